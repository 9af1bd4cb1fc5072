"""MLA and KDA decode attention kernels against the reference, in TPU interpret mode with races
checked, plus KV bytes from the DMA log, TPU7x compiles and bad-input errors.

Tolerance (stated once, used for every sublayer output): the kernels round at the same points as
the reference but accumulate matmuls in other orders (streamed row blocks, online softmax), so a
bf16 output may differ by about one bf16 ulp of the output's scale:
|kernel − reference| ≤ 2^-7 · |reference| + 2^-7 · max|reference|.
Caches and the conv state must be bit-equal (within one bf16 ulp when the B=3 cases split the
weights into 128-row blocks, which changes the f32 summation order); the f32 recurrent state
within 1e-5 (abs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import first_layers
from mkresearch.kernels.base import dma, kv_update
from mkresearch.kernels.sharded import mla_sharded
from mkresearch.kernels.stages import kda, mla

from mkresearch.hardware import tpu
from mkresearch.measurement.logs import kv_bytes_at, kv_bytes_by_row, kv_bytes_per_rank
from mkresearch.model import config, kv_cache, numerics, reference, weights
from mkresearch.model.config import get_config

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

BF16_TOL = 2.0 ** -7
STATE_ATOL = 1e-5
MINI = config.get_config("kimi-k3-mini")
T = MINI.kv_tile  # 32
# positions per batch size: 0, a tile boundary (32), non-multiples of the tile; B=8 stays within
# two tiles (interpret mode costs ~10 ms per simulated memory op)
POSITIONS = {1: [45], 3: [0, 32, 77], 8: [0, 1, 16, 31, 32, 33, 47, 63]}
# at mini shapes every weight matrix fits one 2 MiB block: the B=3 cases cut them into 128-row
# blocks so the two-slot weight ring really alternates (4 blocks for a 512-row matrix)
BLOCK_ROWS = {1: None, 3: 128, 8: None}


def assert_bf16_close(actual, expected, what):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, rtol=BF16_TOL, atol=BF16_TOL * scale,
                               err_msg=f"{what}: beyond the bf16 tolerance")


def assert_state_equal(actual, expected, batch, what):
    """Bit-equal with whole-matrix weight blocks (the reference's one matmul sums in the same
    order); with 128-row blocks the f32 partial sums add in another order, so a bf16 entry may
    round one ulp apart."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    if BLOCK_ROWS[batch] is None:
        np.testing.assert_array_equal(actual, expected, err_msg=f"{what} after the step")
    else:
        np.testing.assert_allclose(actual, expected, rtol=BF16_TOL, atol=0,
                                   err_msg=f"{what} after the step: beyond one bf16 ulp")


@pytest.fixture(scope="module")
def mini_params():
    """The mini's weights as far as these tests read them (MLA layer 0, KDA layers 0 and 1): the
    mini cut to its first 4 layers (3 KDA + dense, MLA + MoE), whose leaves are the whole mini's
    first layers bit for bit (each leaf is drawn from its own stream, layer by layer) at a
    fraction of init_params' time (5 fewer MoE layers of experts)."""
    return weights.init_params(first_layers(MINI, 4, n_dense_layers=3), 0)


def random_cache(cfg, batch, seed):
    """A cache full of random bf16 entries (zero K padding), so every tile read matters."""
    shapes = mla.cache_shapes(cfg, batch, cfg.max_seq_len)
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    cache = {name: jax.random.normal(key, shape).astype(jnp.bfloat16)
             for (name, shape), key in zip(shapes.items(), keys)}
    if "k" in cache:
        cache["k"] = cache["k"].at[..., cfg.mla_qk_dim:].set(0)
    return cache


def normalised_input(cfg, batch, seed):
    x = jax.random.normal(jax.random.key(seed), (batch, cfg.d_model))
    return reference.rms_norm(x, jnp.ones((cfg.d_model,), jnp.bfloat16), cfg.rms_eps)


# ---- MLA ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["expanded", "latent"])
@pytest.mark.parametrize("batch", [  # B = 3 here; B = 1 and 8 (the megakernel checks 8): exhaustive
    pytest.param(1, marks=pytest.mark.exhaustive), 3, pytest.param(8, marks=pytest.mark.exhaustive)])
def test_mla_matches_reference_and_reads_only_needed_tiles(race_checked, mini_params, layout,
                                                           batch):
    cfg = MINI.replace(mla_cache_layout=layout)
    p = reference.layer_params(mini_params["mla"], 0)
    x = normalised_input(cfg, batch, seed=batch)
    cache = random_cache(cfg, batch, seed=10 + batch)
    positions = jnp.array(POSITIONS[batch], jnp.int32)

    with dma.recording() as log:
        out, new_cache = mla.mla_attention(p, x, cache, positions, cfg,
                                           weight_block_rows=BLOCK_ROWS[batch])
        jax.block_until_ready(out)
    ref_out, ref_cache = reference.mla_attention(p, x, cache, positions, cfg)

    assert_bf16_close(out, ref_out, f"MLA {layout} B={batch} output")
    for name in ref_cache:
        assert_state_equal(new_cache[name], ref_cache[name], batch, f"cache[{name!r}]")
    # KV: each row's tokens 0..p-1 in 16-row groups, nothing past them; at T = 32 a tile is one
    # DMA per cache array (whole, or its first 16 rows)
    needed = kv_cache.kv_tile_bytes_needed(positions, cfg)
    assert needed == sum(-(-p // 16) * 16 for p in POSITIONS[batch]) * kv_cache.kv_bytes_per_token(cfg)
    assert log.dma_bytes("mla.kv.") == needed
    tiles = sum(-(-p // T) for p in POSITIONS[batch])
    assert len(log.select("dma_start", "mla.kv.")) == 2 * tiles  # two cache arrays per tile
    # the in-place write: one aligned 16-row block read and written per row and cache array
    entry = kv_cache.kv_bytes_per_token(cfg)
    assert log.dma_bytes("mla.kv_update") == batch * 2 * kv_update.UPDATE_ROWS * entry
    # every weight byte of the layer went through the DMA log exactly once
    weight_bytes = sum(int(np.prod(p[name].shape)) * 2 for name in mla.WEIGHT_NAMES)
    assert log.dma_bytes("mla.w_") + log.dma_bytes("mla.q_norm") + log.dma_bytes(
        "mla.kv_norm") == weight_bytes
    if BLOCK_ROWS[batch]:
        w_qa_blocks = log.select("dma_start", "mla.w_qa")
        assert [e.slot for e in w_qa_blocks] == [0, 1, 0, 1]  # 512 rows in 4 blocks of 128


# x seeds (B = 2) at which the reference's former product batched over rows and heads rounded a
# head's q̃ one bf16 apart from the kernel's one-row products, and the output with it, on an AVX2
# CPU (`stages.mla.head_products`); more seeds in the exhaustive tier
LATENT_SEEDS = [33, 41, *(pytest.param(seed, marks=pytest.mark.exhaustive)
                          for seed in (13, 21, 69, *range(8)))]


@pytest.mark.slow
@pytest.mark.parametrize("seed", LATENT_SEEDS)
def test_mla_latent_equals_the_reference_to_the_bit(race_checked, mini_params, seed):
    """With whole weight blocks the latent MLA kernel sums every product in the reference's order
    (q̃ and each head's output: one [1, K] product per row and head): the same bits."""
    cfg = MINI.replace(mla_cache_layout="latent")
    p = reference.layer_params(mini_params["mla"], 0)
    x = normalised_input(cfg, 2, seed=100 + seed)
    cache = random_cache(cfg, 2, seed=200 + seed)
    positions = jax.random.randint(jax.random.key(300 + seed), (2,), 1, cfg.max_seq_len)
    out, new_cache = mla.mla_attention(p, x, cache, positions, cfg)
    ref_out, ref_cache = reference.mla_attention(p, x, cache, positions, cfg)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))
    for name in ref_cache:
        np.testing.assert_array_equal(np.asarray(new_cache[name], np.float32),
                                      np.asarray(ref_cache[name], np.float32), err_msg=name)


def test_mla_latent_reads_far_fewer_kv_bytes(race_checked, mini_params):
    """Record both layouts at mini shapes (the B=1 case above, exhaustive: the same compiled
    kernels); rescale the logs to Kimi K3 shapes."""
    positions = jnp.array(POSITIONS[1], jnp.int32)
    logs = {}
    for cache in ("expanded", "latent"):
        cfg = MINI.replace(mla_cache_layout=cache)
        p = reference.layer_params(mini_params["mla"], 0)
        with dma.recording() as logs[cache]:
            out, _ = mla.mla_attention(p, normalised_input(cfg, 1, 1), random_cache(cfg, 1, 11),
                                       positions, cfg)
            jax.block_until_ready(out)
    full = config.get_config("kimi-k3")
    rank = get_config("kimi-k3-rank", max_seq_len=32768)
    at = {(name, cache): kv_bytes_at(logs[cache], MINI.replace(mla_cache_layout=cache),
                                         target.replace(mla_cache_layout=cache))
          for name, target in (("kimi-k3", full), ("kimi-k3-rank", rank))
          for cache in ("expanded", "latent")}
    tokens = 48  # position 45: 16-row groups, one tile of 32 and 16 rows of the next (not 64)
    # docs/kimi-k3.md §5: 73,728 B (expanded, 96 heads) vs 1,152 B (latent) per token per layer
    assert at[("kimi-k3", "expanded")] == tokens * 73_728
    assert at[("kimi-k3", "latent")] == tokens * 1_152
    assert at[("kimi-k3", "expanded")] >= 50 * at[("kimi-k3", "latent")]  # 64x
    # one rank holds 3 of the 96 heads but the whole latent: the saving per rank is only 2x
    assert at[("kimi-k3-rank", "expanded")] == 2 * at[("kimi-k3-rank", "latent")]


# ---- MLA at short context: the last KV tile is read only as far as the tokens go -----------------

# Kimi K3's KV tile (256 tokens) at mini shapes: at rank shapes an interpreted run would stream
# GBs of weights, and the KV rows read depend only on positions and tile (the rank-shape kernels
# compile in test_compiles_for_tpu7x)
SHORT_CFG = config.get_config("kimi-k3-mini", kv_tile=256, max_seq_len=512)
SHORT_TOKENS = [1, 15, 16, 17, 127, 128, 129]  # cached tokens a row needs: around 16-row groups


def nan_past(cache, counts):
    """The cache with every row at or past counts[b] set to NaN (rows a kernel may read, then
    must mask: 0 · NaN would poison the softmax)."""
    token = jnp.arange(cache["ckv" if "ckv" in cache else "k"].shape[-2])
    past = token[None, :] >= jnp.asarray(counts)[:, None]  # [B, S]
    return {name: jnp.where(past[:, None, :, None] if array.ndim == 4 else past[:, :, None],
                            jnp.nan, array).astype(array.dtype) for name, array in cache.items()}


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["expanded", "latent", "latent-partial"])
def test_mla_short_context_reads_only_the_16_row_groups_needed(race_checked, mini_params, kernel):
    """Each row reads its tokens rounded up to 16 rows (never the whole 256-token tile), and the
    rows read past them are masked: a cache holding NaN from each row's first unneeded token on
    gives the very same bits."""
    cfg = SHORT_CFG.replace(mla_cache_layout=kernel.split("-")[0])
    batch, per_token = len(SHORT_TOKENS), kv_cache.kv_bytes_per_token(cfg)
    cache = random_cache(cfg, batch, seed=41)
    if kernel == "latent-partial":  # one shard holding the whole cache: tokens 0..position
        q_absorbed, q_extra = absorbed_queries(reference.layer_params(mini_params["mla"], 0),
                                               normalised_input(cfg, batch, seed=40), cfg)
        positions = jnp.array(SHORT_TOKENS, jnp.int32) - 1

        def run(cache):
            _, norm, acc = mla_sharded.mla_latent_partial(q_absorbed, q_extra, cache, positions, 0, cfg)
            return acc / norm  # [B, H, kv_rank]: Σ α ĉ over tokens 0..position

        scores = (jnp.einsum("bhr,bsr->bhs", q_absorbed, cache["ckv"],
                             preferred_element_type=jnp.float32)
                  + jnp.einsum("bhe,bse->bhs", q_extra, cache["kx"],
                               preferred_element_type=jnp.float32)) * cfg.mla_qk_dim ** -0.5
        scores = jnp.where(jnp.arange(cfg.max_seq_len) <= positions[:, None, None], scores,
                           -jnp.inf)
        expected = jnp.matmul(jax.nn.softmax(scores, -1), cache["ckv"].astype(jnp.float32),
                              precision=numerics.HIGHEST)  # f32 (a TPU's default: one bf16 pass)
        check = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    else:
        p = reference.layer_params(mini_params["mla"], 0)
        x = normalised_input(cfg, batch, seed=40)
        positions = jnp.array(SHORT_TOKENS, jnp.int32)  # position p: tokens 0..p-1 cached

        def run(cache):
            return mla.mla_attention(p, x, cache, positions, cfg)[0]

        expected = reference.mla_attention(p, x, cache, positions, cfg)[0]
        check = functools.partial(assert_bf16_close, what=f"MLA {kernel} output")

    with dma.recording() as log:
        out = jax.block_until_ready(run(cache))
    check(out, expected)
    np.testing.assert_array_equal(run(nan_past(cache, SHORT_TOKENS)), out)
    by_row = kv_bytes_by_row(log)
    read = [by_row[b] // per_token for b in range(batch)]
    assert read == [16, 16, 16, 32, 128, 128, 144]  # ⌈tokens / 16⌉ · 16, never 256
    assert read == [kv_cache.rows_read(tokens) for tokens in SHORT_TOKENS]
    # the last tile in runs of 2^i 16-row groups, one DMA per run and cache array: 144 rows are
    # a run of 128 and one of 16
    dmas = [sum(e.indices["row"] == b for e in log.select("dma_start", "mla.kv.")) // 2
            for b in range(batch)]
    assert dmas == [1, 1, 1, 1, 1, 1, 2]


# ---- MLA, latent cache sharded by sequence ---------------------------------------------------------

SHARD_TILE = 16  # 4 shards of the 128-token mini cache hold 32 tokens: two tiles, so the ring alternates
SHARD_POSITIONS = [0, 32, 77, 127]  # first token, a shard boundary, mid-shard, the last token


def absorbed_queries(p, x, cfg):
    """What each head's owner computes and all ranks gather: q̃ = bf(q^C W_kvbKᵀ) and q^X, the
    reference's formulas (docs/kimi-k3.md §5)."""
    batch, h, nope, rank = x.shape[0], cfg.n_heads, cfg.mla_qk_nope, cfg.mla_kv_rank
    c_q = reference.rms_norm(reference.bf(x @ p["w_qa"]), p["q_norm"], cfg.rms_eps)
    q = reference.bf(jnp.dot(c_q, p["w_qb"], preferred_element_type=jnp.float32)).reshape(
        batch, h, cfg.mla_qk_dim)
    w_kb = p["w_kvb"].reshape(rank, h, nope + cfg.mla_v_dim)[..., :nope]
    q_absorbed = reference.bf(jnp.einsum("bhn,rhn->bhr", q[..., :nope], w_kb,
                                         preferred_element_type=jnp.float32))
    return q_absorbed, q[..., nope:]


def finish_heads(p, x, context, cfg):
    """Each head's owner after the merge: o_h = bf(bf(Σαĉ) W_kvbV_h), the gate and W_o (the
    reference's formulas)."""
    batch, h, nope, rank = x.shape[0], cfg.n_heads, cfg.mla_qk_nope, cfg.mla_kv_rank
    w_vb = p["w_kvb"].reshape(rank, h, nope + cfg.mla_v_dim)[..., nope:]
    o = reference.bf(jnp.einsum("bhr,rhv->bhv", reference.bf(context), w_vb,
                                preferred_element_type=jnp.float32)).reshape(batch, -1)
    gate = reference.bf(jax.nn.sigmoid(reference.bf(x @ p["w_g"]).astype(jnp.float32)))
    y = reference.bf(o.astype(jnp.float32) * gate.astype(jnp.float32))
    return reference.bf(jnp.dot(y, p["w_o"], preferred_element_type=jnp.float32))


def run_shards(q_absorbed, q_extra, cache, positions, cfg, n_shards):
    """Every shard's partial state, one after the other (one device), with its DMA log."""
    length = cache["ckv"].shape[1] // n_shards
    partials, logs = [], []
    for i in range(n_shards):
        shard = {name: array[:, i * length:(i + 1) * length] for name, array in cache.items()}
        with dma.recording() as log:
            partials.append(jax.block_until_ready(mla_sharded.mla_latent_partial(
                q_absorbed, q_extra, shard, positions, i * length, cfg, kv_tile=SHARD_TILE,
                shard=i)))
        logs.append(log)
    return partials, logs


@pytest.mark.slow
def test_mla_latent_sequence_shards_combine_to_the_reference(race_checked, mini_params):
    """4 shards of the latent cache, merged, = the unsharded partial (f32, 1e-5) and, finished by
    the heads' owner, = the reference output (the stated bf16 tolerance)."""
    cfg = MINI.replace(mla_cache_layout="latent")
    p = reference.layer_params(mini_params["mla"], 0)
    batch = len(SHARD_POSITIONS)
    x = normalised_input(cfg, batch, seed=30)
    positions = jnp.array(SHARD_POSITIONS, jnp.int32)
    ref_out, ref_cache = reference.mla_attention(p, x, random_cache(cfg, batch, 31), positions, cfg)
    q_absorbed, q_extra = absorbed_queries(p, x, cfg)

    # the cache after the step holds the new entries (each position's shard wrote its own)
    (whole,), _ = run_shards(q_absorbed, q_extra, ref_cache, positions, cfg, n_shards=1)
    partials, logs = run_shards(q_absorbed, q_extra, ref_cache, positions, cfg, n_shards=4)
    _, norm, acc = mla_sharded.combine_partials(partials)
    context = acc / norm  # [B, H, kv_rank]
    np.testing.assert_allclose(np.asarray(context), np.asarray(whole[2] / whole[1]), rtol=1e-5,
                               atol=1e-6)
    assert_bf16_close(finish_heads(p, x, context, cfg), ref_out, "sequence-sharded latent output")

    # each shard reads exactly its own tiles holding tokens <= the row's position
    length, per_token = MINI.max_seq_len // 4, kv_cache.kv_bytes_per_token(cfg)
    for i, log in enumerate(logs):
        for b, position in enumerate(SHARD_POSITIONS):
            tokens = min(max(position + 1 - i * length, 0), length)
            tiles = [e.indices["tile"] for e in log.select("dma_start", "mla.kv.ckv")
                     if e.indices["row"] == b]
            assert tiles == list(range(-(-tokens // SHARD_TILE))), (i, b, tiles)
            assert kv_bytes_by_row(log).get(b, 0) == len(tiles) * SHARD_TILE * per_token
        assert all(e.indices["shard"] == i for e in log.select("dma_start", "mla.kv."))
    # the last row reads every shard whole: the ring alternates slots within a shard
    assert [e.slot for e in logs[3].select("dma_start", "mla.kv.ckv")] == [0, 1]


@pytest.mark.slow
def test_mla_latent_sequence_sharded_reads_64x_fewer_kv_bytes_per_rank(race_checked, mini_params):
    """A mini run with the row at the last position, scaled to a Kimi K3 rank (3 heads, 32 ranks,
    context 32768): head-sharded latent reads 2x fewer KV bytes than expanded, sequence-sharded
    latent 64x fewer."""
    p = reference.layer_params(mini_params["mla"], 0)
    positions = jnp.array([MINI.max_seq_len - 1], jnp.int32)
    logs = {}
    for cache in ("expanded", "latent"):  # test_mla_latent_reads_far_fewer_kv_bytes' kernels
        cfg = MINI.replace(mla_cache_layout=cache)
        with dma.recording() as logs[cache]:
            jax.block_until_ready(mla.mla_attention(p, normalised_input(cfg, 1, 1),
                                                    random_cache(cfg, 1, 11), positions, cfg))
    cfg = MINI.replace(mla_cache_layout="latent")
    q_absorbed, q_extra = absorbed_queries(p, normalised_input(cfg, 1, 1), cfg)
    _, logs["latent-sequence"] = run_shards(q_absorbed, q_extra, random_cache(cfg, 1, 11),
                                            positions, cfg, n_shards=4)

    rank = get_config("kimi-k3-rank", max_seq_len=32768)
    per_rank = kv_bytes_per_rank(logs, MINI, rank, n_ranks=32, row=0)
    assert per_rank == {"expanded": 32768 * 3 * (256 + 128) * 2,  # 3 heads of K, V: 2,304 B/token
                        "latent": 32768 * 1_152,  # the whole latent: 1,152 B/token
                        "latent-sequence": 32768 // 32 * 1_152}  # 1/32 of the tokens
    assert per_rank["expanded"] == 2 * per_rank["latent"]
    assert per_rank["expanded"] >= 50 * per_rank["latent-sequence"]
    assert per_rank["expanded"] == 64 * per_rank["latent-sequence"]


# ---- KDA ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("batch", [  # B = 3 here; B = 1 and 8 (the megakernel checks 8): exhaustive
    pytest.param(1, marks=pytest.mark.exhaustive), 3, pytest.param(8, marks=pytest.mark.exhaustive)])
def test_kda_matches_reference(race_checked, mini_params, batch):
    cfg = MINI
    h, d = cfg.n_heads, cfg.kda_head_dim
    p = reference.layer_params(mini_params["kda"], 1)
    keys = jax.random.split(jax.random.key(batch), 2)
    conv = jax.random.normal(keys[0], (batch, cfg.kda_conv_size - 1, 3, h, d)).astype(jnp.bfloat16)
    state = 0.1 * jax.random.normal(keys[1], (batch, h, d, d), jnp.float32)
    x = normalised_input(cfg, batch, seed=20 + batch)

    with dma.recording() as log:
        out, new_conv, new_state = kda.kda_attention(p, x, conv, state, cfg,
                                                     weight_block_rows=BLOCK_ROWS[batch])
        jax.block_until_ready(out)
    ref_out, ref_conv, ref_state = reference.kda_attention(p, x, conv, state, cfg)

    assert_bf16_close(out, ref_out, f"KDA B={batch} output")
    assert_state_equal(new_conv, ref_conv, batch, "conv state")
    np.testing.assert_allclose(np.asarray(new_state), np.asarray(ref_state), rtol=0,
                               atol=STATE_ATOL)
    # the f32 state is read once and written once; every weight byte goes through the log
    state_bytes = batch * h * d * d * 4
    assert log.dma_bytes("kda.state.read") == log.dma_bytes("kda.state.write") == state_bytes
    weight_bytes = sum(int(np.prod(p[name].shape)) * p[name].dtype.itemsize
                       for name in kda.WEIGHT_NAMES)
    assert log.dma_bytes("kda.w_") + sum(log.dma_bytes(f"kda.{name}") for name in
                                         ("conv_w", "a_log", "dt_bias", "o_norm")) == weight_bytes


def test_kda_decay_stays_above_its_bound(race_checked, mini_params):
    """A huge decay rate saturates λ at the bound −5: the state shrinks by e^-5, no further."""
    cfg = MINI
    h, d = cfg.n_heads, cfg.kda_head_dim
    p = dict(reference.layer_params(mini_params["kda"], 0))
    p["a_log"] = jnp.full((h,), 30.0, jnp.float32)  # exp(30)·(g + bias) -> σ = 1 where positive
    p["dt_bias"] = jnp.full((h * d,), 100.0, jnp.float32)
    p["w_k"] = jnp.zeros_like(p["w_k"])  # k = 0: no delta update, only the decay acts
    conv = jnp.zeros((1, cfg.kda_conv_size - 1, 3, h, d), jnp.bfloat16)
    state = jnp.ones((1, h, d, d), jnp.float32)
    x = normalised_input(cfg, 1, seed=3)
    with dma.recording():  # recorded like the B=1 case above (exhaustive): the same kernel
        _, _, new_state = kda.kda_attention(p, x, conv, state, cfg)
    np.testing.assert_allclose(np.asarray(new_state), np.exp(cfg.kda_decay_bound), rtol=1e-5)


# ---- compilation for TPU7x ----------------------------------------------------------------------


def _mla_structs(cfg, batch):
    s = jax.ShapeDtypeStruct
    p = {name: s(shape, jnp.bfloat16) for name, shape in mla.weight_shapes(cfg).items()}
    cache = {name: s(shape, jnp.bfloat16)
             for name, shape in mla.cache_shapes(cfg, batch, cfg.max_seq_len).items()}
    return p, s((batch, cfg.d_model), jnp.bfloat16), cache, s((batch,), jnp.int32)


def _kda_structs(cfg, batch):
    s = jax.ShapeDtypeStruct
    h, d = cfg.n_heads, cfg.kda_head_dim
    p = {name: s(shape, kda.WEIGHT_DTYPES.get(name, jnp.bfloat16))
         for name, shape in kda.weight_shapes(cfg).items()}
    return (p, s((batch, cfg.d_model), jnp.bfloat16),
            s((batch, cfg.kda_conv_size - 1, 3, h, d), jnp.bfloat16),
            s((batch, h, d, d), jnp.float32))


def _partial_structs(cfg, batch, n_ranks, n_heads):
    """One rank's inputs with the latent cache sharded by sequence: the absorbed queries of all
    n_heads heads, 1/n_ranks of the context."""
    s = jax.ShapeDtypeStruct
    shard = cfg.max_seq_len // n_ranks
    cache = {"ckv": s((batch, shard, cfg.mla_kv_rank), jnp.bfloat16),
             "kx": s((batch, shard, cfg.mla_qk_extra), jnp.bfloat16)}
    return (s((batch, n_heads, cfg.mla_kv_rank), jnp.bfloat16),
            s((batch, n_heads, cfg.mla_qk_extra), jnp.bfloat16), cache, s((batch,), jnp.int32),
            s((), jnp.int32))


COMPILE_CASES = [("kimi-k3-mini", {}, 3), ("kimi-k3-rank", {"max_seq_len": 32768}, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides,batch", COMPILE_CASES)
@pytest.mark.parametrize("kernel", ["mla-expanded", "mla-latent", "mla-latent-partial",
                                    "kda"])
def test_compiles_for_tpu7x(name, overrides, batch, kernel):
    if kernel == "mla-latent-partial":
        cfg = get_config(name, mla_cache_layout="latent", **overrides)
        result = tpu.compile_for(
            lambda q, qx, c, pos, start: mla_sharded.mla_latent_partial(q, qx, c, pos, start, cfg),
            # a rank of kimi-k3-rank: 1/32 of the context, all 96 heads; mini: 4 shards, 2 heads
            *(_partial_structs(cfg, batch, 32, cfg.n_heads * 32) if name == "kimi-k3-rank"
              else _partial_structs(cfg, batch, 4, cfg.n_heads)), chip="tpu7x")
    elif kernel == "kda":
        cfg = get_config(name, **overrides)
        result = tpu.compile_for(lambda p, x, c, s: kda.kda_attention(p, x, c, s, cfg),
                                 *_kda_structs(cfg, batch), chip="tpu7x")
    else:
        cfg = get_config(name, mla_cache_layout=kernel.split("-")[1], **overrides)
        result = tpu.compile_for(lambda p, x, c, pos: mla.mla_attention(p, x, c, pos, cfg),
                                 *_mla_structs(cfg, batch), chip="tpu7x")
    print(f"{kernel} at {name} (B={batch}, context {cfg.max_seq_len}): {result}")
    assert result.n_mosaic_kernels == 1


# ---- bad input ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mla_inputs(mini_params):
    p = reference.layer_params(mini_params["mla"], 0)
    return p, normalised_input(MINI, 2, 0), random_cache(MINI, 2, 1), jnp.array([3, 9], jnp.int32)


@pytest.mark.slow
def test_mla_rejects_a_position_past_the_cache(mla_inputs):
    p, x, cache, _ = mla_inputs
    with pytest.raises(ValueError, match=r"positions=.*too short"):
        mla.mla_attention(p, x, cache, jnp.array([3, MINI.max_seq_len], jnp.int32), MINI)


@pytest.mark.parametrize("change,match", [
    (lambda p, x, c, pos: (p, x.astype(jnp.float32), c, pos), r"x\.dtype"),
    (lambda p, x, c, pos: (p, x, {**c, "v": c["v"].astype(jnp.float32)}, pos),
     r"cache\['v'\]\.dtype"),
    (lambda p, x, c, pos: ({**p, "w_o": p["w_o"].astype(jnp.float32)}, x, c, pos),
     r"p\['w_o'\]\.dtype"),
    (lambda p, x, c, pos: (p, x, c, pos.astype(jnp.float32)), r"positions\.dtype"),
])
def test_mla_rejects_dtype_mismatch(mla_inputs, change, match):
    with pytest.raises(ValueError, match=match):
        mla.mla_attention(*change(*mla_inputs), MINI)


@pytest.mark.parametrize("option,value", [("kv_tile", 24), ("kv_tile", 48),
                                          ("weight_block_rows", 64)])
def test_mla_rejects_block_sizes_that_break_tiling(mla_inputs, option, value):
    with pytest.raises(ValueError, match=option):
        mla.mla_attention(*mla_inputs, MINI, **{option: value})


def test_kda_rejects_bad_dtype_and_block_rows(mini_params):
    cfg = MINI
    h, d = cfg.n_heads, cfg.kda_head_dim
    p = reference.layer_params(mini_params["kda"], 0)
    x = normalised_input(cfg, 1, 0)
    conv = jnp.zeros((1, cfg.kda_conv_size - 1, 3, h, d), jnp.bfloat16)
    state = jnp.zeros((1, h, d, d), jnp.float32)
    with pytest.raises(ValueError, match=r"state\.dtype"):
        kda.kda_attention(p, x, conv, state.astype(jnp.bfloat16), cfg)
    with pytest.raises(ValueError, match=r"conv\.dtype"):
        kda.kda_attention(p, x, conv.astype(jnp.float32), state, cfg)
    with pytest.raises(ValueError, match="weight_block_rows"):
        kda.kda_attention(p, x, conv, state, cfg, weight_block_rows=200)


@pytest.mark.parametrize("change,match", [
    (lambda q, qx, c, pos, start: (q.astype(jnp.float32), qx, c, pos, start), r"q_absorbed\.dtype"),
    (lambda q, qx, c, pos, start: (q, qx[:, :1], c, pos, start), r"q_extra has shape"),
    (lambda q, qx, c, pos, start: (q, qx, {**c, "kx": c["kx"].astype(jnp.float32)}, pos, start),
     r"cache_shard\['kx'\]\.dtype"),
    (lambda q, qx, c, pos, start: (q, qx, c, pos, -32), r"shard_start"),
])
@pytest.mark.slow
def test_mla_latent_partial_rejects_bad_input(change, match):
    cfg = MINI.replace(mla_cache_layout="latent")
    q = jnp.zeros((2, cfg.n_heads, cfg.mla_kv_rank), jnp.bfloat16)
    qx = jnp.zeros((2, cfg.n_heads, cfg.mla_qk_extra), jnp.bfloat16)
    cache = {"ckv": jnp.zeros((2, 32, cfg.mla_kv_rank), jnp.bfloat16),
             "kx": jnp.zeros((2, 32, cfg.mla_qk_extra), jnp.bfloat16)}
    positions = jnp.array([3, 40], jnp.int32)
    with pytest.raises(ValueError, match=match):
        mla_sharded.mla_latent_partial(*change(q, qx, cache, positions, 32), cfg)
    with pytest.raises(ValueError, match="kv_tile"):
        mla_sharded.mla_latent_partial(q, qx, cache, positions, 32, cfg, kv_tile=24)
