//! PDU framing over a byte stream: the only place that turns bytes on a socket into
//! [`Pdu`]s and back. Lengths are bounded by the [`ReceivePlan`] before anything is read;
//! digests are checked and computed here (CRC32C over header and data, padding included).
//!
//! Four parts: reading PDUs (here), the receive buffer ([`RecvBuf`], `recv_buf.rs`), Data-Out
//! received in place ([`Placement`], `place.rs`) and send batching ([`WriteBatch`],
//! `batch.rs`).

mod batch;
mod place;
mod recv_buf;

pub use batch::WriteBatch;
pub use place::{recv_in_place, PlaceTarget, Placement};
pub use recv_buf::RecvBuf;

use bytes::{Bytes, BytesMut};
use ironsan_proto::digest;
use ironsan_proto::pdu::{Bhs, Header, Pdu, ReceivePlan};
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

#[cfg(test)]
mod tests {
    use super::recv_buf::*;
    use super::*;
    use ironsan_proto::pdu::BHS_LEN;
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
