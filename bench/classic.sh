#!/usr/bin/env bash
# The classic iSCSI target experiments (../shared/design/seed-experiments.md), one command
# each, against ironsan and the peers (tgt, istgt), on loopback or across emulated Gigabit
# lines (network namespaces joined by veth pairs, each direction capped with tc tbf).
#
#   bench/classic.sh [EXPERIMENT...] [--targets LIST] [--quick] [--full] [--no-save]
#                    [--rate RATE] [--tsv FILE] [--report DIR]
#
#   EXPERIMENT (default: all, in this order)
#     iometer    the IOmeter matrix (FORTH study): sequential/random x read, write and a
#                70/30 read/write mix x outstanding requests x request size, on one 256 MiB
#                file on tmpfs (ironsan file LUN, tgt rdwr, istgt), loopback; throughput,
#                mean response time and target CPU per point. Default grid: QD 1, 4, 16 x
#                512 B, 4 KiB, 32 KiB, 128 KiB; --full: QD 1, 2, 4, 8, 16 x 512 B ... 128 KiB
#                (every power of two).
#     ramdisk    a RAM-disk target with one outstanding request: response time, throughput
#                and initiator CPU per I/O for reads and writes of 512 B ... 128 KiB
#                (ironsan's RAM LUN, and the tmpfs file for all three), loopback.
#     dd         `dd bs=512K count=2000` read and write of the raw LUN over one Gigabit line
#                (iSCSI-SCST vs IET vs STGT, 2009): QD1 sequential 512 KiB commands, NULLIO
#                (ironsan null, tgt null), FILEIO (page cache: a 1 GiB file on a disk file
#                system, write cache on) and BLOCKIO (the same file with O_DIRECT).
#     mpio       the same dd over two lines (MPIO): one session per line, each moving half
#                the data, against one line; the ratio two / one (iSCSI-SCST got 1.67x).
#     sessions   the multiple-connections experiment (IISc): one session of 4 connections
#                (MC/S) sharing one Gigabit line, sequential 512 KiB writes then reads, one
#                command in flight per connection; beside it 4 separate sessions on the same
#                line. Per connection (or session): MiB/s, command turnaround mean and
#                deviation; Jain's fairness index; the senders' congestion windows sampled
#                every 0.5 s, their TCP retransmissions and the share of their busy time
#                spent limited by the receiver's window or their send buffer (ss -ti,
#                tcp_info's rwnd_limited / sndbuf_limited). Commands spread round robin
#                (rr: equal counts per connection, so unfairness shows in turnaround) and to
#                the least loaded connection (lqd: it shows in throughput); ironsan with its
#                connection fairness off and on; istgt (MC/S too); tgt (one connection per
#                session) with sessions only.
#     mcs        one session over 1, 2 and 4 lines, one connection per line (sequential
#                512 KiB writes then reads, 2 in flight per connection): the ratio to one
#                line (goal: N lines give N x one line); and on loopback, 4 KiB QD32 random
#                reads and 512 KiB QD8 reads with 1, 2 and 4 connections: IOPS and target
#                CPU per I/O. ironsan and istgt (tgt offers one connection per session).
#     cache      target-side cache: a 4 KiB random 70/30 read/write mix at QD8 over a
#                256 MiB file on a disk file system, FILEIO (page cache, warmed first) against
#                BLOCKIO (O_DIRECT), ironsan and tgt, loopback; the ratio FILEIO / BLOCKIO.
#     scaleout   three targets striped together by the initiator (one session to each, over
#                a line each) against one target over one line, against the local disk
#                (dd with O_DIRECT on the same file system); sequential 512 KiB at QD4.
#     breakdown  where the time goes: per-stage time per command inside ironsan (receive,
#                queue, backend, respond, send; `ironsan ctl stats`) and target CPU per I/O
#                for ironsan, tgt and istgt, for 4 KiB QD32 random reads and writes and
#                512 KiB QD8 sequential reads and writes (RAM LUN / tgt null / istgt tmpfs),
#                loopback.
#
#   --targets LIST   comma-separated subset of ironsan,tgt,istgt (default: all three)
#   --quick          short runs (a smoke test: the tool works, figures not judged)
#   --full           the full IOmeter grid
#   --rate RATE      the emulated line rate (tc syntax, default 1gbit)
#   --no-save        print only, do not append to bench/results/<date>-classic.txt
#   --tsv FILE       also write every measured point as tab-separated values (for plots)
#   --report DIR     draw the figures of what was measured: DIR/index.html, the PNGs beside
#                    it, and the data (DIR/classic.tsv, DIR/meta-classic.txt) to redraw them
#                    with bench/report.py DIR (docs/PERFORMANCE.md, "Reports")
#   --tcp-cc NAME    TCP congestion control of the targets' and the initiator's sockets
#                    (net.ipv4.tcp_congestion_control of both namespaces, restored at exit),
#                    e.g. cubic on a host whose default is bbr
#
# Builds nothing: uses target/release/ironsan (or $IRONSAN_BIN), `ironsan load` as the
# client (pinned to CPU 1, targets to CPU 0). Needs root (namespaces, tc, tgtd), iproute2,
# tgt, istgt, python3, taskset. The initiator-side file system part of the dd experiment
# (ext3 on the LUN) needs a kernel initiator, which this host has only in an emulated guest
# (tests/kernel): not run here, see docs/PERFORMANCE.md.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=bench/common.sh
. "$ROOT/bench/common.sh"

die() { printf 'classic: ERROR: %s\n' "$*" >&2; exit 1; }
note() { printf 'classic: %s\n' "$*" >&2; }

ALL_EXPERIMENTS="iometer ramdisk dd mpio sessions mcs cache scaleout breakdown"
EXPERIMENTS="" TARGETS="ironsan tgt istgt" QUICK=0 FULL=0 SAVE=1 RATE=1gbit TSV="" TCP_CC="" REPORT=""
ARGS=("$@")
while [[ $# -gt 0 ]]; do
    case $1 in
        --targets) TARGETS=${2:?}; TARGETS=${TARGETS//,/ }; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --full) FULL=1; shift ;;
        --no-save) SAVE=0; shift ;;
        --rate) RATE=${2:?}; shift 2 ;;
        --tsv) TSV=${2:?}; shift 2 ;;
        --report) REPORT=${2:?}; shift 2 ;;
        --tcp-cc) TCP_CC=${2:?}; shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        -*) die "unknown option: $1 (see --help)" ;;
        *) [[ " $ALL_EXPERIMENTS " == *" $1 "* ]] || die "unknown experiment: $1 (one of: $ALL_EXPERIMENTS)"
           EXPERIMENTS+=" $1"; shift ;;
    esac
done
EXPERIMENTS=${EXPERIMENTS:-$ALL_EXPERIMENTS}
for t in $TARGETS; do
    [[ " ironsan tgt istgt " == *" $t "* ]] || die "--targets: unknown target '$t'"
done
want_target() { [[ " $TARGETS " == *" $1 "* ]]; }
[[ $(id -u) -eq 0 ]] || die "needs root (network namespaces, tc, tgtd)"
for tool in ip tc taskset ss python3; do command -v "$tool" >/dev/null || die "$tool not found"; done
want_target tgt && { command -v tgtd >/dev/null || die "tgtd not found"; }
want_target istgt && { command -v istgt >/dev/null || die "istgt not found"; }
BIN=${IRONSAN_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/ironsan}
[[ -x $BIN ]] || die "$BIN not found: run 'cargo build --release -p ironsan'"

# Run lengths: seconds per timed point, commands per dd.
if ((QUICK)); then SECS=0.5 DD_COUNT=40 SESSION_SECS=1; else SECS=1 DD_COUNT=2000 SESSION_SECS=10; fi
TARGET_CPU=0 CLIENT_CPU=1
[[ $(nproc) -ge 2 ]] || { note "WARNING: one CPU; target and client share it"; CLIENT_CPU=0; }
CLK_TCK=$(getconf CLK_TCK)
NS=ironsan-classic
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ironsan-classic.XXXXXX")
SHM=$(mktemp -d /dev/shm/ironsan-classic.XXXXXX)
DISK=$(mktemp -d "${DISK_DIR:-/var/tmp}/ironsan-classic.XXXXXX")
OUT=$WORK/report.txt
: >"$OUT"
declare -A PID=() URL=() KIND=()
# Extra `ironsan serve` arguments of the next start_target (e.g. --connection-fairness on).
IRONSAN_ARGS=()
LINES=0

cleanup() {
    local n
    for n in "${!PID[@]}"; do stop_target "$n"; done
    lines_down
    restore_tcp_cc
    rm -rf "$WORK" "$SHM" "$DISK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# After the trap, so the host's setting comes back however the run ends.
[[ -z $TCP_CC ]] || set_tcp_cc "$TCP_CC"

say() { printf '%s\n' "$*" | tee -a "$OUT"; }

# --- emulated lines ------------------------------------------------------------------------
# lines_up N: namespace $NS (the initiator's side) joined to this one (the targets') by N
# veth pairs; line i is 10.77.i.1 (targets) <-> 10.77.i.2 (initiator), both directions capped
# at $RATE by tbf (so a line is a full-duplex Gigabit link).
lines_up() {
    local n=$1 i
    lines_down
    ip netns add "$NS"
    ip -n "$NS" link set lo up
    [[ -z $TCP_CC ]] || ip netns exec "$NS" sh -c "echo $TCP_CC >$CC_SYSCTL"
    for ((i = 1; i <= n; i++)); do
        ip link add "icl$i" type veth peer name "icr$i"
        ip link set "icr$i" netns "$NS"
        ip addr add "10.77.$i.1/24" dev "icl$i"
        ip link set "icl$i" up
        ip -n "$NS" addr add "10.77.$i.2/24" dev "icr$i"
        ip -n "$NS" link set "icr$i" up
        tc qdisc add dev "icl$i" root tbf rate "$RATE" burst 256kb latency 20ms
        tc -n "$NS" qdisc add dev "icr$i" root tbf rate "$RATE" burst 256kb latency 20ms
    done
    LINES=$n
}
lines_down() {
    local i
    for ((i = 1; i <= 4; i++)); do ip link del "icl$i" 2>/dev/null || true; done
    ip netns del "$NS" 2>/dev/null || true
    LINES=0
}
# on_line URL I: URL with its host replaced by line I's target address.
on_line() { sed -E "s#^iscsi://[^/]+:([0-9]+)/#iscsi://10.77.$2.1:\1/#" <<<"$1"; }

# --- targets -------------------------------------------------------------------------------
# start_target NAME KIND LUN: KIND ironsan, tgt or istgt; LUN is null, ram, shm (the 256 MiB
# tmpfs file), disk (the 1 GiB file on a disk file system, page cache), direct (the same
# file, O_DIRECT), or shm2/shm3 (further tmpfs files, for scaleout). Listens on every
# address (loopback and the lines), pinned to CPU $TARGET_CPU.
start_target() {
    local name=$1 kind=$2 lun=$3 port dir=$WORK/$1 pid url
    port=$(free_port 0.0.0.0)
    mkdir -p "$dir"
    local file=""
    case $lun in
        shm*) file=$SHM/lun${lun#shm}.img ;;
        disk|direct) file=$DISK/lun.img ;;
    esac
    case $kind in
        ironsan)
            local spec extra=(--write-cache)
            case $lun in
                null) spec=null:1G; extra=() ;;
                ram) spec=ram:1G; extra=() ;;
                direct) spec=file:$file,direct ;;
                *) spec=file:$file ;;
            esac
            NO_COLOR=1 taskset -c "$TARGET_CPU" "$BIN" serve --listen "0.0.0.0:$port" \
                --target iqn.2026-11.org.ironsan:classic --lun "$spec" "${extra[@]}" "${IRONSAN_ARGS[@]}" \
                --data-dir "$dir/data" --control "$dir/control.sock" \
                </dev/null >"$dir/ironsan.log" 2>&1 &
            pid=$!
            for _ in $(seq 300); do
                kill -0 "$pid" 2>/dev/null || { cat "$dir/ironsan.log" >&2; die "$name exited during startup"; }
                listening "$port" && break
                sleep 0.1
            done
            listening "$port" || die "$name is not listening on port $port"
            url=iscsi://127.0.0.1:$port/iqn.2026-11.org.ironsan:classic/0 ;;
        tgt)
            local tl
            case $lun in
                null|ram) tl=null ;;
                direct) tl=direct:$file ;;
                *) tl=file:$file ;;
            esac
            url=$(bash "$ROOT/bench/peer-tgt.sh" start --addr 0.0.0.0 --port "$port" --dir "$dir" \
                --cpu "$TARGET_CPU" --lun "$tl")
            pid=$(<"$dir/tgtd.pid") ;;
        istgt)
            url=$(bash "$ROOT/bench/peer-istgt.sh" start --addr 0.0.0.0 --port "$port" --dir "$dir" \
                --cpu "$TARGET_CPU" --file "$file")
            pid=$(<"$dir/istgt.pid") ;;
    esac
    PID[$name]=$pid URL[$name]=$url KIND[$name]=$kind
}
stop_target() {
    local name=$1 pid=${PID[$1]:-} kind=${KIND[$1]:-}
    unset "PID[$name]" "URL[$name]" "KIND[$name]"
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
stop_all() { local n; for n in "${!PID[@]}"; do stop_target "$n"; done; }
# Which targets serve a backing: tgt has no RAM store (null stands in), istgt serves only
# files.
serves() {
    local kind=$1 lun=$2
    want_target "$kind" || return 1
    case $kind:$lun in
        istgt:null|istgt:ram|istgt:direct) return 1 ;;
    esac
    return 0
}

# --- the client ----------------------------------------------------------------------------
# load NAMES LINE ARGS...: `ironsan load --json ARGS` against the targets NAMES (a space-
# separated list; one URL each, or with LINE > 0 on lines LINE, LINE+1, ... for the URLs in
# turn, from the initiator namespace; LINE 0 is loopback). Sets L_JSON (the result) and
# L_CPU (the targets' CPU seconds, summed).
L_JSON="" L_CPU=0
load() {
    local names=$1 line=$2 urls=() n i=0 c0=0 c1=0 pre=()
    shift 2
    for n in $names; do
        if ((line > 0)); then urls+=("$(on_line "${URL[$n]}" $((line + i)))"); else urls+=("${URL[$n]}"); fi
        c0=$((c0 + $(cpu_ticks "${PID[$n]}")))
        i=$((i + 1))
    done
    ((line > 0)) && pre=(ip netns exec "$NS")
    progress_point
    # Bounded: a client that never ends (a target that stops mid-run) fails its point.
    if ! L_JSON=$("${pre[@]}" timeout -k 10 900 taskset -c "$CLIENT_CPU" "$BIN" load "${urls[@]}" --json "$@" 2>"$WORK/load.err"); then
        note "load ${urls[*]} $* failed: $(tail -n 3 "$WORK/load.err")"
        L_JSON='{"iops":0,"mib_per_s":0,"lat_mean_us":0,"lat_stddev_us":0,"ios":0,"client_cpu_s":0,"per_session":[]}'
        FAILED=$((FAILED + 1))
    fi
    for n in $names; do c1=$((c1 + $(cpu_ticks "${PID[$n]}"))); done
    L_CPU=$(awk -v t=$((c1 - c0)) -v hz="$CLK_TCK" 'BEGIN { printf "%.3f", t / hz }')
}
FAILED=0
# j FIELD: a field of L_JSON.
j() { python3 -c 'import json, sys; v = json.loads(sys.argv[1]); print(v.get(sys.argv[2], 0))' "$L_JSON" "$1"; }
# fmt FORMAT NUMBER...
fmt() { local f=$1; shift; awk -v f="$f" 'BEGIN { for (i = 1; i < ARGC; i++) printf f, ARGV[i]; }' "$@"; }
tsv() { [[ -z $TSV ]] || printf '%s\n' "$(IFS=$'\t'; echo "$*")" >>"$TSV"; }
# The three figures of one point: MB/s (10^6 bytes), mean response time (us), and the
# target's CPU per I/O (us).
point() {
    local mbs lat cpu_io ios
    ios=$(j ios)
    mbs=$(awk -v m="$(j mib_per_s)" 'BEGIN { printf "%.1f", m * 1.048576 }')
    lat=$(awk -v l="$(j lat_mean_us)" 'BEGIN { printf "%.0f", l }')
    cpu_io=$(awk -v c="$L_CPU" -v n="$ios" 'BEGIN { printf "%.1f", (n > 0 ? c * 1e6 / n : 0) }')
    echo "$mbs $lat $cpu_io"
}

prepare_files() {
    if [[ ! -f $SHM/lun.img ]]; then
        fallocate -l 256M "$SHM/lun.img"
        dd if=/dev/urandom of="$SHM/lun.img" bs=1M count=256 conv=notrunc status=none
    fi
}
prepare_disk() {
    [[ -f $DISK/lun.img ]] && return
    fallocate -l 1G "$DISK/lun.img"
    dd if=/dev/urandom of="$DISK/lun.img" bs=1M count=1024 conv=notrunc,fsync status=none
}

header() {
    say ""
    say "== $1 =="
}

# --- 1. IOmeter matrix ---------------------------------------------------------------------
exp_iometer() {
    header "iometer: pattern x QD x size, 256 MiB tmpfs file, loopback (MB/s / mean response us / target CPU us per I/O)"
    prepare_files
    local names=() t
    for t in ironsan tgt istgt; do serves "$t" shm && { start_target "$t" "$t" shm; names+=("$t"); }; done
    local qds="1 4 16" sizes="512 4096 32768 131072"
    if ((FULL)); then qds="1 2 4 8 16" sizes="512 1024 2048 4096 8192 16384 32768 65536 131072"; fi
    # --quick: every pattern once, at one end of the grid's diagonal or the other in turn
    # (QD1 x 128 KiB, QD16 x 4 KiB).
    local points="" quick_points=("1:131072" "16:4096") k=0
    local line
    line=$(printf '%-9s %3s %7s' pattern qd bytes)
    for t in "${names[@]}"; do line+=$(printf ' | %-22s' "$t"); done
    [[ ${#names[@]} -gt 1 ]] && line+=" | ironsan/others MB/s"
    say "$line"
    local p rw mix q bs pt
    for p in read randread write randwrite rw randrw; do
        rw=$p mix=()
        [[ $p == rw || $p == randrw ]] && mix=(--rwmixread 70)
        if ((QUICK)); then
            points=${quick_points[k % 2]}
            k=$((k + 1))
        elif [[ -z $points ]]; then
            for q in $qds; do for bs in $sizes; do points+=" $q:$bs"; done; done
        fi
        for pt in $points; do
            q=${pt%%:*} bs=${pt#*:}
            {
                line=$(printf '%-9s %3s %7s' "$p${mix:+ 70/30}" "$q" "$bs")
                local first="" ratios=""
                for t in "${names[@]}"; do
                    load "$t" 0 --rw "$rw" "${mix[@]}" --bs "$bs" --qd "$q" -t "$SECS"
                    read -r mbs lat cpu <<<"$(point)"
                    line+=$(printf ' | %7s %6s %7s' "$mbs" "$lat" "$cpu")
                    tsv iometer "$t" "$p" "$q" "$bs" "$mbs" "$lat" "$cpu"
                    if [[ -z $first ]]; then first=$mbs
                    else ratios+=" $(awk -v a="$first" -v b="$mbs" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')"; fi
                done
                say "$line${ratios:+ |$ratios}"
            }
        done
    done
    stop_all
}

# --- 2. RAM disk, one outstanding request --------------------------------------------------
exp_ramdisk() {
    header "ramdisk: QD1, loopback (MB/s / mean response us / initiator CPU us per I/O)"
    prepare_files
    local names=() t
    want_target ironsan && { start_target ironsan-ram ironsan ram; names+=(ironsan-ram); }
    for t in ironsan tgt istgt; do serves "$t" shm && { start_target "$t" "$t" shm; names+=("$t"); }; done
    local line
    line=$(printf '%-6s %7s' rw bytes)
    for t in "${names[@]}"; do line+=$(printf ' | %-22s' "$t"); done
    say "$line"
    local rw bs sizes="512 1024 2048 4096 8192 16384 32768 65536 131072"
    ((QUICK)) && sizes="512 131072"
    for rw in read write; do
        for bs in $sizes; do
            line=$(printf '%-6s %7s' "$rw" "$bs")
            for t in "${names[@]}"; do
                load "$t" 0 --rw "$rw" --bs "$bs" --qd 1 -t "$SECS"
                read -r mbs lat _ <<<"$(point)"
                local icpu
                icpu=$(awk -v c="$(j client_cpu_s)" -v n="$(j ios)" 'BEGIN { printf "%.1f", (n > 0 ? c * 1e6 / n : 0) }')
                line+=$(printf ' | %7s %6s %7s' "$mbs" "$lat" "$icpu")
                tsv ramdisk "$t" "$rw" 1 "$bs" "$mbs" "$lat" "$icpu"
            done
            say "$line"
        done
    done
    stop_all
}

# dd_row LABEL NAMES... : the dd pair (write, then read) of each target over line 1.
dd_pair() {
    local label=$1 t w r
    shift
    for t in "$@"; do
        load "$t" 1 --rw write --bs 524288 --qd 1 --count "$DD_COUNT" -t 600
        read -r w _ _ <<<"$(point)"
        local wcpu=$L_CPU
        load "$t" 1 --rw read --bs 524288 --qd 1 --count "$DD_COUNT" -t 600
        read -r r _ _ <<<"$(point)"
        say "$(printf '%-8s %-8s %10s %10s %14s' "$label" "$t" "$w" "$r" "$(awk -v a="$wcpu" -v b="$L_CPU" 'BEGIN { printf "%.2f / %.2f", a, b }')")"
        tsv dd "$t" "$label" "$w" "$r"
    done
}

# --- 3. dd over one Gigabit line -----------------------------------------------------------
exp_dd() {
    header "dd: bs=512K count=$DD_COUNT, QD1, one $RATE line (MB/s; target CPU s for write / read)"
    prepare_disk
    lines_up 1
    say "$(printf '%-8s %-8s %10s %10s %14s' backend target write read 'CPU s w / r')"
    local t names
    for lun in null disk direct; do
        names=()
        for t in ironsan tgt istgt; do serves "$t" "$lun" && { start_target "$t" "$t" "$lun"; names+=("$t"); }; done
        local label=$lun
        case $lun in null) label=NULLIO ;; disk) label=FILEIO ;; direct) label=BLOCKIO ;; esac
        dd_pair "$label" "${names[@]}"
        stop_all
    done
    lines_down
}

# --- 4. MPIO: the dd over two lines --------------------------------------------------------
exp_mpio() {
    header "mpio: dd bs=512K over one and over two $RATE lines (one session per line), tmpfs file (MB/s)"
    prepare_files
    lines_up 2
    say "$(printf '%-8s %-6s %10s %10s %10s' target rw 'one line' 'two lines' ratio)"
    local t rw one two
    for t in ironsan tgt istgt; do
        serves "$t" shm || continue
        start_target "$t" "$t" shm
        for rw in write read; do
            load "$t" 1 --rw "$rw" --bs 524288 --qd 1 --count "$DD_COUNT" -t 600
            read -r one _ _ <<<"$(point)"
            # Two sessions, one per line (URL i on line i), each half the data.
            load "$t $t" 1 --sessions 2 --rw "$rw" --bs 524288 --qd 1 --count $((DD_COUNT / 2)) -t 600
            read -r two _ _ <<<"$(point)"
            say "$(printf '%-8s %-6s %10s %10s %10s' "$t" "$rw" "$one" "$two" "$(awk -v a="$one" -v b="$two" 'BEGIN { printf "%.2fx", (a > 0 ? b / a : 0) }')")"
            tsv mpio "$t" "$rw" "$one" "$two"
        done
        stop_target "$t"
    done
    lines_down
}

# --- 5. sessions sharing one line ----------------------------------------------------------
# cwnd_trace SIDE SECS OUTFILE: sample the congestion window of every iSCSI connection of
# the sending side (target: this namespace, sport 10.77.1.1; initiator: $NS) every 0.5 s.
cwnd_trace() {
    local side=$1 secs=$2 out=$3 pre=() filter
    if [[ $side == initiator ]]; then pre=(ip netns exec "$NS"); filter="dst 10.77.1.1"
    else filter="src 10.77.1.1"; fi
    local end=$((SECONDS + ${secs%.*} + 1))
    : >"$out"
    while ((SECONDS < end)); do
        # shellcheck disable=SC2086
        "${pre[@]}" ss -Htin $filter 2>/dev/null | paste - - >>"$out" || true
        echo "--" >>"$out"
        sleep 0.5
    done
}
# share_report KEY: per unit (KEY per_connection or per_session of L_JSON) MB/s and
# turnaround, Jain's index, and the congestion windows traced in $WORK/cwnd.
share_report() {
    python3 - "$L_JSON" "$WORK/cwnd" "$1" <<'EOF' | tee -a "$OUT"
import json, re, sys
r = json.loads(sys.argv[1])
key = sys.argv[3]
unit = "connection" if key == "per_connection" else "session"
rates = []
for i, s in enumerate(r.get(key, [])):
    mbs = s["mib_per_s"] * 1.048576
    rates.append(mbs)
    print(f"  {unit} {i}: {mbs:7.1f} MB/s, turnaround mean {s['lat_mean_us']:8.0f} us, sd {s['lat_stddev_us']:7.0f} us")
def jain(v):
    return sum(v) ** 2 / (len(v) * sum(x * x for x in v)) if v and sum(v) > 0 else 0
if rates and sum(r * r for r in rates) > 0:
    print(f"  Jain's fairness index {jain(rates):.3f} (1 = equal shares); min/max {min(rates) / max(rates):.2f}")
    turn = [s["lat_mean_us"] for s in r.get(key, [])]
    print(f"  Jain's index of the mean turnaround {jain(turn):.3f}; min/max {min(turn) / max(turn):.2f}")
# ss lines: local and peer address, then the info line; one block per sample.
# rwnd_limited / sndbuf_limited: the share of the sender's busy time spent waiting for the
# receiver's window or for its own send buffer (tcp_info, cumulative: the last sample counts).
traces, retrans, limits = {}, {}, {}
for line in open(sys.argv[2]):
    f = line.split()
    if len(f) < 5:
        continue
    conn = f[3] + ">" + f[4]
    m = re.search(r"\bcwnd:(\d+)", line)
    traces.setdefault(conn, []).append(m.group(1) if m else "-")
    m = re.search(r"\bretrans:\d+/(\d+)", line)
    retrans[conn] = int(m.group(1)) if m else 0
    lim = []
    for k, name in (("rwnd_limited", "rwnd"), ("sndbuf_limited", "sndbuf")):
        m = re.search(r"\b" + k + r":\d+ms\(([\d.]+)%\)", line)
        if m:
            lim.append(f"{name}-limited {float(m.group(1)):.0f} %")
    limits[conn] = ", ".join(lim) if lim else "not window- or buffer-limited"
for conn, t in sorted(traces.items()):
    print(f"  cwnd {conn}: {' '.join(t[:24])}{' ...' if len(t) > 24 else ''}; retransmitted {retrans.get(conn, 0)}; {limits.get(conn, '')}")
EOF
}
# share_tsv TARGET MODE RW KEY: each unit's MB/s and turnaround, and the congestion windows
# traced in $WORK/cwnd (one block per 0.5 s sample), as TSV rows `share` and `cwnd`.
share_tsv() {
    [[ -n $TSV ]] || return 0
    python3 - "$L_JSON" "$WORK/cwnd" "$@" >>"$TSV" <<'EOF'
import json, re, sys
r, path, t, mode, rw, key = json.loads(sys.argv[1]), sys.argv[2], *sys.argv[3:7]
for i, s in enumerate(r.get(key, [])):
    print("\t".join(map(str, ("share", t, mode, rw, i, s["mib_per_s"], s["lat_mean_us"], s["lat_stddev_us"]))))
k = 0
for line in open(path):
    if line.startswith("--"):
        k += 1
        continue
    f = line.split()
    m = re.search(r"\bcwnd:(\d+)", line)
    a = re.search(r"\bbytes_acked:(\d+)", line)
    if len(f) >= 5 and m:
        print("\t".join(map(str, ("cwnd", t, mode, rw, f[3] + ">" + f[4], k * 0.5, m.group(1), a.group(1) if a else ""))))
EOF
}
# jain KEY: Jain's index over L_JSON's KEY list (MB/s), for the TSV.
jain() {
    python3 -c 'import json, sys
r = [x["mib_per_s"] for x in json.loads(sys.argv[1]).get(sys.argv[2], [])]
print(f"{sum(r) ** 2 / (len(r) * sum(x * x for x in r)):.3f}" if r and sum(r) > 0 else "0")' "$L_JSON" "$1"
}
exp_sessions() {
    header "sessions: one session of 4 connections, and 4 sessions, over one $RATE line; sequential 512 KiB, one in flight per connection, ${SESSION_SECS} s each way"
    prepare_files
    lines_up 1
    local t rw mode
    for t in ironsan tgt istgt; do
        serves "$t" shm || continue
        local modes="sessions"
        case $t in
            ironsan) modes="mcs-rr mcs-rr-fair mcs-lqd mcs-lqd-fair sessions" ;;
            istgt) modes="mcs-rr mcs-lqd sessions" ;;
        esac
        # The smoke runs each spreading and each fairness setting once.
        if ((QUICK)); then
            case $t in
                ironsan) modes="mcs-rr mcs-lqd-fair sessions" ;;
                istgt) modes="mcs-lqd sessions" ;;
            esac
        fi
        for mode in $modes; do
            IRONSAN_ARGS=()
            if [[ $t == ironsan ]]; then
                IRONSAN_ARGS=(--connection-fairness off)
                [[ $mode == *-fair ]] && IRONSAN_ARGS=(--connection-fairness on)
            fi
            local spread=rr
            [[ $mode == mcs-lqd* ]] && spread=lqd
            start_target "$t" "$t" shm
            IRONSAN_ARGS=()
            for rw in write read; do
                local side=initiator key=per_connection
                [[ $rw == read ]] && side=target
                cwnd_trace "$side" "$SESSION_SECS" "$WORK/cwnd" &
                local tracer=$!
                if [[ $mode == sessions ]]; then
                    key=per_session
                    load "$t" 1 --sessions 4 --rw "$rw" --bs 524288 --qd 1 -t "$SESSION_SECS"
                else
                    load "$t" 1 --connections 4 --spread "$spread" --rw "$rw" --bs 524288 --qd 4 -t "$SESSION_SECS"
                fi
                wait "$tracer" 2>/dev/null || true
                say "$t $mode $rw: total $(awk -v m="$(j mib_per_s)" 'BEGIN { printf "%.1f", m * 1.048576 }') MB/s; turnaround mean $(j lat_mean_us | cut -d. -f1) us, sd $(j lat_stddev_us | cut -d. -f1) us"
                share_report "$key"
                share_tsv "$t" "$mode" "$rw" "$key"
                tsv sessions "$t" "$mode" "$rw" "$(j mib_per_s)" "$(j lat_mean_us)" "$(j lat_stddev_us)" "$(jain "$key")"
            done
            stop_target "$t"
        done
    done
    lines_down
}

# --- 5b. one session over several lines (MC/S), and connections on loopback ----------------
exp_mcs() {
    header "mcs: one session over 1, 2 and 4 $RATE lines, one connection per line; sequential 512 KiB, 2 in flight per connection, ${SESSION_SECS} s each way (MB/s)"
    prepare_files
    lines_up 4
    say "$(printf '%-8s %-6s %10s %10s %10s %8s %8s' target rw '1 line' '2 lines' '4 lines' '2/1' '4/1')"
    local t rw n m
    for t in ironsan istgt; do
        serves "$t" shm || continue
        start_target "$t" "$t" shm
        for rw in write read; do
            local mbs=()
            for n in 1 2 4; do
                local tnames="" k
                for ((k = 0; k < n; k++)); do tnames+=" $t"; done
                load "$tnames" 1 --connections "$n" --rw "$rw" --bs 524288 --qd $((2 * n)) -t "$SESSION_SECS"
                read -r m _ _ <<<"$(point)"
                mbs+=("$m")
            done
            say "$(printf '%-8s %-6s %10s %10s %10s %8s %8s' "$t" "$rw" "${mbs[0]}" "${mbs[1]}" "${mbs[2]}" \
                "$(awk -v a="${mbs[0]}" -v b="${mbs[1]}" 'BEGIN { printf "%.2fx", (a > 0 ? b / a : 0) }')" \
                "$(awk -v a="${mbs[0]}" -v b="${mbs[2]}" 'BEGIN { printf "%.2fx", (a > 0 ? b / a : 0) }')")"
            tsv mcs-lines "$t" "$rw" "${mbs[@]}"
        done
        stop_target "$t"
    done
    lines_down
    header "mcs: connections per session on loopback (IOPS / target CPU us per I/O), ${SESSION_SECS} s each"
    say "$(printf '%-8s %-20s %16s %16s %16s' target workload '1 conn' '2 conns' '4 conns')"
    local wl bs qd lun cpu
    for t in ironsan istgt; do
        lun=ram
        [[ $t == istgt ]] && lun=shm
        serves "$t" "$lun" || continue
        start_target "$t" "$t" "$lun"
        [[ $t == ironsan ]] && load "$t" 0 --rw write --bs 524288 --qd 8 --count 2048 -t 600
        for wl in "randread 4096 32" "read 524288 8"; do
            read -r rw bs qd <<<"$wl"
            local cells=()
            for n in 1 2 4; do
                load "$t" 0 --connections "$n" --rw "$rw" --bs "$bs" --qd "$qd" -t "$SESSION_SECS"
                read -r _ _ cpu <<<"$(point)"
                cells+=("$(printf '%.0f / %s' "$(j iops)" "$cpu")")
                tsv mcs-loop "$t" "$rw" "$bs" "$qd" "$n" "$(j iops)" "$cpu"
            done
            say "$(printf '%-8s %-20s %16s %16s %16s' "$t" "$rw $bs QD$qd" "${cells[@]}")"
        done
        stop_target "$t"
    done
}

# --- 6. target-side cache ------------------------------------------------------------------
exp_cache() {
    header "cache: 4 KiB random 70/30 read/write QD8, 256 MiB of a file on a disk file system, loopback (IOPS; mean response us)"
    prepare_disk
    say "$(printf '%-8s %18s %18s %8s' target 'FILEIO (cache)' 'BLOCKIO (direct)' ratio)"
    local t f b fl bl
    for t in ironsan tgt; do
        want_target "$t" || continue
        start_target "$t-file" "$t" disk
        # Warm the page cache over the 256 MiB the mix touches (the first quarter of the file).
        load "$t-file" 0 --rw read --bs 1048576 --qd 4 --count 256 -t 600
        load "$t-file" 0 --rw randrw --rwmixread 70 --bs 4096 --qd 8 -t "$((QUICK ? 1 : 10))" --count 100000000
        f=$(j iops | cut -d. -f1) fl=$(j lat_mean_us | cut -d. -f1)
        stop_target "$t-file"
        start_target "$t-direct" "$t" direct
        load "$t-direct" 0 --rw randrw --rwmixread 70 --bs 4096 --qd 8 -t "$((QUICK ? 1 : 10))" --count 100000000
        b=$(j iops | cut -d. -f1) bl=$(j lat_mean_us | cut -d. -f1)
        stop_target "$t-direct"
        say "$(printf '%-8s %10s %6s us %10s %6s us %7s' "$t" "$f" "$fl" "$b" "$bl" "$(awk -v a="$f" -v b="$b" 'BEGIN { printf "%.1fx", (b > 0 ? a / b : 0) }')")"
        tsv cache "$t" "$f" "$b"
    done
}

# --- 7. scale-out --------------------------------------------------------------------------
exp_scaleout() {
    header "scaleout: sequential 512 KiB QD4, one target over one $RATE line, three targets striped over three lines, local disk (MB/s)"
    prepare_files
    local i
    for i in 2 3; do [[ -f $SHM/lun$i.img ]] || cp "$SHM/lun.img" "$SHM/lun$i.img"; done
    lines_up 3
    say "$(printf '%-8s %-6s %10s %12s %8s' target rw 'one' 'three' ratio)"
    local t rw one three
    for t in ironsan tgt istgt; do
        want_target "$t" || continue
        start_target "$t-1" "$t" shm
        start_target "$t-2" "$t" shm2
        start_target "$t-3" "$t" shm3
        for rw in write read; do
            load "$t-1" 1 --rw "$rw" --bs 524288 --qd 4 -t "$((QUICK ? 1 : 5))"
            read -r one _ _ <<<"$(point)"
            load "$t-1 $t-2 $t-3" 1 --sessions 3 --rw "$rw" --bs 524288 --qd 4 -t "$((QUICK ? 1 : 5))"
            read -r three _ _ <<<"$(point)"
            say "$(printf '%-8s %-6s %10s %12s %8s' "$t" "$rw" "$one" "$three" "$(awk -v a="$one" -v b="$three" 'BEGIN { printf "%.2fx", (a > 0 ? b / a : 0) }')")"
            tsv scaleout "$t" "$rw" "$one" "$three"
        done
        stop_target "$t-1"; stop_target "$t-2"; stop_target "$t-3"
    done
    lines_down
    # The local disk: the same sequential 512 KiB transfers with O_DIRECT, no network.
    local n=$((QUICK ? 64 : 2048)) w r
    w=$(dd if=/dev/zero of="$DISK/local.img" bs=512K count="$n" oflag=direct conv=fsync 2>&1 | awk '/copied/ { print $(NF-1), $NF }')
    r=$(dd if="$DISK/local.img" of=/dev/null bs=512K iflag=direct 2>&1 | awk '/copied/ { print $(NF-1), $NF }')
    rm -f "$DISK/local.img"
    say "local disk (dd O_DIRECT, $((n / 2)) MiB, ${DISK_DIR:-/var/tmp}): write $w, read $r"
}

# --- 8. where the time goes ----------------------------------------------------------------
exp_breakdown() {
    header "breakdown: target CPU us per I/O (all targets) and ironsan's time per stage (mean us), loopback, ${SESSION_SECS} s per workload"
    prepare_files
    local wl rw bs qd t
    for wl in "randread 4096 32" "randwrite 4096 32" "read 524288 8" "write 524288 8"; do
        read -r rw bs qd <<<"$wl"
        local line
        line=$(printf '%-9s %6s QD%-2s CPU us/IO:' "$rw" "$bs" "$qd")
        for t in ironsan tgt istgt; do
            local lun=ram
            [[ $t == istgt ]] && lun=shm
            serves "$t" "$lun" || continue
            start_target "$t" "$t" "$lun"
            if [[ $t == ironsan ]]; then
                # Written data, not holes (which go out as the zero page), and no first-touch
                # page faults in the timed writes: one pass over the whole RAM LUN first.
                load "$t" 0 --rw write --bs 524288 --qd 8 --count 2048 -t 600
                "$BIN" ctl --control "$WORK/ironsan/control.sock" --json stats >"$WORK/stats0.json" || true
            fi
            load "$t" 0 --rw "$rw" --bs "$bs" --qd "$qd" -t "$SESSION_SECS"
            read -r _ _ cpu <<<"$(point)"
            line+=$(printf ' %s %s (%s IOPS)' "$t" "$cpu" "$(j iops | cut -d. -f1)")
            tsv breakdown "$t" "$rw" "$bs" "$qd" "$cpu" "$(j iops)"
            if [[ $t == ironsan ]]; then
                "$BIN" ctl --control "$WORK/ironsan/control.sock" --json stats >"$WORK/stats.json" || true
            fi
            stop_target "$t"
        done
        say "$line"
        [[ -s $WORK/stats.json ]] && python3 - "$WORK/stats0.json" "$WORK/stats.json" "${TSV:-/dev/null}" "$rw" "$bs" "$qd" <<'EOF' | tee -a "$OUT"
import json, sys
def walk(v):
    if isinstance(v, dict):
        if "stages" in v and isinstance(v["stages"], (dict, list)):
            yield v
        for x in v.values():
            yield from walk(x)
    elif isinstance(v, list):
        for x in v:
            yield from walk(x)
try:
    after = json.load(open(sys.argv[2]))
except Exception as e:
    print(f"  (no stage figures: {e})")
    sys.exit()
try:
    before = {l.get("class"): l for l in walk(json.load(open(sys.argv[1])))}
except Exception:
    before = {}
# The timed run only: the counters before it (the fill pass) subtracted.
for lun in walk(after):
    b = before.get(lun.get("class"), {})
    n = lun.get("commands", 0) - b.get("commands", 0)
    if n < 100:  # the run's own READ CAPACITY, not a workload
        continue
    st, bst = lun["stages"], b.get("stages", {})
    order = ["receive", "queue", "backend", "respond", "send", "total"]
    parts = [
        f"{name} {(st[name]['sum_us'] - bst.get(name, {}).get('sum_us', 0)) / n:.1f}"
        for name in order
        if name in st
    ]
    print(f"  ironsan {lun.get('class', '?')}: {n} commands, mean us per stage: " + ", ".join(parts))
    with open(sys.argv[3], "a") as tsv:
        for name in order[:-1]:
            if name in st:
                mean = (st[name]["sum_us"] - bst.get(name, {}).get("sum_us", 0)) / n
                tsv.write("\t".join(map(str, ("stages", "ironsan", *sys.argv[4:7], name, f"{mean:.2f}"))) + "\n")
EOF
        rm -f "$WORK/stats.json" "$WORK/stats0.json"
    done
}

say "ironsan classic experiments, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown)"
say "host: $(nproc) CPUs ($(awk -F': ' '/model name/ { print $2; exit }' /proc/cpuinfo)), $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo), kernel $(uname -r), TCP $(cat /proc/sys/net/ipv4/tcp_congestion_control); targets on CPU $TARGET_CPU, ironsan load on CPU $CLIENT_CPU; experiments:$EXPERIMENTS; targets: $TARGETS$( ((QUICK)) && echo ' (--quick: figures not judged)')"
if [[ -n $REPORT ]]; then
    mkdir -p "$REPORT"
    REPORT=$(cd "$REPORT" && pwd)
    if [[ -z $TSV ]]; then TSV=$REPORT/classic.tsv; : >"$TSV"; fi
    report_meta "$REPORT/meta-classic.txt" bench/classic.sh "${ARGS[@]}"
fi
n_exp=$(wc -w <<<"$EXPERIMENTS") i_exp=0
for e in $EXPERIMENTS; do
    i_exp=$((i_exp + 1))
    progress_begin "$i_exp" "$n_exp" "$e"
    "exp_$e"
done
progress_end
if [[ -n $REPORT ]]; then
    [[ $TSV == "$REPORT/classic.tsv" ]] || cp "$TSV" "$REPORT/classic.tsv"
    "$ROOT/bench/report.py" "$REPORT" >&2 || die "bench/report.py $REPORT failed"
fi

if ((SAVE && !QUICK)); then
    mkdir -p "$ROOT/bench/results"
    dest=$ROOT/bench/results/$(date -u +%F)-classic.txt
    { cat "$OUT"; echo; } >>"$dest"
    note "appended to $dest"
fi
((FAILED == 0)) || die "$FAILED client runs failed (their rows read 0)"
