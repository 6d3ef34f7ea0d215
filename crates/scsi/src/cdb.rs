//! CDB access without panics, operation codes, and [`data_out_len`].
//!
//! Every accessor here reads past-the-end bytes as zero instead of indexing; the dispatcher
//! also refuses CDBs shorter than their operation code's length before any handler runs, so the
//! zero fill is a second line of defence, never a semantic.

use crate::sense::SenseReason;

/// Operation codes handled by this device server (SPC-4 annex E / SBC-3 table 13).
pub mod opcode {
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const REQUEST_SENSE: u8 = 0x03;
    pub const READ_6: u8 = 0x08;
    pub const WRITE_6: u8 = 0x0A;
    pub const INQUIRY: u8 = 0x12;
    pub const MODE_SELECT_6: u8 = 0x15;
    pub const RESERVE_6: u8 = 0x16;
    pub const RELEASE_6: u8 = 0x17;
    pub const MODE_SENSE_6: u8 = 0x1A;
    pub const START_STOP_UNIT: u8 = 0x1B;
    pub const PREVENT_ALLOW_MEDIUM_REMOVAL: u8 = 0x1E;
    pub const READ_CAPACITY_10: u8 = 0x25;
    pub const READ_10: u8 = 0x28;
    pub const WRITE_10: u8 = 0x2A;
    pub const WRITE_AND_VERIFY_10: u8 = 0x2E;
    pub const VERIFY_10: u8 = 0x2F;
    pub const PRE_FETCH_10: u8 = 0x34;
    pub const SYNCHRONIZE_CACHE_10: u8 = 0x35;
    pub const READ_DEFECT_DATA_10: u8 = 0x37;
    pub const WRITE_SAME_10: u8 = 0x41;
    pub const UNMAP: u8 = 0x42;
    pub const SANITIZE: u8 = 0x48;
    pub const MODE_SELECT_10: u8 = 0x55;
    pub const RESERVE_10: u8 = 0x56;
    pub const RELEASE_10: u8 = 0x57;
    pub const MODE_SENSE_10: u8 = 0x5A;
    pub const PERSISTENT_RESERVE_IN: u8 = 0x5E;
    pub const PERSISTENT_RESERVE_OUT: u8 = 0x5F;
    pub const EXTENDED_COPY: u8 = 0x83;
    pub const RECEIVE_COPY_RESULTS: u8 = 0x84;
    pub const READ_16: u8 = 0x88;
    pub const COMPARE_AND_WRITE: u8 = 0x89;
    pub const WRITE_16: u8 = 0x8A;
    pub const ORWRITE_16: u8 = 0x8B;
    pub const WRITE_AND_VERIFY_16: u8 = 0x8E;
    pub const VERIFY_16: u8 = 0x8F;
    pub const PRE_FETCH_16: u8 = 0x90;
    pub const SYNCHRONIZE_CACHE_16: u8 = 0x91;
    pub const WRITE_SAME_16: u8 = 0x93;
    pub const WRITE_ATOMIC_16: u8 = 0x9C;
    pub const SERVICE_ACTION_IN_16: u8 = 0x9E;
    pub const REPORT_LUNS: u8 = 0xA0;
    pub const MAINTENANCE_IN: u8 = 0xA3;
    pub const MAINTENANCE_OUT: u8 = 0xA4;
    pub const READ_12: u8 = 0xA8;
    pub const WRITE_12: u8 = 0xAA;
    pub const WRITE_AND_VERIFY_12: u8 = 0xAE;
    pub const VERIFY_12: u8 = 0xAF;
    pub const READ_DEFECT_DATA_12: u8 = 0xB7;

    /// SERVICE ACTION IN (16) service actions (SBC-3 READ CAPACITY (16), GET LBA STATUS).
    pub const SAI_READ_CAPACITY_16: u8 = 0x10;
    pub const SAI_GET_LBA_STATUS: u8 = 0x12;
    /// MAINTENANCE IN service action REPORT SUPPORTED OPERATION CODES (SPC-4 REPORT SUPPORTED OPERATION CODES).
    pub const MI_REPORT_SUPPORTED_OPCODES: u8 = 0x0C;
    /// MAINTENANCE IN service action REPORT TARGET PORT GROUPS (SPC-4).
    pub const MI_REPORT_TARGET_PGS: u8 = 0x0A;
    /// MAINTENANCE OUT service action SET TARGET PORT GROUPS (SPC-4).
    pub const MO_SET_TARGET_PGS: u8 = 0x0A;
    /// PERSISTENT RESERVE IN service actions (SPC-4).
    pub const PRIN_READ_KEYS: u8 = 0x00;
    pub const PRIN_READ_RESERVATION: u8 = 0x01;
    pub const PRIN_REPORT_CAPABILITIES: u8 = 0x02;
    pub const PRIN_READ_FULL_STATUS: u8 = 0x03;
    /// PERSISTENT RESERVE OUT service actions (SPC-4).
    pub const PROUT_REGISTER: u8 = 0x00;
    pub const PROUT_RESERVE: u8 = 0x01;
    pub const PROUT_RELEASE: u8 = 0x02;
    pub const PROUT_CLEAR: u8 = 0x03;
    pub const PROUT_PREEMPT: u8 = 0x04;
    pub const PROUT_PREEMPT_AND_ABORT: u8 = 0x05;
    pub const PROUT_REGISTER_AND_IGNORE: u8 = 0x06;
    pub const PROUT_REGISTER_AND_MOVE: u8 = 0x07;
    /// EXTENDED COPY service action (SPC-4: LID1; LID4 is 01h and not supported).
    pub const SA_EXTENDED_COPY_LID1: u8 = 0x00;
    /// RECEIVE COPY RESULTS service actions (SPC-4, LID1).
    pub const SA_RCR_COPY_STATUS: u8 = 0x00;
    pub const SA_RCR_OPERATING_PARAMETERS: u8 = 0x03;
    /// SANITIZE service actions (SBC-3).
    pub const SA_SANITIZE_OVERWRITE: u8 = 0x01;
    pub const SA_SANITIZE_BLOCK_ERASE: u8 = 0x02;
    pub const SA_SANITIZE_CRYPTO_ERASE: u8 = 0x03;
    pub const SA_SANITIZE_EXIT_FAILURE_MODE: u8 = 0x1F;
}

/// CDB length implied by the operation code's group code (SPC-4 operation code group codes);
/// `None` for the reserved and vendor-specific groups and the variable-length group 3.
pub fn cdb_length(op: u8) -> Option<usize> {
    match op >> 5 {
        0 => Some(6),
        1 | 2 => Some(10),
        4 => Some(16),
        5 => Some(12),
        _ => None,
    }
}

/// A CDB whose fields read as zero past its end (never panics).
#[derive(Clone, Copy)]
pub(crate) struct Cdb<'a>(pub &'a [u8]);

impl Cdb<'_> {
    pub(crate) fn op(&self) -> u8 {
        self.u8(0)
    }
    pub(crate) fn u8(&self, i: usize) -> u8 {
        self.0.get(i).copied().unwrap_or(0)
    }
    pub(crate) fn bit(&self, i: usize, bit: u8) -> bool {
        self.u8(i) & (1 << bit) != 0
    }
    /// Big-endian unsigned field of `n` (<= 8) bytes at `i`.
    pub(crate) fn be(&self, i: usize, n: usize) -> u64 {
        (i..i + n).fold(0u64, |acc, j| (acc << 8) | u64::from(self.u8(j)))
    }
    pub(crate) fn u16(&self, i: usize) -> u16 {
        self.be(i, 2) as u16
    }
    pub(crate) fn u32(&self, i: usize) -> u32 {
        self.be(i, 4) as u32
    }
    pub(crate) fn u64(&self, i: usize) -> u64 {
        self.be(i, 8)
    }
    /// Offset of the CONTROL byte (the last byte of a fixed-length CDB).
    pub(crate) fn control_offset(&self) -> usize {
        cdb_length(self.op()).unwrap_or(1) - 1
    }
}

/// The LBA/length part of the READ, WRITE, VERIFY and WRITE SAME families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockRange {
    pub lba: u64,
    /// Number of logical blocks (READ/WRITE(6) length 0 already turned into 256).
    pub blocks: u32,
    /// CDB byte of the transfer length field, for field pointers.
    pub len_byte: u16,
}

/// Decode LBA and transfer length of a READ/WRITE/VERIFY/WRITE SAME/SYNCHRONIZE CACHE/
/// COMPARE AND WRITE CDB by its size class (SBC-3 clause 5 CDB layouts: 6-byte with a 21-bit LBA, 10/12/16-byte).
pub(crate) fn block_range(cdb: Cdb<'_>) -> BlockRange {
    use opcode::*;
    match cdb.op() {
        READ_6 | WRITE_6 => {
            // SBC-3 READ (6) / WRITE (6): TRANSFER LENGTH 0 means 256 blocks.
            let len = cdb.u8(4);
            BlockRange {
                lba: cdb.be(1, 3) & 0x1F_FFFF,
                blocks: if len == 0 { 256 } else { u32::from(len) },
                len_byte: 4,
            }
        }
        READ_12 | WRITE_12 | VERIFY_12 | WRITE_AND_VERIFY_12 => BlockRange {
            lba: u64::from(cdb.u32(2)),
            blocks: cdb.u32(6),
            len_byte: 6,
        },
        // COMPARE AND WRITE: NUMBER OF LOGICAL BLOCKS is the single byte 13 (SBC-3 COMPARE AND WRITE).
        COMPARE_AND_WRITE => BlockRange {
            lba: cdb.u64(2),
            blocks: u32::from(cdb.u8(13)),
            len_byte: 13,
        },
        // WRITE ATOMIC (16): TRANSFER LENGTH is bytes 12..13 (SBC-4).
        WRITE_ATOMIC_16 => BlockRange {
            lba: cdb.u64(2),
            blocks: u32::from(cdb.u16(12)),
            len_byte: 12,
        },
        READ_16 | WRITE_16 | VERIFY_16 | WRITE_AND_VERIFY_16 | SYNCHRONIZE_CACHE_16
        | WRITE_SAME_16 | ORWRITE_16 | PRE_FETCH_16 => BlockRange {
            lba: cdb.u64(2),
            blocks: cdb.u32(10),
            len_byte: 10,
        },
        // READ(10), WRITE(10), VERIFY(10), SYNCHRONIZE CACHE(10), WRITE SAME(10).
        _ => BlockRange {
            lba: u64::from(cdb.u32(2)),
            blocks: u32::from(cdb.u16(7)),
            len_byte: 7,
        },
    }
}

/// Largest single data transfer (READ/WRITE/VERIFY) this device server accepts, in bytes;
/// reported as MAXIMUM TRANSFER LENGTH in the Block Limits VPD page and enforced on every
/// command, so no command can make us allocate more than this.
pub const MAX_TRANSFER_BYTES: u32 = 32 << 20;

/// Largest parameter list accepted for PERSISTENT RESERVE OUT (and EXTENDED COPY): longer
/// lists are cut here by `data_out_len` and refused by the command.
pub const MAX_PARAMETER_LIST: u32 = 64 << 10;

/// Whether the command with this CDB may change the medium (a write of any kind, zeroing,
/// unmapping, sanitizing, an EXTENDED COPY): what a cluster must admit before it runs
/// (`ClusterLu::begin_write`).
pub fn changes_medium(cdb: &[u8]) -> bool {
    use opcode::*;
    matches!(
        cdb.first().copied(),
        Some(
            WRITE_6
                | WRITE_10
                | WRITE_12
                | WRITE_16
                | WRITE_AND_VERIFY_10
                | WRITE_AND_VERIFY_12
                | WRITE_AND_VERIFY_16
                | WRITE_SAME_10
                | WRITE_SAME_16
                | UNMAP
                | COMPARE_AND_WRITE
                | ORWRITE_16
                | WRITE_ATOMIC_16
                | SANITIZE
                | EXTENDED_COPY
        )
    )
}

/// [`MAX_TRANSFER_BYTES`] in blocks of `block_size`.
pub fn max_transfer_blocks(block_size: u32) -> u32 {
    MAX_TRANSFER_BYTES / block_size.max(1)
}

/// VERIFY BYTCHK field (SBC-4 VERIFY: two bits 2..1; SBC-3's single bit is the same as 01b).
pub(crate) fn verify_bytchk(cdb: Cdb<'_>) -> u8 {
    (cdb.u8(1) >> 1) & 0x03
}

/// Bytes of Data-Out this CDB takes from the initiator, so the iSCSI layer knows how much to
/// solicit (R2T) and what residual to report. Only the CDB is looked at; `block_size` is the
/// addressed LU's. CDBs that are not understood (unknown opcode, too short) yield `Ok(0)` or the
/// sense reason that [`crate::Target::execute`] will also report for them, so a caller may fail
/// the command early without soliciting data.
///
/// * WRITE(6/10/12/16): TRANSFER LENGTH × block size (WRITE(6) 0 → 256 blocks).
/// * VERIFY(10/12/16): BYTCHK=01b → length × block size; 11b → one block; 00b → 0.
/// * WRITE SAME(10/16): one block, unless NDOB (16 only).
/// * COMPARE AND WRITE: 2 × NUMBER OF LOGICAL BLOCKS × block size.
/// * ORWRITE (16), WRITE ATOMIC (16): TRANSFER LENGTH × block size.
/// * MODE SELECT(6/10), UNMAP, SANITIZE: PARAMETER LIST LENGTH.
/// * PERSISTENT RESERVE OUT, EXTENDED COPY: PARAMETER LIST LENGTH (at most
///   [`MAX_PARAMETER_LIST`]).
/// * everything else: 0.
pub fn data_out_len(cdb: &[u8], block_size: u32) -> Result<u32, SenseReason> {
    use opcode::*;
    let Some(&op) = cdb.first() else {
        return Err(SenseReason::CdbTooShort);
    };
    let c = Cdb(cdb);
    let needs_len = |n: usize| {
        if cdb.len() < n {
            Err(SenseReason::CdbTooShort)
        } else {
            Ok(())
        }
    };
    let blocks_bytes = |blocks: u32, len_byte: u16| -> Result<u32, SenseReason> {
        if blocks > max_transfer_blocks(block_size) {
            return Err(SenseReason::cdb_byte(len_byte));
        }
        Ok(blocks * block_size)
    };
    match op {
        WRITE_6 | WRITE_10 | WRITE_12 | WRITE_16 | WRITE_AND_VERIFY_10 | WRITE_AND_VERIFY_12
        | WRITE_AND_VERIFY_16 | ORWRITE_16 | WRITE_ATOMIC_16 => {
            needs_len(cdb_length(op).unwrap_or(16))?;
            let r = block_range(c);
            blocks_bytes(r.blocks, r.len_byte)
        }
        VERIFY_10 | VERIFY_12 | VERIFY_16 => {
            needs_len(cdb_length(op).unwrap_or(16))?;
            let r = block_range(c);
            match verify_bytchk(c) {
                0b01 => blocks_bytes(r.blocks, r.len_byte),
                0b11 if r.blocks > 0 => Ok(block_size),
                _ => Ok(0),
            }
        }
        WRITE_SAME_10 | WRITE_SAME_16 => {
            needs_len(cdb_length(op).unwrap_or(16))?;
            // SBC-4 WRITE SAME (16): NDOB (16 only, byte 1 bit 0) means no data-out buffer.
            if op == WRITE_SAME_16 && c.bit(1, 0) {
                Ok(0)
            } else {
                Ok(block_size)
            }
        }
        COMPARE_AND_WRITE => {
            needs_len(16)?;
            let r = block_range(c);
            let b = blocks_bytes(r.blocks, r.len_byte)?;
            Ok(b * 2)
        }
        MODE_SELECT_6 => {
            needs_len(6)?;
            Ok(u32::from(c.u8(4)))
        }
        MODE_SELECT_10 | UNMAP | SANITIZE => {
            needs_len(10)?;
            Ok(u32::from(c.u16(7)))
        }
        PERSISTENT_RESERVE_OUT => {
            needs_len(10)?;
            Ok(c.u32(5).min(MAX_PARAMETER_LIST))
        }
        MAINTENANCE_OUT => {
            needs_len(12)?;
            Ok(c.u32(6).min(MAX_PARAMETER_LIST))
        }
        EXTENDED_COPY => {
            needs_len(16)?;
            Ok(c.u32(10).min(MAX_PARAMETER_LIST))
        }
        _ => Ok(0),
    }
}
