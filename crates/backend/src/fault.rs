//! A fault-injecting wrapper around any [`BlockDevice`], for tests and for rehearsing failure
//! handling on a live target (`--lun ram:64M,fault=read@1000-1010:eio`).
//!
//! Each [`FaultRule`] says which operations it applies to, where (an LBA range, or anywhere),
//! how often (always, or with a probability drawn from a seeded, deterministic PRNG), how many
//! times at most, and what happens:
//!
//! | effect    | result                                                                    |
//! |-----------|---------------------------------------------------------------------------|
//! | `eio`     | [`BackendError::ReadError`] / [`BackendError::WriteError`] at the first failing byte (MEDIUM ERROR 11h/00h or 0Ch/00h with that LBA in INFORMATION); flush and unmap get [`BackendError::Io`] |
//! | `enospc`  | [`BackendError::NoSpace`] (DATA PROTECT, SPACE ALLOCATION FAILED 27h/07h)   |
//! | `error`   | [`BackendError::Io`] (HARDWARE ERROR, INTERNAL TARGET FAILURE 44h/00h)      |
//! | `delay=D` | the operation is held `D` (e.g. `50ms`, `2s`) on a worker thread, then done |
//! | `stuck`   | the operation waits until [`FaultControl::release`]; from the command line that is for ever (a hung device) |
//! | `hang`    | the operation is handed to the device at once (on a worker thread) and held there until [`FaultControl::release`]; dropping its future does **not** cancel it: it lands after release, like a `pwritev2` already running on an I/O thread |
//!
//! A failed operation never reaches the wrapped device: a failed write writes nothing, so the
//! promise "a failed write never leaves bytes the initiator did not send" holds trivially.
//! A stuck or delayed operation whose future is dropped (ABORT TASK, LUN RESET) never reaches
//! it either; a `hang` one does, on release, and keeps the caller's [`Keep`](crate::Keep)
//! value (the SCSI layer's write range lock) until it has.
//!
//! # Grammar (one rule; give `fault=` once per rule on a `--lun`)
//! ```text
//! RULE    := OPS '@' WHERE [':' EFFECT]          (EFFECT defaults to eio)
//! OPS     := OP ('|' OP)*      OP := read | write | flush | unmap | rw | any
//! WHERE   := ITEM ('/' ITEM)*
//! ITEM    := '*'               anywhere (the default when only rate/count are given)
//!          | LBA | LBA '-' LBA an inclusive range of logical blocks; a request fails when it
//!                              overlaps the range (flush has no range and matches only '*')
//!          | 'rate=' P         probability 0 < P <= 1 per matching operation
//!          | 'count=' N        at most N injections, then the rule is spent
//! EFFECT  := eio | enospc | error | stuck | hang | 'delay=' N ('us'|'ms'|'s')
//! ```
//! Examples: `read@1000-1010:eio`, `write@rate=0.01`, `any@rate=0.1:delay=50ms`,
//! `write@0-99/count=1:enospc`, `rw@*:stuck`. `fault-seed=N` seeds the PRNG (default 1).

use crate::pool::IoPool;
use crate::{BackendError, BlockDevice, Capabilities, IoFuture, Keep, WriteMode};
use bytes::Bytes;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Operations a rule applies to (a bit set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ops(u8);

impl Ops {
    pub const READ: Ops = Ops(1);
    pub const WRITE: Ops = Ops(2);
    pub const FLUSH: Ops = Ops(4);
    pub const UNMAP: Ops = Ops(8);
    pub const RW: Ops = Ops(3);
    pub const ANY: Ops = Ops(15);

    fn contains(self, op: Ops) -> bool {
        self.0 & op.0 != 0
    }
}

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// EIO: read or write error at the first failing byte.
    Eio,
    /// ENOSPC: no space on a thin backing store.
    NoSpace,
    /// Any other error (internal target failure).
    Error,
    /// Hold the operation this long (on a worker thread), then do it.
    Delay(Duration),
    /// Hold the operation until [`FaultControl::release`] (cancelled when its future is
    /// dropped).
    Stuck,
    /// Submit the operation to the device now, on a worker thread, where it waits for
    /// [`FaultControl::release`] and then runs, whether or not its future still exists (an
    /// I/O that cannot be called back).
    Hang,
}

/// One fault rule; see the module documentation for the grammar.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultRule {
    pub ops: Ops,
    /// Inclusive LBA range; `None` matches everywhere (and flush).
    pub lbas: Option<(u64, u64)>,
    /// Probability per matching operation (1.0: always).
    pub rate: f64,
    /// At most this many injections.
    pub count: Option<u64>,
    pub effect: Effect,
}

impl FaultRule {
    /// A rule that always applies `effect` to `ops` on the inclusive LBA range `first..=last`.
    pub fn range(ops: Ops, first: u64, last: u64, effect: Effect) -> Self {
        FaultRule {
            ops,
            lbas: Some((first, last)),
            rate: 1.0,
            count: None,
            effect,
        }
    }

    /// A rule that applies `effect` to `ops` anywhere with probability `rate`.
    pub fn rate(ops: Ops, rate: f64, effect: Effect) -> Self {
        FaultRule {
            ops,
            lbas: None,
            rate,
            count: None,
            effect,
        }
    }

    /// Parse one rule (`read@1000-1010:eio`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let err = |why: &str| format!("fault rule '{s}': {why}");
        let (ops_s, rest) = s
            .split_once('@')
            .ok_or_else(|| err("expected OPS@WHERE[:EFFECT]"))?;
        let mut ops = 0u8;
        for op in ops_s.split('|') {
            ops |= match op {
                "read" => Ops::READ.0,
                "write" => Ops::WRITE.0,
                "flush" => Ops::FLUSH.0,
                "unmap" => Ops::UNMAP.0,
                "rw" => Ops::RW.0,
                "any" => Ops::ANY.0,
                _ => return Err(err(&format!("unknown operation '{op}'"))),
            };
        }
        let (where_s, effect_s) = match rest.split_once(':') {
            Some((w, e)) => (w, Some(e)),
            None => (rest, None),
        };
        let mut rule = FaultRule {
            ops: Ops(ops),
            lbas: None,
            rate: 1.0,
            count: None,
            effect: Effect::Eio,
        };
        for item in where_s.split('/') {
            if item == "*" {
                continue;
            } else if let Some(p) = item.strip_prefix("rate=") {
                let p: f64 = p.parse().map_err(|_| err("rate is not a number"))?;
                if !(p > 0.0 && p <= 1.0) {
                    return Err(err("rate must be in (0, 1]"));
                }
                rule.rate = p;
            } else if let Some(n) = item.strip_prefix("count=") {
                rule.count = Some(n.parse().map_err(|_| err("count is not a number"))?);
            } else {
                let (a, b) = item.split_once('-').unwrap_or((item, item));
                let a: u64 = a.parse().map_err(|_| err("bad LBA range"))?;
                let b: u64 = b.parse().map_err(|_| err("bad LBA range"))?;
                if b < a {
                    return Err(err("LBA range ends before it starts"));
                }
                rule.lbas = Some((a, b));
            }
        }
        if let Some(e) = effect_s {
            rule.effect =
                match e {
                    "eio" => Effect::Eio,
                    "enospc" => Effect::NoSpace,
                    "error" => Effect::Error,
                    "stuck" => Effect::Stuck,
                    "hang" => Effect::Hang,
                    _ => match e.strip_prefix("delay=") {
                        Some(d) => Effect::Delay(crate::parse_duration(d).ok_or_else(|| {
                            err("delay wants a duration such as 500us, 50ms or 2s")
                        })?),
                        None => return Err(err(&format!("unknown effect '{e}'"))),
                    },
                };
        }
        Ok(rule)
    }
}

/// Run-time handle on a [`FaultBackend`]: release stuck I/O, switch faults off and on, read
/// counters. Cheap to clone.
#[derive(Debug)]
pub struct FaultControl {
    enabled: std::sync::atomic::AtomicBool,
    gate: tokio::sync::watch::Sender<u64>,
    stuck_now: AtomicUsize,
    injected: AtomicU64,
}

impl FaultControl {
    /// Let every operation stuck now go on (later ones matching a `stuck` rule stick again).
    pub fn release(&self) {
        self.gate.send_modify(|g| *g += 1);
    }
    /// Switch all rules off (`false`) or on; switching off also releases stuck I/O.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::SeqCst);
        if !on {
            self.release();
        }
    }
    /// Operations waiting in a `stuck` or `hang` rule right now (a dropped, e.g. aborted,
    /// `stuck` one leaves; a `hang` one stays until released).
    pub fn stuck_now(&self) -> usize {
        self.stuck_now.load(Ordering::SeqCst)
    }
    /// Faults injected so far (errors, delays and stalls).
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }
    /// Wait (polling, up to `timeout`) until at least `n` operations are stuck.
    pub fn wait_stuck(&self, n: usize, timeout: Duration) -> bool {
        let t0 = std::time::Instant::now();
        while self.stuck_now() < n {
            if t0.elapsed() > timeout {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }
}

/// Counts an operation as stuck while it lives.
struct StuckGuard<'a>(&'a FaultControl);
impl Drop for StuckGuard<'_> {
    fn drop(&mut self) {
        self.0.stuck_now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Drive `f` to completion on the current (worker) thread, parking between polls. The
/// wrapped device's futures need no runtime (RAM completes inline, files wait on a oneshot).
pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// Fault-injecting wrapper. See the module documentation.
pub struct FaultBackend {
    inner: Arc<dyn BlockDevice>,
    rules: Vec<(FaultRule, AtomicU64)>,
    block_size: u64,
    rng: AtomicU64,
    ctl: Arc<FaultControl>,
    pool: OnceLock<IoPool>,
}

impl std::fmt::Debug for FaultBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultBackend")
            .field("inner", &self.inner.kind())
            .field("rules", &self.rules.len())
            .finish()
    }
}

/// SplitMix64: a tiny deterministic PRNG step.
fn splitmix(state: &AtomicU64) -> u64 {
    let mut z = state
        .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What to do with one operation.
enum Verdict {
    Pass,
    Fail(BackendError),
    Delay(Duration),
    Stuck,
    Hang,
}

impl FaultBackend {
    /// Wrap `inner`. LBAs in `rules` are in units of `block_size` bytes; `seed` makes the
    /// rate-based rules reproducible.
    pub fn new(
        inner: Arc<dyn BlockDevice>,
        rules: Vec<FaultRule>,
        block_size: u32,
        seed: u64,
    ) -> Self {
        let (gate, _) = tokio::sync::watch::channel(0u64);
        FaultBackend {
            inner,
            rules: rules.into_iter().map(|r| (r, AtomicU64::new(0))).collect(),
            block_size: u64::from(block_size.max(1)),
            rng: AtomicU64::new(seed),
            ctl: Arc::new(FaultControl {
                enabled: std::sync::atomic::AtomicBool::new(true),
                gate,
                stuck_now: AtomicUsize::new(0),
                injected: AtomicU64::new(0),
            }),
            pool: OnceLock::new(),
        }
    }

    /// The run-time control handle.
    pub fn control(&self) -> Arc<FaultControl> {
        Arc::clone(&self.ctl)
    }

    /// The wrapped device.
    pub fn inner(&self) -> &Arc<dyn BlockDevice> {
        &self.inner
    }

    /// Decide the fate of `op` on `[offset, offset+len)` (`None`: flush, no range).
    fn verdict(&self, op: Ops, range: Option<(u64, u64)>) -> Verdict {
        if !self.ctl.enabled.load(Ordering::SeqCst) {
            return Verdict::Pass;
        }
        for (rule, used) in &self.rules {
            if !rule.ops.contains(op) {
                continue;
            }
            // First failing byte: the start of the overlap of request and rule.
            let at = match (rule.lbas, range) {
                (None, Some((off, _))) => off,
                (None, None) => 0,
                (Some(_), None) => continue,
                (Some((a, b)), Some((off, len))) => {
                    let lo = a.saturating_mul(self.block_size);
                    let hi = b.saturating_add(1).saturating_mul(self.block_size);
                    let end = off.saturating_add(len);
                    if len == 0 || end <= lo || off >= hi {
                        continue;
                    }
                    off.max(lo)
                }
            };
            if rule.rate < 1.0 {
                let draw = (splitmix(&self.rng) >> 11) as f64 / (1u64 << 53) as f64;
                if draw >= rule.rate {
                    continue;
                }
            }
            if let Some(max) = rule.count {
                if used.fetch_add(1, Ordering::SeqCst) >= max {
                    continue;
                }
            }
            self.ctl.injected.fetch_add(1, Ordering::SeqCst);
            return match rule.effect {
                Effect::Eio if op == Ops::READ => {
                    Verdict::Fail(BackendError::ReadError { offset: at })
                }
                Effect::Eio if op == Ops::WRITE => {
                    Verdict::Fail(BackendError::WriteError { offset: at })
                }
                Effect::Eio => Verdict::Fail(BackendError::Io("injected EIO".into())),
                Effect::NoSpace => Verdict::Fail(BackendError::NoSpace),
                Effect::Error => Verdict::Fail(BackendError::Io("injected error".into())),
                Effect::Delay(d) => Verdict::Delay(d),
                Effect::Stuck => Verdict::Stuck,
                Effect::Hang => Verdict::Hang,
            };
        }
        Verdict::Pass
    }

    fn pool(&self) -> Result<&IoPool, BackendError> {
        Ok(match self.pool.get() {
            Some(p) => p,
            None => {
                let p = IoPool::new("fault", 8).map_err(|e| BackendError::Io(e.to_string()))?;
                self.pool.get_or_init(|| p)
            }
        })
    }

    /// Run `op` on the wrapped device under the verdict for `op_kind`: fail, wait (cancellably)
    /// then run it, or hand it to a worker thread where it waits for a release and then runs
    /// even if this future is dropped (`hang`).
    async fn run<T: Send + 'static>(
        &self,
        op_kind: Ops,
        range: Option<(u64, u64)>,
        op: impl FnOnce(&dyn BlockDevice) -> IoFuture<'_, T> + Send + 'static,
    ) -> Result<T, BackendError> {
        let verdict = self.verdict(op_kind, range);
        if let Verdict::Hang = verdict {
            // The gate generation is read now, so a job that starts on a busy pool after a
            // release still sees that release.
            let mut rx = self.ctl.gate.subscribe();
            let start = *rx.borrow_and_update();
            self.ctl.stuck_now.fetch_add(1, Ordering::SeqCst);
            let ctl = Arc::clone(&self.ctl);
            let inner = Arc::clone(&self.inner);
            let pool = match self.pool() {
                Ok(p) => p,
                Err(e) => {
                    drop(StuckGuard(&self.ctl));
                    return Err(e);
                }
            };
            return pool
                .run(move || {
                    block_on(async move {
                        {
                            let _g = StuckGuard(&ctl);
                            let _ = rx.wait_for(|g| *g != start).await;
                        }
                        op(&*inner).await
                    })
                })
                .await;
        }
        self.gate(verdict).await?;
        op(&*self.inner).await
    }

    /// Apply a verdict other than `Hang`: `Err` to fail, `Ok` to go on to the wrapped device.
    async fn gate(&self, verdict: Verdict) -> Result<(), BackendError> {
        match verdict {
            Verdict::Pass | Verdict::Hang => Ok(()),
            Verdict::Fail(e) => Err(e),
            Verdict::Delay(d) => {
                // Sleep on a worker thread, as a slow device would hold an I/O thread.
                self.pool()?
                    .run(move || {
                        std::thread::sleep(d);
                        Ok(())
                    })
                    .await
            }
            Verdict::Stuck => {
                let mut rx = self.ctl.gate.subscribe();
                let start = *rx.borrow_and_update();
                self.ctl.stuck_now.fetch_add(1, Ordering::SeqCst);
                let _g = StuckGuard(&self.ctl);
                let _ = rx.wait_for(|g| *g != start).await;
                Ok(())
            }
        }
    }
}

impl BlockDevice for FaultBackend {
    fn kind(&self) -> &'static str {
        "fault"
    }
    fn io_engine(&self) -> Option<&'static str> {
        self.inner.io_engine()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn in_flight(&self) -> Option<u64> {
        self.inner.in_flight()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        Box::pin(self.run(Ops::READ, Some((offset, len as u64)), move |d| {
            d.read(offset, len)
        }))
    }
    fn write(&self, offset: u64, data: Bytes, mode: WriteMode) -> IoFuture<'_, ()> {
        self.write_keeping(offset, data, mode, Box::new(()))
    }
    /// `keep` is passed on to the wrapped device; a failed or dropped `stuck`/`delay`
    /// operation drops it at once (it will never reach the device), a `hang` one keeps it on
    /// its worker thread until the device is done.
    fn write_keeping(
        &self,
        offset: u64,
        data: Bytes,
        mode: WriteMode,
        keep: Keep,
    ) -> IoFuture<'_, ()> {
        let range = Some((offset, data.len() as u64));
        Box::pin(self.run(Ops::WRITE, range, move |d| {
            d.write_keeping(offset, data, mode, keep)
        }))
    }
    fn flush(&self) -> IoFuture<'_, ()> {
        Box::pin(self.run(Ops::FLUSH, None, |d| d.flush()))
    }
    fn unmap(&self, offset: u64, len: u64) -> IoFuture<'_, ()> {
        self.unmap_keeping(offset, len, Box::new(()))
    }
    fn unmap_keeping(&self, offset: u64, len: u64, keep: Keep) -> IoFuture<'_, ()> {
        Box::pin(self.run(Ops::UNMAP, Some((offset, len)), move |d| {
            d.unmap_keeping(offset, len, keep)
        }))
    }
    fn write_zeroes_keeping(
        &self,
        offset: u64,
        len: u64,
        mode: WriteMode,
        keep: Keep,
    ) -> IoFuture<'_, ()> {
        Box::pin(self.run(Ops::WRITE, Some((offset, len)), move |d| {
            d.write_zeroes_keeping(offset, len, mode, keep)
        }))
    }
    fn can_compare_and_write(&self, offset: u64, len: usize) -> bool {
        self.inner.can_compare_and_write(offset, len)
    }
    fn compare_and_write_keeping(
        &self,
        offset: u64,
        verify: Bytes,
        data: Bytes,
        mode: WriteMode,
        keep: Keep,
    ) -> IoFuture<'_, Option<u64>> {
        let range = Some((offset, data.len() as u64));
        Box::pin(self.run(Ops::WRITE, range, move |d| {
            d.compare_and_write_keeping(offset, verify, data, mode, keep)
        }))
    }
    fn size_watch(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.inner.size_watch()
    }
    fn resize(&self, new_size: u64) -> Result<(), BackendError> {
        self.inner.resize(new_size)
    }
    fn map_status(&self, offset: u64, len: u64) -> IoFuture<'_, Vec<(u64, u64, bool)>> {
        self.inner.map_status(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RamBackend;

    fn ram() -> Arc<dyn BlockDevice> {
        Arc::new(RamBackend::new(1 << 20))
    }

    #[test]
    fn parses_the_documented_examples() {
        let r = FaultRule::parse("read@1000-1010:eio").unwrap();
        assert_eq!(r, FaultRule::range(Ops::READ, 1000, 1010, Effect::Eio));
        let r = FaultRule::parse("write@rate=0.01").unwrap();
        assert_eq!(r, FaultRule::rate(Ops::WRITE, 0.01, Effect::Eio));
        let r = FaultRule::parse("any@rate=0.1:delay=50ms").unwrap();
        assert_eq!(
            r,
            FaultRule::rate(Ops::ANY, 0.1, Effect::Delay(Duration::from_millis(50)))
        );
        let r = FaultRule::parse("write@0-99/count=1:enospc").unwrap();
        assert_eq!(r.count, Some(1));
        assert_eq!(r.effect, Effect::NoSpace);
        assert_eq!(r.lbas, Some((0, 99)));
        let r = FaultRule::parse("rw@*:stuck").unwrap();
        assert_eq!(r, FaultRule::rate(Ops::RW, 1.0, Effect::Stuck));
        let r = FaultRule::parse("read|flush@7:error").unwrap();
        assert_eq!(r.ops, Ops(Ops::READ.0 | Ops::FLUSH.0));
        assert_eq!(r.lbas, Some((7, 7)));
        for bad in [
            "read",
            "bogus@*",
            "read@5-1",
            "read@x",
            "read@rate=0",
            "read@rate=2",
            "read@*:boom",
            "read@*:delay=5",
            "read@count=x",
        ] {
            assert!(FaultRule::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[tokio::test]
    async fn range_faults_fail_at_the_first_overlapping_byte_and_write_nothing() {
        let be = FaultBackend::new(
            ram(),
            vec![
                FaultRule::parse("read@10-11").unwrap(),
                FaultRule::parse("write@20-20").unwrap(),
                FaultRule::parse("unmap@30-30:enospc").unwrap(),
            ],
            512,
            1,
        );
        // Outside the ranges: passes.
        be.write(0, Bytes::from(vec![1u8; 4096]), WriteMode::Durable)
            .await
            .unwrap();
        assert_eq!(be.read(0, 4096).await.unwrap(), vec![1u8; 4096]);
        // Read of LBAs 8..16 overlaps 10..=11: error at LBA 10.
        assert_eq!(
            be.read(8 * 512, 8 * 512).await.unwrap_err(),
            BackendError::ReadError { offset: 10 * 512 }
        );
        // Read ending exactly at LBA 10: passes.
        be.read(0, 10 * 512).await.unwrap();
        // Write of LBAs 16..24 fails at LBA 20 and writes nothing.
        assert_eq!(
            be.write(16 * 512, Bytes::from(vec![7u8; 4096]), WriteMode::Durable)
                .await
                .unwrap_err(),
            BackendError::WriteError { offset: 20 * 512 }
        );
        assert!(be
            .inner()
            .read(16 * 512, 4096)
            .await
            .unwrap()
            .iter()
            .all(|&b| b == 0));
        assert_eq!(
            be.unmap(0, 64 * 512).await.unwrap_err(),
            BackendError::NoSpace
        );
        be.flush().await.unwrap();
        assert_eq!(be.control().injected(), 3);
        // Switched off: everything passes.
        be.control().set_enabled(false);
        be.read(8 * 512, 8 * 512).await.unwrap();
    }

    #[tokio::test]
    async fn rate_faults_are_deterministic_per_seed_and_count_is_a_limit() {
        let run = |seed| async move {
            let be = FaultBackend::new(
                ram(),
                vec![FaultRule::parse("read@rate=0.3").unwrap()],
                512,
                seed,
            );
            let mut pattern = Vec::new();
            for i in 0..200u64 {
                pattern.push(be.read(i * 512, 512).await.is_err());
            }
            pattern
        };
        let a = run(42).await;
        assert_eq!(a, run(42).await);
        assert_ne!(a, run(43).await);
        let fails = a.iter().filter(|&&f| f).count();
        assert!((30..=90).contains(&fails), "{fails} of 200 at rate 0.3");

        let be = FaultBackend::new(
            ram(),
            vec![FaultRule::parse("write@*/count=2").unwrap()],
            512,
            1,
        );
        let mut errs = 0;
        for _ in 0..5 {
            if be
                .write(0, Bytes::from_static(&[0; 512]), WriteMode::Cached)
                .await
                .is_err()
            {
                errs += 1;
            }
        }
        assert_eq!(errs, 2);
    }

    #[tokio::test]
    async fn delay_holds_the_operation() {
        let be = FaultBackend::new(
            ram(),
            vec![FaultRule::parse("flush@*:delay=60ms").unwrap()],
            512,
            1,
        );
        let t0 = std::time::Instant::now();
        be.flush().await.unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(60));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn stuck_io_waits_for_release_and_a_dropped_one_never_lands() {
        let be = Arc::new(FaultBackend::new(
            ram(),
            vec![FaultRule::parse("write@*:stuck").unwrap()],
            512,
            1,
        ));
        let ctl = be.control();
        // A stuck write whose future is dropped (an aborted task) never reaches the device.
        {
            let mut fut = be.write(0, Bytes::from(vec![9u8; 512]), WriteMode::Durable);
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            assert!(fut.as_mut().poll(&mut cx).is_pending());
            assert_eq!(ctl.stuck_now(), 1);
        }
        assert_eq!(ctl.stuck_now(), 0);
        ctl.release();
        assert!(be
            .inner()
            .read(0, 512)
            .await
            .unwrap()
            .iter()
            .all(|&b| b == 0));
        // A stuck write that is released completes.
        let be2 = Arc::clone(&be);
        let h = tokio::spawn(async move {
            be2.write(512, Bytes::from(vec![5u8; 512]), WriteMode::Durable)
                .await
        });
        while ctl.stuck_now() == 0 {
            tokio::task::yield_now().await;
        }
        ctl.release();
        h.await.unwrap().unwrap();
        assert_eq!(be.read(512, 512).await.unwrap(), vec![5u8; 512]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn hang_lands_after_its_future_is_dropped_and_keeps_the_keep_until_then() {
        let be = Arc::new(FaultBackend::new(
            ram(),
            vec![FaultRule::parse("write|unmap@*:hang").unwrap()],
            512,
            1,
        ));
        let ctl = be.control();
        let token = Arc::new(());
        {
            let keep: Keep = Box::new(Arc::clone(&token));
            let mut fut =
                be.write_keeping(0, Bytes::from(vec![9u8; 512]), WriteMode::Durable, keep);
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            assert!(fut.as_mut().poll(&mut cx).is_pending());
        }
        // The future is gone, the I/O is not: still stuck, still holding the keep.
        assert!(ctl.wait_stuck(1, Duration::from_secs(5)));
        assert_eq!(Arc::strong_count(&token), 2);
        assert!(be
            .inner()
            .read(0, 512)
            .await
            .unwrap()
            .iter()
            .all(|&b| b == 0));
        ctl.release();
        let t0 = std::time::Instant::now();
        while Arc::strong_count(&token) > 1 {
            assert!(t0.elapsed() < Duration::from_secs(5), "keep never dropped");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Dropped only after the write reached the device.
        assert_eq!(be.inner().read(0, 512).await.unwrap(), vec![9u8; 512]);
        assert_eq!(ctl.stuck_now(), 0);
        // An awaited hang completes on release, and unmap keeps its value the same way.
        let be2 = Arc::clone(&be);
        let keep: Keep = Box::new(Arc::clone(&token));
        let h = tokio::spawn(async move { be2.unmap_keeping(0, 512, keep).await });
        while ctl.stuck_now() == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(Arc::strong_count(&token), 2);
        ctl.release();
        h.await.unwrap().unwrap();
        assert_eq!(Arc::strong_count(&token), 1);
        assert!(be.read(0, 512).await.unwrap().iter().all(|&b| b == 0));
        // A stuck (cancellable) write that is dropped gives its keep back at once.
        let be3 = FaultBackend::new(
            ram(),
            vec![FaultRule::parse("write@*:stuck").unwrap()],
            512,
            1,
        );
        {
            let keep: Keep = Box::new(Arc::clone(&token));
            let mut fut =
                be3.write_keeping(0, Bytes::from(vec![1u8; 512]), WriteMode::Durable, keep);
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            assert!(fut.as_mut().poll(&mut cx).is_pending());
            assert_eq!(Arc::strong_count(&token), 2);
        }
        assert_eq!(Arc::strong_count(&token), 1);
    }

    #[test]
    fn parses_hang() {
        let r = FaultRule::parse("write@0-7/count=1:hang").unwrap();
        assert_eq!(r.effect, Effect::Hang);
        assert_eq!(r.count, Some(1));
    }
}
