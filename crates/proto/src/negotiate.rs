//! Table-driven operational key negotiation (RFC 7143 §6.2, §13), target side.
//!
//! Every key of §13 is one [`KeyDef`] row in [`KEYS`]: scope, where it may be used, who may send
//! it, the result function, range and RFC default. [`Negotiator`] answers what the initiator
//! offers during login and remembers the outcome; [`Negotiator::respond_full_feature`] handles
//! the few keys a Text Request may carry in full-feature phase.
//!
//! Decisions (see also the `login` module):
//! * We only ever *answer* and *declare*; we never originate a negotiated key, so a key the
//!   initiator never offers takes its RFC default (not our preference). Linux, Windows, ESXi and
//!   libiscsi offer every key that matters. Consequence: a configuration more restrictive than
//!   an RFC default (ImmediateData=No, FirstBurstLength < 65536, MaxBurstLength < 262144) only
//!   holds when the initiator offers the key; the server must accept the RFC default otherwise.
//! * An offer outside the key's range, or not of its form, is answered `Reject` and the key keeps
//!   its current value (§6.2: "If the acceptor sends Reject ... the negotiated key is left at its
//!   current value"). The login fails instead (status 0200) for what the RFC calls a protocol
//!   error or what we cannot honour: a key offered twice (§6.2: "MUST respond with a Login reject
//!   (initiator error)"), a reserved constant (`Reject`, `Irrelevant`, `NotUnderstood`) used as
//!   an offer, a bad MaxRecvDataSegmentLength declaration (we could not know how much we may
//!   send), a security key outside the security stage.
//! * Operational keys are accepted in the security stage too (answered at once). RFC 7143 §6.3
//!   expects them after security negotiation; no initiator we know sends them early, and
//!   refusing them would fail logins for no safety gain (nothing takes effect before the login
//!   succeeds). LIO is stricter here.
//! * Unknown keys, including `X-` private and `X#` public extension keys, get `NotUnderstood`.
//! * Keys only the target sends (TargetAlias, TargetAddress, TargetPortalGroupTag) and
//!   full-feature-only keys (SendTargets) offered during login get `Reject`.
//! * Leading-only keys on a non-leading connection, and the data-transfer keys in a Discovery
//!   session, get `Irrelevant`.
//! * OFMarker/IFMarker (obsoleted by RFC 7143, result AND) are answered `No`; OFMarkInt/IFMarkInt
//!   `Irrelevant`, as for markers that are off.
//! * FirstBurstLength never exceeds MaxBurstLength (§13.14): within one request MaxBurstLength is
//!   negotiated first and bounds the FirstBurstLength answer; a MaxBurstLength offered later below
//!   the agreed FirstBurstLength is answered `Reject`.

use crate::pdu::Stage;

/// MaxRecvDataSegmentLength while logging in, and the RFC default (RFC 7143 §13.12).
pub const DEFAULT_MAX_RECV_DATA_SEGMENT_LENGTH: u32 = 8192;
/// Smallest MaxRecvDataSegmentLength / MaxBurstLength / FirstBurstLength (§13.12-§13.14).
pub const MIN_DATA_SEGMENT_LENGTH: u32 = 512;
/// Largest of those three (2^24 - 1).
pub const MAX_DATA_SEGMENT_LENGTH: u32 = (1 << 24) - 1;
/// Longest iSCSI name (RFC 7143 §4.2.7.1: 223 bytes).
pub const MAX_ISCSI_NAME_LEN: usize = 223;
/// The iSCSIProtocolLevel we implement (RFC 7144 §2.1: 1 = RFC 7143).
pub const PROTOCOL_LEVEL: u64 = 1;

/// The reserved answer constants (RFC 7143 §6.2).
pub const REJECT: &str = "Reject";
pub const IRRELEVANT: &str = "Irrelevant";
pub const NOT_UNDERSTOOD: &str = "NotUnderstood";

/// Who may send a key (the "Senders" line of each §13 key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sender {
    Initiator,
    Target,
    Both,
}

/// Where a key may be used (the "Use" line of §13, plus the security stage of §12).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyUse {
    /// LO: only in the login of the session's leading connection.
    LeadingOnly,
    /// IO: only in the login of any connection.
    InitializeOnly,
    /// FFPO: only in full-feature phase.
    FullFeatureOnly,
    /// ALL: login and full-feature phase.
    All,
    /// Security negotiation stage only (§12).
    Security,
}

/// Scope of the outcome (§13: SW = session-wide, CO = connection-only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Session,
    Connection,
}

/// Result function (§6.2.1, §6.2.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Numerical, result is the smaller offer.
    Min,
    /// Numerical, result is the larger offer.
    Max,
    /// Boolean OR.
    Or,
    /// Boolean AND.
    And,
    /// List: the acceptor picks the first value of the offer it supports.
    List,
    /// Declarative: no negotiation, the sender states its value.
    Declarative,
    /// Obsoleted marker intervals: always `Irrelevant`.
    MarkerInterval,
}

/// One row of the key table.
#[derive(Clone, Copy, Debug)]
pub struct KeyDef {
    pub name: &'static str,
    /// RFC 7143 section.
    pub section: &'static str,
    pub scope: Scope,
    pub key_use: KeyUse,
    pub sender: Sender,
    pub rule: Rule,
    /// Numerical range (ignored for non-numerical rules).
    pub min: u64,
    pub max: u64,
    pub default: &'static str,
    /// "Irrelevant when: SessionType=Discovery".
    pub irrelevant_in_discovery: bool,
}

#[allow(clippy::too_many_arguments)]
const fn key(
    name: &'static str,
    section: &'static str,
    scope: Scope,
    key_use: KeyUse,
    sender: Sender,
    rule: Rule,
    range: (u64, u64),
    default: &'static str,
    irrelevant_in_discovery: bool,
) -> KeyDef {
    KeyDef {
        name,
        section,
        scope,
        key_use,
        sender,
        rule,
        min: range.0,
        max: range.1,
        default,
        irrelevant_in_discovery,
    }
}

use KeyUse::{All, FullFeatureOnly as Ffpo, InitializeOnly as Io, LeadingOnly as Lo, Security};
use Rule::{And, Declarative, List, MarkerInterval, Max, Min, Or};
use Scope::{Connection as Co, Session as Sw};
use Sender::{Both, Initiator, Target};

const NONE: (u64, u64) = (0, 0);
const SEG: (u64, u64) = (
    MIN_DATA_SEGMENT_LENGTH as u64,
    MAX_DATA_SEGMENT_LENGTH as u64,
);

/// Every key of RFC 7143 §12-§13 (and iSCSIProtocolLevel, RFC 7144).
#[rustfmt::skip]
pub static KEYS: &[KeyDef] = &[
    key("AuthMethod", "12.1", Co, Security, Both, List, NONE, "None", false),
    key("HeaderDigest", "13.1", Co, Io, Both, List, NONE, "None", false),
    key("DataDigest", "13.1", Co, Io, Both, List, NONE, "None", false),
    key("MaxConnections", "13.2", Sw, Lo, Both, Min, (1, 65535), "1", true),
    key("SendTargets", "13.3", Sw, Ffpo, Initiator, Declarative, NONE, "", false),
    key("TargetName", "13.4", Sw, Io, Both, Declarative, NONE, "", false),
    key("InitiatorName", "13.5", Sw, Io, Initiator, Declarative, NONE, "", false),
    key("TargetAlias", "13.6", Sw, All, Target, Declarative, NONE, "", false),
    key("InitiatorAlias", "13.7", Sw, All, Initiator, Declarative, NONE, "", false),
    key("TargetAddress", "13.8", Sw, All, Target, Declarative, NONE, "", false),
    key("TargetPortalGroupTag", "13.9", Sw, Io, Target, Declarative, (0, 65535), "", false),
    key("InitialR2T", "13.10", Sw, Lo, Both, Or, NONE, "Yes", true),
    key("ImmediateData", "13.11", Sw, Lo, Both, And, NONE, "Yes", true),
    key("MaxRecvDataSegmentLength", "13.12", Co, All, Both, Declarative, SEG, "8192", false),
    key("MaxBurstLength", "13.13", Sw, Lo, Both, Min, SEG, "262144", true),
    key("FirstBurstLength", "13.14", Sw, Lo, Both, Min, SEG, "65536", true),
    key("DefaultTime2Wait", "13.15", Sw, Lo, Both, Max, (0, 3600), "2", false),
    key("DefaultTime2Retain", "13.16", Sw, Lo, Both, Min, (0, 3600), "20", false),
    key("MaxOutstandingR2T", "13.17", Sw, Lo, Both, Min, (1, 65535), "1", true),
    key("DataPDUInOrder", "13.18", Sw, Lo, Both, Or, NONE, "Yes", true),
    key("DataSequenceInOrder", "13.19", Sw, Lo, Both, Or, NONE, "Yes", true),
    key("ErrorRecoveryLevel", "13.20", Sw, Lo, Both, Min, (0, 2), "0", false),
    key("SessionType", "13.21", Sw, Lo, Initiator, Declarative, NONE, "Normal", false),
    key("TaskReporting", "13.23", Sw, Lo, Both, List, NONE, "RFC3720", true),
    key("iSCSIProtocolLevel", "13.24", Sw, Lo, Both, Min, (0, 31), "1", false),
    // Markers: obsoleted by RFC 7143 (defined in RFC 3720 §12.17-12.18).
    key("OFMarker", "3720 12.17", Co, Io, Both, And, NONE, "No", false),
    key("IFMarker", "3720 12.17", Co, Io, Both, And, NONE, "No", false),
    key("OFMarkInt", "3720 12.18", Co, Io, Both, MarkerInterval, NONE, "2048~2048", false),
    key("IFMarkInt", "3720 12.18", Co, Io, Both, MarkerInterval, NONE, "2048~2048", false),
];

/// The CHAP keys (RFC 7143 §12.1.3), handled by the login's security stage, not by this table.
pub const CHAP_KEYS: &[&str] = &["CHAP_A", "CHAP_I", "CHAP_C", "CHAP_N", "CHAP_R"];

/// A session's value of a leading-only key, as an answer to `offer` in a non-leading login:
/// `Some` when negotiating `offer` against it gives it back (so the answer is a valid result
/// of the key's function), else `None`.
fn value_in_effect(def: &KeyDef, offer: &str, s: &SessionParams) -> Option<String> {
    match def.rule {
        Rule::Min | Rule::Max => {
            let cur: u64 = match def.name {
                "MaxConnections" => s.max_connections.into(),
                "MaxBurstLength" => s.max_burst_length.into(),
                "FirstBurstLength" => s.first_burst_length.into(),
                "DefaultTime2Wait" => s.default_time2wait.into(),
                "DefaultTime2Retain" => s.default_time2retain.into(),
                "MaxOutstandingR2T" => s.max_outstanding_r2t.into(),
                "ErrorRecoveryLevel" => s.error_recovery_level.into(),
                _ => return None,
            };
            let offer = parse_number(offer).filter(|n| (def.min..=def.max).contains(n))?;
            let result = if def.rule == Rule::Min {
                offer.min(cur)
            } else {
                offer.max(cur)
            };
            (result == cur).then(|| cur.to_string())
        }
        Rule::Or | Rule::And => {
            let cur = match def.name {
                "InitialR2T" => s.initial_r2t,
                "ImmediateData" => s.immediate_data,
                "DataPDUInOrder" => s.data_pdu_in_order,
                "DataSequenceInOrder" => s.data_sequence_in_order,
                _ => return None,
            };
            let offer = parse_bool(offer)?;
            let result = if def.rule == Rule::Or {
                offer || cur
            } else {
                offer && cur
            };
            (result == cur).then(|| yes_no(cur).to_owned())
        }
        _ => None,
    }
}

/// Look a key up in [`KEYS`].
pub fn key_def(name: &str) -> Option<&'static KeyDef> {
    KEYS.iter().find(|k| k.name == name)
}

/// True for keys that belong to the security negotiation stage (AuthMethod and CHAP_*).
pub fn is_security_key(name: &str) -> bool {
    name == "AuthMethod" || CHAP_KEYS.contains(&name)
}

/// What this target prefers; the negotiated outcome never exceeds these in the direction each
/// key's result function allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetDefaults {
    /// What we accept per PDU; declared to the initiator.
    pub max_recv_data_segment_length: u32,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub max_outstanding_r2t: u32,
    pub max_connections: u16,
    /// false: we prefer unsolicited data (InitialR2T=No).
    pub initial_r2t: bool,
    pub immediate_data: bool,
    /// We accept CRC32C header digests (the initiator's order decides).
    pub header_digest: bool,
    /// We accept CRC32C data digests.
    pub data_digest: bool,
    pub default_time2wait: u16,
    pub default_time2retain: u16,
    pub error_recovery_level: u8,
    pub data_pdu_in_order: bool,
    pub data_sequence_in_order: bool,
}

impl Default for TargetDefaults {
    fn default() -> Self {
        TargetDefaults {
            max_recv_data_segment_length: 262_144,
            max_burst_length: 1 << 20,
            // What open-iscsi, libiscsi and VMware offer, and our MaxRecvDataSegmentLength: a
            // write of up to 256 KiB then goes in one PDU with no R2T round trip (at 64 KiB,
            // the RFC default, a 128 KiB write at QD1 took 1.6x as long; docs/PERFORMANCE.md).
            // Memory stays bounded by `write_buffer_per_session` (TASK SET FULL past it).
            first_burst_length: 262_144,
            max_outstanding_r2t: 16,
            // Several connections per session (MC/S), as LIO and istgt offer; per target in
            // the configuration.
            max_connections: 4,
            initial_r2t: false,
            immediate_data: true,
            header_digest: true,
            data_digest: true,
            default_time2wait: 2,
            default_time2retain: 20,
            error_recovery_level: MAX_ERROR_RECOVERY_LEVEL,
            data_pdu_in_order: true,
            data_sequence_in_order: true,
        }
    }
}

/// The highest ErrorRecoveryLevel (RFC 7143 §13.20) this target implements: 2, recovery
/// within a command and within a connection (level 1, §7.1.5, §7.2: recovery R2Ts, dropped
/// PDUs, SNACKs) and connection recovery (level 2, §7.2.2: tasks of a failed connection kept
/// for TASK REASSIGN, logout for recovery).
pub const MAX_ERROR_RECOVERY_LEVEL: u8 = 2;

impl TargetDefaults {
    /// Bring every value into its RFC range and FirstBurstLength under MaxBurstLength, so that no
    /// answer built from these can be out of range.
    pub fn sanitized(&self) -> TargetDefaults {
        let seg = |v: u32| v.clamp(MIN_DATA_SEGMENT_LENGTH, MAX_DATA_SEGMENT_LENGTH);
        let max_burst_length = seg(self.max_burst_length);
        TargetDefaults {
            max_recv_data_segment_length: seg(self.max_recv_data_segment_length),
            max_burst_length,
            first_burst_length: seg(self.first_burst_length).min(max_burst_length),
            max_outstanding_r2t: self.max_outstanding_r2t.clamp(1, 65535),
            max_connections: self.max_connections.max(1),
            default_time2wait: self.default_time2wait.min(3600),
            default_time2retain: self.default_time2retain.min(3600),
            error_recovery_level: self.error_recovery_level.min(MAX_ERROR_RECOVERY_LEVEL),
            ..self.clone()
        }
    }
}

/// Session type (RFC 7143 §13.21).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SessionType {
    #[default]
    Normal,
    Discovery,
}

impl SessionType {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionType::Normal => "Normal",
            SessionType::Discovery => "Discovery",
        }
    }
}

/// Session-wide outcome of a login. Starts at the RFC defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionParams {
    pub initiator_name: String,
    pub initiator_alias: Option<String>,
    pub target_name: Option<String>,
    pub session_type: SessionType,
    pub max_connections: u16,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub default_time2wait: u16,
    pub default_time2retain: u16,
    pub max_outstanding_r2t: u32,
    pub data_pdu_in_order: bool,
    pub data_sequence_in_order: bool,
    pub error_recovery_level: u8,
}

impl Default for SessionParams {
    /// The RFC 7143 §13 defaults.
    fn default() -> Self {
        SessionParams {
            initiator_name: String::new(),
            initiator_alias: None,
            target_name: None,
            session_type: SessionType::Normal,
            max_connections: 1,
            initial_r2t: true,
            immediate_data: true,
            max_burst_length: 262_144,
            first_burst_length: 65_536,
            default_time2wait: 2,
            default_time2retain: 20,
            max_outstanding_r2t: 1,
            data_pdu_in_order: true,
            data_sequence_in_order: true,
            error_recovery_level: 0,
        }
    }
}

/// Connection-only outcome of a login.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnParams {
    pub header_digest: bool,
    pub data_digest: bool,
    /// What we may send in one PDU (the initiator's declared MaxRecvDataSegmentLength; RFC
    /// default 8192 if it never says).
    pub max_xmit_data_segment_length: u32,
    /// What we accept (our declared MaxRecvDataSegmentLength; 8192 until we declare it).
    pub max_recv_data_segment_length: u32,
}

impl Default for ConnParams {
    fn default() -> Self {
        ConnParams {
            header_digest: false,
            data_digest: false,
            max_xmit_data_segment_length: DEFAULT_MAX_RECV_DATA_SEGMENT_LENGTH,
            max_recv_data_segment_length: DEFAULT_MAX_RECV_DATA_SEGMENT_LENGTH,
        }
    }
}

/// A negotiation the login cannot survive. Every variant is the initiator's fault; `login`
/// turns each into a status (RFC 7143 §11.13.5), given in parentheses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NegotiationError {
    /// §6.2: a key negotiated or declared twice in one login (status 0200).
    #[error("key {0} was already negotiated in this login")]
    Renegotiated(String),
    /// §6.2: Reject / Irrelevant / NotUnderstood used as an offer (status 0200).
    #[error("reserved value {value} offered for {key}")]
    ReservedValue { key: String, value: String },
    /// A declaration we cannot honour, e.g. MaxRecvDataSegmentLength outside 512..2^24-1 (status 0200).
    #[error("invalid declaration {key}={value}")]
    InvalidDeclaration { key: String, value: String },
    /// AuthMethod or CHAP_* outside the security stage (status 0200).
    #[error("security key {0} outside the security negotiation stage")]
    SecurityKeyOutOfStage(String),
    /// InitiatorName that is not an iSCSI name (§4.2.7) (status 0200).
    #[error("malformed InitiatorName")]
    BadInitiatorName,
    /// TargetName that is not an iSCSI name: it cannot name any target (status 0203).
    #[error("malformed TargetName")]
    BadTargetName,
    /// SessionType other than Normal / Discovery (status 0209).
    #[error("unsupported SessionType {0}")]
    UnsupportedSessionType(String),
    /// finish() without an InitiatorName (status 0207).
    #[error("InitiatorName missing")]
    MissingInitiatorName,
}

/// Is `s` a well-formed iSCSI name (RFC 7143 §4.2.7): `iqn.`, `eui.` (16 hex digits) or `naa.`
/// (16 or 32 hex digits), at most 223 bytes, no whitespace or control characters. Case is not
/// checked (names compare case-insensitively after normalisation).
pub fn valid_iscsi_name(s: &str) -> bool {
    if s.is_empty() || s.len() > MAX_ISCSI_NAME_LEN {
        return false;
    }
    if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return false;
    }
    let lower = s.to_ascii_lowercase();
    let hex = |t: &str| t.bytes().all(|b| b.is_ascii_hexdigit());
    if let Some(rest) = lower.strip_prefix("iqn.") {
        !rest.is_empty()
    } else if let Some(rest) = lower.strip_prefix("eui.") {
        rest.len() == 16 && hex(rest)
    } else if let Some(rest) = lower.strip_prefix("naa.") {
        (rest.len() == 16 || rest.len() == 32) && hex(rest)
    } else {
        false
    }
}

/// Parse a numerical-value (§6.1: decimal-constant or hex-constant, < 2^64).
pub fn parse_number(v: &str) -> Option<u64> {
    if let Some(hex) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        if hex.is_empty() || hex.len() > 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(hex, 16).ok()
    } else {
        if v.is_empty() || v.len() > 20 || !v.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        v.parse().ok()
    }
}

fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "Yes"
    } else {
        "No"
    }
}

fn is_reserved(v: &str) -> bool {
    v == REJECT || v == IRRELEVANT || v == NOT_UNDERSTOOD
}

/// What a full-feature Text Request asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FullFeatureResponse {
    /// Our answers, in the order of the request.
    pub pairs: Vec<(String, String)>,
    /// `SendTargets=<value>` was asked (§13.3): the server appends the target list.
    pub send_targets: Option<String>,
    /// The initiator declared a new MaxRecvDataSegmentLength: what we may send from now on (it
    /// takes effect once this text exchange completes).
    pub max_xmit_data_segment_length: Option<u32>,
}

/// Negotiates one login (and, afterwards, full-feature Text keys) for one connection.
#[derive(Clone, Debug)]
pub struct Negotiator {
    defaults: TargetDefaults,
    auth_methods: Vec<String>,
    auth_method: Option<String>,
    leading: bool,
    /// The session a non-leading login joins: its leading-only keys are answered with the
    /// values in effect where those are a valid answer to the offer.
    joining: Option<SessionParams>,
    /// Keys the initiator has sent in this login.
    seen: Vec<String>,
    /// Keys we have declared in this login.
    declared: Vec<&'static str>,
    session: SessionParams,
    conn: ConnParams,
    /// FirstBurstLength was explicitly agreed (so a later, smaller MaxBurstLength must not
    /// undercut it).
    first_burst_agreed: bool,
}

impl Negotiator {
    pub fn new(defaults: &TargetDefaults) -> Self {
        Negotiator {
            defaults: defaults.sanitized(),
            auth_methods: vec!["None".to_owned()],
            auth_method: None,
            leading: true,
            joining: None,
            seen: Vec::new(),
            declared: Vec::new(),
            session: SessionParams::default(),
            conn: ConnParams::default(),
            first_burst_agreed: false,
        }
    }

    /// The AuthMethod values we accept, in no particular order (the initiator's order decides).
    /// Defaults to `["None"]`.
    pub fn set_auth_methods<S: AsRef<str>>(&mut self, methods: &[S]) {
        self.auth_methods = methods.iter().map(|m| m.as_ref().to_owned()).collect();
    }

    /// The AuthMethod agreed in the security stage, if one was.
    pub fn auth_method(&self) -> Option<&str> {
        self.auth_method.as_deref()
    }

    /// The most connections we allow a session (MaxConnections, §13.2), for a target whose
    /// setting differs from the defaults'.
    pub fn set_max_connections(&mut self, n: u16) {
        self.defaults.max_connections = n.max(1);
    }

    /// The highest ErrorRecoveryLevel we agree to (§13.20), for a target whose setting differs
    /// from the defaults'; capped at [`MAX_ERROR_RECOVERY_LEVEL`].
    pub fn set_error_recovery_level(&mut self, n: u8) {
        self.defaults.error_recovery_level = n.min(MAX_ERROR_RECOVERY_LEVEL);
    }

    /// The session this non-leading login adds a connection to (see [`Negotiator::set_leading`]).
    pub fn set_joining(&mut self, session: SessionParams) {
        self.joining = Some(session);
    }

    /// Whether this connection leads a new session (TSIH 0). Leading-only keys on other
    /// connections are answered `Irrelevant`.
    pub fn set_leading(&mut self, leading: bool) {
        self.leading = leading;
    }

    /// The session parameters as negotiated so far.
    pub fn session_params(&self) -> &SessionParams {
        &self.session
    }

    /// The connection parameters as negotiated so far.
    pub fn conn_params(&self) -> &ConnParams {
        &self.conn
    }

    /// Whether the initiator sent `key` in this login.
    pub fn was_sent(&self, key: &str) -> bool {
        self.seen.iter().any(|k| k == key)
    }

    /// Answer one complete set of key=value pairs the initiator sent in `stage`. Answers come in
    /// the order of the request; declarations need no answer and get none (except that we
    /// declare our own MaxRecvDataSegmentLength alongside the initiator's). CHAP_* keys are not
    /// handled here: the login's security stage takes them out first.
    pub fn respond(
        &mut self,
        stage: Stage,
        pairs: &[(String, String)],
    ) -> Result<Vec<(String, String)>, NegotiationError> {
        // SessionType first (it decides what is irrelevant), MaxBurstLength before
        // FirstBurstLength (it bounds it), ErrorRecoveryLevel before MaxOutstandingR2T (above
        // level 0 it makes the answer 1); answers still go out in request order.
        let rank = |k: &str| match k {
            "SessionType" => 0,
            "MaxBurstLength" | "ErrorRecoveryLevel" => 1,
            _ => 2,
        };
        let mut order: Vec<usize> = (0..pairs.len()).collect();
        order.sort_by_key(|&i| rank(&pairs[i].0));
        let mut answers: Vec<Option<String>> = vec![None; pairs.len()];
        for i in order {
            let (k, v) = &pairs[i];
            answers[i] = self.answer(stage, k, v)?;
        }
        Ok(pairs
            .iter()
            .zip(answers)
            .filter_map(|((k, _), a)| a.map(|a| (k.clone(), a)))
            .collect())
    }

    fn answer(
        &mut self,
        stage: Stage,
        k: &str,
        v: &str,
    ) -> Result<Option<String>, NegotiationError> {
        let def = key_def(k);
        if is_reserved(v) {
            // An answer to one of our declarations (e.g. TargetAlias=NotUnderstood) is fine.
            if def.is_some_and(|d| self.declared.contains(&d.name)) {
                return Ok(None);
            }
            return Err(NegotiationError::ReservedValue {
                key: k.to_owned(),
                value: v.to_owned(),
            });
        }
        if self.was_sent(k) {
            return Err(NegotiationError::Renegotiated(k.to_owned()));
        }
        self.seen.push(k.to_owned());
        if is_security_key(k) && stage != Stage::SECURITY_NEGOTIATION {
            return Err(NegotiationError::SecurityKeyOutOfStage(k.to_owned()));
        }
        let Some(def) = def else {
            return Ok(Some(NOT_UNDERSTOOD.to_owned()));
        };
        if def.sender == Sender::Target || def.key_use == KeyUse::FullFeatureOnly {
            return Ok(Some(REJECT.to_owned()));
        }
        if def.key_use == KeyUse::LeadingOnly && !self.leading {
            // The RFC says only that these keys belong to the leading login (§13). Answering
            // the session's value, where that is what the negotiation would give for this
            // offer, tells the initiator what is in effect and satisfies initiators that
            // check every answer; otherwise Irrelevant. Nothing of the session changes.
            let in_effect = self
                .joining
                .as_ref()
                .and_then(|s| value_in_effect(def, v, s));
            return Ok(Some(in_effect.unwrap_or_else(|| IRRELEVANT.to_owned())));
        }
        if def.irrelevant_in_discovery && self.session.session_type == SessionType::Discovery {
            return Ok(Some(IRRELEVANT.to_owned()));
        }
        let d = &self.defaults;
        let answer = match def.rule {
            Rule::Declarative => return self.declare(def, v),
            Rule::MarkerInterval => IRRELEVANT.to_owned(),
            Rule::Min | Rule::Max => {
                let Some(offer) = parse_number(v).filter(|n| (def.min..=def.max).contains(n))
                else {
                    return Ok(Some(REJECT.to_owned()));
                };
                let pick = |ours: u64| {
                    if def.rule == Rule::Min {
                        offer.min(ours)
                    } else {
                        offer.max(ours)
                    }
                };
                let s = &mut self.session;
                let n = match def.name {
                    "MaxConnections" => {
                        let n = pick(d.max_connections.into());
                        s.max_connections = n as u16;
                        n
                    }
                    "MaxBurstLength" => {
                        let n = pick(d.max_burst_length.into());
                        if self.first_burst_agreed && n < u64::from(s.first_burst_length) {
                            return Ok(Some(REJECT.to_owned()));
                        }
                        s.max_burst_length = n as u32;
                        n
                    }
                    "FirstBurstLength" => {
                        let n = pick(d.first_burst_length.into()).min(s.max_burst_length.into());
                        s.first_burst_length = n as u32;
                        self.first_burst_agreed = true;
                        n
                    }
                    "DefaultTime2Wait" => {
                        let n = pick(d.default_time2wait.into());
                        s.default_time2wait = n as u16;
                        n
                    }
                    "DefaultTime2Retain" => {
                        let n = pick(d.default_time2retain.into());
                        s.default_time2retain = n as u16;
                        n
                    }
                    "MaxOutstandingR2T" => {
                        // §13.19: with DataSequenceInOrder=Yes (always, for us) and
                        // ErrorRecoveryLevel above 0, MaxOutstandingR2T must be 1 (only the
                        // last R2T can be recovered).
                        let ours = if s.error_recovery_level > 0 {
                            1
                        } else {
                            d.max_outstanding_r2t
                        };
                        let n = pick(ours.into());
                        s.max_outstanding_r2t = n as u32;
                        n
                    }
                    "ErrorRecoveryLevel" => {
                        // A MaxOutstandingR2T above 1 agreed in an earlier request rules out
                        // recovery (§13.19): level 0.
                        let ours = if s.max_outstanding_r2t > 1 {
                            0
                        } else {
                            d.error_recovery_level
                        };
                        let n = pick(ours.into());
                        s.error_recovery_level = n as u8;
                        n
                    }
                    "iSCSIProtocolLevel" => pick(PROTOCOL_LEVEL),
                    other => unreachable!("numerical key {other} without a field"),
                };
                n.to_string()
            }
            Rule::Or | Rule::And => {
                let Some(offer) = parse_bool(v) else {
                    return Ok(Some(REJECT.to_owned()));
                };
                let combine = |ours: bool| {
                    if def.rule == Rule::Or {
                        offer || ours
                    } else {
                        offer && ours
                    }
                };
                let s = &mut self.session;
                let b = match def.name {
                    "InitialR2T" => {
                        s.initial_r2t = combine(d.initial_r2t);
                        s.initial_r2t
                    }
                    "ImmediateData" => {
                        s.immediate_data = combine(d.immediate_data);
                        s.immediate_data
                    }
                    "DataPDUInOrder" => {
                        s.data_pdu_in_order = combine(d.data_pdu_in_order);
                        s.data_pdu_in_order
                    }
                    "DataSequenceInOrder" => {
                        s.data_sequence_in_order = combine(d.data_sequence_in_order);
                        s.data_sequence_in_order
                    }
                    // Markers are gone from RFC 7143: we never use them.
                    "OFMarker" | "IFMarker" => combine(false),
                    other => unreachable!("boolean key {other} without a field"),
                };
                yes_no(b).to_owned()
            }
            Rule::List => {
                let supported: &[&str] = match def.name {
                    "HeaderDigest" if d.header_digest => &["CRC32C", "None"],
                    "DataDigest" if d.data_digest => &["CRC32C", "None"],
                    "HeaderDigest" | "DataDigest" => &["None"],
                    "TaskReporting" => &["RFC3720"],
                    "AuthMethod" => &[],
                    other => unreachable!("list key {other} without values"),
                };
                let mut offered = v.split(',');
                let pick = if def.name == "AuthMethod" {
                    offered.find(|o| self.auth_methods.iter().any(|m| m == o))
                } else {
                    offered.find(|o| supported.contains(o))
                };
                match pick {
                    None => REJECT.to_owned(),
                    Some(p) => {
                        match def.name {
                            "HeaderDigest" => self.conn.header_digest = p == "CRC32C",
                            "DataDigest" => self.conn.data_digest = p == "CRC32C",
                            "AuthMethod" => self.auth_method = Some(p.to_owned()),
                            _ => {}
                        }
                        p.to_owned()
                    }
                }
            }
        };
        Ok(Some(answer))
    }

    fn declare(&mut self, def: &KeyDef, v: &str) -> Result<Option<String>, NegotiationError> {
        match def.name {
            "InitiatorName" => {
                if !valid_iscsi_name(v) {
                    return Err(NegotiationError::BadInitiatorName);
                }
                self.session.initiator_name = v.to_owned();
            }
            "TargetName" => {
                if !valid_iscsi_name(v) {
                    return Err(NegotiationError::BadTargetName);
                }
                self.session.target_name = Some(v.to_owned());
            }
            "InitiatorAlias" => self.session.initiator_alias = Some(v.to_owned()),
            "SessionType" => {
                self.session.session_type = match v {
                    "Normal" => SessionType::Normal,
                    "Discovery" => SessionType::Discovery,
                    _ => return Err(NegotiationError::UnsupportedSessionType(v.to_owned())),
                }
            }
            "MaxRecvDataSegmentLength" => {
                let n = parse_number(v)
                    .filter(|n| (def.min..=def.max).contains(n))
                    .ok_or_else(|| NegotiationError::InvalidDeclaration {
                        key: def.name.to_owned(),
                        value: v.to_owned(),
                    })?;
                self.conn.max_xmit_data_segment_length = n as u32;
                return Ok(self.declare_ours(def.name));
            }
            other => unreachable!("declarative key {other} without handling"),
        }
        Ok(None)
    }

    /// Our own declaration of `name`, once per login.
    fn declare_ours(&mut self, name: &'static str) -> Option<String> {
        if self.declared.contains(&name) {
            return None;
        }
        self.declared.push(name);
        match name {
            "MaxRecvDataSegmentLength" => {
                self.conn.max_recv_data_segment_length = self.defaults.max_recv_data_segment_length;
                Some(self.defaults.max_recv_data_segment_length.to_string())
            }
            _ => None,
        }
    }

    /// Record that the login declared `name` itself (TargetAlias, TargetPortalGroupTag), so an
    /// initiator's `NotUnderstood` for it is not treated as a protocol error.
    pub fn note_declared(&mut self, name: &'static str) {
        if !self.declared.contains(&name) {
            self.declared.push(name);
        }
    }

    /// The declarations we owe the initiator and have not sent yet (our
    /// MaxRecvDataSegmentLength, §13.12): append them to the response that ends the login.
    pub fn unsent_declarations(&mut self) -> Vec<(String, String)> {
        let name = "MaxRecvDataSegmentLength";
        self.declare_ours(name)
            .map(|v| vec![(name.to_owned(), v)])
            .unwrap_or_default()
    }

    /// The outcome of the login. Call after [`Negotiator::unsent_declarations`]. For a
    /// connection joining an existing session the session half is meaningless (the session's own
    /// parameters stay in force).
    pub fn finish(&mut self) -> Result<(SessionParams, ConnParams), NegotiationError> {
        if self.session.initiator_name.is_empty() {
            return Err(NegotiationError::MissingInitiatorName);
        }
        let mut s = self.session.clone();
        // Only reachable if MaxBurstLength ended below the RFC-default FirstBurstLength that
        // the initiator never negotiated; never let the invariant break.
        s.first_burst_length = s.first_burst_length.min(s.max_burst_length);
        Ok((s, self.conn))
    }

    /// Answer a Text Request in full-feature phase (§6.2, §13: only keys whose Use is ALL or
    /// FFPO). Each Text exchange is a fresh negotiation, so a key may come again in a later one.
    /// MaxRecvDataSegmentLength is re-declared both ways; SendTargets is left to the server;
    /// login-only keys get `Reject`, unknown keys `NotUnderstood`.
    pub fn respond_full_feature(&mut self, pairs: &[(String, String)]) -> FullFeatureResponse {
        let mut out = FullFeatureResponse::default();
        for (k, v) in pairs {
            let answer = match key_def(k) {
                None if is_security_key(k) => Some(REJECT),
                None => Some(NOT_UNDERSTOOD),
                Some(_) if is_reserved(v) => Some(REJECT),
                Some(def) => match def.name {
                    "SendTargets" => {
                        out.send_targets = Some(v.clone());
                        None
                    }
                    "InitiatorAlias" => {
                        self.session.initiator_alias = Some(v.clone());
                        None
                    }
                    "MaxRecvDataSegmentLength" => {
                        match parse_number(v).filter(|n| (def.min..=def.max).contains(n)) {
                            Some(n) => {
                                self.conn.max_xmit_data_segment_length = n as u32;
                                out.max_xmit_data_segment_length = Some(n as u32);
                                out.pairs.push((
                                    k.clone(),
                                    self.defaults.max_recv_data_segment_length.to_string(),
                                ));
                                None
                            }
                            None => Some(REJECT),
                        }
                    }
                    _ => Some(REJECT),
                },
            };
            if let Some(a) = answer {
                out.pairs.push((k.clone(), a.to_owned()));
            }
        }
        out
    }
}

/// Every negotiated key with its value, for the admin view.
pub fn describe(session: &SessionParams, conn: &ConnParams) -> Vec<(&'static str, String)> {
    let digest = |on: bool| if on { "CRC32C" } else { "None" }.to_owned();
    let mut v = vec![
        ("SessionType", session.session_type.as_str().to_owned()),
        ("InitiatorName", session.initiator_name.clone()),
    ];
    if let Some(a) = &session.initiator_alias {
        v.push(("InitiatorAlias", a.clone()));
    }
    if let Some(t) = &session.target_name {
        v.push(("TargetName", t.clone()));
    }
    v.extend([
        ("MaxConnections", session.max_connections.to_string()),
        ("InitialR2T", yes_no(session.initial_r2t).to_owned()),
        ("ImmediateData", yes_no(session.immediate_data).to_owned()),
        ("MaxBurstLength", session.max_burst_length.to_string()),
        ("FirstBurstLength", session.first_burst_length.to_string()),
        ("DefaultTime2Wait", session.default_time2wait.to_string()),
        (
            "DefaultTime2Retain",
            session.default_time2retain.to_string(),
        ),
        ("MaxOutstandingR2T", session.max_outstanding_r2t.to_string()),
        (
            "DataPDUInOrder",
            yes_no(session.data_pdu_in_order).to_owned(),
        ),
        (
            "DataSequenceInOrder",
            yes_no(session.data_sequence_in_order).to_owned(),
        ),
        (
            "ErrorRecoveryLevel",
            session.error_recovery_level.to_string(),
        ),
        ("HeaderDigest", digest(conn.header_digest)),
        ("DataDigest", digest(conn.data_digest)),
        (
            "MaxRecvDataSegmentLength",
            conn.max_recv_data_segment_length.to_string(),
        ),
        (
            "MaxXmitDataSegmentLength",
            conn.max_xmit_data_segment_length.to_string(),
        ),
    ]);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OP: Stage = Stage::LOGIN_OPERATIONAL_NEGOTIATION;
    const SEC: Stage = Stage::SECURITY_NEGOTIATION;

    fn p(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn answer(n: &mut Negotiator, k: &str, v: &str) -> Option<String> {
        let out = n.respond(OP, &p(&[(k, v)])).unwrap();
        out.into_iter().find(|(key, _)| key == k).map(|(_, v)| v)
    }

    fn fresh() -> Negotiator {
        Negotiator::new(&TargetDefaults::default())
    }

    #[test]
    fn table_covers_every_rfc7143_key_once() {
        for name in [
            "HeaderDigest",
            "DataDigest",
            "MaxConnections",
            "SendTargets",
            "TargetName",
            "InitiatorName",
            "TargetAlias",
            "InitiatorAlias",
            "TargetAddress",
            "TargetPortalGroupTag",
            "InitialR2T",
            "ImmediateData",
            "MaxRecvDataSegmentLength",
            "MaxBurstLength",
            "FirstBurstLength",
            "DefaultTime2Wait",
            "DefaultTime2Retain",
            "MaxOutstandingR2T",
            "DataPDUInOrder",
            "DataSequenceInOrder",
            "ErrorRecoveryLevel",
            "SessionType",
            "TaskReporting",
            "iSCSIProtocolLevel",
            "OFMarker",
            "IFMarker",
            "OFMarkInt",
            "IFMarkInt",
            "AuthMethod",
        ] {
            assert_eq!(KEYS.iter().filter(|k| k.name == name).count(), 1, "{name}");
        }
        assert_eq!(KEYS.len(), 29);
    }

    #[test]
    fn numerical_min_answers_the_smaller_value() {
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "MaxBurstLength", "262144").as_deref(),
            Some("262144")
        );
        assert_eq!(n.session_params().max_burst_length, 262_144);
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "MaxBurstLength", "16776192").as_deref(),
            Some("1048576")
        );
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "MaxOutstandingR2T", "1").as_deref(),
            Some("1")
        );
        assert_eq!(
            answer(&mut n, "ErrorRecoveryLevel", "2").as_deref(),
            Some("2")
        );
        assert_eq!(answer(&mut n, "MaxConnections", "8").as_deref(), Some("4"));
        assert_eq!(
            answer(&mut n, "DefaultTime2Retain", "0").as_deref(),
            Some("0")
        );
        assert_eq!(
            answer(&mut n, "iSCSIProtocolLevel", "2").as_deref(),
            Some("1")
        );
    }

    #[test]
    fn error_recovery_level_and_max_outstanding_r2t_agree() {
        // §13.19: DataSequenceInOrder=Yes and a level above 0 make MaxOutstandingR2T 1,
        // whichever order the keys come in within one request.
        let mut n = fresh();
        let out = n
            .respond(
                OP,
                &p(&[("MaxOutstandingR2T", "8"), ("ErrorRecoveryLevel", "2")]),
            )
            .unwrap();
        assert_eq!(
            out,
            p(&[("MaxOutstandingR2T", "1"), ("ErrorRecoveryLevel", "2")])
        );
        // A MaxOutstandingR2T above 1 agreed in an earlier request keeps the level at 0.
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "MaxOutstandingR2T", "8").as_deref(),
            Some("8")
        );
        assert_eq!(
            answer(&mut n, "ErrorRecoveryLevel", "1").as_deref(),
            Some("0")
        );
        // A target set to 0 or 1 answers its own level.
        let mut n = fresh();
        n.set_error_recovery_level(0);
        assert_eq!(
            answer(&mut n, "ErrorRecoveryLevel", "2").as_deref(),
            Some("0")
        );
        assert_eq!(
            answer(&mut n, "MaxOutstandingR2T", "8").as_deref(),
            Some("8")
        );
        let mut n = fresh();
        n.set_error_recovery_level(1);
        assert_eq!(
            answer(&mut n, "ErrorRecoveryLevel", "2").as_deref(),
            Some("1")
        );
    }

    #[test]
    fn numerical_max_answers_the_larger_value() {
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "DefaultTime2Wait", "0").as_deref(),
            Some("2")
        );
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "DefaultTime2Wait", "10").as_deref(),
            Some("10")
        );
        assert_eq!(n.session_params().default_time2wait, 10);
    }

    #[test]
    fn numbers_accept_hex_constants() {
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "MaxBurstLength", "0x10000").as_deref(),
            Some("65536")
        );
    }

    #[test]
    fn boolean_or_is_yes_if_either_side_says_yes() {
        let mut n = fresh();
        assert_eq!(answer(&mut n, "InitialR2T", "Yes").as_deref(), Some("Yes"));
        let mut n = fresh();
        assert_eq!(answer(&mut n, "InitialR2T", "No").as_deref(), Some("No"));
        assert!(!n.session_params().initial_r2t);
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "DataPDUInOrder", "No").as_deref(),
            Some("Yes")
        );
    }

    #[test]
    fn boolean_and_is_no_if_either_side_says_no() {
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "ImmediateData", "Yes").as_deref(),
            Some("Yes")
        );
        let mut n = fresh();
        assert_eq!(answer(&mut n, "ImmediateData", "No").as_deref(), Some("No"));
        let mut n = Negotiator::new(&TargetDefaults {
            immediate_data: false,
            ..TargetDefaults::default()
        });
        assert_eq!(
            answer(&mut n, "ImmediateData", "Yes").as_deref(),
            Some("No")
        );
        assert!(!n.session_params().immediate_data);
    }

    #[test]
    fn list_picks_the_first_offered_value_we_support() {
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "HeaderDigest", "CRC32C,None").as_deref(),
            Some("CRC32C")
        );
        assert_eq!(
            answer(&mut n, "DataDigest", "None,CRC32C").as_deref(),
            Some("None")
        );
        assert!(n.conn_params().header_digest && !n.conn_params().data_digest);
        let mut n = Negotiator::new(&TargetDefaults {
            header_digest: false,
            ..TargetDefaults::default()
        });
        assert_eq!(
            answer(&mut n, "HeaderDigest", "CRC32C,None").as_deref(),
            Some("None")
        );
        assert_eq!(
            answer(&mut n, "DataDigest", "MD5,CRC32C").as_deref(),
            Some("CRC32C")
        );
        assert_eq!(
            answer(&mut n, "TaskReporting", "FastAbort,RFC3720").as_deref(),
            Some("RFC3720")
        );
    }

    #[test]
    fn list_without_a_supported_value_is_rejected() {
        let mut n = Negotiator::new(&TargetDefaults {
            header_digest: false,
            ..TargetDefaults::default()
        });
        assert_eq!(
            answer(&mut n, "HeaderDigest", "CRC32C").as_deref(),
            Some("Reject")
        );
        assert!(!n.conn_params().header_digest);
        assert_eq!(
            answer(&mut n, "TaskReporting", "FastAbort").as_deref(),
            Some("Reject")
        );
    }

    #[test]
    fn declarative_max_recv_data_segment_length_sets_what_we_may_send_and_declares_ours() {
        let mut n = fresh();
        assert_eq!(
            answer(&mut n, "MaxRecvDataSegmentLength", "65536").as_deref(),
            Some("262144")
        );
        assert_eq!(n.conn_params().max_xmit_data_segment_length, 65536);
        assert_eq!(n.conn_params().max_recv_data_segment_length, 262_144);
        // Already declared: nothing left to send.
        assert!(n.unsent_declarations().is_empty());
    }

    #[test]
    fn our_max_recv_data_segment_length_is_declared_once_even_if_never_asked() {
        let mut n = fresh();
        n.respond(OP, &p(&[("InitiatorName", "iqn.2024-01.org.x:i")]))
            .unwrap();
        assert_eq!(
            n.unsent_declarations(),
            p(&[("MaxRecvDataSegmentLength", "262144")])
        );
        assert!(n.unsent_declarations().is_empty());
        let (_, conn) = n.finish().unwrap();
        assert_eq!(conn.max_xmit_data_segment_length, 8192);
        assert_eq!(conn.max_recv_data_segment_length, 262_144);
    }

    #[test]
    fn bad_max_recv_data_segment_length_fails_the_login() {
        for bad in ["511", "16777216", "lots", ""] {
            let mut n = fresh();
            assert!(matches!(
                n.respond(OP, &p(&[("MaxRecvDataSegmentLength", bad)])),
                Err(NegotiationError::InvalidDeclaration { .. })
            ));
        }
    }

    #[test]
    fn unknown_and_extension_keys_are_not_understood() {
        let mut n = fresh();
        let out = n
            .respond(
                OP,
                &p(&[
                    ("X-com.example.Foo", "1"),
                    ("X#NodeArchitecture", "Linux"),
                    ("Bogus", "1"),
                ]),
            )
            .unwrap();
        assert!(out.iter().all(|(_, v)| v == "NotUnderstood"));
        assert_eq!(out.len(), 3);
    }

    #[test]
    fn out_of_range_or_malformed_offers_are_rejected_and_keep_the_default() {
        let mut n = fresh();
        for (k, v) in [
            ("MaxBurstLength", "511"),
            ("FirstBurstLength", "16777216"),
            ("MaxOutstandingR2T", "0"),
            ("ErrorRecoveryLevel", "3"),
            ("DefaultTime2Wait", "3601"),
            ("MaxConnections", "-1"),
            ("InitialR2T", "yes"),
            ("DataSequenceInOrder", "Maybe"),
        ] {
            assert_eq!(answer(&mut n, k, v).as_deref(), Some("Reject"), "{k}={v}");
        }
        assert_eq!(n.session_params(), &SessionParams::default());
    }

    #[test]
    fn key_offered_twice_in_one_login_is_an_error() {
        let mut n = fresh();
        n.respond(OP, &p(&[("MaxBurstLength", "65536")])).unwrap();
        assert_eq!(
            n.respond(OP, &p(&[("MaxBurstLength", "65536")])),
            Err(NegotiationError::Renegotiated("MaxBurstLength".into()))
        );
        let mut n = fresh();
        n.respond(SEC, &p(&[("InitiatorName", "iqn.2024-01.org.x:i")]))
            .unwrap();
        assert!(n
            .respond(OP, &p(&[("InitiatorName", "iqn.2024-01.org.x:j")]))
            .is_err());
    }

    #[test]
    fn reserved_constants_as_offers_are_protocol_errors() {
        let mut n = fresh();
        assert!(matches!(
            n.respond(OP, &p(&[("MaxBurstLength", "Irrelevant")])),
            Err(NegotiationError::ReservedValue { .. })
        ));
        // ... but an initiator may say it did not understand one of our declarations.
        let mut n = fresh();
        n.note_declared("TargetAlias");
        assert_eq!(
            n.respond(OP, &p(&[("TargetAlias", "NotUnderstood")])),
            Ok(vec![])
        );
    }

    #[test]
    fn first_burst_never_exceeds_max_burst() {
        // Same request, FirstBurstLength first on the wire.
        let mut n = fresh();
        let out = n
            .respond(
                OP,
                &p(&[("FirstBurstLength", "65536"), ("MaxBurstLength", "16384")]),
            )
            .unwrap();
        assert_eq!(
            out,
            p(&[("FirstBurstLength", "16384"), ("MaxBurstLength", "16384")])
        );
        // A later, smaller MaxBurstLength is refused.
        let mut n = fresh();
        n.respond(OP, &p(&[("FirstBurstLength", "65536")])).unwrap();
        assert_eq!(
            answer(&mut n, "MaxBurstLength", "8192").as_deref(),
            Some("Reject")
        );
        let s = n.session_params();
        assert!(s.first_burst_length <= s.max_burst_length);
        // Our own configuration is sanitized too.
        let n = Negotiator::new(&TargetDefaults {
            first_burst_length: 1 << 20,
            max_burst_length: 4096,
            ..TargetDefaults::default()
        });
        assert_eq!(n.defaults.first_burst_length, 4096);
    }

    #[test]
    fn first_burst_default_is_clamped_when_max_burst_negotiated_below_it() {
        let mut n = fresh();
        n.respond(
            OP,
            &p(&[
                ("InitiatorName", "iqn.2024-01.org.x:i"),
                ("MaxBurstLength", "4096"),
            ]),
        )
        .unwrap();
        let (s, _) = n.finish().unwrap();
        assert_eq!((s.first_burst_length, s.max_burst_length), (4096, 4096));
    }

    #[test]
    fn discovery_sessions_answer_data_transfer_keys_irrelevant() {
        let mut n = fresh();
        let out = n
            .respond(
                OP,
                &p(&[
                    ("MaxBurstLength", "65536"),
                    ("SessionType", "Discovery"),
                    ("InitialR2T", "No"),
                    ("HeaderDigest", "None"),
                    ("ErrorRecoveryLevel", "0"),
                ]),
            )
            .unwrap();
        assert_eq!(
            out,
            p(&[
                ("MaxBurstLength", "Irrelevant"),
                ("InitialR2T", "Irrelevant"),
                ("HeaderDigest", "None"),
                ("ErrorRecoveryLevel", "0"),
            ])
        );
        assert_eq!(n.session_params().session_type, SessionType::Discovery);
    }

    #[test]
    fn leading_only_keys_on_a_non_leading_connection_are_irrelevant() {
        let mut n = fresh();
        n.set_leading(false);
        assert_eq!(
            answer(&mut n, "MaxBurstLength", "65536").as_deref(),
            Some("Irrelevant")
        );
        assert_eq!(
            answer(&mut n, "HeaderDigest", "CRC32C").as_deref(),
            Some("CRC32C")
        );
    }

    #[test]
    fn target_only_and_full_feature_only_keys_are_rejected_in_login() {
        let mut n = fresh();
        for k in [
            "TargetAlias",
            "TargetAddress",
            "TargetPortalGroupTag",
            "SendTargets",
        ] {
            assert_eq!(answer(&mut n, k, "x").as_deref(), Some("Reject"), "{k}");
        }
    }

    #[test]
    fn markers_are_answered_off() {
        let mut n = fresh();
        let out = n
            .respond(
                OP,
                &p(&[
                    ("OFMarker", "Yes"),
                    ("IFMarker", "No"),
                    ("OFMarkInt", "2048~8192"),
                    ("IFMarkInt", "1~65535"),
                ]),
            )
            .unwrap();
        assert_eq!(
            out,
            p(&[
                ("OFMarker", "No"),
                ("IFMarker", "No"),
                ("OFMarkInt", "Irrelevant"),
                ("IFMarkInt", "Irrelevant"),
            ])
        );
    }

    #[test]
    fn auth_method_picks_the_first_supported_and_only_in_security_stage() {
        let mut n = fresh();
        let out = n.respond(SEC, &p(&[("AuthMethod", "CHAP,None")])).unwrap();
        assert_eq!(out, p(&[("AuthMethod", "None")]));
        assert_eq!(n.auth_method(), Some("None"));
        let mut n = fresh();
        assert_eq!(
            n.respond(SEC, &p(&[("AuthMethod", "CHAP,SRP")])).unwrap(),
            p(&[("AuthMethod", "Reject")])
        );
        assert_eq!(n.auth_method(), None);
        let mut n = fresh();
        assert_eq!(
            n.respond(OP, &p(&[("AuthMethod", "None")])),
            Err(NegotiationError::SecurityKeyOutOfStage("AuthMethod".into()))
        );
    }

    #[test]
    fn declarations_are_validated() {
        let mut n = fresh();
        assert_eq!(
            n.respond(SEC, &p(&[("InitiatorName", "not-a-name")])),
            Err(NegotiationError::BadInitiatorName)
        );
        let mut n = fresh();
        assert_eq!(
            n.respond(SEC, &p(&[("TargetName", &"iqn.x".repeat(50))])),
            Err(NegotiationError::BadTargetName)
        );
        let mut n = fresh();
        assert_eq!(
            n.respond(SEC, &p(&[("SessionType", "Bogus")])),
            Err(NegotiationError::UnsupportedSessionType("Bogus".into()))
        );
        assert_eq!(
            fresh().finish(),
            Err(NegotiationError::MissingInitiatorName)
        );
    }

    #[test]
    fn iscsi_names_follow_the_three_formats() {
        assert!(valid_iscsi_name("iqn.1993-08.org.debian:01:abcdef"));
        assert!(valid_iscsi_name("eui.02004567A425678D"));
        assert!(valid_iscsi_name("naa.52004567BA64678D"));
        assert!(valid_iscsi_name("naa.62004567BA64678D0123456789ABCDEF"));
        assert!(!valid_iscsi_name("eui.0200"));
        assert!(!valid_iscsi_name("iqn."));
        assert!(!valid_iscsi_name("iqn.a b"));
        assert!(!valid_iscsi_name(&format!("iqn.{}", "a".repeat(220))));
    }

    #[test]
    fn answers_keep_request_order_and_skip_declarations() {
        let mut n = fresh();
        let out = n
            .respond(
                OP,
                &p(&[
                    ("InitiatorName", "iqn.2024-01.org.x:i"),
                    ("HeaderDigest", "None"),
                    ("SessionType", "Normal"),
                    ("MaxBurstLength", "65536"),
                    ("InitiatorAlias", "host"),
                ]),
            )
            .unwrap();
        assert_eq!(
            out,
            p(&[("HeaderDigest", "None"), ("MaxBurstLength", "65536")])
        );
        let s = n.session_params();
        assert_eq!(s.initiator_alias.as_deref(), Some("host"));
        assert_eq!(s.session_type, SessionType::Normal);
    }

    #[test]
    fn full_feature_text_renegotiates_max_recv_data_segment_length_only() {
        let mut n = fresh();
        let r = n.respond_full_feature(&p(&[
            ("MaxRecvDataSegmentLength", "16384"),
            ("SendTargets", "All"),
            ("MaxBurstLength", "4096"),
            ("X-foo", "1"),
            ("HeaderDigest", "CRC32C"),
        ]));
        assert_eq!(r.send_targets.as_deref(), Some("All"));
        assert_eq!(r.max_xmit_data_segment_length, Some(16384));
        assert_eq!(
            r.pairs,
            p(&[
                ("MaxRecvDataSegmentLength", "262144"),
                ("MaxBurstLength", "Reject"),
                ("X-foo", "NotUnderstood"),
                ("HeaderDigest", "Reject"),
            ])
        );
        // Each text exchange is a fresh negotiation: the key may come again.
        let r = n.respond_full_feature(&p(&[("MaxRecvDataSegmentLength", "100")]));
        assert_eq!(r.pairs, p(&[("MaxRecvDataSegmentLength", "Reject")]));
        assert_eq!(n.conn_params().max_xmit_data_segment_length, 16384);
    }

    #[test]
    fn describe_lists_every_negotiated_key() {
        let (s, c) = (SessionParams::default(), ConnParams::default());
        let d = describe(&s, &c);
        assert!(d
            .iter()
            .any(|(k, v)| *k == "MaxBurstLength" && v == "262144"));
        assert!(d.iter().any(|(k, v)| *k == "HeaderDigest" && v == "None"));
        assert_eq!(d.len(), 17);
    }

    proptest! {
        #[test]
        fn min_answers_never_exceed_either_side(
            mbl in 512u64..(1 << 24),
            fbl in 512u64..(1 << 24),
            r2t in 1u64..=65535,
            erl in 0u64..=2,
            conns in 1u64..=65535,
            retain in 0u64..=3600,
            wait in 0u64..=3600,
        ) {
            let d = TargetDefaults::default();
            let mut n = Negotiator::new(&d);
            let offer = p(&[
                ("FirstBurstLength", &fbl.to_string()),
                ("MaxBurstLength", &mbl.to_string()),
                ("MaxOutstandingR2T", &r2t.to_string()),
                ("ErrorRecoveryLevel", &erl.to_string()),
                ("MaxConnections", &conns.to_string()),
                ("DefaultTime2Retain", &retain.to_string()),
                ("DefaultTime2Wait", &wait.to_string()),
            ]);
            let out = n.respond(OP, &offer).unwrap();
            let get = |k: &str| -> u64 {
                out.iter().find(|(key, _)| key == k).unwrap().1.parse().unwrap()
            };
            prop_assert!(get("MaxBurstLength") <= mbl.min(d.max_burst_length.into()));
            prop_assert!(get("FirstBurstLength") <= fbl.min(d.first_burst_length.into()));
            prop_assert!(get("FirstBurstLength") <= get("MaxBurstLength"));
            // ErrorRecoveryLevel is answered first; above 0 MaxOutstandingR2T is 1 (§13.19).
            let level = erl.min(d.error_recovery_level.into());
            prop_assert_eq!(get("ErrorRecoveryLevel"), level);
            let r2t_ours = if level > 0 { 1 } else { d.max_outstanding_r2t.into() };
            prop_assert_eq!(get("MaxOutstandingR2T"), r2t.min(r2t_ours));
            prop_assert_eq!(get("MaxConnections"), conns.min(d.max_connections.into()));
            prop_assert_eq!(get("DefaultTime2Retain"), retain.min(d.default_time2retain.into()));
            // Max rule: at least both sides.
            prop_assert_eq!(get("DefaultTime2Wait"), wait.max(d.default_time2wait.into()));
            let s = n.session_params();
            prop_assert_eq!(u64::from(s.max_burst_length), get("MaxBurstLength"));
            prop_assert_eq!(u64::from(s.first_burst_length), get("FirstBurstLength"));
        }

        #[test]
        fn respond_never_panics_on_arbitrary_values(
            k in proptest::sample::select(KEYS.iter().map(|k| k.name).collect::<Vec<_>>()),
            v in "[ -~]{0,40}",
        ) {
            let mut n = fresh();
            let _ = n.respond(OP, &p(&[(k, &v)]));
            let _ = n.respond_full_feature(&p(&[(k, &v)]));
        }
    }
}
