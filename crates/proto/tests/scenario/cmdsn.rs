//! CmdSN ordering across the connections of a session (RFC 7143 §3.2.2.1, §4.2.2.1) and the
//! window: held commands and held non-task PDUs, duplicates, floods, immediate PDUs.

use crate::pair::{pattern, Cmd, Pair, Tmf};
use crate::target::{Params, GOOD};
use ironsan_proto::pdu::{Header, Itt, TmfFunction, TmfResponseCode};
use ironsan_proto::window::Ignored;
use ironsan_proto::CmdSn;

/// The (ExpCmdSN, MaxCmdSN) of the SCSI status of `itt` as received on `cid`.
fn status_window(p: &Pair, cid: u16, itt: Itt) -> (CmdSn, CmdSn) {
    p.init
        .conn(cid)
        .received
        .iter()
        .find_map(|r| match &r.header {
            Header::ScsiResponse(s) if s.itt == itt => Some((s.sn.exp_cmd_sn, s.sn.max_cmd_sn)),
            Header::DataIn(d) if d.itt == itt && d.status.is_some() => {
                Some((d.sn.exp_cmd_sn, d.sn.max_cmd_sn))
            }
            _ => None,
        })
        .expect("a status")
}

/// §3.2.2.1: commands are delivered in CmdSN order across the session's connections; one
/// that arrives ahead of a gap waits; each is answered on the connection it came on
/// (§3.2.2.? connection allegiance).
#[test]
fn commands_out_of_cmd_sn_order_across_connections_run_in_cmd_sn_order() {
    let mut p = Pair::new(Params::default(), &[1, 2]);
    // CmdSN 1 on connection 1, CmdSN 2 and 3 on connection 2, the same blocks.
    let a = p.write(1, 8, pattern(1, 4096));
    let b = p.write(2, 8, pattern(2, 4096));
    let c = p.read(2, 8, 8);
    // A write held behind the gap with more data than its immediate data: no R2T yet.
    let d = p.write(2, 100, pattern(4, 16384));
    p.deliver_to_target(2);
    assert_eq!(p.target.held(), 3, "CmdSN 2, 3, 4 wait for 1");
    assert!(p.target.executed.is_empty());
    assert_eq!(p.in_transit(2), (0, 0), "nothing is answered, no R2T sent");
    p.deliver_to_target(1);
    assert_eq!(p.target.executed, vec![a, b, c], "CmdSN order");
    assert_eq!(p.target.held(), 0);
    p.run();
    assert_eq!(p.target.executed, vec![a, b, c, d]);
    for itt in [a, b, c, d] {
        assert_eq!(p.task(itt).statuses, vec![GOOD]);
    }
    assert_eq!(p.init.task_pdus_on(1, a), 1);
    assert_eq!(p.init.task_pdus_on(2, a), 0);
    assert!(p.init.task_pdus_on(2, b) == 1 && p.init.task_pdus_on(1, b) == 0);
    assert!(p.init.task_pdus_on(1, c) == 0 && p.init.task_pdus_on(1, d) == 0);
    // The read ran after both writes.
    assert_eq!(p.task(c).read_data, pattern(2, 4096));
    assert_eq!(p.disk(100, 32), &pattern(4, 16384)[..]);
    // ExpCmdSN advances with each status.
    // ExpCmdSN in the responses: A's admission filled the gap, so CmdSN 2-4 were received
    // before A's status left.
    assert_eq!(status_window(&p, 1, a).0, CmdSn(5));
    assert_eq!(status_window(&p, 2, d).0, CmdSn(5));
    let t = p.tur(1);
    p.run();
    assert_eq!(status_window(&p, 1, t).0, CmdSn(6), "ExpCmdSN advances");
}

/// §4.2.2.1: a CmdSN below ExpCmdSN (a duplicate) or one already held is silently ignored.
#[test]
fn a_reused_cmd_sn_is_ignored() {
    let mut p = Pair::new(Params::default(), &[1, 2]);
    let a = p.write(1, 0, pattern(1, 512));
    p.run();
    assert_eq!(p.task(a).statuses, vec![GOOD]);
    // CmdSN 1 again, with another tag: below the window.
    let dup = p.command(1, Cmd::write(0, pattern(9, 512)).with_sn(CmdSn(1)));
    p.run();
    assert_eq!(p.target.ignored, vec![(dup, Ignored::BelowWindow)]);
    assert!(p.task(dup).statuses.is_empty());
    assert_eq!(p.disk(0, 1), &pattern(1, 512)[..]);
    // CmdSN 3 is held (2 is missing); another CmdSN 3 on the other connection is a duplicate.
    let third = p.command(2, Cmd::tur().with_sn(CmdSn(3)));
    p.run();
    let dup3 = p.command(1, Cmd::tur().with_sn(CmdSn(3)));
    p.run();
    assert_eq!(p.target.ignored[1], (dup3, Ignored::Duplicate));
    let second = p.command(1, Cmd::tur().with_sn(CmdSn(2)));
    p.run();
    assert_eq!(p.target.executed, vec![a, second, third]);
}

/// §4.2.2.1: MaxCmdSN bounds what the target takes: a flood beyond it is ignored, and the
/// window reopens as commands complete (MaxCmdSN = ExpCmdSN + depth - 1 - in flight).
#[test]
fn a_flood_beyond_max_cmd_sn_is_bounded_by_the_window() {
    let params = Params {
        depth: 4,
        ..Params::default()
    };
    let mut p = Pair::new(params, &[1]);
    p.target.defer = true;
    let tags: Vec<Itt> = (0..8).map(|_| p.command(1, Cmd::tur())).collect();
    p.run();
    assert_eq!(p.target.running.len(), 4);
    let ignored: Vec<Itt> = p.target.ignored.iter().map(|(i, _)| *i).collect();
    assert_eq!(ignored, tags[4..].to_vec());
    assert!(p
        .target
        .ignored
        .iter()
        .all(|(_, w)| *w == Ignored::AboveWindow));
    assert_eq!(
        p.target.window(),
        (CmdSn(5), CmdSn(4)),
        "closed: MaxCmdSN = ExpCmdSN - 1"
    );
    p.complete_all();
    p.run();
    let windows: Vec<(CmdSn, CmdSn)> = tags[..4].iter().map(|t| status_window(&p, 1, *t)).collect();
    assert_eq!(
        windows,
        vec![
            (CmdSn(5), CmdSn(5)),
            (CmdSn(5), CmdSn(6)),
            (CmdSn(5), CmdSn(7)),
            (CmdSn(5), CmdSn(8))
        ],
        "MaxCmdSN advances as the window reopens"
    );
    // The initiator sends the ignored ones again, with their CmdSNs.
    for (i, t) in tags[4..].iter().enumerate() {
        p.command(1, Cmd::tur().with_sn(CmdSn(5 + i as u32)).with_itt(*t));
    }
    p.run();
    assert_eq!(p.target.running.len(), 4);
    p.complete_all();
    p.run();
    assert!(tags.iter().all(|t| p.task(*t).statuses == vec![GOOD]));
}

/// §3.2.2.1: a NOP-Out with a task tag and a task management request that are not immediate
/// take their place in CmdSN order like commands: held behind a gap, acted on when it fills.
#[test]
fn held_nop_out_and_tmf_take_their_place_in_cmd_sn_order() {
    let mut p = Pair::new(Params::default(), &[1, 2]);
    p.target.defer = true;
    let a = p.write(1, 16, pattern(3, 1024)); // CmdSN 1
    let nop = p.nop(2, false); // CmdSN 2
    let abort = p.tmf(
        2,
        Tmf {
            function: TmfFunction::ABORT_TASK,
            rtt: a,
            ref_cmd_sn: CmdSn(1),
            immediate: false,
            ..Tmf::default()
        },
    ); // CmdSN 3
    let b = p.read(1, 16, 2); // CmdSN 4
    p.deliver_to_target(2);
    assert_eq!(p.target.held(), 2);
    assert_eq!(p.in_transit(2), (0, 0), "no NOP-In, no TMF response yet");
    p.deliver_to_target(1);
    // A runs, then the NOP-In, then the abort of A, then B.
    assert_eq!(p.target.held(), 0);
    assert!(
        !p.target.has_task(a),
        "aborted in CmdSN order, before B was delivered"
    );
    let order: Vec<bool> = p
        .peek_to_initiator(2)
        .iter()
        .map(|h| matches!(h, Header::NopIn(_)))
        .collect();
    assert_eq!(
        order,
        vec![true, false],
        "the NOP-In, then the TMF response"
    );
    p.complete_all();
    p.run();
    assert_eq!(p.init.nop_ins(2, nop), 1);
    assert_eq!(
        p.init.tmf_response(2, abort),
        Some(TmfResponseCode::COMPLETE)
    );
    assert!(
        p.task(a).statuses.is_empty(),
        "an aborted task sends no status"
    );
    assert_eq!(p.task(b).statuses, vec![GOOD]);
    assert_eq!(p.target.executed, vec![b]);
    assert_ne!(
        p.disk(16, 2),
        &pattern(3, 1024)[..],
        "the aborted write never landed"
    );
    assert_eq!(p.target.window().0, CmdSn(5));
}

/// §3.2.2.1: immediate PDUs are delivered at once, even ahead of a gap, and take no CmdSN.
#[test]
fn immediate_pdus_do_not_consume_a_cmd_sn() {
    let mut p = Pair::new(Params::default(), &[1, 2]);
    let late = p.write(1, 0, pattern(5, 512)); // CmdSN 1, not delivered yet
    let nop = p.nop(2, true); // carries CmdSN 2, not taken
    let tur = p.command(
        2,
        Cmd {
            immediate: true,
            ..Cmd::tur()
        },
    );
    p.deliver_to_target(2);
    p.deliver_to_initiator(2);
    assert_eq!(p.init.nop_ins(2, nop), 1, "answered across the gap");
    assert_eq!(p.task(tur).statuses, vec![GOOD]);
    assert_eq!(p.target.window().0, CmdSn(1), "ExpCmdSN did not move");
    assert!(p.init.windows.iter().all(|w| w.0 == CmdSn(1)));
    // CmdSN 2 is still free: the next non-immediate command takes it.
    let next = p.read(2, 0, 1);
    assert_eq!(p.task(next).cmd.cmd_sn, CmdSn(2));
    p.run();
    assert_eq!(p.target.executed, vec![tur, late, next]);
    assert_eq!(p.task(next).read_data, pattern(5, 512));
    assert_eq!(p.target.window().0, CmdSn(3));
}
