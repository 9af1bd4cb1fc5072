"""Parameters: shapes without allocation, deterministic init, healthy activations and routing,
exact MXFP4 / FP8 round trips, and the byte counts of docs/kimi-k3.md §7 and §10."""


import functools

import cuts
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import EXHAUSTIVE

from mkresearch.hardware.chips import CHIPS
from mkresearch.model import formats, reference, weights
from mkresearch.model.config import get_config

MINI = get_config("kimi-k3-mini")
FULL = get_config("kimi-k3")


def _equal_trees(a, b) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(x.dtype == y.dtype and x.shape == y.shape
                    and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
                    for x, y in zip(leaves_a, leaves_b)))


@pytest.fixture(scope="module")
def mini_params():
    return weights.init_params(MINI, seed=0)


# ---- init -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_same_config_and_seed_give_identical_arrays(mini_params):
    assert _equal_trees(mini_params, weights.init_params(MINI, seed=0))
    # seed 1's embedding: each leaf has its own stream, so the mini cut to one layer draws the
    # whole mini's, bit for bit, without its experts (mla_first: within the cut)
    other = weights.init_params(cuts.first_layers(MINI, 1, n_dense_layers=0), seed=1)
    assert not np.array_equal(np.asarray(mini_params["embed"], np.float32),
                              np.asarray(other["embed"], np.float32))


@functools.cache
def _whole_params(cfg):
    return weights.init_params(cfg, seed=0)


MINIS = ("kimi-k3-mini", "deepseek-v3-mini", "glm-4.5-mini", "qwen3-235b-a22b-mini")


def _cuts() -> list:
    """(the whole config, its cut) for every cut tests/cuts.py can draw of the families' minis
    (tests/cuts.py relies on this test): each depth, with the mini's dense layers, none, or all
    but the last (a mini without dense layers: none; the fields the tests change), Kimi K3's with its attention-residual block too
    (`kimi_kinds`), each with an expert format in turn (the whole config in the same one). `make
    test` draws every seventh, the exhaustive tier all."""
    cases = []
    for name in MINIS:
        mini = get_config(name)
        blocks = (mini.attn_res_block, 1) if mini.attn_res_block < mini.n_layers else (None,)
        for n in range(1, mini.n_layers + 1):
            denses = {min(mini.n_dense_layers, n - 1), 0, n - 1} if mini.n_dense_layers else {0}
            for dense in sorted(denses):
                for block in blocks:
                    fmt = formats.EXPERT_FORMATS[len(cases) % len(formats.EXPERT_FORMATS)]
                    changes = {"n_dense_layers": dense, "expert_format": fmt}
                    if block is not None:
                        changes["attn_res_block"] = block
                    whole = mini.replace(expert_format=fmt)
                    marks = () if len(cases) % 7 == 0 else (pytest.mark.exhaustive,)
                    blocked = "" if block is None else f"-{block}b"
                    cases.append(pytest.param(whole, cuts.first_layers(whole, n, **changes),
                                              marks=marks, id=f"{name}-{n}l-{dense}d{blocked}-{fmt}"))
    return cases


@pytest.mark.slow  # draws each whole mini
@pytest.mark.parametrize("cfg, cut", _cuts())
def test_a_cut_mini_draws_the_whole_minis_first_layers_bit_for_bit(cfg, cut):
    """init_params draws each leaf from its own stream, in C order, so a config cut to fewer
    layers gets each kind's first layers of the whole config (each leaf stacked per kind: its
    first rows, wherever the cut places that kind's layers) and the unstacked leaves (embedding,
    final norm, LM head), bit for bit; the layers of a kind both configs have are equal."""
    name = cfg.name
    whole, part = _whole_params(cfg), weights.init_params(cut, seed=0)
    for path, leaf in jax.tree_util.tree_leaves_with_path(part):
        full = whole
        for key in path:
            full = full[key.key] if hasattr(key, "key") else full[key.idx]
        assert full.shape[1:] == leaf.shape[1:], (name, jax.tree_util.keystr(path))
        rows = min(full.shape[0], leaf.shape[0])  # a kind's layers both have (a cut may add
        # dense layers the whole mini lacks: their rows are drawn on, from the same stream)
        assert _equal_trees(leaf[:rows], full[:rows]), (name, jax.tree_util.keystr(path))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_init_matches_param_shapes(mini_params, fmt):
    cfg = MINI.replace(expert_format=fmt)
    shapes = weights.param_shapes(cfg)
    # the mini's own format (mxfp4): the fixture's init_params(MINI, seed=0)
    params = mini_params if cfg == MINI else weights.init_params(cfg, seed=0)
    assert jax.tree.structure(shapes) == jax.tree.structure(params)
    for s, p in zip(jax.tree.leaves(shapes), jax.tree.leaves(params)):
        assert (s.shape, s.dtype) == (p.shape, p.dtype)
    assert weights.nbytes(shapes) == weights.nbytes(params)


@pytest.mark.slow
def test_activations_stay_order_one_and_every_expert_is_chosen(mini_params):
    """64 random tokens through one reference step: no layer's hidden RMS leaves [0.1, 10] and
    every expert of every MoE layer is picked at least once."""
    batch = 64
    tokens = np.random.default_rng(0).integers(0, MINI.vocab_size, batch)
    logits, _, aux = reference.decode_step(mini_params, reference.init_state(MINI, batch),
                                           tokens, np.zeros(batch, np.int32), MINI)
    rms = np.asarray(aux["hidden_rms"])  # [L, B]
    assert rms.shape == (MINI.n_layers, batch)
    assert rms.min() > 0.1 and rms.max() < 10, (rms.min(), rms.max())
    expert_ids = np.asarray(aux["expert_ids"])  # [n_moe, B, k]
    for layer, ids in zip(MINI.moe_layers, expert_ids):
        counts = np.bincount(ids.ravel(), minlength=MINI.n_experts)
        assert counts.min() >= 1, f"layer {layer}: experts never chosen {np.flatnonzero(counts == 0)}"
    assert np.isfinite(np.asarray(logits)).all()


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="seed"):
        weights.init_params(MINI, seed=-1)
    with pytest.raises(ValueError, match="cfg"):
        weights.param_shapes("kimi-k3-mini")
    with pytest.raises(ValueError, match="fmt"):
        weights.dequantize(jnp.zeros((32, 128)), "int4")
    with pytest.raises(ValueError, match="multiple of 32"):
        weights.mxfp4_pack(jnp.zeros((48, 128)))
    with pytest.raises(ValueError, match="multiple of 256"):
        weights.fp8_pack(jnp.zeros((128, 128)))


# ---- quantisation -----------------------------------------------------------------------------
def _random_weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    # several magnitudes per block row so scales differ, plus an all-zero block
    w = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-6, 6, shape[-1]))
    w[..., :32, 0] = 0.0
    return jnp.asarray(w)


def test_mxfp4_code_layout_follows_the_spec():
    """Nibble c of word k holds K = 8k + c (low nibble first); magnitude table, sign bit 8,
    E8M0 scale 2^(e-127)."""
    nibbles = np.arange(16, dtype=np.uint32)  # codes 0..15 along K (two words)
    codes = np.zeros((4, 1), np.uint32)  # K = 32
    for k, c in enumerate(nibbles):
        codes[k // 8, 0] |= c << (4 * (k % 8))
    packed = {"codes": jnp.asarray(codes), "scales": jnp.asarray([[128]], jnp.uint8)}  # scale 2
    values = np.asarray(weights.mxfp4_unpack(packed))[:, 0]
    magnitudes = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
    expected = 2 * np.concatenate([magnitudes, -magnitudes, np.zeros(16)])
    np.testing.assert_array_equal(values, expected)


def test_mxfp4_round_trips_are_exact():
    w = _random_weights((2, 64, 256))
    packed = weights.mxfp4_pack(w)
    assert packed["codes"].shape == (2, 8, 256) and packed["codes"].dtype == jnp.uint32
    assert packed["scales"].shape == (2, 2, 256) and packed["scales"].dtype == jnp.uint8
    assert _equal_trees(weights.mxfp4_pack(weights.mxfp4_unpack(packed)), packed)
    # w already on the grid: any codes and scales; unpack(pack(w)) == w bit for bit
    rng = np.random.default_rng(1)
    on_grid = weights.mxfp4_unpack({
        "codes": jnp.asarray(rng.integers(0, 2**32, (3, 4, 128), dtype=np.uint32)),
        "scales": jnp.asarray(rng.integers(100, 150, (3, 1, 128)), jnp.uint8)})
    np.testing.assert_array_equal(weights.mxfp4_unpack(weights.mxfp4_pack(on_grid)), on_grid)
    # nearest-value rounding: error at most half a grid step (≤ 1 * scale when |x|/scale in [4, 6])
    error = np.abs(np.asarray(weights.mxfp4_unpack(packed)) - np.asarray(w))
    scale = np.exp2(np.repeat(np.asarray(packed["scales"], np.float32) - 127, 32, axis=-2))
    assert np.all(error <= scale + 1e-30)


def test_fp8_round_trips_are_exact():
    w = _random_weights((2, 512, 128))
    packed = weights.fp8_pack(w)
    assert packed["values"].dtype == jnp.float8_e4m3fn and packed["values"].shape == (2, 512, 128)
    assert packed["scales"].dtype == jnp.bfloat16 and packed["scales"].shape == (2, 2, 128)
    scales = np.asarray(packed["scales"], np.float32)
    assert np.all(np.exp2(np.round(np.log2(scales))) == scales)  # powers of two
    assert _equal_trees(weights.fp8_pack(weights.fp8_unpack(packed)), packed)
    on_grid = weights.fp8_unpack(packed)
    np.testing.assert_array_equal(weights.fp8_unpack(weights.fp8_pack(on_grid)), on_grid)
    # e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4 for normal values
    w_np, back = np.asarray(w), np.asarray(on_grid)
    big = np.abs(w_np) > np.repeat(scales, 256, axis=-2) * 2.0 ** -6
    assert np.all(np.abs(back - w_np)[big] <= np.abs(w_np)[big] * 2.0 ** -4)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_dequantize_is_exact_in_bf16(fmt):
    w = _random_weights((2, 256, 128))
    quantized = weights.quantize(w, fmt)
    dense = weights.dequantize(quantized, fmt)
    assert dense.dtype == jnp.bfloat16 and dense.shape == w.shape
    exact = {"bf16": lambda q: np.asarray(q, np.float32),
             "fp8": lambda q: np.asarray(weights.fp8_unpack(q)),
             "mxfp4": lambda q: np.asarray(weights.mxfp4_unpack(q))}[fmt](quantized)
    np.testing.assert_array_equal(np.asarray(dense, np.float32), exact)
    assert weights.expert_format_of(quantized) == fmt  # dequantize(w) infers the format
    np.testing.assert_array_equal(weights.dequantize(quantized), dense)


# ---- sizes (docs/kimi-k3.md §7, §10) ---------------------------------------------------------------------
def test_full_size_param_shapes_do_not_allocate_and_match_the_spec_counts():
    shapes = weights.param_shapes(FULL)  # 2.78 T parameters: must not allocate (time: bench-speed)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    total = weights.n_values(shapes)
    routed = weights.n_values(shapes["moe"]["experts"])
    assert routed == pytest.approx(2.72e12, rel=0.01)
    assert total == pytest.approx(2.78e12, rel=0.01)
    # every expert format holds the same parameters
    assert weights.n_values(weights.param_shapes(FULL.replace(expert_format="fp8"))) == total


def test_bytes_per_token_match_spec_section_10():
    shapes = weights.param_shapes(FULL)
    GB = 1e9
    per_layer = {kind: weights.nbytes(shapes[kind]) for kind in ("kda", "mla", "dense")}
    assert per_layer["kda"] / GB == pytest.approx(61.26, rel=0.01)
    assert per_layer["mla"] / GB == pytest.approx(11.15, rel=0.01)
    assert per_layer["dense"] / GB == pytest.approx(1.45, rel=0.01)
    moe_non_routed = {k: v for k, v in shapes["moe"].items() if k != "experts"}
    assert weights.nbytes(moe_non_routed) / GB == pytest.approx(34.95, rel=0.01)
    assert weights.nbytes(shapes["lm_head"]) / GB == pytest.approx(2.35, rel=0.01)
    routed_per_token = FULL.top_k * len(FULL.moe_layers) * weights.expert_nbytes(FULL)
    assert routed_per_token / GB == pytest.approx(25.83, rel=0.01)


def test_expert_nbytes_per_format():
    # one full expert: 3 x 3584 x 3072 values; MXFP4 = 4.25 bits, FP8 = 8 bits + a bf16 per 256
    values = 3 * 3584 * 3072
    assert weights.expert_nbytes(FULL) == values // 2 + values // 32 == 17_547_264
    assert weights.expert_nbytes(FULL.replace(expert_format="fp8")) == values + values // 128
    assert weights.expert_nbytes(FULL.replace(expert_format="bf16")) == 2 * values
    assert weights.expert_nbytes(MINI) == 3 * 256 * 256 * 17 // 32 == 104_448
    assert weights.nbytes(jnp.zeros((3, 5), jnp.bfloat16)) == 30


def test_mxfp4_scales_exact_for_every_e8m0_exponent():
    """Every E8M0 exponent unpacks to exactly 2^(e-127) times the E2M1 value.

    e = 0 and 1 give f32 subnormals for some magnitudes, which XLA:CPU (like a TPU) flushes to
    zero, so the exact comparison covers e = 2..254; 6 * 2^127 overflows to inf on both sides.
    """
    codes = jnp.full((4, 255), 0x76543210, jnp.uint32)  # nibbles 0..7: magnitudes 0 .. 6
    scales = jnp.arange(255, dtype=jnp.uint8)[None, :]  # one 32-row block, column n has e = n
    got = np.asarray(weights.mxfp4_unpack({"codes": codes, "scales": scales}))
    magnitudes = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float64)[np.arange(32) % 8]
    with np.errstate(over="ignore"):
        want = (magnitudes[:, None] * np.ldexp(1.0, np.arange(255) - 127)).astype(np.float32)
    np.testing.assert_array_equal(got[:, 2:], want[:, 2:])


# ---- what the MXU is handed with expert_mxu="fp8" (formats.mxu_parts, formats.mxu_matmul) ------
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_mxu_parts_are_the_dequantized_weight(fmt):
    """e4m3 values times their f32 block scales are `dequantize`'s weight, exactly: no value of
    either format is lost on its way to the MXU as fp8."""
    block = {"fp8": 256, "mxfp4": 32}[fmt]
    for seed in range(4):
        w = np.random.default_rng(seed).normal(0, 10.0 ** (seed - 3), (512, 128))
        stored = weights.quantize(jnp.asarray(w, jnp.float32), fmt)
        values, scales = formats.mxu_parts(stored, fmt)
        assert values.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32
        rebuilt = values.astype(jnp.float32) * jnp.repeat(scales, block, axis=0)
        np.testing.assert_array_equal(np.asarray(rebuilt.astype(jnp.bfloat16), np.float32),
                                      np.asarray(weights.dequantize(stored, fmt), np.float32))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_k_rows_are_the_dequantized_rows(fmt):
    """An ETP slice of a stored expert weight (`formats.k_rows`: every part cut along K in
    proportion) is the dequantized weight's rows; a cut through a scale block is refused."""
    w = np.random.default_rng(0).normal(0, 0.1, (2, 1024, 128))
    stored = weights.quantize(jnp.asarray(w, jnp.float32), fmt)
    whole = np.asarray(weights.dequantize(stored, fmt), np.float32)
    for start, stop in ((0, 512), (512, 1024), (256, 768)):
        got = weights.dequantize(formats.k_rows(stored, start, stop, 1024), fmt)
        np.testing.assert_array_equal(np.asarray(got, np.float32), whole[:, start:stop])
    if fmt != "bf16":
        with pytest.raises(ValueError, match=r"rows \[0, 16\) of K=1024 cut a block"):
            formats.k_rows(stored, 0, 16, 1024)


def mxu_passes(fmt, k, chunk, batch):
    """MXU passes (per 256 output columns) of B rows against [k, N] in K chunks of `chunk`:
    chunks x row passes of the spread rows x contraction passes, on TPU7x's 256 x 256 MXU."""
    spread = batch * (chunk // {"fp8": 256, "mxfp4": 32}[fmt])
    return k // chunk * -(-spread // 256) * -(-chunk // 256)


def test_mxu_k_chunk_takes_the_fewest_mxu_passes_at_every_batch():
    """expert_mxu="fp8" chunks K by `formats.mxu_k_chunk`: of the chunks a decode may take
    (multiples of 256 dividing K, at most MAX_K_CHUNK), the smallest: no other takes fewer MXU
    passes at any batch, and it does not depend on the batch (a row's bits are its own). Kimi
    K3's W1 / W3 K = 3584, W2 K = 3072 and a rank's W2 slice K = 768: 256 (8 MXFP4 blocks)."""
    assert CHIPS["tpu7x"].mxu_shape == (256, 256)
    for fmt, k in [("mxfp4", 3584), ("mxfp4", 3072), ("mxfp4", 768), ("mxfp4", 1024),
                   ("fp8", 3584), ("fp8", 4096), ("mxfp4", 64)]:
        chunks = [r for r in range(256, min(k, formats.MAX_K_CHUNK) + 1, 256) if k % r == 0] or [k]
        got = formats.mxu_k_chunk(fmt, k)
        assert got == min(chunks) and formats.mxu_spread(fmt, k) == got // {"fp8": 256,
                                                                              "mxfp4": 32}[fmt]
        for batch in [*range(1, 70), 128, 256, 257]:
            assert mxu_passes(fmt, k, got, batch) == min(mxu_passes(fmt, k, r, batch)
                                                         for r in chunks)
    assert [formats.mxu_k_chunk("mxfp4", k) for k in (3584, 3072, 768)] == [256] * 3
    assert [formats.k_chunk("mxfp4", k) for k in (3584, 3072, 768)] == [512, 1024, 768]
    # one pass of 256 x 256 contraction: 9 rows of 1024-deep chunks spread over 288 rows
    assert mxu_passes("mxfp4", 3072, 1024, 9) == 3 * 2 * 4 > mxu_passes("mxfp4", 3072, 256, 9)
    with pytest.raises(ValueError, match="fmt='bf16'"):
        formats.mxu_k_chunk("bf16", 3584)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_mxu_matmul_row_alone_is_the_row_in_a_batch(fmt):
    """`formats.mxu_matmul` chunks K the same at any batch: one row of a batch of 48 alone gives
    that row's bits of the batch's product (MXFP4's K = 1024 and FP8's K = 4096 in chunks of 256,
    not k_chunk's 1024). Within 50 rows: XLA:CPU sums a bf16 x fp8 product of 51 rows or more
    at K = 256 in another order (measured on an x86 CPU with AMX; `numerics.padded_rows`)."""
    k = 1024 if fmt == "mxfp4" else 4096
    rng = np.random.default_rng(3)
    stored = weights.quantize(jnp.asarray(rng.normal(0, 0.05, (k, 256)), jnp.float32), fmt)
    x = jnp.asarray(rng.normal(0, 1, (48, k)), jnp.bfloat16)
    assert formats.mxu_k_chunk(fmt, k) == 256 < formats.k_chunk(fmt, k)
    whole = np.asarray(formats.mxu_matmul(x, stored, fmt)).view(np.uint32)
    for row in (0, 41):
        one = formats.mxu_matmul(x[row:row + 1], stored, fmt)
        np.testing.assert_array_equal(np.asarray(one).view(np.uint32), whole[row:row + 1])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("rows, k", [(1, 256), (3, 768), (8, 1536)])
def test_mxu_matmul_is_the_decoded_product_up_to_summation_order(fmt, rows, k):
    """Over 3 seeds (8 exhaustive): the block-scaled fp8 product equals the decoded bf16 product within the
    bound of two f32 sums of the same exact products in other orders, |a - b| <= 2 K 2^-24
    (|x| @ |w|): the products are exact in f32 (a bf16 times an e4m3 value, a power-of-two
    scale), only the order of the additions differs."""
    for seed in range(8 if EXHAUSTIVE else 3):
        rng = np.random.default_rng(seed)
        w = jnp.asarray(rng.normal(0, 0.05, (k, 256)), jnp.float32)
        x = jnp.asarray(rng.normal(0, 1, (rows, k)), jnp.bfloat16)
        stored = weights.quantize(w, fmt)
        decoded = weights.dequantize(stored, fmt).astype(jnp.float32)
        got = np.asarray(formats.mxu_matmul(x, stored, fmt), np.float64)
        want = np.asarray(jnp.matmul(x.astype(jnp.float32), decoded,
                                     precision=jax.lax.Precision.HIGHEST), np.float64)
        bound = 2 * k * 2.0**-24 * (np.abs(np.asarray(x, np.float64))
                                    @ np.abs(np.asarray(decoded, np.float64)))
        assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) - bound))
