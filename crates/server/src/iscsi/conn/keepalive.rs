//! Target-initiated NOP-In pings (RFC 7143 §11.19): the timer side of
//! [`ironsan_proto::keepalive::Keepalive`], on its own task so the reader's per-PDU path only
//! stores the time of the last receive.

use crate::iscsi::session::{Close, Session};
use crate::iscsi::writer::{self, Out, OutPdu};
use crate::metrics::Stamp;
use bytes::Bytes;
use ironsan_proto::keepalive::Keepalive;
use ironsan_proto::session::ConnId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Ping after `interval` without traffic; close the connection if nothing arrives within
/// `timeout` of the ping. `last_rx` is the reader's last receive, in ms since `epoch`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run(
    tx: writer::Queue,
    last_rx: Arc<AtomicU64>,
    epoch: Stamp,
    interval: Duration,
    timeout: Duration,
    session: Arc<Session>,
    id: ConnId,
    cid: u16,
) {
    let now = || Stamp::now().since(epoch) / 1_000_000;
    let mut k = Keepalive::new(interval.as_millis() as u64, timeout.as_millis() as u64);
    let Some(mut next) = k.first_deadline(now()) else {
        return;
    };
    loop {
        tokio::time::sleep(Duration::from_millis(next.saturating_sub(now()))).await;
        let a = k.on_timer(now(), last_rx.load(Ordering::Relaxed));
        if let Some(ping) = a.ping {
            let out = Out::Pdus(vec![OutPdu::current(ping, Bytes::new())]);
            if tx.send(out).await.is_err() {
                return;
            }
        }
        if a.close {
            tracing::warn!(initiator = %session.initiator_name, tsih = session.tsih.0, cid, "initiator did not answer NOP-In within {timeout:?}; closing");
            session.with_conns(|conns| {
                if let Some(c) = conns.iter().find(|c| c.id == id) {
                    c.payload.close(Close::NopTimeout);
                }
            });
            return;
        }
        match a.next {
            Some(n) => next = n,
            None => return,
        }
    }
}
