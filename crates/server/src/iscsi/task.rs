//! What the driver keeps for a command until it ends: its [`Slot`] (its share of the session's
//! write buffer and its place in the connection's in-flight count) and, for a write waiting
//! for Data-Out, the [`PendingWrite`] the protocol core's transfer carries; per task in the
//! session's core, [`Running`]: what aborting it needs, and the [`Held`] work of a command
//! waiting behind a CmdSN gap (its task record is the one place it lives); a non-task PDU
//! waiting the same way is a [`HeldPdu`] in the session core's window. Below the session
//! and the connections, which both hold them (a kept connection's writes wait in the
//! session's [`crate::iscsi::session::Orphans`] for TASK REASSIGN).

use crate::counters::ConnStats;
use crate::iscsi::io;
use crate::lock;
use crate::metrics::Stamp;
use bytes::{Bytes, BytesMut};
use ironsan_proto::pdu::{Bhs, Header, ScsiCommand};
use ironsan_proto::DataSn;
use ironsan_scsi::Response;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What the server keeps per task to abort it.
#[derive(Debug)]
pub(crate) struct Running {
    /// The command's tokio task, if it has one (a command completing inline never has).
    pub abort: Option<tokio::task::AbortHandle>,
    /// While the command is polled inline by its connection's reader (before it has a task),
    /// this is set: an abort from another thread then waits for it (reads of the LU wait
    /// until the flag is clear, `LogicalUnit::task_aborted`).
    pub polling: Arc<AtomicBool>,
    /// A write received in place while it waits for its Data-Out: aborting the task empties
    /// this, which releases the blocks' range at once (not when its connection next reads).
    pub placed: Option<Arc<PlacedSlot>>,
    /// The command's work while it waits behind a CmdSN gap, taken when the session delivers
    /// it (dropped with the task if it is aborted or its connection goes first).
    pub parked: Option<Held>,
}

/// A command held behind a CmdSN gap, ready to run (or to fail) when it is delivered. Writes
/// still waiting for data are kept by the protocol core's connection instead.
#[derive(Debug)]
pub(crate) enum Held {
    Run {
        cmd: ScsiCommand,
        cdb: Bytes,
        data: Bytes,
        exp_data_sn: DataSn,
        slot: Slot,
        t_header: Stamp,
    },
    Fail {
        cmd: ScsiCommand,
        resp: Response,
        exp_data_sn: DataSn,
        slot: Slot,
    },
}

impl Held {
    pub(crate) fn itt(&self) -> ironsan_proto::pdu::Itt {
        match self {
            Held::Run { cmd, .. } | Held::Fail { cmd, .. } => cmd.itt,
        }
    }
}

/// A non-task PDU with a CmdSN that arrived ahead of a CmdSN gap, kept in the session core's
/// window until it is due.
#[derive(Debug)]
pub(crate) struct HeldPdu {
    pub bhs: Bhs,
    pub header: Header,
    pub data: Bytes,
}

/// A write received in place ([`ironsan_scsi::PlacedWrite`], holding its blocks' range) while
/// it waits for its Data-Out. Its connection puts bytes through it (`io::PlaceTarget`), each
/// put under the slot's lock; an abort from any task empties it, which drops the write and
/// its range, and no byte is put after that.
#[derive(Debug)]
pub(crate) struct PlacedSlot {
    grain: usize,
    write: Mutex<Option<ironsan_scsi::PlacedWrite>>,
}

impl PlacedSlot {
    pub(crate) fn new(p: ironsan_scsi::PlacedWrite) -> Self {
        PlacedSlot {
            grain: p.target().grain(),
            write: Mutex::new(Some(p)),
        }
    }

    /// The write, unless an abort took it.
    pub(crate) fn take(&self) -> Option<ironsan_scsi::PlacedWrite> {
        lock(&self.write).take()
    }
}

impl crate::iscsi::io::PlaceTarget for PlacedSlot {
    fn grain(&self) -> usize {
        self.grain
    }
    fn with<T>(
        &self,
        f: impl FnOnce(&ironsan_backend::InPlaceWrite) -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        match lock(&self.write).as_ref() {
            Some(p) => f(p.target()),
            None => Err(std::io::Error::other("the write was aborted")),
        }
    }
}

/// Bytes of a write counted against the session's `write_buffer_per_session`.
#[derive(Debug)]
pub(crate) struct WriteQuota {
    buffered: Arc<AtomicU64>,
    bytes: u64,
}

impl WriteQuota {
    pub(crate) fn try_new(buffered: &Arc<AtomicU64>, bytes: u64, limit: u64) -> Option<WriteQuota> {
        buffered
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                (cur + bytes <= limit).then_some(cur + bytes)
            })
            .ok()?;
        Some(WriteQuota {
            buffered: Arc::clone(buffered),
            bytes,
        })
    }
}

impl Drop for WriteQuota {
    fn drop(&mut self) {
        self.buffered.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// What a command holds until it completes or is dropped: its share of the session's write
/// quota, and, once delivered, its place in the connection's in-flight count.
#[derive(Debug)]
pub(crate) struct Slot {
    #[allow(dead_code)] // held for its Drop
    quota: Option<WriteQuota>,
    counted: Option<Arc<ConnStats>>,
}

impl Slot {
    pub(crate) fn new(quota: Option<WriteQuota>) -> Self {
        Slot {
            quota,
            counted: None,
        }
    }

    /// The session delivered the command: count it (once).
    pub(crate) fn deliver(&mut self, stats: &Arc<ConnStats>, cmd: &ScsiCommand) {
        if self.counted.is_none() {
            stats.command(cmd.read, cmd.write, cmd.expected_data_transfer_length);
            self.counted = Some(Arc::clone(stats));
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(s) = &self.counted {
            s.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// What the driver keeps for a write waiting for its Data-Out (the protocol core tracks the
/// transfer itself).
pub(crate) struct PendingWrite {
    pub(crate) cmd: ScsiCommand,
    pub(crate) cdb: Bytes,
    pub(crate) buf: BytesMut,
    /// The data goes straight into the medium instead of `buf` (see `conn::write::place_min`), a
    /// whole block at a time.
    pub(crate) placed: Option<(Arc<PlacedSlot>, io::Placement)>,
    /// Aborted while received in place (a task management function emptied its slot): the
    /// rest of its data is received and dropped, as a buffered write's is, and it ends with no
    /// response.
    pub(crate) discard: bool,
    pub(crate) slot: Slot,
    /// When the command's header was read (start of the "receive" stage).
    pub(crate) t_header: Stamp,
}
