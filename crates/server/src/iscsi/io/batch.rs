//! Send batching: the encoded PDUs of one vectored write, headers and digests here, data
//! segments referenced (memory or a file range sent by `sendfile`).

use super::Digests;
use bytes::Bytes;
use ironsan_backend::FileRange;
use ironsan_proto::digest;
use ironsan_proto::pdu::{pad_len, Bhs, BHS_LEN};
use std::os::fd::{AsFd, AsRawFd};

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
