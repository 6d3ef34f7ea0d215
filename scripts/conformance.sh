#!/usr/bin/env bash
# SCSI/iSCSI conformance run with libiscsi's iscsi-test-cu.
#
#   scripts/conformance.sh                 start ironsan on a free loopback port
#                                          (RAM LUN), run conformance/suites.txt
#   scripts/conformance.sh --all           run every iscsi-test-cu test (ALL), with
#                                          --allow-sanitize and, when ironsan is started
#                                          here, a second portal for the MultipathIO suite
#   scripts/conformance.sh --url URL       run against another target instead,
#                                          e.g. tgt (bench/peer-tgt.sh --lun rdwr:256M);
#                                          give --url twice for a multipath pair.
#                                          DESTRUCTIVE: --dataloss writes to that LUN.
#   --suites FILE / --waivers FILE         override conformance/{suites,waivers}.txt
#   --lun SPEC                             LUN 0 of the server this script starts
#   --serve-arg ARG                        one more argument for `ironsan serve` (repeatable)
#                                          (default ram:256M; e.g. file:lun0.img:256M)
#
# Env: IRONSAN_BIN (default target/release/ironsan), CONFORMANCE_TIMEOUT
# (seconds per iscsi-test-cu run; default 120, 1800 with --all),
# CONFORMANCE_LOG_DIR (default target/conformance).
#
# Verdict (scripts/cunit_report.py has the details): any failed test, any
# run without a CUnit summary, any pattern that matches no test, any
# skipped test not covered by a waiver, and (with --all) any waiver no
# skipped test used fails the run. The server dying during
# the run, or not exiting on SIGTERM, fails it too.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

die() { printf 'conformance: ERROR: %s\n' "$*" >&2; exit 2; }

ALL=0
URLS=()
SUITES=conformance/suites.txt
WAIVERS=conformance/waivers.txt
LUN=ram:256M
SERVE_ARGS=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --all) ALL=1; shift ;;
        --url) URLS+=("${2:?--url needs a value}"); shift 2 ;;
        --suites) SUITES=${2:?}; shift 2 ;;
        --waivers) WAIVERS=${2:?}; shift 2 ;;
        --lun) LUN=${2:?}; shift 2 ;;
        --serve-arg) SERVE_ARGS+=("${2:?}"); shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done

command -v iscsi-test-cu >/dev/null || die "iscsi-test-cu not found; run scripts/install-deps.sh"
[[ -f $WAIVERS ]] || die "waivers file $WAIVERS not found"

# Patterns: one per line, '#' starts a comment. Each becomes one
# iscsi-test-cu run (its own login), so one crashing suite cannot hide the
# results of the others.
PATTERNS=()
if [[ $ALL -eq 1 ]]; then
    PATTERNS=(ALL)
    TIMEOUT=${CONFORMANCE_TIMEOUT:-1800}
else
    [[ -f $SUITES ]] || die "suites file $SUITES not found"
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line%%#*}
        line=${line//[[:space:]]/}
        [[ -n $line ]] && PATTERNS+=("$line")
    done <"$SUITES"
    [[ ${#PATTERNS[@]} -gt 0 ]] || die "$SUITES lists no test patterns"
    TIMEOUT=${CONFORMANCE_TIMEOUT:-120}
fi

LOG_DIR=${CONFORMANCE_LOG_DIR:-$ROOT/target/conformance}
rm -rf "$LOG_DIR"
mkdir -p "$LOG_DIR"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ironsan-conformance.XXXXXX")

SERVER_PID=""
SERVER_LOG=$LOG_DIR/ironsan.log

pid_alive() { [[ -n $1 ]] && kill -0 "$1" 2>/dev/null; }

# Stop the server with SIGTERM (what it is documented to handle); returns 1 if
# it had to be killed. Runs from the EXIT trap too, so it never exits itself.
stop_server() {
    local pid=$SERVER_PID rc=0
    [[ -n $pid ]] || return 0
    SERVER_PID=""
    if pid_alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do pid_alive "$pid" || break; sleep 0.1; done
        if pid_alive "$pid"; then
            echo "conformance: ironsan did not exit within 10 s of SIGTERM; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
            rc=1
        fi
    fi
    wait "$pid" 2>/dev/null || true
    return $rc
}

cleanup() {
    stop_server || true
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

listening() { ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }

if [[ ${#URLS[@]} -eq 0 ]]; then
    TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
    BIN=${IRONSAN_BIN:-$TARGET_DIR/release/ironsan}
    [[ -x $BIN ]] || die "$BIN not found; build it first (cargo build --release)"
    PORT=$(free_port)
    IQN=iqn.2026-11.org.ironsan:conf
    LISTEN=(--listen "127.0.0.1:$PORT")
    if [[ $ALL -eq 1 ]]; then
        # A second portal to the same LU lets the MultipathIO suite run
        # instead of skipping ("Multipath unavailable").
        PORT2=$(free_port)
        LISTEN+=(--listen "127.0.0.1:$PORT2")
    fi
    NO_COLOR=1 "$BIN" serve "${LISTEN[@]}" --target "$IQN" --lun "$LUN" "${SERVE_ARGS[@]}" \
        --data-dir "$WORK/data" </dev/null >"$SERVER_LOG" 2>&1 &
    SERVER_PID=$!
    # Wait until the port is listening (checked with ss, so no probe
    # connection shows up in the target's log), failing fast if it exits.
    for _ in $(seq 300); do
        if ! pid_alive "$SERVER_PID"; then
            tail -n 30 "$SERVER_LOG" >&2
            die "ironsan exited during startup (log: $SERVER_LOG)"
        fi
        listening "$PORT" && break
        sleep 0.1
    done
    listening "$PORT" || { tail -n 30 "$SERVER_LOG" >&2; die "ironsan is not listening on 127.0.0.1:$PORT after 30 s"; }
    URLS=("iscsi://127.0.0.1:$PORT/$IQN/0")
    if [[ $ALL -eq 1 ]]; then
        for _ in $(seq 100); do listening "$PORT2" && break; sleep 0.1; done
        listening "$PORT2" || die "ironsan is not listening on its second portal 127.0.0.1:$PORT2"
        URLS+=("iscsi://127.0.0.1:$PORT2/$IQN/0")
    fi
fi

# -V: libiscsi logs verbosely, and some tests report their skips only then (NoMedia.NoMediaSBC,
# StartStopUnit.PwrCnd and NoLoej print "[SKIPPED] LUN is not removable" at LOG_VERBOSE).
CU_OPTS=(--dataloss -V)
# SANITIZE erases the whole LU; only the exhaustive run asks for it.
[[ $ALL -eq 0 ]] || CU_OPTS+=(--allow-sanitize)

echo "conformance: ${URLS[*]} (${#PATTERNS[@]} pattern(s), logs in ${LOG_DIR#"$ROOT"/})"
RUNS=()
i=0
for pat in "${PATTERNS[@]}"; do
    i=$((i + 1))
    log=$LOG_DIR/$(printf '%02d' "$i")-${pat//[^A-Za-z0-9._-]/_}.log
    rc=0
    timeout -k 10 "$TIMEOUT" iscsi-test-cu "${CU_OPTS[@]}" --test="$pat" "${URLS[@]}" >"$log" 2>&1 || rc=$?
    if [[ $rc -eq 124 ]]; then
        printf '\n[conformance.sh] timed out after %ss\n' "$TIMEOUT" >>"$log"
    elif [[ $rc -gt 128 && $rc -lt 192 ]]; then
        printf '\n[conformance.sh] iscsi-test-cu killed by signal %d\n' $((rc - 128)) >>"$log"
    fi
    RUNS+=("$log:$rc")
done

verdict=0
REPORT_OPTS=(--waivers "$WAIVERS")
# A run of some suites leaves the waivers of the others unused; an --all run uses every one.
[[ $ALL -eq 1 ]] || REPORT_OPTS+=(--allow-unused-waivers)
python3 "$ROOT/scripts/cunit_report.py" "${REPORT_OPTS[@]}" "${RUNS[@]}" || verdict=1

if [[ -n $SERVER_PID ]]; then
    if ! pid_alive "$SERVER_PID"; then
        echo "conformance: FAIL: ironsan died during the run; last lines of $SERVER_LOG:"
        tail -n 10 "$SERVER_LOG" | sed 's/^/  | /'
        verdict=1
    elif ! stop_server; then
        echo "conformance: FAIL: ironsan did not shut down on SIGTERM"
        verdict=1
    fi
fi

if [[ $verdict -ne 0 ]]; then
    echo "conformance: FAILED (full iscsi-test-cu output in ${LOG_DIR#"$ROOT"/})"
    exit 1
fi
echo "conformance: OK"
