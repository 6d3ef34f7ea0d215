//! Sessions and the session registry (RFC 7143 §4.4, §6.3.5 session reinstatement).
//!
//! A session is shared by its connections: the CmdSN window and the table of running tasks
//! are session-wide; Data-Out reassembly is per connection (connection allegiance at
//! ErrorRecoveryLevel 0). Nothing here assumes one connection per session.

use crate::LiveTarget;
use ironsan_backend::IntMap;
use ironsan_proto::login::LoginStatus;
use ironsan_proto::negotiate::{ConnParams, SessionParams};
use ironsan_proto::pdu::{Isid, Itt, Tsih};
use ironsan_proto::window::CmdWindow;
use ironsan_proto::CmdSn;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::watch;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A command the SCSI layer is executing, for task management.
#[derive(Debug)]
pub struct Running {
    pub lun: u64,
    /// The command's task, if it has one (a command completing inline never has).
    pub abort: Option<tokio::task::AbortHandle>,
    /// While the command is polled inline by its connection's reader (before it has a task),
    /// this is set: an abort from another thread then waits for it (reads of the LU wait
    /// until the flag is clear, `LogicalUnit::task_aborted`).
    pub polling: Arc<std::sync::atomic::AtomicBool>,
    /// A write received in place while it waits for its Data-Out: aborting the task empties
    /// this, which releases the blocks' range at once (not when its connection next reads).
    pub placed: Option<Arc<PlacedSlot>>,
}

/// A write received in place ([`ironsan_scsi::PlacedWrite`], holding its blocks' range) while
/// it waits for its Data-Out. Its connection puts bytes through it (`io::PlaceTarget`), each
/// put under the slot's lock; an abort from any task empties it, which drops the write and
/// its range, and no byte is put after that.
#[derive(Debug)]
pub struct PlacedSlot {
    grain: usize,
    write: Mutex<Option<ironsan_scsi::PlacedWrite>>,
}

impl PlacedSlot {
    pub fn new(p: ironsan_scsi::PlacedWrite) -> Self {
        PlacedSlot {
            grain: p.target().grain(),
            write: Mutex::new(Some(p)),
        }
    }

    /// The write, unless an abort took it.
    pub fn take(&self) -> Option<ironsan_scsi::PlacedWrite> {
        lock(&self.write).take()
    }
}

impl crate::io::PlaceTarget for PlacedSlot {
    fn grain(&self) -> usize {
        self.grain
    }
    fn with<T>(
        &self,
        f: impl FnOnce(&ironsan_backend::InPlaceWrite) -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        match lock(&self.write).as_ref() {
            Some(p) => f(p.target()),
            None => Err(std::io::Error::other("the write was aborted")),
        }
    }
}

/// One connection as the session sees it.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub cid: u16,
    pub peer: SocketAddr,
    pub local: SocketAddr,
    pub params: ConnParams,
    /// The socket, for TCP_INFO in the admin view. Valid while the connection is in the
    /// session's list: the connection removes itself before its socket is closed.
    pub fd: std::os::fd::RawFd,
    /// Counters of the reader side (relaxed atomics).
    pub stats: Arc<crate::admin::ConnStats>,
    /// Counters of the writer side.
    pub tx: Arc<crate::writer::TxStats>,
    /// When the login completed.
    pub since: std::time::SystemTime,
    /// Set to true to make the connection close.
    pub close: watch::Sender<bool>,
}

/// An iSCSI session.
#[derive(Debug)]
pub struct Session {
    pub tsih: Tsih,
    pub isid: Isid,
    pub initiator_name: String,
    /// `None` for discovery sessions.
    pub target: Option<Arc<LiveTarget>>,
    pub params: SessionParams,
    pub nexus: ironsan_scsi::Nexus,
    window: Mutex<CmdWindow<()>>,
    running: Mutex<IntMap<Itt, Running>>,
    conns: Mutex<Vec<ConnInfo>>,
    pub commands: AtomicU64,
    /// Bytes of write data buffered for this session's writes (the write quota).
    pub buffered_writes: AtomicU64,
    /// Set by [`Session::end`] and [`Session::leave`] under the connection list's and the
    /// running table's locks; read by [`Session::admit`] under the latter (a command either
    /// entered the table before the end, and the end aborts it, or never starts) and by
    /// [`Session::join`] under the former.
    ended: AtomicBool,
    /// Connections whose full-feature reader is running, and a wake-up when one stops.
    readers: AtomicUsize,
    reader_stopped: tokio::sync::Notify,
}

impl Session {
    pub fn new(
        tsih: Tsih,
        isid: Isid,
        initiator_name: String,
        target: Option<Arc<LiveTarget>>,
        params: SessionParams,
        nexus: ironsan_scsi::Nexus,
        window: CmdWindow<()>,
    ) -> Self {
        Session {
            tsih,
            isid,
            initiator_name,
            target,
            params,
            nexus,
            window: Mutex::new(window),
            running: Mutex::new(IntMap::default()),
            conns: Mutex::new(Vec::new()),
            commands: AtomicU64::new(0),
            buffered_writes: AtomicU64::new(0),
            ended: AtomicBool::new(false),
            readers: AtomicUsize::new(0),
            reader_stopped: tokio::sync::Notify::new(),
        }
    }

    /// (ExpCmdSN, MaxCmdSN) to stamp on outgoing PDUs.
    pub fn window_sn(&self) -> (CmdSn, CmdSn) {
        let w = lock(&self.window);
        (w.exp_cmd_sn(), w.max_cmd_sn())
    }

    pub fn window(&self) -> MutexGuard<'_, CmdWindow<()>> {
        lock(&self.window)
    }

    pub fn running(&self) -> MutexGuard<'_, IntMap<Itt, Running>> {
        lock(&self.running)
    }

    /// Enter a command into the running table before it may start; `false` once the session
    /// has ended (the command must then not run: its initiator was told the session's tasks
    /// are gone, and a new session may already be writing the same blocks). With `claim`, the
    /// command is already there (a write that waited for its Data-Out) and only takes its
    /// entry over: `false` as well when a task management function removed it meanwhile,
    /// which aborted it.
    pub fn admit(&self, itt: Itt, r: Running, claim: bool) -> bool {
        let mut running = self.running();
        if self.ended.load(Ordering::Relaxed) || (claim && !running.contains_key(&itt)) {
            return false;
        }
        running.insert(itt, r);
        true
    }

    /// End the session (reinstated, reset away, or its last connection gone): abort every
    /// task, and admit none from now on. Returns how many were aborted.
    pub fn end(&self) -> usize {
        // A connection joins before this (and is closed with the others) or is refused.
        self.mark_ended(&lock(&self.conns));
        self.abort_where(|_, _| true)
    }

    /// Set `ended`; `_conns` is the connection list, locked by the caller (`join` looks under
    /// that lock), and the running table's lock is taken here (`admit` looks under it).
    fn mark_ended(&self, _conns: &[ConnInfo]) {
        let _running = self.running();
        self.ended.store(true, Ordering::Relaxed);
    }

    /// A connection's full-feature reader begins (it may admit commands until it stops).
    pub fn reader_started(&self) {
        self.readers.fetch_add(1, Ordering::SeqCst);
    }

    /// A connection's full-feature reader has stopped: it reads and admits nothing more.
    pub fn reader_stopped(&self) {
        self.readers.fetch_sub(1, Ordering::SeqCst);
        self.reader_stopped.notify_waiters();
    }

    /// Wait until no reader of this session runs (after [`Session::close_conns`]), at most
    /// `limit`; `false` if one still does.
    pub async fn readers_stopped(&self, limit: std::time::Duration) -> bool {
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

    /// Add a logged-in connection, unless the session has ended (its last connection left,
    /// or it was reinstated or reset away: SESSION DOES NOT EXIST, RFC 7143 §11.13.5) or has
    /// `max` connections already (TOO MANY CONNECTIONS). Atomic with [`Session::leave`] and
    /// [`Session::end`]: a connection never joins a session whose commands are no longer
    /// admitted, where they would go unanswered.
    pub fn join(&self, c: ConnInfo, max: usize) -> Result<(), LoginStatus> {
        let mut conns = lock(&self.conns);
        if self.ended.load(Ordering::Relaxed) {
            return Err(LoginStatus::SESSION_DOES_NOT_EXIST);
        }
        if conns.len() >= max {
            return Err(LoginStatus::TOO_MANY_CONNECTIONS);
        }
        conns.push(c);
        Ok(())
    }

    /// Remove the connection `cid` whose close signal `close` watches (only that one: a
    /// second login with the same CID does not lose its entry when the first leaves); when it
    /// was the last, the session ends (ErrorRecoveryLevel 0: every task is aborted and no
    /// connection can join any more) and `true` is returned.
    pub fn leave(&self, cid: u16, close: &watch::Receiver<bool>) -> bool {
        {
            let mut conns = lock(&self.conns);
            if let Some(i) = conns
                .iter()
                .position(|c| c.cid == cid && c.close.subscribe().same_channel(close))
            {
                conns.swap_remove(i);
            }
            if !conns.is_empty() {
                return false;
            }
            self.mark_ended(&conns);
        }
        self.abort_where(|_, _| true);
        true
    }

    /// Look at the connections under the session's lock (a connection cannot leave, and so
    /// cannot close its socket, while `f` runs).
    pub fn with_conns<R>(&self, f: impl FnOnce(&[ConnInfo]) -> R) -> R {
        f(&lock(&self.conns))
    }

    pub fn conn_count(&self) -> usize {
        lock(&self.conns).len()
    }

    /// Ask every connection (or the one with `cid`) to close.
    pub fn close_conns(&self, cid: Option<u16>) {
        for c in lock(&self.conns).iter() {
            if cid.is_none_or(|id| id == c.cid) {
                let _ = c.close.send(true);
            }
        }
    }

    /// Abort running tasks that match `pred`; returns how many.
    ///
    /// Each aborted task's LU is told before this returns, so before any task management
    /// response (`LogicalUnit::task_aborted`): `AbortHandle::abort` only schedules the drop of
    /// the task's future, and until it is dropped reads of that LU wait, so no read issued
    /// after the response can miss a write the aborted task leaves in the device
    /// (docs/INTEGRITY.md, "Reads and orphaned writes").
    pub fn abort_where(&self, pred: impl Fn(&Itt, &Running) -> bool) -> usize {
        // The LUN map first (its lock is never taken under the running table's).
        let scsi = self.target.as_ref().map(|t| t.scsi());
        let mut running = self.running();
        let victims: Vec<Itt> = running
            .iter()
            .filter(|(i, r)| pred(i, r))
            .map(|(i, _)| *i)
            .collect();
        for itt in &victims {
            let Some(r) = running.remove(itt) else {
                continue;
            };
            if let Some(slot) = &r.placed {
                // Released now, with nothing put after it.
                drop(slot.take());
            }
            let lu = scsi.as_ref().and_then(|s| s.lun(r.lun));
            match r.abort {
                Some(abort) => {
                    abort.abort();
                    if let Some(lu) = lu {
                        lu.task_aborted(move || abort.is_finished());
                    }
                }
                None => {
                    // Being polled inline right now (or already done with): reads wait
                    // until the reader is out of it.
                    let polling = r.polling;
                    if polling.load(std::sync::atomic::Ordering::Acquire) {
                        if let Some(lu) = lu {
                            lu.task_aborted(move || {
                                !polling.load(std::sync::atomic::Ordering::Acquire)
                            });
                        }
                    }
                }
            }
        }
        victims.len()
    }

    pub fn info(&self) -> SessionInfo {
        // One lock, released before the struct is built (a second `lock` in the same
        // expression would deadlock on the first one's temporary guard).
        let (first, connections) = {
            let conns = lock(&self.conns);
            (
                conns.first().map(|c| c.params).unwrap_or_default(),
                conns
                    .iter()
                    .map(|c| (c.cid, c.peer, c.local))
                    .collect::<Vec<_>>(),
            )
        };
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
            commands: self.commands.load(Ordering::Relaxed),
        }
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
    pub commands: u64,
}

/// All sessions of the server, by TSIH.
#[derive(Debug, Default)]
pub struct Registry {
    by_tsih: HashMap<u16, Arc<Session>>,
}

impl Registry {
    pub fn len(&self) -> usize {
        self.by_tsih.len()
    }
    /// Every session, by TSIH.
    pub fn all(&self) -> Vec<Arc<Session>> {
        let mut v: Vec<_> = self.by_tsih.values().cloned().collect();
        v.sort_by_key(|s| s.tsih.0);
        v
    }
    pub fn get(&self, tsih: Tsih) -> Option<Arc<Session>> {
        self.by_tsih.get(&tsih.0).cloned()
    }
    pub fn insert(&mut self, s: Arc<Session>) {
        self.by_tsih.insert(s.tsih.0, s);
    }
    /// Remove the session if it is still the registered one for its TSIH.
    pub fn remove(&mut self, s: &Arc<Session>) {
        if self
            .by_tsih
            .get(&s.tsih.0)
            .is_some_and(|cur| Arc::ptr_eq(cur, s))
        {
            self.by_tsih.remove(&s.tsih.0);
        }
    }
    /// The session with the same initiator name, ISID and target (RFC 7143 §6.3.5: a new
    /// leading login with TSIH 0 for an existing session reinstates it).
    pub fn find_same_nexus(
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
    pub fn count_initiator(&self, initiator: &str) -> usize {
        self.by_tsih
            .values()
            .filter(|s| s.initiator_name == initiator)
            .count()
    }
    /// Every session logged in to `target`.
    pub fn of_target(&self, target: &str) -> Vec<Arc<Session>> {
        self.by_tsih
            .values()
            .filter(|s| s.target.as_ref().is_some_and(|t| t.name == target))
            .cloned()
            .collect()
    }
    pub fn info(&self) -> Vec<SessionInfo> {
        let mut v: Vec<_> = self.by_tsih.values().map(|s| s.info()).collect();
        v.sort_by_key(|s| s.tsih);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session() -> Session {
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
            CmdWindow::new(CmdSn(1), 8),
        )
    }

    /// A connection and the receiving end of its close signal (what `leave` is given).
    fn conn(cid: u16) -> (ConnInfo, watch::Receiver<bool>) {
        let any: SocketAddr = "127.0.0.1:3260".parse().expect("an address");
        let (close, rx) = watch::channel(false);
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
        };
        (c, rx)
    }

    fn running() -> Running {
        Running {
            lun: 0,
            abort: None,
            polling: Arc::default(),
            placed: None,
        }
    }

    /// A login that looked the session up before its last connection left must not join it
    /// after: the session has ended, its commands would be dropped unanswered. It is told
    /// SESSION DOES NOT EXIST instead (and the initiator logs in anew).
    #[test]
    fn no_connection_joins_a_session_after_its_last_one_left() {
        let s = session();
        let (c0, rx0) = conn(0);
        assert_eq!(s.join(c0, 2), Ok(()));
        assert!(s.leave(0, &rx0), "the last connection ends the session");
        assert_eq!(
            s.join(conn(1).0, 2),
            Err(LoginStatus::SESSION_DOES_NOT_EXIST)
        );
        assert_eq!(s.conn_count(), 0);
        assert!(!s.admit(Itt(1), running(), false));
    }

    /// One that joined first keeps the session alive when the other connection leaves, and
    /// its commands are admitted.
    #[test]
    fn a_connection_that_joined_first_keeps_the_session() {
        let s = session();
        let ((c0, rx0), (c1, rx1)) = (conn(0), conn(1));
        assert_eq!(s.join(c0, 2), Ok(()));
        assert_eq!(s.join(c1, 2), Ok(()));
        assert_eq!(s.join(conn(2).0, 2), Err(LoginStatus::TOO_MANY_CONNECTIONS));
        assert!(!s.leave(0, &rx0));
        assert!(s.admit(Itt(1), running(), false));
        assert!(s.leave(1, &rx1));
        assert_eq!(s.running().len(), 0, "the end aborts what was running");
    }

    /// A second connection with the same CID (a connection reinstatement) keeps its entry, and
    /// the session, when the first one leaves.
    #[test]
    fn a_connection_leaving_removes_only_itself() {
        let s = session();
        let ((old, old_rx), (new, new_rx)) = (conn(0), conn(0));
        assert_eq!(s.join(old, 2), Ok(()));
        assert_eq!(s.join(new, 2), Ok(()));
        assert!(
            !s.leave(0, &old_rx),
            "the new connection's session ended with the old one"
        );
        assert_eq!(s.conn_count(), 1);
        assert!(s.leave(0, &new_rx));
    }

    /// A reinstated (or reset) session refuses connections too, and admits nothing.
    #[test]
    fn an_ended_session_takes_no_connection() {
        let s = session();
        assert_eq!(s.join(conn(0).0, 2), Ok(()));
        s.end();
        assert_eq!(
            s.join(conn(1).0, 2),
            Err(LoginStatus::SESSION_DOES_NOT_EXIST)
        );
        assert!(!s.admit(Itt(1), running(), false));
    }
}
