#!/usr/bin/env bash
# Throughput and CPU-cost benchmark: ironsan against tgt, same client, same box.
#
#   bench/run.sh [--duration SECS] [--only ironsan|tgt] [--ironsan-lun SPEC] [--no-save]
#
# Builds nothing: it uses target/release/ironsan (or $IRONSAN_BIN), so run
# `cargo build --release` first.
#
# Method
#   * Each target runs alone (one after the other), pinned to CPU 0 with
#     taskset; the client, libiscsi's iscsi-perf, is pinned to CPU 1. With the
#     target confined to one core, "CPU per I/O" is a fair efficiency figure
#     even where IOPS are client-bound.
#   * ironsan serves a RAM LUN (ram:1G by default); tgt serves LUN 1 with
#     bstype null (tgt's LUN 0 is its controller pseudo-LUN). tgt's null
#     backend does no data copy at all, so the comparison is, if anything,
#     tilted towards tgt. Use --ironsan-lun null:1T for like-for-like.
#   * Workloads (iscsi-perf only issues READ16):
#       randread-4k-qd32    iscsi-perf -m 32 -b 8 -r      (4 KiB random, 32 in flight)
#       seqread-512k-qd8    iscsi-perf -m 8 -b 1024       (512 KiB sequential, 8 in flight)
#     each for --duration seconds (default 10) via iscsi-perf's own -t; the
#     figure used is its final "iops average".
#   * Target CPU time is utime+stime of the whole process (all threads) from
#     /proc/PID/stat, sampled right before and after each iscsi-perf run.
#     CPU % = CPU seconds / wall seconds; CPU us/IO = CPU seconds / I/Os done.
#
# The table is printed and appended, with uname -a, nproc and the CPU model,
# to bench/results/<date>-<hostname>.txt (unless --no-save).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

die() { printf 'bench: ERROR: %s\n' "$*" >&2; exit 1; }

DURATION=10
ONLY=""
IRONSAN_LUN=ram:1G
SAVE=1
while [[ $# -gt 0 ]]; do
    case $1 in
        --duration) DURATION=${2:?}; shift 2 ;;
        --only) ONLY=${2:?}; shift 2 ;;
        --ironsan-lun) IRONSAN_LUN=${2:?}; shift 2 ;;
        --no-save) SAVE=0; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
[[ $DURATION =~ ^[1-9][0-9]*$ ]] || die "--duration must be a positive integer"
case $ONLY in ""|ironsan|tgt) ;; *) die "--only takes ironsan or tgt" ;; esac

TARGETS=(ironsan tgt)
[[ -z $ONLY ]] || TARGETS=("$ONLY")

WORKLOADS=(
    "randread-4k-qd32|-m 32 -b 8 -r"
    "seqread-512k-qd8|-m 8 -b 1024"
)

for tool in iscsi-perf taskset ss python3; do
    command -v "$tool" >/dev/null || die "$tool not found; run scripts/install-deps.sh"
done
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
BIN=${IRONSAN_BIN:-$TARGET_DIR/release/ironsan}
if [[ " ${TARGETS[*]} " == *" ironsan "* ]]; then
    [[ -x $BIN ]] || die "$BIN not found: bench/run.sh builds nothing, run 'cargo build --release' first (or --only tgt)"
fi

NCPU=$(nproc)
# Other work on the box (a cargo build, say) skews every figure; record it.
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
if awk -v l="${LOAD_BEFORE%% *}" 'BEGIN { exit !(l > 0.5) }'; then
    echo "bench: WARNING: load average is $LOAD_BEFORE before starting; figures will be noisy" >&2
fi
if [[ $NCPU -ge 2 ]]; then
    TARGET_CPU=0 CLIENT_CPU=1
else
    echo "bench: WARNING: only one CPU; target and client share it" >&2
    TARGET_CPU=0 CLIENT_CPU=0
fi
CLK_TCK=$(getconf CLK_TCK)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ironsan-bench.XXXXXX")
IRONSAN_PID=""
TGT_UP=0

stop_ironsan() {
    local pid=$IRONSAN_PID
    [[ -n $pid ]] || return 0
    IRONSAN_PID=""
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

stop_tgt() {
    [[ $TGT_UP -eq 1 ]] || return 0
    TGT_UP=0
    bash "$ROOT/bench/peer-tgt.sh" stop --dir "$WORK/tgt" || true
}

cleanup() {
    stop_ironsan
    stop_tgt
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
listening() { ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }

# utime + stime (clock ticks) of the whole thread group. Field positions are
# counted after the ")" that ends the command name, which may contain spaces.
cpu_ticks() {
    local stat
    stat=$(<"/proc/$1/stat") || die "process $1 is gone"
    stat=${stat##*) }
    # shellcheck disable=SC2086  # deliberate word splitting into fields
    set -- $stat
    # $1 is field 3 (state); utime is field 14, stime field 15.
    echo $((${12} + ${13}))
}

start_ironsan() {
    local port
    port=$(free_port)
    local iqn=iqn.2026-11.org.ironsan:bench
    NO_COLOR=1 taskset -c "$TARGET_CPU" "$BIN" serve --listen "127.0.0.1:$port" --target "$iqn" \
        --lun "$IRONSAN_LUN" --data-dir "$WORK/ironsan-data" </dev/null >"$WORK/ironsan.log" 2>&1 &
    IRONSAN_PID=$!
    for _ in $(seq 300); do
        kill -0 "$IRONSAN_PID" 2>/dev/null || { cat "$WORK/ironsan.log" >&2; die "ironsan exited during startup"; }
        listening "$port" && break
        sleep 0.1
    done
    listening "$port" || die "ironsan is not listening on 127.0.0.1:$port"
    TARGET_PID=$IRONSAN_PID
    TARGET_URL=iscsi://127.0.0.1:$port/$iqn/0
}

start_tgt() {
    local port
    port=$(free_port)
    TARGET_URL=$(bash "$ROOT/bench/peer-tgt.sh" start --port "$port" --dir "$WORK/tgt" \
        --cpu "$TARGET_CPU" --lun null)
    TGT_UP=1
    TARGET_PID=$(<"$WORK/tgt/tgtd.pid")
}

ROWS=$WORK/rows.tsv
: >"$ROWS"

# measure TARGET WORKLOAD ARGS...
measure() {
    local target=$1 workload=$2; shift 2
    local log=$WORK/$target-$workload.log
    local c0 c1 t0 t1 rc=0
    c0=$(cpu_ticks "$TARGET_PID")
    t0=$(date +%s%N)
    taskset -c "$CLIENT_CPU" timeout -s INT -k 10 $((DURATION + 30)) \
        iscsi-perf -t "$DURATION" "$@" "$TARGET_URL" >"$log" 2>&1 || rc=$?
    t1=$(date +%s%N)
    c1=$(cpu_ticks "$TARGET_PID")
    # iscsi-perf redraws its status line with \r; the final figure is the
    # last "iops average N" on the output.
    local iops cap_blocks cap_bytes
    iops=$(tr '\r' '\n' <"$log" | sed -n 's/.*iops average \([0-9][0-9]*\).*/\1/p' | tail -n 1)
    read -r cap_blocks cap_bytes < <(sed -n 's/^capacity is \([0-9]*\) blocks or \([0-9]*\) byte.*/\1 \2/p' "$log") || true
    if [[ $rc -ne 0 || -z $iops || -z ${cap_blocks:-} ]] || grep -qiE 'failed|ABORTED' "$log"; then
        tr '\r' '\n' <"$log" | tail -n 5 >&2
        die "iscsi-perf against $target ($workload) failed (exit $rc)"
    fi
    [[ $iops -gt 0 ]] || die "iscsi-perf against $target ($workload) reported 0 IOPS"
    local bs=$((cap_bytes / cap_blocks))
    local blocks
    blocks=$(sed -n 's/.*transfer size of \([0-9]*\) blocks.*/\1/p' "$log")
    [[ -n $blocks ]] || die "cannot find the transfer size in iscsi-perf's output"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$workload" "$target" "$iops" "$((blocks * bs))" \
        "$((c1 - c0))" "$CLK_TCK" "$((t1 - t0))" >>"$ROWS"
    printf 'bench: %-8s %-18s %8s IOPS\n' "$target" "$workload" "$iops" >&2
}

for target in "${TARGETS[@]}"; do
    "start_$target"
    echo "bench: $target at $TARGET_URL (pid $TARGET_PID, CPU $TARGET_CPU; client CPU $CLIENT_CPU)" >&2
    for w in "${WORKLOADS[@]}"; do
        name=${w%%|*}
        read -r -a args <<<"${w#*|}"
        measure "$target" "$name" "${args[@]}"
    done
    "stop_$target"
done

TABLE=$(python3 - "$ROWS" <<'EOF'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
res = {}
order = []
for workload, target, iops, io_bytes, ticks, hz, wall_ns in rows:
    iops, io_bytes, ticks, hz, wall_ns = int(iops), int(io_bytes), int(ticks), int(hz), int(wall_ns)
    cpu_s = ticks / hz
    wall_s = wall_ns / 1e9
    cpu_pct = 100.0 * cpu_s / wall_s
    us_per_io = cpu_pct / 100.0 * 1e6 / iops
    res[(workload, target)] = (iops, iops * io_bytes / 1048576, cpu_pct, us_per_io)
    if workload not in order:
        order.append(workload)
hdr = f"{'workload':<18} {'target':<12} {'IOPS':>10} {'MiB/s':>9} {'CPU %':>9} {'CPU us/IO':>10}"
print(hdr)
print("-" * len(hdr))
for w in order:
    for t in ("ironsan", "tgt"):
        if (w, t) in res:
            i, m, c, u = res[(w, t)]
            print(f"{w:<18} {t:<12} {i:>10d} {m:>9.1f} {c:>9.1f} {u:>10.2f}")
    if (w, "ironsan") in res and (w, "tgt") in res:
        a, b = res[(w, "ironsan")], res[(w, "tgt")]
        r = [x / y if y else float("nan") for x, y in zip(a, b)]
        print(f"{w:<18} {'ironsan/tgt':<12} {r[0]:>10.2f} {r[1]:>9.2f} {r[2]:>9.2f} {r[3]:>10.2f}")
EOF
)

REPORT=$(
    echo "=== $(date -Is)  ironsan $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet 2>/dev/null || echo '+dirty') ==="
    echo "uname: $(uname -a)"
    echo "nproc: $NCPU   cpu: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)"
    echo "targets pinned to CPU $TARGET_CPU, iscsi-perf to CPU $CLIENT_CPU; ${DURATION}s per workload; loadavg before: $LOAD_BEFORE"
    echo "ironsan LUN: $IRONSAN_LUN; tgt $(tgtd -V 2>/dev/null | head -n 1 || echo '?') LUN 1: bstype null; client: $(dpkg-query -W -f='libiscsi-bin ${Version}' libiscsi-bin 2>/dev/null || echo 'iscsi-perf')"
    echo "$TABLE"
)
echo "$REPORT"
if [[ $SAVE -eq 1 ]]; then
    mkdir -p "$ROOT/bench/results"
    out=$ROOT/bench/results/$(date +%F)-$(uname -n).txt
    { echo "$REPORT"; echo; } >>"$out"
    echo "bench: appended to ${out#"$ROOT"/}" >&2
fi
