#!/usr/bin/env bash
# The real Linux kernel iSCSI initiator (open-iscsi + iscsi_tcp) against
# ironsan, in a QEMU guest under TCG emulation (no KVM or host iSCSI modules needed).
#
#   scripts/kernel-initiator.sh
#
# Starts `ironsan serve` on a free 127.0.0.1 port with a 256 MiB file LUN,
# boots Debian's kernel with a throw-away initramfs (tests/kernel/init) whose
# only network route is a guestfwd portal 10.0.2.100:3260 relayed to that
# port (restrict=on: the guest reaches nothing else). The guest discovers the
# target (SendTargets), logs in with iscsistart, checks a raw O_DIRECT region,
# makes ext4, writes a 20 MiB random payload and small files, runs
# e2fsck -fn, remounts and verifies, logs out, and prints
# "IRONSAN-KERNEL-TEST: PASS ..." or "... FAIL <reason>". Then the host checks
# the LUN's backing file itself: e2fsck -fn, every file's sha256 through
# debugfs against what the guest printed (and the payload against the host's
# own copy), and the raw region. Exit status 0 only if all of that held.
#
# Environment:
#   IRONSAN_BIN              ironsan binary (default target/release/ironsan, built if missing)
#   IRONSAN_REQUIRE_TOOLS=1  missing packages are an error (default: skip with exit 0)
#   IRONSAN_KERNEL_VERSION   kernel under /lib/modules to boot (default: newest with iscsi_tcp)
#   IRONSAN_KERNEL_TIMEOUT   hard limit for the guest, seconds (default 300)
#   IRONSAN_KERNEL_DIGEST    CRC32C (default) or None: header and data digests
#   IRONSAN_KERNEL_ACCEL     QEMU accelerator (default tcg; kvm where KVM really works)
#   IRONSAN_KEEP=1           keep the work directory (it is always kept on failure)
#   IRONSAN_KERNEL_QEMU_ARGS extra QEMU arguments, split on spaces (e.g. a pcap of the
#                            guest's traffic: -object filter-dump,id=d0,netdev=n0,file=/tmp/g.pcap)
#
# shellcheck disable=SC2317  # is_static_busybox, cleanup: called through need() and trap
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KDIR=$ROOT/tests/kernel
START=$(date +%s)

log() { printf 'kernel-initiator: %s\n' "$*"; }
die() { printf 'kernel-initiator: ERROR: %s\n' "$*" >&2; exit 1; }

TIMEOUT=${IRONSAN_KERNEL_TIMEOUT:-300}
DIGEST=${IRONSAN_KERNEL_DIGEST:-CRC32C}
# Authentication of the guest's login: mutual CHAP (default), one-way CHAP, or none.
CHAP=${IRONSAN_KERNEL_CHAP:-mutual}
case $CHAP in mutual | one-way | none) ;; *) die "IRONSAN_KERNEL_CHAP must be mutual, one-way or none" ;; esac
CHAP_USER=kernel-initiator
CHAP_SECRET=initiator-secret-$RANDOM$RANDOM
CHAP_TUSER=ironsan-target
CHAP_TSECRET=target-secret-$RANDOM$RANDOM
AUTH_ARGS=()
case $CHAP in
    mutual) AUTH_ARGS=(--chap "$CHAP_USER:$CHAP_SECRET" --mutual-chap "$CHAP_TUSER:$CHAP_TSECRET") ;;
    one-way) AUTH_ARGS=(--chap "$CHAP_USER:$CHAP_SECRET") ;;
esac
case $DIGEST in CRC32C | None) ;; *) die "IRONSAN_KERNEL_DIGEST must be CRC32C or None" ;; esac
TARGET_IQN=iqn.2026-11.org.ironsan:kernel-test
INITIATOR_IQN=iqn.2026-11.org.ironsan:guest-initiator
LUN_SIZE_MIB=256
RAW_MIB=16
PAYLOAD_MIB=20

# ---------------------------------------------------------------------------
# Tools. Nothing is installed here: scripts/install-deps.sh does that.
# ---------------------------------------------------------------------------
missing=()
need() { # need PACKAGE CHECK...
    local pkg=$1
    shift
    "$@" >/dev/null 2>&1 || missing+=("$pkg")
}
is_static_busybox() {
    local b out
    b=$(command -v busybox) || return 1
    out=$(LC_ALL=C ldd "$b" 2>&1 || true)
    [[ $out == *"not a dynamic executable"* ]]
}
need qemu-system-x86 command -v qemu-system-x86_64
need busybox-static is_static_busybox
need open-iscsi test -x /usr/sbin/iscsistart -a -x /usr/sbin/iscsiadm -a -x /usr/sbin/iscsid
need e2fsprogs test -x /usr/sbin/mke2fs -a -x /usr/sbin/e2fsck -a -x /usr/sbin/debugfs
need python3 test -x /usr/bin/python3

# shellcheck source=tests/kernel/common.sh
. "$KDIR/common.sh"
guest_prerequisites

# TCG by default: on these machines /dev/kvm can exist and open yet not run
# a guest (it spins in the kernel), and TCG is fast enough (about a minute).
ACCEL=${IRONSAN_KERNEL_ACCEL:-tcg}

# ---------------------------------------------------------------------------
# Work directory, server, cleanup.
# ---------------------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ironsan-kernel.XXXXXX")
[[ $WORK != *,* ]] || die "work directory $WORK contains a comma (QEMU option syntax)"
SERVER_PID=""
QEMU_PID=""
OK=0

stop_server() {
    [[ -n $SERVER_PID ]] || return 0
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        local i
        for ((i = 0; i < 100; i++)); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$SERVER_PID" 2>/dev/null; then
            log "ironsan did not stop within 10 s of SIGTERM; killing it"
            kill -KILL "$SERVER_PID" 2>/dev/null || true
        fi
    fi
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
cleanup() {
    local rc=$?
    if [[ -n $QEMU_PID ]] && kill -0 "$QEMU_PID" 2>/dev/null; then
        # QEMU_PID is timeout(1), which passes SIGTERM on to QEMU.
        kill -TERM "$QEMU_PID" 2>/dev/null || true
        local i
        for ((i = 0; i < 50; i++)); do
            kill -0 "$QEMU_PID" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$QEMU_PID" 2>/dev/null || true
        wait "$QEMU_PID" 2>/dev/null || true
    fi
    stop_server
    if [[ $OK == 1 && ${IRONSAN_KEEP:-0} != 1 ]]; then
        rm -rf "$WORK"
    else
        log "work directory kept: $WORK (serial.log, server.log, relay.log, data/lun0.img)"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

PORT=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$WORK/data"
"$BIN" serve --listen "127.0.0.1:$PORT" --target "$TARGET_IQN" \
    --lun "file:lun0.img:${LUN_SIZE_MIB}M" --zero-copy-reads on --control "$WORK/control.sock" \
    --data-dir "$WORK/data" --log "${IRONSAN_LOG:-info}" \
    "${AUTH_ARGS[@]}" \
    >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
ready=0
for ((i = 0; i < 100; i++)); do
    kill -0 "$SERVER_PID" 2>/dev/null || break
    if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
        ready=1
        break
    fi
    sleep 0.1
done
if [[ $ready != 1 ]]; then
    cat "$WORK/server.log" >&2
    die "ironsan serve did not listen on 127.0.0.1:$PORT within 10 s"
fi
log "ironsan $("$BIN" --version 2>/dev/null | head -1) (pid $SERVER_PID, $BIN) on 127.0.0.1:$PORT, LUN 0 = $WORK/data/lun0.img (${LUN_SIZE_MIB} MiB)"

# ---------------------------------------------------------------------------
# Payload, guest settings, initramfs.
# ---------------------------------------------------------------------------
head -c "$((PAYLOAD_MIB << 20))" /dev/urandom >"$WORK/payload.bin"
PAYLOAD_SHA256=$(sha256sum "$WORK/payload.bin" | cut -d' ' -f1)
RAW_SHA256=$(head -c "$((RAW_MIB << 20))" "$WORK/payload.bin" | sha256sum | cut -d' ' -f1)
cat >"$WORK/guest.env" <<EOF
TARGET_IQN=$TARGET_IQN
INITIATOR_IQN=$INITIATOR_IQN
PORTAL_IP=10.0.2.100
PORTAL_PORT=3260
GUEST_IP=10.0.2.15
GATEWAY=10.0.2.2
DIGEST=$DIGEST
CHAP=$CHAP
CHAP_USER=$CHAP_USER
CHAP_SECRET=$CHAP_SECRET
CHAP_TUSER=$CHAP_TUSER
CHAP_TSECRET=$CHAP_TSECRET
RAW_MIB=$RAW_MIB
RAW_SHA256=$RAW_SHA256
PAYLOAD_SHA256=$PAYLOAD_SHA256
EOF
bash "$KDIR/build-initramfs.sh" "$KVER" "$WORK/rootfs" "$WORK/initrd.cpio" "$WORK/guest.env" "$WORK/payload.bin"
rm -rf "$WORK/rootfs"
cp "$KDIR/relay.py" "$WORK/relay.py"

# ---------------------------------------------------------------------------
# The guest. Its only way out is 10.0.2.100:3260, and each connection to it
# runs relay.py, which connects to ironsan (see relay.py for why not a
# chardev guestfwd).
# ---------------------------------------------------------------------------
NETDEV="user,id=n0,restrict=on,ipv6=off,net=10.0.2.0/24,host=10.0.2.2"
NETDEV+=",guestfwd=tcp:10.0.2.100:3260-cmd:/usr/bin/python3 $WORK/relay.py 127.0.0.1 $PORT $WORK/relay.log $((TIMEOUT + 60))"
QEMU_EXTRA=()
read -r -a QEMU_EXTRA <<<"${IRONSAN_KERNEL_QEMU_ARGS:-}"
log "booting Linux $KVER under QEMU (accel $ACCEL, timeout ${TIMEOUT}s, digests $DIGEST, CHAP $CHAP)"
T_QEMU=$(date +%s)
timeout --kill-after=10 "$TIMEOUT" qemu-system-x86_64 \
    -nodefaults -no-user-config -machine "pc,accel=$ACCEL" -m 512 -smp 1 \
    -display none -vga none -monitor none -serial "file:$WORK/serial.log" -no-reboot \
    -kernel "/boot/vmlinuz-$KVER" -initrd "$WORK/initrd.cpio" \
    -append "console=ttyS0 panic=-1 quiet" \
    -netdev "$NETDEV" -device virtio-net-pci,netdev=n0,romfile= \
    "${QEMU_EXTRA[@]}" \
    </dev/null >"$WORK/qemu.log" 2>&1 &
QEMU_PID=$!
qemu_rc=0
wait "$QEMU_PID" || qemu_rc=$?
QEMU_PID=""
GUEST_SECS=$(($(date +%s) - T_QEMU))
# Data-In bytes the target sent from the page cache (sendfile): zero-copy reads are forced on,
# so with DataDigest=None the guest's large reads go that way, and with CRC32C none may.
ZERO_COPY=$("$BIN" ctl --control "$WORK/control.sock" --json counters 2>/dev/null |
    /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["zero_copy_read_bytes"])' 2>/dev/null || echo "?")
stop_server
rm -f "$WORK/initrd.cpio"

# ---------------------------------------------------------------------------
# Verdict.
# ---------------------------------------------------------------------------
SERIAL=$WORK/serial.log
touch "$SERIAL"
echo "----- guest console (dmesg filtered) -----"
# The guest's own lines, then the kernel lines about SCSI/iSCSI/ext4.
sed -n '/----- guest dmesg begin -----/q;p' "$SERIAL" | tr -d '\r' | grep -v '^\s*$' || true
sed -n '/----- guest dmesg begin -----/,/----- guest dmesg end -----/p' "$SERIAL" | tr -d '\r' |
    grep -E 'scsi|iscsi|\[sd[a-z]+\]|sd [0-9]+:|connection[0-9]|session[0-9]|EXT4|JBD2|I/O error|critical|Sense|WARNING|Call Trace|BUG' |
    grep -v -- '----- guest dmesg' | sed 's/^/  dmesg: /' || true
echo "----- end of guest console -----"

failures=()
[[ $qemu_rc -eq 0 ]] || failures+=("qemu exited with status $qemu_rc$([[ $qemu_rc -eq 124 || $qemu_rc -eq 137 ]] && echo " (timed out after ${TIMEOUT}s)")")
result=$(tr -d '\r' <"$SERIAL" | grep -E '^IRONSAN-KERNEL-TEST: (PASS|FAIL)' | tail -1 || true)
if [[ $result == "IRONSAN-KERNEL-TEST: PASS"* ]]; then
    :
elif [[ -n $result ]]; then
    failures+=("guest: ${result#IRONSAN-KERNEL-TEST: }")
else
    failures+=("the guest printed no IRONSAN-KERNEL-TEST result line")
fi

# Host-side checks of the backing file: the data really is on ironsan's disk.
IMG=$WORK/data/lun0.img
if [[ $result == "IRONSAN-KERNEL-TEST: PASS"* ]]; then
    if /usr/sbin/e2fsck -fn "$IMG" >"$WORK/host-fsck.out" 2>&1; then
        log "host: e2fsck -fn $IMG: clean ($(tail -1 "$WORK/host-fsck.out"))"
    else
        cat "$WORK/host-fsck.out"
        failures+=("host: e2fsck -fn of the backing file is not clean")
    fi
    nfiles=0
    while read -r _ sum path; do
        got=$(/usr/sbin/debugfs -R "cat $path" "$IMG" 2>/dev/null | sha256sum | cut -d' ' -f1)
        if [[ $got == "$sum" ]]; then
            nfiles=$((nfiles + 1))
        else
            failures+=("host: $path in the backing file has sha256 $got, the guest wrote $sum")
        fi
    done < <(tr -d '\r' <"$SERIAL" | grep -E '^IRONSAN-KERNEL-SHA256 [0-9a-f]{64} /')
    [[ $nfiles -ge 5 ]] || failures+=("host: only $nfiles files checked (expected 5)")
    expect_small() { # expect_small PATH CONTENT-COMMAND...
        local path=$1 want got
        shift
        want=$("$@" | sha256sum | cut -d' ' -f1)
        got=$(/usr/sbin/debugfs -R "cat $path" "$IMG" 2>/dev/null | sha256sum | cut -d' ' -f1)
        [[ $got == "$want" ]] || failures+=("host: $path content is not what the guest was told to write")
    }
    expect_small /data/payload.bin cat "$WORK/payload.bin"
    expect_small /small/hello.txt echo "hello from the Linux kernel iSCSI initiator"
    expect_small /small/seq.txt seq 1 10000
    expect_small /small/empty true
    expect_small /small/deeper/three.txt seq 1 3
    raw=$(dd if="$IMG" bs=1M skip=$((LUN_SIZE_MIB - RAW_MIB)) count="$RAW_MIB" status=none | sha256sum | cut -d' ' -f1)
    [[ $raw == "$RAW_SHA256" ]] || failures+=("host: raw region of the backing file has sha256 $raw, expected $RAW_SHA256")
    log "host: $nfiles files in the backing file match the guest's checksums; payload and raw region match the host's copy"
fi

warns=$(grep -cE '\b(WARN|ERROR)\b' "$WORK/server.log" || true)
if [[ $warns -gt 0 ]]; then
    log "ironsan logged $warns WARN/ERROR lines:"
    grep -E '\b(WARN|ERROR)\b' "$WORK/server.log" | tail -20 | sed 's/^/  server: /'
fi

TOTAL=$(($(date +%s) - START))
log "target: $ZERO_COPY Data-In bytes sent from the page cache (digests $DIGEST)"
case $DIGEST/$ZERO_COPY in
    */\?) failures+=("could not read the target's zero-copy counter") ;;
    None/0) failures+=("DataDigest=None with --zero-copy-reads on, yet no read went by sendfile") ;;
    CRC32C/0) ;;
    CRC32C/*) failures+=("DataDigest=CRC32C, yet $ZERO_COPY bytes went by sendfile (the digest needs them in memory)") ;;
esac

if [[ ${#failures[@]} -eq 0 ]]; then
    OK=1
    log "$result"
    log "PASS (guest ${GUEST_SECS}s, total ${TOTAL}s)"
    exit 0
fi
echo "----- last 60 lines of the guest console -----"
tail -n 60 "$SERIAL" | tr -d '\r'
echo "----- last 30 lines of the ironsan log -----"
tail -n 30 "$WORK/server.log"
[[ -s $WORK/qemu.log ]] && { echo "----- qemu -----"; cat "$WORK/qemu.log"; }
for f in "${failures[@]}"; do
    log "FAIL: $f"
done
log "FAIL (guest ${GUEST_SECS}s, total ${TOTAL}s)"
exit 1
