"""The DMA log where kernels are compiled (`kernels/base/chip_log.py`): the kernel run on shapes
records, event for event, what TPU interpret mode records as the kernel runs.

A TPU is faked here: `dma.logs_from_shapes` is made to answer True (as it does on a TPU
while a log records) and interpret mode's own events are switched off (`dma._emitting`), so the
log a wrapper leaves is the one a TPU leaves. Each stage wrapper, a routed MoE layer (given the
reference's routing) and the megakernel step are compared with their interpret-mode log.
"""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import kimi_kinds
from mkresearch.kernels.base import chip_log, dma, gemv, quant
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.compose import megakernel_paged as mkp
from mkresearch.kernels.compose import megakernel_verify as mv
from mkresearch.kernels.stages import experts, kda, mla, router, sampling

from mkresearch.hardware import tpu
from mkresearch.model import paged_kv, reference, weights
from mkresearch.model.config import get_config

MINI = get_config("kimi-k3-mini")


def as_on_a_tpu(run):
    """The log `run()` leaves where kernels are compiled: its events from shapes alone. The
    kernels are traced anew (another vector clock size: another InterpretParams, a static
    argument) with interpret mode's own events off."""
    options = tpu.current_interpret_options()
    with mock.patch.object(dma, "logs_from_shapes", lambda: dma.is_recording() is True), \
            mock.patch.object(dma, "_emitting", lambda: False), \
            tpu.interpret_options(vector_clock_size=(options["vector_clock_size"] or 16) + 1), \
            dma.recording() as log:
        jax.block_until_ready(run())
    return [e.to_record() for e in log]


def interpreted(run):
    with dma.recording() as log:
        jax.block_until_ready(run())
    return [e.to_record() for e in log]


def assert_same_log(run):
    expected, from_shapes = interpreted(run), as_on_a_tpu(run)
    assert expected, "the kernel logged nothing"
    assert len(from_shapes) == len(expected)
    for i, (a, b) in enumerate(zip(from_shapes, expected, strict=True)):
        assert a == b, f"event {i}: from shapes {a} != interpreted {b}"
    return len(expected)


@pytest.fixture(scope="module")
def mini():
    cfg = kimi_kinds(MINI)
    return cfg, weights.init_params(cfg, 0)


def layer(params, kind, index=0):
    return reference.layer_params(params[kind], index)


def test_a_notebooks_own_kernel_logs_from_shapes(race_checked):
    """A `pl.pallas_call` called outside jit inside `dma.recording()` (a notebook's own kernel),
    with an SMEM count deciding how many blocks it copies."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(n_ref, w_hbm, o_ref, slots, sems):
        def block(i, carry):
            slot = i % 2  # named once: the ring slot, its semaphore and the log's slot
            copy = dma.Copy(w_hbm.at[pl.ds(i * 8, 8)], slots.at[slot], sems.at[slot],
                            name="w", slot=slot, k=i)
            copy.start()
            copy.wait()
            with dma.phase("add", flops=8 * 128, k=i):
                o_ref[...] += slots[slot]
            return carry

        o_ref[...] = jnp.zeros_like(o_ref)
        jax.lax.fori_loop(0, n_ref[0], block, 0)

    def run():
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((2, 8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
            interpret=tpu.interpret_params())(jnp.asarray([3], jnp.int32),
                                              jnp.ones((32, 128), jnp.float32))

    assert assert_same_log(run) == 3 * 4


def test_gemv_and_decode_logs_from_shapes(race_checked):
    x = jnp.ones((8, 1024), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(0), (1024, 256), jnp.bfloat16)
    assert assert_same_log(lambda: gemv.gemv_stream(x, w, block_k=256, n_buffers=3)) > 8
    packed = weights.quantize(jax.random.normal(jax.random.key(1), (256, 128), jnp.float32),
                              "mxfp4")
    assert_same_log(lambda: quant.decode(packed, "mxfp4"))


def test_attention_logs_from_shapes(mini, race_checked):
    cfg, params = mini
    batch = 2
    x = jax.random.normal(jax.random.key(2), (batch, cfg.d_model), jnp.bfloat16)
    state = reference.init_state(cfg, batch, 64)
    kda_state = layer(state, "kda")
    assert_same_log(lambda: kda.kda_attention(layer(params, "kda"), x, kda_state["conv"],
                                              kda_state["recurrent"], cfg))
    positions = jnp.asarray([5, 40], jnp.int32)  # two rows, two KV tiles read by the second
    assert_same_log(lambda: mla.mla_attention(layer(params, "mla"), x, layer(state, "mla"),
                                              positions, cfg))


def test_routing_logs_from_shapes(mini, race_checked):
    cfg, params = mini
    x = jax.random.normal(jax.random.key(3), (4, cfg.d_model), jnp.bfloat16)
    p = layer(params, "moe")
    assert_same_log(lambda: router.route(p, x, cfg))  # its own outputs are its choice
    ids, w = reference.route(p, x, cfg)
    assert_same_log(lambda: experts.routed_experts(p, x, ids, w, cfg))
    assert_same_log(lambda: experts.moe_ffn(p, x, cfg))  # given the reference's routing


def test_sampling_logs_from_shapes(mini, race_checked):
    cfg, params = mini
    batch = 2
    snapshots = jax.random.normal(jax.random.key(4), (cfg.n_blocks, batch, cfg.d_model),
                                  jnp.bfloat16)
    partial = jax.random.normal(jax.random.key(5), (batch, cfg.d_model), jnp.bfloat16)
    run = functools.partial(sampling.sample_stage, snapshots, partial, params["mix_out"],
                            params["final_norm"], params["lm_head"], cfg=cfg, seed=0,
                            positions=np.asarray([3, 4]))
    assert_same_log(run)


@pytest.mark.slow
def test_megakernel_step_logs_from_shapes(mini, race_checked):
    """The step given the reference's routing (what a TPU's log is given by default)."""
    cfg, params = mini
    batch = 3
    state = reference.init_state(cfg, batch, 64)
    tokens, positions = jnp.asarray([1, 7, 30], jnp.int32), jnp.asarray([0, 9, 33], jnp.int32)
    run = lambda: mk.decode_step(params, jax.tree.map(jnp.copy, state), tokens, positions,
                                 cfg)[0]
    assert assert_same_log(run) > 100


@pytest.mark.slow
def test_verify_step_logs_from_shapes(mini, race_checked):
    """The verify step (B = 2, K = 2: 6 rows) given the reference's routing of each row."""
    cfg, params = mini
    state = reference.init_state(cfg, 2, 64)
    tokens, positions = jnp.asarray([[1, 7, 30], [4, 2, 9]], jnp.int32), jnp.asarray([0, 9])
    run = lambda: mv.verify_step(params, jax.tree.map(jnp.copy, state), tokens, positions,
                                 cfg)[0]
    assert assert_same_log(run) > 100


@pytest.mark.slow
def test_paged_step_logs_from_shapes(mini, race_checked):
    """The paged decode step (a free slot among the rows), given the paged reference's routing
    of each row; the paged verify step's routing is the same function's over K + 1 tokens
    (`megakernel_paged.paged_routing`), its kernel the verify step's (held above)."""
    cfg, params = mini
    pages = paged_kv.PagedKVConfig(page_size=16, n_pages=8, max_pages_per_row=4)
    state = paged_kv.init_paged_state(cfg, pages, 3)
    table = np.array([[0, 1, -1, -1], [2, -1, -1, -1], [-1, -1, -1, -1]], np.int32)
    positions = np.array([20, 3, -1], np.int32)
    decode = lambda: mkp.paged_decode_step(params, jax.tree.map(jnp.copy, state),
                                           np.array([1, 7, 0], np.int32), positions, table, cfg,
                                           pages)[0]
    assert assert_same_log(decode) > 100


def test_prepared_weights_need_the_routing(mini):
    cfg, params = mini
    state = reference.init_state(cfg, 1, 64)
    with mock.patch.object(dma, "logs_from_shapes", lambda: True), \
            pytest.raises(ValueError, match="expert_ids=None with prepared weights"):
        mk.decode_step(mk.prepare_weights(params, cfg), state, jnp.zeros(1, jnp.int32),
                       jnp.zeros(1, jnp.int32), cfg)
    with mock.patch.object(dma, "logs_from_shapes", lambda: True), \
            pytest.raises(ValueError, match="expert_ids=None with prepared weights: a verify"):
        mv.verify_step(mk.prepare_weights(params, cfg), state, jnp.zeros((1, 2), jnp.int32),
                       jnp.zeros(1, jnp.int32), cfg)


def test_traced_inputs_are_refused(mini):
    cfg, params = mini
    p = layer(params, "moe")
    x = jnp.ones((2, cfg.d_model), jnp.bfloat16)
    ids, w = reference.route(p, x, cfg)
    record = lambda ids: dma.record_from_shapes(
        lambda ids: experts.routed_experts(p, x, ids, w, cfg), ids)
    with pytest.raises(ValueError, match="record outside jit"):
        jax.jit(record)(ids)
