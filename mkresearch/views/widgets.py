"""Views of a timeline: a Gantt chart of DMA lanes against compute, VMEM occupancy, a control bar.

Every view is a thin layer over a pure data function, which the tests cover:

    what_if(log, chip, batch, n_buffers, base_batch)  -> Timeline   (the control bar's data)
    gantt_rows(timeline, measured)                   -> list of bars, one per span
    gantt_bars(timeline, measured, window, pixel)    -> what plot_gantt draws: one group per lane
                                                        and kind, sub-pixel gaps merged
    vmem_steps(timeline)                             -> (times_us, bytes)
    idle_rows(timeline) / summary_rows({label: timeline}) / time_split_rows / summary_line
    format_table(rows, columns) / TableView(rows, columns): rows as text, or as an HTML table

The static figures (`plot_gantt`, `plot_vmem`, `timeline_figure`, `plot_time_split`) live in
`mkresearch.views.timeline_plots` and are re-exported here. `TimelineExplorer` is the ipywidgets view:
dropdowns for chip (v5e, v6e, v5p, TPU7x), batch size and buffer count (and a time window for
long timelines) redraw the figure from the same recorded log, titled with those settings. Like
every explorer (`FigureExplorer`, shared with `scale_out_plots.ScaleOutExplorer`) it leaves the
figure and its summary as static outputs (what GitHub, nbviewer, an HTML export, an untrusted
or reopened notebook show), then the live widget, which hides them and redraws its own figure
in place above (or beside) the controls. `show()` falls back to the static figure where ipywidgets is
missing or there is no kernel to talk to.

The compute unit's idle time has two causes (`mkresearch.prediction.timeline.Idle`): "compute idle: HBM
busy" (a DMA moves bytes meanwhile: what a bandwidth-bound step looks like, not waste) and
"bubble: nothing moves" (latency, issue gaps: waste). Both are drawn, labelled and summed apart.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from typing import Any

from mkresearch.prediction import timeline as tl
from mkresearch.views.timeline_plots import (  # noqa: F401 - the static views, re-exported
    COLORS,
    IDLE_LANES,
    LABELS,
    MIN_OPACITY,
    gantt_bars,
    gantt_lanes,
    gantt_rows,
    legend_outside,
    modelled,
    plot_gantt,
    plot_time_split,
    plot_vmem,
    time_split_rows,
    timeline_end_us,
    timeline_figure,
    vmem_steps,
)

CHIP_CHOICES = ("v5e", "v6e", "v5p", "tpu7x")
BATCH_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
BUFFER_CHOICES = (1, 2, 3)
AS_RECORDED = "as recorded"  # the buffers dropdown's first option: the log's own buffering
ZOOM_MIN_SPANS = 50  # from this many spans on, bars get a few pixels wide: a time-window slider


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


def idle_rows(timeline: tl.Timeline) -> list[dict]:
    """The compute unit's idle time by cause: label, µs and fraction of the step."""
    return [{"cause": cause, "label": LABELS[cause], "us": seconds * 1e6,
             "fraction": timeline.step_fraction(seconds)}
            for cause, seconds in timeline.idle_by_cause().items()]


def summary_rows(timelines: Mapping[str, tl.Timeline]) -> list[dict]:
    """One row per labelled timeline: step time, HBM floor, roofline fraction, compute idle by
    cause (µs and fraction of the step), VMEM."""
    return [{"label": label, **timeline.summary()} for label, timeline in timelines.items()]


def summary_line(timeline: tl.Timeline) -> str:
    """One line of headline numbers (the control bar shows it above the figure)."""
    s = timeline.summary()
    return (f"step {s['total_us']:.2f} µs · HBM floor {s['hbm_floor_us']:.2f} µs · "
            f"{s['roofline_fraction']:.0%} of roofline · {LABELS['hbm_busy']} "
            f"{s['idle_hbm_busy_fraction']:.0%} of the step · {LABELS['bubble']} "
            f"{s['bubble_fraction']:.0%} · peak VMEM {s['peak_vmem_bytes'] / 2**20:.2f} MiB")


def table_cell(value: Any, digits: int = 3) -> str:
    """One cell of a table: big numbers in full, small ones to `digits` figures."""
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str],
                 digits: int = 3) -> str:
    """Rows as a fixed-width text table (numbers rounded): stable output for checked cells."""
    table = [list(columns)] + [[table_cell(row[c], digits) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in table)


class TableView:
    """Rows shown as a compact HTML table in a notebook, as `format_table`'s text elsewhere
    (print, repr, an HTML export's plain-text form). Numbers are right-aligned and never wrap
    (align="right"); prose columns wrap inside their cell (align="left"). `html_cell` turns a
    cell's text into HTML (default: escaped); `folded`, a line the reader clicks to unfold the
    table (a long one), None to show it open."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *,
                 digits: int = 3, align: str = "right", html_cell: Any = None,
                 folded: str | None = None):
        if align not in ("left", "right"):
            raise ValueError(f"align={align!r} is invalid: 'left' or 'right'")
        self.rows, self.columns, self.digits, self.align = list(rows), list(columns), digits, align
        self.html_cell, self.folded = html_cell or html.escape, folded

    def cells(self) -> list[list[str]]:
        """The table's text, header first (the data the HTML and the text are drawn from)."""
        return [list(self.columns)] + [[table_cell(row[c], self.digits) for c in self.columns]
                                       for row in self.rows]

    def __str__(self) -> str:
        if self.align == "right":
            return format_table(self.rows, self.columns, self.digits)
        table = self.cells()
        widths = [max(len(r[i]) for r in table) for i in range(len(self.columns))]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        wrap = "normal" if self.align == "left" else "nowrap"
        style = f"text-align:{self.align};white-space:{wrap};padding:1px 8px;vertical-align:top"
        header, *body = self.cells()
        head = "".join(f'<th style="{style}">{html.escape(c)}</th>' for c in header)
        rows = "".join("<tr>" + "".join(f'<td style="{style}">{self.html_cell(c)}</td>'
                                        for c in row) + "</tr>" for row in body)
        table = (f'<table style="border-collapse:collapse;font-size:12px"><thead><tr>{head}'
                 f"</tr></thead><tbody>{rows}</tbody></table>")
        if self.folded is None:
            return table
        return f"<details><summary>{html.escape(self.folded)}</summary>{table}</details>"


def png_bundle(fig, text: str) -> dict[str, str]:
    """A figure as a display bundle for `display(bundle, raw=True)`: its PNG (base64), the same
    PNG as an HTML <img> whose alt text is `text` (JupyterLab and an HTML export pick the HTML,
    so the image is described; nbconvert gives a bare PNG no alt text), and `text` as the
    plain-text form. Saved at the figure's own size, not cropped to its contents, so each
    redraw of an explorer has the same pixel size and the controls under it stay put."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    png = base64.b64encode(buffer.getvalue()).decode("ascii")
    return {"image/png": png, "text/plain": text,
            "text/html": f'<img src="data:image/png;base64,{png}" alt="{html.escape(text)}">'}


def show_figure(fig, description: str | None = None) -> None:
    """Display a figure as `png_bundle` (its alt text `description`, else its title: an HTML
    export describes the picture) and close it in pyplot, which would otherwise show it again,
    bare, at the end of the cell. What a notebook calls instead of `plt.show()`."""
    import matplotlib.pyplot as plt

    plt.close(fig)
    _display(png_bundle(fig, description or figure_title(fig)), raw=True)


def hide_static_outputs_rule(css_class: str, n_outputs: int) -> str:
    """A style rule hiding the `n_outputs` cell outputs right before the widget carrying
    `css_class` (JupyterLab / Notebook 7 and classic Notebook class names). Only a rendered
    widget puts the rule in the page, so where widgets do not render the static outputs stay."""
    selectors = [f".{area}:has(+ {f'.{area} + ' * skipped}.{area} .{css_class})"
                 for area in ("jp-OutputArea-child", "output_area")
                 for skipped in range(n_outputs)]
    return f"<style>{', '.join(selectors)} {{display: none;}}</style>"


# ---- the interactive views -------------------------------------------------------------------
def widgets_available() -> bool:
    """True if ipywidgets imports and an IPython kernel is there to render widgets."""
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class FigureExplorer:
    """What every explorer shares: a figure above rows of controls (or beside a column of
    them), a summary line under them.

    Displayed, an explorer leaves three outputs: its figure as a static picture, its summary as
    plain text (what GitHub, nbviewer, an HTML export or a reopened notebook show), then the
    widget. The widget holds its own copy of the figure in an output area ABOVE its controls
    (or right of them) and a style rule that hides the two static outputs, so a live notebook
    shows one figure; a redraw replaces the picture in that output area, in place: the controls
    never move. Subclasses build their controls, then call `_build(rows)` (`beside=True`: the
    controls in one column left of the figure, so that a tall figure and its controls fit one
    window), and define `update()` (recompute the data), `draw()` (a Figure whose title names
    the settings shown), `summary_line()`.
    """

    STATIC_OUTPUTS = 2  # the figure and the summary displayed before the widget
    CONTROLS_WIDTH_PX = 230  # the column of controls left of the figure (beside=True)

    def _build(self, control_rows: Sequence[Sequence[Any]], *, beside: bool = False) -> None:
        import ipywidgets as w

        self.summary, self.output = w.HTML(), w.Output()
        if beside:  # the figure takes the room the column leaves, shrunk to it if need be
            column = w.VBox([control for row in control_rows for control in row],
                            layout=w.Layout(flex="0 0 auto", width=f"{self.CONTROLS_WIDTH_PX}px"))
            self.output.layout = w.Layout(flex="1 1 auto", min_width="0")
            parts = [w.HBox([column, self.output], layout=w.Layout(align_items="flex-start"))]
        else:
            parts = [self.output, *(w.HBox(list(row)) for row in control_rows)]
        self.widget = w.VBox([*parts, self.summary])
        self._css_class = f"mkresearch-explorer-{self.widget.model_id}"
        self.widget.add_class(self._css_class)
        self._hide_static = w.HTML(hide_static_outputs_rule(self._css_class, self.STATIC_OUTPUTS))
        self.widget.children += (self._hide_static,)
        for row in control_rows:
            for control in row:
                control.observe(lambda _change: self.redraw(), names="value")
        self.figure = None
        self.redraw()

    def update(self) -> None:
        raise NotImplementedError

    def draw(self):
        raise NotImplementedError

    def summary_line(self) -> str:
        raise NotImplementedError

    def figure_bundle(self) -> dict[str, str]:
        """The figure as a display bundle described by its title and the summary (the summary
        alone where it already starts with the title's settings)."""
        title, summary = figure_title(self.figure), self.summary_line()
        settings = title.split(":")[0]
        return png_bundle(self.figure, summary if summary.startswith(settings)
                          else f"{title}. {summary}")

    def redraw(self) -> None:
        self.update()
        self.summary.value = html.escape(self.summary_line())
        self.figure = self.draw()
        if widgets_available():  # a kernel: the picture goes into the widget's output area
            self.output.clear_output(wait=True)  # the old one stays until the new one arrives
            with self.output:
                _display(self.figure_bundle(), raw=True)

    def _fallback_text(self) -> str:
        return (f"{self!r}: live controls. Run this cell to use them; the figure above is what "
                "they first drew")

    def _ipython_display_(self) -> None:
        _display(self.figure_bundle(), raw=True)
        _display({"text/plain": self.summary_line()}, raw=True)
        bundle = self.widget._repr_mimebundle_()
        bundle["text/plain"] = self._fallback_text()
        _display(bundle, raw=True)


def figure_title(fig) -> str:
    """A figure's title: its suptitle, else its axes' titles joined."""
    if suptitle := fig.get_suptitle():
        return suptitle
    return "; ".join(t for ax in fig.axes if (t := ax.get_title()))


class TimelineExplorer(FigureExplorer):
    """A control bar (chip, batch, buffers, and a time window for long timelines) under a Gantt
    + VMEM figure of one recorded log (see `FigureExplorer` for what is displayed where).
    `timeline` is the current data; `redraw()` recomputes it from the log (the controls call
    it). The figure's title names the chip, batch and buffers it shows, and says the timeline
    is modelled (`timeline.simulate`), not measured.
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
        # a real option for "as recorded": a None value would show as an empty dropdown
        self.buffers = w.Dropdown(options=[AS_RECORDED, *buffers],
                                  value=AS_RECORDED if n_buffers is None else n_buffers,
                                  description="buffers")
        self.window = w.FloatRangeSlider(value=(0.0, 100.0), min=0.0, max=100.0, step=0.5,
                                         description="window %", continuous_update=False,
                                         readout_format=".1f")
        self.timeline: tl.Timeline = self.compute()
        controls = [self.chip, self.batch, self.buffers]
        if len(self.timeline.spans) >= ZOOM_MIN_SPANS:
            controls.append(self.window)
        self._build([controls])

    @property
    def controls(self) -> tuple:
        """The control bar's widgets, left to right."""
        return self.widget.children[1].children

    @property
    def n_buffers(self) -> int | None:
        """The buffers dropdown as `what_if` reads it: None keeps the log's own buffering."""
        return None if self.buffers.value == AS_RECORDED else self.buffers.value

    @property
    def window_us(self) -> tuple[float, float] | None:
        """The time window (µs) the figure shows; None for the whole step."""
        lo, hi = self.window.value
        if (lo, hi) == (self.window.min, self.window.max):
            return None
        end = timeline_end_us(self.timeline, self.measured)
        return lo / 100 * end, max(hi, lo + self.window.step) / 100 * end

    def compute(self) -> tl.Timeline:
        return what_if(self.events, self.chip.value, batch=self.batch.value,
                       n_buffers=self.n_buffers, base_batch=self.base_batch,
                       vpu_phases=self.vpu_phases)

    def update(self) -> None:
        self.timeline = self.compute()

    def settings(self) -> str:
        """The settings the figure shows, as its title names them."""
        return f"{self.chip.value}, batch {self.batch.value}, buffers {self.buffers.label}"

    def draw(self):
        t, window = self.timeline, self.window_us
        title = (f"{self.settings()}: step {t.total_s * 1e6:.2f} µs, "
                 f"{t.roofline_fraction:.0%} of the HBM roofline (modelled)")
        if window is not None:
            title += f" (window {window[0]:.4g}–{window[1]:.4g} µs)"
        return timeline_figure(t, self.measured, title=title, window_us=window)

    def summary_line(self) -> str:
        return f"{self.settings()}: {summary_line(self.timeline)}"

    def __repr__(self) -> str:
        return (f"TimelineExplorer(chip={self.chip.value!r}, batch={self.batch.value}, "
                f"buffers={self.buffers.value!r})")


def _display(obj, **kwargs: Any) -> None:
    try:
        from IPython.display import display
    except ImportError:
        return
    display(obj, **kwargs)


def show(log: Any, **kwargs: Any):
    """The interactive explorer where widgets render, else a static figure of the same data."""
    if widgets_available():
        return TimelineExplorer(log, **kwargs)
    timeline = what_if(log, kwargs.get("chip", "tpu7x"), batch=kwargs.get("batch"),
                       n_buffers=kwargs.get("n_buffers"), base_batch=kwargs.get("base_batch", 1),
                       vpu_phases=kwargs.get("vpu_phases", ()))
    return timeline_figure(timeline, kwargs.get("measured", ()))
