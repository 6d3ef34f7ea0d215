//! Block storage backends for ironsan.
//!
//! The contract is deliberately tiny (after LIO's backend ops): read, write (optionally FUA),
//! flush, unmap/write-zeroes, plus geometry and honest capabilities. Backends never see a CDB or
//! a PDU; they see byte offsets into a flat device. The SCSI layer converts LBAs, checks ranges
//! and turns [`BackendError`] into sense data in one place.
//!
//! # Buffers
//! Reads hand back an owned [`Bytes`] (the null backend returns a shared zero page, the RAM
//! backend one copy, the file backend the buffer it read into), writes take an owned [`Bytes`],
//! so an io_uring or zero-copy backend can be added without changing callers.
//!
//! # Durability contract
//! * `write(.., WriteMode::Durable)` returns only when the data is on stable storage
//!   (for files: `pwritev2(RWF_DSYNC)` or write + `fdatasync`).
//! * `write(.., WriteMode::Cached)` may return while data is still in a volatile cache;
//!   a later successful `flush()` makes every write that completed before it durable.
//! * Backends that cannot be durable (null, ram) say so in [`Capabilities::volatile`]; the SCSI
//!   layer reports that honestly (e.g. in the caching mode page) rather than pretending.
//!
//! # Blocking
//! Methods are `async`: in-memory backends complete inline; file backends do what cannot block
//! inline (page-cache hits via `RWF_NOWAIT`, tmpfs files) and hand the rest to io_uring
//! (`uring.rs`, on the caller's tokio runtime) or, with `io_engine = threads` or without
//! io_uring, to a small pool of I/O threads ([`pool::IoPool`]), so the network side never
//! blocks.
//!
//! # Cancellation and [`Keep`]
//! Dropping an operation's future (an aborted task) may or may not stop it: a file backend's
//! `pwritev2` already running on an I/O thread cannot be called back and lands later.
//! [`BlockDevice::write_keeping`] and [`BlockDevice::unmap_keeping`] therefore take a
//! [`Keep`] value that the backend drops only when the operation can no longer change the
//! medium: after the syscall returned, or when it is certain never to be issued (failed
//! first, or dropped before it was handed to a thread). The SCSI layer puts its write range
//! lock guard there, so a later writer of the same blocks waits for an aborted write's I/O
//! even though the aborted task (and its TMF response) did not.
//!
//! The defaults call `write`/`unmap` and drop the value when that future completes or is
//! dropped, which is right for a backend whose future does all the work while polled (RAM,
//! null). **A backend whose operation goes on after its future is dropped (thread pool,
//! io_uring, another process) must override both**, moving the value into the job; a wrapper
//! must pass it on to the device it wraps.

use bytes::Bytes;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// Largest read of zeros served from [`ZEROS`] without allocating.
const ZERO_LEN: usize = 1 << 20;
/// Shared zeros, in the binary's read-only data: no heap, no zeroing per read, and the first
/// pages, which every small read sends, stay in cache.
static ZEROS: [u8; ZERO_LEN] = [0; ZERO_LEN];

/// `len` zero bytes for a read of nothing stored (a NULL LUN, a hole in a RAM LUN): a slice of
/// [`ZEROS`] up to 1 MiB, zeroed memory beyond.
pub(crate) fn zeros(len: usize) -> Bytes {
    match ZEROS.get(..len) {
        Some(z) => Bytes::from_static(z),
        None => bytes::BytesMut::zeroed(len).freeze(),
    }
}

/// Longest read of zeros [`zeros_in_place`] can send: the size of the shared zero file.
const ZERO_FILE_LEN: u64 = 1 << 30;

/// Whether [`zeros_in_place`] can answer on this kernel: from Linux 6.5 `sendfile` from a hole
/// of a tmpfs file splices the shared zero page (`shmem_file_splice_read`); before, the kernel
/// zero-fills fresh pipe pages for it, no cheaper than the copy it replaces, so older kernels
/// (Debian 12's own 6.1 among them) keep the copy. Read once from
/// `/proc/sys/kernel/osrelease`; `false` when it cannot be read or parsed.
pub fn zero_page_reads_supported() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .and_then(|r| kernel_version(&r))
            .is_some_and(|v| v >= (6, 5))
    })
}

/// `(major, minor)` of a kernel release string such as `6.18.44-fc-v595` or `6.1.0-27-amd64`.
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// `len` zero bytes as a [`FileRange`] of a sealed, empty anonymous file, for a read of
/// nothing stored (a NULL LUN, a hole of a RAM LUN) when the connection allows it
/// ([`InPlaceRead::zero_page`]): `sendfile` from it sends the kernel's shared zero page and
/// copies nothing, where [`zeros`] costs the kernel's copy into the socket
/// (docs/PERFORMANCE.md, "Reads of nothing stored are the zero page"). `None` when not
/// allowed, for reads over 1 GiB, on kernels before 6.5 ([`zero_page_reads_supported`]), or when the
/// kernel cannot make the file (said once on stderr); the caller then sends [`zeros`].
pub(crate) fn zeros_in_place(len: usize, how: InPlaceRead) -> Option<FileRange> {
    static ZERO_FILE: std::sync::OnceLock<Option<Arc<std::fs::File>>> = std::sync::OnceLock::new();
    if !how.zero_page || len as u64 > ZERO_FILE_LEN {
        return None;
    }
    // Made once; `None` for good on an older kernel or when the kernel refuses.
    let file = ZERO_FILE.get_or_init(|| {
        if !zero_page_reads_supported() {
            return None;
        }
        sys::sealed_zero_file(c"ironsan-zeros", ZERO_FILE_LEN)
            .map_err(|e| tracing::warn!("no zero file for zero-copy reads of holes: {e}"))
            .ok()
            .map(Arc::new)
    });
    Some(FileRange {
        file: Arc::clone(file.as_ref()?),
        offset: 0,
        len,
        map: None,
    })
}

pub mod fault;
pub mod file;
pub mod int_map;
pub mod lease;
pub mod null;
pub mod pool;
pub mod ram;
pub mod rbd;
mod sys;
mod uring;

pub use fault::{Effect, FaultBackend, FaultControl, FaultRule, Ops};
pub use file::{FileBackend, FileOptions, IoEngine};
pub use int_map::IntMap;
pub use lease::Lease;
pub use null::NullBackend;
pub use ram::{set_free_memory_release, RamBackend};
pub use rbd::{RadosClient, RbdBackend, RbdOptions};
pub use sys::{no_transparent_huge_pages, MappedDest, Mapping};

/// Data that stays in a file until it is sent: `len` bytes at `offset` of `file`. A backend
/// returns one from [`BlockDevice::read_in_place`] when the kernel can send the range straight
/// from the page cache without waiting for a device, so the transport sends it with no copy
/// through user space: with `sendfile`, or, when `map` is set, with a vectored send whose
/// iovec points into that shared mapping of the file ([`SendFrom`]). The bytes are those in
/// the file when they are sent.
#[derive(Clone, Debug)]
pub struct FileRange {
    pub file: Arc<std::fs::File>,
    pub offset: u64,
    pub len: usize,
    /// A shared mapping of `file` from offset 0 that covers the range: send from it
    /// ([`sys::Mapping::iovec`]) instead of with `sendfile`.
    pub map: Option<Arc<sys::Mapping>>,
}

/// How a transport can send a READ's data without a copy through user space; what it asks
/// for depends on the connection (docs/PERFORMANCE.md, "zero_copy_reads").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendFrom {
    /// `sendfile` from the page cache: no copy by the target at all. Any buffered file whose
    /// range is in memory.
    PageCache,
    /// A vectored send from a shared mapping of the file, among the other parts of the same
    /// write: the kernel's one copy into the socket, none through a buffer of ours. tmpfs and
    /// ramfs files only (a disk file's mapping could fault to the device on the network side),
    /// and only over pages that exist (a read fault on a hole of a tmpfs mapping would
    /// allocate it).
    Mapping,
}

/// Reads of at least `min` bytes may answer with a [`FileRange`] sent as `from` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InPlaceRead {
    pub min: u32,
    pub from: SendFrom,
    /// Reads of nothing stored (NULL LUNs, holes of RAM LUNs) may be sent with `sendfile`
    /// from a file of zeros whatever `from` says: the kernel sends its shared zero page and
    /// copies nothing, which measured faster under BBR as well as cubic (unlike `sendfile` of
    /// data). Set when segments are large enough for `sendfile` (docs/PERFORMANCE.md,
    /// "Reads of nothing stored are the zero page").
    pub zero_page: bool,
}

/// `from` alone (`min` 0), with [`InPlaceRead::zero_page`] where `sendfile` is asked for.
impl From<SendFrom> for InPlaceRead {
    fn from(from: SendFrom) -> Self {
        InPlaceRead {
            min: 0,
            from,
            zero_page: from == SendFrom::PageCache,
        }
    }
}

impl PartialEq for FileRange {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.file, &other.file) && self.offset == other.offset && self.len == other.len
    }
}
impl Eq for FileRange {}

impl FileRange {
    /// Split off the first `n` bytes (at most `len`) and return them; `self` keeps the rest.
    pub fn split_to(&mut self, n: usize) -> FileRange {
        let n = n.min(self.len);
        let head = FileRange {
            file: Arc::clone(&self.file),
            offset: self.offset,
            len: n,
            map: self.map.clone(),
        };
        self.offset += n as u64;
        self.len -= n;
        head
    }
    /// Keep only the first `n` bytes.
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }
    /// Read the range into memory (where the bytes are needed in user space after all, e.g.
    /// to compute a data digest). A file that has become shorter is an error.
    pub fn to_bytes(&self) -> std::io::Result<Bytes> {
        let mut v = vec![0u8; self.len];
        sys::read_exact_at(&*self.file, &mut v, self.offset)?;
        Ok(Bytes::from(v))
    }
}

/// Where a write's bytes can be received in place: `len` bytes at `offset` of a file, mapped
/// shared, so the transport has the kernel copy them from its socket straight into the file's
/// pages ([`mapped`](Self::mapped)) instead of into a buffer first and from there into the
/// file. A backend hands one out from [`BlockDevice::write_in_place`] only where that copy
/// cannot wait for a device (tmpfs/ramfs files). The bytes are in the file as they arrive.
#[derive(Clone, Debug)]
pub struct InPlaceWrite {
    file: Arc<std::fs::File>,
    map: Arc<sys::Mapping>,
    offset: u64,
    len: usize,
    /// The transport receives whole multiples of this into the mapping (a logical block).
    grain: usize,
}

impl InPlaceWrite {
    pub(crate) fn new(
        file: Arc<std::fs::File>,
        map: Arc<sys::Mapping>,
        offset: u64,
        len: usize,
    ) -> Self {
        InPlaceWrite {
            file,
            map,
            offset,
            len,
            grain: 1,
        }
    }

    /// Receive in multiples of `grain` bytes (the logical block size, which the backend does
    /// not know), so a transfer broken off never leaves part of a block written.
    pub fn in_grains_of(mut self, grain: usize) -> Self {
        self.grain = grain.max(1);
        self
    }

    /// See [`in_grains_of`](Self::in_grains_of).
    pub fn grain(&self) -> usize {
        self.grain
    }

    /// Where the write starts in the device, in bytes.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes the write covers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the write covers nothing (never for one a backend handed out).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file's mapped pages under bytes `at .. at + len` of the write, as the destination
    /// of a receive system call ([`MappedDest`]: a raw view for the kernel, never read or
    /// written in user space). `InvalidInput` when the bytes are not all inside the write. A
    /// file cut short behind our back shows only in that call: it fails with EFAULT.
    pub fn mapped(&self, at: usize, len: usize) -> std::io::Result<MappedDest<'_>> {
        let at_map = self.map_offset(at, len)?;
        self.map
            .dest(at_map, len)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    }

    /// Write `data` (bytes already received elsewhere) into the write at byte `at`.
    pub fn write_at(&self, at: usize, data: &[u8]) -> std::io::Result<()> {
        self.map_offset(at, data.len())?;
        sys::write_all_at(&*self.file, data, self.offset + at as u64, false)
    }

    /// Make the bytes durable (WCE=0 or FUA): `fdatasync` (on tmpfs it returns at once).
    pub fn sync(&self) -> Result<(), BackendError> {
        self.file
            .sync_data()
            .map_err(|e| BackendError::from_io(&e, self.offset, true))
    }

    /// The mapping offset of bytes `at .. at + n` of the write, if they lie inside it.
    fn map_offset(&self, at: usize, n: usize) -> std::io::Result<usize> {
        at.checked_add(n)
            .filter(|&end| end <= self.len)
            .and_then(|_| usize::try_from(self.offset).ok())
            .and_then(|base| base.checked_add(at))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    }
}

/// A boxed future returned by backend operations (object-safe async).
pub type IoFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, BackendError>> + Send + 'a>>;

/// Something the caller needs kept alive until an operation can no longer change the medium
/// (see "Cancellation and Keep" above): typically a range lock guard.
pub type Keep = Box<dyn std::any::Any + Send>;

/// What went wrong in a backend, small enough to map to sense data in one table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The request reaches past the end of the device (the SCSI layer checks first; this is a
    /// second line of defence).
    #[error("request beyond end of device")]
    OutOfRange,
    /// The operation is not supported by this backend.
    #[error("operation not supported by backend")]
    Unsupported,
    /// The device is full (thin provisioning).
    #[error("no space left on backing store")]
    NoSpace,
    /// A read failed at the given byte offset (maps to MEDIUM ERROR / UNRECOVERED READ ERROR).
    #[error("read error at byte offset {offset}")]
    ReadError { offset: u64 },
    /// A write failed at the given byte offset (maps to MEDIUM ERROR / WRITE ERROR).
    #[error("write error at byte offset {offset}")]
    WriteError { offset: u64 },
    /// Any other I/O error (maps to HARDWARE ERROR / INTERNAL TARGET FAILURE).
    #[error("I/O error: {0}")]
    Io(String),
    /// The storage behind the device did not answer in time (a cluster without quorum, OSDs
    /// down); the operation may still complete later. Maps to NOT READY, IN PROCESS OF
    /// BECOMING READY, which initiators retry.
    #[error("storage unavailable: {0}")]
    Unavailable(String),
    /// This process may no longer write the device (another client took it over, or the
    /// cluster fenced this one off). Maps to NOT READY, MANUAL INTERVENTION REQUIRED.
    #[error("fenced: {0}")]
    Fenced(String),
    /// This node's lease on shared storage has lapsed (a cluster node that was paused, cut
    /// off or stalled), so it hands no write to the storage until it has rejoined. Maps to
    /// NOT READY, LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN UNAVAILABLE STATE: initiators
    /// use another path.
    #[error("suspended: {0}")]
    Suspended(String),
}

impl BackendError {
    /// Classify an `std::io::Error` from a read or write at `offset`.
    pub fn from_io(e: &std::io::Error, offset: u64, is_write: bool) -> Self {
        match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => BackendError::NoSpace,
            Some(libc::EIO) if is_write => BackendError::WriteError { offset },
            Some(libc::EIO) => BackendError::ReadError { offset },
            _ => BackendError::Io(e.to_string()),
        }
    }
}

/// Whether a write must be durable before it completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// Complete only when on stable storage (WCE=0, or FUA).
    Durable,
    /// May complete while still in a volatile cache (WCE=1 without FUA).
    Cached,
}

/// What a backend is and can do; reported honestly to the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Data does not survive a restart of the process (null, ram).
    pub volatile: bool,
    /// Unmap (deallocate) is supported, and deallocated ranges read back as zeros.
    pub unmap: bool,
    /// Preferred alignment of I/O in bytes (O_DIRECT needs the device's logical block size).
    pub alignment: u32,
    /// The backend discards writes (NULLIO).
    pub discards_writes: bool,
    /// [`BlockDevice::write_zeroes_keeping`] zeroes a range without a buffer of zeros.
    pub write_zeroes: bool,
}

/// The backend contract. Offsets and lengths are in bytes; the caller guarantees
/// `offset + len <= size()`.
pub trait BlockDevice: Send + Sync + 'static {
    /// Short kind name for logs and admin output (`null`, `ram`, `file`, `file-direct`).
    fn kind(&self) -> &'static str;
    /// What runs its I/O that may block, for admin output: `io_uring`, `threads`, `inline`
    /// (file LUNs); `None` (the default) for backends that never block.
    fn io_engine(&self) -> Option<&'static str> {
        None
    }
    /// Size of the device in bytes.
    fn size(&self) -> u64;
    /// Operations handed to the storage and not yet completed, for backends that queue them
    /// somewhere of their own (RBD: in librbd); `None` (the default) otherwise.
    fn in_flight(&self) -> Option<u64> {
        None
    }
    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;
    /// Read `len` bytes at `offset`.
    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes>;
    /// `len` bytes at `offset` as a [`FileRange`] the transport can send from the page cache or
    /// a mapping (as `how.from` says), if the backend is a buffered file and the kernel would
    /// not wait for a device to send it; for a range with nothing stored (NULL, RAM holes),
    /// the shared zero file when `how.zero_page` allows it. `None` (the default): use
    /// [`read`](Self::read). Called on the network side: must not block.
    fn read_in_place(&self, offset: u64, len: usize, how: InPlaceRead) -> Option<FileRange> {
        let _ = (offset, len, how);
        None
    }
    /// Write `data` at `offset`.
    fn write(&self, offset: u64, data: Bytes, mode: WriteMode) -> IoFuture<'_, ()>;
    /// Whether [`write_in_place`](Self::write_in_place) can ever give `Some` (a cheap check,
    /// so a transport does not prepare for writes in place on a LUN that never takes them).
    fn can_write_in_place(&self) -> bool {
        false
    }

    /// Where `len` bytes at `offset` can be received in place (see [`InPlaceWrite`]), or
    /// `None` (the default): the write then comes through [`write`](Self::write).
    fn write_in_place(&self, offset: u64, len: usize) -> Option<InPlaceWrite> {
        let _ = (offset, len);
        None
    }

    /// [`write`](Self::write), dropping `keep` only when the write can no longer change the
    /// medium, even if the returned future is dropped first (see "Cancellation and Keep").
    /// The default is right only for backends whose write does nothing once its future is
    /// dropped.
    fn write_keeping(
        &self,
        offset: u64,
        data: Bytes,
        mode: WriteMode,
        keep: Keep,
    ) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let r = self.write(offset, data, mode).await;
            drop(keep);
            r
        })
    }
    /// Make every completed write durable.
    fn flush(&self) -> IoFuture<'_, ()>;
    /// Deallocate `len` bytes at `offset`; afterwards the range reads as zeros.
    fn unmap(&self, offset: u64, len: u64) -> IoFuture<'_, ()> {
        let _ = (offset, len);
        Box::pin(async { Err(BackendError::Unsupported) })
    }
    /// [`unmap`](Self::unmap) with `keep` held as for [`write_keeping`](Self::write_keeping).
    fn unmap_keeping(&self, offset: u64, len: u64, keep: Keep) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let r = self.unmap(offset, len).await;
            drop(keep);
            r
        })
    }
    /// Write zeros over `len` bytes at `offset`, allocated (not deallocated), without a
    /// buffer of them, holding `keep` as [`write_keeping`](Self::write_keeping) does. Only
    /// called when [`Capabilities::write_zeroes`] says so; default
    /// [`BackendError::Unsupported`].
    fn write_zeroes_keeping(
        &self,
        offset: u64,
        len: u64,
        mode: WriteMode,
        keep: Keep,
    ) -> IoFuture<'_, ()> {
        let _ = (offset, len, mode, keep);
        Box::pin(async { Err(BackendError::Unsupported) })
    }
    /// Whether [`compare_and_write_keeping`](Self::compare_and_write_keeping) can compare
    /// and write `len` bytes at `offset` atomically in the backing store itself (for every
    /// client of it, not only this process). Default: no; the SCSI layer then compares and
    /// writes under its own range lock.
    fn can_compare_and_write(&self, offset: u64, len: usize) -> bool {
        let _ = (offset, len);
        false
    }
    /// Compare the device at `offset` with `verify` and write `data` (as long) there only if
    /// they are equal, as one atomic step; `Some(i)`: they differ first at byte `i` and
    /// nothing was written. `keep` as for [`write_keeping`](Self::write_keeping).
    fn compare_and_write_keeping(
        &self,
        offset: u64,
        verify: Bytes,
        data: Bytes,
        mode: WriteMode,
        keep: Keep,
    ) -> IoFuture<'_, Option<u64>> {
        let _ = (offset, verify, data, mode, keep);
        Box::pin(async { Err(BackendError::Unsupported) })
    }
    /// The device's size in bytes as it changes outside ironsan (another client of a shared
    /// image resized it); the channel closes when the device is dropped. `None` (the
    /// default): the size changes only through [`resize`](Self::resize).
    fn size_watch(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
    /// Change the size of the device to `new_size` bytes (`ironsan ctl lun resize`). Growing
    /// exposes zeros; shrinking hides the tail (the file backend leaves the file's bytes
    /// alone). The caller (the SCSI layer) raises CAPACITY DATA HAS CHANGED. Default:
    /// [`BackendError::Unsupported`].
    fn resize(&self, new_size: u64) -> Result<(), BackendError> {
        let _ = new_size;
        Err(BackendError::Unsupported)
    }
    /// Allocation map of `[offset, offset+len)`: consecutive, non-empty extents
    /// `(offset, len, mapped)` covering exactly that range, in order. The default reports
    /// everything mapped (a backend that cannot tell). RAM reports its allocated chunks, files
    /// their data and holes (`SEEK_DATA`/`SEEK_HOLE`).
    fn map_status(&self, offset: u64, len: u64) -> IoFuture<'_, Vec<(u64, u64, bool)>> {
        Box::pin(async move {
            Ok(if len == 0 {
                Vec::new()
            } else {
                vec![(offset, len, true)]
            })
        })
    }
}

/// Append `(offset, len, mapped)` to `out`, merging with the previous extent when it has the
/// same state and is contiguous (used by backends building a [`BlockDevice::map_status`]).
pub fn push_extent(out: &mut Vec<(u64, u64, bool)>, offset: u64, len: u64, mapped: bool) {
    if len == 0 {
        return;
    }
    if let Some(last) = out.last_mut() {
        if last.2 == mapped && last.0 + last.1 == offset {
            last.1 += len;
            return;
        }
    }
    out.push((offset, len, mapped));
}

/// Parse a duration: a number with `us`, `ms`, `s`, `m` or `h` (`"10s"`, `"1500ms"`, `"2m"`,
/// `"250us"`). `None` on garbage, a missing unit or overflow.
pub fn parse_duration(v: &str) -> Option<std::time::Duration> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = v.split_at(split);
    let n: u64 = n.parse().ok()?;
    let us = match unit.trim() {
        "us" => n,
        "ms" => n.checked_mul(1_000)?,
        "s" => n.checked_mul(1_000_000)?,
        "m" => n.checked_mul(60_000_000)?,
        "h" => n.checked_mul(3_600_000_000)?,
        _ => return None,
    };
    Some(std::time::Duration::from_micros(us))
}

/// Parse a size such as `1G`, `512M`, `16T`, `4096` (bytes) or `100K`.
/// Binary multiples (K = 1024). Returns `None` on garbage or overflow.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    let (num, mult) = match s.as_bytes()[s.len() - 1].to_ascii_uppercase() {
        b'K' => (&s[..s.len() - 1], 1u64 << 10),
        b'M' => (&s[..s.len() - 1], 1u64 << 20),
        b'G' => (&s[..s.len() - 1], 1u64 << 30),
        b'T' => (&s[..s.len() - 1], 1u64 << 40),
        b'P' => (&s[..s.len() - 1], 1u64 << 50),
        b'B' => (&s[..s.len() - 1], 1),
        _ => (s, 1),
    };
    let n: u64 = num.trim().parse().ok()?;
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::{kernel_version, parse_size};

    #[test]
    fn reads_kernel_versions_from_release_strings() {
        assert_eq!(kernel_version("6.18.44-fc-v595\n"), Some((6, 18)));
        assert_eq!(kernel_version("6.1.0-27-amd64"), Some((6, 1)));
        assert_eq!(kernel_version("6.5"), Some((6, 5)));
        assert_eq!(kernel_version("5.10.0+"), Some((5, 10)));
        assert!(kernel_version("6.4.0").is_some_and(|v| v < (6, 5)));
        assert_eq!(kernel_version("6"), None);
        assert_eq!(kernel_version("linux"), None);
        assert_eq!(kernel_version(""), None);
    }

    #[test]
    fn parses_sizes_with_suffixes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("1K"), Some(1024));
        assert_eq!(parse_size("1g"), Some(1 << 30));
        assert_eq!(parse_size("16T"), Some(16 << 40));
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("G"), None);
        assert_eq!(parse_size("12x"), None);
        assert_eq!(parse_size("99999999999P"), None);
    }
}
