//! Where the time of a command goes: a per-layer latency breakdown kept as log2 histograms per
//! target/LUN and command class, the `ironsan ctl stats` view of it, and the Prometheus
//! exposition served by `ironsan serve --metrics ADDR:PORT`.
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
//! with its response ([`Timing`] inside [`crate::writer::Out::Command`]); when the vectored write
//! holding the status PDU has returned, the writer stamps "written" and records every stage at
//! once. Recording is two relaxed `fetch_add`s per stage (bucket, sum) plus two per command
//! (commands, bytes): no locks and no allocation. Commands that never reach the SCSI layer
//! (rejected, digest errors, TASK SET FULL) and aborted ones are not recorded.
//!
//! # Buckets
//! Bucket `i` (0 ≤ i < 25) counts durations `≤ 2^i µs` and `> 2^(i-1) µs` (1 µs … 16.8 s);
//! one more counts longer ones (`+Inf`). Quantiles are interpolated linearly inside a bucket,
//! so they are accurate to a factor of two at worst.

use crate::admin::Control;
use serde_json::{json, Value};
use std::fmt::Write as _;
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

// ----- views ------------------------------------------------------------------------------------

/// `ironsan ctl stats [TARGET]`: per target, LUN and class, the count, bytes and per stage the
/// mean and p50/p99 (µs) and the raw buckets.
pub fn stats_view(control: &Control, target: Option<&str>) -> Result<Value, String> {
    let mut out = Vec::new();
    for (tname, lun, m) in control.lun_metrics(target)? {
        for class in Class::ALL {
            let c = &m.classes[class as usize];
            let stages: serde_json::Map<String, Value> = STAGES
                .iter()
                .zip(&c.stages)
                .map(|(name, h)| {
                    let s = h.snapshot();
                    (
                        name.to_string(),
                        json!({
                            "count": s.count(),
                            "mean_us": round2(s.mean_us()),
                            "p50_us": round2(s.quantile_us(0.5)),
                            "p99_us": round2(s.quantile_us(0.99)),
                            "sum_us": s.sum_ns / 1000,
                            "buckets": s.counts.to_vec(),
                        }),
                    )
                })
                .collect();
            out.push(json!({
                "target": tname,
                "lun": lun,
                "class": class.name(),
                "commands": c.commands.load(Relaxed),
                "bytes": c.bytes.load(Relaxed),
                "stages": stages,
            }));
        }
    }
    Ok(Value::Array(out))
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

/// A duration in µs for people: `850 ns`, `12.3 µs`, `4.56 ms`, `1.20 s`.
pub fn human_us(us: f64) -> String {
    if us < 1.0 {
        format!("{:.0} ns", us * 1000.0)
    } else if us < 1000.0 {
        format!("{us:.1} µs")
    } else if us < 1_000_000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{:.2} s", us / 1_000_000.0)
    }
}

/// The human form of [`stats_view`]: one block per target/LUN/class that saw commands.
pub fn render_stats(v: &Value) -> String {
    let empty = Vec::new();
    let mut out = String::new();
    for e in v.as_array().unwrap_or(&empty) {
        let n = e["commands"].as_u64().unwrap_or(0);
        if n == 0 {
            continue;
        }
        out.push_str(&format!(
            "{} LUN {} {}: {} commands, {}\n",
            e["target"].as_str().unwrap_or("?"),
            e["lun"],
            e["class"].as_str().unwrap_or("?"),
            n,
            crate::admin::human_bytes(e["bytes"].as_u64().unwrap_or(0)),
        ));
        let mut rows = Vec::new();
        for st in STAGES {
            let s = &e["stages"][st];
            let f = |k: &str| human_us(s[k].as_f64().unwrap_or(0.0));
            rows.push(format!(
                "  {:<8} {:>10} {:>10} {:>10}\n",
                st,
                f("mean_us"),
                f("p50_us"),
                f("p99_us")
            ));
        }
        out.push_str(&format!(
            "  {:<8} {:>10} {:>10} {:>10}\n",
            "STAGE", "MEAN", "P50", "P99"
        ));
        for r in rows {
            out.push_str(&r);
        }
    }
    if out.is_empty() {
        out.push_str("no commands yet\n");
    }
    out
}

// ----- Prometheus -------------------------------------------------------------------------------

/// Escape a label value (text exposition format 0.0.4).
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `le` of finite bucket `i` in seconds, exactly (2^i µs).
fn le_seconds(i: usize) -> String {
    let us = bucket_le_us(i);
    format!("{}.{:06}", us / 1_000_000, us % 1_000_000)
}

/// CPU seconds (user + system) and resident bytes of this process, from /proc.
fn process_stats() -> (Option<f64>, Option<u64>) {
    const CLK_TCK: f64 = 100.0;
    let cpu = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the command name (which may hold spaces) start at field 3 (state).
            let rest = &s[s.rfind(')')? + 1..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            let utime: u64 = f.get(11)?.parse().ok()?;
            let stime: u64 = f.get(12)?.parse().ok()?;
            Some((utime + stime) as f64 / CLK_TCK)
        });
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let l = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            let kb: u64 = l.split_whitespace().nth(1)?.parse().ok()?;
            Some(kb * 1024)
        });
    (cpu, rss)
}

/// The whole exposition (text format 0.0.4).
pub fn prometheus(control: &Control) -> String {
    let mut o = String::with_capacity(64 << 10);
    let luns = control.lun_metrics(None).unwrap_or_default();
    let head = |o: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };

    head(
        &mut o,
        "ironsan_commands_total",
        "counter",
        "SCSI commands completed (response written), per target, LUN and class.",
    );
    for (t, lun, m) in &luns {
        for c in Class::ALL {
            let _ = writeln!(
                o,
                "ironsan_commands_total{{target=\"{}\",lun=\"{lun}\",class=\"{}\"}} {}",
                esc(t),
                c.name(),
                m.classes[c as usize].commands.load(Relaxed)
            );
        }
    }
    head(
        &mut o,
        "ironsan_bytes_total",
        "counter",
        "Data bytes moved by completed commands: read = Data-In sent, write = Data-Out received.",
    );
    for (t, lun, m) in &luns {
        for c in [Class::Read, Class::Write] {
            let _ = writeln!(
                o,
                "ironsan_bytes_total{{target=\"{}\",lun=\"{lun}\",direction=\"{}\"}} {}",
                esc(t),
                c.name(),
                m.classes[c as usize].bytes.load(Relaxed)
            );
        }
    }
    head(
        &mut o,
        "ironsan_command_latency_seconds",
        "histogram",
        "Time per stage of a command: receive (header to data complete), queue (to SCSI execute), backend (SCSI and backend), respond (response built and queued), send (queued to written), total.",
    );
    for (t, lun, m) in &luns {
        let t = esc(t);
        for c in Class::ALL {
            for (stage, h) in STAGES.iter().zip(&m.classes[c as usize].stages) {
                let s = h.snapshot();
                let labels = format!(
                    "target=\"{t}\",lun=\"{lun}\",class=\"{}\",stage=\"{stage}\"",
                    c.name()
                );
                let mut cum = 0;
                for i in 0..BUCKETS {
                    cum += s.counts[i];
                    let _ = writeln!(
                        o,
                        "ironsan_command_latency_seconds_bucket{{{labels},le=\"{}\"}} {cum}",
                        le_seconds(i)
                    );
                }
                cum += s.counts[BUCKETS];
                let _ = writeln!(
                    o,
                    "ironsan_command_latency_seconds_bucket{{{labels},le=\"+Inf\"}} {cum}\n\
                     ironsan_command_latency_seconds_sum{{{labels}}} {}\n\
                     ironsan_command_latency_seconds_count{{{labels}}} {cum}",
                    s.sum_ns as f64 / 1e9
                );
            }
        }
    }

    let inventory = control.lun_inventory();
    head(
        &mut o,
        "ironsan_lun_info",
        "gauge",
        "Every LUN (value 1), with its backend and device (the spec's first part: rbd:POOL/IMAGE, file:PATH, ram:SIZE, ...).",
    );
    for (t, lun, kind, device, _) in &inventory {
        let _ = writeln!(
            o,
            "ironsan_lun_info{{target=\"{}\",lun=\"{lun}\",backend=\"{kind}\",device=\"{}\"}} 1",
            esc(t),
            esc(device)
        );
    }
    head(
        &mut o,
        "ironsan_backend_operations_in_flight",
        "gauge",
        "Operations a LUN's backend has handed to its storage and not yet seen complete (RBD: in librbd).",
    );
    for (t, lun, kind, _, n) in &inventory {
        if let Some(n) = n {
            let _ = writeln!(
                o,
                "ironsan_backend_operations_in_flight{{target=\"{}\",lun=\"{lun}\",backend=\"{kind}\"}} {n}",
                esc(t)
            );
        }
    }

    head(
        &mut o,
        "ironsan_alua_group_state",
        "gauge",
        "ALUA target port groups: 1 for the state each group is in, 0 for the others (state: active/optimized, active/non-optimized, standby, unavailable, offline, transitioning).",
    );
    for name in control.target_names() {
        let Ok((_, groups)) = control.port_groups(&name) else {
            continue;
        };
        for g in groups {
            for st in ironsan_scsi::AccessState::ALL {
                let _ = writeln!(
                    o,
                    "ironsan_alua_group_state{{target=\"{}\",group=\"{}\",state=\"{}\"}} {}",
                    esc(&name),
                    g.id,
                    st.name(),
                    u8::from(g.state == st)
                );
            }
        }
    }

    let g = control.gauges();
    head(
        &mut o,
        "ironsan_sessions",
        "gauge",
        "Sessions (normal and discovery) now.",
    );
    let _ = writeln!(o, "ironsan_sessions {}", g.sessions);
    head(
        &mut o,
        "ironsan_connections",
        "gauge",
        "TCP connections open now.",
    );
    let _ = writeln!(o, "ironsan_connections {}", g.connections);
    let conns = control.connection_counters();
    let label = |c: &crate::admin::ConnCounters| {
        format!(
            "target=\"{}\",initiator=\"{}\",tsih=\"{}\",cid=\"{}\"",
            esc(&c.target),
            esc(&c.initiator),
            c.tsih,
            c.cid
        )
    };
    head(
        &mut o,
        "ironsan_connection_bytes_total",
        "counter",
        "Bytes received and sent on each connection of each session (several per session with MC/S).",
    );
    for c in &conns {
        let l = label(c);
        let _ = writeln!(
            o,
            "ironsan_connection_bytes_total{{{l},direction=\"rx\"}} {}\n\
             ironsan_connection_bytes_total{{{l},direction=\"tx\"}} {}",
            c.rx_bytes, c.tx_bytes
        );
    }
    head(
        &mut o,
        "ironsan_connection_commands_total",
        "counter",
        "SCSI commands received on each connection, by class.",
    );
    for c in &conns {
        let l = label(c);
        for (class, n) in [("read", c.reads), ("write", c.writes), ("other", c.other)] {
            let _ = writeln!(
                o,
                "ironsan_connection_commands_total{{{l},class=\"{class}\"}} {n}"
            );
        }
    }
    head(
        &mut o,
        "ironsan_connection_commands_in_flight",
        "gauge",
        "SCSI commands delivered on each connection and not yet completed.",
    );
    for c in &conns {
        let _ = writeln!(
            o,
            "ironsan_connection_commands_in_flight{{{}}} {}",
            label(c),
            c.in_flight
        );
    }
    head(
        &mut o,
        "ironsan_logins_total",
        "counter",
        "Logins by result; failures by reason.",
    );
    let _ = writeln!(
        o,
        "ironsan_logins_total{{result=\"success\",reason=\"\"}} {}",
        g.logins
    );
    for (reason, n) in &g.login_failures {
        let _ = writeln!(
            o,
            "ironsan_logins_total{{result=\"failure\",reason=\"{}\"}} {n}",
            esc(reason)
        );
    }
    head(
        &mut o,
        "ironsan_digest_errors_total",
        "counter",
        "Header and data digest (CRC32C) errors.",
    );
    let _ = writeln!(o, "ironsan_digest_errors_total {}", g.digest_errors);
    head(
        &mut o,
        "ironsan_zero_copy_read_bytes_total",
        "counter",
        "Data-In bytes sent straight from file LUNs' page cache (sendfile, or a mapping of a tmpfs file) or as the kernel's zero page (reads of nothing stored in RAM and NULL LUNs); zero_copy_reads.",
    );
    let _ = writeln!(
        o,
        "ironsan_zero_copy_read_bytes_total {}",
        g.zero_copy_bytes
    );
    head(
        &mut o,
        "ironsan_zero_copy_write_bytes_total",
        "counter",
        "Data-Out bytes received straight into file LUNs' pages (zero_copy_writes).",
    );
    let _ = writeln!(
        o,
        "ironsan_zero_copy_write_bytes_total {}",
        g.zero_copy_write_bytes
    );

    let (cpu, rss) = process_stats();
    if let Some(cpu) = cpu {
        head(
            &mut o,
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
        );
        let _ = writeln!(o, "process_cpu_seconds_total {cpu}");
    }
    if let Some(rss) = rss {
        head(
            &mut o,
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
        );
        let _ = writeln!(o, "process_resident_memory_bytes {rss}");
    }
    o
}

// ----- the HTTP listener ------------------------------------------------------------------------

/// Largest request head accepted (request line and headers).
const MAX_HTTP_REQUEST: usize = 8 << 10;
/// Scrapes served at once; more connections are closed at once.
const MAX_HTTP_CONNECTIONS: usize = 8;
/// A scrape connection must send its request and take the answer within this time.
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);

/// Serve `GET /metrics` on `listener` until the task is dropped or aborted: a minimal
/// HTTP/1.1 responder, one request per connection.
pub async fn serve_metrics(listener: tokio::net::TcpListener, control: Control) {
    let limit = Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CONNECTIONS));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(permit) = Arc::clone(&limit).try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let control = control.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(HTTP_TIMEOUT, http_one(stream, &control)).await;
            drop(permit);
        });
    }
}

async fn http_one(mut s: tokio::net::TcpStream, control: &Control) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p;
        }
        if buf.len() > MAX_HTTP_REQUEST {
            let msg = "HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
            s.write_all(msg.as_bytes()).await?;
            return s.shutdown().await;
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let mut parts = head.lines().next().unwrap_or("").split(' ');
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, ctype, body) = if path == "/metrics" && (method == "GET" || method == "HEAD") {
        let control = control.clone();
        // Reads /proc and formats a few thousand lines: off the runtime threads.
        let body = tokio::task::spawn_blocking(move || prometheus(&control))
            .await
            .unwrap_or_default();
        ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body)
    } else {
        (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: try GET /metrics\n".to_string(),
        )
    };
    let mut resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if method != "HEAD" {
        resp.push_str(&body);
    }
    s.write_all(resp.as_bytes()).await?;
    s.shutdown().await
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
        assert_eq!(le_seconds(0), "0.000001");
        assert_eq!(le_seconds(24), "16.777216");
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
