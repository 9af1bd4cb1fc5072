"""Pictures of the scale-out prediction: figures/scale_out.png, the ranks' timeline, and the
`ScaleOutExplorer` widget (batch, ranks, layout, schedule, link bandwidth and latency).

Data functions (pure, tested): `ranks_rows` (the bars of a multi-rank timeline), `figure_rows`
(tok/s per batch per series), `parts_rows` (the decomposition of one step per series); the
figures of `prediction.step_bounds`, `collective_plan.overlap` and `replication_floor` draw their
rows as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mkresearch.hardware import interconnect as links
from mkresearch.model.config import get_config
from mkresearch.prediction import calibration, scale_out
from mkresearch.prediction.timeline import merge_intervals
from mkresearch.prediction.timeline_ranks import PARTS, RanksTimeline
from mkresearch.views.timeline_plots import modelled
from mkresearch.views.widgets import FigureExplorer

KINDS = ("hbm", "waiting", "collective")  # a rank's bars: HBM moving, waiting for peers, messages
COLORS = {"hbm": "#4C72B0", "waiting": "#DD8452", "collective": "#C44E52",
          "hbm_floor": "#4C72B0", "waiting_for_peers": "#DD8452",
          "collective_messages": "#C44E52", "compute": "#55A868", "bubble": "#8C8C8C"}
PART_LABELS = {"hbm_floor": "HBM floor", "waiting_for_peers": "waiting for peers",
               "collective_messages": "collective messages", "compute": "compute (HBM idle)",
               "bubble": "bubbles"}


def ranks_rows(ranks: RanksTimeline, window_us: tuple[float, float] | None = None) -> list[dict]:
    """One row per bar: rank, kind (KINDS), start_us, end_us; clipped to the window (µs)."""
    lo, hi = window_us if window_us is not None else (0.0, ranks.total_s * 1e6)
    rows = []
    for rank, tl in zip(ranks.ranks, ranks.timelines, strict=True):
        bars = [("hbm", a, b) for a, b in merge_intervals((s.start, s.end) for s in tl.spans
                                                  if s.kind == "dma")]
        for run in ranks.collectives:
            if rank in run.group:
                bars += [("waiting", run.arrivals[run.group.index(rank)], run.start),
                         ("collective", run.start, run.end)]
        for kind, a, b in bars:
            a, b = max(a * 1e6, lo), min(b * 1e6, hi)
            if b > a:
                rows.append({"rank": rank, "kind": kind, "start_us": a, "end_us": b})
    return rows


def plot_ranks(ranks: RanksTimeline, ax, window_us: tuple[float, float] | None = None) -> None:
    rows = ranks_rows(ranks, window_us)
    for y, rank in enumerate(ranks.ranks):
        for kind in KINDS:
            bars = [(r["start_us"], r["end_us"] - r["start_us"]) for r in rows
                    if r["rank"] == rank and r["kind"] == kind]
            # HBM on the upper half of a rank's row, collectives on the lower: they overlap
            # where the ring streams weights while the program waits in a collective
            ax.broken_barh(bars, (y, 0.4) if kind == "hbm" else (y - 0.4, 0.4), color=COLORS[kind],
                           label={"hbm": "HBM moving weights", "waiting": "waiting for peers",
                                  "collective": "collective messages"}[kind] if y == 0 else None)
    ax.set_yticks(range(len(ranks.ranks)), [f"rank {r}" for r in ranks.ranks])
    ax.set_xlabel("µs from the start of the step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def parts_rows(predictions: dict[str, dict]) -> list[dict]:
    """label -> a prediction (`scale_out.predict`) as rows: label, part, ms."""
    return [{"label": label, "part": part, "ms": p["parts_s"][part] * 1e3}
            for label, p in predictions.items() for part in PARTS]


def plot_parts(predictions: dict[str, dict], ax, published_ms: float | None = None) -> None:
    rows = parts_rows(predictions)
    labels = list(predictions)
    bottoms = [0.0] * len(labels)
    for part in PARTS:
        values = [next(r["ms"] for r in rows if r["label"] == lab and r["part"] == part)
                  for lab in labels]
        ax.barh(labels, values, left=bottoms, color=COLORS[part], label=PART_LABELS[part])
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    if published_ms:
        ax.axvline(published_ms, color="black", ls="--", label=f"published {published_ms:.2f} ms")
    ax.set_xlabel("ms per step (the slowest rank)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def figure_rows(release: Sequence[dict], ours: Sequence[dict]) -> list[dict]:
    """tok/s per batch: published TPU7x and 16x GB200, and the four predictions."""
    rows = []
    for rel, our in zip(release, ours, strict=True):
        b = rel["batch"]
        rows += [{"series": "published, 16 TPU7x (the release)", "batch": b,
                  "tok_s": our["published_tok_s"]},
                 {"series": "published, 16x GB200", "batch": b, "tok_s": our["gb200_tok_s"]},
                 {"series": "predicted: the release's layout + schedule", "batch": b,
                  "tok_s": b / rel["predicted_ms"] * 1e3},
                 {"series": "predicted: ours, partial-sum collectives", "batch": b,
                  "tok_s": our["ours"]["tok_s"]},
                 {"series": "predicted: ours, exact (bit-equal) collectives", "batch": b,
                  "tok_s": our["ours_exact"]["tok_s"]},
                 {"series": "predicted: our layout + the release's schedule", "batch": b,
                  "tok_s": our["ours_release_schedule"]["tok_s"]}]
    return rows


def scale_out_figure(release: Sequence[dict], ours: Sequence[dict]):
    """Predicted vs published tok/s per batch, and the B = 1 parts (`calibration` tables)."""
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_parts) = plt.subplots(1, 2, figsize=(14, 4.8), layout="constrained")
    rows = figure_rows(release, ours)
    # published: wide pale lines with open squares, drawn first; predicted: dashed lines with
    # small dots on top. Where a prediction equals the published number (the release at
    # B = 2 and 4) both still show: the dot inside the square, the dashes over the wide line.
    styles = {"published": {"ls": "-", "marker": "s", "lw": 5, "alpha": 0.45, "ms": 11,
                            "markerfacecolor": "none", "markeredgewidth": 2, "zorder": 2},
              "predicted": {"ls": "--", "marker": "o", "lw": 1.5, "ms": 5, "zorder": 3}}
    for series in dict.fromkeys(r["series"] for r in rows):
        points = [r for r in rows if r["series"] == series]
        ax_rate.plot([p["batch"] for p in points], [p["tok_s"] for p in points], label=series,
                     **styles[series.split(",")[0].split(":")[0]])
    batches = sorted({r["batch"] for r in rows})
    ax_rate.set_xscale("log", base=2)
    ax_rate.set_xticks(batches, [str(b) for b in batches])  # 1, 2, 4, 8 as in every figure
    ax_rate.minorticks_off()
    ax_rate.set_xlabel("batch (sequences)")
    ax_rate.set_ylabel("tokens/s")
    ax_rate.set_title("Kimi K3 decode, predicted vs published: 16 TPU7x chips\n"
                      "= 32 ranks (one per core, 2 cores per chip)", fontsize=10)
    ax_rate.legend(fontsize=8)

    def seconds(parts_ms: dict) -> dict:
        return {"parts_s": {k: v / 1e3 for k, v in parts_ms.items()}}

    one = {"release (layout + schedule)": seconds(release[0]["parts_ms"]),
           "ours, partial sums": seconds(ours[0]["ours"]["parts_ms"]),
           "ours, exact": seconds(ours[0]["ours_exact"]["parts_ms"]),
           "our layout, release schedule": seconds(ours[0]["ours_release_schedule"]["parts_ms"])}
    plot_parts(one, ax_parts, release[0]["published_ms"])
    ax_parts.set_title(modelled("B = 1: where the step goes (the slowest of 32 ranks)"),
                       fontsize=10)
    return fig


def plot_scale_out(path) -> None:
    """figures/scale_out.png: `scale_out_figure` of the calibration tables."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = get_config("kimi-k3")
    fig = scale_out_figure(calibration.release_table(cfg), calibration.ours_table(cfg))
    fig.savefig(path, dpi=110)
    plt.close(fig)


class ScaleOutExplorer(FigureExplorer):
    """A column of controls (batch, ranks, layout, schedule, ICI bandwidth and latency) beside
    the multi-rank timeline of kimi-k3 and its parts, a figure titled with the settings it
    shows, modelled (displayed as every `widgets.FigureExplorer` is; both fit a 1400 x 900
    window). `prediction` is the current data."""

    FIGSIZE = (8.4, 5.0)  # inches at 100 dpi: beside the controls in a 1400-pixel window

    def __init__(self, *, batch: int = 1, n_ranks: int = 32, layout: str = "ours",
                 schedule: str | None = None, window_us: tuple[float, float] = (0.0, 200.0)):
        self.cfg = get_config("kimi-k3")
        self.window_us = window_us
        base = links.interconnect("tpu7x")
        self.batch = _dropdown([1, 2, 4, 8], batch, "batch")
        self.ranks = _dropdown([8, 16, 32], n_ranks, "ranks")
        self.layout = _dropdown(["ours", "release"], layout, "layout")
        self.schedule = _dropdown(list(scale_out.SCHEDULES), schedule or layout, "schedule")
        link = round(base.ici_bandwidth / 1e9)  # the measured per-link figure, x0.5 .. x2
        self.bandwidth = _dropdown([link / 4, link / 2, link, 2 * link], link, "ICI GB/s")
        latency = round(base.ici_latency * 1e6, 1)
        self.latency = _dropdown([0.5, 1.0, latency, 5.0], latency, "ICI µs")
        self._build([[self.batch, self.ranks, self.layout],
                     [self.schedule, self.bandwidth, self.latency]], beside=True)

    def compute(self) -> dict:
        inter = links.interconnect("tpu7x", ici_bandwidth=self.bandwidth.value * 1e9,
                                   ici_latency=self.latency.value * 1e-6)
        return scale_out.predict(self.cfg, self.ranks.value, self.layout.value, self.batch.value,
                                 schedule=self.schedule.value, interconnect=inter,
                                 keep_timeline=True)

    def update(self) -> None:
        self.prediction = self.compute()

    def settings(self) -> str:
        """The settings the figure shows, as its title names them."""
        return (f"B = {self.batch.value}, {self.ranks.value} ranks, {self.layout.value} layout, "
                f"{self.schedule.value} schedule, ICI {self.bandwidth.value:g} GB/s and "
                f"{self.latency.value:g} µs")

    def summary_line(self) -> str:
        p = self.prediction
        parts = ", ".join(f"{PART_LABELS[k]} {v * 1e3:.2f}" for k, v in p["parts_s"].items())
        return (f"{self.settings()}: {p['step_s'] * 1e3:.2f} ms per step, "
                f"{p['tokens_per_s']:.0f} tok/s (ms: {parts}); {p['collectives_per_rank']} "
                "collectives per rank")

    def draw(self):
        import matplotlib.pyplot as plt

        fig, (ax_ranks, ax_parts) = plt.subplots(2, 1, figsize=self.FIGSIZE,
                                                 gridspec_kw={"height_ratios": [3, 1]},
                                                 layout="constrained")
        plt.close(fig)  # shown through the explorer's outputs, never by pyplot
        p = self.prediction
        fig.suptitle(f"{self.settings()}: {p['step_s'] * 1e3:.2f} ms per step (modelled)",
                     fontsize=10)
        plot_ranks(p["timeline"], ax_ranks, self.window_us)
        ax_ranks.set_title(f"the first {self.window_us[1]:.0f} µs of the step, one rank per "
                           "expert-parallel group", fontsize=10)
        published = p.get("published_step_s")
        plot_parts({"this prediction": p}, ax_parts, published * 1e3 if published else None)
        return fig

    def __repr__(self) -> str:
        return (f"ScaleOutExplorer(batch={self.batch.value}, n_ranks={self.ranks.value}, "
                f"layout={self.layout.value!r}, schedule={self.schedule.value!r})")


def _dropdown(options: Sequence[Any], value: Any, description: str):
    """A dropdown as narrow as the explorer's column of controls."""
    import ipywidgets as w

    return w.Dropdown(options=list(options), value=value, description=description,
                      layout=w.Layout(width=f"{FigureExplorer.CONTROLS_WIDTH_PX - 10}px"),
                      style={"description_width": "70px"})


def explorer(**kwargs: Any):
    """The explorer where ipywidgets is installed; it needs a kernel to redraw."""
    return ScaleOutExplorer(**kwargs)


def overlap_figure(overlaps: Sequence[dict]):
    """One panel per `collective_plan.overlap` result: HBM streaming (blue) above the
    collectives outstanding (red) in its window, titled with the share of outstanding time
    HBM stays busy over the whole step."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(overlaps), 1, figsize=(12, 1.9 * len(overlaps) + 0.6),
                             layout="constrained", squeeze=False)
    for ax, data in zip(axes[:, 0], overlaps, strict=True):
        lo, hi = data["window_us"]
        lanes = {"HBM": (1, "tab:blue"), "collective": (0, "tab:red")}
        for r in data["rows"]:
            y, color = lanes[r["lane"]]
            start, end = max(r["start_us"], lo), min(r["end_us"], hi)
            ax.broken_barh([(start - lo, end - start)], (y - 0.35, 0.7), color=color, alpha=0.8)
        ax.set_yticks([1, 0], ["HBM streams", "collective outstanding"])
        ax.set_xlim(0, hi - lo)
        ax.set_xlabel(f"µs after {lo:.0f} µs into the step (rank 0)")
        ax.set_title(f"{data['mode']}, B = {data['batch']}: modelled step {data['step_ms']:.2f} "
                     f"ms; HBM busy {data['hbm_busy_fraction']:.0%} of the "
                     f"{data['outstanding_ms']:.2f} ms a collective is outstanding", fontsize=10)
    return fig


def log_overlap_figure(rows: Sequence[dict], title: str):
    """The recorded log's overlap (`measurement.collective_overlap.overlap_rows`): spans with a
    weight DMA in flight (blue) above each collective from its first remote copy to its last
    wait (red), on the axis of the rank's events in program order."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 2.2), layout="constrained")
    lanes = {"HBM": (1, "tab:blue"), "collective": (0, "tab:red")}
    for r in rows:
        y, color = lanes[r["lane"]]
        ax.broken_barh([(r["start"], max(r["end"] - r["start"], 1))], (y - 0.35, 0.7),
                       color=color, alpha=0.8)
    ax.set_yticks([1, 0], ["weight DMA in flight", "collective outstanding"])
    ax.set_xlabel("the rank's DMA-log events, in program order")
    ax.set_title(title, fontsize=10)
    return fig


def frontier_figure(fronts: Sequence[dict], *, max_collectives: int | None = None,
                    max_floor_ms: float | None = None):
    """Each `replication_floor.frontier`: collectives per rank per step (x) against the HBM floor
    of the bytes per rank (y), the step as built ringed; a target (at most `max_collectives`,
    at most `max_floor_ms`) shaded where given: empty when no design reaches it."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), layout="constrained")
    for front in fronts:
        xs = [r["collectives"] for r in front["rows"]]
        ys = [r["floor_ms"] for r in front["rows"]]
        line, = ax.plot(xs, ys, marker="o", label=front["model"])
        ax.plot(xs[:1], ys[:1], marker="o", markersize=13, fillstyle="none",
                color=line.get_color())
    if max_collectives is not None and max_floor_ms is not None:
        ax.fill_between([0, max_collectives], 0, max_floor_ms, color="tab:green", alpha=0.15,
                        label=f"≤ {max_collectives} collectives and ≤ {max_floor_ms:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("collectives per rank per step (every one counted)")
    ax.set_ylabel("HBM floor of the bytes per rank (ms, log)")
    ax.set_title("fewer collectives cost bytes: each point avoids the next cheapest collective "
                 "(ringed: the step as built)", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def step_bounds_figure(rows: Sequence[dict]):
    """`prediction.step_bounds`'s rows at one batch: per resource, the ms each side's step loses
    when that resource alone is 10x faster, ours and the release's side by side."""
    import matplotlib.pyplot as plt

    sides = list(dict.fromkeys(r["side"] for r in rows))
    resources = [r["resource"] for r in rows if r["side"] == sides[0]][1:]  # not "as modelled"
    fig, ax = plt.subplots(figsize=(9, 3.6), layout="constrained")
    height = 0.8 / len(sides)
    for i, side in enumerate(sides):
        saved = {r["resource"]: r["saved_ms"] for r in rows if r["side"] == side}
        step = next(r["step_ms"] for r in rows if r["side"] == side)
        ys = [len(resources) - 1 - j + (len(sides) / 2 - i - 0.5) * height
              for j in range(len(resources))]
        ax.barh(ys, [saved[k] for k in resources], height=height * 0.9,
                label=f"{side}: {step:.2f} ms", color=("#4C72B0", "#C44E52")[i % 2])
    ax.set_yticks(range(len(resources)), resources[::-1])
    ax.set_xlabel("ms the step loses with that resource alone 10x faster (modelled)")
    batch, sequences = rows[0]["batch"], rows[0].get("sequences", rows[0]["batch"])
    ax.set_title("What the step waits for, " + (f"B = {batch}" if sequences == batch else
                 f"the verify step of B = {sequences} ({batch} rows)"), fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    return fig
