#!/usr/bin/env bash
# User-space instructions the target executes per I/O, counted by callgrind: a figure that,
# unlike CPU time on this shared box, does not move between runs, for before/after
# comparisons of changes to the per-command path.
#
#   bench/instructions.sh [--count N] BIN [BIN...] [-- LOAD_ARGS...]
#
#   BIN        ironsan binaries to compare (e.g. a build of the parent commit and
#              target/release/ironsan)
#   --count N  I/Os per measurement (default 20000)
#   LOAD_ARGS  `ironsan load` workload (default: --rw randread --bs 4096 --qd 32)
#
# Each binary serves a 64 MiB RAM LUN under valgrind --tool=callgrind twice, driven by the
# first binary's `ironsan load` (the LUN written once first, a warm-up, then N and 2N I/Os);
# the difference of the two totals divided by N is the per-I/O figure, so start-up, login
# and the warm-up cancel out. Kernel work (syscalls, TCP) is not counted: this measures the
# target's own code, and under valgrind the target is slow, so batches are larger than on a
# real run. Needs valgrind.
set -euo pipefail

count=20000
bins=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --count) count=$2; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) bins+=("$1"); shift ;;
    esac
done
load_args=("$@")
[[ ${#load_args[@]} -gt 0 ]] || load_args=(--rw randread --bs 4096 --qd 32)
[[ ${#bins[@]} -gt 0 ]] || { echo "usage: bench/instructions.sh [--count N] BIN [BIN...] [-- LOAD_ARGS]" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "bench/instructions.sh: needs valgrind" >&2; exit 2; }
client=${bins[0]}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Total instructions of one served run of N I/Os.
total() {
    local bin=$1 n=$2 port out pid
    port=$((20000 + RANDOM % 20000))
    out=$work/cg.out
    valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" serve \
        --listen "127.0.0.1:$port" --lun ram:64M >/dev/null 2>&1 &
    pid=$!
    for _ in $(seq 150); do
        (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.2
    done
    local url="iscsi://127.0.0.1:$port/iqn.2026-11.org.ironsan:default/0"
    "$client" load "$url" --rw write --bs 1048576 --qd 4 --count 64 >/dev/null
    "$client" load "$url" "${load_args[@]}" --count 2000 >/dev/null
    "$client" load "$url" "${load_args[@]}" --count "$n" >/dev/null
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    cat "$out"* | awk '/^(summary|totals):/ { s += $2 } END { printf "%.0f\n", s }'
    rm -f "$out"*
}

echo "instructions per I/O (callgrind, target user space), ${load_args[*]}, $count I/Os"
for bin in "${bins[@]}"; do
    a=$(total "$bin" "$count")
    b=$(total "$bin" $((2 * count)))
    printf '%10d  %s\n' $(((b - a) / count)) "$bin"
done
