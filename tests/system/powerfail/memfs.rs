//! A one-file FUSE file system with a volatile write cache, to emulate power loss.
//!
//! `/disk.img` (fixed size, sparse, in memory) keeps two layers of 4 KiB pages: `durable`
//! and `dirty`. WRITE goes to `dirty`; FSYNC (fsync or fdatasync) moves every dirty page to
//! `durable`; FLUSH (close) does **not** (close is not a durability point). [`PowerFs::cut`]
//! throws `dirty` away: what a power failure does to a volatile cache.
//!
//! Opening mode (found by experiment, kernel 6.x, writeback_cache off):
//! * default (`direct_io = false`): writes are write-through (every write() is a WRITE
//!   request before it returns) and a pwritev2(RWF_DSYNC) arrives as WRITE followed by
//!   FSYNC(datasync) (the kernel's generic_write_sync). Reads may come from the kernel's page
//!   cache, which is dropped on the next open (no FOPEN_KEEP_CACHE), i.e. when the restarted
//!   target opens the file again, so it cannot hide a cut.
//! * `direct_io = true` (FOPEN_DIRECT_IO): the kernel does **not** turn RWF_DSYNC into an
//!   FSYNC: the write arrives as a plain WRITE and nothing tells the server it had to be
//!   durable. A target on such a file system loses acknowledged writes on power loss; the test
//!   `fuse_direct_io_drops_rwf_dsync` records this.
//!
//! Counted in [`Stats`], which the tests use to show that the flushes are issued.

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, LockOwner, OpenFlags,
    ReplyAttr, ReplyData, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, WriteFlags,
};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

const PAGE: u64 = 4096;
pub(crate) const FILE_NAME: &str = "disk.img";
const FILE_INO: u64 = 2;

/// Request counters.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Stats {
    pub writes: u64,
    pub fsyncs: u64,
    pub fdatasyncs: u64,
    pub flushes: u64,
    pub cuts: u64,
    /// Dirty pages thrown away by cuts.
    pub pages_lost: u64,
}

#[derive(Default)]
struct State {
    durable: HashMap<u64, Box<[u8]>>,
    dirty: HashMap<u64, Box<[u8]>>,
    stats: Stats,
}

/// Handle shared by the FUSE server thread and the test.
#[derive(Clone)]
pub(crate) struct PowerFs {
    st: Arc<Mutex<State>>,
    size: u64,
    direct_io: bool,
}

impl PowerFs {
    pub(crate) fn new(size: u64, direct_io: bool) -> Self {
        PowerFs {
            st: Arc::default(),
            size,
            direct_io,
        }
    }
    /// Power failure: every write not yet covered by an FSYNC is gone.
    pub(crate) fn cut(&self) {
        let mut s = self.st.lock().unwrap();
        s.stats.pages_lost += s.dirty.len() as u64;
        s.stats.cuts += 1;
        s.dirty.clear();
    }
    pub(crate) fn stats(&self) -> Stats {
        self.st.lock().unwrap().stats
    }
    fn attr(&self, ino: u64) -> FileAttr {
        let (kind, size, perm, nlink) = if ino == 1 {
            (FileType::Directory, 0, 0o755, 2)
        } else {
            (FileType::RegularFile, self.size, 0o644, 1)
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size / 512,
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

const TTL: Duration = Duration::from_secs(1);

impl Filesystem for PowerFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent.0 == 1 && name.to_str() == Some(FILE_NAME) {
            reply.entry(&TTL, &self.attr(FILE_INO), fuser::Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }
    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match ino.0 {
            1 | FILE_INO => reply.attr(&TTL, &self.attr(ino.0)),
            _ => reply.error(Errno::ENOENT),
        }
    }
    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let flags = if self.direct_io {
            FopenFlags::FOPEN_DIRECT_IO
        } else {
            FopenFlags::empty()
        };
        reply.opened(FileHandle(0), flags);
    }
    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let end = (offset + u64::from(size)).min(self.size);
        let mut out = vec![0u8; end.saturating_sub(offset) as usize];
        let s = self.st.lock().unwrap();
        let mut pos = offset;
        while pos < end {
            let page = pos / PAGE;
            let within = (pos % PAGE) as usize;
            let n = ((PAGE - pos % PAGE).min(end - pos)) as usize;
            if let Some(p) = s.dirty.get(&page).or_else(|| s.durable.get(&page)) {
                let at = (pos - offset) as usize;
                out[at..at + n].copy_from_slice(&p[within..within + n]);
            }
            pos += n as u64;
        }
        reply.data(&out);
    }
    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if offset + data.len() as u64 > self.size {
            reply.error(Errno::EFBIG);
            return;
        }
        let mut s = self.st.lock().unwrap();
        s.stats.writes += 1;
        let mut pos = offset;
        let end = offset + data.len() as u64;
        while pos < end {
            let page = pos / PAGE;
            let within = (pos % PAGE) as usize;
            let n = ((PAGE - pos % PAGE).min(end - pos)) as usize;
            if !s.dirty.contains_key(&page) {
                let base = s
                    .durable
                    .get(&page)
                    .cloned()
                    .unwrap_or_else(|| vec![0u8; PAGE as usize].into_boxed_slice());
                s.dirty.insert(page, base);
            }
            let at = (pos - offset) as usize;
            s.dirty.get_mut(&page).unwrap()[within..within + n].copy_from_slice(&data[at..at + n]);
            pos += n as u64;
        }
        reply.written(data.len() as u32);
    }
    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        self.st.lock().unwrap().stats.flushes += 1;
        reply.ok();
    }
    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let mut s = self.st.lock().unwrap();
        if datasync {
            s.stats.fdatasyncs += 1;
        } else {
            s.stats.fsyncs += 1;
        }
        let dirty = std::mem::take(&mut s.dirty);
        s.durable.extend(dirty);
        reply.ok();
    }
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.attr(&TTL, &self.attr(ino.0));
    }
}

/// Mount `fs` at `dir` (as root, by mount(2); no fusermount needed). Unmounted when dropped.
pub(crate) fn mount(
    fs: PowerFs,
    dir: &std::path::Path,
) -> std::io::Result<fuser::BackgroundSession> {
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        fuser::MountOption::FSName("ironsan-powerfail".into()),
        fuser::MountOption::RW,
    ];
    cfg.n_threads = Some(1);
    fuser::spawn_mount(fs, dir, &cfg)
}
