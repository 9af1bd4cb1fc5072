"""The measured path on CPU: a jax.profiler trace parses into spans with the named scopes."""

import sys

import jax
import jax.numpy as jnp
import pytest

from mkresearch.measurement import profiling
from mkresearch.prediction import timeline as tl
from mkresearch.views import widgets


def two_phase_step(x, w):
    with jax.named_scope("gemv"):
        y = jnp.dot(x, w, preferred_element_type=jnp.float32)
    with jax.named_scope("activation"):
        return jnp.tanh(y)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    x = jnp.ones((8, 256), jnp.bfloat16)
    w = jnp.ones((256, 512), jnp.bfloat16)
    step = jax.jit(two_phase_step)
    path = profiling.capture(step, x, w, logdir=tmp_path_factory.mktemp("trace"),
                             annotation="decode_step")
    return path, profiling.hlo_scope_names(step.lower(x, w).compile())


def test_capture_writes_an_xplane(trace):
    path, _ = trace
    assert path.name.endswith(".xplane.pb") and path.stat().st_size > 0
    assert profiling.trace_files(path.parents[3]) == [path]  # logdir/plugins/profile/<run>/


def test_hlo_scope_names_carry_the_named_scopes(trace):
    _, names = trace
    paths = set(names.values())
    assert any("/gemv/" in p for p in paths) and any("/activation/" in p for p in paths)


def test_named_scopes_parse_into_spans(trace):
    path, names = trace
    spans = profiling.parse_trace(path, ["gemv", "activation", "decode_step"], scope_names=names)
    found = {s.name for s in spans}
    assert found == {"gemv", "activation", "decode_step"}
    by_name = {s.name: s for s in spans}
    # the annotation encloses the whole step; the ops run inside it and in program order
    assert by_name["decode_step"].start == 0.0
    assert by_name["gemv"].end <= by_name["activation"].start + 1e-9
    assert by_name["activation"].end <= by_name["decode_step"].end
    assert all(s.kind == "measured" and s.duration >= 0 for s in spans)
    totals = profiling.scope_totals(spans)
    assert set(totals) == found


def test_without_scope_names_only_annotations_are_found_on_cpu(trace):
    path, _ = trace
    spans = profiling.parse_trace(path.parent.parent.parent.parent, ["gemv", "decode_step"])
    assert {s.name for s in spans} == {"decode_step"}


def test_all_scoped_ops(trace):
    path, names = trace
    spans = profiling.parse_trace(path, None, scope_names=names)
    assert spans and all("/" in s.name for s in spans)


def test_measured_spans_overlay_on_the_model(trace):
    path, names = trace
    measured = profiling.parse_trace(path, ["gemv", "activation"], scope_names=names)
    model = tl.simulate(tl.stream_log(2, 4096, 1e6, 2), "v5e")
    rows = widgets.gantt_rows(model, measured)
    measured_rows = [r for r in rows if r["kind"] == "measured"]
    assert {r["name"] for r in measured_rows} == {"gemv", "activation"}
    assert min(r["row"] for r in measured_rows) > max(r["row"] for r in rows
                                                      if r["kind"] != "measured")
    fig = widgets.timeline_figure(model, measured)
    assert len(fig.axes) == 2


def test_xprof_command():
    cmd = profiling.xprof_command("/some/dir", 9000)
    assert cmd == [sys.executable, "-m", "xprof.server", "--logdir", "/some/dir", "--port", "9000"]
    assert profiling.tensorboard_command("d", 6006)[1:] == ["--logdir", "d", "--port", "6006"]


@pytest.mark.parametrize("call,match", [
    (lambda tmp: profiling.parse_trace(tmp, ["x"]), "no .xplane.pb"),
    (lambda tmp: profiling.parse_trace(tmp / "missing.xplane.pb"), "no such trace file"),
    (lambda tmp: profiling.xprof_command(tmp, 0), "port=0"),
    (lambda tmp: profiling.capture(3, logdir=tmp), "fn=3"),
])
def test_bad_input(tmp_path, call, match):
    with pytest.raises(ValueError, match=match):
        call(tmp_path)


def test_bad_scopes(trace):
    path, _ = trace
    with pytest.raises(ValueError, match="scopes='gemv'"):
        profiling.parse_trace(path, "gemv")


def test_device_time_reads_a_recorded_tpu_profile():
    """The profile recorded on a TPU v5e (benchmarks/recorded/tpu-v5e, `benchmarks/tpu_v5e.py
    time`): one call of the loop, 32 steps of kimi-k3-mini at B = 8, is one execution of the
    loop's program; its duration is the device time of 32 steps."""
    from pathlib import Path

    from mkresearch.measurement import device_time

    path = (Path(__file__).parents[1] / "benchmarks" / "recorded" / "tpu-v5e"
            / "kimi-k3-mini_loop_B8.xplane.pb")
    seconds = device_time.module_seconds(path, "_megakernel_run")
    assert len(seconds) == 1
    assert round(seconds[0] * 1e6 / 32, 1) == 276.6  # µs per step
    with pytest.raises(ValueError, match="no TPU execution"):
        device_time.module_seconds(path, "no_such_program")
