"""Static figures of a timeline (matplotlib) and the pure data functions behind them.

    gantt_rows(timeline, measured)                 -> one dict per span / idle interval
    gantt_bars(timeline, measured, window, pixel)  -> what plot_gantt draws: one group per lane and
                                                      kind, gaps under a pixel merged
    vmem_steps(timeline)                           -> (times_us, bytes)
    time_split_rows({label: timeline})             -> compute / idle, HBM busy / bubble µs

`plot_gantt` draws one collection per lane and kind (13k spans draw as fast as 100), no bar
edges, every bar at least a pixel wide, the legend outside the axes. `mkresearch.views.widgets`
re-exports all of it next to the interactive view.

A figure drawn from the timeline model (or the scale-out model, `scale_out_plots`) says so in its
title (`modelled`): its times come from stated chip figures and assumptions, not from a clock.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from mkresearch.prediction import timeline as tl

COLORS = {"dma": "#4C72B0", "compute": "#DD8452", "measured": "#55A868",
          "hbm_busy": "#A9C4E4",  # a pale DMA blue: the compute unit waits, HBM moves bytes
          "bubble": "#C44E52"}  # red: nothing moves, the time is lost
LABELS = {"dma": "DMA moving bytes", "compute": "compute phase", "measured": "measured (trace)",
          "hbm_busy": "compute idle: HBM busy", "bubble": "bubble: nothing moves"}
IDLE_LANES = {"hbm_busy": "idle, HBM busy", "bubble": "bubble"}  # Gantt rows, by cause
_KIND_ORDER = ("dma", "compute", "hbm_busy", "bubble", "measured")


_SAYS_MODELLED = re.compile(r"\b(modell?ed|model|predicted)\b", re.IGNORECASE)


def modelled(title: str) -> str:
    """`title` saying that what the figure shows is modelled: " (modelled)" appended unless it
    already says modelled, model or predicted."""
    if _SAYS_MODELLED.search(title):
        return title
    return f"{title} (modelled)" if title else "modelled"


# ---- data functions (pure) -------------------------------------------------------------------
def gantt_lanes(timeline: tl.Timeline, measured: Sequence[tl.Span] = ()) -> list[str]:
    """The Gantt chart's rows, top to bottom: DMA lanes, compute, the two idle causes (if the
    timeline has spans), then one row per measured scope name."""
    idle_lanes = list(IDLE_LANES.values()) if timeline.spans else []
    measured_lanes = list(dict.fromkeys(f"measured: {s.name}" for s in measured))
    return timeline.lanes + idle_lanes + measured_lanes


def gantt_rows(timeline: tl.Timeline, measured: Sequence[tl.Span] = ()) -> list[dict]:
    """One dict per bar: lane, row (0 = top), name, kind, start_us, end_us. DMA lanes first, then
    compute, then the compute unit's idle time by cause, then one row per measured scope (spans
    from a trace, see profiling)."""
    order = {lane: i for i, lane in enumerate(gantt_lanes(timeline, measured))}
    rows = [{"lane": s.lane, "row": order[s.lane], "name": s.name, "kind": s.kind,
             "start_us": s.start * 1e6, "end_us": s.end * 1e6} for s in timeline.spans]
    rows += [{"lane": IDLE_LANES[i.cause], "row": order[IDLE_LANES[i.cause]], "name": i.cause,
              "kind": i.cause, "start_us": i.start * 1e6, "end_us": i.end * 1e6}
             for i in timeline.idle]
    rows += [{"lane": f"measured: {s.name}", "row": order[f"measured: {s.name}"], "name": s.name,
              "kind": "measured", "start_us": s.start * 1e6, "end_us": s.end * 1e6}
             for s in measured]
    return rows


def timeline_end_us(timeline: tl.Timeline, measured: Sequence[tl.Span] = ()) -> float:
    """Where the chart ends: the step's end or the last measured span's, whichever is later."""
    return max([timeline.total_s * 1e6] + [s.end * 1e6 for s in measured])


def gantt_bars(timeline: tl.Timeline, measured: Sequence[tl.Span] = (), *,
               window_us: tuple[float, float] | None = None, pixel_us: float = 0.0) -> list[dict]:
    """What `plot_gantt` draws: one dict per (row, kind) with lane, row, kind, `xranges` (a list
    of (start_us, width_us) bars) and `opacity` (one value in (0, 1] per bar).

    Spans are clipped to `window_us` (None: everything); spans that take no time (phases that
    declare no work) are left out. With `pixel_us` = 0 the bars are the spans, touching ones
    merged, all opaque. With a resolution of `pixel_us` per pixel the lane is drawn pixel column
    by column: a column with any span in it is drawn, its opacity the fraction of its time that
    is covered (at least MIN_OPACITY, so a short phase stays visible), and neighbouring columns
    of equal opacity form one bar. So 13k spans draw as at most a few hundred bars per lane, and
    a dense lane shows how busy it is instead of a solid block or thousands of hairlines.
    """
    if not (isinstance(pixel_us, (int, float)) and pixel_us >= 0 and math.isfinite(pixel_us)):
        raise ValueError(f"pixel_us={pixel_us!r} is invalid: a finite number >= 0")
    lo, hi = (-math.inf, math.inf) if window_us is None else window_us
    if not lo < hi:
        raise ValueError(f"window_us={window_us!r} is invalid: (start, end) with start < end")
    groups: dict[tuple[int, str], dict] = {}
    for r in gantt_rows(timeline, measured):
        start, end = max(r["start_us"], lo), min(r["end_us"], hi)
        if r["end_us"] <= r["start_us"] or end <= start:
            continue
        group = groups.setdefault((r["row"], r["kind"]), {"lane": r["lane"], "row": r["row"],
                                                          "kind": r["kind"], "intervals": []})
        group["intervals"].append((start, end))
    bars = []
    for key in sorted(groups, key=lambda k: (k[0], _kind_rank(k[1]))):
        group = groups[key]
        merged = _merge_touching(group.pop("intervals"))
        if pixel_us > 0:
            xranges, opacity = _pixel_columns(merged, pixel_us)
        else:
            xranges, opacity = [(a, b - a) for a, b in merged], [1.0] * len(merged)
        bars.append(group | {"xranges": xranges, "opacity": opacity})
    return bars


MIN_OPACITY = 0.25  # a pixel column with a sliver of a span in it is still drawn this strongly
_OPACITY_LEVELS = 8  # opacities are rounded up to eighths, so equal neighbours merge


def _merge_touching(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:  # overlapping (several DMA engines) or touching
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _pixel_columns(merged: list[tuple[float, float]],
                   pixel_us: float) -> tuple[list[tuple[float, float]], list[float]]:
    """Disjoint sorted intervals -> bars over pixel columns with the covered fraction as
    opacity (see gantt_bars)."""
    import numpy as np

    first = math.floor(merged[0][0] / pixel_us)
    n_columns = max(1, math.ceil(merged[-1][1] / pixel_us) - first)
    edges = (first + np.arange(n_columns + 1)) * pixel_us
    # time covered below x, piecewise linear through the interval ends: exact per column
    points = np.array(merged).ravel()
    covered = np.concatenate([[0.0], np.cumsum(np.diff(points) * (np.arange(len(points) - 1) % 2
                                                                  == 0))])
    fraction = np.diff(np.interp(edges, points, covered)) / pixel_us
    level = np.where(fraction > 0, np.ceil(np.maximum(fraction, MIN_OPACITY) * _OPACITY_LEVELS
                                           - 1e-9), 0) / _OPACITY_LEVELS
    xranges, opacity = [], []
    column = 0
    while column < n_columns:
        run = column
        while run + 1 < n_columns and level[run + 1] == level[column]:
            run += 1
        if level[column] > 0:
            xranges.append((float(edges[column]), float(edges[run + 1] - edges[column])))
            opacity.append(float(min(1.0, level[column])))
        column = run + 1
    return xranges, opacity


def _kind_rank(kind: str) -> int:
    return _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)


def vmem_steps(timeline: tl.Timeline) -> tuple[list[float], list[int]]:
    """The VMEM occupancy step function as (times in µs, bytes from that time on), closed at the
    end of the step."""
    times = [t * 1e6 for t, _ in timeline.vmem]
    values = [b for _, b in timeline.vmem]
    end = timeline.total_s * 1e6
    if not times or times[-1] < end:
        times.append(end)
        values.append(values[-1] if values else 0)
    return times, values


def time_split_rows(timelines: Mapping[str, tl.Timeline]) -> list[dict]:
    """Where each timeline's step goes, in µs: compute, compute idle while HBM is busy, bubbles.
    The three add up to the step time (the compute unit is either busy or idle)."""
    return [{"label": label, "compute_us": t.busy_s("compute") * 1e6,
             "idle_hbm_busy_us": t.idle_s("hbm_busy") * 1e6, "bubble_us": t.idle_s("bubble") * 1e6}
            for label, t in timelines.items()]


# ---- figures ---------------------------------------------------------------------------------
def legend_outside(ax, handles=None, **kwargs):
    """The legend to the right of the axes, where it cannot cover data."""
    options = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0,
               "frameon": False, "fontsize": "small"} | kwargs
    return ax.legend(handles=handles, **options) if handles is not None else ax.legend(**options)


def plot_gantt(timeline: tl.Timeline, ax=None, measured: Sequence[tl.Span] = (),
               title: str | None = None, window_us: tuple[float, float] | None = None):
    """Bars per lane against time (µs): DMA engines, compute, the compute unit's idle time by
    cause (each with its fraction of the step in the legend), measured spans."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3), layout="constrained")
    end = timeline_end_us(timeline, measured)
    lo, hi = window_us if window_us is not None else (0.0, end)
    rows = gantt_rows(timeline, measured)
    lanes = gantt_lanes(timeline, measured)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # row 0 on top
    kinds = [k for k in _KIND_ORDER if any(r["kind"] == k and r["end_us"] > r["start_us"]
                                           for r in rows) or (k in IDLE_LANES and timeline.spans)]
    if kinds:
        legend_outside(ax, [Patch(facecolor=COLORS[k], label=_legend_label(timeline, k))
                            for k in kinds])
    if hi > lo:  # the whole step gets a 1% margin so its last bar is not cut by the frame
        ax.set_xlim(lo, hi + (0.01 * (hi - lo) if window_us is None else 0.0))
    default = (f"{timeline.chip.name}: modelled step {timeline.total_s * 1e6:.2f} µs, "
               f"{timeline.roofline_fraction:.0%} of the HBM roofline")
    if window_us is not None:
        default += f" (window {lo:.4g}–{hi:.4g} µs)"
    title = title or default
    ax.set_title(modelled(title) if timeline.spans else title)  # measured spans alone are not
    ax.set_xlabel("time (µs)")
    if ax.figure.get_layout_engine() is not None:
        ax.figure.draw_without_rendering()  # lays out ticks and legend: the axes' final width
    width_px = max(1.0, ax.get_window_extent().width)
    bars = gantt_bars(timeline, measured, window_us=window_us,
                      pixel_us=(hi - lo) / width_px if hi > lo else 0.0)
    for bar in bars:  # one collection per lane and kind, no edges
        rgb = to_rgb(COLORS[bar["kind"]])
        ax.broken_barh(bar["xranges"], (bar["row"] - 0.4, 0.8),
                       facecolors=[(*rgb, a) for a in bar["opacity"]], edgecolors="none",
                       linewidth=0, antialiased=False)  # no seams between pixel columns
    if any(a < 1 for bar in bars for a in bar["opacity"]):
        # short enough to stay under its own panel in a grid of Gantt charts (notebook 01)
        ax.set_xlabel("time (µs); paler: a pixel only partly covered by spans")
    return ax


def _legend_label(timeline: tl.Timeline, kind: str) -> str:
    if kind in IDLE_LANES:
        return f"{LABELS[kind]} ({timeline.step_fraction(timeline.idle_s(kind)):.0%} of the step)"
    return LABELS[kind]


def plot_vmem(timeline: tl.Timeline, ax=None):
    """VMEM bytes in use (MiB) against time, with the chip's VMEM capacity in the title."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2))
    times, values = vmem_steps(timeline)
    ax.step(times, [v / 2**20 for v in values], where="post", color=COLORS["dma"])
    ax.fill_between(times, [v / 2**20 for v in values], step="post", alpha=0.3,
                    color=COLORS["dma"])
    ax.set_ylabel("VMEM (MiB)")
    ax.set_xlabel("time (µs)")
    if timeline.total_s > 0:
        ax.set_xlim(0, timeline.total_s * 1e6)
    ax.set_title(f"VMEM in use (modelled): peak {timeline.peak_vmem_bytes / 2**20:.2f} MiB of "
                 f"{timeline.chip.vmem_capacity / 2**20:.0f} MiB")
    return ax


def timeline_figure(timeline: tl.Timeline, measured: Sequence[tl.Span] = (),
                    title: str | None = None, window_us: tuple[float, float] | None = None):
    """Gantt chart over VMEM occupancy, one figure, returned and not shown: a notebook cell that
    ends with it (or `display(fig)`) shows it once. It is made by pyplot, which sets up the
    notebook's figure display, and closed there at once so that pyplot does not show it again."""
    import matplotlib.pyplot as plt

    n_lanes = len(gantt_lanes(timeline, measured))
    fig, (gantt, vmem) = plt.subplots(2, 1, figsize=(11, 1.2 + 0.4 * n_lanes + 1.8),
                                      height_ratios=[max(2, n_lanes), 2], sharex=True,
                                      layout="constrained")
    plt.close(fig)
    plot_vmem(timeline, vmem)
    plot_gantt(timeline, gantt, measured, title, window_us)  # last: its x range wins
    vmem.set_xlabel(gantt.get_xlabel())  # the shared time axis, with the Gantt's shading note
    gantt.set_xlabel("")
    return fig


def plot_time_split(timelines: Mapping[str, tl.Timeline], ax=None,
                    title: str = "where each step's time goes (modelled)"):
    """One stacked bar per timeline: compute, compute idle while HBM is busy, bubbles (µs)."""
    import matplotlib.pyplot as plt

    rows = time_split_rows(timelines)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * max(1, len(rows))), layout="constrained")
    labels = [r["label"] for r in rows]
    left = [0.0] * len(rows)
    for key, kind in (("compute_us", "compute"), ("idle_hbm_busy_us", "hbm_busy"),
                      ("bubble_us", "bubble")):
        values = [r[key] for r in rows]
        ax.barh(labels, values, left=left, color=COLORS[kind], label=LABELS[kind])
        left = [a + b for a, b in zip(left, values)]
    ax.set(xlabel="µs", title=modelled(title))
    ax.invert_yaxis()
    legend_outside(ax)
    return ax
