//! Target portal groups: two groups on two 127.0.0.1 ports; SendTargets lists each target's
//! portals with their group tags, a login announces the tag of the portal it came in on, and
//! a login on a portal outside the target's groups fails with 0203 (not found).

mod support;
use ironsan_initiator::{Client, Error, LoginOptions};
use ironsan_server::{Portal, PortalGroup, Server, ServerConfig};
use std::collections::HashMap;
use support::*;

const EVERYWHERE: &str = "iqn.2026-11.org.ironsan:everywhere";
const ONLY_TWO: &str = "iqn.2026-11.org.ironsan:only-two";
const ONLY_ONE: &str = "iqn.2026-11.org.ironsan:only-one";

/// Groups 1 and 2, one port each; EVERYWHERE on both, ONLY_ONE on 1, ONLY_TWO on 2.
async fn start_groups() -> (
    Vec<Portal>,
    ironsan_server::admin::Control,
    tokio::sync::oneshot::Sender<()>,
) {
    let any = || vec!["127.0.0.1:0".parse().unwrap()];
    let mut cfg = ServerConfig::new(
        Vec::new(),
        vec![
            ram_target(EVERYWHERE),
            ram_target(ONLY_TWO),
            ram_target(ONLY_ONE),
        ],
    );
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
    cfg.target_portal_groups = HashMap::from([
        (ONLY_TWO.to_string(), vec![2]),
        (ONLY_ONE.to_string(), vec![1]),
    ]);
    let server = Server::bind(cfg).await.unwrap();
    let portals = server.portals();
    let control = server.control();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.run(async {
        let _ = rx.await;
    }));
    (portals, control, tx)
}

fn tpgt(c: &Client) -> Option<String> {
    c.negotiated
        .iter()
        .rev()
        .find(|(k, _)| k == "TargetPortalGroupTag")
        .map(|(_, v)| v.clone())
}

#[tokio::test]
async fn send_targets_lists_each_targets_portals_with_their_tags() {
    let (portals, _control, _stop) = start_groups().await;
    assert_eq!(
        portals.iter().map(|p| p.tag).collect::<Vec<_>>(),
        vec![1, 2]
    );
    let (p1, p2) = (portals[0].addr, portals[1].addr);
    assert_ne!(p1, p2);
    // The same answer from a discovery session on either portal.
    for p in [p1, p2] {
        let mut c = Client::login(p, &LoginOptions::new(None)).await.unwrap();
        let pairs = c.send_targets("All").await.unwrap();
        let s = |k: &str, v: String| (k.to_string(), v);
        assert_eq!(
            pairs,
            vec![
                s("TargetName", EVERYWHERE.into()),
                s("TargetAddress", format!("{p1},1")),
                s("TargetAddress", format!("{p2},2")),
                s("TargetName", ONLY_ONE.into()),
                s("TargetAddress", format!("{p1},1")),
                s("TargetName", ONLY_TWO.into()),
                s("TargetAddress", format!("{p2},2")),
            ]
        );
    }
}

#[tokio::test]
async fn login_announces_the_tag_of_its_portal_and_outside_portals_are_not_found() {
    let (portals, control, _stop) = start_groups().await;
    let (p1, p2) = (portals[0].addr, portals[1].addr);
    for (p, tag) in [(p1, "1"), (p2, "2")] {
        let mut c = Client::login(p, &LoginOptions::new(Some(EVERYWHERE)))
            .await
            .unwrap();
        assert_eq!(tpgt(&c).as_deref(), Some(tag));
        // A normal session's SendTargets lists its target on every portal of its groups.
        let pairs = c.send_targets("").await.unwrap();
        assert_eq!(pairs.len(), 3, "{pairs:?}");
    }
    let c = Client::login(p2, &LoginOptions::new(Some(ONLY_TWO)))
        .await
        .unwrap();
    assert_eq!(tpgt(&c).as_deref(), Some("2"));
    let c = Client::login(p1, &LoginOptions::new(Some(ONLY_ONE)))
        .await
        .unwrap();
    assert_eq!(tpgt(&c).as_deref(), Some("1"));
    // RFC 7143 §11.13.5: 0203, the target does not exist at this address.
    for (p, t) in [(p1, ONLY_TWO), (p2, ONLY_ONE)] {
        match Client::login(p, &LoginOptions::new(Some(t))).await {
            Err(Error::Login(2, 3)) => {}
            Err(e) => panic!("{t} on {p}: {e}"),
            Ok(_) => panic!("{t} on {p}: login succeeded"),
        }
    }
    // Changed live: ONLY_TWO now on every portal, and back to group 1 only.
    control.set_portal_groups(ONLY_TWO, None).unwrap();
    let c = Client::login(p1, &LoginOptions::new(Some(ONLY_TWO)))
        .await
        .unwrap();
    assert_eq!(tpgt(&c).as_deref(), Some("1"));
    control.set_portal_groups(ONLY_TWO, Some(vec![1])).unwrap();
    assert!(matches!(
        Client::login(p2, &LoginOptions::new(Some(ONLY_TWO))).await,
        Err(Error::Login(2, 3))
    ));
    assert!(control.set_portal_groups(ONLY_TWO, Some(vec![0])).is_err());
    let v = control.portals();
    assert_eq!(v[1]["tag"], 2);
    assert_eq!(v[1]["addr"], p2.to_string());
}

#[tokio::test]
async fn listen_alone_is_portal_group_one() {
    let (addr, _stop) = start().await;
    let c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    assert_eq!(tpgt(&c).as_deref(), Some("1"));
}
