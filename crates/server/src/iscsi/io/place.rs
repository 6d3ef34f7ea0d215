//! Data-Out received in place: straight from the socket into a file LUN's mapped pages, a
//! whole logical block at a time.

use super::recv_buf::{DIRECT_AFTER_LARGE, RECV_BUF_MAX};
use super::{skip_bytes, RecvBuf};
use ironsan_backend::InPlaceWrite;
use ironsan_proto::pdu::ReceivePlan;
use tokio::io::AsyncReadExt;

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
