use super::*;
use crate::pdu::{
    sense_segment, Lun, NopIn, ScsiCommand, SnMode, StatSnCounter, TaskMgmtResponse,
    TmfResponseCode,
};
use crate::task::{data_in_segments, response_pdus, Outcome};
use proptest::prelude::*;
use std::collections::HashMap as Map;

type R = Retained;

const EXP: CmdSn = CmdSn(100);
const MAX: CmdSn = CmdSn(163);

/// A connection's writer as the server has it: A bit, stamp, record.
struct Conn {
    counter: StatSnCounter,
    r: R,
}

impl Conn {
    fn new(limit: usize) -> Self {
        Self::at(limit, StatSn(1))
    }
    fn at(limit: usize, first: StatSn) -> Self {
        Conn {
            counter: StatSnCounter(first),
            r: R::new(limit),
        }
    }
    fn next_stat_sn(&self) -> StatSn {
        self.counter.0
    }
    fn send(&mut self, mut h: Header, data: Bytes, status: bool) -> Pdu {
        mark_ack(&mut h);
        let mode = if status {
            SnMode::Status
        } else {
            SnMode::Current
        };
        self.counter.stamp(&mut h, mode, Some((EXP, MAX)));
        self.r.record(&h, &data, status);
        Pdu::new(h, data)
    }
    /// A read of `len` bytes answered with `response_pdus` (sense data: a separate SCSI
    /// Response).
    fn read(&mut self, itt: u32, len: u32, sense: bool, max_xmit: u32, max_burst: u32) -> Vec<Pdu> {
        let data = pattern(itt, len);
        let cmd = ScsiCommand {
            read: true,
            final_bit: true,
            lun: Lun::from_number(3),
            itt: Itt(itt),
            expected_data_transfer_length: len + 512,
            ..Default::default()
        };
        let outcome = Outcome {
            status: if sense { 2 } else { 0 },
            sense,
            produced: len,
            write_needed: None,
            exp_data_sn: DataSn(0),
        };
        let (_, pdus) = response_pdus(&cmd, outcome, max_xmit, max_burst);
        let mut off = 0usize;
        let mut out = Vec::new();
        for p in pdus {
            let seg = if p.data_len > 0 {
                let s = data.slice(off..off + p.data_len as usize);
                off += p.data_len as usize;
                s
            } else if matches!(p.header, Header::ScsiResponse(_)) && sense {
                sense_segment(&[0x70, 0, 5, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24, 0])
            } else {
                Bytes::new()
            };
            out.push(self.send(p.header, seg, p.status));
        }
        out
    }
    fn nop_response(&mut self, itt: u32) -> Pdu {
        let h = Header::NopIn(NopIn {
            itt: Itt(itt),
            ttt: Ttt::RESERVED,
            ..Default::default()
        });
        self.send(h, Bytes::from_static(b"ping data"), true)
    }
    fn tmf_response(&mut self, itt: u32) -> Pdu {
        let h = Header::TaskMgmtResponse(TaskMgmtResponse {
            response: TmfResponseCode::COMPLETE,
            itt: Itt(itt),
            ..Default::default()
        });
        self.send(h, Bytes::new(), true)
    }
}

fn pattern(itt: u32, len: u32) -> Bytes {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ itt.wrapping_mul(7)) as u8)
        .collect::<Vec<u8>>()
        .into()
}

fn wire(p: &Pdu) -> (Vec<u8>, Bytes) {
    (p.bhs().0.to_vec(), p.data.clone())
}

fn wires(v: &[Pdu]) -> Vec<(Vec<u8>, Bytes)> {
    v.iter().map(wire).collect()
}

fn resent(r: Result<Snacked, SnackRefused>) -> Vec<Pdu> {
    match r {
        Ok(Snacked::Resend(v)) => v,
        other => panic!("expected PDUs, got {other:?}"),
    }
}

fn snack(snack_type: u8, itt: u32, ttt: u32, beg_run: u32, run_length: u32) -> SnackRequest {
    SnackRequest {
        snack_type,
        itt: Itt(itt),
        ttt: Ttt(ttt),
        beg_run,
        run_length,
        ..Default::default()
    }
}

fn data_snack(itt: u32, beg: u32, run: u32) -> SnackRequest {
    snack(SNACK_DATA_R2T, itt, RESERVED_TAG, beg, run)
}
fn status_snack(beg: StatSn, run: u32) -> SnackRequest {
    snack(SNACK_STATUS, RESERVED_TAG, RESERVED_TAG, beg.0, run)
}
fn data_ack(itt: u32, beg: u32) -> SnackRequest {
    snack(SNACK_DATA_ACK, RESERVED_TAG, itt, beg, 0)
}
fn r_data(itt: u32, tag: u32) -> SnackRequest {
    snack(SNACK_R_DATA, itt, tag, 0, 0)
}

fn stat_sn(p: &Pdu) -> StatSn {
    p.header.target_sn().map(|s| s.stat_sn).unwrap_or_default()
}

fn data_in(p: &Pdu) -> &DataIn {
    match &p.header {
        Header::DataIn(d) => d,
        h => panic!("not a Data-In: {h:?}"),
    }
}

/// The store's own accounting matches what it holds, and every bound holds.
fn check(r: &R) {
    let task_bytes: usize = r
        .tasks
        .values()
        .map(|t| t.data.iter().map(|(_, d)| d.len()).sum::<usize>())
        .sum();
    for t in r.tasks.values() {
        assert_eq!(t.bytes, t.data.iter().map(|(_, d)| d.len()).sum::<usize>());
        for (k, (h, _)) in t.data.iter().enumerate() {
            assert_eq!(h.data_sn, t.first().plus(k as u32), "consecutive DataSNs");
        }
    }
    let own: usize = r
        .statuses
        .iter()
        .map(|s| match &s.body {
            Body::Own(_, d) => d.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(r.bytes, task_bytes + own);
    assert!(r.bytes <= r.limit, "{} > {}", r.bytes, r.limit);
    assert!(r.statuses.len() <= MAX_STATUSES);
    let open = r.tasks.values().filter(|t| t.status.is_none()).count();
    assert_eq!(open, r.open_live);
    assert!(open <= MAX_OPEN_TASKS);
    for w in r.statuses.iter().collect::<Vec<_>>().windows(2) {
        assert!(w[0].stat_sn.lt(w[1].stat_sn), "statuses in StatSN order");
    }
    for (itt, t) in &r.tasks {
        if let Some((sn, _)) = t.status {
            let i = r.status_index(sn).expect("a task's status is queued");
            assert_eq!(r.statuses[i].task, Some((*itt, t.gen)));
        }
    }
}

#[test]
fn a_bit_and_ttt_on_sequence_ends_without_status() {
    let mut c = Conn::new(usize::MAX);
    // 300000 bytes, 64 KiB PDUs, 128 KiB bursts: F on PDUs 1, 3 and 4; 4 carries the status.
    let pdus = c.read(0x42, 300_000, false, 65536, 131072);
    let acks: Vec<bool> = pdus.iter().map(|p| data_in(p).ack).collect();
    assert_eq!(acks, [false, true, false, true, false]);
    for p in &pdus {
        let d = data_in(p);
        let want = if d.ack { Ttt(0x42) } else { Ttt::RESERVED };
        assert_eq!(d.ttt, want, "TTT is the ITT exactly when A is set");
    }
    // With sense data, the last Data-In concludes the transfer and the status follows it.
    let pdus = c.read(0x43, 8192, true, 65536, 131072);
    assert!(data_in(&pdus[0]).ack && data_in(&pdus[0]).final_bit);
    assert!(matches!(pdus[1].header, Header::ScsiResponse(_)));
    // Nothing else is touched.
    let mut h = Header::NopIn(NopIn::default());
    assert!(!mark_ack(&mut h));
    assert_eq!(h, Header::NopIn(NopIn::default()));
    check(&c.r);
}

#[test]
fn scsi_response_carries_the_snack_tag_in_bytes_20_to_24() {
    let h = Header::ScsiResponse(ScsiResponse {
        snack_tag: 0xdead_beef,
        ..Default::default()
    });
    let b = h.encode();
    assert_eq!(&b.0[20..24], &0xdead_beefu32.to_be_bytes());
    assert_eq!(Header::decode(&b), h);
}

#[test]
fn data_snack_resends_data_in_exactly_as_sent() {
    let mut c = Conn::new(usize::MAX);
    let pdus = c.read(7, 40_000, false, 8192, 16384);
    assert_eq!(pdus.len(), 5);
    let got = resent(c.r.snack(&data_snack(7, 1, 2), 8192));
    assert_eq!(wires(&got), wires(&pdus[1..3]));
    let got = resent(c.r.snack(&data_snack(7, 3, 0), 8192));
    assert_eq!(
        wires(&got),
        wires(&pdus[3..]),
        "RunLength 0: all from BegRun"
    );
    let got = resent(c.r.snack(&data_snack(7, 0, 0), 8192));
    assert_eq!(
        wires(&got),
        wires(&pdus),
        "BegRun 0, RunLength 0: all unacknowledged"
    );
    let got = resent(c.r.snack(&data_snack(7, 4, 1), 8192));
    assert_eq!(
        wires(&got),
        wires(&pdus[4..]),
        "the status-carrying Data-In too"
    );
    // No Data-In for this tag: perhaps R2Ts, the caller's business.
    assert_eq!(
        c.r.snack(&data_snack(8, 0, 0), 8192),
        Ok(Snacked::NotRetained)
    );
    check(&c.r);
}

#[test]
fn status_snack_resends_every_kind_of_status_exactly_as_sent() {
    let mut c = Conn::new(usize::MAX);
    let first = c.next_stat_sn();
    let read = c.read(1, 10_000, false, 8192, 65536); // status in the last Data-In
    let sensed = c.read(2, 4096, true, 8192, 65536); // Data-In, then SCSI Response
    let nop = c.nop_response(3);
    let tmf = c.tmf_response(4);
    let empty = c.read(5, 0, false, 8192, 65536); // SCSI Response only
    let statuses = vec![
        read[1].clone(),
        sensed[1].clone(),
        nop,
        tmf,
        empty[0].clone(),
    ];
    for (k, s) in statuses.iter().enumerate() {
        assert_eq!(stat_sn(s), first.plus(k as u32));
    }
    let got = resent(c.r.snack(&status_snack(first, 0), 8192));
    assert_eq!(wires(&got), wires(&statuses));
    let got = resent(c.r.snack(&status_snack(first.plus(1), 2), 8192));
    assert_eq!(wires(&got), wires(&statuses[1..3]));
    let got = resent(c.r.snack(&status_snack(StatSn(0), 0), 8192));
    assert_eq!(wires(&got), wires(&statuses), "0/0: all unacknowledged");
    // Data-In without status took no StatSN: the R2T-free Data SNACK still finds it.
    let got = resent(c.r.snack(&data_snack(2, 0, 0), 8192));
    assert_eq!(wires(&got), wires(&sensed[..1]));
    check(&c.r);
}

#[test]
fn exp_stat_sn_acknowledges_statuses_and_their_tasks() {
    let mut c = Conn::new(usize::MAX);
    let a = c.read(1, 20_000, false, 8192, 65536);
    let b = c.read(2, 20_000, true, 8192, 65536);
    let nop = c.nop_response(9);
    let before = c.r.bytes();
    // Acknowledge a's status only.
    c.r.ack(stat_sn(&a[2]).next());
    assert_eq!(
        c.r.snack(&data_snack(1, 0, 0), 8192),
        Ok(Snacked::NotRetained)
    );
    assert_eq!(
        c.r.snack(&status_snack(stat_sn(&a[2]), 1), 8192),
        Err(SnackRefused::StatusAcknowledged(stat_sn(&a[2])))
    );
    assert_eq!(c.r.bytes(), before - 20_000);
    assert_eq!(
        wires(&resent(c.r.snack(&data_snack(2, 0, 0), 8192))),
        wires(&b[..3])
    );
    // An old ExpStatSN changes nothing.
    c.r.ack(StatSn(0));
    assert_eq!(c.r.statuses(), 2);
    // Beyond what was sent: all of it.
    c.r.ack(stat_sn(&nop).plus(1000));
    assert_eq!((c.r.statuses(), c.r.tasks(), c.r.bytes()), (0, 0, 0));
    assert_eq!(
        c.r.snack(&status_snack(stat_sn(&nop), 0), 8192),
        Err(SnackRefused::StatusAcknowledged(stat_sn(&nop)))
    );
    assert_eq!(
        c.r.snack(&status_snack(StatSn(0), 0), 8192),
        Ok(Snacked::Resend(vec![]))
    );
    check(&c.r);
}

#[test]
fn data_ack_releases_data_in_below_beg_run() {
    let mut c = Conn::new(usize::MAX);
    // 4 bursts of 2 PDUs: A on DataSN 1, 3, 5.
    let pdus = c.read(5, 65536, false, 8192, 16384);
    assert_eq!(pdus.len(), 8);
    assert_eq!(c.r.snack(&data_ack(5, 2), 8192), Ok(Snacked::DataAcked));
    assert_eq!(c.r.bytes(), 65536 - 16384);
    assert_eq!(
        c.r.snack(&data_snack(5, 1, 1), 8192),
        Err(SnackRefused::DataAcknowledged {
            itt: Itt(5),
            data_sn: DataSn(1)
        })
    );
    let got = resent(c.r.snack(&data_snack(5, 0, 0), 8192));
    assert_eq!(wires(&got), wires(&pdus[2..]), "0/0: from the DataACK on");
    // A stale DataACK is harmless.
    assert_eq!(c.r.snack(&data_ack(5, 1), 8192), Ok(Snacked::DataAcked));
    // Acknowledging everything keeps the status-carrying Data-In for its status.
    assert_eq!(c.r.snack(&data_ack(5, 8), 8192), Ok(Snacked::DataAcked));
    assert_eq!(c.r.bytes(), 8192);
    let got = resent(c.r.snack(&status_snack(stat_sn(&pdus[7]), 0), 8192));
    assert_eq!(wires(&got), wires(&pdus[7..]));
    assert_eq!(
        c.r.snack(&data_snack(5, 0, 0), 8192),
        Ok(Snacked::Resend(vec![]))
    );
    check(&c.r);
}

/// Check an R-Data answer: resegmented data from `from` (a DataSN the original had), ending
/// in a tagged SCSI Response with the status's StatSN.
fn check_r_data(got: &[Pdu], orig: &[Pdu], data: &Bytes, from: u32, max_xmit: u32, tag: u32) {
    let (resp, ins) = got.split_last().expect("a SCSI Response at least");
    let Header::ScsiResponse(resp) = &resp.header else {
        panic!("last is not a SCSI Response: {resp:?}");
    };
    let status_pdu = orig
        .iter()
        .find(|p| match &p.header {
            Header::DataIn(d) => d.status.is_some(),
            _ => true,
        })
        .expect("the original status");
    assert_eq!(resp.sn.stat_sn, stat_sn(status_pdu), "same StatSN");
    assert_eq!(resp.snack_tag, tag);
    assert_eq!(resp.exp_data_sn, DataSn(from + ins.len() as u32));
    let start = orig
        .get(from as usize)
        .and_then(|p| match &p.header {
            Header::DataIn(d) => Some(d.buffer_offset as usize),
            _ => None,
        })
        .unwrap_or(data.len());
    let mut off = start;
    // Where the original sequences ended.
    let ends: Vec<usize> = orig
        .iter()
        .filter_map(|p| match &p.header {
            Header::DataIn(d) if d.final_bit => Some(d.buffer_offset as usize + p.data.len()),
            _ => None,
        })
        .collect();
    for (k, p) in ins.iter().enumerate() {
        let d = data_in(p);
        assert_eq!(d.data_sn, DataSn(from + k as u32));
        assert_eq!(d.buffer_offset as usize, off);
        assert!(p.data.len() <= max_xmit.max(512) as usize);
        assert!(d.status.is_none(), "the status is in the SCSI Response");
        assert_eq!(&p.data[..], &data[off..off + p.data.len()]);
        off += p.data.len();
        assert_eq!(
            d.final_bit,
            ends.contains(&off),
            "sequence ends where they were"
        );
        assert_eq!(d.ack, d.final_bit);
        if d.ack {
            assert_eq!(d.ttt, Ttt(d.itt.0));
        }
    }
    assert_eq!(off, data.len(), "all the unacknowledged data");
}

#[test]
fn r_data_resegments_and_tags_the_status() {
    for max_xmit in [512, 5000, 8192, 65536, 1 << 20] {
        let mut c = Conn::new(usize::MAX);
        let orig = c.read(9, 100_000, false, 8192, 32768);
        let data = pattern(9, 100_000);
        let got = resent(c.r.snack(&r_data(9, 77), max_xmit));
        check_r_data(&got, &orig, &data, 0, max_xmit, 77);
        check(&c.r);
        // A Status SNACK now gets the tagged SCSI Response (§11.16.3), a Data SNACK the new
        // Data-In.
        let st = resent(c.r.snack(&status_snack(stat_sn(got.last().unwrap()), 1), 8192));
        assert_eq!(wires(&st), wires(&got[got.len() - 1..]));
        let d = resent(c.r.snack(&data_snack(9, 0, 0), 8192));
        assert_eq!(wires(&d), wires(&got[..got.len() - 1]));
        // A second R-Data carries the new tag, same StatSN.
        let again = resent(c.r.snack(&r_data(9, 78), max_xmit));
        let Header::ScsiResponse(r2) = &again.last().unwrap().header else {
            panic!()
        };
        assert_eq!(r2.snack_tag, 78);
        assert_eq!(stat_sn(again.last().unwrap()), stat_sn(got.last().unwrap()));
        assert_eq!(
            wires(&again[..again.len() - 1]),
            wires(&got[..got.len() - 1])
        );
    }
}

#[test]
fn r_data_starts_at_the_last_data_ack_and_keeps_sense() {
    let mut c = Conn::new(usize::MAX);
    let orig = c.read(4, 50_000, true, 8192, 16384);
    let data = pattern(4, 50_000);
    assert_eq!(c.r.snack(&data_ack(4, 4), 8192), Ok(Snacked::DataAcked));
    let got = resent(c.r.snack(&r_data(4, 5), 3000));
    check_r_data(&got, &orig, &data, 4, 3000, 5);
    // The sense data and status of the original SCSI Response are kept.
    let orig_resp = orig.last().unwrap();
    let new_resp = got.last().unwrap();
    assert_eq!(new_resp.data, orig_resp.data);
    let (Header::ScsiResponse(a), Header::ScsiResponse(b)) = (&orig_resp.header, &new_resp.header)
    else {
        panic!()
    };
    assert_eq!(
        ScsiResponse {
            snack_tag: 0,
            exp_data_sn: a.exp_data_sn,
            ..b.clone()
        },
        *a
    );
    check(&c.r);
    // Everything acknowledged by DataACK: only the SCSI Response comes back.
    assert_eq!(
        c.r.snack(&data_ack(4, 4 + got.len() as u32 - 1), 8192),
        Ok(Snacked::DataAcked)
    );
    let only = resent(c.r.snack(&r_data(4, 6), 3000));
    assert_eq!(only.len(), 1);
    check(&c.r);
}

#[test]
fn every_refusal() {
    let mut c = Conn::new(usize::MAX);
    let a = c.read(1, 20_000, false, 8192, 65536); // one sequence: no A bit
    let open = c.send(
        Header::DataIn(DataIn {
            itt: Itt(2),
            final_bit: true,
            ..Default::default()
        }),
        Bytes::from_static(&[1; 100]),
        false,
    );
    let nop = c.nop_response(3);
    let next = c.next_stat_sn();
    let r = &mut c.r;
    assert_eq!(
        r.snack(&snack(4, 1, 0, 0, 0), 8192),
        Err(SnackRefused::UnknownType(4))
    );
    assert_eq!(
        r.snack(&snack(15, 1, 0, 0, 0), 8192),
        Err(SnackRefused::UnknownType(15))
    );
    // Status SNACK.
    assert_eq!(
        r.snack(&status_snack(next, 0), 8192),
        Err(SnackRefused::StatusNotSent(next))
    );
    assert_eq!(
        r.snack(&status_snack(next.plus(5), 1), 8192),
        Err(SnackRefused::StatusNotSent(next.plus(5)))
    );
    assert_eq!(
        r.snack(&status_snack(stat_sn(&nop), 2), 8192),
        Err(SnackRefused::StatusBeyondSent {
            beg: stat_sn(&nop),
            run_length: 2
        })
    );
    r.ack(stat_sn(&nop));
    assert_eq!(
        r.snack(&status_snack(stat_sn(&a[2]), 1), 8192),
        Err(SnackRefused::StatusAcknowledged(stat_sn(&a[2])))
    );
    // Data SNACK.
    assert_eq!(
        r.snack(&data_snack(2, 1, 0), 8192),
        Err(SnackRefused::DataNotSent {
            itt: Itt(2),
            data_sn: DataSn(1)
        })
    );
    assert_eq!(
        r.snack(&data_snack(2, 0, 2), 8192),
        Err(SnackRefused::DataBeyondSent {
            itt: Itt(2),
            beg: DataSn(0),
            run_length: 2
        })
    );
    assert_eq!(
        wires(&resent(r.snack(&data_snack(2, 0, 1), 8192))),
        wires(&[open])
    );
    assert_eq!(r.snack(&data_ack(2, 1), 8192), Ok(Snacked::DataAcked));
    assert_eq!(
        r.snack(&data_snack(2, 0, 1), 8192),
        Err(SnackRefused::DataAcknowledged {
            itt: Itt(2),
            data_sn: DataSn(0)
        })
    );
    // DataACK.
    assert_eq!(
        r.snack(&data_ack(77, 1), 8192),
        Err(SnackRefused::UnknownTtt(Ttt(77)))
    );
    assert_eq!(
        r.snack(&data_ack(RESERVED_TAG, 1), 8192),
        Err(SnackRefused::UnknownTtt(Ttt::RESERVED))
    );
    assert_eq!(
        r.snack(&data_ack(2, 2), 8192),
        Err(SnackRefused::DataAckBeyondSent {
            ttt: Ttt(2),
            data_sn: DataSn(2)
        })
    );
    assert_eq!(
        r.snack(&snack(SNACK_DATA_ACK, RESERVED_TAG, 2, 1, 1), 8192),
        Err(SnackRefused::InvalidRun(SNACK_DATA_ACK))
    );
    // R-Data SNACK.
    assert_eq!(
        r.snack(&r_data(2, 0), 8192),
        Err(SnackRefused::BadSnackTag(0))
    );
    assert_eq!(
        r.snack(&r_data(2, RESERVED_TAG), 8192),
        Err(SnackRefused::BadSnackTag(RESERVED_TAG))
    );
    assert_eq!(
        r.snack(&snack(SNACK_R_DATA, 2, 9, 1, 0), 8192),
        Err(SnackRefused::InvalidRun(SNACK_R_DATA))
    );
    assert_eq!(
        r.snack(&r_data(2, 9), 8192),
        Err(SnackRefused::StatusPending(Itt(2)))
    );
    assert_eq!(
        r.snack(&r_data(1, 9), 8192),
        Err(SnackRefused::UnknownTask(Itt(1)))
    );
    assert_eq!(
        r.snack(&r_data(3, 9), 8192),
        Err(SnackRefused::UnknownTask(Itt(3)))
    );
    check(r);
}

#[test]
fn reject_reasons_and_messages() {
    let all = [
        SnackRefused::UnknownType(5),
        SnackRefused::StatusNotSent(StatSn(1)),
        SnackRefused::StatusAcknowledged(StatSn(1)),
        SnackRefused::StatusDropped(StatSn(1)),
        SnackRefused::StatusBeyondSent {
            beg: StatSn(1),
            run_length: 3,
        },
        SnackRefused::UnknownTask(Itt(1)),
        SnackRefused::StatusPending(Itt(1)),
        SnackRefused::DataNotSent {
            itt: Itt(1),
            data_sn: DataSn(2),
        },
        SnackRefused::DataAcknowledged {
            itt: Itt(1),
            data_sn: DataSn(2),
        },
        SnackRefused::DataDropped {
            itt: Itt(1),
            data_sn: DataSn(2),
        },
        SnackRefused::DataBeyondSent {
            itt: Itt(1),
            beg: DataSn(2),
            run_length: 3,
        },
        SnackRefused::UnknownTtt(Ttt(1)),
        SnackRefused::DataAckBeyondSent {
            ttt: Ttt(1),
            data_sn: DataSn(2),
        },
        SnackRefused::BadSnackTag(0),
        SnackRefused::InvalidRun(3),
    ];
    for e in all {
        assert!(!e.to_string().is_empty());
        let want = match e {
            SnackRefused::UnknownTtt(_) | SnackRefused::DataAckBeyondSent { .. } => {
                RejectReason::INVALID_DATA_ACK
            }
            _ => RejectReason::PROTOCOL_ERROR,
        };
        assert_eq!(e.reject_reason(), want, "{e}");
    }
}

#[test]
fn a_reused_tag_replaces_the_old_task() {
    let mut c = Conn::new(usize::MAX);
    let old = c.read(6, 20_000, false, 8192, 65536);
    let new = c.read(6, 10_000, false, 8192, 65536);
    assert_eq!(c.r.bytes(), 10_000);
    assert_eq!(
        wires(&resent(c.r.snack(&data_snack(6, 0, 0), 8192))),
        wires(&new)
    );
    let old_sn = stat_sn(&old[2]);
    assert_eq!(
        c.r.snack(&status_snack(old_sn, 1), 8192),
        Err(SnackRefused::StatusDropped(old_sn))
    );
    assert_eq!(
        wires(&resent(c.r.snack(&status_snack(old_sn.next(), 1), 8192))),
        wires(&new[1..])
    );
    // Reused by a command without data: its SCSI Response replaces the read.
    let none = c.read(6, 0, false, 8192, 65536);
    assert_eq!((c.r.bytes(), c.r.tasks()), (0, 0));
    assert_eq!(
        c.r.snack(&data_snack(6, 0, 0), 8192),
        Ok(Snacked::NotRetained)
    );
    assert_eq!(
        wires(&resent(
            c.r.snack(&status_snack(stat_sn(&none[0]), 0), 8192)
        )),
        wires(&none)
    );
    check(&c.r);
}

#[test]
fn the_byte_bound_drops_the_oldest_tasks_whole() {
    let mut c = Conn::new(100_000);
    let a = c.read(1, 40_000, false, 8192, 65536);
    c.read(2, 40_000, true, 8192, 65536);
    check(&c.r);
    let b = c.read(3, 40_000, false, 8192, 65536);
    check(&c.r);
    assert_eq!(
        c.r.snack(&data_snack(1, 0, 0), 8192),
        Ok(Snacked::NotRetained)
    );
    let a_sn = stat_sn(a.last().unwrap());
    assert_eq!(
        c.r.snack(&status_snack(a_sn, 1), 8192),
        Err(SnackRefused::StatusDropped(a_sn))
    );
    assert_eq!(
        c.r.snack(&status_snack(StatSn(0), 0), 8192),
        Err(SnackRefused::StatusDropped(a_sn)),
        "not all unacknowledged statuses are there"
    );
    assert_eq!(
        wires(&resent(c.r.snack(&data_snack(3, 0, 0), 8192))),
        wires(&b)
    );
}

#[test]
fn a_read_larger_than_the_bound_is_not_kept() {
    let mut c = Conn::new(10_000);
    let big = c.read(1, 50_000, false, 8192, 65536);
    check(&c.r);
    assert_eq!(
        c.r.snack(&data_snack(1, 0, 0), 8192),
        Ok(Snacked::NotRetained)
    );
    assert_eq!(
        c.r.snack(&r_data(1, 3), 8192),
        Err(SnackRefused::UnknownTask(Itt(1)))
    );
    // Its status still fits: it is kept as sent.
    let last = big.last().unwrap();
    assert_eq!(
        wires(&resent(c.r.snack(&status_snack(stat_sn(last), 1), 8192))),
        wires(std::slice::from_ref(last))
    );
    // A zero bound keeps nothing, and never breaks.
    let mut z = Conn::new(0);
    z.read(1, 50_000, true, 8192, 65536);
    z.nop_response(2);
    check(&z.r);
    assert_eq!(z.r.bytes(), 0);
}

#[test]
fn the_status_count_is_bounded() {
    let mut c = Conn::new(usize::MAX);
    let first = c.nop_response(0);
    let mut last = first.clone();
    for i in 1..MAX_STATUSES as u32 + 100 {
        last = c.nop_response(i);
    }
    check(&c.r);
    assert_eq!(c.r.statuses(), MAX_STATUSES);
    assert_eq!(
        c.r.snack(&status_snack(stat_sn(&first), 1), 8192),
        Err(SnackRefused::StatusDropped(stat_sn(&first)))
    );
    assert_eq!(
        wires(&resent(c.r.snack(&status_snack(stat_sn(&last), 0), 8192))),
        wires(&[last])
    );
}

#[test]
fn tasks_in_progress_are_bounded_and_can_be_forgotten() {
    let mut c = Conn::new(usize::MAX);
    for itt in 0..MAX_OPEN_TASKS as u32 + 10 {
        c.send(
            Header::DataIn(DataIn {
                itt: Itt(itt),
                ..Default::default()
            }),
            Bytes::from_static(&[0; 16]),
            false,
        );
    }
    check(&c.r);
    assert_eq!(c.r.tasks(), MAX_OPEN_TASKS);
    assert_eq!(
        c.r.snack(&data_snack(0, 0, 0), 8192),
        Ok(Snacked::NotRetained)
    );
    // Their later Data-In are not kept either.
    c.send(
        Header::DataIn(DataIn {
            itt: Itt(0),
            data_sn: DataSn(1),
            ..Default::default()
        }),
        Bytes::from_static(&[0; 16]),
        false,
    );
    assert_eq!(
        c.r.snack(&data_snack(0, 0, 0), 8192),
        Ok(Snacked::NotRetained)
    );
    c.r.forget(Itt(20));
    assert_eq!(
        c.r.snack(&data_snack(20, 0, 0), 8192),
        Ok(Snacked::NotRetained)
    );
    assert_eq!(c.r.tasks(), MAX_OPEN_TASKS - 1);
    check(&c.r);
}

#[test]
fn stat_sn_and_data_sn_wrap_around() {
    let mut c = Conn::at(usize::MAX, StatSn(u32::MAX - 1));
    let a = c.read(1, 10_000, false, 8192, 65536);
    let nop = c.nop_response(2);
    let b = c.read(3, 10_000, true, 8192, 65536);
    assert_eq!(stat_sn(&b[2]), StatSn(0));
    let got = resent(c.r.snack(&status_snack(StatSn(u32::MAX - 1), 0), 8192));
    assert_eq!(wires(&got), wires(&[a[1].clone(), nop, b[2].clone()]));
    c.r.ack(StatSn(0));
    assert_eq!(c.r.statuses(), 1);
    assert_eq!(
        c.r.snack(&data_snack(1, 0, 0), 8192),
        Ok(Snacked::NotRetained)
    );
    assert_eq!(
        wires(&resent(c.r.snack(&status_snack(StatSn(0), 0), 8192))),
        wires(&b[2..])
    );
    // A huge RunLength is refused, not looped over.
    assert_eq!(
        c.r.snack(&status_snack(StatSn(0), u32::MAX), 8192),
        Err(SnackRefused::StatusBeyondSent {
            beg: StatSn(0),
            run_length: u32::MAX
        })
    );
    check(&c.r);
}

#[test]
fn a_stat_sn_that_goes_back_replaces_the_later_ones() {
    let mut c = Conn::new(usize::MAX);
    c.nop_response(1);
    c.read(2, 1000, false, 8192, 65536);
    // The caller restarts numbering (a bug, or a new counter): the store stays ordered.
    c.counter = StatSnCounter(StatSn(1));
    let again = c.nop_response(3);
    check(&c.r);
    assert_eq!(c.r.statuses(), 1);
    assert_eq!(
        wires(&resent(c.r.snack(&status_snack(StatSn(1), 0), 8192))),
        wires(&[again])
    );
}

#[test]
fn data_in_segments_match_what_the_store_keeps() {
    // The store keeps Data-In by DataSN exactly as data_in_segments numbers them.
    let mut c = Conn::new(usize::MAX);
    let pdus = c.read(11, 123_457, false, 10_000, 40_000);
    let segs: Vec<_> = data_in_segments(123_457, 10_000, 40_000).collect();
    assert_eq!(pdus.len(), segs.len());
    for (p, s) in pdus.iter().zip(&segs) {
        let got = resent(c.r.snack(&data_snack(11, s.data_sn.0, 1), 8192));
        assert_eq!(wires(&got), wires(std::slice::from_ref(p)));
        assert_eq!(data_in(p).ack, s.final_bit && !s.last);
    }
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Read { itt: u32, len: u32, sense: bool },
    Nop,
    Ack { back: u32 },
    DataSnack { itt: u32, beg: u32, run: u32 },
    StatusSnack { back: u32, run: u32 },
    DataAck { itt: u32, beg: u32 },
    RData { itt: u32, tag: u32, max_xmit: u32 },
    Any(SnackRequest),
}

fn arb_snack() -> impl Strategy<Value = SnackRequest> {
    (
        prop_oneof![0u8..4, any::<u8>()],
        prop_oneof![0u32..8, any::<u32>()],
        prop_oneof![0u32..8, Just(RESERVED_TAG), any::<u32>()],
        prop_oneof![0u32..16, any::<u32>()],
        prop_oneof![0u32..16, any::<u32>()],
        any::<u32>(),
    )
        .prop_map(|(t, itt, ttt, beg_run, run_length, e)| SnackRequest {
            snack_type: t,
            itt: Itt(itt),
            ttt: Ttt(ttt),
            beg_run,
            run_length,
            exp_stat_sn: StatSn(e),
            ..Default::default()
        })
}

fn arb_op() -> impl Strategy<Value = Op> {
    let itt = 0u32..6;
    prop_oneof![
        4 => (itt.clone(), 0u32..60_000, any::<bool>())
            .prop_map(|(itt, len, sense)| Op::Read { itt, len, sense }),
        1 => Just(Op::Nop),
        2 => (0u32..6).prop_map(|back| Op::Ack { back }),
        3 => (itt.clone(), 0u32..8, 0u32..4)
            .prop_map(|(itt, beg, run)| Op::DataSnack { itt, beg, run }),
        2 => (0u32..12, 0u32..5).prop_map(|(back, run)| Op::StatusSnack { back, run }),
        2 => (itt.clone(), 0u32..10).prop_map(|(itt, beg)| Op::DataAck { itt, beg }),
        2 => (itt.clone(), 1u32..1000, 0u32..70_000)
            .prop_map(|(itt, tag, max_xmit)| Op::RData { itt, tag, max_xmit }),
        1 => arb_snack().prop_map(Op::Any),
    ]
}

/// What was sent, in its latest version: statuses by StatSN, each tag's Data-In by DataSN.
#[derive(Default)]
struct Model {
    statuses: Map<u32, Pdu>,
    data_in: Map<u32, Vec<Pdu>>,
    read_data: Map<u32, Bytes>,
    /// The StatSN of each tag's status.
    status_of: Map<u32, StatSn>,
    /// Each tag's last DataACK.
    acked: Map<u32, u32>,
    exp_stat_sn: Option<StatSn>,
}

impl Model {
    /// `got` is exactly what was sent: by StatSN for a Status SNACK, else each Data-In as the
    /// tag's Data-In with that DataSN.
    fn sound(&self, got: &[Pdu], by_status: bool) {
        for p in got {
            let want = match &p.header {
                Header::DataIn(d) if !by_status => self
                    .data_in
                    .get(&d.itt.0)
                    .and_then(|v| v.get(d.data_sn.0 as usize)),
                h => self.statuses.get(&h.target_sn().unwrap().stat_sn.0),
            };
            let want = want.unwrap_or_else(|| panic!("never sent: {p:?}"));
            assert_eq!(wire(p), wire(want));
        }
    }

    /// Check an R-Data answer against what was sent, then take it as sent.
    fn r_data(&mut self, itt: u32, tag: u32, max_xmit: u32, got: &[Pdu]) {
        let from = self.acked.get(&itt).copied().unwrap_or(0);
        let mut with_status = self.data_in.get(&itt).cloned().unwrap_or_default();
        if let Some(st) = self
            .status_of
            .get(&itt)
            .and_then(|s| self.statuses.get(&s.0))
        {
            if !matches!(st.header, Header::DataIn(_)) {
                with_status.push(st.clone());
            }
        }
        check_r_data(
            got,
            &with_status,
            &self.read_data[&itt],
            from,
            max_xmit,
            tag,
        );
        let (resp, ins) = got.split_last().unwrap();
        let v = self.data_in.entry(itt).or_default();
        v.truncate(from as usize);
        v.extend(ins.iter().cloned());
        self.statuses.insert(stat_sn(resp).0, resp.clone());
    }
}

fn run(ops: Vec<Op>, limit: usize, max_xmit: u32, max_burst: u32, fresh_tags: bool) {
    let mut c = Conn::new(limit);
    let mut m = Model::default();
    let mut tag = 1000u32;
    for op in ops {
        match op {
            Op::Read { itt, len, sense } => {
                let itt = if fresh_tags {
                    tag += 1;
                    tag
                } else {
                    itt
                };
                let pdus = c.read(itt, len, sense, max_xmit, max_burst);
                m.data_in.insert(
                    itt,
                    pdus.iter()
                        .filter(|p| matches!(p.header, Header::DataIn(_)))
                        .cloned()
                        .collect(),
                );
                m.read_data.insert(itt, pattern(itt, len));
                m.acked.insert(itt, 0);
                let st = pdus.last().unwrap();
                m.status_of.insert(itt, stat_sn(st));
                m.statuses.insert(stat_sn(st).0, st.clone());
            }
            Op::Nop => {
                let p = c.nop_response(RESERVED_TAG);
                m.statuses.insert(stat_sn(&p).0, p);
            }
            Op::Ack { back } => {
                let exp = StatSn(c.next_stat_sn().0.wrapping_sub(back));
                c.r.ack(exp);
                if c.next_stat_sn() != StatSn(1) && exp.gt(m.exp_stat_sn.unwrap_or(StatSn(1))) {
                    m.exp_stat_sn = Some(exp);
                }
            }
            Op::DataSnack { itt, beg, run } => {
                let itt = if fresh_tags {
                    tag.wrapping_sub(itt)
                } else {
                    itt
                };
                if let Ok(Snacked::Resend(v)) = c.r.snack(&data_snack(itt, beg, run), max_xmit) {
                    m.sound(&v, false);
                }
            }
            Op::StatusSnack { back, run } => {
                let beg = StatSn(c.next_stat_sn().0.wrapping_sub(back));
                if let Ok(Snacked::Resend(v)) = c.r.snack(&status_snack(beg, run), max_xmit) {
                    m.sound(&v, true);
                    if run > 0 {
                        assert_eq!(v.len(), run as usize);
                    }
                }
            }
            Op::DataAck { itt, beg } => {
                let itt = if fresh_tags {
                    tag.wrapping_sub(itt)
                } else {
                    itt
                };
                if c.r.snack(&data_ack(itt, beg), max_xmit) == Ok(Snacked::DataAcked) {
                    let a = m.acked.entry(itt).or_default();
                    *a = (*a).max(beg);
                }
            }
            Op::RData {
                itt,
                tag: snack_tag,
                max_xmit: new_xmit,
            } => {
                let itt = if fresh_tags {
                    tag.wrapping_sub(itt)
                } else {
                    itt
                };
                if let Ok(Snacked::Resend(got)) = c.r.snack(&r_data(itt, snack_tag), new_xmit) {
                    m.r_data(itt, snack_tag, new_xmit, &got);
                }
            }
            Op::Any(_) if fresh_tags => {}
            Op::Any(req) => {
                c.r.ack(req.exp_stat_sn);
                match c.r.snack(&req, max_xmit) {
                    Ok(Snacked::Resend(v)) if req.snack_type == SNACK_R_DATA => {
                        m.r_data(req.itt.0, req.ttt.0, max_xmit, &v)
                    }
                    Ok(Snacked::Resend(v)) => m.sound(&v, req.snack_type == SNACK_STATUS),
                    Ok(Snacked::DataAcked) => {
                        let a = m.acked.entry(req.ttt.0).or_default();
                        *a = (*a).max(req.beg_run);
                    }
                    _ => {}
                }
            }
        }
        check(&c.r);
    }
    if fresh_tags && limit == usize::MAX {
        // Nothing was dropped: everything unacknowledged is there.
        let floor = m.exp_stat_sn.unwrap_or(StatSn(1));
        let got = resent(c.r.snack(&status_snack(StatSn(0), 0), max_xmit));
        let want: Vec<u32> = (floor.0..c.next_stat_sn().0).collect();
        assert_eq!(got.iter().map(|p| stat_sn(p).0).collect::<Vec<_>>(), want);
        m.sound(&got, true);
        for (itt, st) in &m.status_of {
            let all = &m.data_in[itt];
            if st.ge(floor) && !all.is_empty() {
                let got = resent(c.r.snack(&data_snack(*itt, 0, 0), max_xmit));
                let from = m.acked[itt] as usize;
                assert_eq!(wires(&got), wires(all.get(from..).unwrap_or(&[])));
            } else {
                assert_eq!(
                    c.r.snack(&data_snack(*itt, 0, 0), max_xmit),
                    Ok(Snacked::NotRetained)
                );
            }
        }
    }
}

proptest! {
    /// Any sequence of reads, acknowledgements and SNACKs: every bound holds after every call,
    /// nothing panics, and whatever a SNACK returns is exactly what was sent.
    #[test]
    fn snacks_return_what_was_sent_within_bounds(
        ops in proptest::collection::vec(arb_op(), 1..60),
        limit in prop_oneof![Just(0usize), 1usize..200_000, Just(usize::MAX)],
        max_xmit in 512u32..20_000,
        max_burst in 512u32..80_000,
    ) {
        run(ops, limit, max_xmit, max_burst, false);
    }

    /// With room for everything and no tag reused, every unacknowledged status and Data-In
    /// is answered.
    #[test]
    fn everything_unacknowledged_is_answered(
        ops in proptest::collection::vec(arb_op(), 1..40),
        max_xmit in 512u32..20_000,
        max_burst in 512u32..80_000,
    ) {
        run(ops, usize::MAX, max_xmit, max_burst, true);
    }

    /// Fuzz-friendly: any SNACK Request, at any point, never panics.
    #[test]
    fn snack_never_panics(
        reads in proptest::collection::vec((0u32..4, 0u32..40_000, any::<bool>()), 0..6),
        reqs in proptest::collection::vec(arb_snack(), 1..30),
        limit in prop_oneof![Just(0usize), 1usize..100_000, Just(usize::MAX)],
        max_xmit in any::<u32>(),
    ) {
        let mut c = Conn::new(limit);
        for (itt, len, sense) in reads {
            c.read(itt, len, sense, 8192, 32768);
        }
        for req in reqs {
            let _ = c.r.snack(&req, max_xmit);
            c.r.ack(req.exp_stat_sn);
            check(&c.r);
        }
    }
}

#[test]
fn reassignment_takes_a_tasks_data_from_exp_data_sn_and_its_status() {
    let mut c = Conn::new(usize::MAX);
    // Still running: no status yet, nothing to take.
    let first = c.read(7, 40_000, false, 8192, 16384);
    let other = c.read(8, 9000, true, 8192, 16384);
    let heads = |v: &[(Header, Bytes)]| -> Vec<(Vec<u8>, Bytes)> {
        v.iter()
            .map(|(h, d)| wire(&Pdu::new(h.clone(), d.clone())))
            .collect()
    };
    let got = c.r.reassign(Itt(7), DataSn(2)).expect("status held");
    assert_eq!(
        heads(&got),
        wires(&first[2..]),
        "from ExpDataSN, the S bit last"
    );
    assert_eq!(c.r.reassign(Itt(7), DataSn(0)), None, "let go once taken");
    // ExpDataSN 0: everything not acknowledged; sense data: the SCSI Response last.
    let got = c.r.reassign(Itt(8), DataSn(0)).expect("status held");
    assert_eq!(heads(&got), wires(&other));
    assert!(matches!(got.last(), Some((Header::ScsiResponse(_), _))));
    assert_eq!(
        c.r.reassign(Itt(8), DataSn(0)),
        None,
        "a SCSI Response is taken once too"
    );
    // A write's status (no Data-In), taken once.
    let h = Header::ScsiResponse(ScsiResponse {
        itt: Itt(11),
        ..Default::default()
    });
    c.send(h, Bytes::new(), true);
    assert_eq!(c.r.reassign(Itt(11), DataSn(0)).map(|v| v.len()), Some(1));
    assert_eq!(c.r.reassign(Itt(11), DataSn(0)), None);
    // Everything acknowledged but the status: the status still goes.
    let third = c.read(9, 20_000, false, 8192, 16384);
    let got = c.r.reassign(Itt(9), DataSn(50)).expect("status held");
    assert_eq!(heads(&got), wires(&third[2..]));
    assert_eq!(c.r.reassign(Itt(10), DataSn(0)), None, "never seen");
    check(&c.r);
}

/// Data-In of one 10,000-byte read from DataSN 3 (offset 3,000), 1,000 bytes each but the
/// last (4,000 bytes, F and S bits, residual), as a reassignment resumes it.
fn resumed_read() -> Vec<(Header, Bytes)> {
    let data = pattern(7, 10_000);
    let mut v: Vec<(Header, Bytes)> = (3..6u32)
        .map(|sn| {
            let h = DataIn {
                itt: Itt(7),
                data_sn: DataSn(sn),
                buffer_offset: sn * 1000,
                ..Default::default()
            };
            let at = (sn * 1000) as usize;
            (Header::DataIn(h), data.slice(at..at + 1000))
        })
        .collect();
    let last = DataIn {
        itt: Itt(7),
        final_bit: true,
        status: Some(0),
        residual: Residual::Underflow(24),
        data_sn: DataSn(6),
        buffer_offset: 6000,
        ..Default::default()
    };
    v.push((Header::DataIn(last), data.slice(6000..)));
    v
}

fn refit(v: Vec<(Header, Bytes)>, max: usize) -> Vec<(Header, Bytes)> {
    refit_data_in(v, max, Bytes::len, |b, n| b.split_to(n))
}

#[test]
fn refit_keeps_data_in_that_fit_as_they_were() {
    let v = resumed_read();
    assert_eq!(refit(v.clone(), 4000), v);
    assert_eq!(refit(v.clone(), 8192), v);
}

#[test]
fn refit_splits_longer_data_in_and_numbers_them_again() {
    let data = pattern(7, 10_000);
    for max in [1, 512, 999, 1000, 1500, 3999] {
        let got = refit(resumed_read(), max);
        let mut offset = 3000usize;
        for (i, (h, d)) in got.iter().enumerate() {
            let Header::DataIn(h) = h else {
                panic!("only Data-In")
            };
            let last = i + 1 == got.len();
            assert!(d.len() <= max, "max {max}: {} bytes", d.len());
            assert_eq!(h.data_sn, DataSn(3 + i as u32), "max {max}");
            assert_eq!(h.buffer_offset as usize, offset, "max {max}: contiguous");
            assert_eq!(&d[..], &data[offset..offset + d.len()]);
            assert_eq!(h.final_bit, last, "max {max}: F bit on the last only");
            assert_eq!(h.status, last.then_some(0), "max {max}: S on the last only");
            let residual = if last {
                Residual::Underflow(24)
            } else {
                Residual::None
            };
            assert_eq!(h.residual, residual);
            offset += d.len();
        }
        assert_eq!(offset, 10_000, "max {max}: all of it");
    }
}

#[test]
fn refit_counts_the_data_in_in_a_separate_response() {
    let mut v = resumed_read();
    if let Some((Header::DataIn(h), _)) = v.last_mut() {
        h.status = None;
        h.residual = Residual::None;
    }
    let resp = ScsiResponse {
        itt: Itt(7),
        exp_data_sn: DataSn(7),
        ..Default::default()
    };
    v.push((Header::ScsiResponse(resp), Bytes::new()));
    let got = refit(v, 500);
    // 3,000 + 4,000 bytes in 500-byte pieces from DataSN 3: 14 Data-In, then the status.
    assert_eq!(got.len(), 15);
    let Some((Header::ScsiResponse(r), _)) = got.last() else {
        panic!("the status last")
    };
    assert_eq!(r.exp_data_sn, DataSn(3 + 14));
}
