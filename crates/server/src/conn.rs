//! One iSCSI connection: login phase, then full feature phase (RFC 7143 §7 connection states).
//!
//! The reader (this task) decodes PDUs and acts on them; every SCSI command runs as its own
//! task so many commands per connection execute concurrently; all output goes through the
//! writer task ([`crate::writer`]). Data-Out reassembly is local to the connection: at
//! ErrorRecoveryLevel 0 a command's data arrives on the connection that carried the command.

use crate::access::{os_random, Access};
use crate::admin::ConnStats;
use crate::io::{self, Digests, ReadError};
use crate::metrics::{Class, LunMetrics, Stamp, Timing};
use crate::session::{ConnInfo, PlacedSlot, Running, Session};
use crate::writer::{self, Out, OutPdu, TxStats};
use crate::{LiveTarget, Portal, Runtime, Shared};
use bytes::{Bytes, BytesMut};
use ironsan_backend::IntMap;
use ironsan_proto::chap::ChapCredentials;
use ironsan_proto::login::{
    Login, LoginPolicy, LoginStatus, LoginStep, TargetLookup, CHAP_RANDOM_LEN,
};
use ironsan_proto::negotiate::{ConnParams, Negotiator, SessionType};
use ironsan_proto::pdu::*;
use ironsan_proto::task::{data_in_segments, DataOutError, WriteParams, WriteTransfer};
use ironsan_proto::window::CmdWindow;
use ironsan_proto::{text, CmdSn, DataSn, StatSn};
use ironsan_scsi::{Command, PlacedWrite, Response, SenseReason, UnitAttention};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, Semaphore};

/// The per-connection read budget in bytes (at least one largest read, so a read alone always
/// proceeds).
fn tx_budget_bytes(shared: &Shared) -> usize {
    let b = shared
        .cfg
        .tx_buffer_per_connection
        .max(u64::from(shared.cfg.max_io_bytes))
        .min(Semaphore::MAX_PERMITS as u64);
    b as usize
}

/// Writer queue depth in messages: bounds what a reader that never reads can make us hold.
const WRITER_QUEUE: usize = 512;
/// MaxRecvDataSegmentLength during login (RFC 7143 §13.12: 8192 until negotiated).
const LOGIN_MAX_DATA: u32 = 8192;

/// The login's view of the configuration: targets, ACLs (by initiator name and source
/// address) and CHAP credentials.
/// One snapshot of the run-time configuration serves the whole login.
struct Policy {
    rt: Arc<Runtime>,
    peer: IpAddr,
    /// The tag of the portal group the connection came in on.
    tag: u16,
}

impl Policy {
    fn access(&self, target_name: Option<&str>) -> &Access {
        match target_name {
            Some(t) => self.rt.access(t),
            None => &self.rt.discovery,
        }
    }
}

impl LoginPolicy for Policy {
    fn lookup_target(&self, target_name: &str, initiator_name: &str) -> TargetLookup {
        match self.rt.targets.get(target_name) {
            // A target not served by this portal group does not exist at this address
            // (RFC 7143 §11.13.5, 0203).
            Some(_) if !self.rt.served_on(target_name, self.tag) => TargetLookup::NotFound,
            Some(t)
                if self
                    .access(Some(target_name))
                    .allows(initiator_name, self.peer) =>
            {
                TargetLookup::Allowed {
                    tpgt: self.tag,
                    alias: t.alias.clone(),
                }
            }
            Some(_) => TargetLookup::Denied,
            None => TargetLookup::NotFound,
        }
    }
    fn discovery_allowed(&self, initiator_name: &str) -> bool {
        self.rt.discovery.allows(initiator_name, self.peer)
    }
    fn auth_required(&self, target_name: Option<&str>, _initiator_name: &str) -> bool {
        self.access(target_name).auth_required()
    }
    fn chap_credentials(&self, target_name: Option<&str>) -> Option<&dyn ChapCredentials> {
        let a = self.access(target_name);
        a.auth_required().then_some(a as &dyn ChapCredentials)
    }
}

/// A write command waiting for its Data-Out.
struct PendingWrite {
    cmd: ScsiCommand,
    cdb: Bytes,
    transfer: WriteTransfer,
    buf: BytesMut,
    /// The data goes straight into the medium instead of `buf` (see [`place_min`]), a
    /// whole block at a time.
    placed: Option<(Arc<PlacedSlot>, io::Placement)>,
    /// Aborted while received in place (a task management function emptied its slot): the
    /// rest of its data is received and dropped, as a buffered write's is, and it ends with no
    /// response.
    discard: bool,
    slot: Slot,
    /// When the command's header was read (start of the "receive" stage).
    t_header: Stamp,
}

/// A write's data on its way to execution: in a buffer, or already in place in the medium.
enum WriteData {
    Buffer(Bytes),
    Placed(PlacedWrite),
}

impl From<Bytes> for WriteData {
    fn from(b: Bytes) -> Self {
        WriteData::Buffer(b)
    }
}

impl From<PlacedWrite> for WriteData {
    fn from(p: PlacedWrite) -> Self {
        WriteData::Placed(p)
    }
}

/// A command's place in the session's CmdSN window; released (opening the window) when the
/// command finishes or is dropped for any reason, together with its share of the session's
/// write buffer quota.
struct Slot(
    Arc<Session>,
    #[allow(dead_code)] Option<WriteQuota>, // held for its Drop
    Arc<ConnStats>,
);

/// Bytes of a write counted against the session's `write_buffer_per_session`.
struct WriteQuota {
    session: Arc<Session>,
    bytes: u64,
}

impl WriteQuota {
    fn try_new(session: &Arc<Session>, bytes: u64, limit: u64) -> Option<WriteQuota> {
        session
            .buffered_writes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                (cur + bytes <= limit).then_some(cur + bytes)
            })
            .ok()?;
        Some(WriteQuota {
            session: Arc::clone(session),
            bytes,
        })
    }
}

impl Drop for WriteQuota {
    fn drop(&mut self) {
        self.session
            .buffered_writes
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.window().complete();
        self.2.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Set while a connection's reader polls a command inline (`Running::polling`); clears on
/// drop.
struct PollingFlag(Arc<std::sync::atomic::AtomicBool>);

impl PollingFlag {
    fn set(flag: &Arc<std::sync::atomic::AtomicBool>) -> Self {
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
    tx: writer::Queue,
    params: ConnParams,
    cid: u16,
    local: SocketAddr,
    peer: SocketAddr,
    pending: IntMap<Itt, PendingWrite>,
    /// Writes that want R2Ts but hit `max_r2ts_per_connection`, oldest first.
    starved: std::collections::VecDeque<Itt>,
    /// Bytes of read data allowed between the backend and the socket.
    tx_budget: Arc<Semaphore>,
    /// Continuations of long Text responses: (ITT, TTT) → remaining segments.
    text_pending: Option<(Itt, Ttt, Vec<Bytes>)>,
    tasks: tokio::task::JoinSet<()>,
    /// Reads of at least this many bytes may answer from a file LUN's page cache or mapping
    /// ([`in_place_reads`]).
    in_place: Option<ironsan_backend::InPlaceRead>,
    /// Writes of at least this many bytes may receive their Data-Out straight into a file
    /// LUN's pages ([`place_min`]).
    place_min: Option<u32>,
    next_ttt: u32,
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
    polling: Arc<std::sync::atomic::AtomicBool>,
    /// Always false: the flag of a write's running-table entry while it waits for its data.
    not_polling: Arc<std::sync::atomic::AtomicBool>,
}

/// Bytes of data the reader keeps for the writer before handing them over.
const OUT_BATCH_BYTES: usize = 64 * 1024;
/// Responses the reader keeps before handing them over even though more commands are
/// already buffered. Without it a burst of small commands (4K writes: 48-byte responses)
/// went back as one batch after the whole burst, so the initiator and the target took turns
/// instead of overlapping (4K QD32 writes: 170-177K IOPS with the target 30 % idle; with 8:
/// 275-303K at less CPU per I/O). Large responses reach [`OUT_BATCH_BYTES`] first.
const OUT_BATCH_ITEMS: usize = 8;

fn reject(reason: RejectReason, bhs: &Bhs) -> OutPdu {
    OutPdu::status(
        Header::Reject(Reject {
            reason,
            ..Default::default()
        }),
        Bytes::copy_from_slice(&bhs.0),
    )
}

/// Serve one accepted TCP connection until it closes.
pub async fn run(
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
        shared.cfg.login_timeout,
        login_phase(&mut rd, &tx, &shared, peer, portal, over_limit, &mut writer),
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
    let Some((session, params, cid, close_rx, conn_stats)) = outcome else {
        let _ = tx.send(Out::Close).await;
        drop(tx);
        let _ = writer.await;
        return;
    };
    shared.stats.logins.fetch_add(1, Ordering::Relaxed);
    tracing::info!(%peer, initiator = %session.initiator_name, target = session.target.as_ref().map(|t| t.name.as_str()).unwrap_or("(discovery)"), tsih = session.tsih.0, "login");
    let last_rx = Arc::new(AtomicU64::new(0));
    let mut conn = Connection {
        shared: Arc::clone(&shared),
        session: Arc::clone(&session),
        tx,
        params,
        cid,
        local,
        peer,
        pending: IntMap::default(),
        starved: std::collections::VecDeque::new(),
        tx_budget: Arc::new(Semaphore::new(tx_budget_bytes(&shared))),
        text_pending: None,
        tasks: tokio::task::JoinSet::new(),
        next_ttt: 1,
        last_rx: Arc::clone(&last_rx),
        epoch: Stamp::now(),
        stats: conn_stats,
        lun_metrics: IntMap::default(),
        out: Vec::new(),
        out_bytes: 0,
        writer: direct_writer,
        polling: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        not_polling: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        place_min: place_min(shared.cfg.zero_copy_writes, &params),
        in_place: in_place_reads(shared.cfg.zero_copy_reads, &params, {
            use std::os::fd::AsRawFd;
            rd.get_ref().as_ref().as_raw_fd()
        }),
    };
    let keepalive = tokio::spawn(keepalive(
        conn.tx.clone(),
        Arc::clone(&last_rx),
        conn.epoch,
        shared.cfg.nop_interval,
        shared.cfg.nop_timeout,
        Arc::clone(&session),
        cid,
    ));
    // Behind the login's Attach and Digests: from here the reader may write directly.
    let _ = conn.tx.send(Out::Direct).await;
    // This connection's own entry in the session (a CID alone need not be unique).
    let me = close_rx.clone();
    let reason = conn.full_feature(&mut rd, close_rx).await;
    // A logout or a shutdown is routine; anything else (a protocol or digest error, a reset,
    // a NOP timeout) is an error worth a warning.
    if matches!(
        reason.as_str(),
        "logout" | "closed by target" | "server shutting down"
    ) {
        tracing::info!(%peer, initiator = %session.initiator_name, tsih = session.tsih.0, "connection closed: {reason}");
    } else {
        tracing::warn!(%peer, initiator = %session.initiator_name, tsih = session.tsih.0, "connection closed: {reason}");
    }
    keepalive.abort();
    conn.pending.clear();
    conn.tasks.abort_all();
    if session.leave(cid, &me) {
        // ErrorRecoveryLevel 0: the session ends with its last connection (and no login can
        // join it from now on, `Session::join`).
        shared
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&session);
        if let Some(t) = &session.target {
            t.scsi().nexus_lost(session.nexus.id);
        }
    }
    let _ = conn.tx.send(Out::Close).await;
    drop(conn);
    let _ = writer.await;
}

type LoginOutcome = (
    Arc<Session>,
    ConnParams,
    u16,
    watch::Receiver<bool>,
    Arc<ConnStats>,
);

/// The writer task, started when the first Login Request tells the StatSN to begin with
/// (its ExpStatSN), so every login response, not only the last, goes out at once.
struct LazyWriter {
    writer: Arc<writer::Writer>,
    rx: Option<mpsc::Receiver<Out>>,
    pending: Arc<std::sync::atomic::AtomicUsize>,
    handle: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
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

/// The running writer, to wait for at the end of the connection.
struct WriterHandle(Option<tokio::task::JoinHandle<std::io::Result<()>>>);

impl std::future::IntoFuture for WriterHandle {
    type Output = ();
    type IntoFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            if let Some(h) = self.0 {
                let _ = h.await;
            }
        })
    }
}

/// Run the login phase. Returns the StatSN to start from and, on success, the session.
async fn login_phase(
    rd: &mut io::RecvBuf<OwnedReadHalf>,
    tx: &writer::Queue,
    shared: &Arc<Shared>,
    peer: SocketAddr,
    portal: Portal,
    over_limit: bool,
    writer: &mut LazyWriter,
) -> Result<Option<LoginOutcome>, ReadError> {
    use std::os::fd::AsRawFd;
    let fd = rd.get_ref().as_ref().as_raw_fd();
    let mut login = Login::new(shared.cfg.negotiation.clone());
    // Fresh CHAP identifier and challenge for this login from the OS CSPRNG. Without them a
    // CHAP login fails with 0300 rather than use a predictable challenge.
    let mut random = [0u8; CHAP_RANDOM_LEN];
    if os_random(&mut random) {
        login.set_random(random);
    } else {
        tracing::error!("the OS random number generator failed; CHAP logins will fail");
    }
    let local = portal.addr;
    let policy = Policy {
        rt: shared.runtime(),
        peer: peer.ip(),
        tag: portal.tag,
    };
    let mut assembler = text::Assembler::default();
    let mut first_stat_sn = None;
    loop {
        let rx = io::read_pdu(rd, Digests::default(), LOGIN_MAX_DATA).await?;
        let Header::LoginRequest(req) = rx.pdu.header else {
            // RFC 7143 §6.3: only Login Requests before the login completes. Nothing sensible
            // can be answered; close.
            return Ok(None);
        };
        let stat_sn = *first_stat_sn.get_or_insert(req.exp_stat_sn);
        if writer.handle.is_none() {
            let h = writer.start(stat_sn);
            writer.handle = h.0;
        }
        if over_limit {
            tracing::warn!(%peer, "too many connections: login refused (0302)");
            shared.stats.login_failed("out_of_resources");
            let (resp, data) = login.fail(&req, LoginStatus::OUT_OF_RESOURCES);
            send_login(tx, resp, data).await;
            return Ok(None);
        }
        // C-bit continuations are joined here; the state machine sees empty pairs for them.
        let parsed = match assembler.push(&rx.pdu.data, req.cont) {
            Ok(Some(text)) => text::parse(&text).map_err(|e| LoginStatus::from(&e)),
            Ok(None) => Ok(Vec::new()),
            Err(e) => Err(LoginStatus::from(&e)),
        };
        let pairs = match parsed {
            Ok(p) => p,
            Err(status) => {
                let (resp, data) = login.fail(&req, status);
                send_login(tx, resp, data).await;
                return Ok(None);
            }
        };
        match login.step(&req, pairs, &policy) {
            LoginStep::Respond(resp, data) => {
                send_login(tx, resp, data).await;
            }
            LoginStep::Fail(resp, data) => {
                // Never the secrets or the CHAP values: only who, and the status.
                let reason = login_failure_reason(resp.status_class, resp.status_detail);
                shared.stats.login_failed(reason);
                tracing::info!(%peer, status = format_args!("{:02x}{:02x}", resp.status_class, resp.status_detail), reason, "login failed");
                send_login(tx, resp, data).await;
                return Ok(None);
            }
            LoginStep::ReadyToComplete(ready) => {
                let target = ready
                    .target_name
                    .as_ref()
                    .and_then(|n| policy.rt.targets.get(n))
                    .cloned();
                let (close_tx, close_rx) = watch::channel(false);
                // Pick or create the session (leading login with TSIH 0, or a new connection).
                let mut limit_hit = false;
                let mut reinstated = None;
                let (session, new) = 'pick: {
                    let mut reg = shared.sessions.lock().unwrap_or_else(|p| p.into_inner());
                    if ready.tsih.0 == 0 {
                        let old = reg.find_same_nexus(
                            &ready.initiator_name,
                            ready.isid,
                            ready.target_name.as_deref(),
                        );
                        // Resource limits, checked before anything is disturbed; a session
                        // being reinstated does not count.
                        let replaced = usize::from(old.is_some());
                        let total = reg.len() - replaced;
                        let mine = reg.count_initiator(&ready.initiator_name) - replaced;
                        if total >= shared.cfg.max_sessions
                            || mine >= shared.cfg.max_sessions_per_initiator
                        {
                            tracing::warn!(%peer, initiator = %ready.initiator_name, total, mine, "session limit reached: login refused (0302)");
                            limit_hit = true;
                            break 'pick (None, true);
                        }
                        if let Some(old) = old {
                            // Session reinstatement (RFC 7143 §6.3.5): the old session's tasks
                            // are aborted and its connections closed.
                            tracing::info!(initiator = %ready.initiator_name, tsih = old.tsih.0, "reinstating session");
                            old.end();
                            old.close_conns(None);
                            reg.remove(&old);
                            if let Some(t) = &old.target {
                                t.scsi().nexus_lost(old.nexus.id);
                            }
                            reinstated = Some(old);
                        }
                        (None, true)
                    } else {
                        match reg.get(ready.tsih) {
                            // Every connection of a session is in one portal group.
                            Some(s)
                                if s.isid == ready.isid
                                    && s.initiator_name == ready.initiator_name
                                    && s.nexus.relative_port == portal.tag =>
                            {
                                (Some(s), false)
                            }
                            _ => (None, false),
                        }
                    }
                };
                if let Some(old) = reinstated {
                    // Nothing of the old session may happen after this login's response: its
                    // readers stop at once when told to close (even in the middle of a PDU),
                    // and once they have, no command of it can start (`Session::end`). Only
                    // I/O already in a device remains, fenced by its range (INTEGRITY.md).
                    if !old.readers_stopped(std::time::Duration::from_secs(5)).await {
                        tracing::warn!(initiator = %ready.initiator_name, tsih = old.tsih.0, "reinstated session's connections still reading after 5 s");
                    }
                }
                if limit_hit {
                    let (resp, data) = login.reject(LoginStatus::OUT_OF_RESOURCES);
                    shared.stats.login_failed("out_of_resources");
                    send_login(tx, resp, data).await;
                    return Ok(None);
                }
                if session.is_none() && !new {
                    let (resp, data) = login.reject(LoginStatus::SESSION_DOES_NOT_EXIST);
                    shared.stats.login_failed("session_does_not_exist");
                    send_login(tx, resp, data).await;
                    return Ok(None);
                }
                let Some(cparams) = login.conn_params() else {
                    // `step` said ReadyToComplete, which implies negotiated parameters.
                    let (resp, data) = login.reject(LoginStatus::TARGET_ERROR);
                    shared.stats.login_failed("target_error");
                    send_login(tx, resp, data).await;
                    return Ok(None);
                };
                let conn_stats = Arc::new(ConnStats::default());
                let conn_info = ConnInfo {
                    cid: ready.cid.0,
                    peer,
                    local,
                    params: cparams,
                    fd,
                    stats: Arc::clone(&conn_stats),
                    tx: Arc::clone(&writer.stats),
                    since: std::time::SystemTime::now(),
                    close: close_tx,
                };
                // An existing session: join it now, before the response, or be refused; it
                // may have ended since it was looked up (its last connection left, or it was
                // reinstated), and commands on an ended session would go unanswered.
                let conn_info = match &session {
                    Some(s) => {
                        let max = s.params.max_connections as usize;
                        if let Err(status) = s.join(conn_info, max) {
                            let reason = login_failure_reason(status.class(), status.detail());
                            let (resp, data) = login.reject(status);
                            shared.stats.login_failed(reason);
                            send_login(tx, resp, data).await;
                            return Ok(None);
                        }
                        None
                    }
                    None => Some(conn_info),
                };
                let tsih = match &session {
                    Some(s) => s.tsih,
                    None => Tsih(shared.alloc_tsih()),
                };
                let sn = TargetSn {
                    stat_sn,
                    exp_cmd_sn: req.cmd_sn,
                    max_cmd_sn: req.cmd_sn.plus(shared.cfg.queue_depth.saturating_sub(1)),
                };
                let (resp, data, sparams, _) = login.complete(tsih, sn);
                let session = match session {
                    Some(s) => s,
                    None => {
                        let nexus_id = shared.next_nexus_id.fetch_add(1, Ordering::Relaxed);
                        let tname = target.as_ref().map(|t| t.name.clone()).unwrap_or_default();
                        let tpgt = portal.tag;
                        let nexus = ironsan_scsi::Nexus {
                            id: nexus_id,
                            initiator_port: format!("{},i,0x{}", ready.initiator_name, ready.isid)
                                .into(),
                            target_port: format!("{tname},t,0x{tpgt:04x}").into(),
                            relative_port: tpgt,
                        };
                        let s = Arc::new(Session::new(
                            tsih,
                            ready.isid,
                            ready.initiator_name.clone(),
                            if ready.session_type == SessionType::Discovery {
                                None
                            } else {
                                target.clone()
                            },
                            sparams,
                            nexus,
                            CmdWindow::new(req.cmd_sn, shared.cfg.queue_depth),
                        ));
                        // Joined before the registry makes it findable: no other login can
                        // end it or take its place first, so this cannot fail.
                        if let Some(c) = conn_info {
                            if s.join(c, 1).is_err() {
                                tracing::error!(
                                    tsih = tsih.0,
                                    "a new session refused its first connection"
                                );
                                return Ok(None);
                            }
                        }
                        shared
                            .sessions
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(Arc::clone(&s));
                        s
                    }
                };
                send_login(tx, resp, data).await;
                let _ = tx.send(Out::Attach(Arc::clone(&session))).await;
                let _ = tx
                    .send(Out::Digests(Digests {
                        header: cparams.header_digest,
                        data: cparams.data_digest,
                    }))
                    .await;
                return Ok(Some((session, cparams, ready.cid.0, close_rx, conn_stats)));
            }
        }
    }
}

/// A metrics label for a failed login's status (RFC 7143 §11.13.5).
fn login_failure_reason(class: u8, detail: u8) -> &'static str {
    match (class, detail) {
        (2, 0x01) => "authentication",
        (2, 0x02) => "authorization",
        (2, 0x03) | (2, 0x04) => "not_found",
        (2, 0x05) => "unsupported_version",
        (2, 0x06) => "too_many_connections",
        (2, 0x07) => "missing_parameter",
        (2, 0x09) => "unsupported_session_type",
        (2, 0x0a) => "session_does_not_exist",
        (2, 0x0b) => "invalid_during_login",
        (2, _) => "initiator_error",
        (3, 0x02) => "out_of_resources",
        _ => "target_error",
    }
}

async fn send_login(tx: &writer::Queue, resp: LoginResponse, data: Bytes) {
    let _ = tx
        .send(Out::Pdus(vec![OutPdu::status(
            Header::LoginResponse(resp),
            data,
        )]))
        .await;
}

/// Target-initiated NOP-In pings (RFC 7143 §11.19): after `interval` without traffic, ping;
/// if nothing arrives within `timeout`, close the connection.
async fn keepalive(
    tx: writer::Queue,
    last_rx: Arc<AtomicU64>,
    epoch: Stamp,
    interval: std::time::Duration,
    timeout: std::time::Duration,
    session: Arc<Session>,
    cid: u16,
) {
    if interval.is_zero() {
        return;
    }
    let mut ttt = 0x1000_0000u32;
    loop {
        tokio::time::sleep(interval).await;
        let now = Stamp::now().since(epoch) / 1_000_000;
        if now.saturating_sub(last_rx.load(Ordering::Relaxed)) < interval.as_millis() as u64 {
            continue;
        }
        ttt = ttt.wrapping_add(1) | 0x1000_0000;
        let ping = Header::NopIn(NopIn {
            itt: Itt::RESERVED,
            ttt: Ttt(ttt),
            ..Default::default()
        });
        if tx
            .send(Out::Pdus(vec![OutPdu::current(ping, Bytes::new())]))
            .await
            .is_err()
        {
            return;
        }
        let sent = Stamp::now().since(epoch) / 1_000_000;
        tokio::time::sleep(timeout).await;
        if last_rx.load(Ordering::Relaxed) < sent {
            tracing::warn!(initiator = %session.initiator_name, tsih = session.tsih.0, cid, "initiator did not answer NOP-In within {timeout:?}; closing");
            session.close_conns(Some(cid));
            return;
        }
    }
}

impl Connection {
    fn write_params(&self) -> WriteParams {
        let p = &self.session.params;
        WriteParams {
            initial_r2t: p.initial_r2t,
            immediate_data: p.immediate_data,
            first_burst_length: p.first_burst_length,
            max_burst_length: p.max_burst_length,
            max_outstanding_r2t: p.max_outstanding_r2t,
            max_recv_data_segment_length: self.params.max_recv_data_segment_length,
        }
    }

    fn alloc_ttt(&mut self) -> Ttt {
        self.next_ttt = self.next_ttt.wrapping_add(1);
        if self.next_ttt == RESERVED_TAG || self.next_ttt >= 0x1000_0000 {
            self.next_ttt = 1;
        }
        Ttt(self.next_ttt)
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
                    let _ = self.tx.send(Out::Batch(batch)).await;
                }
            }
            if large {
                // Let the writer send it while the data is still in the CPU's caches, before
                // this reader produces the next large response.
                tokio::task::yield_now().await;
            }
        }
    }

    /// Admit a non-task PDU's CmdSN (NOP-Out, Text, Logout, TMF): `false` if it must be
    /// silently ignored.
    fn admit_and_complete(&self, cmd_sn: CmdSn, immediate: bool) -> bool {
        let mut w = self.session.window();
        match w.admit(cmd_sn, immediate, ()) {
            Ok(_) => {
                w.complete();
                true
            }
            Err(_) => false,
        }
    }

    /// The full feature phase loop. Returns why it ended.
    async fn full_feature(
        &mut self,
        rd: &mut io::RecvBuf<OwnedReadHalf>,
        close_rx: watch::Receiver<bool>,
    ) -> String {
        self.session.reader_started();
        let mut closed = close_rx.clone();
        let reason = tokio::select! {
            biased;
            // Told to close (reinstatement, a reset, `ctl`): stop at once, even in the middle
            // of a PDU, so nothing more that arrives here reaches a LU.
            Ok(_) = closed.wait_for(|c| *c) => if *self.shared.shutdown.borrow() {
                "server shutting down".to_string()
            } else {
                "closed by target".to_string()
            },
            r = self.serve_pdus(rd, close_rx) => r,
        };
        self.session.reader_stopped();
        // A Logout response (or anything else still kept) goes out before the close.
        self.flush().await;
        reason
    }

    async fn serve_pdus(
        &mut self,
        rd: &mut io::RecvBuf<OwnedReadHalf>,
        mut close_rx: watch::Receiver<bool>,
    ) -> String {
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
        loop {
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
                let spin = self.shared.cfg.busy_poll;
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
            let quiet = |w: &watch::Receiver<bool>| matches!(w.has_changed(), Ok(false));
            if buffered && quiet(&close_rx) && (draining || quiet(&shutdown)) {
                let header = io::read_header(rd, digests, max_data).await;
                if let Some(reason) = self.on_pdu(rd, header).await {
                    return reason;
                }
                continue;
            }
            let header = tokio::select! {
                biased;
                _ = close_rx.changed() => {
                    return if draining { "server shutting down".into() } else { "closed by target".into() };
                }
                r = shutdown.changed(), if !draining => {
                    draining = true;
                    if r.is_ok() {
                        self.async_logout_request().await;
                    }
                    continue;
                }
                h = io::read_header(rd, digests, max_data) => h,
            };
            if let Some(reason) = self.on_pdu(rd, header).await {
                return reason;
            }
        }
    }

    /// Handle one PDU whose header was read; `Some(reason)` ends the connection.
    async fn on_pdu(
        &mut self,
        rd: &mut io::RecvBuf<OwnedReadHalf>,
        header: Result<(Bhs, Bytes, ReceivePlan), ReadError>,
    ) -> Option<String> {
        let (bhs, ahs, plan) = match header {
            Ok(h) => h,
            Err(ReadError::TooLong(e)) => {
                // RFC 7143 §7.1.3: a length beyond what was negotiated is a protocol error;
                // the stream cannot be resynchronised safely.
                return Some(format!("protocol error: {e}"));
            }
            Err(e) => {
                if matches!(e, ReadError::HeaderDigest) {
                    self.stats.digest_errors.fetch_add(1, Ordering::Relaxed);
                    self.shared
                        .stats
                        .digest_errors
                        .fetch_add(1, Ordering::Relaxed);
                }
                return Some(e.to_string());
            }
        };
        self.stats.received(48 + ahs.len() + plan.data_len);
        // One clock read per PDU: the NOP-Out timer's last receive and a command's first stage.
        let t_header = Stamp::now();
        self.last_rx
            .store(t_header.since(self.epoch) / 1_000_000, Ordering::Relaxed);
        let result = match Header::decode(&bhs) {
            Header::ScsiCommand(cmd) => {
                self.on_scsi_command(rd, &bhs, ahs, &plan, cmd, t_header)
                    .await
            }
            Header::DataOut(d) => self.on_data_out(rd, &bhs, &plan, d).await,
            other => {
                let mut data = BytesMut::zeroed(plan.data_len);
                match io::read_data_into(rd, &plan, &mut data).await {
                    Ok(true) => self.on_other(&bhs, other, data.freeze()).await,
                    Ok(false) => {
                        self.send(vec![
                            self.digest_error(RejectReason::DATA_DIGEST_ERROR, &bhs)
                        ])
                        .await;
                        Ok(())
                    }
                    Err(e) => Err(e.to_string()),
                }
            }
        };
        if let Err(reason) = result {
            return Some(reason);
        }
        if !self.starved.is_empty() {
            self.serve_starved().await;
        }
        None
    }

    /// A Reject for a data digest error, counted.
    fn digest_error(&self, reason: RejectReason, bhs: &Bhs) -> OutPdu {
        tracing::warn!(peer = %self.peer, initiator = %self.session.initiator_name, tsih = self.session.tsih.0, "data digest error; PDU rejected");
        self.stats.digest_errors.fetch_add(1, Ordering::Relaxed);
        self.shared
            .stats
            .digest_errors
            .fetch_add(1, Ordering::Relaxed);
        reject(reason, bhs)
    }

    /// Ask the initiator to log out (Async Message event 1, RFC 7143 §11.9.1), used on shutdown.
    async fn async_logout_request(&mut self) {
        // Parameter3: the seconds within which the initiator should log out (RFC 7143
        // §11.9.1), the shutdown grace time.
        let secs = self
            .shared
            .cfg
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

    async fn on_scsi_command(
        &mut self,
        rd: &mut io::RecvBuf<OwnedReadHalf>,
        bhs: &Bhs,
        ahs: Bytes,
        plan: &ReceivePlan,
        cmd: ScsiCommand,
        t_header: Stamp,
    ) -> Result<(), String> {
        if self.session.target.is_none() {
            // SCSI commands are not allowed in a discovery session (RFC 7143 §4.3).
            io::skip_data(rd, plan).await.map_err(|e| e.to_string())?;
            self.send(vec![reject(RejectReason::PROTOCOL_ERROR, bhs)])
                .await;
            return Ok(());
        }
        // Immediate data goes straight into the command's buffer.
        let edtl = cmd.expected_data_transfer_length;
        let immediate_len = plan.data_len as u32;
        let oversize = cmd.write && edtl > self.shared.cfg.max_io_bytes;
        // The session's write buffer quota is taken before the buffer is allocated.
        let quota_limit = self
            .shared
            .cfg
            .write_buffer_per_session
            .max(u64::from(self.shared.cfg.max_io_bytes));
        let quota = (cmd.write && !oversize && edtl > 0)
            .then(|| WriteQuota::try_new(&self.session, u64::from(edtl), quota_limit));
        let over_quota = matches!(quota, Some(None));
        let quota = quota.flatten();
        let buffered = cmd.write && !oversize && !over_quota;
        // A write whose data all came as immediate data, already received, keeps it where it
        // lies: a slice of the receive buffer, not a copy in a buffer of its own.
        let shared = if buffered && immediate_len > 0 && immediate_len == edtl && cmd.final_bit {
            io::read_data_shared(rd, plan)
                .await
                .map_err(|e| e.to_string())?
        } else {
            None
        };
        // A write that may be received in place needs a buffer for its immediate data only.
        let place_on = if buffered && self.place_min.is_some_and(|m| edtl >= m) {
            let lun = cmd.lun.number().unwrap_or(u64::MAX);
            self.session
                .target
                .as_ref()
                .map(|t| t.scsi())
                .filter(|scsi| scsi.can_place_writes(lun))
        } else {
            None
        };
        let may_place = place_on.is_some();
        let mut buf = if buffered && shared.is_none() {
            // Capacity only: data is appended as it arrives (`io::read_data_at`).
            BytesMut::with_capacity(if may_place { immediate_len } else { edtl } as usize)
        } else {
            BytesMut::new()
        };
        let digest_ok = if let Some((_, ok)) = &shared {
            *ok
        } else if immediate_len > 0 && immediate_len <= edtl && buffered {
            io::read_data_at(rd, plan, &mut buf, 0)
                .await
                .map_err(|e| e.to_string())?
        } else if immediate_len > 0 {
            io::skip_data(rd, plan).await.map_err(|e| e.to_string())?;
            true
        } else {
            true
        };
        if cmd.itt == Itt::RESERVED {
            // RFC 7143 §11.2.1.8: 0xffffffff is reserved and names no task. Consume the CmdSN
            // so the window does not stall, and Reject.
            self.admit_and_complete(cmd.cmd_sn, cmd.immediate);
            self.send(vec![reject(RejectReason::INVALID_PDU_FIELD, bhs)])
                .await;
            return Ok(());
        }
        if self.pending.contains_key(&cmd.itt) || self.session.running().contains_key(&cmd.itt) {
            self.send(vec![reject(RejectReason::TASK_IN_PROGRESS, bhs)])
                .await;
            return Ok(());
        }
        // CmdSN: out-of-window commands are silently ignored (RFC 7143 §4.2.2.1).
        if self
            .session
            .window()
            .admit(cmd.cmd_sn, cmd.immediate, ())
            .is_err()
        {
            tracing::debug!(
                cmd_sn = cmd.cmd_sn.0,
                "command outside the CmdSN window ignored"
            );
            return Ok(());
        }
        self.session.commands.fetch_add(1, Ordering::Relaxed);
        self.stats.command(cmd.read, cmd.write, edtl);
        let slot = Slot(Arc::clone(&self.session), quota, Arc::clone(&self.stats));
        let cdb = match extended_cdb(&cmd.cdb, &ahs) {
            Some(c) => c,
            None => {
                self.send(vec![reject(RejectReason::INVALID_PDU_FIELD, bhs)])
                    .await;
                return Ok(());
            }
        };
        let fail = |reason: SenseReason| Response::check_condition(reason);
        if !digest_ok {
            // RFC 7143 §7.8: discard, Reject, and fail the command so the CmdSN is consumed.
            self.send(vec![self.digest_error(RejectReason::DATA_DIGEST_ERROR, bhs)])
                .await;
            self.finish(
                cmd,
                fail(SenseReason::ProtocolCrcError),
                None,
                DataSn(0),
                slot,
            );
            return Ok(());
        }
        if oversize {
            self.finish(
                cmd,
                fail(SenseReason::InvalidFieldInCdb { byte: 0, bit: None }),
                None,
                DataSn(0),
                slot,
            );
            return Ok(());
        }
        if over_quota {
            // SAM-5 §5.3: the session has other writes holding the buffer (a write alone always
            // fits the quota), so TASK SET FULL; the initiator retries later.
            tracing::debug!(
                itt = cmd.itt.0,
                edtl,
                "write buffer quota exhausted: TASK SET FULL"
            );
            self.finish(
                cmd,
                Response::status_only(ironsan_scsi::Status::TASK_SET_FULL),
                None,
                DataSn(0),
                slot,
            );
            return Ok(());
        }
        if immediate_len > edtl {
            self.send(vec![reject(RejectReason::PROTOCOL_ERROR, bhs)])
                .await;
            return Ok(());
        }
        if !cmd.write || edtl == 0 {
            self.spawn_exec(cmd, cdb, Bytes::new(), DataSn(0), slot, t_header, false);
            return Ok(());
        }
        let transfer =
            match WriteTransfer::new(edtl, immediate_len, cmd.final_bit, self.write_params()) {
                Ok(t) => t,
                Err(_) => {
                    self.send(vec![reject(RejectReason::PROTOCOL_ERROR, bhs)])
                        .await;
                    self.finish(
                        cmd,
                        fail(SenseReason::DataPhaseError),
                        None,
                        DataSn(0),
                        slot,
                    );
                    return Ok(());
                }
            };
        if let Some((data, _)) = shared {
            if transfer.is_complete() {
                self.spawn_exec(cmd, cdb, data, transfer.r2t_count(), slot, t_header, false);
                return Ok(());
            }
            buf.extend_from_slice(&data);
        }
        // Its blocks' range is taken here, but nothing reaches the medium before the write
        // is admitted below: a session that has ended must change nothing.
        let slot_placed = place_on.and_then(|scsi| {
            let lun = cmd.lun.number()?;
            let edtl = cmd.expected_data_transfer_length;
            let p = scsi.place_write(lun, &self.session.nexus, &cdb, edtl)?;
            Some(Arc::new(PlacedSlot::new(p)))
        });
        // The write is a task from here on, also while it waits for its Data-Out: a task
        // management function of any session (ABORT TASK, CLEAR TASK SET, a LUN or target
        // reset) finds it in the running table, and removing the entry aborts it.
        let waiting = Running {
            lun: cmd.lun.number().unwrap_or(u64::MAX),
            abort: None,
            polling: Arc::clone(&self.not_polling),
            placed: slot_placed.clone(),
        };
        if !self.session.admit(cmd.itt, waiting, false) {
            // The session has ended: the write never runs (dropping the slot releases it).
            return Ok(());
        }
        // Immediate data first, through the slot: an abort from now on empties it, and
        // nothing is put after that.
        let placed = slot_placed.and_then(|slot| {
            let mut placement = io::Placement::default();
            match placement.put(&*slot, 0, &buf) {
                Ok(()) => Some((slot, placement)),
                Err(_) => {
                    // The medium refused it (or an abort took the write): the usual path
                    // writes, and reports, everything; an aborted write's claim fails there.
                    drop(slot.take());
                    None
                }
            }
        });
        if placed.is_some() {
            buf = BytesMut::new();
        }
        let pw = PendingWrite {
            cmd,
            cdb,
            transfer,
            buf,
            placed,
            discard: false,
            slot,
            t_header,
        };
        self.advance_write(pw).await;
        Ok(())
    }

    /// Send any R2Ts the write now needs, or execute it if all data is in.
    async fn advance_write(&mut self, mut pw: PendingWrite) {
        if pw.transfer.is_complete() {
            if pw.discard {
                // Aborted: its last data is in; it ends here, unanswered.
                return;
            }
            let exp_data_sn = pw.transfer.r2t_count();
            if let Some((slot, placement)) = pw.placed.take() {
                let Some(placed) = slot.take() else {
                    // Aborted while it waited (its range is released already).
                    return;
                };
                if placement.is_pending() {
                    // Every byte arrived, so no block can be waiting for more: a bug if so.
                    let resp = Response::check_condition(SenseReason::InternalTargetFailure);
                    self.finish_waiting(pw.cmd, resp, exp_data_sn, pw.slot);
                    return;
                }
                let t = pw.t_header;
                self.spawn_exec(pw.cmd, pw.cdb, placed, exp_data_sn, pw.slot, t, true);
                return;
            }
            // Every byte arrived; a buffer filled out of order is as long as the transfer.
            pw.buf
                .resize(pw.cmd.expected_data_transfer_length as usize, 0);
            self.spawn_exec(
                pw.cmd,
                pw.cdb,
                pw.buf.freeze(),
                exp_data_sn,
                pw.slot,
                pw.t_header,
                true,
            );
            return;
        }
        let room = self
            .r2t_room()
            .saturating_sub(pw.transfer.outstanding_r2ts());
        let out = self.issue_r2ts(&mut pw, room);
        let itt = pw.cmd.itt;
        if pw.transfer.wants_r2t() && !self.starved.contains(&itt) {
            self.starved.push_back(itt);
        }
        self.pending.insert(itt, pw);
        if !out.is_empty() {
            self.send(out).await;
        }
    }

    /// How many more R2Ts the connection may have outstanding.
    fn r2t_room(&self) -> usize {
        let outstanding: usize = self
            .pending
            .values()
            .map(|p| p.transfer.outstanding_r2ts())
            .sum();
        self.shared
            .cfg
            .max_r2ts_per_connection
            .max(1)
            .saturating_sub(outstanding)
    }

    fn issue_r2ts(&mut self, pw: &mut PendingWrite, limit: usize) -> Vec<OutPdu> {
        let r2ts = pw.transfer.next_r2ts_limited(limit, || self.alloc_ttt());
        r2ts.into_iter()
            .map(|r| {
                OutPdu::current(
                    Header::R2t(R2t {
                        lun: pw.cmd.lun,
                        itt: pw.cmd.itt,
                        ttt: r.ttt,
                        r2t_sn: r.r2t_sn,
                        buffer_offset: r.offset,
                        desired_data_transfer_length: r.len,
                        ..Default::default()
                    }),
                    Bytes::new(),
                )
            })
            .collect()
    }

    /// Give R2Ts to writes that were held back by `max_r2ts_per_connection`, oldest first.
    async fn serve_starved(&mut self) {
        let mut out = Vec::new();
        while let Some(itt) = self.starved.front().copied() {
            let room = self.r2t_room();
            if room == 0 {
                break;
            }
            self.starved.pop_front();
            let Some(mut pw) = self.pending.remove(&itt) else {
                continue;
            };
            out.extend(self.issue_r2ts(&mut pw, room));
            let again = pw.transfer.wants_r2t();
            self.pending.insert(itt, pw);
            if again {
                self.starved.push_front(itt);
                if self.r2t_room() == 0 {
                    break;
                }
            }
        }
        if !out.is_empty() {
            self.send(out).await;
        }
    }

    async fn on_data_out(
        &mut self,
        rd: &mut io::RecvBuf<OwnedReadHalf>,
        bhs: &Bhs,
        plan: &ReceivePlan,
        d: DataOut,
    ) -> Result<(), String> {
        let len = plan.data_len as u32;
        let Some(mut pw) = self.pending.remove(&d.itt) else {
            // Data-Out for no live write (RFC 7143 §11.7): discard and Reject.
            io::skip_data(rd, plan).await.map_err(|e| e.to_string())?;
            self.send(vec![reject(RejectReason::INVALID_PDU_FIELD, bhs)])
                .await;
            return Ok(());
        };
        if let Err(e) = pw.transfer.accept(&d, len) {
            io::skip_data(rd, plan).await.map_err(|e| e.to_string())?;
            tracing::debug!(itt = d.itt.0, "Data-Out refused: {e}");
            // ErrorRecoveryLevel 0 cannot recover a broken data sequence: Reject the PDU and
            // end the command with CHECK CONDITION, so nothing is written.
            self.send(vec![reject(RejectReason::PROTOCOL_ERROR, bhs)])
                .await;
            let reason = match e {
                DataOutError::BadDataSn | DataOutError::BadOffset | DataOutError::OutsideR2t => {
                    SenseReason::DataPhaseError
                }
                _ => SenseReason::DataPhaseError,
            };
            let n = pw.transfer.r2t_count();
            self.finish_waiting(pw.cmd, Response::check_condition(reason), n, pw.slot);
            return Ok(());
        }
        let off = d.buffer_offset as usize;
        if off + len as usize > pw.cmd.expected_data_transfer_length as usize {
            return Err("Data-Out outside the command buffer".into());
        }
        if pw.discard {
            io::skip_data(rd, plan).await.map_err(|e| e.to_string())?;
            self.advance_write(pw).await;
            return Ok(());
        }
        if let Some((slot, placement)) = &mut pw.placed {
            let placed_ok = placement
                .receive(rd, plan, &**slot, off)
                .await
                .map_err(|e| e.to_string())?;
            if let Err(e) = placed_ok {
                let Some(placed) = pw.placed.take().and_then(|(slot, _)| slot.take()) else {
                    // A task management function aborted it (and emptied the slot; the rest
                    // of this segment was skipped): take the rest of its data and drop it.
                    pw.discard = true;
                    self.advance_write(pw).await;
                    return Ok(());
                };
                tracing::warn!(itt = d.itt.0, "Data-Out not received in place: {e}");
                let reason = placed.failed(&e);
                let n = pw.transfer.r2t_count();
                self.finish_waiting(pw.cmd, Response::check_condition(reason), n, pw.slot);
                return Ok(());
            }
            self.shared
                .stats
                .zero_copy_write_bytes
                .fetch_add(u64::from(len), Ordering::Relaxed);
            self.advance_write(pw).await;
            return Ok(());
        }
        let ok = io::read_data_at(rd, plan, &mut pw.buf, off)
            .await
            .map_err(|e| e.to_string())?;
        if !ok {
            self.send(vec![self.digest_error(RejectReason::DATA_DIGEST_ERROR, bhs)])
                .await;
            let n = pw.transfer.r2t_count();
            let resp = Response::check_condition(SenseReason::ProtocolCrcError);
            self.finish_waiting(pw.cmd, resp, n, pw.slot);
            return Ok(());
        }
        self.advance_write(pw).await;
        Ok(())
    }

    /// Run a command whose data is complete on its own task (normal sessions only). With
    /// `waited`, a write takes over the running-table entry it has had since it began
    /// waiting for its data (and does not run if that was removed); any other command enters
    /// the table here.
    #[allow(clippy::too_many_arguments)]
    fn spawn_exec(
        &mut self,
        cmd: ScsiCommand,
        cdb: Bytes,
        data_out: impl Into<WriteData>,
        exp_data_sn: DataSn,
        slot: Slot,
        t_header: Stamp,
        waited: bool,
    ) {
        // A command without Data-Out comes here straight from its header: no second clock
        // read for a stage that is empty.
        let t_data = if cmd.write { Stamp::now() } else { t_header };
        let Some(target) = self.session.target.clone() else {
            return;
        };
        let session = Arc::clone(&self.session);
        let shared = Arc::clone(&self.shared);
        let scmd_op = cdb.first().copied().unwrap_or(0);
        let max_xmit = self.params.max_xmit_data_segment_length;
        let max_burst = session.params.max_burst_length;
        let in_place = self.in_place;
        let lun = cmd.lun.number().unwrap_or(u64::MAX);
        let itt = cmd.itt;
        // The LUN map as of this command: a LUN removed meanwhile still finishes this command.
        let scsi = target.scsi();
        // Latency counters only for LUNs that exist (an initiator cannot make entries).
        let metrics = match self.lun_metrics.get(&lun) {
            Some(m) => Some(Arc::clone(m)),
            None if scsi.lun(lun).is_some() => {
                let m = target.lun_metrics(lun);
                self.lun_metrics.insert(lun, Arc::clone(&m));
                Some(m)
            }
            None => None,
        };
        let class = Class::of(cmd.read, cmd.write);
        let (data_out, placed) = match data_out.into() {
            WriteData::Buffer(b) => (b, None),
            WriteData::Placed(p) => (Bytes::new(), Some(p)),
        };
        let write_bytes = match &placed {
            Some(p) => p.target().len(),
            None => data_out.len(),
        };
        let write_needed = if cmd.write {
            let bs = scsi.lun(lun).map(|l| l.block_size()).unwrap_or(512);
            Some(ironsan_scsi::data_out_len(&cdb, bs).unwrap_or(write_bytes as u32))
        } else {
            None
        };
        let write_bytes = write_bytes as u64;
        // A read first takes its size from the connection's transmit budget (returned when the
        // writer has sent its Data-In), holding its CmdSN slot while it waits.
        let budget = (cmd.read && cmd.expected_data_transfer_length > 0).then(|| {
            let n = (cmd.expected_data_transfer_length as usize).min(tx_budget_bytes(&shared));
            (Arc::clone(&self.tx_budget), n as u32)
        });
        // The command is in the running table before it can complete, so a task management
        // function (from any connection of the session) and the completion agree on who
        // answers it: whoever removes the entry.
        // Cleared however this function ends (a panic in the inline poll included): a flag
        // left set would make the LU's reads and writes wait for an aborted task forever.
        let _polling = PollingFlag::set(&self.polling);
        let admitted = session.admit(
            itt,
            Running {
                lun,
                abort: None,
                polling: Arc::clone(&self.polling),
                placed: None,
            },
            waited,
        );
        if !admitted {
            // The session has ended (reinstated or reset away), or a task management function
            // aborted the write while it waited for data: the command never runs.
            return;
        }
        let body = {
            let session = Arc::clone(&session);
            async move {
                // Execution starts when the budget is had: no second clock read when it was
                // there at once (the usual case).
                let (permit, t_exec) = match budget {
                    Some((b, n)) => match Arc::clone(&b).try_acquire_many_owned(n) {
                        Ok(p) => (Some(p), t_data),
                        Err(_) => {
                            let p = b.acquire_many_owned(n).await.ok()?;
                            (Some(p), Stamp::now())
                        }
                    },
                    None => (None, t_data),
                };
                let resp = match placed {
                    // The data is in place; the command's checks were made before it came.
                    Some(p) => match p.finish() {
                        Ok(()) => Response::good(Bytes::new()),
                        Err(reason) => Response::check_condition(reason),
                    },
                    None => {
                        let scmd = Command {
                            cdb,
                            data_out,
                            expected_in_len: cmd.expected_data_transfer_length,
                            in_place,
                        };
                        scsi.execute(lun, &session.nexus, scmd).await
                    }
                };
                let t_done = Stamp::now();
                // Whoever removes the entry owns the completion: TMF or us, never both.
                session.running().remove(&itt)?;
                if scmd_op == ironsan_scsi::opcode::PERSISTENT_RESERVE_OUT {
                    abort_preempted(&shared, &target, lun);
                }
                let bytes = match class {
                    Class::Read => (resp.data_in.len() as u64)
                        .min(u64::from(cmd.expected_data_transfer_length)),
                    Class::Write => write_bytes,
                    Class::Other => 0,
                };
                let pdus =
                    response_pdus(&cmd, resp, write_needed, exp_data_sn, max_xmit, max_burst);
                drop(slot);
                let timing = metrics.map(|lun| Timing {
                    lun,
                    class,
                    bytes,
                    header: t_header,
                    data: t_data,
                    exec: t_exec,
                    done: t_done,
                    queued: Stamp::now(),
                });
                Some(Out::Command {
                    pdus,
                    permit,
                    timing,
                })
            }
        };
        // Most commands (RAM, the page-cache fast path of file LUNs, errors) complete the
        // first time they are polled: run them here, with no task, no wake-up and no queue
        // hop, and keep the response for the writer's next batch. The rest become tasks.
        let mut body = Box::pin(body);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match body.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(Some(out)) => self.keep(out),
            std::task::Poll::Ready(None) => {}
            std::task::Poll::Pending => {
                let tx = self.tx.clone();
                // Polled again by the task, every future in `body` registers the task's
                // waker in place of the no-op one.
                let handle = self.tasks.spawn(async move {
                    if let Some(out) = body.await {
                        let _ = tx.send(out).await;
                    }
                });
                let mut running = session.running();
                match running.get_mut(&itt) {
                    Some(r) => r.abort = Some(handle),
                    None => {
                        // A task management function took the entry while the command was
                        // polled here: it is aborted, like every other task it found.
                        drop(running);
                        handle.abort();
                        let scsi = self.session.target.as_ref().map(|t| t.scsi());
                        if let Some(lu) = scsi.as_ref().and_then(|s| s.lun(lun)) {
                            lu.task_aborted(move || handle.is_finished());
                        }
                    }
                }
            }
        }
        // Out of the inline poll (completed, or a task that an abort now knows about): the
        // flag clears as `_polling` drops.
    }

    /// Complete a write that failed while waiting for its data, if its running-table entry
    /// is still there to take (else a task management function aborted it: no response).
    fn finish_waiting(&mut self, cmd: ScsiCommand, resp: Response, n: DataSn, slot: Slot) {
        if self.session.running().remove(&cmd.itt).is_some() {
            self.finish(cmd, resp, None, n, slot);
        }
    }

    /// Complete a command that never reached the SCSI layer.
    fn finish(
        &mut self,
        cmd: ScsiCommand,
        resp: Response,
        write_needed: Option<u32>,
        exp_data_sn: DataSn,
        slot: Slot,
    ) {
        let pdus = response_pdus(
            &cmd,
            resp,
            write_needed,
            exp_data_sn,
            self.params.max_xmit_data_segment_length,
            self.session.params.max_burst_length,
        );
        drop(slot);
        let tx = self.tx.clone();
        self.tasks.spawn(async move {
            let _ = tx.send(Out::Pdus(pdus)).await;
        });
    }

    async fn on_other(&mut self, bhs: &Bhs, header: Header, data: Bytes) -> Result<(), String> {
        match header {
            Header::NopOut(n) => {
                if n.itt == Itt::RESERVED {
                    // Answer to our ping (or an unsolicited no-op): nothing to send.
                    return Ok(());
                }
                if !self.admit_and_complete(n.cmd_sn, n.immediate) {
                    return Ok(());
                }
                // Ping: echo the data (RFC 7143 §11.18.1), no more of it than the
                // initiator's MaxRecvDataSegmentLength (§11.18.4): the ping may carry up to
                // ours, which can be the larger.
                let resp = Header::NopIn(NopIn {
                    lun: n.lun,
                    itt: n.itt,
                    ttt: Ttt::RESERVED,
                    ..Default::default()
                });
                let echo = data
                    .len()
                    .min(self.params.max_xmit_data_segment_length as usize);
                self.send(vec![OutPdu::status(resp, data.slice(..echo))])
                    .await;
            }
            Header::TextRequest(t) => {
                if !self.admit_and_complete(t.cmd_sn, t.immediate) {
                    return Ok(());
                }
                self.on_text(t, data).await;
            }
            Header::TaskMgmtRequest(t) => {
                if !self.admit_and_complete(t.cmd_sn, t.immediate) {
                    return Ok(());
                }
                let code = self.task_management(&t);
                tracing::info!(
                    peer = %self.peer,
                    initiator = %self.session.initiator_name,
                    tsih = self.session.tsih.0,
                    function = tmf_name(t.function),
                    lun = t.lun.number().map(|l| l as i64).unwrap_or(-1),
                    itt = t.itt.0,
                    response = tmf_response_name(code),
                    "task management"
                );
                let resp = Header::TaskMgmtResponse(TaskMgmtResponse {
                    response: code,
                    itt: t.itt,
                    ..Default::default()
                });
                self.send(vec![OutPdu::status(resp, Bytes::new())]).await;
                if t.function == TmfFunction::TARGET_COLD_RESET && code == TmfResponseCode::COMPLETE
                {
                    return Err("target cold reset".into());
                }
            }
            Header::LogoutRequest(l) => {
                if !self.admit_and_complete(l.cmd_sn, l.immediate) {
                    return Ok(());
                }
                return self.on_logout(l).await;
            }
            Header::SnackRequest(_) => {
                // No SNACK at ErrorRecoveryLevel 0 (RFC 7143 §11.16).
                self.send(vec![reject(RejectReason::SNACK_REJECT, bhs)])
                    .await;
            }
            Header::LoginRequest(_) => {
                // A login on a connection already in full feature phase (RFC 7143 §6.3).
                self.send(vec![reject(RejectReason::PROTOCOL_ERROR, bhs)])
                    .await;
            }
            Header::Unknown(_) => {
                self.send(vec![reject(RejectReason::COMMAND_NOT_SUPPORTED, bhs)])
                    .await;
            }
            _ => {
                // Target-only opcodes sent by an initiator.
                self.send(vec![reject(RejectReason::PROTOCOL_ERROR, bhs)])
                    .await;
            }
        }
        Ok(())
    }

    fn task_management(&mut self, t: &TaskMgmtRequest) -> TmfResponseCode {
        let Some(target) = self.session.target.clone() else {
            return TmfResponseCode::REJECTED;
        };
        let lun = t.lun.number();
        let scsi = target.scsi();
        let lun_exists = lun.is_some_and(|l| scsi.lun(l).is_some());
        match t.function {
            TmfFunction::ABORT_TASK => {
                let rtt = t.referenced_task_tag;
                if self.pending.remove(&rtt).is_some() {
                    self.session.running().remove(&rtt);
                    return TmfResponseCode::COMPLETE;
                }
                if self.session.abort_where(|itt, _| *itt == rtt) > 0 {
                    return TmfResponseCode::COMPLETE;
                }
                // RFC 7143 §11.5.1: a referenced task that was never received (its CmdSN is
                // inside the window and before this request) counts as aborted; a task that
                // already completed (CmdSN below ExpCmdSN) does not exist any more.
                let (exp, max) = self.session.window_sn();
                let never_received =
                    t.ref_cmd_sn.ge(exp) && t.ref_cmd_sn.le(max) && t.ref_cmd_sn.lt(t.cmd_sn);
                if never_received {
                    TmfResponseCode::COMPLETE
                } else {
                    TmfResponseCode::TASK_DOES_NOT_EXIST
                }
            }
            TmfFunction::ABORT_TASK_SET
            | TmfFunction::CLEAR_TASK_SET
            | TmfFunction::LOGICAL_UNIT_RESET => {
                let Some(lun) = lun.filter(|_| lun_exists) else {
                    return TmfResponseCode::LUN_DOES_NOT_EXIST;
                };
                self.pending.retain(|_, p| p.cmd.lun.number() != Some(lun));
                self.session.abort_where(|_, r| r.lun == lun);
                if t.function != TmfFunction::ABORT_TASK_SET {
                    // CLEAR TASK SET and LUN RESET affect every initiator's tasks on the LUN.
                    for s in self
                        .shared
                        .sessions
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .of_target(&target.name)
                    {
                        // SAM-5, TAS=0: an initiator whose commands were aborted (and so get
                        // no status) is told with a unit attention on its next command.
                        let cleared = s.abort_where(|_, r| r.lun == lun);
                        let ua = match t.function {
                            TmfFunction::CLEAR_TASK_SET => {
                                UnitAttention::CommandsClearedByAnotherInitiator
                            }
                            _ => UnitAttention::PowerOnReset,
                        };
                        if cleared > 0 && !Arc::ptr_eq(&s, &self.session) {
                            if let Some(lu) = scsi.lun(lun) {
                                lu.establish_unit_attention_on(&s.nexus, ua);
                            }
                        }
                    }
                }
                if t.function == TmfFunction::LOGICAL_UNIT_RESET {
                    if let Some(lu) = scsi.lun(lun) {
                        lu.reset(&self.session.nexus);
                    }
                }
                TmfResponseCode::COMPLETE
            }
            TmfFunction::TARGET_WARM_RESET | TmfFunction::TARGET_COLD_RESET => {
                self.pending.clear();
                let sessions = self
                    .shared
                    .sessions
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .of_target(&target.name);
                for s in &sessions {
                    let cleared = s.abort_where(|_, _| true);
                    if cleared > 0 && !Arc::ptr_eq(s, &self.session) {
                        // As after a LUN RESET: told on its next command, even if no LU had
                        // seen it yet (its only commands writes waiting for data).
                        for (_, lu) in scsi.luns() {
                            lu.establish_unit_attention_on(&s.nexus, UnitAttention::PowerOnReset);
                        }
                    }
                }
                for (_, lu) in scsi.luns() {
                    lu.reset(&self.session.nexus);
                }
                if t.function == TmfFunction::TARGET_COLD_RESET {
                    for s in sessions.iter().filter(|s| !Arc::ptr_eq(s, &self.session)) {
                        s.end();
                        s.close_conns(None);
                    }
                }
                TmfResponseCode::COMPLETE
            }
            TmfFunction::CLEAR_ACA => TmfResponseCode::NOT_SUPPORTED,
            TmfFunction::TASK_REASSIGN => TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED,
            _ => TmfResponseCode::REJECTED,
        }
    }

    async fn on_logout(&mut self, l: LogoutRequest) -> Result<(), String> {
        // Responses kept for the writer go out first: they hold transmit budget that commands
        // still running (waited for below) may need.
        self.flush().await;
        let mut code = LogoutResponseCode::CLOSED;
        let mut close_self = false;
        match l.reason {
            LogoutReason::CLOSE_SESSION => {
                close_self = true;
                // Let this connection's commands finish and send their responses first.
                while self.tasks.join_next().await.is_some() {}
                self.session.close_conns(None);
            }
            LogoutReason::CLOSE_CONNECTION if l.cid.0 == self.cid => {
                close_self = true;
                while self.tasks.join_next().await.is_some() {}
            }
            LogoutReason::CLOSE_CONNECTION => {
                if self.session.conn_count() > 1 {
                    self.session.close_conns(Some(l.cid.0));
                } else {
                    code = LogoutResponseCode::CID_NOT_FOUND;
                }
            }
            _ => code = LogoutResponseCode::RECOVERY_NOT_SUPPORTED,
        }
        tracing::info!(
            peer = %self.peer,
            initiator = %self.session.initiator_name,
            tsih = self.session.tsih.0,
            cid = l.cid.0,
            reason = match l.reason {
                LogoutReason::CLOSE_SESSION => "close session",
                LogoutReason::CLOSE_CONNECTION => "close connection",
                _ => "recovery",
            },
            response = code.0,
            "logout"
        );
        let resp = Header::LogoutResponse(LogoutResponse {
            response: code,
            itt: l.itt,
            time2wait: self.session.params.default_time2wait,
            time2retain: 0,
            ..Default::default()
        });
        self.send(vec![OutPdu::status(resp, Bytes::new())]).await;
        if close_self {
            return Err("logout".into());
        }
        Ok(())
    }

    async fn on_text(&mut self, t: TextRequest, data: Bytes) {
        let max = self.params.max_xmit_data_segment_length.max(512) as usize;
        // Continuation of a long response (RFC 7143 §6.2): an empty request with our TTT.
        if t.ttt != Ttt::RESERVED {
            if let Some((itt, ttt, mut rest)) = self.text_pending.take() {
                if itt == t.itt && ttt == t.ttt && !rest.is_empty() {
                    let chunk = rest.remove(0);
                    let more = !rest.is_empty();
                    if more {
                        self.text_pending = Some((itt, ttt, rest));
                    }
                    self.send_text(&t, chunk, more, ttt).await;
                    return;
                }
            }
        }
        self.text_pending = None;
        let pairs = match text::parse(&data) {
            Ok(p) => p,
            Err(_) => {
                let resp = Header::Reject(Reject {
                    reason: RejectReason::PROTOCOL_ERROR,
                    ..Default::default()
                });
                self.send(vec![OutPdu::status(resp, Bytes::new())]).await;
                return;
            }
        };
        let mut out: Vec<(String, String)> = Vec::new();
        let mut others = Vec::new();
        for (k, v) in pairs {
            if k == "SendTargets" {
                out.extend(self.send_targets(&v));
            } else {
                others.push((k, v));
            }
        }
        if !others.is_empty() {
            let mut neg = Negotiator::new(&self.shared.cfg.negotiation);
            out.extend(neg.respond_full_feature(&others).pairs);
        }
        let encoded = text::encode(&out);
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut off = 0;
        while off < encoded.len() {
            let end = (off + max).min(encoded.len());
            chunks.push(encoded.slice(off..end));
            off = end;
        }
        if chunks.is_empty() {
            chunks.push(Bytes::new());
        }
        let first = chunks.remove(0);
        if chunks.is_empty() {
            self.send_text(&t, first, false, Ttt::RESERVED).await;
        } else {
            let ttt = self.alloc_ttt();
            self.text_pending = Some((t.itt, ttt, chunks));
            self.send_text(&t, first, true, ttt).await;
        }
    }

    async fn send_text(&mut self, t: &TextRequest, data: Bytes, more: bool, ttt: Ttt) {
        let resp = Header::TextResponse(TextResponse {
            final_bit: !more,
            cont: more,
            lun: t.lun,
            itt: t.itt,
            ttt: if more { ttt } else { Ttt::RESERVED },
            ..Default::default()
        });
        self.send(vec![OutPdu::status(resp, data)]).await;
    }

    /// SendTargets (RFC 7143 §13.3, Appendix C): `All` lists every target (discovery
    /// sessions only); a name lists that target; empty means the session's target.
    fn send_targets(&self, value: &str) -> Vec<(String, String)> {
        let discovery = self.session.target.is_none();
        let rt = self.shared.runtime();
        let mut names: Vec<&Arc<LiveTarget>> = match value {
            "All" if discovery => rt.targets.values().collect(),
            "All" | "" => self.session.target.iter().collect(),
            name => rt.targets.get(name).into_iter().collect(),
        };
        // Only the targets this initiator may log in to (its ACLs; CHAP is checked at login).
        let initiator = &self.session.initiator_name;
        let peer = self.peer.ip();
        names.retain(|t| rt.access(&t.name).allows(initiator, peer));
        names.sort_by(|a, b| a.name.cmp(&b.name));
        let portals = self
            .shared
            .portals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut out = Vec::new();
        for t in names {
            out.push(("TargetName".to_string(), t.name.clone()));
            // The portals of the target's groups, each with its group's tag.
            for p in portals.iter().filter(|p| rt.served_on(&t.name, p.tag)) {
                // A wildcard listener is reached at the address this connection came in on.
                let ip = if p.addr.ip().is_unspecified() {
                    self.local.ip()
                } else {
                    p.addr.ip()
                };
                let addr = SocketAddr::new(ip, p.addr.port());
                out.push(("TargetAddress".to_string(), format!("{addr},{}", p.tag)));
            }
        }
        out
    }
}

/// PREEMPT AND ABORT (SPC-4): the SCSI layer names the I_T nexuses whose tasks on the LUN
/// must be aborted; find their sessions and abort those tasks (no responses are sent for them).
/// The name of a task management function, for the log.
fn tmf_name(f: TmfFunction) -> &'static str {
    match f {
        TmfFunction::ABORT_TASK => "ABORT TASK",
        TmfFunction::ABORT_TASK_SET => "ABORT TASK SET",
        TmfFunction::CLEAR_ACA => "CLEAR ACA",
        TmfFunction::CLEAR_TASK_SET => "CLEAR TASK SET",
        TmfFunction::LOGICAL_UNIT_RESET => "LOGICAL UNIT RESET",
        TmfFunction::TARGET_WARM_RESET => "TARGET WARM RESET",
        TmfFunction::TARGET_COLD_RESET => "TARGET COLD RESET",
        TmfFunction::TASK_REASSIGN => "TASK REASSIGN",
        _ => "unknown",
    }
}

/// The name of a task management response, for the log.
fn tmf_response_name(c: TmfResponseCode) -> &'static str {
    match c {
        TmfResponseCode::COMPLETE => "complete",
        TmfResponseCode::TASK_DOES_NOT_EXIST => "task does not exist",
        TmfResponseCode::LUN_DOES_NOT_EXIST => "LUN does not exist",
        TmfResponseCode::TASK_STILL_ALLEGIANT => "task still allegiant",
        TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED => "reassignment not supported",
        TmfResponseCode::NOT_SUPPORTED => "not supported",
        TmfResponseCode::AUTHORIZATION_FAILED => "authorization failed",
        _ => "rejected",
    }
}

fn abort_preempted(shared: &Shared, target: &LiveTarget, lun: u64) {
    let Some(lu) = target.scsi().lun(lun).cloned() else {
        return;
    };
    let victims = lu.take_pr_aborts();
    if victims.is_empty() {
        return;
    }
    let sessions = shared
        .sessions
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .of_target(&target.name);
    for s in sessions {
        let hit = victims
            .iter()
            .any(|(i, t)| *i == s.nexus.initiator_port && *t == s.nexus.target_port);
        if hit {
            s.abort_where(|_, r| r.lun == lun);
        }
    }
}

/// The CDB with any Extended CDB AHS appended (RFC 7143 §11.2.2.3). `None` if an AHS is
/// malformed.
fn extended_cdb(cdb16: &[u8; 16], ahs: &Bytes) -> Option<Bytes> {
    if ahs.is_empty() {
        return Some(Bytes::copy_from_slice(cdb16));
    }
    let mut cdb = cdb16.to_vec();
    let mut rest = &ahs[..];
    while !rest.is_empty() {
        let hdr = rest.get(..3)?;
        let len = u16::from_be_bytes([hdr[0], hdr[1]]) as usize;
        let ahs_type = hdr[2];
        let body = rest.get(4..4 + len.saturating_sub(1))?;
        if ahs_type == 1 {
            cdb.extend_from_slice(body);
        }
        let total = 4 + len.saturating_sub(1);
        let padded = total + ironsan_proto::pdu::pad_len(total);
        rest = rest.get(padded..).unwrap_or(&[]);
    }
    Some(Bytes::from(cdb))
}

/// The smallest read sent straight from a file LUN's page cache or mapping (below it the
/// `cachestat` a mapped read asks costs about what the copy saves), and the smallest
/// MaxRecvDataSegmentLength for which `sendfile` is used: each Data-In segment then costs a
/// `sendfile` (and a `sendmsg` for its header) instead of two copies; below this, copying
/// into one batched vectored write is cheaper (docs/PERFORMANCE.md).
const IN_PLACE_MIN: u32 = 64 * 1024;

/// Writes whose Data-Out is received in place: from 64 KiB (below that the data mostly
/// arrives with the command, already buffered), and only without a data digest, which must be
/// checked before a byte may reach the medium.
fn place_min(on: bool, params: &ConnParams) -> Option<u32> {
    (on && !params.data_digest).then_some(IN_PLACE_MIN)
}

/// Whether and how a connection sends large file-LUN reads without copying them
/// ([`crate::ZeroCopyReads`]): never with a data digest (it needs the bytes); `sendfile` only
/// with segments of at least [`IN_PLACE_MIN`] and, in `auto`, on a connection whose congestion
/// control does not pace inside TCP (BBR), where a mapping of a tmpfs file is sent from
/// instead (docs/PERFORMANCE.md). Reads of nothing stored may go as the zero page with
/// `sendfile` in `on` and `auto` alike, given segments of at least [`IN_PLACE_MIN`].
fn in_place_reads(
    mode: crate::ZeroCopyReads,
    params: &ConnParams,
    fd: std::os::fd::RawFd,
) -> Option<ironsan_backend::InPlaceRead> {
    use crate::ZeroCopyReads as Z;
    use ironsan_backend::SendFrom;
    if params.data_digest {
        return None;
    }
    let big_segments = params.max_xmit_data_segment_length >= IN_PLACE_MIN;
    let from = match mode {
        Z::Off => return None,
        Z::On if big_segments => SendFrom::PageCache,
        Z::On => return None,
        Z::Mapped => SendFrom::Mapping,
        Z::Auto => {
            let paced = crate::sys::tcp_congestion(fd).is_ok_and(|cc| cc.starts_with("bbr"));
            if big_segments && !paced {
                SendFrom::PageCache
            } else {
                SendFrom::Mapping
            }
        }
    };
    Some(ironsan_backend::InPlaceRead {
        min: IN_PLACE_MIN,
        from,
        zero_page: big_segments && mode != Z::Mapped,
    })
}

/// Turn a SCSI response into iSCSI PDUs: Data-In (with the status collapsed into the last
/// one when there is no sense data) and/or a SCSI Response, with residuals against the
/// Expected Data Transfer Length (RFC 7143 §11.4.5, §11.7).
fn response_pdus(
    cmd: &ScsiCommand,
    resp: Response,
    write_needed: Option<u32>,
    exp_data_sn: DataSn,
    max_xmit: u32,
    max_burst: u32,
) -> Vec<OutPdu> {
    let edtl = cmd.expected_data_transfer_length;
    let mut out = Vec::new();
    let produced = resp.data_in.len() as u32;
    let (data, residual) = if cmd.read {
        let send = produced.min(edtl);
        // Moved, not cloned: a clone of a freshly frozen buffer allocates its shared header.
        let mut data = resp.data_in;
        data.truncate(send as usize);
        (data, Residual::of(edtl, produced))
    } else if let Some(needed) = write_needed {
        (ironsan_scsi::DataIn::default(), Residual::of(edtl, needed))
    } else {
        // No data direction, or data the initiator did not ask for: send none (the R bit
        // was off), and report what would have come as overflow.
        (
            ironsan_scsi::DataIn::default(),
            if produced > 0 || edtl > 0 {
                Residual::of(edtl, produced)
            } else {
                Residual::None
            },
        )
    };
    let collapse = resp.sense.is_none() && !data.is_empty();
    let mut data_sn = exp_data_sn;
    if !data.is_empty() {
        data_sn = DataSn(0);
        // Each segment is split off the front; the last (usually the only) one takes what is
        // left without a clone.
        let mut rest = data;
        for s in data_in_segments(rest.len() as u32, max_xmit, max_burst) {
            let last = s.last && collapse;
            out.push(OutPdu {
                header: Header::DataIn(DataIn {
                    final_bit: s.final_bit,
                    status: last.then_some(resp.status.0),
                    lun: cmd.lun,
                    itt: cmd.itt,
                    ttt: Ttt::RESERVED,
                    data_sn: s.data_sn,
                    buffer_offset: s.offset,
                    residual: if last { residual } else { Residual::None },
                    ..Default::default()
                }),
                data: rest.split_to(s.len as usize),
                mode: if last {
                    writer::SnMode::Status
                } else {
                    writer::SnMode::Current
                },
            });
            data_sn = s.data_sn.next();
        }
    }
    if !collapse {
        let sense = resp.sense.as_deref().map(sense_segment).unwrap_or_default();
        out.push(OutPdu::status(
            Header::ScsiResponse(ScsiResponse {
                response: ServiceResponse::COMMAND_COMPLETED,
                status: resp.status.0,
                itt: cmd.itt,
                exp_data_sn: data_sn,
                residual,
                ..Default::default()
            }),
            sense,
        ));
    }
    out
}
