//! `ctl apply FILE`: the running state reconciled to a configuration file, one section at a
//! time, in an order that keeps every intermediate state valid: settings that need a restart
//! (only named), portals moved and added, targets removed, each target (added whole, or its
//! access, settings, portal groups, ALUA groups and LUNs changed), discovery's access, then
//! portals closed or replaced (a target may have been moved off them first; if a new portal
//! could not be bound, the old ones stay).

use super::{
    alua_layout, clashes, identity, keep_identity, lun_spec, plan_size, portal_diff, same_but_size,
    BinHooks, PortalDiff,
};
use crate::config::{self, Backing, Plan, TargetPlan};
use ironsan_server::control::{Control, ControlError};
use ironsan_server::{PortalInfo, TargetDef};
use std::cell::Cell;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

/// The changes of one `apply`: each described, made unless a dry run, its failure kept.
struct Steps {
    dry_run: bool,
    changes: Vec<String>,
    errors: Vec<String>,
}

impl Steps {
    fn step(&mut self, desc: String, f: impl FnOnce() -> Result<(), ControlError>) {
        if !self.dry_run {
            if let Err(e) = f() {
                self.errors.push(format!("{desc}: {}", e.message));
                return;
            }
        }
        self.changes.push(desc);
    }
}

/// A LUN built from the file's plan, its failure as the control plane reports it.
fn build_lu(
    target: &str,
    n: usize,
    l: &config::LunPlan,
    data_dir: &Path,
) -> Result<Arc<ironsan_scsi::LogicalUnit>, ControlError> {
    crate::build_lu(target, n, l, data_dir)
        .map(|(_, lu)| lu)
        .map_err(|e| ControlError::failed(format!("{e:#}")))
}

impl BinHooks {
    /// Reconcile the running state to `file`: returns the changes (made unless `dry_run`).
    pub(crate) fn reconcile(
        &self,
        control: &Control,
        file: &Path,
        dry_run: bool,
    ) -> Result<Vec<String>, ControlError> {
        let plan = config::load_file(file).map_err(|e| ControlError::invalid(e.to_string()))?;
        let mut steps = Steps {
            dry_run,
            changes: Vec::new(),
            errors: Vec::new(),
        };
        self.restart_notes(&plan, &mut steps);
        let running = control.target_names();
        let portals = portal_diff(&control.portal_list(), &plan);
        let (closing, bind_failed) = portals_opened(control, &portals, &mut steps);
        for name in running
            .iter()
            .filter(|n| !plan.targets.iter().any(|t| &t.name == *n))
        {
            steps.step(format!("- target {name}"), || {
                control.remove_target(name, false).map(|_| ())
            });
        }
        for t in &plan.targets {
            if running.contains(&t.name) {
                target_changed(control, t, &plan.data_dir, &mut steps);
            } else {
                target_added(control, t, &plan.data_dir, &mut steps);
            }
        }
        if control.access(None).ok().as_ref() != Some(&plan.discovery) {
            steps.step("~ discovery: access (ACL/CHAP)".into(), || {
                control.set_access(None, plan.discovery.clone())
            });
        }
        portals_closed(control, closing, bind_failed, &mut steps);
        if !steps.errors.is_empty() {
            return Err(ControlError::failed(format!(
                "applied:\n  {}\nfailed:\n  {}",
                steps.changes.join("\n  "),
                steps.errors.join("\n  ")
            )));
        }
        if !dry_run {
            let mut p = self.plan.lock().unwrap_or_else(|p| p.into_inner());
            p.targets = plan.targets;
            p.discovery = plan.discovery;
            p.portal_groups = plan.portal_groups;
        }
        Ok(steps.changes)
    }

    /// What the file changes that only a restart applies: said, not made.
    fn restart_notes(&self, plan: &Plan, steps: &mut Steps) {
        let old = self.plan.lock().unwrap_or_else(|p| p.into_inner());
        if old.limits != plan.limits
            || old.queue_depth != plan.queue_depth
            || old.data_dir != plan.data_dir
            || old.metrics != plan.metrics
            || old.control != plan.control
        {
            steps.changes.push(
                "! data_dir, queue_depth, metrics, control and [limits] take effect only after a restart"
                    .to_string(),
            );
        }
    }
}

/// Portals moved to another group and new ones bound (before the targets: a new target may
/// be served only on a new group). Returns what is to close or be replaced at the end, and
/// whether a new portal could not be bound.
fn portals_opened(control: &Control, portals: &PortalDiff, steps: &mut Steps) -> (Closing, bool) {
    for (addr, old, tag) in &portals.moved {
        steps.step(format!("~ portal {addr}: group {old} -> {tag}"), || {
            control.set_portal_tag(*addr, *tag)
        });
    }
    // A new portal that clashes with one that goes away (same port, same or wildcard
    // address: 127.0.0.1:3260 replaced by 0.0.0.0:3260) replaces it, after the other
    // closings; one that clashes with several replaces the last of them.
    let mut removed: Vec<PortalInfo> = portals.removed.clone();
    let mut now = Vec::new();
    let mut replaced = Vec::new();
    for &(a, tag) in &portals.added {
        match removed.iter().rposition(|p| clashes(&a, &p.addr)) {
            Some(i) => replaced.push((removed.remove(i), a, tag)),
            None => now.push((a, tag)),
        }
    }
    let bind_failed = Cell::new(false);
    for (addr, tag) in &now {
        steps.step(format!("+ portal {addr} (group {tag})"), || {
            control
                .add_portal(*addr, *tag)
                .map(|_| ())
                .inspect_err(|_| bind_failed.set(true))
        });
    }
    (Closing { removed, replaced }, bind_failed.get())
}

/// Running portals the file no longer has, and those a new clashing portal replaces.
struct Closing {
    removed: Vec<PortalInfo>,
    replaced: Vec<(PortalInfo, SocketAddr, u16)>,
}

/// Close or replace the portals that go (after the targets: one may have been moved off
/// them). If a new portal could not be bound, the old ones stay: the file may be replacing
/// them.
fn portals_closed(control: &Control, closing: Closing, bind_failed: bool, steps: &mut Steps) {
    for p in &closing.removed {
        steps.step(format!("- portal {} (group {})", p.addr, p.tag), || {
            if bind_failed {
                return Err(ControlError::failed(
                    "not closed, as a new portal could not be bound",
                ));
            }
            control.remove_portal(p.addr).map(|_| ())
        });
    }
    for (old, addr, tag) in &closing.replaced {
        steps.step(
            format!(
                "~ portal {} (group {}) replaced by {addr} (group {tag})",
                old.addr, old.tag
            ),
            || {
                if bind_failed {
                    return Err(ControlError::failed(
                        "not replaced, as a new portal could not be bound",
                    ));
                }
                control.replace_portal(old.addr, *addr, *tag).map(|_| ())
            },
        );
    }
}

/// A target the file adds, whole: its LUNs, access, portal groups and ALUA groups.
fn target_added(control: &Control, t: &TargetPlan, data_dir: &Path, steps: &mut Steps) {
    steps.step(
        format!("+ target {} ({} LUNs)", t.name, t.luns.len()),
        || {
            let mut scsi = ironsan_scsi::Target::new();
            let mut specs = Vec::new();
            for (n, l) in t.luns.iter().enumerate() {
                scsi.add_lun(n as u64, build_lu(&t.name, n, l, data_dir)?);
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
}

/// A running target the file keeps: what differs of its settings, ALUA groups and LUNs.
fn target_changed(control: &Control, t: &TargetPlan, data_dir: &Path, steps: &mut Steps) {
    target_settings(control, t, steps);
    target_alua(control, t, steps);
    target_luns(control, t, data_dir, steps);
}

/// Access rules, MaxConnections, ErrorRecoveryLevel and portal groups.
fn target_settings(control: &Control, t: &TargetPlan, steps: &mut Steps) {
    let default = |n: Option<String>| n.unwrap_or_else(|| "the default".to_string());
    if control.access(Some(&t.name)).ok().as_ref() != Some(&t.access) {
        steps.step(format!("~ target {}: access (ACL/CHAP)", t.name), || {
            control.set_access(Some(&t.name), t.access.clone())
        });
    }
    if control.connections_per_session(&t.name).ok() != Some(t.connections_per_session) {
        let what = default(t.connections_per_session.map(|n| n.to_string()));
        steps.step(
            format!("~ target {}: connections per session {what}", t.name),
            || control.set_connections_per_session(&t.name, t.connections_per_session),
        );
    }
    if control.error_recovery_level(&t.name).ok() != Some(t.error_recovery_level) {
        let what = default(t.error_recovery_level.map(|n| n.to_string()));
        steps.step(
            format!("~ target {}: error recovery level {what}", t.name),
            || control.set_error_recovery_level(&t.name, t.error_recovery_level),
        );
    }
    if control.portal_groups(&t.name).ok().as_ref() != Some(&t.portal_groups) {
        let what = match &t.portal_groups {
            Some(g) => format!("{g:?}"),
            None => "all".into(),
        };
        steps.step(format!("~ target {}: portal groups {what}", t.name), || {
            control.set_portal_groups(&t.name, t.portal_groups.clone())
        });
    }
}

/// The file's ALUA target port groups against the running ones; no groups in the file means
/// the default: one group per portal group, each active/optimized, none preferred.
fn target_alua(control: &Control, t: &TargetPlan, steps: &mut Steps) {
    let Ok((fixed, groups)) = control.port_groups(&t.name) else {
        return;
    };
    let differs = match &t.alua {
        Some(want) => alua_layout(&groups) != alua_layout(want),
        None => {
            fixed
                || groups
                    .iter()
                    .any(|g| g.state != ironsan_scsi::AccessState::ActiveOptimized || g.preferred)
        }
    };
    if differs {
        let what = match &t.alua {
            Some(g) => format!("{} configured", g.len()),
            None => "one per portal group".into(),
        };
        steps.step(
            format!("~ target {}: ALUA target port groups ({what})", t.name),
            || control.set_port_groups(&t.name, t.alua.clone()),
        );
    }
}

/// LUNs the file drops, resizes, replaces or adds.
fn target_luns(control: &Control, t: &TargetPlan, data_dir: &Path, steps: &mut Steps) {
    let have = control.lun_list(&t.name).unwrap_or_default();
    for (n, _, _) in have.iter().filter(|(n, _, _)| *n as usize >= t.luns.len()) {
        steps.step(format!("- target {} LUN {n}", t.name), || {
            control.remove_lun(&t.name, *n).map(|_| ())
        });
    }
    for (n, l) in t.luns.iter().enumerate() {
        let cur = have.iter().find(|(m, _, _)| *m == n as u64);
        // The file's LUN, keeping the running identity (NAA, serial) where the file gives
        // none; and the running LUN, identity included.
        let (want, now) = match cur {
            Some((_, lu, spec)) => (
                keep_identity(l, lu),
                spec.as_deref()
                    .and_then(|s| config::parse_lun(s, data_dir).ok())
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
                steps.step(
                    format!("~ target {} LUN {n}: resize {now} -> {size} bytes", t.name),
                    || {
                        control.resize_lun(&t.name, n as u64, size)?;
                        control.set_lun_origin(&t.name, n as u64, Some(want_spec.clone()));
                        Ok(())
                    },
                );
            }
            _ => {
                let verb = if cur.is_some() { "~" } else { "+" };
                steps.step(
                    format!("{verb} target {} LUN {n}: {want_spec}", t.name),
                    || {
                        // An RBD image can be open for writing once per LU state directory:
                        // the old LUN goes first. Others are built first, so a failure
                        // leaves the old one in place.
                        let rbd = matches!(want.backing, Backing::Rbd(_));
                        if cur.is_some() && rbd {
                            drop(control.remove_lun(&t.name, n as u64)?);
                        }
                        let lu = build_lu(&t.name, n, &want, data_dir)?;
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
