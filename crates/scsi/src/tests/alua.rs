//! ALUA (`alua.rs`): target port groups, access states, REPORT / SET TARGET PORT GROUPS.

use super::*;

const RTPG: [u8; 12] = [0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0];

const RTPG_EXT: [u8; 12] = [0xA3, 0x2A, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0];

fn stpg_cdb(len: u32) -> [u8; 12] {
    let l = len.to_be_bytes();
    [0xA4, 0x0A, 0, 0, 0, 0, l[0], l[1], l[2], l[3], 0, 0]
}

/// A SET TARGET PORT GROUPS parameter list of (state code, group) descriptors.
fn stpg_list(d: &[(u8, u16)]) -> Vec<u8> {
    let mut v = vec![0u8; 4];
    for (s, g) in d {
        v.extend_from_slice(&[*s, 0]);
        v.extend_from_slice(&g.to_be_bytes());
    }
    v
}

/// (group id, state code, pref, status code, ports) of each RTPG descriptor after `hdr` bytes.
fn rtpg_groups(d: &[u8], hdr: usize) -> Vec<(u16, u8, bool, u8, Vec<u16>)> {
    let len = u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize;
    assert_eq!(len + 4, d.len(), "RETURN DATA LENGTH");
    let mut out = Vec::new();
    let mut o = hdr;
    while o < d.len() {
        assert_eq!(d[o + 1], 0xCF, "supported states T/O/U/S/AN/AO");
        let n = usize::from(d[o + 7]);
        let ports = (0..n)
            .map(|i| u16::from_be_bytes([d[o + 10 + 4 * i], d[o + 11 + 4 * i]]))
            .collect();
        out.push((
            u16::from_be_bytes([d[o + 2], d[o + 3]]),
            d[o] & 0x0F,
            d[o] & 0x80 != 0,
            d[o + 5],
            ports,
        ));
        o += 8 + 4 * n;
    }
    out
}

#[tokio::test]
async fn alua_inquiry_reports_tpgs_and_the_port_and_group_designators() {
    let t = alua_target();
    let d = good(&run_on(&t, 0, &nexus_at(1, 3), &[0x12, 0, 0, 0, 96, 0], &[]).await).to_vec();
    assert_eq!(d[5] & 0x30, 0x30, "TPGS = implicit and explicit");
    let d = good(&run_on(&t, 0, &nexus_at(1, 3), &[0x12, 1, 0x83, 1, 0, 0], &[]).await).to_vec();
    let mut o = 4;
    let (mut rel, mut tpg) = (None, None);
    while o + 4 <= d.len() {
        let (kind, len) = (d[o + 1] & 0x3F, usize::from(d[o + 3]));
        let v = &d[o + 4..o + 4 + len];
        match kind {
            0x14 => rel = Some(u16::from_be_bytes([v[2], v[3]])),
            0x15 => tpg = Some(u16::from_be_bytes([v[2], v[3]])),
            _ => {}
        }
        o += 4 + len;
    }
    assert_eq!(rel, Some(3), "relative target port designator");
    assert_eq!(tpg, Some(2), "target port group designator");
}

#[tokio::test]
async fn alua_report_target_port_groups_in_both_formats_and_truncated() {
    let t = alua_target();
    t.alua().set_preferred(1, true).unwrap();
    t.alua().set_transition_time(7);
    for port in [1, 2] {
        let d = good(&run_on(&t, 0, &nexus_at(1, port), &RTPG, &[]).await).to_vec();
        assert_eq!(
            rtpg_groups(&d, 4),
            vec![(1, 0, true, 0, vec![1]), (2, 0, false, 0, vec![2, 3])],
            "the same view from port {port}"
        );
    }
    let d = good(&run_on(&t, 0, &nexus_at(1, 1), &RTPG_EXT, &[]).await).to_vec();
    assert_eq!(
        (d[4], d[5]),
        (0x10, 7),
        "format type 001b, implicit transition time"
    );
    assert_eq!(rtpg_groups(&d, 8).len(), 2);
    // A tiny allocation length truncates; RETURN DATA LENGTH still counts everything.
    let mut cdb = RTPG;
    cdb[9] = 6;
    cdb[8] = 0;
    let d = good(&run_on(&t, 0, &nexus_at(1, 1), &cdb, &[]).await).to_vec();
    assert_eq!(d.len(), 6);
    assert_eq!(u32::from_be_bytes([d[0], d[1], d[2], d[3]]), 8 + 4 + 8 + 8);
    // Parameter data formats other than 000b / 001b are refused.
    let mut cdb = RTPG;
    cdb[1] = 0x4A;
    invalid_cdb_field(&run_on(&t, 0, &nexus_at(1, 1), &cdb, &[]).await, 1, Some(7));
}

/// One command of each class, and whether each state processes it.
#[tokio::test]
async fn alua_each_state_refuses_what_spc4_says_with_its_ascq() {
    let classes: [(&str, Vec<u8>, Vec<u8>); 10] = [
        ("INQUIRY", vec![0x12, 0, 0, 0, 96, 0], vec![]),
        (
            "REPORT LUNS",
            vec![0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 64, 0, 0],
            vec![],
        ),
        ("REQUEST SENSE", vec![0x03, 0, 0, 0, 18, 0], vec![]),
        ("RTPG", RTPG.to_vec(), vec![]),
        ("MODE SENSE", vec![0x1A, 0, 0x3F, 0, 255, 0], vec![]),
        (
            "READ CAPACITY",
            vec![0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            vec![],
        ),
        ("PR IN", vec![0x5E, 0, 0, 0, 0, 0, 0, 0, 64, 0], vec![]),
        ("TEST UNIT READY", vec![0, 0, 0, 0, 0, 0], vec![]),
        ("READ", vec![0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], vec![]),
        (
            "WRITE",
            vec![0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0],
            vec![0xAB; 512],
        ),
    ];
    // Which of the classes above each state processes (SPC-4 §5.15.2.4).
    let allowed = |s: AccessState, i: usize| match s {
        AccessState::ActiveOptimized | AccessState::ActiveNonOptimized => true,
        AccessState::Standby => i <= 6,
        _ => i <= 3,
    };
    for state in AccessState::ALL {
        let t = alua_target();
        t.set_access_state(2, state, None).unwrap();
        let n = nexus_at(5, 2);
        let _ = run_on(&t, 0, &n, &[0, 0, 0, 0, 0, 0], &[]).await; // the state-change UA
        for (i, (name, cdb, data)) in classes.iter().enumerate() {
            let r = run_on(&t, 0, &n, cdb, data).await;
            if allowed(state, i) {
                good(&r);
            } else {
                assert_eq!(
                    sense(&r),
                    (0x2, 0x04, state.refusal_ascq()),
                    "{name} in {state}"
                );
            }
        }
        // The other group's port is unaffected.
        good(
            &run_on(
                &t,
                0,
                &nexus_at(6, 1),
                &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0],
                &[],
            )
            .await,
        );
    }
    assert_eq!(
        [
            AccessState::Transitioning,
            AccessState::Standby,
            AccessState::Unavailable,
            AccessState::Offline
        ]
        .map(AccessState::refusal_ascq),
        [0x0A, 0x0B, 0x0C, 0x12]
    );
}

#[tokio::test]
async fn alua_set_target_port_groups_changes_states_and_tells_the_other_nexuses() {
    let t = alua_target();
    let (me, other) = (nexus_at(1, 1), nexus_at(2, 2));
    good(&run_on(&t, 0, &me, &[0, 0, 0, 0, 0, 0], &[]).await);
    good(&run_on(&t, 0, &other, &[0, 0, 0, 0, 0, 0], &[]).await);
    let list = stpg_list(&[(0x1, 1), (0x2, 2)]);
    good(&run_on(&t, 0, &me, &stpg_cdb(list.len() as u32), &list).await);
    let d = good(&run_on(&t, 0, &me, &RTPG, &[]).await).to_vec();
    assert_eq!(
        rtpg_groups(&d, 4),
        vec![(1, 1, false, 1, vec![1]), (2, 2, false, 1, vec![2, 3])],
        "states set, status code 01h (altered by SET TARGET PORT GROUPS)"
    );
    // The requester gets no unit attention; the other nexus gets 2Ah/06h once.
    good(&run_on(&t, 0, &me, &[0, 0, 0, 0, 0, 0], &[]).await);
    assert_eq!(
        sense(&run_on(&t, 0, &other, &[0, 0, 0, 0, 0, 0], &[]).await),
        (0x6, 0x2A, 0x06)
    );
    // Now in standby, port 2 refuses media access but still takes STPG back to active.
    assert_eq!(
        sense(&run_on(&t, 0, &other, &[0, 0, 0, 0, 0, 0], &[]).await),
        (0x2, 0x04, 0x0B)
    );
    let list = stpg_list(&[(0x0, 2)]);
    good(&run_on(&t, 0, &other, &stpg_cdb(list.len() as u32), &list).await);
    good(&run_on(&t, 0, &other, &[0, 0, 0, 0, 0, 0], &[]).await);
    assert_eq!(
        sense(&run_on(&t, 0, &me, &[0, 0, 0, 0, 0, 0], &[]).await),
        (0x6, 0x2A, 0x06)
    );
    // An implicit change: status code 02h and a unit attention for everyone.
    t.set_access_state(1, AccessState::Unavailable, None)
        .unwrap();
    assert_eq!(
        sense(&run_on(&t, 0, &other, &RTPG, &[]).await),
        (0x6, 0x2A, 0x06)
    );
    let d = good(&run_on(&t, 0, &other, &RTPG, &[]).await).to_vec();
    assert_eq!(rtpg_groups(&d, 4)[0], (1, 3, false, 2, vec![1]));
}

#[tokio::test]
async fn alua_bad_set_target_port_groups_lists_change_nothing() {
    let t = alua_target();
    let n = nexus_at(1, 1);
    let before = t.alua().groups();
    // Unknown group (second descriptor): field pointer at its TARGET PORT GROUP.
    let list = stpg_list(&[(0x2, 1), (0x2, 9)]);
    invalid_param_field(&run_on(&t, 0, &n, &stpg_cdb(12), &list).await, 10, None);
    // States that cannot be asked for: LBA dependent, offline, transitioning, reserved.
    for code in [0x4u8, 0xE, 0xF, 0x7] {
        let list = stpg_list(&[(0x2, 1), (code, 2)]);
        invalid_param_field(&run_on(&t, 0, &n, &stpg_cdb(12), &list).await, 8, Some(3));
    }
    // A list length that is not a header plus whole descriptors, or more than was sent.
    let list = stpg_list(&[(0x2, 1)]);
    for (len, data) in [(6u32, &list[..]), (12, &list[..]), (3, &list[..3])] {
        assert_eq!(
            sense(&run_on(&t, 0, &n, &stpg_cdb(len), data).await),
            (0x5, 0x1A, 0x00),
            "length {len}"
        );
    }
    // A wrong service action.
    let mut cdb = stpg_cdb(8);
    cdb[1] = 0x0B;
    invalid_cdb_field(&run_on(&t, 0, &n, &cdb, &list).await, 1, Some(4));
    assert_eq!(t.alua().groups(), before, "nothing changed");
    good(&run_on(&t, 0, &nexus_at(2, 2), &[0, 0, 0, 0, 0, 0], &[]).await);
}

#[tokio::test]
async fn alua_timed_transition_ends_only_if_not_overtaken() {
    let t = alua_target();
    good(&run_on(&t, 0, &nexus_at(1, 3), &[0, 0, 0, 0, 0, 0], &[]).await);
    let gen = t
        .set_access_state(2, AccessState::Transitioning, None)
        .unwrap();
    assert_eq!(
        sense(
            &run_on(
                &t,
                0,
                &nexus_at(1, 3),
                &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0],
                &[]
            )
            .await
        ),
        (0x6, 0x2A, 0x06)
    );
    assert_eq!(
        sense(
            &run_on(
                &t,
                0,
                &nexus_at(1, 3),
                &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0],
                &[]
            )
            .await
        ),
        (0x2, 0x04, 0x0A)
    );
    t.set_access_state(2, AccessState::ActiveNonOptimized, Some(gen))
        .unwrap();
    // A transition overtaken by another change does not apply its end.
    let gen = t
        .set_access_state(2, AccessState::Transitioning, None)
        .unwrap();
    t.set_access_state(2, AccessState::Standby, None).unwrap();
    assert_eq!(
        t.set_access_state(2, AccessState::ActiveOptimized, Some(gen)),
        Err(AluaError::Overtaken)
    );
    assert_eq!(t.alua().group_of(2).unwrap().state, AccessState::Standby);
}

#[tokio::test]
async fn alua_writes_are_not_placed_through_an_inaccessible_port() {
    let t = alua_target();
    let cdb = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    let n = nexus_at(1, 2);
    // RAM cannot place writes either way; the check must not open a path around the state.
    t.set_access_state(2, AccessState::Standby, None).unwrap();
    assert!(t.place_write(0, &n, &cdb, 512).is_none());
}

#[tokio::test]
async fn alua_commands_are_listed_by_report_supported_operation_codes() {
    let t = alua_target();
    for (op, sa) in [(0xA3u8, 0x0Au16), (0xA4, 0x0A)] {
        let s = sa.to_be_bytes();
        let cdb = [0xA3, 0x0C, 0x02, op, s[0], s[1], 0, 0, 1, 0, 0, 0];
        let d = good(&run(&t, &cdb).await).to_vec();
        assert_eq!(d[1] & 0x07, 0b011, "{op:02x}/{sa:02x} supported");
        assert_eq!(d[4], op);
    }
}

#[tokio::test]
async fn alua_and_pr_edge_cases_found_in_review() {
    // An ALL_TG_PT registration may not hide a per-port one of the same initiator port.
    let t = alua_target();
    register(&t, &path(1, 1), 0xA1).await;
    let mut p = prout_params(0, 0xA2, false);
    p[20] |= 0x04;
    assert_eq!(
        run_on(&t, 0, &path(1, 2), &prout(0x00, 0), &p).await.status,
        Status::RESERVATION_CONFLICT
    );
    // A timed transition taken before the layout was replaced never ends a later state.
    let t = alua_target();
    let gen = t
        .set_access_state(2, AccessState::Transitioning, None)
        .unwrap();
    t.set_port_groups(Some(vec![
        PortGroup::new(1, vec![1]),
        PortGroup::new(2, vec![2, 3]),
    ]));
    t.set_access_state(2, AccessState::Unavailable, None)
        .unwrap();
    assert_eq!(
        t.set_access_state(2, AccessState::Standby, Some(gen)),
        Err(AluaError::Overtaken)
    );
    // Configured groups: a new port outside them gets a group of its own.
    t.follow_ports(&[1, 2, 3, 7]);
    let g = t.alua().groups();
    assert_eq!(g.len(), 3);
    assert_eq!((g[2].id, g[2].ports.clone()), (7, vec![7]));
    assert_eq!(
        g[1].state,
        AccessState::Unavailable,
        "configured states stay"
    );
}
