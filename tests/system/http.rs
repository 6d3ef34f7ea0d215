//! The HTTP listener of `ironsan serve --metrics` with real clients: Prometheus' own checker
//! (`promtool check metrics`, Debian package `prometheus`) on a scrape taken under load, and
//! the status page loaded by headless Chromium while a libiscsi session is logged in.

use crate::common;
use common::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// serve with a RAM LUN, the metrics listener on a free port, and a libiscsi session reading
/// from it until dropped.
fn serve_with_session() -> (Server, SocketAddr, Background) {
    let maddr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let m = maddr.to_string();
    let s = Server::start(&["--lun", "ram:64M", "--metrics", &m]);
    let mut perf = Background::spawn("iscsi-perf", &[&s.url(0)]);
    perf.wait_for_stdout("iops current", Duration::from_secs(15));
    (s, maddr, perf)
}

#[test]
fn metrics_pass_promtool_check_metrics_under_load() {
    if !require_tools(&["promtool", "iscsi-perf"]) {
        return;
    }
    let (_s, maddr, _perf) = serve_with_session();
    let (code, body) = http_get(maddr, "/metrics");
    assert_eq!(code, 200, "{body}");
    for family in [
        "ironsan_commands_total{",
        "ironsan_command_latency_seconds_bucket{",
        "ironsan_connection_bytes_total{",
        "ironsan_sessions 1",
        "ironsan_lun_info{",
    ] {
        assert!(body.contains(family), "no {family} in:\n{body}");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("metrics.txt");
    std::fs::write(&file, &body).unwrap();
    let out = run_unchecked(
        "sh",
        &[
            "-c",
            &format!("promtool check metrics < {}", file.display()),
        ],
        Duration::from_secs(60),
    );
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}",
        show(&out)
    );
}

#[test]
fn status_page_shows_a_live_session_in_chromium_without_console_errors() {
    let Some(chromium) = which("chromium").or_else(|| which("chromium-browser")) else {
        require_tool("chromium");
        return;
    };
    if !require_tool("iscsi-perf") {
        return;
    }
    let (s, maddr, _perf) = serve_with_session();
    let (code, api) = http_get(maddr, "/api/status");
    assert_eq!(code, 200, "{api}");
    let v: serde_json::Value = serde_json::from_str(&api).unwrap();
    let initiator = v["sessions"][0]["initiator"]
        .as_str()
        .unwrap_or_else(|| panic!("no session in /api/status: {api}"))
        .to_string();
    assert_eq!(http_get(maddr, "/nothing-here").0, 404);

    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile");
    let url = format!("http://{maddr}/");
    let args = [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",
        &format!("--user-data-dir={}", profile.display()),
        "--dump-dom",
        &url,
    ];
    let started = Instant::now();
    let out = run_unchecked(chromium.to_str().unwrap(), &args, Duration::from_secs(120));
    assert!(out.status.success(), "chromium failed:\n{}", show(&out));
    let dom = String::from_utf8_lossy(&out.stdout);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        dom.contains("data-state=\"ok\""),
        "the page did not render the status (after {:?}):\n{dom}\n{log}",
        started.elapsed()
    );
    assert!(dom.contains("data-sessions=\"1\""), "{dom}");
    assert!(
        dom.contains(&initiator),
        "the session's initiator is not shown:\n{dom}"
    );
    assert!(dom.contains(&s.target), "{dom}");
    assert!(dom.contains("ram:67108864"), "the LUN is not shown:\n{dom}");
    assert!(
        dom.contains("MaxBurstLength="),
        "no negotiated keys:\n{dom}"
    );
    let errors: Vec<&str> = log
        .lines()
        .filter(|l| (l.contains("CONSOLE") || l.contains("Uncaught")) && !l.contains(":INFO:"))
        .collect();
    assert!(errors.is_empty(), "console errors:\n{}", errors.join("\n"));
}

/// contrib/grafana/ironsan-dashboard.json: every query parses as PromQL (`promtool check
/// rules`), and every metric and every label it groups by exists in a real scrape.
#[test]
fn grafana_dashboard_uses_only_metrics_that_exist() {
    if !require_tools(&["promtool", "iscsi-perf"]) {
        return;
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/contrib/grafana/ironsan-dashboard.json"
    );
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let exprs: Vec<String> = dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    assert!(exprs.len() >= 10, "{exprs:?}");

    // PromQL syntax, through Prometheus' own parser.
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yml");
    let mut y = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        y.push_str(&format!(
            "      - record: dashboard:panel_{i}\n        expr: '{}'\n",
            e.replace('\'', "''")
        ));
    }
    std::fs::write(&rules, y).unwrap();
    let out = run_unchecked(
        "promtool",
        &["check", "rules", rules.to_str().unwrap()],
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", show(&out));

    // Metric and label names, against a scrape with a session doing I/O.
    let (_s, maddr, _perf) = serve_with_session();
    let (_, body) = http_get(maddr, "/metrics");
    let mut labels: std::collections::HashMap<String, std::collections::HashSet<String>> =
        Default::default();
    // Families declared with no series now (e.g. backend operations in flight, which only RBD
    // LUNs count) exist too; their labels are checked where series exist.
    for line in body.lines() {
        if let Some(name) = line
            .strip_prefix("# TYPE ")
            .and_then(|r| r.split(' ').next())
        {
            labels.entry(name.to_string()).or_default();
        }
    }
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name_end = line.find(['{', ' ']).unwrap();
        let set = labels.entry(line[..name_end].to_string()).or_default();
        if let Some(inner) = line[name_end..].strip_prefix('{') {
            for kv in inner.split("\",") {
                if let Some((k, _)) = kv.split_once('=') {
                    set.insert(k.trim_start_matches(',').to_string());
                }
            }
        }
    }
    let ident = |s: &str, at: usize| -> String {
        s[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for e in &exprs {
        let mut used = Vec::new();
        for (at, _) in e
            .match_indices("ironsan_")
            .chain(e.match_indices("process_"))
        {
            let name = ident(e, at);
            assert!(
                labels.contains_key(&name),
                "the dashboard uses {name}, which /metrics does not have (query: {e})"
            );
            used.push(name);
        }
        for (at, _) in e.match_indices("by (") {
            let inner = &e[at + 4..at + 4 + e[at + 4..].find(')').unwrap()];
            for l in inner.split(',').map(str::trim) {
                let with_series: Vec<&String> =
                    used.iter().filter(|m| !labels[*m].is_empty()).collect();
                assert!(
                    with_series.is_empty() || with_series.iter().any(|m| labels[*m].contains(l)),
                    "no metric of '{e}' has the label {l}"
                );
            }
        }
    }
}
