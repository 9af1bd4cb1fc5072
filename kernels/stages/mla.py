"""MLA decode attention (docs/kimi-k3.md §5) as one Pallas TPU kernel: x -> sublayer output + cache update.

One call does, for a batch of B rows each at its own position p_b:

  projections   c_q = RMSNorm(bf(x W_qa)); q = bf(c_q W_qb); [c_kv | k^X] = bf(x W_kva);
                ĉ = RMSNorm(c_kv); gate = bf(σ(bf(x W_g)))             (weights stream by DMA)
  attention     scores over the p_b cached tokens + the new one, f32 online softmax over KV tiles
                of T tokens read from HBM with a double-buffered DMA ring (`kv_tiles.py`); only
                tokens 0..p_b-1 are read, rounded up to whole 16-row HBM tiles (the last KV tile
                in runs of 16-row groups, `kv_tiles._tile_reads`). The new token never goes
                through HBM on the read side: it seeds the softmax (m = its score, norm = 1,
                acc = its value).
  output        y_h = bf(bf(o_h) ⊙ gate_h); out = y W_o                    (W_o streams by DMA)
  cache update  the new token's entry is written in place (input_output_aliases). HBM arrays are
                tiled (16 rows of bf16), so a single row cannot be DMA'd at an arbitrary position:
                the aligned 16-row block around p_b is read, patched in VMEM, and written back.

Cache layouts (`cfg.mla_cache_layout`, docs/kimi-k3.md §5):
  expanded  k [B, H, S, k_padded] = [k^C | k^X | 0], v [B, H, S, v]: per head, what the released
            kernels cache. Scores q^C·k^C + q^X·k^X per head, o = Σ α v.
  latent    ckv [B, S, kv_rank] = ĉ, kx [B, S, extra]: shared by all heads. W_kvb is absorbed:
            the query side uses q_lat_h = q^C_h W_kvbK_hᵀ (score q_lat_h·ĉ + q^X_h·k^X), the output
            side o_h = (Σ α ĉ) W_kvbV_h. One tile serves every head, at 64x fewer bytes per token.

Per rank (3 of 96 heads) the head-sharded latent layout saves only 2x: each rank still reads the
whole latent. `mla_sharded.mla_latent_partial` shards the latent cache by sequence instead: each
rank computes the online-softmax state of all heads over its 1/32 of the tokens (the same tile
loop, `latent_partial`), and `mla_sharded.combine_partials` merges the states (log-sum-exp): 64x
fewer KV bytes per rank. KV bytes are counted by `mkresearch.model.kv_cache` (shapes) and
`mkresearch.measurement.logs` (DMA logs).

`mla_attention_body` works on Refs and allocates its own scratch (`pl.run_scoped`), so the
megakernel calls it as it is; `mla_attention` is the thin `pallas_call` wrapper with the reference's
signature (`mkresearch.model.reference.mla_attention`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, chip_log, costs, dma, input_checks
from mkresearch.kernels.base.blocks import bf16, f32
from mkresearch.kernels.base.kv_tiles import (
    CONTIGUOUS,
    dot_t,
    online_softmax_step,
    rows_dot_t,
    tile_loop,
)
from mkresearch.kernels.base.kv_update import (
    update_expanded,
    update_latent,
)
from mkresearch.kernels.base.registry import KernelStage, StageRefs, Streamed, register
from mkresearch.kernels.stages import mla_queries

from mkresearch.hardware import tpu
from mkresearch.model.config import MLA_CACHE_LAYOUTS, ModelConfig

WEIGHT_NAMES = ("w_qa", "q_norm", "w_qb", "w_kva", "kv_norm", "w_kvb", "w_g", "w_o")  # q LoRA


def weight_names(cfg: ModelConfig) -> tuple[str, ...]:
    """WEIGHT_NAMES with the query weights of cfg (`mla_queries`: W_q alone at mla_q_rank 0),
    without W_g when the output is not gated (mla_output_gate False: Kimi Linear)."""
    return mla_queries.weight_names(cfg.mla_q_rank) + tuple(
        name for name in WEIGHT_NAMES[3:] if cfg.mla_output_gate or name != "w_g")
CACHE_NAMES = {"expanded": ("k", "v"), "latent": ("ckv", "kx")}
KV_TILE_NAME = "mla.kv"  # DMA-log name prefix of the KV tile reads: <prefix>.<cache array>


@dataclass(frozen=True)
class MlaPlan:
    """Everything static about one MLA kernel: shapes, layout, block sizes."""

    batch: int
    n_heads: int
    d_model: int
    q_rank: int
    kv_rank: int
    qk_nope: int
    qk_extra: int
    v_dim: int
    k_padded: int
    seq_len: int  # S: cache length
    kv_tile: int  # T: tokens per KV tile
    layout: str  # "expanded" | "latent"
    eps: float
    rows: tuple[tuple[str, int], ...]  # weight name -> rows of one streamed block
    # rows sharing one cache row (a verify step's K + 1 tokens, in order): row r attends to and
    # writes cache row r // rows_per_state at its own position, so later rows see earlier ones
    # (not in the repr: the recorded compiles are keyed by a decode plan's repr)
    rows_per_state: int = field(default=1, repr=False)
    output_gate: bool = field(default=True, repr=False)  # False: Kimi Linear's MLA, y = o

    @property
    def qk_dim(self) -> int:
        return self.qk_nope + self.qk_extra

    @property
    def scale(self) -> float:
        return float(self.qk_dim) ** -0.5

    def block_rows(self, name: str) -> int:
        return dict(self.rows)[name]


def make_plan(cfg: ModelConfig, batch: int, seq_len: int, *, kv_tile: int | None = None,
              weight_block_rows: int | None = None) -> MlaPlan:
    """Check block sizes (ValueError naming the parameter) and fix every static size."""
    kv_tile = cfg.kv_tile if kv_tile is None else kv_tile
    blocks.check_kv_tile(kv_tile, seq_len)
    blocks.check_block_rows(weight_block_rows)
    h, v = cfg.n_heads, cfg.mla_v_dim
    rows = tuple((name, blocks.weight_block_rows(shape, jnp.bfloat16, weight_block_rows))
                 for name, shape in weight_shapes(cfg).items() if len(shape) == 2)
    return MlaPlan(batch=batch, n_heads=h, d_model=cfg.d_model, q_rank=cfg.mla_q_rank,
                   kv_rank=cfg.mla_kv_rank, qk_nope=cfg.mla_qk_nope, qk_extra=cfg.mla_qk_extra,
                   v_dim=v, k_padded=cfg.mla_k_padded, seq_len=seq_len, kv_tile=kv_tile,
                   layout=cfg.mla_cache_layout, eps=cfg.rms_eps, rows=rows,
                   output_gate=cfg.mla_output_gate)


# ---- the body -----------------------------------------------------------------------------------


def mla_attention_body(plan: MlaPlan, refs: StageRefs) -> None:
    """One MLA sublayer for B rows.

    refs.positions [B] i32 (SMEM); refs.x [B, d] bf16 (VMEM); refs.weights by WEIGHT_NAMES in
    HBM, norms as [1, n]; refs.state_in the layer's cache in HBM ({"k", "v"} or {"ckv", "kx"})
    and refs.state_out the same buffers (aliased) for the in-place write; refs.out [B, d] bf16
    (VMEM). refs.indices (e.g. layer=3) tag the DMA log.

    A verify step (plan.rows_per_state = K + 1 > 1): row r is at position positions[r] of cache
    row r // (K + 1); rows run in order and each writes its entry before the next one attends, so
    row (b, j) sees the cache up to p_b + j: causal within the batch row by length masking.

    A paged cache (refs.kv_rows, `kv_tiles.KvRows`): the cache refs are pools [N, (H,) P, ·],
    read and written through the page table; a free slot (position -1) reads and writes none.
    """
    with dma.phase("mla.project", **refs.indices):
        projected = _project(plan, refs)
    # W_kvb stays whole in VMEM for the latent layout (both absorbed sides use it); the expanded
    # layout streams it instead and gets a one-tile placeholder
    w_kvb_shape = ((plan.kv_rank, plan.n_heads * (plan.qk_nope + plan.v_dim))
                   if plan.layout == "latent" else (16, 128))
    pl.run_scoped(functools.partial(_with_w_kvb, plan, refs, projected),
                  pltpu.VMEM(w_kvb_shape, jnp.bfloat16))


class _Projected(NamedTuple):
    """The projections every row reads (bf16 values)."""

    q: Any  # [B, H·qk] f32: per head [q^C | q^X]
    c_hat: Any  # [B, kv_rank] bf16: the normalised latent ĉ
    k_extra: Any  # [B, extra] bf16: k^X, shared by all heads, not normalised
    gate: Any  # [B, H·v] f32: σ of the output gate (None: Kimi Linear's MLA has none)


def _project(p: MlaPlan, refs: StageRefs) -> _Projected:
    """The queries and x W_kva (`mla_queries.project`), ĉ = RMSNorm(c) and the output gate."""
    x, indices = refs.x[...], refs.indices  # x [B, d] bf16
    q, ckv_kx = mla_queries.project(p, refs.weights, x, refs.stream, indices)  # [B, H*qk]
    ckv_kx = bf16(ckv_kx)  # [B, kv_rank + extra]
    c_hat = blocks.rms_norm(f32(ckv_kx[:, :p.kv_rank]),
                            blocks.load_whole(refs.weights["kv_norm"], name="mla.kv_norm",
                                              **indices), p.eps)  # [B, kv_rank] bf16
    k_extra = ckv_kx[:, p.kv_rank:]
    gate = None
    if p.output_gate:
        gate = f32(bf16(jax.nn.sigmoid(f32(bf16(blocks.stream_matmul(
            refs.stream, x, refs.weights["w_g"], rows=p.block_rows("w_g"), name="mla.w_g",
            **indices))))))
    return _Projected(q, c_hat, k_extra, gate)


def _with_w_kvb(p: MlaPlan, refs: StageRefs, projected: _Projected, w_kvb_vmem: Any) -> None:
    """The rows in order (each attends, then writes its entry), then W_o. w_kvb_vmem: W_kvb
    whole for the latent layout; the expanded layout streams it into [B, H·(nope+v)] instead."""
    w_kvb, kv_new = refs.weights["w_kvb"], None
    if p.layout == "expanded":  # per head [k^C | v]
        kv_new = bf16(blocks.stream_matmul(refs.stream, projected.c_hat, w_kvb,
                                           rows=p.block_rows("w_kvb"), name="mla.w_kvb",
                                           **refs.indices))
    else:
        blocks.load_into(w_kvb, w_kvb_vmem, rows=p.block_rows("w_kvb"), name="mla.w_kvb",
                         **refs.indices)
    y = jax.lax.fori_loop(0, p.batch, functools.partial(_row_step, p, refs, projected, kv_new,
                                                        w_kvb_vmem),
                          (jnp.zeros((p.batch, p.v_dim)),) * p.n_heads)
    with dma.phase("mla.output", **refs.indices):
        refs.out[...] = bf16(blocks.stream_matmul(
            refs.stream, bf16(jnp.concatenate(y, axis=1)), refs.weights["w_o"],
            rows=p.block_rows("w_o"), name="mla.w_o", **refs.indices))


def _row_step(p: MlaPlan, refs: StageRefs, projected: _Projected, kv_new: Any, w_kvb_vmem: Any,
              b: Any, y: tuple) -> tuple:
    """One batch row (a loop, not unrolled: it keeps the kernel small): its heads attend over
    its cache row, its entry is written, its outputs (gated) land in y (per head [B, v])."""
    position = refs.positions[b]
    s = blocks.state_row(b, p.rows_per_state)  # the row's cache row
    q_b = blocks.select_row(projected.q, b)  # [1, H*qk]
    q_row = [q_b[:, h * p.qk_dim:(h + 1) * p.qk_dim] for h in range(p.n_heads)]
    k_extra_b = blocks.select_row(projected.k_extra, b)  # [1, extra] bf16
    if p.layout == "expanded":
        heads = _expanded_row(p, refs, s, position, q_row, k_extra_b,
                              blocks.select_row(kv_new, b))
    else:
        heads = _latent_row(p, refs, s, position, q_row, k_extra_b,
                            blocks.select_row(projected.c_hat, b), w_kvb_vmem)
    y = list(y)
    for h, o_h in enumerate(heads):  # o_h [1, v] f32
        y_h = f32(bf16(o_h))
        if projected.gate is not None:
            y_h = f32(bf16(y_h * blocks.select_row(
                projected.gate[:, h * p.v_dim:(h + 1) * p.v_dim], b)))
        y[h] = blocks.put_row(y[h], b, y_h)
    return tuple(y)


def _expanded_row(p: MlaPlan, refs: StageRefs, s: Any, position: Any, q_row: list,
                  k_extra_b: Any, kv_b: Any) -> list:
    """The expanded layout's row: per head k^C, v from kv_b [1, H·(nope+v)]; attend, then
    write K = [k^C | k^X | 0], V."""
    nope, v_dim = p.qk_nope, p.v_dim
    k_c = [kv_b[:, h * (nope + v_dim):h * (nope + v_dim) + nope]
           for h in range(p.n_heads)]  # [1, nope] each
    v_new = [kv_b[:, h * (nope + v_dim) + nope:(h + 1) * (nope + v_dim)]
             for h in range(p.n_heads)]  # [1, v] each
    caches, outs = _caches(p, refs)
    kv_rows = refs.kv_rows or CONTIGUOUS
    heads = _attend_expanded(p, s, position, q_row, k_c, k_extra_b, v_new, *caches,
                             refs.indices, kv_rows)
    update_expanded(p, s, position, k_c, k_extra_b, v_new, *caches, *outs,
                    CACHE_NAMES[p.layout], refs.indices, kv_rows)
    return heads


def _latent_row(p: MlaPlan, refs: StageRefs, s: Any, position: Any, q_row: list,
                k_extra_b: Any, c_hat_b: Any, w_kvb_vmem: Any) -> list:
    """The latent layout's row: attend with W_kvb absorbed, then write ĉ and k^X."""
    caches, outs = _caches(p, refs)
    kv_rows = refs.kv_rows or CONTIGUOUS
    heads = attend_latent(p, s, position, q_row, c_hat_b, k_extra_b, w_kvb_vmem, *caches,
                          refs.indices, kv_rows)
    update_latent(p, s, position, c_hat_b, k_extra_b, *caches, *outs, CACHE_NAMES[p.layout],
                  refs.indices, kv_rows)
    return heads


def _caches(p: MlaPlan, refs: StageRefs) -> tuple[tuple, tuple]:
    """The layer's two cache arrays in HBM, to read and (aliased) to write."""
    names = CACHE_NAMES[p.layout]
    return (tuple(refs.state_in[n] for n in names), tuple(refs.state_out[n] for n in names))


def _attend_expanded(p, b, position, q_row, k_c, k_extra, v_new, k_hbm, v_hbm, indices,
                     kv_rows=CONTIGUOUS):
    """Per head: scores over the cached expanded K, V tiles [H, T, ·] plus the new token."""
    nope, qk = p.qk_nope, p.qk_dim
    carry = []
    for h in range(p.n_heads):  # the new token seeds the softmax: m = its score, norm = 1, acc = v
        score = (blocks.ordered_sum(q_row[h][:, :nope] * f32(k_c[h]), keepdims=True)
                 + blocks.ordered_sum(q_row[h][:, nope:qk] * f32(k_extra), keepdims=True))
        carry.append((score * p.scale, jnp.ones_like(score), f32(v_new[h])))

    def update(t, tiles, carry):
        k_tile, v_tile = tiles
        new = []
        for h in range(p.n_heads):
            scores = (dot_t(bf16(q_row[h][:, :nope]), k_tile[h][:, :nope])
                      + dot_t(bf16(q_row[h][:, nope:qk]), k_tile[h][:, nope:qk])) * p.scale
            new.append(online_softmax_step(p, t, position, scores, f32(v_tile[h]), carry[h]))
        return new

    def scoped(k_buffers, v_buffers, sems):
        k_name, v_name = (f"{KV_TILE_NAME}.{name}" for name in CACHE_NAMES["expanded"])
        rings = (dma.Ring(k_buffers, sems.at[0], name=k_name),
                 dma.Ring(v_buffers, sems.at[1], name=v_name))
        return tile_loop(p, b, position, rings, (k_hbm, v_hbm), update, carry, indices,
                         kv_rows=kv_rows)  # tiles [H, T, k_padded], [H, T, v]

    final = pl.run_scoped(scoped, pltpu.VMEM((2, p.n_heads, p.kv_tile, p.k_padded), jnp.bfloat16),
                          pltpu.VMEM((2, p.n_heads, p.kv_tile, p.v_dim), jnp.bfloat16),
                          pltpu.SemaphoreType.DMA((2, 2)))
    return [acc / norm for _, norm, acc in final]


def attend_latent(p, b, position, q_row, c_hat, k_extra, w_kvb_vmem, ckv_hbm, kx_hbm, indices,
                   kv_rows=CONTIGUOUS):
    """All heads at once over latent tiles ĉ [T, kv_rank], k^X [T, extra], W_kvb absorbed."""
    nope, qk, width = p.qk_nope, p.qk_dim, p.qk_nope + p.v_dim

    def scoped(q_lat_scratch, q_x_scratch):
        for h in range(p.n_heads):  # q_lat_h = q^C_h W_kvbK_hᵀ  [1, kv_rank]
            w_k = w_kvb_vmem[:, h * width:h * width + nope]  # [kv_rank, nope]
            # 8 rows, not one (`rows_dot_t`): one-row products round otherwise on a TPU
            q_lat_scratch[h:h + 1, :] = f32(bf16(rows_dot_t(bf16(q_row[h][:, :nope]), w_k)))
            q_x_scratch[h:h + 1, :] = q_row[h][:, nope:qk]
        # bf16-exact f32 values: q̃ is rounded to bf16 like the reference, so the score matmuls
        # take bf16 operands (one MXU pass on a TPU)
        q_lat, q_x = q_lat_scratch[...], q_x_scratch[...]  # [H, kv_rank], [H, extra]
        c_new = f32(c_hat)  # [1, kv_rank]
        score = (blocks.ordered_sum(q_lat * c_new, keepdims=True)
                 + blocks.ordered_sum(q_x * f32(k_extra), keepdims=True)) * p.scale  # [H, 1]
        carry = (score, jnp.ones_like(score), jnp.broadcast_to(c_new, q_lat.shape))
        _, norm, acc = latent_partial(p, b, position, q_lat, q_x, ckv_hbm, kx_hbm, carry, indices,
                                      kv_rows)
        context = bf16(acc / norm)  # [H, kv_rank]: Σ α ĉ, the latent of the head outputs
        return [blocks.dot(context[h:h + 1, :],  # o_h = (Σ α ĉ) W_kvbV_h  [1, v], in 8 rows
                           w_kvb_vmem[:, h * width + nope:(h + 1) * width])
                for h in range(p.n_heads)]

    return pl.run_scoped(scoped, pltpu.VMEM((p.n_heads, p.kv_rank), jnp.float32),
                         pltpu.VMEM((p.n_heads, p.qk_extra), jnp.float32))


def latent_partial(p: MlaPlan, b, count, q_lat, q_x, ckv_hbm, kx_hbm, carry, indices,
                   kv_rows=CONTIGUOUS):
    """The online-softmax state of all heads over latent cache tokens 0..count-1 of row b.

    q_lat [H, kv_rank], q_x [H, extra]: the absorbed queries (bf16-exact f32); ckv_hbm
    [B, S, kv_rank], kx_hbm [B, S, extra] in HBM; carry (m [H, 1], norm [H, 1], acc [H, kv_rank])
    to continue from. Reads those tokens' rows (`kv_cache.rows_read`) tile by tile, double-buffered
    (paged: pools [N, P, ·] through the page table, `kv_rows`).
    """

    def update(t, tiles, carry):
        c_tile, x_tile = tiles  # [T, kv_rank], [T, extra] bf16
        # H rows: 2 heads on one device of the mini, 1 on each of its ranks; padded to 8 rows,
        # so a head gets the same bits either way (rows_dot_t)
        scores = (rows_dot_t(bf16(q_lat), c_tile)
                  + rows_dot_t(bf16(q_x), x_tile)) * p.scale  # [H, T]
        return online_softmax_step(p, t, count, scores, f32(c_tile), carry,
                                   padded=True)

    def scoped(c_buffers, x_buffers, sems):
        c_name, x_name = (f"{KV_TILE_NAME}.{name}" for name in CACHE_NAMES["latent"])
        rings = (dma.Ring(c_buffers, sems.at[0], name=c_name),
                 dma.Ring(x_buffers, sems.at[1], name=x_name))
        return tile_loop(p, b, count, rings, (ckv_hbm, kx_hbm), update, carry, indices,
                         kv_rows=kv_rows)  # tiles [T, kv_rank], [T, extra]

    return pl.run_scoped(scoped, pltpu.VMEM((2, p.kv_tile, p.kv_rank), jnp.bfloat16),
                         pltpu.VMEM((2, p.kv_tile, p.qk_extra), jnp.bfloat16),
                         pltpu.SemaphoreType.DMA((2, 2)))


# ---- the wrapper --------------------------------------------------------------------------------


def cache_shapes(cfg: ModelConfig, batch: int, seq_len: int) -> dict[str, tuple[int, ...]]:
    h = cfg.n_heads
    if cfg.mla_cache_layout == "expanded":
        return {"k": (batch, h, seq_len, cfg.mla_k_padded), "v": (batch, h, seq_len, cfg.mla_v_dim)}
    return {"ckv": (batch, seq_len, cfg.mla_kv_rank), "kx": (batch, seq_len, cfg.mla_qk_extra)}


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, v = cfg.n_heads, cfg.mla_v_dim
    gate = {"w_g": (cfg.d_model, h * v)} if cfg.mla_output_gate else {}  # Kimi Linear: none
    return {**mla_queries.shapes(cfg), "w_kva": (cfg.d_model, cfg.mla_latent_cache_dim),
            "kv_norm": (cfg.mla_kv_rank,), "w_kvb": (cfg.mla_kv_rank, h * (cfg.mla_qk_nope + v)),
            **gate, "w_o": (h * v, cfg.d_model)}


def check_cache(cache: Any, label: str, cfg: ModelConfig, batch: int) -> int:
    """ValueError naming `label` for bad keys, shapes or dtypes of a (layout cfg) cache or cache
    shard; returns its length."""
    names = CACHE_NAMES[cfg.mla_cache_layout]
    input_checks.check_keys(cache, label, names, f" for mla_cache_layout={cfg.mla_cache_layout!r}")
    seq_len = cache[names[0]].shape[-2]
    input_checks.check_arrays(cache, label, cache_shapes(cfg, batch, seq_len),
                        note=f" (batch {batch}, length {seq_len})")
    return seq_len


def check_inputs(p: dict, x: Any, cache: dict, positions: Any, cfg: ModelConfig) -> int:
    """ValueError naming the parameter for bad shapes, dtypes or positions; returns the cache
    length."""
    if cfg.mla_cache_layout not in MLA_CACHE_LAYOUTS:
        raise ValueError(f"cfg.mla_cache_layout={cfg.mla_cache_layout!r} is invalid: one of "
                         f"{MLA_CACHE_LAYOUTS}")
    batch = input_checks.check_x(x, cfg.d_model)
    input_checks.check_arrays(p, "p", weight_shapes(cfg))
    seq_len = check_cache(cache, "cache", cfg, batch)
    input_checks.check_positions(positions, batch, seq_len)
    return seq_len


def mla_attention(p: dict, x: jax.Array, cache: dict, positions: jax.Array, cfg: ModelConfig, *,
                  kv_tile: int | None = None, weight_block_rows: int | None = None,
                  **indices: int) -> tuple[jax.Array, dict]:
    """The MLA sublayer as a Pallas kernel; same contract as `reference.mla_attention`.

    x [B, d] bf16 (normalised), one layer's weights `p`, that layer's cache (batch-major, layout
    `cfg.mla_cache_layout`), positions [B] i32 -> (out [B, d] bf16, updated cache). The cache is
    updated in place when the caller donates it. kv_tile overrides cfg.kv_tile (a multiple of 16
    dividing the cache length); weight_block_rows caps the rows of one streamed weight block (a
    multiple of 128).
    """
    seq_len = check_inputs(p, x, cache, positions, cfg)
    plan = make_plan(cfg, x.shape[0], seq_len, kv_tile=kv_tile,
                     weight_block_rows=weight_block_rows)
    names = CACHE_NAMES[plan.layout]
    out, new_cache = chip_log.run(
        lambda *args: _call(plan, tpu.interpret_params(), dma.is_recording(),
                            tuple(sorted(indices.items())), *args),
        positions, x, prepare_layer(p), {name: cache[name] for name in names})
    return out, new_cache


def prepare_layer(p: dict) -> dict:
    """One layer's weights as the body reads them: vectors as [1, n] rows (a VMEM row)."""
    names = [name for name in ("w_q", *WEIGHT_NAMES) if name in p]  # q LoRA or W_q
    return {name: p[name].reshape(1, -1) if p[name].ndim == 1 else p[name] for name in names}


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _call(plan: MlaPlan, interpret: Any, recording: bool, indices: tuple, positions, x, weights,
          cache):
    del recording  # a static argument only so recorded and silent traces are cached apart
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    n_in = 2 + len(jax.tree.leaves(weights))  # then the two cache arrays (a dict flattens sorted)
    names = sorted(cache)

    def kernel(positions_ref, x_ref, weight_refs, cache_in, out_ref, cache_out):
        mla_attention_body(plan, StageRefs(x=x_ref, out=out_ref, weights=weight_refs,
                                           state_in=cache_in, state_out=cache_out,
                                           positions=positions_ref, stream=blocks.LOCAL_STREAM,
                                           indices=dict(indices)))

    call = functools.partial(
        pl.pallas_call, kernel,
        out_shape=(out, {name: jax.ShapeDtypeStruct(cache[name].shape, cache[name].dtype)
                         for name in names}),
        in_specs=(pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM),
                  jax.tree.map(lambda _: hbm, weights), {name: hbm for name in names}),
        out_specs=(pl.BlockSpec(memory_space=pltpu.VMEM), {name: hbm for name in names}),
        input_output_aliases={n_in: 1, n_in + 1: 2},
        interpret=interpret)
    # read off the body, every row at the cache's last position: the whole cache is read
    return costs.costed_call(call, positions, x, weights, cache, io=(positions, x, out),
                             inputs={0: costs.worst_positions(plan.batch, plan.seq_len)})


# ---- the kind in the kernel registry (what the megakernel composes) ----------------------------
def _prepare(stack: dict, cfg: ModelConfig) -> dict:
    """The MLA layers' stacked weights as the body reads them: norm gains as [n, 1, x] rows."""
    return {name: stack[name].reshape(stack[name].shape[0], 1, -1) if stack[name].ndim == 2
            and name in ("q_norm", "kv_norm") else stack[name] for name in weight_names(cfg)}


def _streamed(cfg: ModelConfig) -> tuple[Streamed, ...]:
    """In the body's order; the latent layout keeps W_kvb whole in VMEM (not streamed)."""
    shapes = weight_shapes(cfg)
    names = mla_queries.streamed_names(cfg.mla_q_rank) + (
        ("w_g",) if cfg.mla_output_gate else ()) + (
        ("w_kvb",) if cfg.mla_cache_layout == "expanded" else ()) + ("w_o",)
    return tuple(Streamed(name, f"mla.{name}", shapes[name]) for name in names)


KERNEL = register(KernelStage(
    name="mla",
    plan=lambda cfg, batch, seq_len, options: make_plan(cfg, batch, seq_len,
                                                        kv_tile=options.kv_tile),
    prepare=_prepare, streamed=_streamed, body=mla_attention_body,
    scope=lambda plan: f"MLA ({plan.layout})"))
