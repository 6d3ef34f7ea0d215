//! # ironsan-scsi: the SCSI device server (SPC-4 / SBC-3)
//!
//! This crate executes SCSI commands against logical units backed by
//! [`ironsan_backend::BlockDevice`]s. It never sees a PDU: the iSCSI layer hands it a
//! [`Command`] (CDB, the Data-Out bytes it collected, the expected Data-In length) addressed to a
//! LUN over an I_T [`Nexus`], and gets back a [`Response`] (status, Data-In, sense). Backends
//! never see a CDB: they get byte offsets that this crate has already range-checked.
//!
//! ## Contract with the transport (iSCSI) layer
//! * Call [`data_out_len`] on the CDB to learn how many Data-Out bytes the command will consume,
//!   solicit at most that (bounded by the task's EDTL), then call [`Target::execute`].
//! * If `data_out` is **shorter** than the CDB needs, the command fails with CHECK CONDITION,
//!   ILLEGAL REQUEST and: INVALID FIELD IN CDB (24h/00h) pointing at the TRANSFER LENGTH field for
//!   block data (VERIFY BYTCHK, WRITE SAME, COMPARE AND WRITE: the CDB asks for more than
//!   the initiator sent, as LIO does; WRITE instead writes only the whole blocks it was sent,
//!   as libiscsi's residual tests expect), PARAMETER LIST LENGTH ERROR (1Ah/00h) for parameter lists
//!   (MODE SELECT, UNMAP). Nothing is written in that case. If it is **longer**, only the first
//!   bytes are used and the transport reports the residual, except for WRITE SAME and COMPARE
//!   AND WRITE, whose buffer is one unit laid out by the CDB (one pattern block; verify half +
//!   write half): any size other than the exact one is INVALID FIELD IN CDB, nothing written.
//!   So pass **all** the Data-Out received (immediate and unsolicited included), not only
//!   the first `data_out_len` bytes.
//! * EXTENDED COPY (83h) is executed by [`Target::execute`] itself: its copy targets are the
//!   LUs of this `Target` (named by their NAA designator), so a `Target` is the copy domain.
//! * Data-In is in memory unless [`Command::in_place`] allows a READ to answer with a
//!   range of its file LUN's backing file ([`DataIn::File`]), which the transport sends from the
//!   page cache (or a mapping of the file) itself.
//! * `data_in` is never longer than the CDB's ALLOCATION LENGTH or TRANSFER LENGTH. It may be
//!   longer than the task's EDTL; the transport truncates and reports the overflow residual
//!   (RFC 7143 SCSI Response residual count).
//! * Every failure is a [`SenseReason`], reported as CHECK CONDITION with 18-byte fixed-format
//!   sense data (response code 70h, SPC-4 §4.5.3). No failure closes the connection.
//! * LUN numbers are plain numbers (0..=[`MAX_LUN`]); [`lun_to_wire`] and [`lun_from_wire`]
//!   convert to and from the 8-byte SAM LUN field (single-level peripheral or flat space).
//! * Call [`Target::nexus_lost`] when a session ends, [`LogicalUnit::reset`] on LOGICAL UNIT
//!   RESET (it raises 29h/00h on every I_T nexus of the LU, the requester's included).
//! * After a PERSISTENT RESERVE OUT (5Fh) completes, call [`LogicalUnit::take_pr_aborts`] and
//!   abort every task on that LU of the sessions whose (initiator port, target port) it lists
//!   (PREEMPT AND ABORT).
//! * Persistent reservations are keyed by [`Nexus::initiator_port`] + [`Nexus::target_port`]
//!   and survive session loss; APTPL state lives in `LuConfig::state_dir`.
//!
//! ## Durability
//! With WCE=0 (the default, `LuConfig::write_cache = false`) every write is
//! [`WriteMode::Durable`](ironsan_backend::WriteMode) before GOOD. With WCE=1 writes are
//! `Cached` unless FUA is set; SYNCHRONIZE CACHE calls `flush`. Volatile backends (null, ram:
//! `Capabilities::volatile`) accept the same mode pages but are **not durable at all**; this is
//! stated here and in their kind name, not hidden in the caching page (an initiator cannot act on
//! it anyway, and lying with WCE=1 would make Linux issue pointless flushes).
//!
//! ## Unit attentions
//! Per LU, one queue per I_T nexus ([`Nexus::id`]), created lazily on the nexus's first
//! command; no power-on UA is raised at first contact. A queued condition is reported once as
//! CHECK CONDITION / UNIT ATTENTION on the next command other than INQUIRY, REPORT LUNS and
//! REQUEST SENSE (SAM-5 unit attention condition; REQUEST SENSE returns and clears it as parameter data).
//!
//! ## Modules
//! * [`sense`] — [`SenseReason`] and the one sense table.
//! * [`cdb`] — operation codes, panic-free CDB access, [`data_out_len`].
//! * `spc` — INQUIRY/VPD, REPORT LUNS, REQUEST SENSE, TEST UNIT READY, reservations, RSOC.
//! * `mode` — MODE SENSE / MODE SELECT and the mode pages.
//! * `sbc` — READ/WRITE/VERIFY/capacity/cache/provisioning commands, ORWRITE, WRITE ATOMIC,
//!   PRE-FETCH, READ DEFECT DATA, SANITIZE.
//! * `pr` — SPC-4 persistent reservations (PRIN/PROUT, conflicts, APTPL file).
//! * [`alua`] — target port groups and access states, REPORT / SET TARGET PORT GROUPS.
//! * `xcopy` — SPC-4 EXTENDED COPY (LID1) between LUs of one [`Target`], RECEIVE COPY
//!   RESULTS, the Third-party Copy VPD page. EXTENDED COPY is executed here, at the target
//!   level, because its copy targets are other LUs of the same target (named by their NAA).

pub mod alua;
pub mod cdb;
mod lu;
mod mode;
mod pr;
mod sbc;
pub mod sense;
mod spc;
mod xcopy;

#[cfg(test)]
mod tests;

use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;

pub use alua::{AccessState, Alua, AluaError, PortGroup, StatusCode};
pub use cdb::{changes_medium, data_out_len, opcode, MAX_TRANSFER_BYTES};
pub use lu::{
    local_naa, ClusterFuture, ClusterLu, ClusterLuHandle, LogicalUnit, LuConfig, PrChange,
    WriteAdmission, WriteToken,
};
pub use pr::{names_port, pr_record_serial, ALL_TARGET_PORTS, PR_STATE_FILE};
pub use sbc::PlacedWrite;
pub use sense::{FieldPointer, SenseFields, SenseKey, SenseReason, UnitAttention};

use cdb::{opcode::*, Cdb};
use lu::lock;

/// An I_T nexus as the SCSI layer sees it (SAM-5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nexus {
    /// Unique per I_T nexus (per iSCSI session) for the target's lifetime; keys the unit
    /// attention queues and reservations.
    pub id: u64,
    /// SCSI initiator port name, e.g. `iqn.1994-05.com.example:host,i,0x23d000000001`.
    pub initiator_port: Arc<str>,
    /// SCSI target port name, e.g. `iqn.2024-01.org.ironsan:disk,t,0x0001`.
    pub target_port: Arc<str>,
    /// RELATIVE TARGET PORT IDENTIFIER (1-based; SPC-4 relative target port designator).
    pub relative_port: u16,
}

impl Nexus {
    /// The SCSI target port name of target `target` through the portal group with tag `tpgt`
    /// (RFC 7143 SCSI target port names: `<target name>,t,0x<TPGT in hex>`); the portal
    /// group tag is the relative target port identifier.
    pub fn target_port_name(target: &str, tpgt: u16) -> String {
        format!("{target},t,0x{tpgt:04x}")
    }

    /// The SCSI target device name part of [`target_port`](Self::target_port).
    pub fn target_device(&self) -> &str {
        self.target_port
            .split(",t,")
            .next()
            .unwrap_or(&self.target_port)
    }
}

/// One SCSI command as delivered by the transport.
#[derive(Clone, Debug, Default)]
pub struct Command {
    /// The CDB as received (6..=260 bytes; iSCSI gives 16 plus any extended CDB AHS).
    pub cdb: Bytes,
    /// Data-Out the initiator sent (possibly empty).
    pub data_out: Bytes,
    /// iSCSI Expected Data Transfer Length for reads (informational; see the crate docs).
    pub expected_in_len: u32,
    /// The transport can send Data-In of at least `min` bytes straight from a file
    /// ([`DataIn::File`]), in the way `from` says; `None`: Data-In is always in memory.
    /// (iSCSI allows it when no data digest is computed over the bytes.)
    pub in_place: Option<ironsan_backend::InPlaceRead>,
}

/// A command's Data-In: bytes in memory, or a range of the backing file that the transport
/// sends from the page cache with no copy through user space (READ only, and only when the
/// [`Command`] allowed it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataIn {
    Memory(Bytes),
    File(ironsan_backend::FileRange),
}

impl Default for DataIn {
    fn default() -> Self {
        DataIn::Memory(Bytes::new())
    }
}

impl DataIn {
    pub fn len(&self) -> usize {
        match self {
            DataIn::Memory(b) => b.len(),
            DataIn::File(f) => f.len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Keep only the first `n` bytes.
    pub fn truncate(&mut self, n: usize) {
        match self {
            DataIn::Memory(b) => b.truncate(n),
            DataIn::File(f) => f.truncate(n),
        }
    }
    /// Split off the first `n` bytes (at most all) and return them; `self` keeps the rest.
    pub fn split_to(&mut self, n: usize) -> DataIn {
        match self {
            DataIn::Memory(b) => DataIn::Memory(b.split_to(n.min(b.len()))),
            DataIn::File(f) => DataIn::File(f.split_to(n)),
        }
    }
}

impl From<Bytes> for DataIn {
    fn from(b: Bytes) -> Self {
        DataIn::Memory(b)
    }
}

/// SCSI status byte (SAM-5 status codes).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Status(pub u8);

impl Status {
    pub const GOOD: Status = Status(0x00);
    pub const CHECK_CONDITION: Status = Status(0x02);
    pub const CONDITION_MET: Status = Status(0x04);
    pub const BUSY: Status = Status(0x08);
    pub const RESERVATION_CONFLICT: Status = Status(0x18);
    pub const TASK_SET_FULL: Status = Status(0x28);
    pub const ACA_ACTIVE: Status = Status(0x30);
    pub const TASK_ABORTED: Status = Status(0x40);
}

/// The outcome of a command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: Status,
    /// Data-In, never longer than the CDB's allocation or transfer length.
    pub data_in: DataIn,
    /// Fixed-format sense data (>= 18 bytes), present iff status is CHECK CONDITION.
    pub sense: Option<Bytes>,
}

impl Response {
    /// GOOD with `data_in`.
    pub fn good(data_in: impl Into<DataIn>) -> Self {
        Response {
            status: Status::GOOD,
            data_in: data_in.into(),
            sense: None,
        }
    }
    /// CHECK CONDITION with the sense data of `reason`.
    pub fn check_condition(reason: SenseReason) -> Self {
        Response {
            status: Status::CHECK_CONDITION,
            data_in: DataIn::default(),
            sense: Some(reason.to_fixed_sense()),
        }
    }
    /// A status without data or sense (BUSY, RESERVATION CONFLICT, TASK SET FULL, ...).
    pub fn status_only(status: Status) -> Self {
        Response {
            status,
            data_in: DataIn::default(),
            sense: None,
        }
    }
}

/// Highest LUN this target can address: 14-bit flat space addressing (SAM-5 LUN structure).
pub const MAX_LUN: u64 = 0x3FFF;

/// Encode a LUN as the 8-byte SAM LUN field (as a big-endian u64): peripheral device
/// addressing (00b) below 256, flat space addressing (01b) up to [`MAX_LUN`] (SAM-5 single level LUN structure).
pub fn lun_to_wire(lun: u64) -> u64 {
    if lun < 256 {
        lun << 48
    } else {
        (0x4000 | (lun & 0x3FFF)) << 48
    }
}

/// Decode the 8-byte SAM LUN field (big-endian u64) into a LUN number. Addressing methods other
/// than single-level peripheral (bus 0) and flat space return `None`, which the transport
/// should treat as an unsupported LUN.
pub fn lun_from_wire(raw: u64) -> Option<u64> {
    if raw & 0x0000_FFFF_FFFF_FFFF != 0 {
        return None; // second..fourth levels must be empty
    }
    let top = (raw >> 48) as u16;
    match top >> 14 {
        0b00 if top >> 8 == 0 => Some(u64::from(top & 0xFF)),
        0b01 => Some(u64::from(top & 0x3FFF)),
        _ => None,
    }
}

/// The LUN map of one SCSI target device, and the entry point for commands. Cheap to clone
/// (the LUs are shared): the server swaps in a changed copy to add or remove LUNs at run time.
#[derive(Default, Debug, Clone)]
pub struct Target {
    luns: BTreeMap<u64, Arc<LogicalUnit>>,
    /// Target port groups and their states, shared by every copy of this target.
    alua: Arc<Alua>,
}

impl Target {
    pub fn new() -> Self {
        Target::default()
    }

    /// Map `lu` at `lun` (replacing any previous mapping).
    ///
    /// # Panics
    /// If `lun > MAX_LUN`: it could not be reported by REPORT LUNS (config must validate).
    pub fn add_lun(&mut self, lun: u64, lu: Arc<LogicalUnit>) {
        assert!(lun <= MAX_LUN, "LUN {lun} exceeds {MAX_LUN}");
        self.luns.insert(lun, lu);
    }

    /// Use `alua` as this target's ALUA layout (shared with whoever else holds it).
    pub fn set_alua(&mut self, alua: Arc<Alua>) {
        self.alua = alua;
    }

    /// The ALUA layout: target port groups and their states.
    pub fn alua(&self) -> &Arc<Alua> {
        &self.alua
    }

    /// Replace the target port groups (a configuration change); `None`: one group per port,
    /// following the ports ([`follow_ports`](Self::follow_ports)). If any port's state
    /// changed, every I_T nexus of every LU gets ASYMMETRIC ACCESS STATE CHANGED.
    pub fn set_port_groups(&self, groups: Option<Vec<PortGroup>>) {
        let changed = match groups {
            Some(g) => self.alua.replace(g, true),
            None => self.alua.replace(Vec::new(), false),
        };
        if changed {
            self.access_changed(None);
        }
    }

    /// The target's ports are now the relative target ports `ports`: unless the groups were
    /// given ([`Alua::is_fixed`]), one group per port, identified by the port's number (a
    /// group that already existed keeps its state and PREF bit); with given groups, a port in
    /// none of them gets a group of its own.
    pub fn follow_ports(&self, ports: &[u16]) {
        if self.alua.follow(ports) {
            self.access_changed(None);
        }
    }

    /// An implicit transition of group `id` to `state` (SPC-4 §5.15.2.3). With `only_if`, only
    /// if the group's generation is still that (the end of a timed transition). Returns the
    /// group's new generation. A change of state raises ASYMMETRIC ACCESS STATE CHANGED on
    /// every I_T nexus of every LU.
    pub fn set_access_state(
        &self,
        id: u16,
        state: AccessState,
        only_if: Option<u64>,
    ) -> Result<u64, AluaError> {
        let (gen, changed) = self.alua.set(id, state, StatusCode::Implicit, only_if)?;
        if changed {
            self.access_changed(None);
        }
        Ok(gen)
    }

    fn access_changed(&self, except: Option<u64>) {
        for lu in self.luns.values() {
            lu.establish_unit_attention(UnitAttention::AsymmetricAccessStateChanged, except);
        }
    }

    /// SET TARGET PORT GROUPS (MAINTENANCE OUT, service action 0Ah; SPC-4 §6.44): the whole
    /// list is checked first, then applied; the other I_T nexuses get ASYMMETRIC ACCESS STATE
    /// CHANGED.
    fn set_target_port_groups(
        &self,
        nexus: &Nexus,
        cdb: Cdb<'_>,
        data: &[u8],
    ) -> Result<Bytes, SenseReason> {
        if cdb.u8(1) & 0x1F != MO_SET_TARGET_PGS {
            return Err(SenseReason::cdb_bit(1, 4));
        }
        let mut changed = false;
        for (id, state) in alua::parse_set_target_port_groups(&self.alua, cdb, data)? {
            // Checked above: the group exists.
            if let Ok((_, c)) = self.alua.set(id, state, StatusCode::Explicit, None) {
                changed |= c;
            }
        }
        if changed {
            self.access_changed(Some(nexus.id));
        }
        Ok(Bytes::new())
    }

    /// Unmap `lun`; returns the LU that was there. Commands holding the LU finish.
    pub fn remove_lun(&mut self, lun: u64) -> Option<Arc<LogicalUnit>> {
        self.luns.remove(&lun)
    }

    /// REPORTED LUNS DATA HAS CHANGED (3Fh/0Eh) for every I_T nexus of every LU (SPC-4
    /// §5.13.10: after LUNs were added or removed). REPORT LUNS clears it.
    pub fn luns_changed(&self) {
        for lu in self.luns.values() {
            lu.establish_unit_attention(UnitAttention::ReportedLunsDataChanged, None);
        }
    }

    pub fn lun(&self, lun: u64) -> Option<&Arc<LogicalUnit>> {
        self.luns.get(&lun)
    }

    /// All LUNs, ascending.
    pub fn luns(&self) -> impl Iterator<Item = (u64, &Arc<LogicalUnit>)> {
        self.luns.iter().map(|(k, v)| (*k, v))
    }

    /// The I_T nexus is gone (session closed or reinstated): drop its unit attention queues,
    /// reservations and medium-removal prevention on every LU.
    pub fn nexus_lost(&self, nexus_id: u64) {
        for lu in self.luns.values() {
            lu.nexus_lost(nexus_id);
        }
    }

    /// Whether writes to `lun` may ever be placed ([`place_write`](Self::place_write)): the
    /// transport then prepares no buffer for a large write's data before asking.
    pub fn can_place_writes(&self, lun: u64) -> bool {
        self.luns
            .get(&lun)
            .is_some_and(|lu| lu.backend().can_write_in_place())
    }

    /// Begin a WRITE whose `data_len` bytes of Data-Out the transport will receive straight
    /// into the medium: every check [`execute`](Self::execute) would make of it (unit
    /// attention, CDB, reservations, write protect, range) is made now, before the data, and
    /// its blocks are locked. `None` when any check fails, a reservation exists, the blocks
    /// are locked by another command, the data would not cover the transfer exactly, or the
    /// backend cannot take bytes in place: the command then goes through `execute` with its
    /// data as usual, which reports any failure. With `Some`, the transport receives the data
    /// into [`PlacedWrite::target`] and completes the command with [`PlacedWrite::finish`],
    /// not `execute`: the command has begun, so a unit attention established meanwhile is
    /// reported to the next command (SAM-5).
    pub fn place_write(
        &self,
        lun: u64,
        nexus: &Nexus,
        cdb: &[u8],
        data_len: u32,
    ) -> Option<PlacedWrite> {
        let lu = self.luns.get(&lun)?;
        let c = Cdb(cdb);
        if cdb.is_empty() {
            return None;
        }
        validate_cdb(c).ok()?;
        sbc::place_write(lu, c, data_len, || {
            self.alua.is_active(nexus.relative_port)
                && lu.nothing_to_report(nexus.id)
                && lock(&lu.reservation).is_none()
                && !lock(&lu.pr).reserved()
        })
    }

    /// Execute one command addressed to `lun` over `nexus`. Never panics on any CDB or data.
    pub async fn execute(&self, lun: u64, nexus: &Nexus, cmd: Command) -> Response {
        match self.execute_inner(lun, nexus, cmd).await {
            Ok(r) => r,
            Err(reason) => Response::check_condition(reason),
        }
    }

    async fn execute_inner(
        &self,
        lun: u64,
        nexus: &Nexus,
        mut cmd: Command,
    ) -> Result<Response, SenseReason> {
        let cdb = Cdb(&cmd.cdb);
        if cmd.cdb.is_empty() {
            return Err(SenseReason::CdbTooShort);
        }
        let op = cdb.op();
        let Some(lu) = self.luns.get(&lun) else {
            return self.execute_without_lu(cdb).map(Response::good);
        };
        // SAM-5 unit attention condition: a pending unit attention terminates the next command,
        // except INQUIRY, REPORT LUNS and REQUEST SENSE (which reports it as data).
        let reports_ua = !matches!(op, INQUIRY | REPORT_LUNS | REQUEST_SENSE);
        if let Some(ua) = lu.register_nexus(nexus, reports_ua) {
            return Err(SenseReason::UnitAttention(ua));
        }
        validate_cdb(cdb)?;
        // ALUA: the state of the group of the port the command came through.
        alua::check(self.alua.state(nexus.relative_port), cdb)?;

        // SPC-2 reservations (RESERVE/RELEASE): another nexus's reservation conflicts with all but
        // the commands in `spc::allowed_under_reservation`.
        if let Some(holder) = *lock(&lu.reservation) {
            if holder != nexus.id && !spc::allowed_under_reservation(cdb) {
                return Ok(Response::status_only(Status::RESERVATION_CONFLICT));
            }
        }
        // SPC-4 persistent reservations: the opcode table says how each command behaves.
        // (Only when a reservation exists: most commands meet none.)
        let conflict = {
            let pr = lock(&lu.pr);
            pr.reserved() && pr.conflicts(&pr::PortPair::of(nexus), spc::pr_access(cdb))
        };
        if conflict {
            return Ok(Response::status_only(Status::RESERVATION_CONFLICT));
        }
        // An LU other nodes write too: a command that may change the medium starts only
        // when the cluster admits it, and holds its token until it ends (ClusterLu).
        let _write_token = match &lu.config().cluster {
            Some(c) if cdb::changes_medium(&cmd.cdb) => match c.0.begin_write() {
                WriteAdmission::Go(t) => Some(t),
                WriteAdmission::Refused(r) => return Err(r),
                WriteAdmission::Wait(f) => Some(f.await?),
            },
            _ => None,
        };

        let data = match op {
            op if spc::not_offered(lu.config(), op) => Err(SenseReason::InvalidOpcode),
            TEST_UNIT_READY => Ok(Bytes::new()),
            REQUEST_SENSE => spc::request_sense(lu, nexus, cdb),
            INQUIRY => spc::inquiry(lu, &self.alua, nexus, cdb),
            REPORT_LUNS => {
                let d = spc::report_luns(self, cdb)?;
                lu.clear_unit_attention(nexus.id, UnitAttention::ReportedLunsDataChanged);
                Ok(d)
            }
            MODE_SENSE_6 | MODE_SENSE_10 => mode::mode_sense(lu, cdb),
            MODE_SELECT_6 | MODE_SELECT_10 => {
                mode::mode_select(lu, nexus, cdb, &cmd.data_out).await
            }
            RESERVE_6 | RESERVE_10 => match spc::reserve(lu, nexus, cdb)? {
                true => Ok(Bytes::new()),
                false => return Ok(Response::status_only(Status::RESERVATION_CONFLICT)),
            },
            RELEASE_6 | RELEASE_10 => spc::release(lu, nexus, cdb),
            MAINTENANCE_IN => match cdb.u8(1) & 0x1F {
                MI_REPORT_TARGET_PGS => alua::report_target_port_groups(&self.alua, cdb),
                _ => spc::report_supported_opcodes(cdb, lu.config()),
            },
            MAINTENANCE_OUT => self.set_target_port_groups(nexus, cdb, &cmd.data_out),
            PERSISTENT_RESERVE_IN => pr::persistent_reserve_in(lu, cdb),
            PERSISTENT_RESERVE_OUT => {
                let out = match &lu.config().cluster {
                    Some(store) => {
                        let ports = self.alua.groups().into_iter().flat_map(|g| g.ports);
                        let ports = ports.collect();
                        let data = &cmd.data_out;
                        pr::persistent_reserve_out_shared(lu, store, nexus, &cmd.cdb, data, ports)
                            .await?
                    }
                    None => {
                        let port_exists = |p: u16| self.alua.group_of(p).is_some();
                        pr::persistent_reserve_out(lu, nexus, cdb, &cmd.data_out, &port_exists)?
                    }
                };
                match out {
                    pr::ProutOutcome::Good => Ok(Bytes::new()),
                    pr::ProutOutcome::Conflict => {
                        return Ok(Response::status_only(Status::RESERVATION_CONFLICT))
                    }
                }
            }
            PREVENT_ALLOW_MEDIUM_REMOVAL => spc::prevent_allow(lu, nexus, cdb),
            START_STOP_UNIT => sbc::start_stop_unit(lu, nexus, cdb).await,
            READ_CAPACITY_10 => sbc::read_capacity_10(lu, cdb),
            SERVICE_ACTION_IN_16 => match cdb.u8(1) & 0x1F {
                SAI_READ_CAPACITY_16 => sbc::read_capacity_16(lu, cdb),
                SAI_GET_LBA_STATUS => sbc::get_lba_status(lu, cdb).await,
                _ => Err(SenseReason::cdb_bit(1, 4)),
            },
            READ_6 | READ_10 | READ_12 | READ_16 => {
                return sbc::read(lu, cdb, cmd.in_place).await.map(Response::good);
            }
            WRITE_6 | WRITE_10 | WRITE_12 | WRITE_16 => {
                // The data goes down by value: a backend may keep the buffer (RAM adopts
                // whole chunks) instead of copying it.
                sbc::write(lu, cdb, std::mem::take(&mut cmd.data_out)).await
            }
            WRITE_AND_VERIFY_10 | WRITE_AND_VERIFY_12 | WRITE_AND_VERIFY_16 => {
                sbc::write_and_verify(lu, cdb, &cmd.data_out).await
            }
            VERIFY_10 | VERIFY_12 | VERIFY_16 => sbc::verify(lu, cdb, &cmd.data_out).await,
            SYNCHRONIZE_CACHE_10 | SYNCHRONIZE_CACHE_16 => sbc::synchronize_cache(lu, cdb).await,
            WRITE_SAME_10 | WRITE_SAME_16 => sbc::write_same(lu, cdb, &cmd.data_out).await,
            UNMAP => sbc::unmap(lu, cdb, &cmd.data_out).await,
            COMPARE_AND_WRITE => sbc::compare_and_write(lu, cdb, &cmd.data_out).await,
            ORWRITE_16 => sbc::orwrite(lu, cdb, &cmd.data_out).await,
            PRE_FETCH_10 | PRE_FETCH_16 => {
                return Ok(if sbc::pre_fetch(lu, cdb)? {
                    Response::status_only(Status::CONDITION_MET)
                } else {
                    Response::good(Bytes::new())
                });
            }
            READ_DEFECT_DATA_10 | READ_DEFECT_DATA_12 => sbc::read_defect_data(cdb),
            SANITIZE => sbc::sanitize(lu, cdb).await,
            EXTENDED_COPY => {
                return Ok(
                    match xcopy::extended_copy(self, lu, nexus, cdb, &cmd.data_out).await? {
                        xcopy::Outcome::Good => Response::good(Bytes::new()),
                        xcopy::Outcome::ReservationConflict => {
                            Response::status_only(Status::RESERVATION_CONFLICT)
                        }
                        xcopy::Outcome::Busy => Response::status_only(Status::BUSY),
                    },
                );
            }
            RECEIVE_COPY_RESULTS => xcopy::receive_copy_results(lu, nexus, cdb),
            _ => Err(SenseReason::InvalidOpcode),
        }?;
        Ok(Response::good(data))
    }

    /// Commands addressed to a LUN with no logical unit (SPC-4 INQUIRY, REPORT LUNS, REQUEST SENSE).
    fn execute_without_lu(&self, cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
        match cdb.op() {
            INQUIRY => {
                validate_cdb(cdb)?;
                spc::inquiry_no_lu(cdb)
            }
            REPORT_LUNS => {
                validate_cdb(cdb)?;
                spc::report_luns(self, cdb)
            }
            REQUEST_SENSE => {
                validate_cdb(cdb)?;
                spc::request_sense_data(cdb, SenseReason::LogicalUnitNotSupported)
            }
            _ => Err(SenseReason::LogicalUnitNotSupported),
        }
    }
}

/// Whether `op` is implemented (the dispatcher's and REPORT SUPPORTED OPERATION CODES' list).
pub(crate) fn is_supported(op: u8) -> bool {
    spc::SUPPORTED.iter().any(|c| c.op == op)
}

/// Checks common to every CDB: known operation code, full length, CONTROL byte.
fn validate_cdb(cdb: Cdb<'_>) -> Result<(), SenseReason> {
    let op = cdb.op();
    if !is_supported(op) {
        return Err(SenseReason::InvalidOpcode);
    }
    let need = cdb::cdb_length(op).ok_or(SenseReason::InvalidOpcode)?;
    if cdb.0.len() < need {
        return Err(SenseReason::CdbTooShort);
    }
    // SAM-5 CONTROL byte: NACA=1 needs NormACA support (we report NormACA=0); LINK is
    // obsolete and linked commands are not supported.
    let ctrl = cdb.control_offset();
    if cdb.bit(ctrl, 2) {
        return Err(SenseReason::cdb_bit(ctrl as u16, 2));
    }
    if cdb.bit(ctrl, 0) {
        return Err(SenseReason::cdb_bit(ctrl as u16, 0));
    }
    Ok(())
}
