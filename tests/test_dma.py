"""The DMA log: exact order and bytes of a double-buffered GEMV, silence when not recording, JSON."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma

from mkresearch.hardware import tpu

BATCH, K, N, TILE_K = 8, 512, 256, 128  # x [B, K] @ w [K, N], w streamed in [TILE_K, N] tiles
N_TILES = K // TILE_K
TILE_BYTES = TILE_K * N * 2  # bf16


def gemv_body(x_ref, w_hbm, o_ref, w_ring_ref, sems, acc_ref):
    """o = x @ w with w's K tiles streamed HBM -> a 2-slot VMEM ring (next tile loads during compute)."""
    ring = dma.Ring(w_ring_ref, sems, name="w")
    n_tiles = w_hbm.shape[0] // TILE_K

    def w_tile(k):  # [TILE_K, N] block of w in HBM
        return w_hbm.at[pl.ds(pl.multiple_of(k * TILE_K, TILE_K), TILE_K)]

    ring.start(w_tile(0), 0, k=0)
    acc_ref[...] = jnp.zeros_like(acc_ref)

    def step(k, carry):
        slot = k % 2
        ring.wait(w_tile(k), slot, k=k)

        @pl.when(k + 1 < n_tiles)
        def _prefetch():  # the other slot was consumed by step k-1: free to overwrite
            ring.start(w_tile(k + 1), 1 - slot, k=k + 1)

        with dma.phase("gemv", flops=2 * BATCH * TILE_K * N, vmem_bytes=TILE_BYTES, k=k):
            x_tile = x_ref[:, pl.ds(pl.multiple_of(k * TILE_K, TILE_K), TILE_K)]  # [B, TILE_K]
            acc_ref[...] += jnp.dot(x_tile, ring.buffer(slot)[...],
                                    preferred_element_type=jnp.float32)
        return carry

    jax.lax.fori_loop(0, n_tiles, step, 0)
    o_ref[...] = acc_ref[...]


@functools.partial(jax.jit, static_argnames=("recording", "interpret"))
def _gemv(x, w, *, recording, interpret):
    del recording  # only keys the jit cache: recorded and silent traces never mix
    return pl.pallas_call(
        gemv_body,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((2, TILE_K, w.shape[1]), w.dtype), pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((x.shape[0], w.shape[1]), jnp.float32)],
        interpret=interpret,
    )(x, w)


def gemv(x, w):
    return _gemv(x, w, recording=dma.is_recording(), interpret=tpu.interpret_params())


def _inputs():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (BATCH, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    return x, w


def _expected_order():
    order = [("dma_start", "w", 0, 0)]
    for k in range(N_TILES):
        order.append(("dma_wait", "w", k % 2, k))
        if k + 1 < N_TILES:
            order.append(("dma_start", "w", (k + 1) % 2, k + 1))
        order += [("phase_start", "gemv", None, k), ("phase_end", "gemv", None, k)]
    return order


def test_double_buffered_gemv_log_has_exact_order_and_bytes(race_checked):
    x, w = _inputs()
    with dma.recording() as log:
        out = gemv(x, w)
    expected = jnp.dot(x, w, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)

    assert [(e.kind, e.name, e.slot, e.indices["k"]) for e in log.events] == _expected_order()
    starts = log.select("dma_start")
    assert all((e.src, e.dst, e.nbytes) == ("hbm", "vmem", TILE_BYTES) for e in starts)
    assert log.dma_bytes() == log.dma_bytes("w") == K * N * 2  # every weight byte exactly once
    assert log.dma_bytes("x") == 0
    phases = log.select("phase_start", "gemv")
    assert sum(e.flops for e in phases) == 2 * BATCH * K * N
    assert {e.vmem_bytes for e in phases} == {TILE_BYTES}
    print(f"PASS gemv log: {len(log)} events, {log.dma_bytes()} DMA bytes")


def test_silent_trace_records_nothing(race_checked):
    x, w = _inputs()
    out = gemv(x, w)  # traced and run without recording: nothing to record into, no callbacks
    with dma.recording() as log:  # that silent trace, reused from the jit cache, stays silent
        silent = _gemv(x, w, recording=False, interpret=tpu.interpret_params())
    assert log.events == []
    np.testing.assert_array_equal(np.asarray(out), np.asarray(silent))
    with dma.recording() as log:  # a fresh trace while recording does record
        again = gemv(x, w)
    assert len(log.events) == len(_expected_order())
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))
    assert not dma.is_recording()


def test_events_land_in_the_innermost_log_only(race_checked):
    x, w = _inputs()
    with dma.recording() as outer:
        with dma.recording() as inner:
            gemv(x, w)
        assert dma.is_recording()
    assert len(inner) == len(_expected_order()) and len(outer) == 0


def test_json_round_trip(race_checked):
    x, w = _inputs()
    with dma.recording() as log:
        gemv(x, w)
    text = log.to_json()
    back = dma.DmaLog.from_json(text)
    assert back.events == log.events
    assert back.to_records() == log.to_records()
    assert back.dma_bytes("w") == K * N * 2
    assert set(log.to_records()[0]) == {"kind", "name", "src", "dst", "nbytes", "slot", "indices",
                                        "flops", "vmem_bytes", "rank", "src_rank", "dst_rank"}
    assert {log.to_records()[0][key] for key in ("rank", "src_rank", "dst_rank")} == {None}


def test_nothing_is_emitted_when_compiling_for_a_tpu():
    x, w = _inputs()
    with dma.recording() as log:  # inside compile_for the kernel is built for Mosaic: no callbacks
        result = tpu.compile_for(gemv, x, w, chip="tpu7x")
    assert log.events == [] and result.n_mosaic_kernels == 1


def test_bad_arguments_raise_value_errors():
    buf = jax.ShapeDtypeStruct((2, 8, 128), jnp.float32)
    with pytest.raises(ValueError, match="name"):
        dma.Ring(buf, jax.ShapeDtypeStruct((2,), jnp.int32), name="")
    with pytest.raises(ValueError, match="sems_ref"):
        dma.Ring(buf, jax.ShapeDtypeStruct((3,), jnp.int32), name="w")
    with pytest.raises(ValueError, match="src shape"):
        dma.Copy(jax.ShapeDtypeStruct((8, 128), jnp.float32), jax.ShapeDtypeStruct((16, 128), jnp.float32),
                 None, name="w")
    with pytest.raises(ValueError, match="kind"):
        dma.DmaLog().select("dma_begin")


# ---- the mistakes a kernel writer makes with a copy: one line naming it, before it starts ------
def _ring_copy(variant):
    """A kernel streaming x [32, 128] f32 through a 2-slot ring, its copy built as `variant` says
    (each wrong variant of `make_async_copy` would fail at the wait, or hang there)."""
    def kernel(x_hbm, o_ref, slots, sems):
        def step(k, carry):
            slot, other = jax.lax.rem(k, 2), 1 - jax.lax.rem(k, 2)
            rows = x_hbm.at[pl.ds(pl.multiple_of(k * 8, 8), 8)]
            copy = {
                "ring": lambda: dma.Ring(slots, sems, name="x").copy(rows, slot),
                "one slot value": lambda: dma.Copy(rows, slots.at[slot], sems.at[slot], name="x",
                                                   slot=slot),
                "equal ints": lambda: dma.Copy(rows, slots.at[1], sems.at[1], name="x", slot=1),
                "another semaphore": lambda: dma.Copy(rows, slots.at[1], sems.at[0], name="x",
                                                      slot=1),
                "another slot": lambda: dma.Copy(rows, slots.at[0], sems.at[1], name="x",
                                                 slot=1),
                "traced apart": lambda: dma.Copy(rows, slots.at[other], sems.at[slot], name="x",
                                                 slot=other),
                "shape": lambda: dma.Copy(x_hbm.at[pl.ds(0, 16)], slots.at[slot], sems.at[slot],
                                          name="x", slot=slot),
                "dtype": lambda: dma.Copy(rows.bitcast(jnp.int32), slots.at[slot],
                                          sems.at[slot], name="x", slot=slot),
            }[variant]()
            copy.start()
            copy.wait()
            o_ref[...] += slots[copy.slot if isinstance(copy.slot, int) else slot]
            return carry

        o_ref[...] = jnp.zeros_like(o_ref)
        jax.lax.fori_loop(0, 4, step, 0)

    x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((2, 8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
        interpret=tpu.interpret_params())(x)


@pytest.mark.parametrize("variant", ["ring", "one slot value", "equal ints"])
def test_a_copy_into_its_slot_with_its_semaphore_runs(race_checked, variant):
    x = np.arange(32 * 128, dtype=np.float32).reshape(4, 8, 128)
    np.testing.assert_array_equal(np.asarray(_ring_copy(variant)), x.sum(0))


@pytest.mark.parametrize("variant, says", [
    ("another semaphore", ("Copy 'x': slot=1 but the semaphore it signals is at [0]: a copy "
                           "into ring slot s signals semaphore s")),
    ("another slot", "Copy 'x': slot=1 but the ring slot it copies into is at [0]"),
    ("traced apart", ("Copy 'x': its slot and the semaphore it signals are two traced values, "
                      "which tracing cannot tell equal")),
    ("shape", "Copy 'x': src shape (16, 128) != dst shape (8, 128)"),
    ("dtype", "Copy 'x': src dtype int32 != dst dtype float32"),
])
def test_a_mismatched_copy_is_one_line_naming_it_before_it_starts(race_checked, variant, says):
    """Refused while the kernel is traced, before any copy starts: with `make_async_copy` the
    shapes fail at the wait as a numpy broadcast error naming no copy, and a copy signalling
    another slot's semaphore leaves a wait that never returns (interpret mode hangs)."""
    with pytest.raises(ValueError) as error:
        _ring_copy(variant)
    message = str(error.value)
    assert message.startswith(says) and "\n" not in message, message
    if "slot" in says:
        assert message.endswith("Copy(src, slots.at[s], sems.at[s], slot=s)")


def test_a_ring_on_a_row_of_semaphores_checks_the_slot_index():
    """`Ring(buffers, sems.at[ring])` (a 2-D semaphore array, one row per ring) copies into slot
    s signalling sems[ring, s]: the check finds the slot among the semaphore's indices."""
    def kernel(x_hbm, o_ref, slots, sems):
        ring = dma.Ring(slots, sems.at[1], name="x")
        ring.start(x_hbm.at[pl.ds(0, 8)], 0)
        ring.wait(x_hbm.at[pl.ds(0, 8)], 0)
        o_ref[...] = slots[0]
        with pytest.raises(ValueError, match=r"slot=1 but the semaphore it signals is at \[1, 0\]"):
            dma.Copy(x_hbm.at[pl.ds(0, 8)], slots.at[1], sems.at[1].at[0], name="x", slot=1)

    x = jnp.ones((32, 128), jnp.float32)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((2, 8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2, 2))],
        interpret=tpu.interpret_params())(x)
    np.testing.assert_array_equal(np.asarray(out), 1.0)


def test_writeback_direction_in_a_core_map_kernel(race_checked):
    """VMEM -> HBM copies log their direction; pl.kernel (core_map) kernels record like pallas_call."""
    x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)

    @functools.partial(jax.jit, static_argnames=("recording", "interpret"))
    def add_one(x, *, recording, interpret):
        del recording

        @pl.kernel(out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret,
                   mesh=pltpu.create_tensorcore_mesh("core", num_cores=1),
                   scratch_types=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())])
        def kernel(x_hbm, o_hbm, buf_ref, sem):
            dma.Copy(x_hbm, buf_ref, sem, name="in").start().wait()
            with dma.phase("add", flops=x.size):
                buf_ref[...] = buf_ref[...] + 1
            dma.Copy(buf_ref, o_hbm, sem, name="out").start().wait()

        return kernel(x)

    with dma.recording() as log:
        out = add_one(x, recording=dma.is_recording(), interpret=tpu.interpret_params())
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) + 1)
    assert [(e.kind, e.name, e.src, e.dst) for e in log.events] == [
        ("dma_start", "in", "hbm", "vmem"), ("dma_wait", "in", "hbm", "vmem"),
        ("phase_start", "add", None, None), ("phase_end", "add", None, None),
        ("dma_start", "out", "vmem", "hbm"), ("dma_wait", "out", "vmem", "hbm")]
    assert log.dma_bytes() == 2 * x.size * 4 and log.dma_bytes("out") == x.size * 4
