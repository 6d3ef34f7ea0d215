//! Connection recovery under load (`ironsan cuts`): a verified stream of reads and writes
//! over a session of two connections at ErrorRecoveryLevel 2 (RFC 7143 §7.2.2), one
//! connection cut in the middle of its commands every round and its tasks reassigned to the
//! other (logout for recovery, §11.14.1 reason 2, then TASK REASSIGN, §11.5.1), then a new
//! connection joined in its place.
//!
//! Each round issues `depth` commands on the connection to be cut: writes of a region not
//! touched this round (their data by R2T only, so a write can be cut before, during or after
//! its data) and reads of regions whose content is known. It then takes a random number of
//! the target's PDUs (answering R2Ts, sometimes only in part) and cuts the connection; on the
//! other one it logs the cut one out for recovery, reassigns every command with no status yet
//! (a read from the next DataSN it lacks), sends again the ones the target never received
//! (answered "task does not exist": a retry with the same CmdSN, RFC 7143 §6.2.1) and finishes
//! them. The regions are read once before the run; every read is compared with what the
//! acknowledged writes left, and every region is read back at the end: a write lost,
//! applied twice over a later one, or torn, and a read resumed at the wrong place, are
//! counted as mismatches. The report gives the time from each cut to the logout's answer and
//! to the last status of its reassigned commands.

use crate::{read16_cdb, write16_cdb, Client, Error, LoginOptions, Result};
use bytes::{Bytes, BytesMut};
use ironsan_proto::pdu::*;
use ironsan_proto::{CmdSn, DataSn};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// What a run does.
#[derive(Clone, Debug)]
pub struct CutSpec {
    pub addr: SocketAddr,
    /// Login options of the leading connection (ErrorRecoveryLevel 2, a DefaultTime2Retain
    /// and two connections are asked for here).
    pub opts: LoginOptions,
    pub lun: u64,
    pub rounds: u32,
    /// Commands in flight on the connection cut each round.
    pub depth: u32,
    /// Blocks per command.
    pub blocks: u32,
    pub block_size: u32,
    /// Regions of `blocks` blocks used, from LBA 0.
    pub regions: u64,
    pub seed: u64,
}

/// What a run saw.
#[derive(Clone, Debug, Default)]
pub struct CutReport {
    pub rounds: u32,
    /// Commands issued on connections that were then cut.
    pub commands: u64,
    /// Of them, reassigned (no status before the cut, TASK REASSIGN answered COMPLETE).
    pub reassigned: u64,
    /// Of them, sent again with their CmdSN (the target never had them: TASK REASSIGN
    /// answered "task does not exist").
    pub retried: u64,
    /// Milliseconds from each cut to the answer of the logout for recovery.
    pub logout_ms: Vec<f64>,
    /// Milliseconds from each cut to the last status of its reassigned commands.
    pub recovery_ms: Vec<f64>,
    /// Blocks compared (reads during the run and the final read-back).
    pub verified_blocks: u64,
    /// Blocks whose content was not what the acknowledged writes left.
    pub mismatches: u64,
    /// Where the first of them was found.
    pub first_mismatch: Option<String>,
    /// Commands that did not end GOOD, reassignments not answered COMPLETE.
    pub failures: Vec<String>,
}

enum Kind {
    Read {
        region: u64,
        buf: BytesMut,
        next_sn: u32,
    },
    Write {
        region: u64,
        data: Bytes,
    },
}

struct Task {
    /// The command as sent (its ITT and CmdSN), for a retry.
    cmd: ScsiCommand,
    kind: Kind,
    status: Option<u8>,
}

/// A small deterministic PRNG (xorshift64*, the load generator's step).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = crate::load::xorshift(self.0);
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The data of write `n` to `region`: every 8 bytes name both.
fn content(region: u64, n: u64, len: usize) -> Bytes {
    let mut b = BytesMut::with_capacity(len);
    let mut i = 0u64;
    while b.len() < len {
        let word = (region << 40) ^ (n << 20) ^ i;
        b.extend_from_slice(&word.to_le_bytes());
        i += 1;
    }
    b.truncate(len);
    b.freeze()
}

const PDU_WAIT: Duration = Duration::from_secs(30);

/// Run `spec`; errors only when the session itself cannot go on (a login refused, a
/// connection lost that was not cut).
pub async fn run(spec: &CutSpec) -> Result<CutReport> {
    let mut rng = Rng(spec.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let len = (spec.blocks * spec.block_size) as usize;
    let mut opts = spec.opts.clone();
    opts.error_recovery_level = 2;
    opts.max_connections = opts.max_connections.max(2);
    if opts.time2retain == 0 {
        opts.time2retain = 20;
    }
    // Writes wait for R2Ts: a cut can fall before, within or after their data.
    opts.initial_r2t = true;
    opts.immediate_data = false;
    let leader = Client::login(spec.addr, &opts).await?;
    if leader.negotiated_value("ErrorRecoveryLevel") != Some("2") {
        return Err(Error::Protocol(format!(
            "the target agreed ErrorRecoveryLevel {:?}, not 2",
            leader.negotiated_value("ErrorRecoveryLevel")
        )));
    }
    let mut leader = leader;
    // What the regions hold before the run.
    let mut known: HashMap<u64, Bytes> = HashMap::new();
    let regions = spec.regions.max(u64::from(spec.depth) + 1);
    for region in 0..regions {
        let r = read_region(&mut leader, spec, region).await?;
        if r.status != 0 || r.data.len() != len {
            return Err(Error::Protocol(format!(
                "reading region {region} before the run: status {:#x}, {} bytes",
                r.status,
                r.data.len()
            )));
        }
        known.insert(region, r.data);
    }
    let other = Client::join(spec.addr, &opts, &leader, 1).await?;
    let mut conns = [Some(leader), Some(other)];
    let mut sn = conns[0].as_ref().map(|c| c.cmd_sn).unwrap_or(CmdSn(0));
    let mut report = CutReport::default();
    let mut writes = 0u64;
    for round in 0..spec.rounds {
        let v = (round % 2) as usize;
        let (Some(mut victim), Some(mut survivor)) = (conns[v].take(), conns[1 - v].take()) else {
            return Err(Error::Protocol("a connection is missing".into()));
        };
        let cid = v as u16;
        // Commands on the connection to cut; regions written this round are neither read
        // nor written twice in it.
        let mut tasks: HashMap<Itt, Task> = HashMap::new();
        let mut busy: Vec<u64> = Vec::new();
        victim.cmd_sn = sn;
        for _ in 0..spec.depth {
            let mut region = rng.below(regions);
            while busy.contains(&region) {
                region = (region + 1) % regions;
            }
            busy.push(region);
            let lba = region * u64::from(spec.blocks);
            let write = rng.below(2) == 0;
            let cdb = if write {
                write16_cdb(lba, spec.blocks)
            } else {
                read16_cdb(lba, spec.blocks)
            };
            let cmd = crate::simple_command(spec.lun, write, len as u32, cdb);
            let (itt, cmd_sn) = victim.send_command(cmd.clone(), Bytes::new()).await?;
            let cmd = ScsiCommand { itt, cmd_sn, ..cmd };
            let kind = if write {
                writes += 1;
                Kind::Write {
                    region,
                    data: content(region, writes, len),
                }
            } else {
                Kind::Read {
                    region,
                    buf: BytesMut::zeroed(len),
                    next_sn: 0,
                }
            };
            tasks.insert(
                cmd.itt,
                Task {
                    cmd,
                    kind,
                    status: None,
                },
            );
        }
        report.commands += u64::from(spec.depth);
        // Some of the target's answers, then the cut.
        let take = rng.below(u64::from(spec.depth) * 4 + 1);
        for _ in 0..take {
            match tokio::time::timeout(Duration::from_millis(100), victim.recv()).await {
                Ok(Ok(p)) => {
                    let partial = rng.below(3) == 0;
                    handle(&mut victim, spec.lun, &mut tasks, p, partial).await?;
                }
                _ => break,
            }
        }
        let cut = Instant::now();
        let code = cut_and_recover(victim, cid, &mut survivor).await?;
        report.logout_ms.push(cut.elapsed().as_secs_f64() * 1000.0);
        if code != LogoutResponseCode::CLOSED {
            report.failures.push(format!(
                "round {round}: logout for recovery answered {}",
                code.0
            ));
        }
        let open: Vec<(Itt, u32)> = tasks
            .iter()
            .filter(|(_, t)| t.status.is_none())
            .map(|(i, t)| {
                let from = match &t.kind {
                    Kind::Read { next_sn, .. } => *next_sn,
                    Kind::Write { .. } => 0,
                };
                (*i, from)
            })
            .collect();
        let mut retry = Vec::new();
        for (itt, from) in &open {
            let code = survivor.task_reassign(*itt, DataSn(*from)).await?;
            match code {
                TmfResponseCode::COMPLETE => report.reassigned += 1,
                // Never received (lost with the connection, or held behind one that was):
                // sent again with its CmdSN (RFC 7143 §6.2.1).
                TmfResponseCode::TASK_DOES_NOT_EXIST => retry.push(*itt),
                _ => {
                    report.failures.push(format!(
                        "round {round}: TASK REASSIGN of {:#x} answered {}",
                        itt.0, code.0
                    ));
                    tasks.remove(itt);
                }
            }
        }
        // In CmdSN order, as first sent.
        retry.sort_by_key(|i| tasks.get(i).map(|t| t.cmd.cmd_sn.0));
        for itt in retry {
            let Some(t) = tasks.get_mut(&itt) else {
                continue;
            };
            report.retried += 1;
            if let Kind::Read { buf, next_sn, .. } = &mut t.kind {
                buf.fill(0);
                *next_sn = 0;
            }
            let cmd = ScsiCommand {
                exp_stat_sn: survivor.exp_stat_sn,
                ..t.cmd.clone()
            };
            survivor
                .send(Header::ScsiCommand(cmd), Bytes::new())
                .await?;
        }
        // What arrived while the reassignments were answered, then the rest.
        for p in std::mem::take(&mut survivor.unsolicited) {
            handle(&mut survivor, spec.lun, &mut tasks, p, false).await?;
        }
        while tasks.values().any(|t| t.status.is_none()) {
            let p = tokio::time::timeout(PDU_WAIT, survivor.recv())
                .await
                .map_err(|_| {
                    Error::Protocol(format!("round {round}: no answer in {PDU_WAIT:?}"))
                })??;
            handle(&mut survivor, spec.lun, &mut tasks, p, false).await?;
        }
        if !open.is_empty() {
            report
                .recovery_ms
                .push(cut.elapsed().as_secs_f64() * 1000.0);
        }
        // Check the reads against what was known before the round, then learn the writes.
        for (itt, t) in &tasks {
            match (&t.kind, t.status) {
                (Kind::Read { region, buf, .. }, Some(0)) => {
                    // A region whose last write failed is not checked.
                    let Some(want) = known.get(region) else {
                        continue;
                    };
                    report.verified_blocks += u64::from(spec.blocks);
                    let bad = mismatched_blocks(buf, want, spec.block_size);
                    if bad > 0 && report.first_mismatch.is_none() {
                        report.first_mismatch = Some(format!(
                            "round {round}: read {:#x} (CmdSN {}) of region {region}: {bad} \
                             blocks differ",
                            itt.0, t.cmd.cmd_sn.0
                        ));
                    }
                    report.mismatches += bad;
                }
                (_, Some(0)) => {}
                (_, s) => report.failures.push(format!(
                    "round {round}: {:#x} ended with status {s:?}",
                    itt.0
                )),
            }
        }
        for t in tasks.into_values() {
            if let Kind::Write { region, data } = t.kind {
                if t.status == Some(0) {
                    known.insert(region, data);
                } else {
                    // Not acknowledged: old or new, not checked any more.
                    known.remove(&region);
                }
            }
        }
        sn = survivor.cmd_sn;
        // A new connection in place of the cut one.
        let fresh = Client::join(spec.addr, &opts, &survivor, cid).await?;
        conns[v] = Some(fresh);
        conns[1 - v] = Some(survivor);
        report.rounds += 1;
    }
    // Every region read back.
    let Some(mut c) = conns[0].take() else {
        return Err(Error::Protocol("no connection left".into()));
    };
    c.cmd_sn = sn;
    for region in 0..regions {
        let r = read_region(&mut c, spec, region).await?;
        if r.status != 0 {
            report
                .failures
                .push(format!("read-back of region {region}: status {}", r.status));
            continue;
        }
        let Some(want) = known.get(&region) else {
            continue;
        };
        report.verified_blocks += u64::from(spec.blocks);
        let bad = mismatched_blocks(&r.data, want, spec.block_size);
        if bad > 0 && report.first_mismatch.is_none() {
            report.first_mismatch =
                Some(format!("read-back of region {region}: {bad} blocks differ"));
        }
        report.mismatches += bad;
    }
    let _ = c.logout().await;
    Ok(report)
}

/// Cut `victim`, connection `cid` of the session (its socket closed with whatever is in
/// flight), and log it out for recovery from `survivor` with its last ExpStatSN; `survivor`
/// goes on with the session's CmdSN. Returns the logout's answer.
async fn cut_and_recover(
    victim: Client,
    cid: u16,
    survivor: &mut Client,
) -> Result<LogoutResponseCode> {
    let last = victim.exp_stat_sn;
    survivor.cmd_sn = victim.cmd_sn;
    drop(victim);
    let (code, _, _) = survivor
        .logout_for(
            LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY,
            cid,
            Some(last),
        )
        .await?;
    Ok(code)
}

/// READ(16) of region `region` (`spec.blocks` blocks from `region * spec.blocks`).
async fn read_region(c: &mut Client, spec: &CutSpec, region: u64) -> Result<crate::CommandResult> {
    c.read16(
        spec.lun,
        region * u64::from(spec.blocks),
        spec.blocks,
        spec.block_size,
    )
    .await
}

fn mismatched_blocks(got: &[u8], want: &[u8], bs: u32) -> u64 {
    let bs = bs.max(1) as usize;
    got.chunks(bs)
        .zip(want.chunks(bs))
        .filter(|(g, w)| g != w)
        .count() as u64
        + (want.len().saturating_sub(got.len()) / bs) as u64
}

/// Act on a PDU of the stream: Data-In into its read, R2Ts answered (with `partial`, only
/// the first half of the data asked for), statuses noted.
async fn handle(
    c: &mut Client,
    lun: u64,
    tasks: &mut HashMap<Itt, Task>,
    p: Pdu,
    partial: bool,
) -> Result<()> {
    match p.header {
        Header::DataIn(d) => {
            let Some(t) = tasks.get_mut(&d.itt) else {
                return Ok(());
            };
            if let Kind::Read { buf, next_sn, .. } = &mut t.kind {
                // In order only: a gap (never on TCP) would leave the rest to the resume.
                if d.data_sn.0 >= *next_sn {
                    let at = d.buffer_offset as usize;
                    if let Some(dst) = buf.get_mut(at..at + p.data.len()) {
                        dst.copy_from_slice(&p.data);
                    }
                    *next_sn = d.data_sn.0 + 1;
                }
            }
            if let Some(s) = d.status {
                t.status = Some(s);
                c.note_sn(&d.sn, true);
            }
        }
        Header::ScsiResponse(r) => {
            c.note_sn(&r.sn, true);
            if let Some(t) = tasks.get_mut(&r.itt) {
                t.status = Some(r.status);
            }
        }
        Header::R2t(r) => {
            if let Some(Task {
                kind: Kind::Write { data, .. },
                ..
            }) = tasks.get(&r.itt)
            {
                let data = data.clone();
                let seq = crate::DataOutSeq {
                    lun: Lun::from_number(lun),
                    itt: r.itt,
                    ttt: r.ttt,
                    exp_stat_sn: c.exp_stat_sn,
                    mrdsl: c.target_mrdsl,
                };
                let end = r.buffer_offset + r.desired_data_transfer_length;
                let pdus: Vec<(DataOut, u32)> = seq.pdus(r.buffer_offset, end).collect();
                // Part of a sequence leaves the write waiting for the rest.
                let n = if partial { pdus.len() / 2 } else { pdus.len() };
                for (d, len) in pdus.into_iter().take(n) {
                    let at = d.buffer_offset as usize;
                    let Some(segment) = data.get(at..at + len as usize) else {
                        break;
                    };
                    let segment = Bytes::copy_from_slice(segment);
                    c.send(Header::DataOut(d), segment).await?;
                }
            }
        }
        Header::NopIn(n) if n.ttt != Ttt::RESERVED => {
            // A ping from the target: answered (RFC 7143 §11.18).
            let out = NopOut {
                immediate: true,
                itt: Itt::RESERVED,
                ttt: n.ttt,
                cmd_sn: c.cmd_sn,
                exp_stat_sn: c.exp_stat_sn,
                ..Default::default()
            };
            c.send(Header::NopOut(out), Bytes::new()).await?;
        }
        _ => {}
    }
    Ok(())
}

/// One WRITE(16) of `data` at `lba` (FUA when `fua`) issued on `a`, whose connection (CID
/// `a_cid`) is cut once the command's first R2T is half answered; the command is then moved
/// to `b`, another connection of the session (logout for recovery, TASK REASSIGN, or a retry
/// with its CmdSN when the target never received it), and finished there. `a` is consumed;
/// join a new connection in its place. Needs a session at ErrorRecoveryLevel 2 whose writes
/// wait for R2Ts (InitialR2T=Yes, ImmediateData=No). Returns the command's status.
#[allow(clippy::too_many_arguments)]
pub async fn write_across_a_cut(
    mut a: Client,
    a_cid: u16,
    b: &mut Client,
    lun: u64,
    lba: u64,
    data: Bytes,
    block_size: u32,
    fua: bool,
) -> Result<u8> {
    let blocks = data.len() as u32 / block_size.max(1);
    let mut cdb = write16_cdb(lba, blocks);
    cdb[1] |= if fua { 0x08 } else { 0 };
    let cmd = crate::simple_command(lun, true, data.len() as u32, cdb);
    let (itt, sn) = a.send_command(cmd.clone(), Bytes::new()).await?;
    let cmd = ScsiCommand {
        itt,
        cmd_sn: sn,
        ..cmd
    };
    let mut tasks = HashMap::new();
    tasks.insert(
        itt,
        Task {
            cmd,
            kind: Kind::Write {
                region: 0,
                data: data.clone(),
            },
            status: None,
        },
    );
    // The first R2T, half answered.
    loop {
        let p = tokio::time::timeout(PDU_WAIT, a.recv())
            .await
            .map_err(|_| Error::Protocol("no R2T".into()))??;
        let r2t = matches!(&p.header, Header::R2t(r) if r.itt == itt);
        handle(&mut a, lun, &mut tasks, p, true).await?;
        if r2t {
            break;
        }
        if let Some(s) = tasks.get(&itt).and_then(|t| t.status) {
            return Ok(s);
        }
    }
    let code = cut_and_recover(a, a_cid, b).await?;
    if code != LogoutResponseCode::CLOSED {
        return Err(Error::Protocol(format!(
            "logout for recovery answered {}",
            code.0
        )));
    }
    match b.task_reassign(itt, DataSn(0)).await? {
        TmfResponseCode::COMPLETE => {}
        TmfResponseCode::TASK_DOES_NOT_EXIST => {
            let cmd = ScsiCommand {
                exp_stat_sn: b.exp_stat_sn,
                ..tasks[&itt].cmd.clone()
            };
            b.send(Header::ScsiCommand(cmd), Bytes::new()).await?;
        }
        other => {
            return Err(Error::Protocol(format!(
                "TASK REASSIGN answered {}",
                other.0
            )))
        }
    }
    for p in std::mem::take(&mut b.unsolicited) {
        handle(b, lun, &mut tasks, p, false).await?;
    }
    loop {
        if let Some(s) = tasks.get(&itt).and_then(|t| t.status) {
            return Ok(s);
        }
        let p = tokio::time::timeout(PDU_WAIT, b.recv())
            .await
            .map_err(|_| Error::Protocol("no status after the reassignment".into()))??;
        handle(b, lun, &mut tasks, p, false).await?;
    }
}
