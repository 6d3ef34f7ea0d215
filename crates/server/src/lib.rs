//! # ironsan-server: the runtime side of ironsan
//!
//! The only crate that knows about tokio and sockets. It accepts connections on portals, runs
//! each connection as a reader (this task) plus a writer task, keeps the session registry
//! (reinstatement, several connections per session), and glues the sans-IO protocol core
//! (`ironsan-proto`) to the SCSI device server (`ironsan-scsi`).
//!
//! ```text
//!  socket ──read──▶ conn::Connection (reader) ──▶ proto (login, window, R2T/Data-Out)
//!                        │ spawn per command
//!                        ▼
//!                  scsi::Target::execute ──▶ backend
//!                        │ Vec<OutPdu>
//!                        ▼
//!  socket ◀─write── writer task (StatSN, ExpCmdSN/MaxCmdSN, digests, vectored batching)
//! ```

pub mod access;
pub mod admin;
pub mod cluster;
mod conn;
pub mod counters;
pub mod exposition;
pub mod fair;
pub mod http;
pub mod io;
pub mod limits;
pub mod metrics;
mod session;
mod sys;
mod writer;

use ironsan_proto::negotiate::TargetDefaults;
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

pub use access::{Access, AclRule, ChapAccount, Secret};
pub use limits::Limits;
pub use session::SessionInfo;

/// One iSCSI target (an iSCSI node with a SCSI target device behind it).
#[derive(Clone, Debug)]
pub struct TargetDef {
    /// iSCSI qualified name.
    pub name: String,
    pub alias: Option<String>,
    /// The most connections a session with this target may have (MaxConnections, RFC 7143
    /// §13.2); `None`: [`ServerConfig::negotiation`]'s.
    pub max_connections: Option<u16>,
    /// The highest ErrorRecoveryLevel its sessions may agree (RFC 7143 §13.20; at most
    /// [`ironsan_proto::negotiate::MAX_ERROR_RECOVERY_LEVEL`]); `None`:
    /// [`ServerConfig::negotiation`]'s.
    pub error_recovery_level: Option<u8>,
    pub scsi: Arc<ironsan_scsi::Target>,
}

/// A target portal group (RFC 7143 §4.4.1): portals that share a tag. A session's
/// connections all use portals of one group; the tag is the TargetPortalGroupTag of logins
/// on those portals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortalGroup {
    /// 1 to 65535.
    pub tag: u16,
    pub listen: Vec<SocketAddr>,
}

/// A bound portal: its address and its group's tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Portal {
    pub addr: SocketAddr,
    pub tag: u16,
}

/// Everything the server needs to run.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Portals of the implicit group with tag 1 (bound before `portal_groups`).
    pub listen: Vec<SocketAddr>,
    /// Further portal groups, each with its own tag.
    pub portal_groups: Vec<PortalGroup>,
    /// The portal groups (tags) that serve a target; a target without an entry is served on
    /// every portal. A login on another portal fails with 0203 (not found at this address)
    /// and SendTargets lists only the target's portals.
    pub target_portal_groups: HashMap<String, Vec<u16>>,
    pub targets: Vec<TargetDef>,
    /// What we offer in operational negotiation.
    pub negotiation: TargetDefaults,
    /// Commands one session may have in the target at once (sets MaxCmdSN).
    pub queue_depth: u32,
    /// Resource limits and data-path switches (`[limits]`).
    pub limits: Limits,
    /// Largest Expected Data Transfer Length of a write the target will buffer.
    pub max_io_bytes: u32,
    /// Access control (ACL, CHAP) per target name; a target without an entry is open.
    pub access: HashMap<String, Access>,
    /// Access control for discovery sessions.
    pub discovery: Access,
}

/// How a connection sends large file-LUN reads without copying them through a buffer. Only
/// ever without a data digest (the digest needs the bytes) and for reads of at least 64 KiB.
/// In `Auto` and `On`, with segments of at least 64 KiB, reads of nothing stored (RAM-LUN
/// holes, NULL LUNs) are sent with `sendfile` from an empty sealed file, the kernel's zero
/// page ([`ironsan_backend::InPlaceRead::zero_page`]), under BBR too (Linux 6.5 and later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroCopyReads {
    /// `sendfile` from the page cache (as `on`), unless the connection's TCP congestion
    /// control paces inside TCP (BBR without an fq qdisc): there each 64 KiB splice chunk is
    /// paced on its own, which measured 1.4-1.7x the CPU of copying, so tmpfs/ramfs LUNs send
    /// from a mapping instead (as `mapped`) and other file systems copy (docs/PERFORMANCE.md).
    #[default]
    Auto,
    /// `sendfile` from the page cache, any buffered file whose range is cached, with segments
    /// (MaxRecvDataSegmentLength) of at least 64 KiB.
    On,
    /// tmpfs/ramfs LUNs only: a vectored send straight from a shared mapping of the file,
    /// the kernel's one copy into the socket (pages that do not exist yet are copied as usual).
    Mapped,
    Off,
}

impl ZeroCopyReads {
    const ALL: [ZeroCopyReads; 4] = [
        ZeroCopyReads::Auto,
        ZeroCopyReads::On,
        ZeroCopyReads::Mapped,
        ZeroCopyReads::Off,
    ];
    /// The name in the configuration and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ZeroCopyReads::Auto => "auto",
            ZeroCopyReads::On => "on",
            ZeroCopyReads::Mapped => "mapped",
            ZeroCopyReads::Off => "off",
        }
    }
}

impl std::str::FromStr for ZeroCopyReads {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|m| m.name()).collect();
                format!("'{s}' is not one of {}", names.join(", "))
            })
    }
}

impl std::fmt::Display for ZeroCopyReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl ServerConfig {
    pub fn new(listen: Vec<SocketAddr>, targets: Vec<TargetDef>) -> Self {
        ServerConfig {
            listen,
            portal_groups: Vec::new(),
            target_portal_groups: HashMap::new(),
            targets,
            negotiation: TargetDefaults::default(),
            queue_depth: 128,
            limits: Limits::default(),
            max_io_bytes: ironsan_scsi::MAX_TRANSFER_BYTES,
            access: HashMap::new(),
            discovery: Access::default(),
        }
    }
}

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
    /// The spec each LUN was made from (for `ironsan ctl save`), kept by `admin::Control`.
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
    pub(crate) fn update_runtime<R>(
        &self,
        f: impl FnOnce(&mut Runtime) -> Result<R, String>,
    ) -> Result<R, String> {
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
                listening.push(Listening::bind(*addr, tag)?);
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
            listeners: Mutex::new(Listeners {
                list: listening,
                handle: None,
                closed: false,
            }),
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
    pub fn control(&self) -> admin::Control {
        admin::Control::new(Arc::clone(&self.shared))
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

/// Connections beyond `max_connections` accepted only to answer their login with 0302.
const OVERFLOW_CONNECTIONS: usize = 16;

/// Counts a connection in `Shared::connections` while it lives.
struct ConnGuard(Arc<Shared>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A listening portal. The socket is owned here (through the one long-lived strong `Arc`);
/// its accept loop holds only a `Weak` and upgrades it while it polls, so dropping this
/// entry closes the socket at once (see [`Listening::close`]) without waiting for the loop.
struct Listening {
    /// The address as asked for (port 0: any free port).
    requested: SocketAddr,
    /// The address actually bound.
    addr: SocketAddr,
    /// The portal group tag; read by the accept loop for each connection it accepts.
    tag: Arc<AtomicU16>,
    listener: Arc<TcpListener>,
    /// Wakes the accept loop to end.
    stop: Arc<Notify>,
    /// Whether its accept loop runs (false between `Server::bind` and `Server::run`).
    started: bool,
}

/// The listening portals, in the order they were bound or added.
struct Listeners {
    list: Vec<Listening>,
    /// Where accept loops run: set by `Server::run`.
    handle: Option<tokio::runtime::Handle>,
    /// Shutdown has begun: every socket is closed and no portal may be added.
    closed: bool,
}

impl Listeners {
    /// Refuse `addr` if a portal (other than the `except`-th) is bound to it or was asked
    /// for it. Port 0 asks for a new free port: never a duplicate.
    fn refuse_duplicate(&self, addr: SocketAddr, except: Option<usize>) -> Result<(), String> {
        if addr.port() == 0 {
            return Ok(());
        }
        match self
            .list
            .iter()
            .enumerate()
            .find(|(j, p)| Some(*j) != except && (p.addr == addr || p.requested == addr))
        {
            Some((_, p)) => Err(format!(
                "portal {addr} already exists (group {})",
                p.tag.load(Ordering::Relaxed)
            )),
            None => Ok(()),
        }
    }

    /// The runtime a socket for `addr` is registered with: the server's (or the caller's
    /// before `run`).
    fn runtime_handle(&self, addr: SocketAddr) -> Result<tokio::runtime::Handle, String> {
        match self.handle.clone() {
            Some(h) => Ok(h),
            None => tokio::runtime::Handle::try_current()
                .map_err(|_| format!("cannot listen on {addr}: no tokio runtime")),
        }
    }
}

/// Take a mutex, taking over one a panicking holder poisoned: every critical section in this
/// crate leaves its state consistent before it can panic, so the state is still good.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Listening {
    /// Bind `addr` as tokio's `TcpListener::bind` does (SO_REUSEADDR, backlog 1024), but
    /// synchronously, so the control socket's (blocking) commands can add portals. Needs a
    /// tokio runtime context (the socket is registered with its reactor).
    fn bind(addr: SocketAddr, tag: u16) -> std::io::Result<Listening> {
        let err = |e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}"))
        };
        let sock = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }
        .map_err(err)?;
        sock.set_reuseaddr(true).map_err(err)?;
        sock.bind(addr).map_err(err)?;
        let listener = sock.listen(1024).map_err(err)?;
        let bound = listener.local_addr().map_err(err)?;
        Ok(Listening {
            requested: addr,
            addr: bound,
            tag: Arc::new(AtomicU16::new(tag)),
            listener: Arc::new(listener),
            stop: Arc::new(Notify::new()),
            started: false,
        })
    }

    fn portal(&self) -> Portal {
        Portal {
            addr: self.addr,
            tag: self.tag.load(Ordering::Relaxed),
        }
    }

    fn start(&mut self, handle: &tokio::runtime::Handle, shared: &Arc<Shared>) {
        if !self.started {
            self.started = true;
            handle.spawn(accept_loop(
                Arc::downgrade(&self.listener),
                Arc::clone(&self.tag),
                Arc::clone(&self.stop),
                Arc::clone(shared),
            ));
        }
    }

    /// Stop accepting and close the socket now: when this returns, connection attempts are
    /// refused. Connections already accepted are not touched.
    fn close(self) {
        self.stop.notify_one();
        // The accept loop holds a strong reference only inside one (non-blocking) poll; wait
        // those microseconds out so the socket is closed here, not a moment later.
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        let mut arc = self.listener;
        loop {
            match Arc::try_unwrap(arc) {
                Ok(listener) => {
                    drop(listener);
                    return;
                }
                Err(a) if std::time::Instant::now() < deadline => {
                    arc = a;
                    std::thread::yield_now();
                }
                // Never expected: the loop closes it when its poll returns.
                Err(_) => return,
            }
        }
    }
}

/// Closes every portal when dropped (`Server::run` ending or being dropped).
struct StopAccepting(Arc<Shared>);

impl Drop for StopAccepting {
    fn drop(&mut self) {
        self.0.stop_accepting();
    }
}

/// A portal as `admin::Control::portal_list` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortalInfo {
    /// The address actually bound.
    pub addr: SocketAddr,
    pub tag: u16,
    /// The address as configured or added (differs from `addr` for port 0).
    pub requested: SocketAddr,
}

impl Shared {
    /// Publish the portal list (SendTargets, `ctl portals`) after a change of `l`.
    fn sync_portals(&self, l: &Listeners) {
        *lock(&self.portals) = l.list.iter().map(Listening::portal).collect();
        self.refresh_alua();
    }

    /// `Server::run`: start every accept loop on this runtime; portals added from now on
    /// start at once.
    fn start_accepting(self: &Arc<Self>, handle: tokio::runtime::Handle) {
        let mut l = lock(&self.listeners);
        for p in &mut l.list {
            p.start(&handle, self);
        }
        l.handle = Some(handle);
    }

    /// Shutdown: close every listening socket. The published portal list is left as it was
    /// (SendTargets during the grace time answers as before).
    fn stop_accepting(&self) {
        let list = {
            let mut l = lock(&self.listeners);
            l.closed = true;
            l.handle = None;
            std::mem::take(&mut l.list)
        };
        for p in list {
            p.close();
        }
    }

    pub(crate) fn portal_list(&self) -> Vec<PortalInfo> {
        lock(&self.listeners)
            .list
            .iter()
            .map(|p| PortalInfo {
                addr: p.addr,
                tag: p.tag.load(Ordering::Relaxed),
                requested: p.requested,
            })
            .collect()
    }

    /// The listeners, locked to bind a portal of group `tag`: refused for tag 0 (reserved)
    /// and once shutdown has begun.
    fn listeners_to_bind(&self, tag: u16) -> Result<std::sync::MutexGuard<'_, Listeners>, String> {
        if tag == 0 {
            return Err("portal group tag 0 is reserved".into());
        }
        let l = lock(&self.listeners);
        if l.closed {
            return Err("the server is shutting down".into());
        }
        Ok(l)
    }

    /// Bind `addr` as a portal of group `tag` and start accepting on it (if the server runs).
    pub(crate) fn add_portal(
        self: &Arc<Self>,
        addr: SocketAddr,
        tag: u16,
    ) -> Result<Portal, String> {
        let mut l = self.listeners_to_bind(tag)?;
        l.refuse_duplicate(addr, None)?;
        let handle = l.runtime_handle(addr)?;
        let mut p = {
            let _in_runtime = handle.enter();
            Listening::bind(addr, tag).map_err(|e| e.to_string())?
        };
        if l.handle.is_some() {
            p.start(&handle, self);
        }
        let portal = p.portal();
        l.list.push(p);
        self.sync_portals(&l);
        drop(l);
        tracing::info!(portal = %portal.addr, tag, "portal added");
        Ok(portal)
    }

    /// Stop accepting on the portal bound to `addr` and close its socket. Sessions that came
    /// in through it keep running. Refused for the last portal, and for the last portal of a
    /// group that a target is restricted to (its `portal_groups`).
    pub(crate) fn remove_portal(&self, addr: SocketAddr) -> Result<Portal, String> {
        let mut l = lock(&self.listeners);
        let i = l
            .list
            .iter()
            .position(|p| p.addr == addr)
            .ok_or_else(|| format!("no portal {addr} (ironsan ctl portals lists them)"))?;
        if l.list.len() == 1 {
            return Err(format!("{addr} is the last portal; add another one first"));
        }
        self.check_group_keeps_a_portal(&l, i)?;
        let p = l.list.remove(i);
        self.sync_portals(&l);
        drop(l);
        let portal = p.portal();
        p.close();
        tracing::info!(portal = %portal.addr, tag = portal.tag, "portal removed");
        Ok(portal)
    }

    /// Refuse to take portal `i` out of its group if it is the group's last portal and a
    /// target is restricted to groups that include it (it would become unreachable there,
    /// and a saved configuration would name a group that does not exist).
    fn check_group_keeps_a_portal(&self, l: &Listeners, i: usize) -> Result<(), String> {
        let (addr, tag) = (l.list[i].addr, l.list[i].tag.load(Ordering::Relaxed));
        let last_of_group = !l
            .list
            .iter()
            .enumerate()
            .any(|(j, p)| j != i && p.tag.load(Ordering::Relaxed) == tag);
        if !last_of_group {
            return Ok(());
        }
        let rt = self.runtime();
        let mut named: Vec<&str> = rt
            .portal_groups
            .iter()
            .filter(|(t, tags)| tags.contains(&tag) && rt.targets.contains_key(*t))
            .map(|(t, _)| t.as_str())
            .collect();
        if named.is_empty() {
            return Ok(());
        }
        named.sort_unstable();
        Err(format!(
            "{addr} is the last portal of group {tag}, which {} name(s) in portal_groups; change that first (ironsan ctl apply)",
            named.join(", ")
        ))
    }

    /// Close the portal bound to `old` and listen on `new` (group `tag`) in its place, for an
    /// address that cannot be bound while `old` listens (127.0.0.1:3260 → 0.0.0.0:3260). If
    /// `new` cannot be bound, `old` is bound again and the error returned.
    pub(crate) fn replace_portal(
        self: &Arc<Self>,
        old: SocketAddr,
        new: SocketAddr,
        tag: u16,
    ) -> Result<Portal, String> {
        let mut l = self.listeners_to_bind(tag)?;
        let i = l
            .list
            .iter()
            .position(|p| p.addr == old)
            .ok_or_else(|| format!("no portal {old}"))?;
        l.refuse_duplicate(new, Some(i))?;
        let old_tag = l.list[i].tag.load(Ordering::Relaxed);
        if old_tag != tag {
            self.check_group_keeps_a_portal(&l, i)?;
        }
        let handle = l.runtime_handle(new)?;
        let _in_runtime = handle.enter();
        let started = l.handle.is_some();
        let gone = l.list.remove(i);
        let old_requested = gone.requested;
        gone.close();
        let (mut p, result) = match Listening::bind(new, tag) {
            Ok(p) => (p, Ok(())),
            Err(e) => match Listening::bind(old, old_tag) {
                Ok(mut back) => {
                    back.requested = old_requested;
                    (back, Err(e.to_string()))
                }
                Err(e2) => {
                    self.sync_portals(&l);
                    return Err(format!("{e}; and {old} could not be bound again: {e2}"));
                }
            },
        };
        if started {
            p.start(&handle, self);
        }
        let portal = p.portal();
        l.list.insert(i, p);
        self.sync_portals(&l);
        drop(l);
        result?;
        tracing::info!(old = %old, portal = %portal.addr, tag, "portal replaced");
        Ok(portal)
    }

    /// Move the portal bound to `addr` to group `tag`: connections accepted from now on get
    /// the new tag, those already accepted keep theirs.
    pub(crate) fn set_portal_tag(&self, addr: SocketAddr, tag: u16) -> Result<(), String> {
        if tag == 0 {
            return Err("portal group tag 0 is reserved".into());
        }
        let l = lock(&self.listeners);
        let p = l
            .list
            .iter()
            .find(|p| p.addr == addr)
            .ok_or_else(|| format!("no portal {addr}"))?;
        let old = p.tag.swap(tag, Ordering::Relaxed);
        self.sync_portals(&l);
        drop(l);
        tracing::info!(portal = %addr, old, tag, "portal moved to another group");
        Ok(())
    }
}

/// Accept on one portal until it is removed (its socket dropped or `stop` notified) or the
/// task is dropped.
async fn accept_loop(
    listener: Weak<TcpListener>,
    tag: Arc<AtomicU16>,
    stop: Arc<Notify>,
    shared: Arc<Shared>,
) {
    loop {
        // The strong reference lives only inside the poll (see `Listening::close`).
        let accept = std::future::poll_fn(|cx| match listener.upgrade() {
            Some(l) => l.poll_accept(cx).map(Some),
            None => std::task::Poll::Ready(None),
        });
        let accepted = tokio::select! {
            biased;
            _ = stop.notified() => return,
            r = accept => r,
        };
        match accepted {
            None => return,
            Some(Ok((stream, peer))) => {
                // Beyond max_connections a few more are served only to fail their login with
                // 0302; past that, close at once so descriptors stay bounded.
                let open = shared.connections.fetch_add(1, Ordering::Relaxed);
                let guard = ConnGuard(Arc::clone(&shared));
                if open
                    >= shared
                        .cfg
                        .limits
                        .max_connections
                        .saturating_add(OVERFLOW_CONNECTIONS)
                {
                    tracing::warn!(%peer, "connection limit reached; closing");
                    drop(stream);
                    drop(guard);
                    continue;
                }
                let _ = stream.set_nodelay(true);
                let over = open >= shared.cfg.limits.max_connections;
                let tag = tag.load(Ordering::Relaxed);
                tokio::spawn(async move {
                    conn::run(stream, peer, tag, Arc::clone(&guard.0), over).await;
                    drop(guard);
                });
            }
            Some(Err(e)) => {
                // EMFILE and friends: back off rather than spin.
                tracing::warn!("accept failed: {e}");
                tokio::select! {
                    _ = stop.notified() => return,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
    }
}
