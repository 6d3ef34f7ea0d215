#!/usr/bin/env bash
# A throwaway Ceph cluster on this machine: one monitor and one OSD on 127.0.0.1, cephx on,
# everything (config, keys, logs, sockets, OSD data) in one directory. For trying ironsan's
# RBD LUNs without a cluster, and for the tests and benchmarks that need one.
#
#   scripts/ceph-micro.sh start DIR [--osd memstore|bluestore] [--osd-size 4G] [--pool rbd]
#                                   [--addr IP] [--die-with PID]
#   scripts/ceph-micro.sh stop DIR           stop the daemons (the directory stays)
#   scripts/ceph-micro.sh restart-osd DIR    stop the OSD and start it again (bluestore only:
#                                            the in-memory store loses its data when it stops)
#   scripts/ceph-micro.sh stop-osd DIR / start-osd DIR
#   scripts/ceph-micro.sh destroy DIR        stop, then remove the directory
#
# `start` prints shell assignments (CEPH_CONF=DIR/ceph.conf, CEPH_KEYRING, CEPH_POOL) and
# writes them to DIR/env; `ceph`, `rbd` and `rados` use the cluster with
# `--conf DIR/ceph.conf` (or CEPH_CONF in the environment), as does an ironsan LUN
# `rbd:POOL/IMAGE,conf=DIR/ceph.conf`. The client key is client.admin in DIR/keyring.
#
# --osd memstore (default): the OSD keeps objects in memory (--osd-size, default 2G, is
# its capacity); the cluster starts in a few seconds and takes ~100 MiB plus the data.
# --osd bluestore: the OSD keeps objects in a file of --osd-size in DIR (sparse), so it
# can be stopped and started again with its data (restart-osd).
# --die-with PID: destroy the cluster (and DIR) once process PID has exited (tests pass
# their own PID, so a test that fails or is killed leaves no daemons behind).
# --addr IP: the address the monitor and the OSD bind (default 127.0.0.1); with
# `ip netns exec NS`, a cluster in a network namespace that tests can cut nodes off from.
#
# Needs ceph-mon, ceph-osd and ceph-common (Debian: apt-get install ceph-mon ceph-osd
# ceph-common). Runs as the invoking user; the ports are chosen free at start.
set -euo pipefail

die() { echo "ceph-micro: $*" >&2; exit 1; }

cmd=${1:-}
dir=${2:-}
[[ -n $cmd && -n $dir ]] || { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2; }
shift 2

osd_kind=memstore
osd_size=2G
pool=rbd
die_with=
addr=127.0.0.1
while [[ $# -gt 0 ]]; do
    case $1 in
        --die-with) die_with=$2; shift ;;
        --osd) osd_kind=$2; shift ;;
        --osd-size) osd_size=$2; shift ;;
        --pool) pool=$2; shift ;;
        --addr) addr=$2; shift ;;
        *) die "unknown option $1" ;;
    esac
    shift
done
case $osd_kind in memstore|bluestore) ;; *) die "--osd: memstore or bluestore, not $osd_kind" ;; esac

conf() { echo "$dir/ceph.conf"; }
cephc() { timeout 60 ceph --conf "$(conf)" "$@"; }

bytes() {
    local v=$1 n=${1%[KkMmGgTt]}
    case ${v: -1} in
        K|k) echo $((n << 10)) ;; M|m) echo $((n << 20)) ;; G|g) echo $((n << 30)) ;;
        T|t) echo $((n << 40)) ;; *) echo "$v" ;;
    esac
}

free_port() {
    python3 -c 'import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])' "$addr"
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_daemon() { # pidfile
    local f=$1 i
    pid_alive "$f" || return 0
    kill "$(cat "$f")" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do pid_alive "$f" || return 0; sleep 0.1; done
    kill -9 "$(cat "$f")" 2>/dev/null || true
}

start_osd() {
    ceph-osd --conf "$(conf)" -i 0 2>>"$dir/log/osd.0.stderr" || die "ceph-osd did not start (see $dir/log/osd.0.log)"
    local i
    for ((i = 0; i < 300; i++)); do
        if cephc osd dump 2>/dev/null | grep -q '^osd\.0 up'; then return 0; fi
        sleep 0.2
    done
    die "osd.0 did not come up within 60 s (see $dir/log/osd.0.log)"
}

case $cmd in
start)
    for t in ceph-mon ceph-osd ceph ceph-authtool monmaptool rbd; do
        command -v "$t" >/dev/null || die "$t not found: apt-get install ceph-mon ceph-osd ceph-common"
    done
    [[ ! -e $dir/ceph.conf ]] || die "$dir already holds a cluster (stop/destroy it first)"
    mkdir -p "$dir"/{run,log,mon.a,osd.0}
    # A start that fails leaves no daemon behind (the directory stays, with the logs).
    trap 'stop_daemon "$dir/run/osd.0.pid"; stop_daemon "$dir/run/mon.a.pid"' ERR EXIT
    dir=$(cd "$dir" && pwd)
    fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
    port=$(free_port)
    cat > "$dir/ceph.conf" <<EOF
[global]
fsid = $fsid
mon host = v2:$addr:$port
mon initial members = a
public addr = $addr
ms bind ipv6 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $dir/keyring
run dir = $dir/run
admin socket = $dir/run/\$name.asok
pid file = $dir/run/\$name.pid
log file = $dir/log/\$name.log
crash dir = $dir/crash
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
auth allow insecure global id reclaim = false

[mon]
mon data = $dir/mon.\$id

[osd]
osd data = $dir/osd.\$id
keyring = $dir/osd.\$id/keyring
osd objectstore = $osd_kind
memstore device bytes = $(bytes "$osd_size")
bluestore block path = $dir/osd.\$id.block
bluestore block size = $(bytes "$osd_size")
bluestore block create = true
bluestore fsck on mount = false
osd max object name len = 256
osd max object namespace len = 64
osd memory target = 939524096
EOF
    ceph-authtool --create-keyring "$dir/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool "$dir/keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
    monmaptool --create --addv a "[v2:$addr:$port]" --fsid "$fsid" "$dir/monmap" >/dev/null
    ceph-mon --conf "$dir/ceph.conf" --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/keyring" \
        || die "ceph-mon --mkfs failed"
    ceph-mon --conf "$dir/ceph.conf" -i a || die "ceph-mon did not start (see $dir/log/mon.a.log)"
    uuid=$(python3 -c 'import uuid; print(uuid.uuid4())')
    id=$(cephc osd new "$uuid") || die "the monitor did not answer (see $dir/log/mon.a.log)"
    [[ $id == 0 ]] || die "unexpected OSD id $id"
    ceph-osd --conf "$dir/ceph.conf" -i 0 --mkfs --mkkey --osd-uuid "$uuid" --no-mon-config >/dev/null 2>&1 \
        || die "ceph-osd --mkfs failed (see $dir/log/osd.0.log)"
    cephc auth add osd.0 osd 'allow *' mon 'allow profile osd' mgr 'allow profile osd' \
        -i "$dir/osd.0/keyring" >/dev/null 2>&1 || die "ceph auth add osd.0 failed"
    cephc osd crush add osd.0 1.0 host=localhost root=default >/dev/null 2>&1 || true
    start_osd
    cephc osd pool create "$pool" 8 8 >/dev/null 2>&1 || die "could not create pool $pool"
    cephc osd pool set "$pool" size 1 --yes-i-really-mean-it >/dev/null 2>&1 || true
    timeout 60 rbd --conf "$dir/ceph.conf" pool init "$pool" || die "rbd pool init $pool failed"
    cat > "$dir/env" <<EOF
CEPH_CONF=$dir/ceph.conf
CEPH_KEYRING=$dir/keyring
CEPH_POOL=$pool
EOF
    echo "$osd_kind" > "$dir/osd-kind"
    if [[ -n $die_with ]]; then
        self=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
        # shellcheck disable=SC2016 # expanded by the inner shell, from its arguments
        setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec "$2" destroy "$3"' \
            _ "$die_with" "$self" "$dir" </dev/null >/dev/null 2>&1 &
    fi
    trap - ERR EXIT
    cat "$dir/env"
    ;;
stop)
    stop_daemon "$dir/run/osd.0.pid"
    stop_daemon "$dir/run/mon.a.pid"
    ;;
stop-osd)
    stop_daemon "$dir/run/osd.0.pid"
    ;;
start-osd)
    [[ $(cat "$dir/osd-kind" 2>/dev/null) == bluestore ]] || die "only a bluestore OSD keeps its data across a restart"
    start_osd
    ;;
restart-osd)
    [[ $(cat "$dir/osd-kind" 2>/dev/null) == bluestore ]] || die "only a bluestore OSD keeps its data across a restart"
    stop_daemon "$dir/run/osd.0.pid"
    start_osd
    ;;
destroy)
    stop_daemon "$dir/run/osd.0.pid"
    stop_daemon "$dir/run/mon.a.pid"
    [[ -f $dir/ceph.conf ]] && rm -rf "$dir"
    ;;
*)
    die "unknown command $cmd (start, stop, stop-osd, start-osd, restart-osd, destroy)"
    ;;
esac
