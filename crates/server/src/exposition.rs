//! The Prometheus exposition of `GET /metrics`: every family, read from the live counters and
//! latency histograms when scraped, encoded in the text format 0.0.4 by `prometheus-client`.
//!
//! The data path keeps its own lock-free counters and log2 histograms ([`crate::metrics`]):
//! `prometheus-client`'s `Histogram` takes a lock on every observation, which the command path
//! must not pay. The crate is used for what it fits: a [`Collector`] reads the counters at
//! scrape time and hands them to the crate's encoder, which writes the names, HELP and TYPE
//! lines, label escaping, `_total` suffixes and histogram buckets.

use crate::control::Control;
use crate::counters::ConnCounters;
use crate::counters::Gauges;
use crate::metrics::{Class, BUCKETS, STAGES};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::fmt::Error;
use std::sync::atomic::Ordering::Relaxed;

/// The `Content-Type` of the exposition.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The whole exposition (text format 0.0.4).
pub fn prometheus(control: &Control) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Families(control.clone())));
    let mut out = String::with_capacity(64 << 10);
    // Writing into a String fails only if a collector does; ours do not.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
    out
}

/// Labels of one series.
type Labels<'a> = Vec<(&'static str, String)>;

/// Every family ironsan exports, read at scrape time.
#[derive(Debug)]
struct Families(Control);

/// `le` of finite bucket `i` in seconds (2^i µs).
fn le_seconds(i: usize) -> f64 {
    (1u64 << i) as f64 / 1e6
}

fn counter<V: EncodeCounterValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (Labels<'static>, V)>,
) -> Result<(), Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in series {
        m.encode_family(&labels)?
            .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
    }
    Ok(())
}

fn gauge<V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (Labels<'static>, V)>,
) -> Result<(), Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in series {
        m.encode_family(&labels)?.encode_gauge(&v)?;
    }
    Ok(())
}

fn conn_labels(c: &ConnCounters) -> Labels<'static> {
    vec![
        ("target", c.target.clone()),
        ("initiator", c.initiator.clone()),
        ("tsih", c.tsih.to_string()),
        ("cid", c.cid.to_string()),
    ]
}

impl Collector for Families {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), Error> {
        let control = &self.0;
        if let Some(node) = control.cluster() {
            encode_cluster(&mut enc, node)?;
        }
        encode_luns(&mut enc, control)?;
        encode_alua(&mut enc, control)?;
        let g = control.gauges();
        encode_connections(&mut enc, control, &g)?;
        encode_server(&mut enc, &g)?;
        encode_process(&mut enc)
    }
}

fn count(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn lun_labels(t: &str, lun: u64) -> Labels<'static> {
    vec![("target", t.to_string()), ("lun", lun.to_string())]
}

/// This cluster node: its lease, the write gate, its view of the other nodes.
fn encode_cluster(
    enc: &mut DescriptorEncoder,
    node: &crate::cluster::ClusterNode,
) -> Result<(), Error> {
    gauge(
        enc,
        "ironsan_cluster_serving",
        "1 while this cluster node is in touch with the cluster and its lease holds; 0 when it is partitioned, suspended (lease lapsed) or fenced and its target port groups are unavailable",
        [(vec![("node", node.node().to_string())], i64::from(node.serving()))],
    )?;
    gauge(
        enc,
        "ironsan_cluster_node_up",
        "1 for each node of the cluster whose lease holds in this node's view (its target port group is active), 0 for one whose does not (unavailable)",
        node.node_states().into_iter().map(|(t, n, up)| {
            (vec![("target", t), ("node", n.to_string())], i64::from(up))
        }),
    )?;
    let me = || vec![("node", node.node().to_string())];
    let m = node.lease_metrics();
    gauge(
        enc,
        "ironsan_cluster_lease_remaining_seconds",
        "How long this node's lease still holds (0: lapsed: it starts no write to a shared LUN)",
        [(me(), m.lease_seconds)],
    )?;
    gauge(
        enc,
        "ironsan_cluster_write_gate_open",
        "1 while every other node's lease holds or it is fenced (writes to shared LUNs start), 0 while one is pending or suspect (they wait)",
        [(me(), i64::from(m.gate_open))],
    )?;
    gauge(
        enc,
        "ironsan_cluster_peer_state",
        "1 for the state each other node is in, in this node's view (pending, alive, suspect, fenced)",
        m.peers.iter().flat_map(|(n, state, _)| {
            ["pending", "alive", "suspect", "fenced"].into_iter().map(move |s| {
                (
                    vec![("peer", n.to_string()), ("state", s.to_string())],
                    i64::from(s == *state),
                )
            })
        }),
    )?;
    gauge(
        enc,
        "ironsan_cluster_peer_lease_remaining_seconds",
        "How long each other node's lease still holds in this node's view",
        m.peers
            .iter()
            .map(|(n, _, l)| (vec![("peer", n.to_string())], *l)),
    )?;
    gauge(
        enc,
        "ironsan_cluster_writes_waiting",
        "Commands that change a shared medium waiting for the write gate now",
        [(me(), m.waiting as i64)],
    )?;
    counter(
        enc,
        "ironsan_cluster_writes_held",
        "Commands that waited for the write gate (a node pending or suspect)",
        [(me(), m.waited)],
    )?;
    counter(
        enc,
        "ironsan_cluster_write_hold_seconds",
        "Time commands spent waiting for the write gate, in all",
        [(me(), m.waited_seconds)],
    )?;
    counter(
        enc,
        "ironsan_cluster_writes_refused",
        "Commands that change a shared medium refused (this node's lease had lapsed, or the gate stayed closed)",
        [(me(), m.refused)],
    )?;
    counter(
        enc,
        "ironsan_cluster_fences",
        "Other nodes this node fenced (blocklisted)",
        [(me(), m.fences)],
    )?;
    Ok(())
}

/// Per LUN: commands, bytes, the latency of each stage, what it is and its backend's queue.
fn encode_luns(enc: &mut DescriptorEncoder, control: &Control) -> Result<(), Error> {
    let luns = control.lun_metrics(None).unwrap_or_default();
    counter(
        enc,
        "ironsan_commands",
        "SCSI commands completed (response written), per target, LUN and class",
        luns.iter().flat_map(|(t, lun, m)| {
            Class::ALL.into_iter().map(move |c| {
                let mut l = lun_labels(t, *lun);
                l.push(("class", c.name().to_string()));
                (l, m.classes[c as usize].commands.load(Relaxed))
            })
        }),
    )?;
    counter(
        enc,
        "ironsan_bytes",
        "Data bytes moved by completed commands: read = Data-In sent, write = Data-Out received",
        luns.iter().flat_map(|(t, lun, m)| {
            [Class::Read, Class::Write].into_iter().map(move |c| {
                let mut l = lun_labels(t, *lun);
                l.push(("direction", c.name().to_string()));
                (l, m.classes[c as usize].bytes.load(Relaxed))
            })
        }),
    )?;

    {
        let mut h = enc.encode_descriptor(
        "ironsan_command_latency_seconds",
        "Time per stage of a command: receive (header to data complete), queue (to SCSI execute), backend (SCSI and backend), respond (response built and queued), send (queued to written), total",
        None,
        MetricType::Histogram,
    )?;
        for (t, lun, m) in &luns {
            for c in Class::ALL {
                for (stage, hist) in STAGES.iter().zip(&m.classes[c as usize].stages) {
                    let s = hist.snapshot();
                    let mut l = lun_labels(t, *lun);
                    l.push(("class", c.name().to_string()));
                    l.push(("stage", stage.to_string()));
                    // The encoder writes the buckets cumulatively and adds +Inf with `count`.
                    let buckets: Vec<(f64, u64)> =
                        (0..BUCKETS).map(|i| (le_seconds(i), s.counts[i])).collect();
                    h.encode_family(&l)?.encode_histogram::<NoLabelSet>(
                        s.sum_ns as f64 / 1e9,
                        s.count(),
                        &buckets,
                        None,
                    )?;
                }
            }
        }
    }

    let inventory = control.lun_inventory();
    gauge(
        enc,
        "ironsan_lun_info",
        "Every LUN (value 1), with its backend and device (the spec's first part: rbd:POOL/IMAGE, file:PATH, ram:SIZE, ...)",
        inventory.iter().map(|(t, lun, kind, device, _)| {
            let mut l = lun_labels(t, *lun);
            l.push(("backend", kind.to_string()));
            l.push(("device", device.clone()));
            (l, 1)
        }),
    )?;
    gauge(
        enc,
        "ironsan_backend_operations_in_flight",
        "Operations a LUN's backend has handed to its storage and not yet seen complete (RBD: in librbd)",
        inventory.iter().filter_map(|(t, lun, kind, _, n)| {
            let mut l = lun_labels(t, *lun);
            l.push(("backend", kind.to_string()));
            Some((l, i64::try_from((*n)?).unwrap_or(i64::MAX)))
        }),
    )?;
    Ok(())
}

/// The state of every ALUA target port group.
fn encode_alua(enc: &mut DescriptorEncoder, control: &Control) -> Result<(), Error> {
    let mut alua = Vec::new();
    for name in control.target_names() {
        let Ok((_, groups)) = control.port_groups(&name) else {
            continue;
        };
        for g in groups {
            for st in ironsan_scsi::AccessState::ALL {
                let l = vec![
                    ("target", name.clone()),
                    ("group", g.id.to_string()),
                    ("state", st.name().to_string()),
                ];
                alua.push((l, i64::from(g.state == st)));
            }
        }
    }
    gauge(
        enc,
        "ironsan_alua_group_state",
        "ALUA target port groups: 1 for the state each group is in, 0 for the others (state: active/optimized, active/non-optimized, standby, unavailable, offline, transitioning)",
        alua,
    )?;
    Ok(())
}

/// Sessions and connections now, and each connection's counters.
fn encode_connections(
    enc: &mut DescriptorEncoder,
    control: &Control,
    g: &Gauges,
) -> Result<(), Error> {
    let n = count;
    gauge(
        enc,
        "ironsan_sessions",
        "Sessions (normal and discovery) now",
        [(vec![], n(g.sessions))],
    )?;
    gauge(
        enc,
        "ironsan_connections",
        "TCP connections open now",
        [(vec![], n(g.connections))],
    )?;
    let conns = control.connection_counters();
    counter(
        enc,
        "ironsan_connection_bytes",
        "Bytes received and sent on each connection of each session (several per session with MC/S)",
        conns.iter().flat_map(|c| {
            [("rx", c.rx_bytes), ("tx", c.tx_bytes)].map(|(d, v)| {
                let mut l = conn_labels(c);
                l.push(("direction", d.to_string()));
                (l, v)
            })
        }),
    )?;
    counter(
        enc,
        "ironsan_connection_commands",
        "SCSI commands received on each connection, by class",
        conns.iter().flat_map(|c| {
            [("read", c.reads), ("write", c.writes), ("other", c.other)].map(|(k, v)| {
                let mut l = conn_labels(c);
                l.push(("class", k.to_string()));
                (l, v)
            })
        }),
    )?;
    gauge(
        enc,
        "ironsan_connection_commands_in_flight",
        "SCSI commands delivered on each connection and not yet completed",
        conns.iter().map(|c| (conn_labels(c), n(c.in_flight))),
    )?;
    Ok(())
}

/// The server's own counters: logins, digest errors, probes, error recovery, zero copy.
fn encode_server(enc: &mut DescriptorEncoder, g: &Gauges) -> Result<(), Error> {
    counter(
        enc,
        "ironsan_logins",
        "Logins by result; failures by reason",
        std::iter::once((
            vec![("result", "success".to_string()), ("reason", String::new())],
            g.logins,
        ))
        .chain(g.login_failures.iter().map(|(reason, v)| {
            (
                vec![
                    ("result", "failure".to_string()),
                    ("reason", reason.to_string()),
                ],
                *v,
            )
        })),
    )?;
    counter(
        enc,
        "ironsan_digest_errors",
        "Header and data digest (CRC32C) errors",
        [(vec![], g.digest_errors)],
    )?;
    counter(
        enc,
        "ironsan_liveness_probes",
        "Writes to shared LUNs read after a silence on their connection that waited for the initiator to answer a NOP-In first",
        [(vec![], g.probes)],
    )?;
    counter(
        enc,
        "ironsan_error_recovery",
        "Error recovery (ErrorRecoveryLevels 1 and 2), by kind: recovery_r2t (lost Data-Out asked for again), header_dropped (a PDU with a header digest error dropped), snack (a SNACK answered), snack_refused (a SNACK rejected), connection_kept (a failed connection's tasks kept for reassignment), task_reassigned (a task moved by TASK REASSIGN), task_expired (a kept task not reassigned in time)",
        g.error_recovery
            .iter()
            .map(|(kind, v)| (vec![("kind", kind.to_string())], *v)),
    )?;
    counter(
        enc,
        "ironsan_zero_copy_read_bytes",
        "Data-In bytes sent straight from file LUNs' page cache (sendfile, or a mapping of a tmpfs file) or as the kernel's zero page (reads of nothing stored in RAM and NULL LUNs); zero_copy_reads",
        [(vec![], g.zero_copy_bytes)],
    )?;
    counter(
        enc,
        "ironsan_zero_copy_write_bytes",
        "Data-Out bytes received straight into file LUNs' pages (zero_copy_writes)",
        [(vec![], g.zero_copy_write_bytes)],
    )?;
    Ok(())
}

/// The process's CPU time and resident memory.
fn encode_process(enc: &mut DescriptorEncoder) -> Result<(), Error> {
    let (cpu, rss) = process_stats();
    if let Some(cpu) = cpu {
        let mut m = enc.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            MetricType::Counter,
        )?;
        m.encode_counter::<NoLabelSet, _, u64>(&cpu, None)?;
    }
    if let Some(rss) = rss {
        gauge(
            enc,
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            [(vec![], count(rss))],
        )?;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_bounds_are_powers_of_two_microseconds() {
        assert_eq!(le_seconds(0).to_string(), "0.000001");
        assert_eq!(le_seconds(1).to_string(), "0.000002");
        assert_eq!(le_seconds(24).to_string(), "16.777216");
    }
}
