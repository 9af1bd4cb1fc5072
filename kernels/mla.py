"""MLA decode attention (spec §5) as one Pallas TPU kernel: x -> sublayer output + cache update.

One call does, for a batch of B rows each at its own position p_b:

  projections   c_q = RMSNorm(bf(x W_qa)); q = bf(c_q W_qb); [c_kv | k^X] = bf(x W_kva);
                ĉ = RMSNorm(c_kv); gate = bf(σ(bf(x W_g)))             (weights stream by DMA)
  attention     scores over the p_b cached tokens + the new one, f32 online softmax over KV tiles
                of T tokens read from HBM with a double-buffered DMA ring; only tokens
                0..p_b-1 are read, rounded up to whole 16-row HBM tiles (the last KV tile in
                runs of 16-row groups, `_tile_reads`). The new token never goes through HBM
                on the read side: it seeds the softmax (m = its score, norm = 1, acc = its value).
  output        y_h = bf(bf(o_h) ⊙ gate_h); out = y W_o                    (W_o streams by DMA)
  cache update  the new token's entry is written in place (input_output_aliases). HBM arrays are
                tiled (16 rows of bf16), so a single row cannot be DMA'd at an arbitrary position:
                the aligned 16-row block around p_b is read, patched in VMEM, and written back.

Cache layouts (`cfg.mla_cache_layout`, spec §5):
  expanded  k [B, H, S, k_padded] = [k^C | k^X | 0], v [B, H, S, v]: per head, what the released
            kernels cache. Scores q^C·k^C + q^X·k^X per head, o = Σ α v.
  latent    ckv [B, S, kv_rank] = ĉ, kx [B, S, extra]: shared by all heads. W_kvb is absorbed:
            the query side uses q_lat_h = q^C_h W_kvbK_hᵀ (score q_lat_h·ĉ + q^X_h·k^X), the output
            side o_h = (Σ α ĉ) W_kvbV_h. One tile serves every head, at 64x fewer bytes per token.

Per rank (3 of 96 heads) the head-sharded latent layout saves only 2x: each rank still reads the
whole latent. `mla_latent_partial` shards the latent cache by sequence instead: each rank computes
the online-softmax state of all heads over its 1/32 of the tokens (the same tile loop), and
`combine_partials` merges the states (log-sum-exp): 64x fewer KV bytes per rank.

`mla_attention_body` works on Refs and allocates its own scratch (`pl.run_scoped`), so the
megakernel calls it as it is; `mla_attention` is the thin `pallas_call` wrapper with the reference's
signature (`mkresearch.reference.mla_attention`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkresearch import tpu
from mkresearch.config import BF16_SUBLANE, MLA_CACHE_LAYOUTS, ModelConfig
from mkresearch.kernels import blocks, costs, dma
from mkresearch.kernels.blocks import bf16, f32

# Rows of the aligned HBM block patched to write one new cache entry (bf16 HBM tiling).
UPDATE_ROWS = BF16_SUBLANE
# The KV tiles are read in groups of this many rows: a DMA window of a bf16 HBM array starts and
# ends on its 16-row tiles, so the last tile's tail past the position is skipped group by group.
KV_ROW_GROUP = BF16_SUBLANE

WEIGHT_NAMES = ("w_qa", "q_norm", "w_qb", "w_kva", "kv_norm", "w_kvb", "w_g", "w_o")
CACHE_NAMES = {"expanded": ("k", "v"), "latent": ("ckv", "kx")}


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
    h, qk, v = cfg.n_heads, cfg.mla_qk_dim, cfg.mla_v_dim
    shapes = {"w_qa": (cfg.d_model, cfg.mla_q_rank), "w_qb": (cfg.mla_q_rank, h * qk),
              "w_kva": (cfg.d_model, cfg.mla_latent_cache_dim),
              "w_kvb": (cfg.mla_kv_rank, h * (cfg.mla_qk_nope + v)),
              "w_g": (cfg.d_model, h * v), "w_o": (h * v, cfg.d_model)}
    rows = tuple((name, blocks.weight_block_rows(shape, jnp.bfloat16, weight_block_rows))
                 for name, shape in shapes.items())
    return MlaPlan(batch=batch, n_heads=h, d_model=cfg.d_model, q_rank=cfg.mla_q_rank,
                   kv_rank=cfg.mla_kv_rank, qk_nope=cfg.mla_qk_nope, qk_extra=cfg.mla_qk_extra,
                   v_dim=v, k_padded=cfg.mla_k_padded, seq_len=seq_len, kv_tile=kv_tile,
                   layout=cfg.mla_cache_layout, eps=cfg.rms_eps, rows=rows)


# ---- the body -----------------------------------------------------------------------------------


def mla_attention_body(plan: MlaPlan, positions_ref, x_ref, w_qa, q_norm, w_qb, w_kva, kv_norm,
                       w_kvb, w_g, w_o, cache_a, cache_b, out_ref, cache_a_out, cache_b_out,
                       **indices: Any) -> None:
    """One MLA sublayer for B rows.

    positions_ref [B] i32 (SMEM); x_ref [B, d] bf16 (VMEM); weights in HBM, norms as [1, n];
    cache_a/cache_b the layer's cache in HBM (k, v or ckv, kx) and cache_*_out the same buffers
    (aliased) for the in-place write; out_ref [B, d] bf16 (VMEM). `indices` (e.g. layer=3) tag
    the DMA log.
    """
    p = plan
    h_count, nope, v_dim = p.n_heads, p.qk_nope, p.v_dim

    with dma.phase("mla.project", **indices):
        x = x_ref[...]  # [B, d] bf16
        stream = functools.partial(blocks.stream_matmul, **indices)
        c_q = blocks.rms_norm(
            bf16(stream(x, w_qa, rows=p.block_rows("w_qa"), name="mla.w_qa")),
            blocks.load_whole(q_norm, name="mla.q_norm", **indices), p.eps)  # [B, q_rank]
        q = f32(bf16(stream(c_q, w_qb, rows=p.block_rows("w_qb"), name="mla.w_qb")))  # [B, H*qk]
        ckv_kx = bf16(stream(x, w_kva, rows=p.block_rows("w_kva"), name="mla.w_kva"))
        c_hat = blocks.rms_norm(f32(ckv_kx[:, :p.kv_rank]),
                                blocks.load_whole(kv_norm, name="mla.kv_norm", **indices),
                                p.eps)  # [B, kv_rank] bf16
        k_extra = ckv_kx[:, p.kv_rank:]  # [B, extra] bf16, shared by all heads, not normalised
        gate = f32(bf16(jax.nn.sigmoid(f32(bf16(
            stream(x, w_g, rows=p.block_rows("w_g"), name="mla.w_g"))))))  # [B, H*v]

    def with_scratch(w_kvb_vmem):
        if p.layout == "expanded":
            kv_new = bf16(stream(c_hat, w_kvb, rows=p.block_rows("w_kvb"),
                                 name="mla.w_kvb"))  # [B, H*(nope+v)] = per head [k^C | v]
        else:
            blocks.load_into(w_kvb, w_kvb_vmem, rows=p.block_rows("w_kvb"), name="mla.w_kvb",
                             **indices)

        def row_step(b, y):  # one batch row; a loop (not unrolled) keeps the kernel small
            position = positions_ref[b]
            q_b = blocks.select_row(q, b)  # [1, H*qk]
            q_row = [q_b[:, h * p.qk_dim:(h + 1) * p.qk_dim] for h in range(h_count)]
            k_extra_b = blocks.select_row(k_extra, b)  # [1, extra] bf16
            if p.layout == "expanded":
                kv_b = blocks.select_row(kv_new, b)
                k_c = [kv_b[:, h * (nope + v_dim):h * (nope + v_dim) + nope]
                       for h in range(h_count)]  # [1, nope] each
                v_new = [kv_b[:, h * (nope + v_dim) + nope:(h + 1) * (nope + v_dim)]
                         for h in range(h_count)]  # [1, v] each
                heads = _attend_expanded(p, b, position, q_row, k_c, k_extra_b, v_new,
                                         cache_a, cache_b, indices)
                _update_expanded(p, b, position, k_c, k_extra_b, v_new, cache_a, cache_b,
                                 cache_a_out, cache_b_out, indices)
            else:
                c_hat_b = blocks.select_row(c_hat, b)  # [1, kv_rank] bf16
                heads = _attend_latent(p, b, position, q_row, c_hat_b, k_extra_b, w_kvb_vmem,
                                       cache_a, cache_b, indices)
                _update_latent(p, b, position, c_hat_b, k_extra_b, cache_a, cache_b,
                               cache_a_out, cache_b_out, indices)
            y = list(y)  # per head [B, v]
            for h, o_h in enumerate(heads):  # o_h [1, v] f32
                gate_h = blocks.select_row(gate[:, h * v_dim:(h + 1) * v_dim], b)
                y[h] = blocks.put_row(y[h], b, f32(bf16(f32(bf16(o_h)) * gate_h)))
            return tuple(y)

        y = jax.lax.fori_loop(0, p.batch, row_step, (jnp.zeros((p.batch, v_dim)),) * h_count)
        with dma.phase("mla.output", **indices):
            out_ref[...] = bf16(stream(bf16(jnp.concatenate(y, axis=1)), w_o,
                                       rows=p.block_rows("w_o"), name="mla.w_o"))

    # W_kvb stays whole in VMEM for the latent layout (both absorbed sides use it); the expanded
    # layout streams it instead and gets a one-tile placeholder
    w_kvb_shape = (p.kv_rank, h_count * (nope + v_dim)) if p.layout == "latent" else (16, 128)
    pl.run_scoped(with_scratch, pltpu.VMEM(w_kvb_shape, jnp.bfloat16))


def _tile_count(p: MlaPlan, position):
    """⌈position / T⌉: the tiles holding the cached tokens 0..position-1 (lax.div: no sign op)."""
    return jax.lax.div(position + p.kv_tile - 1, p.kv_tile)


def rows_read(count: int) -> int:
    """Cache rows the kernels read for `count` tokens: whole 16-row HBM tiles (bf16), the least
    a DMA window can cover. Tiles of T tokens add nothing: T is a multiple of 16."""
    return -(-count // KV_ROW_GROUP) * KV_ROW_GROUP


def _tile_reads(p: MlaPlan, t, count):
    """How tile t is read, as [(condition, first row, rows)]: the whole tile when it holds no
    token past count - 1, else only the ⌈r / 16⌉ 16-row groups holding its r = count - t·T
    tokens. A DMA's size is static, so those groups go as runs of 2^i groups, largest first (the
    binary digits of the group count): at most log2(T / 16) + 1 DMAs, each under its condition."""
    n_groups = p.kv_tile // KV_ROW_GROUP
    tokens = jnp.minimum(count - t * p.kv_tile, p.kv_tile)  # >= 1 for every tile of the loop
    groups = jax.lax.div(tokens + KV_ROW_GROUP - 1, KV_ROW_GROUP)
    reads = [(groups == n_groups, 0, p.kv_tile)]
    for i in reversed(range((n_groups - 1).bit_length())):  # runs of 2^i groups, i descending
        run = 2 ** i
        has_run = (groups < n_groups) & (jax.lax.rem(jax.lax.div(groups, run), 2) == 1)
        first = jax.lax.div(groups, 2 * run) * (2 * run * KV_ROW_GROUP)  # the longer runs' rows
        reads.append((has_run, pl.multiple_of(first, KV_ROW_GROUP), run * KV_ROW_GROUP))
    return reads


def _token_rows(ref, rows):
    """ref[..., rows, :]: a window of the token axis (the second-to-last) of a cache ref."""
    return ref.at[(slice(None),) * (len(ref.shape) - 2) + (rows, slice(None))]


def tile_loop(p: MlaPlan, b: int, count, rings, windows, update, carry, indices):
    """Double-buffered loop over the KV tiles holding tokens 0..count-1: tile t+1 flies while
    tile t is used. The last tile reads only the 16-row groups holding tokens < count
    (`_tile_reads`); its other rows keep stale or uninitialised values, masked by `update`.

    rings: dma.Ring per cache array; windows(t) -> the HBM window [.., T, ..] of each array for
    tile t (tokens on the second-to-last axis); update(t, tiles, carry) -> carry, with tiles the
    VMEM values of tile t ([.., T, ..] whole, rows past count unread).
    """
    n_tiles = _tile_count(p, count)

    def read(t, slot, action, first, rows):  # start or wait rows first.. of tile t, each array
        part = pl.ds(first, rows)
        for ring, window in zip(rings, windows(t)):
            copy = dma.Copy(_token_rows(window, part), _token_rows(ring.buffer(slot), part),
                            ring.sems_ref.at[slot], name=ring.name, slot=slot, row=b, tile=t,
                            **indices)
            getattr(copy, action)()

    def each_read(t, slot, action):  # action: "start" or "wait" every DMA of tile t
        for condition, first, rows in _tile_reads(p, t, count):
            pl.when(condition)(functools.partial(read, t, slot, action, first, rows))

    @pl.when(n_tiles > 0)
    def _():
        each_read(0, 0, "start")

    def step(t, carry):
        slot = jax.lax.rem(t, 2)

        @pl.when(t + 1 < n_tiles)
        def _():
            each_read(t + 1, 1 - slot, "start")

        each_read(t, slot, "wait")
        tiles = [ring.buffer(slot)[...] for ring in rings]
        with dma.phase("mla.attend", row=b, tile=t, **indices):
            return update(t, tiles, carry)

    return jax.lax.fori_loop(0, n_tiles, step, carry)


def online_softmax_step(p: MlaPlan, t, position, scores, values, carry):
    """One tile of the f32 online softmax: scores [R, T], values [T, n]; carry (m, norm, acc)."""
    m, norm, acc = carry
    token = t * p.kv_tile + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    valid = token < position  # the tile's tail past the cached tokens is stale: masked
    scores = jnp.where(valid, scores, -jnp.inf)
    # rows past the cached tokens may be unread (uninitialised, even NaN): 0 · NaN = NaN, so the
    # values are selected too; a valid row is unchanged and a masked one added 0 before as well
    row_token = t * p.kv_tile + jax.lax.broadcasted_iota(jnp.int32, values.shape, 0)
    values = jnp.where(row_token < position, values, 0.0)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))  # finite: m starts finite
    correction = jnp.exp(m - m_new)
    weights = jnp.where(valid, jnp.exp(scores - m_new), 0.0)
    norm = correction * norm + blocks.ordered_sum(weights, keepdims=True)
    acc = correction * acc + jnp.dot(weights, values, preferred_element_type=jnp.float32)
    return m_new, norm, acc


def dot_t(a, b):
    """a [M, K] · b [N, K]ᵀ -> [M, N] f32 (contract the last dims: no transpose in VMEM)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _attend_expanded(p, b, position, q_row, k_c, k_extra, v_new, k_hbm, v_hbm, indices):
    """Per head: scores over the cached expanded K, V tiles [H, T, ·] plus the new token."""
    nope, qk = p.qk_nope, p.qk_dim
    carry = []
    for h in range(p.n_heads):  # the new token seeds the softmax: m = its score, norm = 1, acc = v
        score = (blocks.ordered_sum(q_row[h][:, :nope] * f32(k_c[h]), keepdims=True)
                 + blocks.ordered_sum(q_row[h][:, nope:qk] * f32(k_extra), keepdims=True))
        carry.append((score * p.scale, jnp.ones_like(score), f32(v_new[h])))

    def windows(t):
        tokens = pl.ds(pl.multiple_of(t * p.kv_tile, p.kv_tile), p.kv_tile)
        return k_hbm.at[b, :, tokens, :], v_hbm.at[b, :, tokens, :]  # [H, T, k_padded], [H, T, v]

    def update(t, tiles, carry):
        k_tile, v_tile = tiles
        new = []
        for h in range(p.n_heads):
            scores = (dot_t(bf16(q_row[h][:, :nope]), k_tile[h][:, :nope])
                      + dot_t(bf16(q_row[h][:, nope:qk]), k_tile[h][:, nope:qk])) * p.scale
            new.append(online_softmax_step(p, t, position, scores, f32(v_tile[h]), carry[h]))
        return new

    def scoped(k_buffers, v_buffers, sems):
        rings = (dma.Ring(k_buffers, sems.at[0], name="mla.kv.k"),
                 dma.Ring(v_buffers, sems.at[1], name="mla.kv.v"))
        return tile_loop(p, b, position, rings, windows, update, carry, indices)

    final = pl.run_scoped(scoped, pltpu.VMEM((2, p.n_heads, p.kv_tile, p.k_padded), jnp.bfloat16),
                          pltpu.VMEM((2, p.n_heads, p.kv_tile, p.v_dim), jnp.bfloat16),
                          pltpu.SemaphoreType.DMA((2, 2)))
    return [acc / norm for _, norm, acc in final]


def _attend_latent(p, b, position, q_row, c_hat, k_extra, w_kvb_vmem, ckv_hbm, kx_hbm, indices):
    """All heads at once over latent tiles ĉ [T, kv_rank], k^X [T, extra], W_kvb absorbed."""
    nope, qk, width = p.qk_nope, p.qk_dim, p.qk_nope + p.v_dim

    def scoped(q_lat_scratch, q_x_scratch):
        for h in range(p.n_heads):  # q_lat_h = q^C_h W_kvbK_hᵀ  [1, kv_rank]
            w_k = w_kvb_vmem[:, h * width:h * width + nope]  # [kv_rank, nope]
            q_lat_scratch[h:h + 1, :] = f32(bf16(dot_t(bf16(q_row[h][:, :nope]), w_k)))
            q_x_scratch[h:h + 1, :] = q_row[h][:, nope:qk]
        # bf16-exact f32 values: q̃ is rounded to bf16 like the reference, so the score matmuls
        # take bf16 operands (one MXU pass on a TPU)
        q_lat, q_x = q_lat_scratch[...], q_x_scratch[...]  # [H, kv_rank], [H, extra]
        c_new = f32(c_hat)  # [1, kv_rank]
        score = (blocks.ordered_sum(q_lat * c_new, keepdims=True)
                 + blocks.ordered_sum(q_x * f32(k_extra), keepdims=True)) * p.scale  # [H, 1]
        carry = (score, jnp.ones_like(score), jnp.broadcast_to(c_new, q_lat.shape))
        _, norm, acc = latent_partial(p, b, position, q_lat, q_x, ckv_hbm, kx_hbm, carry, indices)
        context = bf16(acc / norm)  # [H, kv_rank]: Σ α ĉ, the latent of the head outputs
        return [jnp.dot(context[h:h + 1, :], w_kvb_vmem[:, h * width + nope:(h + 1) * width],
                        preferred_element_type=jnp.float32)  # o_h = (Σ α ĉ) W_kvbV_h  [1, v]
                for h in range(p.n_heads)]

    return pl.run_scoped(scoped, pltpu.VMEM((p.n_heads, p.kv_rank), jnp.float32),
                         pltpu.VMEM((p.n_heads, p.qk_extra), jnp.float32))


def latent_partial(p: MlaPlan, b, count, q_lat, q_x, ckv_hbm, kx_hbm, carry, indices):
    """The online-softmax state of all heads over latent cache tokens 0..count-1 of row b.

    q_lat [H, kv_rank], q_x [H, extra]: the absorbed queries (bf16-exact f32); ckv_hbm
    [B, S, kv_rank], kx_hbm [B, S, extra] in HBM; carry (m [H, 1], norm [H, 1], acc [H, kv_rank])
    to continue from. Reads those tokens' rows (`rows_read`) tile by tile, double-buffered.
    """

    def windows(t):
        tokens = pl.ds(pl.multiple_of(t * p.kv_tile, p.kv_tile), p.kv_tile)
        return ckv_hbm.at[b, tokens, :], kx_hbm.at[b, tokens, :]  # [T, kv_rank], [T, extra]

    def update(t, tiles, carry):
        c_tile, x_tile = tiles  # [T, kv_rank], [T, extra] bf16
        scores = (dot_t(bf16(q_lat), c_tile) + dot_t(bf16(q_x), x_tile)) * p.scale  # [H, T]
        return online_softmax_step(p, t, count, scores, f32(c_tile), carry)

    def scoped(c_buffers, x_buffers, sems):
        rings = (dma.Ring(c_buffers, sems.at[0], name="mla.kv.ckv"),
                 dma.Ring(x_buffers, sems.at[1], name="mla.kv.kx"))
        return tile_loop(p, b, count, rings, windows, update, carry, indices)

    return pl.run_scoped(scoped, pltpu.VMEM((2, p.kv_tile, p.kv_rank), jnp.bfloat16),
                         pltpu.VMEM((2, p.kv_tile, p.qk_extra), jnp.bfloat16),
                         pltpu.SemaphoreType.DMA((2, 2)))


def _patch_block(b, row_in_block, window_in, window_out, buffer, sem, patch, name, indices):
    """Read the aligned UPDATE_ROWS block around the new position, patch its row, write it back."""
    dma.Copy(window_in, buffer, sem, name=f"{name}.read", row=b, **indices).start().wait()
    rows = jax.lax.broadcasted_iota(jnp.int32, buffer.shape, len(buffer.shape) - 2)
    patch(rows == row_in_block)
    dma.Copy(buffer, window_out, sem, name=f"{name}.write", row=b, **indices).start().wait()


def _update_window(position):
    start = pl.multiple_of(jax.lax.div(position, UPDATE_ROWS) * UPDATE_ROWS, UPDATE_ROWS)
    return start, pl.ds(start, UPDATE_ROWS)


def _update_expanded(p, b, position, k_c, k_extra, v_new, k_in, v_in, k_out, v_out, indices):
    """Write K = [k^C | k^X | 0] and V of the new token at `position` for every head."""
    start, rows = _update_window(position)
    pad = p.k_padded - p.qk_dim

    def scoped(k_block, v_block, sems):  # [H, 16, k_padded], [H, 16, v]
        def patch_k(is_new):
            parts = [k_c, [k_extra] * p.n_heads]
            if pad:
                parts.append([jnp.zeros((1, pad), jnp.bfloat16)] * p.n_heads)
            entry = jnp.stack([jnp.concatenate(row, axis=-1) for row in zip(*parts)])  # [H,1,kp]
            k_block[...] = jnp.where(is_new, entry, k_block[...])

        def patch_v(is_new):
            v_block[...] = jnp.where(is_new, jnp.stack(v_new), v_block[...])  # [H, 1, v]

        _patch_block(b, position - start, k_in.at[b, :, rows, :], k_out.at[b, :, rows, :],
                     k_block, sems.at[0], patch_k, "mla.kv_update.k", indices)
        _patch_block(b, position - start, v_in.at[b, :, rows, :], v_out.at[b, :, rows, :],
                     v_block, sems.at[1], patch_v, "mla.kv_update.v", indices)

    pl.run_scoped(scoped, pltpu.VMEM((p.n_heads, UPDATE_ROWS, p.k_padded), jnp.bfloat16),
                  pltpu.VMEM((p.n_heads, UPDATE_ROWS, p.v_dim), jnp.bfloat16),
                  pltpu.SemaphoreType.DMA((2,)))


def _update_latent(p, b, position, c_hat, k_extra, ckv_in, kx_in, ckv_out, kx_out, indices):
    """Write ĉ and k^X of the new token at `position` (one entry for all heads)."""
    start, rows = _update_window(position)

    def scoped(c_block, x_block, sems):  # [16, kv_rank], [16, extra]
        def patch_c(is_new):
            c_block[...] = jnp.where(is_new, c_hat, c_block[...])

        def patch_x(is_new):
            x_block[...] = jnp.where(is_new, k_extra, x_block[...])

        _patch_block(b, position - start, ckv_in.at[b, rows, :], ckv_out.at[b, rows, :],
                     c_block, sems.at[0], patch_c, "mla.kv_update.ckv", indices)
        _patch_block(b, position - start, kx_in.at[b, rows, :], kx_out.at[b, rows, :],
                     x_block, sems.at[1], patch_x, "mla.kv_update.kx", indices)

    pl.run_scoped(scoped, pltpu.VMEM((UPDATE_ROWS, p.kv_rank), jnp.bfloat16),
                  pltpu.VMEM((UPDATE_ROWS, p.qk_extra), jnp.bfloat16),
                  pltpu.SemaphoreType.DMA((2,)))


# ---- the wrapper --------------------------------------------------------------------------------


def cache_shapes(cfg: ModelConfig, batch: int, seq_len: int) -> dict[str, tuple[int, ...]]:
    h = cfg.n_heads
    if cfg.mla_cache_layout == "expanded":
        return {"k": (batch, h, seq_len, cfg.mla_k_padded), "v": (batch, h, seq_len, cfg.mla_v_dim)}
    return {"ckv": (batch, seq_len, cfg.mla_kv_rank), "kx": (batch, seq_len, cfg.mla_qk_extra)}


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, qk, v = cfg.n_heads, cfg.mla_qk_dim, cfg.mla_v_dim
    return {"w_qa": (cfg.d_model, cfg.mla_q_rank), "q_norm": (cfg.mla_q_rank,),
            "w_qb": (cfg.mla_q_rank, h * qk), "w_kva": (cfg.d_model, cfg.mla_latent_cache_dim),
            "kv_norm": (cfg.mla_kv_rank,), "w_kvb": (cfg.mla_kv_rank, h * (cfg.mla_qk_nope + v)),
            "w_g": (cfg.d_model, h * v), "w_o": (h * v, cfg.d_model)}


def _check_cache(cache: Any, label: str, cfg: ModelConfig, batch: int) -> int:
    """ValueError naming `label` for bad keys, shapes or dtypes of a (layout cfg) cache or cache
    shard; returns its length."""
    names = CACHE_NAMES[cfg.mla_cache_layout]
    if not isinstance(cache, dict) or set(cache) != set(names):
        raise ValueError(f"{label} has keys {sorted(cache) if isinstance(cache, dict) else cache!r}"
                         f": expected {names} for mla_cache_layout={cfg.mla_cache_layout!r}")
    seq_len = cache[names[0]].shape[-2]
    for name, shape in cache_shapes(cfg, batch, seq_len).items():
        if tuple(cache[name].shape) != shape:
            raise ValueError(f"{label}[{name!r}] has shape {tuple(cache[name].shape)}: expected "
                             f"{shape} (batch {batch}, length {seq_len})")
        if cache[name].dtype != jnp.bfloat16:
            raise ValueError(f"{label}[{name!r}].dtype={cache[name].dtype} is invalid: bfloat16")
    return seq_len


def check_inputs(p: dict, x: Any, cache: dict, positions: Any, cfg: ModelConfig) -> int:
    """ValueError naming the parameter for bad shapes, dtypes or positions; returns the cache
    length."""
    if cfg.mla_cache_layout not in MLA_CACHE_LAYOUTS:
        raise ValueError(f"cfg.mla_cache_layout={cfg.mla_cache_layout!r} is invalid: one of "
                         f"{MLA_CACHE_LAYOUTS}")
    if getattr(x, "ndim", None) != 2 or x.shape[1] != cfg.d_model:
        raise ValueError(f"x has shape {getattr(x, 'shape', None)}: expected [B, d={cfg.d_model}]")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x.dtype={x.dtype} is invalid: bfloat16 (the normalised input)")
    batch = x.shape[0]
    for name, shape in weight_shapes(cfg).items():
        w = p.get(name) if isinstance(p, dict) else None
        if w is None or tuple(w.shape) != shape:
            raise ValueError(f"p[{name!r}] has shape {getattr(w, 'shape', None)}: expected {shape}")
        if w.dtype != jnp.bfloat16:
            raise ValueError(f"p[{name!r}].dtype={w.dtype} is invalid: bfloat16")
    seq_len = _check_cache(cache, "cache", cfg, batch)
    if getattr(positions, "shape", None) != (batch,):
        raise ValueError(f"positions has shape {getattr(positions, 'shape', None)}: "
                         f"expected [B={batch}]")
    if positions.dtype != jnp.int32:
        raise ValueError(f"positions.dtype={positions.dtype} is invalid: int32")
    if not isinstance(positions, jax.core.Tracer):  # concrete: check every row's position
        values = np.asarray(positions)
        if values.min() < 0 or values.max() >= seq_len:
            raise ValueError(f"positions={values.tolist()} is invalid: each in [0, {seq_len}) — "
                             f"the cache holds {seq_len} tokens, too short for position "
                             f"{int(values.max())}")
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
    weights = [p[name].reshape(1, -1) if p[name].ndim == 1 else p[name] for name in WEIGHT_NAMES]
    out, cache_a, cache_b = _call(plan, tpu.interpret_params(), dma.is_recording(),
                                  tuple(sorted(indices.items())), positions, x, *weights,
                                  cache[names[0]], cache[names[1]])
    return out, {names[0]: cache_a, names[1]: cache_b}


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _call(plan: MlaPlan, interpret: Any, recording: bool, indices: tuple, positions, x, *operands):
    del recording  # a static argument only so recorded and silent traces are cached apart
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    n_in = 2 + len(operands)
    cache_a, cache_b = operands[-2:]
    out = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    # KV bytes for every row at the cache's last position: the whole cache (kernels/costs.py)
    cost = costs.mla(plan, dict(zip(WEIGHT_NAMES, operands[:-2])), (cache_a, cache_b))
    return pl.pallas_call(
        functools.partial(mla_attention_body, plan, **dict(indices)),
        out_shape=(out, jax.ShapeDtypeStruct(cache_a.shape, cache_a.dtype),
                   jax.ShapeDtypeStruct(cache_b.shape, cache_b.dtype)),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)]
        + [hbm] * len(operands),
        out_specs=(pl.BlockSpec(memory_space=pltpu.VMEM), hbm, hbm),
        input_output_aliases={n_in - 2: 1, n_in - 1: 2},
        cost_estimate=cost.estimate(positions, x, out),
        interpret=interpret,
    )(positions, x, *operands)


# ---- the latent cache sharded by sequence --------------------------------------------------------
#
# The latent cache has no head axis, so with heads sharded (3 per rank) every rank would read the
# whole latent: only 2x fewer bytes than its 3 heads of expanded K, V. Sharding the latent cache by
# SEQUENCE over the ranks instead gives each rank 1/n of the tokens, for all heads:
#   1. each head's owner absorbs its queries (q̃ = bf(q^C W_kvbKᵀ), q^X) and all ranks all-gather
#      them: [B, H_all, kv_rank + extra], a few KB;
#   2. every rank runs `mla_latent_partial` over its shard: the online-softmax state (m, norm, acc)
#      of all heads over the shard's tokens <= the row's position (the shard holding the position
#      has written the new entry first, as `mla_attention` does);
#   3. the states are merged across ranks (`combine_partials`, a log-sum-exp merge) and each head's
#      owner finishes: o_h = bf(bf(acc / norm) W_kvbV_h), the gate and W_o.
# On one device the collectives are left out: the shards are run one after the other and merged in
# plain JAX.

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
    return _partial_call(plan, tpu.interpret_params(), dma.is_recording(),
                         tuple(sorted(indices.items())), positions, jnp.asarray(shard_start),
                         q_absorbed, q_extra, cache_shard["ckv"], cache_shard["kx"])


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
    _check_cache(cache_shard, "cache_shard", cfg.replace(mla_cache_layout="latent"), batch)
    if getattr(positions, "shape", None) != (batch,) or positions.dtype != jnp.int32:
        raise ValueError(f"positions has shape {getattr(positions, 'shape', None)} and dtype "
                         f"{getattr(positions, 'dtype', None)}: expected [B={batch}] int32")
    if not isinstance(shard_start, jax.core.Tracer) and (
            np.ndim(shard_start) != 0 or int(shard_start) < 0):
        raise ValueError(f"shard_start={shard_start!r} is invalid: an int >= 0 (the global index "
                         f"of the shard's first token)")
    return batch, n_heads


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _partial_call(plan: MlaPlan, interpret: Any, recording: bool, indices: tuple, positions,
                  shard_start, q_absorbed, q_extra, ckv, kx):
    del recording  # static only so recorded and silent traces are cached apart
    # tokens of this shard each row attends to: global tokens shard_start..position
    counts = jnp.clip(positions + 1 - shard_start, 0, plan.seq_len).astype(jnp.int32)
    vmem, hbm = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)
    stat = jax.ShapeDtypeStruct((plan.batch, plan.n_heads, 1), jnp.float32)
    out_shape = (stat, stat,
                 jax.ShapeDtypeStruct((plan.batch, plan.n_heads, plan.kv_rank), jnp.float32))
    # KV bytes for every row attending to the whole shard (kernels/costs.py)
    cost = costs.mla_partial(plan, (ckv, kx))
    return pl.pallas_call(
        functools.partial(mla_latent_partial_body, plan, **dict(indices)),
        out_shape=out_shape,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), vmem, vmem, hbm, hbm],
        out_specs=(vmem, vmem, vmem),
        cost_estimate=cost.estimate(counts, q_absorbed, q_extra, out_shape),
        interpret=interpret,
    )(counts, q_absorbed, q_extra, ckv, kx)


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


# ---- KV traffic ---------------------------------------------------------------------------------


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes of one cached token of one layer, as this kernel reads it (all heads of cfg)."""
    if cfg.mla_cache_layout == "expanded":
        return cfg.n_heads * (cfg.mla_k_padded + cfg.mla_v_dim) * 2
    return cfg.mla_latent_cache_dim * 2


def kv_tile_bytes_needed(positions: Any, cfg: ModelConfig) -> int:
    """KV bytes the cached tokens 0..p_b-1 of every row take, in the 16-row HBM tiles a DMA
    reads: Σ_b ⌈p_b / 16⌉ · 16 tokens (what `mla_attention` reads, whatever cfg.kv_tile)."""
    tokens = sum(rows_read(int(position)) for position in np.asarray(positions))
    return tokens * kv_bytes_per_token(cfg)


def kv_bytes_at(log: dma.DmaLog, recorded: ModelConfig, target: ModelConfig) -> int:
    """The KV tile bytes of a recorded run, rescaled to another config's per-token bytes.

    The log counts the tokens read (its KV tile bytes over `recorded`'s bytes per token); the
    same tokens at `target`'s shapes (heads, ranks, layout) cost `target`'s bytes per token.
    """
    return tokens_read(log, recorded) * kv_bytes_per_token(target)


def tokens_read(log: dma.DmaLog, recorded: ModelConfig, row: int | None = None) -> int:
    """The tokens whose KV tiles a recorded run read (all rows, or batch row `row`): its KV tile
    bytes over `recorded`'s bytes per token; ValueError if that is not a whole number."""
    nbytes = log.dma_bytes("mla.kv.") if row is None else kv_bytes_by_row(log).get(row, 0)
    tokens, remainder = divmod(nbytes, kv_bytes_per_token(recorded))
    if remainder:
        raise ValueError(f"recorded={recorded.name!r} does not match the log: its KV bytes are not "
                         f"a whole number of {recorded.mla_cache_layout} tokens")
    return tokens


def kv_bytes_by_row(log: dma.DmaLog) -> dict[int, int]:
    """KV tile bytes each batch row read, from the log's `row` index."""
    by_row: dict[int, int] = {}
    for event in log.select("dma_start", "mla.kv."):
        by_row[event.indices["row"]] = by_row.get(event.indices["row"], 0) + event.nbytes
    return by_row


def kv_bytes_per_rank(logs: dict, recorded: ModelConfig, target: ModelConfig, n_ranks: int,
                      row: int) -> dict[str, int]:
    """KV bytes one rank reads per MLA layer per step at `target` (per-rank shapes, context
    target.max_seq_len), scaled from the DMA logs of a run at `recorded` (mini) shapes.

    logs: "expanded" and "latent" — `mla_attention` runs (heads sharded: a rank reads every token
    for its heads); "latent-sequence" — a list of `mla_latent_partial` runs, one per shard. `row`
    is a batch row at the last position, so it attends to the whole recorded context. Each log
    gives the share of that context one rank reads (its busiest shard for "latent-sequence", as a
    share of len(shards) shards rescaled to n_ranks); `target` prices that share of its context
    at its bytes per token (heads of target.n_heads for expanded, the whole latent otherwise).
    """
    from fractions import Fraction

    def share(log, layout):
        return Fraction(tokens_read(log, recorded.replace(mla_cache_layout=layout), row),
                        recorded.max_seq_len)

    shards = logs["latent-sequence"]
    shares = {"expanded": share(logs["expanded"], "expanded"),
              "latent": share(logs["latent"], "latent"),
              "latent-sequence": max(share(log, "latent") for log in shards)
              * Fraction(len(shards), n_ranks)}
    tokens = {name: value * target.max_seq_len for name, value in shares.items()}
    if any(value.denominator != 1 for value in tokens.values()):
        raise ValueError(f"target.max_seq_len={target.max_seq_len} is invalid: the shares "
                         f"{ {k: str(v) for k, v in shares.items()} } of it must be whole tokens")
    return {name: int(tokens[name]) * kv_bytes_per_token(
        target.replace(mla_cache_layout="expanded" if name == "expanded" else "latent"))
        for name in tokens}


FIGURE_POSITIONS = (0, 17, 32, 45, 64, 90, 100, 127)  # 0, tile boundaries and in-between


def record_kv_logs(cfg: ModelConfig, positions=FIGURE_POSITIONS, seed: int = 0) -> dict:
    """Run both layouts once at `cfg` (mini) shapes, one row per position; their DMA logs."""
    from mkresearch import reference, weights

    params = reference.layer_params(weights.init_params(cfg, seed)["mla"], 0)
    batch = len(positions)
    x = jax.random.normal(jax.random.key(seed), (batch, cfg.d_model)).astype(jnp.bfloat16)
    logs = {}
    for layout in MLA_CACHE_LAYOUTS:
        layout_cfg = cfg.replace(mla_cache_layout=layout)
        cache = {name: jnp.zeros(shape, jnp.bfloat16)
                 for name, shape in cache_shapes(layout_cfg, batch, cfg.max_seq_len).items()}
        with dma.recording() as logs[layout]:
            jax.block_until_ready(mla_attention(params, x, cache, jnp.asarray(positions, jnp.int32),
                                                layout_cfg))
    return logs


def plot_kv_bytes(path=None, logs: dict | None = None, recorded: ModelConfig | None = None,
                  positions=FIGURE_POSITIONS):
    """KV bytes read per MLA layer per step against context, both layouts, at Kimi K3 shapes.

    Dots: the tokens each row of a recorded mini run read (from its DMA log), priced at Kimi K3's
    bytes per token. Solid lines: the rule ⌈p / 16⌉ · 16 tokens (16-row HBM tiles) out to 32768;
    dashed: whole KV tiles of Kimi K3's 256 tokens, what reading the last tile whole would cost.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mkresearch.config import get_config

    recorded = recorded or get_config("kimi-k3-mini")
    logs = logs or record_kv_logs(recorded, positions)
    full = get_config("kimi-k3")
    context = np.unique(np.geomspace(1, full.max_seq_len, 400).astype(int))
    fig, ax = plt.subplots(figsize=(7, 4))
    for layout, color in zip(MLA_CACHE_LAYOUTS, ("tab:red", "tab:blue")):
        source, target = recorded.replace(mla_cache_layout=layout), full.replace(
            mla_cache_layout=layout)
        per_token = kv_bytes_per_token(target)
        for tile, style, rule in ((KV_ROW_GROUP, "-", "16-row groups (read)"),
                                  (full.kv_tile, "--", f"whole tiles of {full.kv_tile}")):
            ax.plot(context, -(-context // tile) * tile * per_token, style, color=color, lw=1,
                    label=f"{layout}: {per_token:,} B/token, {rule}")
        measured = [(positions[r], tokens_read(logs[layout], source, r) * per_token)
                    for r in range(len(positions))]
        xs, ys = zip(*[(pos, y) for pos, y in measured if pos > 0])
        ax.scatter(xs, ys, color=color, zorder=3, s=18,
                   label=f"{layout}: DMA log of a mini run, priced at Kimi K3")
    ax.set(xscale="log", yscale="log", xlabel="context (cached tokens)",
           ylabel="KV bytes read per MLA layer per step",
           title="MLA KV traffic at Kimi K3 shapes (96 heads): latent reads 64x less")
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig
