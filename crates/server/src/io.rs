//! PDU framing over a byte stream: the only place that turns bytes on a socket into
//! [`Pdu`]s and back. Lengths are bounded by the [`ReceivePlan`] before anything is read;
//! digests are checked and computed here (CRC32C over header and data, padding included).

use bytes::{Bytes, BytesMut};
use ironsan_proto::digest;
use ironsan_proto::pdu::{pad_len, Bhs, Header, Pdu, ReceivePlan, BHS_LEN};
use std::io::IoSlice;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Digest settings of a connection, one per direction as negotiated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

/// Why a PDU could not be read. `HeaderDigest` and `Io` are fatal to the connection (the
/// length can no longer be trusted); the others allow a Reject.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("connection closed")]
    Closed,
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("header digest error")]
    HeaderDigest,
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
            return Err(ReadError::HeaderDigest);
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
    let mut left = plan.data_len + plan.pad_len + plan.data_digest_len;
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
#[derive(Default)]
pub struct WriteBatch {
    /// Headers, digests and padding live here; data segments are referenced, not copied.
    parts: Vec<Part>,
    bytes: usize,
}

enum Part {
    Small([u8; BHS_LEN + 4], usize),
    Tail([u8; 8], usize),
    Data(Bytes),
}

impl Part {
    fn as_slice(&self) -> &[u8] {
        match self {
            Part::Small(b, n) => &b[..*n],
            Part::Tail(b, n) => &b[..*n],
            Part::Data(d) => d,
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

    /// Append one PDU (BHS already encoded with lengths; no AHS is ever sent by the target).
    pub fn push(&mut self, bhs: &Bhs, data: Bytes, digests: Digests) {
        let mut head = [0u8; BHS_LEN + 4];
        head[..BHS_LEN].copy_from_slice(&bhs.0);
        let mut n = BHS_LEN;
        if digests.header {
            head[BHS_LEN..].copy_from_slice(&digest::crc32c(&bhs.0).to_le_bytes());
            n += 4;
        }
        self.bytes += n;
        self.parts.push(Part::Small(head, n));
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

    /// Write everything queued, then clear the batch.
    pub async fn flush<W: AsyncWrite + Unpin>(&mut self, w: &mut W) -> std::io::Result<()> {
        let mut part = 0usize;
        let mut off = 0usize;
        while part < self.parts.len() {
            let slices: Vec<IoSlice<'_>> = self.parts[part..]
                .iter()
                .enumerate()
                .take(1024)
                .map(|(i, p)| {
                    if i == 0 {
                        IoSlice::new(&p.as_slice()[off..])
                    } else {
                        IoSlice::new(p.as_slice())
                    }
                })
                .collect();
            let mut n = w.write_vectored(&slices).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            while n > 0 && part < self.parts.len() {
                let left = self.parts[part].as_slice().len() - off;
                if n >= left {
                    n -= left;
                    part += 1;
                    off = 0;
                } else {
                    off += n;
                    n = 0;
                }
            }
        }
        self.parts.clear();
        self.bytes = 0;
        w.flush().await
    }
}
