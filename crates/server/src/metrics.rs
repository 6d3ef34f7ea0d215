//! Where the time of a command goes: a per-layer latency breakdown kept as log2 histograms per
//! target/LUN and command class, and the `ironsan ctl stats` view of it ([`crate::exposition`]
//! exports them to Prometheus).
//!
//! # Stages
//! Every SCSI command that reaches the SCSI layer is stamped with one [`Stamp`] (the
//! monotonic clock in nanoseconds) per stage boundary:
//!
//! ```text
//!  header read ─receive─▶ data complete ─queue─▶ execute ─backend─▶ done ─respond─▶ queued ─send─▶ written
//!  (reader)               (reader: last Data-Out  (command task)    (SCSI+backend)  (to the writer) (writer's
//!                          or immediate data)                                                      write returned)
//! ```
//!
//! plus `total` (header read → written). The command task carries the stamps to the writer
//! with its response ([`Timing`] inside [`crate::iscsi::writer::Out::Command`]); when the vectored write
//! holding the status PDU has returned, the writer stamps "written" and records every stage at
//! once. Recording is two relaxed `fetch_add`s per stage (bucket, sum) plus two per command
//! (commands, bytes): no locks and no allocation. Commands that never reach the SCSI layer
//! (rejected, digest errors, TASK SET FULL) and aborted ones are not recorded.
//!
//! # Buckets
//! Bucket `i` (0 ≤ i < 25) counts durations `≤ 2^i µs` and `> 2^(i-1) µs` (1 µs … 16.8 s);
//! one more counts longer ones (`+Inf`). Quantiles are interpolated linearly inside a bucket,
//! so they are accurate to a factor of two at worst.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Finite buckets: `le` = 2^0 … 2^24 µs.
pub const BUCKETS: usize = 25;
/// Finite buckets plus the overflow bucket.
const SLOTS: usize = BUCKETS + 1;

/// Command classes (as the connection counters count them: a bidirectional command is a read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Read = 0,
    Write = 1,
    Other = 2,
}

impl Class {
    pub const ALL: [Class; 3] = [Class::Read, Class::Write, Class::Other];
    pub fn of(read: bool, write: bool) -> Class {
        match (read, write) {
            (true, _) => Class::Read,
            (_, true) => Class::Write,
            _ => Class::Other,
        }
    }
    pub fn name(self) -> &'static str {
        ["read", "write", "other"][self as usize]
    }
}

/// Stage names, in the order of [`ClassMetrics::stages`].
pub const STAGES: [&str; 6] = ["receive", "queue", "backend", "respond", "send", "total"];

/// The bucket of a duration in nanoseconds.
#[inline]
pub fn bucket_of(ns: u64) -> usize {
    let us = ns.div_ceil(1000);
    if us <= 1 {
        0
    } else {
        ((64 - (us - 1).leading_zeros()) as usize).min(BUCKETS)
    }
}

/// Upper bound of finite bucket `i` in µs.
fn bucket_le_us(i: usize) -> u64 {
    1u64 << i
}

/// A log2 histogram of durations in relaxed atomics.
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; SLOTS],
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    #[inline]
    pub fn record(&self, d: Duration) {
        self.record_ns(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    #[inline]
    pub fn record_ns(&self, ns: u64) {
        self.buckets[bucket_of(ns)].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    pub fn snapshot(&self) -> HistSnapshot {
        HistSnapshot {
            counts: std::array::from_fn(|i| self.buckets[i].load(Relaxed)),
            sum_ns: self.sum_ns.load(Relaxed),
        }
    }
}

/// A histogram read at one moment (the buckets are read one by one, so under load the sum
/// and the counts may disagree by a command or two).
#[derive(Clone, Debug)]
pub struct HistSnapshot {
    /// Per bucket (not cumulative); the last is `+Inf`.
    pub counts: [u64; SLOTS],
    pub sum_ns: u64,
}

impl HistSnapshot {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    pub fn mean_us(&self) -> f64 {
        match self.count() {
            0 => 0.0,
            n => self.sum_ns as f64 / 1000.0 / n as f64,
        }
    }

    /// The `q` quantile in µs, interpolated inside its bucket (0 when empty).
    pub fn quantile_us(&self, q: f64) -> f64 {
        let n = self.count();
        if n == 0 {
            return 0.0;
        }
        let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
        let mut cum = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            if c > 0 && cum + c >= rank {
                let lo = if i == 0 {
                    0.0
                } else {
                    bucket_le_us(i - 1) as f64
                };
                if i >= BUCKETS {
                    return lo;
                }
                let hi = bucket_le_us(i) as f64;
                return lo + (hi - lo) * (rank - cum) as f64 / c as f64;
            }
            cum += c;
        }
        0.0
    }
}

/// The counters of one command class on one LUN.
#[derive(Debug, Default)]
pub struct ClassMetrics {
    pub commands: AtomicU64,
    /// Data moved: Data-In sent for reads, Data-Out received for writes.
    pub bytes: AtomicU64,
    /// Indexed as [`STAGES`].
    pub stages: [Histogram; 6],
}

/// The counters of one LUN, per [`Class`].
#[derive(Debug, Default)]
pub struct LunMetrics {
    pub classes: [ClassMetrics; 3],
}

/// A moment on the monotonic clock, in nanoseconds (`CLOCK_MONOTONIC`, the clock of
/// `std::time::Instant`); differences are plain integer subtractions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(pub u64);

impl Stamp {
    #[inline]
    pub fn now() -> Stamp {
        Stamp(crate::sys::monotonic_ns())
    }

    /// Nanoseconds from `earlier` to `self`, 0 if `earlier` is later.
    #[inline]
    pub fn since(self, earlier: Stamp) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

/// The stamps of one command, carried from the reader to the writer with its response.
#[derive(Debug)]
pub struct Timing {
    pub lun: Arc<LunMetrics>,
    pub class: Class,
    pub bytes: u64,
    /// Command header read.
    pub header: Stamp,
    /// Last Data-Out (or immediate data) read; for a read, when it was handed to its task.
    pub data: Stamp,
    /// SCSI execution started (after waiting for the transmit budget and a worker).
    pub exec: Stamp,
    /// SCSI layer and backend done.
    pub done: Stamp,
    /// Response PDUs built and about to be queued to the writer.
    pub queued: Stamp,
}

impl Timing {
    /// The status-bearing PDU was written at `now`: record every stage.
    #[inline]
    pub fn written(&self, now: Stamp) {
        let c = &self.lun.classes[self.class as usize];
        c.commands.fetch_add(1, Relaxed);
        c.bytes.fetch_add(self.bytes, Relaxed);
        let marks = [
            self.header,
            self.data,
            self.exec,
            self.done,
            self.queued,
            now,
        ];
        for (i, h) in c.stages[..5].iter().enumerate() {
            h.record_ns(marks[i + 1].since(marks[i]));
        }
        c.stages[5].record_ns(now.since(self.header));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1000), 0);
        assert_eq!(bucket_of(1001), 1);
        assert_eq!(bucket_of(2000), 1);
        assert_eq!(bucket_of(3000), 2);
        assert_eq!(bucket_of(4000), 2);
        assert_eq!(bucket_of(4001), 3);
        assert_eq!(bucket_of((1 << 24) * 1000), 24);
        assert_eq!(bucket_of((1 << 24) * 1000 + 1), 25);
        assert_eq!(bucket_of(u64::MAX), 25);
    }

    /// Stamps read the clock `Instant` reads: a span stamped around an `Instant`-measured one
    /// is never shorter, and a stage recorded from stamps lands in the bucket of its length.
    #[test]
    fn stamps_are_monotonic_nanoseconds_and_record_into_the_right_bucket() {
        let s0 = Stamp::now();
        let i0 = std::time::Instant::now();
        std::thread::sleep(Duration::from_millis(3));
        let i1 = std::time::Instant::now();
        let s1 = Stamp::now();
        let inner = i1.duration_since(i0).as_nanos() as u64;
        assert!(s1.since(s0) >= inner, "{} < {inner}", s1.since(s0));
        assert!(inner >= 3_000_000);
        assert_eq!(s0.since(s1), 0, "an earlier stamp saturates at 0");
        let lun = LunMetrics::default();
        let base = Stamp(1_000_000_000);
        let t = Timing {
            lun: Arc::new(lun),
            class: Class::Write,
            bytes: 4096,
            header: base,
            data: Stamp(base.0 + 3_000),     // receive 3 µs: bucket 2
            exec: Stamp(base.0 + 3_000),     // queue 0: bucket 0
            done: Stamp(base.0 + 103_000),   // backend 100 µs: bucket 7
            queued: Stamp(base.0 + 104_500), // respond 1.5 µs: bucket 1
        };
        t.written(Stamp(base.0 + 1_104_500)); // send 1 ms: bucket 10; total 1.1045 ms: 11
        let c = &t.lun.classes[Class::Write as usize];
        assert_eq!(c.commands.load(Relaxed), 1);
        assert_eq!(c.bytes.load(Relaxed), 4096);
        for (stage, bucket, ns) in [
            (0, 2, 3_000),
            (1, 0, 0),
            (2, 7, 100_000),
            (3, 1, 1_500),
            (4, 10, 1_000_000),
            (5, 11, 1_104_500),
        ] {
            let snap = c.stages[stage].snapshot();
            assert_eq!(snap.counts[bucket], 1, "stage {stage}");
            assert_eq!(snap.count(), 1);
            assert_eq!(snap.sum_ns, ns, "stage {stage}");
        }
    }

    #[test]
    fn quantiles() {
        let h = Histogram::default();
        for _ in 0..99 {
            h.record(Duration::from_micros(3)); // bucket 2: (2, 4]
        }
        h.record(Duration::from_millis(100)); // bucket 17: (65.5 ms, 131 ms]
        let s = h.snapshot();
        assert_eq!(s.count(), 100);
        let p50 = s.quantile_us(0.5);
        assert!((2.0..=4.0).contains(&p50), "{p50}");
        assert!(s.quantile_us(0.99) <= 4.0);
        let p100 = s.quantile_us(1.0);
        assert!((65536.0..=131072.0).contains(&p100), "{p100}");
        assert!((s.mean_us() - (99.0 * 3.0 + 100_000.0) / 100.0).abs() < 0.01);
        assert_eq!(Histogram::default().snapshot().quantile_us(0.5), 0.0);
    }
}
