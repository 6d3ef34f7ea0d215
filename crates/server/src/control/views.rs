//! What the control plane shows, as types: the server builds these and sends them as JSON
//! (`ironsan ctl --json`, the status page's `/status.json`), and `ironsan ctl` reads the same
//! types back to print its tables. A field is named once, here; JSON keys are the field
//! names. Plain data with no behaviour, so any layer may build or read a view without
//! importing the one that serves it.
//!
//! Readers tolerate views from a server one version apart: a field a reader does not know is
//! ignored, and one the server does not send takes its default.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `ctl sessions`: one session with its connections.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct SessionView {
    pub tsih: u16,
    pub isid: String,
    pub initiator: String,
    /// `None`: a discovery session.
    pub target: Option<String>,
    /// `normal` or `discovery`.
    #[serde(rename = "type")]
    pub kind: String,
    pub commands: u64,
    /// The negotiated keys (RFC 7143 §13) as the login answered them.
    pub params: BTreeMap<String, String>,
    pub connections: Vec<ConnectionView>,
    pub kept_connections: Vec<KeptConnectionView>,
}

/// One connection of a session in full feature phase.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct ConnectionView {
    pub cid: u16,
    pub peer: String,
    pub portal: String,
    /// When it logged in, seconds since the epoch.
    pub since: u64,
    pub in_flight: u64,
    pub rx_pdus: u64,
    pub rx_bytes: u64,
    pub tx_pdus: u64,
    pub tx_bytes: u64,
    pub tx_zero_copy_bytes: u64,
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    pub other_commands: u64,
    pub digest_errors: u64,
    /// The kernel's TCP_INFO of its socket (`None` when it could not be read).
    pub tcp: Option<TcpView>,
}

/// A socket's TCP_INFO, as far as an admin needs it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct TcpView {
    pub rtt_us: u32,
    pub rttvar_us: u32,
    /// Congestion window, segments.
    pub cwnd: u32,
    /// Slow-start threshold, segments (0x7fffffff and above: not set yet).
    pub ssthresh: u32,
    pub retransmits: u32,
    /// Bytes per second.
    pub delivery_rate: u64,
    pub mss: u32,
    pub congestion: Option<String>,
}

/// A connection kept for TASK REASSIGN (ErrorRecoveryLevel 2).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct KeptConnectionView {
    pub cid: u16,
    pub tasks: usize,
    pub expires_in_ms: u64,
}

/// `ctl targets`: one target's settings.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct TargetView {
    pub name: String,
    pub alias: Option<String>,
    pub connections_per_session: u16,
    pub error_recovery_level: u8,
    /// The portal groups it is served on (`None`: every portal).
    pub portal_groups: Option<Vec<u16>>,
    pub luns: usize,
    pub sessions: usize,
    /// The initiator rules that may log in (empty: everyone).
    pub acl: Vec<String>,
    /// The CHAP user names (never the secrets).
    pub chap: Option<String>,
    pub mutual_chap: Option<String>,
}

/// `ctl luns`: one LUN.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct LunView {
    pub target: String,
    pub lun: u64,
    pub backend: String,
    pub io_engine: Option<String>,
    pub in_flight: Option<u64>,
    /// Bytes.
    pub size: u64,
    pub blocks: u64,
    pub block_size: u32,
    pub read_only: bool,
    pub write_cache: bool,
    pub serial: String,
    /// The NAA identifier, 16 hex digits.
    pub naa: String,
    /// The spec it was made from, as written in the file or at `ctl lun add`.
    pub spec: Option<String>,
}

/// `ctl show target IQN`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct TargetDetailView {
    pub target: TargetView,
    pub luns: Vec<LunView>,
    pub sessions: Vec<SessionView>,
}

/// `ctl portals`: one listening portal.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct PortalView {
    /// The address actually bound.
    pub addr: String,
    pub tag: u16,
    /// The protocol it speaks (`iscsi`).
    pub transport: String,
}

/// `ctl alua`: one target port group of a target.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct AluaGroupView {
    pub target: String,
    pub group: u16,
    pub state: String,
    pub preferred: bool,
    /// Set in the configuration (not derived from the portals).
    pub configured: bool,
    pub ports: Vec<u16>,
    pub portals: Vec<String>,
}

/// `ctl stats`: one class of commands (read, write, other) of one LUN.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct StatsView {
    pub target: String,
    pub lun: u64,
    pub class: String,
    pub commands: u64,
    pub bytes: u64,
    /// Per stage of a command ([`crate::metrics::STAGES`]).
    pub stages: BTreeMap<String, StageView>,
}

/// The latency of one stage.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct StageView {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub sum_us: u64,
    /// The histogram's raw buckets.
    pub buckets: Vec<u64>,
}

/// `ctl cluster`: this node, its lease and write gate, and every node per target.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct ClusterView {
    pub node: u16,
    pub name: String,
    pub pool: String,
    pub group: String,
    pub object: String,
    /// This node's RADOS client address (what fencing blocklists).
    pub address: String,
    /// `serving`, `suspended`, `partitioned` or `fenced`.
    pub health: String,
    pub reason: Option<String>,
    pub heartbeat_ms: u64,
    pub lease: LeaseView,
    pub gate: GateView,
    pub oldest_write_ms: Option<u64>,
    pub fences: u64,
    pub last_fence: Option<LastFenceView>,
    pub peers: Vec<PeerView>,
    pub targets: Vec<ClusterTargetView>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct LeaseView {
    pub length_ms: u64,
    pub remaining_ms: Option<u64>,
}

/// The gate that holds writes while this node's lease is not valid.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct GateView {
    pub open: bool,
    pub waiting: u64,
    pub waited: u64,
    pub waited_ms: u64,
    pub refused: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct LastFenceView {
    pub node: u16,
    pub after_lapse_ms: u64,
    pub ago_ms: u64,
}

/// Another node as this one sees it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct PeerView {
    pub node: u16,
    pub name: String,
    pub address: String,
    pub state: Option<String>,
    pub lease_ms: Option<u64>,
    pub last_ack_ms: Option<u64>,
}

/// One clustered target: its nodes and its shared LUNs.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct ClusterTargetView {
    pub target: String,
    pub object: String,
    pub nodes: Vec<ClusterNodeView>,
    pub luns: Vec<SharedLunView>,
}

/// One node serving a clustered target.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct ClusterNodeView {
    pub node: u16,
    pub name: String,
    /// This is the node answering.
    #[serde(rename = "self")]
    pub is_self: bool,
    pub state: String,
    pub lease_ms: Option<u64>,
    pub ports: Vec<u16>,
    pub portals: Vec<String>,
    pub address: String,
    pub last_ack_ms: Option<u64>,
    /// LUN → the reservation record serial it applied.
    pub applied: BTreeMap<u64, u64>,
}

/// A LUN whose reservations are held in RADOS.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct SharedLunView {
    pub lun: u64,
    pub serial: u64,
    pub pr_generation: u32,
}
