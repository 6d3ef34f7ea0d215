//! The Data-Out transfer tracker (`WriteTransfer`): arbitrary write parameters, immediate
//! data and a sequence of R2T requests and Data-Out headers, at ErrorRecoveryLevel 0 or 1
//! (`recovery`): Data-Outs whose payload is then reported damaged (a data digest error),
//! lost immediate data, DataSN gaps (a Data-Out dropped for its header digest) and R2Ts sent
//! again for an R2T SNACK. A shadow model checks the tracker: every accepted Data-Out lies
//! inside its R2T (or the unsolicited burst) and the transfer, no byte is accepted while it is
//! still held, `received` counts exactly the bytes accepted and not damaged since,
//! completion means every byte of the transfer is held, R2Ts (recovery R2Ts too) ask only for
//! bytes not held and not already asked for, within MaxBurstLength and MaxOutstandingR2T,
//! with R2TSNs counting from 0; at level 0 damage is `NoRecovery` and a gap `BadDataSn`; at
//! level 1 the recoveries are counted and the one past `RECOVERY_LIMIT` is
//! `TooManyRecoveries`.
#![no_main]

use arbitrary::Arbitrary;
use ironsan_proto::pdu::{DataOut, Ttt};
use ironsan_proto::task::{
    data_in_segments, DataOutError, R2tRequest, WriteParams, WriteTransfer, RECOVERY_LIMIT,
};
use ironsan_proto::DataSn;
use libfuzzer_sys::fuzz_target;

/// A Data-Out for the `r2t`-th issued R2T (or unsolicited when None), with deltas from the
/// expected DataSN/offset so most are near-valid.
#[derive(Arbitrary, Debug)]
struct DataArgs {
    r2t: Option<u8>,
    raw_ttt: Option<u32>,
    sn_delta: i8,
    off_delta: i16,
    len: u16,
    final_bit: bool,
}

#[derive(Arbitrary, Debug)]
enum Op {
    R2ts,
    Data(DataArgs),
    /// A Data-Out as `Data` whose payload, once accepted, fails its data digest:
    /// `damaged(offset, len)` for it, as the server calls it.
    Damage(DataArgs),
    /// A Data-Out whose DataSN is `1 + skip % 8` past the expected one and whose offset is
    /// `1 + gap` bytes past it: the PDUs between were dropped for their header digests.
    Gap {
        r2t: Option<u8>,
        raw_ttt: Option<u32>,
        skip: u8,
        gap: u16,
        len: u16,
        final_bit: bool,
    },
    /// The immediate data failed its data digest (`lost_immediate`); only as the first
    /// operation, where the server finds it (as it begins the write).
    LoseImmediate,
    /// An R2T SNACK for the R2T with this R2TSN (`resend_r2t`).
    ResendR2t(u8),
}

#[derive(Arbitrary, Debug)]
struct Input {
    edtl: u32,
    immediate_len: u32,
    cmd_final: bool,
    initial_r2t: bool,
    immediate_data: bool,
    recovery: bool,
    first_burst_length: u32,
    max_burst_length: u32,
    max_outstanding_r2t: u8,
    mrdsl: u32,
    ops: Vec<Op>,
}

/// Byte ranges `[start, end)`, disjoint, none empty.
#[derive(Default)]
struct Ranges(Vec<(u32, u32)>);

impl Ranges {
    fn total(&self) -> u64 {
        self.0.iter().map(|&(a, b)| u64::from(b - a)).sum()
    }
    fn overlaps(&self, s: u32, e: u32) -> bool {
        s < e && self.0.iter().any(|&(a, b)| s < b && a < e)
    }
    fn add(&mut self, s: u32, e: u32) {
        assert!(!self.overlaps(s, e), "bytes [{s}, {e}) accepted while held");
        if s < e {
            self.0.push((s, e));
        }
    }
    fn remove(&mut self, s: u32, e: u32) {
        let mut out = Vec::new();
        for &(a, b) in &self.0 {
            if b <= s || e <= a {
                out.push((a, b));
                continue;
            }
            if a < s {
                out.push((a, s));
            }
            if e < b {
                out.push((e, b));
            }
        }
        self.0 = out;
    }
}

/// One sequence the model knows of: the unsolicited one (no R2T) or an R2T's.
struct Seq {
    ttt: Ttt,
    r2t: Option<R2tRequest>,
    start: u32,
    end: u32,
    /// The next (DataSN, offset) a well-behaved initiator sends.
    next_sn: u32,
    next_off: u32,
    open: bool,
}

/// The shadow model.
struct Model {
    edtl: u32,
    recovery: bool,
    held: Ranges,
    /// Index 0: the unsolicited sequence; then the R2Ts in R2TSN order.
    seqs: Vec<Seq>,
    recoveries: u32,
    /// The transfer failed (the server fails the command): no more operations.
    failed: bool,
}

impl Model {
    fn seq(&self, ttt: Ttt) -> Option<&Seq> {
        self.seqs.iter().find(|s| s.ttt == ttt)
    }
    fn r2ts(&self) -> impl Iterator<Item = &Seq> {
        self.seqs.iter().skip(1)
    }
    fn open_r2ts(&self) -> usize {
        self.r2ts().filter(|s| s.open).count()
    }

    /// Count a recovery; true when it is one too many (the call must have failed).
    fn recover(&mut self) -> bool {
        self.recoveries += 1;
        self.recoveries > RECOVERY_LIMIT
    }

    /// `t.accept(h, len)`, then `t.damaged` for it when `damage`.
    fn data_out(&mut self, t: &mut WriteTransfer, h: &DataOut, len: u32, damage: bool) {
        let r = t.accept(h, len);
        let known = self
            .seq(h.ttt)
            .map(|s| (s.open, s.next_sn, s.next_off, s.end));
        let gap = known.is_some_and(|(_, sn, _, _)| h.data_sn.0 != sn);
        match r {
            Ok(()) => {}
            Err(DataOutError::TooManyRecoveries) => {
                assert!(self.recovery && gap, "TooManyRecoveries without a gap");
                assert!(self.recover(), "TooManyRecoveries before the limit");
                self.failed = true;
                return;
            }
            Err(DataOutError::NoRecovery) => panic!("accept answered NoRecovery"),
            Err(_) => return,
        }
        let Some((open, next_sn, next_off, seq_end)) = known else {
            panic!("Data-Out accepted for TTT {:?}, never issued", h.ttt);
        };
        assert!(open, "Data-Out accepted for a finished sequence");
        let (s, e) = (h.buffer_offset, h.buffer_offset + len);
        assert!(
            e <= self.edtl,
            "accepted Data-Out [{s}, {e}) beyond EDTL {}",
            self.edtl
        );
        assert!(
            e <= seq_end,
            "accepted Data-Out [{s}, {e}) beyond its sequence's end"
        );
        if gap {
            assert!(
                self.recovery,
                "a DataSN gap accepted at ErrorRecoveryLevel 0"
            );
            assert!(
                h.data_sn.0.wrapping_sub(next_sn) < 1 << 31,
                "DataSN went back"
            );
            assert!(s > next_off, "a DataSN gap with no data missing");
            assert!(!self.recover(), "a gap past the recovery limit accepted");
        } else {
            assert_eq!(s, next_off, "Data-Out accepted at an offset not the next");
        }
        self.held.add(s, e);
        let seq = self
            .seqs
            .iter_mut()
            .find(|q| q.ttt == h.ttt)
            .expect("known");
        seq.next_sn = h.data_sn.0.wrapping_add(1);
        seq.next_off = e;
        if e == seq.end {
            seq.open = false;
        }
        assert_eq!(t.received() as u64, self.held.total());
        if damage {
            let d = t.damaged(s, len);
            if !self.recovery {
                assert_eq!(d, Err(DataOutError::NoRecovery));
                self.failed = true;
            } else if self.recover() {
                assert_eq!(d, Err(DataOutError::TooManyRecoveries));
                self.failed = true;
            } else {
                assert_eq!(d, Ok(()));
                self.held.remove(s, e);
            }
        }
    }
}

fn data_out(ttt: Ttt, sn: u32, off: u32, final_bit: bool) -> DataOut {
    DataOut {
        final_bit,
        ttt,
        data_sn: DataSn(sn),
        buffer_offset: off,
        ..Default::default()
    }
}

fn pick_ttt(m: &Model, r2t: &Option<u8>, raw_ttt: &Option<u32>) -> Ttt {
    let n = m.seqs.len() - 1;
    match (r2t, raw_ttt) {
        (Some(k), _) if n > 0 => m.seqs[1 + *k as usize % n].ttt,
        (_, Some(x)) => Ttt(*x),
        _ => Ttt::RESERVED,
    }
}

fuzz_target!(|i: Input| {
    let edtl = i.edtl % (1 << 22);
    let params = WriteParams {
        initial_r2t: i.initial_r2t,
        immediate_data: i.immediate_data,
        first_burst_length: i.first_burst_length % (1 << 21),
        max_burst_length: i.max_burst_length % (1 << 21),
        // Above level 0 MaxOutstandingR2T is negotiated to 1 (RFC 7143 §13.19, as our
        // negotiation answers): the only setting recovery is used with.
        max_outstanding_r2t: if i.recovery {
            1
        } else {
            i.max_outstanding_r2t as u32
        },
        max_recv_data_segment_length: i.mrdsl % (1 << 20),
        recovery: i.recovery,
    };
    let imm = i.immediate_len % (1 << 22);
    let Ok(mut t) = WriteTransfer::new(edtl, imm, i.cmd_final, params) else {
        return;
    };
    assert!(imm <= edtl);
    let unsolicited_end = if !i.cmd_final && !params.initial_r2t {
        params.first_burst_length.min(edtl)
    } else {
        imm
    };
    let mut m = Model {
        edtl,
        recovery: params.recovery,
        held: Ranges::default(),
        seqs: vec![Seq {
            ttt: Ttt::RESERVED,
            r2t: None,
            start: imm,
            end: unsolicited_end,
            next_sn: 0,
            next_off: imm,
            open: unsolicited_end > imm,
        }],
        recoveries: 0,
        failed: false,
    };
    m.held.add(0, imm);
    let mut next_ttt = 1u32;
    for (n, op) in i.ops.iter().take(256).enumerate() {
        match op {
            Op::R2ts => {
                let new = t.next_r2ts(|| {
                    next_ttt += 1;
                    Ttt(next_ttt)
                });
                for r in &new {
                    assert!(!m.seqs[0].open, "R2T during the unsolicited burst");
                    assert!(r.len > 0);
                    let (s, e) = (r.offset, r.offset + r.len);
                    assert!(e <= edtl, "R2T beyond EDTL");
                    assert!(r.len <= params.max_burst_length.max(512));
                    assert_eq!(r.r2t_sn, DataSn(m.seqs.len() as u32 - 1), "R2TSN");
                    assert!(!m.held.overlaps(s, e), "R2T for [{s}, {e}), bytes held");
                    for q in m.r2ts().filter(|q| q.open) {
                        assert!(e <= q.start || q.end <= s, "R2T over an open R2T's range");
                    }
                    m.seqs.push(Seq {
                        ttt: r.ttt,
                        r2t: Some(*r),
                        start: s,
                        end: e,
                        next_sn: 0,
                        next_off: s,
                        open: true,
                    });
                }
                assert!(m.open_r2ts() <= params.max_outstanding_r2t.max(1) as usize);
            }
            Op::Data(a) | Op::Damage(a) => {
                let ttt = pick_ttt(&m, &a.r2t, &a.raw_ttt);
                let (sn, off) = m.seq(ttt).map_or((0, 0), |s| (s.next_sn, s.next_off));
                let h = data_out(
                    ttt,
                    sn.wrapping_add(a.sn_delta as i32 as u32),
                    off.wrapping_add(a.off_delta as i32 as u32),
                    a.final_bit,
                );
                m.data_out(&mut t, &h, a.len as u32, matches!(op, Op::Damage(_)));
            }
            Op::Gap {
                r2t,
                raw_ttt,
                skip,
                gap,
                len,
                final_bit,
            } => {
                let ttt = pick_ttt(&m, r2t, raw_ttt);
                let (sn, off) = m.seq(ttt).map_or((0, 0), |s| (s.next_sn, s.next_off));
                let h = data_out(
                    ttt,
                    sn.wrapping_add(1 + u32::from(skip % 8)),
                    off.wrapping_add(1 + u32::from(*gap)),
                    *final_bit,
                );
                let len = *len as u32;
                if !m.recovery {
                    let r = t.accept(&h, len);
                    assert!(
                        matches!(
                            r,
                            Err(DataOutError::BadDataSn
                                | DataOutError::TooLong
                                | DataOutError::UnknownTtt
                                | DataOutError::UnsolicitedNotAllowed)
                        ),
                        "a DataSN gap at ErrorRecoveryLevel 0: {r:?}"
                    );
                } else {
                    m.data_out(&mut t, &h, len, false);
                }
            }
            Op::LoseImmediate => {
                if n == 0 && imm > 0 {
                    let r = t.lost_immediate(imm);
                    if !m.recovery {
                        assert_eq!(r, Err(DataOutError::NoRecovery));
                        m.failed = true;
                    } else {
                        assert!(!m.recover());
                        assert_eq!(r, Ok(()));
                        m.held.remove(0, imm);
                    }
                }
            }
            Op::ResendR2t(k) => {
                let sn = u32::from(*k);
                let want = m
                    .seqs
                    .get(1 + *k as usize)
                    .filter(|q| q.open)
                    .map(|q| q.r2t);
                let got = t.resend_r2t(DataSn(sn));
                match want {
                    None => assert_eq!(got, None, "R2T {sn} sent again, none open"),
                    Some(r) => {
                        assert_eq!(got, r, "R2T {sn} sent again differs");
                        let q = &mut m.seqs[1 + *k as usize];
                        q.next_sn = 0;
                        q.next_off = q.start;
                        let (s, e) = (q.start, q.end);
                        m.held.remove(s, e);
                    }
                }
            }
        }
        if m.failed {
            break;
        }
        assert_eq!(t.received() as u64, m.held.total(), "received");
        assert!(m.held.total() <= edtl as u64);
        assert_eq!(t.recoveries(), m.recoveries);
        assert_eq!(t.outstanding_r2ts(), m.open_r2ts());
        assert_eq!(t.r2t_count(), DataSn(m.seqs.len() as u32 - 1));
        if t.is_complete() {
            // Disjoint ranges inside [0, EDTL) adding up to EDTL cover it.
            assert_eq!(m.held.total(), edtl as u64, "complete with bytes missing");
        }
    }
    // Data-In arithmetic on the same numbers.
    let mut total = 0u64;
    for s in data_in_segments(
        edtl,
        params.max_recv_data_segment_length,
        params.max_burst_length,
    )
    .take(20_000)
    {
        assert_eq!(s.offset as u64, total);
        total += s.len as u64;
        assert!(s.len > 0);
    }
});
