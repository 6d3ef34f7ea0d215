//! The server crate's only `unsafe`: getsockopt(TCP_INFO) for the admin view, the two
//! sends of zero-copy Data-In (`sendmsg` with MSG_MORE for the headers before a file range,
//! `sendfile` for the range), the receive of Data-Out straight into a file's mapped pages
//! (`recv`, with `ioctl(FIONREAD)` and a one-byte peek to decide how much), and the monotonic
//! clock as nanoseconds for the per-command stage stamps. Kept thin: one call each, no
//! pointers kept.

#![allow(unsafe_code)]

use ironsan_backend::MappedDest;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};

fn check(ret: isize) -> std::io::Result<usize> {
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// `clock_gettime(CLOCK_MONOTONIC)` in nanoseconds: the clock `std::time::Instant` reads, as
/// a plain integer, so the five stamps of every command and their differences cost integer
/// arithmetic (`Instant`'s checked subtraction was about 3 % of a 4K read's instructions).
#[inline]
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a live local the call writes (a `struct timespec`); CLOCK_MONOTONIC
    // always exists on Linux, so the call cannot fail and `ts` stays valid either way.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// The memory one vectored send reads, as `iovec`s that each borrow what they name for `'a`:
/// a byte slice, or a range of a file's shared mapping (which nothing in user space reads; a
/// page of it past the file's end makes the send fail with EFAULT). Only these two can be
/// added, so every `iovec` [`send_iovecs`] hands the kernel names memory alive for the call.
#[derive(Debug, Default)]
pub(crate) struct SendList<'a> {
    iov: Vec<libc::iovec>,
    _borrows: std::marker::PhantomData<&'a [u8]>,
}

impl<'a> SendList<'a> {
    pub(crate) fn push_slice(&mut self, s: &'a [u8]) {
        self.iov.push(libc::iovec {
            iov_base: s.as_ptr() as *mut libc::c_void,
            iov_len: s.len(),
        });
    }

    /// `len` bytes at byte `at` of `map`; false (nothing added) when that is not inside it.
    pub(crate) fn push_mapped(
        &mut self,
        map: &'a ironsan_backend::Mapping,
        at: usize,
        len: usize,
    ) -> bool {
        match map.iovec(at, len) {
            Some(v) => {
                self.iov.push(v);
                true
            }
            None => false,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.iov.is_empty()
    }
}

/// `sendmsg(fd, list, MSG_DONTWAIT | MSG_NOSIGNAL)` on the non-blocking socket `fd`, with
/// `MSG_MORE` when `more` (the kernel then holds a partial segment back for what comes next, a
/// `sendfile`). `MSG_NOSIGNAL`: a peer that reset gives EPIPE, never SIGPIPE, whether or not
/// the process embedding the server ignores that signal. A mapped range past its file's end
/// makes the call fail with EFAULT, or stop short after the bytes before it.
pub(crate) fn send_iovecs(
    fd: BorrowedFd<'_>,
    list: &SendList<'_>,
    more: bool,
) -> std::io::Result<usize> {
    let iov = &list.iov;
    let count = iov.len().min(libc::UIO_MAXIOV as usize);
    // SAFETY: all-zero is a valid `msghdr` (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = count as _;
    let mut flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    if more {
        flags |= libc::MSG_MORE;
    }
    // SAFETY: `msg` points at `iov`, borrowed (alive, unmoved) for the call, and `count` is
    // at most its length; the kernel only reads the iovecs and the memory they name, which
    // `list` borrows for at least the call (`SendList` takes nothing else); `fd` is borrowed,
    // so open for the call.
    let ret = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, flags) };
    check(ret)
}

/// `sendfile(sock, file, offset, count)` on a non-blocking socket: bytes of `file` from
/// `offset` go to the socket from the page cache; returns how many (0: the file ends before
/// `offset`). A peer that reset raises SIGPIPE (no flag avoids it): the process ignores it
/// (see [`crate::Server`]) and the call fails with EPIPE.
pub(crate) fn sendfile(
    sock: RawFd,
    file: &std::fs::File,
    offset: u64,
    count: usize,
) -> std::io::Result<usize> {
    let mut off = offset as libc::off_t;
    // SAFETY: `off` is a live local the kernel reads and updates; both descriptors are open
    // for the call (`file` is borrowed; the caller holds the socket). No memory of ours is
    // read or written besides `off`.
    let ret = unsafe { libc::sendfile(sock, file.as_raw_fd(), &mut off, count) };
    check(ret)
}

/// `recv(src, MSG_DONTWAIT)` of at most `dest.len()` bytes straight into `dest`: the kernel
/// copies from the socket into the mapped file's pages, with no buffer in between.
/// `WouldBlock` when nothing is there; `Ok(0)` at end of stream; EFAULT when the file no
/// longer reaches that far (cut short behind our back).
pub(crate) fn recv_into(src: BorrowedFd<'_>, dest: MappedDest<'_>) -> std::io::Result<usize> {
    // SAFETY: `dest` names `dest.len()` bytes inside a live shared mapping of a file, which it
    // borrows (so keeps mapped) for the call: a `MappedDest` is only made by the backend's
    // `Mapping::dest`, for a range it checked lies inside the mapping. No Rust reference to
    // that memory exists (it is written only by system calls like this one), so no aliasing
    // rule is involved; a page past the end of a file cut short makes the call fail with
    // EFAULT. `src` is a borrowed open descriptor.
    let ret = unsafe {
        libc::recv(
            src.as_raw_fd(),
            dest.as_ptr().cast::<libc::c_void>(),
            dest.len(),
            libc::MSG_DONTWAIT,
        )
    };
    check(ret)
}

/// Bytes waiting in a socket's receive queue (`ioctl(FIONREAD)`).
pub(crate) fn bytes_readable(src: BorrowedFd<'_>) -> std::io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points at `n`, alive and
    // exclusively borrowed for the call; `src` is a borrowed open descriptor.
    let ret = unsafe { libc::ioctl(src.as_raw_fd(), libc::FIONREAD, &mut n as *mut libc::c_int) };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// `recv(MSG_PEEK | MSG_DONTWAIT)` of one byte: `true` when a byte is waiting, `false` at end
/// of stream, `WouldBlock` when nothing is, or the socket's error.
pub(crate) fn peek_byte(src: BorrowedFd<'_>) -> std::io::Result<bool> {
    let mut b = 0u8;
    // SAFETY: the kernel writes at most one byte, into `b`, alive and exclusively borrowed for
    // the call; `src` is a borrowed open descriptor.
    let ret = unsafe {
        libc::recv(
            src.as_raw_fd(),
            (&mut b as *mut u8).cast::<libc::c_void>(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    check(ret).map(|n| n > 0)
}

/// shutdown(fd, SHUT_RDWR): end both directions of a connection whose socket stays open
/// (its reader then sees end of file). Errors (already closed) are of no interest.
pub(crate) fn shutdown(fd: RawFd) {
    // SAFETY: no memory is passed; a bad or closed fd only makes the call fail.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION): the socket's congestion control ("cubic",
/// "bbr", ...).
pub(crate) fn tcp_congestion(fd: RawFd) -> std::io::Result<String> {
    let mut name = [0u8; 32];
    let mut len = name.len() as libc::socklen_t;
    // SAFETY: the pointer and length describe `name`, which lives across the call; the kernel
    // writes at most `len` bytes and updates `len`. A bad fd only makes the call fail.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_mut_ptr().cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let got = name.get(..len as usize).unwrap_or(&name);
    let end = got.iter().position(|&b| b == 0).unwrap_or(got.len());
    Ok(String::from_utf8_lossy(&got[..end]).into_owned())
}

/// What `ironsan ctl sessions` shows of a connection's TCP state (Linux `struct tcp_info`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TcpInfo {
    /// Smoothed round-trip time, microseconds.
    pub rtt_us: u32,
    /// Round-trip time variance, microseconds.
    pub rttvar_us: u32,
    /// Congestion window, segments.
    pub snd_cwnd: u32,
    /// Slow-start threshold, segments (`u32::MAX`-ish values mean "infinite").
    pub snd_ssthresh: u32,
    /// Retransmitted segments over the connection's life.
    pub total_retrans: u32,
    /// Latest delivery rate estimate, bytes per second (0 if the kernel does not report it).
    pub delivery_rate: u64,
    /// Maximum segment size we send with.
    pub snd_mss: u32,
}

/// getsockopt(fd, SOL_TCP, TCP_INFO). `fd` must be a TCP socket the caller keeps open for the
/// duration of the call (the admin view holds the session's connection list lock, and a
/// connection leaves that list before its socket is closed).
pub(crate) fn tcp_info(fd: RawFd) -> std::io::Result<TcpInfo> {
    // SAFETY: `tcp_info` is a plain C struct of integers; all-zero bytes are a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the pointer and length describe `info`, which lives across the call; the kernel
    // writes at most `len` bytes and updates `len`. A bad fd only makes the call fail.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Older kernels fill a shorter struct; fields past `len` stay zero.
    Ok(TcpInfo {
        rtt_us: info.tcpi_rtt,
        rttvar_us: info.tcpi_rttvar,
        snd_cwnd: info.tcpi_snd_cwnd,
        snd_ssthresh: info.tcpi_snd_ssthresh,
        total_retrans: info.tcpi_total_retrans,
        delivery_rate: info.tcpi_delivery_rate,
        snd_mss: info.tcpi_snd_mss,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn tcp_info_of_a_live_connection_and_a_bad_fd() {
        use std::os::fd::AsRawFd;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let i = super::tcp_info(c.as_raw_fd()).unwrap();
        assert!(i.snd_cwnd > 0 && i.snd_mss > 0, "{i:?}");
        assert!(super::tcp_info(-1).is_err());
    }
}
