//! Integration tests: a live `ironsan serve` driven by real initiators from Debian —
//! libiscsi's tools (iscsi-ls, iscsi-inq, iscsi-readcapacity16, iscsi-perf, iscsi-test-cu)
//! and qemu-img's iscsi:// driver — plus the CLI's observable behaviour (start-up output,
//! data directory, configuration file, signals).
//!
//! Every test starts its own server on its own free port (tests run in parallel). A missing
//! tool skips the test with a message, or fails it when `IRONSAN_REQUIRE_TOOLS=1` (CI).
//! The tests parse what the tools print; an exit status alone proves little.

use crate::common;

use common::*;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

/// One `Target:... Portal:...` block of `iscsi-ls -s` output.
#[derive(Debug)]
struct Listed {
    target: String,
    portal: String,
    /// (LUN, type, size as printed, e.g. "63M")
    luns: Vec<(u32, String, Option<String>)>,
}

/// Parse `iscsi-ls [-s]` output: `Target:T Portal:P` lines, each followed (with -s) by
/// `Lun:N    Type:TYPE (Size:S)` lines.
fn parse_iscsi_ls(text: &str) -> Vec<Listed> {
    let mut out: Vec<Listed> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Target:") {
            let (target, portal) = rest
                .split_once(" Portal:")
                .unwrap_or_else(|| panic!("unexpected iscsi-ls line {line:?}"));
            out.push(Listed {
                target: target.trim().into(),
                portal: portal.trim().into(),
                luns: Vec::new(),
            });
        } else if let Some(rest) = line.strip_prefix("Lun:") {
            let (num, rest) = rest
                .split_once("Type:")
                .unwrap_or_else(|| panic!("unexpected iscsi-ls line {line:?}"));
            let lun: u32 = num
                .trim()
                .parse()
                .unwrap_or_else(|_| panic!("bad LUN in {line:?}"));
            let (ty, size) = match rest.split_once(" (Size:") {
                Some((ty, s)) => (
                    ty.trim().to_string(),
                    Some(s.trim_end_matches(')').to_string()),
                ),
                None => (rest.trim().to_string(), None),
            };
            out.last_mut()
                .unwrap_or_else(|| panic!("Lun line before any Target line: {text}"))
                .luns
                .push((lun, ty, size));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// 1. Discovery and LUN listing
// ---------------------------------------------------------------------------------------------

#[test]
fn iscsi_ls_discovers_target_and_luns() {
    if !require_tools(&["iscsi-ls", "iscsi-readcapacity16"]) {
        return;
    }
    let mut s = Server::start(&["--lun", "ram:64M", "--lun", "null:16T"]);
    let portal = format!("127.0.0.1:{}", s.port);

    // Discovery only.
    let text = run_stdout("iscsi-ls", &[&s.portal_url()]);
    let listed = parse_iscsi_ls(&text);
    assert_eq!(listed.len(), 1, "expected one target/portal pair:\n{text}");
    assert_eq!(listed[0].target, DEFAULT_TARGET, "{text}");
    // SendTargets reports the portal as ADDR:PORT,TPGT and it must be the one we listen on.
    assert_eq!(listed[0].portal, format!("{portal},1"), "{text}");

    // With -s iscsi-ls logs in to the portal SendTargets gave, runs REPORT LUNS, and for each
    // LUN TEST UNIT READY, INQUIRY and READ CAPACITY(10).
    let text = run_stdout("iscsi-ls", &["-s", &s.portal_url()]);
    let listed = parse_iscsi_ls(&text);
    assert_eq!(listed.len(), 1, "{text}");
    let luns = &listed[0].luns;
    assert_eq!(luns.len(), 2, "expected LUNs 0 and 1:\n{text}");
    assert_eq!(luns[0].0, 0, "{text}");
    assert_eq!(luns[1].0, 1, "{text}");
    for l in luns {
        assert_eq!(l.1, "DIRECT_ACCESS", "{text}");
    }
    // iscsi-ls prints RC10's block length × last LBA (libiscsi's own off-by-one): 64 MiB
    // shows as "63M".
    assert_eq!(
        luns[0].2.as_deref(),
        Some(iscsi_ls_size(64 * 2048 - 1, 512).as_str()),
        "ram:64M size:\n{text}"
    );
    // 16 TiB is beyond READ CAPACITY(10): the target must return LBA 0xFFFFFFFF there (SBC-3
    // 5.16), which iscsi-ls shows as "1T". The real size comes from READ CAPACITY(16) below.
    assert_eq!(
        luns[1].2.as_deref(),
        Some(iscsi_ls_size(0xFFFF_FFFF, 512).as_str()),
        "null:16T size:\n{text}"
    );
    let size = run_stdout("iscsi-readcapacity16", &["-s", &s.url(1)]);
    assert_eq!(
        size.trim(),
        (16u64 << 40).to_string(),
        "READ CAPACITY(16) total size of null:16T"
    );
    let size = run_stdout("iscsi-readcapacity16", &["-s", &s.url(0)]);
    assert_eq!(
        size.trim(),
        (64u64 << 20).to_string(),
        "READ CAPACITY(16) total size of ram:64M"
    );
    s.assert_alive();
}

// ---------------------------------------------------------------------------------------------
// 2. INQUIRY: standard data and VPD pages
// ---------------------------------------------------------------------------------------------

fn inq(s: &Server, lun: u32, page: Option<u8>) -> String {
    match page {
        None => run_stdout("iscsi-inq", &[&s.url(lun)]),
        // iscsi-inq parses -c as a decimal integer ("0x80" would silently become page 0).
        Some(p) => run_stdout("iscsi-inq", &["-e", "1", "-c", &p.to_string(), &s.url(lun)]),
    }
}

fn serial_of(page80: &str) -> String {
    let v = field(page80, "Unit Serial Number:")
        .unwrap_or_else(|| panic!("no serial number in page 0x80 output:\n{page80}"));
    v.trim_start_matches('[')
        .trim_end_matches(']')
        .trim()
        .to_string()
}

#[test]
fn iscsi_inq_reports_standard_and_vpd_pages() {
    if !require_tool("iscsi-inq") {
        return;
    }
    let mut s = Server::start(&["--lun", "file:lun.img:64M"]);

    let std_inq = inq(&s, 0, None);
    assert_eq!(
        field(&std_inq, "Vendor:"),
        Some("IRONSAN"),
        "vendor:\n{std_inq}"
    );
    assert_eq!(
        field(&std_inq, "Peripheral Device Type:"),
        Some("DIRECT_ACCESS"),
        "{std_inq}"
    );
    assert_eq!(
        field(&std_inq, "Peripheral Qualifier:"),
        Some("CONNECTED"),
        "{std_inq}"
    );
    assert_eq!(field(&std_inq, "Removable:"), Some("0"), "{std_inq}");
    assert_eq!(
        field(&std_inq, "CmdQue:"),
        Some("1"),
        "command queuing must be advertised:\n{std_inq}"
    );
    assert!(
        field(&std_inq, "Product:").is_some_and(|p| !p.is_empty()),
        "{std_inq}"
    );
    // libiscsi 1.19 names versions up to 5 (SPC-3) and prints "6 unknown" for SPC-4.
    let version = field(&std_inq, "Version:").unwrap_or_default();
    let version_num: u32 = version
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(
        version_num >= 5,
        "standard INQUIRY VERSION should be SPC-3 (5) or later: {version:?}\n{std_inq}"
    );

    // Supported VPD pages (0x00) must list what we ask for next.
    let pages = inq(&s, 0, Some(0x00));
    for p in ["0x00", "0x80", "0x83", "0xb0"] {
        assert!(
            pages.lines().any(|l| l.starts_with(&format!("Page:{p}"))),
            "page {p} not in supported VPD pages:\n{pages}"
        );
    }

    let page80 = inq(&s, 0, Some(0x80));
    let serial = serial_of(&page80);
    assert!(!serial.is_empty(), "empty unit serial number:\n{page80}");
    assert!(
        serial.chars().all(|c| c.is_ascii_graphic()),
        "serial {serial:?} is not printable ASCII"
    );

    let page83 = inq(&s, 0, Some(0x83));
    assert!(page83.contains("DEVICE_IDENTIFICATION"), "{page83}");
    assert!(
        page83.contains("Designator Type:(3) NAA"),
        "page 0x83 has no NAA designator:\n{page83}"
    );
    assert!(page83.contains("Association:(0) LOGICAL_UNIT"), "{page83}");

    let page_b0 = inq(&s, 0, Some(0xb0));
    for key in [
        "maximum transfer length:",
        "optimal transfer length:",
        "maximum compare and write length:",
    ] {
        let v = field(&page_b0, key)
            .unwrap_or_else(|| panic!("block limits page lacks {key:?}:\n{page_b0}"));
        v.parse::<u64>()
            .unwrap_or_else(|_| panic!("{key} {v:?} is not a number:\n{page_b0}"));
    }

    // The identity of a file LUN is stable across a restart on the same data directory.
    s.restart();
    let serial2 = serial_of(&inq(&s, 0, Some(0x80)));
    assert_eq!(
        serial2, serial,
        "unit serial number changed across a restart"
    );
    let page83_2 = inq(&s, 0, Some(0x83));
    assert_eq!(
        page83_2, page83,
        "device identification page changed across a restart"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. 64-bit capacity
// ---------------------------------------------------------------------------------------------

#[test]
fn readcapacity16_on_16t_null_lun() {
    if !require_tool("iscsi-readcapacity16") {
        return;
    }
    let s = Server::start(&["--lun", "null:16T"]);
    let out = run_stdout("iscsi-readcapacity16", &[&s.url(0)]);
    assert_eq!(
        field(&out, "RETURNED LOGICAL BLOCK ADDRESS:"),
        Some(((1u64 << 35) - 1).to_string().as_str()),
        "{out}"
    );
    assert_eq!(
        field(&out, "LOGICAL BLOCK LENGTH IN BYTES:"),
        Some("512"),
        "{out}"
    );
    assert_eq!(
        field(&out, "Total size:"),
        Some((16u64 << 40).to_string().as_str()),
        "{out}"
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Data integrity through qemu-img (a second initiator implementation's I/O path)
// ---------------------------------------------------------------------------------------------

/// Write `img` to `dst` (an iscsi:// URL or json: filename) with `qemu-img convert -n`, read
/// the whole LUN back into `out`, and return what was read.
fn qemu_round_trip(img: &std::path::Path, dst: &str, out: &std::path::Path) -> Vec<u8> {
    let img_s = img.display().to_string();
    let out_s = out.display().to_string();
    qemu_img_convert(&img_s, dst, true);
    let _ = std::fs::remove_file(out);
    qemu_img_convert(dst, &out_s, false);
    std::fs::read(out).unwrap()
}

#[test]
fn qemu_img_round_trip_is_byte_exact() {
    if !require_qemu_iscsi() {
        return;
    }
    // Zero-copy reads forced on (whatever the host's congestion control): the file LUN's
    // reads go to qemu's libiscsi by sendfile. LUN 2 is a file on tmpfs: qemu's large writes
    // are received straight into its pages (zero_copy_writes, on by default).
    let ctl_dir = tempfile::tempdir().unwrap();
    let sock = ctl_dir.path().join("control.sock").display().to_string();
    let shm = ShmFile::new("qemu");
    let shm_lun = format!("file:{}:64M", shm.0.display());
    let mut s = Server::start(&[
        "--lun",
        "file:lun.img:64M",
        "--lun",
        "ram:64M",
        "--lun",
        &shm_lun,
        "--zero-copy-reads",
        "on",
        "--control",
        &sock,
    ]);
    let tmp = tempfile::tempdir().unwrap();
    let data = random_bytes(32 * MIB, 4);
    let img = tmp.path().join("in.raw");
    std::fs::write(&img, &data).unwrap();

    for (lun, what) in [(0, "file LUN"), (1, "ram LUN"), (2, "tmpfs file LUN")] {
        let back = qemu_round_trip(&img, &s.url(lun), &tmp.path().join(format!("out{lun}.raw")));
        assert_eq!(
            back.len(),
            64 * MIB,
            "{what}: qemu-img read back {} bytes, the LUN has 64 MiB",
            back.len()
        );
        assert_same_bytes(
            &format!("{what}: first 32 MiB read back"),
            &back[..32 * MIB],
            &data,
        );
        assert!(
            back[32 * MIB..].iter().all(|&b| b == 0),
            "{what}: never-written second half does not read as zeros"
        );
    }
    // WCE=0 by default: acknowledged writes are on stable storage, so the backing file holds
    // them now, with the server still running.
    let file = std::fs::read(s.data_dir().join("lun.img")).unwrap();
    assert_eq!(file.len(), 64 * MIB, "backing file size");
    assert_same_bytes(
        "backing file after qemu-img wrote the LUN",
        &file[..32 * MIB],
        &data,
    );
    // The file LUN's 64 MiB (read back in large requests, every page cached after the
    // writes) went by sendfile.
    let out = run_stdout(bin(), &["ctl", "--control", &sock, "--json", "counters"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let zc = v["zero_copy_read_bytes"].as_u64().unwrap_or(0);
    assert!(
        zc >= 32 * MIB as u64,
        "file LUN reads did not go by sendfile: {out}"
    );
    // The tmpfs file holds what qemu-img wrote, most of it received in place.
    assert_same_bytes(
        "tmpfs backing file after qemu-img wrote the LUN",
        &std::fs::read(&shm.0).unwrap()[..32 * MIB],
        &data,
    );
    let placed = v["zero_copy_write_bytes"].as_u64().unwrap_or(0);
    assert!(
        placed >= 16 * MIB as u64,
        "qemu-img's writes to the tmpfs LUN were not received in place: {out}"
    );
    s.assert_alive();
}

/// A file on /dev/shm (tmpfs) for a LUN, removed when the test ends.
struct ShmFile(std::path::PathBuf);
impl ShmFile {
    fn new(name: &str) -> Self {
        let p = std::path::PathBuf::from(format!(
            "/dev/shm/ironsan-clients-{name}-{}.img",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&p);
        ShmFile(p)
    }
}
impl Drop for ShmFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn qemu_img_round_trip_with_crc32c_header_digests() {
    if !require_qemu_iscsi() {
        return;
    }
    // qemu's iscsi driver takes header-digest=crc32c (libiscsi then offers only CRC32C);
    // libiscsi never offers data digests. A recording relay in between checks that digests
    // were negotiated and that every PDU the target sent after login carries a correct one.
    let mut s = Server::start(&["--lun", "ram:64M"]);
    let sniff = Sniffer::start(s.addr());
    let tmp = tempfile::tempdir().unwrap();
    let data = random_bytes(16 * MIB, 5);
    let img = tmp.path().join("in.raw");
    std::fs::write(&img, &data).unwrap();
    let dst = s.qemu_json(0, Some(sniff.addr), &[("header-digest", "crc32c")]);
    let back = qemu_round_trip(&img, &dst, &tmp.path().join("out.raw"));
    assert_eq!(back.len(), 64 * MIB);
    assert_same_bytes("read back with header digests", &back[..16 * MIB], &data);

    let conns = sniff.captured();
    assert!(
        conns.len() >= 2,
        "expected the relay to see qemu-img's connections, saw {}",
        conns.len()
    );
    let mut ffp_pdus = 0;
    for (i, c) in conns.iter().enumerate() {
        let login_down = String::from_utf8_lossy(&c.down[..c.down.len().min(8192)]).into_owned();
        let login_up = String::from_utf8_lossy(&c.up[..c.up.len().min(8192)]).into_owned();
        assert!(
            login_up.contains("HeaderDigest=CRC32C\0"),
            "connection {i}: the initiator did not offer CRC32C only"
        );
        assert!(
            login_down.contains("HeaderDigest=CRC32C\0"),
            "connection {i}: the target did not answer HeaderDigest=CRC32C; its login text: {:?}",
            login_down
                .split('\0')
                .filter(|k| k.contains('='))
                .collect::<Vec<_>>()
        );
        let down = check_header_digests(&c.down, None)
            .unwrap_or_else(|e| panic!("connection {i}, target→initiator: {e}"));
        let up = check_header_digests(&c.up, Some(down.login_pdus)).unwrap_or_else(|e| {
            panic!(
                "connection {i}, initiator→target (libiscsi's digests; walker out of step?): {e}"
            )
        });
        assert!(
            down.verified > 0,
            "connection {i}: no PDU after login from the target"
        );
        assert!(
            up.verified > 0,
            "connection {i}: no PDU after login from the initiator"
        );
        eprintln!(
            "connection {i}: {} login PDUs, then {} target and {} initiator PDUs with correct CRC32C header digests",
            down.login_pdus, down.verified, up.verified
        );
        ffp_pdus += down.verified;
    }
    assert!(
        ffp_pdus > 100,
        "only {ffp_pdus} target PDUs with header digests checked"
    );
    s.assert_alive();
}

/// Data digests: no Debian initiator here negotiates them (libiscsi 1.19 always sends
/// DataDigest=None; open-iscsi needs the kernel), so the project's own initiator drives them
/// against the real binary: header + data CRC32C, a write larger than FirstBurstLength (R2T
/// and several Data-Out PDUs) and the read back (several Data-In PDUs).
#[tokio::test]
async fn header_and_data_digests_with_ironsan_initiator() {
    let mut s = Server::start(&["--lun", "ram:16M"]);
    let mut opts = ironsan_initiator::LoginOptions::new(Some(DEFAULT_TARGET));
    opts.header_digest = true;
    opts.data_digest = true;
    opts.max_recv_data_segment_length = 8192;
    let mut c = ironsan_initiator::Client::login(s.addr(), &opts)
        .await
        .expect("login with CRC32C digests");
    let neg = |k: &str| {
        c.negotiated
            .iter()
            .rev()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(
        neg("HeaderDigest").as_deref(),
        Some("CRC32C"),
        "negotiated: {:?}",
        c.negotiated
    );
    assert_eq!(
        neg("DataDigest").as_deref(),
        Some("CRC32C"),
        "negotiated: {:?}",
        c.negotiated
    );
    assert!(
        c.header_digest && c.data_digest,
        "client did not switch digests on"
    );

    let data = random_bytes(512 * 1024, 6);
    let r = c
        .write16(0, 100, data.clone().into(), 512, false)
        .await
        .expect("WRITE(16) with digests");
    assert_eq!(
        r.status,
        0,
        "WRITE(16) status {:#x}, sense {:?}",
        r.status,
        r.sense_key()
    );
    let r = c
        .read16(0, 100, (data.len() / 512) as u32, 512)
        .await
        .expect("READ(16) with digests");
    assert_eq!(
        r.status,
        0,
        "READ(16) status {:#x}, sense {:?}",
        r.status,
        r.sense_key()
    );
    assert_same_bytes("READ(16) after WRITE(16) with data digests", &r.data, &data);
    c.logout().await.expect("logout");
    s.assert_alive();
}

// ---------------------------------------------------------------------------------------------
// 5. Load: iscsi-perf (reads, many in flight) and qemu-img bench (writes)
// ---------------------------------------------------------------------------------------------

/// The final "iops average N (M MB/s)" of iscsi-perf (it redraws its line with '\r').
fn perf_iops(out: &str) -> u64 {
    let last = out
        .split(['\r', '\n'])
        .rev()
        .find_map(|l| l.trim().strip_prefix("iops average "))
        .unwrap_or_else(|| panic!("no final 'iops average' line in iscsi-perf output:\n{out}"));
    last.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("bad iops in {last:?}"))
}

#[test]
fn iscsi_perf_runs_reads_and_writes() {
    if !require_tool("iscsi-perf") || !require_qemu_iscsi() {
        return;
    }
    let mut s = Server::start(&["--lun", "ram:64M"]);
    let url = s.url(0);
    // Sequential 4 KiB reads, 32 in flight; then random 128 KiB reads (several Data-In PDUs
    // each), 16 in flight. -t N: run N seconds and print the average.
    for args in [
        vec!["-t", "2"],
        vec!["-t", "2", "-r", "-b", "256", "-m", "16"],
    ] {
        let mut a: Vec<&str> = args.clone();
        a.push(&url);
        let out = run_stdout("iscsi-perf", &a);
        assert!(
            out.contains("capacity is 131072 blocks"),
            "iscsi-perf saw a wrong capacity:\n{out}"
        );
        assert!(
            !out.contains("failed"),
            "iscsi-perf reported failures:\n{out}"
        );
        let iops = perf_iops(&out);
        assert!(iops > 0, "iscsi-perf {args:?}: 0 IOPS\n{out}");
        eprintln!("iscsi-perf {args:?}: {iops} IOPS");
    }
    // iscsi-perf only reads; qemu-img bench -w writes: 4 KiB writes of a pattern, 32 in flight,
    // wrapping over the whole 64 MiB LUN (20000 × 4 KiB > 64 MiB), with periodic flushes.
    let out = run_stdout(
        "qemu-img",
        &[
            "bench",
            "-f",
            "raw",
            "-w",
            "-c",
            "20000",
            "-d",
            "32",
            "-s",
            "4096",
            "--pattern=165",
            "--flush-interval=2000",
            &url,
        ],
    );
    assert!(
        out.contains("Run completed in"),
        "qemu-img bench did not complete:\n{out}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let back = tmp.path().join("back.raw");
    qemu_img_convert(&url, &back.display().to_string(), false);
    let back = std::fs::read(&back).unwrap();
    assert_eq!(back.len(), 64 * MIB);
    if let Some(i) = back.iter().position(|&b| b != 0xa5) {
        panic!(
            "after qemu-img bench wrote 0xa5 everywhere, byte {i} (block {}) reads {:#04x}",
            i / 512,
            back[i]
        );
    }
    s.assert_alive();
}

// ---------------------------------------------------------------------------------------------
// 7. Defaults: data directory, connect lines, durability across a restart
// ---------------------------------------------------------------------------------------------

#[test]
fn serve_default_creates_data_dir_and_prints_connect_lines() {
    if !require_qemu_iscsi() {
        return;
    }
    let mut s = Server::start(&[]);
    let portal = format!("127.0.0.1:{}", s.port);
    let stdout = s.stdout();
    let iscsiadm = stdout
        .lines()
        .find(|l| l.contains("iscsiadm"))
        .unwrap_or_else(|| panic!("no iscsiadm line on stdout:\n{stdout}"));
    assert!(
        iscsiadm.contains(&format!("-m discovery -t sendtargets -p {portal}"))
            && iscsiadm.contains(&format!("-T {DEFAULT_TARGET}")),
        "iscsiadm line does not name this portal and target: {iscsiadm}"
    );
    let ls = stdout
        .lines()
        .find(|l| l.contains("iscsi-ls"))
        .unwrap_or_else(|| panic!("no iscsi-ls line on stdout:\n{stdout}"));
    assert_eq!(
        ls.trim(),
        format!("iscsi-ls -s iscsi://{portal}"),
        "iscsi-ls line"
    );

    // The printed iscsi-ls command works as printed.
    if require_tool("iscsi-ls") {
        let args: Vec<&str> = ls.split_whitespace().collect();
        let text = run_stdout(args[0], &args[1..]);
        let listed = parse_iscsi_ls(&text);
        assert!(listed.len() == 1 && listed[0].luns.len() == 1, "{text}");
        assert_eq!(
            listed[0].luns[0].2.as_deref(),
            Some(iscsi_ls_size((1 << 21) - 1, 512).as_str()),
            "{text}"
        );
    }

    let lun0 = s.data_dir().join("lun0.img");
    let md = std::fs::metadata(&lun0).unwrap_or_else(|e| panic!("{}: {e}", lun0.display()));
    assert_eq!(md.len(), 1 << 30, "default LUN file size");
    assert!(
        md.blocks() * 512 <= 4 * MIB as u64,
        "lun0.img is not sparse: {} bytes allocated",
        md.blocks() * 512
    );

    // Write 1 MiB at offset 0 (qemu-img convert) and 1 MiB of 0x5a at 512 MiB (qemu-img bench).
    let tmp = tempfile::tempdir().unwrap();
    let head = random_bytes(MIB, 7);
    let img = tmp.path().join("head.raw");
    std::fs::write(&img, &head).unwrap();
    let url = s.url(0);
    qemu_img_convert(&img.display().to_string(), &url, true);
    run(
        "qemu-img",
        &[
            "bench",
            "-f",
            "raw",
            "-w",
            "-c",
            "16",
            "-d",
            "4",
            "-s",
            "65536",
            "-o",
            "536870912",
            "--pattern=90",
            &url,
        ],
    );

    let read_back = |s: &Server, skip_mib: usize, name: &str| -> Vec<u8> {
        let out = tmp.path().join(name);
        let _ = std::fs::remove_file(&out);
        run(
            "qemu-img",
            &[
                "dd",
                "-f",
                "raw",
                "-O",
                "raw",
                "bs=1M",
                // qemu-img dd's count includes the skipped blocks.
                &format!("count={}", skip_mib + 1),
                &format!("skip={skip_mib}"),
                &format!("if={}", s.url(0)),
                &format!("of={}", out.display()),
            ],
        );
        std::fs::read(&out).unwrap()
    };
    assert_same_bytes("offset 0 before restart", &read_back(&s, 0, "a.raw"), &head);
    assert_same_bytes(
        "offset 512 MiB before restart",
        &read_back(&s, 512, "b.raw"),
        &vec![0x5a; MIB],
    );

    s.restart();
    assert_same_bytes("offset 0 after restart", &read_back(&s, 0, "c.raw"), &head);
    assert_same_bytes(
        "offset 512 MiB after restart",
        &read_back(&s, 512, "d.raw"),
        &vec![0x5a; MIB],
    );
    let file = std::fs::read(&lun0).unwrap();
    assert_same_bytes("lun0.img at 0", &file[..MIB], &head);
    assert_same_bytes(
        "lun0.img at 512 MiB",
        &file[512 * MIB..513 * MIB],
        &vec![0x5a; MIB],
    );
    let md = std::fs::metadata(&lun0).unwrap();
    assert_eq!(md.len(), 1 << 30, "LUN file size after restart");
    assert!(
        md.blocks() * 512 <= 16 * MIB as u64,
        "lun0.img lost its sparseness: {} bytes allocated",
        md.blocks() * 512
    );
}

// ---------------------------------------------------------------------------------------------
// 8. Configuration file
// ---------------------------------------------------------------------------------------------

#[test]
fn config_file_serves_two_targets_on_two_portals() {
    if !require_tool("iscsi-ls") {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("ironsan-test-")
        .tempdir()
        .unwrap();
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let second = if ipv6_loopback_available() {
        SocketAddr::from((
            Ipv6Addr::LOCALHOST,
            free_port_on(Ipv6Addr::LOCALHOST.into()),
        ))
    } else {
        eprintln!("[::1] cannot be bound here: the second portal is IPv4");
        SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()))
    };
    let (t1, t2) = (
        "iqn.2026-11.org.ironsan:cfg-one",
        "iqn.2026-11.org.ironsan:cfg-two",
    );
    let config = dir.path().join("ironsan.toml");
    std::fs::write(
        &config,
        format!(
            r#"listen = ["{v4}", "{second}"]
data_dir = "{data}"

[[target]]
name = "{t1}"
alias = "one"

[[target.lun]]
backend = "file"
path = "one.img"
size = "32M"

[[target]]
name = "{t2}"

[[target.lun]]
spec = "ram:16M"

[[target.lun]]
backend = "null"
size = "2T"
"#,
            data = dir.path().join("data").display()
        ),
    )
    .unwrap();
    let s = Server::start_config(dir, &config, vec![v4, second], t1);
    assert!(
        s.data_dir().join("one.img").exists(),
        "file LUN not created under data_dir"
    );

    for portal in [v4, second] {
        let text = run_stdout("iscsi-ls", &["-s", &format!("iscsi://{portal}")]);
        eprintln!("iscsi-ls -s iscsi://{portal}:\n{text}");
        let listed = parse_iscsi_ls(&text);
        for (t, want) in [
            (t1, vec![iscsi_ls_size(32 * 2048 - 1, 512)]),
            (
                t2,
                vec![
                    iscsi_ls_size(16 * 2048 - 1, 512),
                    iscsi_ls_size(0xFFFF_FFFF, 512),
                ],
            ),
        ] {
            let blocks: Vec<&Listed> = listed.iter().filter(|l| l.target == t).collect();
            assert!(
                !blocks.is_empty(),
                "discovery on {portal} does not list {t}:\n{text}"
            );
            for b in blocks {
                let sizes: Vec<String> = b
                    .luns
                    .iter()
                    .map(|l| l.2.clone().unwrap_or_default())
                    .collect();
                assert_eq!(
                    sizes, want,
                    "LUNs of {t} via portal {} (discovered on {portal}):\n{text}",
                    b.portal
                );
            }
        }
        for l in &listed {
            let addr = l
                .portal
                .rsplit_once(',')
                .map(|(a, _)| a)
                .unwrap_or(&l.portal);
            assert!(
                addr == v4.to_string() || addr == second.to_string(),
                "SendTargets on {portal} reported portal {:?}, which is not one we listen on:\n{text}",
                l.portal
            );
        }
    }
}

#[test]
fn bad_config_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cases: &[(&str, usize)] = &[
        // (config text, line of the error)
        (&format!("listen = [\"127.0.0.1:{port}\"]\n\n[[target]]\nname = \"iqn.2026-11.org.ironsan:x\"\n[[target.lun]]\nspec = \"ram:12Q\"\n"), 6),
        (&format!("listen = [\"127.0.0.1:{port}\", \"nowhere\"]\n[[target]]\nname = \"iqn.2026-11.org.ironsan:x\"\n"), 1),
        ("[[target]]\nname = \"iqn.2026-11.org.ironsan:x\"\n\n[[target.lun]]\nspec = \"ram:1G\"\nbogus = true\n", 6),
        ("\n[[target]]\nname = \"Not A Valid Name\"\n[[target.lun]]\nspec = \"ram:1G\"\n", 3),
        ("[[target]]\nname = \"iqn.2026-11.org.ironsan:x\"\n[[target.lun]]\nbackend = \"tape\"\nsize = \"1G\"\n", 4),
        ("[[target]]\nname = \"iqn.2026-11.org.ironsan:x\"\n[[target.lun]\nspec = \"ram:1G\"\n", 3),
    ];
    for (i, (text, line)) in cases.iter().enumerate() {
        let f = dir.path().join(format!("bad{i}.toml"));
        std::fs::write(&f, text).unwrap();
        let fs = f.display().to_string();
        // A config that were accepted would make the server run: the timeout catches that.
        let out = run_unchecked(bin(), &["serve", "--config", &fs], Duration::from_secs(20));
        assert!(
            !out.status.success(),
            "config {i} was accepted:\n{text}\n{}",
            show(&out)
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("{fs}:{line}:")),
            "config {i}: stderr does not name {fs}:{line}:\n{text}\n{}",
            show(&out)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 9. Signals
// ---------------------------------------------------------------------------------------------

#[test]
fn sigterm_shuts_down_cleanly() {
    if !require_tool("iscsi-perf") {
        return;
    }
    let mut s = Server::start(&["--lun", "ram:64M"]);
    let mut perf = Background::spawn("iscsi-perf", &[&s.url(0)]);
    // iscsi-perf prints its progress line once a second of I/O has completed.
    perf.wait_for_stdout("iops current", Duration::from_secs(15));
    s.assert_alive();
    // 20 s only catches a hang; the order of events below is what is checked.
    let st = s.stop_within(Duration::from_secs(20));
    let st = st.unwrap_or_else(|| {
        panic!(
            "ironsan did not exit within 20 s of SIGTERM with a client connected\n{}\n{}",
            s.logs(),
            perf.output_text()
        )
    });
    assert_eq!(
        st.code(),
        Some(0),
        "ironsan exit status on SIGTERM: {st}\n{}",
        s.logs()
    );
    // The server exited because the initiator's session ended, not because the grace time
    // ran out: "every session has ended", and no session closed for not logging out.
    let log = s.stderr();
    assert!(
        log.contains("shutdown: every session has ended"),
        "the shutdown did not see every session end\n{log}"
    );
    assert!(
        !log.contains("did not log out"),
        "a session was closed at the end of the grace time\n{log}"
    );
    assert!(
        std::net::TcpStream::connect(s.addr()).is_err(),
        "the portal still accepts connections after exit"
    );
    // The initiator's session is gone: iscsi-perf ends (or keeps retrying a dead portal).
    let _ = perf.wait_timeout(Duration::from_secs(5));
}

// ---------------------------------------------------------------------------------------------
// 9. Authentication and authorization with real initiators (docs/SECURITY.md)
// ---------------------------------------------------------------------------------------------

const CHAP_USER: &str = "host1";
const CHAP_SECRET: &str = "host1-secret-0123";
const TARGET_USER: &str = "ironsan-disk";
const TARGET_SECRET: &str = "target-secret-4567";

/// A secret file (mode 0600) in a temporary directory; returns the directory (keep it alive)
/// and the `@PATH` flag form.
fn secret_file(secret: &str) -> (tempfile::TempDir, String) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("secret");
    std::fs::write(&p, format!("{secret}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    let at = format!("@{}", p.display());
    (dir, at)
}

/// `iscsi://USER%SECRET@HOST:PORT/TARGET/LUN` (libiscsi's URL form for CHAP).
fn chap_url(s: &Server, user: &str, secret: &str, lun: u32) -> String {
    format!("iscsi://{user}%{secret}@{}/{}/{lun}", s.addr(), s.target)
}

#[test]
fn chap_with_libiscsi_url() {
    if !require_tool("iscsi-inq") {
        return;
    }
    let (_d, at) = secret_file(CHAP_SECRET);
    let mut s = Server::start(&["--lun", "ram:16M", "--chap", &format!("{CHAP_USER}:{at}")]);
    let good = run_stdout("iscsi-inq", &[&chap_url(&s, CHAP_USER, CHAP_SECRET, 0)]);
    assert!(
        good.contains("IRONSAN") || good.to_lowercase().contains("ironsan"),
        "{good}"
    );
    // Wrong password, unknown user, no credentials: the login fails.
    for url in [
        chap_url(&s, CHAP_USER, "wrong-secret-0000", 0),
        chap_url(&s, "mallory", CHAP_SECRET, 0),
        s.url(0),
    ] {
        let out = run_unchecked("iscsi-inq", &[&url], DEFAULT_TIMEOUT);
        assert!(!out.status.success(), "{url} logged in:\n{}", show(&out));
    }
    // The secret is never logged, not even at debug level.
    let logs = s.logs();
    assert!(!logs.contains(CHAP_SECRET), "secret in the logs:\n{logs}");
    assert!(logs.contains("login failed"), "{logs}");
    s.assert_alive();
}

#[test]
fn mutual_chap_with_libiscsi() {
    if !require_tool("iscsi-inq") {
        return;
    }
    let (_d, at) = secret_file(TARGET_SECRET);
    let mut s = Server::start(&[
        "--lun",
        "ram:16M",
        "--chap",
        &format!("{CHAP_USER}:{CHAP_SECRET}"),
        "--mutual-chap",
        &format!("{TARGET_USER}:{at}"),
    ]);
    let url = chap_url(&s, CHAP_USER, CHAP_SECRET, 0);
    // libiscsi asks for mutual CHAP when it has target credentials: from the environment...
    let env_ok = [
        ("LIBISCSI_CHAP_TARGET_USERNAME", TARGET_USER),
        ("LIBISCSI_CHAP_TARGET_PASSWORD", TARGET_SECRET),
    ];
    let out = run_env("iscsi-inq", &[&url], &env_ok, DEFAULT_TIMEOUT);
    assert!(out.status.success(), "mutual CHAP via env:\n{}", show(&out));
    // ...or from the URL's query.
    let q = format!("{url}?target_user={TARGET_USER}&target_password={TARGET_SECRET}");
    let out = run_unchecked("iscsi-inq", &[&q], DEFAULT_TIMEOUT);
    assert!(out.status.success(), "mutual CHAP via URL:\n{}", show(&out));
    // The initiator refuses a target that does not know the target secret it expects.
    let env_bad = [
        ("LIBISCSI_CHAP_TARGET_USERNAME", TARGET_USER),
        ("LIBISCSI_CHAP_TARGET_PASSWORD", "not-the-target-secret"),
    ];
    let out = run_env("iscsi-inq", &[&url], &env_bad, DEFAULT_TIMEOUT);
    assert!(
        !out.status.success(),
        "wrong target secret accepted:\n{}",
        show(&out)
    );
    // Wrong initiator password with mutual CHAP: refused by the target.
    let out = run_env(
        "iscsi-inq",
        &[&chap_url(&s, CHAP_USER, "wrong-secret-0000", 0)],
        &env_ok,
        DEFAULT_TIMEOUT,
    );
    assert!(
        !out.status.success(),
        "wrong password accepted:\n{}",
        show(&out)
    );
    let logs = s.logs();
    assert!(
        !logs.contains(CHAP_SECRET) && !logs.contains(TARGET_SECRET),
        "{logs}"
    );
    s.assert_alive();
}

#[test]
fn qemu_img_with_chap() {
    if !require_qemu_iscsi() {
        return;
    }
    let mut s = Server::start(&[
        "--lun",
        "ram:16M",
        "--chap",
        &format!("{CHAP_USER}:{CHAP_SECRET}"),
    ]);
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("in.raw");
    let data = random_bytes(MIB, 11);
    std::fs::write(&img, &data).unwrap();
    let url = chap_url(&s, CHAP_USER, CHAP_SECRET, 0);
    let out = tmp.path().join("out.raw");
    let back = qemu_round_trip(&img, &url, &out);
    assert_same_bytes("qemu-img over CHAP", &back[..MIB], &data);
    let bad = run_unchecked(
        "qemu-img",
        &["info", &chap_url(&s, CHAP_USER, "wrong-secret-0000", 0)],
        DEFAULT_TIMEOUT,
    );
    assert!(
        !bad.status.success(),
        "wrong password accepted:\n{}",
        show(&bad)
    );
    s.assert_alive();
}

#[test]
fn discovery_chap_with_iscsi_ls() {
    if !require_tool("iscsi-ls") {
        return;
    }
    let mut s = Server::start(&[
        "--lun",
        "ram:16M",
        "--discovery-chap",
        "discover:discovery-secret-1",
    ]);
    let out = run_unchecked("iscsi-ls", &[&s.portal_url()], DEFAULT_TIMEOUT);
    assert!(
        !out.status.success(),
        "discovery without CHAP:\n{}",
        show(&out)
    );
    let url = format!("iscsi://discover%discovery-secret-1@{}", s.addr());
    let text = run_stdout("iscsi-ls", &[&url]);
    let listed = parse_iscsi_ls(&text);
    assert_eq!(listed.len(), 1, "{text}");
    assert_eq!(listed[0].target, DEFAULT_TARGET);
    s.assert_alive();
}

#[test]
fn acl_hides_targets_in_sendtargets() {
    if !require_tools(&["iscsi-ls", "iscsi-inq"]) {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("ironsan-test-")
        .tempdir()
        .unwrap();
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let (open, closed) = (
        "iqn.2026-11.org.ironsan:open",
        "iqn.2026-11.org.ironsan:closed",
    );
    let allowed = "iqn.2026-11.org.ironsan:allowed-host";
    let other = "iqn.2026-11.org.ironsan:other-host";
    let cfg = dir.path().join("ironsan.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"listen = ["{addr}"]
data_dir = "{data}"
[[target]]
name = "{open}"
[[target.lun]]
spec = "ram:16M"
[[target]]
name = "{closed}"
acl = ["{allowed}", "iqn.2026-11.org.ironsan:ops-*@127.0.0.0/8"]
[[target.lun]]
spec = "ram:16M"
"#,
            data = dir.path().join("data").display()
        ),
    )
    .unwrap();
    let mut s = Server::start_config(dir, &cfg, vec![addr], open);
    let portal = format!("iscsi://{addr}");
    let names = |initiator: &str| -> Vec<String> {
        let text = run_stdout("iscsi-ls", &["-i", initiator, &portal]);
        let mut v: Vec<String> = parse_iscsi_ls(&text)
            .into_iter()
            .map(|l| l.target)
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(allowed), vec![closed.to_string(), open.to_string()]);
    assert_eq!(
        names("iqn.2026-11.org.ironsan:ops-7"),
        vec![closed.to_string(), open.to_string()]
    );
    assert_eq!(names(other), vec![open.to_string()]);
    // Logging in anyway is refused (0202 authorization failure).
    let url = format!("iscsi://{addr}/{closed}/0");
    let out = run_unchecked("iscsi-inq", &["-i", other, &url], DEFAULT_TIMEOUT);
    assert!(!out.status.success(), "ACL bypassed:\n{}", show(&out));
    run_stdout("iscsi-inq", &["-i", allowed, &url]);
    s.assert_alive();
}

#[test]
fn identical_chap_secrets_are_a_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_unchecked(
        bin(),
        &[
            "serve",
            "--data-dir",
            &dir.path().join("d").display().to_string(),
            "--chap",
            "u:same-secret-1234",
            "--mutual-chap",
            "t:same-secret-1234",
        ],
        Duration::from_secs(30),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--mutual-chap") && err.contains("differ"),
        "{err}"
    );
    assert!(!err.contains("same-secret-1234"), "secret echoed: {err}");
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        "[[target]]\nname = \"iqn.2026-11.org.x:a\"\nchap = { user = \"u\", secret = \"same-secret-1234\" }\nmutual_chap = { user = \"t\", secret = \"same-secret-1234\" }\n[[target.lun]]\nspec = \"ram:1G\"\n",
    )
    .unwrap();
    let out = run_unchecked(
        bin(),
        &["serve", "--config", &cfg.display().to_string()],
        Duration::from_secs(30),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:4: ", cfg.display())) && err.contains("differ"),
        "{err}"
    );
    assert!(!err.contains("same-secret-1234"), "secret echoed: {err}");
}

// ---------------------------------------------------------------------------------------------
// 10. Service management: sd_notify, graceful shutdown, the control socket (docs/OPERATIONS.md)
// ---------------------------------------------------------------------------------------------

/// Kills the child on drop (a failed assertion must not leave a server running).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One datagram from the notify socket (5 s at most).
fn recv_notify(sock: &std::os::unix::net::UnixDatagram, what: &str) -> String {
    let mut buf = [0u8; 1024];
    let n = sock
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("no {what} datagram on NOTIFY_SOCKET: {e}"));
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// `ironsan serve` of a 1 MiB RAM LUN on `addr` (no control socket, data in `dir`/data,
/// output discarded) with `NOTIFY_SOCKET` at `dir`/notify.sock, after `env` set more of its
/// environment. Returns that socket (15 s read timeout) and the process.
fn serve_notifying(
    dir: &std::path::Path,
    addr: SocketAddr,
    env: impl FnOnce(&mut std::process::Command),
) -> (std::os::unix::net::UnixDatagram, KillOnDrop) {
    let notify_path = dir.join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let mut cmd = std::process::Command::new(bin());
    cmd.args(["serve", "--listen", &addr.to_string(), "--lun", "ram:1M"])
        .args(["--control", "none", "--data-dir"])
        .arg(dir.join("data"))
        .env("NOTIFY_SOCKET", &notify_path)
        .env_remove("IRONSAN_LOG")
        .env_remove("IRONSAN_CONFIG")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    env(&mut cmd);
    let child = cmd.spawn().expect("starting ironsan serve");
    (sock, KillOnDrop(child))
}

#[test]
fn sd_notify_ready_once_the_portal_accepts_and_stopping_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let (sock, mut child) = serve_notifying(dir.path(), addr, |_| {});
    let ready = recv_notify(&sock, "READY=1");
    // The portal accepts by the time READY=1 arrives: no retry here.
    let accepted = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1));
    assert!(
        ready.lines().next() == Some("READY=1"),
        "first notification: {ready:?}"
    );
    assert!(
        accepted.is_ok(),
        "READY=1 was sent before {addr} accepted: {accepted:?}"
    );
    drop(accepted);
    signal(child.0.id(), "TERM");
    let stopping = recv_notify(&sock, "STOPPING=1");
    assert!(
        stopping.lines().next() == Some("STOPPING=1"),
        "notification after SIGTERM: {stopping:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let st = loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "no exit within 10 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(st.code(), Some(0), "exit status {st}");
}

/// With `$WATCHDOG_USEC` (and no `$WATCHDOG_PID` naming another process) serve pings the
/// notify socket with `WATCHDOG=1` every half interval after `READY=1`. Only that messages
/// arrive is checked, not their timing.
#[test]
fn sd_notify_watchdog_pings_when_watchdog_usec_is_set() {
    let dir = tempfile::tempdir().unwrap();
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let (sock, _child) = serve_notifying(dir.path(), addr, |c| {
        c.env("WATCHDOG_USEC", "200000").env_remove("WATCHDOG_PID");
    });
    let ready = recv_notify(&sock, "READY=1");
    assert_eq!(ready.lines().next(), Some("READY=1"), "{ready:?}");
    // 100 ms apart: at least two within a second (a slow CI machine gets 3 s).
    let mut pings = 0;
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut other = Vec::new();
    while pings < 2 && Instant::now() < deadline {
        sock.set_read_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))
        .unwrap();
        let mut buf = [0u8; 1024];
        match sock.recv(&mut buf) {
            Ok(n) if &buf[..n] == b"WATCHDOG=1" => pings += 1,
            Ok(n) => other.push(String::from_utf8_lossy(&buf[..n]).into_owned()),
            Err(_) => break,
        }
    }
    assert!(
        pings >= 2,
        "{pings} WATCHDOG=1 datagram(s) after READY=1; others: {other:?}"
    );
}

/// `ironsan ctl portal add/remove` on a running serve: the new portal serves logins and
/// discovery, `ctl save` writes it (and `[limits]`) to the --config file, removing it refuses
/// new connections while the session that came in through it goes on, and SIGHUP re-applies
/// the saved file, which brings it back.
#[tokio::test]
async fn ctl_portal_add_remove_save_and_reload() {
    use ironsan_initiator::{Client, LoginOptions};
    let dir = tempfile::tempdir().unwrap();
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let sock = dir.path().join("control.sock");
    let sock_s = sock.display().to_string();
    let config = write_ram_config(
        dir.path(),
        addr,
        &sock_s,
        "\n[limits]\nshutdown_grace = \"1s\"\nmax_sessions = 77\n",
    );
    let s = Server::start_config(dir, &config, vec![addr], DEFAULT_TARGET);
    let ctl = |args: &[&str]| {
        let mut full = vec!["ctl", "--control", &sock_s];
        full.extend_from_slice(args);
        run_unchecked(bin(), &full, Duration::from_secs(30))
    };
    let text = |o: &std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    let addr2 = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let a2 = addr2.to_string();
    let out = ctl(&["portal", "add", &a2, "--tag", "2"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("portal {a2} (group 2) added")),
        "{}",
        text(&out)
    );
    let out = ctl(&["portal", "add", &a2]);
    assert!(!out.status.success(), "a duplicate was accepted");
    assert!(
        text(&out).contains(&format!("portal {a2} already exists")),
        "{}",
        text(&out)
    );
    let out = ctl(&["portals"]);
    let listed = text(&out);
    assert!(
        listed.lines().any(|l| l
            .split_whitespace()
            .eq([addr.to_string().as_str(), "1", "iscsi"]))
            && listed
                .lines()
                .any(|l| l.split_whitespace().eq([a2.as_str(), "2", "iscsi"])),
        "{listed}"
    );

    // Discovery and a login through the new portal.
    let opts = LoginOptions::new(Some(DEFAULT_TARGET));
    let mut c = Client::login(addr2, &opts)
        .await
        .expect("login on the new portal");
    let tag = c
        .negotiated
        .iter()
        .rev()
        .find(|(k, _)| k == "TargetPortalGroupTag")
        .map(|(_, v)| v.clone());
    assert_eq!(tag.as_deref(), Some("2"));
    let mut d = Client::login(addr, &LoginOptions::new(None)).await.unwrap();
    let pairs = d.send_targets("All").await.unwrap();
    assert!(
        pairs.contains(&("TargetAddress".to_string(), format!("{a2},2"))),
        "{pairs:?}"
    );

    // save writes the running portals and [limits] back to the --config file.
    let out = ctl(&["save"]);
    assert!(out.status.success(), "{}", text(&out));
    let saved = std::fs::read_to_string(&config).unwrap();
    for want in [
        format!("[[portal_group]]\ntag = 1\nlisten = [\"{addr}\"]"),
        format!("[[portal_group]]\ntag = 2\nlisten = [\"{a2}\"]"),
        "[limits]\n".to_string(),
        "max_sessions = 77\n".to_string(),
        "shutdown_grace = \"1s\"\n".to_string(),
    ] {
        assert!(saved.contains(&want), "{want}\n---\n{saved}");
    }

    // Removed: refused at once, the session on it goes on.
    let out = ctl(&["portal", "remove", &a2]);
    assert!(out.status.success(), "{}", text(&out));
    let refused = std::net::TcpStream::connect_timeout(&addr2, Duration::from_secs(2));
    assert!(
        refused.is_err(),
        "{addr2} still accepts after portal remove"
    );
    let r = c
        .read16(0, 0, 1, 512)
        .await
        .expect("READ(16) after the portal went");
    assert_eq!(r.status, 0);
    let out = ctl(&["portals"]);
    assert!(!text(&out).contains(&a2), "{}", text(&out));

    // SIGHUP applies the saved file: the portal is back.
    signal(s.pid(), "HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect_timeout(&addr2, Duration::from_secs(1)).is_err() {
        assert!(
            Instant::now() < deadline,
            "SIGHUP did not bring {addr2} back\n{}",
            s.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The line is logged once the reload is done, after the portal is bound (so possibly
    // after it accepts).
    let line = format!("SIGHUP: + portal {a2} (group 2)");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !s.stderr().contains(&line) {
        assert!(
            Instant::now() < deadline,
            "no {line:?} logged within 10 s of the portal accepting\n{}",
            s.stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _c2 = Client::login(addr2, &opts)
        .await
        .expect("login after SIGHUP");
}

/// Receive until an Async Message arrives (NOP-Ins are skipped); returns (event, parameter3).
async fn next_async_message(c: &mut ironsan_initiator::Client) -> (u8, u16) {
    loop {
        let pdu = tokio::time::timeout(Duration::from_secs(5), c.recv())
            .await
            .expect("no Async Message within 5 s of SIGTERM")
            .expect("connection closed before the Async Message");
        if let ironsan_proto::pdu::Header::AsyncMessage(m) = pdu.header {
            return (m.async_event, m.parameter3);
        }
    }
}

/// SIGTERM with two idle sessions: both get Async Message event 1 ("please log out within
/// Parameter3 seconds" = shutdown_grace); one logs out, the other does not and is closed once
/// the grace time is over; the process exits 0 just after it, not before.
#[tokio::test]
async fn sigterm_asks_initiators_to_log_out_and_exits_within_the_grace_time() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let config = write_ram_config(
        dir.path(),
        addr,
        "none",
        "\n[limits]\nshutdown_grace = \"2s\"\n",
    );
    let mut s = Server::start_config(dir, &config, vec![addr], DEFAULT_TARGET);
    let opts = ironsan_initiator::LoginOptions::new(Some(DEFAULT_TARGET));
    let mut polite = ironsan_initiator::Client::login(addr, &opts)
        .await
        .expect("login (polite)");
    let mut idle_opts = opts.clone();
    idle_opts.initiator_name = "iqn.2026-11.org.ironsan:idle-initiator".into();
    let mut idle = ironsan_initiator::Client::login(addr, &idle_opts)
        .await
        .expect("login (idle)");
    let r = polite.read16(0, 0, 1, 512).await.expect("READ(16)");
    assert_eq!(r.status, 0);

    let t0 = Instant::now();
    signal(s.pid(), "TERM");
    assert_eq!(
        next_async_message(&mut polite).await,
        (1, 2),
        "Async Message to the polite session: (event, parameter3)"
    );
    assert_eq!(
        next_async_message(&mut idle).await,
        (1, 2),
        "Async Message to the idle session: (event, parameter3)"
    );
    // The server still serves while draining: a command and the logout are answered.
    let r = polite
        .read16(0, 0, 1, 512)
        .await
        .expect("READ(16) while draining");
    assert_eq!(r.status, 0);
    assert_eq!(
        polite.logout().await.expect("logout while draining"),
        ironsan_proto::pdu::LogoutResponseCode::CLOSED
    );
    // 20 s only catches a hang; that the configured grace time was used is read from the log.
    let st = s.wait_exit(Duration::from_secs(20));
    let took = t0.elapsed();
    let st = st.unwrap_or_else(|| panic!("no exit within 20 s of SIGTERM\n{}", s.logs()));
    assert_eq!(st.code(), Some(0), "exit status {st}\n{}", s.logs());
    // Not before the grace time (a lower bound: a loaded machine only makes it later).
    assert!(
        took >= Duration::from_millis(1900),
        "SIGTERM → exit took {took:?}, less than the 2 s grace time, with a session that does not log out\n{}",
        s.logs()
    );
    let log = s.stderr();
    assert!(
        log.contains("waiting up to 2s"),
        "the shutdown did not wait the configured 2 s grace time\n{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("logout") && l.contains("initiator=")),
        "no logout line with the initiator name\n{log}"
    );
    assert!(
        log.lines().any(|l| l.contains("did not log out")
            && l.contains("iqn.2026-11.org.ironsan:idle-initiator")),
        "no line naming the session that did not log out\n{log}"
    );
    // The idle session was closed by the target.
    let closed = tokio::time::timeout(Duration::from_secs(2), idle.recv()).await;
    assert!(
        matches!(closed, Ok(Err(_))),
        "idle session not closed: {:?}",
        closed.map(|r| r.map(|_| ()))
    );
}

#[test]
fn ctl_sessions_shows_negotiated_keys_for_a_libiscsi_session() {
    if !require_tool("iscsi-perf") {
        return;
    }
    let ctl_dir = tempfile::tempdir().unwrap();
    let sock = ctl_dir.path().join("control.sock");
    let sock_s = sock.display().to_string();
    let s = Server::start(&["--lun", "ram:64M", "--control", &sock_s]);
    let mut perf = Background::spawn("iscsi-perf", &[&s.url(0)]);
    perf.wait_for_stdout("iops current", Duration::from_secs(15));
    // Flags anywhere on the line (clap subcommands with global flags).
    let out = run_stdout(bin(), &["ctl", "sessions", "--json", "--control", &sock_s]);
    let v: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("ctl sessions --json is not JSON ({e}):\n{out}"));
    // The same as a table, and the exit statuses scripts test: 1 refused by the target (one
    // line, no backtrace), 2 a bad command line, 3 no control socket there.
    let text = run_stdout(bin(), &["ctl", "--control", &sock_s, "sessions"]);
    assert!(
        text.contains("negotiated:") && text.contains(DEFAULT_TARGET),
        "{text}"
    );
    let ctl = |args: &[&str]| {
        let mut full = vec!["ctl", "--control", &sock_s];
        full.extend_from_slice(args);
        run_env(
            bin(),
            &full,
            &[("RUST_BACKTRACE", "1")],
            Duration::from_secs(30),
        )
    };
    let o = ctl(&["lun", "remove", "iqn.2026-11.org.nope:x", "0"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("ironsan ctl: ") && err.contains("iqn.2026-11.org.nope:x"),
        "{err}"
    );
    assert_eq!(
        ctl(&["lun", "remove", DEFAULT_TARGET, "zero"])
            .status
            .code(),
        Some(2)
    );
    let gone = ctl_dir.path().join("nobody.sock").display().to_string();
    let o = run_unchecked(
        bin(),
        &["ctl", "luns", "--control", &gone],
        Duration::from_secs(30),
    );
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let sessions = v
        .as_array()
        .unwrap_or_else(|| panic!("not an array:\n{out}"));
    let sess = sessions
        .iter()
        .find(|x| x["type"] == "normal")
        .unwrap_or_else(|| panic!("no normal session:\n{out}"));
    assert_eq!(sess["target"], DEFAULT_TARGET, "{out}");
    assert!(
        sess["initiator"]
            .as_str()
            .is_some_and(|i| i.starts_with("iqn.")),
        "{out}"
    );
    let p = &sess["params"];
    let num = |k: &str| -> u64 {
        p[k].as_str()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{k} missing or not a number:\n{out}"))
    };
    for k in ["HeaderDigest", "DataDigest"] {
        assert!(
            matches!(p[k].as_str(), Some("None" | "CRC32C")),
            "{k}: {}\n{out}",
            p[k]
        );
    }
    for k in ["ImmediateData", "InitialR2T"] {
        assert!(
            matches!(p[k].as_str(), Some("Yes" | "No")),
            "{k}: {}\n{out}",
            p[k]
        );
    }
    for k in [
        "MaxRecvDataSegmentLength",
        "MaxBurstLength",
        "FirstBurstLength",
    ] {
        let n = num(k);
        assert!((512..=(1 << 24) - 1).contains(&n), "{k} = {n}\n{out}");
    }
    assert!(num("FirstBurstLength") <= num("MaxBurstLength"), "{out}");
    let conn = &sess["connections"][0];
    assert_eq!(conn["portal"], s.addr().to_string(), "{out}");
    assert!(
        conn["reads"].as_u64().unwrap_or(0) > 0,
        "no reads counted:\n{out}"
    );
    let tcp = &conn["tcp"];
    let t = |k: &str| {
        tcp[k]
            .as_u64()
            .unwrap_or_else(|| panic!("tcp.{k} missing:\n{out}"))
    };
    assert!(t("rtt_us") > 0, "rtt 0:\n{out}");
    assert!(t("rtt_us") < 5_000_000, "rtt over 5 s on loopback:\n{out}");
    assert!(t("cwnd") > 0, "cwnd 0:\n{out}");
    assert!(t("mss") > 0, "mss 0:\n{out}");
    let _ = t("retransmits");
    let _ = t("delivery_rate");
    let _ = perf.child.kill();
}

// ---------------------------------------------------------------------------------------------
// The load generator (`ironsan load`) against ironsan and the peers the benchmark uses
// ---------------------------------------------------------------------------------------------

/// `ironsan load URL ARGS --json`: the parsed result, or the whole output on failure.
fn load(url: &str, args: &[&str]) -> Result<serde_json::Value, String> {
    let mut a = vec!["load", url, "--json"];
    a.extend_from_slice(args);
    let out = run_unchecked(bin(), &a, Duration::from_secs(120));
    if !out.status.success() {
        return Err(show(&out));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("{e}: {}", show(&out)))
}

/// Stamp every block of the 64 MiB LUN behind `url` (64 KiB writes, then 512 KiB writes that
/// need R2Ts past the first burst, then 4 KiB writes at random), then read it back at random
/// (4 KiB, QD32) and in 512 KiB pieces from 4 sessions, checking every stamp.
fn load_round_trip(url: &str) {
    let u64_of = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(u64::MAX);
    let w = load(
        url,
        &[
            "--rw", "write", "--bs", "65536", "--qd", "4", "--count", "1024", "--verify",
        ],
    )
    .unwrap_or_else(|e| panic!("write pass on {url}: {e}"));
    assert_eq!(u64_of(&w, "blocks"), 131_072, "{w}");
    assert_eq!((u64_of(&w, "ios"), u64_of(&w, "failed")), (1024, 0), "{w}");
    assert_eq!(u64_of(&w, "bytes"), 64 << 20, "{w}");
    let w = load(
        url,
        &[
            "--rw", "write", "--bs", "524288", "--qd", "8", "--count", "200", "--verify",
        ],
    )
    .unwrap_or_else(|e| panic!("512 KiB write pass on {url}: {e}"));
    assert_eq!((u64_of(&w, "ios"), u64_of(&w, "failed")), (200, 0), "{w}");
    // 4 KiB writes at QD32 carry their data as immediate data, handed to the backend as
    // slices of the receive buffer while later PDUs keep arriving (`io::RecvBuf`): the reads
    // below check the stamps they left.
    let w = load(
        url,
        &[
            "--rw",
            "randwrite",
            "--bs",
            "4096",
            "--qd",
            "32",
            "--count",
            "4000",
            "--verify",
        ],
    )
    .unwrap_or_else(|e| panic!("4 KiB random write pass on {url}: {e}"));
    assert_eq!((u64_of(&w, "ios"), u64_of(&w, "failed")), (4000, 0), "{w}");
    for args in [
        &["--rw", "randread", "--qd", "32", "-t", "1", "--verify"][..],
        &[
            "--rw",
            "read",
            "--bs",
            "524288",
            "--qd",
            "8",
            "--sessions",
            "4",
            "-t",
            "1",
            "--verify",
        ],
    ] {
        let r = load(url, args).unwrap_or_else(|e| panic!("{args:?} on {url}: {e}"));
        assert!(u64_of(&r, "ios") > 0, "{r}");
        assert_eq!(u64_of(&r, "failed"), 0, "{r}");
        assert_eq!(u64_of(&r, "verify_failures"), 0, "{r}");
        assert!(r["lat_p50_us"].as_f64().unwrap_or(0.0) > 0.0, "{r}");
        eprintln!("ironsan load {args:?} on {url}: {r}");
    }
}

/// The binary's memory set-up (`src/alloc.rs`): mimalloc without transparent huge pages, and
/// the memory of a RAM LUN's data goes back to the kernel when the data goes, although the
/// target is idle then (mimalloc alone returns memory only while the process allocates).
#[test]
fn ram_lun_memory_goes_back_to_the_kernel_when_the_data_goes() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("control.sock").display().to_string();
    let s = Server::start(&["--lun", "ram:128M", "--control", &sock]);
    let status =
        |field| proc_status(s.pid(), field).unwrap_or_else(|| panic!("no {field} for the server"));
    assert_eq!(status("THP_enabled:"), 0, "huge pages not turned off");
    let w = load(
        &s.url(0),
        &[
            "--rw", "write", "--bs", "524288", "--qd", "8", "--count", "256",
        ],
    )
    .unwrap_or_else(|e| panic!("filling the LUN: {e}"));
    assert_eq!(w["failed"].as_u64(), Some(0), "{w}");
    let full = status("VmRSS:");
    assert!(full >= 128 << 10, "128 MiB written, RSS {full} kB");
    let out = run_unchecked(
        bin(),
        &[
            "ctl",
            "--control",
            &sock,
            "lun",
            "resize",
            &s.target,
            "0",
            "1M",
        ],
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "{}", show(&out));
    // The resize returns once the backend has handed the memory back; mimalloc by itself
    // would return it only with later allocations, seconds or never on an idle target.
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut now = status("VmRSS:");
    while full.saturating_sub(now) < 96 << 10 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        now = status("VmRSS:");
    }
    assert!(
        full.saturating_sub(now) >= 96 << 10,
        "RSS {full} kB with 128 MiB stored, still {now} kB after shrinking the LUN to 1 MiB"
    );
}

/// What bench/classic.sh builds on: a mixed pattern sends the share of writes asked for
/// (`--rwmixread`, fio's), its reads find the stamps its writes and the fill left, and
/// sessions alternate over several URLs (two portals of one target here: the MPIO and
/// striping experiments), each reporting its own figures.
#[test]
fn load_generator_mixes_reads_and_writes_and_spreads_sessions_over_urls() {
    let second = SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), free_port()));
    let second_s = second.to_string();
    let s = Server::start(&["--lun", "ram:64M", "--listen", &second_s]);
    let first = format!("127.0.0.1:{}", s.port);
    let u1 = s.url(0);
    let u2 = u1.replace(&first, &second_s);
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(u64::MAX);
    let w = load(
        &u1,
        &[
            "--rw", "write", "--bs", "524288", "--qd", "8", "--count", "128", "--verify",
        ],
    )
    .unwrap_or_else(|e| panic!("filling the LUN: {e}"));
    assert_eq!(
        (n(&w, "ios"), n(&w, "writes"), n(&w, "failed")),
        (128, 128, 0),
        "{w}"
    );
    let r = load(
        &u1,
        &[
            &u2,
            "--sessions",
            "4",
            "--rw",
            "randrw",
            "--rwmixread",
            "70",
            "--count",
            "5000",
            "--verify",
        ],
    )
    .unwrap_or_else(|e| panic!("70/30 mix over two portals: {e}"));
    assert_eq!((n(&r, "ios"), n(&r, "failed")), (20_000, 0), "{r}");
    assert_eq!(n(&r, "verify_failures"), 0, "{r}");
    // 30 % of 20,000 is 6,000 (a binomial deviation of 65): far from both pure patterns.
    let writes = n(&r, "writes");
    assert!(
        (5_000..7_000).contains(&writes),
        "{writes} writes of 20,000: {r}"
    );
    let per: Vec<(String, u64)> = r["per_session"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|x| (x["portal"].as_str().unwrap_or("").to_string(), n(x, "ios")))
                .collect()
        })
        .unwrap_or_default();
    let want: Vec<(String, u64)> = [&first, &second_s, &first, &second_s]
        .iter()
        .map(|p| (p.to_string(), 5_000))
        .collect();
    assert_eq!(per, want, "{r}");
    // The ends of the range: all writes, all reads; and a percentage past 100 is refused.
    let r = load(&u2, &["--rw", "rw", "--rwmixread", "0", "--count", "300"])
        .unwrap_or_else(|e| panic!("rwmixread 0: {e}"));
    assert_eq!((n(&r, "ios"), n(&r, "writes")), (300, 300), "{r}");
    let r = load(&u2, &["--rw", "rw", "--rwmixread", "100", "--count", "300"])
        .unwrap_or_else(|e| panic!("rwmixread 100: {e}"));
    assert_eq!((n(&r, "ios"), n(&r, "writes")), (300, 0), "{r}");
    let err = load(&u1, &["--rw", "randrw", "--rwmixread", "101"]).expect_err("101 % accepted");
    assert!(err.contains("101"), "{err}");
}

#[test]
fn load_generator_verifies_every_block_on_ironsan() {
    let s = Server::start(&["--lun", "ram:64M", "--lun", "ram:64M"]);
    load_round_trip(&s.url(0));
    // Negative control: LUN 1 was never written, so its stamps are wrong and the run fails.
    let err = load(
        &s.url(1),
        &["--rw", "randread", "--count", "100", "--verify"],
    )
    .expect_err("reading never-written blocks passed verification");
    assert!(err.contains("reads returned wrong data"), "{err}");
    // A bad URL and a size that is not a multiple of the block size are refused clearly.
    let out = run_unchecked(
        bin(),
        &["load", "iscsi://127.0.0.1/x"],
        Duration::from_secs(10),
    );
    assert!(
        !out.status.success() && show(&out).contains("no LUN"),
        "{}",
        show(&out)
    );
    let err = load(&s.url(0), &["--bs", "1000"]).expect_err("bs 1000 accepted");
    assert!(
        err.contains("not a multiple of the block size 512"),
        "{err}"
    );
}

#[test]
fn load_generator_verifies_every_block_on_tgt_and_istgt() {
    if !require_tools(&["tgtd", "tgtadm", "istgt"]) {
        return;
    }
    let root = env!("CARGO_MANIFEST_DIR");
    for (peer, extra) in [
        ("tgt", vec!["--lun", "rdwr:64M"]),
        ("istgt", vec!["--file", "PATH", "--size", "64M"]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let img = format!("{d}/lun.img");
        let script = format!("{root}/bench/peer-{peer}.sh");
        let port = free_port().to_string();
        let mut args = vec![script.as_str(), "start", "--port", &port, "--dir", &d];
        args.extend(
            extra
                .iter()
                .map(|a| if *a == "PATH" { img.as_str() } else { a }),
        );
        let out = run_unchecked("bash", &args, Duration::from_secs(60));
        assert!(out.status.success(), "{peer} did not start: {}", show(&out));
        let url = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let result = std::panic::catch_unwind(|| load_round_trip(&url));
        run_unchecked(
            "bash",
            &[&script, "stop", "--dir", &d],
            Duration::from_secs(60),
        );
        if let Err(e) = result {
            std::panic::resume_unwind(e);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// File LUNs' I/O engines: io_uring (the default where the kernel allows it) and I/O threads
// ---------------------------------------------------------------------------------------------

/// An O_DIRECT file LUN (BLOCKIO) on a disk file system served with each engine: every block
/// written and read back through `ironsan load --verify` (4K..512K, QD4..32, 4 sessions), and
/// `ctl luns` names the engine that did it.
#[test]
fn file_luns_verify_every_block_with_io_uring_and_with_threads() {
    for (engine, shown) in [("uring", "io_uring"), ("threads", "threads")] {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("control.sock").display().to_string();
        let s = Server::start(&[
            "--io-engine",
            engine,
            "--lun",
            "file:direct.img:64M,direct",
            "--lun",
            "file:buffered.img:64M",
            "--control",
            &sock,
        ]);
        let luns = run_stdout(bin(), &["ctl", "--control", &sock, "--json", "luns"]);
        let luns: serde_json::Value = serde_json::from_str(&luns).unwrap();
        let fs_is_tmpfs = luns[1]["io_engine"] == "inline";
        let text = run_stdout(bin(), &["ctl", "--control", &sock, "luns"]);
        assert!(
            text.lines().next().unwrap_or("").contains("ENGINE")
                && text
                    .lines()
                    .any(|l| l.contains("direct.img") && l.contains(shown)),
            "{text}"
        );
        for lun in 0..2 {
            let want = if lun == 1 && fs_is_tmpfs {
                "inline"
            } else {
                shown
            };
            assert_eq!(luns[lun]["io_engine"], want, "{engine}: {luns}");
            load_round_trip(&s.url(lun as u32));
        }
    }
    // A file on tmpfs (inline I/O): the solicited Data-Out of the 512 KiB write pass (each
    // write's second 256 KiB, after its FirstBurstLength of immediate data, which goes through
    // a buffer) is received straight into its pages, and every stamp reads back.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("control.sock").display().to_string();
    let shm = ShmFile::new("load");
    let s = Server::start(&[
        "--lun",
        &format!("file:{}:64M", shm.0.display()),
        "--control",
        &sock,
    ]);
    load_round_trip(&s.url(0));
    let out = run_stdout(bin(), &["ctl", "--control", &sock, "--json", "counters"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        v["zero_copy_write_bytes"].as_u64().unwrap_or(0) >= 200 * (256 << 10),
        "large writes to the tmpfs LUN not received in place: {out}"
    );
}

/// BLOCKIO on a block device (a loop device over a file): O_DIRECT through each engine, every
/// block written and read back; the device's bytes, read without ironsan, are the stamps.
#[test]
fn block_device_lun_verifies_every_block_with_io_uring_and_with_threads() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("backing.img");
    let dev = match common::LoopDevice::over_new_file(&img, 64 << 20) {
        Ok(d) => d,
        Err(e) => {
            ironsan_testkit::skip(format!("{e}; block device LUN not tested"));
            return;
        }
    };
    for engine in ["uring", "threads"] {
        let spec = format!("file:{},direct", dev.0);
        let s = Server::start(&["--io-engine", engine, "--lun", &spec]);
        assert!(
            s.stdout().contains("file-direct") && s.stdout().contains(&dev.0),
            "{}",
            s.logs()
        );
        load_round_trip(&s.url(0));
    }
    // What the LUN wrote is on the device: the first block carries LBA 0's stamp, not zeros.
    let first = std::fs::read(&img).unwrap();
    assert!(
        first[..512].iter().any(|&b| b != 0),
        "nothing reached the device"
    );
}

/// Sets a sysctl for the length of a test and puts the old value back.
struct Sysctl {
    path: &'static str,
    old: String,
}

impl Sysctl {
    fn set(path: &'static str, value: &str) -> Option<Sysctl> {
        let old = std::fs::read_to_string(path).ok()?;
        std::fs::write(path, value).ok()?;
        Some(Sysctl { path, old })
    }
}

impl Drop for Sysctl {
    fn drop(&mut self) {
        let _ = std::fs::write(self.path, self.old.trim());
    }
}

/// Where the kernel refuses io_uring, `auto` falls back to I/O threads (with a warning that
/// says why) and still serves the LUN; `--io-engine uring` refuses to start instead.
/// `kernel.io_uring_disabled=1` refuses it to processes without CAP_SYS_ADMIN, so the server
/// runs without that capability and the other tests' servers are not affected.
#[test]
fn without_io_uring_auto_falls_back_to_threads_and_uring_refuses_to_start() {
    if common::which("setpriv").is_none() {
        ironsan_testkit::skip("no setpriv (util-linux)");
        return;
    }
    let Some(_sysctl) = Sysctl::set("/proc/sys/kernel/io_uring_disabled", "1") else {
        ironsan_testkit::skip("cannot set kernel.io_uring_disabled (kernel < 6.6 or not root)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let serve = |engine: &str, port: u16| {
        let listen = format!("127.0.0.1:{port}");
        let data = dir
            .path()
            .join(format!("data-{engine}"))
            .display()
            .to_string();
        Background::spawn(
            "setpriv",
            &[
                "--inh-caps=-sys_admin",
                "--bounding-set=-sys_admin",
                "--",
                bin(),
                "serve",
                "--listen",
                &listen,
                "--data-dir",
                &data,
                "--control",
                "none",
                "--io-engine",
                engine,
                "--lun",
                "file:lun.img:64M,direct",
            ],
        )
    };
    let port = free_port();
    let mut auto = serve("auto", port);
    auto.wait_for_stdout("iscsi-ls", Duration::from_secs(20));
    assert!(
        auto.stdout().contains("(threads)")
            && auto.stderr().contains("io_uring unavailable")
            && auto.stderr().contains("I/O threads instead"),
        "{}",
        auto.output_text()
    );
    let url = format!("iscsi://127.0.0.1:{port}/{DEFAULT_TARGET}/0");
    let w = load(&url, &["--rw", "randwrite", "--count", "2000", "--verify"])
        .unwrap_or_else(|e| panic!("{e}\n{}", auto.output_text()));
    assert_eq!(w["failed"].as_u64(), Some(0), "{w}");
    let _ = auto.child.kill();
    let mut uring = serve("uring", free_port());
    let st = uring
        .wait_timeout(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("--io-engine uring started without io_uring"));
    assert!(!st.success());
    let err = uring.stderr();
    assert!(
        err.contains("io_engine uring") && err.contains("Operation not permitted"),
        "{}",
        uring.output_text()
    );
}

/// `ironsan load --connections N`: one session of several connections (MC/S), commands
/// spread round robin and by least queue depth, every block verified; `ctl sessions` shows
/// the session's connections, each with its own counters.
#[test]
fn load_generator_runs_one_session_over_several_connections() {
    let ctl_dir = tempfile::tempdir().unwrap();
    let sock = ctl_dir.path().join("control.sock");
    let sock_s = sock.display().to_string();
    let s = Server::start(&["--lun", "ram:64M", "--control", &sock_s]);
    let u = s.url(0);
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(u64::MAX);
    let w = load(
        &u,
        &[
            "--connections",
            "4",
            "--rw",
            "write",
            "--bs",
            "65536",
            "--qd",
            "16",
            "--count",
            "1024",
            "--verify",
        ],
    )
    .unwrap_or_else(|e| panic!("write pass over 4 connections: {e}"));
    assert_eq!((n(&w, "ios"), n(&w, "failed")), (1024, 0), "{w}");
    let per = w["per_connection"].as_array().cloned().unwrap_or_default();
    assert_eq!(per.len(), 4, "{w}");
    // Round robin: 256 commands on each connection.
    assert!(per.iter().all(|c| n(c, "ios") == 256), "{w}");
    for spread in ["rr", "lqd"] {
        let r = load(
            &u,
            &[
                "--connections",
                "3",
                "--spread",
                spread,
                "--rw",
                "randread",
                "--count",
                "20000",
                "--verify",
            ],
        )
        .unwrap_or_else(|e| panic!("random reads over 3 connections ({spread}): {e}"));
        assert_eq!((n(&r, "ios"), n(&r, "failed")), (20_000, 0), "{r}");
        assert_eq!(n(&r, "verify_failures"), 0, "{r}");
        let per = r["per_connection"].as_array().cloned().unwrap_or_default();
        assert!(
            per.len() == 3 && per.iter().all(|c| n(c, "ios") > 0),
            "every connection carried commands: {r}"
        );
    }
    // While a session of 4 connections runs, `ctl sessions` lists them all.
    let mut bg = Background::spawn(
        bin(),
        &[
            "load",
            &u,
            "--connections",
            "4",
            "--rw",
            "randread",
            "-t",
            "8",
        ],
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    let cids = loop {
        let out = run_stdout(bin(), &["ctl", "--control", &sock_s, "--json", "sessions"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        let cids: Vec<u64> = v
            .as_array()
            .and_then(|a| a.first())
            .and_then(|s| s["connections"].as_array())
            .map(|c| c.iter().filter_map(|x| x["cid"].as_u64()).collect())
            .unwrap_or_default();
        if cids.len() == 4 || std::time::Instant::now() > deadline {
            break cids;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut sorted = cids.clone();
    sorted.sort();
    assert_eq!(sorted, vec![0, 1, 2, 3]);
    assert!(bg
        .wait_timeout(Duration::from_secs(30))
        .is_some_and(|st| st.success()));
    // More connections than the target allows: refused with a clear message.
    let err = load(&u, &["--connections", "5", "--count", "10"]).expect_err("5 > 4 accepted");
    assert!(err.contains("allows 4 connections"), "{err}");
}

/// The third-party initiator `ironsan-mcs-peer` (tests/mcs-peer: the crates.io crate
/// iscsi-client-rs, which does MC/S; built by scripts/test.sh), as a new user with that
/// initiator would use it: sessions of 2 and 4 connections, with and without digests, data
/// written on one connection verified through another, every connection logged out.
#[test]
fn a_third_party_mcs_initiator_moves_verified_data_over_several_connections() {
    let peer = std::env::var("IRONSAN_MCS_PEER").unwrap_or_else(|_| {
        format!(
            "{}/target/mcs-peer/release/ironsan-mcs-peer",
            env!("CARGO_MANIFEST_DIR")
        )
    });
    if !Path::new(&peer).exists() {
        ironsan_testkit::skip(format!(
            "{peer} is not built (scripts/test.sh builds it: cargo build --release --manifest-path tests/mcs-peer/Cargo.toml)"
        ));
        return;
    }
    let s = Server::start(&["--lun", "ram:64M"]);
    let addr = s.addr().to_string();
    for (conns, digest, blocks, cmds) in [
        ("2", "None", "128", "128"),
        ("4", "None", "16", "256"),
        ("4", "CRC32C", "128", "128"),
    ] {
        let out = run_env(
            &peer,
            &[],
            &[
                ("TARGET", &addr),
                ("TARGET_NAME", DEFAULT_TARGET),
                ("NCONN", conns),
                ("DIGEST", digest),
                ("BLOCKS", blocks),
                ("NCMDS", cmds),
                ("MAX_INFLIGHT", "16"),
            ],
            Duration::from_secs(120),
        );
        let text = show(&out);
        assert!(
            out.status.success()
                && text.contains(&format!("MCS-PEER OK conns={conns} cmds={cmds}")),
            "{conns} connections, digest {digest}:\n{text}\n{}",
            s.logs()
        );
    }
}
