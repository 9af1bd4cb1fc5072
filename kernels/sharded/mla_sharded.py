"""MLA over a latent cache sharded by sequence (a prototype of the pod layout, docs/kimi-k3.md §9).

The latent cache has no head axis, so with heads sharded (3 per rank) every rank would read the
whole latent: only 2x fewer bytes than its 3 heads of expanded K, V. Sharding the latent cache by
SEQUENCE over the ranks instead gives each rank 1/n of the tokens, for all heads:
  1. each head's owner absorbs its queries (q̃ = bf(q^C W_kvbKᵀ), q^X) and all ranks all-gather
     them: [B, H_all, kv_rank + extra], a few KB;
  2. every rank runs `mla_latent_partial` over its shard: the online-softmax state (m, norm, acc)
     of all heads over the shard's tokens <= the row's position (the shard holding the position
     has written the new entry first, as `mla_attention` does);
  3. the states are merged across ranks (`combine_partials`, a log-sum-exp merge) and each head's
     owner finishes: o_h = bf(bf(acc / norm) W_kvbV_h), the gate and W_o.
On one device the collectives are left out: the shards are run one after the other and merged in
plain JAX.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import chip_log, costs, dma
from mkresearch.kernels.base.blocks import f32
from mkresearch.kernels.stages.mla import MlaPlan, check_cache, latent_partial, make_plan

from mkresearch.hardware import tpu
from mkresearch.model.config import ModelConfig

# m of a state that has seen no token: finite (so exp(m - m_new) is 0, not NaN) and below any score
EMPTY_MAX = -1e30


def mla_latent_partial_body(plan: MlaPlan, counts_ref, q_lat_ref, q_x_ref, ckv_hbm, kx_hbm,
                            m_ref, norm_ref, acc_ref, **indices: Any) -> None:
    """Partial attention state of all heads over one shard of the latent cache, for B rows.

    counts_ref [B] i32 (SMEM): tokens of this shard each row attends to; q_lat_ref [B, H, kv_rank],
    q_x_ref [B, H, extra] bf16 (VMEM); ckv_hbm [B, S_shard, kv_rank], kx_hbm [B, S_shard, extra]
    in HBM; out m_ref, norm_ref [B, H, 1] and acc_ref [B, H, kv_rank] f32 (VMEM).
    """
    p = plan

    def row_step(b, _):
        q_lat, q_x = f32(q_lat_ref[b]), f32(q_x_ref[b])  # [H, kv_rank], [H, extra]
        empty = (jnp.full((p.n_heads, 1), EMPTY_MAX, jnp.float32),
                 jnp.zeros((p.n_heads, 1), jnp.float32),
                 jnp.zeros((p.n_heads, p.kv_rank), jnp.float32))
        m, norm, acc = latent_partial(p, b, counts_ref[b], q_lat, q_x, ckv_hbm, kx_hbm, empty,
                                      indices)
        m_ref[b], norm_ref[b], acc_ref[b] = m, norm, acc
        return 0

    jax.lax.fori_loop(0, p.batch, row_step, 0)


def mla_latent_partial(q_absorbed: jax.Array, q_extra: jax.Array, cache_shard: dict,
                       positions: jax.Array, shard_start: Any, cfg: ModelConfig, *,
                       kv_tile: int | None = None, **indices: int):
    """One rank's part of sequence-sharded latent attention, as a Pallas kernel.

    q_absorbed [B, H, kv_rank] bf16 (q̃ of all H heads, gathered), q_extra [B, H, extra] bf16,
    cache_shard {"ckv": [B, S_shard, kv_rank], "kx": [B, S_shard, extra]} bf16 holding global
    tokens shard_start .. shard_start + S_shard - 1, positions [B] i32 (global; the entry at each
    position already written). Returns the state over the shard's tokens <= position:
    (m [B, H, 1], norm [B, H, 1], acc [B, H, kv_rank]) f32 — merge them with `combine_partials`.
    shard_start may be traced (a rank's index times S_shard inside shard_map).
    """
    batch, n_heads = _check_partial_inputs(q_absorbed, q_extra, cache_shard, positions,
                                           shard_start, cfg)
    shard_len = cache_shard["ckv"].shape[1]
    plan = make_plan(cfg.replace(n_heads=n_heads, mla_cache_layout="latent"), batch, shard_len,
                     kv_tile=kv_tile)
    # tokens of this shard each row attends to: global tokens shard_start..position (the kernel's
    # SMEM operand, made here so that a log from shapes reads it)
    counts = jnp.clip(jnp.asarray(positions) + 1 - shard_start, 0, shard_len).astype(jnp.int32)
    return chip_log.run(
        lambda *args: _partial_call(plan, tpu.interpret_params(), dma.is_recording(),
                                    tuple(sorted(indices.items())), *args),
        counts, q_absorbed, q_extra, cache_shard["ckv"], cache_shard["kx"])


def _check_partial_inputs(q_absorbed, q_extra, cache_shard, positions, shard_start, cfg):
    """ValueError naming the parameter; returns (B, H)."""
    if getattr(q_absorbed, "ndim", None) != 3 or q_absorbed.shape[2] != cfg.mla_kv_rank:
        raise ValueError(f"q_absorbed has shape {getattr(q_absorbed, 'shape', None)}: expected "
                         f"[B, H, kv_rank={cfg.mla_kv_rank}]")
    batch, n_heads = q_absorbed.shape[:2]
    if getattr(q_extra, "shape", None) != (batch, n_heads, cfg.mla_qk_extra):
        raise ValueError(f"q_extra has shape {getattr(q_extra, 'shape', None)}: expected "
                         f"{(batch, n_heads, cfg.mla_qk_extra)}")
    for name, value in (("q_absorbed", q_absorbed), ("q_extra", q_extra)):
        if value.dtype != jnp.bfloat16:
            raise ValueError(f"{name}.dtype={value.dtype} is invalid: bfloat16")
    check_cache(cache_shard, "cache_shard", cfg.replace(mla_cache_layout="latent"), batch)
    if getattr(positions, "shape", None) != (batch,) or positions.dtype != jnp.int32:
        raise ValueError(f"positions has shape {getattr(positions, 'shape', None)} and dtype "
                         f"{getattr(positions, 'dtype', None)}: expected [B={batch}] int32")
    if not isinstance(shard_start, jax.core.Tracer) and (
            np.ndim(shard_start) != 0 or int(shard_start) < 0):
        raise ValueError(f"shard_start={shard_start!r} is invalid: an int >= 0 (the global index "
                         f"of the shard's first token)")
    return batch, n_heads


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _partial_call(plan: MlaPlan, interpret: Any, recording: bool, indices: tuple, counts,
                  q_absorbed, q_extra, ckv, kx):
    del recording  # static only so recorded and silent traces are cached apart
    vmem, hbm = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)
    stat = jax.ShapeDtypeStruct((plan.batch, plan.n_heads, 1), jnp.float32)
    out_shape = (stat, stat,
                 jax.ShapeDtypeStruct((plan.batch, plan.n_heads, plan.kv_rank), jnp.float32))
    call = functools.partial(
        pl.pallas_call, functools.partial(mla_latent_partial_body, plan, **dict(indices)),
        out_shape=out_shape,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), vmem, vmem, hbm, hbm],
        out_specs=(vmem, vmem, vmem),
        interpret=interpret)
    # read off the body, every row attending to the whole shard (kernels/base/costs.py)
    every_token = np.full((plan.batch,), plan.seq_len, np.int32)
    return costs.costed_call(call, counts, q_absorbed, q_extra, ckv, kx,
                             io=(counts, q_absorbed, q_extra, out_shape), inputs={0: every_token})


def combine_partials(partials):
    """Merge partial online-softmax states [(m, norm, acc), ...] of disjoint token sets into one.

    The log-sum-exp merge: with M = max_i m_i, norm = Σ_i e^(m_i - M) norm_i and
    acc = Σ_i e^(m_i - M) acc_i. An empty shard (m = EMPTY_MAX, norm = acc = 0) adds nothing.
    On a pod this is the collective across the ranks; here it is plain JAX.
    """
    ms, norms, accs = zip(*partials)
    m = functools.reduce(jnp.maximum, ms)
    weights = [jnp.exp(m_i - m) for m_i in ms]
    return (m, sum(w * n for w, n in zip(weights, norms)),
            sum(w * a for w, a in zip(weights, accs)))
