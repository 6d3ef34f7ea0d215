//! The control socket in process: views (sessions with negotiated keys and TCP_INFO) and
//! run-time changes (LUN add/remove/resize, ACLs, targets) while other sessions do I/O.

use crate::support;
use bytes::Bytes;
use ironsan_backend::RamBackend;
use ironsan_initiator::{Client, LoginOptions};
use ironsan_scsi::{LogicalUnit, LuConfig};
use ironsan_server::control::{self, ControlError, Hooks};
use ironsan_server::{Server, ServerConfig, TargetDef};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use support::{ctl, login_opts, wait_for_progress};

const TARGET: &str = "iqn.2026-11.org.ironsan:admin";

fn ram_lu(bytes: u64, seed: &str) -> Arc<LogicalUnit> {
    Arc::new(LogicalUnit::new(
        Arc::new(RamBackend::new(bytes)),
        LuConfig {
            naa: ironsan_scsi::local_naa(seed),
            ..Default::default()
        },
    ))
}

/// Builds `ram:SIZE` LUNs, as the binary builds any spec.
struct RamHooks;
impl Hooks for RamHooks {
    fn build_lun(
        &self,
        target: &str,
        lun: u64,
        spec: &str,
    ) -> Result<(Arc<LogicalUnit>, String), ControlError> {
        let size = spec
            .strip_prefix("ram:")
            .and_then(ironsan_backend::parse_size)
            .ok_or_else(|| ControlError::invalid(format!("bad spec {spec}")))?;
        Ok((ram_lu(size, &format!("{target}/{lun}")), spec.to_string()))
    }
}

fn sock_path(name: &str) -> PathBuf {
    std::env::temp_dir()
        .join(format!("ironsan-admin-{}-{name}", std::process::id()))
        .join("control.sock")
}

async fn start(name: &str) -> (SocketAddr, PathBuf, tokio::sync::oneshot::Sender<()>) {
    let mut scsi = ironsan_scsi::Target::new();
    scsi.add_lun(0, ram_lu(64 << 20, "admin/0"));
    let t = TargetDef {
        name: TARGET.into(),
        alias: Some("adm".into()),
        max_connections: None,
        error_recovery_level: None,
        scsi: Arc::new(scsi),
    };
    let cfg = ServerConfig::new(vec!["127.0.0.1:0".parse().unwrap()], vec![t]);
    let server = Server::bind(cfg).await.unwrap();
    let addr = server.local_addrs()[0];
    let path = sock_path(name);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
    let listener = control::bind_control(&path).unwrap();
    tokio::spawn(control::serve_control(
        listener,
        server.control(),
        Arc::new(RamHooks),
    ));
    let tx = support::run_in_background(server);
    (addr, path, tx)
}

fn opts(initiator: &str, isid: u8) -> LoginOptions {
    login_opts(TARGET, initiator, isid)
}

const UA: u8 = 0x6;

/// A command that may first report a unit attention (as an initiator would, retry once).
async fn write_read(c: &mut Client, lun: u64, lba: u64, seed: u8) -> Result<(), String> {
    let data = Bytes::from((0..8192).map(|i| (i as u8) ^ seed).collect::<Vec<u8>>());
    for _ in 0..3 {
        let w = c.write16(lun, lba, data.clone(), 512, false).await.unwrap();
        if w.status == 2 && w.sense_key().is_some_and(|s| s.0 == UA) {
            continue;
        }
        if w.status != 0 {
            return Err(format!("write: status {} {:?}", w.status, w.sense_key()));
        }
        let r = c.read16(lun, lba, 16, 512).await.unwrap();
        if r.status == 2 && r.sense_key().is_some_and(|s| s.0 == UA) {
            continue;
        }
        if r.status != 0 || r.data != data {
            return Err(format!("read: status {} {:?}", r.status, r.sense_key()));
        }
        return Ok(());
    }
    Err("unit attention three times in a row".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_lun_changes_do_not_disturb_another_session() {
    let (addr, path, _stop) = start("live").await;
    // The socket is for the owner only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let dir_mode = std::fs::metadata(path.parent().unwrap())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(dir_mode, 0o700);

    // Session A does I/O on LUN 0 the whole time.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut a = Client::login(addr, &opts("iqn.2026-11.org.test:a", 1))
        .await
        .unwrap();
    let mut io = tokio::spawn({
        let stop = Arc::clone(&stop);
        let done = Arc::clone(&done);
        async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) || i < 20 {
                write_read(&mut a, 0, (i % 64) * 16, i as u8).await?;
                i += 1;
                done.store(i, Ordering::Relaxed);
            }
            Ok::<_, String>(a)
        }
    });

    // Add LUN 1 live; session B uses it.
    let r = ctl(&path, &["lun", "add", TARGET, "ram:8M"]).await.unwrap();
    assert!(r["message"].as_str().unwrap().contains("LUN 1"), "{r}");
    let luns = ctl(&path, &["luns", TARGET]).await.unwrap();
    assert_eq!(luns.as_array().unwrap().len(), 2, "{luns}");
    assert_eq!(luns[1]["size"], 8 << 20);
    assert_eq!(luns[1]["spec"], "ram:8M");
    let mut b = Client::login(addr, &opts("iqn.2026-11.org.test:b", 2))
        .await
        .unwrap();
    write_read(&mut b, 1, 100, 9).await.unwrap();

    // Resize: B sees CAPACITY DATA HAS CHANGED once, then the new capacity.
    ctl(&path, &["lun", "resize", TARGET, "1", "16M"])
        .await
        .unwrap();
    let rc = b
        .command(1, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], None, 8)
        .await
        .unwrap();
    assert_eq!(rc.sense_key(), Some((UA, 0x2A, 0x09)));
    let rc = b
        .command(1, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], None, 8)
        .await
        .unwrap();
    assert_eq!(rc.status, 0);
    assert_eq!(&rc.data[..4], &((16u32 << 11) - 1).to_be_bytes());
    write_read(&mut b, 1, (16 << 11) - 16, 3).await.unwrap();

    // Sessions: both, with negotiated keys, counters and TCP_INFO.
    let s = ctl(&path, &["sessions"]).await.unwrap();
    let list = s.as_array().unwrap();
    assert_eq!(list.len(), 2, "{s}");
    let sb = list
        .iter()
        .find(|x| x["initiator"] == "iqn.2026-11.org.test:b")
        .unwrap();
    assert_eq!(sb["target"], TARGET);
    assert_eq!(sb["params"]["HeaderDigest"], "None", "{sb}");
    assert!(sb["params"]["MaxBurstLength"].is_string(), "{sb}");
    let c0 = &sb["connections"][0];
    assert!(c0["writes"].as_u64().unwrap() >= 2, "{c0}");
    assert!(c0["reads"].as_u64().unwrap() >= 2, "{c0}");
    assert!(c0["tcp"]["cwnd"].as_u64().unwrap() > 0, "{c0}");
    assert!(c0["tcp"]["rtt_us"].is_u64(), "{c0}");

    // Remove LUN 1: B gets LOGICAL UNIT NOT SUPPORTED; A never noticed anything but UAs.
    ctl(&path, &["lun", "remove", TARGET, "1"]).await.unwrap();
    let mut saw_not_supported = false;
    for _ in 0..3 {
        let r = b.read16(1, 0, 1, 512).await.unwrap();
        if r.sense_key() == Some((0x5, 0x25, 0x00)) {
            saw_not_supported = true;
            break;
        }
    }
    assert!(saw_not_supported);
    assert!(ctl(&path, &["lun", "remove", TARGET, "1"]).await.is_err());
    // Let A run on for a moment after the changes.
    let before = done.load(Ordering::Relaxed);
    wait_for_progress(&done, before, &mut io).await;
    stop.store(true, Ordering::Relaxed);
    let mut a = io.await.unwrap().unwrap();
    write_read(&mut a, 0, 0, 1).await.unwrap();
}

#[tokio::test]
async fn acl_and_target_changes_apply_to_new_logins_only() {
    let (addr, path, _stop) = start("acl").await;
    let mut a = Client::login(addr, &opts("iqn.2026-11.org.test:a", 1))
        .await
        .unwrap();
    // Only b may log in now; a's session goes on.
    ctl(&path, &["acl", "add", TARGET, "iqn.2026-11.org.test:b"])
        .await
        .unwrap();
    assert!(
        ctl(&path, &["acl", "add", TARGET, "not a rule"])
            .await
            .is_err(),
        "bad rules are refused"
    );
    let t = ctl(&path, &["targets"]).await.unwrap();
    assert_eq!(t[0]["acl"][0], "iqn.2026-11.org.test:b", "{t}");
    assert!(Client::login(addr, &opts("iqn.2026-11.org.test:c", 3))
        .await
        .is_err());
    write_read(&mut a, 0, 0, 5).await.unwrap();
    let _b = Client::login(addr, &opts("iqn.2026-11.org.test:b", 2))
        .await
        .unwrap();
    ctl(&path, &["acl", "remove", TARGET, "iqn.2026-11.org.test:b"])
        .await
        .unwrap();
    let _c = Client::login(addr, &opts("iqn.2026-11.org.test:c", 3))
        .await
        .unwrap();

    // A new target, live: discovery lists it, a session uses it.
    let t2 = "iqn.2026-11.org.ironsan:second";
    ctl(&path, &["target", "add", t2]).await.unwrap();
    ctl(&path, &["lun", "add", t2, "ram:4M"]).await.unwrap();
    let mut d = Client::login(addr, &LoginOptions::new(None)).await.unwrap();
    let st = d.send_targets("All").await.unwrap();
    assert!(
        st.iter().any(|(k, v)| k == "TargetName" && v == t2),
        "{st:?}"
    );
    let mut o = opts("iqn.2026-11.org.test:d", 4);
    o.target_name = Some(t2.into());
    let mut s2 = Client::login(addr, &o).await.unwrap();
    write_read(&mut s2, 0, 0, 7).await.unwrap();
    let show = ctl(&path, &["show", "target", t2]).await.unwrap();
    assert_eq!(show["sessions"].as_array().unwrap().len(), 1, "{show}");
    // Removing a target with a session needs --force, which closes it.
    let e = ctl(&path, &["target", "remove", t2]).await.unwrap_err();
    assert!(e.contains("--force"), "{e}");
    ctl(&path, &["target", "remove", t2, "--force"])
        .await
        .unwrap();
    assert!(s2.read16(0, 0, 1, 512).await.is_err() || s2.read16(0, 0, 1, 512).await.is_err());
    assert!(Client::login(addr, &o).await.is_err());
    // The first target was not disturbed.
    write_read(&mut a, 0, 64, 8).await.unwrap();
    let c = ctl(&path, &["counters"]).await.unwrap();
    assert!(c["logins"].as_u64().unwrap() >= 5, "{c}");
    assert!(
        c["login_failures"]["authorization"].as_u64().unwrap() >= 1,
        "{c}"
    );
    assert!(ctl(&path, &["no-such-command"]).await.is_err());
}

/// One request line on the control socket, raw: the answer line as JSON.
fn raw_line(path: &std::path::Path, line: &str) -> serde_json::Value {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path).unwrap();
    s.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut answer = String::new();
    std::io::BufReader::new(&s).read_line(&mut answer).unwrap();
    serde_json::from_str(&answer).unwrap()
}

#[tokio::test]
async fn typed_requests_and_words_are_one_protocol_and_refusals_say_their_kind() {
    use control::{CallError, ErrorKind, LunRequest, Request, TargetRequest};
    let (addr, path, _stop) = start("typed").await;
    let p = path.clone();
    tokio::task::spawn_blocking(move || {
        // The typed form (what `ironsan ctl` sends) and the words (what a script sends).
        let add = Request::Target(TargetRequest::Add {
            iqn: "iqn.2026-11.org.test:typed".into(),
            alias: Some("typed".into()),
        });
        control::call_request(&p, &add).unwrap();
        let luns = control::call_request(
            &p,
            &Request::Lun(LunRequest::Add {
                target: "iqn.2026-11.org.test:typed".into(),
                spec: "ram:4M".into(),
                lun: None,
            }),
        )
        .unwrap();
        assert_eq!(luns["message"], "iqn.2026-11.org.test:typed: LUN 0 added");
        let words =
            control::call(&p, &["luns".into(), "iqn.2026-11.org.test:typed".into()]).unwrap();
        assert_eq!(words.as_array().map(Vec::len), Some(1), "{words}");
        // Each refusal carries its kind.
        let kind = |r: Result<serde_json::Value, CallError>| match r {
            Err(CallError::Refused(e)) => e.kind,
            other => panic!("not refused: {other:?}"),
        };
        assert_eq!(kind(control::call_request(&p, &add)), ErrorKind::Exists);
        // The portals' refusals too: a portal already there, one that is not.
        assert_eq!(
            kind(control::call(
                &p,
                &["portal".into(), "add".into(), addr.to_string()]
            )),
            ErrorKind::Exists
        );
        assert_eq!(
            kind(control::call(
                &p,
                &["portal".into(), "remove".into(), "127.0.0.9:1".into()]
            )),
            ErrorKind::NotFound
        );
        assert_eq!(
            kind(control::call(
                &p,
                &[
                    "lun".into(),
                    "remove".into(),
                    "iqn.2026-11.org.test:typed".into(),
                    "9".into()
                ]
            )),
            ErrorKind::NotFound
        );
        assert_eq!(
            kind(control::call(
                &p,
                &["lun".into(), "remove".into(), "x".into(), "zero".into()]
            )),
            ErrorKind::Invalid
        );
        assert_eq!(
            kind(control::call_request(&p, &Request::Cluster { cmd: None })),
            ErrorKind::Unsupported
        );
        // A line that is neither form, or both, is refused as invalid, naming the problem.
        for line in [
            r#"{"argv": ["sessions"], "request": "sessions"}"#,
            r#"{"command": "sessions"}"#,
            r#"{"request": "no-such-request"}"#,
            "not json",
        ] {
            let v = raw_line(&p, line);
            assert_eq!(v["ok"], false, "{line}: {v}");
            assert_eq!(v["kind"], "invalid", "{line}: {v}");
            assert!(
                v["error"].as_str().unwrap().starts_with("bad request"),
                "{v}"
            );
        }
        let v = raw_line(&p, r#"{"request": {"luns": {"target": null}}}"#);
        assert_eq!(v["ok"], true, "{v}");
    })
    .await
    .unwrap();
}
