//! The command-line flags of `ironsan serve` (no configuration file) as a [`Plan`].

use super::*;

/// The plan from command-line flags.
pub(crate) fn from_flags(
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
            error_recovery_level: None,
            alua: None,
        }],
        discovery,
        limits: Limits::default(),
        metrics: None,
        control: None,
        cluster: None,
    })
}

/// A plan from flags made a cluster node's (`--cluster`): its `--listen` portals are portal
/// group N (the node number), as tags are the nodes' relative target ports, unique in the
/// cluster.
pub(crate) fn on_cluster(mut plan: Plan, cluster: ironsan_server::cluster::ClusterConfig) -> Plan {
    for g in plan.portal_groups.iter_mut().filter(|g| g.tag == 1) {
        g.tag = cluster.node;
    }
    plan.cluster = Some(cluster);
    plan
}
