"""An always-on MLP's gate and up streamed as one matrix where a rank's hidden slice is under whole
lanes (`kernels/stages/gate_up.py`): the partial-sum layout's half-lane FFN hidden chunks, the
fused shapes the weight ring streams, the product split back, the W_down blocks of whole
sublanes, and the bytes a rank reads."""

import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.base import blocks
from mkresearch.kernels.base.registry import Streamed
from mkresearch.kernels.compose import megakernel_sharded as ms
from mkresearch.kernels.stages import gate_up

from mkresearch.model import numerics, spec
from mkresearch.model.config import get_config
from mkresearch.sharding import layout as layouts

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu


@pytest.mark.parametrize("model, n_ranks, shared, dense", [
    ("kimi-k3", 32, 192, 1088), ("deepseek-v3", 32, 64, 576), ("glm-4.5", 32, 64, 384),
    ("kimi-k3-mini", 8, 64, 128)])
def test_partial_sum_hidden_in_half_lane_chunks(model, n_ranks, shared, dense):
    """Partial-sum: ceil(hidden / ranks) rounded up to 64 (every rank real data of Kimi K3's
    6,144 shared hidden); exact mode keeps whole lane tiles (256 for Kimi K3)."""
    cfg = get_config(model)
    lay = layouts.layout(cfg, n_ranks, collectives="partial-sum")
    assert lay.local_length(spec.FFN_HIDDEN, cfg.shared_hidden) == shared
    assert lay.local_length(spec.FFN_HIDDEN, cfg.dense_hidden) == dense
    exact = layouts.layout(cfg, n_ranks)
    assert exact.local_length(spec.FFN_HIDDEN, cfg.shared_hidden) % 128 == 0


def test_the_ring_streams_gate_and_up_as_one():
    """Kimi K3 on 32 ranks: the shared experts' [7168, 384] and W_down [192, 7168] in blocks of
    96 rows; the dense FFN's [7168, 2176] and [1088, 7168] in blocks of 64; exact mode unfused."""
    lay = layouts.layout(get_config("kimi-k3"), 32, collectives="partial-sum")
    plan = ms.make_sharded_plan(lay, 1)
    entries = {e.name: e for _, es in plan.mega.stream.stages for e in es}
    assert (entries["shared/w_gate_up"].k, entries["shared/w_gate_up"].n) == (7168, 384)
    assert "shared/w_gate" not in entries and "shared/w_up" not in entries
    assert (entries["shared/w_down"].k, entries["shared/w_down"].rows) == (192, 96)
    assert (entries["dense/w_gate_up"].n, entries["dense/w_down"].rows) == (2176, 64)
    exact = ms.make_sharded_plan(layouts.layout(get_config("kimi-k3"), 32, collectives="exact"),
                                 1)
    names = {e.name for _, es in exact.mega.stream.stages for e in es}
    assert {"shared/w_gate", "shared/w_up"} <= names and "shared/w_gate_up" not in names


def test_fuse_parts_and_split():
    rng = np.random.default_rng(0)
    gate, up = (jnp.asarray(rng.standard_normal((3, 256, 64)), jnp.bfloat16) for _ in range(2))
    down = jnp.zeros((3, 64, 256), jnp.bfloat16)
    stack = gate_up.fuse({"w_sg": gate, "w_su": up, "w_sd": down, "w_router": 1},
                         gate_up.SHARED_KEYS)
    assert set(stack) == {"w_sgu", "w_sd", "w_router"} and stack["w_sgu"].shape == (3, 256, 128)
    parts = gate_up.parts(stack, gate_up.SHARED_KEYS)
    assert list(parts) == [gate_up.GATE_UP, "w_down"]
    # whole lanes: left as they are
    whole = {"w_gate": jnp.zeros((256, 128)), "w_up": jnp.zeros((256, 128)),
             "w_down": jnp.zeros((128, 256))}
    assert gate_up.fuse(whole, gate_up.DENSE_KEYS) is whole
    assert list(gate_up.parts(whole, gate_up.DENSE_KEYS)) == ["w_gate", "w_up", "w_down"]
    assert gate_up.parts({"w_router": 1}, gate_up.SHARED_KEYS) is None
    # the fused product's columns are the two products' (the bits the body splits)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    g, u = gate_up.split(numerics.matmul(x, stack["w_sgu"][0]), 64)
    np.testing.assert_array_equal(g, numerics.matmul(x, gate[0]).astype(jnp.bfloat16))
    np.testing.assert_array_equal(u, numerics.matmul(x, up[0]).astype(jnp.bfloat16))


def test_fuse_streamed_keeps_the_body_order():
    ms_ = (Streamed("w_router", "router/w_router", (512, 128)),
           Streamed("w_sg", "shared/w_gate", (512, 64)), Streamed("w_su", "shared/w_up", (512, 64)),
           Streamed("w_sd", "shared/w_down", (64, 512)))
    fused = gate_up.fuse_streamed(ms_)
    assert [m.name for m in fused] == ["router/w_router", "shared/w_gate_up", "shared/w_down"]
    assert fused[1] == Streamed("w_sgu", "shared/w_gate_up", (512, 128))
    assert gate_up.fuse_streamed(ms_[:1]) == ms_[:1]


def test_block_rows_of_a_half_lane_slice():
    """A K that is a multiple of 128 keeps blocks of whole lanes; a rank's W_down slice of 192 or
    64 rows: the largest divisor in whole sublanes (16) within the limit."""
    bf16 = jnp.bfloat16
    assert blocks.weight_block_rows((7168, 7168), bf16, block_rows=128) == 128
    assert blocks.weight_block_rows((192, 7168), bf16, block_rows=128) == 96
    assert blocks.weight_block_rows((1088, 7168), bf16, block_rows=128) == 64
    assert blocks.weight_block_rows((64, 512), bf16) == 64
