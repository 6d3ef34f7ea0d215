//! Every SCSI failure as one [`SenseReason`] value, turned into sense bytes in exactly one table
//! ([`SenseReason::sense`]) and one encoder ([`SenseReason::to_fixed_sense`]).
//!
//! Sense data is always **fixed format** (response code 70h, SPC-4 §4.5.3), 18 bytes long.
//! Descriptor format is not offered: the control mode page reports D_SENSE=0 and does not let it
//! change, and REQUEST SENSE with DESC=1 is refused with INVALID FIELD IN CDB.

use bytes::Bytes;
use ironsan_backend::BackendError;

/// Sense key (SPC-4 sense key descriptions).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct SenseKey(pub u8);

impl SenseKey {
    pub const NO_SENSE: SenseKey = SenseKey(0x0);
    pub const RECOVERED_ERROR: SenseKey = SenseKey(0x1);
    pub const NOT_READY: SenseKey = SenseKey(0x2);
    pub const MEDIUM_ERROR: SenseKey = SenseKey(0x3);
    pub const HARDWARE_ERROR: SenseKey = SenseKey(0x4);
    pub const ILLEGAL_REQUEST: SenseKey = SenseKey(0x5);
    pub const UNIT_ATTENTION: SenseKey = SenseKey(0x6);
    pub const DATA_PROTECT: SenseKey = SenseKey(0x7);
    pub const COPY_ABORTED: SenseKey = SenseKey(0xA);
    pub const ABORTED_COMMAND: SenseKey = SenseKey(0xB);
    pub const MISCOMPARE: SenseKey = SenseKey(0xE);
}

/// Unit attention conditions this device server establishes (SAM-5 unit attention condition, SPC-4 ASC/ASCQ assignments).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum UnitAttention {
    /// 29h/00h POWER ON, RESET, OR BUS DEVICE RESET OCCURRED (used for LOGICAL UNIT RESET).
    PowerOnReset,
    /// 29h/07h I_T NEXUS LOSS OCCURRED.
    NexusLoss,
    /// 2Ah/01h MODE PARAMETERS CHANGED.
    ModeParametersChanged,
    /// 2Ah/03h RESERVATIONS PREEMPTED.
    ReservationsPreempted,
    /// 2Ah/04h RESERVATIONS RELEASED.
    ReservationsReleased,
    /// 2Ah/05h REGISTRATIONS PREEMPTED.
    RegistrationsPreempted,
    /// 2Ah/06h ASYMMETRIC ACCESS STATE CHANGED (a target port group changed state).
    AsymmetricAccessStateChanged,
    /// 2Ah/09h CAPACITY DATA HAS CHANGED.
    CapacityDataChanged,
    /// 2Fh/00h COMMANDS CLEARED BY ANOTHER INITIATOR (SAM-5 CLEAR TASK SET with TAS=0: for
    /// each other I_T nexus that had commands aborted, since they get no status).
    CommandsClearedByAnotherInitiator,
    /// 3Fh/03h INQUIRY DATA HAS CHANGED.
    InquiryDataChanged,
    /// 47h/7Fh SOME COMMANDS CLEARED BY ISCSI PROTOCOL EVENT (RFC 7143 §11.14.5: tasks of a
    /// connection closed or reinstated while its session goes on were terminated).
    CommandsClearedByIscsiEvent,
    /// 3Fh/0Eh REPORTED LUNS DATA HAS CHANGED.
    ReportedLunsDataChanged,
}

impl UnitAttention {
    /// (ASC, ASCQ) of this condition.
    pub fn asc_ascq(self) -> (u8, u8) {
        match self {
            UnitAttention::PowerOnReset => (0x29, 0x00),
            UnitAttention::NexusLoss => (0x29, 0x07),
            UnitAttention::ModeParametersChanged => (0x2A, 0x01),
            UnitAttention::ReservationsPreempted => (0x2A, 0x03),
            UnitAttention::ReservationsReleased => (0x2A, 0x04),
            UnitAttention::RegistrationsPreempted => (0x2A, 0x05),
            UnitAttention::AsymmetricAccessStateChanged => (0x2A, 0x06),
            UnitAttention::CapacityDataChanged => (0x2A, 0x09),
            UnitAttention::CommandsClearedByAnotherInitiator => (0x2F, 0x00),
            UnitAttention::InquiryDataChanged => (0x3F, 0x03),
            UnitAttention::CommandsClearedByIscsiEvent => (0x47, 0x7F),
            UnitAttention::ReportedLunsDataChanged => (0x3F, 0x0E),
        }
    }
}

/// The sense-key specific FIELD POINTER (SPC-4 field pointer sense key specific data): which CDB or parameter-list byte,
/// and optionally which bit, was wrong.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct FieldPointer {
    /// C/D bit: `true` when the error is in the CDB, `false` when in the parameter list.
    pub in_cdb: bool,
    /// Byte offset of the field (of its most significant byte).
    pub byte: u16,
    /// Bit number (7..=0) of the field's most significant bit, when given (BPV=1).
    pub bit: Option<u8>,
}

/// The decoded fields of one sense condition: what [`SenseReason::sense`] returns.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct SenseFields {
    pub key: SenseKey,
    pub asc: u8,
    pub ascq: u8,
    /// INFORMATION field (VALID=1) when present. Values wider than 32 bits cannot be carried in
    /// fixed format; they are dropped and VALID is left zero (SPC-4 §4.5.3).
    pub information: Option<u64>,
    /// Sense-key specific field pointer (SKSV=1) when present.
    pub field_pointer: Option<FieldPointer>,
    /// COMMAND-SPECIFIC INFORMATION (bytes 8..11): for COPY ABORTED, the number (0-based) of
    /// the segment descriptor being processed (SPC-4 EXTENDED COPY errors).
    pub command_specific: Option<u32>,
}

/// Every way a SCSI command can fail with CHECK CONDITION, plus [`SenseReason::NoSense`] for
/// REQUEST SENSE when nothing is pending.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, thiserror::Error)]
pub enum SenseReason {
    /// NO SENSE, 00h/00h: REQUEST SENSE parameter data when no condition is pending.
    #[error("no sense")]
    NoSense,
    /// ILLEGAL REQUEST, 20h/00h INVALID COMMAND OPERATION CODE.
    #[error("invalid command operation code")]
    InvalidOpcode,
    /// ILLEGAL REQUEST, 24h/00h INVALID FIELD IN CDB without a field pointer: the CDB is
    /// shorter than its operation code requires, so there is no field to point at.
    #[error("CDB shorter than its operation code requires")]
    CdbTooShort,
    /// ILLEGAL REQUEST, 24h/00h INVALID FIELD IN CDB, field pointer with C/D=1.
    #[error("invalid field in CDB at byte {byte}")]
    InvalidFieldInCdb { byte: u16, bit: Option<u8> },
    /// ILLEGAL REQUEST, 26h/00h INVALID FIELD IN PARAMETER LIST, field pointer with C/D=0.
    #[error("invalid field in parameter list at byte {byte}")]
    InvalidFieldInParameterList { byte: u16, bit: Option<u8> },
    /// ILLEGAL REQUEST, 1Ah/00h PARAMETER LIST LENGTH ERROR: the parameter list is truncated
    /// (by its length field or by the data the initiator actually sent) or inconsistent.
    #[error("parameter list length error")]
    ParameterListLengthError,
    /// ILLEGAL REQUEST, 26h/04h INVALID RELEASE OF PERSISTENT RESERVATION (SPC-4 RELEASE with
    /// a type or scope other than the reservation's).
    #[error("invalid release of persistent reservation")]
    InvalidReleaseOfPersistentReservation,
    /// ILLEGAL REQUEST, 21h/00h LOGICAL BLOCK ADDRESS OUT OF RANGE.
    #[error("logical block address out of range")]
    LbaOutOfRange,
    /// ILLEGAL REQUEST, 25h/00h LOGICAL UNIT NOT SUPPORTED.
    #[error("logical unit not supported")]
    LogicalUnitNotSupported,
    /// ILLEGAL REQUEST, 39h/00h SAVING PARAMETERS NOT SUPPORTED.
    #[error("saving parameters not supported")]
    SavingParametersNotSupported,
    /// ILLEGAL REQUEST, 53h/02h MEDIUM REMOVAL PREVENTED.
    #[error("medium removal prevented")]
    MediumRemovalPrevented,
    /// DATA PROTECT, 27h/00h WRITE PROTECTED.
    #[error("write protected")]
    WriteProtected,
    /// DATA PROTECT, 27h/07h SPACE ALLOCATION FAILED WRITE PROTECT (thin pool full).
    #[error("space allocation failed")]
    SpaceAllocationFailed,
    /// MISCOMPARE, 1Dh/00h MISCOMPARE DURING VERIFY OPERATION; INFORMATION = byte offset of the
    /// first differing byte in the Data-Out buffer (SBC-3 VERIFY, COMPARE AND WRITE).
    #[error("miscompare at data-out offset {offset}")]
    Miscompare { offset: u64 },
    /// MEDIUM ERROR, 11h/00h UNRECOVERED READ ERROR; INFORMATION = first failing LBA.
    #[error("unrecovered read error at LBA {lba}")]
    UnrecoveredReadError { lba: u64 },
    /// MEDIUM ERROR, 0Ch/00h WRITE ERROR; INFORMATION = first failing LBA.
    #[error("write error at LBA {lba}")]
    WriteError { lba: u64 },
    /// NOT READY, 04h/01h LOGICAL UNIT IS IN PROCESS OF BECOMING READY: the storage behind
    /// the LU did not answer in time (initiators retry).
    #[error("logical unit becoming ready")]
    BecomingReady,
    /// NOT READY, 04h/03h LOGICAL UNIT NOT READY, MANUAL INTERVENTION REQUIRED: this target
    /// may no longer write the storage (fenced off by it).
    #[error("logical unit not ready, manual intervention required")]
    ManualInterventionRequired,
    /// NOT READY, 04h/0Ah, 0Bh, 0Ch or 12h: LOGICAL UNIT NOT ACCESSIBLE, ASYMMETRIC ACCESS
    /// STATE TRANSITION / TARGET PORT IN STANDBY STATE / TARGET PORT IN UNAVAILABLE STATE,
    /// or LOGICAL UNIT NOT READY, OFFLINE: the port's target port group does not process
    /// this command in its state (SPC-4 §5.15.2.4).
    #[error("logical unit not accessible through a port in the {0} state")]
    NotAccessible(crate::alua::AccessState),
    /// HARDWARE ERROR, 44h/00h INTERNAL TARGET FAILURE.
    #[error("internal target failure")]
    InternalTargetFailure,
    /// ABORTED COMMAND, 47h/05h PROTOCOL SERVICE CRC ERROR: the transport saw a data digest
    /// error in the command's data (RFC 7143 §7.8).
    #[error("protocol service CRC error")]
    ProtocolCrcError,
    /// ABORTED COMMAND, 4Bh/00h DATA PHASE ERROR: the transport could not collect the
    /// command's data (bad DataSN, offset or sequence at ErrorRecoveryLevel 0).
    #[error("data phase error")]
    DataPhaseError,
    /// UNIT ATTENTION with the condition's ASC/ASCQ.
    #[error("unit attention {0:?}")]
    UnitAttention(UnitAttention),
    /// ILLEGAL REQUEST, 26h/06h TOO MANY TARGET DESCRIPTORS (EXTENDED COPY: more CSCD
    /// descriptors than RECEIVE COPY RESULTS / OPERATING PARAMETERS allows).
    #[error("too many target descriptors")]
    TooManyTargetDescriptors,
    /// ILLEGAL REQUEST, 26h/07h UNSUPPORTED TARGET DESCRIPTOR TYPE CODE.
    #[error("unsupported target descriptor type code")]
    UnsupportedTargetDescriptorType,
    /// ILLEGAL REQUEST, 26h/08h TOO MANY SEGMENT DESCRIPTORS.
    #[error("too many segment descriptors")]
    TooManySegmentDescriptors,
    /// ILLEGAL REQUEST, 26h/09h UNSUPPORTED SEGMENT DESCRIPTOR TYPE CODE.
    #[error("unsupported segment descriptor type code")]
    UnsupportedSegmentDescriptorType,
    /// ILLEGAL REQUEST, 00h/16h OPERATION IN PROGRESS: an EXTENDED COPY with this LIST
    /// IDENTIFIER is still running for the I_T nexus.
    #[error("operation in progress")]
    OperationInProgress,
    /// COPY ABORTED with `asc`/`ascq`, COMMAND-SPECIFIC INFORMATION = the segment descriptor
    /// number: an EXTENDED COPY could not process segment `segment` (08h/04h UNREACHABLE COPY
    /// TARGET, 0Dh/02h COPY TARGET DEVICE NOT REACHABLE, 00h/00h for a range outside a copy
    /// target, or the ASC of the medium error that stopped it).
    #[error("copy aborted in segment {segment} ({asc:02x}h/{ascq:02x}h)")]
    CopyAborted { segment: u32, asc: u8, ascq: u8 },
}

impl SenseReason {
    /// Shorthand for an INVALID FIELD IN CDB pointing at a whole byte.
    pub(crate) fn cdb_byte(byte: u16) -> Self {
        SenseReason::InvalidFieldInCdb { byte, bit: None }
    }
    /// Shorthand for an INVALID FIELD IN CDB pointing at a bit (the field's most significant).
    pub(crate) fn cdb_bit(byte: u16, bit: u8) -> Self {
        SenseReason::InvalidFieldInCdb {
            byte,
            bit: Some(bit),
        }
    }
    /// Shorthand for an INVALID FIELD IN PARAMETER LIST.
    pub(crate) fn param(byte: usize, bit: Option<u8>) -> Self {
        SenseReason::InvalidFieldInParameterList {
            byte: u16::try_from(byte).unwrap_or(u16::MAX),
            bit,
        }
    }

    /// THE table: sense key, ASC/ASCQ, INFORMATION and field pointer of each reason.
    pub fn sense(&self) -> SenseFields {
        let f = |key, asc, ascq| SenseFields {
            key,
            asc,
            ascq,
            information: None,
            field_pointer: None,
            command_specific: None,
        };
        use SenseKey as K;
        match *self {
            SenseReason::NoSense => f(K::NO_SENSE, 0x00, 0x00),
            SenseReason::InvalidOpcode => f(K::ILLEGAL_REQUEST, 0x20, 0x00),
            SenseReason::CdbTooShort => f(K::ILLEGAL_REQUEST, 0x24, 0x00),
            SenseReason::InvalidFieldInCdb { byte, bit } => SenseFields {
                field_pointer: Some(FieldPointer {
                    in_cdb: true,
                    byte,
                    bit,
                }),
                ..f(K::ILLEGAL_REQUEST, 0x24, 0x00)
            },
            SenseReason::InvalidFieldInParameterList { byte, bit } => SenseFields {
                field_pointer: Some(FieldPointer {
                    in_cdb: false,
                    byte,
                    bit,
                }),
                ..f(K::ILLEGAL_REQUEST, 0x26, 0x00)
            },
            SenseReason::ParameterListLengthError => f(K::ILLEGAL_REQUEST, 0x1A, 0x00),
            SenseReason::InvalidReleaseOfPersistentReservation => f(K::ILLEGAL_REQUEST, 0x26, 0x04),
            SenseReason::LbaOutOfRange => f(K::ILLEGAL_REQUEST, 0x21, 0x00),
            SenseReason::LogicalUnitNotSupported => f(K::ILLEGAL_REQUEST, 0x25, 0x00),
            SenseReason::SavingParametersNotSupported => f(K::ILLEGAL_REQUEST, 0x39, 0x00),
            SenseReason::MediumRemovalPrevented => f(K::ILLEGAL_REQUEST, 0x53, 0x02),
            SenseReason::WriteProtected => f(K::DATA_PROTECT, 0x27, 0x00),
            SenseReason::SpaceAllocationFailed => f(K::DATA_PROTECT, 0x27, 0x07),
            SenseReason::Miscompare { offset } => SenseFields {
                information: Some(offset),
                ..f(K::MISCOMPARE, 0x1D, 0x00)
            },
            SenseReason::UnrecoveredReadError { lba } => SenseFields {
                information: Some(lba),
                ..f(K::MEDIUM_ERROR, 0x11, 0x00)
            },
            SenseReason::WriteError { lba } => SenseFields {
                information: Some(lba),
                ..f(K::MEDIUM_ERROR, 0x0C, 0x00)
            },
            SenseReason::BecomingReady => f(K::NOT_READY, 0x04, 0x01),
            SenseReason::ManualInterventionRequired => f(K::NOT_READY, 0x04, 0x03),
            SenseReason::NotAccessible(s) => f(K::NOT_READY, 0x04, s.refusal_ascq()),
            SenseReason::InternalTargetFailure => f(K::HARDWARE_ERROR, 0x44, 0x00),
            SenseReason::ProtocolCrcError => f(K::ABORTED_COMMAND, 0x47, 0x05),
            SenseReason::DataPhaseError => f(K::ABORTED_COMMAND, 0x4b, 0x00),
            SenseReason::UnitAttention(ua) => {
                let (asc, ascq) = ua.asc_ascq();
                f(K::UNIT_ATTENTION, asc, ascq)
            }
            SenseReason::TooManyTargetDescriptors => f(K::ILLEGAL_REQUEST, 0x26, 0x06),
            SenseReason::UnsupportedTargetDescriptorType => f(K::ILLEGAL_REQUEST, 0x26, 0x07),
            SenseReason::TooManySegmentDescriptors => f(K::ILLEGAL_REQUEST, 0x26, 0x08),
            SenseReason::UnsupportedSegmentDescriptorType => f(K::ILLEGAL_REQUEST, 0x26, 0x09),
            SenseReason::OperationInProgress => f(K::ILLEGAL_REQUEST, 0x00, 0x16),
            SenseReason::CopyAborted { segment, asc, ascq } => SenseFields {
                command_specific: Some(segment),
                ..f(K::COPY_ABORTED, asc, ascq)
            },
        }
    }

    /// Fixed-format sense data (SPC-4 §4.5.3), current error, 18 bytes.
    pub fn to_fixed_sense(&self) -> Bytes {
        Bytes::copy_from_slice(&self.fixed_sense_array())
    }

    pub(crate) fn fixed_sense_array(&self) -> [u8; FIXED_SENSE_LEN] {
        let s = self.sense();
        let mut b = [0u8; FIXED_SENSE_LEN];
        b[0] = 0x70;
        if let Some(info) = s.information.and_then(|i| u32::try_from(i).ok()) {
            b[0] |= 0x80; // VALID
            b[3..7].copy_from_slice(&info.to_be_bytes());
        }
        b[2] = s.key.0 & 0x0F;
        b[7] = (FIXED_SENSE_LEN - 8) as u8; // ADDITIONAL SENSE LENGTH
        if let Some(csi) = s.command_specific {
            b[8..12].copy_from_slice(&csi.to_be_bytes());
        }
        b[12] = s.asc;
        b[13] = s.ascq;
        if let Some(fp) = s.field_pointer {
            let mut b15 = 0x80; // SKSV
            if fp.in_cdb {
                b15 |= 0x40; // C/D
            }
            if let Some(bit) = fp.bit {
                b15 |= 0x08 | (bit & 0x07); // BPV + BIT POINTER
            }
            b[15] = b15;
            b[16..18].copy_from_slice(&fp.byte.to_be_bytes());
        }
        b
    }

    /// Map a backend failure to sense data. `block_size` converts byte offsets to LBAs for the
    /// INFORMATION field. This and [`SenseReason::sense`] are the only places errors become
    /// sense.
    pub fn from_backend(e: &BackendError, block_size: u32) -> Self {
        let lba = |off: u64| off / u64::from(block_size.max(1));
        match *e {
            BackendError::OutOfRange => SenseReason::LbaOutOfRange,
            BackendError::Unsupported => SenseReason::InvalidOpcode,
            BackendError::NoSpace => SenseReason::SpaceAllocationFailed,
            BackendError::ReadError { offset } => {
                SenseReason::UnrecoveredReadError { lba: lba(offset) }
            }
            BackendError::WriteError { offset } => SenseReason::WriteError { lba: lba(offset) },
            BackendError::Io(_) => SenseReason::InternalTargetFailure,
            BackendError::Unavailable(_) => SenseReason::BecomingReady,
            BackendError::Fenced(_) => SenseReason::ManualInterventionRequired,
            BackendError::Suspended(_) => {
                SenseReason::NotAccessible(crate::alua::AccessState::Unavailable)
            }
        }
    }
}

/// Length of the fixed-format sense data produced here.
pub const FIXED_SENSE_LEN: usize = 18;
