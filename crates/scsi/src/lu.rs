//! One logical unit: configuration, mode state (WCE), per-I_T-nexus unit attention queues,
//! SPC-2 reservation and the write range lock that makes COMPARE AND WRITE atomic.

use crate::pr::{PortPair, PrState};
use crate::sense::UnitAttention;
use crate::Nexus;
use ironsan_backend::BlockDevice;
use ironsan_backend::IntMap;
use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

/// Static configuration of a logical unit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LuConfig {
    /// Logical block size in bytes: 512 or 4096 (any power of two in 512..=65536 is accepted).
    pub block_size: u32,
    /// Physical block size in bytes reported to initiators (READ CAPACITY (16) LOGICAL BLOCKS
    /// PER PHYSICAL BLOCK EXPONENT; Block Limits optimal granularities). 0 (the default), or a
    /// value that is not a power of two larger than `block_size`, means "same as the logical
    /// block". 4096 with 512-byte blocks is the 512e layout: initiators align to 4 KiB (Linux
    /// reports physical_block_size 4096), which saves the page cache a read-modify-write for
    /// partial pages. A backend that needs a larger alignment (O_DIRECT) raises it.
    /// Not the default because libiscsi's GetLBAStatus.UnmapSingle cannot pass with
    /// LBPPB > 1 (see docs/ARCHITECTURE.md).
    pub physical_block_size: u32,
    /// Refuse writes with DATA PROTECT / WRITE PROTECTED; MODE SENSE reports WP=1.
    pub read_only: bool,
    /// Initial (and default) value of WCE in the caching mode page.
    pub write_cache: bool,
    /// Unit serial number (VPD 80h); printable ASCII, at most 64 bytes are used. When empty,
    /// the NAA identifier in hex is used.
    pub serial: String,
    /// The LU's NAA designator (VPD 83h), used as the 8-byte NAA identifier verbatim when its
    /// top nibble is a valid 8-byte NAA format (2h IEEE extended, 3h locally assigned, 5h IEEE
    /// registered). Any other top nibble is replaced by 3h (locally assigned), which keeps the
    /// identifier well formed; [`local_naa`] makes one from a name.
    pub naa: u64,
    /// T10 VENDOR IDENTIFICATION (8 ASCII bytes, space padded); "IRONSAN" when empty.
    pub vendor: String,
    /// PRODUCT IDENTIFICATION (16 ASCII bytes, space padded).
    pub product: String,
    /// PRODUCT REVISION LEVEL (4 ASCII bytes, space padded).
    pub revision: String,
    /// Directory for this LU's persistent state (one directory per LU, created if missing).
    /// Persistent reservations with APTPL=1 are kept in `<state_dir>/pr-state` and reloaded
    /// by [`LogicalUnit::new`]. `None` (the default): APTPL=1 is refused with INVALID FIELD
    /// IN PARAMETER LIST and REPORT CAPABILITIES reports PTPL_C=0.
    pub state_dir: Option<PathBuf>,
    /// The backing store is written by other, independent nodes too (an RBD image served
    /// with `shared` by several gateways), so nothing that is atomic or enforced only inside
    /// this process is offered:
    /// - PERSISTENT RESERVE IN/OUT are not supported (INVALID COMMAND OPERATION CODE; REPORT
    ///   SUPPORTED OPERATION CODES leaves them out): a reservation made through one node
    ///   would not hold on the others;
    /// - COMPARE AND WRITE only where the backing store compares and writes atomically itself
    ///   (`BlockDevice::can_compare_and_write`), else INVALID FIELD IN CDB; Block Limits
    ///   reports that length;
    /// - ORWRITE (a read-modify-write under a range lock of this process) is not supported.
    pub shared: bool,
    /// A `shared` LU served by a cluster of nodes: its persistent reservations live in the
    /// cluster (then PERSISTENT RESERVE IN/OUT are offered) and its resets reach every node;
    /// see [`ClusterLu`].
    pub cluster: Option<ClusterLuHandle>,
}

/// What a PERSISTENT RESERVE OUT does to the shared record (`None`: no record yet): the new
/// record, or `None` to leave it as it is.
pub type PrChange = Box<dyn FnMut(Option<&str>) -> Option<String> + Send>;

/// The result of a [`ClusterLu`] call.
pub type ClusterFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An LU that several nodes serve (the server's cluster agent implements it on RADOS):
/// where its persistent-reservation state lives, and how its other nodes hear of what
/// concerns every I_T nexus. The reservation record is opaque text made and read by this
/// crate; the store only keeps it, versions it and hands it to every node
/// ([`LogicalUnit::apply_shared_pr`]).
pub trait ClusterLu: Send + Sync + std::fmt::Debug {
    /// Read the LU's record, pass it to `change`, and if that returns a new record write it
    /// with compare-and-set (calling `change` again on the newer record if another node wrote
    /// first). Resolves once every node has applied the written record or has been fenced
    /// from the cluster, with the record written (`None`: nothing was written).
    fn update_pr(&self, change: PrChange) -> ClusterFuture<'_, Result<Option<String>, String>>;

    /// A LOGICAL UNIT RESET happened on this node: the other nodes abort their tasks on the
    /// LU and establish POWER ON, RESET, OR BUS DEVICE RESET OCCURRED for their I_T nexuses
    /// ([`LogicalUnit::reset`]). Resolves once they have, or after the cluster's timeout.
    fn reset(&self) -> ClusterFuture<'_, ()>;

    /// A command that may change the medium is about to start on this node (called after
    /// the ALUA and reservation checks, before the command touches the LU). The cluster
    /// admits it only while this node's lease holds and every other node is either known to
    /// be alive or fenced (so no write another node was given earlier and never answered
    /// can land after this one); it may have to wait for a node to be fenced. The token it
    /// gives is held until the command ends: while a token (or a write range the device
    /// still holds, [`LogicalUnit::oldest_write`]) is older than the cluster's lease, the
    /// node stops renewing its lease, so that the others fence it.
    fn begin_write(&self) -> WriteAdmission;
}

/// What [`ClusterLu::begin_write`] decides.
pub enum WriteAdmission {
    /// Run the command, holding the token until it ends.
    Go(WriteToken),
    /// Refuse it with this sense (e.g. NOT READY, TARGET PORT IN UNAVAILABLE STATE while the
    /// node's lease has lapsed).
    Refused(crate::SenseReason),
    /// Wait (bounded) for the cluster's write gate; resolves to `Go` or `Refused` as above.
    Wait(ClusterFuture<'static, Result<WriteToken, crate::SenseReason>>),
}

impl std::fmt::Debug for WriteAdmission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteAdmission::Go(_) => f.write_str("Go"),
            WriteAdmission::Refused(r) => write!(f, "Refused({r:?})"),
            WriteAdmission::Wait(_) => f.write_str("Wait"),
        }
    }
}

/// Held by a command that may change a cluster LU's medium, for as long as it runs
/// ([`ClusterLu::begin_write`]); what it holds is the cluster's.
pub struct WriteToken(pub Box<dyn Send + Sync>);

impl std::fmt::Debug for WriteToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WriteToken")
    }
}

/// A [`ClusterLu`] in an [`LuConfig`] (two are equal when they are the same store).
#[derive(Clone)]
pub struct ClusterLuHandle(pub Arc<dyn ClusterLu>);

impl std::fmt::Debug for ClusterLuHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}
impl PartialEq for ClusterLuHandle {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for ClusterLuHandle {}

impl Default for LuConfig {
    fn default() -> Self {
        LuConfig {
            block_size: 512,
            physical_block_size: 0,
            read_only: false,
            write_cache: false,
            serial: String::new(),
            naa: 0,
            vendor: "IRONSAN".into(),
            product: "ironsan LU".into(),
            revision: "0001".into(),
            state_dir: None,
            shared: false,
            cluster: None,
        }
    }
}

/// A locally assigned (NAA 3h, SPC-4 NAA Locally Assigned designator format) identifier derived from `seed` (e.g.
/// "target-iqn/lun"), stable across restarts: FNV-1a 64 with the top nibble forced to 3.
pub fn local_naa(seed: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in seed.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h & 0x0FFF_FFFF_FFFF_FFFF) | 0x3000_0000_0000_0000
}

/// Most unit attentions queued for one I_T nexus; older conditions are kept and identical
/// conditions are not queued twice (SAM-5 lets a device server drop or merge them).
const MAX_UA_PER_NEXUS: usize = 16;

/// A logical unit: one [`BlockDevice`] plus the SCSI state that belongs to it.
pub struct LogicalUnit {
    backend: Arc<dyn BlockDevice>,
    cfg: LuConfig,
    block_size: u32,
    /// Number of logical blocks; changed only by [`LogicalUnit::resize`].
    capacity: AtomicU64,
    wce: AtomicBool,
    /// SWP (software write protect) of the control mode page.
    swp: AtomicBool,
    /// Serialises MODE SELECT so validation and update are one step.
    pub(crate) mode_select: Mutex<()>,
    ua: Mutex<IntMap<u64, NexusUa>>,
    pub(crate) writes: RangeLock,
    /// SPC-2 RESERVE(6/10) holder, by I_T nexus id.
    pub(crate) reservation: Mutex<Option<u64>>,
    /// I_T nexuses that issued PREVENT ALLOW MEDIUM REMOVAL with PREVENT=01b.
    pub(crate) prevent: Mutex<HashSet<u64>>,
    /// SPC-4 persistent reservations.
    pub(crate) pr: Mutex<PrState>,
    /// The serial of the shared record `pr` was last set from (`LuConfig::cluster`).
    pub(crate) pr_serial: AtomicU64,
    /// I_T nexuses whose tasks a PREEMPT AND ABORT asked the transport to abort.
    pub(crate) pr_aborts: Mutex<Vec<PortPair>>,
    /// EXTENDED COPY commands this LU (as copy manager) runs or has results of.
    pub(crate) copies: Mutex<crate::xcopy::CopyResults>,
    /// EXTENDED COPY commands running now (bounded by TOTAL CONCURRENT COPIES).
    pub(crate) copies_running: AtomicUsize,
}

/// Unit attention queue of one I_T nexus, with the port names that identify it to
/// persistent reservations.
struct NexusUa {
    who: PortPair,
    q: VecDeque<UnitAttention>,
}

impl NexusUa {
    fn new(nexus: &Nexus) -> Self {
        NexusUa {
            who: PortPair::of(nexus),
            q: VecDeque::new(),
        }
    }
    /// Queue `ua` unless it is already pending or the queue is full.
    fn raise(&mut self, ua: UnitAttention) {
        if !self.q.contains(&ua) && self.q.len() < MAX_UA_PER_NEXUS {
            self.q.push_back(ua);
        }
    }
}

impl std::fmt::Debug for LogicalUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogicalUnit")
            .field("backend", &self.backend.kind())
            .field("block_size", &self.block_size)
            .field("capacity_blocks", &self.capacity_blocks())
            .field("wce", &self.wce())
            .finish()
    }
}

/// Lock a mutex, ignoring poisoning: the protected state stays consistent across panics
/// because each critical section is a single update.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl LogicalUnit {
    /// Create a logical unit over `backend`. Capacity is `backend.size() / block_size`
    /// (a trailing partial block is not exposed).
    ///
    /// # Panics
    /// If `cfg.block_size` is not a power of two in 512..=65536 (a configuration error the
    /// config layer must catch first).
    pub fn new(backend: Arc<dyn BlockDevice>, cfg: LuConfig) -> Self {
        let bs = cfg.block_size;
        assert!(
            bs.is_power_of_two() && (512..=65536).contains(&bs),
            "block size {bs} is not a power of two in 512..=65536"
        );
        let capacity = backend.size() / u64::from(bs);
        let pr = crate::pr::load(cfg.state_dir.as_deref());
        let writes = if cfg.cluster.is_some() {
            RangeLock::timed()
        } else {
            RangeLock::default()
        };
        LogicalUnit {
            wce: AtomicBool::new(cfg.write_cache),
            swp: AtomicBool::new(false),
            backend,
            block_size: bs,
            capacity: AtomicU64::new(capacity),
            cfg,
            mode_select: Mutex::new(()),
            ua: Mutex::new(IntMap::default()),
            writes,
            reservation: Mutex::new(None),
            prevent: Mutex::new(HashSet::new()),
            pr: Mutex::new(pr),
            pr_serial: AtomicU64::new(0),
            pr_aborts: Mutex::new(Vec::new()),
            copies: Mutex::new(Default::default()),
            copies_running: AtomicUsize::new(0),
        }
    }

    /// Number of logical blocks.
    pub fn capacity_blocks(&self) -> u64 {
        self.capacity.load(Ordering::Acquire)
    }

    /// Change the medium size to `new_bytes` (rounded down to whole blocks; at least one):
    /// the backend resizes first, then the capacity changes and CAPACITY DATA HAS CHANGED
    /// (2Ah/09h) is established for every I_T nexus of the LU (SBC-3 §4.7: initiators re-read
    /// the capacity). Commands already range-checked against the old capacity finish; a
    /// shrink under a running initiator is the operator's decision.
    pub fn resize(&self, new_bytes: u64) -> Result<u64, ironsan_backend::BackendError> {
        let bs = u64::from(self.block_size);
        let blocks = new_bytes / bs;
        if blocks == 0 {
            return Err(ironsan_backend::BackendError::OutOfRange);
        }
        self.backend.resize(blocks * bs)?;
        let old = self.capacity.swap(blocks, Ordering::AcqRel);
        if old != blocks {
            self.establish_unit_attention(UnitAttention::CapacityDataChanged, None);
        }
        Ok(blocks)
    }
    /// The backing device's size changed outside ironsan (another client resized a shared
    /// image) to `new_bytes`: the capacity follows (whole blocks, at least one) and, if it
    /// changed, CAPACITY DATA HAS CHANGED is established for every I_T nexus.
    pub fn capacity_changed(&self, new_bytes: u64) -> u64 {
        let blocks = (new_bytes / u64::from(self.block_size)).max(1);
        if self.capacity.swap(blocks, Ordering::AcqRel) != blocks {
            self.establish_unit_attention(UnitAttention::CapacityDataChanged, None);
        }
        blocks
    }
    /// Logical block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Physical block size in bytes as reported (a power-of-two multiple of the logical
    /// block, at most 2^15 of them): the configured one, raised to the backend's alignment.
    pub fn physical_block_size(&self) -> u32 {
        let bs = self.block_size;
        let cfg = self.cfg.physical_block_size;
        let cfg = if cfg.is_power_of_two() && cfg > bs {
            cfg
        } else {
            bs
        };
        let align = self.backend.capabilities().alignment;
        let align = if align.is_power_of_two() { align } else { 1 };
        let p = u64::from(cfg.max(align));
        u32::try_from(p.min(u64::from(bs) << 15)).unwrap_or(bs)
    }
    /// Current WCE (write cache enable) of the caching mode page.
    pub fn wce(&self) -> bool {
        self.wce.load(Ordering::Acquire)
    }
    pub(crate) fn set_wce(&self, on: bool) {
        self.wce.store(on, Ordering::Release);
    }
    /// Current SWP (software write protect) of the control mode page: writes fail with DATA
    /// PROTECT / WRITE PROTECTED while it is set.
    pub fn swp(&self) -> bool {
        self.swp.load(Ordering::Acquire)
    }
    pub(crate) fn set_swp(&self, on: bool) {
        self.swp.store(on, Ordering::Release);
    }
    /// The backing device.
    pub fn backend(&self) -> &Arc<dyn BlockDevice> {
        &self.backend
    }
    /// The configuration this LU was created with.
    pub fn config(&self) -> &LuConfig {
        &self.cfg
    }

    /// LOGICAL UNIT RESET (SAM-5 task management functions): release the SPC-2 reservation and medium-removal
    /// prevention, and establish POWER ON, RESET, OR BUS DEVICE RESET OCCURRED (29h/00h) for
    /// every I_T nexus known to this LU, the requesting one included (SAM-5: every I_T nexus;
    /// multipath initiators look for it on each path). Persistent reservations are kept
    /// (SPC-4: they survive resets). Mode parameters keep their current values (not
    /// reverted to defaults), so a reset never silently turns a write cache back on or off.
    pub fn reset(&self) {
        *lock(&self.reservation) = None;
        lock(&self.prevent).clear();
        self.establish_unit_attention(UnitAttention::PowerOnReset, None);
    }

    /// PREEMPT AND ABORT: the I_T nexuses, as (initiator port name, target port name), whose
    /// tasks on this LU the transport must abort (SAM-5 TASK ABORTED semantics, as for
    /// CLEAR TASK SET limited to those nexuses). Call it after a PERSISTENT RESERVE OUT
    /// (opcode 5Fh) completes; each list is returned once.
    pub fn take_pr_aborts(&self) -> Vec<(Arc<str>, Arc<str>)> {
        std::mem::take(&mut *lock(&self.pr_aborts))
            .into_iter()
            .map(|p| (p.initiator, p.target))
            .collect()
    }

    /// Take the persistent-reservation record the cluster published for this LU (see
    /// [`ClusterLu`]) if it is newer than the one applied: the state every later command is
    /// checked against. With `events`, the unit attentions of the change are established
    /// for this node's I_T nexuses and the nexuses PREEMPT AND ABORT named are queued for
    /// [`LogicalUnit::take_pr_aborts`] (not when catching up at start: they are old news).
    /// Returns whether the record was new.
    pub fn apply_shared_pr(&self, record: &str, events: bool) -> Result<bool, String> {
        let rec = crate::pr::SharedRecord::decode(record)
            .ok_or_else(|| "malformed persistent-reservation record".to_string())?;
        let mut g = lock(&self.pr);
        if rec.serial <= self.pr_serial.load(Ordering::Acquire) {
            return Ok(false);
        }
        *g = rec.state;
        self.pr_serial.store(rec.serial, Ordering::Release);
        drop(g);
        if events {
            self.pr_changed(rec.uas, rec.aborts);
        }
        Ok(true)
    }

    /// What a persistent-reservation change sets off once it is the state: its unit
    /// attentions for the named I_T nexuses, and PREEMPT AND ABORT's victims queued for
    /// [`LogicalUnit::take_pr_aborts`].
    pub(crate) fn pr_changed(&self, uas: Vec<(PortPair, UnitAttention)>, aborts: Vec<PortPair>) {
        for (who, ua) in uas {
            self.establish_unit_attention_for(&who, ua);
        }
        if !aborts.is_empty() {
            lock(&self.pr_aborts).extend(aborts);
        }
    }

    /// The serial of the shared persistent-reservation record this node applied (0: none).
    pub fn shared_pr_serial(&self) -> u64 {
        self.pr_serial.load(Ordering::Acquire)
    }

    /// The PRgeneration of the persistent-reservation state (SPC-4 READ KEYS).
    pub fn pr_generation(&self) -> u32 {
        lock(&self.pr).generation
    }

    /// Establish `ua` for every known I_T nexus with the port names `who`.
    pub(crate) fn establish_unit_attention_for(&self, who: &PortPair, ua: UnitAttention) {
        let mut map = lock(&self.ua);
        for e in map.values_mut().filter(|e| who.covers(&e.who)) {
            e.raise(ua);
        }
    }

    /// Establish `ua` for one I_T nexus, which need not have addressed this LU yet: a task
    /// management function from another nexus aborted its commands here (its only ones may
    /// have been writes still waiting for their data), and with TAS=0 (our control mode page)
    /// they end with no status, so this is how it learns (SAM-5: COMMANDS CLEARED BY ANOTHER
    /// INITIATOR after CLEAR TASK SET; POWER ON, RESET, OR BUS DEVICE RESET OCCURRED after
    /// LOGICAL UNIT RESET).
    pub fn establish_unit_attention_on(&self, nexus: &Nexus, ua: UnitAttention) {
        lock(&self.ua)
            .entry(nexus.id)
            .or_insert_with(|| NexusUa::new(nexus))
            .raise(ua);
    }

    /// Establish `ua` for every I_T nexus that has addressed this LU, except `except`.
    /// Nexuses first seen later start with no pending condition (no power-on UA at first
    /// contact).
    pub fn establish_unit_attention(&self, ua: UnitAttention, except: Option<u64>) {
        let mut map = lock(&self.ua);
        for (id, e) in map.iter_mut() {
            if Some(*id) == except || e.q.contains(&ua) || e.q.len() >= MAX_UA_PER_NEXUS {
                continue;
            }
            e.q.push_back(ua);
        }
    }

    /// Forget an I_T nexus (session gone, SAM-5 I_T nexus loss): its queue and any SPC-2
    /// reservation or medium-removal prevention it held.
    pub fn nexus_lost(&self, nexus_id: u64) {
        lock(&self.ua).remove(&nexus_id);
        lock(&self.copies).forget_nexus(nexus_id);
        lock(&self.prevent).remove(&nexus_id);
        let mut r = lock(&self.reservation);
        if *r == Some(nexus_id) {
            *r = None;
        }
    }

    /// Make `nexus` known (lazily creating its queue) and, with `take`, pop its oldest
    /// pending unit attention: one lock per command for both.
    pub(crate) fn register_nexus(&self, nexus: &Nexus, take: bool) -> Option<UnitAttention> {
        let mut ua = lock(&self.ua);
        let e = ua.entry(nexus.id).or_insert_with(|| NexusUa::new(nexus));
        if take {
            e.q.pop_front()
        } else {
            None
        }
    }

    /// Whether `nexus_id` has been seen here and has no unit attention pending (the state in
    /// which a command begins without one being reported).
    pub(crate) fn nothing_to_report(&self, nexus_id: u64) -> bool {
        lock(&self.ua)
            .get(&nexus_id)
            .is_some_and(|e| e.q.is_empty())
    }

    /// Pop the oldest pending unit attention of `nexus_id`.
    pub(crate) fn take_unit_attention(&self, nexus_id: u64) -> Option<UnitAttention> {
        lock(&self.ua)
            .get_mut(&nexus_id)
            .and_then(|e| e.q.pop_front())
    }

    /// Drop a pending `ua` of `nexus_id` without reporting it (REPORT LUNS clears REPORTED
    /// LUNS DATA HAS CHANGED, SPC-4 REPORT LUNS).
    pub(crate) fn clear_unit_attention(&self, nexus_id: u64, ua: UnitAttention) {
        if let Some(e) = lock(&self.ua).get_mut(&nexus_id) {
            e.q.retain(|&u| u != ua);
        }
    }

    /// Whether `lba .. lba+blocks` lies within the medium, with no u64 wrap.
    pub(crate) fn in_range(&self, lba: u64, blocks: u64) -> bool {
        lba.checked_add(blocks)
            .is_some_and(|end| end <= self.capacity_blocks())
    }

    /// The transport aborted a task that may be executing a command on this LU (ABORT TASK,
    /// a task set cleared, a LUN or target reset, session reinstatement, a connection lost,
    /// PREEMPT AND ABORT). `gone` must report when the task's future has been dropped (a
    /// tokio `AbortHandle::is_finished`). Call it before the task management response: until
    /// every such task is gone, reads wait for them, so a read issued after the response
    /// sees any write the aborted task left in the device (it waits for that write to finish;
    /// docs/INTEGRITY.md, "Reads and orphaned writes").
    pub fn task_aborted(&self, gone: impl Fn() -> bool + Send + Sync + 'static) {
        self.writes.aborting(Box::new(gone));
    }

    /// When the oldest write range still held was taken: the write the device (or the
    /// command) has been holding longest, whether or not its command is still running. Only
    /// kept for cluster LUs (`LuConfig::cluster`); `None` otherwise or when nothing is held.
    pub fn oldest_write(&self) -> Option<Instant> {
        self.writes.oldest()
    }

    /// Resolves once no aborted command of this LU can still change its medium: no range
    /// orphaned by an abort, and every aborted task's future gone (`task_aborted`). A
    /// transport calls it before it answers a task management function on an LU other
    /// nodes write too, so that nothing the initiator was told is aborted lands after a
    /// write it then sends through another node.
    pub fn aborts_settled(&self) -> impl Future<Output = ()> + Send + '_ {
        self.writes.settled(0, u64::MAX)
    }

    pub(crate) fn max_transfer_blocks(&self) -> u32 {
        crate::cdb::max_transfer_blocks(self.block_size)
    }
}

/// An async exclusive lock over LBA ranges. Every command that modifies the medium holds it
/// over its range for the duration of the backend call, so COMPARE AND WRITE's read-compare-
/// write cannot interleave with another writer (SBC-3 COMPARE AND WRITE). Runtime-agnostic (plain wakers).
///
/// Guards are owned (`'static`): a write hands its guard to the backend as the operation's
/// [`Keep`](ironsan_backend::Keep) value, so the range stays locked until the backend I/O has
/// really finished, even when the task was aborted and its future dropped first. A later
/// writer of the same blocks therefore always lands after an aborted one.
///
/// **Orphans and reads** (docs/INTEGRITY.md, "Reads and orphaned writes"). Reads take no lock.
/// A range whose command was dropped (aborted) while the device still held its I/O is
/// *orphaned* ([`Kept::run`] marks it); [`RangeLock::settled`] waits until no orphaned range
/// overlaps a read. Because the transport answers a TMF before the aborted task's future is
/// really dropped, it first reports each aborted task with [`RangeLock::aborting`]; until those
/// futures are gone `settled` yields (they are dropped within one scheduling round). With no
/// orphan and no such task, `settled` is one atomic load. Writers ([`RangeLock::lock`],
/// [`RangeLock::try_lock`]) wait for such tasks as well: one may be aborted after its command
/// was admitted but before it took its range, and a write issued after the TMF response must
/// not take the range first and then be overwritten by it (docs/INTEGRITY.md, promise 17).
#[derive(Default)]
pub(crate) struct RangeLock {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<RangeLockInner>,
    /// Orphaned ranges plus aborted tasks not yet known to be gone: 0 means reads need not
    /// look (the fast path of [`RangeLock::settled`]).
    attention: AtomicUsize,
}

/// Reports whether an aborted task's future has been dropped (e.g. a tokio `AbortHandle`'s
/// `is_finished`).
pub(crate) type TaskGone = Box<dyn Fn() -> bool + Send + Sync>;

#[derive(Default)]
struct RangeLockInner {
    /// Each range remembers when it was taken (a cluster LU: [`LogicalUnit::oldest_write`]).
    timed: bool,
    held: Vec<Held>,
    next_token: u64,
    /// Writers waiting for a range and readers waiting for an orphan; all woken on release.
    waiters: Vec<Waker>,
    /// How many of `held` are orphaned.
    orphaned: usize,
    /// Aborted tasks whose futures may still be alive (and may still hand I/O to the device).
    aborting: Vec<TaskGone>,
}

struct Held {
    start: u64,
    end: u64,
    token: u64,
    orphaned: bool,
    /// When it was taken (only on a timed lock: [`RangeLock::timed`]).
    since: Option<Instant>,
}

impl RangeLockInner {
    fn publish(&self, shared: &Shared) {
        shared
            .attention
            .store(self.orphaned + self.aborting.len(), Ordering::SeqCst);
    }
    /// Whether a held range overlaps blocks `start .. end`.
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.held.iter().any(|h| h.start < end && start < h.end)
    }
    /// Hold blocks `start .. end` (free: the caller checked [`overlaps`](Self::overlaps)).
    fn hold(&mut self, shared: &Arc<Shared>, start: u64, end: u64) -> RangeGuard {
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1);
        let since = self.timed.then(Instant::now);
        self.held.push(Held {
            start,
            end,
            token,
            orphaned: false,
            since,
        });
        RangeGuard {
            shared: Arc::clone(shared),
            token,
        }
    }
    /// Forget aborted tasks that are gone.
    fn prune(&mut self) {
        self.aborting.retain(|gone| !gone());
    }
    /// Whether an aborted task may still be alive (pruned first). Writers wait while one
    /// is: such a task may not have taken its range yet, and the TMF response has already
    /// told the initiator it is gone, so a write issued after that response must not take the
    /// range before it and then be overwritten by it.
    fn aborted_alive(&mut self, shared: &Shared) -> bool {
        if self.aborting.is_empty() {
            return false;
        }
        self.prune();
        self.publish(shared);
        !self.aborting.is_empty()
    }
    fn wake_all(&mut self) -> Vec<Waker> {
        std::mem::take(&mut self.waiters)
    }
}

fn add_waker(waiters: &mut Vec<Waker>, w: &Waker) {
    if !waiters.iter().any(|x| x.will_wake(w)) {
        waiters.push(w.clone());
    }
}

impl RangeLock {
    /// A lock whose ranges remember when they were taken ([`RangeLock::oldest`]).
    fn timed() -> RangeLock {
        let l = RangeLock::default();
        lock(&l.shared.state).timed = true;
        l
    }

    /// When the longest-held range was taken (a timed lock; `None`: none is held).
    fn oldest(&self) -> Option<Instant> {
        lock(&self.shared.state)
            .held
            .iter()
            .filter_map(|h| h.since)
            .min()
    }

    /// Lock blocks `start .. end` (half open).
    pub(crate) fn lock(&self, start: u64, end: u64) -> RangeLockFuture<'_> {
        RangeLockFuture {
            lock: self,
            start,
            end,
        }
    }

    /// Lock blocks `start .. end` if no held range overlaps them now and no aborted task may
    /// still take one; never waits.
    pub(crate) fn try_lock(&self, start: u64, end: u64) -> Option<RangeGuard> {
        let mut g = lock(&self.shared.state);
        if g.overlaps(start, end) || g.aborted_alive(&self.shared) {
            return None;
        }
        Some(g.hold(&self.shared, start, end))
    }

    /// Resolves when no orphaned range overlaps blocks `start .. end` and no aborted task can
    /// still create one (see the type's docs). Reads await this before reading the medium.
    pub(crate) fn settled(&self, start: u64, end: u64) -> Settled<'_> {
        Settled {
            lock: self,
            start,
            end,
        }
    }

    /// The transport aborted a task that may be executing a command on this LU; `gone`
    /// reports when its future has been dropped. Until then [`settled`](Self::settled) waits,
    /// so a read issued after the TMF response sees any range the task orphans.
    pub(crate) fn aborting(&self, gone: TaskGone) {
        let mut g = lock(&self.shared.state);
        g.prune();
        if !gone() {
            g.aborting.push(gone);
        }
        g.publish(&self.shared);
    }

    /// Ranges held right now (tests).
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        lock(&self.shared.state).held.len()
    }

    /// Orphaned ranges right now (tests).
    #[cfg(test)]
    pub(crate) fn orphaned(&self) -> usize {
        lock(&self.shared.state).orphaned
    }
}

pub(crate) struct RangeLockFuture<'a> {
    lock: &'a RangeLock,
    start: u64,
    end: u64,
}

impl Future for RangeLockFuture<'_> {
    type Output = RangeGuard;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<RangeGuard> {
        let mut g = lock(&self.lock.shared.state);
        let (s, e) = (self.start, self.end);
        if g.aborted_alive(&self.lock.shared) {
            // As in `Settled`: its future is about to be dropped and nothing wakes us when it
            // is, so yield and look again. (If this is that task, it is dropped here.)
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if g.overlaps(s, e) {
            add_waker(&mut g.waiters, cx.waker());
            return Poll::Pending;
        }
        Poll::Ready(g.hold(&self.lock.shared, s, e))
    }
}

/// See [`RangeLock::settled`].
pub(crate) struct Settled<'a> {
    lock: &'a RangeLock,
    start: u64,
    end: u64,
}

impl Future for Settled<'_> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let shared = &self.lock.shared;
        if shared.attention.load(Ordering::SeqCst) == 0 {
            return Poll::Ready(());
        }
        let mut g = lock(&shared.state);
        if g.aborted_alive(shared) {
            // An aborted task's future is about to be dropped; nothing wakes us when it is, so
            // yield and look again.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let (s, e) = (self.start, self.end);
        if g.held
            .iter()
            .any(|h| h.orphaned && h.start < e && s < h.end)
        {
            add_waker(&mut g.waiters, cx.waker());
            return Poll::Pending;
        }
        Poll::Ready(())
    }
}

/// A held range; dropping it (on any thread, e.g. a backend I/O thread) releases the range.
pub(crate) struct RangeGuard {
    shared: Arc<Shared>,
    token: u64,
}

impl RangeGuard {
    /// This guard as a backend [`Keep`](ironsan_backend::Keep) value, for one backend
    /// operation started with [`Kept::run`].
    pub(crate) fn keep(self) -> Kept {
        let mark = OrphanMark {
            shared: Some(Arc::clone(&self.shared)),
            token: self.token,
        };
        Kept {
            keep: Box::new(self),
            mark,
        }
    }
    /// A shared guard as a [`Keep`](ironsan_backend::Keep) value, for commands that issue
    /// several backend operations under one lock: the range is released when the command
    /// and every operation it issued are done.
    pub(crate) fn keep_shared(self: &Arc<Self>) -> Kept {
        Kept {
            keep: Box::new(Arc::clone(self)),
            mark: OrphanMark {
                shared: Some(Arc::clone(&self.shared)),
                token: self.token,
            },
        }
    }
}

impl Drop for RangeGuard {
    fn drop(&mut self) {
        let waiters = {
            let mut g = lock(&self.shared.state);
            if let Some(i) = g.held.iter().position(|h| h.token == self.token) {
                let h = g.held.swap_remove(i);
                if h.orphaned {
                    g.orphaned -= 1;
                    g.publish(&self.shared);
                }
            }
            g.wake_all()
        };
        for w in waiters {
            w.wake();
        }
    }
}

/// A range guard on its way into one backend operation: the [`Keep`](ironsan_backend::Keep)
/// the backend holds until the operation can no longer change the medium, and the mark that
/// makes the range orphaned if the command is dropped first.
pub(crate) struct Kept {
    keep: ironsan_backend::Keep,
    mark: OrphanMark,
}

impl Kept {
    /// Start the backend operation `op` with the keep and await it. If this future is
    /// dropped (the task was aborted) before `op` returns and the device still holds the
    /// keep, the range becomes orphaned: reads of it wait until the device lets go.
    pub(crate) fn run<'a, T>(
        self,
        op: impl FnOnce(ironsan_backend::Keep) -> ironsan_backend::IoFuture<'a, T>,
    ) -> InDevice<'a, T> {
        InDevice {
            op: op(self.keep),
            mark: self.mark,
        }
    }
}

/// See [`Kept::run`]. Field order matters: the operation is dropped first (a backend that
/// cancels it drops the keep there and then), then the mark looks whether the range is still
/// held.
pub(crate) struct InDevice<'a, T> {
    op: ironsan_backend::IoFuture<'a, T>,
    mark: OrphanMark,
}

impl<T> Future for InDevice<'_, T> {
    type Output = Result<T, ironsan_backend::BackendError>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let r = std::task::ready!(self.op.as_mut().poll(cx));
        self.mark.shared = None; // completed: not an orphan
        Poll::Ready(r)
    }
}

/// Marks its range orphaned when dropped while armed and the range is still held.
struct OrphanMark {
    shared: Option<Arc<Shared>>,
    token: u64,
}

impl Drop for OrphanMark {
    fn drop(&mut self) {
        let Some(shared) = self.shared.take() else {
            return;
        };
        let mut g = lock(&shared.state);
        let token = self.token;
        let Some(h) = g.held.iter_mut().find(|h| h.token == token) else {
            return;
        };
        if !h.orphaned {
            h.orphaned = true;
            g.orphaned += 1;
            g.publish(&shared);
        }
    }
}
