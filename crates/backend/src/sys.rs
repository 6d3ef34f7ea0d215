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

/// A read that found the end of the backing file before its last byte.
pub fn past_end() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "read past end of backing store",
    )
}

/// Read exactly `buf.len()` bytes at `offset` (blocking).
pub fn read_exact_at(file: &impl AsRawFd, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match preadv2(file, buf, offset, 0) {
            Ok(0) => return Err(past_end()),
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

/// The process allocator the `ironsan` binary installs (`#[global_allocator]`): mimalloc
/// (<https://github.com/microsoft/mimalloc>, MIT), run without transparent huge pages (see
/// [`no_transparent_huge_pages`]).
///
/// Why (docs/PERFORMANCE.md, "mimalloc"): a command still allocates a few buffers (a read's
/// Data-In, a write's Data-Out, the RAM store's 512 KiB chunks); against glibc's allocator
/// the same binary took about a tenth less CPU per 4K read or write and per 512K read, with
/// the same memory per idle session. glibc kept no freed 512 KiB buffer for reuse unless
/// told to (`mallopt`, which is unsafe once threads run); mimalloc does by itself.
///
/// Rust asks every allocation with its alignment. mimalloc's `mi_malloc_aligned` (what the
/// `mimalloc` crate calls for all of them) takes a slow generic path for any block over 1 KiB,
/// whatever the alignment: a 4 KiB read buffer cost about 250 instructions more than with
/// `mi_malloc` (callgrind, docs/PERFORMANCE.md). mimalloc's blocks are 16-byte aligned once
/// they are 16 bytes or more (`MI_MAX_ALIGN_SIZE`, the first block of a page starts 16-aligned
/// and every size class from 16 bytes is a multiple of 16) and 8-aligned below, so a layout
/// whose alignment is at most 16 and at most its size gets plain `mi_malloc`, as std's own
/// `System` allocator does with `malloc`; anything else the aligned calls.
#[derive(Debug, Default, Clone, Copy)]
pub struct Allocator;

/// The largest alignment plain `mi_malloc` guarantees (mimalloc's `MI_MAX_ALIGN_SIZE`) for a
/// block at least that large; smaller power-of-two sizes are aligned to their size.
const MI_MIN_ALIGN: usize = 16;

impl Allocator {
    /// Whether a block of `size` bytes from plain `mi_malloc`/`mi_zalloc`/`mi_realloc` is
    /// aligned to `align` (the rule above); the one place `alloc`, `alloc_zeroed` and
    /// `realloc` decide between the plain and the `_aligned` calls.
    #[inline]
    fn plain(align: usize, size: usize) -> bool {
        align <= MI_MIN_ALIGN && align <= size
    }
}

// SAFETY: every block handed out comes from mimalloc with at least the layout's size and
// alignment (`plain` above gives the rule under which `mi_malloc`'s natural alignment
// suffices; other layouts use the `_aligned` calls), and every block is returned to mimalloc
// with `mi_free`, which accepts blocks from any of these calls. mimalloc is thread-safe.
unsafe impl std::alloc::GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        use libmimalloc_sys as mi;
        // SAFETY: plain calls into mimalloc with a size and a power-of-two alignment.
        unsafe {
            if Self::plain(layout.align(), layout.size()) {
                mi::mi_malloc(layout.size()).cast()
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        use libmimalloc_sys as mi;
        // SAFETY: as in `alloc`; the block comes back zeroed.
        unsafe {
            if Self::plain(layout.align(), layout.size()) {
                mi::mi_zalloc(layout.size()).cast()
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: std::alloc::Layout) {
        // SAFETY: the caller passes a block this allocator returned (GlobalAlloc's contract),
        // i.e. one from mimalloc, which `mi_free` takes whatever call made it.
        unsafe { libmimalloc_sys::mi_free(ptr.cast()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        use libmimalloc_sys as mi;
        // SAFETY: `ptr` is a live block of this allocator (the caller's contract); the new
        // block keeps the old alignment under the same rule as `alloc`.
        unsafe {
            if Self::plain(layout.align(), new_size) {
                mi::mi_realloc(ptr.cast(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast(), new_size, layout.align()).cast()
            }
        }
    }
}

/// A new anonymous file of `size` bytes that holds no pages and can never be written
/// (`memfd_create` with sealing, `ftruncate`, then `F_SEAL_WRITE | F_SEAL_SHRINK |
/// F_SEAL_GROW | F_SEAL_SEAL`): every byte reads as zero for as long as it is open, and
/// `sendfile` from it sends the kernel's shared zero page.
pub fn sealed_zero_file(name: &std::ffi::CStr, size: u64) -> io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: `name` is a valid NUL-terminated string borrowed for the call; the flags ask for
    // a new descriptor, closed on exec, that may be sealed.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else; the File
    // takes sole ownership and closes it.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(size)?;
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS takes an integer argument and changes only the file's seals; the
    // descriptor is valid and owned by `file`.
    let ret = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// Hand the allocator's free memory back to the kernel: used after a RAM LUN frees many
/// chunks, so the process really shrinks. mimalloc gives freed memory back on its own only
/// while the process keeps allocating; an idle target would keep it. `malloc_trim` does the
/// same for glibc's heap (where the chunks live when this crate runs under the system
/// allocator, as in its own tests).
pub fn release_free_memory() {
    // SAFETY: mi_collect takes no pointers; it walks mimalloc's own structures (each
    // thread's heap is only collected by its thread; the arenas under their locks) and
    // returns unused pages to the kernel. Harmless when mimalloc is not the allocator.
    unsafe { libmimalloc_sys::mi_collect(true) };
    // SAFETY: malloc_trim takes each arena's own lock (glibc documents it MT-Safe) and reads
    // or writes no memory of ours; it only returns unused pages to the kernel.
    unsafe { libc::malloc_trim(0) };
}

/// Keep this process's memory in 4 KiB pages (`prctl(PR_SET_THP_DISABLE)`), whatever the
/// system's transparent-huge-page setting. Returns whether the kernel agreed.
///
/// With huge pages the RAM store's random 4K reads took 4-10 % less CPU, but every first write
/// to a 2 MiB page costs a whole huge page: on VMs that hand free memory back to the host
/// (free page reporting, as on the machine of docs/PERFORMANCE.md) filling a RAM LUN took 2
/// to 4 times the CPU, and resident memory grew in 2 MiB steps. Call it first thing in `main`.
pub fn no_transparent_huge_pages() -> bool {
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments only and changes a flag of this
    // process's address space; no memory of ours is read or written.
    unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0 }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout};

    /// Every layout a program can ask for comes back aligned, usable to its full size,
    /// zeroed when asked, and keeps its bytes and alignment through `realloc`, on both paths
    /// (plain `mi_malloc` and the aligned calls). Each size is allocated many times so blocks
    /// come from different places in mimalloc's pages.
    #[test]
    fn allocator_honours_every_alignment_and_keeps_bytes_through_realloc() {
        let a = Allocator;
        let sizes = [
            1usize,
            2,
            3,
            4,
            7,
            8,
            12,
            16,
            24,
            40,
            48,
            80,
            96,
            112,
            144,
            1000,
            1024,
            1040,
            4096,
            4100,
            6144,
            12288,
            20480,
            65536,
            524288,
            1 << 21,
        ];
        for &size in &sizes {
            for align in [1usize, 2, 4, 8, 16, 32, 64, 2048, 4096] {
                // A Rust layout's size is a multiple of its alignment.
                let size = size.div_ceil(align) * align;
                let layout = Layout::from_size_align(size, align).expect("layout");
                let mut held = Vec::new();
                for round in 0..64u8 {
                    // SAFETY: a non-zero-size layout; the block is freed below with it.
                    let p = unsafe {
                        if round % 2 == 0 {
                            a.alloc(layout)
                        } else {
                            a.alloc_zeroed(layout)
                        }
                    };
                    assert!(!p.is_null(), "size {size} align {align}");
                    assert_eq!(p as usize % align, 0, "size {size} align {align}");
                    // SAFETY: `p` is a live block of `size` bytes.
                    let block = unsafe { std::slice::from_raw_parts_mut(p, size) };
                    if round % 2 == 1 {
                        assert!(block.iter().all(|&b| b == 0), "zeroed {size}/{align}");
                    }
                    block.fill(round);
                    held.push((p, round));
                }
                for (p, round) in held {
                    // SAFETY: `p` is live with `layout`; the new block has `2 * size` bytes.
                    let q = unsafe { a.realloc(p, layout, size * 2) };
                    assert!(!q.is_null());
                    assert_eq!(q as usize % align, 0, "realloc size {size} align {align}");
                    // SAFETY: the first `size` bytes were carried over by realloc.
                    let kept = unsafe { std::slice::from_raw_parts(q, size) };
                    assert!(kept.iter().all(|&b| b == round), "realloc kept bytes");
                    let grown = Layout::from_size_align(size * 2, align).expect("layout");
                    // SAFETY: `q` is live with the grown layout.
                    unsafe { a.dealloc(q, grown) };
                }
            }
        }
    }
}

/// A shared, writable mapping of the first `len` bytes of a file (`mmap(MAP_SHARED)`), used
/// only as a destination for the kernel: [`recv_into`] has the kernel copy received bytes
/// straight into the file's pages. Nothing in user space reads or writes the mapped memory,
/// so a file cut short behind our back cannot raise SIGBUS: the kernel's copy into a page
/// past the end fails with EFAULT instead.
#[derive(Debug)]
pub struct Mapping {
    ptr: std::ptr::NonNull<libc::c_void>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value until `Drop`; the pointer is
// only handed to system calls (never dereferenced in user space), which is sound from any
// thread.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: `&Mapping` only gives out the pointer to system calls.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map the first `len` bytes of `file` shared and writable (`len` > 0). No page is
    /// touched here: a sparse file stays sparse until bytes are received into it.
    pub fn shared(file: &impl AsRawFd, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL), of a descriptor borrowed
        // for the call; the result is checked against MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = std::ptr::NonNull::new(p).ok_or_else(|| io::Error::other("mmap gave NULL"))?;
        Ok(Mapping { ptr, len })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// An `iovec` naming `len` bytes at byte `at` of the mapping, for a system call that reads
    /// them (a vectored send of Data-In); `None` when the range is not inside the mapping.
    /// Making one reads nothing, and nothing in user space reads through it: the kernel's
    /// copy out of a page past the file's end fails with EFAULT.
    pub fn iovec(&self, at: usize, len: usize) -> Option<libc::iovec> {
        at.checked_add(len).filter(|&e| e <= self.len)?;
        Some(libc::iovec {
            iov_base: self.ptr.as_ptr().cast::<u8>().wrapping_add(at).cast(),
            iov_len: len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what `mmap` returned, unmapped once, here; no
        // reference into the memory exists (it is only ever passed to system calls, which
        // have returned by the time the last owner drops it).
        unsafe {
            libc::munmap(self.ptr.as_ptr(), self.len);
        }
    }
}

/// `recv(src, MSG_DONTWAIT)` of at most `len` bytes straight into `map` at byte `at`: the
/// kernel copies from the socket into the mapped file's pages, with no buffer in between.
/// `WouldBlock` when nothing is there; `Ok(0)` at end of stream; EFAULT when the file no
/// longer reaches that far (cut short behind our back).
pub fn recv_into(
    src: std::os::fd::BorrowedFd<'_>,
    map: &Mapping,
    at: usize,
    len: usize,
) -> io::Result<usize> {
    at.checked_add(len)
        .filter(|&e| e <= map.len)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `at + len <= map.len` (checked above), so the kernel writes only inside the
    // mapping, which `map` keeps alive for the call. No Rust reference to that memory exists:
    // it is written only by the kernel, so no aliasing rule is involved. `src` is a borrowed
    // open descriptor.
    let ret = unsafe {
        libc::recv(
            std::os::fd::AsRawFd::as_raw_fd(&src),
            map.ptr.as_ptr().cast::<u8>().add(at).cast::<libc::c_void>(),
            len,
            libc::MSG_DONTWAIT,
        )
    };
    check(ret)
}

/// Bytes waiting in a socket's receive queue (`ioctl(FIONREAD)`).
pub fn bytes_readable(src: std::os::fd::BorrowedFd<'_>) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points at `n`, alive and
    // exclusively borrowed for the call; `src` is a borrowed open descriptor.
    let ret = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&src),
            libc::FIONREAD,
            &mut n as *mut libc::c_int,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// `recv(MSG_PEEK | MSG_DONTWAIT)` of one byte: `true` when a byte is waiting, `false` at end
/// of stream, `WouldBlock` when nothing is, or the socket's error.
pub fn peek_byte(src: std::os::fd::BorrowedFd<'_>) -> io::Result<bool> {
    let mut b = 0u8;
    // SAFETY: the kernel writes at most one byte, into `b`, alive and exclusively borrowed for
    // the call; `src` is a borrowed open descriptor.
    let ret = unsafe {
        libc::recv(
            std::os::fd::AsRawFd::as_raw_fd(&src),
            (&mut b as *mut u8).cast::<libc::c_void>(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    check(ret).map(|n| n > 0)
}
