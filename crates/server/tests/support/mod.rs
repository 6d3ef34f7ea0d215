//! What the in-process server tests share: a RAM-backed target, a server on 127.0.0.1:0 that
//! stops when the returned sender is dropped, a data pattern, login options and control
//! socket calls.
#![allow(dead_code)] // each test crate uses a different part

use bytes::Bytes;
use ironsan_backend::{BlockDevice, FaultBackend, FaultControl, FaultRule, RamBackend};
use ironsan_initiator::LoginOptions;
use ironsan_scsi::{LogicalUnit, LuConfig};
use ironsan_server::{control, Server, ServerConfig, TargetDef};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

/// The target name most tests use.
pub(crate) const TARGET: &str = "iqn.2026-11.org.ironsan:test";

/// A target called `name` with LUN 0 on `backend` (NAA designator `naa`), portal group 1.
pub(crate) fn target_on(name: &str, backend: Arc<dyn BlockDevice>, naa: u64) -> TargetDef {
    target_with(name, vec![backend], naa)
}

/// A target called `name` with LUNs 0, 1, … on `backends` (NAA designators `naa`, `naa + 1`, …).
pub(crate) fn target_with(name: &str, backends: Vec<Arc<dyn BlockDevice>>, naa: u64) -> TargetDef {
    let mut scsi = ironsan_scsi::Target::new();
    for (n, backend) in (0u64..).zip(backends) {
        let cfg = LuConfig {
            naa: naa + n,
            ..Default::default()
        };
        scsi.add_lun(n, Arc::new(LogicalUnit::new(backend, cfg)));
    }
    TargetDef {
        name: name.into(),
        alias: None,
        max_connections: None,
        error_recovery_level: None,
        scsi: Arc::new(scsi),
    }
}

/// A target called `name` with LUN 0 on a 64 MiB RAM disk.
pub(crate) fn ram_target(name: &str) -> TargetDef {
    target_on(
        name,
        Arc::new(RamBackend::new(64 << 20)),
        0x3000_0000_0000_0001,
    )
}

/// A server whose LUN 0 fails as fault rules say ([`FaultBackend`] over `inner`), for the
/// fault and abort-ordering tests; it stops when dropped.
pub(crate) struct FaultRig {
    pub addr: SocketAddr,
    pub ctl: Arc<FaultControl>,
    /// What LUN 0 stores, read behind the faults.
    pub inner: Arc<dyn BlockDevice>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// Serve target `name`: LUN 0 is `rules` (`fault=` syntax, random choices from `seed`) over
/// `inner`, the LUNs after it are `more`; `tune` adjusts the configuration before binding.
pub(crate) async fn fault_rig(
    name: &str,
    inner: Arc<dyn BlockDevice>,
    rules: &[&str],
    seed: u64,
    more: Vec<Arc<dyn BlockDevice>>,
    naa: u64,
    tune: impl FnOnce(&mut ServerConfig),
) -> FaultRig {
    let rules = rules.iter().map(|r| FaultRule::parse(r).unwrap()).collect();
    let fault = FaultBackend::new(Arc::clone(&inner), rules, 512, seed);
    let ctl = fault.control();
    let mut luns: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(fault)];
    luns.extend(more);
    let t = target_with(name, luns, naa);
    let mut cfg = ServerConfig::new(vec!["127.0.0.1:0".parse().unwrap()], vec![t]);
    tune(&mut cfg);
    let server = Server::bind(cfg).await.unwrap();
    FaultRig {
        addr: server.local_addrs()[0],
        ctl,
        inner,
        _stop: run_in_background(server),
    }
}

/// Run a bound server in the background; it stops when the sender is dropped.
pub(crate) fn run_in_background(server: Server) -> tokio::sync::oneshot::Sender<()> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.run(async {
        let _ = rx.await;
    }));
    tx
}

/// Bind a server with `cfg` and run it in the background; it stops when the sender is dropped.
pub(crate) async fn serve(cfg: ServerConfig) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let server = Server::bind(cfg).await.unwrap();
    let addr = server.local_addrs()[0];
    (addr, run_in_background(server))
}

/// A server with one RAM target ([`TARGET`]) on 127.0.0.1:0, after `f` adjusted the config.
pub(crate) async fn start_with(
    f: impl FnOnce(&mut ServerConfig),
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let mut cfg = ServerConfig::new(
        vec!["127.0.0.1:0".parse().unwrap()],
        vec![ram_target(TARGET)],
    );
    f(&mut cfg);
    serve(cfg).await
}

/// [`start_with`] with the default config.
pub(crate) async fn start() -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    start_with(|_| {}).await
}

/// `len` bytes of a pattern that differs per `seed`.
pub(crate) fn pattern(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<u8>>(),
    )
}

/// Login options for `target` as `initiator`, with `isid` as the last byte of the ISID.
pub(crate) fn login_opts(target: &str, initiator: &str, isid: u8) -> LoginOptions {
    let mut o = LoginOptions::new(Some(target));
    o.initiator_name = initiator.into();
    o.isid.0[5] = isid;
    o
}

/// Run `ironsan ctl ARGV` against the control socket at `path` (off the async threads).
pub(crate) async fn ctl(path: &Path, argv: &[&str]) -> Result<Value, String> {
    let path = path.to_owned();
    let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || control::call(&path, &argv).map_err(|e| e.to_string()))
        .await
        .unwrap()
}

/// (ITT, status) of every final status in `pdus` (SCSI Response, or Data-In with status).
pub(crate) fn completions(pdus: &[ironsan_proto::pdu::Pdu]) -> Vec<(ironsan_proto::pdu::Itt, u8)> {
    use ironsan_proto::pdu::Header;
    pdus.iter()
        .filter_map(|p| match &p.header {
            Header::ScsiResponse(r) => Some((r.itt, r.status)),
            Header::DataIn(d) => d.status.map(|s| (d.itt, s)),
            _ => None,
        })
        .collect()
}

/// Collect PDUs for `dur` (or until the connection closes).
pub(crate) async fn drain(
    c: &mut ironsan_initiator::Client,
    dur: std::time::Duration,
) -> Vec<ironsan_proto::pdu::Pdu> {
    let mut out = Vec::new();
    let end = tokio::time::Instant::now() + dur;
    while let Ok(Ok(p)) = tokio::time::timeout_at(end, c.recv()).await {
        out.push(p);
    }
    out
}

/// Wait (up to 30 s) until a background I/O task has completed 10 more commands than `before`
/// by its counter `done`; fail at once, with its error, if the task ended.
pub(crate) async fn wait_for_progress<T, E: std::fmt::Debug>(
    done: &std::sync::atomic::AtomicU64,
    before: u64,
    io: &mut tokio::task::JoinHandle<Result<T, E>>,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while done.load(Relaxed) < before + 10 {
        if io.is_finished() {
            let r = io.await.map(|r| r.map(|_| ()));
            panic!(
                "the background I/O ended after {} commands: {r:?}",
                done.load(Relaxed)
            );
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the background I/O completed {} of 10 commands in 30 s",
            done.load(Relaxed) - before
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Wait (up to 10 s) until the number of I/Os stuck in a fault backend satisfies `want`;
/// `what` says what is awaited in the failure message.
pub(crate) async fn wait_stuck_until(
    ctl: &ironsan_backend::FaultControl,
    want: impl Fn(usize) -> bool,
    what: &str,
) {
    let t0 = std::time::Instant::now();
    while !want(ctl.stuck_now()) {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "{what}: {} I/Os stuck after 10 s",
            ctl.stuck_now()
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}
