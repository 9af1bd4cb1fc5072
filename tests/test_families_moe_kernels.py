"""The families' router and MoE kernels (kernels/stages/router.py with the group-limited first stage,
kernels/stages/moe_full.py) against the reference (mkresearch.model.stages.ffn.route, stages.moe_full), in
TPU interpret mode with races checked; and Kimi's LM head + sampling stage reused as it is for a
pre-norm model's last step.

Tolerances (docs/kimi-k3.md §11): router ids exact, engineered ties and the group-limited
selection included; weights rtol 1e-6. MoE outputs within a bf16 ulp of the output's scale
(|kernel − ref| ≤ 2^-7 · max|ref|); on these shapes they are in fact bit-equal. Expert bytes in
the DMA log = distinct experts of the batch × bytes of one expert, to the byte.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import dense_and_one_moe, first_layers
from mkresearch.kernels.base import costs, dma
from mkresearch.kernels.stages import experts, moe_full, router
from mkresearch.kernels.stages import sampling as sampling_kernel

from mkresearch.hardware import tpu
from mkresearch.model import config, reference, weights
from mkresearch.model.stages import ffn
from mkresearch.model.stages import moe_full as moe_full_ref

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

MINIS = {name: config.get_config(name) for name in (
    "deepseek-v3-mini", "glm-4.5-mini", "qwen3-235b-a22b-mini")}
DEEPSEEK = MINIS["deepseek-v3-mini"]
RTOL = 2.0 ** -7


@pytest.fixture(scope="module")
def layers():
    """Each mini's MoE layer 0, drawn from the mini cut to its dense layers and one MoE layer:
    each leaf comes from its own stream, layer by layer, so these are the whole mini's weights,
    bit for bit, without drawing the other MoE layers' experts."""
    out = {}
    for name, cfg in MINIS.items():
        cut = dense_and_one_moe(cfg)
        out[name] = reference.layer_params(weights.init_params(cut, 0)["moe_full"], 0)
    return out


def activations(batch, d=512, seed=1):
    x = np.random.default_rng(seed).standard_normal((batch, d))
    return jnp.asarray(x / np.sqrt(np.mean(x * x, -1, keepdims=True)), jnp.bfloat16)


def assert_route_equal(got, want):
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6, atol=0)


# ---- the router -----------------------------------------------------------------------------------
ROUTER_CASES = {name: cfg for name, cfg in MINIS.items()}
ROUTER_CASES["deepseek-v3-mini unnormalised"] = DEEPSEEK.replace(router_normalize=False)


@pytest.mark.parametrize("case", ROUTER_CASES)
@pytest.mark.slow
def test_router_matches_reference(race_checked, layers, case):
    cfg = ROUTER_CASES[case]
    p = layers[case.split()[0]]
    x = activations(8)
    with dma.recording() as log:
        got = router.route(p, x, cfg)
    assert_route_equal(got, ffn.route(p, x, cfg))
    assert log.dma_bytes("router/w_router") == weights.nbytes(p["w_router"])
    if cfg.router_groups > 1:
        size = cfg.n_experts // cfg.router_groups
        assert all(len(set(row // size)) <= cfg.router_topk_groups for row in np.asarray(got[0]))


def test_router_engineered_ties_and_groups(race_checked, layers):
    """Group 1 copies group 0 (their group scores tie: the lower group goes first), expert 2
    copies expert 1 (within a group: 1 before 2), and group 3 holds the best single expert but
    the weakest pair (the group limit drops it)."""
    p = layers["deepseek-v3-mini"]
    w = np.asarray(p["w_router"].astype(jnp.float32)).copy()
    bias = np.asarray(p["router_bias"]).copy()
    w[:, 4:8], bias[4:8] = w[:, 0:4], bias[0:4]
    w[:, 2], bias[2] = w[:, 1], bias[1]
    w[:, 6], bias[6] = w[:, 1], bias[1]
    w[:, [1, 2, 5, 6]] += 0.01  # x >= 0: these lead their groups
    w[:, 12] += 0.03  # the best expert overall, alone in group 3
    w[:, 13:16] -= 0.03
    p = {**p, "w_router": jnp.asarray(w, jnp.bfloat16), "router_bias": jnp.asarray(bias)}
    x = jnp.abs(activations(4, seed=2))
    got = router.route(p, x, DEEPSEEK)
    assert_route_equal(got, ffn.route(p, x, DEEPSEEK))
    ids = np.asarray(got[0])
    assert 12 not in ids  # its group's top-2 sum loses to groups 0 and 1
    np.testing.assert_array_equal(np.sort(ids, -1), np.tile([1, 2, 5, 6], (4, 1)))
    assert (ids[:, 0] == 1).all()  # ties: the lowest index first


@pytest.mark.slow
def test_group_limit_vector_form_equals_the_reference():
    """The kernel's vector form (no [B, G] array) against the reference's reshape + top_k, on
    random scores with ties inside and across groups, for every (groups, kept) of 16 experts."""
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, (64, 16)).astype(np.float32) / 4  # many exact ties
    iota = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    for groups in (2, 4, 8):
        for kept in range(1, groups + 1):
            got = router.limit_to_groups(jnp.asarray(scores), iota, groups, kept)
            want = ffn.limit_to_groups(jnp.asarray(scores), groups, kept)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kwargs, match", [({"groups": 3}, "groups"), ({"groups": 16}, "groups"),
                                           ({"groups": 4, "topk_groups": 5}, "topk_groups"),
                                           ({"groups": 8, "topk_groups": 1}, "topk_groups"),
                                           ({"normalize": 1}, "normalize")])
def test_router_rejects_bad_grouping(layers, kwargs, match):
    p = layers["deepseek-v3-mini"]
    with pytest.raises(ValueError, match=match):
        router.route_with(activations(2), p["w_router"], p["router_bias"], top_k=4, **kwargs)


# ---- the MoE layer on the full d --------------------------------------------------------------------
@pytest.mark.parametrize("name", MINIS)
@pytest.mark.slow
def test_moe_full_matches_reference_one_kernel(race_checked, layers, name):
    cfg, p = MINIS[name], layers[name]
    x = activations(4, seed=4)
    with dma.recording() as log:
        out = moe_full.moe_full_ffn(p, x, cfg)
    want = moe_full_ref.moe_full_ffn(p, x, cfg)
    err = np.abs(np.asarray(out, np.float32) - np.asarray(want, np.float32))
    print(f"moe_full {name}: max |kernel - reference| = {err.max():.3g}")
    assert err.max() <= RTOL * np.abs(np.asarray(want, np.float32)).max()
    ids = np.asarray(ffn.route(p, x, cfg)[0])
    one_expert = weights.expert_nbytes(cfg)
    assert log.dma_bytes(experts.EXPERT_DMA_PREFIX) == len(np.unique(ids)) * one_expert
    shared = sum(weights.nbytes(p[k]) for k in ("w_sg", "w_su", "w_sd") if k in p)
    assert log.dma_bytes("shared/") == shared
    assert "latent/" not in {e.name[:7] for e in log.select("dma_start")}  # no latent here
    # the declared cost: every weight, min(E, B·k) experts at most (here fewer: shared ones);
    # x and the output around the body
    declared = costs.declared(lambda x: moe_full.moe_full_ffn(p, x, cfg), x)
    unused = min(cfg.n_experts, 4 * cfg.top_k) - len(np.unique(ids))
    assert declared.bytes_accessed - unused * one_expert - 2 * costs.nbytes(x) == (
        log.dma_bytes() - log.dma_bytes("router/ids_to_smem")
        - log.dma_bytes("router/weights_to_smem"))


@pytest.mark.slow
def test_moe_full_routed_part_and_batch_invariance(race_checked, layers):
    cfg, p = DEEPSEEK, layers["deepseek-v3-mini"]  # FP8 experts, decoded in VMEM
    x = activations(5, seed=5)
    ids, w = ffn.route(p, x, cfg)
    got = moe_full.routed_experts(p, x, ids, w, cfg)
    want = moe_full_ref.routed_experts(p, x, ids, w, cfg)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=RTOL * float(jnp.abs(want).max()))
    whole = np.asarray(moe_full.moe_full_ffn(p, x, cfg))
    for rows in ([3], [4, 0, 2]):
        part = moe_full.moe_full_ffn(p, x[np.array(rows)], cfg)
        np.testing.assert_array_equal(np.asarray(part), whole[rows])


@pytest.mark.slow
def test_moe_full_fp8_mxu_bit_equal_to_reference(race_checked, layers):
    """DeepSeek-V3's mini (FP8 experts on the full d) with expert_mxu="fp8": the routed part's
    block-scaled products (`numerics.block_scaled_matmul`) equal the reference's to the bit."""
    cfg, p = DEEPSEEK.replace(expert_mxu="fp8"), layers["deepseek-v3-mini"]
    x = activations(3, seed=6)
    ids, w = ffn.route(p, x, cfg)
    got = moe_full.routed_experts(p, x, ids, w, cfg)
    want = moe_full_ref.routed_experts(p, x, ids, w, cfg)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))


# ---- the LM head and sampling stage, reused -----------------------------------------------------------
@pytest.mark.slow
def test_sampling_stage_gives_a_prenorm_models_logits(race_checked):
    """The sampling body mixes candidates before RMSNorm and the LM head; given the final hidden
    state h twice (a snapshot and the partial sum), the mix is h exactly (α = ½, ½ and ½h + ½h =
    h), so the body computes a pre-norm model's RMSNorm(h) W_lm and its greedy token unchanged."""
    cfg = config.get_config("qwen3-235b-a22b-mini")
    # the final norm and LM head only: the mini cut to one layer draws them bit for bit the same
    params = weights.init_params(first_layers(cfg, 1), 0)
    h = activations(3, seed=6) * 3  # the residual stream: not normalised
    out = sampling_kernel.sample_stage(h[None], h, jnp.zeros((cfg.d_model,), jnp.float32),
                                       params["final_norm"], params["lm_head"], cfg=cfg, seed=0,
                                       positions=jnp.zeros(3, jnp.int32), return_logits=True)
    want = reference.head_logits(params, h, cfg)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(jnp.argmax(want, -1)))


# ---- compilation for TPU7x ----------------------------------------------------------------------------
# per-rank-like: DeepSeek-V3 with expert parallelism 8 x expert-tensor parallelism 4 (32 of 256
# experts, a 512-wide slice of the 2048 hidden, and of the shared expert), FP8 experts, B = 8
RANK = config.get_config("deepseek-v3", n_experts=32, expert_hidden=512, shared_hidden=512)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek-v3-mini", "deepseek-v3", "deepseek-v3-rank",
                                  "qwen3-235b-a22b-mini"])
def test_compiles_for_tpu7x(name):
    cfg = RANK if name == "deepseek-v3-rank" else config.get_config(name)
    shapes = weights.param_shapes(cfg)["moe_full"]
    layer_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), shapes)
    x = jax.ShapeDtypeStruct((8, cfg.d_model), jnp.bfloat16)
    if name == "deepseek-v3":  # the whole router (256 experts, 8 groups): the layer is too big
        p = {k: layer_shapes[k] for k in ("w_router", "router_bias")}
        result = tpu.compile_for(lambda p, x: router.route(p, x, cfg), p, x, chip="tpu7x")
    else:
        result = tpu.compile_for(lambda p, x: moe_full.moe_full_ffn(p, x, cfg), layer_shapes, x,
                                 chip="tpu7x")
    print(f"{name}: {result}")
    assert result.n_mosaic_kernels == 1
