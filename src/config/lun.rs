//! LUN specs: `--lun` / `spec = "…"` strings and their parts (backing, RBD images, identity,
//! block sizes).

use super::*;

/// Which backend a LUN uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Backing {
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
pub(crate) struct RbdSpec {
    pub pool: String,
    pub namespace: Option<String>,
    pub image: String,
    /// `conf=PATH`; `None`: librados' own search.
    pub conf: Option<PathBuf>,
    /// `id=NAME`: the cephx client (`client.NAME`).
    pub id: String,
    /// `timeout=SECS`: how long one operation may wait for the cluster.
    pub timeout_secs: u64,
    /// `shared`: served by several ironsan nodes at once (no exclusive lock, no gateway
    /// cache, no persistent reservations).
    pub shared: bool,
}

/// Default cephx client of RBD LUNs.
pub(crate) const RBD_DEFAULT_ID: &str = "admin";

impl RbdSpec {
    /// `POOL/IMAGE` or `POOL/NAMESPACE/IMAGE`.
    pub(crate) fn image_spec(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{}/{ns}/{}", self.pool, self.image),
            None => format!("{}/{}", self.pool, self.image),
        }
    }
}

/// One LUN, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LunPlan {
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
    pub(crate) fn new(backing: Backing) -> Self {
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
/// `fault-seed=N`, and for `rbd:` LUNs `conf=PATH`, `id=NAME`, `timeout=SECS` and `shared`.
pub(crate) fn parse_lun(value: &str, data_dir: &Path) -> Result<LunPlan, String> {
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
            None if opt == "shared" => {
                let Backing::Rbd(r) = &mut plan.backing else {
                    return Err(format!("'{value}': shared applies to rbd: LUNs only"));
                };
                r.shared = true;
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
                    "'{value}': unknown LUN option '{opt}' (ro, direct, wce, bs=N, pbs=N, serial=S, naa=0xHEX, fault=RULE, fault-seed=N; rbd: conf=PATH, id=NAME, timeout=SECS, shared)"
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
pub(crate) fn parse_naa(v: &str) -> Result<u64, String> {
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
pub(crate) fn check_serial(v: &str) -> Result<String, String> {
    if v.is_empty() || v.len() > 64 || !v.bytes().all(|b| b.is_ascii_graphic() && b != b',') {
        return Err(format!(
            "serial '{}' must be 1 to 64 printable ASCII characters without spaces or commas",
            v.escape_debug()
        ));
    }
    Ok(v.to_string())
}

/// Parse a `--lun` SPEC: `null:SIZE`, `ram:SIZE`, `file:PATH` or `file:PATH:SIZE`. Relative
/// paths are taken relative to `data_dir`.
pub(crate) fn parse_lun_spec(spec: &str, data_dir: &Path) -> Result<Backing, String> {
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
pub(crate) fn parse_rbd(rest: &str) -> Result<Backing, String> {
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
        shared: false,
    }))
}

pub(crate) fn check_block_size(bs: u32) -> Result<u32, String> {
    if bs.is_power_of_two() && (512..=65536).contains(&bs) {
        Ok(bs)
    } else {
        Err(format!(
            "block_size {bs} must be a power of two from 512 to 65536"
        ))
    }
}
