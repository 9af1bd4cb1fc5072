"""The stage registry is the one place a sublayer kind is defined: a toy FFN kind added here, in
this file alone (its model side: weights with their shard rule and the reference; its kernel
side: plan, body; no cost: it is read off the body), is seen by the planner, the step's schedule (its DMAs come from its body:
no list of them is written), the VMEM plan (its buffers are its body's `run_scoped` ones: no list
of them either), the cost estimate, the byte counts and the sharded layout, and runs through the
reference decode step and the megakernel composer, which agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, costs, dma, planned, registry
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.compose import megakernel_plan, megakernel_sharded, schedule

from mkresearch.model import config, numerics, reference, roofline, spec, weights
from mkresearch.sharding import layout, layout_bytes

TOY = "toy_ffn"


def toy_params(cfg):  # its d output columns split across ranks (each rank a chunk, gathered)
    return {"w": spec.matrix(cfg.d_model, cfg.d_model, shard=spec.split(1, spec.MODEL_COLS))}


def toy_sublayer(p, x, layer_state, positions, cfg):
    """m = bf(x W): one matrix, no state."""
    return numerics.bf(numerics.matmul(x, p["w"])), layer_state, {}


def toy_body(plan, refs):
    """out = bf(x W), the product staged in a scoped f32 buffer [B, d] (its VMEM plan's)."""
    rows = blocks.weight_block_rows(tuple(refs.weights["w"].shape), jnp.bfloat16)

    def with_product(product):
        product[...] = blocks.stream_matmul(refs.stream, refs.x[...], refs.weights["w"],
                                            rows=rows, name="toy.w", **refs.indices)
        refs.out[...] = product[...].astype(jnp.bfloat16)

    pl.run_scoped(with_product, pltpu.VMEM(refs.out.shape, jnp.float32))


@pytest.fixture
def toy_kind():
    spec.register(spec.Stage(name=TOY, role=spec.FFN, params=toy_params, sublayer=toy_sublayer,
                             component=("toy", lambda cfg: "toy FFN")))
    registry.register(registry.KernelStage(
        name=TOY, plan=lambda cfg, batch, seq_len, options: (TOY, batch),
        prepare=lambda stack, cfg: dict(stack),
        streamed=lambda cfg: (registry.Streamed("w", "toy.w", (cfg.d_model, cfg.d_model)),),
        body=toy_body, scope=lambda plan: "toy"))
    try:
        yield
    finally:
        spec.unregister(TOY)
        registry.unregister(TOY)


@pytest.mark.slow
def test_a_toy_kind_runs_through_the_composer(race_checked, toy_kind):
    cfg = toy_config()
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
    # no list of the kind's DMAs was written: its body is the step's schedule, event for event
    planned = schedule.schedule(aux["plan"], positions)
    assert planned.exact and planned.mismatch(log) is None, planned.mismatch(log)


def toy_config():
    # one stage's lookahead may not cross two stage boundaries: the toy streams one block
    return config.get_config("kimi-k3-mini", ffn=TOY, n_dense_layers=0, ring_depth=2)


def test_a_toy_kind_is_planned_scheduled_costed_counted_and_sharded(toy_kind):
    """From the kind's two sides alone, with nothing run: the plan (its stage plan, its matrix
    on the weight ring), the schedule (its body's DMAs, one ring block per layer), the cost
    estimate (its FLOPs and bytes), the byte counts (the roofline's component, the schedule's
    tally by component) and the sharded layout (each rank a column chunk: half the bytes, in
    the layout's counts and in a rank's schedule)."""
    cfg = toy_config()
    layers, matrix = cfg.n_layers, cfg.d_model * cfg.d_model * 2  # one layer's W, bf16
    plan = mk.make_plan(cfg, 2, cfg.max_seq_len)
    assert plan.stage_plan(TOY) == (TOY, 2)
    assert [e.name for e in plan.stream.entries(TOY)] == ["toy.w"]
    # the VMEM plan: the toy declares no buffers; its scope is what its body allocates (its
    # matrix on the global ring: no local ring of its own)
    assert [(b.name, b.shape, b.dtype) for b in plan.vmem.buffers if b.scope == "toy"] == [
        ("test_registry.toy_body: product", (2, cfg.d_model), "float32")]
    # the schedule: its body run on shapes, one ring block per layer
    sched = schedule.schedule(plan)
    toy = [dma for dma in sched.starts if dma.stage == TOY]
    assert [dma.layer for dma in toy] == list(range(layers))
    assert {dma.buffer for dma in toy} == {planned.WEIGHT_RING} and toy[0].name == "toy.w"
    by_component = sched.tally(schedule.component)
    assert by_component["toy"].read == layers * matrix == roofline.step_bytes(cfg).read["toy"]
    # the cost estimate, read off the body (the kind writes none): per layer its matrix read
    # once, x W's FLOPs (its 2 rows padded to 8: `numerics.padded_rows`) and the stream's
    # accumulation of its one block ([B, d] adds); the
    # step's bytes are the schedule's (its worst case), the toy's blocks included
    one_layer = megakernel_plan.stage_cost(TOY, plan.stage_plan(TOY), cfg, 2, cfg.max_seq_len)
    assert one_layer == costs.Cost(flops=2 * numerics.ROW_TILE * cfg.d_model ** 2 + 2 * cfg.d_model,
                                   bytes_accessed=matrix)
    step = mk.step_cost(plan, *mk.step_shapes(plan))
    assert step.bytes_accessed == sched.total.read + sched.total.written
    assert step.flops >= layers * one_layer.flops
    # sharded: each of 2 ranks holds half of W's columns, counted and streamed
    lay = layout.layout(cfg, 2)
    assert layout.rank_param_shapes(lay)[TOY]["w"].shape == (layers, cfg.d_model,
                                                             cfg.d_model // 2)
    assert layout_bytes.rank_bytes(lay, 2).component("toy") == layers * matrix // 2
    ranked = schedule.schedule(megakernel_sharded.make_sharded_plan(lay, 2), rank=1)
    assert ranked.tally(schedule.component)["toy"].read == layers * matrix // 2


def test_an_unregistered_kind_is_refused_naming_the_field():
    cfg = config.get_config("kimi-k3-mini", ffn="no_such_kind", n_dense_layers=0)
    with pytest.raises(ValueError, match=r"ModelConfig.ffn='no_such_kind' is invalid: layer kind "
                                         r"'no_such_kind' is not a registered ffn kind"):
        weights.param_shapes(cfg)
    with pytest.raises(ValueError, match=r"ModelConfig.attention='moe' is invalid"):
        mk.make_plan(config.get_config("kimi-k3-mini", attention="moe"), 1, 128)


# ---- the layer table: a kind id and an index per layer, every kind with a layer -----------------
def test_kind_table_gives_each_layer_its_kind_and_place_in_the_kind_stack():
    from mkresearch.kernels.base import weight_stream

    assert weight_stream.kind_table(("mlp", "glu", "glu", "mlp"), ("mlp", "glu")) == (
        0, 0, 1, 0, 1, 1, 0, 1)
    for name in config.config_names():  # the megakernel's table is two of these, interleaved
        cfg = config.get_config(name)
        attention, ffn = weight_stream.stage_kinds(cfg)
        table = np.asarray(weight_stream.layer_table(cfg)).reshape(cfg.n_layers, 4)
        assert tuple(table[:, :2].ravel()) == weight_stream.kind_table(cfg.attention_kinds,
                                                                       attention)
        assert tuple(table[:, 2:].ravel()) == weight_stream.kind_table(cfg.ffn_kinds, ffn)


@pytest.mark.parametrize("pattern, kinds, says", [
    (("mlp", "mlp"), ("mlp", "glu"), ("kind 'glu' has no layer in the pattern ['mlp', 'mlp']: "
                                      "its stacked weights would be empty")),
    (("mlp", "tanh"), ("mlp",), "kind 'tanh' of the pattern is not one of the kinds ['mlp']"),
])
def test_a_kind_without_a_layer_is_one_line_naming_it(pattern, kinds, says):
    """Its stack would be [0, ...]: Pallas refuses an empty operand only deep in its block
    padding, as a bare ZeroDivisionError; the table refuses it first, naming the kind."""
    from mkresearch.kernels.base import weight_stream

    with pytest.raises(ValueError) as error:
        weight_stream.kind_table(pattern, kinds)
    assert str(error.value).startswith(says) and "\n" not in str(error.value)
