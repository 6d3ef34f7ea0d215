//! Sessions and the session registry (RFC 7143 §4.4, §6.3.5 session reinstatement).
//!
//! A session is shared by its connections, which may run on different threads. Its
//! session-wide protocol state (the CmdSN sequencer, the task table with each task's
//! connection, the connections) is the sans-IO [`ironsan_proto::session::Session`], kept here
//! under one mutex that no caller holds across I/O or an `.await`: each command takes it to be
//! admitted, once to be claimed when it starts running, and once to be removed when it
//! completes. ExpCmdSN and MaxCmdSN are published after every change in one atomic word, so the
//! writers of every connection stamp them without the lock.
//!
//! What the protocol core cannot do is here: aborting a running task (its tokio task, the
//! zero-copy slot of a write received in place, and telling its LU), closing and waking
//! connections, and waiting for the readers of a replaced session to stop.

use crate::LiveTarget;
use ironsan_backend::int_map::IntHasher;
use ironsan_proto::login::LoginStatus;
use ironsan_proto::negotiate::{ConnParams, SessionParams};
use ironsan_proto::pdu::{Cid, Isid, Itt, Tsih};
use ironsan_proto::session::{ConnId, ConnSlot, Joined, Task, Terminated};
use ironsan_proto::CmdSn;
use ironsan_scsi::UnitAttention;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{watch, Notify};

mod orphans;

use crate::iscsi::task::{HeldPdu, Running};
use crate::iscsi::writer::SnWindow;
use crate::lock;
pub(crate) use orphans::{send_forwards, Orphans};

/// The session-wide protocol core, as this server instantiates it.
pub(crate) type Core =
    ironsan_proto::session::Session<Running, ConnInfo, HeldPdu, BuildHasherDefault<IntHasher>>;

/// Why the target closes a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Close {
    /// Its session ended (reinstated, reset away, recovered), it was logged out from another
    /// connection or reinstated, or an admin closed it.
    ByTarget,
    /// The initiator did not answer a NOP-In ping (a connection failure).
    NopTimeout,
    /// Removed for recovery at ErrorRecoveryLevel 2 (a logout with reason 2 from another
    /// connection, or a reinstatement): it leaves as failed, its tasks kept for reassignment.
    ForRecovery,
}

/// How other threads reach a connection's reader: events due on it (a held command released
/// by another connection), and whether its reader has stopped.
#[derive(Debug, Default)]
pub(crate) struct ConnSignals {
    events: AtomicBool,
    wake: Notify,
    stopped: AtomicBool,
    stop: Notify,
}

impl ConnSignals {
    /// Tell the reader its session queue has events.
    pub(crate) fn wake(&self) {
        self.events.store(true, Ordering::Release);
        self.wake.notify_one();
    }
    /// Whether events were signalled since the last call (clears it).
    pub(crate) fn take_events(&self) -> bool {
        self.events.swap(false, Ordering::AcqRel)
    }
    /// Wait for [`ConnSignals::wake`].
    pub(crate) async fn woken(&self) {
        self.wake.notified().await
    }
    /// The reader has stopped: it reads and admits nothing more.
    pub(crate) fn mark_stopped(&self) {
        self.stopped.store(true, Ordering::Release);
        self.stop.notify_waiters();
    }
    /// Wait until the reader has stopped, at most `limit`; `false` if it still runs.
    pub(crate) async fn stopped(&self, limit: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let n = self.stop.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.stopped.load(Ordering::Acquire) {
                return true;
            }
            if tokio::time::timeout_at(deadline, n).await.is_err() {
                return self.stopped.load(Ordering::Acquire);
            }
        }
    }
}

/// One connection as the session sees it.
#[derive(Debug, Clone)]
pub(crate) struct ConnInfo {
    pub cid: u16,
    pub peer: SocketAddr,
    pub local: SocketAddr,
    pub params: ConnParams,
    /// The socket, for TCP_INFO in the admin view. Valid while the connection is in the
    /// session's list: the connection removes itself before its socket is closed.
    pub fd: std::os::fd::RawFd,
    /// Counters of the reader side (relaxed atomics).
    pub stats: Arc<crate::counters::ConnStats>,
    /// Counters of the writer side.
    pub tx: Arc<crate::counters::TxStats>,
    /// When the login completed.
    pub since: std::time::SystemTime,
    /// Set to make the connection close.
    pub close: watch::Sender<Option<Close>>,
    pub signals: Arc<ConnSignals>,
}

impl ConnInfo {
    pub(crate) fn close(&self, why: Close) {
        let _ = self.close.send(Some(why));
    }
}

/// An iSCSI session.
#[derive(Debug)]
pub(crate) struct Session {
    pub tsih: Tsih,
    pub isid: Isid,
    pub initiator_name: String,
    /// `None` for discovery sessions.
    pub target: Option<Arc<LiveTarget>>,
    pub params: SessionParams,
    pub nexus: ironsan_scsi::Nexus,
    /// The byte shares of the session's connections ([`crate::iscsi::fair`]).
    pub shares: Arc<crate::iscsi::fair::Shares>,
    core: Mutex<Core>,
    /// (ExpCmdSN, MaxCmdSN), published after every change of the core.
    window: SnWindow,
    pub commands: AtomicU64,
    /// Bytes of write data buffered for this session's writes (the write quota).
    pub buffered_writes: Arc<AtomicU64>,
    /// Connections whose full-feature reader is running, and a wake-up when one stops.
    readers: AtomicUsize,
    reader_stopped: Notify,
    /// The zero of the protocol core's clock (milliseconds, for connection recovery).
    started: tokio::time::Instant,
    /// ErrorRecoveryLevel 2 with a DefaultTime2Retain: failed connections' tasks are kept.
    recovers: bool,
    /// What kept connections left for TASK REASSIGN ([`Orphans`]).
    orphans: Mutex<Orphans>,
    /// `orphans` is empty (read without its lock on every command).
    no_orphans: AtomicBool,
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        tsih: Tsih,
        isid: Isid,
        initiator_name: String,
        target: Option<Arc<LiveTarget>>,
        params: SessionParams,
        nexus: ironsan_scsi::Nexus,
        mut core: Core,
        fairness: bool,
    ) -> Self {
        // RFC 7143 §6.2.2: a failed connection's tasks wait DefaultTime2Wait, then up to
        // DefaultTime2Retain more, for reassignment (0: no reassignment).
        let recovers = params.error_recovery_level >= 2 && params.default_time2retain > 0;
        if recovers {
            core.set_retention(
                1000 * (u64::from(params.default_time2wait)
                    + u64::from(params.default_time2retain)),
            );
        }
        let s = Session {
            started: tokio::time::Instant::now(),
            recovers,
            orphans: Mutex::new(Orphans::default()),
            no_orphans: AtomicBool::new(true),
            tsih,
            isid,
            initiator_name,
            target,
            params,
            nexus,
            shares: Arc::new(crate::iscsi::fair::Shares::new(fairness)),
            window: SnWindow::default(),
            core: Mutex::new(core),
            commands: AtomicU64::new(0),
            buffered_writes: Arc::default(),
            readers: AtomicUsize::new(0),
            reader_stopped: Notify::new(),
        };
        s.with_core(|_| ());
        s
    }

    /// Run `f` on the protocol core under its lock, then publish ExpCmdSN/MaxCmdSN. `f` must
    /// not wait for anything.
    pub(crate) fn with_core<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        let mut core = lock(&self.core);
        let r = f(&mut core);
        self.window.set(core.window_sn());
        r
    }

    /// The protocol core's clock: milliseconds since the session began.
    pub(crate) fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The instant a time of the core's clock stands for.
    pub(crate) fn instant_at(&self, ms: u64) -> tokio::time::Instant {
        self.started + std::time::Duration::from_millis(ms)
    }

    /// Failed connections' tasks are kept for reassignment (ErrorRecoveryLevel 2).
    pub(crate) fn recovers(&self) -> bool {
        self.recovers
    }

    /// Run `f` on what kept connections left (ErrorRecoveryLevel 2).
    pub(crate) fn orphans<R>(&self, f: impl FnOnce(&mut Orphans) -> R) -> R {
        let mut o = lock(&self.orphans);
        let r = f(&mut o);
        self.no_orphans.store(o.is_empty(), Ordering::Release);
        r
    }

    /// A response of connection `id` that could not be queued (its writer had stopped): kept
    /// for a TASK REASSIGN when the session recovers connections, else dropped.
    pub(crate) fn park(&self, id: ConnId, out: crate::iscsi::writer::Out) {
        if self.recovers {
            let ready = self.orphans(|o| o.park(id, out));
            send_forwards(ready);
        }
    }

    /// The writer of the kept connection `id` has stopped: what it stamped for tasks
    /// reassigned meanwhile goes to their new connections.
    pub(crate) fn writer_stopped(&self, id: ConnId) {
        if self.recovers {
            let ready = self.orphans(|o| o.resolve(id));
            send_forwards(ready);
        }
    }

    /// A command with the tag `itt` was admitted: what kept connections hold for an earlier
    /// task with that tag is stale ([`Orphans::tag_reused`]). One atomic load
    /// while nothing is kept.
    pub(crate) fn tag_reused(&self, itt: Itt) {
        if !self.no_orphans.load(Ordering::Acquire) {
            self.orphans(|o| o.tag_reused(itt));
        }
    }

    /// Terminate what kept connections left past their time (RFC 7143 §6.2.2). Returns how
    /// many tasks ended that way, and whether the session ended (no connection left).
    pub(crate) fn expire(&self) -> (usize, bool) {
        let e = self.with_core(|c| c.expire(self.now_ms()));
        self.orphans(|o| o.forget(&e.conns));
        let n = e.terminated.len();
        if e.session_ended.is_some() {
            self.orphans(|o| o.clear());
            self.abort_tasks(e.terminated);
            (n, true)
        } else {
            self.terminated_by_iscsi_event(e.terminated);
            (n, false)
        }
    }

    /// (ExpCmdSN, MaxCmdSN) to stamp on outgoing PDUs, the same on every connection.
    pub(crate) fn window_sn(&self) -> (CmdSn, CmdSn) {
        self.window.get()
    }

    /// The window word the writers of this session's connections stamp from.
    pub(crate) fn sn_window(&self) -> SnWindow {
        self.window.clone()
    }

    /// Add a logged-in connection (see [`Core::join`]). On a connection reinstatement the old
    /// connection is told to close and its tasks are aborted here; the caller waits for its
    /// reader to stop ([`ConnSignals::stopped`]) before answering the login.
    pub(crate) fn join(
        &self,
        cid: Cid,
        info: ConnInfo,
    ) -> Result<(ConnId, Option<ConnInfo>), LoginStatus> {
        let now = self.now_ms();
        let Joined { id, replaced } = self.with_core(|c| c.join(cid, info, now))?;
        let replaced = replaced.map(|(slot, terminated)| {
            // At ErrorRecoveryLevel 2 the old connection's tasks wait for reassignment.
            slot.payload.close(if self.recovers {
                Close::ForRecovery
            } else {
                Close::ByTarget
            });
            self.terminated_by_iscsi_event(terminated);
            slot.payload
        });
        Ok((id, replaced))
    }

    /// The connection `id` has stopped reading; `failed` unless it ended by a logout or was
    /// closed by the target. Returns `true` when the session ended with it: every task is then
    /// aborted and the other connections are told to close.
    /// At ErrorRecoveryLevel 2 a failed connection's tasks are kept instead (see
    /// [`Core::leave_for_recovery`]).
    pub(crate) fn leave(&self, id: ConnId, failed: bool) -> bool {
        let now = self.now_ms();
        let left = self.with_core(|c| {
            if failed && self.recovers {
                c.leave_for_recovery(id, now)
            } else {
                c.leave(id, failed)
            }
        });
        match left.session_ended {
            Some(others) => {
                for c in &others {
                    c.payload.close(Close::ByTarget);
                }
                self.orphans(|o| o.clear());
                self.abort_tasks(left.terminated);
                true
            }
            // Kept for reassignment: only commands held ahead of a CmdSN gap went, never
            // delivered, to be retried by the initiator (no unit attention for them).
            None if failed && self.recovers => {
                self.abort_tasks(left.terminated);
                false
            }
            None => {
                self.terminated_by_iscsi_event(left.terminated);
                false
            }
        }
    }

    /// Tasks of a connection that went away while the session goes on: aborted, and each LU
    /// they were on raises SOME COMMANDS CLEARED BY ISCSI PROTOCOL EVENT for this nexus (RFC
    /// 7143 §11.14.5).
    pub(crate) fn terminated_by_iscsi_event(&self, tasks: Terminated<Running>) {
        let mut luns: Vec<u64> = tasks.iter().map(|(_, t)| t.lun).collect();
        luns.sort_unstable();
        luns.dedup();
        self.abort_tasks(tasks);
        if let Some(scsi) = self.target.as_ref().map(|t| t.scsi()) {
            for lun in luns {
                if let Some(lu) = scsi.lun(lun) {
                    lu.establish_unit_attention_on(
                        &self.nexus,
                        UnitAttention::CommandsClearedByIscsiEvent,
                    );
                }
            }
        }
    }

    /// End the session (reinstated or reset away): abort every task, admit and join nothing
    /// from now on. Returns how many tasks were aborted. The caller closes the connections.
    pub(crate) fn end(&self) -> usize {
        let tasks = self.with_core(|c| c.end());
        self.orphans(|o| o.clear());
        self.abort_tasks(tasks)
    }

    /// A connection's full-feature reader begins (it may admit commands until it stops).
    pub(crate) fn reader_started(&self) {
        self.readers.fetch_add(1, Ordering::SeqCst);
    }

    /// A connection's full-feature reader has stopped: it reads and admits nothing more.
    pub(crate) fn reader_stopped(&self) {
        self.readers.fetch_sub(1, Ordering::SeqCst);
        self.reader_stopped.notify_waiters();
    }

    /// Wait until no reader of this session runs (after [`Session::close_conns`]), at most
    /// `limit`; `false` if one still does.
    pub(crate) async fn readers_stopped(&self, limit: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.reader_stopped.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.readers.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.readers.load(Ordering::SeqCst) == 0;
            }
        }
    }

    /// Look at the connections under the session's lock (a connection cannot leave, and so
    /// cannot close its socket, while `f` runs).
    pub(crate) fn with_conns<R>(&self, f: impl FnOnce(&[ConnSlot<ConnInfo, HeldPdu>]) -> R) -> R {
        f(lock(&self.core).conns())
    }

    #[cfg(test)]
    pub(crate) fn conn_count(&self) -> usize {
        lock(&self.core).conns().len()
    }

    /// Ask every connection (or the one with `cid`) to close.
    pub(crate) fn close_conns(&self, cid: Option<u16>) {
        self.with_conns(|conns| {
            for c in conns {
                if cid.is_none_or(|id| id == c.cid.0) {
                    c.payload.close(Close::ByTarget);
                }
            }
        })
    }

    /// Abort the session's tasks that match `pred`; returns how many. With `tell` the
    /// initiator asked for it (its connections drop what they keep for the tasks); without,
    /// another initiator did.
    pub(crate) fn abort_where(
        &self,
        tell: bool,
        pred: impl FnMut(&Itt, &Task<Running>) -> bool,
    ) -> usize {
        let tasks = self.with_core(|c| c.abort_where(tell, pred));
        self.abort_tasks(tasks)
    }

    /// Abort tasks the core removed; returns how many.
    ///
    /// Each aborted task's LU is told before this returns, so before any task management
    /// response (`LogicalUnit::task_aborted`): `AbortHandle::abort` only schedules the drop of
    /// the task's future, and until it is dropped reads of that LU wait, so no read issued
    /// after the response can miss a write the aborted task leaves in the device
    /// (docs/INTEGRITY.md, "Reads and orphaned writes").
    pub(crate) fn abort_tasks(&self, tasks: Terminated<Running>) -> usize {
        if tasks.is_empty() {
            return 0;
        }
        let scsi = self.target.as_ref().map(|t| t.scsi());
        let n = tasks.len();
        for (_, t) in tasks {
            let r = t.payload;
            if let Some(slot) = &r.placed {
                // Released now, with nothing put after it.
                drop(slot.take());
            }
            let lu = scsi.as_ref().and_then(|s| s.lun(t.lun));
            match r.abort {
                Some(abort) => {
                    abort.abort();
                    if let Some(lu) = lu {
                        lu.task_aborted(move || abort.is_finished());
                    }
                }
                None => {
                    // Being polled inline right now (or already done with, or never started):
                    // reads wait until the reader is out of it.
                    let polling = r.polling;
                    if polling.load(Ordering::Acquire) {
                        if let Some(lu) = lu {
                            lu.task_aborted(move || !polling.load(Ordering::Acquire));
                        }
                    }
                }
            }
        }
        n
    }

    pub(crate) fn info(&self) -> SessionInfo {
        let (first, connections) = self.with_conns(|conns| {
            (
                conns.first().map(|c| c.payload.params).unwrap_or_default(),
                conns
                    .iter()
                    .map(|c| (c.cid.0, c.payload.peer, c.payload.local))
                    .collect::<Vec<_>>(),
            )
        });
        SessionInfo {
            tsih: self.tsih.0,
            isid: self.isid.to_string(),
            initiator_name: self.initiator_name.clone(),
            target_name: self.target.as_ref().map(|t| t.name.clone()),
            params: ironsan_proto::negotiate::describe(&self.params, &first)
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            connections,
            kept: self.kept(),
            commands: self.commands.load(Ordering::Relaxed),
        }
    }

    /// Connections kept for reassignment (ErrorRecoveryLevel 2): (CID, tasks still allegiant
    /// to it, milliseconds until they end).
    pub(crate) fn kept(&self) -> Vec<(u16, usize, u64)> {
        let now = self.now_ms();
        self.with_core(|c| {
            c.failed()
                .iter()
                .map(|f| {
                    let tasks = c.tasks().filter(|(_, t)| t.conn == f.id).count();
                    (f.cid.0, tasks, f.until.saturating_sub(now))
                })
                .collect()
        })
    }

    /// No connection is left in the session (its connections may be kept for reassignment).
    pub(crate) fn is_idle(&self) -> bool {
        lock(&self.core).conns().is_empty()
    }
}

/// What an admin (or a test) sees of a session.
#[derive(Debug, Clone)]
pub struct SessionInfo {
    pub tsih: u16,
    pub isid: String,
    pub initiator_name: String,
    pub target_name: Option<String>,
    pub params: Vec<(String, String)>,
    /// (CID, initiator address, portal address) per connection.
    pub connections: Vec<(u16, SocketAddr, SocketAddr)>,
    /// (CID, tasks, milliseconds left) per connection kept for reassignment.
    pub kept: Vec<(u16, usize, u64)>,
    pub commands: u64,
}

/// PREEMPT AND ABORT (SPC-4): the SCSI layer names the I_T nexuses whose tasks on the LUN
/// must be aborted; find their sessions and abort those tasks (no responses are sent for them).
pub(crate) fn abort_preempted(sessions: &Mutex<Registry>, target: &LiveTarget, lun: u64) {
    let Some(lu) = target.scsi().lun(lun).cloned() else {
        return;
    };
    let victims = lu.take_pr_aborts();
    if victims.is_empty() {
        return;
    }
    let sessions = lock(sessions).of_target(&target.name);
    for s in sessions {
        let hit = victims.iter().any(|(i, t)| {
            *i == s.nexus.initiator_port && ironsan_scsi::names_port(t, &s.nexus.target_port)
        });
        if hit {
            s.abort_where(false, |_, t| t.lun == lun);
        }
    }
}

/// All sessions of the server, by TSIH.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    by_tsih: HashMap<u16, Arc<Session>>,
}

impl Registry {
    pub(crate) fn len(&self) -> usize {
        self.by_tsih.len()
    }
    /// Every session, by TSIH.
    pub(crate) fn all(&self) -> Vec<Arc<Session>> {
        let mut v: Vec<_> = self.by_tsih.values().cloned().collect();
        v.sort_by_key(|s| s.tsih.0);
        v
    }
    pub(crate) fn get(&self, tsih: Tsih) -> Option<Arc<Session>> {
        self.by_tsih.get(&tsih.0).cloned()
    }
    pub(crate) fn insert(&mut self, s: Arc<Session>) {
        self.by_tsih.insert(s.tsih.0, s);
    }
    /// Remove the session if it is still the registered one for its TSIH.
    pub(crate) fn remove(&mut self, s: &Arc<Session>) {
        if self
            .by_tsih
            .get(&s.tsih.0)
            .is_some_and(|cur| Arc::ptr_eq(cur, s))
        {
            self.by_tsih.remove(&s.tsih.0);
        }
    }
    /// End a session the target takes away (reinstated, or a TARGET COLD RESET): its tasks
    /// are aborted, its connections told to close, it leaves the registry and its nexus is
    /// forgotten by the LUs (reservations, unit attentions).
    pub(crate) fn retire(&mut self, s: &Arc<Session>) {
        s.end();
        s.close_conns(None);
        self.ended(s);
    }
    /// A session that ended by itself (its last connection gone, or its connections kept for
    /// reassignment expired): it leaves the registry and its nexus is forgotten by the LUs.
    pub(crate) fn ended(&mut self, s: &Arc<Session>) {
        self.remove(s);
        if let Some(t) = &s.target {
            t.scsi().nexus_lost(s.nexus.id);
        }
    }
    /// The session with the same initiator name, ISID and target (RFC 7143 §6.3.5: a new
    /// leading login with TSIH 0 for an existing session reinstates it).
    pub(crate) fn find_same_nexus(
        &self,
        initiator: &str,
        isid: Isid,
        target: Option<&str>,
    ) -> Option<Arc<Session>> {
        self.by_tsih
            .values()
            .find(|s| {
                s.initiator_name == initiator
                    && s.isid == isid
                    && s.target.as_ref().map(|t| t.name.as_str()) == target
            })
            .cloned()
    }
    /// How many sessions `initiator` has.
    pub(crate) fn count_initiator(&self, initiator: &str) -> usize {
        self.by_tsih
            .values()
            .filter(|s| s.initiator_name == initiator)
            .count()
    }
    /// Every session logged in to `target`.
    pub(crate) fn of_target(&self, target: &str) -> Vec<Arc<Session>> {
        self.by_tsih
            .values()
            .filter(|s| s.target.as_ref().is_some_and(|t| t.name == target))
            .cloned()
            .collect()
    }
    pub(crate) fn info(&self) -> Vec<SessionInfo> {
        let mut v: Vec<_> = self.by_tsih.values().map(|s| s.info()).collect();
        v.sort_by_key(|s| s.tsih);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ironsan_proto::pdu::ScsiCommand;
    use ironsan_proto::session::Admission;

    fn session(max_connections: u16) -> Session {
        Session::new(
            Tsih(1),
            Isid([0x40, 0, 0, 0, 0, 1]),
            "iqn.2026-11.org.ironsan:test-initiator".into(),
            None,
            SessionParams::default(),
            ironsan_scsi::Nexus {
                id: 1,
                initiator_port: "iqn.2026-11.org.ironsan:test-initiator,i,0x400000000001".into(),
                target_port: "iqn.2026-11.org.ironsan:test,t,0x0001".into(),
                relative_port: 1,
            },
            Core::new(CmdSn(1), 8, max_connections, 0),
            true,
        )
    }

    /// A connection and the receiving end of its close signal.
    fn conn(cid: u16) -> (ConnInfo, watch::Receiver<Option<Close>>) {
        let any: SocketAddr = "127.0.0.1:3260".parse().expect("an address");
        let (close, rx) = watch::channel(None);
        let c = ConnInfo {
            cid,
            peer: any,
            local: any,
            params: ConnParams::default(),
            fd: -1,
            stats: Arc::default(),
            tx: Arc::default(),
            since: std::time::SystemTime::now(),
            close,
            signals: Arc::default(),
        };
        (c, rx)
    }

    fn admit(s: &Session, id: ConnId, itt: u32, cmd_sn: u32) -> Admission {
        let cmd = ScsiCommand {
            itt: Itt(itt),
            cmd_sn: CmdSn(cmd_sn),
            ..Default::default()
        };
        s.with_core(|c| {
            c.admit_command(id, &cmd, 0, || Running {
                abort: None,
                polling: Arc::default(),
                placed: None,
                parked: None,
            })
        })
    }

    /// A login that looked the session up before its last connection left must not join it
    /// after: the session has ended, its commands would be dropped unanswered. It is told
    /// SESSION DOES NOT EXIST instead (and the initiator logs in anew).
    #[test]
    fn no_connection_joins_a_session_after_its_last_one_left() {
        let s = session(2);
        let (id, _) = s.join(Cid(0), conn(0).0).unwrap();
        assert!(s.leave(id, false), "the last connection ends the session");
        assert_eq!(
            s.join(Cid(1), conn(1).0).unwrap_err(),
            LoginStatus::SESSION_DOES_NOT_EXIST
        );
        assert_eq!(s.conn_count(), 0);
        assert_eq!(admit(&s, id, 1, 1), Admission::Ended);
    }

    /// One that joined first keeps the session alive when the other connection leaves
    /// cleanly, and its commands are admitted.
    #[test]
    fn a_connection_that_joined_first_keeps_the_session() {
        let s = session(2);
        let (a, _) = s.join(Cid(0), conn(0).0).unwrap();
        let (b, _) = s.join(Cid(1), conn(1).0).unwrap();
        assert_eq!(
            s.join(Cid(2), conn(2).0).unwrap_err(),
            LoginStatus::TOO_MANY_CONNECTIONS
        );
        assert!(!s.leave(a, false));
        assert_eq!(admit(&s, b, 1, 1), Admission::Deliver);
        assert!(s.leave(b, false));
        assert_eq!(
            s.with_core(|c| c.tasks().count()),
            0,
            "the end aborts what was running"
        );
    }

    /// Below ErrorRecoveryLevel 2 a failed connection takes its session with it, and the other
    /// connections are told to close.
    #[test]
    fn a_failed_connection_ends_its_session_and_closes_the_others() {
        let s = session(2);
        let (a, _) = s.join(Cid(0), conn(0).0).unwrap();
        let (other, mut other_rx) = conn(1);
        s.join(Cid(1), other).unwrap();
        assert!(s.leave(a, true));
        assert_eq!(*other_rx.borrow_and_update(), Some(Close::ByTarget));
    }

    /// A second login with the same CID reinstates the connection: the old one is told to
    /// close, and the session keeps one connection.
    #[test]
    fn a_login_with_a_known_cid_replaces_that_connection() {
        let s = session(2);
        let (old, mut old_rx) = conn(0);
        let (old_id, _) = s.join(Cid(0), old).unwrap();
        let (new_id, replaced) = s.join(Cid(0), conn(0).0).unwrap();
        assert!(replaced.is_some());
        assert_eq!(*old_rx.borrow_and_update(), Some(Close::ByTarget));
        assert_eq!(s.conn_count(), 1);
        assert!(
            !s.leave(old_id, true),
            "the old connection's end is not the session's"
        );
        assert!(s.leave(new_id, false));
    }

    /// A reinstated (or reset) session refuses connections too, and admits nothing.
    #[test]
    fn an_ended_session_takes_no_connection() {
        let s = session(2);
        let (id, _) = s.join(Cid(0), conn(0).0).unwrap();
        s.end();
        assert_eq!(
            s.join(Cid(1), conn(1).0).unwrap_err(),
            LoginStatus::SESSION_DOES_NOT_EXIST
        );
        assert_eq!(admit(&s, id, 1, 1), Admission::Ended);
    }

    #[test]
    fn the_published_window_follows_the_core() {
        let s = session(1);
        let (id, _) = s.join(Cid(0), conn(0).0).unwrap();
        assert_eq!(s.window_sn(), (CmdSn(1), CmdSn(8)));
        admit(&s, id, 1, 1);
        assert_eq!(s.window_sn(), (CmdSn(2), CmdSn(8)));
        s.with_core(|c| c.remove(Itt(1)));
        assert_eq!(s.window_sn(), (CmdSn(2), CmdSn(9)));
    }
}
