//! `ironsan load`: the pipelined load generator of `ironsan-initiator` on the command line.

use anyhow::{anyhow, bail, Result};
use ironsan_initiator::load::{run, Pattern, Report, Spec, Spread, Url};
use std::time::Duration;

#[derive(clap::Args)]
pub(crate) struct LoadArgs {
    /// iscsi://[user%secret@]HOST[:PORT]/TARGET-IQN/LUN (libiscsi's URL form). With several
    /// URLs (paths to one LUN, or LUNs of several targets), session i logs in to URL
    /// i mod their number, and its connection j (--connections) to URL (i + j) mod their
    /// number.
    #[arg(required = true, num_args = 1..)]
    url: Vec<String>,
    /// randread | read | randwrite | write | randrw | rw (a mix: see --rwmixread).
    #[arg(long, default_value = "randread")]
    rw: String,
    /// Percentage of a mix's commands that read (fio's rwmixread).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u8).range(0..=100))]
    rwmixread: u8,
    /// Bytes per command (a multiple of the block size).
    #[arg(long, default_value_t = 4096)]
    bs: u32,
    /// Commands in flight per session.
    #[arg(long = "qd", default_value_t = 32)]
    queue_depth: u32,
    /// Sessions, all driven from one thread.
    #[arg(long, default_value_t = 1)]
    sessions: u32,
    /// TCP connections per session (MC/S: one CmdSN space; the target must allow as many).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    connections: u32,
    /// How a session's commands go over its connections: rr (round robin) or lqd (the one
    /// with the fewest in flight).
    #[arg(long, default_value = "rr")]
    spread: String,
    /// Seconds to run.
    #[arg(short = 't', long = "time", default_value_t = 10.0)]
    time: f64,
    /// Stop after this many commands per session (sequential patterns wrap at the end).
    #[arg(long)]
    count: Option<u64>,
    /// Stamp written blocks with their LBA; check the stamps of blocks read. Exit status 1
    /// on any mismatch.
    #[arg(long)]
    verify: bool,
    /// Every session registers a key and holds a Write Exclusive – All Registrants
    /// persistent reservation during the run (cleared after it), so every command meets the
    /// target's reservation check: what that check costs.
    #[arg(long)]
    reserve: bool,
    /// ErrorRecoveryLevel to offer (0, 1 or 2): above 0 the target keeps what it sends for
    /// SNACKs (what that costs); the load generator never asks for anything again (`ironsan
    /// cuts` does).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    erl: u8,
    /// Seed of the random LBAs.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Initiator name to log in with.
    #[arg(long, default_value = "iqn.2026-11.org.ironsan:load")]
    initiator_name: String,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

pub(crate) fn main(a: LoadArgs) -> Result<()> {
    let urls = a
        .url
        .iter()
        .map(|u| Url::parse(u).map_err(|e| anyhow!(e)))
        .collect::<Result<Vec<_>>>()?;
    let pattern = Pattern::parse(&a.rw).ok_or_else(|| {
        anyhow!(
            "--rw {:?}: want randread, read, randwrite, write, randrw or rw",
            a.rw
        )
    })?;
    if !(a.time.is_finite() && a.time > 0.0 && a.time <= 1e7) {
        bail!("--time must be a positive number of seconds (at most 10^7)");
    }
    let spread = Spread::parse(&a.spread)
        .ok_or_else(|| anyhow!("--spread {:?}: want rr or lqd", a.spread))?;
    let mut spec = Spec::new(pattern, a.bs, a.queue_depth);
    spec.sessions = a.sessions;
    spec.connections = a.connections;
    spec.spread = spread;
    spec.read_percent = a.rwmixread;
    spec.duration = Duration::from_secs_f64(a.time);
    spec.count = a.count;
    spec.verify = a.verify;
    spec.reserve = a.reserve;
    spec.error_recovery_level = a.erl;
    spec.seed = a.seed;
    spec.initiator_name = a.initiator_name;
    // One thread: the figures mean "one client core".
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(run(&urls, &spec))?;
    print(&a.json, &spec, &r);
    if let Some(f) = &r.first_failure {
        bail!("{} of {} commands failed; first: {f}", r.failed, r.ios);
    }
    if let Some(f) = &r.first_verify_failure {
        bail!(
            "{} reads returned wrong data; first: {f}",
            r.verify_failures
        );
    }
    Ok(())
}

fn print(json: &bool, spec: &Spec, r: &Report) {
    let secs = r.elapsed.as_secs_f64();
    let cpu_us_per_io = r.cpu.as_secs_f64() * 1e6 / (r.ios.max(1) as f64);
    if *json {
        let sessions: Vec<_> = r
            .sessions
            .iter()
            .map(|s| {
                serde_json::json!({
                    "portal": s.portal,
                    "ios": s.ios,
                    "bytes": s.bytes,
                    "seconds": s.elapsed.as_secs_f64(),
                    "mib_per_s": s.mib_per_s(),
                    "lat_mean_us": s.lat_mean_us,
                    "lat_stddev_us": s.lat_stddev_us,
                })
            })
            .collect();
        let connections: Vec<_> = r
            .connections
            .iter()
            .map(|c| {
                serde_json::json!({
                    "session": c.session,
                    "cid": c.cid,
                    "portal": c.portal,
                    "ios": c.ios,
                    "bytes": c.bytes,
                    "seconds": c.elapsed.as_secs_f64(),
                    "mib_per_s": c.mib_per_s(),
                    "lat_mean_us": c.lat_mean_us,
                    "lat_stddev_us": c.lat_stddev_us,
                })
            })
            .collect();
        let v = serde_json::json!({
            "rw": spec.pattern.name(),
            "bs": spec.io_bytes,
            "qd": spec.queue_depth,
            "sessions": spec.sessions,
            "connections": spec.connections,
            "spread": spec.spread.name(),
            "ios": r.ios,
            "writes": r.writes,
            "bytes": r.bytes,
            "seconds": secs,
            "iops": r.iops(),
            "mib_per_s": r.mib_per_s(),
            "lat_mean_us": r.latency.mean_us(),
            "lat_stddev_us": r.latency.stddev_us(),
            "lat_p50_us": r.latency.percentile_us(0.5),
            "lat_p99_us": r.latency.percentile_us(0.99),
            "lat_max_us": r.latency.max_us(),
            "failed": r.failed,
            "verify_failures": r.verify_failures,
            "client_cpu_s": r.cpu.as_secs_f64(),
            "block_size": r.block_size,
            "blocks": r.blocks,
            "per_session": sessions,
            "per_connection": connections,
        });
        println!("{v}");
        return;
    }
    println!(
        "{} bs={} qd={} sessions={} connections={}: {} I/Os in {secs:.2} s = {:.0} IOPS, \
         {:.1} MiB/s; latency mean {:.1} us, p50 {:.0} us, p99 {:.0} us, max {:.0} us; \
         failed {}; verify failures {}; client CPU {cpu_us_per_io:.2} us/IO",
        spec.pattern.name(),
        spec.io_bytes,
        spec.queue_depth,
        spec.sessions,
        spec.connections,
        r.ios,
        r.iops(),
        r.mib_per_s(),
        r.latency.mean_us(),
        r.latency.percentile_us(0.5),
        r.latency.percentile_us(0.99),
        r.latency.max_us(),
        r.failed,
        r.verify_failures,
    );
    if r.sessions.len() > 1 {
        for (i, s) in r.sessions.iter().enumerate() {
            println!(
                "  session {i} via {}: {} I/Os, {:.1} MiB/s; latency mean {:.1} us, sd {:.1} us",
                s.portal,
                s.ios,
                s.mib_per_s(),
                s.lat_mean_us,
                s.lat_stddev_us
            );
        }
    }
    if spec.connections > 1 {
        for c in &r.connections {
            println!(
                "  session {} connection {} via {}: {} I/Os, {:.1} MiB/s; turnaround mean {:.1} \
                 us, sd {:.1} us",
                c.session,
                c.cid,
                c.portal,
                c.ios,
                c.mib_per_s(),
                c.lat_mean_us,
                c.lat_stddev_us
            );
        }
    }
}
