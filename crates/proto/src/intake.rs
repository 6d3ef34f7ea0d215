//! Intake of a PDU in the full-feature phase: what a connection does with a PDU whose header it
//! has read, before the PDU's own state machine ([`crate::session`], [`crate::connection`],
//! [`crate::task`], [`crate::recovery`]) sees it.
//!
//! The driver reads a header, asks [`Intake`] and acts on the answer; it decides no protocol
//! rule itself:
//!
//! ```text
//!  header read ──digest bad──▶ Intake::damaged_header ──▶ Drop (skip its data) / Close
//!      │ good
//!      ▼
//!  Intake::header ──▶ the ExpStatSN it acknowledges (retained PDUs released)
//!      │
//!      ▼
//!  Intake::route ──▶ Command ──Intake::command──▶ CDB, or Reject before its CmdSN is looked at
//!                    DataOut      (crate::connection)
//!                    Sequenced    (crate::session::Session::admit_pdu)
//!                    Now          (a ping's answer, a SNACK)
//!                    Reject(reason)
//! ```

use crate::pdu::{
    pad_len, Bhs, Cid, Header, LogoutReason, LogoutRequest, LogoutResponse, LogoutResponseCode,
    RejectReason, ScsiCommand, TaskMgmtRequest, TmfFunction,
};
use crate::serial::{CmdSn, StatSn};
use bytes::Bytes;

/// The connection-level facts intake depends on, fixed by the login.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntakeParams {
    /// This connection's CID.
    pub cid: Cid,
    /// The session's negotiated ErrorRecoveryLevel (RFC 7143 §13.20).
    pub error_recovery_level: u8,
    /// A discovery session (RFC 7143 §4.3): no SCSI commands.
    pub discovery: bool,
}

/// What to do with a PDU whose header digest is wrong (RFC 7143 §7.9).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DamagedHeader {
    /// Discard the PDU (skip the data segment its length field describes) and go on: what it
    /// carried is recovered as lost (a DataSN gap, a command retried, a SNACK).
    Drop,
    /// Close the connection: the stream cannot be resynchronised safely.
    Close,
}

/// Where a PDU goes after its header was accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// A SCSI Command: next [`Intake::command`], then
    /// [`crate::session::Session::admit_command`].
    Command,
    /// A Data-Out: the per-connection reassembly ([`crate::connection::Connection::data_out`]).
    DataOut,
    /// A PDU that takes its place in CmdSN order across the session's connections (RFC 7143
    /// §3.2.2.1): a NOP-Out with a task tag, Text, task management, Logout. Next
    /// [`crate::session::Session::admit_pdu`].
    Sequenced { cmd_sn: CmdSn, immediate: bool },
    /// Acted on at once, outside CmdSN order: a NOP-Out answering the target's ping (reserved
    /// ITT, RFC 7143 §11.18), a SNACK (§11.16).
    Now,
    /// Answer with a Reject of this reason (RFC 7143 §11.17.1) once its data is read or
    /// skipped; nothing else happens.
    Reject(RejectReason),
}

/// How a command with damaged immediate data goes on (RFC 7143 §7.8): in either case the PDU
/// is Rejected with reason DATA_DIGEST_ERROR and its data discarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DamagedImmediate {
    /// The command ends with CHECK CONDITION, PROTOCOL SERVICE CRC ERROR: its CmdSN was
    /// received, so it must be answered.
    Fail,
    /// At ErrorRecoveryLevel 1 or more a write asks for the lost bytes again by R2T
    /// ([`crate::task::WriteTransfer::lost_immediate`]).
    AskAgain,
}

/// The per-connection intake state in the full-feature phase.
#[derive(Clone, Debug)]
pub struct Intake {
    params: IntakeParams,
    /// Damaged headers in a row.
    bad_headers: u8,
    /// The last ExpStatSN taken from this connection's PDUs.
    acked: Option<StatSn>,
}

impl Intake {
    pub fn new(params: IntakeParams) -> Self {
        Intake {
            params,
            bad_headers: 0,
            acked: None,
        }
    }

    pub fn params(&self) -> &IntakeParams {
        &self.params
    }

    /// A header whose digest is wrong. `length_valid`: its length fields still describe a PDU
    /// this connection may receive (the codec's receive plan). RFC 7143 §7.9 lets a target
    /// discard the PDU or close; at ErrorRecoveryLevel 0 nothing could recover what it carried,
    /// so the connection closes; above it the PDU is dropped, unless this is the second damaged
    /// header in a row (the stream is out of step).
    pub fn damaged_header(&mut self, length_valid: bool) -> DamagedHeader {
        self.bad_headers = self.bad_headers.saturating_add(1);
        if length_valid && self.params.error_recovery_level > 0 && self.bad_headers < 2 {
            DamagedHeader::Drop
        } else {
            DamagedHeader::Close
        }
    }

    /// A header that passed its digest. Returns the ExpStatSN it acknowledges on this
    /// connection when that changed since the last PDU (RFC 7143 §4.2.2.2: every initiator PDU
    /// carries it; the statuses before it need not be kept for SNACKs). A Logout naming another
    /// connection carries that connection's ExpStatSN (§11.14.3) and acknowledges nothing here.
    pub fn header(&mut self, bhs: &Bhs) -> Option<StatSn> {
        self.bad_headers = 0;
        if bhs.logout_cid().is_some_and(|c| c != self.params.cid) {
            return None;
        }
        let sn = bhs.exp_stat_sn();
        if self.acked == Some(sn) {
            return None;
        }
        self.acked = Some(sn);
        Some(sn)
    }

    /// Where an accepted header goes.
    pub fn route(&self, header: &Header) -> Route {
        match header {
            // RFC 7143 §4.3: a discovery session carries Text, NOP and Logout only.
            Header::ScsiCommand(_) if self.params.discovery => {
                Route::Reject(RejectReason::PROTOCOL_ERROR)
            }
            Header::ScsiCommand(_) => Route::Command,
            Header::DataOut(_) => Route::DataOut,
            // §11.18: the reserved ITT marks an answer to the target's NOP-In; it has no CmdSN.
            Header::NopOut(n) if n.itt == crate::pdu::Itt::RESERVED => Route::Now,
            Header::NopOut(n) => Route::Sequenced {
                cmd_sn: n.cmd_sn,
                immediate: n.immediate,
            },
            Header::TextRequest(t) => Route::Sequenced {
                cmd_sn: t.cmd_sn,
                immediate: t.immediate,
            },
            Header::TaskMgmtRequest(t) => Route::Sequenced {
                cmd_sn: t.cmd_sn,
                immediate: t.immediate,
            },
            Header::LogoutRequest(l) => Route::Sequenced {
                cmd_sn: l.cmd_sn,
                immediate: l.immediate,
            },
            Header::SnackRequest(_) => Route::Now,
            // §6.3: a Login Request on a connection already in the full-feature phase.
            Header::LoginRequest(_) => Route::Reject(RejectReason::PROTOCOL_ERROR),
            // §11.17.1: an opcode the target does not support.
            Header::Unknown(_) => Route::Reject(RejectReason::COMMAND_NOT_SUPPORTED),
            // Target opcodes sent by an initiator.
            Header::NopIn(_)
            | Header::ScsiResponse(_)
            | Header::TaskMgmtResponse(_)
            | Header::LoginResponse(_)
            | Header::TextResponse(_)
            | Header::DataIn(_)
            | Header::LogoutResponse(_)
            | Header::R2t(_)
            | Header::AsyncMessage(_)
            | Header::Reject(_) => Route::Reject(RejectReason::PROTOCOL_ERROR),
        }
    }

    /// The faults of a SCSI Command PDU itself, judged before its CmdSN is looked at: a
    /// rejected command is not received (RFC 7143 §7.3), and the initiator plugs the gap.
    /// Returns the whole CDB (with any Extended CDB AHS, [`extended_cdb`]) or the reason to
    /// Reject: a malformed AHS (INVALID_PDU_FIELD), or more immediate data than the
    /// ExpectedDataTransferLength (§11.3.5 PROTOCOL_ERROR).
    pub fn command(
        &self,
        cmd: &ScsiCommand,
        ahs: &[u8],
        immediate_len: u32,
    ) -> Result<Bytes, RejectReason> {
        let cdb = extended_cdb(&cmd.cdb, ahs).ok_or(RejectReason::INVALID_PDU_FIELD)?;
        if immediate_len > cmd.expected_data_transfer_length {
            return Err(RejectReason::PROTOCOL_ERROR);
        }
        Ok(cdb)
    }

    /// A command whose immediate data failed its digest (RFC 7143 §7.8).
    pub fn damaged_immediate(&self, cmd: &ScsiCommand) -> DamagedImmediate {
        if self.params.error_recovery_level > 0
            && cmd.write
            && cmd.expected_data_transfer_length > 0
        {
            DamagedImmediate::AskAgain
        } else {
            DamagedImmediate::Fail
        }
    }

    /// Whether a task management request is a TASK REASSIGN for connection recovery, which
    /// moves a task's allegiance ([`crate::session::Session::reassign`]); below
    /// ErrorRecoveryLevel 2 it is answered by [`crate::session::Session::task_management`]
    /// like any other function (§11.5.1: reassignment not supported).
    pub fn reassigns(&self, t: &TaskMgmtRequest) -> bool {
        t.function == TmfFunction::TASK_REASSIGN && self.params.error_recovery_level >= 2
    }
}

/// The Logout Response to `req` (RFC 7143 §11.15): Time2Wait always, Time2Retain only after a
/// connection was removed for recovery (the time its tasks wait for reassignment after
/// Time2Wait), 0 otherwise.
pub fn logout_response(
    req: &LogoutRequest,
    code: LogoutResponseCode,
    time2wait: u16,
    time2retain: u16,
) -> LogoutResponse {
    let for_recovery = req.reason == LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY
        && code == LogoutResponseCode::CLOSED;
    LogoutResponse {
        response: code,
        itt: req.itt,
        time2wait,
        time2retain: if for_recovery { time2retain } else { 0 },
        ..Default::default()
    }
}

/// The CDB with any Extended CDB AHS appended (RFC 7143 §11.2.2.3, §11.3.4): AHS of other
/// types are skipped. `None` if an AHS is malformed (shorter than its length says).
pub fn extended_cdb(cdb16: &[u8; 16], ahs: &[u8]) -> Option<Bytes> {
    if ahs.is_empty() {
        return Some(Bytes::copy_from_slice(cdb16));
    }
    let mut cdb = cdb16.to_vec();
    let mut rest = ahs;
    while !rest.is_empty() {
        let hdr = rest.get(..3)?;
        // §11.2.2: AHSLength counts the bytes after the type-specific byte (for an Extended
        // CDB: the reserved byte is the first CDB byte's place, so length - 1 CDB bytes).
        let len = usize::from(u16::from_be_bytes([hdr[0], hdr[1]]));
        let ahs_type = hdr[2];
        let body = rest.get(4..4 + len.saturating_sub(1))?;
        if ahs_type == 1 {
            cdb.extend_from_slice(body);
        }
        let total = 4 + len.saturating_sub(1);
        rest = rest.get(total + pad_len(total)..).unwrap_or(&[]);
    }
    Some(Bytes::from(cdb))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pdu::{DataOut, Itt, LoginRequest, NopOut, SnackRequest, TextRequest};

    fn intake(erl: u8) -> Intake {
        Intake::new(IntakeParams {
            cid: Cid(1),
            error_recovery_level: erl,
            discovery: false,
        })
    }

    fn bhs_of(h: Header) -> Bhs {
        h.encode()
    }

    #[test]
    fn damaged_headers_close_at_level_0_and_the_second_in_a_row_above() {
        let mut i = intake(0);
        assert_eq!(i.damaged_header(true), DamagedHeader::Close);
        let mut i = intake(1);
        assert_eq!(i.damaged_header(true), DamagedHeader::Drop);
        assert_eq!(i.damaged_header(true), DamagedHeader::Close);
        // A good header in between resets the count.
        let mut i = intake(2);
        assert_eq!(i.damaged_header(true), DamagedHeader::Drop);
        i.header(&bhs_of(Header::NopOut(NopOut::default())));
        assert_eq!(i.damaged_header(true), DamagedHeader::Drop);
        // A length that cannot be trusted always closes.
        let mut i = intake(2);
        assert_eq!(i.damaged_header(false), DamagedHeader::Close);
    }

    #[test]
    fn exp_stat_sn_is_taken_once_and_not_from_a_logout_for_another_connection() {
        let mut i = intake(1);
        let nop = |sn: u32| {
            bhs_of(Header::NopOut(NopOut {
                exp_stat_sn: StatSn(sn),
                ..Default::default()
            }))
        };
        assert_eq!(i.header(&nop(5)), Some(StatSn(5)));
        assert_eq!(i.header(&nop(5)), None);
        assert_eq!(i.header(&nop(6)), Some(StatSn(6)));
        let logout = |cid: u16, sn: u32| {
            bhs_of(Header::LogoutRequest(LogoutRequest {
                cid: Cid(cid),
                exp_stat_sn: StatSn(sn),
                ..Default::default()
            }))
        };
        assert_eq!(i.header(&logout(2, 9)), None);
        assert_eq!(i.header(&logout(1, 9)), Some(StatSn(9)));
    }

    #[test]
    fn routes() {
        let i = intake(0);
        assert_eq!(
            i.route(&Header::ScsiCommand(Default::default())),
            Route::Command
        );
        assert_eq!(
            i.route(&Header::DataOut(DataOut::default())),
            Route::DataOut
        );
        let ping_answer = Header::NopOut(NopOut {
            itt: Itt::RESERVED,
            ..Default::default()
        });
        assert_eq!(i.route(&ping_answer), Route::Now);
        let nop = Header::NopOut(NopOut {
            itt: Itt(3),
            cmd_sn: CmdSn(7),
            immediate: true,
            ..Default::default()
        });
        assert_eq!(
            i.route(&nop),
            Route::Sequenced {
                cmd_sn: CmdSn(7),
                immediate: true
            }
        );
        let text = Header::TextRequest(TextRequest {
            cmd_sn: CmdSn(8),
            ..Default::default()
        });
        assert_eq!(
            i.route(&text),
            Route::Sequenced {
                cmd_sn: CmdSn(8),
                immediate: false
            }
        );
        assert_eq!(
            i.route(&Header::SnackRequest(SnackRequest::default())),
            Route::Now
        );
        assert_eq!(
            i.route(&Header::LoginRequest(LoginRequest::default())),
            Route::Reject(RejectReason::PROTOCOL_ERROR)
        );
        assert_eq!(
            i.route(&Header::Unknown(Bhs([0x1f; 48]))),
            Route::Reject(RejectReason::COMMAND_NOT_SUPPORTED)
        );
        assert_eq!(
            i.route(&Header::R2t(Default::default())),
            Route::Reject(RejectReason::PROTOCOL_ERROR)
        );
        let discovery = Intake::new(IntakeParams {
            cid: Cid(0),
            error_recovery_level: 0,
            discovery: true,
        });
        assert_eq!(
            discovery.route(&Header::ScsiCommand(Default::default())),
            Route::Reject(RejectReason::PROTOCOL_ERROR)
        );
        assert!(matches!(discovery.route(&text), Route::Sequenced { .. }));
    }

    #[test]
    fn command_faults_are_judged_before_the_cmd_sn() {
        let i = intake(0);
        let cmd = ScsiCommand {
            expected_data_transfer_length: 512,
            write: true,
            ..Default::default()
        };
        assert_eq!(i.command(&cmd, &[], 512).map(|c| c.len()), Ok(16));
        assert_eq!(i.command(&cmd, &[], 513), Err(RejectReason::PROTOCOL_ERROR));
        // An Extended CDB AHS of 16 more bytes: AHSLength 17 (the reserved byte and 16 CDB
        // bytes), type 1, reserved, 16 bytes: 20 bytes, a whole number of words.
        let mut ahs = vec![0, 17, 1, 0];
        ahs.extend(1..=16u8);
        let cdb = i.command(&cmd, &ahs, 0).unwrap();
        assert_eq!(cdb.len(), 32);
        assert_eq!(&cdb[16..], &(1..=16u8).collect::<Vec<_>>()[..]);
        // Cut short.
        assert_eq!(
            i.command(&cmd, &ahs[..10], 0),
            Err(RejectReason::INVALID_PDU_FIELD)
        );
        assert_eq!(
            i.command(&cmd, &[0, 1], 0),
            Err(RejectReason::INVALID_PDU_FIELD)
        );
        // Another AHS type is skipped.
        let other = [0u8, 1, 2, 0];
        assert_eq!(i.command(&cmd, &other, 0).map(|c| c.len()), Ok(16));
    }

    #[test]
    fn damaged_immediate_data_of_a_write_is_asked_again_above_level_0() {
        let write = ScsiCommand {
            expected_data_transfer_length: 4096,
            write: true,
            ..Default::default()
        };
        let read = ScsiCommand {
            expected_data_transfer_length: 4096,
            read: true,
            ..Default::default()
        };
        assert_eq!(intake(0).damaged_immediate(&write), DamagedImmediate::Fail);
        assert_eq!(
            intake(1).damaged_immediate(&write),
            DamagedImmediate::AskAgain
        );
        assert_eq!(intake(1).damaged_immediate(&read), DamagedImmediate::Fail);
    }

    #[test]
    fn task_reassign_is_routed_by_level() {
        let t = TaskMgmtRequest {
            function: TmfFunction::TASK_REASSIGN,
            ..Default::default()
        };
        assert!(!intake(1).reassigns(&t));
        assert!(intake(2).reassigns(&t));
        let abort = TaskMgmtRequest {
            function: TmfFunction::ABORT_TASK,
            ..Default::default()
        };
        assert!(!intake(2).reassigns(&abort));
    }

    #[test]
    fn time2retain_only_after_a_removal_for_recovery() {
        let l = |reason| LogoutRequest {
            reason,
            itt: Itt(4),
            ..Default::default()
        };
        let r = logout_response(
            &l(LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY),
            LogoutResponseCode::CLOSED,
            2,
            20,
        );
        assert_eq!((r.time2wait, r.time2retain, r.itt), (2, 20, Itt(4)));
        for (reason, code) in [
            (LogoutReason::CLOSE_SESSION, LogoutResponseCode::CLOSED),
            (LogoutReason::CLOSE_CONNECTION, LogoutResponseCode::CLOSED),
            (
                LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY,
                LogoutResponseCode::CLEANUP_FAILED,
            ),
        ] {
            assert_eq!(logout_response(&l(reason), code, 2, 20).time2retain, 0);
        }
    }
}
