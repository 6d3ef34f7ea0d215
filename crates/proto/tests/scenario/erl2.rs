//! ErrorRecoveryLevel 2: connection recovery (RFC 7143 §7.1.5, §7.2.2, §6.2.2): a connection
//! cut at any point of a read or a write, a Logout for its recovery (§11.14.1 reason 2), TASK
//! REASSIGN (§11.5.1) on a new or another existing connection; every task ends exactly once,
//! a write lands exactly once, a read's bytes resume from ExpDataSN; what nobody reassigns
//! within DefaultTime2Wait + DefaultTime2Retain is terminated (§6.2.2).

use crate::pair::{pattern, Cmd, Pair};
use crate::target::{counts, Params, GOOD};
use ironsan_proto::pdu::{Header, LogoutReason, LogoutResponseCode, TmfResponseCode};
use proptest::prelude::*;

fn erl2(immediate_data: bool, initial_r2t: bool) -> Params {
    Params {
        erl: 2,
        target_mrdsl: 4096,
        initiator_mrdsl: 4096,
        max_burst: 8192,
        first_burst: 4096,
        immediate_data,
        initial_r2t,
        time2wait: 2,
        time2retain: 20,
        ..Params::default()
    }
}

const LBA: u32 = 64;

#[derive(Clone, Copy, Debug)]
struct Case {
    write: bool,
    blocks: u16,
    /// 0: cut before the command reaches the target; 1: right after it (and its immediate
    /// and unsolicited data) arrived; n: after n - 1 target PDUs reached the initiator (each
    /// answered at once: Data-Out for an R2T).
    cut_at: usize,
    /// Commands keep running until the test completes them (the cut finds one running).
    defer: bool,
    /// Complete running commands before the TASK REASSIGN (their response is parked) or
    /// after it (it is forwarded when done).
    complete_before_reassign: bool,
    /// Log a new connection in for the recovery, or use the session's other one.
    new_login: bool,
    immediate_data: bool,
    initial_r2t: bool,
    /// The new connection's MaxRecvDataSegmentLength (resumed Data-In are refitted to it).
    new_mrdsl: u32,
}

fn run_case(c: Case) {
    let mut p = Pair::new(erl2(c.immediate_data, c.initial_r2t), &[1, 2]);
    p.target.defer = c.defer;
    let data = pattern(c.blocks as u8, usize::from(c.blocks) * 512);
    let spec = if c.write {
        Cmd::write(LBA, data.clone())
    } else {
        Cmd::read(LBA, c.blocks)
    };
    let itt = p.command(1, spec.clone());
    let cmd_sn = p.task(itt).cmd.cmd_sn;
    let expected_read = p.disk(LBA, c.blocks).to_vec();
    if c.cut_at > 0 {
        p.deliver_to_target(1);
        for _ in 1..c.cut_at {
            if !p.deliver_one_to_initiator(1) {
                break;
            }
            p.deliver_to_target(1);
        }
    }
    p.cut(1);
    assert!(!p.is_open(1));

    // Recovery, after DefaultTime2Wait (§6.2.2).
    p.advance(2000);
    let rcid = if c.new_login {
        p.login(3, c.new_mrdsl);
        3
    } else {
        2
    };
    // §7.2.2 / §11.14.1: the failed connection is logged out for recovery (the target has
    // noticed already: closed); its ExpStatSN acknowledges what the initiator got on it.
    let lo = p.logout(rcid, LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 1);
    p.run();
    let resp = p.init.logout_response(rcid, lo).expect("logout response");
    assert_eq!(resp.response, LogoutResponseCode::CLOSED);
    assert_eq!((resp.time2wait, resp.time2retain), (2, 20));
    if c.complete_before_reassign {
        p.complete_all();
        p.run();
    }
    let done_before = !p.task(itt).statuses.is_empty();
    let mut first_resumed = None;
    if !done_before {
        let exp = p.task(itt).exp_data_sn();
        let seen = p.init.conn(rcid).received.len();
        let tr = p.reassign(rcid, itt);
        p.run();
        match p.init.tmf_response(rcid, tr) {
            Some(TmfResponseCode::COMPLETE) => {
                first_resumed = p.init.conn(rcid).received[seen..]
                    .iter()
                    .find_map(|r| match &r.header {
                        Header::DataIn(d) if d.itt == itt => Some(d.data_sn),
                        _ => None,
                    })
                    .map(|sn| (exp, sn));
            }
            Some(TmfResponseCode::TASK_DOES_NOT_EXIST) => {
                // Never received (§6.2.1): retried with the same ITT and CmdSN.
                assert_eq!(c.cut_at, 0, "only a command that never arrived is unknown");
                p.command(rcid, spec.with_sn(cmd_sn).with_itt(itt));
                p.run();
            }
            other => panic!("TASK REASSIGN answered {other:?}"),
        }
        p.complete_all();
        p.run();
    }
    p.complete_all();
    p.run();

    let t = p.task(itt);
    assert_eq!(t.statuses, vec![GOOD], "the task ends exactly once");
    assert_eq!(counts(&p.target.executed).get(&itt.0), Some(&1), "ran once");
    assert!(!p.target.has_task(itt));
    if c.write {
        assert_eq!(p.disk(LBA, c.blocks), &data[..], "the write landed, whole");
    } else {
        assert_eq!(t.read_data, expected_read, "the read's bytes");
        if let Some((exp, first)) = first_resumed {
            // §11.5.1 ExpDataSN: the Data-In resume where the initiator's data stopped.
            assert_eq!(first, exp);
        }
    }
    // What reached the initiator on the failed connection and the new one adds up: no
    // Data-In or status of the task came anywhere else.
    let elsewhere = if rcid == 2 { 3 } else { 2 };
    if p.init.conns.contains_key(&elsewhere) {
        assert_eq!(p.init.task_pdus_on(elsewhere, itt), 0);
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        any::<bool>(),
        1u16..=48,
        0usize..14,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop_oneof![Just(4096u32), Just(1024u32), Just(8192u32)],
    )
        .prop_map(
            |(write, blocks, cut_at, defer, before, new_login, imm, r2t, mrdsl)| Case {
                write,
                blocks,
                cut_at,
                defer,
                complete_before_reassign: before,
                new_login,
                immediate_data: imm,
                initial_r2t: r2t,
                new_mrdsl: if new_login { mrdsl } else { 4096 },
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    /// A connection cut at any point of a read or a write, recovered on another connection.
    #[test]
    fn a_cut_connection_is_recovered_by_task_reassign(c in case()) {
        run_case(c);
    }
}

/// The interesting points, each once, as plain tests (what the property samples).
#[test]
fn every_cut_point_of_a_write_and_of_a_read() {
    for write in [false, true] {
        for defer in [false, true] {
            for cut_at in 0..10 {
                run_case(Case {
                    write,
                    blocks: 24,
                    cut_at,
                    defer,
                    complete_before_reassign: cut_at % 2 == 0,
                    new_login: cut_at % 3 == 0,
                    immediate_data: true,
                    initial_r2t: false,
                    new_mrdsl: 2048,
                });
            }
        }
    }
}

/// §6.2.2: a task not reassigned within DefaultTime2Wait + DefaultTime2Retain is
/// terminated; with no connection left the session ends with it.
#[test]
fn a_task_not_reassigned_in_time_is_dropped() {
    for other_connection in [false, true] {
        let cids: &[u16] = if other_connection { &[1, 2] } else { &[1] };
        let mut p = Pair::new(erl2(true, false), cids);
        p.target.defer = true;
        let r = p.read(1, 0, 16);
        let w = p.command(
            1,
            Cmd {
                immediate_data: false,
                unsolicited: false,
                ..Cmd::write(100, pattern(1, 8192))
            },
        );
        p.deliver_to_target(1);
        assert_eq!(
            p.target.running.len(),
            1,
            "the read runs, the write waits for data"
        );
        p.cut(1);
        assert_eq!(p.target.kept_conns(), 1);
        assert!(
            p.target.has_task(r) && p.target.has_task(w),
            "kept for reassignment"
        );
        assert_eq!(p.target.next_expiry(), Some(22_000));
        p.advance(21_999);
        assert!(p.target.has_task(r) && p.target.expired.is_empty());
        p.advance(1);
        assert!(!p.target.has_task(r) && !p.target.has_task(w));
        let mut expired = p.target.expired.clone();
        expired.sort_unstable_by_key(|i| i.0);
        assert_eq!(expired, vec![r, w]);
        assert_eq!(p.target.kept_conns(), 0);
        assert!(
            p.target.running.is_empty(),
            "the running read was terminated"
        );
        assert_eq!(p.target.session_ended, !other_connection);
        assert_ne!(p.disk(100, 16), &pattern(1, 8192)[..]);
        if other_connection {
            // Too late: the task does not exist any more (§11.5.1 response 1).
            let tr = p.reassign(2, r);
            p.run();
            assert_eq!(
                p.init.tmf_response(2, tr),
                Some(TmfResponseCode::TASK_DOES_NOT_EXIST)
            );
        }
    }
}

/// §11.5.1: TASK REASSIGN of a task still allegiant to a live connection is refused
/// (response 3); below level 2 it is not supported (response 4).
#[test]
fn task_reassign_needs_a_failed_connection_and_level_2() {
    let mut p = Pair::new(erl2(true, false), &[1, 2]);
    p.target.defer = true;
    let r = p.read(1, 0, 1);
    p.run();
    let tr = p.reassign(2, r);
    p.run();
    assert_eq!(
        p.init.tmf_response(2, tr),
        Some(TmfResponseCode::TASK_STILL_ALLEGIANT)
    );
    let mut p1 = Pair::new(
        Params {
            erl: 1,
            ..erl2(true, false)
        },
        &[1, 2],
    );
    p1.target.defer = true;
    let r = p1.read(1, 0, 1);
    p1.run();
    let tr = p1.reassign(2, r);
    p1.run();
    assert_eq!(
        p1.init.tmf_response(2, tr),
        Some(TmfResponseCode::REASSIGNMENT_NOT_SUPPORTED)
    );
    // §7.1.5: below level 2 a failed connection ends the session (session recovery).
    p1.cut(1);
    assert!(p1.target.session_ended);
    assert!(!p1.target.has_task(r));
}

/// §6.3.4: reinstating a connection (a login with the failed connection's CID) at level 2
/// keeps its tasks for reassignment, like a failure.
#[test]
fn a_reinstated_connection_keeps_its_tasks_for_reassignment() {
    let mut p = Pair::new(erl2(true, false), &[1]);
    p.target.defer = true;
    let r = p.read(1, 8, 8);
    p.deliver_to_target(1);
    // The initiator gives up on the TCP connection and logs in again with CID 1.
    p.login(1, 4096);
    assert!(p.target.has_task(r));
    let tr = p.reassign(1, r);
    p.run();
    assert_eq!(p.init.tmf_response(1, tr), Some(TmfResponseCode::COMPLETE));
    p.complete_all();
    p.run();
    assert_eq!(p.task(r).statuses, vec![GOOD]);
    assert_eq!(p.task(r).read_data, p.disk(8, 8));
}

/// §6.2.1, §7.2.2: a command held behind a CmdSN gap on a connection that fails was never
/// delivered: its CmdSN counts as not received, TASK REASSIGN finds no task, and the
/// initiator sends it again with the same CmdSN on another connection.
#[test]
fn a_command_held_on_a_failed_connection_is_retried_with_its_cmd_sn() {
    let mut p = Pair::new(erl2(true, false), &[1, 2]);
    let a = p.write(2, 0, pattern(1, 2048)); // CmdSN 1, still in transit
    let b_spec = Cmd::write(0, pattern(2, 2048));
    let b = p.command(1, b_spec.clone()); // CmdSN 2
    p.deliver_to_target(1);
    assert_eq!(p.target.held(), 1);
    p.cut(1);
    assert_eq!(p.target.held(), 0, "forgotten with the connection");
    p.run();
    assert_eq!(p.target.executed, vec![a]);
    assert_eq!(
        p.target.window().0,
        ironsan_proto::CmdSn(2),
        "CmdSN 2 not received"
    );
    let tr = p.reassign(2, b);
    p.run();
    assert_eq!(
        p.init.tmf_response(2, tr),
        Some(TmfResponseCode::TASK_DOES_NOT_EXIST)
    );
    let sn = p.task(b).cmd.cmd_sn;
    p.command(2, b_spec.with_sn(sn).with_itt(b));
    p.run();
    assert_eq!(p.target.executed, vec![a, b], "in CmdSN order, once each");
    assert_eq!(p.task(b).statuses, vec![GOOD]);
    assert_eq!(p.disk(0, 4), &pattern(2, 2048)[..]);
}
