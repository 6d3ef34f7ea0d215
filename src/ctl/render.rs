//! The tables `ironsan ctl` prints without `--json`, from the views the control socket
//! answers with (`ironsan_server::control::views`: the same types the server builds).

use ironsan_server::control::views::{
    AluaGroupView, ClusterView, LunView, PortalView, SessionView, StatsView, TargetDetailView,
    TargetView,
};
use ironsan_server::control::Request;
use ironsan_server::metrics::STAGES;
use serde::de::DeserializeOwned;
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

fn render_sessions(list: &[SessionView]) -> String {
    if list.is_empty() {
        return "no sessions\n".into();
    }
    let mut out = String::new();
    for sess in list {
        out.push_str(&format!(
            "session TSIH {} ISID {}  {}  →  {}  ({} commands)\n",
            sess.tsih,
            sess.isid,
            sess.initiator,
            sess.target.as_deref().unwrap_or("(discovery)"),
            sess.commands
        ));
        for c in &sess.connections {
            out.push_str(&format!(
                "  connection CID {} from {} on {}: in flight {}, reads {} ({}), writes {} ({}), other {}, rx {} ({}), tx {} ({}, {} zero-copy), digest errors {}\n",
                c.cid, c.peer, c.portal, c.in_flight,
                c.reads, human_bytes(c.read_bytes), c.writes, human_bytes(c.write_bytes),
                c.other_commands, c.rx_pdus, human_bytes(c.rx_bytes),
                c.tx_pdus, human_bytes(c.tx_bytes), human_bytes(c.tx_zero_copy_bytes),
                c.digest_errors,
            ));
            if let Some(t) = &c.tcp {
                out.push_str(&format!(
                    "    tcp: rtt {:.3} ms ± {:.3}, cwnd {}, ssthresh {}, retransmits {}, delivery rate {}/s, mss {}, congestion control {}\n",
                    f64::from(t.rtt_us) / 1000.0,
                    f64::from(t.rttvar_us) / 1000.0,
                    t.cwnd,
                    if t.ssthresh >= 0x7fff_ffff { "∞".to_string() } else { t.ssthresh.to_string() },
                    t.retransmits,
                    human_bytes(t.delivery_rate),
                    t.mss,
                    t.congestion.as_deref().unwrap_or("?"),
                ));
            }
        }
        if !sess.params.is_empty() {
            out.push_str("  negotiated:");
            let mut col = 13;
            for (k, v) in &sess.params {
                let item = format!("{k}={v}");
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

fn or_dash(v: Option<&str>) -> String {
    v.unwrap_or("-").to_string()
}

fn joined<T: ToString>(items: &[T], sep: &str) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(sep)
}

fn render_cluster(v: &ClusterView) -> String {
    let mut out = format!(
        "node {} ({}), pool {}, client {}: {}{}\n",
        v.node,
        v.name,
        v.pool,
        v.address,
        v.health,
        v.reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    for t in &v.targets {
        out.push_str(&format!("\n{} (object {})\n", t.target, t.object));
        let rows = t
            .nodes
            .iter()
            .map(|n| {
                let applied = n
                    .applied
                    .iter()
                    .map(|(lun, serial)| format!("{lun}:{serial}"))
                    .collect::<Vec<_>>()
                    .join(" ");
                vec![
                    format!("{}{}", n.node, if n.is_self { "*" } else { "" }),
                    n.name.clone(),
                    n.state.clone(),
                    joined(&n.ports, ","),
                    joined(&n.portals, " "),
                    match n.last_ack_ms {
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
        for l in &t.luns {
            out.push_str(&format!(
                "LUN {}: reservation record {}, PRgeneration {}\n",
                l.lun, l.serial, l.pr_generation
            ));
        }
    }
    out
}

fn render_targets(list: &[TargetView]) -> String {
    let rows = list
        .iter()
        .map(|t| {
            let auth = match (&t.chap, &t.mutual_chap) {
                (Some(u), Some(m)) => format!("mutual CHAP ({u}/{m})"),
                (Some(u), None) => format!("CHAP ({u})"),
                _ => "none".into(),
            };
            vec![
                t.name.clone(),
                or_dash(t.alias.as_deref()),
                t.luns.to_string(),
                t.sessions.to_string(),
                t.portal_groups
                    .as_deref()
                    .map(|g| joined(g, ","))
                    .unwrap_or_else(|| "all".into()),
                if t.acl.is_empty() {
                    "everyone".into()
                } else {
                    format!("{} rule(s)", t.acl.len())
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

fn render_luns(list: &[LunView]) -> String {
    let rows = list
        .iter()
        .map(|l| {
            vec![
                l.target.clone(),
                l.lun.to_string(),
                l.backend.clone(),
                or_dash(l.io_engine.as_deref()),
                human_bytes(l.size),
                l.block_size.to_string(),
                if l.read_only { "ro" } else { "rw" }.into(),
                if l.write_cache { "on" } else { "off" }.into(),
                or_dash(l.spec.as_deref()),
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

/// `ctl stats`: one block per target/LUN/class that saw commands.
fn render_stats(list: &[StatsView]) -> String {
    let mut out = String::new();
    for e in list.iter().filter(|e| e.commands > 0) {
        out.push_str(&format!(
            "{} LUN {} {}: {} commands, {}\n",
            e.target,
            e.lun,
            e.class,
            e.commands,
            human_bytes(e.bytes),
        ));
        out.push_str(&format!(
            "  {:<8} {:>10} {:>10} {:>10}\n",
            "STAGE", "MEAN", "P50", "P99"
        ));
        for st in STAGES {
            let s = e.stages.get(st).cloned().unwrap_or_default();
            out.push_str(&format!(
                "  {:<8} {:>10} {:>10} {:>10}\n",
                st,
                human_us(s.mean_us),
                human_us(s.p50_us),
                human_us(s.p99_us)
            ));
        }
    }
    if out.is_empty() {
        out.push_str("no commands yet\n");
    }
    out
}

fn render_alua(list: &[AluaGroupView]) -> String {
    let rows = list
        .iter()
        .map(|x| {
            vec![
                x.target.clone(),
                x.group.to_string(),
                x.state.clone(),
                if x.preferred { "yes" } else { "" }.into(),
                joined(&x.ports, ","),
                joined(&x.portals, " "),
            ]
        })
        .collect();
    table(
        &["TARGET", "GROUP", "STATE", "PREF", "PORTS", "PORTALS"],
        rows,
    )
}

fn render_portals(list: &[PortalView]) -> String {
    let rows = list
        .iter()
        .map(|x| vec![x.addr.clone(), x.tag.to_string(), x.transport.clone()])
        .collect();
    table(&["PORTAL", "GROUP", "TRANSPORT"], rows)
}

fn render_target(d: &TargetDetailView) -> String {
    let t = &d.target;
    let mut out = format!(
        "target {}\n  alias: {}\n  ACL: {}\n  CHAP: {}  mutual CHAP: {}\n\n",
        t.name,
        or_dash(t.alias.as_deref()),
        if t.acl.is_empty() {
            "everyone".into()
        } else {
            t.acl.join(", ")
        },
        or_dash(t.chap.as_deref()),
        or_dash(t.mutual_chap.as_deref()),
    );
    out.push_str(&render_luns(&d.luns));
    out.push('\n');
    out.push_str(&render_sessions(&d.sessions));
    out
}

/// Read `data` as the view `V` and print it with `f`; an answer that is not that view (a
/// server of another version) is printed as JSON, after saying so.
fn typed<V: DeserializeOwned>(data: &Value, f: impl FnOnce(&V) -> String) -> String {
    match V::deserialize(data) {
        Ok(v) => f(&v),
        Err(e) => format!(
            "(the server's answer is not the expected view: {e})\n{}\n",
            serde_json::to_string_pretty(data).unwrap_or_default()
        ),
    }
}

/// The human form of a command's `data` (what `ironsan ctl` prints without `--json`).
pub(super) fn render(cmd: &Request, data: &Value) -> String {
    match cmd {
        Request::Sessions => typed(data, |v: &Vec<SessionView>| render_sessions(v)),
        Request::Targets => typed(data, |v: &Vec<TargetView>| render_targets(v)),
        Request::Luns { .. } => typed(data, |v: &Vec<LunView>| render_luns(v)),
        Request::Stats { .. } => typed(data, |v: &Vec<StatsView>| render_stats(v)),
        Request::Cluster { cmd: None } => typed(data, render_cluster),
        Request::Alua { cmd: None, .. } => typed(data, |v: &Vec<AluaGroupView>| render_alua(v)),
        Request::Portals => typed(data, |v: &Vec<PortalView>| render_portals(v)),
        Request::Show(_) => typed(data, render_target),
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
        // An answer that is not the view says so and still shows what came.
        let odd = render(&Request::Sessions, &json!({"sessions": 3}));
        assert!(
            odd.starts_with("(the server's answer is not the expected view")
                && odd.contains("\"sessions\": 3"),
            "{odd}"
        );
        // What the server builds reads back as itself.
        let built = vec![SessionView {
            tsih: 9,
            target: None,
            ..Default::default()
        }];
        let t = render(&Request::Sessions, &serde_json::to_value(&built).unwrap());
        assert!(
            t.starts_with("session TSIH 9 ") && t.contains("(discovery)"),
            "{t}"
        );

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
