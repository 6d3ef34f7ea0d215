//! The Data-Out transfer tracker (`WriteTransfer`): arbitrary write parameters, immediate
//! data and a sequence of R2T requests and Data-Out headers. A shadow model checks the
//! tracker: every accepted Data-Out lies inside the expected transfer, no byte is accepted
//! twice, `received` counts exactly the accepted bytes, completion means every byte arrived,
//! and R2Ts respect MaxBurstLength, MaxOutstandingR2T and the transfer length.
#![no_main]

use arbitrary::Arbitrary;
use ironsan_proto::pdu::{DataOut, Ttt};
use ironsan_proto::task::{data_in_segments, WriteParams, WriteTransfer};
use ironsan_proto::DataSn;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Op {
    R2ts,
    /// Data-Out for the `r2t`-th issued R2T (or unsolicited when None), with deltas from the
    /// expected DataSN/offset so most are near-valid.
    Data {
        r2t: Option<u8>,
        raw_ttt: Option<u32>,
        sn_delta: i8,
        off_delta: i16,
        len: u16,
        final_bit: bool,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    edtl: u32,
    immediate_len: u32,
    cmd_final: bool,
    initial_r2t: bool,
    immediate_data: bool,
    first_burst_length: u32,
    max_burst_length: u32,
    max_outstanding_r2t: u8,
    mrdsl: u32,
    ops: Vec<Op>,
}

fuzz_target!(|i: Input| {
    let edtl = i.edtl % (1 << 22);
    let params = WriteParams {
        initial_r2t: i.initial_r2t,
        immediate_data: i.immediate_data,
        first_burst_length: i.first_burst_length % (1 << 21),
        max_burst_length: i.max_burst_length % (1 << 21),
        max_outstanding_r2t: i.max_outstanding_r2t as u32,
        max_recv_data_segment_length: i.mrdsl % (1 << 20),
        recovery: false,
    };
    let imm = i.immediate_len % (1 << 22);
    let Ok(mut t) = WriteTransfer::new(edtl, imm, i.cmd_final, params) else {
        return;
    };
    assert!(imm <= edtl);
    // Shadow state: accepted byte ranges and, per R2T, the expected next (DataSN, offset).
    let mut got: Vec<(u32, u32)> = vec![(0, imm)];
    let mut received = imm as u64;
    let mut r2ts = Vec::new();
    let mut next_ttt = 1u32;
    let mut expect: Vec<(Ttt, u32, u32)> = vec![(Ttt::RESERVED, 0, imm)];
    let mut last_r2t_sn: Option<DataSn> = None;
    for op in i.ops.iter().take(256) {
        match op {
            Op::R2ts => {
                let new = t.next_r2ts(|| {
                    next_ttt += 1;
                    Ttt(next_ttt)
                });
                for r in &new {
                    assert!(r.len > 0);
                    assert!(
                        r.offset as u64 + r.len as u64 <= edtl as u64,
                        "R2T beyond EDTL"
                    );
                    assert!(r.len <= params.max_burst_length.max(512));
                    if let Some(p) = last_r2t_sn {
                        assert_eq!(r.r2t_sn, p.next());
                    }
                    last_r2t_sn = Some(r.r2t_sn);
                    expect.push((r.ttt, 0, r.offset));
                }
                r2ts.extend(new);
            }
            Op::Data {
                r2t,
                raw_ttt,
                sn_delta,
                off_delta,
                len,
                final_bit,
            } => {
                let ttt = match (r2t, raw_ttt) {
                    (Some(k), _) if !r2ts.is_empty() => r2ts[*k as usize % r2ts.len()].ttt,
                    (_, Some(x)) => Ttt(*x),
                    _ => Ttt::RESERVED,
                };
                let (sn, off) = expect
                    .iter()
                    .find(|e| e.0 == ttt)
                    .map_or((0, 0), |e| (e.1, e.2));
                let h = DataOut {
                    final_bit: *final_bit,
                    ttt,
                    data_sn: DataSn(sn.wrapping_add(*sn_delta as i32 as u32)),
                    buffer_offset: off.wrapping_add(*off_delta as i32 as u32),
                    ..Default::default()
                };
                let len = *len as u32;
                if t.accept(&h, len).is_ok() {
                    let (s, e) = (h.buffer_offset, h.buffer_offset + len);
                    assert!(e <= edtl, "accepted Data-Out [{s}, {e}) beyond EDTL {edtl}");
                    assert!(len <= params.max_recv_data_segment_length);
                    for &(a, b) in &got {
                        assert!(
                            e <= a || s >= b || s == e,
                            "bytes [{s}, {e}) accepted twice"
                        );
                    }
                    got.push((s, e));
                    received += len as u64;
                    if let Some(x) = expect.iter_mut().find(|x| x.0 == ttt) {
                        x.1 = h.data_sn.0.wrapping_add(1);
                        x.2 = e;
                    }
                }
            }
        }
        assert_eq!(t.received() as u64, received);
        assert!(received <= edtl as u64);
        if t.is_complete() {
            assert_eq!(received, edtl as u64, "complete with bytes missing");
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
