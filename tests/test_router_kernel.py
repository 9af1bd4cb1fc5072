"""Router kernel (mkresearch.kernels.stages.router) against mkresearch.model.reference.route (docs/kimi-k3.md §6.1).

ids exact (engineered ties included), weights within 1e-6 relative, the correction bias moves the
selection but never the weights, ids/weights end in SMEM, bad input -> ValueError, and the kernel
compiles for TPU7x at mini and per-rank shapes. Interpret mode with the race detector on.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.base import dma
from mkresearch.kernels.stages import router

from mkresearch.hardware import tpu
from mkresearch.model import config, reference, weights
from mkresearch.model.config import get_config

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

MINI = config.get_config("kimi-k3-mini")


@pytest.fixture(scope="module")
def layer():
    params = weights.init_params(MINI, seed=0)
    return reference.layer_params(params["moe"], 0)


def activations(batch, seed=1, d=MINI.d_model):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((batch, d)), jnp.bfloat16)


def assert_route_equal(got, want):
    ids, w = (np.asarray(a) for a in got)
    ref_ids, ref_w = (np.asarray(a) for a in want)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("batch", [1, 8])
def test_matches_reference(race_checked, layer, batch):
    x = activations(batch)
    with dma.recording() as log:
        got = router.route(layer, x, MINI)
    assert_route_equal(got, reference.route(layer, x, MINI))
    # the ids and weights leave the kernel from SMEM, moved there by DMA
    to_smem = [e for e in log.select("dma_start") if e.dst == "smem"]
    assert {e.name for e in to_smem} == {"router/ids_to_smem", "router/weights_to_smem"}
    # every router weight byte is read once
    assert log.dma_bytes("router/w_router") == weights.nbytes(layer["w_router"])


def test_engineered_ties_go_to_the_lower_index(race_checked, layer):
    # experts 3, 5, 9 and 12 get identical W_r columns and bias: their selection scores tie
    # exactly, so the order of their ids must be 3 < 5 < 9 < 12 whichever wins the row.
    w_router = np.asarray(layer["w_router"]).copy()
    bias = np.asarray(layer["router_bias"]).copy()
    tied = [3, 5, 9, 12]
    w_router[:, tied] = w_router[:, [3]] + 0.5  # large: these four win every row's top 4
    bias[tied] = 0.0
    p = {**layer, "w_router": jnp.asarray(w_router, jnp.bfloat16),
         "router_bias": jnp.asarray(bias)}
    x = jnp.abs(activations(4))  # positive x with positive column shift: the tied four lead
    got = router.route(p, x, MINI)
    want = reference.route(p, x, MINI)
    assert_route_equal(got, want)
    np.testing.assert_array_equal(np.asarray(got[0]), np.tile(tied, (4, 1)))


def test_bias_changes_selection_not_weights(race_checked, layer):
    x = activations(8, seed=3)
    no_bias = MINI.replace(router_bias=False)
    ids_b, w_b = (np.asarray(a) for a in router.route(layer, x, MINI))
    ids_0, w_0 = (np.asarray(a) for a in router.route(layer, x, no_bias))
    assert_route_equal((ids_0, w_0), reference.route(layer, x, no_bias))
    assert (np.sort(ids_b, -1) != np.sort(ids_0, -1)).any(), "the bias should move a selection"
    # with or without bias, a weight is the plain score over the sum of the chosen plain scores
    logits = np.asarray(jnp.dot(x, layer["w_router"], preferred_element_type=jnp.float32))
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    for ids, w in ((ids_b, w_b), (ids_0, w_0)):
        top = np.take_along_axis(scores, ids, -1)
        np.testing.assert_allclose(w, top / top.sum(-1, keepdims=True), rtol=1e-5)
    # rows whose selection the bias left alone keep exactly the same weights
    same = (ids_b == ids_0).all(-1)
    assert same.any()
    np.testing.assert_allclose(w_b[same], w_0[same], rtol=1e-6)


def test_softmax_router_and_routed_scale(race_checked, layer):
    x = activations(4, seed=5)
    for cfg in (MINI.replace(router_score="softmax"), MINI.replace(routed_scale=2.5)):
        assert_route_equal(router.route(layer, x, cfg), reference.route(layer, x, cfg))


@pytest.mark.parametrize("kwargs, match", [
    ({"top_k": 17}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"router_score": "sparsemax"}, "router_score"),
])
def test_bad_options(layer, kwargs, match):
    options = {"top_k": 4, "router_score": "sigmoid", **kwargs}
    with pytest.raises(ValueError, match=match):
        router.route_with(activations(2), layer["w_router"], layer["router_bias"], **options)


def test_bad_shapes(layer):
    with pytest.raises(ValueError, match="x must be"):
        router.route(layer, activations(2).astype(jnp.float32), MINI)
    with pytest.raises(ValueError, match="w_router"):
        router.route(layer, activations(2, d=256), MINI)
    with pytest.raises(ValueError, match="router_bias"):
        router.route({**layer, "router_bias": layer["router_bias"][:8]}, activations(2), MINI)


@pytest.mark.parametrize("name", ["kimi-k3-mini", "kimi-k3-rank"])
def test_compiles_for_tpu7x(name):
    cfg = get_config(name)
    moe = weights.param_shapes(cfg)["moe"]
    p = {k: jax.ShapeDtypeStruct(moe[k].shape[1:], moe[k].dtype)
         for k in ("w_router", "router_bias")}
    x = jax.ShapeDtypeStruct((8, cfg.d_model), jnp.bfloat16)
    result = tpu.compile_for(lambda p, x: router.route(p, x, cfg), p, x, chip="tpu7x")
    assert result.n_mosaic_kernels == 1
