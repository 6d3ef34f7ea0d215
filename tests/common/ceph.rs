//! A throwaway Ceph cluster for the tests (scripts/ceph-micro.sh): one monitor and one OSD,
//! cephx on, destroyed when the test process exits.

#![allow(dead_code)] // each test binary uses a different part

use crate::common::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

pub(crate) const MIB: u64 = 1 << 20;

/// A throwaway cluster (scripts/ceph-micro.sh).
pub(crate) struct Cluster {
    pub(crate) dir: PathBuf,
}

impl Cluster {
    /// Start one in a new directory; it is destroyed when this process exits.
    pub(crate) fn start(osd: &str) -> Cluster {
        Cluster::start_at(osd, None)
    }

    /// Start one whose monitor and OSD run in network namespace `netns` and bind `addr` (an
    /// address of that namespace this one can reach), e.g. so that tests can cut a gateway
    /// off from the cluster and nothing else.
    pub(crate) fn start_in(netns: &str, addr: &str) -> Cluster {
        Cluster::start_at("memstore", Some((netns, addr)))
    }

    fn start_at(osd: &str, ns: Option<(&str, &str)>) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("ironsan-ceph-")
            .tempdir()
            .expect("temp dir")
            .keep();
        // The script wants to create the directory's contents itself.
        let pid = std::process::id().to_string();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/ceph-micro.sh");
        let (script, dir_s) = (script.display().to_string(), dir.display().to_string());
        let mut args = vec![
            script.as_str(),
            "start",
            &dir_s,
            "--osd",
            osd,
            "--die-with",
            &pid,
        ];
        let out = match ns {
            None => run_unchecked("bash", &args, Duration::from_secs(180)),
            Some((netns, addr)) => {
                args.extend_from_slice(&["--addr", addr]);
                let mut full = vec!["netns", "exec", netns, "bash"];
                full.extend_from_slice(&args);
                run_unchecked("ip", &full, Duration::from_secs(180))
            }
        };
        assert!(out.status.success(), "ceph-micro.sh start: {}", show(&out));
        Cluster { dir }
    }

    /// The cluster shared by the tests that need no OSD restart (memstore).
    pub(crate) fn shared() -> Option<&'static Cluster> {
        static C: OnceLock<Cluster> = OnceLock::new();
        if !require_tools(&["ceph-mon", "ceph-osd", "ceph", "rbd"]) {
            return None;
        }
        Some(C.get_or_init(|| Cluster::start("memstore")))
    }

    pub(crate) fn conf(&self) -> PathBuf {
        self.dir.join("ceph.conf")
    }

    pub(crate) fn run(&self, tool: &str, args: &[&str]) -> std::process::Output {
        let conf = self.conf().display().to_string();
        let mut a = vec!["--conf", conf.as_str()];
        a.extend_from_slice(args);
        run_unchecked(tool, &a, Duration::from_secs(120))
    }

    pub(crate) fn rbd(&self, args: &[&str]) -> String {
        let out = self.run("rbd", args);
        assert!(out.status.success(), "rbd {args:?}: {}", show(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub(crate) fn ceph(&self, args: &[&str]) -> String {
        let out = self.run("ceph", args);
        assert!(out.status.success(), "ceph {args:?}: {}", show(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A new image of `size` bytes in pool `rbd`.
    pub(crate) fn create(&self, image: &str, size: u64) {
        self.rbd(&[
            "create",
            "--size",
            &format!("{}M", size / MIB),
            &format!("rbd/{image}"),
        ]);
    }

    /// The `--lun` spec of `image` with `extra` options.
    /// A 64 MiB image several nodes may serve (`layering` only: no exclusive lock).
    pub(crate) fn create_shareable(&self, image: &str) {
        self.rbd(&[
            "create",
            "--size",
            "64M",
            "--image-feature",
            "layering",
            &format!("rbd/{image}"),
        ]);
    }

    pub(crate) fn spec(&self, image: &str, extra: &str) -> String {
        format!("rbd:rbd/{image},conf={}{extra}", self.conf().display())
    }

    pub(crate) fn script(&self, cmd: &str) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/ceph-micro.sh");
        let out = run_unchecked(
            "bash",
            &[
                &script.display().to_string(),
                cmd,
                &self.dir.display().to_string(),
            ],
            Duration::from_secs(180),
        );
        assert!(out.status.success(), "ceph-micro.sh {cmd}: {}", show(&out));
    }
}
