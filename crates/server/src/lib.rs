//! # ironsan-server: the runtime side of ironsan
//!
//! The only crate that knows about tokio and sockets. It accepts connections on portals, runs
//! each connection as a reader (this task) plus a writer task, keeps the session registry
//! (reinstatement, several connections per session), and glues the sans-IO protocol core
//! (`ironsan-proto`) to the SCSI device server (`ironsan-scsi`).
//!
//! ```text
//!  socket ──read──▶ iscsi::conn::Connection (reader) ──▶ proto (login, window, R2T/Data-Out)
//!                        │ spawn per command
//!                        ▼
//!                  scsi::Target::execute ──▶ backend
//!                        │ Vec<OutPdu>
//!                        ▼
//!  socket ◀─write── writer task (StatSN, ExpCmdSN/MaxCmdSN, digests, vectored batching)
//! ```

pub mod access;
pub mod cluster;
mod config;
pub mod control;
pub mod counters;
pub mod exposition;
pub mod http;
pub mod iscsi;
pub mod limits;
pub mod metrics;
mod portals;
mod sys;

use iscsi::{conn, session};

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

pub use access::{Access, AclRule, ChapAccount, Secret};
pub use config::{Portal, PortalGroup, ServerConfig, TargetDef, Transport, ZeroCopyReads};
pub use limits::Limits;
pub use portals::PortalInfo;
use portals::{Listeners, Listening, StopAccepting};
pub use session::SessionInfo;

/// A target as the running server holds it. Sessions keep an `Arc` of it; its LUN map is a
/// copy-on-write snapshot (`scsi`) read once per command, so `ironsan ctl lun add/remove`
/// swaps in a new map without stopping I/O (commands in flight keep the LU they started on).
/// [`LiveTarget`]'s ErrorRecoveryLevel when the target has none of its own.
const ERL_DEFAULT: u8 = u8::MAX;

#[derive(Debug)]
pub(crate) struct LiveTarget {
    pub name: String,
    pub alias: Option<String>,
    /// MaxConnections offered for this target's sessions; 0: the server's default.
    max_connections: std::sync::atomic::AtomicU16,
    /// The highest ErrorRecoveryLevel offered; [`ERL_DEFAULT`]: the server's default.
    error_recovery_level: std::sync::atomic::AtomicU8,
    scsi: RwLock<Arc<ironsan_scsi::Target>>,
    /// Latency and throughput counters per LUN, made when a LUN first serves a command (or
    /// is first shown); kept after the LUN is removed, until the target is. Connections cache
    /// the `Arc`s, so the mutex is not on the per-command path.
    metrics: Mutex<std::collections::BTreeMap<u64, Arc<metrics::LunMetrics>>>,
}

impl LiveTarget {
    pub(crate) fn new(def: &TargetDef) -> Self {
        LiveTarget {
            name: def.name.clone(),
            alias: def.alias.clone(),
            max_connections: std::sync::atomic::AtomicU16::new(def.max_connections.unwrap_or(0)),
            error_recovery_level: std::sync::atomic::AtomicU8::new(
                def.error_recovery_level.unwrap_or(ERL_DEFAULT),
            ),
            scsi: RwLock::new(Arc::clone(&def.scsi)),
            metrics: Mutex::default(),
        }
    }

    /// The MaxConnections this target offers (`None`: the server's default).
    pub(crate) fn max_connections(&self) -> Option<u16> {
        match self.max_connections.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    pub(crate) fn set_max_connections(&self, n: Option<u16>) {
        self.max_connections
            .store(n.unwrap_or(0), Ordering::Relaxed);
    }

    /// The highest ErrorRecoveryLevel this target offers (`None`: the server's default).
    pub(crate) fn error_recovery_level(&self) -> Option<u8> {
        match self.error_recovery_level.load(Ordering::Relaxed) {
            ERL_DEFAULT => None,
            n => Some(n),
        }
    }

    pub(crate) fn set_error_recovery_level(&self, n: Option<u8>) {
        self.error_recovery_level
            .store(n.unwrap_or(ERL_DEFAULT), Ordering::Relaxed);
    }

    /// The counters of a LUN (made on first use).
    pub(crate) fn lun_metrics(&self, lun: u64) -> Arc<metrics::LunMetrics> {
        Arc::clone(crate::lock(&self.metrics).entry(lun).or_default())
    }

    /// The counters of every current LUN and of every LUN that ever served a command.
    pub(crate) fn all_lun_metrics(&self) -> Vec<(u64, Arc<metrics::LunMetrics>)> {
        let luns: Vec<u64> = self.scsi().luns().map(|(n, _)| n).collect();
        let mut m = crate::lock(&self.metrics);
        for n in luns {
            m.entry(n).or_default();
        }
        m.iter().map(|(n, x)| (*n, Arc::clone(x))).collect()
    }

    /// The current LUN map (one short read lock and an `Arc` clone).
    pub(crate) fn scsi(&self) -> Arc<ironsan_scsi::Target> {
        Arc::clone(&self.scsi.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Change the LUN map: `f` edits a copy, which replaces the current one. Writers are
    /// serialised by the write lock.
    pub(crate) fn update_luns<R>(&self, f: impl FnOnce(&mut ironsan_scsi::Target) -> R) -> R {
        let mut slot = self.scsi.write().unwrap_or_else(|p| p.into_inner());
        let mut next = ironsan_scsi::Target::clone(&slot);
        let r = f(&mut next);
        *slot = Arc::new(next);
        r
    }
}

/// The run-time configuration: which targets exist and who may use them. Replaced whole
/// (copy on write) by the control socket; a login reads one snapshot from start to end.
#[derive(Debug, Default, Clone)]
pub(crate) struct Runtime {
    pub targets: HashMap<String, Arc<LiveTarget>>,
    /// Access control per target name; a target without an entry is open.
    pub access: HashMap<String, Access>,
    /// Access control for discovery sessions.
    pub discovery: Access,
    /// The portal group tags serving each target; a target without an entry: every portal.
    pub portal_groups: HashMap<String, Vec<u16>>,
}

impl Runtime {
    /// The access rules of a target (open if none are configured).
    pub(crate) fn access(&self, target: &str) -> &Access {
        static OPEN: std::sync::OnceLock<Access> = std::sync::OnceLock::new();
        self.access
            .get(target)
            .unwrap_or_else(|| OPEN.get_or_init(Access::default))
    }

    /// Whether the portal group `tag` serves `target`.
    pub(crate) fn served_on(&self, target: &str, tag: u16) -> bool {
        self.portal_groups
            .get(target)
            .is_none_or(|tags| tags.contains(&tag))
    }
}

/// State shared by every connection.
pub(crate) struct Shared {
    pub cfg: ServerConfig,
    runtime: RwLock<Arc<Runtime>>,
    pub stats: counters::ServerStats,
    /// The spec each LUN was made from (for `ironsan ctl save`), kept by `control::Control`.
    pub origins:
        Arc<Mutex<std::collections::BTreeMap<String, std::collections::BTreeMap<u64, String>>>>,
    /// The portals SendTargets and `ctl portals` report (bound address, current tag), kept
    /// equal to `listeners` by every change there.
    pub portals: Mutex<Vec<Portal>>,
    /// The listening sockets, each stoppable on its own (`ironsan ctl portal remove`).
    listeners: Mutex<Listeners>,
    pub sessions: Mutex<session::Registry>,
    pub next_tsih: AtomicU16,
    pub next_nexus_id: AtomicU64,
    pub shutdown: watch::Receiver<bool>,
    /// Connections open now (accepted and not yet closed).
    pub connections: AtomicUsize,
    /// This process as a node of a cluster of gateways, once it joined.
    pub cluster: std::sync::OnceLock<Arc<cluster::ClusterNode>>,
}

impl Shared {
    /// The current run-time configuration.
    pub(crate) fn runtime(&self) -> Arc<Runtime> {
        Arc::clone(&self.runtime.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Change the run-time configuration: `f` edits a copy that replaces the current one
    /// unless it fails. Writers are serialised.
    pub(crate) fn update_runtime<R, E>(
        &self,
        f: impl FnOnce(&mut Runtime) -> Result<R, E>,
    ) -> Result<R, E> {
        let mut slot = self.runtime.write().unwrap_or_else(|p| p.into_inner());
        let mut next = Runtime::clone(&slot);
        let r = f(&mut next)?;
        *slot = Arc::new(next);
        drop(slot);
        self.refresh_alua();
        Ok(r)
    }

    /// Keep each target's default ALUA layout (one target port group per portal group that
    /// serves it) in step with the portals and the target's `portal_groups`. Targets whose
    /// groups were configured keep them.
    pub(crate) fn refresh_alua(&self) {
        // One refresh at a time: two racing could leave the older port list in place.
        static REFRESH: Mutex<()> = Mutex::new(());
        let _one = lock(&REFRESH);
        let rt = self.runtime();
        let mut all: Vec<u16> = lock(&self.portals).iter().map(|p| p.tag).collect();
        all.sort_unstable();
        all.dedup();
        for (name, t) in &rt.targets {
            let tags = rt.portal_groups.get(name).unwrap_or(&all);
            t.scsi().follow_ports(tags);
        }
    }

    pub(crate) fn alloc_tsih(&self) -> u16 {
        loop {
            let t = self.next_tsih.fetch_add(1, Ordering::Relaxed);
            if t != 0 {
                return t;
            }
        }
    }
}

/// A bound, not yet running, server.
///
/// Reads of file LUNs go to sockets with `sendfile`, which raises SIGPIPE when the peer has
/// reset: a process embedding the server must ignore SIGPIPE, as every Rust `main` does
/// (the runtime sets it to ignored before `main`); other sends use `MSG_NOSIGNAL`.
pub struct Server {
    shared: Arc<Shared>,
    shutdown_tx: watch::Sender<bool>,
}

/// The configured portals and the connections open now (no lock taken).
impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("listen", &self.shared.cfg.listen)
            .field(
                "connections",
                &self.shared.connections.load(Ordering::Relaxed),
            )
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Bind every portal. Fails if any address cannot be bound.
    pub async fn bind(cfg: ServerConfig) -> std::io::Result<Server> {
        let mut listening = Vec::new();
        let groups = std::iter::once((1u16, &cfg.listen))
            .chain(cfg.portal_groups.iter().map(|g| (g.tag, &g.listen)));
        for (tag, addrs) in groups {
            if tag == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "portal group tag 0 is reserved",
                ));
            }
            for addr in addrs {
                listening.push(Listening::bind(*addr, tag, Transport::Iscsi)?);
            }
        }
        let portals = listening.iter().map(Listening::portal).collect();
        let runtime = Runtime {
            targets: cfg
                .targets
                .iter()
                .map(|t| (t.name.clone(), Arc::new(LiveTarget::new(t))))
                .collect(),
            access: cfg.access.clone(),
            discovery: cfg.discovery.clone(),
            portal_groups: cfg.target_portal_groups.clone(),
        };
        let (shutdown_tx, shutdown) = watch::channel(false);
        let shared = Arc::new(Shared {
            cfg,
            runtime: RwLock::new(Arc::new(runtime)),
            stats: counters::ServerStats::default(),
            origins: Default::default(),
            portals: Mutex::new(portals),
            listeners: Mutex::new(Listeners::new(listening)),
            sessions: Mutex::new(session::Registry::default()),
            next_tsih: AtomicU16::new(1),
            next_nexus_id: AtomicU64::new(1),
            shutdown,
            connections: AtomicUsize::new(0),
            cluster: std::sync::OnceLock::new(),
        });
        shared.refresh_alua();
        Ok(Server {
            shared,
            shutdown_tx,
        })
    }

    /// The addresses actually bound (useful with port 0), in the order they were bound.
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.portals().into_iter().map(|p| p.addr).collect()
    }

    /// The portals actually bound, with their group tags.
    pub fn portals(&self) -> Vec<Portal> {
        lock(&self.shared.portals).clone()
    }

    /// A handle to inspect and change the running server (the control socket uses it).
    pub fn control(&self) -> control::Control {
        control::Control::new(Arc::clone(&self.shared))
    }

    /// A snapshot of the sessions (for admin views and tests).
    pub fn sessions(&self) -> Vec<SessionInfo> {
        self.shared
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .info()
    }

    /// Serve until `stop` resolves, then shut down gracefully: stop accepting, ask every
    /// initiator to log out (Async Message event 1; connections keep serving, so commands in
    /// flight finish), wait up to `shutdown_grace` for every connection to end, then close
    /// the rest.
    pub async fn run(self, stop: impl Future<Output = ()>) {
        self.shared
            .start_accepting(tokio::runtime::Handle::current());
        // Also when this future is dropped, as the accept loops are not its children.
        let accepting = StopAccepting(Arc::clone(&self.shared));
        stop.await;
        // Every listening socket is closed when this returns; portals can no longer be added.
        drop(accepting);
        let grace = self.shared.cfg.limits.shutdown_grace;
        let (sessions, conns) = (self.shared.session_count(), self.shared.open_connections());
        tracing::info!(
            sessions,
            connections = conns,
            "shutting down: initiators asked to log out; waiting up to {grace:?}"
        );
        let _ = self.shutdown_tx.send(true);
        let drained = tokio::time::timeout(grace, self.shared.wait_idle())
            .await
            .is_ok();
        // Sessions left with no connection wait for a reassignment that can no longer come
        // (ErrorRecoveryLevel 2): they end now.
        self.shared.end_idle_sessions();
        if drained {
            tracing::info!("shutdown: every session has ended");
            return;
        }
        let left = self.shared.all_sessions();
        tracing::warn!(
            sessions = left.len(),
            connections = self.shared.open_connections(),
            "shutdown: grace time over; closing the remaining connections"
        );
        for s in &left {
            tracing::warn!(initiator = %s.initiator_name, tsih = s.tsih.0, "shutdown: closing a session that did not log out");
            s.close_conns(None);
        }
        // Closing is quick (commands are aborted); do not hang on a stuck login either.
        let _ = tokio::time::timeout(Duration::from_secs(1), self.shared.wait_idle()).await;
    }
}

impl Shared {
    fn session_count(&self) -> usize {
        self.sessions.lock().map(|s| s.len()).unwrap_or(0)
    }

    fn all_sessions(&self) -> Vec<Arc<session::Session>> {
        crate::lock(&self.sessions).all()
    }

    fn open_connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// Until no connection is left, nor a session with one (a session whose connections
    /// are only kept for reassignment needs nothing from its initiator to end).
    async fn wait_idle(&self) {
        while self.open_connections() > 0 || self.all_sessions().iter().any(|s| !s.is_idle()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// End the sessions with no connection (kept for reassignment at ErrorRecoveryLevel 2).
    fn end_idle_sessions(&self) {
        for s in self.all_sessions().into_iter().filter(|s| s.is_idle()) {
            crate::lock(&self.sessions).retire(&s);
        }
    }
}

/// Take a mutex, taking over one a panicking holder poisoned: every critical section in this
/// crate leaves its state consistent before it can panic, so the state is still good.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
