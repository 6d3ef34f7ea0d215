//! Backend faults seen through iSCSI: an in-process server whose LUN 0 is a
//! [`FaultBackend`] over RAM (or a file) and LUN 1 a plain RAM disk, driven by
//! `ironsan-initiator`. Under faults: no hang, no crash, the right sense (MEDIUM ERROR with the
//! failing LBA in INFORMATION, SPACE ALLOCATION FAILED, ...), the other LUN unaffected, and
//! ABORT TASK / LUN RESET complete while the backend I/O is stuck, without a double completion.

use crate::support;
use bytes::Bytes;
use ironsan_backend::{BlockDevice, FaultControl, RamBackend};
use ironsan_initiator::{Client, CommandResult, LoginOptions};
use ironsan_proto::pdu::*;
use ironsan_proto::CmdSn;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use support::drain;

const TARGET: &str = "iqn.2026-11.org.ironsan:faults";
const BS: u32 = 512;
const WAIT: Duration = Duration::from_secs(10);

type Rig = support::FaultRig;

/// LUN 0: `rules` over `inner`; LUN 1: a plain RAM disk.
async fn start_on(inner: Arc<dyn BlockDevice>, rules: &[&str], seed: u64) -> Rig {
    let plain: Arc<dyn BlockDevice> = Arc::new(RamBackend::new(16 << 20));
    let naa = 0x3000_0000_0000_0010;
    support::fault_rig(TARGET, inner, rules, seed, vec![plain], naa, |_| {}).await
}

async fn start(rules: &[&str]) -> Rig {
    start_on(Arc::new(RamBackend::new(16 << 20)), rules, 1).await
}

async fn login(addr: SocketAddr, isid_last: u8) -> Client {
    let mut o = LoginOptions::new(Some(TARGET));
    o.isid.0[5] = isid_last;
    tokio::time::timeout(WAIT, Client::login(addr, &o))
        .await
        .expect("login hung")
        .unwrap()
}

/// Fixed-format INFORMATION (bytes 3..7) when VALID is set.
fn information(r: &CommandResult) -> Option<u32> {
    let s = &r.sense;
    (s.len() >= 7 && s[0] & 0x80 != 0).then(|| u32::from_be_bytes([s[3], s[4], s[5], s[6]]))
}

fn pattern(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect::<Vec<u8>>(),
    )
}

async fn write(c: &mut Client, lun: u64, lba: u64, data: Bytes) -> CommandResult {
    tokio::time::timeout(WAIT, c.write16(lun, lba, data, BS, false))
        .await
        .expect("write hung")
        .unwrap()
}

async fn read(c: &mut Client, lun: u64, lba: u64, blocks: u32) -> CommandResult {
    tokio::time::timeout(WAIT, c.read16(lun, lba, blocks, BS))
        .await
        .expect("read hung")
        .unwrap()
}

/// Send a WRITE(16) with all its data immediate, without waiting; returns its ITT and CmdSN.
async fn send_write(c: &mut Client, lun: u64, lba: u64, data: Bytes) -> (Itt, CmdSn) {
    let len = data.len() as u32;
    c.send_write16(lun, lba, len, BS, data).await.unwrap()
}

/// Send a READ(16) without waiting.
async fn send_read(c: &mut Client, lun: u64, lba: u64, blocks: u32) -> (Itt, CmdSn) {
    c.send_read16(lun, lba, blocks, BS).await.unwrap()
}

async fn wait_stuck(ctl: &FaultControl, n: usize) {
    support::wait_stuck_until(
        ctl,
        |s| s >= n,
        &format!("waiting for {n} I/Os to get stuck"),
    )
    .await;
}

/// Wait until no I/O is stuck in the device any more. An abort or reset only cancels the
/// task; the stuck I/O is dropped when the cancelled task is next polled, which can be just
/// after the TMF response went out.
async fn wait_unstuck(ctl: &FaultControl, what: &str) {
    support::wait_stuck_until(ctl, |s| s == 0, what).await;
}

/// ITTs of every final status seen in `pdus` (SCSI Response, or Data-In with status).
fn completions(pdus: &[Pdu]) -> Vec<Itt> {
    support::completions(pdus)
        .into_iter()
        .map(|(i, _)| i)
        .collect()
}

#[tokio::test]
async fn medium_errors_carry_the_failing_lba_and_nothing_is_written() {
    let rig = start(&[
        "read@1000-1010:eio",
        "write@2000-2003:eio",
        "write@3000-3000:enospc",
        "flush@*/count=1:error",
    ])
    .await;
    let mut c = login(rig.addr, 1).await;
    // READ of 992..1000 is clean; 996..1004 overlaps 1000..=1010 → 11h/00h at LBA 1000.
    assert_eq!(read(&mut c, 0, 992, 8).await.status, 0);
    let r = read(&mut c, 0, 996, 8).await;
    assert_eq!(r.status, 2);
    assert_eq!(r.sense_key(), Some((0x03, 0x11, 0x00)), "{:?}", r.sense);
    assert_eq!(information(&r), Some(1000));
    // Starting inside the range: the first LBA of the request.
    let r = read(&mut c, 0, 1005, 1).await;
    assert_eq!(information(&r), Some(1005));
    // WRITE across 2000..=2003: 0Ch/00h at LBA 2000, and not a byte written.
    let r = write(&mut c, 0, 1998, pattern(8 * 512, 3)).await;
    assert_eq!(r.status, 2);
    assert_eq!(r.sense_key(), Some((0x03, 0x0C, 0x00)), "{:?}", r.sense);
    assert_eq!(information(&r), Some(2000));
    let back = rig.inner.read(1998 * 512, 8 * 512).await.unwrap();
    assert!(back.iter().all(|&b| b == 0), "a failed write left data");
    // ENOSPC → DATA PROTECT, SPACE ALLOCATION FAILED WRITE PROTECT (27h/07h).
    let r = write(&mut c, 0, 3000, pattern(512, 4)).await;
    assert_eq!(r.sense_key(), Some((0x07, 0x27, 0x07)), "{:?}", r.sense);
    // A failing flush: SYNCHRONIZE CACHE gets HARDWARE ERROR, INTERNAL TARGET FAILURE;
    // the next one (count=1 spent) is GOOD.
    let sync = [0x35u8, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    let r = c.command(0, &sync, None, 0).await.unwrap();
    assert_eq!(r.sense_key(), Some((0x04, 0x44, 0x00)), "{:?}", r.sense);
    assert_eq!(c.command(0, &sync, None, 0).await.unwrap().status, 0);
    // Everything else on LUN 0 and all of LUN 1 work on the same session.
    let d = pattern(4096, 9);
    assert_eq!(write(&mut c, 0, 0, d.clone()).await.status, 0);
    assert_eq!(read(&mut c, 0, 0, 8).await.data, d);
    assert_eq!(write(&mut c, 1, 1000, d.clone()).await.status, 0);
    assert_eq!(read(&mut c, 1, 1000, 8).await.data, d);
    assert_eq!(rig.ctl.injected(), 5);
}

#[tokio::test]
async fn random_faults_and_delays_never_hang_and_never_touch_the_other_lun() {
    let rig = start(&["rw@rate=0.2:eio", "any@rate=0.1:delay=20ms"]).await;
    let addr = rig.addr;
    // LUN 1 traffic on its own session alongside.
    let other = tokio::spawn(async move {
        let mut c = login(addr, 2).await;
        for i in 0..100u64 {
            let d = pattern(4096, i as u8);
            let w = write(&mut c, 1, i * 8, d.clone()).await;
            assert_eq!(w.status, 0, "LUN 1 write failed: {:?}", w.sense_key());
            assert_eq!(read(&mut c, 1, i * 8, 8).await.data, d);
        }
    });
    let mut c = login(addr, 1).await;
    let (mut good, mut failed) = (0, 0);
    // What each block holds: a failed write leaves the previous content.
    let mut model = [None::<u8>; 64];
    for i in 0..300u64 {
        let blk = (i * 7) % 64;
        if i % 2 == 0 {
            let seed = i as u8;
            let r = write(&mut c, 0, blk * 8, pattern(4096, seed)).await;
            match r.status {
                0 => {
                    good += 1;
                    model[blk as usize] = Some(seed);
                }
                2 => {
                    failed += 1;
                    assert_eq!(r.sense_key(), Some((0x03, 0x0C, 0x00)));
                    assert_eq!(information(&r), Some((blk * 8) as u32));
                }
                s => panic!("status {s:#x}"),
            }
        } else {
            let r = read(&mut c, 0, blk * 8, 8).await;
            match r.status {
                0 => {
                    good += 1;
                    let want = model[blk as usize].map(|s| pattern(4096, s));
                    match want {
                        Some(w) => assert!(r.data == w, "block {blk} holds other data"),
                        None => assert!(r.data.iter().all(|&b| b == 0)),
                    }
                }
                2 => {
                    failed += 1;
                    assert_eq!(r.sense_key(), Some((0x03, 0x11, 0x00)));
                }
                s => panic!("status {s:#x}"),
            }
        }
    }
    other.await.unwrap();
    assert!(failed > 20 && good > 150, "good {good}, failed {failed}");
    eprintln!(
        "random faults: {good} good, {failed} failed, {} injected",
        rig.ctl.injected()
    );
}

#[tokio::test]
async fn abort_task_completes_while_the_backend_write_is_stuck() {
    let rig = start(&["rw@4096-8191:stuck"]).await;
    let mut c = login(rig.addr, 1).await;
    let (itt, sn) = send_write(&mut c, 0, 4096, pattern(4096, 1)).await;
    wait_stuck(&rig.ctl, 1).await;
    let code = tokio::time::timeout(WAIT, c.task_mgmt(TmfFunction::ABORT_TASK, 0, itt, sn))
        .await
        .expect("ABORT TASK hung behind stuck I/O")
        .unwrap();
    assert_eq!(code, TmfResponseCode::COMPLETE);
    // The stuck I/O was dropped with the task (before the device is released below).
    wait_unstuck(&rig.ctl, "ABORT TASK").await;
    // Releasing the device produces no late response and writes nothing.
    rig.ctl.release();
    let late = drain(&mut c, Duration::from_millis(300)).await;
    let mut all = std::mem::take(&mut c.unsolicited);
    all.extend(late);
    assert!(
        !completions(&all).contains(&itt),
        "aborted task answered: {all:?}"
    );
    let back = rig.inner.read(4096 * 512, 4096).await.unwrap();
    assert!(back.iter().all(|&b| b == 0), "aborted write landed");
    // The session goes on (and a read of the stuck range, released, works).
    assert_eq!(read(&mut c, 0, 0, 8).await.status, 0);
    // A stuck READ aborted the same way.
    let (itt, sn) = send_read(&mut c, 0, 5000, 8).await;
    wait_stuck(&rig.ctl, 1).await;
    let code = c
        .task_mgmt(TmfFunction::ABORT_TASK, 0, itt, sn)
        .await
        .unwrap();
    assert_eq!(code, TmfResponseCode::COMPLETE);
    rig.ctl.set_enabled(false);
    let late = drain(&mut c, Duration::from_millis(300)).await;
    assert!(!completions(&late).contains(&itt));
    assert!(!completions(&c.unsolicited).contains(&itt));
    assert_eq!(read(&mut c, 0, 5000, 8).await.status, 0);
}

#[tokio::test]
async fn lun_reset_from_another_session_clears_stuck_io_and_other_luns_run_on() {
    let rig = start(&["write@*:stuck"]).await;
    let mut a = login(rig.addr, 1).await;
    let mut b = login(rig.addr, 2).await;
    let mut itts = Vec::new();
    for i in 0..4u64 {
        itts.push(send_write(&mut a, 0, i * 8, pattern(4096, i as u8)).await.0);
    }
    wait_stuck(&rig.ctl, 4).await;
    // Session B: LUN 1 is not affected by LUN 0's hung device.
    let d = pattern(4096, 77);
    assert_eq!(write(&mut b, 1, 0, d.clone()).await.status, 0);
    assert_eq!(read(&mut b, 1, 0, 8).await.data, d);
    let code = tokio::time::timeout(
        WAIT,
        b.task_mgmt(TmfFunction::LOGICAL_UNIT_RESET, 0, Itt::RESERVED, CmdSn(0)),
    )
    .await
    .expect("LUN RESET hung behind stuck I/O")
    .unwrap();
    assert_eq!(code, TmfResponseCode::COMPLETE);
    wait_unstuck(&rig.ctl, "stuck I/O outlived the LUN reset").await;
    rig.ctl.set_enabled(false);
    let late = drain(&mut a, Duration::from_millis(300)).await;
    for itt in &itts {
        assert!(!completions(&late).contains(itt), "reset task answered");
    }
    let back = rig.inner.read(0, 4 * 4096).await.unwrap();
    assert!(back.iter().all(|&x| x == 0), "reset writes landed");
    // Session A sees the reset (29h) once, then works.
    let r = read(&mut a, 0, 0, 8).await;
    assert_eq!(r.sense_key().map(|k| (k.0, k.1)), Some((0x06, 0x29)));
    assert_eq!(read(&mut a, 0, 0, 8).await.status, 0);
}

/// Release and ABORT TASK race: the task completes exactly once, either by its response (and
/// the abort finds no task) or by the abort (and no response comes).
#[tokio::test]
async fn release_racing_abort_completes_each_task_exactly_once() {
    let rig = start(&["write@*:stuck"]).await;
    let mut c = login(rig.addr, 1).await;
    let (mut by_response, mut by_abort) = (0, 0);
    for i in 0..40u64 {
        let (itt, sn) = send_write(&mut c, 0, i * 8, pattern(4096, i as u8)).await;
        wait_stuck(&rig.ctl, 1).await;
        let ctl = Arc::clone(&rig.ctl);
        // Every third round releases before the abort is even sent; the others race it.
        if i % 3 == 0 {
            ctl.release();
        }
        let delay = Duration::from_micros((i % 8) * 100);
        let releaser = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            ctl.release();
        });
        let code = c
            .task_mgmt(TmfFunction::ABORT_TASK, 0, itt, sn)
            .await
            .unwrap();
        releaser.await.unwrap();
        let mut seen: Vec<Itt> = completions(&c.unsolicited);
        c.unsolicited.clear();
        // When the task completed first, its response can still be on its way after the TMF
        // response (the task leaves the task set before its response is sent): wait for it.
        let deadline = tokio::time::Instant::now() + WAIT;
        while code == TmfResponseCode::TASK_DOES_NOT_EXIST && !seen.contains(&itt) {
            let p = tokio::time::timeout_at(deadline, c.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!("round {i}: neither aborted nor answered within {WAIT:?}")
                })
                .unwrap();
            seen.extend(completions(std::slice::from_ref(&p)));
        }
        // A second (or, after COMPLETE, any) answer that comes late.
        let late = drain(&mut c, Duration::from_millis(50)).await;
        seen.extend(completions(&late));
        let answered = seen.iter().filter(|&&x| x == itt).count();
        match code {
            TmfResponseCode::COMPLETE => {
                assert_eq!(answered, 0, "aborted and answered");
                by_abort += 1;
            }
            TmfResponseCode::TASK_DOES_NOT_EXIST => {
                assert_eq!(answered, 1, "neither aborted nor answered");
                by_response += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    eprintln!("race: {by_abort} aborted, {by_response} completed first");
    assert_eq!(read(&mut c, 0, 0, 8).await.status, 0);
}

/// Real ENOSPC: a thin file on a 1 MiB tmpfs mounted for the test (root only; skipped
/// otherwise) → SPACE ALLOCATION FAILED, and the target goes on.
#[tokio::test]
async fn thin_file_out_of_space_reports_space_allocation_failed() {
    let mnt = std::env::temp_dir().join(format!("ironsan-enospc-{}", std::process::id()));
    std::fs::create_dir_all(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "ironsan-enospc"])
        .arg(&mnt)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        ironsan_testkit::skip("cannot mount a 1 MiB tmpfs (needs root)");
        return;
    }
    struct Umount(std::path::PathBuf);
    impl Drop for Umount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _u = Umount(mnt.clone());
    let file = ironsan_backend::FileBackend::open(
        &mnt.join("thin.img"),
        &ironsan_backend::FileOptions {
            size: Some(16 << 20),
            io_threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let rig = start_on(Arc::new(file), &[], 1).await;
    let mut c = login(rig.addr, 1).await;
    let mut nospace = None;
    for i in 0..64u64 {
        let r = write(&mut c, 0, i * 128, pattern(64 * 1024, i as u8)).await;
        if r.status != 0 {
            nospace = Some((i, r));
            break;
        }
    }
    let (i, r) = nospace.expect("16 MiB fitted in a 1 MiB tmpfs");
    assert!(i >= 8, "failed too early at {i}");
    assert_eq!(r.sense_key(), Some((0x07, 0x27, 0x07)), "{:?}", r.sense);
    // Overwriting allocated blocks still works; LUN 1 too.
    assert_eq!(write(&mut c, 0, 0, pattern(4096, 1)).await.status, 0);
    assert_eq!(write(&mut c, 1, 0, pattern(4096, 1)).await.status, 0);
}
