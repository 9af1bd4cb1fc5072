"""How kernels run: interpret params, compiling for TPUs on this CPU, VMEM overflow, races, chips."""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkresearch.hardware import cheap_compiles, fast_interpret, tpu
from mkresearch.hardware.chips import CHIPS, Chip, get_chip


def add(x, y):
    """A one-block Pallas kernel: o = x + y."""

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=tpu.interpret_params())(x, y)


def vmem_hog(x):
    """Asks for a 160 MiB VMEM scratch: more than any chip's VMEM (64 or 128 MiB)."""

    def kernel(x_ref, o_ref, scratch_ref):
        scratch_ref[...] = jnp.zeros_like(scratch_ref)
        o_ref[...] = x_ref[...] + scratch_ref[0:8, :]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          scratch_shapes=[pltpu.VMEM((40 * 1024, 1024), jnp.float32)],
                          interpret=tpu.interpret_params())(x)


@pytest.mark.parametrize("chip", ["tpu7x", "v5e"])
def test_small_kernel_compiles_for_tpu_on_this_cpu(chip):
    block = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    result = tpu.compile_for(add, block, block, chip=chip)
    print(f"{chip}: compile {result.seconds:.2f} s; {result}")
    assert result.chip == chip
    assert result.n_mosaic_kernels == 1
    assert result.memory["argument_size_in_bytes"] == 2 * 256 * 512 * 4
    assert result.memory["output_size_in_bytes"] == 256 * 512 * 4
    assert "Mosaic kernel" in str(result)


CACHED_COMPILE = """
import jax, jax.numpy as jnp, warnings
from mkresearch.hardware import tpu
warnings.simplefilter("error")  # any warning fails the child
block = jax.ShapeDtypeStruct((8, 128), jnp.float32)
print(tpu.compile_for(lambda x, y: x + y, block, block, chip="tpu7x").chip)
"""


def test_compiling_again_with_the_persistent_cache_is_quiet(tmp_path):
    """`make test` turns JAX's persistent compilation cache on: a topology compile is written to
    it, and a compile-only client cannot load it back. The second process compiling the same
    program must neither warn (a notebook cell would show it on stderr) nor fail."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    runs = [subprocess.run([sys.executable, "-c", CACHED_COMPILE], env=env, capture_output=True,
                           text=True, check=False, timeout=600) for _ in range(2)]
    assert any(tmp_path.iterdir()), "the first compile wrote no cache entry"
    for run in runs:
        assert run.returncode == 0 and run.stdout.strip() == "tpu7x", run.stderr[-2000:]
        assert "persistent compilation cache" not in run.stderr, run.stderr[-2000:]


def test_static_argnums_pass_through():
    def scaled_add(x, y, scale):
        return add(x * scale, y)

    block = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    result = tpu.compile_for(scaled_add, block, block, 2.0, chip="tpu7x", static_argnums=2)
    assert result.n_mosaic_kernels == 1


def test_vmem_overflow_says_so():
    start = time.perf_counter()
    with pytest.raises(tpu.VmemOverflowError, match="more VMEM than tpu7x has") as error:
        tpu.compile_for(vmem_hog, jax.ShapeDtypeStruct((8, 1024), jnp.float32), chip="tpu7x")
    assert "160.00 MiB" in str(error.value) and "64.00 MiB" in str(error.value)
    assert isinstance(error.value, ValueError)
    print(f"failing compile took {time.perf_counter() - start:.2f} s")


def test_unknown_chip_lists_the_names():
    with pytest.raises(ValueError, match="'v5e', 'v6e', 'v5p', 'tpu7x'"):
        tpu.compile_for(add, jax.ShapeDtypeStruct((8, 128), jnp.float32), chip="v4")
    with pytest.raises(ValueError, match="unknown chip 'h100'"):
        get_chip("h100")


def test_interpret_params_here_and_inside_compiling():
    assert jax.default_backend() == "cpu"
    params = tpu.interpret_params()
    assert isinstance(params, pltpu.InterpretParams)
    hash(params)  # usable as a static jit argument
    with tpu.compiling():
        assert tpu.interpret_params() is None
    assert tpu.interpret_params() == params
    assert tpu.describe_backend() == "cpu: TPU interpret mode"


def test_target_chip_is_the_chip_compiled_for():
    """Kernel wrappers read target_chip() for chip-dependent code (e.g. the MXFP4 decode path):
    compile_for's chip inside it (nested compiling() restores the outer one), None here."""
    assert tpu.target_chip() is None
    seen = []

    def record(x, y):
        seen.append(tpu.target_chip())
        return add(x, y)

    block = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    tpu.compile_for(record, block, block, chip="v6e")
    assert seen == ["v6e"]
    with tpu.compiling("v5p"):
        with tpu.compiling():
            assert tpu.target_chip() is None
        assert tpu.target_chip() == "v5p"
    assert tpu.target_chip() is None


def test_native_fp4_only_on_tpu7x():
    assert {name: chip.native_fp4 for name, chip in CHIPS.items()} == {
        "v5e": False, "v6e": False, "v5p": False, "tpu7x": True}


def test_interpret_options_set_and_restore():
    before = tpu.interpret_params()
    with tpu.interpret_options(detect_races=True, vector_clock_size=16):
        inside = tpu.interpret_params()
        assert inside.detect_races and inside.vector_clock_size == 16
        assert inside == tpu.interpret_params() and hash(inside) == hash(tpu.interpret_params())
    assert tpu.interpret_params() == before
    with pytest.raises(ValueError, match="unknown option.*allowed:.*detect_races"):
        tpu.interpret_options(detect_race=True)
    with pytest.raises(ValueError, match="vector_clock_size"):
        tpu.interpret_options(vector_clock_size=0)
    assert tpu.interpret_params() == before


def test_race_flag_survives_later_clean_kernels():
    """A race in one kernel stays reported after another kernel runs (the interpreter resets its
    own state per kernel), until reset_races()."""

    def racy_kernel(x_hbm, o_ref, buf_ref, sem):
        copy = pltpu.make_async_copy(x_hbm, buf_ref, sem)
        copy.start()
        o_ref[...] = buf_ref[...]  # reads the DMA destination before waiting: a race
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    with tpu.interpret_options(detect_races=True, vector_clock_size=16):
        tpu.reset_races()
        pl.pallas_call(racy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                       scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())],
                       interpret=tpu.interpret_params())(x)
        assert tpu.races_found()
        np.testing.assert_array_equal(np.asarray(add(x, x)), 2 * np.ones((8, 128)))
        assert tpu.races_found()
        tpu.reset_races()
        assert not tpu.races_found()


def _two_slot_copy(wait_on):
    """A kernel copying x into slot 0 signalling semaphore 0, then waiting on semaphore
    `wait_on` (1: one that no started copy signals, a wait that never returns)."""
    def kernel(x_hbm, o_ref, slots, sems):
        pltpu.make_async_copy(x_hbm, slots.at[0], sems.at[0]).start()
        pltpu.make_async_copy(x_hbm, slots.at[0], sems.at[wait_on]).wait()
        o_ref[...] = slots[0]

    x = jnp.ones((8, 128), jnp.float32)
    return np.asarray(pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((2, 8, 128), x.dtype), pltpu.SemaphoreType.DMA((2,))],
        interpret=tpu.interpret_params())(x))


def test_run_timed_stops_a_kernel_that_waits_forever_in_one_line(race_checked):
    """A wait nothing will signal would spin in interpret mode forever: run_timed stops it after
    its time and says so in one line; the simulated TPU runs the next kernel as before."""
    with pytest.raises(tpu.KernelTimeout) as error:
        tpu.run_timed(lambda: _two_slot_copy(wait_on=1), 1.0, what="the ring")
    assert str(error.value).startswith("the ring did not finish in 1 s: a DMA wait that no "
                                       "started copy signals never returns")
    assert "\n" not in str(error.value)
    np.testing.assert_array_equal(tpu.run_timed(lambda: _two_slot_copy(wait_on=0), 60), 1.0)
    with pytest.raises(ZeroDivisionError):  # fn's own exception, as it is
        tpu.run_timed(lambda: 1 // 0, 60)


def test_fast_interpret_gives_equal_results(race_checked):
    """The io_callback speed-up changes nothing but speed (jax 0.10.2 only)."""
    x = jnp.arange(64 * 256, dtype=jnp.float32).reshape(64, 256)
    y = jnp.sin(x)

    def run():
        start = time.perf_counter()
        out = np.asarray(add(x, y))
        return out, time.perf_counter() - start

    assert tpu.interpret_params() is not None
    assert fast_interpret.active() == fast_interpret.supported()
    fast_out, _ = run()
    tpu.set_fast_interpret(False)
    try:
        tpu.interpret_params()
        assert not fast_interpret.active()
        slow_out, _ = run()
    finally:
        tpu.set_fast_interpret(True)
    tpu.interpret_params()
    assert fast_interpret.active() == fast_interpret.supported()
    np.testing.assert_array_equal(fast_out, slow_out)
    np.testing.assert_array_equal(fast_out, np.asarray(x + y))


@pytest.mark.slow
def test_select_platform_respects_explicit_choice():
    code = "import os, mkresearch; print(os.environ.get('JAX_PLATFORMS'))"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    chosen = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            check=True).stdout.strip()
    assert chosen == ("cpu" if not tpu._tpu_present() else "None")
    env["JAX_PLATFORMS"] = "cpu,tpu"
    kept = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert kept == "cpu,tpu"


def test_chips_table():
    assert tuple(CHIPS) == ("v5e", "v6e", "v5p", "tpu7x")
    tpu7x = CHIPS["tpu7x"]
    assert isinstance(tpu7x, Chip) and get_chip(tpu7x) is tpu7x
    assert tpu7x.hbm_bandwidth == pytest.approx(3.69e12, rel=0.01)  # per TensorCore = per device
    assert tpu7x.vmem_bytes == 64 * 2**20 and CHIPS["v5e"].vmem_bytes == 128 * 2**20
    assert tpu7x.topology == "tpu7x:2x2x1" and CHIPS["v5p"].topology == "v5p:2x2x1"
    assert tpu7x.mxu_shape == (256, 256) and CHIPS["v5e"].mxu_shape == (128, 128)
    assert tpu7x.fp8_flops == pytest.approx(2 * tpu7x.bf16_flops, rel=0.01)
    for chip in CHIPS.values():
        for name in ("hbm_bandwidth", "bf16_flops", "fp8_flops", "vmem_bytes", "hbm_bytes",
                     "mxu_shape", "topology", "device_kind", "tensorcores_per_chip",
                     "native_fp4"):
            assert chip.sources[name], (chip.name, name)
        assert chip.hbm_bandwidth > 0 and chip.bf16_flops > 0 and chip.critical_intensity > 100


def test_device_kind_matches_topology():
    for chip in CHIPS.values():
        assert tpu.tpu_device(chip.name).device_kind == chip.device_kind


def test_lower_for_tpu_checks_tiling_without_compiling():
    block = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    lowered = tpu.lower_for_tpu(add, block, block)
    assert "tpu_custom_call" in lowered.as_text()

    def bad_block(x):  # a (4, 100) f32 block breaks the (8, 128) tiling of a (16, 200) array
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]

        return pl.pallas_call(kernel, grid=(4, 2), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              in_specs=[pl.BlockSpec((4, 100), lambda i, j: (i, j))],
                              out_specs=pl.BlockSpec((4, 100), lambda i, j: (i, j)),
                              interpret=tpu.interpret_params())(x)

    with pytest.raises(Exception, match="(?i)block shape|divisible|tiling"):
        tpu.lower_for_tpu(bad_block, jax.ShapeDtypeStruct((16, 200), jnp.float32))


def test_cheap_cpu_compiles_adds_its_switches_once_and_keeps_explicit_ones(monkeypatch):
    """What tests/conftest.py and notebooks/conftest.py call before any compile: jax's cheap
    passes (its flag too, since jax is imported already here) and XLA:CPU's legacy fusion emitters
    added to XLA_FLAGS once, after what is there; an explicit setting of either is kept."""
    from jax._src import compiler

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS", raising=False)
    previous = compiler._DISABLE_MOST_OPTIMIZATIONS.value
    try:
        cheap_compiles.cheap_cpu_compiles()
        cheap_compiles.cheap_cpu_compiles()
        assert os.environ["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=8 "
                                           "--xla_cpu_use_fusion_emitters=false")
        assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
        assert compiler._DISABLE_MOST_OPTIMIZATIONS.value is True
        monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=true")
        monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
        cheap_compiles.cheap_cpu_compiles()
        assert os.environ["XLA_FLAGS"] == "--xla_cpu_use_fusion_emitters=true"
        assert compiler._DISABLE_MOST_OPTIMIZATIONS.value is False
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)


def test_the_chip_present_is_the_default_and_another_is_refused(monkeypatch):
    """A TPU faked by its device kind (`jax.devices()[0].device_kind`): it is the chip kernels are
    built for by default (MegakernelOptions, compile_for, the CLI's --chip), and a step built for
    another chip is refused in one line; without a TPU the default is tpu7x."""
    import types

    from mkresearch.kernels.compose import megakernel as mk

    from mkresearch.cli.common import known_chip
    from mkresearch.model.config import get_config

    assert tpu.present_chip() is None and tpu.default_chip() == tpu.DEFAULT_CHIP == "tpu7x"
    monkeypatch.setattr(tpu, "on_tpu", lambda: True)
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(
        device_kind="TPU v5 lite")])
    assert tpu.present_chip() == tpu.default_chip() == known_chip(None) == "v5e"
    assert tpu.chip_of_kind("TPU7x") == "tpu7x" and tpu.chip_of_kind("GPU") is None
    plan = mk.make_plan(get_config("kimi-k3-mini"), 1, 128, mk.MegakernelOptions())
    assert plan.options.chip == "v5e"
    tpu.check_runs_here("v5e")
    with pytest.raises(ValueError, match=r"^chip='tpu7x' is invalid here: this machine's TPU is "
                                         r"'v5e'.*mkresearch compile --chip tpu7x"):
        tpu.check_runs_here("tpu7x")
    with tpu.compiling("tpu7x"):  # compiling for another chip from shapes is not running it
        tpu.check_runs_here("tpu7x")
    # a stage kernel or decode built for another chip: refused before Mosaic sees a float4 vector
    from mkresearch.kernels.base import quant
    from mkresearch.kernels.stages import experts

    cfg = get_config("kimi-k3-mini", expert_format="mxfp4")
    x = jnp.zeros((1, cfg.d_model), jnp.bfloat16)
    ids, w = jnp.zeros((1, cfg.top_k), jnp.int32), jnp.zeros((1, cfg.top_k), jnp.float32)
    for run in (lambda: quant.decode({}, "mxfp4", chip="tpu7x"),
                lambda: experts.routed_experts({}, x, ids, w, cfg, chip="tpu7x")):
        with pytest.raises(ValueError, match=r"^chip='tpu7x' is invalid here"):
            run()


def test_on_a_tpu_only_the_tpu_tier_runs(monkeypatch, pytestconfig):
    """tests/conftest.py's collection hook: on a TPU a test not marked `tpu` is skipped, saying
    why (it once sat in a second hook of the same name, which replaced it)."""
    here = Path(__file__).with_name("conftest.py")
    conftest = next(p for p in pytestconfig.pluginmanager.get_plugins()
                    if getattr(p, "__file__", None) and Path(p.__file__) == here)

    class Item:
        def __init__(self, keywords):
            self.keywords, self.markers = keywords, []

        def add_marker(self, marker):
            self.markers.append(marker)

    tier, cpu_only = Item({"tpu": True}), Item({})
    monkeypatch.setattr(conftest._tpu, "on_tpu", lambda: False)
    conftest._tpu_tier_only([tier, cpu_only])
    assert not tier.markers and not cpu_only.markers
    monkeypatch.setattr(conftest._tpu, "on_tpu", lambda: True)
    conftest._tpu_tier_only([tier, cpu_only])
    assert not tier.markers
    assert [m.name for m in cpu_only.markers] == ["skip"]
    assert "make test-tpu" in cpu_only.markers[0].kwargs["reason"]


def test_each_test_logged_as_it_ends(monkeypatch, pytestconfig, tmp_path):
    """MKRESEARCH_TEST_LOG=FILE (tests/conftest.py): a JSON line per test when it ends, its
    outcome and the reason's last lines, so a run cut by a time limit keeps what it found."""
    import json
    import types

    here = Path(__file__).with_name("conftest.py")
    conftest = next(p for p in pytestconfig.pluginmanager.get_plugins()
                    if getattr(p, "__file__", None) and Path(p.__file__) == here)

    def report(when, outcome, text=""):
        return types.SimpleNamespace(
            nodeid=f"t.py::{when}_{outcome}", when=when, outcome=outcome, duration=1.234,
            failed=outcome == "failed", skipped=outcome == "skipped", longrepr=text or None,
            longreprtext=text)

    log = tmp_path / "tests.jsonl"
    monkeypatch.setenv("MKRESEARCH_TEST_LOG", str(log))
    for each in (report("call", "passed"), report("setup", "passed"),
                 report("setup", "failed", "fixture\nE   ValueError: no"),
                 report("call", "failed", "E   AssertionError"), report("setup", "skipped", "why")):
        conftest.pytest_runtest_logreport(each)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(line["test"], line["outcome"]) for line in lines] == [
        ("t.py::call_passed", "passed"), ("t.py::setup_failed", "error"),
        ("t.py::call_failed", "failed"), ("t.py::setup_skipped", "skipped")]
    assert lines[1]["reason"] == ["fixture", "E   ValueError: no"] and lines[0]["seconds"] == 1.23
