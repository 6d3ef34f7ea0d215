//! Shared by the tests of every crate in the workspace (a dev-dependency only).
//!
//! A test that needs something this machine lacks (a tool, root, a kernel feature, a file
//! system) calls [`skip`] and returns. Under `IRONSAN_REQUIRE_TOOLS=1` (scripts/test.sh and
//! CI set it) that is a failure naming what is missing, so a broken install cannot turn into
//! a green run. Otherwise the test says `skipped: <test>: <reason>` on stderr and, when
//! `IRONSAN_SKIP_LOG` names a file, appends that line to it: scripts/test.sh counts the lines
//! and prints the total at the end.

use std::io::Write;

/// Whether a test that cannot run must fail (`IRONSAN_REQUIRE_TOOLS=1`) instead of skipping.
pub fn required() -> bool {
    std::env::var("IRONSAN_REQUIRE_TOOLS").is_ok_and(|v| v == "1")
}

/// The calling test cannot run here because of `reason`: panics under
/// `IRONSAN_REQUIRE_TOOLS=1`; otherwise reports and records the skip. The caller returns
/// right after.
#[track_caller]
pub fn skip(reason: impl std::fmt::Display) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("unnamed test");
    if required() {
        panic!(
            "{test} cannot run: {reason} (IRONSAN_REQUIRE_TOOLS=1: a test that cannot run fails)"
        );
    }
    let line = format!("skipped: {test}: {reason}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("IRONSAN_SKIP_LOG") {
        let logged = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = logged {
            panic!("cannot record the skip in {}: {e}", path.to_string_lossy());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record is one line naming the test and the reason, appended (never truncating what
    /// other tests recorded). Both variables are read in a child process of this test binary,
    /// so the environment of the tests running beside it is not touched.
    #[test]
    fn a_skip_is_recorded_and_a_required_skip_fails() {
        if let Some(mode) = std::env::var_os("IRONSAN_TESTKIT_CHILD") {
            if mode == "skip" {
                skip("no such tool: frobnicate");
            }
            return;
        }
        let dir = std::env::temp_dir().join(format!("ironsan-testkit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("skips");
        std::fs::write(&log, "skipped: earlier: kept\n").unwrap();
        let me = std::env::current_exe().unwrap();
        let run = |require: &str| {
            std::process::Command::new(&me)
                .args([
                    "--exact",
                    "tests::a_skip_is_recorded_and_a_required_skip_fails",
                    "--nocapture",
                ])
                .env("IRONSAN_TESTKIT_CHILD", "skip")
                .env("IRONSAN_SKIP_LOG", &log)
                .env("IRONSAN_REQUIRE_TOOLS", require)
                .output()
                .unwrap()
        };
        let out = run("0");
        assert!(out.status.success(), "{out:?}");
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            text,
            "skipped: earlier: kept\nskipped: tests::a_skip_is_recorded_and_a_required_skip_fails: no such tool: frobnicate\n"
        );
        let out = run("1");
        assert!(!out.status.success(), "a required skip must fail: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("cannot run: no such tool: frobnicate"),
            "{stderr}"
        );
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            text,
            "a failure is not a skip"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
