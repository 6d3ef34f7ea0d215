//! Per-command data transfer arithmetic (RFC 7143 §3.2.4, §11.7, §11.8).
//!
//! * [`data_in_segments`] splits read data into Data-In PDUs: each at most the initiator's
//!   MaxRecvDataSegmentLength, sequences (F bit) at most MaxBurstLength, DataSN counting from 0,
//!   and the status collapsed into the last PDU (§11.7.3) when the command has no sense data.
//! * [`response_pdus`] turns a command's outcome into its response PDUs: Data-In segments
//!   with the status collapsed into the last (§11.7.3) when there is no sense data, otherwise a
//!   SCSI Response, with residuals against the Expected Data Transfer Length (§11.4.5).
//! * [`WriteTransfer`] tracks a write's Data-Out: immediate data, unsolicited data up to
//!   FirstBurstLength (when InitialR2T=No), and R2Ts for the rest (at most MaxOutstandingR2T at
//!   a time, each at most MaxBurstLength), validating every Data-Out header before its payload
//!   is read so the payload can go straight to its place in the command's buffer.

use crate::pdu::{
    DataIn, DataOut, Header, Residual, ScsiCommand, ScsiResponse, ServiceResponse, Ttt,
};
use crate::serial::DataSn;

/// One Data-In PDU of a read: its place in the data and its flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataInSegment {
    pub data_sn: DataSn,
    pub offset: u32,
    pub len: u32,
    /// Last PDU of a sequence (burst), F bit.
    pub final_bit: bool,
    /// Last PDU of the command: carries the status when phase-collapsed.
    pub last: bool,
}

/// Split `total` bytes of read data into Data-In PDUs.
pub fn data_in_segments(
    total: u32,
    max_xmit: u32,
    max_burst: u32,
) -> impl Iterator<Item = DataInSegment> {
    let max_xmit = max_xmit.max(512);
    let max_burst = max_burst.max(max_xmit);
    let mut offset = 0u32;
    let mut in_burst = 0u32;
    let mut sn = 0u32;
    std::iter::from_fn(move || {
        if offset >= total {
            return None;
        }
        let len = max_xmit.min(total - offset).min(max_burst - in_burst);
        let seg_off = offset;
        offset += len;
        in_burst += len;
        let last = offset >= total;
        let final_bit = last || in_burst >= max_burst;
        if final_bit {
            in_burst = 0;
        }
        let s = DataInSegment {
            data_sn: DataSn(sn),
            offset: seg_off,
            len,
            final_bit,
            last,
        };
        sn += 1;
        Some(s)
    })
}

/// One PDU of a command's response ([`response_pdus`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResponsePdu {
    pub header: Header,
    /// Bytes of read data it carries: the next `data_len` bytes of what the command read
    /// (0 for a SCSI Response, whose data segment is the sense data, if any).
    pub data_len: u32,
    /// It carries the command's status, so it takes the next StatSN.
    pub status: bool,
}

/// How a command ended, as far as its response PDUs go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub status: u8,
    /// There is sense data (it goes in a SCSI Response, never collapsed into Data-In).
    pub sense: bool,
    /// Bytes of read data the command produced (at most EDTL of them are sent).
    pub produced: u32,
    /// For a write, the bytes its CDB asked for (its residual against EDTL).
    pub write_needed: Option<u32>,
    /// For a write, the R2Ts issued: a SCSI Response's ExpDataSN (§11.4.8).
    pub exp_data_sn: DataSn,
}

/// The PDUs that answer a command (RFC 7143 §11.4, §11.7), with the initiator's `max_xmit`
/// and the session's `max_burst` for Data-In segmentation. Returns how many bytes of the read
/// data are sent, and the PDUs.
pub fn response_pdus(
    cmd: &ScsiCommand,
    outcome: Outcome,
    max_xmit: u32,
    max_burst: u32,
) -> (u32, impl Iterator<Item = ResponsePdu>) {
    let Outcome {
        status,
        sense,
        produced,
        write_needed,
        exp_data_sn,
    } = outcome;
    let edtl = cmd.expected_data_transfer_length;
    let (send, residual) = if cmd.read {
        (produced.min(edtl), Residual::of(edtl, produced))
    } else if let Some(needed) = write_needed {
        (0, Residual::of(edtl, needed))
    } else {
        // No data direction, or data the initiator did not ask for: send none (the R bit was
        // off), and report what would have come as overflow.
        let r = if produced > 0 || edtl > 0 {
            Residual::of(edtl, produced)
        } else {
            Residual::None
        };
        (0, r)
    };
    let collapse = !sense && send > 0;
    let (lun, itt) = (cmd.lun, cmd.itt);
    let data_ins = data_in_segments(send, max_xmit, max_burst).map(move |s| {
        let last = s.last && collapse;
        ResponsePdu {
            header: Header::DataIn(DataIn {
                final_bit: s.final_bit,
                status: last.then_some(status),
                lun,
                itt,
                ttt: Ttt::RESERVED,
                data_sn: s.data_sn,
                buffer_offset: s.offset,
                residual: if last { residual } else { Residual::None },
                ..Default::default()
            }),
            data_len: s.len,
            status: last,
        }
    });
    let scsi_response = (!collapse).then(|| ResponsePdu {
        header: Header::ScsiResponse(ScsiResponse {
            response: ServiceResponse::COMMAND_COMPLETED,
            status,
            itt,
            // After Data-In, ExpDataSN is the number of Data-In PDUs sent.
            exp_data_sn: if send > 0 {
                DataSn(data_in_segments(send, max_xmit, max_burst).count() as u32)
            } else {
                exp_data_sn
            },
            residual,
            ..Default::default()
        }),
        data_len: 0,
        status: true,
    });
    (send, data_ins.chain(scsi_response))
}

/// Negotiated parameters that govern a write's data transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteParams {
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub first_burst_length: u32,
    pub max_burst_length: u32,
    pub max_outstanding_r2t: u32,
    /// Our MaxRecvDataSegmentLength (a Data-Out may not carry more).
    pub max_recv_data_segment_length: u32,
    /// ErrorRecoveryLevel above 0: data lost to a digest error or a dropped PDU is asked for
    /// again with a recovery R2T (RFC 7143 §7.1.5, §7.2.1); at 0 the command fails instead.
    pub recovery: bool,
}

/// Recoveries (lost ranges asked for again) one write may need before it fails: an
/// initiator whose every PDU arrives damaged cannot keep a command alive for ever.
pub const RECOVERY_LIMIT: u32 = 16;

/// An R2T to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct R2tRequest {
    pub ttt: Ttt,
    pub r2t_sn: DataSn,
    pub offset: u32,
    pub len: u32,
}

/// Why a Data-Out (or immediate data) was refused. Each maps to a Reject reason or a
/// command failure in the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DataOutError {
    #[error("immediate data not allowed or longer than FirstBurstLength/EDTL")]
    BadImmediateData,
    #[error("unsolicited Data-Out not allowed (InitialR2T=Yes or command had F=1)")]
    UnsolicitedNotAllowed,
    #[error("Data-Out beyond FirstBurstLength or the expected transfer length")]
    BeyondBurst,
    #[error("Data-Out with unknown Target Transfer Tag")]
    UnknownTtt,
    #[error("Data-Out outside the range its R2T asked for")]
    OutsideR2t,
    #[error("Data-Out with wrong DataSN")]
    BadDataSn,
    #[error("Data-Out with wrong BufferOffset (DataPDUInOrder=Yes)")]
    BadOffset,
    #[error("Data-Out segment longer than MaxRecvDataSegmentLength")]
    TooLong,
    #[error("data lost too often: more than {RECOVERY_LIMIT} recoveries")]
    TooManyRecoveries,
    #[error("data lost and ErrorRecoveryLevel 0 cannot ask for it again")]
    NoRecovery,
}

#[derive(Clone, Copy, Debug)]
struct Sequence {
    ttt: Ttt,
    /// The R2T that opened it (none for the unsolicited sequence).
    r2t: Option<R2tRequest>,
    /// Next expected offset and DataSN within the sequence.
    next_offset: u32,
    next_data_sn: DataSn,
    end: u32,
}

/// Data-Out state of one write command.
#[derive(Debug)]
pub struct WriteTransfer {
    edtl: u32,
    params: WriteParams,
    received: u32,
    /// Unsolicited sequence, if one is expected.
    unsolicited: Option<Sequence>,
    /// Where R2Ts start and how far they have been issued.
    next_r2t_offset: u32,
    next_r2t_sn: DataSn,
    outstanding: Vec<Sequence>,
    /// Ranges lost (digest errors, dropped PDUs) still to be asked for, in offset order.
    holes: Vec<(u32, u32)>,
    recoveries: u32,
}

impl WriteTransfer {
    /// Start tracking a write of `edtl` bytes whose command PDU carried `immediate_len` bytes
    /// and had the F bit `cmd_final` (F=0 announces unsolicited Data-Out to follow).
    pub fn new(
        edtl: u32,
        immediate_len: u32,
        cmd_final: bool,
        mut params: WriteParams,
    ) -> Result<Self, DataOutError> {
        if params.recovery {
            // Recovery needs one sequence at a time (RFC 7143 §13.19: negotiation makes
            // MaxOutstandingR2T 1 above ErrorRecoveryLevel 0); a recovery R2T never overlaps
            // an open one.
            params.max_outstanding_r2t = 1;
        }
        let first_burst = params.first_burst_length.min(edtl);
        if immediate_len > 0 && (!params.immediate_data || immediate_len > first_burst) {
            return Err(DataOutError::BadImmediateData);
        }
        let unsolicited_end = if !cmd_final && !params.initial_r2t {
            first_burst
        } else {
            immediate_len
        };
        let unsolicited = (unsolicited_end > immediate_len).then_some(Sequence {
            ttt: Ttt::RESERVED,
            r2t: None,
            next_offset: immediate_len,
            next_data_sn: DataSn(0),
            end: unsolicited_end,
        });
        if !cmd_final && params.initial_r2t {
            // F=0 with InitialR2T=Yes announces data the target never allowed.
            return Err(DataOutError::UnsolicitedNotAllowed);
        }
        Ok(WriteTransfer {
            edtl,
            params,
            received: immediate_len,
            unsolicited,
            next_r2t_offset: unsolicited_end,
            next_r2t_sn: DataSn(0),
            outstanding: Vec::new(),
            holes: Vec::new(),
            recoveries: 0,
        })
    }

    /// The Expected Data Transfer Length.
    pub fn edtl(&self) -> u32 {
        self.edtl
    }

    /// All bytes of the expected transfer have arrived.
    pub fn is_complete(&self) -> bool {
        self.received >= self.edtl
    }

    /// Bytes received so far.
    pub fn received(&self) -> u32 {
        self.received
    }

    /// R2Ts to send now, with TTTs from `alloc_ttt`. R2Ts are only issued once the
    /// unsolicited burst is over, so DataSequenceInOrder holds.
    pub fn next_r2ts(&mut self, alloc_ttt: impl FnMut() -> Ttt) -> Vec<R2tRequest> {
        self.next_r2ts_limited(usize::MAX, alloc_ttt)
    }

    /// [`WriteTransfer::next_r2ts`], issuing at most `limit` R2Ts (for a target-wide cap on
    /// outstanding R2Ts; call again when [`WriteTransfer::wants_r2t`] says so).
    pub fn next_r2ts_limited(
        &mut self,
        limit: usize,
        mut alloc_ttt: impl FnMut() -> Ttt,
    ) -> Vec<R2tRequest> {
        let mut out = Vec::new();
        if self.unsolicited.is_some() {
            return out;
        }
        let burst = self.params.max_burst_length.max(512);
        while out.len() < limit && self.wants_r2t() {
            // Lost ranges first (recovery R2Ts, RFC 7143 §7.1.5), each at most a burst.
            let (offset, len) = match self.holes.first_mut() {
                Some(h) => {
                    let take = (h.0, (h.1 - h.0).min(burst));
                    h.0 += take.1;
                    if h.0 >= h.1 {
                        self.holes.remove(0);
                    }
                    take
                }
                None => {
                    let take = (
                        self.next_r2t_offset,
                        (self.edtl - self.next_r2t_offset).min(burst),
                    );
                    self.next_r2t_offset += take.1;
                    take
                }
            };
            let ttt = alloc_ttt();
            let r = R2tRequest {
                ttt,
                r2t_sn: self.next_r2t_sn,
                offset,
                len,
            };
            self.outstanding.push(Sequence {
                ttt,
                r2t: Some(r),
                next_offset: offset,
                next_data_sn: DataSn(0),
                end: offset + len,
            });
            self.next_r2t_sn = self.next_r2t_sn.next();
            out.push(r);
        }
        out
    }

    /// The R2T numbered `r2t_sn` again (an R2T SNACK, RFC 7143 §11.16.1), if it is still
    /// outstanding: its sequence starts over (what had arrived of it will come again).
    /// `None` for an R2T never sent or whose data is all in.
    pub fn resend_r2t(&mut self, r2t_sn: DataSn) -> Option<R2tRequest> {
        let seq = self
            .outstanding
            .iter_mut()
            .find(|s| s.r2t.is_some_and(|r| r.r2t_sn == r2t_sn))?;
        let r = seq.r2t?;
        let (from, to) = (r.offset, seq.next_offset);
        seq.next_offset = r.offset;
        seq.next_data_sn = DataSn(0);
        // What was lost of it comes again with it: no recovery R2T for that.
        let mut lost = 0;
        self.holes.retain(|h| {
            let inside = h.0 >= from && h.1 <= to;
            if inside {
                lost += h.1 - h.0;
            }
            !inside
        });
        self.received = self
            .received
            .saturating_sub((to - from).saturating_sub(lost));
        Some(r)
    }

    /// The transfer after a TASK REASSIGN (RFC 7143 §7.2.2, §11.5.1): the new connection asks
    /// for the whole of the data again by R2T (what arrived on the failed connection is not
    /// trusted to be complete: the initiator keeps a write's data until its status), R2TSNs
    /// continuing where they were. Returns the outstanding R2Ts it drops.
    pub fn reassigned(&mut self) -> usize {
        let dropped = self.outstanding.len();
        self.received = 0;
        self.unsolicited = None;
        self.next_r2t_offset = 0;
        self.outstanding.clear();
        self.holes.clear();
        dropped
    }

    /// R2Ts issued whose data has not all arrived.
    pub fn outstanding_r2ts(&self) -> usize {
        self.outstanding.len()
    }

    /// True when an R2T could be issued now: the unsolicited burst is over, data remains to be
    /// asked for, and fewer than MaxOutstandingR2T R2Ts are outstanding.
    pub fn wants_r2t(&self) -> bool {
        self.unsolicited.is_none()
            && (self.next_r2t_offset < self.edtl || !self.holes.is_empty())
            && (self.outstanding.len() as u32) < self.params.max_outstanding_r2t.max(1)
    }

    /// The R2TSN the next R2T will use (for the SCSI Response's ExpDataSN on writes).
    pub fn r2t_count(&self) -> DataSn {
        self.next_r2t_sn
    }

    /// Validate a Data-Out header carrying `len` bytes. On success the caller reads the payload
    /// into `[buffer_offset, buffer_offset + len)` of the command's buffer.
    /// (At ErrorRecoveryLevel 1, a DataSN gap in a sequence, left by a Data-Out dropped for
    /// a header digest error, RFC 7143 §7.9, is accepted: the skipped range is lost data.)
    pub fn accept(&mut self, h: &DataOut, len: u32) -> Result<(), DataOutError> {
        if len > self.params.max_recv_data_segment_length {
            return Err(DataOutError::TooLong);
        }
        let recovery = self.params.recovery;
        let seq = if h.ttt == Ttt::RESERVED {
            self.unsolicited
                .as_mut()
                .ok_or(DataOutError::UnsolicitedNotAllowed)?
        } else {
            self.outstanding
                .iter_mut()
                .find(|s| s.ttt == h.ttt)
                .ok_or(DataOutError::UnknownTtt)?
        };
        // A Data-Out dropped for its header (RFC 7143 §7.9) shows as a gap in DataSN and
        // offset: at ErrorRecoveryLevel 1 the gap is lost data, asked for again.
        let gap = recovery
            && h.data_sn.0.wrapping_sub(seq.next_data_sn.0) < (1 << 31)
            && h.data_sn != seq.next_data_sn
            && h.buffer_offset > seq.next_offset
            && h.buffer_offset <= seq.end;
        let gap = gap.then_some((seq.next_offset, h.buffer_offset));
        if gap.is_none() && h.data_sn != seq.next_data_sn {
            return Err(DataOutError::BadDataSn);
        }
        if gap.is_none() && h.buffer_offset != seq.next_offset {
            return Err(if h.ttt == Ttt::RESERVED {
                DataOutError::BadOffset
            } else {
                DataOutError::OutsideR2t
            });
        }
        let end = h
            .buffer_offset
            .checked_add(len)
            .ok_or(DataOutError::BeyondBurst)?;
        if end > seq.end {
            return Err(if h.ttt == Ttt::RESERVED {
                DataOutError::BeyondBurst
            } else {
                DataOutError::OutsideR2t
            });
        }
        if h.final_bit && end != seq.end {
            // F=1 before the sequence is complete: data would be missing with no way to ask
            // for it at ErrorRecoveryLevel 0.
            return Err(DataOutError::BadOffset);
        }
        seq.next_offset = end;
        seq.next_data_sn = h.data_sn.next();
        let done = end == seq.end;
        if let Some((from, to)) = gap {
            self.recover(from, to)?;
        }
        self.received += len;
        if done {
            if h.ttt == Ttt::RESERVED {
                self.unsolicited = None;
            } else {
                let ttt = h.ttt;
                self.outstanding.retain(|s| s.ttt != ttt);
            }
        }
        Ok(())
    }

    /// The payload of a Data-Out [`WriteTransfer::accept`] took, `len` bytes at `offset`,
    /// failed its data digest (RFC 7143 §7.8): the sequence goes on, and the range is asked
    /// for again by a recovery R2T once the sequence is over. At ErrorRecoveryLevel 0, or past
    /// [`RECOVERY_LIMIT`], an error: the command must fail.
    pub fn damaged(&mut self, offset: u32, len: u32) -> Result<(), DataOutError> {
        let len = len.min(self.received);
        self.recover(offset, offset.saturating_add(len))?;
        self.received -= len;
        Ok(())
    }

    /// Recoveries so far (lost ranges asked for again).
    pub fn recoveries(&self) -> u32 {
        self.recoveries
    }

    /// The immediate data was lost (a data digest error on the command PDU): its range is
    /// asked for again by R2T (RFC 7143 §7.8).
    pub fn lost_immediate(&mut self, len: u32) -> Result<(), DataOutError> {
        self.damaged(0, len)
    }

    /// Note `[start, end)` as lost, counting a recovery.
    fn recover(&mut self, start: u32, end: u32) -> Result<(), DataOutError> {
        if !self.params.recovery {
            return Err(DataOutError::NoRecovery);
        }
        self.recoveries += 1;
        if self.recoveries > RECOVERY_LIMIT {
            return Err(DataOutError::TooManyRecoveries);
        }
        if start < end {
            let at = self.holes.partition_point(|h| h.0 < start);
            self.holes.insert(at, (start, end));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> WriteParams {
        WriteParams {
            initial_r2t: false,
            immediate_data: true,
            first_burst_length: 65536,
            max_burst_length: 262144,
            max_outstanding_r2t: 2,
            max_recv_data_segment_length: 65536,
            recovery: false,
        }
    }

    #[test]
    fn data_in_respects_segment_and_burst_limits() {
        let segs: Vec<_> = data_in_segments(300_000, 65536, 131072).collect();
        assert_eq!(segs.len(), 5);
        assert_eq!(segs.iter().map(|s| s.len).sum::<u32>(), 300_000);
        assert!(segs.iter().all(|s| s.len <= 65536));
        assert_eq!(segs.iter().filter(|s| s.final_bit).count(), 3);
        assert!(segs[1].final_bit && segs[3].final_bit && segs[4].last);
        for (i, s) in segs.iter().enumerate() {
            assert_eq!(s.data_sn, DataSn(i as u32));
        }
        let mut off = 0;
        for s in &segs {
            assert_eq!(s.offset, off);
            off += s.len;
        }
    }

    #[test]
    fn limited_r2ts_resume_where_they_stopped() {
        // 1 MiB in 256 KiB bursts, MaxOutstandingR2T 2, issued one at a time.
        let mut w = WriteTransfer::new(1 << 20, 0, true, params()).unwrap();
        let mut ttt = 0;
        let mut alloc = || {
            ttt += 1;
            Ttt(ttt)
        };
        let first = w.next_r2ts_limited(1, &mut alloc);
        assert_eq!(first.len(), 1);
        assert_eq!((first[0].offset, first[0].r2t_sn), (0, DataSn(0)));
        assert!(w.wants_r2t());
        assert_eq!(w.outstanding_r2ts(), 1);
        let second = w.next_r2ts_limited(5, &mut alloc);
        assert_eq!(second.len(), 1, "MaxOutstandingR2T still applies");
        assert_eq!((second[0].offset, second[0].r2t_sn), (262144, DataSn(1)));
        assert!(!w.wants_r2t());
        assert_eq!(w.outstanding_r2ts(), 2);
        assert!(w.next_r2ts_limited(0, &mut alloc).is_empty());
    }

    #[test]
    fn empty_read_has_no_data_in() {
        assert_eq!(data_in_segments(0, 8192, 8192).count(), 0);
    }

    fn data_out(ttt: Ttt, sn: u32, off: u32, fin: bool) -> DataOut {
        DataOut {
            final_bit: fin,
            ttt,
            data_sn: DataSn(sn),
            buffer_offset: off,
            ..Default::default()
        }
    }

    #[test]
    fn immediate_then_unsolicited_then_r2ts() {
        let mut t = WriteTransfer::new(400_000, 8192, false, params()).unwrap();
        assert!(
            t.next_r2ts(|| Ttt(1)).is_empty(),
            "no R2T before the unsolicited burst ends"
        );
        t.accept(&data_out(Ttt::RESERVED, 0, 8192, false), 32768)
            .unwrap();
        t.accept(&data_out(Ttt::RESERVED, 1, 40960, true), 24576)
            .unwrap();
        let mut next = 100;
        let r2ts = t.next_r2ts(|| {
            next += 1;
            Ttt(next)
        });
        assert_eq!(r2ts.len(), 2);
        assert_eq!((r2ts[0].offset, r2ts[0].len), (65536, 262144));
        assert_eq!((r2ts[1].offset, r2ts[1].len), (327680, 72320));
        assert_eq!(r2ts[1].r2t_sn, DataSn(1));
        // Out-of-order DataSN inside an R2T sequence.
        assert_eq!(
            t.accept(&data_out(r2ts[1].ttt, 1, 327680, false), 100),
            Err(DataOutError::BadDataSn)
        );
        t.accept(&data_out(r2ts[1].ttt, 0, 327680, false), 65536)
            .unwrap();
        t.accept(&data_out(r2ts[1].ttt, 1, 393216, true), 6784)
            .unwrap();
        for i in 0..4u32 {
            t.accept(&data_out(r2ts[0].ttt, i, 65536 + i * 65536, i == 3), 65536)
                .unwrap();
        }
        assert!(t.is_complete());
    }

    #[test]
    fn refuses_data_beyond_first_burst_and_unknown_ttt() {
        let mut t = WriteTransfer::new(1 << 20, 0, false, params()).unwrap();
        assert_eq!(
            t.accept(&data_out(Ttt::RESERVED, 0, 0, false), 65537),
            Err(DataOutError::TooLong)
        );
        t.accept(&data_out(Ttt::RESERVED, 0, 0, false), 65000)
            .unwrap();
        assert_eq!(
            t.accept(&data_out(Ttt::RESERVED, 1, 65000, true), 1000),
            Err(DataOutError::BeyondBurst)
        );
        assert_eq!(
            t.accept(&data_out(Ttt(77), 0, 0, true), 10),
            Err(DataOutError::UnknownTtt)
        );
    }

    #[test]
    fn initial_r2t_forbids_unsolicited_data() {
        let p = WriteParams {
            initial_r2t: true,
            ..params()
        };
        assert_eq!(
            WriteTransfer::new(8192, 0, false, p).unwrap_err(),
            DataOutError::UnsolicitedNotAllowed
        );
        let mut t = WriteTransfer::new(8192, 0, true, p).unwrap();
        assert_eq!(
            t.accept(&data_out(Ttt::RESERVED, 0, 0, true), 8192),
            Err(DataOutError::UnsolicitedNotAllowed)
        );
        let r = t.next_r2ts(|| Ttt(5));
        assert_eq!(
            r,
            vec![R2tRequest {
                ttt: Ttt(5),
                r2t_sn: DataSn(0),
                offset: 0,
                len: 8192
            }]
        );
    }

    #[test]
    fn immediate_data_longer_than_first_burst_is_refused() {
        assert_eq!(
            WriteTransfer::new(1 << 20, 65540, true, params()).unwrap_err(),
            DataOutError::BadImmediateData
        );
        let p = WriteParams {
            immediate_data: false,
            ..params()
        };
        assert_eq!(
            WriteTransfer::new(4096, 4096, true, p).unwrap_err(),
            DataOutError::BadImmediateData
        );
    }

    #[test]
    fn immediate_data_alone_completes_a_small_write() {
        let t = WriteTransfer::new(4096, 4096, true, params()).unwrap();
        assert!(t.is_complete());
    }

    fn recovering() -> WriteParams {
        WriteParams {
            max_outstanding_r2t: 1,
            recovery: true,
            ..params()
        }
    }

    fn issue(t: &mut WriteTransfer, ttt: u32) -> Vec<R2tRequest> {
        t.next_r2ts(|| Ttt(ttt))
    }

    #[test]
    fn damaged_data_out_is_asked_for_again_after_its_sequence() {
        // 128 KiB by R2T in 64 KiB bursts; the second PDU of the first burst is damaged.
        let p = WriteParams {
            initial_r2t: true,
            max_burst_length: 65536,
            ..recovering()
        };
        let mut t = WriteTransfer::new(131072, 0, true, p).unwrap();
        let r = issue(&mut t, 1);
        assert_eq!((r[0].offset, r[0].len), (0, 65536));
        t.accept(&data_out(Ttt(1), 0, 0, false), 32768).unwrap();
        t.accept(&data_out(Ttt(1), 1, 32768, true), 32768).unwrap();
        t.damaged(32768, 32768).unwrap();
        assert_eq!(t.received(), 32768);
        // The next R2T is the recovery one: exactly the lost range, next R2TSN.
        let r = issue(&mut t, 2);
        assert_eq!(
            r,
            vec![R2tRequest {
                ttt: Ttt(2),
                r2t_sn: DataSn(1),
                offset: 32768,
                len: 32768
            }]
        );
        assert!(issue(&mut t, 3).is_empty(), "MaxOutstandingR2T 1");
        t.accept(&data_out(Ttt(2), 0, 32768, true), 32768).unwrap();
        let r = issue(&mut t, 4);
        assert_eq!(
            (r[0].offset, r[0].len, r[0].r2t_sn),
            (65536, 65536, DataSn(2))
        );
        t.accept(&data_out(Ttt(4), 0, 65536, true), 65536).unwrap();
        assert!(t.is_complete());
        assert_eq!(t.recoveries(), 1);
    }

    #[test]
    fn a_datasn_gap_is_lost_data_at_level_1_and_an_error_at_0() {
        for recovery in [false, true] {
            let p = WriteParams {
                recovery,
                ..recovering()
            };
            let mut t = WriteTransfer::new(65536, 0, false, p).unwrap();
            t.accept(&data_out(Ttt::RESERVED, 0, 0, false), 16384)
                .unwrap();
            // DataSN 1 (16 KiB at 16384) was dropped for its header digest.
            let r = t.accept(&data_out(Ttt::RESERVED, 2, 32768, false), 16384);
            if !recovery {
                assert_eq!(r, Err(DataOutError::BadDataSn));
                continue;
            }
            r.unwrap();
            t.accept(&data_out(Ttt::RESERVED, 3, 49152, true), 16384)
                .unwrap();
            let r = issue(&mut t, 9);
            assert_eq!((r[0].offset, r[0].len), (16384, 16384));
            t.accept(&data_out(Ttt(9), 0, 16384, true), 16384).unwrap();
            assert!(t.is_complete());
        }
    }

    #[test]
    fn damaged_immediate_data_is_asked_for_by_r2t() {
        let mut t = WriteTransfer::new(8192, 8192, true, recovering()).unwrap();
        assert!(t.is_complete());
        t.lost_immediate(8192).unwrap();
        assert!(!t.is_complete());
        let r = issue(&mut t, 5);
        assert_eq!((r[0].offset, r[0].len), (0, 8192));
        t.accept(&data_out(Ttt(5), 0, 0, true), 8192).unwrap();
        assert!(t.is_complete());
        let mut t0 = WriteTransfer::new(8192, 8192, true, params()).unwrap();
        assert_eq!(t0.lost_immediate(8192), Err(DataOutError::NoRecovery));
    }

    #[test]
    fn recoveries_are_bounded() {
        let mut t = WriteTransfer::new(4096, 0, true, recovering()).unwrap();
        for i in 0..=RECOVERY_LIMIT {
            let r = issue(&mut t, i + 1);
            assert_eq!((r[0].offset, r[0].len), (0, 4096));
            t.accept(&data_out(r[0].ttt, 0, 0, true), 4096).unwrap();
            let e = t.damaged(0, 4096);
            if i < RECOVERY_LIMIT {
                e.unwrap();
            } else {
                assert_eq!(e, Err(DataOutError::TooManyRecoveries));
            }
        }
    }

    #[test]
    fn an_r2t_sent_again_restarts_its_sequence() {
        let p = WriteParams {
            initial_r2t: true,
            ..recovering()
        };
        let mut t = WriteTransfer::new(65536, 0, true, p).unwrap();
        let r = issue(&mut t, 7);
        t.accept(&data_out(Ttt(7), 0, 0, false), 16384).unwrap();
        assert_eq!(t.resend_r2t(DataSn(1)), None, "never sent");
        assert_eq!(t.resend_r2t(DataSn(0)), Some(r[0]));
        assert_eq!(t.received(), 0);
        for i in 0..4u32 {
            t.accept(&data_out(Ttt(7), i, i * 16384, i == 3), 16384)
                .unwrap();
        }
        assert!(t.is_complete());
        assert_eq!(t.resend_r2t(DataSn(0)), None, "all its data is in");
    }
}
