//! Crash consistency: `ironsan serve` on a durable backend is killed with SIGKILL at random
//! moments while several sessions write, restarted on the same backing store, and every
//! acknowledged write is checked (harness: `tests/common/crash.rs`; promises:
//! docs/INTEGRITY.md). Modes: file buffered, file O_DIRECT (skipped when the file system
//! refuses O_DIRECT), a loop block device (skipped when `losetup` fails); each with WCE=0 and
//! WCE=1. 5 cycles each; `IRONSAN_LONG=1` runs 100; `IRONSAN_SEED=N` replays a schedule.
//!
//! SIGKILL cannot lose what is in the page cache, so this proves ordering, atomicity and
//! acknowledgement discipline, not that flushes are issued: `tests/system/powerfail.rs` does that.

use crate::common;
use crate::crash_harness;

use common::Server;
use crash_harness::{Crashable, Plan};
use std::net::SocketAddr;
use std::path::Path;

struct Proc(Server);

impl Crashable for Proc {
    fn addr(&self) -> SocketAddr {
        self.0.addr()
    }
    fn target(&self) -> String {
        self.0.target.clone()
    }
    fn crash(&mut self) {
        self.0.kill9();
    }
    fn restart(&mut self) {
        self.0.start_again();
    }
}

/// The LUN spec for a backing path, with `direct`/`wce` options.
fn lun(path: &Path, size: Option<&str>, direct: bool, wce: bool) -> String {
    let mut s = format!("file:{}", path.display());
    if let Some(sz) = size {
        s.push(':');
        s.push_str(sz);
    }
    if direct {
        s.push_str(",direct");
    }
    if wce {
        s.push_str(",wce");
    }
    s
}

async fn run_mode(name: &str, spec: String, wce: bool) {
    run_plan(spec, Plan::new(name, wce)).await;
}

async fn run_plan(spec: String, plan: Plan) {
    let name = plan.name.as_str();
    let mut t = Proc(Server::start(&["--lun", &spec]));
    let rep = crash_harness::run(&plan, &mut t).await;
    assert!(
        rep.ok(),
        "{}\nseed {}\n{}",
        rep.summary(name),
        plan.seed,
        rep.problems.join("\n")
    );
    assert!(rep.acked > 0, "{name}: no write was ever acknowledged");
    assert!(
        rep.records_checked > 0,
        "{name}: nothing was checked after the crashes"
    );
    if plan.recovery {
        assert!(
            rep.recovered > 0,
            "{name}: no write was recovered across a cut"
        );
    }
}

fn direct_supported(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join("probe");
    let ok = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .custom_flags(libc_o_direct())
        .open(&p)
        .is_ok();
    let _ = std::fs::remove_file(&p);
    ok
}

fn libc_o_direct() -> i32 {
    // O_DIRECT on Linux x86_64/aarch64 (the root package does not depend on libc).
    if cfg!(any(target_arch = "aarch64", target_arch = "arm")) {
        0o200000
    } else {
        0o40000
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_buffered_wce0() {
    let dir = tempfile::tempdir().unwrap();
    run_mode(
        "file buffered WCE=0",
        lun(&dir.path().join("b0.img"), Some("64M"), false, false),
        false,
    )
    .await;
}

/// ErrorRecoveryLevel 2: one write in three is cut half-way through its data and finished on
/// the session's other connection (reassigned, or retried when the target never got it), with
/// SIGKILL falling anywhere in that: no acknowledged write lost, none applied over a later
/// one, none torn.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_buffered_wce0_connection_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let mut plan = Plan::new("file buffered WCE=0, connections cut and recovered", false);
    plan.recovery = true;
    run_plan(
        lun(&dir.path().join("r0.img"), Some("64M"), false, false),
        plan,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_buffered_wce1() {
    let dir = tempfile::tempdir().unwrap();
    run_mode(
        "file buffered WCE=1",
        lun(&dir.path().join("b1.img"), Some("64M"), false, true),
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_direct_wce0_and_wce1() {
    let dir = tempfile::tempdir().unwrap();
    if !direct_supported(dir.path()) {
        ironsan_testkit::skip(format!(
            "{} refuses O_DIRECT; file O_DIRECT mode not tested",
            dir.path().display()
        ));
        return;
    }
    for wce in [false, true] {
        run_mode(
            &format!("file O_DIRECT WCE={}", u8::from(wce)),
            lun(
                &dir.path().join(format!("d{wce}.img")),
                Some("64M"),
                true,
                wce,
            ),
            wce,
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn block_device_loop_wce0_and_wce1() {
    let dir = tempfile::tempdir().unwrap();
    for wce in [false, true] {
        let img = dir.path().join(format!("loop{wce}.img"));
        let dev = match common::LoopDevice::over_new_file(&img, 64 << 20) {
            Ok(l) => l,
            Err(e) => {
                ironsan_testkit::skip(format!("{e}; block device mode not tested"));
                return;
            }
        };
        run_mode(
            &format!("loop block device {} WCE={}", dev.0, u8::from(wce)),
            lun(Path::new(&dev.0), None, false, wce),
            wce,
        )
        .await;
    }
}

/// The harness's own checks: a torn record, a misdirected record and garbage are caught.
#[test]
fn decoder_catches_torn_and_misdirected_records() {
    let r = crash_harness::record(7, 42, 1);
    assert_eq!(crash_harness::decode(7, &r), Ok(42));
    assert_eq!(crash_harness::decode(7, &[0u8; crash_harness::REC]), Ok(0));
    assert!(crash_harness::decode(8, &r).is_err());
    let mut torn = crash_harness::record(7, 43, 1);
    torn[2048..].copy_from_slice(&r[2048..]);
    assert!(crash_harness::decode(7, &torn).is_err());
    let mut one_sector = r.clone();
    one_sector[512..1024].fill(0);
    assert!(crash_harness::decode(7, &one_sector).is_err());
}

/// (VmRSS in KiB, open fds) of a process.
fn rss_and_fds(pid: u32) -> (u64, usize) {
    let rss = common::proc_status(pid, "VmRSS:").unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    (rss, fds)
}

/// Connect, log in, write, read, drop the TCP connection without logging out: 500 times
/// (`IRONSAN_LONG=1`: 10,000). The server's fd count returns to where it was and its RSS
/// stays flat (measured after a warm-up, so allocator pools are already grown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_io_drop_cycles_leak_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let spec = lun(&dir.path().join("cycles.img"), Some("16M"), false, false);
    let server = Server::start(&["--lun", &spec]);
    let long = std::env::var("IRONSAN_LONG").is_ok_and(|v| v == "1");
    let cycles = if long { 10_000 } else { 500 };
    let addr = server.addr();
    let target = server.target.clone();
    let one = |i: u64| {
        let target = target.clone();
        async move {
            let mut o = ironsan_initiator::LoginOptions::new(Some(&target));
            o.isid.0[5] = (i % 7) as u8;
            let mut c = ironsan_initiator::Client::login(addr, &o).await.unwrap();
            let data = crash_harness::record(i % 1000, i + 1, 1);
            let w = c.write16(
                0,
                (i % 1000) * 8,
                data.clone().into(),
                512,
                i.is_multiple_of(2),
            );
            assert_eq!(w.await.unwrap().status, 0);
            let r = c.read16(0, (i % 1000) * 8, 8, 512).await.unwrap();
            assert!(r.data == data);
            drop(c); // TCP close without logout
        }
    };
    for i in 0..50 {
        one(i).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let before = rss_and_fds(server.pid());
    for i in 50..50 + cycles {
        one(i).await;
    }
    // Let the server notice the last closes.
    let mut after = rss_and_fds(server.pid());
    for _ in 0..50 {
        if after.1 <= before.1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        after = rss_and_fds(server.pid());
    }
    eprintln!(
        "{cycles} connect/login/write/read/drop cycles: RSS {} -> {} KiB, fds {} -> {}",
        before.0, after.0, before.1, after.1
    );
    assert!(after.1 <= before.1, "fd leak: {} -> {}", before.1, after.1);
    assert!(
        after.0 < before.0 + 8 * 1024,
        "RSS grew by {} KiB",
        after.0.saturating_sub(before.0)
    );
}

// ---------------------------------------------------------------------------------------------
// Persistent reservations (APTPL) and `ctl save` across SIGKILL
// ---------------------------------------------------------------------------------------------

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

const PR_INITIATOR: &str = "iqn.2026-11.org.ironsan:pr-crash";

/// What PERSISTENT RESERVE IN reports: PRGENERATION, the registered keys (sorted) and the
/// reservation (key, type).
#[derive(Clone, Debug, PartialEq, Eq)]
struct PrView {
    generation: u32,
    keys: Vec<u64>,
    res: Option<(u64, u8)>,
}

async fn pr_login(addr: SocketAddr, target: &str, isid: u8) -> ironsan_initiator::Client {
    let mut o = ironsan_initiator::LoginOptions::new(Some(target));
    o.initiator_name = PR_INITIATOR.into();
    o.isid.0[5] = isid;
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        ironsan_initiator::Client::login(addr, &o),
    )
    .await
    .expect("login hung")
    .expect("login")
}

/// PERSISTENT RESERVE OUT with APTPL=1; the SCSI status, or an error when the connection
/// went away.
async fn prout(
    c: &mut ironsan_initiator::Client,
    sa: u8,
    ptype: u8,
    rk: u64,
    sark: u64,
) -> Result<u8, String> {
    let (cdb, p) = ironsan_initiator::prout_basic(sa, ptype, rk, sark, true);
    c.command(0, &cdb, Some(p), 0)
        .await
        .map(|r| r.status)
        .map_err(|e| e.to_string())
}

async fn prin(c: &mut ironsan_initiator::Client, sa: u8) -> bytes::Bytes {
    let mut cdb = [0u8; 10];
    cdb[0] = 0x5E;
    cdb[1] = sa;
    cdb[7..9].copy_from_slice(&1024u16.to_be_bytes());
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        c.command(0, &cdb, None, 1024),
    )
    .await
    .expect("PERSISTENT RESERVE IN hung")
    .expect("PERSISTENT RESERVE IN");
    assert_eq!(
        r.status,
        0,
        "PERSISTENT RESERVE IN sense {:?}",
        r.sense_key()
    );
    r.data
}

fn be32(d: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(d[at..at + 4].try_into().unwrap())
}

/// READ KEYS and READ RESERVATION.
async fn pr_view(c: &mut ironsan_initiator::Client) -> PrView {
    let k = prin(c, 0).await;
    let n = be32(&k, 4) as usize / 8;
    let mut keys: Vec<u64> = (0..n)
        .map(|i| u64::from_be_bytes(k[8 + 8 * i..16 + 8 * i].try_into().unwrap()))
        .collect();
    keys.sort_unstable();
    let r = prin(c, 1).await;
    assert_eq!(be32(&r, 0), be32(&k, 0), "generation changed between reads");
    let res = (be32(&r, 4) >= 16).then(|| {
        (
            u64::from_be_bytes(r[8..16].try_into().unwrap()),
            r[21] & 0x0F,
        )
    });
    PrView {
        generation: be32(&k, 0),
        keys,
        res,
    }
}

/// The two registrants' keys: S1 (ISID 1) changes its key, S2 (ISID 2) keeps `S2_KEY`.
const S2_KEY: u64 = 0x5200_0000_0000_0002;

/// The model of the LU's PR state: S1's key and the view it must give.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PrModel {
    k1: u64,
    view: PrView,
}

impl PrModel {
    fn with_key(&self, k1: u64) -> PrModel {
        let mut keys = vec![k1, S2_KEY];
        keys.sort_unstable();
        PrModel {
            k1,
            view: PrView {
                generation: self.view.generation.wrapping_add(1),
                keys,
                res: self.view.res.map(|(_, t)| (k1, t)),
            },
        }
    }
    fn with_res(&self, res: Option<u8>) -> PrModel {
        let mut m = self.clone();
        m.view.res = res.map(|t| (self.k1, t));
        m
    }
}

/// APTPL state survives SIGKILL: (1) right after REGISTER (both nexuses) and RESERVE with
/// APTPL=1 completed, the target is killed and restarted on the same data directory, and
/// READ KEYS / READ RESERVATION report them (and the reservation is enforced); (2) a stream of
/// PR OUT changes (key changes with APTPL=1, RESERVE, RELEASE) is cut by SIGKILL at random
/// moments, and after each restart the state read back is the last acknowledged one or the
/// one in flight at the kill, never an older, torn or empty one. 5 kills (`IRONSAN_LONG=1`:
/// 100); `IRONSAN_SEED` replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pr_aptpl_state_survives_sigkill() {
    let plan = Plan::new("pr", false);
    let mut rng = Rng(plan.seed | 1);
    let mut server = Server::start(&["--lun", "ram:1M"]);
    let target = server.target.clone();
    let state_file = server
        .data_dir()
        .join("state")
        .join(&target)
        .join("0")
        .join(ironsan_scsi::PR_STATE_FILE);
    const K1: u64 = 0x5100_0000_0000_0001;
    {
        let mut s1 = pr_login(server.addr(), &target, 1).await;
        let mut s2 = pr_login(server.addr(), &target, 2).await;
        assert_eq!(prout(&mut s1, 0x00, 0, 0, K1).await, Ok(0)); // REGISTER
        assert_eq!(prout(&mut s2, 0x00, 0, 0, S2_KEY).await, Ok(0));
        assert_eq!(prout(&mut s1, 0x01, 0x01, K1, 0).await, Ok(0)); // RESERVE, WR_EX
        server.kill9();
    }
    server.start_again();
    let mut s1 = pr_login(server.addr(), &target, 1).await;
    let mut s2 = pr_login(server.addr(), &target, 2).await;
    let mut model = PrModel {
        k1: K1,
        view: PrView {
            generation: 2,
            keys: vec![K1, S2_KEY],
            res: Some((K1, 0x01)),
        },
    };
    assert_eq!(pr_view(&mut s1).await, model.view, "after SIGKILL");
    // The reservation is in force: the holder writes, the other registrant gets RESERVATION
    // CONFLICT (WRITE EXCLUSIVE).
    let block = bytes::Bytes::from(vec![7u8; 512]);
    assert_eq!(
        s1.write16(0, 0, block.clone(), 512, false)
            .await
            .unwrap()
            .status,
        0
    );
    assert_eq!(
        s2.write16(0, 0, block, 512, false).await.unwrap().status,
        0x18
    );
    drop(s2);

    // A stream of changes, killed at random moments.
    let mut acked_total = 0u64;
    let mut in_flight_won = 0u64;
    let (mut min_gap, mut max_gap) = (u64::MAX, 0);
    for cycle in 0..plan.cycles {
        type Log = std::sync::Mutex<(PrModel, Option<PrModel>, u64)>;
        let log: std::sync::Arc<Log> =
            std::sync::Arc::new(std::sync::Mutex::new((model.clone(), None, 0)));
        let mut op_rng = Rng(rng.below(u64::MAX) | 1);
        let stream = tokio::spawn({
            let log = std::sync::Arc::clone(&log);
            let mut c = s1;
            async move {
                loop {
                    let cur = log.lock().unwrap().0.clone();
                    let (next, sa, ptype, rk, sark) = match (cur.view.res, op_rng.below(2)) {
                        (None, 0) => {
                            let t = [0x01, 0x03, 0x05, 0x06][op_rng.below(4) as usize];
                            (cur.with_res(Some(t)), 0x01, t, cur.k1, 0)
                        }
                        (Some((_, t)), 0) => (cur.with_res(None), 0x02, t, cur.k1, 0),
                        _ => {
                            let k = 0x5100_0000_0000_0000 | (op_rng.below(1 << 40) + 1);
                            (cur.with_key(k), 0x00, 0, cur.k1, k)
                        }
                    };
                    log.lock().unwrap().1 = Some(next.clone());
                    match prout(&mut c, sa, ptype, rk, sark).await {
                        Ok(0) => {
                            let mut g = log.lock().unwrap();
                            *g = (next, None, g.2 + 1);
                        }
                        Ok(s) => panic!("PR OUT {sa:#x} status {s:#x} in state {cur:?}"),
                        Err(_) => return, // killed
                    }
                }
            }
        });
        // Kill only once this cycle has had an acknowledged change (one PR OUT is a round
        // trip, a temporary file and fsyncs: on a loaded machine that can take longer than
        // the whole gap), then after a random gap: into the middle of the stream.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while log.lock().unwrap().2 == 0 {
            if stream.is_finished() {
                let r = stream.await;
                panic!(
                    "cycle {cycle}: the PR OUT stream ended before its first acknowledgement \
                     ({r:?})\n{}",
                    server.logs()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "cycle {cycle}: no PR OUT acknowledged within 30 s\n{}",
                server.logs()
            );
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        let gap = 2 + rng.below(60);
        min_gap = min_gap.min(gap);
        max_gap = max_gap.max(gap);
        tokio::time::sleep(std::time::Duration::from_millis(gap)).await;
        server.kill9();
        tokio::time::timeout(std::time::Duration::from_secs(10), stream)
            .await
            .expect("the PR OUT stream did not notice the kill")
            .unwrap();
        let (acked, in_flight, n) = log.lock().unwrap().clone();
        acked_total += n;
        // Whatever happened, the file on disk is whole: the state parses.
        let text = std::fs::read_to_string(&state_file).expect("pr-state missing after a kill");
        assert!(text.starts_with("ironsan-pr 1\n"), "torn pr-state:\n{text}");
        server.start_again();
        s1 = pr_login(server.addr(), &target, 1).await;
        let got = pr_view(&mut s1).await;
        model = if got == acked.view {
            acked
        } else if in_flight.as_ref().is_some_and(|m| m.view == got) {
            in_flight_won += 1;
            in_flight.unwrap()
        } else {
            panic!(
                "cycle {cycle} (seed {}): after SIGKILL the PR state is {got:?}; the last \
                 acknowledged one is {:?}, the one in flight {:?}",
                plan.seed,
                acked.view,
                in_flight.map(|m| m.view)
            );
        };
    }
    eprintln!(
        "pr APTPL: seed {} (IRONSAN_SEED={} reproduces), {} SIGKILLs {min_gap}-{max_gap} ms \
         into a stream of PR OUT changes, {acked_total} acknowledged, {in_flight_won} kills \
         between persisting and the acknowledgement; every restart read back the last \
         acknowledged or the in-flight state",
        plan.seed, plan.seed, plan.cycles
    );
    assert!(
        acked_total > 0,
        "no PR OUT was acknowledged before the kills"
    );
}

/// One control-socket request (`{"argv": [...]}`), its `data` or error; Err also when the
/// server is gone.
fn control(sock: &Path, argv: &[&str]) -> Result<serde_json::Value, String> {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(sock).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let req = serde_json::json!({ "argv": argv }).to_string() + "\n";
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut line = String::new();
    std::io::BufReader::new(s)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| format!("{e}: {line}"))?;
    if v["ok"] == true {
        Ok(v["data"].clone())
    } else {
        Err(v["error"].to_string())
    }
}

/// `ironsan ctl save` (temporary file, rename over the --config file) survives SIGKILL: saves
/// alternate between two running states (LUN 0 resized to 1 MiB and 2 MiB) and the target is
/// killed at random moments; after every kill the file is exactly the last saved text or the
/// one being saved, never partial, and the target starts from it. 5 kills
/// (`IRONSAN_LONG=1`: 100).
#[test]
fn ctl_save_leaves_the_old_or_the_new_config_after_sigkill() {
    use common::DEFAULT_TARGET;
    use std::net::{Ipv4Addr, SocketAddr};
    let plan = Plan::new("ctl save", false);
    let mut rng = Rng(plan.seed | 1);
    let dir = tempfile::tempdir().unwrap();
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, common::free_port()));
    let sock = dir.path().join("control.sock");
    let config = common::write_ram_config(dir.path(), addr, &sock.display().to_string(), "");
    let mut server = Server::start_config(dir, &config, vec![addr], DEFAULT_TARGET);
    let size = ["1M", "2M"];
    let save_as = |i: usize| {
        control(&sock, &["lun", "resize", DEFAULT_TARGET, "0", size[i]]).unwrap();
        control(&sock, &["save"]).unwrap();
        std::fs::read_to_string(&config).unwrap()
    };
    let texts = [save_as(0), save_as(1)];
    assert_ne!(texts[0], texts[1]);
    assert!(texts[1].contains("ram:2097152"), "{}", texts[1]);
    let mut acked = 1usize;
    let (mut saves, mut new_won) = (0u64, 0u64);
    for cycle in 0..plan.cycles {
        // (last saved, being saved, saves acknowledged)
        let log = std::sync::Arc::new(std::sync::Mutex::new((acked, None::<usize>, 0u64)));
        let stream = std::thread::spawn({
            let log = std::sync::Arc::clone(&log);
            let sock = sock.clone();
            // Ends with the error of the request that failed (the kill, normally).
            move || loop {
                let next = 1 - log.lock().unwrap().0;
                if let Err(e) = control(&sock, &["lun", "resize", DEFAULT_TARGET, "0", size[next]])
                {
                    return format!("lun resize: {e}");
                }
                log.lock().unwrap().1 = Some(next);
                if let Err(e) = control(&sock, &["save"]) {
                    return format!("save: {e}");
                }
                let mut g = log.lock().unwrap();
                *g = (next, None, g.2 + 1);
            }
        });
        // Kill only once this cycle has had an acknowledged save (a round trip, a temporary
        // file and fsyncs: on a loaded machine that can take longer than the whole gap),
        // then after a random gap: into the middle of the stream.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while log.lock().unwrap().2 == 0 {
            if stream.is_finished() {
                let why = stream.join().unwrap();
                panic!(
                    "cycle {cycle}: the save stream ended before its first acknowledged save: \
                     {why}\n{}",
                    server.logs()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "cycle {cycle}: no save acknowledged within 30 s\n{}",
                server.logs()
            );
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        std::thread::sleep(std::time::Duration::from_millis(1 + rng.below(40)));
        server.kill9();
        stream.join().unwrap();
        let (last, in_flight, n) = *log.lock().unwrap();
        saves += n;
        let text = std::fs::read_to_string(&config).unwrap();
        if text == texts[last] {
            acked = last;
        } else if in_flight.is_some_and(|i| texts[i] == text) {
            acked = 1 - last;
            new_won += 1;
        } else {
            panic!(
                "cycle {cycle} (seed {}): after SIGKILL the config is neither the last saved \
                 nor the one being saved:\n{text}",
                plan.seed
            );
        }
        server.start_again();
    }
    eprintln!(
        "ctl save: seed {}, {} SIGKILLs during {saves} saves, {new_won} kills after the \
         rename but before the answer; every file was whole and the target started from it",
        plan.seed, plan.cycles
    );
    assert!(
        saves >= plan.cycles as u64,
        "{saves} saves in {} cycles",
        plan.cycles
    );
}
