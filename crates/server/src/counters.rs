//! The counters the data path keeps for operations: per connection (relaxed atomics the
//! reader and writer bump) and server-wide (logins, digest errors, zero-copy bytes), and the
//! plain snapshots the control API hands out ([`ConnCounters`], [`Gauges`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// Per-connection counters the writer keeps.
#[derive(Debug, Default)]
pub struct TxStats {
    pub pdus: AtomicU64,
    pub bytes: AtomicU64,
    /// Of `bytes`, those sent straight from a file LUN's page cache (`sendfile`).
    pub zero_copy_bytes: AtomicU64,
    /// The server-wide total of `zero_copy_bytes` (for the metrics).
    pub server_zero_copy_bytes: Arc<AtomicU64>,
}

/// Per-connection counters, updated by the reader with relaxed atomics.
#[derive(Debug, Default)]
pub struct ConnStats {
    pub rx_pdus: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    /// Commands with no data (TEST UNIT READY, SYNCHRONIZE CACHE, …).
    pub other_cmds: AtomicU64,
    pub digest_errors: AtomicU64,
    /// SCSI commands admitted and not yet completed.
    pub in_flight: AtomicU64,
}

impl ConnStats {
    pub(crate) fn received(&self, bytes: usize) {
        self.rx_pdus.fetch_add(1, Relaxed);
        self.rx_bytes.fetch_add(bytes as u64, Relaxed);
    }
    pub(crate) fn command(&self, read: bool, write: bool, edtl: u32) {
        self.in_flight.fetch_add(1, Relaxed);
        let (n, b) = match (read, write) {
            (true, _) => (&self.reads, &self.read_bytes),
            (_, true) => (&self.writes, &self.write_bytes),
            _ => {
                self.other_cmds.fetch_add(1, Relaxed);
                return;
            }
        };
        n.fetch_add(1, Relaxed);
        b.fetch_add(u64::from(edtl), Relaxed);
    }
}

/// One connection's counters, labelled by its session (the metrics' per-connection series).
#[derive(Debug, Clone)]
pub struct ConnCounters {
    pub target: String,
    pub initiator: String,
    pub tsih: u16,
    pub cid: u16,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub reads: u64,
    pub writes: u64,
    pub other: u64,
    pub in_flight: u64,
}

/// Server-wide counters (logins, digest errors).
#[derive(Debug, Default)]
pub struct ServerStats {
    pub logins: AtomicU64,
    /// Failed logins by reason (a status name); rare, so a mutex is fine.
    pub login_failures: Mutex<BTreeMap<String, u64>>,
    pub digest_errors: AtomicU64,
    /// Writes to shared LUNs read after a silence that waited for a NOP-In answer (a cluster
    /// node: `conn::Probing`).
    pub probes: AtomicU64,
    /// Data-In bytes sent straight from file LUNs' page cache or as the zero page, every connection ever.
    pub zero_copy_bytes: Arc<AtomicU64>,
    /// Data-Out bytes received straight into file LUNs' pages (zero_copy_writes).
    pub zero_copy_write_bytes: AtomicU64,
    /// Error recovery (ErrorRecoveryLevels 1 and 2), by [`Recovery`] kind.
    pub recovery: [AtomicU64; Recovery::ALL.len()],
}

/// What error recovery did (RFC 7143 §7), counted server-wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// Lost Data-Out asked for again with a recovery R2T.
    R2t = 0,
    /// A PDU with a header digest error dropped (its connection went on).
    HeaderDropped,
    /// A SNACK answered (data, R2T, status, DataACK, R-Data).
    Snack,
    /// A SNACK refused with a Reject.
    SnackRefused,
    /// A connection kept for reassignment (ErrorRecoveryLevel 2): failed, logged out for
    /// recovery, or reinstated.
    ConnectionKept,
    /// A task moved to another connection by TASK REASSIGN.
    Reassigned,
    /// A task of a kept connection terminated because nothing reassigned it in time.
    Expired,
}

impl Recovery {
    pub const ALL: [Recovery; 7] = [
        Recovery::R2t,
        Recovery::HeaderDropped,
        Recovery::Snack,
        Recovery::SnackRefused,
        Recovery::ConnectionKept,
        Recovery::Reassigned,
        Recovery::Expired,
    ];

    /// The label of the metric and the key of `ctl counters`.
    pub fn name(self) -> &'static str {
        match self {
            Recovery::R2t => "recovery_r2t",
            Recovery::HeaderDropped => "header_dropped",
            Recovery::Snack => "snack",
            Recovery::SnackRefused => "snack_refused",
            Recovery::ConnectionKept => "connection_kept",
            Recovery::Reassigned => "task_reassigned",
            Recovery::Expired => "task_expired",
        }
    }
}

impl ServerStats {
    pub(crate) fn recovered(&self, kind: Recovery) {
        self.recovered_n(kind, 1);
    }

    pub(crate) fn recovered_n(&self, kind: Recovery, n: u64) {
        if let Some(c) = self.recovery.get(kind as usize) {
            c.fetch_add(n, Relaxed);
        }
    }

    /// (kind, count) of every kind of recovery.
    pub fn recoveries(&self) -> Vec<(&'static str, u64)> {
        Recovery::ALL
            .iter()
            .zip(&self.recovery)
            .map(|(k, c)| (k.name(), c.load(Relaxed)))
            .collect()
    }

    pub(crate) fn login_failed(&self, reason: &str) {
        *self
            .login_failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(reason.to_string())
            .or_default() += 1;
    }
}

/// Server-wide gauges and counters, as [`crate::control::Control::gauges`] reads them.
#[derive(Clone, Debug, Default)]
pub struct Gauges {
    pub connections: u64,
    pub sessions: u64,
    pub logins: u64,
    pub login_failures: BTreeMap<String, u64>,
    pub digest_errors: u64,
    pub probes: u64,
    pub zero_copy_bytes: u64,
    pub zero_copy_write_bytes: u64,
    /// (kind, count) of error recovery ([`Recovery`]).
    pub error_recovery: Vec<(&'static str, u64)>,
}
