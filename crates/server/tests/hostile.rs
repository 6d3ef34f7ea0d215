//! A hostile-client suite: a live in-process server attacked with raw PDUs for each input
//! class of `shared/design/hostile-inputs.md` (numbered 1-13 below, and 14: MC/S), asserting the exact
//! answer (Reject reason, login status, sense, or close), that a well-behaved session keeps
//! working during the attack, and that the server's file descriptors (/proc/self/fd) and RSS
//! (/proc/self/status VmRSS) stay bounded. The server is in-process, so those are our own.
//!
//! Default counts keep the whole file under a minute; `IRONSAN_LONG=1` uses the big ones
//! (2,000 idle connections, ...). Tests that measure fds or RSS take the `GATE` exclusively,
//! every other test takes it shared, so measurements are not disturbed by parallel tests.

mod support;
use bytes::Bytes;
use ironsan_initiator::{read16_cdb, write16_cdb, Client, LoginOptions};
use ironsan_proto::pdu::*;
use ironsan_proto::{text, CmdSn, DataSn, StatSn};
use ironsan_server::iscsi::io::{read_pdu, Digests, ReadError};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

const INITIATOR: &str = "iqn.2026-11.org.ironsan:hostile";
const WAIT: Duration = Duration::from_secs(5);

/// Resource-measuring tests hold this exclusively; the others share it.
static GATE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn long() -> bool {
    std::env::var("IRONSAN_LONG").is_ok_and(|v| v == "1")
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn opts(isid: u8) -> LoginOptions {
    let mut o = LoginOptions::new(Some(TARGET));
    o.initiator_name = INITIATOR.into();
    o.isid = Isid([0x80, 0, 0, 0, 0x42, isid]);
    o
}

async fn round_trip(c: &mut Client, lba: u64, len: usize, seed: u8) {
    let data = pattern(len, seed);
    let w = c.write16(0, lba, data.clone(), 512, false).await.unwrap();
    assert_eq!(w.status, 0, "write sense {:?}", w.sense_key());
    let r = c.read16(0, lba, (len / 512) as u32, 512).await.unwrap();
    assert_eq!(r.status, 0);
    assert!(r.data == data, "data read back differs");
}

/// A round trip that accepts one unit attention first (an attack test may reset the LU).
async fn bystander_round_trip(c: &mut Client, lba: u64, seed: u8) {
    let data = pattern(8192, seed);
    let mut w = c.write16(0, lba, data.clone(), 512, false).await.unwrap();
    if w.status == 2 && w.sense_key().map(|k| k.0) == Some(0x6) {
        w = c.write16(0, lba, data.clone(), 512, false).await.unwrap();
    }
    assert_eq!(w.status, 0, "write sense {:?}", w.sense_key());
    let r = c.read16(0, lba, 16, 512).await.unwrap();
    assert_eq!(r.status, 0, "read sense {:?}", r.sense_key());
    assert!(r.data == data, "data read back differs");
}

/// A well-behaved session doing write/read round trips (each within 5 s) until `stop`.
struct Bystander {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<usize>,
}

impl Bystander {
    async fn start(addr: SocketAddr, isid: u8) -> Bystander {
        let stop = Arc::new(AtomicBool::new(false));
        let mut c = Client::login(addr, &opts(isid))
            .await
            .expect("the well-behaved session could not log in");
        let s = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let mut n = 0usize;
            while !s.load(Ordering::Relaxed) || n < 2 {
                let lba = 60_000 + (isid as u64 % 8) * 512 + (n as u64 % 8) * 16;
                tokio::time::timeout(WAIT, bystander_round_trip(&mut c, lba, n as u8))
                    .await
                    .expect("well-behaved session starved during the attack");
                n += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            n
        });
        Bystander { stop, task }
    }

    /// Stop and return how many round trips succeeded (panics if one failed).
    async fn finish(self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("well-behaved session failed")
    }
}

/// A raw connection: PDUs built by hand, read with the server's own framing.
struct Raw {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
}

impl Raw {
    async fn connect(addr: SocketAddr) -> Raw {
        let (rd, wr) = Client::connect_raw(addr).await.unwrap();
        Raw { rd, wr }
    }
    async fn send(&mut self, header: Header, data: &[u8]) {
        let pdu = Pdu::new(header, Bytes::copy_from_slice(data));
        let bhs = pdu.bhs();
        self.send_bhs(&bhs, data).await;
    }
    async fn send_bhs(&mut self, bhs: &Bhs, data: &[u8]) {
        let mut b = bhs.0.to_vec();
        b.extend_from_slice(data);
        b.resize(b.len() + pad_len(data.len()), 0);
        let _ = self.wr.write_all(&b).await;
    }
    /// The next PDU, or `None` once the target closed the connection.
    async fn recv(&mut self) -> Option<Pdu> {
        match tokio::time::timeout(WAIT, read_pdu(&mut self.rd, Digests::default(), 1 << 24))
            .await
            .expect("target neither answered nor closed")
        {
            Ok(r) => Some(r.pdu),
            Err(ReadError::Closed | ReadError::Io(_)) => None,
            Err(e) => panic!("bad PDU from target: {e}"),
        }
    }
    async fn expect_closed(&mut self) {
        let mut n = 0;
        while let Some(p) = self.recv().await {
            n += 1;
            assert!(
                n < 4,
                "target keeps talking instead of closing: {:?}",
                p.header
            );
        }
    }
}

fn login_req(csg: u8, nsg: u8, transit: bool) -> LoginRequest {
    LoginRequest {
        transit,
        csg: Stage(csg),
        nsg: Stage(nsg),
        isid: Isid([0x80, 0, 0, 0, 0x43, 1]),
        itt: Itt(0x10),
        cmd_sn: CmdSn(1),
        exp_stat_sn: StatSn(0),
        ..Default::default()
    }
}

fn base_keys() -> Vec<(String, String)> {
    vec![
        ("InitiatorName".into(), INITIATOR.into()),
        ("TargetName".into(), TARGET.into()),
        ("SessionType".into(), "Normal".into()),
    ]
}

/// Send one Login Request and return the response's status and text.
async fn login_once(raw: &mut Raw, req: LoginRequest, data: &[u8]) -> (u8, u8, Bytes) {
    raw.send(Header::LoginRequest(req), data).await;
    let p = raw.recv().await.expect("no login response");
    match p.header {
        Header::LoginResponse(r) => (r.status_class, r.status_detail, p.data),
        h => panic!("expected Login Response, got {h:?}"),
    }
}

/// A one-PDU login with `data` as the text: the status it ends with.
async fn login_status(addr: SocketAddr, data: &[u8]) -> (u8, u8) {
    let mut raw = Raw::connect(addr).await;
    let (c, d, _) = login_once(&mut raw, login_req(1, 3, true), data).await;
    if c != 0 {
        raw.expect_closed().await;
    }
    (c, d)
}

/// Read PDUs until a Reject; every other PDU must be in `allowed` opcodes.
async fn expect_reject(c: &mut Client, reason: RejectReason) -> Pdu {
    loop {
        let p = tokio::time::timeout(WAIT, c.recv())
            .await
            .expect("no Reject")
            .expect("connection closed instead of Reject");
        match &p.header {
            Header::Reject(r) => {
                assert_eq!(r.reason, reason, "wrong Reject reason");
                return p;
            }
            Header::NopIn(_) => {}
            h => panic!("expected Reject {reason:?}, got {h:?}"),
        }
    }
}

/// A Reject (`reason`) of a bad PDU of the command `itt` and the command's final status, in
/// either order: the Reject is queued on the connection while the status is sent by the
/// task that ends the command, so on a multi-thread runtime the status can be first (the
/// protocol does not order them). NOP-Ins are skipped, and so are later Rejects, R2Ts and
/// Data-Ins once the first Reject is in (as [`expect_status`] does). Returns what
/// [`expect_status`] returns.
async fn expect_reject_and_status(
    c: &mut Client,
    reason: RejectReason,
    itt: Itt,
) -> (u8, Option<(u8, u8, u8)>) {
    let mut rejected = false;
    let mut status = None;
    while !rejected || status.is_none() {
        let p = tokio::time::timeout(WAIT, c.recv())
            .await
            .unwrap_or_else(|_| {
                panic!("no Reject {reason:?} and final status of {itt:?} (Reject seen: {rejected}, status: {status:?})")
            })
            .expect("connection closed instead of Reject and SCSI Response");
        match p.header {
            Header::Reject(r) if !rejected => {
                assert_eq!(r.reason, reason, "wrong Reject reason");
                rejected = true;
            }
            Header::ScsiResponse(r) if r.itt == itt && status.is_none() => {
                let s = p.data.get(2..).unwrap_or(&[]);
                let sense = (s.len() >= 14).then(|| (s[2] & 0x0f, s[12], s[13]));
                c.exp_stat_sn = r.sn.stat_sn.next();
                status = Some((r.status, sense));
            }
            Header::DataIn(d) if d.itt == itt && d.status.is_some() && status.is_none() => {
                status = Some((d.status.unwrap(), None));
            }
            Header::NopIn(_) => {}
            Header::Reject(_) | Header::R2t(_) | Header::DataIn(_) if rejected => {}
            h => panic!("expected Reject {reason:?} and the status of {itt:?}, got {h:?}"),
        }
    }
    status.unwrap()
}

/// The SCSI Response for `itt` (Rejects are skipped): status and (key, asc, ascq).
async fn expect_status(c: &mut Client, itt: Itt) -> (u8, Option<(u8, u8, u8)>) {
    loop {
        let p = tokio::time::timeout(WAIT, c.recv())
            .await
            .expect("no SCSI Response")
            .expect("connection closed instead of SCSI Response");
        match p.header {
            Header::ScsiResponse(r) if r.itt == itt => {
                let s = p.data.get(2..).unwrap_or(&[]);
                let sense = (s.len() >= 14).then(|| (s[2] & 0x0f, s[12], s[13]));
                c.exp_stat_sn = r.sn.stat_sn.next();
                return (r.status, sense);
            }
            Header::DataIn(d) if d.itt == itt && d.status.is_some() => {
                return (d.status.unwrap(), None)
            }
            Header::Reject(_) | Header::NopIn(_) | Header::R2t(_) | Header::DataIn(_) => {}
            h => panic!("unexpected {h:?}"),
        }
    }
}

async fn assert_zeros(c: &mut Client, lba: u64, blocks: u32) {
    let r = c.read16(0, lba, blocks, 512).await.unwrap();
    assert_eq!(r.status, 0);
    assert!(
        r.data.iter().all(|&b| b == 0),
        "data the initiator never validly sent reached the disk"
    );
}

/// Send a WRITE(16) command header (no data) and return its ITT.
async fn send_write(c: &mut Client, lba: u64, blocks: u32, final_bit: bool) -> Itt {
    let cmd = ScsiCommand {
        final_bit,
        write: true,
        expected_data_transfer_length: blocks * 512,
        cdb: write16_cdb(lba, blocks),
        ..Default::default()
    };
    c.send_command(cmd, Bytes::new()).await.unwrap().0
}

fn r2t_opts(isid: u8) -> LoginOptions {
    let mut o = opts(isid);
    o.initial_r2t = true;
    o.immediate_data = false;
    o
}

// ---------------------------------------------------------------------------------------------
// 1. Malformed BHS
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn c01_malformed_bhs() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    let mut c = Client::login(addr, &opts(2)).await.unwrap();
    // Reserved opcodes (0x07-0x0f, 0x11-0x1b, 0x1d-0x1f): command not supported, header echoed.
    for op in [0x07u8, 0x0f, 0x11, 0x1b, 0x1f] {
        let mut bhs = Bhs::default();
        bhs.0[0] = op;
        bhs.0[16..20].copy_from_slice(&[9, 9, 9, op]);
        c.send_raw_bhs(&bhs, &[]).await.unwrap();
        let p = expect_reject(&mut c, RejectReason::COMMAND_NOT_SUPPORTED).await;
        assert_eq!(&p.data[..], &bhs.0[..]);
    }
    // Target-only opcodes from an initiator: protocol error.
    for op in [0x20u8, 0x21, 0x25, 0x31, 0x3f] {
        let mut bhs = Bhs::default();
        bhs.0[0] = op;
        bhs.0[1] = 0x80;
        c.send_raw_bhs(&bhs, &[]).await.unwrap();
        expect_reject(&mut c, RejectReason::PROTOCOL_ERROR).await;
    }
    // Reserved bits set everywhere in a NOP-Out ping: still a ping.
    let mut bhs = Pdu::new(
        Header::NopOut(NopOut {
            immediate: true,
            itt: Itt(0x55),
            ttt: Ttt::RESERVED,
            cmd_sn: c.cmd_sn,
            ..Default::default()
        }),
        Bytes::new(),
    )
    .bhs();
    bhs.0[1] = 0xff;
    bhs.0[2] = 0xff;
    bhs.0[3] = 0xff;
    bhs.0[32..48].fill(0xff);
    c.send_raw_bhs(&bhs, &[]).await.unwrap();
    let p = tokio::time::timeout(WAIT, c.recv()).await.unwrap().unwrap();
    assert!(
        matches!(p.header, Header::NopIn(ref n) if n.itt == Itt(0x55)),
        "{:?}",
        p.header
    );
    assert_eq!(c.ping(Bytes::from_static(b"ok")).await.unwrap(), "ok");

    // A SCSI Command, a Text Request or a Logout before login: the connection closes unanswered.
    for h in [
        Header::ScsiCommand(ScsiCommand {
            final_bit: true,
            itt: Itt(1),
            ..Default::default()
        }),
        Header::TextRequest(TextRequest {
            final_bit: true,
            itt: Itt(1),
            ..Default::default()
        }),
        Header::LogoutRequest(LogoutRequest {
            itt: Itt(1),
            ..Default::default()
        }),
    ] {
        let mut raw = Raw::connect(addr).await;
        raw.send(h, &[]).await;
        assert!(raw.recv().await.is_none(), "answered a PDU before login");
    }
    assert!(by.finish().await >= 2);
}

// ---------------------------------------------------------------------------------------------
// 2. Lengths that lie
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn c02_lengths_that_lie() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    // During login: DataSegmentLength above 8192 closes before anything is read.
    let mut raw = Raw::connect(addr).await;
    let mut bhs = Pdu::new(Header::LoginRequest(login_req(1, 3, true)), Bytes::new()).bhs();
    bhs.set_lengths(0, 8193);
    raw.send_bhs(&bhs, &[]).await;
    raw.expect_closed().await;
    // Full feature: one byte above our MaxRecvDataSegmentLength (262144).
    let mut c = Client::login(addr, &opts(2)).await.unwrap();
    let mut bhs = Pdu::new(
        Header::NopOut(NopOut {
            itt: Itt(5),
            immediate: true,
            ..Default::default()
        }),
        Bytes::new(),
    )
    .bhs();
    bhs.set_lengths(0, 262_145);
    c.send_raw_bhs(&bhs, &[]).await.unwrap();
    let res = tokio::time::timeout(WAIT, c.recv())
        .await
        .expect("kept open");
    assert!(
        res.is_err(),
        "answered a PDU longer than negotiated: {res:?}"
    );
    // An Extended CDB AHS whose length points past the AHS: INVALID PDU FIELD.
    let mut c = Client::login(addr, &opts(3)).await.unwrap();
    let itt = c.itt();
    let mut bhs = Pdu::new(
        Header::ScsiCommand(ScsiCommand {
            final_bit: true,
            itt,
            cmd_sn: c.cmd_sn,
            ..Default::default()
        }),
        Bytes::new(),
    )
    .bhs();
    bhs.0[4] = 1; // one word of AHS...
    let mut raw = bhs.0.to_vec();
    raw.extend_from_slice(&[0x00, 0xff, 0x01, 0x00]); // ...claiming 255 bytes of CDB
    c.send_bytes(&raw).await.unwrap();
    expect_reject(&mut c, RejectReason::INVALID_PDU_FIELD).await;
    // A rejected command's CmdSN is not received (RFC 7143 §7.3): the next command plugs the
    // gap with it.
    assert_eq!(c.ping(Bytes::from_static(b"x")).await.unwrap(), "x");
    // Immediate data longer than EDTL: Reject (protocol error), nothing written.
    let itt = c.itt();
    let cmd = ScsiCommand {
        final_bit: true,
        write: true,
        itt,
        expected_data_transfer_length: 512,
        cmd_sn: c.cmd_sn,
        cdb: write16_cdb(300, 1),
        ..Default::default()
    };
    c.send(Header::ScsiCommand(cmd), pattern(1024, 3))
        .await
        .unwrap();
    expect_reject(&mut c, RejectReason::PROTOCOL_ERROR).await;
    assert_zeros(&mut c, 300, 2).await;
    assert!(by.finish().await >= 2);
}

// ---------------------------------------------------------------------------------------------
// 3. Text key abuse
// ---------------------------------------------------------------------------------------------

fn keys_with(extra: &[(String, String)]) -> Vec<u8> {
    let mut k = base_keys();
    k.extend_from_slice(extra);
    text::encode(&k).to_vec()
}

#[tokio::test]
async fn c03_text_key_abuse_fails_login_with_0200() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "key of 64 bytes",
            keys_with(&[("K".repeat(64), "1".into())]),
        ),
        (
            "value of 256 bytes",
            keys_with(&[("X-v".into(), "v".repeat(256))]),
        ),
        ("no '='", {
            let mut d = keys_with(&[]);
            d.extend_from_slice(b"NoEquals\0");
            d
        }),
        ("empty key", {
            let mut d = keys_with(&[]);
            d.extend_from_slice(b"=1\0");
            d
        }),
        (
            "duplicate key",
            keys_with(&[("TargetName".into(), TARGET.into())]),
        ),
        ("no NUL terminator", {
            let mut d = keys_with(&[]);
            d.extend_from_slice(b"MaxBurstLength=512");
            d
        }),
        (
            "control character",
            keys_with(&[("X-c".into(), "a\u{1}b".into())]),
        ),
        ("InitiatorName over 223 bytes", {
            let name = format!("iqn.2026-11.org.ironsan:{}", "a".repeat(220));
            text::encode(&[("InitiatorName", name.as_str()), ("TargetName", TARGET)]).to_vec()
        }),
        ("300 keys", {
            let extra: Vec<_> = (0..300).map(|i| (format!("X-k{i}"), "1".into())).collect();
            keys_with(&extra)
        }),
        ("NotUnderstood answers over 8192 bytes", {
            let extra: Vec<_> = (0..140)
                .map(|i| (format!("X-com.example.{i:031}"), "1".into()))
                .collect();
            keys_with(&extra)
        }),
    ];
    for (what, data) in cases {
        assert!(data.len() <= 8192, "{what}: test data too long");
        assert_eq!(login_status(addr, &data).await, (2, 0), "{what}");
    }
    // Endless C-bit continuation: refused after a bound, not held forever.
    let mut raw = Raw::connect(addr).await;
    let mut req = login_req(1, 3, false);
    req.cont = true;
    let mut status = None;
    for _ in 0..400 {
        let (c, d, _) = login_once(&mut raw, req.clone(), b"X-a=b").await;
        if c != 0 {
            status = Some((c, d));
            break;
        }
    }
    assert_eq!(status, Some((2, 0)), "continuation never refused");
    raw.expect_closed().await;
    // Full feature: malformed text in a Text Request is a Reject (protocol error).
    let mut c = Client::login(addr, &opts(2)).await.unwrap();
    let itt = c.itt();
    c.send(
        Header::TextRequest(TextRequest {
            final_bit: true,
            itt,
            ttt: Ttt::RESERVED,
            cmd_sn: c.cmd_sn,
            ..Default::default()
        }),
        Bytes::from_static(b"SendTargets"),
    )
    .await
    .unwrap();
    c.cmd_sn = c.cmd_sn.next();
    expect_reject(&mut c, RejectReason::PROTOCOL_ERROR).await;
    assert!(by.finish().await >= 2);
}

// ---------------------------------------------------------------------------------------------
// 5. Login state-machine violations (4 and 6, CHAP, are in the fuzz targets and security.rs)
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn c05_login_state_machine_violations() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    let keys = keys_with(&[]);
    // Invalid stage transitions: T=1 to the same stage, NSG=2, CSG=2 and CSG=3.
    for (csg, nsg) in [(1u8, 1u8), (1, 2), (0, 2), (2, 3), (3, 3), (1, 0)] {
        let mut raw = Raw::connect(addr).await;
        let (c, d, _) = login_once(&mut raw, login_req(csg, nsg, true), &keys).await;
        assert_eq!((c, d), (2, 0), "CSG={csg} NSG={nsg}");
        raw.expect_closed().await;
    }
    // C=1 with T=1.
    let mut raw = Raw::connect(addr).await;
    let mut r = login_req(1, 3, true);
    r.cont = true;
    assert_eq!(login_once(&mut raw, r, &keys).await.0, 2);
    // ISID, TSIH, CID or CmdSN changing mid-login: 0200.
    for change in 0..4 {
        let mut raw = Raw::connect(addr).await;
        let (c, _, _) = login_once(&mut raw, login_req(0, 1, false), &keys).await;
        assert_eq!(c, 0);
        let mut r = login_req(0, 1, true);
        match change {
            0 => r.isid.0[5] ^= 1,
            1 => r.tsih = Tsih(77),
            2 => r.cid = Cid(9),
            _ => r.cmd_sn = CmdSn(2),
        }
        let (c, d, _) = login_once(&mut raw, r, &[]).await;
        assert_eq!((c, d), (2, 0), "change {change}");
        raw.expect_closed().await;
    }
    // Unsupported version: 0205.
    let mut raw = Raw::connect(addr).await;
    let mut r = login_req(1, 3, true);
    r.version_min = 1;
    r.version_max = 1;
    assert_eq!(login_once(&mut raw, r, &keys).await.0, 2);
    // Missing InitiatorName: 0207; unknown target: 0203; bad SessionType: 0209.
    assert_eq!(
        login_status(addr, &text::encode(&[("TargetName", TARGET)])).await,
        (2, 7)
    );
    assert_eq!(
        login_status(
            addr,
            &text::encode(&[
                ("InitiatorName", INITIATOR),
                ("TargetName", "iqn.2026-11.org.ironsan:nope")
            ])
        )
        .await,
        (2, 3)
    );
    assert_eq!(
        login_status(
            addr,
            &text::encode(&[("InitiatorName", INITIATOR), ("SessionType", "Bogus")])
        )
        .await,
        (2, 9)
    );
    // A TSIH that does not exist: 020A.
    let mut raw = Raw::connect(addr).await;
    let mut r = login_req(1, 3, true);
    r.tsih = Tsih(0x7777);
    assert_eq!(login_once(&mut raw, r, &keys).await.0, 2);
    // Pipelined login PDUs (no wait for the first answer): answered in order, login succeeds.
    let mut raw = Raw::connect(addr).await;
    raw.send(Header::LoginRequest(login_req(0, 1, true)), &keys)
        .await;
    raw.send(Header::LoginRequest(login_req(1, 3, true)), &[])
        .await;
    for expect_nsg in [1u8, 3] {
        let p = raw.recv().await.expect("pipelined login answered");
        let Header::LoginResponse(r) = p.header else {
            panic!("expected Login Response")
        };
        assert_eq!((r.status_class, r.nsg.0, r.transit), (0, expect_nsg, true));
    }
    // A second login after full-feature phase: Reject (protocol error), session unharmed.
    let mut c = Client::login(addr, &opts(2)).await.unwrap();
    let req = LoginRequest {
        isid: Isid([0x80, 0, 0, 0, 0x42, 2]),
        ..login_req(1, 3, true)
    };
    c.send(Header::LoginRequest(req), Bytes::from(keys.clone()))
        .await
        .unwrap();
    expect_reject(&mut c, RejectReason::PROTOCOL_ERROR).await;
    round_trip(&mut c, 100, 4096, 5).await;
    assert!(by.finish().await >= 2);
}

// ---------------------------------------------------------------------------------------------
// 7. CmdSN window abuse
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn c07_cmdsn_window_abuse() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    let mut c = Client::login(addr, &opts(2)).await.unwrap();
    let tur = |c: &mut Client, sn: CmdSn, imm: bool| {
        let itt = c.itt();
        (
            itt,
            Header::ScsiCommand(ScsiCommand {
                final_bit: true,
                immediate: imm,
                itt,
                cmd_sn: sn,
                cdb: [0; 16],
                ..Default::default()
            }),
        )
    };
    // Below ExpCmdSN and above MaxCmdSN: silently ignored.
    for sn in [
        c.cmd_sn.0.wrapping_sub(1),
        c.cmd_sn.0.wrapping_sub(1 << 30),
        c.max_cmd_sn.0.wrapping_add(1),
    ] {
        let (_, h) = tur(&mut c, CmdSn(sn), false);
        c.send(h, Bytes::new()).await.unwrap();
    }
    let r = c.command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!(r.status, 0);
    assert!(
        c.unsolicited.is_empty(),
        "answered an out-of-window command: {:?}",
        c.unsolicited
    );
    // A flood of immediate NOP-Out pings: each answered, the session stays usable.
    let n = if long() { 20_000 } else { 2_000 };
    for i in 0..n {
        c.send(
            Header::NopOut(NopOut {
                immediate: true,
                itt: Itt(0x100_0000 + i),
                ttt: Ttt::RESERVED,
                cmd_sn: c.cmd_sn,
                exp_stat_sn: c.exp_stat_sn,
                ..Default::default()
            }),
            Bytes::new(),
        )
        .await
        .unwrap();
    }
    let mut answered = 0;
    while answered < n {
        match tokio::time::timeout(WAIT, c.recv())
            .await
            .unwrap()
            .unwrap()
            .header
        {
            Header::NopIn(_) => answered += 1,
            h => panic!("unexpected {h:?}"),
        }
    }
    round_trip(&mut c, 200, 4096, 1).await;
    // Stale ExpStatSN on a command: still executed.
    let itt = c.itt();
    let cmd = ScsiCommand {
        final_bit: true,
        itt,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: StatSn(c.exp_stat_sn.0.wrapping_sub(1000)),
        cdb: [0; 16],
        ..Default::default()
    };
    c.cmd_sn = c.cmd_sn.next();
    c.send(Header::ScsiCommand(cmd), Bytes::new())
        .await
        .unwrap();
    assert_eq!(expect_status(&mut c, itt).await.0, 0);
    assert!(by.finish().await >= 2);
}

#[tokio::test]
async fn c07_cmdsn_wraps_around_2_pow_32() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    // Log in with CmdSN just below 2^32 by driving the login by hand.
    let mut raw = Raw::connect(addr).await;
    let mut req = login_req(1, 3, true);
    req.cmd_sn = CmdSn(0xffff_fff0);
    req.isid = Isid([0x80, 0, 0, 0, 0x42, 9]);
    let (c, _, _) = login_once(&mut raw, req, &keys_with(&[])).await;
    assert_eq!(c, 0);
    let mut sn = CmdSn(0xffff_fff0);
    for i in 0..40u32 {
        raw.send(
            Header::ScsiCommand(ScsiCommand {
                final_bit: true,
                itt: Itt(i + 1),
                cmd_sn: sn,
                cdb: [0; 16],
                ..Default::default()
            }),
            &[],
        )
        .await;
        sn = sn.next();
        loop {
            let p = raw.recv().await.expect("closed while wrapping");
            if let Header::ScsiResponse(r) = p.header {
                assert_eq!((r.itt, r.status), (Itt(i + 1), 0), "command {i}");
                assert_eq!(r.sn.exp_cmd_sn, sn, "ExpCmdSN across the wrap");
                break;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 8. Data-Out abuse
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn c08_data_out_abuse() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    let data_phase_error = Some((0x0b, 0x4b, 0x00));
    // (a) More data than the R2T asked for.
    let mut c = Client::login(addr, &r2t_opts(2)).await.unwrap();
    let itt = send_write(&mut c, 400, 2, true).await;
    let Header::R2t(r2t) = c.recv().await.unwrap().header else {
        panic!("expected R2T")
    };
    let d = DataOut {
        final_bit: true,
        itt,
        ttt: r2t.ttt,
        ..Default::default()
    };
    c.send(Header::DataOut(d), pattern(2048, 1)).await.unwrap();
    assert_eq!(
        expect_reject_and_status(&mut c, RejectReason::PROTOCOL_ERROR, itt).await,
        (2, data_phase_error)
    );
    assert_zeros(&mut c, 400, 4).await;
    // (b) Unknown TTT.
    let itt = send_write(&mut c, 410, 2, true).await;
    let Header::R2t(r2t) = c.recv().await.unwrap().header else {
        panic!("expected R2T")
    };
    let d = DataOut {
        final_bit: true,
        itt,
        ttt: Ttt(r2t.ttt.0 ^ 0x55),
        ..Default::default()
    };
    c.send(Header::DataOut(d), pattern(1024, 2)).await.unwrap();
    assert_eq!(
        expect_reject_and_status(&mut c, RejectReason::PROTOCOL_ERROR, itt).await,
        (2, data_phase_error)
    );
    // (c) BufferOffset beyond the R2T / the transfer.
    let itt = send_write(&mut c, 420, 2, true).await;
    let Header::R2t(r2t) = c.recv().await.unwrap().header else {
        panic!("expected R2T")
    };
    let d = DataOut {
        final_bit: true,
        itt,
        ttt: r2t.ttt,
        buffer_offset: 0xffff_fe00,
        ..Default::default()
    };
    c.send(Header::DataOut(d), pattern(1024, 3)).await.unwrap();
    assert_eq!(
        expect_reject_and_status(&mut c, RejectReason::PROTOCOL_ERROR, itt).await,
        (2, data_phase_error)
    );
    assert_zeros(&mut c, 410, 12).await;
    // (d) Unsolicited Data-Out with InitialR2T=Yes (the command's F=0 announces it).
    let itt = send_write(&mut c, 430, 2, false).await;
    assert_eq!(
        expect_reject_and_status(&mut c, RejectReason::PROTOCOL_ERROR, itt).await,
        (2, data_phase_error)
    );
    // (e) Data-Out for an unknown ITT, and for a read: Reject (invalid PDU field).
    let d = DataOut {
        final_bit: true,
        itt: Itt(0xdead),
        ttt: Ttt::RESERVED,
        ..Default::default()
    };
    c.send(Header::DataOut(d.clone()), pattern(512, 4))
        .await
        .unwrap();
    expect_reject(&mut c, RejectReason::INVALID_PDU_FIELD).await;
    // (f) Data-Out after the write completed (after the final bit).
    let itt = c.itt();
    let w = c
        .write16(0, 440, pattern(1024, 5), 512, false)
        .await
        .unwrap();
    assert_eq!(w.status, 0);
    let d = DataOut {
        final_bit: true,
        itt: Itt(itt.0 + 1),
        ttt: Ttt(1),
        ..Default::default()
    };
    c.send(Header::DataOut(d), pattern(1024, 6)).await.unwrap();
    expect_reject(&mut c, RejectReason::INVALID_PDU_FIELD).await;
    let r = c.read16(0, 440, 2, 512).await.unwrap();
    assert!(r.data == pattern(1024, 5));
    // (g) Unsolicited data beyond FirstBurstLength (InitialR2T=No).
    let mut o = opts(3);
    o.initial_r2t = false;
    o.immediate_data = false;
    o.first_burst_length = 8192;
    let mut c = Client::login(addr, &o).await.unwrap();
    let itt = send_write(&mut c, 450, 64, false).await;
    let d = DataOut {
        final_bit: true,
        itt,
        ttt: Ttt::RESERVED,
        ..Default::default()
    };
    c.send(Header::DataOut(d), pattern(16384, 7)).await.unwrap();
    assert_eq!(
        expect_reject_and_status(&mut c, RejectReason::PROTOCOL_ERROR, itt).await,
        (2, data_phase_error)
    );
    assert_zeros(&mut c, 450, 64).await;
    assert!(by.finish().await >= 2);
}

// ---------------------------------------------------------------------------------------------
// 9. Tag reuse
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn c09_tag_reuse() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    let mut c = Client::login(addr, &r2t_opts(2)).await.unwrap();
    // An ITT reused while its write waits for data: task in progress.
    let itt = send_write(&mut c, 500, 2, true).await;
    let Header::R2t(r2t) = c.recv().await.unwrap().header else {
        panic!("expected R2T")
    };
    let dup = ScsiCommand {
        final_bit: true,
        itt,
        cmd_sn: c.cmd_sn,
        cdb: [0; 16],
        ..Default::default()
    };
    c.send(Header::ScsiCommand(dup), Bytes::new())
        .await
        .unwrap();
    expect_reject(&mut c, RejectReason::TASK_IN_PROGRESS).await;
    // Its CmdSN was not received (RFC 7143 §7.3): the commands after it reuse it.
    // The original write still completes.
    let d = DataOut {
        final_bit: true,
        itt,
        ttt: r2t.ttt,
        ..Default::default()
    };
    c.send(Header::DataOut(d), pattern(1024, 9)).await.unwrap();
    assert_eq!(expect_status(&mut c, itt).await, (0, None));
    // A NOP-Out answering a TTT we never sent: ignored.
    c.send(
        Header::NopOut(NopOut {
            itt: Itt::RESERVED,
            ttt: Ttt(0x1234_5678),
            cmd_sn: c.cmd_sn,
            ..Default::default()
        }),
        Bytes::new(),
    )
    .await
    .unwrap();
    // SNACK at ErrorRecoveryLevel 0: SNACK reject.
    c.send(
        Header::SnackRequest(SnackRequest {
            itt: Itt(3),
            ..Default::default()
        }),
        Bytes::new(),
    )
    .await
    .unwrap();
    expect_reject(&mut c, RejectReason::SNACK_REJECT).await;
    assert_eq!(c.ping(Bytes::from_static(b"alive")).await.unwrap(), "alive");
    assert!(c.unsolicited.is_empty(), "{:?}", c.unsolicited);
    assert!(by.finish().await >= 2);
}

#[tokio::test]
async fn c09_reserved_itt_on_a_command_is_rejected() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let mut c = Client::login(addr, &opts(2)).await.unwrap();
    // The reserved ITT 0xffffffff on a SCSI command: refused (RFC 7143 §11.2.1.8).
    let cmd = ScsiCommand {
        final_bit: true,
        itt: Itt::RESERVED,
        cmd_sn: c.cmd_sn,
        cdb: [0; 16],
        ..Default::default()
    };
    c.send(Header::ScsiCommand(cmd), Bytes::new())
        .await
        .unwrap();
    expect_reject(&mut c, RejectReason::INVALID_PDU_FIELD).await;
    // The CmdSN was not received (RFC 7143 §7.3): a command after it waits for the gap...
    let held = c.cmd_sn.next();
    let mut tur = ScsiCommand {
        final_bit: true,
        itt: c.itt(),
        cmd_sn: held,
        cdb: [0; 16],
        ..Default::default()
    };
    c.send(Header::ScsiCommand(tur.clone()), Bytes::new())
        .await
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), c.recv())
            .await
            .is_err(),
        "a command behind the gap ran"
    );
    // ...until the initiator plugs it, here with a command that takes the rejected CmdSN;
    // then both run, in order.
    tur.itt = c.itt();
    tur.cmd_sn = c.cmd_sn;
    c.send(Header::ScsiCommand(tur), Bytes::new())
        .await
        .unwrap();
    for _ in 0..2 {
        let Header::ScsiResponse(r) = c.recv().await.unwrap().header else {
            panic!("expected two SCSI Responses")
        };
        assert_eq!(r.status, 0);
    }
    c.cmd_sn = held.next();
    let r = c.command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!(r.status, 0);
}

// ---------------------------------------------------------------------------------------------
// 10. CDB abuse
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn c10_cdb_abuse() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    let mut c = Client::login(addr, &opts(2)).await.unwrap();
    let lba_out_of_range = Some((0x5, 0x21, 0x00));
    let invalid_field = |k: Option<(u8, u8, u8)>| k.map(|k| (k.0, k.1)) == Some((0x5, 0x24));
    // LBA + length wrapping 64 bits; beyond capacity by one block.
    for (lba, n) in [(u64::MAX, 2u32), (u64::MAX - 1, 4), ((64 << 20) / 512, 1)] {
        let r = c
            .command(0, &read16_cdb(lba, n), None, n * 512)
            .await
            .unwrap();
        assert_eq!(
            (r.status, r.sense_key()),
            (2, lba_out_of_range),
            "READ lba {lba}"
        );
        let r = c
            .command(
                0,
                &write16_cdb(lba, n),
                Some(pattern(n as usize * 512, 1)),
                0,
            )
            .await
            .unwrap();
        assert_eq!(
            (r.status, r.sense_key()),
            (2, lba_out_of_range),
            "WRITE lba {lba}"
        );
    }
    // READ(6) with TRANSFER LENGTH 0 means 256 blocks.
    let r = c
        .command(0, &[0x08, 0, 0, 0, 0, 0], None, 256 * 512)
        .await
        .unwrap();
    assert_eq!((r.status, r.data.len()), (0, 256 * 512));
    // Huge allocation length with a small EDTL: truncated, overflow residual.
    let r = c
        .command(0, &[0x12, 0, 0, 0xff, 0xff, 0], None, 36)
        .await
        .unwrap();
    assert_eq!(r.status, 0);
    assert_eq!(r.data.len(), 36);
    assert!(
        matches!(r.residual, Residual::Overflow(_)),
        "{:?}",
        r.residual
    );
    // A WRITE claiming a 1 GiB transfer with an EDTL of one block: only the sent block counts.
    let r = c
        .command(0, &write16_cdb(600, 1 << 21), Some(pattern(512, 4)), 0)
        .await
        .unwrap();
    assert_eq!(r.status, 2, "1 GiB write past the 64 MiB LU must fail");
    // WRITE SAME(16) without data, and with NDOB; COMPARE AND WRITE with 255 blocks.
    let mut ws = [0u8; 16];
    ws[0] = 0x93;
    ws[13] = 8;
    ws[2..10].copy_from_slice(&700u64.to_be_bytes());
    let r = c.command(0, &ws, None, 0).await.unwrap();
    assert!(
        invalid_field(r.sense_key()),
        "WRITE SAME without data: {:?}",
        r.sense_key()
    );
    ws[1] = 0x01; // NDOB
    let r = c.command(0, &ws, None, 0).await.unwrap();
    assert!(
        r.status == 0 || invalid_field(r.sense_key()),
        "NDOB: {:?}",
        r.sense_key()
    );
    let mut caw = [0u8; 16];
    caw[0] = 0x89;
    caw[13] = 255;
    let r = c
        .command(0, &caw, Some(pattern(2 * 255 * 512, 1)), 0)
        .await
        .unwrap();
    assert!(
        invalid_field(r.sense_key()),
        "COMPARE AND WRITE 255: {:?}",
        r.sense_key()
    );
    // UNMAP with a descriptor beyond capacity: LBA out of range, nothing unmapped.
    round_trip(&mut c, 800, 4096, 8).await;
    let mut list = vec![0u8; 8 + 32];
    list[0..2].copy_from_slice(&(6u16 + 32).to_be_bytes());
    list[2..4].copy_from_slice(&32u16.to_be_bytes());
    list[8..16].copy_from_slice(&800u64.to_be_bytes());
    list[16..20].copy_from_slice(&8u32.to_be_bytes());
    list[24..32].copy_from_slice(&(u64::MAX - 3).to_be_bytes());
    list[32..36].copy_from_slice(&8u32.to_be_bytes());
    let mut unmap = [0u8; 10];
    unmap[0] = 0x42;
    unmap[8] = list.len() as u8;
    let r = c
        .command(0, &unmap, Some(Bytes::from(list)), 0)
        .await
        .unwrap();
    assert_eq!((r.status, r.sense_key()), (2, lba_out_of_range));
    let r = c.read16(0, 800, 8, 512).await.unwrap();
    assert!(r.data == pattern(4096, 8), "a refused UNMAP unmapped data");
    // A command to a LUN that does not exist.
    let r = c.command(5, &read16_cdb(0, 1), None, 512).await.unwrap();
    assert_eq!(r.sense_key(), Some((0x5, 0x25, 0x00)));
    assert!(by.finish().await >= 2);
}

// ---------------------------------------------------------------------------------------------
// 11. Digest errors
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn c11_digest_errors() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    let mut o = opts(2);
    o.header_digest = true;
    o.data_digest = true;
    let mut c = Client::login(addr, &o).await.unwrap();
    assert!(c.header_digest && c.data_digest);
    // Bad header digest: the length cannot be trusted, close.
    let bhs = Pdu::new(
        Header::NopOut(NopOut {
            immediate: true,
            itt: Itt(7),
            ttt: Ttt::RESERVED,
            cmd_sn: c.cmd_sn,
            ..Default::default()
        }),
        Bytes::new(),
    )
    .bhs();
    let mut raw = bhs.0.to_vec();
    raw.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
    c.send_bytes(&raw).await.unwrap();
    let res = tokio::time::timeout(WAIT, c.recv())
        .await
        .expect("kept open");
    assert!(
        res.is_err(),
        "answered after a header digest error: {res:?}"
    );
    // Bad data digest on a Data-Out: Reject (data digest error), CHECK CONDITION 0B/47/05,
    // nothing written.
    let mut o = r2t_opts(3);
    o.data_digest = true;
    let mut c = Client::login(addr, &o).await.unwrap();
    let itt = send_write(&mut c, 900, 2, true).await;
    let Header::R2t(r2t) = c.recv().await.unwrap().header else {
        panic!("expected R2T")
    };
    let bhs = Pdu::new(
        Header::DataOut(DataOut {
            final_bit: true,
            itt,
            ttt: r2t.ttt,
            ..Default::default()
        }),
        pattern(1024, 1),
    )
    .bhs();
    let mut raw = bhs.0.to_vec();
    raw.extend_from_slice(&pattern(1024, 1));
    raw.extend_from_slice(&[1, 2, 3, 4]);
    c.send_bytes(&raw).await.unwrap();
    assert_eq!(
        expect_reject_and_status(&mut c, RejectReason::DATA_DIGEST_ERROR, itt).await,
        (2, Some((0x0b, 0x47, 0x05)))
    );
    assert_zeros(&mut c, 900, 2).await;
    assert!(by.finish().await >= 2);
}

// ---------------------------------------------------------------------------------------------
// 12. Task-management races
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn c12_task_management_races() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    let mut c = Client::login(addr, &r2t_opts(2)).await.unwrap();
    // LUN reset during a split write: the write is gone, its late Data-Out is refused, and
    // nothing of it is written.
    let itt = send_write(&mut c, 1000, 8, true).await;
    let Header::R2t(r2t) = c.recv().await.unwrap().header else {
        panic!("expected R2T")
    };
    let d = DataOut {
        final_bit: false,
        itt,
        ttt: r2t.ttt,
        ..Default::default()
    };
    c.send(Header::DataOut(d), pattern(1024, 1)).await.unwrap();
    let code = c
        .task_mgmt(TmfFunction::LOGICAL_UNIT_RESET, 0, Itt::RESERVED, CmdSn(0))
        .await
        .unwrap();
    assert_eq!(code, TmfResponseCode::COMPLETE);
    let d = DataOut {
        final_bit: true,
        itt,
        ttt: r2t.ttt,
        data_sn: DataSn(1),
        buffer_offset: 1024,
        ..Default::default()
    };
    c.send(Header::DataOut(d), pattern(3072, 2)).await.unwrap();
    expect_reject(&mut c, RejectReason::INVALID_PDU_FIELD).await;
    // The reset raises 29h/00h only on nexuses the LU has seen (this one's write never
    // reached it): GOOD, or one unit attention.
    let r = c.command(0, &[0u8; 6], None, 0).await.unwrap();
    if r.status != 0 {
        assert_eq!(r.sense_key().map(|k| (k.0, k.1)), Some((0x6, 0x29)));
    }
    assert_zeros(&mut c, 1000, 8).await;
    // ABORT TASK of a task not yet arrived (CmdSN ahead) and of an unknown one.
    let code = c
        .task_mgmt(TmfFunction::ABORT_TASK, 0, Itt(0x4444), c.cmd_sn.plus(3))
        .await
        .unwrap();
    assert_eq!(code, TmfResponseCode::TASK_DOES_NOT_EXIST);
    // Logout with a write outstanding: answered, connection closed.
    let _itt = send_write(&mut c, 1100, 8, true).await;
    let Header::R2t(_) = c.recv().await.unwrap().header else {
        panic!("expected R2T")
    };
    assert_eq!(c.logout().await.unwrap(), LogoutResponseCode::CLOSED);
    // Connection loss with R2Ts outstanding, many times: the server survives.
    for i in 0..20u8 {
        let mut o = r2t_opts(10 + i);
        o.max_outstanding_r2t = 4;
        let mut c = Client::login(addr, &o).await.unwrap();
        send_write(&mut c, 1200, 2048, true).await;
        let _ = c.recv().await.unwrap();
        drop(c);
    }
    let mut c = Client::login(addr, &opts(3)).await.unwrap();
    round_trip(&mut c, 1100, 4096, 3).await;
    assert!(by.finish().await >= 2);
}

// ---------------------------------------------------------------------------------------------
// 13. Exhaustion (these measure fds and RSS, so they run alone)
// ---------------------------------------------------------------------------------------------

async fn wait_fds_back(baseline: usize) -> usize {
    let t0 = Instant::now();
    loop {
        let n = fd_count();
        if n <= baseline + 4 || t0.elapsed() > Duration::from_secs(5) {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c13_idle_connection_flood_is_closed_by_the_login_timeout() {
    let _g = GATE.write().await;
    let (addr, _stop) = start_with(|c| c.limits.login_timeout = Duration::from_secs(1)).await;
    let by = Bystander::start(addr, 1).await;
    let n = if long() { 2_000 } else { 500 };
    let fd0 = fd_count();
    let rss0 = rss_kib();
    let t0 = Instant::now();
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let peak_fds = fd_count();
    let peak_rss = rss_kib();
    // Every connection is closed by the target (EOF) after the login timeout. The 30 s bound
    // only catches a connection that is never closed: they all close about 1 s in, so the
    // reads after the first return at once.
    let mut closed = 0;
    for s in &mut conns {
        let mut b = [0u8; 1];
        match tokio::time::timeout(Duration::from_secs(30), s.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed += 1,
            Ok(Ok(_)) => panic!("target sent data to a silent connection"),
            Err(_) => {}
        }
    }
    let took = t0.elapsed();
    drop(conns);
    let fds_after = wait_fds_back(fd0).await;
    eprintln!(
        "idle flood: {n} connections, fds {fd0} -> peak {peak_fds} -> {fds_after}, \
         RSS {rss0} -> peak {peak_rss} KiB, all closed after {took:?}"
    );
    assert_eq!(closed, n, "connections left open after the login timeout");
    assert!(
        fds_after <= fd0 + 4,
        "fds not released: {fd0} -> {fds_after}"
    );
    assert!(
        peak_rss.saturating_sub(rss0) < 256 * 1024,
        "RSS grew by {} KiB",
        peak_rss.saturating_sub(rss0)
    );
    assert!(by.finish().await >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c13_slow_logins_are_cut_by_the_login_timeout() {
    let _g = GATE.write().await;
    let (addr, _stop) = start_with(|c| c.limits.login_timeout = Duration::from_secs(1)).await;
    let by = Bystander::start(addr, 1).await;
    let n = if long() { 1_000 } else { 200 };
    let fd0 = fd_count();
    let login = {
        let mut raw = Pdu::new(
            Header::LoginRequest(login_req(1, 3, true)),
            Bytes::from(keys_with(&[])),
        )
        .bhs()
        .0
        .to_vec();
        raw.extend_from_slice(&keys_with(&[]));
        raw
    };
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let login = login.clone();
        tasks.spawn(async move {
            let t0 = Instant::now();
            let (mut rd, mut wr) = TcpStream::connect(addr).await.unwrap().into_split();
            let mut b = [0u8; 64];
            for byte in login {
                tokio::select! {
                    r = rd.read(&mut b) => {
                        assert!(matches!(r, Ok(0) | Err(_)), "answered a half-sent login");
                        return t0.elapsed();
                    }
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
                if wr.write_all(&[byte]).await.is_err() {
                    return t0.elapsed();
                }
                // Far past the 1 s login timeout: held (a hang bound, not a measurement).
                if t0.elapsed() > Duration::from_secs(60) {
                    break;
                }
            }
            Duration::MAX
        });
    }
    let mut worst = Duration::ZERO;
    while let Some(t) = tasks.join_next().await {
        worst = worst.max(t.unwrap());
    }
    let fds_after = wait_fds_back(fd0).await;
    eprintln!("slow logins: {n}, slowest closed after {worst:?}, fds {fd0} -> {fds_after}");
    // Every connection was closed by the target while its login was still being sent (a
    // task that gave up after 60 s returns Duration::MAX); how soon is printed above.
    assert!(
        worst < Duration::MAX,
        "a slow login was held for 60 s: the login timeout did not cut it"
    );
    assert!(
        fds_after <= fd0 + 4,
        "fds not released: {fd0} -> {fds_after}"
    );
    assert!(by.finish().await >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c13_windows_full_of_writes_that_never_send_data() {
    let _g = GATE.write().await;
    let depth = 32u32;
    let (addr, _stop) = start_with(|c| c.queue_depth = depth).await;
    let by = Bystander::start(addr, 1).await;
    let sessions = if long() { 100 } else { 20 };
    let rss0 = rss_kib();
    let mut held = Vec::new();
    for s in 0..sessions {
        let mut o = r2t_opts(0x80 | s as u8);
        o.max_burst_length = 65536;
        // Distinct initiators: the per-initiator session limit is not what is tested here.
        o.initiator_name = format!("{INITIATOR}-{s}");
        let mut c = Client::login(addr, &o).await.unwrap();
        // Each write claims 8 MiB (the largest the target buffers by default is 32 MiB).
        for _ in 0..depth {
            send_write(&mut c, 0, 16384, true).await;
        }
        held.push(c);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss1 = rss_kib();
    let claimed = (sessions as u64 * depth as u64 * 8) << 10;
    eprintln!(
        "write windows: {sessions} sessions x {depth} writes x 8 MiB claimed ({claimed} KiB), \
         RSS {rss0} -> {rss1} KiB (+{} KiB)",
        rss1.saturating_sub(rss0)
    );
    assert!(by.finish().await >= 2);
    let mut c = Client::login(addr, &opts(3)).await.unwrap();
    round_trip(&mut c, 4000, 65536, 1).await;
    drop(held);
    assert!(
        rss1.saturating_sub(rss0) < 256 * 1024,
        "RSS grew by {} KiB for writes whose data never came",
        rss1.saturating_sub(rss0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c13_reader_that_never_reads() {
    let _g = GATE.write().await;
    let depth = 32u32;
    let (addr, _stop) = start_with(|c| c.queue_depth = depth).await;
    // Real data on the LU, so reads copy (and commit) memory.
    let mut w = Client::login(addr, &opts(4)).await.unwrap();
    for i in 0..16u64 {
        let r = w
            .write16(0, i * 2048, pattern(1 << 20, i as u8), 512, false)
            .await
            .unwrap();
        assert_eq!(r.status, 0);
    }
    let by = Bystander::start(addr, 1).await;
    let rss0 = rss_kib();
    // 1 MiB reads in waves of one window each, CmdSN always advanced as if MaxCmdSN kept
    // opening (a pause between waves lets the commands run), responses never read.
    let n = if long() { 4_000u32 } else { 640 };
    let mut c = Client::login(addr, &opts(2)).await.unwrap();
    'waves: for wave in 0..n / depth {
        for k in 0..depth {
            let i = wave * depth + k;
            let sent = tokio::time::timeout(
                Duration::from_secs(2),
                c.send_read16(0, (i as u64 % 16) * 2048, 2048, 512),
            )
            .await;
            if sent.is_err() {
                break 'waves; // the target stopped reading from us: also bounded
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss1 = rss_kib();
    let grew = rss1.saturating_sub(rss0);
    eprintln!(
        "non-reading reader: {n} x 1 MiB reads, queue depth {depth}, RSS {rss0} -> {rss1} KiB \
         (+{grew} KiB)"
    );
    assert!(by.finish().await >= 2);
    drop(c);
    // Bound: the window (depth x 1 MiB) plus socket buffers and slack.
    assert!(
        grew < (depth as u64 + 96) * 1024,
        "a reader that never reads made the target hold {grew} KiB"
    );
}

// ---------------------------------------------------------------------------------------------
// 14. Several connections per session (MC/S). The rules an initiator can break one at a time
// (CmdSN reused on another connection, a tag in use on another connection, Data-Out on the
// wrong connection, joining a session that is not its own, logout of a CID that does not
// exist) are in tests/mcs.rs; here, a window flooded with early CmdSNs.
// ---------------------------------------------------------------------------------------------

/// A session of two connections, as the hostile initiator.
async fn mcs_pair(addr: SocketAddr, isid: u8) -> (Client, Client) {
    let mut o = opts(isid);
    o.max_connections = 2;
    let a = Client::login(addr, &o).await.unwrap();
    let b = Client::join(addr, &o, &a, 1).await.unwrap();
    (a, b)
}

/// One connection fills the whole CmdSN window but its first slot with writes carrying their
/// data, and sends more beyond MaxCmdSN: nothing runs (the gap is never filled by it), the
/// ones beyond the window are ignored, and the held data is bounded by the window. When the
/// other connection fills the gap, every held write runs, in order, once. A gap that is never
/// filled costs nothing once the connection fails: the session ends (ErrorRecoveryLevel 0),
/// and what was held goes with it, round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c14_mcs_window_flooded_with_early_cmdsns() {
    let _g = GATE.write().await;
    let depth = 32u32;
    let (addr, _stop) = start_with(|c| c.queue_depth = depth).await;
    let by = Bystander::start(addr, 1).await;
    let len = 8192u32;

    // Filled: every held write runs once the gap is filled, in CmdSN order (each block range
    // is written twice, and the later CmdSN's data is what stays).
    let (mut a, mut b) = mcs_pair(addr, 0x40).await;
    let gap = a.cmd_sn;
    let window = b.max_cmd_sn.0.wrapping_sub(gap.0) + 1;
    assert_eq!(window, depth, "the window is the queue depth");
    b.cmd_sn = gap.next();
    let mut held = Vec::new();
    for i in 1..window {
        let lba = 8000 + u64::from(i % 8) * 16;
        let (itt, _) = b
            .send_write16(0, lba, len, 512, pattern(len as usize, i as u8))
            .await
            .unwrap();
        held.push(itt);
    }
    for _ in 0..8 {
        // Beyond MaxCmdSN: ignored, never run, never answered.
        b.send_write16(0, 9000, len, 512, pattern(len as usize, 0xee))
            .await
            .unwrap();
    }
    let quiet = tokio::time::timeout(Duration::from_millis(300), b.recv()).await;
    assert!(quiet.is_err(), "a command ahead of the gap ran: {quiet:?}");
    a.cmd_sn = gap;
    let r = a.command(0, &[0u8; 6], None, 0).await.unwrap();
    assert_eq!(r.status, 0);
    for itt in held {
        assert_eq!(expect_status(&mut b, itt).await.0, 0);
    }
    let quiet = tokio::time::timeout(Duration::from_millis(300), b.recv()).await;
    assert!(quiet.is_err(), "a command beyond MaxCmdSN ran: {quiet:?}");
    b.cmd_sn = CmdSn(gap.0.wrapping_add(window));
    for k in 0..8u32 {
        let last = (1..window).filter(|i| i % 8 == k).max().unwrap();
        let r = b
            .read16(0, 8000 + u64::from(k) * 16, 16, 512)
            .await
            .unwrap();
        assert_eq!(r.status, 0);
        assert!(
            r.data == pattern(len as usize, last as u8),
            "blocks {k}: not the data of the last write to them"
        );
    }
    assert_eq!(b.logout().await.unwrap(), LogoutResponseCode::CLOSED);
    drop(a);

    // Never filled: the window held full of data, then the holding connection is reset.
    let rounds = if long() { 200 } else { 20 };
    let (fd0, rss0) = (fd_count(), rss_kib());
    for round in 0..rounds {
        let (mut a, mut b) = mcs_pair(addr, 0x41).await;
        b.cmd_sn = a.cmd_sn.next();
        for i in 1..window {
            b.send_write16(
                0,
                10_000 + u64::from(i) * 16,
                len,
                512,
                pattern(len as usize, 1),
            )
            .await
            .unwrap();
        }
        b.reset().unwrap();
        let gone = tokio::time::timeout(WAIT, a.recv()).await;
        assert!(
            matches!(gone, Ok(Err(_))),
            "round {round}: the session's other connection stayed open: {gone:?}"
        );
    }
    let fd1 = wait_fds_back(fd0).await;
    let rss1 = rss_kib();
    eprintln!(
        "{rounds} sessions with a window of held writes ({} KiB each), then reset: \
         fds {fd0} -> {fd1}, RSS {rss0} -> {rss1} KiB",
        u64::from(window - 1) * u64::from(len) / 1024
    );
    assert!(fd1 <= fd0 + 4, "descriptors leaked: {fd0} -> {fd1}");
    assert!(
        rss1.saturating_sub(rss0) < 64 * 1024,
        "RSS grew by {} KiB",
        rss1.saturating_sub(rss0)
    );
    // The target is unharmed: a fresh session of the same initiator works.
    let (mut a, _b) = mcs_pair(addr, 0x41).await;
    round_trip(&mut a, 12_000, 8192, 3).await;
    assert!(by.finish().await >= 2);
}

/// Connection recovery (ErrorRecoveryLevel 2) asked for wrongly, in a storm: TASK REASSIGN of
/// tags that do not exist (each with another ExpDataSN) and of a tag whose connection is still
/// in the session, and logouts for recovery naming CIDs the session does not have. Each is
/// answered with the RFC's code (1 task does not exist, 3 still allegiant, CID not found),
/// nothing is kept for them, and both connections go on working.
#[tokio::test]
async fn reassignment_and_recovery_logout_storms_get_the_rfcs_answers() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let mut o = opts(0x61);
    o.error_recovery_level = 2;
    o.time2retain = 20;
    o.max_connections = 2;
    let mut a = Client::login(addr, &o).await.unwrap();
    assert_eq!(a.negotiated_value("ErrorRecoveryLevel"), Some("2"));
    let mut b = Client::join(addr, &o, &a, 1).await.unwrap();
    // A write left waiting for its data on A (no immediate data: it gets an R2T): its task is
    // allegiant to A.
    let (itt, _) = a
        .send_write16(0, 900, 4096, 512, Bytes::new())
        .await
        .unwrap();
    b.cmd_sn = a.cmd_sn;
    let n = if long() { 20_000 } else { 2_000 };
    for i in 0..n {
        let code = b
            .task_reassign(Itt(0x7000_0000 + i), DataSn(i))
            .await
            .unwrap();
        assert_eq!(code, TmfResponseCode::TASK_DOES_NOT_EXIST, "tag {i}");
        if i % 100 == 0 {
            let code = b.task_reassign(itt, DataSn(0)).await.unwrap();
            assert_eq!(code, TmfResponseCode::TASK_STILL_ALLEGIANT);
            let (code, _, _) = b
                .logout_for(
                    LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY,
                    100 + (i % 50) as u16,
                    None,
                )
                .await
                .unwrap();
            assert_eq!(code, LogoutResponseCode::CID_NOT_FOUND);
        }
    }
    // Both connections still serve.
    round_trip(&mut b, 2000, 8192, 7).await;
    a.cmd_sn = b.cmd_sn;
    round_trip(&mut a, 2100, 8192, 8).await;
}

/// Finish the tasks `writes` (tag, data) and `reads` (tag, what the LU holds) on `c`, whose
/// R2Ts, Data-In and statuses arrive there unasked (moved there by TASK REASSIGN, or merely
/// left waiting): the R2Ts answered with the data, each Data-In checked against what the LU
/// holds at its offset, until every task has its status (GOOD); what `c.unsolicited` holds
/// (kept while a task management request waited for its answer) first. Returns how many
/// Data-In arrived.
async fn finish_unasked(c: &mut Client, writes: &[(Itt, Bytes)], reads: &[(Itt, Bytes)]) -> usize {
    let mut open: Vec<Itt> = writes.iter().chain(reads).map(|t| t.0).collect();
    let mut backlog = std::mem::take(&mut c.unsolicited).into_iter();
    let mut segments = 0;
    while !open.is_empty() {
        let p = match backlog.next() {
            Some(p) => p,
            None => tokio::time::timeout(WAIT, c.recv())
                .await
                .unwrap_or_else(|_| panic!("reassigned tasks {open:?} unfinished"))
                .expect("connection closed with reassigned tasks unfinished"),
        };
        match p.header {
            Header::R2t(r) => {
                let (_, data) = writes
                    .iter()
                    .find(|w| w.0 == r.itt)
                    .unwrap_or_else(|| panic!("R2T for a task not reassigned here: {r:?}"));
                c.answer_r2t(&r, data).await.unwrap();
            }
            Header::DataIn(d) => {
                let (_, want) = reads
                    .iter()
                    .find(|t| t.0 == d.itt)
                    .unwrap_or_else(|| panic!("Data-In for a task not reassigned here: {d:?}"));
                let at = d.buffer_offset as usize;
                assert!(
                    want.get(at..at + p.data.len()) == Some(&p.data[..]),
                    "resumed Data-In of {:?} at {at}: not the data read",
                    d.itt
                );
                segments += 1;
                if let Some(s) = d.status {
                    assert_eq!(s, 0, "status of the resumed read {:?}", d.itt);
                    c.exp_stat_sn = d.sn.stat_sn.next();
                    open.retain(|i| *i != d.itt);
                }
            }
            Header::ScsiResponse(r) => {
                assert_eq!(r.status, 0, "status of the reassigned task {:?}", r.itt);
                assert!(open.contains(&r.itt), "a second status for {:?}", r.itt);
                c.exp_stat_sn = r.sn.stat_sn.next();
                open.retain(|i| *i != r.itt);
            }
            Header::NopIn(_) => {}
            h => panic!("unexpected {h:?} while finishing reassigned tasks"),
        }
    }
    segments
}

/// Connection recovery (ErrorRecoveryLevel 2) abused over connections really cut: round after round
/// a second connection of the session is reset with two reads answered (their statuses received,
/// not acknowledged) and two writes waiting for their data, and logged out for recovery from the
/// first; then a storm of TASK REASSIGN of those tags (the first from ExpDataSN 0, 1 or 2, then
/// any), of unknown tags, and logouts for recovery naming the cut CID and CIDs that never existed.
/// The first reassignment of each task is COMPLETE and only that one: a read's response is handed
/// out once (a second asks for a task that does not exist), a write moved to the first connection
/// is allegiant to it; unknown tags do not exist, the cut CID is closed, others are not found. The
/// moved writes land once their data comes by R2T, the resumed reads' data is what the LU holds,
/// every request is answered, a well-behaved session keeps working, and the server's memory stays
/// flat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reassignment_storms_over_cut_connections_are_answered_once_each() {
    let _g = GATE.write().await;
    let (addr, _stop) = start().await;
    let by = Bystander::start(addr, 1).await;
    let mut o = r2t_opts(0x62);
    o.error_recovery_level = 2;
    o.time2retain = 20;
    o.max_connections = 2;
    // Reads of 16 KiB in two Data-In.
    o.max_recv_data_segment_length = 8192;
    let mut b = Client::login(addr, &o).await.unwrap();
    assert_eq!(b.negotiated_value("ErrorRecoveryLevel"), Some("2"));
    let (rounds, storm) = if long() { (100, 400) } else { (20, 100) };
    let rss0 = rss_kib();
    let mut answered = 0usize;
    for round in 0..rounds {
        let base = 20_000 + (round % 8) * 128;
        // What the reads will find: written through the first connection.
        let old: Vec<Bytes> = (0..2u8)
            .map(|k| pattern(16384, round as u8 ^ (0x40 + k)))
            .collect();
        for (k, d) in old.iter().enumerate() {
            let w = b
                .write16(0, base + k as u64 * 32, d.clone(), 512, false)
                .await
                .unwrap();
            assert_eq!(w.status, 0);
        }
        let mut a = Client::join(addr, &o, &b, 1).await.unwrap();
        a.cmd_sn = b.cmd_sn;
        let mut reads = Vec::new();
        for (k, d) in old.iter().enumerate() {
            let (itt, _) = a
                .send_read16(0, base + k as u64 * 32, 32, 512)
                .await
                .unwrap();
            reads.push((itt, d.clone()));
        }
        let mut writes = Vec::new();
        for k in 0..2u8 {
            let data = pattern(8192, round as u8 ^ (0x80 + k));
            let lba = base + 64 + u64::from(k) * 16;
            let (itt, _) = a
                .send_write16(0, lba, 8192, 512, Bytes::new())
                .await
                .unwrap();
            writes.push((itt, data, lba));
        }
        // The reads answered and both writes delivered (their R2Ts came); the connection's
        // ExpStatSN stays where the login left it, so nothing is acknowledged.
        let (mut statuses, mut r2ts) = (0, 0);
        while statuses < reads.len() || r2ts < writes.len() {
            let p = tokio::time::timeout(WAIT, a.recv()).await.unwrap().unwrap();
            match p.header {
                Header::R2t(_) => r2ts += 1,
                Header::DataIn(d) if d.status.is_some() => statuses += 1,
                Header::DataIn(_) | Header::NopIn(_) => {}
                h => panic!("round {round}: unexpected {h:?}"),
            }
        }
        b.cmd_sn = a.cmd_sn;
        let last = a.exp_stat_sn;
        a.reset().unwrap();
        let (code, _, _) = b
            .logout_for(LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 1, Some(last))
            .await
            .unwrap();
        assert_eq!(code, LogoutResponseCode::CLOSED, "round {round}");
        let moved: Vec<(Itt, Bytes)> = writes.iter().map(|w| (w.0, w.1.clone())).collect();
        for (i, (itt, _)) in reads.iter().chain(&moved).enumerate() {
            // A read resumes from ExpDataSN 0 (all of it), 1 (its last Data-In) or 2 (past
            // it: the Data-In with the status still goes).
            let code = b
                .task_reassign(*itt, DataSn(round as u32 % 3))
                .await
                .unwrap();
            assert_eq!(code, TmfResponseCode::COMPLETE, "round {round}, task {i}");
            answered += 1;
        }
        for i in 0..storm {
            let sn = DataSn((i as u32).wrapping_mul(0x9e37_79b9) >> (i % 32));
            let (code, want) = match i % 5 {
                0 | 1 => (
                    b.task_reassign(reads[i % 2].0, sn).await.unwrap(),
                    TmfResponseCode::TASK_DOES_NOT_EXIST,
                ),
                2 => (
                    b.task_reassign(writes[i % 2].0, sn).await.unwrap(),
                    TmfResponseCode::TASK_STILL_ALLEGIANT,
                ),
                3 => (
                    b.task_reassign(Itt(0x6000_0000 + i as u32), sn)
                        .await
                        .unwrap(),
                    TmfResponseCode::TASK_DOES_NOT_EXIST,
                ),
                _ => {
                    // The cut CID (already failed: closed) with its own last ExpStatSN, so
                    // nothing kept for it is taken as received; or one never used.
                    let (cid, exp, want) = if i % 2 == 0 {
                        (1, Some(last), LogoutResponseCode::CLOSED)
                    } else {
                        (
                            2 + (i % 100) as u16,
                            None,
                            LogoutResponseCode::CID_NOT_FOUND,
                        )
                    };
                    let (code, _, _) = b
                        .logout_for(LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, cid, exp)
                        .await
                        .unwrap();
                    assert_eq!(code, want, "round {round}, logout {i} for CID {cid}");
                    answered += 1;
                    continue;
                }
            };
            assert_eq!(code, want, "round {round}, request {i}");
            answered += 1;
        }
        let segments = finish_unasked(&mut b, &moved, &reads).await;
        assert!(segments >= reads.len(), "round {round}: no resumed Data-In");
        for (itt, data, lba) in &writes {
            let r = b.read16(0, *lba, 16, 512).await.unwrap();
            assert_eq!(r.status, 0);
            assert!(
                r.data == *data,
                "round {round}: moved write {itt:?} not read back"
            );
        }
    }
    let rss1 = rss_kib();
    eprintln!(
        "{rounds} connections cut and recovered, {answered} TASK REASSIGN and logouts for \
         recovery answered, RSS {rss0} -> {rss1} KiB"
    );
    round_trip(&mut b, 30_000, 65536, 9).await;
    assert_eq!(b.logout().await.unwrap(), LogoutResponseCode::CLOSED);
    assert!(by.finish().await >= 2);
    assert!(
        rss1.saturating_sub(rss0) < 64 * 1024,
        "RSS grew by {} KiB",
        rss1.saturating_sub(rss0)
    );
}

/// TASK REASSIGN and logouts for recovery below ErrorRecoveryLevel 2 (the initiator offered 1),
/// in a storm: reassignment is not supported (4) for any tag, even that of a task the
/// connection still has (a write waiting for its data), and a logout for recovery of any CID,
/// its own too, is refused with "recovery not supported" (2) and closes nothing. The write
/// then finishes and the session works.
#[tokio::test]
async fn reassignment_below_level_2_is_not_supported() {
    let _g = GATE.read().await;
    let (addr, _stop) = start().await;
    let mut o = r2t_opts(0x63);
    o.error_recovery_level = 1;
    o.time2retain = 20;
    let mut c = Client::login(addr, &o).await.unwrap();
    assert_eq!(c.negotiated_value("ErrorRecoveryLevel"), Some("1"));
    let data = pattern(8192, 0x31);
    let (itt, _) = c
        .send_write16(0, 3000, 8192, 512, Bytes::new())
        .await
        .unwrap();
    let n = if long() { 10_000 } else { 1_000 };
    for i in 0..n {
        let tag = if i % 3 == 0 {
            itt
        } else {
            Itt(0x5000_0000 + i)
        };
        let code = c.task_reassign(tag, DataSn(i)).await.unwrap();
        assert_eq!(
            code,
            TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED,
            "request {i}"
        );
        if i % 50 == 0 {
            let (code, _, _) = c
                .logout_for(
                    LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY,
                    (i / 50 % 3) as u16,
                    None,
                )
                .await
                .unwrap();
            assert_eq!(
                code,
                LogoutResponseCode::RECOVERY_NOT_SUPPORTED,
                "logout {i}"
            );
        }
    }
    // The write's R2T (kept while the storm was answered) is answered: it lands.
    let done = finish_unasked(&mut c, &[(itt, data.clone())], &[]).await;
    assert_eq!(done, 0);
    let r = c.read16(0, 3000, 16, 512).await.unwrap();
    assert_eq!(r.status, 0);
    assert!(r.data == data, "the write did not land");
    round_trip(&mut c, 3100, 8192, 0x32).await;
}
