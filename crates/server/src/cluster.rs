//! A node of a cluster of ironsan gateways that serve the same targets and the same RBD
//! images (`[cluster]` in the configuration; docs/ARCHITECTURE.md, "Several gateways on one
//! image"). Everything the nodes share goes through Ceph's own primitives, no consensus of
//! ours:
//!
//! * **One RADOS object per target** (`ironsan.target.<name>` in the cluster's pool) holds
//!   every node's registration (its number, name, relative target ports, portals, RADOS
//!   client address) and every shared LU's persistent-reservation record, replaced with
//!   compare-and-set on a version ([`SharedPool::update`]). Every node watches it.
//! * **Membership and ALUA.** Each node is one target port group (identifier = node
//!   number); its relative target ports are its portal group tags, unique in the cluster
//!   (a node whose tag another node has is refused at start). Every `heartbeat` each node
//!   re-reads the object and notifies a ping; the nodes that acknowledge are
//!   active/optimized in its REPORT TARGET PORT GROUPS, the others unavailable (never
//!   dropped).
//! * **Reservations.** A PERSISTENT RESERVE OUT works out the change on the object's record
//!   (`ironsan_scsi`), writes it with compare-and-set, and notifies it; every node applies it
//!   before it acknowledges. A registered node that does not acknowledge within
//!   `notify_timeout` is blocklisted before the command completes: once GOOD is returned,
//!   every node enforces the new state or can no longer reach the cluster.
//! * **Partition.** When this node's watch breaks (it may have missed changes), its own
//!   group becomes unavailable (commands get NOT READY, LOGICAL UNIT NOT ACCESSIBLE, TARGET
//!   PORT IN UNAVAILABLE STATE, so initiators use other paths) until it has watched and read
//!   the object again. A node the cluster blocklisted stays unavailable: it must be
//!   restarted (a new client) to serve again.
//!
//! A node serves its RBD images through the same RADOS client ([`ClusterNode::client`]), so
//! blocklisting its one address fences its writes to the images too.
//!
//! Every call here waits for the cluster: it runs on this module's heartbeat thread,
//! librados' callback threads or a blocking thread (`spawn_blocking`), never on a
//! connection's task.

use crate::admin::Control;
use ironsan_backend::rbd::shared::{Notification, SharedError, SharedPool, Watcher};
use ironsan_backend::RadosClient;
use ironsan_scsi::{AccessState, ClusterFuture, ClusterLu, ClusterLuHandle, PortGroup, PrChange};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How a node joins its cluster (`[cluster]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// This node's number, 1-65535: its ALUA target port group.
    pub node: u16,
    /// A name for people (`ctl cluster`, logs); default: the host name.
    pub name: String,
    /// The pool that holds the shared objects (one per target).
    pub pool: String,
    /// ceph.conf (`None`: librados' own search).
    pub conf: Option<PathBuf>,
    /// The cephx client, without `client.`.
    pub id: String,
    /// How often membership is checked (a ping to every node).
    pub heartbeat: Duration,
    /// How long a reservation change waits for the other nodes before fencing them.
    pub notify_timeout: Duration,
}

/// Default `heartbeat`.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(2);
/// Default `notify_timeout`.
pub const DEFAULT_NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);

/// The shared object of one target.
#[derive(Serialize, Deserialize, Default, Clone, Debug)]
struct TargetObject {
    #[serde(default)]
    nodes: BTreeMap<u16, NodeEntry>,
    /// LUN → persistent-reservation record (made and read by `ironsan_scsi`).
    #[serde(default)]
    luns: BTreeMap<u64, String>,
}

/// One node's registration.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
struct NodeEntry {
    name: String,
    /// Relative target ports (= portal group tags) through which it serves the target.
    ports: Vec<u16>,
    portals: Vec<String>,
    /// Its RADOS client's address: what fencing it blocklists.
    address: String,
    instance: u64,
    /// When it registered (seconds since the epoch).
    joined: u64,
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

/// What a node acknowledges with: who it is and the record serial it applied per LUN.
#[derive(Serialize, Deserialize, Default, Debug)]
struct Ack {
    node: u16,
    #[serde(default)]
    applied: BTreeMap<u64, u64>,
}

/// This node's standing with the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Health {
    Serving,
    /// The watch broke: changes may have been missed.
    Partitioned(String),
    /// The cluster blocklisted this node's client.
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
    /// Acknowledged the last ping.
    alive: bool,
    last_ack: Option<Instant>,
    applied: BTreeMap<u64, u64>,
}

/// One target this node serves as part of the cluster.
struct TargetAgent {
    name: String,
    oid: String,
    watch: Mutex<Option<Watcher>>,
    view: Mutex<BTreeMap<u16, NodeView>>,
}

/// This process as a node of a cluster.
pub struct ClusterNode {
    cfg: ClusterConfig,
    pool: Arc<SharedPool>,
    address: String,
    control: OnceLock<Control>,
    targets: Mutex<BTreeMap<String, Arc<TargetAgent>>>,
    health: Mutex<Health>,
    /// Addresses this node blocklisted (not blocklisted again).
    fenced: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("node", &self.cfg.node)
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The shared object of target `name`.
pub fn object_name(target: &str) -> String {
    format!("ironsan.target.{target}")
}

fn parse_object(data: Option<&[u8]>) -> Result<TargetObject, String> {
    match data {
        None | Some([]) => Ok(TargetObject::default()),
        Some(d) => serde_json::from_slice(d).map_err(|e| format!("unreadable shared object: {e}")),
    }
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

impl ClusterNode {
    /// Connect to the cluster (blocking). Nothing is registered until [`ClusterNode::join`].
    pub fn connect(cfg: ClusterConfig) -> Result<Arc<ClusterNode>, String> {
        let conf = cfg.conf.as_ref().map(|p| p.to_string_lossy().into_owned());
        let pool = SharedPool::connect(conf.as_deref(), &cfg.id, &cfg.pool)
            .map_err(|e| format!("[cluster]: {e}"))?;
        let address = pool.address().map_err(|e| format!("[cluster]: {e}"))?;
        Ok(Arc::new(ClusterNode {
            cfg,
            pool: Arc::new(pool),
            address,
            control: OnceLock::new(),
            targets: Mutex::new(BTreeMap::new()),
            health: Mutex::new(Health::Serving),
            fenced: Mutex::new(HashSet::new()),
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

    /// Register this node for every target `control` serves, catch up on the shared state
    /// (reservations, the other nodes) and start the heartbeat. Blocking; call it before the
    /// server accepts connections.
    pub fn join(self: &Arc<Self>, control: Control) -> Result<(), String> {
        let _ = self.control.set(control.clone());
        control.set_cluster(Arc::clone(self));
        for target in control.target_names() {
            self.join_target(&control, &target)?;
        }
        let me = Arc::downgrade(self);
        let every = self.cfg.heartbeat;
        std::thread::Builder::new()
            .name("ironsan-cluster".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                let Some(node) = me.upgrade() else { return };
                node.tick();
            })
            .map_err(|e| format!("starting the cluster heartbeat: {e}"))?;
        Ok(())
    }

    fn my_entry(&self, control: &Control, target: &str) -> NodeEntry {
        let tags = control.portal_groups(target).ok().flatten();
        let portals = control.portal_list();
        let serving = |tag: u16| tags.as_ref().is_none_or(|t| t.contains(&tag));
        let mut ports: Vec<u16> = portals
            .iter()
            .filter(|p| serving(p.tag))
            .map(|p| p.tag)
            .collect();
        ports.sort_unstable();
        ports.dedup();
        NodeEntry {
            name: self.cfg.name.clone(),
            ports,
            portals: portals
                .iter()
                .filter(|p| serving(p.tag))
                .map(|p| p.addr.to_string())
                .collect(),
            address: self.address.clone(),
            instance: self.pool.instance_id(),
            joined: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }

    fn join_target(self: &Arc<Self>, control: &Control, target: &str) -> Result<(), String> {
        let me = self.cfg.node;
        let oid = object_name(target);
        let entry = self.my_entry(control, target);
        let fail = |e: SharedError| format!("[cluster] target {target}: {e}");
        // A previous incarnation of this node (killed, or a stray copy) is fenced before this
        // one takes its place: the others would no longer fence it for changes it misses.
        let cur = self.pool.read(&oid).map_err(fail)?;
        let obj = parse_object(cur.as_ref().map(|v| v.data.as_slice()))?;
        if let Some(old) = obj.nodes.get(&me).filter(|o| o.address != self.address) {
            tracing::warn!(
                target,
                node = me,
                old = %old.address,
                "fencing this node's previous instance before rejoining"
            );
            self.fence(&old.address).map_err(fail)?;
        }
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
                            other.name
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
        self.ping(&agent);
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
                if let Some(lu) = control.scsi_lun(&agent.name, *lun) {
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
                Some(v) => {
                    if v.entry.address != entry.address {
                        v.alive = false;
                    }
                    v.entry = entry;
                }
                None => {
                    view.insert(
                        n,
                        NodeView {
                            entry,
                            alive: false,
                            last_ack: None,
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
            .lun_list(target)
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, lu, _)| lu.config().cluster.is_some())
            .map(|(lun, lu, _)| (lun, lu.shared_pr_serial()))
            .collect()
    }

    /// A notification on a target's object (a librados thread): apply, then acknowledge.
    fn on_notify(&self, agent: &TargetAgent, n: Notification) {
        match serde_json::from_slice::<Message>(&n.data) {
            Ok(Message::Pr { lun, record }) => {
                if let Some(control) = self.control.get() {
                    if let Some(lu) = control.scsi_lun(&agent.name, lun) {
                        match lu.apply_shared_pr(&record, true) {
                            Ok(true) => control.abort_preempted(&agent.name, lun),
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
                }
            }
            Ok(Message::Ping { .. } | Message::Reset { .. }) => {}
            Err(e) => tracing::debug!(target = %agent.name, "unknown notification: {e}"),
        }
        // A node that may have missed changes does not acknowledge: better fenced than
        // enforcing a stale state.
        if !self.serving() {
            return;
        }
        let ack = Ack {
            node: self.cfg.node,
            applied: self.applied(&agent.name),
        };
        if let Err(e) = self.pool.ack(&agent.oid, &n, &encode(&ack)) {
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
                "cluster: {why}: the cluster blocklisted this node; it serves nothing more (restart it to rejoin)"
            );
            *h = Health::Fenced(why);
        }
        self.publish_all_groups();
    }

    fn failed(&self, e: &SharedError) {
        if e.fenced() {
            self.fenced_now(e.to_string());
        } else {
            self.lost(e.to_string());
        }
    }

    /// One heartbeat: back in touch if the watch broke, the registrations, a ping.
    fn tick(self: &Arc<Self>) {
        let agents = self.agents();
        if matches!(*lock(&self.health), Health::Fenced(_)) {
            return;
        }
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
            self.ping(a);
            self.publish_groups(a);
        }
    }

    /// Ping every node of `agent`'s target: who answers is alive.
    fn ping(&self, agent: &TargetAgent) {
        let msg = encode(&Message::Ping {
            from: self.cfg.node,
        });
        let reply = match self.pool.notify(&agent.oid, &msg, self.cfg.heartbeat) {
            Ok(r) => r,
            Err(e) => {
                self.failed(&e);
                return;
            }
        };
        let acks: BTreeMap<u16, Ack> = reply
            .acks
            .iter()
            .filter_map(|(_, _, payload)| serde_json::from_slice::<Ack>(payload).ok())
            .map(|a| (a.node, a))
            .collect();
        let now = Instant::now();
        let mut view = lock(&agent.view);
        for (n, v) in view.iter_mut() {
            match acks.get(n) {
                Some(a) => {
                    v.alive = true;
                    v.last_ack = Some(now);
                    v.applied = a.applied.clone();
                }
                None => v.alive = false,
            }
        }
    }

    fn publish_all_groups(&self) {
        for a in self.agents() {
            self.publish_groups(&a);
        }
    }

    /// One target port group per node: active/optimized while it answers (this node: while
    /// it is in touch with the cluster), else unavailable.
    fn publish_groups(&self, agent: &TargetAgent) {
        let Some(control) = self.control.get() else {
            return;
        };
        let serving = self.serving();
        let groups: Vec<PortGroup> = lock(&agent.view)
            .iter()
            .filter(|(_, v)| !v.entry.ports.is_empty())
            .map(|(n, v)| {
                let up = if *n == self.cfg.node {
                    serving
                } else {
                    v.alive
                };
                let mut g = PortGroup::new(*n, v.entry.ports.clone());
                g.state = if up {
                    AccessState::ActiveOptimized
                } else {
                    AccessState::Unavailable
                };
                g
            })
            .collect();
        let Ok((_, now)) = control.port_groups(&agent.name) else {
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
            match control.set_port_groups(&agent.name, Some(groups)) {
                Ok(()) => {
                    tracing::info!(target = %agent.name, "cluster view: {}", states.join(" "))
                }
                Err(e) => tracing::error!(target = %agent.name, "cluster view: {e}"),
            }
        }
    }

    /// Blocklist `address` (once).
    fn fence(&self, address: &str) -> Result<(), SharedError> {
        if lock(&self.fenced).contains(address) {
            return Ok(());
        }
        self.pool.blocklist(address, Duration::ZERO)?;
        lock(&self.fenced).insert(address.to_string());
        Ok(())
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
                    address = %entry.address,
                    "node {n} did not confirm a reservation change: fencing it"
                );
                self.fence(&entry.address).map_err(|e| e.to_string())?;
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

    /// `ctl cluster forget N`: remove node `n`'s registration from every target's object, for
    /// a node taken out of service for good (else it stays, unavailable, and every
    /// reservation change fences its address). Refused for this node and for a node that
    /// answered the last heartbeat; a forgotten node that starts again registers anew.
    pub fn forget(&self, n: u16) -> Result<String, String> {
        if n == self.cfg.node {
            return Err(format!("node {n} is this node"));
        }
        let agents = self.agents();
        if agents
            .iter()
            .any(|a| lock(&a.view).get(&n).is_some_and(|v| v.alive))
        {
            return Err(format!(
                "node {n} answers the heartbeat: stop it first (or it would register again)"
            ));
        }
        let mut found = 0;
        for a in &agents {
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
        tracing::warn!(node = n, "cluster: node {n} forgotten ({found} target(s))");
        Ok(format!("node {n} forgotten ({found} target(s))"))
    }

    /// `ctl cluster`: this node, every node per target with its state, and per shared LUN the
    /// record serial and PRgeneration each node applied.
    pub fn status(&self) -> Value {
        let health = lock(&self.health).clone();
        let reason = match &health {
            Health::Serving => None,
            Health::Partitioned(r) | Health::Fenced(r) => Some(r.clone()),
        };
        let agents = self.agents();
        let mut targets = Vec::new();
        for a in agents {
            let mine = self.applied(&a.name);
            let nodes: Vec<Value> = lock(&a.view)
                .iter()
                .map(|(n, v)| {
                    let me = *n == self.cfg.node;
                    let state = if me {
                        health.name()
                    } else if v.alive {
                        "alive"
                    } else {
                        "unreachable"
                    };
                    json!({
                        "node": n,
                        "name": v.entry.name,
                        "self": me,
                        "state": state,
                        "ports": v.entry.ports,
                        "portals": v.entry.portals,
                        "address": v.entry.address,
                        "last_ack_ms": v.last_ack.map(|t| t.elapsed().as_millis() as u64),
                        "applied": if me { &mine } else { &v.applied },
                    })
                })
                .collect();
            let luns: Vec<Value> = self
                .control
                .get()
                .and_then(|c| c.lun_list(&a.name).ok())
                .unwrap_or_default()
                .into_iter()
                .filter(|(_, lu, _)| lu.config().cluster.is_some())
                .map(|(lun, lu, _)| {
                    json!({
                        "lun": lun,
                        "serial": lu.shared_pr_serial(),
                        "pr_generation": lu.pr_generation(),
                    })
                })
                .collect();
            targets.push(json!({
                "target": a.name,
                "object": a.oid,
                "nodes": nodes,
                "luns": luns,
            }));
        }
        json!({
            "node": self.cfg.node,
            "name": self.cfg.name,
            "pool": self.cfg.pool,
            "address": self.address,
            "health": health.name(),
            "reason": reason,
            "targets": targets,
        })
    }

    /// Whether this node is in touch with the cluster (serving), for the metrics.
    pub fn serving(&self) -> bool {
        *lock(&self.health) == Health::Serving
    }

    /// (target, node, answering) for every node of every target, this one included (it
    /// answers while it is serving), for the metrics.
    pub fn node_states(&self) -> Vec<(String, u16, bool)> {
        let serving = self.serving();
        let agents = self.agents();
        let mut out = Vec::new();
        for a in agents {
            for (n, v) in lock(&a.view).iter() {
                let up = if *n == self.cfg.node {
                    serving
                } else {
                    v.alive
                };
                out.push((a.name.clone(), *n, up));
            }
        }
        out
    }
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
}
