//! RBD LUNs against a real Ceph cluster: one monitor and one OSD on 127.0.0.1, started by the
//! tests themselves with `scripts/ceph-micro.sh` (cephx on) and destroyed when the test
//! process exits. Data crosses between iSCSI and Ceph's own tools (`rbd export`, `rbd
//! import`, `rbd resize`), acknowledged writes survive `kill -9` of the gateway, a restarted
//! gateway takes the image back at once, an OSD that stops makes commands fail after the
//! LUN's timeout and I/O resume when it returns, and a blocklisted gateway stops
//! acknowledging. Needs ceph-mon, ceph-osd and ceph-common (a missing tool skips the tests,
//! or fails them with `IRONSAN_REQUIRE_TOOLS=1`).

use crate::ceph;
use crate::common;
use crate::crash_harness;

use ceph::{Cluster, MIB};

use bytes::Bytes;
use common::*;
use ironsan_initiator::{read16_cdb, write16_cdb, Client, LoginOptions};
use ironsan_proto::pdu::Header;
use std::path::Path;
use std::time::{Duration, Instant};

/// `len` bytes that differ per `seed`.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

async fn login(s: &Server) -> Client {
    Client::login(s.addr(), &LoginOptions::new(Some(&s.target)))
        .await
        .expect("login")
}

/// (sense key, ASC, ASCQ) of a CHECK CONDITION.
fn sense_of(r: &ironsan_initiator::CommandResult) -> Option<(u8, u8, u8)> {
    if r.status != 2 {
        return None;
    }
    r.sense_key()
}

// ---------------------------------------------------------------------------------------------

/// What an initiator writes is what `rbd export` finds in the image, and what `rbd import`
/// put in an image is what the initiator reads; `ctl luns` names the image.
#[test]
fn data_crosses_between_iscsi_and_the_rbd_tools() {
    let Some(c) = Cluster::shared() else { return };
    if !require_qemu_iscsi() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    c.create("xfer", 32 * MIB);
    let imported = pattern(16 << 20, 7);
    let imp = dir.path().join("import.raw");
    std::fs::write(&imp, &imported).unwrap();
    c.rbd(&["import", &imp.display().to_string(), "rbd/imported"]);
    let sock = dir.path().join("control.sock").display().to_string();
    let metrics = format!("127.0.0.1:{}", free_port());
    let s = Server::start(&[
        "--lun",
        &c.spec("xfer", ""),
        "--lun",
        &c.spec("imported", ""),
        "--control",
        &sock,
        "--metrics",
        &metrics,
    ]);

    // iSCSI -> image.
    let written = pattern(8 << 20, 3);
    let src = dir.path().join("src.raw");
    std::fs::write(&src, &written).unwrap();
    qemu_img_convert(&src.display().to_string(), &s.url(0), true);
    let exp = dir.path().join("export.raw");
    c.rbd(&["export", "rbd/xfer", &exp.display().to_string()]);
    let image = std::fs::read(&exp).unwrap();
    assert_eq!(image.len() as u64, 32 * MIB);
    assert!(
        image[..written.len()] == written[..],
        "rbd export differs from what was written"
    );
    assert!(
        image[written.len()..].iter().all(|&b| b == 0),
        "beyond the write: not zeros"
    );

    // Image -> iSCSI.
    let out = dir.path().join("read.raw");
    qemu_img_convert(&s.url(1), &out.display().to_string(), false);
    let read = std::fs::read(&out).unwrap();
    assert!(
        read == imported,
        "the imported image reads back differently"
    );

    let luns = run_stdout(bin(), &["ctl", "--control", &sock, "--json", "luns"]);
    let v: serde_json::Value = serde_json::from_str(&luns).unwrap();
    let l0 = &v.as_array().unwrap()[0];
    assert_eq!(l0["backend"], "rbd", "{luns}");
    assert_eq!(l0["io_engine"], "librbd", "{luns}");
    assert!(
        l0["spec"]
            .as_str()
            .unwrap_or_default()
            .starts_with("rbd:rbd/xfer"),
        "{luns}"
    );
    assert_eq!(l0["in_flight"].as_u64(), Some(0), "{luns}");
    let (code, text) = http_get(metrics.parse().unwrap(), "/metrics");
    assert_eq!(code, 200, "{text}");
    assert!(
        text.contains(&format!(
            "ironsan_lun_info{{target=\"{}\",lun=\"0\",backend=\"rbd\",device=\"rbd:rbd/xfer\"}} 1",
            s.target
        )),
        "{text}"
    );
    assert!(
        text.contains("ironsan_backend_operations_in_flight{")
            && text.contains("backend=\"rbd\"} 0"),
        "{text}"
    );
}

/// Many commands in flight on an RBD LUN, every block verified: sequential 64 KiB writes,
/// random 4 KiB writes at QD32 over several sessions, random reads.
#[test]
fn the_load_generator_verifies_every_block_at_depth() {
    let Some(c) = Cluster::shared() else { return };
    c.create("load", 64 * MIB);
    let s = Server::start(&["--lun", &c.spec("load", "")]);
    let u = s.url(0);
    for args in [
        &[
            "--rw", "write", "--bs", "65536", "--qd", "8", "--count", "1024", "--verify",
        ][..],
        &[
            "--rw",
            "randwrite",
            "--bs",
            "4096",
            "--qd",
            "32",
            "--count",
            "4000",
            "--verify",
            "--sessions",
            "2",
        ],
        &[
            "--rw", "randread", "--bs", "4096", "--qd", "32", "--count", "4000", "--verify",
        ],
        &[
            "--rw", "read", "--bs", "524288", "--qd", "8", "--count", "128", "--verify",
        ],
    ] {
        let mut a = vec!["load", u.as_str(), "--json"];
        a.extend_from_slice(args);
        let out = run_unchecked(bin(), &a, Duration::from_secs(300));
        assert!(out.status.success(), "load {args:?}: {}", show(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["failed"].as_u64(), Some(0), "{args:?}: {v}");
        assert!(v["ios"].as_u64().unwrap_or(0) > 0, "{args:?}: {v}");
    }
}

/// Zero-length transfers complete without reaching librbd; COMPARE AND WRITE compares and
/// writes in the cluster and reports the first differing byte; WRITE SAME of zeros and UNMAP
/// leave zeros.
#[test]
fn compare_and_write_zero_lengths_and_zeroing() {
    let Some(c) = Cluster::shared() else { return };
    c.create("caw", 16 * MIB);
    let s = Server::start(&["--lun", &c.spec("caw", "")]);
    rt().block_on(async {
        let mut cl = login(&s).await;
        // READ(10) and WRITE(10) of zero blocks.
        let mut rd = [0u8; 10];
        rd[0] = 0x28;
        rd[2..6].copy_from_slice(&100u32.to_be_bytes());
        let r = cl.command(0, &rd, None, 0).await.unwrap();
        assert_eq!(r.status, 0, "READ(10) of 0 blocks: {:?}", sense_of(&r));
        let mut wr = rd;
        wr[0] = 0x2A;
        let r = cl.command(0, &wr, Some(Bytes::new()), 0).await.unwrap();
        assert_eq!(r.status, 0, "WRITE(10) of 0 blocks: {:?}", sense_of(&r));

        let old = Bytes::from(pattern(512, 1));
        let new = Bytes::from(pattern(512, 2));
        let w = cl
            .command(0, &write16_cdb(40, 1), Some(old.clone()), 0)
            .await
            .unwrap();
        assert_eq!(w.status, 0);
        let caw = |lba: u64| {
            let mut cdb = [0u8; 16];
            cdb[0] = 0x89;
            cdb[2..10].copy_from_slice(&lba.to_be_bytes());
            cdb[13] = 1;
            cdb
        };
        // Verify data differing at byte 77: MISCOMPARE, INFORMATION 77, nothing written.
        let mut wrong = old.to_vec();
        wrong[77] ^= 0xFF;
        let mut buf = wrong.clone();
        buf.extend_from_slice(&new);
        let r = cl
            .command(0, &caw(40), Some(Bytes::from(buf)), 0)
            .await
            .unwrap();
        assert_eq!(sense_of(&r), Some((0xE, 0x1D, 0x00)), "miscompare");
        let sense = r.sense.clone();
        let info = sense
            .get(3..7)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        assert_eq!(
            info,
            Some(77),
            "INFORMATION = offset of the first difference"
        );
        let r = cl.command(0, &read16_cdb(40, 1), None, 512).await.unwrap();
        assert_eq!(r.data, old, "a miscompare wrote");
        // Matching verify data: written.
        let mut buf = old.to_vec();
        buf.extend_from_slice(&new);
        let r = cl
            .command(0, &caw(40), Some(Bytes::from(buf)), 0)
            .await
            .unwrap();
        assert_eq!(r.status, 0, "compare and write: {:?}", sense_of(&r));
        let r = cl.command(0, &read16_cdb(40, 1), None, 512).await.unwrap();
        assert_eq!(r.data, new);

        // 8 MiB of data at 2 MiB (over the image's 4 MiB objects 0, 1 and 2); WRITE SAME(16)
        // of zeros over its first 2 MiB (allocated zeros), UNMAP of object 1 (deallocated).
        let data = Bytes::from(pattern(8 << 20, 9));
        for (i, chunk) in data.chunks(1 << 20).enumerate() {
            let lba = 4096 + i as u64 * 2048;
            let w = cl
                .command(
                    0,
                    &write16_cdb(lba, 2048),
                    Some(Bytes::copy_from_slice(chunk)),
                    0,
                )
                .await
                .unwrap();
            assert_eq!(w.status, 0);
        }
        let mut ws = [0u8; 16];
        ws[0] = 0x93;
        ws[2..10].copy_from_slice(&4096u64.to_be_bytes());
        ws[10..14].copy_from_slice(&4096u32.to_be_bytes());
        let r = cl
            .command(0, &ws, Some(Bytes::from(vec![0u8; 512])), 0)
            .await
            .unwrap();
        assert_eq!(r.status, 0, "WRITE SAME zeros: {:?}", sense_of(&r));
        let mut um = [0u8; 10];
        um[0] = 0x42;
        um[8] = 24;
        let mut list = vec![0u8; 24];
        list[1] = 22;
        list[3] = 16;
        list[8..16].copy_from_slice(&(4096u64 + 4096).to_be_bytes());
        list[16..20].copy_from_slice(&8192u32.to_be_bytes());
        let r = cl
            .command(0, &um, Some(Bytes::from(list)), 0)
            .await
            .unwrap();
        assert_eq!(r.status, 0, "UNMAP: {:?}", sense_of(&r));
        for lba in (4096..16384).step_by(2048) {
            let r = cl
                .command(0, &read16_cdb(lba, 2048), None, 1 << 20)
                .await
                .unwrap();
            assert!(
                r.data.iter().all(|&b| b == 0),
                "zeroed LBA {lba} reads back non-zero"
            );
        }
        let r = cl
            .command(0, &read16_cdb(16384, 2048), None, 1 << 20)
            .await
            .unwrap();
        assert_eq!(
            &r.data[..],
            &data[6 << 20..7 << 20],
            "data beyond the zeroed ranges"
        );
        // GET LBA STATUS from the image's allocation: object 1 deallocated, object 2 mapped.
        let status = |lba: u64| {
            let mut cdb = [0u8; 16];
            cdb[0] = 0x9E;
            cdb[1] = 0x12;
            cdb[2..10].copy_from_slice(&lba.to_be_bytes());
            cdb[13] = 24;
            cdb
        };
        let r = cl.command(0, &status(8192), None, 24).await.unwrap();
        assert_eq!(r.status, 0, "GET LBA STATUS: {:?}", sense_of(&r));
        assert_eq!(
            r.data.get(20).map(|b| b & 0x0F),
            Some(1),
            "object 1 deallocated: {:?}",
            r.data
        );
        let r = cl.command(0, &status(16384), None, 24).await.unwrap();
        assert_eq!(
            r.data.get(20).map(|b| b & 0x0F),
            Some(0),
            "object 2 mapped: {:?}",
            r.data
        );
    });
}

/// READ CAPACITY (16): (status, number of blocks).
async fn capacity(cl: &mut Client) -> (u8, Option<u64>) {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x9E;
    cdb[1] = 0x10;
    cdb[13] = 32;
    let r = cl.command(0, &cdb, None, 32).await.unwrap();
    let last = r
        .data
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_be_bytes);
    (r.status, last.map(|l| l + 1))
}

/// `rbd resize` by another client: the initiator gets CAPACITY DATA HAS CHANGED and READ
/// CAPACITY reports the new size; `ctl lun resize` resizes the image itself.
#[test]
fn a_resize_outside_ironsan_reaches_the_initiator() {
    let Some(c) = Cluster::shared() else { return };
    c.create("grow", 16 * MIB);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("control.sock").display().to_string();
    let s = Server::start(&["--lun", &c.spec("grow", ""), "--control", &sock]);
    rt().block_on(async {
        let mut cl = login(&s).await;
        assert_eq!(capacity(&mut cl).await, (0, Some(16 * MIB / 512)));
        c.rbd(&["resize", "--size", "48M", "rbd/grow"]);
        let t0 = Instant::now();
        let ua = loop {
            let r = cl.command(0, &[0u8; 6], None, 0).await.unwrap();
            if r.status != 0 {
                break sense_of(&r);
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no unit attention after an outside resize"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(ua, Some((0x6, 0x2A, 0x09)), "CAPACITY DATA HAS CHANGED");
        assert_eq!(capacity(&mut cl).await, (0, Some(48 * MIB / 512)));
    });
    run(
        bin(),
        &[
            "ctl",
            "--control",
            &sock,
            "lun",
            "resize",
            &s.target,
            "0",
            "64M",
        ],
    );
    let info = c.rbd(&["info", "--format", "json", "rbd/grow"]);
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(v["size"].as_u64(), Some(64 * MIB), "{info}");
}

/// Every acknowledged write survives SIGKILL of the gateway (harness: tests/common/crash.rs),
/// and each restart takes the image's lock back from its dead predecessor at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_kill_9_and_restarts_take_the_lock_back() {
    let Some(c) = Cluster::shared() else { return };
    c.create("crash", 64 * MIB);
    struct Proc(Server);
    impl crash_harness::Crashable for Proc {
        fn addr(&self) -> std::net::SocketAddr {
            self.0.addr()
        }
        fn target(&self) -> String {
            self.0.target.clone()
        }
        fn crash(&mut self) {
            self.0.kill9();
        }
        fn restart(&mut self) {
            self.0.start_again();
        }
    }
    let mut t = Proc(Server::start(&["--lun", &c.spec("crash", "")]));
    let plan = crash_harness::Plan::new("rbd", false);
    let rep = crash_harness::run(&plan, &mut t).await;
    assert!(
        rep.ok(),
        "{}\nseed {}\n{}",
        rep.summary("rbd"),
        plan.seed,
        t.0.logs()
    );
    eprintln!("{}", rep.summary("rbd"));
    let logs = t.0.logs();
    assert!(
        logs.contains("the previous ironsan instance"),
        "a restart did not take the lock from its dead predecessor:\n{logs}"
    );
    let blocklist = c.ceph(&["osd", "blocklist", "ls"]);
    assert!(
        blocklist.contains("127.0.0.1:0/"),
        "no predecessor was blocklisted: {blocklist}"
    );
}

/// The gateway's client address blocklisted by the cluster (as another gateway taking over
/// would do): writes fail with NOT READY, MANUAL INTERVENTION REQUIRED, the log says why, and
/// no write is acknowledged from then on.
#[test]
fn a_blocklisted_gateway_stops_acknowledging_writes() {
    let Some(c) = Cluster::shared() else { return };
    c.create("fenced", 16 * MIB);
    let s = Server::start(&["--lun", &c.spec("fenced", ",timeout=5")]);
    let owner_file = s
        .data_dir()
        .join("state")
        .join(&s.target)
        .join("0")
        .join("rbd-lock-owner");
    rt().block_on(async {
        let mut cl = login(&s).await;
        let w = cl
            .command(
                0,
                &write16_cdb(0, 8),
                Some(Bytes::from(pattern(4096, 1))),
                0,
            )
            .await
            .unwrap();
        assert_eq!(w.status, 0);
        let me = std::fs::read_to_string(&owner_file).expect("the lock owner is recorded");
        c.ceph(&["osd", "blocklist", "add", me.trim()]);
        let t0 = Instant::now();
        let fenced = loop {
            let w = cl
                .command(
                    0,
                    &write16_cdb(8, 8),
                    Some(Bytes::from(pattern(4096, 2))),
                    0,
                )
                .await
                .unwrap();
            if w.status != 0 {
                break sense_of(&w);
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "writes still acknowledged after the blocklist"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(
            fenced,
            Some((0x2, 0x04, 0x03)),
            "NOT READY, MANUAL INTERVENTION REQUIRED"
        );
        let w = cl
            .command(
                0,
                &write16_cdb(16, 8),
                Some(Bytes::from(pattern(4096, 3))),
                0,
            )
            .await
            .unwrap();
        assert_eq!(sense_of(&w), Some((0x2, 0x04, 0x03)), "a later write");
        c.ceph(&["osd", "blocklist", "rm", me.trim()]);
    });
    assert!(
        s.logs().contains("blocklisted this gateway"),
        "{}",
        s.logs()
    );
}

/// Clear errors for what cannot be served: a pool or image that does not exist, a cluster
/// that does not answer, a client the cluster does not know.
#[test]
fn unusable_images_are_refused_at_start_with_what_was_asked() {
    let Some(c) = Cluster::shared() else { return };
    let dir = tempfile::tempdir().unwrap();
    let refused = |spec: &str| {
        let data = dir.path().join("data").display().to_string();
        let out = run_unchecked(
            bin(),
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
                &data,
                "--lun",
                spec,
            ],
            Duration::from_secs(120),
        );
        assert!(!out.status.success(), "{spec} was served: {}", show(&out));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let conf = c.conf().display().to_string();
    let e = refused(&format!("rbd:nopool/x,conf={conf}"));
    assert!(e.contains("pool 'nopool' does not exist"), "{e}");
    let e = refused(&format!("rbd:rbd/noimage,conf={conf}"));
    assert!(
        e.contains("image 'noimage' does not exist in pool 'rbd'"),
        "{e}"
    );
    let e = refused(&format!("rbd:rbd/x,conf={conf},id=nobody"));
    assert!(e.contains("client.nobody"), "{e}");
    // A client the cluster knows, without rights on the pool.
    c.create("guarded", 4 * MIB);
    let key = c.ceph(&[
        "auth",
        "get-or-create",
        "client.limited",
        "mon",
        "allow r",
        "osd",
        "allow rwx pool=elsewhere",
    ]);
    let keyring = dir.path().join("limited.keyring");
    std::fs::write(&keyring, key).unwrap();
    let limited = dir.path().join("limited.conf");
    let text = std::fs::read_to_string(c.conf()).unwrap();
    std::fs::write(
        &limited,
        format!(
            "{text}\n[client.limited]\nkeyring = {}\n",
            keyring.display()
        ),
    )
    .unwrap();
    let e = refused(&format!(
        "rbd:rbd/guarded,conf={},id=limited",
        limited.display()
    ));
    assert!(
        e.contains("permission denied") && e.contains("client.limited"),
        "{e}"
    );
    let e = refused("rbd:rbd/x,conf=/nonexistent/ceph.conf");
    assert!(
        e.contains("conf=/nonexistent/ceph.conf: no such file"),
        "{e}"
    );
    // A monitor address where nothing listens.
    let dead = dir.path().join("dead.conf");
    let text = std::fs::read_to_string(c.conf()).unwrap();
    let port = free_port();
    let text: String = text
        .lines()
        .map(|l| {
            if l.starts_with("mon host") {
                format!("mon host = v2:127.0.0.1:{port}")
            } else {
                l.to_string()
            }
        })
        .map(|l| l + "\n")
        .collect();
    std::fs::write(&dead, text).unwrap();
    let e = refused(&format!("rbd:rbd/x,conf={}", dead.display()));
    assert!(e.contains("cluster unreachable"), "{e}");
}

/// An OSD stopped under I/O: commands wait at most the LUN's timeout, then fail with NOT
/// READY, BECOMING READY; the session stays (NOP-In keeps it); once the OSD is back, I/O
/// resumes, and every acknowledged write reads back. Needs an OSD that keeps its data across
/// a restart (BlueStore in a file), so it has a cluster of its own.
#[test]
fn an_osd_outage_fails_commands_in_bounded_time_and_io_resumes() {
    if Cluster::shared().is_none() {
        return;
    }
    let c = Cluster::start("bluestore");
    c.create("outage", 16 * MIB);
    let mut s = Server::start(&["--lun", &c.spec("outage", ",timeout=3")]);
    rt().block_on(async {
        let mut cl = login(&s).await;
        let before = Bytes::from(pattern(65536, 1));
        let w = cl
            .command(0, &write16_cdb(0, 128), Some(before.clone()), 0)
            .await
            .unwrap();
        assert_eq!(w.status, 0);
        c.script("stop-osd");
        let t0 = Instant::now();
        let w = cl
            .command(
                0,
                &write16_cdb(1024, 128),
                Some(Bytes::from(pattern(65536, 2))),
                0,
            )
            .await
            .unwrap();
        let waited = t0.elapsed();
        assert_eq!(
            sense_of(&w),
            Some((0x2, 0x04, 0x01)),
            "NOT READY, BECOMING READY after the timeout"
        );
        eprintln!("write with the OSD down failed after {waited:?} (timeout=3)");
        // The session is alive: a command that needs no storage is answered.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let r = cl.command(0, &[0u8; 6], None, 0).await.unwrap();
        assert_eq!(
            r.status,
            0,
            "TEST UNIT READY during the outage: {:?}",
            sense_of(&r)
        );
        c.script("start-osd");
        let after = Bytes::from(pattern(65536, 3));
        let t0 = Instant::now();
        loop {
            let w = cl
                .command(0, &write16_cdb(2048, 128), Some(after.clone()), 0)
                .await
                .unwrap();
            if w.status == 0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "I/O did not resume: {:?}",
                sense_of(&w)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        for (lba, want) in [(0u64, &before), (2048, &after)] {
            let r = cl
                .command(0, &read16_cdb(lba, 128), None, 65536)
                .await
                .unwrap();
            assert_eq!(r.status, 0);
            assert!(r.data == *want, "acknowledged write at LBA {lba} lost");
        }
    });
    s.assert_alive();
}

/// The primitives several gateways share state with (`ironsan_backend::rbd::shared`), on the
/// real cluster: compare-and-set on a version (a stale writer loses, concurrent updates all
/// land), watch/notify with acknowledgements and payloads, a watcher that does not answer
/// reported as timed out, and fencing: once blocklisted, that client's writes fail.
#[test]
fn shared_objects_compare_and_set_watch_notify_and_fence() {
    use ironsan_backend::rbd::shared::SharedPool;
    use std::sync::{mpsc, Arc};
    let Some(c) = Cluster::shared() else {
        return;
    };
    let conf = c.conf().display().to_string();
    let open = || Arc::new(SharedPool::connect(Some(&conf), "admin", "rbd").expect("connect"));
    let (a, b, mute) = (open(), open(), open());
    let oid = format!("ironsan-shared-test-{}", std::process::id());

    // Compare-and-set.
    assert_eq!(a.replace(&oid, None, b"one").unwrap(), Some(1));
    assert_eq!(
        b.replace(&oid, None, b"again").unwrap(),
        None,
        "exists already"
    );
    let r = b.read(&oid).unwrap().expect("the object");
    assert_eq!((r.data.as_slice(), r.version), (&b"one"[..], 1));
    assert_eq!(b.replace(&oid, Some(1), b"two").unwrap(), Some(2));
    assert_eq!(
        a.replace(&oid, Some(1), b"stale").unwrap(),
        None,
        "a stale writer loses"
    );
    assert_eq!(a.read(&oid).unwrap().unwrap().data, b"two");
    assert!(a.read("ironsan-no-such-object").unwrap().is_none());

    // Concurrent read-modify-write from two clients: every increment lands.
    let counter = format!("{oid}-counter");
    let bump = |p: Arc<SharedPool>, counter: String| {
        std::thread::spawn(move || {
            for _ in 0..25 {
                p.update(&counter, 1000, |cur| {
                    let n: u64 = cur
                        .and_then(|d| std::str::from_utf8(d).ok()?.parse().ok())
                        .unwrap_or(0);
                    Some((n + 1).to_string().into_bytes())
                })
                .unwrap();
            }
        })
    };
    let (t1, t2) = (
        bump(a.clone(), counter.clone()),
        bump(b.clone(), counter.clone()),
    );
    t1.join().unwrap();
    t2.join().unwrap();
    let r = a.read(&counter).unwrap().unwrap();
    assert_eq!(r.data, b"50", "version {}", r.version);
    assert_eq!(r.version, 50);

    // Watch/notify: b answers with a payload of its own; `mute` never answers.
    let b2 = b.clone();
    let oid2 = oid.clone();
    let (seen_tx, seen_rx) = mpsc::channel();
    let wb = b
        .watch(
            &oid,
            move |n| {
                let mut reply = b"b:".to_vec();
                reply.extend_from_slice(&n.data);
                let _ = b2.ack(&oid2, &n, &reply);
                let _ = seen_tx.send(n.notifier);
            },
            |_| {},
        )
        .unwrap();
    let wm = mute.watch(&oid, |_| {}, |_| {}).unwrap();
    let reply = a
        .notify(&oid, b"hello", Duration::from_secs(3))
        .expect("notify");
    assert_eq!(
        reply.acks,
        vec![(b.instance_id(), wb.cookie(), b"b:hello".to_vec())],
        "{reply:?}"
    );
    assert_eq!(
        reply.timeouts,
        vec![(mute.instance_id(), wm.cookie())],
        "{reply:?}"
    );
    assert_eq!(
        seen_rx.recv_timeout(Duration::from_secs(5)),
        Ok(a.instance_id())
    );
    drop(wm);

    // Fencing: once `mute` is blocklisted, its writes are refused. Blocklisting returns once
    // `a` has the OSD map that lists `mute`; an OSD may still be on an older map, and takes
    // `mute`'s writes until an op from a client on the new map makes it catch up. What fencing
    // promises is that order: once `a` (the fencer) has written after the blocklist, nothing
    // from `mute` lands. So `a` writes first, as a cluster node writes only after fencing.
    a.blocklist(&mute.address().unwrap(), Duration::from_secs(600))
        .expect("blocklist");
    let v = a.read(&oid).unwrap().unwrap().version;
    let now = a
        .replace(&oid, Some(v), b"three")
        .expect("the fencer writes");
    // At the current version: only the blocklist can refuse it.
    let now = now.expect("nobody else wrote");
    let (tx, rx) = mpsc::channel();
    let m = mute.clone();
    let o = oid.clone();
    std::thread::spawn(move || {
        let _ = tx.send(m.replace(&o, Some(now), b"from a fenced node"));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("a fenced client's write returns");
    assert!(
        r.is_err(),
        "a blocklisted client wrote after the fencer: {r:?}"
    );
    assert_eq!(a.read(&oid).unwrap().unwrap().data, b"three");
    drop(wb);
}

/// Two ironsan processes serve one image with `shared` (active/active, no exclusive lock): a
/// write acknowledged through either is what a read through the other returns, in both
/// directions and interleaved; COMPARE AND WRITE is atomic across them (a counter two
/// initiators increment through different gateways ends at the number of GOOD
/// compare-and-writes); persistent reservations are not offered (one node could not enforce
/// them on the other); an image with the exclusive-lock feature, or `shared` with `wce`, is
/// refused at start with what to do.
#[test]
fn two_gateways_serve_one_shared_image_active_active() {
    let Some(c) = Cluster::shared() else { return };
    c.create_shareable("aa");
    let spec = c.spec("aa", ",shared");
    let a = Server::start(&["--lun", &spec]);
    let b = Server::start(&["--lun", &spec]);
    rt().block_on(async {
        let (mut ca, mut cb) = (login(&a).await, login(&b).await);
        for i in 0..24u64 {
            let (w, r) = if i % 2 == 0 {
                (&mut ca, &mut cb)
            } else {
                (&mut cb, &mut ca)
            };
            let data = Bytes::from(pattern(8192, 100 + i));
            let lba = (i % 6) * 16; // the same blocks rewritten through both gateways
            let res = w.write16(0, lba, data.clone(), 512, false).await.unwrap();
            assert_eq!(res.status, 0, "write {i}: {:?}", sense_of(&res));
            let got = r.read16(0, lba, 16, 512).await.unwrap();
            assert_eq!(got.status, 0, "read {i}: {:?}", sense_of(&got));
            assert!(
                got.data == data,
                "write {i} through one gateway, read through the other: different data"
            );
        }

        // No persistent reservations on a shared LU, through either gateway.
        let mut prout = [0u8; 10];
        prout[0] = 0x5F;
        prout[8] = 24;
        let mut params = vec![0u8; 24];
        params[8..16].copy_from_slice(&0x1234u64.to_be_bytes()); // SERVICE ACTION KEY
        for cl in [&mut ca, &mut cb] {
            let r = cl
                .command(0, &prout, Some(Bytes::from(params.clone())), 0)
                .await
                .unwrap();
            assert_eq!(
                sense_of(&r),
                Some((0x5, 0x20, 0x00)),
                "PR OUT on a shared LU"
            );
            let prin = [0x5E, 0, 0, 0, 0, 0, 0, 0, 64, 0];
            let r = cl.command(0, &prin, None, 64).await.unwrap();
            assert_eq!(
                sense_of(&r),
                Some((0x5, 0x20, 0x00)),
                "PR IN on a shared LU"
            );
        }
    });

    // A counter in block 2048, incremented by COMPARE AND WRITE through both gateways.
    let counter = |n: u64| {
        let mut b = vec![0u8; 512];
        b[..8].copy_from_slice(&n.to_be_bytes());
        b
    };
    rt().block_on(async {
        let mut c0 = login(&a).await;
        let r = c0
            .write16(0, 2048, Bytes::from(counter(0)), 512, false)
            .await
            .unwrap();
        assert_eq!(r.status, 0);
    });
    let bump = |s: &Server| {
        let (addr, target) = (s.addr(), s.target.clone());
        std::thread::spawn(move || {
            rt().block_on(async move {
                let mut cl = Client::login(addr, &LoginOptions::new(Some(&target)))
                    .await
                    .expect("login");
                let (mut good, mut miscompares) = (0u64, 0u64);
                while good < 40 {
                    let r = cl.read16(0, 2048, 1, 512).await.unwrap();
                    assert_eq!(r.status, 0);
                    let n = u64::from_be_bytes(r.data[..8].try_into().unwrap());
                    let mut cdb = [0u8; 16];
                    cdb[0] = 0x89;
                    cdb[2..10].copy_from_slice(&2048u64.to_be_bytes());
                    cdb[13] = 1;
                    let mut buf = counter(n);
                    buf.extend_from_slice(&counter(n + 1));
                    let r = cl
                        .command(0, &cdb, Some(Bytes::from(buf)), 0)
                        .await
                        .unwrap();
                    match (r.status, sense_of(&r)) {
                        (0, _) => good += 1,
                        (_, Some((0xE, 0x1D, 0x00))) => miscompares += 1,
                        other => panic!("COMPARE AND WRITE: {other:?}"),
                    }
                }
                (good, miscompares)
            })
        })
    };
    let (ta, tb) = (bump(&a), bump(&b));
    let ((ga, ma), (gb, mb)) = (ta.join().unwrap(), tb.join().unwrap());
    let final_value = rt().block_on(async {
        let mut cl = login(&b).await;
        let r = cl.read16(0, 2048, 1, 512).await.unwrap();
        u64::from_be_bytes(r.data[..8].try_into().unwrap())
    });
    assert_eq!(
        final_value,
        ga + gb,
        "counter {final_value} after {ga} + {gb} GOOD compare-and-writes ({ma} + {mb} miscompares)"
    );
    drop((a, b));

    // What `shared` refuses, at start.
    c.create("aa-locked", 16 * MIB); // default features: exclusive-lock, object-map, fast-diff
    let bad = [
        (
            c.spec("aa-locked", ",shared"),
            "rbd feature disable rbd/aa-locked fast-diff object-map exclusive-lock",
        ),
        (
            c.spec("aa", ",shared,wce"),
            "shared and wce exclude each other",
        ),
    ];
    for (spec, want) in bad {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().display().to_string();
        let out = run_unchecked(
            bin(),
            &[
                "serve",
                "--listen",
                &format!("127.0.0.1:{}", free_port()),
                "--data-dir",
                &data,
                "--control",
                "none",
                "--lun",
                &spec,
            ],
            Duration::from_secs(60),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{spec}: {err}");
        assert!(err.contains(want), "{spec}: wanted '{want}' in: {err}");
    }
}

// ---------------------------------------------------------------------------------------------
// A cluster of nodes (`--cluster`): one target, reservations and membership through RADOS.
// ---------------------------------------------------------------------------------------------

/// `--cluster` for node `n` of cluster `group` on the test cluster (fast heartbeat and lease,
/// short notify timeout; each test its own group: they share the pool and run at once).
fn cluster_flag(c: &Cluster, group: &str, n: u16) -> String {
    format!(
        "node={n},pool=rbd,conf={},name=gw{n},group={group},heartbeat=250ms,lease=2s,notify_timeout=3s",
        c.conf().display()
    )
}

/// Node `n` of a cluster serving `target` with `luns`, its control socket at `sock`.
fn start_node(
    c: &Cluster,
    n: u16,
    target: &str,
    luns: &[&str],
    sock: &Path,
    extra: &[&str],
) -> Server {
    let (flag, ctl) = (cluster_flag(c, target, n), sock.display().to_string());
    let mut args = vec!["--target", target, "--cluster", &flag, "--control", &ctl];
    for l in luns {
        args.extend_from_slice(&["--lun", l]);
    }
    args.extend_from_slice(extra);
    Server::start(&args)
}

/// `ironsan ctl cluster --json` of the node with control socket `sock`.
fn cluster_view(sock: &Path) -> serde_json::Value {
    let out = run_stdout(
        bin(),
        &[
            "ctl",
            "--control",
            &sock.display().to_string(),
            "--json",
            "cluster",
        ],
    );
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("ctl cluster: {e}: {out}"))
}

/// Wait (at most `limit`) until `ok` holds for node `sock`'s view of the cluster.
fn wait_view(sock: &Path, limit: Duration, ok: impl Fn(&serde_json::Value) -> bool) -> Duration {
    let t0 = Instant::now();
    loop {
        let v = cluster_view(sock);
        if ok(&v) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < limit,
            "cluster view never as expected: {v:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The state a node has in a `ctl cluster` view of target 0.
fn node_state(v: &serde_json::Value, n: u64) -> String {
    v["targets"][0]["nodes"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["node"] == n))
        .and_then(|x| x["state"].as_str())
        .unwrap_or("absent")
        .to_string()
}

/// A command, repeated while it meets a unit attention (reported once each).
async fn past_uas(
    cl: &mut Client,
    cdb: &[u8],
    data: Option<Bytes>,
    alloc: u32,
) -> ironsan_initiator::CommandResult {
    for _ in 0..8 {
        let r = cl.command(1, cdb, data.clone(), alloc).await.unwrap();
        if sense_of(&r).map(|s| s.0) != Some(0x6) {
            return r;
        }
    }
    panic!("unit attentions without end");
}

/// REPORT TARGET PORT GROUPS: (group, access state code, relative ports) per group.
async fn port_groups(cl: &mut Client) -> Vec<(u16, u8, Vec<u16>)> {
    let cdb = [0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0];
    let r = past_uas(cl, &cdb, None, 1024).await;
    assert_eq!(r.status, 0, "RTPG: {:?}", sense_of(&r));
    let d = &r.data;
    let mut out = Vec::new();
    let mut o = 4;
    while o + 8 <= d.len() {
        let n = d[o + 7] as usize;
        let ports = (0..n)
            .filter_map(|i| d.get(o + 8 + i * 4 + 2..o + 8 + i * 4 + 4))
            .map(|p| u16::from_be_bytes([p[0], p[1]]))
            .collect();
        out.push((u16::from_be_bytes([d[o + 2], d[o + 3]]), d[o] & 0x0F, ports));
        o += 8 + n * 4;
    }
    out
}

/// PERSISTENT RESERVE OUT on LUN 1.
async fn prout(
    cl: &mut Client,
    sa: u8,
    ptype: u8,
    key: u64,
    sark: u64,
) -> ironsan_initiator::CommandResult {
    let (cdb, p) = ironsan_initiator::prout_basic(sa, ptype, key, sark, false);
    past_uas(cl, &cdb, Some(p), 0).await
}

/// PERSISTENT RESERVE IN READ KEYS on LUN 1: (PRGENERATION, keys).
async fn read_keys(cl: &mut Client) -> (u32, Vec<u64>) {
    let cdb = [0x5E, 0, 0, 0, 0, 0, 0, 1, 0, 0];
    let r = past_uas(cl, &cdb, None, 256).await;
    assert_eq!(r.status, 0, "READ KEYS: {:?}", sense_of(&r));
    let d = &r.data;
    let gen = u32::from_be_bytes([d[0], d[1], d[2], d[3]]);
    let len = u32::from_be_bytes([d[4], d[5], d[6], d[7]]) as usize;
    let keys = d[8..8 + len]
        .chunks(8)
        .map(|k| u64::from_be_bytes(k.try_into().unwrap()))
        .collect();
    (gen, keys)
}

async fn login_as(s: &Server, initiator: &str) -> Client {
    let mut o = LoginOptions::new(Some(&s.target));
    o.initiator_name = initiator.into();
    Client::login(s.addr(), &o).await.expect("login")
}

const RESERVATION_CONFLICT: u8 = 0x18;
/// The reservation keys of the cluster test's initiators two and three.
const K2: u64 = 0x2222;
const K3: u64 = 0x3333;

/// Two nodes of one cluster serve one target: libiscsi's persistent-reservation and
/// multipath suites pass with their two I_T nexuses on different nodes; REPORT TARGET PORT
/// GROUPS from either node lists both nodes' groups; a reservation made through one node is
/// enforced by the other from the first command after it completed; PREEMPT AND ABORT
/// through one node aborts the preempted initiator's write in flight on the other (the write
/// never lands); a node killed shows unavailable, a reservation change still completes
/// (the dead node is fenced), and the node restarted catches up and is active again.
#[test]
fn a_cluster_of_two_nodes_shares_reservations_and_membership() {
    let Some(c) = Cluster::shared() else { return };
    for img in ["cl0", "cl1"] {
        c.create_shareable(img);
    }
    let target = "iqn.2026-11.org.ironsan:cluster-pr";
    let socks = tempfile::tempdir().unwrap();
    let sock = |n: u16| socks.path().join(format!("n{n}.sock"));
    let lun0 = c.spec("cl0", ",shared");
    // Node 1 holds writes to LUN 1 for 3 s, so that one is in flight when it is preempted.
    let lun1_held = c.spec("cl1", ",shared,fault=write@*:delay=3s");
    let lun1 = c.spec("cl1", ",shared");
    let start = |n: u16, lun1: &str| start_node(c, n, target, &[&lun0, lun1], &sock(n), &[]);
    let a = start(1, &lun1_held);
    let mut b = start(2, &lun1);
    let both_up = |v: &serde_json::Value| {
        let s = (node_state(v, 1), node_state(v, 2));
        (s.0 == "serving" || s.0 == "alive") && (s.1 == "serving" || s.1 == "alive")
    };
    wait_view(&sock(1), Duration::from_secs(20), both_up);
    wait_view(&sock(2), Duration::from_secs(20), both_up);

    if require_tools(&["iscsi-test-cu"]) {
        let urls = [a.url(0), b.url(0)];
        let out = run_unchecked(
            "iscsi-test-cu",
            &[
                "--dataloss",
                "-V",
                "-t",
                "SCSI.PrinReadKeys,SCSI.PrinServiceactionRange,SCSI.PrinReportCapabilities,\
                 SCSI.ProutRegister,SCSI.ProutReserve,SCSI.ProutClear,SCSI.ProutPreempt,\
                 SCSI.MultipathIO",
                &urls[0],
                &urls[1],
            ],
            Duration::from_secs(600),
        );
        // Judged as scripts/conformance.sh judges its runs: no failed test, and every skip
        // named in conformance/waivers.txt (this subset leaves the other waivers unused).
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("cluster-pr-multipath.log");
        let mut all = out.stdout.clone();
        all.extend_from_slice(&out.stderr);
        std::fs::write(&log, &all).unwrap();
        let root = env!("CARGO_MANIFEST_DIR");
        let status = out.status.code().unwrap_or(255);
        let verdict = run_unchecked(
            "python3",
            &[
                &format!("{root}/scripts/cunit_report.py"),
                "--waivers",
                &format!("{root}/conformance/waivers.txt"),
                "--allow-unused-waivers",
                &format!("{}:{status}", log.display()),
            ],
            Duration::from_secs(60),
        );
        let report = String::from_utf8_lossy(&verdict.stdout);
        eprintln!("{report}");
        assert!(
            verdict.status.success(),
            "libiscsi's PR and multipath suites across the two nodes:\n{report}"
        );
        // The summary line: "conformance: P passed, F failed, S skipped".
        let passed: u64 = report
            .lines()
            .find_map(|l| l.strip_prefix("conformance: "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no summary line:\n{report}"));
        assert!(passed >= 20, "only {passed} tests passed:\n{report}");
    }

    rt().block_on(async {
        let mut i1 = login_as(&a, "iqn.2026-11.org.test:one").await;
        let mut i2 = login_as(&b, "iqn.2026-11.org.test:two").await;
        // Both nodes report both groups: group N is node N, its port its portal group N.
        for cl in [&mut i1, &mut i2] {
            assert_eq!(
                port_groups(cl).await,
                vec![(1, 0, vec![1]), (2, 0, vec![2])],
                "REPORT TARGET PORT GROUPS"
            );
        }
        // Exclusive Access through node 1: node 2 refuses the other initiator's reads from
        // its first command after the PROUT completed, registered or not.
        let k1 = 0x1111u64;
        assert_eq!(
            prout(&mut i1, 0x00, 0, 0, k1).await.status,
            0,
            "REGISTER via node 1"
        );
        assert_eq!(
            prout(&mut i1, 0x01, 0x3, k1, 0).await.status,
            0,
            "RESERVE EA via node 1"
        );
        let read = read16_cdb(0, 8);
        assert_eq!(
            past_uas(&mut i2, &read, None, 4096).await.status,
            RESERVATION_CONFLICT
        );
        assert_eq!(
            prout(&mut i2, 0x00, 0, 0, K2).await.status,
            0,
            "REGISTER via node 2"
        );
        assert_eq!(
            past_uas(&mut i2, &read, None, 4096).await.status,
            RESERVATION_CONFLICT
        );
        let (gen_a, keys_a) = read_keys(&mut i1).await;
        assert_eq!(
            read_keys(&mut i2).await,
            (gen_a, keys_a.clone()),
            "both nodes agree"
        );
        assert_eq!(keys_a.len(), 2);

        // A write by initiator 1, held 3 s in node 1; PREEMPT AND ABORT through node 2 meanwhile.
        let (itt, _) = i1
            .send_write16(1, 4096, 4096, 512, Bytes::from(vec![0xAB; 4096]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            prout(&mut i2, 0x05, 0x1, K2, k1).await.status,
            0,
            "PREEMPT AND ABORT via node 2"
        );
        // The aborted write never answers (TAS=0) and never lands.
        let answer = tokio::time::timeout(Duration::from_secs(6), async {
            loop {
                match i1.recv().await {
                    Ok(p) => match p.header {
                        Header::ScsiResponse(r) if r.itt == itt => return Some(r.status),
                        _ => {}
                    },
                    Err(_) => return None,
                }
            }
        })
        .await;
        assert!(
            matches!(answer, Err(_) | Ok(None)),
            "the preempted write answered: {answer:?}"
        );
        let mut i3 = login_as(&b, "iqn.2026-11.org.test:three").await;
        let r = past_uas(&mut i3, &read16_cdb(4096, 8), None, 4096).await;
        assert_eq!(r.status, 0);
        assert!(r.data.iter().all(|&x| x == 0), "the aborted write landed");
        // Initiator 1 (through node 1): told its registration went, then refused writes
        // under the Write Exclusive reservation initiator 2 now holds.
        let mut i1 = login_as(&a, "iqn.2026-11.org.test:one").await;
        let r = i1.command(1, &[0, 0, 0, 0, 0, 0], None, 0).await.unwrap();
        let s = sense_of(&r);
        assert!(
            s == Some((0x6, 0x2A, 0x05)) || s == Some((0x6, 0x29, 0x00)) || r.status == 0,
            "{s:?}"
        );
        let w = write16_cdb(0, 1);
        let r = past_uas(&mut i1, &w, Some(Bytes::from(vec![1u8; 512])), 0).await;
        assert_eq!(r.status, RESERVATION_CONFLICT, "{:?}", sense_of(&r));
        assert_eq!(read_keys(&mut i1).await.1, vec![K2]);
    });

    // A node that answers cannot be forgotten, nor can a node forget itself.
    let ctl = |n: u16, args: &[&str]| {
        let sock = sock(n).display().to_string();
        let mut a = vec!["ctl", "--control", sock.as_str()];
        a.extend_from_slice(args);
        run_unchecked(bin(), &a, Duration::from_secs(30))
    };
    for (n, says) in [("2", "answers the heartbeat"), ("1", "is this node")] {
        let out = ctl(1, &["cluster", "forget", n]);
        assert_eq!(out.status.code(), Some(1), "{}", show(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(says),
            "{}",
            show(&out)
        );
    }
    // Node 2 killed: once its lease has run out node 1 fences it and reports its group
    // unavailable; a reservation change through node 1 completes.
    b.kill9();
    let seen = wait_view(&sock(1), Duration::from_secs(20), |v| {
        node_state(v, 2) == "fenced"
    });
    eprintln!("node 2 killed: fenced in node 1's view after {seen:?}");
    rt().block_on(async {
        let mut i4 = login_as(&a, "iqn.2026-11.org.test:four").await;
        let groups = port_groups(&mut i4).await;
        assert_eq!(
            groups,
            vec![(1, 0, vec![1]), (2, 3, vec![2])],
            "node 2 unavailable"
        );
        let t0 = Instant::now();
        assert_eq!(
            prout(&mut i4, 0x00, 0, 0, K3).await.status,
            0,
            "REGISTER, node 2 dead"
        );
        eprintln!(
            "a reservation change with node 2 dead took {:?}",
            t0.elapsed()
        );
    });
    // Forgotten (out of service for good), node 2 leaves node 1's port groups.
    let out = ctl(1, &["cluster", "forget", "2"]);
    assert!(out.status.success(), "{}", show(&out));
    rt().block_on(async {
        let mut i4 = login_as(&a, "iqn.2026-11.org.test:four").await;
        assert_eq!(
            port_groups(&mut i4).await,
            vec![(1, 0, vec![1])],
            "node 2 forgotten"
        );
    });
    // Node 2 comes back: it registers anew, has caught up before it serves, and node 1 sees
    // it active.
    b.start_again();
    wait_view(&sock(1), Duration::from_secs(20), |v| {
        node_state(v, 2) == "alive"
    });
    rt().block_on(async {
        let mut i2 = login_as(&b, "iqn.2026-11.org.test:two").await;
        let mut keys = read_keys(&mut i2).await.1;
        keys.sort_unstable();
        assert_eq!(keys, vec![K2, K3], "node 2 caught up on the reservations");
        let mut i4 = login_as(&a, "iqn.2026-11.org.test:four").await;
        assert_eq!(
            port_groups(&mut i4).await,
            vec![(1, 0, vec![1]), (2, 0, vec![2])],
            "node 2 active again"
        );
    });
    drop(a);
}

/// A node cut off from the cluster (its RADOS client blocklisted) stops acknowledging
/// writes and says so (`ctl cluster`: fenced); the other node goes on serving, and its
/// reservation changes complete.
#[test]
fn a_cluster_node_cut_off_stops_acknowledging_writes() {
    let Some(c) = Cluster::shared() else { return };
    for img in ["cut0", "cut1"] {
        c.create_shareable(img);
    }
    let target = "iqn.2026-11.org.ironsan:cluster-cut";
    let socks = tempfile::tempdir().unwrap();
    let sock = |n: u16| socks.path().join(format!("n{n}.sock"));
    let (lun0, lun1) = (c.spec("cut0", ",shared"), c.spec("cut1", ",shared"));
    let metrics = format!("127.0.0.1:{}", free_port());
    let metrics1 = format!("127.0.0.1:{}", free_port());
    let start = |n: u16, extra: &[&str]| start_node(c, n, target, &[&lun0, &lun1], &sock(n), extra);
    let (a, b) = (
        start(1, &["--metrics", &metrics1]),
        start(2, &["--metrics", &metrics]),
    );
    wait_view(&sock(1), Duration::from_secs(20), |v| {
        node_state(v, 2) == "alive"
    });
    wait_view(&sock(2), Duration::from_secs(20), |v| {
        node_state(v, 1) == "alive"
    });
    let scrape = || http_get(metrics.parse().unwrap(), "/metrics").1;
    let m = scrape();
    assert!(m.contains("ironsan_cluster_serving{node=\"2\"} 1"), "{m}");
    assert!(
        m.contains(&format!(
            "ironsan_cluster_node_up{{target=\"{target}\",node=\"1\"}} 1"
        )),
        "{m}"
    );
    let addr = cluster_view(&sock(2))["address"]
        .as_str()
        .expect("node 2's address")
        .to_string();
    let out = c.run("ceph", &["osd", "blocklist", "add", &addr]);
    assert!(out.status.success(), "{}", show(&out));
    rt().block_on(async {
        let mut ib = login(&b).await;
        let mut ia = login(&a).await;
        let w = |i: u64| Bytes::from(pattern(4096, i));
        let t0 = Instant::now();
        let mut i = 0;
        let refused = loop {
            let r = ib.write16(1, 0, w(i), 512, false).await.unwrap();
            if r.status != 0 && sense_of(&r).map(|s| s.0) != Some(0x6) {
                break r;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(90),
                "node 2 kept acknowledging writes"
            );
            i += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        eprintln!(
            "node 2 refused writes {:?} after its blocklisting: {:?}",
            t0.elapsed(),
            sense_of(&refused)
        );
        // Node 1 goes on, reservations included.
        for j in 0..5 {
            let r = ia.write16(1, 8, w(100 + j), 512, false).await.unwrap();
            assert!(
                r.status == 0 || sense_of(&r).map(|s| s.0) == Some(0x6),
                "{:?}",
                sense_of(&r)
            );
        }
        let r = ia.write16(1, 8, w(200), 512, false).await.unwrap();
        assert_eq!(r.status, 0, "{:?}", sense_of(&r));
        assert_eq!(prout(&mut ia, 0x00, 0, 0, 0x77).await.status, 0);
    });
    wait_view(&sock(2), Duration::from_secs(60), |v| {
        v["health"] == "fenced" || v["health"] == "partitioned"
    });
    let m = scrape();
    assert!(m.contains("ironsan_cluster_serving{node=\"2\"} 0"), "{m}");
    assert!(
        m.contains("ironsan_cluster_lease_remaining_seconds{node=\"2\"} 0"),
        "{m}"
    );
    // Node 1 fenced node 2 once node 2 stopped answering (its lease ran out): its view, its
    // metrics.
    wait_view(&sock(1), Duration::from_secs(30), |v| {
        node_state(v, 2) == "fenced"
    });
    let v = cluster_view(&sock(1));
    assert!(v["fences"].as_u64() >= Some(1), "{v:#}");
    assert_eq!(v["gate"]["open"], true, "{v:#}");
    let m1 = http_get(metrics1.parse().unwrap(), "/metrics").1;
    for want in [
        "ironsan_cluster_peer_state{peer=\"2\",state=\"fenced\"} 1",
        "ironsan_cluster_write_gate_open{node=\"1\"} 1",
        "ironsan_cluster_fences_total{node=\"1\"} 1",
    ] {
        assert!(m1.contains(want), "{want} not in\n{m1}");
    }
    assert!(
        m1.contains("ironsan_cluster_lease_remaining_seconds{node=\"1\"} "),
        "{m1}"
    );
    c.run("ceph", &["osd", "blocklist", "rm", &addr]);
    drop((a, b));
}

/// A node started with the number of a node that is running (answering pings) is refused at
/// start, naming it, rather than fencing it as a dead previous instance; the running node
/// goes on serving. Another group in the same pool (here: with another target) is another
/// cluster: the same number is no clash there.
#[test]
fn a_node_number_already_running_is_refused_and_groups_are_separate_clusters() {
    let Some(c) = Cluster::shared() else { return };
    c.create_shareable("dup0");
    let target = "iqn.2026-11.org.ironsan:cluster-dup";
    let socks = tempfile::tempdir().unwrap();
    let lun = c.spec("dup0", ",shared");
    let a = start_node(c, 1, target, &[&lun], &socks.path().join("a.sock"), &[]);
    let data = tempfile::tempdir().unwrap();
    let port = free_port();
    let (listen, dir) = (
        format!("127.0.0.1:{port}"),
        data.path().display().to_string(),
    );
    let flag = cluster_flag(c, target, 1);
    let out = run_unchecked(
        bin(),
        &[
            "serve",
            "--listen",
            &listen,
            "--data-dir",
            &dir,
            "--target",
            target,
            "--lun",
            &lun,
            "--cluster",
            &flag,
        ],
        Duration::from_secs(60),
    );
    assert!(
        !out.status.success(),
        "a second node 1 started: {}",
        show(&out)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("node 1 is running already"), "{}", show(&out));
    let v = cluster_view(&socks.path().join("a.sock"));
    assert_eq!(
        v["health"], "serving",
        "the running node 1 was not fenced: {v:#}"
    );
    // Node 1 of another group in the same pool: a cluster of its own.
    let other = start_node(
        c,
        1,
        "iqn.2026-11.org.ironsan:cluster-dup2",
        &[&lun],
        &socks.path().join("b.sock"),
        &[],
    );
    assert_eq!(
        cluster_view(&socks.path().join("b.sock"))["health"],
        "serving"
    );
    assert_eq!(
        cluster_view(&socks.path().join("a.sock"))["health"],
        "serving"
    );
    drop((a, other));
}
