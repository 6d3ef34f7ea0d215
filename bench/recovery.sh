#!/usr/bin/env bash
# Error recovery, measured.
#
# 1. What ErrorRecoveryLevel 1 costs when nothing goes wrong: the target keeps every Data-In
#    and status until the initiator acknowledges it (for SNACKs), reads go through memory and
#    writes through a buffer. One ironsan binary, `ironsan load` offering ErrorRecoveryLevel 0
#    or 1, alternated per round (bench/ab.sh: target on CPU 0, client on CPU 1), on a RAM LUN.
#    Prints bench/ab.sh's lines per workload ("old" = level 0, "new" = level 1: IOPS, target
#    CPU per I/O, peak RSS) and the ratio of the medians. (Level 2 adds nothing to this path.)
# 2. How long connection recovery (level 2) takes: `ironsan cuts` against a RAM LUN (target on
#    CPU 0, client on CPU 1), one connection of the session cut every round with commands in
#    flight, its commands reassigned to the other connection: time from the cut to the
#    logout-for-recovery's answer and to the last status of the reassigned commands, and the
#    verification of every block.
#
#   bench/recovery.sh [--rounds N] [--secs S] [--cuts N] [--only-cuts] [BIN]
#       (default: 4 rounds of 8 s, 200 cuts, target/release/ironsan)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=4 secs=8 cuts=200 only_cuts=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --secs) secs=$2; shift 2 ;;
        --cuts) cuts=$2; shift 2 ;;
        --only-cuts) only_cuts=1; shift ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) break ;;
    esac
done
bin=${1:-target/release/ironsan}
[[ -x $bin ]] || { echo "bench/recovery.sh: $bin is not an executable (cargo build --release)" >&2; exit 2; }
echo "recovery: $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPUs, $(uname -r)"
[[ $only_cuts == 1 ]] || for w in "--rw randread --bs 4096 --qd 32" "--rw randwrite --bs 4096 --qd 32" \
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

echo
echo "== connection recovery: ironsan cuts, $cuts rounds (ErrorRecoveryLevel 2, RAM LUN)"
port=$((20000 + RANDOM % 20000))
dir=$(mktemp -d)
taskset -c 0 "$bin" serve --listen "127.0.0.1:$port" --lun ram:512M >"$dir/serve.log" 2>&1 &
serve=$!
trap 'kill $serve 2>/dev/null; wait $serve 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 50); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    sleep 0.1
done
url="iscsi://127.0.0.1:$port/iqn.2026-11.org.ironsan:default/0"
for w in "--bs 65536 --depth 8" "--bs 4096 --depth 32" "--bs 1048576 --depth 4"; do
    echo "-- $w"
    # shellcheck disable=SC2086 # the workload is a list of arguments
    taskset -c 1 "$bin" cuts "$url" --rounds "$cuts" --regions 256 $w
done
