#!/usr/bin/env bash
# The one test command (README, CI via .ci/run):
#
#   scripts/test.sh            deps, fmt, clippy, build (profile ci), tests, conformance
#   scripts/test.sh --quick    the same without fmt/clippy/shellcheck
#   scripts/test.sh --long     also run long soak modes (IRONSAN_LONG=1)
#
# Stops at the first failing step with a non-zero exit status. Ends with one line counting
# the tests run: cargo's tests, libiscsi's (conformance) and the scripted end-to-end steps,
# passed, failed and skipped. A test that cannot run on this machine is a skip
# (ironsan-testkit's `skip`, recorded in $IRONSAN_SKIP_LOG); under IRONSAN_REQUIRE_TOOLS=1,
# as here, it fails instead, so a CI run shows 0 skipped. libiscsi's waived skips
# (conformance/waivers.txt) are counted apart.
#
# The workspace tests run with IRONSAN_REQUIRE_TOOLS=1: tests that drive
# external initiators (iscsi-test-cu, qemu-img, ...) fail instead of
# skipping when a tool is missing, so a broken install cannot turn into a
# quietly green run. IRONSAN_BIN points them at the binary built here (profile ci).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

QUICK=0
for arg in "$@"; do
    case $arg in
        --quick) QUICK=1 ;;
        --long) export IRONSAN_LONG=1 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) echo "test.sh: unknown argument: $arg (see --help)" >&2; exit 2 ;;
    esac
done

# cargo may not be on PATH in a non-login shell (CI, sudo).
if ! command -v cargo >/dev/null 2>&1 && [[ -f ${HOME:-/root}/.cargo/env ]]; then
    # shellcheck source=/dev/null
    . "${HOME:-/root}/.cargo/env"
fi

START=$(date +%s)
SECTION=""
SECTION_START=$START
TALLY=$(mktemp -d "${TMPDIR:-/tmp}/ironsan-test-tally.XXXXXX")
export IRONSAN_SKIP_LOG=$TALLY/skips
: >"$IRONSAN_SKIP_LOG"
# Totals: cargo tests, libiscsi tests, scripted steps.
declare -A N=([passed]=0 [failed]=0 [skipped]=0 [ignored]=0 [cu_passed]=0 [cu_failed]=0 [cu_waived]=0 [steps]=0)

# tally LOG: add the counts of a step's output (cargo's "test result:" lines, the
# conformance report's closing line) and print them for the step.
tally() {
    local log=$1 p f i cp cf cs
    read -r p f i < <(awk '/^test result:/ { for (k = 1; k <= NF; k++) { if ($(k+1) ~ /^passed/) p += $k; if ($(k+1) ~ /^failed/) f += $k; if ($(k+1) ~ /^ignored/) i += $k } } END { print p + 0, f + 0, i + 0 }' "$log")
    read -r cp cf cs < <(awk '/^conformance: [0-9]+ passed/ { p += $2; f += $4; s += $6 } END { print p + 0, f + 0, s + 0 }' "$log")
    N[passed]=$((N[passed] + p)); N[failed]=$((N[failed] + f)); N[ignored]=$((N[ignored] + i))
    N[cu_passed]=$((N[cu_passed] + cp)); N[cu_failed]=$((N[cu_failed] + cf)); N[cu_waived]=$((N[cu_waived] + cs))
    if ((p + f + i)); then printf '    (tests in this step: %d passed, %d failed, %d ignored)\n' "$p" "$f" "$i"; fi
    if ((cp + cf + cs)); then printf '    (libiscsi tests in this step: %d passed, %d failed, %d skipped and waived)\n' "$cp" "$cf" "$cs"; fi
}

# run_logged CMD...: run it with its output shown and kept for tally.
run_logged() {
    local log=$TALLY/step.log rc=0
    "$@" 2>&1 | tee "$log" || rc=$?
    tally "$log"
    return $rc
}

# run_pair "CMD A" "CMD B": two independent steps at once (each a loopback server and its
# client, which leave a CPU idle between round trips), their outputs shown one after the other
# and tallied; fails if either does.
run_pair() {
    local a=$TALLY/pair-a.log b=$TALLY/pair-b.log ra=0 rb=0 pa pb
    bash -c "$1" >"$a" 2>&1 &
    pa=$!
    bash -c "$2" >"$b" 2>&1 &
    pb=$!
    wait "$pa" || ra=$?
    wait "$pb" || rb=$?
    cat "$a"; tally "$a"
    cat "$b"; tally "$b"
    ((ra == 0 && rb == 0))
}

# step_passed: one scripted end-to-end check (a guest, the package, a benchmark smoke) passed.
step_passed() { N[steps]=$((N[steps] + 1)); }

fmt_secs() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

end_section() {
    if [[ -n $SECTION ]]; then
        printf '    (%s: %s)\n' "$SECTION" "$(fmt_secs $(($(date +%s) - SECTION_START)))"
    fi
}

section() {
    end_section
    SECTION=$1
    SECTION_START=$(date +%s)
    printf '\n==== %s ====\n' "$SECTION"
}

on_exit() {
    local rc=$?
    local total skipped
    total=$(fmt_secs $(($(date +%s) - START)))
    skipped=$(grep -c '^skipped:' "$IRONSAN_SKIP_LOG" 2>/dev/null || true)
    if [[ $rc -eq 0 ]]; then
        end_section
    fi
    if ((skipped)); then
        echo "Skipped tests (a tool, right or kernel feature missing):"
        sed 's/^/  /' "$IRONSAN_SKIP_LOG"
    fi
    printf '\n==== tests: %d passed, %d failed, %d skipped (%d ignored); libiscsi: %d passed, %d failed, %d waived skips; end-to-end steps: %d passed ====\n' \
        "${N[passed]}" "${N[failed]}" "${skipped:-0}" "${N[ignored]}" "${N[cu_passed]}" "${N[cu_failed]}" "${N[cu_waived]}" "${N[steps]}"
    rm -rf "$TALLY"
    if [[ $rc -eq 0 ]]; then
        printf '\n==== ALL PASSED (total %s) ====\n' "$total"
    else
        printf '\n==== FAILED in step "%s" (exit %d, total %s) ====\n' "$SECTION" "$rc" "$total"
    fi
}
trap on_exit EXIT

TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}

section "install dependencies"
bash scripts/install-deps.sh

if [[ $QUICK -eq 0 ]]; then
    section "cargo fmt --check"
    cargo fmt --all -- --check

    section "cargo clippy"
    cargo clippy --workspace --all-targets -- -D warnings

    section "cargo deny (licences, bans, sources; deny.toml)"
    # Installed from crates.io when missing (about 3 minutes on two cores). Advisories need the
    # RustSec database from GitHub, which these machines cannot reach (deny.toml says more).
    if ! command -v cargo-deny >/dev/null; then
        cargo install --locked --no-default-features cargo-deny --version 0.20.2
    fi
    # cargo-deny reads `cargo metadata` for every platform, offline: the crates of other
    # platforms (never built here) must be in the local registry too.
    cargo fetch --locked
    cargo deny --offline check licenses bans sources

    section "shellcheck"
    # Gate on warnings and errors; info-level notes (e.g. SC2317 "unreachable"
    # for functions only called from traps) are advice, not defects.
    shellcheck -S warning scripts/*.sh bench/*.sh packaging/*.sh .ci/run tests/kernel/build-initramfs.sh tests/kernel/common.sh
    shellcheck -S warning -s sh tests/kernel/init tests/kernel/init-multipath

    section "fuzz smoke (scripts/fuzz.sh: every target briefly; docs/FUZZING.md for long runs)"
    bash scripts/fuzz.sh --seconds "${FUZZ_SECONDS:-10}"
fi

# Everything below builds and tests the `ci` profile (Cargo.toml): release optimisation without
# thin LTO and debug info, which halves the build of the test binaries. `cargo build --release`
# (what users and the benchmarks run) differs only in how it links.
PROFILE=${IRONSAN_TEST_PROFILE:-ci}
section "cargo build --profile $PROFILE"
cargo build --profile "$PROFILE"

section "third-party MC/S initiator (tests/mcs-peer: iscsi-client-rs, a test tool)"
# A separate package (AGPL, never linked into ironsan); tests/system/clients.rs runs it. A
# debug build: it is a test tool, and its speed is not what is tested.
CARGO_TARGET_DIR="$TARGET_DIR/mcs-peer" cargo build --manifest-path tests/mcs-peer/Cargo.toml
export IRONSAN_MCS_PEER="$TARGET_DIR/mcs-peer/debug/ironsan-mcs-peer"

section "cargo test --workspace --profile $PROFILE"
export IRONSAN_REQUIRE_TOOLS=1 IRONSAN_BIN="$TARGET_DIR/$PROFILE/ironsan"
# The fencing scenarios run on their own after the rest: they pause and cut off cluster
# nodes on a two-second lease, which a heavy test beside them would only make noisier.
run_logged cargo test --workspace --profile "$PROFILE" --lib --bins --tests -- --skip fencing::

section "cargo test: gateways paused or cut off (tests/system/fencing.rs, network namespaces)"
# The same selection of packages as above (--workspace), so nothing is built again.
run_logged cargo test --workspace --profile "$PROFILE" --test system fencing::

section "conformance (iscsi-test-cu ALL: RAM LUN, file LUN, 4K-physical and read-only passes)"
# The report parser guards the verdict, so check it can still fail first.
python3 scripts/cunit_report.py --self-test
# Every test on a RAM LUN and on a file LUN; skips must be in conformance/waivers.txt, and
# every waiver must be used.
# The file LUN with zero-copy reads forced on (this host's BBR would turn "auto" off), so
# libiscsi's whole suite reads through sendfile. The passes run two at a time.
# Each pass of a pair keeps its logs in a directory of its own.
run_pair "CONFORMANCE_LOG_DIR=target/conformance-ram bash scripts/conformance.sh --all --lun ram:256M" \
    "CONFORMANCE_LOG_DIR=target/conformance-file bash scripts/conformance.sh --all --lun file:lun0.img:256M --serve-arg --zero-copy-reads --serve-arg on"
# The waived tests that need another LU shape, run on that shape with no waivers.
run_pair "CONFORMANCE_LOG_DIR=target/conformance-pbs4k bash scripts/conformance.sh --suites conformance/suites-pbs4k.txt --waivers conformance/no-waivers.txt --lun ram:256M,pbs=4096" \
    "CONFORMANCE_LOG_DIR=target/conformance-ro bash scripts/conformance.sh --suites conformance/suites-readonly.txt --waivers conformance/no-waivers.txt --lun ram:256M,ro"

section "conformance on an RBD LUN (a throwaway Ceph cluster: scripts/ceph-micro.sh)"
CEPH_DIR=$(mktemp -d /tmp/ironsan-ceph-ci.XXXXXX)
rmdir "$CEPH_DIR"
bash scripts/ceph-micro.sh start "$CEPH_DIR" --die-with $$ >/dev/null
rbd --conf "$CEPH_DIR/ceph.conf" create --size 256M rbd/conformance
run_logged bash scripts/conformance.sh --all --lun "rbd:rbd/conformance,conf=$CEPH_DIR/ceph.conf"
bash scripts/ceph-micro.sh destroy "$CEPH_DIR"

section "linux kernel initiator (open-iscsi in a QEMU guest)"
bash scripts/kernel-initiator.sh
step_passed
# Again without digests: the guest's reads then come by sendfile (zero-copy reads forced on).
IRONSAN_KERNEL_DIGEST=None bash scripts/kernel-initiator.sh
step_passed

section "linux dm-multipath with ALUA (two paths in a QEMU guest, states and a portal changed under a verified write stream)"
bash scripts/kernel-multipath.sh
step_passed

section "linux dm-multipath across two cluster nodes (one RBD image; node 1 killed and restarted under a verified write stream)"
bash scripts/kernel-multipath.sh --cluster
step_passed

section "benchmark report (bench/report.py on the checked-in run, opened in headless Chromium)"
bash scripts/report-test.sh
step_passed

section "Debian package (packaging/build-deb.sh: install, serve from the installed config, remove, purge)"
bash scripts/package-test.sh
step_passed

section "bench smoke (bench/run.sh, 1 s per workload: the tool works, figures not judged)"
# Every client against every target once, interleaved as in a real run; exits 1 if any
# client run fails. Idle and memory are left out (about 2 minutes of waiting between them).
bash bench/run.sh --duration 1 --only ram,qd1,scale,file,load,disk --no-save
step_passed
# The RBD section on small images (its own throwaway cluster; of the restarts after kill -9,
# only the one with its lock-owner record: the other waits ~30 s for librbd).
RBD_MB=64 bash bench/run.sh --duration 1 --only rbd --no-save
step_passed

section "classic experiments smoke (bench/classic.sh --quick: every experiment once, figures not judged)"
# Namespaces, veth lines with tbf, every peer; exits 1 if any client run fails.
bash bench/classic.sh --quick --no-save
step_passed
