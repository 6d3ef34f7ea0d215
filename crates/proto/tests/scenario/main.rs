//! In-memory scenario tests of the sans-IO core on virtual time, in quinn-proto's `Pair`
//! style: a test target built only from the core's public pieces, a test initiator that
//! builds PDUs, and one in-memory link per connection carrying encoded PDUs (every PDU goes
//! through `ironsan_proto::pdu`'s encoder and its two-stage decoder). No sockets, threads or
//! clocks: the test moves PDUs (`Pair::deliver_to_target`, `deliver_to_initiator`, `run`), loses
//! them in transit (`lose_to_initiator`, `lose_to_target`), reorders them across connections
//! (by choosing which link delivers first), cuts connections (`cut`: what is in transit is
//! lost), completes commands when it likes (`Target::defer`, `complete`), and advances the
//! virtual millisecond clock (`advance`).
//!
//! # The target's driving order (that of `crates/server/src/iscsi/conn/`)
//!
//! For every PDU read on a connection (`Target::receive`, the server's `on_pdu`):
//! 1. decode the BHS and bound the data segment by MaxRecvDataSegmentLength
//!    (`Bhs::plan`), then `Intake::header`: the ExpStatSN it carries → `Retained::ack`;
//! 2. `Intake::route`: Command / DataOut / Sequenced / Now / Reject;
//! 3. a command: `Intake::command` (PDU faults, Rejected before the CmdSN), then
//!    `Session::admit_command` (Deliver, Held, Ignore, Reject, Ended); a new tag lets go of
//!    what kept connections hold for it; a write: `Connection::begin_write`, then run at
//!    once (all data here), `insert_write` (waits for Data-Out) or hold (behind a gap: the
//!    command's work is parked in its task record, `Session::task_mut`);
//! 4. a Data-Out: `Connection::data_out` (NoTask → Reject, Refused → Reject + CHECK
//!    CONDITION, Accept → the payload into the buffer; a damaged one → `data_damaged`),
//!    then `after_data` → Complete → run;
//! 5. a sequenced PDU: `Session::admit_pdu` (Now, or Held in the session's window until
//!    `Event::DeliverPdu` hands it back, or Ignore),
//!    then NOP-Out → `connection::nop_in`; TMF → `Intake::reassigns` ? `Session::reassign`
//!    (+ `take_write`/`adopt_write`, `Retained::reassign`, parked responses,
//!    `recovery::refit_data_in`) : `Session::task_management` (aborted tasks dropped);
//!    Logout → `Session::logout` → `LogoutPlan`, then `intake::logout_response`; SNACK →
//!    `Retained::ack` + `Retained::snack` (Resend, DataAcked, NotRetained →
//!    `Connection::resend_r2ts`, refused → Reject);
//! 6. then, for every connection, `Session::poll_event` until empty (Deliver → run the held
//!    command parked in its task record, else `deliver_write`; Drop → forget its write;
//!    DeliverPdu → step 5 now), and the R2Ts
//!    of `Connection::poll_r2t` are sent.
//!
//! Running a command: `Session::claim` (none: aborted, never runs), execute on the disk now
//! or when the test says, `Session::remove` (none: a TMF or the session took it, no
//! response), `task::response_pdus`, sent on the connection it came on, or parked if that
//! connection is kept for reassignment (and forwarded if it was reassigned meanwhile).
//! Sending (the writer): `recovery::mark_ack` at level ≥ 1, `StatSnCounter::stamp` with the
//! session's window (`SnMode::Resend` keeps the StatSN), `Retained::record`.
//! A connection that ends (`Target::teardown`): at level 2 if failed, its delivered writes
//! (`take_where`) and its `Retained` are kept and its running commands go on; otherwise its
//! running commands are aborted; then `Session::leave_for_recovery` or `Session::leave`.
//! Time: `Session::expire` when `next_expiry` has come.
//!
//! # What is not modelled
//!
//! Sockets, framing across reads, digests (a data digest error is injected:
//! `Target::damage_next_data_out`), login (sessions are built from chosen parameters),
//! Text, keepalive pings, SCSI beyond READ(10)/WRITE(10)/TEST UNIT READY (an aborted
//! command never reaches the disk here), other sessions (a LUN RESET's reach beyond this
//! one), and the server's pacing, batching, quotas and zero-copy paths.

mod initiator;
mod pair;
mod target;
mod wire;

mod cmdsn;
mod erl1;
mod erl2;
mod logout;
mod tmf;
