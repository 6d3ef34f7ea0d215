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
pub(crate) fn write_all_at(
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
pub(crate) fn read_nowait_append(
    file: &impl AsRawFd,
    buf: &mut Vec<u8>,
    len: usize,
    offset: u64,
) -> io::Result<usize> {
    read_append(file, buf, len, offset, libc::RWF_NOWAIT)
}

/// Read up to `len` bytes at `offset` into `buf`'s spare capacity (blocking); returns the
/// bytes appended (fewer only at the end of the file).
pub(crate) fn read_append_blocking(
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
pub(crate) fn past_end() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "read past end of backing store",
    )
}

/// Read exactly `buf.len()` bytes at `offset` (blocking).
pub(crate) fn read_exact_at(
    file: &impl AsRawFd,
    mut buf: &mut [u8],
    mut offset: u64,
) -> io::Result<()> {
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
pub(crate) fn fs_type(file: &impl AsRawFd) -> io::Result<i64> {
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
pub(crate) const TMPFS_MAGIC: i64 = 0x0102_1994;
pub(crate) const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// `statfs.f_type` of FUSE file systems.
pub(crate) const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Deallocate a byte range, keeping the file size (`fallocate(PUNCH_HOLE|KEEP_SIZE)`).
pub(crate) fn punch_hole(file: &impl AsRawFd, offset: u64, len: u64) -> io::Result<()> {
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
pub(crate) fn seek_data_or_hole(
    file: &impl AsRawFd,
    offset: u64,
    data: bool,
) -> io::Result<Option<u64>> {
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

/// A new anonymous file of `size` bytes that holds no pages and can never be written
/// (`memfd_create` with sealing, `ftruncate`, then `F_SEAL_WRITE | F_SEAL_SHRINK |
/// F_SEAL_GROW | F_SEAL_SEAL`): every byte reads as zero for as long as it is open, and
/// `sendfile` from it sends the kernel's shared zero page.
pub(crate) fn sealed_zero_file(name: &std::ffi::CStr, size: u64) -> io::Result<std::fs::File> {
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

/// Hand glibc's free heap memory back to the kernel (`malloc_trim(0)`); memory of another
/// allocator is not its business.
pub(crate) fn malloc_trim() {
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
pub(crate) fn fully_cached(file: &impl AsRawFd, offset: u64, len: u64) -> Option<bool> {
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

/// A shared, writable mapping of the first `len` bytes of a file (`mmap(MAP_SHARED)`), used
/// only by the kernel: a receive system call copies bytes from a socket straight into the
/// file's pages ([`MappedDest`]), a send copies them out ([`iovec`](Self::iovec)). Nothing in
/// user space reads or writes the mapped memory, so a file cut short behind our back cannot
/// raise SIGBUS: the kernel's copy into or out of a page past the end fails with EFAULT
/// instead.
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

    /// Whether nothing is mapped (never: a mapping has at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
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

    /// `len` bytes at byte `at` of the mapping as the destination of a receive system call
    /// ([`MappedDest`]); `None` when the range is not inside the mapping.
    pub fn dest(&self, at: usize, len: usize) -> Option<MappedDest<'_>> {
        at.checked_add(len).filter(|&e| e <= self.len)?;
        Some(MappedDest {
            ptr: self.ptr.as_ptr().cast::<u8>().wrapping_add(at),
            len,
            _map: std::marker::PhantomData,
        })
    }
}

/// `len` writable bytes of a [`Mapping`], for the kernel to write: the destination of a
/// `recv` straight into a file's pages (the server's receive path). It borrows the mapping, so
/// the memory stays mapped while it exists, and it gives out a raw pointer only, never a
/// reference: nothing in user space reads or writes that memory, it is written by system
/// calls alone, and a page past the end of a file cut short behind our back makes such a call
/// fail with EFAULT instead of raising SIGBUS. Only [`Mapping::dest`] makes one, so
/// `ptr .. ptr + len` always lies inside a live mapping.
#[derive(Debug)]
pub struct MappedDest<'a> {
    ptr: *mut u8,
    len: usize,
    _map: std::marker::PhantomData<&'a Mapping>,
}

impl MappedDest<'_> {
    /// The first byte, for a system call to write `len()` bytes from (never to dereference).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Bytes the destination covers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it covers nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Only the first `n` bytes (all of them if there are fewer).
    pub fn first(self, n: usize) -> Self {
        MappedDest {
            len: self.len.min(n),
            ..self
        }
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
