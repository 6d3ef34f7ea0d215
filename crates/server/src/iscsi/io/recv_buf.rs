//! A connection's adaptive receive buffer.

use bytes::{Bytes, BytesMut};
use ironsan_proto::pdu::BHS_LEN;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::io::{AsyncRead, AsyncReadExt};

/// The smallest and largest receive buffer of a connection.
pub(super) const RECV_BUF_MIN: usize = 4 * 1024;
pub(super) const RECV_BUF_MAX: usize = 64 * 1024;

/// Earlier receive buffers a connection may leave held by commands (see [`RecvBuf::take_shared`])
/// before it copies instead of sharing.
pub(super) const RETIRED_MAX: usize = 8;

/// The same bound over the whole process, in bytes.
pub(super) const RETIRED_BYTES_MAX: usize = 64 << 20;

/// Bytes of receive buffers that connections have moved on from while commands still hold
/// part of them ([`RecvBuf::take_shared`]).
pub(super) static RETIRED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// A connection's receive buffer: many PDUs per `recv` when the initiator is busy, little
/// memory when it is not. It starts at 4 KiB, doubles (to 64 KiB) whenever a `recv` fills it,
/// and halves again once it has been mostly empty for a while, so an idle session holds
/// 4 KiB instead of a 64 KiB buffer. A read at least as large as the buffer, with
/// nothing buffered, goes straight into the caller's memory (large Data-Out payloads).
///
/// After a read of [`RECV_BUF_MAX`] or more, the next few small reads (the next PDU's header,
/// digests) also go straight to the caller instead of filling the buffer: a fill there would
/// take up to 64 KiB of the next large payload with it, and that part would then be copied a
/// second time, from this buffer into the payload's destination (11 % of the target's CPU at
/// 512 KiB writes).
/// A stream of small PDUs goes back to buffered fills after [`DIRECT_AFTER_LARGE`] reads.
///
/// A data segment already received whole can be handed out without a copy
/// ([`take_shared`](Self::take_shared)): a slice of this buffer. The next fill reuses the buffer
/// when no such slice is left, and otherwise moves to a new one, keeping a handle on the old
/// until its last slice is dropped. At most [`RETIRED_MAX`] such buffers per connection and
/// [`RETIRED_BYTES_MAX`] in the process are held that way; past that, data is copied.
#[derive(Debug)]
pub struct RecvBuf<R> {
    pub(super) inner: R,
    /// The bytes received and not yet consumed.
    pub(super) buf: BytesMut,
    /// How much a fill asks for (from `RECV_BUF_MIN` to `RECV_BUF_MAX`).
    size: usize,
    /// The size of the allocation `buf` lives in.
    alloc: usize,
    /// Consecutive fills that used less than an eighth of the buffer.
    sparse_fills: u32,
    /// Small reads still to be done straight into the caller's memory (see above).
    pub(super) direct_left: u8,
    /// A handle on the current allocation once part of it was handed out.
    lent: Option<Bytes>,
    /// Earlier allocations still held by commands: a handle on each and its size.
    retired: Vec<(Bytes, usize)>,
}

/// How many small reads after a large one skip the buffer: header, header digest, data
/// digest and the next header cover a Data-Out PDU with both digests on.
pub(super) const DIRECT_AFTER_LARGE: u8 = 4;

impl<R> Drop for RecvBuf<R> {
    fn drop(&mut self) {
        let held: usize = self.retired.iter().map(|(_, n)| n).sum();
        RETIRED_BYTES.fetch_sub(held, Ordering::Relaxed);
    }
}

impl<R: AsyncRead + Unpin> RecvBuf<R> {
    pub fn new(inner: R) -> Self {
        RecvBuf {
            inner,
            buf: BytesMut::with_capacity(RECV_BUF_MIN),
            size: RECV_BUF_MIN,
            alloc: RECV_BUF_MIN,
            sparse_fills: 0,
            direct_left: 0,
            lent: None,
            retired: Vec::new(),
        }
    }

    /// The reader underneath.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// The bytes received and not yet consumed.
    pub fn buffer(&self) -> &[u8] {
        &self.buf
    }

    /// How much a fill asks for: the buffer's current size.
    pub fn capacity(&self) -> usize {
        self.size
    }

    /// Earlier buffers this connection still has held by commands.
    #[cfg(test)]
    pub(super) fn retired(&self) -> usize {
        self.retired.len()
    }

    /// Hand out the next `n` buffered bytes as a slice of the buffer, without copying them.
    /// `None` when fewer are buffered, or when too many old buffers are still held (the
    /// caller then copies).
    pub fn take_shared(&mut self, n: usize) -> Option<Bytes> {
        if n == 0
            || self.buf.len() < n
            || self.retired.len() >= RETIRED_MAX
            || RETIRED_BYTES.load(Ordering::Relaxed) >= RETIRED_BYTES_MAX
        {
            return None;
        }
        let data = self.buf.split_to(n).freeze();
        if self.lent.is_none() {
            self.lent = Some(data.slice(..1));
        }
        Some(data)
    }

    /// Make room for a fill of an empty buffer: reuse the allocation unless a slice of it is
    /// still held, drop old buffers no longer held, and follow the size.
    fn prepare_fill(&mut self) {
        debug_assert!(self.buf.is_empty());
        if !self.retired.is_empty() {
            let mut freed = 0;
            self.retired.retain(|(h, n)| {
                let held = !h.is_unique();
                if !held {
                    freed += n;
                }
                held
            });
            RETIRED_BYTES.fetch_sub(freed, Ordering::Relaxed);
        }
        if let Some(h) = self.lent.take() {
            self.buf = BytesMut::new();
            match h.try_into_mut() {
                Ok(mut m) => {
                    m.clear();
                    self.buf = m;
                }
                Err(h) => {
                    RETIRED_BYTES.fetch_add(self.alloc, Ordering::Relaxed);
                    self.retired.push((h, self.alloc));
                    self.alloc = 0;
                }
            }
        }
        if self.sparse_fills >= 64 && self.size > RECV_BUF_MIN {
            self.size /= 2;
            self.sparse_fills = 0;
            // A smaller allocation replaces this one just below.
            self.alloc = 0;
        }
        if self.alloc < self.size {
            self.buf = BytesMut::with_capacity(self.size);
            self.alloc = self.size;
        } else {
            // Back to the start of the allocation (nothing is buffered: no copy).
            self.buf.reserve(self.size);
        }
    }

    /// Follow the size after a fill of `n` bytes into `room`.
    fn after_fill(&mut self, n: usize, room: usize) {
        if n >= room && self.size < RECV_BUF_MAX {
            // Full: there is more waiting; the next fills take twice as much.
            self.size *= 2;
            self.sparse_fills = 0;
        } else if n < self.size / 8 {
            self.sparse_fills = self.sparse_fills.saturating_add(1);
        } else {
            self.sparse_fills = 0;
        }
    }

    fn poll_fill(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::future::Future;
        self.prepare_fill();
        let room = self.buf.capacity();
        // `read_buf` fills the spare capacity without zeroing it first; the future holds no
        // state of its own, so making one per poll is cancel-safe.
        let n = {
            let fut = AsyncReadExt::read_buf(&mut self.inner, &mut self.buf);
            let fut = std::pin::pin!(fut);
            std::task::ready!(fut.poll(cx))?
        };
        self.after_fill(n, room);
        std::task::Poll::Ready(Ok(()))
    }
}

impl<R: AsyncRead + Unpin> RecvBuf<R> {
    /// Bytes a whole header takes (BHS, AHS, header digest), as far as the buffer tells: the
    /// BHS alone until its AHS length is here.
    fn header_len(&self, header_digest: bool) -> usize {
        let ahs = self.buf.get(4).map_or(0, |&words| usize::from(words) * 4);
        BHS_LEN + ahs + if header_digest { 4 } else { 0 }
    }

    /// Wait until a whole PDU header is buffered, reading into the buffer only, so that
    /// dropping the future loses no byte (cancel-safe: a connection waits for its next header
    /// in a `select!` with its close and wake-up signals). `Ok(false)` at end of stream.
    /// Right after a large payload (see the type's docs) only what the header needs is read,
    /// so the next payload still goes straight to its destination.
    pub async fn header_buffered(&mut self, header_digest: bool) -> std::io::Result<bool> {
        std::future::poll_fn(|cx| self.poll_header_buffered(cx, header_digest)).await
    }

    fn poll_header_buffered(
        &mut self,
        cx: &mut std::task::Context<'_>,
        header_digest: bool,
    ) -> std::task::Poll<std::io::Result<bool>> {
        use bytes::BufMut;
        use std::future::Future;
        loop {
            let need = self.header_len(header_digest);
            if self.buf.len() >= need {
                return std::task::Poll::Ready(Ok(true));
            }
            if self.buf.is_empty() && self.direct_left == 0 {
                std::task::ready!(self.poll_fill(cx))?;
                if self.buf.is_empty() {
                    return std::task::Poll::Ready(Ok(false));
                }
                continue;
            }
            if self.buf.is_empty() {
                self.prepare_fill();
            }
            let missing = need - self.buf.len();
            let want = if self.direct_left > 0 {
                missing
            } else {
                missing.max(self.size)
            };
            self.buf.reserve(want);
            let n = {
                let mut limited = (&mut self.buf).limit(want);
                let fut = AsyncReadExt::read_buf(&mut self.inner, &mut limited);
                let fut = std::pin::pin!(fut);
                std::task::ready!(fut.poll(cx))?
            };
            if n == 0 {
                return std::task::Poll::Ready(Ok(false));
            }
        }
    }
}

impl RecvBuf<tokio::net::tcp::OwnedReadHalf> {
    /// Receive without waiting into an empty buffer (busy polling): `Ok(0)` at end of stream,
    /// `WouldBlock` when nothing is there.
    pub fn try_fill(&mut self) -> std::io::Result<usize> {
        if !self.buf.is_empty() {
            return Ok(self.buf.len());
        }
        self.prepare_fill();
        let room = self.buf.capacity();
        let n = self.inner.try_read_buf(&mut self.buf)?;
        self.after_fill(n, room);
        Ok(n)
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for RecvBuf<R> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        dst: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use bytes::Buf;
        let me = self.get_mut();
        if me.buf.is_empty() {
            let want = dst.remaining();
            if want >= me.size || me.direct_left > 0 {
                std::task::ready!(std::pin::Pin::new(&mut me.inner).poll_read(cx, dst))?;
                me.direct_left = if want >= RECV_BUF_MAX {
                    DIRECT_AFTER_LARGE
                } else {
                    me.direct_left.saturating_sub(1)
                };
                return std::task::Poll::Ready(Ok(()));
            }
            std::task::ready!(me.poll_fill(cx))?;
        }
        let n = dst.remaining().min(me.buf.len());
        dst.put_slice(&me.buf[..n]);
        me.buf.advance(n);
        std::task::Poll::Ready(Ok(()))
    }
}
