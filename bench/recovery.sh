#!/usr/bin/env bash
# What ErrorRecoveryLevel 1 costs when nothing goes wrong: the target keeps every Data-In and
# status until the initiator acknowledges it (for SNACKs), reads go through memory and writes
# through a buffer. One ironsan binary, `ironsan load` offering ErrorRecoveryLevel 0 or 1,
# alternated per round (bench/ab.sh: target on CPU 0, client on CPU 1), on a RAM LUN.
#
#   bench/recovery.sh [--rounds N] [--secs S] [BIN]     (default: 4 rounds of 8 s,
#                                                        target/release/ironsan)
#
# Prints bench/ab.sh's lines per workload ("old" = level 0, "new" = level 1: IOPS, target
# CPU per I/O, peak RSS) and the ratio of the medians.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=4 secs=8
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --secs) secs=$2; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) break ;;
    esac
done
bin=${1:-target/release/ironsan}
[[ -x $bin ]] || { echo "bench/recovery.sh: $bin is not an executable (cargo build --release)" >&2; exit 2; }
echo "recovery: $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPUs, $(uname -r)"
for w in "--rw randread --bs 4096 --qd 32" "--rw randwrite --bs 4096 --qd 32" \
         "--rw read --bs 524288 --qd 8" "--rw write --bs 524288 --qd 8"; do
    echo
    echo "== $w (old = ErrorRecoveryLevel 0, new = 1)"
    # shellcheck disable=SC2086 # the workload is a list of arguments
    bash bench/ab.sh --load --prefill --rounds "$rounds" --secs "$secs" --lun ram:1G \
        --old-arg --erl=0 --new-arg --erl=1 "$bin" "$bin" -- $w | tee /tmp/ironsan-recovery-ab.$$
    python3 - /tmp/ironsan-recovery-ab.$$ <<'PY'
import statistics, sys
rows = {"old": [], "new": []}
for line in open(sys.argv[1]):
    f = line.split()
    if f and f[0] in rows and "IOPS" in f:
        rows[f[0]].append((int(f[1]), float(f[f.index("us/IO") - 1])))
if rows["old"] and rows["new"]:
    o = statistics.median(r[0] for r in rows["old"]); n = statistics.median(r[0] for r in rows["new"])
    oc = statistics.median(r[1] for r in rows["old"]); nc = statistics.median(r[1] for r in rows["new"])
    print(f"median: level 0 {o:,.0f} IOPS ({oc:.2f} us/IO), level 1 {n:,.0f} IOPS ({nc:.2f} us/IO): "
          f"{n / o:.2f}x IOPS, {nc / oc:.2f}x CPU per I/O")
PY
    rm -f /tmp/ironsan-recovery-ab.$$
done
