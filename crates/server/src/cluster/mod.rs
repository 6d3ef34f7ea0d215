//! A node of a cluster of ironsan gateways that serve the same targets and the same RBD
//! images (`[cluster]` in the configuration; docs/ARCHITECTURE.md, "Several gateways on one
//! image"). Everything the nodes share goes through Ceph's own primitives, no consensus of
//! ours:
//!
//! * **The cluster object** (`ironsan.cluster.<group>` in the cluster's pool) lists every node (its
//!   number, name and RADOS client address) and every address fenced so far, replaced with
//!   compare-and-set ([`SharedPool::update`]). Every node watches it and pings on it.
//! * **Leases and fencing** ([`liveness`]). Every `heartbeat` each node pings the cluster
//!   object; an answer to a ping sent at `s` gives that node a lease until `s + lease`. A
//!   node answers only while it holds no write (in a command, or still in the device) older
//!   than `lease`. A peer whose lease ran out is *suspect*: while one is, or one has not
//!   answered since this node joined or came back, no command that changes a shared medium
//!   starts here (the write gate, [`ClusterNode::begin_write`]); the suspect is fenced —
//!   its address added to the cluster object's fenced list (compare-and-set, refused to a
//!   node that is itself on it, so two nodes can never fence each other) and then
//!   blocklisted, after which the OSDs refuse whatever it still sends — and the gate opens
//!   again. A node whose own lease lapsed starts no write (its RBD images hand nothing more
//!   to librbd: [`Lease`]) and fences nobody until it is back: its own answer seen again
//!   and the cluster object read without its address among the fenced.
//! * **One RADOS object per target** (`ironsan.target.<name>`) holds every node's
//!   registration for that target (relative target ports, portals) and every shared LU's
//!   persistent-reservation record, replaced with compare-and-set. Every node watches it.
//! * **Membership and ALUA.** Each node is one target port group (identifier = node
//!   number); its relative target ports are its portal group tags, unique in the cluster
//!   (a node whose tag another node has is refused at start). A node whose lease holds is
//!   active/optimized in REPORT TARGET PORT GROUPS, any other unavailable (never dropped).
//! * **Reservations.** A PERSISTENT RESERVE OUT works out the change on the object's record
//!   (`ironsan_scsi`), writes it with compare-and-set, and notifies it; every node applies it
//!   before it acknowledges. A registered node that does not acknowledge within
//!   `notify_timeout` is fenced before the command completes: once GOOD is returned, every
//!   node enforces the new state or can no longer reach the cluster.
//! * **Partition.** When this node's watch of a target object breaks (it may have missed
//!   changes), its own group becomes unavailable (commands get NOT READY, LOGICAL UNIT NOT
//!   ACCESSIBLE, TARGET PORT IN UNAVAILABLE STATE, so initiators use other paths) until it
//!   has watched and read the object again. A node the cluster fenced stays unavailable: it
//!   must be restarted (a new client) to serve again.
//!
//! A node serves its RBD images through the same RADOS client ([`ClusterNode::client`]), so
//! blocklisting its one address fences its writes to the images too.
//!
//! Every call here that waits for the cluster runs on this module's threads (`ironsan-cluster`
//! for membership and fencing, `ironsan-ping` and its short-lived ping threads), librados'
//! callback threads or a blocking thread (`spawn_blocking`), never on a connection's task.

mod liveness;

use crate::control::views::{
    ClusterNodeView, ClusterTargetView, ClusterView, GateView, LastFenceView, LeaseView, PeerView,
    SharedLunView,
};
use ironsan_backend::rbd::shared::{Notification, NotifyReply, SharedError, SharedPool, Watcher};
use ironsan_backend::{Lease, RadosClient};
use ironsan_scsi::{
    AccessState, ClusterFuture, ClusterLu, ClusterLuHandle, PortGroup, PrChange, SenseReason,
    WriteAdmission, WriteToken,
};
use liveness::{Gate, Liveness, PeerState};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How a node joins its cluster (`[cluster]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// This node's number, 1-65535: its ALUA target port group.
    pub node: u16,
    /// A name for people (`ctl cluster`, logs); default: the host name.
    pub name: String,
    /// The pool that holds the shared objects (the cluster object and one per target).
    pub pool: String,
    /// ceph.conf (`None`: librados' own search).
    pub conf: Option<PathBuf>,
    /// The cephx client, without `client.`.
    pub id: String,
    /// How often this node pings the others (and re-reads the shared objects).
    pub heartbeat: Duration,
    /// How long a reservation change waits for the other nodes before fencing them.
    pub notify_timeout: Duration,
    /// The cluster's name: the nodes of one pool and group are one cluster (their cluster
    /// object is `ironsan.cluster.<group>`); other groups in the pool are other clusters.
    pub group: String,
    /// How long an answer to a ping keeps a node alive in the others' view; also how long
    /// a node may hold a write before it stops answering (docs/OPERATIONS.md, "The time
    /// budget of a cluster").
    pub lease: Duration,
}

/// Default `heartbeat`.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// Default `notify_timeout`.
pub const DEFAULT_NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);
/// Default `lease`.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(3);
/// How long a ping waits for the answers (the OSD keeps notify timeouts in whole seconds;
/// pings overlap, so a node that does not answer delays nobody's lease).
pub const PING_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether `lease` is long enough for `heartbeat`: a peer's lease must outlast the ping
/// after next (the answers to a ping arrive up to [`PING_TIMEOUT`] after it leaves).
pub fn check_lease(heartbeat: Duration, lease: Duration) -> Result<(), String> {
    let least = heartbeat * 2 + PING_TIMEOUT;
    if lease < least {
        return Err(format!(
            "cluster lease {} ms is too short for heartbeat {} ms: at least 2 x heartbeat + {} s ({} ms)",
            lease.as_millis(),
            heartbeat.as_millis(),
            PING_TIMEOUT.as_secs(),
            least.as_millis()
        ));
    }
    Ok(())
}

/// The object every node of cluster `group` registers in, watches and pings on.
pub fn cluster_object(group: &str) -> String {
    format!("ironsan.cluster.{group}")
}

/// Default `group`.
pub const DEFAULT_GROUP: &str = "default";

/// How long a fenced address stays blocklisted (and listed in the cluster object): longer
/// than any pause a process could come back from with writes in hand.
const FENCE_EXPIRE: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long a write waits for the write gate before it is refused.
fn gate_wait(cfg: &ClusterConfig) -> Duration {
    cfg.lease * 2 + cfg.heartbeat * 2 + PING_TIMEOUT
}

/// The cluster object.
#[derive(Serialize, Deserialize, Default, Clone, Debug)]
struct ClusterObject {
    #[serde(default)]
    members: BTreeMap<u16, Member>,
    /// Address → who fenced it.
    #[serde(default)]
    fenced: BTreeMap<String, FenceRecord>,
}

/// A node as the cluster object lists it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
struct Member {
    name: String,
    /// Its RADOS client's address: what fencing it blocklists.
    address: String,
    instance: u64,
    /// When it registered (seconds since the epoch).
    joined: u64,
}

/// One fenced address.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
struct FenceRecord {
    /// The node it was.
    node: u16,
    /// The node that fenced it.
    by: u16,
    /// When (seconds since the epoch).
    at: u64,
}

/// The shared object of one target.
#[derive(Serialize, Deserialize, Default, Clone, Debug)]
struct TargetObject {
    #[serde(default)]
    nodes: BTreeMap<u16, NodeEntry>,
    /// LUN → persistent-reservation record (made and read by `ironsan_scsi`).
    #[serde(default)]
    luns: BTreeMap<u64, String>,
}

/// One node's registration for a target: the node, and its ports there.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
struct NodeEntry {
    #[serde(flatten)]
    member: Member,
    /// Relative target ports (= portal group tags) through which it serves the target.
    ports: Vec<u16>,
    portals: Vec<String>,
}

/// What a node notifies the others of.
#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Message {
    Ping {
        from: u16,
    },
    Pr {
        lun: u64,
        record: String,
    },
    /// A LOGICAL UNIT RESET of `lun` on node `from`.
    Reset {
        from: u16,
        lun: u64,
    },
}

/// What a node acknowledges with: who it is and the record serial it applied per LUN (per
/// target, for a ping on the cluster object).
#[derive(Serialize, Deserialize, Default, Debug)]
struct Ack {
    node: u16,
    #[serde(default)]
    applied: BTreeMap<u64, u64>,
    #[serde(default)]
    targets: BTreeMap<String, BTreeMap<u64, u64>>,
}

/// This node's standing with the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Health {
    Serving,
    /// The watch of a target object broke: changes may have been missed.
    Partitioned(String),
    /// The cluster fenced this node's client.
    Fenced(String),
}

impl Health {
    fn name(&self) -> &'static str {
        match self {
            Health::Serving => "serving",
            Health::Partitioned(_) => "partitioned",
            Health::Fenced(_) => "fenced",
        }
    }
}

/// What this node knows of another node (or itself) for one target.
#[derive(Clone, Debug)]
struct NodeView {
    entry: NodeEntry,
    applied: BTreeMap<u64, u64>,
}

/// One target this node serves as part of the cluster.
struct TargetAgent {
    name: String,
    oid: String,
    watch: Mutex<Option<Watcher>>,
    view: Mutex<BTreeMap<u16, NodeView>>,
}

/// Counters of the write gate and fencing (metrics, `ctl cluster`).
#[derive(Default, Debug)]
struct GateStats {
    /// Commands waiting for the gate now.
    waiting: AtomicU64,
    /// Commands that waited for it, and for how long in all (ns).
    waited: AtomicU64,
    waited_ns: AtomicU64,
    /// Commands refused (lease lapsed, or the gate stayed closed).
    refused: AtomicU64,
    /// Peers this node fenced.
    fences: AtomicU64,
}

/// The last fence this node carried out: which node, and how long after its lease ran out.
#[derive(Clone, Copy, Debug)]
struct LastFence {
    node: u16,
    after_lapse: Duration,
    at: Instant,
}

/// What a cluster node needs of the server it belongs to, and nothing more: its targets,
/// their portals, logical units and port groups, and two task operations a change made
/// through another node asks for. The control plane implements it
/// ([`crate::control::Control`]); the cluster sees no session, connection or PDU.
pub trait Host: Send + Sync {
    /// The names of the targets served.
    fn target_names(&self) -> Vec<String>;
    /// (portal group tag, bound address) of every portal that serves `target`.
    fn target_portals(&self, target: &str) -> Vec<(u16, std::net::SocketAddr)>;
    /// `target`'s logical units by LUN.
    fn logical_units(&self, target: &str) -> Vec<(u64, Arc<ironsan_scsi::LogicalUnit>)>;
    fn logical_unit(&self, target: &str, lun: u64) -> Option<Arc<ironsan_scsi::LogicalUnit>>;
    /// Abort the tasks of the I_T nexuses a PREEMPT AND ABORT named.
    fn abort_preempted(&self, target: &str, lun: u64);
    /// A LOGICAL UNIT RESET made through another node.
    fn reset_lun(&self, target: &str, lun: u64);
    /// `target`'s ALUA target port groups.
    fn port_groups(&self, target: &str) -> Result<Vec<PortGroup>, String>;
    fn set_port_groups(&self, target: &str, groups: Vec<PortGroup>) -> Result<(), String>;
}

/// This process as a node of a cluster.
pub struct ClusterNode {
    cfg: ClusterConfig,
    /// The cluster object of this node's group.
    oid: String,
    pool: Arc<SharedPool>,
    address: String,
    control: OnceLock<Arc<dyn Host>>,
    targets: Mutex<BTreeMap<String, Arc<TargetAgent>>>,
    health: Mutex<Health>,
    /// Addresses this node has blocklisted itself (not blocklisted again).
    blocklisted: Mutex<HashSet<String>>,
    /// Leases, the write gate's inputs.
    live: Mutex<Liveness>,
    /// This node's lease, as the data path reads it (also handed to its RBD images).
    lease: Arc<Lease>,
    /// The write gate, as the data path reads it: open until then.
    gate: Lease,
    /// Bumped whenever the gate or the lease may have opened.
    gate_changed: tokio::sync::watch::Sender<u64>,
    /// The commands that may change a shared medium running now: id → when they started.
    writes: Mutex<BTreeMap<u64, Instant>>,
    next_write: AtomicU64,
    stats: GateStats,
    last_fence: Mutex<Option<LastFence>>,
    /// The watch of the cluster object (`None`: broken, watched again at the next tick).
    cluster_watch: Mutex<Option<Watcher>>,
    /// The cluster object's watch broke: the heartbeat watches it again. (Set by librados'
    /// error callback, which must not drop the watch itself: unwatching waits for the
    /// callbacks to finish, the one running among them.)
    cluster_watch_broken: AtomicBool,
    /// Pings waiting for their answers.
    pings: AtomicUsize,
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("node", &self.cfg.node)
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

use crate::lock;

/// The shared object of target `name`.
pub fn object_name(target: &str) -> String {
    format!("ironsan.target.{target}")
}

fn parse<T: for<'de> Deserialize<'de> + Default>(data: Option<&[u8]>) -> Result<T, String> {
    match data {
        None | Some([]) => Ok(T::default()),
        Some(d) => serde_json::from_slice(d).map_err(|e| format!("unreadable shared object: {e}")),
    }
}

fn parse_object(data: Option<&[u8]>) -> Result<TargetObject, String> {
    parse(data)
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

fn epoch_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The token a running command holds ([`ClusterNode::begin_write`]).
struct Running {
    node: Arc<ClusterNode>,
    id: u64,
}

impl Drop for Running {
    fn drop(&mut self) {
        lock(&self.node.writes).remove(&self.id);
    }
}

/// Why this node's writes are refused now.
const SUSPENDED: SenseReason = SenseReason::NotAccessible(AccessState::Unavailable);

impl ClusterNode {
    /// Connect to the cluster (blocking). Nothing is registered until [`ClusterNode::join`].
    pub fn connect(cfg: ClusterConfig) -> Result<Arc<ClusterNode>, String> {
        check_lease(cfg.heartbeat, cfg.lease).map_err(|e| format!("[cluster]: {e}"))?;
        let conf = cfg.conf.as_ref().map(|p| p.to_string_lossy().into_owned());
        let pool = SharedPool::connect(conf.as_deref(), &cfg.id, &cfg.pool)
            .map_err(|e| format!("[cluster]: {e}"))?;
        let address = pool.address().map_err(|e| format!("[cluster]: {e}"))?;
        let live = Liveness::new(cfg.node, cfg.lease, Instant::now());
        Ok(Arc::new(ClusterNode {
            oid: cluster_object(&cfg.group),
            cfg,
            pool: Arc::new(pool),
            address,
            control: OnceLock::new(),
            targets: Mutex::new(BTreeMap::new()),
            health: Mutex::new(Health::Serving),
            blocklisted: Mutex::new(HashSet::new()),
            live: Mutex::new(live),
            lease: Arc::new(Lease::new()),
            gate: Lease::new(),
            gate_changed: tokio::sync::watch::channel(0).0,
            writes: Mutex::new(BTreeMap::new()),
            next_write: AtomicU64::new(0),
            stats: GateStats::default(),
            last_fence: Mutex::new(None),
            cluster_watch: Mutex::new(None),
            cluster_watch_broken: AtomicBool::new(false),
            pings: AtomicUsize::new(0),
        }))
    }

    /// The targets this node serves in the cluster, now.
    fn agents(&self) -> Vec<Arc<TargetAgent>> {
        lock(&self.targets).values().cloned().collect()
    }

    /// The RADOS client shared RBD LUNs of this node use.
    pub fn client(&self) -> RadosClient {
        self.pool.client()
    }

    /// This node's lease, for its shared RBD LUNs ([`ironsan_backend::RbdOptions::lease`]).
    pub fn lease(&self) -> Arc<Lease> {
        Arc::clone(&self.lease)
    }

    /// The heartbeat: also the silence after which a connection must prove its initiator
    /// live before a write to a shared LUN runs (`conn::Probing`).
    pub fn heartbeat(&self) -> std::time::Duration {
        self.cfg.heartbeat
    }

    /// This node's number.
    pub fn node(&self) -> u16 {
        self.cfg.node
    }

    /// The store of `target`'s LUN `lun` persistent reservations (for `LuConfig::cluster`).
    pub fn lun_store(self: &Arc<Self>, target: &str, lun: u64) -> ClusterLuHandle {
        ClusterLuHandle(Arc::new(LunStore {
            node: Arc::clone(self),
            target: target.to_string(),
            lun,
        }))
    }

    /// Register this node in the cluster object (fencing a previous instance of it first)
    /// and for every target `control` serves, catch up on the shared state (reservations,
    /// the other nodes), start the heartbeat and wait (a few seconds at most) for this
    /// node's first lease. Blocking; call it before the server accepts connections.
    pub fn join(self: &Arc<Self>, control: Arc<dyn Host>) -> Result<(), String> {
        let _ = self.control.set(Arc::clone(&control));
        self.register()?;
        self.watch_cluster()
            .map_err(|e| format!("[cluster] {}: {e}", self.oid))?;
        self.read_cluster()
            .map_err(|e| format!("[cluster] {}: {e}", self.oid))?;
        for target in control.target_names() {
            self.join_target(control.as_ref(), &target)?;
        }
        let me = Arc::downgrade(self);
        let every = self.cfg.heartbeat;
        std::thread::Builder::new()
            .name("ironsan-ping".into())
            .spawn(move || loop {
                let Some(node) = me.upgrade() else { return };
                if matches!(*lock(&node.health), Health::Fenced(_)) {
                    return;
                }
                node.start_ping();
                drop(node);
                std::thread::sleep(every);
            })
            .map_err(|e| format!("starting the cluster pings: {e}"))?;
        let me = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("ironsan-cluster".into())
            .spawn(move || loop {
                let Some(node) = me.upgrade() else { return };
                let wait = node.until_next_tick();
                drop(node);
                std::thread::sleep(wait);
                let Some(node) = me.upgrade() else { return };
                node.tick();
            })
            .map_err(|e| format!("starting the cluster heartbeat: {e}"))?;
        let t0 = Instant::now();
        while !self.lease.valid() && t0.elapsed() < self.cfg.lease {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.publish_all_groups();
        if !self.lease.valid() {
            tracing::warn!(
                "cluster: no lease yet {} ms after joining: writes to shared LUNs are refused until there is one",
                self.cfg.lease.as_millis()
            );
        }
        Ok(())
    }

    /// Put this node in the cluster object; a previous instance of it (another address) is
    /// listed as fenced in the same write, and blocklisted right after.
    fn register(&self) -> Result<(), String> {
        let me = self.cfg.node;
        let entry = self.member();
        // A live node with this number (a second node given the same number, or this one
        // started twice) answers a ping: refused, rather than fencing it.
        let cur = self
            .pool
            .read(&self.oid)
            .map_err(|e| format!("[cluster] {}: {e}", self.oid))?;
        let obj: ClusterObject = parse(cur.as_ref().map(|v| v.data.as_slice()))
            .map_err(|e| format!("[cluster] {}: {e}", self.oid))?;
        if let Some(old) = obj.members.get(&me).filter(|o| o.address != entry.address) {
            let msg = encode(&Message::Ping { from: me });
            let alive = self
                .pool
                .notify(&self.oid, &msg, PING_TIMEOUT)
                .map(|r| {
                    r.acks
                        .iter()
                        .filter_map(|(_, _, p)| serde_json::from_slice::<Ack>(p).ok())
                        .any(|a| a.node == me)
                })
                .unwrap_or(false);
            if alive {
                return Err(format!(
                    "[cluster] node {me} is running already (client {}): give this node another number, or stop that one first",
                    old.address
                ));
            }
        }
        let mut previous = None;
        let mut unreadable = None;
        let written = self
            .pool
            .update(&self.oid, 50, |cur| {
                let mut obj: ClusterObject = match parse(cur) {
                    Ok(o) => o,
                    Err(e) => {
                        unreadable = Some(e);
                        return None;
                    }
                };
                previous = obj
                    .members
                    .get(&me)
                    .filter(|o| o.address != entry.address)
                    .map(|o| o.address.clone());
                if let Some(old) = &previous {
                    obj.fenced.insert(
                        old.clone(),
                        FenceRecord {
                            node: me,
                            by: me,
                            at: epoch_secs(),
                        },
                    );
                }
                prune_fenced(&mut obj);
                obj.members.insert(me, entry.clone());
                Some(encode(&obj))
            })
            .map_err(|e| format!("[cluster] {}: {e}", self.oid))?;
        if let Some(e) = unreadable {
            return Err(format!("[cluster] {}: {e}", self.oid));
        }
        if written.is_none() {
            return Err(format!("[cluster] {}: not registered", self.oid));
        }
        if let Some(old) = previous {
            tracing::warn!(
                node = me,
                old = %old,
                "fencing this node's previous instance before rejoining"
            );
            self.blocklist(&old)
                .map_err(|e| format!("[cluster] fencing {old}: {e}"))?;
        }
        Ok(())
    }

    /// This node as the shared objects list it.
    fn member(&self) -> Member {
        Member {
            name: self.cfg.name.clone(),
            address: self.address.clone(),
            instance: self.pool.instance_id(),
            joined: epoch_secs(),
        }
    }

    fn my_entry(&self, control: &dyn Host, target: &str) -> NodeEntry {
        let portals = control.target_portals(target);
        let mut ports: Vec<u16> = portals.iter().map(|(tag, _)| *tag).collect();
        ports.sort_unstable();
        ports.dedup();
        NodeEntry {
            member: self.member(),
            ports,
            portals: portals.iter().map(|(_, a)| a.to_string()).collect(),
        }
    }

    fn join_target(self: &Arc<Self>, control: &dyn Host, target: &str) -> Result<(), String> {
        let me = self.cfg.node;
        let oid = object_name(target);
        let entry = self.my_entry(control, target);
        let fail = |e: SharedError| format!("[cluster] target {target}: {e}");
        let mut refused = None;
        let written = self
            .pool
            .update(&oid, 50, |cur| {
                let mut obj = match parse_object(cur) {
                    Ok(o) => o,
                    Err(e) => {
                        refused = Some(e);
                        return None;
                    }
                };
                for (n, other) in obj.nodes.iter().filter(|(n, _)| **n != me) {
                    if let Some(p) = entry.ports.iter().find(|p| other.ports.contains(p)) {
                        refused = Some(format!(
                            "portal group tag {p} is node {n}'s ({}): give every node its own portal group tags",
                            other.member.name
                        ));
                        return None;
                    }
                }
                obj.nodes.insert(me, entry.clone());
                Some(encode(&obj))
            })
            .map_err(fail)?;
        if written.is_none() {
            let why = refused.unwrap_or_else(|| "not registered".into());
            return Err(format!("[cluster] target {target}: {why}"));
        }
        let agent = Arc::new(TargetAgent {
            name: target.to_string(),
            oid,
            watch: Mutex::new(None),
            view: Mutex::new(BTreeMap::new()),
        });
        lock(&self.targets).insert(target.to_string(), Arc::clone(&agent));
        self.watch(&agent).map_err(fail)?;
        self.catch_up(&agent, true).map_err(fail)?;
        self.publish_groups(&agent);
        tracing::info!(
            target,
            node = me,
            address = %self.address,
            "joined the cluster (pool {})",
            self.cfg.pool
        );
        Ok(())
    }

    /// Watch the cluster object (replacing a broken watch).
    fn watch_cluster(self: &Arc<Self>) -> Result<(), SharedError> {
        self.cluster_watch_broken.store(false, Ordering::Release);
        let old = lock(&self.cluster_watch).take();
        drop(old);
        let (n1, n2) = (Arc::downgrade(self), Arc::downgrade(self));
        let w = self.pool.watch(
            &self.oid,
            move |n| {
                if let Some(node) = n1.upgrade() {
                    node.on_cluster_notify(n);
                }
            },
            move |err| {
                if let Some(node) = n2.upgrade() {
                    tracing::warn!(
                        "cluster: the watch of {} broke ({}); watching it again",
                        node.oid,
                        std::io::Error::from_raw_os_error(-err)
                    );
                    node.cluster_watch_broken.store(true, Ordering::Release);
                }
            },
        )?;
        *lock(&self.cluster_watch) = Some(w);
        Ok(())
    }

    /// Read the cluster object: who the members are and who is fenced. This node's own
    /// address among the fenced makes it fenced for good.
    fn read_cluster(&self) -> Result<(), SharedError> {
        let t = Instant::now();
        let cur = self.pool.read(&self.oid)?;
        let obj: ClusterObject = parse(cur.as_ref().map(|v| v.data.as_slice()))?;
        // A fenced member is taken for fenced here only once this node has blocklisted it
        // itself (whoever listed it may have stopped before it could).
        let fenced: BTreeSet<String> = obj
            .fenced
            .keys()
            .filter(|a| {
                **a == self.address
                    || !obj.members.values().any(|m| m.address == **a)
                    || self.blocklist(a).is_ok()
            })
            .cloned()
            .collect();
        let ok = lock(&self.live).members(
            t,
            Instant::now(),
            &self.address,
            obj.members
                .iter()
                .map(|(n, m)| (*n, m.address.as_str(), m.name.as_str())),
            &fenced,
        );
        if !ok {
            let by = obj.fenced.get(&self.address).map_or(0, |f| f.by);
            self.fenced_now(format!(
                "node {by} fenced this node (its lease had run out)"
            ));
        }
        self.publish_gate();
        Ok(())
    }

    /// Send one ping on the cluster object from a thread of its own (at most as many at once
    /// as overlap within [`PING_TIMEOUT`]).
    fn start_ping(self: &Arc<Self>) {
        let most = (PING_TIMEOUT.as_millis() / self.cfg.heartbeat.as_millis().max(1)) as usize + 2;
        if self.pings.fetch_add(1, Ordering::AcqRel) >= most {
            self.pings.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        let node = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("ironsan-ping1".into())
            .spawn(move || {
                let s = Instant::now();
                let msg = encode(&Message::Ping {
                    from: node.cfg.node,
                });
                let r = node.pool.notify(&node.oid, &msg, PING_TIMEOUT);
                node.pinged(s, r);
                node.pings.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            self.pings.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The answers to a ping sent at `s`.
    fn pinged(&self, s: Instant, r: Result<NotifyReply, SharedError>) {
        let reply = match r {
            Ok(r) => r,
            Err(e) => {
                if e.fenced() {
                    self.fenced_now(e.to_string());
                } else {
                    tracing::debug!("cluster: ping: {e}");
                }
                return;
            }
        };
        let acks: Vec<Ack> = reply
            .acks
            .iter()
            .filter_map(|(_, _, payload)| serde_json::from_slice::<Ack>(payload).ok())
            .collect();
        let nodes: BTreeSet<u16> = acks.iter().map(|a| a.node).collect();
        let now = Instant::now();
        let changed = {
            let mut l = lock(&self.live);
            let states = |l: &Liveness| -> Vec<Option<PeerState>> {
                let mut v: Vec<_> = l
                    .peer_numbers()
                    .into_iter()
                    .map(|n| l.state(n, now))
                    .collect();
                v.push(Some(if l.self_valid(now) {
                    PeerState::Alive
                } else {
                    PeerState::Pending
                }));
                v
            };
            let before = states(&l);
            l.pinged(s, now, &nodes);
            before != states(&l)
        };
        for a in acks {
            for agent in self.agents() {
                if let Some(v) = lock(&agent.view).get_mut(&a.node) {
                    if let Some(applied) = a.targets.get(&agent.name) {
                        v.applied = applied.clone();
                    }
                }
            }
        }
        self.publish_gate();
        // A node (or this one) that just became alive is active in the port groups now,
        // not at the next heartbeat.
        if changed {
            self.publish_all_groups();
        }
    }

    /// A ping on the cluster object (a librados thread): answered while this node is not
    /// fenced and holds no write older than the lease.
    fn on_cluster_notify(&self, n: Notification) {
        if matches!(*lock(&self.health), Health::Fenced(_)) {
            return;
        }
        if let Some(age) = self.oldest_write().filter(|a| *a >= self.cfg.lease) {
            tracing::warn!(
                "cluster: a write has been held here for {} ms (the lease is {} ms): not answering the others' pings, so that they fence this node",
                age.as_millis(),
                self.cfg.lease.as_millis()
            );
            return;
        }
        let targets = self
            .agents()
            .iter()
            .map(|a| (a.name.clone(), self.applied(&a.name)))
            .collect();
        let ack = Ack {
            node: self.cfg.node,
            applied: BTreeMap::new(),
            targets,
        };
        if let Err(e) = self.pool.ack(&self.oid, &n, &encode(&ack)) {
            tracing::debug!("cluster: answering a ping: {e}");
        }
    }

    /// How long the oldest write of this node has been held: a command that may change a
    /// shared medium still running, or a range a cluster LU's device still holds.
    fn oldest_write(&self) -> Option<Duration> {
        let mut oldest = lock(&self.writes).values().next().copied();
        if let Some(control) = self.control.get() {
            for t in control.target_names() {
                for (_, lu) in control.logical_units(&t) {
                    if let Some(w) = lu.oldest_write() {
                        oldest = Some(oldest.map_or(w, |o| o.min(w)));
                    }
                }
            }
        }
        oldest.map(|t| t.elapsed())
    }

    /// Hand the lease and the write gate to the data path; wake the commands waiting for it.
    fn publish_gate(&self) {
        let (until, gate) = {
            let l = lock(&self.live);
            (l.self_until(), l.gate())
        };
        if matches!(*lock(&self.health), Health::Fenced(_)) {
            self.lease.lapse();
            self.gate.lapse();
        } else {
            self.lease.set(until);
            match gate {
                Gate::Open(Some(t)) => self.gate.set(Some(t)),
                Gate::Open(None) => self.gate.set_forever(),
                Gate::Closed => self.gate.lapse(),
            }
        }
        self.gate_changed.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// Whether a command that changes a shared medium may start now (see
    /// [`ClusterLu::begin_write`]).
    fn begin_write(self: &Arc<Self>) -> WriteAdmission {
        if !self.lease.valid() {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return WriteAdmission::Refused(SUSPENDED);
        }
        if self.gate.valid() {
            return WriteAdmission::Go(self.running());
        }
        let node = Arc::clone(self);
        WriteAdmission::Wait(Box::pin(async move {
            let t0 = Instant::now();
            let limit = gate_wait(&node.cfg);
            let mut changed = node.gate_changed.subscribe();
            node.stats.waiting.fetch_add(1, Ordering::Relaxed);
            let out = loop {
                if !node.lease.valid() {
                    break Err(SUSPENDED);
                }
                if node.gate.valid() {
                    break Ok(());
                }
                let left = limit.saturating_sub(t0.elapsed());
                if left.is_zero() {
                    break Err(SUSPENDED);
                }
                // Woken when the gate may have opened; looked at again every 100 ms anyway.
                let _ =
                    tokio::time::timeout(left.min(Duration::from_millis(100)), changed.changed())
                        .await;
            };
            node.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            node.stats.waited.fetch_add(1, Ordering::Relaxed);
            let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            node.stats.waited_ns.fetch_add(ns, Ordering::Relaxed);
            match out {
                Ok(()) => Ok(node.running()),
                Err(r) => {
                    node.stats.refused.fetch_add(1, Ordering::Relaxed);
                    Err(r)
                }
            }
        }))
    }

    /// A token for a command that may change a shared medium, registered until it drops.
    fn running(self: &Arc<Self>) -> WriteToken {
        let id = self.next_write.fetch_add(1, Ordering::Relaxed);
        lock(&self.writes).insert(id, Instant::now());
        WriteToken(Box::new(Running {
            node: Arc::clone(self),
            id,
        }))
    }

    /// Watch `agent`'s object (replacing a broken watch).
    fn watch(self: &Arc<Self>, agent: &Arc<TargetAgent>) -> Result<(), SharedError> {
        drop(lock(&agent.watch).take());
        let (n1, n2) = (Arc::downgrade(self), Arc::downgrade(self));
        let (a1, a2) = (Arc::downgrade(agent), Arc::downgrade(agent));
        let w = self.pool.watch(
            &agent.oid,
            move |n| {
                if let (Some(node), Some(agent)) = (n1.upgrade(), a1.upgrade()) {
                    node.on_notify(&agent, n);
                }
            },
            move |err| {
                if let (Some(node), Some(agent)) = (n2.upgrade(), a2.upgrade()) {
                    node.lost(format!(
                        "the watch of {} broke ({})",
                        agent.oid,
                        std::io::Error::from_raw_os_error(-err)
                    ));
                }
            },
        )?;
        *lock(&agent.watch) = Some(w);
        Ok(())
    }

    /// Read the object: the registrations and, with `records` (joining, or back in touch
    /// after a broken watch), every LU's record, applied without events (old news to the
    /// nexuses this node has). While the watch stands, records arrive only by notify: a
    /// heartbeat that read a record before its notify was handled would apply it without the
    /// unit attentions and aborts the notify carries.
    fn catch_up(&self, agent: &TargetAgent, records: bool) -> Result<(), SharedError> {
        let cur = self.pool.read(&agent.oid)?;
        let obj = parse_object(cur.as_ref().map(|v| v.data.as_slice()))?;
        if let Some(control) = self.control.get().filter(|_| records) {
            for (lun, record) in &obj.luns {
                if let Some(lu) = control.logical_unit(&agent.name, *lun) {
                    if lu.config().cluster.is_some() {
                        if let Err(e) = lu.apply_shared_pr(record, false) {
                            tracing::error!(target = %agent.name, lun, "{e}");
                        }
                    }
                }
            }
        }
        let mut view = lock(&agent.view);
        view.retain(|n, _| obj.nodes.contains_key(n));
        for (n, entry) in obj.nodes {
            match view.get_mut(&n) {
                Some(v) => v.entry = entry,
                None => {
                    view.insert(
                        n,
                        NodeView {
                            entry,
                            applied: BTreeMap::new(),
                        },
                    );
                }
            }
        }
        Ok(())
    }

    /// The record serial this node applied per shared LUN of `target`.
    fn applied(&self, target: &str) -> BTreeMap<u64, u64> {
        let Some(control) = self.control.get() else {
            return BTreeMap::new();
        };
        control
            .logical_units(target)
            .into_iter()
            .filter(|(_, lu)| lu.config().cluster.is_some())
            .map(|(lun, lu)| (lun, lu.shared_pr_serial()))
            .collect()
    }

    /// A notification on a target's object (a librados thread): apply, then acknowledge.
    fn on_notify(self: &Arc<Self>, agent: &TargetAgent, n: Notification) {
        // An LU whose tasks this notification aborted: acknowledged only once their writes
        // have left the device, so that the notifier's initiator cannot write through
        // another node and see an aborted write land after it.
        let mut aborted = None;
        match serde_json::from_slice::<Message>(&n.data) {
            Ok(Message::Pr { lun, record }) => {
                if let Some(control) = self.control.get() {
                    if let Some(lu) = control.logical_unit(&agent.name, lun) {
                        match lu.apply_shared_pr(&record, true) {
                            Ok(true) => {
                                control.abort_preempted(&agent.name, lun);
                                aborted = Some(lu);
                            }
                            Ok(false) => {}
                            Err(e) => {
                                // Not acknowledged: the notifier fences this node rather
                                // than trust a state it could not apply.
                                tracing::error!(target = %agent.name, lun, "{e}");
                                return;
                            }
                        }
                    }
                }
            }
            Ok(Message::Reset { from, lun }) if from != self.cfg.node => {
                if let Some(control) = self.control.get() {
                    control.reset_lun(&agent.name, lun);
                    aborted = control.logical_unit(&agent.name, lun);
                }
            }
            Ok(Message::Ping { .. } | Message::Reset { .. }) => {}
            Err(e) => tracing::debug!(target = %agent.name, "unknown notification: {e}"),
        }
        // A node that may have missed changes does not acknowledge: better fenced than
        // enforcing a stale state.
        if !self.in_touch() {
            return;
        }
        let Some(lu) = aborted.filter(|lu| lu.config().cluster.is_some()) else {
            self.ack_target(agent, &n);
            return;
        };
        // Not on librados' callback thread: the writes being waited for complete there.
        let (node, name, oid) = (Arc::clone(self), agent.name.clone(), agent.oid.clone());
        let limit = self.cfg.notify_timeout;
        let spawned = std::thread::Builder::new()
            .name("ironsan-settle".into())
            .spawn(move || {
                if !block_on_for(lu.aborts_settled(), limit) {
                    tracing::warn!(target = %name, "aborted writes still in the device after {limit:?}: not acknowledging (the notifier fences this node)");
                    return;
                }
                let ack = Ack {
                    node: node.cfg.node,
                    applied: node.applied(&name),
                    targets: BTreeMap::new(),
                };
                if let Err(e) = node.pool.ack(&oid, &n, &encode(&ack)) {
                    tracing::warn!(target = %name, "{e}");
                }
            });
        if let Err(e) = spawned {
            tracing::error!(target = %agent.name, "cluster: waiting for aborted writes: {e}");
        }
    }

    /// Acknowledge `n` on `agent`'s object with what this node applied.
    fn ack_target(&self, agent: &TargetAgent, n: &Notification) {
        let ack = Ack {
            node: self.cfg.node,
            applied: self.applied(&agent.name),
            targets: BTreeMap::new(),
        };
        if let Err(e) = self.pool.ack(&agent.oid, n, &encode(&ack)) {
            tracing::warn!(target = %agent.name, "{e}");
        }
    }

    /// This node may have missed changes: its groups become unavailable until it has watched
    /// and read the objects again.
    fn lost(&self, why: String) {
        {
            let mut h = lock(&self.health);
            if matches!(*h, Health::Fenced(_)) {
                return;
            }
            if *h == Health::Serving {
                tracing::error!(
                    "cluster: {why}: this node stops serving (its target port groups are unavailable) until it is back in touch"
                );
            }
            *h = Health::Partitioned(why);
        }
        self.publish_all_groups();
    }

    fn fenced_now(&self, why: String) {
        {
            let mut h = lock(&self.health);
            if matches!(*h, Health::Fenced(_)) {
                return;
            }
            tracing::error!(
                "cluster: {why}: the cluster fenced this node; it serves nothing more (restart it to rejoin)"
            );
            *h = Health::Fenced(why);
        }
        lock(&self.live).lapse();
        self.publish_gate();
        self.publish_all_groups();
    }

    fn failed(&self, e: &SharedError) {
        if e.fenced() {
            self.fenced_now(e.to_string());
        } else {
            self.lost(e.to_string());
        }
    }

    /// How long the heartbeat thread sleeps: a heartbeat, or less when a peer's lease runs
    /// out sooner (it is then fenced at once).
    fn until_next_tick(&self) -> Duration {
        let next = lock(&self.live).next_deadline();
        let hb = self.cfg.heartbeat;
        match next {
            Some(t) => t
                .saturating_duration_since(Instant::now())
                .clamp(Duration::from_millis(5), hb),
            None => hb,
        }
    }

    /// One heartbeat: the cluster object (members, fenced addresses), fencing whoever is
    /// suspect, back in touch if a watch broke, the registrations, the port groups.
    fn tick(self: &Arc<Self>) {
        if matches!(*lock(&self.health), Health::Fenced(_)) {
            return;
        }
        if self.cluster_watch_broken.load(Ordering::Acquire) || lock(&self.cluster_watch).is_none()
        {
            if let Err(e) = self.watch_cluster() {
                if e.fenced() {
                    self.fenced_now(e.to_string());
                    return;
                }
                tracing::debug!("cluster: watching {}: {e}", self.oid);
            }
        }
        if let Err(e) = self.read_cluster() {
            if e.fenced() {
                self.fenced_now(e.to_string());
                return;
            }
            tracing::debug!("cluster: reading {}: {e}", self.oid);
        }
        let suspects = lock(&self.live).to_fence(Instant::now());
        for (n, address) in suspects {
            if let Err(e) = self.fence_node(n, &address, "its lease ran out") {
                tracing::warn!(node = n, "cluster: fencing node {n}: {e}");
            }
        }
        if matches!(*lock(&self.health), Health::Fenced(_)) {
            return;
        }
        let agents = self.agents();
        let partitioned = matches!(*lock(&self.health), Health::Partitioned(_));
        if partitioned {
            let back = agents
                .iter()
                .try_for_each(|a| self.watch(a).and_then(|()| self.catch_up(a, true)));
            match back {
                Ok(()) => {
                    tracing::warn!(
                        "cluster: back in touch (watching and caught up): serving again"
                    );
                    *lock(&self.health) = Health::Serving;
                }
                Err(e) => {
                    self.failed(&e);
                    return;
                }
            }
        }
        for a in &agents {
            let broken = lock(&a.watch).as_ref().map(|w| w.check());
            match broken {
                Some(Err(e)) => {
                    self.failed(&e);
                    return;
                }
                None => {
                    self.lost(format!("no watch on {}", a.oid));
                    return;
                }
                Some(Ok(_)) => {}
            }
            if let Err(e) = self.catch_up(a, false) {
                self.failed(&e);
                return;
            }
            self.publish_groups(a);
        }
    }

    /// Fence node `n` at `address`: listed as fenced in the cluster object (refused if this
    /// node is listed itself, which makes it fenced), then blocklisted.
    fn fence_node(&self, n: u16, address: &str, why: &str) -> Result<(), String> {
        let me = self.cfg.node;
        let lapsed_at = Instant::now();
        let mut me_fenced = None;
        let mut unreadable = None;
        self.pool
            .update(&self.oid, 50, |cur| {
                let mut obj: ClusterObject = match parse(cur) {
                    Ok(o) => o,
                    Err(e) => {
                        unreadable = Some(e);
                        return None;
                    }
                };
                if let Some(f) = obj.fenced.get(&self.address) {
                    me_fenced = Some(f.by);
                    return None;
                }
                if obj.fenced.contains_key(address) {
                    return None;
                }
                obj.fenced.insert(
                    address.to_string(),
                    FenceRecord {
                        node: n,
                        by: me,
                        at: epoch_secs(),
                    },
                );
                prune_fenced(&mut obj);
                Some(encode(&obj))
            })
            .map_err(|e| {
                if e.fenced() {
                    self.fenced_now(e.to_string());
                }
                e.to_string()
            })?;
        if let Some(by) = me_fenced {
            self.fenced_now(format!("node {by} fenced this node first"));
            return Err("this node is fenced itself".into());
        }
        // Never a blocklist that the fenced list does not record: the list is what keeps
        // two nodes from fencing each other.
        if let Some(e) = unreadable {
            return Err(format!("{}: {e}", self.oid));
        }
        tracing::warn!(node = n, address, "cluster: fencing node {n} ({why})");
        self.blocklist(address).map_err(|e| e.to_string())?;
        lock(&self.live).fenced(n, address);
        self.stats.fences.fetch_add(1, Ordering::Relaxed);
        *lock(&self.last_fence) = Some(LastFence {
            node: n,
            after_lapse: lapsed_at.elapsed(),
            at: Instant::now(),
        });
        self.publish_gate();
        self.publish_all_groups();
        Ok(())
    }

    /// Blocklist `address` (once).
    fn blocklist(&self, address: &str) -> Result<(), SharedError> {
        if lock(&self.blocklisted).contains(address) {
            return Ok(());
        }
        self.pool.blocklist(address, FENCE_EXPIRE)?;
        lock(&self.blocklisted).insert(address.to_string());
        Ok(())
    }

    fn publish_all_groups(&self) {
        for a in self.agents() {
            self.publish_groups(&a);
        }
    }

    /// Whether node `n` is up as the port groups show it: this node while it serves and its
    /// lease holds, another while its lease holds.
    fn up(&self, n: u16) -> bool {
        if n == self.cfg.node {
            self.serving()
        } else {
            lock(&self.live).state(n, Instant::now()) == Some(PeerState::Alive)
        }
    }

    /// One target port group per node: active/optimized while it is up, else unavailable.
    fn publish_groups(&self, agent: &TargetAgent) {
        let Some(control) = self.control.get() else {
            return;
        };
        let entries: Vec<(u16, Vec<u16>)> = lock(&agent.view)
            .iter()
            .filter(|(_, v)| !v.entry.ports.is_empty())
            .map(|(n, v)| (*n, v.entry.ports.clone()))
            .collect();
        let groups: Vec<PortGroup> = entries
            .into_iter()
            .map(|(n, ports)| {
                let mut g = PortGroup::new(n, ports);
                g.state = if self.up(n) {
                    AccessState::ActiveOptimized
                } else {
                    AccessState::Unavailable
                };
                g
            })
            .collect();
        let Ok(now) = control.port_groups(&agent.name) else {
            return;
        };
        let same = now.len() == groups.len()
            && now
                .iter()
                .zip(&groups)
                .all(|(a, b)| a.id == b.id && a.ports == b.ports && a.state == b.state);
        if !same {
            let states: Vec<String> = groups
                .iter()
                .map(|g| format!("{}:{}", g.id, g.state))
                .collect();
            match control.set_port_groups(&agent.name, groups) {
                Ok(()) => {
                    tracing::info!(target = %agent.name, "cluster view: {}", states.join(" "))
                }
                Err(e) => tracing::error!(target = %agent.name, "cluster view: {e}"),
            }
        }
    }

    /// A PERSISTENT RESERVE OUT's change of `target`'s LUN `lun` record (see [`ClusterLu`]).
    fn change_record(
        &self,
        target: &str,
        lun: u64,
        mut change: PrChange,
    ) -> Result<Option<String>, String> {
        if let h @ (Health::Partitioned(_) | Health::Fenced(_)) = &*lock(&self.health) {
            return Err(format!("this node is {}", h.name()));
        }
        let agent = lock(&self.targets)
            .get(target)
            .cloned()
            .ok_or_else(|| format!("target {target} has not joined the cluster"))?;
        let oid = &agent.oid;
        // The record and the registrations as written by the attempt that succeeded.
        let mut written: Option<(String, TargetObject)> = None;
        let mut unreadable = None;
        let done = self
            .pool
            .update(oid, 50, |cur| {
                let mut obj = match parse_object(cur) {
                    Ok(o) => o,
                    Err(e) => {
                        unreadable = Some(e);
                        return None;
                    }
                };
                let record = change(obj.luns.get(&lun).map(String::as_str))?;
                obj.luns.insert(lun, record.clone());
                let data = encode(&obj);
                written = Some((record, obj));
                Some(data)
            })
            .map_err(|e| e.to_string())?;
        if let Some(e) = unreadable {
            return Err(e);
        }
        let (Some(_), Some((record, obj))) = (done, written) else {
            return Ok(None);
        };
        let serial = ironsan_scsi::pr_record_serial(&record).unwrap_or(u64::MAX);
        let msg = encode(&Message::Pr {
            lun,
            record: record.clone(),
        });
        let reply = self
            .pool
            .notify(oid, &msg, self.cfg.notify_timeout)
            .map_err(|e| e.to_string())?;
        let acked: BTreeSet<u16> = reply
            .acks
            .iter()
            .filter_map(|(_, _, p)| serde_json::from_slice::<Ack>(p).ok())
            .filter(|a| a.applied.get(&lun).is_some_and(|s| *s >= serial))
            .map(|a| a.node)
            .collect();
        for (n, entry) in obj.nodes.iter().filter(|(n, _)| **n != self.cfg.node) {
            if !acked.contains(n) {
                tracing::warn!(
                    target,
                    lun,
                    node = n,
                    address = %entry.member.address,
                    "node {n} did not confirm a reservation change: fencing it"
                );
                self.fence_node(
                    *n,
                    &entry.member.address,
                    "it did not confirm a reservation change",
                )?;
            }
        }
        Ok(Some(record))
    }

    /// Tell the other nodes of a LOGICAL UNIT RESET of `target`'s `lun` and wait for them
    /// (at most `notify_timeout`; a node that does not answer is not fenced for it).
    fn announce_reset(&self, target: &str, lun: u64) {
        let Some(agent) = lock(&self.targets).get(target).cloned() else {
            return;
        };
        let msg = encode(&Message::Reset {
            from: self.cfg.node,
            lun,
        });
        if let Err(e) = self.pool.notify(&agent.oid, &msg, self.cfg.notify_timeout) {
            tracing::warn!(target, lun, "telling the other nodes of a LUN reset: {e}");
        }
    }

    /// `ctl cluster forget N`: remove node `n` from the cluster object and from every
    /// target's object, for a node taken out of service for good (else it stays, fenced and
    /// unavailable). Refused for this node and for a node whose lease holds; a forgotten node
    /// that starts again registers anew.
    pub fn forget(&self, n: u16) -> Result<String, String> {
        if n == self.cfg.node {
            return Err(format!("node {n} is this node"));
        }
        if self.up(n) {
            return Err(format!(
                "node {n} answers the heartbeat: stop it first (or it would register again)"
            ));
        }
        let mut found = 0;
        let removed = self.pool.update(&self.oid, 50, |cur| {
            let mut obj: ClusterObject = parse(cur).ok()?;
            obj.members.remove(&n)?;
            Some(encode(&obj))
        });
        if matches!(removed, Ok(Some(_))) {
            found += 1;
        }
        for a in &self.agents() {
            let removed = self.pool.update(&a.oid, 50, |cur| {
                let mut obj = parse_object(cur).ok()?;
                obj.nodes.remove(&n)?;
                Some(encode(&obj))
            });
            let gone = matches!(removed, Ok(Some(_)));
            if gone && lock(&a.view).remove(&n).is_some() {
                found += 1;
            }
            self.publish_groups(a);
        }
        if found == 0 {
            return Err(format!("no node {n} is registered"));
        }
        let _ = self.read_cluster();
        tracing::warn!(node = n, "cluster: node {n} forgotten");
        Ok(format!("node {n} forgotten"))
    }

    /// `ctl cluster`: this node (its lease, the write gate, fencing), every node per target
    /// with its state, and per shared LUN the record serial and PRgeneration each node
    /// applied.
    pub fn status(&self) -> ClusterView {
        let health = lock(&self.health).clone();
        let reason = match &health {
            Health::Serving => None,
            Health::Partitioned(r) | Health::Fenced(r) => Some(r.clone()),
        };
        let now = Instant::now();
        let me = self.cfg.node;
        let my_state = match &health {
            Health::Serving if !self.lease.valid() => "suspended",
            h => h.name(),
        };
        let ms = |d: Duration| d.as_millis() as u64;
        let peers: Vec<PeerView> = {
            let l = lock(&self.live);
            l.peer_numbers()
                .into_iter()
                .filter_map(|n| {
                    let p = l.peer(n)?;
                    Some(PeerView {
                        node: n,
                        name: p.name.clone(),
                        address: p.address.clone(),
                        state: l.state(n, now).map(|s| s.name().to_string()),
                        lease_ms: l.peer_lease(n, now).map(ms),
                        last_ack_ms: p.last_ack.map(|t| ms(now.saturating_duration_since(t))),
                    })
                })
                .collect()
        };
        let peer_state = |n: u16| -> (String, Option<u64>, Option<u64>) {
            let l = lock(&self.live);
            (
                l.state(n, now)
                    .map_or("unknown", PeerState::name)
                    .to_string(),
                l.peer_lease(n, now).map(ms),
                l.peer(n)
                    .and_then(|p| p.last_ack)
                    .map(|t| ms(now.saturating_duration_since(t))),
            )
        };
        let mut targets = Vec::new();
        for a in self.agents() {
            let mine = self.applied(&a.name);
            let view: Vec<(u16, NodeView)> =
                lock(&a.view).iter().map(|(n, v)| (*n, v.clone())).collect();
            let nodes = view
                .into_iter()
                .map(|(n, v)| {
                    let is_self = n == me;
                    let (state, lease_ms, last_ack_ms) = if is_self {
                        (
                            my_state.to_string(),
                            self.lease.remaining().map(ms),
                            Some(0),
                        )
                    } else {
                        peer_state(n)
                    };
                    ClusterNodeView {
                        node: n,
                        name: v.entry.member.name,
                        is_self,
                        state,
                        lease_ms,
                        ports: v.entry.ports,
                        portals: v.entry.portals,
                        address: v.entry.member.address,
                        last_ack_ms,
                        applied: if is_self { mine.clone() } else { v.applied },
                    }
                })
                .collect();
            let luns = self
                .control
                .get()
                .map(|c| c.logical_units(&a.name))
                .unwrap_or_default()
                .into_iter()
                .filter(|(_, lu)| lu.config().cluster.is_some())
                .map(|(lun, lu)| SharedLunView {
                    lun,
                    serial: lu.shared_pr_serial(),
                    pr_generation: lu.pr_generation(),
                })
                .collect();
            targets.push(ClusterTargetView {
                target: a.name.clone(),
                object: a.oid.clone(),
                nodes,
                luns,
            });
        }
        let last_fence = lock(&self.last_fence).map(|f| LastFenceView {
            node: f.node,
            after_lapse_ms: ms(f.after_lapse),
            ago_ms: ms(now.saturating_duration_since(f.at)),
        });
        ClusterView {
            node: me,
            name: self.cfg.name.clone(),
            pool: self.cfg.pool.clone(),
            group: self.cfg.group.clone(),
            object: self.oid.clone(),
            address: self.address.clone(),
            health: my_state.to_string(),
            reason,
            heartbeat_ms: ms(self.cfg.heartbeat),
            lease: LeaseView {
                length_ms: ms(self.cfg.lease),
                remaining_ms: self.lease.remaining().map(ms),
            },
            gate: GateView {
                open: self.gate.valid(),
                waiting: self.stats.waiting.load(Ordering::Relaxed),
                waited: self.stats.waited.load(Ordering::Relaxed),
                waited_ms: self.stats.waited_ns.load(Ordering::Relaxed) / 1_000_000,
                refused: self.stats.refused.load(Ordering::Relaxed),
            },
            oldest_write_ms: self.oldest_write().map(ms),
            fences: self.stats.fences.load(Ordering::Relaxed),
            last_fence,
            peers,
            targets,
        }
    }

    /// Whether this node is in touch with the cluster: not partitioned, not fenced.
    fn in_touch(&self) -> bool {
        *lock(&self.health) == Health::Serving
    }

    /// Whether this node serves (in touch, and its lease holds), for the metrics and its
    /// own port groups.
    pub fn serving(&self) -> bool {
        self.in_touch() && self.lease.valid()
    }

    /// (target, node, up) for every node of every target, this one included, for the
    /// metrics.
    pub fn node_states(&self) -> Vec<(String, u16, bool)> {
        let mut out = Vec::new();
        for a in self.agents() {
            let nodes: Vec<u16> = lock(&a.view).keys().copied().collect();
            for n in nodes {
                out.push((a.name.clone(), n, self.up(n)));
            }
        }
        out
    }

    /// The metrics of leases and fencing: (this node's lease left in seconds, the peers'
    /// states by node, the gate's counters).
    pub fn lease_metrics(&self) -> LeaseMetrics {
        let now = Instant::now();
        let peers = {
            let l = lock(&self.live);
            l.peer_numbers()
                .into_iter()
                .filter_map(|n| {
                    let s = l.state(n, now)?;
                    Some((
                        n,
                        s.name(),
                        l.peer_lease(n, now).map_or(0.0, |d| d.as_secs_f64()),
                    ))
                })
                .collect()
        };
        LeaseMetrics {
            lease_seconds: self.lease.remaining().map_or(0.0, |d| d.as_secs_f64()),
            gate_open: self.gate.valid(),
            peers,
            waiting: self.stats.waiting.load(Ordering::Relaxed),
            waited: self.stats.waited.load(Ordering::Relaxed),
            waited_seconds: self.stats.waited_ns.load(Ordering::Relaxed) as f64 / 1e9,
            refused: self.stats.refused.load(Ordering::Relaxed),
            fences: self.stats.fences.load(Ordering::Relaxed),
        }
    }
}

/// What [`ClusterNode::lease_metrics`] reports.
#[derive(Debug, Clone)]
pub struct LeaseMetrics {
    pub lease_seconds: f64,
    pub gate_open: bool,
    /// (node, state name, lease left in seconds).
    pub peers: Vec<(u16, &'static str, f64)>,
    pub waiting: u64,
    pub waited: u64,
    pub waited_seconds: f64,
    pub refused: u64,
    pub fences: u64,
}

/// Run `f` to completion on this thread, for at most `limit`: whether it completed.
fn block_on_for(f: impl std::future::Future<Output = ()>, limit: Duration) -> bool {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    let t0 = Instant::now();
    loop {
        if f.as_mut().poll(&mut cx).is_ready() {
            return true;
        }
        let left = limit.saturating_sub(t0.elapsed());
        if left.is_zero() {
            return false;
        }
        std::thread::park_timeout(left.min(Duration::from_millis(10)));
    }
}

/// Forget fenced addresses older than the blocklist.
fn prune_fenced(obj: &mut ClusterObject) {
    let now = epoch_secs();
    obj.fenced
        .retain(|_, f| now.saturating_sub(f.at) < FENCE_EXPIRE.as_secs());
}

/// The persistent-reservation store of one shared LU.
struct LunStore {
    node: Arc<ClusterNode>,
    target: String,
    lun: u64,
}

impl std::fmt::Debug for LunStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LunStore")
            .field("node", &self.node.cfg.node)
            .field("target", &self.target)
            .field("lun", &self.lun)
            .finish()
    }
}

impl ClusterLu for LunStore {
    fn update_pr(&self, change: PrChange) -> ClusterFuture<'_, Result<Option<String>, String>> {
        let node = Arc::clone(&self.node);
        let (target, lun) = (self.target.clone(), self.lun);
        Box::pin(async move {
            tokio::task::spawn_blocking(move || node.change_record(&target, lun, change))
                .await
                .map_err(|e| format!("cluster update: {e}"))?
        })
    }

    fn reset(&self) -> ClusterFuture<'_, ()> {
        let node = Arc::clone(&self.node);
        let (target, lun) = (self.target.clone(), self.lun);
        Box::pin(async move {
            let _ = tokio::task::spawn_blocking(move || node.announce_reset(&target, lun)).await;
        })
    }

    fn begin_write(&self) -> WriteAdmission {
        self.node.begin_write()
    }
}
