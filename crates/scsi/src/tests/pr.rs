//! SPC-4 persistent reservations (`pr.rs`).

use super::*;

fn prin(sa: u8) -> Vec<u8> {
    let mut c = vec![0u8; 10];
    c[0] = opcode::PERSISTENT_RESERVE_IN;
    c[1] = sa;
    c[7] = 0x10;
    c
}

#[tokio::test]
async fn pr_register_read_keys_and_generation() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    register(&t, &a, 0xAA).await;
    register(&t, &b, 0xBB).await;
    let r = run_on(&t, 0, &a, &prin(0x00), &[]).await;
    let d = good(&r);
    assert_eq!(&d[0..4], &2u32.to_be_bytes()); // PRGENERATION
    assert_eq!(&d[4..8], &16u32.to_be_bytes());
    assert_eq!(&d[8..16], &0xAAu64.to_be_bytes());
    assert_eq!(&d[16..24], &0xBBu64.to_be_bytes());
    // REGISTER with a wrong key conflicts.
    let r = run_on(&t, 0, &a, &prout(0x00, 0), &prout_params(0x1, 0xCC, false)).await;
    assert_eq!(r.status, Status::RESERVATION_CONFLICT);
}

#[tokio::test]
async fn pr_exclusive_access_blocks_reads_and_writes_of_others() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    register(&t, &a, 0xAA).await;
    good(&run_on(&t, 0, &a, &prout(0x01, 0x03), &prout_params(0xAA, 0, false)).await);
    let read = cdb10(opcode::READ_10, 0, 1);
    good(&run_on(&t, 0, &a, &read, &[]).await);
    assert_eq!(
        run_on(&t, 0, &b, &read, &[]).await.status,
        Status::RESERVATION_CONFLICT
    );
    // INQUIRY and PRIN stay allowed.
    good(&run_on(&t, 0, &b, &inquiry(false, 0, 96), &[]).await);
    good(&run_on(&t, 0, &b, &prin(0x01), &[]).await);
    let rr = run_on(&t, 0, &b, &prin(0x01), &[]).await;
    assert_eq!(&good(&rr)[8..16], &0xAAu64.to_be_bytes());
    assert_eq!(good(&rr)[21], 0x03);
}

#[tokio::test]
async fn pr_write_exclusive_registrants_only_lets_registered_nexus_write() {
    let t = ram_target();
    let (a, b, c) = (nexus(1), nexus(2), nexus(3));
    register(&t, &a, 0xAA).await;
    register(&t, &b, 0xBB).await;
    good(&run_on(&t, 0, &a, &prout(0x01, 0x05), &prout_params(0xAA, 0, false)).await);
    let w = cdb10(opcode::WRITE_10, 0, 1);
    good(&run_on(&t, 0, &b, &w, &[0u8; 512]).await);
    assert_eq!(
        run_on(&t, 0, &c, &w, &[0u8; 512]).await.status,
        Status::RESERVATION_CONFLICT
    );
    good(&run_on(&t, 0, &c, &cdb10(opcode::READ_10, 0, 1), &[]).await);
}

#[tokio::test]
async fn pr_release_with_wrong_type_is_invalid_release() {
    let t = ram_target();
    let a = nexus(1);
    register(&t, &a, 0xAA).await;
    good(&run_on(&t, 0, &a, &prout(0x01, 0x01), &prout_params(0xAA, 0, false)).await);
    let r = run_on(&t, 0, &a, &prout(0x02, 0x03), &prout_params(0xAA, 0, false)).await;
    assert_eq!(sense(&r), (0x05, 0x26, 0x04));
}

#[tokio::test]
async fn pr_preempt_and_abort_removes_registration_queues_abort_and_ua() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    register(&t, &a, 0xAA).await;
    register(&t, &b, 0xBB).await;
    good(&run_on(&t, 0, &a, &prout(0x01, 0x03), &prout_params(0xAA, 0, false)).await);
    good(
        &run_on(
            &t,
            0,
            &b,
            &prout(0x05, 0x03),
            &prout_params(0xBB, 0xAA, false),
        )
        .await,
    );
    let lu = t.lun(0).unwrap();
    let aborts = lu.take_pr_aborts();
    assert_eq!(aborts.len(), 1);
    assert_eq!(aborts[0].0, a.initiator_port);
    assert!(lu.take_pr_aborts().is_empty());
    let r = run_on(&t, 0, &a, &[0; 6], &[]).await;
    assert_eq!(sense(&r), (0x06, 0x2A, 0x05)); // REGISTRATIONS PREEMPTED
    let rr = run_on(&t, 0, &b, &prin(0x01), &[]).await;
    assert_eq!(&good(&rr)[8..16], &0xBBu64.to_be_bytes());
}

#[tokio::test]
async fn pr_clear_removes_everything_and_reports_reservations_preempted() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    register(&t, &a, 0xAA).await;
    register(&t, &b, 0xBB).await;
    clear_uas(&t, &b).await;
    good(&run_on(&t, 0, &a, &prout(0x03, 0), &prout_params(0xAA, 0, false)).await);
    let r = run_on(&t, 0, &b, &[0; 6], &[]).await;
    assert_eq!(sense(&r), (0x06, 0x2A, 0x03));
    let r = run_on(&t, 0, &a, &prin(0x00), &[]).await;
    assert_eq!(&good(&r)[4..8], &0u32.to_be_bytes());
}

#[tokio::test]
async fn pr_aptpl_without_state_dir_is_refused_and_with_one_survives_restart() {
    let t = ram_target();
    let r = run_on(
        &t,
        0,
        &nexus(1),
        &prout(0x06, 0),
        &prout_params(0, 0xAA, true),
    )
    .await;
    invalid_param_field(&r, 20, Some(0));

    let dir = std::env::temp_dir().join(format!("ironsan-pr-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let c = LuConfig {
        state_dir: Some(dir.clone()),
        ..cfg(512)
    };
    let backend: Arc<dyn BlockDevice> = Arc::new(RamBackend::new(1 << 20));
    let t = target_over(Arc::clone(&backend), c.clone());
    let a = nexus(1);
    good(&run_on(&t, 0, &a, &prout(0x06, 0), &prout_params(0, 0xAA, true)).await);
    good(&run_on(&t, 0, &a, &prout(0x01, 0x01), &prout_params(0xAA, 0, false)).await);
    assert!(dir.join(PR_STATE_FILE).exists());
    drop(t);
    let t = target_over(backend, c);
    let rr = run_on(&t, 0, &nexus(2), &prin(0x01), &[]).await;
    let d = good(&rr);
    assert_eq!(&d[8..16], &0xAAu64.to_be_bytes());
    assert_eq!(d[21], 0x01);
    let caps = run_on(&t, 0, &a, &prin(0x02), &[]).await;
    assert_eq!(good(&caps)[2] & 0x01, 0x01); // PTPL_C
    assert_eq!(good(&caps)[3] & 0x01, 0x01); // PTPL_A
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn pr_across_target_ports_all_tg_pt_spec_i_pt_and_register_and_move() {
    let t = alua_target();
    let w = cdb10(opcode::WRITE_10, 0, 1);
    // Initiator 1 registers through port 1 with ALL_TG_PT=1: its path through port 2 is
    // registered too, and READ FULL STATUS says ALL_TG_PT.
    let mut p = prout_params(0, 0xA1, false);
    p[20] |= 0x04;
    good(&run_on(&t, 0, &path(1, 1), &prout(0x00, 0), &p).await);
    // Write Exclusive, Registrants Only, reserved through port 1.
    good(
        &run_on(
            &t,
            0,
            &path(1, 1),
            &prout(0x01, 0x05),
            &prout_params(0xA1, 0, false),
        )
        .await,
    );
    good(&run_on(&t, 0, &path(1, 2), &w, &[1u8; 512]).await);
    let mut full = prin(0x03);
    full[8] = 0xFF;
    let d = good(&run_on(&t, 0, &path(1, 2), &full, &[]).await).to_vec();
    assert_eq!(d[8 + 12] & 0x02, 0x02, "ALL_TG_PT reported");
    // Initiator 2 registered through port 1 only: its path through port 2 is not.
    register(&t, &path(2, 1), 0xB2).await;
    good(&run_on(&t, 0, &path(2, 1), &w, &[2u8; 512]).await);
    assert_eq!(
        run_on(&t, 0, &path(2, 2), &w, &[2u8; 512]).await.status,
        Status::RESERVATION_CONFLICT
    );
    good(&run_on(&t, 0, &path(2, 2), &cdb10(opcode::READ_10, 0, 1), &[]).await);
    // SPEC_I_PT is not supported (SIP_C=0): refused with the bit pointed at.
    let mut p = prout_params(0, 0xC3, false);
    p[20] |= 0x08;
    invalid_param_field(
        &run_on(&t, 0, &path(3, 1), &prout(0x00, 0), &p).await,
        20,
        Some(3),
    );

    // REGISTER AND MOVE: initiator 2's holder moves a Write Exclusive reservation to
    // initiator 4 through another relative port (3).
    let t = alua_target();
    register(&t, &path(2, 1), 0xB2).await;
    good(
        &run_on(
            &t,
            0,
            &path(2, 1),
            &prout(0x01, 0x01),
            &prout_params(0xB2, 0, false),
        )
        .await,
    );
    let tid = {
        let name = path(4, 3).initiator_port.to_string();
        let mut n = name.into_bytes();
        n.push(0);
        while !n.len().is_multiple_of(4) {
            n.push(0);
        }
        let mut d = vec![0x45, 0];
        d.extend_from_slice(&(n.len() as u16).to_be_bytes());
        d.extend_from_slice(&n);
        d
    };
    let move_params = |rel: u16| {
        let mut m = vec![0u8; 24];
        m[0..8].copy_from_slice(&0xB2u64.to_be_bytes());
        m[8..16].copy_from_slice(&0xD4u64.to_be_bytes());
        m[18..20].copy_from_slice(&rel.to_be_bytes());
        m[20..24].copy_from_slice(&(tid.len() as u32).to_be_bytes());
        m.extend_from_slice(&tid);
        m
    };
    let mut cdb = prout(0x07, 0x01);
    // A relative port that does not exist: INVALID FIELD IN PARAMETER LIST at byte 18.
    let m = move_params(9);
    cdb[8] = m.len() as u8;
    invalid_param_field(&run_on(&t, 0, &path(2, 1), &cdb, &m).await, 18, None);
    let m = move_params(3);
    good(&run_on(&t, 0, &path(2, 1), &cdb, &m).await);
    // Initiator 4 now holds it through port 3 (and only there); initiator 2 is unregistered
    // as a holder and writes conflict.
    good(&run_on(&t, 0, &path(4, 3), &w, &[4u8; 512]).await);
    assert_eq!(
        run_on(&t, 0, &path(4, 2), &w, &[4u8; 512]).await.status,
        Status::RESERVATION_CONFLICT
    );
    assert_eq!(
        run_on(&t, 0, &path(2, 1), &w, &[2u8; 512]).await.status,
        Status::RESERVATION_CONFLICT
    );
    let rr = run_on(&t, 0, &path(2, 1), &prin(0x01), &[]).await;
    assert_eq!(&good(&rr)[8..16], &0xD4u64.to_be_bytes());
}

/// Two nodes' LUs of one shared image, their reservation records kept by one store that
/// hands every written record to both (what the cluster agent does through RADOS).
#[derive(Debug, Default)]
struct TwoNodes {
    record: std::sync::Mutex<Option<String>>,
    lus: std::sync::Mutex<Vec<std::sync::Weak<LogicalUnit>>>,
    /// What `begin_write` answers: admit (`None`), or refuse with this.
    refuse: std::sync::Mutex<Option<SenseReason>>,
    /// Write tokens alive now.
    tokens: Arc<std::sync::atomic::AtomicUsize>,
}

/// A token that counts itself while alive.
struct Counted(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl ClusterLu for TwoNodes {
    fn update_pr(&self, mut change: PrChange) -> ClusterFuture<'_, Result<Option<String>, String>> {
        Box::pin(async move {
            let mut rec = self.record.lock().unwrap();
            let Some(new) = change(rec.as_deref()) else {
                return Ok(None);
            };
            *rec = Some(new.clone());
            for lu in self.lus.lock().unwrap().iter().filter_map(|l| l.upgrade()) {
                lu.apply_shared_pr(&new, true)?;
            }
            Ok(Some(new))
        })
    }
    fn reset(&self) -> ClusterFuture<'_, ()> {
        Box::pin(async {})
    }
    fn begin_write(&self) -> WriteAdmission {
        if let Some(r) = *self.refuse.lock().unwrap() {
            return WriteAdmission::Refused(r);
        }
        self.tokens
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        WriteAdmission::Go(WriteToken(Box::new(Counted(Arc::clone(&self.tokens)))))
    }
}

/// A cluster LU asks the cluster before every command that may change its medium (and
/// only those), holds the token while the command runs, refuses what the cluster refuses,
/// and reports when the range it holds was taken.
#[tokio::test]
async fn a_cluster_lu_admits_medium_changes_through_the_cluster() {
    use std::sync::atomic::Ordering::SeqCst;
    let (na, _nb, store) = two_nodes();
    let a = nexus_at(1, 1);
    let w = cdb10(opcode::WRITE_10, 0, 1);
    clear_uas(&na, &a).await;
    good(&run_on(&na, 0, &a, &w, &[7u8; 512]).await);
    assert_eq!(
        store.tokens.load(SeqCst),
        0,
        "the token ends with the command"
    );
    let unavailable = SenseReason::NotAccessible(crate::alua::AccessState::Unavailable);
    *store.refuse.lock().unwrap() = Some(unavailable);
    let r = run_on(&na, 0, &a, &w, &[8u8; 512]).await;
    assert_eq!(r.sense.as_deref(), Some(&unavailable.to_fixed_sense()[..]));
    // Reads and other commands that do not change the medium do not ask.
    let rd = good(&run_on(&na, 0, &a, &cdb10(opcode::READ_10, 0, 1), &[]).await).to_vec();
    assert_eq!(rd, vec![7u8; 512], "the refused write did not land");
    good(&run_on(&na, 0, &a, &[0u8; 6], &[]).await);
    *store.refuse.lock().unwrap() = None;
    // A write held in the range lock: its token lives and the range's age is reported.
    let lu = na.lun(0).unwrap().clone();
    assert!(lu.oldest_write().is_none());
    let g = lu.writes.lock(0, 1).await;
    let t0 = std::time::Instant::now();
    let held = {
        let na = na.clone();
        let a = a.clone();
        tokio::spawn(async move {
            run_on(&na, 0, &a, &cdb10(opcode::WRITE_10, 0, 1), &[9u8; 512]).await
        })
    };
    tokio::task::yield_now().await;
    assert_eq!(
        store.tokens.load(SeqCst),
        1,
        "waiting for its range, with a token"
    );
    assert!(lu.oldest_write().is_some_and(|t| t <= t0));
    drop(g);
    good(&held.await.unwrap());
    assert_eq!(store.tokens.load(SeqCst), 0);
    assert!(lu.oldest_write().is_none());
}

fn two_nodes() -> (Target, Target, Arc<TwoNodes>) {
    let store = Arc::new(TwoNodes::default());
    let node = |_| {
        let c = LuConfig {
            shared: true,
            cluster: Some(ClusterLuHandle(store.clone())),
            ..cfg(512)
        };
        let lu = Arc::new(LogicalUnit::new(Arc::new(RamBackend::new(1 << 20)), c));
        store.lus.lock().unwrap().push(Arc::downgrade(&lu));
        let mut t = Target::new();
        t.add_lun(0, lu);
        t.set_alua(Arc::new(Alua::new(vec![
            PortGroup::new(1, vec![1]),
            PortGroup::new(2, vec![2]),
        ])));
        t
    };
    let (a, b) = (node(1), node(2));
    (a, b, store)
}

#[tokio::test]
async fn a_shared_reservation_holds_on_every_node_with_its_unit_attentions_and_aborts() {
    let (na, nb, store) = two_nodes();
    let (a, b) = (nexus_at(1, 1), nexus_at(2, 2));
    // REPORT SUPPORTED OPERATION CODES offers PR on a shared LU that has a cluster.
    good(
        &run_on(
            &na,
            0,
            &a,
            &rsoc(2, opcode::PERSISTENT_RESERVE_OUT, 0, 64),
            &[],
        )
        .await,
    );
    register(&na, &a, 0xAA).await;
    register(&nb, &b, 0xBB).await;
    good(
        &run_on(
            &na,
            0,
            &a,
            &prout(0x01, 0x01),
            &prout_params(0xAA, 0, false),
        )
        .await,
    );
    // Node B enforces node A's Write Exclusive, and reports the same keys and generation.
    let w = cdb10(opcode::WRITE_10, 0, 1);
    clear_uas(&nb, &b).await;
    assert_eq!(
        run_on(&nb, 0, &b, &w, &[0u8; 512]).await.status,
        Status::RESERVATION_CONFLICT
    );
    let keys = |t: &Target, n: &Nexus| {
        let (t, n) = (t.clone(), n.clone());
        async move { good(&run_on(&t, 0, &n, &prin(0x00), &[]).await).to_vec() }
    };
    assert_eq!(keys(&na, &a).await, keys(&nb, &b).await);
    // PREEMPT AND ABORT through node B: node A queues the abort of nexus a's tasks and
    // tells it its registration went.
    good(
        &run_on(
            &nb,
            0,
            &b,
            &prout(0x05, 0x01),
            &prout_params(0xBB, 0xAA, false),
        )
        .await,
    );
    let lu_a = na.lun(0).unwrap();
    let victims = lu_a.take_pr_aborts();
    assert_eq!(victims.len(), 1);
    assert_eq!(victims[0].0, a.initiator_port);
    let r = run_on(&na, 0, &a, &[0; 6], &[]).await;
    assert_eq!(
        sense(&r),
        (0x6, 0x2A, 0x05),
        "REGISTRATIONS PREEMPTED on node A"
    );
    assert_eq!(
        run_on(&na, 0, &a, &w, &[0u8; 512]).await.status,
        Status::RESERVATION_CONFLICT
    );
    // The record is what both nodes applied; an older one is not taken again.
    let rec = store.record.lock().unwrap().clone().unwrap();
    assert_eq!(pr_record_serial(&rec), Some(lu_a.shared_pr_serial()));
    assert_eq!(lu_a.apply_shared_pr(&rec, true), Ok(false));
    assert!(lu_a.apply_shared_pr("not a record", true).is_err());
    // APTPL is accepted: the record outlives any node.
    good(&run_on(&nb, 0, &b, &prout(0x00, 0), &prout_params(0xBB, 0xBC, true)).await);
}
