//! Target portal groups: two groups on two 127.0.0.1 ports; SendTargets lists each target's
//! portals with their group tags, a login announces the tag of the portal it came in on, and
//! a login on a portal outside the target's groups fails with 0203 (not found). Portals are
//! added and removed live through the control socket while another session does I/O.

use crate::support;
use ironsan_initiator::{Client, Error, LoginOptions};
use ironsan_server::control;
use ironsan_server::{Portal, PortalGroup, Server, ServerConfig};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use support::*;

const EVERYWHERE: &str = "iqn.2026-11.org.ironsan:everywhere";
const ONLY_TWO: &str = "iqn.2026-11.org.ironsan:only-two";
const ONLY_ONE: &str = "iqn.2026-11.org.ironsan:only-one";

/// Groups 1 and 2, one port each; EVERYWHERE on both, ONLY_ONE on 1, ONLY_TWO on 2.
async fn start_groups() -> (
    Vec<Portal>,
    ironsan_server::control::Control,
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
    (portals, control, run_in_background(server))
}

fn tpgt(c: &Client) -> Option<String> {
    c.negotiated
        .iter()
        .rev()
        .find(|(k, _)| k == "TargetPortalGroupTag")
        .map(|(_, v)| v.clone())
}

/// SendTargets=All from a discovery session on `portal`, with the TargetPortalGroupTag that
/// session's login announced.
async fn discover(portal: SocketAddr) -> (Option<String>, Vec<(String, String)>) {
    let mut c = Client::login(portal, &LoginOptions::new(None))
        .await
        .unwrap();
    let pairs = c.send_targets("All").await.unwrap();
    (tpgt(&c), pairs)
}

/// The SendTargets answer for `targets`, in order, each with its portals (address, tag).
fn listing(targets: &[(&str, &[(SocketAddr, u16)])]) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    for (name, portals) in targets {
        pairs.push(("TargetName".to_string(), name.to_string()));
        for (addr, tag) in *portals {
            pairs.push(("TargetAddress".to_string(), format!("{addr},{tag}")));
        }
    }
    pairs
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
        let (_, pairs) = discover(p).await;
        assert_eq!(
            pairs,
            listing(&[
                (EVERYWHERE, &[(p1, 1), (p2, 2)]),
                (ONLY_ONE, &[(p1, 1)]),
                (ONLY_TWO, &[(p2, 2)]),
            ])
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
    assert_eq!(v[1].tag, 2);
    assert_eq!(v[1].addr, p2.to_string());
}

#[tokio::test]
async fn listen_alone_is_portal_group_one() {
    let (addr, _stop) = start().await;
    let c = Client::login(addr, &LoginOptions::new(Some(TARGET)))
        .await
        .unwrap();
    assert_eq!(tpgt(&c).as_deref(), Some("1"));
}

/// Write 8 KiB at `lba` and read it back.
async fn write_read(c: &mut Client, lba: u64, seed: u8) -> Result<(), String> {
    let data = pattern(8192, seed);
    let w = c
        .write16(0, lba, data.clone(), 512, false)
        .await
        .map_err(|e| format!("write: {e}"))?;
    if w.status != 0 {
        return Err(format!("write: status {} {:?}", w.status, w.sense_key()));
    }
    let r = c
        .read16(0, lba, 16, 512)
        .await
        .map_err(|e| format!("read: {e}"))?;
    if r.status != 0 || r.data != data {
        return Err(format!("read: status {} {:?}", r.status, r.sense_key()));
    }
    Ok(())
}

fn addresses(pairs: &[(String, String)]) -> Vec<String> {
    pairs
        .iter()
        .filter(|(k, _)| k == "TargetAddress")
        .map(|(_, v)| v.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn portals_are_added_and_removed_live() {
    // Group 1 only; ONLY_TWO is meant for group 2, which does not exist yet.
    let mut cfg = ServerConfig::new(
        vec!["127.0.0.1:0".parse().unwrap()],
        vec![ram_target(EVERYWHERE), ram_target(ONLY_TWO)],
    );
    cfg.target_portal_groups = HashMap::from([(ONLY_TWO.to_string(), vec![2])]);
    let server = Server::bind(cfg).await.unwrap();
    let p1 = server.local_addrs()[0];
    let path: PathBuf = std::env::temp_dir()
        .join(format!("ironsan-portals-{}", std::process::id()))
        .join("control.sock");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
    let listener = control::bind_control(&path).unwrap();
    tokio::spawn(control::serve_control(
        listener,
        server.control(),
        Arc::new(control::NoHooks),
    ));
    let _stop = run_in_background(server);

    // Session A does I/O through portal 1 the whole time.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut a = Client::login(p1, &login_opts(EVERYWHERE, "iqn.2026-11.org.test:a", 1))
        .await
        .unwrap();
    let mut io = tokio::spawn({
        let (stop, done) = (Arc::clone(&stop), Arc::clone(&done));
        async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) || i < 20 {
                write_read(&mut a, (i % 64) * 16, i as u8).await?;
                i += 1;
                done.store(i, Ordering::Relaxed);
            }
            Ok::<_, String>(a)
        }
    });

    // Add group 2 (port 0: any free port; the answer names the port).
    let r = ctl(&path, &["portal", "add", "127.0.0.1:0", "--tag", "2"])
        .await
        .unwrap();
    let p2: SocketAddr = r["addr"].as_str().unwrap().parse().unwrap();
    assert_eq!(r["tag"], 2);
    assert!(
        r["message"].as_str().unwrap().contains(&p2.to_string()),
        "{r}"
    );
    // Refused: tag 0, a portal that exists, an address taken by someone else (named), junk.
    let e = ctl(&path, &["portal", "add", "127.0.0.1:0", "--tag", "0"])
        .await
        .unwrap_err();
    assert!(e.contains("reserved"), "{e}");
    let e = ctl(&path, &["portal", "add", &p2.to_string(), "--tag", "3"])
        .await
        .unwrap_err();
    assert!(e.contains("already exists (group 2)"), "{e}");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    let e = ctl(&path, &["portal", "add", &taken_addr])
        .await
        .unwrap_err();
    assert!(e.contains(&format!("cannot listen on {taken_addr}")), "{e}");
    for bad in [
        vec!["portal", "add", "localhost"],
        vec!["portal", "add", "127.0.0.1:0", "--tag", "65536"],
    ] {
        assert!(ctl(&path, &bad).await.is_err(), "{bad:?}");
    }
    let list = ctl(&path, &["portals"]).await.unwrap();
    assert_eq!(
        list,
        serde_json::json!([
            {"addr": p1.to_string(), "tag": 1, "transport": "iscsi"},
            {"addr": p2.to_string(), "tag": 2, "transport": "iscsi"},
        ])
    );

    // SendTargets reflects it, with each portal's tag, from a discovery session on either
    // portal. A discovery login announces no TargetPortalGroupTag (RFC 7143 §13.9: only when
    // the initiator names a target).
    for p in [p1, p2] {
        let (tag, pairs) = discover(p).await;
        assert_eq!(tag, None);
        assert_eq!(
            pairs,
            listing(&[(EVERYWHERE, &[(p1, 1), (p2, 2)]), (ONLY_TWO, &[(p2, 2)])])
        );
    }
    // Session B through the new portal: announces tag 2 and does I/O.
    let mut b = Client::login(p2, &login_opts(ONLY_TWO, "iqn.2026-11.org.test:b", 2))
        .await
        .unwrap();
    assert_eq!(tpgt(&b).as_deref(), Some("2"));
    write_read(&mut b, 0, 0x22).await.unwrap();
    assert!(matches!(
        Client::login(p1, &login_opts(ONLY_TWO, "iqn.2026-11.org.test:b", 3)).await,
        Err(Error::Login(2, 3))
    ));

    // p2 is the only portal of group 2, which ONLY_TWO is restricted to: not removable.
    let e = ctl(&path, &["portal", "remove", &p2.to_string()])
        .await
        .unwrap_err();
    assert!(
        e.contains("last portal of group 2") && e.contains(ONLY_TWO),
        "{e}"
    );
    // With a second portal in group 2 it is.
    let r = ctl(&path, &["portal", "add", "127.0.0.1:0", "--tag", "2"])
        .await
        .unwrap();
    let p3: SocketAddr = r["addr"].as_str().unwrap().parse().unwrap();
    let before = done.load(Ordering::Relaxed);
    ctl(&path, &["portal", "remove", &p2.to_string()])
        .await
        .unwrap();
    // New connections are refused at once; the session that came in through it goes on.
    let refused = tokio::net::TcpStream::connect(p2).await;
    assert_eq!(
        refused.as_ref().map_err(|e| e.kind()).err(),
        Some(std::io::ErrorKind::ConnectionRefused),
        "{refused:?}"
    );
    write_read(&mut b, 64, 0x23).await.unwrap();
    assert_eq!(
        addresses(&discover(p1).await.1),
        vec![format!("{p1},1"), format!("{p3},2"), format!("{p3},2")]
    );
    let mut b2 = Client::login(p3, &login_opts(ONLY_TWO, "iqn.2026-11.org.test:b", 4))
        .await
        .unwrap();
    write_read(&mut b2, 128, 0x24).await.unwrap();
    let e = ctl(&path, &["portal", "remove", &p2.to_string()])
        .await
        .unwrap_err();
    assert!(e.contains("no portal"), "{e}");

    // Portal 1 goes too, under session A's feet: A keeps working.
    ctl(&path, &["portal", "remove", &p1.to_string()])
        .await
        .unwrap();
    assert!(tokio::net::TcpStream::connect(p1).await.is_err());
    let e = ctl(&path, &["portal", "remove", &p3.to_string()])
        .await
        .unwrap_err();
    assert!(e.contains("last portal"), "{e}");
    wait_for_progress(&done, before, &mut io).await;
    stop.store(true, Ordering::Relaxed);
    let mut a = io.await.unwrap().unwrap();
    write_read(&mut a, 0, 1).await.unwrap();
    let sessions = ctl(&path, &["sessions"]).await.unwrap();
    let portal_of = |initiator: &str| {
        sessions
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["initiator"] == initiator && s["type"] == "normal")
            .map(|s| s["connections"][0]["portal"].clone())
    };
    assert_eq!(
        portal_of("iqn.2026-11.org.test:a"),
        Some(p1.to_string().into())
    );
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}
