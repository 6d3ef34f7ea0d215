#!/usr/bin/env bash
# Run the cargo-fuzz (libFuzzer) targets in fuzz/, each for a bounded time, as many at once
# as there are CPUs (--jobs), and print the executions per target (docs/FUZZING.md).
#
#   scripts/fuzz.sh                     every target for 20 s (CI smoke)
#   scripts/fuzz.sh --seconds 600       every target for 10 minutes
#   scripts/fuzz.sh --long              every target for FUZZ_LONG_SECONDS (default 4 h)
#   scripts/fuzz.sh login chap          only these targets
#   scripts/fuzz.sh --asan ...          build with AddressSanitizer (slower)
#   scripts/fuzz.sh --jobs 1 ...        one target at a time (default: one per CPU)
#
# A stable toolchain is enough: cargo-fuzz's nightly flags are enabled with RUSTC_BOOTSTRAP=1.
# Fuzzers run nice'd, each a single libFuzzer process. New corpus entries go to fuzz/work/<target> (ignored by
# git); fuzz/corpus/<target> holds the small committed seeds. Crashes land in
# fuzz/artifacts/<target>/; the exit status is non-zero if any target crashed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT/fuzz"

if ! command -v cargo >/dev/null 2>&1 && [[ -f ${HOME:-/root}/.cargo/env ]]; then
    # shellcheck source=/dev/null
    . "${HOME:-/root}/.cargo/env"
fi

ALL=(pdu_decode text_negotiate login chap scsi_execute write_transfer session)
SECS=20
# Without AddressSanitizer by default: it halves the speed, and the unsafe code the targets
# reach is small (the syscall layers of ironsan-backend and ironsan-server: the session
# target's sockets and file LUN, io_uring off); --asan turns it back on (cargo-fuzz's
# default) for long runs.
SAN="--sanitizer=none"
JOBS=$(nproc)
TARGETS=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --seconds) SECS=$2; shift ;;
        --seconds=*) SECS=${1#*=} ;;
        --long) SECS=${FUZZ_LONG_SECONDS:-14400} ;;
        --asan) SAN="" ;;
        --jobs) JOBS=$2; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        -*) echo "fuzz.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) TARGETS+=("$1") ;;
    esac
    shift
done
[[ ${#TARGETS[@]} -gt 0 ]] || TARGETS=("${ALL[@]}")

export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: cargo-fuzz missing; installing it from crates.io" >&2
    cargo install --locked cargo-fuzz
fi
# Runs shorter than 10 minutes (the smoke) build with 16 codegen units: 3m52 instead of 4m46
# for a cold build of every target here, at some cost in executions per second that a short
# run does not notice; longer runs keep cargo-fuzz's single unit. Build and run must agree,
# or the run builds again.
CGU=()
((SECS < 600)) && CGU=(--codegen-units 16)
nice -n 10 cargo fuzz build $SAN "${CGU[@]}"

LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
declare -A EXECS STATUS
FAILED=0
# fuzz_one TARGET: run it, its output in $LOGS/TARGET.log and its exit status in .rc.
fuzz_one() {
    local t=$1 dict=() rc=0
    mkdir -p "work/$t" "corpus/$t"
    case $t in pdu_decode|text_negotiate|login|chap) dict=(-dict=dict/iscsi.dict) ;; esac
    nice -n 10 cargo fuzz run $SAN "${CGU[@]}" "$t" "work/$t" "corpus/$t" -- \
        -max_total_time="$SECS" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
        "${dict[@]}" >"$LOGS/$t.log" 2>&1 || rc=$?
    echo "$rc" >"$LOGS/$t.rc"
}
running=0
for t in "${TARGETS[@]}"; do
    if ((running >= JOBS)); then
        wait -n || true
        running=$((running - 1))
    fi
    echo "==== $t: ${SECS}s ===="
    fuzz_one "$t" &
    running=$((running + 1))
done
wait
for t in "${TARGETS[@]}"; do
    rc=$(cat "$LOGS/$t.rc" 2>/dev/null || echo 1)
    EXECS[$t]=$(awk '/stat::number_of_executed_units:/ { n = $2 } END { print n + 0 }' "$LOGS/$t.log")
    if [[ $rc -eq 0 ]]; then
        STATUS[$t]=ok
    else
        STATUS[$t]="CRASH (exit $rc)"
        FAILED=1
        echo "---- $t ----"
        grep -E -A12 'panicked at|ERROR: libFuzzer|SUMMARY' "$LOGS/$t.log" | head -40 || true
        ls -t "artifacts/$t" 2>/dev/null | head -3 | sed "s|^|    artifact: fuzz/artifacts/$t/|"
    fi
done
echo
printf '%-16s %16s  %s\n' target executions status
total=0
for t in "${TARGETS[@]}"; do
    printf '%-16s %16s  %s\n' "$t" "${EXECS[$t]}" "${STATUS[$t]}"
    total=$((total + EXECS[$t]))
done
printf '%-16s %16s\n' total "$total"
exit $FAILED
