use super::*;
use crate::pdu::{Lun, ScsiCommand};
use crate::task::{response_pdus, DataOutError, Outcome};
use crate::DataSn;
use proptest::prelude::*;

type C = Connection<Vec<u8>>;

fn params(first_burst: u32, max_burst: u32, max_r2t: u32, mrdsl: u32) -> WriteParams {
    WriteParams {
        initial_r2t: false,
        immediate_data: true,
        first_burst_length: first_burst,
        max_burst_length: max_burst,
        max_outstanding_r2t: max_r2t,
        max_recv_data_segment_length: mrdsl,
        recovery: false,
    }
}

fn data_out(itt: u32, ttt: Ttt, sn: u32, off: u32, fin: bool) -> DataOut {
    DataOut {
        final_bit: fin,
        itt: Itt(itt),
        ttt,
        data_sn: DataSn(sn),
        buffer_offset: off,
        ..Default::default()
    }
}

fn r2ts(c: &mut C) -> Vec<R2t> {
    std::iter::from_fn(|| c.poll_r2t()).collect()
}

#[test]
fn a_held_write_gets_no_r2t_until_it_is_delivered() {
    let mut c = C::new(params(65536, 262144, 4, 65536), 65536, 64);
    let t = c.begin_write(1 << 20, 0, true).unwrap();
    c.insert_write(Itt(1), Lun::default(), t, false, vec![]);
    assert!(r2ts(&mut c).is_empty());
    assert!(matches!(c.deliver_write(Itt(1)), Next::Waiting));
    let r = r2ts(&mut c);
    assert_eq!(r.len(), 4);
    assert_eq!(c.outstanding_r2ts(), 4);
    assert!(matches!(c.deliver_write(Itt(9)), Next::Gone));
}

#[test]
fn unsolicited_data_of_a_held_write_is_taken_and_it_completes_on_delivery() {
    let mut c = C::new(params(65536, 262144, 4, 65536), 65536, 64);
    // 64 KiB: 8 KiB immediate, the rest unsolicited (F=0 on the command).
    let t = c.begin_write(65536, 8192, false).unwrap();
    c.insert_write(Itt(2), Lun::default(), t, false, vec![]);
    let d = data_out(2, Ttt::RESERVED, 0, 8192, true);
    assert!(matches!(
        c.data_out(&d, 57344),
        DataOutPlan::Accept { offset: 8192 }
    ));
    assert!(
        matches!(c.after_data(Itt(2)), Next::Waiting),
        "not delivered yet"
    );
    assert!(matches!(c.deliver_write(Itt(2)), Next::Complete(w) if w.itt == Itt(2)));
    assert!(r2ts(&mut c).is_empty());
}

#[test]
fn data_out_for_no_write_or_out_of_sequence_is_refused() {
    let mut c = C::new(params(65536, 262144, 4, 65536), 65536, 64);
    assert!(matches!(
        c.data_out(&data_out(5, Ttt(1), 0, 0, true), 10),
        DataOutPlan::NoTask
    ));
    let t = c.begin_write(8192, 0, true).unwrap();
    c.insert_write(Itt(5), Lun::default(), t, true, vec![]);
    let r = r2ts(&mut c);
    assert_eq!(r.len(), 1);
    let bad = data_out(5, r[0].ttt, 1, 0, true);
    match c.data_out(&bad, 8192) {
        DataOutPlan::Refused(DataOutError::BadDataSn, w) => assert_eq!(w.itt, Itt(5)),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        c.outstanding_r2ts(),
        0,
        "the refused write's R2T no longer counts"
    );
    assert!(c.write_mut(Itt(5)).is_none());
}

#[test]
fn immediate_data_longer_than_the_transfer_is_refused() {
    let c = C::new(params(65536, 262144, 4, 65536), 65536, 64);
    assert_eq!(
        c.begin_write(4096, 8192, true).unwrap_err(),
        DataOutError::BadImmediateData
    );
}

#[test]
fn the_connection_budget_starves_writes_and_serves_them_oldest_first() {
    let mut c = C::new(params(512, 8192, 4, 8192), 8192, 2);
    for itt in 1..=2u32 {
        let t = c.begin_write(32768, 0, true).unwrap();
        c.insert_write(Itt(itt), Lun::default(), t, true, vec![]);
    }
    let r = r2ts(&mut c);
    assert_eq!(r.len(), 2, "budget of 2");
    assert!(r.iter().all(|r| r.itt == Itt(1)));
    // Answering write 1's first R2T frees one: the oldest starved write (1 again) gets it.
    let d = data_out(1, r[0].ttt, 0, 0, true);
    assert!(matches!(c.data_out(&d, 8192), DataOutPlan::Accept { .. }));
    assert!(matches!(c.after_data(Itt(1)), Next::Waiting));
    let more = r2ts(&mut c);
    assert_eq!(more.len(), 1);
    assert_eq!(c.outstanding_r2ts(), 2);
    // Dropping write 1 gives write 2 its R2Ts.
    assert!(c.take_where(|w| w.itt == Itt(1)).len() == 1);
    let w2 = r2ts(&mut c);
    assert_eq!(w2.len(), 2);
    assert!(w2.iter().all(|r| r.itt == Itt(2)));
}

#[test]
fn long_text_responses_continue_with_our_ttt() {
    let mut c = C::new(params(512, 8192, 4, 8192), 512, 2);
    let t = TextRequest {
        itt: Itt(3),
        ttt: Ttt::RESERVED,
        final_bit: true,
        ..Default::default()
    };
    let body = Bytes::from(vec![b'x'; 1200]);
    let (h, first) = c.text_respond(&t, body.clone());
    let Header::TextResponse(r) = h else {
        panic!("{h:?}")
    };
    assert!(r.cont && !r.final_bit && r.ttt != Ttt::RESERVED);
    assert_eq!(first.len(), 512);
    let next = TextRequest {
        ttt: r.ttt,
        ..t.clone()
    };
    let (_, second) = c.text_continue(&next).expect("continues");
    let (h3, third) = c.text_continue(&next).expect("continues");
    assert!(
        matches!(h3, Header::TextResponse(ref r) if r.final_bit && !r.cont && r.ttt == Ttt::RESERVED)
    );
    assert_eq!([first, second, third].concat(), body.to_vec());
    assert!(c.text_continue(&next).is_none(), "nothing left");
}

#[test]
fn pings_are_echoed_within_the_initiators_segment_limit() {
    let n = NopOut {
        itt: Itt(4),
        ..Default::default()
    };
    let (_, echo) = nop_in(&n, &Bytes::from(vec![1u8; 10000]), 8192).expect("answered");
    assert_eq!(echo.len(), 8192);
    let reply = NopOut {
        itt: Itt::RESERVED,
        ..Default::default()
    };
    assert!(nop_in(&reply, &Bytes::new(), 8192).is_none());
}

/// A write as a well-behaved initiator sends it: immediate data, unsolicited Data-Out up to
/// FirstBurstLength, then Data-Out answering each R2T, segments of random sizes within our
/// MaxRecvDataSegmentLength, sequences of different R2Ts interleaved arbitrarily.
#[derive(Debug, Clone)]
struct WriteCase {
    edtl: u32,
    immediate: u32,
    unsolicited: bool,
    first_burst: u32,
    max_burst: u32,
    max_r2t: u32,
    mrdsl: u32,
    budget: usize,
    picks: Vec<usize>,
    sizes: Vec<u32>,
}

fn write_case() -> impl Strategy<Value = WriteCase> {
    (
        1u32..300_000,
        512u32..70_000,
        512u32..300_000,
        1u32..5,
        512u32..70_000,
        1usize..6,
        any::<bool>(),
    )
        .prop_flat_map(
            |(edtl, first_burst, max_burst, max_r2t, mrdsl, budget, unsolicited)| {
                let max_burst = max_burst.max(first_burst);
                let fb = first_burst.min(edtl);
                (
                    Just((
                        edtl,
                        first_burst,
                        max_burst,
                        max_r2t,
                        mrdsl,
                        budget,
                        unsolicited,
                    )),
                    0..=fb.min(mrdsl),
                    proptest::collection::vec(0usize..16, 64),
                    proptest::collection::vec(1u32..70_000, 64),
                )
            },
        )
        .prop_map(
            |(
                (edtl, first_burst, max_burst, max_r2t, mrdsl, budget, unsolicited),
                immediate,
                picks,
                sizes,
            )| {
                WriteCase {
                    edtl,
                    immediate,
                    unsolicited,
                    first_burst,
                    max_burst,
                    max_r2t,
                    mrdsl,
                    budget,
                    picks,
                    sizes,
                }
            },
        )
}

proptest! {
    /// Every byte of a write arrives exactly once, the write completes exactly when the last
    /// byte is in, R2Ts stay within MaxOutstandingR2T per task and the connection's budget,
    /// and no R2T asks for more than MaxBurstLength.
    #[test]
    fn reassembles_any_well_behaved_write(w in write_case()) {
        let p = params(w.first_burst, w.max_burst, w.max_r2t, w.mrdsl);
        let mut c = C::new(p, 65536, w.budget);
        let t = c.begin_write(w.edtl, w.immediate, !w.unsolicited).unwrap();
        let mut have = vec![0u8; w.edtl as usize];
        for b in &mut have[..w.immediate as usize] {
            *b += 1;
        }
        if t.is_complete() {
            prop_assert_eq!(w.immediate, w.edtl);
            return Ok(());
        }
        c.insert_write(Itt(1), Lun::default(), t, true, vec![]);
        // Open sequences: (ttt, next offset, end, next DataSN).
        let mut open: Vec<(Ttt, u32, u32, u32)> = Vec::new();
        let unsolicited_end = if w.unsolicited { w.first_burst.min(w.edtl) } else { w.immediate };
        if unsolicited_end > w.immediate {
            open.push((Ttt::RESERVED, w.immediate, unsolicited_end, 0));
        }
        let mut step = 0usize;
        let mut done = false;
        while !done {
            for r in std::iter::from_fn(|| c.poll_r2t()) {
                prop_assert!(r.desired_data_transfer_length <= w.max_burst.max(512));
                open.push((r.ttt, r.buffer_offset, r.buffer_offset + r.desired_data_transfer_length, 0));
            }
            prop_assert!(c.outstanding_r2ts() <= w.budget);
            prop_assert!(open.iter().filter(|s| s.0 != Ttt::RESERVED).count() <= w.max_r2t as usize);
            prop_assert!(!open.is_empty(), "stalled with data missing");
            let i = w.picks[step % w.picks.len()] % open.len();
            let len = w.sizes[step % w.sizes.len()].min(w.mrdsl);
            step += 1;
            let (ttt, off, end, sn) = open[i];
            let len = len.min(end - off);
            let fin = off + len == end;
            let d = data_out(1, ttt, sn, off, fin);
            let plan = c.data_out(&d, len);
            prop_assert!(matches!(plan, DataOutPlan::Accept { offset } if offset == off), "{:?}", plan);
            for b in &mut have[off as usize..(off + len) as usize] {
                *b += 1;
            }
            if fin {
                open.remove(i);
            } else {
                open[i] = (ttt, off + len, end, sn + 1);
            }
            match c.after_data(Itt(1)) {
                Next::Complete(wr) => {
                    prop_assert_eq!(wr.received(), w.edtl);
                    done = true;
                }
                Next::Waiting => {}
                Next::Gone => prop_assert!(false, "write vanished"),
            }
        }
        prop_assert!(have.iter().all(|&b| b == 1), "every byte exactly once");
        prop_assert!(open.is_empty());
        prop_assert_eq!(c.outstanding_r2ts(), 0);
    }

    /// No PDU of a response, a Text answer or a ping echo carries more than the initiator's
    /// MaxRecvDataSegmentLength; the Data-In cover the data in order.
    #[test]
    fn no_pdu_exceeds_the_initiators_segment_limit(
        max_xmit in 512u32..300_000,
        max_burst in 512u32..2_000_000,
        produced in 0u32..3_000_000,
        edtl in 0u32..3_000_000,
        sense in any::<bool>(),
        text_len in 0usize..100_000,
    ) {
        let cmd = ScsiCommand { read: true, expected_data_transfer_length: edtl, ..Default::default() };
        let outcome = Outcome { status: 0, sense, produced, write_needed: None, exp_data_sn: DataSn(0) };
        let (send, pdus) = response_pdus(&cmd, outcome, max_xmit, max_burst);
        prop_assert_eq!(send, produced.min(edtl));
        let mut off = 0;
        let mut statuses = 0;
        for p in pdus {
            prop_assert!(p.data_len <= max_xmit);
            if let Header::DataIn(d) = &p.header {
                prop_assert_eq!(d.buffer_offset, off);
            }
            off += p.data_len;
            statuses += usize::from(p.status);
        }
        prop_assert_eq!(off, send);
        prop_assert_eq!(statuses, 1, "exactly one PDU carries the status");
        let mut c = C::new(params(512, 8192, 1, 8192), max_xmit, 1);
        let t = TextRequest { itt: Itt(1), ttt: Ttt::RESERVED, ..Default::default() };
        let body = Bytes::from(vec![b'k'; text_len]);
        let (mut h, first) = c.text_respond(&t, body);
        prop_assert!(first.len() <= max_xmit as usize);
        let mut total = first.len();
        while let Header::TextResponse(r) = &h {
            if !r.cont {
                break;
            }
            let (h2, seg) = c.text_continue(&TextRequest { ttt: r.ttt, ..t.clone() }).expect("more");
            prop_assert!(seg.len() <= max_xmit as usize);
            total += seg.len();
            h = h2;
        }
        prop_assert_eq!(total, text_len);
    }
}
