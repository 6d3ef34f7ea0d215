//! Connection recovery at ErrorRecoveryLevel 2 (RFC 7143 §7.2.2, §6.2.2, §11.5.1 TASK
//! REASSIGN, §11.14 logout reason 2).
//!
//! When a connection of such a session fails (or is logged out for recovery, or reinstated),
//! the protocol core keeps its delivered tasks allegiant to it for DefaultTime2Wait +
//! DefaultTime2Retain ([`ironsan_proto::session::Session::leave_for_recovery`]), and the
//! session keeps what the server needs to resume them on another connection
//! ([`crate::iscsi::session::Orphans`]). A TASK REASSIGN then moves the task to the asking
//! connection: a write waiting for data asks for all of it again by R2T there; a finished
//! task's Data-In from the initiator's ExpDataSN and its status (with the new connection's
//! StatSN) go out after the TMF response; a task still running has them forwarded as soon as
//! it finishes. A timer ends what nobody reassigned in time, and the session too when no
//! connection is left.

use super::{ConnResult, Connection};
use crate::counters::Recovery;
use crate::iscsi::session::send_forwards;
use crate::iscsi::session::Session;
use crate::iscsi::writer::OutPdu;
use crate::Shared;
use ironsan_proto::pdu::*;
use ironsan_proto::session::Reassign;
use std::sync::Arc;

impl Connection {
    /// TASK REASSIGN at ErrorRecoveryLevel 2 (RFC 7143 §11.5.1): the TMF response, then
    /// whatever resumes the task here.
    pub(super) async fn on_reassign(&mut self, t: TaskMgmtRequest) -> ConnResult {
        let id = self.id;
        let itt = t.referenced_task_tag;
        let exp = t.exp_data_sn;
        let max_xmit = self.params.max_xmit_data_segment_length;
        let r = self.sess(|c| c.reassign(id, itt));
        let mut resume = Vec::new();
        let mut adopt = None;
        let mut forward = None;
        let code = match r {
            Reassign::NotSupported => TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED,
            Reassign::StillAllegiant => TmfResponseCode::TASK_STILL_ALLEGIANT,
            Reassign::Unknown => {
                // Finished while its connection was failing: its response is all that is left.
                match self
                    .session
                    .orphans(|o| o.take_output(None, itt, exp, max_xmit))
                {
                    Some(p) => {
                        resume = p;
                        TmfResponseCode::COMPLETE
                    }
                    None => TmfResponseCode::TASK_DOES_NOT_EXIST,
                }
            }
            Reassign::Moved { from } => {
                let (w, out) = self.session.orphans(|o| match o.take_write(from, itt) {
                    Some(w) => (Some(w), None),
                    None => (None, o.take_output(Some(from), itt, exp, max_xmit)),
                });
                match (w, out) {
                    (Some(w), _) => adopt = Some(w),
                    (None, Some(p)) => resume = p,
                    (None, None) => forward = Some(from),
                }
                TmfResponseCode::COMPLETE
            }
        };
        tracing::info!(
            peer = %self.peer,
            initiator = %self.session.initiator_name,
            tsih = self.session.tsih.0,
            cid = self.cid,
            itt = itt.0,
            exp_data_sn = exp.0,
            response = code.0,
            resume = if adopt.is_some() { "R2T" } else if forward.is_some() { "when done" } else { "now" },
            "task reassign"
        );
        if code == TmfResponseCode::COMPLETE {
            self.count_recovery(Recovery::Reassigned);
        }
        let resp = Header::TaskMgmtResponse(TaskMgmtResponse {
            response: code,
            itt: t.itt,
            ..Default::default()
        });
        self.send(vec![OutPdu::status(resp, bytes::Bytes::new())])
            .await;
        if let Some(w) = adopt {
            // Its R2Ts follow the response (kept after this PDU is handled).
            self.core.adopt_write(w);
        }
        if !resume.is_empty() {
            self.send(resume).await;
        }
        if let Some(from) = forward {
            // Behind the TMF response: what the reader kept goes first. Its response is
            // sent here when it is parked or its old writer stops (`Orphans::resolve`); a
            // task aborted meanwhile sends nothing, and the entry goes with the kept
            // connection.
            self.flush().await;
            let tx = self.tx.clone();
            let ready = self
                .session
                .orphans(|o| o.forward_when_done(from, itt, tx, exp, max_xmit));
            send_forwards(ready);
        }
        Ok(())
    }
}

/// End, when their time has come, the kept connections of `session` and the tasks nobody
/// reassigned (RFC 7143 §6.2.2); the session too when no connection is left.
pub(super) async fn expire_later(session: Arc<Session>, shared: Arc<Shared>) {
    while let Some(at) = session.with_core(|c| c.next_expiry()) {
        tokio::time::sleep_until(session.instant_at(at)).await;
        let (expired, ended) = session.expire();
        if expired > 0 {
            shared.stats.recovered_n(Recovery::Expired, expired as u64);
        }
        if ended {
            tracing::info!(initiator = %session.initiator_name, tsih = session.tsih.0, "session ended: no connection reassigned its tasks in time");
            shared
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .ended(&session);
            return;
        }
    }
}
