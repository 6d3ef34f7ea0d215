//! SPC-4 primary commands: INQUIRY and VPD pages, REPORT LUNS, REQUEST SENSE, REPORT SUPPORTED
//! OPERATION CODES, SPC-2 RESERVE/RELEASE, PREVENT ALLOW MEDIUM REMOVAL.

use crate::cdb::{opcode::*, Cdb};
use crate::lu::lock;
use crate::pr::PrAccess;
use crate::sense::SenseReason;
use crate::{LogicalUnit, Nexus, Target, MAX_LUN};
use bytes::Bytes;

/// Truncate `data` to the allocation length (SPC-4 ALLOCATION LENGTH field).
pub(crate) fn truncate(mut data: Vec<u8>, alloc_len: usize) -> Bytes {
    data.truncate(alloc_len);
    Bytes::from(data)
}

// ---------------------------------------------------------------------------------------------
// INQUIRY (SPC-4)
// ---------------------------------------------------------------------------------------------

/// Peripheral device type: direct access block device (SPC-4 standard INQUIRY data).
const PDT_DISK: u8 = 0x00;
/// Peripheral qualifier 011b, device type 1Fh: no logical unit at this LUN.
const PQ_NO_LU: u8 = 0x7F;
/// Length of our standard INQUIRY data (through the version descriptors, SPC-4 table 139).
const STD_INQUIRY_LEN: usize = 96;
/// VPD pages we return, ascending (SPC-4 Supported VPD Pages page).
const VPD_PAGES: [u8; 7] = [0x00, 0x80, 0x83, 0x8F, 0xB0, 0xB1, 0xB2];
/// Cap on the unit serial number we report.
const MAX_SERIAL: usize = 64;

/// Copy `s` into a space-padded ASCII field, replacing anything non-printable (SPC-4 ASCII data field requirements).
fn ascii_field(dst: &mut [u8], s: &str) {
    dst.fill(b' ');
    for (d, c) in dst.iter_mut().zip(s.bytes()) {
        *d = if (0x20..0x7F).contains(&c) { c } else { b' ' };
    }
}

/// Common INQUIRY CDB checks (SPC-4 INQUIRY): CmdDt is obsolete (we refuse it) and a PAGE
/// CODE without EVPD is invalid. Returns (evpd, page, allocation length).
fn inquiry_fields(cdb: Cdb<'_>) -> Result<(bool, u8, usize), SenseReason> {
    if cdb.bit(1, 1) {
        return Err(SenseReason::cdb_bit(1, 1));
    }
    let evpd = cdb.bit(1, 0);
    let page = cdb.u8(2);
    if !evpd && page != 0 {
        return Err(SenseReason::cdb_byte(2));
    }
    Ok((evpd, page, usize::from(cdb.u16(3))))
}

fn standard_inquiry(pq_pdt: u8, vendor: &str, product: &str, revision: &str) -> Vec<u8> {
    let mut d = vec![0u8; STD_INQUIRY_LEN];
    d[0] = pq_pdt;
    d[1] = 0x00; // RMB=0: not removable
    d[2] = 0x06; // VERSION: SPC-4
    d[3] = 0x12; // HISUP=1, RESPONSE DATA FORMAT=2
    d[4] = (STD_INQUIRY_LEN - 5) as u8; // ADDITIONAL LENGTH
                                        // SCCS/ACC/PROTECT zero; for a logical unit TPGS=11b (implicit and explicit ALUA) and
                                        // 3PC=1 (EXTENDED COPY).
    d[5] = if pq_pdt == PDT_DISK { 0x38 } else { 0x00 };
    d[6] = 0x00; // ENCSERV/MULTIP zero
    d[7] = 0x02; // CMDQUE=1
    ascii_field(
        &mut d[8..16],
        if vendor.is_empty() { "IRONSAN" } else { vendor },
    );
    ascii_field(&mut d[16..32], product);
    ascii_field(&mut d[32..36], revision);
    // VERSION DESCRIPTORS (SPC-4 table 144): SAM-5, SPC-4, SBC-3, iSCSI (no version).
    for (i, v) in [0x00A0u16, 0x0460, 0x04C0, 0x0960].iter().enumerate() {
        d[58 + 2 * i..60 + 2 * i].copy_from_slice(&v.to_be_bytes());
    }
    d
}

/// INQUIRY addressed to a LUN without a logical unit: standard data with peripheral qualifier
/// 011b / type 1Fh (SPC-4 standard INQUIRY data); VPD pages are not available there.
pub(crate) fn inquiry_no_lu(cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    let (evpd, _, alloc) = inquiry_fields(cdb)?;
    if evpd {
        return Err(SenseReason::LogicalUnitNotSupported);
    }
    Ok(truncate(standard_inquiry(PQ_NO_LU, "", "", ""), alloc))
}

/// INQUIRY (SPC-4): standard data or one VPD page.
pub(crate) fn inquiry(
    lu: &LogicalUnit,
    alua: &crate::Alua,
    nexus: &Nexus,
    cdb: Cdb<'_>,
) -> Result<Bytes, SenseReason> {
    let (evpd, page, alloc) = inquiry_fields(cdb)?;
    let cfg = lu.config();
    let data = if !evpd {
        standard_inquiry(PDT_DISK, &cfg.vendor, &cfg.product, &cfg.revision)
    } else {
        let body = match page {
            0x00 => VPD_PAGES.to_vec(),
            0x80 => serial(lu).into_bytes(),
            0x83 => device_identification(lu, alua, nexus),
            0x8F => crate::xcopy::third_party_copy_vpd(lu),
            0xB0 => crate::sbc::block_limits_vpd(lu),
            0xB1 => crate::sbc::block_characteristics_vpd(),
            0xB2 => crate::sbc::provisioning_vpd(lu),
            _ => return Err(SenseReason::cdb_byte(2)),
        };
        let mut d = Vec::with_capacity(4 + body.len());
        d.push(PDT_DISK);
        d.push(page);
        d.extend_from_slice(&(body.len() as u16).to_be_bytes()); // PAGE LENGTH
        d.extend_from_slice(&body);
        d
    };
    Ok(truncate(data, alloc))
}

/// Unit serial number (VPD 80h, SPC-4 Unit Serial Number page): printable ASCII, at most [`MAX_SERIAL`] bytes;
/// the NAA in hex when none is configured.
fn serial(lu: &LogicalUnit) -> String {
    let cfg = lu.config();
    let s: String = cfg
        .serial
        .chars()
        .filter(|c| c.is_ascii_graphic() || *c == ' ')
        .take(MAX_SERIAL)
        .collect();
    if s.trim().is_empty() {
        format!("{:016x}", naa(lu))
    } else {
        s
    }
}

/// The NAA designator value: the configured one if its top nibble is an 8-byte NAA format
/// (2h, 3h, 5h), otherwise forced to locally assigned (3h). SPC-4 NAA designator format.
pub(crate) fn naa(lu: &LogicalUnit) -> u64 {
    let v = lu.config().naa;
    match v >> 60 {
        0x2 | 0x3 | 0x5 => v,
        _ => (v & 0x0FFF_FFFF_FFFF_FFFF) | 0x3000_0000_0000_0000,
    }
}

/// Append one designation descriptor (SPC-4 designation descriptor).
fn designator(out: &mut Vec<u8>, proto_codeset: u8, piv_assoc_type: u8, value: &[u8]) {
    out.push(proto_codeset);
    out.push(piv_assoc_type);
    out.push(0);
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}

/// SCSI name string value: UTF-8, NUL terminated, padded with NULs to a multiple of 4 bytes,
/// at most 256 bytes (SPC-4 SCSI name string designator).
fn name_string(name: &str) -> Vec<u8> {
    let mut v: Vec<u8> = name.bytes().filter(|&b| b != 0).take(252).collect();
    v.push(0);
    while !v.len().is_multiple_of(4) {
        v.push(0);
    }
    v
}

/// Device Identification VPD page (83h, SPC-4 Device Identification VPD page).
fn device_identification(lu: &LogicalUnit, alua: &crate::Alua, nexus: &Nexus) -> Vec<u8> {
    const ISCSI: u8 = 0x5 << 4; // PROTOCOL IDENTIFIER iSCSI (SPC-4 table 362)
    const BINARY: u8 = 1;
    const ASCII: u8 = 2;
    const UTF8: u8 = 3;
    const PIV: u8 = 0x80;
    const ASSOC_LU: u8 = 0x00;
    const ASSOC_PORT: u8 = 0x10;
    const ASSOC_DEVICE: u8 = 0x20;
    let mut d = Vec::new();
    // NAA, logical unit.
    designator(&mut d, BINARY, ASSOC_LU | 0x3, &naa(lu).to_be_bytes());
    // T10 vendor ID based, logical unit: vendor + serial.
    let mut t10 = [b' '; 8].to_vec();
    let vendor = &lu.config().vendor;
    ascii_field(&mut t10, if vendor.is_empty() { "IRONSAN" } else { vendor });
    t10.extend_from_slice(serial(lu).as_bytes());
    designator(&mut d, ASCII, ASSOC_LU | 0x1, &t10);
    // Relative target port, target port association.
    let mut rel = [0u8; 4];
    rel[2..4].copy_from_slice(&nexus.relative_port.to_be_bytes());
    designator(&mut d, ISCSI | BINARY, PIV | ASSOC_PORT | 0x4, &rel);
    // Target port group of that port (ALUA; Linux's scsi_dh_alua needs it beside type 4).
    if let Some(tpg) = crate::alua::port_group_designator(alua, nexus) {
        designator(&mut d, ISCSI | BINARY, PIV | ASSOC_PORT | 0x5, &tpg);
    }
    // SCSI name string of the target port, "<iqn>,t,0x<tpgt>" (RFC 7143 iSCSI names).
    designator(
        &mut d,
        ISCSI | UTF8,
        PIV | ASSOC_PORT | 0x8,
        &name_string(&nexus.target_port),
    );
    // SCSI name string of the target device: the iSCSI target name.
    let device = nexus.target_device();
    designator(
        &mut d,
        ISCSI | UTF8,
        PIV | ASSOC_DEVICE | 0x8,
        &name_string(device),
    );
    d
}

// ---------------------------------------------------------------------------------------------
// REPORT LUNS (SPC-4)
// ---------------------------------------------------------------------------------------------

pub(crate) fn report_luns(t: &Target, cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    let select = cdb.u8(2);
    let alloc = cdb.u32(6) as usize;
    // SPC-4: "the allocation length should be at least 16"; shorter is refused, as LIO does.
    if alloc < 16 {
        return Err(SenseReason::cdb_byte(6));
    }
    let list: Vec<u64> = match select {
        // 00h: LUs; 02h: all (we have no well-known LUs); 01h: well-known LUs only (none).
        0x00 | 0x02 => t.luns().map(|(l, _)| l).filter(|&l| l <= MAX_LUN).collect(),
        0x01 => Vec::new(),
        _ => return Err(SenseReason::cdb_byte(2)),
    };
    let mut d = Vec::with_capacity(8 + 8 * list.len().min(alloc / 8 + 1));
    d.extend_from_slice(&((list.len() * 8) as u32).to_be_bytes());
    d.extend_from_slice(&[0; 4]);
    for l in list {
        if d.len() >= alloc {
            break; // LUN LIST LENGTH still counts every LUN
        }
        d.extend_from_slice(&crate::lun_to_wire(l).to_be_bytes());
    }
    Ok(truncate(d, alloc))
}

// ---------------------------------------------------------------------------------------------
// REQUEST SENSE (SPC-4)
// ---------------------------------------------------------------------------------------------

/// Sense data as REQUEST SENSE parameter data; DESC=1 is refused (fixed format only).
pub(crate) fn request_sense_data(cdb: Cdb<'_>, reason: SenseReason) -> Result<Bytes, SenseReason> {
    if cdb.bit(1, 0) {
        return Err(SenseReason::cdb_bit(1, 0));
    }
    let alloc = usize::from(cdb.u8(4));
    Ok(truncate(reason.fixed_sense_array().to_vec(), alloc))
}

/// REQUEST SENSE: report (and clear) the oldest pending unit attention, else NO SENSE.
pub(crate) fn request_sense(
    lu: &LogicalUnit,
    nexus: &Nexus,
    cdb: Cdb<'_>,
) -> Result<Bytes, SenseReason> {
    if cdb.bit(1, 0) {
        return Err(SenseReason::cdb_bit(1, 0));
    }
    let reason = lu
        .take_unit_attention(nexus.id)
        .map_or(SenseReason::NoSense, SenseReason::UnitAttention);
    request_sense_data(cdb, reason)
}

// ---------------------------------------------------------------------------------------------
// RESERVE / RELEASE (SPC-2), PREVENT ALLOW MEDIUM REMOVAL (SPC-4/SBC-3)
// ---------------------------------------------------------------------------------------------

/// Commands another nexus may run while an SPC-2 reservation is held (SPC-2 reservations: commands allowed in the presence of a reservation).
pub(crate) fn allowed_under_reservation(cdb: Cdb<'_>) -> bool {
    match cdb.op() {
        INQUIRY | REPORT_LUNS | REQUEST_SENSE | RELEASE_6 | RELEASE_10 | MAINTENANCE_IN => true,
        PREVENT_ALLOW_MEDIUM_REMOVAL => cdb.u8(4) & 0x03 == 0,
        _ => false,
    }
}

fn check_third_party(cdb: Cdb<'_>) -> Result<(), SenseReason> {
    // Third-party reservations (3RDPTY) and LONGID are not supported.
    if cdb.op() == RESERVE_10 || cdb.op() == RELEASE_10 {
        if cdb.bit(1, 4) {
            return Err(SenseReason::cdb_bit(1, 4));
        }
        if cdb.bit(1, 1) {
            return Err(SenseReason::cdb_bit(1, 1));
        }
    } else if cdb.u8(1) & 0x1F != 0 {
        // RESERVE(6)/RELEASE(6) byte 1 holds the obsolete 3rd-party and extent fields.
        return Err(SenseReason::cdb_bit(1, 4));
    }
    Ok(())
}

/// RESERVE(6/10): reserve the LU for this I_T nexus. Returns `false` when another nexus holds
/// it (RESERVATION CONFLICT; normally caught by the dispatcher already, this closes the race).
pub(crate) fn reserve(lu: &LogicalUnit, nexus: &Nexus, cdb: Cdb<'_>) -> Result<bool, SenseReason> {
    check_third_party(cdb)?;
    let mut r = lock(&lu.reservation);
    match *r {
        Some(holder) if holder != nexus.id => Ok(false),
        _ => {
            *r = Some(nexus.id);
            Ok(true)
        }
    }
}

/// RELEASE(6/10): release our reservation; GOOD with no effect when we do not hold it.
pub(crate) fn release(lu: &LogicalUnit, nexus: &Nexus, cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    check_third_party(cdb)?;
    let mut r = lock(&lu.reservation);
    if *r == Some(nexus.id) {
        *r = None;
    }
    Ok(Bytes::new())
}

/// PREVENT ALLOW MEDIUM REMOVAL: recorded per nexus, consulted by START STOP UNIT LOEJ.
pub(crate) fn prevent_allow(
    lu: &LogicalUnit,
    nexus: &Nexus,
    cdb: Cdb<'_>,
) -> Result<Bytes, SenseReason> {
    match cdb.u8(4) & 0x03 {
        0b00 => {
            lock(&lu.prevent).remove(&nexus.id);
        }
        0b01 => {
            lock(&lu.prevent).insert(nexus.id);
        }
        // 10b/11b are for medium changers (obsolete for block devices).
        _ => return Err(SenseReason::cdb_bit(4, 1)),
    }
    Ok(Bytes::new())
}

// ---------------------------------------------------------------------------------------------
// REPORT SUPPORTED OPERATION CODES (SPC-4)
// ---------------------------------------------------------------------------------------------

/// One supported command: operation code, service action, how it behaves under a persistent
/// reservation held by another I_T nexus, CDB USAGE DATA (SPC-4 one_command parameter data).
pub(crate) struct OpEntry {
    pub op: u8,
    pub sa: Option<u8>,
    pub pr: PrAccess,
    pub usage: &'static [u8],
}

const C: u8 = 0x07; // CONTROL byte: NACA, FLAG (obsolete), LINK are examined.

const fn e(op: u8, sa: Option<u8>, pr: PrAccess, usage: &'static [u8]) -> OpEntry {
    OpEntry { op, sa, pr, usage }
}

use PrAccess::{Allowed, Conflict, Read, Write};

/// Every command the dispatcher executes: the single list that RSOC reports and that says how
/// each command behaves under each persistent reservation type ([`PrAccess`]; exceptions by
/// field value are in [`pr_access`]).
#[rustfmt::skip]
pub(crate) const SUPPORTED: &[OpEntry] = &[
    e(TEST_UNIT_READY, None, Allowed, &[TEST_UNIT_READY, 0, 0, 0, 0, C]),
    e(REQUEST_SENSE, None, Allowed, &[REQUEST_SENSE, 0x01, 0, 0, 0xFF, C]),
    e(READ_6, None, Read, &[READ_6, 0x1F, 0xFF, 0xFF, 0xFF, C]),
    e(WRITE_6, None, Write, &[WRITE_6, 0x1F, 0xFF, 0xFF, 0xFF, C]),
    e(INQUIRY, None, Allowed, &[INQUIRY, 0x03, 0xFF, 0xFF, 0xFF, C]),
    e(MODE_SELECT_6, None, Write, &[MODE_SELECT_6, 0x11, 0, 0, 0xFF, C]),
    e(RESERVE_6, None, Conflict, &[RESERVE_6, 0, 0, 0, 0, C]),
    e(RELEASE_6, None, Conflict, &[RELEASE_6, 0, 0, 0, 0, C]),
    e(MODE_SENSE_6, None, Allowed, &[MODE_SENSE_6, 0x08, 0xFF, 0xFF, 0xFF, C]),
    e(START_STOP_UNIT, None, Write, &[START_STOP_UNIT, 0x01, 0, 0x0F, 0xF7, C]),
    e(PREVENT_ALLOW_MEDIUM_REMOVAL, None, Write, &[PREVENT_ALLOW_MEDIUM_REMOVAL, 0, 0, 0, 0x03, C]),
    e(READ_CAPACITY_10, None, Allowed, &[READ_CAPACITY_10, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0x01, C]),
    e(READ_10, None, Read, &[READ_10, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0xFF, 0xFF, C]),
    e(WRITE_10, None, Write, &[WRITE_10, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0xFF, 0xFF, C]),
    e(WRITE_AND_VERIFY_10, None, Write, &[WRITE_AND_VERIFY_10, 0xF2, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0xFF, 0xFF, C]),
    e(VERIFY_10, None, Read, &[VERIFY_10, 0xF6, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0xFF, 0xFF, C]),
    e(PRE_FETCH_10, None, Read, &[PRE_FETCH_10, 0x02, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0xFF, 0xFF, C]),
    e(SYNCHRONIZE_CACHE_10, None, Write, &[SYNCHRONIZE_CACHE_10, 0x02, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0xFF, 0xFF, C]),
    e(READ_DEFECT_DATA_10, None, Read, &[READ_DEFECT_DATA_10, 0, 0x1F, 0, 0, 0, 0, 0xFF, 0xFF, C]),
    e(WRITE_SAME_10, None, Write, &[WRITE_SAME_10, 0xE8, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0xFF, 0xFF, C]),
    e(UNMAP, None, Write, &[UNMAP, 0x01, 0, 0, 0, 0, 0, 0xFF, 0xFF, C]),
    e(SANITIZE, Some(SA_SANITIZE_BLOCK_ERASE), Write, &[SANITIZE, 0xBF, 0, 0, 0, 0, 0, 0xFF, 0xFF, C]),
    e(SANITIZE, Some(SA_SANITIZE_CRYPTO_ERASE), Write, &[SANITIZE, 0xBF, 0, 0, 0, 0, 0, 0xFF, 0xFF, C]),
    e(SANITIZE, Some(SA_SANITIZE_EXIT_FAILURE_MODE), Write, &[SANITIZE, 0xBF, 0, 0, 0, 0, 0, 0xFF, 0xFF, C]),
    e(MODE_SELECT_10, None, Write, &[MODE_SELECT_10, 0x11, 0, 0, 0, 0, 0, 0xFF, 0xFF, C]),
    e(RESERVE_10, None, Conflict, &[RESERVE_10, 0x12, 0, 0, 0, 0, 0, 0, 0, C]),
    e(RELEASE_10, None, Conflict, &[RELEASE_10, 0x12, 0, 0, 0, 0, 0, 0, 0, C]),
    e(MODE_SENSE_10, None, Allowed, &[MODE_SENSE_10, 0x18, 0xFF, 0xFF, 0, 0, 0, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_IN, Some(PRIN_READ_KEYS), Allowed, &[PERSISTENT_RESERVE_IN, 0x1F, 0, 0, 0, 0, 0, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_IN, Some(PRIN_READ_RESERVATION), Allowed, &[PERSISTENT_RESERVE_IN, 0x1F, 0, 0, 0, 0, 0, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_IN, Some(PRIN_REPORT_CAPABILITIES), Allowed, &[PERSISTENT_RESERVE_IN, 0x1F, 0, 0, 0, 0, 0, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_IN, Some(PRIN_READ_FULL_STATUS), Allowed, &[PERSISTENT_RESERVE_IN, 0x1F, 0, 0, 0, 0, 0, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_OUT, Some(PROUT_REGISTER), Allowed, &[PERSISTENT_RESERVE_OUT, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_OUT, Some(PROUT_RESERVE), Allowed, &[PERSISTENT_RESERVE_OUT, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_OUT, Some(PROUT_RELEASE), Allowed, &[PERSISTENT_RESERVE_OUT, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_OUT, Some(PROUT_CLEAR), Allowed, &[PERSISTENT_RESERVE_OUT, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_OUT, Some(PROUT_PREEMPT), Allowed, &[PERSISTENT_RESERVE_OUT, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_OUT, Some(PROUT_PREEMPT_AND_ABORT), Allowed, &[PERSISTENT_RESERVE_OUT, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_OUT, Some(PROUT_REGISTER_AND_IGNORE), Allowed, &[PERSISTENT_RESERVE_OUT, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, C]),
    e(PERSISTENT_RESERVE_OUT, Some(PROUT_REGISTER_AND_MOVE), Allowed, &[PERSISTENT_RESERVE_OUT, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, C]),
    e(EXTENDED_COPY, Some(SA_EXTENDED_COPY_LID1), Allowed, &[EXTENDED_COPY, 0x1F, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(RECEIVE_COPY_RESULTS, Some(SA_RCR_COPY_STATUS), Allowed, &[RECEIVE_COPY_RESULTS, 0x1F, 0xFF, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(RECEIVE_COPY_RESULTS, Some(SA_RCR_OPERATING_PARAMETERS), Allowed, &[RECEIVE_COPY_RESULTS, 0x1F, 0xFF, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(READ_16, None, Read, &[READ_16, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(COMPARE_AND_WRITE, None, Write, &[COMPARE_AND_WRITE, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0xFF, 0, C]),
    e(WRITE_16, None, Write, &[WRITE_16, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(ORWRITE_16, None, Write, &[ORWRITE_16, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(WRITE_AND_VERIFY_16, None, Write, &[WRITE_AND_VERIFY_16, 0xF2, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(VERIFY_16, None, Read, &[VERIFY_16, 0xF6, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(PRE_FETCH_16, None, Read, &[PRE_FETCH_16, 0x02, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(SYNCHRONIZE_CACHE_16, None, Write, &[SYNCHRONIZE_CACHE_16, 0x02, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(WRITE_SAME_16, None, Write, &[WRITE_SAME_16, 0xE9, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(SERVICE_ACTION_IN_16, Some(SAI_READ_CAPACITY_16), Allowed, &[SERVICE_ACTION_IN_16, 0x1F, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01, C]),
    e(SERVICE_ACTION_IN_16, Some(SAI_GET_LBA_STATUS), Read, &[SERVICE_ACTION_IN_16, 0x1F, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(REPORT_LUNS, None, Allowed, &[REPORT_LUNS, 0, 0xFF, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(MAINTENANCE_IN, Some(MI_REPORT_TARGET_PGS), Allowed, &[MAINTENANCE_IN, 0xFF, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(MAINTENANCE_OUT, Some(MO_SET_TARGET_PGS), Write, &[MAINTENANCE_OUT, 0x1F, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(MAINTENANCE_IN, Some(MI_REPORT_SUPPORTED_OPCODES), Allowed, &[MAINTENANCE_IN, 0x1F, 0x87, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(READ_12, None, Read, &[READ_12, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(WRITE_12, None, Write, &[WRITE_12, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(WRITE_AND_VERIFY_12, None, Write, &[WRITE_AND_VERIFY_12, 0xF2, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(VERIFY_12, None, Read, &[VERIFY_12, 0xF6, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
    e(READ_DEFECT_DATA_12, None, Read, &[READ_DEFECT_DATA_12, 0x1F, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0, C]),
];

/// How `cdb` behaves under another I_T nexus's persistent reservation: the table entry, with
/// the field-dependent cases of SPC-4/SBC-3 (START STOP UNIT with START=1 and PREVENT ALLOW
/// MEDIUM REMOVAL with PREVENT=00b are allowed).
pub(crate) fn pr_access(cdb: Cdb<'_>) -> PrAccess {
    let op = cdb.op();
    match op {
        START_STOP_UNIT if cdb.bit(4, 0) => return Allowed,
        PREVENT_ALLOW_MEDIUM_REMOVAL if cdb.u8(4) & 0x03 == 0 => return Allowed,
        _ => {}
    }
    let sa = cdb.u8(1) & 0x1F;
    SUPPORTED
        .iter()
        .find(|x| x.op == op && x.sa.is_none_or(|s| s == sa))
        .or_else(|| SUPPORTED.iter().find(|x| x.op == op))
        .map_or(Write, |x| x.pr)
}

/// Command timeouts descriptor (SPC-4 command timeouts descriptor): no timeouts reported (zero = not specified).
fn timeouts_descriptor(out: &mut Vec<u8>) {
    out.extend_from_slice(&[0x00, 0x0A]);
    out.extend_from_slice(&[0; 10]);
}

/// Whether `op` is left out on this LU: on an `LuConfig::shared` LU, the commands only
/// atomic or enforced inside this process — ORWRITE (a read-modify-write under this
/// process's range lock), SPC-2 RESERVE/RELEASE (held in this process) and, unless the
/// reservations are shared with the other nodes (`LuConfig::cluster`), PERSISTENT RESERVE
/// IN/OUT.
pub(crate) fn not_offered(cfg: &crate::LuConfig, op: u8) -> bool {
    cfg.shared
        && match op {
            PERSISTENT_RESERVE_IN | PERSISTENT_RESERVE_OUT => cfg.cluster.is_none(),
            ORWRITE_16 | RESERVE_6 | RESERVE_10 | RELEASE_6 | RELEASE_10 => true,
            _ => false,
        }
}

/// MAINTENANCE IN / REPORT SUPPORTED OPERATION CODES (SPC-4), without the commands
/// [`not_offered`] on this LU.
pub(crate) fn report_supported_opcodes(
    cdb: Cdb<'_>,
    cfg: &crate::LuConfig,
) -> Result<Bytes, SenseReason> {
    if cdb.u8(1) & 0x1F != MI_REPORT_SUPPORTED_OPCODES {
        return Err(SenseReason::cdb_bit(1, 4));
    }
    let rctd = cdb.bit(2, 7);
    let options = cdb.u8(2) & 0x07;
    let req_op = cdb.u8(3);
    let req_sa = cdb.u16(4);
    let alloc = cdb.u32(6) as usize;
    let offered = |e: &&OpEntry| !not_offered(cfg, e.op);
    let has_sa = |op: u8| {
        SUPPORTED
            .iter()
            .filter(offered)
            .any(|e| e.op == op && e.sa.is_some())
    };
    let mut d = Vec::new();
    match options {
        0b000 => {
            d.extend_from_slice(&[0; 4]);
            for e in SUPPORTED.iter().filter(offered) {
                d.push(e.op);
                d.push(0);
                d.extend_from_slice(&u16::from(e.sa.unwrap_or(0)).to_be_bytes());
                d.push(0);
                // CTDP (bit 1), SERVACTV (bit 0)
                d.push(if rctd { 0x02 } else { 0 } | u8::from(e.sa.is_some()));
                d.extend_from_slice(&(e.usage.len() as u16).to_be_bytes());
                if rctd {
                    timeouts_descriptor(&mut d);
                }
            }
            let len = (d.len() - 4) as u32;
            d[0..4].copy_from_slice(&len.to_be_bytes());
        }
        0b001..=0b011 => {
            let with_sa = match options {
                0b001 => false,
                0b010 => true,
                _ => has_sa(req_op),
            };
            // 001b on a command with service actions, or 010b on one without: the request
            // names the wrong thing (SPC-4 REPORTING OPTIONS).
            if options == 0b001 && has_sa(req_op) {
                return Err(SenseReason::cdb_byte(3));
            }
            let supported = crate::is_supported(req_op) && !not_offered(cfg, req_op);
            if options == 0b010 && !has_sa(req_op) && supported {
                return Err(SenseReason::cdb_byte(3));
            }
            let entry = SUPPORTED.iter().filter(offered).find(|e| {
                e.op == req_op
                    && match (with_sa, e.sa) {
                        (true, Some(sa)) => u16::from(sa) == req_sa,
                        (false, None) => true,
                        _ => false,
                    }
            });
            d.push(0);
            match entry {
                Some(e) => {
                    d.push(if rctd { 0x80 } else { 0 } | 0b011); // CTDP, SUPPORT=011b
                    d.extend_from_slice(&(e.usage.len() as u16).to_be_bytes());
                    d.extend_from_slice(e.usage);
                    if rctd {
                        timeouts_descriptor(&mut d);
                    }
                }
                None => {
                    d.push(0b001); // SUPPORT=001b: not supported
                    d.extend_from_slice(&[0, 0]);
                }
            }
        }
        _ => return Err(SenseReason::cdb_bit(2, 2)),
    }
    Ok(truncate(d, alloc))
}
