#!/usr/bin/env bash
# Start or stop a private instance of tgt (the Linux SCSI target framework,
# Debian package "tgt") as a comparison peer for ironsan.
#
#   bench/peer-tgt.sh start --port PORT [--addr ADDR] --dir DIR [--cpu CPUS] [--lun null|rdwr:SIZE|file:PATH|direct:PATH|rbd:POOL/IMAGE:CONF] [--null-lun2] [--iqn IQN]
#       Prints the iscsi:// URL of the data LUN (always LUN 1) on stdout.
#       --null-lun2 adds LUN 2 with bstype null beside it (bench/run.sh rbd: the round
#       trip through the same tgtd with no backend).
#   bench/peer-tgt.sh stop --dir DIR
#
# Why private: tgtd's management socket is /var/run/tgtd/socket.N, N being the
# "control port" (1..32767 in tgt 1.0.85; a system-wide tgtd uses 0). We
# derive N from the iSCSI port, (PORT % 32767) + 1, so this instance never
# talks to (or reconfigures) a system tgtd and several can coexist.
#
# LUN layout: tgt always puts a "controller" pseudo-LUN at LUN 0, so the data
# LUN is LUN 1.
#   null        bstype null: reads return without touching any storage and
#               writes are discarded; tgt reports a fixed 1 TiB capacity. This
#               measures the protocol/SCSI path only (used by bench/run.sh).
#   rdwr:SIZE   bstype rdwr on a sparse file DIR/lun1.img of SIZE (truncate(1)
#               syntax, e.g. 256M): real data, for conformance runs
#               (scripts/conformance.sh --url ...).
#   file:PATH   bstype rdwr on an existing file PATH, left in place (bench/run.sh
#               uses one file on tmpfs for ironsan, tgt and istgt in turn).
#   direct:PATH the same with --bsoflags direct (O_DIRECT: bench/run.sh's disk
#               setup).
#   rbd:POOL/IMAGE:CONF  bstype rbd (Debian package tgt-rbd) on an image of the
#               cluster described by the ceph.conf CONF, as client.admin.
# Negotiation limits are raised to ironsan's defaults (MaxRecv/MaxXmit
# DataSegmentLength 256 KiB, MaxBurstLength 16 MiB) so a comparison measures
# the implementations, not tgt's conservative 8 KiB defaults.
set -euo pipefail

die() { printf 'peer-tgt: ERROR: %s\n' "$*" >&2; exit 1; }
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" >&2; exit 2; }

[[ $# -ge 1 ]] || usage
cmd=$1; shift
addr=127.0.0.1 port="" dir="" cpus="" lun="null" null2=0 iqn="iqn.2026-11.org.ironsan:peer-tgt"
while [[ $# -gt 0 ]]; do
    case $1 in
        --port) port=$2; shift 2 ;;
        --addr) addr=$2; shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        --cpu) cpus=$2; shift 2 ;;
        --lun) lun=$2; shift 2 ;;
        --null-lun2) null2=1; shift ;;
        --iqn) iqn=$2; shift 2 ;;
        -h|--help) usage ;;
        *) die "unknown argument: $1" ;;
    esac
done
[[ -n $dir ]] || die "--dir is required"

# shellcheck source=bench/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

stop() {
    local pid cport
    [[ -f $dir/tgtd.pid ]] || return 0
    pid=$(<"$dir/tgtd.pid")
    cport=$(cat "$dir/control_port" 2>/dev/null || true)
    # Only touch the process if it is still the tgtd we started (the pid file
    # may be stale and the pid reused).
    if pid_alive "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == tgtd ]]; then
        # tgtd ignores SIGTERM/SIGINT by design; the supported shutdown is to
        # delete the targets, then the "system".
        if [[ -n $cport ]]; then
            tgtadm -C "$cport" --lld iscsi --mode target --op delete --force --tid 1 >/dev/null 2>&1 || true
            tgtadm -C "$cport" --mode system --op delete >/dev/null 2>&1 || true
        fi
        for _ in $(seq 50); do pid_alive "$pid" || break; sleep 0.1; done
        if pid_alive "$pid"; then
            echo "peer-tgt: tgtd $pid did not shut down cleanly; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$dir/tgtd.pid"
    if [[ -n $cport ]]; then
        rm -f "/var/run/tgtd/socket.$cport" "/var/run/tgtd/socket.$cport.lock"
    fi
}


start() {
    [[ -n $port ]] || die "--port is required"
    if ! command -v tgtd >/dev/null || ! command -v tgtadm >/dev/null; then
        die "tgt is not installed (scripts/install-deps.sh)"
    fi
    [[ $(id -u) -eq 0 ]] || die "tgtd needs root"
    mkdir -p "$dir"
    stop
    listening "$port" && die "port $port is already in use"

    local -a pin=()
    [[ -z $cpus ]] || pin=(taskset -c "$cpus")
    local cport=$(( port % 32767 + 1 ))
    echo "$cport" >"$dir/control_port"
    # -f: stay in the foreground so $! is tgtd's own pid (the bench samples
    # its CPU time from /proc/PID/stat); stdin detached, output to a log.
    "${pin[@]}" tgtd -f -C "$cport" --iscsi "portal=$addr:$port" \
        </dev/null >"$dir/tgtd.log" 2>&1 &
    local pid=$!
    echo "$pid" >"$dir/tgtd.pid"

    local adm=(tgtadm -C "$cport" --lld iscsi)
    # Wait for the management socket: tgtadm fails until tgtd is up.
    local ok=0
    for _ in $(seq 100); do
        pid_alive "$pid" || { cat "$dir/tgtd.log" >&2; die "tgtd exited during startup"; }
        if "${adm[@]}" --mode target --op show >/dev/null 2>&1; then ok=1; break; fi
        sleep 0.1
    done
    [[ $ok -eq 1 ]] || { stop; die "tgtd management socket did not come up"; }

    "${adm[@]}" --mode target --op new --tid 1 -T "$iqn"
    case $lun in
        null)
            # bs_null ignores the path but tgtadm insists on one.
            "${adm[@]}" --mode logicalunit --op new --tid 1 --lun 1 --bstype null -b /dev/null ;;
        rdwr:*)
            local size=${lun#rdwr:}
            rm -f "$dir/lun1.img"
            truncate -s "$size" "$dir/lun1.img"
            "${adm[@]}" --mode logicalunit --op new --tid 1 --lun 1 --bstype rdwr -b "$dir/lun1.img" ;;
        file:* | direct:*)
            local path=${lun#*:} oflags=()
            [[ $lun == direct:* ]] && oflags=(--bsoflags direct)
            [[ -f $path ]] || { stop; die "no such file: $path"; }
            "${adm[@]}" --mode logicalunit --op new --tid 1 --lun 1 --bstype rdwr \
                "${oflags[@]}" -b "$path" ;;
        rbd:*)
            local rest=${lun#rbd:}
            local image=${rest%%:*} conf=${rest#*:}
            [[ -f $conf ]] || { stop; die "no such ceph.conf: $conf"; }
            "${adm[@]}" --mode logicalunit --op new --tid 1 --lun 1 --bstype rbd \
                --bsopts "conf=$conf" -b "$image" ;;
        *) stop; die "unknown --lun $lun (null | rdwr:SIZE | file:PATH | direct:PATH | rbd:POOL/IMAGE:CONF)" ;;
    esac
    if [[ $null2 -eq 1 ]]; then
        "${adm[@]}" --mode logicalunit --op new --tid 1 --lun 2 --bstype null -b /dev/null
    fi
    # Offer the same negotiation limits ironsan offers (its defaults), so
    # large reads are not split into tgt's default 8 KiB Data-In PDUs.
    local kv
    for kv in MaxRecvDataSegmentLength=262144 MaxXmitDataSegmentLength=262144 \
              FirstBurstLength=262144 MaxBurstLength=16776192; do
        "${adm[@]}" --mode target --op update --tid 1 --name "${kv%%=*}" --value "${kv#*=}"
    done
    "${adm[@]}" --mode target --op bind --tid 1 -I ALL

    for _ in $(seq 100); do
        listening "$port" && break
        sleep 0.1
    done
    listening "$port" || { stop; die "tgtd is not listening on $addr:$port"; }
    local host=$addr
    [[ $host == 0.0.0.0 ]] && host=127.0.0.1
    echo "iscsi://$host:$port/$iqn/1"
}

case $cmd in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
