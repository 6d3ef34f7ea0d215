# shellcheck shell=bash
# Shared by the bench scripts (sourced, not run). `die` is the sourcing script's.

# kill -0 also succeeds on a zombie; a daemon started by an earlier invocation
# is reparented and may never be reaped, so treat state Z as dead.
pid_alive() {
    [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null || return 1
    local state
    state=$(awk '{sub(/^.*\) /, ""); print $1}' "/proc/$1/stat" 2>/dev/null || true)
    [[ -n $state && $state != Z ]]
}

# free_port [ADDR]: a TCP port nothing listens on at ADDR (default 127.0.0.1) right now.
free_port() {
    python3 -c 'import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1]); s.close()' "${1:-127.0.0.1}"
}

# listening PORT: something listens on TCP port PORT.
listening() { ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }

# cpu_ticks PID: utime + stime (clock ticks) of the whole thread group; fields counted after
# the ")" that ends the command name.
cpu_ticks() {
    local stat
    stat=$(<"/proc/$1/stat") || die "process $1 is gone"
    stat=${stat##*) }
    # shellcheck disable=SC2086
    set -- $stat
    echo $((${12} + ${13}))
}

# The host's TCP congestion control: set_tcp_cc NAME changes it (remembering what it was,
# in CC_BEFORE), restore_tcp_cc puts that back (call it from the EXIT trap).
CC_SYSCTL=/proc/sys/net/ipv4/tcp_congestion_control
CC_BEFORE=$(cat "$CC_SYSCTL")
set_tcp_cc() {
    echo "$1" >"$CC_SYSCTL" 2>/dev/null || die "cannot set congestion control '$1' (available: $(cat /proc/sys/net/ipv4/tcp_available_congestion_control))"
}
restore_tcp_cc() {
    [[ $(cat "$CC_SYSCTL") == "$CC_BEFORE" ]] || echo "$CC_BEFORE" >"$CC_SYSCTL" || true
}

# Progress on a terminal, never in CI or when stderr is not a terminal: which experiment (or
# setup) of how many, which point, the time elapsed and an estimate of what is left from the
# experiments done so far. progress_begin INDEX TOTAL NAME; progress_point; progress_end.
PROGRESS_T0=$SECONDS PROGRESS_DONE=0 PROGRESS_TOTAL=0 PROGRESS_NAME="" PROGRESS_POINT=0
progress_on() { [[ -t 2 && -z ${CI:-} ]]; }
progress_mmss() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
progress_show() {
    progress_on || return 0
    local el=$((SECONDS - PROGRESS_T0)) left="estimate after the first"
    if ((PROGRESS_DONE > 0)); then
        left="about $(progress_mmss $((el * (PROGRESS_TOTAL - PROGRESS_DONE) / PROGRESS_DONE))) left"
    fi
    printf '\r\033[K[%d/%d %s] point %d, %s elapsed, %s' "$((PROGRESS_DONE + 1))" "$PROGRESS_TOTAL" \
        "$PROGRESS_NAME" "$PROGRESS_POINT" "$(progress_mmss "$el")" "$left" >&2
}
progress_begin() { PROGRESS_DONE=$(($1 - 1)) PROGRESS_TOTAL=$2 PROGRESS_NAME=$3 PROGRESS_POINT=0; progress_show; }
progress_point() { PROGRESS_POINT=$((PROGRESS_POINT + 1)); progress_show; }
progress_end() { if progress_on; then printf '\r\033[K' >&2; fi; }

# report_meta FILE COMMAND...: what a report page says about a run (bench/report.py).
report_meta() {
    local f=$1
    shift
    {
        echo "command: $*"
        echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo "commit: $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown)"
        echo "host: $(uname -n), $(nproc) CPUs ($(awk -F': ' '/model name/ { print $2; exit }' /proc/cpuinfo)), $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo), kernel $(uname -r), TCP $(cat /proc/sys/net/ipv4/tcp_congestion_control)"
        echo "ironsan: $("${BIN:-ironsan}" --version 2>/dev/null | head -n 1 || echo '?')"
        echo "tgt: $(tgtd -V 2>/dev/null | head -n 1 || echo '?')"
        echo "istgt: $(dpkg-query -W -f='${Version}' istgt 2>/dev/null || echo '?')"
        echo "libiscsi-bin: $(dpkg-query -W -f='${Version}' libiscsi-bin 2>/dev/null || echo '?')"
        echo "ceph: $(dpkg-query -W -f='${Version}' librbd1 2>/dev/null || echo '?')"
    } >"$f"
}
