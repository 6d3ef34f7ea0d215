//! Task management (RFC 7143 §11.5, SAM-5 §7) and logout (§11.14).
//!
//! The protocol core decides which of the session's tasks a function aborts and what the
//! response is; this part aborts them, reaches the other sessions for the functions whose
//! scope is a LU or the whole target, and raises the unit attentions SAM-5 asks for.

use super::{ConnError, ConnResult, Connection};
use crate::iscsi::writer::OutPdu;
use bytes::Bytes;
use ironsan_proto::pdu::*;
use ironsan_proto::session::{LogoutPlan, TmfScope};
use ironsan_scsi::UnitAttention;
use std::sync::Arc;

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

/// How long a task management function waits for aborted writes to a shared LU to leave the
/// device ([`Connection::settle_shared_aborts`]).
const SHARED_ABORT_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a logout for recovery waits for the connection it names to stop reading.
const RECOVERY_CLOSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Connection {
    pub(super) async fn on_task_management(&mut self, t: TaskMgmtRequest) -> ConnResult {
        if self.intake.reassigns(&t) {
            return self.on_reassign(t).await;
        }
        let code = self.task_management(&t);
        // An LU several nodes serve: their I_T nexuses are its too, told before the response.
        if t.function == TmfFunction::LOGICAL_UNIT_RESET && code == TmfResponseCode::COMPLETE {
            let lu = t.lun.number().and_then(|l| {
                let target = self.session.target.as_ref()?;
                target.scsi().lun(l).cloned()
            });
            if let Some(c) = lu.as_ref().and_then(|lu| lu.config().cluster.clone()) {
                c.0.reset().await;
            }
        }
        if code == TmfResponseCode::COMPLETE {
            self.settle_shared_aborts(&t).await;
        }
        tracing::info!(
            peer = %self.peer,
            initiator = %self.session.initiator_name,
            tsih = self.session.tsih.0,
            cid = self.cid,
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
        if t.function == TmfFunction::TARGET_COLD_RESET && code == TmfResponseCode::COMPLETE {
            return Err(ConnError::ColdReset);
        }
        Ok(())
    }

    /// Before a task management function that aborted commands is answered: on LUs other
    /// nodes write too (a cluster's shared LUs), wait until no aborted command can still
    /// change the medium, so that a write the initiator then sends through another node
    /// cannot be overtaken by one it was told is gone. Bounded: a write the device holds
    /// that long makes this node stop renewing its lease, so the others fence it and the
    /// write ends.
    async fn settle_shared_aborts(&self, t: &TaskMgmtRequest) {
        let Some(target) = self.session.target.as_ref() else {
            return;
        };
        let scsi = target.scsi();
        let lus: Vec<Arc<ironsan_scsi::LogicalUnit>> = match t.function {
            TmfFunction::ABORT_TASK
            | TmfFunction::ABORT_TASK_SET
            | TmfFunction::CLEAR_TASK_SET
            | TmfFunction::LOGICAL_UNIT_RESET => t
                .lun
                .number()
                .and_then(|l| scsi.lun(l).cloned())
                .into_iter()
                .collect(),
            TmfFunction::TARGET_WARM_RESET | TmfFunction::TARGET_COLD_RESET => {
                scsi.luns().map(|(_, lu)| Arc::clone(lu)).collect()
            }
            _ => Vec::new(),
        };
        let settle = async {
            for lu in lus.iter().filter(|lu| lu.config().cluster.is_some()) {
                lu.aborts_settled().await;
            }
        };
        if tokio::time::timeout(SHARED_ABORT_LIMIT, settle)
            .await
            .is_err()
        {
            tracing::warn!(
                initiator = %self.session.initiator_name,
                "aborted writes to a shared LUN still in the device after {SHARED_ABORT_LIMIT:?}: answering the task management function"
            );
        }
    }

    /// Every session of the target `name`, this one's included.
    fn sessions_of(&self, name: &str) -> Vec<Arc<crate::iscsi::session::Session>> {
        self.shared
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .of_target(name)
    }

    fn task_management(&mut self, t: &TaskMgmtRequest) -> TmfResponseCode {
        let Some(target) = self.session.target.clone() else {
            return TmfResponseCode::REJECTED;
        };
        let scsi = target.scsi();
        let lun_exists = t.lun.number().is_some_and(|l| scsi.lun(l).is_some());
        let out = self.sess(|c| c.task_management(t, lun_exists));
        // This session's tasks, on every connection: aborted before the response.
        self.session.abort_tasks(out.aborted);
        // What this connection kept for them (writes waiting for data, held commands) goes
        // when the reader next acts on its events, before it reads another PDU.
        if out.response != TmfResponseCode::COMPLETE {
            return out.response;
        }
        match out.scope {
            TmfScope::Session => {}
            TmfScope::Lun(lun) => {
                // CLEAR TASK SET and LUN RESET affect every initiator's tasks on the LUN.
                let sessions = self.sessions_of(&target.name);
                for s in sessions.iter().filter(|s| !Arc::ptr_eq(s, &self.session)) {
                    // SAM-5, TAS=0: an initiator whose commands were aborted (and so get no
                    // status) is told with a unit attention on its next command.
                    let cleared = s.abort_where(false, |_, task| task.lun == lun);
                    let ua = match t.function {
                        TmfFunction::CLEAR_TASK_SET => {
                            UnitAttention::CommandsClearedByAnotherInitiator
                        }
                        _ => UnitAttention::PowerOnReset,
                    };
                    if cleared > 0 {
                        if let Some(lu) = scsi.lun(lun) {
                            lu.establish_unit_attention_on(&s.nexus, ua);
                        }
                    }
                }
                if t.function == TmfFunction::LOGICAL_UNIT_RESET {
                    if let Some(lu) = scsi.lun(lun) {
                        lu.reset();
                    }
                }
            }
            TmfScope::Target { cold } => {
                let sessions = self.sessions_of(&target.name);
                for s in sessions.iter().filter(|s| !Arc::ptr_eq(s, &self.session)) {
                    let cleared = s.abort_where(false, |_, _| true);
                    if cleared > 0 {
                        // As after a LUN RESET: told on its next command, even if no LU had
                        // seen it yet (its only commands writes waiting for data).
                        for (_, lu) in scsi.luns() {
                            lu.establish_unit_attention_on(&s.nexus, UnitAttention::PowerOnReset);
                        }
                    }
                }
                for (_, lu) in scsi.luns() {
                    lu.reset();
                }
                if cold {
                    // RFC 7143 §11.5.1: a cold reset also closes every TCP connection of every
                    // session, this one's included (its connection closes after the response).
                    let mut reg = self
                        .shared
                        .sessions
                        .lock()
                        .unwrap_or_else(|p| p.into_inner());
                    for s in &sessions {
                        reg.retire(s);
                    }
                }
            }
        }
        TmfResponseCode::COMPLETE
    }

    pub(super) async fn on_logout(&mut self, l: LogoutRequest) -> ConnResult {
        // Responses kept for the writer go out first: they hold transmit budget that commands
        // still running (waited for below) may need.
        self.flush().await;
        let id = self.id;
        let plan = self.sess(|c| c.logout(id, &l));
        let mut code = LogoutResponseCode::CLOSED;
        let mut close_self = false;
        let mut recover_self = false;
        match plan {
            LogoutPlan::RecoverSelf => {
                // Its tasks stay, for reassignment on another connection (RFC 7143 §11.14.1
                // reason 2): nothing is waited for.
                recover_self = true;
            }
            LogoutPlan::RecoverOther(other) => {
                // Closed as failed: its reader stops, then it leaves with its tasks kept.
                let signals = self.session.with_conns(|conns| {
                    conns.iter().find(|c| c.id == other).map(|c| {
                        c.payload.close(crate::iscsi::session::Close::ForRecovery);
                        Arc::clone(&c.payload.signals)
                    })
                });
                if let Some(s) = signals {
                    if !s.stopped(RECOVERY_CLOSE_LIMIT).await {
                        code = LogoutResponseCode::CLEANUP_FAILED;
                    }
                }
            }
            LogoutPlan::CloseSession => {
                close_self = true;
                // Let this connection's commands finish and send their responses first.
                while self.tasks.join_next().await.is_some() {}
                self.session.close_conns(None);
            }
            LogoutPlan::CloseConnection => {
                close_self = true;
                while self.tasks.join_next().await.is_some() {}
            }
            LogoutPlan::CloseOther { slot, terminated } => {
                // Another connection of the session (RFC 7143 §11.14: a logout for a CID may
                // come on a different connection). It stops reading now; its tasks end
                // without responses.
                slot.payload.close(crate::iscsi::session::Close::ByTarget);
                self.session.terminated_by_iscsi_event(terminated);
            }
            LogoutPlan::Respond(c) => code = c,
        }
        if l.reason == LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY && l.cid.0 != self.cid {
            // §11.14: its ExpStatSN is the named connection's: the statuses it acknowledges
            // were received and are not resent by a TASK REASSIGN.
            self.session
                .orphans(|o| o.acknowledge(l.cid, l.exp_stat_sn));
        }
        tracing::info!(
            peer = %self.peer,
            initiator = %self.session.initiator_name,
            tsih = self.session.tsih.0,
            cid = l.cid.0,
            on_cid = self.cid,
            reason = match l.reason {
                LogoutReason::CLOSE_SESSION => "close session",
                LogoutReason::CLOSE_CONNECTION => "close connection",
                _ => "recovery",
            },
            response = code.0,
            "logout"
        );
        let resp = Header::LogoutResponse(ironsan_proto::intake::logout_response(
            &l,
            code,
            self.session.params.default_time2wait,
            self.session.params.default_time2retain,
        ));
        self.send(vec![OutPdu::status(resp, Bytes::new())]).await;
        if recover_self {
            return Err(ConnError::Recovery { by_logout: true });
        }
        if close_self {
            return Err(ConnError::Logout);
        }
        Ok(())
    }
}
