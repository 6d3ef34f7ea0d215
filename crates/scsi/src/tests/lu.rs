//! The logical unit (`lu.rs`): identity, unit attention queues and LU reset, resizing, and the
//! write range lock with the writes and unmaps aborted tasks leave in the device.

use super::*;
use crate::lu;

/// A FaultBackend over RAM whose first write to LBAs 0..=7 does `effect`; the target over it.
fn fault_target(effect: &str) -> (Arc<Target>, Arc<ironsan_backend::FaultControl>) {
    let rule = ironsan_backend::FaultRule::parse(&format!("write@0-7/count=1:{effect}")).unwrap();
    let be =
        ironsan_backend::FaultBackend::new(Arc::new(RamBackend::new(1 << 20)), vec![rule], 512, 1);
    let ctl = be.control();
    (Arc::new(target_over(Arc::new(be), cfg(512))), ctl)
}

async fn yield_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "timed out: {what}"
        );
        tokio::task::yield_now().await;
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// Report an aborted task to `lu` as the transport does (`task_aborted`); it is gone once the
/// returned flag is set.
fn report_aborted(lu: &LogicalUnit) -> Arc<std::sync::atomic::AtomicBool> {
    let gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
    lu.task_aborted({
        let gone = Arc::clone(&gone);
        move || gone.load(Ordering::SeqCst)
    });
    gone
}

// ---------------------------------------------------------------------------------------------
// Identity
// ---------------------------------------------------------------------------------------------

#[test]
fn local_naa_is_locally_assigned_and_stable() {
    let a = local_naa("iqn.x/0");
    assert_eq!(a >> 60, 3);
    assert_eq!(a, local_naa("iqn.x/0"));
    assert_ne!(a, local_naa("iqn.x/1"));
}

// ---------------------------------------------------------------------------------------------
// Unit attentions and LU reset
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn no_unit_attention_at_first_contact() {
    let t = ram_target();
    good(&run_on(&t, 0, &nexus(9), &cdb10(opcode::READ_10, 0, 1), &[]).await);
}

#[tokio::test]
async fn lun_reset_raises_power_on_reset_once_per_nexus() {
    let t = ram_target();
    let (n1, n2) = (nexus(1), nexus(2));
    good(&run_on(&t, 0, &n1, &[0; 6], &[]).await);
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
    t.lun(0).unwrap().reset();
    assert_eq!(
        sense(&run_on(&t, 0, &n1, &[0; 6], &[]).await),
        (0x6, 0x29, 0x00)
    );
    good(&run_on(&t, 0, &n1, &[0; 6], &[]).await);
    // REPORT LUNS does not consume it either.
    good(&run_on(&t, 0, &n2, &[0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0], &[]).await);
    let r = run_on(&t, 0, &n2, &cdb10(opcode::READ_10, 0, 1), &[]).await;
    assert_eq!(sense(&r), (0x6, 0x29, 0x00));
    good(&run_on(&t, 0, &n2, &cdb10(opcode::READ_10, 0, 1), &[]).await);
}

#[tokio::test]
async fn request_sense_returns_and_clears_unit_attention() {
    let t = ram_target();
    let n2 = nexus(2);
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
    t.lun(0).unwrap().reset();
    let r = run_on(&t, 0, &n2, &[0x03, 0, 0, 0, 18, 0], &[]).await;
    let d = good(&r);
    assert_eq!((d[2], d[12], d[13]), (0x6, 0x29, 0x00));
    let r = run_on(&t, 0, &n2, &[0x03, 0, 0, 0, 18, 0], &[]).await;
    assert_eq!(good(&r)[2], 0);
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
}

#[tokio::test]
async fn unit_attentions_queue_in_order_without_duplicates() {
    let t = ram_target();
    let lu = t.lun(0).unwrap();
    good(&run_on(&t, 0, &nexus(2), &[0; 6], &[]).await);
    lu.establish_unit_attention(UnitAttention::PowerOnReset, None);
    lu.establish_unit_attention(UnitAttention::ModeParametersChanged, None);
    lu.establish_unit_attention(UnitAttention::PowerOnReset, None);
    let n2 = nexus(2);
    assert_eq!(sense(&run_on(&t, 0, &n2, &[0; 6], &[]).await), (6, 0x29, 0));
    assert_eq!(sense(&run_on(&t, 0, &n2, &[0; 6], &[]).await), (6, 0x2A, 1));
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
}

#[tokio::test]
async fn report_luns_clears_reported_luns_data_changed() {
    let t = ram_target();
    let n2 = nexus(2);
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
    let lu = t.lun(0).unwrap();
    lu.establish_unit_attention(UnitAttention::ReportedLunsDataChanged, None);
    lu.establish_unit_attention(UnitAttention::CapacityDataChanged, None);
    good(&run_on(&t, 0, &n2, &[0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0], &[]).await);
    assert_eq!(
        sense(&run_on(&t, 0, &n2, &[0; 6], &[]).await),
        (6, 0x2A, 0x09)
    );
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
}

#[tokio::test]
async fn nexus_loss_drops_pending_unit_attentions() {
    let t = ram_target();
    good(&run_on(&t, 0, &nexus(2), &[0; 6], &[]).await);
    t.lun(0).unwrap().reset();
    t.nexus_lost(2);
    good(&run_on(&t, 0, &nexus(2), &[0; 6], &[]).await);
}

#[tokio::test]
async fn lun_reset_reports_unit_attention_to_every_nexus_including_the_requester() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    good(&run_on(&t, 0, &a, &[0; 6], &[]).await);
    good(&run_on(&t, 0, &b, &[0; 6], &[]).await);
    t.lun(0).unwrap().reset();
    assert_eq!(
        sense(&run_on(&t, 0, &a, &[0; 6], &[]).await),
        (0x06, 0x29, 0x00)
    );
    assert_eq!(
        sense(&run_on(&t, 0, &b, &[0; 6], &[]).await),
        (0x06, 0x29, 0x00)
    );
}

// ---------------------------------------------------------------------------------------------
// Run-time changes (ironsan ctl): resize, LUN add/remove
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn resize_raises_capacity_data_has_changed_and_reports_the_new_size() {
    let mut t = ram_target();
    good(&run(&t, &[0x00, 0, 0, 0, 0, 0]).await); // nexus 1 known
    let lu = Arc::clone(t.lun(0).unwrap());
    // Write the last block, shrink, grow back: it reads zeros.
    let last = 2047u32;
    let w = cdb10(0x2A, last, 1);
    good(&run_data(&t, &w, &[0xAB; 512]).await);
    assert_eq!(lu.resize(4 << 20).unwrap(), 8192);
    assert_eq!(
        sense(&run(&t, &[0x00, 0, 0, 0, 0, 0]).await),
        (0x6, 0x2A, 0x09)
    );
    let cap = run(&t, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]).await;
    assert_eq!(&good(&cap)[..4], &8191u32.to_be_bytes());
    good(&run(&t, &cdb10(0x28, 8191, 1)).await);
    lu.resize(512 * 1024).unwrap();
    assert_eq!(
        sense(&run(&t, &cdb10(0x28, 1500, 1)).await),
        (0x6, 0x2A, 0x09)
    );
    assert_eq!(sense(&run(&t, &cdb10(0x28, 1500, 1)).await), LBA_OOR);
    lu.resize(1 << 20).unwrap();
    let _ = run(&t, &[0x00, 0, 0, 0, 0, 0]).await; // the UA
    assert_eq!(good(&run(&t, &cdb10(0x28, last, 1)).await), &[0u8; 512][..]);
    assert!(lu.resize(100).is_err(), "less than one block");
    // Adding a LUN raises REPORTED LUNS DATA HAS CHANGED on the others.
    let mut t2 = t.clone();
    t2.add_lun(
        1,
        Arc::new(LogicalUnit::new(
            Arc::new(RamBackend::new(1 << 20)),
            cfg(512),
        )),
    );
    t2.luns_changed();
    t = t2;
    assert_eq!(
        sense(&run(&t, &[0x00, 0, 0, 0, 0, 0]).await),
        (0x6, 0x3F, 0x0E)
    );
    assert!(t.clone().remove_lun(1).is_some());
}

// ---------------------------------------------------------------------------------------------
// The write range lock and aborted writes
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn range_lock_excludes_only_overlapping_ranges() {
    let l = lu::RangeLock::default();
    let g1 = l.lock(0, 10).await;
    let _g2 = l.lock(10, 20).await; // adjacent: no overlap
    let mut waiting = Box::pin(l.lock(5, 6));
    let waker = std::task::Waker::noop();
    let mut cx = Context::from_waker(waker);
    assert!(waiting.as_mut().poll(&mut cx).is_pending());
    drop(g1);
    assert!(waiting.as_mut().poll(&mut cx).is_ready());
}

/// An aborted write whose I/O is already in the device (cannot be called back) keeps the range
/// locked until that I/O is done, so a newer write of the same blocks lands after it and wins.
/// Before the fix the lock went with the dropped task: the newer write was acknowledged at
/// once and then overwritten by the aborted one.
#[tokio::test(flavor = "current_thread")]
async fn aborted_write_in_flight_keeps_the_range_until_its_io_is_done() {
    let (t, ctl) = fault_target("hang");
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await }
    });
    yield_until("old write in the device", || ctl.stuck_now() == 1).await;
    // ABORT TASK: the task future is dropped; the transport answers the TMF at once.
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    assert_eq!(
        t.lun(0).unwrap().writes.held(),
        1,
        "range released with the task"
    );
    // A newer write of the same blocks waits for the aborted I/O ...
    let new = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 2)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!new.is_finished(), "newer write overtook the aborted one");
    // ... a write elsewhere does not.
    good(&run_data(&t, &cdb16(WRITE_16, 8, 8), &pattern(4096, 3)).await);
    // The device lets the old I/O finish; then the newer write runs and is acknowledged.
    ctl.release();
    good(&new.await.unwrap());
    let r = run(&t, &cdb16(READ_16, 0, 16)).await;
    assert_eq!(
        &good(&r)[..4096],
        &pattern(4096, 2)[..],
        "aborted write landed last"
    );
    assert_eq!(&good(&r)[4096..], &pattern(4096, 3)[..]);
    assert_eq!(t.lun(0).unwrap().writes.held(), 0);
}

/// An aborted write that never reached the device (stuck before it) gives its range back at
/// once: a newer write neither waits for the hung device nor is overwritten.
#[tokio::test(flavor = "current_thread")]
async fn aborted_write_that_never_reached_the_device_releases_the_range_at_once() {
    let (t, ctl) = fault_target("stuck");
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await }
    });
    yield_until("old write stuck", || ctl.stuck_now() == 1).await;
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    assert_eq!(t.lun(0).unwrap().writes.held(), 0);
    good(&run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 2)).await);
    ctl.release();
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert_eq!(good(&r), &pattern(4096, 2)[..]);
}

/// The same for UNMAP and WRITE SAME: an aborted deallocation in the device is ordered before
/// a newer write of the blocks.
#[tokio::test(flavor = "current_thread")]
async fn aborted_unmap_in_flight_keeps_the_range_until_its_io_is_done() {
    let rule = ironsan_backend::FaultRule::parse("unmap@0-7/count=1:hang").unwrap();
    let inner = Arc::new(TestBackend::new(1 << 20));
    let be = ironsan_backend::FaultBackend::new(inner, vec![rule], 512, 1);
    let ctl = be.control();
    let t = Arc::new(target_over(Arc::new(be), cfg(512)));
    good(&run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await);
    let mut unmap = vec![0u8; 24];
    unmap[1] = 22;
    unmap[3] = 16;
    unmap[8..16].copy_from_slice(&0u64.to_be_bytes());
    unmap[16..20].copy_from_slice(&8u32.to_be_bytes());
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb10(UNMAP, 0, 24), &unmap).await }
    });
    yield_until("unmap in the device", || ctl.stuck_now() == 1).await;
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    let new = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 2)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!new.is_finished(), "newer write overtook the aborted unmap");
    ctl.release();
    good(&new.await.unwrap());
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert_eq!(good(&r), &pattern(4096, 2)[..]);
}

// ---------------------------------------------------------------------------------------------
// Reads and orphaned writes (docs/INTEGRITY.md, "Reads and orphaned writes")
// ---------------------------------------------------------------------------------------------

/// A write aborted while the device holds its I/O leaves an orphaned range: a read of it issued
/// after the abort waits until the device finishes and then sees the aborted data, so two
/// successive reads agree. Without the fix the first read returned the old data and a later
/// one the aborted write's.
#[tokio::test(flavor = "current_thread")]
async fn read_after_abort_waits_for_the_orphaned_write_in_the_device() {
    let (t, ctl) = fault_target("hang");
    good(&run_data(&t, &cdb16(WRITE_16, 8, 8), &pattern(4096, 7)).await);
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await }
    });
    yield_until("write in the device", || ctl.stuck_now() == 1).await;
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    let lu = Arc::clone(t.lun(0).unwrap());
    assert_eq!(lu.writes.orphaned(), 1);
    // A read of the orphaned blocks (here overlapping them by one block) waits ...
    let read = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run(&t, &cdb16(READ_16, 7, 2)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!read.is_finished(), "read overtook the orphaned write");
    // ... reads elsewhere do not.
    let r = run(&t, &cdb16(READ_16, 8, 8)).await;
    assert_eq!(good(&r), &pattern(4096, 7)[..]);
    // The device finishes the aborted write: the waiting read sees it, and so does every
    // later read.
    ctl.release();
    let r = read.await.unwrap();
    assert_eq!(&good(&r)[..512], &pattern(4096, 1)[3584..]);
    assert_eq!(&good(&r)[512..], &pattern(4096, 7)[..512]);
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert_eq!(good(&r), &pattern(4096, 1)[..]);
    assert_eq!(lu.writes.orphaned(), 0);
    assert_eq!(lu.writes.held(), 0);
}

/// Reads do not wait for ordinary in-flight writes (SCSI does not order concurrent commands;
/// waiting would cost every read that meets a write): a read of blocks a running write holds
/// completes at once with the old data.
#[tokio::test(flavor = "current_thread")]
async fn read_does_not_wait_for_a_write_that_was_not_aborted() {
    let (t, ctl) = fault_target("hang");
    let w = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await }
    });
    yield_until("write in the device", || ctl.stuck_now() == 1).await;
    let lu = Arc::clone(t.lun(0).unwrap());
    assert_eq!((lu.writes.held(), lu.writes.orphaned()), (1, 0));
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert!(good(&r).iter().all(|&b| b == 0));
    ctl.release();
    good(&w.await.unwrap());
    assert_eq!(
        good(&run(&t, &cdb16(READ_16, 0, 8)).await),
        &pattern(4096, 1)[..]
    );
}

/// A write aborted before it reached the device (stuck in front of it) orphans nothing: reads
/// go on at once and see the old data for good.
#[tokio::test(flavor = "current_thread")]
async fn read_after_abort_of_a_write_that_never_reached_the_device_does_not_wait() {
    let (t, ctl) = fault_target("stuck");
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await }
    });
    yield_until("write stuck", || ctl.stuck_now() == 1).await;
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    let lu = Arc::clone(t.lun(0).unwrap());
    assert_eq!((lu.writes.held(), lu.writes.orphaned()), (0, 0));
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert!(good(&r).iter().all(|&b| b == 0));
    ctl.release();
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert!(good(&r).iter().all(|&b| b == 0), "the dropped write landed");
}

/// The transport answers ABORT TASK before the aborted task's future is dropped; reads wait
/// for every task reported with `task_aborted` to be gone, then for what it orphaned. Here
/// the aborted task is a future held by the test: reads of any block wait while it is
/// alive; once it is dropped, reads of its blocks wait for the device.
#[tokio::test(flavor = "current_thread")]
async fn reads_wait_for_an_aborted_task_that_is_not_yet_dropped() {
    let (t, ctl) = fault_target("hang");
    let lu = Arc::clone(t.lun(0).unwrap());
    let cdb = cdb16(WRITE_16, 0, 8);
    let data = Bytes::from(pattern(4096, 1));
    let nexus = nexus(1);
    let mut aborted = Box::pin(t.execute(
        0,
        &nexus,
        Command {
            cdb: Bytes::copy_from_slice(&cdb),
            data_out: data,
            expected_in_len: 0,
            in_place: None,
        },
    ));
    let noop = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(noop);
    assert!(aborted.as_mut().poll(&mut cx).is_pending());
    yield_until("write in the device", || ctl.stuck_now() == 1).await;
    // ABORT TASK: reported to the LU; the future is not dropped yet.
    let gone = report_aborted(&lu);
    let far = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run(&t, &cdb16(READ_16, 64, 8)).await }
    });
    let near = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run(&t, &cdb16(READ_16, 0, 8)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!far.is_finished() && !near.is_finished());
    // The future is dropped: its range is orphaned; the far read goes on, the near one waits
    // for the device.
    drop(aborted);
    gone.store(true, Ordering::SeqCst);
    good(&far.await.unwrap());
    assert_eq!(lu.writes.orphaned(), 1);
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!near.is_finished());
    ctl.release();
    assert_eq!(good(&near.await.unwrap()), &pattern(4096, 1)[..]);
    assert_eq!(lu.writes.orphaned(), 0);
}

/// A task aborted after its command was admitted but before it took its blocks' range (its
/// thread preempted in between, say) must not land after the TMF response: a write issued
/// after that response waits until the aborted task is gone, and the aborted task, polled
/// meanwhile, takes no range (it yields to be dropped). Without that the later write took the
/// free range and was acknowledged, and the aborted one then wrote over it (INTEGRITY.md
/// promise 17).
#[tokio::test(flavor = "current_thread")]
async fn writes_wait_for_an_aborted_task_that_has_not_taken_its_range_yet() {
    let t = Arc::new(ram_target());
    let lu = Arc::clone(t.lun(0).unwrap());
    let nexus = nexus(1);
    // Admitted, not yet polled: it holds no range.
    let mut aborted = Box::pin(t.execute(
        0,
        &nexus,
        Command {
            cdb: Bytes::copy_from_slice(&cdb16(WRITE_16, 0, 8)),
            data_out: Bytes::from(pattern(4096, 1)),
            expected_in_len: 0,
            in_place: None,
        },
    ));
    let gone = report_aborted(&lu);
    // After the TMF response: a write of the same blocks from another initiator.
    let newer = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 2)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(
        !newer.is_finished(),
        "a write went ahead of an aborted task still alive"
    );
    // The aborted task runs on: it must not take the range and write.
    let noop = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(noop);
    assert!(
        aborted.as_mut().poll(&mut cx).is_pending(),
        "the aborted write ran"
    );
    assert_eq!(lu.writes.held(), 0);
    drop(aborted);
    gone.store(true, Ordering::SeqCst);
    good(&newer.await.unwrap());
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert!(
        good(&r) == &pattern(4096, 2)[..],
        "the newer write was overwritten"
    );
}

/// An aborted WRITE SAME (UNMAP) in the device orphans its range like a WRITE; reads and GET
/// LBA STATUS (which reads the allocation map) wait for it.
#[tokio::test(flavor = "current_thread")]
async fn get_lba_status_and_reads_wait_for_an_orphaned_unmap() {
    // Two whole RAM chunks (1 MiB = 2048 blocks), so the unmap really deallocates.
    let rule = ironsan_backend::FaultRule::parse("unmap@0-2047/count=1:hang").unwrap();
    let inner = Arc::new(RamBackend::new(2 << 20));
    let be = ironsan_backend::FaultBackend::new(inner, vec![rule], 512, 1);
    let ctl = be.control();
    let t = Arc::new(target_over(Arc::new(be), cfg(512)));
    good(&run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await);
    let mut ws = cdb16(opcode::WRITE_SAME_16, 0, 2048);
    ws[1] = 0x08; // UNMAP
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &ws, &[0u8; 512]).await }
    });
    yield_until("unmap in the device", || ctl.stuck_now() == 1).await;
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    assert_eq!(t.lun(0).unwrap().writes.orphaned(), 1);
    let mut gls = vec![0u8; 16];
    gls[0] = 0x9E;
    gls[1] = 0x12;
    gls[13] = 64;
    let status = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run(&t, &gls).await }
    });
    let read = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run(&t, &cdb16(READ_16, 0, 8)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!status.is_finished() && !read.is_finished());
    ctl.release();
    let st = status.await.unwrap();
    assert_eq!(good(&st)[8..16], 0u64.to_be_bytes());
    assert_eq!(
        good(&st)[20] & 0x0F,
        0x01,
        "LBA 0 deallocated by the aborted unmap"
    );
    assert!(good(&read.await.unwrap()).iter().all(|&b| b == 0));
}
