#!/usr/bin/env bash
# Throughput, latency, CPU-cost and memory benchmark: ironsan against tgt and
# istgt, same clients, same box, one command.
#
#   bench/run.sh [--quick] [--duration SECS] [--rounds N] [--only LIST] [--no-save]
#
#   --quick        3 s per workload (default 10 s)
#   --duration N   N s per workload
#   --rounds N     run every workload N times against each target (the
#                  targets' order reversed each time) and report, per target
#                  and workload, the round with the median IOPS (default 1)
#   --only LIST    comma-separated sections and/or targets:
#                    sections: ram file qd1 scale idle memory load disk rbd
#                    targets:  ironsan tgt istgt
#                  e.g. --only ram,qd1  or  --only file,istgt,ironsan
#   --no-save      print only, do not append to bench/results/
#   --report DIR   draw the figures of what was measured: DIR/index.html, the PNGs beside
#                  it, and the data (DIR/run.tsv, DIR/meta-run.txt) to redraw them with
#                  bench/report.py DIR
#   --tcp-cc NAME  run everything with this TCP congestion control (the
#                  net.ipv4.tcp_congestion_control sysctl, restored at exit),
#                  e.g. cubic on a host whose default is bbr: every target's
#                  connections then use it
#
# Builds nothing: it uses target/release/ironsan (or $IRONSAN_BIN).
# Needs root (tgtd), tgt, istgt, libiscsi-bin (iscsi-perf), qemu-utils +
# qemu-block-extra (qemu-img with the iscsi driver), python3, taskset.
#
# Method (see docs/PERFORMANCE.md for the discussion)
#   * Targets pinned to CPU 0; every client pinned to CPU 1. Loopback TCP, no
#     digests, no CHAP, 512-byte blocks.
#   * Interleaved: the targets of a setup (ram: ironsan, tgt, ironsan-poll;
#     file: ironsan, tgt, istgt) run side by side, idle but for the one being
#     measured, and each workload runs against every target in turn, the
#     order reversed on every pass (--rounds); so the targets' turns at
#     a workload come seconds apart, not minutes, and a host whose speed
#     changes during the run moves them alike. Memory and idle are measured
#     on each target alone, on fresh processes.
#   * Target CPU = utime+stime of the whole process (all threads) from
#     /proc/PID/stat before and after each run. CPU % = CPU s / wall s,
#     CPU us/IO = CPU s / I/Os done. With the target confined to one core,
#     CPU per I/O is a fair efficiency figure even when IOPS are client-bound.
#   * Client % = busy time of the clients' core (user, system, irq and softirq
#     from /proc/stat) over the run's wall time: near 100 % the client, not
#     the target, set the IOPS (on loopback the client's core also does the
#     kernel's TCP work for the segments the client sends).
#   * Sections:
#     ram     ironsan ram:1G LUN vs tgt bstype null (no data copy at all; tgt
#             discards writes): 4K QD32 random read, 512K QD8 sequential read
#             (iscsi-perf, READ16 only), 4K QD32 and 512K QD8 sequential
#             write (qemu-img bench -w, WRITE16).
#     qd1     QD1 4K random read: latency = 1 / IOPS of iscsi-perf -m 1 -b 8 -r;
#             ironsan also once more with --busy-poll-us $POLL_US (ironsan-poll).
#             With ram too, ironsan-poll also runs the 4K QD32 random read:
#             the opt-in polling mode is what SPDK's published QD1 figure measures.
#     scale   16 iscsi-perf processes (16 sessions) x -m 8 -b 8 -r, summed,
#             vs one session -m 32, run just before and just after the 16
#             against the same target (row 1x-randread-4k-qd32: the two
#             together), so a drifting host cannot tip the ratio.
#     idle    target CPU over 10 s with one logged-in idle session (ironsan-poll
#             too: it polls only after traffic, so idle it should cost nothing).
#     memory  VmRSS delta of the target with 100 idle logged-in sessions
#             (bench/idle-sessions.py, one Python process holding them and
#             answering NOP-In), and with 100 bare TCP connections that
#             have not logged in; measured on a fresh process.
#     file    the same four data workloads on one 256 MiB file on tmpfs
#             (/dev/shm), preallocated: ironsan file LUN (--write-cache, so
#             WCE=1 like tgt rdwr and istgt), tgt bstype rdwr, istgt.
#     load    the data workloads, QD1 and 16 sessions x QD8 (between two
#             1 x QD32 runs, as in scale) again with
#             ironsan's own load generator (`ironsan load`, one client
#             thread, pipelined; see docs/PERFORMANCE.md), on the RAM/null
#             setup (ironsan, tgt) and the tmpfs file setup (all three).
#             With a client that costs ~1.4 us/IO instead of ~4, the figures
#             show what the targets can do rather than what iscsi-perf can.
#     disk    O_DIRECT (BLOCKIO) on one 256 MiB file on a disk file system
#             ($DISK_DIR, default /var/tmp; filled with random data so reads
#             reach the device): ironsan (io_uring), ironsan-threads
#             (--io-engine threads, the engine before io_uring) and tgt rdwr
#             --bsoflags direct, all with the write cache on (WCE=1, like
#             tgt); 4K QD32 random read with iscsi-perf, then 4K QD32 random
#             read and write and 512K QD8 read with `ironsan load`. The
#             device's speed bounds IOPS; CPU us/IO is the target's cost
#             per I/O.
#     rbd     RBD images on a throwaway Ceph cluster (scripts/ceph-micro.sh: one
#             monitor, one OSD with the in-memory store, on 127.0.0.1; librbd's
#             cache off for every client, so a write completes once it is in
#             RADOS): ironsan's RBD LUN and tgt's RBD store (tgt-rbd), each on an
#             image of its own ($RBD_MB MiB, default 1024, written in full first
#             so reads reach the OSD), driven by `ironsan load`, against native
#             librbd (fio --ioengine=rbd, the ceiling a gateway can approach):
#             4K QD32 random read and write, 512K QD8 read and write, 4K QD1
#             random read, and 4K QD1 random reads from a NULL LUN of each
#             gateway (qd1-null-4k: the round trip through the gateway with no
#             backend, which every QD1 gateway figure includes). Gateways on
#             CPU 0, clients on CPU 1, the monitor and the OSD unpinned (they
#             share both cores: the OSD's CPU per I/O is printed beside the
#             gateway's, and the whole host's CPU per I/O and busy share beside
#             them). Then restart-to-first-write of ironsan after kill -9, with
#             its lock-owner record and without it.
#   * Tools: iscsi-perf (libiscsi) keeps -m commands in flight for -t s and
#     prints its running average; the figure used is the last "iops average".
#     qemu-img bench runs a fixed count of requests at -d depth through
#     QEMU's libiscsi block driver, sequential (offset += size, wrapping);
#     IOPS = count / "Run completed in" seconds (login and setup excluded). The
#     count is calibrated by a short first run so a run lasts about --duration.
#
# The report (machine description + tables) is printed and appended to
# bench/results/<date>-<hostname>.txt unless --no-save. Exit status 1 if any
# client run failed (its row reads 0), after the report; CI runs a short
# smoke of it (scripts/test.sh, "bench smoke").
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=bench/common.sh
. "$ROOT/bench/common.sh"

die() { printf 'bench: ERROR: %s\n' "$*" >&2; exit 1; }
note() { printf 'bench: %s\n' "$*" >&2; }

DURATION=10
ROUNDS=1
IDLE_SECS=10
POLL_US=100   # ironsan-poll: the QD1 (and 4K QD32) rows of the opt-in busy-polling mode
SESSIONS=100
ONLY=""
SAVE=1
TCP_CC=""
REPORT_DIR=""
ARGS=("$@")
while [[ $# -gt 0 ]]; do
    case $1 in
        --quick) DURATION=3; shift ;;
        --duration) DURATION=${2:?}; shift 2 ;;
        --rounds) ROUNDS=${2:?}; shift 2 ;;
        --only) ONLY=${2:?}; shift 2 ;;
        --no-save) SAVE=0; shift ;;
        --tcp-cc) TCP_CC=${2:?}; shift 2 ;;
        --report) REPORT_DIR=${2:?}; shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
[[ $DURATION =~ ^[1-9][0-9]*$ ]] || die "--duration must be a positive integer"
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive integer"

ALL_SECTIONS="ram qd1 scale idle memory file load disk rbd"
ALL_TARGETS="ironsan tgt istgt"
SECTIONS="" TARGETS=""
for tok in ${ONLY//,/ }; do
    if [[ " $ALL_SECTIONS " == *" $tok "* ]]; then SECTIONS+=" $tok"
    elif [[ " $ALL_TARGETS " == *" $tok "* ]]; then TARGETS+=" $tok"
    else die "--only: unknown section or target '$tok'"; fi
done
SECTIONS=${SECTIONS:-$ALL_SECTIONS}
TARGETS=${TARGETS:-$ALL_TARGETS}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
want_target() { [[ " $TARGETS " == *" $1 "* ]]; }

for tool in iscsi-perf qemu-img taskset ss python3 tgtd tgtadm istgt fallocate; do
    command -v "$tool" >/dev/null || die "$tool not found"
done
BIN=${IRONSAN_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/ironsan}
[[ -x $BIN ]] || die "$BIN not found: bench/run.sh builds nothing, run 'cargo build --release -p ironsan'"
HEAD_TIME=$(git -C "$ROOT" log -1 --format=%ct 2>/dev/null || echo 0)
if [[ $(stat -c %Y "$BIN") -lt $HEAD_TIME ]]; then
    note "WARNING: $BIN is older than the last commit; rebuild for current figures"
fi

NCPU=$(nproc)
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
if awk -v l="${LOAD_BEFORE%% *}" 'BEGIN { exit !(l > 0.5) }'; then
    note "WARNING: load average is $LOAD_BEFORE before starting; figures will be noisy"
fi
if [[ $NCPU -ge 2 ]]; then TARGET_CPU=0 CLIENT_CPU=1
else note "WARNING: only one CPU; target and client share it"; TARGET_CPU=0 CLIENT_CPU=0; fi
CLK_TCK=$(getconf CLK_TCK)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ironsan-bench.XXXXXX")
SHM="" DISK="" CEPH="" OSD_PID=""
RBD_MB=${RBD_MB:-1024}
# Every target of a setup runs at once (each idle but for the workload at hand), so the
# targets take their turns at one workload seconds apart; see "Interleaving" below.
# Per started target NAME: PID[NAME], URL[NAME], PORT[NAME], IQN[NAME], KIND[NAME]
# (ironsan, tgt or istgt). use_target NAME points the TARGET_*
# variables the workload functions read at one of them.
declare -A PID=() URL=() PORT=() IQN=() KIND=() NULL_URL=()
TARGET_PID="" TARGET_NAME="" TARGET_URL="" TARGET_PORT="" TARGET_IQN=""
HOLD_PID=""

use_target() {
    TARGET_NAME=$1 TARGET_PID=${PID[$1]} TARGET_URL=${URL[$1]} TARGET_PORT=${PORT[$1]}
    TARGET_IQN=${IQN[$1]}
}

stop_target() {
    local name=$1 pid=${PID[$1]:-} kind=${KIND[$1]:-}
    unset "PID[$name]" "URL[$name]" "PORT[$name]" "IQN[$name]" "KIND[$name]" "NULL_URL[$name]"
    case $kind in
        ironsan)
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -KILL "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true ;;
        tgt) bash "$ROOT/bench/peer-tgt.sh" stop --dir "$WORK/$name" || true ;;
        istgt) bash "$ROOT/bench/peer-istgt.sh" stop --dir "$WORK/$name" || true ;;
    esac
}
stop_all() {
    local name
    for name in "${!PID[@]}"; do stop_target "$name"; done
}

release_sessions() {
    [[ -n $HOLD_PID ]] || return 0
    exec 7>&- || true
    kill -TERM "$HOLD_PID" 2>/dev/null || true
    wait "$HOLD_PID" 2>/dev/null || true
    HOLD_PID=""
}

cleanup() {
    release_sessions
    stop_all
    restore_tcp_cc
    rm -rf "$WORK"
    [[ -z $SHM ]] || rm -rf "$SHM"
    [[ -z $DISK ]] || rm -rf "$DISK"
    [[ -z $CEPH ]] || bash "$ROOT/scripts/ceph-micro.sh" destroy "$CEPH" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

[[ -z $TCP_CC ]] || set_tcp_cc "$TCP_CC"

# Nanoseconds on CPU and context switches (wakeups), summed over all threads:
# finer than the 10 ms ticks of /proc/PID/stat, for the idle measurement.
sched_ns_switches() {
    cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ ns += $1 } END { printf "%d ", ns }'
    cat /proc/"$1"/task/*/status 2>/dev/null | awk '/^(voluntary|nonvoluntary)_ctxt_switches/ { n += $2 } END { print n + 0 }'
}
rss_kb() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"; }
# Busy clock ticks of one CPU (user + nice + system + irq + softirq, /proc/stat): every client
# runs on CPU $CLIENT_CPU, so this is how hard the clients worked, loopback TCP processing
# included; a row whose client core is near 100 % was limited by its client, not its target.
core_ticks() { awk -v c="cpu$1" '$1 == c { print $2 + $3 + $4 + $7 + $8; exit }' /proc/stat; }
# The same over every CPU: the whole host's busy ticks.
host_ticks() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8; exit }' /proc/stat; }
# measured FUNCTION ARGS...: runs FUNCTION, which prints the IOPS it measured, with the
# target's CPU, the client core's busy ticks and the wall clock sampled around it; sets
# M_IOPS, M_TICKS, M_CLIENT and M_WALL (ns).
M_IOPS=0 M_TICKS=0 M_CLIENT=0 M_WALL=0
measured() {
    local c0 k0 t0
    c0=$(cpu_ticks "$TARGET_PID"); k0=$(core_ticks "$CLIENT_CPU"); t0=$(date +%s%N)
    M_IOPS=$("$@")
    M_WALL=$(($(date +%s%N) - t0))
    M_TICKS=$(($(cpu_ticks "$TARGET_PID") - c0))
    M_CLIENT=$(($(core_ticks "$CLIENT_CPU") - k0))
}

# start_target NAME SETUP: NAME is ironsan, ironsan-poll (ironsan in the opt-in busy-polling
# mode, for the QD1 and RAM 4K QD32 rows only), ironsan-threads (--io-engine threads, disk
# setup), tgt or istgt; fills PID[NAME], URL[NAME] and the rest.
start_target() {
    local name=$1 setup=$2 port kind=${1%%-*} dir=$WORK/$1 pid url iqn
    port=$(free_port)
    mkdir -p "$dir"
    case $kind in
        ironsan)
            local lun=ram:1G extra=()
            iqn=iqn.2026-11.org.ironsan:bench
            if [[ $setup == file ]]; then lun=file:$SHM/lun.img; extra=(--write-cache); fi
            if [[ $setup == disk ]]; then lun=file:$DISK/lun.img,direct; extra=(--write-cache); fi
            # rbd: LUN 1 is a NULL LUN, the same round trip with no backend (qd1-null-4k).
            if [[ $setup == rbd ]]; then lun=rbd:rbd/bench-ironsan,conf=$CEPH/ceph.conf; extra=(--lun null:1G); fi
            if [[ $name == ironsan-poll ]]; then extra+=(--busy-poll-us "$POLL_US"); fi
            if [[ $name == ironsan-threads ]]; then extra+=(--io-engine threads); fi
            NO_COLOR=1 taskset -c "$TARGET_CPU" "$BIN" serve --listen "127.0.0.1:$port" --target "$iqn" \
                --lun "$lun" "${extra[@]}" --data-dir "$dir/data" </dev/null >"$dir/ironsan.log" 2>&1 &
            pid=$!
            # An RBD image's lock may take ~30 s when its dead owner's record is gone.
            for _ in $(seq 900); do
                kill -0 "$pid" 2>/dev/null || { cat "$dir/ironsan.log" >&2; die "$name exited during startup"; }
                listening "$port" && break
                sleep 0.1
            done
            listening "$port" || die "$name is not listening on 127.0.0.1:$port"
            url=iscsi://127.0.0.1:$port/$iqn/0
            NULL_URL[$name]=iscsi://127.0.0.1:$port/$iqn/1 ;;
        tgt)
            local lun=null
            [[ $setup == file ]] && lun=file:$SHM/lun.img
            [[ $setup == disk ]] && lun=direct:$DISK/lun.img
            local null2=()
            [[ $setup == rbd ]] && lun=rbd:rbd/bench-tgt:$CEPH/ceph.conf null2=(--null-lun2)
            url=$(bash "$ROOT/bench/peer-tgt.sh" start --port "$port" --dir "$dir" \
                --cpu "$TARGET_CPU" --lun "$lun" "${null2[@]}")
            NULL_URL[$name]=${url%/1}/2
            pid=$(<"$dir/tgtd.pid")
            iqn=iqn.2026-11.org.ironsan:peer-tgt ;;
        istgt)
            url=$(bash "$ROOT/bench/peer-istgt.sh" start --port "$port" --dir "$dir" \
                --cpu "$TARGET_CPU" --file "$SHM/lun.img")
            pid=$(<"$dir/istgt.pid")
            iqn=iqn.2026-11.org.ironsan:peer-istgt ;;
        native)
            # Not a target: fio's librbd engine straight on the image (bench/run.sh rbd).
            pid="" url="" iqn="" ;;
        *) die "start_target: unknown target $name" ;;
    esac
    PID[$name]=$pid URL[$name]=$url PORT[$name]=$port IQN[$name]=$iqn KIND[$name]=$kind
    note "$name ($setup) at $url (pid $pid, CPU $TARGET_CPU; clients CPU $CLIENT_CPU)"
}

# Interleaving: each_target [--with-poll] FUNCTION ARGS... runs one workload against every
# started target in turn (ironsan-poll only with --with-poll), --rounds times, alternating the
# order from one pass to the next, so a host that slows down or speeds up during the run moves
# the targets alike instead of whichever took its turn later.
SETUP_TARGETS=()
EACH_CALLS=0
each_target() {
    local with_poll=0 t order=()
    if [[ $1 == --with-poll ]]; then with_poll=1; shift; fi
    for t in "${SETUP_TARGETS[@]}"; do
        [[ $t == ironsan-poll && $with_poll -eq 0 ]] && continue
        order+=("$t")
    done
    local rev=() turn=() i round
    for ((i = ${#order[@]} - 1; i >= 0; i--)); do rev+=("${order[i]}"); done
    for ((round = 0; round < ROUNDS; round++)); do
        if (( EACH_CALLS % 2 )); then turn=("${rev[@]}"); else turn=("${order[@]}"); fi
        EACH_CALLS=$((EACH_CALLS + 1))
        for t in "${turn[@]}"; do
            use_target "$t"
            "$@"
        done
    done
}

ROWS=$WORK/rows.tsv
: >"$ROWS"
# One line per failed client run (they run in subshells, so a file, not a variable); the
# report is still printed and saved, then the bench exits 1.
FAILURES=$WORK/failures
: >"$FAILURES"
failed() { note "$*"; echo "$*" >>"$FAILURES"; }
# row SETUP WORKLOAD TARGET IOPS IO_BYTES TICKS WALL_NS TOOL CLIENT_TICKS
row() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" "$CLK_TCK" >>"$ROWS"; }

# iscsi-perf once; echoes the final "iops average".
perf_once() {
    local log=$1; shift
    local rc=0
    taskset -c "$CLIENT_CPU" timeout -s INT -k 10 $((DURATION + 30)) \
        iscsi-perf -t "$DURATION" "$@" "$TARGET_URL" >"$log" 2>&1 || rc=$?
    local iops
    iops=$(tr '\r' '\n' <"$log" | sed -n 's/.*iops average \([0-9][0-9]*\).*/\1/p' | tail -n 1)
    if [[ $rc -ne 0 || -z $iops ]] || grep -qiE 'failed|ABORTED' "$log"; then
        tr '\r' '\n' <"$log" | tail -n 5 >&2
        failed "iscsi-perf against $TARGET_NAME failed (exit $rc): $*"
        echo 0; return 0
    fi
    echo "$iops"
}

# record TABLE WORKLOAD BYTES TOOL FUNCTION ARGS...: FUNCTION ARGS, measured (it prints the
# IOPS of its run), becomes a row of TABLE.
record() {
    local table=$1 workload=$2 bytes=$3 tool=$4; shift 4
    measured "$@"
    row "$table" "$workload" "$TARGET_NAME" "$M_IOPS" "$bytes" "$M_TICKS" "$M_WALL" "$tool" "$M_CLIENT"
    progress_point
    note "$(printf '%-8s %-10s %-20s %8s IOPS (%s)' "$TARGET_NAME" "$table" "$workload" "$M_IOPS" "$tool")"
}

# perf SETUP WORKLOAD BYTES iscsi-perf-args...
perf() {
    local setup=$1 workload=$2 bytes=$3; shift 3
    record "$setup" "$workload" "$bytes" iscsi-perf perf_once "$WORK/$TARGET_NAME-$setup-$workload.log" "$@"
}

# qemu-img bench write; echoes "IOPS" of one run of COUNT requests (0 on failure).
qbench_once() {
    local count=$1 depth=$2 size=$3 log=$4 rc=0
    taskset -c "$CLIENT_CPU" timeout -k 10 $((DURATION * 6 + 30)) \
        qemu-img bench -f raw -w -t none --pattern=165 -c "$count" -d "$depth" -s "$size" "$TARGET_URL" >"$log" 2>&1 || rc=$?
    local secs
    secs=$(sed -n 's/^Run completed in \([0-9.]*\) seconds.*/\1/p' "$log")
    if [[ $rc -ne 0 || -z $secs ]]; then
        tail -n 3 "$log" >&2
        failed "qemu-img bench -c $count -d $depth -s $size against $TARGET_NAME failed (exit $rc)"
        echo 0; return 0
    fi
    python3 -c "print(round($count / max($secs, 1e-6)))"
}

# qwrite SETUP WORKLOAD DEPTH SIZE
qwrite() {
    local setup=$1 workload=$2 depth=$3 size=$4
    # Calibrate: a short run (also warms the target), then size the real one.
    local cal=$(( size >= 65536 ? 200 : 3000 ))
    local est count
    est=$(qbench_once "$cal" "$depth" "$size" "$WORK/qcal.log")
    count=$(( est * DURATION )); [[ $count -ge $cal ]] || count=$cal
    # CPU is charged over the whole qemu-img process lifetime (login, probing
    # and logout included); the run itself dominates at >= 3 s.
    record "$setup" "$workload" "$size" qemu-img \
        qbench_once "$count" "$depth" "$size" "$WORK/$TARGET_NAME-$setup-$workload.log"
}

# The four data workloads of a setup, each against every target in turn; ironsan-poll, where
# the setup has it (RAM), runs the 4K random read too.
data_workloads() {
    local setup=$1
    each_target --with-poll perf "$setup" randread-4k-qd32 4096 -m 32 -b 8 -r
    each_target perf "$setup" seqread-512k-qd8 524288 -m 8 -b 1024
    each_target qwrite "$setup" write-4k-qd32 32 4096
    each_target qwrite "$setup" write-512k-qd8 8 524288
}

# sixteen_perf LOG: 16 iscsi-perf processes (16 sessions) x QD8 at once, logging to
# $WORK/scale-N.log (not LOG); prints their summed IOPS.
sixteen_perf() {
    local i total=0 pids=()
    for i in $(seq 16); do
        perf_once "$WORK/scale-$i.log" -m 8 -b 8 -r >"$WORK/scale-$i.iops" &
        pids+=($!)
    done
    wait "${pids[@]}"
    for i in $(seq 16); do total=$((total + $(<"$WORK/scale-$i.iops"))); done
    echo "$total"
}

# scale_pair SETUP TOOL ONE SIXTEEN: one session x QD32, then 16 sessions x QD8, then one
# session x QD32 again, back to back against one target (ONE and SIXTEEN print the IOPS of a
# run), so the scaling ratio compares runs seconds apart on a host whose speed drifts; the
# 1x-randread-4k-qd32 row is the two single-session runs together (mean IOPS, summed CPU).
scale_pair() {
    local setup=$1 tool=$2 one=$3 sixteen=$4 i1 c1 k1 w1
    measured "$one" "$WORK/$TARGET_NAME-$setup-1x32a.log"
    i1=$M_IOPS c1=$M_TICKS k1=$M_CLIENT w1=$M_WALL
    record "$setup" 16x-randread-4k-qd8 4096 "$tool" "$sixteen" "$WORK/$TARGET_NAME-$setup-16x8.log"
    measured "$one" "$WORK/$TARGET_NAME-$setup-1x32b.log"
    row "$setup" 1x-randread-4k-qd32 "$TARGET_NAME" $(((i1 + M_IOPS) / 2)) 4096 $((c1 + M_TICKS)) \
        $((w1 + M_WALL)) "$tool" $((k1 + M_CLIENT))
    note "$(printf '%-8s %-10s %-20s %8s IOPS (%s)' "$TARGET_NAME" "$setup" 1x-randread-4k-qd32 $(((i1 + M_IOPS) / 2)) "$tool")"
}
one_perf() { perf_once "$1" -m 32 -b 8 -r; }
scale() { scale_pair "$1" iscsi-perf one_perf sixteen_perf; }

# hold_sessions N [idle-sessions.py options]: returns once they are logged in.
hold_sessions() {
    local n=$1; shift
    rm -f "$WORK/hold" "$WORK/hold.out"
    mkfifo "$WORK/hold"
    taskset -c "$CLIENT_CPU" python3 "$ROOT/bench/idle-sessions.py" 127.0.0.1 "$TARGET_PORT" "$TARGET_IQN" \
        --sessions "$n" "$@" <"$WORK/hold" >"$WORK/hold.out" 2>"$WORK/hold.err" &
    HOLD_PID=$!
    exec 7>"$WORK/hold"
    for _ in $(seq 2000); do  # istgt logs sessions in about one per second
        grep -q '^ready' "$WORK/hold.out" 2>/dev/null && return 0
        kill -0 "$HOLD_PID" 2>/dev/null || break
        sleep 0.1
    done
    cat "$WORK/hold.err" >&2
    release_sessions
    return 1
}

idle() {
    local setup=$1 c0 t0 c1 t1
    hold_sessions 1 || { failed "idle: could not log in to $TARGET_NAME"; return 0; }
    sleep 1
    local n0 s0 n1 s1
    read -r n0 s0 < <(sched_ns_switches "$TARGET_PID")
    c0=$(cpu_ticks "$TARGET_PID"); t0=$(date +%s%N)
    sleep "$IDLE_SECS"
    t1=$(date +%s%N); c1=$(cpu_ticks "$TARGET_PID")
    read -r n1 s1 < <(sched_ns_switches "$TARGET_PID")
    release_sessions
    # Idle rows: IOPS = CPU ns (schedstat), IO_BYTES = context switches.
    row "$setup" idle-1-session "$TARGET_NAME" $((n1 - n0)) $((s1 - s0)) $((c1 - c0)) $((t1 - t0)) - 0
    note "$TARGET_NAME idle: $(( (n1 - n0) / 1000 )) us CPU, $((s1 - s0)) context switches in ${IDLE_SECS}s"
}

# memory: RSS deltas; rows carry IOPS=rss before (kB), IO_BYTES=rss after, TICKS=count.
memory() {
    local setup=$1 r0 r1
    sleep 0.5
    r0=$(rss_kb "$TARGET_PID")
    if hold_sessions "$SESSIONS"; then
        sleep 1
        r1=$(rss_kb "$TARGET_PID")
        release_sessions
        row "$setup" mem-idle-session "$TARGET_NAME" "$r0" "$r1" "$SESSIONS" 0 - 0
        note "$TARGET_NAME RSS ${r0} kB -> ${r1} kB with $SESSIONS idle sessions"
    else
        failed "memory: $SESSIONS sessions against $TARGET_NAME failed"
    fi
    # A fresh process for the bare connections: memory the sessions freed would otherwise be
    # reused and the per-connection figure would read as (near) zero.
    local name=$TARGET_NAME
    stop_target "$name"
    start_target "$name" "$setup"
    use_target "$name"
    sleep 0.5
    r0=$(rss_kb "$TARGET_PID")
    if hold_sessions "$SESSIONS" --connect-only; then
        sleep 1
        r1=$(rss_kb "$TARGET_PID")
        release_sessions
        row "$setup" mem-bare-connection "$TARGET_NAME" "$r0" "$r1" "$SESSIONS" 0 - 0
        note "$TARGET_NAME RSS ${r0} kB -> ${r1} kB with $SESSIONS bare connections"
    else
        failed "memory: $SESSIONS bare connections to $TARGET_NAME failed"
    fi
    sleep 1
}

qd1() { perf "$1" qd1-randread-4k 4096 -m 1 -b 8 -r; }

# lload_once LOG ironsan-load-args...: one `ironsan load` run; prints its IOPS (0 on failure).
lload_once() {
    local log=$1; shift
    local out iops rc=0
    out=$(RUST_BACKTRACE=0 taskset -c "$CLIENT_CPU" timeout -k 10 $((DURATION + 60)) \
        "$BIN" load "$TARGET_URL" -t "$DURATION" --json "$@" 2>"$log") || rc=$?
    iops=$(python3 -c 'import json, sys; print(round(json.load(sys.stdin)["iops"]))' <<<"$out" 2>/dev/null) || iops=0
    if [[ $rc -ne 0 || $iops -eq 0 ]]; then
        tail -n 3 "$log" >&2
        failed "ironsan load against $TARGET_NAME failed (exit $rc): $*"
        iops=0
    fi
    echo "$iops"
}

# lrun SETUP WORKLOAD BYTES ironsan-load-args...: one `ironsan load` run; the row goes to
# the table "SETUP+load".
lrun() {
    local setup=$1 workload=$2 bytes=$3; shift 3
    record "$setup+load" "$workload" "$bytes" ironsan-load \
        lload_once "$WORK/$TARGET_NAME-$setup-load-$workload.log" "$@"
}
one_load() { lload_once "$1" --rw randread --bs 4096 --qd 32; }
sixteen_load() { lload_once "$1" --rw randread --bs 4096 --qd 8 --sessions 16; }
lscale() { scale_pair "$1+load" ironsan-load one_load sixteen_load; }

load_workloads() {
    local setup=$1
    each_target lrun "$setup" randread-4k-qd32 4096 --rw randread --bs 4096 --qd 32
    each_target lrun "$setup" seqread-512k-qd8 524288 --rw read --bs 524288 --qd 8
    each_target lrun "$setup" write-4k-qd32 4096 --rw write --bs 4096 --qd 32
    each_target lrun "$setup" write-512k-qd8 524288 --rw write --bs 524288 --qd 8
    each_target lrun "$setup" qd1-randread-4k 4096 --rw randread --bs 4096 --qd 1
    each_target lscale "$setup"
}

# --- rbd -------------------------------------------------------------------------------

# A cluster of its own, three images written in full (one per client: ironsan keeps its
# image's exclusive lock, so the gateways cannot share one).
rbd_setup() {
    CEPH=$WORK/ceph
    bash "$ROOT/scripts/ceph-micro.sh" start "$CEPH" --osd-size "$((RBD_MB * 3 + 1024))M" \
        --die-with $$ >/dev/null || die "could not start the Ceph cluster (scripts/ceph-micro.sh)"
    # Every client without librbd's cache: a write completes once it is in RADOS.
    printf '\n[client]\nrbd cache = false\n' >>"$CEPH/ceph.conf"
    local t
    for t in ironsan tgt native; do
        rbd --conf "$CEPH/ceph.conf" create --size "${RBD_MB}M" "rbd/bench-$t"
        rbd --conf "$CEPH/ceph.conf" bench --io-type write --io-pattern seq --io-size 4M \
            --io-threads 4 --io-total "${RBD_MB}M" "rbd/bench-$t" >/dev/null
    done
    OSD_PID=$(<"$CEPH/run/osd.0.pid")
}

# fio_once LOG RW BS QD: native librbd (fio's rbd engine) on rbd/bench-native; prints IOPS.
fio_once() {
    local log=$1 rw=$2 bs=$3 qd=$4 out iops rc=0
    out=$(CEPH_CONF=$CEPH/ceph.conf taskset -c "$CLIENT_CPU" timeout -k 10 $((DURATION + 60)) \
        fio --name=native --ioengine=rbd --clientname=admin --pool=rbd --rbdname=bench-native \
            --rw="$rw" --bs="$bs" --iodepth="$qd" --time_based --runtime="$DURATION" \
            --invalidate=0 --output-format=json 2>"$log") || rc=$?
    iops=$(python3 -c 'import json, sys; j = json.load(sys.stdin)["jobs"][0]; print(round(j["read"]["iops"] + j["write"]["iops"]))' <<<"$out" 2>/dev/null) || iops=0
    if [[ $rc -ne 0 || $iops -eq 0 ]]; then
        tail -n 3 "$log" >&2
        failed "fio rbd failed (exit $rc): $rw $bs QD$qd"
        iops=0
    fi
    echo "$iops"
}

# rbd_run WORKLOAD BYTES RW BS QD: one run against the current target (fio for native,
# `ironsan load` for the gateways); the row's TOOL field carries the OSD's CPU ticks and the
# whole host's busy ticks. Workload qd1-null-4k goes to the gateway's NULL LUN (no backend:
# the round trip through the gateway alone); native has no such row.
rbd_run() {
    local w=$1 bytes=$2 rw=$3 bs=$4 qd=$5 o0 g0=0 g1=0 k0 h0 t0 iops wall tool
    if [[ $w == qd1-null-4k ]]; then
        [[ $TARGET_NAME != native ]] || return 0
        TARGET_URL=${NULL_URL[$TARGET_NAME]}
    fi
    o0=$(cpu_ticks "$OSD_PID")
    [[ -z $TARGET_PID ]] || g0=$(cpu_ticks "$TARGET_PID")
    k0=$(core_ticks "$CLIENT_CPU"); h0=$(host_ticks); t0=$(date +%s%N)
    if [[ $TARGET_NAME == native ]]; then
        tool=fio; iops=$(fio_once "$WORK/native-$w.log" "$rw" "$bs" "$qd")
    else
        tool=ironsan-load
        iops=$(lload_once "$WORK/$TARGET_NAME-rbd-$w.log" --rw "$rw" --bs "$bs" --qd "$qd")
    fi
    wall=$(($(date +%s%N) - t0))
    [[ -z $TARGET_PID ]] || g1=$(cpu_ticks "$TARGET_PID")
    row rbd "$w" "$TARGET_NAME" "$iops" "$bytes" $((g1 - g0)) "$wall" \
        "$tool:osd=$(($(cpu_ticks "$OSD_PID") - o0)):host=$(($(host_ticks) - h0))" \
        $(($(core_ticks "$CLIENT_CPU") - k0))
    use_target "$TARGET_NAME"
    note "$(printf '%-8s %-10s %-20s %8s IOPS (%s)' "$TARGET_NAME" rbd "$w" "$iops" "$tool")"
}

# A restarted ironsan's first write: kill -9, start again on the same data directory, time
# until a write is acknowledged; once with the lock owner it recorded (the dead one is
# blocklisted and its lock broken at once), once with that record deleted (librbd then waits
# for the dead owner's watch to expire). Rows carry milliseconds in the IOPS field.
rbd_restart() {
    local how t0 ms ok hows=(recorded forgotten)
    # A 1 s smoke run times only the restart with its record: without it the wait is
    # librbd's watch timeout (~30 s), a figure the full runs give.
    ((DURATION > 1)) || hows=(recorded)
    for how in "${hows[@]}"; do
        kill -KILL "${PID[ironsan]}" 2>/dev/null || true
        wait "${PID[ironsan]}" 2>/dev/null || true
        unset "PID[ironsan]"
        [[ $how == forgotten ]] && rm -f "$WORK"/ironsan/data/state/*/0/rbd-lock-owner
        t0=$(date +%s%N)
        start_target ironsan rbd
        use_target ironsan
        ok=0
        for _ in $(seq 600); do
            if RUST_BACKTRACE=0 "$BIN" load "$TARGET_URL" --rw write --bs 4096 --qd 1 --count 1 \
                >/dev/null 2>&1; then ok=1; break; fi
            sleep 0.1
        done
        ms=$(( ($(date +%s%N) - t0) / 1000000 ))
        [[ $ok -eq 1 ]] || { failed "ironsan did not acknowledge a write within 60 s of a restart ($how)"; ms=0; }
        row rbd "restart-$how" ironsan "$ms" 0 0 0 - 0
        note "ironsan restart ($how lock owner): first write acknowledged after $ms ms"
    done
}

rbd_workloads() {
    each_target rbd_run randread-4k-qd32 4096 randread 4096 32
    each_target rbd_run randwrite-4k-qd32 4096 randwrite 4096 32
    each_target rbd_run seqread-512k-qd8 524288 read 524288 8
    each_target rbd_run seqwrite-512k-qd8 524288 write 524288 8
    each_target rbd_run qd1-randread-4k 4096 randread 4096 1
    each_target rbd_run qd1-null-4k 4096 randread 4096 1
}

T_START=$(date +%s)
# Progress: the setups that will run, in order.
SETUPS_RUN=()
if want ram || want qd1 || want scale || want idle || want memory || want load; then SETUPS_RUN+=(ram); fi
if want file || want load || { want memory && want_target istgt; }; then SETUPS_RUN+=(file); fi
if want disk; then SETUPS_RUN+=(disk); fi
if want rbd; then SETUPS_RUN+=(rbd); fi
setup_progress() {
    local i
    for i in "${!SETUPS_RUN[@]}"; do
        [[ ${SETUPS_RUN[$i]} == "$1" ]] && progress_begin $((i + 1)) "${#SETUPS_RUN[@]}" "$1 setup"
    done
    return 0
}
# One setup at a time: its targets start together, each is measured alone for memory and idle
# (fresh processes), then every workload runs against each of them in turn (each_target).
if want ram || want qd1 || want scale || want idle || want memory || want load; then
    setup_progress ram
    SETUP_TARGETS=()
    for t in ironsan tgt; do want_target "$t" && SETUP_TARGETS+=("$t"); done
    if want_target ironsan && { want qd1 || want ram || want idle; }; then SETUP_TARGETS+=(ironsan-poll); fi
    for t in "${SETUP_TARGETS[@]}"; do start_target "$t" ram; done
    for t in "${SETUP_TARGETS[@]}"; do
        use_target "$t"
        # ironsan-poll's memory is ironsan's; its idle row shows what the opt-in polling
        # costs with nothing to do (it polls only after traffic).
        if want memory && [[ $t != ironsan-poll ]]; then memory ram; fi
        if want idle; then idle ram; fi
    done
    if want ram; then data_workloads ram; fi
    if want qd1; then each_target --with-poll qd1 ram; fi
    if want scale; then each_target scale ram; fi
    if want load; then load_workloads ram; fi
    stop_all
fi
if want file || want load || { want memory && want_target istgt; }; then
    setup_progress file
    SHM=$(mktemp -d /dev/shm/ironsan-bench.XXXXXX)
    fallocate -l 256M "$SHM/lun.img"
    SETUP_TARGETS=()
    for t in ironsan tgt istgt; do want_target "$t" && SETUP_TARGETS+=("$t"); done
    for t in "${SETUP_TARGETS[@]}"; do start_target "$t" file; done
    if want_target istgt && want memory; then use_target istgt; memory file; fi
    if want file; then data_workloads file; fi
    if want load; then load_workloads file; fi
    stop_all
fi
if want disk; then
    setup_progress disk
    DISK=$(mktemp -d "${DISK_DIR:-/var/tmp}/ironsan-bench.XXXXXX")
    # Real data: ext4 reads unwritten extents as zeros without going to the device.
    dd if=/dev/urandom of="$DISK/lun.img" bs=1M count=256 oflag=direct status=none
    SETUP_TARGETS=()
    if want_target ironsan; then SETUP_TARGETS+=(ironsan ironsan-threads); fi
    if want_target tgt; then SETUP_TARGETS+=(tgt); fi
    for t in "${SETUP_TARGETS[@]}"; do start_target "$t" disk; done
    each_target perf disk randread-4k-qd32 4096 -m 32 -b 8 -r
    each_target lrun disk randread-4k-qd32 4096 --rw randread --bs 4096 --qd 32
    each_target lrun disk randwrite-4k-qd32 4096 --rw randwrite --bs 4096 --qd 32
    each_target lrun disk seqread-512k-qd8 524288 --rw read --bs 524288 --qd 8
    stop_all
fi
if want rbd; then
    setup_progress rbd
    for tool in ceph-mon ceph-osd rbd fio; do command -v "$tool" >/dev/null || die "$tool not found (rbd section)"; done
    rbd_setup
    SETUP_TARGETS=()
    for t in ironsan tgt; do want_target "$t" && SETUP_TARGETS+=("$t"); done
    SETUP_TARGETS+=(native)
    for t in "${SETUP_TARGETS[@]}"; do start_target "$t" rbd; done
    rbd_workloads
    if want_target ironsan; then rbd_restart; fi
    stop_all
    bash "$ROOT/scripts/ceph-micro.sh" destroy "$CEPH" || true
    CEPH=""
fi
T_END=$(date +%s)
progress_end

TABLE=$(python3 - "$ROWS" "$IDLE_SECS" "$POLL_US" "$NCPU" <<'EOF'
import sys
POLL_US = sys.argv[3]
NCPU = int(sys.argv[4])
runs = {}
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
perf, idle, mem = {}, {}, {}
order = {}
restarts = {}
for setup, w, t, a, b, ticks, wall_ns, tool, client_ticks, hz in rows:
    if w.startswith("restart-"):
        restarts[w[len("restart-"):]] = int(a)
        continue
    # TOOL[:osd=TICKS][:host=TICKS] (rbd rows: the OSD's CPU and the whole host's busy time)
    tool, *extra = tool.split(":")
    extra = dict(kv.split("=", 1) for kv in extra)
    osd_ticks = int(extra["osd"]) if "osd" in extra else None
    host_ticks = int(extra["host"]) if "host" in extra else None
    if w.startswith("mem-"):
        mem[(w, t)] = (int(a), int(b), int(ticks))
        continue
    cpu_s = int(ticks) / int(hz)
    wall_s = int(wall_ns) / 1e9
    cpu_pct = 100.0 * cpu_s / wall_s
    client_pct = 100.0 * int(client_ticks) / int(hz) / wall_s
    if w.startswith("idle"):
        idle[t] = (int(a), int(b), wall_s)
        continue
    iops = int(a)
    us = cpu_pct / 100.0 * 1e6 / iops if iops else float("nan")
    osd_us = (osd_ticks / int(hz) * 1e6 / (iops * wall_s)) if (osd_ticks is not None and iops) else None
    host_us = (host_ticks / int(hz) * 1e6 / (iops * wall_s)) if (host_ticks is not None and iops) else None
    host_pct = 100.0 * host_ticks / int(hz) / wall_s / NCPU if host_ticks is not None else None
    runs.setdefault((setup, w, t), []).append((iops, iops * int(b) / 1048576, cpu_pct, us, tool, client_pct, osd_us, host_us, host_pct))
    order.setdefault(setup, [])
    if w not in order[setup]:
        order[setup].append(w)

# --rounds: the round with the median IOPS (the lower middle one of an even count), with its
# own CPU figures, so a row stays one real run.
for key, rs in runs.items():
    rs.sort(key=lambda r: r[0])
    perf[key] = rs[(len(rs) - 1) // 2]

def table(setup, title, targets, bases):
    if setup not in order:
        return
    print(f"\n{title}")
    hdr = f"{'workload':<22} {'target':<24} {'IOPS':>9} {'MiB/s':>9} {'CPU %':>7} {'CPU us/IO':>10} {'client %':>9}  tool"
    print(hdr); print("-" * len(hdr))
    for w in order[setup]:
        for t in targets:
            if (setup, w, t) in perf:
                i, m, c, u, tool, k = perf[(setup, w, t)][:6]
                print(f"{w:<22} {t:<24} {i:>9d} {m:>9.1f} {c:>7.1f} {u:>10.2f} {k:>9.1f}  {tool}")
        for base in bases:
            a = perf.get((setup, w, base))
            for t in targets:
                b = perf.get((setup, w, t))
                if t not in bases and a and b:
                    r = [x / y if y else float("nan") for x, y in zip(a[:4], b[:4])]
                    print(f"{w:<22} {base + '/' + t:<24} {r[0]:>9.2f} {r[1]:>9.2f} {r[2]:>7.2f} {r[3]:>10.2f}")

table("ram", "RAM/null LUN: ironsan ram:1G vs tgt bstype null (target CPU 0, client CPU 1; ironsan-poll: --busy-poll-us " + POLL_US + ")", ["ironsan", "ironsan-poll", "tgt"], ["ironsan", "ironsan-poll"])
table("file", "File LUN: one preallocated 256 MiB file on tmpfs (ironsan --write-cache, tgt rdwr, istgt)", ["ironsan", "tgt", "istgt"], ["ironsan"])
table("ram+load", "RAM/null LUN with ironsan's load generator (ironsan load, one client thread; QD1 latency = 1/IOPS)", ["ironsan", "tgt"], ["ironsan"])
table("file+load", "File LUN on tmpfs with ironsan's load generator", ["ironsan", "tgt", "istgt"], ["ironsan"])
table("disk", "O_DIRECT file LUN on a disk file system, iscsi-perf (ironsan: io_uring; ironsan-threads: --io-engine threads; tgt rdwr --bsoflags direct)", ["ironsan", "ironsan-threads", "tgt"], ["ironsan"])
table("disk+load", "O_DIRECT file LUN on a disk file system with ironsan's load generator (ironsan: io_uring; ironsan-threads: --io-engine threads; tgt rdwr --bsoflags direct; WCE=1)", ["ironsan", "ironsan-threads", "tgt"], ["ironsan"])

if "rbd" in order:
    print("\nRBD images on a one-OSD in-memory Ceph cluster on this host (librbd cache off): ironsan's RBD LUN and tgt's RBD store (ironsan load as the initiator; gateways on CPU 0) against native librbd (fio --ioengine=rbd); the monitor and OSD float over both cores")
    print("(host: every process's CPU per I/O, both cores, and how busy the two cores were; where both")
    print(" rows of a ratio ran the host near 100 % busy, IOPS ratios follow host CPU per I/O)")
    hdr = f"{'workload':<20} {'target':<16} {'IOPS':>9} {'MiB/s':>9} {'mean us':>9} {'gw CPU us/IO':>13} {'OSD CPU us/IO':>14} {'host us/IO':>11} {'host busy %':>12} {'client %':>9}"
    print(hdr); print("-" * len(hdr))
    qd = {"randread-4k-qd32": 32, "randwrite-4k-qd32": 32, "seqread-512k-qd8": 8, "seqwrite-512k-qd8": 8, "qd1-randread-4k": 1, "qd1-null-4k": 1}
    opt = lambda v, width: f"{v:{width}.1f}" if v is not None else f"{'-':>{width}}"
    for w in order["rbd"]:
        for t in ("ironsan", "tgt", "native"):
            r = perf.get(("rbd", w, t))
            if not r:
                continue
            i, m, c, u, tool, k, osd, host_us, host_pct = r
            mean = qd.get(w, 1) * 1e6 / i if i else float("nan")
            gw = f"{u:13.1f}" if t != "native" else f"{'-':>13}"
            print(f"{w:<20} {t:<16} {i:>9d} {m:>9.1f} {mean:>9.0f} {gw} {opt(osd, 14)} {opt(host_us, 11)} {opt(host_pct, 12)} {k:>9.1f}")
        a = perf.get(("rbd", w, "ironsan"))
        for base in ("tgt", "native"):
            b = perf.get(("rbd", w, base))
            if a and b and b[0]:
                extra = ""
                if base == "tgt" and b[3] and a[3] == a[3]:
                    extra = f"   gateway CPU/IO {a[3] / b[3]:.2f}x"
                if a[7] and b[7]:
                    extra += f"   host CPU/IO {a[7] / b[7]:.2f}x"
                if w == "qd1-randread-4k" and a[0]:
                    extra += f"   mean {1e6 / a[0] - 1e6 / b[0]:+.0f} us"
                print(f"{w:<20} {'ironsan/' + base:<16} {a[0] / b[0]:>9.2f}{extra}")
    floor = {t: perf[("rbd", "qd1-null-4k", t)][0] for t in ("ironsan", "tgt") if ("rbd", "qd1-null-4k", t) in perf}
    if floor:
        print("\nqd1-null-4k: the same QD1 reads from a NULL LUN of the same gateway process, pinned as above:")
        print("the round trip through the gateway with no backend, which every QD1 gateway figure includes")
        for t, i in floor.items():
            print(f"  {t:<8} {1e6 / i:7.1f} us" if i else f"  {t:<8} failed")
    if restarts:
        print("\nironsan restart after kill -9, to the first acknowledged write (process start, cluster connection, image lock, one 4 KiB write):")
        for how, ms in restarts.items():
            what = "its lock-owner record kept (dead owner blocklisted, lock broken at once)" if how == "recorded" else "the record deleted (librbd waits for the dead owner's watch to expire)"
            print(f"  {ms / 1000:6.1f} s  {what}")

lat = {t: perf[("ram", "qd1-randread-4k", t)][0] for t in ("ironsan", "ironsan-poll", "tgt") if ("ram", "qd1-randread-4k", t) in perf}
if lat:
    print("\nQD1 4K random read latency (1 / IOPS, iscsi-perf -m 1 -b 8 -r; includes the client's own time)")
    for t, i in lat.items():
        print(f"  {t:<12} {1e6 / i:8.1f} us" if i else f"  {t:<12} failed")
    for t in ("ironsan", "ironsan-poll"):
        if lat.get(t) and lat.get("tgt"):
            print(f"  {t}/tgt latency ratio {lat['tgt'] / lat[t]:.2f}")
    if "ironsan-poll" in lat:
        print(f"  (ironsan-poll: --busy-poll-us {POLL_US}, opt-in; the default never polls)")

# The single-session figure measured around the 16-session run (scale_pair), else the setup's
# randread row.
scaling = []
for setup, how in (("ram", "16 iscsi-perf processes, summed"), ("ram+load", "ironsan load --sessions 16"), ("file+load", "ironsan load --sessions 16, tmpfs file LUN")):
    for t in ("ironsan", "tgt", "istgt"):
        m = perf.get((setup, "16x-randread-4k-qd8", t))
        o = perf.get((setup, "1x-randread-4k-qd32", t)) or perf.get((setup, "randread-4k-qd32", t))
        if m and o:
            scaling.append((setup, how, t, m, o))
if scaling:
    print("\nScaling: 16 sessions x QD8 vs 1 session x QD32, 4K random read (1x32: the runs just before and after the 16x8)")
    for setup, how, t, m, o in scaling:
        print(f"  {setup:<9} {t:<8} 16x8: {m[0]:>8d} IOPS {m[3]:7.2f} us/IO   1x32: {o[0]:>8d} IOPS {o[3]:7.2f} us/IO   16x8/1x32 = {m[0] / o[0] if o[0] else float('nan'):.2f}   ({how})")

if idle:
    print(f"\nIdle: target CPU with one logged-in idle session over {sys.argv[2]} s")
    for t, (ns, switches, wall_s) in idle.items():
        print(f"  {t:<12} {100 * ns / 1e9 / wall_s:7.4f} % CPU ({ns / 1e3:.0f} us in {wall_s:.1f} s, /proc/PID/task/*/schedstat), {switches / wall_s:.1f} wakeups/s")

if mem:
    print("\nMemory: VmRSS delta of the target process, per session / per connection")
    for (w, t), (r0, r1, n) in sorted(mem.items(), key=lambda x: (x[0][1], x[0][0])):
        what = "idle logged-in session" if w == "mem-idle-session" else "bare TCP connection (no login)"
        print(f"  {t:<8} {what:<32} {r0:>7d} kB -> {r1:>7d} kB with {n}: {(r1 - r0) / n:7.1f} KiB each")
EOF
)

REPORT=$(
    echo "=== $(date -Is)  ironsan $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet -- crates src 2>/dev/null || echo '+dirty') ==="
    echo "uname: $(uname -a)"
    echo "nproc: $NCPU   cpu: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)   mem: $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) MiB"
    echo "targets pinned to CPU $TARGET_CPU, clients to CPU $CLIENT_CPU; ${DURATION}s per workload$([[ $ROUNDS -gt 1 ]] && echo ", $ROUNDS rounds each (median shown)"); took $((T_END - T_START))s; loadavg before: $LOAD_BEFORE, after: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "ironsan binary: $(date -d "@$(stat -c %Y "$BIN")" -Is); tgt $(tgtd -V 2>/dev/null | head -n 1 || echo '?'); $(dpkg-query -W -f='istgt ${Version}, libiscsi-bin ${Version}' istgt 2>/dev/null | sed 's/libiscsi-bin [^,]*$//')$(dpkg-query -W -f='libiscsi-bin ${Version}' libiscsi-bin 2>/dev/null); $(qemu-img --version | head -n 1)"
    echo "sections: $SECTIONS; targets: $TARGETS; TCP congestion control: $(cat "$CC_SYSCTL")$([[ -n $TCP_CC ]] && echo " (--tcp-cc; host default $CC_BEFORE)")$([[ -n $TCP_CC && $(cat "$CC_SYSCTL") != "$TCP_CC" ]] && echo " WARNING: changed by someone else during the run, figures invalid")"
    echo "$TABLE"
)
echo "$REPORT"
if [[ $SAVE -eq 1 ]]; then
    mkdir -p "$ROOT/bench/results"
    out=$ROOT/bench/results/$(date +%F)-$(uname -n).txt
    { echo "$REPORT"; echo; } >>"$out"
    note "appended to ${out#"$ROOT"/}"
fi
if [[ -n $REPORT_DIR ]]; then
    mkdir -p "$REPORT_DIR"
    cp "$ROWS" "$REPORT_DIR/run.tsv"
    report_meta "$REPORT_DIR/meta-run.txt" bench/run.sh "${ARGS[@]}"
    "$ROOT/bench/report.py" "$REPORT_DIR" >&2 || die "bench/report.py $REPORT_DIR failed"
fi
if [[ -s $FAILURES ]]; then
    note "$(wc -l <"$FAILURES") client run(s) failed:"
    sed 's/^/bench:   /' "$FAILURES" >&2
    exit 1
fi
