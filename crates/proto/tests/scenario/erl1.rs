//! ErrorRecoveryLevel 1: recovery within a connection (RFC 7143 §7.1.5, §7.2.1): SNACKs
//! (§11.16), recovery R2Ts for lost Data-Out (§7.8, §7.9), DataACK (§11.16.2) and ExpStatSN
//! (§4.2.2.2) releasing what the target retains.

use crate::pair::{pattern, Cmd, Pair};
use crate::target::{Params, GOOD};
use crate::wire;
use ironsan_proto::pdu::{Header, Itt, RejectReason, SnackRequest, Ttt};
use ironsan_proto::recovery::{SNACK_DATA_ACK, SNACK_DATA_R2T, SNACK_STATUS};

fn erl1() -> Params {
    Params {
        erl: 1,
        target_mrdsl: 4096,
        initiator_mrdsl: 4096,
        max_burst: 8192,
        first_burst: 4096,
        ..Params::default()
    }
}

fn snack(snack_type: u8, itt: Itt, beg_run: u32, run_length: u32) -> SnackRequest {
    SnackRequest {
        snack_type,
        itt,
        ttt: Ttt::RESERVED,
        beg_run,
        run_length,
        ..Default::default()
    }
}

/// §11.16.1: a Data SNACK asks for Data-In again; §11.16: the resent PDU is an exact
/// replica (ExpCmdSN/MaxCmdSN aside, and they have not moved here).
#[test]
fn a_lost_data_in_comes_again_byte_identical_on_a_data_snack() {
    let mut p = Pair::new(erl1(), &[1]);
    let r = p.read(1, 40, 32); // 16 KiB: 4 Data-In of 4 KiB in 2 bursts
    p.deliver_to_target(1);
    let lost = p
        .lose_to_initiator(1, |h| matches!(h, Header::DataIn(d) if d.data_sn.0 == 1))
        .expect("DataSN 1 in transit");
    p.deliver_to_initiator(1);
    assert_eq!(p.task(r).data_sns, vec![0, 2, 3]);
    assert_eq!(p.task(r).exp_data_sn().0, 1);
    p.snack(1, snack(SNACK_DATA_R2T, r, 1, 1));
    p.run();
    let again = &p.init.conn(1).received.last().expect("resent").bytes;
    assert_eq!(again, &lost, "exact replica");
    assert_eq!(p.task(r).read_data, p.disk(40, 32));
    assert_eq!(p.task(r).statuses, vec![GOOD]);
}

/// §11.16.1 Status SNACK: a status lost in transit shows as a gap in StatSN (the next status
/// is ahead of ExpStatSN) and comes again with its StatSN.
#[test]
fn a_lost_status_comes_again_on_a_status_snack() {
    let mut p = Pair::new(erl1(), &[1]);
    let w = p.write(1, 0, pattern(7, 2048));
    p.deliver_to_target(1);
    let lost = p
        .lose_to_initiator(1, |h| matches!(h, Header::ScsiResponse(_)))
        .expect("the status in transit");
    let gap = p.init.exp_stat_sn(1);
    let nop = p.nop(1, false);
    p.run();
    assert_eq!(p.init.nop_ins(1, nop), 1);
    assert_eq!(
        p.init.exp_stat_sn(1),
        gap,
        "ExpStatSN stops at the lost status"
    );
    assert!(p.task(w).statuses.is_empty());
    p.snack(1, snack(SNACK_STATUS, Itt::RESERVED, gap.0, 1));
    p.run();
    let again = &p.init.conn(1).received.last().expect("resent").bytes;
    assert_eq!(wire::without_window(again), wire::without_window(&lost));
    assert_eq!(p.task(w).statuses, vec![GOOD]);
    assert_eq!(p.init.exp_stat_sn(1), gap.plus(2), "both statuses now");
    assert_eq!(p.disk(0, 4), &pattern(7, 2048)[..]);
}

/// §7.9, §7.2.1: a Data-Out lost in the middle of a sequence shows as a DataSN gap at the
/// next one; once the sequence is over the target asks for exactly the lost range with a
/// recovery R2T (next R2TSN).
#[test]
fn a_lost_data_out_is_asked_for_again_by_a_recovery_r2t() {
    let mut p = Pair::new(erl1(), &[1]);
    let data = pattern(11, 16384);
    let w = p.command(
        1,
        Cmd {
            immediate_data: false,
            unsolicited: false,
            ..Cmd::write(200, data.clone())
        },
    );
    p.deliver_to_target(1);
    p.deliver_to_initiator(1); // R2T 0: 8 KiB at 0, answered by two Data-Out
    p.lose_to_target(1, |h| matches!(h, Header::DataOut(d) if d.data_sn.0 == 0))
        .expect("the first Data-Out");
    p.run();
    assert_eq!(
        p.task(w).r2ts,
        vec![(0, 0, 8192), (1, 0, 4096), (2, 8192, 8192)],
        "the recovery R2T asks for the lost 4 KiB before the rest"
    );
    assert_eq!(p.task(w).statuses, vec![GOOD]);
    assert_eq!(p.disk(200, 32), &data[..]);
    assert_eq!(p.target.executed, vec![w]);
}

/// §7.8: a Data-Out whose data digest fails is Rejected and asked for again the same way.
#[test]
fn a_damaged_data_out_is_rejected_and_asked_for_again() {
    let mut p = Pair::new(erl1(), &[1]);
    let data = pattern(12, 8192);
    let w = p.command(
        1,
        Cmd {
            immediate_data: false,
            unsolicited: false,
            ..Cmd::write(300, data.clone())
        },
    );
    p.deliver_to_target(1);
    p.deliver_to_initiator(1);
    p.target.damage_next_data_out = true;
    p.run();
    assert_eq!(p.init.rejects(1), vec![RejectReason::DATA_DIGEST_ERROR]);
    assert_eq!(p.task(w).r2ts, vec![(0, 0, 8192), (1, 0, 4096)]);
    assert_eq!(p.task(w).statuses, vec![GOOD]);
    assert_eq!(p.disk(300, 16), &data[..]);
}

/// §11.16.1: when the last Data-Out of a sequence is lost there is no gap to see; the
/// initiator's R2T SNACK gets the R2T again (same R2TSN), its sequence started over.
#[test]
fn a_lost_last_data_out_is_recovered_by_an_r2t_snack() {
    let mut p = Pair::new(erl1(), &[1]);
    let data = pattern(13, 8192);
    let w = p.command(
        1,
        Cmd {
            immediate_data: false,
            unsolicited: false,
            ..Cmd::write(400, data.clone())
        },
    );
    p.deliver_to_target(1);
    p.deliver_to_initiator(1);
    p.lose_to_target(1, |h| matches!(h, Header::DataOut(d) if d.final_bit))
        .expect("the last Data-Out");
    p.run();
    assert!(
        p.task(w).statuses.is_empty(),
        "the target waits for the data"
    );
    p.snack(1, snack(SNACK_DATA_R2T, w, 0, 1));
    p.run();
    assert_eq!(p.task(w).r2ts, vec![(0, 0, 8192), (0, 0, 8192)]);
    assert_eq!(p.task(w).statuses, vec![GOOD]);
    assert_eq!(p.disk(400, 16), &data[..]);
    // An R2T SNACK for an R2T never sent is refused.
    p.snack(1, snack(SNACK_DATA_R2T, w, 5, 1));
    p.run();
    assert_eq!(p.init.rejects(1), vec![RejectReason::PROTOCOL_ERROR]);
}

/// §11.16.2: a DataACK lets go of the Data-In below its BegRun; §4.2.2.2: ExpStatSN past a
/// status lets go of it and of its task's Data-In. A SNACK for either is then refused.
#[test]
fn data_ack_and_exp_stat_sn_free_what_the_target_retains() {
    let mut p = Pair::new(erl1(), &[1]);
    let conn = p.conn_id(1);
    let r = p.read(1, 0, 64); // 32 KiB: 8 Data-In in 4 bursts
    p.deliver_to_target(1);
    p.deliver_to_initiator(1);
    assert_eq!(
        p.target.retained(conn),
        (32768, 1),
        "every Data-In, one status"
    );
    // The A bit asks for a DataACK at the end of each burst but the last (§11.7.2), with the
    // task's tag as TTT (§11.7.4).
    let acks: Vec<(u32, Ttt)> = p
        .init
        .conn(1)
        .received
        .iter()
        .filter_map(|x| match &x.header {
            Header::DataIn(d) if d.ack => Some((d.data_sn.0, d.ttt)),
            _ => None,
        })
        .collect();
    assert_eq!(acks, vec![(1, Ttt(r.0)), (3, Ttt(r.0)), (5, Ttt(r.0))]);
    // The DataACK carries the ExpStatSN of before the read's status, so that it alone
    // lets go of anything.
    let before = p.task(r).cmd.exp_stat_sn;
    p.send(
        1,
        Header::SnackRequest(SnackRequest {
            snack_type: SNACK_DATA_ACK,
            ttt: Ttt(r.0),
            beg_run: 4,
            exp_stat_sn: before,
            ..Default::default()
        }),
        &[],
    );
    p.deliver_to_target(1);
    assert_eq!(p.target.retained(conn), (16384, 1), "DataSN 0-3 let go");
    // A Data SNACK for what was acknowledged is refused.
    p.send(
        1,
        Header::SnackRequest(SnackRequest {
            snack_type: SNACK_DATA_R2T,
            itt: r,
            beg_run: 0,
            run_length: 1,
            exp_stat_sn: before,
            ..Default::default()
        }),
        &[],
    );
    p.run();
    assert_eq!(p.init.rejects(1), vec![RejectReason::PROTOCOL_ERROR]);
    // The Reject took a StatSN too; a NOP-Out with the current ExpStatSN acknowledges both.
    let status_sn = p.init.exp_stat_sn(1).0 - 2;
    let nop = p.nop(1, false);
    p.run();
    assert_eq!(p.init.nop_ins(1, nop), 1);
    assert_eq!(
        p.target.retained(conn),
        (4, 1),
        "only the NOP-In's echo is left"
    );
    p.snack(1, snack(SNACK_STATUS, Itt::RESERVED, status_sn, 1));
    p.run();
    assert_eq!(p.init.rejects(1).len(), 2, "the status was acknowledged");
    assert_eq!(p.task(r).read_data, p.disk(0, 64));
    assert_eq!(p.task(r).statuses, vec![GOOD]);
}

/// §11.16: no SNACK at ErrorRecoveryLevel 0 (Reject, SNACK reject).
#[test]
fn snacks_are_rejected_at_level_0() {
    let mut p = Pair::new(Params::default(), &[1]);
    let r = p.read(1, 0, 1);
    p.run();
    p.snack(1, snack(SNACK_DATA_R2T, r, 0, 0));
    p.run();
    assert_eq!(p.init.rejects(1), vec![RejectReason::SNACK_REJECT]);
}
