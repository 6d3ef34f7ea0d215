//! The server crate's only `unsafe`: getsockopt(TCP_INFO) for the admin view. Kept thin:
//! one call, a plain-old-data struct, no pointers kept.

#![allow(unsafe_code)]

use std::os::fd::RawFd;

/// What `ironsan ctl sessions` shows of a connection's TCP state (Linux `struct tcp_info`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpInfo {
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
pub fn tcp_info(fd: RawFd) -> std::io::Result<TcpInfo> {
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
