"""The last stage of a decode step in one Pallas TPU kernel: final mix, RMSNorm, LM head, sampling.

    h = Mix({R_0..R_last, P}; w_out)        reference.mix       (docs/kimi-k3.md §3.3)
    x = RMSNorm(h; final_norm)              reference.rms_norm
    for each vocab tile t (lm_head[:, t] streamed HBM -> VMEM through a two-slot dma.Ring):
        logits_t = x @ lm_head[:, t]  (f32; soft-capped if cfg.logit_softcap)
        z_t = logits_t / T            (per row; T = 1 for greedy rows, temperature None)
        update the running state      (`update_running_state`)
    token = finish(running state)       (`finish_sampling`)

The [B, V] logits never reach HBM. What survives a tile is the running state, per row:

* the best z and its index (greedy; the lower index wins ties, as earlier tiles win);
* the best z + G and its index, G the counter-based Gumbel noise of (seed, row, position, index):
  Gumbel-max over the whole vocabulary, an exact temperature sample;
* an online log-sum-exp of z (running max and rescaled sum): exact probabilities later;
* the top 128 candidates (z and index), kept sorted (z descending, index ascending); a tile's
  elements that beat the 128th candidate are inserted at their rank (`merge_candidates`).

At the end: greedy rows take the best index; pure-temperature rows (top_k 0, top_p 1) the Gumbel
winner; top-k / top-p rows Gumbel-max over the kept candidates. A candidate j is kept while j <
top_k (if set) and the softmax mass before it, p_i = exp(z_i - lse), is < top_p (the first always
kept). **Top-p is exact whenever the nucleus fits in the candidates.** When it needs more (the
128 candidates hold less than top_p of the mass) the stage samples from the candidates and sets
that row's `nucleus_overflow` flag: exactly `mkresearch.model.sampling.nucleus_overflow`.

Every number is the reference's (`mkresearch.model.sampling` with `candidates=...`): the same mix and
norm functions, the same uint32 hash computed on VMEM values, so a row's token depends only on its
logits and (seed, row, position), on CPU and on a TPU. The softmax mass is a triangular f32 matmul
(HIGHEST precision) instead of a cumsum: it can differ from the reference's cumsum in the last
bits, which matters only when the mass lands on top_p within ~1e-7.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, chip_log, costs, dma, planned

from mkresearch.hardware import tpu
from mkresearch.model import reference, sampling
from mkresearch.model.config import LANE, ModelConfig

MAX_CANDIDATES = LANE  # the candidate list is one vreg row of lanes per batch row
TILE_BYTES = 4 * 1024 * 1024  # one LM head tile in VMEM (two are in flight); at most this
MAX_VOCAB_TILE = 512  # lanes per tile: several tiles even at mini size, so streaming is exercised
NO_INDEX = np.iinfo(np.int32).max  # sorts after every vocab index in "lowest index wins"
LM_HEAD = "lm_head"  # DMA log name of the LM head tiles


# ---- running state (values; the tile loop carries it in vregs / VMEM) ----------------------------
class RunningState(NamedTuple):
    greedy_value: jax.Array  # [B, 1] f32 best z so far
    greedy_index: jax.Array  # [B, 1] i32
    gumbel_value: jax.Array  # [B, 1] f32 best z + G so far
    gumbel_index: jax.Array  # [B, 1] i32
    lse_max: jax.Array  # [B, 1] f32 running max of z
    lse_sum: jax.Array  # [B, 1] f32 sum of exp(z - lse_max)
    cand_values: jax.Array  # [B, 128] f32 sorted descending
    cand_indices: jax.Array  # [B, 128] i32 (ascending among equal values)


def initial_state(batch: int) -> RunningState:
    column = jnp.full((batch, 1), -jnp.inf, jnp.float32)
    no_index = jnp.full((batch, 1), NO_INDEX, jnp.int32)
    # distinct fake indices >= any vocab index: the first tile (>= 128 lanes) evicts them all
    fake = NO_INDEX - MAX_CANDIDATES + lax.broadcasted_iota(jnp.int32, (batch, MAX_CANDIDATES), 1)
    return RunningState(column, no_index, column, no_index, column,
                        jnp.zeros((batch, 1), jnp.float32),
                        jnp.full((batch, MAX_CANDIDATES), -jnp.inf, jnp.float32), fake)


def row_best(values: jax.Array, indices: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row max [B, 1] and the lowest index attaining it [B, 1]."""
    best = jnp.max(values, axis=1, keepdims=True)
    return best, jnp.min(jnp.where(values == best, indices, NO_INDEX), axis=1, keepdims=True)


def take_better(value, index, new_value, new_index):
    """Keep (value, index) unless the new one is larger, or equal with a lower index."""
    better = (new_value > value) | ((new_value == value) & (new_index < index))
    return jnp.where(better, new_value, value), jnp.where(better, new_index, index)


def merge_candidates(cand_values, cand_indices, z, indices):
    """Insert the tile z [B, TV] (indices [B, TV]) into the sorted candidates [B, 128].

    Tile elements go in best first (z desc, index asc), each at its rank among the candidates:
    lanes below the rank stay, the element lands at the rank, the rest shift one lane right (a lane
    roll). A candidate from an earlier tile wins ties (its index is lower), and so does an element
    of this tile inserted before. The loop stops as soon as no row has a tile element above its
    128th candidate, so a tile costs as many rounds as it has new top-128 elements (all 128 for the
    first tile, about 128/(t+1) for tile t of random logits), not 128 every time."""
    lane = lax.broadcasted_iota(jnp.int32, cand_values.shape, 1)

    def improves(z, cand_values):  # [B, 1]: the tile's best beats the row's 128th candidate
        return jnp.max(z, axis=1, keepdims=True) > cand_values[:, -1:]

    def insert_one(carry):
        z, cand_values, cand_indices = carry
        best, best_index = row_best(z, indices)  # [B, 1]
        rank = jnp.sum((cand_values >= best).astype(jnp.int32), axis=1, keepdims=True)
        shifted_values = pltpu.roll(cand_values, 1, 1)  # lane j <- lane j-1
        shifted_indices = pltpu.roll(cand_indices, 1, 1)
        go = improves(z, cand_values)  # rows with nothing left to insert stay as they are
        new_values = jnp.where(lane < rank, cand_values, jnp.where(lane == rank, best, shifted_values))
        new_indices = jnp.where(lane < rank, cand_indices,
                                jnp.where(lane == rank, best_index, shifted_indices))
        return (jnp.where(go & (indices == best_index), -jnp.inf, z),
                jnp.where(go, new_values, cand_values), jnp.where(go, new_indices, cand_indices))

    _, cand_values, cand_indices = lax.while_loop(
        lambda carry: jnp.any(improves(carry[0], carry[1])), insert_one,
        (z, cand_values, cand_indices))
    return cand_values, cand_indices


def update_running_state(state: RunningState, z: jax.Array, indices: jax.Array, key: jax.Array, *,
                         use_gumbel: bool = True, use_candidates: bool = True) -> RunningState:
    """Fold one tile z [B, TV] f32 (vocab indices [B, TV] i32) into the running state.

    key [B, 1] uint32 = sampling.counter_key(seed, row, position). Tiles come in vocab order, so
    on equal values the state (earlier, lower indices) wins."""
    greedy = take_better(state.greedy_value, state.greedy_index, *row_best(z, indices))
    gumbel = (state.gumbel_value, state.gumbel_index)
    if use_gumbel:
        scores = z + sampling.gumbel_from_key(key, indices)
        gumbel = take_better(*gumbel, *row_best(scores, indices))
    lse_max = jnp.maximum(state.lse_max, jnp.max(z, axis=1, keepdims=True))
    lse_sum = (state.lse_sum * jnp.exp(state.lse_max - lse_max)
               + jnp.sum(jnp.exp(z - lse_max), axis=1, keepdims=True))
    candidates = (state.cand_values, state.cand_indices)
    if use_candidates:
        candidates = merge_candidates(*candidates, z, indices)
    return RunningState(*greedy, *gumbel, lse_max, lse_sum, *candidates)


def finish_sampling(state: RunningState, key, temperature, top_k, top_p, *, candidates: int
                    ) -> tuple[jax.Array, jax.Array]:
    """tokens [B, 1] i32 and nucleus_overflow [B, 1] i32 from the final running state.

    temperature [B, 1] f32 (0 encodes a greedy row, as sampling.check_params returns it), top_p
    [B, 1] f32, top_k [B, 1] i32 (0 = off); candidates <= 128 (static)."""
    lse = state.lse_max + jnp.log(state.lse_sum)  # [B, 1] exact log-sum-exp of all z
    lane = lax.broadcasted_iota(jnp.int32, state.cand_values.shape, 1)
    in_capacity = lane < candidates
    probs = jnp.where(in_capacity, jnp.exp(state.cand_values - lse), 0.0)  # [B, 128]
    # mass before lane j = sum_{i < j} p_i, as one matmul with a strictly upper triangle
    rows = lax.broadcasted_iota(jnp.int32, (MAX_CANDIDATES, MAX_CANDIDATES), 0)
    cols = lax.broadcasted_iota(jnp.int32, (MAX_CANDIDATES, MAX_CANDIDATES), 1)
    before = (rows < cols).astype(jnp.float32)
    mass_before = jnp.dot(probs, before, precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    k = jnp.where(top_k > 0, top_k, candidates)
    keep = in_capacity & (lane < k) & ((lane == 0) | (mass_before < top_p) | (top_p >= 1.0))
    scores = jnp.where(keep, state.cand_values + sampling.gumbel_from_key(key, state.cand_indices),
                       -jnp.inf)
    _, candidate_token = row_best(scores, state.cand_indices)
    sampled = temperature > 0
    truncated = (top_k > 0) | (top_p < 1.0)
    tokens = jnp.where(sampled, jnp.where(truncated, candidate_token, state.gumbel_index),
                       state.greedy_index)
    captured = jnp.sum(probs, axis=1, keepdims=True)  # mass of the candidates = mass before #C+1
    overflow = sampled & (top_k == 0) & (top_p < 1.0) & (captured < top_p)
    return tokens, overflow.astype(jnp.int32)


# ---- the body over Refs --------------------------------------------------------------------------
def sampling_body(seed_ref, positions_ref, temperature_ref, top_k_ref, top_p_ref,
                  snapshots_ref, partial_ref, mix_out_ref, final_norm_ref, lm_head_hbm,
                  tokens_ref, overflow_ref, *rest, vocab_tile: int, candidates: int, eps: float,
                  softcap: float | None, use_gumbel: bool, use_candidates: bool,
                  return_logits: bool, index_offset: Any = 0, merge: Any = None,
                  rows_per_key: int = 1, vocab_limit: int | None = None,
                  norm_width: int | None = None):
    # seed_ref [1] i32 (SMEM); positions_ref, top_k_ref [B, 1] i32; temperature_ref (0 = greedy
    # row), top_p_ref [B, 1] f32; snapshots_ref [N-1, B, d] bf16; partial_ref [B, d] bf16; mix_out_ref [1, d] f32;
    # final_norm_ref [1, d] bf16; lm_head_hbm [d, V] bf16 (HBM); tokens_ref, overflow_ref [B, 1]
    # i32; rest = ([logits_ref [B, V] f32] if return_logits) + (tile_slots [2, d, TV] bf16, sems [2]).
    # A vocab shard (the sharded megakernel): lm_head_hbm holds columns index_offset.. of the
    # vocabulary (the uniforms are keyed by the global index) and merge(RunningState) -> the
    # state over every shard, before the token is chosen; vocab_limit (static): the vocabulary
    # size when the last shard is padded (its padding columns are masked out: never chosen, no
    # mass). rows_per_key > 1 (a verify step): row r is keyed as batch row r // rows_per_key (its
    # position, p + 1, comes per row). norm_width: what the final RMSNorm divides by, when d
    # pads the checkpoint's width (GPT-OSS, `ModelConfig.d_norm`); None: d.
    logits_ref = rest[0] if return_logits else None
    tile_slots, sems = rest[-2:]
    batch = partial_ref.shape[0]
    tiles = _LmHeadTiles(dma.Ring(tile_slots, sems, name=LM_HEAD, buffer=planned.LM_HEAD_TILES),
                         lm_head_hbm, vocab_tile, logits_ref, softcap, index_offset, vocab_limit,
                         use_gumbel, use_candidates)
    tiles.ring.start(tiles.tile(0), 0, tile=0)  # flies while the mix and norm run
    x = _final_hidden(snapshots_ref, partial_ref, mix_out_ref, final_norm_ref, eps,
                      lm_head_hbm.shape[0], norm_width)
    temperature = temperature_ref[...]  # [B, 1]
    inverse_scale = jnp.where(temperature > 0, temperature, 1.0)  # greedy rows: z = logits
    rows = blocks.state_row(lax.broadcasted_iota(jnp.int32, (batch, 1), 0), rows_per_key)
    key = sampling.counter_key(seed_ref[0], rows, positions_ref[...])  # [B, 1] uint32
    state = lax.fori_loop(0, tiles.count, functools.partial(tiles.step, x, inverse_scale, key),
                          initial_state(batch))
    if merge is not None:
        state = merge(state)
    with dma.phase("sample"):
        tokens, overflow = finish_sampling(state, key, temperature, top_k_ref[...], top_p_ref[...],
                                           candidates=candidates)
    tokens_ref[...] = tokens
    overflow_ref[...] = overflow


def _final_hidden(snapshots_ref, partial_ref, mix_out_ref, final_norm_ref, eps: float,
                  d: int, norm_width: int | None = None) -> jax.Array:
    """x = RMSNorm(h) [B, d] bf16: attention residuals mix the snapshots and the partial sum
    first (docs/kimi-k3.md §3.3); a residual stream (snapshots_ref None) is normalised as it is."""
    batch = partial_ref.shape[0]
    n_candidates = 0 if snapshots_ref is None else snapshots_ref.shape[0] + 1
    with dma.phase("final_mix_norm", flops=6 * n_candidates * batch * d):
        if snapshots_ref is None:
            h = partial_ref[...]  # [B, d] bf16
        else:
            mix_candidates = jnp.concatenate([snapshots_ref[...], partial_ref[...][None]], axis=0)
            h = reference.mix(mix_candidates, mix_out_ref[...], eps)  # [B, d] bf16
        return reference.rms_norm(h, final_norm_ref[...], eps, norm_width)  # [B, d] bf16


@dataclass(frozen=True)
class _LmHeadTiles:
    """The LM head's vocab tiles [d, TV] through a two-slot ring, each folded into the running
    state as it arrives (`sampling_body`'s arguments of the same names)."""

    ring: Any
    lm_head_hbm: Any
    vocab_tile: int
    logits_ref: Any
    softcap: float | None
    index_offset: Any
    vocab_limit: int | None
    use_gumbel: bool
    use_candidates: bool

    @property
    def count(self) -> int:
        return self.lm_head_hbm.shape[1] // self.vocab_tile

    def tile(self, t: Any) -> Any:
        """[d, TV] columns of the HBM matrix."""
        return self.lm_head_hbm.at[:, pl.ds(pl.multiple_of(t * self.vocab_tile, self.vocab_tile),
                                            self.vocab_tile)]

    def step(self, x: Any, inverse_scale: Any, key: Any, t: Any, state: Any) -> Any:
        """Tile t: the next one started into the slot tile t-1 used (already read), this one
        waited for, its logits folded into the state."""
        slot = lax.rem(t, 2)

        @pl.when(t + 1 < self.count)
        def _():
            self.ring.start(self.tile(t + 1), 1 - slot, tile=t + 1)

        self.ring.wait(self.tile(t), slot, tile=t)
        d, tile, batch = self.lm_head_hbm.shape[0], self.vocab_tile, x.shape[0]
        with dma.phase("lm_head_tile", flops=2 * batch * d * tile, tile=t,
                       vmem_bytes=2 * d * tile + 2 * batch * d + 4 * batch * tile):
            logits = sampling.soft_cap(blocks.dot(x, self.ring.buffer(slot)[...]),
                                       self.softcap)  # [B, TV] f32
            if self.logits_ref is not None:  # checking only: materialises what the stage avoids
                self.logits_ref[:, pl.ds(pl.multiple_of(t * tile, tile), tile)] = logits
            indices = t * tile + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
            if not isinstance(self.index_offset, int) or self.index_offset:  # a vocab shard
                indices = indices + self.index_offset
            z = logits / inverse_scale
            if self.vocab_limit is not None:  # a padded vocab shard: padding is never a token
                z = jnp.where(indices < self.vocab_limit, z, -jnp.inf)
            return update_running_state(state, z, indices, key, use_gumbel=self.use_gumbel,
                                        use_candidates=self.use_candidates)


# ---- the wrapper -----------------------------------------------------------------------------
class SampleResult(NamedTuple):
    tokens: jax.Array  # [B] i32
    nucleus_overflow: jax.Array  # [B] bool: top-p needed more than the candidates (not exact)
    logits: jax.Array | None  # [B, V] f32 only with return_logits=True (for checking)


def default_vocab_tile(d: int, vocab: int) -> int:
    """Largest multiple of 128 dividing V with at most TILE_BYTES of bf16 and MAX_VOCAB_TILE lanes."""
    limit = max(LANE, min(MAX_VOCAB_TILE, TILE_BYTES // (2 * d)))
    return max(t for t in range(LANE, min(vocab, limit) + 1, LANE) if vocab % t == 0)


def _check_array(name: str, value: Any, shape: tuple[int, ...], dtype: Any) -> None:
    if getattr(value, "shape", None) != shape or getattr(value, "dtype", None) != jnp.dtype(dtype):
        raise ValueError(f"{name} has shape {getattr(value, 'shape', None)} and dtype "
                         f"{getattr(value, 'dtype', None)}: allowed shape {shape}, dtype "
                         f"{jnp.dtype(dtype).name}")


def check_stage_args(snapshots, partial, mix_out, final_norm, lm_head, cfg: ModelConfig,
                     vocab_tile: Any, candidates: Any) -> None:
    """ValueError naming the bad parameter, before anything is traced."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg={cfg!r} is invalid: a mkresearch.model.config.ModelConfig")  # noqa: TRY004
    d, vocab = cfg.d_model, cfg.vocab_size
    if getattr(partial, "ndim", None) != 2:
        raise ValueError(f"partial has shape {getattr(partial, 'shape', None)}: allowed [B, d={d}]")
    batch = partial.shape[0]
    _check_array("partial", partial, (batch, d), jnp.bfloat16)
    if getattr(snapshots, "ndim", None) != 3 or snapshots.shape[0] < 1:
        raise ValueError(f"snapshots has shape {getattr(snapshots, 'shape', None)}: allowed "
                         f"[n_blocks={cfg.n_blocks}, B={batch}, d={d}]")
    _check_array("snapshots", snapshots, (snapshots.shape[0], batch, d), jnp.bfloat16)
    _check_array("mix_out", mix_out, (d,), jnp.float32)
    _check_array("final_norm", final_norm, (d,), jnp.bfloat16)
    _check_array("lm_head", lm_head, (d, vocab), jnp.bfloat16)
    if (isinstance(vocab_tile, bool) or not isinstance(vocab_tile, int) or vocab_tile < LANE
            or vocab_tile % LANE or vocab % vocab_tile):
        allowed = [t for t in range(LANE, vocab + 1, LANE) if vocab % t == 0]
        raise ValueError(f"vocab_tile={vocab_tile!r} is invalid: a multiple of {LANE} dividing "
                         f"V={vocab} (a tile is a lane block of the LM head); allowed: {allowed}")
    if (isinstance(candidates, bool) or not isinstance(candidates, int)
            or not 1 <= candidates <= MAX_CANDIDATES):
        raise ValueError(f"candidates={candidates!r} is invalid: an int in [1, {MAX_CANDIDATES}]")


@functools.partial(jax.jit, static_argnames=(
    "vocab_tile", "candidates", "eps", "softcap", "use_gumbel", "use_candidates",
    "return_logits", "interpret", "recording"))
def _sampling_call(seed, positions, temperature, top_k, top_p, snapshots, partial, mix_out,
                   final_norm, lm_head, *, vocab_tile, candidates, eps, softcap, use_gumbel,
                   use_candidates, return_logits, interpret, recording):
    del recording  # static only so that recorded and silent traces are cached apart
    d, vocab = lm_head.shape
    batch = partial.shape[0]
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    out_shape = [jax.ShapeDtypeStruct((batch, 1), jnp.int32)] * 2  # tokens, nucleus_overflow
    if return_logits:
        out_shape.append(jax.ShapeDtypeStruct((batch, vocab), jnp.float32))
    body = functools.partial(sampling_body, vocab_tile=vocab_tile, candidates=candidates, eps=eps,
                             softcap=softcap, use_gumbel=use_gumbel, use_candidates=use_candidates,
                             return_logits=return_logits)
    tile_bytes = 2 * d * vocab_tile * 2
    call = functools.partial(
        pl.pallas_call, body,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [vmem] * 8
        + [pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[vmem] * len(out_shape),
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((2, d, vocab_tile), lm_head.dtype),
                        pltpu.SemaphoreType.DMA((2,))],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=tile_bytes + 32 * 1024 * 1024),
        interpret=interpret)
    args = (seed, positions[:, None], temperature[:, None], top_k[:, None], top_p[:, None],
            snapshots, partial, mix_out[None], final_norm[None], lm_head)
    outs = costs.costed_call(call, *args, io=(  # read off the body (kernels/base/costs.py)
        seed, positions, temperature, top_k, top_p, snapshots, partial, mix_out, final_norm,
        out_shape))
    tokens, overflow = outs[0][:, 0], outs[1][:, 0] != 0
    return tokens, overflow, (outs[2] if return_logits else None)


def sample_stage(snapshots: jax.Array, partial: jax.Array, mix_out: jax.Array,
                 final_norm: jax.Array, lm_head: jax.Array, *, cfg: ModelConfig, seed: Any,
                 positions: Any, temperature: Any = None, top_k: Any = 0, top_p: Any = 1.0,
                 vocab_tile: int | None = None, candidates: int = MAX_CANDIDATES,
                 return_logits: bool = False) -> SampleResult:
    """Tokens of the last stage of a decode step (module docstring), one Pallas TPU kernel.

    snapshots [n_blocks, B, d] bf16, partial [B, d] bf16 (aux of the step), mix_out [d] f32,
    final_norm [d] bf16, lm_head [d, V] bf16 (params); seed an int, positions [B] ints;
    temperature (None = greedy, else finite and > 0; T <= 0 is a ValueError), top_k
    (0..candidates, 0 = off), top_p ((0, 1], 1 = off): scalars or per row (a temperature list may
    mix None rows with numbers). Equals `mkresearch.model.sampling.sample(final_logits(...), ...,
    candidates=candidates)`; `return_logits=True` also returns the logits, for checking only.
    """
    if vocab_tile is None and isinstance(cfg, ModelConfig):
        vocab_tile = default_vocab_tile(cfg.d_model, cfg.vocab_size)
    check_stage_args(snapshots, partial, mix_out, final_norm, lm_head, cfg, vocab_tile, candidates)
    batch = partial.shape[0]
    if np.shape(positions) != (batch,):
        raise ValueError(f"positions has shape {np.shape(positions)}: allowed ({batch},)")
    sampling.check_seed(seed)
    params = sampling.check_params(batch, cfg.vocab_size, temperature=temperature, top_k=top_k,
                                   top_p=top_p, candidates=candidates)
    sampled = params.temperature > 0
    truncated = (params.top_k > 0) | (params.top_p < 1)
    seed_i32 = np.asarray(np.uint32(int(seed) % 2**32)).view(np.int32).reshape(1)
    options = {"vocab_tile": vocab_tile, "candidates": candidates, "eps": float(cfg.rms_eps),
               "softcap": cfg.logit_softcap, "use_gumbel": bool(np.any(sampled & ~truncated)),
               "use_candidates": bool(np.any(sampled & truncated)),
               "return_logits": bool(return_logits)}
    tokens, overflow, logits = chip_log.run(
        lambda *args: _sampling_call(*args, **options, interpret=tpu.interpret_params(),
                                     recording=dma.is_recording()),
        jnp.asarray(seed_i32), jnp.asarray(positions, jnp.int32), jnp.asarray(params.temperature),
        jnp.asarray(params.top_k), jnp.asarray(params.top_p), snapshots, partial, mix_out,
        final_norm, lm_head)
    return SampleResult(tokens, overflow, logits)
