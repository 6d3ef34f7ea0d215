//! Zero-copy Data-In (`zero_copy_reads`): large reads of file LUNs go from the page cache to
//! the socket with `sendfile`. Real files (tmpfs and the test's own file system), real
//! sockets, the test initiator: every byte read back is checked against what was written, and
//! the server's own counter says whether the bytes went by `sendfile` or by copy.

mod support;
use bytes::Bytes;
use ironsan_backend::{FileBackend, FileOptions};
use ironsan_initiator::{Client, LoginOptions};
use ironsan_proto::pdu::Header;
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
    /// The backing file (removed with the rig).
    file: TempFile,
    addr: SocketAddr,
    control: ironsan_server::admin::Control,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Rig {
    fn zero_copy_bytes(&self) -> u64 {
        self.control.gauges().zero_copy_bytes
    }
}

/// A server whose LUN 0 is a new file `name` in `dir`.
async fn start(dir: &Path, name: &str, mode: ZeroCopyReads) -> Rig {
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
    let t = support::target_on(
        TARGET,
        Arc::new(backend),
        ironsan_scsi::local_naa("zero-copy"),
    );
    let mut cfg = ServerConfig::new(vec!["127.0.0.1:0".parse().unwrap()], vec![t]);
    cfg.zero_copy_reads = mode;
    let server = Server::bind(cfg).await.unwrap();
    let addr = server.local_addrs()[0];
    let control = server.control();
    Rig {
        file,
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
    let data = pattern(LUN_BYTES as usize, 7);
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
    let rig = start(Path::new("/dev/shm"), "tmpfs", ZeroCopyReads::On).await;
    let mut c = login(rig.addr, |_| {}).await;
    let data = fill(&mut c).await;
    let before = rig.zero_copy_bytes();
    let large = read_and_check(&mut c, &data).await;
    assert_eq!(
        rig.zero_copy_bytes() - before,
        large,
        "every read of 64 KiB or more, and nothing else, goes by sendfile"
    );
    // The admin view shows it per connection.
    let sessions = rig.control.sessions();
    let conn = &sessions[0]["connections"][0];
    assert_eq!(conn["tx_zero_copy_bytes"].as_u64(), Some(large), "{conn}");
    // A header digest covers only the header: the data still goes by sendfile.
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
    // 16 reads of 2 MiB sent at once and read back slowly: the target's socket fills, so
    // `sendfile` stops part way through segments and the writer resumes when it drains.
    let rig = start(Path::new("/dev/shm"), "inflight", ZeroCopyReads::On).await;
    let mut c = login(rig.addr, |_| {}).await;
    let data = fill(&mut c).await;
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
    assert_eq!(rig.zero_copy_bytes() - before, 16 * (2 << 20));
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
    std::fs::OpenOptions::new()
        .write(true)
        .open(&rig.file.0)
        .unwrap()
        .set_len(LUN_BYTES / 2)
        .unwrap();
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
