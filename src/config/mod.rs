//! The declarative configuration: a TOML file, or the equivalent command-line flags, turned
//! into a validated [`Plan`] (portals, targets, LUN specs). Errors name the file and line, or
//! the flag, and say what is wrong.
//!
//! ```toml
//! listen = ["127.0.0.1:3260", "[::1]:3260"]   # portal group 1; more: [[portal_group]]
//! data_dir = "/var/lib/ironsan"
//! queue_depth = 128
//!
//! # [[portal_group]]
//! # tag = 2
//! # listen = ["10.0.2.5:3260"]
//!
//! [[target]]
//! name = "iqn.2026-11.org.ironsan:disk1"
//! alias = "disk1"
//! # portal_groups = [1, 2]  # default: every portal
//! # connections_per_session = 4   # MaxConnections offered (MC/S), 1-64
//! # error_recovery_level = 2      # highest ErrorRecoveryLevel agreed, 0-2
//!
//! [[target.lun]]
//! backend = "file"          # null | ram | file
//! path = "disk1.img"        # relative to data_dir
//! size = "10G"              # creates the file sparse if missing
//! direct = false            # O_DIRECT (BLOCKIO)
//! write_cache = false       # initial WCE
//! read_only = false
//! block_size = 512
//! # serial = "D1SK0001"     # identity (docs/CONFIG.md); `ctl save` writes both
//! # naa = "0x3000c0ffee000001"
//!
//! [[target.lun]]
//! spec = "ram:1G"           # the same shorthand as --lun
//!
//! # Access control (docs/SECURITY.md): per target, and for discovery sessions.
//! # acl = ["iqn.1993-08.org.debian:01:host1", "iqn.2005-03.org.open-iscsi:*@10.0.0.0/24"]
//! # chap = { user = "host1", secret_file = "/etc/ironsan/host1.secret" }
//! # mutual_chap = { user = "disk1", secret_env = "IRONSAN_DISK1_SECRET" }
//! # [discovery]
//! # chap = { user = "discover", secret = "..." }
//! # [limits]
//! # max_connections = 1024
//! # shutdown_grace = "10s"   # SIGTERM: how long initiators get to log out
//! # busy_poll_us = 0         # opt-in: spin up to N us per connection before sleeping
//! # zero_copy_reads = "auto" # large file-LUN reads sent from the page cache, RAM holes as the zero page (auto|on|mapped|off)
//! # zero_copy_writes = "on"  # tmpfs file LUNs: large writes received into the file's pages (on|off)
//! # connection_fairness = "on" # a session's connections (MC/S) move data in equal shares (on|off)
//! # io_engine = "auto"       # file LUNs' blocking I/O: io_uring, else threads (auto|uring|threads)
//!
//! # Top-level keys (before any [table]); the --metrics / --control flags override them.
//! # metrics = "127.0.0.1:9360"
//! # control = "/run/ironsan/control.sock"   # or "none"
//! ```

use ironsan_backend::parse_size;
pub(crate) use ironsan_server::limits::parse_on_off;
pub(crate) use ironsan_server::Limits;
use ironsan_server::{Access, AclRule, ChapAccount, PortalGroup};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use toml::Spanned;

/// Default target name of the embedded default.
pub(crate) const DEFAULT_TARGET: &str = "iqn.2026-11.org.ironsan:default";
/// Default portal.
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:3260";
/// A configuration error: what is wrong and, for a file, where (`FILE:LINE: message`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConfigError {
    /// The file and its 1-based line, for errors in a file.
    pub at: Option<(PathBuf, usize)>,
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.at {
            Some((path, line)) => write!(f, "{}:{line}: {}", path.display(), self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

impl From<String> for ConfigError {
    fn from(message: String) -> Self {
        ConfigError { at: None, message }
    }
}

mod auth;
mod cluster;
mod file;
mod flags;
mod lun;
#[cfg(test)]
mod tests;

pub(crate) use auth::*;
pub(crate) use cluster::{cluster_toml, parse_cluster_flag};
pub(crate) use file::*;
pub(crate) use flags::*;
pub(crate) use lun::*;

/// One target, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TargetPlan {
    pub name: String,
    pub alias: Option<String>,
    pub luns: Vec<LunPlan>,
    /// ACL and CHAP (open when default).
    pub access: Access,
    /// The tags of the portal groups that serve it; `None`: every portal.
    pub portal_groups: Option<Vec<u16>>,
    /// MaxConnections offered to its sessions (several connections per session, RFC 7143
    /// §13.2); `None`: the server's default (`--connections-per-session`, else 4).
    pub connections_per_session: Option<u16>,
    /// The highest ErrorRecoveryLevel its sessions may agree (RFC 7143 §13.20, 0 or 1);
    /// `None`: the server's default (`--error-recovery-level`, else 2).
    pub error_recovery_level: Option<u8>,
    /// ALUA target port groups (`[[target.alua_group]]`), ports named by portal group tag;
    /// `None`: one group per portal group, active/optimized.
    pub alua: Option<Vec<ironsan_scsi::PortGroup>>,
}

/// Most connections per session a target may offer: each is a reader and a writer task with
/// their buffers, so the session-wide count stays small; `[limits] max_connections` bounds
/// the server's total.
pub(crate) const MAX_CONNECTIONS_PER_SESSION: u16 = 64;

#[cfg(test)]
impl Plan {
    /// Every portal address of every group.
    pub(crate) fn listen(&self) -> Vec<SocketAddr> {
        self.portal_groups
            .iter()
            .flat_map(|g| g.listen.iter().copied())
            .collect()
    }
}

/// Everything `serve` needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Portal groups; `listen = [...]` (or `--listen`) is the group with tag 1 (in a
    /// cluster: the node number).
    pub portal_groups: Vec<PortalGroup>,
    pub data_dir: PathBuf,
    pub queue_depth: u32,
    pub targets: Vec<TargetPlan>,
    /// ACL and CHAP of discovery sessions.
    pub discovery: Access,
    pub limits: Limits,
    /// Prometheus listener (`metrics = "ADDR:PORT"`); the `--metrics` flag overrides it.
    pub metrics: Option<SocketAddr>,
    /// Control socket (`control = "PATH"` or `"none"`); the `--control` flag overrides it.
    pub control: Option<PathBuf>,
    /// This node of a cluster of gateways (`[cluster]`, `--cluster`); then `listen` is portal
    /// group N (the node number), not 1.
    pub cluster: Option<ironsan_server::cluster::ClusterConfig>,
}

/// Check an iSCSI name (RFC 7143 §4.2.7): `iqn.`, `eui.` or `naa.` form, at most 223 bytes.
pub(crate) fn check_iscsi_name(name: &str) -> Result<(), String> {
    if name.len() > 223 {
        return Err(format!("iSCSI name '{name}' is longer than 223 bytes"));
    }
    let ok_chars = name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-.:".contains(c));
    let ok_form = name.starts_with("iqn.") || name.starts_with("eui.") || name.starts_with("naa.");
    if !ok_form || !ok_chars {
        return Err(format!(
            "'{name}' is not a valid iSCSI name (use lower case, e.g. iqn.2026-11.org.example:disk1)"
        ));
    }
    Ok(())
}

/// The configuration file `ironsan serve` reads when neither `--config` nor
/// `$IRONSAN_CONFIG` names one and no target flags are given.
pub(crate) const DEFAULT_CONFIG_PATH: &str = "/etc/ironsan/ironsan.toml";

/// Where `ironsan serve` takes its targets from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    /// `--config FILE`.
    Flag(PathBuf),
    /// `$IRONSAN_CONFIG`.
    Env(PathBuf),
    /// [`DEFAULT_CONFIG_PATH`] (it exists).
    Default(PathBuf),
    /// The command-line flags, or the embedded default (one file LUN) when there are none.
    Flags,
}

impl Source {
    /// The configuration file, if one is used.
    pub(crate) fn path(&self) -> Option<&Path> {
        match self {
            Source::Flag(p) | Source::Env(p) | Source::Default(p) => Some(p),
            Source::Flags => None,
        }
    }
}

/// Decide where the configuration comes from: `--config` first; then `$IRONSAN_CONFIG`
/// (an error together with target flags such as `--listen` or `--lun`, as `--config` is);
/// then the target flags; then `default` if it exists; else the embedded default.
pub(crate) fn config_source(
    flag: Option<&Path>,
    env: Option<&std::ffi::OsStr>,
    target_flags: bool,
    default: &Path,
) -> Result<Source, String> {
    if let Some(p) = flag {
        return Ok(Source::Flag(p.to_owned()));
    }
    if let Some(e) = env.filter(|e| !e.is_empty()) {
        if target_flags {
            return Err(format!(
                "IRONSAN_CONFIG={} and the target flags (--listen, --target, --lun, --chap, --acl, …) both describe the targets: unset one",
                Path::new(e).display()
            ));
        }
        return Ok(Source::Env(PathBuf::from(e)));
    }
    if target_flags {
        return Ok(Source::Flags);
    }
    if default.exists() {
        return Ok(Source::Default(default.to_owned()));
    }
    Ok(Source::Flags)
}
