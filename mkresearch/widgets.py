"""Views of a timeline: a Gantt chart of DMA lanes against compute, VMEM occupancy, a control bar.

Every view is a thin layer over a pure data function, which the tests cover:

    what_if(log, chip, batch, n_buffers, base_batch)  -> Timeline   (the control bar's data)
    gantt_rows(timeline, measured)                   -> list of bars
    vmem_steps(timeline)                             -> (times_us, bytes)
    bubble_rows(timeline) / summary_rows({label: timeline})

`plot_gantt`, `plot_vmem` and `timeline_figure` draw them with matplotlib (a static figure: what a
notebook keeps when it is rendered without a kernel, e.g. on GitHub). `TimelineExplorer` is the
ipywidgets view: dropdowns for chip (v5e, v6e, v5p, TPU7x), batch size and buffer count redraw the
figure from the same recorded log. It renders in JupyterLab and Colab; `show()` falls back to the
static figure where ipywidgets is missing or there is no kernel to talk to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mkresearch import timeline as tl

CHIP_CHOICES = ("v5e", "v6e", "v5p", "tpu7x")
BATCH_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
BUFFER_CHOICES = (1, 2, 3)
_COLORS = {"dma": "#4C72B0", "compute": "#DD8452", "measured": "#55A868"}
_BUBBLE_COLORS = {"dma_wait": "#C44E52", "idle": "#BBBBBB"}
_LEGEND = {"dma": "DMA moving bytes", "compute": "compute phase",
           "dma_wait": "bubble: compute waits on DMA", "idle": "bubble: nothing runs",
           "measured": "measured (trace)"}


# ---- data functions (pure) -------------------------------------------------------------------
def what_if(log: Any, chip: str | tl.TimelineChip = "tpu7x", *, batch: int | None = None,
            n_buffers: int | None = None, base_batch: int = 1,
            vpu_phases: Sequence[str] = ()) -> tl.Timeline:
    """The timeline of a recorded `log` on `chip`, replayed at `batch` with `n_buffers` slots.

    `base_batch` is the batch the log was recorded at: FLOPs scale by batch / base_batch (weight
    bytes do not change). None keeps the recorded batch / buffering.
    """
    if batch is not None and (not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch={batch!r} is invalid: an int >= 1")
    if not isinstance(base_batch, int) or base_batch < 1:
        raise ValueError(f"base_batch={base_batch!r} is invalid: an int >= 1")
    events = tl.events_of(log)
    if n_buffers is not None:
        events = tl.rebuffer(events, n_buffers)
    if batch is not None and batch != base_batch:
        events = tl.scale_batch(events, batch / base_batch)
    return tl.simulate(events, chip, vpu_phases=vpu_phases)


def gantt_rows(timeline: tl.Timeline, measured: Sequence[tl.Span] = ()) -> list[dict]:
    """One dict per bar: lane, row (0 = top), name, kind, start_us, end_us. DMA lanes first, then
    compute, then bubbles, then one row per measured scope (spans from a trace, see profiling)."""
    lanes = timeline.lanes + ["bubbles"]
    # measured spans get one row per scope name (their own lane is a profiler thread)
    measured_lanes = list(dict.fromkeys(f"measured: {s.name}" for s in measured))
    order = {lane: i for i, lane in enumerate(lanes + measured_lanes)}
    rows = [{"lane": s.lane, "row": order[s.lane], "name": s.name, "kind": s.kind,
             "start_us": s.start * 1e6, "end_us": s.end * 1e6} for s in timeline.spans]
    rows += [{"lane": "bubbles", "row": order["bubbles"], "name": b.cause, "kind": b.cause,
              "start_us": b.start * 1e6, "end_us": b.end * 1e6} for b in timeline.bubbles]
    rows += [{"lane": f"measured: {s.name}", "row": order[f"measured: {s.name}"], "name": s.name,
              "kind": "measured", "start_us": s.start * 1e6, "end_us": s.end * 1e6}
             for s in measured]
    return rows


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


def bubble_rows(timeline: tl.Timeline) -> list[dict]:
    """Bubble time by cause, in µs and as a fraction of the step."""
    total = timeline.total_s or 1.0
    return [{"cause": cause, "us": seconds * 1e6, "fraction": seconds / total}
            for cause, seconds in timeline.bubbles_by_cause().items()]


def summary_rows(timelines: Mapping[str, tl.Timeline]) -> list[dict]:
    """One row per labelled timeline: step time, HBM floor, roofline fraction, bubbles, VMEM."""
    return [{"label": label, **timeline.summary()} for label, timeline in timelines.items()]


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str],
                 digits: int = 3) -> str:
    """Rows as a fixed-width text table (numbers rounded): stable output for checked cells."""
    def cell(value):
        if isinstance(value, float):  # big numbers in full, small ones to `digits` figures
            return f"{value:.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"
        return str(value)

    table = [list(columns)] + [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in table)


# ---- static figures (matplotlib) -------------------------------------------------------------
def plot_gantt(timeline: tl.Timeline, ax=None, measured: Sequence[tl.Span] = (),
               title: str | None = None):
    """Bars per lane against time (µs): DMA engines, compute, bubbles, measured spans."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3))
    rows = gantt_rows(timeline, measured)
    labels: dict[int, str] = {}
    for r in rows:
        color = _COLORS.get(r["kind"]) or _BUBBLE_COLORS.get(r["kind"], "#888888")
        ax.broken_barh([(r["start_us"], r["end_us"] - r["start_us"])], (r["row"] - 0.4, 0.8),
                       facecolors=color, edgecolors="white", linewidth=0.3,
                       hatch="//" if r["kind"] == "measured" else None)
        labels[r["row"]] = r["lane"]
    ax.set_yticks(sorted(labels), [labels[i] for i in sorted(labels)])
    kinds = dict.fromkeys(r["kind"] for r in rows)
    handles = [Patch(facecolor=_COLORS.get(k) or _BUBBLE_COLORS.get(k, "#888888"),
                     label=_LEGEND.get(k, k)) for k in kinds]
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small",
                  frameon=False)
    ax.invert_yaxis()
    ax.set_xlabel("time (µs)")
    end = max(timeline.total_s * 1e6, max((r["end_us"] for r in rows), default=0))
    if end > 0:
        ax.set_xlim(0, end)
    ax.set_title(title or f"{timeline.chip.name}: step {timeline.total_s * 1e6:.2f} µs, "
                 f"{timeline.roofline_fraction:.0%} of the HBM roofline")
    return ax


def plot_vmem(timeline: tl.Timeline, ax=None):
    """VMEM bytes in use (MiB) against time, with the chip's VMEM capacity in the title."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2))
    times, values = vmem_steps(timeline)
    ax.step(times, [v / 2**20 for v in values], where="post", color=_COLORS["dma"])
    ax.fill_between(times, [v / 2**20 for v in values], step="post", alpha=0.3,
                    color=_COLORS["dma"])
    ax.set_ylabel("VMEM (MiB)")
    ax.set_xlabel("time (µs)")
    if timeline.total_s > 0:
        ax.set_xlim(0, timeline.total_s * 1e6)
    ax.set_title(f"VMEM in use: peak {timeline.peak_vmem_bytes / 2**20:.2f} MiB of "
                 f"{timeline.chip.vmem_capacity / 2**20:.0f} MiB")
    return ax


def timeline_figure(timeline: tl.Timeline, measured: Sequence[tl.Span] = (),
                    title: str | None = None):
    """Gantt chart over VMEM occupancy, one figure, returned and not shown: a notebook cell that
    ends with it (or `display(fig)`) shows it once. It is made by pyplot, which sets up the
    notebook's figure display, and closed there at once so that pyplot does not show it again."""
    import matplotlib.pyplot as plt

    n_lanes = len(timeline.lanes) + 1 + len({s.name for s in measured})
    fig, (gantt, vmem) = plt.subplots(2, 1, figsize=(10, 1.2 + 0.45 * n_lanes + 1.8),
                                      height_ratios=[max(2, n_lanes), 2], sharex=True,
                                      layout="constrained")
    plt.close(fig)
    plot_vmem(timeline, vmem)
    plot_gantt(timeline, gantt, measured, title)  # last: its x range (measured spans too) wins
    gantt.set_xlabel("")
    return fig


# ---- the interactive view --------------------------------------------------------------------
def widgets_available() -> bool:
    """True if ipywidgets imports and an IPython kernel is there to render widgets."""
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class TimelineExplorer:
    """A control bar (chip, batch, buffers) over a Gantt + VMEM figure of one recorded log.

    `explorer.widget` is the ipywidgets box; displaying the explorer displays it. `timeline` is
    the current data; `redraw()` recomputes it from the log (the dropdowns call it).
    """

    def __init__(self, log: Any, *, chip: str = "tpu7x", batch: int = 1, n_buffers: int | None = None,
                 base_batch: int = 1, chips: Sequence[str] = CHIP_CHOICES,
                 batches: Sequence[int] = BATCH_CHOICES, buffers: Sequence[int] = BUFFER_CHOICES,
                 measured: Sequence[tl.Span] = (), vpu_phases: Sequence[str] = ()):
        import ipywidgets as w

        for name, value, choices in (("chip", chip, chips), ("batch", batch, batches)):
            if value not in choices:
                raise ValueError(f"{name}={value!r} is invalid: one of {tuple(choices)}")
        if n_buffers is not None and n_buffers not in buffers:
            raise ValueError(f"n_buffers={n_buffers!r} is invalid: None (as recorded) or one of "
                             f"{tuple(buffers)}")
        self.events = tl.events_of(log)
        self.base_batch, self.measured, self.vpu_phases = base_batch, tuple(measured), vpu_phases
        self.chip = w.Dropdown(options=list(chips), value=chip, description="chip")
        self.batch = w.Dropdown(options=list(batches), value=batch, description="batch")
        self.buffers = w.Dropdown(options=[("as recorded", None)] + [(str(b), b) for b in buffers],
                                  value=n_buffers, description="buffers")
        self.summary = w.HTML()
        self.output = w.Output()
        for control in (self.chip, self.batch, self.buffers):
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([self.chip, self.batch, self.buffers]), self.summary,
                              self.output])
        self.timeline: tl.Timeline | None = None
        self.figure = None
        self.redraw()

    def compute(self) -> tl.Timeline:
        return what_if(self.events, self.chip.value, batch=self.batch.value,
                       n_buffers=self.buffers.value, base_batch=self.base_batch,
                       vpu_phases=self.vpu_phases)

    def redraw(self) -> None:
        self.timeline = self.compute()
        s = self.timeline.summary()
        self.summary.value = (
            f"step <b>{s['total_us']:.2f} µs</b> · HBM floor {s['hbm_floor_us']:.2f} µs · "
            f"<b>{s['roofline_fraction']:.0%}</b> of roofline · bubbles: compute waits on DMA "
            f"{s['bubble_dma_wait_us']:.2f} µs, idle {s['bubble_idle_us']:.2f} µs · "
            f"peak VMEM {s['peak_vmem_bytes'] / 2**20:.2f} MiB")
        self.figure = timeline_figure(self.timeline, self.measured)
        self.output.clear_output(wait=True)
        with self.output:
            _display(self.figure)

    def _ipython_display_(self) -> None:
        _display(self.widget)

    def __repr__(self) -> str:
        return (f"TimelineExplorer(chip={self.chip.value!r}, batch={self.batch.value}, "
                f"buffers={self.buffers.value})")


def _display(obj) -> None:
    try:
        from IPython.display import display
    except ImportError:
        return
    display(obj)


def show(log: Any, **kwargs: Any):
    """The interactive explorer where widgets render, else a static figure of the same data."""
    if widgets_available():
        return TimelineExplorer(log, **kwargs)
    timeline = what_if(log, kwargs.get("chip", "tpu7x"), batch=kwargs.get("batch"),
                       n_buffers=kwargs.get("n_buffers"), base_batch=kwargs.get("base_batch", 1),
                       vpu_phases=kwargs.get("vpu_phases", ()))
    return timeline_figure(timeline, kwargs.get("measured", ()))
