//! `ctl save`: the running state written as a configuration file (portals as bound,
//! [limits], targets with their access rules, LUNs with their identity, ALUA groups), and
//! written so that a crash leaves the old or the new file.

use super::*;

impl BinHooks {
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

/// Replace `path` with `text` so that a crash or a power loss leaves the old or the new file,
/// never a torn one: write a temporary file beside it, fsync it, rename it over `path`, fsync
/// the directory (the rename itself is then durable).
pub(super) fn write_durably(path: &Path, text: &str) -> std::io::Result<()> {
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
