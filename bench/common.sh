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
