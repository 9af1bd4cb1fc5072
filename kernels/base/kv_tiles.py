"""The KV tile loop of the attention kernels: tiles of T cached tokens read from HBM by a
double-buffered DMA ring, and the f32 online softmax over them.

`tile_loop` reads only the 16-row groups of the last tile that hold cached tokens (`_tile_reads`,
`mkresearch.model.kv_cache.rows_read` in bytes); `online_softmax_step` masks what lies past the
position. MLA's expanded and latent layouts (`mla.py`), GQA (`gqa.py`) and the sequence-sharded
latent prototype (`mla_sharded.py`) all run them.

Where a row's tokens are is a `KvRows`: contiguous (row b's slots of a cache [B, (H,) S, n]), or
paged (`mkresearch.model.paged_kv`: a pool [N, (H,) P, n] and the page table in SMEM, token t of
row b at slot t mod P of page table[b, t div P]). The paged reads are the contiguous ones (the
same 16-row groups, the same bytes) split at page boundaries: a read never crosses a page.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from mkresearch.kernels.base import blocks, dma, planned

from mkresearch.model import numerics, reference
from mkresearch.model.kv_cache import KV_ROW_GROUP

# An attention stage's plan (kernels/stages/mla.py's MlaPlan; the tile loop reads its fields): named,
# not imported, since the stages stand on this module.
MlaPlan = Any


def _tile_count(p: MlaPlan, position):
    """⌈position / T⌉: the tiles holding the cached tokens 0..position-1 (lax.div: jnp's //
    lowers through a sign op)."""
    return jax.lax.div(position + p.kv_tile - 1, p.kv_tile)


def _tile_reads(p: MlaPlan, t, count):
    """How tile t is read, as [(condition, first row, rows)]: the whole tile when it holds no
    token past count - 1, else only the ⌈r / 16⌉ 16-row groups holding its r = count - t·T
    tokens. A DMA's size is static, so those groups go as runs of 2^i groups, largest first (the
    binary digits of the group count): at most log2(T / 16) + 1 DMAs, each under its condition."""
    div, n_groups = jax.lax.div, p.kv_tile // KV_ROW_GROUP
    tokens = jnp.minimum(count - t * p.kv_tile, p.kv_tile)  # >= 1 for every tile of the loop
    groups = div(tokens + KV_ROW_GROUP - 1, KV_ROW_GROUP)
    reads = [(groups == n_groups, 0, p.kv_tile)]
    for i in reversed(range((n_groups - 1).bit_length())):  # runs of 2^i groups, i descending
        run = 2 ** i
        has_run = (groups < n_groups) & (jax.lax.rem(div(groups, run), 2) == 1)
        first = div(groups, 2 * run) * (2 * run * KV_ROW_GROUP)  # the longer runs' rows
        reads.append((has_run, pl.multiple_of(first, KV_ROW_GROUP), run * KV_ROW_GROUP))
    return reads


def _token_rows(ref, rows):
    """ref[..., rows, :]: a window of the token axis (the second-to-last) of a cache ref."""
    return ref.at[(slice(None),) * (len(ref.shape) - 2) + (rows, slice(None))]


def _row_window(cache, row, tokens):
    """cache[row, ..., tokens, :]: a token window of one row (or page) of a cache ref
    [B, (H,) S, n]."""
    return cache.at[(row,) + (slice(None),) * (len(cache.shape) - 3) + (tokens, slice(None))]


@dataclass(frozen=True)
class KvRows:
    """Where the cached tokens of a row are. Contiguous (table None): slots 0..S-1 of row b of a
    cache ref [B, (H,) S, n]. Paged: table the page table [B · columns] i32 (SMEM, row-major),
    the cache ref a pool [N, (H,) page_size, n]; token t of row b is slot t mod page_size of page
    table[b · columns + t div page_size]. A paged row at position -1 is a free slot: it reads no
    page (no tile) and writes none (`guard`)."""

    table: Any = None
    page_size: int = 0
    columns: int = 0

    @property
    def paged(self) -> bool:
        return self.table is not None

    def window(self, cache, b, start, rows: int):
        """Tokens start..start+rows-1 of row b ([.., rows, n]); paged: inside one page (start a
        multiple of 16, rows at most what is left of its page)."""
        if not self.paged:
            return _row_window(cache, b, pl.ds(start, rows))
        page = self.table[b * self.columns + jax.lax.div(start, self.page_size)]
        offset = pl.multiple_of(jax.lax.rem(start, self.page_size), KV_ROW_GROUP)
        return _row_window(cache, page, pl.ds(offset, rows))

    def tile_window(self, cache, b, t, kv_tile: int, first, rows: int):
        """Rows first..first+rows-1 of KV tile t of row b (contiguous: a window of the tile's
        window, as the kernels always read it)."""
        if not self.paged:
            tokens = pl.ds(pl.multiple_of(t * kv_tile, kv_tile), kv_tile)
            return _token_rows(_row_window(cache, b, tokens), pl.ds(first, rows))
        return self.window(cache, b, t * kv_tile + first, rows)

    def pieces(self, rows: int) -> list[tuple[int, int]]:
        """A read of `rows` rows as (offset, rows) pieces that each stay in one page: reads are
        runs of 2^i 16-row groups aligned to their size (or whole tiles), pages 16 · 2^j rows."""
        if not self.paged or rows <= self.page_size:
            return [(0, rows)]
        return [(k * self.page_size, self.page_size) for k in range(rows // self.page_size)]

    def guard(self, position, write) -> None:
        """write() for a row with a cache slot; paged, a free slot (position -1) writes none."""
        if self.paged:
            pl.when(position >= 0)(write)
        else:
            write()


CONTIGUOUS = KvRows()


def window_first_tile(p: MlaPlan, position, window: int):
    """The first KV tile a sliding window of `window` tokens reads at `position`: the tile of
    slot max(0, p − window + 1) (the window's oldest; every tile before it is outside)."""
    return jax.lax.div(jnp.maximum(position - window + 1, 0), p.kv_tile)


def tile_loop(p: MlaPlan, b: int, count, rings, caches, update, carry, indices, *,
              phase: str = "mla.attend", kv_rows: KvRows = CONTIGUOUS, first_tile=None):
    """Double-buffered loop over the KV tiles holding tokens 0..count-1: tile t+1 flies while
    tile t is used. The last tile reads only the 16-row groups holding tokens < count
    (`_tile_reads`); its other rows keep stale or uninitialised values, masked by `update`.

    rings: dma.Ring per cache array; caches: the HBM refs of the arrays (tokens on the
    second-to-last axis), read where `kv_rows` says (contiguous, or through the page table: a
    read split at page boundaries, `KvRows.pieces`); update(t, tiles, carry) -> carry, with tiles
    the VMEM values of tile t ([.., T, ..] whole, rows past count unread). `phase` names the
    compute phase of each tile in the DMA log. p: any plan with a kv_tile (MLA's, GQA's).
    first_tile: the first tile read (a sliding window's, `window_first_tile`; None: tile 0),
    the tiles before it neither read nor computed.
    """
    n_tiles = _tile_count(p, count)

    def read(t, slot, action, first, rows):  # start or wait rows first.. of tile t, each array
        for offset, piece in kv_rows.pieces(rows):
            for ring, cache in zip(rings, caches):
                source = kv_rows.tile_window(cache, b, t, p.kv_tile, first + offset, piece)
                target = _token_rows(ring.buffer(slot), pl.ds(first + offset, piece))
                copy = dma.Copy(source, target, ring.sems_ref.at[slot], name=ring.name,
                                slot=slot, buffer=planned.KV_TILES, row=b, tile=t, **indices)
                getattr(copy, action)()

    def each_read(t, slot, action):  # action: "start" or "wait" every DMA of tile t
        for condition, first, rows in _tile_reads(p, t, count):
            pl.when(condition)(functools.partial(read, t, slot, action, first, rows))

    if first_tile is None:
        @pl.when(n_tiles > 0)
        def _():
            each_read(0, 0, "start")
    else:  # a window: its first tile into the slot of its parity
        @pl.when(n_tiles > first_tile)
        def _():
            each_read(first_tile, jax.lax.rem(first_tile, 2), "start")

    def step(t, carry):
        slot = jax.lax.rem(t, 2)

        @pl.when(t + 1 < n_tiles)
        def _():
            each_read(t + 1, 1 - slot, "start")

        each_read(t, slot, "wait")
        tiles = [ring.buffer(slot)[...] for ring in rings]
        with dma.phase(phase, row=b, tile=t, **indices):
            return update(t, tiles, carry)

    return jax.lax.fori_loop(0 if first_tile is None else first_tile, n_tiles, step, carry)


def online_softmax_step(p: MlaPlan, t, position, scores, values, carry, *,
                        padded: bool = False):
    """One tile of the f32 online softmax: scores [R, T], values [T, n]; carry (m, norm, acc).

    padded: the R rows are heads whose count differs between one device and a rank (the latent
    layout's all-heads-at-once product): they are padded to a multiple of 8 rows, so that a head
    sums in one order whatever the head count (`reference.padded_rows`)."""
    m, norm, acc = carry
    token = t * p.kv_tile + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    valid = token < position  # the tile's tail past the cached tokens is stale: masked
    window = getattr(p, "window", 0)  # a sliding window: slots before it count nothing
    if window:
        valid = valid & (token > position - window)
    scores = jnp.where(valid, scores, -jnp.inf)
    # rows past the cached tokens may be unread (uninitialised, even NaN): 0 · NaN = NaN, so the
    # values are selected too; a valid row is unchanged and a masked one added 0 before as well
    row_token = t * p.kv_tile + jax.lax.broadcasted_iota(jnp.int32, values.shape, 0)
    values = jnp.where(row_token < position, values, 0.0)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))  # finite: m starts finite
    correction = jnp.exp(m - m_new)
    weights = jnp.where(valid, jnp.exp(scores - m_new), 0.0)
    norm = correction * norm + blocks.ordered_sum(weights, keepdims=True)
    weighted = (blocks.dot(weights, values) if padded
                else jnp.dot(weights, values, preferred_element_type=jnp.float32,
                             precision=numerics.precision_for(weights, values)))  # [R, n]
    acc = correction * acc + weighted
    return m_new, norm, acc


def dot_t(a, b):
    """a [M, K] · b [N, K]ᵀ -> [M, N] f32 (contract the last dims: no transpose in VMEM)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=numerics.precision_for(a, b))


def rows_dot_t(a, b):
    """`dot_t` with a's rows padded to a multiple of 8 (`reference.padded_rows`): a row's bits do
    not depend on how many rows a has. XLA:CPU sums a one-row product in another order, so
    without it the latent layout's scores of a rank's one head differ from that head's row of
    the two-head product on one device (issue 22), and GQA's of a rank's one query head from its
    row of the K/V head's four (Qwen3's mini on 4 and 8 ranks, issue 79)."""
    return reference.padded_rows(lambda rows: dot_t(rows, b), a)
