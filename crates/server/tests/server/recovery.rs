//! ErrorRecoveryLevel 1 over real sockets with ironsan's initiator (RFC 7143 §7): damaged
//! Data-Out and immediate data asked for again by recovery R2T, PDUs with a damaged header
//! dropped, SNACKs answered from what the connection kept, and what a level-0 session gets
//! instead.

use crate::support;

use bytes::Bytes;
use ironsan_initiator::{Client, Corrupt, LoginOptions};
use ironsan_proto::pdu::{Header, Itt, Pdu, RejectReason, Ttt};
use ironsan_proto::StatSn;
use std::net::SocketAddr;
use support::*;

/// Login options with both digests, level `erl` offered, and writes that go by R2T after
/// 8 KiB of immediate data (so a test can damage a chosen Data-Out).
fn opts(erl: u8) -> LoginOptions {
    let mut o = login_opts(TARGET, "iqn.2026-11.org.ironsan:recovery", 1);
    o.header_digest = true;
    o.data_digest = true;
    o.error_recovery_level = erl;
    o.initial_r2t = true;
    o.immediate_data = true;
    o.first_burst_length = 8192;
    o.max_burst_length = 65536;
    o.max_recv_data_segment_length = 16384;
    o
}

/// A server whose MaxRecvDataSegmentLength is 16 KiB: a 64 KiB R2T is answered by four
/// Data-Outs, so one can vanish in the middle of a sequence.
async fn start_small() -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    start_with(|cfg| cfg.negotiation.max_recv_data_segment_length = 16384).await
}

async fn login(addr: SocketAddr, erl: u8) -> Client {
    Client::login(addr, &opts(erl)).await.unwrap()
}

/// Rejects (reason) the initiator saw while waiting.
fn rejects(c: &Client) -> Vec<RejectReason> {
    c.unsolicited
        .iter()
        .filter_map(|p| match &p.header {
            Header::Reject(r) => Some(r.reason),
            _ => None,
        })
        .collect()
}

async fn read_back(c: &mut Client, lba: u64, len: usize) -> Bytes {
    let r = c.read16(0, lba, (len / 512) as u32, 512).await.unwrap();
    assert_eq!(r.status, 0, "read back: {:?}", r.sense_key());
    r.data
}

#[tokio::test]
async fn the_level_is_agreed_up_to_the_targets_setting() {
    let (addr, _stop) = start().await;
    // The default setting is 2.
    let c = login(addr, 2).await;
    assert_eq!(c.negotiated_value("ErrorRecoveryLevel"), Some("2"));
    let c = login(addr, 1).await;
    assert_eq!(c.negotiated_value("ErrorRecoveryLevel"), Some("1"));
    // Above level 0 only the last R2T can be recovered: MaxOutstandingR2T is 1 (§13.19).
    let mut o = opts(1);
    o.max_outstanding_r2t = 8;
    let c = Client::login(addr, &o).await.unwrap();
    assert_eq!(c.negotiated_value("ErrorRecoveryLevel"), Some("1"));
    assert_eq!(c.negotiated_value("MaxOutstandingR2T"), Some("1"));
    let c = login(addr, 0).await;
    assert_eq!(c.negotiated_value("ErrorRecoveryLevel"), Some("0"));
    drop(_stop);
    // A target set to level 0 answers 0.
    let (addr, _stop) = start_with(|cfg| {
        for t in cfg.targets.iter_mut() {
            t.error_recovery_level = Some(0);
        }
    })
    .await;
    let c = login(addr, 1).await;
    assert_eq!(c.negotiated_value("ErrorRecoveryLevel"), Some("0"));
    drop(_stop);
    // A target set to level 1 answers 1 to an offer of 2.
    let (addr, _stop) = start_with(|cfg| {
        for t in cfg.targets.iter_mut() {
            t.error_recovery_level = Some(1);
        }
    })
    .await;
    let c = login(addr, 2).await;
    assert_eq!(c.negotiated_value("ErrorRecoveryLevel"), Some("1"));
}

#[tokio::test]
async fn a_damaged_data_out_is_asked_for_again_and_the_write_lands_whole() {
    let (addr, _stop) = start_small().await;
    let mut c = login(addr, 1).await;
    // 8 KiB immediate, then R2Ts of 64 KiB in 16 KiB Data-Outs: damage the third PDU from
    // the command (the second Data-Out of the first R2T).
    let data = pattern(256 << 10, 7);
    c.corrupt_after(Corrupt::Data, 2);
    let r = c.write16(0, 100, data.clone(), 512, false).await.unwrap();
    assert_eq!(
        r.status,
        0,
        "write with one damaged Data-Out: {:?}",
        r.sense_key()
    );
    assert_eq!(rejects(&c), vec![RejectReason::DATA_DIGEST_ERROR]);
    assert_eq!(read_back(&mut c, 100, data.len()).await, data);
}

#[tokio::test]
async fn damaged_immediate_data_is_asked_for_by_r2t() {
    let (addr, _stop) = start().await;
    let mut c = login(addr, 1).await;
    let data = pattern(8192, 9);
    c.corrupt_after(Corrupt::Data, 0);
    let r = c.write16(0, 40, data.clone(), 512, false).await.unwrap();
    assert_eq!(r.status, 0, "{:?}", r.sense_key());
    assert_eq!(rejects(&c), vec![RejectReason::DATA_DIGEST_ERROR]);
    assert_eq!(read_back(&mut c, 40, data.len()).await, data);
}

#[tokio::test]
async fn at_level_0_a_damaged_data_out_fails_the_command_and_writes_nothing() {
    let (addr, _stop) = start().await;
    let mut c = login(addr, 0).await;
    let zeros = read_back(&mut c, 300, 64 << 10).await;
    c.corrupt_after(Corrupt::Data, 1);
    let r = c
        .write16(0, 300, pattern(64 << 10, 3), 512, false)
        .await
        .unwrap();
    assert_eq!(r.status, 2);
    assert_eq!(
        r.sense_key(),
        Some((0x0b, 0x47, 0x05)),
        "PROTOCOL SERVICE CRC ERROR"
    );
    assert_eq!(read_back(&mut c, 300, 64 << 10).await, zeros);
}

#[tokio::test]
async fn a_pdu_with_a_damaged_header_is_dropped_and_its_data_recovered() {
    let (addr, _stop) = start_small().await;
    let mut c = login(addr, 1).await;
    let data = pattern(128 << 10, 11);
    // The second Data-Out of the first R2T vanishes: the next one shows the DataSN gap.
    c.corrupt_after(Corrupt::Header, 2);
    let r = c.write16(0, 500, data.clone(), 512, false).await.unwrap();
    assert_eq!(r.status, 0, "{:?}", r.sense_key());
    assert_eq!(read_back(&mut c, 500, data.len()).await, data);
    // A damaged ping is dropped; the next is answered.
    c.corrupt_after(Corrupt::Header, 0);
    let itt = c.itt();
    let nop = ironsan_proto::pdu::NopOut {
        immediate: true,
        itt,
        ttt: Ttt::RESERVED,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: c.exp_stat_sn,
        ..Default::default()
    };
    c.send(Header::NopOut(nop), Bytes::new()).await.unwrap();
    let echo = c.ping(Bytes::from_static(b"after")).await.unwrap();
    assert_eq!(&echo[..], b"after");
}

#[tokio::test]
async fn two_damaged_headers_in_a_row_close_the_connection_and_level_0_closes_at_once() {
    let (addr, _stop) = start().await;
    for (erl, damaged) in [(1u8, 2u32), (0, 1)] {
        let mut c = login(addr, erl).await;
        for _ in 0..damaged {
            c.corrupt_after(Corrupt::Header, 0);
            let d = Bytes::from_static(b"ping");
            let nop = ironsan_proto::pdu::NopOut {
                immediate: true,
                itt: Itt(0x77),
                ttt: Ttt::RESERVED,
                cmd_sn: c.cmd_sn,
                exp_stat_sn: c.exp_stat_sn,
                ..Default::default()
            };
            c.send(Header::NopOut(nop), d).await.unwrap();
        }
        let r = tokio::time::timeout(std::time::Duration::from_secs(10), c.recv()).await;
        assert!(
            matches!(r, Ok(Err(_))),
            "level {erl}: the connection should close, got {r:?}"
        );
    }
}

#[tokio::test]
async fn a_write_damaged_too_often_fails_and_leaves_the_old_data() {
    let (addr, _stop) = start().await;
    let mut c = login(addr, 1).await;
    let old = pattern(8192, 1);
    assert_eq!(
        c.write16(0, 700, old.clone(), 512, false)
            .await
            .unwrap()
            .status,
        0
    );
    // The immediate data damaged, then the Data-Out answering every recovery R2T.
    c.corrupt_after(Corrupt::Data, 0);
    let (itt, _) = c
        .send_write16(0, 700, 8192, 512, pattern(8192, 2))
        .await
        .unwrap();
    let mut r2ts = 0;
    loop {
        let p = c.recv().await.unwrap();
        match p.header {
            Header::R2t(t) => {
                r2ts += 1;
                assert!(
                    r2ts <= ironsan_proto::task::RECOVERY_LIMIT,
                    "R2Ts past the limit"
                );
                let d = ironsan_proto::pdu::DataOut {
                    final_bit: true,
                    itt: t.itt,
                    ttt: t.ttt,
                    exp_stat_sn: c.exp_stat_sn,
                    buffer_offset: t.buffer_offset,
                    ..Default::default()
                };
                c.corrupt_after(Corrupt::Data, 0);
                let len = t.desired_data_transfer_length as usize;
                c.send(Header::DataOut(d), pattern(len, 2)).await.unwrap();
            }
            Header::ScsiResponse(resp) => {
                assert_eq!(resp.itt, itt);
                assert_eq!(resp.status, 2, "CHECK CONDITION past the recovery limit");
                break;
            }
            Header::Reject(r) => assert_eq!(r.reason, RejectReason::DATA_DIGEST_ERROR),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(r2ts, ironsan_proto::task::RECOVERY_LIMIT);
    c.exp_stat_sn = c.exp_stat_sn.next();
    assert_eq!(read_back(&mut c, 700, 8192).await, old);
}

/// Send a READ(16) of `len` bytes at `lba` and collect its PDUs up to the status, with the
/// StatSN of the status. The initiator's ExpStatSN is left where it was, so nothing of the
/// read is acknowledged yet.
async fn read_pdus(c: &mut Client, lba: u64, len: u32) -> (Itt, Vec<Pdu>, StatSn) {
    let (itt, _) = c.send_read16(0, lba, len / 512, 512).await.unwrap();
    let mut pdus = Vec::new();
    loop {
        let p = c.recv().await.unwrap();
        let status = match &p.header {
            Header::DataIn(d) if d.itt == itt => d.status.map(|_| d.sn.stat_sn),
            Header::ScsiResponse(r) if r.itt == itt => Some(r.sn.stat_sn),
            other => panic!("unexpected {other:?}"),
        };
        pdus.push(p);
        if let Some(sn) = status {
            return (itt, pdus, sn);
        }
    }
}

/// The PDUs answering a SNACK: `n` of them.
async fn recv_n(c: &mut Client, n: usize) -> Vec<Pdu> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(
            tokio::time::timeout(std::time::Duration::from_secs(10), c.recv())
                .await
                .expect("SNACK answered")
                .unwrap(),
        );
    }
    v
}

/// A header as sent, but for ExpCmdSN and MaxCmdSN (which a resent PDU carries current).
fn same(a: &Pdu, b: &Pdu) -> bool {
    let strip = |p: &Pdu| {
        let mut bhs = p.bhs();
        bhs.0[28..36].fill(0);
        (bhs.0, p.data.clone())
    };
    strip(a) == strip(b)
}

/// Level-1 login whose Data-In come in 16 KiB PDUs and 64 KiB bursts.
async fn reader(addr: SocketAddr) -> Client {
    let mut o = opts(1);
    o.max_recv_data_segment_length = 16384;
    Client::login(addr, &o).await.unwrap()
}

#[tokio::test]
async fn data_status_and_r_data_snacks_send_back_what_was_sent() {
    let (addr, _stop) = start().await;
    let mut c = reader(addr).await;
    let data = pattern(128 << 10, 21);
    assert_eq!(
        c.write16(0, 1000, data.clone(), 512, false)
            .await
            .unwrap()
            .status,
        0
    );
    let before = c.exp_stat_sn;
    let (itt, pdus, stat_sn) = read_pdus(&mut c, 1000, 128 << 10).await;
    assert_eq!(pdus.len(), 8, "16 KiB Data-In");
    let got: Vec<u8> = pdus.iter().flat_map(|p| p.data.to_vec()).collect();
    assert_eq!(got, data);
    // Burst ends (every 64 KiB) but the last carry the A bit and the task's tag as TTT.
    for (i, p) in pdus.iter().enumerate() {
        let Header::DataIn(d) = &p.header else {
            panic!()
        };
        assert_eq!(d.ack, i == 3, "A bit on Data-In {i}");
        if d.ack {
            assert_eq!(d.ttt, Ttt(itt.0));
        }
    }
    // Data SNACK for DataSN 2 and 3.
    c.exp_stat_sn = before;
    c.snack(0, itt, Ttt::RESERVED, 2, 2).await.unwrap();
    let again = recv_n(&mut c, 2).await;
    assert!(same(&again[0], &pdus[2]) && same(&again[1], &pdus[3]));
    // Status SNACK: the status again, same StatSN.
    c.snack(1, Itt::RESERVED, Ttt::RESERVED, stat_sn.0, 1)
        .await
        .unwrap();
    let again = recv_n(&mut c, 1).await;
    assert!(same(&again[0], &pdus[7]), "{:?}", again[0].header);
    // R-Data SNACK (tag 0x5151): the data again in this connection's segments, then a SCSI
    // Response with the tag and the same StatSN.
    c.snack(3, itt, Ttt(0x5151), 0, 0).await.unwrap();
    let again = recv_n(&mut c, 9).await;
    let got: Vec<u8> = again[..8].iter().flat_map(|p| p.data.to_vec()).collect();
    assert_eq!(got, data);
    match &again[8].header {
        Header::ScsiResponse(r) => {
            assert_eq!(
                (r.itt, r.snack_tag, r.sn.stat_sn, r.status),
                (itt, 0x5151, stat_sn, 0)
            );
        }
        other => panic!("{other:?}"),
    }
    // A DataACK lets go of the first burst: a Data SNACK for it is refused afterwards.
    c.snack(2, Itt::RESERVED, Ttt(itt.0), 4, 0).await.unwrap();
    c.snack(0, itt, Ttt::RESERVED, 0, 1).await.unwrap();
    let r = recv_n(&mut c, 1).await;
    assert!(
        matches!(&r[0].header, Header::Reject(j) if j.reason == RejectReason::PROTOCOL_ERROR),
        "{:?}",
        r[0].header
    );
    // Acknowledged by ExpStatSN: nothing of the read is kept.
    c.exp_stat_sn = stat_sn.next();
    c.snack(1, Itt::RESERVED, Ttt::RESERVED, stat_sn.0, 1)
        .await
        .unwrap();
    let r = recv_n(&mut c, 1).await;
    assert!(
        matches!(&r[0].header, Header::Reject(_)),
        "{:?}",
        r[0].header
    );
}

#[tokio::test]
async fn an_r2t_snack_sends_the_r2t_again() {
    let (addr, _stop) = start().await;
    let mut o = opts(1);
    o.immediate_data = false;
    let mut c = Client::login(addr, &o).await.unwrap();
    let data = pattern(32 << 10, 5);
    let cmd = ironsan_proto::pdu::ScsiCommand {
        final_bit: true,
        write: true,
        attr: ironsan_proto::pdu::TaskAttr::SIMPLE,
        expected_data_transfer_length: data.len() as u32,
        cdb: ironsan_initiator::write16_cdb(1500, 64),
        ..Default::default()
    };
    let (itt, _) = c.send_command(cmd, Bytes::new()).await.unwrap();
    let first = recv_n(&mut c, 1).await;
    let Header::R2t(r) = &first[0].header else {
        panic!("{:?}", first[0].header)
    };
    assert_eq!((r.r2t_sn.0, r.buffer_offset), (0, 0));
    // The initiator says it never got it.
    c.snack(0, itt, Ttt::RESERVED, 0, 1).await.unwrap();
    let again = recv_n(&mut c, 1).await;
    assert!(same(&again[0], &first[0]), "{:?}", again[0].header);
    // R2TSN 1 was never sent.
    c.snack(0, itt, Ttt::RESERVED, 1, 1).await.unwrap();
    let refused = recv_n(&mut c, 1).await;
    assert!(matches!(&refused[0].header, Header::Reject(_)));
    let d = ironsan_proto::pdu::DataOut {
        final_bit: true,
        itt,
        ttt: r.ttt,
        exp_stat_sn: c.exp_stat_sn,
        ..Default::default()
    };
    c.send(Header::DataOut(d), data.clone()).await.unwrap();
    let resp = recv_n(&mut c, 1).await;
    assert!(matches!(&resp[0].header, Header::ScsiResponse(s) if s.status == 0));
    c.exp_stat_sn = c.exp_stat_sn.next();
    assert_eq!(read_back(&mut c, 1500, data.len()).await, data);
}

#[tokio::test]
async fn snacks_for_what_was_never_sent_are_refused() {
    let (addr, _stop) = start().await;
    let mut c = reader(addr).await;
    let before = c.exp_stat_sn;
    let (itt, pdus, stat_sn) = read_pdus(&mut c, 0, 32 << 10).await;
    assert_eq!(pdus.len(), 2);
    c.exp_stat_sn = before;
    let cases: &[(u8, Itt, Ttt, u32, u32, RejectReason)] = &[
        // Data SNACK for an unknown task, beyond what was sent, and a run too long.
        (
            0,
            Itt(0xdead),
            Ttt::RESERVED,
            0,
            0,
            RejectReason::PROTOCOL_ERROR,
        ),
        (0, itt, Ttt::RESERVED, 2, 1, RejectReason::PROTOCOL_ERROR),
        (0, itt, Ttt::RESERVED, 1, 5, RejectReason::PROTOCOL_ERROR),
        // Status SNACK for a StatSN never sent.
        (
            1,
            Itt::RESERVED,
            Ttt::RESERVED,
            stat_sn.0 + 10,
            1,
            RejectReason::PROTOCOL_ERROR,
        ),
        // DataACK naming no task, and beyond what was sent.
        (
            2,
            Itt::RESERVED,
            Ttt(0xbeef),
            1,
            0,
            RejectReason::INVALID_DATA_ACK,
        ),
        (
            2,
            Itt::RESERVED,
            Ttt(itt.0),
            9,
            0,
            RejectReason::INVALID_DATA_ACK,
        ),
        // An unknown SNACK type.
        (7, itt, Ttt::RESERVED, 0, 0, RejectReason::PROTOCOL_ERROR),
        // An R-Data SNACK with the reserved tag.
        (3, itt, Ttt::RESERVED, 0, 0, RejectReason::PROTOCOL_ERROR),
    ];
    for &(t, i, ttt, beg, run, reason) in cases {
        c.snack(t, i, ttt, beg, run).await.unwrap();
        let r = recv_n(&mut c, 1).await;
        assert!(
            matches!(&r[0].header, Header::Reject(j) if j.reason == reason),
            "SNACK type {t} {i:?} {ttt:?} {beg}+{run}: {:?}",
            r[0].header
        );
    }
    // The connection still works, and the read is still there to ask for.
    c.snack(0, itt, Ttt::RESERVED, 1, 1).await.unwrap();
    let again = recv_n(&mut c, 1).await;
    assert!(same(&again[0], &pdus[1]));
    // At level 0 a SNACK is refused as such.
    let mut c0 = login(addr, 0).await;
    c0.snack(1, Itt::RESERVED, Ttt::RESERVED, 0, 0)
        .await
        .unwrap();
    let r = recv_n(&mut c0, 1).await;
    assert!(matches!(&r[0].header, Header::Reject(j) if j.reason == RejectReason::SNACK_REJECT));
}

#[tokio::test]
async fn kept_pdus_are_bounded_when_nothing_is_acknowledged() {
    // A 1 MiB transmit budget; 4 MiB read and never acknowledged: the oldest reads go.
    let (addr, _stop) = start_with(|cfg| cfg.limits.tx_buffer_per_connection = 1 << 20).await;
    let mut c = reader(addr).await;
    let before = c.exp_stat_sn;
    let mut reads = Vec::new();
    for i in 0..16u64 {
        c.exp_stat_sn = before;
        reads.push(read_pdus(&mut c, i * 512, 256 << 10).await);
    }
    c.exp_stat_sn = before;
    // The first read was dropped to stay within the bound; the last is still there.
    let (first, _, _) = &reads[0];
    c.snack(0, *first, Ttt::RESERVED, 0, 1).await.unwrap();
    let r = recv_n(&mut c, 1).await;
    assert!(
        matches!(&r[0].header, Header::Reject(_)),
        "{:?}",
        r[0].header
    );
    let (last, pdus, _) = &reads[15];
    c.snack(0, *last, Ttt::RESERVED, 0, 1).await.unwrap();
    let r = recv_n(&mut c, 1).await;
    assert!(same(&r[0], &pdus[0]));
}

/// Writes and reads verified while Data-Outs and headers are damaged at random.
#[tokio::test]
async fn a_verified_stream_survives_damaged_pdus() {
    let (addr, _stop) = start_small().await;
    let mut c = login(addr, 1).await;
    let mut model = std::collections::HashMap::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for i in 0..40u64 {
        let lba = (next() % 64) * 256;
        let data = pattern(128 << 10, i as u8);
        // 8 KiB immediate, then two R2Ts answered by four Data-Outs each (PDUs 1-4, 5-8).
        // Damage one of them: the data of any, or the header of one that is not the last of
        // its sequence (a sequence whose last PDU vanishes waits for ever: no Data-Out timer;
        // and a damaged command header is a command lost, which the initiator retries).
        let (what, at) = if next() % 2 == 0 {
            (Corrupt::Data, 1 + next() % 8)
        } else {
            (Corrupt::Header, [1, 2, 3, 5, 6, 7][(next() % 6) as usize])
        };
        c.corrupt_after(what, at as u32);
        let r = c.write16(0, lba, data.clone(), 512, false).await.unwrap();
        assert_eq!(r.status, 0, "write {i}: {:?}", r.sense_key());
        model.insert(lba, data);
    }
    for (lba, data) in &model {
        assert_eq!(
            &read_back(&mut c, *lba, data.len()).await,
            data,
            "LBA {lba}"
        );
    }
}
