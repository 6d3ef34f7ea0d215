//! ALUA over real sockets: one target served through two portal groups (two ports), one
//! session through each. What each path reads (RTPG, VPD 83h), what a state set through the
//! control plane does to each path (unit attention, refusals with the state's sense, no
//! effect on the other path), SET TARGET PORT GROUPS from an initiator, a timed transition,
//! groups following portals added live, and the metrics.

use crate::support;
use ironsan_initiator::Client;
use ironsan_server::control::{Control, Hooks};
use ironsan_server::{Portal, PortalGroup, Server, ServerConfig};
use std::time::Duration;
use support::*;

const T: &str = "iqn.2026-11.org.ironsan:alua";

struct NoHooks;
impl Hooks for NoHooks {}

/// A RAM target on portal groups 1 and 2 (one port each).
async fn start() -> (Vec<Portal>, Control, tokio::sync::oneshot::Sender<()>) {
    let any = || vec!["127.0.0.1:0".parse().unwrap()];
    let mut cfg = ServerConfig::new(Vec::new(), vec![ram_target(T)]);
    cfg.portal_groups = vec![
        PortalGroup {
            tag: 1,
            listen: any(),
        },
        PortalGroup {
            tag: 2,
            listen: any(),
        },
    ];
    let server = Server::bind(cfg).await.unwrap();
    let portals = server.portals();
    let control = server.control();
    (portals, control, run_in_background(server))
}

async fn login(p: &Portal, isid: u8) -> Client {
    Client::login(p.addr, &login_opts(T, "iqn.2026-11.org.example:host", isid))
        .await
        .unwrap()
}

const TUR: [u8; 6] = [0; 6];
const READ10: [u8; 10] = [0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0];
const RTPG: [u8; 12] = [0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0];

/// (status, sense key/ASC/ASCQ) of one command.
async fn run(c: &mut Client, cdb: &[u8], len: u32) -> (u8, Option<(u8, u8, u8)>) {
    let r = c.command(0, cdb, None, len).await.unwrap();
    (r.status, r.sense_key())
}

/// (group, state code, status code, ports) per RTPG descriptor.
async fn rtpg(c: &mut Client) -> Vec<(u16, u8, u8, Vec<u16>)> {
    let r = c.command(0, &RTPG, None, 256).await.unwrap();
    assert_eq!(r.status, 0, "RTPG: {:?}", r.sense_key());
    let d = &r.data;
    let mut out = Vec::new();
    let mut o = 4;
    while o + 8 <= d.len() {
        let n = usize::from(d[o + 7]);
        let ports = (0..n)
            .map(|i| u16::from_be_bytes([d[o + 10 + 4 * i], d[o + 11 + 4 * i]]))
            .collect();
        out.push((
            u16::from_be_bytes([d[o + 2], d[o + 3]]),
            d[o] & 0x0F,
            d[o + 5],
            ports,
        ));
        o += 8 + 4 * n;
    }
    out
}

/// The relative target port and target port group designators of VPD 83h.
async fn port_designators(c: &mut Client) -> (Option<u16>, Option<u16>) {
    let r = c
        .command(0, &[0x12, 1, 0x83, 1, 0, 0], None, 256)
        .await
        .unwrap();
    let d = &r.data;
    let (mut rel, mut tpg) = (None, None);
    let mut o = 4;
    while o + 4 <= d.len() {
        let len = usize::from(d[o + 3]);
        if o + 4 + len > d.len() {
            break;
        }
        let v = &d[o + 4..o + 4 + len];
        match d[o + 1] & 0x3F {
            0x14 => rel = Some(u16::from_be_bytes([v[2], v[3]])),
            0x15 => tpg = Some(u16::from_be_bytes([v[2], v[3]])),
            _ => {}
        }
        o += 4 + len;
    }
    (rel, tpg)
}

#[tokio::test]
async fn two_paths_see_one_view_and_a_standby_path_refuses_media_access() {
    let (portals, control, _stop) = start().await;
    let mut a = login(&portals[0], 1).await;
    let mut b = login(&portals[1], 2).await;
    // INQUIRY says ALUA (TPGS = 11b).
    let inq = a
        .command(0, &[0x12, 0, 0, 0, 96, 0], None, 96)
        .await
        .unwrap();
    assert_eq!(inq.data[5] & 0x30, 0x30);
    assert_eq!(port_designators(&mut a).await, (Some(1), Some(1)));
    assert_eq!(port_designators(&mut b).await, (Some(2), Some(2)));
    let both = vec![(1, 0, 0, vec![1]), (2, 0, 0, vec![2])];
    assert_eq!(rtpg(&mut a).await, both);
    assert_eq!(rtpg(&mut b).await, both);

    // Group 2 to standby through the control plane.
    let v = control
        .dispatch_words(
            &NoHooks,
            &["alua", "set", T, "2", "standby"].map(String::from),
        )
        .unwrap();
    assert_eq!(v["message"], format!("{T}: group 2 is standby"));
    assert_eq!(run(&mut b, &TUR, 0).await, (2, Some((6, 0x2A, 0x06))));
    assert_eq!(run(&mut b, &READ10, 512).await, (2, Some((2, 0x04, 0x0B))));
    assert_eq!(run(&mut b, &TUR, 0).await, (2, Some((2, 0x04, 0x0B))));
    assert_eq!(rtpg(&mut b).await[1], (2, 2, 2, vec![2]));
    // Path A: told once, then reads as before.
    assert_eq!(run(&mut a, &READ10, 512).await, (2, Some((6, 0x2A, 0x06))));
    assert_eq!(run(&mut a, &READ10, 512).await, (0, None));

    // The control plane's view and the metrics.
    let view = control.alua(Some(T)).unwrap();
    assert_eq!(view[1].state, "standby");
    assert_eq!(view[1].portals[0], portals[1].addr.to_string());

    // The initiator brings its path back with SET TARGET PORT GROUPS (explicit ALUA).
    let list = bytes::Bytes::from(vec![0, 0, 0, 0, 0x00, 0, 0, 2]);
    let stpg = [0xA4, 0x0A, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0];
    let r = b.command(0, &stpg, Some(list), 0).await.unwrap();
    assert_eq!(r.status, 0, "{:?}", r.sense_key());
    // B sent it and gets no unit attention; A is told.
    assert_eq!(run(&mut b, &READ10, 512).await, (0, None));
    assert_eq!(run(&mut a, &READ10, 512).await, (2, Some((6, 0x2A, 0x06))));
    // Status code 01h (altered by SET TARGET PORT GROUPS) on group 2 only.
    assert_eq!(
        rtpg(&mut a).await,
        vec![(1, 0, 0, vec![1]), (2, 0, 1, vec![2])]
    );
}

#[tokio::test]
async fn a_timed_transition_then_the_state_and_unknown_groups_are_refused() {
    let (portals, control, _stop) = start().await;
    let mut b = login(&portals[1], 2).await;
    assert_eq!(run(&mut b, &TUR, 0).await, (0, None));
    control
        .set_alua_state(
            T,
            2,
            ironsan_scsi::AccessState::Unavailable,
            Some(Duration::from_millis(600)),
        )
        .unwrap();
    assert_eq!(run(&mut b, &TUR, 0).await, (2, Some((6, 0x2A, 0x06))));
    assert_eq!(run(&mut b, &READ10, 512).await, (2, Some((2, 0x04, 0x0A))));
    // The extended RTPG header gives the implicit transition time (rounded up to seconds).
    let ext = [0xA3, 0x2A, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0];
    let r = b.command(0, &ext, None, 256).await.unwrap();
    assert_eq!((r.data[4], r.data[5]), (0x10, 1));
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(run(&mut b, &READ10, 512).await, (2, Some((6, 0x2A, 0x06))));
    assert_eq!(run(&mut b, &READ10, 512).await, (2, Some((2, 0x04, 0x0C))));
    // Unavailable still answers RTPG; STPG naming a group that does not exist changes nothing.
    let list = bytes::Bytes::from(vec![0, 0, 0, 0, 0x00, 0, 0, 9]);
    let stpg = [0xA4, 0x0A, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0];
    let r = b.command(0, &stpg, Some(list), 0).await.unwrap();
    assert_eq!(r.sense_key(), Some((5, 0x26, 0x00)));
    assert_eq!(rtpg(&mut b).await[1].1, 3);
    // The control plane refuses what it cannot do, naming it.
    let e = control
        .dispatch_words(
            &NoHooks,
            &["alua", "set", T, "7", "standby"].map(String::from),
        )
        .unwrap_err();
    assert!(e.message.contains("no target port group 7"), "{e}");
    let e = control
        .dispatch_words(
            &NoHooks,
            &["alua", "set", T, "2", "sleepy"].map(String::from),
        )
        .unwrap_err();
    assert!(e.message.contains("'sleepy' is not a state"), "{e}");
}

#[tokio::test]
async fn default_groups_follow_portals_added_live() {
    let (portals, control, _stop) = start().await;
    let mut a = login(&portals[0], 1).await;
    assert_eq!(rtpg(&mut a).await.len(), 2);
    control
        .set_alua_state(T, 2, ironsan_scsi::AccessState::Standby, None)
        .unwrap();
    let _ = run(&mut a, &TUR, 0).await; // the state-change unit attention
    let p3 = control
        .add_portal("127.0.0.1:0".parse().unwrap(), 3)
        .unwrap();
    let groups = rtpg(&mut a).await;
    assert_eq!(groups.len(), 3, "{groups:?}");
    assert_eq!(groups[1].1, 2, "group 2 keeps its state");
    assert_eq!(groups[2], (3, 0, 0, vec![3]));
    let mut c = login(&p3, 3).await;
    assert_eq!(port_designators(&mut c).await, (Some(3), Some(3)));
    control.remove_portal(p3.addr).unwrap();
    assert_eq!(rtpg(&mut a).await.len(), 2);
    // Configured groups stop following: one group for both ports.
    let mut g = ironsan_scsi::PortGroup::new(10, vec![1, 2]);
    g.preferred = true;
    control.set_port_groups(T, Some(vec![g])).unwrap();
    let _ = run(&mut a, &TUR, 0).await;
    assert_eq!(rtpg(&mut a).await, vec![(10, 0, 0, vec![1, 2])]);
    assert_eq!(port_designators(&mut a).await, (Some(1), Some(10)));
    // A portal group in two groups is refused.
    let e = control
        .set_port_groups(
            T,
            Some(vec![
                ironsan_scsi::PortGroup::new(1, vec![1]),
                ironsan_scsi::PortGroup::new(2, vec![1, 2]),
            ]),
        )
        .unwrap_err();
    assert!(
        e.message
            .contains("portal group 1 is in target port groups 1 and 2"),
        "{e}"
    );
}
