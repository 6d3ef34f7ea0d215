//! iSCSI PDU codec (RFC 7143 §11).
//!
//! Decoding is two-stage, so a receiver can bound lengths before it reads or allocates anything
//! (and can later read a payload straight into its destination):
//! 1. [`Bhs::plan`] looks at the 48-byte Basic Header Segment and returns a [`ReceivePlan`]
//!    (how many AHS, digest, data and padding bytes follow), checked against the caller's limits.
//! 2. [`Header::decode`] turns the BHS into a typed header; the data segment stays an opaque
//!    [`Bytes`].
//!
//! Every PDU type is a plain struct with `decode`/`encode`; opcodes are a newtype over the wire
//! byte so unknown values survive decoding (a Reject must echo them).
//!
//! ```text
//! Byte/     0       |       1       |       2       |       3       |
//!    +---------------+---------------+---------------+---------------+
//!   0|.|I| Opcode    |F|  Opcode-specific fields                      |
//!    +---------------+---------------+---------------+---------------+
//!   4|TotalAHSLength | DataSegmentLength                             |
//!    +---------------+---------------+---------------+---------------+
//!   8| LUN or Opcode-specific fields                                 |
//!  16| Initiator Task Tag                                            |
//!  20/ Opcode-specific fields                                        /
//!  48+---------------+---------------+---------------+---------------+
//! ```

use crate::serial::{CmdSn, DataSn, StatSn};
use bytes::Bytes;

/// Length of the Basic Header Segment.
pub const BHS_LEN: usize = 48;
/// Largest data segment a 24-bit DataSegmentLength can describe.
pub const MAX_DSL: u32 = (1 << 24) - 1;
/// The reserved tag value (RFC 7143 §11.2.1.8): "no task".
pub const RESERVED_TAG: u32 = 0xffff_ffff;

/// Padding needed to bring `len` to a multiple of 4.
pub fn pad_len(len: usize) -> usize {
    (4 - (len % 4)) % 4
}

/// Initiator Task Tag (RFC 7143 §11.2.1.8).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Itt(pub u32);
/// Target Transfer Tag (RFC 7143 §11.7.4).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Ttt(pub u32);

impl Itt {
    pub const RESERVED: Itt = Itt(RESERVED_TAG);
}
impl Ttt {
    pub const RESERVED: Ttt = Ttt(RESERVED_TAG);
}

/// Connection ID (RFC 7143 §11.12.4).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Cid(pub u16);
/// Target Session Identifying Handle (RFC 7143 §11.12.6).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Tsih(pub u16);
/// Initiator Session ID, 6 bytes (RFC 7143 §11.12.5).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Isid(pub [u8; 6]);

impl std::fmt::Display for Isid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// The 8-byte LUN field (SAM-5 §4.7). [`Lun::number`] decodes the common address methods.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Lun(pub [u8; 8]);

impl Lun {
    /// Encode a LUN number the way REPORT LUNS reports it: peripheral addressing (00b) below
    /// 256, flat space addressing (01b) up to 16383.
    pub fn from_number(n: u64) -> Lun {
        let mut b = [0u8; 8];
        if n < 256 {
            b[1] = n as u8;
        } else {
            let n = (n & 0x3fff) as u16;
            b[0] = 0x40 | (n >> 8) as u8;
            b[1] = n as u8;
        }
        Lun(b)
    }
    /// The LUN number for single-level peripheral (00b) or flat-space (01b) addressing;
    /// `None` for other address methods or multi-level LUNs.
    pub fn number(&self) -> Option<u64> {
        if self.0[2..].iter().any(|&b| b != 0) {
            return None;
        }
        match self.0[0] >> 6 {
            0b00 if self.0[0] == 0 => Some(self.0[1] as u64),
            0b01 => Some((((self.0[0] & 0x3f) as u64) << 8) | self.0[1] as u64),
            _ => None,
        }
    }
}

/// Opcode byte (RFC 7143 §11.2.1.2), kept as a newtype so unknown values survive.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Opcode(pub u8);

impl Opcode {
    pub const NOP_OUT: Opcode = Opcode(0x00);
    pub const SCSI_COMMAND: Opcode = Opcode(0x01);
    pub const TASK_MGMT_REQUEST: Opcode = Opcode(0x02);
    pub const LOGIN_REQUEST: Opcode = Opcode(0x03);
    pub const TEXT_REQUEST: Opcode = Opcode(0x04);
    pub const DATA_OUT: Opcode = Opcode(0x05);
    pub const LOGOUT_REQUEST: Opcode = Opcode(0x06);
    pub const SNACK_REQUEST: Opcode = Opcode(0x10);
    pub const NOP_IN: Opcode = Opcode(0x20);
    pub const SCSI_RESPONSE: Opcode = Opcode(0x21);
    pub const TASK_MGMT_RESPONSE: Opcode = Opcode(0x22);
    pub const LOGIN_RESPONSE: Opcode = Opcode(0x23);
    pub const TEXT_RESPONSE: Opcode = Opcode(0x24);
    pub const DATA_IN: Opcode = Opcode(0x25);
    pub const LOGOUT_RESPONSE: Opcode = Opcode(0x26);
    pub const R2T: Opcode = Opcode(0x31);
    pub const ASYNC_MESSAGE: Opcode = Opcode(0x32);
    pub const REJECT: Opcode = Opcode(0x3f);

    /// Sent by initiators (RFC 7143 §11.2.1.2: 0x00-0x1f are initiator opcodes).
    pub fn is_initiator(self) -> bool {
        self.0 < 0x20
    }
}

/// A raw Basic Header Segment.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Bhs(pub [u8; BHS_LEN]);

impl Default for Bhs {
    fn default() -> Self {
        Bhs([0; BHS_LEN])
    }
}

impl std::fmt::Debug for Bhs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bhs(")?;
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

/// How many bytes follow a BHS on the wire, in order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ReceivePlan {
    /// Additional Header Segments (TotalAHSLength * 4).
    pub ahs_len: usize,
    /// Header digest bytes (0 or 4).
    pub header_digest_len: usize,
    /// DataSegmentLength (excludes padding).
    pub data_len: usize,
    /// Padding after the data segment.
    pub pad_len: usize,
    /// Data digest bytes (0 or 4; none when there is no data).
    pub data_digest_len: usize,
}

impl ReceivePlan {
    /// Total bytes after the BHS.
    pub fn total(&self) -> usize {
        self.ahs_len + self.header_digest_len + self.data_len + self.pad_len + self.data_digest_len
    }
}

/// A length in a header that exceeds what the receiver allows (RFC 7143 §7.1.3: protocol error).
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
#[error("DataSegmentLength {data_len} exceeds the limit {limit}")]
pub struct LengthError {
    pub data_len: u32,
    pub limit: u32,
}

impl Bhs {
    fn u16_at(&self, o: usize) -> u16 {
        u16::from_be_bytes([self.0[o], self.0[o + 1]])
    }
    fn u32_at(&self, o: usize) -> u32 {
        u32::from_be_bytes([self.0[o], self.0[o + 1], self.0[o + 2], self.0[o + 3]])
    }
    fn put_u16(&mut self, o: usize, v: u16) {
        self.0[o..o + 2].copy_from_slice(&v.to_be_bytes());
    }
    fn put_u32(&mut self, o: usize, v: u32) {
        self.0[o..o + 4].copy_from_slice(&v.to_be_bytes());
    }
    fn lun(&self) -> Lun {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[8..16]);
        Lun(b)
    }
    fn put_lun(&mut self, lun: Lun) {
        self.0[8..16].copy_from_slice(&lun.0);
    }

    /// The opcode (low 6 bits of byte 0).
    pub fn opcode(&self) -> Opcode {
        Opcode(self.0[0] & 0x3f)
    }
    /// The immediate-delivery bit.
    pub fn immediate(&self) -> bool {
        self.0[0] & 0x40 != 0
    }
    /// The final bit (byte 1, bit 7).
    pub fn final_bit(&self) -> bool {
        self.0[1] & 0x80 != 0
    }
    /// TotalAHSLength in bytes.
    pub fn ahs_len(&self) -> usize {
        self.0[4] as usize * 4
    }
    /// DataSegmentLength.
    pub fn data_len(&self) -> u32 {
        u32::from_be_bytes([0, self.0[5], self.0[6], self.0[7]])
    }
    /// Set TotalAHSLength (in bytes, must be a multiple of 4 and < 1024) and DataSegmentLength.
    pub fn set_lengths(&mut self, ahs_bytes: usize, data_len: u32) {
        self.0[4] = (ahs_bytes / 4) as u8;
        let d = data_len.min(MAX_DSL).to_be_bytes();
        self.0[5..8].copy_from_slice(&d[1..4]);
    }
    /// The Initiator Task Tag (bytes 16-19) of any PDU.
    pub fn itt(&self) -> Itt {
        Itt(self.u32_at(16))
    }

    /// Work out what follows this header, refusing data segments above `max_data` (the
    /// negotiated MaxRecvDataSegmentLength, or 8192 during login).
    pub fn plan(
        &self,
        header_digest: bool,
        data_digest: bool,
        max_data: u32,
    ) -> Result<ReceivePlan, LengthError> {
        let data_len = self.data_len();
        if data_len > max_data {
            return Err(LengthError {
                data_len,
                limit: max_data,
            });
        }
        let data_len = data_len as usize;
        Ok(ReceivePlan {
            ahs_len: self.ahs_len(),
            header_digest_len: if header_digest { 4 } else { 0 },
            data_len,
            pad_len: pad_len(data_len),
            data_digest_len: if data_digest && data_len > 0 { 4 } else { 0 },
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Initiator PDUs
// ---------------------------------------------------------------------------------------------

/// NOP-Out (RFC 7143 §11.18).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct NopOut {
    pub immediate: bool,
    pub lun: Lun,
    pub itt: Itt,
    pub ttt: Ttt,
    pub cmd_sn: CmdSn,
    pub exp_stat_sn: StatSn,
}

/// Task attribute of a SCSI command (RFC 7143 §11.3.1, SAM).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TaskAttr(pub u8);
impl TaskAttr {
    pub const UNTAGGED: TaskAttr = TaskAttr(0);
    pub const SIMPLE: TaskAttr = TaskAttr(1);
    pub const ORDERED: TaskAttr = TaskAttr(2);
    pub const HEAD_OF_QUEUE: TaskAttr = TaskAttr(3);
    pub const ACA: TaskAttr = TaskAttr(4);
}

/// SCSI Command (RFC 7143 §11.3). The CDB here is the 16 bytes of the BHS; a longer CDB
/// continues in an Extended CDB AHS (§11.2.2.3), which the receiver appends.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ScsiCommand {
    pub immediate: bool,
    pub final_bit: bool,
    pub read: bool,
    pub write: bool,
    pub attr: TaskAttr,
    pub lun: Lun,
    pub itt: Itt,
    pub expected_data_transfer_length: u32,
    pub cmd_sn: CmdSn,
    pub exp_stat_sn: StatSn,
    pub cdb: [u8; 16],
}

/// Task management function codes (RFC 7143 §11.5.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TmfFunction(pub u8);
impl TmfFunction {
    pub const ABORT_TASK: TmfFunction = TmfFunction(1);
    pub const ABORT_TASK_SET: TmfFunction = TmfFunction(2);
    pub const CLEAR_ACA: TmfFunction = TmfFunction(3);
    pub const CLEAR_TASK_SET: TmfFunction = TmfFunction(4);
    pub const LOGICAL_UNIT_RESET: TmfFunction = TmfFunction(5);
    pub const TARGET_WARM_RESET: TmfFunction = TmfFunction(6);
    pub const TARGET_COLD_RESET: TmfFunction = TmfFunction(7);
    pub const TASK_REASSIGN: TmfFunction = TmfFunction(8);
}

/// Task Management Function Request (RFC 7143 §11.5).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TaskMgmtRequest {
    pub immediate: bool,
    pub function: TmfFunction,
    pub lun: Lun,
    pub itt: Itt,
    pub referenced_task_tag: Itt,
    pub cmd_sn: CmdSn,
    pub exp_stat_sn: StatSn,
    pub ref_cmd_sn: CmdSn,
    pub exp_data_sn: DataSn,
}

/// Login stages (RFC 7143 §11.12.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Stage(pub u8);
impl Stage {
    pub const SECURITY_NEGOTIATION: Stage = Stage(0);
    pub const LOGIN_OPERATIONAL_NEGOTIATION: Stage = Stage(1);
    pub const FULL_FEATURE_PHASE: Stage = Stage(3);
}

/// Login Request (RFC 7143 §11.12).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct LoginRequest {
    pub transit: bool,
    pub cont: bool,
    pub csg: Stage,
    pub nsg: Stage,
    pub version_max: u8,
    pub version_min: u8,
    pub isid: Isid,
    pub tsih: Tsih,
    pub itt: Itt,
    pub cid: Cid,
    pub cmd_sn: CmdSn,
    pub exp_stat_sn: StatSn,
}

/// Text Request (RFC 7143 §11.10).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TextRequest {
    pub immediate: bool,
    pub final_bit: bool,
    pub cont: bool,
    pub lun: Lun,
    pub itt: Itt,
    pub ttt: Ttt,
    pub cmd_sn: CmdSn,
    pub exp_stat_sn: StatSn,
}

/// SCSI Data-Out (RFC 7143 §11.7).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DataOut {
    pub final_bit: bool,
    pub lun: Lun,
    pub itt: Itt,
    pub ttt: Ttt,
    pub exp_stat_sn: StatSn,
    pub data_sn: DataSn,
    pub buffer_offset: u32,
}

/// Logout reason codes (RFC 7143 §11.14.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LogoutReason(pub u8);
impl LogoutReason {
    pub const CLOSE_SESSION: LogoutReason = LogoutReason(0);
    pub const CLOSE_CONNECTION: LogoutReason = LogoutReason(1);
    pub const REMOVE_CONNECTION_FOR_RECOVERY: LogoutReason = LogoutReason(2);
}

/// Logout Request (RFC 7143 §11.14).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct LogoutRequest {
    pub immediate: bool,
    pub reason: LogoutReason,
    pub itt: Itt,
    pub cid: Cid,
    pub cmd_sn: CmdSn,
    pub exp_stat_sn: StatSn,
}

/// SNACK Request (RFC 7143 §11.16).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SnackRequest {
    pub snack_type: u8,
    pub lun: Lun,
    pub itt: Itt,
    pub ttt: Ttt,
    pub exp_stat_sn: StatSn,
    pub beg_run: u32,
    pub run_length: u32,
}

// ---------------------------------------------------------------------------------------------
// Target PDUs
// ---------------------------------------------------------------------------------------------

/// Sequence numbers every target response carries (StatSN is only meaningful on some).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TargetSn {
    pub stat_sn: StatSn,
    pub exp_cmd_sn: CmdSn,
    pub max_cmd_sn: CmdSn,
}

/// NOP-In (RFC 7143 §11.19).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct NopIn {
    pub lun: Lun,
    pub itt: Itt,
    pub ttt: Ttt,
    pub sn: TargetSn,
}

/// Residual flags and count (RFC 7143 §11.4.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Residual {
    #[default]
    None,
    /// Less data was transferred than the initiator expected.
    Underflow(u32),
    /// The command wanted more data than the initiator expected.
    Overflow(u32),
}

impl Residual {
    fn flags(self) -> u8 {
        match self {
            Residual::None => 0,
            Residual::Underflow(_) => 0x02,
            Residual::Overflow(_) => 0x04,
        }
    }
    fn count(self) -> u32 {
        match self {
            Residual::None => 0,
            Residual::Underflow(n) | Residual::Overflow(n) => n,
        }
    }
    fn from_flags(flags: u8, count: u32) -> Residual {
        if flags & 0x04 != 0 {
            Residual::Overflow(count)
        } else if flags & 0x02 != 0 {
            Residual::Underflow(count)
        } else {
            Residual::None
        }
    }
    /// Residual for a transfer of `actual` bytes when the initiator expected `expected`.
    pub fn of(expected: u32, actual: u32) -> Residual {
        use std::cmp::Ordering::*;
        match actual.cmp(&expected) {
            Less => Residual::Underflow(expected - actual),
            Greater => Residual::Overflow(actual - expected),
            Equal => Residual::None,
        }
    }
}

/// iSCSI service response (RFC 7143 §11.4.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ServiceResponse(pub u8);
impl ServiceResponse {
    pub const COMMAND_COMPLETED: ServiceResponse = ServiceResponse(0);
    pub const TARGET_FAILURE: ServiceResponse = ServiceResponse(1);
}

/// SCSI Response (RFC 7143 §11.4). The data segment carries SenseLength + sense data.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ScsiResponse {
    pub response: ServiceResponse,
    pub status: u8,
    pub itt: Itt,
    pub sn: TargetSn,
    pub exp_data_sn: DataSn,
    pub bidi_residual: Residual,
    pub residual: Residual,
    /// SNACK Tag (RFC 7143 §11.4.4, bytes 20..24): the tag of the last R-Data SNACK the target
    /// accepted for the command on this connection (§11.16.3), otherwise 0.
    pub snack_tag: u32,
}

/// Task Management Function Response codes (RFC 7143 §11.6.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TmfResponseCode(pub u8);
impl TmfResponseCode {
    pub const COMPLETE: TmfResponseCode = TmfResponseCode(0);
    pub const TASK_DOES_NOT_EXIST: TmfResponseCode = TmfResponseCode(1);
    pub const LUN_DOES_NOT_EXIST: TmfResponseCode = TmfResponseCode(2);
    pub const TASK_STILL_ALLEGIANT: TmfResponseCode = TmfResponseCode(3);
    pub const REASSIGNMENT_NOT_SUPPORTED: TmfResponseCode = TmfResponseCode(4);
    pub const NOT_SUPPORTED: TmfResponseCode = TmfResponseCode(5);
    pub const AUTHORIZATION_FAILED: TmfResponseCode = TmfResponseCode(6);
    pub const REJECTED: TmfResponseCode = TmfResponseCode(255);
}

/// Task Management Function Response (RFC 7143 §11.6).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TaskMgmtResponse {
    pub response: TmfResponseCode,
    pub itt: Itt,
    pub sn: TargetSn,
}

/// Login Response (RFC 7143 §11.13).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct LoginResponse {
    pub transit: bool,
    pub cont: bool,
    pub csg: Stage,
    pub nsg: Stage,
    pub version_max: u8,
    pub version_active: u8,
    pub isid: Isid,
    pub tsih: Tsih,
    pub itt: Itt,
    pub sn: TargetSn,
    pub status_class: u8,
    pub status_detail: u8,
}

/// Text Response (RFC 7143 §11.11).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TextResponse {
    pub final_bit: bool,
    pub cont: bool,
    pub lun: Lun,
    pub itt: Itt,
    pub ttt: Ttt,
    pub sn: TargetSn,
}

/// SCSI Data-In (RFC 7143 §11.7). With `status` set, the S bit is on and the PDU also carries
/// the command's status (phase collapse, §11.7.3).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DataIn {
    pub final_bit: bool,
    pub ack: bool,
    pub status: Option<u8>,
    pub lun: Lun,
    pub itt: Itt,
    pub ttt: Ttt,
    pub sn: TargetSn,
    pub data_sn: DataSn,
    pub buffer_offset: u32,
    pub residual: Residual,
}

/// Logout Response codes (RFC 7143 §11.15.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LogoutResponseCode(pub u8);
impl LogoutResponseCode {
    pub const CLOSED: LogoutResponseCode = LogoutResponseCode(0);
    pub const CID_NOT_FOUND: LogoutResponseCode = LogoutResponseCode(1);
    pub const RECOVERY_NOT_SUPPORTED: LogoutResponseCode = LogoutResponseCode(2);
    pub const CLEANUP_FAILED: LogoutResponseCode = LogoutResponseCode(3);
}

/// Logout Response (RFC 7143 §11.15).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct LogoutResponse {
    pub response: LogoutResponseCode,
    pub itt: Itt,
    pub sn: TargetSn,
    pub time2wait: u16,
    pub time2retain: u16,
}

/// Ready To Transfer (RFC 7143 §11.8).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct R2t {
    pub lun: Lun,
    pub itt: Itt,
    pub ttt: Ttt,
    pub sn: TargetSn,
    pub r2t_sn: DataSn,
    pub buffer_offset: u32,
    pub desired_data_transfer_length: u32,
}

/// Asynchronous Message (RFC 7143 §11.9).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct AsyncMessage {
    pub lun: Lun,
    pub sn: TargetSn,
    pub async_event: u8,
    pub async_vcode: u8,
    pub parameter1: u16,
    pub parameter2: u16,
    pub parameter3: u16,
}

/// Reject reasons (RFC 7143 §11.17.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RejectReason(pub u8);
impl RejectReason {
    pub const DATA_DIGEST_ERROR: RejectReason = RejectReason(0x02);
    pub const SNACK_REJECT: RejectReason = RejectReason(0x03);
    pub const PROTOCOL_ERROR: RejectReason = RejectReason(0x04);
    pub const COMMAND_NOT_SUPPORTED: RejectReason = RejectReason(0x05);
    pub const IMMEDIATE_COMMAND_REJECT: RejectReason = RejectReason(0x06);
    pub const TASK_IN_PROGRESS: RejectReason = RejectReason(0x07);
    pub const INVALID_DATA_ACK: RejectReason = RejectReason(0x08);
    pub const INVALID_PDU_FIELD: RejectReason = RejectReason(0x09);
    pub const LONG_OP_REJECT: RejectReason = RejectReason(0x0a);
    pub const DEPRECATED: RejectReason = RejectReason(0x0b);
    pub const WAITING_FOR_LOGOUT: RejectReason = RejectReason(0x0c);
}

/// Reject (RFC 7143 §11.17). The data segment is the rejected PDU's header.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Reject {
    pub reason: RejectReason,
    pub sn: TargetSn,
    pub data_sn: DataSn,
}

/// A typed header of any PDU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Header {
    NopOut(NopOut),
    ScsiCommand(ScsiCommand),
    TaskMgmtRequest(TaskMgmtRequest),
    LoginRequest(LoginRequest),
    TextRequest(TextRequest),
    DataOut(DataOut),
    LogoutRequest(LogoutRequest),
    SnackRequest(SnackRequest),
    NopIn(NopIn),
    ScsiResponse(ScsiResponse),
    TaskMgmtResponse(TaskMgmtResponse),
    LoginResponse(LoginResponse),
    TextResponse(TextResponse),
    DataIn(DataIn),
    LogoutResponse(LogoutResponse),
    R2t(R2t),
    AsyncMessage(AsyncMessage),
    Reject(Reject),
    /// An opcode this codec does not know; the raw BHS is kept for the Reject.
    Unknown(Bhs),
}

impl Bhs {
    fn target_sn(&self) -> TargetSn {
        TargetSn {
            stat_sn: StatSn(self.u32_at(24)),
            exp_cmd_sn: CmdSn(self.u32_at(28)),
            max_cmd_sn: CmdSn(self.u32_at(32)),
        }
    }
    fn put_target_sn(&mut self, sn: TargetSn) {
        self.put_u32(24, sn.stat_sn.0);
        self.put_u32(28, sn.exp_cmd_sn.0);
        self.put_u32(32, sn.max_cmd_sn.0);
    }
    fn isid(&self) -> Isid {
        let mut b = [0u8; 6];
        b.copy_from_slice(&self.0[8..14]);
        Isid(b)
    }
}

/// How a target PDU uses its connection's StatSN (RFC 7143 §4.2.2.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnMode {
    /// Carries a status (SCSI Response, a Data-In with S=1, every other response): takes the
    /// next StatSN.
    Status,
    /// Carries the current StatSN without advancing it (R2T, Data-In without status, a
    /// target-initiated NOP-In).
    Current,
    /// Sent again for a SNACK (§11.16): an exact replica but for ExpCmdSN and MaxCmdSN, so
    /// its StatSN stays as first sent.
    Resend,
}

/// A connection's StatSN counter (RFC 7143 §4.2.2.2: StatSN is per connection). Every target
/// PDU is stamped with it as it is written, so numbers leave in write order, together with the
/// session's ExpCmdSN and MaxCmdSN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatSnCounter(pub StatSn);

impl StatSnCounter {
    /// Stamp `h` (a target PDU) and advance for a status.
    pub fn stamp(&mut self, h: &mut Header, mode: SnMode, window: Option<(CmdSn, CmdSn)>) {
        if let Some(sn) = h.target_sn_mut() {
            if mode != SnMode::Resend {
                sn.stat_sn = self.0;
            }
            if let Some((exp, max)) = window {
                sn.exp_cmd_sn = exp;
                sn.max_cmd_sn = max;
            }
        }
        if mode == SnMode::Status {
            self.0 = self.0.next();
        }
    }
}

impl Reject {
    /// A Reject of the PDU whose header is `bhs` (RFC 7143 §11.17: the data segment is the
    /// rejected header).
    pub fn of(reason: RejectReason, bhs: &Bhs) -> (Header, Bytes) {
        let h = Header::Reject(Reject {
            reason,
            ..Default::default()
        });
        (h, Bytes::copy_from_slice(&bhs.0))
    }
}

impl Bhs {
    /// ExpStatSN (bytes 28..32), where every initiator PDU carries it (RFC 7143 §11: SCSI
    /// Command, Data-Out, NOP-Out, Task Management, Text, Logout, SNACK; §4.2.2.2).
    pub fn exp_stat_sn(&self) -> StatSn {
        StatSn(self.u32_at(28))
    }

    /// The CID a Logout Request names (bytes 20..22, RFC 7143 §11.14), when this is one: its
    /// ExpStatSN is that connection's ("the last ExpStatSN value for the connection to be
    /// closed"), not the one it arrived on.
    pub fn logout_cid(&self) -> Option<Cid> {
        (self.opcode() == Opcode::LOGOUT_REQUEST).then(|| Cid(self.u16_at(20)))
    }
}

impl Header {
    /// A target PDU's StatSN, ExpCmdSN and MaxCmdSN (the PDUs of
    /// [`Header::target_sn_mut`]).
    pub fn target_sn(&self) -> Option<TargetSn> {
        match self {
            Header::NopIn(p) => Some(p.sn),
            Header::ScsiResponse(p) => Some(p.sn),
            Header::TaskMgmtResponse(p) => Some(p.sn),
            Header::LoginResponse(p) => Some(p.sn),
            Header::TextResponse(p) => Some(p.sn),
            Header::DataIn(p) => Some(p.sn),
            Header::LogoutResponse(p) => Some(p.sn),
            Header::R2t(p) => Some(p.sn),
            Header::AsyncMessage(p) => Some(p.sn),
            Header::Reject(p) => Some(p.sn),
            _ => None,
        }
    }

    /// Where a target PDU keeps its StatSN, ExpCmdSN and MaxCmdSN.
    pub fn target_sn_mut(&mut self) -> Option<&mut TargetSn> {
        match self {
            Header::NopIn(p) => Some(&mut p.sn),
            Header::ScsiResponse(p) => Some(&mut p.sn),
            Header::TaskMgmtResponse(p) => Some(&mut p.sn),
            Header::LoginResponse(p) => Some(&mut p.sn),
            Header::TextResponse(p) => Some(&mut p.sn),
            Header::DataIn(p) => Some(&mut p.sn),
            Header::LogoutResponse(p) => Some(&mut p.sn),
            Header::R2t(p) => Some(&mut p.sn),
            Header::AsyncMessage(p) => Some(&mut p.sn),
            Header::Reject(p) => Some(&mut p.sn),
            _ => None,
        }
    }

    /// Decode a BHS. Never fails: unknown opcodes become [`Header::Unknown`].
    pub fn decode(b: &Bhs) -> Header {
        let imm = b.immediate();
        let f = b.final_bit();
        let b1 = b.0[1];
        match b.opcode() {
            Opcode::NOP_OUT => Header::NopOut(NopOut {
                immediate: imm,
                lun: b.lun(),
                itt: b.itt(),
                ttt: Ttt(b.u32_at(20)),
                cmd_sn: CmdSn(b.u32_at(24)),
                exp_stat_sn: StatSn(b.u32_at(28)),
            }),
            Opcode::SCSI_COMMAND => {
                let mut cdb = [0u8; 16];
                cdb.copy_from_slice(&b.0[32..48]);
                Header::ScsiCommand(ScsiCommand {
                    immediate: imm,
                    final_bit: f,
                    read: b1 & 0x40 != 0,
                    write: b1 & 0x20 != 0,
                    attr: TaskAttr(b1 & 0x07),
                    lun: b.lun(),
                    itt: b.itt(),
                    expected_data_transfer_length: b.u32_at(20),
                    cmd_sn: CmdSn(b.u32_at(24)),
                    exp_stat_sn: StatSn(b.u32_at(28)),
                    cdb,
                })
            }
            Opcode::TASK_MGMT_REQUEST => Header::TaskMgmtRequest(TaskMgmtRequest {
                immediate: imm,
                function: TmfFunction(b1 & 0x7f),
                lun: b.lun(),
                itt: b.itt(),
                referenced_task_tag: Itt(b.u32_at(20)),
                cmd_sn: CmdSn(b.u32_at(24)),
                exp_stat_sn: StatSn(b.u32_at(28)),
                ref_cmd_sn: CmdSn(b.u32_at(32)),
                exp_data_sn: DataSn(b.u32_at(36)),
            }),
            Opcode::LOGIN_REQUEST => Header::LoginRequest(LoginRequest {
                transit: b1 & 0x80 != 0,
                cont: b1 & 0x40 != 0,
                csg: Stage((b1 >> 2) & 3),
                nsg: Stage(b1 & 3),
                version_max: b.0[2],
                version_min: b.0[3],
                isid: b.isid(),
                tsih: Tsih(b.u16_at(14)),
                itt: b.itt(),
                cid: Cid(b.u16_at(20)),
                cmd_sn: CmdSn(b.u32_at(24)),
                exp_stat_sn: StatSn(b.u32_at(28)),
            }),
            Opcode::TEXT_REQUEST => Header::TextRequest(TextRequest {
                immediate: imm,
                final_bit: f,
                cont: b1 & 0x40 != 0,
                lun: b.lun(),
                itt: b.itt(),
                ttt: Ttt(b.u32_at(20)),
                cmd_sn: CmdSn(b.u32_at(24)),
                exp_stat_sn: StatSn(b.u32_at(28)),
            }),
            Opcode::DATA_OUT => Header::DataOut(DataOut {
                final_bit: f,
                lun: b.lun(),
                itt: b.itt(),
                ttt: Ttt(b.u32_at(20)),
                exp_stat_sn: StatSn(b.u32_at(28)),
                data_sn: DataSn(b.u32_at(36)),
                buffer_offset: b.u32_at(40),
            }),
            Opcode::LOGOUT_REQUEST => Header::LogoutRequest(LogoutRequest {
                immediate: imm,
                reason: LogoutReason(b1 & 0x7f),
                itt: b.itt(),
                cid: Cid(b.u16_at(20)),
                cmd_sn: CmdSn(b.u32_at(24)),
                exp_stat_sn: StatSn(b.u32_at(28)),
            }),
            Opcode::SNACK_REQUEST => Header::SnackRequest(SnackRequest {
                snack_type: b1 & 0x0f,
                lun: b.lun(),
                itt: b.itt(),
                ttt: Ttt(b.u32_at(20)),
                exp_stat_sn: StatSn(b.u32_at(28)),
                beg_run: b.u32_at(40),
                run_length: b.u32_at(44),
            }),
            Opcode::NOP_IN => Header::NopIn(NopIn {
                lun: b.lun(),
                itt: b.itt(),
                ttt: Ttt(b.u32_at(20)),
                sn: b.target_sn(),
            }),
            Opcode::SCSI_RESPONSE => Header::ScsiResponse(ScsiResponse {
                response: ServiceResponse(b.0[2]),
                status: b.0[3],
                itt: b.itt(),
                sn: b.target_sn(),
                exp_data_sn: DataSn(b.u32_at(36)),
                bidi_residual: Residual::from_flags((b1 >> 3) & 0x06, b.u32_at(40)),
                residual: Residual::from_flags(b1 & 0x06, b.u32_at(44)),
                snack_tag: b.u32_at(20),
            }),
            Opcode::TASK_MGMT_RESPONSE => Header::TaskMgmtResponse(TaskMgmtResponse {
                response: TmfResponseCode(b.0[2]),
                itt: b.itt(),
                sn: b.target_sn(),
            }),
            Opcode::LOGIN_RESPONSE => Header::LoginResponse(LoginResponse {
                transit: b1 & 0x80 != 0,
                cont: b1 & 0x40 != 0,
                csg: Stage((b1 >> 2) & 3),
                nsg: Stage(b1 & 3),
                version_max: b.0[2],
                version_active: b.0[3],
                isid: b.isid(),
                tsih: Tsih(b.u16_at(14)),
                itt: b.itt(),
                sn: b.target_sn(),
                status_class: b.0[36],
                status_detail: b.0[37],
            }),
            Opcode::TEXT_RESPONSE => Header::TextResponse(TextResponse {
                final_bit: f,
                cont: b1 & 0x40 != 0,
                lun: b.lun(),
                itt: b.itt(),
                ttt: Ttt(b.u32_at(20)),
                sn: b.target_sn(),
            }),
            Opcode::DATA_IN => Header::DataIn(DataIn {
                final_bit: f,
                ack: b1 & 0x40 != 0,
                status: if b1 & 0x01 != 0 { Some(b.0[3]) } else { None },
                lun: b.lun(),
                itt: b.itt(),
                ttt: Ttt(b.u32_at(20)),
                sn: b.target_sn(),
                data_sn: DataSn(b.u32_at(36)),
                buffer_offset: b.u32_at(40),
                residual: Residual::from_flags(b1 & 0x06, b.u32_at(44)),
            }),
            Opcode::LOGOUT_RESPONSE => Header::LogoutResponse(LogoutResponse {
                response: LogoutResponseCode(b.0[2]),
                itt: b.itt(),
                sn: b.target_sn(),
                time2wait: b.u16_at(40),
                time2retain: b.u16_at(42),
            }),
            Opcode::R2T => Header::R2t(R2t {
                lun: b.lun(),
                itt: b.itt(),
                ttt: Ttt(b.u32_at(20)),
                sn: b.target_sn(),
                r2t_sn: DataSn(b.u32_at(36)),
                buffer_offset: b.u32_at(40),
                desired_data_transfer_length: b.u32_at(44),
            }),
            Opcode::ASYNC_MESSAGE => Header::AsyncMessage(AsyncMessage {
                lun: b.lun(),
                sn: b.target_sn(),
                async_event: b.0[36],
                async_vcode: b.0[37],
                parameter1: b.u16_at(38),
                parameter2: b.u16_at(40),
                parameter3: b.u16_at(42),
            }),
            Opcode::REJECT => Header::Reject(Reject {
                reason: RejectReason(b.0[2]),
                sn: b.target_sn(),
                data_sn: DataSn(b.u32_at(36)),
            }),
            _ => Header::Unknown(*b),
        }
    }

    /// Encode into a BHS; the caller sets the lengths with [`Bhs::set_lengths`].
    pub fn encode(&self) -> Bhs {
        let mut b = Bhs::default();
        match self {
            Header::NopOut(p) => {
                b.0[0] = Opcode::NOP_OUT.0 | imm(p.immediate);
                b.0[1] = 0x80;
                b.put_lun(p.lun);
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.ttt.0);
                b.put_u32(24, p.cmd_sn.0);
                b.put_u32(28, p.exp_stat_sn.0);
            }
            Header::ScsiCommand(p) => {
                b.0[0] = Opcode::SCSI_COMMAND.0 | imm(p.immediate);
                b.0[1] = flag(p.final_bit, 0x80)
                    | flag(p.read, 0x40)
                    | flag(p.write, 0x20)
                    | (p.attr.0 & 0x07);
                b.put_lun(p.lun);
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.expected_data_transfer_length);
                b.put_u32(24, p.cmd_sn.0);
                b.put_u32(28, p.exp_stat_sn.0);
                b.0[32..48].copy_from_slice(&p.cdb);
            }
            Header::TaskMgmtRequest(p) => {
                b.0[0] = Opcode::TASK_MGMT_REQUEST.0 | imm(p.immediate);
                b.0[1] = 0x80 | (p.function.0 & 0x7f);
                b.put_lun(p.lun);
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.referenced_task_tag.0);
                b.put_u32(24, p.cmd_sn.0);
                b.put_u32(28, p.exp_stat_sn.0);
                b.put_u32(32, p.ref_cmd_sn.0);
                b.put_u32(36, p.exp_data_sn.0);
            }
            Header::LoginRequest(p) => {
                b.0[0] = Opcode::LOGIN_REQUEST.0 | 0x40;
                b.0[1] = flag(p.transit, 0x80)
                    | flag(p.cont, 0x40)
                    | ((p.csg.0 & 3) << 2)
                    | (p.nsg.0 & 3);
                b.0[2] = p.version_max;
                b.0[3] = p.version_min;
                b.0[8..14].copy_from_slice(&p.isid.0);
                b.put_u16(14, p.tsih.0);
                b.put_u32(16, p.itt.0);
                b.put_u16(20, p.cid.0);
                b.put_u32(24, p.cmd_sn.0);
                b.put_u32(28, p.exp_stat_sn.0);
            }
            Header::TextRequest(p) => {
                b.0[0] = Opcode::TEXT_REQUEST.0 | imm(p.immediate);
                b.0[1] = flag(p.final_bit, 0x80) | flag(p.cont, 0x40);
                b.put_lun(p.lun);
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.ttt.0);
                b.put_u32(24, p.cmd_sn.0);
                b.put_u32(28, p.exp_stat_sn.0);
            }
            Header::DataOut(p) => {
                b.0[0] = Opcode::DATA_OUT.0;
                b.0[1] = flag(p.final_bit, 0x80);
                b.put_lun(p.lun);
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.ttt.0);
                b.put_u32(28, p.exp_stat_sn.0);
                b.put_u32(36, p.data_sn.0);
                b.put_u32(40, p.buffer_offset);
            }
            Header::LogoutRequest(p) => {
                b.0[0] = Opcode::LOGOUT_REQUEST.0 | imm(p.immediate);
                b.0[1] = 0x80 | (p.reason.0 & 0x7f);
                b.put_u32(16, p.itt.0);
                b.put_u16(20, p.cid.0);
                b.put_u32(24, p.cmd_sn.0);
                b.put_u32(28, p.exp_stat_sn.0);
            }
            Header::SnackRequest(p) => {
                b.0[0] = Opcode::SNACK_REQUEST.0;
                b.0[1] = 0x80 | (p.snack_type & 0x0f);
                b.put_lun(p.lun);
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.ttt.0);
                b.put_u32(28, p.exp_stat_sn.0);
                b.put_u32(40, p.beg_run);
                b.put_u32(44, p.run_length);
            }
            Header::NopIn(p) => {
                b.0[0] = Opcode::NOP_IN.0;
                b.0[1] = 0x80;
                b.put_lun(p.lun);
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.ttt.0);
                b.put_target_sn(p.sn);
            }
            Header::ScsiResponse(p) => {
                b.0[0] = Opcode::SCSI_RESPONSE.0;
                b.0[1] = 0x80 | (p.bidi_residual.flags() << 3) | p.residual.flags();
                b.0[2] = p.response.0;
                b.0[3] = p.status;
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.snack_tag);
                b.put_target_sn(p.sn);
                b.put_u32(36, p.exp_data_sn.0);
                b.put_u32(40, p.bidi_residual.count());
                b.put_u32(44, p.residual.count());
            }
            Header::TaskMgmtResponse(p) => {
                b.0[0] = Opcode::TASK_MGMT_RESPONSE.0;
                b.0[1] = 0x80;
                b.0[2] = p.response.0;
                b.put_u32(16, p.itt.0);
                b.put_target_sn(p.sn);
            }
            Header::LoginResponse(p) => {
                b.0[0] = Opcode::LOGIN_RESPONSE.0;
                b.0[1] = flag(p.transit, 0x80)
                    | flag(p.cont, 0x40)
                    | ((p.csg.0 & 3) << 2)
                    | (p.nsg.0 & 3);
                b.0[2] = p.version_max;
                b.0[3] = p.version_active;
                b.0[8..14].copy_from_slice(&p.isid.0);
                b.put_u16(14, p.tsih.0);
                b.put_u32(16, p.itt.0);
                b.put_target_sn(p.sn);
                b.0[36] = p.status_class;
                b.0[37] = p.status_detail;
            }
            Header::TextResponse(p) => {
                b.0[0] = Opcode::TEXT_RESPONSE.0;
                b.0[1] = flag(p.final_bit, 0x80) | flag(p.cont, 0x40);
                b.put_lun(p.lun);
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.ttt.0);
                b.put_target_sn(p.sn);
            }
            Header::DataIn(p) => {
                b.0[0] = Opcode::DATA_IN.0;
                b.0[1] = flag(p.final_bit, 0x80)
                    | flag(p.ack, 0x40)
                    | flag(p.status.is_some(), 0x01)
                    | if p.status.is_some() {
                        p.residual.flags()
                    } else {
                        0
                    };
                b.0[3] = p.status.unwrap_or(0);
                b.put_lun(p.lun);
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.ttt.0);
                b.put_target_sn(p.sn);
                b.put_u32(36, p.data_sn.0);
                b.put_u32(40, p.buffer_offset);
                if p.status.is_some() {
                    b.put_u32(44, p.residual.count());
                }
            }
            Header::LogoutResponse(p) => {
                b.0[0] = Opcode::LOGOUT_RESPONSE.0;
                b.0[1] = 0x80;
                b.0[2] = p.response.0;
                b.put_u32(16, p.itt.0);
                b.put_target_sn(p.sn);
                b.put_u16(40, p.time2wait);
                b.put_u16(42, p.time2retain);
            }
            Header::R2t(p) => {
                b.0[0] = Opcode::R2T.0;
                b.0[1] = 0x80;
                b.put_lun(p.lun);
                b.put_u32(16, p.itt.0);
                b.put_u32(20, p.ttt.0);
                b.put_target_sn(p.sn);
                b.put_u32(36, p.r2t_sn.0);
                b.put_u32(40, p.buffer_offset);
                b.put_u32(44, p.desired_data_transfer_length);
            }
            Header::AsyncMessage(p) => {
                b.0[0] = Opcode::ASYNC_MESSAGE.0;
                b.0[1] = 0x80;
                b.put_lun(p.lun);
                b.put_u32(16, RESERVED_TAG);
                b.put_target_sn(p.sn);
                b.0[36] = p.async_event;
                b.0[37] = p.async_vcode;
                b.put_u16(38, p.parameter1);
                b.put_u16(40, p.parameter2);
                b.put_u16(42, p.parameter3);
            }
            Header::Reject(p) => {
                b.0[0] = Opcode::REJECT.0;
                b.0[1] = 0x80;
                b.0[2] = p.reason.0;
                b.put_u32(16, RESERVED_TAG);
                b.put_target_sn(p.sn);
                b.put_u32(36, p.data_sn.0);
            }
            Header::Unknown(raw) => b = *raw,
        }
        b
    }
}

fn imm(i: bool) -> u8 {
    flag(i, 0x40)
}
fn flag(on: bool, bit: u8) -> u8 {
    if on {
        bit
    } else {
        0
    }
}

/// A PDU ready to send or just received: header plus data segment (without padding/digests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pdu {
    pub header: Header,
    /// Additional header segments as received (the receiver validates them).
    pub ahs: Bytes,
    pub data: Bytes,
}

impl Pdu {
    pub fn new(header: Header, data: Bytes) -> Pdu {
        Pdu {
            header,
            ahs: Bytes::new(),
            data,
        }
    }
    /// The BHS with lengths filled in.
    pub fn bhs(&self) -> Bhs {
        let mut b = self.header.encode();
        b.set_lengths(self.ahs.len(), self.data.len() as u32);
        b
    }
}

/// Build a SCSI Response data segment: SenseLength (2 bytes) followed by the sense data
/// (RFC 7143 §11.4.7).
pub fn sense_segment(sense: &[u8]) -> Bytes {
    let len = sense.len().min(u16::MAX as usize);
    let mut v = Vec::with_capacity(2 + len);
    v.extend_from_slice(&(len as u16).to_be_bytes());
    v.extend_from_slice(&sense[..len]);
    Bytes::from(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plan_bounds_data_segment_before_reading() {
        let mut b = Header::NopOut(NopOut::default()).encode();
        b.set_lengths(8, 8193);
        assert_eq!(
            b.plan(false, false, 8192),
            Err(LengthError {
                data_len: 8193,
                limit: 8192
            })
        );
        b.set_lengths(8, 5);
        let plan = b.plan(true, true, 8192).unwrap();
        assert_eq!(
            plan,
            ReceivePlan {
                ahs_len: 8,
                header_digest_len: 4,
                data_len: 5,
                pad_len: 3,
                data_digest_len: 4
            }
        );
        assert_eq!(plan.total(), 24);
        b.set_lengths(0, 0);
        assert_eq!(b.plan(true, true, 8192).unwrap().data_digest_len, 0);
    }

    #[test]
    fn lun_numbers_round_trip_in_both_address_methods() {
        for n in [0u64, 1, 255, 256, 1000, 16383] {
            assert_eq!(Lun::from_number(n).number(), Some(n));
        }
        assert_eq!(Lun([0x80, 0, 0, 0, 0, 0, 0, 0]).number(), None);
        assert_eq!(Lun([0, 1, 0, 0, 0, 0, 0, 1]).number(), None);
    }

    #[test]
    fn unknown_opcode_survives_decoding() {
        let mut b = Bhs::default();
        b.0[0] = 0x1c;
        b.0[20] = 0xab;
        match Header::decode(&b) {
            Header::Unknown(raw) => assert_eq!(raw, b),
            h => panic!("decoded as {h:?}"),
        }
    }

    #[test]
    fn data_in_with_status_sets_s_and_residual_bits() {
        let h = Header::DataIn(DataIn {
            final_bit: true,
            status: Some(0),
            residual: Residual::Underflow(512),
            ..Default::default()
        });
        let b = h.encode();
        assert_eq!(b.0[1], 0x80 | 0x02 | 0x01);
        assert_eq!(&b.0[44..48], &512u32.to_be_bytes());
    }

    fn arb_residual() -> impl Strategy<Value = Residual> {
        prop_oneof![
            Just(Residual::None),
            any::<u32>().prop_map(Residual::Underflow),
            any::<u32>().prop_map(Residual::Overflow),
        ]
    }

    fn arb_sn() -> impl Strategy<Value = TargetSn> {
        (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(a, b, c)| TargetSn {
            stat_sn: StatSn(a),
            exp_cmd_sn: CmdSn(b),
            max_cmd_sn: CmdSn(c),
        })
    }

    fn arb_header() -> impl Strategy<Value = Header> {
        let lun = any::<[u8; 8]>().prop_map(Lun);
        prop_oneof![
            (
                any::<bool>(),
                lun.clone(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>()
            )
                .prop_map(|(i, l, itt, ttt, c, e)| Header::NopOut(NopOut {
                    immediate: i,
                    lun: l,
                    itt: Itt(itt),
                    ttt: Ttt(ttt),
                    cmd_sn: CmdSn(c),
                    exp_stat_sn: StatSn(e)
                })),
            (
                any::<[bool; 4]>(),
                0u8..8,
                lun.clone(),
                any::<[u32; 4]>(),
                any::<[u8; 16]>()
            )
                .prop_map(|(f, a, l, n, cdb)| Header::ScsiCommand(ScsiCommand {
                    immediate: f[0],
                    final_bit: f[1],
                    read: f[2],
                    write: f[3],
                    attr: TaskAttr(a),
                    lun: l,
                    itt: Itt(n[0]),
                    expected_data_transfer_length: n[1],
                    cmd_sn: CmdSn(n[2]),
                    exp_stat_sn: StatSn(n[3]),
                    cdb
                })),
            (any::<bool>(), 0u8..128, lun.clone(), any::<[u32; 6]>()).prop_map(|(i, f, l, n)| {
                Header::TaskMgmtRequest(TaskMgmtRequest {
                    immediate: i,
                    function: TmfFunction(f),
                    lun: l,
                    itt: Itt(n[0]),
                    referenced_task_tag: Itt(n[1]),
                    cmd_sn: CmdSn(n[2]),
                    exp_stat_sn: StatSn(n[3]),
                    ref_cmd_sn: CmdSn(n[4]),
                    exp_data_sn: DataSn(n[5]),
                })
            }),
            (
                any::<[bool; 2]>(),
                0u8..4,
                0u8..4,
                any::<[u8; 2]>(),
                any::<[u8; 6]>(),
                any::<u16>(),
                any::<u16>(),
                any::<[u32; 3]>()
            )
                .prop_map(|(f, c, n, v, isid, tsih, cid, s)| Header::LoginRequest(
                    LoginRequest {
                        transit: f[0],
                        cont: f[1],
                        csg: Stage(c),
                        nsg: Stage(n),
                        version_max: v[0],
                        version_min: v[1],
                        isid: Isid(isid),
                        tsih: Tsih(tsih),
                        itt: Itt(s[0]),
                        cid: Cid(cid),
                        cmd_sn: CmdSn(s[1]),
                        exp_stat_sn: StatSn(s[2]),
                    }
                )),
            (any::<bool>(), lun.clone(), any::<[u32; 5]>()).prop_map(|(f, l, n)| Header::DataOut(
                DataOut {
                    final_bit: f,
                    lun: l,
                    itt: Itt(n[0]),
                    ttt: Ttt(n[1]),
                    exp_stat_sn: StatSn(n[2]),
                    data_sn: DataSn(n[3]),
                    buffer_offset: n[4],
                }
            )),
            (
                any::<u8>(),
                any::<u8>(),
                any::<u32>(),
                arb_sn(),
                any::<u32>(),
                arb_residual(),
                arb_residual(),
                any::<u32>()
            )
                .prop_map(|(r, s, itt, sn, e, br, rr, tag)| Header::ScsiResponse(
                    ScsiResponse {
                        response: ServiceResponse(r),
                        status: s,
                        itt: Itt(itt),
                        sn,
                        exp_data_sn: DataSn(e),
                        bidi_residual: br,
                        residual: rr,
                        snack_tag: tag,
                    }
                )),
            (
                any::<[bool; 3]>(),
                any::<u8>(),
                lun.clone(),
                any::<[u32; 4]>(),
                arb_sn(),
                arb_residual()
            )
                .prop_map(|(f, st, l, n, sn, r)| Header::DataIn(DataIn {
                    final_bit: f[0],
                    ack: f[1],
                    status: if f[2] { Some(st) } else { None },
                    lun: l,
                    itt: Itt(n[0]),
                    ttt: Ttt(n[1]),
                    sn,
                    data_sn: DataSn(n[2]),
                    buffer_offset: n[3],
                    residual: if f[2] { r } else { Residual::None },
                })),
            (lun.clone(), any::<[u32; 5]>(), arb_sn()).prop_map(|(l, n, sn)| Header::R2t(R2t {
                lun: l,
                itt: Itt(n[0]),
                ttt: Ttt(n[1]),
                sn,
                r2t_sn: DataSn(n[2]),
                buffer_offset: n[3],
                desired_data_transfer_length: n[4],
            })),
            (
                any::<[bool; 2]>(),
                0u8..4,
                0u8..4,
                any::<[u8; 6]>(),
                any::<u16>(),
                any::<u32>(),
                arb_sn(),
                any::<[u8; 4]>()
            )
                .prop_map(|(f, c, n, isid, tsih, itt, sn, v)| Header::LoginResponse(
                    LoginResponse {
                        transit: f[0],
                        cont: f[1],
                        csg: Stage(c),
                        nsg: Stage(n),
                        version_max: v[0],
                        version_active: v[1],
                        isid: Isid(isid),
                        tsih: Tsih(tsih),
                        itt: Itt(itt),
                        sn,
                        status_class: v[2],
                        status_detail: v[3],
                    }
                )),
            (any::<u8>(), arb_sn(), any::<u32>()).prop_map(|(r, sn, d)| Header::Reject(Reject {
                reason: RejectReason(r),
                sn,
                data_sn: DataSn(d)
            })),
            (
                any::<u8>(),
                any::<u32>(),
                arb_sn(),
                any::<u16>(),
                any::<u16>()
            )
                .prop_map(|(r, itt, sn, w, t)| {
                    Header::LogoutResponse(LogoutResponse {
                        response: LogoutResponseCode(r),
                        itt: Itt(itt),
                        sn,
                        time2wait: w,
                        time2retain: t,
                    })
                }),
        ]
    }

    proptest! {
        #[test]
        fn headers_round_trip(h in arb_header(), dlen in 0u32..=MAX_DSL) {
            let mut b = h.encode();
            b.set_lengths(0, dlen);
            prop_assert_eq!(b.data_len(), dlen);
            prop_assert_eq!(Header::decode(&b), h);
        }

        #[test]
        fn decoding_any_bhs_never_panics(raw in any::<[u8; 32]>(), raw2 in any::<[u8; 16]>()) {
            let mut b = Bhs::default();
            b.0[..32].copy_from_slice(&raw);
            b.0[32..].copy_from_slice(&raw2);
            let _ = Header::decode(&b);
            let _ = b.plan(true, true, 1 << 24);
        }
    }
}
