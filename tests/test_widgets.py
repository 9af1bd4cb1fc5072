"""The widget data functions, the static figures, and the widgets built without a browser."""

import matplotlib

matplotlib.use("Agg")

import pytest

from mkresearch import timeline as tl
from mkresearch import widgets

BLOCK = 1 << 20  # 1 MiB blocks


@pytest.fixture
def log():
    """A two-buffer stream of 8 blocks, as JSON-like records (what a notebook would save)."""
    return tl.to_records(tl.stream_log(8, BLOCK, 2e6, 2))


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
    assert lanes["DMA 0"] < lanes[tl.COMPUTE_LANE] < lanes["bubbles"]
    assert sum(r["kind"] == "dma" for r in rows) == 8
    assert sum(r["kind"] == "compute" for r in rows) == 8
    assert sum(r["end_us"] - r["start_us"] for r in rows if r["lane"] == "bubbles") == \
        pytest.approx(timeline.bubble_s() * 1e6)


def test_vmem_steps_end_at_the_step_end(log):
    timeline = widgets.what_if(log, "v5e")
    times, values = widgets.vmem_steps(timeline)
    assert times[0] == 0 and times[-1] == pytest.approx(timeline.total_s * 1e6)
    assert max(values) == 2 * BLOCK and values[-1] == 0
    assert len(times) == len(values)


def test_bubble_and_summary_rows(log):
    timeline = widgets.what_if(log, "v5e")
    bubbles = widgets.bubble_rows(timeline)
    assert [b["cause"] for b in bubbles] == list(tl.BUBBLE_CAUSES)
    assert sum(b["us"] for b in bubbles) == pytest.approx(timeline.bubble_s() * 1e6)
    rows = widgets.summary_rows({"a": timeline})
    assert rows[0]["label"] == "a" and rows[0]["roofline_fraction"] == timeline.roofline_fraction
    text = widgets.format_table(rows, ["label", "total_us", "roofline_fraction"])
    assert text.splitlines()[0].split() == ["label", "total_us", "roofline_fraction"]


def test_static_figure(log):
    fig = widgets.timeline_figure(widgets.what_if(log, "tpu7x"))
    gantt, vmem = fig.axes
    assert "tpu7x" in gantt.get_title() and "VMEM" in vmem.get_title()


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
    assert "roofline" in explorer.summary.value
    assert repr(explorer) == "TimelineExplorer(chip='tpu7x', batch=8, buffers=1)"
    assert explorer.widget.children[0].children == (explorer.chip, explorer.batch, explorer.buffers)


def test_show_falls_back_to_a_static_figure_without_a_kernel(log):
    assert not widgets.widgets_available()  # pytest: no IPython kernel
    fig = widgets.show(log, chip="v6e")
    assert "v6e" in fig.axes[0].get_title()


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
