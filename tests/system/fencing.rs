//! Two cluster nodes serving one RBD image keep every acknowledged write when one of them
//! stalls or is cut off (docs/INTEGRITY.md, promise 23; docs/ARCHITECTURE.md, "Leases and
//! fencing").
//!
//! Each node runs in a network namespace of its own with two links, one to the initiators
//! (this process) and one to the Ceph cluster, which runs in a third namespace, so a test can
//! cut a node off from either side alone. Clients behave as Linux dm-multipath does: each
//! writes unique, checksummed values to a block of its own through the two nodes in turn; a
//! write that gets no answer within [`RETRY_AFTER`] is dropped with its connection and sent
//! again, with the same data, through the other node; once that is GOOD the next value
//! follows. Every GOOD write is read back, and at the end every block through both nodes:
//! no block may ever show a value older than the last one acknowledged. The scenarios:
//!
//! * node 1 paused (SIGSTOP of the whole process) with writes in flight, continued later;
//! * node 1 cut off from the initiators only (its link down), then back: what the clients
//!   sent before they gave up arrives late, from sockets they have closed;
//! * node 1 cut off from Ceph only;
//! * both nodes cut off from Ceph at once (nodes talk only through the cluster, so this is
//!   how two nodes lose each other), then both back: neither may fence while cut off, and
//!   afterwards they may not both be fenced.
//!
//! Needs root (`ip netns`), ceph-mon, ceph-osd and ceph-common.

use crate::ceph;
use crate::common;

use bytes::Bytes;
use ceph::Cluster;
use common::*;
use ironsan_initiator::{Client, LoginOptions};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a client waits for an answer before it sends the write through the other node:
/// what the cluster's settings below allow (more than twice the lease plus a heartbeat:
/// docs/OPERATIONS.md, "The time budget of a cluster").
const RETRY_AFTER: Duration = Duration::from_secs(5);
const HEARTBEAT: &str = "250ms";
const LEASE: &str = "2s";
/// Clients, each with one block of its own.
const WRITERS: u64 = 16;
const BS: u32 = 512;
/// A block of each client: 4 KiB at LBA 8 * i.
const BLOCK: usize = 4096;
const TARGET: &str = "iqn.2026-12.org.ironsan:fencing";
/// How long a cut lasts: longer than a client waits plus a lease, so the clients resend and
/// the other node fences while it lasts.
const CUT: Duration = Duration::from_secs(8);

/// The value `seq` of client `i`: its number and sequence stamped over the block, with a
/// checksum.
fn value(i: u64, seq: u64) -> Bytes {
    let mut b = vec![0u8; BLOCK];
    for (k, chunk) in b.chunks_mut(32).enumerate() {
        chunk[..8].copy_from_slice(&i.to_le_bytes());
        chunk[8..16].copy_from_slice(&seq.to_le_bytes());
        chunk[16..24].copy_from_slice(&(k as u64).to_le_bytes());
        let sum = i.wrapping_mul(31) ^ seq.wrapping_mul(0x9E37_79B9) ^ k as u64;
        chunk[24..32].copy_from_slice(&sum.to_le_bytes());
    }
    Bytes::from(b)
}

/// The (client, sequence) a block holds, if it is one of [`value`]'s.
fn decode(b: &[u8]) -> Option<(u64, u64)> {
    let head = b.get(..16)?;
    let i = u64::from_le_bytes(head[..8].try_into().ok()?);
    let seq = u64::from_le_bytes(head[8..16].try_into().ok()?);
    (b == &value(i, seq)[..]).then_some((i, seq))
}

// ---------------------------------------------------------------------------------------------
// The network: Ceph, node 1 and node 2 each in a namespace of their own.
// ---------------------------------------------------------------------------------------------

/// The namespaces and links; removed when this process exits.
struct Net {
    tag: u32,
}

const CEPH_ADDR: &str = "10.231.1.1";

impl Net {
    fn ns(&self, what: &str) -> String {
        format!("isf{}{what}", self.tag)
    }
    /// The namespace of node `n`.
    fn node_ns(&self, n: u16) -> String {
        self.ns(&format!("n{n}"))
    }
    fn ceph_ns(&self) -> String {
        self.ns("c")
    }
    /// Node `n`'s portal, as the initiators (this namespace) reach it.
    fn portal(&self, n: u16) -> SocketAddr {
        format!("10.231.2{n}.2:3260").parse().unwrap()
    }
    /// The initiators' side of node `n`'s link to them.
    fn initiator_link(&self, n: u16) -> String {
        format!("r{n}x{}", self.tag)
    }
    /// The Ceph side of node `n`'s link to the cluster.
    fn ceph_link(&self, n: u16) -> String {
        format!("c{n}x{}", self.tag)
    }

    fn ip(args: &[&str]) {
        let out = run_unchecked("ip", args, Duration::from_secs(20));
        assert!(out.status.success(), "ip {args:?}: {}", show(&out));
    }

    fn create() -> Net {
        let net = Net {
            tag: std::process::id() % 100_000,
        };
        let (c, t) = (net.ceph_ns(), net.tag);
        for ns in [c.clone(), net.node_ns(1), net.node_ns(2)] {
            let _ = run_unchecked("ip", &["netns", "del", &ns], Duration::from_secs(10));
            Net::ip(&["netns", "add", &ns]);
            Net::ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        // Removed once this process has gone, however it ends.
        let names = format!("{c} {} {}", net.node_ns(1), net.node_ns(2));
        let script = format!(
            "while kill -0 {} 2>/dev/null; do sleep 1; done; sleep 2; for n in {names}; do ip netns del $n; done",
            std::process::id()
        );
        // `setsid --fork`: the clean-up runs on in the background; setsid itself returns.
        std::process::Command::new("setsid")
            .args(["--fork", "bash", "-c", &script])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("the namespace clean-up");
        // This namespace <-> Ceph: the test's `rbd` and `ceph` commands.
        let (rc, cr) = (format!("rc{t}"), format!("cr{t}"));
        Net::ip(&[
            "link", "add", &rc, "type", "veth", "peer", "name", &cr, "netns", &c,
        ]);
        Net::ip(&["addr", "add", "10.231.1.2/24", "dev", &rc]);
        Net::ip(&["link", "set", &rc, "up"]);
        Net::ip(&["-n", &c, "addr", "add", "10.231.1.1/24", "dev", &cr]);
        Net::ip(&["-n", &c, "link", "set", &cr, "up"]);
        for n in [1u16, 2] {
            let ns = net.node_ns(n);
            let (cx, nc) = (net.ceph_link(n), format!("n{n}c{t}"));
            Net::ip(&[
                "-n", &c, "link", "add", &cx, "type", "veth", "peer", "name", &nc, "netns", &ns,
            ]);
            Net::ip(&[
                "-n",
                &c,
                "addr",
                "add",
                &format!("10.231.1{n}.1/24"),
                "dev",
                &cx,
            ]);
            Net::ip(&["-n", &c, "link", "set", &cx, "up"]);
            Net::ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("10.231.1{n}.2/24"),
                "dev",
                &nc,
            ]);
            Net::ip(&["-n", &ns, "link", "set", &nc, "up"]);
            Net::ip(&[
                "-n",
                &ns,
                "route",
                "add",
                "10.231.1.1/32",
                "via",
                &format!("10.231.1{n}.1"),
            ]);
            let (rx, nr) = (net.initiator_link(n), format!("n{n}r{t}"));
            Net::ip(&[
                "link", "add", &rx, "type", "veth", "peer", "name", &nr, "netns", &ns,
            ]);
            Net::ip(&["addr", "add", &format!("10.231.2{n}.1/24"), "dev", &rx]);
            Net::ip(&["link", "set", &rx, "up"]);
            Net::ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("10.231.2{n}.2/24"),
                "dev",
                &nr,
            ]);
            Net::ip(&["-n", &ns, "link", "set", &nr, "up"]);
        }
        net
    }

    /// Node `n` cut off from (`false`) or back with (`true`) the initiators: its own end of
    /// their link goes down, so what they send is lost on the way (the initiators' side
    /// stays up, as across a real network, and their sockets keep retransmitting).
    fn initiators(&self, n: u16, up: bool) {
        let state = if up { "up" } else { "down" };
        let link = format!("n{n}r{}", self.tag);
        Net::ip(&["-n", &self.node_ns(n), "link", "set", &link, state]);
    }

    /// Node `n` cut off from (`false`) or back with (`true`) the Ceph cluster.
    fn ceph(&self, n: u16, up: bool) {
        let state = if up { "up" } else { "down" };
        Net::ip(&[
            "-n",
            &self.ceph_ns(),
            "link",
            "set",
            &self.ceph_link(n),
            state,
        ]);
    }
}

/// The network and the cluster every scenario shares, and the lock that runs one scenario
/// at a time.
struct World {
    net: Net,
    ceph: Cluster,
    one_at_a_time: Mutex<()>,
}

fn world() -> Option<&'static World> {
    static W: OnceLock<World> = OnceLock::new();
    if !require_tools(&["ceph-mon", "ceph-osd", "ceph", "rbd", "ip"]) {
        return None;
    }
    if !is_root() {
        return skip("fencing tests need root (network namespaces)");
    }
    Some(W.get_or_init(|| {
        let net = Net::create();
        let ceph = Cluster::start_in(&net.ceph_ns(), CEPH_ADDR);
        World {
            net,
            ceph,
            one_at_a_time: Mutex::new(()),
        }
    }))
}

fn is_root() -> bool {
    run_stdout("id", &["-u"]).trim() == "0"
}

/// Not root: a skip (or, with `IRONSAN_REQUIRE_TOOLS=1`, a failure) that says why.
fn skip<T>(why: &str) -> Option<T> {
    ironsan_testkit::skip(why);
    None
}

// ---------------------------------------------------------------------------------------------
// Nodes
// ---------------------------------------------------------------------------------------------

/// The two nodes of one scenario, serving one new image.
struct Nodes<'a> {
    w: &'a World,
    nodes: [Server; 2],
    socks: tempfile::TempDir,
}

impl<'a> Nodes<'a> {
    fn start(w: &'a World, image: &str) -> Nodes<'a> {
        w.ceph.create_shareable(image);
        let socks = tempfile::tempdir().unwrap();
        let start = |n: u16| Nodes::node(w, image, socks.path(), n);
        let nodes = [start(1), start(2)];
        let n = Nodes { w, nodes, socks };
        for k in [1, 2] {
            n.wait(k, Duration::from_secs(30), |v| {
                peer_state(v, 3 - k) == "alive" && v["lease"]["remaining_ms"].is_u64()
            });
        }
        n
    }

    fn node(w: &World, image: &str, socks: &Path, n: u16) -> Server {
        let lun = format!("{},shared", w.ceph.spec(image, ""));
        let cluster = format!(
            "node={n},pool=rbd,conf={},name=node{n},heartbeat={HEARTBEAT},lease={LEASE},notify_timeout=3s",
            w.ceph.conf().display()
        );
        let sock = socks.join(format!("n{n}.sock")).display().to_string();
        let args = [
            "--target",
            TARGET,
            "--lun",
            lun.as_str(),
            "--cluster",
            cluster.as_str(),
            "--control",
            sock.as_str(),
        ];
        Server::start_in(&w.net.node_ns(n), w.net.portal(n), &args)
    }

    fn sock(&self, n: u16) -> PathBuf {
        self.socks.path().join(format!("n{n}.sock"))
    }

    fn server(&mut self, n: u16) -> &mut Server {
        &mut self.nodes[usize::from(n - 1)]
    }

    /// `ctl cluster --json` of node `n` (`None`: it does not answer, e.g. paused).
    fn view(&self, n: u16) -> Option<serde_json::Value> {
        let sock = self.sock(n).display().to_string();
        let out = run_unchecked(
            bin(),
            &["ctl", "--control", &sock, "--json", "cluster"],
            Duration::from_secs(5),
        );
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }

    /// `ctl counters --json` of node `n`.
    fn counters(&self, n: u16) -> serde_json::Value {
        let sock = self.sock(n).display().to_string();
        let out = run_stdout(bin(), &["ctl", "--control", &sock, "--json", "counters"]);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("ctl counters: {e}: {out}"))
    }

    /// Wait (at most `limit`) until `ok` holds for node `n`'s view; how long it took.
    fn wait(&self, n: u16, limit: Duration, ok: impl Fn(&serde_json::Value) -> bool) -> Duration {
        let t0 = Instant::now();
        loop {
            let v = self.view(n);
            if v.as_ref().is_some_and(&ok) {
                return t0.elapsed();
            }
            assert!(
                t0.elapsed() < limit,
                "node {n}'s view never as expected within {limit:?}: {v:#?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Node `n` killed and started again (a fenced node must be restarted to serve).
    fn restart(&mut self, n: u16) {
        self.server(n).kill9();
        self.server(n).start_again();
        for k in [1, 2] {
            self.wait(k, Duration::from_secs(30), |v| {
                peer_state(v, 3 - k) == "alive" && v["health"] == "serving"
            });
        }
    }
}

/// The state node `peer` has in a `ctl cluster` view.
fn peer_state(v: &serde_json::Value, peer: u16) -> String {
    v["peers"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["node"] == peer))
        .and_then(|x| x["state"].as_str())
        .unwrap_or("absent")
        .to_string()
}

// ---------------------------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------------------------

/// One attempt at a write, as a client saw it.
#[derive(Clone, Debug)]
struct Attempt {
    client: u64,
    seq: u64,
    node: u16,
    start: Instant,
    end: Instant,
    good: bool,
}

/// What the clients saw, for the checks and the figures.
#[derive(Default)]
struct Record {
    attempts: Vec<Attempt>,
    /// Per client, the last value acknowledged.
    acked: BTreeMap<u64, u64>,
    /// Reads that returned something other than the last value acknowledged.
    violations: Vec<String>,
    /// Connections given up on but kept open ([`GiveUp::Park`]), never read again.
    parked: Vec<Client>,
}

/// What a client does with a connection whose write got no answer in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GiveUp {
    /// Close it, as an initiator that fails the path does (the kernel of the closed socket
    /// still retransmits what it had not delivered, and may deliver it late).
    Close,
    /// Keep it open and never read it again: what it had not delivered arrives late on a
    /// live socket, which no late retransmission of the node can reset first.
    Park,
    /// Even clients park, odd ones close.
    Mixed,
}

/// A client's connection to one node (`None`: none now; made again when needed).
struct PathTo {
    addr: SocketAddr,
    node: u16,
    client: Option<Client>,
    /// Not tried again before this (a login failed).
    retry_at: Instant,
}

impl PathTo {
    async fn client(&mut self, name: &str) -> Option<&mut Client> {
        if self.client.is_none() && Instant::now() >= self.retry_at {
            let mut o = LoginOptions::new(Some(TARGET));
            o.initiator_name = name.to_string();
            match tokio::time::timeout(Duration::from_secs(2), Client::login(self.addr, &o)).await {
                Ok(Ok(c)) => self.client = Some(c),
                _ => self.retry_at = Instant::now() + Duration::from_millis(500),
            }
        }
        self.client.as_mut()
    }
}

/// Client `i`: values 1, 2, ... to its block through the nodes in turn, each resent through
/// the other node until it is GOOD, each read back; until `stop` (the value in flight then
/// is finished first).
async fn client(
    i: u64,
    portals: [SocketAddr; 2],
    give_up: GiveUp,
    stop: Arc<AtomicBool>,
    rec: Arc<Mutex<Record>>,
) {
    let name = format!("iqn.2026-12.org.ironsan:client-{i}");
    let mut paths = [1u16, 2].map(|n| PathTo {
        addr: portals[usize::from(n - 1)],
        node: n,
        client: None,
        retry_at: Instant::now(),
    });
    let lba = 8 * i;
    let mut seq = 0;
    let too_long = |t: Instant| t.elapsed() > Duration::from_secs(90);
    while !stop.load(Ordering::Relaxed) {
        seq += 1;
        let data = value(i, seq);
        let mut p = (seq % 2) as usize;
        let t_value = Instant::now();
        loop {
            assert!(
                !too_long(t_value),
                "client {i}: value {seq} never acknowledged"
            );
            let node = paths[p].node;
            let Some(c) = paths[p].client(&name).await else {
                p = 1 - p;
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            let start = Instant::now();
            let r =
                tokio::time::timeout(RETRY_AFTER, c.write16(0, lba, data.clone(), BS, false)).await;
            let good = matches!(&r, Ok(Ok(r)) if r.status == 0);
            rec.lock().unwrap().attempts.push(Attempt {
                client: i,
                seq,
                node,
                start,
                end: Instant::now(),
                good,
            });
            match r {
                Ok(Ok(r)) if r.status == 0 => break,
                // A unit attention (the other node's state changed): again, same path.
                Ok(Ok(r)) if r.sense_key().map(|s| s.0) == Some(0x6) => {}
                // Refused (the node is suspended or fenced): the other path.
                Ok(Ok(_)) => {
                    p = 1 - p;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                // No answer in time, or the connection broke: given up with its connection,
                // sent through the other node.
                _ => {
                    let park = give_up == GiveUp::Park
                        || (give_up == GiveUp::Mixed && i.is_multiple_of(2));
                    if let Some(c) = paths[p].client.take().filter(|_| park) {
                        rec.lock().unwrap().parked.push(c);
                    }
                    paths[p].retry_at = Instant::now() + CUT;
                    p = 1 - p;
                }
            }
        }
        rec.lock().unwrap().acked.insert(i, seq);
        // Read back through either node: it must be this value (or no answer in time).
        let q = (seq as usize / 2) % 2;
        if let Some(c) = paths[q].client(&name).await {
            match tokio::time::timeout(Duration::from_secs(2), c.read16(0, lba, 8, BS)).await {
                Ok(Ok(r)) if r.status == 0 => {
                    if decode(&r.data) != Some((i, seq)) {
                        rec.lock().unwrap().violations.push(format!(
                            "client {i}: after value {seq} was acknowledged, node {} read {:?}",
                            paths[q].node,
                            decode(&r.data)
                        ));
                    }
                }
                Ok(Ok(_)) => {}
                _ => paths[q].client = None,
            }
        }
    }
}

/// The clients running on a thread of their own.
struct Clients {
    stop: Arc<AtomicBool>,
    rec: Arc<Mutex<Record>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Clients {
    fn start(net: &Net, give_up: GiveUp) -> Clients {
        let stop = Arc::new(AtomicBool::new(false));
        let rec = Arc::new(Mutex::new(Record::default()));
        let portals = [net.portal(1), net.portal(2)];
        let (s, r) = (Arc::clone(&stop), Arc::clone(&rec));
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let mut set = tokio::task::JoinSet::new();
                for i in 0..WRITERS {
                    set.spawn(client(i, portals, give_up, Arc::clone(&s), Arc::clone(&r)));
                }
                while let Some(j) = set.join_next().await {
                    if let Err(e) = j {
                        std::panic::resume_unwind(e.into_panic());
                    }
                }
            })
        });
        Clients {
            stop,
            rec,
            thread: Some(thread),
        }
    }

    /// Ask the clients to stop after the values in flight.
    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Stop after the values in flight (waiting for them); what they saw.
    fn finish(mut self) -> Record {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            if let Err(e) = t.join() {
                std::panic::resume_unwind(e);
            }
        }
        std::mem::take(&mut *self.rec.lock().unwrap())
    }
}

/// Every client's block through node `n` (a fresh session): its last acknowledged value.
fn check_blocks(nodes: &Nodes, n: u16, rec: &Record) {
    let addr = nodes.w.net.portal(n);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut o = LoginOptions::new(Some(TARGET));
        o.initiator_name = "iqn.2026-12.org.ironsan:checker".into();
        let mut c = Client::login(addr, &o).await.expect("login to check");
        for (i, seq) in &rec.acked {
            let r = loop {
                let r = c.read16(0, 8 * i, 8, BS).await.expect("read to check");
                if r.sense_key().map(|s| s.0) != Some(0x6) {
                    break r;
                }
            };
            assert_eq!(
                r.status,
                0,
                "node {n}: reading client {i}'s block: {:?}",
                r.sense_key()
            );
            assert_eq!(
                decode(&r.data),
                Some((*i, *seq)),
                "node {n}: client {i}'s block went back from the acknowledged value {seq}"
            );
        }
    });
}

/// What the clients saw while they ran: no read gave an older value than the last one
/// acknowledged, enough writes to mean something, some resent through the other node.
fn check_run(rec: &Record) {
    assert!(
        rec.violations.is_empty(),
        "values went back:\n{}",
        rec.violations.join("\n")
    );
    let writes = rec.attempts.iter().filter(|a| a.good).count();
    let resent = rec.attempts.iter().filter(|a| !a.good).count();
    eprintln!("{writes} writes acknowledged, {resent} attempts not answered GOOD and resent");
    assert!(writes > 100, "too few writes to mean anything: {writes}");
    assert!(
        resent > 0,
        "no write was resent: the scenario tested nothing"
    );
}

/// How long whatever a node held back may take to land once it is let go (long enough for
/// a write to reach the OSD and be done).
const SETTLE: Duration = Duration::from_secs(3);

/// The first GOOD through node `to` of a write whose attempt through node `from` started
/// within [`CUT`] after `t` and got no GOOD: how long after `t`.
fn first_resent_good(rec: &Record, from: u16, to: u16, t: Instant) -> Option<Duration> {
    rec.attempts
        .iter()
        .filter(|a| a.node == to && a.good)
        .filter(|a| {
            rec.attempts.iter().any(|b| {
                b.client == a.client
                    && b.seq == a.seq
                    && b.node == from
                    && !b.good
                    && b.start < t + CUT
                    && b.end > t
            })
        })
        .map(|a| a.end.saturating_duration_since(t))
        .min()
}

/// Median and largest write latency through node `n` of the writes that started in
/// `from..to`.
fn latency(rec: &Record, n: u16, from: Instant, to: Instant) -> Option<(Duration, Duration)> {
    let mut l: Vec<Duration> = rec
        .attempts
        .iter()
        .filter(|a| a.node == n && a.good && a.start >= from && a.start < to)
        .map(|a| a.end - a.start)
        .collect();
    l.sort_unstable();
    Some((*l.get(l.len() / 2)?, *l.last()?))
}

/// A scenario's start: its turn, two nodes serving a new image `image`, the clients writing
/// for two seconds.
fn begin(
    image: &str,
    give_up: GiveUp,
) -> Option<(
    std::sync::MutexGuard<'static, ()>,
    &'static World,
    Nodes<'static>,
    Clients,
)> {
    let w = world()?;
    let g = w.one_at_a_time.lock().unwrap_or_else(|p| p.into_inner());
    let nodes = Nodes::start(w, image);
    let clients = Clients::start(&w.net, give_up);
    std::thread::sleep(Duration::from_secs(2));
    Some((g, w, nodes, clients))
}

/// The end of a scenario in which node 1 was fenced: the run's checks, every block through
/// node 2, node 1 restarted, every block through it.
fn check_fenced_1(nodes: &mut Nodes, rec: &Record) {
    check_run(rec);
    check_blocks(nodes, 2, rec);
    nodes.restart(1);
    check_blocks(nodes, 1, rec);
}

// ---------------------------------------------------------------------------------------------
// The scenarios
// ---------------------------------------------------------------------------------------------

/// Node 1 stopped (SIGSTOP) for [`CUT`] with writes in flight: node 2 fences it once its
/// lease has run out, the clients' resent writes and the newer values go through node 2;
/// the clients stop, and only then node 1 continues: nothing it held may land (it finds
/// itself fenced, and must be restarted).
#[test]
fn a_paused_node_is_fenced_before_its_writes_could_overtake_newer_ones() {
    let Some((_one, _w, mut nodes, clients)) = begin("fence-pause", GiveUp::Close) else {
        return;
    };
    let t_pause = Instant::now();
    nodes.server(1).pause();
    let fenced = nodes.wait(2, Duration::from_secs(20), |v| peer_state(v, 1) == "fenced");
    std::thread::sleep(CUT.saturating_sub(t_pause.elapsed()));
    let rec = clients.finish();
    nodes.server(1).resume();
    // Node 1 learns it was fenced, and refuses to serve; what it held never lands.
    nodes.wait(1, Duration::from_secs(20), |v| v["health"] == "fenced");
    std::thread::sleep(SETTLE);
    let resent = first_resent_good(&rec, 1, 2, t_pause);
    let before = latency(&rec, 2, t_pause - Duration::from_secs(2), t_pause);
    let suspect = latency(&rec, 2, t_pause, t_pause + fenced);
    eprintln!(
        "node 1 paused: fenced by node 2 after {fenced:?}; first resent write GOOD through node 2 {resent:?} after the pause; \
         node 2 write latency (median, max) healthy {before:?}, while node 1 was suspect {suspect:?}"
    );
    assert!(resent.is_some(), "no write was resent through node 2");
    check_fenced_1(&mut nodes, &rec);
}

/// Node 1 cut off from the initiators only for [`CUT`]: it stays in the cluster (not
/// fenced), the clients give up on it and resend through node 2, then stop; when the link
/// comes back what their sockets still send reaches node 1 late — where it must not land.
/// Half the clients closed those sockets (whether their late bytes arrive before node 1's own
/// retransmissions meet a reset is a race); the other half keep them open and unread, so
/// their late writes always arrive, wait for a NOP-In answer that never comes, and are
/// refused.
#[test]
fn a_node_cut_off_from_the_initiators_lands_nothing_they_gave_up_on() {
    let Some((_one, w, nodes, clients)) = begin("fence-initiators", GiveUp::Mixed) else {
        return;
    };
    let t_cut = Instant::now();
    w.net.initiators(1, false);
    std::thread::sleep(CUT);
    let rec = clients.finish();
    w.net.initiators(1, true);
    // Long enough for the closed sockets' retransmissions (their timer has backed off to
    // a few seconds by now) to reach node 1.
    std::thread::sleep(Duration::from_secs(8));
    eprintln!(
        "node 1 cut off from the initiators: first resent write GOOD through node 2 {:?} after the cut",
        first_resent_good(&rec, 1, 2, t_cut)
    );
    // In touch with the cluster all along: nobody fenced it.
    let v = nodes.view(2).expect("node 2's view");
    assert_eq!(peer_state(&v, 1), "alive", "{v:#}");
    // What arrived late from the closed sockets waited for an answer to a NOP-In (and got a
    // reset from those sockets instead).
    let probes = nodes.counters(1)["liveness_probes"].as_u64().unwrap_or(0);
    eprintln!("node 1 held {probes} writes read after the silence for a NOP-In answer");
    assert!(
        probes > 0,
        "node 1 never held a write read after the silence"
    );
    check_run(&rec);
    for n in [1, 2] {
        check_blocks(&nodes, n, &rec);
    }
}

/// Node 1 cut off from Ceph only for [`CUT`]: node 2 fences it; the clients stop; what node
/// 1 had queued in librbd is refused by the OSD when the link comes back, and node 1 finds
/// itself fenced.
#[test]
fn a_node_cut_off_from_ceph_is_fenced_and_lands_nothing_after_newer_writes() {
    let Some((_one, w, mut nodes, clients)) = begin("fence-ceph", GiveUp::Close) else {
        return;
    };
    let t_cut = Instant::now();
    w.net.ceph(1, false);
    let fenced = nodes.wait(2, Duration::from_secs(20), |v| peer_state(v, 1) == "fenced");
    // Cut off, node 1's own lease lapses: it refuses writes rather than queue them.
    nodes.wait(1, Duration::from_secs(20), |v| v["health"] != "serving");
    std::thread::sleep(CUT.saturating_sub(t_cut.elapsed()));
    let rec = clients.finish();
    w.net.ceph(1, true);
    nodes.wait(1, Duration::from_secs(30), |v| v["health"] == "fenced");
    std::thread::sleep(SETTLE);
    eprintln!(
        "node 1 cut off from Ceph: fenced by node 2 after {fenced:?}; first resent write GOOD through node 2 {:?} after the cut",
        first_resent_good(&rec, 1, 2, t_cut)
    );
    check_fenced_1(&mut nodes, &rec);
}

/// Both nodes cut off from Ceph at once for [`CUT`] (the only way two nodes that talk
/// through the cluster lose each other): neither can fence the other, both stop
/// acknowledging; back in touch, at least one serves, they do not both end fenced, and
/// nothing goes back.
#[test]
fn two_nodes_cut_off_from_each_other_neither_both_fence_nor_both_serve_stale_data() {
    let Some((_one, w, mut nodes, clients)) = begin("fence-both", GiveUp::Close) else {
        return;
    };
    w.net.ceph(1, false);
    w.net.ceph(2, false);
    for n in [1, 2] {
        nodes.wait(n, Duration::from_secs(20), |v| v["health"] != "serving");
    }
    std::thread::sleep(CUT);
    for n in [1, 2] {
        let v = nodes.view(n).expect("a view");
        assert_eq!(v["fences"], 0, "node {n} fenced while cut off: {v:#}");
    }
    // The clients finish their values once a node acknowledges again.
    clients.stop();
    w.net.ceph(1, true);
    w.net.ceph(2, true);
    let t0 = Instant::now();
    let healths = loop {
        let h: Vec<String> = [1, 2]
            .map(|n| {
                nodes
                    .view(n)
                    .map(|v| v["health"].as_str().unwrap_or("").to_string())
                    .unwrap_or_default()
            })
            .to_vec();
        if h.iter().any(|s| s == "serving") && h.iter().all(|s| s == "serving" || s == "fenced") {
            break h;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "after the cut: {h:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "both nodes back in touch after {:?}: {healths:?}",
        t0.elapsed()
    );
    let rec = clients.finish();
    std::thread::sleep(SETTLE);
    check_run(&rec);
    for (n, h) in [1u16, 2].into_iter().zip(&healths) {
        if h == "fenced" {
            nodes.restart(n);
        }
    }
    for n in [1, 2] {
        check_blocks(&nodes, n, &rec);
    }
}
