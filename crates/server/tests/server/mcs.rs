//! Several connections per session (MC/S, RFC 7143 §4.2.2, §6.3) over real sockets: data
//! written on one connection read back on another, CmdSN ordering across connections,
//! connection allegiance, logout of a named connection, connection reinstatement, the limits,
//! and what an initiator that breaks the rules gets.

use crate::support;

use bytes::Bytes;
use ironsan_initiator::{read16_cdb, write16_cdb, Client, Error, LoginOptions};
use ironsan_proto::pdu::*;
use ironsan_proto::CmdSn;
use std::net::SocketAddr;
use std::time::Duration;
use support::*;

/// How long "nothing arrives" is waited for.
const QUIET: Duration = Duration::from_millis(300);

fn opts(conns: u16, isid_tail: u8) -> LoginOptions {
    let mut o = LoginOptions::new(Some(TARGET));
    o.max_connections = conns;
    o.isid = Isid([0x80, 0, 0x4d, 0x43, 0x53, isid_tail]);
    o
}

/// A session of `n` connections to `addr`.
async fn session(addr: SocketAddr, n: u16, isid_tail: u8) -> Vec<Client> {
    let o = opts(n, isid_tail);
    let leader = Client::login(addr, &o).await.expect("leading login");
    assert_eq!(leader.negotiated_u32("MaxConnections"), Some(u32::from(n)));
    let mut conns = vec![leader];
    for cid in 1..n {
        let c = Client::join(addr, &o, &conns[0], cid).await.expect("joins");
        conns.push(c);
    }
    conns
}

/// A session of two connections whose writes send no data before an R2T.
async fn r2t_pair(addr: SocketAddr, isid_tail: u8) -> (LoginOptions, Client, Client) {
    let mut o = opts(2, isid_tail);
    o.immediate_data = false;
    o.initial_r2t = true;
    let a = Client::login(addr, &o).await.unwrap();
    let b = Client::join(addr, &o, &a, 1).await.unwrap();
    (o, a, b)
}

/// CmdSN is the session's: after connection `from` used some, the others continue from it.
fn sync(conns: &mut [Client], from: usize) {
    let sn = conns[from].cmd_sn;
    for c in conns.iter_mut() {
        c.cmd_sn = sn;
    }
}

async fn expect_nothing(c: &mut Client) {
    let r = tokio::time::timeout(QUIET, c.recv()).await;
    assert!(r.is_err(), "expected nothing, got {r:?}");
}

async fn expect_reject(c: &mut Client, reason: RejectReason) {
    loop {
        let p = c.recv().await.expect("a PDU");
        match p.header {
            Header::Reject(r) => {
                assert_eq!(r.reason, reason);
                return;
            }
            Header::NopIn(_) => continue,
            other => panic!("expected a Reject, got {other:?}"),
        }
    }
}

async fn status_of(c: &mut Client, itt: Itt) -> u8 {
    loop {
        let p = c.recv().await.expect("a PDU");
        match p.header {
            Header::ScsiResponse(r) if r.itt == itt => return r.status,
            Header::DataIn(d) if d.itt == itt && d.status.is_some() => {
                return d.status.unwrap_or(0xff)
            }
            Header::DataIn(_) | Header::NopIn(_) => continue,
            other => panic!("expected the status of {itt:?}, got {other:?}"),
        }
    }
}

/// Data written on each connection reads back through another, and the session shows all
/// its connections.
#[tokio::test]
async fn a_session_of_four_connections_moves_data_across_them() {
    let cfg = ironsan_server::ServerConfig::new(
        vec!["127.0.0.1:0".parse().unwrap()],
        vec![ram_target(TARGET)],
    );
    let server = ironsan_server::Server::bind(cfg).await.unwrap();
    let addr = server.local_addrs()[0];
    let control = server.control();
    let _stop = run_in_background(server);
    let mut conns = session(addr, 4, 1).await;
    // `ironsan ctl sessions` shows one session with its four connections.
    let sessions = control.sessions();
    assert_eq!(sessions.len(), 1);
    let cids: Vec<u16> = sessions[0].connections.iter().map(|c| c.cid).collect();
    let mut sorted = cids.clone();
    sorted.sort();
    assert_eq!(sorted, vec![0, 1, 2, 3], "{sessions:?}");
    let mut last = 0;
    for i in 0..4usize {
        let data = pattern(64 * 1024, i as u8);
        let lba = 1000 + 200 * i as u64;
        sync(&mut conns, last);
        let w = conns[i]
            .command(0, &write16_cdb(lba, 128), Some(data.clone()), 0)
            .await
            .unwrap();
        assert_eq!(w.status, 0);
        sync(&mut conns, i);
        let j = (i + 1) % 4;
        let r = conns[j]
            .command(0, &read16_cdb(lba, 128), None, 64 * 1024)
            .await
            .unwrap();
        assert_eq!((r.status, r.data), (0, data), "read back on connection {j}");
        last = j;
    }
    sync(&mut conns, last);
    assert_eq!(conns[0].logout().await.unwrap(), LogoutResponseCode::CLOSED);
}

/// A command whose CmdSN is ahead of the window's next runs only once the gap before it is
/// filled, whichever connection fills it (RFC 7143 §3.2.2.1), and then both run in order.
#[tokio::test]
async fn a_command_ahead_of_a_cmdsn_gap_waits_for_it() {
    let (addr, _stop) = start().await;
    let mut conns = session(addr, 2, 2).await;
    let gap = conns[0].cmd_sn;
    // Connection 1 sends CmdSN n+1: a write.
    conns[1].cmd_sn = gap.next();
    let data = pattern(4096, 7);
    let (w_itt, _) = conns[1]
        .send_write16(0, 50, 4096, 512, data.clone())
        .await
        .unwrap();
    expect_nothing(&mut conns[1]).await;
    // Connection 0 fills CmdSN n with a read of other blocks: both now run.
    conns[0].cmd_sn = gap;
    let (r_itt, _) = conns[0].send_read16(0, 900, 1, 512).await.unwrap();
    assert_eq!(status_of(&mut conns[0], r_itt).await, 0);
    assert_eq!(status_of(&mut conns[1], w_itt).await, 0);
    sync(&mut conns, 1);
    let r = conns[0]
        .command(0, &read16_cdb(50, 8), None, 4096)
        .await
        .unwrap();
    assert_eq!(r.data, data);
}

/// A connection woken by another one (here: its held command released) while only part of
/// its next header has arrived keeps those bytes: the header completes and is answered, and
/// the stream stays in step. (Found with a third-party MC/S initiator: a wake-up used to
/// drop a header read in progress, and the connection then read garbage.)
#[tokio::test]
async fn a_wake_up_in_the_middle_of_a_header_loses_nothing() {
    let (addr, _stop) = start().await;
    let mut conns = session(addr, 2, 10).await;
    let gap = conns[0].cmd_sn;
    conns[1].cmd_sn = gap.next();
    let (held, _) = conns[1].send_read16(0, 0, 1, 512).await.unwrap();
    expect_nothing(&mut conns[1]).await;
    // Half of a ping's header on connection 1...
    let ping = NopOut {
        immediate: true,
        itt: Itt(0x5050),
        cmd_sn: conns[1].cmd_sn,
        ..Default::default()
    };
    let pdu = Pdu::new(Header::NopOut(ping), Bytes::from_static(b"halfway"));
    let wire = ironsan_initiator::wire_pdu(&pdu.bhs(), &pdu.data, false, false);
    conns[1].send_bytes(&wire[..20]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ...then connection 0 fills the gap, which wakes connection 1...
    conns[0].cmd_sn = gap;
    let (r, _) = conns[0].send_read16(0, 8, 1, 512).await.unwrap();
    assert_eq!(status_of(&mut conns[0], r).await, 0);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ...and the rest of the header arrives.
    conns[1].send_bytes(&wire[20..]).await.unwrap();
    let (mut got_read, mut got_ping) = (false, false);
    while !(got_read && got_ping) {
        let p = tokio::time::timeout(Duration::from_secs(10), conns[1].recv())
            .await
            .expect("answers")
            .expect("the connection stays up");
        match p.header {
            Header::DataIn(d) if d.itt == held => got_read |= d.status == Some(0),
            Header::NopIn(n) if n.itt == Itt(0x5050) => {
                assert_eq!(&p.data[..], b"halfway");
                got_ping = true;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// A CmdSN already used on one connection is a duplicate on another: ignored.
#[tokio::test]
async fn a_cmdsn_reused_on_another_connection_is_ignored() {
    let (addr, _stop) = start().await;
    let mut conns = session(addr, 2, 3).await;
    let sn = conns[0].cmd_sn;
    let r = conns[0].command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!(r.status, 0);
    conns[1].cmd_sn = sn;
    conns[1].send_read16(0, 0, 1, 512).await.unwrap();
    expect_nothing(&mut conns[1]).await;
    sync(&mut conns, 0);
    let r = conns[1].command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!(r.status, 0, "the session goes on");
}

/// Task tags are the session's: one in use on a connection is refused on another (Task in
/// progress), and a Data-Out for a task of another connection is refused there (RFC 7143
/// §4.2.5.1: every PDU of a task on its own connection) while the task completes on its own.
#[tokio::test]
async fn tags_and_data_belong_to_their_connection() {
    let (addr, _stop) = start().await;
    let (_, mut a, mut b) = r2t_pair(addr, 4).await;
    let (itt, _) = a
        .send_write16(0, 10, 4096, 512, Bytes::new())
        .await
        .unwrap();
    let Header::R2t(r2t) = a.recv().await.unwrap().header else {
        panic!("expected an R2T")
    };
    b.cmd_sn = a.cmd_sn;
    let dup = ScsiCommand {
        final_bit: true,
        itt,
        cmd_sn: b.cmd_sn,
        cdb: [0; 16],
        ..Default::default()
    };
    b.send(Header::ScsiCommand(dup), Bytes::new())
        .await
        .unwrap();
    expect_reject(&mut b, RejectReason::TASK_IN_PROGRESS).await;
    let data = pattern(4096, 3);
    let d = DataOut {
        final_bit: true,
        itt,
        ttt: r2t.ttt,
        ..Default::default()
    };
    b.send(Header::DataOut(d.clone()), data.clone())
        .await
        .unwrap();
    expect_reject(&mut b, RejectReason::INVALID_PDU_FIELD).await;
    a.send(Header::DataOut(d), data.clone()).await.unwrap();
    assert_eq!(status_of(&mut a, itt).await, 0);
    // The rejected duplicate's CmdSN was not received: B plugs it.
    let r = b.command(0, &read16_cdb(10, 8), None, 4096).await.unwrap();
    assert_eq!(r.data, data);
}

/// Logout reason 1 closes the named connection from any connection of the session; the
/// others go on; an unknown CID is "CID not found".
#[tokio::test]
async fn logout_closes_the_named_connection_from_another_one() {
    let (addr, _stop) = start().await;
    let mut conns = session(addr, 3, 5).await;
    let logout = |cid: u16, reason: LogoutReason, c: &Client| LogoutRequest {
        immediate: true,
        reason,
        itt: Itt(0x7000 + u32::from(cid)),
        cid: Cid(cid),
        cmd_sn: c.cmd_sn,
        ..Default::default()
    };
    for (cid, want) in [
        (9, LogoutResponseCode::CID_NOT_FOUND),
        (2, LogoutResponseCode::CLOSED),
    ] {
        let l = logout(cid, LogoutReason::CLOSE_CONNECTION, &conns[0]);
        conns[0]
            .send(Header::LogoutRequest(l), Bytes::new())
            .await
            .unwrap();
        let Header::LogoutResponse(r) = conns[0].recv().await.unwrap().header else {
            panic!("expected a Logout Response")
        };
        assert_eq!(r.response, want);
    }
    // Connection 2 is closed by the target.
    let gone = tokio::time::timeout(Duration::from_secs(10), conns[2].recv()).await;
    assert!(matches!(gone, Ok(Err(_))), "{gone:?}");
    // The others work.
    sync(&mut conns, 0);
    let r = conns[1].command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!(r.status, 0);
    sync(&mut conns, 1);
    // Reason 2 needs ErrorRecoveryLevel 2.
    let l = logout(1, LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, &conns[0]);
    conns[0]
        .send(Header::LogoutRequest(l), Bytes::new())
        .await
        .unwrap();
    let Header::LogoutResponse(r) = conns[0].recv().await.unwrap().header else {
        panic!("expected a Logout Response")
    };
    assert_eq!(r.response, LogoutResponseCode::RECOVERY_NOT_SUPPORTED);
    // Closing the session on connection 0 closes connection 1 too.
    assert_eq!(conns[0].logout().await.unwrap(), LogoutResponseCode::CLOSED);
    let gone = tokio::time::timeout(Duration::from_secs(10), conns[1].recv()).await;
    assert!(matches!(gone, Ok(Err(_))), "{gone:?}");
}

fn login_status(e: Error) -> u16 {
    match e {
        Error::Login(class, detail) => u16::from(class) << 8 | u16::from(detail),
        other => panic!("expected a login failure, got {other:?}"),
    }
}

/// MaxConnections is the lower offer; beyond it a login gets TOO MANY CONNECTIONS (0x0206).
/// A login naming a session that is not this initiator's, not for this target, or not there
/// at all, gets SESSION DOES NOT EXIST (0x020A) and joins nothing.
#[tokio::test]
async fn joining_obeys_max_connections_and_only_ones_own_session() {
    let (addr, _stop) = start_with(|c| c.negotiation.max_connections = 2).await;
    let o = opts(4, 6);
    let leader = Client::login(addr, &o).await.unwrap();
    assert_eq!(leader.negotiated_u32("MaxConnections"), Some(2));
    let _second = Client::join(addr, &o, &leader, 1).await.unwrap();
    let e = Client::join(addr, &o, &leader, 2).await.err().unwrap();
    assert_eq!(login_status(e), 0x0206);
    // Another initiator's name, another ISID, another target, an unknown TSIH.
    let mut other = o.clone();
    other.initiator_name = "iqn.2026-11.org.ironsan:intruder".into();
    let mut isid = o.clone();
    isid.isid.0[5] ^= 0xff;
    let mut target = o.clone();
    target.target_name = Some("iqn.2026-11.org.ironsan:other".into());
    for (what, opts) in [("initiator", other), ("isid", isid), ("target", target)] {
        let e = Client::join(addr, &opts, &leader, 1).await.err().unwrap();
        let s = login_status(e);
        assert!(
            s == 0x020a || (what == "target" && s == 0x0203),
            "{what}: {s:04x}"
        );
    }
    let mut ghost = Client::connect(addr).await.unwrap();
    let mut g = o.clone();
    g.tsih = Tsih(0x7777);
    g.cid = Cid(1);
    let e = ghost.login_on(&g).await.err().unwrap();
    assert_eq!(login_status(e), 0x020a);
}

/// A login with the CID of a live connection reinstates it (RFC 7143 §6.3.4): the old
/// connection is closed, its tasks end without responses, the next command on their LU gets
/// SOME COMMANDS CLEARED BY ISCSI PROTOCOL EVENT, and the session goes on.
#[tokio::test]
async fn a_known_cid_reinstates_its_connection() {
    let (addr, _stop) = start().await;
    let (o, mut a, mut old) = r2t_pair(addr, 7).await;
    // A write on the old connection waits for its data.
    let (_, _) = old
        .send_write16(0, 70, 4096, 512, Bytes::new())
        .await
        .unwrap();
    let Header::R2t(_) = old.recv().await.unwrap().header else {
        panic!("expected an R2T")
    };
    a.cmd_sn = old.cmd_sn;
    let mut new = Client::join(addr, &o, &a, 1).await.unwrap();
    let gone = tokio::time::timeout(Duration::from_secs(10), old.recv()).await;
    assert!(
        matches!(gone, Ok(Err(_))),
        "the old connection is closed: {gone:?}"
    );
    let r = new.command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!((r.status, r.sense_key()), (2, Some((6, 0x47, 0x7f))));
    let r = new
        .command(0, &read16_cdb(70, 8), None, 4096)
        .await
        .unwrap();
    assert_eq!(
        (r.status, r.data),
        (0, Bytes::from(vec![0u8; 4096])),
        "nothing written"
    );
    a.cmd_sn = new.cmd_sn;
    assert_eq!(a.logout().await.unwrap(), LogoutResponseCode::CLOSED);
}

/// Below ErrorRecoveryLevel 2 a connection that fails takes its session with it (RFC 7143
/// §7.1.5: session recovery; level 1 recovers within a connection only): the other
/// connections are closed.
#[tokio::test]
async fn a_failed_connection_ends_the_whole_session() {
    let (addr, _stop) = start().await;
    for erl in [0u8, 1] {
        let isid = 8 + erl;
        let mut o = opts(2, isid);
        o.error_recovery_level = erl;
        let leader = Client::login(addr, &o).await.unwrap();
        assert_eq!(
            leader.negotiated_u32("ErrorRecoveryLevel"),
            Some(u32::from(erl))
        );
        let b = Client::join(addr, &o, &leader, 1).await.unwrap();
        let mut conns = vec![leader];
        b.reset().unwrap();
        let gone = tokio::time::timeout(Duration::from_secs(10), conns[0].recv()).await;
        assert!(matches!(gone, Ok(Err(_))), "level {erl}: {gone:?}");
        conns.clear();
        // A new leading login with the same ISID gets a fresh session.
        let mut again = Client::login(addr, &o).await.unwrap();
        assert_eq!(
            again.command(0, &[0u8; 6], None, 0).await.unwrap().status,
            0
        );
    }
}

/// TARGET COLD RESET closes every connection of every session of the target, the resetting
/// session's other connections included (RFC 7143 §11.5.1), and leaves no session behind
/// (a shutdown would otherwise wait for logouts that never come).
#[tokio::test]
async fn a_cold_reset_closes_every_connection_and_session() {
    let cfg = ironsan_server::ServerConfig::new(
        vec!["127.0.0.1:0".parse().unwrap()],
        vec![ram_target(TARGET)],
    );
    let server = ironsan_server::Server::bind(cfg).await.unwrap();
    let addr = server.local_addrs()[0];
    let control = server.control();
    let stop = run_in_background(server);
    let mut mine = session(addr, 2, 10).await;
    let mut other = session(addr, 2, 11).await;
    assert_eq!(control.sessions().len(), 2);
    assert_eq!(
        mine[0]
            .task_mgmt(TmfFunction::TARGET_COLD_RESET, 0, Itt::RESERVED, CmdSn(0))
            .await
            .unwrap(),
        TmfResponseCode::COMPLETE
    );
    for (name, c) in mine.iter_mut().chain(other.iter_mut()).enumerate() {
        let gone = tokio::time::timeout(Duration::from_secs(5), c.recv()).await;
        assert!(matches!(gone, Ok(Err(_))), "connection {name}: {gone:?}");
    }
    assert_eq!(control.sessions(), vec![]);
    drop(stop);
}

/// A login that starts in the operational stage but offers AuthMethod=None there (as some
/// initiators do) is accepted when no authentication is required.
#[tokio::test]
async fn auth_method_none_in_the_operational_stage_is_tolerated() {
    let (addr, _stop) = start().await;
    let mut o = opts(1, 9);
    o.extra = vec![("AuthMethod".into(), "None".into())];
    let c = Client::login(addr, &o).await.unwrap();
    assert!(c
        .negotiated
        .iter()
        .any(|(k, v)| k == "AuthMethod" && v == "Irrelevant"));
}

/// Keep `CmdSn` in scope for readers of the helpers above.
#[allow(dead_code)]
fn _sn(c: &Client) -> CmdSn {
    c.cmd_sn
}
