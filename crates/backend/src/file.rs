//! FILEIO and BLOCKIO: a regular file or a block device as a LUN.
//!
//! * Buffered (default): I/O goes through the page cache (the target-side cache that made
//!   small-file workloads several times faster in the classic studies). Reads try
//!   `preadv2(RWF_NOWAIT)` inline first and only go to an I/O thread on a cache miss.
//! * Direct (`direct: true`): the file is opened `O_DIRECT`, bypassing the page cache (BLOCKIO
//!   semantics); buffers are aligned to 4096 bytes.
//!
//! Durable writes use `pwritev2(RWF_DSYNC)` (with O_DIRECT this also reaches through the
//! device's volatile cache via FUA/flush); `flush()` is `fdatasync`.
//!
//! I/O that may block (O_DIRECT, page-cache misses, writes to a device, `fdatasync`) goes to
//! io_uring when the kernel allows it ([`IoEngine::Auto`]), else to a pool of I/O threads.
//! Files on tmpfs/ramfs never block and need neither.

use crate::pool::IoPool;
use crate::uring::{Buf, Ring, SubmitError};
use crate::{
    sys, BackendError, BlockDevice, Capabilities, FileRange, InPlaceRead, InPlaceWrite, IoFuture,
    Keep, SendFrom, WriteMode,
};
use bytes::Bytes;
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const DIRECT_ALIGN: usize = 4096;

/// One write, on whatever thread calls it (`data` as [`for_write`] made it): `dsync` writes
/// with RWF_DSYNC, `by_fdatasync` writes and then `fdatasync`s (FUSE), a kernel without
/// RWF_DSYNC for the file falls back to the latter.
fn write_now(
    file: &File,
    data: &[u8],
    offset: u64,
    dsync: bool,
    by_fdatasync: bool,
) -> Result<(), BackendError> {
    let res = sys::write_all_at(file, data, offset, dsync);
    let res = if by_fdatasync {
        res.and_then(|_| file.sync_data())
    } else {
        res
    };
    match res {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) && dsync => {
            // Kernel without RWF_DSYNC for this file: write, then fdatasync.
            sys::write_all_at(file, data, offset, false)
                .and_then(|_| file.sync_data())
                .map_err(|e| BackendError::from_io(&e, offset, true))
        }
        other => other.map_err(|e| BackendError::from_io(&e, offset, true)),
    }
}

/// How to open a file backend.
#[derive(Debug, Clone)]
pub struct FileOptions {
    /// Bypass the page cache (O_DIRECT).
    pub direct: bool,
    /// Create the file sparse with this size if it does not exist; extend a smaller regular
    /// file to this size. `None`: the file must exist and its size is the LUN size.
    pub size: Option<u64>,
    /// Open read-only.
    pub read_only: bool,
    /// Number of I/O threads (the `threads` engine; with io_uring a pool of 2 still runs
    /// UNMAP and GET LBA STATUS).
    pub io_threads: usize,
    /// What runs I/O that may block.
    pub io_engine: IoEngine,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions {
            direct: false,
            size: None,
            read_only: false,
            io_threads: 16,
            io_engine: IoEngine::Auto,
        }
    }
}

/// What runs a file LUN's I/O that may block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoEngine {
    /// io_uring where the kernel allows it, else threads.
    #[default]
    Auto,
    /// io_uring; opening the LUN fails without it.
    Uring,
    /// A pool of I/O threads doing blocking syscalls.
    Threads,
}

impl std::str::FromStr for IoEngine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(IoEngine::Auto),
            "uring" | "io_uring" => Ok(IoEngine::Uring),
            "threads" => Ok(IoEngine::Threads),
            _ => Err(format!("'{s}': expected auto, uring or threads")),
        }
    }
}

impl std::fmt::Display for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoEngine::Auto => "auto",
            IoEngine::Uring => "uring",
            IoEngine::Threads => "threads",
        })
    }
}

/// A file or block device backend.
#[derive(Debug)]
pub struct FileBackend {
    file: Arc<File>,
    path: PathBuf,
    size: std::sync::atomic::AtomicU64,
    read_only: bool,
    direct: bool,
    punch: bool,
    /// Make durable writes with write + `fdatasync` instead of `RWF_DSYNC`: FUSE in direct-I/O
    /// mode drops the RWF_DSYNC flag (the FUSE server sees a plain WRITE and no FSYNC), which
    /// the power-loss harness (tests/system/powerfail.rs) showed loses acknowledged writes.
    dsync_by_fdatasync: bool,
    /// The file lives on tmpfs/ramfs: its I/O never waits for a device, so it runs inline on
    /// the caller's thread (no I/O-thread hop). Such file systems do not support RWF_NOWAIT.
    in_memory: bool,
    /// `preadv2(RWF_NOWAIT)` works here (cleared the first time it reports EOPNOTSUPP, so a
    /// file system without it does not pay a failing syscall per read).
    nowait_reads: std::sync::atomic::AtomicBool,
    /// `cachestat` works here (cleared when it fails: an older kernel).
    cachestat: std::sync::atomic::AtomicBool,
    pool: IoPool,
    /// io_uring for I/O that may block; `None`: the pool does it.
    ring: Option<Ring>,
    /// Why `auto` found no io_uring (shown at start-up).
    uring_unavailable: Option<String>,
    /// The file mapped shared for writes received in place and reads sent from it
    /// (tmpfs/ramfs only), made at the first such write or read and again when the LUN has
    /// grown past it.
    mapping: std::sync::Mutex<Option<Arc<sys::Mapping>>>,
}

/// An empty buffer for `len` bytes that will start at a 4096-byte boundary (O_DIRECT), made
/// without `unsafe` by over-allocating: its length is the zeroed prefix before that boundary
/// (the returned start); the data is appended after it.
fn aligned_prefix(len: usize) -> (Vec<u8>, usize) {
    let mut v: Vec<u8> = Vec::with_capacity(len + DIRECT_ALIGN);
    let start = v.as_ptr().align_offset(DIRECT_ALIGN);
    v.resize(start, 0);
    (v, start)
}

/// What a write takes its bytes from, and where they start in it: the caller's bytes, or for
/// O_DIRECT an aligned copy when they do not start at a 4096-byte boundary (command buffers
/// of whole pages usually do).
fn for_write(data: Bytes, direct: bool) -> (Buf, usize) {
    if direct && data.as_ptr().align_offset(DIRECT_ALIGN) != 0 {
        let (mut v, start) = aligned_prefix(data.len());
        v.extend_from_slice(&data);
        (Buf::Owned(v), start)
    } else {
        (Buf::Shared(data), 0)
    }
}

/// Append exactly `len` bytes read at `offset` to `buf` (blocking, on an I/O thread).
fn read_rest_blocking(
    file: &File,
    mut buf: Vec<u8>,
    len: usize,
    offset: u64,
) -> Result<Vec<u8>, BackendError> {
    let got = sys::read_append_blocking(file, &mut buf, len, offset)
        .map_err(|e| BackendError::from_io(&e, offset, false))?;
    if got < len {
        return Err(BackendError::from_io(
            &sys::past_end(),
            offset + got as u64,
            false,
        ));
    }
    Ok(buf)
}

impl FileBackend {
    /// Open (or create) the backing file.
    pub fn open(path: &Path, opts: &FileOptions) -> std::io::Result<Self> {
        let exists = path.exists();
        if !exists && opts.size.is_none() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "{} does not exist (give a size to create it)",
                    path.display()
                ),
            ));
        }
        let mut oo = OpenOptions::new();
        oo.read(true).write(!opts.read_only);
        if opts.size.is_some() && !opts.read_only {
            oo.create(true);
        }
        if opts.direct {
            oo.custom_flags(libc::O_DIRECT);
        }
        let mut file = oo.open(path)?;
        let meta = file.metadata()?;
        let is_block = meta.file_type().is_block_device();
        let size = if is_block {
            file.seek(SeekFrom::End(0))?
        } else {
            let cur = meta.len();
            match opts.size {
                Some(want) if want > cur && !opts.read_only => {
                    file.set_len(want)?;
                    want
                }
                // Never beyond the end of a file we may not extend.
                Some(want) => want.min(cur),
                None => cur,
            }
        };
        if size == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{} has size 0", path.display()),
            ));
        }
        let fs_type = sys::fs_type(&file).ok();
        let dsync_by_fdatasync = fs_type.is_none_or(|t| t == sys::FUSE_SUPER_MAGIC);
        let in_memory = !opts.direct
            && !is_block
            && fs_type.is_some_and(|t| t == sys::TMPFS_MAGIC || t == sys::RAMFS_MAGIC);
        let (ring, uring_unavailable) =
            match opts.io_engine {
                // tmpfs/ramfs I/O never blocks: it runs inline whatever the engine.
                IoEngine::Threads => (None, None),
                _ if in_memory => (None, None),
                IoEngine::Uring => (
                    Some(Ring::new().map_err(|e| {
                        std::io::Error::new(e.kind(), format!("io_engine uring: {e}"))
                    })?),
                    None,
                ),
                IoEngine::Auto => match Ring::new() {
                    Ok(r) => (Some(r), None),
                    Err(e) => (None, Some(e.to_string())),
                },
            };
        let threads = if ring.is_some() { 2 } else { opts.io_threads };
        let pool = IoPool::new("file", threads)?;
        Ok(FileBackend {
            file: Arc::new(file),
            path: path.to_owned(),
            size: std::sync::atomic::AtomicU64::new(size),
            read_only: opts.read_only,
            direct: opts.direct,
            punch: !is_block,
            dsync_by_fdatasync,
            in_memory,
            nowait_reads: std::sync::atomic::AtomicBool::new(true),
            cachestat: std::sync::atomic::AtomicBool::new(true),
            pool,
            ring,
            uring_unavailable,
            mapping: std::sync::Mutex::new(None),
        })
    }

    /// Path of the backing file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Why `auto` fell back to threads, if it did.
    pub fn uring_unavailable(&self) -> Option<&str> {
        self.uring_unavailable.as_deref()
    }

    /// The file's shared mapping, covering at least `end` bytes: made on first use with the
    /// LUN's size, remade when the LUN has grown past it; `None` when it cannot be made.
    fn mapping_to(&self, end: u64) -> Option<Arc<sys::Mapping>> {
        let mut m = self.mapping.lock().unwrap_or_else(|p| p.into_inner());
        match &*m {
            Some(map) if map.len() as u64 >= end => Some(Arc::clone(map)),
            _ => {
                let want = usize::try_from(self.size()).ok()?;
                let map = Arc::new(sys::Mapping::shared(&*self.file, want).ok()?);
                *m = Some(Arc::clone(&map));
                Some(map)
            }
        }
    }

    /// Whether `cachestat` reports every page of the range in memory; `false` (and never
    /// asked again) when the kernel has no `cachestat`.
    fn all_cached(&self, offset: u64, len: u64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.cachestat.load(Relaxed) {
            return false;
        }
        sys::fully_cached(&*self.file, offset, len).unwrap_or_else(|| {
            self.cachestat.store(false, Relaxed);
            false
        })
    }

    /// The ring, when there is one and this thread is on a tokio runtime to drive it.
    fn ring(&self) -> Option<&Ring> {
        self.ring.as_ref().filter(|r| r.ensure_driver().is_ok())
    }

    /// Append exactly `len` bytes read at `offset` to `buf`, where the read may wait: on the
    /// ring, else on an I/O thread.
    async fn read_waiting(
        &self,
        buf: Vec<u8>,
        len: usize,
        offset: u64,
    ) -> Result<Vec<u8>, BackendError> {
        match self.ring() {
            Some(ring) => self.ring_read(ring, buf, len, offset).await,
            None => {
                let file = Arc::clone(&self.file);
                self.pool
                    .run(move || read_rest_blocking(&file, buf, len, offset))
                    .await
            }
        }
    }

    /// Read exactly `len` bytes at `offset` through the ring, appended to `buf`.
    async fn ring_read(
        &self,
        ring: &Ring,
        mut buf: Vec<u8>,
        len: usize,
        offset: u64,
    ) -> Result<Vec<u8>, BackendError> {
        let mut got = 0;
        while got < len {
            let at = offset + got as u64;
            let (back, n) = ring
                .read_append(&self.file, buf, len - got, at)
                .await
                .map_err(|e| submit_error(e, at, false))?;
            if n == 0 {
                return Err(BackendError::from_io(&sys::past_end(), at, false));
            }
            buf = back;
            got += n;
        }
        Ok(buf)
    }

    /// One write through the ring, with the same durability choices as [`write_now`].
    async fn ring_write(
        &self,
        ring: &Ring,
        offset: u64,
        data: Bytes,
        dsync: bool,
        by_fdatasync: bool,
        keep: Keep,
    ) -> Result<(), BackendError> {
        let len = data.len();
        let (mut buf, start) = for_write(data, self.direct);
        // RWF_DSYNC: every kernel with io_uring has it (the EOPNOTSUPP fallback of the
        // threads engine is for older ones).
        let mut keep = Some(keep);
        let mut done = 0;
        while done < len {
            let at = offset + done as u64;
            let range = start + done..start + len;
            let r = ring
                .write(&self.file, buf, range, at, dsync, keep.take())
                .await;
            match r {
                Ok((_, _, 0)) => {
                    let e = std::io::Error::new(std::io::ErrorKind::WriteZero, "wrote nothing");
                    return Err(BackendError::from_io(&e, at, true));
                }
                Ok((b, k, n)) => {
                    buf = b;
                    keep = k;
                    done += n;
                }
                Err(e) => return Err(submit_error(e, at, true)),
            }
        }
        if by_fdatasync {
            ring.fdatasync(&self.file)
                .await
                .map_err(|e| submit_error(e, offset, true))?;
        }
        // Like the threads engine: the range lock goes once the write is durable.
        drop(keep);
        Ok(())
    }
}

fn submit_error(e: SubmitError, offset: u64, is_write: bool) -> BackendError {
    match e {
        SubmitError::Io(e) => BackendError::from_io(&e, offset, is_write),
        SubmitError::NoRuntime => BackendError::Io("io_uring without a runtime".into()),
    }
}

impl BlockDevice for FileBackend {
    fn kind(&self) -> &'static str {
        if self.direct {
            "file-direct"
        } else {
            "file"
        }
    }
    /// `io_uring`, `threads`, or `inline` (tmpfs/ramfs: I/O that never blocks).
    fn io_engine(&self) -> Option<&'static str> {
        Some(if self.ring.is_some() {
            "io_uring"
        } else if self.in_memory {
            "inline"
        } else {
            "threads"
        })
    }
    fn size(&self) -> u64 {
        self.size.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Growing past the end of a regular file extends it (sparse, `set_len`); a block device
    /// can grow up to its current size (after e.g. `lvextend`). Shrinking only lowers the LUN
    /// size: the file keeps its bytes.
    fn resize(&self, new_size: u64) -> Result<(), BackendError> {
        let e = |e: std::io::Error| BackendError::Io(e.to_string());
        let meta = self.file.metadata().map_err(e)?;
        let avail = if meta.file_type().is_block_device() {
            (&*self.file).seek(SeekFrom::End(0)).map_err(e)?
        } else {
            meta.len()
        };
        if new_size > avail {
            if self.punch && !self.read_only {
                self.file.set_len(new_size).map_err(e)?;
            } else {
                return Err(BackendError::OutOfRange);
            }
        }
        if new_size == 0 {
            return Err(BackendError::OutOfRange);
        }
        self.size
            .store(new_size, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            volatile: false,
            unmap: self.punch,
            alignment: if self.direct { DIRECT_ALIGN as u32 } else { 1 },
            discards_writes: false,
            write_zeroes: false,
        }
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        Box::pin(async move {
            if self.direct {
                let (v, start) = aligned_prefix(len);
                let v = self.read_waiting(v, len, offset).await?;
                return Ok(Bytes::from(v).slice(start..start + len));
            }
            use std::sync::atomic::Ordering::Relaxed;
            // Page-cache hit: no thread hop, and no zeroing of a buffer the kernel fills.
            let mut buf = Vec::with_capacity(len);
            let got = if self.in_memory {
                sys::read_append_blocking(&*self.file, &mut buf, len, offset)
                    .map_err(|e| BackendError::from_io(&e, offset, false))?
            } else if self.nowait_reads.load(Relaxed) {
                match sys::read_nowait_append(&*self.file, &mut buf, len, offset) {
                    Ok(n) => n,
                    Err(e) => {
                        if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                            self.nowait_reads.store(false, Relaxed);
                        }
                        0
                    }
                }
            } else {
                0
            };
            if got == len {
                return Ok(Bytes::from(buf));
            }
            // A page-cache miss: the rest is read where it may wait.
            let buf = self
                .read_waiting(buf, len - got, offset + got as u64)
                .await?;
            Ok(Bytes::from(buf))
        })
    }

    /// Buffered files only. From the page cache (`sendfile`): always on tmpfs/ramfs,
    /// elsewhere when `cachestat` reports every page of the range cached. A page evicted
    /// between this check and the send (moments later, under memory pressure) makes that
    /// `sendfile` read it from the device on the connection's thread, where a copied read
    /// would have gone to an I/O thread: rare, and the price of not copying. From the mapping:
    /// tmpfs/ramfs only, and only when every page of the range exists (`cachestat`), so a
    /// hole is never allocated by the send's read fault and a swapped-out page is read the
    /// usual way.
    fn read_in_place(&self, offset: u64, len: usize, how: InPlaceRead) -> Option<FileRange> {
        if self.direct {
            return None;
        }
        let end = offset.checked_add(len as u64)?;
        let map = match how.from {
            SendFrom::PageCache if self.in_memory || self.all_cached(offset, len as u64) => None,
            SendFrom::Mapping
                if self.in_memory && end <= self.size() && self.all_cached(offset, len as u64) =>
            {
                Some(self.mapping_to(end)?)
            }
            _ => return None,
        };
        Some(FileRange {
            file: Arc::clone(&self.file),
            offset,
            len,
            map,
        })
    }

    fn write(&self, offset: u64, data: Bytes, mode: WriteMode) -> IoFuture<'_, ()> {
        self.write_keeping(offset, data, mode, Box::new(()))
    }

    /// tmpfs/ramfs files only: there the kernel's copy from the socket into the file's pages
    /// never waits for a device, like the inline writes.
    fn can_write_in_place(&self) -> bool {
        self.in_memory && !self.read_only
    }

    /// The mapping covers the LUN's size when it is made (remade larger when the LUN has grown
    /// past it); a mapping that cannot be made means `None` (the write takes the usual path).
    fn write_in_place(&self, offset: u64, len: usize) -> Option<InPlaceWrite> {
        if !self.can_write_in_place() || len == 0 {
            return None;
        }
        let end = offset.checked_add(len as u64)?;
        if end > self.size() {
            return None;
        }
        let map = self.mapping_to(end)?;
        Some(InPlaceWrite::new(Arc::clone(&self.file), map, offset, len))
    }

    /// `keep` goes with the job to the I/O thread and is dropped there when the syscall has
    /// returned: a `pwritev2` cannot be cancelled, so dropping the future must not release it.
    fn write_keeping(
        &self,
        offset: u64,
        data: Bytes,
        mode: WriteMode,
        keep: Keep,
    ) -> IoFuture<'_, ()> {
        let durable = mode == WriteMode::Durable;
        let by_fdatasync = durable && self.dsync_by_fdatasync;
        let dsync = durable && !by_fdatasync;
        if let Some(ring) = self.ring() {
            return Box::pin(self.ring_write(ring, offset, data, dsync, by_fdatasync, keep));
        }
        let file = Arc::clone(&self.file);
        if self.in_memory {
            // tmpfs: the write is a copy into memory; no reason to hop to an I/O thread.
            let res = write_now(&file, &data, offset, dsync, by_fdatasync);
            drop(keep);
            return Box::pin(async move { res });
        }
        let (buf, start) = for_write(data, self.direct);
        Box::pin(self.pool.run(move || {
            let res = write_now(&file, &buf.bytes()[start..], offset, dsync, by_fdatasync);
            drop(keep);
            res
        }))
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        if let Some(ring) = self.ring() {
            return Box::pin(async move {
                ring.fdatasync(&self.file)
                    .await
                    .map_err(|e| submit_error(e, 0, true))
            });
        }
        let file = Arc::clone(&self.file);
        Box::pin(self.pool.run(move || {
            file.sync_data()
                .map_err(|e| BackendError::Io(e.to_string()))
        }))
    }

    fn map_status(&self, offset: u64, len: u64) -> IoFuture<'_, Vec<(u64, u64, bool)>> {
        if !self.punch {
            // Block devices: no hole information.
            return Box::pin(async move { Ok(vec![(offset, len, true)]) });
        }
        let file = Arc::clone(&self.file);
        Box::pin(self.pool.run(move || {
            file_map(&file, offset, offset + len).map_err(|e| BackendError::Io(e.to_string()))
        }))
    }

    fn unmap(&self, offset: u64, len: u64) -> IoFuture<'_, ()> {
        self.unmap_keeping(offset, len, Box::new(()))
    }

    /// As for [`write_keeping`](Self::write_keeping): `keep` lives until `fallocate` returned.
    fn unmap_keeping(&self, offset: u64, len: u64, keep: Keep) -> IoFuture<'_, ()> {
        if !self.punch {
            return Box::pin(async { Err(BackendError::Unsupported) });
        }
        let file = Arc::clone(&self.file);
        Box::pin(self.pool.run(move || {
            let res = sys::punch_hole(&*file, offset, len).map_err(|e| match e.raw_os_error() {
                Some(libc::EOPNOTSUPP) => BackendError::Unsupported,
                _ => BackendError::Io(e.to_string()),
            });
            drop(keep);
            res
        }))
    }
}

/// Data/hole extents of `[offset, end)` by `SEEK_DATA`/`SEEK_HOLE`. A file system without
/// them (EINVAL) reports everything mapped.
fn file_map(file: &File, offset: u64, end: u64) -> std::io::Result<Vec<(u64, u64, bool)>> {
    let mut out = Vec::new();
    let mut pos = offset;
    while pos < end {
        let data = match sys::seek_data_or_hole(file, pos, true) {
            Ok(d) => d.unwrap_or(end).min(end),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                crate::push_extent(&mut out, pos, end - pos, true);
                break;
            }
            Err(e) => return Err(e),
        };
        crate::push_extent(&mut out, pos, data - pos, false);
        if data >= end {
            break;
        }
        let hole = sys::seek_data_or_hole(file, data, false)?
            .unwrap_or(end)
            .min(end);
        crate::push_extent(&mut out, data, hole - data, true);
        pos = hole;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new 8 MiB LUN file on tmpfs (`/dev/shm`), or `None` (the test skips) without one.
    fn tmpfs_lun() -> Option<(tempfile::TempDir, PathBuf, FileBackend)> {
        if !Path::new("/dev/shm").is_dir() {
            ironsan_testkit::skip("no /dev/shm (tmpfs) for an in-memory LUN file");
            return None;
        }
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("lun.img");
        let opts = FileOptions {
            size: Some(8 << 20),
            ..Default::default()
        };
        let be = FileBackend::open(&path, &opts).unwrap();
        assert!(be.in_memory, "a file on /dev/shm is in memory");
        Some((dir, path, be))
    }

    /// tmpfs files take the inline path (no I/O thread): data round trips, holes read as
    /// zeros, durable and cached writes both land, and a read past the end is an error.
    #[tokio::test]
    async fn tmpfs_file_does_io_inline_and_round_trips() {
        let Some((_dir, path, be)) = tmpfs_lun() else {
            return;
        };
        let a = Bytes::from(vec![0xa5u8; 512 * 1024]);
        be.write(4096, a.clone(), WriteMode::Durable).await.unwrap();
        let b = Bytes::from((0..4096u32).map(|i| i as u8).collect::<Vec<u8>>());
        be.write(1 << 20, b.clone(), WriteMode::Cached)
            .await
            .unwrap();
        assert_eq!(be.read(4096, a.len()).await.unwrap(), a);
        assert_eq!(be.read(1 << 20, 4096).await.unwrap(), b);
        let hole = be.read(4 << 20, 65536).await.unwrap();
        assert!(hole.iter().all(|&x| x == 0));
        assert_eq!(std::fs::read(&path).unwrap()[4096..4096 + a.len()], a[..]);
        assert!(be.read((8 << 20) - 512, 4096).await.is_err());
    }

    /// Reads to send from the file's mapping: only over pages of a tmpfs file that exist (a
    /// hole stays a hole: the send's read fault would allocate it), with a mapping that covers
    /// the range; from the page cache, holes included, without one; never for a disk file.
    #[tokio::test]
    async fn reads_in_place_from_the_mapping_only_over_existing_tmpfs_pages() {
        use std::os::unix::fs::MetadataExt;
        let Some((_dir, path, be)) = tmpfs_lun() else {
            return;
        };
        be.write(1 << 20, Bytes::from(vec![7u8; 1 << 20]), WriteMode::Cached)
            .await
            .unwrap();
        let blocks = std::fs::metadata(&path).unwrap().blocks();
        let hole = be.read_in_place(4 << 20, 512 << 10, SendFrom::Mapping.into());
        assert!(
            hole.is_none(),
            "a hole of a tmpfs file is not sent from the mapping"
        );
        let part = be.read_in_place((2 << 20) - 4096, 8192, SendFrom::Mapping.into());
        assert!(part.is_none(), "half written, half hole: copied");
        let r = be
            .read_in_place(1 << 20, 1 << 20, SendFrom::Mapping.into())
            .expect("written pages of a tmpfs file are sent from the mapping");
        let map = r.map.as_ref().expect("with the file's mapping");
        assert!(map.len() >= 2 << 20 && map.iovec(1 << 20, 1 << 20).is_some());
        assert!(be
            .read_in_place(8 << 20, 4096, SendFrom::Mapping.into())
            .is_none());
        let r = be
            .read_in_place(4 << 20, 512 << 10, SendFrom::PageCache.into())
            .expect("tmpfs sends holes from the page cache (as zeros)");
        assert!(r.map.is_none());
        assert_eq!(
            std::fs::metadata(&path).unwrap().blocks(),
            blocks,
            "nothing allocated"
        );

        let dir = tempfile::tempdir().unwrap();
        let opts = FileOptions {
            size: Some(8 << 20),
            ..Default::default()
        };
        let be = FileBackend::open(&dir.path().join("disk.img"), &opts).unwrap();
        if !be.in_memory {
            be.write(0, Bytes::from(vec![1u8; 1 << 20]), WriteMode::Cached)
                .await
                .unwrap();
            assert!(be
                .read_in_place(0, 1 << 20, SendFrom::Mapping.into())
                .is_none());
        }
    }

    #[tokio::test]
    async fn creates_sparse_file_and_round_trips_data() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lun0.img");
        let opts = FileOptions {
            size: Some(1 << 30),
            ..Default::default()
        };
        let be = FileBackend::open(&path, &opts).unwrap();
        assert_eq!(be.size(), 1 << 30);
        // Sparse: almost nothing allocated on disk.
        use std::os::unix::fs::MetadataExt;
        assert!(std::fs::metadata(&path).unwrap().blocks() < 64);
        let data = Bytes::from((0..8192u32).map(|i| (i % 253) as u8).collect::<Vec<u8>>());
        be.write(4096, data.clone(), WriteMode::Durable)
            .await
            .unwrap();
        assert_eq!(be.read(4096, 8192).await.unwrap(), data);
        be.flush().await.unwrap();
        drop(be);
        // Reopen without a size: size comes from the file, data persisted.
        let be = FileBackend::open(&path, &FileOptions::default()).unwrap();
        assert_eq!(be.size(), 1 << 30);
        assert_eq!(be.read(4096, 8192).await.unwrap(), data);
        be.unmap(0, 1 << 20).await.unwrap();
        assert!(be.read(4096, 8192).await.unwrap().iter().all(|&b| b == 0));
    }

    #[tokio::test]
    async fn map_status_reports_holes_and_data() {
        let dir = tempfile::tempdir().unwrap();
        let opts = FileOptions {
            size: Some(8 << 20),
            ..Default::default()
        };
        let be = FileBackend::open(&dir.path().join("m.img"), &opts).unwrap();
        be.write(1 << 20, Bytes::from(vec![9u8; 1 << 20]), WriteMode::Durable)
            .await
            .unwrap();
        let m = be.map_status(0, 8 << 20).await.unwrap();
        let total: u64 = m.iter().map(|e| e.1).sum();
        assert_eq!(total, 8 << 20);
        let mapped: Vec<_> = m.iter().filter(|e| e.2).collect();
        // tmpfs and ext4/xfs report the written MiB as data (possibly rounded to pages).
        assert!(
            mapped
                .iter()
                .any(|e| e.0 <= 1 << 20 && e.0 + e.1 >= 2 << 20),
            "{m:?}"
        );
        assert!(!m[0].2, "{m:?}");
    }

    #[tokio::test]
    async fn missing_file_without_size_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = FileBackend::open(&dir.path().join("nope"), &FileOptions::default()).unwrap_err();
        assert!(err.to_string().contains("does not exist"));
    }

    #[tokio::test]
    async fn direct_mode_round_trips_when_the_filesystem_supports_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("direct.img");
        let opts = FileOptions {
            size: Some(1 << 20),
            direct: true,
            ..Default::default()
        };
        match FileBackend::open(&path, &opts) {
            Ok(be) => {
                let data = Bytes::from(vec![0x5au8; 4096]);
                be.write(8192, data.clone(), WriteMode::Durable)
                    .await
                    .unwrap();
                assert_eq!(be.read(8192, 4096).await.unwrap(), data);
            }
            // tmpfs on older kernels refuses O_DIRECT at open.
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EINVAL)),
        }
    }

    /// A directory on a disk file system (not tmpfs, whose I/O runs inline whatever the
    /// engine), or `None` with a note when there is none.
    fn disk_dir() -> Option<tempfile::TempDir> {
        for base in ["/var/tmp", "/tmp", "."] {
            let Ok(dir) = tempfile::tempdir_in(base) else {
                continue;
            };
            let f = File::create(dir.path().join("probe")).unwrap();
            let t = sys::fs_type(&f).unwrap_or(0);
            if t != sys::TMPFS_MAGIC && t != sys::RAMFS_MAGIC {
                return Some(dir);
            }
        }
        ironsan_testkit::skip(
            "no disk file system (not tmpfs or ramfs) under /var/tmp, /tmp or . for a scratch file",
        );
        None
    }

    fn engine_opts(engine: IoEngine, direct: bool) -> FileOptions {
        FileOptions {
            size: Some(16 << 20),
            direct,
            io_threads: 2,
            io_engine: engine,
            ..Default::default()
        }
    }

    /// Both engines, buffered and O_DIRECT, on a disk file: writes from aligned and unaligned
    /// buffers, durable and cached, land where they should; reads of data, of holes and
    /// across both come back right; flush works; a read past the end fails.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn both_engines_round_trip_buffered_and_direct_io() {
        let Some(dir) = disk_dir() else { return };
        for engine in [IoEngine::Uring, IoEngine::Threads] {
            for direct in [false, true] {
                let path = dir.path().join(format!("{engine}-{direct}.img"));
                let be = match FileBackend::open(&path, &engine_opts(engine, direct)) {
                    Ok(be) => be,
                    Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => continue,
                    Err(e) => panic!("{engine} direct={direct}: {e}"),
                };
                let want = if engine == IoEngine::Uring {
                    "io_uring"
                } else {
                    "threads"
                };
                assert_eq!(be.io_engine(), Some(want));
                let what = format!("{engine} direct={direct}");
                let pattern: Vec<u8> = (0..(256 << 10) + 1).map(|i| (i % 251) as u8).collect();
                // Offset 1 into the allocation: never 4096-aligned, so O_DIRECT must copy.
                let unaligned = Bytes::from(pattern).slice(1..);
                be.write(1 << 20, unaligned.clone(), WriteMode::Durable)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: {e:?}"));
                let aligned = Bytes::from(vec![0xa5u8; 64 << 10]);
                be.write(4 << 20, aligned.clone(), WriteMode::Cached)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: {e:?}"));
                be.flush().await.unwrap_or_else(|e| panic!("{what}: {e:?}"));
                assert_eq!(
                    be.read(1 << 20, 256 << 10).await.unwrap(),
                    unaligned,
                    "{what}"
                );
                assert_eq!(be.read(4 << 20, 64 << 10).await.unwrap(), aligned, "{what}");
                let edge = be.read((4 << 20) - 4096, 8192).await.unwrap();
                assert!(edge[..4096].iter().all(|&b| b == 0), "{what}: hole");
                assert_eq!(&edge[4096..], &aligned[..4096], "{what}");
                // What the file holds, read without ironsan.
                let on_disk = std::fs::read(&path).unwrap();
                assert_eq!(&on_disk[1 << 20..(1 << 20) + (256 << 10)], &unaligned[..]);
                let err = be.read((16 << 20) - 4096, 8192).await;
                assert!(err.is_err(), "{what}: read past the end");
            }
        }
    }

    /// More operations at once than the ring has entries (256): the rest wait for a slot,
    /// none is lost, each read returns its own block.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn uring_takes_more_operations_than_the_ring_holds() {
        let Some(dir) = disk_dir() else { return };
        let path = dir.path().join("many.img");
        let be = Arc::new(FileBackend::open(&path, &engine_opts(IoEngine::Uring, true)).unwrap());
        let block = |i: usize| Bytes::from(vec![(i % 255) as u8 + 1; 4096]);
        let mut set = tokio::task::JoinSet::new();
        for i in 0..1000usize {
            let be = Arc::clone(&be);
            set.spawn(async move {
                be.write(i as u64 * 4096, block(i), WriteMode::Durable)
                    .await
                    .unwrap();
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        for i in 0..1000usize {
            let be = Arc::clone(&be);
            set.spawn(async move {
                assert_eq!(
                    be.read(i as u64 * 4096, 4096).await.unwrap(),
                    block(i),
                    "block {i}"
                );
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
    }

    /// Reads dropped after they were submitted (an aborted command) leave their buffers to
    /// the ring; the next reads are right, and dropping the backend with reads in flight is
    /// safe.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_uring_operations_leave_the_ring_consistent() {
        let Some(dir) = disk_dir() else { return };
        let path = dir.path().join("drop.img");
        let be = FileBackend::open(&path, &engine_opts(IoEngine::Uring, true)).unwrap();
        let data = Bytes::from(vec![0x3cu8; 128 << 10]);
        be.write(0, data.clone(), WriteMode::Durable).await.unwrap();
        for round in 0..3 {
            let mut futs: Vec<_> = (0..64).map(|_| be.read(0, 128 << 10)).collect();
            for f in &mut futs {
                // Poll once: the read is submitted; then it is dropped in flight.
                tokio::select! { biased; _ = f => {}, _ = async {} => {} }
            }
            drop(futs);
            assert_eq!(be.read(0, 128 << 10).await.unwrap(), data, "round {round}");
        }
        let mut futs: Vec<_> = (0..64).map(|_| be.read(0, 128 << 10)).collect();
        for f in &mut futs {
            tokio::select! { biased; _ = f => {}, _ = async {} => {} }
        }
        drop(futs);
        drop(be);
        let be = FileBackend::open(&path, &engine_opts(IoEngine::Uring, true)).unwrap();
        assert_eq!(be.read(0, 128 << 10).await.unwrap(), data);
    }

    /// Off a tokio runtime (another executor, like the fault wrapper's workers) the ring has
    /// no driver: I/O goes to the pool.
    #[test]
    fn uring_backend_works_off_a_tokio_runtime() {
        use crate::fault::block_on;
        let Some(dir) = disk_dir() else { return };
        let path = dir.path().join("plain.img");
        let be = FileBackend::open(&path, &engine_opts(IoEngine::Uring, true)).unwrap();
        let data = Bytes::from(vec![7u8; 8192]);
        block_on(be.write(8192, data.clone(), WriteMode::Durable)).unwrap();
        assert_eq!(block_on(be.read(8192, 8192)).unwrap(), data);
        block_on(be.flush()).unwrap();
    }

    /// On a tokio runtime built without I/O the ring cannot have a driver: nothing is
    /// submitted to it, the pool does the I/O (no hang waiting for a completion nobody reaps).
    #[test]
    fn uring_backend_works_on_a_runtime_without_io() {
        let Some(dir) = disk_dir() else { return };
        let path = dir.path().join("noio.img");
        let be = FileBackend::open(&path, &engine_opts(IoEngine::Uring, true)).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let data = Bytes::from(vec![9u8; 8192]);
        rt.block_on(async {
            be.write(0, data.clone(), WriteMode::Durable).await.unwrap();
            assert_eq!(be.read(0, 8192).await.unwrap(), data);
            be.flush().await.unwrap();
        });
    }
}
