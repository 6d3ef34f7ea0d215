//! SBC-3 block commands: READ/WRITE(6/10/12/16), VERIFY(10/12/16), READ CAPACITY(10/16),
//! SYNCHRONIZE CACHE(10/16), START STOP UNIT, WRITE SAME(10/16), UNMAP, GET LBA STATUS,
//! COMPARE AND WRITE, and the block VPD pages (B0h, B1h, B2h).
//!
//! Every medium access is range checked here (LBA + length, with no u64 wrap, against the
//! capacity) before the backend sees a byte offset, and every transfer is bounded by
//! [`MAX_TRANSFER_BYTES`](crate::MAX_TRANSFER_BYTES), so no CDB can make us allocate more.

use crate::cdb::{block_range, opcode::*, verify_bytchk, BlockRange, Cdb};
use crate::lu::{lock, Kept, RangeGuard};
use crate::sense::SenseReason;
use crate::spc::truncate;
use crate::{DataIn, LogicalUnit};
use bytes::{Bytes, BytesMut};
use ironsan_backend::{BackendError, WriteMode};
use std::sync::Arc;

/// Largest WRITE SAME (without UNMAP) in bytes; MAXIMUM WRITE SAME LENGTH in B0h.
const MAX_WRITE_SAME_BYTES: u64 = 1 << 30;
/// Largest total UNMAP (or WRITE SAME with UNMAP) in bytes; MAXIMUM UNMAP LBA COUNT in B0h.
const MAX_UNMAP_BYTES: u64 = 1 << 30;
/// MAXIMUM UNMAP BLOCK DESCRIPTOR COUNT in B0h.
const MAX_UNMAP_DESCRIPTORS: usize = 256;
/// MAXIMUM COMPARE AND WRITE LENGTH in B0h (blocks).
const MAX_COMPARE_AND_WRITE_BLOCKS: u8 = 64;
/// Size of the pattern buffer WRITE SAME writes repeatedly.
const WRITE_SAME_CHUNK: usize = 1 << 20;

fn backend_err(lu: &LogicalUnit) -> impl Fn(BackendError) -> SenseReason + '_ {
    move |e| SenseReason::from_backend(&e, lu.block_size())
}

fn bytes_of(lu: &LogicalUnit, blocks: u64) -> u64 {
    blocks * u64::from(lu.block_size())
}

/// RDPROTECT/WRPROTECT/VRPROTECT (byte 1 bits 7..5) must be 000b: no protection information
/// (SBC-3 protection information model; READ(6)/WRITE(6) have no such field).
fn check_no_protection(cdb: Cdb<'_>) -> Result<(), SenseReason> {
    if !matches!(cdb.op(), READ_6 | WRITE_6) && cdb.u8(1) >> 5 != 0 {
        return Err(SenseReason::cdb_bit(1, 7));
    }
    Ok(())
}

/// TRANSFER LENGTH beyond the Block Limits MAXIMUM TRANSFER LENGTH is INVALID FIELD IN CDB
/// (SBC-3 Block Limits VPD page).
fn check_transfer(lu: &LogicalUnit, r: &BlockRange) -> Result<(), SenseReason> {
    if r.blocks > lu.max_transfer_blocks() {
        return Err(SenseReason::cdb_byte(r.len_byte));
    }
    Ok(())
}

/// LBA + length beyond the capacity, or wrapping u64: LOGICAL BLOCK ADDRESS OUT OF RANGE
/// (SBC-3 logical blocks model). Length 0 at LBA == capacity is in range.
fn check_range(lu: &LogicalUnit, lba: u64, blocks: u64) -> Result<(), SenseReason> {
    if !lu.in_range(lba, blocks) {
        return Err(SenseReason::LbaOutOfRange);
    }
    Ok(())
}

pub(crate) fn check_writable(lu: &LogicalUnit) -> Result<(), SenseReason> {
    if lu.config().read_only || lu.swp() {
        return Err(SenseReason::WriteProtected);
    }
    Ok(())
}

/// SBC-3 caching model, FUA bit: WCE=0 → durable; WCE=1 → cached unless FUA.
pub(crate) fn write_mode(lu: &LogicalUnit, fua: bool) -> WriteMode {
    if fua || !lu.wce() {
        WriteMode::Durable
    } else {
        WriteMode::Cached
    }
}

/// Read whole blocks. First waits for any orphaned write of the blocks (an aborted write the
/// device still holds) to finish, so a read after the abort never sees it land later (one
/// atomic load when there is none).
async fn read_blocks(lu: &LogicalUnit, lba: u64, blocks: u32) -> Result<Bytes, SenseReason> {
    lu.writes.settled(lba, lba + u64::from(blocks)).await;
    read_settled(lu, lba, blocks).await
}

/// [`read_blocks`] once the blocks' orphaned writes are known to be done.
async fn read_settled(lu: &LogicalUnit, lba: u64, blocks: u32) -> Result<Bytes, SenseReason> {
    let len = bytes_of(lu, u64::from(blocks)) as usize;
    let data = lu
        .backend()
        .read(bytes_of(lu, lba), len)
        .await
        .map_err(backend_err(lu))?;
    if data.len() < len {
        return Err(SenseReason::InternalTargetFailure);
    }
    Ok(data.slice(..len))
}

/// SBC-3 READ (6), READ (10), READ (12), READ (16). DPO and FUA are accepted;
/// FUA on a read is satisfied trivially because every backend reads what it last wrote.
/// With `in_place` (the transport can send from a file), a read of at least `min` bytes that
/// the backend can leave in the page cache answers with the file range; it waits for orphaned
/// writes first, like every read.
pub(crate) async fn read(
    lu: &LogicalUnit,
    cdb: Cdb<'_>,
    in_place: Option<ironsan_backend::InPlaceRead>,
) -> Result<DataIn, SenseReason> {
    check_no_protection(cdb)?;
    let r = block_range(cdb);
    check_transfer(lu, &r)?;
    check_range(lu, r.lba, u64::from(r.blocks))?;
    if r.blocks == 0 {
        return Ok(DataIn::default());
    }
    lu.writes.settled(r.lba, r.lba + u64::from(r.blocks)).await;
    let len = bytes_of(lu, u64::from(r.blocks));
    if let Some(ip) = in_place.filter(|ip| len >= u64::from(ip.min)) {
        if let Some(range) = lu
            .backend()
            .read_in_place(bytes_of(lu, r.lba), len as usize, ip)
        {
            return Ok(DataIn::File(range));
        }
    }
    read_settled(lu, r.lba, r.blocks).await.map(DataIn::Memory)
}

/// Write whole blocks at `lba`, handing the range-lock keep to the backend so the range stays
/// locked until the I/O is really done (docs/INTEGRITY.md, promise 11).
async fn write_blocks(
    lu: &LogicalUnit,
    lba: u64,
    data: Bytes,
    mode: ironsan_backend::WriteMode,
    keep: Kept,
) -> Result<(), SenseReason> {
    keep.run(|k| lu.backend().write_keeping(bytes_of(lu, lba), data, mode, k))
        .await
        .map_err(backend_err(lu))
}

/// The checks every block write makes, in SBC-3 order: protection field, write protect,
/// transfer length, LBA range.
fn writable_range(lu: &LogicalUnit, cdb: Cdb<'_>) -> Result<BlockRange, SenseReason> {
    check_no_protection(cdb)?;
    check_writable(lu)?;
    let r = block_range(cdb);
    check_transfer(lu, &r)?;
    check_range(lu, r.lba, u64::from(r.blocks))?;
    Ok(r)
}

/// SBC-3 WRITE (6), WRITE (10), WRITE (12), WRITE (16). Check order:
/// protection field, write protect, transfer length, range, Data-Out size.
pub(crate) async fn write(
    lu: &LogicalUnit,
    cdb: Cdb<'_>,
    mut data_out: Bytes,
) -> Result<Bytes, SenseReason> {
    let r = writable_range(lu, cdb)?;
    if r.blocks == 0 {
        return Ok(Bytes::new());
    }
    // iSCSI EDTL smaller than the CDB's transfer length (RFC 7143 §11.4.5.2 overflow): write
    // only the whole blocks the initiator sent; the transport reports the residual. This is
    // what libiscsi's iSCSIResiduals suite expects of a target.
    let blocks = r
        .blocks
        .min((data_out.len() / lu.block_size() as usize) as u32);
    if blocks == 0 {
        return Ok(Bytes::new());
    }
    let len = bytes_of(lu, u64::from(blocks)) as usize;
    let fua = cdb.op() != WRITE_6 && cdb.bit(1, 3);
    let g = lu.writes.lock(r.lba, r.lba + u64::from(blocks)).await;
    data_out.truncate(len);
    write_blocks(lu, r.lba, data_out, write_mode(lu, fua), g.keep()).await?;
    Ok(Bytes::new())
}

/// A WRITE whose data the transport receives straight into the medium (see
/// [`Scsi::place_write`](crate::Scsi::place_write)): every check the command makes has passed
/// and its range is locked until this is finished or dropped. Dropping it part way (the
/// transfer failed or the task was aborted) leaves the blocks received so far written, as a
/// device that wrote part of an aborted command would; nothing lands after the drop.
pub struct PlacedWrite {
    lu: Arc<LogicalUnit>,
    target: ironsan_backend::InPlaceWrite,
    durable: bool,
    _range: RangeGuard,
}

impl std::fmt::Debug for PlacedWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlacedWrite")
            .field("len", &self.target.len())
            .field("durable", &self.durable)
            .finish()
    }
}

impl PlacedWrite {
    /// Where the transport puts the Data-Out bytes (buffer offset = byte `at` of this).
    pub fn target(&self) -> &ironsan_backend::InPlaceWrite {
        &self.target
    }

    /// Every byte is in place: make them durable if the write must be (WCE=0 or FUA), release
    /// the range and give the command's outcome.
    pub fn finish(self) -> Result<(), SenseReason> {
        if self.durable {
            self.target.sync().map_err(backend_err(&self.lu))?;
        }
        Ok(())
    }

    /// Placing the bytes failed with `e` (the file was cut short behind our back): the
    /// command's outcome.
    pub fn failed(self, e: &std::io::Error) -> SenseReason {
        let e = BackendError::from_io(e, self.target.offset(), true);
        SenseReason::from_backend(&e, self.lu.block_size())
    }
}

/// The checks of [`write`] for a WRITE (10/12/16) whose Data-Out is `data_len` bytes, made
/// before the data arrives; `Some` when they pass, the data covers the whole transfer, the
/// backend can receive it in place, `may_begin` (the caller's checks of the nexus) agrees, and
/// the range is free at once. Anything else is `None` and the command takes the usual path,
/// which makes (and reports) the same checks itself. The backend is asked first, so a LUN
/// that cannot take bytes in place (RAM, null, disk files) costs no lock here.
pub(crate) fn place_write(
    lu: &Arc<LogicalUnit>,
    cdb: Cdb<'_>,
    data_len: u32,
    may_begin: impl FnOnce() -> bool,
) -> Option<PlacedWrite> {
    if !matches!(cdb.op(), WRITE_10 | WRITE_12 | WRITE_16) {
        return None;
    }
    let r = writable_range(lu, cdb).ok()?;
    let len = bytes_of(lu, u64::from(r.blocks));
    if r.blocks == 0 || len != u64::from(data_len) {
        return None;
    }
    let target = lu
        .backend()
        .write_in_place(bytes_of(lu, r.lba), len as usize)?
        .in_grains_of(lu.block_size() as usize);
    if !may_begin() {
        return None;
    }
    let range = lu.writes.try_lock(r.lba, r.lba + u64::from(r.blocks))?;
    Some(PlacedWrite {
        lu: Arc::clone(lu),
        target,
        durable: write_mode(lu, cdb.bit(1, 3)) == WriteMode::Durable,
        _range: range,
    })
}

/// SBC-3 WRITE AND VERIFY (10), (12), (16): a write that is durable before the verify (the
/// medium is verified, so the data must have reached it), then, with BYTCHK=1, a read-back
/// compared with what was sent (MISCOMPARE with the offset). BYTCHK is byte 1 bit 1.
pub(crate) async fn write_and_verify(
    lu: &LogicalUnit,
    cdb: Cdb<'_>,
    data_out: &Bytes,
) -> Result<Bytes, SenseReason> {
    let r = writable_range(lu, cdb)?;
    let blocks = r
        .blocks
        .min((data_out.len() / lu.block_size() as usize) as u32);
    if blocks == 0 {
        return Ok(Bytes::new());
    }
    let len = bytes_of(lu, u64::from(blocks)) as usize;
    // Held over the read-back too (no other writer between write and verify).
    let g = Arc::new(lu.writes.lock(r.lba, r.lba + u64::from(blocks)).await);
    write_blocks(
        lu,
        r.lba,
        data_out.slice(..len),
        ironsan_backend::WriteMode::Durable,
        g.keep_shared(),
    )
    .await?;
    if cdb.bit(1, 1) {
        let back = read_blocks(lu, r.lba, blocks).await?;
        if let Some(offset) = first_difference(&back, &data_out[..len]) {
            return Err(SenseReason::Miscompare {
                offset: offset as u64,
            });
        }
    }
    Ok(Bytes::new())
}

/// Offset of the first differing byte.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// SBC-3 VERIFY (10), VERIFY (12), VERIFY (16), with SBC-4's two-bit BYTCHK:
/// 00b reads the range (surfacing medium errors), 01b compares it with the Data-Out buffer,
/// 11b compares every block with the single block sent. A miscompare reports the Data-Out
/// offset of the first differing byte in INFORMATION. The verification length is bounded by
/// the maximum transfer length like any other transfer.
pub(crate) async fn verify(
    lu: &LogicalUnit,
    cdb: Cdb<'_>,
    data_out: &Bytes,
) -> Result<Bytes, SenseReason> {
    check_no_protection(cdb)?;
    let bytchk = verify_bytchk(cdb);
    if bytchk == 0b10 {
        return Err(SenseReason::cdb_bit(1, 2));
    }
    let r = block_range(cdb);
    check_transfer(lu, &r)?;
    check_range(lu, r.lba, u64::from(r.blocks))?;
    if r.blocks == 0 {
        return Ok(Bytes::new());
    }
    let bs = lu.block_size() as usize;
    let len = bytes_of(lu, u64::from(r.blocks)) as usize;
    let need = match bytchk {
        0b01 => len,
        0b11 => bs,
        _ => 0,
    };
    if data_out.len() < need {
        return Err(SenseReason::cdb_byte(r.len_byte));
    }
    let data = read_blocks(lu, r.lba, r.blocks).await?;
    let mismatch = match bytchk {
        0b01 => first_difference(&data, &data_out[..len]),
        0b11 => data
            .chunks(bs)
            .enumerate()
            .find_map(|(i, blk)| first_difference(blk, &data_out[..bs]).map(|o| i * bs + o)),
        _ => None,
    };
    match mismatch {
        Some(offset) => Err(SenseReason::Miscompare {
            offset: offset as u64,
        }),
        None => Ok(Bytes::new()),
    }
}

/// SBC-3 SYNCHRONIZE CACHE (10) / (16): range checked, then the whole backend is flushed
/// (the backend contract has no ranged flush). IMMED is accepted; status follows the flush.
pub(crate) async fn synchronize_cache(
    lu: &LogicalUnit,
    cdb: Cdb<'_>,
) -> Result<Bytes, SenseReason> {
    let r = block_range(cdb);
    check_range(lu, r.lba, u64::from(r.blocks))?;
    lu.backend().flush().await.map_err(backend_err(lu))?;
    Ok(Bytes::new())
}

/// SBC-3 START STOP UNIT: accepted. Stopping (START=0) flushes the cache unless
/// NO_FLUSH; ejecting (LOEJ=1, START=0) while a nexus prevents removal is refused.
pub(crate) async fn start_stop_unit(
    lu: &LogicalUnit,
    _nexus: &crate::Nexus,
    cdb: Cdb<'_>,
) -> Result<Bytes, SenseReason> {
    let b4 = cdb.u8(4);
    // POWER CONDITION (SBC-3 table 88): 0h, 1h, 2h, 3h, 7h, Ah, Bh are defined.
    if !matches!(b4 >> 4, 0x0 | 0x1 | 0x2 | 0x3 | 0x7 | 0xA | 0xB) {
        return Err(SenseReason::cdb_bit(4, 7));
    }
    let start = b4 & 0x01 != 0;
    let loej = b4 & 0x02 != 0;
    let no_flush = b4 & 0x04 != 0;
    if b4 >> 4 == 0 && !start {
        if loej && !lock(&lu.prevent).is_empty() {
            return Err(SenseReason::MediumRemovalPrevented);
        }
        if !no_flush {
            lu.backend().flush().await.map_err(backend_err(lu))?;
        }
    }
    Ok(Bytes::new())
}

/// RETURNED LOGICAL BLOCK ADDRESS: the last LBA (0 on an empty device).
fn last_lba(lu: &LogicalUnit) -> u64 {
    lu.capacity_blocks().saturating_sub(1)
}

/// PMI=0 requires LBA=0 (SBC-3 READ CAPACITY (10)/(16), as SBC-2 required and compliance tests check); PMI=1 returns the last LBA regardless (we
/// never have a "substantial delay" boundary).
fn check_pmi(
    cdb: Cdb<'_>,
    lba_at: usize,
    lba_len: usize,
    pmi_at: usize,
) -> Result<(), SenseReason> {
    if !cdb.bit(pmi_at, 0) && cdb.be(lba_at, lba_len) != 0 {
        return Err(SenseReason::cdb_byte(lba_at as u16));
    }
    Ok(())
}

/// SBC-3 READ CAPACITY (10): FFFF_FFFFh when the last LBA does not fit in 32 bits
/// (the initiator then uses READ CAPACITY(16)).
pub(crate) fn read_capacity_10(lu: &LogicalUnit, cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    check_pmi(cdb, 2, 4, 8)?;
    let last = u32::try_from(last_lba(lu))
        .ok()
        .filter(|&l| l != u32::MAX)
        .unwrap_or(u32::MAX);
    let mut d = Vec::with_capacity(8);
    d.extend_from_slice(&last.to_be_bytes());
    d.extend_from_slice(&lu.block_size().to_be_bytes());
    Ok(Bytes::from(d))
}

/// LOGICAL BLOCKS PER PHYSICAL BLOCK EXPONENT ([`LogicalUnit::physical_block_size`]).
fn lbppbe(lu: &LogicalUnit) -> u8 {
    ((lu.physical_block_size() / lu.block_size()).trailing_zeros() as u8).min(15)
}

fn unmap_supported(lu: &LogicalUnit) -> bool {
    lu.backend().capabilities().unmap
}

/// SBC-3 READ CAPACITY (16): 32 bytes; LBPME and LBPRZ when the backend can unmap
/// (its contract: unmapped ranges read back as zeros).
pub(crate) fn read_capacity_16(lu: &LogicalUnit, cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    check_pmi(cdb, 2, 8, 14)?;
    let alloc = cdb.u32(10) as usize;
    let mut d = vec![0u8; 32];
    d[0..8].copy_from_slice(&last_lba(lu).to_be_bytes());
    d[8..12].copy_from_slice(&lu.block_size().to_be_bytes());
    d[12] = 0; // P_TYPE / PROT_EN: no protection information
    d[13] = lbppbe(lu); // P_I_EXPONENT=0
    if unmap_supported(lu) {
        d[14] = 0x80 | 0x40; // LBPME, LBPRZ; LOWEST ALIGNED LBA = 0
    }
    Ok(truncate(d, alloc))
}

/// Most blocks one GET LBA STATUS looks at (bounds the backend map query).
const LBA_STATUS_SPAN_BYTES: u64 = 64 << 30;

/// SBC-3 GET LBA STATUS: descriptors from the starting LBA on, mapped (0h) or deallocated
/// (1h) as the backend's allocation map says ([`BlockDevice::map_status`]; a backend that
/// cannot tell reports mapped), covering at most [`LBA_STATUS_SPAN_BYTES`] and as many
/// descriptors as the allocation length holds.
///
/// [`BlockDevice::map_status`]: ironsan_backend::BlockDevice::map_status
pub(crate) async fn get_lba_status(lu: &LogicalUnit, cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    let lba = cdb.u64(2);
    let alloc = cdb.u32(10) as usize;
    if lba >= lu.capacity_blocks() {
        return Err(SenseReason::LbaOutOfRange);
    }
    let bs = u64::from(lu.block_size());
    let span = (lu.capacity_blocks() - lba).min(LBA_STATUS_SPAN_BYTES / bs);
    // The map is read like data: not before an orphaned UNMAP or write of it has finished.
    lu.writes.settled(lba, lba + span).await;
    let map = lu
        .backend()
        .map_status(lba * bs, span * bs)
        .await
        .map_err(backend_err(lu))?;
    let max_desc = (alloc.saturating_sub(8) / 16).max(1);
    // Extents in blocks: a block partly mapped counts as mapped.
    let mut descs: Vec<(u64, u64, bool)> = Vec::new();
    for (off, len, mapped) in map {
        let first = off / bs;
        let end = (off + len).div_ceil(bs);
        match descs.last_mut() {
            Some(last) if last.2 == mapped && last.0 + last.1 >= first => {
                last.1 = end.max(last.0 + last.1) - last.0;
            }
            Some(last) if last.0 + last.1 > first => {
                // Overlapping block of differing state: it stays with the mapped side.
                if mapped {
                    last.1 = first - last.0;
                    descs.push((first, end - first, mapped));
                } else if end > last.0 + last.1 {
                    let s = last.0 + last.1;
                    descs.push((s, end - s, mapped));
                }
            }
            _ => descs.push((first, end - first, mapped)),
        }
    }
    descs.retain(|d| d.1 > 0);
    if descs.is_empty() {
        descs.push((lba, span, true));
    }
    let mut d = Vec::with_capacity(8 + 16 * descs.len().min(max_desc));
    d.extend_from_slice(&[0; 8]);
    for &(start, mut n, mapped) in descs.iter().take(max_desc) {
        n = n.min(u64::from(u32::MAX));
        d.extend_from_slice(&start.to_be_bytes());
        d.extend_from_slice(&(n as u32).to_be_bytes());
        d.push(u8::from(!mapped)); // PROVISIONING STATUS: 0 mapped, 1 deallocated
        d.extend_from_slice(&[0; 3]);
    }
    let len = (d.len() - 4) as u32;
    d[0..4].copy_from_slice(&len.to_be_bytes()); // PARAMETER DATA LENGTH
    Ok(truncate(d, alloc))
}

fn max_write_same_blocks(lu: &LogicalUnit) -> u64 {
    MAX_WRITE_SAME_BYTES / u64::from(lu.block_size())
}

fn max_unmap_blocks(lu: &LogicalUnit) -> u64 {
    // libiscsi's BlockLimits test expects MAXIMUM UNMAP LBA COUNT <= 1 Mi blocks.
    (MAX_UNMAP_BYTES / u64::from(lu.block_size())).min(1 << 20)
}

/// OPTIMAL TRANSFER LENGTH GRANULARITY and OPTIMAL UNMAP GRANULARITY: the physical block,
/// and at least 4 KiB (the page size every backend works in).
fn optimal_granularity(lu: &LogicalUnit) -> u32 {
    (lu.physical_block_size().max(4096) / lu.block_size()).max(1)
}

/// Block Limits VPD page (B0h, SBC-3), page length 3Ch.
pub(crate) fn block_limits_vpd(lu: &LogicalUnit) -> Vec<u8> {
    let mut p = vec![0u8; 0x3C];
    // Offsets below are page offsets minus the 4-byte header.
    p[0] = 0x01; // WSNZ: WRITE SAME with NUMBER OF LOGICAL BLOCKS 0 is not supported
    p[1] = max_compare_and_write_blocks(lu);
    let gran = u16::try_from(optimal_granularity(lu)).unwrap_or(u16::MAX);
    p[2..4].copy_from_slice(&gran.to_be_bytes());
    p[4..8].copy_from_slice(&lu.max_transfer_blocks().to_be_bytes());
    let opt = (1u32 << 20) / lu.block_size();
    p[8..12].copy_from_slice(&opt.max(1).to_be_bytes()); // OPTIMAL TRANSFER LENGTH: 1 MiB
    if unmap_supported(lu) {
        let max_unmap = u32::try_from(max_unmap_blocks(lu)).unwrap_or(u32::MAX);
        p[16..20].copy_from_slice(&max_unmap.to_be_bytes());
        p[20..24].copy_from_slice(&(MAX_UNMAP_DESCRIPTORS as u32).to_be_bytes());
        p[24..28].copy_from_slice(&optimal_granularity(lu).to_be_bytes());
    }
    p[32..40].copy_from_slice(&max_write_same_blocks(lu).to_be_bytes());
    // SBC-4 atomic fields (bytes 40..64) stay 0: WRITE ATOMIC is not offered. An atomic write
    // must be all-or-nothing across power loss, which a positional write of more than one
    // sector is not; advertising it would let a database skip its own torn-page protection.
    p
}

/// Block Device Characteristics VPD page (B1h, SBC-3): non-rotating medium; WABEREQ=01b and
/// WACEREQ=01b (reads after a SANITIZE BLOCK/CRYPTOGRAPHIC ERASE succeed, returning zeros).
pub(crate) fn block_characteristics_vpd() -> Vec<u8> {
    let mut p = vec![0u8; 0x3C];
    p[0..2].copy_from_slice(&1u16.to_be_bytes()); // MEDIUM ROTATION RATE: 0001h
    p[3] = 0x40 | 0x10; // WABEREQ=01b, WACEREQ=01b
    p
}

/// Logical Block Provisioning VPD page (B2h, SBC-3): thin provisioned with UNMAP,
/// WRITE SAME(16) and WRITE SAME(10) unmapping, LBPRZ, when the backend can unmap.
pub(crate) fn provisioning_vpd(lu: &LogicalUnit) -> Vec<u8> {
    let mut p = vec![0u8; 4];
    if unmap_supported(lu) {
        p[1] = 0x80 | 0x40 | 0x20 | 0x04; // LBPU, LBPWS, LBPWS10, LBPRZ
        p[2] = 0x02; // PROVISIONING TYPE: thin
    }
    p
}

/// Write `pattern` (one block) over `blocks` blocks at `lba`, in chunks of at most
/// [`WRITE_SAME_CHUNK`], each chunk keeping `guard` (the caller's range lock) until its I/O
/// is done.
async fn write_repeated(
    lu: &LogicalUnit,
    lba: u64,
    blocks: u64,
    pattern: &[u8],
    mode: WriteMode,
    guard: &Arc<RangeGuard>,
) -> Result<(), SenseReason> {
    let bs = u64::from(lu.block_size());
    let per_chunk = (WRITE_SAME_CHUNK as u64 / bs).max(1);
    let mut buf = BytesMut::with_capacity((per_chunk.min(blocks) * bs) as usize);
    for _ in 0..per_chunk.min(blocks) {
        buf.extend_from_slice(pattern);
    }
    let buf = buf.freeze();
    let mut done = 0u64;
    while done < blocks {
        let n = per_chunk.min(blocks - done);
        let data = buf.slice(..(n * bs) as usize);
        guard
            .keep_shared()
            .run(|k| lu.backend().write_keeping((lba + done) * bs, data, mode, k))
            .await
            .map_err(backend_err(lu))?;
        done += n;
    }
    Ok(())
}

/// SBC-3 WRITE SAME (10) / WRITE SAME (16), with UNMAP and SBC-4's NDOB.
/// UNMAP=1 deallocates when the backend can and the block is all zeros (LBPRZ: deallocated
/// blocks read as zeros, so the result is the same); otherwise the block is written.
/// NUMBER OF LOGICAL BLOCKS 0 is refused with INVALID FIELD IN CDB (WSNZ=1): "to the last
/// LBA" would make one command write up to MAXIMUM WRITE SAME LENGTH, and libiscsi 1.19's
/// WriteSame10.UnmapUntilEnd then expects UNMAP=1 with a non-zero pattern to read back zeros,
/// which contradicts the rule below. The LBA is checked first, so an LBA past the end is LBA
/// OUT OF RANGE even with a count of 0. A count above MAXIMUM WRITE SAME LENGTH (MAXIMUM UNMAP
/// LBA COUNT with UNMAP=1) is INVALID FIELD IN CDB. The Data-Out buffer must
/// be exactly one logical block (none with NDOB): any other size means the initiator and we
/// disagree on the block size, and writing a guessed pattern over a range is refused
/// (INVALID FIELD IN CDB at the length field).
pub(crate) async fn write_same(
    lu: &LogicalUnit,
    cdb: Cdb<'_>,
    data_out: &Bytes,
) -> Result<Bytes, SenseReason> {
    check_no_protection(cdb)?;
    let b1 = cdb.u8(1);
    if b1 & 0x10 != 0 {
        return Err(SenseReason::cdb_bit(1, 4)); // ANCHOR: anchored LBAs not supported
    }
    if b1 & 0x06 != 0 {
        return Err(SenseReason::cdb_bit(1, 2)); // PBDATA/LBDATA (obsolete)
    }
    let ten = cdb.op() == WRITE_SAME_10;
    if ten && b1 & 0x01 != 0 {
        return Err(SenseReason::cdb_bit(1, 0)); // obsolete in WRITE SAME(10)
    }
    let unmap = b1 & 0x08 != 0;
    let ndob = !ten && b1 & 0x01 != 0;
    check_writable(lu)?;
    let r = block_range(cdb);
    let limit = if unmap {
        max_unmap_blocks(lu)
    } else {
        max_write_same_blocks(lu)
    };
    let blocks = u64::from(r.blocks);
    if blocks == 0 {
        check_range(lu, r.lba, 0)?;
        return Err(SenseReason::cdb_byte(r.len_byte));
    }
    if blocks > limit {
        return Err(SenseReason::cdb_byte(r.len_byte));
    }
    check_range(lu, r.lba, blocks)?;
    let bs = lu.block_size() as usize;
    let zeros;
    let pattern: &[u8] = if ndob {
        if !data_out.is_empty() {
            return Err(SenseReason::cdb_byte(r.len_byte));
        }
        zeros = vec![0u8; bs];
        &zeros
    } else {
        if data_out.len() != bs {
            return Err(SenseReason::cdb_byte(r.len_byte));
        }
        &data_out[..bs]
    };
    let g = Arc::new(lu.writes.lock(r.lba, r.lba + blocks).await);
    if unmap && unmap_supported(lu) && pattern.iter().all(|&b| b == 0) {
        g.keep_shared()
            .run(|k| {
                lu.backend()
                    .unmap_keeping(bytes_of(lu, r.lba), bytes_of(lu, blocks), k)
            })
            .await
            .map_err(backend_err(lu))?;
    } else if pattern.iter().all(|&b| b == 0) && lu.backend().capabilities().write_zeroes {
        g.keep_shared()
            .run(|k| {
                lu.backend().write_zeroes_keeping(
                    bytes_of(lu, r.lba),
                    bytes_of(lu, blocks),
                    write_mode(lu, false),
                    k,
                )
            })
            .await
            .map_err(backend_err(lu))?;
    } else {
        write_repeated(lu, r.lba, blocks, pattern, write_mode(lu, false), &g).await?;
    }
    Ok(Bytes::new())
}

/// SBC-3 UNMAP. Only offered when the backend can unmap (LBPU=1); otherwise the
/// operation code is reported invalid, as SBC-3 requires when LBPU=0. All descriptors are
/// validated (count, total, ranges) before any is applied.
pub(crate) async fn unmap(
    lu: &LogicalUnit,
    cdb: Cdb<'_>,
    data_out: &Bytes,
) -> Result<Bytes, SenseReason> {
    if !unmap_supported(lu) {
        return Err(SenseReason::InvalidOpcode);
    }
    if cdb.bit(1, 0) {
        return Err(SenseReason::cdb_bit(1, 0)); // ANCHOR
    }
    check_writable(lu)?;
    let len = usize::from(cdb.u16(7));
    if len == 0 {
        return Ok(Bytes::new());
    }
    if len < 8 || data_out.len() < len {
        return Err(SenseReason::ParameterListLengthError);
    }
    let p = &data_out[..len];
    let be = |i: usize, n: usize| crate::cdb::Cdb(p).be(i, n);
    // UNMAP BLOCK DESCRIPTOR DATA LENGTH, bounded by what was actually sent.
    let bd_len = (be(2, 2) as usize).min(len - 8);
    let count = bd_len / 16;
    if count > MAX_UNMAP_DESCRIPTORS {
        return Err(SenseReason::param(2, None));
    }
    let mut total = 0u64;
    let mut ranges = Vec::with_capacity(count);
    for i in 0..count {
        let off = 8 + 16 * i;
        let lba = be(off, 8);
        let n = be(off + 8, 4);
        check_range(lu, lba, n)?;
        total += n;
        if total > max_unmap_blocks(lu) {
            return Err(SenseReason::param(off + 8, None));
        }
        if n > 0 {
            ranges.push((lba, n));
        }
    }
    for (lba, n) in ranges {
        let g = lu.writes.lock(lba, lba + n).await;
        g.keep()
            .run(|k| {
                lu.backend()
                    .unmap_keeping(bytes_of(lu, lba), bytes_of(lu, n), k)
            })
            .await
            .map_err(backend_err(lu))?;
    }
    Ok(Bytes::new())
}

/// SBC-3 COMPARE AND WRITE: atomic against every other writer of the range (they all
/// take the LU's write range lock). The Data-Out buffer is the verify data followed by the
/// write data; a miscompare reports the offset of the first differing byte.
/// The longest COMPARE AND WRITE (in blocks): [`MAX_COMPARE_AND_WRITE_BLOCKS`], or for a
/// shared LU what the backing store compares and writes atomically in one block (0: none).
fn max_compare_and_write_blocks(lu: &LogicalUnit) -> u8 {
    if !lu.config().shared {
        return MAX_COMPARE_AND_WRITE_BLOCKS;
    }
    let bs = lu.config().block_size as usize;
    u8::from(lu.backend().can_compare_and_write(0, bs))
}

pub(crate) async fn compare_and_write(
    lu: &LogicalUnit,
    cdb: Cdb<'_>,
    data_out: &Bytes,
) -> Result<Bytes, SenseReason> {
    check_no_protection(cdb)?;
    check_writable(lu)?;
    let r = block_range(cdb);
    if r.blocks > u32::from(max_compare_and_write_blocks(lu)) {
        return Err(SenseReason::cdb_byte(r.len_byte));
    }
    check_range(lu, r.lba, u64::from(r.blocks))?;
    if r.blocks == 0 {
        // NUMBER OF LOGICAL BLOCKS 0 transfers nothing; an initiator that sends data anyway
        // (e.g. a 256-block request whose count wrapped to 0 in the one-byte field) gets
        // INVALID FIELD IN CDB rather than a silent no-op, as LIO does.
        if !data_out.is_empty() {
            return Err(SenseReason::cdb_byte(r.len_byte));
        }
        return Ok(Bytes::new());
    }
    let len = bytes_of(lu, u64::from(r.blocks)) as usize;
    // The buffer is verify data then write data, split by the CDB's count: with any other
    // size the halves would be guessed, so both too little and too much are refused.
    if data_out.len() != 2 * len {
        return Err(SenseReason::cdb_byte(r.len_byte));
    }
    let fua = cdb.bit(1, 3);
    let g = lu.writes.lock(r.lba, r.lba + u64::from(r.blocks)).await;
    let at = bytes_of(lu, r.lba);
    if lu.backend().can_compare_and_write(at, len) {
        // Atomic in the backing store itself, against its other clients too (an RBD image
        // served by several gateways).
        let (verify, data) = (data_out.slice(..len), data_out.slice(len..2 * len));
        let miscompare = g
            .keep()
            .run(|k| {
                lu.backend()
                    .compare_and_write_keeping(at, verify, data, write_mode(lu, fua), k)
            })
            .await
            .map_err(backend_err(lu))?;
        return match miscompare {
            Some(offset) => Err(SenseReason::Miscompare { offset }),
            None => Ok(Bytes::new()),
        };
    }
    if lu.config().shared {
        // Comparing and writing under this process's range lock is not atomic against the
        // other nodes writing the same store.
        return Err(SenseReason::cdb_byte(r.len_byte));
    }
    let current = read_blocks(lu, r.lba, r.blocks).await?;
    if let Some(offset) = first_difference(&current, &data_out[..len]) {
        return Err(SenseReason::Miscompare {
            offset: offset as u64,
        });
    }
    write_blocks(
        lu,
        r.lba,
        data_out.slice(len..2 * len),
        write_mode(lu, fua),
        g.keep(),
    )
    .await?;
    Ok(Bytes::new())
}

/// SBC-3 ORWRITE (16): read the range, OR the Data-Out buffer into it, write it back, all under
/// the write range lock (atomic against every other writer). ORPROTECT must be 000b.
pub(crate) async fn orwrite(
    lu: &LogicalUnit,
    cdb: Cdb<'_>,
    data_out: &Bytes,
) -> Result<Bytes, SenseReason> {
    let r = writable_range(lu, cdb)?;
    if r.blocks == 0 {
        return Ok(Bytes::new());
    }
    let len = bytes_of(lu, u64::from(r.blocks)) as usize;
    if data_out.len() < len {
        return Err(SenseReason::cdb_byte(r.len_byte));
    }
    let fua = cdb.bit(1, 3);
    let g = lu.writes.lock(r.lba, r.lba + u64::from(r.blocks)).await;
    let current = read_blocks(lu, r.lba, r.blocks).await?;
    let mut merged = BytesMut::from(&current[..]);
    for (m, o) in merged.iter_mut().zip(&data_out[..len]) {
        *m |= *o;
    }
    write_blocks(lu, r.lba, merged.freeze(), write_mode(lu, fua), g.keep()).await?;
    Ok(Bytes::new())
}

/// SBC-3 PRE-FETCH (10) / (16): range checked; nothing to stage (RAM is memory, files use the
/// page cache on demand), so the blocks are "in cache" as far as the initiator can tell and
/// the answer is CONDITION MET (SBC-3: the cache has room for all the blocks). Returns
/// whether CONDITION MET applies (always, for a valid range).
pub(crate) fn pre_fetch(lu: &LogicalUnit, cdb: Cdb<'_>) -> Result<bool, SenseReason> {
    let r = block_range(cdb);
    let blocks = if cdb.op() == PRE_FETCH_10 {
        u64::from(cdb.u16(7))
    } else {
        u64::from(cdb.u32(10))
    };
    check_range(lu, r.lba, blocks)?;
    Ok(true)
}

/// SBC-3 READ DEFECT DATA (10) / (12): an empty list in the requested format (we have no
/// defects). PLISTV/GLISTV echo what was asked for.
pub(crate) fn read_defect_data(cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    let mut d = Vec::new();
    if cdb.op() == READ_DEFECT_DATA_10 {
        let b2 = cdb.u8(2);
        d.extend_from_slice(&[0, b2 & 0x1F, 0, 0]);
        Ok(truncate(d, usize::from(cdb.u16(7))))
    } else {
        let b1 = cdb.u8(1);
        d.extend_from_slice(&[0, b1 & 0x1F, 0, 0, 0, 0, 0, 0]);
        Ok(truncate(d, cdb.u32(6) as usize))
    }
}

/// SBC-3 SANITIZE: BLOCK ERASE and CRYPTOGRAPHIC ERASE deallocate the whole medium (unmap,
/// so it reads back as zeros and GET LBA STATUS reports it deallocated; without unmap support
/// zeros are written), EXIT FAILURE MODE is GOOD (a sanitize never fails half way here).
/// OVERWRITE is not offered (the test suites expect it only of rotating media, and it would
/// have to run in the background for minutes). The parameter list length must be 0; the
/// operation completes before status (IMMED is accepted and changes nothing).
pub(crate) async fn sanitize(lu: &LogicalUnit, cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    let sa = cdb.u8(1) & 0x1F;
    match sa {
        SA_SANITIZE_BLOCK_ERASE | SA_SANITIZE_CRYPTO_ERASE | SA_SANITIZE_EXIT_FAILURE_MODE => {}
        _ => return Err(SenseReason::cdb_bit(1, 4)),
    }
    if cdb.bit(1, 6) {
        return Err(SenseReason::cdb_bit(1, 6)); // reserved
    }
    if let Some(i) = (2..=6).find(|&i| cdb.u8(i) != 0) {
        return Err(SenseReason::cdb_byte(i as u16)); // reserved
    }
    if cdb.u16(7) != 0 {
        return Err(SenseReason::cdb_byte(7));
    }
    check_writable(lu)?;
    if sa == SA_SANITIZE_EXIT_FAILURE_MODE {
        return Ok(Bytes::new());
    }
    let cap = lu.capacity_blocks();
    let g = Arc::new(lu.writes.lock(0, cap).await);
    let bs = u64::from(lu.block_size());
    let step = (1u64 << 30) / bs;
    let mut lba = 0;
    while lba < cap {
        let n = step.min(cap - lba);
        if unmap_supported(lu) {
            g.keep_shared()
                .run(|k| lu.backend().unmap_keeping(lba * bs, n * bs, k))
                .await
                .map_err(backend_err(lu))?;
        } else {
            let zeros = vec![0u8; bs as usize];
            write_repeated(lu, lba, n, &zeros, WriteMode::Cached, &g).await?;
        }
        lba += n;
    }
    lu.backend().flush().await.map_err(backend_err(lu))?;
    Ok(Bytes::new())
}
