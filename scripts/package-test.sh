#!/usr/bin/env bash
# scripts/package-test.sh: build the Debian package (packaging/build-deb.sh), install it on this
# machine, serve from the installed configuration exactly as the installed systemd unit would,
# connect with libiscsi, look at it through the installed `ironsan ctl` and /metrics, then remove
# and purge the package and check what stays (the LUN's data) and what goes.
#
# Needs root, dpkg-dev and libiscsi-bin; port 3260 on 127.0.0.1 must be free (the installed
# configuration listens there). IRONSAN_BIN=PATH packages that binary instead of building one.
# Without systemd as PID 1 (containers, CI), the unit's ExecStart line is run directly.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
die() { printf 'package-test: FAIL: %s\n' "$*" >&2; exit 1; }
log() { printf 'package-test: %s\n' "$*"; }

[[ $(id -u) == 0 ]] || die "needs root (dpkg -i)"
for tool in iscsi-inq iscsi-ls dpkg-deb curl; do
    command -v "$tool" >/dev/null || die "$tool not found (scripts/install-deps.sh)"
done
if dpkg-query -W -f='${Status}' ironsan 2>/dev/null | grep -q 'install ok'; then
    die "an ironsan package is installed already; this test installs and purges its own"
fi
if ss -Hltn 'sport = :3260' | grep -q .; then die "port 3260 is in use"; fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ironsan-pkg.XXXXXX")
PID=""
cleanup() {
    [[ -n $PID ]] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
    dpkg -P ironsan >/dev/null 2>&1 || true
    rm -rf "$WORK" /var/lib/ironsan/disk1.img
}
trap cleanup EXIT

DEB=$("$ROOT/packaging/build-deb.sh" "$WORK" 2>"$WORK/build.log" | tail -n 1) || die "packaging/build-deb.sh: $(tail -n 20 "$WORK/build.log")"
[[ -s $DEB ]] || die "packaging/build-deb.sh made no package"
log "built $(basename "$DEB") ($(du -h "$DEB" | cut -f1))"
dpkg -i "$DEB" >"$WORK/dpkg.log" 2>&1 || die "dpkg -i: $(cat "$WORK/dpkg.log")"

# What the package put in place.
for f in /usr/bin/ironsan /lib/systemd/system/ironsan.service /etc/ironsan/ironsan.toml \
    /usr/share/man/man1/ironsan.1.gz /usr/share/man/man1/ironsan-ctl.1.gz \
    /usr/share/man/man1/ironsan-serve.1.gz /usr/share/bash-completion/completions/ironsan \
    /usr/share/doc/ironsan/README.md; do
    [[ -s $f ]] || die "$f was not installed"
done
[[ $(command -v ironsan) == /usr/bin/ironsan ]] || log "note: $(command -v ironsan) comes first on PATH"
VERSION=$(/usr/bin/ironsan --version)
[[ $VERSION =~ ^ironsan\ [0-9]+\.[0-9]+\.[0-9]+ ]] || die "ironsan --version printed '$VERSION'"
zcat /usr/share/man/man1/ironsan-ctl.1.gz | grep -q 'SUBCOMMANDS' || die "ironsan-ctl.1 has no SUBCOMMANDS"
grep -q '_ironsan()' /usr/share/bash-completion/completions/ironsan || die "bash completion is not a completion"
log "installed: $VERSION, unit, configuration, $(ls /usr/share/man/man1/ironsan*.1.gz | wc -l) man pages, completions"

# Serve as the unit does: its ExecStart, with its RuntimeDirectory and StateDirectory.
EXEC=$(sed -n 's/^ExecStart=//p' /lib/systemd/system/ironsan.service)
[[ $EXEC == /usr/bin/ironsan\ serve\ * ]] || die "ExecStart is '$EXEC'"
install -d -m 0700 /run/ironsan
mkdir -p /var/lib/ironsan
read -r -a argv <<<"$EXEC"
"${argv[@]}" >"$WORK/serve.log" 2>&1 &
PID=$!
for _ in $(seq 100); do
    ss -Hltn 'sport = :3260' | grep -q . && [[ -S /run/ironsan/control.sock ]] && break
    kill -0 "$PID" 2>/dev/null || die "serve exited: $(cat "$WORK/serve.log")"
    sleep 0.1
done
TARGET=$(sed -n 's/^name = "\(.*\)"/\1/p' /etc/ironsan/ironsan.toml | head -n 1)
URL=iscsi://127.0.0.1:3260/$TARGET/0
iscsi-inq "$URL" >"$WORK/inq.txt" 2>&1 || die "iscsi-inq $URL: $(cat "$WORK/inq.txt")"
grep -q 'IRONSAN' "$WORK/inq.txt" || die "INQUIRY did not name ironsan: $(cat "$WORK/inq.txt")"
iscsi-ls -s iscsi://127.0.0.1:3260 >"$WORK/ls.txt" 2>&1 || die "iscsi-ls: $(cat "$WORK/ls.txt")"
grep -q "$TARGET" "$WORK/ls.txt" || die "discovery did not list $TARGET"
# The installed ctl finds the unit's control socket by default (root: /run/ironsan/control.sock).
LUNS=$(/usr/bin/ironsan ctl luns) || die "ironsan ctl luns failed"
grep -q '/var/lib/ironsan/disk1.img\|disk1.img' <<<"$LUNS" || die "ctl luns: $LUNS"
[[ -f /var/lib/ironsan/disk1.img ]] || die "the LUN's file is not in /var/lib/ironsan"
curl -sf http://127.0.0.1:9360/metrics | grep -q '^ironsan_lun_info{' || die "no /metrics on 127.0.0.1:9360"
curl -sf http://127.0.0.1:9360/ | grep -q '<title>ironsan status' || die "no status page on 127.0.0.1:9360"
log "served $TARGET from /etc/ironsan/ironsan.toml: INQUIRY, discovery, ctl luns, /metrics, status page"
kill -TERM "$PID"
wait "$PID" || die "serve did not exit 0 on SIGTERM: $(tail -n 5 "$WORK/serve.log")"
PID=""

# Remove keeps the configuration (a conffile), purge removes it; the data stays.
dpkg -r ironsan >"$WORK/dpkg.log" 2>&1 || die "dpkg -r: $(cat "$WORK/dpkg.log")"
[[ ! -e /usr/bin/ironsan ]] || die "/usr/bin/ironsan is still there after dpkg -r"
[[ -f /etc/ironsan/ironsan.toml ]] || die "dpkg -r removed the configuration"
dpkg -P ironsan >"$WORK/dpkg.log" 2>&1 || die "dpkg -P: $(cat "$WORK/dpkg.log")"
[[ ! -e /etc/ironsan/ironsan.toml ]] || die "dpkg -P left /etc/ironsan/ironsan.toml"
[[ -f /var/lib/ironsan/disk1.img ]] || die "the package removed the LUN's data"
log "PASS: removed (configuration kept), purged (configuration gone, data kept)"
