//! The writer task of a connection: the only place that assigns StatSN and stamps
//! ExpCmdSN/MaxCmdSN (RFC 7143 §4.2.2.2, §11.4.8), so numbers always go out in order. It drains
//! its queue and sends everything ready in one vectored write (batching).

use crate::io::{Digests, WriteBatch};
use crate::metrics::Timing;
use crate::session::Session;
use bytes::Bytes;
use ironsan_proto::pdu::{Header, Pdu, TargetSn};
use ironsan_proto::StatSn;
use std::sync::Arc;
use tokio::io::AsyncWrite;
use tokio::sync::mpsc;

/// How a PDU relates to StatSN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnMode {
    /// Carries a status: gets the next StatSN.
    Status,
    /// Carries the current StatSN without advancing it (R2T, Data-In without status,
    /// target-initiated NOP-In).
    Current,
}

/// One PDU for the writer.
#[derive(Debug)]
pub struct OutPdu {
    pub header: Header,
    pub data: Bytes,
    pub mode: SnMode,
}

impl OutPdu {
    pub fn status(header: Header, data: Bytes) -> Self {
        OutPdu {
            header,
            data,
            mode: SnMode::Status,
        }
    }
    pub fn current(header: Header, data: Bytes) -> Self {
        OutPdu {
            header,
            data,
            mode: SnMode::Current,
        }
    }
}

/// Messages to the writer, processed in order.
#[derive(Debug)]
pub enum Out {
    /// PDUs sent back to back (e.g. a read's Data-In and its status).
    Pdus(Vec<OutPdu>),
    /// A SCSI command's response (Data-In and/or status), optionally holding part of the
    /// connection's transmit budget (returned once written), with the command's stage stamps: once the write that carries the status has returned,
    /// the writer stamps "written" and records the stages (see [`crate::metrics`]).
    Command {
        pdus: Vec<OutPdu>,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
        timing: Option<Timing>,
    },
    /// From now on, stamp sequence numbers from this session's window.
    Attach(Arc<Session>),
    /// From now on, use these digests (set after the final login response).
    Digests(Digests),
    /// Flush and close the socket after everything before this message.
    Close,
    /// Several of the above, in order (what a connection's reader produced in one go).
    Batch(Vec<Out>),
}

impl Out {
    /// Bytes of data segments carried (to size batches).
    pub fn data_len(&self) -> usize {
        match self {
            Out::Pdus(pdus) | Out::Command { pdus, .. } => pdus.iter().map(|p| p.data.len()).sum(),
            Out::Batch(v) => v.iter().map(Out::data_len).sum(),
            _ => 0,
        }
    }
}

/// Where a target PDU keeps its TargetSn.
fn target_sn(h: &mut Header) -> Option<&mut TargetSn> {
    match h {
        Header::NopIn(p) => Some(&mut p.sn),
        Header::ScsiResponse(p) => Some(&mut p.sn),
        Header::TaskMgmtResponse(p) => Some(&mut p.sn),
        Header::LoginResponse(p) => Some(&mut p.sn),
        Header::TextResponse(p) => Some(&mut p.sn),
        Header::DataIn(p) => Some(&mut p.sn),
        Header::LogoutResponse(p) => Some(&mut p.sn),
        Header::R2t(p) => Some(&mut p.sn),
        Header::AsyncMessage(p) => Some(&mut p.sn),
        Header::Reject(p) => Some(&mut p.sn),
        _ => None,
    }
}

/// Counters the writer keeps for the admin view.
#[derive(Debug, Default)]
pub struct TxStats {
    pub pdus: std::sync::atomic::AtomicU64,
    pub bytes: std::sync::atomic::AtomicU64,
}

/// Stamp sequence numbers on `pdus` and add them to the batch.
fn push(
    pdus: Vec<OutPdu>,
    batch: &mut WriteBatch,
    stat_sn: &mut StatSn,
    session: &Option<Arc<Session>>,
    digests: Digests,
    stats: &TxStats,
) {
    for mut p in pdus {
        let window = session.as_ref().map(|s| s.window_sn());
        if let Some(sn) = target_sn(&mut p.header) {
            sn.stat_sn = *stat_sn;
            if let Some((exp, max)) = window {
                sn.exp_cmd_sn = exp;
                sn.max_cmd_sn = max;
            }
        }
        if p.mode == SnMode::Status {
            *stat_sn = stat_sn.next();
        }
        let pdu = Pdu::new(p.header, p.data);
        let bhs = pdu.bhs();
        batch.push(&bhs, pdu.data, digests);
        stats
            .pdus
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Run the writer until the queue closes, a `Close` arrives, or the socket fails.
pub async fn run<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::Receiver<Out>,
    first_stat_sn: StatSn,
    stats: Arc<TxStats>,
) -> std::io::Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    let mut stat_sn = first_stat_sn;
    let mut session: Option<Arc<Session>> = None;
    let mut digests = Digests::default();
    let mut batch = WriteBatch::default();
    const BATCH_BYTES: usize = 1 << 20;
    let mut held = Vec::new();
    // Stamps of the commands whose status is in the batch (reused: no allocation per batch).
    let mut timed: Vec<Timing> = Vec::new();
    // Messages unpacked from a batch, ahead of anything still in the channel.
    let mut unpacked: std::collections::VecDeque<Out> = std::collections::VecDeque::new();
    loop {
        let first = match unpacked.pop_front() {
            Some(m) => m,
            None => match rx.recv().await {
                Some(m) => m,
                None => break,
            },
        };
        let mut next = Some(first);
        let mut close = false;
        while let Some(msg) = next.take() {
            match msg {
                Out::Pdus(pdus) => push(pdus, &mut batch, &mut stat_sn, &session, digests, &stats),
                Out::Command {
                    pdus,
                    permit,
                    timing,
                } => {
                    push(pdus, &mut batch, &mut stat_sn, &session, digests, &stats);
                    held.extend(permit);
                    timed.extend(timing);
                }
                Out::Attach(s) => session = Some(s),
                Out::Digests(d) => {
                    // Everything queued so far was negotiated without digests.
                    if !batch.is_empty() {
                        stats.bytes.fetch_add(batch.len() as u64, Relaxed);
                        batch.flush(&mut w).await?;
                    }
                    digests = d;
                }
                Out::Close => close = true,
                Out::Batch(v) => {
                    for m in v.into_iter().rev() {
                        unpacked.push_front(m);
                    }
                }
            }
            if close || batch.len() >= BATCH_BYTES {
                break;
            }
            next = unpacked.pop_front().or_else(|| rx.try_recv().ok());
        }
        if !batch.is_empty() {
            stats.bytes.fetch_add(batch.len() as u64, Relaxed);
            batch.flush(&mut w).await?;
        }
        // Written: the reads' transmit budget is free again.
        held.clear();
        if !timed.is_empty() {
            let now = std::time::Instant::now();
            for t in timed.drain(..) {
                t.written(now);
            }
        }
        if close {
            break;
        }
    }
    Ok(())
}
