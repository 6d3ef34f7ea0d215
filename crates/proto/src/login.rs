//! The target's login state machine (RFC 7143 §6.3, §7, §11.12, §11.13).
//!
//! The caller decodes each Login Request, joins C-bit continued text with
//! [`text::Assembler`], parses it with [`text::parse`], and calls
//! [`Login::step`] once per PDU (with empty pairs for a C=1 PDU). Each step says what to send:
//! a response, a failure (send it, then close), or that the login may complete, at which point
//! the server picks the TSIH and calls [`Login::complete`] for the final response.
//!
//! ```text
//!                 first PDU CSG=0                    first PDU CSG=1
//!   Start ─────────────────────────▶ Security ─────────────────────────▶ Operational
//!                                  │  T=1,NSG=1 (auth done)              │
//!                                  ├────────────────────────────────────▶│
//!                                  │  T=1,NSG=3 (auth done)              │ T=1,NSG=3
//!                                  └──────────────────────▶ Ready ◀──────┘
//!                                                             │ complete(tsih, sn)
//!   any state ── bad PDU / policy refusal ──▶ Failed          ▼
//!                                                       full-feature phase
//! ```
//!
//! Decisions (RFC 7143 §11.13.5 status codes):
//! * version_min > 0 (we only speak version 0): 0205, with version_max = version_active = 0.
//! * Missing InitiatorName, or TargetName in a Normal session, in the first complete request:
//!   0207. Unknown target (or malformed TargetName): 0203. ACL refusal: 0202. Moved target:
//!   0101 / 0102 with `TargetAddress`. SessionType other than Normal/Discovery, or Discovery
//!   refused by policy: 0209.
//! * Authentication: [`LoginPolicy::auth_required`] decides per target and initiator. Required:
//!   we accept only AuthMethod=CHAP (MD5, SHA-256, SHA3-256; see [`crate::chap`]); otherwise
//!   only None. An offer without an acceptable method is answered `AuthMethod=Reject` in a 0201
//!   failure. Every CHAP failure (wrong response, unknown user, reflected challenge, keys out of
//!   order) is 0201, indistinguishably; CHAP keys when None was agreed are 0200; AuthMethod
//!   offered in the operational stage is answered Irrelevant when no authentication is
//!   required and None is among the offer (else 0200, §6.3); no caller
//!   randomness ([`Login::set_random`]) is 0300. While CHAP is under way we answer T=0 to a
//!   transit request. A login may start at CSG=1, or leave security without naming an
//!   AuthMethod, only when authentication is not required (else 0201).
//! * Everything the initiator gets wrong in the PDU sequence is 0200 "initiator error": ISID,
//!   TSIH, CID, ITT or CmdSN changing between the PDUs of a login; CSG other than the stage we
//!   agreed to; CSG 2/3; T=1 with NSG not above CSG or NSG=2; C=1 together with T=1; a key
//!   negotiated twice; malformed text (`From<&TextError>`); a reserved constant as an offer;
//!   security keys outside the security stage; a response that would not fit one 8192-byte
//!   login PDU (e.g. hundreds of unknown keys, each answered NotUnderstood); more than
//!   [`MAX_LOGIN_PDUS`] PDUs; a request after the login ended. 020B is for the server to send
//!   when a non-login PDU arrives during login.
//! * 0206, 0208, 020A, 0300-0302 depend on the session registry: the server sends them with
//!   [`Login::reject`] (after `ReadyToComplete`) or [`Login::fail`].
//! * A C=1 request gets an empty response with T=0 (§6.2), checked like any other PDU.
//! * Our first response carries TargetPortalGroupTag (and TargetAlias if configured) for a
//!   Normal session (§13.9); the final response carries our MaxRecvDataSegmentLength unless
//!   already declared. Login PDUs carry at most 8192 data bytes (§13.12).
//! * StatSN: the first response uses the initiator's ExpStatSN as our starting StatSN and each
//!   later response adds one (§11.13.4); intermediate responses carry ExpCmdSN = MaxCmdSN = the
//!   login's CmdSN; the final one carries what the server passes to `complete`.

use bytes::Bytes;

use crate::chap::{ChapAlgorithm, ChapCredentials, ChapError, ChapServer};
use crate::negotiate::{
    valid_iscsi_name, ConnParams, NegotiationError, Negotiator, SessionParams, SessionType,
    TargetDefaults, CHAP_KEYS,
};
use crate::pdu::{Cid, Isid, Itt, LoginRequest, LoginResponse, Stage, TargetSn, Tsih};
use crate::serial::{CmdSn, StatSn};
use crate::text::{self, TextError};

/// Largest data segment of a login PDU (RFC 7143 §13.12: MaxRecvDataSegmentLength is 8192 until
/// the login ends).
pub const LOGIN_MAX_DATA_SEGMENT_LENGTH: u32 = 8192;
/// Bound on the PDUs of one login, continuation included.
pub const MAX_LOGIN_PDUS: u32 = 256;

/// Login status, class in the high byte and detail in the low byte (RFC 7143 §11.13.5).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoginStatus(pub u16);

impl LoginStatus {
    /// 0000 Success.
    pub const SUCCESS: LoginStatus = LoginStatus(0x0000);
    /// 0101 Target moved temporarily (redirect; the response carries TargetAddress).
    pub const TARGET_MOVED_TEMPORARILY: LoginStatus = LoginStatus(0x0101);
    /// 0102 Target moved permanently.
    pub const TARGET_MOVED_PERMANENTLY: LoginStatus = LoginStatus(0x0102);
    /// 0200 Initiator error (miscellaneous).
    pub const INITIATOR_ERROR: LoginStatus = LoginStatus(0x0200);
    /// 0201 Authentication failure.
    pub const AUTHENTICATION_FAILURE: LoginStatus = LoginStatus(0x0201);
    /// 0202 Authorization failure: the initiator may not use this target.
    pub const AUTHORIZATION_FAILURE: LoginStatus = LoginStatus(0x0202);
    /// 0203 Not found: no such target.
    pub const NOT_FOUND: LoginStatus = LoginStatus(0x0203);
    /// 0204 Target removed, no forwarding address.
    pub const TARGET_REMOVED: LoginStatus = LoginStatus(0x0204);
    /// 0205 Unsupported version.
    pub const UNSUPPORTED_VERSION: LoginStatus = LoginStatus(0x0205);
    /// 0206 Too many connections.
    pub const TOO_MANY_CONNECTIONS: LoginStatus = LoginStatus(0x0206);
    /// 0207 Missing parameter (e.g. InitiatorName or TargetName).
    pub const MISSING_PARAMETER: LoginStatus = LoginStatus(0x0207);
    /// 0208 Can't include in session.
    pub const CANT_INCLUDE_IN_SESSION: LoginStatus = LoginStatus(0x0208);
    /// 0209 Session type not supported.
    pub const SESSION_TYPE_NOT_SUPPORTED: LoginStatus = LoginStatus(0x0209);
    /// 020A Session does not exist (adding a connection to an unknown TSIH).
    pub const SESSION_DOES_NOT_EXIST: LoginStatus = LoginStatus(0x020a);
    /// 020B Invalid request type during login.
    pub const INVALID_DURING_LOGIN: LoginStatus = LoginStatus(0x020b);
    /// 0300 Target error (miscellaneous).
    pub const TARGET_ERROR: LoginStatus = LoginStatus(0x0300);
    /// 0301 Service unavailable.
    pub const SERVICE_UNAVAILABLE: LoginStatus = LoginStatus(0x0301);
    /// 0302 Out of resources.
    pub const OUT_OF_RESOURCES: LoginStatus = LoginStatus(0x0302);

    pub fn new(class: u8, detail: u8) -> Self {
        LoginStatus(u16::from_be_bytes([class, detail]))
    }
    pub fn class(self) -> u8 {
        (self.0 >> 8) as u8
    }
    pub fn detail(self) -> u8 {
        self.0 as u8
    }
    pub fn is_success(self) -> bool {
        self.class() == 0
    }
}

impl std::fmt::Debug for LoginStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LoginStatus({:04x})", self.0)
    }
}

impl From<&TextError> for LoginStatus {
    /// Malformed text is the initiator's error.
    fn from(_: &TextError) -> Self {
        LoginStatus::INITIATOR_ERROR
    }
}

impl From<&NegotiationError> for LoginStatus {
    fn from(e: &NegotiationError) -> Self {
        match e {
            NegotiationError::BadTargetName => LoginStatus::NOT_FOUND,
            NegotiationError::UnsupportedSessionType(_) => LoginStatus::SESSION_TYPE_NOT_SUPPORTED,
            NegotiationError::MissingInitiatorName => LoginStatus::MISSING_PARAMETER,
            NegotiationError::Renegotiated(_)
            | NegotiationError::ReservedValue { .. }
            | NegotiationError::InvalidDeclaration { .. }
            | NegotiationError::SecurityKeyOutOfStage(_)
            | NegotiationError::BadInitiatorName => LoginStatus::INITIATOR_ERROR,
        }
    }
}

/// What the configuration says about a target for a given initiator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetLookup {
    Allowed {
        tpgt: u16,
        alias: Option<String>,
        /// The most connections a session with this target may have (MaxConnections, RFC
        /// 7143 §13.2); `None`: the defaults' value.
        max_connections: Option<u16>,
        /// The highest ErrorRecoveryLevel its sessions may agree (§13.20); `None`: the
        /// defaults' value.
        error_recovery_level: Option<u8>,
    },
    NotFound,
    Denied,
    /// Redirect (status 0101 or 0102) to `address` (`host[:port][,tpgt]`, §13.8).
    Moved {
        address: String,
        permanent: bool,
    },
}

/// The server's view of targets and initiators, asked once per login.
pub trait LoginPolicy {
    /// Is this target known, and may this initiator use it? Also gives the portal group tag.
    fn lookup_target(&self, target_name: &str, initiator_name: &str) -> TargetLookup;
    /// May this initiator open a Discovery session?
    fn discovery_allowed(&self, _initiator_name: &str) -> bool {
        true
    }
    /// Must this initiator authenticate with CHAP to reach this target (`None`: a Discovery
    /// session)? When true, AuthMethod=None is refused and the security stage cannot be skipped.
    fn auth_required(&self, _target_name: Option<&str>, _initiator_name: &str) -> bool {
        false
    }
    /// The CHAP secrets for this target (`None`: a Discovery session).
    fn chap_credentials(&self, _target_name: Option<&str>) -> Option<&dyn ChapCredentials> {
        None
    }
    /// The negotiated parameters of the session with this TSIH, if it is this initiator's
    /// (same name and ISID): a login adding a connection to it hears the values in effect.
    fn session_params(
        &self,
        _tsih: Tsih,
        _isid: Isid,
        _initiator_name: &str,
    ) -> Option<SessionParams> {
        None
    }
}

/// What the server needs to decide how the login completes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadyToComplete {
    pub isid: Isid,
    /// As the initiator sent it: 0 opens a new session, anything else adds a connection to
    /// (or reinstates one of) the session with that TSIH.
    pub tsih: Tsih,
    pub cid: Cid,
    pub initiator_name: String,
    pub target_name: Option<String>,
    pub session_type: SessionType,
    /// The portal group tag of the target (Normal sessions).
    pub tpgt: Option<u16>,
    /// The login's CmdSN: a new session's first expected CmdSN.
    pub cmd_sn: CmdSn,
    /// The StatSN the final response must carry (pass it in `complete`'s `sn`).
    pub stat_sn: StatSn,
    /// The CHAP user name the initiator authenticated as, if it used CHAP.
    pub auth_user: Option<String>,
}

/// What to do after one Login Request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoginStep {
    /// Send this response and wait for the next request.
    Respond(LoginResponse, Bytes),
    /// Negotiation is done and the initiator asked for full-feature phase: pick the TSIH and
    /// call [`Login::complete`] (or [`Login::reject`]).
    ReadyToComplete(ReadyToComplete),
    /// Send this failure response, then close the connection.
    Fail(LoginResponse, Bytes),
}

/// Where the security stage stands.
#[derive(Clone, Debug)]
enum Security {
    /// No AuthMethod agreed yet.
    Negotiating,
    /// AuthMethod=CHAP agreed; the exchange is under way.
    Chap(Box<ChapServer>),
    /// AuthMethod=None agreed, or CHAP succeeded.
    Done,
}

impl PartialEq for Security {
    fn eq(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}
impl Eq for Security {}

fn chap_failure(e: ChapError) -> Failure {
    match e {
        ChapError::BadChallengeLength(_) => LoginStatus::TARGET_ERROR.into(),
        _ => LoginStatus::AUTHENTICATION_FAILURE.into(),
    }
}

/// Random bytes one login needs from the caller's CSPRNG: CHAP_I, then a 32-byte CHAP_C.
pub const CHAP_RANDOM_LEN: usize = 33;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Start,
    Security(Security),
    Operational,
    Ready,
    Failed,
}

/// The PDU fields that must not change during one login.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ids {
    isid: Isid,
    tsih: Tsih,
    cid: Cid,
    itt: Itt,
    cmd_sn: CmdSn,
}

struct Failure {
    status: LoginStatus,
    data: Vec<(String, String)>,
}

impl From<LoginStatus> for Failure {
    fn from(status: LoginStatus) -> Self {
        Failure {
            status,
            data: Vec::new(),
        }
    }
}

impl From<NegotiationError> for Failure {
    fn from(e: NegotiationError) -> Self {
        LoginStatus::from(&e).into()
    }
}

/// One connection's login.
#[derive(Debug)]
pub struct Login {
    negotiator: Negotiator,
    phase: Phase,
    ids: Option<Ids>,
    stat_sn: StatSn,
    csg: Stage,
    pdus: u32,
    identified: bool,
    /// Keys owed on the first response (TargetPortalGroupTag, TargetAlias).
    first_extra: Vec<(String, String)>,
    tpgt: Option<u16>,
    /// The final response's text, built when the login became ready.
    final_text: Vec<(String, String)>,
    params: Option<(SessionParams, ConnParams)>,
    auth_required: bool,
    authenticated: bool,
    auth_user: Option<String>,
    random: Option<[u8; CHAP_RANDOM_LEN]>,
}

fn has(pairs: &[(String, String)], key: &str) -> bool {
    pairs.iter().any(|(k, _)| k == key)
}

fn value<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

fn owned(k: &str, v: &str) -> (String, String) {
    (k.to_owned(), v.to_owned())
}

impl Login {
    pub fn new(defaults: TargetDefaults) -> Self {
        Login {
            negotiator: Negotiator::new(&defaults),
            phase: Phase::Start,
            ids: None,
            stat_sn: StatSn(0),
            csg: Stage::SECURITY_NEGOTIATION,
            pdus: 0,
            identified: false,
            first_extra: Vec::new(),
            tpgt: None,
            final_text: Vec::new(),
            params: None,
            auth_required: false,
            authenticated: false,
            auth_user: None,
            random: None,
        }
    }

    /// Fresh bytes from the caller's CSPRNG for this login's CHAP identifier and challenge.
    /// Without them a CHAP login fails with 0300 (target error) rather than use a predictable
    /// challenge.
    pub fn set_random(&mut self, random: [u8; CHAP_RANDOM_LEN]) {
        self.random = Some(random);
    }

    /// The negotiator, e.g. to read what has been agreed so far.
    pub fn negotiator(&self) -> &Negotiator {
        &self.negotiator
    }

    /// Process one Login Request and its (complete, parsed) text; `pairs` must be empty for a
    /// PDU with C=1.
    pub fn step(
        &mut self,
        req: &LoginRequest,
        pairs: Vec<(String, String)>,
        policy: &dyn LoginPolicy,
    ) -> LoginStep {
        match self.advance(req, pairs, policy) {
            Ok(step) => step,
            Err(f) => {
                let (rsp, data) = self.failure(Some(req), f.status, &f.data);
                LoginStep::Fail(rsp, data)
            }
        }
    }

    /// Fail the login on behalf of the caller (malformed text, a non-login PDU during login:
    /// 020B, resources...). The response answers `req`.
    pub fn fail(&mut self, req: &LoginRequest, status: LoginStatus) -> (LoginResponse, Bytes) {
        self.failure(Some(req), status, &[])
    }

    /// Refuse a login that was `ReadyToComplete` (too many connections, unknown session...).
    pub fn reject(mut self, status: LoginStatus) -> (LoginResponse, Bytes) {
        self.failure(None, status, &[])
    }

    /// The connection's negotiated parameters once [`Login::step`] has returned
    /// `ReadyToComplete` (before [`Login::complete`], so that a connection can join its
    /// session, or be refused, first).
    pub fn conn_params(&self) -> Option<ConnParams> {
        self.params.as_ref().map(|(_, c)| *c)
    }

    /// The negotiated session parameters, once `step` has returned `ReadyToComplete` (a new
    /// session is made with them before [`Login::complete`]).
    pub fn session_params(&self) -> Option<&SessionParams> {
        self.params.as_ref().map(|(s, _)| s)
    }

    /// Build the final response (T=1, NSG=3, status 0000) with the TSIH the server chose (the
    /// initiator's for an added connection) and the sequence numbers of the session (`sn.stat_sn`
    /// should be [`ReadyToComplete::stat_sn`]).
    ///
    /// # Panics
    /// If `step` has not returned `ReadyToComplete`: that is a bug in the caller.
    pub fn complete(
        self,
        tsih: Tsih,
        sn: TargetSn,
    ) -> (LoginResponse, Bytes, SessionParams, ConnParams) {
        assert_eq!(
            self.phase,
            Phase::Ready,
            "Login::complete before ReadyToComplete"
        );
        let ids = self.ids.expect("ready implies a first request");
        let (session, conn) = self.params.expect("ready implies negotiated parameters");
        let rsp = LoginResponse {
            transit: true,
            cont: false,
            csg: self.csg,
            nsg: Stage::FULL_FEATURE_PHASE,
            version_max: 0,
            version_active: 0,
            isid: ids.isid,
            tsih,
            itt: ids.itt,
            sn,
            status_class: 0,
            status_detail: 0,
        };
        (rsp, text::encode(&self.final_text), session, conn)
    }

    fn advance(
        &mut self,
        req: &LoginRequest,
        pairs: Vec<(String, String)>,
        policy: &dyn LoginPolicy,
    ) -> Result<LoginStep, Failure> {
        self.pdus += 1;
        if self.pdus > MAX_LOGIN_PDUS {
            return Err(LoginStatus::INITIATOR_ERROR.into());
        }
        let ids = Ids {
            isid: req.isid,
            tsih: req.tsih,
            cid: req.cid,
            itt: req.itt,
            cmd_sn: req.cmd_sn,
        };
        match self.phase {
            Phase::Ready | Phase::Failed => return Err(LoginStatus::INITIATOR_ERROR.into()),
            Phase::Start => {
                self.stat_sn = req.exp_stat_sn;
                // Only version 0 exists (§11.12.4): we need version_min <= 0 <= version_max.
                if req.version_min != 0 {
                    return Err(LoginStatus::UNSUPPORTED_VERSION.into());
                }
                self.ids = Some(ids);
                self.negotiator.set_leading(req.tsih == Tsih(0));
                self.phase = match req.csg {
                    Stage::SECURITY_NEGOTIATION => Phase::Security(Security::Negotiating),
                    Stage::LOGIN_OPERATIONAL_NEGOTIATION => Phase::Operational,
                    _ => return Err(LoginStatus::INITIATOR_ERROR.into()),
                };
            }
            _ => {
                if self.ids != Some(ids) {
                    return Err(LoginStatus::INITIATOR_ERROR.into());
                }
            }
        }
        let stage = match self.phase {
            Phase::Security(_) => Stage::SECURITY_NEGOTIATION,
            _ => Stage::LOGIN_OPERATIONAL_NEGOTIATION,
        };
        if req.csg != stage {
            return Err(LoginStatus::INITIATOR_ERROR.into());
        }
        self.csg = stage;
        if req.cont {
            // §11.12.2: C=1 forbids T=1. The rest of the text is still to come: answer empty.
            if req.transit {
                return Err(LoginStatus::INITIATOR_ERROR.into());
            }
            return Ok(self.respond(req, false, Stage(0), Vec::new()));
        }
        if req.transit {
            let valid = matches!(
                (req.csg, req.nsg),
                (
                    Stage::SECURITY_NEGOTIATION,
                    Stage::LOGIN_OPERATIONAL_NEGOTIATION
                ) | (Stage::SECURITY_NEGOTIATION, Stage::FULL_FEATURE_PHASE)
                    | (
                        Stage::LOGIN_OPERATIONAL_NEGOTIATION,
                        Stage::FULL_FEATURE_PHASE
                    )
            );
            if !valid {
                return Err(LoginStatus::INITIATOR_ERROR.into());
            }
        }

        let first = !self.identified;
        if first {
            self.identify(&pairs, policy)?;
        }
        // A login that starts in the operational stage skips security: only when no
        // authentication is required.
        if self.auth_required && !self.authenticated && stage != Stage::SECURITY_NEGOTIATION {
            return Err(LoginStatus::AUTHENTICATION_FAILURE.into());
        }

        let (chap, pairs): (Vec<_>, Vec<_>) = pairs
            .into_iter()
            .partition(|(k, _)| CHAP_KEYS.contains(&k.as_str()));
        if let Some((k, _)) = chap.first() {
            if stage != Stage::SECURITY_NEGOTIATION {
                return Err(NegotiationError::SecurityKeyOutOfStage(k.clone()).into());
            }
        }
        // AuthMethod offered outside the security stage, as some initiators do in a login
        // that starts in the operational stage. A key out of its stage is a protocol
        // error (§6.3), but §6.2 lets the acceptor answer Irrelevant and the negotiation go
        // on: with no authentication required and None among the offer there is nothing to
        // protect, so it is answered Irrelevant (LIO and istgt accept such logins too).
        let (pairs, irrelevant_auth) = if stage != Stage::SECURITY_NEGOTIATION
            && !self.auth_required
            && !self.negotiator.was_sent("AuthMethod")
            && value(&pairs, "AuthMethod").is_some_and(|v| v.split(',').any(|m| m == "None"))
        {
            let rest = pairs
                .into_iter()
                .filter(|(k, _)| k != "AuthMethod")
                .collect();
            (rest, true)
        } else {
            (pairs, false)
        };
        let mut answers = self.negotiator.respond(stage, &pairs)?;
        if irrelevant_auth {
            answers.push(owned("AuthMethod", "Irrelevant"));
        }

        let agree = match &mut self.phase {
            Phase::Security(sec) => {
                if has(&pairs, "AuthMethod") {
                    *sec = match self.negotiator.auth_method() {
                        None => {
                            return Err(Failure {
                                status: LoginStatus::AUTHENTICATION_FAILURE,
                                data: answers,
                            })
                        }
                        Some("CHAP") => {
                            Security::Chap(Box::new(ChapServer::new(&ChapAlgorithm::ALL)))
                        }
                        Some(_) => Security::Done,
                    };
                }
                if !chap.is_empty() {
                    let Security::Chap(server) = sec else {
                        // CHAP keys without AuthMethod=CHAP agreed.
                        return Err(LoginStatus::INITIATOR_ERROR.into());
                    };
                    let target = self.negotiator.session_params().target_name.as_deref();
                    if server.awaiting_response() {
                        let creds = policy
                            .chap_credentials(target)
                            .ok_or(LoginStatus::AUTHENTICATION_FAILURE)?;
                        let ok = server.verify(&chap, creds).map_err(chap_failure)?;
                        answers.extend(ok.reply);
                        self.auth_user = Some(ok.user);
                        self.authenticated = true;
                        *sec = Security::Done;
                    } else {
                        let a =
                            value(&chap, "CHAP_A").ok_or(LoginStatus::AUTHENTICATION_FAILURE)?;
                        if chap.len() != 1 {
                            return Err(LoginStatus::AUTHENTICATION_FAILURE.into());
                        }
                        let random = self.random.take().ok_or(LoginStatus::TARGET_ERROR)?;
                        let keys = server
                            .challenge(a, random[0], &random[1..])
                            .map_err(chap_failure)?;
                        answers.extend(keys);
                    }
                }
                if req.transit && *sec == Security::Negotiating {
                    // Never named an AuthMethod: the default is None (§12.1), acceptable only
                    // when no authentication is required.
                    if self.auth_required {
                        return Err(LoginStatus::AUTHENTICATION_FAILURE.into());
                    }
                    *sec = Security::Done;
                }
                // While CHAP is under way we do not agree to leave the stage (T=0).
                req.transit && *sec == Security::Done
            }
            _ => req.transit,
        };

        if first {
            // Our declarations (TargetPortalGroupTag, TargetAlias) replace any answer to the
            // same key: an initiator that sent one of these target-only keys was answered
            // Reject by the negotiator, and a key may appear only once in a text (§6.2).
            let extra = std::mem::take(&mut self.first_extra);
            answers.retain(|(k, _)| !extra.iter().any(|(d, _)| d == k));
            answers.extend(extra);
        }
        if agree && req.nsg == Stage::FULL_FEATURE_PHASE {
            answers.extend(self.negotiator.unsent_declarations());
            self.check_fits(&answers)?;
            self.params = Some(self.negotiator.finish()?);
            self.final_text = answers;
            self.phase = Phase::Ready;
            let stat_sn = self.next_stat_sn();
            let s = self.negotiator.session_params();
            return Ok(LoginStep::ReadyToComplete(ReadyToComplete {
                isid: req.isid,
                tsih: req.tsih,
                cid: req.cid,
                initiator_name: s.initiator_name.clone(),
                target_name: s.target_name.clone(),
                session_type: s.session_type,
                tpgt: self.tpgt,
                cmd_sn: req.cmd_sn,
                stat_sn,
                auth_user: self.auth_user.clone(),
            }));
        }
        self.check_fits(&answers)?;
        if agree {
            self.phase = Phase::Operational;
        }
        let nsg = if agree { req.nsg } else { Stage(0) };
        Ok(self.respond(req, agree, nsg, answers))
    }

    /// Checks on the first complete request: who is logging in to what (§6.3, §13.4-§13.5,
    /// §13.21).
    fn identify(
        &mut self,
        pairs: &[(String, String)],
        policy: &dyn LoginPolicy,
    ) -> Result<(), Failure> {
        self.identified = true;
        let initiator = value(pairs, "InitiatorName").ok_or(LoginStatus::MISSING_PARAMETER)?;
        if !valid_iscsi_name(initiator) {
            return Err(NegotiationError::BadInitiatorName.into());
        }
        if let Some(ids) = self.ids.filter(|i| i.tsih != Tsih(0)) {
            if let Some(p) = policy.session_params(ids.tsih, ids.isid, initiator) {
                self.negotiator.set_joining(p);
            }
        }
        let session_type = match value(pairs, "SessionType") {
            None | Some("Normal") => SessionType::Normal,
            Some("Discovery") => SessionType::Discovery,
            Some(other) => {
                return Err(NegotiationError::UnsupportedSessionType(other.to_owned()).into())
            }
        };
        match session_type {
            SessionType::Discovery => {
                if !policy.discovery_allowed(initiator) {
                    return Err(LoginStatus::SESSION_TYPE_NOT_SUPPORTED.into());
                }
            }
            SessionType::Normal => {
                let target = value(pairs, "TargetName").ok_or(LoginStatus::MISSING_PARAMETER)?;
                if !valid_iscsi_name(target) {
                    return Err(NegotiationError::BadTargetName.into());
                }
                match policy.lookup_target(target, initiator) {
                    TargetLookup::Allowed {
                        tpgt,
                        alias,
                        max_connections,
                        error_recovery_level,
                    } => {
                        if let Some(n) = max_connections {
                            self.negotiator.set_max_connections(n);
                        }
                        if let Some(n) = error_recovery_level {
                            self.negotiator.set_error_recovery_level(n);
                        }
                        self.tpgt = Some(tpgt);
                        self.first_extra
                            .push(owned("TargetPortalGroupTag", &tpgt.to_string()));
                        self.negotiator.note_declared("TargetPortalGroupTag");
                        if let Some(alias) = alias {
                            self.first_extra.push(owned("TargetAlias", &alias));
                            self.negotiator.note_declared("TargetAlias");
                        }
                    }
                    TargetLookup::NotFound => return Err(LoginStatus::NOT_FOUND.into()),
                    TargetLookup::Denied => return Err(LoginStatus::AUTHORIZATION_FAILURE.into()),
                    TargetLookup::Moved { address, permanent } => {
                        return Err(Failure {
                            status: if permanent {
                                LoginStatus::TARGET_MOVED_PERMANENTLY
                            } else {
                                LoginStatus::TARGET_MOVED_TEMPORARILY
                            },
                            data: vec![owned("TargetAddress", &address)],
                        })
                    }
                }
            }
        }
        let target = match session_type {
            SessionType::Normal => value(pairs, "TargetName"),
            SessionType::Discovery => None,
        };
        self.auth_required = policy.auth_required(target, initiator);
        self.negotiator.set_auth_methods(if self.auth_required {
            &["CHAP"]
        } else {
            &["None"]
        });
        Ok(())
    }

    fn check_fits(&self, answers: &[(String, String)]) -> Result<(), Failure> {
        let len: usize = answers.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        if len > LOGIN_MAX_DATA_SEGMENT_LENGTH as usize {
            return Err(LoginStatus::INITIATOR_ERROR.into());
        }
        Ok(())
    }

    fn next_stat_sn(&mut self) -> StatSn {
        let sn = self.stat_sn;
        self.stat_sn = sn.next();
        sn
    }

    fn respond(
        &mut self,
        req: &LoginRequest,
        transit: bool,
        nsg: Stage,
        answers: Vec<(String, String)>,
    ) -> LoginStep {
        let rsp = LoginResponse {
            transit,
            cont: false,
            csg: req.csg,
            nsg,
            version_max: 0,
            version_active: 0,
            isid: req.isid,
            tsih: req.tsih,
            itt: req.itt,
            sn: TargetSn {
                stat_sn: self.next_stat_sn(),
                exp_cmd_sn: req.cmd_sn,
                max_cmd_sn: req.cmd_sn,
            },
            status_class: 0,
            status_detail: 0,
        };
        LoginStep::Respond(rsp, text::encode(&answers))
    }

    fn failure(
        &mut self,
        req: Option<&LoginRequest>,
        status: LoginStatus,
        data: &[(String, String)],
    ) -> (LoginResponse, Bytes) {
        self.phase = Phase::Failed;
        let ids = self.ids;
        let (isid, tsih, itt, cmd_sn, csg) = match (req, ids) {
            (Some(r), _) => (r.isid, r.tsih, r.itt, r.cmd_sn, r.csg),
            (None, Some(i)) => (i.isid, i.tsih, i.itt, i.cmd_sn, self.csg),
            (None, None) => Default::default(),
        };
        let rsp = LoginResponse {
            transit: false,
            cont: false,
            csg: Stage(csg.0 & 3),
            nsg: Stage(0),
            version_max: 0,
            version_active: 0,
            isid,
            tsih,
            itt,
            sn: TargetSn {
                stat_sn: self.next_stat_sn(),
                exp_cmd_sn: cmd_sn,
                max_cmd_sn: cmd_sn,
            },
            status_class: status.class(),
            status_detail: status.detail(),
        };
        (rsp, text::encode(data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INITIATOR: &str = "iqn.1993-08.org.debian:01:host";
    const DISK: &str = "iqn.2024-01.com.example:disk";
    const SECRET: &str = "iqn.2024-01.com.example:secret";
    const MOVED: &str = "iqn.2024-01.com.example:moved";
    const NO_DISCOVERY: &str = "iqn.2024-01.com.example:nodisc";

    struct Policy;
    impl LoginPolicy for Policy {
        fn lookup_target(&self, target: &str, _initiator: &str) -> TargetLookup {
            match target {
                DISK => TargetLookup::Allowed {
                    tpgt: 1,
                    alias: Some("disk".into()),
                    max_connections: None,
                    error_recovery_level: None,
                },
                SECRET => TargetLookup::Denied,
                MOVED => TargetLookup::Moved {
                    address: "10.0.0.2:3260,1".into(),
                    permanent: false,
                },
                _ => TargetLookup::NotFound,
            }
        }
        fn discovery_allowed(&self, initiator: &str) -> bool {
            initiator != NO_DISCOVERY
        }
    }

    fn p(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter().map(|(k, v)| owned(k, v)).collect()
    }

    fn req(csg: u8, nsg: u8, transit: bool) -> LoginRequest {
        LoginRequest {
            transit,
            cont: false,
            csg: Stage(csg),
            nsg: Stage(nsg),
            version_max: 0,
            version_min: 0,
            isid: Isid([0x80, 0, 0x23, 0x45, 0, 1]),
            tsih: Tsih(0),
            itt: Itt(0x10),
            cid: Cid(0),
            cmd_sn: CmdSn(100),
            exp_stat_sn: StatSn(7),
        }
    }

    fn hello(target: &str) -> Vec<(String, String)> {
        p(&[
            ("InitiatorName", INITIATOR),
            ("InitiatorAlias", "host"),
            ("TargetName", target),
            ("SessionType", "Normal"),
            ("AuthMethod", "None"),
        ])
    }

    fn operational() -> Vec<(String, String)> {
        p(&[
            ("HeaderDigest", "CRC32C,None"),
            ("DataDigest", "None"),
            ("MaxConnections", "1"),
            ("InitialR2T", "No"),
            ("ImmediateData", "Yes"),
            ("MaxRecvDataSegmentLength", "262144"),
            ("MaxBurstLength", "16776192"),
            ("FirstBurstLength", "262144"),
            ("DefaultTime2Wait", "2"),
            ("DefaultTime2Retain", "0"),
            ("MaxOutstandingR2T", "1"),
            ("DataPDUInOrder", "Yes"),
            ("DataSequenceInOrder", "Yes"),
            ("ErrorRecoveryLevel", "0"),
            ("IFMarker", "No"),
            ("OFMarker", "No"),
        ])
    }

    fn login() -> Login {
        Login::new(TargetDefaults::default())
    }

    fn respond(step: LoginStep) -> (LoginResponse, Vec<(String, String)>) {
        match step {
            LoginStep::Respond(r, d) => (r, text::parse(&d).unwrap()),
            other => panic!("expected Respond, got {other:?}"),
        }
    }

    fn fail_status(step: LoginStep) -> (LoginStatus, Vec<(String, String)>) {
        match step {
            LoginStep::Fail(r, d) => {
                assert!(!r.transit);
                (
                    LoginStatus::new(r.status_class, r.status_detail),
                    text::parse(&d).unwrap(),
                )
            }
            other => panic!("expected Fail, got {other:?}"),
        }
    }

    fn ready(step: LoginStep) -> ReadyToComplete {
        match step {
            LoginStep::ReadyToComplete(r) => r,
            other => panic!("expected ReadyToComplete, got {other:?}"),
        }
    }

    fn get<'a>(pairs: &'a [(String, String)], k: &str) -> Option<&'a str> {
        value(pairs, k)
    }

    /// Fuzz regression (fuzz/fuzz_targets/login.rs): an initiator that sends the target-only
    /// key TargetAlias got it back twice in one response (`TargetAlias=Reject` and our
    /// declaration), which no initiator can parse.
    #[test]
    fn target_only_key_from_the_initiator_is_answered_once() {
        let text = b"InitiatorName=iqn.1993-08.org.debian:01:host\0\
TargetName=iqn.2024-01.com.example:disk\0TargetAlias=Normal\0\
TargetPortalGroupTag=7\0AuthMethod=CHAP,None\0";
        let pairs = text::parse(text).unwrap();
        let mut l = Login::new(TargetDefaults::default());
        match l.step(&req(0, 1, false), pairs, &Policy) {
            LoginStep::Respond(_, d) => {
                let answers = text::parse(&d).expect("one record per key");
                assert_eq!(get(&answers, "TargetAlias"), Some("disk"));
                assert_eq!(get(&answers, "TargetPortalGroupTag"), Some("1"));
            }
            other => panic!("expected Respond, got {other:?}"),
        }
    }

    #[test]
    fn status_codes_match_rfc7143_table() {
        let table = [
            (LoginStatus::SUCCESS, 0x00, 0x00),
            (LoginStatus::TARGET_MOVED_TEMPORARILY, 0x01, 0x01),
            (LoginStatus::TARGET_MOVED_PERMANENTLY, 0x01, 0x02),
            (LoginStatus::INITIATOR_ERROR, 0x02, 0x00),
            (LoginStatus::AUTHENTICATION_FAILURE, 0x02, 0x01),
            (LoginStatus::AUTHORIZATION_FAILURE, 0x02, 0x02),
            (LoginStatus::NOT_FOUND, 0x02, 0x03),
            (LoginStatus::TARGET_REMOVED, 0x02, 0x04),
            (LoginStatus::UNSUPPORTED_VERSION, 0x02, 0x05),
            (LoginStatus::TOO_MANY_CONNECTIONS, 0x02, 0x06),
            (LoginStatus::MISSING_PARAMETER, 0x02, 0x07),
            (LoginStatus::CANT_INCLUDE_IN_SESSION, 0x02, 0x08),
            (LoginStatus::SESSION_TYPE_NOT_SUPPORTED, 0x02, 0x09),
            (LoginStatus::SESSION_DOES_NOT_EXIST, 0x02, 0x0a),
            (LoginStatus::INVALID_DURING_LOGIN, 0x02, 0x0b),
            (LoginStatus::TARGET_ERROR, 0x03, 0x00),
            (LoginStatus::SERVICE_UNAVAILABLE, 0x03, 0x01),
            (LoginStatus::OUT_OF_RESOURCES, 0x03, 0x02),
        ];
        for (s, class, detail) in table {
            assert_eq!((s.class(), s.detail()), (class, detail), "{s:?}");
            assert_eq!(LoginStatus::new(class, detail), s);
            assert_eq!(s.is_success(), class == 0);
        }
    }

    #[test]
    fn security_then_operational_then_full_feature() {
        let mut l = login();
        // 1. Security stage, asking to move to operational.
        let (r, d) = respond(l.step(&req(0, 1, true), hello(DISK), &Policy));
        assert!(r.transit);
        assert_eq!((r.csg, r.nsg), (Stage(0), Stage(1)));
        assert_eq!((r.version_max, r.version_active), (0, 0));
        assert_eq!(r.tsih, Tsih(0));
        assert_eq!(r.itt, Itt(0x10));
        assert_eq!(r.sn.stat_sn, StatSn(7));
        assert_eq!((r.sn.exp_cmd_sn, r.sn.max_cmd_sn), (CmdSn(100), CmdSn(100)));
        assert_eq!(r.status_class, 0);
        assert_eq!(get(&d, "AuthMethod"), Some("None"));
        assert_eq!(get(&d, "TargetPortalGroupTag"), Some("1"));
        assert_eq!(get(&d, "TargetAlias"), Some("disk"));

        // 2. Operational keys, not yet ready to transit.
        let (r, d) = respond(l.step(&req(1, 3, false), operational(), &Policy));
        assert!(!r.transit);
        assert_eq!(r.csg, Stage(1));
        assert_eq!(r.sn.stat_sn, StatSn(8));
        assert_eq!(get(&d, "HeaderDigest"), Some("CRC32C"));
        assert_eq!(get(&d, "MaxBurstLength"), Some("1048576"));
        assert_eq!(get(&d, "FirstBurstLength"), Some("262144"));
        assert_eq!(get(&d, "MaxRecvDataSegmentLength"), Some("262144"));
        assert_eq!(get(&d, "TargetPortalGroupTag"), None);

        // 3. Transit to full-feature phase.
        let info = ready(l.step(&req(1, 3, true), vec![], &Policy));
        assert_eq!(info.tsih, Tsih(0));
        assert_eq!(info.initiator_name, INITIATOR);
        assert_eq!(info.target_name.as_deref(), Some(DISK));
        assert_eq!(info.session_type, SessionType::Normal);
        assert_eq!(info.tpgt, Some(1));
        assert_eq!(info.cmd_sn, CmdSn(100));
        assert_eq!(info.stat_sn, StatSn(9));
        let sn = TargetSn {
            stat_sn: info.stat_sn,
            exp_cmd_sn: CmdSn(100),
            max_cmd_sn: CmdSn(131),
        };
        let (r, d, s, c) = l.complete(Tsih(5), sn);
        assert!(r.transit);
        assert_eq!((r.csg, r.nsg), (Stage(1), Stage(3)));
        assert_eq!(r.tsih, Tsih(5));
        assert_eq!(r.sn, sn);
        // Our MaxRecvDataSegmentLength went out in step 2 already.
        assert!(text::parse(&d).unwrap().is_empty());
        assert_eq!(s.initiator_alias.as_deref(), Some("host"));
        assert_eq!(s.max_burst_length, 1 << 20);
        assert!(!s.initial_r2t);
        assert!(c.header_digest && !c.data_digest);
        assert_eq!(c.max_xmit_data_segment_length, 262_144);
        assert_eq!(c.max_recv_data_segment_length, 262_144);
    }

    #[test]
    fn one_step_login_from_operational_straight_to_full_feature() {
        let mut l = login();
        let mut pairs = hello(DISK);
        pairs.retain(|(k, _)| k != "AuthMethod");
        pairs.extend(p(&[("MaxBurstLength", "65536"), ("ImmediateData", "No")]));
        let info = ready(l.step(&req(1, 3, true), pairs, &Policy));
        assert_eq!(info.stat_sn, StatSn(7));
        let (r, d, s, c) = l.complete(Tsih(1), TargetSn::default());
        let d = text::parse(&d).unwrap();
        assert_eq!(
            d,
            p(&[
                ("MaxBurstLength", "65536"),
                ("ImmediateData", "No"),
                ("TargetPortalGroupTag", "1"),
                ("TargetAlias", "disk"),
                ("MaxRecvDataSegmentLength", "262144"),
            ])
        );
        assert_eq!((r.csg, r.nsg, r.transit), (Stage(1), Stage(3), true));
        assert!(!s.immediate_data);
        // Keys never offered keep their RFC defaults.
        assert!(s.initial_r2t);
        assert_eq!(s.max_outstanding_r2t, 1);
        assert_eq!(c.max_xmit_data_segment_length, 8192);
    }

    #[test]
    fn security_stage_straight_to_full_feature() {
        let mut l = login();
        let info = ready(l.step(&req(0, 3, true), hello(DISK), &Policy));
        assert_eq!(info.tpgt, Some(1));
        let (r, d, _, _) = l.complete(Tsih(2), TargetSn::default());
        assert_eq!(r.csg, Stage(0));
        let d = text::parse(&d).unwrap();
        assert_eq!(get(&d, "AuthMethod"), Some("None"));
        assert_eq!(get(&d, "TargetPortalGroupTag"), Some("1"));
    }

    #[test]
    fn security_stage_waits_until_the_initiator_asks_to_transit() {
        let mut l = login();
        let (r, _) = respond(l.step(&req(0, 1, false), hello(DISK), &Policy));
        assert!(!r.transit);
        assert_eq!(r.csg, Stage(0));
        // Still in security: an operational PDU now is out of sequence.
        let (r, _) = respond(l.step(&req(0, 1, true), vec![], &Policy));
        assert!(r.transit);
        assert_eq!(r.nsg, Stage(1));
        respond(l.step(&req(1, 3, false), vec![], &Policy));
    }

    #[test]
    fn discovery_login_needs_no_target_name() {
        let mut l = login();
        let pairs = p(&[
            ("InitiatorName", INITIATOR),
            ("SessionType", "Discovery"),
            ("AuthMethod", "None"),
        ]);
        let (r, d) = respond(l.step(&req(0, 1, true), pairs, &Policy));
        assert!(r.transit);
        assert_eq!(get(&d, "TargetPortalGroupTag"), None);
        let (_, d) = respond(l.step(
            &req(1, 3, false),
            p(&[("MaxBurstLength", "65536"), ("HeaderDigest", "None")]),
            &Policy,
        ));
        assert_eq!(get(&d, "MaxBurstLength"), Some("Irrelevant"));
        let info = ready(l.step(&req(1, 3, true), vec![], &Policy));
        assert_eq!(info.session_type, SessionType::Discovery);
        assert_eq!(info.target_name, None);
        assert_eq!(info.tpgt, None);
        let (_, d, s, _) = l.complete(Tsih(9), TargetSn::default());
        assert_eq!(s.session_type, SessionType::Discovery);
        assert_eq!(
            text::parse(&d).unwrap(),
            p(&[("MaxRecvDataSegmentLength", "262144")])
        );
    }

    #[test]
    fn discovery_refused_by_policy_is_session_type_not_supported() {
        let pairs = p(&[
            ("InitiatorName", NO_DISCOVERY),
            ("SessionType", "Discovery"),
        ]);
        let (s, _) = fail_status(login().step(&req(0, 1, true), pairs, &Policy));
        assert_eq!(s, LoginStatus::SESSION_TYPE_NOT_SUPPORTED);
    }

    #[test]
    fn unknown_session_type_is_not_supported() {
        let pairs = p(&[("InitiatorName", INITIATOR), ("SessionType", "Bulk")]);
        let (s, _) = fail_status(login().step(&req(0, 1, true), pairs, &Policy));
        assert_eq!(s, LoginStatus::SESSION_TYPE_NOT_SUPPORTED);
    }

    #[test]
    fn unsupported_version_fails_with_0205() {
        let mut r = req(0, 1, true);
        r.version_min = 1;
        r.version_max = 2;
        match login().step(&r, hello(DISK), &Policy) {
            LoginStep::Fail(rsp, _) => {
                assert_eq!((rsp.status_class, rsp.status_detail), (2, 5));
                assert_eq!((rsp.version_max, rsp.version_active), (0, 0));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn missing_initiator_name_fails_with_0207() {
        let pairs = p(&[("TargetName", DISK), ("AuthMethod", "None")]);
        let (s, _) = fail_status(login().step(&req(0, 1, true), pairs, &Policy));
        assert_eq!(s, LoginStatus::MISSING_PARAMETER);
    }

    #[test]
    fn normal_session_without_target_name_fails_with_0207() {
        let pairs = p(&[("InitiatorName", INITIATOR), ("AuthMethod", "None")]);
        let (s, _) = fail_status(login().step(&req(0, 1, true), pairs, &Policy));
        assert_eq!(s, LoginStatus::MISSING_PARAMETER);
    }

    #[test]
    fn malformed_initiator_name_is_an_initiator_error() {
        let pairs = p(&[("InitiatorName", "host1"), ("TargetName", DISK)]);
        let (s, _) = fail_status(login().step(&req(0, 1, true), pairs, &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    #[test]
    fn unknown_target_fails_with_0203() {
        let (s, _) = fail_status(login().step(
            &req(0, 1, true),
            hello("iqn.2024-01.com.example:nope"),
            &Policy,
        ));
        assert_eq!(s, LoginStatus::NOT_FOUND);
        let (s, _) = fail_status(login().step(&req(0, 1, true), hello("nope"), &Policy));
        assert_eq!(s, LoginStatus::NOT_FOUND);
    }

    #[test]
    fn denied_initiator_fails_with_0202() {
        let (s, _) = fail_status(login().step(&req(0, 1, true), hello(SECRET), &Policy));
        assert_eq!(s, LoginStatus::AUTHORIZATION_FAILURE);
    }

    #[test]
    fn moved_target_redirects_with_0101_and_target_address() {
        let (s, d) = fail_status(login().step(&req(0, 1, true), hello(MOVED), &Policy));
        assert_eq!(s, LoginStatus::TARGET_MOVED_TEMPORARILY);
        assert_eq!(d, p(&[("TargetAddress", "10.0.0.2:3260,1")]));
    }

    #[test]
    fn auth_method_without_none_fails_with_0201_and_reject() {
        let mut pairs = hello(DISK);
        pairs.retain(|(k, _)| k != "AuthMethod");
        pairs.push(owned("AuthMethod", "CHAP"));
        let (s, d) = fail_status(login().step(&req(0, 1, true), pairs, &Policy));
        assert_eq!(s, LoginStatus::AUTHENTICATION_FAILURE);
        assert_eq!(get(&d, "AuthMethod"), Some("Reject"));
    }

    #[test]
    fn auth_method_list_containing_none_selects_none() {
        let mut pairs = hello(DISK);
        pairs.retain(|(k, _)| k != "AuthMethod");
        pairs.push(owned("AuthMethod", "CHAP,None"));
        let (r, d) = respond(login().step(&req(0, 1, true), pairs, &Policy));
        assert!(r.transit);
        assert_eq!(get(&d, "AuthMethod"), Some("None"));
    }

    #[test]
    fn chap_keys_without_chap_are_an_initiator_error() {
        let mut pairs = hello(DISK);
        pairs.push(owned("CHAP_A", "5"));
        let (s, _) = fail_status(login().step(&req(0, 1, true), pairs, &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    #[test]
    fn security_keys_in_operational_stage_are_an_initiator_error() {
        let mut l = login();
        respond(l.step(&req(0, 1, true), hello(DISK), &Policy));
        let (s, _) = fail_status(l.step(&req(1, 3, false), p(&[("AuthMethod", "None")]), &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    #[test]
    fn changing_isid_tsih_cid_itt_or_cmdsn_mid_login_is_an_initiator_error() {
        type Change = fn(&mut LoginRequest);
        let changes: [Change; 5] = [
            |r| r.isid.0[5] ^= 1,
            |r| r.tsih = Tsih(3),
            |r| r.cid = Cid(1),
            |r| r.itt = Itt(0x11),
            |r| r.cmd_sn = CmdSn(101),
        ];
        for change in changes {
            let mut l = login();
            respond(l.step(&req(0, 1, true), hello(DISK), &Policy));
            let mut r = req(1, 3, true);
            change(&mut r);
            let (s, _) = fail_status(l.step(&r, vec![], &Policy));
            assert_eq!(s, LoginStatus::INITIATOR_ERROR);
        }
    }

    #[test]
    fn invalid_stage_transitions_are_initiator_errors() {
        // (csg, nsg, transit) of a first request.
        for (csg, nsg) in [(0, 0), (0, 2), (1, 1), (1, 0), (1, 2), (2, 3), (3, 3)] {
            let (s, _) = fail_status(login().step(&req(csg, nsg, true), hello(DISK), &Policy));
            assert_eq!(s, LoginStatus::INITIATOR_ERROR, "{csg}->{nsg}");
        }
        // CSG other than the stage we agreed to.
        let mut l = login();
        respond(l.step(&req(0, 1, true), hello(DISK), &Policy));
        let (s, _) = fail_status(l.step(&req(0, 1, true), vec![], &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
        // Jumping to operational before we agreed.
        let mut l = login();
        respond(l.step(&req(0, 1, false), hello(DISK), &Policy));
        let (s, _) = fail_status(l.step(&req(1, 3, true), vec![], &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    #[test]
    fn continued_request_gets_an_empty_non_transit_response() {
        let mut l = login();
        let mut r = req(0, 1, false);
        r.cont = true;
        let (rsp, d) = respond(l.step(&r, vec![], &Policy));
        assert!(!rsp.transit && !rsp.cont);
        assert!(d.is_empty());
        assert_eq!(rsp.sn.stat_sn, StatSn(7));
        // The final PDU of the request carries the assembled text.
        let (rsp, d) = respond(l.step(&req(0, 1, true), hello(DISK), &Policy));
        assert!(rsp.transit);
        assert_eq!(rsp.sn.stat_sn, StatSn(8));
        assert_eq!(get(&d, "TargetPortalGroupTag"), Some("1"));
    }

    #[test]
    fn continue_and_transit_together_are_an_initiator_error() {
        let mut r = req(0, 1, true);
        r.cont = true;
        let (s, _) = fail_status(login().step(&r, vec![], &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    #[test]
    fn key_negotiated_twice_across_pdus_is_an_initiator_error() {
        let mut l = login();
        respond(l.step(&req(0, 1, true), hello(DISK), &Policy));
        respond(l.step(
            &req(1, 3, false),
            p(&[("MaxBurstLength", "65536")]),
            &Policy,
        ));
        let (s, _) =
            fail_status(l.step(&req(1, 3, false), p(&[("MaxBurstLength", "8192")]), &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    #[test]
    fn bad_max_recv_data_segment_length_fails_the_login() {
        let mut l = login();
        respond(l.step(&req(0, 1, true), hello(DISK), &Policy));
        let (s, _) = fail_status(l.step(
            &req(1, 3, true),
            p(&[("MaxRecvDataSegmentLength", "100")]),
            &Policy,
        ));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    #[test]
    fn answers_that_would_not_fit_one_login_pdu_fail_the_login() {
        let mut l = login();
        respond(l.step(&req(0, 1, true), hello(DISK), &Policy));
        let unknown: Vec<(String, String)> = (0..200)
            .map(|i| owned(&format!("X-com.example.padding-key-{i:03}"), "1"))
            .collect();
        let (s, _) = fail_status(l.step(&req(1, 3, false), unknown, &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    #[test]
    fn text_errors_map_to_initiator_error() {
        let e = text::parse(b"NoEquals\0").unwrap_err();
        assert_eq!(LoginStatus::from(&e), LoginStatus::INITIATOR_ERROR);
        let mut l = login();
        let (rsp, _) = l.fail(&req(0, 1, true), (&e).into());
        assert_eq!((rsp.status_class, rsp.status_detail), (2, 0));
        // A failed login stays failed.
        let (s, _) = fail_status(l.step(&req(0, 1, true), hello(DISK), &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    #[test]
    fn requests_after_ready_are_refused() {
        let mut l = login();
        ready(l.step(&req(1, 3, true), hello_op(), &Policy));
        let (s, _) = fail_status(l.step(&req(1, 3, true), vec![], &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    /// A login that starts in the operational stage but offers AuthMethod=None with the other
    /// keys, as some initiators do: tolerated when no authentication is required (answered
    /// Irrelevant), and only with None among the offer.
    #[test]
    fn auth_method_none_in_the_operational_stage_is_answered_irrelevant() {
        let mut l = login();
        let step = l.step(&req(1, 3, true), hello(DISK), &Policy);
        let LoginStep::ReadyToComplete(_) = step else {
            panic!("{step:?}")
        };
        let (_, data, _, _) = l.complete(Tsih(5), TargetSn::default());
        let text = String::from_utf8_lossy(&data).to_string();
        assert!(text.contains("AuthMethod=Irrelevant"), "{text}");
        let mut l = login();
        let mut pairs = hello_op();
        pairs.push(owned("AuthMethod", "CHAP"));
        let (s, _) = fail_status(l.step(&req(1, 3, true), pairs, &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    fn hello_op() -> Vec<(String, String)> {
        let mut pairs = hello(DISK);
        pairs.retain(|(k, _)| k != "AuthMethod");
        pairs
    }

    #[test]
    fn server_can_reject_a_ready_login_with_registry_statuses() {
        for status in [
            LoginStatus::TOO_MANY_CONNECTIONS,
            LoginStatus::CANT_INCLUDE_IN_SESSION,
            LoginStatus::SESSION_DOES_NOT_EXIST,
            LoginStatus::TARGET_ERROR,
            LoginStatus::SERVICE_UNAVAILABLE,
            LoginStatus::OUT_OF_RESOURCES,
        ] {
            let mut l = login();
            let mut r = req(1, 3, true);
            r.tsih = Tsih(42);
            let info = ready(l.step(&r, hello_op(), &Policy));
            assert_eq!(info.tsih, Tsih(42));
            let (rsp, _) = l.reject(status);
            assert_eq!(
                LoginStatus::new(rsp.status_class, rsp.status_detail),
                status
            );
            assert_eq!(rsp.tsih, Tsih(42));
            assert_eq!(rsp.itt, Itt(0x10));
            assert!(!rsp.transit);
        }
    }

    #[test]
    fn server_can_fail_a_login_for_a_non_login_pdu() {
        let mut l = login();
        respond(l.step(&req(0, 1, true), hello(DISK), &Policy));
        let (rsp, _) = l.fail(&req(1, 3, false), LoginStatus::INVALID_DURING_LOGIN);
        assert_eq!((rsp.status_class, rsp.status_detail), (2, 0x0b));
    }

    #[test]
    fn leading_only_keys_are_irrelevant_when_adding_a_connection() {
        let mut l = login();
        let mut r = req(1, 3, false);
        r.tsih = Tsih(42);
        let mut pairs = hello_op();
        pairs.extend(p(&[
            ("MaxBurstLength", "65536"),
            ("HeaderDigest", "CRC32C"),
        ]));
        let (rsp, d) = respond(l.step(&r, pairs, &Policy));
        assert_eq!(rsp.tsih, Tsih(42));
        assert_eq!(get(&d, "MaxBurstLength"), Some("Irrelevant"));
        assert_eq!(get(&d, "HeaderDigest"), Some("CRC32C"));
    }

    #[test]
    fn endless_login_exchanges_are_bounded() {
        let mut l = login();
        respond(l.step(&req(0, 1, false), hello(DISK), &Policy));
        for _ in 1..MAX_LOGIN_PDUS {
            respond(l.step(&req(0, 1, false), vec![], &Policy));
        }
        let (s, _) = fail_status(l.step(&req(0, 1, false), vec![], &Policy));
        assert_eq!(s, LoginStatus::INITIATOR_ERROR);
    }

    struct Creds;
    impl ChapCredentials for Creds {
        fn initiator_secret(&self, user: &str) -> Option<Vec<u8>> {
            (user == "alice").then(|| b"alice-secret-12".to_vec())
        }
        fn target_credentials(&self) -> Option<(String, Vec<u8>)> {
            Some(("target".into(), b"target-secret-12".to_vec()))
        }
    }

    /// Requires CHAP for DISK.
    struct AuthPolicy;
    impl LoginPolicy for AuthPolicy {
        fn lookup_target(&self, target: &str, initiator: &str) -> TargetLookup {
            Policy.lookup_target(target, initiator)
        }
        fn auth_required(&self, target: Option<&str>, _initiator: &str) -> bool {
            target == Some(DISK)
        }
        fn chap_credentials(&self, _target: Option<&str>) -> Option<&dyn ChapCredentials> {
            Some(&Creds)
        }
    }

    const RANDOM: [u8; CHAP_RANDOM_LEN] = {
        let mut r = [0u8; CHAP_RANDOM_LEN];
        let mut i = 0;
        while i < CHAP_RANDOM_LEN {
            r[i] = (i as u8).wrapping_mul(37).wrapping_add(11);
            i += 1;
        }
        r
    };

    fn chap_login() -> Login {
        let mut l = login();
        l.set_random(RANDOM);
        let mut pairs = hello_op();
        pairs.push(owned("AuthMethod", "CHAP,None"));
        let (r, d) = respond(l.step(&req(0, 1, false), pairs, &AuthPolicy));
        assert!(!r.transit);
        assert_eq!(get(&d, "AuthMethod"), Some("CHAP"));
        let (r, d) = respond(l.step(&req(0, 1, false), p(&[("CHAP_A", "7,5")]), &AuthPolicy));
        assert!(!r.transit);
        assert_eq!(get(&d, "CHAP_A"), Some("7"));
        assert_eq!(get(&d, "CHAP_I"), Some(RANDOM[0].to_string().as_str()));
        assert_eq!(
            get(&d, "CHAP_C"),
            Some(crate::chap::encode_hex(&RANDOM[1..]).as_str())
        );
        l
    }

    fn alice_response() -> String {
        crate::chap::encode_hex(&ChapAlgorithm::Sha256.response(
            RANDOM[0],
            b"alice-secret-12",
            &RANDOM[1..],
        ))
    }

    #[test]
    fn chap_login_authenticates_then_negotiates() {
        let mut l = chap_login();
        let (r, d) = respond(l.step(
            &req(0, 1, true),
            p(&[("CHAP_N", "alice"), ("CHAP_R", &alice_response())]),
            &AuthPolicy,
        ));
        assert!(r.transit);
        assert_eq!(r.nsg, Stage(1));
        assert!(d.is_empty());
        let info = ready(l.step(&req(1, 3, true), vec![], &AuthPolicy));
        assert_eq!(info.auth_user.as_deref(), Some("alice"));
    }

    #[test]
    fn mutual_chap_login_proves_the_target_too() {
        let mut l = chap_login();
        let c: Vec<u8> = (200u8..232).collect();
        let (r, d) = respond(l.step(
            &req(0, 1, true),
            p(&[
                ("CHAP_N", "alice"),
                ("CHAP_R", &alice_response()),
                ("CHAP_I", "9"),
                ("CHAP_C", &crate::chap::encode_hex(&c)),
            ]),
            &AuthPolicy,
        ));
        assert!(r.transit);
        assert_eq!(get(&d, "CHAP_N"), Some("target"));
        let expected = ChapAlgorithm::Sha256.response(9, b"target-secret-12", &c);
        assert_eq!(
            get(&d, "CHAP_R"),
            Some(crate::chap::encode_hex(&expected).as_str())
        );
    }

    #[test]
    fn wrong_chap_response_fails_with_0201() {
        let mut l = chap_login();
        let (s, _) = fail_status(l.step(
            &req(0, 1, true),
            p(&[
                ("CHAP_N", "alice"),
                ("CHAP_R", &format!("0x{}", "00".repeat(32))),
            ]),
            &AuthPolicy,
        ));
        assert_eq!(s, LoginStatus::AUTHENTICATION_FAILURE);
        let mut l = chap_login();
        let (s, _) = fail_status(l.step(
            &req(0, 1, true),
            p(&[("CHAP_N", "mallory"), ("CHAP_R", &alice_response())]),
            &AuthPolicy,
        ));
        assert_eq!(s, LoginStatus::AUTHENTICATION_FAILURE);
    }

    #[test]
    fn transit_is_refused_while_chap_is_under_way() {
        let mut l = login();
        l.set_random(RANDOM);
        let mut pairs = hello_op();
        pairs.push(owned("AuthMethod", "CHAP"));
        let (r, _) = respond(l.step(&req(0, 1, true), pairs, &AuthPolicy));
        assert!(!r.transit);
        let (r, _) = respond(l.step(&req(0, 1, true), p(&[("CHAP_A", "5")]), &AuthPolicy));
        assert!(!r.transit);
    }

    #[test]
    fn required_authentication_refuses_auth_method_none() {
        let mut pairs = hello_op();
        pairs.push(owned("AuthMethod", "None"));
        let (s, d) = fail_status(login().step(&req(0, 1, true), pairs, &AuthPolicy));
        assert_eq!(s, LoginStatus::AUTHENTICATION_FAILURE);
        assert_eq!(get(&d, "AuthMethod"), Some("Reject"));
    }

    #[test]
    fn required_authentication_cannot_be_skipped() {
        // Starting in the operational stage.
        let (s, _) = fail_status(login().step(&req(1, 3, true), hello_op(), &AuthPolicy));
        assert_eq!(s, LoginStatus::AUTHENTICATION_FAILURE);
        // Asking to leave the security stage without naming an AuthMethod.
        let (s, _) = fail_status(login().step(&req(0, 3, true), hello_op(), &AuthPolicy));
        assert_eq!(s, LoginStatus::AUTHENTICATION_FAILURE);
    }

    #[test]
    fn chap_response_before_challenge_fails() {
        let mut l = login();
        l.set_random(RANDOM);
        let mut pairs = hello_op();
        pairs.push(owned("AuthMethod", "CHAP"));
        respond(l.step(&req(0, 1, false), pairs, &AuthPolicy));
        let (s, _) = fail_status(l.step(
            &req(0, 1, true),
            p(&[("CHAP_N", "alice"), ("CHAP_R", "0x00")]),
            &AuthPolicy,
        ));
        assert_eq!(s, LoginStatus::AUTHENTICATION_FAILURE);
    }

    #[test]
    fn chap_without_caller_randomness_is_a_target_error() {
        let mut l = login();
        let mut pairs = hello_op();
        pairs.push(owned("AuthMethod", "CHAP"));
        respond(l.step(&req(0, 1, false), pairs, &AuthPolicy));
        let (s, _) = fail_status(l.step(&req(0, 1, false), p(&[("CHAP_A", "5")]), &AuthPolicy));
        assert_eq!(s, LoginStatus::TARGET_ERROR);
    }
}
