#!/usr/bin/env bash
# One RBD image served by one ironsan node against the same image served by two nodes at once
# (`rbd:POOL/IMAGE,shared`, active/active), on a throwaway Ceph cluster (scripts/ceph-micro.sh).
#
#   bench/shared-rbd.sh [--duration SECS] [--rounds N] [--pin] [--no-save] [--old-bin BIN]
#
# The client is `ironsan load` with two sessions: against one node both log in to it; against
# two nodes session i logs in to node i mod 2 (what round-robin multipath over one path per
# node does). The nodes form a cluster (`--cluster`), as a deployment would. Workloads: 4K
# random writes (QD16 per session) and 512K sequential writes (QD4 per session), and 4K random
# writes with every session holding a Write Exclusive – All Registrants reservation
# (`ironsan load --reserve`: every command meets the reservation check). Rounds alternate one
# node / two nodes, in ABBA order; the medians and their ratio are printed (two nodes must not collapse: no
# exclusive lock moves between them). Gateways, client, monitor and OSD float over every core
# (--pin: gateways on CPU 0, client on CPU 1), so on a two-core host everything shares the
# same cores and the ratio shows contention, not scaling.
# --old-bin BIN: also serve the image from a pair of nodes of that binary (another target, so
# another shared object) and measure both binaries in every round, alternated, so a change's
# cost on the data path is one run's before/after: the table then has each binary's one-node
# and two-node IOPS and the new / old ratios.
# Appends the table to bench/results/<date>-shared-rbd.txt unless --no-save.
# Needs root (taskset), ceph-mon, ceph-osd, ceph-common and a release build.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=bench/common.sh
source "$ROOT/bench/common.sh"
die() { printf 'shared-rbd: ERROR: %s\n' "$*" >&2; exit 1; }
note() { printf 'shared-rbd: %s\n' "$*" >&2; }

OLD_BIN="" DURATION=10 ROUNDS=3 SAVE=1 GW_CPUS=0-$(($(nproc) - 1)) CLIENT_CPUS=0-$(($(nproc) - 1))
while [[ $# -gt 0 ]]; do
    case $1 in
        --duration) DURATION=${2:?}; shift 2 ;;
        --rounds) ROUNDS=${2:?}; shift 2 ;;
        --no-save) SAVE=0; shift ;;
        --pin) GW_CPUS=0 CLIENT_CPUS=1; shift ;;
        --old-bin) OLD_BIN=${2:?}; shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
[[ $DURATION =~ ^[1-9][0-9]*$ ]] || die "--duration must be a positive integer"
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive integer"
for tool in ceph-mon ceph-osd rbd taskset python3; do
    command -v "$tool" >/dev/null || die "$tool not found"
done
BIN=${IRONSAN_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/ironsan}
[[ -x $BIN ]] || die "$BIN not found (cargo build --release)"
[[ -z $OLD_BIN || -x $OLD_BIN ]] || die "--old-bin $OLD_BIN is not executable"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ironsan-shared-rbd.XXXXXX")
CEPH=$WORK/ceph
PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    bash "$ROOT/scripts/ceph-micro.sh" destroy "$CEPH" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

note "starting a Ceph cluster (scripts/ceph-micro.sh)"
bash "$ROOT/scripts/ceph-micro.sh" start "$CEPH" --die-with $$ >/dev/null ||
    die "could not start the Ceph cluster"
printf '\n[client]\nrbd cache = false\n' >>"$CEPH/ceph.conf"
rbd --conf "$CEPH/ceph.conf" create --size 1G --image-feature layering rbd/shared
SPEC="rbd:rbd/shared,shared,conf=$CEPH/ceph.conf"
TARGET=iqn.2026-11.org.ironsan:shared

# start_node NAME N BIN TARGET: cluster node N of BIN serving the image as TARGET on a free
# port, which goes to $PORT.
start_node() {
    local name=$1 pid
    PORT=$(free_port)
    mkdir -p "$WORK/$name"
    taskset -c "$GW_CPUS" "$3" serve --listen "127.0.0.1:$PORT" --target "$4" --lun "$SPEC" \
        --cluster "node=$2,pool=rbd,conf=$CEPH/ceph.conf" \
        --data-dir "$WORK/$name" --control "$WORK/$name.sock" >"$WORK/$name.log" 2>&1 &
    pid=$!
    PIDS+=("$pid")
    for _ in $(seq 200); do
        listening "$PORT" && return
        pid_alive "$pid" || die "node $name exited: $(tail -n 3 "$WORK/$name.log")"
        sleep 0.1
    done
    die "node $name did not listen on $PORT"
}
# pair SUFFIX BIN: two nodes of BIN serving TARGET-SUFFIX; their LUN URLs go to $URL_A, $URL_B.
pair() {
    local t=$TARGET$1 a b
    start_node "a$1" 1 "$2" "$t"
    a=$PORT
    start_node "b$1" 2 "$2" "$t"
    b=$PORT
    URL_A=iscsi://127.0.0.1:$a/$t/0
    URL_B=iscsi://127.0.0.1:$b/$t/0
    # Each node sees the other before a run starts (else the port groups change under the
    # first run: a unit attention, which `ironsan load` counts as a failure).
    sleep 3
}
pair "" "$BIN"
NEW_A=$URL_A NEW_B=$URL_B
if [[ -n $OLD_BIN ]]; then
    pair "-old" "$OLD_BIN"
    OLD_A=$URL_A OLD_B=$URL_B
fi

# load_iops URL... -- ARGS: IOPS of one `ironsan load` run with two sessions.
load_iops() {
    local urls=() out
    while [[ $1 != -- ]]; do urls+=("$1"); shift; done
    shift
    out=$(taskset -c "$CLIENT_CPUS" "$BIN" load "${urls[@]}" --sessions 2 -t "$DURATION" --json "$@" \
        2>"$WORK/load.log") || die "ironsan load failed: $(tail -n 3 "$WORK/load.log")"
    python3 -c 'import json, sys; print(round(json.load(sys.stdin)["iops"]))' <<<"$out"
}

median() { printf '%s\n' "$@" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
ratio() { python3 -c "print(f'{$1 / $2:.2f}' if $2 else '-')"; }

TABLE=$WORK/table.txt
{
    echo "=== $(date -u '+%Y-%m-%dT%H:%M:%S+00:00')  ironsan $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown) ==="
    echo "uname: $(uname -srvm)"
    echo "nproc: $(nproc)   gateways on CPUs $GW_CPUS, client on CPUs $CLIENT_CPUS; ${DURATION}s per run, $ROUNDS rounds (medians)"
    echo "one RBD image (layering only, librbd cache off) on a one-OSD in-memory cluster; two cluster nodes; ironsan load, 2 sessions"
    if [[ -n $OLD_BIN ]]; then
        echo "old: $OLD_BIN   new: $BIN (both measured every round, alternated)"
        printf '%-22s %9s %9s %9s %9s %9s %9s\n' workload "old 1" "old 2" "new 1" "new 2" "new/old 1" "new/old 2"
    else
        printf '%-22s %12s %12s %10s\n' workload "1 node IOPS" "2 nodes IOPS" "2 / 1"
    fi
} >"$TABLE"
for w in "randwrite-4k-qd16x2 --rw randwrite --bs 4096 --qd 16" \
         "seqwrite-512k-qd4x2 --rw write --bs 524288 --qd 4" \
         "randwrite-4k-reserved --rw randwrite --bs 4096 --qd 16 --reserve"; do
    read -r name rest <<<"$w"
    read -ra args <<<"$rest"
    one=() two=() old1=() old2=()
    for r in $(seq "$ROUNDS"); do
        # ABBA: the order flips every round, so a drift of the cluster over time (the
        # in-memory OSD slows as its objects fill) favours neither side.
        runs=(new1 new2)
        [[ -n $OLD_BIN ]] && runs=(new1 old1 new2 old2)
        if ((r % 2 == 0)); then
            back=()
            for ((k = ${#runs[@]} - 1; k >= 0; k--)); do back+=("${runs[k]}"); done
            runs=("${back[@]}")
        fi
        for run in "${runs[@]}"; do
            case $run in
                new1) one+=("$(load_iops "$NEW_A" -- "${args[@]}")") ;;
                new2) two+=("$(load_iops "$NEW_A" "$NEW_B" -- "${args[@]}")") ;;
                old1) old1+=("$(load_iops "$OLD_A" -- "${args[@]}")") ;;
                old2) old2+=("$(load_iops "$OLD_A" "$OLD_B" -- "${args[@]}")") ;;
            esac
        done
        if [[ -n $OLD_BIN ]]; then
            note "$name round $r: old ${old1[-1]} / ${old2[-1]} IOPS, new ${one[-1]} / ${two[-1]} IOPS (one node / two nodes)"
        else
            note "$name round $r: one node ${one[-1]} IOPS, two nodes ${two[-1]} IOPS"
        fi
    done
    m1=$(median "${one[@]}") m2=$(median "${two[@]}")
    if [[ -n $OLD_BIN ]]; then
        o1=$(median "${old1[@]}") o2=$(median "${old2[@]}")
        printf '%-22s %9s %9s %9s %9s %9s %9s\n' "$name" "$o1" "$o2" "$m1" "$m2" \
            "$(ratio "$m1" "$o1")" "$(ratio "$m2" "$o2")" >>"$TABLE"
    else
        printf '%-22s %12s %12s %10s\n' "$name" "$m1" "$m2" "$(ratio "$m2" "$m1")" >>"$TABLE"
    fi
done
cat "$TABLE"
if [[ $SAVE -eq 1 ]]; then
    out=$ROOT/bench/results/$(date -u +%F)-shared-rbd.txt
    { cat "$TABLE"; echo; } >>"$out"
    note "appended to $out"
fi
