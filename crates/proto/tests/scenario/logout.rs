//! Logout (RFC 7143 §11.14, §11.15): for recovery of another connection, closing a
//! connection, and the Time2Wait / Time2Retain fields of the response.

use crate::pair::{pattern, Pair};
use crate::target::{Params, GOOD};
use ironsan_proto::pdu::{LogoutReason, LogoutResponseCode, TmfResponseCode};

fn params(erl: u8) -> Params {
    Params {
        erl,
        time2wait: 3,
        time2retain: 17,
        ..Params::default()
    }
}

/// §11.14.1 reason 2 naming another, live connection: it is closed as failed, its tasks kept
/// (§6.2.2); the response carries Time2Wait and Time2Retain (§11.15.2, §11.15.3); a TASK
/// REASSIGN then moves a running read, whose data and status come on the new connection.
#[test]
fn logout_for_recovery_of_another_connection() {
    let mut p = Pair::new(params(2), &[1, 2]);
    p.target.defer = true;
    let r = p.read(1, 32, 16);
    let w = p.write(1, 200, pattern(8, 4096));
    p.run();
    assert_eq!(p.target.running.len(), 2);
    let lo = p.logout(2, LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 1);
    p.run();
    let resp = p.init.logout_response(2, lo).expect("answered");
    assert_eq!(resp.response, LogoutResponseCode::CLOSED);
    assert_eq!((resp.time2wait, resp.time2retain), (3, 17));
    assert!(!p.is_open(1), "the named connection was closed");
    assert!(p.is_open(2));
    assert!(p.target.has_task(r) && p.target.has_task(w));
    // The write completes while its connection is gone: its status is parked.
    assert!(p.complete(w));
    for itt in [r, w] {
        let tr = p.reassign(2, itt);
        p.run();
        assert_eq!(p.init.tmf_response(2, tr), Some(TmfResponseCode::COMPLETE));
    }
    assert_eq!(
        p.task(w).statuses,
        vec![GOOD],
        "the parked status, on connection 2"
    );
    assert!(p.task(r).statuses.is_empty(), "still running");
    p.complete_all();
    p.run();
    assert_eq!(p.task(r).statuses, vec![GOOD]);
    assert_eq!(p.task(r).read_data, p.disk(32, 16));
    assert!(p.init.task_pdus_on(2, r) >= 1 && p.init.task_pdus_on(1, r) == 0);
    assert_eq!(p.disk(200, 8), &pattern(8, 4096)[..]);
}

/// §11.15.3: Time2Retain is 0 unless a connection was removed for recovery; §11.14.1: reason
/// 2 below ErrorRecoveryLevel 2 is "recovery not supported", an unknown CID "CID not found".
#[test]
fn logout_response_fields() {
    // Level 1: reason 2 is not supported.
    let mut p = Pair::new(params(1), &[1, 2]);
    let lo = p.logout(2, LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 1);
    p.run();
    let resp = p.init.logout_response(2, lo).expect("answered");
    assert_eq!(resp.response, LogoutResponseCode::RECOVERY_NOT_SUPPORTED);
    assert_eq!((resp.time2wait, resp.time2retain), (3, 0));
    assert!(p.is_open(1));

    // Level 2, a CID the session does not have.
    let mut p = Pair::new(params(2), &[1, 2]);
    let lo = p.logout(2, LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 9);
    p.run();
    let resp = p.init.logout_response(2, lo).expect("answered");
    assert_eq!(resp.response, LogoutResponseCode::CID_NOT_FOUND);
    assert_eq!(resp.time2retain, 0);

    // Level 2, DefaultTime2Retain 0: no connection recovery either.
    let mut p = Pair::new(
        Params {
            time2retain: 0,
            ..params(2)
        },
        &[1, 2],
    );
    let lo = p.logout(2, LogoutReason::REMOVE_CONNECTION_FOR_RECOVERY, 1);
    p.run();
    let resp = p.init.logout_response(2, lo).expect("answered");
    assert_eq!(resp.response, LogoutResponseCode::RECOVERY_NOT_SUPPORTED);

    // Reason 1 for the connection itself: its commands complete first, then it closes.
    let mut p = Pair::new(params(2), &[1, 2]);
    p.target.defer = true;
    let r = p.read(1, 0, 1);
    p.run();
    let lo = p.logout(1, LogoutReason::CLOSE_CONNECTION, 1);
    p.run();
    let resp = p.init.logout_response(1, lo).expect("answered");
    assert_eq!(resp.response, LogoutResponseCode::CLOSED);
    assert_eq!((resp.time2wait, resp.time2retain), (3, 0));
    assert_eq!(p.task(r).statuses, vec![GOOD], "answered before the logout");
    assert!(!p.is_open(1) && p.is_open(2));

    // Reason 1 for another connection: closed now, its tasks terminated without response.
    let mut p = Pair::new(params(2), &[1, 2]);
    p.target.defer = true;
    let r = p.read(1, 0, 1);
    p.run();
    let lo = p.logout(2, LogoutReason::CLOSE_CONNECTION, 1);
    p.run();
    let resp = p.init.logout_response(2, lo).expect("answered");
    assert_eq!(resp.response, LogoutResponseCode::CLOSED);
    assert_eq!(resp.time2retain, 0);
    assert!(!p.is_open(1));
    assert!(!p.target.has_task(r) && p.target.aborted == vec![r]);
    p.complete_all();
    p.run();
    assert!(p.task(r).statuses.is_empty());
}
