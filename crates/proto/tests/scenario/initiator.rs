//! The test initiator: numbers commands (ITT, CmdSN, ExpStatSN per connection), builds PDUs,
//! answers R2Ts with Data-Out, and records everything it receives per connection and per task.

use crate::wire;
use bytes::Bytes;
use ironsan_proto::pdu::*;
use ironsan_proto::{CmdSn, DataSn, StatSn};
use std::collections::{BTreeMap, BTreeSet};

/// A PDU the initiator received.
#[derive(Clone, Debug)]
pub(crate) struct Received {
    pub(crate) header: Header,
    /// As it came off the wire.
    pub(crate) bytes: Vec<u8>,
}

/// One connection, initiator side.
#[derive(Debug)]
pub(crate) struct IConn {
    pub(crate) received: Vec<Received>,
    /// The next StatSN expected: ExpStatSN advances only over StatSNs received without a gap
    /// (§4.2.2.2), so a lost status shows.
    next_stat_sn: StatSn,
    seen: BTreeSet<u32>,
    pub(crate) open: bool,
}

impl IConn {
    pub(crate) fn new(first_stat_sn: StatSn) -> Self {
        IConn {
            received: Vec::new(),
            next_stat_sn: first_stat_sn,
            seen: BTreeSet::new(),
            open: true,
        }
    }

    pub(crate) fn exp_stat_sn(&self) -> StatSn {
        self.next_stat_sn
    }

    fn saw_status(&mut self, sn: StatSn) {
        if sn.ge(self.next_stat_sn) {
            self.seen.insert(sn.0);
        }
        while self.seen.remove(&self.next_stat_sn.0) {
            self.next_stat_sn = self.next_stat_sn.next();
        }
    }
}

/// A SCSI task, initiator side.
#[derive(Debug, Default)]
pub(crate) struct ITask {
    /// The connection it is allegiant to now.
    pub(crate) cid: u16,
    pub(crate) cmd: ScsiCommand,
    pub(crate) write_data: Vec<u8>,
    pub(crate) read_data: Vec<u8>,
    /// DataSNs of the Data-In received, in arrival order.
    pub(crate) data_sns: Vec<u32>,
    /// SCSI statuses received (a task must end exactly once).
    pub(crate) statuses: Vec<u8>,
    /// R2Ts received: (R2TSN, offset, length).
    pub(crate) r2ts: Vec<(u32, u32, u32)>,
    /// A status that came while Data-In before it were missing: not acknowledged until they
    /// are here (§4.2.2.2: the initiator must not acknowledge a status before the holes in
    /// its data are filled, so the target keeps the Data-In for a SNACK). (StatSN, the
    /// number of Data-In before it.)
    pub(crate) unacked_status: Option<(StatSn, u32)>,
}

impl ITask {
    /// Whether the Data-In numbered below `n` have all arrived.
    fn has_data_below(&self, n: u32) -> bool {
        self.exp_data_sn().0 >= n
    }

    /// The next DataSN expected without a gap (a TASK REASSIGN's ExpDataSN, §11.5.1).
    pub(crate) fn exp_data_sn(&self) -> DataSn {
        let got: BTreeSet<u32> = self.data_sns.iter().copied().collect();
        let mut n = 0;
        while got.contains(&n) {
            n += 1;
        }
        DataSn(n)
    }
}

#[derive(Debug)]
pub(crate) struct Initiator {
    /// The next CmdSN to give a non-immediate PDU.
    pub(crate) cmd_sn: CmdSn,
    next_itt: u32,
    pub(crate) conns: BTreeMap<u16, IConn>,
    pub(crate) tasks: BTreeMap<u32, ITask>,
    /// Answer R2Ts with Data-Out at once.
    pub(crate) auto_data_out: bool,
    /// The target's MaxRecvDataSegmentLength (Data-Out are cut to it).
    pub(crate) target_mrdsl: u32,
    /// (ExpCmdSN, MaxCmdSN) of every target PDU, in arrival order.
    pub(crate) windows: Vec<(CmdSn, CmdSn)>,
}

/// Whether a target PDU took a StatSN (RFC 7143 §4.2.2.2).
pub(crate) fn takes_stat_sn(h: &Header) -> bool {
    match h {
        Header::ScsiResponse(_)
        | Header::TaskMgmtResponse(_)
        | Header::LogoutResponse(_)
        | Header::TextResponse(_)
        | Header::Reject(_) => true,
        Header::DataIn(d) => d.status.is_some(),
        Header::NopIn(n) => n.itt != Itt::RESERVED,
        _ => false,
    }
}

impl Initiator {
    pub(crate) fn new(target_mrdsl: u32) -> Self {
        Initiator {
            cmd_sn: CmdSn(1),
            next_itt: 0x100,
            conns: BTreeMap::new(),
            tasks: BTreeMap::new(),
            auto_data_out: true,
            target_mrdsl,
            windows: Vec::new(),
        }
    }

    pub(crate) fn itt(&mut self) -> Itt {
        self.next_itt += 1;
        Itt(self.next_itt)
    }

    /// The CmdSN for the next PDU: taken (advanced) unless it is immediate (§3.2.2.1).
    pub(crate) fn take_cmd_sn(&mut self, immediate: bool) -> CmdSn {
        let sn = self.cmd_sn;
        if !immediate {
            self.cmd_sn = sn.next();
        }
        sn
    }

    pub(crate) fn exp_stat_sn(&self, cid: u16) -> StatSn {
        self.conns.get(&cid).map_or(StatSn(0), IConn::exp_stat_sn)
    }

    pub(crate) fn task(&self, itt: Itt) -> &ITask {
        &self.tasks[&itt.0]
    }

    pub(crate) fn conn(&self, cid: u16) -> &IConn {
        &self.conns[&cid]
    }

    /// Data-Out for `len` bytes at `offset` of the write `itt` (TTT reserved: unsolicited),
    /// cut to the target's MaxRecvDataSegmentLength, F on the last.
    pub(crate) fn data_outs(
        &self,
        cid: u16,
        itt: Itt,
        ttt: Ttt,
        offset: u32,
        len: u32,
    ) -> Vec<(Header, Bytes)> {
        let t = &self.tasks[&itt.0];
        let mut out = Vec::new();
        let (mut at, end) = (offset, offset + len);
        let mut sn = 0;
        while at < end {
            let n = (end - at).min(self.target_mrdsl);
            let h = Header::DataOut(DataOut {
                final_bit: at + n == end,
                lun: t.cmd.lun,
                itt,
                ttt,
                exp_stat_sn: self.exp_stat_sn(cid),
                data_sn: DataSn(sn),
                buffer_offset: at,
            });
            let data = Bytes::copy_from_slice(&t.write_data[at as usize..(at + n) as usize]);
            out.push((h, data));
            at += n;
            sn += 1;
        }
        out
    }

    /// One PDU arrived on `cid`; returns what the initiator sends back at once (Data-Out
    /// answering an R2T).
    pub(crate) fn receive(&mut self, cid: u16, bytes: Vec<u8>) -> Vec<(Header, Bytes)> {
        let (bhs, _, data) = wire::decode(&bytes, MAX_DSL);
        let header = Header::decode(&bhs);
        // The StatSN to acknowledge, unless the task's data has holes before it.
        let mut ack = header
            .target_sn()
            .filter(|_| takes_stat_sn(&header))
            .map(|sn| sn.stat_sn);
        if let Some(sn) = header.target_sn() {
            self.windows.push((sn.exp_cmd_sn, sn.max_cmd_sn));
        }
        let mut reply = Vec::new();
        match &header {
            Header::DataIn(d) => {
                if let Some(t) = self.tasks.get_mut(&d.itt.0) {
                    let at = d.buffer_offset as usize;
                    if t.read_data.len() < at + data.len() {
                        t.read_data.resize(at + data.len(), 0);
                    }
                    t.read_data[at..at + data.len()].copy_from_slice(&data);
                    t.data_sns.push(d.data_sn.0);
                    if let Some(s) = d.status {
                        t.statuses.push(s);
                        if !t.has_data_below(d.data_sn.0) {
                            t.unacked_status = ack.take().map(|sn| (sn, d.data_sn.0));
                        }
                    }
                    if let Some((sn, n)) = t.unacked_status {
                        if t.has_data_below(n) {
                            t.unacked_status = None;
                            ack = Some(sn);
                        }
                    }
                }
            }
            Header::ScsiResponse(r) => {
                if let Some(t) = self.tasks.get_mut(&r.itt.0) {
                    t.statuses.push(r.status);
                    if t.cmd.read && !t.has_data_below(r.exp_data_sn.0) {
                        t.unacked_status = ack.take().map(|sn| (sn, r.exp_data_sn.0));
                    }
                }
            }
            Header::R2t(r) => {
                if let Some(t) = self.tasks.get_mut(&r.itt.0) {
                    t.r2ts
                        .push((r.r2t_sn.0, r.buffer_offset, r.desired_data_transfer_length));
                }
                if self.auto_data_out && self.tasks.contains_key(&r.itt.0) {
                    reply = self.data_outs(
                        cid,
                        r.itt,
                        r.ttt,
                        r.buffer_offset,
                        r.desired_data_transfer_length,
                    );
                }
            }
            _ => {}
        }
        if let Some(c) = self.conns.get_mut(&cid) {
            if let Some(sn) = ack {
                c.saw_status(sn);
            }
            c.received.push(Received { header, bytes });
        }
        reply
    }

    /// The task management responses received on `cid`, by request tag.
    pub(crate) fn tmf_response(&self, cid: u16, itt: Itt) -> Option<TmfResponseCode> {
        self.conns[&cid]
            .received
            .iter()
            .find_map(|r| match &r.header {
                Header::TaskMgmtResponse(t) if t.itt == itt => Some(t.response),
                _ => None,
            })
    }

    pub(crate) fn logout_response(&self, cid: u16, itt: Itt) -> Option<LogoutResponse> {
        self.conns[&cid]
            .received
            .iter()
            .find_map(|r| match &r.header {
                Header::LogoutResponse(l) if l.itt == itt => Some(l.clone()),
                _ => None,
            })
    }

    pub(crate) fn rejects(&self, cid: u16) -> Vec<RejectReason> {
        self.conns[&cid]
            .received
            .iter()
            .filter_map(|r| match &r.header {
                Header::Reject(j) => Some(j.reason),
                _ => None,
            })
            .collect()
    }

    pub(crate) fn nop_ins(&self, cid: u16, itt: Itt) -> usize {
        self.conns[&cid]
            .received
            .iter()
            .filter(|r| matches!(&r.header, Header::NopIn(n) if n.itt == itt))
            .count()
    }

    /// How many PDUs of task `itt` (Data-In, SCSI Response, R2T) came on `cid`.
    pub(crate) fn task_pdus_on(&self, cid: u16, itt: Itt) -> usize {
        self.conns[&cid]
            .received
            .iter()
            .filter(|r| match &r.header {
                Header::DataIn(d) => d.itt == itt,
                Header::ScsiResponse(s) => s.itt == itt,
                Header::R2t(t) => t.itt == itt,
                _ => false,
            })
            .count()
    }
}
