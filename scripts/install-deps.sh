#!/usr/bin/env bash
# Install the external tools ironsan's tests and benchmarks talk to:
#   libiscsi-bin      iscsi-test-cu / iscsi-perf / iscsi-ls / iscsi-inq (initiators)
#   qemu-utils +      qemu-img with the iscsi:// block driver (a second,
#   qemu-block-extra  independent initiator implementation)
#   tgt, istgt        peer targets to compare against
#   iproute2, procps, python3, shellcheck   used by the scripts themselves
#   ceph-mon, ceph-osd, ceph-common, librbd1   a throwaway Ceph cluster for RBD LUNs
#                                   (scripts/ceph-micro.sh) and the rbd tool
#   tgt-rbd, fio      the RBD benchmark's peers: tgt's RBD store and native librbd
#
# Idempotent: every package is checked with dpkg-query first, and apt-get
# update runs at most once, only when something is actually missing (it is
# the slow, network-bound part, and CI runs this on every submission).
set -euo pipefail

# Use sudo only when we are not already root (CI and dev machines are root;
# a laptop is not).
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive

log() { printf 'install-deps: %s\n' "$*"; }
die() { printf 'install-deps: ERROR: %s\n' "$*" >&2; exit 1; }

# True when the package is fully installed (not just "config-files" or
# "half-configured", which dpkg-query -W alone would also report).
is_installed() {
    local status
    status=$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)
    [[ $status == installed ]]
}

installed_version() {
    dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true
}

APT_UPDATED=0
apt_update_once() {
    if [[ $APT_UPDATED -eq 0 ]]; then
        log "apt-get update"
        "${SUDO[@]}" apt-get update -qq
        APT_UPDATED=1
    fi
}

apt_install() {
    apt_update_once
    log "apt-get install $*"
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ---------------------------------------------------------------------------
# Plain packages: any version will do.
# ---------------------------------------------------------------------------
# qemu-system-x86, linux-image-amd64, busybox-static, open-iscsi and e2fsprogs run the real
# kernel initiator in an emulated guest (scripts/kernel-initiator.sh); multipath-tools and
# sg3-utils go into that guest for the multipath test (scripts/kernel-multipath.sh).
# python3-matplotlib draws the benchmark report (bench/report.py); chromium loads it and the status
# page (tests/system/http.rs); prometheus brings promtool, which checks /metrics (tests/system/http.rs). dpkg-dev
# builds and checks the Debian package (scripts/package-test.sh). gcc links every Rust binary and
# compiles mimalloc, the allocator. librbd-dev and librados-dev bring the headers the RBD
# declarations are checked against (crates/backend/src/rbd/ffi/headers.rs); ironsan itself
# loads librbd1 at run time and links nothing of Ceph.
PLAIN=(gcc libiscsi-bin tgt istgt iproute2 procps python3 shellcheck
    qemu-system-x86 linux-image-amd64 busybox-static open-iscsi e2fsprogs
    ceph-mon ceph-osd ceph-common librbd1 librbd-dev librados-dev tgt-rbd fio multipath-tools sg3-utils
    python3-matplotlib chromium prometheus dpkg-dev curl)
missing=()
for pkg in "${PLAIN[@]}"; do
    is_installed "$pkg" || missing+=("$pkg")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    apt_install "${missing[@]}"
fi

# ---------------------------------------------------------------------------
# qemu-img with a working iscsi:// driver.
#
# The machine image ships a qemu-utils backport (10.x) for which Debian has no
# matching qemu-block-extra, so the iscsi driver module cannot be installed
# next to it. The fix is to install qemu-utils and qemu-block-extra at the
# *same* version, taken from whatever the archive offers for
# qemu-block-extra (bookworm's 7.2 today), downgrading qemu-utils if needed.
# The version is discovered here, never hard-coded, so security updates of
# 7.2 keep working.
# ---------------------------------------------------------------------------

# The driver is usable only if qemu-img lists it AND the block-iscsi module
# actually loads: with a missing or version-mismatched module qemu-img still
# lists "iscsi" but fails with "Unknown protocol" at open time. Port 1 on
# loopback has no listener, so a loaded driver must fail with a *connection*
# error.
qemu_iscsi_ok() {
    command -v qemu-img >/dev/null 2>&1 || return 1
    qemu-img --help 2>/dev/null | grep -i '^Supported formats:' | grep -qw iscsi || return 1
    local out
    out=$(timeout 20 qemu-img info 'iscsi://127.0.0.1:1/iqn.2000-01.invalid:probe/0' 2>&1 || true)
    if grep -qiE 'unknown protocol|unknown driver|Failed to initialize module|module.*not found' <<<"$out"; then
        return 1
    fi
    grep -qiE 'iSCSI: Failed to connect|connection refused|Failed to connect' <<<"$out"
}

qemu_versions_match() {
    is_installed qemu-utils && is_installed qemu-block-extra || return 1
    [[ $(installed_version qemu-utils) == "$(installed_version qemu-block-extra)" ]]
}

# Versions apt can install for a package, highest first (apt-cache madison
# already orders them by version; sort -u would break that order).
apt_versions() {
    apt-cache madison "$1" 2>/dev/null | awk -F'|' '{gsub(/[[:space:]]/, "", $2); print $2}' | awk '!seen[$0]++'
}

if qemu_versions_match && qemu_iscsi_ok; then
    :
else
    apt_update_once
    mapfile -t extra_versions < <(apt_versions qemu-block-extra)
    mapfile -t utils_versions < <(apt_versions qemu-utils)
    [[ ${#extra_versions[@]} -gt 0 ]] || die "apt knows no version of qemu-block-extra"
    chosen=""
    for v in "${extra_versions[@]}"; do
        for u in "${utils_versions[@]}"; do
            if [[ $u == "$v" ]]; then chosen=$v; break 2; fi
        done
    done
    [[ -n $chosen ]] || die "no qemu-utils version matches any qemu-block-extra version (${extra_versions[*]})"
    log "installing qemu-utils and qemu-block-extra at matching version $chosen"
    apt_install --allow-downgrades "qemu-utils=$chosen" "qemu-block-extra=$chosen"
    qemu_versions_match || die "qemu-utils ($(installed_version qemu-utils)) and qemu-block-extra ($(installed_version qemu-block-extra)) still differ"
    qemu_iscsi_ok || die "qemu-img's iscsi:// driver still does not load after installing $chosen"
fi

# ---------------------------------------------------------------------------
# Final check: every tool the tests call by name is on PATH. A package can
# be "installed" yet broken (e.g. a diverted binary), and the tests would then
# fail far less clearly.
# ---------------------------------------------------------------------------
for tool in iscsi-test-cu iscsi-perf iscsi-ls iscsi-inq iscsi-readcapacity16 \
            qemu-img tgtd tgtadm istgt ss taskset pgrep python3 shellcheck; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found on PATH after install"
done
log "ok (qemu-utils $(installed_version qemu-utils), libiscsi-bin $(installed_version libiscsi-bin), tgt $(installed_version tgt))"
