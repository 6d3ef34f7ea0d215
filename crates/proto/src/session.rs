//! The session-wide half of the full-feature phase (RFC 7143 §3.2.2, §4.2.2, §6.3.4, §11.5,
//! §11.14), with no I/O: the CmdSN sequencer, the task table with each task's connection
//! allegiance, the connections of the session, and the rules of task management and logout.
//!
//! [`Session`] is driven by calls that say what arrived (a command, another PDU with a CmdSN,
//! a task management request, a logout, a login adding a connection, a connection gone) and
//! answer what to do; what a call makes due on a connection (a held command released, a task
//! dropped) waits in that connection's queue and is read with [`Session::poll_event`]. The
//! per-connection half (Data-Out reassembly, R2Ts, Text continuations) is
//! [`crate::connection::Connection`].
//!
//! ```text
//!  command on C ──admit_command──▶ ignore (outside the window) / Reject
//!                     │ in order                  │ ahead of a gap
//!                     ▼                           ▼
//!                 Delivered ◀──── released ─── Held ──(abort, C gone)──▶ CmdSN consumed
//!                     │  the task's PDUs stay on C (allegiance)
//!                     ▼
//!           removed: completed, aborted (TMF), or terminated (C gone, session ended)
//! ```
//!
//! # Connection recovery (ErrorRecoveryLevel 2, RFC 7143 §7.1.5, §7.2.2, §6.2.2)
//!
//! At level 2 a connection that fails, is logged out for recovery (reason 2) or is reinstated
//! does not take its tasks with it: [`Session::leave_for_recovery`] keeps every delivered task
//! allegiant to it for DefaultTime2Wait + DefaultTime2Retain on the caller's clock (plain
//! milliseconds: the core reads no clock), and the session lives on even with no connection
//! left. [`Session::reassign`] (TASK REASSIGN, §11.5.1) moves such a task to the connection
//! asking; [`Session::expire`] terminates what was not reassigned in time and ends a session
//! left with no connection. Commands held ahead of a CmdSN gap on the failed connection are
//! forgotten at once, their CmdSNs not received: reassigning finds no task, and the
//! initiator retries them with the same CmdSN (§6.2.1), as it does commands the target never
//! received.
//!
//! Generic over `T`, what the caller keeps per task (how to abort it, and the work of a held
//! command: the task record is the one place a held command lives), `C`, what it keeps per
//! connection (how to close or wake it), `P`, a non-task PDU held ahead of a gap (kept in the
//! window, in its CmdSN's place, and handed back in [`Event::DeliverPdu`]), and the hasher `S`
//! of the task table. A caller that
//! shares a session between threads puts it behind one lock; every call is short and none
//! waits for anything.

use crate::login::LoginStatus;
use crate::pdu::{
    Cid, Itt, LogoutReason, LogoutRequest, LogoutResponseCode, RejectReason, ScsiCommand,
    TaskMgmtRequest, TmfFunction, TmfResponseCode,
};
use crate::serial::CmdSn;
use crate::window::{CmdWindow, Ignored};
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;

/// One connection of a session, unique for the session's life (a reinstated connection keeps
/// its CID but gets a new `ConnId`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// Where a task is in the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskState {
    /// Arrived ahead of a CmdSN gap; not yet delivered to SCSI.
    Held,
    /// Delivered in CmdSN order (it may still wait for Data-Out on its connection).
    Delivered,
}

/// A SCSI task of the session.
#[derive(Debug)]
pub struct Task<T> {
    /// The connection it is allegiant to (RFC 7143 §3.2.2.? connection allegiance: every PDU
    /// of the task travels on it).
    pub conn: ConnId,
    /// The LUN number (`u64::MAX` for an address the target does not decode).
    pub lun: u64,
    pub cmd_sn: CmdSn,
    pub state: TaskState,
    pub payload: T,
}

/// What a connection must act on, read with [`Session::poll_event`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event<P = ()> {
    /// The held task with this ITT is delivered now: run it (or ask for its data). What the
    /// caller parked for it is in its task record.
    Deliver(Itt),
    /// The held non-task PDU with this CmdSN (a NOP-Out, Text, Logout or task management
    /// request) is due now: here it is.
    DeliverPdu(CmdSn, P),
    /// The task was aborted by the initiator's own request through another connection, or
    /// before it was delivered: drop whatever the connection keeps for it (its buffer, its
    /// outstanding R2Ts); no response is sent for it.
    Drop(Itt),
}

/// What the window holds for a command ahead of a gap.
#[derive(Debug)]
struct Held<P> {
    conn: ConnId,
    what: HeldKind<P>,
}

#[derive(Debug)]
enum HeldKind<P> {
    /// The task's record (and what the caller parked in it) is in the task table.
    Task(Itt),
    Pdu(CmdSn, P),
}

/// The answer to a SCSI Command PDU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Deliver it now (in CmdSN order).
    Deliver,
    /// It waits for a CmdSN gap to fill; its connection gets [`Event::Deliver`] then.
    Held,
    /// Silently ignore it (RFC 7143 §4.2.2.1): outside the command window or a duplicate.
    Ignore(Ignored),
    /// Reject the PDU with this reason (RFC 7143 §11.17.1). Its CmdSN is not considered
    /// received (§7.3): the initiator plugs the gap, by sending a command with that CmdSN or
    /// by aborting it.
    Reject(RejectReason),
    /// The session has ended: the command must never run (it is not answered).
    Ended,
}

/// The answer to a non-task PDU that carries a CmdSN (NOP-Out, Text, Logout, task
/// management).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PduAdmission<P = ()> {
    /// Act on it now: it is handed back.
    Now(P),
    /// The session keeps it: its connection gets it back in [`Event::DeliverPdu`] when the
    /// gap before it fills (or never, when the connection or the session goes first).
    Held,
    /// Silently ignore it.
    Ignore,
}

/// A connection of the session as the caller registered it.
#[derive(Debug)]
pub struct ConnSlot<C, P = ()> {
    pub id: ConnId,
    pub cid: Cid,
    pub payload: C,
    events: VecDeque<Event<P>>,
    /// Events were queued for it by another connection's call ([`Session::take_wakeups`]).
    wake: bool,
}

/// A task the session removed without completing it: the caller aborts it (no response).
pub type Terminated<T> = Vec<(Itt, Task<T>)>;

/// The outcome of [`Session::join`].
#[derive(Debug)]
pub struct Joined<T, C, P = ()> {
    pub id: ConnId,
    /// Connection reinstatement (RFC 7143 §6.3.4): the connection that had the CID before. It
    /// must be closed, and its reader stopped, before the new one is answered; its tasks are
    /// terminated below ErrorRecoveryLevel 2, and kept for reassignment at 2 (§6.2.2: the
    /// terminated list is then empty and the old connection is a [`Failed`] one).
    pub replaced: Option<(ConnSlot<C, P>, Terminated<T>)>,
}

/// A connection that failed, was logged out for recovery or was reinstated at
/// ErrorRecoveryLevel 2: its tasks stay allegiant to it until `until` (RFC 7143 §6.2.2,
/// DefaultTime2Wait + DefaultTime2Retain after it went), for a TASK REASSIGN to move them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failed {
    pub id: ConnId,
    pub cid: Cid,
    /// On the caller's clock (milliseconds).
    pub until: u64,
}

/// The answer to a TASK REASSIGN (RFC 7143 §11.5.1, function 8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reassign {
    /// ErrorRecoveryLevel below 2: response 4, task allegiance reassignment not supported.
    NotSupported,
    /// No task with that tag in the table: the caller looks for a response it still holds
    /// for it (completed while its connection was failing), else response 1, task does not
    /// exist.
    Unknown,
    /// Its connection is still in the session (not failed, not logged out): response 3,
    /// task still allegiant.
    StillAllegiant,
    /// Moved to the asking connection (response 0): it was allegiant to the failed
    /// connection `from`; resume it there (Data-In from the initiator's ExpDataSN, R2Ts for
    /// the data not received).
    Moved { from: ConnId },
}

/// The outcome of [`Session::expire`].
#[derive(Debug)]
pub struct Expired<T, C, P = ()> {
    /// Failed connections whose retention ended: the caller lets go of what it kept for them.
    pub conns: Vec<ConnId>,
    /// Their tasks, never reassigned: terminated.
    pub terminated: Terminated<T>,
    /// The session ended (no connection left): the other connections (none), to close.
    pub session_ended: Option<Vec<ConnSlot<C, P>>>,
}

/// The outcome of [`Session::leave`].
#[derive(Debug)]
pub struct Left<T, C, P = ()> {
    /// The connection's own tasks, terminated.
    pub terminated: Terminated<T>,
    /// The session ended: it was the last connection, or it failed below ErrorRecoveryLevel
    /// 2 (session recovery, RFC 7143 §7.1.5): these are the other connections, to close.
    pub session_ended: Option<Vec<ConnSlot<C, P>>>,
}

/// The reach of a task management function beyond this session's own tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TmfScope {
    /// Nothing beyond the aborted tasks returned.
    Session,
    /// CLEAR TASK SET, LOGICAL UNIT RESET: every session's tasks on this LU (SAM-5 §7).
    Lun(u64),
    /// TARGET WARM / COLD RESET: every task of the target; cold also ends the other sessions.
    Target { cold: bool },
}

/// The outcome of [`Session::task_management`].
#[derive(Debug)]
pub struct TmfOutcome<T> {
    pub response: TmfResponseCode,
    /// This session's tasks, removed: abort them (no response for them).
    pub aborted: Terminated<T>,
    /// What the caller still does beyond this session (only with `response` COMPLETE).
    pub scope: TmfScope,
}

/// What a Logout Request does (RFC 7143 §11.14).
#[derive(Debug)]
pub enum LogoutPlan<T, C, P = ()> {
    /// Reason 0: answer once this connection's running commands have completed, then close
    /// every connection; the session ends.
    CloseSession,
    /// Reason 1 naming the requesting connection: answer once its commands have completed,
    /// then close it.
    CloseConnection,
    /// Reason 1 naming another connection of the session: it is closed now (its reader must
    /// stop) and its tasks terminated; answer CLOSED.
    CloseOther {
        slot: ConnSlot<C, P>,
        terminated: Terminated<T>,
    },
    /// Reason 2 naming the requesting connection (ErrorRecoveryLevel 2): answer CLOSED, then
    /// close it as failed ([`Session::leave_for_recovery`]): its tasks wait for reassignment.
    RecoverSelf,
    /// Reason 2 naming another connection still in the session: close it (its reader must
    /// stop, then it leaves for recovery), then answer CLOSED.
    RecoverOther(ConnId),
    /// Answer with this code and close nothing.
    Respond(LogoutResponseCode),
}

/// The session-wide state of the full-feature phase. See the module docs.
#[derive(Debug)]
pub struct Session<T, C, P = (), S = std::hash::RandomState> {
    window: CmdWindow<Held<P>>,
    tasks: HashMap<Itt, Task<T>, S>,
    conns: Vec<ConnSlot<C, P>>,
    next_conn: u64,
    max_connections: u16,
    error_recovery_level: u8,
    ended: bool,
    /// Failed connections whose tasks are kept for reassignment (level 2).
    failed: Vec<Failed>,
    /// How long they are kept: DefaultTime2Wait + DefaultTime2Retain, in milliseconds.
    retain_ms: u64,
}

impl<T, C, P, S: BuildHasher + Default> Session<T, C, P, S> {
    /// A session whose leading login carried `exp_cmd_sn`, allowing `depth` commands in the
    /// target at once and `max_connections` connections (as negotiated).
    pub fn new(
        exp_cmd_sn: CmdSn,
        depth: u32,
        max_connections: u16,
        error_recovery_level: u8,
    ) -> Self {
        Session {
            window: CmdWindow::new(exp_cmd_sn, depth),
            tasks: HashMap::default(),
            conns: Vec::new(),
            next_conn: 1,
            max_connections: max_connections.max(1),
            error_recovery_level,
            ended: false,
            failed: Vec::new(),
            retain_ms: 0,
        }
    }

    /// How long a failed connection's tasks wait for reassignment at ErrorRecoveryLevel 2
    /// (RFC 7143 §6.2.2: DefaultTime2Wait + DefaultTime2Retain as negotiated), in the
    /// milliseconds of the caller's clock. 0 (the default, and DefaultTime2Retain=0)
    /// terminates them at once, as below level 2.
    pub fn set_retention(&mut self, ms: u64) {
        self.retain_ms = ms;
    }

    /// Connections kept for reassignment (level 2), with their deadlines.
    pub fn failed(&self) -> &[Failed] {
        &self.failed
    }

    /// When [`Session::expire`] next has something to do.
    pub fn next_expiry(&self) -> Option<u64> {
        self.failed.iter().map(|f| f.until).min()
    }

    fn recovers(&self) -> bool {
        self.error_recovery_level >= 2 && self.retain_ms > 0
    }

    /// (ExpCmdSN, MaxCmdSN), the same on every connection (RFC 7143 §4.2.2.1).
    pub fn window_sn(&self) -> (CmdSn, CmdSn) {
        (self.window.exp_cmd_sn(), self.window.max_cmd_sn())
    }

    /// Commands delivered and not yet completed.
    pub fn in_flight(&self) -> u32 {
        self.window.in_flight()
    }

    /// CmdSNs held ahead of a gap.
    pub fn held(&self) -> usize {
        self.window.held()
    }

    pub fn is_ended(&self) -> bool {
        self.ended
    }

    pub fn conns(&self) -> &[ConnSlot<C, P>] {
        &self.conns
    }

    pub fn conn(&self, id: ConnId) -> Option<&ConnSlot<C, P>> {
        self.conns.iter().find(|c| c.id == id)
    }

    pub fn tasks(&self) -> impl Iterator<Item = (&Itt, &Task<T>)> {
        self.tasks.iter()
    }

    pub fn task(&self, itt: Itt) -> Option<&Task<T>> {
        self.tasks.get(&itt)
    }

    pub fn task_mut(&mut self, itt: Itt) -> Option<&mut Task<T>> {
        self.tasks.get_mut(&itt)
    }

    // ------------------------------------------------------------------------------------
    // Connections
    // ------------------------------------------------------------------------------------

    /// Add a logged-in connection with `cid` (RFC 7143 §6.3: a login with the session's ISID
    /// and TSIH). An existing CID is a connection reinstatement (§6.3.4). Refused with
    /// SESSION DOES NOT EXIST (0x020A) once the session has ended, and TOO MANY CONNECTIONS
    /// (0x0206) beyond MaxConnections.
    pub fn join(&mut self, cid: Cid, payload: C, now: u64) -> Result<Joined<T, C, P>, LoginStatus> {
        if self.ended {
            return Err(LoginStatus::SESSION_DOES_NOT_EXIST);
        }
        let old = self.conns.iter().position(|c| c.cid == cid);
        if old.is_none() && self.conns.len() >= usize::from(self.max_connections) {
            return Err(LoginStatus::TOO_MANY_CONNECTIONS);
        }
        let replaced = old.map(|i| {
            let slot = self.conns.swap_remove(i);
            let terminated = if self.recovers() {
                self.keep_for_recovery(slot.id, slot.cid, now)
            } else {
                self.terminate_conn(slot.id)
            };
            (slot, terminated)
        });
        let id = ConnId(self.next_conn);
        self.next_conn += 1;
        self.conns.push(ConnSlot {
            id,
            cid,
            payload,
            events: VecDeque::new(),
            wake: false,
        });
        Ok(Joined { id, replaced })
    }

    /// The connection `id` is gone; `failed` when it ended without a logout (a reset, a
    /// protocol or digest error, a ping unanswered). Its tasks are terminated. The session
    /// ends with its last connection, and below ErrorRecoveryLevel 2 with any failed one:
    /// with no connection recovery (level 2), the initiator recovers the session as a whole
    /// (RFC 7143 §7.1.5: level 1 adds recovery within a connection to level 0's session
    /// recovery).
    pub fn leave(&mut self, id: ConnId, failed: bool) -> Left<T, C, P> {
        let was_member = match self.conns.iter().position(|c| c.id == id) {
            Some(i) => {
                self.conns.swap_remove(i);
                true
            }
            None => false,
        };
        // A connection kept for reassignment (reinstated at level 2) keeps its tasks when its
        // reader ends.
        let kept = !was_member && self.failed.iter().any(|f| f.id == id);
        let terminated = if kept {
            Vec::new()
        } else {
            self.terminate_conn(id)
        };
        let end = !self.ended
            && ((self.conns.is_empty() && self.failed.is_empty())
                || (was_member && failed && self.error_recovery_level < 2));
        let session_ended = end.then(|| {
            let others = std::mem::take(&mut self.conns);
            (others, self.end())
        });
        match session_ended {
            Some((others, mut rest)) => {
                let mut terminated = terminated;
                terminated.append(&mut rest);
                Left {
                    terminated,
                    session_ended: Some(others),
                }
            }
            None => Left {
                terminated,
                session_ended: None,
            },
        }
    }

    /// The connection `id` failed or was logged out for recovery at ErrorRecoveryLevel 2 (RFC
    /// 7143 §7.1.5, §6.2.2): its delivered tasks stay allegiant to it until `now` plus the
    /// retention ([`Session::set_retention`]), for [`Session::reassign`]; commands it held
    /// ahead of a CmdSN gap are terminated. The session goes on, even with no connection left,
    /// until [`Session::expire`]. Below level 2 (or with no retention) this is
    /// [`Session::leave`] with `failed`.
    pub fn leave_for_recovery(&mut self, id: ConnId, now: u64) -> Left<T, C, P> {
        if !self.recovers() || self.ended {
            return self.leave(id, true);
        }
        let Some(i) = self.conns.iter().position(|c| c.id == id) else {
            return self.leave(id, true);
        };
        let slot = self.conns.swap_remove(i);
        Left {
            terminated: self.keep_for_recovery(slot.id, slot.cid, now),
            session_ended: None,
        }
    }

    /// Keep `id`'s delivered tasks for reassignment; its held ones are terminated (returned)
    /// and their CmdSNs, like those of its held non-task PDUs, count as not received: a
    /// TASK REASSIGN finds no task, and the initiator sends the command again with the same
    /// CmdSN (RFC 7143 §6.2.1 retry).
    fn keep_for_recovery(&mut self, id: ConnId, cid: Cid, now: u64) -> Terminated<T> {
        self.window.unreceive_held_where(|h| h.conn == id);
        let held = self.remove_tasks_where(|_, t| t.conn == id && t.state == TaskState::Held);
        self.failed.push(Failed {
            id,
            cid,
            until: now.saturating_add(self.retain_ms),
        });
        held
    }

    /// Terminate the tasks of failed connections whose retention has ended by `now` (RFC 7143
    /// §6.2.2: not reassigned within DefaultTime2Retain); a session left with no connection
    /// and nothing retained ends.
    pub fn expire(&mut self, now: u64) -> Expired<T, C, P> {
        let (gone, kept): (Vec<Failed>, Vec<Failed>) =
            self.failed.iter().partition(|f| f.until <= now);
        self.failed = kept;
        let conns: Vec<ConnId> = gone.iter().map(|f| f.id).collect();
        let mut terminated = self.remove_tasks_where(|_, t| conns.contains(&t.conn));
        let end = !self.ended && self.conns.is_empty() && self.failed.is_empty();
        let session_ended = end.then(|| {
            terminated.append(&mut self.end());
            Vec::new()
        });
        Expired {
            conns,
            terminated,
            session_ended,
        }
    }

    /// TASK REASSIGN of the task `itt` to connection `conn` (RFC 7143 §11.5.1, §7.2.2): moved
    /// when it is allegiant to a failed connection.
    pub fn reassign(&mut self, conn: ConnId, itt: Itt) -> Reassign {
        if self.error_recovery_level < 2 {
            return Reassign::NotSupported;
        }
        let Some(t) = self.tasks.get_mut(&itt) else {
            return Reassign::Unknown;
        };
        let from = t.conn;
        if from == conn || self.conns.iter().any(|c| c.id == from) {
            return Reassign::StillAllegiant;
        }
        if !self.failed.iter().any(|f| f.id == from) {
            return Reassign::Unknown;
        }
        t.conn = conn;
        Reassign::Moved { from }
    }

    /// End the session (reinstated, reset away, or its connections gone): every task is
    /// removed and returned, and nothing is admitted or joined from now on.
    pub fn end(&mut self) -> Terminated<T> {
        self.ended = true;
        self.failed.clear();
        self.window.clear_held();
        for c in &mut self.conns {
            c.events.clear();
        }
        self.tasks.drain().collect()
    }

    /// Remove every task allegiant to `conn` (held ones leave their CmdSN consumed).
    fn terminate_conn(&mut self, conn: ConnId) -> Terminated<T> {
        self.window.drop_held_where(|h| h.conn == conn);
        self.remove_tasks_where(|_, t| t.conn == conn)
    }

    fn remove_tasks_where(
        &mut self,
        mut pred: impl FnMut(&Itt, &Task<T>) -> bool,
    ) -> Terminated<T> {
        let victims: Vec<Itt> = self
            .tasks
            .iter()
            .filter(|(i, t)| pred(i, t))
            .map(|(i, _)| *i)
            .collect();
        victims
            .into_iter()
            .filter_map(|i| self.remove(i).map(|t| (i, t)))
            .collect()
    }

    // ------------------------------------------------------------------------------------
    // Commands
    // ------------------------------------------------------------------------------------

    /// A SCSI Command PDU arrived on connection `conn` for LUN `lun`. The ITT must be unique
    /// among the session's tasks on every connection (RFC 7143 §11.2.1.8); the reserved ITT is
    /// refused. `payload` makes what the caller keeps for the task, called only when the task
    /// is entered (delivered or held).
    pub fn admit_command(
        &mut self,
        conn: ConnId,
        cmd: &ScsiCommand,
        lun: u64,
        payload: impl FnOnce() -> T,
    ) -> Admission {
        if self.ended {
            return Admission::Ended;
        }
        if cmd.itt == Itt::RESERVED {
            return Admission::Reject(RejectReason::INVALID_PDU_FIELD);
        }
        if !cmd.immediate {
            if let Err(e) = self.window.check(cmd.cmd_sn) {
                return Admission::Ignore(e);
            }
        }
        if self.tasks.contains_key(&cmd.itt) {
            return Admission::Reject(RejectReason::TASK_IN_PROGRESS);
        }
        let held = Held {
            conn,
            what: HeldKind::Task(cmd.itt),
        };
        let state = match self.window.admit(cmd.cmd_sn, cmd.immediate, held) {
            Err(e) => return Admission::Ignore(e),
            Ok(Some(_)) => TaskState::Delivered,
            Ok(None) => TaskState::Held,
        };
        self.tasks.insert(
            cmd.itt,
            Task {
                conn,
                lun,
                cmd_sn: cmd.cmd_sn,
                state,
                payload: payload(),
            },
        );
        match state {
            TaskState::Delivered => {
                self.release();
                Admission::Deliver
            }
            TaskState::Held => Admission::Held,
        }
    }

    /// A NOP-Out (with a task tag), Text, Logout or task management request with `cmd_sn`
    /// arrived on `conn`. Non-immediate ones take their place in CmdSN order like commands
    /// (RFC 7143 §3.2.2.1) but are never in flight.
    pub fn admit_pdu(
        &mut self,
        conn: ConnId,
        cmd_sn: CmdSn,
        immediate: bool,
        pdu: P,
    ) -> PduAdmission<P> {
        if self.ended {
            return PduAdmission::Ignore;
        }
        if immediate {
            return PduAdmission::Now(pdu);
        }
        let held = Held {
            conn,
            what: HeldKind::Pdu(cmd_sn, pdu),
        };
        match self.window.admit(cmd_sn, false, held) {
            Ok(Some(Held {
                what: HeldKind::Pdu(_, pdu),
                ..
            })) => {
                // It takes no slot: it is answered at once.
                self.window.complete();
                self.release();
                PduAdmission::Now(pdu)
            }
            // The window hands back what it was given: a PDU.
            Err(_) | Ok(Some(_)) => PduAdmission::Ignore,
            Ok(None) => PduAdmission::Held,
        }
    }

    /// Consume a CmdSN without a command (RFC 7143 §11.5.1's "consider the CmdSN
    /// received").
    fn consume(&mut self, cmd_sn: CmdSn, immediate: bool) -> Result<(), Ignored> {
        self.window.consume(cmd_sn, immediate)?;
        self.release();
        Ok(())
    }

    /// Move what the window released to its connections' queues.
    fn release(&mut self) {
        while let Some(h) = self.window.pop_released() {
            let event = match h.what {
                HeldKind::Task(itt) => match self.tasks.get_mut(&itt) {
                    Some(t) if t.state == TaskState::Held => {
                        t.state = TaskState::Delivered;
                        Event::Deliver(itt)
                    }
                    // Dropped while held: nothing to deliver, and not in flight.
                    _ => {
                        self.window.complete();
                        continue;
                    }
                },
                HeldKind::Pdu(sn, pdu) => {
                    self.window.complete();
                    Event::DeliverPdu(sn, pdu)
                }
            };
            self.push_event(h.conn, event);
        }
    }

    fn push_event(&mut self, conn: ConnId, event: Event<P>) {
        if let Some(c) = self.conns.iter_mut().find(|c| c.id == conn) {
            c.events.push_back(event);
            c.wake = true;
        }
    }

    /// The next thing due on connection `conn`, in the order it became due.
    pub fn poll_event(&mut self, conn: ConnId) -> Option<Event<P>> {
        let c = self.conns.iter_mut().find(|c| c.id == conn)?;
        let e = c.events.pop_front();
        if c.events.is_empty() {
            c.wake = false;
        }
        e
    }

    /// Connections that got events since they last polled, except `me` (the caller, which
    /// polls its own queue anyway): wake them. Each is reported once. Returns whether `me` has
    /// events waiting.
    pub fn take_wakeups(&mut self, me: ConnId, mut wake: impl FnMut(&C)) -> bool {
        let mut mine = false;
        for c in &mut self.conns {
            if c.id == me {
                mine = !c.events.is_empty();
            } else if c.wake {
                c.wake = false;
                wake(&c.payload);
            }
        }
        mine
    }

    /// The delivered task `itt`'s payload, to update when it starts running; `None` when it
    /// was removed (aborted, terminated) or the session ended, and then it must not run.
    pub fn claim(&mut self, itt: Itt) -> Option<&mut T> {
        if self.ended {
            return None;
        }
        match self.tasks.get_mut(&itt) {
            Some(t) if t.state == TaskState::Delivered => Some(&mut t.payload),
            _ => None,
        }
    }

    /// Remove a task that completed (or failed before it ran). Whoever removes the task owns
    /// its completion: `None` means a task management function or the session's end took it,
    /// and no response is sent. A delivered task's window slot opens again: the MaxCmdSN of
    /// its response already counts it as done.
    pub fn remove(&mut self, itt: Itt) -> Option<Task<T>> {
        let t = self.tasks.remove(&itt)?;
        if t.state == TaskState::Delivered {
            self.window.complete();
        }
        Some(t)
    }

    /// Remove the tasks that match `pred`: held ones leave their CmdSN consumed, and the
    /// connection of each gets [`Event::Drop`] when `tell` (the initiator of this session asked
    /// for the abort, so it expects no more of the task; an abort by another initiator is not
    /// known to this one, which may still send the task's data).
    pub fn abort_where(
        &mut self,
        tell: bool,
        mut pred: impl FnMut(&Itt, &Task<T>) -> bool,
    ) -> Terminated<T> {
        let out = self.remove_tasks_where(&mut pred);
        self.after_abort(&out, tell);
        out
    }

    fn after_abort(&mut self, aborted: &Terminated<T>, tell: bool) {
        let held: Vec<Itt> = aborted
            .iter()
            .filter(|(_, t)| t.state == TaskState::Held)
            .map(|(i, _)| *i)
            .collect();
        if !held.is_empty() {
            self.window
                .drop_held_where(|h| matches!(h.what, HeldKind::Task(i) if held.contains(&i)));
        }
        for (itt, t) in aborted {
            // A held task was never delivered: its connection must forget it in any case.
            if tell || t.state == TaskState::Held {
                self.push_event(t.conn, Event::Drop(*itt));
            }
        }
    }

    // ------------------------------------------------------------------------------------
    // Task management and logout
    // ------------------------------------------------------------------------------------

    /// A task management request from this session (RFC 7143 §11.5.1), after its CmdSN was
    /// admitted. `lun_exists`: the request's LUN names a logical unit of the target.
    pub fn task_management(&mut self, req: &TaskMgmtRequest, lun_exists: bool) -> TmfOutcome<T> {
        let lun = req.lun.number();
        let done = |response, aborted| TmfOutcome {
            response,
            aborted,
            scope: TmfScope::Session,
        };
        match req.function {
            TmfFunction::ABORT_TASK => {
                let rtt = req.referenced_task_tag;
                if rtt != Itt::RESERVED && self.tasks.contains_key(&rtt) {
                    let aborted = self.abort_where(true, |i, _| *i == rtt);
                    return done(TmfResponseCode::COMPLETE, aborted);
                }
                // §11.5.1: a referenced command that was never received, whose CmdSN is in the
                // window and before this request's, is considered received (it must not run if
                // it comes later) and counts as aborted. One already completed (below
                // ExpCmdSN) does not exist.
                let never_received = self.window.contains(req.ref_cmd_sn)
                    && req.ref_cmd_sn.lt(req.cmd_sn)
                    && self.consume(req.ref_cmd_sn, false).is_ok();
                let code = if never_received {
                    TmfResponseCode::COMPLETE
                } else {
                    TmfResponseCode::TASK_DOES_NOT_EXIST
                };
                done(code, Vec::new())
            }
            TmfFunction::ABORT_TASK_SET
            | TmfFunction::CLEAR_TASK_SET
            | TmfFunction::LOGICAL_UNIT_RESET => {
                let Some(lun) = lun.filter(|_| lun_exists) else {
                    return done(TmfResponseCode::LUN_DOES_NOT_EXIST, Vec::new());
                };
                let aborted = self.abort_where(true, |_, t| t.lun == lun);
                TmfOutcome {
                    response: TmfResponseCode::COMPLETE,
                    aborted,
                    scope: if req.function == TmfFunction::ABORT_TASK_SET {
                        TmfScope::Session
                    } else {
                        TmfScope::Lun(lun)
                    },
                }
            }
            TmfFunction::TARGET_WARM_RESET | TmfFunction::TARGET_COLD_RESET => TmfOutcome {
                response: TmfResponseCode::COMPLETE,
                aborted: self.abort_where(true, |_, _| true),
                scope: TmfScope::Target {
                    cold: req.function == TmfFunction::TARGET_COLD_RESET,
                },
            },
            TmfFunction::CLEAR_ACA => done(TmfResponseCode::NOT_SUPPORTED, Vec::new()),
            // §11.5.1: at ErrorRecoveryLevel below 2, reassignment is not supported; at 2 the
            // caller answers it with `Session::reassign`, which needs the asking connection.
            TmfFunction::TASK_REASSIGN => {
                done(TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED, Vec::new())
            }
            _ => done(TmfResponseCode::REJECTED, Vec::new()),
        }
    }

    /// A Logout Request on connection `conn`, after its CmdSN was admitted (RFC 7143 §11.14).
    pub fn logout(&mut self, conn: ConnId, req: &LogoutRequest) -> LogoutPlan<T, C, P> {
        match req.reason {
            LogoutReason::CLOSE_SESSION => {
                // Nothing waits for reassignment any more: the session ends with its last
                // connection, taking the failed connections' tasks with it.
                self.failed.clear();
                LogoutPlan::CloseSession
            }
            LogoutReason::CLOSE_CONNECTION => {
                let named = self.conns.iter().position(|c| c.cid == req.cid);
                match named {
                    None => LogoutPlan::Respond(LogoutResponseCode::CID_NOT_FOUND),
                    Some(i) if self.conns[i].id == conn => LogoutPlan::CloseConnection,
                    Some(i) => {
                        let slot = self.conns.swap_remove(i);
                        let terminated = self.terminate_conn(slot.id);
                        LogoutPlan::CloseOther { slot, terminated }
                    }
                }
            }
            // Reason 2: connection recovery needs ErrorRecoveryLevel 2 (§11.14.1).
            LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY if self.recovers() => {
                match self.conns.iter().find(|c| c.cid == req.cid) {
                    Some(c) if c.id == conn => LogoutPlan::RecoverSelf,
                    Some(c) => LogoutPlan::RecoverOther(c.id),
                    // Already failed (§11.14.1: the target has noticed it): closed.
                    None if self.failed.iter().any(|f| f.cid == req.cid) => {
                        LogoutPlan::Respond(LogoutResponseCode::CLOSED)
                    }
                    None => LogoutPlan::Respond(LogoutResponseCode::CID_NOT_FOUND),
                }
            }
            // Reason 2 below level 2, and reserved reasons.
            _ => LogoutPlan::Respond(LogoutResponseCode::RECOVERY_NOT_SUPPORTED),
        }
    }
}

#[cfg(test)]
mod tests;
