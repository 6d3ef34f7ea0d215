//! The per-connection half of the full-feature phase (RFC 7143 §3.2.4, §6.2, §11.7, §11.8,
//! §11.10), with no I/O: the Data-Out reassembly of the writes allegiant to the connection,
//! the R2Ts they need (bounded per task by MaxOutstandingR2T and per connection by a budget of
//! our own), Target Transfer Tags, and the continuation of long Text responses.
//!
//! The caller reads a Data-Out header, asks [`Connection::data_out`] where its payload goes,
//! puts the payload there itself (so it can go straight into the task's buffer or the medium),
//! then calls [`Connection::after_data`]; R2Ts to send come out of [`Connection::poll_r2t`].
//! A write enters with [`Connection::insert_write`] when its data is not all there yet, and is
//! handed back, complete, once it is and the session has delivered it.
//!
//! Generic over `W`, what the caller keeps per write (its buffer, its quota), and the hasher
//! `S` of the write table. One connection's state is touched by one thread only.

use crate::pdu::{
    DataOut, Header, Itt, NopIn, NopOut, R2t, TextRequest, TextResponse, Ttt, RESERVED_TAG,
};
use crate::task::{DataOutError, WriteParams, WriteTransfer};
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;

/// A write allegiant to this connection whose data is not all in, or that the session has not
/// delivered yet.
#[derive(Debug)]
pub struct Write<W> {
    pub itt: Itt,
    pub lun: crate::pdu::Lun,
    /// The Expected Data Transfer Length.
    pub edtl: u32,
    transfer: WriteTransfer,
    /// Delivered in CmdSN order ([`crate::session::Event::Deliver`]): until then it gets no
    /// R2T and does not run.
    delivered: bool,
    pub payload: W,
}

impl<W> Write<W> {
    /// R2Ts issued so far (the SCSI Response's ExpDataSN for a write, RFC 7143 §11.4.8).
    pub fn r2t_count(&self) -> crate::DataSn {
        self.transfer.r2t_count()
    }
    /// Bytes received so far.
    pub fn received(&self) -> u32 {
        self.transfer.received()
    }
    pub fn is_delivered(&self) -> bool {
        self.delivered
    }
}

/// Where a Data-Out's payload goes ([`Connection::data_out`]).
#[derive(Debug)]
pub enum DataOutPlan<W> {
    /// No write of this connection has that ITT (RFC 7143 §11.7: discard the payload and
    /// Reject with Invalid PDU field).
    NoTask,
    /// The header breaks the data sequence: discard the payload, Reject (Protocol error) and
    /// end the command with CHECK CONDITION (a wrong offset, TTT or length is not lost data:
    /// even ErrorRecoveryLevel 1 has nothing to ask for again). The write is removed and
    /// handed back.
    Refused(DataOutError, Write<W>),
    /// Put the payload at `offset` of the write's data, then call [`Connection::after_data`].
    Accept { offset: u32 },
}

/// What a write does next ([`Connection::after_data`], [`Connection::deliver_write`]).
#[derive(Debug)]
pub enum Next<W> {
    /// Every byte is in and the write is delivered: run it (it is no longer kept here).
    Complete(Write<W>),
    /// It waits for more data, or for its delivery.
    Waiting,
    /// No such write (removed meanwhile).
    Gone,
}

/// A Text Response to send: header and data segment.
pub type TextOut = (Header, Bytes);

/// The per-connection state. See the module docs.
#[derive(Debug)]
pub struct Connection<W, S = std::hash::RandomState> {
    params: WriteParams,
    /// The initiator's MaxRecvDataSegmentLength: no PDU we send carries more data.
    max_xmit: u32,
    writes: HashMap<Itt, Write<W>, S>,
    /// Our cap on R2Ts outstanding over all the connection's writes (on top of
    /// MaxOutstandingR2T per task), and how many are outstanding.
    max_r2ts: usize,
    outstanding_r2ts: usize,
    /// Writes that want R2Ts but found the budget spent, oldest first.
    starved: VecDeque<Itt>,
    next_ttt: u32,
    r2ts: VecDeque<R2t>,
    /// A long Text response being continued: (ITT, TTT, the segments still to send).
    text: Option<(Itt, Ttt, VecDeque<Bytes>)>,
}

/// Target Transfer Tags for R2Ts and Text continuations stay below this; the keepalive's
/// NOP-In pings use the range above it ([`crate::keepalive`]).
pub const TTT_LIMIT: u32 = 0x1000_0000;

impl<W, S: BuildHasher + Default> Connection<W, S> {
    /// `params`: the session's negotiated write parameters with our MaxRecvDataSegmentLength;
    /// `max_xmit`: the initiator's; `max_r2ts`: the connection's R2T budget (at least 1).
    pub fn new(params: WriteParams, max_xmit: u32, max_r2ts: usize) -> Self {
        Connection {
            params,
            max_xmit: max_xmit.max(512),
            writes: HashMap::default(),
            max_r2ts: max_r2ts.max(1),
            outstanding_r2ts: 0,
            starved: VecDeque::new(),
            next_ttt: 1,
            r2ts: VecDeque::new(),
            text: None,
        }
    }

    pub fn params(&self) -> &WriteParams {
        &self.params
    }

    /// The initiator's MaxRecvDataSegmentLength.
    pub fn max_xmit(&self) -> u32 {
        self.max_xmit
    }

    fn alloc_ttt(next: &mut u32) -> Ttt {
        *next = next.wrapping_add(1);
        if *next == RESERVED_TAG || *next >= TTT_LIMIT {
            *next = 1;
        }
        Ttt(*next)
    }

    /// Check a write command's immediate data and unsolicited-data announcement (RFC 7143
    /// §3.2.4.2): immediate data only with ImmediateData=Yes and within FirstBurstLength and
    /// the transfer length, F=0 only with InitialR2T=No. The transfer says whether the data is
    /// already complete.
    pub fn begin_write(
        &self,
        edtl: u32,
        immediate_len: u32,
        final_bit: bool,
    ) -> Result<WriteTransfer, DataOutError> {
        if immediate_len > edtl {
            return Err(DataOutError::BadImmediateData);
        }
        WriteTransfer::new(edtl, immediate_len, final_bit, self.params)
    }

    /// Keep a write whose data is not all in (or that waits for delivery). When `delivered`,
    /// its R2Ts are issued now ([`Connection::poll_r2t`]).
    pub fn insert_write(
        &mut self,
        itt: Itt,
        lun: crate::pdu::Lun,
        transfer: WriteTransfer,
        delivered: bool,
        payload: W,
    ) {
        let edtl = transfer_edtl(&transfer);
        self.writes.insert(
            itt,
            Write {
                itt,
                lun,
                edtl,
                transfer,
                delivered,
                payload,
            },
        );
        if delivered {
            self.issue_r2ts(itt);
        }
    }

    /// The write `itt`, to put data into its payload.
    pub fn write_mut(&mut self, itt: Itt) -> Option<&mut Write<W>> {
        self.writes.get_mut(&itt)
    }

    /// Writes kept, delivered or not.
    pub fn writes(&self) -> impl Iterator<Item = &Write<W>> {
        self.writes.values()
    }

    /// A Data-Out header carrying `len` bytes arrived (RFC 7143 §11.7): where its payload goes.
    pub fn data_out(&mut self, d: &DataOut, len: u32) -> DataOutPlan<W> {
        let Some(w) = self.writes.get_mut(&d.itt) else {
            return DataOutPlan::NoTask;
        };
        let before = w.transfer.outstanding_r2ts();
        let accepted = w.transfer.accept(d, len);
        let after = w.transfer.outstanding_r2ts();
        self.outstanding_r2ts = self.outstanding_r2ts.saturating_sub(before - after);
        match accepted {
            Ok(())
                if d.buffer_offset
                    .checked_add(len)
                    .is_some_and(|e| e <= w.edtl) =>
            {
                DataOutPlan::Accept {
                    offset: d.buffer_offset,
                }
            }
            Ok(()) => {
                // `accept` keeps every sequence inside EDTL; this cannot happen, but the
                // payload must never go past the write's buffer.
                let w = self.take(d.itt).expect("looked up above");
                DataOutPlan::Refused(DataOutError::BeyondBurst, w)
            }
            Err(e) => {
                let w = self.take(d.itt).expect("looked up above");
                DataOutPlan::Refused(e, w)
            }
        }
    }

    /// The payload of a Data-Out [`Connection::data_out`] accepted for `itt` (`len` bytes at
    /// `offset`) failed its data digest: at ErrorRecoveryLevel 1 the range is asked for again
    /// by a recovery R2T (RFC 7143 §7.8; call [`Connection::after_data`] next); otherwise,
    /// or past [`crate::task::RECOVERY_LIMIT`], the write is removed and handed back to fail.
    pub fn data_damaged(
        &mut self,
        itt: Itt,
        offset: u32,
        len: u32,
    ) -> Option<(DataOutError, Write<W>)> {
        let w = self.writes.get_mut(&itt)?;
        match w.transfer.damaged(offset, len) {
            Ok(()) => None,
            Err(e) => self.take(itt).map(|w| (e, w)),
        }
    }

    /// An R2T SNACK (RFC 7143 §11.16.1) for the write `itt`: the R2Ts numbered from `beg`
    /// (`run` of them; 0: every one from `beg`) again, their sequences started over. `None`
    /// when the write is unknown or one of those R2Ts was never sent or has all its data
    /// (the caller rejects the SNACK).
    pub fn resend_r2ts(&mut self, itt: Itt, beg: u32, run: u32) -> Option<Vec<R2t>> {
        let w = self.writes.get_mut(&itt)?;
        let sent = w.transfer.r2t_count().0;
        let end = if run == 0 {
            sent
        } else {
            beg.checked_add(run)?
        };
        if beg >= end || end > sent {
            return None;
        }
        let mut out = Vec::new();
        for sn in beg..end {
            let r = w.transfer.resend_r2t(crate::DataSn(sn));
            match r {
                Some(r) => out.push(r2t_pdu(w.lun, itt, &r)),
                // RunLength 0 asks for what is still outstanding from BegRun on.
                None if run == 0 => {}
                None => return None,
            }
        }
        (!out.is_empty()).then_some(out)
    }

    /// The payload of the Data-Out [`Connection::data_out`] accepted for `itt` is in place:
    /// the write completes, or gets the R2Ts it now may.
    pub fn after_data(&mut self, itt: Itt) -> Next<W> {
        let next = self.advance(itt);
        self.serve_starved();
        next
    }

    /// The session delivered the held write `itt` ([`crate::session::Event::Deliver`]).
    pub fn deliver_write(&mut self, itt: Itt) -> Next<W> {
        match self.writes.get_mut(&itt) {
            Some(w) => w.delivered = true,
            None => return Next::Gone,
        }
        self.advance(itt)
    }

    fn advance(&mut self, itt: Itt) -> Next<W> {
        let Some(w) = self.writes.get(&itt) else {
            return Next::Gone;
        };
        if !w.delivered {
            return Next::Waiting;
        }
        if w.transfer.is_complete() {
            return match self.take(itt) {
                Some(w) => Next::Complete(w),
                None => Next::Gone,
            };
        }
        self.issue_r2ts(itt);
        Next::Waiting
    }

    /// Remove a write (failed, aborted, dropped); its outstanding R2Ts no longer count.
    pub fn take(&mut self, itt: Itt) -> Option<Write<W>> {
        let w = self.writes.remove(&itt)?;
        self.outstanding_r2ts = self
            .outstanding_r2ts
            .saturating_sub(w.transfer.outstanding_r2ts());
        Some(w)
    }

    /// Take over a delivered write reassigned from a failed connection of the session (TASK
    /// REASSIGN, RFC 7143 §11.5.1): its whole data is asked for again by R2T from this
    /// connection, with this connection's Target Transfer Tags.
    pub fn adopt_write(&mut self, mut w: Write<W>) {
        w.transfer.reassigned();
        w.delivered = true;
        let itt = w.itt;
        self.writes.insert(itt, w);
        self.issue_r2ts(itt);
    }

    /// Remove every write that matches `pred`.
    pub fn take_where(&mut self, mut pred: impl FnMut(&Write<W>) -> bool) -> Vec<Write<W>> {
        let itts: Vec<Itt> = self
            .writes
            .values()
            .filter(|w| pred(w))
            .map(|w| w.itt)
            .collect();
        let out = itts.into_iter().filter_map(|i| self.take(i)).collect();
        self.serve_starved();
        out
    }

    /// Issue what R2Ts the write may have now; queue it as starved if the budget stops it.
    fn issue_r2ts(&mut self, itt: Itt) {
        let room = self.max_r2ts.saturating_sub(self.outstanding_r2ts);
        let Some(w) = self.writes.get_mut(&itt) else {
            return;
        };
        let next_ttt = &mut self.next_ttt;
        let issued = w
            .transfer
            .next_r2ts_limited(room, || Self::alloc_ttt(next_ttt));
        self.outstanding_r2ts += issued.len();
        for r in issued {
            self.r2ts.push_back(r2t_pdu(w.lun, itt, &r));
        }
        if w.transfer.wants_r2t() && !self.starved.contains(&itt) {
            self.starved.push_back(itt);
        }
    }

    /// Give R2Ts to writes the budget held back, oldest first.
    fn serve_starved(&mut self) {
        while self.outstanding_r2ts < self.max_r2ts {
            let Some(itt) = self.starved.pop_front() else {
                return;
            };
            let wants = self
                .writes
                .get(&itt)
                .is_some_and(|w| w.delivered && w.transfer.wants_r2t());
            if wants {
                self.issue_r2ts(itt);
            }
        }
    }

    /// The next R2T to send (RFC 7143 §11.8), in the order they were issued.
    pub fn poll_r2t(&mut self) -> Option<R2t> {
        self.r2ts.pop_front()
    }

    /// R2Ts outstanding over all the connection's writes.
    pub fn outstanding_r2ts(&self) -> usize {
        self.outstanding_r2ts
    }

    /// A Text Request that continues a long response (RFC 7143 §6.2, §11.10: an empty request
    /// with the TTT of our last partial response): its next segment, or `None` when it is a
    /// new request (any earlier continuation is then abandoned).
    pub fn text_continue(&mut self, t: &TextRequest) -> Option<TextOut> {
        let pending = self.text.take();
        if t.ttt == Ttt::RESERVED {
            return None;
        }
        let (itt, ttt, mut rest) = pending?;
        if itt != t.itt || ttt != t.ttt {
            return None;
        }
        let chunk = rest.pop_front()?;
        let more = !rest.is_empty();
        if more {
            self.text = Some((itt, ttt, rest));
        }
        Some(text_response(t, chunk, more, ttt))
    }

    /// The answer to a new Text Request, `encoded` as key=value text: its first segment; the
    /// rest follows [`Connection::text_continue`] requests (C=1 and a TTT of ours while more
    /// remains).
    pub fn text_respond(&mut self, t: &TextRequest, encoded: Bytes) -> TextOut {
        let max = self.max_xmit as usize;
        let mut chunks: VecDeque<Bytes> = VecDeque::new();
        let mut off = 0;
        while off < encoded.len() {
            let end = (off + max).min(encoded.len());
            chunks.push_back(encoded.slice(off..end));
            off = end;
        }
        let first = chunks.pop_front().unwrap_or_default();
        if chunks.is_empty() {
            return text_response(t, first, false, Ttt::RESERVED);
        }
        let ttt = Self::alloc_ttt(&mut self.next_ttt);
        self.text = Some((t.itt, ttt, chunks));
        text_response(t, first, true, ttt)
    }
}

/// The EDTL a transfer was made for (what its offsets are bounded by).
/// The R2T PDU (RFC 7143 §11.8) for `r`.
fn r2t_pdu(lun: crate::pdu::Lun, itt: Itt, r: &crate::task::R2tRequest) -> R2t {
    R2t {
        lun,
        itt,
        ttt: r.ttt,
        r2t_sn: r.r2t_sn,
        buffer_offset: r.offset,
        desired_data_transfer_length: r.len,
        ..Default::default()
    }
}

fn transfer_edtl(t: &WriteTransfer) -> u32 {
    t.edtl()
}

fn text_response(t: &TextRequest, data: Bytes, more: bool, ttt: Ttt) -> TextOut {
    let h = Header::TextResponse(TextResponse {
        final_bit: !more,
        cont: more,
        lun: t.lun,
        itt: t.itt,
        ttt: if more { ttt } else { Ttt::RESERVED },
        ..Default::default()
    });
    (h, data)
}

/// The answer to a NOP-Out (RFC 7143 §11.18, §11.19): a ping (ITT not reserved) is echoed
/// with its data, no more of it than the initiator's MaxRecvDataSegmentLength `max_xmit`
/// (§11.18.4: the ping may carry up to ours, which can be the larger); a NOP-Out with the
/// reserved ITT (an answer to our ping, or a no-op) gets nothing.
pub fn nop_in(n: &NopOut, data: &Bytes, max_xmit: u32) -> Option<(Header, Bytes)> {
    if n.itt == Itt::RESERVED {
        return None;
    }
    let h = Header::NopIn(NopIn {
        lun: n.lun,
        itt: n.itt,
        ttt: Ttt::RESERVED,
        ..Default::default()
    });
    let echo = data.len().min(max_xmit as usize);
    Some((h, data.slice(..echo)))
}

#[cfg(test)]
mod tests;
