//! Authentication, authorization and resource limits, in process: a real server on
//! 127.0.0.1:0 with CHAP / ACL / limit settings, driven by `ironsan-initiator` (which can
//! do CHAP one-way and mutual, MD5 and SHA-256, hex and base64, and misbehave on purpose).
//! Every refusal is checked for its exact login status or SCSI status.

use crate::support;
use bytes::Bytes;
use ironsan_backend::RamBackend;
use ironsan_initiator::{ChapOptions, Client, Error, LoginOptions};
use ironsan_proto::pdu::*;
use ironsan_proto::{CmdSn, DataSn};
use ironsan_scsi::{LogicalUnit, LuConfig};
use ironsan_server::{Access, AclRule, ChapAccount, ServerConfig, TargetDef};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const DISK: &str = "iqn.2026-11.org.ironsan:disk";
const OTHER: &str = "iqn.2026-11.org.ironsan:other";
const HOST1: &str = "iqn.1993-08.org.debian:01:host1";
const HOST2: &str = "iqn.1993-08.org.debian:01:host2";
const USER: &str = "host1";
const SECRET: &[u8] = b"host1-secret-0123";
const TUSER: &str = "disk-target";
const TSECRET: &[u8] = b"target-secret-4567";

fn target(name: &str) -> TargetDef {
    let mut scsi = ironsan_scsi::Target::new();
    let lu = LogicalUnit::new(Arc::new(RamBackend::new(16 << 20)), LuConfig::default());
    scsi.add_lun(0, Arc::new(lu));
    TargetDef {
        name: name.into(),
        alias: None,
        max_connections: None,
        error_recovery_level: None,
        scsi: Arc::new(scsi),
    }
}

async fn start_with(
    f: impl FnOnce(&mut ServerConfig),
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let mut cfg = ServerConfig::new(
        vec!["127.0.0.1:0".parse().unwrap()],
        vec![target(DISK), target(OTHER)],
    );
    f(&mut cfg);
    support::serve(cfg).await
}

fn chap_access(mutual: bool) -> Access {
    Access {
        chap: Some(ChapAccount::new(USER, SECRET)),
        mutual_chap: mutual.then(|| ChapAccount::new(TUSER, TSECRET)),
        ..Default::default()
    }
}

/// DISK requires CHAP (and answers mutual CHAP).
async fn start_chap() -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    start_with(|c| {
        c.access.insert(DISK.into(), chap_access(true));
    })
    .await
}

fn opts(target: Option<&str>, initiator: &str, chap: Option<ChapOptions>) -> LoginOptions {
    let mut o = LoginOptions::new(target);
    o.initiator_name = initiator.into();
    o.chap = chap;
    o
}

fn login_status(r: Result<Client, Error>) -> (u8, u8) {
    match r {
        Err(Error::Login(c, d)) => (c, d),
        Err(e) => panic!("expected a login failure, got {e}"),
        Ok(_) => panic!("expected a login failure, the login succeeded"),
    }
}

async fn tur(c: &mut Client) -> u8 {
    c.command(0, &[0u8; 6], None, 0).await.unwrap().status
}

// ---------------------------------------------------------------------------------------------
// CHAP
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn one_way_chap_md5_sha256_sha3_hex_and_base64() {
    let (addr, _stop) = start_chap().await;
    for (algs, base64) in [
        ("5", false),
        ("5", true),
        ("7", false),
        ("8,7,5", true),
        ("7,5", false),
    ] {
        let mut ch = ChapOptions::new(USER, SECRET);
        ch.algorithms = algs.into();
        ch.base64 = base64;
        let mut c = Client::login(addr, &opts(Some(DISK), HOST1, Some(ch)))
            .await
            .unwrap_or_else(|e| panic!("CHAP_A={algs} base64={base64}: {e}"));
        assert_eq!(tur(&mut c).await, 0);
        c.logout().await.unwrap();
    }
}

#[tokio::test]
async fn mutual_chap_md5_and_sha256_prove_the_target() {
    let (addr, _stop) = start_chap().await;
    for algs in ["5", "7"] {
        let mut ch = ChapOptions::new(USER, SECRET).mutual(TUSER, TSECRET);
        ch.algorithms = algs.into();
        let mut c = Client::login(addr, &opts(Some(DISK), HOST1, Some(ch)))
            .await
            .unwrap_or_else(|e| panic!("mutual CHAP_A={algs}: {e}"));
        assert_eq!(tur(&mut c).await, 0);
    }
}

#[tokio::test]
async fn mutual_chap_with_wrong_target_secret_is_detected_by_the_initiator() {
    let (addr, _stop) = start_chap().await;
    let ch = ChapOptions::new(USER, SECRET).mutual(TUSER, b"not-the-target-secret");
    let r = Client::login(addr, &opts(Some(DISK), HOST1, Some(ch))).await;
    assert!(matches!(r, Err(Error::MutualChap)), "{:?}", r.err());
    // And a target name other than the configured one is detected too.
    let ch = ChapOptions::new(USER, SECRET).mutual("someone-else", TSECRET);
    let r = Client::login(addr, &opts(Some(DISK), HOST1, Some(ch))).await;
    assert!(matches!(r, Err(Error::MutualChap)), "{:?}", r.err());
}

#[tokio::test]
async fn mutual_chap_without_target_credentials_fails_with_0201() {
    let (addr, _stop) = start_with(|c| {
        c.access.insert(DISK.into(), chap_access(false));
    })
    .await;
    let ch = ChapOptions::new(USER, SECRET).mutual(TUSER, TSECRET);
    let r = Client::login(addr, &opts(Some(DISK), HOST1, Some(ch))).await;
    assert_eq!(login_status(r), (2, 1));
}

/// The last Login Response of a failed login, with the fields that legitimately differ
/// between two connections (none here: same ISID, ITT, CmdSN and ExpStatSN) left as sent.
async fn failed_login_bytes(addr: SocketAddr, o: &LoginOptions) -> (Error, Vec<u8>) {
    let mut c = Client::connect(addr).await.unwrap();
    let e = c.login_on(o).await.unwrap_err();
    let last = c.login_responses.last().cloned().expect("a login response");
    let mut bytes = last.bhs().0.to_vec();
    bytes.extend_from_slice(&last.data);
    (e, bytes)
}

#[tokio::test]
async fn wrong_secret_and_unknown_user_are_indistinguishable() {
    let (addr, _stop) = start_chap().await;
    let wrong = opts(
        Some(DISK),
        HOST1,
        Some(ChapOptions::new(USER, b"wrong-secret-00000")),
    );
    let unknown = opts(Some(DISK), HOST1, Some(ChapOptions::new("mallory", SECRET)));
    let (e1, b1) = failed_login_bytes(addr, &wrong).await;
    let (e2, b2) = failed_login_bytes(addr, &unknown).await;
    assert!(matches!(e1, Error::Login(2, 1)), "{e1}");
    assert!(matches!(e2, Error::Login(2, 1)), "{e2}");
    assert_eq!(b1, b2, "the two failures differ on the wire");
}

#[tokio::test]
async fn challenges_are_fresh_and_long_enough() {
    let (addr, _stop) = start_chap().await;
    let mut seen = Vec::new();
    for _ in 0..4 {
        let mut c = Client::connect(addr).await.unwrap();
        let o = opts(Some(DISK), HOST1, None);
        let kv = |k: &str, v: &str| (k.to_string(), v.to_string());
        let sec = Stage::SECURITY_NEGOTIATION;
        let op = Stage::LOGIN_OPERATIONAL_NEGOTIATION;
        c.login_request(
            &o,
            sec,
            op,
            true,
            &[
                kv("InitiatorName", HOST1),
                kv("TargetName", DISK),
                kv("AuthMethod", "CHAP"),
            ],
        )
        .await
        .unwrap();
        let (_, pairs) = c
            .login_request(&o, sec, op, true, &[kv("CHAP_A", "5")])
            .await
            .unwrap();
        let ch = pairs.iter().find(|(k, _)| k == "CHAP_C").unwrap().1.clone();
        let bytes = ironsan_proto::chap::decode_binary(&ch, 1024).unwrap();
        assert!(bytes.len() >= 16, "challenge of {} bytes", bytes.len());
        assert!(!seen.contains(&bytes), "challenge repeated");
        seen.push(bytes);
    }
}

#[tokio::test]
async fn reflected_challenge_is_refused() {
    let (addr, _stop) = start_chap().await;
    let mut ch = ChapOptions::new(USER, SECRET).mutual(TUSER, TSECRET);
    ch.reflect = true;
    let r = Client::login(addr, &opts(Some(DISK), HOST1, Some(ch))).await;
    assert_eq!(login_status(r), (2, 1));
}

#[tokio::test]
async fn chap_i_out_of_range_is_refused() {
    let (addr, _stop) = start_chap().await;
    for bad in ["256", "-1", "0x100", "x"] {
        let mut ch = ChapOptions::new(USER, SECRET).mutual(TUSER, TSECRET);
        ch.mutual_id = Some(bad.into());
        let r = Client::login(addr, &opts(Some(DISK), HOST1, Some(ch))).await;
        assert_eq!(login_status(r), (2, 1), "CHAP_I={bad}");
    }
}

#[tokio::test]
async fn auth_method_downgrade_to_none_is_refused() {
    let (addr, _stop) = start_chap().await;
    let mut o = opts(Some(DISK), HOST1, None);
    o.auth_method = Some("None".into());
    let mut c = Client::connect(addr).await.unwrap();
    let e = c.login_on(&o).await.unwrap_err();
    assert!(matches!(e, Error::Login(2, 1)), "{e}");
    let last = c.login_responses.last().unwrap();
    let pairs = ironsan_proto::text::parse(&last.data).unwrap();
    assert!(
        pairs.contains(&("AuthMethod".into(), "Reject".into())),
        "{pairs:?}"
    );
}

#[tokio::test]
async fn skipping_the_security_stage_is_refused() {
    let (addr, _stop) = start_chap().await;
    // CSG=1 straight away (what LoginOptions without chap does).
    let r = Client::login(addr, &opts(Some(DISK), HOST1, None)).await;
    assert_eq!(login_status(r), (2, 1));
    // The other target has no CHAP: the same login works there.
    Client::login(addr, &opts(Some(OTHER), HOST1, None))
        .await
        .unwrap();
}

#[tokio::test]
async fn chap_offered_to_an_open_target_agrees_on_none() {
    // libiscsi with credentials offers AuthMethod=CHAP,None; an open target picks None.
    let (addr, _stop) = start_chap().await;
    let mut c = Client::login(
        addr,
        &opts(Some(OTHER), HOST1, Some(ChapOptions::new(USER, SECRET))),
    )
    .await
    .unwrap();
    assert_eq!(tur(&mut c).await, 0);
}

#[tokio::test]
async fn discovery_and_normal_sessions_have_separate_credentials() {
    let (addr, _stop) = start_with(|c| {
        c.access.insert(DISK.into(), chap_access(false));
        c.discovery = Access {
            chap: Some(ChapAccount::new("discover", "discovery-secret-1")),
            ..Default::default()
        };
    })
    .await;
    let disc = ChapOptions::new("discover", b"discovery-secret-1");
    // Discovery needs the discovery credentials...
    assert_eq!(
        login_status(Client::login(addr, &opts(None, HOST1, None)).await),
        (2, 1)
    );
    assert_eq!(
        login_status(
            Client::login(
                addr,
                &opts(None, HOST1, Some(ChapOptions::new(USER, SECRET)))
            )
            .await
        ),
        (2, 1)
    );
    let mut d = Client::login(addr, &opts(None, HOST1, Some(disc.clone())))
        .await
        .unwrap();
    let pairs = d.send_targets("All").await.unwrap();
    assert!(pairs.iter().any(|(k, v)| k == "TargetName" && v == DISK));
    // ...and the target its own.
    assert_eq!(
        login_status(Client::login(addr, &opts(Some(DISK), HOST1, Some(disc))).await),
        (2, 1)
    );
    Client::login(
        addr,
        &opts(Some(DISK), HOST1, Some(ChapOptions::new(USER, SECRET))),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn failed_login_does_not_disturb_the_existing_session() {
    let (addr, _stop) = start_chap().await;
    let good = opts(Some(DISK), HOST1, Some(ChapOptions::new(USER, SECRET)));
    let mut c = Client::login(addr, &good).await.unwrap();
    assert_eq!(tur(&mut c).await, 0);
    // Same initiator name and ISID (a reinstatement attempt), wrong secret: 0201, and the
    // existing session is untouched (reinstatement happens only after authentication).
    let bad = opts(
        Some(DISK),
        HOST1,
        Some(ChapOptions::new(USER, b"wrong-secret-00000")),
    );
    assert_eq!(bad.isid, good.isid);
    assert_eq!(login_status(Client::login(addr, &bad).await), (2, 1));
    // No CHAP at all, also with the same ISID.
    assert_eq!(
        login_status(Client::login(addr, &opts(Some(DISK), HOST1, None)).await),
        (2, 1)
    );
    assert_eq!(tur(&mut c).await, 0);
    let data = Bytes::from(vec![0x5a; 4096]);
    assert_eq!(c.write16(0, 0, data, 512, false).await.unwrap().status, 0);
    // A correct login with the same ISID does reinstate.
    let mut c2 = Client::login(addr, &good).await.unwrap();
    assert_eq!(tur(&mut c2).await, 0);
    let res = tokio::time::timeout(Duration::from_secs(5), c.recv())
        .await
        .expect("old connection still open");
    assert!(res.is_err(), "old session still answering: {res:?}");
}

// ---------------------------------------------------------------------------------------------
// ACLs
// ---------------------------------------------------------------------------------------------

fn acl(rules: &[&str]) -> Access {
    Access {
        acl: rules.iter().map(|r| AclRule::parse(r).unwrap()).collect(),
        ..Default::default()
    }
}

#[tokio::test]
async fn acl_admits_listed_initiators_and_refuses_others_with_0202() {
    let (addr, _stop) = start_with(|c| {
        c.access.insert(DISK.into(), acl(&[HOST1]));
        c.access
            .insert(OTHER.into(), acl(&["iqn.1993-08.org.debian:*"]));
    })
    .await;
    Client::login(addr, &opts(Some(DISK), HOST1, None))
        .await
        .unwrap();
    assert_eq!(
        login_status(Client::login(addr, &opts(Some(DISK), HOST2, None)).await),
        (2, 2)
    );
    // Wildcard: every debian host, nobody else.
    Client::login(addr, &opts(Some(OTHER), HOST2, None))
        .await
        .unwrap();
    assert_eq!(
        login_status(
            Client::login(addr, &opts(Some(OTHER), "iqn.2000-01.com.other:x", None)).await
        ),
        (2, 2)
    );
}

#[tokio::test]
async fn acl_by_source_network() {
    let (addr, _stop) = start_with(|c| {
        c.access.insert(DISK.into(), acl(&["*@127.0.0.0/8"]));
        c.access
            .insert(OTHER.into(), acl(&[&format!("{HOST1}@10.0.0.0/8")]));
    })
    .await;
    Client::login(addr, &opts(Some(DISK), HOST2, None))
        .await
        .unwrap();
    assert_eq!(
        login_status(Client::login(addr, &opts(Some(OTHER), HOST1, None)).await),
        (2, 2)
    );
}

#[tokio::test]
async fn sendtargets_lists_only_permitted_targets() {
    let (addr, _stop) = start_with(|c| {
        c.access.insert(DISK.into(), acl(&[HOST1]));
    })
    .await;
    let names = |pairs: Vec<(String, String)>| -> Vec<String> {
        pairs
            .into_iter()
            .filter(|(k, _)| k == "TargetName")
            .map(|(_, v)| v)
            .collect()
    };
    let mut d1 = Client::login(addr, &opts(None, HOST1, None)).await.unwrap();
    assert_eq!(
        names(d1.send_targets("All").await.unwrap()),
        vec![DISK, OTHER]
    );
    let mut d2 = Client::login(addr, &opts(None, HOST2, None)).await.unwrap();
    assert_eq!(names(d2.send_targets("All").await.unwrap()), vec![OTHER]);
    // Asking by name does not reveal it either.
    assert!(names(d2.send_targets(DISK).await.unwrap()).is_empty());
}

#[tokio::test]
async fn discovery_acl_refuses_other_initiators() {
    let (addr, _stop) = start_with(|c| {
        c.discovery = acl(&[HOST1]);
    })
    .await;
    Client::login(addr, &opts(None, HOST1, None)).await.unwrap();
    // Discovery refused by policy: 0209 (login.rs decision for discovery sessions).
    assert_eq!(
        login_status(Client::login(addr, &opts(None, HOST2, None)).await),
        (2, 9)
    );
}

// ---------------------------------------------------------------------------------------------
// Resource limits
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn connections_beyond_the_limit_fail_with_0302() {
    let (addr, _stop) = start_with(|c| c.limits.max_connections = 2).await;
    let mut a = Client::login(addr, &opts(Some(DISK), HOST1, None))
        .await
        .unwrap();
    let mut o = opts(Some(DISK), HOST2, None);
    let _b = Client::login(addr, &o).await.unwrap();
    o.isid = Isid([0x80, 0, 0, 0, 0, 9]);
    assert_eq!(login_status(Client::login(addr, &o).await), (3, 2));
    // The existing sessions are unaffected; closing one makes room.
    assert_eq!(tur(&mut a).await, 0);
    a.logout().await.unwrap();
    drop(a);
    // The slot is free once the server has closed that connection: retry while it is not.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match Client::login(addr, &o).await {
            Ok(_) => break,
            Err(Error::Login(3, 2)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("login after a logout made room: {e}"),
        }
    }
}

#[tokio::test]
async fn sessions_per_initiator_and_in_total_are_limited_with_0302() {
    let (addr, _stop) = start_with(|c| {
        c.limits.max_sessions_per_initiator = 2;
        c.limits.max_sessions = 3;
    })
    .await;
    let with_isid = |init: &str, n: u8| {
        let mut o = opts(Some(DISK), init, None);
        o.isid = Isid([0x80, 0, 0, 0, 0, n]);
        o
    };
    let _s1 = Client::login(addr, &with_isid(HOST1, 1)).await.unwrap();
    let _s2 = Client::login(addr, &with_isid(HOST1, 2)).await.unwrap();
    assert_eq!(
        login_status(Client::login(addr, &with_isid(HOST1, 3)).await),
        (3, 2)
    );
    // Reinstating one of the two (same ISID) is not a new session: allowed.
    let _s2b = Client::login(addr, &with_isid(HOST1, 2)).await.unwrap();
    // Another initiator gets the third session of the server, not a fourth.
    let _s3 = Client::login(addr, &with_isid(HOST2, 1)).await.unwrap();
    assert_eq!(
        login_status(Client::login(addr, &with_isid(HOST2, 2)).await),
        (3, 2)
    );
}

fn write_cmd(c: &mut Client, itt: Itt, lba: u64, len: u32) -> ScsiCommand {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x8a;
    cdb[2..10].copy_from_slice(&lba.to_be_bytes());
    cdb[10..14].copy_from_slice(&(len / 512).to_be_bytes());
    let cmd = ScsiCommand {
        final_bit: true,
        write: true,
        attr: TaskAttr::SIMPLE,
        lun: Lun::from_number(0),
        itt,
        expected_data_transfer_length: len,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: c.exp_stat_sn,
        cdb,
        ..Default::default()
    };
    c.cmd_sn = c.cmd_sn.next();
    cmd
}

fn r2t_only() -> LoginOptions {
    let mut o = opts(Some(DISK), HOST1, None);
    o.initial_r2t = true;
    o.immediate_data = false;
    o
}

async fn answer_r2t(c: &mut Client, r: &R2t, fill: u8) {
    let d = DataOut {
        final_bit: true,
        lun: r.lun,
        itt: r.itt,
        ttt: r.ttt,
        exp_stat_sn: c.exp_stat_sn,
        data_sn: DataSn(0),
        buffer_offset: r.buffer_offset,
    };
    let data = Bytes::from(vec![fill; r.desired_data_transfer_length as usize]);
    c.send(Header::DataOut(d), data).await.unwrap();
}

async fn recv_timeout(c: &mut Client, ms: u64) -> Option<Pdu> {
    tokio::time::timeout(Duration::from_millis(ms), c.recv())
        .await
        .ok()
        .map(|r| r.unwrap())
}

#[tokio::test]
async fn write_buffer_quota_ends_further_writes_with_task_set_full() {
    let (addr, _stop) = start_with(|c| {
        c.max_io_bytes = 1 << 20;
        c.limits.write_buffer_per_session = 1 << 20;
    })
    .await;
    let mut c = Client::login(addr, &r2t_only()).await.unwrap();
    // A 768 KiB write waits for its data (R2T unanswered) and holds 768 KiB of the 1 MiB.
    let w1 = write_cmd(&mut c, Itt(1), 0, 768 << 10);
    c.send(Header::ScsiCommand(w1), Bytes::new()).await.unwrap();
    let Header::R2t(r2t) = c.recv().await.unwrap().header else {
        panic!("expected an R2T");
    };
    // 512 KiB more does not fit: TASK SET FULL, no sense, nothing asked for.
    let w2 = write_cmd(&mut c, Itt(2), 4096, 512 << 10);
    c.send(Header::ScsiCommand(w2), Bytes::new()).await.unwrap();
    match c.recv().await.unwrap().header {
        Header::ScsiResponse(r) => {
            assert_eq!(r.itt, Itt(2));
            assert_eq!(r.status, 0x28, "TASK SET FULL");
            assert_eq!(r.response, ServiceResponse::COMMAND_COMPLETED);
        }
        h => panic!("expected a SCSI Response, got {h:?}"),
    }
    // 256 KiB still fits alongside.
    let w3 = write_cmd(&mut c, Itt(3), 8192, 256 << 10);
    c.send(Header::ScsiCommand(w3), Bytes::new()).await.unwrap();
    let Header::R2t(r3) = c.recv().await.unwrap().header else {
        panic!("expected an R2T for the write that fits");
    };
    answer_r2t(&mut c, &r2t, 1).await;
    answer_r2t(&mut c, &r3, 3).await;
    // The 768 KiB write takes three 256 KiB bursts (MaxBurstLength), one R2T at a time.
    let mut done = 0;
    while done < 2 {
        match c.recv().await.unwrap().header {
            Header::ScsiResponse(r) => {
                assert_eq!(r.status, 0, "{r:?}");
                done += 1;
            }
            Header::R2t(r) => answer_r2t(&mut c, &r, 1).await,
            h => panic!("expected a SCSI Response or R2T, got {h:?}"),
        }
    }
    // The quota is free again: the refused write now succeeds.
    let data = Bytes::from(vec![2u8; 512 << 10]);
    assert_eq!(
        c.write16(0, 4096, data, 512, false).await.unwrap().status,
        0
    );
}

#[tokio::test]
async fn outstanding_r2ts_per_connection_are_capped() {
    let (addr, _stop) = start_with(|c| c.limits.max_r2ts_per_connection = 2).await;
    let mut c = Client::login(addr, &r2t_only()).await.unwrap();
    for i in 1..=4u32 {
        let w = write_cmd(&mut c, Itt(i), u64::from(i) * 16, 4096);
        c.send(Header::ScsiCommand(w), Bytes::new()).await.unwrap();
    }
    // The two R2Ts that fit (generous deadline), then a short look for a third.
    let mut r2ts = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while r2ts.len() < 2 {
        let p = tokio::time::timeout_at(deadline, c.recv())
            .await
            .unwrap_or_else(|_| panic!("only {} R2T(s) within 10 s: {r2ts:?}", r2ts.len()))
            .unwrap();
        match p.header {
            Header::R2t(r) => r2ts.push(r),
            h => panic!("unexpected {h:?}"),
        }
    }
    while let Some(p) = recv_timeout(&mut c, 300).await {
        match p.header {
            Header::R2t(r) => r2ts.push(r),
            h => panic!("unexpected {h:?}"),
        }
    }
    assert_eq!(
        r2ts.iter().map(|r| r.itt).collect::<Vec<_>>(),
        vec![Itt(1), Itt(2)],
        "only two R2Ts outstanding at once"
    );
    // Each answered R2T frees room for the next write's R2T.
    let mut done = 0;
    while done < 4 {
        if let Some(r) = r2ts.pop() {
            answer_r2t(&mut c, &r, 7).await;
        }
        match c.recv().await.unwrap().header {
            Header::ScsiResponse(r) => {
                assert_eq!(r.status, 0);
                done += 1;
            }
            Header::R2t(r) => r2ts.push(r),
            h => panic!("unexpected {h:?}"),
        }
    }
}

#[tokio::test]
async fn reads_to_an_initiator_that_does_not_read_are_bounded_and_complete_later() {
    let (addr, _stop) = start_with(|c| {
        c.max_io_bytes = 1 << 20;
        c.limits.tx_buffer_per_connection = 1 << 20;
    })
    .await;
    let mut c = Client::login(addr, &opts(Some(DISK), HOST1, None))
        .await
        .unwrap();
    // 48 reads of 1 MiB sent without reading anything back.
    let n = 48u32;
    for i in 0..n {
        c.send_read16(0, u64::from(i % 8) * 2048, 2048, 512)
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Another initiator is served meanwhile.
    let mut other = Client::login(addr, &opts(Some(OTHER), HOST2, None))
        .await
        .unwrap();
    assert_eq!(tur(&mut other).await, 0);
    // Everything arrives, in full, once we read; MaxCmdSN shows the window was held back
    // while the budget was exhausted (it never runs ahead of the commands answered + depth).
    let mut bytes = std::collections::HashMap::<u32, usize>::new();
    let mut statuses = 0;
    while statuses < n {
        let p = tokio::time::timeout(Duration::from_secs(20), c.recv())
            .await
            .expect("reads stalled")
            .unwrap();
        match p.header {
            Header::DataIn(d) => {
                *bytes.entry(d.itt.0).or_default() += p.data.len();
                if d.status.is_some() {
                    assert_eq!(d.status, Some(0));
                    statuses += 1;
                }
            }
            Header::NopIn(_) => {}
            h => panic!("unexpected {h:?}"),
        }
    }
    assert_eq!(bytes.len(), n as usize);
    assert!(bytes.values().all(|&b| b == 1 << 20));
    assert_eq!(c.cmd_sn, CmdSn(1 + n));
}
