//! # ironsan-proto: iSCSI (RFC 7143) with no I/O
//!
//! This crate owns every byte of the iSCSI wire protocol and every protocol state machine, and
//! touches neither sockets nor clocks: callers feed it bytes, PDUs and the current time, and get
//! back PDUs to send and decisions to act on (the quinn-proto / rustls model).
//!
//! * [`pdu`] — BHS/AHS codec with a two-stage decode (header → receive plan → payload).
//! * [`digest`] — CRC32C header and data digests (hardware-accelerated).
//! * [`serial`] — RFC 1982 serial arithmetic for CmdSN, StatSN, DataSN.
//! * [`intake`] — what a connection does with each PDU it reads in the full-feature phase:
//!   damaged headers, ExpStatSN, which PDUs take a CmdSN, Rejects before the CmdSN.
//! * [`text`] — text key=value segments (RFC 7143 §6).
//! * [`negotiate`] — table-driven operational key negotiation (RFC 7143 §13).
//! * [`login`] — the target's login state machine (RFC 7143 §6.3, §11.12).
//! * [`window`] — the session's CmdSN sequencer, holding commands that arrive ahead of a gap.
//! * [`session`] — the session-wide half of the full-feature phase: task table and connection
//!   allegiance, the connections of a session (several: MC/S), task management and logout rules.
//! * [`connection`] — the per-connection half: Data-Out reassembly, R2Ts, Text continuations,
//!   NOP-Out answers, the StatSN counter.
//! * [`keepalive`] — target NOP-In pings on virtual time.
//! * [`task`] — per-command data transfer arithmetic: R2T / Data-Out tracking, Data-In
//!   segmentation with status phase-collapse, the response PDUs of a command.
//! * [`recovery`] — the PDUs a connection retains at ErrorRecoveryLevel 1 and the SNACKs that
//!   ask for them again (RFC 7143 §11.16), the A bit and DataACK (§11.7.2).

pub mod chap;
pub mod connection;
pub mod digest;
pub mod intake;
pub mod keepalive;
pub mod login;
pub mod negotiate;
pub mod pdu;
pub mod recovery;
pub mod serial;
pub mod session;
pub mod task;
pub mod text;
pub mod window;

pub use pdu::{Bhs, Header, Pdu};
pub use serial::{CmdSn, DataSn, StatSn};
