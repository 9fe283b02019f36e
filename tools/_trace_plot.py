"""`ucm-trace plot`: a timeline of driver calls, event latency over time, and latency
histograms per event type (matplotlib, Agg backend, imported only here)."""

from __future__ import annotations

import math
import os
from collections import defaultdict

from ._trace_model import Trace

_COLORS = {"lookup": "tab:blue", "load": "tab:green", "store": "tab:orange",
           "delete": "tab:red"}


def plot(trace: Trace, out: str | os.PathLike[str], *, title: str | None = None) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("plot needs matplotlib: pip install 'ucm[trace]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = trace.t_min
    fig, (ax_tl, ax_lat, ax_hist) = plt.subplots(
        3, 1, figsize=(12, 10), gridspec_kw={"height_ratios": [2, 2, 2]})
    fig.suptitle(title or f"ucm trace: {len(trace.events)} events, {trace.seconds:.3f} s")

    # Driver calls: one row per tier and operation.
    rows = sorted({(o.tier, o.op) for o in trace.ops})
    by_row: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for o in trace.ops:
        by_row[(o.tier, o.op)].append(((o.t0 - base) / 1e9, max(o.t1 - o.t0, 1) / 1e9))
    for y, row in enumerate(rows):
        ax_tl.broken_barh(by_row[row], (y - 0.4, 0.8), color=_COLORS.get(row[1], "tab:gray"))
    errors = [((r.t - base) / 1e9, r.fields.get("tier"), r.fields.get("op")) for r in
              trace.errors]
    if errors:
        ys = [next((i for i, row in enumerate(rows) if row == (t, o)), -1) for _, t, o in errors]
        ax_tl.scatter([e[0] for e in errors], ys, marker="x", color="red", zorder=3,
                      label="errors")
        ax_tl.legend(loc="upper right")
    ax_tl.set_yticks(range(len(rows)), [f"{t} {o}" for t, o in rows])
    ax_tl.set_xlabel("time (s)")
    ax_tl.set_title("driver calls")
    ax_tl.grid(axis="x", alpha=0.3)

    # Event latency over time.
    by_type: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for ev in trace.events:
        if ev.seconds is not None and ev.start is not None:
            by_type[ev.type].append(((ev.start - base) / 1e9, max(ev.seconds, 1e-7)))
    for name, pts in sorted(by_type.items()):
        ax_lat.scatter([p[0] for p in pts], [p[1] * 1e3 for p in pts], s=6, label=name,
                       color=_COLORS.get(name.lower()))
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("time (s)")
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_title("event latency (dispatch to completion)")
    if by_type:
        ax_lat.legend(loc="upper right")
    ax_lat.grid(alpha=0.3)

    # Latency histograms.
    all_ms = [p[1] * 1e3 for pts in by_type.values() for p in pts]
    if all_ms:
        lo, hi = math.log10(min(all_ms)), math.log10(max(all_ms))
        if hi - lo < 0.5:
            lo, hi = lo - 0.25, hi + 0.25
        bins = [10 ** (lo + (hi - lo) * i / 40) for i in range(41)]
        for name, pts in sorted(by_type.items()):
            ax_hist.hist([p[1] * 1e3 for p in pts], bins=bins, alpha=0.6, label=name,
                         color=_COLORS.get(name.lower()))
        ax_hist.set_xscale("log")
        ax_hist.legend(loc="upper right")
    ax_hist.set_xlabel("latency (ms)")
    ax_hist.set_ylabel("events")
    ax_hist.set_title("latency histogram by event type")
    ax_hist.grid(alpha=0.3)

    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
