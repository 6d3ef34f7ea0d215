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

use crate::pool::IoPool;
use crate::{sys, BackendError, BlockDevice, Capabilities, FileRange, IoFuture, Keep, WriteMode};
use bytes::Bytes;
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const DIRECT_ALIGN: usize = 4096;

/// One write, on whatever thread calls it: `dsync` writes with RWF_DSYNC, `by_fdatasync`
/// writes and then `fdatasync`s (FUSE), a kernel without RWF_DSYNC for the file falls back to
/// the latter.
fn write_now(
    file: &File,
    data: &[u8],
    offset: u64,
    direct: bool,
    dsync: bool,
    by_fdatasync: bool,
) -> Result<(), BackendError> {
    let res = if direct {
        let (mut v, start) = aligned_vec(data.len());
        v[start..start + data.len()].copy_from_slice(data);
        sys::write_all_at(file, &v[start..start + data.len()], offset, dsync)
    } else {
        sys::write_all_at(file, data, offset, dsync)
    };
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
    /// Number of I/O threads.
    pub io_threads: usize,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions {
            direct: false,
            size: None,
            read_only: false,
            io_threads: 16,
        }
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
    /// the power-loss harness (tests/powerfail) showed loses acknowledged writes.
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
}

/// A buffer whose usable window starts at a 4096-byte boundary, made without `unsafe` by
/// over-allocating and skipping to the first aligned byte.
fn aligned_vec(len: usize) -> (Vec<u8>, usize) {
    let v = vec![0u8; len + DIRECT_ALIGN];
    let start = v.as_ptr().align_offset(DIRECT_ALIGN);
    (v, start)
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
        let pool = IoPool::new("file", opts.io_threads)?;
        let fs_type = sys::fs_type(&file).ok();
        let dsync_by_fdatasync = fs_type.is_none_or(|t| t == sys::FUSE_SUPER_MAGIC);
        let in_memory = !opts.direct
            && !is_block
            && fs_type.is_some_and(|t| t == sys::TMPFS_MAGIC || t == sys::RAMFS_MAGIC);
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
        })
    }

    /// Path of the backing file.
    pub fn path(&self) -> &Path {
        &self.path
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
        }
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        Box::pin(async move {
            if self.direct {
                let file = Arc::clone(&self.file);
                return self
                    .pool
                    .run(move || {
                        let (mut v, start) = aligned_vec(len);
                        sys::read_exact_at(&*file, &mut v[start..start + len], offset)
                            .map_err(|e| BackendError::from_io(&e, offset, false))?;
                        Ok(Bytes::from(v).slice(start..start + len))
                    })
                    .await;
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
            buf.resize(len, 0);
            let file = Arc::clone(&self.file);
            self.pool
                .run(move || {
                    sys::read_exact_at(&*file, &mut buf[got..], offset + got as u64)
                        .map_err(|e| BackendError::from_io(&e, offset, false))?;
                    Ok(Bytes::from(buf))
                })
                .await
        })
    }

    /// Buffered files only: always on tmpfs/ramfs, elsewhere when `cachestat` reports every
    /// page of the range cached. A page evicted between this check and the send (moments
    /// later, under memory pressure) makes that `sendfile` read it from the device on the
    /// connection's thread, where a copied read would have gone to an I/O thread: rare, and
    /// the price of not copying.
    fn read_in_place(&self, offset: u64, len: usize) -> Option<FileRange> {
        if self.direct {
            return None;
        }
        let cached = self.in_memory
            || (self.cachestat.load(std::sync::atomic::Ordering::Relaxed)
                && match sys::fully_cached(&*self.file, offset, len as u64) {
                    Some(c) => c,
                    None => {
                        self.cachestat
                            .store(false, std::sync::atomic::Ordering::Relaxed);
                        false
                    }
                });
        cached.then(|| FileRange {
            file: Arc::clone(&self.file),
            offset,
            len,
        })
    }

    fn write(&self, offset: u64, data: Bytes, mode: WriteMode) -> IoFuture<'_, ()> {
        self.write_keeping(offset, data, mode, Box::new(()))
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
        let file = Arc::clone(&self.file);
        let direct = self.direct;
        let durable = mode == WriteMode::Durable;
        let by_fdatasync = durable && self.dsync_by_fdatasync;
        let dsync = durable && !by_fdatasync;
        if self.in_memory {
            // tmpfs: the write is a copy into memory; no reason to hop to an I/O thread.
            let res = write_now(&file, &data, offset, direct, dsync, by_fdatasync);
            drop(keep);
            return Box::pin(async move { res });
        }
        Box::pin(self.pool.run(move || {
            let res = write_now(&file, &data, offset, direct, dsync, by_fdatasync);
            drop(keep);
            res
        }))
    }

    fn flush(&self) -> IoFuture<'_, ()> {
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

    /// tmpfs files take the inline path (no I/O thread): data round trips, holes read as
    /// zeros, durable and cached writes both land, and a read past the end is an error.
    #[tokio::test]
    async fn tmpfs_file_does_io_inline_and_round_trips() {
        if !Path::new("/dev/shm").is_dir() {
            eprintln!("no /dev/shm: skipped");
            return;
        }
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("lun.img");
        let opts = FileOptions {
            size: Some(8 << 20),
            ..Default::default()
        };
        let be = FileBackend::open(&path, &opts).unwrap();
        assert!(be.in_memory, "a file on /dev/shm is in memory");
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
}
