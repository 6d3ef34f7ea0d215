#!/usr/bin/env bash
# A/B one change: two ironsan binaries, the same workload, alternated in one run.
#
#   bench/ab.sh [--rounds N] [--secs S] [--lun SPEC] [--load | --qemu] [--prefill]
#               OLD_BIN NEW_BIN [-- CLIENT_ARGS...]
#
#   OLD_BIN, NEW_BIN  ironsan binaries (e.g. one built in a `git worktree` of the parent
#                     commit, and target/release/ironsan)
#   --rounds N        alternate N times (default 3): old, new, old, new, ...
#   --secs S          seconds per run (default 5)
#   --lun SPEC        the LUN both serve (default ram:1G; e.g. file:/dev/shm/x.img,wce)
#   --load            the client is `NEW_BIN load` (ironsan's load generator, the same
#                     client for both binaries) instead of iscsi-perf; CLIENT_ARGS are its
#                     arguments (default: --rw randread --bs 4096 --qd 32)
#   --qemu            the client is `qemu-img bench` (libiscsi's writes, as in bench/run.sh);
#                     CLIENT_ARGS are its arguments before the URL and must include -c COUNT
#                     (default: -w -t none --pattern=165 -c 20000 -d 8 -s 512K); --secs is
#                     ignored, IOPS = COUNT / the run's wall time
#   --prefill         before measuring, write the first GiB of the LUN with 1 MiB writes
#                     (so reads of a RAM LUN read data, not holes)
#   --old-arg A, --new-arg A
#                     one more client argument for the old / new runs only (repeatable;
#                     e.g. the same binary twice with --old-arg --erl=0 --new-arg --erl=1)
#   --sends           count the target's send syscalls (needs perf; see below)
#   CLIENT_ARGS       iscsi-perf arguments (default: -m 32 -b 8 -r, 4K QD32 random read)
#
# Per run it prints IOPS, target CPU % and CPU us per I/O (utime+stime from /proc/PID/stat)
# and, with --sends, I/Os per send syscall (write, writev, sendmsg, sendto and sendfile of the
# target, counted by `perf stat` on the syscall tracepoints: how well responses are batched).
# /proc/PID/io's syscw does not count them (socket sendmsg and sendfile bypass vfs_write), and
# the tracepoints cost the target CPU (1-2 us per 4K read here), so IOPS and us/IO of a
# --sends run are not comparable with a run without it.
# The target is pinned to CPU 0 and iscsi-perf to CPU 1, as in bench/run.sh. Alternating
# the binaries in one run is what makes a before/after figure worth quoting on a shared box.
set -euo pipefail

rounds=3 secs=5 lun=ram:1G load=0 qemu=0 prefill=0 count_sends=0
old_extra=() new_extra=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --secs) secs=$2; shift 2 ;;
        --lun) lun=$2; shift 2 ;;
        --load) load=1; shift ;;
        --qemu) qemu=1; shift ;;
        --prefill) prefill=1; shift ;;
        --sends) count_sends=1; shift ;;
        --old-arg) old_extra+=("$2"); shift 2 ;;
        --new-arg) new_extra+=("$2"); shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
        *) break ;;
    esac
done
[[ $# -ge 2 ]] || { echo "usage: bench/ab.sh [options] OLD_BIN NEW_BIN [-- iscsi-perf args]" >&2; exit 2; }
old=$1 new=$2
shift 2
[[ ${1:-} == -- ]] && shift
perf_args=("$@")
if [[ ${#perf_args[@]} -eq 0 ]]; then
    if [[ $load -eq 1 ]]; then perf_args=(--rw randread --bs 4096 --qd 32)
    elif [[ $qemu -eq 1 ]]; then perf_args=(-w -t none --pattern=165 -c 20000 -d 8 -s 512K)
    else perf_args=(-m 32 -b 8 -r); fi
fi
for b in "$old" "$new"; do
    [[ -x $b ]] || { echo "bench/ab.sh: $b is not an executable" >&2; exit 2; }
done
[[ $load -eq 1 || $qemu -eq 1 ]] || command -v iscsi-perf >/dev/null || { echo "bench/ab.sh: needs iscsi-perf (libiscsi-bin)" >&2; exit 2; }
count=0
if [[ $qemu -eq 1 ]]; then
    command -v qemu-img >/dev/null || { echo "bench/ab.sh: needs qemu-img (qemu-utils, qemu-block-extra)" >&2; exit 2; }
    for ((i = 0; i < ${#perf_args[@]} - 1; i++)); do
        [[ ${perf_args[i]} == -c ]] && count=${perf_args[i + 1]}
    done
    [[ $count -gt 0 ]] || { echo "bench/ab.sh: --qemu needs -c COUNT in its arguments" >&2; exit 2; }
fi

work=$(mktemp -d)
port=$((20000 + RANDOM % 20000))
pid=
cleanup() {
    [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

sends=(syscalls:sys_enter_write syscalls:sys_enter_writev syscalls:sys_enter_sendmsg
    syscalls:sys_enter_sendto syscalls:sys_enter_sendfile64)
if [[ $count_sends -eq 1 ]] && ! perf stat -e "$(IFS=,; echo "${sends[*]}")" true >/dev/null 2>&1; then
    echo "bench/ab.sh: --sends needs perf (linux-perf) with syscall tracepoints" >&2; exit 2
fi
cpu_ticks() { awk '{sub(/^.*\) /, ""); print $12 + $13}' "/proc/$1/stat"; }

run_one() {
    local label=$1 bin=$2
    shift 2
    local extra=("$@")
    taskset -c 0 "$bin" serve --listen "127.0.0.1:$port" --control "$work/ctl.sock" \
        --lun "$lun" >"$work/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 50); do
        grep -q "serving" "$work/serve.log" 2>/dev/null && break
        sleep 0.1
    done
    local c0 c1 iops url="iscsi://127.0.0.1:$port/iqn.2026-11.org.ironsan:default/0"
    if [[ $prefill -eq 1 ]]; then
        taskset -c 1 "$new" load "$url" --rw write --bs 1048576 --qd 4 --count 1024 >/dev/null
    fi
    local perf_pid=
    if [[ $count_sends -eq 1 ]]; then
        perf stat -x, -e "$(IFS=,; echo "${sends[*]}")" -p "$pid" -o "$work/sends.csv" &
        perf_pid=$!
        sleep 0.2
    fi
    c0=$(cpu_ticks "$pid")
    local t0 run_secs=$secs
    t0=$(date +%s.%N)
    if [[ $load -eq 1 ]]; then
        taskset -c 1 "$new" load "$url" "${perf_args[@]}" "${extra[@]}" -t "$secs" --json >"$work/perf.log" 2>&1 || true
    elif [[ $qemu -eq 1 ]]; then
        taskset -c 1 qemu-img bench -f raw "${perf_args[@]}" "${extra[@]}" "$url" >"$work/perf.log" 2>&1 || true
        run_secs=$(python3 -c "print($(date +%s.%N) - $t0)")
    else
        taskset -c 1 iscsi-perf "${perf_args[@]}" "${extra[@]}" -t "$secs" "$url" >"$work/perf.log" 2>&1 || true
    fi
    c1=$(cpu_ticks "$pid")
    local writes=0
    if [[ -n $perf_pid ]]; then
        kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null || true
        writes=$(awk -F, '$3 ~ /^syscalls:/ && $1 ~ /^[0-9]+$/ { s += $1 } END { print s + 0 }' "$work/sends.csv")
    fi
    local rss
    rss=$(awk '$1 == "VmHWM:" {print int($2 / 1024)}' "/proc/$pid/status")
    kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
    if [[ $load -eq 1 ]]; then
        iops=$(python3 -c 'import json, sys; print(round(json.load(sys.stdin)["iops"]))' <"$work/perf.log" 2>/dev/null || echo 0)
    elif [[ $qemu -eq 1 ]]; then
        iops=0
        grep -q "Run completed" "$work/perf.log" && iops=$(python3 -c "print(round($count / $run_secs))")
    else
        iops=$(grep -o 'iops average [0-9]*' "$work/perf.log" | tail -n 1 | awk '{print $3}')
    fi
    python3 - "$label" "${iops:-0}" $((c1 - c0)) "$writes" "$run_secs" "${rss:-0}" <<'EOF'
import os, sys
label, iops, ticks, writes, secs, rss = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
hz = os.sysconf("SC_CLK_TCK")
cpu_s = ticks / hz
ios = iops * secs
print(f"{label:4} {iops:>9} IOPS  CPU {100 * cpu_s / secs:5.1f} %  "
      f"{(1e6 * cpu_s / ios) if ios else 0:8.2f} us/IO  "
      f"{f'{ios / writes:6.1f}' if writes else '     -'} IO/send  "
      f"peak RSS {rss} MiB")
EOF
}

client=iscsi-perf; [[ $load -eq 1 ]] && client="ironsan load"; [[ $qemu -eq 1 ]] && client="qemu-img bench"
echo "ab: lun $lun, $client ${perf_args[*]}, ${secs}s x $rounds rounds; target CPU 0, client CPU 1"
echo "old: $old"
echo "new: $new"
[[ ${#old_extra[@]} -gt 0 ]] && echo "old client args: ${old_extra[*]}"
[[ ${#new_extra[@]} -gt 0 ]] && echo "new client args: ${new_extra[*]}"
for _ in $(seq "$rounds"); do
    run_one old "$old" "${old_extra[@]}"
    run_one new "$new" "${new_extra[@]}"
done
