//! Shared harness for the integration tests that drive a live `ironsan serve` with real
//! initiators (libiscsi's tools, qemu-img).
//!
//! - [`Server`]: one `ironsan serve` child on its own free loopback port and its own temporary
//!   directory, killed (SIGTERM, then SIGKILL) when dropped. Tests run in parallel, so never
//!   share a server or a port between tests.
//! - [`require_tool`]: skip (or, with `IRONSAN_REQUIRE_TOOLS=1`, fail) when a tool is missing.
//! - [`run`] / [`run_unchecked`]: run a command with a timeout and print both streams on failure.
//! - [`Background`]: a long-running client (e.g. `iscsi-perf`) whose output is polled.
//! - [`Sniffer`]: a loopback TCP relay that records what passes, to check what was negotiated
//!   and what is on the wire (e.g. CRC32C header digests).

#![allow(dead_code)] // each test binary uses a different part of the harness

use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// The target name `ironsan serve` uses when no `--target` is given.
pub(crate) const DEFAULT_TARGET: &str = "iqn.2026-11.org.ironsan:default";

/// Write `dir`/ironsan.toml for [`Server::start_config`]: `addr` as the only portal, data
/// under `dir`/data, the control socket at `control` ("none" for none), [`DEFAULT_TARGET`]
/// with a 1 MiB RAM LUN, then `extra` (more tables, e.g. `[limits]`). Returns its path.
pub(crate) fn write_ram_config(
    dir: &Path,
    addr: SocketAddr,
    control: &str,
    extra: &str,
) -> PathBuf {
    let config = dir.join("ironsan.toml");
    std::fs::write(
        &config,
        format!(
            "listen = [\"{addr}\"]\ndata_dir = \"{}\"\ncontrol = \"{control}\"\n\n[[target]]\nname = \"{DEFAULT_TARGET}\"\n[[target.lun]]\nspec = \"ram:1M\"\n{extra}",
            dir.join("data").display()
        ),
    )
    .unwrap();
    config
}

/// How long a client command may run before it is killed and the test fails.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The `ironsan` binary under test (built by cargo for this test crate).
pub(crate) fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_ironsan")
}

// ---------------------------------------------------------------------------------------------
// Tools
// ---------------------------------------------------------------------------------------------

/// The full path of `name` on PATH, if it is there and executable.
pub(crate) fn which(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// True when `name` is on PATH. Otherwise: with `IRONSAN_REQUIRE_TOOLS=1` (CI, scripts/test.sh)
/// panic; else print a skip line and return false, and the test should return early.
pub(crate) fn require_tool(name: &str) -> bool {
    if which(name).is_some() {
        return true;
    }
    ironsan_testkit::skip(format!(
        "{name} is not installed (run scripts/install-deps.sh)"
    ));
    false
}

/// [`require_tool`] for several tools; true only when all are there.
pub(crate) fn require_tools(names: &[&str]) -> bool {
    names.iter().all(|n| require_tool(n))
}

/// qemu-img with a loadable iscsi:// driver. qemu-img can be installed without the
/// qemu-block-extra module (or with a mismatched one); it then fails with "Unknown protocol".
pub(crate) fn require_qemu_iscsi() -> bool {
    if !require_tool("qemu-img") {
        return false;
    }
    let out = run_unchecked(
        "qemu-img",
        &["info", "iscsi://127.0.0.1:1/iqn.2000-01.invalid:probe/0"],
        Duration::from_secs(30),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let broken = [
        "Unknown protocol",
        "unknown driver",
        "Failed to initialize module",
        "not found",
    ]
    .iter()
    .any(|p| text.to_lowercase().contains(&p.to_lowercase()));
    if !broken {
        return true;
    }
    ironsan_testkit::skip(format!(
        "qemu-img has no working iscsi:// driver (install qemu-block-extra matching qemu-utils: run scripts/install-deps.sh): {}",
        text.trim()
    ));
    false
}

// ---------------------------------------------------------------------------------------------
// Running commands
// ---------------------------------------------------------------------------------------------

fn describe(cmd: &str, args: &[&str]) -> String {
    let mut s = cmd.to_string();
    for a in args {
        s.push(' ');
        if a.contains([' ', '"', '{']) {
            s.push_str(&format!("'{a}'"));
        } else {
            s.push_str(a);
        }
    }
    s
}

/// Render an Output for a failure message.
pub(crate) fn show(out: &Output) -> String {
    format!(
        "status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim_end(),
        String::from_utf8_lossy(&out.stderr).trim_end()
    )
}

/// Run `cmd args` to completion within `timeout` (killed and panic on timeout) and return its
/// output whatever the exit status. Stdin is /dev/null.
pub(crate) fn run_unchecked(cmd: &str, args: &[&str], timeout: Duration) -> Output {
    run_env(cmd, args, &[], timeout)
}

/// [`run_unchecked`] with extra environment variables.
pub(crate) fn run_env(cmd: &str, args: &[&str], env: &[(&str, &str)], timeout: Duration) -> Output {
    let what = describe(cmd, args);
    let mut child = Command::new(cmd)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start `{what}`: {e}"));
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t_out = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let t_err = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait().expect("waiting for a child") {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let st = child.wait().expect("waiting for a killed child");
            let out = Output {
                status: st,
                stdout: t_out.join().unwrap(),
                stderr: t_err.join().unwrap(),
            };
            panic!(
                "`{what}` timed out after {timeout:?} and was killed\n{}",
                show(&out)
            );
        }
        thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: t_out.join().unwrap(),
        stderr: t_err.join().unwrap(),
    }
}

/// Run `cmd args` with the default timeout; panic (with both streams) unless it exits 0.
pub(crate) fn run(cmd: &str, args: &[&str]) -> Output {
    let out = run_unchecked(cmd, args, DEFAULT_TIMEOUT);
    assert!(
        out.status.success(),
        "`{}` failed\n{}",
        describe(cmd, args),
        show(&out)
    );
    out
}

/// stdout of a successful [`run`] as text.
pub(crate) fn run_stdout(cmd: &str, args: &[&str]) -> String {
    String::from_utf8_lossy(&run(cmd, args).stdout).into_owned()
}

/// A numeric field of `/proc/PID/status` (`"VmRSS:"` in KiB, `"THP_enabled:"`, ...); `None`
/// when the process or the field is not there.
pub(crate) fn proc_status(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Send `sig` (e.g. "TERM", "INT") to a process.
pub(crate) fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("running kill");
    assert!(st.success(), "kill -{sig} {pid} failed");
}

/// A long-running client whose stdout/stderr go to files that can be polled.
pub(crate) struct Background {
    pub child: Child,
    pub what: String,
    out_path: PathBuf,
    err_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Background {
    pub(crate) fn spawn(cmd: &str, args: &[&str]) -> Background {
        let dir = tempfile::tempdir().expect("tempdir");
        let out_path = dir.path().join("stdout");
        let err_path = dir.path().join("stderr");
        let what = describe(cmd, args);
        let child = Command::new(cmd)
            .args(args)
            .stdin(Stdio::null())
            .stdout(File::create(&out_path).unwrap())
            .stderr(File::create(&err_path).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start `{what}`: {e}"));
        Background {
            child,
            what,
            out_path,
            err_path,
            _dir: dir,
        }
    }

    pub(crate) fn stdout(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.out_path).unwrap_or_default()).into_owned()
    }

    pub(crate) fn stderr(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.err_path).unwrap_or_default()).into_owned()
    }

    pub(crate) fn output_text(&self) -> String {
        format!(
            "--- {} stdout ---\n{}\n--- stderr ---\n{}",
            self.what,
            self.stdout().trim_end(),
            self.stderr().trim_end()
        )
    }

    /// Wait until stdout contains `needle`; panic (with the output) after `timeout` or if the
    /// process exits first.
    pub(crate) fn wait_for_stdout(&mut self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if self.stdout().contains(needle) {
                return;
            }
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!(
                    "`{}` exited ({st}) before printing {needle:?}\n{}",
                    self.what,
                    self.output_text()
                );
            }
            if Instant::now() >= deadline {
                panic!(
                    "`{}` did not print {needle:?} within {timeout:?}\n{}",
                    self.what,
                    self.output_text()
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wait for exit up to `timeout`; None if still running.
    pub(crate) fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Ports
// ---------------------------------------------------------------------------------------------

/// A port that was free on `ip` a moment ago (bind port 0, read it, close).
pub(crate) fn free_port_on(ip: IpAddr) -> u16 {
    let l = TcpListener::bind((ip, 0)).unwrap_or_else(|e| panic!("cannot bind {ip}:0: {e}"));
    l.local_addr().unwrap().port()
}

pub(crate) fn free_port() -> u16 {
    free_port_on(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// True when [::1] can be bound here (IPv6 loopback configured).
pub(crate) fn ipv6_loopback_available() -> bool {
    TcpListener::bind("[::1]:0").is_ok()
}

/// Wait until `addr` accepts a TCP connection.
fn accepts(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

// ---------------------------------------------------------------------------------------------
// The server under test
// ---------------------------------------------------------------------------------------------

/// A running `ironsan serve`. Its temporary directory holds `data/` (the `--data-dir`, created
/// by the server) and the captured output of each start (`server-N.stdout` / `.stderr`).
pub(crate) struct Server {
    child: Option<Child>,
    /// The first portal's port (127.0.0.1).
    pub port: u16,
    /// The target name of the first target.
    pub target: String,
    /// Arguments after `ironsan`, reused by [`Server::restart`].
    args: Vec<String>,
    /// Portals to wait for.
    addrs: Vec<SocketAddr>,
    /// Starts so far (names the log files).
    generation: u32,
    /// The `NOTIFY_SOCKET` of the current start (readiness: `READY=1`).
    notify: Option<std::os::unix::net::UnixDatagram>,
    /// The network namespace it runs in (`ip netns exec`), if not this process's.
    netns: Option<String>,
    dir: tempfile::TempDir,
}

/// The target a server started with `args` serves first (`--target`, else the default).
fn target_of(args: &[&str]) -> String {
    args.iter()
        .position(|a| *a == "--target")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.to_string())
        .unwrap_or_else(|| DEFAULT_TARGET.to_string())
}

/// `serve --listen LISTEN --data-dir DATA ARGS...`.
fn serve_args(listen: &str, data: &Path, args: &[&str]) -> Vec<String> {
    let mut full: Vec<String> = vec![
        "serve".into(),
        "--listen".into(),
        listen.into(),
        "--data-dir".into(),
        data.display().to_string(),
    ];
    full.extend(args.iter().map(|s| s.to_string()));
    full
}

impl Server {
    /// `ironsan serve --listen 127.0.0.1:PORT --data-dir TMP/data ARGS...` on a free port.
    ///
    /// [`free_port`] only says the port was free a moment ago: another test's outgoing
    /// connection may take it as its source port before the server binds it. When the server
    /// then exits at start-up because the address is in use, it is started again on another
    /// free port (a few times).
    pub(crate) fn start(args: &[&str]) -> Server {
        let dir = tempfile::Builder::new()
            .prefix("ironsan-test-")
            .tempdir()
            .expect("tempdir");
        let target = target_of(args);
        let data = dir.path().join("data");
        let mut s = Server {
            child: None,
            port: 0,
            target,
            args: Vec::new(),
            addrs: Vec::new(),
            generation: 0,
            notify: None,
            netns: None,
            dir,
        };
        const ATTEMPTS: u32 = 5;
        for attempt in 1..=ATTEMPTS {
            let port = free_port();
            s.port = port;
            s.args = serve_args(&format!("127.0.0.1:{port}"), &data, args);
            s.addrs = vec![SocketAddr::from((Ipv4Addr::LOCALHOST, port))];
            match s.try_spawn() {
                Ok(()) => return s,
                Err(e)
                    if attempt < ATTEMPTS
                        && s.stderr().lines().any(|l| {
                            l.contains(&format!("cannot listen on 127.0.0.1:{port}"))
                                && l.contains("Address already in use")
                        }) =>
                {
                    eprintln!("port {port} was taken before ironsan bound it; another port\n{e}");
                }
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!()
    }

    /// `ironsan serve --config FILE` where the config (written by the caller into `dir`) listens
    /// on `addrs`; `target` is the first target's name.
    pub(crate) fn start_config(
        dir: tempfile::TempDir,
        config: &Path,
        addrs: Vec<SocketAddr>,
        target: &str,
    ) -> Server {
        let full = vec![
            "serve".to_string(),
            "--config".to_string(),
            config.display().to_string(),
        ];
        Server::launch(dir, full, addrs, target.to_string())
    }

    fn launch(
        dir: tempfile::TempDir,
        args: Vec<String>,
        addrs: Vec<SocketAddr>,
        target: String,
    ) -> Server {
        Server::launch_in(dir, args, addrs, target, None)
    }

    fn launch_in(
        dir: tempfile::TempDir,
        args: Vec<String>,
        addrs: Vec<SocketAddr>,
        target: String,
        netns: Option<String>,
    ) -> Server {
        let port = addrs[0].port();
        let mut s = Server {
            child: None,
            port,
            target,
            args,
            addrs,
            generation: 0,
            notify: None,
            netns,
            dir,
        };
        s.spawn();
        s
    }

    /// `ironsan serve --listen ADDR --data-dir TMP/data ARGS...` in network namespace `netns`
    /// (`ip netns exec`: the process is ironsan itself, so signals reach it), `addr` being
    /// an address of that namespace that this one can reach.
    pub(crate) fn start_in(netns: &str, addr: SocketAddr, args: &[&str]) -> Server {
        let dir = tempfile::Builder::new()
            .prefix("ironsan-test-")
            .tempdir()
            .expect("tempdir");
        let full = serve_args(&addr.to_string(), &dir.path().join("data"), args);
        Server::launch_in(
            dir,
            full,
            vec![addr],
            target_of(args),
            Some(netns.to_string()),
        )
    }

    /// Stop the process (SIGSTOP): every thread of it, as a pause, a swapped-out or hung
    /// host would.
    pub(crate) fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    /// Let a paused process go on (SIGCONT).
    pub(crate) fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    /// Start the server and wait until it is ready; panic if it is not.
    fn spawn(&mut self) {
        if let Err(e) = self.try_spawn() {
            panic!("{e}");
        }
    }

    /// Start the server and wait until it is ready: it sent `READY=1` to `NOTIFY_SOCKET`
    /// (main.rs sends it once every portal, the control socket and the metrics listener are
    /// bound, the connect lines are printed and the signal handlers are installed; a
    /// portal that accepts is not enough) and every portal accepts. Err (with its output)
    /// when it exited during start-up; panics when it is not ready within 30 s.
    fn try_spawn(&mut self) -> Result<(), String> {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr as UnixAddr, UnixDatagram};
        use std::sync::atomic::{AtomicU64, Ordering};
        static NOTIFY_SEQ: AtomicU64 = AtomicU64::new(0);
        assert!(self.child.is_none());
        self.generation += 1;
        // An abstract socket name (no path length limit, nothing to clean up), unique per
        // test process and start; it lives as long as this start (STOPPING=1 arrives there).
        let name = format!(
            "ironsan-test-notify-{}-{}",
            std::process::id(),
            NOTIFY_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        // Abstract names belong to a network namespace: a server in another one is told a
        // path in its directory instead.
        let (notify, notify_name) = match &self.netns {
            None => (
                UnixDatagram::bind_addr(&UnixAddr::from_abstract_name(name.as_bytes()).unwrap()),
                format!("@{name}"),
            ),
            Some(_) => {
                let path = self.dir.path().join(format!("notify-{}", self.generation));
                let _ = std::fs::remove_file(&path);
                (UnixDatagram::bind(&path), path.display().to_string())
            }
        };
        let notify =
            notify.unwrap_or_else(|e| panic!("cannot bind the notify socket {notify_name}: {e}"));
        notify.set_nonblocking(true).unwrap();
        self.notify = Some(notify);
        let out = File::create(self.stdout_path()).unwrap();
        let err = File::create(self.stderr_path()).unwrap();
        let mut cmd = match &self.netns {
            None => Command::new(bin()),
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, bin()]);
                c
            }
        };
        let child = cmd
            .args(&self.args)
            .env_remove("IRONSAN_LOG")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .env("NOTIFY_SOCKET", notify_name)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin()));
        self.child = Some(child);
        const START_TIMEOUT: Duration = Duration::from_secs(30);
        let deadline = Instant::now() + START_TIMEOUT;
        let mut ready = false;
        let mut pending = self.addrs.clone();
        loop {
            let mut buf = [0u8; 1024];
            while !ready {
                match self.notify.as_ref().unwrap().recv(&mut buf) {
                    Ok(n) => {
                        ready = String::from_utf8_lossy(&buf[..n])
                            .lines()
                            .any(|l| l == "READY=1")
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => panic!("reading the notify socket: {e}"),
                }
            }
            if ready {
                pending.retain(|a| !accepts(*a));
                if pending.is_empty() {
                    return Ok(());
                }
            }
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return Err(format!(
                    "ironsan serve {:?} exited during start-up ({st})\n{}",
                    self.args,
                    self.logs()
                ));
            }
            if Instant::now() >= deadline {
                let what = if ready {
                    format!("is not accepting on {pending:?}")
                } else {
                    "has not sent READY=1".to_string()
                };
                panic!(
                    "ironsan serve {:?} {what} after {START_TIMEOUT:?}\n{}",
                    self.args,
                    self.logs()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The temporary directory of this server.
    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The `--data-dir` (for servers started with [`Server::start`]).
    pub(crate) fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().expect("server not running").id()
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addrs[0]
    }

    /// `iscsi://127.0.0.1:PORT` (the portal, for iscsi-ls).
    pub(crate) fn portal_url(&self) -> String {
        format!("iscsi://{}", self.addrs[0])
    }

    /// `iscsi://127.0.0.1:PORT/<target>/<lun>`.
    pub(crate) fn url(&self, lun: u32) -> String {
        format!("iscsi://{}/{}/{lun}", self.addrs[0], self.target)
    }

    /// qemu's `json:` filename for the LUN, with extra iscsi driver options (e.g.
    /// `("header-digest", "crc32c")`) and an optional other portal (e.g. a [`Sniffer`]).
    pub(crate) fn qemu_json(
        &self,
        lun: u32,
        portal: Option<SocketAddr>,
        opts: &[(&str, &str)],
    ) -> String {
        let portal = portal.unwrap_or(self.addrs[0]);
        let mut file = format!(
            r#""driver":"iscsi","transport":"tcp","portal":"{portal}","target":"{}","lun":{lun}"#,
            self.target
        );
        for (k, v) in opts {
            file.push_str(&format!(r#","{k}":"{v}""#));
        }
        format!(r#"json:{{"driver":"raw","file":{{{file}}}}}"#)
    }

    pub(crate) fn stdout_path(&self) -> PathBuf {
        self.dir
            .path()
            .join(format!("server-{}.stdout", self.generation))
    }

    pub(crate) fn stderr_path(&self) -> PathBuf {
        self.dir
            .path()
            .join(format!("server-{}.stderr", self.generation))
    }

    /// What the current (or last) start printed on stdout.
    pub(crate) fn stdout(&self) -> String {
        std::fs::read_to_string(self.stdout_path()).unwrap_or_default()
    }

    /// What the current (or last) start printed on stderr (the log).
    pub(crate) fn stderr(&self) -> String {
        std::fs::read_to_string(self.stderr_path()).unwrap_or_default()
    }

    /// Both streams of the current start, for failure messages (log tail only).
    pub(crate) fn logs(&self) -> String {
        let err = self.stderr();
        let lines: Vec<&str> = err.lines().collect();
        let tail = lines[lines.len().saturating_sub(60)..].join("\n");
        format!(
            "--- ironsan stdout ---\n{}\n--- ironsan stderr (last 60 lines) ---\n{tail}",
            self.stdout().trim_end()
        )
    }

    /// Panic (with its output) if the server has died.
    pub(crate) fn assert_alive(&mut self) {
        if let Some(st) = self
            .child
            .as_mut()
            .expect("server not running")
            .try_wait()
            .unwrap()
        {
            self.child = None;
            panic!("ironsan died ({st})\n{}", self.logs());
        }
    }

    /// SIGTERM and wait up to `timeout` for the exit status; None if it had to be SIGKILLed.
    pub(crate) fn stop_within(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        signal(child.id(), "TERM");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait up to `timeout` for the server to exit by itself (after a signal the test sent);
    /// None if it is still running then (it is SIGKILLed).
    pub(crate) fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stop (SIGTERM, must exit within 10 s) and start again with the same arguments, port
    /// and data directory (waits until it is ready, as at the first start).
    pub(crate) fn restart(&mut self) {
        let st = self.stop_within(Duration::from_secs(10));
        assert!(
            st.is_some(),
            "ironsan did not exit within 10 s of SIGTERM\n{}",
            self.logs()
        );
        self.spawn();
    }

    /// SIGKILL (a crash: no flush, no clean-up) and reap; returns at once if not running.
    pub(crate) fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start again with the same arguments and port after [`Server::kill9`] (waits until it
    /// is ready, as at the first start).
    pub(crate) fn start_again(&mut self) {
        self.spawn();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let stopped = self.stop_within(Duration::from_secs(3));
        if thread::panicking() {
            eprintln!(
                "[server on port {}{}]\n{}",
                self.port,
                if stopped.is_none() { ", SIGKILLed" } else { "" },
                self.logs()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Output parsing helpers
// ---------------------------------------------------------------------------------------------

/// The value after `key` on the first line that starts with `key` (e.g. `"Vendor:"`).
pub(crate) fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix(key))
        .map(str::trim)
}

/// The size iscsi-ls prints for a disk: libiscsi 1.19 computes READ CAPACITY(10)'s
/// block length × returned LBA (not LBA+1), then divides by 1024 while > 1024, at most to 'T'.
pub(crate) fn iscsi_ls_size(rc10_lba: u64, block: u64) -> String {
    let mut size = rc10_lba * block;
    let units = [' ', 'k', 'M', 'G', 'T'];
    let mut u = 0;
    while u < 4 && size > 1024 {
        size /= 1024;
        u += 1;
    }
    format!("{size}{}", units[u])
}

// ---------------------------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------------------------

/// Deterministic pseudo-random bytes (xorshift64*), different for each seed.
pub(crate) fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        v.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Panic with the first differing offset if `got` != `want`.
pub(crate) fn assert_same_bytes(what: &str, got: &[u8], want: &[u8]) {
    if got == want {
        return;
    }
    let first = got.iter().zip(want).position(|(a, b)| a != b);
    match first {
        Some(i) => {
            let end = (i + 16).min(got.len()).min(want.len());
            panic!(
                "{what}: first difference at byte {i} (block {} of 512 B): got {:02x?}, want {:02x?} (lengths {} / {})",
                i / 512,
                &got[i..end],
                &want[i..end],
                got.len(),
                want.len()
            );
        }
        None => panic!(
            "{what}: lengths differ: got {} bytes, want {}",
            got.len(),
            want.len()
        ),
    }
}

/// CRC32C (Castagnoli), bitwise: an implementation independent of the one under test.
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

// ---------------------------------------------------------------------------------------------
// Sniffer: a recording TCP relay
// ---------------------------------------------------------------------------------------------

/// Bytes recorded on one relayed connection (each direction capped at [`Sniffer::CAP`]).
#[derive(Default, Clone)]
pub(crate) struct Captured {
    /// Initiator → target.
    pub up: Vec<u8>,
    /// Target → initiator.
    pub down: Vec<u8>,
}

/// A relay on 127.0.0.1:<free port> that forwards every connection to `upstream` and records
/// the bytes. Its threads end when the connections close; the accept thread lives as long as
/// the test process (it is blocked in accept and harmless).
pub(crate) struct Sniffer {
    pub addr: SocketAddr,
    conns: Arc<Mutex<Vec<Arc<Mutex<Captured>>>>>,
}

impl Sniffer {
    pub(crate) const CAP: usize = 24 << 20;

    pub(crate) fn start(upstream: SocketAddr) -> Sniffer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind sniffer");
        let addr = listener.local_addr().unwrap();
        let conns: Arc<Mutex<Vec<Arc<Mutex<Captured>>>>> = Arc::default();
        let c2 = Arc::clone(&conns);
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let cap = Arc::new(Mutex::new(Captured::default()));
                c2.lock().unwrap().push(Arc::clone(&cap));
                let (c_r, c_w) = (client.try_clone().unwrap(), client);
                let (s_r, s_w) = (server.try_clone().unwrap(), server);
                let cap_up = Arc::clone(&cap);
                thread::spawn(move || pump(c_r, s_w, cap_up, true));
                thread::spawn(move || pump(s_r, c_w, cap, false));
            }
        });
        Sniffer { addr, conns }
    }

    /// Everything recorded so far, one entry per connection.
    pub(crate) fn captured(&self) -> Vec<Captured> {
        self.conns
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.lock().unwrap().clone())
            .collect()
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, cap: Arc<Mutex<Captured>>, up: bool) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        {
            let mut c = cap.lock().unwrap();
            let v = if up { &mut c.up } else { &mut c.down };
            let room = Sniffer::CAP.saturating_sub(v.len());
            v.extend_from_slice(&buf[..n.min(room)]);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

/// What [`check_header_digests`] found in one direction of a connection.
#[derive(Debug, Default)]
pub(crate) struct DigestWalk {
    /// Login PDUs (no digests there).
    pub login_pdus: usize,
    /// Full Feature Phase PDUs whose header digest was present and correct.
    pub verified: usize,
}

/// Walk a recorded byte stream of iSCSI PDUs (one direction of one connection). During login
/// there are no digests; after login every PDU must carry a CRC32C header digest, checked
/// here with an independent CRC32C. Data digests are not expected (libiscsi never negotiates
/// them). `login_pdus`: for the target→initiator stream pass None (login ends with the Login
/// Response that has T=1 and NSG=3); for the initiator→target stream pass the number of
/// login responses the other direction had (one request per response).
/// Returns Err describing the first bad PDU. A truncated last PDU (capture cap) is ignored.
pub(crate) fn check_header_digests(
    stream: &[u8],
    login_pdus: Option<usize>,
) -> Result<DigestWalk, String> {
    let mut walk = DigestWalk::default();
    let mut off = 0usize;
    let mut ffp = login_pdus == Some(0);
    while off + 48 <= stream.len() {
        let bhs = &stream[off..off + 48];
        let opcode = bhs[0] & 0x3f;
        let ahs = bhs[4] as usize * 4;
        let dsl = u32::from_be_bytes([0, bhs[5], bhs[6], bhs[7]]) as usize;
        let padded = (dsl + 3) & !3;
        let hd = if ffp { 4 } else { 0 };
        let total = 48 + ahs + hd + padded;
        if off + total > stream.len() {
            break;
        }
        if ffp {
            let hdr = &stream[off..off + 48 + ahs];
            let got = u32::from_le_bytes(
                stream[off + 48 + ahs..off + 48 + ahs + 4]
                    .try_into()
                    .unwrap(),
            );
            let want = crc32c(hdr);
            if got != want {
                return Err(format!(
                    "PDU #{} (opcode 0x{opcode:02x}) at byte {off}: header digest {got:08x}, but the CRC32C of its header is {want:08x}",
                    walk.login_pdus + walk.verified
                ));
            }
            walk.verified += 1;
        } else {
            walk.login_pdus += 1;
            let want_opcode = if login_pdus.is_none() { 0x23 } else { 0x03 };
            if opcode != want_opcode {
                return Err(format!("PDU at byte {off}: opcode 0x{opcode:02x} during login (expected 0x{want_opcode:02x})"));
            }
            let last = match login_pdus {
                None => bhs[1] & 0x80 != 0 && bhs[1] & 0x03 == 3 && bhs[36] == 0,
                Some(n) => walk.login_pdus == n,
            };
            if last {
                ffp = true;
            }
        }
        off += total;
    }
    Ok(walk)
}

/// A loop block device over a file (`losetup -f --show`), detached when dropped.
pub(crate) struct LoopDevice(pub String);

impl LoopDevice {
    /// Create `file` (sparse, `size` bytes) and attach it; `Err` says why not (no losetup,
    /// no loop devices, not root).
    pub(crate) fn over_new_file(file: &Path, size: u64) -> Result<LoopDevice, String> {
        File::create(file)
            .and_then(|f| f.set_len(size))
            .map_err(|e| format!("{}: {e}", file.display()))?;
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(file)
            .output()
            .map_err(|e| format!("no losetup ({e})"))?;
        if !out.status.success() {
            return Err(format!(
                "losetup failed ({})",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(LoopDevice(
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        ))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// `qemu-img convert` of raw data from `from` to `to` (files, `iscsi://` URLs or `json:`
/// names); `into_existing`: write into what `to` already is (`-n`: no create, e.g. a LUN).
pub(crate) fn qemu_img_convert(from: &str, to: &str, into_existing: bool) -> Output {
    let mut args = vec!["convert"];
    if into_existing {
        args.push("-n");
    }
    args.extend(["-f", "raw", "-O", "raw", from, to]);
    run("qemu-img", &args)
}

/// GET `path` from `addr` over HTTP/1.1 (`Connection: close`): (status code, body).
pub(crate) fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("HTTP listener");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (code, body.to_string())
}
