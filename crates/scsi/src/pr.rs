//! SPC-4 persistent reservations: PERSISTENT RESERVE IN (READ KEYS, READ RESERVATION, REPORT
//! CAPABILITIES, READ FULL STATUS) and PERSISTENT RESERVE OUT (REGISTER, REGISTER AND IGNORE
//! EXISTING KEY, RESERVE, RELEASE, CLEAR, PREEMPT, PREEMPT AND ABORT, REGISTER AND MOVE), all six
//! reservation types, PRGENERATION, the unit attentions they establish and APTPL persistence.
//!
//! * **Identity.** A registration belongs to an I_T nexus named by its initiator port name and
//!   target port name ([`Nexus::initiator_port`], [`Nexus::target_port`]), so it survives the
//!   session (SPC-4 persistent reservations are kept across I_T nexus loss) and is shared by
//!   every session of the same port pair. It is never keyed by [`Nexus::id`].
//! * **Conflicts.** Whether a command conflicts with a persistent reservation is decided by
//!   [`PrAccess`] in the opcode table (`spc::SUPPORTED`), see [`PrState::conflicts`].
//! * **APTPL.** With `LuConfig::state_dir` set, a REGISTER with APTPL=1 makes the state persist:
//!   every change is written to `<state_dir>/pr-state` (temporary file, `fsync`, `rename`,
//!   `fsync` of the directory) **before** the command completes, and it is reloaded by
//!   `LogicalUnit::new`. Without a state directory APTPL=1 is refused with INVALID FIELD IN
//!   PARAMETER LIST (REPORT CAPABILITIES then reports PTPL_C=0): we never claim persistence we do
//!   not provide. A change is applied to a copy, persisted, then committed, so a failed write
//!   leaves the state as it was (HARDWARE ERROR / INTERNAL TARGET FAILURE).
//! * **PREEMPT AND ABORT.** Aborting tasks is the transport's job: the preempted I_T nexuses are
//!   queued and the transport takes them with `LogicalUnit::take_pr_aborts` after the command.

use crate::cdb::Cdb;
use crate::sense::{SenseReason, UnitAttention};
use crate::spc::truncate;
use crate::{LogicalUnit, Nexus};
use bytes::Bytes;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Reservation types (SPC-4 persistent reservation type codes).
pub(crate) const WR_EX: u8 = 0x1;
pub(crate) const EX_AC: u8 = 0x3;
pub(crate) const WR_EX_RO: u8 = 0x5;
pub(crate) const EX_AC_RO: u8 = 0x6;
pub(crate) const WR_EX_AR: u8 = 0x7;
pub(crate) const EX_AC_AR: u8 = 0x8;

/// PERSISTENT RESERVE IN service actions.
const READ_KEYS: u8 = 0x00;
const READ_RESERVATION: u8 = 0x01;
const REPORT_CAPABILITIES: u8 = 0x02;
const READ_FULL_STATUS: u8 = 0x03;

/// PERSISTENT RESERVE OUT service actions.
const REGISTER: u8 = 0x00;
const RESERVE: u8 = 0x01;
const RELEASE: u8 = 0x02;
const CLEAR: u8 = 0x03;
const PREEMPT: u8 = 0x04;
const PREEMPT_AND_ABORT: u8 = 0x05;
const REGISTER_AND_IGNORE: u8 = 0x06;
const REGISTER_AND_MOVE: u8 = 0x07;

/// Name of the APTPL state file inside `LuConfig::state_dir`.
pub const PR_STATE_FILE: &str = "pr-state";

/// How a command behaves in the presence of a persistent reservation held by another I_T
/// nexus (SPC-4 / SBC-3 tables of commands allowed in the presence of various reservations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PrAccess {
    /// Allowed under every reservation type (INQUIRY, REPORT LUNS, PRIN, PROUT: its service
    /// actions do their own checks, ...).
    Allowed,
    /// Reads the medium: conflicts with Exclusive Access; with the registrants-only and
    /// all-registrants Exclusive Access types only for unregistered I_T nexuses.
    Read,
    /// Modifies the medium or device state: conflicts with Write Exclusive and Exclusive
    /// Access; with the registrants-only and all-registrants types only for unregistered
    /// I_T nexuses.
    Write,
    /// Always conflicts while a persistent reservation exists (SPC-2 RESERVE/RELEASE).
    Conflict,
}

/// An I_T nexus as persistent reservations identify it (initiator port, target port).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PortPair {
    pub initiator: Arc<str>,
    pub target: Arc<str>,
}

/// The target port name of a registration made with ALL_TG_PT=1: the initiator port through
/// every target port of the target (one registration; changed or removed through any port).
pub const ALL_TARGET_PORTS: &str = "*";

/// Whether a victim's target port name from [`crate::LogicalUnit::take_pr_aborts`] names
/// `port` (it may be [`ALL_TARGET_PORTS`]).
pub fn names_port(victim: &str, port: &str) -> bool {
    victim == port || victim == ALL_TARGET_PORTS
}

impl PortPair {
    /// Whether this registration identity covers the I_T nexus `who` (exactly, or as an
    /// ALL_TG_PT registration of its initiator port).
    pub(crate) fn covers(&self, who: &PortPair) -> bool {
        self == who || (&*self.target == ALL_TARGET_PORTS && self.initiator == who.initiator)
    }

    pub(crate) fn of(n: &Nexus) -> Self {
        PortPair {
            initiator: Arc::clone(&n.initiator_port),
            target: Arc::clone(&n.target_port),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Registration {
    pub who: PortPair,
    pub key: u64,
    pub relative_port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reservation {
    /// The holder (for all-registrants types: the I_T nexus that reserved; every registrant
    /// holds it).
    pub holder: PortPair,
    pub ptype: u8,
}

/// The persistent reservation state of one logical unit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PrState {
    pub generation: u32,
    pub regs: Vec<Registration>,
    pub res: Option<Reservation>,
    pub aptpl: bool,
}

fn all_registrants(t: u8) -> bool {
    matches!(t, WR_EX_AR | EX_AC_AR)
}

fn valid_type(t: u8) -> bool {
    matches!(t, WR_EX | EX_AC | WR_EX_RO | EX_AC_RO | WR_EX_AR | EX_AC_AR)
}

impl PrState {
    /// How reservations know `who`: its initiator port's ALL_TG_PT registration if there is
    /// one, else the I_T nexus itself.
    pub(crate) fn identity(&self, who: &PortPair) -> PortPair {
        self.regs
            .iter()
            .find(|r| &*r.who.target == ALL_TARGET_PORTS && r.who.initiator == who.initiator)
            .map_or_else(|| who.clone(), |r| r.who.clone())
    }

    fn reg(&self, who: &PortPair) -> Option<&Registration> {
        self.regs.iter().find(|r| &r.who == who)
    }

    fn is_holder(&self, who: &PortPair) -> bool {
        match &self.res {
            Some(r) if all_registrants(r.ptype) => self.reg(who).is_some(),
            Some(r) => &r.holder == who,
            None => false,
        }
    }

    /// Whether a command of class `access` from `who` conflicts with the reservation.
    /// Whether a persistent reservation exists (without one nothing conflicts).
    pub(crate) fn reserved(&self) -> bool {
        self.res.is_some()
    }

    pub(crate) fn conflicts(&self, who: &PortPair, access: PrAccess) -> bool {
        let Some(res) = &self.res else {
            return false;
        };
        let who = &self.identity(who);
        if access == PrAccess::Conflict {
            return true;
        }
        if access == PrAccess::Allowed || self.is_holder(who) {
            return false;
        }
        let registered = self.reg(who).is_some();
        match (res.ptype, access) {
            (WR_EX, PrAccess::Read) => false,
            (WR_EX | EX_AC, _) => true,
            (WR_EX_RO | WR_EX_AR, PrAccess::Read) => false,
            // Registrants-only / all-registrants: registered nexuses get full access.
            _ => !registered,
        }
    }

    /// Key reported for the reservation (zero for all-registrants types, SPC-4 READ RESERVATION).
    fn reservation_key(&self) -> u64 {
        match &self.res {
            Some(r) if !all_registrants(r.ptype) => self.reg(&r.holder).map_or(0, |g| g.key),
            _ => 0,
        }
    }

    // -----------------------------------------------------------------------------------------
    // APTPL file: a small line-oriented text format (port names never contain tabs/newlines).
    // -----------------------------------------------------------------------------------------

    fn serialize(&self) -> String {
        let mut s = format!("ironsan-pr 1\ngeneration {}\n", self.generation);
        for r in &self.regs {
            s += &format!(
                "reg\t{:016x}\t{}\t{}\t{}\n",
                r.key, r.relative_port, r.who.initiator, r.who.target
            );
        }
        if let Some(r) = &self.res {
            s += &format!(
                "res\t{}\t{}\t{}\n",
                r.ptype, r.holder.initiator, r.holder.target
            );
        }
        s
    }

    fn parse(text: &str) -> Option<PrState> {
        let mut lines = text.lines();
        if lines.next()? != "ironsan-pr 1" {
            return None;
        }
        let mut st = PrState {
            aptpl: true,
            ..Default::default()
        };
        for line in lines {
            let f: Vec<&str> = line.split('\t').collect();
            match f.as_slice() {
                [g] if g.starts_with("generation ") => {
                    st.generation = g["generation ".len()..].parse().ok()?;
                }
                ["reg", key, rel, i, t] => st.regs.push(Registration {
                    key: u64::from_str_radix(key, 16).ok()?,
                    relative_port: rel.parse().ok()?,
                    who: PortPair {
                        initiator: (*i).into(),
                        target: (*t).into(),
                    },
                }),
                ["res", ty, i, t] => {
                    st.res = Some(Reservation {
                        ptype: ty.parse().ok().filter(|&t| valid_type(t))?,
                        holder: PortPair {
                            initiator: (*i).into(),
                            target: (*t).into(),
                        },
                    })
                }
                [""] => {}
                _ => return None,
            }
        }
        Some(st)
    }
}

/// The record of an LU's persistent reservations that the nodes of a cluster share
/// (`LuConfig::cluster`): the state in the APTPL file's format, a serial that every change
/// increments, whether APTPL was asked for, and what the last change sets off on every node
/// (unit attentions for the named I_T nexuses, the nexuses whose tasks PREEMPT AND ABORT
/// aborts). Port names never contain tabs or newlines.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct SharedRecord {
    pub serial: u64,
    pub state: PrState,
    pub uas: UaList,
    pub aborts: Vec<PortPair>,
}

/// The serial of a shared persistent-reservation record (`None`: not a record).
pub fn pr_record_serial(record: &str) -> Option<u64> {
    SharedRecord::decode(record).map(|r| r.serial)
}

/// The unit attentions a PERSISTENT RESERVE OUT establishes, as the record names them.
const RECORD_UAS: [(UnitAttention, &str); 3] = [
    (UnitAttention::ReservationsReleased, "reservations-released"),
    (
        UnitAttention::ReservationsPreempted,
        "reservations-preempted",
    ),
    (
        UnitAttention::RegistrationsPreempted,
        "registrations-preempted",
    ),
];

impl SharedRecord {
    pub(crate) fn encode(&self) -> String {
        let mut s = self.state.serialize();
        s += &format!(
            "serial\t{}\naptpl\t{}\n",
            self.serial,
            u8::from(self.state.aptpl)
        );
        for (who, ua) in &self.uas {
            if let Some((_, name)) = RECORD_UAS.iter().find(|(u, _)| u == ua) {
                s += &format!("ua\t{name}\t{}\t{}\n", who.initiator, who.target);
            }
        }
        for who in &self.aborts {
            s += &format!("abort\t{}\t{}\n", who.initiator, who.target);
        }
        s
    }

    pub(crate) fn decode(text: &str) -> Option<SharedRecord> {
        let mut rec = SharedRecord::default();
        let mut state = String::new();
        let mut aptpl = false;
        let pair = |i: &str, t: &str| PortPair {
            initiator: i.into(),
            target: t.into(),
        };
        for line in text.lines() {
            let f: Vec<&str> = line.split('\t').collect();
            match f.as_slice() {
                ["serial", n] => rec.serial = n.parse().ok()?,
                ["aptpl", a] => aptpl = *a == "1",
                ["ua", name, i, t] => {
                    let ua = RECORD_UAS.iter().find(|(_, n)| n == name)?.0;
                    rec.uas.push((pair(i, t), ua));
                }
                ["abort", i, t] => rec.aborts.push(pair(i, t)),
                _ => {
                    state += line;
                    state.push('\n');
                }
            }
        }
        rec.state = PrState::parse(&state)?;
        rec.state.aptpl = aptpl;
        Some(rec)
    }
}

/// Load the APTPL state of `dir`, if any and well formed (a damaged file is ignored: the LU
/// starts without persistent reservations, as after a power on without APTPL).
pub(crate) fn load(dir: Option<&Path>) -> PrState {
    dir.and_then(|d| std::fs::read_to_string(d.join(PR_STATE_FILE)).ok())
        .and_then(|t| PrState::parse(&t))
        .unwrap_or_default()
}

/// Write `st` durably: temporary file, fsync, rename over the old one, fsync the directory.
/// With APTPL off the file is removed (a later power on starts empty).
fn persist(dir: &Path, st: &PrState) -> std::io::Result<()> {
    let path = dir.join(PR_STATE_FILE);
    if !st.aptpl {
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        }
    } else {
        std::fs::create_dir_all(dir)?;
        let tmp: PathBuf = dir.join(format!("{PR_STATE_FILE}.tmp"));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(st.serialize().as_bytes())?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, &path)?;
    }
    std::fs::File::open(dir)?.sync_all()
}

// ---------------------------------------------------------------------------------------------
// PERSISTENT RESERVE IN
// ---------------------------------------------------------------------------------------------

/// iSCSI TransportID, format 01h (name + ",i,0x" + ISID; SPC-4 iSCSI TransportID), padded to
/// a multiple of four bytes.
fn transport_id(initiator_port: &str) -> Vec<u8> {
    let mut name: Vec<u8> = initiator_port
        .bytes()
        .filter(|&b| b != 0)
        .take(220)
        .collect();
    name.push(0);
    while !(name.len()).is_multiple_of(4) || name.len() < 16 {
        name.push(0);
    }
    let mut d = vec![0x40 | 0x05, 0];
    d.extend_from_slice(&(name.len() as u16).to_be_bytes());
    d.extend_from_slice(&name);
    d
}

pub(crate) fn persistent_reserve_in(lu: &LogicalUnit, cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    let sa = cdb.u8(1) & 0x1F;
    let alloc = usize::from(cdb.u16(7));
    let st = crate::lu::lock(&lu.pr).clone();
    let mut d = Vec::new();
    match sa {
        READ_KEYS => {
            d.extend_from_slice(&st.generation.to_be_bytes());
            d.extend_from_slice(&((st.regs.len() * 8) as u32).to_be_bytes());
            for r in &st.regs {
                d.extend_from_slice(&r.key.to_be_bytes());
            }
        }
        READ_RESERVATION => {
            d.extend_from_slice(&st.generation.to_be_bytes());
            match &st.res {
                Some(r) => {
                    d.extend_from_slice(&16u32.to_be_bytes());
                    d.extend_from_slice(&st.reservation_key().to_be_bytes());
                    d.extend_from_slice(&[0; 5]);
                    d.push(r.ptype); // SCOPE 0h (LU_SCOPE) | TYPE
                    d.extend_from_slice(&[0; 2]);
                }
                None => d.extend_from_slice(&0u32.to_be_bytes()),
            }
        }
        REPORT_CAPABILITIES => {
            d.extend_from_slice(&8u16.to_be_bytes());
            // CRH=0, SIP_C=0 (no SPEC_I_PT), ATP_C=1 (ALL_TG_PT: one registration covering
            // the initiator port through every target port), PTPL_C when a state directory exists.
            let ptpl_c = lu.config().state_dir.is_some();
            d.push(0x04 | u8::from(ptpl_c));
            // TMV=1, ALLOW COMMANDS=000b (no information), PTPL_A.
            d.push(0x80 | u8::from(st.aptpl));
            // PERSISTENT RESERVATION TYPE MASK: WR_EX_AR, EX_AC_RO, WR_EX_RO, EX_AC, WR_EX;
            // EX_AC_AR.
            d.push(0x80 | 0x40 | 0x20 | 0x08 | 0x02);
            d.push(0x01);
            d.extend_from_slice(&[0; 2]);
        }
        READ_FULL_STATUS => {
            d.extend_from_slice(&st.generation.to_be_bytes());
            d.extend_from_slice(&[0; 4]);
            for r in &st.regs {
                let holder = st.is_holder(&r.who);
                d.extend_from_slice(&r.key.to_be_bytes());
                d.extend_from_slice(&[0; 4]);
                // ALL_TG_PT, R_HOLDER
                d.push(u8::from(&*r.who.target == ALL_TARGET_PORTS) << 1 | u8::from(holder));
                d.push(if holder {
                    st.res.as_ref().map_or(0, |x| x.ptype)
                } else {
                    0
                });
                d.extend_from_slice(&[0; 4]);
                d.extend_from_slice(&r.relative_port.to_be_bytes());
                let tid = transport_id(&r.who.initiator);
                d.extend_from_slice(&(tid.len() as u32).to_be_bytes());
                d.extend_from_slice(&tid);
            }
            let len = (d.len() - 8) as u32;
            d[4..8].copy_from_slice(&len.to_be_bytes());
        }
        _ => return Err(SenseReason::cdb_bit(1, 4)),
    }
    Ok(truncate(d, alloc))
}

// ---------------------------------------------------------------------------------------------
// PERSISTENT RESERVE OUT
// ---------------------------------------------------------------------------------------------

/// Outcome of a PERSISTENT RESERVE OUT.
pub(crate) enum ProutOutcome {
    Good,
    Conflict,
}

/// Unit attentions to establish once the new state is committed: (who, condition).
type UaList = Vec<(PortPair, UnitAttention)>;

/// Parse an iSCSI TransportID (SPC-4): format 01h gives the initiator port name directly.
fn parse_transport_id(p: &[u8], at: usize) -> Result<String, SenseReason> {
    let bad = SenseReason::param(at, None);
    if p.len() < 4 || p[0] & 0x0F != 0x05 {
        return Err(bad);
    }
    let len = usize::from(u16::from_be_bytes([p[2], p[3]]));
    let body = p
        .get(4..4 + len)
        .ok_or(SenseReason::ParameterListLengthError)?;
    let name: Vec<u8> = body.iter().copied().take_while(|&b| b != 0).collect();
    let name = String::from_utf8(name).map_err(|_| bad)?;
    match p[0] >> 6 {
        0b01 => Ok(name),
        _ => Err(bad), // format 00h names a device, not a port: cannot identify the I_T nexus
    }
}

/// What a PERSISTENT RESERVE OUT that completes GOOD sets off besides the new state.
#[derive(Debug, Default)]
struct Effects {
    uas: UaList,
    /// The I_T nexuses whose tasks PREEMPT AND ABORT aborts.
    aborts: Vec<PortPair>,
}

/// PERSISTENT RESERVE OUT on an LU whose state is this process's own.
pub(crate) fn persistent_reserve_out(
    lu: &LogicalUnit,
    nexus: &Nexus,
    cdb: Cdb<'_>,
    data_out: &Bytes,
    port_exists: &dyn Fn(u16) -> bool,
) -> Result<ProutOutcome, SenseReason> {
    let aptpl_ok = lu.config().state_dir.is_some();
    let mut guard = crate::lu::lock(&lu.pr);
    let mut st = guard.clone();
    let mut fx = Effects::default();
    let out = change_state(
        &mut st,
        nexus,
        cdb,
        data_out,
        port_exists,
        aptpl_ok,
        &mut fx,
    )?;
    if matches!(out, ProutOutcome::Conflict) || st == *guard {
        return Ok(out);
    }
    if let Some(dir) = &lu.config().state_dir {
        if st.aptpl || guard.aptpl {
            persist(dir, &st).map_err(|_| SenseReason::InternalTargetFailure)?;
        }
    }
    *guard = st;
    drop(guard);
    lu.pr_changed(fx.uas, fx.aborts);
    Ok(out)
}

/// PERSISTENT RESERVE OUT on an LU whose state the cluster keeps (`LuConfig::cluster`):
/// the change is worked out on the cluster's current record (again if another node changed
/// it first), written, and applied by every node before this returns; GOOD means every node
/// enforces it (or was fenced). `ports`: the relative target ports of the whole target.
/// APTPL is accepted: the record outlives any node (docs/ARCHITECTURE.md).
pub(crate) async fn persistent_reserve_out_shared(
    lu: &LogicalUnit,
    store: &crate::ClusterLuHandle,
    nexus: &Nexus,
    cdb: &[u8],
    data_out: &Bytes,
    ports: Vec<u16>,
) -> Result<ProutOutcome, SenseReason> {
    type Outcome = Option<Result<ProutOutcome, SenseReason>>;
    let result: Arc<std::sync::Mutex<Outcome>> = Arc::default();
    let (nexus2, cdb2, data2, result2) = (
        nexus.clone(),
        cdb.to_vec(),
        data_out.clone(),
        Arc::clone(&result),
    );
    let change: crate::PrChange = Box::new(move |cur| {
        let rec = match cur.map(SharedRecord::decode) {
            None => SharedRecord::default(),
            Some(Some(r)) => r,
            Some(None) => {
                *crate::lu::lock(&result2) = Some(Err(SenseReason::InternalTargetFailure));
                return None;
            }
        };
        let mut st = rec.state.clone();
        let mut fx = Effects::default();
        let exists = |p: u16| ports.contains(&p);
        let out = change_state(&mut st, &nexus2, Cdb(&cdb2), &data2, &exists, true, &mut fx);
        let write = matches!(out, Ok(ProutOutcome::Good)) && st != rec.state;
        *crate::lu::lock(&result2) = Some(out);
        write.then(|| {
            SharedRecord {
                serial: rec.serial + 1,
                state: st,
                uas: fx.uas,
                aborts: fx.aborts,
            }
            .encode()
        })
    });
    let written = store
        .0
        .update_pr(change)
        .await
        .map_err(|_| SenseReason::InternalTargetFailure)?;
    if let Some(rec) = written {
        // Normally applied already, by this node's own watch of the record.
        lu.apply_shared_pr(&rec, true)
            .map_err(|_| SenseReason::InternalTargetFailure)?;
    }
    let out = crate::lu::lock(&result).take();
    out.unwrap_or(Err(SenseReason::InternalTargetFailure))
}

/// Apply one PERSISTENT RESERVE OUT to `st` (a copy: the caller commits it).
fn change_state(
    st: &mut PrState,
    nexus: &Nexus,
    cdb: Cdb<'_>,
    data_out: &[u8],
    port_exists: &dyn Fn(u16) -> bool,
    aptpl_ok: bool,
    fx: &mut Effects,
) -> Result<ProutOutcome, SenseReason> {
    let sa = cdb.u8(1) & 0x1F;
    let scope = cdb.u8(2) >> 4;
    let ptype = cdb.u8(2) & 0x0F;
    let len = cdb.u32(5) as usize;
    if sa > REGISTER_AND_MOVE {
        return Err(SenseReason::cdb_bit(1, 4));
    }
    // Both parameter list layouts (basic, REGISTER AND MOVE) have a 24-byte fixed part.
    if len < 24 || data_out.len() < len {
        return Err(SenseReason::ParameterListLengthError);
    }
    let p = &data_out[..len];
    let be = |i: usize| u64::from_be_bytes(p[i..i + 8].try_into().unwrap_or([0; 8]));
    let rk = be(0);
    let sark = be(8);
    // ALL_TG_PT (REGISTER and REGISTER AND IGNORE EXISTING KEY only; ignored otherwise).
    let all_ports = matches!(sa, REGISTER | REGISTER_AND_IGNORE) && p[20] & 0x04 != 0;

    let needs_type = matches!(sa, RESERVE | RELEASE | PREEMPT | PREEMPT_AND_ABORT);
    if needs_type {
        if scope != 0 {
            return Err(SenseReason::cdb_bit(2, 7));
        }
        if !valid_type(ptype) {
            return Err(SenseReason::cdb_bit(2, 3));
        }
    }
    let aptpl = if sa == REGISTER_AND_MOVE {
        p[17] & 0x01 != 0
    } else {
        p[20] & 0x01 != 0
    };
    if sa != REGISTER_AND_MOVE {
        if p[20] & 0x08 != 0 {
            return Err(SenseReason::param(20, Some(3))); // SPEC_I_PT: SIP_C=0
        }
        if len != 24 {
            return Err(SenseReason::ParameterListLengthError);
        }
    }
    if aptpl && !aptpl_ok {
        return Err(SenseReason::param(
            if sa == REGISTER_AND_MOVE { 17 } else { 20 },
            Some(0),
        ));
    }

    let mut me = st.identity(&PortPair::of(nexus));
    if all_ports && st.reg(&me).is_none() {
        // ALL_TG_PT registers the initiator port through every target port; if it is already
        // registered through one of them, that registration would be hidden: refused.
        if st.regs.iter().any(|r| r.who.initiator == me.initiator) {
            return Ok(ProutOutcome::Conflict);
        }
        me.target = ALL_TARGET_PORTS.into();
    }
    let uas = &mut fx.uas;
    let my_key = st.reg(&me).map(|r| r.key);

    match sa {
        REGISTER | REGISTER_AND_IGNORE => {
            match my_key {
                None => {
                    if sa == REGISTER && rk != 0 {
                        return Ok(ProutOutcome::Conflict);
                    }
                    if sark == 0 {
                        return Ok(ProutOutcome::Good);
                    }
                    st.regs.push(Registration {
                        who: me.clone(),
                        key: sark,
                        relative_port: nexus.relative_port,
                    });
                }
                Some(k) => {
                    if sa == REGISTER && rk != k {
                        return Ok(ProutOutcome::Conflict);
                    }
                    if sark == 0 {
                        unregister(st, &me, uas);
                    } else if let Some(r) = st.regs.iter_mut().find(|r| r.who == me) {
                        r.key = sark;
                    }
                }
            }
            st.aptpl = aptpl;
            st.generation = st.generation.wrapping_add(1);
        }
        RESERVE => {
            if my_key != Some(rk) {
                return Ok(ProutOutcome::Conflict);
            }
            match &st.res {
                Some(r) if st.is_holder(&me) && r.ptype == ptype => return Ok(ProutOutcome::Good),
                Some(_) => return Ok(ProutOutcome::Conflict),
                None => {
                    st.res = Some(Reservation {
                        holder: me.clone(),
                        ptype,
                    })
                }
            }
        }
        RELEASE => {
            if my_key != Some(rk) {
                return Ok(ProutOutcome::Conflict);
            }
            let Some(r) = st.res.clone() else {
                return Ok(ProutOutcome::Good);
            };
            if !st.is_holder(&me) {
                return Ok(ProutOutcome::Good);
            }
            if r.ptype != ptype {
                return Err(SenseReason::InvalidReleaseOfPersistentReservation);
            }
            st.res = None;
            if !matches!(r.ptype, WR_EX | EX_AC) {
                for g in st.regs.iter().filter(|g| g.who != me) {
                    uas.push((g.who.clone(), UnitAttention::ReservationsReleased));
                }
            }
        }
        CLEAR => {
            if my_key != Some(rk) {
                return Ok(ProutOutcome::Conflict);
            }
            for g in st.regs.iter().filter(|g| g.who != me) {
                uas.push((g.who.clone(), UnitAttention::ReservationsPreempted));
            }
            st.regs.clear();
            st.res = None;
            st.generation = st.generation.wrapping_add(1);
        }
        PREEMPT | PREEMPT_AND_ABORT => {
            if my_key != Some(rk) {
                return Ok(ProutOutcome::Conflict);
            }
            let removed: Vec<PortPair>;
            match st.res.clone() {
                Some(r) if all_registrants(r.ptype) && sark == 0 => {
                    // Preempt an all-registrants reservation: every other registration goes,
                    // the issuer holds the new reservation.
                    removed = st
                        .regs
                        .iter()
                        .filter(|g| g.who != me)
                        .map(|g| g.who.clone())
                        .collect();
                    st.res = Some(Reservation {
                        holder: me.clone(),
                        ptype,
                    });
                }
                Some(r)
                    if !all_registrants(r.ptype)
                        && st.reg(&r.holder).map(|g| g.key) == Some(sark) =>
                {
                    removed = st
                        .regs
                        .iter()
                        .filter(|g| g.key == sark && g.who != me)
                        .map(|g| g.who.clone())
                        .collect();
                    let changed = r.ptype != ptype;
                    st.res = Some(Reservation {
                        holder: me.clone(),
                        ptype,
                    });
                    if changed {
                        for g in st
                            .regs
                            .iter()
                            .filter(|g| g.who != me && !removed.contains(&g.who))
                        {
                            uas.push((g.who.clone(), UnitAttention::ReservationsReleased));
                        }
                    }
                }
                _ => {
                    // No reservation, or SARK names other registrants: remove registrations only.
                    if sark == 0 {
                        return Err(SenseReason::param(8, None));
                    }
                    removed = st
                        .regs
                        .iter()
                        .filter(|g| g.key == sark && g.who != me)
                        .map(|g| g.who.clone())
                        .collect();
                    if removed.is_empty() && !st.regs.iter().any(|g| g.key == sark) {
                        return Ok(ProutOutcome::Conflict);
                    }
                }
            }
            st.regs.retain(|g| !removed.contains(&g.who));
            for w in &removed {
                uas.push((w.clone(), UnitAttention::RegistrationsPreempted));
            }
            if sa == PREEMPT_AND_ABORT {
                fx.aborts = removed;
            }
            st.generation = st.generation.wrapping_add(1);
        }
        REGISTER_AND_MOVE => {
            let Some(res) = st.res.clone() else {
                return Ok(ProutOutcome::Conflict);
            };
            if my_key != Some(rk) || !st.is_holder(&me) || all_registrants(res.ptype) {
                return Ok(ProutOutcome::Conflict);
            }
            if sark == 0 {
                return Err(SenseReason::param(8, None));
            }
            let unreg = p[17] & 0x02 != 0;
            let rel = u16::from_be_bytes([p[18], p[19]]);
            let tid_len = u32::from_be_bytes([p[20], p[21], p[22], p[23]]) as usize;
            if len < 24 + tid_len {
                return Err(SenseReason::ParameterListLengthError);
            }
            // The destination I_T nexus may be through another target port of the target.
            let target: Arc<str> = if rel == nexus.relative_port {
                Arc::clone(&nexus.target_port)
            } else if rel != 0 && port_exists(rel) {
                Nexus::target_port_name(nexus.target_device(), rel).into()
            } else {
                return Err(SenseReason::param(18, None));
            };
            let name = parse_transport_id(&p[24..24 + tid_len], 24)?;
            let dest = PortPair {
                initiator: name.into(),
                target,
            };
            if dest.initiator.eq_ignore_ascii_case(&me.initiator) {
                return Err(SenseReason::param(24, None));
            }
            // The destination's registration: through that port, or its initiator port's
            // ALL_TG_PT registration (which then holds the reservation).
            let is_dest = |g: &Registration| {
                g.who.initiator.eq_ignore_ascii_case(&dest.initiator)
                    && (g.who.target == dest.target || &*g.who.target == ALL_TARGET_PORTS)
            };
            match st.regs.iter_mut().find(|g| is_dest(g)) {
                Some(g) => g.key = sark,
                None => st.regs.push(Registration {
                    who: dest.clone(),
                    key: sark,
                    relative_port: rel,
                }),
            }
            let dest = st
                .regs
                .iter()
                .find(|g| is_dest(g))
                .map(|g| g.who.clone())
                .unwrap_or(dest);
            st.res = Some(Reservation {
                holder: dest,
                ptype: res.ptype,
            });
            if unreg {
                st.regs.retain(|g| g.who != me);
            }
            st.aptpl = aptpl;
            st.generation = st.generation.wrapping_add(1);
        }
        _ => return Err(SenseReason::cdb_bit(1, 4)),
    }

    Ok(ProutOutcome::Good)
}

/// Remove `who`'s registration; a reservation it held (other than all-registrants with other
/// registrants left) is released, with RESERVATIONS RELEASED for the registrants-only types.
fn unregister(st: &mut PrState, who: &PortPair, uas: &mut UaList) {
    st.regs.retain(|g| &g.who != who);
    let Some(r) = st.res.clone() else {
        return;
    };
    let release = if all_registrants(r.ptype) {
        st.regs.is_empty()
    } else {
        &r.holder == who
    };
    if release {
        st.res = None;
        if matches!(r.ptype, WR_EX_RO | EX_AC_RO) {
            for g in &st.regs {
                uas.push((g.who.clone(), UnitAttention::ReservationsReleased));
            }
        }
    } else if all_registrants(r.ptype) && &r.holder == who {
        // Another registrant keeps the all-registrants reservation.
        if let Some(g) = st.regs.first() {
            st.res = Some(Reservation {
                holder: g.who.clone(),
                ptype: r.ptype,
            });
        }
    }
}
