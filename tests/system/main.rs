//! ironsan's system tests: `ironsan serve` (the release binary, `IRONSAN_BIN`) driven by real
//! clients, real Ceph clusters, crashes, power cuts and network namespaces.
//!
//! One test binary with a module per subject, not one binary per file: every test binary links
//! the whole program with the release profile's LTO, which took more of a CI run than the
//! tests themselves. Run one subject with a module filter, e.g.
//! `cargo test --release --test system rbd::`.

#[path = "../common/ceph.rs"]
mod ceph;
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/crash.rs"]
mod crash_harness;

mod clients;
mod crash;
mod fencing;
mod http;
mod powerfail;
mod rbd;
