//! A pipelined load generator (`ironsan load`): keeps a fixed number of READ(16) or WRITE(16)
//! commands in flight on each session and reports IOPS, bandwidth, latency percentiles and its
//! own CPU time.
//!
//! Why not only `iscsi-perf`: with a fast target, libiscsi's per-command cost makes the client
//! the bottleneck, so the benchmark measures the client. This generator logs in with
//! [`Client`], then drives the socket itself from one thread: commands are encoded straight
//! into one output buffer and sent with one write per batch, responses are parsed in place
//! from one receive buffer (Data-In payload is never copied), and many sessions share the
//! thread. It speaks to any RFC 7143 target (ironsan, tgt, istgt): immediate and unsolicited
//! data within the negotiated limits, R2Ts answered, the CmdSN window honoured, the target's
//! NOP-In pings answered, Logout at the end.
//!
//! `--verify` stamps every written block with its LBA (first and last 8 bytes) and checks the
//! stamps of every block read, so a write pass followed by a read pass proves the data path
//! end to end.

use crate::{
    read16_cdb, write16_cdb, ChapOptions, Client, DataOutSeq, Error, LoginOptions, Result,
};
use ironsan_proto::pdu::*;
use ironsan_proto::{CmdSn, StatSn};
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// Access pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    RandRead,
    SeqRead,
    RandWrite,
    SeqWrite,
    /// Reads and writes mixed (`Spec::read_percent` of them reads), random LBAs.
    RandRw,
    /// Reads and writes mixed over one sequential stream.
    SeqRw,
}

impl Pattern {
    /// `randread`, `read`, `randwrite`, `write`, `randrw`, `rw` (the names fio uses).
    pub fn parse(s: &str) -> Option<Pattern> {
        Some(match s {
            "randread" => Pattern::RandRead,
            "read" => Pattern::SeqRead,
            "randwrite" => Pattern::RandWrite,
            "write" => Pattern::SeqWrite,
            "randrw" => Pattern::RandRw,
            "rw" => Pattern::SeqRw,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Pattern::RandRead => "randread",
            Pattern::SeqRead => "read",
            Pattern::RandWrite => "randwrite",
            Pattern::SeqWrite => "write",
            Pattern::RandRw => "randrw",
            Pattern::SeqRw => "rw",
        }
    }
    /// Whether any command of the pattern writes.
    fn writes(self) -> bool {
        !matches!(self, Pattern::RandRead | Pattern::SeqRead)
    }
    fn random(self) -> bool {
        matches!(
            self,
            Pattern::RandRead | Pattern::RandWrite | Pattern::RandRw
        )
    }
}

/// Where to connect: `iscsi://[user%secret@]host[:port]/target-iqn/lun` (libiscsi's URL form).
#[derive(Clone, Debug)]
pub struct Url {
    pub addr: SocketAddr,
    pub target: String,
    pub lun: u64,
    pub chap: Option<(String, String)>,
}

impl Url {
    pub fn parse(url: &str) -> std::result::Result<Url, String> {
        let bad = |why: &str| format!("bad URL {url:?}: {why} (want iscsi://host[:port]/iqn/lun)");
        let rest = url
            .strip_prefix("iscsi://")
            .ok_or_else(|| bad("no iscsi:// prefix"))?;
        let (auth, rest) = match rest.split_once('@') {
            Some((a, r)) => (Some(a), r),
            None => (None, rest),
        };
        let chap = match auth {
            None => None,
            Some(a) => {
                let (u, s) = a
                    .split_once('%')
                    .ok_or_else(|| bad("credentials must be user%secret"))?;
                Some((u.to_string(), s.to_string()))
            }
        };
        let (host, path) = rest.split_once('/').ok_or_else(|| bad("no target"))?;
        let (target, lun) = path.rsplit_once('/').ok_or_else(|| bad("no LUN"))?;
        if target.is_empty() {
            return Err(bad("empty target name"));
        }
        let lun = lun.parse().map_err(|_| bad("LUN is not a number"))?;
        let with_port = if host.ends_with(']') || !host.contains(':') {
            format!("{host}:3260")
        } else {
            host.to_string()
        };
        let addr = with_port
            .to_socket_addrs()
            .map_err(|e| bad(&format!("cannot resolve {host}: {e}")))?
            .next()
            .ok_or_else(|| bad("host resolves to nothing"))?;
        Ok(Url {
            addr,
            target: target.to_string(),
            lun,
            chap,
        })
    }
}

/// How a session spreads its commands over its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    /// Each command on the next connection.
    RoundRobin,
    /// Each command on the connection with the fewest commands in flight (ties round robin),
    /// as Microsoft's initiator offers.
    LeastQueueDepth,
}

impl Spread {
    /// `rr` or `lqd`.
    pub fn parse(s: &str) -> Option<Spread> {
        match s {
            "rr" => Some(Spread::RoundRobin),
            "lqd" => Some(Spread::LeastQueueDepth),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Spread::RoundRobin => "rr",
            Spread::LeastQueueDepth => "lqd",
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Spec {
    pub pattern: Pattern,
    /// Bytes per command (a multiple of the LUN's block size).
    pub io_bytes: u32,
    /// Commands in flight per session.
    pub queue_depth: u32,
    pub sessions: u32,
    /// TCP connections per session (MC/S, RFC 7143 §4.2.2.1: one CmdSN space over them).
    pub connections: u32,
    /// How a session's commands are spread over its connections.
    pub spread: Spread,
    /// Of a mixed pattern's commands, the percentage that read (0..=100; fio's `rwmixread`).
    pub read_percent: u8,
    /// Stop issuing after this long...
    pub duration: Duration,
    /// ...or after this many commands per session, whichever comes first.
    pub count: Option<u64>,
    /// Stamp written blocks with their LBA and check the stamps of blocks read.
    pub verify: bool,
    /// Every session registers a key and holds a Write Exclusive – All Registrants
    /// persistent reservation, so that every command meets a reservation (and passes the
    /// target's check); cleared after the run.
    pub reserve: bool,
    /// ErrorRecoveryLevel offered (RFC 7143 §13.20): at 1 the target keeps what it sends
    /// for SNACKs, which is what this measures; the load generator itself never SNACKs.
    pub error_recovery_level: u8,
    /// Seed of the random LBAs.
    pub seed: u64,
    pub initiator_name: String,
}

impl Spec {
    pub fn new(pattern: Pattern, io_bytes: u32, queue_depth: u32) -> Spec {
        Spec {
            pattern,
            io_bytes,
            queue_depth,
            sessions: 1,
            connections: 1,
            spread: Spread::RoundRobin,
            read_percent: 50,
            duration: Duration::from_secs(10),
            count: None,
            verify: false,
            reserve: false,
            error_recovery_level: 0,
            seed: 1,
            initiator_name: "iqn.2026-11.org.ironsan:load".into(),
        }
    }
}

/// Latency histogram with 1 us buckets up to 100 ms (and one bucket above).
#[derive(Clone, Debug)]
pub struct Histogram {
    buckets: Vec<u64>,
    count: u64,
    sum_ns: u128,
    /// Sum of squared nanoseconds, for the standard deviation.
    sum_sq_ns: u128,
    max_ns: u64,
}

const HIST_US: usize = 100_000;

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: vec![0; HIST_US + 1],
            count: 0,
            sum_ns: 0,
            sum_sq_ns: 0,
            max_ns: 0,
        }
    }
}

impl Histogram {
    fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let us = usize::try_from(ns / 1000).unwrap_or(HIST_US).min(HIST_US);
        if let Some(b) = self.buckets.get_mut(us) {
            *b += 1;
        }
        self.count += 1;
        self.sum_ns += u128::from(ns);
        self.sum_sq_ns = self
            .sum_sq_ns
            .saturating_add(u128::from(ns) * u128::from(ns));
        self.max_ns = self.max_ns.max(ns);
    }
    fn merge(&mut self, o: &Histogram) {
        for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
            *a += b;
        }
        self.count += o.count;
        self.sum_ns += o.sum_ns;
        self.sum_sq_ns = self.sum_sq_ns.saturating_add(o.sum_sq_ns);
        self.max_ns = self.max_ns.max(o.max_ns);
    }
    /// Mean latency in microseconds.
    pub fn mean_us(&self) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        self.sum_ns as f64 / self.count as f64 / 1000.0
    }
    /// Standard deviation of the latency in microseconds.
    pub fn stddev_us(&self) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let n = self.count as f64;
        let mean = self.sum_ns as f64 / n;
        let var = (self.sum_sq_ns as f64 / n - mean * mean).max(0.0);
        var.sqrt() / 1000.0
    }
    pub fn max_us(&self) -> f64 {
        self.max_ns as f64 / 1000.0
    }
    /// The latency (upper edge of its 1 us bucket) below which `p` (0..1) of commands fell.
    pub fn percentile_us(&self, p: f64) -> f64 {
        let want = ((self.count as f64) * p).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (us, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= want {
                return if us == HIST_US {
                    self.max_us()
                } else {
                    (us + 1) as f64
                };
            }
        }
        0.0
    }
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Commands completed (with any status).
    pub ios: u64,
    /// Of them, writes.
    pub writes: u64,
    /// Bytes moved by commands that completed with GOOD.
    pub bytes: u64,
    /// Commands that did not complete with GOOD and all their data.
    pub failed: u64,
    pub first_failure: Option<String>,
    /// Blocks read whose stamps were not the ones written (with `verify`).
    pub verify_failures: u64,
    pub first_verify_failure: Option<String>,
    /// From the first command sent to the last response received.
    pub elapsed: Duration,
    pub latency: Histogram,
    /// CPU time this process used during the run (all sessions share one thread).
    pub cpu: Duration,
    pub block_size: u32,
    pub blocks: u64,
    /// Each session's own figures, in the order they were logged in.
    pub sessions: Vec<SessionReport>,
    /// Each connection's own figures (sessions in order, their connections by CID).
    pub connections: Vec<ConnReport>,
    /// When the first command was sent and the last answer came, over all sessions.
    first_sent: Option<Instant>,
    last_done: Option<Instant>,
}

impl Report {
    pub fn iops(&self) -> f64 {
        self.ios as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    pub fn mib_per_s(&self) -> f64 {
        self.bytes as f64 / (1 << 20) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    fn merge(&mut self, o: Report) {
        self.ios += o.ios;
        self.writes += o.writes;
        self.bytes += o.bytes;
        self.failed += o.failed;
        self.first_failure = self.first_failure.take().or(o.first_failure);
        self.verify_failures += o.verify_failures;
        self.first_verify_failure = self.first_verify_failure.take().or(o.first_verify_failure);
        self.first_sent = match (self.first_sent, o.first_sent) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.last_done = self.last_done.max(o.last_done);
        self.latency.merge(&o.latency);
        self.block_size = o.block_size;
        self.blocks = o.blocks;
    }
}

/// One session's share of a run (fairness between sessions, paths, targets).
#[derive(Clone, Debug)]
pub struct SessionReport {
    /// `host:port` of the portal the session logged in to.
    pub portal: String,
    pub ios: u64,
    pub bytes: u64,
    pub elapsed: Duration,
    pub lat_mean_us: f64,
    pub lat_stddev_us: f64,
}

impl SessionReport {
    pub fn mib_per_s(&self) -> f64 {
        self.bytes as f64 / (1 << 20) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// One connection's share of a run (fairness between the connections of a session).
#[derive(Clone, Debug)]
pub struct ConnReport {
    /// The session it belongs to (its index in the run).
    pub session: u32,
    pub cid: u16,
    /// `host:port` of the portal it logged in to.
    pub portal: String,
    pub ios: u64,
    pub bytes: u64,
    pub elapsed: Duration,
    /// Command turnaround on this connection.
    pub lat_mean_us: f64,
    pub lat_stddev_us: f64,
}

impl ConnReport {
    pub fn mib_per_s(&self) -> f64 {
        self.bytes as f64 / (1 << 20) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// CPU time of this process so far (utime + stime from /proc/self/stat, in clock ticks of
/// 10 ms; coarse, fine over seconds).
fn process_cpu() -> Duration {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return Duration::ZERO;
    };
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let Some((_, rest)) = s.rsplit_once(')') else {
        return Duration::ZERO;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    Duration::from_millis((tick(11) + tick(12)) * 10)
}

/// Run `spec` against `urls`: log in `spec.sessions` sessions, session `i` to
/// `urls[i % urls.len()]` (several paths to one LUN, or LUNs of several targets, striped by
/// session) with `spec.connections` connections each (connection `j` of session `i` to
/// `urls[(i + j) % urls.len()]`: several lines to one portal group), drive them all from the
/// current thread, log out. Call from a current-thread
/// Tokio runtime for the figures to mean "one client core".
pub async fn run(urls: &[Url], spec: &Spec) -> Result<Report> {
    if spec.queue_depth == 0 || spec.sessions == 0 || spec.io_bytes == 0 || urls.is_empty() {
        return Err(Error::Protocol(
            "queue depth, sessions, I/O size and URLs must be at least 1".into(),
        ));
    }
    if spec.read_percent > 100 {
        return Err(Error::Protocol(format!(
            "read percentage {} is over 100",
            spec.read_percent
        )));
    }
    if spec.connections == 0 || spec.connections > 64 {
        return Err(Error::Protocol(
            "connections per session must be 1 to 64".into(),
        ));
    }
    let mut conns = Vec::new();
    for i in 0..spec.sessions {
        let addr = urls[i as usize % urls.len()].addr;
        conns.push((addr, Session::login(urls, spec, i).await?));
    }
    let cpu0 = process_cpu();
    let mut runs = Vec::new();
    for (addr, c) in conns {
        runs.push((addr, tokio::spawn(c.drive())));
    }
    let mut report = Report::default();
    let mut sessions = Vec::new();
    let mut connections = Vec::new();
    for (addr, r) in runs {
        let (r, c) = r
            .await
            .map_err(|e| Error::Protocol(format!("session task: {e}")))??;
        connections.extend(c);
        sessions.push(SessionReport {
            portal: addr.to_string(),
            ios: r.ios,
            bytes: r.bytes,
            elapsed: busy_time(r.first_sent, r.last_done),
            lat_mean_us: r.latency.mean_us(),
            lat_stddev_us: r.latency.stddev_us(),
        });
        report.merge(r);
    }
    report.sessions = sessions;
    report.connections = connections;
    report.elapsed = match (report.first_sent, report.last_done) {
        (Some(a), Some(b)) => b.saturating_duration_since(a),
        _ => Duration::ZERO,
    };
    report.cpu = process_cpu().saturating_sub(cpu0);
    if spec.reserve {
        clear_reservation(&urls[0], spec).await?;
    }
    Ok(report)
}

/// `Spec::reserve`: the load's reservation keys (the session index in the low bits).
const RESERVE_KEY: u64 = 0x4c4f_4144_0000_0000;
/// Write Exclusive – All Registrants.
const WR_EX_AR: u8 = 0x7;

/// PERSISTENT RESERVE OUT with a basic 24-byte parameter list, past unit attentions.
async fn prout(
    c: &mut Client,
    lun: u64,
    sa: u8,
    ptype: u8,
    key: u64,
    sark: u64,
) -> Result<crate::CommandResult> {
    let (cdb, p) = crate::prout_basic(sa, ptype, key, sark, false);
    let mut r = c.command(lun, &cdb, Some(p.clone()), 0).await?;
    for _ in 0..4 {
        if r.status != 2 || r.sense_key().map(|s| s.0) != Some(0x6) {
            break;
        }
        r = c.command(lun, &cdb, Some(p.clone()), 0).await?;
    }
    Ok(r)
}

/// After a run with `Spec::reserve`: one more I_T nexus registers and CLEARs every
/// registration and the reservation.
async fn clear_reservation(url: &Url, spec: &Spec) -> Result<()> {
    let mut o = LoginOptions::new(Some(&url.target));
    o.initiator_name = spec.initiator_name.clone();
    let pid = (std::process::id() as u16).to_be_bytes();
    o.isid = Isid([0x80, 0x4c, pid[0], pid[1], 0xff, 0xff]);
    if let Some((u, s)) = &url.chap {
        o.chap = Some(ChapOptions::new(u, s.as_bytes()));
    }
    let mut c = Client::login(url.addr, &o).await?;
    let key = RESERVE_KEY | 0xffff;
    for (sa, rk, sark) in [(0x06, 0, key), (0x03, key, 0)] {
        let r = prout(&mut c, url.lun, sa, 0, rk, sark).await?;
        if r.status != 0 {
            return Err(Error::Protocol(format!(
                "clearing the load's reservation (service action {sa}) failed: status {:#x}",
                r.status
            )));
        }
    }
    let _ = c.logout().await;
    Ok(())
}

/// The stamp of block `lba`: first 8 bytes, last 8 bytes.
fn stamps(lba: u64) -> ([u8; 8], [u8; 8]) {
    (
        (lba.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x1e05_a4a5_1e05_a4a5).to_le_bytes(),
        (!lba).to_le_bytes(),
    )
}

#[derive(Default)]
struct Slot {
    busy: bool,
    /// The command on the slot writes.
    write: bool,
    lba: u64,
    start: Option<Instant>,
    /// Data-In bytes received so far.
    received: u32,
    /// This slot's write data (writes only).
    wbuf: Vec<u8>,
    /// The connection its command went on.
    conn: usize,
}

/// What the PDU whose data segment is being received is.
enum Rx {
    /// Waiting for a header.
    Header,
    /// Receiving a data segment: `left` data bytes, then `pad` bytes of padding.
    Data { kind: Kind, left: usize, pad: usize },
}

/// Whose data segment is being received.
enum Kind {
    /// Data-In for `slot` (checked in place, never copied); `status` if S was set.
    DataIn {
        slot: usize,
        status: Option<u8>,
        residual: Residual,
    },
    /// Any other PDU (sense, reject, ping data), its data collected into `small`.
    Other(Box<Header>),
}

const RX_BUF: usize = 256 * 1024;
/// A session that receives nothing for this long while it waits for answers fails.
const SILENCE_LIMIT: Duration = Duration::from_secs(30);
/// Largest data segment kept for a PDU other than Data-In.
const SMALL_MAX: usize = 64 * 1024;

/// Mean and deviation of latencies without a histogram (per connection).
#[derive(Clone, Copy, Debug, Default)]
struct Moments {
    n: u64,
    sum_ns: u128,
    sum_sq_ns: u128,
}

impl Moments {
    fn record(&mut self, d: Duration) {
        let ns = d.as_nanos();
        self.n += 1;
        self.sum_ns += ns;
        self.sum_sq_ns = self.sum_sq_ns.saturating_add(ns * ns);
    }
    fn mean_us(&self) -> f64 {
        if self.n == 0 {
            return 0.0;
        }
        self.sum_ns as f64 / self.n as f64 / 1000.0
    }
    fn stddev_us(&self) -> f64 {
        if self.n == 0 {
            return 0.0;
        }
        let n = self.n as f64;
        let mean = self.sum_ns as f64 / n;
        ((self.sum_sq_ns as f64 / n - mean * mean).max(0.0)).sqrt() / 1000.0
    }
}

/// One TCP connection of a session: its socket, what is queued for it, what it is receiving,
/// its own StatSN, and its share of the run.
struct Conn {
    stream: TcpStream,
    cid: u16,
    portal: SocketAddr,
    out: Outbox,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    rx: Rx,
    exp_stat_sn: StatSn,
    /// The target's MaxRecvDataSegmentLength on this connection.
    target_mrdsl: u32,
    /// Commands in flight on it (least-queue-depth spreading).
    busy: u32,
    /// Closed by the target after the session's Logout.
    closed: bool,
    ios: u64,
    bytes: u64,
    latency: Moments,
    first_sent: Option<Instant>,
    last_done: Option<Instant>,
}

struct Session {
    spec: Spec,
    index: u32,
    lun: Lun,
    block_size: u32,
    /// Blocks per command.
    bpc: u64,
    /// Command-sized positions on the LUN.
    span: u64,
    next_seq: u64,
    rng: u64,
    /// The read/write choice of mixed patterns, a stream of its own so the LBAs of a mix
    /// are the ones the pure pattern would draw.
    mix: u64,
    /// CmdSN and the window are the session's, shared by its connections (RFC 7143 §4.2.2.1).
    cmd_sn: CmdSn,
    max_cmd_sn: CmdSn,
    first_burst: u32,
    immediate_data: bool,
    initial_r2t: bool,
    conns: Vec<Conn>,
    /// The connection the next command goes on, for round robin.
    next_conn: usize,
    slots: Vec<Slot>,
    /// Slots whose next command waits for the CmdSN window to open.
    waiting: Vec<usize>,
    issued: u64,
    stop: bool,
    logout_sent: bool,
    logged_out: bool,
    deadline: Instant,
    small: Vec<u8>,
    report: Report,
}

/// One step of xorshift64 (the state must not be 0); the caller scrambles the output.
pub(crate) fn xorshift(mut x: u64) -> u64 {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    x
}

fn failure(report: &mut Report, why: impl FnOnce() -> String) {
    report.failed += 1;
    if report.first_failure.is_none() {
        report.first_failure = Some(why());
    }
}

impl Conn {
    fn new(c: Client, cid: u16, portal: SocketAddr) -> Result<Conn> {
        Ok(Conn {
            cid,
            portal,
            out: Outbox::default(),
            buf: vec![0u8; RX_BUF],
            start: 0,
            end: 0,
            rx: Rx::Header,
            exp_stat_sn: c.exp_stat_sn,
            target_mrdsl: c.target_mrdsl.max(512),
            busy: 0,
            closed: false,
            ios: 0,
            bytes: 0,
            latency: Moments::default(),
            first_sent: None,
            last_done: None,
            stream: c.into_stream()?,
        })
    }
}

impl Session {
    /// Log in session `index`: its leading connection to `urls[index % n]`, connection `j`
    /// to `urls[(index + j) % n]` (several paths, or lines, of one portal group).
    async fn login(urls: &[Url], spec: &Spec, index: u32) -> Result<Session> {
        let url = &urls[index as usize % urls.len()];
        let mut o = LoginOptions::new(Some(&url.target));
        o.initiator_name = spec.initiator_name.clone();
        o.error_recovery_level = spec.error_recovery_level;
        // Random-qualifier format (0x80) with this process's id and the session index, so two
        // runs at once do not reinstate each other's sessions.
        let pid = (std::process::id() as u16).to_be_bytes();
        let i = (index as u16).to_be_bytes();
        o.isid = Isid([0x80, 0x4c, pid[0], pid[1], i[0], i[1]]);
        // What libiscsi offers, so both load generators see the same limits.
        o.max_recv_data_segment_length = 262_144;
        o.first_burst_length = 262_144;
        o.max_burst_length = 262_144;
        o.initial_r2t = false;
        o.immediate_data = true;
        o.max_connections = spec.connections.clamp(1, u32::from(u16::MAX)) as u16;
        if let Some((u, s)) = &url.chap {
            o.chap = Some(ChapOptions::new(u, s.as_bytes()));
        }
        let mut c = Client::login(url.addr, &o).await?;
        if c.header_digest || c.data_digest {
            return Err(Error::Protocol(
                "the load generator runs without digests".into(),
            ));
        }
        if spec.connections > 1 {
            let agreed = c.negotiated_u32("MaxConnections").unwrap_or(1);
            if agreed < spec.connections {
                return Err(Error::Protocol(format!(
                    "the target allows {agreed} connections per session, not {}",
                    spec.connections
                )));
            }
        }
        // READ CAPACITY(16), past any unit attention.
        let mut cdb = [0u8; 16];
        cdb[0] = 0x9e;
        cdb[1] = 0x10;
        cdb[13] = 32;
        let mut cap = None;
        for _ in 0..5 {
            let r = c.command(url.lun, &cdb, None, 32).await?;
            if r.status == 0 && r.data.len() >= 12 {
                cap = Some(r.data);
                break;
            }
        }
        let cap = cap.ok_or_else(|| {
            Error::Protocol(format!("READ CAPACITY(16) of LUN {} failed", url.lun))
        })?;
        let be64 = |b: &[u8]| b.iter().fold(0u64, |a, &x| (a << 8) | u64::from(x));
        let blocks = be64(&cap[0..8]).saturating_add(1);
        let block_size = be64(&cap[8..12]) as u32;
        if block_size == 0 || !spec.io_bytes.is_multiple_of(block_size) {
            return Err(Error::Protocol(format!(
                "I/O size {} is not a multiple of the block size {block_size}",
                spec.io_bytes
            )));
        }
        if spec.verify && block_size < 16 {
            return Err(Error::Protocol(format!(
                "--verify needs blocks of at least 16 bytes, the LUN has {block_size}"
            )));
        }
        if spec.reserve {
            let key = RESERVE_KEY | u64::from(index);
            // REGISTER AND IGNORE EXISTING KEY, then RESERVE (all registrants hold it).
            for (sa, ptype, rk, sark) in [(0x06, 0, 0, key), (0x01, WR_EX_AR, key, 0)] {
                let r = prout(&mut c, url.lun, sa, ptype, rk, sark).await?;
                if r.status != 0 {
                    return Err(Error::Protocol(format!(
                        "PERSISTENT RESERVE OUT (service action {sa}) failed: status {:#x}",
                        r.status
                    )));
                }
            }
        }
        let bpc = u64::from(spec.io_bytes / block_size);
        let span = blocks / bpc;
        if span == 0 {
            return Err(Error::Protocol(format!(
                "the LUN ({blocks} blocks) is smaller than one I/O"
            )));
        }
        let wbuf_len = if spec.pattern.writes() {
            spec.io_bytes as usize
        } else {
            0
        };
        let slots = (0..spec.queue_depth)
            .map(|_| Slot {
                // 0xa5, not zeros: a target may treat zero writes specially (thin LUNs).
                wbuf: vec![0xa5; wbuf_len],
                ..Slot::default()
            })
            .collect();
        let sessions = u64::from(spec.sessions.max(1));
        // The other connections join the session (same ISID and TSIH, CIDs 1, 2, ...) and
        // continue its CmdSN.
        let mut cmd_sn = c.cmd_sn;
        let mut max_cmd_sn = c.max_cmd_sn;
        let (first_burst, immediate_data, initial_r2t) =
            (c.first_burst, c.immediate_data, c.initial_r2t);
        let tsih = c.tsih;
        let mut conns = vec![Conn::new(c, 0, url.addr)?];
        for j in 1..spec.connections {
            let u = &urls[(index + j) as usize % urls.len()];
            let mut oj = o.clone();
            oj.tsih = tsih;
            oj.cid = Cid(j as u16);
            let mut cj = Client::connect(u.addr).await?;
            cj.cmd_sn = cmd_sn;
            cj.login_on(&oj).await?;
            cmd_sn = cj.cmd_sn;
            if cj.max_cmd_sn.gt(max_cmd_sn) {
                max_cmd_sn = cj.max_cmd_sn;
            }
            conns.push(Conn::new(cj, j as u16, u.addr)?);
        }
        Ok(Session {
            spec: spec.clone(),
            index,
            lun: Lun::from_number(url.lun),
            block_size,
            bpc,
            span,
            // Sequential streams of several sessions start spread over the LUN.
            next_seq: span / sessions * u64::from(index),
            rng: spec.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(index + 1) | 1,
            mix: spec.seed.wrapping_mul(0xd6e8_feb8_6659_fd93) ^ u64::from(index + 1) | 1,
            cmd_sn,
            max_cmd_sn,
            first_burst,
            immediate_data,
            initial_r2t,
            conns,
            next_conn: 0,
            slots,
            waiting: Vec::new(),
            issued: 0,
            stop: false,
            logout_sent: false,
            logged_out: false,
            deadline: Instant::now(),
            small: Vec::new(),
            report: Report {
                block_size,
                blocks,
                ..Report::default()
            },
        })
    }

    fn next_lba(&mut self) -> u64 {
        let pos = if self.spec.pattern.random() {
            self.rng = xorshift(self.rng);
            self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) % self.span
        } else {
            let p = self.next_seq % self.span;
            self.next_seq = p + 1;
            p
        };
        pos * self.bpc
    }

    /// The connection the next command goes on.
    fn pick_conn(&mut self) -> usize {
        let n = self.conns.len();
        match self.spec.spread {
            Spread::RoundRobin => {
                let c = self.next_conn % n;
                self.next_conn = (c + 1) % n;
                c
            }
            Spread::LeastQueueDepth => {
                // Ties go round robin, so an idle session still uses every connection.
                let start = self.next_conn % n;
                self.next_conn = (start + 1) % n;
                (0..n)
                    .map(|k| (start + k) % n)
                    .min_by_key(|&c| self.conns[c].busy)
                    .unwrap_or(0)
            }
        }
    }

    /// Start the next command on `slot` (or park the slot until the window opens).
    fn issue(&mut self, slot: usize) {
        if self.stop {
            return;
        }
        if self.spec.count.is_some_and(|n| self.issued >= n) {
            self.stop = true;
            return;
        }
        if self.cmd_sn.gt(self.max_cmd_sn) {
            self.waiting.push(slot);
            return;
        }
        let lba = self.next_lba();
        let io = self.spec.io_bytes;
        let write = match self.spec.pattern {
            Pattern::RandRead | Pattern::SeqRead => false,
            Pattern::RandWrite | Pattern::SeqWrite => true,
            Pattern::RandRw | Pattern::SeqRw => {
                self.mix = xorshift(self.mix);
                (self.mix.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) % 100
                    >= u64::from(self.spec.read_percent)
            }
        };
        let ci = self.pick_conn();
        let Some(s) = self.slots.get_mut(slot) else {
            return;
        };
        s.busy = true;
        s.write = write;
        s.lba = lba;
        s.received = 0;
        s.conn = ci;
        if write && self.spec.verify {
            let bs = self.block_size as usize;
            for (i, block) in s.wbuf.chunks_exact_mut(bs).enumerate() {
                let (a, b) = stamps(lba + i as u64);
                block[..8].copy_from_slice(&a);
                block[bs - 8..].copy_from_slice(&b);
            }
        }
        let Some(c) = self.conns.get_mut(ci) else {
            return;
        };
        let blocks = (u64::from(io) / u64::from(self.block_size)) as u32;
        let (imm, unsolicited_end) = if write {
            let imm = if self.immediate_data {
                io.min(self.first_burst).min(c.target_mrdsl)
            } else {
                0
            };
            let end = if self.initial_r2t {
                imm
            } else {
                io.min(self.first_burst)
            };
            (imm, end)
        } else {
            (0, 0)
        };
        let itt = Itt(slot as u32);
        let cmd = ScsiCommand {
            final_bit: unsolicited_end <= imm,
            read: !write,
            write,
            attr: TaskAttr::SIMPLE,
            lun: self.lun,
            itt,
            expected_data_transfer_length: io,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: c.exp_stat_sn,
            cdb: if write {
                write16_cdb(lba, blocks)
            } else {
                read16_cdb(lba, blocks)
            },
            ..Default::default()
        };
        self.cmd_sn = self.cmd_sn.next();
        self.issued += 1;
        c.busy += 1;
        let mut bhs = Header::ScsiCommand(cmd).encode();
        bhs.set_lengths(0, imm);
        c.out.push_bytes(&bhs.0);
        c.out.push_slot(slot, 0, imm);
        push_data_out(
            &mut c.out,
            &DataOutSeq {
                lun: self.lun,
                itt,
                ttt: Ttt::RESERVED,
                exp_stat_sn: c.exp_stat_sn,
                mrdsl: c.target_mrdsl,
            },
            slot,
            imm,
            unsolicited_end,
        );
        let now = Instant::now();
        s.start = Some(now);
        c.first_sent.get_or_insert(now);
        if self.report.first_sent.is_none() {
            self.report.first_sent = s.start;
        }
    }

    /// A command finished: record it and start the next one on its slot.
    fn complete(&mut self, slot: usize, ok: Result<()>) {
        let now = Instant::now();
        let io = u64::from(self.spec.io_bytes);
        let Some(s) = self.slots.get_mut(slot) else {
            return;
        };
        if !s.busy {
            return;
        }
        s.busy = false;
        let (write, ci) = (s.write, s.conn);
        let latency = s.start.take().map(|t| now - t);
        if let Some(l) = latency {
            self.report.latency.record(l);
        }
        if let Some(c) = self.conns.get_mut(ci) {
            c.busy = c.busy.saturating_sub(1);
            c.ios += 1;
            c.last_done = Some(now);
            if let Some(l) = latency {
                c.latency.record(l);
            }
            if ok.is_ok() {
                c.bytes += io;
            }
        }
        self.report.ios += 1;
        if write {
            self.report.writes += 1;
        }
        match ok {
            Ok(()) => self.report.bytes += io,
            Err(e) => failure(&mut self.report, || e.to_string()),
        }
        self.report.last_done = Some(now);
        if now >= self.deadline {
            self.stop = true;
        }
        self.issue(slot);
    }

    fn note_sn(&mut self, ci: usize, sn: &TargetSn, status: bool) {
        if status {
            if let Some(c) = self.conns.get_mut(ci) {
                c.exp_stat_sn = sn.stat_sn.next();
            }
        }
        if sn.max_cmd_sn.gt(self.max_cmd_sn) {
            self.max_cmd_sn = sn.max_cmd_sn;
        }
    }

    /// The slot of a task the target answered on connection `ci`: it must be running, and
    /// on that connection (RFC 7143 §4.2.5.1: every PDU of a task on its connection).
    fn slot_of(&self, ci: usize, itt: Itt) -> Result<usize> {
        let i = itt.0 as usize;
        match self.slots.get(i) {
            Some(s) if s.busy && s.conn == ci => Ok(i),
            Some(s) if s.busy => Err(Error::Protocol(format!(
                "response for task {:#x} on connection {}, not on its own ({})",
                itt.0, ci, s.conn
            ))),
            _ => Err(Error::Protocol(format!(
                "response for task {:#x}, which is not running",
                itt.0
            ))),
        }
    }

    /// Check the stamps of Data-In bytes `chunk` at `offset` in the command's buffer.
    fn verify(&mut self, slot: usize, offset: u32, chunk: &[u8]) {
        let Some(s) = self.slots.get(slot) else {
            return;
        };
        let bs = u64::from(self.block_size);
        let (start, end) = (u64::from(offset), u64::from(offset) + chunk.len() as u64);
        if chunk.is_empty() {
            return;
        }
        let mut bad = None;
        for b in start / bs..=(end - 1) / bs {
            let (head, tail) = stamps(s.lba + b);
            for (at, want) in [(b * bs, head), ((b + 1) * bs - 8, tail)] {
                let lo = at.max(start);
                let hi = (at + 8).min(end);
                if lo >= hi {
                    continue;
                }
                let got = chunk.get((lo - start) as usize..(hi - start) as usize);
                let exp = want.get((lo - at) as usize..(hi - at) as usize);
                if got != exp && bad.is_none() {
                    bad = Some((s.lba + b, got.map(<[u8]>::to_vec).unwrap_or_default()));
                }
            }
        }
        if let Some((lba, got)) = bad {
            self.report.verify_failures += 1;
            if self.report.first_verify_failure.is_none() {
                self.report.first_verify_failure = Some(format!(
                    "block {lba}: stamp bytes {got:02x?} are not its own"
                ));
            }
        }
    }

    /// A header arrived on connection `ci`: act on it, return what its data segment is.
    fn header(&mut self, ci: usize, bhs: &Bhs) -> Result<Rx> {
        let len = bhs.data_len() as usize;
        let pad = pad_len(len);
        let h = Header::decode(bhs);
        match h {
            Header::DataIn(d) => {
                let slot = self.slot_of(ci, d.itt)?;
                let received = self.slots.get(slot).map_or(0, |s| s.received);
                if d.buffer_offset != received {
                    return Err(Error::Protocol(format!(
                        "Data-In at offset {} after {received} bytes",
                        d.buffer_offset
                    )));
                }
                if u64::from(received) + len as u64 > u64::from(self.spec.io_bytes) {
                    return Err(Error::Protocol("Data-In beyond the transfer length".into()));
                }
                self.note_sn(ci, &d.sn, d.status.is_some());
                Ok(Rx::Data {
                    kind: Kind::DataIn {
                        slot,
                        status: d.status,
                        residual: d.residual,
                    },
                    left: len,
                    pad,
                })
            }
            Header::R2t(ref r) => {
                let slot = self.slot_of(ci, r.itt)?;
                self.note_sn(ci, &r.sn, false);
                let io = self.spec.io_bytes;
                let end = r
                    .buffer_offset
                    .saturating_add(r.desired_data_transfer_length);
                let write = self.slots.get(slot).is_some_and(|s| s.write);
                if !write || r.desired_data_transfer_length == 0 || end > io {
                    return Err(Error::Protocol(format!(
                        "R2T for bytes {}..{end} of a {io}-byte {}",
                        r.buffer_offset,
                        if write { "write" } else { "read" }
                    )));
                }
                let lun = self.lun;
                if let Some(c) = self.conns.get_mut(ci) {
                    let seq = DataOutSeq {
                        lun,
                        itt: r.itt,
                        ttt: r.ttt,
                        exp_stat_sn: c.exp_stat_sn,
                        mrdsl: c.target_mrdsl,
                    };
                    push_data_out(&mut c.out, &seq, slot, r.buffer_offset, end);
                }
                self.other_data(h, len, pad)
            }
            Header::NopIn(ref n) => {
                self.note_sn(ci, &n.sn, false);
                if n.ttt != Ttt::RESERVED {
                    let cmd_sn = self.cmd_sn;
                    if let Some(c) = self.conns.get_mut(ci) {
                        let reply = NopOut {
                            immediate: true,
                            lun: n.lun,
                            itt: Itt::RESERVED,
                            ttt: n.ttt,
                            cmd_sn,
                            exp_stat_sn: c.exp_stat_sn,
                        };
                        c.out.push_bytes(&Header::NopOut(reply).encode().0);
                    }
                }
                self.other_data(h, len, pad)
            }
            Header::ScsiResponse(ref r) => {
                self.slot_of(ci, r.itt)?;
                self.note_sn(ci, &r.sn, true);
                self.other_data(h, len, pad)
            }
            Header::AsyncMessage(ref a) => {
                // An Asynchronous Message carries a StatSN of its own (RFC 7143 §11.9).
                self.note_sn(ci, &a.sn, true);
                // Logout requested, connection or session dropped: stop issuing.
                if matches!(a.async_event, 1..=3) {
                    self.stop = true;
                }
                self.other_data(h, len, pad)
            }
            Header::LogoutResponse(ref l) => {
                self.note_sn(ci, &l.sn, true);
                self.logged_out = true;
                self.other_data(h, len, pad)
            }
            Header::Reject(r) => Err(Error::Protocol(format!(
                "the target rejected a PDU (reason {:#04x})",
                r.reason.0
            ))),
            other => Err(Error::Protocol(format!("unexpected PDU {other:?}"))),
        }
    }

    fn other_data(&mut self, h: Header, len: usize, pad: usize) -> Result<Rx> {
        if len > SMALL_MAX {
            return Err(Error::Protocol(format!(
                "{len}-byte data segment on a {h:?}"
            )));
        }
        self.small.clear();
        Ok(Rx::Data {
            kind: Kind::Other(Box::new(h)),
            left: len,
            pad,
        })
    }

    /// The outcome of a read on `slot` that ended with GOOD: all its data, no residual.
    fn read_outcome(&self, slot: usize, residual: Residual) -> Result<()> {
        let received = self.slots.get(slot).map_or(0, |s| s.received);
        if received == self.spec.io_bytes && residual == Residual::None {
            return Ok(());
        }
        Err(Error::Protocol(format!(
            "read returned {received} of {} bytes ({residual:?})",
            self.spec.io_bytes
        )))
    }

    /// The PDU whose data segment ended: complete its command.
    fn pdu_done(&mut self, kind: Kind) {
        let (slot, ok) = match kind {
            Kind::DataIn {
                slot,
                status,
                residual,
            } => match status {
                None => return,
                Some(0) => (slot, self.read_outcome(slot, residual)),
                Some(status) => (
                    slot,
                    Err(Error::Protocol(format!("status {status:#04x} in Data-In"))),
                ),
            },
            Kind::Other(header) => {
                let Header::ScsiResponse(r) = *header else {
                    return;
                };
                let slot = r.itt.0 as usize;
                let ok = if r.response != ServiceResponse::COMMAND_COMPLETED || r.status != 0 {
                    // Sense data: SenseLength, then fixed format (key at 2, ASC/ASCQ at 12).
                    let sense = self.small.get(2..).unwrap_or_default();
                    let key = |i: usize| sense.get(i).copied().unwrap_or(0);
                    Err(Error::Protocol(format!(
                        "response {:#04x} status {:#04x}, sense key {:#x} ASC/ASCQ {:02x}/{:02x}",
                        r.response.0,
                        r.status,
                        key(2) & 0xf,
                        key(12),
                        key(13)
                    )))
                } else if self.slots.get(slot).is_some_and(|s| s.write) {
                    Ok(())
                } else {
                    self.read_outcome(slot, r.residual)
                };
                (slot, ok)
            }
        };
        self.complete(slot, ok);
    }

    /// Parse whole headers and any data connection `ci` received; leaves a partial header.
    fn receive(&mut self, ci: usize) -> Result<()> {
        let Some(c) = self.conns.get_mut(ci) else {
            return Ok(());
        };
        let (mut rx, buf) = (
            std::mem::replace(&mut c.rx, Rx::Header),
            std::mem::take(&mut c.buf),
        );
        let (mut start, end) = (c.start, c.end);
        let r = self.receive_from(ci, &mut rx, &buf, &mut start, end);
        if let Some(c) = self.conns.get_mut(ci) {
            c.rx = rx;
            c.buf = buf;
            c.start = start;
        }
        r
    }

    fn receive_from(
        &mut self,
        ci: usize,
        rx: &mut Rx,
        buf: &[u8],
        start: &mut usize,
        end: usize,
    ) -> Result<()> {
        loop {
            let avail = end - *start;
            match rx {
                Rx::Header => {
                    if avail < BHS_LEN {
                        return Ok(());
                    }
                    let mut bhs = Bhs::default();
                    bhs.0.copy_from_slice(&buf[*start..*start + BHS_LEN]);
                    let ahs = bhs.ahs_len();
                    if avail < BHS_LEN + ahs {
                        return Ok(());
                    }
                    *start += BHS_LEN + ahs;
                    *rx = self.header(ci, &bhs)?;
                }
                Rx::Data { kind, left, pad } => {
                    if *left + *pad > 0 && avail == 0 {
                        return Ok(());
                    }
                    let take = (*left).min(avail);
                    let chunk = &buf[*start..*start + take];
                    match kind {
                        Kind::DataIn { slot, .. } => {
                            let s = *slot;
                            let off = self.slots.get(s).map_or(0, |x| x.received);
                            if self.spec.verify {
                                self.verify(s, off, chunk);
                            }
                            if let Some(x) = self.slots.get_mut(s) {
                                x.received += take as u32;
                            }
                        }
                        Kind::Other(_) => self.small.extend_from_slice(chunk),
                    }
                    *left -= take;
                    *start += take;
                    let skip = (*pad).min(end - *start);
                    *pad -= skip;
                    *start += skip;
                    if *left == 0 && *pad == 0 {
                        if let Rx::Data { kind, .. } = std::mem::replace(rx, Rx::Header) {
                            self.pdu_done(kind);
                        }
                    }
                }
            }
        }
    }

    fn idle(&self) -> bool {
        !self.slots.iter().any(|s| s.busy)
    }

    /// Write what is queued on connection `ci` without waiting (vectored: payload straight
    /// from the slots' buffers); true if everything went.
    fn flush(&mut self, ci: usize) -> Result<bool> {
        let slots = &self.slots;
        let Some(c) = self.conns.get_mut(ci) else {
            return Ok(true);
        };
        while !c.out.is_empty() {
            let iov = c
                .out
                .slices(|slot| slots.get(slot).map_or(&[][..], |s| &s.wbuf));
            match c.stream.try_write_vectored(&iov) {
                Ok(0) => {
                    return Err(Error::Protocol(
                        "the socket took no bytes of a non-empty write".into(),
                    ))
                }
                Ok(n) => {
                    drop(iov);
                    c.out.advance(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e.into()),
            }
        }
        c.out.clear();
        Ok(true)
    }

    /// Read what connection `ci` has; `Ok(true)` if anything came.
    fn read_some(&mut self, ci: usize) -> Result<bool> {
        let logout_sent = self.logout_sent;
        let idle = self.idle();
        let Some(c) = self.conns.get_mut(ci) else {
            return Ok(false);
        };
        if c.closed {
            return Ok(false);
        }
        if c.start == c.end {
            c.start = 0;
            c.end = 0;
        } else if matches!(c.rx, Rx::Header) && c.buf.len() - c.end < BHS_LEN + 1024 {
            c.buf.copy_within(c.start..c.end, 0);
            c.end -= c.start;
            c.start = 0;
        }
        let end = c.end;
        match c.stream.try_read(&mut c.buf[end..]) {
            // After the Logout the target closes the session's connections; some targets
            // (istgt) close instead of answering it. With every command answered, the run
            // is complete all the same.
            Ok(0) if logout_sent && idle => {
                c.closed = true;
                Ok(false)
            }
            Err(e)
                if logout_sent
                    && idle
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                    ) =>
            {
                c.closed = true;
                Ok(false)
            }
            Ok(0) => Err(Error::Protocol(format!(
                "the target closed connection {} after {} of {} commands completed ({} in \
                 flight; {})",
                c.cid,
                self.report.ios,
                self.issued,
                self.slots.iter().filter(|s| s.busy).count(),
                if logout_sent {
                    "logout sent"
                } else {
                    "before logout"
                }
            ))),
            Ok(n) => {
                c.end += n;
                self.receive(ci)?;
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn drive(mut self) -> Result<(Report, Vec<ConnReport>)> {
        self.deadline = Instant::now() + self.spec.duration;
        // However long the run, a target that stops answering ends it with an error.
        let mut silent_since = tokio::time::Instant::now();
        for slot in 0..self.slots.len() {
            self.issue(slot);
        }
        let mut flushed = vec![true; self.conns.len()];
        loop {
            // Slots parked on the CmdSN window.
            while !self.stop && !self.cmd_sn.gt(self.max_cmd_sn) {
                let Some(slot) = self.waiting.pop() else {
                    break;
                };
                self.issue(slot);
            }
            if self.stop && self.idle() && !self.logout_sent {
                self.waiting.clear();
                // Close the session on its leading connection: the target closes the others.
                let l = LogoutRequest {
                    immediate: true,
                    reason: LogoutReason::CLOSE_SESSION,
                    itt: Itt(0x4c4f_4755),
                    cid: Cid(0),
                    cmd_sn: self.cmd_sn,
                    exp_stat_sn: self.conns[0].exp_stat_sn,
                };
                self.conns[0]
                    .out
                    .push_bytes(&Header::LogoutRequest(l).encode().0);
                self.logout_sent = true;
            }
            for (ci, f) in flushed.iter_mut().enumerate() {
                *f = self.flush(ci)?;
            }
            if self.logged_out {
                break;
            }
            let mut got = false;
            for ci in 0..self.conns.len() {
                got |= self.read_some(ci)?;
            }
            // Done once the target has closed every connection after the Logout, or closed
            // the one that carried it with every command answered: istgt closes that one
            // instead of answering and keeps a session's other connections open (sending
            // NOP-Ins), so waiting for all of them would never end.
            if self.logged_out
                || (self.logout_sent
                    && (self.conns.iter().all(|c| c.closed)
                        || (self.idle() && self.conns.first().is_some_and(|c| c.closed))))
            {
                break;
            }
            if got {
                silent_since = tokio::time::Instant::now();
                continue;
            }
            let give_up = silent_since + SILENCE_LIMIT;
            let conns = &self.conns;
            let ready = std::future::poll_fn(|cx| {
                for (c, &f) in conns.iter().zip(&flushed) {
                    if c.closed {
                        continue;
                    }
                    if let std::task::Poll::Ready(r) = c.stream.poll_read_ready(cx) {
                        return std::task::Poll::Ready(r);
                    }
                    if !f {
                        if let std::task::Poll::Ready(r) = c.stream.poll_write_ready(cx) {
                            return std::task::Poll::Ready(r);
                        }
                    }
                }
                std::task::Poll::Pending
            });
            match tokio::time::timeout_at(give_up, ready).await {
                Ok(r) => r?,
                Err(_) => {
                    return Err(Error::Protocol(format!(
                        "the target sent nothing for {SILENCE_LIMIT:?} with {} commands in \
                         flight ({} of {} completed; {})",
                        self.slots.iter().filter(|s| s.busy).count(),
                        self.report.ios,
                        self.issued,
                        if self.logout_sent {
                            "waiting for the Logout response"
                        } else {
                            "before logout"
                        }
                    )))
                }
            }
        }
        let index = self.index;
        let conns = self
            .conns
            .iter()
            .map(|c| ConnReport {
                session: index,
                cid: c.cid,
                portal: c.portal.to_string(),
                ios: c.ios,
                bytes: c.bytes,
                elapsed: busy_time(c.first_sent, c.last_done),
                lat_mean_us: c.latency.mean_us(),
                lat_stddev_us: c.latency.stddev_us(),
            })
            .collect();
        Ok((self.report, conns))
    }
}

/// Append bytes `start..end` of `slot`'s write buffer as Data-Out PDUs
/// ([`DataOutSeq::pdus`]): headers copied, payload referenced.
fn push_data_out(out: &mut Outbox, seq: &DataOutSeq, slot: usize, start: u32, end: u32) {
    for (d, len) in seq.pdus(start, end) {
        let off = d.buffer_offset;
        let mut bhs = Header::DataOut(d).encode();
        bhs.set_lengths(0, len);
        out.push_bytes(&bhs.0);
        out.push_slot(slot, off, off + len);
    }
}

/// A piece of what is to be sent.
#[derive(Clone, Copy, Debug)]
enum Seg {
    /// `Outbox::bytes[start..end]` (headers).
    Own { start: usize, end: usize },
    /// Bytes `start..end` of a slot's write buffer (payload, never copied).
    Slot {
        slot: usize,
        start: usize,
        end: usize,
    },
    /// Zero padding to a 4-byte boundary.
    Pad(usize),
}

impl Seg {
    fn len(self) -> usize {
        match self {
            Seg::Own { start, end } | Seg::Slot { start, end, .. } => end - start,
            Seg::Pad(n) => n,
        }
    }
}

/// What is queued for the socket: headers copied here, payload referenced in place.
#[derive(Default)]
struct Outbox {
    bytes: Vec<u8>,
    segs: Vec<Seg>,
    /// The first segment not completely written, and how much of it was.
    first: usize,
    head: usize,
}

/// Written segments kept before the outbox is compacted.
const COMPACT_AFTER: usize = 1024;

/// Most slices handed to one `writev` (IOV_MAX is 1024).
const MAX_IOV: usize = 512;

impl Outbox {
    fn push_bytes(&mut self, b: &[u8]) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(b);
        let end = self.bytes.len();
        if let Some(Seg::Own { end: e, .. }) = self.segs.last_mut() {
            if *e == start {
                *e = end;
                return;
            }
        }
        self.segs.push(Seg::Own { start, end });
    }
    fn push_slot(&mut self, slot: usize, start: u32, end: u32) {
        let (start, end) = (start as usize, end as usize);
        if end > start {
            self.segs.push(Seg::Slot { slot, start, end });
            let pad = pad_len(end - start);
            if pad > 0 {
                self.segs.push(Seg::Pad(pad));
            }
        }
    }
    fn is_empty(&self) -> bool {
        self.first >= self.segs.len()
    }
    fn clear(&mut self) {
        self.bytes.clear();
        self.segs.clear();
        self.first = 0;
        self.head = 0;
    }
    /// The unwritten bytes as slices; `data(slot)` is that slot's write buffer.
    fn slices<'a>(&'a self, data: impl Fn(usize) -> &'a [u8]) -> Vec<std::io::IoSlice<'a>> {
        self.slices_upto(MAX_IOV, data)
    }
    fn slices_upto<'a>(
        &'a self,
        limit: usize,
        data: impl Fn(usize) -> &'a [u8],
    ) -> Vec<std::io::IoSlice<'a>> {
        let segs = self.segs.get(self.first..).unwrap_or_default();
        segs.iter()
            .take(limit)
            .enumerate()
            .map(|(i, seg)| {
                let b: &[u8] = match *seg {
                    Seg::Own { start, end } => self.bytes.get(start..end).unwrap_or_default(),
                    Seg::Slot { slot, start, end } => {
                        data(slot).get(start..end).unwrap_or_default()
                    }
                    Seg::Pad(n) => &[0u8; 3][..n.min(3)],
                };
                let skip = if i == 0 { self.head.min(b.len()) } else { 0 };
                std::io::IoSlice::new(&b[skip..])
            })
            .collect()
    }
    /// Drop what was written so a socket that never drains completely does not make the
    /// outbox grow without bound.
    fn compact(&mut self) {
        let rest: Vec<Seg> = self.segs.drain(self.first..).collect();
        let old = std::mem::take(&mut self.bytes);
        self.segs.clear();
        self.first = 0;
        let head = std::mem::take(&mut self.head);
        for (i, seg) in rest.into_iter().enumerate() {
            let skip = if i == 0 { head } else { 0 };
            match seg {
                Seg::Own { start, end } => {
                    self.push_bytes(old.get(start + skip..end).unwrap_or_default())
                }
                Seg::Slot { slot, start, end } => self.segs.push(Seg::Slot {
                    slot,
                    start: start + skip,
                    end,
                }),
                Seg::Pad(n) => self.segs.push(Seg::Pad(n - skip)),
            }
        }
    }
    /// `n` more bytes were written.
    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let Some(seg) = self.segs.get(self.first) else {
                return;
            };
            let left = seg.len() - self.head;
            if n >= left {
                n -= left;
                self.first += 1;
                self.head = 0;
            } else {
                self.head += n;
                n = 0;
            }
        }
        if self.first >= COMPACT_AFTER {
            self.compact();
        }
    }
    #[cfg(test)]
    fn render<'a>(&'a self, data: impl Fn(usize) -> &'a [u8]) -> Vec<u8> {
        self.slices_upto(usize::MAX, data)
            .iter()
            .flat_map(|s| s.iter().copied())
            .collect()
    }
}

/// From the first command sent to the last one done (zero if none was).
fn busy_time(first_sent: Option<Instant>, last_done: Option<Instant>) -> Duration {
    match (first_sent, last_done) {
        (Some(a), Some(b)) => b.saturating_duration_since(a),
        _ => Duration::ZERO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ironsan_proto::DataSn;

    #[test]
    fn urls() {
        let u = Url::parse("iscsi://127.0.0.1:3261/iqn.2026-11.x:t/3").unwrap();
        assert_eq!(u.addr.to_string(), "127.0.0.1:3261");
        assert_eq!((u.target.as_str(), u.lun), ("iqn.2026-11.x:t", 3));
        let u = Url::parse("iscsi://me%pw@127.0.0.1/iqn.x:y/0").unwrap();
        assert_eq!(u.addr.port(), 3260);
        assert_eq!(u.chap, Some(("me".into(), "pw".into())));
        let u = Url::parse("iscsi://[::1]/iqn.x:y/0").unwrap();
        assert_eq!(u.addr.to_string(), "[::1]:3260");
        for bad in [
            "http://x/iqn/0",
            "iscsi://127.0.0.1/iqn.x",
            "iscsi://127.0.0.1//0",
            "iscsi://127.0.0.1/iqn.x/zero",
            "iscsi://u@127.0.0.1/iqn.x/0",
        ] {
            assert!(Url::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn histogram_percentiles() {
        let mut h = Histogram::default();
        for us in 1..=100u64 {
            h.record(Duration::from_micros(us) + Duration::from_nanos(500));
        }
        assert_eq!(h.percentile_us(0.5), 51.0);
        assert_eq!(h.percentile_us(0.99), 100.0);
        assert!((h.mean_us() - 51.0).abs() < 0.01);
        h.record(Duration::from_secs(1));
        assert_eq!(h.percentile_us(1.0), 1_000_000.0);
    }

    #[test]
    fn outbox_resumes_partial_writes_anywhere() {
        let data: Vec<u8> = (0..1001u32).map(|i| i as u8).collect();
        let build = || {
            let mut o = Outbox::default();
            o.push_bytes(b"header-1");
            o.push_bytes(b"+more");
            o.push_slot(0, 0, 1001); // 1001 bytes + 3 bytes of padding
            o.push_bytes(b"header-2");
            o
        };
        let whole = build().render(|_| &data);
        assert_eq!(whole.len(), 13 + 1001 + 3 + 8);
        assert_eq!(&whole[13..1014], &data[..]);
        assert_eq!(&whole[1014..1017], &[0, 0, 0]);
        for n in [0, 1, 12, 13, 500, 1014, 1015, 1017, 1024, 1025] {
            let mut o = build();
            o.advance(n);
            assert_eq!(
                o.render(|_| &data),
                &whole[n.min(whole.len())..],
                "after {n}"
            );
            assert_eq!(o.is_empty(), n >= whole.len());
        }
    }

    #[test]
    fn outbox_compacts_what_was_written() {
        let data = vec![9u8; 10];
        let mut o = Outbox::default();
        let mut whole = Vec::new();
        for i in 0..1500u32 {
            o.push_bytes(&i.to_be_bytes());
            o.push_slot(0, 0, 10);
            whole.extend_from_slice(&i.to_be_bytes());
            whole.extend_from_slice(&data);
            whole.extend_from_slice(&[0, 0]);
        }
        // Past 1024 segments, mid-way into a header: compacted, the rest unchanged.
        let n = 700 * 16 + 2;
        o.advance(n);
        assert!(o.first < COMPACT_AFTER && o.bytes.len() < 1500 * 4);
        assert!(
            o.render(|_| &data) == whole[n..],
            "compaction changed the bytes"
        );
        o.advance(whole.len() - n);
        assert!(o.is_empty());
    }

    #[test]
    fn data_out_segments_respect_mrdsl() {
        let data = vec![7u8; 10_000];
        let mut outbox = Outbox::default();
        let seq = DataOutSeq {
            lun: Lun::from_number(0),
            itt: Itt(5),
            ttt: Ttt(9),
            exp_stat_sn: StatSn(3),
            mrdsl: 4096,
        };
        push_data_out(&mut outbox, &seq, 0, 1000, 10_000);
        let out = outbox.render(|_| &data);
        // 9000 bytes: 4096 + 4096 + 808.
        assert_eq!(out.len(), 3 * 48 + 4096 + 4096 + 808);
        let mut at = 0;
        for (sn, (off, len, fin)) in [(1000, 4096, false), (5096, 4096, false), (9192, 808, true)]
            .into_iter()
            .enumerate()
        {
            let mut b = Bhs::default();
            b.0.copy_from_slice(&out[at..at + 48]);
            let Header::DataOut(d) = Header::decode(&b) else {
                panic!("not Data-Out")
            };
            assert_eq!(
                (d.buffer_offset, b.data_len(), d.final_bit, d.data_sn),
                (off, len, fin, DataSn(sn as u32))
            );
            assert_eq!(d.ttt, Ttt(9));
            at += 48 + len as usize;
        }
    }
}
