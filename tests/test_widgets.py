"""The widget data functions, the static figures, and the widgets built without a browser."""

import matplotlib

matplotlib.use("Agg")


import pytest

from mkresearch.prediction import timeline as tl
from mkresearch.views import widgets

BLOCK = 1 << 20  # 1 MiB blocks


@pytest.fixture
def log():
    """A two-buffer stream of 8 blocks, as JSON-like records (what a notebook would save)."""
    return tl.to_records(tl.stream_log(8, BLOCK, 2e6, 2))


@pytest.fixture(scope="module")
def long_timeline():
    """6500 blocks: 13,000 spans, as many as notebook 07's megakernel at kimi-k3-rank shapes."""
    return tl.simulate(tl.stream_log(6500, BLOCK, 2e6, 2), "tpu7x")


def test_what_if_defaults_to_the_recorded_log(log):
    assert widgets.what_if(log, "v5e") == tl.simulate(log, "v5e")


def test_what_if_replays_buffers_and_batch(log):
    three = widgets.what_if(log, "tpu7x", n_buffers=3)
    assert three == tl.simulate(tl.stream_log(8, BLOCK, 2e6, 3), "tpu7x")
    batch8 = widgets.what_if(log, "tpu7x", batch=8, base_batch=2)
    assert batch8.flops == pytest.approx(8 * 2e6 * (8 / 2))  # 8 blocks, batch 2 -> 8
    assert batch8.dma_bytes == 8 * BLOCK


def test_chips_change_the_timeline_not_the_bytes(log):
    timelines = {chip: widgets.what_if(log, chip) for chip in widgets.CHIP_CHOICES}
    assert len({t.dma_bytes for t in timelines.values()}) == 1
    assert timelines["v5e"].total_s > timelines["tpu7x"].total_s  # 819 GB/s vs 3.7 TB/s


def test_gantt_rows(log):
    timeline = widgets.what_if(log, "v5e")
    rows = widgets.gantt_rows(timeline)
    lanes = {r["lane"]: r["row"] for r in rows}
    assert lanes["DMA 0"] < lanes[tl.COMPUTE_LANE] < lanes["idle, HBM busy"] < lanes["bubble"]
    assert sum(r["kind"] == "dma" for r in rows) == 8
    assert sum(r["kind"] == "compute" for r in rows) == 8
    for cause, lane in widgets.IDLE_LANES.items():
        assert sum(r["end_us"] - r["start_us"] for r in rows if r["lane"] == lane) == \
            pytest.approx(timeline.idle_s(cause) * 1e6)


def test_gantt_bars_are_the_spans_without_a_resolution(log):
    timeline = widgets.what_if(log, "v5e")
    bars = {(b["lane"], b["kind"]): b for b in widgets.gantt_bars(timeline)}
    dma = bars["DMA 0", "dma"]  # back-to-back copies touch: one bar
    assert len(dma["xranges"]) == 1 and dma["opacity"] == [1.0]
    start, width = dma["xranges"][0]
    assert start + width == pytest.approx(max(s.end for s in timeline.spans_on("DMA 0")) * 1e6)
    assert len(bars[tl.COMPUTE_LANE, "compute"]["xranges"]) == 8
    window = widgets.gantt_bars(timeline, window_us=(2.0, 4.0))
    assert all(2.0 <= a and a + w <= 4.0 + 1e-9 for b in window for a, w in b["xranges"])


def test_gantt_bars_shade_pixel_columns_by_coverage():
    """Four 0.1 µs spans every 1 µs at 0.5 µs per pixel: each column with a span is drawn, at
    the opacity floor (0.2 of the column is covered, below MIN_OPACITY = 0.25)."""
    spans = tuple(tl.Span("DMA 0", "w", i * 1e-6, i * 1e-6 + 0.1e-6, "dma") for i in range(4))
    timeline = tl.Timeline(tl.timeline_chip("v5e"), spans, ((0.0, 0),), 4e-6, 0, 0.0, ())
    (bar,) = widgets.gantt_bars(timeline, pixel_us=0.5)
    assert [x for r in bar["xranges"] for x in r] == pytest.approx([0, .5, 1, .5, 2, .5, 3, .5])
    assert bar["opacity"] == [widgets.MIN_OPACITY] * 4
    (full,) = widgets.gantt_bars(timeline, pixel_us=0.1)  # one column per span, fully covered
    assert full["opacity"] == [1.0] * 4


def test_gantt_bars_of_a_long_timeline_are_bounded_by_the_pixels(long_timeline):
    pixel_us = long_timeline.total_s * 1e6 / 800
    bars = widgets.gantt_bars(long_timeline, pixel_us=pixel_us)
    assert len(long_timeline.spans) >= 13000
    assert all(len(b["xranges"]) <= 801 for b in bars)
    assert all(0 < a <= 1 for b in bars for a in b["opacity"])


def test_vmem_steps_end_at_the_step_end(log):
    timeline = widgets.what_if(log, "v5e")
    times, values = widgets.vmem_steps(timeline)
    assert times[0] == 0 and times[-1] == pytest.approx(timeline.total_s * 1e6)
    assert max(values) == 2 * BLOCK and values[-1] == 0
    assert len(times) == len(values)


def test_idle_and_summary_rows(log):
    timeline = widgets.what_if(log, "v5e")
    idle = widgets.idle_rows(timeline)
    assert [i["cause"] for i in idle] == list(tl.IDLE_CAUSES)
    assert [i["label"] for i in idle] == ["compute idle: HBM busy", "bubble: nothing moves"]
    assert sum(i["us"] for i in idle) == pytest.approx(timeline.idle_s() * 1e6)
    assert sum(i["fraction"] for i in idle) == pytest.approx(timeline.idle_s() / timeline.total_s)
    rows = widgets.summary_rows({"a": timeline})
    assert rows[0]["label"] == "a" and rows[0]["roofline_fraction"] == timeline.roofline_fraction
    text = widgets.format_table(rows, ["label", "total_us", "roofline_fraction"])
    assert text.splitlines()[0].split() == ["label", "total_us", "roofline_fraction"]
    split = widgets.time_split_rows({"a": timeline})[0]
    assert split["compute_us"] + split["idle_hbm_busy_us"] + split["bubble_us"] == \
        pytest.approx(timeline.total_s * 1e6)


def test_summary_line_names_both_causes_with_their_fractions(log):
    """v5e, two buffers: bandwidth-bound near the roofline, so the compute unit is idle most of
    the step while HBM is busy; only the first copy's latency is a bubble."""
    timeline = widgets.what_if(log, "v5e")
    line = widgets.summary_line(timeline)
    hbm_busy = timeline.step_fraction(timeline.idle_s("hbm_busy"))
    bubble = timeline.step_fraction(timeline.idle_s("bubble"))
    assert hbm_busy > 0.5 and bubble < 0.1
    assert f"compute idle: HBM busy {hbm_busy:.0%} of the step" in line
    assert f"bubble: nothing moves {bubble:.0%}" in line


def test_static_figure(log):
    fig = widgets.timeline_figure(widgets.what_if(log, "tpu7x"))
    gantt, vmem = fig.axes
    assert "tpu7x" in gantt.get_title() and "VMEM" in vmem.get_title()


def test_figures_of_the_models_say_modelled_in_their_titles(log):
    """A timeline looks like a measurement: every figure drawn from the timeline or scale-out
    model says it is modelled, whatever title its caller gave; measured spans alone do not."""
    import matplotlib.pyplot as plt

    from mkresearch.views import speculative_plots

    timeline = widgets.what_if(log, "tpu7x")
    assert widgets.modelled("kda on TPU7x") == "kda on TPU7x (modelled)"
    for said in ("a modelled step", "tok/s (predicted)", "one rank (timeline model, not measured)"):
        assert widgets.modelled(said) == said
    gantt, vmem = widgets.timeline_figure(timeline).axes
    assert gantt.get_title().startswith("tpu7x: modelled step ") and "(modelled)" in vmem.get_title()
    titled = widgets.timeline_figure(timeline, title="kda on TPU7x: 57% of the HBM roofline")
    assert titled.axes[0].get_title() == "kda on TPU7x: 57% of the HBM roofline (modelled)"
    assert "(modelled)" in widgets.plot_time_split({"kda": timeline}).get_title()
    trace = [tl.Span("measured: scope", "scope", 0.0, 1e-6, "measured")]
    _, ax = plt.subplots()
    widgets.plot_gantt(tl.simulate([], "tpu7x"), ax, measured=trace, title="CPU trace: measured")
    assert ax.get_title() == "CPU trace: measured"
    _, ax = plt.subplots()
    speculative_plots.plot_acceptance([{"acceptance": 1, "k7_tokens_per_s": 1.0,
                                        "exact_tokens_per_s": 1.0, "published_tok_s": None}], ax)
    assert ax.get_title() == "tok/s against acceptance length (modelled)"
    plt.close("all")


def test_gantt_chart_is_readable(log):
    """No bar edges, the legend outside the axes with each idle cause's share, and the x range
    past the last span."""
    import matplotlib.pyplot as plt

    timeline = widgets.what_if(log, "v5e")
    fig, ax = plt.subplots(figsize=(10, 3), layout="constrained")
    widgets.plot_gantt(timeline, ax)
    fig.canvas.draw()
    assert all(len(c.get_linewidths()) == 0 or max(c.get_linewidths()) == 0
               for c in ax.collections)
    legend = ax.get_legend()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1
    texts = [t.get_text() for t in legend.get_texts()]
    share = timeline.step_fraction(timeline.idle_s("hbm_busy"))
    assert f"compute idle: HBM busy ({share:.0%} of the step)" in texts
    assert any(t.startswith("bubble: nothing moves (") for t in texts)
    assert ax.get_xlim()[1] > max(s.end for s in timeline.spans) * 1e6
    plt.close(fig)


def test_time_split_legend_is_outside(log):
    import matplotlib.pyplot as plt

    ax = widgets.plot_time_split({"a": widgets.what_if(log, "v5e"),
                                  "b": widgets.what_if(log, "tpu7x")})
    ax.figure.canvas.draw()
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1
    plt.close(ax.figure)


def _drawn_artists(timeline):
    """The artists plot_gantt adds to a fresh axes, and the rectangles in its collections."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
    widgets.plot_gantt(timeline, ax)
    fig.canvas.draw()
    counts = (len(ax.collections) + len(ax.patches),
              sum(len(c.get_paths()) for c in ax.collections))
    plt.close(fig)
    return counts


def test_plot_gantt_draws_13k_spans_with_as_many_artists_as_100(long_timeline):
    """Notebook 07's rank timeline has ≈13k spans. One collection per lane and kind, its bars
    merged by pixel column, keeps the drawing as cheap as 100 spans' (one artist per span, what
    it was, took > 100x as long to draw). Checked by what is drawn, not by a stopwatch: the time
    is printed by `make bench-speed`."""
    short = tl.simulate(tl.stream_log(50, BLOCK, 2e6, 2), "tpu7x")
    assert len(short.spans) == 100 and len(long_timeline.spans) >= 13000
    (short_artists, _), (long_artists, long_bars) = (_drawn_artists(short),
                                                     _drawn_artists(long_timeline))
    assert long_artists <= short_artists + len(widgets.IDLE_LANES)
    assert long_bars <= 801 * long_artists  # at most one bar per pixel column and collection


def test_explorer_widget_without_a_browser(log):
    explorer = widgets.TimelineExplorer(log, chip="v5e", batch=1)
    assert explorer.timeline == widgets.what_if(log, "v5e")
    first_figure = explorer.figure
    explorer.chip.value = "tpu7x"  # the dropdown's observer redraws from the same log
    assert explorer.timeline.chip.name == "tpu7x" and explorer.figure is not first_figure
    explorer.buffers.value = 1
    assert explorer.timeline == widgets.what_if(log, "tpu7x", batch=1, n_buffers=1)
    explorer.batch.value = 8
    assert explorer.timeline.flops == pytest.approx(8 * 8 * 2e6)
    assert "roofline" in explorer.summary.value and "compute idle: HBM busy" in explorer.summary.value
    assert repr(explorer) == "TimelineExplorer(chip='tpu7x', batch=8, buffers=1)"
    assert explorer.controls == (explorer.chip, explorer.batch, explorer.buffers)
    # the figure's title names the settings it shows, and so does the summary; the title says
    # the timeline is modelled, not measured
    assert widgets.figure_title(explorer.figure).startswith("tpu7x, batch 8, buffers 1: step ")
    assert "of the HBM roofline (modelled)" in widgets.figure_title(explorer.figure)
    assert explorer.summary_line().startswith("tpu7x, batch 8, buffers 1: step ")


def test_buffers_dropdown_starts_on_a_real_option(log):
    """ipywidgets shows a None value as an empty dropdown: "as recorded" is a value of its own."""
    explorer = widgets.TimelineExplorer(log)
    assert explorer.buffers.value == widgets.AS_RECORDED
    assert explorer.buffers.label == "as recorded" and explorer.n_buffers is None
    assert explorer.timeline == widgets.what_if(log, "tpu7x", batch=1)
    assert widgets.TimelineExplorer(log, n_buffers=3).buffers.label == "3"


def test_long_timelines_get_a_time_window(log, long_timeline):
    assert explorer_controls(widgets.TimelineExplorer(log)) == ["chip", "batch", "buffers"]
    long_log = tl.stream_log(200, BLOCK, 2e6, 2)
    explorer = widgets.TimelineExplorer(long_log)
    assert explorer_controls(explorer) == ["chip", "batch", "buffers", "window %"]
    explorer.window.value = (10.0, 20.0)
    end = explorer.timeline.total_s * 1e6
    assert explorer.window_us == pytest.approx((0.1 * end, 0.2 * end))
    assert explorer.figure.axes[0].get_xlim() == pytest.approx((0.1 * end, 0.2 * end))


def explorer_controls(explorer):
    return [control.description for control in explorer.controls]


def test_displayed_explorer_leaves_its_figure_and_summary_then_the_live_widget(log, monkeypatch):
    """Static outputs first (the figure with its title as alt text, the summary as plain text:
    what an export or a page without widgets shows), then the widget: its own figure in an
    output area above the controls, and the rule hiding the two static outputs."""
    shown = []
    monkeypatch.setattr(widgets, "_display", lambda obj, **kwargs: shown.append(obj))
    explorer = widgets.TimelineExplorer(log)
    explorer._ipython_display_()
    figure, summary, live = shown
    assert set(figure) == {"image/png", "text/html", "text/plain"} and figure["image/png"]
    assert 'alt="tpu7x, batch 1, buffers as recorded: step ' in figure["text/html"]
    assert summary == {"text/plain": explorer.summary_line()}
    assert "application/vnd.jupyter.widget-view+json" in live
    assert live["text/plain"].startswith("TimelineExplorer(") and "VBox" not in live["text/plain"]
    assert "Run this cell" in live["text/plain"]
    children = explorer.widget.children
    assert children[0] is explorer.output and children[1].children == explorer.controls
    assert explorer._css_class in explorer.widget._dom_classes
    rule = explorer._hide_static.value
    assert rule.count(f".{explorer._css_class}") == 2 * widgets.FigureExplorer.STATIC_OUTPUTS
    assert ".jp-OutputArea-child:has(+ .jp-OutputArea-child + .jp-OutputArea-child ." in rule

    size = explorer.figure.get_size_inches().tolist()
    monkeypatch.setattr(widgets, "widgets_available", lambda: True)  # as in a kernel
    explorer.chip.value = "v5e"
    redrawn = shown[-1]  # the redraw, into the widget's output area
    assert len(shown) == 4 and 'alt="v5e, batch 1, buffers as recorded: step ' in redrawn["text/html"]
    assert explorer.figure.get_size_inches().tolist() == size  # the controls under it stay put


def test_png_bundle_keeps_the_figure_size_and_escapes_its_text():
    import base64
    import struct

    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(4, 2), dpi=50)
    bundle = widgets.png_bundle(fig, 'a "quoted" <title>')
    png = base64.b64decode(bundle["image/png"])
    assert struct.unpack(">II", png[16:24]) == (200, 100)  # not cropped: every redraw alike
    assert 'alt="a &quot;quoted&quot; &lt;title&gt;"' in bundle["text/html"]
    plt.close(fig)


@pytest.mark.parametrize("kwargs,match", [
    ({"chip": "v4"}, "chip='v4'"),
    ({"batch": 3}, "batch=3"),
    ({"n_buffers": 5}, "n_buffers=5"),
])
def test_explorer_bad_input(log, kwargs, match):
    with pytest.raises(ValueError, match=match):
        widgets.TimelineExplorer(log, **kwargs)


def test_what_if_bad_input(log):
    with pytest.raises(ValueError, match="batch=0"):
        widgets.what_if(log, batch=0)
    with pytest.raises(ValueError, match="base_batch"):
        widgets.what_if(log, base_batch=0)


@pytest.mark.slow
def test_scale_out_explorer_titles_and_summarises_its_settings(monkeypatch):
    """Notebook 09's explorer, on 8 ranks (cached predictions of the pure-Python model): a change
    redraws in place, the new figure's title and the summary name the new setting."""
    from mkresearch.views import scale_out_plots

    shown = []
    monkeypatch.setattr(widgets, "_display", lambda obj, **kwargs: shown.append(obj))
    explorer = scale_out_plots.ScaleOutExplorer(batch=1, n_ranks=8, layout="release")
    explorer._ipython_display_()
    figure, summary, live = shown
    assert 'alt="B = 1, 8 ranks, release layout, release schedule, ICI ' in figure["text/html"]
    assert summary["text/plain"].startswith("B = 1, 8 ranks, release layout")
    assert " ms per step, " in summary["text/plain"] and "collectives per rank" in summary["text/plain"]
    assert live["text/plain"].startswith("ScaleOutExplorer(batch=1, n_ranks=8, layout='release'")
    # the controls in a column left of the figure: both fit a 1400 x 900 window
    column, output = explorer.widget.children[0].children
    assert output is explorer.output
    assert column.children == (explorer.batch, explorer.ranks, explorer.layout, explorer.schedule,
                               explorer.bandwidth, explorer.latency)
    assert widgets.figure_title(explorer.figure).endswith(" ms per step (modelled)")
    assert explorer.figure.get_size_inches().tolist() == list(explorer.FIGSIZE)
    size = explorer.figure.get_size_inches().tolist()
    monkeypatch.setattr(widgets, "widgets_available", lambda: True)
    explorer.batch.value = 2
    assert widgets.figure_title(explorer.figure).startswith("B = 2, 8 ranks, release layout")
    assert 'alt="B = 2, 8 ranks' in shown[-1]["text/html"] and len(shown) == 4
    assert explorer.summary.value.startswith("B = 2, 8 ranks")
    assert explorer.figure.get_size_inches().tolist() == size


def test_show_figure_displays_it_described_by_its_title_and_closes_it(monkeypatch):
    import matplotlib.pyplot as plt

    shown = []
    monkeypatch.setattr(widgets, "_display", lambda obj, **kwargs: shown.append(obj))
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.set_title("bytes per step")
    widgets.show_figure(fig)
    assert not plt.fignum_exists(fig.number)  # pyplot will not show it a second time
    (bundle,) = shown
    assert bundle["image/png"] and 'alt="bytes per step"' in bundle["text/html"]
