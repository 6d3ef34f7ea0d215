//! RBD images of a Ceph cluster as LUNs, through librbd's asynchronous calls.
//!
//! * **I/O.** Reads, writes, flushes and zeroing go to librbd's `rbd_aio_*` calls, many in
//!   flight per image; each completes on a librbd thread, which hands the result to the
//!   waiting task over a oneshot channel (`ffi`). No thread per I/O, and no runtime thread
//!   ever waits for the cluster.
//! * **Durability.** The librbd cache is off unless the LUN asks for a write cache (`wce`),
//!   so a write completes once every replica has it. With the cache on (the option, or a
//!   pool or image override of `rbd_cache`), a write that must be durable (WCE=0, FUA) is
//!   followed by a flush, and SYNCHRONIZE CACHE flushes.
//! * **A bounded wait.** An operation the cluster has not answered within the LUN's timeout
//!   fails with [`BackendError::Unavailable`] (NOT READY, so initiators retry); it stays in
//!   flight in librbd, and whatever range it holds stays held until it completes, so nothing
//!   reads around a write that may still land.
//! * **Fencing.** A gateway the cluster has blocklisted, or one that lost the exclusive lock,
//!   gets `ESHUTDOWN` / `EROFS` for its writes: [`BackendError::Fenced`] from then on, with
//!   the reason logged once.
//! * **The exclusive lock.** A writable image with the `exclusive-lock` feature is locked at
//!   open and kept (no transparent hand-over to other writers). A restarted ironsan finds
//!   its previous instance's address in the LU's state directory; if that instance still
//!   owns the lock (it died without releasing it), the lock is broken at once, which
//!   blocklists the dead instance first, instead of waiting ~30 s for its watch to expire.
//!   Another owner is left alone: a live one keeps the image (the LUN is refused), a dead one
//!   loses it when librbd's own timeout expires.

mod ffi;
pub mod shared;

use crate::{BackendError, BlockDevice, Capabilities, IoFuture, Keep, WriteMode};
use bytes::Bytes;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use ffi::available;

/// How an RBD LUN is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdOptions {
    pub pool: String,
    /// RADOS namespace within the pool (`rbd:POOL/NAMESPACE/IMAGE`).
    pub namespace: Option<String>,
    pub image: String,
    /// ceph.conf; `None`: librados' own search ($CEPH_CONF, /etc/ceph/ceph.conf, ...).
    pub conf: Option<PathBuf>,
    /// The cephx client name without `client.` (default `admin`).
    pub id: String,
    pub read_only: bool,
    /// Turn librbd's cache on (the LUN's `wce`).
    pub write_cache: bool,
    /// How long an operation may wait for the cluster before it fails.
    pub timeout: Duration,
    /// The LU's state directory: the lock owner of the previous instance is recorded there.
    pub state_dir: Option<PathBuf>,
    /// Served by several ironsan nodes at once (active/active): no exclusive lock is taken,
    /// and an image with the exclusive-lock feature is refused (its lock would move to every
    /// node that writes); librbd's cache must stay off (`write_cache` is refused).
    pub shared: bool,
    /// Use this connection instead of making one (`conf` and `id` are then not used): a node
    /// of a cluster of gateways serves its shared images through its one client.
    pub client: Option<RadosClient>,
    /// The cluster node's lease (a shared image of a cluster node): no write is handed to
    /// librbd while it has lapsed ([`BackendError::Suspended`]), and a write handed to it is
    /// waited for until librbd answers, never failed by `timeout` while it may still land
    /// (the node stops renewing its lease while it holds a write that long, so the other
    /// nodes fence it and the write ends: docs/ARCHITECTURE.md, "Several gateways").
    pub lease: Option<Arc<crate::Lease>>,
}

impl RbdOptions {
    /// `pool/image` or `pool/namespace/image`, as given.
    pub fn spec(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{}/{}/{}", self.pool, ns, self.image),
            None => format!("{}/{}", self.pool, self.image),
        }
    }
}

/// Default bound on one operation's wait for the cluster: under the 30 s command timeout of
/// Linux and Windows initiators, so they see a retryable NOT READY rather than having to
/// abort the command.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);

/// How long `rados_connect` may wait for a monitor.
const CONNECT_TIMEOUT_SECS: &str = "10";

/// The file in the LU's state directory that names the client holding the lock.
const OWNER_FILE: &str = "rbd-lock-owner";

/// A connection to a cluster (one RADOS client) that several RBD LUNs and the node's shared
/// objects use together: a node of a cluster of gateways is then one client address, which
/// is what fencing it (blocklisting that address) needs.
#[derive(Clone)]
pub struct RadosClient(Arc<ffi::Cluster>);

impl std::fmt::Debug for RadosClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RadosClient")
            .field(&self.0.instance_id())
            .finish()
    }
}

impl PartialEq for RadosClient {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for RadosClient {}

/// Connect a RADOS client with the settings every RBD LUN gets (bounded waits for the
/// monitors, librbd's cache as `write_cache` says, fencing before a lock is broken).
fn connect_client(
    who: &str,
    conf: Option<&std::path::Path>,
    id: &str,
    write_cache: bool,
) -> Result<ffi::Cluster, String> {
    let conf_text = conf.map(|p| p.to_string_lossy().into_owned());
    let cache = if write_cache { "true" } else { "false" };
    let settings = [
        ("client_mount_timeout", CONNECT_TIMEOUT_SECS),
        ("rados_mon_op_timeout", "30"),
        ("rbd_cache", cache),
        ("rbd_cache_policy", "writeback"),
        // Breaking a lock must fence its owner first (the restart path relies on it).
        ("rbd_blocklist_on_break_lock", "true"),
    ];
    ffi::Cluster::connect(conf_text.as_deref(), id, &settings)
        .map_err(|e| connect_error(who, conf, id, e))
}

/// An RBD image.
pub struct RbdBackend {
    spec: String,
    image: Arc<ffi::Image>,
    size: Arc<AtomicU64>,
    read_only: bool,
    /// librbd's cache is on for this image (writes that must be durable are flushed).
    cache: bool,
    timeout: Duration,
    lease: Option<Arc<crate::Lease>>,
    fenced: AtomicBool,
    /// The size as the header watch sees it, and the sender whose drop stops the task that
    /// follows it.
    sizes: Option<(
        tokio::sync::watch::Receiver<u64>,
        tokio::sync::oneshot::Sender<()>,
    )>,
    _watch: Option<ffi::Watch>,
    /// Held for the life of the backend: one process per LU state directory.
    _state_lock: Option<std::fs::File>,
}

impl std::fmt::Debug for RbdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdBackend")
            .field("spec", &self.spec)
            .field("size", &self.size)
            .field("cache", &self.cache)
            .finish()
    }
}

impl RbdBackend {
    /// Connect to the cluster and open the image (blocking: the monitors and OSDs are asked,
    /// and the exclusive lock of a dead previous owner may take up to ~30 s). Every failure
    /// says what was asked for and what went wrong.
    pub fn open(o: &RbdOptions) -> Result<RbdBackend, String> {
        let spec = o.spec();
        let who = format!("rbd:{spec}");
        let state_lock = match &o.state_dir {
            Some(dir) if !o.read_only => Some(lock_state_dir(dir, &who)?),
            _ => None,
        };
        let cluster = match &o.client {
            Some(c) => Arc::clone(&c.0),
            None => Arc::new(connect_client(
                &who,
                o.conf.as_deref(),
                &o.id,
                o.write_cache,
            )?),
        };
        let io = cluster
            .pool(&o.pool, o.namespace.as_deref())
            .map_err(|e| match e.0 {
                libc::ENOENT => format!("{who}: pool '{}' does not exist", o.pool),
                libc::EPERM | libc::EACCES => {
                    format!("{who}: client.{} may not use pool '{}' ({e})", o.id, o.pool)
                }
                _ => format!("{who}: cannot open pool '{}': {e}", o.pool),
            })?;
        let io = Arc::new(io);
        let image = ffi::Image::open(&io, &o.image, o.read_only).map_err(|e| match e.0 {
            libc::ENOENT => format!(
                "{who}: image '{}' does not exist in pool '{}'{} (create it with `rbd create`)",
                o.image,
                o.pool,
                o.namespace
                    .as_ref()
                    .map(|n| format!(", namespace '{n}'"))
                    .unwrap_or_default()
            ),
            libc::EPERM | libc::EACCES => {
                format!(
                    "{who}: permission denied opening the image as client.{} ({e})",
                    o.id
                )
            }
            _ => format!("{who}: cannot open the image: {e}"),
        })?;
        let image = Arc::new(image);
        if o.shared {
            check_shareable(&who, o, &image)?;
        } else if !o.read_only {
            take_lock(&who, &cluster, &image, o.state_dir.as_deref())?;
        }
        let size = image
            .size()
            .map_err(|e| format!("{who}: cannot read the image size: {e}"))?;
        let cache = match image.config("rbd_cache") {
            Ok(Some(v)) => v == "true",
            _ => o.write_cache,
        };
        if cache && !o.write_cache {
            tracing::warn!("{who}: a pool or image setting turns librbd's cache on; writes that must be durable are flushed");
        }
        let size = Arc::new(AtomicU64::new(size));
        let (watch, sizes) = follow_size(&who, &image, &size);
        Ok(RbdBackend {
            spec,
            image,
            size,
            read_only: o.read_only,
            cache,
            timeout: o.timeout,
            lease: o.lease.clone(),
            fenced: AtomicBool::new(false),
            sizes,
            _watch: watch,
            _state_lock: state_lock,
        })
    }

    /// `pool/image` (or `pool/namespace/image`).
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// Wait for an operation, bounded by the timeout; map librbd's errno.
    async fn finish(
        &self,
        p: ffi::Pending,
        offset: u64,
        write: bool,
    ) -> Result<(isize, Box<ffi::Op>), BackendError> {
        let (ret, op) = self.answer(p, write).await?;
        if ret >= 0 {
            return Ok((ret, op));
        }
        let errno = i32::try_from(-ret).unwrap_or(libc::EIO);
        Err(self.error(errno, offset, write))
    }

    /// librbd's answer to `p`: within the timeout, except for a write of a cluster node
    /// (see [`RbdOptions::lease`]), which is waited for until it ends.
    async fn answer(
        &self,
        p: ffi::Pending,
        write: bool,
    ) -> Result<(isize, Box<ffi::Op>), BackendError> {
        if write && self.lease.is_some() {
            return Ok(p.wait().await);
        }
        tokio::time::timeout(self.timeout, p.wait())
            .await
            .map_err(|_| self.no_answer())
    }

    fn no_answer(&self) -> BackendError {
        BackendError::Unavailable(format!(
            "rbd:{}: no answer from the cluster within {} s",
            self.spec,
            self.timeout.as_secs()
        ))
    }

    fn error(&self, errno: i32, offset: u64, write: bool) -> BackendError {
        let e = std::io::Error::from_raw_os_error(errno);
        match errno {
            libc::ESHUTDOWN => self.fence("the cluster blocklisted this gateway"),
            libc::EROFS if write && !self.read_only => {
                self.fence("another client took the image's exclusive lock")
            }
            libc::ETIMEDOUT => BackendError::Unavailable(format!("rbd:{}: {e}", self.spec)),
            libc::EIO if write => BackendError::WriteError { offset },
            libc::EIO => BackendError::ReadError { offset },
            libc::ENOSPC | libc::EDQUOT => BackendError::NoSpace,
            _ => BackendError::Io(format!("rbd:{}: {e}", self.spec)),
        }
    }

    fn fence(&self, why: &str) -> BackendError {
        if !self.fenced.swap(true, Ordering::AcqRel) {
            tracing::error!(
                "rbd:{}: {why}: its writes fail from now on (restart ironsan, or move the LUN, once the other writer is gone)",
                self.spec
            );
        }
        BackendError::Fenced(format!("rbd:{}: {why}", self.spec))
    }

    /// Whether a write may go to librbd now: not fenced, and the cluster node's lease (if
    /// any) holds.
    fn may_write(&self) -> Result<(), BackendError> {
        if self.fenced.load(Ordering::Acquire) {
            return Err(BackendError::Fenced(format!(
                "rbd:{}: this gateway is fenced off the image",
                self.spec
            )));
        }
        if self.lease.as_ref().is_some_and(|l| !l.valid()) {
            return Err(BackendError::Suspended(format!(
                "rbd:{}: this cluster node's lease has lapsed",
                self.spec
            )));
        }
        Ok(())
    }

    async fn flush_now(&self) -> Result<(), BackendError> {
        let p = self.image.flush();
        self.finish(p, 0, true).await.map(|_| ())
    }
}

type Sizes = (
    tokio::sync::watch::Receiver<u64>,
    tokio::sync::oneshot::Sender<()>,
);

/// Watch the image header; on every change, re-read the size (librbd refreshes the header
/// then, which blocks, so on a blocking thread) and publish it. The task holds the image only
/// while it reads the size, and ends when the backend drops its stop sender.
fn follow_size(
    who: &str,
    image: &Arc<ffi::Image>,
    size: &Arc<AtomicU64>,
) -> (Option<ffi::Watch>, Option<Sizes>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        tracing::warn!(
            "{who}: no runtime to follow the image size; a resize by another client is not noticed"
        );
        return (None, None);
    };
    let changed = Arc::new(tokio::sync::Notify::new());
    let n = Arc::clone(&changed);
    let watch = match image.watch(Box::new(move || n.notify_one())) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!("{who}: cannot watch the image header ({e}); a resize by another client is not noticed");
            return (None, None);
        }
    };
    let (tx, rx) = tokio::sync::watch::channel(size.load(Ordering::Acquire));
    let size = Arc::clone(size);
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let weak = Arc::downgrade(image);
    let who = who.to_string();
    rt.spawn(async move {
        loop {
            tokio::select! {
                _ = changed.notified() => {}
                _ = &mut stop_rx => return,
            }
            let Some(image) = weak.upgrade() else { return };
            match tokio::task::spawn_blocking(move || image.size()).await {
                Ok(Ok(n)) => {
                    size.store(n, Ordering::Release);
                    tx.send_if_modified(|cur| std::mem::replace(cur, n) != n);
                }
                Ok(Err(e)) => {
                    tracing::warn!("{who}: cannot read the image size after a header change: {e}")
                }
                Err(_) => return,
            }
        }
    });
    (Some(watch), Some((rx, stop_tx)))
}

/// One ironsan process per LU state directory: a second one would take the first one's
/// recorded lock owner for a dead predecessor.
fn lock_state_dir(dir: &std::path::Path, who: &str) -> Result<std::fs::File, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{who}: creating {}: {e}", dir.display()))?;
    let path = dir.join("rbd.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("{who}: opening {}: {e}", path.display()))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => Err(format!(
            "{who}: another ironsan process serves this LUN from the same data directory ({} is locked)",
            path.display()
        )),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(format!("{who}: locking {}: {e}", path.display()))
        }
    }
}

/// An image several nodes may write at once: without the exclusive-lock feature (and the
/// features that need it), and without librbd's cache on.
fn check_shareable(who: &str, o: &RbdOptions, image: &ffi::Image) -> Result<(), String> {
    if o.write_cache {
        return Err(format!(
            "{who}: shared and wce exclude each other: a gateway cache would serve stale data to the other nodes"
        ));
    }
    let features = image
        .features()
        .map_err(|e| format!("{who}: cannot read the image features: {e}"))?;
    let needs_lock: Vec<&str> = ffi::FEATURES_NEEDING_LOCK
        .iter()
        .filter(|(bit, _)| features & bit != 0)
        .map(|(_, name)| *name)
        .collect();
    if !needs_lock.is_empty() {
        return Err(format!(
            "{who}: shared needs an image without the exclusive-lock feature (its lock would move to every node that writes, stalling I/O); turn it off with `rbd feature disable {} {}`",
            o.spec(),
            needs_lock.join(" ")
        ));
    }
    Ok(())
}

/// Take the image's exclusive lock (if it has the feature) for this client, breaking it first
/// when the previous instance of this LU (recorded in its state directory) still holds it.
fn take_lock(
    who: &str,
    cluster: &ffi::Cluster,
    image: &ffi::Image,
    state_dir: Option<&std::path::Path>,
) -> Result<(), String> {
    let features = image
        .features()
        .map_err(|e| format!("{who}: cannot read the image features: {e}"))?;
    if features & ffi::FEATURE_EXCLUSIVE_LOCK == 0 {
        return Ok(());
    }
    let owner_file = state_dir.map(|d| d.join(OWNER_FILE));
    let previous = owner_file
        .as_ref()
        .and_then(|f| std::fs::read_to_string(f).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    let owners = image
        .lock_owners()
        .map_err(|e| format!("{who}: cannot read the lock owners: {e}"))?;
    if let Some(prev) = previous.as_ref().filter(|p| owners.contains(p)) {
        tracing::warn!(
            "{who}: the previous ironsan instance ({prev}) still holds the exclusive lock: blocklisting it and breaking the lock"
        );
        match image.lock_break(prev) {
            // EBUSY / ENOENT: it changed hands meanwhile; the acquire below sorts it out.
            Ok(()) | Err(ffi::Errno(libc::EBUSY)) | Err(ffi::Errno(libc::ENOENT)) => {}
            Err(e) => return Err(format!("{who}: cannot break the lock of {prev}: {e}")),
        }
    } else if let Some(o) = owners.first() {
        tracing::info!(
            "{who}: waiting for the exclusive lock held by {o} (a dead owner loses it when its watch expires, about 30 s)"
        );
    }
    image.lock_acquire().map_err(|e| match e.0 {
        libc::EROFS | libc::EBUSY => format!(
            "{who}: the image's exclusive lock is held by a live client ({}); stop it, or serve the image read-only (ro)",
            owners.join(", ")
        ),
        _ => format!("{who}: cannot take the image's exclusive lock: {e}"),
    })?;
    if let (Some(f), Ok(me)) = (owner_file, cluster.addr()) {
        if let Err(e) = std::fs::write(&f, format!("{me}\n")) {
            tracing::warn!(
                "{who}: cannot record the lock owner in {}: {e}",
                f.display()
            );
        }
    }
    Ok(())
}

/// What a failed connection to the cluster says, for `who` connecting with `conf` as
/// `client.ID`.
fn connect_error(
    who: &str,
    conf_path: Option<&std::path::Path>,
    id: &str,
    e: ffi::ConnectError,
) -> String {
    let conf = conf_path
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "the default ceph.conf".into());
    match e {
        ffi::ConnectError::Library(m) => format!("{who}: {m}"),
        ffi::ConnectError::ReadConf(ffi::Errno(libc::ENOENT)) => match conf_path {
            Some(p) => format!("{who}: conf={}: no such file", p.display()),
            None => format!(
                "{who}: no Ceph configuration found ($CEPH_CONF, /etc/ceph/ceph.conf, ~/.ceph/config, ./ceph.conf); give conf=PATH"
            ),
        },
        ffi::ConnectError::ReadConf(e) => format!("{who}: cannot read {conf}: {e}"),
        ffi::ConnectError::Create(e) => format!("{who}: cannot create a cluster handle: {e}"),
        ffi::ConnectError::Set(k, e) => format!("{who}: setting {k}: {e}"),
        ffi::ConnectError::Connect(e) => match e.0 {
            libc::ETIMEDOUT => format!(
                "{who}: cluster unreachable: no monitor of {conf} answered within {CONNECT_TIMEOUT_SECS} s"
            ),
            libc::EACCES | libc::EPERM => format!(
                "{who}: permission denied: the monitors refused client.{id} (check its key in the keyring of {conf})"
            ),
            libc::ENOENT => format!(
                "{who}: no key for client.{id} (no keyring found for it; see `keyring` in {conf})"
            ),
            _ => format!("{who}: cannot connect to the cluster of {conf}: {e}"),
        },
    }
}

impl BlockDevice for RbdBackend {
    fn kind(&self) -> &'static str {
        "rbd"
    }

    fn io_engine(&self) -> Option<&'static str> {
        Some("librbd")
    }

    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn in_flight(&self) -> Option<u64> {
        Some(self.image.in_flight())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            volatile: false,
            // Unmap zeroes (`rbd_aio_write_zeroes` deallocates whole objects and zeroes the
            // rest), so deallocated blocks read back as zeros (LBPRZ).
            unmap: true,
            alignment: 1,
            discards_writes: false,
            write_zeroes: true,
        }
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        Box::pin(async move {
            if len == 0 {
                return Ok(Bytes::new());
            }
            let p = self.image.read(offset, len);
            let (ret, mut op) = self.finish(p, offset, false).await?;
            Ok(op.take_read(ret))
        })
    }

    fn write(&self, offset: u64, data: Bytes, mode: WriteMode) -> IoFuture<'_, ()> {
        self.write_keeping(offset, data, mode, Box::new(()))
    }

    fn write_keeping(
        &self,
        offset: u64,
        data: Bytes,
        mode: WriteMode,
        keep: Keep,
    ) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.may_write()?;
            if data.is_empty() {
                return Ok(());
            }
            let p = self.image.write(offset, data, Some(keep));
            self.finish(p, offset, true).await?;
            if self.cache && mode == WriteMode::Durable {
                self.flush_now().await?;
            }
            Ok(())
        })
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.may_write()?;
            self.flush_now().await
        })
    }

    fn unmap(&self, offset: u64, len: u64) -> IoFuture<'_, ()> {
        self.unmap_keeping(offset, len, Box::new(()))
    }

    fn unmap_keeping(&self, offset: u64, len: u64, keep: Keep) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.may_write()?;
            if len == 0 {
                return Ok(());
            }
            let len = usize::try_from(len).map_err(|_| BackendError::OutOfRange)?;
            let p = self.image.write_zeroes(offset, len, 0, Some(keep));
            self.finish(p, offset, true).await?;
            if self.cache {
                self.flush_now().await?;
            }
            Ok(())
        })
    }

    fn write_zeroes_keeping(
        &self,
        offset: u64,
        len: u64,
        mode: WriteMode,
        keep: Keep,
    ) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.may_write()?;
            if len == 0 {
                return Ok(());
            }
            let len = usize::try_from(len).map_err(|_| BackendError::OutOfRange)?;
            let p = self
                .image
                .write_zeroes(offset, len, ffi::ZEROES_THICK, Some(keep));
            self.finish(p, offset, true).await?;
            if self.cache && mode == WriteMode::Durable {
                self.flush_now().await?;
            }
            Ok(())
        })
    }

    fn can_compare_and_write(&self, offset: u64, len: usize) -> bool {
        // librbd 16 compares and writes atomically only within one 512-byte sector; larger
        // requests are left to the caller (compare and write under its range lock).
        len > 0 && (offset % 512) as usize + len <= 512
    }

    fn compare_and_write_keeping(
        &self,
        offset: u64,
        verify: Bytes,
        data: Bytes,
        mode: WriteMode,
        keep: Keep,
    ) -> IoFuture<'_, Option<u64>> {
        Box::pin(async move {
            self.may_write()?;
            let len = data.len();
            if len != verify.len() || !self.can_compare_and_write(offset, len) {
                return Err(BackendError::Unsupported);
            }
            let p = self
                .image
                .compare_and_write(offset, verify.clone(), data, Some(keep));
            let (ret, _) = self.answer(p, true).await?;
            if ret == -(libc::EILSEQ as isize) {
                // The offset librbd 16 reports is relative to the object, not the request:
                // find the first differing byte from the data as it is now.
                let now = self.read(offset, len).await?;
                let at = now
                    .iter()
                    .zip(verify.iter())
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                return Ok(Some(at as u64));
            }
            if ret < 0 {
                let errno = i32::try_from(-ret).unwrap_or(libc::EIO);
                return Err(self.error(errno, offset, true));
            }
            if self.cache && mode == WriteMode::Durable {
                self.flush_now().await?;
            }
            Ok(None)
        })
    }

    fn resize(&self, new_size: u64) -> Result<(), BackendError> {
        if self.read_only {
            return Err(BackendError::Unsupported);
        }
        self.image
            .resize(new_size)
            .map_err(|e| self.error(e.0, 0, true))?;
        self.size.store(new_size, Ordering::Release);
        Ok(())
    }

    fn size_watch(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.sizes.as_ref().map(|(rx, _)| rx.clone())
    }

    fn map_status(&self, offset: u64, len: u64) -> IoFuture<'_, Vec<(u64, u64, bool)>> {
        Box::pin(async move {
            if len == 0 {
                return Ok(Vec::new());
            }
            let image = Arc::clone(&self.image);
            let extents = tokio::task::spawn_blocking(move || image.allocation(offset, len))
                .await
                .map_err(|e| BackendError::Io(e.to_string()))?
                .map_err(|e| self.error(e.0, offset, false))?;
            let mut out = Vec::new();
            let mut at = offset;
            let end = offset + len;
            for (o, l, exists) in extents {
                let (o, e) = (o.max(at), (o + l).min(end));
                if e <= o {
                    continue;
                }
                if o > at {
                    crate::push_extent(&mut out, at, o - at, false);
                }
                crate::push_extent(&mut out, o, e - o, exists);
                at = e;
            }
            if at < end {
                crate::push_extent(&mut out, at, end - at, false);
            }
            Ok(out)
        })
    }
}
