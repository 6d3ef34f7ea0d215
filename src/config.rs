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
pub use ironsan_server::limits::parse_on_off;
pub use ironsan_server::Limits;
use ironsan_server::{Access, AclRule, ChapAccount, PortalGroup};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use toml::Spanned;

/// Default target name of the embedded default.
pub const DEFAULT_TARGET: &str = "iqn.2026-11.org.ironsan:default";
/// Default portal.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:3260";

/// Which backend a LUN uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    Null {
        size: u64,
    },
    Ram {
        size: u64,
    },
    File {
        path: PathBuf,
        size: Option<u64>,
    },
    /// An image of a Ceph cluster (`rbd:POOL[/NAMESPACE]/IMAGE`).
    Rbd(RbdSpec),
}

/// An RBD LUN's image and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdSpec {
    pub pool: String,
    pub namespace: Option<String>,
    pub image: String,
    /// `conf=PATH`; `None`: librados' own search.
    pub conf: Option<PathBuf>,
    /// `id=NAME`: the cephx client (`client.NAME`).
    pub id: String,
    /// `timeout=SECS`: how long one operation may wait for the cluster.
    pub timeout_secs: u64,
}

/// Default cephx client of RBD LUNs.
pub const RBD_DEFAULT_ID: &str = "admin";

impl RbdSpec {
    /// `POOL/IMAGE` or `POOL/NAMESPACE/IMAGE`.
    pub fn image_spec(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{}/{ns}/{}", self.pool, self.image),
            None => format!("{}/{}", self.pool, self.image),
        }
    }
}

/// One LUN, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LunPlan {
    pub backing: Backing,
    pub direct: bool,
    pub write_cache: bool,
    pub read_only: bool,
    pub block_size: u32,
    /// Reported physical block size; 0 = the logical block size.
    pub physical_block_size: u32,
    /// Unit serial number (VPD 80h); `None`: the NAA in hex.
    pub serial: Option<String>,
    /// The 8-byte NAA designator (VPD 83h, NAA 2h, 3h or 5h); `None`: derived from the
    /// target name and LUN number (NAA 3h, locally assigned).
    pub naa: Option<u64>,
    /// Fault injection rules (`fault=RULE`, grammar in `ironsan_backend::fault`), validated;
    /// empty: no fault wrapper.
    pub faults: Vec<String>,
    /// Seed of the fault PRNG (`fault-seed=N`).
    pub fault_seed: u64,
}

impl LunPlan {
    /// A LUN with the given backing and default options.
    pub fn new(backing: Backing) -> Self {
        LunPlan {
            backing,
            direct: false,
            write_cache: false,
            read_only: false,
            block_size: 512,
            physical_block_size: 0,
            serial: None,
            naa: None,
            faults: Vec::new(),
            fault_seed: 1,
        }
    }
}

/// Parse a full `--lun` value: `SPEC[,OPTION]...` where OPTION is `ro`, `direct`, `wce`,
/// `bs=N` (logical block size), `pbs=N` (reported physical block size), `serial=S`,
/// `naa=0xHEX16` (see [`parse_naa`]), `fault=RULE` (once per rule; see docs/INTEGRITY.md),
/// `fault-seed=N`, and for `rbd:` LUNs `conf=PATH`, `id=NAME` and `timeout=SECS`.
pub fn parse_lun(value: &str, data_dir: &Path) -> Result<LunPlan, String> {
    let mut parts = value.split(',');
    let spec = parts.next().unwrap_or_default();
    let mut plan = LunPlan::new(parse_lun_spec(spec, data_dir)?);
    for opt in parts {
        match opt.split_once('=') {
            None if opt == "ro" => plan.read_only = true,
            None if opt == "direct" => plan.direct = true,
            None if opt == "wce" => plan.write_cache = true,
            Some(("bs", v)) => {
                plan.block_size = v
                    .parse()
                    .map_err(|_| format!("'{value}': bs={v} is not a number"))
                    .and_then(check_block_size)?
            }
            Some(("pbs", v)) => {
                plan.physical_block_size = v
                    .parse()
                    .map_err(|_| format!("'{value}': pbs={v} is not a number"))
                    .and_then(check_block_size)?
            }
            Some(("serial", v)) => {
                plan.serial = Some(check_serial(v).map_err(|e| format!("'{value}': {e}"))?)
            }
            Some(("naa", v)) => {
                plan.naa = Some(parse_naa(v).map_err(|e| format!("'{value}': {e}"))?)
            }
            Some(("fault", v)) => {
                ironsan_backend::FaultRule::parse(v).map_err(|e| format!("'{value}': {e}"))?;
                plan.faults.push(v.to_string());
            }
            Some(("fault-seed", v)) => {
                plan.fault_seed = v
                    .parse()
                    .map_err(|_| format!("'{value}': fault-seed={v} is not a number"))?
            }
            Some((k @ ("conf" | "id" | "timeout"), v)) => {
                let Backing::Rbd(r) = &mut plan.backing else {
                    return Err(format!("'{value}': {k}= applies to rbd: LUNs only"));
                };
                match k {
                    "conf" if !v.is_empty() => r.conf = Some(PathBuf::from(v)),
                    "id" if !v.is_empty() && v.bytes().all(|b| b.is_ascii_graphic()) => {
                        r.id = v.strip_prefix("client.").unwrap_or(v).to_string()
                    }
                    "timeout" => {
                        r.timeout_secs = v
                            .parse()
                            .ok()
                            .filter(|n| (1..=3600).contains(n))
                            .ok_or_else(|| {
                                format!("'{value}': timeout={v} must be 1 to 3600 seconds")
                            })?
                    }
                    _ => return Err(format!("'{value}': {k}= needs a value")),
                }
            }
            _ => {
                return Err(format!(
                    "'{value}': unknown LUN option '{opt}' (ro, direct, wce, bs=N, pbs=N, serial=S, naa=0xHEX, fault=RULE, fault-seed=N; rbd: conf=PATH, id=NAME, timeout=SECS)"
                ))
            }
        }
    }
    if plan.physical_block_size != 0 && plan.physical_block_size < plan.block_size {
        return Err(format!("'{value}': pbs must be at least bs"));
    }
    Ok(plan)
}

/// Parse an 8-byte NAA designator: 16 hex digits, optionally after `0x`, whose first digit
/// is an 8-byte NAA format: 2 (IEEE extended), 3 (locally assigned) or 5 (IEEE registered).
/// NAA 6h (IEEE registered extended) needs 16 bytes and is not accepted.
pub fn parse_naa(v: &str) -> Result<u64, String> {
    let hex = v
        .strip_prefix("0x")
        .or_else(|| v.strip_prefix("0X"))
        .unwrap_or(v);
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "naa '{v}' must be 16 hex digits (an 8-byte NAA designator, e.g. 0x3000c0ffee000001)"
        ));
    }
    let n = u64::from_str_radix(hex, 16).map_err(|e| format!("naa '{v}': {e}"))?;
    match n >> 60 {
        0x2 | 0x3 | 0x5 => Ok(n),
        k => Err(format!(
            "naa '{v}': NAA type {k:X}h is not an 8-byte format (use 2h, 3h or 5h)"
        )),
    }
}

/// A unit serial number (VPD 80h): 1 to 64 printable ASCII characters without spaces or
/// commas (a `--lun` spec separates its options with commas).
pub fn check_serial(v: &str) -> Result<String, String> {
    if v.is_empty() || v.len() > 64 || !v.bytes().all(|b| b.is_ascii_graphic() && b != b',') {
        return Err(format!(
            "serial '{}' must be 1 to 64 printable ASCII characters without spaces or commas",
            v.escape_debug()
        ));
    }
    Ok(v.to_string())
}

/// One target, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetPlan {
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
    /// ALUA target port groups (`[[target.alua_group]]`), ports named by portal group tag;
    /// `None`: one group per portal group, active/optimized.
    pub alua: Option<Vec<ironsan_scsi::PortGroup>>,
}

/// Most connections per session a target may offer: each is a reader and a writer task with
/// their buffers, so the session-wide count stays small; `[limits] max_connections` bounds
/// the server's total.
pub const MAX_CONNECTIONS_PER_SESSION: u16 = 64;

#[cfg(test)]
impl Plan {
    /// Every portal address of every group.
    pub fn listen(&self) -> Vec<SocketAddr> {
        self.portal_groups
            .iter()
            .flat_map(|g| g.listen.iter().copied())
            .collect()
    }
}

/// Everything `serve` needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Portal groups; `listen = [...]` (or `--listen`) is the group with tag 1.
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
}

/// Shortest CHAP secret accepted (RFC 3720 §8.2.1 asks for at least 96 bits; Windows and
/// several initiators require 12 bytes).
pub const MIN_SECRET_LEN: usize = 12;
/// Longest CHAP secret accepted (what open-iscsi and libiscsi can store).
pub const MAX_SECRET_LEN: usize = 255;

fn check_chap_user(user: &str) -> Result<(), String> {
    if user.is_empty() || user.len() > 255 || user.chars().any(|c| c.is_control()) {
        return Err(format!(
            "CHAP user name '{}' must be 1 to 255 printable characters",
            user.escape_debug()
        ));
    }
    Ok(())
}

fn check_secret(secret: &[u8]) -> Result<(), String> {
    if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&secret.len()) {
        return Err(format!(
            "CHAP secret is {} bytes; it must be {MIN_SECRET_LEN} to {MAX_SECRET_LEN} bytes",
            secret.len()
        ));
    }
    if secret.contains(&0) {
        return Err("CHAP secret contains a NUL byte".into());
    }
    Ok(())
}

/// Read a secret from a file: its content less one trailing newline.
fn read_secret_file(path: &Path) -> Result<Vec<u8>, String> {
    let mut b = std::fs::read(path)
        .map_err(|e| format!("cannot read secret file {}: {e}", path.display()))?;
    if b.ends_with(b"\n") {
        b.pop();
        if b.ends_with(b"\r") {
            b.pop();
        }
    }
    Ok(b)
}

fn read_secret_env(var: &str) -> Result<Vec<u8>, String> {
    std::env::var_os(var)
        .map(|v| {
            use std::os::unix::ffi::OsStrExt;
            v.as_bytes().to_vec()
        })
        .ok_or_else(|| format!("environment variable {var} (CHAP secret) is not set"))
}

/// Parse a credential flag: `USER:SECRET`, where SECRET is `@PATH` (read from a file),
/// `env:VAR` (from the environment) or the secret itself. With `secret_file`, the whole value
/// is the user name (which may then contain ':').
pub fn parse_credential(
    flag: &str,
    value: &str,
    secret_file: Option<&Path>,
) -> Result<ChapAccount, String> {
    let (user, secret) = match secret_file {
        Some(f) => (
            value,
            read_secret_file(f).map_err(|e| format!("--chap-secret-file: {e}"))?,
        ),
        None => {
            let (user, spec) = value.split_once(':').ok_or_else(|| {
                format!("{flag}: expected USER:SECRET, USER:@FILE or USER:env:VAR")
            })?;
            let secret = if let Some(path) = spec.strip_prefix('@') {
                read_secret_file(Path::new(path)).map_err(|e| format!("{flag}: {e}"))?
            } else if let Some(var) = spec.strip_prefix("env:") {
                read_secret_env(var).map_err(|e| format!("{flag}: {e}"))?
            } else {
                spec.as_bytes().to_vec()
            };
            (user, secret)
        }
    };
    check_chap_user(user).map_err(|e| format!("{flag}: {e}"))?;
    check_secret(&secret).map_err(|e| format!("{flag}: {e}"))?;
    Ok(ChapAccount::new(user, secret))
}

/// Access-control flags for the flag-defined target and for discovery.
#[derive(Debug, Default, Clone)]
pub struct AuthFlags {
    pub chap: Option<String>,
    pub mutual_chap: Option<String>,
    pub chap_secret_file: Option<PathBuf>,
    pub discovery_chap: Option<String>,
    pub discovery_mutual_chap: Option<String>,
    pub acl: Vec<String>,
    pub discovery_acl: Vec<String>,
}

impl AuthFlags {
    fn access(
        chap: &Option<String>,
        chap_flag: &str,
        secret_file: Option<&Path>,
        mutual: &Option<String>,
        mutual_flag: &str,
        acl: &[String],
        acl_flag: &str,
    ) -> Result<Access, String> {
        let mut a = Access::default();
        if let Some(v) = chap {
            a.chap = Some(parse_credential(chap_flag, v, secret_file)?);
        }
        if let Some(v) = mutual {
            a.mutual_chap = Some(parse_credential(mutual_flag, v, None)?);
        }
        for e in acl {
            a.acl
                .push(AclRule::parse(e).map_err(|e| format!("{acl_flag} {e}"))?);
        }
        a.validate().map_err(|e| format!("{mutual_flag}: {e}"))?;
        Ok(a)
    }

    /// (target access, discovery access)
    pub fn plan(&self) -> Result<(Access, Access), String> {
        if self.chap_secret_file.is_some() && self.chap.is_none() {
            return Err("--chap-secret-file: needs --chap USER".into());
        }
        let target = Self::access(
            &self.chap,
            "--chap",
            self.chap_secret_file.as_deref(),
            &self.mutual_chap,
            "--mutual-chap",
            &self.acl,
            "--acl",
        )?;
        let discovery = Self::access(
            &self.discovery_chap,
            "--discovery-chap",
            None,
            &self.discovery_mutual_chap,
            "--discovery-mutual-chap",
            &self.discovery_acl,
            "--discovery-acl",
        )?;
        Ok((target, discovery))
    }
}

/// Parse a `--lun` SPEC: `null:SIZE`, `ram:SIZE`, `file:PATH` or `file:PATH:SIZE`. Relative
/// paths are taken relative to `data_dir`.
pub fn parse_lun_spec(spec: &str, data_dir: &Path) -> Result<Backing, String> {
    let (kind, rest) = spec.split_once(':').ok_or_else(|| {
        format!("'{spec}': expected KIND:..., e.g. ram:1G, null:16T, file:PATH[:SIZE]")
    })?;
    let size = |s: &str| {
        parse_size(s)
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("'{s}' is not a size (e.g. 512M, 1G, 16T)"))
    };
    match kind {
        "null" => Ok(Backing::Null { size: size(rest)? }),
        "ram" => Ok(Backing::Ram { size: size(rest)? }),
        "file" => {
            if rest.is_empty() {
                return Err(format!("'{spec}': file needs a path"));
            }
            // The size, if any, is after the last ':' (paths may contain ':' themselves only
            // if a size follows).
            let (path, size) = match rest.rsplit_once(':') {
                Some((p, s)) if !p.is_empty() && parse_size(s).is_some() => (p, Some(size(s)?)),
                _ => (rest, None),
            };
            let path = Path::new(path);
            let path = if path.is_absolute() {
                path.to_owned()
            } else {
                data_dir.join(path)
            };
            Ok(Backing::File { path, size })
        }
        "rbd" => parse_rbd(rest).map_err(|e| format!("'{spec}': {e}")),
        other => Err(format!(
            "unknown backend '{other}' in '{spec}' (expected null, ram, file or rbd)"
        )),
    }
}

/// `POOL/IMAGE` or `POOL/NAMESPACE/IMAGE` of an `rbd:` spec (names as Ceph allows them: no
/// `/`, `@` or `,`, not empty).
fn parse_rbd(rest: &str) -> Result<Backing, String> {
    let usage = || "rbd needs POOL/IMAGE or POOL/NAMESPACE/IMAGE (e.g. rbd:rbd/disk1)".to_string();
    let parts: Vec<&str> = rest.split('/').collect();
    let bad = |s: &&str| {
        s.is_empty() || s.contains(['@', ',']) || s.bytes().any(|b| b.is_ascii_control())
    };
    if parts.iter().any(bad) {
        return Err(usage());
    }
    let (pool, namespace, image) = match parts.as_slice() {
        [p, i] => (p, None, i),
        [p, n, i] => (p, Some(n.to_string()), i),
        _ => return Err(usage()),
    };
    Ok(Backing::Rbd(RbdSpec {
        pool: pool.to_string(),
        namespace,
        image: image.to_string(),
        conf: None,
        id: RBD_DEFAULT_ID.to_string(),
        timeout_secs: ironsan_backend::rbd::DEFAULT_TIMEOUT.as_secs(),
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<Vec<Spanned<String>>>,
    data_dir: Option<String>,
    queue_depth: Option<Spanned<u32>>,
    #[serde(default)]
    portal_group: Vec<FilePortalGroup>,
    #[serde(default)]
    target: Vec<FileTarget>,
    discovery: Option<FileAccess>,
    limits: Option<Limits>,
    metrics: Option<Spanned<String>>,
    control: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FilePortalGroup {
    tag: Spanned<i64>,
    listen: Spanned<Vec<Spanned<String>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTarget {
    name: Spanned<String>,
    alias: Option<String>,
    portal_groups: Option<Spanned<Vec<Spanned<i64>>>>,
    connections_per_session: Option<Spanned<i64>>,
    #[serde(default)]
    lun: Vec<FileLun>,
    #[serde(default)]
    alua_group: Vec<FileAluaGroup>,
    acl: Option<Vec<Spanned<String>>>,
    chap: Option<Spanned<FileChap>>,
    mutual_chap: Option<Spanned<FileChap>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileAluaGroup {
    id: Spanned<i64>,
    portal_groups: Spanned<Vec<Spanned<i64>>>,
    state: Option<Spanned<String>>,
    preferred: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileAccess {
    acl: Option<Vec<Spanned<String>>>,
    chap: Option<Spanned<FileChap>>,
    mutual_chap: Option<Spanned<FileChap>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileChap {
    user: String,
    secret: Option<String>,
    secret_file: Option<String>,
    secret_env: Option<String>,
}

type At<'a> = &'a dyn Fn(std::ops::Range<usize>, String) -> String;

fn chap_from_file(c: &Spanned<FileChap>, base: &Path, at: At) -> Result<ChapAccount, String> {
    let f = c.get_ref();
    let err = |m: String| at(c.span(), m);
    let secret = match (&f.secret, &f.secret_file, &f.secret_env) {
        (Some(s), None, None) => s.as_bytes().to_vec(),
        (None, Some(p), None) => read_secret_file(&base.join(p)).map_err(err)?,
        (None, None, Some(v)) => read_secret_env(v).map_err(err)?,
        _ => {
            return Err(err(
                "give exactly one of secret, secret_file or secret_env".into()
            ))
        }
    };
    check_chap_user(&f.user).map_err(err)?;
    check_secret(&secret).map_err(err)?;
    Ok(ChapAccount::new(f.user.clone(), secret))
}

/// `[[target.alua_group]]`s: identifiers 1-65535 once each, ports that are portal groups
/// serving the target, none in two groups, every serving portal group in one; states other
/// than transitioning (a timed state the control socket enters).
fn alua_from_file(
    list: &[FileAluaGroup],
    serving: &[u16],
    target: &str,
    at: At,
) -> Result<Option<Vec<ironsan_scsi::PortGroup>>, String> {
    if list.is_empty() {
        return Ok(None);
    }
    let mut out: Vec<ironsan_scsi::PortGroup> = Vec::new();
    for g in list {
        let id = u16::try_from(*g.id.get_ref())
            .ok()
            .filter(|i| *i > 0)
            .ok_or_else(|| {
                at(
                    g.id.span(),
                    "alua_group id must be between 1 and 65535".into(),
                )
            })?;
        if out.iter().any(|x| x.id == id) {
            return Err(at(g.id.span(), format!("alua_group {id} is defined twice")));
        }
        if g.portal_groups.get_ref().is_empty() {
            return Err(at(
                g.portal_groups.span(),
                format!("alua_group {id} names no portal group"),
            ));
        }
        let mut ports = Vec::new();
        for p in g.portal_groups.get_ref() {
            let tag = u16::try_from(*p.get_ref())
                .ok()
                .filter(|t| serving.contains(t))
                .ok_or_else(|| {
                    at(
                        p.span(),
                        format!(
                            "portal group {} does not serve target {target} (its groups: {serving:?})",
                            p.get_ref()
                        ),
                    )
                })?;
            if let Some(other) = out.iter().find(|x| x.ports.contains(&tag)) {
                return Err(at(
                    p.span(),
                    format!(
                        "portal group {tag} is already in alua_group {}; a portal group belongs to one",
                        other.id
                    ),
                ));
            }
            if !ports.contains(&tag) {
                ports.push(tag);
            }
        }
        let mut pg = ironsan_scsi::PortGroup::new(id, ports);
        if let Some(st) = &g.state {
            pg.state = ironsan_scsi::AccessState::parse(st.get_ref())
                .filter(|s| *s != ironsan_scsi::AccessState::Transitioning)
                .ok_or_else(|| {
                    at(
                        st.span(),
                        format!(
                            "'{}' is not a state: active/optimized, active/non-optimized, standby, unavailable or offline",
                            st.get_ref()
                        ),
                    )
                })?;
        }
        pg.preferred = g.preferred.unwrap_or(false);
        out.push(pg);
    }
    if let Some(tag) = serving
        .iter()
        .find(|t| !out.iter().any(|g| g.ports.contains(t)))
    {
        let span = list.last().map_or(0..0, |g| g.id.span());
        return Err(at(
            span,
            format!("portal group {tag} serves target {target} but is in no [[target.alua_group]]"),
        ));
    }
    Ok(Some(out))
}

fn access_from_file(
    acl: &Option<Vec<Spanned<String>>>,
    chap: &Option<Spanned<FileChap>>,
    mutual: &Option<Spanned<FileChap>>,
    base: &Path,
    at: At,
) -> Result<Access, String> {
    let mut a = Access::default();
    for e in acl.iter().flatten() {
        a.acl
            .push(AclRule::parse(e.get_ref()).map_err(|m| at(e.span(), format!("acl {m}")))?);
    }
    if let Some(c) = chap {
        a.chap = Some(chap_from_file(c, base, at)?);
    }
    if let Some(m) = mutual {
        a.mutual_chap = Some(chap_from_file(m, base, at)?);
    }
    if let Err(e) = a.validate() {
        let span = mutual
            .as_ref()
            .or(chap.as_ref())
            .map(|c| c.span())
            .unwrap_or(0..0);
        return Err(at(span, e));
    }
    Ok(a)
}

/// `[limits]` as read (serde has checked each key's type and form), checked against its
/// bounds; an error names the line of the key.
fn limits_from_file(l: Option<Limits>, text: &str, at: At) -> Result<Limits, String> {
    let l = l.unwrap_or_default();
    l.check()
        .map_err(|e| at(key_span(text, "limits", e.key), e.message))?;
    Ok(l)
}

/// Where `key = …` is written inside the `[table]` of `text` (for errors found after parsing);
/// the table's header, or the start, if it cannot be found.
fn key_span(text: &str, table: &str, key: &str) -> std::ops::Range<usize> {
    let header = format!("[{table}]");
    let Some(start) = text.find(&header) else {
        return 0..0;
    };
    let mut begin = start;
    for line in text[start..].split_inclusive('\n') {
        let t = line.trim_start();
        if begin > start && t.starts_with('[') {
            break;
        }
        if t.strip_prefix(key)
            .is_some_and(|r| r.trim_start().starts_with('='))
        {
            return begin..begin + line.len();
        }
        begin += line.len();
    }
    start..start + header.len()
}

/// The key of the `key = value` line holding `offset`, if that line is one.
fn key_at(text: &str, offset: usize) -> Option<&str> {
    let line_start = text.get(..offset)?.rfind('\n').map_or(0, |i| i + 1);
    let line = text.get(line_start..)?.lines().next()?;
    let (k, _) = line.split_once('=')?;
    let k = k.trim();
    (!k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'))
    .then_some(k)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLun {
    spec: Option<Spanned<String>>,
    backend: Option<Spanned<String>>,
    path: Option<Spanned<String>>,
    size: Option<Spanned<String>>,
    #[serde(default)]
    direct: bool,
    #[serde(default)]
    write_cache: bool,
    #[serde(default)]
    read_only: bool,
    block_size: Option<Spanned<u32>>,
    physical_block_size: Option<Spanned<u32>>,
    serial: Option<Spanned<String>>,
    naa: Option<Spanned<String>>,
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map(|s| s.matches('\n').count() + 1)
        .unwrap_or(1)
}

/// Check an iSCSI name (RFC 7143 §4.2.7): `iqn.`, `eui.` or `naa.` form, at most 223 bytes.
pub fn check_iscsi_name(name: &str) -> Result<(), String> {
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

fn check_block_size(bs: u32) -> Result<u32, String> {
    if bs.is_power_of_two() && (512..=65536).contains(&bs) {
        Ok(bs)
    } else {
        Err(format!(
            "block_size {bs} must be a power of two from 512 to 65536"
        ))
    }
}

/// Load and validate a TOML config file.
pub fn load_file(path: &Path) -> Result<Plan, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_file(&text, path)
}

/// Validate config `text` read from `path`.
pub fn parse_file(text: &str, path: &Path) -> Result<Plan, String> {
    let file = path.display();
    let cfg: FileConfig = toml::from_str(text).map_err(|e| {
        let start = e.span().map(|s| s.start).unwrap_or(0);
        let line = line_of(text, start);
        // Errors of a value's own form (a size, a duration, on/off) do not name the key.
        match key_at(text, start).filter(|k| !e.message().contains(k)) {
            Some(k) => format!("{file}:{line}: {k}: {}", e.message()),
            None => format!("{file}:{line}: {}", e.message()),
        }
    })?;
    let at = |span: std::ops::Range<usize>, msg: String| {
        format!("{file}:{}: {msg}", line_of(text, span.start))
    };
    let data_dir = PathBuf::from(cfg.data_dir.unwrap_or_else(|| "./ironsan-data".into()));
    // secret_file paths are relative to the configuration file's directory.
    let base = path.parent().unwrap_or(Path::new("."));
    let addrs = |list: &[Spanned<String>]| -> Result<Vec<SocketAddr>, String> {
        let mut out = Vec::new();
        for l in list {
            out.push(l.get_ref().parse::<SocketAddr>().map_err(|_| {
                at(
                    l.span(),
                    format!(
                        "listen address '{}' is not ADDR:PORT (IPv6 as [::1]:3260)",
                        l.get_ref()
                    ),
                )
            })?);
        }
        Ok(out)
    };
    let mut portal_groups = Vec::new();
    let listen = addrs(cfg.listen.as_deref().unwrap_or_default())?;
    if !listen.is_empty() {
        portal_groups.push(PortalGroup { tag: 1, listen });
    }
    let mut seen: Vec<SocketAddr> = portal_groups
        .iter()
        .flat_map(|g| g.listen.clone())
        .collect();
    for g in &cfg.portal_group {
        let tag = u16::try_from(*g.tag.get_ref())
            .ok()
            .filter(|&t| t != 0)
            .ok_or_else(|| at(g.tag.span(), "portal group tag must be 1 to 65535".into()))?;
        if portal_groups.iter().any(|x: &PortalGroup| x.tag == tag) {
            let why = if tag == 1 && cfg.listen.is_some() {
                " (listen = [...] is portal group 1)"
            } else {
                ""
            };
            return Err(at(
                g.tag.span(),
                format!("portal group {tag} is defined twice{why}"),
            ));
        }
        let listen = addrs(g.listen.get_ref())?;
        if listen.is_empty() {
            return Err(at(
                g.listen.span(),
                format!("portal group {tag} has no listen address"),
            ));
        }
        for (a, l) in listen.iter().zip(g.listen.get_ref()) {
            // Port 0 (any free port, for tests) never clashes.
            if a.port() != 0 && seen.contains(a) {
                return Err(at(l.span(), format!("portal {a} is in two portal groups")));
            }
            seen.push(*a);
        }
        portal_groups.push(PortalGroup { tag, listen });
    }
    if portal_groups.is_empty() {
        portal_groups.push(PortalGroup {
            tag: 1,
            listen: vec![DEFAULT_LISTEN
                .parse()
                .map_err(|_| "bad default listen address".to_string())?],
        });
    }
    let queue_depth = match cfg.queue_depth {
        Some(q) if *q.get_ref() == 0 || *q.get_ref() > 4096 => {
            return Err(at(
                q.span(),
                "queue_depth must be between 1 and 4096".into(),
            ))
        }
        Some(q) => *q.get_ref(),
        None => 128,
    };
    let mut targets = Vec::new();
    for t in cfg.target {
        check_iscsi_name(t.name.get_ref()).map_err(|e| at(t.name.span(), e))?;
        if targets
            .iter()
            .any(|x: &TargetPlan| &x.name == t.name.get_ref())
        {
            return Err(at(
                t.name.span(),
                format!("target '{}' is defined twice", t.name.get_ref()),
            ));
        }
        let mut luns = Vec::new();
        for l in t.lun {
            luns.push(lun_from_file(l, &data_dir, &at)?);
        }
        if luns.is_empty() {
            return Err(at(
                t.name.span(),
                format!("target '{}' has no [[target.lun]]", t.name.get_ref()),
            ));
        }
        let access = access_from_file(&t.acl, &t.chap, &t.mutual_chap, base, &at)?;
        let groups = match &t.portal_groups {
            None => None,
            Some(list) => {
                if list.get_ref().is_empty() {
                    return Err(at(
                        list.span(),
                        "portal_groups is empty (leave it out to serve on every portal)".into(),
                    ));
                }
                let mut tags = Vec::new();
                for g in list.get_ref() {
                    let tag = u16::try_from(*g.get_ref())
                        .ok()
                        .filter(|t| portal_groups.iter().any(|p| p.tag == *t))
                        .ok_or_else(|| {
                            at(
                                g.span(),
                                format!("no [[portal_group]] with tag {}", g.get_ref()),
                            )
                        })?;
                    if !tags.contains(&tag) {
                        tags.push(tag);
                    }
                }
                Some(tags)
            }
        };
        let connections_per_session = match &t.connections_per_session {
            None => None,
            Some(n) => Some(
                u16::try_from(*n.get_ref())
                    .ok()
                    .filter(|n| (1..=MAX_CONNECTIONS_PER_SESSION).contains(n))
                    .ok_or_else(|| {
                        at(
                            n.span(),
                            format!(
                                "connections_per_session must be between 1 and \
                                 {MAX_CONNECTIONS_PER_SESSION}"
                            ),
                        )
                    })?,
            ),
        };
        let serving: Vec<u16> = groups
            .clone()
            .unwrap_or_else(|| portal_groups.iter().map(|p| p.tag).collect());
        let alua = alua_from_file(&t.alua_group, &serving, t.name.get_ref(), &at)?;
        targets.push(TargetPlan {
            name: t.name.into_inner(),
            alias: t.alias,
            luns,
            access,
            portal_groups: groups,
            connections_per_session,
            alua,
        });
    }
    if targets.is_empty() {
        return Err(format!("{file}: no [[target]] defined"));
    }
    // Two LUs with one identity would look like two paths to one disk to a multipath host.
    let mut ids = std::collections::HashMap::new();
    for t in &targets {
        for (n, l) in t.luns.iter().enumerate() {
            if let Some(naa) = l.naa {
                if let Some((t0, n0)) = ids.insert(naa, (&t.name, n)) {
                    return Err(format!(
                        "{file}: {} LUN {n} and {t0} LUN {n0} have the same naa 0x{naa:016x}",
                        t.name
                    ));
                }
            }
        }
    }
    let discovery = match &cfg.discovery {
        Some(d) => access_from_file(&d.acl, &d.chap, &d.mutual_chap, base, &at)?,
        None => Access::default(),
    };
    let limits = limits_from_file(cfg.limits, text, &at)?;
    let metrics = match &cfg.metrics {
        Some(m) => Some(m.get_ref().parse::<SocketAddr>().map_err(|_| {
            at(
                m.span(),
                format!(
                    "metrics address '{}' is not ADDR:PORT (e.g. 127.0.0.1:9360)",
                    m.get_ref()
                ),
            )
        })?),
        None => None,
    };
    let control = match &cfg.control {
        Some(c) if c.get_ref().is_empty() => {
            return Err(at(
                c.span(),
                "control must be a socket path or \"none\"".into(),
            ))
        }
        Some(c) => Some(PathBuf::from(c.get_ref())),
        None => None,
    };
    Ok(Plan {
        portal_groups,
        data_dir,
        queue_depth,
        targets,
        discovery,
        limits,
        metrics,
        control,
    })
}

fn lun_from_file(l: FileLun, data_dir: &Path, at: At) -> Result<LunPlan, String> {
    let mut from_spec = None;
    let backing = match (&l.spec, &l.backend) {
        (Some(spec), None) => {
            let plan = parse_lun(spec.get_ref(), data_dir).map_err(|e| at(spec.span(), e))?;
            let backing = plan.backing.clone();
            from_spec = Some(plan);
            backing
        }
        (None, Some(b)) => {
            let size = match &l.size {
                Some(s) => Some(parse_size(s.get_ref()).filter(|&n| n > 0).ok_or_else(|| {
                    at(
                        s.span(),
                        format!("'{}' is not a size (e.g. 512M, 1G, 16T)", s.get_ref()),
                    )
                })?),
                None => None,
            };
            let need_size = |kind: &str| {
                size.ok_or_else(|| at(b.span(), format!("a {kind} LUN needs size = \"...\"")))
            };
            match b.get_ref().as_str() {
                "null" => Backing::Null {
                    size: need_size("null")?,
                },
                "ram" => Backing::Ram {
                    size: need_size("ram")?,
                },
                "file" => {
                    let p = l
                        .path
                        .as_ref()
                        .ok_or_else(|| at(b.span(), "a file LUN needs path = \"...\"".into()))?;
                    let path = Path::new(p.get_ref());
                    let path = if path.is_absolute() {
                        path.to_owned()
                    } else {
                        data_dir.join(path)
                    };
                    Backing::File { path, size }
                }
                "rbd" => {
                    return Err(at(
                        b.span(),
                        "an rbd LUN is given as spec = \"rbd:POOL/IMAGE[,conf=PATH,id=NAME]\"".into(),
                    ))
                }
                other => {
                    return Err(at(
                        b.span(),
                        format!("unknown backend '{other}' (expected null, ram or file; rbd as spec = \"rbd:...\")"),
                    ))
                }
            }
        }
        (Some(spec), Some(_)) => {
            return Err(at(
                spec.span(),
                "give either spec or backend, not both".into(),
            ))
        }
        (None, None) => {
            return Err("a [[target.lun]] needs spec = \"...\" or backend = \"...\"".into())
        }
    };
    let base = from_spec.unwrap_or_else(|| LunPlan::new(backing.clone()));
    let serial = match &l.serial {
        Some(s) => Some(check_serial(s.get_ref()).map_err(|e| at(s.span(), e))?),
        None => base.serial,
    };
    let naa = match &l.naa {
        Some(v) => Some(parse_naa(v.get_ref()).map_err(|e| at(v.span(), e))?),
        None => base.naa,
    };
    let block_size = match &l.block_size {
        Some(b) => check_block_size(*b.get_ref()).map_err(|e| at(b.span(), e))?,
        None => base.block_size,
    };
    let physical_block_size = match &l.physical_block_size {
        Some(b) => check_block_size(*b.get_ref()).map_err(|e| at(b.span(), e))?,
        None => base.physical_block_size,
    };
    Ok(LunPlan {
        backing,
        direct: l.direct || base.direct,
        write_cache: l.write_cache || base.write_cache,
        read_only: l.read_only || base.read_only,
        block_size,
        physical_block_size,
        serial,
        naa,
        faults: base.faults,
        fault_seed: base.fault_seed,
    })
}

/// The configuration file `ironsan serve` reads when neither `--config` nor
/// `$IRONSAN_CONFIG` names one and no target flags are given.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/ironsan/ironsan.toml";

/// Where `ironsan serve` takes its targets from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
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
    pub fn path(&self) -> Option<&Path> {
        match self {
            Source::Flag(p) | Source::Env(p) | Source::Default(p) => Some(p),
            Source::Flags => None,
        }
    }
}

/// Decide where the configuration comes from: `--config` first; then `$IRONSAN_CONFIG`
/// (an error together with target flags such as `--listen` or `--lun`, as `--config` is);
/// then the target flags; then `default` if it exists; else the embedded default.
pub fn config_source(
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

/// The plan from command-line flags.
pub fn from_flags(
    listen: &[String],
    target: Option<&str>,
    luns: &[String],
    data_dir: &Path,
    direct: bool,
    write_cache: bool,
    auth: &AuthFlags,
) -> Result<Plan, String> {
    let (access, discovery) = auth.plan()?;
    let mut addrs = Vec::new();
    for l in listen {
        addrs.push(
            l.parse::<SocketAddr>()
                .map_err(|_| format!("--listen '{l}': expected ADDR:PORT (IPv6 as [::1]:3260)"))?,
        );
    }
    if addrs.is_empty() {
        addrs.push(
            DEFAULT_LISTEN
                .parse()
                .map_err(|_| "bad default listen address".to_string())?,
        );
    }
    let name = target.unwrap_or(DEFAULT_TARGET).to_string();
    check_iscsi_name(&name).map_err(|e| format!("--target: {e}"))?;
    let mut plans = Vec::new();
    for value in luns {
        let mut plan = parse_lun(value, data_dir).map_err(|e| format!("--lun {e}"))?;
        plan.direct |= direct;
        plan.write_cache |= write_cache;
        plans.push(plan);
    }
    if plans.is_empty() {
        let mut plan = LunPlan::new(Backing::File {
            path: data_dir.join("lun0.img"),
            size: Some(1 << 30),
        });
        plan.direct = direct;
        plan.write_cache = write_cache;
        plans.push(plan);
    }
    Ok(Plan {
        portal_groups: vec![PortalGroup {
            tag: 1,
            listen: addrs,
        }],
        data_dir: data_dir.to_owned(),
        queue_depth: 128,
        targets: vec![TargetPlan {
            name,
            alias: None,
            luns: plans,
            access,
            portal_groups: None,
            connections_per_session: None,
            alua: None,
        }],
        discovery,
        limits: Limits::default(),
        metrics: None,
        control: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ironsan_server::limits::parse_duration;

    #[test]
    fn parses_every_lun_spec_form() {
        let d = Path::new("/data");
        assert_eq!(
            parse_lun_spec("null:16T", d),
            Ok(Backing::Null { size: 16 << 40 })
        );
        assert_eq!(
            parse_lun_spec("ram:1G", d),
            Ok(Backing::Ram { size: 1 << 30 })
        );
        assert_eq!(
            parse_lun_spec("file:/dev/sdb", d),
            Ok(Backing::File {
                path: "/dev/sdb".into(),
                size: None
            })
        );
        assert_eq!(
            parse_lun_spec("file:x.img:2G", d),
            Ok(Backing::File {
                path: "/data/x.img".into(),
                size: Some(2 << 30)
            })
        );
        assert!(parse_lun_spec("ram:lots", d)
            .unwrap_err()
            .contains("not a size"));
        assert!(parse_lun_spec("tape:1G", d)
            .unwrap_err()
            .contains("unknown backend 'tape'"));
        assert!(parse_lun_spec("ram", d).is_err());
        assert!(parse_lun_spec("ram:0", d).is_err());
    }

    #[test]
    fn lun_options_follow_the_spec() {
        let d = Path::new("/data");
        let p = parse_lun("ram:1G,ro,wce,bs=4096,pbs=8192,serial=AB12", d).unwrap();
        assert!(p.read_only && p.write_cache && !p.direct);
        assert_eq!((p.block_size, p.physical_block_size), (4096, 8192));
        assert_eq!(p.serial.as_deref(), Some("AB12"));
        assert!(parse_lun("file:x.img:1G,direct", d).unwrap().direct);
        assert!(parse_lun("ram:1G,fast", d)
            .unwrap_err()
            .contains("unknown LUN option 'fast'"));
        assert!(parse_lun("ram:1G,bs=1000", d)
            .unwrap_err()
            .contains("power of two"));
        assert!(parse_lun("ram:1G,bs=4096,pbs=512", d)
            .unwrap_err()
            .contains("pbs"));
    }

    #[test]
    fn lun_identity_naa_and_serial() {
        let d = Path::new("/data");
        let p = parse_lun("ram:1G,serial=DISK-01,naa=0x3000c0ffee000001", d).unwrap();
        assert_eq!(p.serial.as_deref(), Some("DISK-01"));
        assert_eq!(p.naa, Some(0x3000_c0ff_ee00_0001));
        assert_eq!(parse_naa("5000C0FFEE000001"), Ok(0x5000_c0ff_ee00_0001));
        assert_eq!(parse_naa("0x2000000000000001"), Ok(0x2000_0000_0000_0001));
        for (v, what) in [
            ("0x3000c0ffee0001", "16 hex digits"),
            ("0x3000c0ffee00000g", "16 hex digits"),
            ("0x6000c0ffee000001", "not an 8-byte format"),
            ("0x1000c0ffee000001", "not an 8-byte format"),
            ("", "16 hex digits"),
        ] {
            let e = parse_naa(v).unwrap_err();
            assert!(e.contains(what), "{v}: {e}");
        }
        for bad in ["", "a b", "a,b", &"x".repeat(65)] {
            assert!(check_serial(bad).is_err(), "{bad:?}");
        }
        assert!(parse_lun("ram:1G,serial=", d).is_err());
        let text = r#"
[[target]]
name = "iqn.2026-11.org.x:a"
[[target.lun]]
spec = "ram:1M"
serial = "S1"
naa = "0x3000000000000001"
[[target.lun]]
spec = "ram:1M,naa=0x5000000000000002"
[[target]]
name = "iqn.2026-11.org.x:b"
[[target.lun]]
spec = "ram:1M"
"#;
        let plan = parse_file(text, Path::new("t.toml")).unwrap();
        let l = &plan.targets[0].luns;
        assert_eq!(
            (l[0].serial.as_deref(), l[0].naa),
            (Some("S1"), Some(0x3000_0000_0000_0001))
        );
        assert_eq!(
            (l[1].serial.as_deref(), l[1].naa),
            (None, Some(0x5000_0000_0000_0002))
        );
        assert_eq!(plan.targets[1].luns[0].naa, None);
        let base =
            "[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:1M\"\n";
        for (text, want) in [
            (format!("{base}naa = \"0x6000000000000001\"\n"), "t.toml:5: "),
            (format!("{base}naa = \"0x30\"\n"), "t.toml:5: "),
            (format!("{base}serial = \"a b\"\n"), "t.toml:5: "),
            (
                format!("{base}naa = \"0x3000000000000001\"\n[[target.lun]]\nspec = \"ram:1M\"\nnaa = \"3000000000000001\"\n"),
                "same naa",
            ),
        ] {
            let e = parse_file(&text, Path::new("t.toml")).unwrap_err();
            assert!(e.contains(want), "{e}\n{text}");
        }
    }

    #[test]
    fn alua_groups_from_the_file_and_what_is_wrong_with_them() {
        let head = r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]
[[portal_group]]
tag = 2
listen = ["127.0.0.1:3261"]
[[portal_group]]
tag = 3
listen = ["127.0.0.1:3262"]
[[target]]
name = "iqn.2026-11.org.x:a"
portal_groups = [1, 2]
[[target.lun]]
spec = "ram:1M"
"#;
        let ok = format!(
            "{head}[[target.alua_group]]\nid = 10\nportal_groups = [1]\npreferred = true\n\
             [[target.alua_group]]\nid = 20\nportal_groups = [2]\nstate = \"standby\"\n"
        );
        let plan = parse_file(&ok, Path::new("t.toml")).unwrap();
        let g = plan.targets[0].alua.as_ref().unwrap();
        assert_eq!(
            (g[0].id, g[0].ports.clone(), g[0].preferred),
            (10, vec![1], true)
        );
        assert_eq!(
            (g[1].id, g[1].state),
            (20, ironsan_scsi::AccessState::Standby)
        );
        let bad =
            |extra: &str| parse_file(&format!("{head}{extra}"), Path::new("t.toml")).unwrap_err();
        let two = "[[target.alua_group]]\nid = 1\nportal_groups = [1, 2]\n\
                   [[target.alua_group]]\nid = 2\nportal_groups = [2]\n";
        let e = bad(two);
        assert!(
            e.starts_with("t.toml:21:") && e.contains("portal group 2 is already in alua_group 1"),
            "{e}"
        );
        let e = bad("[[target.alua_group]]\nid = 1\nportal_groups = [3]\n");
        assert!(e.contains("portal group 3 does not serve target"), "{e}");
        let e = bad("[[target.alua_group]]\nid = 1\nportal_groups = [1]\n");
        assert!(
            e.contains("portal group 2 serves target iqn.2026-11.org.x:a but is in no"),
            "{e}"
        );
        let e = bad(
            "[[target.alua_group]]\nid = 1\nportal_groups = [1, 2]\nstate = \"transitioning\"\n",
        );
        assert!(
            e.starts_with("t.toml:19:") && e.contains("is not a state"),
            "{e}"
        );
        let e = bad("[[target.alua_group]]\nid = 0\nportal_groups = [1, 2]\n");
        assert!(e.contains("between 1 and 65535"), "{e}");
        let e = bad("[[target.alua_group]]\nid = 1\nportal_groups = [1]\n[[target.alua_group]]\nid = 1\nportal_groups = [2]\n");
        assert!(e.contains("alua_group 1 is defined twice"), "{e}");
    }

    #[test]
    fn portal_groups_and_target_membership() {
        let text = r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260", "[::1]:3260"]
[[portal_group]]
tag = 7
listen = ["127.0.0.1:3261"]
[[target]]
name = "iqn.2026-11.org.x:a"
portal_groups = [7]
[[target.lun]]
spec = "ram:1M"
[[target]]
name = "iqn.2026-11.org.x:b"
[[target.lun]]
spec = "ram:1M"
"#;
        let plan = parse_file(text, Path::new("t.toml")).unwrap();
        assert_eq!(
            plan.portal_groups,
            vec![
                PortalGroup {
                    tag: 1,
                    listen: vec![
                        "127.0.0.1:3260".parse().unwrap(),
                        "[::1]:3260".parse().unwrap()
                    ]
                },
                PortalGroup {
                    tag: 7,
                    listen: vec!["127.0.0.1:3261".parse().unwrap()]
                },
            ]
        );
        assert_eq!(plan.targets[0].portal_groups, Some(vec![7]));
        assert_eq!(plan.targets[1].portal_groups, None);
        // listen = [...] alone is group 1; with [[portal_group]]s it is group 1 beside them.
        let lun = "[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:1M\"\n";
        let plan = parse_file(
            &format!("listen = [\"127.0.0.1:3260\"]\n{lun}"),
            Path::new("t.toml"),
        )
        .unwrap();
        assert_eq!(plan.portal_groups.len(), 1);
        assert_eq!(plan.portal_groups[0].tag, 1);
        let plan = parse_file(
            &format!("listen = [\"127.0.0.1:3260\"]\n[[portal_group]]\ntag = 2\nlisten = [\"127.0.0.1:3261\"]\n{lun}"),
            Path::new("t.toml"),
        )
        .unwrap();
        assert_eq!(
            plan.portal_groups.iter().map(|g| g.tag).collect::<Vec<_>>(),
            vec![1, 2]
        );
        let g = |tag: &str, listen: &str| {
            format!("[[portal_group]]\ntag = {tag}\nlisten = [{listen}]\n")
        };
        for (text, line, what) in [
            (g("0", "\"127.0.0.1:1\""), 2, "1 to 65535"),
            (g("65536", "\"127.0.0.1:1\""), 2, "1 to 65535"),
            (g("2", ""), 3, "no listen address"),
            (g("2", "\"nowhere\""), 3, "not ADDR:PORT"),
            (
                format!("{}{}", g("2", "\"127.0.0.1:1\""), g("2", "\"127.0.0.1:2\"")),
                5,
                "defined twice",
            ),
            (
                format!("listen = [\"127.0.0.1:1\"]\n{}", g("1", "\"127.0.0.1:2\"")),
                3,
                "listen = [...] is portal group 1",
            ),
            (
                format!("{}{}", g("2", "\"127.0.0.1:1\""), g("3", "\"127.0.0.1:1\"")),
                6,
                "two portal groups",
            ),
        ] {
            let text = format!("{text}{lun}");
            let e = parse_file(&text, Path::new("t.toml")).unwrap_err();
            assert!(
                e.starts_with(&format!("t.toml:{line}: ")) && e.contains(what),
                "{e}\n{text}"
            );
        }
        let t = |groups: &str| {
            format!("{}[[target]]\nname = \"iqn.2026-11.org.x:a\"\nportal_groups = {groups}\n[[target.lun]]\nspec = \"ram:1M\"\n", g("2", "\"127.0.0.1:1\""))
        };
        let e = parse_file(&t("[3]"), Path::new("t.toml")).unwrap_err();
        assert!(
            e.starts_with("t.toml:6: ") && e.contains("no [[portal_group]] with tag 3"),
            "{e}"
        );
        let e = parse_file(&t("[]"), Path::new("t.toml")).unwrap_err();
        assert!(e.starts_with("t.toml:6: ") && e.contains("empty"), "{e}");
        assert_eq!(
            parse_file(&t("[2, 2]"), Path::new("t.toml"))
                .unwrap()
                .targets[0]
                .portal_groups,
            Some(vec![2])
        );
    }

    #[test]
    fn fault_options_are_validated_and_kept() {
        let d = Path::new("/data");
        let p = parse_lun(
            "ram:64M,fault=read@1000-1010:eio,fault=write@rate=0.01,fault=any@rate=0.1:delay=50ms,fault-seed=7",
            d,
        )
        .unwrap();
        assert_eq!(p.faults.len(), 3);
        assert_eq!(p.fault_seed, 7);
        assert!(parse_lun("ram:64M", d).unwrap().faults.is_empty());
        assert!(parse_lun("ram:64M,fault=read@9-1", d)
            .unwrap_err()
            .contains("fault rule"));
    }

    #[test]
    fn config_source_prefers_flag_then_env_then_flags_then_default_file() {
        let dir = tempfile::tempdir().unwrap();
        let present = dir.path().join("ironsan.toml");
        std::fs::write(&present, "").unwrap();
        let absent = dir.path().join("missing.toml");
        let flag = Path::new("/x/flag.toml");
        let env = std::ffi::OsStr::new("/x/env.toml");
        // --config wins over everything.
        assert_eq!(
            config_source(Some(flag), Some(env), true, &present),
            Ok(Source::Flag(flag.into()))
        );
        // Then IRONSAN_CONFIG, which conflicts with target flags.
        assert_eq!(
            config_source(None, Some(env), false, &present),
            Ok(Source::Env("/x/env.toml".into()))
        );
        let err = config_source(None, Some(env), true, &present).unwrap_err();
        assert!(err.contains("IRONSAN_CONFIG=/x/env.toml"), "{err}");
        // An empty variable counts as unset.
        assert_eq!(
            config_source(None, Some(std::ffi::OsStr::new("")), false, &present),
            Ok(Source::Default(present.clone()))
        );
        // Target flags beat the default file.
        assert_eq!(config_source(None, None, true, &present), Ok(Source::Flags));
        // No flags: the default file if it exists, else the embedded default.
        assert_eq!(
            config_source(None, None, false, &present),
            Ok(Source::Default(present.clone()))
        );
        assert_eq!(config_source(None, None, false, &absent), Ok(Source::Flags));
        assert_eq!(
            Source::Default(present.clone()).path(),
            Some(present.as_path())
        );
        assert_eq!(Source::Flags.path(), None);
        assert_eq!(DEFAULT_CONFIG_PATH, "/etc/ironsan/ironsan.toml");
    }

    #[test]
    fn metrics_control_and_shutdown_grace_keys() {
        let base =
            "[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:1M\"\n";
        let plan = parse_file(base, Path::new("t.toml")).unwrap();
        assert_eq!(plan.metrics, None);
        assert_eq!(plan.control, None);
        assert_eq!(
            plan.limits.shutdown_grace,
            std::time::Duration::from_secs(10)
        );
        let text = format!(
            "metrics = \"127.0.0.1:9360\"\ncontrol = \"/run/x/control.sock\"\n{base}[limits]\nshutdown_grace = \"2500ms\"\n"
        );
        let plan = parse_file(&text, Path::new("t.toml")).unwrap();
        assert_eq!(plan.metrics, Some("127.0.0.1:9360".parse().unwrap()));
        assert_eq!(plan.control, Some(PathBuf::from("/run/x/control.sock")));
        assert_eq!(
            plan.limits.shutdown_grace,
            std::time::Duration::from_millis(2500)
        );
        let text = format!("{base}[limits]\nzero_copy_reads = \"off\"\n");
        let plan = parse_file(&text, Path::new("t.toml")).unwrap();
        assert_eq!(
            plan.limits.zero_copy_reads,
            ironsan_server::ZeroCopyReads::Off
        );
        let text = format!("{base}[limits]\nzero_copy_reads = \"mapped\"\n");
        let plan = parse_file(&text, Path::new("t.toml")).unwrap();
        assert_eq!(
            plan.limits.zero_copy_reads,
            ironsan_server::ZeroCopyReads::Mapped
        );
        let err = parse_file(
            &format!("{base}[limits]\nzero_copy_reads = \"always\"\n"),
            Path::new("t.toml"),
        )
        .unwrap_err();
        assert!(
            err.contains("t.toml:6")
                && err.contains("'always' is not one of auto, on, mapped, off"),
            "{err}"
        );
        let text = format!("{base}[limits]\nio_engine = \"threads\"\n");
        let plan = parse_file(&text, Path::new("t.toml")).unwrap();
        assert_eq!(plan.limits.io_engine, ironsan_backend::IoEngine::Threads);
        let err = parse_file(
            &format!("{base}[limits]\nio_engine = \"aio\"\n"),
            Path::new("t.toml"),
        )
        .unwrap_err();
        assert!(
            err.contains("t.toml:6")
                && err.contains("io_engine: 'aio': expected auto, uring or threads"),
            "{err}"
        );
        let text = format!("control = \"none\"\n{base}");
        let plan = parse_file(&text, Path::new("t.toml")).unwrap();
        assert_eq!(plan.control, Some(PathBuf::from("none")));
        // Errors name the file and line.
        for (text, line, what) in [
            (format!("metrics = \"localhost\"\n{base}"), 1, "metrics"),
            (format!("\ncontrol = \"\"\n{base}"), 2, "control"),
            (
                format!("{base}[limits]\nshutdown_grace = \"ten\"\n"),
                6,
                "shutdown_grace",
            ),
            (
                format!("{base}[limits]\nshutdown_grace = \"2d\"\n"),
                6,
                "shutdown_grace",
            ),
            (
                format!("{base}[limits]\nshutdown_grace = \"2h\"\n"),
                6,
                "shutdown_grace",
            ),
        ] {
            let err = parse_file(&text, Path::new("t.toml")).unwrap_err();
            assert!(
                err.starts_with(&format!("t.toml:{line}: ")) && err.contains(what),
                "{err}"
            );
        }
        assert_eq!(
            parse_duration("10s"),
            Some(std::time::Duration::from_secs(10))
        );
        assert_eq!(
            parse_duration("2m"),
            Some(std::time::Duration::from_secs(120))
        );
        assert_eq!(parse_duration("0s"), Some(std::time::Duration::ZERO));
        assert_eq!(parse_duration("10"), None);
        assert_eq!(parse_duration("s"), None);
    }

    #[test]
    fn config_errors_name_file_and_line() {
        let text = "listen = [\"127.0.0.1:3260\"]\n\n[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:12Q\"\n";
        let err = parse_file(text, Path::new("t.toml")).unwrap_err();
        assert!(err.starts_with("t.toml:6: "), "{err}");
        let text = "listen = [\"nowhere\"]\n";
        assert!(parse_file(text, Path::new("t.toml"))
            .unwrap_err()
            .starts_with("t.toml:1: "));
        let text = "[[target]]\nname = \"iqn.2026-11.org.x:a\"\nbogus = 1\n";
        let err = parse_file(text, Path::new("t.toml")).unwrap_err();
        assert!(
            err.starts_with("t.toml:3: ") && err.contains("bogus"),
            "{err}"
        );
        let text = "[[target]]\nname = \"Not A Name\"\n[[target.lun]]\nspec = \"ram:1G\"\n";
        assert!(parse_file(text, Path::new("t.toml"))
            .unwrap_err()
            .starts_with("t.toml:2: "));
    }

    #[test]
    fn config_file_describes_several_targets_and_portals() {
        let text = r#"
listen = ["127.0.0.1:3260", "[::1]:3261"]
data_dir = "/srv/iscsi"
queue_depth = 64
[[target]]
name = "iqn.2026-11.org.x:a"
[[target.lun]]
backend = "file"
path = "a.img"
size = "10G"
direct = true
write_cache = true
[[target.lun]]
spec = "null:16T"
[[target]]
name = "iqn.2026-11.org.x:b"
[[target.lun]]
backend = "ram"
size = "1G"
block_size = 4096
"#;
        let plan = parse_file(text, Path::new("c.toml")).unwrap();
        assert_eq!(plan.listen().len(), 2);
        assert_eq!(plan.portal_groups[0].tag, 1);
        assert_eq!(plan.queue_depth, 64);
        assert_eq!(plan.targets.len(), 2);
        assert_eq!(
            plan.targets[0].luns[0].backing,
            Backing::File {
                path: "/srv/iscsi/a.img".into(),
                size: Some(10 << 30)
            }
        );
        assert!(plan.targets[0].luns[0].direct && plan.targets[0].luns[0].write_cache);
        assert_eq!(
            plan.targets[0].luns[1].backing,
            Backing::Null { size: 16 << 40 }
        );
        assert_eq!(plan.targets[1].luns[0].block_size, 4096);
    }

    #[test]
    fn flags_default_to_the_embedded_lun() {
        let p = from_flags(
            &[],
            None,
            &[],
            Path::new("d"),
            false,
            false,
            &AuthFlags::default(),
        )
        .unwrap();
        assert_eq!(p.listen(), vec!["127.0.0.1:3260".parse().unwrap()]);
        assert_eq!(p.targets[0].name, DEFAULT_TARGET);
        assert_eq!(
            p.targets[0].luns[0].backing,
            Backing::File {
                path: "d/lun0.img".into(),
                size: Some(1 << 30)
            }
        );
        assert!(from_flags(
            &["x".into()],
            None,
            &[],
            Path::new("d"),
            false,
            false,
            &AuthFlags::default()
        )
        .unwrap_err()
        .starts_with("--listen"));
    }

    #[test]
    fn config_file_access_control_and_limits() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("t.secret"), "target-secret-456\n").unwrap();
        std::env::set_var("IRONSAN_TEST_DISC_SECRET", "discovery-secret-1");
        let text = r#"
[limits]
max_connections = 64
max_sessions_per_initiator = 4
write_buffer_per_session = "128M"
[discovery]
chap = { user = "disc", secret_env = "IRONSAN_TEST_DISC_SECRET" }
acl = ["iqn.1993-08.org.debian:*"]
[[target]]
name = "iqn.2026-11.org.x:a"
acl = ["iqn.1993-08.org.debian:01:h1", "*@10.0.0.0/8"]
chap = { user = "h1", secret = "initiator-secret-1" }
mutual_chap = { user = "tgt", secret_file = "t.secret" }
[[target.lun]]
spec = "ram:1G"
"#;
        let plan = parse_file(text, &dir.path().join("c.toml")).unwrap();
        let a = &plan.targets[0].access;
        assert_eq!(a.acl.len(), 2);
        assert_eq!(
            a.chap.as_ref().unwrap().secret.expose(),
            b"initiator-secret-1"
        );
        assert_eq!(
            a.mutual_chap.as_ref().unwrap().secret.expose(),
            b"target-secret-456"
        );
        assert_eq!(
            plan.discovery.chap.as_ref().unwrap().secret.expose(),
            b"discovery-secret-1"
        );
        assert_eq!(plan.limits.max_connections, 64);
        assert_eq!(plan.limits.max_sessions_per_initiator, 4);
        assert_eq!(plan.limits.write_buffer_per_session, 128 << 20);
        assert_eq!(plan.limits.max_sessions, Limits::default().max_sessions);
        // Secrets never appear in the plan's Debug output.
        let dbg = format!("{plan:?}");
        assert!(!dbg.contains("initiator-secret") && !dbg.contains("target-secret"));
    }

    #[test]
    fn access_control_errors_name_file_and_line() {
        let p = Path::new("c.toml");
        let base =
            "[[target]]\nname = \"iqn.2026-11.org.x:a\"\n[[target.lun]]\nspec = \"ram:1G\"\n";
        let cases = [
            // identical secrets in both directions
            ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nchap = { user = \"u\", secret = \"same-secret-123\" }\nmutual_chap = { user = \"t\", secret = \"same-secret-123\" }\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 4, "must differ"),
            ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nchap = { user = \"u\", secret = \"short\" }\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 3, "12 to 255"),
            ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nacl = [\"host*x\"]\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 3, "acl"),
            ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nchap = { user = \"u\", secret = \"a-long-secret-1\", secret_env = \"X\" }\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 3, "exactly one"),
            ("[[target]]\nname = \"iqn.2026-11.org.x:a\"\nchap = { user = \"u\", secret_env = \"IRONSAN_TEST_UNSET_VAR\" }\n[[target.lun]]\nspec = \"ram:1G\"\n".to_string(), 3, "not set"),
            (format!("[limits]\nmax_connections = 0\n{base}"), 2, "max_connections"),
            (format!("[limits]\nwrite_buffer_per_session = \"1M\"\n{base}"), 2, "write_buffer_per_session"),
            (format!("[discovery]\nmutual_chap = {{ user = \"t\", secret = \"a-long-secret-1\" }}\n{base}"), 2, "needs chap"),
        ];
        for (text, line, what) in cases {
            let err = parse_file(&text, p).unwrap_err();
            assert!(
                err.starts_with(&format!("c.toml:{line}: ")) && err.contains(what),
                "{err}\n---\n{text}"
            );
        }
    }

    #[test]
    fn credential_flags_take_secrets_inline_from_files_or_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("s");
        std::fs::write(&f, "file-secret-1234\r\n").unwrap();
        let c = parse_credential("--chap", "alice:inline-secret-1", None).unwrap();
        assert_eq!(
            (c.user.as_str(), c.secret.expose()),
            ("alice", &b"inline-secret-1"[..])
        );
        let c = parse_credential("--chap", &format!("alice:@{}", f.display()), None).unwrap();
        assert_eq!(c.secret.expose(), b"file-secret-1234");
        std::env::set_var("IRONSAN_TEST_FLAG_SECRET", "env-secret-12345");
        let c = parse_credential("--chap", "alice:env:IRONSAN_TEST_FLAG_SECRET", None).unwrap();
        assert_eq!(c.secret.expose(), b"env-secret-12345");
        // With --chap-secret-file the value is the user name, colons and all.
        let c = parse_credential("--chap", "iqn.1993-08.org.debian:01:h1", Some(&f)).unwrap();
        assert_eq!(c.user, "iqn.1993-08.org.debian:01:h1");
        for (v, what) in [
            ("alice", "USER:SECRET"),
            ("alice:short", "12 to 255"),
            (":long-enough-secret", "user name"),
            ("alice:env:IRONSAN_TEST_UNSET_VAR", "not set"),
            ("alice:@/nonexistent/secret", "cannot read"),
        ] {
            let e = parse_credential("--chap", v, None).unwrap_err();
            assert!(e.starts_with("--chap: ") && e.contains(what), "{v}: {e}");
        }
        let flags = AuthFlags {
            chap: Some("u:same-secret-1234".into()),
            mutual_chap: Some("t:same-secret-1234".into()),
            ..Default::default()
        };
        let e = from_flags(&[], None, &[], Path::new("d"), false, false, &flags).unwrap_err();
        assert!(
            e.starts_with("--mutual-chap: ") && e.contains("differ"),
            "{e}"
        );
        let flags = AuthFlags {
            acl: vec!["not-a-name".into()],
            ..Default::default()
        };
        let e = from_flags(&[], None, &[], Path::new("d"), false, false, &flags).unwrap_err();
        assert!(e.starts_with("--acl "), "{e}");
    }
}
