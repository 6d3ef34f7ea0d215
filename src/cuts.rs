//! `ironsan cuts`: connection recovery under load on the command line
//! ([`ironsan_initiator::cuts`]): a verified stream over a session of two connections at
//! ErrorRecoveryLevel 2, one connection cut every round and its commands reassigned to the
//! other; prints the time from each cut to the recovery.

use anyhow::{anyhow, bail, Result};
use ironsan_initiator::cuts::{run, CutSpec};
use ironsan_initiator::load::Url;
use ironsan_initiator::LoginOptions;

#[derive(clap::Args)]
pub(crate) struct CutsArgs {
    /// iscsi://HOST[:PORT]/TARGET-IQN/LUN. The LUN is written: its first --regions × --bs
    /// bytes are overwritten.
    url: String,
    /// Rounds: one connection cut (and replaced) per round.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    rounds: u32,
    /// Commands in flight on the connection cut each round.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=128))]
    depth: u32,
    /// Bytes per command (a multiple of --block-size).
    #[arg(long, default_value_t = 65536)]
    bs: u32,
    /// The LUN's block size.
    #[arg(long, default_value_t = 512)]
    block_size: u32,
    /// Regions of --bs bytes written and read, from LBA 0.
    #[arg(long, default_value_t = 256)]
    regions: u64,
    /// DefaultTime2Retain to offer (seconds the target keeps a cut connection's commands
    /// after DefaultTime2Wait).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..=3600))]
    time2retain: u16,
    /// Seed of the schedule (regions, reads or writes, where each cut falls).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Initiator name to log in with.
    #[arg(long, default_value = "iqn.2026-11.org.ironsan:cuts")]
    initiator_name: String,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

/// (median, 90th percentile, max) of `v`, in its unit.
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| {
        s.get(((s.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    (at(0.5), at(0.9), s.last().copied().unwrap_or(0.0))
}

pub(crate) fn main(a: CutsArgs) -> Result<()> {
    let url = Url::parse(&a.url).map_err(|e| anyhow!(e))?;
    if a.block_size == 0 || a.bs == 0 || !a.bs.is_multiple_of(a.block_size) {
        bail!("--bs must be a positive multiple of --block-size");
    }
    let mut opts = LoginOptions::new(Some(&url.target));
    opts.initiator_name = a.initiator_name;
    opts.time2retain = a.time2retain;
    let spec = CutSpec {
        addr: url.addr,
        opts,
        lun: url.lun,
        rounds: a.rounds,
        depth: a.depth,
        blocks: a.bs / a.block_size,
        block_size: a.block_size,
        regions: a.regions,
        seed: a.seed,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(run(&spec))?;
    let logout = spread(&r.logout_ms);
    let recovery = spread(&r.recovery_ms);
    if a.json {
        let v = serde_json::json!({
            "rounds": r.rounds,
            "commands": r.commands,
            "reassigned": r.reassigned,
            "retried": r.retried,
            "logout_ms": {"median": logout.0, "p90": logout.1, "max": logout.2},
            "recovery_ms": {"median": recovery.0, "p90": recovery.1, "max": recovery.2},
            "verified_blocks": r.verified_blocks,
            "mismatches": r.mismatches,
            "first_mismatch": r.first_mismatch,
            "failures": r.failures,
        });
        println!("{v}");
    } else {
        println!(
            "{} rounds, {} commands on cut connections: {} reassigned, {} retried (never \
             received); cut -> logout for recovery answered: median {:.2} ms, p90 {:.2}, max \
             {:.2}; cut -> last status of the reassigned: median {:.2} ms, p90 {:.2}, max {:.2}; \
             {} blocks verified, {} mismatches, {} failures",
            r.rounds,
            r.commands,
            r.reassigned,
            r.retried,
            logout.0,
            logout.1,
            logout.2,
            recovery.0,
            recovery.1,
            recovery.2,
            r.verified_blocks,
            r.mismatches,
            r.failures.len()
        );
        for f in r.failures.iter().take(10).chain(&r.first_mismatch) {
            println!("  {f}");
        }
    }
    if r.mismatches > 0 || !r.failures.is_empty() {
        bail!(
            "{} blocks read back wrong, {} failures",
            r.mismatches,
            r.failures.len()
        );
    }
    Ok(())
}
