# shellcheck shell=bash
# Shared by the guest tests (scripts/kernel-initiator.sh, scripts/kernel-multipath.sh);
# sourced after they define ROOT, log, die and the array `missing`.

# pick_kernel: IRONSAN_KERNEL_VERSION, else the newest kernel under /lib/modules that has a
# /boot/vmlinuz and the iscsi_tcp module.
pick_kernel() {
    local k
    if [[ -n ${IRONSAN_KERNEL_VERSION:-} ]]; then
        echo "$IRONSAN_KERNEL_VERSION"
        return 0
    fi
    local -a kvers=()
    [[ -d /lib/modules ]] && mapfile -t kvers < <(find /lib/modules -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -rV)
    for k in "${kvers[@]}"; do
        if [[ -r /boot/vmlinuz-$k && -f /lib/modules/$k/modules.dep ]] &&
            grep -q '/iscsi_tcp\.ko' "/lib/modules/$k/modules.dep"; then
            echo "$k"
            return 0
        fi
    done
    return 1
}

# guest_prerequisites: sets KVER (or notes linux-image-amd64 missing), then skips (exit 0)
# or, with IRONSAN_REQUIRE_TOOLS=1, fails if any package is missing; then sets BIN, building
# it if needed.
guest_prerequisites() {
    KVER=$(pick_kernel || true)
    [[ -n $KVER && -r /boot/vmlinuz-$KVER ]] || missing+=(linux-image-amd64)
    if [[ ${#missing[@]} -gt 0 ]]; then
        local msg="missing packages: ${missing[*]} (scripts/install-deps.sh installs them: apt-get install --no-install-recommends ${missing[*]})"
        [[ ${IRONSAN_REQUIRE_TOOLS:-0} == 1 ]] && die "$msg"
        log "SKIP: $msg"
        exit 0
    fi
    # cargo may not be on PATH in a non-login shell.
    if ! command -v cargo >/dev/null 2>&1 && [[ -f ${HOME:-/root}/.cargo/env ]]; then
        # shellcheck source=/dev/null
        . "${HOME:-/root}/.cargo/env"
    fi
    BIN=${IRONSAN_BIN:-$ROOT/target/release/ironsan}
    if [[ ! -x $BIN ]]; then
        log "building $BIN"
        (cd "$ROOT" && cargo build --release -p ironsan)
    fi
    [[ -x $BIN ]] || die "ironsan binary $BIN not found"
}
