"""GQA and MLA-with-RoPE decode kernels (kernels/stages/gqa.py, kernels/stages/mla_rope.py) against the
reference sublayers (mkresearch.model.stages.gqa, mla_rope), in TPU interpret mode with races checked:
outputs, cache writes, KV bytes from the DMA log (only the 16-row groups holding cached tokens),
every weight byte once, the declared cost, batch invariance, TPU7x compiles and bad input.

Tolerance (as tests/test_attention_kernels.py): the kernels round where the reference rounds but
may sum in other orders (streamed weight blocks, online softmax per tile), so a bf16 output may
differ by one bf16 ulp of the output's scale: |kernel − reference| ≤ 2^-7 · |ref| + 2^-7 · max|ref|;
caches bit-equal (within one ulp when weights stream in 128-row blocks). With whole weight
blocks GQA's output is bit-equal too (tested over several draws); the MLA-with-RoPE output on these
shapes is in fact bit-equal (printed with -s).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import dense_and_one_moe
from mkresearch.kernels.base import costs, dma
from mkresearch.kernels.stages import gqa, mla_rope

from mkresearch.hardware import tpu
from mkresearch.model import config, kv_cache, reference, weights
from mkresearch.model.stages import gqa as gqa_ref
from mkresearch.model.stages import mla_rope as mla_rope_ref

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

BF16_TOL = 2.0 ** -7
GLM, QWEN, DEEPSEEK = (config.get_config(n) for n in (
    "glm-4.5-mini", "qwen3-235b-a22b-mini", "deepseek-v3-mini"))
GLM_PLAIN = GLM.replace(attention_bias=False, qk_norm=False)
# (config, positions, weight_block_rows): position 0, tile boundaries (32, 64), mid-tile, the
# last slot (127: the whole cache is read); 128-row weight blocks make the weight ring alternate
CASES = {"glm": (GLM, [0, 32, 77], 128), "qwen": (QWEN, [5, 16, 31, 33, 64, 100, 126, 127], None),
         "glm-plain": (GLM_PLAIN, [45], None)}
KERNELS = {"gqa": (gqa, gqa_ref.gqa_attention), "mla_rope": (mla_rope, mla_rope_ref.mla_rope_attention)}


def assert_bf16_close(actual, expected, what):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = float(np.abs(expected).max())
    print(f"{what}: max |kernel - reference| = {np.abs(actual - expected).max():.3g}")
    np.testing.assert_allclose(actual, expected, rtol=BF16_TOL, atol=BF16_TOL * scale,
                               err_msg=f"{what}: beyond the bf16 tolerance")


@functools.cache  # the tests read the weights only: one draw per (cfg, kind, seed)
def layer(cfg, kind, seed=0):
    """Layer 0 of `kind`, drawn from cfg cut to its dense layers and one more: each leaf comes
    from its own stream, layer by layer, so these are the whole mini's layer 0 weights, bit for
    bit, without drawing the other MoE layers' experts."""
    return reference.layer_params(weights.init_params(dense_and_one_moe(cfg), seed)[kind], 0)


def random_cache(module, cfg, batch, seed):
    shapes = module.cache_shapes(cfg, batch, cfg.max_seq_len)
    rng = np.random.default_rng(seed)
    return {name: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
            for name, shape in shapes.items()}


def normalised(cfg, batch, seed):
    x = np.random.default_rng(seed).standard_normal((batch, cfg.d_model))
    return jnp.asarray(x / np.sqrt(np.mean(x * x, -1, keepdims=True)), jnp.bfloat16)


def weight_bytes(p):
    return sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in p.values())


def run(kind, p, x, cache, positions, cfg, **options):
    module, _ = KERNELS[kind]
    call = module.gqa_attention if kind == "gqa" else module.mla_rope_attention
    with dma.recording() as log:
        out, new_cache = call(p, x, cache, positions, cfg, **options)
        jax.block_until_ready(out)
    return out, new_cache, log


def kv_per_token(kind, cfg):
    """Bytes of one cached token of one layer: K and V of every K/V head, or ĉ and k^R."""
    if kind == "gqa":
        return 2 * cfg.n_kv_heads * cfg.head_dim * 2
    return (cfg.mla_kv_rank + cfg.mla_qk_extra) * 2


@pytest.mark.slow
@pytest.mark.parametrize("case", [*CASES, "deepseek"])
def test_matches_reference_and_reads_only_needed_kv(race_checked, case):
    kind = "mla_rope" if case == "deepseek" else "gqa"
    cfg, positions, block_rows = CASES.get(case, (DEEPSEEK, [0, 45, 127], None))
    module, reference_fn = KERNELS[kind]
    p = layer(cfg, kind)
    batch, positions = len(positions), jnp.array(positions, jnp.int32)
    x, cache = normalised(cfg, batch, 1), random_cache(module, cfg, batch, 2)
    out, new_cache, log = run(kind, p, x, cache, positions, cfg, weight_block_rows=block_rows)
    want, want_cache = reference_fn(p, x, cache, positions, cfg)
    assert_bf16_close(out, want, f"{kind} {case} B={batch} output")
    for name in want_cache:
        np.testing.assert_array_equal(np.asarray(new_cache[name]), np.asarray(want_cache[name]),
                                      err_msg=f"cache[{name!r}]")
    per_token = kv_per_token(kind, cfg)
    prefix = "gqa." if kind == "gqa" else "mla."
    needed = sum(kv_cache.rows_read(int(q)) for q in positions) * per_token
    assert log.dma_bytes(prefix + "kv.") == needed  # tokens 0..p-1 in 16-row groups, no more
    # the in-place write: one aligned 16-row block read and written per row and cache array
    assert log.dma_bytes(prefix + "kv_update") == batch * 2 * 16 * per_token
    streamed = sum(log.dma_bytes(prefix + name) for name in p)  # every weight once
    assert streamed == weight_bytes(p)
    if block_rows:  # the two-slot weight ring alternates: 512 rows of W_q in 4 blocks of 128
        assert [e.slot for e in log.select("dma_start", "gqa.w_q")] == [0, 1, 0, 1]
    if kind == "gqa":  # one DMA per tile carries every K/V head; the group shares it
        tiles = sum(-(-int(q) // cfg.kv_tile) for q in positions)
        assert len(log.select("dma_start", "gqa.kv.k")) >= tiles


# (case, seed): the Qwen draws at which the reference's former products, one per query head
# (scores, and values repeated per head), rounded apart from the kernel's [G, ·] products of a
# K/V head's group enough to change the output on an AVX2 CPU (draw 3 under the tests' compile
# switches, both under XLA's defaults); the other draws in the exhaustive tier
GQA_BIT_CASES = [("qwen", 1), ("qwen", 3), *(
    pytest.param(case, seed, marks=pytest.mark.exhaustive) for case in CASES for seed in range(6)
    if (case, seed) not in {("qwen", 1), ("qwen", 3)})]


@pytest.mark.slow
@pytest.mark.parametrize("case, seed", GQA_BIT_CASES)
def test_gqa_equals_the_reference_to_the_bit(race_checked, case, seed):
    """With whole weight blocks the GQA kernel sums every product in the reference's order (each
    K/V head's G query heads in one product over the cached keys): the same bits."""
    cfg, positions, _ = CASES[case]
    p = layer(cfg, "gqa")
    batch, positions = len(positions), jnp.array(positions, jnp.int32)
    x, cache = normalised(cfg, batch, 1 + 10 * seed), random_cache(gqa, cfg, batch, 2 + 10 * seed)
    out, new_cache, _ = run("gqa", p, x, cache, positions, cfg)
    want, want_cache = gqa_ref.gqa_attention(p, x, cache, positions, cfg)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    for name in want_cache:
        np.testing.assert_array_equal(np.asarray(new_cache[name]), np.asarray(want_cache[name]),
                                      err_msg=f"cache[{name!r}]")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gqa", "mla_rope"])
def test_rows_past_the_position_are_masked_and_cost_is_the_worst_case(race_checked, kind):
    """A cache holding NaN from each row's first unneeded token on gives the same bits; a row at
    the last position reads the whole cache, exactly the bytes the cost estimate declares."""
    cfg = GLM if kind == "gqa" else DEEPSEEK
    module, _ = KERNELS[kind]
    p = layer(cfg, kind)
    counts = [1, 17, cfg.max_seq_len - 1]
    positions = jnp.array(counts, jnp.int32)
    x, cache = normalised(cfg, 3, 3), random_cache(module, cfg, 3, 4)
    out, _, _ = run(kind, p, x, cache, positions, cfg)
    token = jnp.arange(cfg.max_seq_len)
    past = token[None, :] > positions[:, None]  # [B, S]: past the new token's slot
    poisoned = {n: jnp.where(past[:, None, :, None] if a.ndim == 4 else past[:, :, None],
                             jnp.nan, a).astype(a.dtype) for n, a in cache.items()}
    np.testing.assert_array_equal(np.asarray(run(kind, p, x, poisoned, positions, cfg)[0]),
                                  np.asarray(out))
    # one row at the last position: what the cost estimate assumes for every row
    last = jnp.array([cfg.max_seq_len - 1], jnp.int32)
    _, _, log = run(kind, p, x[:1], {n: a[:1] for n, a in cache.items()}, last, cfg)
    call = module.gqa_attention if kind == "gqa" else module.mla_rope_attention
    row = {n: a[:1] for n, a in cache.items()}
    declared = costs.declared(lambda x, c, pos: call(p, x, c, pos, cfg), x[:1], row, last)
    # read off the body: the bytes it moves, + positions, x and the output around it
    assert declared.bytes_accessed == log.dma_bytes() + costs.nbytes(last, x[:1], x[:1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gqa", "mla_rope"])
def test_batch_invariant(race_checked, kind):
    """Each row alone gives the bits it gets in a batch of three (another order)."""
    cfg = QWEN if kind == "gqa" else DEEPSEEK
    module, _ = KERNELS[kind]
    p = layer(cfg, kind, seed=5)
    positions = jnp.array([3, 60, 100], jnp.int32)
    x, cache = normalised(cfg, 3, 6), random_cache(module, cfg, 3, 7)
    out, new_cache, _ = run(kind, p, x, cache, positions, cfg)
    for rows in ([1], [2, 0]):
        idx = np.array(rows)
        part, part_cache, _ = run(kind, p, x[idx], {n: a[idx] for n, a in cache.items()},
                                  positions[idx], cfg)
        np.testing.assert_array_equal(np.asarray(part), np.asarray(out)[idx])
        for name in part_cache:
            np.testing.assert_array_equal(np.asarray(part_cache[name]),
                                          np.asarray(new_cache[name])[idx])


# ---- compilation for TPU7x -------------------------------------------------------------------------
# per-rank-like shapes: GLM-4.5 and Qwen3 with 8 and 4 ranks of attention heads (one K/V head
# each), DeepSeek-V3 with 16 of its 128 heads per rank and the whole latent cache; 32k tokens
COMPILE_CASES = [("gqa", "glm-4.5-mini", {}, 3), ("gqa", "qwen3-235b-a22b-mini", {}, 3),
                 ("mla_rope", "deepseek-v3-mini", {}, 3),
                 ("gqa", "glm-4.5", {"n_heads": 12, "n_kv_heads": 1, "max_seq_len": 32768}, 1),
                 ("gqa", "qwen3-235b-a22b", {"n_heads": 16, "n_kv_heads": 1,
                                             "max_seq_len": 32768}, 8),
                 ("mla_rope", "deepseek-v3", {"n_heads": 16, "max_seq_len": 32768}, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("kind, name, overrides, batch", COMPILE_CASES)
def test_compiles_for_tpu7x(kind, name, overrides, batch):
    cfg = config.get_config(name, **overrides)
    module, _ = KERNELS[kind]
    s = jax.ShapeDtypeStruct
    p = {n: s(shape, jnp.bfloat16) for n, shape in module.weight_shapes(cfg).items()}
    cache = {n: s(shape, jnp.bfloat16)
             for n, shape in module.cache_shapes(cfg, batch, cfg.max_seq_len).items()}
    call = module.gqa_attention if kind == "gqa" else module.mla_rope_attention
    result = tpu.compile_for(lambda p, x, c, pos: call(p, x, c, pos, cfg), p,
                             s((batch, cfg.d_model), jnp.bfloat16), cache, s((batch,), jnp.int32),
                             chip="tpu7x")
    print(f"{kind} at {name} {overrides} (B={batch}): {result}")
    assert result.n_mosaic_kernels == 1


# ---- bad input ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gqa_inputs():
    return (layer(GLM, "gqa"), normalised(GLM, 2, 0), random_cache(gqa, GLM, 2, 1),
            jnp.array([3, 9], jnp.int32))


@pytest.mark.parametrize("change, match", [
    (lambda p, x, c, pos: (p, x.astype(jnp.float32), c, pos), r"x\.dtype"),
    (lambda p, x, c, pos: ({k: v for k, v in p.items() if k != "b_q"}, x, c, pos), "b_q"),
    (lambda p, x, c, pos: (p, x, {**c, "v": c["v"].astype(jnp.float32)}, pos),
     r"cache\['v'\]\.dtype"),
    (lambda p, x, c, pos: (p, x, c, jnp.array([3, 128], jnp.int32)), r"positions=\[3, 128\]"),
])
def test_gqa_rejects_bad_input(gqa_inputs, change, match):
    with pytest.raises(ValueError, match=match):
        gqa.gqa_attention(*change(*gqa_inputs), GLM)


@pytest.mark.parametrize("option, value", [("kv_tile", 24), ("kv_tile", 48),
                                           ("weight_block_rows", 64)])
def test_gqa_rejects_block_sizes_that_break_tiling(gqa_inputs, option, value):
    with pytest.raises(ValueError, match=option):
        gqa.gqa_attention(*gqa_inputs, GLM, **{option: value})


def test_mla_rope_rejects_bad_input():
    p, x = layer(DEEPSEEK, "mla_rope"), normalised(DEEPSEEK, 2, 0)
    cache, positions = random_cache(mla_rope, DEEPSEEK, 2, 1), jnp.array([3, 9], jnp.int32)
    with pytest.raises(ValueError, match=r"cache\['kpe'\]"):
        mla_rope.mla_rope_attention(p, x, {**cache, "kpe": cache["kpe"][..., :32]}, positions,
                                    DEEPSEEK)
    with pytest.raises(ValueError, match=r"p\['w_o'\]"):
        mla_rope.mla_rope_attention({**p, "w_o": p["w_o"][:128]}, x, cache, positions, DEEPSEEK)
    with pytest.raises(ValueError, match="positions"):
        mla_rope.mla_rope_attention(p, x, cache, positions.astype(jnp.int16), DEEPSEEK)
