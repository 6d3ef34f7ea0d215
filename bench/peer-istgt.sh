#!/usr/bin/env bash
# Start or stop a private instance of istgt (Debian package "istgt", the
# FreeBSD-born userspace target) as a comparison peer for ironsan.
#
#   bench/peer-istgt.sh start --port PORT [--addr ADDR] --dir DIR --file PATH [--size SIZE] [--cpu CPUS] [--iqn IQN]
#       Creates PATH sparse (truncate(1) SIZE, default 256M) if missing,
#       writes DIR/istgt.conf and DIR/auth.conf, starts `istgt -c DIR/istgt.conf -D`
#       (foreground, so the pid is istgt's own), and prints the iscsi:// URL of
#       LUN 0 on stdout.
#   bench/peer-istgt.sh stop --dir DIR
#
# istgt has no RAM or null backend: it only serves files/devices, so it takes
# part in the file-LUN comparison only. No authentication, no digests; the
# negotiation limits are raised to ironsan's defaults where istgt allows it
# (MaxRecvDataSegmentLength 256 KiB; istgt caps MaxBurstLength at 1 MiB? we
# offer 16 MiB and it keeps what it supports). QueueDepth 64 (istgt's maximum
# is 255; 64 covers QD32 runs and 16 sessions x QD8). MaxSessions 128 so the
# idle-session memory probe (100 sessions) fits.
set -euo pipefail

die() { printf 'peer-istgt: ERROR: %s\n' "$*" >&2; exit 1; }
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" >&2; exit 2; }

[[ $# -ge 1 ]] || usage
cmd=$1; shift
addr=127.0.0.1 port="" dir="" cpus="" file="" size=256M iqn="iqn.2026-11.org.ironsan:peer-istgt"
while [[ $# -gt 0 ]]; do
    case $1 in
        --port) port=$2; shift 2 ;;
        --addr) addr=$2; shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        --cpu) cpus=$2; shift 2 ;;
        --file) file=$2; shift 2 ;;
        --size) size=$2; shift 2 ;;
        --iqn) iqn=$2; shift 2 ;;
        -h|--help) usage ;;
        *) die "unknown argument: $1" ;;
    esac
done
[[ -n $dir ]] || die "--dir is required"

# shellcheck source=bench/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

stop() {
    [[ -f $dir/istgt.pid ]] || return 0
    local pid
    pid=$(<"$dir/istgt.pid")
    if pid_alive "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == istgt ]]; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do pid_alive "$pid" || break; sleep 0.1; done
        if pid_alive "$pid"; then
            echo "peer-istgt: istgt $pid did not exit on SIGTERM; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$dir/istgt.pid"
}


start() {
    [[ -n $port ]] || die "--port is required"
    [[ -n $file ]] || die "--file is required"
    command -v istgt >/dev/null || die "istgt is not installed (apt-get install istgt)"
    mkdir -p "$dir"
    stop
    listening "$port" && die "port $port is already in use"
    [[ -e $file ]] || truncate -s "$size" "$file"
    local bytes
    bytes=$(stat -c %s "$file")
    # istgt wants the LU size in the config; MB units, rounded down.
    local mb=$((bytes / 1048576))

    # The iqn is split into NodeBase and the short TargetName.
    local base=${iqn%:*} short=${iqn##*:}
    cat >"$dir/auth.conf" <<EOF
[AuthGroup1]
  Comment "unused: the bench logs in without CHAP"
  Auth "iqn.2026-11.org.ironsan:nobody" "bench-secret-12"
EOF
    cat >"$dir/istgt.conf" <<EOF
[Global]
  NodeBase "$base"
  PidFile $dir/istgt.pid.daemon
  AuthFile $dir/auth.conf
  MediaDirectory $dir
  LogFacility "local7"
  Timeout 30
  NopInInterval 20
  DiscoveryAuthMethod None
  MaxSessions 128
  MaxConnections 4
  MaxR2T 32
  MaxOutstandingR2T 16
  DefaultTime2Wait 2
  DefaultTime2Retain 60
  FirstBurstLength 262144
  MaxBurstLength 16776192
  MaxRecvDataSegmentLength 262144
  InitialR2T Yes
  ImmediateData Yes
  DataPDUInOrder Yes
  DataSequenceInOrder Yes
  ErrorRecoveryLevel 0
[UnitControl]
  AuthMethod None
  Netmask 127.0.0.1
[PortalGroup1]
  Portal DA1 $addr:$port
[InitiatorGroup1]
  InitiatorName "ALL"
  Netmask 127.0.0.0/8
  Netmask 10.77.0.0/16
[LogicalUnit1]
  TargetName $short
  Mapping PortalGroup1 InitiatorGroup1
  AuthMethod None
  UseDigest Auto
  UnitType Disk
  QueueDepth 64
  LUN0 Storage $file ${mb}MB
EOF

    local -a pin=()
    [[ -z $cpus ]] || pin=(taskset -c "$cpus")
    # -D: no daemonising, so $! is istgt itself (the bench reads its CPU time
    # from /proc/PID/stat). -m 1 is istgt's default "normal" mode.
    "${pin[@]}" istgt -c "$dir/istgt.conf" -D </dev/null >"$dir/istgt.log" 2>&1 &
    local pid=$!
    echo "$pid" >"$dir/istgt.pid"
    for _ in $(seq 100); do
        pid_alive "$pid" || { cat "$dir/istgt.log" >&2; die "istgt exited during startup"; }
        listening "$port" && break
        sleep 0.1
    done
    listening "$port" || { stop; die "istgt is not listening on $addr:$port"; }
    local host=$addr
    [[ $host == 0.0.0.0 ]] && host=127.0.0.1
    echo "iscsi://$host:$port/$iqn/0"
}

case $cmd in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
