//! Asymmetric logical unit access (ALUA, SPC-4 §5.15): target port groups, their access
//! states, what each state refuses, REPORT TARGET PORT GROUPS and SET TARGET PORT GROUPS.
//!
//! * A target port is identified by its RELATIVE TARGET PORT IDENTIFIER ([`Nexus::relative_port`]);
//!   target ports belong to target port groups ([`PortGroup`]), each with one
//!   [`AccessState`] that applies to every logical unit of the [`crate::Target`] (ironsan keeps
//!   one ALUA layout per SCSI target device, not one per LU).
//! * INQUIRY reports TPGS=11b (implicit and explicit ALUA); VPD 83h carries the relative target
//!   port and target port group designators of the port a command came through.
//! * The state of the group of the port a command came through decides whether it runs
//!   ([`check`]); refused commands get NOT READY, LOGICAL UNIT NOT ACCESSIBLE with the ASCQ of
//!   the state ([`crate::SenseReason::NotAccessible`]).
//! * A change of state establishes ASYMMETRIC ACCESS STATE CHANGED (2Ah/06h) for every I_T
//!   nexus of every LU (but the one that sent the SET TARGET PORT GROUPS that made it).
//!
//! Nothing here keeps time: an implicit transition with a duration is driven by the caller
//! (set [`AccessState::Transitioning`], wait, set the final state if the group's
//! [`PortGroup::generation`] is unchanged).

use crate::cdb::{opcode::*, Cdb};
use crate::sense::SenseReason;
use crate::spc::truncate;
use crate::Nexus;
use bytes::Bytes;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::RwLock;

/// ASYMMETRIC ACCESS STATE (SPC-4 target port group descriptor). LBA-dependent is not offered.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub enum AccessState {
    #[default]
    ActiveOptimized,
    ActiveNonOptimized,
    Standby,
    Unavailable,
    Offline,
    Transitioning,
}

impl AccessState {
    /// Every state, in the order of their codes.
    pub const ALL: [AccessState; 6] = [
        AccessState::ActiveOptimized,
        AccessState::ActiveNonOptimized,
        AccessState::Standby,
        AccessState::Unavailable,
        AccessState::Offline,
        AccessState::Transitioning,
    ];

    /// The 4-bit code (SPC-4 ASYMMETRIC ACCESS STATE field).
    pub fn code(self) -> u8 {
        match self {
            AccessState::ActiveOptimized => 0x0,
            AccessState::ActiveNonOptimized => 0x1,
            AccessState::Standby => 0x2,
            AccessState::Unavailable => 0x3,
            AccessState::Offline => 0xE,
            AccessState::Transitioning => 0xF,
        }
    }

    /// The name used in the configuration file, `ironsan ctl` and the metrics.
    pub fn name(self) -> &'static str {
        match self {
            AccessState::ActiveOptimized => "active/optimized",
            AccessState::ActiveNonOptimized => "active/non-optimized",
            AccessState::Standby => "standby",
            AccessState::Unavailable => "unavailable",
            AccessState::Offline => "offline",
            AccessState::Transitioning => "transitioning",
        }
    }

    /// Parse a [`name`](Self::name) (also `optimized`, `non-optimized`, `ao`, `ano`).
    pub fn parse(s: &str) -> Option<AccessState> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "active/optimized" | "optimized" | "ao" => AccessState::ActiveOptimized,
            "active/non-optimized" | "non-optimized" | "ano" => AccessState::ActiveNonOptimized,
            "standby" => AccessState::Standby,
            "unavailable" => AccessState::Unavailable,
            "offline" => AccessState::Offline,
            "transitioning" => AccessState::Transitioning,
            _ => return None,
        })
    }

    /// Active/optimized or active/non-optimized: every command is processed.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            AccessState::ActiveOptimized | AccessState::ActiveNonOptimized
        )
    }

    /// The ASCQ of NOT READY, LOGICAL UNIT NOT ACCESSIBLE (ASC 04h) for commands this state
    /// refuses: 0Ah transitioning, 0Bh standby, 0Ch unavailable, 12h offline (SPC-4 ASC and
    /// ASCQ assignments).
    pub fn refusal_ascq(self) -> u8 {
        match self {
            AccessState::Transitioning => 0x0A,
            AccessState::Standby => 0x0B,
            AccessState::Offline => 0x12,
            _ => 0x0C,
        }
    }
}

impl std::fmt::Display for AccessState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a group's state last changed (SPC-4 target port group descriptor STATUS CODE).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum StatusCode {
    /// 00h: no status available (as configured).
    #[default]
    None,
    /// 01h: altered by SET TARGET PORT GROUPS.
    Explicit,
    /// 02h: altered by the target (an implicit transition: `ironsan ctl`, a configuration change).
    Implicit,
}

impl StatusCode {
    fn code(self) -> u8 {
        match self {
            StatusCode::None => 0,
            StatusCode::Explicit => 1,
            StatusCode::Implicit => 2,
        }
    }
}

/// One target port group (SPC-4 §5.15.2.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortGroup {
    /// TARGET PORT GROUP identifier.
    pub id: u16,
    /// The RELATIVE TARGET PORT IDENTIFIERs of its ports.
    pub ports: Vec<u16>,
    pub state: AccessState,
    /// PREF: the preferred group to send commands to (multipath adds to its priority).
    pub preferred: bool,
    pub status: StatusCode,
    /// Counts the group's state changes (a delayed end of a transition applies only if no
    /// other change came in between).
    pub generation: u64,
}

impl PortGroup {
    /// A group of `ports`, active/optimized, not preferred.
    pub fn new(id: u16, ports: Vec<u16>) -> Self {
        PortGroup {
            id,
            ports,
            state: AccessState::ActiveOptimized,
            preferred: false,
            status: StatusCode::None,
            generation: 0,
        }
    }
}

/// The ALUA layout of one SCSI target device: its target port groups and their states. Read
/// on every command: while every group is active (the usual case) that costs one atomic load.
#[derive(Debug, Default)]
pub struct Alua {
    /// Some group is in a state other than active (false: every command passes unchecked).
    any_inactive: AtomicBool,
    groups: RwLock<Vec<PortGroup>>,
    transition_secs: AtomicU8,
    /// The groups were given (configuration): they do not follow the target's portal groups.
    fixed: AtomicBool,
    /// Source of [`PortGroup::generation`]s: never reset, so a generation taken before the
    /// layout was replaced can never match a group made afterwards.
    generations: AtomicU64,
}

/// A change that could not be made: what was wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AluaError {
    #[error("no target port group {0}")]
    NoSuchGroup(u16),
    #[error("a group may be set to active/optimized, active/non-optimized, standby, unavailable, offline or (with a duration) transitioning")]
    StateNotAllowed,
    #[error("the change was overtaken by another one")]
    Overtaken,
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}
fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

impl Alua {
    /// A layout with `groups` (ports in no group are served as active/optimized).
    pub fn new(groups: Vec<PortGroup>) -> Self {
        let a = Alua::default();
        a.replace(groups, true);
        a
    }

    /// Replace the whole layout; returns whether any port's state changed.
    pub(crate) fn replace(&self, groups: Vec<PortGroup>, fixed: bool) -> bool {
        let mut g = write(&self.groups);
        self.fixed.store(fixed, Ordering::Relaxed);
        let old = std::mem::replace(&mut *g, groups);
        self.note_states(&g);
        any_port_changed(&old, &g)
    }

    fn note_states(&self, groups: &[PortGroup]) {
        self.any_inactive.store(
            groups.iter().any(|x| !x.state.is_active()),
            Ordering::Release,
        );
    }

    /// Whether the groups were given by configuration (else one group per portal group, each
    /// with the portal group's tag as its identifier and its one port, following the target's
    /// portal groups: [`crate::Target::follow_ports`]).
    pub fn is_fixed(&self) -> bool {
        self.fixed.load(Ordering::Relaxed)
    }

    /// A snapshot of the groups.
    pub fn groups(&self) -> Vec<PortGroup> {
        read(&self.groups).clone()
    }

    /// The group of relative target port `port`, if it is in one.
    pub fn group_of(&self, port: u16) -> Option<PortGroup> {
        read(&self.groups)
            .iter()
            .find(|g| g.ports.contains(&port))
            .cloned()
    }

    /// The state commands through `port` meet.
    pub fn state(&self, port: u16) -> AccessState {
        if !self.any_inactive.load(Ordering::Acquire) {
            return AccessState::ActiveOptimized;
        }
        state_of(&read(&self.groups), port)
    }

    /// Whether commands through `port` reach the medium (the port's group is active).
    pub fn is_active(&self, port: u16) -> bool {
        self.state(port).is_active()
    }

    /// IMPLICIT TRANSITION TIME reported by REPORT TARGET PORT GROUPS (seconds, 0: unspecified).
    pub fn set_transition_time(&self, secs: u8) {
        self.transition_secs.store(secs, Ordering::Relaxed);
    }

    /// An implicit transition of `secs` seconds was started: the IMPLICIT TRANSITION TIME
    /// reported is the longest so far (at most 255), which initiators use as the time to
    /// wait for a transitioning group (Linux's scsi_dh_alua: its transition timeout).
    pub fn note_transition(&self, secs: u64) {
        let s = u8::try_from(secs).unwrap_or(u8::MAX);
        self.transition_secs.fetch_max(s, Ordering::Relaxed);
    }

    /// Set group `id` to `state`. With `only_if`, only if the group's generation is still that
    /// (the end of a transition). Returns the group's new generation and whether its state
    /// changed.
    pub(crate) fn set(
        &self,
        id: u16,
        state: AccessState,
        status: StatusCode,
        only_if: Option<u64>,
    ) -> Result<(u64, bool), AluaError> {
        let mut g = write(&self.groups);
        let grp = g
            .iter_mut()
            .find(|x| x.id == id)
            .ok_or(AluaError::NoSuchGroup(id))?;
        if only_if.is_some_and(|gen| gen != grp.generation) {
            return Err(AluaError::Overtaken);
        }
        let changed = grp.state != state;
        grp.state = state;
        grp.status = status;
        let gen = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        grp.generation = gen;
        self.note_states(&g);
        Ok((gen, changed))
    }

    /// The target's ports are now `ports`, in one step under the layout's lock (a state set
    /// meanwhile is never undone). Not configured: one group per port, identified by the
    /// port's number, keeping the state and PREF bit of a group that remains. Configured: the
    /// groups stay, and a port in none of them gets a group of its own (its number as the
    /// identifier, when free), so that every port reports a target port group. Returns
    /// whether any port's state changed.
    pub(crate) fn follow(&self, ports: &[u16]) -> bool {
        let mut g = write(&self.groups);
        let old = g.clone();
        if self.fixed.load(Ordering::Relaxed) {
            for &p in ports {
                if !g.iter().any(|x| x.ports.contains(&p)) && !g.iter().any(|x| x.id == p) {
                    g.push(PortGroup::new(p, vec![p]));
                }
            }
        } else {
            *g = ports
                .iter()
                .map(|&p| {
                    let mut x = old
                        .iter()
                        .find(|x| x.id == p)
                        .cloned()
                        .unwrap_or_else(|| PortGroup::new(p, Vec::new()));
                    x.ports = vec![p];
                    x
                })
                .collect();
        }
        self.note_states(&g);
        any_port_changed(&old, &g)
    }

    /// Set the PREF bit of group `id`.
    pub fn set_preferred(&self, id: u16, preferred: bool) -> Result<(), AluaError> {
        let mut g = write(&self.groups);
        let grp = g
            .iter_mut()
            .find(|x| x.id == id)
            .ok_or(AluaError::NoSuchGroup(id))?;
        grp.preferred = preferred;
        Ok(())
    }

    /// The target port group designator value for VPD 83h (type 5), if `port` is in a group.
    pub(crate) fn group_id_of(&self, port: u16) -> Option<u16> {
        self.group_of(port).map(|g| g.id)
    }
}

/// Whether any port of either layout meets another state in `new` than in `old`.
fn any_port_changed(old: &[PortGroup], new: &[PortGroup]) -> bool {
    old.iter()
        .chain(new)
        .flat_map(|x| x.ports.iter())
        .any(|p| state_of(old, *p) != state_of(new, *p))
}

fn state_of(groups: &[PortGroup], port: u16) -> AccessState {
    groups
        .iter()
        .find(|g| g.ports.contains(&port))
        .map_or(AccessState::ActiveOptimized, |g| g.state)
}

/// Whether a command may run through a port in `state` (SPC-4 §5.15.2.4: the commands the
/// standby, unavailable, offline and transitioning states still process); the refusal is NOT
/// READY, LOGICAL UNIT NOT ACCESSIBLE with the state's ASCQ.
pub(crate) fn check(state: AccessState, cdb: Cdb<'_>) -> Result<(), SenseReason> {
    if state.is_active() {
        return Ok(());
    }
    let op = cdb.op();
    let sa = cdb.u8(1) & 0x1F;
    // Processed in every state: the commands that tell the initiator where it stands.
    let always = matches!(op, INQUIRY | REPORT_LUNS | REQUEST_SENSE)
        || (op == MAINTENANCE_IN && sa == MI_REPORT_TARGET_PGS);
    let allowed = always
        || match state {
            AccessState::Standby => {
                matches!(
                    op,
                    MODE_SENSE_6
                        | MODE_SENSE_10
                        | MODE_SELECT_6
                        | MODE_SELECT_10
                        | PERSISTENT_RESERVE_IN
                        | PERSISTENT_RESERVE_OUT
                        | READ_CAPACITY_10
                ) || (op == SERVICE_ACTION_IN_16 && sa == SAI_READ_CAPACITY_16)
                    || (op == MAINTENANCE_OUT && sa == MO_SET_TARGET_PGS)
            }
            AccessState::Unavailable => op == MAINTENANCE_OUT && sa == MO_SET_TARGET_PGS,
            _ => false,
        };
    if allowed {
        Ok(())
    } else {
        Err(SenseReason::NotAccessible(state))
    }
}

/// REPORT TARGET PORT GROUPS (MAINTENANCE IN, service action 0Ah; SPC-4 §6.36): every group
/// with its state, whichever port asks; length-only (000b) or extended header (001b) format.
pub(crate) fn report_target_port_groups(alua: &Alua, cdb: Cdb<'_>) -> Result<Bytes, SenseReason> {
    let format = cdb.u8(1) >> 5;
    if format > 1 {
        return Err(SenseReason::cdb_bit(1, 7));
    }
    let alloc = cdb.u32(6) as usize;
    let groups = read(&alua.groups);
    let mut d = vec![0u8; 4];
    if format == 1 {
        // FORMAT TYPE 001b, IMPLICIT TRANSITION TIME.
        d.extend_from_slice(&[0x10, alua.transition_secs.load(Ordering::Relaxed), 0, 0]);
    }
    for g in groups.iter() {
        d.push(u8::from(g.preferred) << 7 | g.state.code());
        // T_SUP, O_SUP, U_SUP, S_SUP, AN_SUP, AO_SUP (no LBD_SUP).
        d.push(0xCF);
        d.extend_from_slice(&g.id.to_be_bytes());
        d.push(0);
        d.push(g.status.code());
        d.push(0);
        let ports = &g.ports[..g.ports.len().min(255)];
        d.push(ports.len() as u8);
        for p in ports {
            d.extend_from_slice(&[0, 0]);
            d.extend_from_slice(&p.to_be_bytes());
        }
    }
    let len = (d.len() - 4) as u32;
    d[0..4].copy_from_slice(&len.to_be_bytes());
    Ok(truncate(d, alloc))
}

/// A SET TARGET PORT GROUPS parameter list, checked whole before anything changes (SPC-4
/// §6.44): `(group, state)` per descriptor.
pub(crate) fn parse_set_target_port_groups(
    alua: &Alua,
    cdb: Cdb<'_>,
    data: &[u8],
) -> Result<Vec<(u16, AccessState)>, SenseReason> {
    let len = cdb.u32(6) as usize;
    if len == 0 {
        return Ok(Vec::new());
    }
    if len < 4 || !(len - 4).is_multiple_of(4) || data.len() < len {
        return Err(SenseReason::ParameterListLengthError);
    }
    let groups = read(&alua.groups);
    let mut out = Vec::new();
    for o in (4..len).step_by(4) {
        let code = data.get(o).copied().unwrap_or(0) & 0x0F;
        let state = match code {
            0x0 => AccessState::ActiveOptimized,
            0x1 => AccessState::ActiveNonOptimized,
            0x2 => AccessState::Standby,
            0x3 => AccessState::Unavailable,
            // LBA dependent, offline, transitioning and reserved codes cannot be asked for.
            _ => return Err(SenseReason::param(o, Some(3))),
        };
        let id = u16::from_be_bytes([
            data.get(o + 2).copied().unwrap_or(0),
            data.get(o + 3).copied().unwrap_or(0),
        ]);
        if !groups.iter().any(|g| g.id == id) {
            return Err(SenseReason::param(o + 2, None));
        }
        out.push((id, state));
    }
    Ok(out)
}

/// The VPD 83h target port group designator value (type 5) for `nexus`'s port.
pub(crate) fn port_group_designator(alua: &Alua, nexus: &Nexus) -> Option<[u8; 4]> {
    alua.group_id_of(nexus.relative_port).map(|id| {
        let mut v = [0u8; 4];
        v[2..4].copy_from_slice(&id.to_be_bytes());
        v
    })
}
