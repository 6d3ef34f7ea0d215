//! The pair: a test target and a test initiator joined by one in-memory link per connection,
//! on a virtual millisecond clock.

use crate::initiator::{ITask, Initiator};
use crate::target::{Params, Target, BLOCK};
use crate::wire;
use bytes::Bytes;
use ironsan_proto::pdu::*;
use ironsan_proto::session::ConnId;
use ironsan_proto::{CmdSn, DataSn, StatSn};
use std::collections::{BTreeMap, VecDeque};

/// One TCP connection: encoded PDUs in transit each way.
#[derive(Debug)]
struct Link {
    conn: ConnId,
    to_target: VecDeque<Vec<u8>>,
    to_initiator: VecDeque<Vec<u8>>,
    /// The target closed it: what is in transit to the initiator still arrives.
    closed: bool,
}

#[derive(Debug)]
pub(crate) struct Pair {
    pub(crate) target: Target,
    pub(crate) init: Initiator,
    links: BTreeMap<u16, Link>,
    pub(crate) now_ms: u64,
}

/// The CDB of a READ(10) or WRITE(10).
pub(crate) fn rw10(op: u8, lba: u32, blocks: u16) -> [u8; 16] {
    let mut cdb = [0u8; 16];
    cdb[0] = op;
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
    cdb
}

/// Bytes for a write that differ per `seed` and per offset.
pub(crate) fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31) ^ (i as u8) ^ ((i >> 8) as u8).wrapping_add(seed))
        .collect()
}

impl Pair {
    /// A session with a connection for each of `cids`, logged in with `params` (the login
    /// phase is not driven: `ironsan_proto::login` has its own tests, and a scenario wants
    /// exact parameters, which a session built from them gives directly).
    pub(crate) fn new(params: Params, cids: &[u16]) -> Pair {
        let mut p = Pair {
            target: Target::new(params),
            init: Initiator::new(params.target_mrdsl),
            links: BTreeMap::new(),
            now_ms: 0,
        };
        for &cid in cids {
            p.login(cid, params.initiator_mrdsl);
        }
        p
    }

    /// A connection logs in with `cid` (a new one, or a reinstatement of a CID in use), the
    /// initiator declaring MaxRecvDataSegmentLength `mrdsl`. Its StatSN starts at 1000·cid
    /// plus the logins so far, so numbers of different connections never meet.
    pub(crate) fn login(&mut self, cid: u16, mrdsl: u32) -> ConnId {
        let first = StatSn(1000 * u32::from(cid) + 100 * self.links.len() as u32);
        if let Some(old) = self.links.remove(&cid) {
            // Reinstatement: the old TCP connection is gone, with what was in transit.
            drop(old);
        }
        let conn = self
            .target
            .join(cid, mrdsl, first)
            .expect("the session takes the connection");
        self.init
            .conns
            .insert(cid, crate::initiator::IConn::new(first));
        self.links.insert(
            cid,
            Link {
                conn,
                to_target: VecDeque::new(),
                to_initiator: VecDeque::new(),
                closed: false,
            },
        );
        self.pump();
        conn
    }

    /// The target's id of the connection `cid`.
    pub(crate) fn conn_id(&self, cid: u16) -> ConnId {
        self.links[&cid].conn
    }

    pub(crate) fn is_open(&self, cid: u16) -> bool {
        self.links.get(&cid).is_some_and(|l| !l.closed)
    }

    /// Move what the target sent onto the links; note connections it closed.
    fn pump(&mut self) {
        for (id, bytes) in self.target.outbox.drain(..) {
            if let Some(l) = self.links.values_mut().find(|l| l.conn == id) {
                l.to_initiator.push_back(bytes);
            }
        }
        for id in self.target.closed.drain(..) {
            if let Some(l) = self.links.values_mut().find(|l| l.conn == id) {
                l.closed = true;
                l.to_target.clear();
            }
        }
    }

    // ------------------------------------------------------------------------------------
    // Moving PDUs
    // ------------------------------------------------------------------------------------

    /// Deliver to the target every PDU in transit on `cid` (and what that makes the target
    /// send stays in transit back). Returns how many.
    pub(crate) fn deliver_to_target(&mut self, cid: u16) -> usize {
        let mut n = 0;
        loop {
            let Some(l) = self.links.get_mut(&cid).filter(|l| !l.closed) else {
                return n;
            };
            let Some(bytes) = l.to_target.pop_front() else {
                return n;
            };
            let conn = l.conn;
            self.target.receive(conn, &bytes);
            self.pump();
            n += 1;
        }
    }

    /// Deliver to the initiator every PDU in transit on `cid`; its answers (Data-Out for
    /// R2Ts) go in transit to the target. Returns how many.
    pub(crate) fn deliver_to_initiator(&mut self, cid: u16) -> usize {
        let mut n = 0;
        loop {
            let Some(l) = self.links.get_mut(&cid) else {
                return n;
            };
            let Some(bytes) = l.to_initiator.pop_front() else {
                if l.closed {
                    self.links.remove(&cid);
                    if let Some(c) = self.init.conns.get_mut(&cid) {
                        c.open = false;
                    }
                }
                return n;
            };
            let reply = self.init.receive(cid, bytes);
            for (h, d) in reply {
                self.send(cid, h, &d);
            }
            n += 1;
        }
    }

    /// Deliver one PDU in transit to the initiator on `cid` (its answers stay in transit).
    pub(crate) fn deliver_one_to_initiator(&mut self, cid: u16) -> bool {
        let Some(bytes) = self
            .links
            .get_mut(&cid)
            .and_then(|l| l.to_initiator.pop_front())
        else {
            return false;
        };
        let reply = self.init.receive(cid, bytes);
        for (h, d) in reply {
            self.send(cid, h, &d);
        }
        true
    }

    /// Move everything both ways on every connection until nothing moves.
    pub(crate) fn run(&mut self) {
        loop {
            let cids: Vec<u16> = self.links.keys().copied().collect();
            let mut moved = 0;
            for cid in cids {
                moved += self.deliver_to_target(cid);
                moved += self.deliver_to_initiator(cid);
            }
            if moved == 0 {
                return;
            }
        }
    }

    /// PDUs in transit to the target on `cid`, and to the initiator.
    pub(crate) fn in_transit(&self, cid: u16) -> (usize, usize) {
        self.links
            .get(&cid)
            .map_or((0, 0), |l| (l.to_target.len(), l.to_initiator.len()))
    }

    /// The headers in transit to the initiator on `cid`.
    pub(crate) fn peek_to_initiator(&self, cid: u16) -> Vec<Header> {
        self.links
            .get(&cid)
            .map(|l| l.to_initiator.iter().map(|b| wire::header(b)).collect())
            .unwrap_or_default()
    }

    /// Lose in transit the first PDU to the initiator on `cid` that matches; returns its
    /// bytes.
    pub(crate) fn lose_to_initiator(
        &mut self,
        cid: u16,
        pred: impl Fn(&Header) -> bool,
    ) -> Option<Vec<u8>> {
        let l = self.links.get_mut(&cid)?;
        let i = l.to_initiator.iter().position(|b| pred(&wire::header(b)))?;
        l.to_initiator.remove(i)
    }

    /// Lose in transit the first PDU to the target on `cid` that matches.
    pub(crate) fn lose_to_target(
        &mut self,
        cid: u16,
        pred: impl Fn(&Header) -> bool,
    ) -> Option<Vec<u8>> {
        let l = self.links.get_mut(&cid)?;
        let i = l.to_target.iter().position(|b| pred(&wire::header(b)))?;
        l.to_target.remove(i)
    }

    /// The TCP connection `cid` breaks: what is in transit is lost, both ends notice (the
    /// target's reader fails: `Target::teardown` as failed).
    pub(crate) fn cut(&mut self, cid: u16) {
        if let Some(l) = self.links.remove(&cid) {
            self.target.teardown(l.conn, true);
            self.pump();
        }
        if let Some(c) = self.init.conns.get_mut(&cid) {
            c.open = false;
        }
    }

    /// The SCSI layer completes the running command `itt`.
    pub(crate) fn complete(&mut self, itt: Itt) -> bool {
        let done = self.target.complete(itt);
        self.pump();
        done
    }

    /// Complete every running command, oldest first.
    pub(crate) fn complete_all(&mut self) {
        while let Some(itt) = self.target.running.first().map(|r| r.itt) {
            self.complete(itt);
        }
    }

    /// The virtual clock moves on by `ms`.
    pub(crate) fn advance(&mut self, ms: u64) {
        self.now_ms += ms;
        self.target.advance(self.now_ms);
        self.pump();
    }

    // ------------------------------------------------------------------------------------
    // The initiator's PDUs
    // ------------------------------------------------------------------------------------

    /// Put already encoded bytes in transit to the target on `cid` (a PDU lost earlier that
    /// arrives late).
    pub(crate) fn inject_to_target(&mut self, cid: u16, bytes: Vec<u8>) {
        if let Some(l) = self.links.get_mut(&cid).filter(|l| !l.closed) {
            l.to_target.push_back(bytes);
        }
    }

    /// Put a PDU in transit to the target on `cid`.
    pub(crate) fn send(&mut self, cid: u16, header: Header, data: &[u8]) {
        let bytes = wire::encode(&header, data);
        if let Some(l) = self.links.get_mut(&cid).filter(|l| !l.closed) {
            l.to_target.push_back(bytes);
        }
    }

    /// A SCSI Command on `cid` (with the next CmdSN unless `cmd_sn` says otherwise): for a
    /// write with the immediate data and unsolicited Data-Out the session allows.
    pub(crate) fn command(&mut self, cid: u16, spec: Cmd) -> Itt {
        let itt = spec.itt.unwrap_or_else(|| self.init.itt());
        let cmd_sn = spec
            .cmd_sn
            .unwrap_or_else(|| self.init.take_cmd_sn(spec.immediate));
        let p = self.target.params;
        let write = !spec.write_data.is_empty();
        let edtl = if write {
            spec.write_data.len() as u32
        } else {
            spec.read_len
        };
        let first_burst = p.first_burst.min(edtl);
        let immediate_len = if write && p.immediate_data && spec.immediate_data {
            first_burst.min(p.target_mrdsl)
        } else {
            0
        };
        let unsolicited_end = if write && !p.initial_r2t && spec.unsolicited {
            first_burst
        } else {
            immediate_len
        };
        let cmd = ScsiCommand {
            immediate: spec.immediate,
            final_bit: unsolicited_end == immediate_len,
            read: spec.read_len > 0,
            write,
            attr: TaskAttr::SIMPLE,
            lun: Lun::from_number(0),
            itt,
            expected_data_transfer_length: edtl,
            cmd_sn,
            exp_stat_sn: self.init.exp_stat_sn(cid),
            cdb: spec.cdb,
        };
        self.init.tasks.insert(
            itt.0,
            ITask {
                cid,
                cmd: cmd.clone(),
                write_data: spec.write_data.clone(),
                ..Default::default()
            },
        );
        let immediate = spec.write_data[..immediate_len as usize].to_vec();
        self.send(cid, Header::ScsiCommand(cmd), &immediate);
        if unsolicited_end > immediate_len {
            let outs = self.init.data_outs(
                cid,
                itt,
                Ttt::RESERVED,
                immediate_len,
                unsolicited_end - immediate_len,
            );
            for (h, d) in outs {
                self.send(cid, h, &d);
            }
        }
        itt
    }

    pub(crate) fn read(&mut self, cid: u16, lba: u32, blocks: u16) -> Itt {
        self.command(cid, Cmd::read(lba, blocks))
    }

    pub(crate) fn write(&mut self, cid: u16, lba: u32, data: Vec<u8>) -> Itt {
        self.command(cid, Cmd::write(lba, data))
    }

    pub(crate) fn tur(&mut self, cid: u16) -> Itt {
        self.command(cid, Cmd::tur())
    }

    /// A NOP-Out ping (ITT not reserved, so it takes its place in CmdSN order unless
    /// immediate, §11.18).
    pub(crate) fn nop(&mut self, cid: u16, immediate: bool) -> Itt {
        let itt = self.init.itt();
        let h = Header::NopOut(NopOut {
            immediate,
            lun: Lun::default(),
            itt,
            ttt: Ttt::RESERVED,
            cmd_sn: self.init.take_cmd_sn(immediate),
            exp_stat_sn: self.init.exp_stat_sn(cid),
        });
        self.send(cid, h, b"ping");
        itt
    }

    /// A task management request.
    pub(crate) fn tmf(&mut self, cid: u16, t: Tmf) -> Itt {
        let itt = self.init.itt();
        let h = Header::TaskMgmtRequest(TaskMgmtRequest {
            immediate: t.immediate,
            function: t.function,
            lun: Lun::from_number(0),
            itt,
            referenced_task_tag: t.rtt,
            cmd_sn: self.init.take_cmd_sn(t.immediate),
            exp_stat_sn: self.init.exp_stat_sn(cid),
            ref_cmd_sn: t.ref_cmd_sn,
            exp_data_sn: t.exp_data_sn,
        });
        self.send(cid, h, &[]);
        itt
    }

    /// ABORT TASK (immediate) of `rtt`, whose CmdSN was `ref_cmd_sn`.
    pub(crate) fn abort_task(&mut self, cid: u16, rtt: Itt, ref_cmd_sn: CmdSn) -> Itt {
        self.tmf(
            cid,
            Tmf {
                function: TmfFunction::ABORT_TASK,
                rtt,
                ref_cmd_sn,
                ..Tmf::default()
            },
        )
    }

    /// TASK REASSIGN (immediate) of `rtt` to `cid`, with the ExpDataSN the initiator has
    /// (0 for a write, §11.5.1).
    pub(crate) fn reassign(&mut self, cid: u16, rtt: Itt) -> Itt {
        let t = self.init.task(rtt);
        let exp_data_sn = if t.cmd.read {
            t.exp_data_sn()
        } else {
            DataSn(0)
        };
        let itt = self.tmf(
            cid,
            Tmf {
                function: TmfFunction::TASK_REASSIGN,
                rtt,
                exp_data_sn,
                ..Tmf::default()
            },
        );
        if let Some(t) = self.init.tasks.get_mut(&rtt.0) {
            t.cid = cid;
        }
        itt
    }

    /// A Logout Request on `cid` (immediate) with `reason` for the connection `of`; its
    /// ExpStatSN is the named connection's (§11.14).
    pub(crate) fn logout(&mut self, cid: u16, reason: LogoutReason, of: u16) -> Itt {
        let itt = self.init.itt();
        let h = Header::LogoutRequest(LogoutRequest {
            immediate: true,
            reason,
            itt,
            cid: Cid(of),
            cmd_sn: self.init.take_cmd_sn(true),
            exp_stat_sn: self.init.exp_stat_sn(of),
        });
        self.send(cid, h, &[]);
        itt
    }

    /// A SNACK Request (§11.16).
    pub(crate) fn snack(&mut self, cid: u16, s: SnackRequest) {
        let s = SnackRequest {
            exp_stat_sn: self.init.exp_stat_sn(cid),
            ..s
        };
        self.send(cid, Header::SnackRequest(s), &[]);
    }

    /// The data a read brought (or the disk's bytes) for checks.
    pub(crate) fn disk(&self, lba: u32, blocks: u16) -> &[u8] {
        let at = lba as usize * BLOCK;
        &self.target.disk[at..at + usize::from(blocks) * BLOCK]
    }

    /// The task `itt` as the initiator sees it.
    pub(crate) fn task(&self, itt: Itt) -> &ITask {
        self.init.task(itt)
    }

    /// Data bytes of PDUs now in transit to the initiator on `cid` (for tests that bound it).
    #[allow(dead_code)]
    pub(crate) fn bytes_in_transit(&self, cid: u16) -> Bytes {
        let mut v = Vec::new();
        if let Some(l) = self.links.get(&cid) {
            for b in &l.to_initiator {
                v.extend_from_slice(b);
            }
        }
        Bytes::from(v)
    }
}

/// A SCSI command to send ([`Pair::command`]).
#[derive(Clone, Debug)]
pub(crate) struct Cmd {
    pub(crate) cdb: [u8; 16],
    pub(crate) read_len: u32,
    pub(crate) write_data: Vec<u8>,
    /// A CmdSN of the test's choosing (a duplicate, a retry); else the next one.
    pub(crate) cmd_sn: Option<CmdSn>,
    /// A tag of the test's choosing (a retry with the same ITT).
    pub(crate) itt: Option<Itt>,
    pub(crate) immediate: bool,
    /// Send immediate data if the session allows it.
    pub(crate) immediate_data: bool,
    /// Send unsolicited Data-Out if the session allows it.
    pub(crate) unsolicited: bool,
}

impl Cmd {
    pub(crate) fn read(lba: u32, blocks: u16) -> Cmd {
        Cmd {
            cdb: rw10(0x28, lba, blocks),
            read_len: u32::from(blocks) * BLOCK as u32,
            write_data: Vec::new(),
            cmd_sn: None,
            itt: None,
            immediate: false,
            immediate_data: true,
            unsolicited: true,
        }
    }

    pub(crate) fn write(lba: u32, data: Vec<u8>) -> Cmd {
        let blocks = (data.len() / BLOCK) as u16;
        Cmd {
            cdb: rw10(0x2a, lba, blocks),
            read_len: 0,
            write_data: data,
            ..Cmd::read(lba, 0)
        }
    }

    pub(crate) fn tur() -> Cmd {
        Cmd {
            cdb: [0; 16],
            ..Cmd::read(0, 0)
        }
    }

    pub(crate) fn with_sn(self, sn: CmdSn) -> Cmd {
        Cmd {
            cmd_sn: Some(sn),
            ..self
        }
    }

    pub(crate) fn with_itt(self, itt: Itt) -> Cmd {
        Cmd {
            itt: Some(itt),
            ..self
        }
    }
}

/// A task management request ([`Pair::tmf`]); immediate unless said otherwise.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tmf {
    pub(crate) function: TmfFunction,
    pub(crate) rtt: Itt,
    pub(crate) ref_cmd_sn: CmdSn,
    pub(crate) exp_data_sn: DataSn,
    pub(crate) immediate: bool,
}

impl Default for Tmf {
    fn default() -> Self {
        Tmf {
            function: TmfFunction::ABORT_TASK,
            rtt: Itt::RESERVED,
            ref_cmd_sn: CmdSn(0),
            exp_data_sn: DataSn(0),
            immediate: true,
        }
    }
}
