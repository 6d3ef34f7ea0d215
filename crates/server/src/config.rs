//! What the server is configured with: its targets, portals and portal groups, the
//! negotiation defaults and limits ([`ServerConfig`]), and how large reads go out
//! ([`ZeroCopyReads`]). Plain data: the binary builds it from flags and the file, the
//! control plane changes a running server through `control::Control`.

use crate::access::Access;
use crate::limits::Limits;
use ironsan_proto::negotiate::TargetDefaults;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

/// One iSCSI target (an iSCSI node with a SCSI target device behind it).
#[derive(Clone, Debug)]
pub struct TargetDef {
    /// iSCSI qualified name.
    pub name: String,
    pub alias: Option<String>,
    /// The most connections a session with this target may have (MaxConnections, RFC 7143
    /// §13.2); `None`: [`ServerConfig::negotiation`]'s.
    pub max_connections: Option<u16>,
    /// The highest ErrorRecoveryLevel its sessions may agree (RFC 7143 §13.20; at most
    /// [`ironsan_proto::negotiate::MAX_ERROR_RECOVERY_LEVEL`]); `None`:
    /// [`ServerConfig::negotiation`]'s.
    pub error_recovery_level: Option<u8>,
    pub scsi: Arc<ironsan_scsi::Target>,
}

/// A target portal group (RFC 7143 §4.4.1): portals that share a tag. A session's
/// connections all use portals of one group; the tag is the TargetPortalGroupTag of logins
/// on those portals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortalGroup {
    /// 1 to 65535.
    pub tag: u16,
    pub listen: Vec<SocketAddr>,
}

/// A bound portal: its address and its group's tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Portal {
    pub addr: SocketAddr,
    pub tag: u16,
}

/// The protocol a listening portal speaks: its accept loop hands each connection to that
/// transport's driver. Every portal is iSCSI today; NVMe/TCP listeners are the next kind
/// (docs/ARCHITECTURE.md, "A second transport").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transport {
    /// iSCSI (RFC 7143): logins, sessions, SendTargets lists the portal.
    #[default]
    Iscsi,
}

impl Transport {
    /// Its name in views (`ctl portals`).
    pub fn name(self) -> &'static str {
        match self {
            Transport::Iscsi => "iscsi",
        }
    }
}

/// Everything the server needs to run.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Portals of the implicit group with tag 1 (bound before `portal_groups`).
    pub listen: Vec<SocketAddr>,
    /// Further portal groups, each with its own tag.
    pub portal_groups: Vec<PortalGroup>,
    /// The portal groups (tags) that serve a target; a target without an entry is served on
    /// every portal. A login on another portal fails with 0203 (not found at this address)
    /// and SendTargets lists only the target's portals.
    pub target_portal_groups: HashMap<String, Vec<u16>>,
    pub targets: Vec<TargetDef>,
    /// What we offer in operational negotiation.
    pub negotiation: TargetDefaults,
    /// Commands one session may have in the target at once (sets MaxCmdSN).
    pub queue_depth: u32,
    /// Resource limits and data-path switches (`[limits]`).
    pub limits: Limits,
    /// Largest Expected Data Transfer Length of a write the target will buffer.
    pub max_io_bytes: u32,
    /// Access control (ACL, CHAP) per target name; a target without an entry is open.
    pub access: HashMap<String, Access>,
    /// Access control for discovery sessions.
    pub discovery: Access,
}

/// How a connection sends large file-LUN reads without copying them through a buffer. Only
/// ever without a data digest (the digest needs the bytes) and for reads of at least 64 KiB.
/// In `Auto` and `On`, with segments of at least 64 KiB, reads of nothing stored (RAM-LUN
/// holes, NULL LUNs) are sent with `sendfile` from an empty sealed file, the kernel's zero
/// page ([`ironsan_backend::InPlaceRead::zero_page`]), under BBR too (Linux 6.5 and later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroCopyReads {
    /// `sendfile` from the page cache (as `on`), unless the connection's TCP congestion
    /// control paces inside TCP (BBR without an fq qdisc): there each 64 KiB splice chunk is
    /// paced on its own, which measured 1.4-1.7x the CPU of copying, so tmpfs/ramfs LUNs send
    /// from a mapping instead (as `mapped`) and other file systems copy (docs/PERFORMANCE.md).
    #[default]
    Auto,
    /// `sendfile` from the page cache, any buffered file whose range is cached, with segments
    /// (MaxRecvDataSegmentLength) of at least 64 KiB.
    On,
    /// tmpfs/ramfs LUNs only: a vectored send straight from a shared mapping of the file,
    /// the kernel's one copy into the socket (pages that do not exist yet are copied as usual).
    Mapped,
    Off,
}

impl ZeroCopyReads {
    const ALL: [ZeroCopyReads; 4] = [
        ZeroCopyReads::Auto,
        ZeroCopyReads::On,
        ZeroCopyReads::Mapped,
        ZeroCopyReads::Off,
    ];
    /// The name in the configuration and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ZeroCopyReads::Auto => "auto",
            ZeroCopyReads::On => "on",
            ZeroCopyReads::Mapped => "mapped",
            ZeroCopyReads::Off => "off",
        }
    }
}

impl std::str::FromStr for ZeroCopyReads {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|m| m.name()).collect();
                format!("'{s}' is not one of {}", names.join(", "))
            })
    }
}

impl std::fmt::Display for ZeroCopyReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl ServerConfig {
    pub fn new(listen: Vec<SocketAddr>, targets: Vec<TargetDef>) -> Self {
        ServerConfig {
            listen,
            portal_groups: Vec::new(),
            target_portal_groups: HashMap::new(),
            targets,
            negotiation: TargetDefaults::default(),
            queue_depth: 128,
            limits: Limits::default(),
            max_io_bytes: ironsan_scsi::MAX_TRANSFER_BYTES,
            access: HashMap::new(),
            discovery: Access::default(),
        }
    }
}
