//! Aborted writes and broken connections, through iSCSI (issue 6):
//!
//! * An aborted write whose I/O is already in the device (a `hang` fault: it cannot be called
//!   back, like a `pwritev2` running on an I/O thread) keeps its blocks' write range lock until
//!   the I/O is done. ABORT TASK still completes at once; a newer write of the same blocks waits
//!   for the device and then lands last, so the acknowledged newer data is what stays.
//! * A TCP reset in the middle of a write (R2Ts outstanding, Data-Out half sent), with session
//!   reinstatement (same initiator name and ISID, TSIH 0) before or after the reset: no old
//!   task is answered, a stuck old task is dropped, none of the broken write's blocks change
//!   (we never write before all of a command's data arrived, so whole blocks received are not
//!   written either), an old write in the device is ordered before the new session's writes,
//!   and the new session works.
//!
//! * A READ issued after ABORT TASK of blocks an aborted write still holds in the device waits
//!   for that write, so two successive reads agree.
//! * An initiator that stops reading its socket and answering NOP-In: the target's NOP-In
//!   timeout drops the connection, a new session with the same initiator name and ISID reads
//!   back every acknowledged write, and every unacknowledged one is all old or all new per
//!   block (the one still in the device included, read only once it finished).
//!
//! LUN 0 is a [`FaultBackend`] over RAM; the test reads the RAM under it directly.

use crate::support;
use bytes::Bytes;
use ironsan_backend::{BlockDevice, FaultControl, RamBackend};
use ironsan_initiator::{Client, CommandResult, LoginOptions};
use ironsan_proto::pdu::*;
use ironsan_proto::{CmdSn, DataSn};
use ironsan_server::ServerConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use support::{completions, drain};

const TARGET: &str = "iqn.2026-11.org.ironsan:abort-order";
const BS: u32 = 512;
const WAIT: Duration = Duration::from_secs(10);

type Rig = support::FaultRig;

async fn start(rules: &[&str]) -> Rig {
    start_cfg(rules, |_| {}).await
}

async fn start_cfg(rules: &[&str], tune: impl FnOnce(&mut ServerConfig)) -> Rig {
    let inner: Arc<dyn BlockDevice> = Arc::new(RamBackend::new(16 << 20));
    support::fault_rig(
        TARGET,
        inner,
        rules,
        1,
        Vec::new(),
        0x3000_0000_0000_0020,
        tune,
    )
    .await
}

fn opts(isid_last: u8) -> LoginOptions {
    let mut o = LoginOptions::new(Some(TARGET));
    o.isid.0[5] = isid_last;
    o
}

async fn login_with(addr: SocketAddr, o: &LoginOptions) -> Client {
    tokio::time::timeout(WAIT, Client::login(addr, o))
        .await
        .expect("login hung")
        .unwrap()
}

fn pattern(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect::<Vec<u8>>(),
    )
}

async fn write(c: &mut Client, lba: u64, data: Bytes) -> CommandResult {
    tokio::time::timeout(WAIT, c.write16(0, lba, data, BS, false))
        .await
        .expect("write hung")
        .unwrap()
}

async fn read(c: &mut Client, lba: u64, blocks: u32) -> CommandResult {
    tokio::time::timeout(WAIT, c.read16(0, lba, blocks, BS))
        .await
        .expect("read hung")
        .unwrap()
}

/// Send a WRITE(16) of `len` bytes without waiting, with `data` as immediate data (all of it,
/// or none to go by R2T); returns its ITT and CmdSN.
async fn send_write(c: &mut Client, lba: u64, len: u32, data: Bytes) -> (Itt, CmdSn) {
    c.send_write16(0, lba, len, BS, data).await.unwrap()
}

async fn wait_stuck(ctl: &FaultControl, n: usize) {
    support::wait_stuck_until(ctl, |s| s == n, &format!("waiting for {n} stuck I/Os")).await;
}

/// Receive until the final status of `itt`; returns it and everything else seen.
async fn wait_status(c: &mut Client, itt: Itt) -> (u8, Vec<Pdu>) {
    let mut seen = Vec::new();
    loop {
        let p = tokio::time::timeout(WAIT, c.recv())
            .await
            .expect("no status")
            .unwrap();
        if let Some(&(_, s)) = completions(std::slice::from_ref(&p))
            .iter()
            .find(|(i, _)| *i == itt)
        {
            return (s, seen);
        }
        seen.push(p);
    }
}

/// Send a WRITE(16) of `data` at `lba` that a `hang` rule holds in the device, and ABORT TASK
/// it: the abort completes while the I/O stays in the device (which never finishes on its
/// own, so an abort that waits for it times out). Returns the write's ITT.
async fn abort_write_stuck_in_device(rig: &Rig, c: &mut Client, lba: u64, data: Bytes) -> Itt {
    let (itt, sn) = send_write(c, lba, data.len() as u32, data).await;
    wait_stuck(&rig.ctl, 1).await;
    let code = tokio::time::timeout(WAIT, c.task_mgmt(TmfFunction::ABORT_TASK, 0, itt, sn))
        .await
        .expect("ABORT TASK waited for the stuck device")
        .unwrap();
    assert_eq!(code, TmfResponseCode::COMPLETE);
    assert_eq!(rig.ctl.stuck_now(), 1, "the write is still in the device");
    itt
}

/// RAM under the fault layer at `lba`, `blocks` long.
async fn medium(rig: &Rig, lba: u64, blocks: u32) -> Bytes {
    rig.inner
        .read(lba * u64::from(BS), (blocks * BS) as usize)
        .await
        .unwrap()
}

#[tokio::test]
async fn aborted_write_in_the_device_cannot_overwrite_a_newer_acknowledged_write() {
    let rig = start(&["write@0-7/count=1:hang"]).await;
    let mut c = login_with(rig.addr, &opts(1)).await;
    let old = pattern(4096, 1);
    let new = pattern(4096, 2);
    // ABORT TASK completes at once although the device holds the I/O, which cannot be called
    // back: it is still in the device.
    let itt = abort_write_stuck_in_device(&rig, &mut c, 0, old.clone()).await;
    // A newer write of the same blocks waits for it (the range stays locked) ...
    let (itt2, _) = send_write(&mut c, 0, 4096, new.clone()).await;
    // ... while other blocks are written and read as usual.
    assert_eq!(write(&mut c, 64, pattern(4096, 3)).await.status, 0);
    let early = drain(&mut c, Duration::from_millis(300)).await;
    let mut seen = completions(&early);
    seen.extend(completions(&c.unsolicited));
    assert!(
        !seen.iter().any(|(i, _)| *i == itt2),
        "newer write acknowledged while the aborted one was still in the device"
    );
    assert!(medium(&rig, 0, 8).await.iter().all(|&b| b == 0));
    // The device finishes the aborted write; then the newer one runs and is acknowledged.
    rig.ctl.release();
    let (status, others) = wait_status(&mut c, itt2).await;
    assert_eq!(status, 0);
    let mut all = completions(&others);
    all.extend(completions(&c.unsolicited));
    all.extend(completions(&early));
    assert!(
        !all.iter().any(|(i, _)| *i == itt),
        "aborted task answered: {all:?}"
    );
    // Newest acknowledged data wins, through iSCSI and on the medium.
    assert_eq!(
        read(&mut c, 0, 8).await.data,
        new,
        "aborted write landed last"
    );
    assert_eq!(medium(&rig, 0, 8).await, new);
    assert_eq!(read(&mut c, 64, 8).await.data, pattern(4096, 3));
    assert_eq!(rig.ctl.stuck_now(), 0);
}

/// Send a READ(16) of `blocks` blocks without waiting; returns its ITT.
async fn send_read(c: &mut Client, lba: u64, blocks: u32) -> Itt {
    c.send_read16(0, lba, blocks, BS).await.unwrap().0
}

/// The Data-In of `itt` in `pdus` (in order of arrival) and its status, if it completed.
fn read_result(pdus: &[Pdu], itt: Itt) -> (Option<u8>, Vec<u8>) {
    let mut data = Vec::new();
    let mut status = None;
    for p in pdus {
        match &p.header {
            Header::DataIn(d) if d.itt == itt => {
                data.extend_from_slice(&p.data);
                status = status.or(d.status);
            }
            Header::ScsiResponse(r) if r.itt == itt => status = Some(r.status),
            _ => {}
        }
    }
    (status, data)
}

/// A READ issued after the ABORT TASK response, of blocks an aborted write still holds in the
/// device (an orphaned write), waits until the device finishes it and returns what is there
/// for good: two successive reads agree. Before the fix it returned the old data at once and a
/// later read the aborted data (the write landed after).
#[tokio::test]
async fn read_after_abort_waits_for_the_orphaned_write_so_successive_reads_agree() {
    let rig = start(&["write@0-7/count=1:hang"]).await;
    let mut c = login_with(rig.addr, &opts(2)).await;
    let aborted = pattern(4096, 31);
    assert_eq!(write(&mut c, 64, pattern(4096, 32)).await.status, 0);
    abort_write_stuck_in_device(&rig, &mut c, 0, aborted.clone()).await;
    // A read of the orphaned blocks, issued after the TMF response, waits ...
    let r1 = send_read(&mut c, 0, 8).await;
    // ... while reads of other blocks go on.
    assert_eq!(read(&mut c, 64, 8).await.data, pattern(4096, 32));
    let mut seen = std::mem::take(&mut c.unsolicited);
    seen.extend(drain(&mut c, Duration::from_millis(300)).await);
    assert_eq!(
        read_result(&seen, r1).0,
        None,
        "read answered while the aborted write was still in the device"
    );
    assert!(medium(&rig, 0, 8).await.iter().all(|&b| b == 0));
    // The device finishes the aborted write; the waiting read returns its data ...
    rig.ctl.release();
    let (status, first) = loop {
        let p = tokio::time::timeout(WAIT, c.recv())
            .await
            .expect("the read never completed")
            .unwrap();
        seen.push(p);
        if let (Some(s), data) = read_result(&seen, r1) {
            break (s, data);
        }
    };
    assert_eq!(status, 0);
    assert_eq!(first, aborted, "the waiting read returned the old data");
    // ... and a later read agrees.
    let r2 = read(&mut c, 0, 8).await;
    assert_eq!(r2.status, 0);
    assert_eq!(r2.data, first, "two successive reads disagree");
    assert_eq!(medium(&rig, 0, 8).await, aborted);
    assert_eq!(rig.ctl.stuck_now(), 0);
}

/// Start the broken write on `c`: WRITE(16) of 64 blocks with no immediate data (InitialR2T=Yes,
/// so nothing unsolicited either), answer the
/// first R2T in full and send the first half of the second one (not final). Returns with R2Ts
/// outstanding and the write incomplete.
async fn half_send_write(c: &mut Client, lba: u64, data: &Bytes) -> Itt {
    let (itt, _) = send_write(c, lba, data.len() as u32, Bytes::new()).await;
    let mut r2ts: Vec<R2t> = Vec::new();
    let mut sent_full = false;
    loop {
        let p = tokio::time::timeout(WAIT, c.recv())
            .await
            .expect("no R2T")
            .unwrap();
        match p.header {
            Header::R2t(r) if r.itt == itt => r2ts.push(r),
            other => panic!("unexpected {other:?}"),
        }
        if !sent_full {
            // The first R2T: all of its data, final.
            let r = r2ts[0].clone();
            assert_eq!(r.buffer_offset, 0);
            let end = (r.buffer_offset + r.desired_data_transfer_length) as usize;
            let d = DataOut {
                final_bit: true,
                lun: Lun::from_number(0),
                itt,
                ttt: r.ttt,
                exp_stat_sn: c.exp_stat_sn,
                data_sn: DataSn(0),
                buffer_offset: 0,
            };
            c.send(Header::DataOut(d), data.slice(0..end))
                .await
                .unwrap();
            sent_full = true;
        }
        if let Some(r) = r2ts.iter().find(|r| r.buffer_offset > 0).cloned() {
            // A later R2T: half of its data, whole blocks, not final.
            let half = (r.desired_data_transfer_length / 2) / BS * BS;
            let start = r.buffer_offset as usize;
            let d = DataOut {
                final_bit: false,
                lun: Lun::from_number(0),
                itt,
                ttt: r.ttt,
                exp_stat_sn: c.exp_stat_sn,
                data_sn: DataSn(0),
                buffer_offset: r.buffer_offset,
            };
            c.send(Header::DataOut(d), data.slice(start..start + half as usize))
                .await
                .unwrap();
            // Let the target take the data in before the connection breaks.
            tokio::time::sleep(Duration::from_millis(50)).await;
            return itt;
        }
    }
}

async fn tcp_reset_mid_write(reinstate_first: bool) {
    let rig = start(&["write@1000-1007:stuck", "write@2000-2007/count=1:hang"]).await;
    let mut o = opts(7);
    o.initial_r2t = true;
    o.immediate_data = true;
    o.first_burst_length = 8192;
    o.max_burst_length = 8192;
    o.max_outstanding_r2t = 2;
    let mut old = login_with(rig.addr, &o).await;
    let old_tsih = old.tsih;
    // Old task 1: stuck before the device (cancellable). Old task 2: in the device.
    let (t1, _) = send_write(&mut old, 1000, 4096, pattern(4096, 11)).await;
    let (t2, _) = send_write(&mut old, 2000, 4096, pattern(4096, 12)).await;
    wait_stuck(&rig.ctl, 2).await;
    // Old task 3: the broken write, 64 blocks at LBA 0, 8 KiB + 2 KiB of its 32 KiB sent.
    let broken = pattern(64 * BS as usize, 13);
    let t3 = half_send_write(&mut old, 0, &broken).await;

    // The same initiator name and ISID, TSIH 0: a reinstatement.
    let o2 = opts(7);
    let (mut new, old_pdus) = if reinstate_first {
        // Reinstatement while the old connection is still up, then the reset.
        let new = login_with(rig.addr, &o2).await;
        let mut old = old;
        let late = drain(&mut old, Duration::from_millis(200)).await;
        old.reset().unwrap();
        (new, late)
    } else {
        // The reset first; the target may or may not have seen it when the new login comes.
        old.reset().unwrap();
        (login_with(rig.addr, &o2).await, Vec::new())
    };
    assert_ne!(new.tsih.0, 0);
    assert_ne!(new.tsih, old_tsih, "a reinstated session gets a new TSIH");
    // No old task was answered on the old connection (it would be on nothing else).
    let answered = completions(&old_pdus);
    for t in [t1, t2, t3] {
        assert!(
            !answered.iter().any(|(i, _)| *i == t),
            "old task {t:?} answered: {answered:?}"
        );
    }
    // The stuck (cancellable) task was dropped; the one in the device is still there.
    wait_stuck(&rig.ctl, 1).await;
    // None of the broken write's blocks changed: not the 16 blocks of the full R2T, not the 4
    // of the half-sent one, nothing else.
    assert!(
        medium(&rig, 0, 64).await.iter().all(|&b| b == 0),
        "the broken write was applied"
    );
    assert!(medium(&rig, 1000, 8).await.iter().all(|&b| b == 0));
    // The new session works on the blocks of the broken write.
    let d = pattern(64 * BS as usize, 21);
    assert_eq!(write(&mut new, 0, d.clone()).await.status, 0);
    assert_eq!(read(&mut new, 0, 64).await.data, d);
    // The old write still in the device may land (it was in flight), but before the new
    // session's write of its blocks, which waits for it and then stays.
    let d2000 = pattern(4096, 23);
    let (itt, _) = send_write(&mut new, 2000, 4096, d2000.clone()).await;
    let early = drain(&mut new, Duration::from_millis(200)).await;
    assert!(
        !completions(&early).iter().any(|(i, _)| *i == itt),
        "new write acknowledged before the old one in the device finished: {early:?}"
    );
    rig.ctl.set_enabled(false); // releases the device
    assert_eq!(wait_status(&mut new, itt).await.0, 0);
    assert_eq!(read(&mut new, 2000, 8).await.data, d2000);
    assert_eq!(medium(&rig, 2000, 8).await, d2000);
    assert_eq!(rig.ctl.stuck_now(), 0);
    // ... and on the blocks of the dropped stuck task.
    let d = pattern(4096, 22);
    assert_eq!(write(&mut new, 1000, d.clone()).await.status, 0);
    assert_eq!(read(&mut new, 1000, 8).await.data, d);
    // Nothing of the old session reached the new connection.
    let late = drain(&mut new, Duration::from_millis(100)).await;
    let mut seen = completions(&late);
    seen.extend(completions(&new.unsolicited));
    for t in [t1, t2, t3] {
        assert!(!seen.iter().any(|(i, _)| *i == t));
    }
}

#[tokio::test]
async fn tcp_reset_mid_write_then_reinstatement_applies_nothing_of_the_broken_write() {
    tcp_reset_mid_write(false).await;
}

#[tokio::test]
async fn reinstatement_then_tcp_reset_mid_write_applies_nothing_of_the_broken_write() {
    tcp_reset_mid_write(true).await;
}

/// What one 8-block write may have left at its LBA.
struct Expect {
    lba: u64,
    /// Data of the newest acknowledged write of these blocks (zeros if none).
    old: Bytes,
    /// An unacknowledged write of these blocks, if any: each block is `old` or this.
    new: Option<Bytes>,
}

/// Check `got` (what was read at `e.lba`) against `e`, block by block; returns how many
/// blocks hold the unacknowledged write's data.
fn check_expect(e: &Expect, got: &[u8]) -> usize {
    assert_eq!(got.len(), e.old.len(), "read of LBA {}", e.lba);
    let bs = BS as usize;
    let mut landed = 0;
    for b in 0..got.len() / bs {
        let r = b * bs..(b + 1) * bs;
        if got[r.clone()] == e.old[r.clone()] {
            continue;
        }
        match &e.new {
            Some(n) if got[r.clone()] == n[r] => landed += 1,
            Some(_) => panic!(
                "LBA {}: neither the acknowledged nor the unacknowledged write's data",
                e.lba + b as u64
            ),
            None => panic!("LBA {}: an acknowledged write is missing", e.lba + b as u64),
        }
    }
    landed
}

/// issue 6, "an initiator that stops answering NOP-In", with the integrity promises: a session
/// writes acknowledged data, then sends more writes and stops reading its socket and answering
/// the target's NOP-In. Of those writes some complete (their GOOD waits unread in the socket),
/// some are held before the device (a `delay`, a `stuck`) and some are in the device (`hang`).
/// The target drops the connection after its NOP-In timeout (short here); a new session with
/// the same initiator name and ISID reads back: every acknowledged write is there, every
/// unacknowledged one is all old or all new per block, the ones held before the device never
/// land, and the ones in the device are orphans: reads of them wait until they finished and
/// then see all of them.
#[tokio::test]
async fn silent_initiator_is_dropped_by_nop_timeout_and_acknowledged_writes_survive() {
    let rig = start_cfg(
        &[
            "write@8-15:delay=5s",
            "write@256-287:delay=5s",
            "write@288-303:hang",
            "write@1000-1007:stuck",
            "write@2000-2007:hang",
        ],
        |c| {
            c.limits.nop_interval = Duration::from_millis(200);
            c.limits.nop_timeout = Duration::from_millis(300);
        },
    )
    .await;
    let t0 = std::time::Instant::now();
    rig.ctl.set_enabled(false);
    let mut a = login_with(rig.addr, &opts(9)).await;
    let zeros = Bytes::from(vec![0u8; 4096]);
    // Acknowledged: 16 writes, the first four 8-block groups overwritten once more.
    let mut expect: Vec<Expect> = Vec::new();
    for i in 0..16u8 {
        let d = pattern(4096, 100 + i);
        assert_eq!(write(&mut a, u64::from(i) * 8, d.clone()).await.status, 0);
        expect.push(Expect {
            lba: u64::from(i) * 8,
            old: d,
            new: None,
        });
    }
    for i in 0..4u8 {
        let d = pattern(4096, 200 + i);
        assert_eq!(write(&mut a, u64::from(i) * 8, d.clone()).await.status, 0);
        expect[usize::from(i)].old = d;
    }
    // Unacknowledged: sent, never read. An overwrite of acknowledged blocks and four new
    // writes held before the device (delay), two in the device (hang), two that complete,
    // one stuck before the device at 1000 and one in the device at 2000.
    rig.ctl.set_enabled(true);
    let mut unacked: Vec<(Itt, usize)> = Vec::new();
    let d = pattern(4096, 250);
    let (itt, _) = send_write(&mut a, 8, 4096, d.clone()).await;
    expect[1].new = Some(d);
    unacked.push((itt, 1));
    for lba in [256, 264, 272, 280, 288, 296, 304, 312, 2000] {
        let d = pattern(4096, (lba / 8) as u8);
        let (itt, _) = send_write(&mut a, lba, 4096, d.clone()).await;
        expect.push(Expect {
            lba,
            old: zeros.clone(),
            new: Some(d),
        });
        unacked.push((itt, expect.len() - 1));
    }
    let (stuck, _) = send_write(&mut a, 1000, 4096, pattern(4096, 251)).await;
    wait_stuck(&rig.ctl, 4).await;
    // Silence: no reads of the socket, no NOP-Out. Past the interval and the timeout (and a
    // margin) the target must have pinged and given up.
    tokio::time::sleep(Duration::from_millis(200 + 300 + 700)).await;
    let mut pdus = std::mem::take(&mut a.unsolicited);
    let closed = loop {
        match tokio::time::timeout(WAIT, a.recv()).await {
            Ok(Ok(p)) => pdus.push(p),
            Ok(Err(_)) => break true,
            Err(_) => break false,
        }
    };
    assert!(closed, "the target kept a silent initiator's connection");
    assert!(
        pdus.iter()
            .any(|p| matches!(&p.header, Header::NopIn(n) if n.itt == Itt::RESERVED)),
        "no NOP-In ping before the close"
    );
    // A write whose GOOD reached the socket counts as acknowledged; only the two writes
    // outside every fault rule can have one.
    let answered = completions(&pdus);
    assert!(!answered.iter().any(|(i, _)| *i == stuck));
    let mut acked_late = Vec::new();
    for (itt, e) in &unacked {
        if answered.iter().any(|(i, s)| i == itt && *s == 0) {
            let e = &mut expect[*e];
            e.old = e.new.take().unwrap();
            acked_late.push(e.lba);
        }
    }
    assert_eq!(acked_late, [304, 312], "answered: {answered:?}");
    // The delayed and stuck tasks were dropped with the connection; the three writes in the
    // device are still there.
    wait_stuck(&rig.ctl, 3).await;

    // The same initiator name and ISID, TSIH 0: a new session of the same I_T nexus.
    let mut b = login_with(rig.addr, &opts(9)).await;
    let in_device = [288u64, 296, 2000];
    let mut landed = 0;
    let mut checked = 0;
    for e in expect.iter().filter(|e| !in_device.contains(&e.lba)) {
        let got = read(&mut b, e.lba, 8).await;
        assert_eq!(got.status, 0);
        landed += check_expect(e, &got.data);
        checked += 8;
        if (256..288).contains(&e.lba) || e.lba == 8 {
            assert_eq!(got.data, e.old, "LBA {}: a dropped write landed", e.lba);
        }
    }
    assert!(
        read(&mut b, 1000, 8).await.data.iter().all(|&x| x == 0),
        "the write stuck before the device landed"
    );
    // The writes still in the device: reads of them wait until the device finished, then
    // see all of each (handed to the device whole).
    let reads: Vec<Itt> = {
        let mut v = Vec::new();
        for lba in in_device {
            v.push(send_read(&mut b, lba, 8).await);
        }
        v
    };
    let mut seen = std::mem::take(&mut b.unsolicited);
    seen.extend(drain(&mut b, Duration::from_millis(200)).await);
    for r in &reads {
        assert_eq!(
            read_result(&seen, *r).0,
            None,
            "read of an orphaned write answered before the device finished"
        );
    }
    rig.ctl.set_enabled(false);
    while !reads.iter().all(|r| read_result(&seen, *r).0.is_some()) {
        let p = tokio::time::timeout(WAIT, b.recv())
            .await
            .expect("read never completed")
            .unwrap();
        seen.push(p);
    }
    for (lba, r) in in_device.iter().zip(&reads) {
        let (status, got) = read_result(&seen, *r);
        assert_eq!(status, Some(0));
        let e = expect.iter().find(|e| e.lba == *lba).unwrap();
        landed += check_expect(e, &got);
        checked += 8;
        assert_eq!(Some(&Bytes::from(got)), e.new.as_ref(), "LBA {lba}");
        // ... and a later read agrees.
        assert_eq!(read(&mut b, *lba, 8).await.data, e.new.clone().unwrap());
    }
    assert_eq!(rig.ctl.stuck_now(), 0);
    let elapsed = t0.elapsed();
    eprintln!(
        "silent initiator: 20 acknowledged writes, {} acknowledged but unread, {} blocks \
         checked, {landed} blocks of unacknowledged writes landed (whole writes), 0 torn; \
         {elapsed:?}",
        acked_late.len(),
        checked
    );
    // No bound on the whole: every step above waits at most WAIT for its event, so a hang
    // fails there, naming the step.
}

/// Log in (ISID ending in `isid`, InitialR2T=Yes, no immediate data) and send an 8 KiB
/// WRITE(16) at `lba`; returns the connection, the write's ITT and the R2T it waits on.
async fn write_awaiting_data(addr: SocketAddr, isid: u8, lba: u64) -> (Client, Itt, R2t) {
    let mut o = opts(isid);
    o.initial_r2t = true;
    o.immediate_data = false;
    let mut c = login_with(addr, &o).await;
    let (itt, _) = send_write(&mut c, lba, 8192, Bytes::new()).await;
    loop {
        let p = tokio::time::timeout(WAIT, c.recv())
            .await
            .expect("no R2T")
            .unwrap();
        if let Header::R2t(r) = p.header {
            assert_eq!((r.itt, r.buffer_offset), (itt, 0));
            return (c, itt, r);
        }
    }
}

/// Session reinstatement while the old connection is in the middle of a Data-Out PDU (its
/// header and half of its data received): the old session's write is gone with it. When the
/// rest of that PDU arrives on the old connection afterwards (a late retransmission from an
/// initiator that gave the old path up), none of it lands: the new session's acknowledged
/// write of the same blocks stays.
#[tokio::test]
async fn reinstatement_mid_data_out_pdu_lets_nothing_of_the_old_write_land_later() {
    let rig = start(&[]).await;
    let (mut old, itt, r2t) = write_awaiting_data(rig.addr, 11, 100).await;
    let old_data = pattern(8192, 31);
    assert_eq!(
        (r2t.itt, r2t.buffer_offset, r2t.desired_data_transfer_length),
        (itt, 0, 8192)
    );
    let d = DataOut {
        final_bit: true,
        lun: Lun::from_number(0),
        itt,
        ttt: r2t.ttt,
        exp_stat_sn: old.exp_stat_sn,
        data_sn: DataSn(0),
        buffer_offset: 0,
    };
    let pdu = Pdu::new(Header::DataOut(d), old_data.clone());
    let mut wire = pdu.bhs().0.to_vec();
    wire.extend_from_slice(&old_data);
    old.send_bytes(&wire[..48 + 4096]).await.unwrap();
    // Let the target's reader take the header and the first half in.
    tokio::time::sleep(Duration::from_millis(100)).await;

    let mut new = login_with(rig.addr, &opts(11)).await;
    let new_data = pattern(8192, 32);
    assert_eq!(write(&mut new, 100, new_data.clone()).await.status, 0);
    // The rest of the old PDU arrives late; the old connection may be closed already.
    let _ = old.send_bytes(&wire[48 + 4096..]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        read(&mut new, 100, 16).await.data == new_data && medium(&rig, 100, 16).await == new_data,
        "the old session's write landed after the new session's acknowledged one"
    );
}

/// LOGICAL UNIT RESET, CLEAR TASK SET and TARGET WARM RESET from another initiator abort
/// every task on the LU (SAM), writes still waiting for their Data-Out included: data that comes for such a write
/// afterwards completes nothing, so the other initiator's write acknowledged after the reset
/// stays. The initiator whose write was aborted gets no status for it (TAS=0) and learns of it
/// from a unit attention on its next command, even though its only command had not reached
/// the LU yet.
#[tokio::test]
async fn a_reset_by_another_initiator_aborts_a_write_still_waiting_for_data() {
    for (n, function) in [
        TmfFunction::LOGICAL_UNIT_RESET,
        TmfFunction::CLEAR_TASK_SET,
        TmfFunction::TARGET_WARM_RESET,
    ]
    .into_iter()
    .enumerate()
    {
        let rig = start(&[]).await;
        let (mut a, itt, r2t) = write_awaiting_data(rig.addr, 12, 300).await;
        let mut b = login_with(rig.addr, &opts(13)).await;
        let code = b
            .task_mgmt(function, 0, Itt::RESERVED, b.cmd_sn)
            .await
            .unwrap();
        assert_eq!(code, TmfResponseCode::COMPLETE, "case {n}");
        let new_data = pattern(8192, 42);
        let mut w = write(&mut b, 300, new_data.clone()).await;
        if w.status == 2 {
            w = write(&mut b, 300, new_data.clone()).await;
        }
        assert_eq!(w.status, 0, "case {n}: sense {:?}", w.sense_key());
        // A's data for its write, sent after the reset.
        let d = DataOut {
            final_bit: true,
            lun: Lun::from_number(0),
            itt,
            ttt: r2t.ttt,
            exp_stat_sn: a.exp_stat_sn,
            data_sn: DataSn(0),
            buffer_offset: 0,
        };
        let _ = a.send(Header::DataOut(d), pattern(8192, 41)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            medium(&rig, 300, 16).await == new_data,
            "case {n}: a write aborted by the reset landed over one acknowledged after it"
        );
        // A got no status for its write (TAS=0); its next command learns why (SAM-5).
        let r = read(&mut a, 300, 16).await;
        let asc = if function == TmfFunction::CLEAR_TASK_SET {
            (0x06, 0x2F, 0x00) // COMMANDS CLEARED BY ANOTHER INITIATOR
        } else {
            (0x06, 0x29, 0x00) // POWER ON, RESET, OR BUS DEVICE RESET OCCURRED
        };
        assert_eq!((r.status, r.sense_key()), (2, Some(asc)), "case {n}");
        let r = read(&mut a, 300, 16).await;
        assert!(
            r.status == 0 && r.data == new_data,
            "case {n}: {:?}",
            r.sense_key()
        );
    }
}
