//! SCSI commands as they arrive (RFC 7143 §3.2.2, §11.3): admission in CmdSN order across the
//! session's connections, immediate data, and a write's Data-Out into its buffer or straight
//! into the medium. A command that arrives ahead of a CmdSN gap is held, with its data, until
//! the session delivers it.

use super::{reject, ConnResult, Connection};
use crate::iscsi::io;
use crate::iscsi::session::Session;
use crate::iscsi::task::{Held, PendingWrite, PlacedSlot, Running, Slot, WriteQuota};
use crate::metrics::Stamp;
use bytes::{Bytes, BytesMut};
use ironsan_proto::connection::{DataOutPlan, Next, Write};
use ironsan_proto::negotiate::ConnParams;
use ironsan_proto::pdu::*;
use ironsan_proto::session::Admission;
use ironsan_proto::task::{DataOutError, WriteParams};
use ironsan_proto::DataSn;
use ironsan_scsi::{Response, SenseReason};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The smallest write received in place: from 64 KiB (below that the data mostly arrives with
/// the command, already buffered), and only without a data digest, which must be checked
/// before a byte may reach the medium.
const PLACE_MIN: u32 = 64 * 1024;

/// Writes whose Data-Out is received in place ([`crate::ServerConfig::zero_copy_writes`]).
pub(super) fn place_min(on: bool, params: &ConnParams) -> Option<u32> {
    (on && !params.data_digest).then_some(PLACE_MIN)
}

/// The session's negotiated write parameters with this connection's MaxRecvDataSegmentLength.
pub(super) fn write_params(session: &Session, params: &ConnParams) -> WriteParams {
    let p = &session.params;
    WriteParams {
        initial_r2t: p.initial_r2t,
        immediate_data: p.immediate_data,
        first_burst_length: p.first_burst_length,
        max_burst_length: p.max_burst_length,
        max_outstanding_r2t: p.max_outstanding_r2t,
        max_recv_data_segment_length: params.max_recv_data_segment_length,
        recovery: p.error_recovery_level > 0,
    }
}

/// A write's data on its way to execution: in a buffer, or already in place in the medium.
pub(super) enum WriteData {
    Buffer(Bytes),
    Placed(ironsan_scsi::PlacedWrite),
}

/// Whether a write's data may be buffered ([`Connection::write_budget`]).
enum Budget {
    /// Not a write with data, or one whose buffer fits the session's quota (held here).
    Fits(Option<WriteQuota>),
    /// Longer than the largest I/O: refused.
    Oversize,
    /// The session's write buffer is spent: TASK SET FULL.
    Full,
}

/// A command's immediate data as received.
struct Immediate {
    len: u32,
    /// All of a write's data, a slice of the receive buffer.
    shared: Option<Bytes>,
    /// Or the immediate data in the command's own buffer.
    buf: BytesMut,
    /// The LU to receive the rest in place on.
    place_on: Option<Arc<ironsan_scsi::Target>>,
    digest_ok: bool,
}

/// What an arrived command does once it may (at once, or when delivered).
enum Start {
    Run(Bytes, DataSn),
    Fail(Response),
    AwaitData(ironsan_proto::task::WriteTransfer),
}

impl Connection {
    pub(super) async fn on_scsi_command(
        &mut self,
        rd: &mut io::RecvBuf<tokio::net::tcp::OwnedReadHalf>,
        bhs: &Bhs,
        ahs: Bytes,
        plan: &ReceivePlan,
        cmd: ScsiCommand,
        t_header: Stamp,
    ) -> ConnResult {
        let Some((cdb, delivered)) = self.admit(rd, bhs, &ahs, plan, &cmd).await? else {
            return Ok(());
        };
        self.session.commands.fetch_add(1, Ordering::Relaxed);
        let budget = self.write_budget(&cmd);
        let mut imm = self
            .receive_immediate(rd, plan, &cmd, &budget, delivered)
            .await?;
        let start = self.start(bhs, &cmd, &budget, &mut imm).await;
        let quota = match budget {
            Budget::Fits(q) => q,
            Budget::Oversize | Budget::Full => None,
        };
        self.begin(cmd, cdb, start, delivered, Slot::new(quota), imm, t_header);
        Ok(())
    }

    /// The command's intake and its place in CmdSN order across the session's connections
    /// (with ITT uniqueness): its CDB and whether it is delivered (`false`: held behind a gap),
    /// or `None` when it was rejected or ignored (its data skipped).
    async fn admit(
        &mut self,
        rd: &mut io::RecvBuf<tokio::net::tcp::OwnedReadHalf>,
        bhs: &Bhs,
        ahs: &Bytes,
        plan: &ReceivePlan,
        cmd: &ScsiCommand,
    ) -> Result<Option<(Bytes, bool)>, super::ConnError> {
        let immediate_len = plan.data_len as u32;
        let cdb = match self.intake.command(cmd, ahs, immediate_len) {
            Ok(c) => c,
            Err(reason) => {
                io::skip_data(rd, plan).await?;
                self.send(vec![reject(reason, bhs)]).await;
                return Ok(None);
            }
        };
        let lun = cmd.lun.number().unwrap_or(u64::MAX);
        let (id, idle) = (self.id, Arc::clone(&self.not_polling));
        let admission = self.sess(|c| {
            c.admit_command(id, cmd, lun, || Running {
                abort: None,
                polling: idle,
                placed: None,
                parked: None,
            })
        });
        if matches!(admission, Admission::Deliver | Admission::Held) {
            self.session.tag_reused(cmd.itt);
        }
        match admission {
            Admission::Deliver => Ok(Some((cdb, true))),
            Admission::Held => Ok(Some((cdb, false))),
            Admission::Ignore(why) => {
                tracing::debug!(
                    cmd_sn = cmd.cmd_sn.0,
                    ?why,
                    "command outside the CmdSN window ignored"
                );
                io::skip_data(rd, plan).await?;
                Ok(None)
            }
            Admission::Reject(reason) => {
                io::skip_data(rd, plan).await?;
                self.send(vec![reject(reason, bhs)]).await;
                Ok(None)
            }
            // The session has ended (reinstated or reset away): the command never runs.
            Admission::Ended => {
                io::skip_data(rd, plan).await?;
                Ok(None)
            }
        }
    }

    /// Whether a write's data may be buffered: the session's write buffer quota is taken
    /// before the buffer is allocated.
    fn write_budget(&self, cmd: &ScsiCommand) -> Budget {
        let edtl = cmd.expected_data_transfer_length;
        if !cmd.write || edtl == 0 {
            return Budget::Fits(None);
        }
        let cfg = &self.shared.cfg;
        if edtl > cfg.max_io_bytes {
            return Budget::Oversize;
        }
        let limit = cfg
            .limits
            .write_buffer_per_session
            .max(u64::from(cfg.max_io_bytes));
        match WriteQuota::try_new(&self.session.buffered_writes, u64::from(edtl), limit) {
            Some(q) => Budget::Fits(Some(q)),
            None => Budget::Full,
        }
    }

    /// Receive the command's immediate data (or skip it when the write is refused), and for
    /// a delivered write that may be received in place, the LU to place it on.
    async fn receive_immediate(
        &mut self,
        rd: &mut io::RecvBuf<tokio::net::tcp::OwnedReadHalf>,
        plan: &ReceivePlan,
        cmd: &ScsiCommand,
        budget: &Budget,
        delivered: bool,
    ) -> Result<Immediate, super::ConnError> {
        let edtl = cmd.expected_data_transfer_length;
        let immediate_len = plan.data_len as u32;
        let buffered = cmd.write && matches!(budget, Budget::Fits(_));
        // A write whose data all came as immediate data, already received, keeps it where it
        // lies: a slice of the receive buffer, not a copy in a buffer of its own.
        let shared = if buffered && immediate_len > 0 && immediate_len == edtl && cmd.final_bit {
            io::read_data_shared(rd, plan).await?
        } else {
            None
        };
        // A delivered write that may be received in place needs a buffer for its immediate
        // data only. A held one is buffered: nothing may reach the medium before it is
        // delivered.
        let lun = cmd.lun.number().unwrap_or(u64::MAX);
        let place_on = if delivered && buffered && self.place_min.is_some_and(|m| edtl >= m) {
            self.session
                .target
                .as_ref()
                .map(|t| t.scsi())
                .filter(|scsi| scsi.can_place_writes(lun))
        } else {
            None
        };
        let mut buf = if buffered && shared.is_none() {
            // Capacity only: data is appended as it arrives (`io::read_data_at`).
            let cap = if place_on.is_some() {
                immediate_len
            } else {
                edtl
            };
            BytesMut::with_capacity(cap as usize)
        } else {
            BytesMut::new()
        };
        let digest_ok = if let Some((_, ok)) = &shared {
            *ok
        } else if immediate_len > 0 && buffered {
            io::read_data_at(rd, plan, &mut buf, 0).await?
        } else if immediate_len > 0 {
            io::skip_data(rd, plan).await?;
            true
        } else {
            true
        };
        Ok(Immediate {
            len: immediate_len,
            shared: shared.map(|(data, _)| data),
            buf,
            place_on,
            digest_ok,
        })
    }

    /// What the command does once it may: run, fail, or wait for its Data-Out (the write's
    /// transfer begun in the core).
    async fn start(
        &mut self,
        bhs: &Bhs,
        cmd: &ScsiCommand,
        budget: &Budget,
        imm: &mut Immediate,
    ) -> Start {
        let edtl = cmd.expected_data_transfer_length;
        let fail = Response::check_condition;
        // RFC 7143 §7.8: damaged immediate data is discarded and Rejected; the command fails
        // (its CmdSN was received), or at ErrorRecoveryLevel 1 asks for it again by R2T.
        if !imm.digest_ok {
            let r = self.digest_error(RejectReason::DATA_DIGEST_ERROR, bhs);
            self.send(vec![r]).await;
            imm.shared = None;
            imm.buf.clear();
        }
        let immediate_lost = !imm.digest_ok
            && self.intake.damaged_immediate(cmd)
                == ironsan_proto::intake::DamagedImmediate::AskAgain;
        if !imm.digest_ok && !immediate_lost {
            return Start::Fail(fail(SenseReason::ProtocolCrcError));
        }
        match budget {
            Budget::Oversize => {
                return Start::Fail(fail(SenseReason::InvalidFieldInCdb { byte: 0, bit: None }))
            }
            Budget::Full => {
                // SAM-5 §5.3: the session has other writes holding the buffer (a write alone
                // always fits the quota), so TASK SET FULL; the initiator retries later.
                tracing::debug!(
                    itt = cmd.itt.0,
                    edtl,
                    "write buffer quota exhausted: TASK SET FULL"
                );
                return Start::Fail(Response::status_only(ironsan_scsi::Status::TASK_SET_FULL));
            }
            Budget::Fits(_) => {}
        }
        if !cmd.write || edtl == 0 {
            return Start::Run(Bytes::new(), DataSn(0));
        }
        let begun = self
            .core
            .begin_write(edtl, imm.len, cmd.final_bit)
            .and_then(|mut t| {
                if immediate_lost {
                    t.lost_immediate(imm.len)?;
                    self.count_recovery(crate::counters::Recovery::R2t);
                }
                Ok(t)
            });
        match begun {
            Err(DataOutError::TooManyRecoveries | DataOutError::NoRecovery) => {
                Start::Fail(fail(SenseReason::ProtocolCrcError))
            }
            Err(_) => {
                self.send(vec![reject(RejectReason::PROTOCOL_ERROR, bhs)])
                    .await;
                Start::Fail(fail(SenseReason::DataPhaseError))
            }
            Ok(t) if t.is_complete() => {
                let data = match imm.shared.take() {
                    Some(data) => data,
                    None => {
                        imm.buf.resize(edtl as usize, 0);
                        std::mem::take(&mut imm.buf).freeze()
                    }
                };
                Start::Run(data, t.r2t_count())
            }
            Ok(t) => Start::AwaitData(t),
        }
    }

    /// Act on the start: run or fail now if delivered, park the work if held, or keep the
    /// write in the core until its Data-Out is in.
    #[allow(clippy::too_many_arguments)]
    fn begin(
        &mut self,
        cmd: ScsiCommand,
        cdb: Bytes,
        start: Start,
        delivered: bool,
        mut slot: Slot,
        imm: Immediate,
        t_header: Stamp,
    ) {
        let edtl = cmd.expected_data_transfer_length;
        match start {
            Start::Run(data, exp_data_sn) if delivered => {
                self.run_buffered(cmd, cdb, data, exp_data_sn, slot, t_header);
            }
            Start::Run(data, exp_data_sn) => self.park(Held::Run {
                cmd,
                cdb,
                data,
                exp_data_sn,
                slot,
                t_header,
            }),
            Start::Fail(resp) if delivered => {
                slot.deliver(&self.stats, &cmd);
                self.finish_waiting(cmd, resp, DataSn(0), slot);
            }
            Start::Fail(resp) => self.park(Held::Fail {
                cmd,
                resp,
                exp_data_sn: DataSn(0),
                slot,
            }),
            Start::AwaitData(transfer) => {
                let Immediate {
                    shared,
                    mut buf,
                    place_on,
                    ..
                } = imm;
                if let Some(data) = shared {
                    buf.extend_from_slice(&data);
                }
                let placed = place_on.and_then(|scsi| self.place(&scsi, &cmd, &cdb, &buf));
                if placed.is_some() {
                    buf = BytesMut::new();
                } else if buf.capacity() < edtl as usize {
                    buf.reserve(edtl as usize - buf.len());
                }
                if delivered {
                    slot.deliver(&self.stats, &cmd);
                }
                let (itt, lun) = (cmd.itt, cmd.lun);
                let pw = PendingWrite {
                    cmd,
                    cdb,
                    buf,
                    placed,
                    discard: false,
                    slot,
                    t_header,
                };
                self.core.insert_write(itt, lun, transfer, delivered, pw);
            }
        }
    }

    /// Begin a delivered write in place ([`crate::ServerConfig::zero_copy_writes`]): the SCSI
    /// layer checks it and takes its blocks' range now; its slot enters the task's entry, so
    /// an abort from now on empties it; then the immediate data goes in through the slot.
    /// `None`: the usual path (the SCSI layer declined, the task was aborted meanwhile, or the
    /// medium refused the immediate data).
    fn place(
        &mut self,
        scsi: &ironsan_scsi::Target,
        cmd: &ScsiCommand,
        cdb: &Bytes,
        immediate: &[u8],
    ) -> Option<(Arc<PlacedSlot>, io::Placement)> {
        let lun = cmd.lun.number()?;
        let edtl = cmd.expected_data_transfer_length;
        let p = scsi.place_write(lun, &self.session.nexus, cdb, edtl)?;
        let slot = Arc::new(PlacedSlot::new(p));
        let itt = cmd.itt;
        let entered = self.sess(|c| match c.task_mut(itt) {
            Some(t) => {
                t.payload.placed = Some(Arc::clone(&slot));
                true
            }
            None => false,
        });
        if !entered {
            // Aborted already: release the range; the write goes the usual way and is not run.
            drop(slot.take());
            return None;
        }
        let mut placement = io::Placement::default();
        match placement.put(&*slot, 0, immediate) {
            Ok(()) => Some((slot, placement)),
            Err(_) => {
                // The medium refused it (or an abort took the write): the usual path writes,
                // and reports, everything; an aborted write's claim fails there.
                drop(slot.take());
                None
            }
        }
    }

    /// Run a delivered write whose data is all in one buffer.
    fn run_buffered(
        &mut self,
        cmd: ScsiCommand,
        cdb: Bytes,
        data: Bytes,
        exp_data_sn: DataSn,
        mut slot: Slot,
        t_header: Stamp,
    ) {
        slot.deliver(&self.stats, &cmd);
        self.spawn_exec(
            cmd,
            cdb,
            WriteData::Buffer(data),
            exp_data_sn,
            slot,
            t_header,
        );
    }

    /// Keep a held command's work in its task record until the session delivers it. Parking
    /// after the admission said Held is safe even if another connection filled the gap
    /// meanwhile: the delivery then waits in this connection's queue, read after this.
    fn park(&mut self, h: Held) {
        let itt = h.itt();
        self.sess(|c| {
            if let Some(t) = c.task_mut(itt) {
                t.payload.parked = Some(h);
            }
        });
    }

    /// The session delivered the held task `itt` (a CmdSN gap before it filled).
    pub(super) fn deliver(&mut self, itt: Itt) {
        let parked = self.sess(|c| c.task_mut(itt).and_then(|t| t.payload.parked.take()));
        if let Some(h) = parked {
            match h {
                Held::Run {
                    cmd,
                    cdb,
                    data,
                    exp_data_sn,
                    slot,
                    t_header,
                } => self.run_buffered(cmd, cdb, data, exp_data_sn, slot, t_header),
                Held::Fail {
                    cmd,
                    resp,
                    exp_data_sn,
                    mut slot,
                } => {
                    slot.deliver(&self.stats, &cmd);
                    self.finish_waiting(cmd, resp, exp_data_sn, slot);
                }
            }
            return;
        }
        let stats = Arc::clone(&self.stats);
        if let Some(w) = self.core.write_mut(itt) {
            let pw = &mut w.payload;
            pw.slot.deliver(&stats, &pw.cmd);
        }
        if let Next::Complete(w) = self.core.deliver_write(itt) {
            self.write_complete(w);
        }
    }

    pub(super) async fn on_data_out(
        &mut self,
        rd: &mut io::RecvBuf<tokio::net::tcp::OwnedReadHalf>,
        bhs: &Bhs,
        plan: &ReceivePlan,
        d: DataOut,
    ) -> ConnResult {
        let len = plan.data_len as u32;
        let offset = match self.core.data_out(&d, len) {
            DataOutPlan::Accept { offset } => offset as usize,
            DataOutPlan::NoTask => {
                // Data-Out for no write of this connection (RFC 7143 §11.7, §4.2.5.1: a task's
                // data never comes on another connection): discard and Reject.
                io::skip_data(rd, plan).await?;
                self.send(vec![reject(RejectReason::INVALID_PDU_FIELD, bhs)])
                    .await;
                return Ok(());
            }
            DataOutPlan::Refused(e, w) => {
                io::skip_data(rd, plan).await?;
                tracing::debug!(itt = d.itt.0, "Data-Out refused: {e}");
                // A broken data sequence (not a gap or damaged data, which level 1 asks for
                // again) cannot be recovered: Reject the PDU and end the command with CHECK
                // CONDITION, so nothing is written.
                self.send(vec![reject(RejectReason::PROTOCOL_ERROR, bhs)])
                    .await;
                self.write_failed(w, SenseReason::DataPhaseError);
                return Ok(());
            }
        };
        let Some(w) = self.core.write_mut(d.itt) else {
            return Ok(());
        };
        let pw = &mut w.payload;
        if pw.discard {
            io::skip_data(rd, plan).await?;
        } else if let Some((slot, placement)) = &mut pw.placed {
            if let Err(e) = placement.receive(rd, plan, &**slot, offset).await? {
                let Some(placed) = pw.placed.take().and_then(|(slot, _)| slot.take()) else {
                    // A task management function aborted it (and emptied the slot; the rest
                    // of this segment was skipped): take the rest of its data and drop it.
                    pw.discard = true;
                    if let Next::Complete(w) = self.core.after_data(d.itt) {
                        self.write_complete(w);
                    }
                    return Ok(());
                };
                tracing::warn!(itt = d.itt.0, "Data-Out not received in place: {e}");
                let reason = placed.failed(&e);
                if let Some(w) = self.core.take(d.itt) {
                    self.write_failed(w, reason);
                }
                return Ok(());
            }
            self.shared
                .stats
                .zero_copy_write_bytes
                .fetch_add(u64::from(len), Ordering::Relaxed);
        } else if !io::read_data_at(rd, plan, &mut pw.buf, offset).await? {
            let r = self.digest_error(RejectReason::DATA_DIGEST_ERROR, bhs);
            self.send(vec![r]).await;
            // RFC 7143 §7.8: at ErrorRecoveryLevel 1 the range is asked for again by a
            // recovery R2T; at 0 (or past the recovery limit) the command fails.
            match self.core.data_damaged(d.itt, offset as u32, len) {
                Some((_, w)) => self.write_failed(w, SenseReason::ProtocolCrcError),
                None => {
                    self.count_recovery(crate::counters::Recovery::R2t);
                    if let Next::Complete(w) = self.core.after_data(d.itt) {
                        self.write_complete(w);
                    }
                }
            }
            return Ok(());
        }
        if let Next::Complete(w) = self.core.after_data(d.itt) {
            self.write_complete(w);
        }
        Ok(())
    }

    /// Every byte of a delivered write is in: run it.
    fn write_complete(&mut self, w: Write<PendingWrite>) {
        let exp_data_sn = w.r2t_count();
        let mut pw = w.payload;
        if pw.discard {
            // Aborted: its last data is in; it ends here, unanswered.
            return;
        }
        if let Some((slot, placement)) = pw.placed.take() {
            let Some(placed) = slot.take() else {
                // Aborted while it waited (its range is released already).
                return;
            };
            if placement.is_pending() {
                // Every byte arrived, so no block can be waiting for more: a bug if so.
                let resp = Response::check_condition(SenseReason::InternalTargetFailure);
                self.finish_waiting(pw.cmd, resp, exp_data_sn, pw.slot);
                return;
            }
            let data = WriteData::Placed(placed);
            self.spawn_exec(pw.cmd, pw.cdb, data, exp_data_sn, pw.slot, pw.t_header);
            return;
        }
        // Every byte arrived; a buffer filled out of order is as long as the transfer.
        pw.buf
            .resize(pw.cmd.expected_data_transfer_length as usize, 0);
        let data = WriteData::Buffer(pw.buf.freeze());
        self.spawn_exec(pw.cmd, pw.cdb, data, exp_data_sn, pw.slot, pw.t_header);
    }

    /// A write's data could not be taken: it ends with CHECK CONDITION, when it is delivered
    /// (at once if it is).
    fn write_failed(&mut self, w: Write<PendingWrite>, reason: SenseReason) {
        let exp_data_sn = w.r2t_count();
        let delivered = w.is_delivered();
        let pw = w.payload;
        let resp = Response::check_condition(reason);
        if delivered {
            self.finish_waiting(pw.cmd, resp, exp_data_sn, pw.slot);
        } else {
            self.park(Held::Fail {
                cmd: pw.cmd,
                resp,
                exp_data_sn,
                slot: pw.slot,
            });
        }
    }
}
