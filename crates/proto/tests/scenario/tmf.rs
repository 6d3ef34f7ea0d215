//! Task management (RFC 7143 §11.5): ABORT TASK of a running command and of one not yet
//! received, and LOGICAL UNIT RESET across every connection of the session.

use crate::pair::{pattern, Cmd, Pair, Tmf};
use crate::target::{Params, GOOD};
use ironsan_proto::pdu::{Header, RejectReason, TmfFunction, TmfResponseCode};
use ironsan_proto::window::Ignored;
use ironsan_proto::CmdSn;

/// §11.5.1 ABORT TASK of a running command: the TMF response says COMPLETE and the task
/// never sends a status (SAM-5: an aborted task is not answered), even when the SCSI layer
/// finishes it afterwards; its window slot opens again.
#[test]
fn abort_task_of_a_running_command() {
    let mut p = Pair::new(
        Params {
            depth: 2,
            ..Params::default()
        },
        &[1],
    );
    p.target.defer = true;
    let w = p.write(1, 50, pattern(6, 2048));
    p.run();
    assert_eq!(p.target.window(), (CmdSn(2), CmdSn(2)));
    let cmd_sn = p.task(w).cmd.cmd_sn;
    let abort = p.abort_task(1, w, cmd_sn);
    p.run();
    assert_eq!(
        p.init.tmf_response(1, abort),
        Some(TmfResponseCode::COMPLETE)
    );
    assert_eq!(
        p.target.window(),
        (CmdSn(2), CmdSn(3)),
        "the slot is free again"
    );
    assert!(!p.complete(w), "no longer running");
    p.run();
    assert!(p.task(w).statuses.is_empty());
    assert_eq!(
        p.init.task_pdus_on(1, w),
        0,
        "nothing of the task after the TMF response"
    );
    assert_ne!(p.disk(50, 4), &pattern(6, 2048)[..]);
    // Aborting it again: it no longer exists.
    let again = p.abort_task(1, w, cmd_sn);
    p.run();
    assert_eq!(
        p.init.tmf_response(1, again),
        Some(TmfResponseCode::TASK_DOES_NOT_EXIST)
    );
}

/// §11.5.1: ABORT TASK of a command the target never received, with its CmdSN (RefCmdSN) in
/// the window: COMPLETE, and the CmdSN counts as received, so the command, arriving late,
/// is ignored and never runs.
#[test]
fn abort_task_of_a_command_not_yet_received_consumes_its_cmd_sn() {
    let mut p = Pair::new(Params::default(), &[1, 2]);
    let x = p.write(1, 10, pattern(2, 1024)); // CmdSN 1
    let lost = p
        .lose_to_target(1, |h| matches!(h, Header::ScsiCommand(_)))
        .expect("in transit");
    let y = p.read(2, 10, 2); // CmdSN 2: held behind the gap
    p.run();
    assert_eq!(p.target.held(), 1);
    let abort = p.abort_task(2, x, CmdSn(1));
    p.run();
    assert_eq!(
        p.init.tmf_response(2, abort),
        Some(TmfResponseCode::COMPLETE)
    );
    assert_eq!(
        p.target.window().0,
        CmdSn(3),
        "CmdSN 1 consumed, 2 released"
    );
    assert_eq!(p.task(y).statuses, vec![GOOD]);
    p.inject_to_target(1, lost);
    p.run();
    assert_eq!(p.target.ignored, vec![(x, Ignored::BelowWindow)]);
    assert_eq!(p.target.executed, vec![y]);
    assert!(p.task(x).statuses.is_empty());
    assert_ne!(p.disk(10, 2), &pattern(2, 1024)[..]);
}

/// §11.5.1 LOGICAL UNIT RESET: every task of the LU is aborted, on every connection of the
/// session (running commands, and a write waiting for Data-Out, whose later Data-Out finds
/// no task); none of them sends a status.
#[test]
fn lun_reset_aborts_tasks_on_every_connection() {
    let mut p = Pair::new(Params::default(), &[1, 2]);
    p.target.defer = true;
    p.init.auto_data_out = false;
    let r = p.read(1, 0, 4);
    let w = p.write(2, 20, pattern(4, 1024));
    let waiting = p.command(
        2,
        Cmd {
            immediate_data: false,
            unsolicited: false,
            ..Cmd::write(40, pattern(5, 4096))
        },
    );
    p.run();
    assert_eq!(p.target.running.len(), 2);
    assert_eq!(p.task(waiting).r2ts.len(), 1);
    let reset = p.tmf(
        1,
        Tmf {
            function: TmfFunction::LOGICAL_UNIT_RESET,
            ..Tmf::default()
        },
    );
    p.run();
    assert_eq!(
        p.init.tmf_response(1, reset),
        Some(TmfResponseCode::COMPLETE)
    );
    assert!([r, w, waiting].iter().all(|t| !p.target.has_task(*t)));
    assert!(p.target.running.is_empty());
    p.complete_all();
    // The initiator sends the data the R2T asked for: the write is gone from connection 2.
    let outs = p.init.data_outs(2, waiting, ttt_of(&p, waiting), 0, 4096);
    for (h, d) in outs {
        p.send(2, h, &d);
    }
    p.run();
    assert_eq!(p.init.rejects(2), vec![RejectReason::INVALID_PDU_FIELD]);
    for t in [r, w, waiting] {
        assert!(p.task(t).statuses.is_empty());
    }
    assert!(p.target.executed.is_empty());
    assert_ne!(p.disk(20, 2), &pattern(4, 1024)[..]);
    assert_ne!(p.disk(40, 8), &pattern(5, 4096)[..]);
}

/// The TTT of the R2T task `itt` received.
fn ttt_of(p: &Pair, itt: ironsan_proto::pdu::Itt) -> ironsan_proto::pdu::Ttt {
    let cid = p.task(itt).cid;
    p.init
        .conn(cid)
        .received
        .iter()
        .find_map(|r| match &r.header {
            Header::R2t(t) if t.itt == itt => Some(t.ttt),
            _ => None,
        })
        .expect("an R2T")
}
