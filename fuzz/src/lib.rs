//! Helpers shared by the fuzz targets: a tiny `block_on`, a PDU reader over a byte slice that
//! applies the same bounds as the server's reader (`crates/server/src/iscsi/io.rs`), and fixtures.

use bytes::Bytes;
use ironsan_proto::pdu::{Bhs, Header, Pdu, BHS_LEN};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

struct ThreadWaker(Thread);
impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Run a future to completion on this thread (backends may complete on their I/O pool).
pub fn block_on<F: Future>(f: F) -> F::Output {
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// One PDU as the server's reader would see it, or why reading stopped.
pub enum Wire {
    Pdu(Bhs, Pdu),
    /// DataSegmentLength above the phase limit: the server closes the connection.
    TooLong,
    /// Not enough bytes left: the server would wait (and time out).
    Short,
}

/// Read the next PDU from `input` (no digests), bounding the data segment by `max_data` as
/// `Bhs::plan` does before anything is allocated.
pub fn next_pdu(input: &mut &[u8], max_data: u32) -> Wire {
    if input.len() < BHS_LEN {
        return Wire::Short;
    }
    let mut bhs = Bhs::default();
    bhs.0.copy_from_slice(&input[..BHS_LEN]);
    let plan = match bhs.plan(false, false, max_data) {
        Ok(p) => p,
        Err(e) => {
            assert!(e.data_len > max_data);
            return Wire::TooLong;
        }
    };
    assert!(plan.data_len <= max_data as usize);
    assert_eq!(plan.ahs_len, bhs.ahs_len());
    assert!(plan.ahs_len <= 255 * 4);
    assert_eq!((plan.data_len + plan.pad_len) % 4, 0);
    let rest = &input[BHS_LEN..];
    if rest.len() < plan.total() {
        *input = &[];
        return Wire::Short;
    }
    let ahs = Bytes::copy_from_slice(&rest[..plan.ahs_len]);
    let d0 = plan.ahs_len + plan.header_digest_len;
    let data = Bytes::copy_from_slice(&rest[d0..d0 + plan.data_len]);
    *input = &rest[plan.total()..];
    let pdu = Pdu {
        header: Header::decode(&bhs),
        ahs,
        data,
    };
    Wire::Pdu(bhs, pdu)
}
