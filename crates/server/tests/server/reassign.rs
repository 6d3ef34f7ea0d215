//! ErrorRecoveryLevel 2 over real sockets with ironsan's initiator (RFC 7143 §7.2.2, §6.2.2,
//! §11.5.1 TASK REASSIGN, §11.14 logout reason 2): a connection cut in the middle of a read or
//! a write, logged out for recovery from another connection of the session, and its task
//! reassigned there and finished; a session whose only connection failed taken up again by a
//! new one; what is not reassigned in time ends; the refusals the RFC asks for.
//!
//! LUN 0 is a [`FaultBackend`] over RAM: reads and writes of LBAs 2000-2007 take 1.5 s, so a
//! command is still running when its connection is cut.

use crate::support;

use bytes::{Bytes, BytesMut};
use ironsan_backend::{BlockDevice, FaultBackend, FaultRule, RamBackend};
use ironsan_initiator::{Client, Error, LoginOptions};
use ironsan_proto::pdu::*;
use ironsan_proto::{DataSn, StatSn};
use ironsan_server::{Server, ServerConfig};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use support::{pattern, TARGET};

const BS: u32 = 512;
/// LBAs whose I/O takes 1.5 s.
const SLOW: u64 = 2000;
const WAIT: Duration = Duration::from_secs(15);

async fn rig(
    tune: impl FnOnce(&mut ServerConfig),
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let inner: Arc<dyn BlockDevice> = Arc::new(RamBackend::new(16 << 20));
    let rules = vec![FaultRule::parse(&format!("rw@{SLOW}-{}:delay=1500ms", SLOW + 7)).unwrap()];
    let fault = FaultBackend::new(inner, rules, BS, 1);
    let t = support::target_on(TARGET, Arc::new(fault), 0x3000_0000_0000_0030);
    let mut cfg = ServerConfig::new(vec!["127.0.0.1:0".parse().unwrap()], vec![t]);
    tune(&mut cfg);
    let server = Server::bind(cfg).await.unwrap();
    let addr = server.local_addrs()[0];
    (addr, support::run_in_background(server))
}

/// Level 2 offered, tasks kept 20 s, two connections, 64 KiB segments, writes by R2T only.
fn opts(isid: u8) -> LoginOptions {
    let mut o = LoginOptions::new(Some(TARGET));
    o.isid.0[5] = isid;
    o.error_recovery_level = 2;
    o.time2retain = 20;
    o.max_connections = 2;
    o.max_recv_data_segment_length = 65536;
    o.max_burst_length = 65536;
    o.initial_r2t = true;
    o.immediate_data = false;
    o
}

async fn pair(addr: SocketAddr, o: &LoginOptions) -> (Client, Client) {
    let a = Client::login(addr, o).await.unwrap();
    assert_eq!(a.negotiated_value("ErrorRecoveryLevel"), Some("2"));
    let b = Client::join(addr, o, &a, 1).await.unwrap();
    (a, b)
}

/// Write `data` at `lba` through R2Ts.
async fn write(c: &mut Client, lba: u64, data: &Bytes) {
    let r = c.write16(0, lba, data.clone(), BS, false).await.unwrap();
    assert_eq!(r.status, 0, "write: {:?}", r.sense_key());
}

async fn read(c: &mut Client, lba: u64, len: usize) -> Bytes {
    let r = c.read16(0, lba, (len / 512) as u32, BS).await.unwrap();
    assert_eq!(r.status, 0, "read: {:?}", r.sense_key());
    r.data
}

/// The first `n` Data-In of a read on `c` into `buf`, DataSN 0.. in order: their lengths.
async fn take_data_in(c: &mut Client, n: u32, buf: &mut BytesMut) -> Vec<usize> {
    let mut lens = Vec::new();
    for sn in 0..n {
        let p = c.recv().await.unwrap();
        let Header::DataIn(d) = p.header else {
            panic!("expected Data-In")
        };
        assert_eq!(d.data_sn, DataSn(sn));
        let at = d.buffer_offset as usize;
        buf[at..at + p.data.len()].copy_from_slice(&p.data);
        lens.push(p.data.len());
    }
    lens
}

/// A Data-In of a read: DataSN, buffer offset, length.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Piece {
    sn: u32,
    offset: usize,
    len: usize,
}

/// The rest of read `itt` on `c` into `buf`: (the Data-In seen, status). The status's StatSN
/// advances `c`'s ExpStatSN; a separate SCSI Response's ExpDataSN must count every Data-In
/// of the task (RFC 7143 §11.4.8), the last one seen included.
async fn finish_read(c: &mut Client, itt: Itt, buf: &mut BytesMut) -> (Vec<Piece>, u8) {
    let mut pieces = Vec::new();
    loop {
        let p = tokio::time::timeout(WAIT, c.recv())
            .await
            .expect("in time")
            .expect("a PDU");
        match p.header {
            Header::DataIn(d) if d.itt == itt => {
                let at = d.buffer_offset as usize;
                pieces.push(Piece {
                    sn: d.data_sn.0,
                    offset: at,
                    len: p.data.len(),
                });
                buf[at..at + p.data.len()].copy_from_slice(&p.data);
                if let Some(s) = d.status {
                    c.exp_stat_sn = d.sn.stat_sn.next();
                    return (pieces, s);
                }
            }
            Header::ScsiResponse(r) if r.itt == itt => {
                if let Some(last) = pieces.last() {
                    assert_eq!(r.exp_data_sn, DataSn(last.sn + 1), "ExpDataSN");
                }
                c.exp_stat_sn = r.sn.stat_sn.next();
                return (pieces, r.status);
            }
            Header::NopIn(_) => continue,
            other => panic!("expected the read's Data-In, got {other:?}"),
        }
    }
}

/// Answer R2Ts for write `itt` of `data` on `c` until its status.
async fn finish_write(c: &mut Client, itt: Itt, data: &Bytes) -> (Vec<(u32, u32)>, u8) {
    let mut asked = Vec::new();
    loop {
        let p = tokio::time::timeout(WAIT, c.recv())
            .await
            .expect("in time")
            .expect("a PDU");
        match p.header {
            Header::R2t(r) if r.itt == itt => {
                asked.push((r.buffer_offset, r.desired_data_transfer_length));
                c.answer_r2t(&r, data).await.unwrap();
            }
            Header::ScsiResponse(r) if r.itt == itt => return (asked, r.status),
            Header::NopIn(_) => continue,
            other => panic!("expected R2Ts or the status, got {other:?}"),
        }
    }
}

/// Cut connection `a` (CID 0) and log it out for recovery from `b`, with its last ExpStatSN;
/// `b` takes over `a`'s CmdSN.
async fn cut_and_recover(a: Client, b: &mut Client) {
    b.cmd_sn = a.cmd_sn;
    let last = a.exp_stat_sn;
    drop(a);
    let (code, t2w, t2r) = b
        .logout_for(LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 0, Some(last))
        .await
        .unwrap();
    assert_eq!((code, t2w, t2r), (LogoutResponseCode::CLOSED, 2, 20));
}

/// Connection `a` fails and restarts: a login with the same CID into its session (RFC 7143
/// §6.2.1), with `a`'s CmdSN and, when given, `exp_stat_sn` as the ExpStatSN it carries.
async fn restart(
    addr: SocketAddr,
    o: &LoginOptions,
    a: Client,
    exp_stat_sn: Option<StatSn>,
) -> Client {
    let mut again = o.clone();
    again.tsih = a.tsih;
    let mut b = Client::connect(addr).await.unwrap();
    b.cmd_sn = a.cmd_sn;
    if let Some(sn) = exp_stat_sn {
        b.exp_stat_sn = sn;
    }
    drop(a);
    b.login_on(&again).await.unwrap();
    b
}

/// TASK REASSIGN of `itt` from DataSN 0 on `b`, asked again for up to 5 s while the target
/// has not yet seen the old connection fail (still allegiant) or kept it (no such task).
async fn reassign_when_kept(b: &mut Client, itt: Itt) -> TmfResponseCode {
    let mut code = b.task_reassign(itt, DataSn(0)).await.unwrap();
    for _ in 0..50 {
        if code != TmfResponseCode::TASK_STILL_ALLEGIANT
            && code != TmfResponseCode::TASK_DOES_NOT_EXIST
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        code = b.task_reassign(itt, DataSn(0)).await.unwrap();
    }
    code
}

/// TASK REASSIGN of `itt` on `b` from `exp_data_sn`, answered "function complete".
async fn reassign(b: &mut Client, itt: Itt, exp_data_sn: u32) {
    assert_eq!(
        b.task_reassign(itt, DataSn(exp_data_sn)).await.unwrap(),
        TmfResponseCode::COMPLETE
    );
}

#[tokio::test]
async fn a_read_cut_mid_transfer_resumes_from_exp_data_sn_on_another_connection() {
    let (addr, _stop) = rig(|_| {}).await;
    let (mut a, mut b) = pair(addr, &opts(1)).await;
    let data = pattern(1 << 20, 5);
    write(&mut a, 4096, &data).await;
    let (itt, _) = a.send_read16(0, 4096, 2048, BS).await.unwrap();
    let mut buf = BytesMut::zeroed(data.len());
    take_data_in(&mut a, 3, &mut buf).await;
    cut_and_recover(a, &mut b).await; // the connection is cut with most of the read unsent
    reassign(&mut b, itt, 3).await;
    let (pieces, status) = finish_read(&mut b, itt, &mut buf).await;
    assert_eq!(status, 0);
    assert_eq!(
        pieces.first().map(|p| p.sn),
        Some(3),
        "from the initiator's ExpDataSN"
    );
    assert_eq!(&buf[..], &data[..], "the read arrives complete");
    // The session goes on on B, its StatSN in step.
    assert_eq!(read(&mut b, 4096, 4096).await, data.slice(..4096));
    assert_eq!(b.logout().await.unwrap(), LogoutResponseCode::CLOSED);
}

#[tokio::test]
async fn a_read_resumed_on_a_connection_with_smaller_segments_is_resegmented() {
    let (addr, _stop) = rig(|_| {}).await;
    let o = opts(8);
    let mut a = Client::login(addr, &o).await.unwrap();
    // B declares 8 KiB segments, A 64 KiB (RFC 7143 §11.5.6, §12.12: per connection).
    let mut small = o.clone();
    small.max_recv_data_segment_length = 8192;
    let mut b = Client::join(addr, &small, &a, 1).await.unwrap();
    let data = pattern(1 << 20, 12);
    write(&mut a, 4096, &data).await;
    let (itt, _) = a.send_read16(0, 4096, 2048, BS).await.unwrap();
    let mut buf = BytesMut::zeroed(data.len());
    assert_eq!(take_data_in(&mut a, 2, &mut buf).await, [65536, 65536]);
    cut_and_recover(a, &mut b).await;
    reassign(&mut b, itt, 2).await;
    let (pieces, status) = finish_read(&mut b, itt, &mut buf).await;
    assert_eq!(status, 0);
    let mut offset = 2 * 65536;
    for p in &pieces {
        assert!(p.len <= 8192, "{p:?}");
        assert_eq!(p.offset, offset, "in order, no gap");
        offset += p.len;
    }
    let sns: Vec<u32> = pieces.iter().map(|p| p.sn).collect();
    let want: Vec<u32> = (2..2 + 14 * 8).collect();
    assert_eq!(sns, want, "14 x 64 KiB in 8 KiB Data-In from DataSN 2");
    assert_eq!(&buf[..], &data[..], "the read arrives complete");
    assert_eq!(read(&mut b, 4096, 65536).await, data.slice(..65536));
}

#[tokio::test]
async fn a_restarting_login_acknowledges_the_old_connections_statuses() {
    let (addr, _stop) = rig(|_| {}).await;
    let o = opts(9);
    let mut a = Client::login(addr, &o).await.unwrap();
    let data = pattern(8192, 13);
    write(&mut a, 64, &data).await;
    // Two reads answered in full on A (sent together: no later PDU on A acknowledges
    // their statuses); the connection then fails.
    let (first, _) = a.send_read16(0, 64, 8, BS).await.unwrap();
    let (second, _) = a.send_read16(0, 72, 8, BS).await.unwrap();
    let mut buf = BytesMut::zeroed(4096);
    assert_eq!(finish_read(&mut a, first, &mut buf).await.1, 0);
    let acked = a.exp_stat_sn;
    assert_eq!(finish_read(&mut a, second, &mut buf).await.1, 0);
    // The connection restarted with the same CID, its login acknowledging the first read's
    // status only (RFC 7143 §11.12.8).
    let mut b = restart(addr, &o, a, Some(acked)).await;
    assert_eq!(
        reassign_when_kept(&mut b, second).await,
        TmfResponseCode::COMPLETE,
        "unacknowledged: resent"
    );
    let mut buf = BytesMut::zeroed(4096);
    assert_eq!(finish_read(&mut b, second, &mut buf).await.1, 0);
    assert_eq!(&buf[..], &data[4096..]);
    assert_eq!(
        b.task_reassign(first, DataSn(0)).await.unwrap(),
        TmfResponseCode::TASK_DOES_NOT_EXIST,
        "acknowledged by the login: let go"
    );
}

#[tokio::test]
async fn a_read_still_running_when_cut_is_answered_when_it_finishes() {
    let (addr, _stop) = rig(|_| {}).await;
    let (mut a, mut b) = pair(addr, &opts(2)).await;
    let data = pattern(4096, 6);
    write(&mut a, SLOW, &data).await;
    let (itt, _) = a.send_read16(0, SLOW, 8, BS).await.unwrap();
    cut_and_recover(a, &mut b).await;
    reassign(&mut b, itt, 0).await;
    let mut buf = BytesMut::zeroed(4096);
    let (pieces, status) = finish_read(&mut b, itt, &mut buf).await;
    let sns: Vec<u32> = pieces.iter().map(|p| p.sn).collect();
    assert_eq!((sns, status), (vec![0], 0));
    assert_eq!(&buf[..], &data[..]);
}

#[tokio::test]
async fn a_write_cut_while_sending_data_is_asked_for_again_and_lands_once() {
    let (addr, _stop) = rig(|_| {}).await;
    let (mut a, mut b) = pair(addr, &opts(3)).await;
    let old = pattern(128 << 10, 1);
    write(&mut a, 6000, &old).await;
    let data = pattern(128 << 10, 2);
    let (itt, _) = a
        .send_write16(0, 6000, data.len() as u32, BS, Bytes::new())
        .await
        .unwrap();
    let Header::R2t(r2t) = a.recv().await.unwrap().header else {
        panic!("expected an R2T")
    };
    assert_eq!(
        (r2t.buffer_offset, r2t.desired_data_transfer_length),
        (0, 65536)
    );
    // Half of the first burst, then the connection is cut.
    let d = DataOut {
        final_bit: false,
        lun: Lun::from_number(0),
        itt,
        ttt: r2t.ttt,
        ..Default::default()
    };
    a.send(Header::DataOut(d), data.slice(..32768))
        .await
        .unwrap();
    cut_and_recover(a, &mut b).await;
    // Nothing of it was written.
    assert_eq!(read(&mut b, 6000, old.len()).await, old);
    reassign(&mut b, itt, 0).await;
    let (asked, status) = finish_write(&mut b, itt, &data).await;
    assert_eq!(status, 0);
    assert_eq!(
        asked,
        vec![(0, 65536), (65536, 65536)],
        "all of it again, by R2T"
    );
    assert_eq!(read(&mut b, 6000, data.len()).await, data);
    // Reassigned once: asking again finds no task.
    assert_eq!(
        b.task_reassign(itt, DataSn(0)).await.unwrap(),
        TmfResponseCode::TASK_DOES_NOT_EXIST
    );
}

#[tokio::test]
async fn a_write_running_when_cut_is_applied_once_and_its_status_resent() {
    let (addr, _stop) = rig(|_| {}).await;
    let mut o = opts(4);
    o.immediate_data = true;
    o.initial_r2t = false;
    let (mut a, mut b) = pair(addr, &o).await;
    let data = pattern(4096, 8);
    let (itt, _) = a
        .send_write16(0, SLOW, 4096, BS, data.clone())
        .await
        .unwrap();
    cut_and_recover(a, &mut b).await;
    reassign(&mut b, itt, 0).await;
    let (asked, status) = finish_write(&mut b, itt, &data).await;
    assert_eq!(
        (asked, status),
        (vec![], 0),
        "no data asked for: it had it all"
    );
    assert_eq!(read(&mut b, SLOW, 4096).await, data);
}

#[tokio::test]
async fn a_session_whose_only_connection_failed_is_taken_up_by_a_new_one() {
    let (addr, _stop) = rig(|_| {}).await;
    let o = opts(5);
    let mut a = Client::login(addr, &o).await.unwrap();
    let data = pattern(4096, 9);
    write(&mut a, SLOW, &data).await;
    let (itt, _) = a.send_read16(0, SLOW, 8, BS).await.unwrap();
    // The same CID in the same session: the old connection is already gone, or reinstated.
    let mut b = restart(addr, &o, a, None).await;
    assert_eq!(
        reassign_when_kept(&mut b, itt).await,
        TmfResponseCode::COMPLETE
    );
    let mut buf = BytesMut::zeroed(4096);
    let (_, status) = finish_read(&mut b, itt, &mut buf).await;
    assert_eq!(status, 0);
    assert_eq!(&buf[..], &data[..]);
}

#[tokio::test]
async fn what_is_not_reassigned_in_time_ends_and_so_does_the_session() {
    let (addr, _stop) = rig(|_| {}).await;
    let mut o = opts(6);
    // Kept DefaultTime2Wait (2 s) + DefaultTime2Retain (1 s).
    o.time2retain = 1;
    let mut a = Client::login(addr, &o).await.unwrap();
    let data = pattern(4096, 10);
    write(&mut a, 100, &data).await;
    let (_itt, _) = a
        .send_write16(0, 100, 4096, BS, Bytes::new())
        .await
        .unwrap();
    let Header::R2t(_) = a.recv().await.unwrap().header else {
        panic!("expected an R2T")
    };
    let tsih = a.tsih;
    drop(a);
    tokio::time::sleep(Duration::from_millis(4500)).await;
    let mut late = o.clone();
    late.tsih = tsih;
    late.cid = Cid(1);
    let mut c = Client::connect(addr).await.unwrap();
    let e = c.login_on(&late).await.unwrap_err();
    assert!(
        matches!(e, Error::Login(2, 0x0a)),
        "the session ended: {e:?}"
    );
    // The write never got its data: the old data stays.
    let mut fresh = Client::login(addr, &opts(7)).await.unwrap();
    assert_eq!(read(&mut fresh, 100, 4096).await, data);
}

#[tokio::test]
async fn refusals_follow_the_rfc() {
    let (addr, _stop) = rig(|_| {}).await;
    let (mut a, mut b) = pair(addr, &opts(8)).await;
    // A task still on a live connection: still allegiant, on it or on another one.
    let (itt, _) = a.send_read16(0, SLOW, 8, BS).await.unwrap();
    b.cmd_sn = a.cmd_sn;
    assert_eq!(
        b.task_reassign(itt, DataSn(0)).await.unwrap(),
        TmfResponseCode::TASK_STILL_ALLEGIANT
    );
    assert_eq!(
        a.task_reassign(itt, DataSn(0)).await.unwrap(),
        TmfResponseCode::TASK_STILL_ALLEGIANT
    );
    // An unknown task.
    assert_eq!(
        b.task_reassign(Itt(0x0bad_0001), DataSn(0)).await.unwrap(),
        TmfResponseCode::TASK_DOES_NOT_EXIST
    );
    // A logout for recovery of a CID the session does not have.
    let (code, _, _) = b
        .logout_for(LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 7, None)
        .await
        .unwrap();
    assert_eq!(code, LogoutResponseCode::CID_NOT_FOUND);
    // The read on A is unharmed.
    let mut buf = BytesMut::zeroed(4096);
    assert_eq!(finish_read(&mut a, itt, &mut buf).await.1, 0);

    // Below level 2 (or with DefaultTime2Retain 0): not supported.
    for (erl, t2r) in [(1, 20), (2, 0)] {
        let mut o = opts(9);
        o.error_recovery_level = erl;
        o.time2retain = t2r;
        let mut c = Client::login(addr, &o).await.unwrap();
        let want = if erl < 2 {
            TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED
        } else {
            TmfResponseCode::TASK_DOES_NOT_EXIST
        };
        assert_eq!(c.task_reassign(Itt(5), DataSn(0)).await.unwrap(), want);
        let (code, _, _) = c
            .logout_for(LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 0, None)
            .await
            .unwrap();
        assert_eq!(code, LogoutResponseCode::RECOVERY_NOT_SUPPORTED);
    }
}

/// A verified stream of reads and writes while one connection of the session is cut every
/// round, in the middle of its commands, and replaced (`ironsan_initiator::cuts`): every
/// acknowledged write reads back, none is applied over a later one, every resumed read
/// arrives whole, every reassignment is answered COMPLETE.
#[tokio::test]
async fn a_verified_stream_survives_connections_cut_and_replaced() {
    let (addr, _stop) = rig(|_| {}).await;
    let spec = ironsan_initiator::cuts::CutSpec {
        addr,
        opts: opts(10),
        lun: 0,
        rounds: 24,
        depth: 8,
        // 64 KiB commands over 4 MiB: region 15 holds the slow LBAs.
        blocks: 128,
        block_size: BS,
        regions: 64,
        seed: 0x5eed,
    };
    let r = ironsan_initiator::cuts::run(&spec).await.unwrap();
    assert_eq!(r.rounds, 24);
    assert!(r.failures.is_empty(), "{:?}", r.failures);
    assert_eq!(r.mismatches, 0, "of {} blocks", r.verified_blocks);
    assert!(r.reassigned > 24, "few tasks were cut: {r:?}");
    assert!(r.verified_blocks >= 64 * 128);
}
