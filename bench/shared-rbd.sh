#!/usr/bin/env bash
# One RBD image served by one ironsan node against the same image served by two nodes at once
# (`rbd:POOL/IMAGE,shared`, active/active), on a throwaway Ceph cluster (scripts/ceph-micro.sh).
#
#   bench/shared-rbd.sh [--duration SECS] [--rounds N] [--pin] [--no-save]
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
# Appends the table to bench/results/<date>-shared-rbd.txt unless --no-save.
# Needs root (taskset), ceph-mon, ceph-osd, ceph-common and a release build.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=bench/common.sh
source "$ROOT/bench/common.sh"
die() { printf 'shared-rbd: ERROR: %s\n' "$*" >&2; exit 1; }
note() { printf 'shared-rbd: %s\n' "$*" >&2; }

DURATION=10 ROUNDS=3 SAVE=1 GW_CPUS=0-$(($(nproc) - 1)) CLIENT_CPUS=0-$(($(nproc) - 1))
while [[ $# -gt 0 ]]; do
    case $1 in
        --duration) DURATION=${2:?}; shift 2 ;;
        --rounds) ROUNDS=${2:?}; shift 2 ;;
        --no-save) SAVE=0; shift ;;
        --pin) GW_CPUS=0 CLIENT_CPUS=1; shift ;;
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

# start_node NAME N: cluster node N serving the image on a free port, which goes to $PORT.
start_node() {
    local name=$1 pid
    PORT=$(free_port)
    mkdir -p "$WORK/$name"
    taskset -c "$GW_CPUS" "$BIN" serve --listen "127.0.0.1:$PORT" --target "$TARGET" --lun "$SPEC" \
        --cluster "node=$2,pool=rbd,conf=$CEPH/ceph.conf" \
        --data-dir "$WORK/$name" --control none >"$WORK/$name.log" 2>&1 &
    pid=$!
    PIDS+=("$pid")
    for _ in $(seq 200); do
        listening "$PORT" && return
        pid_alive "$pid" || die "node $name exited: $(tail -n 3 "$WORK/$name.log")"
        sleep 0.1
    done
    die "node $name did not listen on $PORT"
}
start_node a 1
PA=$PORT
start_node b 2
PB=$PORT
URL_A=iscsi://127.0.0.1:$PA/$TARGET/0
URL_B=iscsi://127.0.0.1:$PB/$TARGET/0

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

TABLE=$WORK/table.txt
{
    echo "=== $(date -u '+%Y-%m-%dT%H:%M:%S+00:00')  ironsan $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown) ==="
    echo "uname: $(uname -srvm)"
    echo "nproc: $(nproc)   gateways on CPUs $GW_CPUS, client on CPUs $CLIENT_CPUS; ${DURATION}s per run, $ROUNDS rounds (medians)"
    echo "one RBD image (layering only, librbd cache off) on a one-OSD in-memory cluster; two cluster nodes; ironsan load, 2 sessions"
    printf '%-22s %12s %12s %10s\n' workload "1 node IOPS" "2 nodes IOPS" "2 / 1"
} >"$TABLE"
for w in "randwrite-4k-qd16x2 --rw randwrite --bs 4096 --qd 16" \
         "seqwrite-512k-qd4x2 --rw write --bs 524288 --qd 4" \
         "randwrite-4k-reserved --rw randwrite --bs 4096 --qd 16 --reserve"; do
    read -r name args <<<"$w"
    one=() two=()
    for r in $(seq "$ROUNDS"); do
        # ABBA: the order flips every round, so a drift of the cluster over time (the
        # in-memory OSD slows as its objects fill) favours neither side.
        if ((r % 2)); then
            # shellcheck disable=SC2086
            one+=("$(load_iops "$URL_A" -- $args)")
            # shellcheck disable=SC2086
            two+=("$(load_iops "$URL_A" "$URL_B" -- $args)")
        else
            # shellcheck disable=SC2086
            two+=("$(load_iops "$URL_A" "$URL_B" -- $args)")
            # shellcheck disable=SC2086
            one+=("$(load_iops "$URL_A" -- $args)")
        fi
        note "$name round $r: one node ${one[-1]} IOPS, two nodes ${two[-1]} IOPS"
    done
    m1=$(median "${one[@]}") m2=$(median "${two[@]}")
    printf '%-22s %12s %12s %10s\n' "$name" "$m1" "$m2" \
        "$(python3 -c "print(f'{$m2 / $m1:.2f}' if $m1 else '-')")" >>"$TABLE"
done
cat "$TABLE"
if [[ $SAVE -eq 1 ]]; then
    out=$ROOT/bench/results/$(date -u +%F)-shared-rbd.txt
    { cat "$TABLE"; echo; } >>"$out"
    note "appended to $out"
fi
