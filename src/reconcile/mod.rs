//! The daemon's configuration reconciler: what the control socket needs the configuration
//! syntax for, which the server crate does not know. [`BinHooks`] implements the server's
//! `control::Hooks`: a LUN built from a spec (`lun add`), `apply` (the running state
//! reconciled to a file, `apply.rs`, one section at a time) and `save` (the running state
//! written as a file, `save.rs`).

mod apply;
mod save;

use crate::config::{self, Backing, Limits, LunPlan, Plan};
use anyhow::Result;
use ironsan_scsi::LogicalUnit;
use ironsan_server::control::{Control, ControlError, Hooks};
use ironsan_server::{Access, PortalGroup, PortalInfo};
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
    ) -> Result<(Arc<LogicalUnit>, String), ControlError> {
        let data_dir = self.data_dir();
        let l = config::parse_lun(spec, &data_dir).map_err(ControlError::invalid)?;
        let (_, lu) = crate::build_lu(target, lun as usize, &l, &data_dir)
            .map_err(|e| ControlError::failed(format!("{e:#}")))?;
        Ok((lu, lun_spec(&l)))
    }

    fn apply(&self, control: &Control, file: &Path, dry_run: bool) -> Result<Value, ControlError> {
        let c = self.reconcile(control, file, dry_run)?;
        let mut text = if c.is_empty() {
            "no changes\n".to_string()
        } else {
            c.join("\n") + "\n"
        };
        if dry_run {
            text.push_str("(dry run: nothing changed)\n");
        }
        Ok(json!({ "changes": c, "dry_run": dry_run, "text": text }))
    }

    fn save(&self, control: &Control, file: Option<&Path>) -> Result<Value, ControlError> {
        let text = self.save_text(control)?;
        match file.map(Path::to_path_buf).or_else(|| self.config.clone()) {
            None => Ok(json!({ "text": text })),
            Some(f) => {
                save::write_durably(&f, &text)
                    .map_err(|e| ControlError::failed(format!("{}: {e}", f.display())))?;
                Ok(json!({ "message": format!("saved to {}", f.display()) }))
            }
        }
    }
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
    use ironsan_server::{Server, TargetDef};

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
            hooks.reconcile(&control, &file, false).unwrap(),
            Vec::<String>::new()
        );
        // Renamed target: the LUNs keep the saved identities.
        std::fs::write(&file, saved.replace(":old", ":new")).unwrap();
        hooks.reconcile(&control, &file, false).unwrap();
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
        let changes = hooks.reconcile(&control, &file, false).unwrap();
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
        let dry = hooks.reconcile(&control, &file, true).unwrap();
        let changes = hooks.reconcile(&control, &file, false).unwrap();
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
        assert!(e.message.contains("iqn.2026-11.org.x:new"), "{e}");
        // Applying the same file again changes nothing (the restart notice aside: [limits]
        // still differ from the running ones).
        assert_eq!(hooks.reconcile(&control, &file, false).unwrap().len(), 1);
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
            hooks.reconcile(&control, &file, false).unwrap(),
            vec![format!(
                "~ portal {p} (group 1) replaced by {any} (group 1)"
            )]
        );
        assert_eq!(control.portal_list()[0].addr, any);
        // Replacing by an address that cannot be bound keeps the old portal.
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let t = taken.local_addr().unwrap();
        let e = control.replace_portal(any, t, 1).unwrap_err();
        assert!(e.message.contains(&format!("cannot listen on {t}")), "{e}");
        assert_eq!(control.portal_list()[0].addr, any);
        assert!(std::net::TcpStream::connect(("127.0.0.1", p.port())).is_ok());
        // A file whose new portal cannot be bound: the running one stays, and both are said.
        std::fs::write(&file, with(&format!("\"{t}\""))).unwrap();
        let e = hooks.reconcile(&control, &file, false).unwrap_err();
        assert!(e.message.contains(&format!("cannot listen on {t}")), "{e}");
        assert!(
            e.message
                .contains(&format!("- portal {any} (group 1): not closed")),
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
