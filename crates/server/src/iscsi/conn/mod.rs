//! One iSCSI connection: login phase, then full feature phase (RFC 7143 §8 connection states).
//!
//! This module is the driver of the sans-IO protocol core (`ironsan_proto::session` for what
//! the session's connections share, `ironsan_proto::connection` for this connection's own
//! state): it reads PDUs from the socket, asks the core what they mean, puts payloads where the
//! core says, runs commands on the SCSI layer, and hands PDUs to the writer task
//! ([`crate::iscsi::writer`]). Every SCSI command runs as its own future, polled once inline and
//! spawned as a task only if it has to wait, so many commands per connection execute
//! concurrently.
//!
//! The parts, by role:
//! * `login` — the login phase, the session registry's decisions (new session, reinstatement,
//!   a connection added to a session, a connection reinstated).
//! * `write` — SCSI commands as they arrive: admission in CmdSN order, immediate data, Data-Out
//!   into buffers or straight into the medium, commands held behind a CmdSN gap.
//! * `exec` — running a command on the SCSI layer and turning the outcome into PDUs.
//! * `tmf` — task management and logout.
//! * `text` — Text requests (SendTargets, negotiation in full feature phase) and NOP-Out.
//! * `keepalive` — NOP-In pings after silence.

mod exec;
mod keepalive;
mod login;
mod reassign;
mod recovery;
mod text;
mod tmf;
mod write;

use crate::counters::ConnStats;
use crate::counters::TxStats;
use crate::iscsi::io::{self, Digests, ReadError};
use crate::iscsi::session::{Close, ConnSignals, Core, Session};
use crate::iscsi::task::HeldPdu;
use crate::iscsi::writer::{self, Out, OutPdu};
use crate::metrics::{LunMetrics, Stamp};
use crate::{Portal, Shared};
use bytes::{Bytes, BytesMut};
use ironsan_backend::int_map::IntHasher;
use ironsan_backend::IntMap;
use ironsan_proto::intake::{DamagedHeader, Intake, IntakeParams, Route};
use ironsan_proto::negotiate::ConnParams;
use ironsan_proto::pdu::*;
use ironsan_proto::session::{ConnId, Event, PduAdmission};
use ironsan_proto::StatSn;
use std::hash::BuildHasherDefault;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, Semaphore};

/// The per-connection protocol core as this driver instantiates it.
type ConnCore = ironsan_proto::connection::Connection<
    crate::iscsi::task::PendingWrite,
    BuildHasherDefault<IntHasher>,
>;

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    /// The initiator logged out (this connection or its session).
    #[error("logout")]
    Logout,
    #[error("closed by target")]
    ClosedByTarget,
    #[error("server shutting down")]
    Shutdown,
    #[error("initiator did not answer NOP-In")]
    NopTimeout,
    #[error("target cold reset")]
    ColdReset,
    /// Logged out (`by_logout`) or closed for recovery at ErrorRecoveryLevel 2: it leaves as
    /// failed, its tasks kept for reassignment (RFC 7143 §11.14.1 reason 2, §6.2.2).
    #[error("removed for recovery")]
    Recovery { by_logout: bool },
    /// A PDU that breaks the protocol in a way the stream cannot recover from (RFC 7143 §7.1.3:
    /// a length beyond what was negotiated; a header digest error: the length can no longer
    /// be trusted).
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("{0}")]
    Read(#[from] ReadError),
}

impl ConnError {
    /// Routine endings (logged at info); the rest are failures (a warning, and below
    /// ErrorRecoveryLevel 2 the end of the session).
    fn routine(&self) -> bool {
        matches!(
            self,
            ConnError::Logout
                | ConnError::ClosedByTarget
                | ConnError::Shutdown
                | ConnError::Recovery { .. }
        )
    }
    /// The connection failed (RFC 7143 §7.14): anything but a logout or a close the target
    /// decided.
    fn failed(&self) -> bool {
        !matches!(
            self,
            ConnError::Logout
                | ConnError::ClosedByTarget
                | ConnError::Shutdown
                | ConnError::ColdReset
        )
    }
}

impl From<std::io::Error> for ConnError {
    fn from(e: std::io::Error) -> Self {
        ConnError::Read(ReadError::Io(e))
    }
}

type ConnResult = Result<(), ConnError>;

/// The per-connection read budget in bytes (at least one largest read, so a read alone always
/// proceeds).
fn tx_budget_bytes(shared: &Shared) -> usize {
    let b = shared
        .cfg
        .limits
        .tx_buffer_per_connection
        .max(u64::from(shared.cfg.max_io_bytes))
        .min(Semaphore::MAX_PERMITS as u64);
    b as usize
}

/// Writer queue depth in messages: bounds what a reader that never reads can make us hold.
const WRITER_QUEUE: usize = 512;

/// Bytes of data the reader keeps for the writer before handing them over.
const OUT_BATCH_BYTES: usize = 64 * 1024;
/// Responses the reader keeps before handing them over even though more commands are
/// already buffered. Without it a burst of small commands (4K writes: 48-byte responses)
/// went back as one batch after the whole burst, so the initiator and the target took turns
/// instead of overlapping (4K QD32 writes: 170-177K IOPS with the target 30 % idle; with 8:
/// 275-303K at less CPU per I/O). Large responses reach [`OUT_BATCH_BYTES`] first.
const OUT_BATCH_ITEMS: usize = 8;

/// A Reject of the PDU with header `bhs` (RFC 7143 §11.17).
fn reject(reason: RejectReason, bhs: &Bhs) -> OutPdu {
    let (h, data) = Reject::of(reason, bhs);
    OutPdu::status(h, data)
}

/// Set while a connection's reader polls a command inline (`Running::polling`); clears on
/// drop.
struct PollingFlag(Arc<AtomicBool>);

impl PollingFlag {
    fn set(flag: &Arc<AtomicBool>) -> Self {
        flag.store(true, Ordering::Release);
        PollingFlag(Arc::clone(flag))
    }
}

impl Drop for PollingFlag {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Everything the reader of a connection in full feature phase needs.
struct Connection {
    shared: Arc<Shared>,
    session: Arc<Session>,
    /// This connection in its session.
    id: ConnId,
    signals: Arc<ConnSignals>,
    tx: writer::Queue,
    params: ConnParams,
    cid: u16,
    local: SocketAddr,
    peer: SocketAddr,
    /// The per-connection protocol state: writes waiting for Data-Out, R2Ts, Text
    /// continuations. Commands held behind a CmdSN gap are in their task records in the
    /// session's core (`Running::parked`), non-task PDUs in its window.
    core: ConnCore,
    /// The session queued events for this connection.
    events: bool,
    /// Bytes of read data allowed between the backend and the socket.
    tx_budget: Arc<Semaphore>,
    tasks: tokio::task::JoinSet<()>,
    /// Reads of at least this many bytes may answer from a file LUN's page cache or mapping
    /// ([`exec::in_place_reads`]).
    in_place: Option<ironsan_backend::InPlaceRead>,
    /// Writes of at least this many bytes may receive their Data-Out straight into a file
    /// LUN's pages ([`write::place_min`]).
    place_min: Option<u32>,
    last_rx: Arc<AtomicU64>,
    /// When the connection started (the zero of `last_rx`, in ms).
    epoch: Stamp,
    /// Counters for `ironsan ctl sessions` and the metrics (relaxed atomics).
    stats: Arc<ConnStats>,
    /// The latency counters of the LUNs this connection used (a private cache of the target's
    /// map, so a command takes no lock to find them).
    lun_metrics: IntMap<u64, Arc<LunMetrics>>,
    /// What the reader produced since it last handed work to the writer: responses of
    /// commands that completed inline, R2Ts, replies. Handed over as one [`Out::Batch`] before
    /// the reader waits for the socket, or once it is full (`batch_full`), so the
    /// writer wakes once and sends them all with one vectored write.
    out: Vec<Out>,
    out_bytes: usize,
    /// The connection's writer, for writing `out` directly when it is idle.
    writer: Arc<writer::Writer>,
    /// Set while `spawn_exec` polls a command inline (see `Running::polling`).
    polling: Arc<AtomicBool>,
    /// Always false: the flag of a task's entry while it is not being polled.
    not_polling: Arc<AtomicBool>,
    /// This connection's share of its session ([`crate::iscsi::fair`]).
    pacer: Arc<crate::iscsi::fair::Pacer>,
    /// ErrorRecoveryLevel above 0 (RFC 7143 §7.1.5): lost data is asked for again, damaged
    /// headers are dropped, SNACKs are answered.
    recovery: bool,
    /// The protocol core's intake of this connection's PDUs (damaged headers, ExpStatSN,
    /// where each PDU goes).
    intake: Intake,
    /// On a cluster node: proof that the initiator is live after a silence, before a command
    /// that changes a shared medium runs ([`Probing`]).
    probe: Option<Probing>,
}

/// A connection's [`ironsan_proto::keepalive::Probe`] and the proofs its held commands wait
/// for (docs/ARCHITECTURE.md, "Several gateways on one image": a command read after a
/// silence may have waited in a socket through a pause or a partition, sent by an initiator
/// that has since given up on it and sent it through another node).
pub(super) struct Probing {
    core: ironsan_proto::keepalive::Probe,
    proofs: watch::Sender<u64>,
}

impl Probing {
    fn new(gap: std::time::Duration) -> Self {
        Probing {
            core: ironsan_proto::keepalive::Probe::new(gap.as_millis() as u64),
            proofs: watch::channel(0).0,
        }
    }
}

/// Serve one accepted TCP connection until it closes.
pub(crate) async fn run(
    stream: TcpStream,
    peer: SocketAddr,
    tag: u16,
    shared: Arc<Shared>,
    over_limit: bool,
) {
    let local = match stream.local_addr() {
        Ok(a) => a,
        Err(_) => return,
    };
    let portal = Portal { addr: local, tag };
    let (rd, wr) = stream.into_split();
    let mut rd = io::RecvBuf::new(rd);
    let (tx, rx) = writer::Queue::new(WRITER_QUEUE);
    let stats = Arc::new(TxStats {
        server_zero_copy_bytes: Arc::clone(&shared.stats.zero_copy_bytes),
        ..TxStats::default()
    });
    let mut writer = LazyWriter {
        writer: writer::Writer::new(wr, Arc::clone(&stats)),
        rx: Some(rx),
        pending: tx.pending(),
        handle: None,
        stats: Arc::clone(&stats),
    };

    // Login phase, bounded in time so half-sent logins cannot pin resources.
    let login = tokio::time::timeout(
        shared.cfg.limits.login_timeout,
        login::login_phase(&mut rd, &tx, &shared, peer, portal, over_limit, &mut writer),
    )
    .await;
    let outcome = match login {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => {
            tracing::debug!(%peer, "login ended: {e}");
            None
        }
        Err(_) => {
            shared.stats.login_failed("timeout");
            tracing::info!(%peer, "login timed out");
            return;
        }
    };
    let direct_writer = Arc::clone(&writer.writer);
    let writer = writer.start(StatSn(0));
    let Some(login::LoginOutcome {
        session,
        params,
        cid,
        id,
        close_rx,
        stats: conn_stats,
        signals,
    }) = outcome
    else {
        let _ = tx.send(Out::Close).await;
        drop(tx);
        let _ = writer.await;
        return;
    };
    shared.stats.logins.fetch_add(1, Ordering::Relaxed);
    tracing::info!(%peer, initiator = %session.initiator_name, target = session.target.as_ref().map(|t| t.name.as_str()).unwrap_or("(discovery)"), tsih = session.tsih.0, cid, "login");
    let mut conn = Connection::new(
        &shared,
        session,
        params,
        cid,
        id,
        conn_stats,
        Arc::clone(&signals),
        tx,
        direct_writer,
        (local, peer),
        &rd,
    );
    let (session, last_rx) = (Arc::clone(&conn.session), Arc::clone(&conn.last_rx));
    let keepalive = tokio::spawn(keepalive::run(
        conn.tx.clone(),
        Arc::clone(&last_rx),
        conn.epoch,
        shared.cfg.limits.nop_interval,
        shared.cfg.limits.nop_timeout,
        Arc::clone(&session),
        id,
        cid,
    ));
    // Behind the login's Attach and Digests: from here the reader may write directly.
    let _ = conn.tx.send(Out::Direct).await;
    let reason = match conn.full_feature(&mut rd, close_rx).await {
        Ok(()) => ConnError::Logout,
        Err(e) => e,
    };
    keepalive.abort();
    conn.close(&mut rd, reason, writer).await;
}

impl Connection {
    /// A logged-in connection entering full feature phase: its fairness share, the writer's
    /// record of what it sent (at ErrorRecoveryLevel ≥ 1), and its per-connection state.
    #[allow(clippy::too_many_arguments)]
    fn new(
        shared: &Arc<Shared>,
        session: Arc<Session>,
        params: ConnParams,
        cid: u16,
        id: ConnId,
        conn_stats: Arc<ConnStats>,
        signals: Arc<ConnSignals>,
        tx: writer::Queue,
        direct_writer: Arc<writer::Writer>,
        (local, peer): (SocketAddr, SocketAddr),
        rd: &io::RecvBuf<OwnedReadHalf>,
    ) -> Connection {
        let last_rx = Arc::new(AtomicU64::new(0));
        let fd = {
            use std::os::fd::AsRawFd;
            rd.get_ref().as_ref().as_raw_fd()
        };
        let pacer = Arc::new(
            session
                .shares
                .join(Arc::clone(&conn_stats), Arc::clone(&direct_writer.stats)),
        );
        let _ = direct_writer.pacer.set(Arc::clone(&pacer));
        let recovery = session.params.error_recovery_level > 0;
        if recovery {
            // Kept PDUs are bounded by the connection's transmit budget (and a count of
            // statuses): an initiator that never acknowledges cannot grow them.
            let limit =
                usize::try_from(shared.cfg.limits.tx_buffer_per_connection).unwrap_or(usize::MAX);
            let _ =
                direct_writer
                    .retained
                    .set(Arc::new(std::sync::Mutex::new(writer::Retained::new(
                        limit,
                    ))));
        }
        Connection {
            pacer,
            shared: Arc::clone(shared),
            session: Arc::clone(&session),
            id,
            signals,
            tx,
            params,
            cid,
            local,
            peer,
            core: ConnCore::new(
                write::write_params(&session, &params),
                params.max_xmit_data_segment_length,
                shared.cfg.limits.max_r2ts_per_connection,
            ),
            events: false,
            tx_budget: Arc::new(Semaphore::new(tx_budget_bytes(shared))),
            tasks: tokio::task::JoinSet::new(),
            last_rx,
            epoch: Stamp::now(),
            stats: conn_stats,
            lun_metrics: IntMap::default(),
            out: Vec::new(),
            out_bytes: 0,
            writer: direct_writer,
            polling: Arc::new(AtomicBool::new(false)),
            not_polling: Arc::new(AtomicBool::new(false)),
            // At ErrorRecoveryLevel 1 data may be asked for again: writes go through a buffer
            // (a damaged segment must not reach the medium) and reads through memory (a SNACK
            // resends what was sent, not what the file holds by then).
            place_min: write::place_min(shared.cfg.limits.zero_copy_writes, &params)
                .filter(|_| !recovery),
            in_place: exec::in_place_reads(shared.cfg.limits.zero_copy_reads, &params, fd)
                .filter(|_| !recovery),
            recovery,
            intake: Intake::new(IntakeParams {
                cid: Cid(cid),
                error_recovery_level: session.params.error_recovery_level,
                discovery: session.target.is_none(),
            }),
            probe: shared
                .cluster
                .get()
                .filter(|_| session.target.is_some())
                .map(|c| Probing::new(c.heartbeat())),
        }
    }

    /// The connection has ended for `reason`: at ErrorRecoveryLevel 2 a failed connection's
    /// tasks wait for a TASK REASSIGN (its commands keep running, its writes waiting for data
    /// are kept with their data, its writer's record of what it sent is kept); otherwise its
    /// tasks are aborted. It leaves the session, then the writer is stopped.
    async fn close(
        mut self,
        rd: &mut io::RecvBuf<OwnedReadHalf>,
        reason: ConnError,
        writer: WriterHandle,
    ) {
        let (session, shared) = (Arc::clone(&self.session), Arc::clone(&self.shared));
        let (id, cid, peer, signals) = (self.id, self.cid, self.peer, Arc::clone(&self.signals));
        let failed = reason.failed();
        if reason.routine() {
            tracing::info!(%peer, initiator = %session.initiator_name, tsih = session.tsih.0, cid, "connection closed: {reason}");
        } else {
            tracing::warn!(%peer, initiator = %session.initiator_name, tsih = session.tsih.0, cid, "connection closed: {reason}");
        }
        // At ErrorRecoveryLevel 2 a failed connection's tasks wait for a TASK REASSIGN
        // (`reassign`): its commands keep running, its writes waiting for data are kept with
        // their data, its writer's record of what it sent is kept.
        let recover = failed && session.recovers() && !*shared.shutdown.borrow();
        if recover {
            // Its writer lives on in the session: the fairness control must not wait for it.
            self.pacer.retire();
            let writes = self.core.take_where(|w| w.is_delivered());
            let kept = self.writer.retained.get().cloned();
            session.orphans(|o| o.keep(id, Cid(cid), kept, writes));
            self.tasks.detach_all();
            shared
                .stats
                .recovered(crate::counters::Recovery::ConnectionKept);
        } else {
            self.tasks.abort_all();
        }
        // Writes waiting for data (the rest of them) go with the connection; its held commands
        // and PDUs go with it in the session's core.
        let _ = self.core.take_where(|_| true);
        if session.leave(id, failed) {
            // The session ends with its last connection, and below ErrorRecoveryLevel 2 with any
            // that failed (session recovery); no login can join it from now on.
            shared
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .ended(&session);
        }
        // Told after it has left the session: whoever waited for it (a reinstating login, a
        // logout for recovery) then finds it gone from the core (a TASK REASSIGN right after the
        // logout's answer moves its tasks instead of finding them still allegiant).
        signals.mark_stopped();
        if matches!(
            reason,
            ConnError::Logout | ConnError::Recovery { by_logout: true }
        ) {
            // RFC 7143 §11.15: after a Logout Response both ends close. Initiators close first
            // once they have read it; one that notices our close before it reads the response
            // (iscsi-client-rs does) fails the logout, so its close is waited for, briefly.
            let _ = tokio::time::timeout(LOGOUT_LINGER, until_eof(rd)).await;
        }
        let _ = self.tx.send(Out::Close).await;
        drop(self);
        let unsent = writer.await;
        if recover {
            for out in unsent {
                session.park(id, out);
            }
            session.writer_stopped(id);
            tokio::spawn(reassign::expire_later(
                Arc::clone(&session),
                Arc::clone(&shared),
            ));
        } else {
            session.orphans(|o| o.forget(&[id]));
        }
    }
}

/// How long a connection that answered a Logout waits for the initiator to close it.
const LOGOUT_LINGER: std::time::Duration = std::time::Duration::from_secs(2);

/// Read and drop whatever still comes, until the peer closes.
async fn until_eof(rd: &mut io::RecvBuf<OwnedReadHalf>) {
    use tokio::io::AsyncReadExt;
    let mut scratch = [0u8; 512];
    while matches!(rd.read(&mut scratch).await, Ok(n) if n > 0) {}
}

/// The writer task, started when the first Login Request tells the StatSN to begin with
/// (its ExpStatSN), so every login response, not only the last, goes out at once.
struct LazyWriter {
    writer: Arc<writer::Writer>,
    rx: Option<mpsc::Receiver<Out>>,
    pending: Arc<std::sync::atomic::AtomicUsize>,
    handle: Option<WriterTask>,
    stats: Arc<TxStats>,
}

impl LazyWriter {
    /// Start the writer (once) and return its handle's owner.
    fn start(&mut self, first_stat_sn: StatSn) -> WriterHandle {
        if let Some(rx) = self.rx.take() {
            self.handle = Some(tokio::spawn(writer::run(
                Arc::clone(&self.writer),
                rx,
                Arc::clone(&self.pending),
                first_stat_sn,
            )));
        }
        WriterHandle(self.handle.take())
    }
}

type WriterTask = tokio::task::JoinHandle<(std::io::Result<()>, Vec<Out>)>;

/// The running writer, to wait for at the end of the connection: what it had not encoded
/// when it stopped.
struct WriterHandle(Option<WriterTask>);

impl std::future::IntoFuture for WriterHandle {
    type Output = Vec<Out>;
    type IntoFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Vec<Out>> + Send>>;
    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            match self.0 {
                Some(h) => h.await.map(|(_, unsent)| unsent).unwrap_or_default(),
                None => Vec::new(),
            }
        })
    }
}

impl Connection {
    /// Run `f` on the session's protocol core, then wake the connections it made events for;
    /// notes whether this one has events of its own ([`Connection::drain_events`]).
    fn sess<R>(&mut self, f: impl FnOnce(&mut Core) -> R) -> R {
        let me = self.id;
        let (r, mine) = self.session.with_core(|c| {
            let r = f(c);
            let mine = c.take_wakeups(me, |other| other.signals.wake());
            (r, mine)
        });
        self.events |= mine;
        r
    }

    /// Queue PDUs behind everything the reader produced before them.
    async fn send(&mut self, pdus: Vec<OutPdu>) {
        self.queue(Out::Pdus(pdus)).await;
    }

    /// Keep `out` for the writer; hand the batch over once it is full.
    async fn queue(&mut self, out: Out) {
        self.keep(out);
        if self.batch_full() {
            self.flush().await;
        }
    }

    /// The kept batch should go now even if more commands are waiting: enough data
    /// ([`OUT_BATCH_BYTES`]) or enough responses ([`OUT_BATCH_ITEMS`]).
    fn batch_full(&self) -> bool {
        self.out_bytes >= OUT_BATCH_BYTES || self.out.len() >= OUT_BATCH_ITEMS
    }

    /// Keep `out` for the writer's next batch.
    fn keep(&mut self, out: Out) {
        self.out_bytes += out.data_len();
        self.out.push(out);
    }

    /// Hand the batch to the writer.
    async fn flush(&mut self) {
        if !self.out.is_empty() {
            let large = self.out_bytes >= OUT_BATCH_BYTES;
            self.out_bytes = 0;
            let batch = std::mem::take(&mut self.out);
            // Written here when the writer is idle; otherwise (or to finish a partial write)
            // through the writer task.
            match self.writer.try_direct(&self.tx, batch) {
                Ok(writer::DirectOutcome::Written) => {}
                Ok(writer::DirectOutcome::Kick) => {
                    let _ = self.tx.send(Out::Kick).await;
                }
                Err(batch) => {
                    if let Err(e) = self.tx.send(Out::Batch(batch)).await {
                        // The writer has stopped: responses kept for a TASK REASSIGN.
                        self.session.park(self.id, e.0);
                    }
                }
            }
            if large {
                // Let the writer send it while the data is still in the CPU's caches, before
                // this reader produces the next large response.
                tokio::task::yield_now().await;
            }
        }
    }

    /// Keep the R2Ts the core issued for the writer.
    fn keep_r2ts(&mut self) {
        while let Some(r) = self.core.poll_r2t() {
            self.keep(Out::Pdus(vec![OutPdu::current(
                Header::R2t(r),
                Bytes::new(),
            )]));
        }
    }

    /// Act on what the session made due on this connection: held commands released by a
    /// CmdSN that arrived (here or on another connection), tasks dropped by an abort.
    async fn drain_events(&mut self) -> ConnResult {
        self.events = false;
        loop {
            let id = self.id;
            let Some(e) = self.sess(|c| c.poll_event(id)) else {
                break;
            };
            match e {
                Event::Deliver(itt) => self.deliver(itt),
                Event::Drop(itt) => {
                    let _ = self.core.take(itt);
                }
                Event::DeliverPdu(_, p) => {
                    self.on_other_now(&p.bhs, p.header, p.data).await?;
                }
            }
        }
        self.keep_r2ts();
        Ok(())
    }

    /// The full feature phase loop. Returns why it ended.
    async fn full_feature(
        &mut self,
        rd: &mut io::RecvBuf<OwnedReadHalf>,
        close_rx: watch::Receiver<Option<Close>>,
    ) -> ConnResult {
        self.session.reader_started();
        let mut closed = close_rx.clone();
        let result = tokio::select! {
            biased;
            // Told to close (reinstatement, a reset, a logout from another connection, `ctl`,
            // an unanswered ping): stop at once, even in the middle of a PDU, so nothing more
            // that arrives here reaches a LU.
            Ok(why) = closed.wait_for(|c| c.is_some()) => Err(self.close_reason(*why)),
            r = self.serve_pdus(rd, close_rx) => r,
        };
        self.session.reader_stopped();
        // A Logout response (or anything else still kept) goes out before the close.
        self.flush().await;
        result
    }

    fn close_reason(&self, why: Option<Close>) -> ConnError {
        if *self.shared.shutdown.borrow() {
            return ConnError::Shutdown;
        }
        match why {
            Some(Close::NopTimeout) => ConnError::NopTimeout,
            Some(Close::ForRecovery) => ConnError::Recovery { by_logout: false },
            _ => ConnError::ClosedByTarget,
        }
    }

    async fn serve_pdus(
        &mut self,
        rd: &mut io::RecvBuf<OwnedReadHalf>,
        mut close_rx: watch::Receiver<Option<Close>>,
    ) -> ConnResult {
        let digests = Digests {
            header: self.params.header_digest,
            data: self.params.data_digest,
        };
        let max_data = self.params.max_recv_data_segment_length;
        let mut shutdown = self.shared.shutdown.clone();
        // Shutting down: the initiator was asked to log out; keep serving (commands in
        // flight finish, the Logout is answered) until it does or the server closes us.
        let mut draining = *shutdown.borrow();
        if draining {
            self.async_logout_request().await;
        }
        let signals = Arc::clone(&self.signals);
        loop {
            if self.events || signals.take_events() {
                self.drain_events().await?;
            }
            // The whole header (BHS, AHS, header digest) is here: reading it cannot wait.
            let buffered = {
                let b = rd.buffer();
                let ahs = b.get(4).map_or(0, |&words| usize::from(words) * 4);
                let hd = if digests.header { 4 } else { 0 };
                b.len() >= BHS_LEN && b.len() >= BHS_LEN + ahs + hd
            };
            if !buffered || self.batch_full() {
                // The next header needs the socket: first let the writer send what is ready
                // (and reap finished command tasks).
                self.flush().await;
                while self.tasks.try_join_next().is_some() {}
                let spin = self.shared.cfg.limits.busy_poll;
                if !spin.is_zero() && rd.buffer().is_empty() {
                    // Opt-in busy polling (`busy_poll`): keep receiving for a while instead
                    // of sleeping, letting the writer and other tasks run in between.
                    let deadline = Instant::now() + spin;
                    let got = loop {
                        tokio::task::yield_now().await;
                        match rd.try_fill() {
                            Ok(n) if n > 0 => break true,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                if Instant::now() >= deadline {
                                    break false;
                                }
                            }
                            // End of stream or an error: the normal read reports it.
                            _ => break false,
                        }
                    };
                    if got {
                        continue;
                    }
                }
            }
            // A header already buffered is read without arming the close/shutdown watches
            // (registering and dropping their waiters per PDU was a measurable cost); a
            // change is still seen at once through `has_changed`.
            fn quiet<T>(w: &watch::Receiver<T>) -> bool {
                matches!(w.has_changed(), Ok(false))
            }
            if buffered && quiet(&close_rx) && (draining || quiet(&shutdown)) {
                let header = io::read_header(rd, digests, max_data).await;
                self.on_pdu(rd, header).await?;
                continue;
            }
            let header = tokio::select! {
                biased;
                r = close_rx.changed() => {
                    return Err(match r {
                        Ok(()) => self.close_reason(*close_rx.borrow()),
                        Err(_) => ConnError::ClosedByTarget,
                    });
                }
                r = shutdown.changed(), if !draining => {
                    draining = true;
                    if r.is_ok() {
                        self.async_logout_request().await;
                    }
                    continue;
                }
                _ = signals.woken() => continue,
                // Cancel-safe: bytes of a header that is not all here stay in the buffer when
                // another branch wins (a wake-up from another connection of the session).
                r = rd.header_buffered(digests.header) => match r {
                    Ok(true) => continue,
                    Ok(false) => Err(ReadError::Closed),
                    Err(e) => Err(ReadError::Io(e)),
                },
            };
            self.on_pdu(rd, header).await?;
        }
    }

    /// Handle one PDU whose header was read.
    async fn on_pdu(
        &mut self,
        rd: &mut io::RecvBuf<OwnedReadHalf>,
        header: Result<(Bhs, Bytes, ReceivePlan), ReadError>,
    ) -> ConnResult {
        let (bhs, ahs, plan) = match header {
            Ok(h) => h,
            Err(ReadError::TooLong(e)) => {
                // RFC 7143 §7.1.3: a length beyond what was negotiated is a protocol error;
                // the stream cannot be resynchronised safely.
                return Err(ConnError::Protocol(e.to_string()));
            }
            Err(ReadError::HeaderDigest(plan)) => {
                self.count_digest_error();
                match (self.intake.damaged_header(plan.is_some()), plan) {
                    (DamagedHeader::Drop, Some(plan)) => {
                        tracing::warn!(peer = %self.peer, initiator = %self.session.initiator_name, tsih = self.session.tsih.0, cid = self.cid, "header digest error; PDU dropped");
                        self.count_recovery(crate::counters::Recovery::HeaderDropped);
                        io::skip_data(rd, &plan).await?;
                        return Ok(());
                    }
                    (_, plan) => return Err(ReadError::HeaderDigest(plan).into()),
                }
            }
            Err(e) => return Err(e.into()),
        };
        // What an initiator PDU's ExpStatSN acknowledges need not be kept for SNACKs any
        // more; most PDUs repeat the last one, which costs no lock.
        if let Some(sn) = self.intake.header(&bhs) {
            if let Some(kept) = self.writer.retained.get() {
                crate::lock(kept).ack(sn);
            }
        }
        self.stats.received(48 + ahs.len() + plan.data_len);
        // One clock read per PDU: the NOP-Out timer's last receive and a command's first stage.
        let t_header = Stamp::now();
        let rx_ms = t_header.since(self.epoch) / 1_000_000;
        self.last_rx.store(rx_ms, Ordering::Relaxed);
        if let Some(p) = &mut self.probe {
            p.core.received(rx_ms);
        }
        let header = Header::decode(&bhs);
        match (self.intake.route(&header), header) {
            (Route::Command, Header::ScsiCommand(cmd)) => {
                self.on_scsi_command(rd, &bhs, ahs, &plan, cmd, t_header)
                    .await?
            }
            (Route::DataOut, Header::DataOut(d)) => self.on_data_out(rd, &bhs, &plan, d).await?,
            (Route::Reject(reason), Header::ScsiCommand(_)) => {
                io::skip_data(rd, &plan).await?;
                self.send(vec![reject(reason, &bhs)]).await;
            }
            (route, other) => {
                let mut data = BytesMut::zeroed(plan.data_len);
                if !io::read_data_into(rd, &plan, &mut data).await? {
                    let r = self.digest_error(RejectReason::DATA_DIGEST_ERROR, &bhs);
                    self.send(vec![r]).await;
                } else if let Route::Reject(reason) = route {
                    self.send(vec![reject(reason, &bhs)]).await;
                } else {
                    self.on_other(&bhs, route, other, data.freeze()).await?;
                }
            }
        }
        if self.events {
            self.drain_events().await?;
        }
        self.keep_r2ts();
        if plan.data_len > 0 && self.pacer.active() && self.pacer.ahead() {
            // Ahead of the session's other connections: let the writer send what is ready,
            // then wait before reading more data here (crate::iscsi::fair).
            self.flush().await;
            self.pacer.wait_turn().await;
        }
        Ok(())
    }

    fn count_recovery(&self, kind: crate::counters::Recovery) {
        self.shared.stats.recovered(kind);
    }

    fn count_digest_error(&self) {
        self.stats.digest_errors.fetch_add(1, Ordering::Relaxed);
        self.shared
            .stats
            .digest_errors
            .fetch_add(1, Ordering::Relaxed);
    }

    /// A Reject for a data digest error, counted.
    fn digest_error(&self, reason: RejectReason, bhs: &Bhs) -> OutPdu {
        tracing::warn!(peer = %self.peer, initiator = %self.session.initiator_name, tsih = self.session.tsih.0, cid = self.cid, "data digest error; PDU rejected");
        self.count_digest_error();
        reject(reason, bhs)
    }

    /// Ask the initiator to log out (Async Message event 1, RFC 7143 §11.9.1), used on shutdown.
    async fn async_logout_request(&mut self) {
        // Parameter3: the seconds within which the initiator should log out (RFC 7143
        // §11.9.1), the shutdown grace time.
        let secs = self
            .shared
            .cfg
            .limits
            .shutdown_grace
            .as_secs()
            .clamp(1, u64::from(u16::MAX));
        tracing::info!(peer = %self.peer, initiator = %self.session.initiator_name, tsih = self.session.tsih.0, "asking the initiator to log out within {secs} s (shutdown)");
        let msg = Header::AsyncMessage(AsyncMessage {
            async_event: 1,
            parameter3: secs as u16,
            ..Default::default()
        });
        self.send(vec![OutPdu::status(msg, Bytes::new())]).await;
    }

    /// A PDU other than a SCSI Command or Data-Out. Those that carry a CmdSN (NOP-Out with a
    /// task tag, Text, task management, Logout) take their place in CmdSN order across the
    /// session's connections (RFC 7143 §3.2.2.1); one that arrives ahead of a gap waits.
    async fn on_other(
        &mut self,
        bhs: &Bhs,
        route: Route,
        header: Header,
        data: Bytes,
    ) -> ConnResult {
        if let Route::Sequenced { cmd_sn, immediate } = route {
            let id = self.id;
            let pdu = HeldPdu {
                bhs: *bhs,
                header,
                data,
            };
            return match self.sess(|c| c.admit_pdu(id, cmd_sn, immediate, pdu)) {
                PduAdmission::Now(p) => self.on_other_now(&p.bhs, p.header, p.data).await,
                PduAdmission::Ignore | PduAdmission::Held => Ok(()),
            };
        }
        self.on_other_now(bhs, header, data).await
    }

    /// Act on a PDU other than a SCSI Command or Data-Out whose turn it is.
    async fn on_other_now(&mut self, bhs: &Bhs, header: Header, data: Bytes) -> ConnResult {
        match header {
            Header::NopOut(n) => {
                if let Some(p) = self.probe.as_mut().filter(|_| n.itt == Itt::RESERVED) {
                    if p.core.answered(n.ttt) {
                        p.proofs.send_replace(p.core.proofs());
                    }
                }
                let max = self.params.max_xmit_data_segment_length;
                if let Some((h, echo)) = ironsan_proto::connection::nop_in(&n, &data, max) {
                    self.send(vec![OutPdu::status(h, echo)]).await;
                }
            }
            Header::TextRequest(t) => self.on_text(bhs, t, data).await,
            Header::TaskMgmtRequest(t) => self.on_task_management(t).await?,
            Header::LogoutRequest(l) => self.on_logout(l).await?,
            Header::SnackRequest(s) => self.on_snack(bhs, s).await,
            // Rejected by `Intake::route` before they get here.
            other => {
                let reason = match self.intake.route(&other) {
                    Route::Reject(reason) => reason,
                    _ => RejectReason::PROTOCOL_ERROR,
                };
                self.send(vec![reject(reason, bhs)]).await;
            }
        }
        Ok(())
    }
}
