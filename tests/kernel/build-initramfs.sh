#!/usr/bin/env bash
# Build the guest's initramfs (an uncompressed newc cpio) for the kernel
# initiator test. Everything comes from the host's installed packages at
# test time; nothing built here is ever committed.
#
#   build-initramfs.sh KVER STAGING_DIR OUT.cpio ENV_FILE PAYLOAD_FILE
#
#   KVER          kernel version under /lib/modules (the guest runs /boot/vmlinuz-KVER)
#   STAGING_DIR   empty directory to assemble the root file system in
#   OUT.cpio      the archive to write
#   ENV_FILE      shell variables for the guest init (copied to /etc/ironsan-test.env)
#   PAYLOAD_FILE  the data file the guest writes to the iSCSI disk (copied to /payload.bin)
#
# Kernel modules: the ones named in MODULES below plus their dependencies,
# resolved with the kernel's modules.dep and written to /etc/modules.load in
# load order (dependencies first) for the guest's insmod loop.
#
# Environment (for other guest tests, e.g. scripts/kernel-multipath.sh):
#   IRONSAN_GUEST_INIT      the guest's /init (default: init beside this script)
#   IRONSAN_EXTRA_MODULES   more module names, space separated
#   IRONSAN_EXTRA_PROGRAMS  more dynamically linked programs (absolute paths)
#   IRONSAN_EXTRA_LIBS      more shared objects, e.g. plugins (absolute paths; their
#                           libraries come too)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { printf 'build-initramfs: ERROR: %s\n' "$*" >&2; exit 1; }

[[ $# -eq 5 ]] || die "usage: $0 KVER STAGING_DIR OUT.cpio ENV_FILE PAYLOAD_FILE"
KVER=$1 ROOT=$2 OUT=$3 ENV_FILE=$4 PAYLOAD=$5

MODDIR=/lib/modules/$KVER
[[ -f $MODDIR/modules.dep ]] || die "$MODDIR/modules.dep not found (is linux-image-amd64 installed?)"

# What the guest needs, by module name ('-' and '_' are the same):
#   iscsi_tcp (+ libiscsi_tcp, libiscsi, scsi_transport_iscsi, scsi_mod)  the initiator
#   sd_mod            SCSI disks (/dev/sdX)
#   crc32c_generic    CRC32C for iSCSI digests and ext4 metadata checksums
#   virtio_pci, virtio_net (+ virtio, virtio_ring, failover, net_failover)  the NIC
#   ext4 (+ jbd2, mbcache, crc16)
MODULES=(crc32c_generic virtio_pci virtio_net scsi_transport_iscsi libiscsi libiscsi_tcp iscsi_tcp sd_mod ext4)
read -r -a extra <<<"${IRONSAN_EXTRA_MODULES:-}"
MODULES+=("${extra[@]}")

# ---------------------------------------------------------------------------
# Module dependency closure from modules.dep, dependencies first.
# ---------------------------------------------------------------------------
declare -A DEPS=()   # relative path -> space-separated relative dep paths
declare -A BYNAME=() # normalized module name -> relative path
while IFS= read -r line; do
    path=${line%%:*}
    deps=${line#*:}
    DEPS[$path]=${deps# }
    name=$(basename "$path")
    name=${name%%.ko*}
    BYNAME[${name//-/_}]=$path
done <"$MODDIR/modules.dep"

declare -A SEEN=()
ORDER=()
visit() {
    local path=$1 d
    [[ -n ${SEEN[$path]:-} ]] && return 0
    SEEN[$path]=1
    local -a deps
    read -r -a deps <<<"${DEPS[$path]}"
    # modules.dep lists dependencies so that loading them last-to-first works;
    # visiting them in that order and recursing keeps it right either way.
    local i
    for ((i = ${#deps[@]} - 1; i >= 0; i--)); do
        d=${deps[$i]}
        visit "$d"
    done
    ORDER+=("$path")
}
for m in "${MODULES[@]}"; do
    key=${m//-/_}
    [[ -n ${BYNAME[$key]:-} ]] || die "module $m is not in $MODDIR/modules.dep (built in? then drop it from MODULES)"
    visit "${BYNAME[$key]}"
done

mkdir -p "$ROOT"/{bin,sbin,usr/bin,usr/sbin,lib/modules/ironsan,etc/iscsi,proc,sys,dev,tmp,mnt,run/lock/iscsi,var/lib/iscsi,var/lock,root}
: >"$ROOT/etc/modules.load"
for path in "${ORDER[@]}"; do
    src=$MODDIR/$path
    base=$(basename "$path")
    case $base in
        *.ko) cp "$src" "$ROOT/lib/modules/ironsan/$base" ;;
        *.ko.xz) xz -dc "$src" >"$ROOT/lib/modules/ironsan/${base%.xz}"; base=${base%.xz} ;;
        *.ko.zst) zstd -qdc "$src" >"$ROOT/lib/modules/ironsan/${base%.zst}"; base=${base%.zst} ;;
        *.ko.gz) gzip -dc "$src" >"$ROOT/lib/modules/ironsan/${base%.gz}"; base=${base%.gz} ;;
        *) die "unexpected module file $src" ;;
    esac
    echo "$base" >>"$ROOT/etc/modules.load"
done

# ---------------------------------------------------------------------------
# Programs. busybox (static) is the shell and the small tools; the real
# open-iscsi and e2fsprogs binaries keep their absolute paths and the guest
# calls them by those paths (Debian's static busybox prefers its own applets
# over $PATH, e.g. its own mke2fs).
# ---------------------------------------------------------------------------
BUSYBOX=$(command -v busybox) || die "busybox not found"
ldd_out=$(LC_ALL=C ldd "$BUSYBOX" 2>&1 || true)
[[ $ldd_out == *"not a dynamic executable"* ]] || die "$BUSYBOX is not statically linked (install busybox-static)"
cp "$BUSYBOX" "$ROOT/bin/busybox"

# Dynamically linked programs and every shared object ldd says they need.
PROGRAMS=(/usr/sbin/iscsistart /usr/sbin/iscsiadm /usr/sbin/iscsid /usr/sbin/mke2fs /usr/sbin/e2fsck)
read -r -a extra <<<"${IRONSAN_EXTRA_PROGRAMS:-}"
PROGRAMS+=("${extra[@]}")
copy_with_libs() {
    local prog=$1 lib
    [[ -e $prog ]] || die "$prog not found"
    mkdir -p "$ROOT$(dirname "$prog")"
    cp -L "$prog" "$ROOT$prog"
    while read -r lib; do
        [[ -n $lib ]] || continue
        if [[ ! -e $ROOT$lib ]]; then
            mkdir -p "$ROOT$(dirname "$lib")"
            cp -L "$lib" "$ROOT$lib"
        fi
    done < <(ldd "$prog" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
}
read -r -a extra <<<"${IRONSAN_EXTRA_LIBS:-}"
for p in "${PROGRAMS[@]}" "${extra[@]}"; do
    copy_with_libs "$p"
done
# Merged /usr: the dynamic loader and libraries are asked for under /lib and /lib64.
for d in lib lib64; do
    if [[ -d $ROOT/usr/$d ]]; then
        cp -a "$ROOT/usr/$d/." "$ROOT/$d/"
    fi
done
ln -sf mke2fs "$ROOT/usr/sbin/mkfs.ext4"
[[ -f /etc/mke2fs.conf ]] && cp /etc/mke2fs.conf "$ROOT/etc/mke2fs.conf"

# ---------------------------------------------------------------------------
# Configuration, init, data.
# ---------------------------------------------------------------------------
cp "$ENV_FILE" "$ROOT/etc/ironsan-test.env"
# shellcheck source=/dev/null
. "$ENV_FILE"
printf 'InitiatorName=%s\n' "$INITIATOR_IQN" >"$ROOT/etc/iscsi/initiatorname.iscsi"
cat >"$ROOT/etc/iscsi/iscsid.conf" <<'EOF'
node.startup = manual
node.session.timeo.replacement_timeout = 30
node.conn[0].timeo.login_timeout = 15
node.conn[0].timeo.logout_timeout = 15
node.conn[0].timeo.noop_out_interval = 5
node.conn[0].timeo.noop_out_timeout = 10
node.session.initial_login_retry_max = 4
node.session.cmds_max = 128
node.session.queue_depth = 32
node.session.iscsi.InitialR2T = No
node.session.iscsi.ImmediateData = Yes
node.session.iscsi.FirstBurstLength = 262144
node.session.iscsi.MaxBurstLength = 16776192
node.conn[0].iscsi.MaxRecvDataSegmentLength = 262144
discovery.sendtargets.iscsi.MaxRecvDataSegmentLength = 32768
node.session.scan = auto
EOF
echo 'root:x:0:0:root:/root:/bin/sh' >"$ROOT/etc/passwd"
echo 'root:x:0:' >"$ROOT/etc/group"
cp "${IRONSAN_GUEST_INIT:-$HERE/init}" "$ROOT/init"
chmod 0755 "$ROOT/init"
cp "$PAYLOAD" "$ROOT/payload.bin"

# The archive: owned by root whoever builds it.
(cd "$ROOT" && find . -mindepth 1 | LC_ALL=C sort | "$BUSYBOX" cpio -o -H newc -R 0:0 >"$OUT" 2>/dev/null)
[[ -s $OUT ]] || die "cpio produced nothing"
printf 'build-initramfs: %s: %s modules, %s bytes\n' "$OUT" "${#ORDER[@]}" "$(stat -c %s "$OUT")"
