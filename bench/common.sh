# shellcheck shell=bash
# Shared by the bench peer scripts (sourced, not run).

# kill -0 also succeeds on a zombie; a daemon started by an earlier invocation
# is reparented and may never be reaped, so treat state Z as dead.
pid_alive() {
    [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null || return 1
    local state
    state=$(awk '{sub(/^.*\) /, ""); print $1}' "/proc/$1/stat" 2>/dev/null || true)
    [[ -n $state && $state != Z ]]
}
