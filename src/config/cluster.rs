//! `[cluster]` (or `--cluster`): this node of a cluster of ironsan gateways that serve the
//! same targets and RBD images (docs/ARCHITECTURE.md, "Several gateways on one image").
//!
//! ```toml
//! [cluster]
//! node = 1                 # 1-65535, unique in the cluster: the ALUA target port group
//! pool = "rbd"             # where the shared objects (one per target) live
//! # conf = "/etc/ceph/ceph.conf"   # default: librados' own search
//! # id = "admin"           # cephx client, without "client."
//! # name = "gw1"           # default: the host name
//! # group = "default"      # the cluster's name: nodes of one pool and group are one cluster
//! # heartbeat = "1s"       # how often the nodes ping each other
//! # lease = "3s"           # a node not heard from for this long is fenced; also the
//! #                        # longest a node holds a write before it stops answering
//! # notify_timeout = "5s"  # how long a reservation change waits before fencing a node
//! ```

use super::*;
use ironsan_server::cluster::{
    check_lease, ClusterConfig, DEFAULT_GROUP, DEFAULT_HEARTBEAT, DEFAULT_LEASE,
    DEFAULT_NOTIFY_TIMEOUT,
};
use std::time::Duration;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileCluster {
    node: Spanned<i64>,
    pool: Spanned<String>,
    conf: Option<String>,
    id: Option<String>,
    name: Option<String>,
    group: Option<String>,
    heartbeat: Option<Spanned<String>>,
    notify_timeout: Option<Spanned<String>>,
    lease: Option<Spanned<String>>,
}

/// The host name (for `name`'s default).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "ironsan".into())
}

/// Node `node` on `pool` with every other key at its default.
fn defaults(node: u16, pool: &str) -> ClusterConfig {
    ClusterConfig {
        node,
        name: host_name(),
        pool: pool.to_string(),
        conf: None,
        id: "admin".into(),
        heartbeat: DEFAULT_HEARTBEAT,
        notify_timeout: DEFAULT_NOTIFY_TIMEOUT,
        lease: DEFAULT_LEASE,
        group: DEFAULT_GROUP.into(),
    }
}

fn node_number(n: i64) -> Result<u16, String> {
    u16::try_from(n)
        .ok()
        .filter(|&n| n != 0)
        .ok_or_else(|| format!("cluster node must be 1 to 65535, not {n}"))
}

fn interval(key: &str, v: &str) -> Result<Duration, String> {
    let d = ironsan_backend::parse_duration(v)
        .ok_or_else(|| format!("cluster {key} '{v}' is not a duration (e.g. 2s, 500ms)"))?;
    if !(Duration::from_millis(100)..=Duration::from_secs(60)).contains(&d) {
        return Err(format!(
            "cluster {key} must be between 100ms and 60s, not {v}"
        ));
    }
    Ok(d)
}

fn check_name(what: &str, v: &str) -> Result<(), String> {
    if v.is_empty() || v.chars().any(|c| c.is_control() || c == ',') {
        return Err(format!(
            "cluster {what} '{v}' is empty or has a comma or control character"
        ));
    }
    Ok(())
}

pub(super) fn cluster_from_file(
    c: &Spanned<FileCluster>,
    at: At,
) -> Result<ClusterConfig, ConfigError> {
    let f = c.get_ref();
    let node = node_number(*f.node.get_ref()).map_err(|e| at(f.node.span(), e))?;
    check_name("pool", f.pool.get_ref()).map_err(|e| at(f.pool.span(), e))?;
    let heartbeat = match &f.heartbeat {
        Some(h) => interval("heartbeat", h.get_ref()).map_err(|e| at(h.span(), e))?,
        None => DEFAULT_HEARTBEAT,
    };
    let notify_timeout = match &f.notify_timeout {
        Some(h) => interval("notify_timeout", h.get_ref()).map_err(|e| at(h.span(), e))?,
        None => DEFAULT_NOTIFY_TIMEOUT,
    };
    let lease = match &f.lease {
        Some(h) => interval("lease", h.get_ref()).map_err(|e| at(h.span(), e))?,
        None => DEFAULT_LEASE,
    };
    check_lease(heartbeat, lease)
        .map_err(|e| at(f.lease.as_ref().map_or(c.span(), |l| l.span()), e))?;
    let mut cfg = defaults(node, f.pool.get_ref());
    cfg.heartbeat = heartbeat;
    cfg.notify_timeout = notify_timeout;
    cfg.lease = lease;
    cfg.conf = f.conf.as_ref().map(PathBuf::from);
    if let Some(n) = &f.name {
        cfg.name = n.clone();
    }
    if let Some(id) = &f.id {
        cfg.id = id.clone();
    }
    if let Some(g) = &f.group {
        cfg.group = g.clone();
    }
    check_name("name", &cfg.name).map_err(|e| at(c.span(), e))?;
    check_name("group", &cfg.group).map_err(|e| at(c.span(), e))?;
    check_name("id", &cfg.id).map_err(|e| at(c.span(), e))?;
    Ok(cfg)
}

/// `--cluster node=N,pool=POOL[,conf=PATH][,id=NAME][,name=NAME][,group=NAME][,heartbeat=D][,lease=D][,notify_timeout=D]`.
pub(crate) fn parse_cluster_flag(v: &str) -> Result<ClusterConfig, String> {
    let mut cfg = defaults(0, "");
    for part in v.split(',') {
        let (k, val) = part
            .split_once('=')
            .ok_or_else(|| format!("--cluster '{v}': '{part}' is not KEY=VALUE"))?;
        match k {
            "node" => {
                let n: i64 = val
                    .parse()
                    .map_err(|_| format!("--cluster: node '{val}' is not a number"))?;
                cfg.node = node_number(n).map_err(|e| format!("--cluster: {e}"))?;
            }
            "pool" => cfg.pool = val.to_string(),
            "conf" => cfg.conf = Some(PathBuf::from(val)),
            "id" => cfg.id = val.to_string(),
            "name" => cfg.name = val.to_string(),
            "group" => cfg.group = val.to_string(),
            "heartbeat" => cfg.heartbeat = interval(k, val).map_err(|e| format!("--cluster: {e}"))?,
            "notify_timeout" => {
                cfg.notify_timeout = interval(k, val).map_err(|e| format!("--cluster: {e}"))?
            }
            "lease" => cfg.lease = interval(k, val).map_err(|e| format!("--cluster: {e}"))?,
            _ => {
                return Err(format!(
                    "--cluster: unknown key '{k}' (node, pool, conf, id, name, group, heartbeat, lease, notify_timeout)"
                ))
            }
        }
    }
    check_lease(cfg.heartbeat, cfg.lease).map_err(|e| format!("--cluster: {e}"))?;
    if cfg.node == 0 {
        return Err("--cluster needs node=N (1-65535, unique in the cluster)".into());
    }
    for (what, val) in [
        ("pool", &cfg.pool),
        ("id", &cfg.id),
        ("name", &cfg.name),
        ("group", &cfg.group),
    ] {
        check_name(what, val).map_err(|e| format!("--cluster: {e}"))?;
    }
    Ok(cfg)
}

/// The `[cluster]` section `ctl save` writes.
pub(crate) fn cluster_toml(c: &ClusterConfig) -> String {
    let mut s = format!(
        "\n[cluster]\nnode = {}\npool = {:?}\nid = {:?}\nname = {:?}\ngroup = {:?}\n",
        c.node, c.pool, c.id, c.name, c.group
    );
    if let Some(conf) = &c.conf {
        s += &format!("conf = {:?}\n", conf.display().to_string());
    }
    s += &format!(
        "heartbeat = \"{}ms\"\nlease = \"{}ms\"\nnotify_timeout = \"{}ms\"\n",
        c.heartbeat.as_millis(),
        c.lease.as_millis(),
        c.notify_timeout.as_millis()
    );
    s
}
