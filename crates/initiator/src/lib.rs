//! # ironsan-initiator: a small iSCSI initiator on `ironsan-proto`
//!
//! For tests and benchmarks: things libiscsi cannot do (hostile PDUs, exact control over
//! every field), and an in-process client for the server's tests. One command at a time per
//! [`Client`]; raw PDU access for protocol tests. [`load`] is a pipelined load generator
//! (`ironsan load`) for benchmarks.

pub mod cuts;
pub mod load;

use bytes::{Bytes, BytesMut};
use ironsan_proto::chap::{decode_binary, encode_hex, ChapAlgorithm, MAX_BINARY_LEN};
use ironsan_proto::digest;
use ironsan_proto::pdu::*;
use ironsan_proto::{text, CmdSn, DataSn, StatSn};
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// Errors of the test initiator.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("login failed with status {0:02x}{1:02x}")]
    Login(u8, u8),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("the target failed mutual CHAP (wrong CHAP_N or CHAP_R)")]
    MutualChap,
}

fn get_key(pairs: &[(String, String)], key: &str) -> Option<String> {
    pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

pub type Result<T> = std::result::Result<T, Error>;

/// A PERSISTENT RESERVE OUT (SPC-4) with the basic 24-byte parameter list: its CDB (service
/// action `sa`, reservation type `ptype`) and parameters (RESERVATION KEY `key`, SERVICE
/// ACTION RESERVATION KEY `sark`, APTPL as given).
pub fn prout_basic(sa: u8, ptype: u8, key: u64, sark: u64, aptpl: bool) -> ([u8; 10], Bytes) {
    let mut cdb = [0u8; 10];
    cdb[0] = 0x5F;
    cdb[1] = sa;
    cdb[2] = ptype;
    cdb[8] = 24;
    let mut p = vec![0u8; 24];
    p[..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&sark.to_be_bytes());
    p[20] = u8::from(aptpl);
    (cdb, Bytes::from(p))
}

/// The CDB of a READ(16) of `blocks` blocks at `lba`.
pub fn read16_cdb(lba: u64, blocks: u32) -> [u8; 16] {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x88;
    cdb[2..10].copy_from_slice(&lba.to_be_bytes());
    cdb[10..14].copy_from_slice(&blocks.to_be_bytes());
    cdb
}

/// The CDB of a WRITE(16) of `blocks` blocks at `lba` (no FUA).
pub fn write16_cdb(lba: u64, blocks: u32) -> [u8; 16] {
    let mut cdb = read16_cdb(lba, blocks);
    cdb[0] = 0x8a;
    cdb
}

/// A SCSI Command with the F bit and the simple task attribute, reading or writing `edtl`
/// bytes; ITT and numbers are filled in by [`Client::send_command`].
fn simple_command(lun: u64, write: bool, edtl: u32, cdb: [u8; 16]) -> ScsiCommand {
    ScsiCommand {
        final_bit: true,
        read: !write,
        write,
        attr: TaskAttr::SIMPLE,
        lun: Lun::from_number(lun),
        expected_data_transfer_length: edtl,
        cdb,
        ..Default::default()
    }
}

/// The fields every Data-Out PDU of one sequence shares (RFC 7143 §11.7): one R2T's, or the
/// unsolicited data's (TTT 0xffffffff).
pub(crate) struct DataOutSeq {
    pub lun: Lun,
    pub itt: Itt,
    pub ttt: Ttt,
    pub exp_stat_sn: StatSn,
    /// The target's MaxRecvDataSegmentLength.
    pub mrdsl: u32,
}

impl DataOutSeq {
    /// Bytes `start..end` of the command's data as Data-Out headers with their data length:
    /// DataSN from 0, at most `mrdsl` bytes each, F on the last.
    pub(crate) fn pdus(&self, start: u32, end: u32) -> impl Iterator<Item = (DataOut, u32)> + '_ {
        let mrdsl = self.mrdsl.max(1);
        let mut off = start;
        let mut sn = 0;
        std::iter::from_fn(move || {
            if off >= end {
                return None;
            }
            let len = (end - off).min(mrdsl);
            let d = DataOut {
                final_bit: off + len == end,
                lun: self.lun,
                itt: self.itt,
                ttt: self.ttt,
                exp_stat_sn: self.exp_stat_sn,
                data_sn: DataSn(sn),
                buffer_offset: off,
            };
            off += len;
            sn += 1;
            Some((d, len))
        })
    }
}

/// A PDU as it goes on the wire (RFC 7143 §11.1): the BHS (no AHS), its CRC32C when
/// `header_digest`, the data segment padded to 4 bytes, and its CRC32C when `data_digest` and
/// there is data.
pub fn wire_pdu(bhs: &Bhs, data: &[u8], header_digest: bool, data_digest: bool) -> BytesMut {
    let mut buf = BytesMut::with_capacity(48 + 8 + data.len() + 4);
    buf.extend_from_slice(&bhs.0);
    if header_digest {
        buf.extend_from_slice(&digest::crc32c(&bhs.0).to_le_bytes());
    }
    if !data.is_empty() {
        buf.extend_from_slice(data);
        buf.extend_from_slice(&[0u8; 3][..pad_len(data.len())]);
        if data_digest {
            buf.extend_from_slice(&digest::data_digest(&[data]).to_le_bytes());
        }
    }
    buf
}

/// What to offer at login.
#[derive(Clone, Debug)]
pub struct LoginOptions {
    pub initiator_name: String,
    /// `None` logs in to a discovery session.
    pub target_name: Option<String>,
    pub isid: Isid,
    pub tsih: Tsih,
    pub cid: Cid,
    pub header_digest: bool,
    pub data_digest: bool,
    pub max_recv_data_segment_length: u32,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub first_burst_length: u32,
    pub max_burst_length: u32,
    pub max_outstanding_r2t: u32,
    /// MaxConnections offered in a leading login (RFC 7143 §13.2).
    pub max_connections: u16,
    /// ErrorRecoveryLevel offered in a leading login (RFC 7143 §13.20).
    pub error_recovery_level: u8,
    /// DefaultTime2Wait and DefaultTime2Retain offered in a leading login (RFC 7143 §13.15,
    /// §13.16; default 2 and 0: no connection recovery).
    pub time2wait: u16,
    pub time2retain: u16,
    /// Extra key=value pairs to send in the login.
    pub extra: Vec<(String, String)>,
    /// Authenticate with CHAP in a security stage.
    pub chap: Option<ChapOptions>,
    /// Offer this AuthMethod in a security stage instead of what `chap` implies (e.g. "None"
    /// to try a downgrade). With neither, the security stage is skipped (CSG=1 at once).
    pub auth_method: Option<String>,
}

/// CHAP as the initiator does it (RFC 7143 §12.1.3), with knobs for hostile tests.
#[derive(Clone, Debug)]
pub struct ChapOptions {
    pub user: String,
    pub secret: Vec<u8>,
    /// The CHAP_A list offered, e.g. "5" (MD5) or "7,5" (SHA-256, then MD5).
    pub algorithms: String,
    /// Mutual CHAP: the target's expected CHAP_N and its secret.
    pub mutual: Option<(String, Vec<u8>)>,
    /// Send CHAP_R (and our CHAP_C) base64-encoded (`0b…`) instead of hex.
    pub base64: bool,
    /// Hostile: use the target's own CHAP_I and CHAP_C as our mutual challenge.
    pub reflect: bool,
    /// Hostile: send this CHAP_I with the mutual challenge (e.g. "256").
    pub mutual_id: Option<String>,
}

impl ChapOptions {
    /// One-way CHAP with MD5.
    pub fn new(user: &str, secret: &[u8]) -> Self {
        ChapOptions {
            user: user.into(),
            secret: secret.to_vec(),
            algorithms: "5".into(),
            mutual: None,
            base64: false,
            reflect: false,
            mutual_id: None,
        }
    }

    /// Mutual CHAP: also check that the target answers as `target_user` with `target_secret`.
    pub fn mutual(mut self, target_user: &str, target_secret: &[u8]) -> Self {
        self.mutual = Some((target_user.into(), target_secret.to_vec()));
        self
    }
}

fn encode_b64(b: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::from("0b");
    for ch in b.chunks(3) {
        let n = ch.iter().fold(0u32, |a, &x| a << 8 | u32::from(x)) << (8 * (3 - ch.len()));
        for i in 0..=ch.len() {
            s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
        for _ in ch.len()..3 {
            s.push('=');
        }
    }
    s
}

/// Not-cryptographic bytes for the test initiator's mutual challenge (unique per call).
fn test_challenge(len: usize) -> Vec<u8> {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let state = std::collections::hash_map::RandomState::new();
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        let mut h = state.build_hasher();
        h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        out.extend_from_slice(&h.finish().to_le_bytes());
    }
    out.truncate(len);
    out
}

impl LoginOptions {
    pub fn new(target: Option<&str>) -> Self {
        LoginOptions {
            initiator_name: "iqn.2026-11.org.ironsan:test-initiator".into(),
            target_name: target.map(str::to_string),
            isid: Isid([0x80, 0, 0x12, 0x34, 0, 1]),
            tsih: Tsih(0),
            cid: Cid(0),
            header_digest: false,
            data_digest: false,
            max_recv_data_segment_length: 262144,
            initial_r2t: false,
            immediate_data: true,
            first_burst_length: 65536,
            max_burst_length: 262144,
            max_outstanding_r2t: 1,
            max_connections: 1,
            error_recovery_level: 0,
            time2wait: 2,
            time2retain: 0,
            extra: Vec::new(),
            chap: None,
            auth_method: None,
        }
    }
}

/// The outcome of a SCSI command.
#[derive(Clone, Debug, Default)]
pub struct CommandResult {
    pub status: u8,
    pub data: Bytes,
    pub sense: Bytes,
    pub residual: Residual,
}

impl CommandResult {
    /// (sense key, ASC, ASCQ) from fixed-format sense data.
    pub fn sense_key(&self) -> Option<(u8, u8, u8)> {
        let s = &self.sense;
        (s.len() >= 14).then(|| (s[2] & 0x0f, s[12], s[13]))
    }
}

/// A logged-in connection.
#[derive(Debug)]
pub struct Client {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
    pub cmd_sn: CmdSn,
    pub exp_stat_sn: StatSn,
    pub max_cmd_sn: CmdSn,
    next_itt: u32,
    pub header_digest: bool,
    pub data_digest: bool,
    /// Negotiated values as the target answered them.
    pub negotiated: Vec<(String, String)>,
    pub tsih: Tsih,
    /// The target's MaxRecvDataSegmentLength (limit for our Data-Out).
    pub target_mrdsl: u32,
    pub first_burst: u32,
    pub max_burst: u32,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    /// Async messages and other unsolicited PDUs seen while waiting.
    pub unsolicited: Vec<Pdu>,
    /// Every Login Response received, as it came (to compare failures byte for byte).
    pub login_responses: Vec<Pdu>,
    /// Damage one PDU about to be sent ([`Client::corrupt_after`]).
    corrupt: Option<(Corrupt, u32)>,
}

/// What to damage in a PDU sent on purpose with a wrong digest (error recovery tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Corrupt {
    /// The header digest (the target drops the PDU, or closes the connection).
    Header,
    /// The data digest (the target rejects the PDU's data).
    Data,
}

impl Client {
    /// Connect without logging in (for raw protocol tests).
    pub async fn connect_raw(
        addr: SocketAddr,
    ) -> Result<(BufReader<OwnedReadHalf>, OwnedWriteHalf)> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let (r, w) = s.into_split();
        Ok((BufReader::new(r), w))
    }

    /// Connect without logging in; then [`Client::login_on`] or [`Client::login_request`].
    pub async fn connect(addr: SocketAddr) -> Result<Client> {
        let (rd, wr) = Self::connect_raw(addr).await?;
        Ok(Client {
            rd,
            wr,
            cmd_sn: CmdSn(1),
            exp_stat_sn: StatSn(0),
            max_cmd_sn: CmdSn(1),
            next_itt: 1,
            header_digest: false,
            data_digest: false,
            negotiated: Vec::new(),
            tsih: Tsih(0),
            target_mrdsl: 8192,
            first_burst: 65536,
            max_burst: 262144,
            immediate_data: true,
            initial_r2t: true,
            unsolicited: Vec::new(),
            login_responses: Vec::new(),
            corrupt: None,
        })
    }

    /// Connect and log in: a security stage with CHAP when `opts.chap` (or an AuthMethod
    /// offer when `opts.auth_method`) is set, else straight to the operational stage (CSG=1).
    pub async fn login(addr: SocketAddr, opts: &LoginOptions) -> Result<Client> {
        let mut c = Self::connect(addr).await?;
        c.login_on(opts).await?;
        Ok(c)
    }

    /// Send one Login Request (ISID, TSIH, CID from `opts`, ITT 0, the login's CmdSN) and
    /// return the response and its keys. A response with a non-zero status is
    /// [`Error::Login`] (the PDU stays in [`Client::login_responses`]).
    pub async fn login_request(
        &mut self,
        opts: &LoginOptions,
        csg: Stage,
        nsg: Stage,
        transit: bool,
        pairs: &[(String, String)],
    ) -> Result<(LoginResponse, Vec<(String, String)>)> {
        let req = LoginRequest {
            transit,
            csg,
            nsg: if transit { nsg } else { Stage(0) },
            isid: opts.isid,
            tsih: opts.tsih,
            itt: Itt(0),
            cid: opts.cid,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: self.exp_stat_sn,
            ..Default::default()
        };
        self.send(Header::LoginRequest(req), text::encode(pairs))
            .await?;
        let resp = self.recv().await?;
        self.login_responses.push(resp.clone());
        let Header::LoginResponse(lr) = resp.header else {
            return Err(Error::Protocol(format!(
                "expected login response, got {:?}",
                resp.header
            )));
        };
        if lr.status_class != 0 {
            return Err(Error::Login(lr.status_class, lr.status_detail));
        }
        self.exp_stat_sn = lr.sn.stat_sn.next();
        self.max_cmd_sn = lr.sn.max_cmd_sn;
        let pairs =
            text::parse(&resp.data).map_err(|e| Error::Protocol(format!("login text: {e:?}")))?;
        Ok((lr, pairs))
    }

    /// The security stage: AuthMethod, then the CHAP exchange (RFC 7143 §12.1.3).
    async fn security_stage(
        &mut self,
        opts: &LoginOptions,
        identity: Vec<(String, String)>,
    ) -> Result<()> {
        let sec = Stage::SECURITY_NEGOTIATION;
        let op = Stage::LOGIN_OPERATIONAL_NEGOTIATION;
        let kv = |k: &str, v: &str| (k.to_string(), v.to_string());
        let method = match (&opts.auth_method, &opts.chap) {
            (Some(m), _) => m.clone(),
            (None, Some(_)) => "CHAP,None".into(),
            (None, None) => "None".into(),
        };
        let mut first = identity;
        first.push(kv("AuthMethod", &method));
        let (lr, pairs) = self.login_request(opts, sec, op, true, &first).await?;
        let agreed = get_key(&pairs, "AuthMethod").unwrap_or_default();
        let Some(chap) = opts.chap.as_ref().filter(|_| agreed == "CHAP") else {
            if lr.transit {
                return Ok(());
            }
            // The target wants more of the security stage than we offer.
            let (lr, _) = self.login_request(opts, sec, op, true, &[]).await?;
            return if lr.transit {
                Ok(())
            } else {
                Err(Error::Protocol(
                    "target did not leave the security stage".into(),
                ))
            };
        };
        let (_, pairs) = self
            .login_request(opts, sec, op, true, &[kv("CHAP_A", &chap.algorithms)])
            .await?;
        let missing = |k: &str| Error::Protocol(format!("no {k} from the target"));
        let alg = get_key(&pairs, "CHAP_A")
            .and_then(|a| a.parse::<u64>().ok())
            .and_then(ChapAlgorithm::from_code)
            .ok_or_else(|| missing("CHAP_A"))?;
        let id_s = get_key(&pairs, "CHAP_I").ok_or_else(|| missing("CHAP_I"))?;
        let id: u8 = id_s.parse().map_err(|_| missing("valid CHAP_I"))?;
        let c_s = get_key(&pairs, "CHAP_C").ok_or_else(|| missing("CHAP_C"))?;
        let challenge =
            decode_binary(&c_s, MAX_BINARY_LEN).ok_or_else(|| missing("valid CHAP_C"))?;
        let r = alg.response(id, &chap.secret, &challenge);
        let enc = |b: &[u8]| {
            if chap.base64 {
                encode_b64(b)
            } else {
                encode_hex(b)
            }
        };
        let mut answer = vec![kv("CHAP_N", &chap.user), kv("CHAP_R", &enc(&r))];
        let mut my = None;
        if chap.mutual.is_some() || chap.reflect || chap.mutual_id.is_some() {
            let (my_id, my_c) = if chap.reflect {
                (id, challenge.clone())
            } else {
                (challenge[0].wrapping_add(1), test_challenge(32))
            };
            let id_text = chap.mutual_id.clone().unwrap_or_else(|| my_id.to_string());
            answer.push(kv("CHAP_I", &id_text));
            answer.push(kv("CHAP_C", &enc(&my_c)));
            my = Some((my_id, my_c));
        }
        let (lr, pairs) = self.login_request(opts, sec, op, true, &answer).await?;
        if let (Some((name, secret)), Some((my_id, my_c))) = (&chap.mutual, my) {
            let n = get_key(&pairs, "CHAP_N").ok_or_else(|| missing("CHAP_N"))?;
            let r = get_key(&pairs, "CHAP_R")
                .and_then(|r| decode_binary(&r, MAX_BINARY_LEN))
                .ok_or_else(|| missing("CHAP_R"))?;
            if &n != name || r != alg.response(my_id, secret, &my_c) {
                return Err(Error::MutualChap);
            }
        }
        if !lr.transit {
            return Err(Error::Protocol(
                "target did not leave the security stage after CHAP".into(),
            ));
        }
        Ok(())
    }

    /// Log in on a connected client (see [`Client::login`]).
    pub async fn login_on(&mut self, opts: &LoginOptions) -> Result<()> {
        let c = self;
        let yn = |b: bool| if b { "Yes" } else { "No" }.to_string();
        let dg = |b: bool| if b { "CRC32C" } else { "None" }.to_string();
        let mut identity: Vec<(String, String)> =
            vec![("InitiatorName".into(), opts.initiator_name.clone())];
        match &opts.target_name {
            Some(t) => {
                identity.push(("TargetName".into(), t.clone()));
                identity.push(("SessionType".into(), "Normal".into()));
            }
            None => identity.push(("SessionType".into(), "Discovery".into())),
        }
        let secure = opts.chap.is_some() || opts.auth_method.is_some();
        let mut keys = Vec::new();
        if secure {
            c.security_stage(opts, identity).await?;
        } else {
            keys = identity;
        }
        keys.extend([
            ("HeaderDigest".into(), dg(opts.header_digest)),
            ("DataDigest".into(), dg(opts.data_digest)),
            (
                "MaxRecvDataSegmentLength".into(),
                opts.max_recv_data_segment_length.to_string(),
            ),
        ]);
        // Leading-only keys only in the session's leading login (RFC 7143 §13: "LO").
        if opts.target_name.is_some() && opts.tsih.0 == 0 {
            keys.extend([
                ("InitialR2T".into(), yn(opts.initial_r2t)),
                ("ImmediateData".into(), yn(opts.immediate_data)),
                (
                    "FirstBurstLength".into(),
                    opts.first_burst_length.to_string(),
                ),
                ("MaxBurstLength".into(), opts.max_burst_length.to_string()),
                (
                    "MaxOutstandingR2T".into(),
                    opts.max_outstanding_r2t.to_string(),
                ),
                (
                    "ErrorRecoveryLevel".into(),
                    opts.error_recovery_level.to_string(),
                ),
                ("DefaultTime2Wait".into(), opts.time2wait.to_string()),
                ("DefaultTime2Retain".into(), opts.time2retain.to_string()),
                ("MaxConnections".into(), opts.max_connections.to_string()),
                ("DataPDUInOrder".into(), "Yes".into()),
                ("DataSequenceInOrder".into(), "Yes".into()),
            ]);
        }
        keys.extend(opts.extra.iter().cloned());
        for _round in 0..8 {
            let (lr, pairs) = c
                .login_request(
                    opts,
                    Stage::LOGIN_OPERATIONAL_NEGOTIATION,
                    Stage::FULL_FEATURE_PHASE,
                    true,
                    &keys,
                )
                .await?;
            c.negotiated.extend(pairs);
            if lr.transit && lr.nsg == Stage::FULL_FEATURE_PHASE {
                c.tsih = lr.tsih;
                break;
            }
            keys = Vec::new();
        }
        let get = |k: &str| {
            c.negotiated
                .iter()
                .rev()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
        };
        c.header_digest = get("HeaderDigest").as_deref() == Some("CRC32C");
        c.data_digest = get("DataDigest").as_deref() == Some("CRC32C");
        c.target_mrdsl = get("MaxRecvDataSegmentLength")
            .and_then(|v| v.parse().ok())
            .unwrap_or(8192);
        c.first_burst = get("FirstBurstLength")
            .and_then(|v| v.parse().ok())
            .unwrap_or(65536);
        c.max_burst = get("MaxBurstLength")
            .and_then(|v| v.parse().ok())
            .unwrap_or(262144);
        c.immediate_data = get("ImmediateData").as_deref() != Some("No");
        c.initial_r2t = get("InitialR2T").as_deref() != Some("No");
        if c.tsih.0 == 0 {
            return Err(Error::Protocol(
                "login did not reach full feature phase".into(),
            ));
        }
        Ok(())
    }

    /// A numeric key as the target answered it at login.
    pub fn negotiated_u32(&self, key: &str) -> Option<u32> {
        self.negotiated
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.parse().ok())
    }

    /// Log in a further connection of `leader`'s session (RFC 7143 §6.3: the session's ISID
    /// and TSIH, a new CID), continuing the session's CmdSN; the session-wide values agreed by
    /// the leading login apply to it. The caller keeps the connections' CmdSNs in step (CmdSN
    /// is the session's, §4.2.2.1).
    pub async fn join(
        addr: SocketAddr,
        opts: &LoginOptions,
        leader: &Client,
        cid: u16,
    ) -> Result<Client> {
        let mut o = opts.clone();
        o.tsih = leader.tsih;
        o.cid = Cid(cid);
        let mut c = Self::connect(addr).await?;
        c.cmd_sn = leader.cmd_sn;
        // Task tags are the session's too: keep this connection's apart from the leader's.
        c.next_itt = u32::from(cid) << 24 | 1;
        c.login_on(&o).await?;
        c.first_burst = leader.first_burst;
        c.max_burst = leader.max_burst;
        c.immediate_data = leader.immediate_data;
        c.initial_r2t = leader.initial_r2t;
        Ok(c)
    }

    /// A fresh initiator task tag.
    pub fn itt(&mut self) -> Itt {
        let i = Itt(self.next_itt);
        self.next_itt = self.next_itt.wrapping_add(1).max(1);
        i
    }

    /// Send one PDU with this connection's digests.
    pub async fn send(&mut self, header: Header, data: Bytes) -> Result<()> {
        let pdu = Pdu::new(header, data);
        let bhs = pdu.bhs();
        self.send_raw_bhs(&bhs, &pdu.data).await
    }

    /// Send a raw BHS (possibly malformed) and data, with digests as negotiated.
    pub async fn send_raw_bhs(&mut self, bhs: &Bhs, data: &[u8]) -> Result<()> {
        let mut buf = wire_pdu(bhs, data, self.header_digest, self.data_digest);
        match self.corrupt {
            Some((what, 0)) => {
                self.corrupt = None;
                // The digest is the last 4 bytes of its part (RFC 7143 §11.1).
                let at = match what {
                    Corrupt::Header if self.header_digest => Some(48 + 3),
                    Corrupt::Data if self.data_digest && !data.is_empty() => Some(buf.len() - 1),
                    _ => None,
                };
                if let Some(b) = at.and_then(|at| buf.get_mut(at)) {
                    *b ^= 0x5a;
                }
            }
            Some((what, n)) => self.corrupt = Some((what, n - 1)),
            None => {}
        }
        self.wr.write_all(&buf).await?;
        Ok(())
    }

    /// Send the PDU `skip` PDUs from now (0: the next) with a wrong header or data digest
    /// (a digest that was not negotiated, or a data digest on a PDU with no data, leaves it
    /// sound). Commands run as usual around it, so a test can damage, say, the second
    /// Data-Out of a write.
    pub fn corrupt_after(&mut self, what: Corrupt, skip: u32) {
        self.corrupt = Some((what, skip));
    }

    /// Send a SNACK Request (RFC 7143 §11.16): `snack_type` 0 Data/R2T, 1 Status, 2 DataACK,
    /// 3 R-Data; the answer comes by [`Client::recv`].
    pub async fn snack(
        &mut self,
        snack_type: u8,
        itt: Itt,
        ttt: Ttt,
        beg_run: u32,
        run_length: u32,
    ) -> Result<()> {
        let s = SnackRequest {
            snack_type,
            lun: Lun::default(),
            itt,
            ttt,
            exp_stat_sn: self.exp_stat_sn,
            beg_run,
            run_length,
        };
        self.send(Header::SnackRequest(s), Bytes::new()).await
    }

    /// A key as the target answered it at login.
    pub fn negotiated_value(&self, key: &str) -> Option<&str> {
        self.negotiated
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Abort the connection with a TCP RST (SO_LINGER 0, then close), as a crashed host or a
    /// middlebox would, instead of an orderly FIN. Unread input is discarded.
    pub fn reset(self) -> Result<()> {
        let s = self
            .rd
            .into_inner()
            .reunite(self.wr)
            .map_err(|e| Error::Protocol(format!("reunite: {e}")))?;
        s.set_zero_linger()?;
        drop(s);
        Ok(())
    }

    /// Give up the connection for a caller that drives the session itself (the load
    /// generator): the socket, with nothing buffered ahead of it.
    pub fn into_stream(self) -> Result<TcpStream> {
        if !self.rd.buffer().is_empty() {
            return Err(Error::Protocol(format!(
                "{} bytes from the target arrived unasked",
                self.rd.buffer().len()
            )));
        }
        self.rd
            .into_inner()
            .reunite(self.wr)
            .map_err(|e| Error::Protocol(format!("reunite: {e}")))
    }

    /// Write raw bytes to the socket.
    pub async fn send_bytes(&mut self, b: &[u8]) -> Result<()> {
        self.wr.write_all(b).await?;
        Ok(())
    }

    /// Receive one PDU (digests checked).
    pub async fn recv(&mut self) -> Result<Pdu> {
        let mut bhs = Bhs::default();
        self.rd.read_exact(&mut bhs.0).await?;
        let mut ahs = vec![0u8; bhs.ahs_len()];
        self.rd.read_exact(&mut ahs).await?;
        if self.header_digest {
            let mut d = [0u8; 4];
            self.rd.read_exact(&mut d).await?;
            if u32::from_le_bytes(d) != digest::crc32c_append(digest::crc32c(&bhs.0), &ahs) {
                return Err(Error::Protocol("header digest mismatch from target".into()));
            }
        }
        let len = bhs.data_len() as usize;
        let mut data = vec![0u8; len + pad_len(len)];
        self.rd.read_exact(&mut data).await?;
        if self.data_digest && len > 0 {
            let mut d = [0u8; 4];
            self.rd.read_exact(&mut d).await?;
            if u32::from_le_bytes(d) != digest::crc32c(&data) {
                return Err(Error::Protocol("data digest mismatch from target".into()));
            }
        }
        data.truncate(len);
        Ok(Pdu {
            header: Header::decode(&bhs),
            ahs: Bytes::from(ahs),
            data: Bytes::from(data),
        })
    }

    fn note_sn(&mut self, sn: &TargetSn, advances: bool) {
        if advances {
            self.exp_stat_sn = sn.stat_sn.next();
        }
        self.max_cmd_sn = sn.max_cmd_sn;
    }

    /// Run one SCSI command to completion: immediate/unsolicited data within the negotiated
    /// limits, R2Ts answered, Data-In collected.
    pub async fn command(
        &mut self,
        lun: u64,
        cdb: &[u8],
        data_out: Option<Bytes>,
        read_len: u32,
    ) -> Result<CommandResult> {
        let itt = self.itt();
        let mut cdb16 = [0u8; 16];
        let n = cdb.len().min(16);
        cdb16[..n].copy_from_slice(&cdb[..n]);
        let out = data_out.unwrap_or_default();
        let edtl = if out.is_empty() {
            read_len
        } else {
            out.len() as u32
        };
        let imm_len = if self.immediate_data {
            (out.len() as u32)
                .min(self.first_burst)
                .min(self.target_mrdsl)
        } else {
            0
        };
        let unsolicited_end = if !self.initial_r2t {
            (out.len() as u32).min(self.first_burst)
        } else {
            imm_len
        };
        let cmd = ScsiCommand {
            final_bit: unsolicited_end <= imm_len,
            read: read_len > 0,
            write: !out.is_empty(),
            attr: TaskAttr::SIMPLE,
            lun: Lun::from_number(lun),
            itt,
            expected_data_transfer_length: edtl,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: self.exp_stat_sn,
            cdb: cdb16,
            ..Default::default()
        };
        self.cmd_sn = self.cmd_sn.next();
        self.send(Header::ScsiCommand(cmd), out.slice(..imm_len as usize))
            .await?;
        // Unsolicited Data-Out.
        self.send_data_out(
            Lun::from_number(lun),
            itt,
            Ttt::RESERVED,
            &out,
            imm_len,
            unsolicited_end,
        )
        .await?;
        let mut data = BytesMut::new();
        loop {
            let pdu = self.recv().await?;
            match pdu.header {
                Header::R2t(r) if r.itt == itt => {
                    self.note_sn(&r.sn, false);
                    self.answer_r2t(&r, &out).await?;
                }
                Header::DataIn(d) if d.itt == itt => {
                    if d.buffer_offset as usize != data.len() {
                        return Err(Error::Protocol(format!(
                            "Data-In out of order at {}",
                            d.buffer_offset
                        )));
                    }
                    data.extend_from_slice(&pdu.data);
                    self.note_sn(&d.sn, d.status.is_some());
                    if let Some(status) = d.status {
                        return Ok(CommandResult {
                            status,
                            data: data.freeze(),
                            sense: Bytes::new(),
                            residual: d.residual,
                        });
                    }
                }
                Header::ScsiResponse(r) if r.itt == itt => {
                    self.note_sn(&r.sn, true);
                    let sense = if pdu.data.len() >= 2 {
                        let l = u16::from_be_bytes([pdu.data[0], pdu.data[1]]) as usize;
                        pdu.data.slice(2..(2 + l).min(pdu.data.len()))
                    } else {
                        Bytes::new()
                    };
                    return Ok(CommandResult {
                        status: r.status,
                        data: data.freeze(),
                        sense,
                        residual: r.residual,
                    });
                }
                Header::NopIn(n) if n.ttt != Ttt::RESERVED => {
                    // Answer the target's ping.
                    self.note_sn(&n.sn, false);
                    let reply = NopOut {
                        immediate: true,
                        itt: Itt::RESERVED,
                        ttt: n.ttt,
                        cmd_sn: self.cmd_sn,
                        exp_stat_sn: self.exp_stat_sn,
                        lun: n.lun,
                    };
                    self.send(Header::NopOut(reply), Bytes::new()).await?;
                }
                other => {
                    self.unsolicited.push(Pdu::new(other, pdu.data));
                }
            }
        }
    }

    /// Answer the R2T `r` of a command whose data is `out`: the bytes it asks for (as far as
    /// `out` goes) as one Data-Out sequence.
    pub async fn answer_r2t(&mut self, r: &R2t, out: &Bytes) -> Result<()> {
        let end = r
            .buffer_offset
            .saturating_add(r.desired_data_transfer_length)
            .min(out.len() as u32);
        self.send_data_out(r.lun, r.itt, r.ttt, out, r.buffer_offset, end)
            .await
    }

    /// Send `out[start..end]` as one Data-Out sequence in PDUs of at most the target's
    /// MaxRecvDataSegmentLength ([`DataOutSeq::pdus`]).
    async fn send_data_out(
        &mut self,
        lun: Lun,
        itt: Itt,
        ttt: Ttt,
        out: &Bytes,
        start: u32,
        end: u32,
    ) -> Result<()> {
        let seq = DataOutSeq {
            lun,
            itt,
            ttt,
            exp_stat_sn: self.exp_stat_sn,
            mrdsl: self.target_mrdsl,
        };
        for (d, len) in seq.pdus(start, end) {
            let off = d.buffer_offset as usize;
            self.send(Header::DataOut(d), out.slice(off..off + len as usize))
                .await?;
        }
        Ok(())
    }

    /// READ(16) of `blocks` blocks of `block_size` at `lba`.
    pub async fn read16(
        &mut self,
        lun: u64,
        lba: u64,
        blocks: u32,
        block_size: u32,
    ) -> Result<CommandResult> {
        self.command(lun, &read16_cdb(lba, blocks), None, blocks * block_size)
            .await
    }

    /// WRITE(16) of `data` at `lba`, with FUA if asked.
    pub async fn write16(
        &mut self,
        lun: u64,
        lba: u64,
        data: Bytes,
        block_size: u32,
        fua: bool,
    ) -> Result<CommandResult> {
        let mut cdb = write16_cdb(lba, (data.len() as u32) / block_size);
        if fua {
            cdb[1] = 0x08;
        }
        self.command(lun, &cdb, Some(data), 0).await
    }

    /// Send the SCSI Command PDU `cmd` with `data` as its immediate data and return at once:
    /// the Data-Out, the Data-In and the status are the caller's. `cmd` gets a fresh ITT,
    /// the next CmdSN (which then advances) and the current ExpStatSN; returns the ITT and
    /// CmdSN, as a task management request names the task.
    pub async fn send_command(&mut self, cmd: ScsiCommand, data: Bytes) -> Result<(Itt, CmdSn)> {
        let cmd = self.stamp(cmd);
        let (itt, sn) = (cmd.itt, cmd.cmd_sn);
        self.send(Header::ScsiCommand(cmd), data).await?;
        Ok((itt, sn))
    }

    /// `cmd` with a fresh ITT, the next CmdSN (which then advances) and the current
    /// ExpStatSN, for a caller that sends it by other means (raw bytes, a damaged digest).
    pub fn stamp(&mut self, cmd: ScsiCommand) -> ScsiCommand {
        let itt = self.itt();
        let sn = self.cmd_sn;
        self.cmd_sn = sn.next();
        ScsiCommand {
            itt,
            cmd_sn: sn,
            exp_stat_sn: self.exp_stat_sn,
            ..cmd
        }
    }

    /// [`send_command`](Self::send_command) of a READ(16) of `blocks` blocks of `block_size`
    /// at `lba` (simple task attribute): sent without waiting for the answer.
    pub async fn send_read16(
        &mut self,
        lun: u64,
        lba: u64,
        blocks: u32,
        block_size: u32,
    ) -> Result<(Itt, CmdSn)> {
        let cmd = simple_command(lun, false, blocks * block_size, read16_cdb(lba, blocks));
        self.send_command(cmd, Bytes::new()).await
    }

    /// [`send_command`](Self::send_command) of a WRITE(16) of `len` bytes in blocks of
    /// `block_size` at `lba` (simple task attribute, F set), with `data` as its immediate
    /// data: all of it, or a first part or none, for the rest to go by R2T. Sent without
    /// waiting for the answer.
    pub async fn send_write16(
        &mut self,
        lun: u64,
        lba: u64,
        len: u32,
        block_size: u32,
        data: Bytes,
    ) -> Result<(Itt, CmdSn)> {
        let cmd = simple_command(lun, true, len, write16_cdb(lba, len / block_size));
        self.send_command(cmd, data).await
    }

    /// Text request with SendTargets=`value`; returns the key=value pairs (following C-bit
    /// continuations).
    pub async fn send_targets(&mut self, value: &str) -> Result<Vec<(String, String)>> {
        let itt = self.itt();
        let mut ttt = Ttt::RESERVED;
        let mut data = text::encode(&[("SendTargets", value)]);
        let mut all = BytesMut::new();
        loop {
            let req = TextRequest {
                final_bit: true,
                itt,
                ttt,
                cmd_sn: self.cmd_sn,
                exp_stat_sn: self.exp_stat_sn,
                ..Default::default()
            };
            self.cmd_sn = self.cmd_sn.next();
            self.send(Header::TextRequest(req), data).await?;
            let pdu = self.recv().await?;
            let Header::TextResponse(t) = pdu.header else {
                return Err(Error::Protocol(format!(
                    "expected text response, got {:?}",
                    pdu.header
                )));
            };
            self.note_sn(&t.sn, true);
            all.extend_from_slice(&pdu.data);
            if t.final_bit {
                break;
            }
            ttt = t.ttt;
            data = Bytes::new();
        }
        // SendTargets repeats TargetName/TargetAddress: parse without the duplicate-key rule.
        all[..]
            .split(|&b| b == 0)
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let kv = std::str::from_utf8(kv)
                    .map_err(|_| Error::Protocol("text: not UTF-8".into()))?;
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| Error::Protocol(format!("text: no '=' in {kv:?}")))?;
                Ok((k.to_string(), v.to_string()))
            })
            .collect()
    }

    /// NOP-Out ping with `data`; returns the echoed data.
    pub async fn ping(&mut self, data: Bytes) -> Result<Bytes> {
        let itt = self.itt();
        let n = NopOut {
            immediate: true,
            itt,
            ttt: Ttt::RESERVED,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: self.exp_stat_sn,
            ..Default::default()
        };
        self.send(Header::NopOut(n), data).await?;
        loop {
            let pdu = self.recv().await?;
            match pdu.header {
                Header::NopIn(n) if n.itt == itt => {
                    self.note_sn(&n.sn, true);
                    return Ok(pdu.data);
                }
                other => self.unsolicited.push(Pdu::new(other, pdu.data)),
            }
        }
    }

    /// Task management request; returns the response code.
    pub async fn task_mgmt(
        &mut self,
        function: TmfFunction,
        lun: u64,
        referenced: Itt,
        ref_cmd_sn: CmdSn,
    ) -> Result<TmfResponseCode> {
        self.tmf(TaskMgmtRequest {
            function,
            lun: Lun::from_number(lun),
            referenced_task_tag: referenced,
            ref_cmd_sn,
            ..Default::default()
        })
        .await
    }

    /// TASK REASSIGN (RFC 7143 §11.5.1, ErrorRecoveryLevel 2) of the task `referenced` to
    /// this connection, with `exp_data_sn` the next Data-In DataSN wanted (0: all not
    /// acknowledged); returns the response code. What resumes the task (Data-In, R2Ts, its
    /// status) follows; read it with [`recv`](Self::recv).
    pub async fn task_reassign(
        &mut self,
        referenced: Itt,
        exp_data_sn: DataSn,
    ) -> Result<TmfResponseCode> {
        self.tmf(TaskMgmtRequest {
            function: TmfFunction::TASK_REASSIGN,
            referenced_task_tag: referenced,
            exp_data_sn,
            ..Default::default()
        })
        .await
    }

    /// Send `t` as an immediate task management request (with a fresh ITT and this
    /// connection's CmdSN and ExpStatSN) and wait for its response.
    async fn tmf(&mut self, t: TaskMgmtRequest) -> Result<TmfResponseCode> {
        let itt = self.itt();
        let t = TaskMgmtRequest {
            immediate: true,
            itt,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: self.exp_stat_sn,
            ..t
        };
        self.send(Header::TaskMgmtRequest(t), Bytes::new()).await?;
        loop {
            let pdu = self.recv().await?;
            match pdu.header {
                Header::TaskMgmtResponse(r) if r.itt == itt => {
                    self.note_sn(&r.sn, true);
                    return Ok(r.response);
                }
                other => self.unsolicited.push(Pdu::new(other, pdu.data)),
            }
        }
    }

    /// Log out with `reason` for the connection `cid` (RFC 7143 §11.14), whose last ExpStatSN
    /// was `exp_stat_sn` (`None`: this connection's); returns the response code and its
    /// Time2Wait and Time2Retain.
    pub async fn logout_for(
        &mut self,
        reason: LogoutReason,
        cid: u16,
        exp_stat_sn: Option<StatSn>,
    ) -> Result<(LogoutResponseCode, u16, u16)> {
        let itt = self.itt();
        let l = LogoutRequest {
            immediate: true,
            reason,
            itt,
            cid: Cid(cid),
            cmd_sn: self.cmd_sn,
            exp_stat_sn: exp_stat_sn.unwrap_or(self.exp_stat_sn),
        };
        self.send(Header::LogoutRequest(l), Bytes::new()).await?;
        loop {
            let pdu = self.recv().await?;
            match pdu.header {
                Header::LogoutResponse(r) if r.itt == itt => {
                    self.note_sn(&r.sn, true);
                    return Ok((r.response, r.time2wait, r.time2retain));
                }
                other => self.unsolicited.push(Pdu::new(other, pdu.data)),
            }
        }
    }

    /// Log out (close the session); returns the logout response code.
    pub async fn logout(&mut self) -> Result<LogoutResponseCode> {
        let (code, _, _) = self
            .logout_for(LogoutReason::CLOSE_SESSION, 0, None)
            .await?;
        Ok(code)
    }
}
