#!/usr/bin/env bash
# Run the cargo-fuzz (libFuzzer) targets in fuzz/ one after another, each for a bounded time,
# and print the executions per target (docs/FUZZING.md).
#
#   scripts/fuzz.sh                     every target for 20 s (CI smoke)
#   scripts/fuzz.sh --seconds 600       every target for 10 minutes
#   scripts/fuzz.sh --long              every target for FUZZ_LONG_SECONDS (default 4 h)
#   scripts/fuzz.sh login chap          only these targets
#   scripts/fuzz.sh --asan ...          build with AddressSanitizer (slower)
#
# A stable toolchain is enough: cargo-fuzz's nightly flags are enabled with RUSTC_BOOTSTRAP=1.
# Fuzzers run nice'd, one at a time. New corpus entries go to fuzz/work/<target> (ignored by
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
# The fuzzed crates deny unsafe code, so AddressSanitizer buys little and halves the speed;
# --asan turns it back on (cargo-fuzz's default).
SAN="--sanitizer=none"
TARGETS=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --seconds) SECS=$2; shift ;;
        --seconds=*) SECS=${1#*=} ;;
        --long) SECS=${FUZZ_LONG_SECONDS:-14400} ;;
        --asan) SAN="" ;;
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
nice -n 10 cargo fuzz build $SAN

LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
declare -A EXECS STATUS
FAILED=0
for t in "${TARGETS[@]}"; do
    mkdir -p "work/$t" "corpus/$t"
    echo "==== $t: ${SECS}s ===="
    dict=()
    case $t in pdu_decode|text_negotiate|login|chap) dict=(-dict=dict/iscsi.dict) ;; esac
    set +e
    nice -n 10 cargo fuzz run $SAN "$t" "work/$t" "corpus/$t" -- \
        -max_total_time="$SECS" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
        "${dict[@]}" >"$LOGS/$t.log" 2>&1
    rc=$?
    set -e
    EXECS[$t]=$(awk '/stat::number_of_executed_units:/ { n = $2 } END { print n + 0 }' "$LOGS/$t.log")
    if [[ $rc -eq 0 ]]; then
        STATUS[$t]=ok
    else
        STATUS[$t]="CRASH (exit $rc)"
        FAILED=1
        grep -E -A12 'panicked at|ERROR: libFuzzer|SUMMARY' "$LOGS/$t.log" | head -40 || true
        ls -t "artifacts/$t" 2>/dev/null | head -3 | sed "s|^|    artifact: fuzz/artifacts/$t/|"
    fi
    tail -n 3 "$LOGS/$t.log" | grep -v '^$' || true
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
