//! Zero-copy Data-In (`zero_copy_reads`): large reads of file LUNs go from the page cache to
//! the socket with `sendfile`, or from a mapping of a tmpfs file in the vectored write. Zero-copy Data-Out (`zero_copy_writes`): large writes to tmpfs
//! file LUNs are received straight into the file's pages. Real files (tmpfs and the test's
//! own file system), real sockets, the test initiator: every byte read back is checked
//! against what was written (and written bytes in the backing file itself), and the server's
//! own counters say whether the bytes went in place or by copy.

use crate::support;
use bytes::Bytes;
use ironsan_backend::{BlockDevice, FileBackend, FileOptions, NullBackend, RamBackend};
use ironsan_initiator::{Client, CommandResult, LoginOptions};
use ironsan_proto::pdu::{Bhs, DataOut, Header, Itt, Lun, Pdu, TmfFunction, TmfResponseCode};
use ironsan_proto::DataSn;
use ironsan_server::{Server, ServerConfig, ZeroCopyReads};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use support::{pattern, TARGET};

const BS: u32 = 512;
const LUN_BYTES: u64 = 32 << 20;

/// A backing file removed when the test ends.
struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

struct Rig {
    /// The backing file (removed with the rig); `None` for a RAM or NULL LUN.
    file: Option<TempFile>,
    addr: SocketAddr,
    control: ironsan_server::control::Control,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Rig {
    fn zero_copy_bytes(&self) -> u64 {
        self.control.gauges().zero_copy_bytes
    }
    fn zero_copy_write_bytes(&self) -> u64 {
        self.control.gauges().zero_copy_write_bytes
    }
    /// The backing file of a file LUN.
    fn path(&self) -> &Path {
        &self.file.as_ref().expect("a file LUN").0
    }
    /// Truncate the backing file behind the target's back.
    fn cut_short(&self, len: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.path())
            .unwrap()
            .set_len(len)
            .unwrap();
    }
}

/// A server whose LUN 0 is a new file `name` in `dir`.
async fn start(dir: &Path, name: &str, mode: ZeroCopyReads) -> Rig {
    start_with(dir, name, |cfg| cfg.limits.zero_copy_reads = mode).await
}

/// [`start`] with the server's configuration as `f` leaves it.
async fn start_with(dir: &Path, name: &str, f: impl FnOnce(&mut ServerConfig)) -> Rig {
    let file = TempFile(dir.join(format!(
        "ironsan-zero-copy-{}-{name}.img",
        std::process::id()
    )));
    let backend = FileBackend::open(
        &file.0,
        &FileOptions {
            size: Some(LUN_BYTES),
            io_threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let mut rig = start_on(Arc::new(backend), f).await;
    rig.file = Some(file);
    rig
}

/// A server whose LUN 0 is `backend`, with its configuration as `f` leaves it.
async fn start_on(backend: Arc<dyn BlockDevice>, f: impl FnOnce(&mut ServerConfig)) -> Rig {
    let t = support::target_on(TARGET, backend, ironsan_scsi::local_naa("zero-copy"));
    let mut cfg = ServerConfig::new(vec!["127.0.0.1:0".parse().unwrap()], vec![t]);
    f(&mut cfg);
    let server = Server::bind(cfg).await.unwrap();
    let addr = server.local_addrs()[0];
    let control = server.control();
    Rig {
        file: None,
        addr,
        control,
        _stop: support::run_in_background(server),
    }
}

async fn login(addr: SocketAddr, f: impl FnOnce(&mut LoginOptions)) -> Client {
    let mut o = support::login_opts(TARGET, "iqn.2026-11.org.ironsan:zero-copy", 1);
    f(&mut o);
    Client::login(addr, &o).await.unwrap()
}

/// Fill the LUN with a pattern (2 MiB writes) and return it.
async fn fill(c: &mut Client) -> Bytes {
    fill_first(c, LUN_BYTES as usize, 7).await
}

/// Write the first `len` bytes of the LUN with pattern `seed` (2 MiB writes) and return them.
async fn fill_first(c: &mut Client, len: usize, seed: u8) -> Bytes {
    let data = pattern(len, seed);
    for (i, chunk) in data.chunks(2 << 20).enumerate() {
        let lba = (i as u64 * (2 << 20)) / u64::from(BS);
        let r = c
            .write16(0, lba, Bytes::copy_from_slice(chunk), BS, false)
            .await
            .unwrap();
        assert_eq!(r.status, 0, "write at LBA {lba}: {:?}", r.sense_key());
    }
    data
}

/// Reads of many sizes and offsets, each checked byte for byte; returns the bytes read in
/// reads of at least 64 KiB.
async fn read_and_check(c: &mut Client, data: &Bytes) -> u64 {
    let mut large = 0;
    for (lba, blocks) in [
        (0u64, 8u32),     // 4 KiB: copied whatever the mode
        (1, 128),         // exactly 64 KiB, odd LBA
        (3, 1024),        // 512 KiB: two 256 KiB segments
        (4097, 2049),     // 1 MiB + 512: a short last segment
        (60_000, 4096),   // 2 MiB near the end
        (65_536 - 8, 8),  // the last 4 KiB
        (12_345, 16_384), // 8 MiB: MaxBurstLength sequences
    ] {
        let r = c.read16(0, lba, blocks, BS).await.unwrap();
        assert_eq!(r.status, 0, "read {blocks} at {lba}: {:?}", r.sense_key());
        let off = (lba * u64::from(BS)) as usize;
        let len = (blocks * BS) as usize;
        assert_eq!(r.data.len(), len, "read {blocks} blocks at {lba}");
        assert!(
            r.data[..] == data[off..off + len],
            "read {blocks} blocks at LBA {lba} returned other bytes than were written"
        );
        if len >= 64 << 10 {
            large += len as u64;
        }
    }
    large
}

#[tokio::test]
async fn large_reads_of_a_tmpfs_file_lun_are_sent_from_the_page_cache() {
    for mode in [ZeroCopyReads::On, ZeroCopyReads::Mapped] {
        large_reads_of_a_tmpfs_file_lun_go_zero_copy(mode).await;
    }
}

async fn large_reads_of_a_tmpfs_file_lun_go_zero_copy(mode: ZeroCopyReads) {
    let rig = start(Path::new("/dev/shm"), &format!("tmpfs-{mode}"), mode).await;
    let mut c = login(rig.addr, |_| {}).await;
    let data = fill(&mut c).await;
    let before = rig.zero_copy_bytes();
    let large = read_and_check(&mut c, &data).await;
    assert_eq!(
        rig.zero_copy_bytes() - before,
        large,
        "{mode}: every read of 64 KiB or more, and nothing else, goes zero-copy"
    );
    // The admin view shows it per connection.
    let sessions = rig.control.sessions();
    let conn = &sessions[0].connections[0];
    assert_eq!(conn.tx_zero_copy_bytes, large, "{conn:?}");
    // A header digest covers only the header: the data still goes zero-copy.
    let mut c = login(rig.addr, |o| {
        o.header_digest = true;
        o.isid.0[5] = 2;
    })
    .await;
    assert!(c.header_digest && !c.data_digest);
    let before = rig.zero_copy_bytes();
    let large = read_and_check(&mut c, &data).await;
    assert_eq!(rig.zero_copy_bytes() - before, large);
}

/// Read `blocks` at `lba` and check every byte against `want` (the LUN's contents).
async fn read_expecting(c: &mut Client, lba: u64, blocks: u32, want: &[u8]) {
    let r = c.read16(0, lba, blocks, BS).await.unwrap();
    assert_eq!(r.status, 0, "read {blocks} at {lba}: {:?}", r.sense_key());
    let off = (lba * u64::from(BS)) as usize;
    let len = (blocks * BS) as usize;
    assert!(
        r.data.len() == len && r.data[..] == want[off..off + len],
        "read {blocks} blocks at LBA {lba} returned other bytes than the LUN holds"
    );
}

#[tokio::test]
async fn reads_of_nothing_stored_are_sent_from_the_zero_page() {
    // `auto` (BBR on this host: a mapping for file data) and `on` (sendfile) both send reads
    // of RAM-LUN holes and of NULL LUNs from the zero file; `mapped` and `off` copy.
    for (mode, zero_page) in [
        (ZeroCopyReads::Auto, true),
        (ZeroCopyReads::On, true),
        (ZeroCopyReads::Mapped, false),
        (ZeroCopyReads::Off, false),
    ] {
        let rig = start_on(Arc::new(RamBackend::new(LUN_BYTES)), |cfg| {
            cfg.limits.zero_copy_reads = mode
        })
        .await;
        let mut c = login(rig.addr, |_| {}).await;
        let mut lun = vec![0u8; LUN_BYTES as usize];
        // Before Linux 6.5 the kernel would zero-fill pipe pages for it: copied instead.
        let zero_page = zero_page && ironsan_backend::zero_page_reads_supported();
        let sent = |n: u64| if zero_page { n } else { 0 };

        read_expecting(&mut c, 0, 1024, &lun).await; // 512 KiB of a hole
        read_expecting(&mut c, 12_345, 16_384, &lun).await; // 8 MiB, unaligned
        assert_eq!(
            rig.zero_copy_bytes(),
            sent((512 << 10) + (8 << 20)),
            "{mode}"
        );

        // 512 KiB written at 1 MiB: reads that touch it copy, holes beside it still do not.
        let data = pattern(512 << 10, 3);
        let r = c.write16(0, 2048, data.clone(), BS, false).await.unwrap();
        assert_eq!(r.status, 0);
        lun[1 << 20..(1 << 20) + (512 << 10)].copy_from_slice(&data);
        let before = rig.zero_copy_bytes();
        read_expecting(&mut c, 0, 4096, &lun).await; // 2 MiB over the written chunk
        read_expecting(&mut c, 2048, 1024, &lun).await; // the written chunk alone
        read_expecting(&mut c, 1024, 1024, &lun).await; // the hole before it
        read_expecting(&mut c, 8, 8, &lun).await; // 4 KiB: always copied
        assert_eq!(rig.zero_copy_bytes() - before, sent(512 << 10), "{mode}");

        // A data digest needs the bytes; 8 KiB segments would cost a syscall each.
        for (isid, digest, mrdsl) in [(2u8, true, 256 << 10), (3, false, 8192)] {
            let mut c = login(rig.addr, |o| {
                o.isid.0[5] = isid;
                o.data_digest = digest;
                o.max_recv_data_segment_length = mrdsl;
            })
            .await;
            let before = rig.zero_copy_bytes();
            read_expecting(&mut c, 0, 1024, &lun).await;
            assert_eq!(
                rig.zero_copy_bytes(),
                before,
                "{mode}, digest {digest}, {mrdsl}"
            );
        }
    }

    // A NULL LUN: every large read is zeros from the zero page, written data or not.
    let rig = start_on(Arc::new(NullBackend::new(LUN_BYTES)), |_| {}).await;
    let mut c = login(rig.addr, |_| {}).await;
    let r = c
        .write16(0, 0, pattern(1 << 20, 5), BS, false)
        .await
        .unwrap();
    assert_eq!(r.status, 0);
    read_expecting(&mut c, 0, 2048, &vec![0u8; 1 << 20]).await;
    let sent = if ironsan_backend::zero_page_reads_supported() {
        1 << 20
    } else {
        0
    };
    assert_eq!(rig.zero_copy_bytes(), sent);
}

#[tokio::test]
async fn cached_pages_of_a_disk_file_lun_are_sent_from_the_page_cache() {
    // The test's own directory is on a disk file system here (not tmpfs): reads go by
    // sendfile only when `cachestat` says every page is cached, as it is right after the
    // writes.
    let rig = start(&std::env::temp_dir(), "disk", ZeroCopyReads::On).await;
    let mut c = login(rig.addr, |_| {}).await;
    let data = fill(&mut c).await;
    let before = rig.zero_copy_bytes();
    let large = read_and_check(&mut c, &data).await;
    let sent = rig.zero_copy_bytes() - before;
    assert!(
        sent == large || sent == 0,
        "all large reads by sendfile (every page cached) or none (no cachestat): {sent} of {large}"
    );
}

#[tokio::test]
async fn data_digest_or_mode_off_copies_and_reads_the_same_bytes() {
    let rig = start(Path::new("/dev/shm"), "digest", ZeroCopyReads::On).await;
    let mut c = login(rig.addr, |o| o.data_digest = true).await;
    assert!(c.data_digest);
    let data = fill(&mut c).await;
    let before = rig.zero_copy_bytes();
    read_and_check(&mut c, &data).await;
    assert_eq!(
        rig.zero_copy_bytes(),
        before,
        "with DataDigest=CRC32C the bytes are read into memory for the digest"
    );
    // Small segments: a syscall per 8 KiB segment would cost more than the copy.
    let mut c = login(rig.addr, |o| {
        o.max_recv_data_segment_length = 8192;
        o.isid.0[5] = 2;
    })
    .await;
    read_and_check(&mut c, &data).await;
    assert_eq!(
        rig.zero_copy_bytes(),
        before,
        "MaxRecvDataSegmentLength 8 KiB copies"
    );

    let rig = start(Path::new("/dev/shm"), "off", ZeroCopyReads::Off).await;
    let mut c = login(rig.addr, |_| {}).await;
    let data = fill(&mut c).await;
    read_and_check(&mut c, &data).await;
    assert_eq!(rig.zero_copy_bytes(), 0, "zero_copy_reads = off");
}

#[tokio::test]
async fn many_large_reads_in_flight_fill_the_socket_and_arrive_whole() {
    for mode in [ZeroCopyReads::On, ZeroCopyReads::Mapped] {
        many_large_reads_in_flight_arrive_whole(mode).await;
    }
}

async fn many_large_reads_in_flight_arrive_whole(mode: ZeroCopyReads) {
    // 16 reads of 2 MiB sent at once and read back slowly: the target's socket fills, so
    // `sendfile` (or the vectored send from the mapping) stops part way through segments and
    // the writer resumes when it drains.
    let rig = start(Path::new("/dev/shm"), &format!("inflight-{mode}"), mode).await;
    let mut c = login(rig.addr, |_| {}).await;
    let data = fill(&mut c).await;
    let sent = reads_in_flight_arrive_whole(&rig, &mut c, &data).await;
    assert_eq!(sent, 16 * (2 << 20));
}

#[tokio::test]
async fn many_reads_of_ram_holes_and_data_in_flight_arrive_whole() {
    // The same against a RAM LUN whose first half is written and second half never was: the
    // reads wholly in the holes go as the zero page, and every byte still arrives in place.
    let rig = start_on(Arc::new(RamBackend::new(LUN_BYTES)), |_| {}).await;
    let mut c = login(rig.addr, |_| {}).await;
    let mut data = vec![0u8; LUN_BYTES as usize];
    let half = fill_first(&mut c, LUN_BYTES as usize / 2, 11).await;
    data[..half.len()].copy_from_slice(&half);
    let sent = reads_in_flight_arrive_whole(&rig, &mut c, &data).await;
    // Reads 9-15 start past the written half (read 8 starts in its last chunk).
    let holes = if ironsan_backend::zero_page_reads_supported() {
        7 * (2 << 20)
    } else {
        0
    };
    assert_eq!(sent, holes);
}

/// 16 reads of 2 MiB at LBA 4001 * i, sent at once and read back slowly; every byte is
/// checked against `data` (the LUN's contents). Returns the bytes the target sent zero-copy.
async fn reads_in_flight_arrive_whole(rig: &Rig, c: &mut Client, data: &[u8]) -> u64 {
    let before = rig.zero_copy_bytes();
    let mut want = HashMap::new();
    for i in 0..16u64 {
        let lba = i * 4000 + i; // unaligned to pages; the last ends before block 65,536
        let (itt, _) = c.send_read16(0, lba, 4096, BS).await.unwrap();
        want.insert(itt, (lba, vec![0u8; 2 << 20], false));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while want.values().any(|w| !w.2) {
        let p = tokio::time::timeout_at(deadline, c.recv())
            .await
            .expect("reads did not complete")
            .unwrap();
        let Header::DataIn(d) = &p.header else {
            panic!("unexpected PDU {:?}", p.header);
        };
        let w = want.get_mut(&d.itt).expect("Data-In for an unknown ITT");
        let off = d.buffer_offset as usize;
        w.1[off..off + p.data.len()].copy_from_slice(&p.data);
        if let Some(status) = d.status {
            assert_eq!(status, 0);
            w.2 = true;
        }
        // Read slowly at first so the target meets a full socket.
        if d.buffer_offset == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    for (lba, got, _) in want.values() {
        let off = (*lba * u64::from(BS)) as usize;
        assert!(
            got[..] == data[off..off + (2 << 20)],
            "2 MiB read at LBA {lba} came back with other bytes"
        );
    }
    rig.zero_copy_bytes() - before
}

#[tokio::test]
async fn a_backing_file_cut_short_under_a_read_closes_the_connection() {
    // Someone truncates the backing file behind the target's back. A copied read would fail
    // with a CHECK CONDITION; a read whose header is already on the wire cannot, so the
    // connection closes (the initiator retries elsewhere) rather than send bytes that are
    // not the file's. Nothing hangs, and a new session works.
    let rig = start(Path::new("/dev/shm"), "cut", ZeroCopyReads::On).await;
    let mut c = login(rig.addr, |_| {}).await;
    fill(&mut c).await;
    rig.cut_short(LUN_BYTES / 2);
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        c.read16(0, LUN_BYTES / 2 / u64::from(BS) - 8, 1024, BS),
    )
    .await
    .expect("read past the cut hung");
    assert!(
        r.is_err(),
        "a read past the end of the file did not fail: {r:?}"
    );
    let mut c = login(rig.addr, |o| o.isid.0[5] = 3).await;
    let r = c.read16(0, 0, 1024, BS).await.unwrap();
    assert_eq!(r.status, 0);
}

#[tokio::test]
async fn mapped_reads_leave_holes_unallocated_and_a_cut_file_is_read_the_usual_way() {
    // `mapped` sends only over pages that exist: a read fault on a hole of the mapping would
    // allocate it, so holes (and pages past a cut) are copied, as zeros or as an error, and
    // the sparse file stays sparse.
    use std::os::unix::fs::MetadataExt;
    let rig = start(Path::new("/dev/shm"), "mapped-holes", ZeroCopyReads::Mapped).await;
    let mut c = login(rig.addr, |_| {}).await;
    let data = pattern(1 << 20, 3);
    let r = c.write16(0, 2048, data.clone(), BS, false).await.unwrap();
    assert_eq!(r.status, 0);
    let blocks = std::fs::metadata(rig.path()).unwrap().blocks();
    let before = rig.zero_copy_bytes();
    let r = c.read16(0, 2048, 2048, BS).await.unwrap();
    assert!(
        r.status == 0 && r.data == data,
        "the written MiB reads back"
    );
    assert_eq!(
        rig.zero_copy_bytes() - before,
        1 << 20,
        "sent from the mapping"
    );
    for (lba, blocks) in [(8192u64, 4096u32), (0, 2048)] {
        let r = c.read16(0, lba, blocks, BS).await.unwrap();
        assert_eq!(r.status, 0);
        assert!(
            r.data.iter().all(|&b| b == 0),
            "a hole at {lba} reads as zeros"
        );
    }
    assert_eq!(rig.zero_copy_bytes() - before, 1 << 20, "holes were copied");
    assert_eq!(
        std::fs::metadata(rig.path()).unwrap().blocks(),
        blocks,
        "reading holes allocated nothing"
    );
    // Cut behind the target's back: the read past the end is not sent from the mapping, so it
    // fails the usual way, with CHECK CONDITION, and the session goes on.
    rig.cut_short(3 << 20);
    let r = tokio::time::timeout(Duration::from_secs(10), c.read16(0, 2048, 8192, BS))
        .await
        .expect("read past the cut hung")
        .unwrap();
    assert_ne!(r.status, 0, "a read past the end of the file succeeded");
    let r = c.read16(0, 2048, 2048, BS).await.unwrap();
    assert!(r.status == 0 && r.data == data);
}

/// Writes of many sizes and offsets; each is checked in the backing file itself and read back
/// through the target. Returns the bytes in writes of at least 64 KiB.
async fn write_and_check(c: &mut Client, file: &Path, seed: u8) -> u64 {
    use std::os::unix::fs::FileExt;
    let backing = std::fs::File::open(file).unwrap();
    let mut large = 0;
    for (i, (lba, blocks, fua)) in [
        (0u64, 8u32, false),     // 4 KiB: through a buffer whatever the mode
        (1, 128, false),         // exactly 64 KiB, odd LBA
        (3, 1024, true),         // 512 KiB, FUA (made durable)
        (4097, 2049, false),     // 1 MiB + 512: a short last Data-Out
        (60_000, 4096, false),   // 2 MiB near the end
        (12_345, 16_384, false), // 8 MiB: several bursts of R2Ts
    ]
    .into_iter()
    .enumerate()
    {
        let data = pattern((blocks * BS) as usize, seed.wrapping_add(i as u8));
        let r = c.write16(0, lba, data.clone(), BS, fua).await.unwrap();
        assert_eq!(r.status, 0, "write {blocks} at {lba}: {:?}", r.sense_key());
        let mut got = vec![0u8; data.len()];
        backing
            .read_exact_at(&mut got, lba * u64::from(BS))
            .unwrap();
        assert!(
            got[..] == data[..],
            "the file holds other bytes than the write of {blocks} blocks at LBA {lba} sent"
        );
        let r = c.read16(0, lba, blocks, BS).await.unwrap();
        assert!(
            r.status == 0 && r.data == data,
            "read back {blocks} at {lba}"
        );
        if data.len() >= 64 << 10 {
            large += data.len() as u64;
        }
    }
    large
}

#[tokio::test]
async fn large_writes_to_a_tmpfs_file_lun_are_received_into_its_pages() {
    let rig = start(Path::new("/dev/shm"), "wr-tmpfs", ZeroCopyReads::Off).await;
    let mut c = login(rig.addr, |_| {}).await;
    let large = write_and_check(&mut c, rig.path(), 1).await;
    let placed = rig.zero_copy_write_bytes();
    // All but the data that came with each command (immediate and unsolicited, already in
    // the receive buffer, written from there) was received in place.
    assert!(
        placed > large / 2 && placed <= large,
        "{placed} of {large} bytes of large writes received in place"
    );
    // A 4 KiB write goes through a buffer.
    let r = c
        .write16(0, 5000, pattern(4096, 9), BS, false)
        .await
        .unwrap();
    assert_eq!(r.status, 0);
    assert_eq!(rig.zero_copy_write_bytes(), placed);
    // Overwriting what reads may still be sending, and a header digest (it covers only the
    // header): in place as well, and the bytes are the new ones.
    let mut c = login(rig.addr, |o| {
        o.header_digest = true;
        o.isid.0[5] = 2;
    })
    .await;
    assert!(c.header_digest && !c.data_digest);
    write_and_check(&mut c, rig.path(), 2).await;
    assert!(rig.zero_copy_write_bytes() > 2 * placed - large / 2);
}

#[tokio::test]
async fn data_digest_or_writes_off_receive_through_a_buffer() {
    let rig = start(Path::new("/dev/shm"), "wr-digest", ZeroCopyReads::Off).await;
    let mut c = login(rig.addr, |o| o.data_digest = true).await;
    assert!(c.data_digest);
    write_and_check(&mut c, rig.path(), 3).await;
    assert_eq!(
        rig.zero_copy_write_bytes(),
        0,
        "with DataDigest=CRC32C the bytes are checked before they may reach the medium"
    );
    let rig = start_with(Path::new("/dev/shm"), "wr-off", |cfg| {
        cfg.limits.zero_copy_writes = false;
    })
    .await;
    let mut c = login(rig.addr, |_| {}).await;
    write_and_check(&mut c, rig.path(), 4).await;
    assert_eq!(rig.zero_copy_write_bytes(), 0, "zero_copy_writes = off");
    // A file on a disk file system is written through a buffer too.
    let rig = start(&std::env::temp_dir(), "wr-disk", ZeroCopyReads::Off).await;
    let mut c = login(rig.addr, |_| {}).await;
    write_and_check(&mut c, rig.path(), 5).await;
    assert_eq!(rig.zero_copy_write_bytes(), 0, "only tmpfs/ramfs files");
}

#[tokio::test]
async fn a_backing_file_cut_short_under_large_writes_is_written_as_before() {
    // Someone truncates the backing file behind the target's back. A write through a buffer
    // extends the file again; so does one received in place: the kernel cannot copy into
    // pages past the end (EFAULT, never SIGBUS: nothing in user space touches the mapping),
    // so the rest of the data is received into memory and written from there.
    let rig = start(Path::new("/dev/shm"), "wr-cut", ZeroCopyReads::Off).await;
    let mut c = login(rig.addr, |_| {}).await;
    // The nexus's first command reports or registers it (a write that might owe a unit
    // attention is not placed).
    assert_eq!(c.read16(0, 0, 1, BS).await.unwrap().status, 0);
    let first = pattern(1 << 20, 6);
    let r = c.write16(0, 0, first.clone(), BS, false).await.unwrap();
    assert_eq!(r.status, 0);
    assert!(rig.zero_copy_write_bytes() > 0, "the mapping exists");
    rig.cut_short(LUN_BYTES / 4);
    let lba = LUN_BYTES / 2 / u64::from(BS);
    let data = pattern(2 << 20, 8);
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        c.write16(0, lba, data.clone(), BS, false),
    )
    .await
    .expect("a write past the cut hung")
    .unwrap();
    assert_eq!(r.status, 0, "{:?}", r.sense_key());
    let r = c.read16(0, lba, 4096, BS).await.unwrap();
    assert!(r.status == 0 && r.data == data);
    let r = c.read16(0, 0, 2048, BS).await.unwrap();
    assert!(r.status == 0 && r.data == first);
}

/// Send a WRITE(16) of `len` bytes at LBA 0 with no data, wait for its R2T, and return the
/// wire bytes of a Data-Out PDU carrying `data` from offset 0 (final when it completes the
/// write), for the caller to send, or part of.
async fn write_by_r2t(c: &mut Client, name: &str, len: u32, data: &[u8]) -> Vec<u8> {
    let (itt, _) = c.send_write16(0, 0, len, BS, Bytes::new()).await.unwrap();
    // The command's F bit says no unsolicited data follows: the target asks for it.
    let p = tokio::time::timeout(Duration::from_secs(10), c.recv())
        .await
        .expect("no R2T")
        .unwrap();
    let Header::R2t(r2t) = &p.header else {
        panic!("{name}: expected an R2T, got {:?}", p.header);
    };
    assert_eq!((r2t.itt, r2t.buffer_offset), (itt, 0));
    let header = Header::DataOut(DataOut {
        final_bit: data.len() == len as usize,
        lun: Lun::from_number(0),
        itt,
        ttt: r2t.ttt,
        data_sn: DataSn(0),
        buffer_offset: 0,
        ..Default::default()
    });
    let mut raw = Pdu::new(header, Bytes::copy_from_slice(data))
        .bhs()
        .0
        .to_vec();
    raw.extend_from_slice(data);
    raw
}

#[tokio::test]
async fn a_write_broken_off_mid_transfer_leaves_no_block_torn() {
    // A 256 KiB write whose first Data-Out PDU announces 64 KiB and carries 4,600 bytes (eight
    // whole blocks and 504 bytes of the ninth), then a TCP reset. Every block reads back all
    // old or all new. Received in place, whole blocks reach the file as they arrive (SBC
    // allows either for an aborted write) and the ninth, incomplete, never does; through a
    // buffer, nothing is written.
    for on in [true, false] {
        let name = if on { "tear-on" } else { "tear-off" };
        let rig = start_with(Path::new("/dev/shm"), name, |cfg| {
            cfg.limits.zero_copy_writes = on
        })
        .await;
        let mut c = login(rig.addr, |_| {}).await;
        assert_eq!(c.read16(0, 0, 1, BS).await.unwrap().status, 0);
        let old = pattern(256 << 10, 1);
        let r = c.write16(0, 0, old.clone(), BS, false).await.unwrap();
        assert_eq!(r.status, 0);
        let new = pattern(256 << 10, 2);
        let raw = write_by_r2t(&mut c, name, 256 << 10, &new[..64 << 10]).await;
        c.send_bytes(&raw[..48 + 4600]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.reset().unwrap();
        let mut c = login(rig.addr, |o| o.isid.0[5] = 9).await;
        let r = c.read16(0, 0, 32, BS).await.unwrap();
        assert_eq!(r.status, 0);
        let block = |d: &[u8], b: usize| d[b * 512..(b + 1) * 512].to_vec();
        for b in 0..32 {
            let got = block(&r.data, b);
            assert!(
                got == block(&old, b) || got == block(&new, b),
                "{name}: block {b} is torn"
            );
        }
        assert!(
            r.data[8 * 512..] == old[8 * 512..16 << 10],
            "{name}: the incomplete block or one after it was written"
        );
        if on {
            assert!(
                r.data[..8 * 512] == new[..8 * 512],
                "{name}: the whole blocks that arrived were not received in place"
            );
        } else {
            assert!(
                r.data[..] == old[..16 << 10],
                "{name}: a buffered write wrote"
            );
        }
    }
}

/// Session reinstatement while a 64 KiB write is in the middle of its one Data-Out PDU (the
/// header and 4,600 bytes here): the whole blocks that came before the new login may be in
/// the file when received in place (promise 12's exception), but the rest of the PDU arriving
/// on the old connection afterwards (a late retransmission), which completes the transfer,
/// never reaches the file, so the new session's acknowledged write of the same blocks stays,
/// received in place or through a buffer.
#[tokio::test]
async fn reinstatement_mid_data_out_lets_no_late_bytes_of_the_old_write_land() {
    for on in [true, false] {
        let name = if on { "late-on" } else { "late-off" };
        let rig = start_with(Path::new("/dev/shm"), name, |cfg| {
            cfg.limits.zero_copy_writes = on
        })
        .await;
        let mut c = login(rig.addr, |o| o.isid.0[5] = 21).await;
        // A nexus with a unit attention to report does not place writes: take it first.
        let _ = c.read16(0, 0, 1, BS).await.unwrap();
        assert_eq!(c.read16(0, 0, 1, BS).await.unwrap().status, 0);
        let late = pattern(256 << 10, 3);
        let raw = write_by_r2t(&mut c, name, 64 << 10, &late).await;
        c.send_bytes(&raw[..48 + 4600]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The same ISID, TSIH 0: the old session is reinstated.
        let mut n = login(rig.addr, |o| o.isid.0[5] = 21).await;
        let new = pattern(256 << 10, 4);
        let w = n.write16(0, 0, new.clone(), BS, false).await.unwrap();
        assert_eq!(w.status, 0, "{name}: sense {:?}", w.sense_key());
        let _ = c.send_bytes(&raw[48 + 4600..]).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = n.read16(0, 0, 512, BS).await.unwrap();
        assert_eq!(r.status, 0);
        let differ =
            (0..512).filter(|b| r.data[b * 512..(b + 1) * 512] != new[b * 512..(b + 1) * 512]);
        let differ: Vec<usize> = differ.collect();
        assert!(
            differ.is_empty(),
            "{name}: {} blocks of the acknowledged write were overwritten afterwards, from block {:?}",
            differ.len(),
            differ.first()
        );
    }
}

/// A LUN RESET from another initiator aborts a write received in place that still waits for
/// its Data-Out: the range the write held is released at once, so the other initiator's write
/// of the same blocks completes at once, and the aborted write's data, sent afterwards, never
/// reaches the file.
#[tokio::test]
async fn a_reset_by_another_initiator_releases_a_waiting_in_place_write_at_once() {
    let rig = start_with(Path::new("/dev/shm"), "reset-wait", |cfg| {
        cfg.limits.zero_copy_writes = true
    })
    .await;
    let mut a = login(rig.addr, |o| o.isid.0[5] = 31).await;
    // A nexus with a unit attention to report does not place writes: take it first.
    let _ = a.read16(0, 0, 1, BS).await.unwrap();
    assert_eq!(a.read16(0, 0, 1, BS).await.unwrap().status, 0);
    let aborted = pattern(256 << 10, 5);
    let raw = write_by_r2t(&mut a, "reset-wait", 256 << 10, &aborted[..64 << 10]).await;
    let mut b = login(rig.addr, |o| o.isid.0[5] = 32).await;
    let code = b
        .task_mgmt(TmfFunction::LOGICAL_UNIT_RESET, 0, Itt::RESERVED, b.cmd_sn)
        .await
        .unwrap();
    assert_eq!(code, TmfResponseCode::COMPLETE);
    let new = pattern(256 << 10, 6);
    let mut w = CommandResult::default();
    for _ in 0..2 {
        // The first may meet the reset's unit attention.
        w = tokio::time::timeout(
            Duration::from_secs(10),
            b.write16(0, 0, new.clone(), BS, false),
        )
        .await
        .expect("the write waited for the aborted one's range")
        .unwrap();
        if w.status == 0 {
            break;
        }
    }
    assert_eq!(w.status, 0, "sense {:?}", w.sense_key());
    let _ = a.send_bytes(&raw).await;
    // The rest of A's data for its R2T, as an initiator that does not know of the reset
    // sends it: taken and dropped, like a buffered write's (no Reject, the connection in step).
    let mut bhs = Bhs::default();
    bhs.0.copy_from_slice(&raw[..48]);
    let Header::DataOut(first) = Header::decode(&bhs) else {
        panic!("not a Data-Out");
    };
    let (itt, ttt) = (first.itt, first.ttt);
    for (n, off) in [(1u32, 64usize << 10), (2, 128 << 10), (3, 192 << 10)] {
        let d = DataOut {
            final_bit: n == 3,
            lun: Lun::from_number(0),
            itt,
            ttt,
            data_sn: DataSn(n),
            buffer_offset: off as u32,
            ..Default::default()
        };
        let piece = Bytes::copy_from_slice(&aborted[off..off + (64 << 10)]);
        a.send(Header::DataOut(d), piece).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = b.read16(0, 0, 512, BS).await.unwrap();
    assert!(
        r.status == 0 && r.data == new,
        "the aborted write's data reached the file"
    );
    // A got no status for its write (TAS=0); its next command reports the reset, the one
    // after reads what B wrote, and nothing was rejected on the way.
    let r = a.read16(0, 0, 512, BS).await.unwrap();
    assert_eq!((r.status, r.sense_key()), (2, Some((0x06, 0x29, 0x00))));
    let r = a.read16(0, 0, 512, BS).await.unwrap();
    assert!(r.status == 0 && r.data == new, "A reads what B wrote");
    let rejects = a
        .unsolicited
        .iter()
        .filter(|p| matches!(p.header, Header::Reject(_)))
        .count();
    assert_eq!(rejects, 0, "the aborted write's Data-Out was rejected");
}
