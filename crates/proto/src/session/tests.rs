use super::*;
use crate::pdu::Lun;
use proptest::prelude::*;

type S = Session<u32, &'static str>;

fn cmd(itt: u32, cmd_sn: u32) -> ScsiCommand {
    ScsiCommand {
        final_bit: true,
        read: true,
        itt: Itt(itt),
        cmd_sn: CmdSn(cmd_sn),
        lun: Lun::from_number(0),
        expected_data_transfer_length: 4096,
        ..Default::default()
    }
}

fn session(conns: &[u16]) -> (S, Vec<ConnId>) {
    let mut s = S::new(CmdSn(0), 64, 4, 0);
    let ids = conns
        .iter()
        .map(|&cid| s.join(Cid(cid), "c", 0).expect("joins").id)
        .collect();
    (s, ids)
}

fn events(s: &mut S, c: ConnId) -> Vec<Event> {
    std::iter::from_fn(|| s.poll_event(c)).collect()
}

#[test]
fn a_command_ahead_of_a_gap_waits_and_its_own_connection_runs_it() {
    let (mut s, ids) = session(&[1, 2]);
    let (a, b) = (ids[0], ids[1]);
    // CmdSN 1 on B overtakes CmdSN 0 on A: it is held, not delivered.
    assert_eq!(s.admit_command(b, &cmd(11, 1), 0, || 11), Admission::Held);
    assert_eq!(s.task(Itt(11)).map(|t| t.state), Some(TaskState::Held));
    assert_eq!(s.claim(Itt(11)), None, "a held task must not run");
    assert_eq!(
        s.admit_command(a, &cmd(10, 0), 0, || 10),
        Admission::Deliver
    );
    // A filled the gap: B is told (and woken), A is not.
    let mut woken = Vec::new();
    s.take_wakeups(a, |c| woken.push(*c));
    assert_eq!(woken, vec!["c"]);
    assert_eq!(events(&mut s, a), vec![]);
    assert_eq!(events(&mut s, b), vec![Event::Deliver(Itt(11))]);
    assert_eq!(s.claim(Itt(11)), Some(&mut 11));
    assert_eq!(s.window_sn().0, CmdSn(2));
    assert_eq!(s.in_flight(), 2);
}

#[test]
fn itts_are_unique_across_the_connections_of_a_session() {
    let (mut s, ids) = session(&[1, 2]);
    assert_eq!(
        s.admit_command(ids[0], &cmd(7, 0), 0, || 0),
        Admission::Deliver
    );
    assert_eq!(
        s.admit_command(ids[1], &cmd(7, 1), 0, || 0),
        Admission::Reject(RejectReason::TASK_IN_PROGRESS)
    );
    // A rejected command's CmdSN is not received (RFC 7143 §7.3): the initiator plugs the
    // gap, here with another command with that CmdSN.
    assert_eq!(s.window_sn().0, CmdSn(1));
    assert_eq!(
        s.admit_command(ids[1], &cmd(RESERVED, 1), 0, || 0),
        Admission::Reject(RejectReason::INVALID_PDU_FIELD)
    );
    assert_eq!(s.window_sn().0, CmdSn(1));
    assert_eq!(
        s.admit_command(ids[1], &cmd(8, 1), 0, || 0),
        Admission::Deliver
    );
    assert_eq!(s.window_sn().0, CmdSn(2));
}

#[test]
fn the_session_keeps_a_held_pdu_and_hands_it_back_in_order() {
    let mut s: Session<u32, &'static str, &'static str> = Session::new(CmdSn(1), 8, 2, 0);
    let a = s.join(Cid(1), "a", 0).unwrap().id;
    let b = s.join(Cid(2), "b", 0).unwrap().id;
    assert_eq!(
        s.admit_pdu(b, CmdSn(3), false, "logout"),
        PduAdmission::Held
    );
    assert_eq!(s.admit_pdu(b, CmdSn(2), false, "text"), PduAdmission::Held);
    assert_eq!(
        s.admit_pdu(a, CmdSn(1), false, "nop"),
        PduAdmission::Now("nop")
    );
    assert_eq!(s.poll_event(b), Some(Event::DeliverPdu(CmdSn(2), "text")));
    assert_eq!(s.poll_event(b), Some(Event::DeliverPdu(CmdSn(3), "logout")));
    assert_eq!(s.poll_event(b), None);
    // One held on a connection that goes is dropped with it, its CmdSN consumed.
    assert_eq!(s.admit_pdu(b, CmdSn(5), false, "gone"), PduAdmission::Held);
    let _ = s.leave(b, false);
    assert_eq!(
        s.admit_pdu(a, CmdSn(4), false, "next"),
        PduAdmission::Now("next")
    );
    assert_eq!(s.window_sn().0, CmdSn(6));
    assert_eq!(s.poll_event(a), None);
}

const RESERVED: u32 = crate::pdu::RESERVED_TAG;

#[test]
fn a_cmdsn_reused_on_another_connection_is_ignored() {
    let (mut s, ids) = session(&[1, 2]);
    assert_eq!(
        s.admit_command(ids[0], &cmd(1, 0), 0, || 0),
        Admission::Deliver
    );
    assert_eq!(
        s.admit_command(ids[1], &cmd(2, 0), 0, || 0),
        Admission::Ignore(Ignored::BelowWindow)
    );
    assert_eq!(
        s.admit_command(ids[1], &cmd(3, 2), 0, || 0),
        Admission::Held
    );
    assert_eq!(
        s.admit_command(ids[0], &cmd(4, 2), 0, || 0),
        Admission::Ignore(Ignored::Duplicate)
    );
    assert!(s.task(Itt(2)).is_none() && s.task(Itt(4)).is_none());
}

#[test]
fn a_flood_of_early_cmdsns_is_bounded_by_the_window() {
    let mut s = S::new(CmdSn(0), 16, 2, 0);
    let a = s.join(Cid(1), "a", 0).unwrap().id;
    for i in 1..1000u32 {
        let _ = s.admit_command(a, &cmd(i, i), 0, || i);
    }
    assert_eq!(s.held(), 15);
    assert_eq!(s.tasks().count(), 15);
}

#[test]
fn held_non_task_pdus_are_delivered_in_order() {
    let (mut s, ids) = session(&[1, 2]);
    let (a, b) = (ids[0], ids[1]);
    assert_eq!(s.admit_pdu(b, CmdSn(1), false, ()), PduAdmission::Held);
    assert_eq!(s.admit_pdu(b, CmdSn(7), true, ()), PduAdmission::Now(()));
    assert_eq!(s.admit_command(a, &cmd(1, 0), 0, || 0), Admission::Deliver);
    assert_eq!(events(&mut s, b), vec![Event::DeliverPdu(CmdSn(1), ())]);
    // The PDU took no slot.
    assert_eq!(s.in_flight(), 1);
    assert_eq!(s.window_sn().0, CmdSn(2));
}

#[test]
fn aborting_a_held_task_consumes_its_cmdsn_and_tells_its_connection() {
    let (mut s, ids) = session(&[1, 2]);
    let (a, b) = (ids[0], ids[1]);
    s.admit_command(b, &cmd(5, 1), 0, || 5);
    let tmf = TaskMgmtRequest {
        function: TmfFunction::ABORT_TASK,
        immediate: true,
        referenced_task_tag: Itt(5),
        cmd_sn: CmdSn(2),
        ..Default::default()
    };
    let out = s.task_management(&tmf, true);
    assert_eq!(out.response, TmfResponseCode::COMPLETE);
    assert_eq!(out.aborted.len(), 1);
    assert_eq!(events(&mut s, b), vec![Event::Drop(Itt(5))]);
    s.admit_command(a, &cmd(6, 0), 0, || 6);
    assert_eq!(s.window_sn().0, CmdSn(2), "CmdSN 1 counts as received");
    assert_eq!(
        events(&mut s, b),
        vec![],
        "nothing delivered for the aborted task"
    );
    assert_eq!(s.in_flight(), 1);
}

#[test]
fn abort_task_of_a_command_never_received_consumes_its_cmdsn() {
    let (mut s, ids) = session(&[1]);
    let tmf = TaskMgmtRequest {
        function: TmfFunction::ABORT_TASK,
        immediate: true,
        referenced_task_tag: Itt(9),
        ref_cmd_sn: CmdSn(0),
        cmd_sn: CmdSn(1),
        ..Default::default()
    };
    assert_eq!(
        s.task_management(&tmf, true).response,
        TmfResponseCode::COMPLETE
    );
    // The command arrives late: it is a duplicate now and never runs.
    assert_eq!(
        s.admit_command(ids[0], &cmd(9, 0), 0, || 9),
        Admission::Ignore(Ignored::BelowWindow)
    );
    // A command that completed long ago does not exist.
    let tmf = TaskMgmtRequest {
        ref_cmd_sn: CmdSn(0),
        cmd_sn: CmdSn(1),
        ..tmf
    };
    assert_eq!(
        s.task_management(&tmf, true).response,
        TmfResponseCode::TASK_DOES_NOT_EXIST
    );
}

#[test]
fn task_set_functions_need_a_lun_and_reach_every_connection() {
    let (mut s, ids) = session(&[1, 2]);
    s.admit_command(ids[0], &cmd(1, 0), 0, || 1);
    s.admit_command(ids[1], &cmd(2, 1), 0, || 2);
    s.admit_command(ids[1], &cmd(3, 2), 3, || 3);
    let mut tmf = TaskMgmtRequest {
        function: TmfFunction::LOGICAL_UNIT_RESET,
        immediate: true,
        lun: Lun::from_number(0),
        ..Default::default()
    };
    assert_eq!(
        s.task_management(&tmf, false).response,
        TmfResponseCode::LUN_DOES_NOT_EXIST
    );
    let out = s.task_management(&tmf, true);
    assert_eq!(out.scope, TmfScope::Lun(0));
    let mut itts: Vec<u32> = out.aborted.iter().map(|(i, _)| i.0).collect();
    itts.sort();
    assert_eq!(itts, vec![1, 2]);
    assert!(s.task(Itt(3)).is_some());
    tmf.function = TmfFunction::TASK_REASSIGN;
    assert_eq!(
        s.task_management(&tmf, true).response,
        TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED
    );
    tmf.function = TmfFunction(99);
    assert_eq!(
        s.task_management(&tmf, true).response,
        TmfResponseCode::REJECTED
    );
}

#[test]
fn joining_obeys_max_connections_and_a_known_cid_reinstates() {
    let mut s = S::new(CmdSn(0), 8, 2, 0);
    let a = s.join(Cid(1), "a", 0).unwrap().id;
    s.join(Cid(2), "b", 0).unwrap();
    assert_eq!(
        s.join(Cid(3), "c", 0).unwrap_err(),
        LoginStatus::TOO_MANY_CONNECTIONS
    );
    s.admit_command(a, &cmd(1, 0), 0, || 1);
    s.admit_command(a, &cmd(2, 2), 0, || 2);
    // CID 1 again: connection reinstatement replaces it and terminates its tasks.
    let j = s.join(Cid(1), "a2", 0).unwrap();
    let (old, terminated) = j.replaced.expect("replaces");
    assert_eq!((old.id, old.payload), (a, "a"));
    assert_eq!(terminated.len(), 2);
    assert_eq!(s.conns().len(), 2);
    // The old connection's leaving later changes nothing.
    let left = s.leave(a, true);
    assert!(left.terminated.is_empty() && left.session_ended.is_none());
    // Its held CmdSN 2 is consumed: CmdSN 1 releases past it.
    s.admit_command(j.id, &cmd(3, 1), 0, || 3);
    assert_eq!(s.window_sn().0, CmdSn(3));
}

#[test]
fn a_failed_connection_ends_the_session_at_erl_0() {
    let (mut s, ids) = session(&[1, 2]);
    s.admit_command(ids[1], &cmd(1, 0), 0, || 1);
    let left = s.leave(ids[0], true);
    let others = left.session_ended.expect("session recovery");
    assert_eq!(others.len(), 1);
    assert_eq!(left.terminated.len(), 1, "every task of the session ends");
    assert!(s.is_ended());
    assert_eq!(
        s.join(Cid(3), "x", 0).unwrap_err(),
        LoginStatus::SESSION_DOES_NOT_EXIST
    );
    assert_eq!(
        s.admit_command(ids[1], &cmd(2, 1), 0, || 2),
        Admission::Ended
    );
}

#[test]
fn a_clean_leave_keeps_the_session_until_the_last_connection() {
    let (mut s, ids) = session(&[1, 2]);
    assert!(s.leave(ids[0], false).session_ended.is_none());
    assert!(!s.is_ended());
    assert!(s.leave(ids[1], false).session_ended.is_some());
    assert!(s.is_ended());
}

#[test]
fn logout_closes_the_named_connection_from_any_connection() {
    let (mut s, ids) = session(&[1, 2]);
    s.admit_command(ids[1], &cmd(1, 0), 0, || 1);
    let req = |reason, cid| LogoutRequest {
        reason,
        cid: Cid(cid),
        ..Default::default()
    };
    assert!(matches!(
        s.logout(ids[0], &req(LogoutReason::CLOSE_CONNECTION, 9)),
        LogoutPlan::Respond(LogoutResponseCode::CID_NOT_FOUND)
    ));
    assert!(matches!(
        s.logout(ids[0], &req(LogoutReason::CLOSE_CONNECTION, 1)),
        LogoutPlan::CloseConnection
    ));
    match s.logout(ids[0], &req(LogoutReason::CLOSE_CONNECTION, 2)) {
        LogoutPlan::CloseOther { slot, terminated } => {
            assert_eq!(slot.id, ids[1]);
            assert_eq!(terminated.len(), 1);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.conns().len(), 1);
    assert!(!s.is_ended());
    assert!(matches!(
        s.logout(
            ids[0],
            &req(LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 1)
        ),
        LogoutPlan::Respond(LogoutResponseCode::RECOVERY_NOT_SUPPORTED)
    ));
    assert!(matches!(
        s.logout(ids[0], &req(LogoutReason::CLOSE_SESSION, 1)),
        LogoutPlan::CloseSession
    ));
}

/// What a scripted initiator sends: commands spread over connections, each connection's in
/// CmdSN order (TCP keeps one connection's order), the connections interleaved arbitrarily.
#[derive(Debug, Clone)]
struct Script {
    conns: usize,
    /// For each CmdSN, the connection that carries it.
    owner: Vec<usize>,
    /// Which connection sends next, as indexes taken modulo the connections still sending.
    order: Vec<usize>,
    /// CmdSNs sent twice (a stale duplicate after the first).
    dups: Vec<usize>,
    /// How many commands SCSI may hold before it completes the oldest.
    scsi_depth: usize,
}

fn script() -> impl Strategy<Value = Script> {
    (1usize..=4, 1usize..60).prop_flat_map(|(conns, n)| {
        (
            Just(conns),
            proptest::collection::vec(0..conns, n),
            proptest::collection::vec(0usize..64, n * 2),
            proptest::collection::vec(0..n, 0..4),
            1usize..8,
        )
            .prop_map(|(conns, owner, order, dups, scsi_depth)| Script {
                conns,
                owner,
                order,
                dups,
                scsi_depth,
            })
    })
}

proptest! {
    /// For any interleaving of N connections' PDUs, SCSI receives each command exactly once,
    /// in CmdSN order, and each is due on the connection it came on (where its response goes).
    #[test]
    fn delivers_every_command_once_in_cmdsn_order_on_its_own_connection(sc in script()) {
        let mut s = S::new(CmdSn(1000), 16, 4, 0);
        let ids: Vec<ConnId> = (0..sc.conns)
            .map(|i| s.join(Cid(i as u16), "c", 0).unwrap().id)
            .collect();
        // Per connection, the CmdSNs it carries, in order, with duplicates appended.
        let mut queues: Vec<std::collections::VecDeque<u32>> = vec![Default::default(); sc.conns];
        for (sn, &c) in sc.owner.iter().enumerate() {
            queues[c].push_back(sn as u32);
            if sc.dups.contains(&sn) {
                queues[c].push_back(sn as u32);
            }
        }
        let mut delivered: Vec<(u32, usize)> = Vec::new();
        let mut running: std::collections::VecDeque<Itt> = Default::default();
        let mut step = 0;
        let max_sn = |s: &S| s.window_sn().1;
        loop {
            let live: Vec<usize> = (0..sc.conns).filter(|&c| !queues[c].is_empty()).collect();
            if live.is_empty() {
                break;
            }
            // A sender sends only inside the window it was given (MaxCmdSN).
            let pick = sc.order.get(step).copied().unwrap_or(step);
            step += 1;
            let mut c = live[pick % live.len()];
            let mut tries = 0;
            while queues[c].front().is_some_and(|&sn| CmdSn(1000 + sn).gt(max_sn(&s))) {
                tries += 1;
                if tries > live.len() {
                    break;
                }
                c = live[(pick + tries) % live.len()];
            }
            if tries > live.len() {
                // Everyone waits for the window: SCSI completes the oldest.
                let itt = running.pop_front().expect("something runs when the window is full");
                prop_assert!(s.remove(itt).is_some());
                continue;
            }
            let sn = queues[c].pop_front().expect("live");
            let a = s.admit_command(ids[c], &cmd(sn, 1000 + sn), 0, || sn);
            // What this step delivers: the command itself and what it released, each on its
            // own connection's queue. Sorted by CmdSN, the steps must add up to 0, 1, 2, ...:
            // nothing is delivered before every command ahead of it is.
            let mut step_delivered = Vec::new();
            if a == Admission::Deliver {
                step_delivered.push((sn, c));
            }
            s.take_wakeups(ids[c], |_| {});
            for (i, &id) in ids.iter().enumerate() {
                while let Some(e) = s.poll_event(id) {
                    match e {
                        Event::Deliver(itt) => {
                            prop_assert_eq!(s.task(itt).map(|t| t.conn), Some(id));
                            prop_assert_eq!(sc.owner[itt.0 as usize], i);
                            step_delivered.push((itt.0, i));
                        }
                        other => prop_assert!(false, "unexpected {:?}", other),
                    }
                }
            }
            step_delivered.sort();
            for &(sn, c) in &step_delivered {
                prop_assert_eq!(sn as usize, delivered.len(), "delivered ahead of a gap");
                delivered.push((sn, c));
                running.push_back(Itt(sn));
            }
            while running.len() > sc.scsi_depth {
                let itt = running.pop_front().expect("non-empty");
                prop_assert!(s.remove(itt).is_some());
            }
        }
        let sns: Vec<u32> = delivered.iter().map(|d| d.0).collect();
        prop_assert_eq!(sns, (0..sc.owner.len() as u32).collect::<Vec<_>>());
        for (sn, c) in delivered {
            prop_assert_eq!(sc.owner[sn as usize], c);
        }
        prop_assert_eq!(s.held(), 0);
    }
}

// ---------------------------------------------------------------------------------------
// Connection recovery (ErrorRecoveryLevel 2)
// ---------------------------------------------------------------------------------------

fn level2(conns: &[u16], retain_ms: u64) -> (S, Vec<ConnId>) {
    let mut s = S::new(CmdSn(0), 64, 4, 2);
    s.set_retention(retain_ms);
    let ids = conns
        .iter()
        .map(|&cid| s.join(Cid(cid), "c", 0).expect("joins").id)
        .collect();
    (s, ids)
}

fn tmf_reassign(itt: u32) -> TaskMgmtRequest {
    TaskMgmtRequest {
        immediate: true,
        function: TmfFunction::TASK_REASSIGN,
        referenced_task_tag: Itt(itt),
        ..Default::default()
    }
}

fn logout(reason: LogoutReason, cid: u16) -> LogoutRequest {
    LogoutRequest {
        immediate: true,
        reason,
        cid: Cid(cid),
        ..Default::default()
    }
}

#[test]
fn below_level_2_reassignment_and_recovery_logout_are_not_supported() {
    let (mut s, ids) = session(&[1, 2]);
    assert_eq!(s.reassign(ids[1], Itt(5)), Reassign::NotSupported);
    let out = s.task_management(&tmf_reassign(5), true);
    assert_eq!(out.response, TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED);
    assert!(matches!(
        s.logout(
            ids[0],
            &logout(LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 2)
        ),
        LogoutPlan::Respond(LogoutResponseCode::RECOVERY_NOT_SUPPORTED)
    ));
}

#[test]
fn a_failed_connections_tasks_wait_for_reassignment_then_expire() {
    let (mut s, ids) = level2(&[1, 2], 5_000);
    let (a, b) = (ids[0], ids[1]);
    assert_eq!(
        s.admit_command(a, &cmd(10, 0), 0, || 10),
        Admission::Deliver
    );
    assert_eq!(
        s.admit_command(a, &cmd(11, 1), 0, || 11),
        Admission::Deliver
    );
    // Still in the session: still allegiant.
    assert_eq!(s.reassign(b, Itt(10)), Reassign::StillAllegiant);
    assert_eq!(s.reassign(a, Itt(10)), Reassign::StillAllegiant);
    let left = s.leave_for_recovery(a, 1_000);
    assert!(left.terminated.is_empty() && left.session_ended.is_none());
    assert_eq!(
        s.failed(),
        &[Failed {
            id: a,
            cid: Cid(1),
            until: 6_000
        }]
    );
    assert_eq!(s.next_expiry(), Some(6_000));
    assert_eq!(s.reassign(b, Itt(10)), Reassign::Moved { from: a });
    assert_eq!(s.task(Itt(10)).map(|t| t.conn), Some(b));
    // Moved once: now allegiant to a live connection.
    assert_eq!(s.reassign(b, Itt(10)), Reassign::StillAllegiant);
    assert_eq!(s.reassign(b, Itt(99)), Reassign::Unknown);
    // Nothing expires early.
    let e = s.expire(5_999);
    assert!(e.conns.is_empty() && e.terminated.is_empty());
    let e = s.expire(6_000);
    assert_eq!(e.conns, vec![a]);
    let gone: Vec<Itt> = e.terminated.iter().map(|(i, _)| *i).collect();
    assert_eq!(gone, vec![Itt(11)], "the task not reassigned is terminated");
    assert!(e.session_ended.is_none());
    assert!(s.task(Itt(10)).is_some(), "the reassigned task lives on");
    assert_eq!(s.reassign(b, Itt(11)), Reassign::Unknown);
    assert_eq!(s.next_expiry(), None);
}

#[test]
fn a_session_whose_connections_all_failed_waits_for_a_new_one() {
    let (mut s, ids) = level2(&[1], 2_000);
    let a = ids[0];
    assert_eq!(
        s.admit_command(a, &cmd(10, 0), 0, || 10),
        Admission::Deliver
    );
    // CmdSN 2 ahead of a gap: held, then terminated with the connection.
    assert_eq!(s.admit_command(a, &cmd(12, 2), 0, || 12), Admission::Held);
    let left = s.leave_for_recovery(a, 0);
    let held: Vec<Itt> = left.terminated.iter().map(|(i, _)| *i).collect();
    assert_eq!(held, vec![Itt(12)]);
    assert!(left.session_ended.is_none(), "the session waits");
    assert!(!s.is_ended());
    // A new connection joins (the same CID: the failed one is gone already) and takes it.
    let b = s.join(Cid(1), "b", 500).expect("joins").id;
    assert_eq!(s.reassign(b, Itt(10)), Reassign::Moved { from: a });
    assert_eq!(s.reassign(b, Itt(12)), Reassign::Unknown);
    // CmdSN 2 counts as not received: 1 fills the gap, and the initiator's retry of the
    // held command with its CmdSN (RFC 7143 §6.2.1) is delivered.
    assert_eq!(
        s.admit_command(b, &cmd(13, 1), 0, || 13),
        Admission::Deliver
    );
    assert_eq!(s.window_sn().0, CmdSn(2));
    assert_eq!(
        s.admit_command(b, &cmd(12, 2), 0, || 12),
        Admission::Deliver
    );
    assert_eq!(s.window_sn().0, CmdSn(3));
    let e = s.expire(2_000);
    assert_eq!(e.conns, vec![a]);
    assert!(e.terminated.is_empty() && e.session_ended.is_none());
}

#[test]
fn with_nothing_reassigned_the_session_ends_at_expiry() {
    let (mut s, ids) = level2(&[1], 2_000);
    assert_eq!(
        s.admit_command(ids[0], &cmd(10, 0), 0, || 10),
        Admission::Deliver
    );
    assert!(s.leave_for_recovery(ids[0], 100).session_ended.is_none());
    let e = s.expire(2_100);
    assert_eq!(e.terminated.len(), 1);
    assert!(e.session_ended.is_some());
    assert!(s.is_ended());
    assert_eq!(
        s.join(Cid(1), "late", 2_200).unwrap_err(),
        LoginStatus::SESSION_DOES_NOT_EXIST
    );
}

#[test]
fn no_retention_means_level_0_behaviour() {
    let (mut s, ids) = level2(&[1, 2], 0);
    assert_eq!(
        s.admit_command(ids[0], &cmd(10, 0), 0, || 10),
        Admission::Deliver
    );
    let left = s.leave_for_recovery(ids[0], 0);
    assert_eq!(left.terminated.len(), 1);
    assert!(s.failed().is_empty());
}

#[test]
fn reinstating_a_connection_at_level_2_keeps_its_tasks() {
    let (mut s, ids) = level2(&[1, 2], 1_000);
    assert_eq!(
        s.admit_command(ids[0], &cmd(10, 0), 0, || 10),
        Admission::Deliver
    );
    let j = s.join(Cid(1), "again", 50).expect("joins");
    let (old, terminated) = j.replaced.expect("replaced");
    assert_eq!(old.id, ids[0]);
    assert!(terminated.is_empty());
    assert_eq!(s.reassign(j.id, Itt(10)), Reassign::Moved { from: ids[0] });
}

#[test]
fn logout_for_recovery_names_a_connection() {
    let (mut s, ids) = level2(&[1, 2], 1_000);
    let (a, b) = (ids[0], ids[1]);
    let r = LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY;
    assert!(matches!(
        s.logout(a, &logout(r, 1)),
        LogoutPlan::RecoverSelf
    ));
    assert!(matches!(s.logout(a, &logout(r, 2)), LogoutPlan::RecoverOther(x) if x == b));
    assert!(matches!(
        s.logout(a, &logout(r, 9)),
        LogoutPlan::Respond(LogoutResponseCode::CID_NOT_FOUND)
    ));
    s.leave_for_recovery(b, 0);
    assert!(matches!(
        s.logout(a, &logout(r, 2)),
        LogoutPlan::Respond(LogoutResponseCode::CLOSED)
    ));
    // Closing the session lets go of what waits for reassignment.
    assert!(matches!(
        s.logout(a, &logout(LogoutReason::CLOSE_SESSION, 1)),
        LogoutPlan::CloseSession
    ));
    assert!(s.failed().is_empty());
    assert!(s.leave(a, false).session_ended.is_some());
}

proptest! {
    /// Commands spread over two connections; connection A fails after any prefix of them,
    /// and a TASK REASSIGN for every command follows on B at any time before, at or after
    /// the deadline. Every delivered task is either moved exactly once (and then completes
    /// once) or terminated exactly once at expiry; a held one is terminated at the failure;
    /// nothing stays past the deadline; no task is both completed and terminated.
    #[test]
    fn every_task_ends_exactly_once_whatever_the_cut(
        on_a in proptest::collection::vec(any::<bool>(), 1..12),
        gap in any::<bool>(),
        cut in 0usize..12,
        late in 0u64..3,
    ) {
        let (mut s, ids) = level2(&[1, 2], 1_000);
        let (a, b) = (ids[0], ids[1]);
        let n = on_a.len();
        let cut = cut.min(n);
        let mut ends: std::collections::HashMap<u32, u32> = Default::default();
        let mut admitted = Vec::new();
        for (i, &here) in on_a.iter().enumerate().take(cut) {
            // With `gap`, CmdSN 0 is skipped until after the cut: everything is held.
            let sn = if gap { i as u32 + 1 } else { i as u32 };
            let c = if here { a } else { b };
            let adm = s.admit_command(c, &cmd(100 + i as u32, sn), 0, || 100 + i as u32);
            prop_assert!(matches!(adm, Admission::Deliver | Admission::Held));
            admitted.push((100 + i as u32, here));
        }
        let left = s.leave_for_recovery(a, 0);
        for (itt, _) in &left.terminated {
            *ends.entry(itt.0).or_default() += 1;
        }
        let now = [500u64, 1_000, 1_500][late as usize];
        let e = s.expire(now);
        for (itt, _) in &e.terminated {
            *ends.entry(itt.0).or_default() += 1;
        }
        for &(itt, here) in &admitted {
            match s.reassign(b, Itt(itt)) {
                Reassign::Moved { from } => {
                    prop_assert!(here);
                    prop_assert_eq!(from, a);
                    prop_assert!(now < 1_000, "moved after its deadline");
                    prop_assert!(s.remove(Itt(itt)).is_some());
                    *ends.entry(itt).or_default() += 1;
                }
                Reassign::StillAllegiant => prop_assert!(!here),
                Reassign::Unknown => prop_assert!(ends.contains_key(&itt)),
                Reassign::NotSupported => prop_assert!(false),
            }
        }
        // Past the deadline nothing of A is kept.
        let e = s.expire(2_000);
        for (itt, _) in &e.terminated {
            *ends.entry(itt.0).or_default() += 1;
        }
        prop_assert!(s.failed().is_empty());
        prop_assert!(s.tasks().all(|(_, t)| t.conn == b));
        for &(itt, here) in &admitted {
            let n = ends.get(&itt).copied().unwrap_or(0);
            if here {
                prop_assert_eq!(n, 1, "task {} of A ended {} times", itt, n);
            } else {
                prop_assert_eq!(n, 0);
            }
        }
    }
}
