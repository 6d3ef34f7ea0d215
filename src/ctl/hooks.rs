//! The binary's side of the control socket: building LUNs from specs (`lun add`), `apply`
//! and `save`, which need the configuration syntax the server crate does not know.

use crate::config::{self, Backing, Limits, LunPlan, Plan};
use anyhow::Result;
use ironsan_scsi::LogicalUnit;
use ironsan_server::control::{Control, Hooks};
use ironsan_server::{Access, PortalGroup, PortalInfo, TargetDef};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The `--lun` spec equivalent to `l` (what `save` writes and `luns` shows).
pub(crate) fn lun_spec(l: &LunPlan) -> String {
    let mut s = match &l.backing {
        Backing::Null { size } => format!("null:{size}"),
        Backing::Ram { size } => format!("ram:{size}"),
        Backing::File { path, size: None } => format!("file:{}", path.display()),
        Backing::File {
            path,
            size: Some(n),
        } => format!("file:{}:{n}", path.display()),
        Backing::Rbd(r) => {
            let mut s = format!("rbd:{}", r.image_spec());
            if let Some(c) = &r.conf {
                s.push_str(&format!(",conf={}", c.display()));
            }
            if r.id != config::RBD_DEFAULT_ID {
                s.push_str(&format!(",id={}", r.id));
            }
            if r.timeout_secs != ironsan_backend::rbd::DEFAULT_TIMEOUT.as_secs() {
                s.push_str(&format!(",timeout={}", r.timeout_secs));
            }
            if r.shared {
                s.push_str(",shared");
            }
            s
        }
    };
    for (on, o) in [
        (l.read_only, "ro"),
        (l.direct, "direct"),
        (l.write_cache, "wce"),
    ] {
        if on {
            s.push(',');
            s.push_str(o);
        }
    }
    if l.block_size != 512 {
        s.push_str(&format!(",bs={}", l.block_size));
    }
    if l.physical_block_size != 0 {
        s.push_str(&format!(",pbs={}", l.physical_block_size));
    }
    if let Some(serial) = &l.serial {
        s.push_str(&format!(",serial={serial}"));
    }
    if let Some(naa) = l.naa {
        s.push_str(&format!(",naa=0x{naa:016x}"));
    }
    for f in &l.faults {
        s.push_str(&format!(",fault={f}"));
    }
    if !l.faults.is_empty() && l.fault_seed != 1 {
        s.push_str(&format!(",fault-seed={}", l.fault_seed));
    }
    s
}

/// The binary's hooks: LUN specs, `apply`, `save`.
pub(crate) struct BinHooks {
    /// The plan serve runs (listen, data_dir, limits and the CHAP sources are kept from it).
    plan: Mutex<Plan>,
    /// The configuration file serve started with, if any.
    config: Option<PathBuf>,
}

impl BinHooks {
    pub(crate) fn new(plan: Plan, config: Option<PathBuf>) -> Self {
        BinHooks {
            plan: Mutex::new(plan),
            config,
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.plan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .data_dir
            .clone()
    }

    /// Reconcile the running state to `file`: returns the changes (made unless `dry_run`).
    pub(crate) fn apply(
        &self,
        control: &Control,
        file: &Path,
        dry_run: bool,
    ) -> Result<Vec<String>, String> {
        let plan = config::load_file(file).map_err(|e| e.to_string())?;
        let mut changes = Vec::new();
        let mut errors = Vec::new();
        let running = control.target_names();
        let data_dir = plan.data_dir.clone();
        {
            let old = self.plan.lock().unwrap_or_else(|p| p.into_inner());
            if old.limits != plan.limits
                || old.queue_depth != plan.queue_depth
                || old.data_dir != plan.data_dir
                || old.metrics != plan.metrics
                || old.control != plan.control
            {
                changes.push(
                    "! data_dir, queue_depth, metrics, control and [limits] take effect only after a restart"
                        .to_string(),
                );
            }
        }
        let portals = portal_diff(&control.portal_list(), &plan);
        let mut step = |desc: String, f: &mut dyn FnMut() -> Result<(), String>| {
            if !dry_run {
                if let Err(e) = f() {
                    errors.push(format!("{desc}: {e}"));
                    return;
                }
            }
            changes.push(desc);
        };
        // Portals first (a new target may be served only on a new group), removals last
        // (a target may be moved off a group that goes away).
        for (addr, old, tag) in &portals.moved {
            step(
                format!("~ portal {addr}: group {old} -> {tag}"),
                &mut || control.set_portal_tag(*addr, *tag),
            );
        }
        // A new portal that clashes with one that goes away (same port, same or wildcard
        // address: 127.0.0.1:3260 replaced by 0.0.0.0:3260) replaces it, after the other
        // closings; one that clashes with several replaces the last of them.
        let mut removed: Vec<PortalInfo> = portals.removed.clone();
        let mut now = Vec::new();
        let mut replace = Vec::new();
        for &(a, tag) in &portals.added {
            match removed.iter().rposition(|p| clashes(&a, &p.addr)) {
                Some(i) => replace.push((removed.remove(i), a, tag)),
                None => now.push((a, tag)),
            }
        }
        let bind_failed = std::cell::Cell::new(false);
        for (addr, tag) in &now {
            step(format!("+ portal {addr} (group {tag})"), &mut || {
                control
                    .add_portal(*addr, *tag)
                    .map(|_| ())
                    .inspect_err(|_| {
                        bind_failed.set(true);
                    })
            });
        }
        for name in running
            .iter()
            .filter(|n| !plan.targets.iter().any(|t| &t.name == *n))
        {
            step(format!("- target {name}"), &mut || {
                control.remove_target(name, false).map(|_| ())
            });
        }
        for t in &plan.targets {
            if !running.contains(&t.name) {
                step(
                    format!("+ target {} ({} LUNs)", t.name, t.luns.len()),
                    &mut || {
                        let mut scsi = ironsan_scsi::Target::new();
                        let mut specs = Vec::new();
                        for (n, l) in t.luns.iter().enumerate() {
                            let (_, lu) = crate::build_lu(&t.name, n, l, &data_dir)
                                .map_err(|e| format!("{e:#}"))?;
                            scsi.add_lun(n as u64, lu);
                            specs.push(lun_spec(l));
                        }
                        control.add_target(
                            TargetDef {
                                name: t.name.clone(),
                                alias: t.alias.clone(),
                                max_connections: t.connections_per_session,
                                error_recovery_level: t.error_recovery_level,
                                scsi: Arc::new(scsi),
                            },
                            t.access.clone(),
                        )?;
                        for (n, s) in specs.into_iter().enumerate() {
                            control.set_lun_origin(&t.name, n as u64, Some(s));
                        }
                        if t.portal_groups.is_some() {
                            control.set_portal_groups(&t.name, t.portal_groups.clone())?;
                        }
                        if t.alua.is_some() {
                            control.set_port_groups(&t.name, t.alua.clone())?;
                        }
                        Ok(())
                    },
                );
                continue;
            }
            if control.access(Some(&t.name)).ok().as_ref() != Some(&t.access) {
                step(
                    format!("~ target {}: access (ACL/CHAP)", t.name),
                    &mut || control.set_access(Some(&t.name), t.access.clone()),
                );
            }
            if control.connections_per_session(&t.name).ok() != Some(t.connections_per_session) {
                let what = t
                    .connections_per_session
                    .map_or("the default".to_string(), |n| n.to_string());
                step(
                    format!("~ target {}: connections per session {what}", t.name),
                    &mut || control.set_connections_per_session(&t.name, t.connections_per_session),
                );
            }
            if control.error_recovery_level(&t.name).ok() != Some(t.error_recovery_level) {
                let what = t
                    .error_recovery_level
                    .map_or("the default".to_string(), |n| n.to_string());
                step(
                    format!("~ target {}: error recovery level {what}", t.name),
                    &mut || control.set_error_recovery_level(&t.name, t.error_recovery_level),
                );
            }
            if control.portal_groups(&t.name).ok().as_ref() != Some(&t.portal_groups) {
                let what = match &t.portal_groups {
                    Some(g) => format!("{g:?}"),
                    None => "all".into(),
                };
                step(
                    format!("~ target {}: portal groups {what}", t.name),
                    &mut || control.set_portal_groups(&t.name, t.portal_groups.clone()),
                );
            }
            if let Ok((fixed, groups)) = control.port_groups(&t.name) {
                // The file's groups against the running ones; no groups in the file means the
                // default: one group per portal group, each active/optimized, none preferred.
                let differs = match &t.alua {
                    Some(want) => alua_layout(&groups) != alua_layout(want),
                    None => {
                        fixed
                            || groups.iter().any(|g| {
                                g.state != ironsan_scsi::AccessState::ActiveOptimized || g.preferred
                            })
                    }
                };
                if differs {
                    let what = match &t.alua {
                        Some(g) => format!("{} configured", g.len()),
                        None => "one per portal group".into(),
                    };
                    step(
                        format!("~ target {}: ALUA target port groups ({what})", t.name),
                        &mut || control.set_port_groups(&t.name, t.alua.clone()),
                    );
                }
            }
            let have = control.lun_list(&t.name).unwrap_or_default();
            for (n, _, _) in have.iter().filter(|(n, _, _)| *n as usize >= t.luns.len()) {
                step(format!("- target {} LUN {n}", t.name), &mut || {
                    control.remove_lun(&t.name, *n).map(|_| ())
                });
            }
            for (n, l) in t.luns.iter().enumerate() {
                let cur = have.iter().find(|(m, _, _)| *m == n as u64);
                // The file's LUN, keeping the running identity (NAA, serial) where the file
                // gives none; and the running LUN, identity included.
                let (want, now) = match cur {
                    Some((_, lu, spec)) => (
                        keep_identity(l, lu),
                        spec.as_deref()
                            .and_then(|s| config::parse_lun(s, &data_dir).ok())
                            .map(|mut c| {
                                let (naa, serial) = identity(lu);
                                c.naa = Some(naa);
                                c.serial = Some(serial);
                                c
                            }),
                    ),
                    None => (l.clone(), None),
                };
                let want_spec = lun_spec(&want);
                match (cur, &now) {
                    (Some(_), Some(now)) if *now == want => {}
                    (Some((_, lu, _)), Some(now)) if same_but_size(now, &want) => {
                        let size = plan_size(&want).unwrap_or(0);
                        let now = lu.capacity_blocks() * u64::from(lu.block_size());
                        if size == now {
                            continue;
                        }
                        step(
                            format!("~ target {} LUN {n}: resize {now} -> {size} bytes", t.name),
                            &mut || {
                                control.resize_lun(&t.name, n as u64, size)?;
                                control.set_lun_origin(&t.name, n as u64, Some(want_spec.clone()));
                                Ok(())
                            },
                        );
                    }
                    _ => {
                        let verb = if cur.is_some() { "~" } else { "+" };
                        step(
                            format!("{verb} target {} LUN {n}: {want_spec}", t.name),
                            &mut || {
                                // An RBD image can be open for writing once per LU state
                                // directory: the old LUN goes first. Others are built first,
                                // so a failure leaves the old one in place.
                                let rbd = matches!(want.backing, Backing::Rbd(_));
                                if cur.is_some() && rbd {
                                    drop(control.remove_lun(&t.name, n as u64)?);
                                }
                                let (_, lu) = crate::build_lu(&t.name, n, &want, &data_dir)
                                    .map_err(|e| format!("{e:#}"))?;
                                if cur.is_some() && !rbd {
                                    control.remove_lun(&t.name, n as u64)?;
                                }
                                control
                                    .add_lun(&t.name, Some(n as u64), lu, Some(want_spec.clone()))
                                    .map(|_| ())
                            },
                        );
                    }
                }
            }
        }
        if control.access(None).ok().as_ref() != Some(&plan.discovery) {
            step("~ discovery: access (ACL/CHAP)".into(), &mut || {
                control.set_access(None, plan.discovery.clone())
            });
        }
        // If a new portal could not be bound, the old ones stay: the file may be replacing them.
        for p in &removed {
            step(
                format!("- portal {} (group {})", p.addr, p.tag),
                &mut || {
                    if bind_failed.get() {
                        return Err("not closed, as a new portal could not be bound".into());
                    }
                    control.remove_portal(p.addr).map(|_| ())
                },
            );
        }
        for (old, addr, tag) in &replace {
            step(
                format!(
                    "~ portal {} (group {}) replaced by {addr} (group {tag})",
                    old.addr, old.tag
                ),
                &mut || {
                    if bind_failed.get() {
                        return Err("not replaced, as a new portal could not be bound".into());
                    }
                    control.replace_portal(old.addr, *addr, *tag).map(|_| ())
                },
            );
        }
        if !errors.is_empty() {
            return Err(format!(
                "applied:\n  {}\nfailed:\n  {}",
                changes.join("\n  "),
                errors.join("\n  ")
            ));
        }
        if !dry_run {
            let mut p = self.plan.lock().unwrap_or_else(|p| p.into_inner());
            p.targets = plan.targets;
            p.discovery = plan.discovery;
            p.portal_groups = plan.portal_groups;
        }
        Ok(changes)
    }

    /// The running state as a configuration file.
    pub(crate) fn save_text(&self, control: &Control) -> Result<String, String> {
        let plan = self.plan.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut out = String::from("# Written by `ironsan ctl save`.\n");
        let q = |s: &str| toml::Value::String(s.to_string()).to_string();
        let addrs = |l: &[std::net::SocketAddr]| {
            l.iter()
                .map(|a| q(&a.to_string()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        // The running portals (as bound: port 0 is written as the port it got), grouped by
        // tag in the order the groups first appear. One group with tag 1 is `listen`;
        // otherwise every group is a [[portal_group]].
        let mut groups: Vec<PortalGroup> = Vec::new();
        for p in control.portal_list() {
            match groups.iter_mut().find(|g| g.tag == p.tag) {
                Some(g) => g.listen.push(p.addr),
                None => groups.push(PortalGroup {
                    tag: p.tag,
                    listen: vec![p.addr],
                }),
            }
        }
        // `listen` is group 1, on a cluster node its node number.
        let listen_tag = plan.cluster.as_ref().map_or(1, |c| c.node);
        let implicit = match groups.as_slice() {
            [g] if g.tag == listen_tag => Some(g),
            _ => None,
        };
        if let Some(g) = implicit {
            out.push_str(&format!("listen = [{}]\n", addrs(&g.listen)));
        }
        out.push_str(&format!(
            "data_dir = {}\nqueue_depth = {}\n",
            q(&plan.data_dir.display().to_string()),
            plan.queue_depth
        ));
        if let Some(m) = plan.metrics {
            out.push_str(&format!("metrics = {}\n", q(&m.to_string())));
        }
        if let Some(c) = &plan.control {
            out.push_str(&format!("control = {}\n", q(&c.display().to_string())));
        }
        out.push_str(&limits_text(&plan.limits));
        if let Some(c) = &plan.cluster {
            out.push_str(&crate::config::cluster_toml(c));
        }
        if implicit.is_none() {
            for g in &groups {
                out.push_str(&format!(
                    "\n[[portal_group]]\ntag = {}\nlisten = [{}]\n",
                    g.tag,
                    addrs(&g.listen)
                ));
            }
        }
        let access_lines = |who: &str, a: &Access, out: &mut String| -> Result<(), String> {
            if !a.acl.is_empty() {
                out.push_str(&format!(
                    "acl = [{}]\n",
                    a.acl
                        .iter()
                        .map(|r| q(&r.to_string()))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            if a.chap.is_some() {
                return Err(format!(
                    "{who} uses CHAP: save does not write secrets; edit the configuration file and use ironsan ctl apply"
                ));
            }
            Ok(())
        };
        let disc = control.access(None)?;
        if disc != Access::default() {
            out.push_str("\n[discovery]\n");
            access_lines("discovery", &disc, &mut out)?;
        }
        for t in control.target_names() {
            out.push_str(&format!("\n[[target]]\nname = {}\n", q(&t)));
            if let Some(a) = control.alias(&t)? {
                out.push_str(&format!("alias = {}\n", q(&a)));
            }
            if let Some(g) = control.portal_groups(&t)? {
                let g: Vec<String> = g.iter().map(u16::to_string).collect();
                out.push_str(&format!("portal_groups = [{}]\n", g.join(", ")));
            }
            if let Some(n) = control.connections_per_session(&t)? {
                out.push_str(&format!("connections_per_session = {n}\n"));
            }
            if let Some(n) = control.error_recovery_level(&t)? {
                out.push_str(&format!("error_recovery_level = {n}\n"));
            }
            // Groups are written when configured or when a state differs from the default,
            // so that a state set through `ctl alua set` survives a restart.
            let (fixed, groups) = control.port_groups(&t)?;
            let changed = groups
                .iter()
                .any(|g| g.state != ironsan_scsi::AccessState::ActiveOptimized || g.preferred);
            if fixed || changed {
                for g in &groups {
                    let state = match g.state {
                        // A file cannot say transitioning (a timed state): a group caught
                        // in one is saved active/optimized.
                        ironsan_scsi::AccessState::Transitioning => {
                            ironsan_scsi::AccessState::ActiveOptimized
                        }
                        s => s,
                    };
                    let ports: Vec<String> = g.ports.iter().map(u16::to_string).collect();
                    out.push_str(&format!(
                        "[[target.alua_group]]\nid = {}\nportal_groups = [{}]\nstate = {}\n{}",
                        g.id,
                        ports.join(", "),
                        q(state.name()),
                        if g.preferred {
                            "preferred = true\n"
                        } else {
                            ""
                        }
                    ));
                }
            }
            access_lines(&t, &control.access(Some(&t))?, &mut out)?;
            let luns = control.lun_list(&t)?;
            for (i, (n, lu, spec)) in luns.iter().enumerate() {
                if *n != i as u64 {
                    return Err(format!(
                        "{t}: LUN numbers have a gap before {n}; a configuration file numbers LUNs 0, 1, 2…"
                    ));
                }
                let spec = spec
                    .as_deref()
                    .ok_or_else(|| format!("{t} LUN {n}: its spec is unknown"))?;
                let mut l = config::parse_lun(spec, &plan.data_dir)?;
                let now = lu.capacity_blocks() * u64::from(lu.block_size());
                match &mut l.backing {
                    Backing::Null { size } | Backing::Ram { size } => *size = now,
                    Backing::File { size, .. } => *size = Some(now),
                    // The image keeps its own size.
                    Backing::Rbd(_) => {}
                }
                // The identity is written out, so it survives a restart and a renamed target.
                let (naa, serial) = identity(lu);
                l.naa = None;
                l.serial = None;
                out.push_str(&format!(
                    "\n[[target.lun]]\nspec = {}\nserial = {}\nnaa = \"0x{naa:016x}\"\n",
                    q(&lun_spec(&l)),
                    q(&serial)
                ));
            }
        }
        // The file must read back.
        config::parse_file(&out, Path::new("(saved)")).map_err(|e| e.to_string())?;
        Ok(out)
    }
}

/// What `apply` changes about the portals: (address, old tag, new tag) moved to another
/// group, (address, tag) to bind, running portals to close.
#[derive(Debug, Default)]
struct PortalDiff {
    moved: Vec<(SocketAddr, u16, u16)>,
    added: Vec<(SocketAddr, u16)>,
    removed: Vec<PortalInfo>,
}

/// Match the file's portals to the running ones. A file address matches a running portal
/// bound to it or asked for as it (so `127.0.0.1:0` in the file matches a portal that was
/// started from it, on whatever port it got); same group first, then another group (moved).
fn portal_diff(running: &[PortalInfo], plan: &Plan) -> PortalDiff {
    let want: Vec<(u16, SocketAddr)> = plan
        .portal_groups
        .iter()
        .flat_map(|g| g.listen.iter().map(move |a| (g.tag, *a)))
        .collect();
    let is = |p: &PortalInfo, a: &SocketAddr| p.addr == *a || p.requested == *a;
    let mut used = vec![false; running.len()];
    let mut left = Vec::new();
    for (tag, a) in &want {
        match (0..running.len()).find(|&i| !used[i] && running[i].tag == *tag && is(&running[i], a))
        {
            Some(i) => used[i] = true,
            None => left.push((*tag, *a)),
        }
    }
    let mut d = PortalDiff::default();
    for (tag, a) in left {
        match (0..running.len()).find(|&i| !used[i] && is(&running[i], &a)) {
            Some(i) => {
                used[i] = true;
                d.moved.push((running[i].addr, running[i].tag, tag));
            }
            None => d.added.push((a, tag)),
        }
    }
    d.removed = running
        .iter()
        .zip(&used)
        .filter(|(_, u)| !**u)
        .map(|(p, _)| *p)
        .collect();
    d
}

/// Whether listening on `a` needs `b` closed first: the same port on the same address, or
/// with either a wildcard (on Linux `[::]` takes IPv4 too, so any family).
fn clashes(a: &SocketAddr, b: &SocketAddr) -> bool {
    a.port() == b.port() && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// The `[limits]` section with every limit (the running values, defaults included).
fn limits_text(l: &Limits) -> String {
    format!("\n[limits]\n{}", l.to_toml())
}

fn plan_size(l: &LunPlan) -> Option<u64> {
    match &l.backing {
        Backing::Null { size } | Backing::Ram { size } => Some(*size),
        Backing::File { size, .. } => *size,
        Backing::Rbd(_) => None,
    }
}

/// The identity of a running LU: its NAA designator (as VPD 83h reports it) and serial.
fn identity(lu: &LogicalUnit) -> (u64, String) {
    let c = lu.config();
    let naa = match c.naa >> 60 {
        0x2 | 0x3 | 0x5 => c.naa,
        _ => (c.naa & 0x0FFF_FFFF_FFFF_FFFF) | 0x3000_0000_0000_0000,
    };
    let serial = config::check_serial(&c.serial).unwrap_or_else(|_| format!("{naa:016x}"));
    (naa, serial)
}

/// `want` with the identity of the running `lu` where `want` gives none (a LUN that `apply`
/// changes keeps its NAA and serial unless the file names others).
fn keep_identity(want: &LunPlan, lu: &LogicalUnit) -> LunPlan {
    let (naa, serial) = identity(lu);
    let mut w = want.clone();
    let new_naa = *w.naa.get_or_insert(naa);
    if w.serial.is_none() {
        w.serial = Some(if new_naa == naa {
            serial
        } else {
            format!("{new_naa:016x}")
        });
    }
    w
}

/// Whether the running LUN `cur` and `want` differ at most in size.
fn same_but_size(cur: &LunPlan, want: &LunPlan) -> bool {
    let mut cur = cur.clone();
    let mut want = want.clone();
    for b in [&mut cur.backing, &mut want.backing] {
        match b {
            Backing::Null { size } | Backing::Ram { size } => *size = 0,
            Backing::File { size, .. } => *size = None,
            Backing::Rbd(_) => {}
        }
    }
    cur == want
}

impl Hooks for BinHooks {
    fn build_lun(
        &self,
        target: &str,
        lun: u64,
        spec: &str,
    ) -> Result<(Arc<LogicalUnit>, String), String> {
        let data_dir = self.data_dir();
        let l = config::parse_lun(spec, &data_dir)?;
        let (_, lu) =
            crate::build_lu(target, lun as usize, &l, &data_dir).map_err(|e| format!("{e:#}"))?;
        Ok((lu, lun_spec(&l)))
    }

    fn command(&self, control: &Control, argv: &[String]) -> Option<Result<Value, String>> {
        let a: Vec<&str> = argv.iter().map(String::as_str).collect();
        Some(match a.as_slice() {
            ["apply", file] | ["apply", file, "--dry-run"] => {
                let dry = a.len() == 3;
                self.apply(control, Path::new(file), dry).map(|c| {
                    let mut text = if c.is_empty() {
                        "no changes\n".to_string()
                    } else {
                        c.join("\n") + "\n"
                    };
                    if dry {
                        text.push_str("(dry run: nothing changed)\n");
                    }
                    json!({ "changes": c, "dry_run": dry, "text": text })
                })
            }
            ["cluster"] => match crate::CLUSTER.get() {
                Some(node) => Ok(node.status()),
                None => {
                    Err("this node is not part of a cluster (no [cluster] or --cluster)".into())
                }
            },
            ["save"] | ["save", _] => {
                let file = a.get(1).map(PathBuf::from).or_else(|| self.config.clone());
                self.save_text(control).and_then(|text| match file {
                    None => Ok(json!({ "text": text })),
                    Some(f) => {
                        write_durably(&f, &text).map_err(|e| format!("{}: {e}", f.display()))?;
                        Ok(json!({ "message": format!("saved to {}", f.display()) }))
                    }
                })
            }
            _ => return None,
        })
    }
}

/// Replace `path` with `text` so that a crash or a power loss leaves the old or the new file,
/// never a torn one: write a temporary file beside it, fsync it, rename it over `path`, fsync
/// the directory (the rename itself is then durable).
fn write_durably(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("toml.new");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// What of an ALUA layout a configuration file says: (group, ports, state, preferred).
fn alua_layout(
    groups: &[ironsan_scsi::PortGroup],
) -> Vec<(u16, Vec<u16>, ironsan_scsi::AccessState, bool)> {
    groups
        .iter()
        .map(|g| (g.id, g.ports.clone(), g.state, g.preferred))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ironsan_server::Server;

    /// What `serve` does with a plan, less the printing.
    async fn start(plan: &Plan) -> Server {
        let mut targets = Vec::new();
        for t in &plan.targets {
            let mut scsi = ironsan_scsi::Target::new();
            for (n, l) in t.luns.iter().enumerate() {
                let (_, lu) = crate::build_lu(&t.name, n, l, &plan.data_dir).unwrap();
                scsi.add_lun(n as u64, lu);
            }
            targets.push(TargetDef {
                name: t.name.clone(),
                alias: None,
                max_connections: t.connections_per_session,
                error_recovery_level: t.error_recovery_level,
                scsi: Arc::new(scsi),
            });
        }
        let cfg = crate::server_config(plan, targets);
        let server = Server::bind(cfg).await.unwrap();
        let control = server.control();
        for t in &plan.targets {
            for (n, l) in t.luns.iter().enumerate() {
                control.set_lun_origin(&t.name, n as u64, Some(lun_spec(l)));
            }
        }
        server
    }

    fn ids(control: &Control, t: &str) -> Vec<(u64, String)> {
        control
            .lun_list(t)
            .unwrap()
            .iter()
            .map(|(_, lu, _)| (lu.config().naa, lu.config().serial.clone()))
            .collect()
    }

    #[tokio::test]
    async fn save_writes_lun_identity_and_apply_keeps_it_across_a_rename() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.toml");
        let text = format!(
            r#"data_dir = "{}"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:0"]
[[portal_group]]
tag = 2
listen = ["127.0.0.1:0"]
[[target]]
name = "iqn.2026-11.org.x:old"
portal_groups = [2]
error_recovery_level = 0
[[target.lun]]
spec = "ram:1M"
[[target.lun]]
spec = "ram:1M"
serial = "S1"
naa = "0x5000000000000042"
[limits]
max_connections = 64
write_buffer_per_session = "96M"
shutdown_grace = "2500ms"
"#,
            dir.path().display()
        );
        std::fs::write(&file, &text).unwrap();
        let plan = config::load_file(&file).unwrap();
        let server = start(&plan).await;
        let control = server.control();
        let hooks = BinHooks::new(plan, Some(file.clone()));
        let old = ids(&control, "iqn.2026-11.org.x:old");
        let derived = ironsan_scsi::local_naa("iqn.2026-11.org.x:old/0");
        assert_eq!(
            old,
            vec![
                (derived, format!("{derived:016x}")),
                (0x5000_0000_0000_0042, "S1".to_string())
            ]
        );
        // A state set live is saved (the groups with it).
        control
            .set_alua_state(
                "iqn.2026-11.org.x:old",
                2,
                ironsan_scsi::AccessState::ActiveNonOptimized,
                None,
            )
            .unwrap();
        // A portal added live is saved, as bound.
        let p3 = control
            .add_portal("127.0.0.1:0".parse().unwrap(), 3)
            .unwrap()
            .addr;
        let bound: Vec<_> = control.portal_list().iter().map(|p| p.addr).collect();
        let saved = hooks.save_text(&control).unwrap();
        for want in [
            format!("serial = \"{derived:016x}\"\nnaa = \"0x{derived:016x}\""),
            "serial = \"S1\"\nnaa = \"0x5000000000000042\"".to_string(),
            "portal_groups = [2]".to_string(),
            "error_recovery_level = 0".to_string(),
            format!("[[portal_group]]\ntag = 2\nlisten = [\"{}\"]", bound[1]),
            format!("[[portal_group]]\ntag = 3\nlisten = [\"{p3}\"]"),
            "[limits]\n".to_string(),
            "write_buffer_per_session = \"96M\"".to_string(),
            "shutdown_grace = \"2500ms\"".to_string(),
            "[[target.alua_group]]\nid = 2\nportal_groups = [2]\nstate = \"active/non-optimized\"\n"
                .to_string(),
        ] {
            assert!(saved.contains(&want), "{want}\n---\n{saved}");
        }
        // The saved file reads back as the running state: portals (as bound) and every limit.
        let back = config::parse_file(&saved, Path::new("saved.toml")).unwrap();
        assert_eq!(back.limits, plan_limits(&file_limits(&text)));
        assert_eq!(back.limits.max_connections, 64);
        assert_eq!(
            back.portal_groups
                .iter()
                .flat_map(|g| g.listen.iter().map(|a| (g.tag, *a)))
                .collect::<Vec<_>>(),
            vec![(1, bound[0]), (2, bound[1]), (3, p3)]
        );
        // Applying what was saved changes nothing.
        std::fs::write(&file, &saved).unwrap();
        assert_eq!(
            hooks.apply(&control, &file, false).unwrap(),
            Vec::<String>::new()
        );
        // Renamed target: the LUNs keep the saved identities.
        std::fs::write(&file, saved.replace(":old", ":new")).unwrap();
        hooks.apply(&control, &file, false).unwrap();
        assert_eq!(control.target_names(), vec!["iqn.2026-11.org.x:new"]);
        assert_eq!(ids(&control, "iqn.2026-11.org.x:new"), old);
        assert_eq!(
            control.portal_groups("iqn.2026-11.org.x:new").unwrap(),
            Some(vec![2])
        );
        // A LUN changed by a file that names no identity keeps the running one.
        let edited = text
            .replace(":old", ":new")
            .replacen("spec = \"ram:1M\"", "spec = \"ram:1M,ro\"", 1)
            .replace("portal_groups = [2]\n", "");
        std::fs::write(&file, &edited).unwrap();
        let changes = hooks.apply(&control, &file, false).unwrap();
        // The target's portal groups, its ALUA groups (back to one per portal group), the
        // LUN, and the live portal that the file does not have.
        assert_eq!(changes.len(), 4, "{changes:?}");
        assert!(changes[1].contains("ALUA target port groups (one per portal group)"));
        assert_eq!(changes[3], format!("- portal {p3} (group 3)"));
        assert_eq!(ids(&control, "iqn.2026-11.org.x:new"), old);
        assert_eq!(
            control.portal_groups("iqn.2026-11.org.x:new").unwrap(),
            None
        );
        assert!(
            control.lun_list("iqn.2026-11.org.x:new").unwrap()[0]
                .1
                .config()
                .read_only
        );
        assert_eq!(
            control
                .portal_list()
                .iter()
                .map(|p| p.addr)
                .collect::<Vec<_>>(),
            bound[..2]
        );
        // A portal moved to another group and a new group, with the target moved onto it:
        // portals change before the target, a portal that goes away after it.
        let moved = edited
            .replace(
                "tag = 2\nlisten = [\"127.0.0.1:0\"]",
                &format!("tag = 5\nlisten = [\"{}\"]\n[[portal_group]]\ntag = 6\nlisten = [\"127.0.0.1:0\"]", bound[1]),
            )
            .replace(
                "name = \"iqn.2026-11.org.x:new\"\n",
                "name = \"iqn.2026-11.org.x:new\"\nportal_groups = [6]\n",
            )
            .replace("max_connections = 64", "max_connections = 65");
        std::fs::write(&file, &moved).unwrap();
        let dry = hooks.apply(&control, &file, true).unwrap();
        let changes = hooks.apply(&control, &file, false).unwrap();
        assert_eq!(dry, changes);
        assert_eq!(
            changes[..4],
            [
                "! data_dir, queue_depth, metrics, control and [limits] take effect only after a restart".to_string(),
                format!("~ portal {}: group 2 -> 5", bound[1]),
                "+ portal 127.0.0.1:0 (group 6)".to_string(),
                "~ target iqn.2026-11.org.x:new: portal groups [6]".to_string(),
            ],
            "{changes:?}"
        );
        assert_eq!(changes.len(), 4, "{changes:?}");
        let now = control.portal_list();
        assert_eq!(
            now.iter().map(|p| p.tag).collect::<Vec<_>>(),
            vec![1, 5, 6],
            "{now:?}"
        );
        assert_eq!(now[1].addr, bound[1]);
        // The last portal of group 6 cannot go while the target is served only there.
        let e = control.remove_portal(now[2].addr).unwrap_err();
        assert!(e.contains("iqn.2026-11.org.x:new"), "{e}");
        // Applying the same file again changes nothing (the restart notice aside: [limits]
        // still differ from the running ones).
        assert_eq!(hooks.apply(&control, &file, false).unwrap().len(), 1);
    }

    #[tokio::test]
    async fn apply_swaps_a_portal_for_a_wildcard_and_keeps_portals_when_a_bind_fails() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("p.toml");
        let with = |listen: &str| {
            format!(
                "listen = [{listen}]\ndata_dir = \"{}\"\n[[target]]\nname = \"iqn.2026-11.org.x:p\"\n[[target.lun]]\nspec = \"ram:1M\"\n",
                dir.path().display()
            )
        };
        std::fs::write(&file, with("\"127.0.0.1:0\"")).unwrap();
        let plan = config::load_file(&file).unwrap();
        let server = start(&plan).await;
        let control = server.control();
        let hooks = BinHooks::new(plan, Some(file.clone()));
        let p = control.portal_list()[0].addr;
        // 127.0.0.1:P → 0.0.0.0:P: the old socket is closed before the wildcard is bound.
        let any = SocketAddr::from(([0, 0, 0, 0], p.port()));
        std::fs::write(&file, with(&format!("\"{any}\""))).unwrap();
        assert_eq!(
            hooks.apply(&control, &file, false).unwrap(),
            vec![format!(
                "~ portal {p} (group 1) replaced by {any} (group 1)"
            )]
        );
        assert_eq!(control.portal_list()[0].addr, any);
        // Replacing by an address that cannot be bound keeps the old portal.
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let t = taken.local_addr().unwrap();
        let e = control.replace_portal(any, t, 1).unwrap_err();
        assert!(e.contains(&format!("cannot listen on {t}")), "{e}");
        assert_eq!(control.portal_list()[0].addr, any);
        assert!(std::net::TcpStream::connect(("127.0.0.1", p.port())).is_ok());
        // A file whose new portal cannot be bound: the running one stays, and both are said.
        std::fs::write(&file, with(&format!("\"{t}\""))).unwrap();
        let e = hooks.apply(&control, &file, false).unwrap_err();
        assert!(e.contains(&format!("cannot listen on {t}")), "{e}");
        assert!(
            e.contains(&format!("- portal {any} (group 1): not closed")),
            "{e}"
        );
        assert_eq!(control.portal_list().len(), 1);
        assert_eq!(control.portal_list()[0].addr, any);
        assert!(clashes(&any, &"[::1]:1".parse().unwrap()) == (p.port() == 1));
    }

    /// The `[limits]` of a configuration text, parsed alone.
    fn file_limits(text: &str) -> String {
        text[text.find("[limits]").unwrap()..].to_string()
    }

    fn plan_limits(limits: &str) -> Limits {
        let t = format!("[[target]]\nname = \"iqn.2026-11.org.x:l\"\n[[target.lun]]\nspec = \"ram:1M\"\n{limits}");
        config::parse_file(&t, Path::new("l.toml")).unwrap().limits
    }

    #[test]
    fn limits_are_written_as_the_file_reads_them() {
        let d = Limits::default();
        assert_eq!(plan_limits(&limits_text(&d)), d);
        let l = Limits {
            login_timeout: std::time::Duration::from_secs(3),
            nop_interval: std::time::Duration::ZERO,
            nop_timeout: std::time::Duration::from_secs(7),
            max_connections: 9,
            max_sessions: 10,
            max_sessions_per_initiator: 2,
            write_buffer_per_session: (32 << 20) + 512,
            max_r2ts_per_connection: 5,
            tx_buffer_per_connection: 1 << 30,
            shutdown_grace: std::time::Duration::from_millis(1500),
            busy_poll: std::time::Duration::from_micros(50),
            zero_copy_reads: ironsan_server::ZeroCopyReads::On,
            zero_copy_writes: false,
            connection_fairness: false,
            io_engine: ironsan_backend::IoEngine::Threads,
        };
        let text = limits_text(&l);
        assert!(text.contains("tx_buffer_per_connection = \"1G\""), "{text}");
        assert!(
            text.contains("write_buffer_per_session = \"33554944\""),
            "{text}"
        );
        assert!(text.contains("shutdown_grace = \"1500ms\""), "{text}");
        assert_eq!(plan_limits(&text), l);
        assert_eq!(
            ironsan_server::limits::duration_text(std::time::Duration::ZERO),
            "0s"
        );
    }
}
