//! The test target: the protocol core's public pieces glued in the order the server's driver
//! (`crates/server/src/iscsi/conn/`) uses them, over a tiny in-memory disk. See the crate docs for
//! the driving order.

use crate::wire;
use bytes::Bytes;
use ironsan_proto::connection::{nop_in, Connection, DataOutPlan, Next, Write};
use ironsan_proto::intake::{logout_response, Intake, IntakeParams, Route};
use ironsan_proto::pdu::*;
use ironsan_proto::recovery::{self, Retained, Snacked, SNACK_DATA_R2T};
use ironsan_proto::session::{
    Admission, ConnId, Event, LogoutPlan, PduAdmission, Reassign, Session, Terminated,
};
use ironsan_proto::task::{response_pdus, Outcome, WriteParams, WriteTransfer};
use ironsan_proto::window::Ignored;
use ironsan_proto::{CmdSn, DataSn, StatSn};
use std::collections::hash_map::DefaultHasher;
use std::collections::BTreeMap;
use std::hash::BuildHasherDefault;

/// A fixed hasher: the core's tables iterate in the same order on every run.
pub(crate) type Fixed = BuildHasherDefault<DefaultHasher>;
/// The task record carries a held command's work (the one place it lives); a held non-task
/// PDU waits in the session's window.
type Core = Session<Option<Held>, (), HeldPdu, Fixed>;

/// A non-task PDU held ahead of a CmdSN gap.
type HeldPdu = (Bhs, Header, Bytes);
type ConnCore = Connection<PendingWrite, Fixed>;

pub(crate) const BLOCK: usize = 512;
pub(crate) const DISK_BYTES: usize = 1 << 20;
/// What the disk holds before any write: a pattern, so a read of the wrong bytes shows.
pub(crate) fn initial_byte(at: usize) -> u8 {
    (at / BLOCK) as u8 ^ (at as u8).wrapping_mul(7)
}

pub(crate) const GOOD: u8 = 0x00;
pub(crate) const CHECK_CONDITION: u8 = 0x02;

/// The session's negotiated parameters (RFC 7143 §13), as a login would have agreed them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    pub(crate) erl: u8,
    /// The target's MaxRecvDataSegmentLength (what a Data-Out or immediate data may carry).
    pub(crate) target_mrdsl: u32,
    /// The initiator's MaxRecvDataSegmentLength (what a Data-In may carry), per connection
    /// unless a login says otherwise.
    pub(crate) initiator_mrdsl: u32,
    pub(crate) max_burst: u32,
    pub(crate) first_burst: u32,
    pub(crate) immediate_data: bool,
    pub(crate) initial_r2t: bool,
    pub(crate) max_outstanding_r2t: u32,
    pub(crate) time2wait: u16,
    pub(crate) time2retain: u16,
    /// Commands in the target at once (MaxCmdSN = ExpCmdSN + depth - 1 - in flight).
    pub(crate) depth: u32,
    pub(crate) max_connections: u16,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            erl: 0,
            target_mrdsl: 8192,
            initiator_mrdsl: 8192,
            max_burst: 16384,
            first_burst: 8192,
            immediate_data: true,
            initial_r2t: false,
            max_outstanding_r2t: 1,
            time2wait: 2,
            time2retain: 20,
            depth: 32,
            max_connections: 4,
        }
    }
}

/// What the harness keeps for a write waiting for its Data-Out (the core tracks the
/// transfer).
#[derive(Debug)]
pub(crate) struct PendingWrite {
    cmd: ScsiCommand,
    buf: Vec<u8>,
}

/// A command held behind a CmdSN gap with its data, ready to run (or fail) when delivered.
#[derive(Debug)]
enum Held {
    Run {
        cmd: ScsiCommand,
        data: Vec<u8>,
        exp_data_sn: DataSn,
    },
    Fail {
        cmd: ScsiCommand,
        exp_data_sn: DataSn,
    },
}

/// A target PDU before the writer stamps it.
#[derive(Clone, Debug)]
pub(crate) struct OutPdu {
    header: Header,
    data: Bytes,
    mode: SnMode,
}

impl OutPdu {
    fn status(header: Header, data: Bytes) -> Self {
        OutPdu {
            header,
            data,
            mode: SnMode::Status,
        }
    }
    fn current(header: Header) -> Self {
        OutPdu {
            header,
            data: Bytes::new(),
            mode: SnMode::Current,
        }
    }
}

/// One connection of the session, target side.
#[derive(Debug)]
struct TConn {
    cid: Cid,
    intake: Intake,
    core: ConnCore,
    /// The writer's StatSN counter.
    stat_sn: StatSnCounter,
    /// ErrorRecoveryLevel 1 and above: what the writer stamped, for SNACKs.
    retained: Option<Retained<Fixed>>,
    /// The initiator's MaxRecvDataSegmentLength on this connection.
    max_xmit: u32,
}

/// What a connection kept for TASK REASSIGN left behind (the server's `conn::Orphans`).
#[derive(Debug, Default)]
struct Kept {
    cid: Option<Cid>,
    retained: Option<Retained<Fixed>>,
    /// Responses produced after it failed, never stamped, by task.
    parked: BTreeMap<u32, Vec<OutPdu>>,
    /// Delivered writes that were waiting for Data-Out.
    writes: Vec<Write<PendingWrite>>,
    /// Tasks reassigned while running: (new connection, ExpDataSN, its MaxRecvDataSegmentLength).
    waiting: BTreeMap<u32, (ConnId, DataSn, u32)>,
}

/// A command the core let run, not yet completed (the test chooses when).
#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) itt: Itt,
    /// The connection it started on (its response goes there, or is parked if it is gone).
    conn: ConnId,
    cmd: ScsiCommand,
    data: Vec<u8>,
    exp_data_sn: DataSn,
    max_xmit: u32,
}

/// What the SCSI layer answered.
struct ScsiResult {
    status: u8,
    sense: Option<Vec<u8>>,
    data_in: Vec<u8>,
    write_needed: Option<u32>,
}

/// The test target. Its fields that tests read are the observable effects: the disk, which
/// commands ran, which were ignored, aborted or expired.
#[derive(Debug)]
pub(crate) struct Target {
    pub(crate) params: Params,
    session: Core,
    conns: BTreeMap<ConnId, TConn>,
    kept: BTreeMap<ConnId, Kept>,
    pub(crate) disk: Vec<u8>,
    /// Commands running, oldest first.
    pub(crate) running: Vec<Running>,
    /// Every command that starts running is kept running until the test completes it.
    pub(crate) defer: bool,
    /// Commands executed against the disk, in order (a write lands when it executes).
    pub(crate) executed: Vec<Itt>,
    /// Commands silently ignored (RFC 7143 §4.2.2.1), with why.
    pub(crate) ignored: Vec<(Itt, Ignored)>,
    /// Tasks the core removed without a response: TMF aborts, connections gone.
    pub(crate) aborted: Vec<Itt>,
    /// Tasks terminated because nobody reassigned them in time (§6.2.2).
    pub(crate) expired: Vec<Itt>,
    pub(crate) session_ended: bool,
    now_ms: u64,
    /// The next data digest error: a Data-Out whose payload is to be treated as damaged.
    pub(crate) damage_next_data_out: bool,
    /// Encoded PDUs sent, by connection, in send order (the pair moves them onto links).
    pub(crate) outbox: Vec<(ConnId, Vec<u8>)>,
    /// Connections the target closed (logout, logout for recovery, reinstatement).
    pub(crate) closed: Vec<ConnId>,
}

fn carries_status(h: &Header) -> bool {
    match h {
        Header::ScsiResponse(_) => true,
        Header::DataIn(d) => d.status.is_some(),
        _ => false,
    }
}

/// A 16-bit big-endian CDB field.
fn be16(b: &[u8]) -> u32 {
    u32::from(u16::from_be_bytes([b[0], b[1]]))
}

impl Target {
    pub(crate) fn new(params: Params) -> Self {
        let mut session = Core::new(CmdSn(1), params.depth, params.max_connections, params.erl);
        if params.erl >= 2 && params.time2retain > 0 {
            // RFC 7143 §6.2.2: DefaultTime2Wait, then up to DefaultTime2Retain more.
            session.set_retention(
                1000 * (u64::from(params.time2wait) + u64::from(params.time2retain)),
            );
        }
        Target {
            params,
            session,
            conns: BTreeMap::new(),
            kept: BTreeMap::new(),
            disk: (0..DISK_BYTES).map(initial_byte).collect(),
            running: Vec::new(),
            defer: false,
            executed: Vec::new(),
            ignored: Vec::new(),
            aborted: Vec::new(),
            expired: Vec::new(),
            session_ended: false,
            now_ms: 0,
            damage_next_data_out: false,
            outbox: Vec::new(),
            closed: Vec::new(),
        }
    }

    fn recovers(&self) -> bool {
        self.params.erl >= 2 && self.params.time2retain > 0
    }

    /// (ExpCmdSN, MaxCmdSN) now.
    pub(crate) fn window(&self) -> (CmdSn, CmdSn) {
        self.session.window_sn()
    }

    pub(crate) fn has_task(&self, itt: Itt) -> bool {
        self.session.task(itt).is_some()
    }

    pub(crate) fn held(&self) -> usize {
        self.session.held()
    }

    /// Connections kept for reassignment.
    pub(crate) fn kept_conns(&self) -> usize {
        self.kept.len()
    }

    /// Data segment bytes and statuses connection `id` retains for SNACKs.
    pub(crate) fn retained(&self, id: ConnId) -> (usize, usize) {
        self.conns
            .get(&id)
            .and_then(|c| c.retained.as_ref())
            .map_or((0, 0), |r| (r.bytes(), r.statuses()))
    }

    pub(crate) fn next_expiry(&self) -> Option<u64> {
        self.session.next_expiry()
    }

    // ------------------------------------------------------------------------------------
    // Connections
    // ------------------------------------------------------------------------------------

    /// A connection logged in with `cid` (login itself is not driven: see the crate docs):
    /// joined to the session, its writer starting at `first_stat_sn`.
    pub(crate) fn join(
        &mut self,
        cid: u16,
        max_xmit: u32,
        first_stat_sn: StatSn,
    ) -> Result<ConnId, ironsan_proto::login::LoginStatus> {
        let joined = self.session.join(Cid(cid), (), self.now_ms)?;
        let p = self.params;
        let write_params = WriteParams {
            initial_r2t: p.initial_r2t,
            immediate_data: p.immediate_data,
            first_burst_length: p.first_burst,
            max_burst_length: p.max_burst,
            max_outstanding_r2t: p.max_outstanding_r2t,
            max_recv_data_segment_length: p.target_mrdsl,
            recovery: p.erl > 0,
        };
        let conn = TConn {
            cid: Cid(cid),
            intake: Intake::new(IntakeParams {
                cid: Cid(cid),
                error_recovery_level: p.erl,
                discovery: false,
            }),
            core: ConnCore::new(write_params, max_xmit, 16),
            stat_sn: StatSnCounter(first_stat_sn),
            retained: (p.erl > 0).then(|| Retained::new(16 << 20)),
            max_xmit,
        };
        self.conns.insert(joined.id, conn);
        if let Some((slot, terminated)) = joined.replaced {
            // Connection reinstatement (§6.3.4): the old connection closes; at level 2 as
            // failed, its tasks kept for reassignment.
            self.abort_tasks(terminated);
            let failed = self.recovers();
            self.teardown(slot.id, failed);
        }
        Ok(joined.id)
    }

    /// The connection `id` ends: `failed` (a reset, a cut, closed for recovery) or not (a
    /// logout). At level 2 a failed connection's delivered writes, retained PDUs and running
    /// commands are kept for TASK REASSIGN (the server's `conn::run` epilogue).
    pub(crate) fn teardown(&mut self, id: ConnId, failed: bool) {
        let Some(mut c) = self.conns.remove(&id) else {
            return;
        };
        let recover = failed && self.recovers();
        if recover {
            let writes = c.core.take_where(|w| w.is_delivered());
            let kept = self.kept.entry(id).or_default();
            kept.cid = Some(c.cid);
            kept.retained = c.retained.take();
            kept.writes.extend(writes);
        } else {
            // Its running commands are aborted with it.
            self.running.retain(|r| r.conn != id);
        }
        let _ = c.core.take_where(|_| true);
        let left = if recover {
            self.session.leave_for_recovery(id, self.now_ms)
        } else {
            self.session.leave(id, failed)
        };
        self.abort_tasks(left.terminated);
        if let Some(others) = left.session_ended {
            self.session_ended = true;
            self.kept.clear();
            self.running.clear();
            for o in others {
                if self.conns.remove(&o.id).is_some() {
                    self.closed.push(o.id);
                }
            }
        }
        self.closed.push(id);
    }

    /// The test's clock moved to `now_ms`: what nobody reassigned in time is terminated
    /// (§6.2.2, `Session::expire` at `next_expiry`).
    pub(crate) fn advance(&mut self, now_ms: u64) {
        self.now_ms = now_ms;
        if self.session.next_expiry().is_none_or(|t| t > now_ms) {
            return;
        }
        let e = self.session.expire(now_ms);
        for c in &e.conns {
            self.kept.remove(c);
        }
        for (itt, _) in &e.terminated {
            self.expired.push(*itt);
            self.running.retain(|r| r.itt != *itt);
        }
        if e.session_ended.is_some() {
            self.session_ended = true;
            self.kept.clear();
        }
    }

    fn abort_tasks(&mut self, tasks: Terminated<Option<Held>>) {
        for (itt, _) in tasks {
            self.running.retain(|r| r.itt != itt);
            self.aborted.push(itt);
        }
    }

    // ------------------------------------------------------------------------------------
    // Sending (the writer)
    // ------------------------------------------------------------------------------------

    /// Stamp and send: the A bit at level 1 and above, StatSN and the session's window, then
    /// recorded for SNACKs (the server's `writer::push`).
    fn send(&mut self, id: ConnId, pdus: Vec<OutPdu>) {
        let window = self.session.window_sn();
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        for mut p in pdus {
            let fresh = p.mode != SnMode::Resend;
            if fresh && c.retained.is_some() {
                recovery::mark_ack(&mut p.header);
            }
            c.stat_sn.stamp(&mut p.header, p.mode, Some(window));
            if let Some(r) = c.retained.as_mut().filter(|_| fresh) {
                r.record(&p.header, &p.data, p.mode == SnMode::Status);
            }
            self.outbox.push((id, wire::encode(&p.header, &p.data)));
        }
    }

    fn reject(&mut self, id: ConnId, reason: RejectReason, bhs: &Bhs) {
        let (h, data) = Reject::of(reason, bhs);
        self.send(id, vec![OutPdu::status(h, data)]);
    }

    // ------------------------------------------------------------------------------------
    // Receiving (the reader): `conn::Connection::on_pdu`
    // ------------------------------------------------------------------------------------

    /// One PDU read on connection `id`.
    pub(crate) fn receive(&mut self, id: ConnId, bytes: &[u8]) {
        let max = self.params.target_mrdsl;
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let (bhs, ahs, data) = wire::decode(bytes, max);
        // The ExpStatSN it acknowledges lets go of retained PDUs (§4.2.2.2).
        if let Some(sn) = c.intake.header(&bhs) {
            if let Some(r) = c.retained.as_mut() {
                r.ack(sn);
            }
        }
        let header = Header::decode(&bhs);
        match (c.intake.route(&header), header) {
            (Route::Command, Header::ScsiCommand(cmd)) => {
                self.on_scsi_command(id, &bhs, &ahs, cmd, data)
            }
            (Route::DataOut, Header::DataOut(d)) => self.on_data_out(id, &bhs, d, data),
            (Route::Reject(reason), _) => self.reject(id, reason, &bhs),
            (route, other) => self.on_other(id, &bhs, route, other, data),
        }
        self.drain_events();
    }

    /// Act on what the session made due on each connection, then send the R2Ts the
    /// connections' cores issued (`drain_events`, `keep_r2ts`).
    fn drain_events(&mut self) {
        loop {
            let mut any = false;
            let ids: Vec<ConnId> = self.conns.keys().copied().collect();
            for id in ids {
                while let Some(e) = self.session.poll_event(id) {
                    any = true;
                    match e {
                        Event::Deliver(itt) => self.deliver(id, itt),
                        Event::Drop(itt) => {
                            if let Some(c) = self.conns.get_mut(&id) {
                                let _ = c.core.take(itt);
                            }
                        }
                        Event::DeliverPdu(_, (bhs, h, data)) => {
                            self.on_other_now(id, &bhs, h, data);
                        }
                    }
                }
                self.send_r2ts(id);
            }
            if !any {
                break;
            }
        }
    }

    fn send_r2ts(&mut self, id: ConnId) {
        let mut r2ts = Vec::new();
        if let Some(c) = self.conns.get_mut(&id) {
            while let Some(r) = c.core.poll_r2t() {
                r2ts.push(OutPdu::current(Header::R2t(r)));
            }
        }
        if !r2ts.is_empty() {
            self.send(id, r2ts);
        }
    }

    /// `write::on_scsi_command`: faults of the PDU, admission in CmdSN order, immediate data,
    /// then run, hold, or wait for Data-Out.
    fn on_scsi_command(
        &mut self,
        id: ConnId,
        bhs: &Bhs,
        ahs: &[u8],
        cmd: ScsiCommand,
        data: Bytes,
    ) {
        let edtl = cmd.expected_data_transfer_length;
        let immediate_len = data.len() as u32;
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if let Err(reason) = c.intake.command(&cmd, ahs, immediate_len) {
            return self.reject(id, reason, bhs);
        }
        let lun = cmd.lun.number().unwrap_or(u64::MAX);
        let admission = self.session.admit_command(id, &cmd, lun, || None);
        if matches!(admission, Admission::Deliver | Admission::Held) {
            self.tag_reused(cmd.itt);
        }
        let delivered = match admission {
            Admission::Deliver => true,
            Admission::Held => false,
            Admission::Ignore(why) => return self.ignored.push((cmd.itt, why)),
            Admission::Reject(reason) => return self.reject(id, reason, bhs),
            Admission::Ended => return,
        };
        if !cmd.write || edtl == 0 {
            return self.start(id, cmd, Vec::new(), DataSn(0), delivered);
        }
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        match c.core.begin_write(edtl, immediate_len, cmd.final_bit) {
            Err(_) => {
                self.reject(id, RejectReason::PROTOCOL_ERROR, bhs);
                if delivered {
                    self.finish_failed(id, cmd, DataSn(0));
                } else {
                    let exp_data_sn = DataSn(0);
                    self.park(Held::Fail { cmd, exp_data_sn });
                }
            }
            Ok(t) if t.is_complete() => {
                let exp = t.r2t_count();
                self.start(id, cmd, data.to_vec(), exp, delivered);
            }
            Ok(t) => self.await_data(id, cmd, &data, t, delivered),
        }
    }

    fn await_data(
        &mut self,
        id: ConnId,
        cmd: ScsiCommand,
        immediate: &[u8],
        t: WriteTransfer,
        delivered: bool,
    ) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let mut buf = vec![0; cmd.expected_data_transfer_length as usize];
        buf[..immediate.len()].copy_from_slice(immediate);
        let (itt, lun) = (cmd.itt, cmd.lun);
        c.core
            .insert_write(itt, lun, t, delivered, PendingWrite { cmd, buf });
    }

    /// A command whose data is all here: run it if delivered, else hold it.
    fn start(
        &mut self,
        id: ConnId,
        cmd: ScsiCommand,
        data: Vec<u8>,
        exp_data_sn: DataSn,
        delivered: bool,
    ) {
        if delivered {
            return self.run(id, cmd, data, exp_data_sn);
        }
        self.park(Held::Run {
            cmd,
            data,
            exp_data_sn,
        });
    }

    /// Keep a held command's work in its task record until the session delivers it.
    fn park(&mut self, h: Held) {
        if let Some(t) = self.session.task_mut(h_itt(&h)) {
            t.payload = Some(h);
        }
    }

    /// `write::deliver`: the session delivered the held task `itt`.
    fn deliver(&mut self, id: ConnId, itt: Itt) {
        let parked = self.session.task_mut(itt).and_then(|t| t.payload.take());
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        match parked {
            Some(Held::Run {
                cmd,
                data,
                exp_data_sn,
            }) => self.run(id, cmd, data, exp_data_sn),
            Some(Held::Fail { cmd, exp_data_sn }) => self.finish_failed(id, cmd, exp_data_sn),
            None => {
                if let Next::Complete(w) = c.core.deliver_write(itt) {
                    self.write_complete(id, w);
                }
            }
        }
    }

    /// `exec::spawn_exec`: claim the task (an abort may have taken it), then run it now or
    /// keep it running until the test completes it.
    fn run(&mut self, id: ConnId, cmd: ScsiCommand, data: Vec<u8>, exp_data_sn: DataSn) {
        if self.session.claim(cmd.itt).is_none() {
            return;
        }
        let max_xmit = self.conns.get(&id).map_or(512, |c| c.max_xmit);
        let r = Running {
            itt: cmd.itt,
            conn: id,
            cmd,
            data,
            exp_data_sn,
            max_xmit,
        };
        if self.defer {
            self.running.push(r);
        } else {
            self.finish(r);
        }
    }

    /// Complete the running command `itt` (the SCSI layer is done with it). Returns whether
    /// it was running.
    pub(crate) fn complete(&mut self, itt: Itt) -> bool {
        let Some(i) = self.running.iter().position(|r| r.itt == itt) else {
            return false;
        };
        let r = self.running.remove(i);
        self.finish(r);
        self.drain_events();
        true
    }

    /// Whoever removes the task owns its completion (`Session::remove`): an aborted task
    /// sends nothing (and, in this harness, never reaches the disk).
    fn finish(&mut self, r: Running) {
        if self.session.remove(r.itt).is_none() {
            return;
        }
        let result = self.execute(&r.cmd, &r.data);
        let pdus = self.response(r.max_xmit, &r.cmd, result, r.exp_data_sn);
        self.respond(r.conn, r.itt, pdus);
    }

    /// A command that failed before it ran (`exec::finish_waiting`).
    fn finish_failed(&mut self, id: ConnId, cmd: ScsiCommand, exp_data_sn: DataSn) {
        if self.session.remove(cmd.itt).is_none() {
            return;
        }
        let result = ScsiResult {
            status: CHECK_CONDITION,
            // ABORTED COMMAND, DATA PHASE ERROR (4Bh/00h).
            sense: Some(vec![
                0x70, 0, 0x0b, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x4b, 0, 0, 0, 0, 0,
            ]),
            data_in: Vec::new(),
            write_needed: None,
        };
        let max_xmit = self.conns.get(&id).map_or(512, |c| c.max_xmit);
        let pdus = self.response(max_xmit, &cmd, result, exp_data_sn);
        self.respond(id, cmd.itt, pdus);
    }

    /// A response goes to the connection the command came on; if that one is gone but kept
    /// (level 2) it is parked there, and forwarded if its task was reassigned meanwhile.
    fn respond(&mut self, id: ConnId, itt: Itt, pdus: Vec<OutPdu>) {
        if self.conns.contains_key(&id) {
            return self.send(id, pdus);
        }
        if let Some(k) = self.kept.get_mut(&id) {
            k.parked.entry(itt.0).or_default().extend(pdus);
            self.resolve(id);
        }
    }

    /// The tiny SCSI layer: READ(10), WRITE(10), TEST UNIT READY.
    fn execute(&mut self, cmd: &ScsiCommand, data: &[u8]) -> ScsiResult {
        self.executed.push(cmd.itt);
        let cdb = &cmd.cdb;
        let check = |asc: u8| ScsiResult {
            status: CHECK_CONDITION,
            // ILLEGAL REQUEST with the ASC given.
            sense: Some(vec![
                0x70, 0, 0x05, 0, 0, 0, 0, 10, 0, 0, 0, 0, asc, 0, 0, 0, 0, 0,
            ]),
            data_in: Vec::new(),
            write_needed: None,
        };
        let range = || {
            let lba = u32::from_be_bytes([cdb[2], cdb[3], cdb[4], cdb[5]]) as usize;
            let blocks = be16(&cdb[7..9]) as usize;
            let (at, len) = (lba * BLOCK, blocks * BLOCK);
            (at + len <= DISK_BYTES).then_some((at, len))
        };
        match cdb[0] {
            0x00 => ScsiResult {
                status: GOOD,
                sense: None,
                data_in: Vec::new(),
                write_needed: None,
            },
            0x28 => match range() {
                Some((at, len)) => ScsiResult {
                    status: GOOD,
                    sense: None,
                    data_in: self.disk[at..at + len].to_vec(),
                    write_needed: None,
                },
                None => check(0x21),
            },
            0x2a => match range() {
                Some((at, len)) => {
                    let n = len.min(data.len());
                    self.disk[at..at + n].copy_from_slice(&data[..n]);
                    ScsiResult {
                        status: GOOD,
                        sense: None,
                        data_in: Vec::new(),
                        write_needed: Some(len as u32),
                    }
                }
                None => check(0x21),
            },
            _ => check(0x20),
        }
    }

    /// `exec::response`: the PDUs of a command's outcome (`task::response_pdus`).
    fn response(
        &self,
        max_xmit: u32,
        cmd: &ScsiCommand,
        r: ScsiResult,
        exp_data_sn: DataSn,
    ) -> Vec<OutPdu> {
        let outcome = Outcome {
            status: r.status,
            sense: r.sense.is_some(),
            produced: r.data_in.len() as u32,
            write_needed: r.write_needed,
            exp_data_sn,
        };
        let (send, pdus) = response_pdus(cmd, outcome, max_xmit, self.params.max_burst);
        let mut data = Bytes::from(r.data_in);
        data.truncate(send as usize);
        pdus.map(|p| {
            let segment = if p.data_len > 0 {
                data.split_to(p.data_len as usize)
            } else if matches!(p.header, Header::ScsiResponse(_)) {
                r.sense.as_deref().map(sense_segment).unwrap_or_default()
            } else {
                Bytes::new()
            };
            OutPdu {
                header: p.header,
                data: segment,
                mode: if p.status {
                    SnMode::Status
                } else {
                    SnMode::Current
                },
            }
        })
        .collect()
    }

    /// `write::on_data_out`.
    fn on_data_out(&mut self, id: ConnId, bhs: &Bhs, d: DataOut, data: Bytes) {
        let len = data.len() as u32;
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        match c.core.data_out(&d, len) {
            // §11.7: no write of this connection has the tag.
            DataOutPlan::NoTask => self.reject(id, RejectReason::INVALID_PDU_FIELD, bhs),
            DataOutPlan::Refused(_, w) => {
                self.reject(id, RejectReason::PROTOCOL_ERROR, bhs);
                self.write_failed(id, w);
            }
            DataOutPlan::Accept { offset } => {
                if std::mem::take(&mut self.damage_next_data_out) {
                    // A data digest error (§7.8): Reject, and at level 1 a recovery R2T.
                    self.reject(id, RejectReason::DATA_DIGEST_ERROR, bhs);
                    let Some(c) = self.conns.get_mut(&id) else {
                        return;
                    };
                    match c.core.data_damaged(d.itt, offset, len) {
                        Some((_, w)) => self.write_failed(id, w),
                        None => {
                            if let Next::Complete(w) = c.core.after_data(d.itt) {
                                self.write_complete(id, w);
                            }
                        }
                    }
                    return;
                }
                let Some(c) = self.conns.get_mut(&id) else {
                    return;
                };
                if let Some(w) = c.core.write_mut(d.itt) {
                    let at = offset as usize;
                    w.payload.buf[at..at + data.len()].copy_from_slice(&data);
                }
                if let Next::Complete(w) = c.core.after_data(d.itt) {
                    self.write_complete(id, w);
                }
            }
        }
    }

    fn write_complete(&mut self, id: ConnId, w: Write<PendingWrite>) {
        let exp = w.r2t_count();
        let pw = w.payload;
        self.run(id, pw.cmd, pw.buf, exp);
    }

    fn write_failed(&mut self, id: ConnId, w: Write<PendingWrite>) {
        let exp_data_sn = w.r2t_count();
        let delivered = w.is_delivered();
        let cmd = w.payload.cmd;
        if delivered {
            self.finish_failed(id, cmd, exp_data_sn);
        } else {
            self.park(Held::Fail { cmd, exp_data_sn });
        }
    }

    /// `conn::on_other`: a PDU with a CmdSN takes its place in CmdSN order.
    fn on_other(&mut self, id: ConnId, bhs: &Bhs, route: Route, header: Header, data: Bytes) {
        if let Route::Sequenced { cmd_sn, immediate } = route {
            match self
                .session
                .admit_pdu(id, cmd_sn, immediate, (*bhs, header, data))
            {
                PduAdmission::Now((bhs, header, data)) => self.on_other_now(id, &bhs, header, data),
                PduAdmission::Ignore | PduAdmission::Held => {}
            }
            return;
        }
        self.on_other_now(id, bhs, header, data);
    }

    fn on_other_now(&mut self, id: ConnId, bhs: &Bhs, header: Header, data: Bytes) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        match header {
            Header::NopOut(n) => {
                if let Some((h, echo)) = nop_in(&n, &data, c.max_xmit) {
                    self.send(id, vec![OutPdu::status(h, echo)]);
                }
            }
            Header::TaskMgmtRequest(t) => {
                if c.intake.reassigns(&t) {
                    self.on_reassign(id, t);
                } else {
                    self.on_task_management(id, t);
                }
            }
            Header::LogoutRequest(l) => self.on_logout(id, l),
            Header::SnackRequest(s) => self.on_snack(id, bhs, s),
            // Text is not modelled.
            _ => self.reject(id, RejectReason::COMMAND_NOT_SUPPORTED, bhs),
        }
    }

    /// `tmf::on_task_management` (one session, one LU: LUN 0).
    fn on_task_management(&mut self, id: ConnId, t: TaskMgmtRequest) {
        let lun_exists = t.lun.number() == Some(0);
        let out = self.session.task_management(&t, lun_exists);
        self.abort_tasks(out.aborted);
        let resp = Header::TaskMgmtResponse(TaskMgmtResponse {
            response: out.response,
            itt: t.itt,
            ..Default::default()
        });
        self.send(id, vec![OutPdu::status(resp, Bytes::new())]);
    }

    /// `reassign::on_reassign`: TASK REASSIGN at level 2.
    fn on_reassign(&mut self, id: ConnId, t: TaskMgmtRequest) {
        let itt = t.referenced_task_tag;
        let exp = t.exp_data_sn;
        let max_xmit = self.conns.get(&id).map_or(512, |c| c.max_xmit);
        let mut resume = Vec::new();
        let mut adopt = None;
        let mut forward = None;
        let code = match self.session.reassign(id, itt) {
            Reassign::NotSupported => TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED,
            Reassign::StillAllegiant => TmfResponseCode::TASK_STILL_ALLEGIANT,
            Reassign::Unknown => match self.take_output(None, itt, exp, max_xmit) {
                Some(p) => {
                    resume = p;
                    TmfResponseCode::COMPLETE
                }
                None => TmfResponseCode::TASK_DOES_NOT_EXIST,
            },
            Reassign::Moved { from } => {
                if let Some(w) = self.take_write(from, itt) {
                    adopt = Some(w);
                } else if let Some(p) = self.take_output(Some(from), itt, exp, max_xmit) {
                    resume = p;
                } else {
                    forward = Some(from);
                }
                TmfResponseCode::COMPLETE
            }
        };
        let resp = Header::TaskMgmtResponse(TaskMgmtResponse {
            response: code,
            itt: t.itt,
            ..Default::default()
        });
        self.send(id, vec![OutPdu::status(resp, Bytes::new())]);
        if let Some(w) = adopt {
            if let Some(c) = self.conns.get_mut(&id) {
                c.core.adopt_write(w);
            }
        }
        if !resume.is_empty() {
            self.send(id, resume);
        }
        if let Some(from) = forward {
            if let Some(k) = self.kept.get_mut(&from) {
                k.waiting.insert(itt.0, (id, exp, max_xmit));
            }
            self.resolve(from);
        }
    }

    fn take_write(&mut self, from: ConnId, itt: Itt) -> Option<Write<PendingWrite>> {
        let k = self.kept.get_mut(&from)?;
        let i = k.writes.iter().position(|w| w.itt == itt)?;
        Some(k.writes.swap_remove(i))
    }

    /// `Orphans::take_output`: a reassigned task's Data-In from `exp` and its status, fitted
    /// to the new connection's MaxRecvDataSegmentLength; `None` until its status is here.
    fn take_output(
        &mut self,
        from: Option<ConnId>,
        itt: Itt,
        exp: DataSn,
        max_xmit: u32,
    ) -> Option<Vec<OutPdu>> {
        let pdus = self.take_response(from, itt, exp)?;
        let fitted = recovery::refit_data_in(
            pdus,
            max_xmit as usize,
            |d: &Bytes| d.len(),
            |d, n| d.split_to(n),
        );
        Some(
            fitted
                .into_iter()
                .map(|(header, data)| OutPdu {
                    mode: if carries_status(&header) {
                        SnMode::Status
                    } else {
                        SnMode::Current
                    },
                    header,
                    data,
                })
                .collect(),
        )
    }

    fn take_response(
        &mut self,
        from: Option<ConnId>,
        itt: Itt,
        exp: DataSn,
    ) -> Option<Vec<(Header, Bytes)>> {
        let ids: Vec<ConnId> = self
            .kept
            .keys()
            .rev()
            .copied()
            .filter(|id| from.is_none_or(|f| f == *id))
            .collect();
        for id in ids {
            let k = self.kept.get_mut(&id)?;
            let done = k
                .parked
                .get(&itt.0)
                .is_some_and(|v| v.iter().any(|p| carries_status(&p.header)));
            if done {
                let pdus = k.parked.remove(&itt.0).unwrap_or_default();
                return Some(
                    pdus.into_iter()
                        .filter(|p| match &p.header {
                            Header::DataIn(d) => {
                                recovery::resent_on_reassign(d, exp, d.status.is_some())
                            }
                            _ => true,
                        })
                        .map(|p| (p.header, p.data))
                        .collect(),
                );
            }
            if let Some(v) = k.retained.as_mut().and_then(|r| r.reassign(itt, exp)) {
                return Some(v);
            }
        }
        None
    }

    /// `Orphans::resolve`: responses of tasks reassigned away from `kept` that are here now.
    fn resolve(&mut self, kept: ConnId) {
        let waiting: Vec<(u32, (ConnId, DataSn, u32))> = match self.kept.get(&kept) {
            Some(k) => k.waiting.iter().map(|(i, w)| (*i, *w)).collect(),
            None => return,
        };
        for (itt, (to, exp, max_xmit)) in waiting {
            if let Some(p) = self.take_output(Some(kept), Itt(itt), exp, max_xmit) {
                if let Some(k) = self.kept.get_mut(&kept) {
                    k.waiting.remove(&itt);
                }
                self.send(to, p);
            }
        }
    }

    /// `Orphans::tag_reused`: a new command with the tag; nothing kept for an earlier task
    /// with it may answer a TASK REASSIGN.
    fn tag_reused(&mut self, itt: Itt) {
        for k in self.kept.values_mut() {
            k.parked.remove(&itt.0);
            k.waiting.remove(&itt.0);
            if let Some(r) = k.retained.as_mut() {
                r.forget_task(itt);
            }
        }
    }

    /// `tmf::on_logout`.
    fn on_logout(&mut self, id: ConnId, l: LogoutRequest) {
        let plan = self.session.logout(id, &l);
        let mut code = LogoutResponseCode::CLOSED;
        // After the response: Some(failed).
        let mut close_self = None;
        match plan {
            LogoutPlan::RecoverSelf => close_self = Some(true),
            // Closed as failed (its reader stops first), its tasks kept.
            LogoutPlan::RecoverOther(other) => self.teardown(other, true),
            LogoutPlan::CloseSession => {
                // This connection's commands complete first.
                self.complete_conn(id);
                let others: Vec<ConnId> = self.conns.keys().copied().filter(|c| *c != id).collect();
                for o in others {
                    self.teardown(o, false);
                }
                close_self = Some(false);
            }
            LogoutPlan::CloseConnection => {
                self.complete_conn(id);
                close_self = Some(false);
            }
            LogoutPlan::CloseOther { slot, terminated } => {
                self.abort_tasks(terminated);
                // Already out of the session: it only stops.
                self.teardown(slot.id, false);
            }
            LogoutPlan::Respond(c) => code = c,
        }
        let own_cid = self.conns.get(&id).map(|c| c.cid);
        if l.reason == LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY && own_cid != Some(l.cid) {
            // §11.14: its ExpStatSN is the named connection's.
            self.acknowledge(l.cid, l.exp_stat_sn);
        }
        let p = self.params;
        let resp = logout_response(&l, code, p.time2wait, p.time2retain);
        self.send(
            id,
            vec![OutPdu::status(Header::LogoutResponse(resp), Bytes::new())],
        );
        if let Some(failed) = close_self {
            self.teardown(id, failed);
        }
    }

    /// Complete what connection `id` is running (a logout waits for its commands).
    fn complete_conn(&mut self, id: ConnId) {
        let itts: Vec<Itt> = self
            .running
            .iter()
            .filter(|r| r.conn == id)
            .map(|r| r.itt)
            .collect();
        for itt in itts {
            self.complete(itt);
        }
    }

    /// `Orphans::acknowledge`.
    fn acknowledge(&mut self, cid: Cid, exp_stat_sn: StatSn) {
        let latest = self
            .kept
            .values_mut()
            .rev()
            .find(|k| k.cid == Some(cid))
            .and_then(|k| k.retained.as_mut());
        if let Some(r) = latest {
            r.ack(exp_stat_sn);
        }
    }

    /// `recovery::on_snack`.
    fn on_snack(&mut self, id: ConnId, bhs: &Bhs, req: SnackRequest) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let max_xmit = c.max_xmit;
        let Some(kept) = c.retained.as_mut() else {
            // §11.16: no SNACK at ErrorRecoveryLevel 0.
            return self.reject(id, RejectReason::SNACK_REJECT, bhs);
        };
        kept.ack(req.exp_stat_sn);
        match kept.snack(&req, max_xmit) {
            Ok(Snacked::Resend(pdus)) => {
                let out = pdus
                    .into_iter()
                    .map(|p| OutPdu {
                        header: p.header,
                        data: p.data,
                        mode: SnMode::Resend,
                    })
                    .collect();
                self.send(id, out);
            }
            Ok(Snacked::DataAcked) => {}
            Ok(Snacked::NotRetained) if req.snack_type == SNACK_DATA_R2T => {
                match c.core.resend_r2ts(req.itt, req.beg_run, req.run_length) {
                    Some(r2ts) => {
                        let out = r2ts.into_iter().map(|r| OutPdu::current(Header::R2t(r)));
                        self.send(id, out.collect());
                    }
                    None => self.reject(id, RejectReason::PROTOCOL_ERROR, bhs),
                }
            }
            Ok(Snacked::NotRetained) => self.reject(id, RejectReason::PROTOCOL_ERROR, bhs),
            Err(e) => self.reject(id, e.reject_reason(), bhs),
        }
    }
}

fn h_itt(h: &Held) -> Itt {
    match h {
        Held::Run { cmd, .. } | Held::Fail { cmd, .. } => cmd.itt,
    }
}

/// How many times each tag appears (for "ran exactly once" checks).
pub(crate) fn counts(itts: &[Itt]) -> BTreeMap<u32, usize> {
    let mut m = BTreeMap::new();
    for i in itts {
        *m.entry(i.0).or_insert(0) += 1;
    }
    m
}
