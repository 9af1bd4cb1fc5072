"""The op-by-op step on JAX's own kernels (mkresearch/baselines/jax_kernels.py) equals the
reference within its stated bound on every mini (each cut to the first layer of each of its
kinds here; the whole minis over 24 seeds in the exhaustive tier), on a paged GQA cache as the
package's paged reference, and compiles with Mosaic for the v5e."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import changed_fields, dense_and_one_moe, first_layers, kimi_kinds

from mkresearch.baselines import jax_kernels, jax_kernels_sweep
from mkresearch.baselines.jax_kernels_sweep import Case, compare
from mkresearch.hardware import tpu
from mkresearch.model import paged_kv, reference, weights
from mkresearch.model.config import get_config

# libtpu allows one process at a time by default; tests on a shared machine compile concurrently
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

BOUND = jax_kernels.SAME_ROUTING_BOUND


def _cut(name: str, cut, **overrides) -> tuple:
    cfg = get_config(name, **overrides)
    return tuple(overrides.items()) + changed_fields(cfg, cut(cfg))


# every mini, each of its kinds: Kimi K3's in MXFP4 (the gathered and decoded experts) with
# either MLA cache layout, DeepSeek's in FP8, GLM's and Qwen3's in bf16 (gmm on the stacked
# experts), Qwen3's on a paged cache (its attention in the kernel's XLA twin, `paged_attention`)
CASES = {
    "kimi-k3 expanded mxfp4": Case("kimi-k3-mini", 3, _cut("kimi-k3-mini", kimi_kinds)),
    "kimi-k3 latent mxfp4": Case("kimi-k3-mini", 2, _cut("kimi-k3-mini", kimi_kinds,
                                                         mla_cache_layout="latent")),
    "deepseek-v3 fp8": Case("deepseek-v3-mini", 3, _cut("deepseek-v3-mini", dense_and_one_moe)),
    "glm-4.5 bf16": Case("glm-4.5-mini", 2, _cut("glm-4.5-mini", dense_and_one_moe)),
    "qwen3 bf16": Case("qwen3-235b-a22b-mini", 3, _cut("qwen3-235b-a22b-mini", dense_and_one_moe)),
    "qwen3 paged": Case("qwen3-235b-a22b-mini", 3, _cut("qwen3-235b-a22b-mini", dense_and_one_moe),
                        paged=True),
}


def within_claim(rows) -> list:
    """The row-steps that break the claim: |Δlogit| over the bound while the row's routing
    equals the reference's, or another greedy token there away from a near-tie."""
    return [r for r in rows if not r.diverged and (
        r.dlogit > BOUND or (r.token_differs and r.top_two_gap > 2 * BOUND))]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_op_by_op_step_is_the_reference_within_its_bound(case):
    rows = compare(case, seed=3, steps=3)
    assert not within_claim(rows), [r.record() for r in within_claim(rows)]
    assert any(r.dlogit == 0 for r in rows)  # the rows compared are the same model's


@pytest.mark.exhaustive
@pytest.mark.parametrize("case", jax_kernels_sweep.SWEEP, ids=lambda c: c.label)
def test_the_sweep_stays_within_the_bound(case):
    """The measurement behind the bound (`python -m mkresearch.baselines.jax_kernels_sweep`):
    each case over 24 seeds of 4 steps."""
    rows = [r for seed in range(24) for r in compare(case, seed, 4)]
    assert not within_claim(rows), [r.record() for r in within_claim(rows)]


def test_gmm_takes_all_rows_in_one_tile_and_weight_tiles_of_2_mib():
    assert jax_kernels.gmm_tiling(16, 256, 256) == (16, 256, 256)  # a mini's expert: one tile
    assert jax_kernels.gmm_tiling(64, 2048, 1408) == (64, 512, 1408)  # 1.4 MiB of whole rows
    assert jax_kernels.gmm_tiling(512, 7168, 2048) == (512, 512, 2048)  # 2 MiB
    assert jax_kernels.gmm_tiling(16, 256, 1 << 14) == (16, 128, 8192)  # a row past 2 MiB: split


def test_the_paged_attention_twin_is_ragged_paged_attentions_reference():
    """In interpret mode the paged step's attention is the kernel's XLA twin: its arithmetic is
    the kernel's own reference (which rounds the probabilities to bf16 first: a few bf16 ulps)."""
    rng = np.random.default_rng(0)
    batch, heads, kv_heads, dim, size, per_row = 3, 4, 2, 128, 16, 4
    pool = jnp.asarray(rng.standard_normal((batch * per_row + 2, size, 2 * kv_heads, dim)),
                       jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((batch, heads, dim)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(batch * per_row + 2)[:batch * per_row].reshape(
        batch, per_row), jnp.int32)
    lengths = jnp.array([1, 37, 64], jnp.int32)
    got = jax_kernels.paged_attention_xla(q, pool, lengths, tables, dim ** -0.5)
    want = jax_kernels.rpa.ref_ragged_paged_attention(
        q, pool, lengths, tables, jnp.arange(batch + 1, dtype=jnp.int32),
        jnp.array([batch], jnp.int32), sm_scale=dim ** -0.5)
    assert got.shape == want.shape == (batch, heads, dim)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=0.03, rtol=0.03)


@pytest.mark.tpu
def test_paged_attention_is_its_xla_twin():
    """On a TPU: ragged paged attention, compiled, against its XLA twin on the same pool (bf16
    out, the kernel's probabilities in its own order: a few bf16 ulps). In interpret mode the
    step's paged attention is the twin itself."""
    cfg = get_config("glm-4.5-mini")  # 4 query heads on 2 K/V heads of 128
    pages = paged_kv.PagedKVConfig(16, 14, 4)
    rng = np.random.default_rng(2)
    pool = jnp.asarray(rng.standard_normal((14, 16, 2 * cfg.n_kv_heads, cfg.head_dim)),
                       jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((3, cfg.n_heads, cfg.head_dim)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(14)[:12].reshape(3, 4), jnp.int32)
    lengths = jnp.array([1, 37, 64], jnp.int32)
    got = jax.jit(lambda *a: jax_kernels.paged_attention(*a, cfg, pages, tpu.interpret_params()))(
        q, pool, lengths, tables)
    want = jax_kernels.paged_attention_xla(q, pool, lengths, tables, cfg.head_dim ** -0.5)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=0.03, rtol=0.03)


def test_the_paged_layout_holds_the_packages_paged_state():
    cfg = get_config("qwen3-235b-a22b-mini")
    pages = paged_kv.PagedKVConfig(16, 8, 4)
    rng = np.random.default_rng(1)
    state = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype),
                         paged_kv.paged_state_shapes(cfg, pages, 2))
    ours = jax_kernels.from_paged_kv(state)
    assert jax.tree.map(lambda a: a.shape, ours) == jax.tree.map(
        lambda s: s.shape, jax_kernels.paged_state_shapes(cfg, pages, 2))
    # K/V head g's key at 2g, its value at 2g + 1 (ragged paged attention's layout)
    np.testing.assert_array_equal(ours["gqa"]["kv"][0, 3, 5, 0], state["gqa"]["k"][0, 3, 0, 5])
    np.testing.assert_array_equal(ours["gqa"]["kv"][0, 3, 5, 1], state["gqa"]["v"][0, 3, 0, 5])
    back = jax_kernels.to_paged_kv(ours)
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(back),
                                                     jax.tree.leaves(state), strict=True))


def test_the_step_donates_the_state():
    cfg = first_layers(get_config("qwen3-235b-a22b-mini"), 1)
    params, state = weights.init_params(cfg, 0), reference.init_state(cfg, 1)
    _, new, _ = jax_kernels.decode_step(params, state, np.array([5]), np.array([0]), cfg)
    assert jax.tree.leaves(state)[0].is_deleted() and not jax.tree.leaves(new)[0].is_deleted()


def test_the_paged_step_refuses_attention_other_than_gqa():
    cfg = get_config("kimi-k3-mini")
    with pytest.raises(ValueError, match=r"ModelConfig.attention='kda\+mla' is invalid for the "
                                         "paged op-by-op step"):
        jax_kernels.paged_state_shapes(cfg, paged_kv.PagedKVConfig(16, 8, 8), 1)


@pytest.mark.slow
@pytest.mark.parametrize("whole", [False, pytest.param(True, marks=pytest.mark.exhaustive)])
def test_the_steps_compile_for_the_v5e(whole):
    """Mosaic for the v5e (libtpu, no TPU): Kimi K3's mini in MXFP4 (three gmm calls per MoE
    layer) and Qwen3's on a paged cache (and a ragged paged attention per layer); make test
    compiles them cut to one layer of each kind, the exhaustive tier whole."""
    kimi, qwen = get_config("kimi-k3-mini"), get_config("qwen3-235b-a22b-mini")
    if not whole:
        kimi, qwen = kimi_kinds(kimi), first_layers(qwen, 1)
    batch = jax.ShapeDtypeStruct((8,), jnp.int32)
    state = jax.eval_shape(lambda: reference.init_state(kimi, 8))
    result = tpu.compile_for(lambda p, s, t, q: jax_kernels.step(p, s, t, q, kimi),
                             weights.param_shapes(kimi), state, batch, batch, chip="v5e")
    assert result.n_mosaic_kernels == 3 * len(kimi.moe_layers)
    pages = paged_kv.PagedKVConfig(16, 64, 8)
    paged = jax.eval_shape(lambda: jax_kernels.init_paged_state(qwen, pages, 8))
    table = jax.ShapeDtypeStruct((8, 8), jnp.int32)
    # the kernel's lowering asks the default device what chip it is for (its integer division's
    # sign): the v5e's topology device, as on the chip itself
    with jax.default_device(tpu.tpu_device("v5e")):
        result = tpu.compile_for(
            lambda p, s, t, q, tb: jax_kernels.paged_step(p, s, t, q, tb, qwen, pages),
            weights.param_shapes(qwen), paged, batch, batch, table, chip="v5e")
    assert result.n_mosaic_kernels == 4 * qwen.n_layers
