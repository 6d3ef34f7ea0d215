//! What a connection keeps for ErrorRecoveryLevel 1 and above (RFC 7143 §11.16, §4.2.2.2):
//! the target PDUs an initiator may ask for again with a SNACK, until it acknowledges them.
//!
//! # What is kept
//!
//! [`Retained::record`] sees every target PDU of the connection, in send order, right after it
//! was stamped ([`crate::pdu::StatSnCounter::stamp`]), with its data segment (a cheap
//! [`Bytes`] clone). It keeps:
//!
//! * every Data-In PDU of a task, by DataSN (§4.2.2.3), for Data SNACK (§11.16.1 type 0) and
//!   R-Data SNACK (type 3);
//! * every PDU that took a StatSN (§4.2.2.2: SCSI Response, Data-In with the S bit, Task
//!   Management, Text, Logout and NOP-In responses, Reject), by StatSN, for Status SNACK
//!   (type 1). The caller says which PDUs took a StatSN (`took_stat_sn`); the store does not
//!   guess. A Data-In with the S bit is kept once, as data, and its status refers to it.
//!
//! R2Ts are not kept here: [`crate::task::WriteTransfer`] knows how to send one again.
//!
//! # What lets go of it
//!
//! * ExpStatSN, carried by every initiator PDU (§4.2.2.2), acknowledges every status below it
//!   ([`Retained::ack`]), and a SCSI status acknowledges its whole task: the Data-In of the
//!   task go with it.
//! * A DataACK SNACK (§11.16.2, type 2) acknowledges a task's Data-In below its BegRun (the
//!   next DataSN the initiator expects, §11.16.6). The Data-In carrying the status stays as
//!   long as the status does.
//! * A new command reusing the Initiator Task Tag of a task still retained (the initiator may
//!   reuse a tag once it has the task's status, §11.2.1.8) replaces it: the old task is
//!   dropped, its status with it (a Status SNACK for it is then refused).
//! * Bounds: at most `limit_bytes` of data segments and [`MAX_STATUSES`] statuses, and at most
//!   [`MAX_OPEN_TASKS`] tasks whose status has not been sent (an aborted task, which sends
//!   none, can be let go with [`Retained::forget`]). Over a bound, the oldest status
//!   is dropped with its whole task (statuses are dropped in StatSN order), and when no status
//!   is left, the oldest task still in progress; an initiator that never acknowledges does not
//!   grow memory. A task dropped while in progress stays dropped: its later Data-In are not
//!   kept. Anything dropped this way is refused to a later SNACK.
//!
//! # The A bit (RFC 7143 §11.7.2, §11.7.4, §11.16.5)
//!
//! At ErrorRecoveryLevel 1 or higher, [`mark_ack`] sets the A bit on every Data-In that ends a
//! sequence (F bit) and does not carry the status: the end of each burst but the last, which
//! is at most once every MaxBurstLength bytes as §11.7.2 allows, and the last Data-In of a read
//! whose status follows in a SCSI Response ("the last Data-In PDU that concludes the entire
//! requested read data transfer", also allowed). A Data-In carrying the status needs no
//! DataACK: acknowledging the status acknowledges the task.
//!
//! With the A bit, the Target Transfer Tag must be provided (§11.7.4) and the initiator copies
//! it into its DataACK (§11.16.5), whose Initiator Task Tag is reserved (§11.16.4): the TTT
//! alone must name the task. [`mark_ack`] uses the task's Initiator Task Tag as the TTT: it is
//! unique among the session's tasks and never 0xffffffff for a command (§11.2.1.8). The value
//! may equal an R2T's, a Text continuation's or a NOP-In ping's TTT ([`crate::connection`],
//! [`crate::keepalive`]); they never meet, as each comes back in a different PDU (Data-Out,
//! Text Request, NOP-Out, SNACK).
//!
//! # SNACKs (RFC 7143 §11.16)
//!
//! [`Retained::snack`] answers with [`Snacked`]:
//!
//! * Data SNACK (type 0): the Data-In of the task from BegRun, RunLength of them (0: all from
//!   BegRun; BegRun 0 and RunLength 0: all unacknowledged, §11.16.6), exactly as first sent.
//!   A tag this store keeps no Data-In for gives [`Snacked::NotRetained`]: the SNACK may ask
//!   for R2Ts, which the caller's write state answers.
//! * Status SNACK (type 1): the statuses from StatSN BegRun (same run rules), exactly as first
//!   sent, or with the latest content after an R-Data SNACK (§11.16.3).
//! * DataACK (type 2): nothing to send ([`Snacked::DataAcked`]). Its TTT names the task;
//!   its LUN (a copy of the Data-In's, §11.16.5) is not checked.
//! * R-Data SNACK (type 3, §11.16.3): the task's unacknowledged read data again, resegmented to
//!   the current MaxRecvDataSegmentLength, its DataSN from the BegRun of the last DataACK (0 if
//!   none), sequence ends (F, and A per [`mark_ack`]) at the same byte offsets as first sent
//!   (so no sequence exceeds MaxBurstLength), then a SCSI Response with the same StatSN as the
//!   task's status, the SNACK Tag (§11.4.4, §11.16.5), and ExpDataSN counting the new Data-In
//!   (§11.4.8). A status first sent in the last Data-In (S bit, §11.7.3) becomes that SCSI
//!   Response, and the resent Data-In carry no status. The store then keeps the new PDUs in
//!   place of the old, so later SNACKs see what the initiator saw. An R-Data SNACK for a task
//!   whose status has not been recorded yet is refused ([`SnackRefused::StatusPending`]):
//!   record a command's response PDUs together, as the server's writer does.
//!
//! §11.16: "the numbered response(s) ... MUST be delivered as exact replicas ... except for the
//! fields ExpCmdSN, MaxCmdSN", which carry the current values: the caller sets those with
//! [`refresh_window`] and sends the PDUs without stamping them (their StatSN stays) and without
//! recording them again.
//!
//! Anything that asks for a PDU never sent or already acknowledged is refused (§11.16: Reject
//! with reason Protocol Error), as are reserved SNACK types and malformed R-Data SNACKs and
//! DataACKs; [`SnackRefused::reject_reason`] gives the Reject reason (§11.17.1).
//!
//! # Use
//!
//! One [`Retained`] per connection at ErrorRecoveryLevel 1 or higher, in its writer:
//!
//! 1. For each target PDU: [`mark_ack`] on its header, stamp it, then [`Retained::record`] with
//!    `took_stat_sn` = it was stamped with [`crate::pdu::SnMode::Status`]. The data segment
//!    must be in memory (a Data-In sent from a file range is read first).
//! 2. For each initiator PDU: [`Retained::ack`] with its ExpStatSN.
//! 3. For a SNACK: [`Retained::ack`] with its ExpStatSN, then [`Retained::snack`]:
//!    [`Snacked::Resend`]: [`refresh_window`] each PDU and write it as is (no stamp, no
//!    record); [`Snacked::DataAcked`]: nothing; [`Snacked::NotRetained`]: an R2T to send again
//!    (`WriteTransfer::resend_r2t`), else a Reject (Protocol Error); `Err(e)`: a Reject with
//!    reason [`SnackRefused::reject_reason`] and the SNACK's header as data
//!    ([`crate::pdu::Reject::of`]).
//!
//! # Cost
//!
//! Every operation is O(1) amortized per PDU recorded or resent: statuses are a queue in StatSN
//! order, tasks a map by Initiator Task Tag (hasher `S`, as in [`crate::connection`]) holding
//! their Data-In in DataSN order.

use crate::pdu::{
    DataIn, Header, Itt, Pdu, RejectReason, Residual, ScsiResponse, ServiceResponse, SnackRequest,
    Ttt, MAX_DSL, RESERVED_TAG,
};
use crate::serial::{CmdSn, DataSn, StatSn};
use bytes::{Bytes, BytesMut};
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;

#[cfg(test)]
mod tests;

/// Statuses retained at most (RFC 7143 §4.2.2.2): past this, the oldest is dropped with its task.
pub const MAX_STATUSES: usize = 4096;

/// Tasks whose status has not been sent yet kept at most (their Data-In, RFC 7143 §11.16.1):
/// past this, the oldest is dropped.
pub const MAX_OPEN_TASKS: usize = 4096;

/// SNACK type 0, Data/R2T SNACK (RFC 7143 §11.16.1).
pub const SNACK_DATA_R2T: u8 = 0;
/// SNACK type 1, Status SNACK (RFC 7143 §11.16.1).
pub const SNACK_STATUS: u8 = 1;
/// SNACK type 2, DataACK (RFC 7143 §11.16.1, §11.16.2).
pub const SNACK_DATA_ACK: u8 = 2;
/// SNACK type 3, R-Data SNACK (RFC 7143 §11.16.1, §11.16.3).
pub const SNACK_R_DATA: u8 = 3;

/// Ask for a DataACK on a Data-In (RFC 7143 §11.7.2, §11.7.4): at ErrorRecoveryLevel 1 or
/// higher, call it on every PDU before it is stamped and encoded. It sets the A bit on a
/// Data-In that ends a sequence (F bit) without carrying the status (S bit), and sets its
/// Target Transfer Tag to its Initiator Task Tag, the value the initiator's DataACK names
/// (§11.16.5). Returns whether it did; other PDUs are left alone. Never call it at
/// ErrorRecoveryLevel 0 (§11.7.2: the A bit MUST NOT be set).
pub fn mark_ack(h: &mut Header) -> bool {
    match h {
        Header::DataIn(d) => set_ack(d),
        _ => false,
    }
}

fn set_ack(d: &mut DataIn) -> bool {
    if d.final_bit && d.status.is_none() && d.itt != Itt::RESERVED {
        d.ack = true;
        d.ttt = Ttt(d.itt.0);
        true
    } else {
        false
    }
}

/// Whether a Data-In of a task reassigned with ExpDataSN `from` is sent again on the new
/// connection (RFC 7143 §7.2.2, §11.5.1): those from `from` on, and the one carrying the
/// status even when its data was acknowledged (`from` is the initiator's ExpDataSN, or the
/// first not acknowledged by a DataACK when it sent 0).
pub fn resent_on_reassign(d: &DataIn, from: DataSn, carries_status: bool) -> bool {
    !d.data_sn.lt(from) || carries_status
}

/// Fit a reassigned task's resumed response to the new connection's
/// MaxRecvDataSegmentLength `max` (RFC 7143 §11.5.6: the number of Data-In sent again depends
/// on whether MaxRecvDataSegmentLength changed with the reassignment; §7.2.2). With every
/// Data-In at most `max` long the PDUs are returned as they are (exact replicas). Otherwise
/// each longer Data-In is split into pieces of `max` bytes (the last piece keeps its F and S
/// bits, status and residual), the Data-In are numbered again from the first one's DataSN,
/// and a SCSI Response's ExpDataSN counts the Data-In now sent. `len` and `split_to` (the
/// first `n` bytes off, the rest kept) work on the payload type, so file ranges split without
/// being read.
pub fn refit_data_in<D>(
    pdus: Vec<(Header, D)>,
    max: usize,
    len: impl Fn(&D) -> usize,
    mut split_to: impl FnMut(&mut D, usize) -> D,
) -> Vec<(Header, D)> {
    let max = max.max(1);
    let fits = pdus
        .iter()
        .all(|(h, d)| !matches!(h, Header::DataIn(_)) || len(d) <= max);
    if fits {
        return pdus;
    }
    let mut next: Option<DataSn> = None;
    let mut out = Vec::with_capacity(pdus.len());
    for (h, mut d) in pdus {
        match h {
            Header::DataIn(mut last) => {
                let mut sn = *next.get_or_insert(last.data_sn);
                let mut offset = last.buffer_offset;
                while len(&d) > max {
                    let piece = split_to(&mut d, max);
                    let head = DataIn {
                        final_bit: false,
                        ack: false,
                        status: None,
                        ttt: Ttt::RESERVED,
                        data_sn: sn,
                        buffer_offset: offset,
                        residual: Residual::None,
                        ..last.clone()
                    };
                    out.push((Header::DataIn(head), piece));
                    offset = offset.wrapping_add(max as u32);
                    sn = sn.next();
                }
                last.data_sn = sn;
                last.buffer_offset = offset;
                next = Some(sn.next());
                out.push((Header::DataIn(last), d));
            }
            Header::ScsiResponse(mut r) => {
                if let Some(n) = next {
                    r.exp_data_sn = n;
                }
                out.push((Header::ScsiResponse(r), d));
            }
            other => out.push((other, d)),
        }
    }
    out
}

/// Give a PDU that is sent again the current ExpCmdSN and MaxCmdSN, keeping its StatSN
/// (RFC 7143 §11.16: resent PDUs are exact replicas except for ExpCmdSN and MaxCmdSN).
pub fn refresh_window(h: &mut Header, exp_cmd_sn: CmdSn, max_cmd_sn: CmdSn) {
    if let Some(sn) = h.target_sn_mut() {
        sn.exp_cmd_sn = exp_cmd_sn;
        sn.max_cmd_sn = max_cmd_sn;
    }
}

/// The answer to a SNACK ([`Retained::snack`], RFC 7143 §11.16).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Snacked {
    /// Send these PDUs, in order, after [`refresh_window`], without stamping or recording them
    /// (§11.16). May be empty (BegRun 0 and RunLength 0 when nothing is unacknowledged).
    Resend(Vec<Pdu>),
    /// A DataACK (§11.16.2): the task's Data-In below BegRun are released; nothing to send.
    DataAcked,
    /// A Data/R2T SNACK (§11.16.1 type 0) for a task this store keeps no Data-In for: it may
    /// ask for R2Ts (the caller's write state, [`crate::task::WriteTransfer`]); if not, the
    /// caller refuses it (Reject, Protocol Error, §11.16).
    NotRetained,
}

/// Why a SNACK is refused ([`Retained::snack`]): the caller answers with a Reject of reason
/// [`SnackRefused::reject_reason`] (RFC 7143 §11.16, §11.17.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SnackRefused {
    /// A reserved SNACK type (§11.16.1).
    #[error("SNACK type {0} is reserved")]
    UnknownType(u8),
    /// A Status SNACK for a StatSN not sent yet (§11.16).
    #[error("StatSN {0} was never sent")]
    StatusNotSent(StatSn),
    /// A Status SNACK for a StatSN already acknowledged by ExpStatSN (§11.16, §4.2.2.2).
    #[error("StatSN {0} is already acknowledged")]
    StatusAcknowledged(StatSn),
    /// A Status SNACK for a status no longer retained (bounds, or its task tag was reused,
    /// §11.16).
    #[error("StatSN {0} is no longer retained")]
    StatusDropped(StatSn),
    /// BegRun + RunLength of a Status SNACK beyond the last StatSN sent (§11.16.6, §11.16.7).
    #[error("{run_length} statuses from StatSN {beg} go beyond the last one sent")]
    StatusBeyondSent { beg: StatSn, run_length: u32 },
    /// An R-Data SNACK for a task with no retained Data-In: never sent, acknowledged, or no
    /// longer retained (§11.16, §11.16.3).
    #[error("no read data retained for the task with ITT {0:?}")]
    UnknownTask(Itt),
    /// An R-Data SNACK for a task whose status has not been sent yet (§11.16.3: the status must
    /// follow the resent data with the SNACK Tag).
    #[error("the task with ITT {0:?} has not sent its status yet")]
    StatusPending(Itt),
    /// A Data SNACK for a DataSN not sent yet (§11.16).
    #[error("DataSN {data_sn} of the task with ITT {itt:?} was never sent")]
    DataNotSent { itt: Itt, data_sn: DataSn },
    /// A Data SNACK for a DataSN already acknowledged by a DataACK (§11.16.2).
    #[error("DataSN {data_sn} of the task with ITT {itt:?} is already acknowledged")]
    DataAcknowledged { itt: Itt, data_sn: DataSn },
    /// A Data SNACK for a Data-In no longer retained (§11.16; kept for safety: a task is kept
    /// whole from its last DataACK or not at all).
    #[error("DataSN {data_sn} of the task with ITT {itt:?} is no longer retained")]
    DataDropped { itt: Itt, data_sn: DataSn },
    /// BegRun + RunLength of a Data SNACK beyond the last DataSN sent (§11.16.6, §11.16.7).
    #[error("{run_length} Data-In from DataSN {beg} of the task with ITT {itt:?} go beyond the last one sent")]
    DataBeyondSent {
        itt: Itt,
        beg: DataSn,
        run_length: u32,
    },
    /// A DataACK whose Target Transfer Tag no retained A-bit Data-In carried (§11.16.5).
    #[error("DataACK for Target Transfer Tag {0:?}, which no retained A-bit Data-In carried")]
    UnknownTtt(Ttt),
    /// A DataACK whose BegRun is beyond the next DataSN to send (§11.16.6).
    #[error("DataACK BegRun {data_sn} for Target Transfer Tag {ttt:?} is beyond the Data-In sent")]
    DataAckBeyondSent { ttt: Ttt, data_sn: DataSn },
    /// An R-Data SNACK whose SNACK Tag is 0 or 0xffffffff (§11.16.5).
    #[error("R-Data SNACK Tag {0:#x} is 0 or reserved")]
    BadSnackTag(u32),
    /// An R-Data SNACK or DataACK with a nonzero RunLength, or an R-Data SNACK with a nonzero
    /// BegRun (§11.16.6, §11.16.7).
    #[error("SNACK type {0} must have BegRun/RunLength 0")]
    InvalidRun(u8),
}

impl SnackRefused {
    /// The reason of the Reject that answers the SNACK (RFC 7143 §11.17.1): Invalid DataACK for
    /// a DataACK naming no A-bit Data-In or beyond the data sent, Protocol Error for the rest
    /// (§11.16: a SNACK for what was not sent or was acknowledged).
    pub fn reject_reason(&self) -> RejectReason {
        match self {
            SnackRefused::UnknownTtt(_) | SnackRefused::DataAckBeyondSent { .. } => {
                RejectReason::INVALID_DATA_ACK
            }
            _ => RejectReason::PROTOCOL_ERROR,
        }
    }
}

/// One task's read data: its Data-In PDUs in DataSN order.
#[derive(Debug)]
struct Task {
    /// Tells this task from an earlier one with the same tag.
    gen: u64,
    /// Data-In PDUs with consecutive DataSNs, up to `next` (exclusive).
    data: VecDeque<(DataIn, Bytes)>,
    next: DataSn,
    /// BegRun of the last DataACK (RFC 7143 §11.16.2): the Data-In below are acknowledged.
    acked: DataSn,
    /// A Data-In with the A bit was sent: a DataACK may name the task.
    ack_asked: bool,
    /// The StatSN of its status once sent, and the DataSN of the Data-In that carried it.
    status: Option<(StatSn, Option<DataSn>)>,
    /// Data segment bytes in `data`.
    bytes: usize,
}

impl Task {
    fn first(&self) -> DataSn {
        self.data.front().map_or(self.next, |(h, _)| h.data_sn)
    }
    fn get(&self, sn: DataSn) -> Option<&(DataIn, Bytes)> {
        let i = usize::try_from(sn.since(self.first())).ok()?;
        self.data.get(i).filter(|(h, _)| h.data_sn == sn)
    }
}

#[derive(Debug)]
enum Body {
    /// Sent as the task's Data-In with this DataSN (S bit).
    InTask(DataSn),
    /// Sent as this PDU.
    Own(Header, Bytes),
    /// Dropped with its task (the tag was reused).
    Dropped,
}

/// A PDU that took a StatSN.
#[derive(Debug)]
struct Status {
    stat_sn: StatSn,
    /// The task whose status it is (its Data-In go when it goes): tag and generation.
    task: Option<(Itt, u64)>,
    body: Body,
}

impl Status {
    /// Whether this is the status of task `itt` (and still held).
    fn is_of(&self, itt: Itt) -> bool {
        match (&self.body, self.task) {
            (Body::InTask(_), Some((i, _))) => i == itt,
            (Body::Own(Header::ScsiResponse(r), _), _) => r.itt == itt,
            _ => false,
        }
    }
}

/// The PDUs a connection retains for SNACK at ErrorRecoveryLevel 1 or higher (RFC 7143 §11.16).
/// See the module docs.
#[derive(Debug)]
pub struct Retained<S = std::hash::RandomState> {
    limit: usize,
    /// Data segment bytes held (Data-In and the other statuses).
    bytes: usize,
    /// In StatSN order.
    statuses: VecDeque<Status>,
    tasks: HashMap<Itt, Task, S>,
    /// Tasks without status in creation order (entries for tasks since gone are skipped).
    open: VecDeque<(Itt, u64)>,
    open_live: usize,
    next_gen: u64,
    /// One past the last StatSN recorded.
    next_stat_sn: Option<StatSn>,
    /// Statuses below this are acknowledged (ExpStatSN) or predate the store.
    floor: Option<StatSn>,
}

impl<S: BuildHasher + Default> Retained<S> {
    /// An empty store keeping at most `limit_bytes` of data segments (and at most
    /// [`MAX_STATUSES`] statuses), for one connection (RFC 7143 §4.2.2.2: StatSN and SNACK are
    /// per connection).
    pub fn new(limit_bytes: usize) -> Self {
        Retained {
            limit: limit_bytes,
            bytes: 0,
            statuses: VecDeque::new(),
            tasks: HashMap::default(),
            open: VecDeque::new(),
            open_live: 0,
            next_gen: 0,
            next_stat_sn: None,
            floor: None,
        }
    }

    /// The bound on data segment bytes held for SNACK (RFC 7143 §11.16).
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Data segment bytes held now for SNACK (RFC 7143 §11.16), at most [`Retained::limit`]
    /// after every call.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Statuses held now (RFC 7143 §4.2.2.2), at most [`MAX_STATUSES`].
    pub fn statuses(&self) -> usize {
        self.statuses.len()
    }

    /// Tasks whose Data-In are held now (RFC 7143 §11.16.1).
    pub fn tasks(&self) -> usize {
        self.tasks.len()
    }

    /// Keep a target PDU just stamped, in send order (RFC 7143 §11.16): a Data-In by its task
    /// and DataSN, and, when `took_stat_sn` (the PDU took the next StatSN, §4.2.2.2), the PDU
    /// by its StatSN. Other PDUs are ignored. Call [`mark_ack`] before stamping.
    pub fn record(&mut self, header: &Header, data: &Bytes, took_stat_sn: bool) {
        let link = match header {
            Header::DataIn(d) => self.record_data_in(d, data),
            _ => None,
        };
        if took_stat_sn {
            if let Some(sn) = header.target_sn() {
                self.record_status(sn.stat_sn, header, data, link);
            }
        }
        self.enforce();
    }

    /// ExpStatSN from an initiator PDU (RFC 7143 §4.2.2.2): every status below it is
    /// acknowledged and let go, with the Data-In of the task it answered. Call it for every
    /// initiator PDU, a SNACK included (before [`Retained::snack`]). A value beyond the StatSNs
    /// sent acknowledges all of them.
    pub fn ack(&mut self, exp_stat_sn: StatSn) {
        let Some(next) = self.next_stat_sn else {
            return;
        };
        let exp = if exp_stat_sn.gt(next) {
            next
        } else {
            exp_stat_sn
        };
        match self.floor {
            Some(f) if !exp.gt(f) => {}
            _ => self.floor = Some(exp),
        }
        while let Some(s) = self.statuses.front() {
            if !s.stat_sn.lt(exp) {
                break;
            }
            if let Some(s) = self.statuses.pop_front() {
                self.drop_status(s);
            }
        }
    }

    /// Forget the Data-In of a task that will send no status (aborted, RFC 7143 §11.5.1); a
    /// task whose status was sent goes with its status instead.
    pub fn forget(&mut self, itt: Itt) {
        if self.tasks.get(&itt).is_some_and(|t| t.status.is_none()) {
            self.remove_task(itt);
        }
    }

    /// Let go of everything kept for the tag `itt`, its status included: a new command with
    /// that tag arrived, so the initiator has the old task's status (RFC 7143 §11.2.1.8) and
    /// nothing kept for it may answer a later SNACK or TASK REASSIGN.
    pub fn forget_task(&mut self, itt: Itt) {
        self.remove_task(itt);
        let mut freed = 0;
        for s in self.statuses.iter_mut() {
            if let Body::Own(Header::ScsiResponse(r), d) = &s.body {
                if r.itt == itt {
                    freed += d.len();
                    s.body = Body::Dropped;
                    s.task = None;
                }
            }
        }
        self.bytes -= freed;
    }

    /// What a TASK REASSIGN of `itt` to another connection sends there (RFC 7143 §11.5.1,
    /// §7.2.2), once this connection has failed: the task's Data-In from `exp_data_sn` (0:
    /// from the first not acknowledged by a DataACK) and its status, as first sent; the caller
    /// stamps them anew on the new connection (the status takes that connection's next
    /// StatSN). `None` while no status of the task is held (still running, or let go): the
    /// caller waits or answers that the task does not exist. The task is let go here.
    pub fn reassign(&mut self, itt: Itt, exp_data_sn: DataSn) -> Option<Vec<(Header, Bytes)>> {
        let at = self.statuses.iter().rposition(|s| s.is_of(itt))?;
        let status = self.statuses.get_mut(at)?;
        let (own, carrier) = match &status.body {
            Body::Own(h, d) => (Some((h.clone(), d.clone())), None),
            Body::InTask(dsn) => (None, Some(*dsn)),
            Body::Dropped => (None, None),
        };
        let linked = status.task.map(|(_, gen)| gen);
        if own.is_some() {
            // Taken once: a later TASK REASSIGN of the tag (reused by then) must not find it.
            status.body = Body::Dropped;
            status.task = None;
        }
        if let Some((_, d)) = &own {
            self.bytes -= d.len();
        }
        let mut out = Vec::new();
        if let Some(t) = self.tasks.get(&itt).filter(|t| Some(t.gen) == linked) {
            let from = if exp_data_sn == DataSn(0) {
                t.acked
            } else {
                exp_data_sn
            };
            out.extend(
                t.data
                    .iter()
                    .filter(|(h, _)| resent_on_reassign(h, from, Some(h.data_sn) == carrier))
                    .map(|(h, d)| (Header::DataIn(h.clone()), d.clone())),
            );
            self.remove_task(itt);
        } else if own.is_none() {
            // Its Data-In were let go: nothing to resume from.
            return None;
        }
        out.extend(own);
        Some(out)
    }

    /// Answer a SNACK Request (RFC 7143 §11.16): the PDUs to send again, a DataACK taken, a
    /// Data/R2T SNACK this store cannot answer, or a refusal. `max_xmit` is the initiator's
    /// current MaxRecvDataSegmentLength (for an R-Data SNACK's resegmentation, §11.16.3).
    pub fn snack(&mut self, req: &SnackRequest, max_xmit: u32) -> Result<Snacked, SnackRefused> {
        match req.snack_type {
            SNACK_DATA_R2T => self.data_snack(req),
            SNACK_STATUS => self.status_snack(req),
            SNACK_DATA_ACK => self.data_ack(req),
            SNACK_R_DATA => self.r_data(req, max_xmit),
            t => Err(SnackRefused::UnknownType(t)),
        }
    }

    fn record_data_in(&mut self, d: &DataIn, data: &Bytes) -> Option<(Itt, u64)> {
        let follows = self
            .tasks
            .get(&d.itt)
            .is_some_and(|t| t.status.is_none() && d.data_sn == t.next);
        if !follows {
            // A new command with the tag (or a Data-In out of sequence): the old task goes.
            self.remove_task(d.itt);
            if d.data_sn != DataSn(0) || d.itt == Itt::RESERVED {
                // The start of this task was dropped (bounds): keep none of it.
                return None;
            }
            let gen = self.next_gen;
            self.next_gen += 1;
            self.tasks.insert(
                d.itt,
                Task {
                    gen,
                    data: VecDeque::new(),
                    next: DataSn(0),
                    acked: DataSn(0),
                    ack_asked: false,
                    status: None,
                    bytes: 0,
                },
            );
            self.open.push_back((d.itt, gen));
            self.open_live += 1;
            if self.open.len() > 2 * self.open_live + 64 {
                let tasks = &self.tasks;
                self.open.retain(|(itt, gen)| {
                    tasks
                        .get(itt)
                        .is_some_and(|t| t.gen == *gen && t.status.is_none())
                });
            }
        }
        let t = self.tasks.get_mut(&d.itt)?;
        t.data.push_back((d.clone(), data.clone()));
        t.next = d.data_sn.next();
        t.bytes += data.len();
        t.ack_asked |= d.ack;
        self.bytes += data.len();
        Some((d.itt, t.gen))
    }

    fn record_status(
        &mut self,
        sn: StatSn,
        header: &Header,
        data: &Bytes,
        link: Option<(Itt, u64)>,
    ) {
        // Keep the queue in StatSN order: a StatSN that does not follow the last one replaces
        // the ones at or after it.
        while let Some(back) = self.statuses.back() {
            if back.stat_sn.lt(sn) {
                break;
            }
            if let Some(s) = self.statuses.pop_back() {
                self.drop_status(s);
            }
        }
        if self.floor.is_some_and(|f| sn.lt(f)) {
            self.floor = Some(sn);
        }
        let (task, body) = match (link, header) {
            (Some(link), Header::DataIn(d)) => (Some(link), Body::InTask(d.data_sn)),
            (_, Header::ScsiResponse(r)) => {
                let open = self.tasks.get(&r.itt).map(|t| (t.status.is_none(), t.gen));
                let task = match open {
                    Some((true, gen)) => Some((r.itt, gen)),
                    Some((false, _)) => {
                        // The tag was reused by a command without Data-In.
                        self.remove_task(r.itt);
                        None
                    }
                    None => None,
                };
                (task, Body::Own(header.clone(), data.clone()))
            }
            _ => (None, Body::Own(header.clone(), data.clone())),
        };
        if let Some((itt, _)) = task {
            if let Some(t) = self.tasks.get_mut(&itt) {
                let in_data = match body {
                    Body::InTask(dsn) => Some(dsn),
                    _ => None,
                };
                if t.status.is_none() {
                    self.open_live -= 1;
                }
                t.status = Some((sn, in_data));
            }
        }
        if let Body::Own(_, d) = &body {
            self.bytes += d.len();
        }
        self.statuses.push_back(Status {
            stat_sn: sn,
            task,
            body,
        });
        self.next_stat_sn = Some(sn.next());
        if self.floor.is_none() {
            self.floor = Some(sn);
        }
    }

    /// Let go of a status taken off the queue, and of its task.
    fn drop_status(&mut self, s: Status) {
        if let Body::Own(_, d) = &s.body {
            self.bytes -= d.len();
        }
        if let Some((itt, gen)) = s.task {
            if self.tasks.get(&itt).is_some_and(|t| t.gen == gen) {
                self.remove_task(itt);
            }
        }
    }

    /// Remove a task; its status, if still queued, is marked dropped.
    fn remove_task(&mut self, itt: Itt) {
        let Some(t) = self.tasks.remove(&itt) else {
            return;
        };
        self.bytes -= t.bytes;
        match t.status {
            None => self.open_live -= 1,
            Some((sn, _)) => {
                let i = self.status_index(sn);
                if let Some(s) = i.and_then(|i| self.statuses.get_mut(i)) {
                    if s.task == Some((itt, t.gen)) {
                        if let Body::Own(_, d) = &s.body {
                            self.bytes -= d.len();
                        }
                        s.task = None;
                        s.body = Body::Dropped;
                    }
                }
            }
        }
    }

    /// Drop the oldest statuses (with their tasks), then the oldest tasks in progress, until
    /// within every bound.
    fn enforce(&mut self) {
        loop {
            let over_bytes = self.bytes > self.limit;
            if over_bytes || self.statuses.len() > MAX_STATUSES {
                if let Some(s) = self.statuses.pop_front() {
                    self.drop_status(s);
                    continue;
                }
            }
            if over_bytes || self.open_live > MAX_OPEN_TASKS {
                if let Some(itt) = self.oldest_open() {
                    self.remove_task(itt);
                    continue;
                }
            }
            break;
        }
    }

    fn oldest_open(&mut self) -> Option<Itt> {
        while let Some((itt, gen)) = self.open.pop_front() {
            if self
                .tasks
                .get(&itt)
                .is_some_and(|t| t.gen == gen && t.status.is_none())
            {
                return Some(itt);
            }
        }
        None
    }

    /// Where the status with StatSN `sn` is in the queue.
    fn status_index(&self, sn: StatSn) -> Option<usize> {
        let front = self.statuses.front()?.stat_sn;
        let d = usize::try_from(sn.since(front)).ok()?;
        if self.statuses.get(d).is_some_and(|s| s.stat_sn == sn) {
            return Some(d);
        }
        if sn.lt(front) {
            return None;
        }
        // StatSNs the caller did not record leave gaps: search.
        let i = self
            .statuses
            .partition_point(|s| s.stat_sn.since(front) < sn.since(front));
        self.statuses
            .get(i)
            .is_some_and(|s| s.stat_sn == sn)
            .then_some(i)
    }

    /// The PDU as sent (or as last updated) of a queued status.
    fn status_pdu(&self, s: &Status) -> Option<Pdu> {
        match &s.body {
            Body::Own(h, d) => Some(Pdu::new(h.clone(), d.clone())),
            Body::InTask(dsn) => {
                let (itt, gen) = s.task?;
                let t = self.tasks.get(&itt).filter(|t| t.gen == gen)?;
                let (h, d) = t.get(*dsn)?;
                Some(Pdu::new(Header::DataIn(h.clone()), d.clone()))
            }
            Body::Dropped => None,
        }
    }

    /// Status SNACK (RFC 7143 §11.16.1 type 1).
    fn status_snack(&self, req: &SnackRequest) -> Result<Snacked, SnackRefused> {
        let all = req.beg_run == 0 && req.run_length == 0;
        let Some(next) = self.next_stat_sn else {
            return if all {
                Ok(Snacked::Resend(Vec::new()))
            } else {
                Err(SnackRefused::StatusNotSent(StatSn(req.beg_run)))
            };
        };
        let floor = self.floor.unwrap_or(next);
        let beg = if all { floor } else { StatSn(req.beg_run) };
        if !beg.lt(next) {
            return if all && beg == next {
                Ok(Snacked::Resend(Vec::new()))
            } else {
                Err(SnackRefused::StatusNotSent(beg))
            };
        }
        if beg.lt(floor) {
            return Err(SnackRefused::StatusAcknowledged(beg));
        }
        let avail = next.since(beg);
        let count = match req.run_length {
            0 => avail,
            n if n > avail => return Err(SnackRefused::StatusBeyondSent { beg, run_length: n }),
            n => n,
        };
        let i = self
            .status_index(beg)
            .ok_or(SnackRefused::StatusDropped(beg))?;
        let mut out = Vec::with_capacity(self.statuses.len().saturating_sub(i).min(count as usize));
        for k in 0..count {
            let want = beg.plus(k);
            let pdu = usize::try_from(k)
                .ok()
                .and_then(|k| i.checked_add(k))
                .and_then(|j| self.statuses.get(j))
                .filter(|s| s.stat_sn == want)
                .and_then(|s| self.status_pdu(s))
                .ok_or(SnackRefused::StatusDropped(want))?;
            out.push(pdu);
        }
        Ok(Snacked::Resend(out))
    }

    /// Data SNACK (RFC 7143 §11.16.1 type 0), for Data-In.
    fn data_snack(&self, req: &SnackRequest) -> Result<Snacked, SnackRefused> {
        let itt = req.itt;
        let Some(t) = self.tasks.get(&itt) else {
            return Ok(Snacked::NotRetained);
        };
        let all = req.beg_run == 0 && req.run_length == 0;
        let beg = if all { t.acked } else { DataSn(req.beg_run) };
        if !beg.lt(t.next) {
            return if all && beg == t.next {
                Ok(Snacked::Resend(Vec::new()))
            } else {
                Err(SnackRefused::DataNotSent { itt, data_sn: beg })
            };
        }
        if beg.lt(t.acked) {
            return Err(SnackRefused::DataAcknowledged { itt, data_sn: beg });
        }
        let avail = t.next.since(beg);
        let count = match req.run_length {
            0 => avail,
            n if n > avail => {
                return Err(SnackRefused::DataBeyondSent {
                    itt,
                    beg,
                    run_length: n,
                })
            }
            n => n,
        };
        let mut out = Vec::with_capacity(t.data.len().min(count as usize));
        for k in 0..count {
            let want = beg.plus(k);
            let (h, d) = t
                .get(want)
                .ok_or(SnackRefused::DataDropped { itt, data_sn: want })?;
            out.push(Pdu::new(Header::DataIn(h.clone()), d.clone()));
        }
        Ok(Snacked::Resend(out))
    }

    /// DataACK (RFC 7143 §11.16.1 type 2, §11.16.2).
    fn data_ack(&mut self, req: &SnackRequest) -> Result<Snacked, SnackRefused> {
        let ttt = req.ttt;
        let t = (ttt != Ttt::RESERVED)
            .then(|| self.tasks.get_mut(&Itt(ttt.0)))
            .flatten()
            .filter(|t| t.ack_asked)
            .ok_or(SnackRefused::UnknownTtt(ttt))?;
        if req.run_length != 0 {
            return Err(SnackRefused::InvalidRun(SNACK_DATA_ACK));
        }
        let beg = DataSn(req.beg_run);
        if !beg.le(t.next) {
            return Err(SnackRefused::DataAckBeyondSent { ttt, data_sn: beg });
        }
        if beg.le(t.acked) {
            return Ok(Snacked::DataAcked);
        }
        t.acked = beg;
        let keep = t.status.and_then(|(_, dsn)| dsn);
        let mut freed = 0;
        while let Some((h, _)) = t.data.front() {
            if !h.data_sn.lt(beg) || Some(h.data_sn) == keep {
                break;
            }
            if let Some((_, d)) = t.data.pop_front() {
                freed += d.len();
            }
        }
        t.bytes -= freed;
        self.bytes -= freed;
        Ok(Snacked::DataAcked)
    }

    /// R-Data SNACK (RFC 7143 §11.16.1 type 3, §11.16.3).
    fn r_data(&mut self, req: &SnackRequest, max_xmit: u32) -> Result<Snacked, SnackRefused> {
        let tag = req.ttt.0;
        if tag == 0 || tag == RESERVED_TAG {
            return Err(SnackRefused::BadSnackTag(tag));
        }
        if req.beg_run != 0 || req.run_length != 0 {
            return Err(SnackRefused::InvalidRun(SNACK_R_DATA));
        }
        let itt = req.itt;
        let t = self.tasks.get(&itt).ok_or(SnackRefused::UnknownTask(itt))?;
        let (stat_sn, _) = t.status.ok_or(SnackRefused::StatusPending(itt))?;
        let i = self
            .status_index(stat_sn)
            .ok_or(SnackRefused::StatusDropped(stat_sn))?;
        let body = self.statuses.get(i).map(|s| &s.body);
        let (mut resp, sense) = match body {
            Some(Body::Own(Header::ScsiResponse(r), sense)) => (r.clone(), sense.clone()),
            Some(Body::InTask(dsn)) => {
                let (h, _) = t.get(*dsn).ok_or(SnackRefused::StatusDropped(stat_sn))?;
                let resp = ScsiResponse {
                    response: ServiceResponse::COMMAND_COMPLETED,
                    status: h.status.unwrap_or(0),
                    itt,
                    sn: h.sn,
                    residual: h.residual,
                    ..Default::default()
                };
                (resp, Bytes::new())
            }
            _ => return Err(SnackRefused::StatusDropped(stat_sn)),
        };
        let max = max_xmit.clamp(512, MAX_DSL) as usize;
        let acked = t.acked;
        let mut r = Resegment {
            out: Vec::new(),
            pieces: Vec::new(),
            len: 0,
            head: None,
            next: acked,
        };
        let mut expect: Option<u32> = None;
        for (h, d) in t.data.iter().filter(|(h, _)| !h.data_sn.lt(acked)) {
            if expect.is_some_and(|e| e != h.buffer_offset) {
                r.flush(false);
            }
            let mut rest = d.clone();
            let mut off = h.buffer_offset;
            if rest.is_empty() && h.final_bit {
                r.flush(true);
            }
            while !rest.is_empty() {
                let take = max.saturating_sub(r.len).min(rest.len()).max(1);
                let piece = rest.split_to(take);
                r.push(h, off, piece);
                off = off.wrapping_add(take as u32);
                let burst_end = rest.is_empty() && h.final_bit;
                if r.len >= max || burst_end {
                    r.flush(burst_end);
                }
            }
            expect = Some(off);
        }
        r.flush(true);
        let new = r.out;
        resp.snack_tag = tag;
        resp.exp_data_sn = acked.plus(new.len() as u32);
        let response = Header::ScsiResponse(resp);
        let mut out: Vec<Pdu> = new
            .iter()
            .map(|(h, d)| Pdu::new(Header::DataIn(h.clone()), d.clone()))
            .collect();
        out.push(Pdu::new(response.clone(), sense.clone()));
        // Keep what the initiator now has: the new Data-In and the tagged SCSI Response.
        let new_bytes: usize = new.iter().map(|(_, d)| d.len()).sum();
        let ack_asked = new.iter().any(|(h, _)| h.ack);
        if let Some(t) = self.tasks.get_mut(&itt) {
            self.bytes = self.bytes - t.bytes + new_bytes;
            t.bytes = new_bytes;
            t.next = acked.plus(new.len() as u32);
            t.data = new.into();
            t.ack_asked |= ack_asked;
            t.status = Some((stat_sn, None));
        }
        if let Some(s) = self.statuses.get_mut(i) {
            if let Body::Own(_, d) = &s.body {
                self.bytes -= d.len();
            }
            self.bytes += sense.len();
            s.body = Body::Own(response, sense);
        }
        self.enforce();
        Ok(Snacked::Resend(out))
    }
}

/// Builds the Data-In of an R-Data SNACK (RFC 7143 §11.16.3) from pieces of the old ones.
struct Resegment {
    out: Vec<(DataIn, Bytes)>,
    pieces: Vec<Bytes>,
    len: usize,
    /// The header of the PDU being built (the old PDU its first byte came from).
    head: Option<DataIn>,
    next: DataSn,
}

impl Resegment {
    fn push(&mut self, from: &DataIn, offset: u32, piece: Bytes) {
        if self.head.is_none() {
            let mut h = from.clone();
            h.buffer_offset = offset;
            self.head = Some(h);
        }
        self.len += piece.len();
        self.pieces.push(piece);
    }

    /// End the PDU being built; `final_bit`: it ends a sequence.
    fn flush(&mut self, final_bit: bool) {
        let Some(mut h) = self.head.take() else {
            if final_bit {
                if let Some((h, _)) = self.out.last_mut() {
                    h.final_bit = true;
                    set_ack(h);
                }
            }
            return;
        };
        let data = if self.pieces.len() == 1 {
            self.pieces.pop().unwrap_or_default()
        } else {
            let mut b = BytesMut::with_capacity(self.len);
            for p in self.pieces.drain(..) {
                b.extend_from_slice(&p);
            }
            b.freeze()
        };
        self.len = 0;
        h.final_bit = final_bit;
        h.ack = false;
        h.ttt = Ttt::RESERVED;
        h.status = None;
        h.residual = Residual::None;
        h.data_sn = self.next;
        self.next = self.next.next();
        set_ack(&mut h);
        self.out.push((h, data));
    }
}
