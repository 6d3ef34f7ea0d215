//! SPC-4 third-party copy, LID1 flavour: EXTENDED COPY (LID1) (83h/00h), RECEIVE COPY RESULTS
//! (84h) with COPY STATUS (00h) and OPERATING PARAMETERS (03h), and the Third-party Copy VPD
//! page (8Fh).
//!
//! The addressed LU is the copy manager; the copy targets (CSCDs) are LUs **of the same
//! [`Target`]**, named by identification descriptor CSCD descriptors (E4h) carrying the LU's
//! NAA designator from VPD 83h. Only the block → block segment descriptor (02h) is offered.
//! That is why EXTENDED COPY is executed with the `Target` in hand: it spans LUs.
//!
//! Processing order: parameter list (lengths, limits, descriptor types) → every segment is
//! resolved and checked (descriptor indexes, LUs, ranges, write protection, reservations)
//! **before any data moves** → segments run in order, data moved through the backends in
//! chunks of [`COPY_CHUNK`] bytes, each written under the destination's write range lock with
//! the destination's WCE (WCE=0: durable before GOOD, like a WRITE).
//!
//! Sense data (SPC-4 EXTENDED COPY, and what libiscsi's ExtendedCopy suite expects):
//! * header/lists longer than the parameter list, or descriptor lists longer than MAXIMUM
//!   DESCRIPTOR LIST LENGTH: ILLEGAL REQUEST / PARAMETER LIST LENGTH ERROR;
//! * more CSCD or segment descriptors than offered: TOO MANY TARGET / SEGMENT DESCRIPTORS;
//! * a CSCD type other than E4h, a segment type other than 02h: UNSUPPORTED TARGET / SEGMENT
//!   DESCRIPTOR TYPE CODE;
//! * malformed fields: INVALID FIELD IN PARAMETER LIST with a field pointer;
//! * a segment naming a descriptor index that does not exist, or a NUL (null device) CSCD:
//!   COPY ABORTED / UNREACHABLE COPY TARGET (08h/04h); an identification this target has no
//!   LU for: COPY ABORTED / COPY TARGET DEVICE NOT REACHABLE (0Dh/02h); a range outside a
//!   copy target: COPY ABORTED / 00h/00h; a medium error while copying: COPY ABORTED with the
//!   medium error's ASC. COMMAND-SPECIFIC INFORMATION holds the segment number;
//! * destination write protected: DATA PROTECT / WRITE PROTECTED; a reservation of another
//!   I_T nexus on the source (read) or destination (write): RESERVATION CONFLICT status.
//! * PARAMETER LIST LENGTH 0: GOOD, nothing done (SPC-4).
//!
//! Copy status is kept per (I_T nexus, LIST IDENTIFIER) for LIST ID USAGE 00b/01b, reported
//! once by RECEIVE COPY RESULTS / COPY STATUS, dropped on I_T nexus loss; a list identifier in
//! use by a running copy is refused with OPERATION IN PROGRESS.

use crate::cdb::{opcode::*, Cdb};
use crate::lu::lock;
use crate::pr::{PortPair, PrAccess};
use crate::sense::SenseReason;
use crate::spc::truncate;
use crate::{LogicalUnit, Nexus, Target};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// MAXIMUM CSCD DESCRIPTOR COUNT.
pub(crate) const MAX_CSCD_DESCRIPTORS: usize = 8;
/// MAXIMUM SEGMENT DESCRIPTOR COUNT.
pub(crate) const MAX_SEGMENT_DESCRIPTORS: usize = 32;
/// MAXIMUM DESCRIPTOR LIST LENGTH (CSCD + segment descriptor lists, without the header): room
/// for the maximum number of each.
pub(crate) const MAX_DESCRIPTOR_LIST_LENGTH: usize =
    MAX_CSCD_DESCRIPTORS * CSCD_LEN + MAX_SEGMENT_DESCRIPTORS * B2B_LEN;
/// MAXIMUM SEGMENT LENGTH in bytes (one segment moves at most this much).
pub(crate) const MAX_SEGMENT_BYTES: u64 = 64 << 20;
/// TOTAL CONCURRENT COPIES per copy manager (LU); more at once get BUSY.
pub(crate) const MAX_CONCURRENT_COPIES: usize = 16;
/// Bytes moved per backend read/write pair.
pub(crate) const COPY_CHUNK: u64 = 1 << 20;
/// Completed copy statuses kept per I_T nexus (oldest dropped first).
const MAX_RESULTS_PER_NEXUS: usize = 16;

const HEADER_LEN: usize = 16;
const CSCD_LEN: usize = 32;
const B2B_LEN: usize = 28;
/// Identification descriptor CSCD descriptor type code.
const CSCD_IDENTIFICATION: u8 = 0xE4;
/// Block device to block device segment descriptor type code.
const SEG_BLOCK_TO_BLOCK: u8 = 0x02;

/// COPY MANAGER STATUS values (SPC-4 COPY STATUS parameter data).
const STATUS_IN_PROGRESS: u8 = 0x00;
const STATUS_GOOD: u8 = 0x01;
const STATUS_ERROR: u8 = 0x02;

/// What the dispatcher turns into a status.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Good,
    ReservationConflict,
    Busy,
}

#[derive(Clone, Copy, Debug)]
struct CopyRecord {
    status: u8,
    segments: u16,
    bytes: u64,
    /// Kept for COPY STATUS after completion (LIST ID USAGE 00b/01b).
    retain: bool,
    seq: u64,
}

/// Copy status records of one copy manager, by (I_T nexus id, LIST IDENTIFIER).
#[derive(Default, Debug)]
pub(crate) struct CopyResults {
    map: HashMap<(u64, u8), CopyRecord>,
    seq: u64,
}

impl CopyResults {
    /// Start a copy with a list identifier; `false` if one with the same id is running.
    fn begin(&mut self, nexus: u64, id: u8, retain: bool) -> bool {
        if self
            .map
            .get(&(nexus, id))
            .is_some_and(|r| r.status == STATUS_IN_PROGRESS)
        {
            return false;
        }
        self.seq += 1;
        self.map.insert(
            (nexus, id),
            CopyRecord {
                status: STATUS_IN_PROGRESS,
                segments: 0,
                bytes: 0,
                retain,
                seq: self.seq,
            },
        );
        true
    }

    fn progress(&mut self, nexus: u64, id: u8, segments: u16, bytes: u64) {
        if let Some(r) = self.map.get_mut(&(nexus, id)) {
            r.segments = segments;
            r.bytes = bytes;
        }
    }

    fn finish(&mut self, nexus: u64, id: u8, ok: bool) {
        let Some(r) = self.map.get_mut(&(nexus, id)) else {
            return;
        };
        if !r.retain {
            self.map.remove(&(nexus, id));
            return;
        }
        r.status = if ok { STATUS_GOOD } else { STATUS_ERROR };
        // Bound what one nexus can make us keep: drop its oldest completed records.
        let mut done: Vec<(u64, u8)> = self
            .map
            .iter()
            .filter(|((n, _), r)| *n == nexus && r.status != STATUS_IN_PROGRESS)
            .map(|(k, r)| (r.seq, k.1))
            .collect();
        if done.len() > MAX_RESULTS_PER_NEXUS {
            done.sort_unstable();
            for (_, old) in &done[..done.len() - MAX_RESULTS_PER_NEXUS] {
                self.map.remove(&(nexus, *old));
            }
        }
    }

    /// The status for COPY STATUS; a completed record is reported once.
    fn report(&mut self, nexus: u64, id: u8) -> Option<CopyRecord> {
        let r = *self.map.get(&(nexus, id))?;
        if r.status != STATUS_IN_PROGRESS {
            self.map.remove(&(nexus, id));
        }
        Some(r)
    }

    pub(crate) fn forget_nexus(&mut self, nexus: u64) {
        self.map.retain(|(n, _), _| *n != nexus);
    }
}

#[cfg(test)]
impl CopyResults {
    pub(crate) fn begin_for_test(&mut self, nexus: u64, id: u8) -> bool {
        self.begin(nexus, id, true)
    }
    pub(crate) fn finish_for_test(&mut self, nexus: u64, id: u8) {
        self.finish(nexus, id, true);
    }
    pub(crate) fn len_for_test(&self, nexus: u64) -> usize {
        self.map.keys().filter(|(n, _)| *n == nexus).count()
    }
}

/// One parsed identification CSCD descriptor.
#[derive(Clone, Copy, Debug)]
struct Cscd {
    /// Byte offset in the parameter list (for field pointers).
    at: usize,
    nul: bool,
    /// The 8-byte NAA designator, if the descriptor carries one for a logical unit.
    naa: Option<u64>,
    /// DISK BLOCK LENGTH (0: not given).
    block_len: u32,
}

/// One parsed block → block segment descriptor.
#[derive(Clone, Copy, Debug)]
struct Segment {
    at: usize,
    dc: bool,
    src: u16,
    dst: u16,
    blocks: u16,
    src_lba: u64,
    dst_lba: u64,
}

/// The validated parameter list.
#[derive(Debug)]
struct ParamList {
    list_id: u8,
    usage: u8,
    cscds: Vec<Cscd>,
    segments: Vec<Segment>,
}

/// Big-endian field of `n` bytes at `i` (0 past the end), as in a CDB.
fn be(p: &[u8], i: usize, n: usize) -> u64 {
    crate::cdb::Cdb(p).be(i, n)
}

/// Parse and check the EXTENDED COPY (LID1) parameter list (everything that does not need
/// the LUs).
fn parse(p: &[u8]) -> Result<ParamList, SenseReason> {
    if p.len() < HEADER_LEN {
        return Err(SenseReason::ParameterListLengthError);
    }
    let list_id = p[0];
    let usage = (p[1] >> 3) & 0x03;
    if usage == 0b11 && list_id != 0 {
        // LIST ID USAGE 11b: no list identifier, so the field must be zero.
        return Err(SenseReason::param(0, None));
    }
    let cscd_len = be(p, 2, 2) as usize;
    let seg_len = be(p, 8, 4) as usize;
    let inline_len = be(p, 12, 4) as usize;
    if HEADER_LEN + cscd_len + seg_len + inline_len > p.len() {
        return Err(SenseReason::ParameterListLengthError);
    }
    if cscd_len + seg_len > MAX_DESCRIPTOR_LIST_LENGTH {
        return Err(SenseReason::ParameterListLengthError);
    }
    if inline_len != 0 {
        // MAXIMUM INLINE DATA LENGTH is 0: no segment type we offer uses inline data.
        return Err(SenseReason::param(12, None));
    }
    if cscd_len / CSCD_LEN > MAX_CSCD_DESCRIPTORS {
        return Err(SenseReason::TooManyTargetDescriptors);
    }
    if !cscd_len.is_multiple_of(CSCD_LEN) {
        return Err(SenseReason::param(2, None));
    }
    let mut cscds = Vec::with_capacity(cscd_len / CSCD_LEN);
    for at in (HEADER_LEN..HEADER_LEN + cscd_len).step_by(CSCD_LEN) {
        cscds.push(parse_cscd(p, at)?);
    }
    let mut segments = Vec::new();
    let end = HEADER_LEN + cscd_len + seg_len;
    let mut at = HEADER_LEN + cscd_len;
    while at < end {
        if segments.len() == MAX_SEGMENT_DESCRIPTORS {
            return Err(SenseReason::TooManySegmentDescriptors);
        }
        if p[at] != SEG_BLOCK_TO_BLOCK {
            return Err(SenseReason::UnsupportedSegmentDescriptorType);
        }
        if at + 4 > end {
            return Err(SenseReason::ParameterListLengthError);
        }
        let dlen = be(p, at + 2, 2) as usize;
        if dlen != B2B_LEN - 4 {
            return Err(SenseReason::param(at + 2, None));
        }
        if at + B2B_LEN > end {
            return Err(SenseReason::ParameterListLengthError);
        }
        segments.push(Segment {
            at,
            dc: p[at + 1] & 0x02 != 0,
            src: be(p, at + 4, 2) as u16,
            dst: be(p, at + 6, 2) as u16,
            blocks: be(p, at + 10, 2) as u16,
            src_lba: be(p, at + 12, 8),
            dst_lba: be(p, at + 20, 8),
        });
        at += B2B_LEN;
    }
    Ok(ParamList {
        list_id,
        usage,
        cscds,
        segments,
    })
}

/// One identification descriptor (E4h). LU ID TYPE is not looked at (SPC-4 leaves the LU to
/// the designator); the PERIPHERAL DEVICE TYPE must be 00h (block) for a block → block copy.
fn parse_cscd(p: &[u8], at: usize) -> Result<Cscd, SenseReason> {
    let d = &p[at..at + CSCD_LEN];
    if d[0] != CSCD_IDENTIFICATION {
        return Err(SenseReason::UnsupportedTargetDescriptorType);
    }
    let nul = d[1] & 0x20 != 0;
    if d[1] & 0x1F != 0 {
        return Err(SenseReason::param(at + 1, Some(4))); // PERIPHERAL DEVICE TYPE
    }
    // Designation descriptor at 4..24: CODE SET (byte 4), ASSOCIATION/TYPE (byte 5),
    // DESIGNATOR LENGTH (byte 7), DESIGNATOR (8..).
    let assoc = (d[5] >> 4) & 0x03;
    let dtype = d[5] & 0x0F;
    let dlen = usize::from(d[7]);
    if dlen > 20 {
        return Err(SenseReason::param(at + 7, None));
    }
    let naa = (dtype == 0x3 && assoc == 0 && dlen == 8).then(|| be(d, 8, 8));
    Ok(Cscd {
        at,
        nul,
        naa,
        block_len: be(d, 29, 3) as u32,
    })
}

/// A segment with its LUs resolved and byte ranges computed.
struct Planned {
    index: u32,
    src: Arc<LogicalUnit>,
    dst: Arc<LogicalUnit>,
    src_off: u64,
    dst_off: u64,
    bytes: u64,
}

fn aborted(segment: u32, asc: u8, ascq: u8) -> SenseReason {
    SenseReason::CopyAborted { segment, asc, ascq }
}

fn resolve(
    t: &Target,
    list: &ParamList,
    idx: u16,
    seg: u32,
) -> Result<Arc<LogicalUnit>, SenseReason> {
    let Some(c) = list.cscds.get(usize::from(idx)) else {
        return Err(aborted(seg, 0x08, 0x04)); // UNREACHABLE COPY TARGET
    };
    if c.nul {
        return Err(aborted(seg, 0x08, 0x04));
    }
    let lu = c
        .naa
        .and_then(|naa| {
            t.luns()
                .map(|(_, lu)| lu)
                .find(|lu| crate::spc::naa(lu) == naa)
        })
        .ok_or(aborted(seg, 0x0D, 0x02))?; // COPY TARGET DEVICE NOT REACHABLE
    if c.block_len != 0 && c.block_len != lu.block_size() {
        return Err(SenseReason::param(c.at + 29, None));
    }
    Ok(Arc::clone(lu))
}

fn plan(t: &Target, list: &ParamList) -> Result<Vec<Planned>, SenseReason> {
    let mut out = Vec::with_capacity(list.segments.len());
    for (i, s) in list.segments.iter().enumerate() {
        let index = i as u32;
        let src = resolve(t, list, s.src, index)?;
        let dst = resolve(t, list, s.dst, index)?;
        let (sbs, dbs) = (u64::from(src.block_size()), u64::from(dst.block_size()));
        // DC=0: NUMBER OF BLOCKS counts source blocks; DC=1 destination blocks.
        let bytes = u64::from(s.blocks) * if s.dc { dbs } else { sbs };
        if !bytes.is_multiple_of(sbs) || !bytes.is_multiple_of(dbs) {
            return Err(SenseReason::param(s.at + 10, None));
        }
        if bytes > MAX_SEGMENT_BYTES {
            return Err(SenseReason::param(s.at + 10, None));
        }
        if !src.in_range(s.src_lba, bytes / sbs) || !dst.in_range(s.dst_lba, bytes / dbs) {
            return Err(aborted(index, 0x00, 0x00));
        }
        out.push(Planned {
            index,
            src_off: s.src_lba * sbs,
            dst_off: s.dst_lba * dbs,
            src,
            dst,
            bytes,
        });
    }
    Ok(out)
}

/// Another I_T nexus's SPC-2 or persistent reservation conflicts with `access` on `lu`.
fn reservation_conflict(lu: &LogicalUnit, nexus: &Nexus, access: PrAccess) -> bool {
    if lock(&lu.reservation).is_some_and(|holder| holder != nexus.id) {
        return true;
    }
    lock(&lu.pr).conflicts(&PortPair::of(nexus), access)
}

/// EXTENDED COPY (LID1), executed by the copy manager `lu` of target `t`.
pub(crate) async fn extended_copy(
    t: &Target,
    lu: &LogicalUnit,
    nexus: &Nexus,
    cdb: Cdb<'_>,
    data_out: &Bytes,
) -> Result<Outcome, SenseReason> {
    if cdb.u8(1) & 0x1F != SA_EXTENDED_COPY_LID1 {
        return Err(SenseReason::cdb_bit(1, 4)); // LID4 (01h) and others: not offered
    }
    let len = cdb.u32(10) as usize;
    if len == 0 {
        return Ok(Outcome::Good); // SPC-4: not an error, nothing is copied
    }
    if data_out.len() < len {
        return Err(SenseReason::ParameterListLengthError);
    }
    let list = parse(&data_out[..len])?;
    let segments = plan(t, &list)?;
    for s in &segments {
        if reservation_conflict(&s.src, nexus, PrAccess::Read)
            || reservation_conflict(&s.dst, nexus, PrAccess::Write)
        {
            return Ok(Outcome::ReservationConflict);
        }
        crate::sbc::check_writable(&s.dst)?;
    }

    if lu.copies_running.fetch_add(1, Ordering::AcqRel) >= MAX_CONCURRENT_COPIES {
        lu.copies_running.fetch_sub(1, Ordering::AcqRel);
        return Ok(Outcome::Busy);
    }
    let _running = RunningGuard(lu);
    let tracked = list.usage != 0b11;
    if tracked && !lock(&lu.copies).begin(nexus.id, list.list_id, list.usage <= 0b01) {
        return Err(SenseReason::OperationInProgress);
    }
    let mut moved = 0u64;
    let mut result = Ok(());
    for (done, s) in segments.iter().enumerate() {
        if let Err(e) = copy_segment(s, &mut moved).await {
            result = Err(e);
            break;
        }
        if tracked {
            lock(&lu.copies).progress(nexus.id, list.list_id, (done + 1) as u16, moved);
        }
    }
    if tracked {
        lock(&lu.copies).finish(nexus.id, list.list_id, result.is_ok());
    }
    result.map(|()| Outcome::Good)
}

struct RunningGuard<'a>(&'a LogicalUnit);

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        self.0.copies_running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Move one segment in [`COPY_CHUNK`] pieces; backwards when source and destination overlap
/// on the same LU with the destination after the source (memmove semantics).
async fn copy_segment(s: &Planned, moved: &mut u64) -> Result<(), SenseReason> {
    let backwards =
        Arc::ptr_eq(&s.src, &s.dst) && s.dst_off > s.src_off && s.dst_off < s.src_off + s.bytes;
    let chunks = s.bytes.div_ceil(COPY_CHUNK);
    let dbs = u64::from(s.dst.block_size());
    let mode = crate::sbc::write_mode(&s.dst, false);
    let medium = |e: ironsan_backend::BackendError, bs: u32| {
        let f = SenseReason::from_backend(&e, bs).sense();
        aborted(s.index, f.asc, f.ascq)
    };
    for k in 0..chunks {
        let k = if backwards { chunks - 1 - k } else { k };
        let off = k * COPY_CHUNK;
        let n = COPY_CHUNK.min(s.bytes - off);
        let dst_lba = (s.dst_off + off) / dbs;
        let g = s.dst.writes.lock(dst_lba, dst_lba + n / dbs).await;
        // Like any read: not before an orphaned write of the source blocks has finished.
        let sbs = u64::from(s.src.block_size());
        let src_lba = (s.src_off + off) / sbs;
        s.src
            .writes
            .settled(src_lba, (s.src_off + off + n).div_ceil(sbs))
            .await;
        let data = s
            .src
            .backend()
            .read(s.src_off + off, n as usize)
            .await
            .map_err(|e| medium(e, s.src.block_size()))?;
        if (data.len() as u64) < n {
            return Err(aborted(s.index, 0x44, 0x00));
        }
        g.keep()
            .run(|k| {
                s.dst
                    .backend()
                    .write_keeping(s.dst_off + off, data.slice(..n as usize), mode, k)
            })
            .await
            .map_err(|e| medium(e, s.dst.block_size()))?;
        *moved += n;
    }
    Ok(())
}

/// RECEIVE COPY RESULTS (LID1): COPY STATUS and OPERATING PARAMETERS; RECEIVE DATA (01h) and
/// FAILED SEGMENT DETAILS (04h) are not offered (no held data, no LID4).
pub(crate) fn receive_copy_results(
    lu: &LogicalUnit,
    nexus: &Nexus,
    cdb: Cdb<'_>,
) -> Result<Bytes, SenseReason> {
    let list_id = cdb.u8(2);
    let alloc = cdb.u32(10) as usize;
    match cdb.u8(1) & 0x1F {
        SA_RCR_COPY_STATUS => {
            let r = lock(&lu.copies)
                .report(nexus.id, list_id)
                .ok_or(SenseReason::cdb_byte(2))?;
            Ok(truncate(copy_status(&r), alloc))
        }
        SA_RCR_OPERATING_PARAMETERS => Ok(truncate(operating_parameters(lu), alloc)),
        _ => Err(SenseReason::cdb_bit(1, 4)),
    }
}

/// COPY STATUS parameter data (12 bytes): TRANSFER COUNT in the smallest binary unit
/// (bytes, KiB, MiB, ...) that fits 32 bits.
fn copy_status(r: &CopyRecord) -> Vec<u8> {
    let mut d = vec![0u8; 12];
    d[0..4].copy_from_slice(&8u32.to_be_bytes()); // AVAILABLE DATA
    d[4] = r.status; // HDD=0
    d[5..7].copy_from_slice(&r.segments.to_be_bytes());
    let (mut units, mut count) = (0u8, r.bytes);
    while count > u64::from(u32::MAX) {
        units += 1;
        count >>= 10;
    }
    d[7] = units;
    d[8..12].copy_from_slice(&(count as u32).to_be_bytes());
    d
}

fn max_segment_bytes_u32() -> u32 {
    u32::try_from(MAX_SEGMENT_BYTES).unwrap_or(u32::MAX)
}

/// OPERATING PARAMETERS parameter data (SPC-4, LID1).
fn operating_parameters(lu: &LogicalUnit) -> Vec<u8> {
    let kinds = [SEG_BLOCK_TO_BLOCK, CSCD_IDENTIFICATION];
    let mut d = vec![0u8; 44];
    d[4] = 0x01; // SNLID: LIST ID USAGE 11b (no list identifier) is supported
    d[8..10].copy_from_slice(&(MAX_CSCD_DESCRIPTORS as u16).to_be_bytes());
    d[10..12].copy_from_slice(&(MAX_SEGMENT_DESCRIPTORS as u16).to_be_bytes());
    d[12..16].copy_from_slice(&(MAX_DESCRIPTOR_LIST_LENGTH as u32).to_be_bytes());
    d[16..20].copy_from_slice(&max_segment_bytes_u32().to_be_bytes());
    // MAXIMUM INLINE DATA LENGTH, HELD DATA LIMIT, MAXIMUM STREAM DEVICE TRANSFER SIZE: 0.
    d[34..36].copy_from_slice(&(MAX_CONCURRENT_COPIES as u16).to_be_bytes());
    d[36] = MAX_CONCURRENT_COPIES as u8; // MAXIMUM CONCURRENT COPIES
    d[37] = lu.block_size().trailing_zeros() as u8; // DATA SEGMENT GRANULARITY (log2)
                                                    // INLINE DATA GRANULARITY, HELD DATA GRANULARITY: 0.
    d[43] = kinds.len() as u8; // IMPLEMENTED DESCRIPTOR LIST LENGTH
    d.extend_from_slice(&kinds);
    let avail = (d.len() - 4) as u32;
    d[0..4].copy_from_slice(&avail.to_be_bytes());
    d
}

/// Append a Third-party Copy descriptor, its body padded to a multiple of 4 bytes.
fn tpc_descriptor(out: &mut Vec<u8>, kind: u16, mut body: Vec<u8>) {
    while !body.len().is_multiple_of(4) {
        body.push(0);
    }
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(body.len() as u16).to_be_bytes());
    out.extend_from_slice(&body);
}

/// Third-party Copy VPD page (8Fh) body: Supported Commands, Parameter Data, Supported
/// Descriptors, Supported CSCD Descriptor IDs (none) and General Copy Operations.
pub(crate) fn third_party_copy_vpd(lu: &LogicalUnit) -> Vec<u8> {
    let mut p = Vec::new();
    // 0001h Supported Commands: EXTENDED COPY (LID1); RECEIVE COPY RESULTS COPY STATUS and
    // OPERATING PARAMETERS.
    let cmds: [(u8, &[u8]); 2] = [
        (EXTENDED_COPY, &[SA_EXTENDED_COPY_LID1]),
        (
            RECEIVE_COPY_RESULTS,
            &[SA_RCR_COPY_STATUS, SA_RCR_OPERATING_PARAMETERS],
        ),
    ];
    let mut list = Vec::new();
    for (op, sas) in cmds {
        list.push(op);
        list.push(sas.len() as u8);
        list.extend_from_slice(sas);
    }
    let mut body = vec![list.len() as u8];
    body.extend_from_slice(&list);
    tpc_descriptor(&mut p, 0x0001, body);
    // 0004h Parameter Data.
    let mut body = vec![0u8; 28];
    body[4..6].copy_from_slice(&(MAX_CSCD_DESCRIPTORS as u16).to_be_bytes());
    body[6..8].copy_from_slice(&(MAX_SEGMENT_DESCRIPTORS as u16).to_be_bytes());
    body[8..12].copy_from_slice(&(MAX_DESCRIPTOR_LIST_LENGTH as u32).to_be_bytes());
    tpc_descriptor(&mut p, 0x0004, body);
    // 0008h Supported Descriptors.
    tpc_descriptor(
        &mut p,
        0x0008,
        vec![2, SEG_BLOCK_TO_BLOCK, CSCD_IDENTIFICATION],
    );
    // 000Ch Supported CSCD Descriptor IDs: none.
    tpc_descriptor(&mut p, 0x000C, vec![0, 0]);
    // 8001h General Copy Operations.
    let mut body = vec![0u8; 32];
    body[0..4].copy_from_slice(&(MAX_CONCURRENT_COPIES as u32).to_be_bytes());
    body[4..8].copy_from_slice(&(MAX_CONCURRENT_COPIES as u32).to_be_bytes());
    body[8..12].copy_from_slice(&max_segment_bytes_u32().to_be_bytes());
    body[12] = lu.block_size().trailing_zeros() as u8; // DATA SEGMENT GRANULARITY (log2)
    tpc_descriptor(&mut p, 0x8001, body);
    p
}
