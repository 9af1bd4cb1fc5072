"""The stage registry is the one place a sublayer kind is defined: a toy FFN kind added here, in
this file alone (its weights, reference, kernel body and schedule), runs through the reference
decode step, the roofline, the megakernel composer and the step's schedule, and they agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.base import blocks, costs, dma, registry
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.compose import schedule

from mkresearch.model import config, numerics, reference, roofline, spec, weights

TOY = "toy_ffn"


def toy_params(cfg):
    return {"w": spec.matrix(cfg.d_model, cfg.d_model)}


def toy_sublayer(p, x, layer_state, positions, cfg):
    """m = bf(x W): one matrix, no state."""
    return numerics.bf(numerics.matmul(x, p["w"])), layer_state, {}


def toy_body(plan, refs):
    rows = blocks.weight_block_rows(tuple(refs.weights["w"].shape), jnp.bfloat16)
    refs.out[...] = blocks.stream_matmul(refs.stream, refs.x[...], refs.weights["w"], rows=rows,
                                         name="toy.w", **refs.indices).astype(jnp.bfloat16)


def toy_schedule(plan, call):
    """The body's DMAs as data: its one matrix through the stream it is given."""
    rows = blocks.weight_block_rows(tuple(call.weights["w"].shape), jnp.bfloat16)
    return call.matmul("toy.w", call.weights["w"], rows, **call.indices)


@pytest.fixture
def toy_kind():
    spec.register(spec.Stage(name=TOY, role=spec.FFN, params=toy_params, sublayer=toy_sublayer,
                             component=("toy", lambda cfg: "toy FFN")))
    registry.register(registry.KernelStage(
        name=TOY, plan=lambda cfg, batch, seq_len, options: (TOY, batch),
        prepare=lambda stack, cfg: dict(stack),
        streamed=lambda cfg: (registry.Streamed("w", "toy.w", (cfg.d_model, cfg.d_model)),),
        body=toy_body, vmem=lambda plan, cfg: [],
        cost=lambda plan, w, state, cfg, batch: costs.Cost(
            flops=costs.matmul_flops(batch, w["w"]), bytes_accessed=costs.nbytes(w)),
        schedule=toy_schedule))
    try:
        yield
    finally:
        spec.unregister(TOY)
        registry.unregister(TOY)


@pytest.mark.slow
def test_a_toy_kind_runs_through_the_composer(race_checked, toy_kind):
    # one stage's lookahead may not cross two stage boundaries: the toy streams one block
    cfg = config.get_config("kimi-k3-mini", ffn=TOY, n_dense_layers=0, ring_depth=2)
    assert cfg.ffn_kinds == (TOY,) * cfg.n_layers and cfg.kinds == ("kda", "mla", TOY)
    params = weights.init_params(cfg, 0)
    assert params[TOY]["w"].shape == (cfg.n_layers, cfg.d_model, cfg.d_model)
    step = roofline.step_bytes(cfg)
    assert step.read["toy"] == cfg.n_layers * cfg.d_model ** 2 * 2 and "toy" in step.components

    tokens, positions = np.array([5, 9], np.int32), np.array([0, 3], np.int32)
    logits, _, _ = reference.decode_step(params, reference.init_state(cfg, 2), tokens, positions,
                                         cfg)
    with dma.recording() as log:
        _, _, aux = mk.decode_step(params, reference.init_state(cfg, 2), tokens, positions, cfg,
                                   return_logits=True)
        jax.block_until_ready(aux["logits"])
    np.testing.assert_array_equal(np.asarray(aux["logits"]), np.asarray(logits))
    toy_blocks = log.select("dma_start", "toy.w")
    assert len(toy_blocks) == cfg.n_layers  # one block per layer, through the global ring
    assert log.dma_bytes("toy.w") == step.read["toy"]
    # the kind brought its own schedule: the step's DMAs are planned, event for event
    planned = schedule.schedule(aux["plan"], positions)
    assert planned.exact and planned.mismatch(log) is None, planned.mismatch(log)


def test_an_unregistered_kind_is_refused_naming_the_field():
    cfg = config.get_config("kimi-k3-mini", ffn="no_such_kind", n_dense_layers=0)
    with pytest.raises(ValueError, match=r"ModelConfig.ffn='no_such_kind' is invalid: layer kind "
                                         r"'no_such_kind' is not a registered ffn kind"):
        weights.param_shapes(cfg)
    with pytest.raises(ValueError, match=r"ModelConfig.attention='moe' is invalid"):
        mk.make_plan(config.get_config("kimi-k3-mini", attention="moe"), 1, 128)
