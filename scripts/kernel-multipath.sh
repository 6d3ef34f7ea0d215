#!/usr/bin/env bash
# Linux dm-multipath with ALUA against ironsan: the real kernel initiator (open-iscsi,
# scsi_dh_alua, dm-multipath, multipathd) in a QEMU guest under TCG, two paths to one LUN.
#
#   scripts/kernel-multipath.sh [--cluster]
#
# ironsan serves one target through two portal groups (two 127.0.0.1 ports, ALUA groups 1
# and 2 from a configuration file). The guest (tests/kernel/init-multipath) reaches portal
# group 1 as 10.0.2.100:3260 and group 2 as 10.0.2.101:3260 (guestfwd relays), logs in
# through both, checks that scsi_dh_alua attached, builds the map with multipathd (prio alua,
# group_by_prio), and keeps a verified O_DIRECT write stream on it. It announces each step
# on its console; this script carries it out on the host:
#
#   standby / unavailable / active   ironsan ctl alua set TARGET 1 STATE
#   portal-down                      ironsan ctl portal remove (portal of group 1), and the
#                                    relays of its connections killed: the path is gone
#   portal-up                        ironsan ctl portal add (same address, group 1)
#
# and the guest waits until multipath shows the effect.
#
# --cluster: the two paths are two ironsan nodes of a cluster (`--cluster`) serving one RBD
# image (`shared`) from a throwaway Ceph cluster (scripts/ceph-micro.sh): node N listens on
# portal group N. The steps are
#
#   node-pause                       SIGSTOP of node 1 (the whole process) under the stream
#   node-continue                    SIGCONT of node 1; it must report itself fenced (node 2
#                                    fenced it while it was stopped) and land nothing it held
#   node-down                        kill -9 of node 1, and the relays of its connections
#   node-up                          node 1 started again (it rejoins the cluster)
#
# and the image (`rbd export`) must hold the stream's last pass. The guest's longest
# write/read-back during node-down is the failover time.
#
# PASS needs every step seen, no
# error in the write stream, and the LUN's backing file holding exactly what the stream's
# last pass wrote. The guest prints multipath -ll after each step, sg_inq, sg_vpd -p di and
# sg_rtpg.
#
# Environment: IRONSAN_BIN, IRONSAN_REQUIRE_TOOLS=1, IRONSAN_KERNEL_VERSION,
# IRONSAN_KERNEL_TIMEOUT (default 600), IRONSAN_KEEP=1 (as scripts/kernel-initiator.sh).
#
# shellcheck disable=SC2317  # cleanup: called through the trap
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KDIR=$ROOT/tests/kernel
START=$(date +%s)
log() { printf 'kernel-multipath: %s\n' "$*"; }
die() { printf 'kernel-multipath: ERROR: %s\n' "$*" >&2; exit 1; }

CLUSTER=0
case ${1:-} in
    --cluster) CLUSTER=1 ;;
    "") ;;
    *) die "usage: scripts/kernel-multipath.sh [--cluster]" ;;
esac
TIMEOUT=${IRONSAN_KERNEL_TIMEOUT:-600}
TARGET_IQN=iqn.2026-11.org.ironsan:multipath
INITIATOR_IQN=iqn.2026-11.org.ironsan:guest-multipath
LUN_MIB=64
PAYLOAD_MIB=8

missing=()
command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
[[ -x /usr/sbin/iscsid && -x /usr/sbin/iscsiadm ]] || missing+=(open-iscsi)
[[ -x /sbin/multipathd && -x /sbin/multipath ]] || missing+=(multipath-tools)
[[ -x /usr/bin/sg_rtpg && -x /usr/bin/sg_vpd ]] || missing+=(sg3-utils)
command -v busybox >/dev/null || missing+=(busybox-static)
if [[ $CLUSTER == 1 ]]; then
    command -v ceph-mon >/dev/null || missing+=(ceph-mon)
    command -v ceph-osd >/dev/null || missing+=(ceph-osd)
    command -v rbd >/dev/null || missing+=(ceph-common)
fi
# shellcheck source=tests/kernel/common.sh
. "$KDIR/common.sh"
guest_prerequisites

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ironsan-mpath.XXXXXX")
[[ $WORK != *,* ]] || die "work directory $WORK contains a comma (QEMU option syntax)"
SERVER_PID=""
NODE_PIDS=("" "" "")
QEMU_PID=""
OK=0
cleanup() {
    local rc=$?
    [[ -n $QEMU_PID ]] && kill -TERM "$QEMU_PID" 2>/dev/null && wait "$QEMU_PID" 2>/dev/null
    for pid in "$SERVER_PID" "${NODE_PIDS[@]}"; do
        [[ -n $pid ]] || continue
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    [[ $CLUSTER == 1 ]] && bash "$ROOT/scripts/ceph-micro.sh" stop "$WORK/ceph" >/dev/null 2>&1
    pkill -f "^/usr/bin/python3 $WORK/relay.py" 2>/dev/null || true
    if [[ $OK == 1 && ${IRONSAN_KEEP:-0} != 1 ]]; then
        rm -rf "$WORK"
    else
        log "work directory kept: $WORK (serial.log, server.log, steps.log)"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
P1=$(free_port)
P2=$(free_port)
while [[ $P2 == "$P1" ]]; do P2=$(free_port); done
mkdir -p "$WORK/data"
wait_port() { # PORT PID LOG
    for ((i = 0; i < 300; i++)); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { cat "$3"; die "ironsan serve exited"; }
        sleep 0.1
    done
    die "ironsan not listening on $1 after 30 s"
}
if [[ $CLUSTER == 1 ]]; then
    bash "$ROOT/scripts/ceph-micro.sh" start "$WORK/ceph" --die-with $$ >"$WORK/ceph.log" 2>&1 ||
        { cat "$WORK/ceph.log"; die "the Ceph cluster did not start"; }
    CONF=$WORK/ceph/ceph.conf
    rbd --conf "$CONF" create --size "${LUN_MIB}M" --image-feature layering rbd/mpath
    # start_node N PORT: node N of the cluster, portal group N.
    start_node() {
        mkdir -p "$WORK/n$1"
        "$BIN" serve --listen "127.0.0.1:$2" --target "$TARGET_IQN" --data-dir "$WORK/n$1" \
            --control "$WORK/n$1.sock" --lun "rbd:rbd/mpath,conf=$CONF,shared" \
            --cluster "node=$1,pool=rbd,conf=$CONF,name=node$1,heartbeat=1s" \
            --log "${IRONSAN_LOG:-info}" >>"$WORK/node$1.log" 2>&1 &
        NODE_PIDS[$1]=$!
        wait_port "$2" "${NODE_PIDS[$1]}" "$WORK/node$1.log"
    }
    start_node 1 "$P1"
    start_node 2 "$P2"
    log "ironsan node 1 on 127.0.0.1:$P1 and node 2 on 127.0.0.1:$P2, one RBD image"
else
    cat >"$WORK/ironsan.toml" <<EOF
data_dir = "$WORK/data"
control = "$WORK/control.sock"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:$P1"]
[[portal_group]]
tag = 2
listen = ["127.0.0.1:$P2"]
[[target]]
name = "$TARGET_IQN"
[[target.lun]]
spec = "file:lun0.img:${LUN_MIB}M"
[[target.alua_group]]
id = 1
portal_groups = [1]
[[target.alua_group]]
id = 2
portal_groups = [2]
EOF
    "$BIN" serve --config "$WORK/ironsan.toml" --log "${IRONSAN_LOG:-info}" >"$WORK/server.log" 2>&1 &
    SERVER_PID=$!
    wait_port "$P2" "$SERVER_PID" "$WORK/server.log"
    log "ironsan on 127.0.0.1:$P1 (group 1) and 127.0.0.1:$P2 (group 2)"
fi
ctl() { "$BIN" ctl --control "$WORK/control.sock" "$@"; }

head -c "$((PAYLOAD_MIB << 20))" /dev/urandom >"$WORK/payload.bin"
cat >"$WORK/guest.env" <<EOF
TARGET_IQN=$TARGET_IQN
INITIATOR_IQN=$INITIATOR_IQN
PORTAL1=10.0.2.100:3260
PORTAL2=10.0.2.101:3260
GUEST_IP=10.0.2.15
GATEWAY=10.0.2.2
PAYLOAD_MIB=$PAYLOAD_MIB
CLUSTER=$CLUSTER
EOF
MP_LIBS=$(find /lib/multipath -name '*.so' 2>/dev/null | tr '\n' ' ' || true)
[[ -n $MP_LIBS ]] || die "no multipath plugins under /lib/multipath (multipath-tools)"
IRONSAN_GUEST_INIT=$KDIR/init-multipath \
    IRONSAN_EXTRA_MODULES="dm_mod dm_multipath dm_round_robin dm_service_time dm_queue_length scsi_dh_alua" \
    IRONSAN_EXTRA_PROGRAMS="/sbin/multipathd /sbin/multipath /usr/bin/sg_inq /usr/bin/sg_vpd /usr/bin/sg_rtpg" \
    IRONSAN_EXTRA_LIBS="$MP_LIBS /lib/x86_64-linux-gnu/libgcc_s.so.1" \
    bash "$KDIR/build-initramfs.sh" "$KVER" "$WORK/rootfs" "$WORK/initrd.cpio" "$WORK/guest.env" "$WORK/payload.bin"
rm -rf "$WORK/rootfs"
cp "$KDIR/relay.py" "$WORK/relay.py"

relay() { echo "/usr/bin/python3 $WORK/relay.py 127.0.0.1 $1 $WORK/relay.log $((TIMEOUT + 60))"; }
NETDEV="user,id=n0,restrict=on,ipv6=off,net=10.0.2.0/24,host=10.0.2.2"
NETDEV+=",guestfwd=tcp:10.0.2.100:3260-cmd:$(relay "$P1")"
NETDEV+=",guestfwd=tcp:10.0.2.101:3260-cmd:$(relay "$P2")"
log "booting Linux $KVER under QEMU (TCG, timeout ${TIMEOUT}s)"
T_QEMU=$(date +%s)
timeout --kill-after=10 "$TIMEOUT" qemu-system-x86_64 \
    -nodefaults -no-user-config -machine "pc,accel=${IRONSAN_KERNEL_ACCEL:-tcg}" -m 768 -smp 1 \
    -display none -vga none -monitor none -serial "file:$WORK/serial.log" -no-reboot \
    -kernel "/boot/vmlinuz-$KVER" -initrd "$WORK/initrd.cpio" \
    -append "console=ttyS0 panic=-1 quiet" \
    -netdev "$NETDEV" -device virtio-net-pci,netdev=n0,romfile= \
    </dev/null >"$WORK/qemu.log" 2>&1 &
QEMU_PID=$!

# Carry out each step the guest announces, once.
: >"$WORK/steps.log"
declare -A done_steps=()
do_step() {
    case $1 in
        standby | unavailable) ctl alua set "$TARGET_IQN" 1 "$1" ;;
        active) ctl alua set "$TARGET_IQN" 1 active/optimized ;;
        portal-down)
            ctl portal remove "127.0.0.1:$P1"
            # The relays of path 1 (anchored: QEMU's own command line names them too).
            pkill -f "^/usr/bin/python3 $WORK/relay.py 127.0.0.1 $P1 " || true
            ;;
        portal-up) ctl portal add "127.0.0.1:$P1" --tag 1 ;;
        node-down)
            kill -KILL "${NODE_PIDS[1]}"
            wait "${NODE_PIDS[1]}" 2>/dev/null || true
            NODE_PIDS[1]=""
            pkill -f "^/usr/bin/python3 $WORK/relay.py 127.0.0.1 $P1 " || true
            ;;
        node-pause) kill -STOP "${NODE_PIDS[1]}" ;;
        node-continue)
            kill -CONT "${NODE_PIDS[1]}"
            # Node 1 finds itself fenced (node 2 fenced it while it was stopped).
            for ((k = 0; k < 200; k++)); do
                "$BIN" ctl --control "$WORK/n1.sock" --json cluster 2>/dev/null | grep -Eq '"health": ?"fenced"' && break
                sleep 0.1
            done
            if "$BIN" ctl --control "$WORK/n1.sock" --json cluster 2>/dev/null | grep -Eq '"health": ?"fenced"'; then
                echo "node 1 reports itself fenced"
            else
                echo "node 1 NOT FENCED"
            fi
            ;;
        node-up) start_node 1 "$P1" ;;
        *) echo "unknown step $1" ;;
    esac
}
while kill -0 "$QEMU_PID" 2>/dev/null; do
    if [[ -f $WORK/serial.log ]]; then
        while read -r s; do
            [[ -n ${done_steps[$s]:-} ]] && continue
            done_steps[$s]=1
            # Not in a command substitution: node-up records the new node's PID, which a
            # subshell would lose (and the cleanup below would never stop that node).
            do_step "$s" >"$WORK/step.out" 2>&1
            printf '%s +%ss %s: %s\n' "$(date +%T)" "$(($(date +%s) - T_QEMU))" "$s" "$(tr '\n' ' ' <"$WORK/step.out")" >>"$WORK/steps.log"
        done < <(tr -d '\r' <"$WORK/serial.log" | sed -n 's/^IRONSAN-MPATH-STEP \([a-z-]*\)$/\1/p')
    fi
    sleep 0.2
done
qemu_rc=0
wait "$QEMU_PID" || qemu_rc=$?
QEMU_PID=""
for pid in "$SERVER_PID" "${NODE_PIDS[@]}"; do
    [[ -n $pid ]] || continue
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
done
SERVER_PID=""
NODE_PIDS=("" "" "")
BACKING=$WORK/data/lun0.img
if [[ $CLUSTER == 1 ]]; then
    BACKING=$WORK/image.raw
    rbd --conf "$CONF" export rbd/mpath "$BACKING" >/dev/null 2>&1 || die "rbd export failed"
fi

SERIAL=$WORK/serial.log
touch "$SERIAL"
echo "----- guest console -----"
sed -n '/----- guest dmesg begin -----/q;p' "$SERIAL" | tr -d '\r' | grep -v '^\s*$' || true
sed -n '/----- guest dmesg begin -----/,/----- guest dmesg end -----/p' "$SERIAL" | tr -d '\r' |
    grep -E 'alua|multipath|device-mapper|sd [0-9]+:|I/O error|Call Trace|BUG' | sed 's/^/  dmesg: /' | tail -40 || true
echo "----- host steps -----"
sed 's/^/  /' "$WORK/steps.log"

failures=()
[[ $qemu_rc -eq 0 ]] || failures+=("qemu exited with status $qemu_rc")
result=$(tr -d '\r' <"$SERIAL" | grep -E '^IRONSAN-KERNEL-TEST: (PASS|FAIL)' | tail -1 || true)
[[ $result == "IRONSAN-KERNEL-TEST: PASS"* ]] || failures+=("guest: ${result:-no result line}")
STEP_NAMES=(standby unavailable active portal-down portal-up)
[[ $CLUSTER == 1 ]] && STEP_NAMES=(node-pause node-continue node-down node-up)
if [[ $CLUSTER == 1 ]] && ! grep -q 'node-continue: node 1 reports itself fenced' "$WORK/steps.log"; then
    failures+=("node 1 continued after its pause but was not fenced")
fi
for s in "${STEP_NAMES[@]}"; do
    [[ -n ${done_steps[$s]:-} ]] || failures+=("step $s was never reached")
done
# The backing file holds the stream's last pass: chunk i = payload chunk (i + pass) mod N.
final=$(tr -d '\r' <"$SERIAL" | sed -n 's/^IRONSAN-MPATH-FINAL \([0-9]*\)$/\1/p' | tail -1)
if [[ -n $final && $result == "IRONSAN-KERNEL-TEST: PASS"* ]]; then
    for ((i = 0; i < PAYLOAD_MIB; i++)); do
        c=$(((i + final) % PAYLOAD_MIB))
        want=$(dd if="$WORK/payload.bin" bs=1M skip="$c" count=1 status=none | sha256sum)
        got=$(dd if="$BACKING" bs=1M skip="$i" count=1 status=none | sha256sum)
        [[ $want == "$got" ]] || failures+=("host: chunk $i of the backing store is not payload chunk $c (pass $final)")
    done
    log "host: the backing store holds pass $final of the write stream, all $PAYLOAD_MIB chunks"
fi
TOTAL=$(($(date +%s) - START))
if [[ ${#failures[@]} -eq 0 ]]; then
    OK=1
    log "$result"
    log "PASS (total ${TOTAL}s)"
    exit 0
fi
echo "----- last 60 lines of the guest console -----"
tail -n 60 "$SERIAL" | tr -d '\r'
for l in "$WORK/server.log" "$WORK/node1.log" "$WORK/node2.log"; do
    [[ -f $l ]] || continue
    echo "----- last 20 lines of $(basename "$l") -----"
    tail -n 20 "$l"
done
for f in "${failures[@]}"; do log "FAIL: $f"; done
exit 1
