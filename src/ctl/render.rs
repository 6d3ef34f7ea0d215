//! The tables `ironsan ctl` prints without `--json`, from the JSON views the control socket
//! answers with (crates/server/src/control/ and metrics.rs build those views).

use ironsan_server::control::Request;
use ironsan_server::metrics::STAGES;
use serde_json::Value;

/// Columns left-aligned, two spaces apart.
fn table(head: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<String>, out: &mut String| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                l.push_str(&format!("{c:<width$}  ", width = w[i]));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(head.iter().map(|s| s.to_string()).collect(), &mut out);
    for r in rows {
        line(r, &mut out);
    }
    out
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Bytes in binary units (`1.5 GiB`).
fn human_bytes(n: u64) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < U.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 {
        format!("{v:.0} {}", U[u])
    } else {
        format!("{v:.1} {}", U[u])
    }
}

fn render_sessions(v: &Value) -> String {
    let mut out = String::new();
    let empty = Vec::new();
    let list = v.as_array().unwrap_or(&empty);
    if list.is_empty() {
        return "no sessions\n".into();
    }
    for sess in list {
        out.push_str(&format!(
            "session TSIH {} ISID {}  {}  →  {}  ({} commands)\n",
            s(&sess["tsih"]),
            s(&sess["isid"]),
            s(&sess["initiator"]),
            sess["target"].as_str().unwrap_or("(discovery)"),
            s(&sess["commands"])
        ));
        for c in sess["connections"].as_array().unwrap_or(&empty) {
            let u = |k: &str| c[k].as_u64().unwrap_or(0);
            out.push_str(&format!(
                "  connection CID {} from {} on {}: in flight {}, reads {} ({}), writes {} ({}), other {}, rx {} ({}), tx {} ({}, {} zero-copy), digest errors {}\n",
                s(&c["cid"]), s(&c["peer"]), s(&c["portal"]), u("in_flight"),
                u("reads"), human_bytes(u("read_bytes")), u("writes"), human_bytes(u("write_bytes")),
                u("other_commands"), u("rx_pdus"), human_bytes(u("rx_bytes")),
                u("tx_pdus"), human_bytes(u("tx_bytes")), human_bytes(u("tx_zero_copy_bytes")),
                u("digest_errors"),
            ));
            let t = &c["tcp"];
            if t.is_object() {
                let g = |k: &str| t[k].as_u64().unwrap_or(0);
                out.push_str(&format!(
                    "    tcp: rtt {:.3} ms ± {:.3}, cwnd {}, ssthresh {}, retransmits {}, delivery rate {}/s, mss {}, congestion control {}\n",
                    g("rtt_us") as f64 / 1000.0,
                    g("rttvar_us") as f64 / 1000.0,
                    g("cwnd"),
                    if g("ssthresh") >= 0x7fff_ffff { "∞".to_string() } else { g("ssthresh").to_string() },
                    g("retransmits"),
                    human_bytes(g("delivery_rate")),
                    g("mss"),
                    t["congestion"].as_str().unwrap_or("?"),
                ));
            }
        }
        if let Some(p) = sess["params"].as_object() {
            let kv: Vec<String> = p.iter().map(|(k, v)| format!("{k}={}", s(v))).collect();
            out.push_str("  negotiated:");
            let mut col = 13;
            for item in kv {
                if col + item.len() + 1 > 100 {
                    out.push_str("\n             ");
                    col = 13;
                }
                out.push(' ');
                out.push_str(&item);
                col += item.len() + 1;
            }
            out.push('\n');
        }
    }
    out
}

fn render_cluster(v: &Value) -> String {
    let empty = Vec::new();
    let mut out = format!(
        "node {} ({}), pool {}, client {}: {}{}\n",
        s(&v["node"]),
        s(&v["name"]),
        s(&v["pool"]),
        s(&v["address"]),
        s(&v["health"]),
        v["reason"]
            .as_str()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    let join = |x: &Value, sep: &str| {
        x.as_array()
            .map(|a| a.iter().map(s).collect::<Vec<_>>().join(sep))
            .unwrap_or_default()
    };
    for t in v["targets"].as_array().unwrap_or(&empty) {
        out.push_str(&format!(
            "\n{} (object {})\n",
            s(&t["target"]),
            s(&t["object"])
        ));
        let rows = t["nodes"]
            .as_array()
            .unwrap_or(&empty)
            .iter()
            .map(|n| {
                let applied = n["applied"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .map(|(lun, serial)| format!("{lun}:{}", s(serial)))
                            .collect::<Vec<_>>()
                            .join(" ")
                    })
                    .unwrap_or_default();
                vec![
                    format!(
                        "{}{}",
                        s(&n["node"]),
                        if n["self"] == true { "*" } else { "" }
                    ),
                    s(&n["name"]),
                    s(&n["state"]),
                    join(&n["ports"], ","),
                    join(&n["portals"], " "),
                    match n["last_ack_ms"].as_u64() {
                        Some(ms) => format!("{:.1}s ago", ms as f64 / 1000.0),
                        None => "-".into(),
                    },
                    applied,
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "NODE",
                "NAME",
                "STATE",
                "PORTS",
                "PORTALS",
                "LAST ACK",
                "PR APPLIED (LUN:SERIAL)",
            ],
            rows,
        ));
        for l in t["luns"].as_array().unwrap_or(&empty) {
            out.push_str(&format!(
                "LUN {}: reservation record {}, PRgeneration {}\n",
                s(&l["lun"]),
                s(&l["serial"]),
                s(&l["pr_generation"])
            ));
        }
    }
    out
}

fn render_targets(v: &Value) -> String {
    let empty = Vec::new();
    let rows = v
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .map(|t| {
            let acl = t["acl"].as_array().map(|a| a.len()).unwrap_or(0);
            let auth = match (&t["chap"], &t["mutual_chap"]) {
                (Value::String(u), Value::String(m)) => format!("mutual CHAP ({u}/{m})"),
                (Value::String(u), _) => format!("CHAP ({u})"),
                _ => "none".into(),
            };
            vec![
                s(&t["name"]),
                s(&t["alias"]),
                s(&t["luns"]),
                s(&t["sessions"]),
                t["portal_groups"]
                    .as_array()
                    .map(|g| g.iter().map(s).collect::<Vec<_>>().join(","))
                    .unwrap_or_else(|| "all".into()),
                if acl == 0 {
                    "everyone".into()
                } else {
                    format!("{acl} rule(s)")
                },
                auth,
            ]
        })
        .collect();
    table(
        &[
            "TARGET", "ALIAS", "LUNS", "SESSIONS", "GROUPS", "ACL", "AUTH",
        ],
        rows,
    )
}

fn render_luns(v: &Value) -> String {
    let empty = Vec::new();
    let rows = v
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .map(|l| {
            vec![
                s(&l["target"]),
                s(&l["lun"]),
                s(&l["backend"]),
                s(&l["io_engine"]),
                human_bytes(l["size"].as_u64().unwrap_or(0)),
                s(&l["block_size"]),
                if l["read_only"] == true { "ro" } else { "rw" }.into(),
                if l["write_cache"] == true {
                    "on"
                } else {
                    "off"
                }
                .into(),
                s(&l["spec"]),
            ]
        })
        .collect();
    table(
        &[
            "TARGET", "LUN", "BACKEND", "ENGINE", "SIZE", "BS", "MODE", "WCE", "SPEC",
        ],
        rows,
    )
}

/// A duration in µs for people: `850 ns`, `12.3 µs`, `4.56 ms`, `1.20 s`.
fn human_us(us: f64) -> String {
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
fn render_stats(v: &Value) -> String {
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
            human_bytes(e["bytes"].as_u64().unwrap_or(0)),
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

/// The human form of a command's `data` (what `ironsan ctl` prints without `--json`).
pub(super) fn render(cmd: &Request, data: &Value) -> String {
    match cmd {
        Request::Sessions => render_sessions(data),
        Request::Targets => render_targets(data),
        Request::Luns { .. } => render_luns(data),
        Request::Stats { .. } => render_stats(data),
        Request::Cluster { cmd: None } => render_cluster(data),
        Request::Alua { cmd: None, .. } => {
            let empty = Vec::new();
            let rows = data
                .as_array()
                .unwrap_or(&empty)
                .iter()
                .map(|x| {
                    vec![
                        s(&x["target"]),
                        s(&x["group"]),
                        s(&x["state"]),
                        if x["preferred"] == true { "yes" } else { "" }.into(),
                        x["ports"]
                            .as_array()
                            .map(|a| a.iter().map(s).collect::<Vec<_>>().join(","))
                            .unwrap_or_default(),
                        x["portals"]
                            .as_array()
                            .map(|a| a.iter().map(s).collect::<Vec<_>>().join(" "))
                            .unwrap_or_default(),
                    ]
                })
                .collect();
            table(
                &["TARGET", "GROUP", "STATE", "PREF", "PORTS", "PORTALS"],
                rows,
            )
        }
        Request::Portals => {
            let empty = Vec::new();
            let rows = data
                .as_array()
                .unwrap_or(&empty)
                .iter()
                .map(|x| vec![s(&x["addr"]), s(&x["tag"]), s(&x["transport"])])
                .collect();
            table(&["PORTAL", "GROUP", "TRANSPORT"], rows)
        }
        Request::Show(_) => {
            let t = &data["target"];
            let mut out = format!(
                "target {}\n  alias: {}\n  ACL: {}\n  CHAP: {}  mutual CHAP: {}\n\n",
                s(&t["name"]),
                s(&t["alias"]),
                t["acl"]
                    .as_array()
                    .filter(|a| !a.is_empty())
                    .map(|a| a.iter().map(s).collect::<Vec<_>>().join(", "))
                    .unwrap_or_else(|| "everyone".into()),
                s(&t["chap"]),
                s(&t["mutual_chap"]),
            );
            out.push_str(&render_luns(&data["luns"]));
            out.push('\n');
            out.push_str(&render_sessions(&data["sessions"]));
            out
        }
        _ => match data.get("message").and_then(Value::as_str) {
            Some(m) => format!("{m}\n"),
            None => match data.get("text").and_then(Value::as_str) {
                Some(t) => t.to_string(),
                None => serde_json::to_string_pretty(data).unwrap_or_default() + "\n",
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ironsan_server::control::LunRequest;
    use serde_json::json;

    #[test]
    fn tables_show_what_the_views_hold() {
        let sessions = json!([{
            "tsih": 1, "isid": "0x023d00000001", "initiator": "iqn.2026-11.org.test:b",
            "target": "iqn.2026-11.org.test:t", "commands": 7, "type": "normal",
            "params": {"MaxBurstLength": "262144", "HeaderDigest": "None"},
            "connections": [{"cid": 0, "peer": "127.0.0.1:50000", "portal": "127.0.0.1:3260",
                "reads": 3, "read_bytes": 1536, "writes": 4, "write_bytes": 2048,
                "tcp": {"rtt_us": 1500, "rttvar_us": 250, "cwnd": 10, "ssthresh": 2147483647,
                        "congestion": "cubic"}}]
        }]);
        let t = render(&Request::Sessions, &sessions);
        assert!(t.contains("iqn.2026-11.org.test:b"), "{t}");
        assert!(t.contains("MaxBurstLength=262144"), "{t}");
        assert!(
            t.contains("rtt 1.500 ms") && t.contains("ssthresh ∞"),
            "{t}"
        );
        assert!(t.contains("reads 3 (1.5 KiB)"), "{t}");
        assert_eq!(render(&Request::Sessions, &json!([])), "no sessions\n");

        let luns = json!([{"target": "iqn.x:t", "lun": 0, "backend": "ram", "io_engine": "inline",
            "size": 1073741824u64, "block_size": 512, "read_only": false, "write_cache": true,
            "spec": "ram:1G,wce"}]);
        let t = render(&Request::Luns { target: None }, &luns);
        let mut lines = t.lines();
        assert!(
            lines
                .next()
                .unwrap()
                .starts_with("TARGET   LUN  BACKEND  ENGINE"),
            "{t}"
        );
        let row = lines.next().unwrap();
        assert!(
            row.contains("1 GiB") && row.contains(" rw ") && row.contains("on"),
            "{t}"
        );

        let alua = json!([{"target": "iqn.x:t", "group": 2, "state": "standby",
            "preferred": true, "ports": [2], "portals": ["127.0.0.1:3261"]}]);
        let t = render(
            &Request::Alua {
                target: None,
                cmd: None,
            },
            &alua,
        );
        assert!(
            t.starts_with("TARGET") && t.contains("standby") && t.contains("yes"),
            "{t}"
        );

        let portals = json!([{"addr": "127.0.0.1:3260", "tag": 1, "transport": "iscsi"}]);
        let t = render(&Request::Portals, &portals);
        assert_eq!(
            t,
            "PORTAL          GROUP  TRANSPORT\n127.0.0.1:3260  1      iscsi\n"
        );

        let stage = json!({"count": 4, "mean_us": 12.5, "p50_us": 10.0, "p99_us": 2500.0});
        let stages: serde_json::Map<String, Value> = STAGES
            .iter()
            .map(|s| (s.to_string(), stage.clone()))
            .collect();
        let stats = json!([{"target": "iqn.x:t", "lun": 0, "class": "write", "commands": 4,
            "bytes": 2048, "stages": stages},
            {"target": "iqn.x:t", "lun": 0, "class": "read", "commands": 0, "bytes": 0,
            "stages": {}}]);
        let t = render(&Request::Stats { target: None }, &stats);
        assert!(
            t.starts_with("iqn.x:t LUN 0 write: 4 commands, 2 KiB\n"),
            "{t}"
        );
        assert!(
            t.contains("backend") && t.contains("12.5 µs") && t.contains("2.50 ms"),
            "{t}"
        );
        assert!(!t.contains("read:"), "{t}");

        let msg = json!({"message": "iqn.x:t: LUN 1 added"});
        let cmd = Request::Lun(LunRequest::Remove {
            target: "t".into(),
            lun: 1,
        });
        assert_eq!(render(&cmd, &msg), "iqn.x:t: LUN 1 added\n");
    }
}
