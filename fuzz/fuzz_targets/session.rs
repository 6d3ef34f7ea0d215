//! A whole session against the live server: after a real login (digests, segment sizes,
//! InitialR2T and ImmediateData chosen by the input), an arbitrary sequence of full-feature
//! PDUs goes over a loopback socket to an in-process `ironsan_server::Server`: reads and
//! writes (READ/WRITE 16 near the LUN's end and past it), arbitrary CDBs, Data-Out answering
//! the R2Ts the target really sent (with skewed offsets, DataSNs, lengths and TTTs),
//! unsolicited Data-Out, NOP-Out, task management, Text, Logout, CmdSN skew, raw BHSs,
//! session reinstatement (a new connection logs in with the same ISID while the old one still
//! has commands in flight), and PDUs cut in two whose rest comes later, on a connection
//! reinstatement may have replaced by then (a late retransmission), and several connections
//! per session (MC/S): connections join with new CIDs or reinstate one with a known CID,
//! commands go on any of them (CmdSN is the session's), and a Logout names any CID.
//! The session offers ErrorRecoveryLevel 0, 1 or 2 (the target agrees to each), with a
//! DefaultTime2Retain of 0-3 s: PDUs go out with a damaged header or data segment (their
//! digest no longer matches; the target drops them, asks for the data again with a recovery
//! R2T, fails the command or closes), and SNACKs of any type name our tasks, the Data-In whose
//! A bit asked for a DataACK, or anything. Connections are cut (half-closed, closed or reset,
//! with whatever they have in flight) and logged out for recovery (Logout reason 2 naming any
//! CID, with the named connection's ExpStatSN); TASK REASSIGN names any of our tasks (those of
//! a cut or recovered connection too) or an arbitrary tag, with any ExpDataSN. At level 2 with
//! a DefaultTime2Retain above 0 a failed connection's tasks wait DefaultTime2Wait (2 s) plus
//! DefaultTime2Retain for a reassignment, so a reassigned read resumes and a reassigned write
//! asks for its data again (answered by `DataOut`/`Answer`) on the connection in use.
//! The LUNs are the data paths the performance work built: a RAM LUN (copy-on-write chunks,
//! reads of holes as the zero page), a tmpfs file LUN with 4096-byte blocks (Data-Out received
//! straight into the file's pages; reads with `sendfile` or from the mapping, one server
//! each) and a NULL LUN.
//!
//! Invariants besides "no panic in any server task" (libFuzzer's panic hook aborts):
//! - every PDU the target sends parses, carries valid digests and a target opcode, and its
//!   data segment fits the MaxRecvDataSegmentLength we declared; no Data-In has the A bit at
//!   ErrorRecoveryLevel 0;
//! - once we close our side the target closes the connection within 5 s (nothing hangs);
//! - afterwards a new session logs in and reads back what it wrote (the server still works);
//! - with `verify` (arbitrary CDBs and raw commands then go to the NULL LUN or an absent one,
//!   so only READ/WRITE(16) can change the RAM and file LUNs): every block that exactly one
//!   write of the session covered holds that write's data if the write ended GOOD (writes sent
//!   on a connection that was replaced or closed before a later write was sent do not count
//!   against it: they were done, or aborted and fenced, before the login's or the logout's
//!   response; writes on a connection that was cut, logged out for recovery or replaced while
//!   the session keeps tasks for reassignment count against every later write, as they may be
//!   reassigned and complete at any time, until a session reinstatement ends them). Data-Out
//!   bytes are a function of (ITT, buffer offset), so skewed or split transfers cannot make
//!   the expected data ambiguous. An acknowledged write that is lost, torn, misplaced or
//!   overwritten by an aborted one fails this, and so does one holding a damaged data
//!   segment (`Damage` at a byte changes the data, not the digest);
//! - the process's file descriptors stay bounded (checked every 256 inputs).
#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use ironsan_backend::{BlockDevice, FileBackend, FileOptions, NullBackend, RamBackend};
use ironsan_initiator::{wire_pdu, Client, LoginOptions};
use ironsan_proto::pdu::*;
use ironsan_proto::{CmdSn, DataSn, StatSn};
use ironsan_scsi::{LogicalUnit, LuConfig};
use ironsan_server::iscsi::io::{read_pdu, Digests, ReadError};
use ironsan_server::{Server, ServerConfig, TargetDef, ZeroCopyReads};
use libfuzzer_sys::fuzz_target;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::tcp::OwnedReadHalf;

const TARGET: &str = "iqn.2026-11.org.ironsan:fuzz";
const LUN_BYTES: u64 = 16 << 20;
/// The LUN only the health check uses (the ops address LUNs 0-2 and an absent one).
const HEALTH_LUN: u64 = 3;
const WAIT: Duration = Duration::from_secs(5);

struct Rig {
    rt: tokio::runtime::Runtime,
    /// zero_copy_reads `on` (sendfile), `mapped`.
    addrs: [SocketAddr; 2],
    fd_baseline: usize,
    runs: AtomicU64,
}

fn target(backends: &[Arc<dyn BlockDevice>]) -> TargetDef {
    let mut scsi = ironsan_scsi::Target::new();
    for (n, b) in backends.iter().enumerate() {
        let cfg = LuConfig {
            block_size: if n == 1 { 4096 } else { 512 },
            naa: ironsan_scsi::local_naa(&format!("fuzz-{n}")),
            ..Default::default()
        };
        scsi.add_lun(n as u64, Arc::new(LogicalUnit::new(b.clone(), cfg)));
    }
    TargetDef {
        name: TARGET.into(),
        alias: None,
        max_connections: None,
        error_recovery_level: None,
        scsi: Arc::new(scsi),
    }
}

/// LUNs 0-3: RAM, a tmpfs file (4096-byte blocks), NULL, and the health check's RAM LUN.
fn backends(name: &str) -> Vec<Arc<dyn BlockDevice>> {
    // A tmpfs file, unlinked at once: the backend keeps its descriptor.
    let path = std::path::PathBuf::from(format!(
        "/dev/shm/ironsan-fuzz-session-{}-{name}.img",
        std::process::id()
    ));
    let file = FileBackend::open(
        &path,
        &FileOptions {
            size: Some(LUN_BYTES),
            io_threads: 2,
            ..Default::default()
        },
    );
    let _ = std::fs::remove_file(&path);
    vec![
        Arc::new(RamBackend::new(LUN_BYTES)),
        Arc::new(file.expect("tmpfs file LUN")),
        Arc::new(NullBackend::new(LUN_BYTES)),
        Arc::new(RamBackend::new(1 << 20)),
    ]
}

extern "C" {
    fn signal(signum: i32, handler: usize) -> usize;
}

/// Ignore SIGPIPE, as the Rust runtime does for `ironsan serve` and as `Server` asks of a
/// process embedding it (libFuzzer's `main` is not Rust's): the server's `sendfile` to a peer
/// that reset (`Cut`) then fails with EPIPE instead of killing the process.
fn ignore_sigpipe() {
    const SIGPIPE: i32 = 13;
    const SIG_IGN: usize = 1;
    // SAFETY: installs the libc-defined "ignore" disposition for SIGPIPE, before any thread
    // of the rig starts; no handler code of ours runs.
    unsafe {
        signal(SIGPIPE, SIG_IGN);
    }
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        ignore_sigpipe();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        // Each server has LUNs of its own: an LU fences the ranges of its aborted writes,
        // and two LUs over one backend would not see each other's fences.
        let addrs = rt.block_on(async {
            let mut addrs = Vec::new();
            for mode in [ZeroCopyReads::On, ZeroCopyReads::Mapped] {
                let mut cfg = ServerConfig::new(
                    vec!["127.0.0.1:0".parse().expect("addr")],
                    vec![target(&backends(mode.name()))],
                );
                cfg.limits.zero_copy_reads = mode;
                cfg.limits.login_timeout = WAIT;
                let server = Server::bind(cfg).await.expect("bind");
                addrs.push(server.local_addrs()[0]);
                tokio::spawn(server.run(std::future::pending::<()>()));
            }
            addrs
        });
        let addrs = [addrs[0], addrs[1]];
        for a in addrs {
            rt.block_on(health(a, &Outcome::default()));
        }
        Rig {
            rt,
            addrs,
            fd_baseline: fd_count(),
            runs: AtomicU64::new(0),
        }
    })
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

#[derive(Arbitrary, Debug)]
struct Input {
    mapped: bool,
    verify: bool,
    header_digest: bool,
    data_digest: bool,
    small_segments: bool,
    initial_r2t: bool,
    immediate_data: bool,
    /// ErrorRecoveryLevel `erl % 3` offered at login (the target agrees to it).
    erl: u8,
    /// DefaultTime2Retain offered, `time2retain % 4` seconds (0: no connection recovery).
    time2retain: u8,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Read {
        lun: u8,
        lba: u16,
        blocks: u16,
        edtl_delta: Option<i16>,
    },
    Write {
        lun: u8,
        lba: u16,
        blocks: u16,
        edtl_delta: Option<i16>,
        immediate: u32,
        final_bit: bool,
    },
    Command {
        lun: u8,
        cdb: [u8; 16],
        read: bool,
        write: bool,
        edtl: u16,
        data: u16,
        attr: u8,
        immediate: bool,
    },
    /// Data-Out for the `r2t`-th R2T seen so far: all of it in `seg`-sized PDUs, the first
    /// one skewed as given.
    DataOut {
        r2t: u8,
        seg: u8,
        offset_delta: Option<i32>,
        sn_delta: i8,
        len_delta: Option<i16>,
        ttt: Option<u32>,
        final_bit: bool,
    },
    /// Unsolicited Data-Out (TTT ffffffff) for the `write`-th write sent.
    Unsolicited {
        write: u8,
        offset: u32,
        len: u16,
        data_sn: u8,
        final_bit: bool,
    },
    Nop {
        ping: u16,
        ttt: Option<u32>,
        immediate: bool,
    },
    Tmf {
        function: u8,
        lun: u8,
        cmd: u8,
        immediate: bool,
    },
    Text {
        data: Vec<u8>,
        final_bit: bool,
        cont: bool,
    },
    Logout {
        reason: u8,
    },
    Raw {
        bhs: [u8; 48],
        data: Vec<u8>,
        honest_len: bool,
    },
    SkewCmdSn(i8),
    /// Let the target catch up (so later Data-Out can answer its R2Ts).
    Wait,
    /// Answer every R2T not answered yet the way a well-behaved initiator does.
    Answer,
    /// Log in again with the same ISID on a new connection (session reinstatement) and go
    /// on there; the old connection stays open on our side, whatever it still has in flight.
    Reinstate,
    /// Send only the first `cut` bytes (modulo its length) of the next PDU and hold the
    /// rest; the connection then sends nothing more until `Release` (a stalled path).
    Split(u16),
    /// Send what `Split` held back, on the connection it belongs to, even one that
    /// reinstatement replaced (a late retransmission).
    Release,
    /// Log in another connection of the session with CID `cid % 4` (a CID in use reinstates
    /// that connection) and go on there.
    Join {
        cid: u8,
    },
    /// Go on with another open connection of the session.
    Switch(u8),
    /// A Logout naming CID `cid % 4` with reason `reason % 4`, on the connection in use.
    LogoutCid {
        cid: u8,
        reason: u8,
    },
    /// Damage the next PDU sent: its header (the digest, or BHS byte `at % 48`) or its data
    /// segment (the digest, or data byte `at`), so that its digest no longer matches. Only
    /// with that digest negotiated; otherwise (or with no data) the PDU goes out sound.
    Damage {
        header: bool,
        at: Option<u8>,
    },
    /// A SNACK Request (RFC 7143 §11.16) of any type (the low 4 bits are sent), for a tag of
    /// ours, a Data-In's A bit, or arbitrary; `near` brings BegRun near what the type
    /// counts (StatSN, the DataSN after the acknowledged Data-In, small DataSNs or R2TSNs) and
    /// RunLength under 4; `unacked`: its ExpStatSN is `1 + unacked % 4` behind ours, so the
    /// last statuses stay unacknowledged (and what it asks for may still be kept).
    Snack {
        snack_type: u8,
        tag: SnackTag,
        beg_run: u32,
        run_length: u32,
        near: bool,
        unacked: Option<u8>,
    },
    /// Drop the session's open connection `conn % n` (0 the one in use, which the next open
    /// one then replaces) without a logout, whatever it has in flight; with no other
    /// connection left nothing goes out until `Join` or `Reinstate`.
    Cut {
        conn: u8,
        how: CutHow,
    },
    /// TASK REASSIGN (RFC 7143 §11.5.1) on the connection in use, with ExpDataSN
    /// `exp_data_sn` (`near`: `exp_data_sn % 8`).
    Reassign {
        tag: ReassignTag,
        exp_data_sn: u32,
        near: bool,
    },
    /// A Logout for recovery (reason 2) naming CID `cid % 8`, with the named connection's
    /// ExpStatSN (ours for a CID we never had), `1 + unacked % 4` behind it if given.
    LogoutRecovery {
        cid: u8,
        unacked: Option<u8>,
    },
}

/// How `Cut` drops a connection.
#[derive(Arbitrary, Debug)]
enum CutHow {
    /// FIN; the target's answers are still read until it closes.
    HalfClose,
    /// close(): FIN, or RST with unread answers.
    Close,
    /// RST (SO_LINGER 0), as a crashed host.
    Reset,
}

/// What a TASK REASSIGN names.
#[derive(Arbitrary, Debug)]
enum ReassignTag {
    /// The `n`-th task sent.
    Task(u8),
    /// The `n`-th task sent on a connection cut, logged out for recovery or replaced (any
    /// task when there is none).
    Kept(u8),
    Raw(u32),
}

/// What a SNACK names.
#[derive(Arbitrary, Debug)]
enum SnackTag {
    /// The `cmd`-th task sent (its ITT and LUN), with a TTT (the SNACK Tag of an R-Data
    /// SNACK) or the reserved one.
    Task {
        cmd: u8,
        ttt: Option<u32>,
    },
    /// The `n`-th Data-In seen with the A bit: a DataACK's reserved ITT, its TTT and LUN.
    Acked(u8),
    Raw {
        itt: u32,
        ttt: u32,
    },
}

/// What the reader has seen from the target.
#[derive(Default)]
struct Seen {
    r2ts: Vec<R2t>,
    exp_stat_sn: u32,
    pdus: usize,
    /// ITTs that ended with GOOD in a SCSI Response.
    good: std::collections::HashSet<u32>,
    /// Data-In with the A bit (a DataACK asked for): LUN, TTT, DataSN.
    acks: Vec<(Lun, Ttt, DataSn)>,
}

impl Seen {
    /// A status with this StatSN arrived: ExpStatSN follows it, but never goes back for a
    /// status sent again (a Status SNACK's answer keeps its StatSN).
    fn advance(&mut self, stat_sn: u32) {
        let next = stat_sn.wrapping_add(1);
        if next.wrapping_sub(self.exp_stat_sn) < 1 << 31 {
            self.exp_stat_sn = next;
        }
    }
}

/// A WRITE(16) the session sent to the RAM (0) or file (1) LUN: its CDB's range, and whether
/// its EDTL matched it (only those are checked; every one counts as covering its range).
struct Sent {
    itt: Itt,
    /// The connection it went on, and its place among the session's writes.
    conn: usize,
    index: usize,
    lun: usize,
    lba: u64,
    blocks: u32,
    exact: bool,
}

/// The byte at buffer offset `x` of the write with ITT `itt` (immediate or Data-Out alike).
fn byte_of(itt: Itt, x: u32) -> u8 {
    (x as u8)
        .wrapping_mul(13)
        .wrapping_add((x >> 9) as u8)
        .wrapping_add((itt.0 as u8).wrapping_mul(101))
}

fn write_data(itt: Itt, offset: u32, len: usize) -> Bytes {
    Bytes::from(
        (0..len as u32)
            .map(|i| byte_of(itt, offset.wrapping_add(i)))
            .collect::<Vec<u8>>(),
    )
}

/// An op's LUN: 0-2, or an absent one.
fn lun_of(n: u8) -> (Lun, u32, u64) {
    match n % 4 {
        0 => (Lun::from_number(0), 512, LUN_BYTES / 512),
        1 => (Lun::from_number(1), 4096, LUN_BYTES / 4096),
        2 => (Lun::from_number(2), 512, LUN_BYTES / 512),
        _ => (Lun::from_number(9), 512, LUN_BYTES / 512),
    }
}

/// The LUN for a command that may write anything: with `verify`, only the NULL LUN or an
/// absent one (EXTENDED COPY only the absent one: it can name other LUs as destinations).
fn free_lun(n: u8, verify: bool, opcode: u8) -> Lun {
    if !verify {
        lun_of(n).0
    } else if n % 2 == 0 && opcode != 0x83 {
        Lun::from_number(2)
    } else {
        Lun::from_number(9)
    }
}

fn pattern(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect::<Vec<u8>>(),
    )
}

/// A READ/WRITE(16)'s LUN, LBA (up to 64 blocks past the end), block count (at most 1 MiB)
/// and EDTL (skewed by `edtl_delta`).
fn rw_args(lun: u8, lba: u16, blocks: u16, edtl_delta: Option<i16>) -> (Lun, u64, u32, u32) {
    let (l, bs, nblocks) = lun_of(lun);
    let blocks = u32::from(blocks) % (((1 << 20) / bs) + 1);
    let lba = u64::from(lba) % (nblocks + 64);
    let edtl = (blocks * bs).saturating_add_signed(edtl_delta.unwrap_or(0).into());
    (l, lba, blocks, edtl)
}

fn rw16(op: u8, lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

/// One connection of the fuzzed session: our write half, what its reader saw, the reader.
struct Conn {
    /// Unique in the run (connections replaced or closed keep theirs).
    no: usize,
    cid: u16,
    /// `None` once `Cut` dropped it.
    wr: Option<tokio::net::tcp::OwnedWriteHalf>,
    seen: Arc<Mutex<Seen>>,
    /// Stopped by `Cut` when it closes the socket.
    reader: tokio::task::JoinHandle<Result<(), String>>,
    /// Stalled behind bytes `Split` held back.
    stalled: bool,
    /// Cut or logged out for recovery: nothing more is sent on it.
    gone: bool,
    /// How many of the R2Ts it saw `Answer` has answered.
    answered: usize,
}

/// What a login gave: the connection and the values the session goes on with.
struct LoggedIn {
    conn: Conn,
    tsih: Tsih,
    digests: Digests,
    cmd_sn: u32,
    target_mrdsl: u32,
    immediate_data: bool,
    /// ErrorRecoveryLevel above 0.
    erl: bool,
    /// ErrorRecoveryLevel 2 with DefaultTime2Retain above 0: a failed connection's tasks are
    /// kept for reassignment.
    recovers: bool,
}

/// Log in (a leading login: with the ISID of a live session, that session is reinstated)
/// and start the connection's reader. `erl`, `recovers`: the session's (what a login that
/// does not negotiate session-wide keys goes on with).
async fn connect(
    addr: SocketAddr,
    o: &LoginOptions,
    cmd_sn: u32,
    no: usize,
    erl: bool,
    recovers: bool,
) -> Option<LoggedIn> {
    let login = async {
        let mut c = Client::connect(addr).await?;
        c.cmd_sn = CmdSn(cmd_sn);
        c.login_on(o).await.map(|()| c)
    };
    let c = tokio::time::timeout(WAIT, login)
        .await
        .expect("login: no answer within 5 s")
        .ok()?;
    let tsih = c.tsih;
    let level = c.negotiated_value("ErrorRecoveryLevel");
    let recovers = match (level, c.negotiated_value("DefaultTime2Retain")) {
        (Some(l), Some(r)) => l == "2" && r != "0",
        _ => recovers,
    };
    let erl = level.map_or(erl, |v| v != "0");
    let digests = Digests {
        header: c.header_digest,
        data: c.data_digest,
    };
    let (cmd_sn, exp_stat_sn, target_mrdsl, immediate_data) = (
        c.cmd_sn.0,
        c.exp_stat_sn.0,
        c.target_mrdsl,
        c.immediate_data,
    );
    let (rd, wr) = c.into_stream().ok()?.into_split();
    let seen = Arc::new(Mutex::new(Seen {
        exp_stat_sn,
        ..Default::default()
    }));
    let mrdsl = o.max_recv_data_segment_length;
    let reader = tokio::spawn(reader(
        BufReader::new(rd),
        digests,
        mrdsl,
        erl,
        seen.clone(),
    ));
    Some(LoggedIn {
        conn: Conn {
            no,
            cid: o.cid.0,
            wr: Some(wr),
            seen,
            reader,
            stalled: false,
            gone: false,
            answered: 0,
        },
        tsih,
        digests,
        cmd_sn,
        target_mrdsl,
        immediate_data,
        erl,
        recovers,
    })
}

struct Sender {
    addr: SocketAddr,
    login: LoginOptions,
    /// The connection in use, which one it is (0 first), and the ones reinstatement
    /// replaced (their write halves stay open: the target must end them itself).
    conn: Conn,
    /// The other open connections of the session.
    others: Vec<Conn>,
    old: Vec<Conn>,
    next_no: usize,
    tsih: Tsih,
    /// (connection, writes sent before it was replaced or closed and its tasks ended). Not
    /// for connections cut or kept for reassignment: their tasks end at no point we know.
    ended: Vec<(usize, usize)>,
    /// The next PDU is split here (`Split`); bytes held back, per connection number; whether
    /// the connection in use is stalled behind them.
    split_next: Option<u16>,
    held: Vec<(usize, Vec<u8>)>,
    digests: Digests,
    cmd_sn: u32,
    next_itt: u32,
    /// (itt, lun, edtl) of the writes sent.
    writes: Vec<(Itt, Lun, u32)>,
    /// WRITE(16)s to LUNs 0 and 1, for `verify`.
    sent: Vec<Sent>,
    verify: bool,
    /// The tasks sent: ITT, LUN and the connection they went on.
    itts: Vec<(Itt, Lun, usize)>,
    target_mrdsl: u32,
    /// The session's ErrorRecoveryLevel is above 0.
    erl: bool,
    /// The session keeps a failed connection's tasks for reassignment (level 2).
    recovers: bool,
    /// Connections cut, logged out for recovery or replaced while `recovers`: their tasks may
    /// still be kept, reassigned and completed.
    kept: Vec<usize>,
    /// The next PDU sent is damaged (`Damage`): its header or its data, at the digest or at
    /// a byte.
    damage: Option<(bool, Option<u8>)>,
    /// The last PDU went out whole and sound (not held back, split or damaged).
    sent_whole: bool,
}

impl Sender {
    fn itt(&mut self) -> Itt {
        self.next_itt += 1;
        Itt(self.next_itt)
    }
    fn exp_stat_sn(&self) -> StatSn {
        StatSn(self.conn.seen.lock().map_or(0, |s| s.exp_stat_sn))
    }
    fn cmd_sn(&mut self, immediate: bool) -> CmdSn {
        let sn = CmdSn(self.cmd_sn);
        if !immediate {
            self.cmd_sn = self.cmd_sn.wrapping_add(1);
        }
        sn
    }
    async fn send_bhs(&mut self, bhs: &Bhs, data: &[u8]) -> std::io::Result<()> {
        let mut buf = wire_pdu(bhs, data, self.digests.header, self.digests.data);
        self.sent_whole = false;
        if self.conn.stalled || self.conn.gone {
            return Ok(());
        }
        let Some(wr) = self.conn.wr.as_mut() else {
            return Ok(());
        };
        let mut damaged = false;
        if let Some((header, at)) = self.damage.take() {
            // The header digest is bytes 48..52, the data digest the last 4 (RFC 7143 §11.1).
            let hd = if self.digests.header { 4 } else { 0 };
            let i = match (header, at) {
                (true, _) if !self.digests.header => None,
                (true, None) => Some(48 + 3),
                (true, Some(b)) => Some(usize::from(b) % 48),
                (false, _) if !self.digests.data || data.is_empty() => None,
                (false, None) => Some(buf.len() - 1),
                (false, Some(b)) => Some(48 + hd + usize::from(b) % data.len()),
            };
            if let Some(b) = i.and_then(|i| buf.get_mut(i)) {
                *b ^= 0x5a;
                damaged = true;
            }
        }
        if let Some(cut) = self.split_next.take() {
            let cut = 1 + usize::from(cut) % buf.len();
            if cut < buf.len() {
                self.held.push((self.conn.no, buf[cut..].to_vec()));
                self.conn.stalled = true;
                return wr.write_all(&buf[..cut]).await;
            }
        }
        self.sent_whole = !damaged;
        wr.write_all(&buf).await
    }
    async fn send(&mut self, header: Header, data: Bytes) -> std::io::Result<()> {
        let pdu = Pdu::new(header, data);
        self.send_bhs(&pdu.bhs(), &pdu.data).await
    }

    #[allow(clippy::too_many_arguments)]
    async fn command(
        &mut self,
        lun: Lun,
        cdb: [u8; 16],
        read: bool,
        write: bool,
        edtl: u32,
        data: Bytes,
        final_bit: bool,
        immediate: bool,
        attr: u8,
    ) -> std::io::Result<()> {
        let itt = self.itt();
        self.itts.push((itt, lun, self.conn.no));
        if write {
            self.writes.push((itt, lun, edtl));
        }
        let cmd = ScsiCommand {
            immediate,
            final_bit,
            read,
            write,
            attr: TaskAttr(attr % 8),
            lun,
            itt,
            expected_data_transfer_length: edtl,
            cmd_sn: self.cmd_sn(immediate),
            exp_stat_sn: self.exp_stat_sn(),
            cdb,
        };
        self.send(Header::ScsiCommand(cmd), data).await
    }

    /// Log a connection in with `o` (numbered next), going on with what the session has.
    async fn log_in(&mut self, o: &LoginOptions) -> Option<LoggedIn> {
        let l = connect(
            self.addr,
            o,
            self.cmd_sn,
            self.next_no,
            self.erl,
            self.recovers,
        )
        .await?;
        self.next_no += 1;
        Some(l)
    }

    async fn op(&mut self, op: Op, imm_data: bool) -> std::io::Result<()> {
        let sends = !matches!(
            op,
            Op::SkewCmdSn(_)
                | Op::Wait
                | Op::Reinstate
                | Op::Split(_)
                | Op::Release
                | Op::Join { .. }
                | Op::Switch(_)
                | Op::Damage { .. }
                | Op::Cut { .. }
        );
        if sends && self.conn.gone {
            // No connection left to send on (it takes no CmdSN or tag either).
            return Ok(());
        }
        match op {
            Op::Read {
                lun,
                lba,
                blocks,
                edtl_delta,
            } => {
                let (l, lba, blocks, edtl) = rw_args(lun, lba, blocks, edtl_delta);
                let cdb = rw16(0x88, lba, blocks);
                self.command(l, cdb, true, false, edtl, Bytes::new(), true, false, 1)
                    .await
            }
            Op::Write {
                lun,
                lba,
                blocks,
                edtl_delta,
                immediate,
                final_bit,
            } => {
                let (l, lba, blocks, edtl) = rw_args(lun, lba, blocks, edtl_delta);
                let imm = if imm_data {
                    (immediate % (edtl + 1)).min(self.target_mrdsl)
                } else {
                    0
                };
                let cdb = rw16(0x8a, lba, blocks);
                let itt = Itt(self.next_itt + 1);
                if lun % 4 < 2 {
                    self.sent.push(Sent {
                        itt,
                        conn: self.conn.no,
                        index: self.sent.len(),
                        lun: usize::from(lun % 4),
                        lba,
                        blocks,
                        exact: edtl_delta.is_none(),
                    });
                }
                let data = write_data(itt, 0, imm as usize);
                self.command(l, cdb, false, true, edtl, data, final_bit, false, 1)
                    .await
            }
            Op::Command {
                lun,
                cdb,
                read,
                write,
                edtl,
                data,
                attr,
                immediate,
            } => {
                let l = free_lun(lun, self.verify, cdb[0]);
                let data = pattern(usize::from(data).min(self.target_mrdsl as usize), 3);
                self.command(
                    l,
                    cdb,
                    read,
                    write,
                    edtl.into(),
                    data,
                    true,
                    immediate,
                    attr,
                )
                .await
            }
            Op::DataOut {
                r2t,
                seg,
                offset_delta,
                sn_delta,
                len_delta,
                ttt,
                final_bit,
            } => {
                let r = {
                    let seen = self
                        .conn
                        .seen
                        .lock()
                        .map_err(|_| std::io::ErrorKind::Other)?;
                    if seen.r2ts.is_empty() {
                        return Ok(());
                    }
                    seen.r2ts[usize::from(r2t) % seen.r2ts.len()].clone()
                };
                let seg = (512u32 << (seg % 10)).min(self.target_mrdsl);
                let mut off = r.buffer_offset;
                let end = r
                    .buffer_offset
                    .saturating_add(r.desired_data_transfer_length);
                let mut sn = 0u32;
                let mut first = true;
                while off < end || first {
                    let mut len = seg.min(end - off);
                    let mut at = off;
                    let mut data_sn = DataSn(sn);
                    if first {
                        at = off.saturating_add_signed(offset_delta.unwrap_or(0));
                        data_sn = DataSn(sn.wrapping_add_signed(sn_delta.into()));
                        len = len
                            .saturating_add_signed(len_delta.unwrap_or(0).into())
                            .min(1 << 20);
                    }
                    let last = off + seg >= end;
                    let d = DataOut {
                        final_bit: if last { final_bit || !first } else { false },
                        lun: r.lun,
                        itt: r.itt,
                        ttt: if first { ttt.map_or(r.ttt, Ttt) } else { r.ttt },
                        exp_stat_sn: self.exp_stat_sn(),
                        data_sn,
                        buffer_offset: at,
                    };
                    self.send(Header::DataOut(d), write_data(r.itt, at, len as usize))
                        .await?;
                    first = false;
                    sn += 1;
                    off = off.saturating_add(seg);
                    if seg == 0 {
                        break;
                    }
                }
                Ok(())
            }
            Op::Unsolicited {
                write,
                offset,
                len,
                data_sn,
                final_bit,
            } => {
                let Some(&(itt, lun, edtl)) = (!self.writes.is_empty())
                    .then(|| &self.writes[usize::from(write) % self.writes.len()])
                else {
                    return Ok(());
                };
                let d = DataOut {
                    final_bit,
                    lun,
                    itt,
                    ttt: Ttt::RESERVED,
                    exp_stat_sn: self.exp_stat_sn(),
                    data_sn: DataSn(data_sn.into()),
                    buffer_offset: offset % (edtl + 1),
                };
                let len = usize::from(len).min(self.target_mrdsl as usize);
                let data = write_data(itt, d.buffer_offset, len);
                self.send(Header::DataOut(d), data).await
            }
            Op::Nop {
                ping,
                ttt,
                immediate,
            } => {
                let itt = if ttt.is_some() {
                    Itt::RESERVED
                } else {
                    self.itt()
                };
                let n = NopOut {
                    immediate: immediate || ttt.is_some(),
                    lun: Lun::default(),
                    itt,
                    ttt: ttt.map_or(Ttt::RESERVED, Ttt),
                    cmd_sn: self.cmd_sn(immediate || ttt.is_some()),
                    exp_stat_sn: self.exp_stat_sn(),
                };
                let len = usize::from(ping).min(self.target_mrdsl as usize);
                self.send(Header::NopOut(n), pattern(len, 5)).await
            }
            Op::Tmf {
                function,
                lun,
                cmd,
                immediate,
            } => {
                let referenced = if self.itts.is_empty() {
                    Itt(u32::from(cmd))
                } else {
                    self.itts[usize::from(cmd) % self.itts.len()].0
                };
                let itt = self.itt();
                let t = TaskMgmtRequest {
                    immediate,
                    function: TmfFunction(function % 16),
                    lun: lun_of(lun).0,
                    itt,
                    referenced_task_tag: referenced,
                    cmd_sn: self.cmd_sn(immediate),
                    exp_stat_sn: self.exp_stat_sn(),
                    ref_cmd_sn: CmdSn(self.cmd_sn.wrapping_sub(u32::from(cmd % 4))),
                    exp_data_sn: DataSn(0),
                };
                self.send(Header::TaskMgmtRequest(t), Bytes::new()).await
            }
            Op::Text {
                data,
                final_bit,
                cont,
            } => {
                let itt = self.itt();
                let t = TextRequest {
                    immediate: false,
                    final_bit,
                    cont,
                    lun: Lun::default(),
                    itt,
                    ttt: Ttt::RESERVED,
                    cmd_sn: self.cmd_sn(false),
                    exp_stat_sn: self.exp_stat_sn(),
                };
                let mut data = data;
                data.truncate(self.target_mrdsl as usize);
                self.send(Header::TextRequest(t), Bytes::from(data)).await
            }
            Op::Logout { reason } => {
                let itt = self.itt();
                let l = LogoutRequest {
                    immediate: true,
                    reason: LogoutReason(reason % 4),
                    itt,
                    cid: Cid(0),
                    cmd_sn: self.cmd_sn(true),
                    exp_stat_sn: self.exp_stat_sn(),
                };
                self.send(Header::LogoutRequest(l), Bytes::new()).await
            }
            Op::Raw {
                mut bhs,
                mut data,
                honest_len,
            } => {
                data.truncate(self.target_mrdsl as usize);
                if self.verify && bhs[0] & 0x3f == 0x01 {
                    // A SCSI Command: keep it off the LUNs `verify` checks.
                    let lun = free_lun(bhs[8], true, bhs[32]);
                    bhs[8..16].copy_from_slice(&lun.0);
                }
                if honest_len {
                    bhs[4] = 0; // no AHS
                    bhs[5..8].copy_from_slice(&(data.len() as u32).to_be_bytes()[1..]);
                }
                self.send_bhs(&Bhs(bhs), &data).await
            }
            Op::SkewCmdSn(d) => {
                self.cmd_sn = self.cmd_sn.wrapping_add_signed(d.into());
                Ok(())
            }
            Op::Answer => {
                let r2ts: Vec<R2t> = {
                    let seen = self
                        .conn
                        .seen
                        .lock()
                        .map_err(|_| std::io::ErrorKind::Other)?;
                    seen.r2ts
                        .get(self.conn.answered..)
                        .unwrap_or_default()
                        .to_vec()
                };
                self.conn.answered += r2ts.len();
                for r in r2ts {
                    let end = r
                        .buffer_offset
                        .saturating_add(r.desired_data_transfer_length);
                    let mut off = r.buffer_offset;
                    let mut sn = 0;
                    while off < end {
                        let len = self.target_mrdsl.max(512).min(end - off);
                        let d = DataOut {
                            final_bit: off + len == end,
                            lun: r.lun,
                            itt: r.itt,
                            ttt: r.ttt,
                            exp_stat_sn: self.exp_stat_sn(),
                            data_sn: DataSn(sn),
                            buffer_offset: off,
                        };
                        self.send(Header::DataOut(d), write_data(r.itt, off, len as usize))
                            .await?;
                        off += len;
                        sn += 1;
                    }
                }
                Ok(())
            }
            Op::Reinstate => {
                let mut o = self.login.clone();
                o.tsih = Tsih(0);
                o.cid = Cid(0);
                let Some(l) = self.log_in(&o).await else {
                    return Ok(());
                };
                // Every connection of the old session ended before the new login's response,
                // and so did everything kept for reassignment: the old session ended.
                let now = self.sent.len();
                for c in &self.old {
                    self.ended.push((c.no, now));
                }
                let old = std::mem::replace(&mut self.conn, l.conn);
                for c in std::iter::once(old).chain(self.others.drain(..)) {
                    self.ended.push((c.no, now));
                    self.old.push(c);
                }
                self.kept.clear();
                self.tsih = l.tsih;
                self.digests = l.digests;
                self.cmd_sn = l.cmd_sn;
                self.target_mrdsl = l.target_mrdsl;
                self.erl = l.erl;
                self.recovers = l.recovers;
                Ok(())
            }
            Op::Join { cid } => {
                let mut o = self.login.clone();
                o.tsih = self.tsih;
                o.cid = Cid(u16::from(cid % 4));
                let Some(l) = self.log_in(&o).await else {
                    return Ok(());
                };
                // A CID in use: that connection was reinstated before the new one's login
                // response: its tasks ended then, or, when the session recovers connections,
                // they are kept for reassignment.
                let now = self.sent.len();
                let old = std::mem::replace(&mut self.conn, l.conn);
                for c in std::iter::once(old)
                    .chain(self.others.drain(..))
                    .collect::<Vec<_>>()
                {
                    if c.gone {
                        self.old.push(c);
                    } else if c.cid == o.cid.0 {
                        if self.recovers {
                            self.kept.push(c.no);
                        } else {
                            self.ended.push((c.no, now));
                        }
                        self.old.push(c);
                    } else {
                        self.others.push(c);
                    }
                }
                self.target_mrdsl = l.target_mrdsl;
                Ok(())
            }
            Op::Switch(n) => {
                if !self.others.is_empty() {
                    let i = usize::from(n) % self.others.len();
                    if self.conn.gone {
                        let next = self.others.swap_remove(i);
                        let c = std::mem::replace(&mut self.conn, next);
                        self.old.push(c);
                    } else {
                        std::mem::swap(&mut self.conn, &mut self.others[i]);
                    }
                }
                Ok(())
            }
            Op::LogoutCid { cid, reason } => {
                let itt = self.itt();
                let cid = u16::from(cid % 4);
                let reason = LogoutReason(reason % 4);
                let l = LogoutRequest {
                    immediate: true,
                    reason,
                    itt,
                    cid: Cid(cid),
                    cmd_sn: self.cmd_sn(true),
                    exp_stat_sn: self.exp_stat_sn(),
                };
                self.send(Header::LogoutRequest(l), Bytes::new()).await?;
                // Closing another connection of the session ends its tasks before the
                // Logout Response, so before anything sent after it here (if the target got
                // the Logout: not held back, split or damaged).
                if reason == LogoutReason::CLOSE_CONNECTION && self.sent_whole {
                    if let Some(i) = self.others.iter().position(|c| c.cid == cid) {
                        let c = self.others.swap_remove(i);
                        self.ended.push((c.no, self.sent.len()));
                        self.old.push(c);
                    }
                }
                if reason == LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY {
                    self.removed_for_recovery(cid);
                }
                Ok(())
            }
            Op::Damage { header, at } => {
                self.damage = Some((header, at));
                Ok(())
            }
            Op::Snack {
                snack_type,
                tag,
                beg_run,
                run_length,
                near,
                unacked,
            } => {
                let exp_stat_sn = self.exp_stat_sn();
                let (lun, itt, ttt, acked) = match tag {
                    SnackTag::Task { cmd, ttt } => {
                        let (itt, lun) = if self.itts.is_empty() {
                            (Itt(u32::from(cmd)), Lun::default())
                        } else {
                            let (itt, lun, _) = self.itts[usize::from(cmd) % self.itts.len()];
                            (itt, lun)
                        };
                        (lun, itt, ttt.map_or(Ttt::RESERVED, Ttt), None)
                    }
                    SnackTag::Acked(n) => {
                        let seen = self
                            .conn
                            .seen
                            .lock()
                            .map_err(|_| std::io::ErrorKind::Other)?;
                        let Some(&(lun, ttt, sn)) = (!seen.acks.is_empty())
                            .then(|| &seen.acks[usize::from(n) % seen.acks.len()])
                        else {
                            return Ok(());
                        };
                        (lun, Itt::RESERVED, ttt, Some(sn))
                    }
                    SnackTag::Raw { itt, ttt } => (Lun::default(), Itt(itt), Ttt(ttt), None),
                };
                let (beg_run, run_length) = if near {
                    let beg = match (snack_type & 0x0f, acked) {
                        // Status: StatSNs already sent.
                        (1, _) => exp_stat_sn.0.wrapping_sub(1 + beg_run % 8),
                        // DataACK: the DataSN after the acknowledged Data-In, or before it.
                        (_, Some(sn)) => sn.0.wrapping_add(1).wrapping_sub(beg_run % 3),
                        _ => beg_run % 8,
                    };
                    (beg, run_length % 4)
                } else {
                    (beg_run, run_length)
                };
                let s = SnackRequest {
                    snack_type,
                    lun,
                    itt,
                    ttt,
                    exp_stat_sn: StatSn(
                        exp_stat_sn
                            .0
                            .wrapping_sub(unacked.map_or(0, |k| 1 + u32::from(k % 4))),
                    ),
                    beg_run,
                    run_length,
                };
                self.send(Header::SnackRequest(s), Bytes::new()).await
            }
            Op::Split(cut) => {
                self.split_next = Some(cut);
                Ok(())
            }
            Op::Release => {
                for (conn, bytes) in std::mem::take(&mut self.held) {
                    if conn == self.conn.no && !self.conn.gone {
                        self.conn.stalled = false;
                        if let Some(wr) = self.conn.wr.as_mut() {
                            wr.write_all(&bytes).await?;
                        }
                    } else if let Some(c) = std::iter::once(&mut self.conn)
                        .chain(self.others.iter_mut())
                        .chain(self.old.iter_mut())
                        .find(|c| c.no == conn)
                    {
                        // It may be closed by now.
                        c.stalled = false;
                        if let Some(wr) = c.wr.as_mut() {
                            let _ = wr.write_all(&bytes).await;
                        }
                    }
                }
                Ok(())
            }
            Op::Wait => {
                let start = self.conn.seen.lock().map_or(0, |s| s.pdus);
                let deadline = Instant::now() + Duration::from_millis(20);
                while Instant::now() < deadline
                    && self.conn.seen.lock().map_or(0, |s| s.pdus) == start
                {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Ok(())
            }
            Op::Cut { conn, how } => {
                let k = usize::from(conn) % (1 + self.others.len());
                let mut c = if k > 0 {
                    self.others.swap_remove(k - 1)
                } else if self.conn.gone {
                    return Ok(());
                } else if let Some(next) = self.others.pop() {
                    std::mem::replace(&mut self.conn, next)
                } else {
                    // The session's last connection: it stays the one in use, sending nothing.
                    cut(&mut self.conn, how);
                    self.kept.push(self.conn.no);
                    return Ok(());
                };
                cut(&mut c, how);
                self.kept.push(c.no);
                self.old.push(c);
                Ok(())
            }
            Op::Reassign {
                tag,
                exp_data_sn,
                near,
            } => {
                let (referenced, lun) = match tag {
                    ReassignTag::Raw(itt) => (Itt(itt), Lun::default()),
                    ReassignTag::Task(n) => self.task(n, false),
                    ReassignTag::Kept(n) => self.task(n, true),
                };
                let itt = self.itt();
                let t = TaskMgmtRequest {
                    immediate: true,
                    function: TmfFunction::TASK_REASSIGN,
                    lun,
                    itt,
                    referenced_task_tag: referenced,
                    cmd_sn: self.cmd_sn(true),
                    exp_stat_sn: self.exp_stat_sn(),
                    ref_cmd_sn: CmdSn(self.cmd_sn),
                    exp_data_sn: DataSn(if near { exp_data_sn % 8 } else { exp_data_sn }),
                };
                self.send(Header::TaskMgmtRequest(t), Bytes::new()).await
            }
            Op::LogoutRecovery { cid, unacked } => {
                let cid = u16::from(cid % 8);
                // RFC 7143 §11.14: the ExpStatSN of the connection named (its latest with the
                // CID: StatSNs are per connection).
                let named = std::iter::once(&self.conn)
                    .chain(self.others.iter())
                    .chain(self.old.iter())
                    .filter(|c| c.cid == cid)
                    .max_by_key(|c| c.no)
                    .map(|c| c.seen.lock().map_or(0, |s| s.exp_stat_sn));
                let exp_stat_sn = named.unwrap_or(self.exp_stat_sn().0);
                let itt = self.itt();
                let l = LogoutRequest {
                    immediate: true,
                    reason: LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY,
                    itt,
                    cid: Cid(cid),
                    cmd_sn: self.cmd_sn(true),
                    exp_stat_sn: StatSn(
                        exp_stat_sn.wrapping_sub(unacked.map_or(0, |k| 1 + u32::from(k % 4))),
                    ),
                };
                self.send(Header::LogoutRequest(l), Bytes::new()).await?;
                self.removed_for_recovery(cid);
                Ok(())
            }
        }
    }

    /// The `n`-th task sent (`kept`: on a connection in `kept`, if any was): ITT and LUN.
    fn task(&self, n: u8, kept: bool) -> (Itt, Lun) {
        let kept = kept && self.itts.iter().any(|t| self.kept.contains(&t.2));
        let from: Vec<(Itt, Lun)> = self
            .itts
            .iter()
            .filter(|t| !kept || self.kept.contains(&t.2))
            .map(|t| (t.0, t.1))
            .collect();
        from.get(usize::from(n) % from.len().max(1))
            .copied()
            .unwrap_or((Itt(u32::from(n)), Lun::default()))
    }

    /// A Logout for recovery named `cid`: when the session recovers connections and the
    /// target got it, that connection closes with its tasks kept (the one in use after the
    /// response: the next open one takes over, if any).
    fn removed_for_recovery(&mut self, cid: u16) {
        if !self.recovers || !self.sent_whole {
            return;
        }
        if self.conn.cid == cid {
            self.conn.gone = true;
            self.kept.push(self.conn.no);
            if let Some(next) = self.others.pop() {
                let c = std::mem::replace(&mut self.conn, next);
                self.old.push(c);
            }
        } else if let Some(i) = self.others.iter().position(|c| c.cid == cid) {
            let mut c = self.others.swap_remove(i);
            c.gone = true;
            self.kept.push(c.no);
            self.old.push(c);
        }
    }
}

/// Drop the connection `c` (`Cut`): nothing more is sent on it.
fn cut(c: &mut Conn, how: CutHow) {
    c.gone = true;
    let Some(wr) = c.wr.take() else {
        return;
    };
    match how {
        // Dropping the write half shuts it down (FIN); the reader goes on.
        CutHow::HalfClose => drop(wr),
        CutHow::Close | CutHow::Reset => {
            if matches!(how, CutHow::Reset) {
                let _ = wr.as_ref().set_zero_linger();
            }
            // The socket closes when the reader, stopped here, drops the read half.
            wr.forget();
            c.reader.abort();
        }
    }
}

/// Read what the target sends until it closes, checking every PDU.
async fn reader(
    mut rd: BufReader<OwnedReadHalf>,
    digests: Digests,
    our_mrdsl: u32,
    erl: bool,
    seen: Arc<Mutex<Seen>>,
) -> Result<(), String> {
    loop {
        let r = match read_pdu(&mut rd, digests, our_mrdsl).await {
            Ok(r) => r,
            Err(ReadError::Closed) => return Ok(()),
            Err(ReadError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
                ) =>
            {
                return Ok(())
            }
            Err(e) => return Err(format!("the target sent a bad PDU: {e}")),
        };
        let stat_sn = u32::from_be_bytes([r.bhs.0[24], r.bhs.0[25], r.bhs.0[26], r.bhs.0[27]]);
        let mut s = seen.lock().map_err(|_| "poisoned".to_string())?;
        s.pdus += 1;
        match r.pdu.header {
            Header::R2t(t) => {
                if s.r2ts.len() < 256 {
                    s.r2ts.push(t)
                }
            }
            Header::ScsiResponse(r) => {
                if r.status == 0 && r.response == ServiceResponse::COMMAND_COMPLETED {
                    s.good.insert(r.itt.0);
                }
                s.advance(stat_sn)
            }
            Header::NopIn(_)
            | Header::TaskMgmtResponse(_)
            | Header::TextResponse(_)
            | Header::LogoutResponse(_)
            | Header::AsyncMessage(_)
            | Header::Reject(_) => s.advance(stat_sn),
            Header::DataIn(d) => {
                if d.status.is_some() {
                    s.advance(stat_sn)
                }
                if d.ack {
                    if !erl {
                        // RFC 7143 §11.7.2: the A bit MUST NOT be set at ErrorRecoveryLevel 0.
                        return Err(format!(
                            "Data-In with the A bit at ErrorRecoveryLevel 0: {d:?}"
                        ));
                    }
                    if s.acks.len() < 256 {
                        s.acks.push((d.lun, d.ttt, d.data_sn));
                    }
                }
            }
            other => return Err(format!("the target sent a non-target PDU: {other:?}")),
        }
    }
}

/// True for CHECK CONDITION with UNIT ATTENTION (a reset by the fuzzed session leaves one
/// for every nexus, this one's too).
fn unit_attention(r: &ironsan_initiator::CommandResult) -> bool {
    r.status == 2 && r.sense_key().map(|k| k.0) == Some(6)
}

/// READ(16) that answers GOOD, past the unit attentions a reset left.
async fn read_good(c: &mut Client, lun: u64, lba: u64, blocks: u32, bs: u32) -> Bytes {
    for _ in 0..4 {
        let r = c.read16(lun, lba, blocks, bs).await.expect("read");
        if !unit_attention(&r) {
            assert_eq!(r.status, 0, "read of LUN {lun}: sense {:?}", r.sense_key());
            return r.data;
        }
    }
    panic!("read of LUN {lun}: unit attention after unit attention");
}

/// A new session logs in, writes and reads back 8 KiB of the health LUN, then reads back
/// every block that exactly one write of the fuzzed session covered, where that write
/// ended GOOD (`sent` and `good` empty unless `verify`).
/// What a fuzzed session leaves to check: its writes, the ITTs that ended GOOD, and when each
/// connection whose tasks the target ended (replaced or closed, not kept for reassignment)
/// ended them (connection, writes sent before that).
#[derive(Default)]
struct Outcome {
    sent: Vec<Sent>,
    good: std::collections::HashSet<u32>,
    ended: Vec<(usize, usize)>,
}

async fn health(addr: SocketAddr, out: &Outcome) {
    let (sent, good) = (&out.sent, &out.good);
    // Write `o` was done, or aborted and fenced, before write `w` was sent.
    let ended_before = |o: &Sent, w: &Sent| {
        out.ended
            .iter()
            .any(|&(conn, at)| conn == o.conn && at <= w.index)
    };
    let mut o = LoginOptions::new(Some(TARGET));
    o.initiator_name = "iqn.2026-11.org.ironsan:fuzz-health".into();
    o.isid = Isid([0x80, 0, 0, 0, 0x48, 1]);
    let run = async {
        let mut c = Client::login(addr, &o).await.expect("health login");
        let data = pattern(8192, 0x5a);
        let mut w = c.write16(HEALTH_LUN, 8, data.clone(), 512, false).await;
        for _ in 0..4 {
            match &w {
                Ok(r) if unit_attention(r) => {
                    w = c.write16(HEALTH_LUN, 8, data.clone(), 512, false).await
                }
                _ => break,
            }
        }
        let w = w.expect("health write");
        assert_eq!(w.status, 0, "health write: sense {:?}", w.sense_key());
        let r = read_good(&mut c, HEALTH_LUN, 8, 16, 512).await;
        assert!(r == data, "health read returned other data");
        for w in sent
            .iter()
            .filter(|w| w.exact && good.contains(&w.itt.0))
            .take(16)
        {
            let bs = if w.lun == 1 { 4096 } else { 512 };
            let got = read_good(&mut c, w.lun as u64, w.lba, w.blocks, bs).await;
            for b in 0..w.blocks {
                let lba = w.lba + u64::from(b);
                // Writes sent on a connection that was replaced or closed before this one was
                // sent were ended (done, or aborted and fenced) by then. Those of a connection
                // cut or kept for reassignment may complete at any time (reassigned, or still
                // running when it failed): they always count.
                let alone = sent
                    .iter()
                    .filter(|o| o.lun == w.lun && o.lba <= lba && lba < o.lba + u64::from(o.blocks))
                    .all(|o| o.itt == w.itt || ended_before(o, w));
                let at = (b * bs) as usize;
                let want = write_data(w.itt, b * bs, bs as usize);
                if alone && got.get(at..at + bs as usize) != Some(&want[..]) {
                    panic!(
                        "LUN {} block {lba}: not the data of write {:?} ({} blocks at {}), which \
                         ended GOOD and alone covered it",
                        w.lun, w.itt, w.blocks, w.lba
                    );
                }
            }
        }
        let _ = c.logout().await;
    };
    tokio::time::timeout(WAIT, run)
        .await
        .expect("health check: no answer within 5 s");
}

/// The fuzzed session; returns its WRITE(16)s to LUNs 0-1 and the ITTs that ended GOOD
/// (both empty unless `verify`).
async fn session(addr: SocketAddr, i: Input) -> Outcome {
    let mut o = LoginOptions::new(Some(TARGET));
    o.initiator_name = "iqn.2026-11.org.ironsan:fuzz-session".into();
    o.isid = Isid([0x80, 0, 0, 0, 0x46, 1]);
    o.header_digest = i.header_digest;
    o.data_digest = i.data_digest;
    o.max_recv_data_segment_length = if i.small_segments { 8192 } else { 262144 };
    o.initial_r2t = i.initial_r2t;
    o.immediate_data = i.immediate_data;
    o.max_outstanding_r2t = 4;
    o.max_burst_length = 1 << 20;
    o.max_connections = 4;
    o.error_recovery_level = i.erl % 3;
    // Small, so kept connections expire quickly (after DefaultTime2Wait, 2 s, plus this).
    o.time2retain = u16::from(i.time2retain % 4);
    let l = connect(addr, &o, 1, 0, false, false).await.expect("login");
    let imm = l.immediate_data;
    let mut s = Sender {
        addr,
        login: o,
        conn: l.conn,
        others: Vec::new(),
        old: Vec::new(),
        next_no: 1,
        tsih: l.tsih,
        ended: Vec::new(),
        split_next: None,
        held: Vec::new(),
        digests: l.digests,
        cmd_sn: l.cmd_sn,
        next_itt: 0x100,
        writes: Vec::new(),
        sent: Vec::new(),
        verify: i.verify,
        itts: Vec::new(),
        target_mrdsl: l.target_mrdsl,
        erl: l.erl,
        recovers: l.recovers,
        kept: Vec::new(),
        damage: None,
        sent_whole: false,
    };
    for op in i.ops.into_iter().take(64) {
        match tokio::time::timeout(WAIT, s.op(op, imm)).await {
            Ok(Ok(())) => {}
            // The target closed the connection (a Logout, or an error it ends it for).
            Ok(Err(_)) => break,
            Err(_) => panic!("the target stopped reading for 5 s"),
        }
    }
    let mut good = std::collections::HashSet::new();
    for mut c in s
        .old
        .drain(..)
        .chain(s.others.drain(..))
        .chain(std::iter::once(s.conn))
    {
        if let Some(wr) = c.wr.as_mut() {
            let _ = wr.shutdown().await;
        }
        match tokio::time::timeout(WAIT, c.reader).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => panic!("{e}"),
            // `Cut` closed the socket and stopped its reader.
            Ok(Err(e)) if e.is_cancelled() && c.gone => {}
            Ok(Err(e)) => panic!("reader task: {e}"),
            Err(_) => panic!("the target kept a connection open 5 s after the initiator closed"),
        }
        good.extend(c.seen.lock().expect("seen").good.drain());
    }
    if !i.verify {
        return Default::default();
    }
    Outcome {
        sent: s.sent,
        good,
        ended: s.ended,
    }
}

fuzz_target!(|i: Input| {
    let rig = rig();
    let addr = rig.addrs[usize::from(i.mapped)];
    rig.rt.block_on(async {
        let out = session(addr, i).await;
        health(addr, &out).await;
    });
    if rig.runs.fetch_add(1, Ordering::Relaxed) % 256 == 255 {
        let deadline = Instant::now() + WAIT;
        while fd_count() > rig.fd_baseline + 16 {
            assert!(
                Instant::now() < deadline,
                "file descriptors: {} against {} at start",
                fd_count(),
                rig.fd_baseline
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
});
