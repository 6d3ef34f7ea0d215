//! A connection's writer: the only place that assigns StatSN and stamps ExpCmdSN/MaxCmdSN
//! (RFC 7143 §4.2.2.2, §11.4.8), under one lock, so numbers always go out in write order. The
//! reader writes its own batch directly when the writer is idle ([`Writer::try_direct`]); the
//! writer task drains its queue (responses of commands that became tasks, pings, login) and
//! sends everything ready in one vectored write, and alone waits for a full socket.

use crate::counters::TxStats;
use crate::iscsi::io::{Digests, WriteBatch};
use crate::metrics::{Stamp, Timing};
use bytes::Bytes;
use ironsan_proto::pdu::{Header, Pdu, StatSnCounter};
use ironsan_proto::{CmdSn, StatSn};
use ironsan_scsi::DataIn;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::mpsc;

pub(crate) use ironsan_proto::pdu::SnMode;

/// One PDU for the writer. Its data segment is in memory, or (a read's Data-In with no data
/// digest) a range of a file LUN's backing file that the batch sends with `sendfile`.
#[derive(Debug)]
pub(crate) struct OutPdu {
    pub header: Header,
    pub data: DataIn,
    pub mode: SnMode,
}

impl OutPdu {
    pub(crate) fn status(header: Header, data: Bytes) -> Self {
        OutPdu {
            header,
            data: DataIn::Memory(data),
            mode: SnMode::Status,
        }
    }
    pub(crate) fn current(header: Header, data: Bytes) -> Self {
        OutPdu {
            header,
            data: DataIn::Memory(data),
            mode: SnMode::Current,
        }
    }
}

/// Messages to the writer, processed in order.
#[derive(Debug)]
pub(crate) enum Out {
    /// PDUs sent back to back (e.g. a read's Data-In and its status).
    Pdus(Vec<OutPdu>),
    /// A SCSI command's response (Data-In and/or status), optionally holding part of the
    /// connection's transmit budget (returned once written), with the command's stage stamps: once the write that carries the status has returned,
    /// the writer stamps "written" and records the stages (see [`crate::metrics`]).
    Command {
        pdus: Vec<OutPdu>,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
        timing: Option<Timing>,
    },
    /// From now on, stamp sequence numbers from this session's window.
    Attach(SnWindow),
    /// From now on, use these digests (set after the final login response).
    Digests(Digests),
    /// Flush and close the socket after everything before this message.
    Close,
    /// From now on the reader may write its batches itself ([`Writer::try_direct`]).
    Direct,
    /// A direct write left bytes unwritten: finish them.
    Kick,
    /// Several of the above, in order (what a connection's reader produced in one go).
    Batch(Vec<Out>),
}

impl Out {
    /// Bytes of data segments carried (to size batches).
    pub(crate) fn data_len(&self) -> usize {
        match self {
            Out::Pdus(pdus) | Out::Command { pdus, .. } => pdus.iter().map(|p| p.data.len()).sum(),
            Out::Batch(v) => v.iter().map(Out::data_len).sum(),
            _ => 0,
        }
    }
}

/// What a connection at ErrorRecoveryLevel 1 keeps of what it sent, for SNACKs
/// ([`ironsan_proto::recovery`]); the writer fills it as it stamps, the reader empties it.
pub(crate) type Retained = ironsan_proto::recovery::Retained<
    std::hash::BuildHasherDefault<ironsan_backend::int_map::IntHasher>,
>;

/// Stamp sequence numbers on `pdus` and add them to the batch (and, at ErrorRecoveryLevel 1,
/// to what the connection keeps: Data-In marked for DataACK first, RFC 7143 §11.7.2).
fn push(
    pdus: Vec<OutPdu>,
    batch: &mut WriteBatch,
    stat_sn: &mut StatSnCounter,
    window: &Option<SnWindow>,
    digests: Digests,
    stats: &TxStats,
    retained: Option<&Mutex<Retained>>,
) {
    let mut kept = retained.map(|r| crate::lock(r));
    for mut p in pdus {
        let window = window.as_ref().map(SnWindow::get);
        if kept.is_some() && p.mode != SnMode::Resend {
            ironsan_proto::recovery::mark_ack(&mut p.header);
        }
        stat_sn.stamp(&mut p.header, p.mode, window);
        if let Some(kept) = kept.as_mut().filter(|_| p.mode != SnMode::Resend) {
            // What is kept must be the bytes sent (a file range is read now; the connection
            // asks for none at this level).
            if let DataIn::File(range) = &p.data {
                match range.to_bytes() {
                    Ok(data) => p.data = DataIn::Memory(data),
                    Err(e) => {
                        batch.fail(e);
                        continue;
                    }
                }
            }
            if let DataIn::Memory(data) = &p.data {
                kept.record(&p.header, data, p.mode == SnMode::Status);
            }
        }
        match p.data {
            DataIn::Memory(data) => {
                let pdu = Pdu::new(p.header, data);
                let bhs = pdu.bhs();
                batch.push(&bhs, pdu.data, digests);
            }
            DataIn::File(range) => {
                let mut bhs = p.header.encode();
                bhs.set_lengths(0, range.len as u32);
                if digests.data {
                    // The digest needs the bytes in memory (the connection does not ask for
                    // file ranges with a data digest; this keeps the writer right regardless).
                    match range.to_bytes() {
                        Ok(data) => batch.push(&bhs, data, digests),
                        Err(e) => batch.fail(e),
                    }
                } else {
                    batch.push_file(&bhs, range, digests);
                }
            }
        }
        stats
            .pdus
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A session's (ExpCmdSN, MaxCmdSN) as one word the session stores after every change of its
/// window and the writers of its connections read for every PDU they stamp, with no lock.
#[derive(Clone, Debug, Default)]
pub(crate) struct SnWindow(Arc<AtomicU64>);

impl SnWindow {
    pub(crate) fn get(&self) -> (CmdSn, CmdSn) {
        let w = self.0.load(Ordering::Acquire);
        (CmdSn((w >> 32) as u32), CmdSn(w as u32))
    }

    pub(crate) fn set(&self, (exp, max): (CmdSn, CmdSn)) {
        self.0.store(
            (u64::from(exp.0) << 32) | u64::from(max.0),
            Ordering::Release,
        );
    }
}

/// What the writer keeps between writes: the StatSN counter, the window of the session it
/// stamps, the digests, and the encoded bytes not yet written with what waits for them.
struct WriterState {
    stat_sn: StatSnCounter,
    window: Option<SnWindow>,
    digests: Digests,
    batch: WriteBatch,
    /// Transmit budget of reads in the batch, returned once it is written.
    held: Vec<tokio::sync::OwnedSemaphorePermit>,
    /// Stage stamps of the commands whose status is in the batch.
    timed: Vec<Timing>,
    /// The writer task has handled [`Out::Direct`]: every login-time message (Attach,
    /// Digests) is behind us, so the reader may write its own batches.
    direct: bool,
}

impl WriterState {
    /// Stamp and encode PDUs or a command's response; other messages (only the writer task
    /// handles them) come back.
    fn add(
        &mut self,
        msg: Out,
        stats: &TxStats,
        retained: &std::sync::OnceLock<Arc<Mutex<Retained>>>,
    ) -> Option<Out> {
        let (pdus, permit, timing) = match msg {
            Out::Pdus(pdus) => (pdus, None, None),
            Out::Command {
                pdus,
                permit,
                timing,
            } => (pdus, permit, timing),
            other => return Some(other),
        };
        push(
            pdus,
            &mut self.batch,
            &mut self.stat_sn,
            &self.window,
            self.digests,
            stats,
            retained.get().map(|r| &**r),
        );
        self.held.extend(permit);
        self.timed.extend(timing);
        None
    }

    /// Write what the socket takes now; `true` once the batch is all written (its read
    /// budget returned and its commands' stages recorded).
    fn try_write(&mut self, sock: &OwnedWriteHalf, stats: &TxStats) -> std::io::Result<bool> {
        let (len, file_len) = (self.batch.len(), self.batch.file_len());
        if !self.batch.try_write(sock)? {
            return Ok(false);
        }
        stats
            .bytes
            .fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        if file_len > 0 {
            for counter in [&stats.zero_copy_bytes, &*stats.server_zero_copy_bytes] {
                counter.fetch_add(file_len as u64, std::sync::atomic::Ordering::Relaxed);
            }
        }
        self.held.clear();
        if !self.timed.is_empty() {
            let now = Stamp::now();
            for t in self.timed.drain(..) {
                t.written(now);
            }
        }
        Ok(true)
    }
}

use crate::lock;

/// A connection's writer: the socket's sending half and the [`WriterState`], shared by the writer
/// task and the connection's reader. The reader writes its own batch directly when the
/// writer is idle (nothing unwritten, nobody holding the core): no channel, no wake-up, no
/// task switch. Otherwise, and for everything else (responses of commands that became
/// tasks, pings, login), the writer task does it; it alone waits for the socket.
pub(crate) struct Writer {
    state: Mutex<WriterState>,
    sock: OwnedWriteHalf,
    pub stats: Arc<TxStats>,
    /// The connection's share of its session ([`crate::iscsi::fair`]), set after login.
    pub pacer: std::sync::OnceLock<Arc<crate::iscsi::fair::Pacer>>,
    /// What the connection keeps for SNACKs, set after login at ErrorRecoveryLevel 1.
    pub retained: std::sync::OnceLock<Arc<Mutex<Retained>>>,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer").finish_non_exhaustive()
    }
}

impl Writer {
    pub(crate) fn new(sock: OwnedWriteHalf, stats: Arc<TxStats>) -> Arc<Writer> {
        Arc::new(Writer {
            state: Mutex::new(WriterState {
                stat_sn: StatSnCounter(StatSn(0)),
                window: None,
                digests: Digests::default(),
                batch: WriteBatch::default(),
                held: Vec::new(),
                timed: Vec::new(),
                direct: false,
            }),
            sock,
            stats,
            pacer: std::sync::OnceLock::new(),
            retained: std::sync::OnceLock::new(),
        })
    }

    /// Write `batch` (responses and PDUs only) from the calling task if the writer is idle.
    /// `Ok(None)`: written, or started and left to the writer task, which `kick` must then
    /// wake; `Err(batch)`: the writer is busy, send it through the channel.
    pub(crate) fn try_direct(
        &self,
        queue: &Queue,
        batch: Vec<Out>,
    ) -> Result<DirectOutcome, Vec<Out>> {
        // A connection ahead of its session's others sends through the writer task, which
        // waits for its turn.
        if self.pacer.get().is_some_and(|p| p.ahead()) {
            return Err(batch);
        }
        let Ok(mut core) = self.state.try_lock() else {
            return Err(batch);
        };
        if !core.direct
            || !core.batch.is_empty()
            // Something queued before this batch is not encoded yet: it goes first.
            || queue.pending.load(std::sync::atomic::Ordering::SeqCst) != 0
            || !batch
                .iter()
                .all(|m| matches!(m, Out::Pdus(_) | Out::Command { .. }))
        {
            return Err(batch);
        }
        for m in batch {
            // Only responses and PDUs (checked above): nothing comes back.
            let _ = core.add(m, &self.stats, &self.retained);
        }
        Ok(match core.try_write(&self.sock, &self.stats) {
            Ok(true) => DirectOutcome::Written,
            // The socket is full (or failed): the writer task finishes or reports it.
            Ok(false) | Err(_) => DirectOutcome::Kick,
        })
    }

    /// Write everything in the core, waiting for the socket as needed (writer task only).
    async fn drain(&self) -> std::io::Result<()> {
        loop {
            if lock(&self.state).try_write(&self.sock, &self.stats)? {
                return Ok(());
            }
            self.sock.as_ref().writable().await?;
        }
    }
}

/// The sending side of the writer's queue. It counts messages sent and not yet encoded by
/// the writer task, so a direct write never overtakes them (a TMF or Logout response must
/// follow the responses queued before it).
#[derive(Debug, Clone)]
pub(crate) struct Queue {
    tx: mpsc::Sender<Out>,
    pending: Arc<std::sync::atomic::AtomicUsize>,
}

impl Queue {
    pub(crate) fn new(capacity: usize) -> (Queue, mpsc::Receiver<Out>) {
        let (tx, rx) = mpsc::channel(capacity);
        (
            Queue {
                tx,
                pending: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            },
            rx,
        )
    }

    /// The count of queued messages not yet encoded, for [`run`] (which must not hold a
    /// sender: the queue closes when the connection's senders are gone).
    pub(crate) fn pending(&self) -> Arc<std::sync::atomic::AtomicUsize> {
        Arc::clone(&self.pending)
    }

    /// Queue `msg` for the writer task (waits while the queue is full).
    pub(crate) async fn send(&self, msg: Out) -> Result<(), mpsc::error::SendError<Out>> {
        use std::sync::atomic::Ordering::SeqCst;
        self.pending.fetch_add(1, SeqCst);
        let r = self.tx.send(msg).await;
        if r.is_err() {
            self.pending.fetch_sub(1, SeqCst);
        }
        r
    }
}

/// What became of a direct write.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum DirectOutcome {
    /// All on the socket.
    Written,
    /// Partly written: send [`Out::Kick`] so the writer task finishes it.
    Kick,
}

/// A batch at least this large (a Data-In's worth) waits for its connection's turn when the
/// connection fairness control is on; responses alone never do.
const BATCH_TURN: usize = 16 * 1024;

/// Run the writer task until the queue closes, a `Close` arrives, or the socket fails. Returns
/// how it ended and what was still queued, not encoded (the queue is closed first, so nothing
/// more can be queued: a sender then gets its message back). At ErrorRecoveryLevel 2 those
/// are responses of tasks a TASK REASSIGN may still ask for.
pub(crate) async fn run(
    w: Arc<Writer>,
    mut rx: mpsc::Receiver<Out>,
    pending: Arc<std::sync::atomic::AtomicUsize>,
    first_stat_sn: StatSn,
) -> (std::io::Result<()>, Vec<Out>) {
    let res = serve(&w, &mut rx, pending, first_stat_sn).await;
    if res.is_err() {
        // Nothing more can be sent in order (a peer gone, or a Data-In whose file range
        // could not be read after its header left): close both directions, so the reader
        // ends the connection and the initiator sees it at once rather than wait for bytes
        // that will never come.
        use std::os::fd::AsRawFd;
        crate::sys::shutdown(w.sock.as_ref().as_raw_fd());
    }
    rx.close();
    let mut left = Vec::new();
    while let Ok(m) = rx.try_recv() {
        left.push(m);
    }
    (res, left)
}

async fn serve(
    w: &Arc<Writer>,
    rx: &mut mpsc::Receiver<Out>,
    pending: Arc<std::sync::atomic::AtomicUsize>,
    first_stat_sn: StatSn,
) -> std::io::Result<()> {
    use std::sync::atomic::Ordering::SeqCst;
    lock(&w.state).stat_sn = StatSnCounter(first_stat_sn);
    const BATCH_BYTES: usize = 1 << 20;
    let mut close = false;
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some(msg) = next.take() {
            handle(w, msg, &mut close).await?;
            // Encoded: a direct write may now follow it.
            pending.fetch_sub(1, SeqCst);
            if close || lock(&w.state).batch.len() >= BATCH_BYTES {
                break;
            }
            next = rx.try_recv().ok();
        }
        if let Some(p) = w.pacer.get().filter(|p| p.active()) {
            if lock(&w.state).batch.len() > BATCH_TURN {
                p.wait_turn().await;
            }
        }
        w.drain().await?;
        if close {
            break;
        }
    }
    Ok(())
}

/// Encode one message, or act on it (writer task).
async fn handle(w: &Writer, msg: Out, close: &mut bool) -> std::io::Result<()> {
    let rest = lock(&w.state).add(msg, &w.stats, &w.retained);
    match rest {
        None | Some(Out::Kick) | Some(Out::Pdus(_)) | Some(Out::Command { .. }) => {}
        Some(Out::Batch(v)) => {
            // A reader's batch: PDUs and responses only (what `Connection::flush` keeps).
            let mut core = lock(&w.state);
            for m in v {
                let rest = core.add(m, &w.stats, &w.retained);
                debug_assert!(rest.is_none(), "only PDUs and responses in a batch");
            }
        }
        Some(Out::Attach(s)) => lock(&w.state).window = Some(s),
        Some(Out::Digests(d)) => {
            // Everything queued so far was negotiated without digests.
            w.drain().await?;
            lock(&w.state).digests = d;
        }
        Some(Out::Direct) => lock(&w.state).direct = true,
        Some(Out::Close) => *close = true,
    }
    Ok(())
}
