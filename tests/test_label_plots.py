"""No two text labels of a chart overlap, none is cut by the figure's edge, no data label leaves
its axes or sits on a line: every figure `make figures` writes (each function of
`mkresearch.cli.figures.FIGURES`) and the plot functions notebooks draw with, on small recorded or
synthetic data (no kernel runs here)."""

import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure

from mkresearch.cli import figures
from mkresearch.measurement.logs import FIGURE_POSITIONS
from mkresearch.prediction import calibration
from mkresearch.prediction import timeline as tl
from mkresearch.views import label_plots, plots, scale_out_plots, speculative_plots, widgets

FIGURES_DIR = Path(__file__).resolve().parent.parent / "figures"

# The calibration tables' numbers (rounded): computing them takes half a minute
PARTS = ("hbm_floor", "waiting_for_peers", "collective_messages", "compute", "bubble")
RELEASE = [{"batch": b, "published_ms": pub, "predicted_ms": pred,
            "parts_ms": dict(zip(PARTS, parts, strict=True))}
           for b, pub, pred, parts in ((1, 4.02, 3.72, (1.93, 0.15, 1.48, 0.09, 0.08)),
                                       (2, 5.10, 5.10, (2.31, 0.24, 2.38, 0.09, 0.08)),
                                       (4, 7.77, 7.79, (2.99, 0.43, 4.20, 0.09, 0.08)),
                                       (8, 9.25, 12.88, (4.24, 0.62, 7.84, 0.09, 0.08)))]
OURS = [{"batch": b, "published_tok_s": pub, "gb200_tok_s": gb,
         "ours": {"tok_s": built, "parts_ms": dict(zip(PARTS, (1.35, 0.24, 1.83, 0.03, 0.22)))},
         "ours_exact": {"tok_s": exact,
                        "parts_ms": dict(zip(PARTS, (1.35, 0.68, 4.60, 0.04, 0.21)))},
         "ours_release_schedule": {"tok_s": summed,
                                   "parts_ms": dict(zip(PARTS, (1.35, 0.06, 1.55, 0.06, 0.09)))}}
        for b, pub, gb, built, exact, summed in (
            (1, 249, 127, 273, 145, 321), (2, 392, 227, 470, 237, 463),
            (4, 515, 373, 753, 345, 599), (8, 865, 636, 1100, 446, 712))]


def check(fig):
    problems = label_plots.label_problems(fig)
    plt.close(fig)
    assert not problems, "\n".join(problems)


def test_the_check_finds_overlapping_cut_and_misplaced_labels():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="a line")
    ax.set_title("a title")
    assert label_plots.label_problems(fig) == []
    ax.text(0.5, 0.5, "on the line", ha="center", va="center")
    ax.text(0.5, 1.1, "over the title", ha="center", va="bottom")
    ax.set_xlabel("a very long x label " * 6)
    problems = label_plots.label_problems(fig)
    assert "on a line: 'on the line' over 'a line'" in problems
    assert "off its axes: 'over the title'" in problems
    assert any(p.startswith("cut by the figure's edge: axes 0 x-label") for p in problems)
    assert "overlap: axes 0 title 'a title' and axes 0 annotation 'over the title'" in problems
    plt.close(fig)


@pytest.mark.parametrize("name", list(figures.FIGURES))
def test_every_committed_figure_reads(name, tmp_path, monkeypatch):
    """Each registered figure function, its data replaced by recorded numbers or small
    synthetic rows; the figure it saves is checked."""
    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig),
                                                                 save(fig, *a, **k)))
    monkeypatch.setattr(plt, "close", lambda *_: None)  # keep the figure to look at it
    monkeypatch.setattr(plots, "expert_bytes_by_batch", lambda cfg, batches: [
        {"batch": b, "unique": min(16, 4 * b), "choices": 4 * b,
         "expert_bytes": min(16, 4 * b - b // 2) * 104_000} for b in batches])
    monkeypatch.setattr(plots, "record_kv_logs", lambda cfg, positions: {"expanded": None, "latent": None})
    monkeypatch.setattr(plots, "tokens_read", lambda log, cfg, row:
                        -(-(FIGURE_POSITIONS[row] + 1) // 16) * 16)
    monkeypatch.setattr(calibration, "release_table", lambda cfg: RELEASE)
    monkeypatch.setattr(calibration, "ours_table", lambda cfg: OURS)
    shutil.copy(FIGURES_DIR / "decode_bench.json", tmp_path)  # the recorded bench, no run
    figures.write_figure(name, tmp_path)
    assert len(drawn) == 1
    monkeypatch.undo()
    check(drawn[0])


def test_the_bench_figure_of_the_committed_bench():
    from mkresearch.cli.bench import bench_figure

    check(bench_figure(json.loads((FIGURES_DIR / "decode_bench.json").read_text())))


@pytest.fixture
def log():
    return tl.to_records(tl.stream_log(8, 1 << 20, 2e6, 2))


def test_timeline_figures_read(log):
    timeline = widgets.what_if(log, "v5e")
    check(widgets.timeline_figure(timeline))
    long = tl.simulate(tl.stream_log(200, 1 << 20, 2e6, 2), "tpu7x")
    check(widgets.timeline_figure(long, window_us=(10.0, 40.0)))
    check(widgets.plot_time_split({"kda": timeline, "mla": widgets.what_if(log, "tpu7x"),
                                   "moe": widgets.what_if(log, "v5p")}).figure)


def test_timeline_explorer_figure_reads(log):
    explorer = widgets.TimelineExplorer(log, chip="v5e", batch=8, n_buffers=3)
    check(explorer.figure)


def test_scale_out_figure_and_parts_read():
    check(scale_out_plots.scale_out_figure(RELEASE, OURS))


def test_step_bounds_figure_reads():
    rows = [{"batch": 1, "side": side, "resource": resource, "step_ms": step - saved,
             "saved_ms": saved}
            for side, step in (("ours (experts 8 ways, 4 slots)", 3.5),
                               ("the release (modelled)", 4.11))
            for resource, saved in (("as modelled", 0.0), ("weight and expert reads", 0.13),
                                    ("the MXU", 0.75), ("the vector unit", 0.0),
                                    ("collective latency", 1.43), ("link bandwidth", 0.3))]
    check(scale_out_plots.step_bounds_figure(rows))


@pytest.mark.slow
def test_scale_out_explorer_figure_reads():
    """The explorer's figure of a real (8-rank, cached) prediction: the ranks' bars and the parts."""
    explorer = scale_out_plots.ScaleOutExplorer(batch=1, n_ranks=8, layout="release")
    check(explorer.figure)


def test_acceptance_figure_reads():
    points = [{"acceptance": a, "k7_tokens_per_s": 100 + 60 * a, "exact_tokens_per_s": 110 + 70 * a,
               "published_tok_s": {3: 350, 6: 709}.get(a)} for a in range(1, 9)]
    fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
    speculative_plots.plot_acceptance(points, ax, plain_tok_s=120.0,
                                      title="kimi-k3 on 32 ranks: tok/s against acceptance")
    check(fig)


def test_rank_timelines_figure_reads():
    """Notebook 08's per-rank chart, of a synthetic 4-rank log: per rank a weight block, its
    compute, an all-gather to the next rank."""
    from mkresearch.kernels.base import dma

    from mkresearch.views import ranks_plots

    events = []
    for rank in range(4):
        peer = (rank + 1) % 4
        for block in range(3):
            events += [dma.Event("dma_start", "mla.w_o", "hbm", "vmem", 1 << 20, rank=rank),
                       dma.Event("dma_wait", "mla.w_o", "hbm", "vmem", 1 << 20, rank=rank),
                       dma.Event("phase_start", "mla.w_o/matmul", flops=2e7, rank=rank),
                       dma.Event("phase_end", "mla.w_o/matmul", flops=2e7, rank=rank)]
        send = {"src": "vmem", "dst": "vmem", "nbytes": 1 << 16, "rank": rank,
                "src_rank": rank, "dst_rank": peer}
        events += [dma.Event("dma_start", "mla.w_o/all_gather", **send),
                   dma.Event("dma_wait", "mla.w_o/all_gather", **send)]
    log = dma.DmaLog(events)
    fig = ranks_plots.plot_rank_timelines(
        log, ranks_plots.rank_timelines(log, "tpu7x"),
        title="kimi-k3-mini, 1 layer, on 4 ranks, B=2: one step per rank on tpu7x (timeline "
              "model, not measured)")
    check(fig)
