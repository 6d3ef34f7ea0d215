//! # ironsan-proto: iSCSI (RFC 7143) with no I/O
//!
//! This crate owns every byte of the iSCSI wire protocol and every protocol state machine, and
//! touches neither sockets nor clocks: callers feed it bytes, PDUs and the current time, and get
//! back PDUs to send and decisions to act on (the quinn-proto / rustls model).
//!
//! * [`pdu`] — BHS/AHS codec with a two-stage decode (header → receive plan → payload).
//! * [`digest`] — CRC32C header and data digests (hardware-accelerated).
//! * [`serial`] — RFC 1982 serial arithmetic for CmdSN, StatSN, DataSN.
//! * [`text`] — text key=value segments (RFC 7143 §6).
//! * [`negotiate`] — table-driven operational key negotiation (RFC 7143 §13).
//! * [`login`] — the target's login state machine (RFC 7143 §6.3, §11.12).
//! * [`window`] — the session's CmdSN window, aware of several connections.
//! * [`task`] — per-command data transfer arithmetic: R2T / Data-Out reassembly, Data-In
//!   segmentation with status phase-collapse.

pub mod chap;
pub mod digest;
pub mod login;
pub mod negotiate;
pub mod pdu;
pub mod serial;
pub mod task;
pub mod text;
pub mod window;

pub use pdu::{Bhs, Header, Pdu};
pub use serial::{CmdSn, DataSn, StatSn};
