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

/// Hand the allocator's free memory back to the kernel (the slab's wholly free huge pages and
/// glibc's `malloc_trim`): used after a RAM LUN frees many chunks, so the process really
/// shrinks.
/// Returns whether any memory was released.
pub fn release_free_memory() -> bool {
    let slab = slab().release(&mut Kernel) > 0;
    // SAFETY: malloc_trim takes each arena's own lock (glibc documents it MT-Safe) and reads
    // or writes no memory of ours; it only returns unused pages to the kernel.
    let heap = unsafe { libc::malloc_trim(0) == 1 };
    slab || heap
}

/// Make glibc's allocator keep freed I/O buffers below `max_buffer` bytes for reuse instead of
/// returning them to the kernel, keeping up to `retain` bytes of free memory per arena.
///
/// By default glibc serves allocations above its (dynamic) mmap threshold with fresh `mmap`s
/// and trims free memory above a few MiB, so every large command buffer (a 512 KiB write's
/// Data-Out, a large read) came as new pages: 128 page faults and a kernel page-zeroing per
/// 512 KiB, about a fifth of the target's CPU at 512K writes. Allocations of `max_buffer` or
/// more still get their own mappings. Blocks of exactly 512 KiB (RAM LUN chunks, the buffers
/// of 512 KiB writes) come from [`ChunkAlloc`]'s slab instead when it is the process
/// allocator; the RAM backend calls [`release_free_memory`] after unmapping many chunks.
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

/// The process's huge-page slab (see `slab.rs`): 512 KiB slots, empty until the first one is
/// asked for.
static SLAB: std::sync::Mutex<crate::slab::Slab<{ crate::slab::MAX_SLOTS }>> =
    std::sync::Mutex::new(crate::slab::Slab::new());

/// The slab's memory: one anonymous mapping the kernel backs with huge pages where it can.
struct Kernel;

impl crate::slab::Memory for Kernel {
    /// At most the machine's physical memory: a store larger than that could not be in RAM.
    fn reserve(&mut self, max: usize) -> Option<(usize, usize)> {
        use crate::slab::HUGE_PAGE;
        let len = max.min(physical_memory()) / HUGE_PAGE * HUGE_PAGE;
        if len == 0 {
            return None;
        }
        let span = len.checked_add(HUGE_PAGE)?;
        // SAFETY: a new private anonymous mapping at an address of the kernel's choosing; it
        // aliases nothing of ours. MAP_NORESERVE: only pages written to are backed (and count).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let start = p as usize;
        let base = start.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (base - start, HUGE_PAGE - (base - start));
        // SAFETY: the two ranges are the unaligned ends of the mapping just made, which nothing
        // has seen yet; unmapping them leaves `[base, base + len)` mapped.
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            libc::munmap((base + len) as *mut libc::c_void, tail);
        }
        // SAFETY: advice on our own fresh mapping; MADV_HUGEPAGE changes only how the kernel
        // backs it (and is refused harmlessly where transparent huge pages are off).
        unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        Some((base, len))
    }

    fn discard(&mut self, addr: usize, len: usize) {
        // SAFETY: `[addr, addr + len)` is whole free slots of the slab's mapping (the slab
        // checked that no slot in it is in use), so no live allocation reads it; afterwards
        // it reads as zeros.
        unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED) };
    }
}

/// The physical memory of the machine: the slab reserves no more address space than that.
fn physical_memory() -> usize {
    // SAFETY: `sysinfo` fills the zeroed struct we pass and touches nothing else.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: as above; a pointer to a live, writable `struct sysinfo`.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return 0;
    }
    (info.totalram as usize).saturating_mul(info.mem_unit.max(1) as usize)
}

fn slab() -> std::sync::MutexGuard<'static, crate::slab::Slab<{ crate::slab::MAX_SLOTS }>> {
    SLAB.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether an allocation is served by the slab: exactly one slot (the RAM backend's chunks and
/// the receive buffers of 512 KiB writes, which become chunks).
fn slab_sized(layout: std::alloc::Layout) -> bool {
    layout.size() == crate::slab::SLOT && layout.align() <= 4096
}

/// The process allocator ironsan installs (`#[global_allocator]` in the binary): the system
/// allocator (glibc), except that 512 KiB allocations come from a slab of 2 MiB pages (see
/// `slab.rs` and docs/PERFORMANCE.md, "RAM store in huge pages"). When the slab cannot be
/// reserved or is full, those come from glibc too.
pub struct ChunkAlloc;

impl ChunkAlloc {
    /// Slab slots in use and free (free ones are kept for reuse until
    /// [`release_free_memory`] gives whole huge pages of them back).
    pub fn slots() -> (usize, usize) {
        slab().counts()
    }
}

// SAFETY: every block handed out is either a slab slot (SLOT bytes, 512 KiB-aligned within a
// 2 MiB-aligned mapping, so aligned to any `align <= 4096`, used by no one else until given
// back) or comes from `System`; `dealloc` and `realloc` send a block back to where it came
// from, told apart by the layout (only slab-sized layouts can be slots) and then by address.
unsafe impl std::alloc::GlobalAlloc for ChunkAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if slab_sized(layout) {
            if let Some((addr, _)) = slab().take(&mut Kernel) {
                return addr as *mut u8;
            }
        }
        // SAFETY: the caller's contract (non-zero size) is passed on unchanged.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if slab_sized(layout) {
            if let Some((addr, zeroed)) = slab().take(&mut Kernel) {
                let p = addr as *mut u8;
                if !zeroed {
                    // SAFETY: `p` is a slot of SLOT bytes now owned by this allocation alone.
                    unsafe { std::ptr::write_bytes(p, 0, crate::slab::SLOT) };
                }
                return p;
            }
        }
        // SAFETY: as in `alloc`.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        if slab_sized(layout) && slab().give(ptr as usize) {
            return;
        }
        // SAFETY: not a slot, so `System` allocated it with this layout (caller's contract).
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        let Ok(new_layout) = std::alloc::Layout::from_size_align(new_size, layout.align()) else {
            return std::ptr::null_mut();
        };
        if !slab_sized(layout) && !slab_sized(new_layout) {
            // SAFETY: neither block is a slot, so this is `System`'s own realloc.
            return unsafe { std::alloc::System.realloc(ptr, layout, new_size) };
        }
        // SAFETY: `new_layout` has a non-zero size (the caller's contract for `new_size`).
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are live and distinct, each at least `min` bytes long.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}
