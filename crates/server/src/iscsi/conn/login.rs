//! The login phase of a connection (RFC 7143 §6.3) and the session registry's decisions: a new
//! session, a session reinstated (§6.3.5), a connection added to a session or reinstated in it
//! (§6.3.4, several connections per session).

use super::LazyWriter;
use crate::access::{os_random, Access};
use crate::counters::ConnStats;
use crate::iscsi::io::{self, Digests, ReadError};
use crate::iscsi::session::{Close, ConnInfo, ConnSignals, Core, Session};
use crate::iscsi::writer::{self, Out, OutPdu};
use crate::{Portal, Runtime, Shared};
use bytes::Bytes;
use ironsan_proto::chap::ChapCredentials;
use ironsan_proto::login::{
    Login, LoginPolicy, LoginStatus, LoginStep, TargetLookup, CHAP_RANDOM_LEN,
};
use ironsan_proto::negotiate::{ConnParams, SessionType};
use ironsan_proto::pdu::*;
use ironsan_proto::session::ConnId;
use ironsan_proto::text;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::watch;

/// MaxRecvDataSegmentLength during login (RFC 7143 §13.12: 8192 until negotiated).
const LOGIN_MAX_DATA: u32 = 8192;

/// How long a login that replaces a session or a connection waits for the old readers to
/// stop before it is answered anyway.
const REPLACED_READERS: std::time::Duration = std::time::Duration::from_secs(5);

/// The login's view of the configuration: targets, ACLs (by initiator name and source
/// address) and CHAP credentials. One snapshot of the run-time configuration serves the whole
/// login.
struct Policy {
    rt: Arc<Runtime>,
    shared: Arc<Shared>,
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
                    max_connections: t.max_connections(),
                    error_recovery_level: t.error_recovery_level(),
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
    fn session_params(
        &self,
        tsih: Tsih,
        isid: Isid,
        initiator_name: &str,
    ) -> Option<ironsan_proto::negotiate::SessionParams> {
        let s = self
            .shared
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(tsih)?;
        (s.isid == isid && s.initiator_name == initiator_name).then(|| s.params.clone())
    }
}

/// A connection that completed its login.
pub(super) struct LoginOutcome {
    pub session: Arc<Session>,
    pub params: ConnParams,
    pub cid: u16,
    pub id: ConnId,
    pub close_rx: watch::Receiver<Option<Close>>,
    pub stats: Arc<ConnStats>,
    pub signals: Arc<ConnSignals>,
}

/// Run the login phase. On success, the connection is in its session.
pub(super) async fn login_phase(
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
        shared: Arc::clone(shared),
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
        let ready = match login.step(&req, pairs, &policy) {
            LoginStep::Respond(resp, data) => {
                send_login(tx, resp, data).await;
                continue;
            }
            LoginStep::Fail(resp, data) => {
                // Never the secrets or the CHAP values: only who, and the status.
                let reason = login_failure_reason(resp.status_class, resp.status_detail);
                shared.stats.login_failed(reason);
                tracing::info!(%peer, status = format_args!("{:02x}{:02x}", resp.status_class, resp.status_detail), reason, "login failed");
                send_login(tx, resp, data).await;
                return Ok(None);
            }
            LoginStep::ReadyToComplete(ready) => ready,
        };
        let refuse = |status: LoginStatus, login: Login| {
            let reason = login_failure_reason(status.class(), status.detail());
            shared.stats.login_failed(reason);
            tracing::info!(%peer, initiator = %ready.initiator_name, tsih = ready.tsih.0, cid = ready.cid.0, status = format_args!("{:04x}", status.0), reason, "login refused");
            login.reject(status)
        };
        let Some(cparams) = login.conn_params() else {
            // `step` said ReadyToComplete, which implies negotiated parameters.
            let (resp, data) = refuse(LoginStatus::TARGET_ERROR, login);
            send_login(tx, resp, data).await;
            return Ok(None);
        };
        let target = ready
            .target_name
            .as_ref()
            .and_then(|n| policy.rt.targets.get(n))
            .cloned();
        let (close_tx, close_rx) = watch::channel(None);
        let conn_stats = Arc::new(ConnStats::default());
        let signals = Arc::new(ConnSignals::default());
        let info = ConnInfo {
            cid: ready.cid.0,
            peer,
            local,
            params: cparams,
            fd,
            stats: Arc::clone(&conn_stats),
            tx: Arc::clone(&writer.stats),
            since: std::time::SystemTime::now(),
            close: close_tx,
            signals: Arc::clone(&signals),
        };
        // An existing session (TSIH ≠ 0): a connection added to it or reinstated in it.
        let (session, id) = if ready.tsih.0 != 0 {
            let found = shared
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(ready.tsih);
            // Only the initiator's own session, for the same target, through a portal of the
            // same portal group (RFC 7143 §4.4.1, Appendix C); anything else does not exist
            // for this login (§6.3.1, 0x020A).
            let session = found.filter(|s| {
                s.isid == ready.isid
                    && s.initiator_name == ready.initiator_name
                    && s.target.as_ref().map(|t| t.name.as_str()) == ready.target_name.as_deref()
                    && s.nexus.relative_port == portal.tag
            });
            let Some(session) = session else {
                let (resp, data) = refuse(LoginStatus::SESSION_DOES_NOT_EXIST, login);
                send_login(tx, resp, data).await;
                return Ok(None);
            };
            // Joined now, before the response, or refused: the session may have ended since it
            // was looked up, and commands on an ended session would go unanswered.
            let (id, replaced) = match session.join(ready.cid, info) {
                Ok(j) => j,
                Err(status) => {
                    let (resp, data) = refuse(status, login);
                    send_login(tx, resp, data).await;
                    return Ok(None);
                }
            };
            if let Some(old) = replaced {
                // Connection reinstatement (RFC 7143 §6.3.4): nothing read on the old
                // connection may reach a LU after this login's response.
                tracing::info!(initiator = %ready.initiator_name, tsih = session.tsih.0, cid = ready.cid.0, "reinstating connection");
                if !old.signals.stopped(REPLACED_READERS).await {
                    tracing::warn!(initiator = %ready.initiator_name, tsih = session.tsih.0, cid = ready.cid.0, "replaced connection still reading after 5 s");
                }
            }
            if session.recovers() {
                // A login that restarts a connection carries that connection's ExpStatSN
                // (RFC 7143 §11.12.8): the statuses it acknowledges, and their tasks' Data-In,
                // are let go. A connection is kept before it leaves the session and before
                // its reader is marked stopped, so the old one (reinstated just now and
                // waited for, or failed earlier) is kept by this point.
                session.orphans(|o| o.acknowledge(ready.cid, stat_sn));
            }
            (session, id)
        } else {
            match new_session(shared, &ready, &login, req.cmd_sn, portal, target, info).await {
                Ok(s) => s,
                Err(status) => {
                    let (resp, data) = refuse(status, login);
                    send_login(tx, resp, data).await;
                    return Ok(None);
                }
            }
        };
        let sn = TargetSn {
            stat_sn,
            exp_cmd_sn: session.window_sn().0,
            max_cmd_sn: session.window_sn().1,
        };
        let (resp, data, _, _) = login.complete(session.tsih, sn);
        send_login(tx, resp, data).await;
        let _ = tx.send(Out::Attach(session.sn_window())).await;
        let _ = tx
            .send(Out::Digests(Digests {
                header: cparams.header_digest,
                data: cparams.data_digest,
            }))
            .await;
        return Ok(Some(LoginOutcome {
            session,
            params: cparams,
            cid: ready.cid.0,
            id,
            close_rx,
            stats: conn_stats,
            signals,
        }));
    }
}

/// A leading login (TSIH 0): a new session, replacing one with the same initiator name, ISID
/// and target (session reinstatement, RFC 7143 §6.3.5), within the session limits.
async fn new_session(
    shared: &Arc<Shared>,
    ready: &ironsan_proto::login::ReadyToComplete,
    login: &Login,
    cmd_sn: ironsan_proto::CmdSn,
    portal: Portal,
    target: Option<Arc<crate::LiveTarget>>,
    info: ConnInfo,
) -> Result<(Arc<Session>, ConnId), LoginStatus> {
    let reinstated = {
        let mut reg = crate::lock(&shared.sessions);
        let old = reg.find_same_nexus(
            &ready.initiator_name,
            ready.isid,
            ready.target_name.as_deref(),
        );
        // Resource limits, checked before anything is disturbed; a session being reinstated
        // does not count.
        let replaced = usize::from(old.is_some());
        let total = reg.len() - replaced;
        let mine = reg.count_initiator(&ready.initiator_name) - replaced;
        if total >= shared.cfg.limits.max_sessions
            || mine >= shared.cfg.limits.max_sessions_per_initiator
        {
            tracing::warn!(peer = %info.peer, initiator = %ready.initiator_name, total, mine, "session limit reached: login refused (0302)");
            return Err(LoginStatus::OUT_OF_RESOURCES);
        }
        if let Some(old) = &old {
            // Session reinstatement: the old session's tasks are aborted and its connections
            // closed.
            tracing::info!(initiator = %ready.initiator_name, tsih = old.tsih.0, "reinstating session");
            reg.retire(old);
        }
        old
    };
    if let Some(old) = reinstated {
        // Nothing of the old session may happen after this login's response: its readers
        // stop at once when told to close (even in the middle of a PDU), and once they have,
        // no command of it can start (`Session::end`). Only I/O already in a device remains,
        // fenced by its range (INTEGRITY.md).
        if !old.readers_stopped(REPLACED_READERS).await {
            tracing::warn!(initiator = %ready.initiator_name, tsih = old.tsih.0, "reinstated session's connections still reading after 5 s");
        }
    }
    let sparams = login
        .session_params()
        .cloned()
        .ok_or(LoginStatus::TARGET_ERROR)?;
    let tsih = Tsih(shared.alloc_tsih());
    let nexus_id = shared.next_nexus_id.fetch_add(1, Ordering::Relaxed);
    let tname = target.as_ref().map(|t| t.name.clone()).unwrap_or_default();
    let tpgt = portal.tag;
    let nexus = ironsan_scsi::Nexus {
        id: nexus_id,
        initiator_port: format!("{},i,0x{}", ready.initiator_name, ready.isid).into(),
        target_port: ironsan_scsi::Nexus::target_port_name(&tname, tpgt).into(),
        relative_port: tpgt,
    };
    let discovery = ready.session_type == SessionType::Discovery;
    // A Discovery session has one connection (RFC 7143 §13.21).
    let max_connections = if discovery {
        1
    } else {
        sparams.max_connections
    };
    let core = Core::new(
        cmd_sn,
        shared.cfg.queue_depth,
        max_connections,
        sparams.error_recovery_level,
    );
    let s = Arc::new(Session::new(
        tsih,
        ready.isid,
        ready.initiator_name.clone(),
        if discovery { None } else { target },
        sparams,
        nexus,
        core,
        shared.cfg.limits.connection_fairness,
    ));
    // Joined before the registry makes it findable: no other login can end it or take its
    // place first, so this cannot fail.
    let (id, _) = s
        .join(ready.cid, info)
        .map_err(|_| LoginStatus::TARGET_ERROR)?;
    shared
        .sessions
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(Arc::clone(&s));
    Ok((s, id))
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
