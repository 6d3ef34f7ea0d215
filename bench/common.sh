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
