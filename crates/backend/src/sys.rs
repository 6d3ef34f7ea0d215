//! The thin syscall layer: the only place in the backends with `unsafe`.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::AsRawFd;

fn check(ret: isize) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// `pwritev2(fd, [buf], offset, flags)`.
fn pwritev2(file: &impl AsRawFd, buf: &[u8], offset: u64, flags: libc::c_int) -> io::Result<usize> {
    let iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: `iov` points at `buf`, which stays borrowed (and so alive and unmoved) for the
    // duration of the call; the kernel only reads from it. `fd` is a valid open descriptor
    // owned by `file`, which is borrowed for the call.
    let ret = unsafe { libc::pwritev2(file.as_raw_fd(), &iov, 1, offset as libc::off_t, flags) };
    check(ret)
}

/// `preadv2(fd, [buf], offset, flags)`.
fn preadv2(
    file: &impl AsRawFd,
    buf: &mut [u8],
    offset: u64,
    flags: libc::c_int,
) -> io::Result<usize> {
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: `iov` points at `buf`, exclusively borrowed for the call, so the kernel may write
    // up to `buf.len()` bytes into it; `fd` is a valid descriptor owned by `file`.
    let ret = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, offset as libc::off_t, flags) };
    check(ret)
}

/// Write all of `buf` at `offset`; with `dsync`, each write is durable on return
/// (RWF_DSYNC: the data and the metadata needed to read it are on stable storage).
pub fn write_all_at(
    file: &impl AsRawFd,
    mut buf: &[u8],
    mut offset: u64,
    dsync: bool,
) -> io::Result<()> {
    let flags = if dsync { libc::RWF_DSYNC } else { 0 };
    while !buf.is_empty() {
        match pwritev2(file, buf, offset, flags) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "pwritev2 wrote nothing",
                ))
            }
            Ok(n) => {
                buf = &buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Read at `offset` without blocking (RWF_NOWAIT), appending up to `len` bytes to `buf`'s
/// spare capacity (so a large read buffer is not zeroed before the kernel fills it): returns
/// how many bytes came from the page cache; `Ok(0)` or an error means "go to a worker
/// thread".
pub fn read_nowait_append(
    file: &impl AsRawFd,
    buf: &mut Vec<u8>,
    len: usize,
    offset: u64,
) -> io::Result<usize> {
    read_append(file, buf, len, offset, libc::RWF_NOWAIT)
}

/// Read up to `len` bytes at `offset` into `buf`'s spare capacity (blocking); returns the
/// bytes appended (fewer only at the end of the file).
pub fn read_append_blocking(
    file: &impl AsRawFd,
    buf: &mut Vec<u8>,
    len: usize,
    offset: u64,
) -> io::Result<usize> {
    let mut got = 0;
    while got < len {
        match read_append(file, buf, len - got, offset + got as u64, 0) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

fn read_append(
    file: &impl AsRawFd,
    buf: &mut Vec<u8>,
    len: usize,
    offset: u64,
    flags: libc::c_int,
) -> io::Result<usize> {
    buf.reserve(len);
    let spare = &mut buf.spare_capacity_mut()[..len];
    let iov = libc::iovec {
        iov_base: spare.as_mut_ptr() as *mut libc::c_void,
        iov_len: spare.len(),
    };
    // SAFETY: `iov` covers `len` bytes of `buf`'s spare capacity (reserved above, exclusively
    // borrowed through `spare` for the call); the kernel writes at most that many. `fd` is a
    // valid descriptor owned by `file`.
    let ret = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, offset as libc::off_t, flags) };
    let got = check(ret)?.min(len);
    let new_len = buf.len() + got;
    // SAFETY: the kernel initialised the first `got` bytes of the spare capacity (preadv2
    // returned `got`, never more than `len`), and `new_len` is within the reserved capacity.
    unsafe { buf.set_len(new_len) };
    Ok(got)
}

/// Read exactly `buf.len()` bytes at `offset` (blocking).
pub fn read_exact_at(file: &impl AsRawFd, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match preadv2(file, buf, offset, 0) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "read past end of backing store",
                ))
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The file system type (`statfs.f_type`) of the file system holding `file`.
pub fn fs_type(file: &impl AsRawFd) -> io::Result<i64> {
    // SAFETY: all-zero bytes are a valid `statfs` (a plain C struct of integers).
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, exclusively borrowed `statfs` the kernel fills in; the descriptor
    // is valid and owned by `file`, borrowed for the call.
    let ret = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(st.f_type as i64)
    }
}

/// `statfs.f_type` of tmpfs and ramfs: file systems whose pages live in memory.
pub const TMPFS_MAGIC: i64 = 0x0102_1994;
pub const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// `statfs.f_type` of FUSE file systems.
pub const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Deallocate a byte range, keeping the file size (`fallocate(PUNCH_HOLE|KEEP_SIZE)`).
pub fn punch_hole(file: &impl AsRawFd, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: plain syscall on a valid descriptor owned by `file`; no memory is passed.
    let ret = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `lseek(fd, offset, SEEK_DATA)` (`data = true`) or `SEEK_HOLE`: the next data or hole
/// offset at or after `offset`; `Ok(None)` when there is no more data (ENXIO).
pub fn seek_data_or_hole(file: &impl AsRawFd, offset: u64, data: bool) -> io::Result<Option<u64>> {
    let whence = if data {
        libc::SEEK_DATA
    } else {
        libc::SEEK_HOLE
    };
    // SAFETY: plain syscall on a valid descriptor owned by `file`; no memory is passed. The
    // file position it moves is never used by this crate (all I/O is positional).
    let ret = unsafe { libc::lseek(file.as_raw_fd(), offset as libc::off_t, whence) };
    if ret < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(e);
    }
    Ok(Some(ret as u64))
}

/// Hand the allocator's free memory back to the kernel (glibc `malloc_trim`): used after a
/// RAM LUN frees many chunks, which live in the heap, so the process really shrinks.
/// Returns whether any memory was released.
pub fn release_free_memory() -> bool {
    // SAFETY: malloc_trim takes each arena's own lock (glibc documents it MT-Safe) and reads
    // or writes no memory of ours; it only returns unused pages to the kernel.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// Make glibc's allocator keep freed I/O buffers below `max_buffer` bytes for reuse instead of
/// returning them to the kernel, keeping up to `retain` bytes of free memory per arena.
///
/// By default glibc serves allocations above its (dynamic) mmap threshold with fresh `mmap`s
/// and trims free memory above a few MiB, so every large command buffer (a 512 KiB write's
/// Data-Out, a large read) came as new pages: 128 page faults and a kernel page-zeroing per
/// 512 KiB, about a fifth of the target's CPU at 512K writes. Allocations of `max_buffer` or
/// more still get their own mappings. The RAM backend's 512 KiB chunks live in the heap too
/// (a whole-chunk write keeps its I/O buffer as the chunk); it calls
/// [`release_free_memory`] after unmapping many of them.
///
/// glibc documents `mallopt` as unsafe to call while other threads use the allocator, so
/// this does nothing and returns `false` unless the process has a single thread (call it
/// first thing in `main`); `false` too if glibc refused a value. Nothing depends on it.
pub fn keep_io_buffers(max_buffer: usize, retain: usize) -> bool {
    let single_threaded = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.split_whitespace().eq(["Threads:", "1"].iter().copied()))
    });
    if !single_threaded {
        return false;
    }
    let as_int = |v: usize| libc::c_int::try_from(v).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt only sets allocator parameters from two integers and reads or writes no
    // memory of ours; the process has one thread (checked above), so no other thread is in
    // the allocator while the parameters change.
    let mmap = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, as_int(max_buffer)) };
    // SAFETY: as above.
    let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, as_int(retain)) };
    mmap == 1 && trim == 1
}

/// `cachestat(2)` (Linux 6.5): how many pages of `[offset, offset + len)` are in the page
/// cache. The syscall number is the same on every architecture (new syscalls share one table).
const SYS_CACHESTAT: libc::c_long = 451;

/// Whether every page of `[offset, offset + len)` of `file` is in the page cache now;
/// `None` when the kernel has no `cachestat` (ENOSYS) or the file does not support it.
pub fn fully_cached(file: &impl AsRawFd, offset: u64, len: u64) -> Option<bool> {
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    if len == 0 {
        return Some(true);
    }
    let range = Range { off: offset, len };
    let mut stat = Stat::default();
    // SAFETY: both pointers refer to live, properly laid out (`repr(C)`, the kernel's
    // `struct cachestat_range` / `struct cachestat`) locals borrowed for the call; the kernel
    // reads `range` and writes at most `size_of::<Stat>()` bytes into `stat`. A bad fd or an
    // unknown syscall only makes the call fail.
    let ret = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut stat as *mut Stat,
            0 as libc::c_uint,
        )
    };
    if ret != 0 {
        return None;
    }
    // 4 KiB pages; with larger ones the count comes out too high and the answer is "no", the
    // safe side (the caller then copies).
    let page = 4096u64;
    let pages = (offset + len - 1) / page - offset / page + 1;
    Some(stat.nr_cache >= pages)
}
