#!/usr/bin/python3
"""Draw the figures of a benchmark run and write DIR/index.html.

    bench/report.py DIR

DIR holds what `bench/classic.sh --report DIR` and `bench/run.sh --report DIR` saved: the
measured points (`classic.tsv`, `run.tsv`) and `meta-classic.txt` / `meta-run.txt` (host,
commit, date, target versions, the exact command). Running this again redraws the report
from those files without measuring anything. Figures are PNG files beside index.html; an
experiment with no points in the data is left out, and the page says which were drawn.

Plotting is matplotlib (Debian's python3-matplotlib): the bench already runs Python for its
tables, and matplotlib draws axes, legends and grouped or stacked bars without code of ours.
"""

import html
import os
import sys
from collections import OrderedDict, defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TARGET_COLORS = {"ironsan": "#1f77b4", "tgt": "#d62728", "istgt": "#2ca02c", "native": "#7f7f7f",
                 "ironsan-poll": "#17becf"}
DPI = 90


def color(t):
    return TARGET_COLORS.get(t, None)


def read_tsv(path):
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line:
                rows.append(line.split("\t"))
    return rows


def num(s, default=0.0):
    try:
        return float(s)
    except (TypeError, ValueError):
        return default


def read_meta(path):
    meta = OrderedDict()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if ":" in line:
                    k, v = line.split(":", 1)
                    meta[k.strip()] = v.strip()
    return meta


class Report:
    def __init__(self, out):
        self.out = out
        self.figs = []  # (file, title, caption)

    def save(self, fig, name, title, caption, rect=None):
        path = os.path.join(self.out, name)
        fig.tight_layout(rect=rect)
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        self.figs.append((name, title, caption))


def size_label(b):
    b = int(b)
    return f"{b // 1024}K" if b >= 1024 else f"{b}"


# --- classic.sh ------------------------------------------------------------------------------

def fig_iometer(rep, rows):
    # iometer TARGET PATTERN QD BS MB/s LAT_US CPU_US
    pts = [r for r in rows if r[0] == "iometer" and len(r) >= 8]
    if not pts:
        return
    patterns = list(OrderedDict.fromkeys(r[2] for r in pts))
    qds = sorted({int(r[3]) for r in pts})
    targets = list(OrderedDict.fromkeys(r[1] for r in pts))
    styles = ["-", "--", ":", "-."]
    for metric, col, unit, fname in (("throughput", 5, "MB/s", "iometer-mbs"),
                                     ("mean response time", 6, "us", "iometer-latency"),
                                     ("target CPU per I/O", 7, "us", "iometer-cpu")):
        n = len(patterns)
        cols = min(3, n)
        nrows = (n + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
        for i, p in enumerate(patterns):
            ax = axes[i // cols][i % cols]
            for t in targets:
                for k, q in enumerate(qds):
                    xs = sorted((int(r[4]), num(r[col])) for r in pts
                                if r[1] == t and r[2] == p and int(r[3]) == q)
                    if xs:
                        ax.plot([x for x, _ in xs], [y for _, y in xs], styles[k % len(styles)],
                                marker="o", ms=3, color=color(t), label=f"{t} QD{q}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({int(r[4]) for r in pts}))
            ax.set_xticklabels([size_label(b) for b in sorted({int(r[4]) for r in pts})], fontsize=7)
            ax.set_title(p, fontsize=9)
            ax.set_xlabel("request size (bytes)", fontsize=8)
            ax.set_ylabel(f"{metric} ({unit})", fontsize=8)
            if metric == "mean response time":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        for j in range(n, nrows * cols):
            axes[j // cols][j % cols].axis("off")
        h, lab = axes[0][0].get_legend_handles_labels()
        fig.legend(h, lab, loc="lower center", ncol=min(9, len(lab)), fontsize=7, frameon=False,
                   bbox_to_anchor=(0.5, 0.0))
        rep.save(fig, f"{fname}.png", f"IOmeter matrix: {metric} against request size",
                 f"Seed experiment 1 (FORTH study): each access pattern at each queue depth, one line "
                 f"per target and depth; {metric} in {unit}; a file on tmpfs, loopback.",
                 rect=(0, 0.06, 1, 1))


def fig_ramdisk(rep, rows):
    # ramdisk TARGET RW QD BS MB/s LAT_US INITIATOR_CPU_US
    pts = [r for r in rows if r[0] == "ramdisk" and len(r) >= 8]
    if not pts:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for t in OrderedDict.fromkeys(r[1] for r in pts):
        for rw, style in (("read", "-"), ("write", "--")):
            xs = sorted((int(r[4]), num(r[6]), num(r[7])) for r in pts if r[1] == t and r[2] == rw)
            if not xs:
                continue
            axes[0].plot([x[0] for x in xs], [x[1] for x in xs], style, marker="o", ms=3,
                         color=color(t), label=f"{t} {rw}")
            axes[1].plot([x[0] for x in xs], [x[2] for x in xs], style, marker="o", ms=3,
                         color=color(t), label=f"{t} {rw}")
    for ax, yl in ((axes[0], "mean response time (us)"), (axes[1], "initiator CPU per I/O (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request size (bytes)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    rep.save(fig, "ramdisk.png", "RAM disk, one outstanding request",
             "Seed experiment 2: response time and initiator CPU per I/O against request size, "
             "reads and writes, loopback.")


def grouped_bars(ax, groups, series, values, colors=None, hatches=None, fmt="{:.0f}"):
    """values[(group, series)] -> height."""
    n = max(1, len(series))
    w = 0.8 / n
    for k, s in enumerate(series):
        xs = [i + (k - (n - 1) / 2) * w for i in range(len(groups))]
        hs = [values.get((g, s), 0) for g in groups]
        bars = ax.bar(xs, hs, w, label=s, color=(colors or {}).get(s),
                      hatch=(hatches or {}).get(s))
        for b, h in zip(bars, hs):
            if h:
                ax.annotate(fmt.format(h), (b.get_x() + b.get_width() / 2, h), ha="center",
                            va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def fig_dd(rep, rows):
    # dd TARGET BACKEND WRITE_MBS READ_MBS ; mpio TARGET RW ONE TWO ; mcs-lines TARGET RW 1 2 4
    dd = [r for r in rows if r[0] == "dd" and len(r) >= 5]
    mpio = [r for r in rows if r[0] == "mpio" and len(r) >= 5]
    mcs = [r for r in rows if r[0] == "mcs-lines" and len(r) >= 6]
    if dd:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
        backends = list(OrderedDict.fromkeys(r[2] for r in dd))
        targets = list(OrderedDict.fromkeys(r[1] for r in dd))
        for ax, col, what in ((axes[0], 3, "write"), (axes[1], 4, "read")):
            vals = {(r[2], r[1]): num(r[col]) for r in dd}
            grouped_bars(ax, backends, targets, vals, {t: color(t) for t in targets})
            ax.set_title(f"dd {what}, one emulated Gigabit line", fontsize=9)
            ax.set_ylabel("MB/s")
        axes[0].legend(fontsize=7)
        rep.save(fig, "dd.png", "dd over one emulated Gigabit line",
                 "Seed experiment 3 (iSCSI-SCST vs IET vs STGT): dd bs=512K of the raw LUN, NULLIO, "
                 "FILEIO and BLOCKIO backends per target; the best targets then reached 106-114 MB/s.")
    if mpio or mcs:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        if mpio:
            groups = list(OrderedDict.fromkeys(f"{r[1]} {r[2]}" for r in mpio))
            vals = {}
            for r in mpio:
                vals[(f"{r[1]} {r[2]}", "one line")] = num(r[3])
                vals[(f"{r[1]} {r[2]}", "two lines")] = num(r[4])
            grouped_bars(axes[0], groups, ["one line", "two lines"], vals,
                         {"one line": "#aec7e8", "two lines": "#1f77b4"})
            axes[0].set_title("MPIO: one session per line", fontsize=9)
            axes[0].set_ylabel("MB/s")
            axes[0].legend(fontsize=7)
        else:
            axes[0].axis("off")
        if mcs:
            for r in mcs:
                ys = [num(x) for x in r[3:6]]
                axes[1].plot([1, 2, 4], ys, "-" if r[2] == "write" else "--", marker="o",
                             color=color(r[1]), label=f"{r[1]} {r[2]}")
            axes[1].plot([1, 2, 4], [num(mcs[0][3]) * n for n in (1, 2, 4)], ":", color="#999",
                         label="N x one line")
            axes[1].set_xticks([1, 2, 4])
            axes[1].set_xlabel("lines (one connection each, one session)")
            axes[1].set_ylabel("MB/s")
            axes[1].set_title("MC/S: one session over 1, 2, 4 lines", fontsize=9)
            axes[1].grid(alpha=0.3)
            axes[1].legend(fontsize=7)
        else:
            axes[1].axis("off")
        rep.save(fig, "lines.png", "One line against several: MPIO and MC/S",
                 "Seed experiment 4 (MPIO; iSCSI-SCST got 1.67x one line) and one session over "
                 "several lines with one connection each (MC/S): sequential 512 KiB.")


def fig_sessions(rep, rows):
    # share TARGET MODE RW UNIT MBS LAT SD ; sessions TARGET MODE RW MIB LAT SD JAIN ;
    # cwnd TARGET MODE RW CONN T CWND [BYTES_ACKED]
    share = [r for r in rows if r[0] == "share" and len(r) >= 8]
    sess = [r for r in rows if r[0] == "sessions" and len(r) >= 8]
    cwnd = [r for r in rows if r[0] == "cwnd" and len(r) >= 7]
    if share:
        combos = list(OrderedDict.fromkeys((r[1], r[2], r[3]) for r in share))
        jain = {(r[1], r[2], r[3]): r[7] for r in sess}
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
        for ax, rw in zip(axes, ("write", "read")):
            cs = [c for c in combos if c[2] == rw]
            units = sorted({int(r[4]) for r in share})
            vals = {}
            labels = []
            for c in cs:
                lab = f"{c[0]}\n{c[1]}\nJ={jain.get(c, '?')}"
                labels.append(lab)
                for r in share:
                    if (r[1], r[2], r[3]) == c:
                        vals[(lab, f"#{r[4]}")] = num(r[5]) * 1.048576
            grouped_bars(ax, labels, [f"#{u}" for u in units], vals, fmt="{:.0f}")
            ax.tick_params(axis="x", labelsize=6)
            ax.set_title(f"sequential 512 KiB {rw}s, one Gigabit line", fontsize=9)
            ax.set_ylabel("MB/s per connection (or session)")
        axes[0].legend(title="connection", fontsize=6, title_fontsize=7)
        rep.save(fig, "sessions.png", "Connections sharing a line: throughput and Jain's index",
                 "Seed experiment 5 (IISc, multiple TCP connections per session): per connection "
                 "(mcs-*: one session of 4 connections; sessions: 4 sessions) MB/s and Jain's "
                 "fairness index J; rr and lqd spreading; -fair: ironsan's fairness control on.")
    writes = [r for r in cwnd if r[3] == "write"]
    combos = list(OrderedDict.fromkeys((r[1], r[2]) for r in writes))
    if not combos:
        return

    def cwnd_of(c):
        series = defaultdict(list)
        for r in writes:
            if (r[1], r[2]) == c:
                series[r[4]].append((num(r[5]), num(r[6])))
        return series

    time_grid(rep, combos, cwnd_of, "cwnd (segments)", "cwnd.png",
              "Congestion windows over time (writes)",
              "Seed experiment 5: the initiator's congestion window of each connection "
              "sampled every 0.5 s while 4 connections (or sessions) write over one line.")

    # Throughput over time: the growth of each sender's bytes_acked between samples.
    def rate_of(c):
        acked = defaultdict(list)
        for r in writes:
            if (r[1], r[2]) == c and len(r) >= 8 and r[7]:
                acked[r[4]].append((num(r[5]), num(r[7])))
        series = {}
        for conn, pts in acked.items():
            pts.sort()
            series[conn] = [(t1, (b1 - b0) / (t1 - t0) / 1e6)
                            for (t0, b0), (t1, b1) in zip(pts, pts[1:]) if t1 > t0]
        return series

    if any(len(r) >= 8 and r[7] for r in writes):
        time_grid(rep, combos, rate_of, "MB/s", "throughput-time.png",
                  "Per-connection throughput over time (writes)",
                  "Seed experiment 5: each connection's (or session's) MB/s in every 0.5 s, "
                  "from the growth of its sender's bytes_acked (ss -ti), 4 writing over one "
                  "Gigabit line.")


def time_grid(rep, combos, series_of, ylabel, name, title, caption):
    """One small plot per (target, mode) of each connection's series over time."""
    n = len(combos)
    cols = min(4, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(3.4 * cols, 2.6 * nrows), squeeze=False)
    for i, c in enumerate(combos):
        ax = axes[i // cols][i % cols]
        for k, (_conn, pts) in enumerate(sorted(series_of(c).items())):
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=f"conn {k}")
        ax.set_title(f"{c[0]} {c[1]}", fontsize=8)
        ax.set_xlabel("time (s)", fontsize=7)
        ax.set_ylabel(ylabel, fontsize=7)
        ax.grid(alpha=0.3)
    for j in range(n, nrows * cols):
        axes[j // cols][j % cols].axis("off")
    axes[0][0].legend(fontsize=6)
    rep.save(fig, name, title, caption)


def fig_breakdown(rep, rows):
    # stages TARGET RW BS QD STAGE MEAN_US ; breakdown TARGET RW BS QD CPU_US IOPS
    st = [r for r in rows if r[0] == "stages" and len(r) >= 7]
    bd = [r for r in rows if r[0] == "breakdown" and len(r) >= 7]
    if not (st or bd):
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    order = ["receive", "queue", "backend", "respond", "send"]
    if st:
        wls = list(OrderedDict.fromkeys(f"{r[2]} {size_label(r[3])} QD{r[4]}" for r in st))
        bottom = [0.0] * len(wls)
        for s in order:
            hs = []
            for w in wls:
                v = [num(r[6]) for r in st if f"{r[2]} {size_label(r[3])} QD{r[4]}" == w and r[5] == s]
                hs.append(v[0] if v else 0.0)
            axes[0].bar(range(len(wls)), hs, 0.6, bottom=bottom, label=s)
            bottom = [a + b for a, b in zip(bottom, hs)]
        axes[0].set_xticks(range(len(wls)))
        axes[0].set_xticklabels(wls, fontsize=7)
        axes[0].set_ylabel("mean us per command")
        axes[0].set_title("ironsan: time per stage", fontsize=9)
        axes[0].legend(fontsize=7)
        axes[0].grid(axis="y", alpha=0.3)
    else:
        axes[0].axis("off")
    if bd:
        wls = list(OrderedDict.fromkeys(f"{r[2]} {size_label(r[3])} QD{r[4]}" for r in bd))
        targets = list(OrderedDict.fromkeys(r[1] for r in bd))
        vals = {(f"{r[2]} {size_label(r[3])} QD{r[4]}", r[1]): num(r[5]) for r in bd}
        grouped_bars(axes[1], wls, targets, vals, {t: color(t) for t in targets}, fmt="{:.1f}")
        axes[1].set_yscale("log")
        axes[1].set_ylabel("target CPU per I/O (us, log)")
        axes[1].set_title("CPU per I/O by target", fontsize=9)
        axes[1].legend(fontsize=7)
        axes[1].tick_params(axis="x", labelsize=7)
    else:
        axes[1].axis("off")
    rep.save(fig, "breakdown.png", "Where the time goes",
             "Seed experiment 8: ironsan's mean time per command in each stage (receive, queue, "
             "backend, respond, send; `ironsan ctl stats`) and each target's CPU per I/O, loopback.")


# --- run.sh ----------------------------------------------------------------------------------

def run_points(rows):
    """(setup, workload) -> target -> (iops, client %, cpu us/IO, osd us/IO or None,
    host us/IO or None)."""
    out = OrderedDict()
    for r in rows:
        if len(r) < 10:
            continue
        setup, w, t, a, _b, ticks, wall_ns, tool, client_ticks, hz = r[:10]
        if w.startswith(("mem-", "idle", "restart-")):
            continue
        # TOOL[:osd=TICKS][:host=TICKS] (rbd rows)
        tool, *extra = tool.split(":")
        extra = dict(kv.split("=", 1) for kv in extra)
        osd = int(extra["osd"]) if "osd" in extra else None
        host = int(extra["host"]) if "host" in extra else None
        iops = num(a)
        wall = num(wall_ns) / 1e9 or 1.0
        hz = num(hz) or 100.0
        ios = iops * wall
        cpu = num(ticks) / hz * 1e6 / ios if ios and ticks != "-" else 0.0
        client = 100.0 * num(client_ticks) / hz / wall
        osd_io = osd / hz * 1e6 / ios if osd is not None and ios else None
        host_io = host / hz * 1e6 / ios if host is not None and ios else None
        out.setdefault((setup, w), OrderedDict())[t] = (iops, client, cpu, osd_io, host_io)
    return out


def fig_run(rep, rows):
    pts = run_points(rows)
    ratio_rows = []  # (label, peer, ratio, client_bound)
    for (setup, w), ts in pts.items():
        if setup == "rbd" or "ironsan" not in ts:
            continue
        mine = ts["ironsan"]
        for peer, v in ts.items():
            if peer.startswith("ironsan") or not v[0]:
                continue
            bound = max(mine[1], v[1]) >= 95.0
            ratio_rows.append((f"{setup} {w}", peer, mine[0] / v[0], bound))
    if ratio_rows:
        labels = list(OrderedDict.fromkeys(r[0] for r in ratio_rows))
        peers = list(OrderedDict.fromkeys(r[1] for r in ratio_rows))
        fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(labels) * len(peers)), 4.2))
        n = len(peers)
        wdt = 0.8 / n
        for k, p in enumerate(peers):
            for i, lab in enumerate(labels):
                m = [r for r in ratio_rows if r[0] == lab and r[1] == p]
                if not m:
                    continue
                _, _, ratio, bound = m[0]
                x = i + (k - (n - 1) / 2) * wdt
                ax.bar(x, ratio, wdt, color=color(p), hatch="//" if bound else None,
                       edgecolor="black" if bound else None, linewidth=0.3,
                       label=p if i == 0 or not ax.get_legend_handles_labels()[1].count(p) else None)
                ax.annotate(f"{ratio:.2f}", (x, ratio), ha="center", va="bottom", fontsize=6)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("ironsan IOPS / peer IOPS")
        ax.grid(axis="y", alpha=0.3)
        h, lab = ax.get_legend_handles_labels()
        seen = OrderedDict()
        for hh, ll in zip(h, lab):
            seen.setdefault(ll, hh)
        ax.legend(list(seen.values()), [f"against {p}" for p in seen], fontsize=7)
        rep.save(fig, "run-ratios.png", "Side by side: ironsan against each peer",
                 "bench/run.sh: ironsan's IOPS over each peer's for every workload of the run "
                 "(above 1: ironsan faster). Hatched bars: a client's core was at 95 % or more, so "
                 "the client, not the target, set the figure.")
    rbd = [(w, ts) for (setup, w), ts in pts.items() if setup == "rbd"]
    if rbd:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        wls = [w for w, _ in rbd]
        targets = ["ironsan", "tgt", "native"]
        vals = {(w, t): ts[t][0] for w, ts in rbd for t in targets if t in ts}
        grouped_bars(axes[0], wls, targets, vals, {t: color(t) for t in targets})
        axes[0].set_ylabel("IOPS")
        axes[0].set_yscale("log")
        axes[0].set_title("RBD: IOPS (log)", fontsize=9)
        axes[0].legend(fontsize=7)
        axes[0].tick_params(axis="x", labelsize=7)
        cpu_series = ["ironsan gateway", "tgt gateway", "OSD (ironsan run)",
                      "host (ironsan run)", "host (native run)"]
        cvals = {}
        for w, ts in rbd:
            if "ironsan" in ts:
                cvals[(w, "ironsan gateway")] = ts["ironsan"][2]
                if ts["ironsan"][3] is not None:
                    cvals[(w, "OSD (ironsan run)")] = ts["ironsan"][3]
                if ts["ironsan"][4] is not None:
                    cvals[(w, "host (ironsan run)")] = ts["ironsan"][4]
            if "native" in ts and ts["native"][4] is not None:
                cvals[(w, "host (native run)")] = ts["native"][4]
            if "tgt" in ts:
                cvals[(w, "tgt gateway")] = ts["tgt"][2]
        grouped_bars(axes[1], wls, cpu_series, cvals,
                     {"ironsan gateway": color("ironsan"), "tgt gateway": color("tgt"),
                      "OSD (ironsan run)": "#bbbbbb", "host (ironsan run)": "#555555",
                      "host (native run)": color("native")})
        axes[1].set_ylabel("CPU us per I/O")
        axes[1].set_title("RBD: CPU per I/O", fontsize=9)
        axes[1].legend(fontsize=7)
        axes[1].tick_params(axis="x", labelsize=7)
        rep.save(fig, "rbd.png", "Ceph RBD: ironsan against tgt's RBD store and native librbd",
                 "bench/run.sh rbd section on a one-OSD cluster on the same host: IOPS of each "
                 "gateway and of fio's rbd engine, and CPU per I/O of the gateways, the OSD and "
                 "the whole host (every process on both cores) in ironsan's and native's runs.")


# --- the page --------------------------------------------------------------------------------

def write_html(rep, metas):
    e = html.escape
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>ironsan benchmark report</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:1em auto;color:#222}"
             "figure{margin:1.5em 0}img{max-width:100%;border:1px solid #ddd}"
             "figcaption{font-size:0.9em;color:#444}table{border-collapse:collapse}"
             "td,th{padding:2px 8px;text-align:left;vertical-align:top;font-size:0.9em}</style>",
             "</head><body><h1>ironsan benchmark report</h1>"]
    for name, meta in metas:
        if not meta:
            continue
        parts.append(f"<h2>{e(name)}</h2><table>")
        for k, v in meta.items():
            parts.append(f"<tr><th>{e(k)}</th><td><code>{e(v)}</code></td></tr>")
        parts.append("</table>")
    if not rep.figs:
        parts.append("<p>No measured points in this directory.</p>")
    for f, title, caption in rep.figs:
        parts.append(f"<figure><h3>{e(title)}</h3><img src='{e(f)}' alt='{e(title)}'>"
                     f"<figcaption>{e(caption)}</figcaption></figure>")
    parts.append("<p>Redraw from the saved data: <code>bench/report.py DIR</code>.</p>")
    # For the report's own test (scripts/report-test.sh): after loading, the body says whether
    # every image decoded.
    parts.append("<script>window.addEventListener('load', () => { const imgs = [...document.images];"
                 " const bad = imgs.filter(i => !(i.complete && i.naturalWidth > 0));"
                 " document.body.dataset.images = bad.length ? 'broken ' + bad.map(i => i.src).join(' ')"
                 " : 'ok ' + imgs.length; });</script></body></html>")
    with open(os.path.join(rep.out, "index.html"), "w", encoding="utf-8") as f:
        f.write("\n".join(parts) + "\n")


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = sys.argv[1]
    if not os.path.isdir(out):
        print(f"report: {out} is not a directory", file=sys.stderr)
        return 2
    rep = Report(out)
    classic = read_tsv(os.path.join(out, "classic.tsv"))
    run = read_tsv(os.path.join(out, "run.tsv"))
    for f in (fig_iometer, fig_ramdisk, fig_dd, fig_sessions, fig_breakdown):
        f(rep, classic)
    fig_run(rep, run)
    write_html(rep, [("bench/classic.sh", read_meta(os.path.join(out, "meta-classic.txt"))),
                     ("bench/run.sh", read_meta(os.path.join(out, "meta-run.txt")))])
    print(f"report: {os.path.join(out, 'index.html')}: {len(rep.figs)} figures "
          f"({', '.join(f for f, _, _ in rep.figs) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
