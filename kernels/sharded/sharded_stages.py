"""The stages of the sharded megakernel that differ from one device's: the embedding gather from
a vocab-sharded table and the merge of the vocab shards' sampling states.

Embedding: the rank that owns a token's row (rows [r·V/n, (r+1)·V/n) on rank r) DMAs it as on
one device; the others contribute zeros; an all-reduce adds them (exact: one non-zero term).

Sampling: each rank streams its LM head columns and keeps, per row, the running state of
`sampling.update_running_state` (greedy best, Gumbel best, online log-sum-exp, the best
MAX_CANDIDATES) over its vocab shard, with the uniforms keyed by the GLOBAL vocab index. The
states are all-gathered (one [B, 384] f32 block per rank, integers bit-cast) and folded in rank
order, which is vocabulary order: the greedy and Gumbel winners (the lower index wins a tie) and
the candidate list (each shard's best 128 hold the global best 128; equal values keep the lower
index) are exactly the unsharded stage's, so greedy tokens and pure-temperature samples are the
same for the same seed. The log-sum-exp is combined from per-shard (max, sum) pairs: the same
value up to f32 rounding, which can move a top-p cut only when the mass lands on top_p within
~1e-7 (as the unsharded kernel's triangular-matmul mass against the reference's cumsum).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from mkresearch.kernels.base import blocks, dma, planned
from mkresearch.kernels.base.blocks import EMBED_ROWS
from mkresearch.kernels.stages import sampling

from mkresearch.model import spec
from mkresearch.model.config import LANE

STATE_LANES = 3 * LANE  # the packed sampling state: 6 scalars | 128 values | 128 indices


def embed(collectives: Any, table_hbm: Any, tokens_smem: Any, blocks_vmem: Any, sems: Any,
          batch: int) -> Any:
    """e = E[token] [B, d] f32 from this rank's rows table_hbm [V / n, d] (HBM) and the
    others' (an all-reduce)."""
    rows, d = table_hbm.shape
    first = collectives.index(spec.VOCAB) * rows
    copies, mine = [], []
    for b in range(batch):
        local = tokens_smem[b] - first
        owned = jnp.logical_and(local >= 0, local < rows)
        local = jnp.clip(local, 0, rows - 1)
        start = pl.multiple_of(lax.div(local, EMBED_ROWS) * EMBED_ROWS, EMBED_ROWS)
        copy = dma.Copy(table_hbm.at[pl.ds(start, EMBED_ROWS), :], blocks_vmem.at[b], sems.at[b],
                        name="embed", buffer=planned.EMBEDDING, row=b)

        @pl.when(owned)
        def _(copy=copy):
            copy.start()

        copies.append((copy, local))
        mine.append(owned)
    with dma.phase("embed"):
        embedded = jnp.zeros((batch, d), jnp.float32)
        for b, (copy, local) in enumerate(copies):
            @pl.when(mine[b])
            def _(copy=copy):
                copy.wait()

            @pl.when(jnp.logical_not(mine[b]))
            def _(b=b):
                blocks_vmem[b] = jnp.zeros(blocks_vmem.shape[1:], blocks_vmem.dtype)

            row = blocks.select_row(blocks_vmem[b], lax.rem(local, EMBED_ROWS))
            row = jnp.where(mine[b], row.astype(jnp.float32), 0.0)
            embedded = blocks.put_row(embedded, b, row)
    return collectives.all_reduce(embedded, name="embed")


# ---- the sampling state of every vocab shard ---------------------------------------------------
def _as_f32(v: Any) -> Any:
    return lax.bitcast_convert_type(v, jnp.float32) if v.dtype == jnp.int32 else v


def pack(state: sampling.RunningState) -> Any:
    """[B, 384] f32: the 6 per-row scalars in lanes 0..5, then the candidates' values and
    indices; integers bit-cast (moved, never added)."""
    scalars = (state.greedy_value, state.greedy_index, state.gumbel_value, state.gumbel_index,
               state.lse_max, state.lse_sum)
    batch = state.greedy_value.shape[0]
    lane = lax.broadcasted_iota(jnp.int32, (batch, LANE), 1)
    head = jnp.zeros((batch, LANE), jnp.float32)
    for i, value in enumerate(scalars):
        head = jnp.where(lane == i, _as_f32(value), head)
    return jnp.concatenate([head, state.cand_values, _as_f32(state.cand_indices)], axis=1)


def unpack(block: Any) -> sampling.RunningState:
    bits = lax.bitcast_convert_type(block, jnp.int32)  # [B, 384]
    head = bits[:, :LANE]
    lane = lax.broadcasted_iota(jnp.int32, head.shape, 1)
    low = jnp.iinfo(jnp.int32).min
    ints = [jnp.max(jnp.where(lane == i, head, low), axis=1, keepdims=True) for i in range(6)]
    floats = [lax.bitcast_convert_type(v, jnp.float32) for v in ints]
    return sampling.RunningState(floats[0], ints[1], floats[2], ints[3], floats[4], floats[5],
                                 block[:, LANE:2 * LANE], bits[:, 2 * LANE:])


def fold(states: list, use_candidates: bool) -> sampling.RunningState:
    """The running state over every shard, folded in rank (vocabulary) order."""
    acc = states[0]
    for st in states[1:]:
        greedy = sampling.take_better(acc.greedy_value, acc.greedy_index, st.greedy_value,
                                       st.greedy_index)
        gumbel = sampling.take_better(acc.gumbel_value, acc.gumbel_index, st.gumbel_value,
                                       st.gumbel_index)
        lse_max = jnp.maximum(acc.lse_max, st.lse_max)
        lse_sum = (acc.lse_sum * jnp.exp(acc.lse_max - lse_max)
                   + st.lse_sum * jnp.exp(st.lse_max - lse_max))
        candidates = (acc.cand_values, acc.cand_indices)
        if use_candidates:
            candidates = sampling.merge_candidates(*candidates, st.cand_values, st.cand_indices)
        acc = sampling.RunningState(*greedy, *gumbel, lse_max, lse_sum, *candidates)
    return acc


def merge_shards(collectives: Any, use_candidates: bool):
    """The `merge` of `sampling.sampling_body` on one rank: all-gather, then fold."""
    def merge(state: sampling.RunningState) -> sampling.RunningState:
        blocks_ = collectives.all_gather(pack(state), name="sampling_state")
        with dma.phase("sampling_merge"):
            return fold([unpack(b) for b in blocks_], use_candidates)

    return merge
