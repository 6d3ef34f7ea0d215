//! Power-loss emulation. Killing the process cannot catch a missing flush (the page cache
//! survives it), so here the backing file lives on a FUSE file system (`memfs.rs`, in this
//! process) that holds written data in a volatile layer until an FSYNC reaches it, and on a
//! power cut throws that layer away. `ironsan serve` is killed with SIGKILL and the power is
//! cut at the same moment, then it is restarted on what survived and every promise of
//! docs/INTEGRITY.md is checked with the crash harness (`tests/common/crash.rs`).
//!
//! `broken_flush_is_caught` shows that the test can fail: the same harness against an
//! in-process target whose backend ignores durability (every write `WriteMode::Cached`,
//! flush a no-op) must report lost writes.
//!
//! Needs root and /dev/fuse (skipped with a message otherwise).

use crate::common;
use crate::crash_harness;
mod memfs;

use bytes::Bytes;
use crash_harness::{Crashable, Plan, Report};
use ironsan_backend::{
    BackendError, BlockDevice, Capabilities, FileBackend, FileOptions, IoEngine, IoFuture,
    WriteMode,
};
use memfs::PowerFs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const SIZE: u64 = 64 << 20;

/// A mounted PowerFs, unmounted on drop.
struct Mounted {
    fs: PowerFs,
    _session: fuser::BackgroundSession,
    dir: tempfile::TempDir,
}

impl Mounted {
    fn file(&self) -> PathBuf {
        self.dir.path().join("mnt").join(memfs::FILE_NAME)
    }
}

fn mount(direct_io: bool) -> Option<Mounted> {
    if !Path::new("/dev/fuse").exists() {
        ironsan_testkit::skip("no /dev/fuse; power-loss emulation not run");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let fs = PowerFs::new(SIZE, direct_io);
    match memfs::mount(fs.clone(), &mnt) {
        Ok(s) => {
            // The mount is live when the file can be stat'ed.
            let t0 = std::time::Instant::now();
            while std::fs::metadata(mnt.join(memfs::FILE_NAME)).is_err() {
                assert!(t0.elapsed() < Duration::from_secs(5), "FUSE mount not live");
                std::thread::sleep(Duration::from_millis(10));
            }
            Some(Mounted {
                fs,
                _session: s,
                dir,
            })
        }
        Err(e) => {
            ironsan_testkit::skip(format!(
                "cannot mount FUSE ({e}; needs root or fusermount3)"
            ));
            None
        }
    }
}

fn check(rep: &Report, plan: &Plan) {
    assert!(
        rep.ok(),
        "{}\nseed {}\n{}",
        rep.summary(&plan.name),
        plan.seed,
        rep.problems.join("\n")
    );
    assert!(rep.acked > 0 && rep.records_checked > 0, "nothing tested");
}

/// `ironsan serve` on the FUSE file: crash = SIGKILL + power cut.
struct Proc {
    server: common::Server,
    fs: PowerFs,
}

impl Crashable for Proc {
    fn addr(&self) -> SocketAddr {
        self.server.addr()
    }
    fn target(&self) -> String {
        self.server.target.clone()
    }
    fn crash(&mut self) {
        // SIGKILL and reap: after that no request of the dead process can still reach the
        // file system (pending ones are dropped by the kernel, the one being served finishes
        // under the state lock), so the cut is the same instant as the kill.
        self.server.kill9();
        self.fs.cut();
    }
    fn restart(&mut self) {
        self.server.start_again();
    }
}

async fn serve_on_fuse(wce: bool) {
    let Some(m) = mount(false) else { return };
    let mut spec = format!("file:{}", m.file().display());
    if wce {
        spec.push_str(",wce");
    }
    let server = common::Server::start(&["--lun", &spec]);
    let mut t = Proc {
        server,
        fs: m.fs.clone(),
    };
    let plan = Plan::new(&format!("FUSE power cut WCE={}", u8::from(wce)), wce);
    let rep = crash_harness::run(&plan, &mut t).await;
    let st = m.fs.stats();
    eprintln!("FUSE requests: {st:?}");
    check(&rep, &plan);
    assert_eq!(st.cuts as usize, plan.cycles);
    if !wce {
        // WCE=0: every acknowledged write was a pwritev2(RWF_DSYNC), which the FUSE server
        // sees as WRITE + FSYNC(datasync): at least one fdatasync per acked write.
        assert!(
            st.fdatasyncs >= rep.acked,
            "{} acked writes but only {} fdatasyncs reached the file system",
            rep.acked,
            st.fdatasyncs
        );
    }
    drop(t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn power_cut_wce0() {
    serve_on_fuse(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn power_cut_wce1() {
    serve_on_fuse(true).await;
}

// ---------------------------------------------------------------------------------------------
// In-process target, to demonstrate that a missing flush is caught.
// ---------------------------------------------------------------------------------------------

/// A backend that lies about durability: every write cached, flush does nothing.
struct IgnoresFlush(FileBackend);

impl BlockDevice for IgnoresFlush {
    fn kind(&self) -> &'static str {
        "broken"
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        self.0.read(offset, len)
    }
    fn write(&self, offset: u64, data: Bytes, _mode: WriteMode) -> IoFuture<'_, ()> {
        self.0.write(offset, data, WriteMode::Cached)
    }
    fn flush(&self) -> IoFuture<'_, ()> {
        Box::pin(async { Ok::<(), BackendError>(()) })
    }
}

struct InProc {
    file: PathBuf,
    fs: PowerFs,
    broken: bool,
    wce: bool,
    engine: IoEngine,
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<()>>,
}

const TARGET: &str = "iqn.2026-11.org.ironsan:powerfail";

impl InProc {
    async fn start(&mut self) {
        let opts = FileOptions {
            io_threads: 4,
            io_engine: self.engine,
            ..Default::default()
        };
        let file = FileBackend::open(&self.file, &opts).unwrap();
        let be: Arc<dyn BlockDevice> = if self.broken {
            Arc::new(IgnoresFlush(file))
        } else {
            Arc::new(file)
        };
        let mut scsi = ironsan_scsi::Target::new();
        let cfg = ironsan_scsi::LuConfig {
            naa: 0x3000_0000_0000_0042,
            write_cache: self.wce,
            ..Default::default()
        };
        scsi.add_lun(0, Arc::new(ironsan_scsi::LogicalUnit::new(be, cfg)));
        let t = ironsan_server::TargetDef {
            name: TARGET.into(),
            alias: None,
            max_connections: None,
            error_recovery_level: None,
            scsi: Arc::new(scsi),
        };
        let mut cfg = ironsan_server::ServerConfig::new(vec![self.addr], vec![t]);
        // A power cut: the server stops at once, it does not wait for the harness's writers
        // to log out (they never do).
        cfg.limits.shutdown_grace = Duration::ZERO;
        let server = ironsan_server::Server::bind(cfg).await.unwrap();
        self.addr = server.local_addrs()[0];
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        self.stop = Some(tx);
        self.done = Some(tokio::spawn(server.run(async {
            let _ = rx.await;
        })));
    }
}

impl Crashable for InProc {
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn target(&self) -> String {
        TARGET.into()
    }
    fn crash(&mut self) {
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async {
                if let Some(tx) = self.stop.take() {
                    let _ = tx.send(());
                }
                if let Some(h) = self.done.take() {
                    let _ = h.await;
                }
                // Let backend I/O already handed to the pool finish (a power cut would have
                // stopped it too; what it wrote is still unflushed and is thrown away).
                tokio::time::sleep(Duration::from_millis(200)).await;
            })
        });
        self.fs.cut();
    }
    fn restart(&mut self) {
        tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(self.start()));
    }
}

async fn in_process(broken: bool, wce: bool, direct_io: bool, engine: IoEngine) -> Option<Report> {
    let m = mount(direct_io)?;
    let mut t = InProc {
        file: m.file(),
        fs: m.fs.clone(),
        broken,
        wce,
        engine,
        addr: "127.0.0.1:0".parse().unwrap(),
        stop: None,
        done: None,
    };
    t.start().await;
    let mut plan = Plan::new(
        &format!(
            "in-process {} backend ({engine} engine), FUSE power cut WCE={}",
            if broken { "flush-ignoring" } else { "real" },
            u8::from(wce)
        ),
        wce,
    );
    plan.cycles = plan.cycles.min(5);
    let rep = crash_harness::run(&plan, &mut t).await;
    t.crash();
    eprintln!("FUSE requests: {:?}", m.fs.stats());
    Some(rep)
}

/// Control: the real file backend in-process passes, with io_uring and with I/O threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_process_real_backend_loses_nothing() {
    for engine in [IoEngine::Uring, IoEngine::Threads] {
        if let Some(rep) = in_process(false, false, false, engine).await {
            assert!(
                rep.ok(),
                "{engine}: {}\n{}",
                rep.summary("real"),
                rep.problems.join("\n")
            );
        }
    }
}

/// The harness catches a target that acknowledges writes it never flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broken_flush_is_caught() {
    for wce in [false, true] {
        if let Some(rep) = in_process(true, wce, false, IoEngine::Auto).await {
            eprintln!(
                "expected failure caught (WCE={}): {}",
                u8::from(wce),
                rep.problems.first().map(String::as_str).unwrap_or("-")
            );
            assert!(
                rep.lost > 0,
                "a backend that never flushes passed the power-loss test: {}",
                rep.summary("broken")
            );
        }
    }
}

/// Kernel behaviour this harness depends on, recorded: with FOPEN_DIRECT_IO a FUSE server is
/// never told that a pwritev2(RWF_DSYNC) had to be durable (no FSYNC follows the WRITE), so
/// the real backend loses acknowledged WCE=0 writes on such a file system. If a kernel starts
/// sending FSYNC (or the backend learns to fdatasync on FUSE), this test says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fuse_direct_io_is_durable_through_fdatasync() {
    // FUSE in direct-I/O mode drops RWF_DSYNC (the server sees a WRITE and no FSYNC); the file
    // backend detects FUSE and makes durable writes with write + fdatasync instead.
    if let Some(rep) = in_process(false, false, true, IoEngine::Auto).await {
        eprintln!(
            "FUSE direct_io: {}",
            rep.summary("real backend on a direct_io FUSE file")
        );
        assert_eq!(
            rep.lost, 0,
            "acknowledged writes lost on a direct_io FUSE file"
        );
    }
}
