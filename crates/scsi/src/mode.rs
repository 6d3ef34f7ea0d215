//! MODE SENSE(6/10) and MODE SELECT(6/10) (SPC-4 MODE SELECT / MODE SENSE) over three mode pages:
//! Caching (08h, SBC-3 Caching mode page: WCE changeable), Control (0Ah, SPC-4 Control mode page) and
//! Informational Exceptions Control (1Ch, SPC-4), none savable (PS=0).

use crate::cdb::{opcode::*, Cdb};
use crate::lu::lock;
use crate::sense::{SenseReason, UnitAttention};
use crate::spc::truncate;
use crate::{LogicalUnit, Nexus};
use bytes::Bytes;

const CACHING: u8 = 0x08;
const CONTROL: u8 = 0x0A;
const INFO_EXCEPTIONS: u8 = 0x1C;
const ALL_PAGES: u8 = 0x3F;
/// Pages in ascending order, as page 3Fh returns them.
const PAGES: [u8; 3] = [CACHING, CONTROL, INFO_EXCEPTIONS];

/// Caching page byte 2 bit 2.
const WCE: u8 = 0x04;
/// Control page byte 4 bit 3.
const SWP: u8 = 0x08;

/// PAGE CONTROL of MODE SENSE (SPC-4); 11b (saved) is refused before this is built.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PageControl {
    Current,
    Changeable,
    Default,
}

/// One mode page under the given page control, or `None` if we do not implement it.
fn page(lu: &LogicalUnit, code: u8, pc: PageControl) -> Option<Vec<u8>> {
    use PageControl::*;
    let p = match code {
        CACHING => {
            // SBC-3 Caching mode page: page length 12h. Only WCE is changeable; RCD=0 (reads may be
            // served from the backend's cache).
            let mut p = vec![0u8; 0x14];
            p[0] = CACHING;
            p[1] = 0x12;
            p[2] = match pc {
                Current => u8::from(lu.wce()) * WCE,
                Changeable => WCE,
                Default => u8::from(lu.config().write_cache) * WCE,
            };
            p
        }
        CONTROL => {
            // SPC-4 Control mode page: page length 0Ah. TST=000b, D_SENSE=0 (fixed sense only),
            // GLTSD=1 (no log parameters saved), QUEUE ALGORITHM MODIFIER=1 (unrestricted
            // reordering: commands really do run concurrently), QERR=00b, TAS=0. Only SWP
            // (software write protect, byte 4 bit 3) is changeable.
            let mut p = vec![0u8; 0x0C];
            p[0] = CONTROL;
            p[1] = 0x0A;
            match pc {
                Changeable => p[4] = SWP,
                Current => {
                    p[2] = 0x02;
                    p[3] = 0x10;
                    p[4] = u8::from(lu.swp()) * SWP;
                }
                Default => {
                    p[2] = 0x02;
                    p[3] = 0x10;
                }
            }
            p
        }
        INFO_EXCEPTIONS => {
            // SPC-4 Informational Exceptions Control mode page: page length 0Ah, DEXCPT=1 (no informational exceptions).
            let mut p = vec![0u8; 0x0C];
            p[0] = INFO_EXCEPTIONS;
            p[1] = 0x0A;
            if pc != Changeable {
                p[2] = 0x08;
            }
            p
        }
        _ => return None,
    };
    Some(p)
}

/// NUMBER OF LOGICAL BLOCKS as the short block descriptor reports it (SBC-3 short LBA mode parameter block descriptor):
/// FFFF_FFFFh when the capacity does not fit.
fn short_blocks(lu: &LogicalUnit) -> u32 {
    u32::try_from(lu.capacity_blocks()).unwrap_or(u32::MAX)
}

/// MODE SENSE(6) and MODE SENSE(10) (SPC-4 MODE SENSE(6), MODE SENSE(10)).
pub(crate) fn mode_sense(lu: &LogicalUnit, cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    let ten = cdb.op() == MODE_SENSE_10;
    let dbd = cdb.bit(1, 3);
    let llbaa = ten && cdb.bit(1, 4);
    let pc = match cdb.u8(2) >> 6 {
        0 => PageControl::Current,
        1 => PageControl::Changeable,
        2 => PageControl::Default,
        _ => return Err(SenseReason::SavingParametersNotSupported),
    };
    let code = cdb.u8(2) & 0x3F;
    let subpage = cdb.u8(3);
    let alloc = if ten {
        usize::from(cdb.u16(7))
    } else {
        usize::from(cdb.u8(4))
    };
    // No subpages are implemented: subpage 00h, or FFh ("all subpages", i.e. the page itself).
    if subpage != 0x00 && subpage != 0xFF {
        return Err(SenseReason::cdb_byte(3));
    }
    let mut pages = Vec::new();
    if code == ALL_PAGES {
        for c in PAGES {
            pages.extend(page(lu, c, pc).unwrap_or_default());
        }
    } else {
        pages.extend(page(lu, code, pc).ok_or(SenseReason::cdb_bit(2, 5))?);
    }

    // Block descriptor (SBC-3 short LBA mode parameter block descriptor): short (8 bytes) or, for MODE SENSE(10) with LLBAA=1,
    // long (16 bytes).
    let mut bd = Vec::new();
    if !dbd {
        if llbaa {
            bd.extend_from_slice(&lu.capacity_blocks().to_be_bytes());
            bd.extend_from_slice(&[0; 4]);
            bd.extend_from_slice(&lu.block_size().to_be_bytes());
        } else {
            bd.extend_from_slice(&short_blocks(lu).to_be_bytes());
            bd.push(0);
            bd.extend_from_slice(&lu.block_size().to_be_bytes()[1..4]);
        }
    }
    // DEVICE-SPECIFIC PARAMETER (SBC-3 mode parameter header): WP (read-only or SWP), DPOFUA=1.
    let dsp = if lu.config().read_only || lu.swp() {
        0x80
    } else {
        0
    } | 0x10;

    let mut d = Vec::with_capacity(8 + bd.len() + pages.len());
    if ten {
        let total = 8 + bd.len() + pages.len();
        d.extend_from_slice(&((total - 2) as u16).to_be_bytes()); // MODE DATA LENGTH
        d.push(0); // MEDIUM TYPE
        d.push(dsp);
        d.push(u8::from(llbaa && !dbd)); // LONGLBA
        d.push(0);
        d.extend_from_slice(&(bd.len() as u16).to_be_bytes());
    } else {
        let total = 4 + bd.len() + pages.len();
        d.push((total - 1) as u8);
        d.push(0);
        d.push(dsp);
        d.push(bd.len() as u8);
    }
    d.extend_from_slice(&bd);
    d.extend_from_slice(&pages);
    Ok(truncate(d, alloc))
}

/// MODE SELECT(6) and MODE SELECT(10) (SPC-4 MODE SELECT(6), MODE SELECT(10)). The whole parameter list is
/// validated before anything changes; a field reported not changeable may only be sent with its
/// current value (SPC-4 MODE SELECT: INVALID FIELD IN PARAMETER LIST, field pointer into the list).
/// A WCE change establishes MODE PARAMETERS CHANGED for every other I_T nexus, and turning the
/// write cache off flushes it, so WCE=0 means what it says from then on.
pub(crate) async fn mode_select(
    lu: &LogicalUnit,
    nexus: &Nexus,
    cdb: Cdb<'_>,
    data_out: &Bytes,
) -> Result<Bytes, SenseReason> {
    let ten = cdb.op() == MODE_SELECT_10;
    let len = if ten {
        usize::from(cdb.u16(7))
    } else {
        usize::from(cdb.u8(4))
    };
    // SP=1: saved pages are not implemented (SPC-4 MODE SELECT).
    if cdb.bit(1, 0) {
        return Err(SenseReason::cdb_bit(1, 0));
    }
    if len == 0 {
        return Ok(Bytes::new());
    }
    // PF=0 (vendor-specific page format) is not implemented.
    if !cdb.bit(1, 4) {
        return Err(SenseReason::cdb_bit(1, 4));
    }
    if data_out.len() < len {
        return Err(SenseReason::ParameterListLengthError);
    }
    let p = &data_out[..len];
    let at = |i: usize| p.get(i).copied().unwrap_or(0);
    let hdr = if ten { 8 } else { 4 };
    if len < hdr {
        return Err(SenseReason::ParameterListLengthError);
    }
    // Mode parameter header (SPC-4 mode parameter header): MODE DATA LENGTH is reserved here; MEDIUM TYPE
    // must be what we report (00h); the device-specific parameter is ignored (SBC-3 mode parameter header).
    let (medium_at, bdl, longlba) = if ten {
        (
            2,
            usize::from(u16::from_be_bytes([at(6), at(7)])),
            at(4) & 1 != 0,
        )
    } else {
        (1, usize::from(at(3)), false)
    };
    if at(medium_at) != 0 {
        return Err(SenseReason::param(medium_at, None));
    }
    let bd_size = if longlba { 16 } else { 8 };
    if bdl % bd_size != 0 {
        return Err(SenseReason::param(if ten { 6 } else { 3 }, None));
    }
    if hdr + bdl > len {
        return Err(SenseReason::ParameterListLengthError);
    }
    // Block descriptors: capacity and block length cannot change; the current values (or 0
    // blocks, "no change") are accepted so a MODE SENSE result can be sent back as is.
    let mut off = hdr;
    while off < hdr + bdl {
        let field = |i: usize, n: usize| crate::cdb::Cdb(p).be(i, n);
        let (blocks, cur_blocks, blen_at, blen) = if longlba {
            (
                field(off, 8),
                lu.capacity_blocks(),
                off + 12,
                field(off + 12, 4),
            )
        } else {
            (
                field(off, 4),
                u64::from(short_blocks(lu)),
                off + 5,
                field(off + 5, 3),
            )
        };
        if blocks != 0 && blocks != cur_blocks {
            return Err(SenseReason::param(off, None));
        }
        if blen != u64::from(lu.block_size()) {
            return Err(SenseReason::param(blen_at, None));
        }
        off += bd_size;
    }

    let _serial = lock(&lu.mode_select);
    let mut new_wce = None;
    let mut new_swp = None;
    while off < len {
        let code_byte = at(off);
        if code_byte & 0x40 != 0 {
            return Err(SenseReason::param(off, Some(6))); // SPF: no subpages implemented
        }
        let code = code_byte & 0x3F; // PS (bit 7) is reserved in MODE SELECT
        let (Some(cur), Some(chg)) = (
            page(lu, code, PageControl::Current),
            page(lu, code, PageControl::Changeable),
        ) else {
            return Err(SenseReason::param(off, Some(5)));
        };
        if off + 2 > len {
            return Err(SenseReason::ParameterListLengthError);
        }
        if usize::from(at(off + 1)) + 2 != cur.len() {
            return Err(SenseReason::param(off + 1, None));
        }
        if off + cur.len() > len {
            return Err(SenseReason::ParameterListLengthError);
        }
        for (i, (&c, &m)) in cur.iter().zip(chg.iter()).enumerate().skip(2) {
            let diff = (at(off + i) ^ c) & !m;
            if diff != 0 {
                let bit = 7 - diff.leading_zeros() as u8;
                return Err(SenseReason::param(off + i, Some(bit)));
            }
        }
        if code == CACHING {
            new_wce = Some(at(off + 2) & WCE != 0);
        }
        if code == CONTROL {
            new_swp = Some(at(off + 4) & SWP != 0);
        }
        off += cur.len();
    }
    let mut flush = false;
    if let Some(w) = new_wce {
        if w != lu.wce() {
            lu.set_wce(w);
            flush = !w;
            lu.establish_unit_attention(UnitAttention::ModeParametersChanged, Some(nexus.id));
        }
    }
    if let Some(w) = new_swp {
        if w != lu.swp() {
            lu.set_swp(w);
            lu.establish_unit_attention(UnitAttention::ModeParametersChanged, Some(nexus.id));
        }
    }
    drop(_serial);
    if flush {
        lu.backend()
            .flush()
            .await
            .map_err(|e| SenseReason::from_backend(&e, lu.block_size()))?;
    }
    Ok(Bytes::new())
}
