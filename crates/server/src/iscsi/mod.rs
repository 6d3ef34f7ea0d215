//! The iSCSI transport: the driver of the sans-IO core in `ironsan-proto`. Everything here
//! is iSCSI's own — logins, sessions and their connections (MC/S), PDU framing and I/O, the
//! per-connection writer, the per-command records, the fairness control between a
//! session's connections — and sits on what any block-storage transport shares, in the crate
//! root: the runtime and its shared state, the listening portals (each with its transport),
//! the LU registry and access rules, the control plane, counters and metrics, the cluster.
//! A second transport (NVMe/TCP) goes beside this module, not inside it (docs/ARCHITECTURE.md,
//! "A second transport").
//!
//! Layering inside, bottom up: `io` (framing, receive buffer, placement, send batches),
//! `fair`, `writer`, `task`, `session`, `conn`.

pub(crate) mod conn;
pub mod fair;
pub mod io;
pub(crate) mod session;
pub(crate) mod task;
pub(crate) mod writer;
