//! The declarative configuration: a TOML file, or the equivalent command-line flags, turned
//! into a validated [`Plan`] (portals, targets, LUN specs). Errors name the file and line, or
//! the flag, and say what is wrong.
//!
//! ```toml
//! listen = ["127.0.0.1:3260", "[::1]:3260"]
//! data_dir = "/var/lib/ironsan"
//! queue_depth = 128
//!
//! [[target]]
//! name = "iqn.2026-11.org.ironsan:disk1"
//! alias = "disk1"
//!
//! [[target.lun]]
//! backend = "file"          # null | ram | file
//! path = "disk1.img"        # relative to data_dir
//! size = "10G"              # creates the file sparse if missing
//! direct = false            # O_DIRECT (BLOCKIO)
//! write_cache = false       # initial WCE
//! read_only = false
//! block_size = 512
//!
//! [[target.lun]]
//! spec = "ram:1G"           # the same shorthand as --lun
//! ```

use ironsan_backend::parse_size;
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
    Null { size: u64 },
    Ram { size: u64 },
    File { path: PathBuf, size: Option<u64> },
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
    pub serial: Option<String>,
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
        }
    }
}

/// Parse a full `--lun` value: `SPEC[,OPTION]...` where OPTION is `ro`, `direct`, `wce`,
/// `bs=N` (logical block size), `pbs=N` (reported physical block size) or `serial=S`.
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
            Some(("serial", v)) if !v.is_empty() => plan.serial = Some(v.to_string()),
            _ => {
                return Err(format!(
                    "'{value}': unknown LUN option '{opt}' (ro, direct, wce, bs=N, pbs=N, serial=S)"
                ))
            }
        }
    }
    if plan.physical_block_size != 0 && plan.physical_block_size < plan.block_size {
        return Err(format!("'{value}': pbs must be at least bs"));
    }
    Ok(plan)
}

/// One target, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetPlan {
    pub name: String,
    pub alias: Option<String>,
    pub luns: Vec<LunPlan>,
}

/// Everything `serve` needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub listen: Vec<SocketAddr>,
    pub data_dir: PathBuf,
    pub queue_depth: u32,
    pub targets: Vec<TargetPlan>,
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
        other => Err(format!(
            "unknown backend '{other}' in '{spec}' (expected null, ram or file)"
        )),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<Vec<Spanned<String>>>,
    data_dir: Option<String>,
    queue_depth: Option<Spanned<u32>>,
    #[serde(default)]
    target: Vec<FileTarget>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTarget {
    name: Spanned<String>,
    alias: Option<String>,
    #[serde(default)]
    lun: Vec<FileLun>,
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
    serial: Option<String>,
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
        let line = e.span().map(|s| line_of(text, s.start)).unwrap_or(1);
        format!("{file}:{line}: {}", e.message())
    })?;
    let at = |span: std::ops::Range<usize>, msg: String| {
        format!("{file}:{}: {msg}", line_of(text, span.start))
    };
    let data_dir = PathBuf::from(cfg.data_dir.unwrap_or_else(|| "./ironsan-data".into()));
    let mut listen = Vec::new();
    for l in cfg.listen.unwrap_or_default() {
        let addr = l.get_ref().parse::<SocketAddr>().map_err(|_| {
            at(
                l.span(),
                format!(
                    "listen address '{}' is not ADDR:PORT (IPv6 as [::1]:3260)",
                    l.get_ref()
                ),
            )
        })?;
        listen.push(addr);
    }
    if listen.is_empty() {
        listen.push(
            DEFAULT_LISTEN
                .parse()
                .map_err(|_| "bad default listen address".to_string())?,
        );
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
        targets.push(TargetPlan {
            name: t.name.into_inner(),
            alias: t.alias,
            luns,
        });
    }
    if targets.is_empty() {
        return Err(format!("{file}: no [[target]] defined"));
    }
    Ok(Plan {
        listen,
        data_dir,
        queue_depth,
        targets,
    })
}

fn lun_from_file(
    l: FileLun,
    data_dir: &Path,
    at: &dyn Fn(std::ops::Range<usize>, String) -> String,
) -> Result<LunPlan, String> {
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
                other => {
                    return Err(at(
                        b.span(),
                        format!("unknown backend '{other}' (expected null, ram or file)"),
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
        serial: l.serial.or(base.serial),
    })
}

/// The plan from command-line flags.
pub fn from_flags(
    listen: &[String],
    target: Option<&str>,
    luns: &[String],
    data_dir: &Path,
    direct: bool,
    write_cache: bool,
) -> Result<Plan, String> {
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
        listen: addrs,
        data_dir: data_dir.to_owned(),
        queue_depth: 128,
        targets: vec![TargetPlan {
            name,
            alias: None,
            luns: plans,
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(plan.listen.len(), 2);
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
        let p = from_flags(&[], None, &[], Path::new("d"), false, false).unwrap();
        assert_eq!(p.listen, vec!["127.0.0.1:3260".parse().unwrap()]);
        assert_eq!(p.targets[0].name, DEFAULT_TARGET);
        assert_eq!(
            p.targets[0].luns[0].backing,
            Backing::File {
                path: "d/lun0.img".into(),
                size: Some(1 << 30)
            }
        );
        assert!(
            from_flags(&["x".into()], None, &[], Path::new("d"), false, false)
                .unwrap_err()
                .starts_with("--listen")
        );
    }
}
