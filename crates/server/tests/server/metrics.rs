//! The latency breakdown and the Prometheus listener: I/O with the test initiator, then a
//! scrape over TCP parsed line by line (HELP/TYPE, samples), counters moved by exactly the I/O
//! done, histogram buckets cumulative and ending with +Inf = count; and `ctl stats`.

use crate::support;
use bytes::Bytes;
use ironsan_backend::RamBackend;
use ironsan_initiator::{Client, LoginOptions};
use ironsan_scsi::{LogicalUnit, LuConfig};
use ironsan_server::control::NoHooks;
use ironsan_server::{Server, ServerConfig, TargetDef};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TARGET: &str = "iqn.2026-11.org.ironsan:metrics";

fn ram_lu(bytes: u64, seed: &str) -> Arc<LogicalUnit> {
    Arc::new(LogicalUnit::new(
        Arc::new(RamBackend::new(bytes)),
        LuConfig {
            naa: ironsan_scsi::local_naa(seed),
            ..Default::default()
        },
    ))
}

struct Running {
    iscsi: SocketAddr,
    metrics: SocketAddr,
    control: ironsan_server::control::Control,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start() -> Running {
    let mut scsi = ironsan_scsi::Target::new();
    scsi.add_lun(0, ram_lu(16 << 20, "metrics/0"));
    scsi.add_lun(1, ram_lu(16 << 20, "metrics/1"));
    let t = TargetDef {
        name: TARGET.into(),
        alias: None,
        max_connections: None,
        error_recovery_level: None,
        scsi: Arc::new(scsi),
    };
    let cfg = ServerConfig::new(vec!["127.0.0.1:0".parse().unwrap()], vec![t]);
    let server = Server::bind(cfg).await.unwrap();
    let iscsi = server.local_addrs()[0];
    let control = server.control();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = l.local_addr().unwrap();
    tokio::spawn(ironsan_server::http::serve(l, control.clone()));
    let tx = support::run_in_background(server);
    Running {
        iscsi,
        metrics,
        control,
        _stop: tx,
    }
}

/// One raw HTTP request; returns (status line, headers, body).
async fn http(addr: SocketAddr, request: &[u8]) -> (String, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .expect("scrape timed out")
        .unwrap();
    let text = String::from_utf8(buf).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("no end of head");
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (status.to_string(), headers.to_string(), body.to_string())
}

/// A parsed exposition: samples by (name, labels without `le` order issues) and families.
#[derive(Default)]
struct Scrape {
    /// name → TYPE
    types: HashMap<String, String>,
    helps: HashMap<String, String>,
    /// (name, sorted labels) → value, in file order too
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let eq = s[i..].find('=').expect("label without =") + i;
        let key = s[i..eq].to_string();
        assert!(
            key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "bad label name {key:?}"
        );
        assert_eq!(b[eq + 1], b'"', "label value not quoted in {s}");
        let mut j = eq + 2;
        let mut val = String::new();
        while b[j] != b'"' {
            if b[j] == b'\\' {
                j += 1;
                val.push(match b[j] {
                    b'n' => '\n',
                    c => c as char,
                });
            } else {
                val.push(b[j] as char);
            }
            j += 1;
        }
        out.insert(key, val);
        i = j + 1;
        if i < b.len() {
            assert_eq!(b[i], b',', "labels not comma-separated in {s}");
            i += 1;
        }
    }
    out
}

fn parse(body: &str) -> Scrape {
    let mut sc = Scrape::default();
    for line in body.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect("HELP without text");
            assert!(!help.is_empty());
            assert!(
                sc.helps.insert(name.into(), help.into()).is_none(),
                "HELP twice for {name}"
            );
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE without kind");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            assert!(
                !sc.samples.iter().any(|(n, _, _)| n == name),
                "TYPE after samples of {name}"
            );
            assert!(sc.types.insert(name.into(), kind.into()).is_none());
            continue;
        }
        assert!(!line.starts_with('#'), "unexpected comment {line}");
        let (series, value) = line.rsplit_once(' ').expect("sample without value");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
        };
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, parse_labels(l.strip_suffix('}').expect("unclosed {"))),
            None => (series, BTreeMap::new()),
        };
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name {name:?}"
        );
        let family = if sc.types.contains_key(name) {
            name
        } else {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name)
        };
        assert!(
            sc.types.contains_key(family) && sc.helps.contains_key(family),
            "sample of {name} without HELP/TYPE"
        );
        sc.samples.push((name.to_string(), labels, value));
    }
    sc
}

impl Scrape {
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.samples
            .iter()
            .find(|(n, l, _)| n == name && *l == want)
            .map(|x| x.2)
            .unwrap_or_else(|| panic!("no sample {name}{labels:?}"))
    }

    /// Check every histogram series: `le` ascending, cumulative, +Inf last and = _count.
    /// Returns how many series were checked.
    fn check_histograms(&self) -> usize {
        let mut series: BTreeMap<BTreeMap<String, String>, Vec<(f64, f64)>> = BTreeMap::new();
        for (n, l, v) in &self.samples {
            if n == "ironsan_command_latency_seconds_bucket" {
                let mut key = l.clone();
                let le = key.remove("le").expect("bucket without le");
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                series.entry(key).or_default().push((le, *v));
            }
        }
        for (key, buckets) in &series {
            assert_eq!(buckets.len(), 26, "{key:?}");
            for w in buckets.windows(2) {
                assert!(w[0].0 < w[1].0, "le not ascending in {key:?}");
                assert!(w[0].1 <= w[1].1, "buckets not cumulative in {key:?}");
            }
            let last = buckets.last().unwrap();
            assert!(last.0.is_infinite(), "last bucket is not +Inf in {key:?}");
            let labels: Vec<(&str, &str)> =
                key.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let count = self.get("ironsan_command_latency_seconds_count", &labels);
            assert_eq!(last.1, count, "+Inf != _count in {key:?}");
            let sum = self.get("ironsan_command_latency_seconds_sum", &labels);
            assert!(sum >= 0.0 && (count > 0.0 || sum == 0.0), "{key:?}");
        }
        series.len()
    }
}

async fn scrape(addr: SocketAddr) -> Scrape {
    let (status, headers, body) = http(
        addr,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n",
    )
    .await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        headers
            .to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{headers}"
    );
    let len: usize = headers
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length: ")
                .map(|v| v.parse().unwrap())
        })
        .expect("no Content-Length");
    assert_eq!(len, body.len());
    parse(&body)
}

/// Run until the command answers without a unit attention (power-on reset and the like);
/// returns how many TEST UNIT READY commands it sent.
async fn settle(c: &mut Client, lun: u64) -> u64 {
    for n in 1..=5 {
        let r = c.command(lun, &[0; 6], None, 0).await.unwrap();
        if r.status == 0 {
            return n;
        }
    }
    panic!("LUN {lun} keeps failing TEST UNIT READY");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_counts_io_and_histograms_are_consistent() {
    let srv = start().await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.initiator_name = "iqn.2026-11.org.test:metrics".into();
    let mut c = Client::login(srv.iscsi, &o).await.unwrap();
    let n0 = settle(&mut c, 0).await as f64;
    let n1 = settle(&mut c, 1).await as f64;

    let lbl = |lun: &'static str, class: &'static str| {
        [("target", TARGET), ("lun", lun), ("class", class)]
    };
    // The writer records a command just after its write returned, which may be a moment
    // after the initiator saw the answer: wait until the settling commands are all counted,
    // or the last of them would be counted again in the differences below.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let before = loop {
        let s = scrape(srv.metrics).await;
        let o0 = s.get("ironsan_commands_total", &lbl("0", "other"));
        let o1 = s.get("ironsan_commands_total", &lbl("1", "other"));
        if o0 == n0 && o1 == n1 {
            break s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "settling commands counted {o0}/{o1}, sent {n0}/{n1}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let b_w = before.get("ironsan_commands_total", &lbl("0", "write"));
    let b_r = before.get("ironsan_commands_total", &lbl("0", "read"));
    let b_o = before.get("ironsan_commands_total", &lbl("0", "other"));
    let b_o1 = before.get("ironsan_commands_total", &lbl("1", "other"));
    let b_wb = before.get(
        "ironsan_bytes_total",
        &[("target", TARGET), ("lun", "0"), ("direction", "write")],
    );
    let b_rb = before.get(
        "ironsan_bytes_total",
        &[("target", TARGET), ("lun", "0"), ("direction", "read")],
    );
    assert_eq!(before.get("ironsan_sessions", &[]), 1.0);
    assert!(before.get("ironsan_connections", &[]) >= 1.0);
    assert!(
        before.get(
            "ironsan_logins_total",
            &[("result", "success"), ("reason", "")]
        ) >= 1.0
    );
    assert!(before.get("process_cpu_seconds_total", &[]) >= 0.0);
    assert!(before.get("process_resident_memory_bytes", &[]) > 1e6);
    assert_eq!(before.get("ironsan_digest_errors_total", &[]), 0.0);

    // 12 writes of 8 KiB, 7 reads of 4 KiB, 3 TEST UNIT READY on LUN 0; 2 on LUN 1; and
    // commands to a LUN that does not exist (no series for it).
    const W: u64 = 12;
    const R: u64 = 7;
    for i in 0..W {
        let data = Bytes::from(vec![i as u8; 8192]);
        let r = c.write16(0, i * 16, data, 512, false).await.unwrap();
        assert_eq!(r.status, 0);
    }
    for i in 0..R {
        let r = c.read16(0, i * 16, 8, 512).await.unwrap();
        assert_eq!(r.status, 0);
        assert_eq!(r.data.len(), 4096);
    }
    for _ in 0..3 {
        assert_eq!(c.command(0, &[0; 6], None, 0).await.unwrap().status, 0);
    }
    for _ in 0..2 {
        assert_eq!(c.command(1, &[0; 6], None, 0).await.unwrap().status, 0);
    }
    let r = c.command(9, &[0; 6], None, 0).await.unwrap();
    assert_ne!(r.status, 0);

    // Poll briefly for the same reason as above.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let after = loop {
        let s = scrape(srv.metrics).await;
        let done = s.get("ironsan_commands_total", &lbl("0", "other")) - b_o == 3.0
            && s.get("ironsan_commands_total", &lbl("1", "other")) - b_o1 == 2.0
            && s.get("ironsan_commands_total", &lbl("0", "write")) - b_w == W as f64
            && s.get("ironsan_commands_total", &lbl("0", "read")) - b_r == R as f64;
        if done || tokio::time::Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        after.get("ironsan_commands_total", &lbl("0", "write")) - b_w,
        W as f64
    );
    assert_eq!(
        after.get("ironsan_commands_total", &lbl("0", "read")) - b_r,
        R as f64
    );
    assert_eq!(
        after.get("ironsan_commands_total", &lbl("0", "other")) - b_o,
        3.0
    );
    assert_eq!(
        after.get("ironsan_commands_total", &lbl("1", "other")) - b_o1,
        2.0
    );
    assert_eq!(
        after.get(
            "ironsan_bytes_total",
            &[("target", TARGET), ("lun", "0"), ("direction", "write")]
        ) - b_wb,
        (W * 8192) as f64
    );
    assert_eq!(
        after.get(
            "ironsan_bytes_total",
            &[("target", TARGET), ("lun", "0"), ("direction", "read")]
        ) - b_rb,
        (R * 4096) as f64
    );
    assert!(
        !after
            .samples
            .iter()
            .any(|(_, l, _)| l.get("lun").is_some_and(|x| x == "9")),
        "a LUN that does not exist got a series"
    );
    assert_eq!(after.types["ironsan_command_latency_seconds"], "histogram");
    assert_eq!(after.types["ironsan_commands_total"], "counter");
    assert_eq!(after.types["ironsan_sessions"], "gauge");

    // Histograms: 2 LUNs × 3 classes × 6 stages, each consistent; every stage of the writes
    // counted every write; the total is at least the backend time.
    assert_eq!(after.check_histograms(), 2 * 3 * 6);
    let h = |class: &'static str, stage: &'static str, what: &str| {
        after.get(
            &format!("ironsan_command_latency_seconds_{what}"),
            &[
                ("target", TARGET),
                ("lun", "0"),
                ("class", class),
                ("stage", stage),
            ],
        )
    };
    let writes = after.get("ironsan_commands_total", &lbl("0", "write"));
    for stage in ["receive", "queue", "backend", "respond", "send", "total"] {
        assert_eq!(h("write", stage, "count"), writes, "{stage}");
    }
    assert!(h("write", "total", "sum") >= h("write", "backend", "sum"));
    assert!(h("write", "total", "sum") > 0.0);
    let parts: f64 = ["receive", "queue", "backend", "respond", "send"]
        .iter()
        .map(|s| h("read", s, "sum"))
        .sum();
    let total = h("read", "total", "sum");
    assert!(
        (parts - total).abs() <= total * 1e-6 + 1e-6,
        "stages do not add up: {parts} vs {total}"
    );

    // ctl stats: the same numbers, and a table.
    let v = srv
        .control
        .dispatch_words(&NoHooks, &["stats".to_string(), TARGET.to_string()])
        .unwrap();
    let w = v
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["lun"] == 0 && e["class"] == "write")
        .unwrap();
    assert_eq!(w["commands"].as_u64().unwrap() as f64, writes, "{w}");
    assert_eq!(
        w["stages"]["backend"]["count"].as_u64().unwrap() as f64,
        writes
    );
    let p50 = w["stages"]["total"]["p50_us"].as_f64().unwrap();
    let p99 = w["stages"]["total"]["p99_us"].as_f64().unwrap();
    assert!(p50 > 0.0 && p50 <= p99, "{w}");
    assert!(srv
        .control
        .dispatch_words(&NoHooks, &["stats".to_string(), "iqn.nope:x".to_string()])
        .is_err());

    c.logout().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_listener_serves_metrics_and_the_status_page_and_nothing_else() {
    let srv = start().await;
    let (status, headers, body) = http(srv.metrics, b"GET / HTTP/1.1\r\n\r\n").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        headers
            .to_ascii_lowercase()
            .contains("content-type: text/html"),
        "{headers}"
    );
    assert!(body.contains("api/status"), "{body}");
    let (status, _, body) = http(srv.metrics, b"GET /nothing HTTP/1.1\r\n\r\n").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    assert!(body.contains("/metrics"));
    let (status, headers, _) = http(srv.metrics, b"POST /metrics HTTP/1.1\r\n\r\n").await;
    assert_eq!(status, "HTTP/1.1 405 Method Not Allowed");
    assert!(
        headers.to_ascii_lowercase().contains("allow: get,head"),
        "{headers}"
    );
    let (status, headers, body) = http(srv.metrics, b"HEAD /metrics HTTP/1.1\r\n\r\n").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        body.is_empty() && headers.to_ascii_lowercase().contains("content-length"),
        "{headers}"
    );
    // A request head that never ends is cut off at 8 KiB.
    let mut big = b"GET /metrics HTTP/1.1\r\n".to_vec();
    big.extend(std::iter::repeat_n(b'x', 20_000));
    let mut s = tokio::net::TcpStream::connect(srv.metrics).await.unwrap();
    let _ = s.write_all(&big).await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    assert!(
        String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 431"),
        "{:?}",
        String::from_utf8_lossy(&buf)
    );
    // A fresh target with no I/O still exports every LUN, at zero.
    let sc = scrape(srv.metrics).await;
    assert_eq!(sc.check_histograms(), 2 * 3 * 6);
    assert_eq!(
        sc.get(
            "ironsan_commands_total",
            &[("target", TARGET), ("lun", "1"), ("class", "read")]
        ),
        0.0
    );
}

/// Each connection of a session with several (MC/S) has series of its own, labelled by the
/// session's TSIH and the connection's CID; the commands each carried add up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_of_a_session_has_its_own_series() {
    let srv = start().await;
    let mut o = LoginOptions::new(Some(TARGET));
    o.initiator_name = "iqn.2026-11.org.test:mcs-metrics".into();
    o.max_connections = 2;
    let mut a = Client::login(srv.iscsi, &o).await.unwrap();
    settle(&mut a, 0).await;
    let mut b = Client::join(srv.iscsi, &o, &a, 1).await.unwrap();
    for i in 0..5u64 {
        let r = b.read16(0, i * 8, 8, 512).await.unwrap();
        assert_eq!(r.status, 0);
    }
    a.cmd_sn = b.cmd_sn;
    for i in 0..3u64 {
        let r = a
            .write16(0, i * 8, Bytes::from(vec![7u8; 4096]), 512, false)
            .await
            .unwrap();
        assert_eq!(r.status, 0);
    }
    let tsih = a.tsih.0.to_string();
    let who = |cid: &'static str, class: &'static str| {
        [
            ("target", TARGET.to_string()),
            ("initiator", o.initiator_name.clone()),
            ("tsih", tsih.clone()),
            ("cid", cid.to_string()),
            ("class", class.to_string()),
        ]
    };
    let s = scrape(srv.metrics).await;
    let get = |cid, class| {
        let l = who(cid, class);
        let l: Vec<(&str, &str)> = l.iter().map(|(k, v)| (*k, v.as_str())).collect();
        s.get("ironsan_connection_commands_total", &l)
    };
    assert_eq!(get("1", "read"), 5.0);
    assert_eq!(get("0", "write"), 3.0);
    assert_eq!(get("1", "write"), 0.0);
    assert_eq!(s.types["ironsan_connection_bytes_total"], "counter");
    assert_eq!(s.types["ironsan_connection_commands_in_flight"], "gauge");
}
