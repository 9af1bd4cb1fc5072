"""The fused final mix + norm + LM head + sampling stage vs the reference (interpret mode, races on).

Tokens are compared exactly with `mkresearch.model.sampling.sample` run on the logits the stage
computed (`return_logits=True`): same logits, same counter noise, so the same token. Those logits
match `reference.final_logits` to a tolerance (XLA on CPU may skip the bf16 rounding of the mix
output when it is fused into the norm: `xla_allow_excess_precision`, 1 bf16 ulp of the normalised
x), and greedy is also compared with the reference logits directly on inputs with clear margins.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.base import dma
from mkresearch.kernels.stages import sampling as stage

from mkresearch.hardware import tpu
from mkresearch.model import reference, sampling
from mkresearch.model.config import get_config

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

MINI = get_config("kimi-k3-mini")
LOGITS_ATOL = 3e-2  # kernel vs reference logits (|logits| ~ 1-10): a few bf16 ulps of x


def make_inputs(cfg, batch, seed=0, head_scale=0.05):
    """Random final-stage inputs: snapshots [n_blocks, B, d], partial [B, d], weights."""
    keys = jax.random.split(jax.random.key(seed), 5)
    d, vocab = cfg.d_model, cfg.vocab_size
    return {
        "snapshots": jax.random.normal(keys[0], (cfg.n_blocks, batch, d)).astype(jnp.bfloat16),
        "partial": jax.random.normal(keys[1], (batch, d)).astype(jnp.bfloat16),
        "mix_out": jax.random.normal(keys[2], (d,)) * 0.05,
        "final_norm": (1 + 0.1 * jax.random.normal(keys[3], (d,))).astype(jnp.bfloat16),
        "lm_head": (jax.random.normal(keys[4], (d, vocab)) * head_scale).astype(jnp.bfloat16),
    }


def run_stage(inputs, cfg, **kwargs):
    return stage.sample_stage(inputs["snapshots"], inputs["partial"], inputs["mix_out"],
                              inputs["final_norm"], inputs["lm_head"], cfg=cfg, **kwargs)


def reference_logits(inputs, cfg):
    params = {k: inputs[k] for k in ("mix_out", "final_norm", "lm_head")}
    return reference.final_logits(params, inputs["snapshots"], inputs["partial"], cfg)


def normalised_x(inputs, cfg):
    candidates = jnp.concatenate([inputs["snapshots"], inputs["partial"][None]])
    h = reference.mix(candidates, inputs["mix_out"], cfg.rms_eps)
    return reference.rms_norm(h, inputs["final_norm"], cfg.rms_eps).astype(jnp.float32)


def tv_bound(probs, n_draws, failure=1e-6):
    """A TV radius the histogram of n_draws stays within with prob. >= 1 - failure:
    E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n), and TV moves by <= 1/n per draw (McDiarmid)."""
    probs = np.asarray(probs, np.float64)
    mean = 0.5 * np.sum(np.sqrt(probs * (1 - probs) / n_draws))
    return mean + math.sqrt(math.log(1 / failure) / (2 * n_draws))


@pytest.mark.slow
# ---- greedy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.exhaustive), 8])  # 8 rows hold 1
def test_greedy_equals_reference_with_engineered_ties(race_checked, batch):
    inputs = make_inputs(MINI, batch, seed=batch)
    x = normalised_x(inputs, MINI)  # [B, d]
    head = np.array(inputs["lm_head"].astype(jnp.float32))
    # row b: a big logit (~8) on several identical columns, in different tiles and in one tile
    tie_sets = [[700, 1100, 1900], [1030, 1031], [5, 2047], [512, 513, 1024],
                [0, 1], [511, 1535], [128, 300, 301], [2000, 2046]]
    for b in range(batch):
        column = 8.0 * x[b] / float(jnp.sum(x[b] * x[b]))
        for j in tie_sets[b]:
            head[:, j] = np.asarray(column)
    inputs["lm_head"] = jnp.asarray(head, jnp.bfloat16)
    want_logits = reference_logits(inputs, MINI)
    want = sampling.sample(want_logits, seed=0, positions=jnp.zeros(batch, jnp.int32))
    expected = [tie_sets[b][0] for b in range(batch)]
    np.testing.assert_array_equal(want, expected)  # the ties are real in the reference
    result = run_stage(inputs, MINI, seed=0, positions=np.zeros(batch, np.int32), return_logits=True)
    np.testing.assert_array_equal(result.tokens, expected)
    assert result.tokens.dtype == jnp.int32 and result.tokens.shape == (batch,)
    assert not bool(jnp.any(result.nucleus_overflow))
    np.testing.assert_allclose(result.logits, want_logits, atol=LOGITS_ATOL, rtol=0)
    for b in range(batch):  # the tie is exact in the kernel's logits too
        assert len(set(np.asarray(result.logits[b, tie_sets[b]]).tolist())) == 1


def test_greedy_random_inputs_match_reference_and_no_logits_by_default(race_checked):
    inputs = make_inputs(MINI, 8, seed=11)
    result = run_stage(inputs, MINI, seed=3, positions=np.arange(8))
    assert result.logits is None
    logits = reference_logits(inputs, MINI)
    want = np.asarray(sampling.sample(logits, seed=3, positions=jnp.arange(8)))
    top2 = np.sort(np.asarray(logits), axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * LOGITS_ATOL  # rows whose argmax no ulp of x can move
    assert clear.sum() >= 4
    np.testing.assert_array_equal(np.asarray(result.tokens)[clear], want[clear])


# ---- the candidate list (plain JAX: the same function the body runs on VMEM values) -------------
@pytest.mark.parametrize("kind", ["random", "ties"])
@pytest.mark.slow
def test_merge_candidates_keeps_sorted_top_128(kind):
    rng = np.random.default_rng(3)
    batch, tile, vocab = 4, 256, 1024
    z = rng.normal(size=(batch, vocab)).astype(np.float32)
    if kind == "ties":
        z = np.round(z * 2) / 2  # a few distinct values: ties across and within tiles
    values, indices = stage.initial_state(batch)[-2:]
    for start in range(0, vocab, tile):
        tile_indices = jnp.broadcast_to(jnp.arange(start, start + tile, dtype=jnp.int32), (batch, tile))
        values, indices = stage.merge_candidates(values, indices, jnp.asarray(z[:, start:start + tile]),
                                                 tile_indices)
    order = np.lexsort((np.broadcast_to(np.arange(vocab), z.shape), -z), axis=1)[:, :128]
    np.testing.assert_array_equal(indices, order)  # z descending, index ascending
    np.testing.assert_array_equal(values, np.take_along_axis(z, order, axis=1))


# ---- sampling: same noise as the reference ----------------------------------------------------
MODES = {
    "temperature": [None, 1.0, 0.7, 1.0, 0.8, 1.2, 1.0, 2.0],  # None: a greedy row
    "top_k": [0, 0, 0, 1, 5, 128, 0, 40],
    "top_p": [1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.5, 0.8],
}


@pytest.mark.slow
def test_mixed_modes_equal_reference_sampler(race_checked):
    inputs = make_inputs(MINI, 8, seed=2, head_scale=0.15)
    positions = np.arange(8) + 17
    result = run_stage(inputs, MINI, seed=9, positions=positions, return_logits=True, **MODES)
    np.testing.assert_allclose(result.logits, reference_logits(inputs, MINI), atol=3 * LOGITS_ATOL)
    want = sampling.sample(result.logits, seed=9, positions=positions, candidates=128, **MODES)
    np.testing.assert_array_equal(result.tokens, want)
    # row 0 (temperature None) is greedy inside the same call as the sampled rows
    assert int(result.tokens[0]) == int(jnp.argmax(result.logits[0]))
    flags = sampling.nucleus_overflow(result.logits, candidates=128, **MODES)
    np.testing.assert_array_equal(result.nucleus_overflow, flags)


def test_determinism_and_streams(race_checked):
    inputs = make_inputs(MINI, 8, seed=4)
    positions = np.full(8, 5)
    first = run_stage(inputs, MINI, seed=21, positions=positions, temperature=1.0).tokens
    again = run_stage(inputs, MINI, seed=21, positions=positions, temperature=1.0).tokens
    other = run_stage(inputs, MINI, seed=22, positions=positions, temperature=1.0).tokens
    np.testing.assert_array_equal(first, again)
    assert np.sum(np.asarray(first) != np.asarray(other)) >= 4  # a different stream
    # (seed, row, position) is the whole state: rows are independent streams, positions too
    moved = run_stage(inputs, MINI, seed=21, positions=positions + 1, temperature=1.0).tokens
    assert np.sum(np.asarray(first) != np.asarray(moved)) >= 4


# ---- distributions over many draws (small vocab, many identical rows) -------------------------
SMALL = MINI.replace(vocab_size=256)
DRAWS = 4096


@pytest.fixture(scope="module")
def many_rows():
    """DRAWS identical rows (positions 0..DRAWS-1): DRAWS samples of one row's distribution."""
    one = make_inputs(SMALL, 1, seed=5, head_scale=0.12)
    inputs = dict(one)
    inputs["snapshots"] = jnp.broadcast_to(one["snapshots"], (SMALL.n_blocks, DRAWS, SMALL.d_model))
    inputs["partial"] = jnp.broadcast_to(one["partial"], (DRAWS, SMALL.d_model))
    return inputs


# rows per call: the stage holds its rows in VMEM, and 4,096 of them (80 MB) pass a v5e's scoped
# VMEM limit (32 MiB); each call's rows are streams 0..511 at their own positions
ROWS_PER_CALL = 512


def run_in_calls(inputs, positions, **kwargs):
    """The stage over DRAWS rows in calls of ROWS_PER_CALL rows, the results concatenated."""
    parts = []
    for start in range(0, DRAWS, ROWS_PER_CALL):
        rows = slice(start, start + ROWS_PER_CALL)
        part = dict(inputs, snapshots=inputs["snapshots"][:, rows], partial=inputs["partial"][rows])
        parts.append(run_stage(part, SMALL, positions=positions[rows], **kwargs))
    return stage.SampleResult(*(jnp.concatenate(each) for each in zip(*parts)))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 6},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 1.5, "top_k": 50, "top_p": 0.9},
])
def test_sampled_distribution(race_checked, many_rows, mode):
    result = run_in_calls(many_rows, seed=1, positions=np.arange(DRAWS), vocab_tile=128,
                          return_logits=True, **mode)
    logits_row = result.logits[:1]
    assert bool(jnp.all(result.logits == logits_row))  # every row saw the same distribution
    exact = np.asarray(sampling.truncated_distribution(logits_row, candidates=128, **mode))[0]
    if len(mode) == 1:
        np.testing.assert_allclose(exact, jax.nn.softmax(logits_row[0] / mode["temperature"]),
                                   rtol=1e-4, atol=1e-9)
    assert not bool(jnp.any(result.nucleus_overflow))  # these nuclei fit in 128 candidates
    histogram = np.bincount(np.asarray(result.tokens), minlength=SMALL.vocab_size) / DRAWS
    tv = 0.5 * np.abs(histogram - exact).sum()
    bound = tv_bound(exact, DRAWS)
    assert tv < bound, (tv, bound)
    assert np.all(histogram[exact == 0] == 0)  # nothing outside the kept set
    # and draw for draw it is the reference sampler with the same noise (row r of each call)
    rows = jnp.arange(DRAWS).reshape(-1, ROWS_PER_CALL)
    want = jnp.concatenate([sampling.sample(result.logits[r], seed=1, positions=r,
                                            candidates=128, **mode) for r in rows])
    np.testing.assert_array_equal(result.tokens, want)


# ---- the nucleus-overflow flag -----------------------------------------------------------------
@pytest.mark.slow
def test_nucleus_overflow_flag_is_exact(race_checked):
    inputs = make_inputs(MINI, 8, seed=6, head_scale=0.1)
    temperature = [None, 50.0, 50.0, 50.0, 0.05, 1.0, 3.0, 50.0]
    top_p = [0.9, 0.9, 0.9, 0.02, 0.9, 0.95, 0.7, 0.999]
    top_k = [0, 0, 100, 0, 0, 0, 0, 0]
    result = run_stage(inputs, MINI, seed=2, positions=np.arange(8), return_logits=True,
                       temperature=temperature, top_p=top_p, top_k=top_k)
    want = sampling.nucleus_overflow(result.logits, temperature=temperature, top_p=top_p,
                                     top_k=top_k, candidates=128)
    np.testing.assert_array_equal(result.nucleus_overflow, want)
    # greedy and top-k rows never overflow; a near-uniform 0.9-nucleus (T = 50) does
    assert list(np.asarray(want)[:4]) == [False, True, False, False]
    sizes = sampling.nucleus_size(result.logits, temperature=temperature, top_p=top_p)
    np.testing.assert_array_equal(np.asarray(want)[1:], (np.asarray(sizes) > 128)[1:] &
                                  (np.asarray(top_k)[1:] == 0))
    tokens = sampling.sample(result.logits, seed=2, positions=jnp.arange(8), temperature=temperature,
                             top_p=top_p, top_k=top_k, candidates=128)
    np.testing.assert_array_equal(result.tokens, tokens)
    # a smaller capacity overflows sooner, and the flag follows it
    small = run_stage(inputs, MINI, seed=2, positions=np.arange(8), candidates=16,
                      temperature=temperature, top_p=top_p, top_k=[0] * 8)
    np.testing.assert_array_equal(small.nucleus_overflow, sampling.nucleus_overflow(
        result.logits, temperature=temperature, top_p=top_p, candidates=16))


# ---- soft-cap ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_logit_softcap(race_checked):
    capped = MINI.replace(logit_softcap=2.0)
    inputs = make_inputs(capped, 8, seed=8, head_scale=0.15)
    result = run_stage(inputs, capped, seed=4, positions=np.arange(8), return_logits=True, **MODES)
    want_logits = reference_logits(inputs, capped)
    assert float(jnp.max(jnp.abs(want_logits))) <= 2.0
    np.testing.assert_allclose(result.logits, want_logits, atol=3 * LOGITS_ATOL)
    want = sampling.sample(result.logits, seed=4, positions=np.arange(8), candidates=128, **MODES)
    np.testing.assert_array_equal(result.tokens, want)


# ---- races and bytes -----------------------------------------------------------------------------
@pytest.mark.slow
def test_dma_log_reads_lm_head_exactly_once(race_checked):
    inputs = make_inputs(MINI, 8, seed=9)
    vocab_tile = 512
    with dma.recording() as log:
        run_stage(inputs, MINI, seed=0, positions=np.arange(8), vocab_tile=vocab_tile,
                  temperature=1.0, top_p=0.9).tokens.block_until_ready()
    n_tiles = MINI.vocab_size // vocab_tile
    starts = log.select("dma_start", stage.LM_HEAD)
    assert log.dma_bytes(stage.LM_HEAD) == MINI.d_model * MINI.vocab_size * 2
    assert sorted(e.indices["tile"] for e in starts) == list(range(n_tiles))
    assert [e.slot for e in starts] == [t % 2 for t in range(n_tiles)]
    assert all(e.src == "hbm" and e.dst == "vmem" for e in starts)
    assert log.dma_bytes() == log.dma_bytes(stage.LM_HEAD)  # nothing else moves by DMA
    phases = [e.name for e in log.select("phase_start")]
    assert phases == ["final_mix_norm"] + ["lm_head_tile"] * n_tiles + ["sample"]
    assert not tpu.races_found()


# ---- compiling for TPU7x -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name, batch, mode", [
    ("kimi-k3-mini", 8, {"temperature": 1.0, "top_p": 0.9}),
    ("kimi-k3-rank", 1, {"temperature": None}),
    ("kimi-k3-rank", 8, MODES),
])
def test_compiles_for_tpu7x(name, batch, mode):
    cfg = get_config(name)
    d, vocab = cfg.d_model, cfg.vocab_size
    shape = jax.ShapeDtypeStruct
    args = (shape((cfg.n_blocks, batch, d), jnp.bfloat16), shape((batch, d), jnp.bfloat16),
            shape((d,), jnp.float32), shape((d,), jnp.bfloat16), shape((d, vocab), jnp.bfloat16))

    def tail(snapshots, partial, mix_out, final_norm, lm_head):
        return stage.sample_stage(snapshots, partial, mix_out, final_norm, lm_head, cfg=cfg, seed=0,
                                  positions=np.arange(batch), **mode).tokens

    compiled = tpu.compile_for(tail, *args, chip="tpu7x")
    assert compiled.n_mosaic_kernels == 1
    assert compiled.bytes_accessed >= d * vocab * 2  # the whole LM head shard, once


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": 0.0}, "temperature.*use temperature=None for greedy"),
    ({"temperature": -1.0}, "temperature.*use temperature=None for greedy"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": [None, 0.0]}, "temperature.*use temperature=None for greedy"),
    ({"temperature": [1.0, 1.0, 1.0]}, "temperature"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
    ({"temperature": 1.0, "top_p": 1.01}, "top_p"),
    ({"temperature": 1.0, "top_k": 129}, "top_k"),
    ({"temperature": 1.0, "top_k": 40, "candidates": 32}, "top_k"),
    ({"candidates": 0}, "candidates"),
    ({"candidates": 200}, "candidates"),
    ({"vocab_tile": 100}, "vocab_tile"),
    ({"vocab_tile": 768}, "vocab_tile"),
    ({"positions": np.arange(3)}, "positions"),
    ({"seed": 2**40}, "seed"),
])
def test_bad_input_names_the_parameter(kwargs, name):
    inputs = make_inputs(MINI, 2)
    kwargs = {"seed": 0, "positions": np.arange(2), **kwargs}
    with pytest.raises(ValueError, match=name):
        run_stage(inputs, MINI, **kwargs)


def test_bad_arrays_name_the_parameter():
    inputs = make_inputs(MINI, 2)
    for key, bad in [("lm_head", inputs["lm_head"].astype(jnp.float32)),
                     ("partial", inputs["partial"][:, :256]),
                     ("mix_out", inputs["mix_out"].astype(jnp.bfloat16)),
                     ("snapshots", inputs["snapshots"][:, :1])]:
        with pytest.raises(ValueError, match=key):
            run_stage({**inputs, key: bad}, MINI, seed=0, positions=np.arange(2))
