//! sd_notify without libsystemd: a datagram to `$NOTIFY_SOCKET` (`READY=1` once every
//! portal listens, `STOPPING=1` when shutdown begins). The protocol is one datagram of
//! newline-separated `KEY=VALUE` assignments to a Unix socket; a name starting with '@' is in
//! the abstract namespace (the '@' stands for the leading NUL byte).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;

/// Send `state` to the service manager if `$NOTIFY_SOCKET` is set. `Ok(false)`: not run
/// under a manager that wants notifications.
pub fn notify(state: &str) -> std::io::Result<bool> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(addr) if !addr.is_empty() => send(&addr, state).map(|()| true),
        _ => Ok(false),
    }
}

/// Log, rather than fail, when the notification cannot be sent.
pub fn notify_or_warn(state: &str) {
    if let Err(e) = notify(state) {
        tracing::warn!("sd_notify {}: {e}", state.lines().next().unwrap_or(state));
    }
}

/// Send `state` to the datagram socket `addr` (a path, or `@name` for an abstract socket).
pub fn send(addr: &OsStr, state: &str) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    let bytes = addr.as_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let a = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(state.as_bytes(), &a)?;
    } else {
        sock.send_to(state.as_bytes(), std::path::Path::new(addr))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(sock: &UnixDatagram) -> String {
        sock.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 256];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn sends_to_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str(), "READY=1\nSTATUS=serving").unwrap();
        assert_eq!(recv(&sock), "READY=1\nSTATUS=serving");
    }

    #[test]
    fn sends_to_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("ironsan-notify-test-{}", std::process::id());
        let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let sock = UnixDatagram::bind_addr(&a).unwrap();
        send(OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        assert_eq!(recv(&sock), "STOPPING=1");
    }

    #[test]
    fn a_missing_socket_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(send(dir.path().join("nobody").as_os_str(), "READY=1").is_err());
    }
}
