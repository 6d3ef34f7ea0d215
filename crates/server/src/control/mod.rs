//! Operations: the control API ([`Control`]: the views `ironsan ctl`, the status page and the
//! metrics read, and the run-time changes) and the control socket that serves it. Nothing here
//! is on the data path; the counters the data path keeps are in [`crate::counters`].
//!
//! # Protocol
//! One Unix stream socket (mode 0600: the owner only, in a 0700 directory). A client sends
//! one JSON object per line and gets one line back: `{"ok": true, "data": …}` or
//! `{"ok": false, "error": "…", "kind": "not_found"}` ([`ControlError`], [`ErrorKind`]). The
//! request is typed once, [`Request`]: `{"request": REQUEST}` is its JSON (what `ironsan ctl`
//! sends), `{"argv": ["lun", "resize", "iqn…", "0", "20G"]}` the same request as the words
//! after `ironsan ctl`, parsed on the server by the same clap grammar (what a script sends).
//! [`Control::dispatch`] runs it; the binary's src/ctl/ renders `data` as tables.
//!
//! # Run-time changes
//! Targets and their access rules live in a copy-on-write [`crate::Runtime`] snapshot, a
//! target's LUN map in a copy-on-write slot of its own (see docs/ARCHITECTURE.md). Every change
//! here edits a copy and swaps it in; sessions and commands holding the old snapshot finish
//! with it. Commands that need the configuration syntax (LUN specs, `apply`, `save`) go through
//! [`Hooks`], implemented by the `ironsan` binary.

mod error;
mod request;
pub mod views;

pub use error::{ControlError, ErrorKind};
pub use request::{
    AclRequest, AluaRequest, ClusterRequest, LunRequest, PortalRequest, Request, ShowRequest,
    Switch, TargetRequest,
};
use views::{
    AluaGroupView, ConnectionView, KeptConnectionView, LunView, PortalView, SessionView, StageView,
    StatsView, TargetDetailView, TargetView, TcpView,
};

use crate::access::{Access, AclRule};
use crate::counters::{ConnCounters, Gauges};
use crate::iscsi::session::Session;
use crate::{LiveTarget, Runtime, Shared, TargetDef};
use ironsan_scsi::LogicalUnit;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

/// What the `ironsan` binary provides to the control socket: everything that needs the
/// configuration syntax.
pub trait Hooks: Send + Sync + 'static {
    /// Build a logical unit from a LUN spec (`ram:1G`, `file:x.img:10G,direct`) for `lun add`.
    /// Returns the LU and the canonical spec to remember for `save`.
    fn build_lun(
        &self,
        target: &str,
        lun: u64,
        spec: &str,
    ) -> Result<(Arc<LogicalUnit>, String), ControlError> {
        let _ = (target, lun, spec);
        Err(ControlError::unsupported(
            "this server cannot build LUNs from specs",
        ))
    }
    /// `apply FILE [--dry-run]`: reconcile the running state to a configuration file.
    fn apply(&self, control: &Control, file: &Path, dry_run: bool) -> Result<Value, ControlError> {
        let _ = (control, file, dry_run);
        Err(ControlError::unsupported(
            "this server has no configuration files to apply",
        ))
    }
    /// `save [FILE]`: the running state as a configuration file.
    fn save(&self, control: &Control, file: Option<&Path>) -> Result<Value, ControlError> {
        let _ = (control, file);
        Err(ControlError::unsupported(
            "this server has no configuration syntax to save in",
        ))
    }
}

/// (LUN, the LU, the spec it was made from) as [`Control::lun_list`] returns them.
pub type LunEntry = (u64, Arc<LogicalUnit>, Option<String>);

/// Hooks that add nothing (tests, embedders without a configuration file).
#[derive(Debug)]
pub struct NoHooks;
impl Hooks for NoHooks {}

/// A handle on the running server: views and run-time changes. Cheap to clone.
#[derive(Clone)]
pub struct Control {
    shared: Arc<Shared>,
    /// The spec each LUN was made from, for `save` (target → LUN → spec).
    origins: Arc<Mutex<BTreeMap<String, BTreeMap<u64, String>>>>,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control")
            .field("targets", &self.target_names())
            .finish_non_exhaustive()
    }
}

/// The name of `target` (which must exist), or of every target, sorted.
fn target_names<'a>(
    rt: &'a Runtime,
    target: Option<&str>,
) -> Result<Vec<&'a String>, ControlError> {
    let mut names: Vec<&String> = match target {
        Some(t) => vec![
            rt.targets
                .get_key_value(t)
                .ok_or_else(|| ControlError::not_found(format!("no target '{t}'")))?
                .0,
        ],
        None => rt.targets.keys().collect(),
    };
    names.sort();
    Ok(names)
}

use crate::lock;

impl Control {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        let origins = Arc::clone(&shared.origins);
        Control { shared, origins }
    }

    fn sessions_of(&self, target: Option<&str>) -> Vec<Arc<Session>> {
        let all = lock(&self.shared.sessions).all();
        all.into_iter()
            .filter(|s| target.is_none_or(|t| s.target.as_ref().is_some_and(|x| x.name == t)))
            .collect()
    }

    fn target(&self, name: &str) -> Result<Arc<LiveTarget>, ControlError> {
        self.shared
            .runtime()
            .targets
            .get(name)
            .cloned()
            .ok_or_else(|| ControlError::not_found(format!("no target '{name}'")))
    }

    // ----- views -----------------------------------------------------------------------------

    /// Every session with its connections (negotiated keys, counters, TCP_INFO).
    pub fn sessions(&self) -> Vec<SessionView> {
        self.sessions_of(None).iter().map(session_view).collect()
    }

    /// Every target, sorted by name.
    pub fn targets(&self) -> Vec<TargetView> {
        let rt = self.shared.runtime();
        let mut names: Vec<&String> = rt.targets.keys().collect();
        names.sort();
        let sessions = lock(&self.shared.sessions).all();
        let neg = &self.shared.cfg.negotiation;
        names
            .into_iter()
            .map(|n| {
                let t = &rt.targets[n];
                let a = rt.access(n);
                TargetView {
                    name: t.name.clone(),
                    alias: t.alias.clone(),
                    connections_per_session: t.max_connections().unwrap_or(neg.max_connections),
                    error_recovery_level: t
                        .error_recovery_level()
                        .unwrap_or(neg.error_recovery_level),
                    portal_groups: rt.portal_groups.get(n.as_str()).cloned(),
                    luns: t.scsi().luns().count(),
                    sessions: sessions
                        .iter()
                        .filter(|s| s.target.as_ref().is_some_and(|x| x.name == t.name))
                        .count(),
                    acl: a.acl.iter().map(|r| r.to_string()).collect(),
                    chap: a.chap.as_ref().map(|c| c.user.clone()),
                    mutual_chap: a.mutual_chap.as_ref().map(|c| c.user.clone()),
                }
            })
            .collect()
    }

    /// The LUNs of one target, or of every target.
    pub fn luns(&self, target: Option<&str>) -> Result<Vec<LunView>, ControlError> {
        let rt = self.shared.runtime();
        let names = target_names(&rt, target)?;
        let origins = lock(&self.origins);
        let mut out = Vec::new();
        for n in names {
            for (lun, lu) in rt.targets[n].scsi().luns() {
                let cfg = lu.config();
                out.push(LunView {
                    target: n.clone(),
                    lun,
                    backend: lu.backend().kind().to_string(),
                    io_engine: lu.backend().io_engine().map(str::to_string),
                    in_flight: lu.backend().in_flight(),
                    size: lu.capacity_blocks() * u64::from(lu.block_size()),
                    blocks: lu.capacity_blocks(),
                    block_size: lu.block_size(),
                    read_only: cfg.read_only,
                    write_cache: lu.wce(),
                    serial: cfg.serial.clone(),
                    naa: format!("{:016x}", cfg.naa),
                    spec: origins.get(n.as_str()).and_then(|m| m.get(&lun)).cloned(),
                });
            }
        }
        Ok(out)
    }

    /// The portals (addresses actually bound) with their portal group tags.
    pub fn portals(&self) -> Vec<PortalView> {
        self.shared
            .portal_list()
            .iter()
            .map(|p| PortalView {
                addr: p.addr.to_string(),
                tag: p.tag,
                transport: p.transport.name().to_string(),
            })
            .collect()
    }

    /// The portals with the addresses they were asked for (port 0: any free port).
    pub fn portal_list(&self) -> Vec<crate::PortalInfo> {
        self.shared.portal_list()
    }

    /// Listen on `addr` as a portal of group `tag` (1 to 65535) and accept logins there at
    /// once; SendTargets lists it from now on. Port 0 binds a free port. Refused for an
    /// address that is already a portal; an address that cannot be bound is named in the
    /// error. Returns the portal as bound.
    pub fn add_portal(&self, addr: SocketAddr, tag: u16) -> Result<crate::Portal, ControlError> {
        self.shared.add_portal(addr, tag)
    }

    /// Stop listening on the portal bound to `addr`: new connections are refused and
    /// SendTargets no longer lists it; sessions (and connections still logging in) that came
    /// in through it keep running. Refused for the last portal and for the last portal of a
    /// group that a target is restricted to.
    pub fn remove_portal(&self, addr: SocketAddr) -> Result<crate::Portal, ControlError> {
        self.shared.remove_portal(addr)
    }

    /// Close the portal bound to `old` and listen on `new` (group `tag`) instead, for an
    /// address that clashes with `old` (same port, one a wildcard). If `new` cannot be
    /// bound, `old` is bound again and the error returned.
    pub fn replace_portal(
        &self,
        old: SocketAddr,
        new: SocketAddr,
        tag: u16,
    ) -> Result<crate::Portal, ControlError> {
        self.shared.replace_portal(old, new, tag)
    }

    /// Move the portal bound to `addr` to group `tag` (for `apply`): logins accepted from
    /// now on announce the new tag; sessions already there keep theirs.
    pub fn set_portal_tag(&self, addr: SocketAddr, tag: u16) -> Result<(), ControlError> {
        self.shared.set_portal_tag(addr, tag)
    }

    /// The ALUA target port groups of `target` and whether they were configured (else one
    /// per portal group, following them).
    pub fn port_groups(
        &self,
        target: &str,
    ) -> Result<(bool, Vec<ironsan_scsi::PortGroup>), ControlError> {
        let scsi = self.target(target)?.scsi();
        Ok((scsi.alua().is_fixed(), scsi.alua().groups()))
    }

    /// Configure `target`'s ALUA target port groups (`None`: one per portal group). Each
    /// group's ports are portal group tags; a tag in two groups, or a group with no port or
    /// a repeated identifier, is refused.
    pub fn set_port_groups(
        &self,
        target: &str,
        groups: Option<Vec<ironsan_scsi::PortGroup>>,
    ) -> Result<(), ControlError> {
        let t = self.target(target)?;
        if let Some(g) = &groups {
            check_port_groups(g)?;
        }
        let follow = groups.is_none();
        t.scsi().set_port_groups(groups);
        if follow {
            self.shared.refresh_alua();
        }
        tracing::info!(target, "ALUA target port groups set");
        Ok(())
    }

    /// Set the access state of `target`'s port group `group` (an implicit transition, SPC-4
    /// §5.15.2.3). With `transition`, the group is transitioning for that long first (commands
    /// through its ports get NOT READY, 04h/0Ah), then takes `state` unless another change
    /// came in between.
    pub fn set_alua_state(
        &self,
        target: &str,
        group: u16,
        state: ironsan_scsi::AccessState,
        transition: Option<std::time::Duration>,
    ) -> Result<(), ControlError> {
        use ironsan_scsi::AccessState;
        if state == AccessState::Transitioning {
            return Err(ControlError::invalid(
                "transitioning is entered with --transition SECS on the way to another state",
            ));
        }
        let t = self.target(target)?;
        let scsi = t.scsi();
        match transition.filter(|d| !d.is_zero()) {
            None => {
                scsi.set_access_state(group, state, None)
                    .map_err(|e| format!("{target}: {e}"))?;
            }
            Some(d) => {
                let handle = tokio::runtime::Handle::try_current().map_err(|_| {
                    ControlError::unsupported("a timed transition needs the server's runtime")
                })?;
                let gen = scsi
                    .set_access_state(group, AccessState::Transitioning, None)
                    .map_err(|e| format!("{target}: {e}"))?;
                scsi.alua().note_transition(d.as_secs_f64().ceil() as u64);
                let t = Arc::clone(&t);
                handle.spawn(async move {
                    tokio::time::sleep(d).await;
                    // Overtaken by another change: that one stands.
                    let _ = t.scsi().set_access_state(group, state, Some(gen));
                });
            }
        }
        tracing::info!(target, group, state = %state, "ALUA state set");
        Ok(())
    }

    /// Set or clear the PREF bit of `target`'s port group `group`.
    pub fn set_alua_preferred(
        &self,
        target: &str,
        group: u16,
        preferred: bool,
    ) -> Result<(), ControlError> {
        Ok(self
            .target(target)?
            .scsi()
            .alua()
            .set_preferred(group, preferred)
            .map_err(|e| format!("{target}: {e}"))?)
    }

    /// `ctl alua [TARGET]`: every target's port groups, their ports (with the portals of
    /// each port) and states.
    pub fn alua(&self, only: Option<&str>) -> Result<Vec<AluaGroupView>, ControlError> {
        if let Some(t) = only {
            self.target(t)?;
        }
        let portals = crate::lock(&self.shared.portals).clone();
        let mut out = Vec::new();
        for name in self.target_names() {
            if only.is_some_and(|o| o != name) {
                continue;
            }
            let (fixed, groups) = self.port_groups(&name)?;
            for g in groups {
                out.push(AluaGroupView {
                    target: name.clone(),
                    group: g.id,
                    state: g.state.name().to_string(),
                    preferred: g.preferred,
                    configured: fixed,
                    portals: portals
                        .iter()
                        .filter(|p| g.ports.contains(&p.tag))
                        .map(|p| p.addr.to_string())
                        .collect(),
                    ports: g.ports,
                });
            }
        }
        Ok(out)
    }

    /// The portal group tags serving `target` (`None`: every portal).
    pub fn portal_groups(&self, target: &str) -> Result<Option<Vec<u16>>, ControlError> {
        self.target(target)?;
        Ok(self.shared.runtime().portal_groups.get(target).cloned())
    }

    /// Serve `target` on the portals of these groups only (`None`: on every portal). New
    /// logins and SendTargets see it at once; sessions already logged in are kept.
    pub fn set_portal_groups(
        &self,
        target: &str,
        tags: Option<Vec<u16>>,
    ) -> Result<(), ControlError> {
        self.target(target)?;
        if let Some(t) = tags.as_ref().and_then(|t| t.iter().find(|&&t| t == 0)) {
            return Err(ControlError::invalid(format!(
                "portal group tag {t} is reserved"
            )));
        }
        self.shared.update_runtime(|rt| {
            match tags {
                Some(t) => rt.portal_groups.insert(target.to_string(), t),
                None => rt.portal_groups.remove(target),
            };
            Ok(())
        })
    }

    /// One target: its settings, LUNs and sessions.
    pub fn show_target(&self, name: &str) -> Result<TargetDetailView, ControlError> {
        self.target(name)?;
        let target = self
            .targets()
            .into_iter()
            .find(|t| t.name == name)
            .ok_or_else(|| ControlError::not_found(format!("no target {name}")))?;
        Ok(TargetDetailView {
            target,
            luns: self.luns(Some(name))?,
            sessions: self
                .sessions_of(Some(name))
                .iter()
                .map(session_view)
                .collect(),
        })
    }

    /// Server-wide counters.
    pub fn counters(&self) -> Value {
        let st = &self.shared.stats;
        json!({
            "connections": self.shared.connections.load(Relaxed),
            "sessions": lock(&self.shared.sessions).len(),
            "logins": st.logins.load(Relaxed),
            "login_failures": lock(&st.login_failures).clone(),
            "digest_errors": st.digest_errors.load(Relaxed),
            "liveness_probes": st.probes.load(Relaxed),
            "zero_copy_read_bytes": st.zero_copy_bytes.load(Relaxed),
            "zero_copy_write_bytes": st.zero_copy_write_bytes.load(Relaxed),
            "error_recovery": st.recoveries().into_iter().collect::<std::collections::BTreeMap<_, _>>(),
        })
    }

    /// `ironsan ctl stats [TARGET]`: per target, LUN and class, the count, bytes and per stage
    /// the mean and p50/p99 (µs) and the raw buckets.
    pub fn stats(&self, target: Option<&str>) -> Result<Vec<StatsView>, ControlError> {
        Ok(stats_view(&self.lun_metrics(target)?))
    }

    /// (target, LUN, counters) of one target or of every target, sorted.
    pub fn lun_metrics(
        &self,
        target: Option<&str>,
    ) -> Result<Vec<(String, u64, Arc<crate::metrics::LunMetrics>)>, ControlError> {
        let rt = self.shared.runtime();
        let names = target_names(&rt, target)?;
        Ok(names
            .into_iter()
            .flat_map(|n| {
                rt.targets[n]
                    .all_lun_metrics()
                    .into_iter()
                    .map(move |(l, m)| (n.clone(), l, m))
            })
            .collect())
    }

    /// Every LUN with its backend kind, the device part of its spec (`rbd:pool/image`,
    /// `file:PATH`, ...) and the backend's operations in flight, if it counts them.
    pub fn lun_inventory(&self) -> Vec<(String, u64, &'static str, String, Option<u64>)> {
        let rt = self.shared.runtime();
        let origins = lock(&self.origins);
        let mut out = Vec::new();
        for (name, t) in rt.targets.iter() {
            for (lun, lu) in t.scsi().luns() {
                let device = origins
                    .get(name.as_str())
                    .and_then(|m| m.get(&lun))
                    .and_then(|s| s.split(',').next())
                    .unwrap_or_default()
                    .to_string();
                let b = lu.backend();
                out.push((name.clone(), lun, b.kind(), device, b.in_flight()));
            }
        }
        out.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        out
    }

    /// Server-wide gauges and counters (for the Prometheus exposition).
    pub fn gauges(&self) -> Gauges {
        let st = &self.shared.stats;
        Gauges {
            connections: self.shared.connections.load(Relaxed) as u64,
            sessions: lock(&self.shared.sessions).len() as u64,
            logins: st.logins.load(Relaxed),
            login_failures: lock(&st.login_failures).clone(),
            digest_errors: st.digest_errors.load(Relaxed),
            probes: st.probes.load(Relaxed),
            zero_copy_bytes: st.zero_copy_bytes.load(Relaxed),
            zero_copy_write_bytes: st.zero_copy_write_bytes.load(Relaxed),
            error_recovery: st.recoveries(),
        }
    }

    /// Every connection of every session, with its counters (for the metrics).
    pub fn connection_counters(&self) -> Vec<ConnCounters> {
        let mut out = Vec::new();
        for s in self.sessions_of(None) {
            let target = s
                .target
                .as_ref()
                .map(|t| t.name.clone())
                .unwrap_or_default();
            s.with_conns(|conns| {
                for c in conns {
                    let p = &c.payload;
                    out.push(ConnCounters {
                        target: target.clone(),
                        initiator: s.initiator_name.clone(),
                        tsih: s.tsih.0,
                        cid: p.cid,
                        rx_bytes: p.stats.rx_bytes.load(Relaxed),
                        tx_bytes: p.tx.bytes.load(Relaxed),
                        reads: p.stats.reads.load(Relaxed),
                        writes: p.stats.writes.load(Relaxed),
                        other: p.stats.other_cmds.load(Relaxed),
                        in_flight: p.stats.in_flight.load(Relaxed),
                    });
                }
            });
        }
        out
    }

    /// The access rules of a target (`None`: discovery).
    pub fn access(&self, target: Option<&str>) -> Result<Access, ControlError> {
        let rt = self.shared.runtime();
        match target {
            None => Ok(rt.discovery.clone()),
            Some(t) if rt.targets.contains_key(t) => Ok(rt.access(t).clone()),
            Some(t) => Err(ControlError::not_found(format!("no target '{t}'"))),
        }
    }

    /// Target names, sorted.
    pub fn target_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.shared.runtime().targets.keys().cloned().collect();
        v.sort();
        v
    }

    /// This server is node `node` of a cluster (`ctl cluster`, the cluster metrics).
    pub fn set_cluster(&self, node: Arc<crate::cluster::ClusterNode>) {
        let _ = self.shared.cluster.set(node);
    }

    /// The cluster node this server is, if it is one.
    pub fn cluster(&self) -> Option<&Arc<crate::cluster::ClusterNode>> {
        self.shared.cluster.get()
    }

    fn cluster_node(&self) -> Result<&Arc<crate::cluster::ClusterNode>, ControlError> {
        self.cluster().ok_or_else(|| {
            ControlError::unsupported(
                "this node is not part of a cluster (no [cluster] or --cluster)",
            )
        })
    }

    /// The LU at `lun` of `target`, if both exist.
    pub fn scsi_lun(&self, target: &str, lun: u64) -> Option<Arc<LogicalUnit>> {
        self.target(target).ok()?.scsi().lun(lun).cloned()
    }

    /// Abort the tasks on `target`'s `lun` of the I_T nexuses a PREEMPT AND ABORT named
    /// ([`LogicalUnit::take_pr_aborts`]): also for a PREEMPT AND ABORT another node of a
    /// cluster completed.
    pub fn abort_preempted(&self, target: &str, lun: u64) {
        if let Ok(t) = self.target(target) {
            crate::iscsi::session::abort_preempted(&self.shared.sessions, &t, lun);
        }
    }

    /// A LOGICAL UNIT RESET of `target`'s `lun` made through another node of a cluster:
    /// every task on the LU is aborted and the LU is reset (POWER ON, RESET, OR BUS DEVICE
    /// RESET OCCURRED for every I_T nexus, also one whose only commands were aborted).
    pub fn reset_lun(&self, target: &str, lun: u64) {
        let Some(lu) = self.scsi_lun(target, lun) else {
            return;
        };
        for s in self.sessions_of(Some(target)) {
            // As for a LUN RESET through this node: a nexus whose only commands here were
            // aborted (writes waiting for data) is told too.
            if s.abort_where(false, |_, task| task.lun == lun) > 0 {
                lu.establish_unit_attention_on(&s.nexus, ironsan_scsi::UnitAttention::PowerOnReset);
            }
        }
        lu.reset();
    }

    /// (LUN, LU, spec it was made from) of a target.
    pub fn lun_list(&self, target: &str) -> Result<Vec<LunEntry>, ControlError> {
        let t = self.target(target)?;
        let origins = lock(&self.origins);
        Ok(t.scsi()
            .luns()
            .map(|(n, lu)| {
                let o = origins.get(target).and_then(|m| m.get(&n)).cloned();
                (n, Arc::clone(lu), o)
            })
            .collect())
    }

    /// The alias of a target.
    pub fn alias(&self, target: &str) -> Result<Option<String>, ControlError> {
        Ok(self.target(target)?.alias.clone())
    }

    /// The connections a session with `target` may have (MaxConnections it offers), if set
    /// for the target (else the server's default applies).
    pub fn connections_per_session(&self, target: &str) -> Result<Option<u16>, ControlError> {
        Ok(self.target(target)?.max_connections())
    }

    /// Set (or clear) the target's MaxConnections offer; sessions logged in later get it.
    pub fn set_connections_per_session(
        &self,
        target: &str,
        n: Option<u16>,
    ) -> Result<(), ControlError> {
        if n == Some(0) {
            return Err(ControlError::invalid(
                "connections_per_session must be at least 1",
            ));
        }
        self.target(target)?.set_max_connections(n);
        Ok(())
    }

    /// The highest ErrorRecoveryLevel `target` offers, if set for the target (else the
    /// server's default applies).
    pub fn error_recovery_level(&self, target: &str) -> Result<Option<u8>, ControlError> {
        Ok(self.target(target)?.error_recovery_level())
    }

    /// Set (or clear) the target's highest ErrorRecoveryLevel; sessions logged in later get
    /// it. Above [`ironsan_proto::negotiate::MAX_ERROR_RECOVERY_LEVEL`] is refused.
    pub fn set_error_recovery_level(
        &self,
        target: &str,
        n: Option<u8>,
    ) -> Result<(), ControlError> {
        let max = ironsan_proto::negotiate::MAX_ERROR_RECOVERY_LEVEL;
        if n.is_some_and(|n| n > max) {
            return Err(ControlError::invalid(format!(
                "error_recovery_level must be between 0 and {max}"
            )));
        }
        self.target(target)?.set_error_recovery_level(n);
        Ok(())
    }

    // ----- changes ---------------------------------------------------------------------------

    /// Remember the spec a LUN was made from (for `save`).
    pub fn set_lun_origin(&self, target: &str, lun: u64, spec: Option<String>) {
        let mut o = lock(&self.origins);
        let m = o.entry(target.to_string()).or_default();
        match spec {
            Some(s) => m.insert(lun, s),
            None => m.remove(&lun),
        };
    }

    /// Add a target with its LUNs and access rules. New logins and SendTargets see it at once.
    pub fn add_target(&self, def: TargetDef, access: Access) -> Result<(), ControlError> {
        access.validate().map_err(ControlError::invalid)?;
        let name = def.name.clone();
        self.shared.update_runtime(|rt| {
            if rt.targets.contains_key(&name) {
                return Err(ControlError::exists(format!(
                    "target '{name}' already exists"
                )));
            }
            rt.targets
                .insert(name.clone(), Arc::new(LiveTarget::new(&def)));
            rt.access.insert(name.clone(), access);
            Ok(())
        })?;
        tracing::info!(target_name = %name, "target added");
        Ok(())
    }

    /// Remove a target. With sessions logged in to it: refused unless `force`, which closes
    /// them. Returns how many sessions were closed.
    pub fn remove_target(&self, name: &str, force: bool) -> Result<usize, ControlError> {
        let sessions = self.sessions_of(Some(name));
        if !sessions.is_empty() && !force {
            return Err(ControlError::busy(format!(
                "target '{name}' has {} session(s); log them out first or use --force",
                sessions.len()
            )));
        }
        self.shared.update_runtime(|rt| {
            rt.targets
                .remove(name)
                .ok_or_else(|| ControlError::not_found(format!("no target '{name}'")))?;
            rt.access.remove(name);
            rt.portal_groups.remove(name);
            Ok::<(), ControlError>(())
        })?;
        lock(&self.origins).remove(name);
        for s in &sessions {
            s.close_conns(None);
        }
        tracing::info!(target_name = %name, closed = sessions.len(), "target removed");
        Ok(sessions.len())
    }

    /// Map `lu` at `lun` (the lowest free number when `None`). Raises REPORTED LUNS DATA HAS
    /// CHANGED on the target's other LUs. Returns the LUN.
    pub fn add_lun(
        &self,
        target: &str,
        lun: Option<u64>,
        lu: Arc<LogicalUnit>,
        spec: Option<String>,
    ) -> Result<u64, ControlError> {
        let t = self.target(target)?;
        let n = t.update_luns(|s| {
            let n = match lun {
                Some(n) if s.lun(n).is_some() => {
                    return Err(ControlError::exists(format!(
                        "{target} already has LUN {n}"
                    )))
                }
                Some(n) if n > ironsan_scsi::MAX_LUN => {
                    return Err(ControlError::invalid(format!(
                        "LUN {n} is above {}",
                        ironsan_scsi::MAX_LUN
                    )))
                }
                Some(n) => n,
                None => (0..=ironsan_scsi::MAX_LUN)
                    .find(|n| s.lun(*n).is_none())
                    .ok_or_else(|| ControlError::busy("no free LUN number"))?,
            };
            s.luns_changed();
            s.add_lun(n, lu);
            Ok(n)
        })?;
        self.set_lun_origin(target, n, spec);
        tracing::info!(target_name = %target, lun = n, "LUN added");
        Ok(n)
    }

    /// Unmap a LUN. Commands already running on it finish; later ones get LOGICAL UNIT NOT
    /// SUPPORTED; the other LUs report REPORTED LUNS DATA HAS CHANGED.
    pub fn remove_lun(&self, target: &str, lun: u64) -> Result<Arc<LogicalUnit>, ControlError> {
        let t = self.target(target)?;
        let lu = t.update_luns(|s| {
            let lu = s
                .remove_lun(lun)
                .ok_or_else(|| ControlError::not_found(format!("{target} has no LUN {lun}")))?;
            s.luns_changed();
            Ok::<_, ControlError>(lu)
        })?;
        self.set_lun_origin(target, lun, None);
        tracing::info!(target_name = %target, lun, "LUN removed");
        Ok(lu)
    }

    /// Resize a LUN to `bytes` (whole blocks); raises CAPACITY DATA HAS CHANGED. Returns the
    /// new number of blocks.
    pub fn resize_lun(&self, target: &str, lun: u64, bytes: u64) -> Result<u64, ControlError> {
        let lu = self
            .target(target)?
            .scsi()
            .lun(lun)
            .cloned()
            .ok_or_else(|| ControlError::not_found(format!("{target} has no LUN {lun}")))?;
        let blocks = lu
            .resize(bytes)
            .map_err(|e| format!("{target} LUN {lun}: cannot resize to {bytes} bytes: {e}"))?;
        tracing::info!(target_name = %target, lun, blocks, "LUN resized");
        Ok(blocks)
    }

    /// Replace the access rules of a target (`None`: discovery). Existing sessions stay; the
    /// rules apply to the next login and SendTargets.
    pub fn set_access(&self, target: Option<&str>, access: Access) -> Result<(), ControlError> {
        access.validate().map_err(ControlError::invalid)?;
        self.shared.update_runtime(|rt| {
            match target {
                None => rt.discovery = access,
                Some(t) if rt.targets.contains_key(t) => {
                    rt.access.insert(t.to_string(), access);
                }
                Some(t) => return Err(ControlError::not_found(format!("no target '{t}'"))),
            }
            Ok(())
        })
    }

    /// Add an ACL rule (`discovery` as the target name means discovery sessions).
    pub fn acl_add(&self, target: &str, rule: &str) -> Result<(), ControlError> {
        let rule = AclRule::parse(rule).map_err(ControlError::invalid)?;
        let t = (target != "discovery").then_some(target);
        let mut a = self.access(t)?;
        if a.acl.contains(&rule) {
            return Err(ControlError::exists(format!(
                "{target} already has ACL rule {rule}"
            )));
        }
        a.acl.push(rule);
        self.set_access(t, a)
    }

    /// Remove an ACL rule. Removing the last rule opens the target to every initiator.
    pub fn acl_remove(&self, target: &str, rule: &str) -> Result<(), ControlError> {
        let rule = AclRule::parse(rule).map_err(ControlError::invalid)?;
        let t = (target != "discovery").then_some(target);
        let mut a = self.access(t)?;
        let before = a.acl.len();
        a.acl.retain(|r| *r != rule);
        if a.acl.len() == before {
            return Err(ControlError::not_found(format!(
                "{target} has no ACL rule {rule}"
            )));
        }
        self.set_access(t, a)
    }

    /// Run one control request given as words (as after `ironsan ctl`, no global flags).
    pub fn dispatch_words<S: AsRef<str>>(
        &self,
        hooks: &dyn Hooks,
        argv: &[S],
    ) -> Result<Value, ControlError> {
        let req = Request::from_argv(argv).map_err(ControlError::invalid)?;
        self.dispatch(hooks, &req)
    }

    /// Run one control request.
    pub fn dispatch(&self, hooks: &dyn Hooks, req: &Request) -> Result<Value, ControlError> {
        let ok = |m: String| Ok(json!({ "message": m }));
        match req {
            Request::Sessions => view(self.sessions()),
            Request::Targets => view(self.targets()),
            Request::Luns { target } => view(self.luns(target.as_deref())?),
            Request::Portals => view(self.portals()),
            Request::Show(ShowRequest::Target { iqn }) => view(self.show_target(iqn)?),
            Request::Counters => Ok(self.counters()),
            Request::Stats { target } => view(self.stats(target.as_deref())?),
            Request::Cluster { cmd: None } => view(self.cluster_node()?.status()),
            Request::Cluster {
                cmd: Some(ClusterRequest::Forget { node }),
            } => {
                let c = Arc::clone(self.cluster_node()?);
                ok(c.forget(*node)?)
            }
            Request::Lun(LunRequest::Add { target, spec, lun }) => {
                let n = match lun {
                    Some(n) => *n,
                    None => self
                        .target(target)?
                        .scsi()
                        .luns()
                        .map(|(n, _)| n + 1)
                        .max()
                        .unwrap_or(0),
                };
                let (lu, canon) = hooks.build_lun(target, n, spec)?;
                let n = self.add_lun(target, Some(n), lu, Some(canon))?;
                ok(format!("{target}: LUN {n} added"))
            }
            Request::Lun(LunRequest::Remove { target, lun }) => {
                self.remove_lun(target, *lun)?;
                ok(format!("{target}: LUN {lun} removed"))
            }
            Request::Lun(LunRequest::Resize { target, lun, size }) => {
                let bytes = ironsan_backend::parse_size(size).ok_or_else(|| {
                    ControlError::invalid(format!("'{size}' is not a size (e.g. 10G)"))
                })?;
                let blocks = self.resize_lun(target, *lun, bytes)?;
                ok(format!("{target}: LUN {lun} now has {blocks} blocks"))
            }
            Request::Target(TargetRequest::Add { iqn, alias }) => {
                check_name(iqn).map_err(ControlError::invalid)?;
                self.add_target(
                    TargetDef {
                        name: iqn.clone(),
                        alias: alias.clone(),
                        max_connections: None,
                        error_recovery_level: None,
                        scsi: Arc::new(ironsan_scsi::Target::new()),
                    },
                    Access::default(),
                )?;
                ok(format!(
                    "target {iqn} added (no LUNs yet: ironsan ctl lun add {iqn} SPEC)"
                ))
            }
            Request::Target(TargetRequest::Remove { iqn, force }) => {
                let n = self.remove_target(iqn, *force)?;
                ok(if *force {
                    format!("target {iqn} removed, {n} session(s) closed")
                } else {
                    format!("target {iqn} removed")
                })
            }
            Request::Portal(PortalRequest::Add { addr, tag }) => self.portal_add_cmd(addr, *tag),
            Request::Portal(PortalRequest::Remove { addr }) => {
                let p = self.remove_portal(portal_addr(addr).map_err(ControlError::invalid)?)?;
                ok(format!(
                    "portal {} (group {}) removed; sessions that came in through it keep running",
                    p.addr, p.tag
                ))
            }
            Request::Alua { target, cmd: None } => view(self.alua(target.as_deref())?),
            Request::Alua {
                cmd:
                    Some(AluaRequest::Set {
                        target,
                        group,
                        state,
                        transition,
                    }),
                ..
            } => {
                let st = ironsan_scsi::AccessState::parse(state).ok_or_else(|| {
                    ControlError::invalid(format!("'{state}' is not a state (active/optimized, active/non-optimized, standby, unavailable, offline)"))
                })?;
                let d = transition.map(std::time::Duration::from_secs);
                self.set_alua_state(target, *group, st, d)?;
                ok(match d {
                    Some(d) => format!(
                        "{target}: group {group} transitioning, {st} in {}s",
                        d.as_secs()
                    ),
                    None => format!("{target}: group {group} is {st}"),
                })
            }
            Request::Alua {
                cmd: Some(AluaRequest::Prefer { target, group, on }),
                ..
            } => {
                self.set_alua_preferred(target, *group, on.is_on())?;
                ok(format!("{target}: group {group} preferred {on}"))
            }
            Request::Acl(AclRequest::Add { target, rule }) => {
                self.acl_add(target, rule)?;
                ok(format!("{target}: ACL rule {rule} added"))
            }
            Request::Acl(AclRequest::Remove { target, rule }) => {
                self.acl_remove(target, rule)?;
                ok(format!("{target}: ACL rule {rule} removed"))
            }
            Request::Apply { file, dry_run } => hooks.apply(self, file, *dry_run),
            Request::Save { file } => hooks.save(self, file.as_deref()),
        }
    }
}

impl crate::cluster::Host for Control {
    fn target_names(&self) -> Vec<String> {
        Control::target_names(self)
    }

    fn target_portals(&self, target: &str) -> Vec<(u16, SocketAddr)> {
        let tags = self.portal_groups(target).ok().flatten();
        self.portal_list()
            .into_iter()
            .filter(|p| tags.as_ref().is_none_or(|t| t.contains(&p.tag)))
            .map(|p| (p.tag, p.addr))
            .collect()
    }

    fn logical_units(&self, target: &str) -> Vec<(u64, Arc<LogicalUnit>)> {
        // Read on every ping (the oldest write held): the LUN map alone, not `lun_list`'s
        // specs.
        self.target(target)
            .map(|t| t.scsi().luns().map(|(n, lu)| (n, Arc::clone(lu))).collect())
            .unwrap_or_default()
    }

    fn logical_unit(&self, target: &str, lun: u64) -> Option<Arc<LogicalUnit>> {
        self.scsi_lun(target, lun)
    }

    fn abort_preempted(&self, target: &str, lun: u64) {
        Control::abort_preempted(self, target, lun)
    }

    fn reset_lun(&self, target: &str, lun: u64) {
        Control::reset_lun(self, target, lun)
    }

    fn port_groups(&self, target: &str) -> Result<Vec<ironsan_scsi::PortGroup>, String> {
        Control::port_groups(self, target)
            .map(|(_, g)| g)
            .map_err(String::from)
    }

    fn set_port_groups(
        &self,
        target: &str,
        groups: Vec<ironsan_scsi::PortGroup>,
    ) -> Result<(), String> {
        Control::set_port_groups(self, target, Some(groups)).map_err(String::from)
    }
}

impl Control {
    /// `portal add ADDR [--tag N]`.
    fn portal_add_cmd(&self, addr: &str, tag: u16) -> Result<Value, ControlError> {
        let want = portal_addr(addr).map_err(ControlError::invalid)?;
        let p = self.add_portal(want, tag)?;
        let what = if p.addr == want {
            format!("portal {} (group {}) added", p.addr, p.tag)
        } else {
            format!("portal {want} (group {}) added as {}", p.tag, p.addr)
        };
        Ok(json!({ "message": what, "addr": p.addr.to_string(), "tag": p.tag }))
    }
}

fn portal_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("'{s}' is not ADDR:PORT (IPv6 as [::1]:3260)"))
}

fn check_name(name: &str) -> Result<(), String> {
    if ironsan_proto::negotiate::valid_iscsi_name(name) && name.to_ascii_lowercase() == name {
        Ok(())
    } else {
        Err(format!(
            "'{name}' is not a lower-case iSCSI name (iqn.…, eui.…, naa.…)"
        ))
    }
}

fn stats_view(luns: &[(String, u64, Arc<crate::metrics::LunMetrics>)]) -> Vec<StatsView> {
    use crate::metrics::{Class, STAGES};
    let round2 = |v: f64| (v * 100.0).round() / 100.0;
    let mut out = Vec::new();
    for (target, lun, m) in luns {
        for class in Class::ALL {
            let c = &m.classes[class as usize];
            let stages = STAGES
                .iter()
                .zip(&c.stages)
                .map(|(name, h)| {
                    let s = h.snapshot();
                    let stage = StageView {
                        count: s.count(),
                        mean_us: round2(s.mean_us()),
                        p50_us: round2(s.quantile_us(0.5)),
                        p99_us: round2(s.quantile_us(0.99)),
                        sum_us: s.sum_ns / 1000,
                        buckets: s.counts.to_vec(),
                    };
                    (name.to_string(), stage)
                })
                .collect();
            out.push(StatsView {
                target: target.clone(),
                lun: *lun,
                class: class.name().to_string(),
                commands: c.commands.load(Relaxed),
                bytes: c.bytes.load(Relaxed),
                stages,
            });
        }
    }
    out
}

/// A view as the JSON the socket answers with.
fn view(v: impl serde::Serialize) -> Result<Value, ControlError> {
    serde_json::to_value(v).map_err(|e| ControlError::failed(format!("view not encoded: {e}")))
}

fn session_view(s: &Arc<Session>) -> SessionView {
    let info = s.info();
    let connections = s.with_conns(|conns| {
        conns
            .iter()
            .map(|slot| {
                let c = &slot.payload;
                let st = &c.stats;
                let tcp = crate::sys::tcp_info(c.fd).ok().map(|t| TcpView {
                    rtt_us: t.rtt_us,
                    rttvar_us: t.rttvar_us,
                    cwnd: t.snd_cwnd,
                    ssthresh: t.snd_ssthresh,
                    retransmits: t.total_retrans,
                    delivery_rate: t.delivery_rate,
                    mss: t.snd_mss,
                    congestion: crate::sys::tcp_congestion(c.fd).ok(),
                });
                ConnectionView {
                    cid: c.cid,
                    peer: c.peer.to_string(),
                    portal: c.local.to_string(),
                    since: c
                        .since
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs())
                        .unwrap_or(0),
                    in_flight: st.in_flight.load(Relaxed),
                    rx_pdus: st.rx_pdus.load(Relaxed),
                    rx_bytes: st.rx_bytes.load(Relaxed),
                    tx_pdus: c.tx.pdus.load(Relaxed),
                    tx_bytes: c.tx.bytes.load(Relaxed),
                    tx_zero_copy_bytes: c.tx.zero_copy_bytes.load(Relaxed),
                    reads: st.reads.load(Relaxed),
                    read_bytes: st.read_bytes.load(Relaxed),
                    writes: st.writes.load(Relaxed),
                    write_bytes: st.write_bytes.load(Relaxed),
                    other_commands: st.other_cmds.load(Relaxed),
                    digest_errors: st.digest_errors.load(Relaxed),
                    tcp,
                }
            })
            .collect()
    });
    SessionView {
        tsih: info.tsih,
        kind: if info.target_name.is_some() {
            "normal"
        } else {
            "discovery"
        }
        .to_string(),
        isid: info.isid,
        initiator: info.initiator_name,
        target: info.target_name,
        commands: info.commands,
        params: info.params.into_iter().collect(),
        connections,
        kept_connections: info
            .kept
            .iter()
            .map(|&(cid, tasks, expires_in_ms)| KeptConnectionView {
                cid,
                tasks,
                expires_in_ms,
            })
            .collect(),
    }
}

// ----- the socket ---------------------------------------------------------------------------

/// Where the control socket lives by default: `/run/ironsan/control.sock` for root,
/// `$XDG_RUNTIME_DIR/ironsan/control.sock` for others when that is set, else
/// `./ironsan-data/control.sock`.
pub fn default_socket_path() -> PathBuf {
    // /proc/self belongs to the process's effective user (no libc call needed).
    let root = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    if root {
        return PathBuf::from("/run/ironsan/control.sock");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => Path::new(&d).join("ironsan").join("control.sock"),
        _ => PathBuf::from("./ironsan-data/control.sock"),
    }
}

/// Bind the control socket at `path`: the parent directory is created with mode 0700 if
/// missing, a stale socket (nobody answering) is replaced, a live one is an error, and the
/// socket gets mode 0600.
pub fn bind_control(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
        }
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("{}: another ironsan is listening there", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let l = tokio::net::UnixListener::bind(path).map_err(|e| {
        std::io::Error::new(e.kind(), format!("control socket {}: {e}", path.display()))
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Longest request line accepted.
const MAX_REQUEST: usize = 1 << 20;

/// Serve the control socket until the task is dropped or aborted.
pub async fn serve_control(
    listener: tokio::net::UnixListener,
    control: Control,
    hooks: Arc<dyn Hooks>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let control = control.clone();
        let hooks = Arc::clone(&hooks);
        tokio::spawn(async move {
            use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
            let (rd, mut wr) = stream.into_split();
            let mut lines = tokio::io::BufReader::new(rd.take(MAX_REQUEST as u64 * 16)).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let resp = if line.len() > MAX_REQUEST {
                    json!({"ok": false, "error": "request too long"})
                } else {
                    let control = control.clone();
                    let hooks = Arc::clone(&hooks);
                    // Commands may touch files (lun add, apply, save): off the runtime threads.
                    tokio::task::spawn_blocking(move || handle_line(&control, &*hooks, &line))
                        .await
                        .unwrap_or_else(|e| json!({"ok": false, "error": e.to_string()}))
                };
                let mut out = resp.to_string();
                out.push('\n');
                if wr.write_all(out.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
    }
}

use tokio::io::AsyncReadExt as _;

/// One request line: `{"request": REQUEST}` (what `ironsan ctl` sends: [`Request`] as JSON)
/// or `{"argv": [WORDS]}` (what a script sends: the words after `ironsan ctl`, parsed by the
/// same grammar).
fn parse_line(line: &str) -> Result<Request, ControlError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        request: Option<Request>,
        argv: Option<Vec<String>>,
    }
    let l: Line = serde_json::from_str(line)
        .map_err(|e| ControlError::invalid(format!("bad request: {e}")))?;
    match (l.request, l.argv) {
        (Some(r), None) => Ok(r),
        (None, Some(words)) => Request::from_argv(&words).map_err(ControlError::invalid),
        _ => Err(ControlError::invalid(
            "bad request: give either \"request\" or \"argv\"",
        )),
    }
}

fn handle_line(control: &Control, hooks: &dyn Hooks, line: &str) -> Value {
    let r = parse_line(line).and_then(|req| {
        tracing::debug!(request = ?req, "control command");
        let r = control.dispatch(hooks, &req);
        if let Err(e) = &r {
            tracing::info!(request = ?req, "control command failed: {e}");
        }
        r
    });
    match r {
        Ok(data) => json!({"ok": true, "data": data}),
        Err(e) => json!({"ok": false, "error": e.message, "kind": e.kind}),
    }
}

/// Why [`call`] got no answer's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// The socket could not be reached (nobody listening, no permission).
    Unreachable(String),
    /// The server refused the command (its reason and kind), or the exchange broke off
    /// (kind `failed`).
    Refused(ControlError),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Unreachable(e) => f.write_str(e),
            CallError::Refused(e) => f.write_str(&e.message),
        }
    }
}

impl std::error::Error for CallError {}

/// Send the words of one command (as after `ironsan ctl`) to the control socket at `path`
/// and return its `data` (blocking; for scripts' equivalents and tests).
pub fn call(path: &Path, argv: &[String]) -> Result<Value, CallError> {
    exchange(path, &json!({ "argv": argv }))
}

/// Send one request to the control socket at `path` and return its `data` (blocking; for
/// `ironsan ctl`).
pub fn call_request(path: &Path, req: &Request) -> Result<Value, CallError> {
    exchange(path, &json!({ "request": req }))
}

fn exchange(path: &Path, req: &Value) -> Result<Value, CallError> {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path).map_err(|e| {
        CallError::Unreachable(format!(
            "cannot connect to {}: {e} (is ironsan serve running? --control PATH)",
            path.display()
        ))
    })?;
    let broke = |e: std::io::Error| {
        CallError::Refused(ControlError::failed(format!("{}: {e}", path.display())))
    };
    let mut line = req.to_string();
    line.push('\n');
    s.write_all(line.as_bytes()).map_err(broke)?;
    let mut line = String::new();
    std::io::BufReader::new(&s)
        .read_line(&mut line)
        .map_err(broke)?;
    let v: Value = serde_json::from_str(&line).map_err(|e| {
        CallError::Refused(ControlError::failed(format!(
            "bad response from {}: {e}",
            path.display()
        )))
    })?;
    if v["ok"] == true {
        Ok(v["data"].clone())
    } else {
        let kind = serde_json::from_value(v["kind"].clone()).unwrap_or(ErrorKind::Failed);
        Err(CallError::Refused(ControlError::new(
            kind,
            v["error"].as_str().unwrap_or("error"),
        )))
    }
}

/// A configured ALUA layout: identifiers unique, every group with a port, no port (portal
/// group tag) in two groups.
pub fn check_port_groups(groups: &[ironsan_scsi::PortGroup]) -> Result<(), String> {
    for (i, g) in groups.iter().enumerate() {
        if g.ports.is_empty() {
            return Err(format!("target port group {} has no portal group", g.id));
        }
        for h in &groups[..i] {
            if h.id == g.id {
                return Err(format!("target port group {} is given twice", g.id));
            }
            if let Some(p) = g.ports.iter().find(|p| h.ports.contains(p)) {
                return Err(format!(
                    "portal group {p} is in target port groups {} and {}",
                    h.id, g.id
                ));
            }
        }
    }
    Ok(())
}
