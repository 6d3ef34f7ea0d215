//! In-process target ↔ initiator tests: a real server on 127.0.0.1:0 driven by the
//! `ironsan-initiator` client over real sockets, covering the protocol paths libiscsi's tools
//! do not choose themselves (digests, R2T-only writes, small segments, window abuse, task
//! management, reinstatement, hostile PDUs).

use crate::support;
use bytes::Bytes;
use ironsan_initiator::{Client, LoginOptions};
use ironsan_proto::pdu::*;
use ironsan_proto::{CmdSn, DataSn};
use std::time::Duration;
use support::*;

async fn round_trip(c: &mut Client, lba: u64, len: usize, seed: u8) {
    let data = pattern(len, seed);
    let w = c.write16(0, lba, data.clone(), 512, false).await.unwrap();
    assert_eq!(w.status, 0, "write sense {:?}", w.sense_key());
    assert_eq!(w.residual, Residual::None);
    let r = c.read16(0, lba, (len / 512) as u32, 512).await.unwrap();
    assert_eq!(r.status, 0);
    assert_eq!(r.data.len(), len);
    assert!(r.data == data, "data read back differs");
}

#[tokio::test]
async fn login_write_read_logout() {
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    round_trip(&mut c, 8, 4096, 1).await;
    assert_eq!(c.logout().await.unwrap(), LogoutResponseCode::CLOSED);
}

/// Opt-in busy polling: commands arriving while the reader spins and after it gave up and
/// slept are both served, with digests and multi-PDU transfers, and logout still works.
#[tokio::test]
async fn busy_polling_serves_io_before_and_after_it_sleeps() {
    let (addr, _stop) = start_with(|c| c.limits.busy_poll = Duration::from_micros(500)).await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.header_digest = true;
    o.data_digest = true;
    let mut c = Client::login(addr, &o).await.unwrap();
    for (i, len) in [512usize, 4096, 300 * 1024].into_iter().enumerate() {
        // Back to back: the next command lands while the reader is still polling.
        round_trip(&mut c, 64 * i as u64, len, i as u8).await;
        // Idle longer than the polling window: the reader must sleep and be woken.
        tokio::time::sleep(Duration::from_millis(20)).await;
        round_trip(&mut c, 4096 + 64 * i as u64, len, 100 + i as u8).await;
    }
    assert_eq!(
        c.ping(Bytes::from_static(b"spin")).await.unwrap(),
        Bytes::from_static(b"spin")
    );
    assert_eq!(c.logout().await.unwrap(), LogoutResponseCode::CLOSED);
}

/// A read that completed inline holds transmit budget until its response is written; a
/// second read waits for that budget; a Logout arriving in the same segment must not wait for
/// the second read before the first one's response is out (it did: the connection hung).
/// Both reads' data and then the Logout Response arrive, in that order.
#[tokio::test]
async fn logout_behind_reads_waiting_for_transmit_budget_completes() {
    // The budget is max(tx_buffer_per_connection, max_io_bytes) = 32 MiB here: a 32 KiB read
    // (small enough to stay in the reader's batch) and a 32 MiB one cannot both hold it.
    let (addr, _stop) = start_with(|c| c.limits.tx_buffer_per_connection = 0).await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    let mut wire = Vec::new();
    let mut itts = Vec::new();
    for (lba, blocks) in [(0u64, 64u32), (0, 64 << 10)] {
        let cmd = c.stamp(ScsiCommand {
            final_bit: true,
            read: true,
            attr: TaskAttr::SIMPLE,
            lun: Lun::from_number(0),
            expected_data_transfer_length: blocks * 512,
            cdb: ironsan_initiator::read16_cdb(lba, blocks),
            ..Default::default()
        });
        itts.push(cmd.itt);
        wire.extend_from_slice(&Pdu::new(Header::ScsiCommand(cmd), Bytes::new()).bhs().0);
    }
    let logout = LogoutRequest {
        immediate: false,
        reason: LogoutReason::CLOSE_SESSION,
        itt: c.itt(),
        cmd_sn: c.cmd_sn,
        exp_stat_sn: c.exp_stat_sn,
        ..Default::default()
    };
    wire.extend_from_slice(
        &Pdu::new(Header::LogoutRequest(logout), Bytes::new())
            .bhs()
            .0,
    );
    c.send_bytes(&wire).await.unwrap();
    let mut data = std::collections::HashMap::new();
    let mut done = Vec::new();
    let logout = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let p = c.recv().await.unwrap();
            match p.header {
                Header::DataIn(d) => {
                    *data.entry(d.itt).or_insert(0usize) += p.data.len();
                    if d.status.is_some() {
                        done.push(d.itt);
                    }
                }
                Header::ScsiResponse(r) => done.push(r.itt),
                Header::LogoutResponse(l) => return l,
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await
    .expect("the Logout Response never came: the connection hung");
    assert_eq!(logout.response, LogoutResponseCode::CLOSED);
    assert_eq!(
        done.len(),
        2,
        "both reads completed before the Logout Response"
    );
    assert_eq!(data.get(&itts[0]), Some(&(32usize << 10)));
    assert_eq!(data.get(&itts[1]), Some(&(32usize << 20)));
}

#[tokio::test]
async fn digests_are_computed_and_checked_both_ways() {
    let (addr, _stop) = start().await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.header_digest = true;
    o.data_digest = true;
    let mut c = Client::login(addr, &o).await.unwrap();
    assert!(
        c.header_digest && c.data_digest,
        "target did not accept CRC32C: {:?}",
        c.negotiated
    );
    // Odd lengths exercise padding inside the digest.
    assert_eq!(
        c.ping(Bytes::from_static(b"abcde")).await.unwrap(),
        Bytes::from_static(b"abcde")
    );
    round_trip(&mut c, 0, 300 * 1024, 7).await;
}

/// A ping may carry up to the target's MaxRecvDataSegmentLength (256 KiB) while the
/// initiator declared a smaller one: the echo stops at the initiator's (RFC 7143 §11.18.4),
/// never a PDU longer than it said it can take. Found by the `session` fuzz target.
#[tokio::test]
async fn ping_echoes_no_more_than_the_initiators_segment_length() {
    let (addr, _stop) = start().await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.max_recv_data_segment_length = 8192;
    let mut c = Client::login(addr, &o).await.unwrap();
    assert!(c.target_mrdsl > 8192, "target declared {}", c.target_mrdsl);
    let data = pattern(13455, 3);
    // `recv` reads whatever length the header announces, so a longer echo would show here.
    assert_eq!(c.ping(data.clone()).await.unwrap(), data.slice(..8192));
    assert_eq!(
        c.ping(data.slice(..8192)).await.unwrap(),
        data.slice(..8192)
    );
    round_trip(&mut c, 0, 64 * 1024, 9).await;
}

#[tokio::test]
async fn r2t_only_writes_with_small_segments_and_bursts() {
    let (addr, _stop) = start_with(|c| {
        c.negotiation.max_recv_data_segment_length = 4096;
        c.negotiation.max_burst_length = 16384;
    })
    .await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.initial_r2t = true;
    o.immediate_data = false;
    o.max_recv_data_segment_length = 4096;
    o.max_burst_length = 16384;
    o.first_burst_length = 8192;
    let mut c = Client::login(addr, &o).await.unwrap();
    assert!(c.initial_r2t && !c.immediate_data);
    assert_eq!(c.target_mrdsl, 4096);
    // 1 MiB: 64 R2Ts of 16 KiB, each answered with four 4 KiB Data-Out PDUs; read back as
    // 256 Data-In PDUs in 16 KiB sequences.
    round_trip(&mut c, 100, 1 << 20, 9).await;
}

#[tokio::test]
async fn immediate_and_unsolicited_data_then_r2t() {
    let (addr, _stop) = start().await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.initial_r2t = false;
    o.immediate_data = true;
    o.first_burst_length = 65536;
    let mut c = Client::login(addr, &o).await.unwrap();
    assert!(!c.initial_r2t && c.immediate_data);
    round_trip(&mut c, 3, 3 << 20, 3).await;
}

#[tokio::test]
async fn read_residuals_are_reported() {
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    // READ(10) of 2 blocks with EDTL of 3 blocks: underflow of one block.
    let cdb = [0x28, 0, 0, 0, 0, 0, 0, 0, 2, 0];
    let r = c.command(0, &cdb, None, 1536).await.unwrap();
    assert_eq!(r.status, 0);
    assert_eq!(r.data.len(), 1024);
    assert_eq!(r.residual, Residual::Underflow(512));
    // EDTL of one block for two: overflow, and only one block is sent.
    let r = c.command(0, &cdb, None, 512).await.unwrap();
    assert_eq!(r.data.len(), 512);
    assert_eq!(r.residual, Residual::Overflow(512));
}

#[tokio::test]
async fn check_condition_carries_sense_for_lba_out_of_range() {
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    let r = c.read16(0, u64::MAX - 1, 4, 512).await.unwrap();
    assert_eq!(r.status, 2);
    assert_eq!(r.sense_key(), Some((0x5, 0x21, 0x00)));
    assert!(r.data.is_empty());
}

#[tokio::test]
async fn discovery_session_lists_targets_with_portal_and_tag() {
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &LoginOptions::new(None)).await.unwrap();
    let pairs = c.send_targets("All").await.unwrap();
    assert_eq!(pairs[0], ("TargetName".to_string(), TARGET.to_string()));
    assert_eq!(pairs[1], ("TargetAddress".to_string(), format!("{addr},1")));
    // SCSI commands are not allowed in a discovery session: Reject.
    c.send(
        Header::ScsiCommand(ScsiCommand {
            final_bit: true,
            itt: Itt(77),
            cmd_sn: c.cmd_sn,
            cdb: [0; 16],
            ..Default::default()
        }),
        Bytes::new(),
    )
    .await
    .unwrap();
    match c.recv().await.unwrap().header {
        Header::Reject(r) => assert_eq!(r.reason, RejectReason::PROTOCOL_ERROR),
        h => panic!("expected Reject, got {h:?}"),
    }
}

#[tokio::test]
async fn unknown_target_fails_login_with_0203() {
    let (addr, _stop) = start().await;
    let err = Client::login(
        addr,
        &LoginOptions::new(Some("iqn.2026-11.org.ironsan:nope")),
    )
    .await
    .err()
    .unwrap();
    assert!(
        matches!(err, ironsan_initiator::Error::Login(2, 3)),
        "{err:?}"
    );
}

#[tokio::test]
async fn commands_outside_the_cmdsn_window_are_ignored() {
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    let max = c.max_cmd_sn;
    // A TEST UNIT READY far above MaxCmdSN: no response may come for it.
    let itt = c.itt();
    c.send(
        Header::ScsiCommand(ScsiCommand {
            final_bit: true,
            itt,
            cmd_sn: max.plus(10),
            cdb: [0; 16],
            ..Default::default()
        }),
        Bytes::new(),
    )
    .await
    .unwrap();
    // The next in-window command is answered, and nothing for the ignored one arrived first.
    let r = c.command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!(r.status, 0);
    assert!(
        c.unsolicited.is_empty(),
        "unexpected PDUs: {:?}",
        c.unsolicited
    );
}

#[tokio::test]
async fn unknown_opcode_is_rejected_with_the_header_echoed() {
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    let mut bhs = Bhs::default();
    bhs.0[0] = 0x1c;
    bhs.0[16..20].copy_from_slice(&[1, 2, 3, 4]);
    c.send_raw_bhs(&bhs, &[]).await.unwrap();
    let pdu = c.recv().await.unwrap();
    match pdu.header {
        Header::Reject(r) => assert_eq!(r.reason, RejectReason::COMMAND_NOT_SUPPORTED),
        h => panic!("expected Reject, got {h:?}"),
    }
    assert_eq!(&pdu.data[..], &bhs.0[..]);
    // The connection still works.
    assert_eq!(
        c.ping(Bytes::from_static(b"x")).await.unwrap(),
        Bytes::from_static(b"x")
    );
}

#[tokio::test]
async fn data_digest_error_rejects_and_fails_the_command_without_writing() {
    let (addr, _stop) = start().await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.data_digest = true;
    let mut c = Client::login(addr, &o).await.unwrap();
    // A WRITE(10) of one block with immediate data whose digest is wrong.
    let cmd = c.stamp(ScsiCommand {
        final_bit: true,
        write: true,
        expected_data_transfer_length: 512,
        cdb: [0x2a, 0, 0, 0, 0, 9, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        ..Default::default()
    });
    let itt = cmd.itt;
    let pdu = Pdu::new(Header::ScsiCommand(cmd), Bytes::from(vec![0xee; 512]));
    let bhs = pdu.bhs();
    let mut raw = bhs.0.to_vec();
    raw.extend_from_slice(&[0xee; 512]);
    raw.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
    c.send_bytes(&raw).await.unwrap();
    // The Reject and the SCSI Response, in either order: the Reject is queued on the
    // connection, the response is sent by the task that ends the command, and the protocol
    // does not order them.
    let (mut saw_reject, mut saw_status) = (false, false);
    while !saw_reject || !saw_status {
        let p = tokio::time::timeout(Duration::from_secs(10), c.recv())
            .await
            .unwrap_or_else(|_| {
                panic!("Reject seen: {saw_reject}, SCSI Response seen: {saw_status}; no more within 10 s")
            })
            .unwrap();
        match p.header {
            Header::Reject(r) if !saw_reject => {
                assert_eq!(r.reason, RejectReason::DATA_DIGEST_ERROR);
                saw_reject = true;
            }
            Header::ScsiResponse(r) if !saw_status => {
                assert_eq!(r.itt, itt);
                assert_eq!(r.status, 2);
                saw_status = true;
            }
            h => panic!("unexpected {h:?}"),
        }
    }
    let r = c.read16(0, 9, 1, 512).await.unwrap();
    assert!(
        r.data.iter().all(|&b| b == 0),
        "a write with a bad digest reached the disk"
    );
}

#[tokio::test]
async fn bad_data_sn_fails_the_write_and_writes_nothing() {
    let (addr, _stop) = start().await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.initial_r2t = true;
    o.immediate_data = false;
    let mut c = Client::login(addr, &o).await.unwrap();
    let cmd = ScsiCommand {
        final_bit: true,
        write: true,
        expected_data_transfer_length: 1024,
        cdb: [0x2a, 0, 0, 0, 0, 20, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0],
        ..Default::default()
    };
    let (itt, _) = c.send_command(cmd, Bytes::new()).await.unwrap();
    let Header::R2t(r2t) = c.recv().await.unwrap().header else {
        panic!("expected R2T")
    };
    let d = DataOut {
        final_bit: true,
        itt,
        ttt: r2t.ttt,
        data_sn: DataSn(5),
        buffer_offset: 0,
        ..Default::default()
    };
    c.send(Header::DataOut(d), Bytes::from(vec![0xab; 1024]))
        .await
        .unwrap();
    let mut status = None;
    while status.is_none() {
        match c.recv().await.unwrap().header {
            Header::Reject(r) => assert_eq!(r.reason, RejectReason::PROTOCOL_ERROR),
            Header::ScsiResponse(r) => status = Some(r.status),
            h => panic!("unexpected {h:?}"),
        }
    }
    assert_eq!(status, Some(2));
    let r = c.read16(0, 20, 2, 512).await.unwrap();
    assert!(r.data.iter().all(|&b| b == 0));
}

#[tokio::test]
async fn abort_task_of_a_write_waiting_for_data() {
    let (addr, _stop) = start().await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.initial_r2t = true;
    o.immediate_data = false;
    let mut c = Client::login(addr, &o).await.unwrap();
    let cmd = ScsiCommand {
        final_bit: true,
        write: true,
        expected_data_transfer_length: 4096,
        cdb: [0x2a, 0, 0, 0, 0, 40, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0],
        ..Default::default()
    };
    let (itt, cmd_sn) = c.send_command(cmd, Bytes::new()).await.unwrap();
    let Header::R2t(_) = c.recv().await.unwrap().header else {
        panic!("expected R2T")
    };
    let code = c
        .task_mgmt(TmfFunction::ABORT_TASK, 0, itt, cmd_sn)
        .await
        .unwrap();
    assert_eq!(code, TmfResponseCode::COMPLETE);
    // An unknown task that was never sent does not exist.
    let code = c
        .task_mgmt(TmfFunction::ABORT_TASK, 0, Itt(999), c.cmd_sn.plus(5))
        .await
        .unwrap();
    assert_eq!(code, TmfResponseCode::TASK_DOES_NOT_EXIST);
    // LUN reset of a LUN that does not exist.
    let code = c
        .task_mgmt(TmfFunction::LOGICAL_UNIT_RESET, 7, Itt::RESERVED, CmdSn(0))
        .await
        .unwrap();
    assert_eq!(code, TmfResponseCode::LUN_DOES_NOT_EXIST);
    let code = c
        .task_mgmt(TmfFunction::LOGICAL_UNIT_RESET, 0, Itt::RESERVED, CmdSn(0))
        .await
        .unwrap();
    assert_eq!(code, TmfResponseCode::COMPLETE);
    // The window slot of the aborted write was released: commands still flow.
    let r = c.command(0, &[0u8; 6], None, 0).await.unwrap();
    // The LUN reset raised a unit attention only for other nexuses, so this is GOOD.
    assert_eq!(r.status, 0, "{:?}", r.sense_key());
}

#[tokio::test]
async fn session_reinstatement_replaces_the_old_session() {
    let (addr, _stop) = start().await;
    let o = LoginOptions::new(Some(TARGET));
    let mut old = Client::login(addr, &o).await.unwrap();
    round_trip(&mut old, 0, 512, 1).await;
    let mut new = Client::login(addr, &o).await.unwrap();
    assert_ne!(new.tsih, old.tsih);
    round_trip(&mut new, 0, 512, 2).await;
    // The old connection was closed by the target.
    let res = tokio::time::timeout(Duration::from_secs(5), old.recv())
        .await
        .expect("old connection still open");
    assert!(res.is_err(), "old session still answering: {res:?}");
}

#[tokio::test]
async fn non_login_pdu_before_login_closes_the_connection() {
    let (addr, _stop) = start().await;
    let (mut rd, mut wr) = Client::connect_raw(addr).await.unwrap();
    let bhs = Pdu::new(
        Header::NopOut(NopOut {
            itt: Itt(1),
            ..Default::default()
        }),
        Bytes::new(),
    )
    .bhs();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    wr.write_all(&bhs.0).await.unwrap();
    let mut buf = [0u8; 48];
    let n = tokio::time::timeout(Duration::from_secs(5), rd.read(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "target answered a NOP-Out before login");
}

#[tokio::test]
async fn data_segment_longer_than_negotiated_closes_the_connection() {
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    let mut bhs = Pdu::new(
        Header::NopOut(NopOut {
            itt: Itt(5),
            immediate: true,
            ..Default::default()
        }),
        Bytes::new(),
    )
    .bhs();
    // Claim 16 MiB of data: the target must not try to read (or allocate) it.
    bhs.set_lengths(0, (1 << 24) - 1);
    c.send_raw_bhs(&bhs, &[]).await.unwrap();
    let res = tokio::time::timeout(Duration::from_secs(5), c.recv())
        .await
        .expect("target kept the connection open");
    assert!(res.is_err());
}

#[tokio::test]
async fn unanswered_nop_in_closes_the_connection() {
    let (addr, _stop) = start_with(|c| {
        c.limits.nop_interval = Duration::from_millis(200);
        c.limits.nop_timeout = Duration::from_millis(300);
    })
    .await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    // Read the ping but do not answer; the target must give up on us.
    let first = tokio::time::timeout(Duration::from_secs(5), c.recv())
        .await
        .unwrap()
        .unwrap();
    match first.header {
        Header::NopIn(n) => {
            assert_eq!(n.itt, Itt::RESERVED);
            assert_ne!(n.ttt, Ttt::RESERVED);
        }
        h => panic!("expected NOP-In ping, got {h:?}"),
    }
    let res = tokio::time::timeout(Duration::from_secs(5), c.recv())
        .await
        .expect("connection not closed");
    assert!(res.is_err());
}

#[tokio::test]
async fn answered_nop_in_keeps_the_connection() {
    // Pings are answered for longer than the NOP-In timeout (so the answers are what keeps
    // the connection); each answer has the whole 3 s timeout, ample on a loaded machine.
    let timeout = Duration::from_secs(3);
    let (addr, _stop) = start_with(|c| {
        c.limits.nop_interval = Duration::from_millis(100);
        c.limits.nop_timeout = timeout;
    })
    .await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    let mut answered = 0;
    while t0.elapsed() < timeout + Duration::from_secs(1) {
        answered += 1;
        let p = tokio::time::timeout(Duration::from_secs(5), c.recv())
            .await
            .unwrap()
            .unwrap();
        let Header::NopIn(n) = p.header else {
            panic!("expected ping")
        };
        let reply = NopOut {
            immediate: true,
            itt: Itt::RESERVED,
            ttt: n.ttt,
            cmd_sn: c.cmd_sn,
            exp_stat_sn: c.exp_stat_sn,
            lun: n.lun,
        };
        c.send(Header::NopOut(reply), Bytes::new()).await.unwrap();
    }
    assert!(
        answered > 1,
        "only {answered} ping(s) in {:?}",
        t0.elapsed()
    );
    let r = c.command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!(r.status, 0);
}

#[tokio::test]
async fn many_commands_in_flight_on_one_connection() {
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    round_trip(&mut c, 0, 64 * 1024, 5).await;
    // Pipeline 32 READ(10)s without waiting, then collect every status.
    let mut itts = Vec::new();
    for i in 0..32u32 {
        let mut cdb = [0u8; 16];
        cdb[0] = 0x28;
        cdb[5] = (i * 4) as u8;
        cdb[8] = 4;
        let cmd = ScsiCommand {
            final_bit: true,
            read: true,
            expected_data_transfer_length: 2048,
            cdb,
            ..Default::default()
        };
        let (itt, _) = c.send_command(cmd, Bytes::new()).await.unwrap();
        itts.push(itt);
    }
    let mut done = 0;
    let mut stat_sns = Vec::new();
    while done < 32 {
        let p = c.recv().await.unwrap();
        if let Header::DataIn(d) = p.header {
            if let Some(s) = d.status {
                assert_eq!(s, 0);
                assert!(itts.contains(&d.itt));
                stat_sns.push(d.sn.stat_sn.0);
                done += 1;
            }
        }
    }
    // StatSN increments by one per status, in order.
    for w in stat_sns.windows(2) {
        assert_eq!(w[1], w[0] + 1);
    }
}

#[tokio::test]
async fn several_outstanding_r2ts_are_issued_and_honoured() {
    let (addr, _stop) = start_with(|c| c.negotiation.max_burst_length = 65536).await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.initial_r2t = true;
    o.immediate_data = false;
    o.max_burst_length = 65536;
    o.max_outstanding_r2t = 4;
    let mut c = Client::login(addr, &o).await.unwrap();
    let len = 512 * 1024u32;
    let cmd = ScsiCommand {
        final_bit: true,
        write: true,
        expected_data_transfer_length: len,
        cdb: {
            let mut cdb = [0u8; 16];
            cdb[0] = 0x2a;
            cdb[7..9].copy_from_slice(&((len / 512) as u16).to_be_bytes());
            cdb
        },
        ..Default::default()
    };
    let (itt, _) = c.send_command(cmd, Bytes::new()).await.unwrap();
    // Four R2Ts arrive before any data is sent: MaxOutstandingR2T=4 is in force.
    let mut r2ts = Vec::new();
    for _ in 0..4 {
        match c.recv().await.unwrap().header {
            Header::R2t(r) => r2ts.push(r),
            h => panic!("expected R2T, got {h:?}"),
        }
    }
    let offsets: Vec<u32> = r2ts.iter().map(|r| r.buffer_offset).collect();
    assert_eq!(offsets, vec![0, 65536, 131072, 196608]);
    assert!(r2ts.iter().all(|r| r.desired_data_transfer_length == 65536));
    let data = pattern(len as usize, 42);
    // Answer them (and the ones that follow) until the status arrives.
    let mut pending = r2ts;
    loop {
        for r in pending.drain(..) {
            let mut off = r.buffer_offset;
            let end = off + r.desired_data_transfer_length;
            let mut sn = 0;
            while off < end {
                let n = (end - off).min(c.target_mrdsl);
                let d = DataOut {
                    final_bit: off + n == end,
                    itt,
                    ttt: r.ttt,
                    data_sn: DataSn(sn),
                    buffer_offset: off,
                    ..Default::default()
                };
                c.send(
                    Header::DataOut(d),
                    data.slice(off as usize..(off + n) as usize),
                )
                .await
                .unwrap();
                off += n;
                sn += 1;
            }
        }
        match c.recv().await.unwrap().header {
            Header::R2t(r) => pending.push(r),
            Header::ScsiResponse(r) => {
                assert_eq!(r.status, 0);
                assert_eq!(
                    r.exp_data_sn,
                    DataSn(8),
                    "ExpDataSN of a write counts its R2Ts"
                );
                break;
            }
            h => panic!("unexpected {h:?}"),
        }
    }
    let r = c.read16(0, 0, len / 512, 512).await.unwrap();
    assert!(r.data == data);
}

#[tokio::test]
async fn task_set_and_target_resets_complete() {
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    for f in [
        TmfFunction::ABORT_TASK_SET,
        TmfFunction::CLEAR_TASK_SET,
        TmfFunction::TARGET_WARM_RESET,
    ] {
        assert_eq!(
            c.task_mgmt(f, 0, Itt::RESERVED, CmdSn(0)).await.unwrap(),
            TmfResponseCode::COMPLETE,
            "{f:?}"
        );
    }
    assert_eq!(
        c.task_mgmt(TmfFunction::CLEAR_ACA, 0, Itt::RESERVED, CmdSn(0))
            .await
            .unwrap(),
        TmfResponseCode::NOT_SUPPORTED
    );
    assert_eq!(
        c.task_mgmt(TmfFunction::TASK_REASSIGN, 0, Itt(3), CmdSn(0))
            .await
            .unwrap(),
        TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED
    );
    // A second session sees the warm reset as a unit attention on its next command.
    let mut o = LoginOptions::new(Some(TARGET));
    o.isid = Isid([0x80, 0, 0, 0, 0, 9]);
    let mut other = Client::login(addr, &o).await.unwrap();
    let r = other.command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!(
        r.status, 0,
        "a session that logged in after the reset has no UA"
    );
    assert_eq!(
        c.task_mgmt(TmfFunction::TARGET_WARM_RESET, 0, Itt::RESERVED, CmdSn(0))
            .await
            .unwrap(),
        TmfResponseCode::COMPLETE
    );
    let r = other.command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!(r.status, 2);
    assert_eq!(r.sense_key().map(|k| (k.0, k.1)), Some((0x6, 0x29)));
    // Cold reset: answered, then the target closes the connection.
    assert_eq!(
        c.task_mgmt(TmfFunction::TARGET_COLD_RESET, 0, Itt::RESERVED, CmdSn(0))
            .await
            .unwrap(),
        TmfResponseCode::COMPLETE
    );
    let res = tokio::time::timeout(Duration::from_secs(5), c.recv())
        .await
        .expect("connection not closed after cold reset");
    assert!(res.is_err());
}

#[tokio::test]
async fn text_request_in_full_feature_phase() {
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    // In a normal session SendTargets with an empty value lists this session's target.
    let pairs = c.send_targets("").await.unwrap();
    assert_eq!(
        pairs.first(),
        Some(&("TargetName".to_string(), TARGET.to_string()))
    );
}
