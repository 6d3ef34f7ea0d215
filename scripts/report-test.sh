#!/usr/bin/env bash
# The benchmark report, end to end: bench/report.py draws the figures of a checked-in run
# (real measured data, bench/results/*-report/*.tsv), every expected figure must exist and be
# a non-trivial PNG, and headless Chromium must load index.html with every image decoded and
# no console error; its screenshot is kept beside the report.
#
#   scripts/report-test.sh [SAMPLE_DIR]     default: the newest bench/results/*-report
#
# Needs python3-matplotlib and chromium (scripts/install-deps.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
die() { printf 'report-test: FAIL: %s\n' "$*" >&2; exit 1; }
log() { printf 'report-test: %s\n' "$*"; }

SAMPLE=${1:-$(find "$ROOT/bench/results" -maxdepth 1 -type d -name '*-report' | sort | tail -n 1)}
[[ -n $SAMPLE && -d $SAMPLE ]] || die "no sample report directory under bench/results"
CHROMIUM=$(command -v chromium || command -v chromium-browser || true)
[[ -n $CHROMIUM ]] || die "chromium not found (apt-get install chromium)"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ironsan-report.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cp "$SAMPLE"/*.tsv "$SAMPLE"/meta-*.txt "$WORK/" 2>/dev/null || true
[[ -n $(ls "$WORK"/*.tsv 2>/dev/null) ]] || die "$SAMPLE has no .tsv data"

"$ROOT/bench/report.py" "$WORK" >"$WORK/report.out" || die "bench/report.py failed: $(cat "$WORK/report.out")"
cat "$WORK/report.out"
# Every figure the data allows: the sample holds a run of every classic experiment and of the
# run.sh sections it names.
want=(iometer-mbs iometer-latency iometer-cpu ramdisk dd lines sessions cwnd throughput-time breakdown run-ratios)
[[ -s $WORK/run.tsv ]] && grep -q '^rbd' "$WORK/run.tsv" && want+=(rbd)
for f in "${want[@]}"; do
    p=$WORK/$f.png
    [[ -s $p ]] || die "figure $f.png was not drawn"
    [[ $(head -c 8 "$p" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]] || die "$f.png is not a PNG"
    (($(stat -c %s "$p") > 8000)) || die "$f.png is only $(stat -c %s "$p") bytes: an empty plot?"
    grep -q "src='$f.png'" "$WORK/index.html" || die "index.html does not show $f.png"
done
log "${#want[@]} figures drawn and linked"

# Chromium: load the page, dump the DOM after the load event, and take a screenshot.
flags=(--headless=new --no-sandbox --disable-gpu --hide-scrollbars --allow-file-access-from-files
       --enable-logging=stderr --v=0 --virtual-time-budget=10000 --user-data-dir="$WORK/profile")
timeout 120 "$CHROMIUM" "${flags[@]}" --dump-dom "file://$WORK/index.html" >"$WORK/dom.html" 2>"$WORK/chromium.log" ||
    die "chromium --dump-dom failed: $(tail -n 5 "$WORK/chromium.log")"
grep -q 'data-images="ok ' "$WORK/dom.html" ||
    die "not every image loaded: $(grep -o 'data-images="[^"]*"' "$WORK/dom.html" || echo 'no load event seen')"
if grep -E 'CONSOLE|Uncaught' "$WORK/chromium.log" | grep -viE 'level=0|:INFO:' | grep -q .; then
    grep -E 'CONSOLE|Uncaught' "$WORK/chromium.log" >&2
    die "console errors in the report page"
fi
timeout 120 "$CHROMIUM" "${flags[@]}" --window-size=1280,2400 --screenshot="$WORK/screenshot.png" \
    "file://$WORK/index.html" >/dev/null 2>>"$WORK/chromium.log" || die "chromium --screenshot failed"
(($(stat -c %s "$WORK/screenshot.png") > 20000)) || die "the screenshot is nearly empty"
OUT=${IRONSAN_REPORT_SCREENSHOT:-$ROOT/target/report-screenshot.png}
mkdir -p "$(dirname "$OUT")"
cp "$WORK/screenshot.png" "$OUT"
log "PASS: $(grep -o 'data-images="[^"]*"' "$WORK/dom.html"), no console errors; screenshot $OUT"
