//! sd_notify without libsystemd: a datagram to `$NOTIFY_SOCKET` (`READY=1` once every
//! portal listens, `STOPPING=1` when shutdown begins, `WATCHDOG=1` every half
//! `$WATCHDOG_USEC` when systemd's watchdog is on). The protocol is one datagram of
//! newline-separated `KEY=VALUE` assignments to a Unix socket; a name starting with '@' is in
//! the abstract namespace (the '@' stands for the leading NUL byte).

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

/// Send `state` to the service manager if `$NOTIFY_SOCKET` is set. `Ok(false)`: not run
/// under a manager that wants notifications.
pub(crate) fn notify(state: &str) -> std::io::Result<bool> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(addr) if !addr.is_empty() => send(&addr, state).map(|()| true),
        _ => Ok(false),
    }
}

/// Log, rather than fail, when the notification cannot be sent.
pub(crate) fn notify_or_warn(state: &str) {
    if let Err(e) = notify(state) {
        tracing::warn!("sd_notify {}: {e}", state.lines().next().unwrap_or(state));
    }
}

/// Send `state` to the datagram socket `addr` (a path, or `@name` for an abstract socket).
pub(crate) fn send(addr: &OsStr, state: &str) -> std::io::Result<()> {
    send_with(addr, state, false)
}

/// [`send`]; with `nonblocking`, a full receive queue is an error (`WouldBlock`) rather than
/// a wait, so a runtime thread never blocks on it.
fn send_with(addr: &OsStr, state: &str, nonblocking: bool) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    sock.set_nonblocking(nonblocking)?;
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

/// Where and how often the service manager wants `WATCHDOG=1`: `$NOTIFY_SOCKET` and
/// `$WATCHDOG_USEC` (positive microseconds), when `$WATCHDOG_PID` is unset or is this process
/// (as sd_watchdog_enabled(3) decides).
pub(crate) fn watchdog_interval() -> Option<(OsString, Duration)> {
    let addr = std::env::var_os("NOTIFY_SOCKET").filter(|s| !s.is_empty())?;
    let usec = std::env::var("WATCHDOG_USEC").ok();
    let pid = std::env::var("WATCHDOG_PID").ok();
    let every = watchdog_from(usec.as_deref(), pid.as_deref(), std::process::id())?;
    Some((addr, every))
}

fn watchdog_from(usec: Option<&str>, pid: Option<&str>, me: u32) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok().filter(|&u| u > 0)?;
    match pid {
        None => {}
        Some(p) if p.trim().parse::<u32>().ok() == Some(me) => {}
        Some(_) => return None,
    }
    Some(Duration::from_micros(usec))
}

/// Send `WATCHDOG=1` to `addr` every `period` (half the watchdog interval), the first at
/// once. Runs as a task of its own on the server's runtime: if the runtime stops running
/// tasks, the pings stop and the service manager restarts the process. A failed send is
/// logged once (at `warn`) until one succeeds again.
pub(crate) async fn watchdog(addr: OsString, period: Duration) {
    let mut tick = tokio::time::interval(period.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        match send_with(&addr, "WATCHDOG=1", true) {
            Ok(()) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!("sd_notify WATCHDOG=1: {e}");
            }
            Err(e) => tracing::debug!("sd_notify WATCHDOG=1: {e}"),
        }
    }
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
    fn watchdog_interval_follows_watchdog_usec_and_pid() {
        let ms = |n| Some(Duration::from_millis(n));
        assert_eq!(watchdog_from(Some("200000"), None, 42), ms(200));
        assert_eq!(watchdog_from(Some("30000000"), Some("42"), 42), ms(30_000));
        // Meant for another process (e.g. a parent that exec'd us without clearing it).
        assert_eq!(watchdog_from(Some("200000"), Some("41"), 42), None);
        assert_eq!(watchdog_from(Some("200000"), Some("x"), 42), None);
        for bad in [None, Some("0"), Some(""), Some("-5"), Some("1s")] {
            assert_eq!(watchdog_from(bad, None, 42), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn watchdog_task_sends_watchdog_1_repeatedly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        let task = tokio::spawn(watchdog(
            path.clone().into_os_string(),
            Duration::from_millis(20),
        ));
        let got = tokio::task::spawn_blocking(move || [recv(&sock), recv(&sock)])
            .await
            .unwrap();
        task.abort();
        assert_eq!(got, ["WATCHDOG=1", "WATCHDOG=1"]);
    }

    #[test]
    fn a_missing_socket_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(send(dir.path().join("nobody").as_os_str(), "READY=1").is_err());
    }
}
