//! The server over real sockets, in-process: protocol, MC/S, recovery, ALUA, the control
//! socket, metrics, security, faults and zero-copy paths, each a module of one test binary
//! (every test binary links the whole server with the release profile's LTO; one binary
//! instead of one per subject keeps that cost once). `hostile.rs` stays a binary of its own:
//! it measures this process's file descriptors and RSS, which other subjects' tests running
//! beside it would disturb. Run one subject with a module filter, e.g.
//! `cargo test -p ironsan-server --test server recovery::`.

#[path = "../support/mod.rs"]
mod support;

mod abort_order;
mod alua;
mod control;
mod faults;
mod mcs;
mod metrics;
mod portal_groups;
mod protocol;
mod reassign;
mod recovery;
mod security;
mod zero_copy;
