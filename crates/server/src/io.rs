//! PDU framing over a byte stream: the only place that turns bytes on a socket into
//! [`Pdu`]s and back. Lengths are bounded by the [`ReceivePlan`] before anything is read;
//! digests are checked and computed here (CRC32C over header and data, padding included).

use bytes::{Bytes, BytesMut};
use ironsan_backend::{FileRange, InPlaceWrite};
use ironsan_proto::digest;
use ironsan_proto::pdu::{pad_len, Bhs, Header, Pdu, ReceivePlan, BHS_LEN};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::io::{AsyncRead, AsyncReadExt};

/// Digest settings of a connection, one per direction as negotiated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

/// Why a PDU could not be read. `Io` is fatal to the connection, and `HeaderDigest` below
/// ErrorRecoveryLevel 1 (the length can no longer be trusted); the others allow a Reject.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("connection closed")]
    Closed,
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The header digest did not match: with where the PDU's data would end if its length
    /// field is right (`None`: the damaged header describes no valid PDU).
    #[error("header digest error")]
    HeaderDigest(Option<ReceivePlan>),
    #[error("data segment too long: {0}")]
    TooLong(#[from] ironsan_proto::pdu::LengthError),
    /// The data digest did not match; the header is returned so the caller can Reject it.
    #[error("data digest error")]
    DataDigest(Bhs),
}

/// A received PDU with its raw BHS (kept for Reject replies).
#[derive(Debug)]
pub struct Received {
    pub bhs: Bhs,
    pub pdu: Pdu,
}

/// Read the BHS, AHS and header digest of one PDU. Returns the BHS, the AHS bytes and the
/// receive plan; the caller then reads the data segment with [`read_data`] (possibly straight
/// into its own buffer with [`read_data_into`]).
pub async fn read_header<R: AsyncRead + Unpin>(
    r: &mut R,
    digests: Digests,
    max_data: u32,
) -> Result<(Bhs, Bytes, ReceivePlan), ReadError> {
    let mut bhs = Bhs::default();
    match r.read_exact(&mut bhs.0).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(ReadError::Closed),
        Err(e) => return Err(e.into()),
    }
    // The AHS length is checked by the plan's arithmetic (at most 255*4 bytes); the header
    // digest covers BHS + AHS, so verify it before trusting the data length.
    let ahs_len = bhs.ahs_len();
    let mut ahs = BytesMut::zeroed(ahs_len);
    r.read_exact(&mut ahs).await?;
    if digests.header {
        let mut d = [0u8; 4];
        r.read_exact(&mut d).await?;
        let crc = digest::crc32c_append(digest::crc32c(&bhs.0), &ahs);
        if crc != u32::from_le_bytes(d) {
            return Err(ReadError::HeaderDigest(
                bhs.plan(digests.header, digests.data, max_data).ok(),
            ));
        }
    }
    let plan = bhs.plan(digests.header, digests.data, max_data)?;
    Ok((bhs, ahs.freeze(), plan))
}

/// Read a data segment described by `plan` into `dst` (exactly `plan.data_len` bytes), then
/// its padding and digest. On a data digest mismatch returns `Ok(false)`.
pub async fn read_data_into<R: AsyncRead + Unpin>(
    r: &mut R,
    plan: &ReceivePlan,
    dst: &mut [u8],
) -> std::io::Result<bool> {
    debug_assert_eq!(dst.len(), plan.data_len);
    r.read_exact(dst).await?;
    check_tail(r, plan, dst).await
}

/// Read a data segment into `buf` at `offset`. A segment that continues the buffer (the
/// usual case: Data-Out in order) is appended straight into its spare capacity, so the buffer
/// is never zeroed first; one that lands elsewhere is written in place (the gap read as zeros
/// until its own segment arrives). `false` on a data digest mismatch.
pub async fn read_data_at<R: AsyncRead + Unpin>(
    r: &mut R,
    plan: &ReceivePlan,
    buf: &mut BytesMut,
    offset: usize,
) -> std::io::Result<bool> {
    use bytes::BufMut;
    let len = plan.data_len;
    if offset != buf.len() {
        if buf.len() < offset + len {
            buf.resize(offset + len, 0);
        }
        return read_data_into(r, plan, &mut buf[offset..offset + len]).await;
    }
    buf.reserve(len);
    while buf.len() < offset + len {
        let want = offset + len - buf.len();
        if r.read_buf(&mut (&mut *buf).limit(want)).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    check_tail(r, plan, &buf[offset..]).await
}

/// Take a data segment that is already in the receive buffer as a slice of it (no copy),
/// then read its pad and digest; `None` (nothing read) when it is not all buffered or the
/// buffer may not lend more (see [`RecvBuf::take_shared`]). The flag is `false` on a data
/// digest mismatch.
pub async fn read_data_shared<R: AsyncRead + Unpin>(
    r: &mut RecvBuf<R>,
    plan: &ReceivePlan,
) -> std::io::Result<Option<(Bytes, bool)>> {
    let Some(data) = r.take_shared(plan.data_len) else {
        return Ok(None);
    };
    let ok = check_tail(r, plan, &data).await?;
    Ok(Some((data, ok)))
}

/// Where a write received in place puts its bytes: the file itself ([`InPlaceWrite`]), or,
/// for a write waiting for its Data-Out, a slot that an abort from any task can empty
/// (`session::PlacedSlot`), after which nothing more is put.
pub trait PlaceTarget {
    /// The logical block size: bytes reach the medium a whole block at a time.
    fn grain(&self) -> usize;
    /// Run `f` on the write's destination; an error if the write is gone (aborted).
    fn with<T>(&self, f: impl FnOnce(&InPlaceWrite) -> std::io::Result<T>) -> std::io::Result<T>;
}

impl PlaceTarget for InPlaceWrite {
    fn grain(&self) -> usize {
        InPlaceWrite::grain(self)
    }
    fn with<T>(&self, f: impl FnOnce(&InPlaceWrite) -> std::io::Result<T>) -> std::io::Result<T> {
        f(self)
    }
}

/// Receive at most `max` bytes from `src` (a socket) without waiting, straight into the
/// file's pages under bytes `at ..` of `w` ([`InPlaceWrite::mapped`]), and only whole grains
/// ([`InPlaceWrite::grain`]) of what is there (all `max` bytes if they are). `Ok(0)`: less
/// than a grain (and less than `max`) is there, which the caller receives through memory;
/// `WouldBlock`: nothing is there; `UnexpectedEof`: the stream ended. Asking past the write's
/// end is `InvalidInput`; another error is the socket's or the medium's (EFAULT: the file was
/// cut short), and the bytes stay in the socket.
pub fn recv_in_place(
    w: &InPlaceWrite,
    src: std::os::fd::BorrowedFd<'_>,
    at: usize,
    max: usize,
) -> std::io::Result<usize> {
    let dest = w.mapped(at, max)?;
    let ready = crate::sys::bytes_readable(src)?;
    let n = if ready >= max {
        max
    } else {
        ready - ready % w.grain()
    };
    if n > 0 {
        return crate::sys::recv_into(src, dest.first(n));
    }
    if ready > 0 {
        return Ok(0);
    }
    // Nothing counted: let the socket itself say whether that is "wait" (which clears the
    // caller's readiness correctly), the end, an error, or bytes just arrived.
    match crate::sys::peek_byte(src)? {
        false => Err(std::io::ErrorKind::UnexpectedEof.into()),
        true => Ok(0),
    }
}

/// The Data-Out of one write received in place ([`InPlaceWrite`]), a whole logical block at a
/// time: a block reaches the medium only once all its bytes are here, so a transfer broken
/// off (a TCP reset, an abort) leaves each block all old or all new, never torn. Blocks that
/// lie wholly in a segment go straight from the socket into the file; the bytes of a block
/// split between segments wait here until the block is complete.
#[derive(Debug, Default)]
pub struct Placement {
    /// Blocks begun and not yet complete: (byte offset in the write, the block's bytes so
    /// far as a block-sized buffer, how many of them arrived).
    partial: Vec<(usize, Vec<u8>, usize)>,
}

impl Placement {
    /// Take `data`, bytes `at ..` of the write: whole blocks are written at once, the rest
    /// kept until its block is complete.
    pub fn put(
        &mut self,
        target: &impl PlaceTarget,
        at: usize,
        data: &[u8],
    ) -> std::io::Result<()> {
        let grain = target.grain();
        let (mut pos, end) = (at, at + data.len());
        while pos < end {
            let block = pos - pos % grain;
            let n = (block + grain).min(end) - pos;
            if n == grain {
                // A whole block (and the ones after it) in this piece.
                let whole = (end - pos) - (end - pos) % grain;
                target.with(|t| t.write_at(pos, &data[pos - at..pos - at + whole]))?;
                pos += whole;
                continue;
            }
            let i = match self.partial.iter().position(|p| p.0 == block) {
                Some(i) => i,
                None => {
                    self.partial.push((block, vec![0u8; grain], 0));
                    self.partial.len() - 1
                }
            };
            let p = &mut self.partial[i];
            p.1[pos - block..pos - block + n].copy_from_slice(&data[pos - at..pos - at + n]);
            p.2 += n;
            if p.2 >= grain {
                let (b, bytes, _) = self.partial.swap_remove(i);
                target.with(|t| t.write_at(b, &bytes))?;
            }
            pos += n;
        }
        Ok(())
    }

    /// Whether a block is still waiting for bytes (never once the transfer is complete).
    pub fn is_pending(&self) -> bool {
        !self.partial.is_empty()
    }

    /// Receive a data segment (no data digest) for bytes `at ..` of the write: what is in
    /// the receive buffer and the ends of blocks split with other segments through
    /// [`put`](Self::put), every whole block still in the socket copied by the kernel straight
    /// into the file ([`recv_in_place`]); should that copy fail, the rest is received
    /// into memory and written from there. The outer error ends the connection; the inner one
    /// is the medium's (a write failed, e.g. tmpfs is full): the rest of the segment is then
    /// read and dropped, so the stream stays in step, and the caller fails the command.
    pub async fn receive(
        &mut self,
        r: &mut RecvBuf<tokio::net::tcp::OwnedReadHalf>,
        plan: &ReceivePlan,
        target: &impl PlaceTarget,
        at: usize,
    ) -> std::io::Result<Result<(), std::io::Error>> {
        use std::os::fd::AsFd;
        let grain = target.grain();
        let (len, end) = (plan.data_len, at + plan.data_len);
        let mut failed = None;
        if plan.data_digest_len != 0 {
            failed = Some(std::io::Error::other("data digest: not received in place"));
        }
        let mut pos = at;
        while pos < end && failed.is_none() {
            // Bytes already in the receive buffer first (reading a short piece below may
            // have filled it with more of the segment): the socket holds what follows them.
            let buffered = r.buf.len().min(end - pos);
            if buffered > 0 {
                failed = self.put(target, pos, &r.buf[..buffered]).err();
                bytes::Buf::advance(&mut r.buf, buffered);
                pos += buffered;
                continue;
            }
            // Whole blocks still in the socket go straight into the file; the rest of a block
            // begun elsewhere, a last piece shorter than a block, or less than a block waiting
            // (`Ok(0)`) come through memory, where a block waits for its last byte.
            let whole = if pos.is_multiple_of(grain) {
                (end - pos) - (end - pos) % grain
            } else {
                0
            };
            let to_memory = if whole == 0 {
                Some((grain - pos % grain).min(end - pos))
            } else {
                let stream = r.inner.as_ref();
                match stream.try_io(tokio::io::Interest::READABLE, || {
                    target.with(|t| recv_in_place(t, stream.as_fd(), pos, whole))
                }) {
                    Ok(0) => Some((grain - pos % grain).min(end - pos)),
                    Ok(n) => {
                        pos += n;
                        None
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(e),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        stream.readable().await?;
                        None
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => None,
                    // The kernel could not copy into the file's pages (EFAULT: the file was
                    // cut short behind our back, or tmpfs is full): the rest through memory,
                    // written as any write is, which extends the file or says why not.
                    Err(_) => Some(end - pos),
                }
            };
            if let Some(n) = to_memory {
                let mut piece = vec![0u8; n];
                r.read_exact(&mut piece).await?;
                failed = self.put(target, pos, &piece).err();
                pos += n;
            }
        }
        if pos < end {
            skip_bytes(r, end - pos).await?;
        }
        if len >= RECV_BUF_MAX {
            // As after any large payload read past the buffer: the next header is read alone.
            r.direct_left = DIRECT_AFTER_LARGE;
        }
        let mut tail = [0u8; 8];
        let tail_len = plan.pad_len + plan.data_digest_len;
        r.read_exact(&mut tail[..tail_len]).await?;
        Ok(match failed {
            Some(e) => Err(e),
            None => Ok(()),
        })
    }
}

/// Read the pad and data digest after a data segment and check the digest.
async fn check_tail<R: AsyncRead + Unpin>(
    r: &mut R,
    plan: &ReceivePlan,
    data: &[u8],
) -> std::io::Result<bool> {
    let mut tail = [0u8; 8];
    let tail_len = plan.pad_len + plan.data_digest_len;
    r.read_exact(&mut tail[..tail_len]).await?;
    if plan.data_digest_len == 4 {
        let crc = digest::crc32c_append(digest::crc32c(data), &tail[..plan.pad_len]);
        let got = u32::from_le_bytes([
            tail[plan.pad_len],
            tail[plan.pad_len + 1],
            tail[plan.pad_len + 2],
            tail[plan.pad_len + 3],
        ]);
        return Ok(crc == got);
    }
    Ok(true)
}

/// Read and throw away a data segment (e.g. Data-Out for a task that no longer exists).
pub async fn skip_data<R: AsyncRead + Unpin>(r: &mut R, plan: &ReceivePlan) -> std::io::Result<()> {
    skip_bytes(r, plan.data_len + plan.pad_len + plan.data_digest_len).await
}

/// Read and throw away `left` bytes.
async fn skip_bytes<R: AsyncRead + Unpin>(r: &mut R, mut left: usize) -> std::io::Result<()> {
    let mut scratch = [0u8; 4096];
    while left > 0 {
        let n = left.min(scratch.len());
        r.read_exact(&mut scratch[..n]).await?;
        left -= n;
    }
    Ok(())
}

/// Read one whole PDU (header and data).
pub async fn read_pdu<R: AsyncRead + Unpin>(
    r: &mut R,
    digests: Digests,
    max_data: u32,
) -> Result<Received, ReadError> {
    let (bhs, ahs, plan) = read_header(r, digests, max_data).await?;
    let mut data = BytesMut::zeroed(plan.data_len);
    if !read_data_into(r, &plan, &mut data).await? {
        return Err(ReadError::DataDigest(bhs));
    }
    Ok(Received {
        bhs,
        pdu: Pdu {
            header: Header::decode(&bhs),
            ahs,
            data: data.freeze(),
        },
    })
}

/// Encoded PDUs waiting to be written in one vectored write.
#[derive(Debug, Default)]
pub struct WriteBatch {
    /// Headers, digests and padding live here; data segments are referenced, not copied.
    parts: Vec<Part>,
    bytes: usize,
    /// Of `bytes`, those in file ranges.
    file_bytes: usize,
    /// Write progress: the first part not yet fully written and how much of it was.
    part: usize,
    off: usize,
    /// A data segment could not be made (its file range could not be read for the digest):
    /// the next write fails with this and the connection closes.
    failed: Option<std::io::Error>,
}

#[derive(Debug)]
enum Part {
    Small([u8; BHS_LEN + 4], usize),
    Tail([u8; 8], usize),
    Data(Bytes),
    /// Zero-copy Data-In: sent with `sendfile` from the page cache, or, when the range carries
    /// a mapping of its file, named by an iovec into it in the vectored write.
    File(FileRange),
}

impl Part {
    /// The bytes of an in-memory part (empty for a file range).
    fn as_slice(&self) -> &[u8] {
        match self {
            Part::Small(b, n) => &b[..*n],
            Part::Tail(b, n) => &b[..*n],
            Part::Data(d) => d,
            Part::File(_) => &[],
        }
    }
    fn len(&self) -> usize {
        match self {
            Part::File(r) => r.len,
            p => p.as_slice().len(),
        }
    }
    /// Add the part from byte `skip` on to a vectored send; false (nothing added) for a file
    /// range sent with `sendfile`.
    fn send_from<'a>(&'a self, skip: usize, list: &mut crate::sys::SendList<'a>) -> bool {
        match self {
            Part::File(r) => match &r.map {
                Some(m) => list.push_mapped(m, r.offset as usize + skip, r.len - skip),
                None => false,
            },
            p => {
                list.push_slice(&p.as_slice()[skip..]);
                true
            }
        }
    }
}

impl WriteBatch {
    /// Bytes queued.
    pub fn len(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
    /// Bytes queued in file ranges (sent with `sendfile` or from a mapping).
    pub fn file_len(&self) -> usize {
        self.file_bytes
    }

    /// The header (and header digest) of a PDU.
    fn push_header(&mut self, bhs: &Bhs, digests: Digests) {
        let mut head = [0u8; BHS_LEN + 4];
        head[..BHS_LEN].copy_from_slice(&bhs.0);
        let mut n = BHS_LEN;
        if digests.header {
            head[BHS_LEN..].copy_from_slice(&digest::crc32c(&bhs.0).to_le_bytes());
            n += 4;
        }
        self.bytes += n;
        self.parts.push(Part::Small(head, n));
    }

    /// Append one PDU whose data segment is `range` of a file, sent with `sendfile` or from the
    /// range's mapping (no data digest: the caller reads the range into memory when one is on).
    pub fn push_file(&mut self, bhs: &Bhs, range: FileRange, digests: Digests) {
        debug_assert!(!digests.data);
        self.push_header(bhs, digests);
        let pad = pad_len(range.len);
        if range.len == 0 {
            return;
        }
        self.bytes += range.len + pad;
        self.file_bytes += range.len;
        self.parts.push(Part::File(range));
        if pad > 0 {
            self.parts.push(Part::Tail([0u8; 8], pad));
        }
    }

    /// Make the next [`try_write`](Self::try_write) fail with `e` (a data segment that could
    /// not be produced: nothing after it may be sent).
    pub fn fail(&mut self, e: std::io::Error) {
        self.failed.get_or_insert(e);
    }

    /// Append one PDU (BHS already encoded with lengths; no AHS is ever sent by the target).
    pub fn push(&mut self, bhs: &Bhs, data: Bytes, digests: Digests) {
        self.push_header(bhs, digests);
        if data.is_empty() {
            return;
        }
        let pad = pad_len(data.len());
        let mut tail = [0u8; 8];
        let mut t = pad;
        if digests.data {
            tail[pad..pad + 4].copy_from_slice(&digest::data_digest(&[&data]).to_le_bytes());
            t += 4;
        }
        self.bytes += data.len() + t;
        self.parts.push(Part::Data(data));
        if t > 0 {
            self.parts.push(Part::Tail(tail, t));
        }
    }

    /// Write as much as the socket takes without waiting; `Ok(true)` once everything queued
    /// is written (the batch is then empty), `Ok(false)` when the socket is full (call again
    /// when it is writable: progress is kept).
    ///
    /// In-memory parts and mapped file ranges go out in one vectored write; a file range
    /// without a mapping with `sendfile`, the parts before it with MSG_MORE so its header does
    /// not leave as a packet of its own.
    pub fn try_write(&mut self, sock: &tokio::net::tcp::OwnedWriteHalf) -> std::io::Result<bool> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let stream: &tokio::net::TcpStream = sock.as_ref();
        let fd = stream.as_raw_fd();
        while self.part < self.parts.len() {
            let (part, off) = (self.part, self.off);
            let mut file_follows = false;
            let mut iov = crate::sys::SendList::default();
            for (i, p) in self.parts[part..].iter().take(1024).enumerate() {
                if !p.send_from(if i == 0 { off } else { 0 }, &mut iov) {
                    file_follows = true;
                    break;
                }
            }
            // Nothing before the first file range that is not mapped: `sendfile` it.
            if let (true, Part::File(r)) = (iov.is_empty(), &self.parts[part]) {
                let sent = stream.try_io(tokio::io::Interest::WRITABLE, || {
                    crate::sys::sendfile(fd, &r.file, r.offset + off as u64, r.len - off)
                });
                let n = match sent {
                    Ok(0) => return Err(file_cut_short()),
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                };
                if off + n >= r.len {
                    self.part += 1;
                    self.off = 0;
                } else {
                    self.off += n;
                }
                continue;
            }
            let sent = stream.try_io(tokio::io::Interest::WRITABLE, || {
                crate::sys::send_iovecs(stream.as_fd(), &iov, file_follows)
            });
            let mut n = match sent {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // Only a mapped file range can fault: its file no longer reaches that far.
                Err(e) if e.raw_os_error() == Some(libc::EFAULT) => return Err(file_cut_short()),
                Err(e) => return Err(e),
            };
            while n > 0 && self.part < self.parts.len() {
                let left = self.parts[self.part].len() - self.off;
                if n >= left {
                    n -= left;
                    self.part += 1;
                    self.off = 0;
                } else {
                    self.off += n;
                    n = 0;
                }
            }
        }
        self.parts.clear();
        self.bytes = 0;
        self.file_bytes = 0;
        self.part = 0;
        self.off = 0;
        Ok(true)
    }
}

/// A file range's Data-In could not be sent because its backing file no longer reaches that
/// far: its header is already on the wire, so the connection ends rather than send other bytes.
fn file_cut_short() -> std::io::Error {
    tracing::warn!(
        "backing file ended before the Data-In it was to send (cut short behind the target's \
         back?); closing the connection"
    );
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        "backing file ended before the Data-In it was to send",
    )
}

/// The smallest and largest receive buffer of a connection.
const RECV_BUF_MIN: usize = 4 * 1024;
const RECV_BUF_MAX: usize = 64 * 1024;

/// Earlier receive buffers a connection may leave held by commands (see [`RecvBuf::take_shared`])
/// before it copies instead of sharing.
const RETIRED_MAX: usize = 8;

/// The same bound over the whole process, in bytes.
const RETIRED_BYTES_MAX: usize = 64 << 20;

/// Bytes of receive buffers that connections have moved on from while commands still hold
/// part of them ([`RecvBuf::take_shared`]).
static RETIRED_BYTES: AtomicUsize = AtomicUsize::new(0);

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
    inner: R,
    /// The bytes received and not yet consumed.
    buf: BytesMut,
    /// How much a fill asks for (from `RECV_BUF_MIN` to `RECV_BUF_MAX`).
    size: usize,
    /// The size of the allocation `buf` lives in.
    alloc: usize,
    /// Consecutive fills that used less than an eighth of the buffer.
    sparse_fills: u32,
    /// Small reads still to be done straight into the caller's memory (see above).
    direct_left: u8,
    /// A handle on the current allocation once part of it was handed out.
    lent: Option<Bytes>,
    /// Earlier allocations still held by commands: a handle on each and its size.
    retired: Vec<(Bytes, usize)>,
}

/// How many small reads after a large one skip the buffer: header, header digest, data
/// digest and the next header cover a Data-Out PDU with both digests on.
const DIRECT_AFTER_LARGE: u8 = 4;

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
    fn retired(&self) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A new file LUN of `size` bytes on tmpfs, `/dev/shm/ironsan-NAME-PID.img` (the caller
    /// removes it).
    fn shm_file(name: &str, size: u64) -> (std::path::PathBuf, ironsan_backend::FileBackend) {
        let path = std::path::PathBuf::from(format!(
            "/dev/shm/ironsan-{name}-{}.img",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let opts = ironsan_backend::FileOptions {
            size: Some(size),
            ..Default::default()
        };
        let be = ironsan_backend::FileBackend::open(&path, &opts).unwrap();
        (path, be)
    }

    /// Write `batch` to `wr` until it is all written or the write fails.
    async fn write_all(
        batch: &mut WriteBatch,
        wr: &tokio::net::tcp::OwnedWriteHalf,
    ) -> std::io::Result<()> {
        while !batch.try_write(wr)? {
            let s: &tokio::net::TcpStream = wr.as_ref();
            s.writable().await?;
        }
        Ok(())
    }

    /// A file range carrying its tmpfs file's mapping goes out inside the one vectored write,
    /// between the parts around it, byte for byte; a file cut short behind the target's back
    /// fails the write (EFAULT from the kernel's copy, never SIGBUS) after at most the bytes
    /// before the cut, instead of sending other bytes.
    #[tokio::test]
    async fn mapped_file_ranges_go_out_in_the_vectored_write_and_a_cut_file_fails_it() {
        use ironsan_backend::{BlockDevice, SendFrom, WriteMode};
        use tokio::io::AsyncReadExt;
        let (path, be) = shm_file("mapped-send", 4 << 20);
        let data: Vec<u8> = (0..2u32 << 20).map(|i| (i * 7 % 251) as u8).collect();
        be.write(1 << 20, Bytes::from(data.clone()), WriteMode::Cached)
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut got = Vec::new();
            let _ = s.read_to_end(&mut got).await;
            got
        });
        let (sock, _) = listener.accept().await.unwrap();
        let (_rd, wr) = sock.into_split();
        let no = Digests::default();

        let range = be
            .read_in_place(1 << 20, 1 << 20, SendFrom::Mapping.into())
            .unwrap();
        assert!(range.map.is_some());
        let mut batch = WriteBatch::default();
        batch.push(&Bhs([1; BHS_LEN]), Bytes::from_static(b"abc"), no);
        batch.push_file(&Bhs([2; BHS_LEN]), range, no);
        batch.push(&Bhs([3; BHS_LEN]), Bytes::new(), no);
        assert_eq!(batch.file_len(), 1 << 20);
        write_all(&mut batch, &wr).await.unwrap();
        assert!(batch.is_empty());

        // The second MiB, with the file cut half way through it.
        let range = be
            .read_in_place(2 << 20, 1 << 20, SendFrom::Mapping.into())
            .unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len((2 << 20) + (256 << 10))
            .unwrap();
        batch.push_file(&Bhs([4; BHS_LEN]), range, no);
        let err = write_all(&mut batch, &wr).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
        drop(wr);
        drop(_rd);

        let got = client.await.unwrap();
        let mut want = Vec::new();
        want.extend_from_slice(&[1; BHS_LEN]);
        want.extend_from_slice(b"abc\0");
        want.extend_from_slice(&[2; BHS_LEN]);
        want.extend_from_slice(&data[..1 << 20]);
        want.extend_from_slice(&[3; BHS_LEN]);
        want.extend_from_slice(&[4; BHS_LEN]);
        assert!(got.len() >= want.len(), "{} bytes arrived", got.len());
        assert!(
            got[..want.len()] == want[..],
            "the bytes sent are not the file's"
        );
        let rest = &got[want.len()..];
        assert!(
            rest.len() <= 256 << 10 && rest[..] == data[1 << 20..(1 << 20) + rest.len()],
            "after the cut: {} bytes, not all the file's",
            rest.len()
        );
        let _ = std::fs::remove_file(&path);
    }

    /// The receive straight into a file's pages: nothing past the write's end, "wait" when
    /// nothing is there, only whole blocks of what the socket holds (all that was asked when
    /// it is all there), the end of the stream, and EFAULT with the bytes left in the socket
    /// when the file was cut short. A real file on tmpfs and a socket pair.
    #[test]
    fn recv_in_place_takes_whole_blocks_and_says_why_not() {
        use ironsan_backend::BlockDevice;
        use std::io::{ErrorKind, Read, Write};
        use std::os::fd::AsFd;
        let (path, file) = shm_file("recv-in-place", 1 << 20);
        let base = 64 << 10;
        let w = file
            .write_in_place(base, 8192)
            .expect("a tmpfs file takes bytes in place")
            .in_grains_of(512);
        let (mut tx, mut rx) = std::os::unix::net::UnixStream::pair().unwrap();
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 13 % 251) as u8).collect();
        let err = recv_in_place(&w, rx.as_fd(), 8000, 512).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "past the write's end");
        let err = recv_in_place(&w, rx.as_fd(), 0, 4096).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::WouldBlock, "nothing there");
        // 700 bytes: one whole block goes in; less than a block is left for memory.
        tx.write_all(&data[..700]).unwrap();
        assert_eq!(recv_in_place(&w, rx.as_fd(), 0, 4096).unwrap(), 512);
        assert_eq!(recv_in_place(&w, rx.as_fd(), 512, 4096).unwrap(), 0);
        // All that is asked is there: all of it, whole blocks or not.
        tx.write_all(&data[700..4196]).unwrap();
        assert_eq!(recv_in_place(&w, rx.as_fd(), 512, 3584).unwrap(), 3584);
        assert_eq!(recv_in_place(&w, rx.as_fd(), 4096, 100).unwrap(), 100);
        let on_file = std::fs::read(&path).unwrap();
        assert!(on_file[base as usize..base as usize + 4196] == data[..4196]);
        // The file cut short under the write: EFAULT, and the bytes stay in the socket.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(base + 4096)
            .unwrap();
        tx.write_all(&data[4608..5120]).unwrap();
        let err = recv_in_place(&w, rx.as_fd(), 4608, 512).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");
        let mut left = [0u8; 512];
        rx.read_exact(&mut left).unwrap();
        assert!(left[..] == data[4608..5120]);
        drop(tx);
        let err = recv_in_place(&w, rx.as_fd(), 4608, 512).unwrap_err();
        assert_eq!(
            err.kind(),
            ErrorKind::UnexpectedEof,
            "the end of the stream"
        );
        let _ = std::fs::remove_file(&path);
    }

    /// A block reaches the file only once every byte of it has arrived, whatever pieces the
    /// bytes come in (the ends of Data-Out segments); whole blocks go at once. A real file on
    /// tmpfs, checked after every piece.
    #[test]
    fn placement_writes_a_block_only_when_it_is_complete() {
        use ironsan_backend::BlockDevice;
        let (path, file) = shm_file("placement", 1 << 20);
        // 6 blocks at byte 4096 of the file.
        let target = file.write_in_place(4096, 3072).unwrap().in_grains_of(512);
        let data: Vec<u8> = (0..3072u32).map(|i| (i % 251 + 1) as u8).collect();
        let mut p = Placement::default();
        let mut at = 0;
        // Pieces that split blocks 0, 1 and 3 and hold all of block 2 and blocks 4-5.
        for (n, complete) in [(100, 0), (700, 1), (300, 2), (1000, 4), (972, 6)] {
            p.put(&target, at, &data[at..at + n]).unwrap();
            at += n;
            let on_disk = std::fs::read(&path).unwrap();
            let got = &on_disk[4096..4096 + 3072];
            for b in 0..6 {
                let want: &[u8] = if b < complete {
                    &data[b * 512..(b + 1) * 512]
                } else {
                    &[0u8; 512]
                };
                assert!(
                    got[b * 512..(b + 1) * 512] == *want,
                    "after {at} bytes: block {b} (complete blocks: {complete})"
                );
            }
        }
        assert!(!p.is_pending());
        let _ = std::fs::remove_file(&path);
    }

    /// Stream 256 KiB through `rb` in 1 KiB reads (each checked): enough fills of a full
    /// buffer to grow it to its largest.
    async fn grow_to_max(
        tx: &mut tokio::io::DuplexStream,
        rb: &mut RecvBuf<tokio::io::DuplexStream>,
    ) {
        tx.write_all(&vec![3u8; 4 * RECV_BUF_MAX]).await.unwrap();
        let mut piece = [0u8; 1024];
        for _ in 0..4 * RECV_BUF_MAX / 1024 {
            rb.read_exact(&mut piece).await.unwrap();
            assert_eq!(piece, [3u8; 1024]);
        }
    }

    /// Bytes come out exactly as written whatever the mix of small and large reads; the buffer
    /// grows to 64 KiB under a stream that fills it, and shrinks back once reads are sparse.
    #[tokio::test]
    async fn recv_buf_delivers_the_stream_and_adapts_its_size() {
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        let data: Vec<u8> = (0..600_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut rb = RecvBuf::new(rx);
        assert_eq!(rb.capacity(), RECV_BUF_MIN);
        tx.write_all(&data).await.unwrap();
        let mut got = Vec::new();
        let sizes = [48usize, 1, 4096, 13, 70_000, 512, 48, 100_000];
        let mut i = 0;
        while got.len() < data.len() {
            let n = sizes[i % sizes.len()].min(data.len() - got.len());
            let mut b = vec![0u8; n];
            rb.read_exact(&mut b).await.unwrap();
            got.extend_from_slice(&b);
            i += 1;
        }
        assert_eq!(got, data);
        // A stream of small reads that fills the buffer grows it.
        grow_to_max(&mut tx, &mut rb).await;
        assert_eq!(
            rb.capacity(),
            RECV_BUF_MAX,
            "a stream that fills it grows it"
        );
        // Sparse traffic: one 48-byte header per fill.
        for _ in 0..(64 * 5) {
            tx.write_all(&[9u8; 48]).await.unwrap();
            let mut b = [0u8; 48];
            rb.read_exact(&mut b).await.unwrap();
            assert_eq!(b, [9u8; 48]);
        }
        assert!(
            rb.capacity() < RECV_BUF_MAX,
            "sparse fills shrink it (now {})",
            rb.capacity()
        );
        assert!(rb.capacity() >= RECV_BUF_MIN);
    }

    /// A buffered segment is lent as a slice: the bytes are right, the next fill reuses the
    /// buffer once no slice is held and moves to a new one while one is, the old buffer is let
    /// go once its slices are dropped, and past the cap on held buffers data is not lent
    /// (the caller copies).
    #[tokio::test]
    async fn lent_slices_keep_their_bytes_and_the_held_buffers_are_bounded() {
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        let mut rb = RecvBuf::new(rx);
        let mut hdr = [0u8; 48];
        // Not buffered yet: nothing to lend.
        assert!(rb.take_shared(16).is_none());
        // One "header" and one "segment" per fill, a slice dropped at once: no buffer is left
        // behind.
        for i in 0..10u8 {
            tx.write_all(&[i; 48]).await.unwrap();
            tx.write_all(&[i ^ 0x5a; 512]).await.unwrap();
            rb.read_exact(&mut hdr).await.unwrap();
            assert_eq!(hdr, [i; 48]);
            let seg = rb.take_shared(512).expect("a buffered segment is lent");
            assert_eq!(&seg[..], &[i ^ 0x5a; 512][..]);
            assert!(rb.take_shared(1).is_none(), "nothing more is buffered");
        }
        assert_eq!(
            rb.retired(),
            0,
            "slices dropped at once leave no buffer held"
        );
        // Slices kept (commands still running): each fill moves to a new buffer and the old
        // one stays held, until the cap; then segments are no longer lent.
        let mut kept = Vec::new();
        for i in 0..(RETIRED_MAX as u8 + 3) {
            tx.write_all(&[i; 48]).await.unwrap();
            tx.write_all(&[i.wrapping_mul(3); 256]).await.unwrap();
            rb.read_exact(&mut hdr).await.unwrap();
            assert_eq!(hdr, [i; 48]);
            match rb.take_shared(256) {
                Some(seg) => kept.push((i, seg)),
                None => {
                    assert_eq!(rb.retired(), RETIRED_MAX, "lending stops only at the cap");
                    let mut copy = [0u8; 256];
                    rb.read_exact(&mut copy).await.unwrap();
                    assert_eq!(copy, [i.wrapping_mul(3); 256]);
                }
            }
        }
        // The buffer in use is not counted: one lent per fill until RETIRED_MAX are left behind.
        assert_eq!(kept.len(), RETIRED_MAX);
        for (i, seg) in &kept {
            assert_eq!(
                &seg[..],
                &[i.wrapping_mul(3); 256][..],
                "a kept slice changed"
            );
        }
        // The slices are dropped: the next fill lets the old buffers go and lends again.
        drop(kept);
        tx.write_all(&[7u8; 48 + 64]).await.unwrap();
        rb.read_exact(&mut hdr).await.unwrap();
        assert_eq!(rb.retired(), 0, "buffers no longer held are let go");
        assert_eq!(&rb.take_shared(64).unwrap()[..], &[7u8; 64][..]);
    }

    /// After a large payload the next header is read on its own: the following large
    /// payload is not pulled into the buffer (and copied twice), it goes straight to its
    /// destination. Small PDUs go back to buffered reads afterwards.
    #[tokio::test]
    async fn after_a_large_payload_the_next_header_is_not_over_read() {
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        let mut rb = RecvBuf::new(rx);
        let payload = |seed: u8| -> Vec<u8> { (0..200_000u32).map(|i| (i as u8) ^ seed).collect() };
        grow_to_max(&mut tx, &mut rb).await;
        assert_eq!(rb.capacity(), RECV_BUF_MAX);
        for seed in [1u8, 2, 3] {
            tx.write_all(&[seed; 48]).await.unwrap();
            tx.write_all(&payload(seed)).await.unwrap();
        }
        let mut got = Vec::new();
        for seed in [1u8, 2, 3] {
            let mut hdr = [0u8; 48];
            rb.read_exact(&mut hdr).await.unwrap();
            assert_eq!(hdr, [seed; 48]);
            if seed > 1 {
                assert!(
                    rb.buffer().is_empty(),
                    "header {seed} read alone, {} payload bytes buffered",
                    rb.buffer().len()
                );
            }
            let mut p = vec![0u8; 200_000];
            rb.read_exact(&mut p).await.unwrap();
            got.push(p == payload(seed));
        }
        assert_eq!(got, [true, true, true]);
        // A run of small PDUs returns to filling the buffer: several headers per read.
        for i in 0..20u8 {
            tx.write_all(&[i; 48]).await.unwrap();
        }
        for i in 0..20u8 {
            let mut hdr = [0u8; 48];
            rb.read_exact(&mut hdr).await.unwrap();
            assert_eq!(hdr, [i; 48]);
        }
        let mut hdr = [0u8; 48];
        tx.write_all(&[1u8; 96]).await.unwrap();
        rb.read_exact(&mut hdr).await.unwrap();
        assert_eq!(rb.buffer().len(), 48, "small reads are buffered again");
    }
}
