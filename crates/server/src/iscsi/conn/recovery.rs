//! SNACKs at ErrorRecoveryLevel 1 (RFC 7143 §11.16): Data-In and statuses again from what
//! the writer kept ([`crate::iscsi::writer::Retained`]), R2Ts again from the write's state, DataACKs
//! letting go of read data; anything else refused with a Reject.

use super::{reject, Connection};
use crate::counters::Recovery;
use crate::iscsi::writer::{OutPdu, SnMode};
use ironsan_proto::pdu::{Bhs, Header, RejectReason, SnackRequest};
use ironsan_proto::recovery::{Snacked, SNACK_DATA_R2T};
use ironsan_scsi::DataIn;

impl Connection {
    /// A SNACK Request, answered after the responses the reader has already queued.
    pub(super) async fn on_snack(&mut self, bhs: &Bhs, req: SnackRequest) {
        if !self.recovery || self.writer.retained.get().is_none() {
            // No SNACK below ErrorRecoveryLevel 1 (§11.16).
            self.send(vec![reject(RejectReason::SNACK_REJECT, bhs)])
                .await;
            return;
        }
        // What the writer keeps is recorded as it sends: what the reader queued must be
        // stamped first, or a SNACK for it would find nothing.
        self.flush().await;
        let writer = std::sync::Arc::clone(&self.writer);
        let Some(kept) = writer.retained.get() else {
            return;
        };
        let answer = {
            let mut kept = crate::lock(kept);
            kept.ack(req.exp_stat_sn);
            kept.snack(&req, self.params.max_xmit_data_segment_length)
        };
        let out = match answer {
            Ok(Snacked::Resend(pdus)) => pdus
                .into_iter()
                .map(|p| OutPdu {
                    header: p.header,
                    data: DataIn::Memory(p.data),
                    mode: SnMode::Resend,
                })
                .collect(),
            Ok(Snacked::DataAcked) => Vec::new(),
            // No Data-In kept for the tag: an R2T SNACK for a write of this connection.
            Ok(Snacked::NotRetained) if req.snack_type == SNACK_DATA_R2T => {
                match self.core.resend_r2ts(req.itt, req.beg_run, req.run_length) {
                    Some(r2ts) => r2ts
                        .into_iter()
                        .map(|r| OutPdu::current(Header::R2t(r), bytes::Bytes::new()))
                        .collect(),
                    None => return self.snack_refused(bhs, RejectReason::PROTOCOL_ERROR).await,
                }
            }
            Ok(Snacked::NotRetained) => {
                return self.snack_refused(bhs, RejectReason::PROTOCOL_ERROR).await
            }
            Err(e) => {
                tracing::debug!(peer = %self.peer, cid = self.cid, "SNACK refused: {e}");
                return self.snack_refused(bhs, e.reject_reason()).await;
            }
        };
        self.count_recovery(Recovery::Snack);
        if !out.is_empty() {
            self.send(out).await;
        }
    }

    async fn snack_refused(&mut self, bhs: &Bhs, reason: RejectReason) {
        self.count_recovery(Recovery::SnackRefused);
        self.send(vec![reject(reason, bhs)]).await;
    }
}
