//! Crash-consistency harness shared by `tests/system/crash.rs` (SIGKILL of `ironsan serve`) and
//! `tests/system/powerfail.rs` (SIGKILL plus a power cut of the FUSE file system under the backing file).
//!
//! Several writer sessions (one iSCSI session each, each owning a disjoint region) write
//! 4 KiB records through `ironsan-initiator` and record every write: issued (in flight), acked,
//! and whether the ack makes it durable (WCE=0: every ack; WCE=1: FUA acks, and every ack that
//! came before a SYNCHRONIZE CACHE that completed GOOD). At a random moment the target crashes;
//! after the restart every record is read back and checked:
//!
//! * **never torn**: a record is all zeros or a whole record (magic, its own block number, a
//!   sequence number, checksum over the rest) — the atomicity unit tested is the 4 KiB-aligned
//!   4 KiB record (eight 512-byte LBAs, one page);
//! * **nothing foreign**: the sequence number is the one the block had after the last restart
//!   or one of the writes issued to it since (acked or in flight);
//! * **nothing lost**: it is not older than the newest write that had to be durable;
//! * **never-written blocks read zeros** (blocks between and after the regions too).
//!
//! A multi-record write that was in flight may be applied in part (per record): counted in
//! `partial`, not a failure (SCSI does not make a plain WRITE all-or-nothing on a crash).

use ironsan_initiator::{Client, LoginOptions};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bytes per record (a page: the atomicity unit under test).
pub(crate) const REC: usize = 4096;
/// LBAs (512 bytes) per record.
pub(crate) const LBAS: u64 = (REC / 512) as u64;
const MAGIC: &[u8; 8] = b"IRNCRASH";

/// Something that can be crashed and restarted.
pub(crate) trait Crashable: Send {
    fn addr(&self) -> SocketAddr;
    fn target(&self) -> String;
    /// Crash now (SIGKILL; and/or cut power). Must close every connection.
    fn crash(&mut self);
    /// Bring the target back on the same backing store.
    fn restart(&mut self);
}

/// What to run.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub name: String,
    pub wce: bool,
    pub cycles: usize,
    pub writers: u64,
    /// Records per writer region.
    pub region: u64,
    /// Largest write, in records.
    pub max_records: u64,
    /// With WCE=1: one write in `fua_every` has FUA; a SYNCHRONIZE CACHE every `sync_every`.
    pub fua_every: u64,
    pub sync_every: u64,
    /// Time the writers run before the crash: uniformly in this range (ms).
    pub run_ms: (u64, u64),
    pub seed: u64,
    /// Each writer's session has two connections at ErrorRecoveryLevel 2, and one write in
    /// three is cut half-way through its data and moved to the other connection
    /// (`ironsan_initiator::cuts::write_across_a_cut`), which then gets a new partner.
    pub recovery: bool,
}

impl Plan {
    pub(crate) fn new(name: &str, wce: bool) -> Plan {
        let long = std::env::var("IRONSAN_LONG").is_ok_and(|v| v == "1");
        let seed = std::env::var("IRONSAN_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        Plan {
            name: name.into(),
            wce,
            cycles: if long { 100 } else { 5 },
            writers: 4,
            region: 256,
            max_records: 8,
            fua_every: 4,
            sync_every: 6,
            run_ms: (100, 600),
            seed,
            recovery: false,
        }
    }
}

/// What a run found.
#[derive(Clone, Debug, Default)]
pub(crate) struct Report {
    pub cycles: usize,
    /// Write commands acknowledged GOOD.
    pub acked: u64,
    /// Of those, writes cut half-way and finished on another connection (`Plan::recovery`).
    pub recovered: u64,
    /// Of those, the ones whose ack promised durability (WCE=0, FUA, or before a SYNC CACHE).
    pub durable_acked: u64,
    /// Records whose durable content was checked after a crash.
    pub records_checked: u64,
    /// Records older than the newest write that had to be durable (must be 0).
    pub lost: u64,
    /// Records that are neither zeros nor a whole record of their own block (must be 0).
    pub torn: u64,
    /// Whole records with a sequence number never written there (must be 0).
    pub foreign: u64,
    /// Blocks never written that did not read zeros (must be 0).
    pub nonzero_unwritten: u64,
    /// In-flight multi-record writes found partly applied (allowed).
    pub partial: u64,
    /// In-flight writes found applied after the crash (allowed).
    pub inflight_landed: u64,
    /// First few problems, for the failure message.
    pub problems: Vec<String>,
}

impl Report {
    pub(crate) fn ok(&self) -> bool {
        self.lost == 0 && self.torn == 0 && self.foreign == 0 && self.nonzero_unwritten == 0
    }
    pub(crate) fn summary(&self, name: &str) -> String {
        format!(
            "{name}: {} cycles, {} writes acked ({} durable on ack), {} records checked, \
             lost {}, torn {}, foreign {}, non-zero unwritten {}, partial in-flight {}, \
             not-yet-durable writes found {}, acked across a connection cut {}",
            self.cycles,
            self.acked,
            self.durable_acked,
            self.records_checked,
            self.lost,
            self.torn,
            self.foreign,
            self.nonzero_unwritten,
            self.partial,
            self.inflight_landed,
            self.recovered
        )
    }
    fn problem(&mut self, p: String) {
        if self.problems.len() < 20 {
            self.problems.push(p);
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Block {
    /// Sequence number found after the last restart (0: zeros).
    baseline: u64,
    /// Writes issued since: (seq, durable).
    issued: Vec<(u64, bool)>,
}

#[derive(Default)]
struct Model {
    blocks: Vec<Block>,
    /// Multi-record writes issued this cycle and never acked: seq → records.
    inflight_multi: std::collections::HashMap<u64, u64>,
    acked: u64,
    durable_acked: u64,
    /// Of `acked`, writes cut half-way and finished on another connection.
    recovered: u64,
}

fn fnv(data: &[u8], mut h: u64) -> u64 {
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One record of `block` written by write `seq`.
pub(crate) fn record(block: u64, seq: u64, nrec: u64) -> Vec<u8> {
    let mut r = vec![0u8; REC];
    r[..8].copy_from_slice(MAGIC);
    r[8..16].copy_from_slice(&block.to_le_bytes());
    r[16..24].copy_from_slice(&seq.to_le_bytes());
    r[24..32].copy_from_slice(&nrec.to_le_bytes());
    let mut x =
        (block.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seq.wrapping_mul(0xD1B5_4A32_D192_ED03)) | 1;
    for chunk in r[40..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let h = fnv(&r[40..], fnv(&r[..32], 0xcbf2_9ce4_8422_2325));
    r[32..40].copy_from_slice(&h.to_le_bytes());
    r
}

/// What a record read back is: `Ok(0)` zeros, `Ok(seq)` a whole record of `block`, or why not.
pub(crate) fn decode(block: u64, r: &[u8]) -> Result<u64, String> {
    if r.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    if &r[..8] != MAGIC {
        return Err("no magic (torn or garbage)".into());
    }
    let h = fnv(&r[40..], fnv(&r[..32], 0xcbf2_9ce4_8422_2325));
    if r[32..40] != h.to_le_bytes() {
        return Err("checksum mismatch (torn)".into());
    }
    let b = u64::from_le_bytes(r[8..16].try_into().unwrap());
    if b != block {
        return Err(format!("record of block {b} (misdirected)"));
    }
    Ok(u64::from_le_bytes(r[16..24].try_into().unwrap()))
}

fn opts(target: &str, writer: u64) -> LoginOptions {
    let mut o = LoginOptions::new(Some(target));
    o.isid.0[4] = 0xC0;
    o.isid.0[5] = writer as u8;
    o
}

/// First block of writer `w`'s region; regions are separated by a never-written gap of 16.
fn region_start(plan: &Plan, w: u64) -> u64 {
    w * (plan.region + 16)
}

async fn writer(
    plan: Plan,
    w: u64,
    addr: SocketAddr,
    target: String,
    model: Arc<Mutex<Model>>,
    seq: Arc<AtomicU64>,
    seed: u64,
) -> Result<(), String> {
    let mut o = opts(&target, w);
    if plan.recovery {
        o.error_recovery_level = 2;
        o.time2retain = 20;
        o.max_connections = 2;
        o.initial_r2t = true;
        o.immediate_data = false;
    }
    let mut c = match Client::login(addr, &o).await {
        Ok(c) => c,
        Err(_) => return Ok(()), // crashed before we got in
    };
    // The connection a cut write starts on (CID 1), with recovery.
    let mut partner = None;
    let mut rng = Rng(seed | 1);
    let base = region_start(&plan, w);
    // Acked, not yet durable writes of this writer: (block, seq).
    let mut pending: Vec<(u64, u64)> = Vec::new();
    loop {
        let n = 1 + rng.below(plan.max_records);
        let first = base + rng.below(plan.region - n + 1);
        let s = seq.fetch_add(1, Ordering::SeqCst);
        let fua = plan.wce && rng.below(plan.fua_every) == 0;
        let mut data = Vec::with_capacity(n as usize * REC);
        {
            let mut m = model.lock().unwrap();
            for b in first..first + n {
                data.extend_from_slice(&record(b, s, n));
                m.blocks[b as usize].issued.push((s, false));
            }
            if n > 1 {
                m.inflight_multi.insert(s, n);
            }
        }
        if plan.recovery && partner.is_none() {
            partner = match Client::join(addr, &o, &c, 1).await {
                Ok(p) => Some(p),
                Err(_) => return Ok(()),
            };
        }
        let cut = partner.is_some() && rng.below(3) == 0;
        let result = match partner.take().filter(|_| cut) {
            Some(p) => ironsan_initiator::cuts::write_across_a_cut(
                p,
                1,
                &mut c,
                0,
                first * LBAS,
                data.into(),
                512,
                fua,
            )
            .await
            .map(|status| ironsan_initiator::CommandResult {
                status,
                data: Default::default(),
                sense: Default::default(),
                residual: Default::default(),
            }),
            p => {
                partner = p;
                c.write16(0, first * LBAS, data.into(), 512, fua).await
            }
        };
        match result {
            Ok(r) if r.status == 0 => {
                let durable = !plan.wce || fua;
                let mut m = model.lock().unwrap();
                m.acked += 1;
                m.recovered += u64::from(cut);
                m.inflight_multi.remove(&s);
                if durable {
                    m.durable_acked += 1;
                }
                for b in first..first + n {
                    if durable {
                        if let Some(e) = m.blocks[b as usize].issued.iter_mut().find(|e| e.0 == s) {
                            e.1 = true;
                        }
                    } else {
                        pending.push((b, s));
                    }
                }
            }
            Ok(r) => {
                return Err(format!(
                    "writer {w}: WRITE got status {:#x} sense {:?}",
                    r.status,
                    r.sense_key()
                ))
            }
            Err(_) => return Ok(()), // the crash
        }
        if plan.wce && rng.below(plan.sync_every) == 0 {
            let snapshot = std::mem::take(&mut pending);
            let sync = [0x35u8, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            match c.command(0, &sync, None, 0).await {
                Ok(r) if r.status == 0 => {
                    let mut m = model.lock().unwrap();
                    let acked_writes: std::collections::HashSet<u64> =
                        snapshot.iter().map(|p| p.1).collect();
                    m.durable_acked += acked_writes.len() as u64;
                    for (b, s) in snapshot {
                        if let Some(e) = m.blocks[b as usize].issued.iter_mut().find(|e| e.0 == s) {
                            e.1 = true;
                        }
                    }
                }
                Ok(r) => return Err(format!("writer {w}: SYNC CACHE status {:#x}", r.status)),
                Err(_) => return Ok(()),
            }
        }
    }
}

/// Read back everything and check it against the model; reset the model to what was found.
async fn verify(plan: &Plan, t: &dyn Crashable, model: &Mutex<Model>, rep: &mut Report) {
    let mut c = Client::login(t.addr(), &opts(&t.target(), 200))
        .await
        .expect("login after restart");
    let total = region_start(plan, plan.writers) + 64;
    let chunk = 64u64;
    let mut all = Vec::with_capacity(total as usize * REC);
    let mut b0 = 0;
    while b0 < total {
        let n = chunk.min(total - b0);
        // A read the target never answers is a defect of its own (a lost backend
        // completion): fail on it, naming the plan, rather than hang the whole test run.
        let r = tokio::time::timeout(
            Duration::from_secs(60),
            c.read16(0, b0 * LBAS, (n * LBAS) as u32, 512),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{}: read of blocks {b0}..{} after restart not answered in 60 s",
                plan.name,
                b0 + n
            )
        })
        .expect("read after restart");
        assert_eq!(r.status, 0, "read after restart: {:?}", r.sense_key());
        assert_eq!(r.data.len(), n as usize * REC, "short read after restart");
        all.extend_from_slice(&r.data);
        b0 += n;
    }
    let mut m = model.lock().unwrap();
    let mut seen_multi: std::collections::HashMap<u64, u64> = Default::default();
    {
        for b in 0..total {
            let bytes = &all[(b as usize) * REC..(b as usize + 1) * REC];
            let in_region = (b as usize) < m.blocks.len()
                && (b % (plan.region + 16)) < plan.region
                && b < region_start(plan, plan.writers);
            if !in_region {
                if bytes.iter().any(|&x| x != 0) {
                    rep.nonzero_unwritten += 1;
                    rep.problem(format!("block {b} outside every region is not zeros"));
                }
                continue;
            }
            let blk = &mut m.blocks[b as usize];
            let obs = match decode(b, bytes) {
                Ok(s) => s,
                Err(why) => {
                    rep.torn += 1;
                    rep.problem(format!("block {b}: {why}"));
                    blk.baseline = u64::MAX; // unknown; excluded from later checks
                    blk.issued.clear();
                    continue;
                }
            };
            if blk.baseline == u64::MAX {
                blk.baseline = obs;
                blk.issued.clear();
                continue;
            }
            let required = blk
                .issued
                .iter()
                .filter(|e| e.1)
                .map(|e| e.0)
                .max()
                .unwrap_or(0)
                .max(blk.baseline);
            let known = obs == blk.baseline || blk.issued.iter().any(|e| e.0 == obs);
            if required > 0 || !blk.issued.is_empty() {
                rep.records_checked += 1;
            }
            if !known {
                rep.foreign += 1;
                rep.problem(format!(
                    "block {b}: seq {obs} was never written there (baseline {}, issued {:?})",
                    blk.baseline, blk.issued
                ));
            } else if obs < required {
                rep.lost += 1;
                rep.problem(format!(
                    "block {b}: holds seq {obs}, but seq {required} was acknowledged durable \
                     (WCE={})",
                    u8::from(plan.wce)
                ));
            }
            if obs != 0 {
                if let Some(&(s, false)) = blk.issued.iter().find(|e| e.0 == obs) {
                    let _ = s;
                    rep.inflight_landed += 1;
                }
                *seen_multi.entry(obs).or_default() += 1;
            }
            blk.baseline = obs;
            blk.issued.clear();
        }
    }
    for (s, n) in std::mem::take(&mut m.inflight_multi) {
        let seen = seen_multi.get(&s).copied().unwrap_or(0);
        if seen > 0 && seen < n {
            rep.partial += 1;
        }
    }
    rep.acked = m.acked;
    rep.durable_acked = m.durable_acked;
    rep.recovered = m.recovered;
}

/// Run `plan.cycles` write-crash-restart-verify cycles against `t`.
pub(crate) async fn run(plan: &Plan, t: &mut dyn Crashable) -> Report {
    eprintln!(
        "{}: seed {} (IRONSAN_SEED={} reproduces the schedule), {} cycles, WCE={}",
        plan.name,
        plan.seed,
        plan.seed,
        plan.cycles,
        u8::from(plan.wce)
    );
    let total = region_start(plan, plan.writers) as usize;
    let model = Arc::new(Mutex::new(Model {
        blocks: vec![Block::default(); total],
        ..Default::default()
    }));
    let seq = Arc::new(AtomicU64::new(1));
    let mut rng = Rng(plan.seed | 1);
    let mut rep = Report::default();
    for cycle in 0..plan.cycles {
        let mut hs = Vec::new();
        for w in 0..plan.writers {
            hs.push(tokio::spawn(writer(
                plan.clone(),
                w,
                t.addr(),
                t.target(),
                Arc::clone(&model),
                Arc::clone(&seq),
                rng.next(),
            )));
        }
        let ms = plan.run_ms.0 + rng.below(plan.run_ms.1 - plan.run_ms.0);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        t.crash();
        for h in hs {
            match tokio::time::timeout(Duration::from_secs(20), h).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => panic!("{}: cycle {cycle}: {e}", plan.name),
                Ok(Err(e)) => panic!("{}: writer panicked: {e}", plan.name),
                Err(_) => panic!("{}: a writer hung after the crash", plan.name),
            }
        }
        t.restart();
        verify(plan, t, &model, &mut rep).await;
        rep.cycles = cycle + 1;
    }
    eprintln!("{}", rep.summary(&plan.name));
    rep
}
