//! The TOML configuration file: its serde shape and its translation into a [`Plan`], with every
//! error naming the file and line.

use super::*;

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
    cluster: Option<Spanned<cluster::FileCluster>>,
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
    error_recovery_level: Option<Spanned<i64>>,
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

/// Makes the error for a span of the file.
pub(super) type At<'a> = &'a dyn Fn(std::ops::Range<usize>, String) -> ConfigError;

fn chap_from_file(c: &Spanned<FileChap>, base: &Path, at: At) -> Result<ChapAccount, ConfigError> {
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
) -> Result<Option<Vec<ironsan_scsi::PortGroup>>, ConfigError> {
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
) -> Result<Access, ConfigError> {
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
fn limits_from_file(l: Option<Limits>, text: &str, at: At) -> Result<Limits, ConfigError> {
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

/// Load and validate a TOML config file.
pub(crate) fn load_file(path: &Path) -> Result<Plan, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::from(format!("{}: {e}", path.display())))?;
    parse_file(&text, path)
}

/// Validate config `text` read from `path`.
pub(crate) fn parse_file(text: &str, path: &Path) -> Result<Plan, ConfigError> {
    let located = |line: usize, message: String| ConfigError {
        at: Some((path.to_path_buf(), line)),
        message,
    };
    let cfg: FileConfig = toml::from_str(text).map_err(|e| {
        let start = e.span().map(|s| s.start).unwrap_or(0);
        // Errors of a value's own form (a size, a duration, on/off) do not name the key.
        let message = match key_at(text, start).filter(|k| !e.message().contains(k)) {
            Some(k) => format!("{k}: {}", e.message()),
            None => e.message().to_string(),
        };
        located(line_of(text, start), message)
    })?;
    let at = |span: std::ops::Range<usize>, msg: String| located(line_of(text, span.start), msg);
    let data_dir = PathBuf::from(cfg.data_dir.unwrap_or_else(|| "./ironsan-data".into()));
    // secret_file paths are relative to the configuration file's directory.
    let base = path.parent().unwrap_or(Path::new("."));
    let cluster = match &cfg.cluster {
        Some(c) => Some(cluster::cluster_from_file(c, &at)?),
        None => None,
    };
    // `listen` is portal group 1; on a cluster node, its node number (tags are the nodes'
    // relative target ports, unique in the cluster).
    let listen_tag = cluster.as_ref().map_or(1, |c| c.node);
    let portal_groups =
        portal_groups_from_file(cfg.listen.as_deref(), &cfg.portal_group, listen_tag, &at)?;
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
    let mut targets: Vec<TargetPlan> = Vec::new();
    for t in cfg.target {
        if targets.iter().any(|x| &x.name == t.name.get_ref()) {
            return Err(at(
                t.name.span(),
                format!("target '{}' is defined twice", t.name.get_ref()),
            ));
        }
        let within = Within {
            portal_groups: &portal_groups,
            clustered: cluster.is_some(),
            data_dir: &data_dir,
            base,
        };
        targets.push(target_from_file(t, &within, &at)?);
    }
    if targets.is_empty() {
        return Err(ConfigError::from(format!(
            "{}: no [[target]] defined",
            path.display()
        )));
    }
    unique_identities(&targets, path)?;
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
        cluster,
    })
}

/// Listen addresses, each `ADDR:PORT`.
fn addrs_from_file(list: &[Spanned<String>], at: At) -> Result<Vec<SocketAddr>, ConfigError> {
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
}

/// `listen = [...]` (portal group `listen_tag`) and the `[[portal_group]]`s; the default
/// portal when there are none. A tag or an address is used once.
fn portal_groups_from_file(
    listen: Option<&[Spanned<String>]>,
    groups: &[FilePortalGroup],
    listen_tag: u16,
    at: At,
) -> Result<Vec<PortalGroup>, ConfigError> {
    let mut portal_groups = Vec::new();
    let first = addrs_from_file(listen.unwrap_or_default(), at)?;
    if !first.is_empty() {
        portal_groups.push(PortalGroup {
            tag: listen_tag,
            listen: first,
        });
    }
    let mut seen: Vec<SocketAddr> = portal_groups
        .iter()
        .flat_map(|g| g.listen.clone())
        .collect();
    for g in groups {
        let tag = u16::try_from(*g.tag.get_ref())
            .ok()
            .filter(|&t| t != 0)
            .ok_or_else(|| at(g.tag.span(), "portal group tag must be 1 to 65535".into()))?;
        if portal_groups.iter().any(|x: &PortalGroup| x.tag == tag) {
            let why = if tag == listen_tag && listen.is_some() {
                format!(" (listen = [...] is portal group {listen_tag})")
            } else {
                String::new()
            };
            return Err(at(
                g.tag.span(),
                format!("portal group {tag} is defined twice{why}"),
            ));
        }
        let addrs = addrs_from_file(g.listen.get_ref(), at)?;
        if addrs.is_empty() {
            return Err(at(
                g.listen.span(),
                format!("portal group {tag} has no listen address"),
            ));
        }
        for (a, l) in addrs.iter().zip(g.listen.get_ref()) {
            // Port 0 (any free port, for tests) never clashes.
            if a.port() != 0 && seen.contains(a) {
                return Err(at(l.span(), format!("portal {a} is in two portal groups")));
            }
            seen.push(*a);
        }
        portal_groups.push(PortalGroup { tag, listen: addrs });
    }
    if portal_groups.is_empty() {
        portal_groups.push(PortalGroup {
            tag: listen_tag,
            listen: vec![DEFAULT_LISTEN
                .parse()
                .map_err(|_| "bad default listen address".to_string())?],
        });
    }
    Ok(portal_groups)
}

/// What a `[[target]]` is read against: the portal groups defined, whether this is a cluster
/// node, and where relative paths start.
struct Within<'a> {
    portal_groups: &'a [PortalGroup],
    clustered: bool,
    data_dir: &'a Path,
    base: &'a Path,
}

/// An optional integer key within `range`, or an error naming its line.
fn ranged<T: TryFrom<i64> + PartialOrd>(
    v: &Option<Spanned<i64>>,
    range: std::ops::RangeInclusive<T>,
    error: impl FnOnce(std::ops::Range<usize>) -> ConfigError,
) -> Result<Option<T>, ConfigError> {
    let Some(n) = v else { return Ok(None) };
    match T::try_from(*n.get_ref()) {
        Ok(x) if range.contains(&x) => Ok(Some(x)),
        _ => Err(error(n.span())),
    }
}

/// One `[[target]]`: its name, LUNs, access, portal groups, session settings and ALUA groups.
fn target_from_file(t: FileTarget, w: &Within, at: At) -> Result<TargetPlan, ConfigError> {
    check_iscsi_name(t.name.get_ref()).map_err(|e| at(t.name.span(), e))?;
    let mut luns = Vec::new();
    for l in t.lun {
        luns.push(lun_from_file(l, w.data_dir, at)?);
    }
    if luns.is_empty() {
        return Err(at(
            t.name.span(),
            format!("target '{}' has no [[target.lun]]", t.name.get_ref()),
        ));
    }
    let access = access_from_file(&t.acl, &t.chap, &t.mutual_chap, w.base, at)?;
    let groups = match &t.portal_groups {
        None => None,
        Some(list) => Some(target_groups_from_file(list, w.portal_groups, at)?),
    };
    let connections_per_session = ranged(
        &t.connections_per_session,
        1..=MAX_CONNECTIONS_PER_SESSION,
        |span| {
            at(
                span,
                format!(
                    "connections_per_session must be between 1 and \
                     {MAX_CONNECTIONS_PER_SESSION}"
                ),
            )
        },
    )?;
    let max_erl = ironsan_proto::negotiate::MAX_ERROR_RECOVERY_LEVEL;
    let error_recovery_level = ranged(&t.error_recovery_level, 0..=max_erl, |span| {
        at(
            span,
            format!("error_recovery_level must be between 0 and {max_erl}"),
        )
    })?;
    let serving: Vec<u16> = groups
        .clone()
        .unwrap_or_else(|| w.portal_groups.iter().map(|p| p.tag).collect());
    if let (Some(g), true) = (t.alua_group.first(), w.clustered) {
        return Err(at(
            g.id.span(),
            "a cluster node's target port groups are the nodes ([cluster]): leave out [[target.alua_group]]".into(),
        ));
    }
    let alua = alua_from_file(&t.alua_group, &serving, t.name.get_ref(), at)?;
    Ok(TargetPlan {
        name: t.name.into_inner(),
        alias: t.alias,
        luns,
        access,
        portal_groups: groups,
        connections_per_session,
        error_recovery_level,
        alua,
    })
}

/// A target's `portal_groups = [...]`: tags of defined groups, each once.
fn target_groups_from_file(
    list: &Spanned<Vec<Spanned<i64>>>,
    defined: &[PortalGroup],
    at: At,
) -> Result<Vec<u16>, ConfigError> {
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
            .filter(|t| defined.iter().any(|p| p.tag == *t))
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
    Ok(tags)
}

/// Two LUs with one identity would look like two paths to one disk to a multipath host.
fn unique_identities(targets: &[TargetPlan], path: &Path) -> Result<(), ConfigError> {
    let mut ids = std::collections::HashMap::new();
    for t in targets {
        for (n, l) in t.luns.iter().enumerate() {
            if let Some(naa) = l.naa {
                if let Some((t0, n0)) = ids.insert(naa, (&t.name, n)) {
                    return Err(ConfigError::from(format!(
                        "{}: {} LUN {n} and {t0} LUN {n0} have the same naa 0x{naa:016x}",
                        path.display(),
                        t.name
                    )));
                }
            }
        }
    }
    Ok(())
}

fn lun_from_file(l: FileLun, data_dir: &Path, at: At) -> Result<LunPlan, ConfigError> {
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
            return Err(ConfigError::from(
                "a [[target.lun]] needs spec = \"...\" or backend = \"...\"".to_string(),
            ))
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
