"""Sampling reference: logits -> tokens, in plain JAX (the oracle the sampling kernel is tested against).

Semantics (docs/kimi-k3.md §8, plus the row in the random counter from issue 5), per row b of `logits [B, V]`:

* **greedy** (`temperature=None`, the default): the argmax of the logits; the lowest index wins
  ties; top_k / top_p are ignored.
* otherwise T = temperature must be finite and > 0 (T <= 0 is a ValueError: greedy is spelled
  None, not 0), z = logits / T (f32), and the kept set is the vocabulary, narrowed by
  * **top-k** (k > 0): the k largest z, ties to the lower index;
  * **top-p** (p < 1): the *nucleus*. Sort z descending (index ascending among ties); token i of
    that order is kept while the probability mass *before* it, under the full softmax of z with an
    exact log-sum-exp, is < p. The first token is always kept.
  Both narrow a prefix of the same order, so together they keep the shorter prefix.
* The token is the Gumbel-max over the kept set: argmax_i (z_i + G_i) with
  G_i = -log(-log(U_i)) and U_i = counter_uniform(seed, b, position_b, i). That is an exact sample
  of softmax(z) renormalised over the kept set, and the same (seed, row, position) always gives
  the same token: the noise is a pure function of those integers, not a stateful PRNG.

**Candidate capacity.** A streaming kernel keeps only the top C candidates of each row (C = 128 in
the released kernels) for top-k / top-p. Passing `candidates=C` makes this reference do exactly
that: for rows with top_k > 0 or top_p < 1 the kept set is also cut to the top C (pure temperature
rows stay exact over the whole vocabulary: Gumbel-max needs no candidates). That is still exact
unless the nucleus needs more than C tokens (it *overflows*); `nucleus_overflow` reports exactly
when that happens: top_p < 1, top_k = 0 and the mass of the C candidates is < top_p. (With
0 < top_k <= C the kept set always fits.)

**The counter-based uniform.** Only uint32 xor, shift, multiply and add (a murmur3 fmix32 chain), so
a Pallas TPU kernel computes the very same bits on VMEM values:

    key = fmix32(fmix32(fmix32(seed + 0x9E3779B9) ^ row) ^ (position + 0x7F4A7C15))
    h   = fmix32(key ^ (index + 0x5851F42D))
    U   = ((h >> 8) | 1) * 2^-24      # an odd multiple of 2^-24: U in (0, 1), 2^23 values

fmix32 is a bijection of uint32, so for one (seed, row, position) distinct indices never collide.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

GOLDEN = 0x9E3779B9  # offsets keep seed/position/index streams apart (arbitrary odd constants)
POSITION_OFFSET = 0x7F4A7C15
INDEX_OFFSET = 0x5851F42D
DEFAULT_CANDIDATES = 128  # top candidates per vocab shard kept by the released kernels (docs/kimi-k3.md §8)


# ---- counter-based randomness -----------------------------------------------------------------
def _u32(x: Any) -> jax.Array:
    """x as uint32; Python ints wrap modulo 2^32 (seed -1 is 0xFFFFFFFF), int arrays bit-cast."""
    if isinstance(x, int):
        return jnp.asarray(np.uint32(x % 2**32))
    return jnp.asarray(x).astype(jnp.uint32)


def fmix32(h: jax.Array) -> jax.Array:
    """The murmur3 32-bit finaliser: a bijection of uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def counter_key(seed: Any, row: Any, position: Any) -> jax.Array:
    """The per-(seed, row, position) part of the hash chain, uint32 (broadcast over the inputs)."""
    h = fmix32(_u32(seed) + jnp.uint32(GOLDEN))
    h = fmix32(h ^ _u32(row))
    return fmix32(h ^ (_u32(position) + jnp.uint32(POSITION_OFFSET)))


def uniform_from_key(key: jax.Array, index: Any) -> jax.Array:
    """U in (0, 1), f32, for vocabulary `index` under `key` = counter_key(seed, row, position)."""
    h = fmix32(key ^ (_u32(index) + jnp.uint32(INDEX_OFFSET)))
    odd = (h >> 8) | jnp.uint32(1)  # < 2^24: exact in f32; odd, so never 0 and never 2^24
    return odd.astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0**-24)


def counter_uniform(seed: Any, row: Any, position: Any, index: Any) -> jax.Array:
    """U(seed, row, position, index) in (0, 1), f32: a pure function of four uint32 counters."""
    return uniform_from_key(counter_key(seed, row, position), index)


def gumbel_from_key(key: jax.Array, index: Any) -> jax.Array:
    """Standard Gumbel noise -log(-log U), f32, finite (|G| < 17 since U in [2^-24, 1 - 2^-24])."""
    return -jnp.log(-jnp.log(uniform_from_key(key, index)))


def gumbel(seed: Any, row: Any, position: Any, index: Any) -> jax.Array:
    """Gumbel noise of counter_uniform(seed, row, position, index)."""
    return gumbel_from_key(counter_key(seed, row, position), index)


# ---- soft-cap (optional; Kimi K3 has none) -----------------------------------------------------
def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(logits / cap) in f32; `None` leaves the logits unchanged."""
    if cap is None:
        return logits
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"softcap={cap!r} is invalid: None or a finite number > 0")
    cap = jnp.float32(cap)
    return cap * jnp.tanh(logits.astype(jnp.float32) / cap)


# ---- parameter checks (shared with the kernel wrapper) ---------------------------------------
class SamplingParams(NamedTuple):
    """Per-row sampling settings, validated, as numpy arrays of shape [B]."""

    temperature: np.ndarray  # [B] f32 > 0; a greedy row (None) is encoded as 0 internally
    top_k: np.ndarray  # [B] i32, 0 = off
    top_p: np.ndarray  # [B] f32, 1 = off


def _per_row(name: str, value: Any, batch: int, dtype: Any) -> np.ndarray:
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name} must be a concrete Python number or a [B] sequence of them "  # noqa: TRY004
                         "(it is checked before tracing), not a traced value")
    array = np.asarray(value)
    if array.ndim == 0:
        array = np.full((batch,), array)
    if array.shape != (batch,):
        raise ValueError(f"{name} has shape {array.shape}: allowed a scalar or shape ({batch},)")
    if array.dtype == bool:
        raise ValueError(f"{name}={value!r} is invalid: a number, not a bool")
    if dtype == np.int32 and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name}={value!r} is invalid: an int (or [B] ints)")
    if not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"{name}={value!r} is invalid: a number (or [B] numbers)")
    return array.astype(dtype)


TEMPERATURE_RULE = ("None (greedy) or a finite number > 0, or a [B] sequence of those "
                    "(None entries = greedy rows); use temperature=None for greedy")


def _is_real_number(value: Any) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_)))


def _temperature_per_row(temperature: Any, batch: int) -> np.ndarray:
    """[B] f32: T > 0 for sampled rows, 0 for greedy rows (None). ValueError on T <= 0, NaN, inf."""
    if temperature is None:
        return np.zeros((batch,), np.float32)
    if isinstance(temperature, jax.core.Tracer):
        raise ValueError("temperature must be concrete (it is checked before tracing), not a "  # noqa: TRY004
                         f"traced value: {TEMPERATURE_RULE}")
    # a list may mix None (greedy rows) with numbers: keep it as objects to see the Nones
    as_objects = isinstance(temperature, (list, tuple))
    entries = np.asarray(temperature, dtype=object if as_objects else None)
    if entries.ndim == 0:
        entries = np.full((batch,), entries[()], dtype=entries.dtype)
    if entries.shape != (batch,):
        raise ValueError(f"temperature has shape {entries.shape}: allowed a scalar or shape "
                         f"({batch},); {TEMPERATURE_RULE}")
    greedy = np.array([entry is None for entry in entries], bool)  # [B]
    if not all(_is_real_number(entry) for entry in entries[~greedy].tolist()):
        raise ValueError(f"temperature={temperature!r} is invalid: {TEMPERATURE_RULE}")
    with np.errstate(over="ignore"):  # beyond f32 becomes inf, rejected just below
        values = np.where(greedy, 1.0, entries).astype(np.float32)  # [B]; 1.0 stands in for None
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"temperature={temperature!r} is invalid: {TEMPERATURE_RULE} "
                         "(T <= 0 has no softmax(logits / T); greedy is None, not 0)")
    return np.where(greedy, 0.0, values).astype(np.float32)


def check_params(batch: int, vocab: int, *, temperature: Any = None, top_k: Any = 0,
                 top_p: Any = 1.0, candidates: int | None = None) -> SamplingParams:
    """Validate the sampling settings (scalars or per-row [B]); ValueError naming the parameter.

    temperature None (greedy) or > 0, per row None or > 0; top_k in [0, V] and <= candidates
    (0 = off); top_p in (0, 1]. The returned temperature encodes greedy rows as 0.
    """
    if candidates is not None and (isinstance(candidates, bool) or not isinstance(candidates, int)
                                   or not 1 <= candidates <= vocab):
        raise ValueError(f"candidates={candidates!r} is invalid: None or an int in [1, V={vocab}]")
    t = _temperature_per_row(temperature, batch)
    k = _per_row("top_k", top_k, batch, np.int32)
    k_max = vocab if candidates is None else candidates
    if np.any(k < 0) or np.any(k > k_max):
        what = f"the candidates={candidates}" if candidates is not None else f"V={vocab}"
        raise ValueError(f"top_k={top_k!r} is invalid: an int in [0, {k_max}] (0 = off; at most {what})")
    p = _per_row("top_p", top_p, batch, np.float32)
    if not np.all(np.isfinite(p)) or np.any(p <= 0) or np.any(p > 1):
        raise ValueError(f"top_p={top_p!r} is invalid: in (0, 1] (1 = off)")
    return SamplingParams(t, k, p)


def _check_logits(logits: Any, positions: Any) -> tuple[int, int]:
    if getattr(logits, "ndim", None) != 2:
        raise ValueError(f"logits has shape {getattr(logits, 'shape', None)}: allowed [B, V]")
    batch, vocab = logits.shape
    if np.shape(positions) != (batch,):
        raise ValueError(f"positions has shape {np.shape(positions)}: allowed ({batch},)")
    return batch, vocab


def check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or (isinstance(seed, int) and not -(2**31) <= seed < 2**32):
        raise ValueError(f"seed={seed!r} is invalid: an int in [-2^31, 2^32) or a uint32/int32 scalar")


# ---- the reference sampler --------------------------------------------------------------------
def _sorted_order(z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """order [B, V]: indices by z descending, index ascending among ties; rank [B, V] its inverse."""
    order = jnp.argsort(-z, axis=-1, stable=True)  # stable: equal z keep ascending index
    rank = jnp.argsort(order, axis=-1)
    return order, rank


def _scaled(logits: jax.Array, temperature: np.ndarray) -> jax.Array:
    """z = logits / T per row (T = 1 for greedy rows, whose order is the logits' own)."""
    t = jnp.asarray(np.where(temperature > 0, temperature, 1.0).astype(np.float32))
    return logits.astype(jnp.float32) / t[:, None]


def _mass_before_sorted(z: jax.Array, order: jax.Array) -> jax.Array:
    """[B, V]: the softmax(z) mass of the tokens before each position of the sorted order."""
    lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)  # exact: max-shifted
    probs_sorted = jnp.exp(jnp.take_along_axis(z, order, axis=-1) - lse)
    return jnp.cumsum(probs_sorted, axis=-1) - probs_sorted


def kept_mask(logits: jax.Array, *, temperature: Any = 1.0, top_k: Any = 0, top_p: Any = 1.0,
              candidates: int | None = None) -> jax.Array:
    """bool [B, V]: the tokens the sampler may draw (for greedy rows: the whole vocabulary)."""
    batch, vocab = logits.shape
    params = check_params(batch, vocab, temperature=temperature, top_k=top_k, top_p=top_p,
                          candidates=candidates)
    return _kept_mask(logits, params, candidates)


def _kept_mask(logits: jax.Array, params: SamplingParams, candidates: int | None) -> jax.Array:
    z = _scaled(logits, params.temperature)
    order, rank = _sorted_order(z)
    vocab = logits.shape[-1]
    k = jnp.asarray(np.where(params.top_k > 0, params.top_k, vocab))[:, None]
    p = jnp.asarray(params.top_p)[:, None]
    in_nucleus_sorted = (_mass_before_sorted(z, order) < p) | (p >= 1.0)
    in_nucleus_sorted = in_nucleus_sorted.at[:, 0].set(True)  # the first is always kept
    in_nucleus = jnp.take_along_axis(in_nucleus_sorted, rank, axis=-1)
    keep = in_nucleus & (rank < k)
    if candidates is not None:  # only top-k / top-p rows use the candidates
        truncated = jnp.asarray((params.top_k > 0) | (params.top_p < 1))[:, None]
        keep = keep & ((rank < candidates) | ~truncated)
    return keep


def nucleus_size(logits: jax.Array, *, temperature: Any = 1.0, top_p: Any = 1.0) -> jax.Array:
    """i32 [B]: how many tokens the top-p nucleus of softmax(logits / T) holds (no top-k, no cap;
    greedy rows, temperature None, are measured at T = 1)."""
    batch, vocab = logits.shape
    params = check_params(batch, vocab, temperature=temperature, top_p=top_p)  # greedy: T = 1
    return jnp.sum(_kept_mask(logits, params, None), axis=-1).astype(jnp.int32)


def nucleus_overflow(logits: jax.Array, *, temperature: Any = 1.0, top_k: Any = 0,
                     top_p: Any = 1.0, candidates: int = DEFAULT_CANDIDATES) -> jax.Array:
    """bool [B]: the row's nucleus needs more than `candidates` tokens, so a sampler that keeps
    only the top `candidates` is not exact for it. Only sampled rows with top_p < 1 and top_k = 0
    can overflow; equivalently, the softmax mass of the top `candidates` tokens is < top_p."""
    batch, vocab = logits.shape
    params = check_params(batch, vocab, temperature=temperature, top_k=top_k, top_p=top_p,
                          candidates=candidates)
    eligible = (params.temperature > 0) & (params.top_k == 0) & (params.top_p < 1)
    sizes = jnp.sum(_kept_mask(logits, params._replace(top_k=np.zeros_like(params.top_k)), None),
                    axis=-1)
    return jnp.asarray(eligible) & (sizes > candidates)


def sample(logits: jax.Array, *, seed: Any, positions: Any, temperature: Any = None,
           top_k: Any = 0, top_p: Any = 1.0, candidates: int | None = None) -> jax.Array:
    """tokens i32 [B] from logits f32 [B, V] (see the module docstring for the exact semantics).

    seed: int or uint32/int32 scalar; positions: [B] ints (the counter of each row's token).
    temperature: None = greedy (the default) or > 0; per row, a [B] sequence of None / > 0.
    top_k / top_p: scalars or per-row [B]. All concrete, checked before tracing.
    candidates: None (exact over the whole vocabulary) or the capacity C of a streaming sampler.
    """
    batch, vocab = _check_logits(logits, positions)
    check_seed(seed)
    params = check_params(batch, vocab, temperature=temperature, top_k=top_k, top_p=top_p,
                          candidates=candidates)
    logits = jnp.asarray(logits, jnp.float32)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # first index among ties
    if not np.any(params.temperature > 0):
        return greedy_tokens
    z = _scaled(logits, params.temperature)
    keep = _kept_mask(logits, params, candidates)
    rows = jnp.arange(batch, dtype=jnp.uint32)
    key = counter_key(seed, rows, jnp.asarray(positions))[:, None]  # [B, 1]
    noise = gumbel_from_key(key, jnp.arange(vocab, dtype=jnp.uint32)[None, :])  # [B, V]
    scores = jnp.where(keep, z + noise, -jnp.inf)
    sampled_tokens = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.asarray(params.temperature > 0), sampled_tokens, greedy_tokens)


def truncated_distribution(logits: jax.Array, *, temperature: Any, top_k: Any = 0,
                           top_p: Any = 1.0, candidates: int | None = None) -> jax.Array:
    """f32 [B, V]: the exact distribution `sample` draws from for T > 0 (softmax(z) over the kept
    set, renormalised); what the distribution tests compare histograms against."""
    batch, vocab = logits.shape
    params = check_params(batch, vocab, temperature=temperature, top_k=top_k, top_p=top_p,
                          candidates=candidates)
    if np.any(params.temperature <= 0):
        raise ValueError(f"temperature={temperature!r} is invalid here: a finite number > 0 for "
                         "every row (a greedy row, None, is not a distribution)")
    z = _scaled(jnp.asarray(logits, jnp.float32), params.temperature)
    keep = _kept_mask(logits, params, candidates)
    return jax.nn.softmax(jnp.where(keep, z, -jnp.inf), axis=-1)
