//! `ironsan`: the command-line front end. `ironsan serve` runs the target.

mod alloc;
mod config;
mod ctl;
mod cuts;
mod load;
mod notify;
mod reconcile;

use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};
use config::{Backing, Plan};
use ironsan_backend::{BlockDevice, FileBackend, FileOptions, NullBackend, RamBackend};
use ironsan_scsi::{LogicalUnit, LuConfig};
use ironsan_server::{Server, ServerConfig, TargetDef};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "ironsan",
    version,
    about = "A user-space iSCSI target (RFC 7143) for Linux storage nodes"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve iSCSI targets. With no arguments: one target with LUN 0 backed by a 1 GiB sparse
    /// file in ./ironsan-data, on 127.0.0.1:3260.
    Serve(Box<ServeArgs>),
    /// Inspect and change a running `ironsan serve` through its control socket.
    Ctl(ctl::CtlArgs),
    /// Load generator: keep --qd READ(16)/WRITE(16) commands in flight against any iSCSI
    /// target and report IOPS, MiB/s, latency percentiles and client CPU.
    Load(load::LoadArgs),
    /// Connection recovery under load: a verified stream over a session of two connections
    /// at ErrorRecoveryLevel 2, one connection cut every round and its commands reassigned
    /// to the other; reports the time from each cut to the recovery. Writes the LUN.
    Cuts(cuts::CutsArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) to stdout, e.g.
    /// `ironsan completions bash > /etc/bash_completion.d/ironsan`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Write the man pages (ironsan.1, ironsan-serve.1, ironsan-ctl.1, ...) into DIR.
    #[command(hide = true)]
    Manpages {
        /// Where to write them (created if missing).
        dir: PathBuf,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Portal to listen on, ADDR:PORT (repeatable; IPv6 as [::1]:3260). Default 127.0.0.1:3260.
    #[arg(long = "listen", value_name = "ADDR:PORT")]
    listen: Vec<String>,
    /// Target name (IQN). Default iqn.2026-11.org.ironsan:default.
    #[arg(long, value_name = "IQN")]
    target: Option<String>,
    /// LUN backing, repeatable, numbered 0,1,2...: null:SIZE | ram:SIZE | file:PATH | file:PATH:SIZE
    /// (SIZE with K/M/G/T suffix; a file is created sparse if missing; relative paths are
    /// under --data-dir).
    #[arg(long = "lun", value_name = "SPEC")]
    luns: Vec<String>,
    /// Serve as node N of a cluster of gateways sharing the targets and RBD images
    /// (docs/OPERATIONS.md): node=N,pool=POOL[,conf=PATH][,id=NAME][,name=NAME]
    /// [,heartbeat=2s][,notify_timeout=5s]. The --listen portals are then portal group N.
    #[arg(long, value_name = "node=N,pool=POOL[,...]", value_parser = config::parse_cluster_flag)]
    cluster: Option<ironsan_server::cluster::ClusterConfig>,
    /// Directory for backing files (created if missing).
    #[arg(long, value_name = "DIR", default_value = "./ironsan-data")]
    data_dir: PathBuf,
    /// TOML configuration file (targets, portals, LUNs, access control, limits); replaces
    /// --listen/--target/--lun and the access-control flags. Default: $IRONSAN_CONFIG, else
    /// /etc/ironsan/ironsan.toml if it exists and no such flag is given.
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "listen", "target", "luns", "chap", "mutual_chap", "chap_secret_file",
        "discovery_chap", "discovery_mutual_chap", "acl", "discovery_acl",
    ])]
    config: Option<PathBuf>,
    /// Require CHAP to log in to the target: USER:SECRET, USER:@FILE (secret read from FILE)
    /// or USER:env:VAR (from the environment; keeps it out of `ps`). Secrets: 12-255 bytes.
    #[arg(long, value_name = "USER:SECRET")]
    chap: Option<String>,
    /// Read the --chap secret from FILE; --chap is then only the user name (may contain ':').
    #[arg(long, value_name = "FILE", requires = "chap")]
    chap_secret_file: Option<PathBuf>,
    /// Mutual CHAP: the name and secret the target answers with (USER:SECRET, USER:@FILE,
    /// USER:env:VAR); must differ from the --chap secret.
    #[arg(long, value_name = "USER:SECRET", requires = "chap")]
    mutual_chap: Option<String>,
    /// Require CHAP for discovery sessions (same forms as --chap).
    #[arg(long, value_name = "USER:SECRET")]
    discovery_chap: Option<String>,
    /// Mutual CHAP for discovery sessions.
    #[arg(long, value_name = "USER:SECRET", requires = "discovery_chap")]
    discovery_mutual_chap: Option<String>,
    /// Allow only these initiators to log in to the target (repeatable): an IQN, a prefix
    /// ending in '*', or '*', optionally @ADDR[/LEN] for a source network. Default: everyone.
    #[arg(long = "acl", value_name = "INITIATOR[@NET]")]
    acl: Vec<String>,
    /// Allow only these initiators to open discovery sessions (same forms as --acl).
    #[arg(long = "discovery-acl", value_name = "INITIATOR[@NET]")]
    discovery_acl: Vec<String>,
    /// Open file LUNs with O_DIRECT (BLOCKIO: bypass the page cache).
    #[arg(long)]
    direct: bool,
    /// Start LUNs with the write cache enabled (WCE=1): writes are durable only after FUA or
    /// SYNCHRONIZE CACHE. Default: WCE=0, every acknowledged write is durable.
    #[arg(long)]
    write_cache: bool,
    /// Control socket for `ironsan ctl` (mode 0600); overrides `control` in the config file.
    /// Default: /run/ironsan/control.sock as
    /// root, else $XDG_RUNTIME_DIR/ironsan/control.sock or ./ironsan-data/control.sock; when
    /// the default is taken by another server, serve runs without one. "none" disables it.
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Serve Prometheus metrics (GET /metrics, plain HTTP) on ADDR:PORT, e.g. 127.0.0.1:9360
    /// (overrides `metrics` in the config file).
    /// Off by default; anyone who can reach it sees target names and load. Port 0 picks a free
    /// port (printed at start-up).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<std::net::SocketAddr>,
    /// Log filter (error, warn, info, debug, trace, or a tracing directive).
    #[arg(long, default_value = "info", env = "IRONSAN_LOG")]
    log: String,
    /// Opt-in busy polling: each connection keeps receiving for up to US microseconds
    /// (0-10000) before it sleeps. Cuts QD1 latency about 3x on loopback, but a core spins
    /// while initiators are active. Overrides `busy_poll_us` in [limits]. Default: 0 (off).
    #[arg(long, value_name = "US")]
    busy_poll_us: Option<u64>,
    /// Large reads (64 KiB and more) of file LUNs go from the page cache to the socket with no
    /// copy through ironsan, on connections without a data digest: on (sendfile), mapped
    /// (tmpfs/ramfs LUNs: one vectored send from a mapping of the file), auto (on, or mapped
    /// where the connection's TCP congestion control is BBR, which paces each sendfile
    /// chunk), off. In auto and on, such reads of nothing stored (RAM-LUN holes, NULL LUNs)
    /// go with sendfile as the kernel's zero page. Overrides `zero_copy_reads` in [limits].
    /// Default: auto.
    #[arg(long, value_name = "MODE")]
    zero_copy_reads: Option<ironsan_server::ZeroCopyReads>,
    /// Large writes (64 KiB and more) to file LUNs on tmpfs/ramfs receive their data straight
    /// into the file's pages, no copy through a buffer, on connections without a data digest:
    /// on, off. Overrides `zero_copy_writes` in [limits]. Default: on.
    #[arg(long, value_name = "on|off", value_parser = config::parse_on_off)]
    zero_copy_writes: Option<bool>,
    /// What runs file LUNs' I/O that may block (O_DIRECT, page-cache misses, writes to a
    /// device, flushes): auto (io_uring where the kernel allows it, else threads), uring
    /// (fail without it), threads. Overrides `io_engine` in [limits]. Default: auto.
    #[arg(long, value_name = "ENGINE")]
    io_engine: Option<ironsan_backend::IoEngine>,
    /// TCP connections a session may have (MaxConnections offered: MC/S, RFC 7143 §13.2),
    /// 1-64, for every target that does not set `connections_per_session`. Default: 4.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=config::MAX_CONNECTIONS_PER_SESSION as i64))]
    connections_per_session: Option<u16>,
    /// The highest ErrorRecoveryLevel sessions may agree (RFC 7143 §13.20): 0 (a damaged PDU
    /// or a lost connection ends the session), 1 (lost data asked for again, damaged headers
    /// dropped, SNACKs answered) or 2 (also: a lost connection's tasks wait for TASK REASSIGN
    /// on another), for every target that does not set `error_recovery_level`. Default: 2.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(0..=i64::from(ironsan_proto::negotiate::MAX_ERROR_RECOVERY_LEVEL)))]
    error_recovery_level: Option<u8>,
    /// The connections of a session with several (MC/S) move data in equal shares: one that
    /// gets ahead of the slowest busy one by 256 KiB waits (at most 50 ms) before it reads or
    /// sends more. on, off. Overrides `connection_fairness` in [limits]. Default: on.
    #[arg(long, value_name = "on|off", value_parser = config::parse_on_off)]
    connection_fairness: Option<bool>,
}

/// This node's cluster connection, when it is one (`[cluster]`): shared RBD LUNs, also those
/// added later by `ctl`, use its RADOS client and keep their reservations in the cluster.
static CLUSTER: std::sync::OnceLock<Arc<ironsan_server::cluster::ClusterNode>> =
    std::sync::OnceLock::new();

/// The file LUNs' I/O engine, fixed at start-up (LUNs added later by `ctl` use it too).
static IO_ENGINE: std::sync::OnceLock<ironsan_backend::IoEngine> = std::sync::OnceLock::new();

fn build_lu(
    target: &str,
    n: usize,
    l: &config::LunPlan,
    data_dir: &std::path::Path,
) -> Result<(Arc<dyn BlockDevice>, Arc<LogicalUnit>)> {
    let backend: Arc<dyn BlockDevice> = match &l.backing {
        Backing::Null { size } => Arc::new(NullBackend::new(*size)),
        Backing::Ram { size } => Arc::new(RamBackend::new(*size)),
        Backing::File { path, size } => {
            if let Some(dir) = path.parent() {
                if size.is_some() && !dir.as_os_str().is_empty() {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                }
            }
            let opts = FileOptions {
                direct: l.direct,
                size: *size,
                read_only: l.read_only,
                io_engine: IO_ENGINE.get().copied().unwrap_or_default(),
                ..Default::default()
            };
            let file = FileBackend::open(path, &opts)
                .with_context(|| format!("LUN {n}: opening {}", path.display()))?;
            if let Some(why) = file.uring_unavailable() {
                tracing::warn!("LUN {n}: io_uring unavailable ({why}): I/O threads instead");
            }
            Arc::new(file)
        }
        Backing::Rbd(r) => {
            let opts = ironsan_backend::RbdOptions {
                pool: r.pool.clone(),
                namespace: r.namespace.clone(),
                image: r.image.clone(),
                conf: r.conf.clone(),
                id: r.id.clone(),
                read_only: l.read_only,
                write_cache: l.write_cache,
                timeout: std::time::Duration::from_secs(r.timeout_secs),
                state_dir: Some(lu_state_dir(data_dir, target, n)),
                shared: r.shared,
                // A cluster node serves its shared images through its one RADOS client, so
                // fencing that client's address fences its writes.
                client: CLUSTER.get().filter(|_| r.shared).map(|c| c.client()),
                // ... and hands no write to librbd once the node's lease has lapsed.
                lease: CLUSTER.get().filter(|_| r.shared).map(|c| c.lease()),
            };
            Arc::new(
                ironsan_backend::RbdBackend::open(&opts)
                    .map_err(|e| anyhow::anyhow!("LUN {n}: {e}"))?,
            )
        }
    };
    let backend: Arc<dyn BlockDevice> = if l.faults.is_empty() {
        backend
    } else {
        let rules = l
            .faults
            .iter()
            .map(|r| ironsan_backend::FaultRule::parse(r));
        let rules = rules
            .collect::<Result<Vec<_>, _>>()
            .map_err(anyhow::Error::msg)?;
        tracing::warn!("LUN {n}: fault injection on: {}", l.faults.join(" "));
        Arc::new(ironsan_backend::FaultBackend::new(
            backend,
            rules,
            l.block_size,
            l.fault_seed,
        ))
    };
    if backend.size() < l.block_size as u64 {
        anyhow::bail!("LUN {n}: size {} is smaller than one block", backend.size());
    }
    // An image several nodes serve: nothing atomic only within this process is offered; on
    // a cluster node its reservations live in the cluster.
    let shared = matches!(&l.backing, Backing::Rbd(r) if r.shared);
    if shared && CLUSTER.get().is_none() {
        tracing::warn!(
            "LUN {n}: shared without [cluster]: no leases and no fencing, so a node that stalls can land writes another node has already replaced (docs/OPERATIONS.md, \"Ceph RBD LUNs\"); serve it from a cluster of nodes unless its writers coordinate otherwise"
        );
    }
    // Configured (so it survives a renamed target), else derived from the name and number.
    let naa = l
        .naa
        .unwrap_or_else(|| ironsan_scsi::local_naa(&format!("{target}/{n}")));
    let cfg = LuConfig {
        block_size: l.block_size,
        physical_block_size: l.physical_block_size,
        read_only: l.read_only,
        write_cache: l.write_cache,
        serial: l.serial.clone().unwrap_or_else(|| format!("{naa:016x}")),
        naa,
        // Persistent reservations with APTPL are saved here (SPC-4 §5.13).
        state_dir: Some(lu_state_dir(data_dir, target, n)),
        shared,
        cluster: CLUSTER
            .get()
            .filter(|_| shared)
            .map(|c| c.lun_store(target, n as u64)),
        ..Default::default()
    };
    let lu = Arc::new(LogicalUnit::new(Arc::clone(&backend), cfg));
    follow_capacity(&lu);
    Ok((backend, lu))
}

/// Where a LU keeps its state (persistent reservations, an RBD image's lock owner).
fn lu_state_dir(data_dir: &std::path::Path, target: &str, n: usize) -> std::path::PathBuf {
    data_dir.join("state").join(target).join(n.to_string())
}

/// A LU whose device can be resized by others (a shared RBD image) follows its size: CAPACITY
/// DATA HAS CHANGED for every initiator when it changes. The task ends with the device.
fn follow_capacity(lu: &Arc<LogicalUnit>) {
    let Some(mut sizes) = lu.backend().size_watch() else {
        return;
    };
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let lu = Arc::downgrade(lu);
    rt.spawn(async move {
        while sizes.changed().await.is_ok() {
            let bytes = *sizes.borrow_and_update();
            let Some(lu) = lu.upgrade() else { return };
            let blocks = lu.capacity_changed(bytes);
            tracing::info!(blocks, "LUN resized outside ironsan: capacity follows");
        }
    });
}

/// What a start-up line says about access control (names, never secrets).
fn describe_access(a: &ironsan_server::Access) -> String {
    let auth = match (&a.chap, &a.mutual_chap) {
        (None, _) => "no authentication".to_string(),
        (Some(c), None) => format!("CHAP (user {})", c.user),
        (Some(c), Some(m)) => format!(
            "mutual CHAP (user {}, target answers as {})",
            c.user, m.user
        ),
    };
    let acl = if a.acl.is_empty() {
        "every initiator".to_string()
    } else {
        format!("{} ACL rule(s)", a.acl.len())
    };
    format!("{auth}, {acl}")
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

impl ServeArgs {
    /// Whether flags that describe targets (and so exclude a configuration file) are given.
    fn target_flags(&self) -> bool {
        !self.listen.is_empty()
            || self.target.is_some()
            || !self.luns.is_empty()
            || self.cluster.is_some()
            || self.chap.is_some()
            || self.chap_secret_file.is_some()
            || self.mutual_chap.is_some()
            || self.discovery_chap.is_some()
            || self.discovery_mutual_chap.is_some()
            || !self.acl.is_empty()
            || !self.discovery_acl.is_empty()
    }
}

/// The server configuration a plan describes (portal groups, queue depth, discovery access,
/// limits) for `targets`; per-target access is the caller's.
fn server_config(plan: &Plan, targets: Vec<TargetDef>) -> ServerConfig {
    let mut cfg = ServerConfig::new(Vec::new(), targets);
    cfg.portal_groups = plan.portal_groups.clone();
    cfg.target_portal_groups = plan
        .targets
        .iter()
        .filter_map(|t| Some((t.name.clone(), t.portal_groups.clone()?)))
        .collect();
    cfg.queue_depth = plan.queue_depth;
    cfg.discovery = plan.discovery.clone();
    cfg.limits = plan.limits.clone();
    cfg
}

async fn serve(args: ServeArgs) -> Result<()> {
    let (plan, config_path) = load_plan(&args)?;
    let _ = IO_ENGINE.set(plan.limits.io_engine);
    if let Some(c) = &plan.cluster {
        let cfg = c.clone();
        let node =
            tokio::task::spawn_blocking(move || ironsan_server::cluster::ClusterNode::connect(cfg))
                .await?
                .map_err(anyhow::Error::msg)?;
        let _ = CLUSTER.set(node);
    }
    let (targets, access, mut summary) = build_targets(&plan)?;
    summary.push(format!("  discovery: {}", describe_access(&plan.discovery)));
    let mut cfg = server_config(&plan, targets);
    cfg.access = access;
    let server = Server::bind(cfg).await?;
    let control = server.control();
    // A cluster node registers and catches up on the shared state (reservations, the other
    // nodes) before it accepts a connection.
    if let Some(node) = CLUSTER.get() {
        control.set_cluster(Arc::clone(node));
        let (joining, c) = (Arc::clone(node), Arc::new(control.clone()));
        tokio::task::spawn_blocking(move || joining.join(c))
            .await?
            .map_err(anyhow::Error::msg)?;
        summary.push(format!(
            "  cluster node {n} (pool {}): target port group {n}",
            plan.cluster.as_ref().map_or("", |c| c.pool.as_str()),
            n = node.node()
        ));
    }
    for t in &plan.targets {
        for (n, l) in t.luns.iter().enumerate() {
            control.set_lun_origin(&t.name, n as u64, Some(reconcile::lun_spec(l)));
        }
    }
    let hooks = Arc::new(reconcile::BinHooks::new(plan.clone(), config_path.clone()));
    let control_path = args.control.clone().or_else(|| plan.control.clone());
    let control_task = start_control(control_path, control.clone(), Arc::clone(&hooks))?;
    let metrics_task = start_metrics(&args, &plan, &control).await?;
    let addrs = server.local_addrs();
    print_banner(&summary, &server.portals(), &plan);
    // The handlers are installed before READY=1: a SIGTERM right after it must not kill
    // the process with the default action.
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    // Every portal, the control socket and the metrics listener are bound: ready.
    notify::notify_or_warn(&format!(
        "READY=1\nSTATUS=serving {} target(s) on {} portal(s)",
        plan.targets.len(),
        addrs.len()
    ));
    // systemd's watchdog (WatchdogSec=): a task that only pings, at half the interval.
    let watchdog_task = notify::watchdog_interval().map(|(addr, every)| {
        tracing::info!("systemd watchdog: WATCHDOG=1 every {:?}", every / 2);
        tokio::spawn(notify::watchdog(addr, every / 2))
    });
    let grace = plan.limits.shutdown_grace;
    server
        .run(async {
            loop {
                tokio::select! {
                    _ = int.recv() => break,
                    _ = term.recv() => break,
                    _ = hup.recv() => {
                        reload(&hooks, &control, config_path.as_deref()).await;
                    }
                }
            }
            notify::notify_or_warn(&format!(
                "STOPPING=1\nSTATUS=asking initiators to log out (up to {grace:?})"
            ));
        })
        .await;
    if let Some(t) = control_task {
        t.abort();
    }
    if let Some(t) = metrics_task {
        t.abort();
    }
    if let Some(t) = watchdog_task {
        t.abort();
    }
    Ok(())
}

/// Where the configuration comes from (a file or the flags), read, with the flags that
/// override `[limits]` and the targets' session settings applied and checked.
fn load_plan(args: &ServeArgs) -> Result<(Plan, Option<std::path::PathBuf>)> {
    let source = config::config_source(
        args.config.as_deref(),
        std::env::var_os("IRONSAN_CONFIG").as_deref(),
        args.target_flags(),
        std::path::Path::new(config::DEFAULT_CONFIG_PATH),
    )
    .map_err(anyhow::Error::msg)?;
    match &source {
        config::Source::Env(p) => println!("configuration {} (from IRONSAN_CONFIG)", p.display()),
        config::Source::Default(p) => {
            println!("configuration {} (the default location)", p.display())
        }
        config::Source::Flag(_) | config::Source::Flags => {}
    }
    let config_path = source.path().map(std::path::Path::to_owned);
    let mut plan: Plan = match &config_path {
        Some(path) => config::load_file(path).map_err(anyhow::Error::msg)?,
        None => config::from_flags(
            &args.listen,
            args.target.as_deref(),
            &args.luns,
            &args.data_dir,
            args.direct,
            args.write_cache,
            &config::AuthFlags {
                chap: args.chap.clone(),
                mutual_chap: args.mutual_chap.clone(),
                chap_secret_file: args.chap_secret_file.clone(),
                discovery_chap: args.discovery_chap.clone(),
                discovery_mutual_chap: args.discovery_mutual_chap.clone(),
                acl: args.acl.clone(),
                discovery_acl: args.discovery_acl.clone(),
            },
        )
        .map(|p| match args.cluster.clone() {
            Some(c) => config::on_cluster(p, c),
            None => p,
        })
        .map_err(anyhow::Error::msg)?,
    };
    if let Some(us) = args.busy_poll_us {
        plan.limits.busy_poll = std::time::Duration::from_micros(us);
    }
    if let Some(z) = args.zero_copy_reads {
        plan.limits.zero_copy_reads = z;
    }
    if let Some(z) = args.zero_copy_writes {
        plan.limits.zero_copy_writes = z;
    }
    if let Some(f) = args.connection_fairness {
        plan.limits.connection_fairness = f;
    }
    if let Some(e) = args.io_engine {
        plan.limits.io_engine = e;
    }
    if let Some(n) = args.connections_per_session {
        for t in plan.targets.iter_mut() {
            t.connections_per_session.get_or_insert(n);
        }
    }
    if let Some(n) = args.error_recovery_level {
        for t in plan.targets.iter_mut() {
            t.error_recovery_level.get_or_insert(n);
        }
    }
    // The flags above override [limits]; the result is checked against the same bounds.
    plan.limits
        .check()
        .map_err(|e| anyhow::anyhow!("[limits] or flags: {e}"))?;
    Ok((plan, config_path))
}

/// The targets built from a plan, each target's access rules, and the banner's lines.
type Built = (
    Vec<TargetDef>,
    std::collections::HashMap<String, ironsan_server::access::Access>,
    Vec<String>,
);

/// The targets of the plan with their LUs built, their access rules, and one summary line per
/// target and LUN for the start-up banner (never a secret).
fn build_targets(plan: &Plan) -> Result<Built> {
    let mut targets = Vec::new();
    let mut summary = Vec::new();
    let mut access = std::collections::HashMap::new();
    for t in plan.targets.iter() {
        access.insert(t.name.clone(), t.access.clone());
        // Never the secrets: only what is required.
        summary.push(format!("  {}: {}", t.name, describe_access(&t.access)));
        let mut scsi = ironsan_scsi::Target::new();
        for (n, l) in t.luns.iter().enumerate() {
            let (backend, lu) = build_lu(&t.name, n, l, &plan.data_dir)?;
            let durability = if backend.capabilities().volatile {
                "volatile: data is lost on exit".to_string()
            } else if l.write_cache {
                "WCE=1: durable after FUA/SYNCHRONIZE CACHE".to_string()
            } else {
                "WCE=0: every acknowledged write is durable".to_string()
            };
            let what = match &l.backing {
                Backing::File { path, .. } => format!(
                    "{} {} ({})",
                    backend.kind(),
                    path.display(),
                    backend.io_engine().unwrap_or("-")
                ),
                Backing::Rbd(r) => format!("rbd {} (librbd)", r.image_spec()),
                _ => backend.kind().to_string(),
            };
            summary.push(format!(
                "  {} LUN {n}: {what}, {} ({durability})",
                t.name,
                human(backend.size())
            ));
            scsi.add_lun(n as u64, lu);
        }
        if let Some(groups) = &t.alua {
            scsi.set_alua(Arc::new(ironsan_scsi::Alua::new(groups.clone())));
        }
        targets.push(TargetDef {
            name: t.name.clone(),
            alias: t.alias.clone(),
            max_connections: t.connections_per_session,
            error_recovery_level: t.error_recovery_level,
            scsi: Arc::new(scsi),
        });
    }
    Ok((targets, access, summary))
}

/// The metrics and status page listener, when `--metrics` or the file's `metrics` asks for it.
async fn start_metrics(
    args: &ServeArgs,
    plan: &Plan,
    control: &ironsan_server::control::Control,
) -> Result<Option<tokio::task::JoinHandle<()>>> {
    Ok(match args.metrics.or(plan.metrics) {
        Some(addr) => {
            let what = if args.metrics.is_some() {
                "--metrics"
            } else {
                "metrics"
            };
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| anyhow::anyhow!("{what}: cannot listen on {addr}: {e}"))?;
            let at = l.local_addr()?;
            println!("  metrics http://{at}/metrics, status page http://{at}/");
            Some(tokio::spawn(ironsan_server::http::serve(
                l,
                control.clone(),
            )))
        }
        None => None,
    })
}

/// What serve prints once it listens: the targets and LUNs, the portals, and how to connect.
fn print_banner(summary: &[String], portals: &[ironsan_server::Portal], plan: &Plan) {
    println!("ironsan {} serving:", env!("CARGO_PKG_VERSION"));
    for s in summary {
        println!("{s}");
    }
    for p in portals {
        println!("  portal {} (group {})", p.addr, p.tag);
    }
    let first = plan.targets.first().and_then(|t| {
        let p = portals
            .iter()
            .find(|p| t.portal_groups.as_ref().is_none_or(|g| g.contains(&p.tag)))?;
        Some((p.addr, t))
    });
    if let Some((a, t)) = first {
        println!("Connect with open-iscsi:");
        println!("  iscsiadm -m discovery -t sendtargets -p {a} && iscsiadm -m node -T {} -p {a} --login", t.name);
        println!("or list with libiscsi:");
        println!("  iscsi-ls -s iscsi://{a}");
    }
}

/// SIGHUP: apply the configuration file serve started with, as a diff; log what changed.
async fn reload(
    hooks: &Arc<reconcile::BinHooks>,
    control: &ironsan_server::control::Control,
    config: Option<&std::path::Path>,
) {
    let Some(path) = config.map(std::path::Path::to_owned) else {
        tracing::warn!("SIGHUP ignored: serve was not started with a configuration file");
        return;
    };
    let (hooks, control) = (Arc::clone(hooks), control.clone());
    let r = tokio::task::spawn_blocking(move || hooks.reconcile(&control, &path, false)).await;
    match r {
        Ok(Ok(changes)) if changes.is_empty() => tracing::info!("SIGHUP: configuration unchanged"),
        Ok(Ok(changes)) => {
            for c in changes {
                tracing::info!("SIGHUP: {c}");
            }
        }
        Ok(Err(e)) => tracing::error!("SIGHUP: reload failed: {e}"),
        Err(e) => tracing::error!("SIGHUP: reload failed: {e}"),
    }
}

/// Bind the control socket (see `--control`) and serve it.
fn start_control(
    path: Option<PathBuf>,
    control: ironsan_server::control::Control,
    hooks: Arc<reconcile::BinHooks>,
) -> Result<Option<tokio::task::JoinHandle<()>>> {
    let (path, explicit) = match &path {
        Some(p) if p.as_os_str() == "none" => return Ok(None),
        Some(p) => (p.clone(), true),
        None => (ironsan_server::control::default_socket_path(), false),
    };
    let listener = match ironsan_server::control::bind_control(&path) {
        Ok(l) => l,
        Err(e) if !explicit => {
            tracing::warn!("no control socket: {e}");
            return Ok(None);
        }
        Err(e) => return Err(anyhow::Error::from(e).context("control socket")),
    };
    println!(
        "  control socket {} (ironsan ctl --control {0} sessions)",
        path.display()
    );
    Ok(Some(tokio::spawn(ironsan_server::control::serve_control(
        listener, control, hooks,
    ))))
}

/// The allocator the RAM store and the I/O buffers are tuned for ([`alloc::Allocator`]).
#[global_allocator]
static ALLOCATOR: alloc::Allocator = alloc::Allocator;

fn main() -> ExitCode {
    let small_pages = ironsan_backend::no_transparent_huge_pages();
    ironsan_backend::set_free_memory_release(alloc::release_free_memory);
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Serve(args) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_new(&args.log)
                        .unwrap_or_else(|_| "info".into()),
                )
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .init();
            if !small_pages {
                tracing::warn!("could not turn transparent huge pages off for this process");
            }
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .map_err(anyhow::Error::from)
                .and_then(|rt| rt.block_on(serve(*args)))
        }
        Cmd::Ctl(args) => return ctl::run(args),
        Cmd::Load(args) => load::main(args),
        Cmd::Cuts(args) => cuts::main(args),
        Cmd::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "ironsan",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Cmd::Manpages { dir } => manpages(&dir),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error and its causes, no backtrace.
            eprintln!("ironsan: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Write a man page for `ironsan` and for each command (`ironsan-serve.1`, `ironsan-ctl.1`,
/// `ironsan-ctl-lun.1`, ...) into `dir`.
fn manpages(dir: &std::path::Path) -> Result<()> {
    fn write(cmd: clap::Command, name: String, dir: &std::path::Path) -> Result<()> {
        let cmd = cmd.name(name.clone());
        let mut out = Vec::new();
        clap_mangen::Man::new(cmd.clone()).render(&mut out)?;
        let path = dir.join(format!("{name}.1"));
        std::fs::write(&path, out).with_context(|| path.display().to_string())?;
        for sub in cmd
            .get_subcommands()
            .filter(|s| !s.is_hide_set() && s.get_name() != "help")
        {
            write(sub.clone(), format!("{name}-{}", sub.get_name()), dir)?;
        }
        Ok(())
    }
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    let mut cmd = Cli::command();
    cmd.build();
    write(cmd, "ironsan".into(), dir)
}
