"""The sampling reference: greedy ties, determinism, exact distributions, nucleus and overflow, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkresearch.model import sampling

DRAWS = 2**17  # draws per distribution test, all in one vectorised call
VOCAB = 16


def tv_bound(n_draws: int, support: int, failure: float = 1e-6) -> float:
    """Total-variation radius the empirical histogram stays within with prob. >= 1 - failure.

    Bretagnolle-Huber-Carol: P(TV > eps) <= 2^support * exp(-2 n eps^2)."""
    return math.sqrt((support * math.log(2) + math.log(1 / failure)) / (2 * n_draws))


def python_uniform(seed, row, position, index):
    """The documented hash chain in plain Python ints (an independent check of the jnp version)."""
    mask = 0xFFFFFFFF

    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & mask
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & mask
        return h ^ (h >> 16)

    key = fmix(fmix(fmix((seed + 0x9E3779B9) & mask) ^ row) ^ ((position + 0x7F4A7C15) & mask))
    h = fmix(key ^ ((index + 0x5851F42D) & mask))
    return ((h >> 8) | 1) * 2.0**-24


def draw_histogram(logits_row, n_draws, **kwargs):
    """Histogram of n_draws samples of one logits row (n_draws rows, positions 0..n-1)."""
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (n_draws, len(logits_row)))
    tokens = sampling.sample(logits, seed=7, positions=jnp.arange(n_draws), **kwargs)
    return np.bincount(np.asarray(tokens), minlength=len(logits_row)) / n_draws


@pytest.fixture(scope="module")
def small_logits():
    return np.asarray(jax.random.normal(jax.random.key(1), (VOCAB,)) * 1.5, np.float32)


def test_counter_uniform_is_in_open_interval_and_uint32_pure():
    u = sampling.counter_uniform(3, jnp.arange(8)[:, None], 11, jnp.arange(4096)[None, :])
    assert u.dtype == jnp.float32 and u.shape == (8, 4096)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.01
    # ints wrap modulo 2^32 the same way whatever their type
    assert sampling.counter_uniform(-1, 0, 0, 0) == sampling.counter_uniform(2**32 - 1, 0, 0, 0)
    assert sampling.counter_uniform(jnp.int32(-1), 0, 0, 0) == sampling.counter_uniform(
        jnp.uint32(2**32 - 1), 0, 0, 0)
    # pinned values: kernels and other machines must reproduce these bits exactly
    for counters in [(0, 0, 0, 0), (1, 2, 3, 4), (2**32 - 1, 7, 123456, 163839)]:
        assert float(sampling.counter_uniform(*counters)) == python_uniform(*counters)
    assert float(sampling.counter_uniform(1, 2, 3, 4)) == 0.8622099757194519
    g = sampling.gumbel(0, 1, 2, jnp.arange(100000))
    assert bool(jnp.all(jnp.isfinite(g))) and abs(float(g.mean()) - 0.5772) < 0.02


def test_counter_uniform_indices_do_not_collide():
    h = sampling.uniform_from_key(sampling.counter_key(5, 2, 9), jnp.arange(2**16))
    # (h >> 8) | 1 takes 2^23 values: ~2^32 / 2^24 = 256 birthday collisions expected, not thousands
    assert len(np.unique(np.asarray(h))) > 2**16 - 400


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_lowest_index_wins_ties(batch):
    logits = np.array(jax.random.normal(jax.random.key(batch), (batch, 64)), np.float32)
    logits[:, [5, 17, 40]] = logits.max() + 1.0  # a three-way tie for the max
    tokens = sampling.sample(jnp.asarray(logits), seed=0, positions=jnp.zeros(batch, jnp.int32))
    assert tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens, np.full(batch, 5))
    # greedy is temperature=None (the default), and it ignores top_k / top_p
    again = sampling.sample(jnp.asarray(logits), seed=1, positions=jnp.arange(batch),
                            temperature=None, top_k=3, top_p=0.2)
    np.testing.assert_array_equal(again, tokens)
    per_row = sampling.sample(jnp.asarray(logits), seed=1, positions=jnp.arange(batch),
                              temperature=[None] * batch)
    np.testing.assert_array_equal(per_row, tokens)


def test_mixed_greedy_and_sampled_rows(small_logits):
    """Per-row temperature: None rows are greedy, the others sample exactly as if every row did."""
    batch = 64
    logits = jnp.asarray(np.stack([np.roll(small_logits, b) for b in range(batch)]))  # [B, V]
    positions = jnp.arange(batch) + 3
    mixed = [None if b % 3 == 0 else 0.5 + b / batch for b in range(batch)]
    all_sampled = [0.5 + b / batch for b in range(batch)]  # the same T on the sampled rows
    tokens = np.asarray(sampling.sample(logits, seed=5, positions=positions, temperature=mixed))
    sampled = np.asarray(sampling.sample(logits, seed=5, positions=positions,
                                         temperature=all_sampled))
    greedy_rows = np.array([t is None for t in mixed])
    np.testing.assert_array_equal(tokens[greedy_rows], np.argmax(logits, -1)[greedy_rows])
    np.testing.assert_array_equal(tokens[~greedy_rows], sampled[~greedy_rows])
    assert np.any(sampled[greedy_rows] != np.argmax(logits, -1)[greedy_rows])  # greedy mattered
    # a tuple and an object array say the same; the internal encoding of a greedy row is 0
    again = sampling.sample(logits, seed=5, positions=positions, temperature=tuple(mixed))
    np.testing.assert_array_equal(again, tokens)
    params = sampling.check_params(batch, VOCAB, temperature=np.array(mixed, dtype=object))
    np.testing.assert_array_equal(params.temperature, np.where(greedy_rows, 0.0, all_sampled))
    assert params.temperature.dtype == np.float32


def test_determinism_and_distinct_streams(small_logits):
    logits = jnp.broadcast_to(jnp.asarray(small_logits), (512, VOCAB))
    positions = jnp.arange(512)
    first = sampling.sample(logits, seed=42, positions=positions, temperature=1.0)
    second = sampling.sample(logits, seed=42, positions=positions, temperature=1.0)
    other_seed = sampling.sample(logits, seed=43, positions=positions, temperature=1.0)
    np.testing.assert_array_equal(first, second)
    assert np.mean(np.asarray(first) != np.asarray(other_seed)) > 0.3
    # the row is part of the counter: row 0 and row 1 at one position draw independently
    same_pos = sampling.sample(logits, seed=42, positions=jnp.zeros(512, jnp.int32), temperature=1.0)
    assert len(np.unique(np.asarray(same_pos))) > 3
    # jit gives the same tokens as eager
    jitted = jax.jit(lambda l, p: sampling.sample(l, seed=42, positions=p, temperature=1.0))(
        logits, positions)
    np.testing.assert_array_equal(jitted, first)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 1.3, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.7},
    {"temperature": 0.8, "top_k": 6, "top_p": 0.9},
])
@pytest.mark.slow
def test_sampled_distribution_matches_exact(small_logits, kwargs):
    histogram = draw_histogram(small_logits, DRAWS, **kwargs)
    exact = np.asarray(sampling.truncated_distribution(jnp.asarray(small_logits)[None], **kwargs))[0]
    if "top_k" not in kwargs and "top_p" not in kwargs:
        np.testing.assert_allclose(exact, jax.nn.softmax(small_logits / kwargs["temperature"]),
                                   rtol=1e-5)
    tv = 0.5 * np.abs(histogram - exact).sum()
    assert tv < tv_bound(DRAWS, VOCAB), (tv, tv_bound(DRAWS, VOCAB))
    assert np.all(histogram[exact == 0] == 0)  # never a token outside the kept set


def test_top_k_and_nucleus_sets():
    # probabilities 0.4, 0.3, 0.2, 0.1 (in a shuffled order) and a tie
    probs = np.array([0.1, 0.4, 0.2, 0.3], np.float32)
    logits = jnp.asarray(np.log(probs))[None]
    keep = lambda **kw: np.asarray(sampling.kept_mask(logits, temperature=1.0, **kw))[0]
    np.testing.assert_array_equal(keep(top_k=2), [False, True, False, True])
    # mass before: 0.4 -> 0, 0.3 -> 0.4, 0.2 -> 0.7, 0.1 -> 0.9
    np.testing.assert_array_equal(keep(top_p=0.39), [False, True, False, False])
    np.testing.assert_array_equal(keep(top_p=0.41), [False, True, False, True])
    np.testing.assert_array_equal(keep(top_p=0.05), [False, True, False, False])  # first always kept
    np.testing.assert_array_equal(keep(top_p=0.75), [False, True, True, True])
    assert int(sampling.nucleus_size(logits, top_p=0.75)[0]) == 3
    tie = jnp.asarray([[1.0, 2.0, 2.0, 2.0]])
    np.testing.assert_array_equal(np.asarray(sampling.kept_mask(tie, top_k=2))[0],
                                  [False, True, True, False])


@pytest.mark.slow
def test_nucleus_overflow_flag():
    flat = jnp.zeros((1, 256))  # uniform: the 0.9-nucleus needs 231 tokens
    peaked = jnp.asarray(np.r_[[20.0], np.zeros(255)], jnp.float32)[None]
    both = jnp.concatenate([flat, peaked, flat, flat])
    flags = sampling.nucleus_overflow(both, temperature=[1.0, 1.0, None, 1.0], top_p=0.9,
                                      top_k=[0, 0, 0, 100], candidates=128)
    np.testing.assert_array_equal(flags, [True, False, False, False])
    assert int(sampling.nucleus_size(flat, top_p=0.9)[0]) == math.ceil(0.9 * 256)
    # exactly C tokens fit: 128 of 256 uniform at top_p 0.5 -> mass before the 129th is 0.5, not < 0.5
    assert not bool(sampling.nucleus_overflow(flat, temperature=1.0, top_p=0.5, candidates=128)[0])
    assert bool(sampling.nucleus_overflow(flat, temperature=1.0, top_p=0.51, candidates=128)[0])
    # with a capacity the sampler draws only among the candidates
    tokens = sampling.sample(jnp.broadcast_to(flat, (4096, 256)), seed=0, positions=jnp.arange(4096),
                             temperature=1.0, top_p=0.9, candidates=128)
    assert int(tokens.max()) < 128
    # pure temperature rows need no candidates (Gumbel-max streams): still the whole vocabulary
    tokens = sampling.sample(jnp.broadcast_to(flat, (4096, 256)), seed=0, positions=jnp.arange(4096),
                             temperature=1.0, candidates=128)
    assert int(tokens.max()) >= 128


@pytest.mark.parametrize("temperature", [
    0.0, 0, -0.5, -1, float("nan"), float("inf"), -float("inf"), 1e40, np.float32(0.0),
    [None, 0.0, 1.0], [1.0, -2.0, None], np.zeros(3), np.array([1.0, 2.0, 0.0]),
])
def test_temperature_at_or_below_zero_is_a_value_error(temperature):
    """Greedy is temperature=None, never 0: T <= 0 (and NaN, inf) names temperature and says so."""
    logits = jnp.zeros((3, 64))
    with pytest.raises(ValueError, match=r"temperature.*use temperature=None for greedy"):
        sampling.sample(logits, seed=0, positions=jnp.zeros(3, jnp.int32), temperature=temperature)
    with pytest.raises(ValueError, match=r"temperature.*use temperature=None for greedy"):
        sampling.check_params(3, 64, temperature=temperature)


@pytest.mark.parametrize("temperature", [True, "1.0", [None, True, 1.0], [1.0, [2.0], 3.0], 1j])
def test_temperature_that_is_not_a_number_is_a_value_error(temperature):
    with pytest.raises(ValueError, match=r"temperature.*use temperature=None for greedy"):
        sampling.check_params(3, 64, temperature=temperature)


def test_greedy_rows_have_no_distribution():
    with pytest.raises(ValueError, match="temperature"):
        sampling.truncated_distribution(jnp.zeros((2, 64)), temperature=[1.0, None])


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
    ({"temperature": 1.0, "top_k": -1}, "top_k"),
    ({"temperature": 1.0, "top_k": 65}, "top_k"),
    ({"temperature": 1.0, "top_k": 1.5}, "top_k"),
    ({"temperature": 1.0, "top_k": 20, "candidates": 16}, "top_k"),
    ({"temperature": [1.0, 2.0]}, "temperature"),
])
def test_bad_input_names_the_parameter(kwargs, name):
    logits = jnp.zeros((3, 64))
    with pytest.raises(ValueError, match=name):
        sampling.sample(logits, seed=0, positions=jnp.zeros(3, jnp.int32), **kwargs)


@pytest.mark.slow
def test_bad_shapes_and_seed():
    with pytest.raises(ValueError, match="logits"):
        sampling.sample(jnp.zeros(64), seed=0, positions=jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="positions"):
        sampling.sample(jnp.zeros((2, 64)), seed=0, positions=jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="seed"):
        sampling.sample(jnp.zeros((2, 64)), seed=2**40, positions=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="softcap"):
        sampling.soft_cap(jnp.zeros(3), -1.0)
    np.testing.assert_allclose(sampling.soft_cap(jnp.asarray([0.0, 100.0]), 30.0), [0.0, 30 * math.tanh(100 / 30)],
                               rtol=1e-6)
