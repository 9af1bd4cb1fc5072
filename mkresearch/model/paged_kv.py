"""A paged KV cache: per attention layer a pool of pages of P tokens, a page table per row.

Serving engines keep the cache in fixed-size pages (vLLM's paged attention, JAX's ragged paged
attention) so that rows of any length share one pool and a finished row's pages go to the next.
This module is the contract and the reference of that layout (plain JAX, no kernel):

    pages = PagedKVConfig(page_size=P, n_pages=N, max_pages_per_row=M)  # frozen, validated
    pages.check(cfg)                          # P and cfg.kv_tile: one a multiple of the
                                              # other, M·P whole KV tiles

The paged state has the contiguous state's structure (`reference.init_state`), with every CACHE
leaf (MLA expanded k/v, MLA latent ckv/kx, MLA-RoPE ckv/kpe, GQA k/v) a pool and every recurrent
leaf (KDA's conv and recurrent state) kept per row slot:

    contiguous cache leaf  [L_kind, B, *row]        row = the per-row StateLeaf shape, S tokens
    pool leaf              [L_kind, N, *row with S -> P]   e.g. latent ckv [L, N, P, kv_rank],
                                                           expanded k [L, N, H, P, k_padded],
                                                           GQA k [L, N, KV, P, D]
    recurrent leaf         [L_kind, B, ...]         unchanged (a slot keeps its row's state)

    page_table  [B, M] int32   token t of row b is slot t % P of page page_table[b, t // P]
                               (SMEM / scalar-prefetch friendly: one int per page a row uses)
    lengths     [B] int32      tokens row b's cache holds; 0 = a free slot (its table row unread)

A row of length n uses the entries page_table[b, :ceil(n / P)]; the entries past those are never
read (any value, e.g. -1). `validate_page_table` checks a table against the lengths it must serve.

Functions (cfg a ModelConfig, pages a PagedKVConfig):

    paged_state_shapes(cfg, pages, batch) / init_paged_state(cfg, pages, batch)
        the paged state: {kind: {leaf: pool or per-slot array}} (ShapeDtypeStructs / zeros)
    validate_page_table(page_table, lengths, pages)
        ValueError, one line, for: a table not [B, M] int32, lengths not [B] in [0, M·P], an
        entry out of the pool, a page shared by two live rows (or twice by one), a table shorter
        than a row's length needs
    pages_needed(length, page_size) -> ceil(length / P)
    gather_cache(state, page_table, lengths, cfg, pages) -> contiguous state (S = M·P)
        cache leaves read through the table; slots at or past a row's length are zero
    scatter_cache(state, contiguous, page_table, lengths, cfg, pages) -> paged state
        writes the tokens 0..lengths[b]-1 of each row into its pages (the rest of the pool kept);
        recurrent leaves taken from `contiguous`
    paged_from_contiguous(contiguous, page_table, lengths, cfg, pages) -> paged state
        a fresh zero pool with the rows' tokens scattered in (recurrent leaves copied)
    insert_row(state, row_state, slot, page_row, length, cfg, pages) -> paged state
        a joining row prefilled on its own (a one-row contiguous state, e.g. from
        `mkresearch.model.prefill.prefill`): its tokens 0..length-1 into the pages page_row
        [M] (its table row), its recurrent leaves into row slot `slot`; nothing else changes
    paged_decode_step(params, state, tokens, positions, page_table, cfg, pages)
        the reference decode step on a paged state: gather, `reference`'s step, scatter. Equal
        to `reference.decode_step` on the contiguous cache to the bit (the online softmax masks
        every slot past a row's position, so the gathered zeros change nothing).
        positions [B] i32: the slot of each row's new token (= tokens cached before the step);
        -1 marks a free slot: it reads and writes no page (its logits mean nothing, and its
        KDA state is overwritten: clear it with `clear_slots` when a row joins).
        Returns (logits [B, V] f32, new paged state, aux), as `reference.decode_step`.
    clear_slots(state, cfg, slots) -> the state with the per-slot (recurrent) leaves of the
        given row slots zeroed: a joining row starts from the zero state a fresh batch has.
    keep_positions(state_all, per_position, kept, cfg) -> a paged verify step's rollback: the
        recurrent leaves after each row's first kept[b] tokens (caches need none).

The kernel twins (`kernels/compose/megakernel_paged.py`): paged_decode_step and
paged_verify_step, the megakernel's one pallas_call per step on this state and table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkresearch.model import reference, spec
from mkresearch.model.config import ModelConfig
from mkresearch.model.kv_cache import KV_ROW_GROUP
from mkresearch.model.numerics import i32


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= 1


@dataclass(frozen=True)
class PagedKVConfig:
    """The page pool of every attention layer: `n_pages` pages of `page_size` tokens, and page
    tables of `max_pages_per_row` columns (the longest row: max_pages_per_row · page_size).

    page_size is 16 · 2^j: a DMA window of a bf16 HBM array starts and ends on its 16-row tiles,
    so a page is whole tiles, and the kernels' reads (runs of 2^i 16-row groups, aligned to
    their size) each stay within one page."""

    page_size: int
    n_pages: int
    max_pages_per_row: int

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not _positive_int(value):
                raise ValueError(f"PagedKVConfig.{field.name}={value!r} is invalid: an int >= 1")
        groups, rest = divmod(self.page_size, KV_ROW_GROUP)
        if rest or groups & (groups - 1):
            raise ValueError(f"PagedKVConfig.page_size={self.page_size} is invalid: "
                             f"{KV_ROW_GROUP} · 2^j (whole bf16 HBM tiles of {KV_ROW_GROUP} rows, "
                             "so that the kernels' power-of-two reads never cross a page)")

    @property
    def max_context(self) -> int:
        """The longest row a table holds: max_pages_per_row · page_size tokens."""
        return self.max_pages_per_row * self.page_size

    def check(self, cfg: ModelConfig) -> PagedKVConfig:
        """ValueError unless cfg.kv_tile and page_size are one a multiple of the other (the
        kernels read a tile's tokens page by page, or a page tile by tile) and a full table is
        whole KV tiles."""
        spec.check(cfg)
        tile, size = cfg.kv_tile, self.page_size
        if tile % size and size % tile:
            raise ValueError(f"PagedKVConfig.page_size={size} is invalid for {cfg.name}: a "
                             f"divisor or a multiple of cfg.kv_tile={tile}")
        if self.max_context % tile:
            raise ValueError(f"PagedKVConfig.max_pages_per_row={self.max_pages_per_row} is "
                             f"invalid for {cfg.name}: {self.max_pages_per_row} pages of {size} "
                             f"tokens are not whole KV tiles of cfg.kv_tile={tile}")
        return self


def _check_pages(pages: Any) -> PagedKVConfig:
    if not isinstance(pages, PagedKVConfig):
        raise ValueError(f"pages={pages!r} is invalid: a paged_kv.PagedKVConfig")  # noqa: TRY004
    return pages


def pages_needed(length: Any, page_size: int) -> Any:
    """Pages a row of `length` tokens uses: ceil(length / page_size) (ints or arrays)."""
    return -(-length // page_size)


# ---- the paged state ----------------------------------------------------------------------------
def paged_state_shapes(cfg: ModelConfig, pages: PagedKVConfig,
                       batch: int) -> dict[str, dict[str, Any]]:
    """The paged state as jax.ShapeDtypeStruct leaves: each CACHE leaf a pool
    [L_kind, n_pages, *row with its S tokens -> page_size], each recurrent leaf [L_kind, B, ...]."""
    _check_pages(pages).check(cfg)
    out = {}
    for kind, leaves in spec.state_table(cfg, batch, pages.page_size).items():
        out[kind] = {}
        for name, leaf in leaves.items():
            shape = leaf.shape
            if leaf.kind == spec.CACHE:  # the batch axis becomes the page axis
                shape = (shape[0], pages.n_pages, *shape[2:])
            out[kind][name] = jax.ShapeDtypeStruct(shape, leaf.dtype)
    return out


def init_paged_state(cfg: ModelConfig, pages: PagedKVConfig, batch: int) -> dict[str, Any]:
    """A zero paged state for `batch` row slots (every page free, every slot's state zero)."""
    reference.init_state(cfg, batch, 1)  # the batch checks
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                        paged_state_shapes(cfg, pages, batch))


def _cache_leaves(cfg: ModelConfig) -> dict[str, dict[str, int]]:
    """kind -> cache leaf -> its token axis within one row's leaf (the row shape)."""
    return {kind: {name: leaf.token_axis - 2 for name, leaf in leaves.items()
                   if leaf.kind == spec.CACHE}
            for kind, leaves in spec.state_table(cfg, 1, 1).items()}


def clear_slots(state: dict[str, Any], cfg: ModelConfig, slots: Any) -> dict[str, Any]:
    """The paged state with the per-slot (recurrent) leaves of row slots `slots` zeroed."""
    return _clear_slots_jit(state, jnp.asarray(np.reshape(slots, -1), i32), cfg=cfg)


def _clear_slots(state, slots, cfg):
    caches = _cache_leaves(cfg)
    return {kind: {name: (leaf if name in caches.get(kind, {}) else leaf.at[:, slots].set(0))
                   for name, leaf in leaves.items()}
            for kind, leaves in state.items()}


_clear_slots_jit = jax.jit(_clear_slots, static_argnames="cfg")


# ---- the page table -----------------------------------------------------------------------------
def validate_page_table(page_table: Any, lengths: Any, pages: PagedKVConfig) -> None:
    """ValueError (one line) unless page_table [B, M] int32 serves rows of `lengths` [B]: every
    entry a row uses (its first ceil(length / P)) in [0, n_pages), no page used twice, and M
    columns enough for every row. Concrete arrays only (the API boundary, before any jit)."""
    _check_pages(pages)
    table, lengths = np.asarray(page_table), np.asarray(lengths)
    M, P = pages.max_pages_per_row, pages.page_size
    if table.ndim != 2 or table.shape[1] != M or table.dtype != np.int32:
        raise ValueError(f"page_table has shape {table.shape} {table.dtype}: allowed [B, {M}] "
                         "int32 (max_pages_per_row columns)")
    batch = table.shape[0]
    if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths has shape {lengths.shape} {lengths.dtype}: allowed ({batch},) "
                         "ints (tokens each row's cache holds)")
    if lengths.min(initial=0) < 0:
        raise ValueError(f"lengths={lengths.tolist()} is invalid: ints >= 0 (0 = a free slot)")
    needed = pages_needed(lengths, P)
    for b in np.flatnonzero(needed > M):
        raise ValueError(f"page_table row {b} is too short: length {lengths[b]} needs "
                         f"{needed[b]} pages of {P} tokens, the table has {M} columns")
    owner: dict[int, tuple[int, int]] = {}
    for b in range(batch):
        for column, page in enumerate(table[b, :needed[b]].tolist()):
            if not 0 <= page < pages.n_pages:
                raise ValueError(f"page_table[{b}, {column}]={page} is out of the pool: allowed "
                                 f"[0, {pages.n_pages}) (n_pages)")
            if page in owner:
                first = owner[page]
                raise ValueError(f"page_table[{b}, {column}]={page} is shared: page {page} is "
                                 f"already used by row {first[0]} (column {first[1]}); a page "
                                 "belongs to one live row")
            owner[page] = (b, column)


# ---- gather and scatter through the table --------------------------------------------------------
def _gather_leaf(pool: jax.Array, table: jax.Array, lengths: jax.Array, token_axis: int,
                 page_size: int) -> jax.Array:
    """pool [L, N, *row(P)] -> [L, B, *row(S = M·P)]: row b's token t from page table[b, t // P];
    slots at or past lengths[b] (and entries out of the pool) read as zero."""
    n_pages = pool.shape[1]
    batch, n_columns = table.shape
    safe = jnp.clip(table, 0, n_pages - 1)
    pages = pool[:, safe]  # [L, B, M, *row(P)]
    pages = jnp.moveaxis(pages, 2, 2 + token_axis)  # [L, B, ..., M, P, ...]
    shape = pages.shape
    axis = 2 + token_axis
    rows = pages.reshape(*shape[:axis], n_columns * page_size, *shape[axis + 2:])
    slots = jnp.arange(n_columns * page_size)
    valid = slots[None, :] < lengths[:, None]  # [B, S]
    valid = valid.reshape(1, batch, *([1] * token_axis), -1, *([1] * (rows.ndim - axis - 1)))
    return jnp.where(valid, rows, jnp.zeros((), rows.dtype))


def _scatter_leaf(pool: jax.Array, rows: jax.Array, table: jax.Array, lengths: jax.Array,
                  token_axis: int, page_size: int) -> jax.Array:
    """The inverse of `_gather_leaf` on the slots before lengths[b]: rows [L, B, *row(S)] written
    into pool [L, N, *row(P)] through the table; pages and slots not used are left as they are."""
    n_pages = pool.shape[1]
    batch, n_columns = table.shape
    axis = 2 + token_axis
    length = rows.shape[axis]
    if length < n_columns * page_size:  # a shorter contiguous cache: pad (those slots unwritten)
        pad = [(0, 0)] * rows.ndim
        pad[axis] = (0, n_columns * page_size - length)
        rows = jnp.pad(rows, pad)
    rows = rows[(slice(None),) * axis + (slice(0, n_columns * page_size),)]
    shape = rows.shape
    pages = rows.reshape(*shape[:axis], n_columns, page_size, *shape[axis + 1:])
    pages = jnp.moveaxis(pages, axis, 2)  # [L, B, M, *row(P)]
    slots = jnp.arange(n_columns)[:, None] * page_size + jnp.arange(page_size)  # [M, P]
    valid = slots[None] < lengths[:, None, None]  # [B, M, P]
    valid = valid.reshape(1, batch, n_columns, *([1] * token_axis), page_size,
                          *([1] * (pages.ndim - axis - 2)))
    used = jnp.arange(n_columns)[None, :] < pages_needed(lengths, page_size)[:, None]  # [B, M]
    target = jnp.where(used, table, n_pages)  # unused entries point past the pool: dropped
    old = pool[:, jnp.clip(target, 0, n_pages - 1)]  # [L, B, M, *row(P)]
    new = jnp.where(valid, pages.astype(pool.dtype), old)
    return pool.at[:, target].set(new, mode="drop")


def _tables(page_table: Any, lengths: Any) -> tuple[jax.Array, jax.Array]:
    return jnp.asarray(page_table, i32), jnp.asarray(lengths, i32)


def gather_cache(state: dict[str, Any], page_table: Any, lengths: Any, cfg: ModelConfig,
                 pages: PagedKVConfig) -> dict[str, Any]:
    """The contiguous state (caches of S = max_pages_per_row · page_size tokens) of a paged one:
    each row's tokens 0..lengths[b]-1 read through its pages, later slots zero; recurrent leaves
    as they are."""
    table, lengths = _tables(page_table, lengths)
    caches = _cache_leaves(cfg)
    return {kind: {name: (_gather_leaf(leaf, table, lengths, caches[kind][name], pages.page_size)
                          if name in caches.get(kind, {}) else leaf)
                   for name, leaf in leaves.items()}
            for kind, leaves in state.items()}


def scatter_cache(state: dict[str, Any], contiguous: dict[str, Any], page_table: Any,
                  lengths: Any, cfg: ModelConfig, pages: PagedKVConfig) -> dict[str, Any]:
    """The paged `state` with each row's tokens 0..lengths[b]-1 of `contiguous` written into its
    pages (other pages and slots kept) and the recurrent leaves taken from `contiguous`."""
    table, lengths = _tables(page_table, lengths)
    caches = _cache_leaves(cfg)
    return {kind: {name: (_scatter_leaf(leaf, contiguous[kind][name], table, lengths,
                                        caches[kind][name], pages.page_size)
                          if name in caches.get(kind, {}) else contiguous[kind][name])
                   for name, leaf in leaves.items()}
            for kind, leaves in state.items()}


def paged_from_contiguous(contiguous: dict[str, Any], page_table: Any, lengths: Any,
                          cfg: ModelConfig, pages: PagedKVConfig) -> dict[str, Any]:
    """A paged state holding a contiguous state's rows: tokens 0..lengths[b]-1 of row b in the
    pages of page_table[b] (validated), the rest of the pool zero; recurrent leaves copied."""
    validate_page_table(page_table, lengths, pages)
    batch = np.shape(page_table)[0]
    reference.check_state(contiguous, cfg, batch)
    contiguous = jax.tree.map(jnp.copy, contiguous)  # its own buffers: a kernel step donates them
    return scatter_cache(init_paged_state(cfg, pages, batch), contiguous, page_table, lengths,
                         cfg, pages)


def insert_row(state: dict[str, Any], row_state: dict[str, Any], slot: int, page_row: Any,
               length: int, cfg: ModelConfig, pages: PagedKVConfig) -> dict[str, Any]:
    """The paged state with a one-row contiguous state put in: its cache tokens 0..length-1 into
    the pages of page_row [max_pages_per_row] (its entries checked against the pool; that no
    live row holds them is the caller's page allocator's to ensure), its recurrent leaves into
    row slot `slot`. The other rows' pages and slots are untouched."""
    page_row = np.asarray(page_row, np.int32).reshape(1, -1)
    validate_page_table(page_row, np.array([length]), pages)
    reference.check_state(row_state, cfg, 1)
    table, lengths = _tables(page_row, [length])
    return _insert_row_jit(state, row_state, jnp.asarray(slot, i32), table, lengths, cfg=cfg,
                           pages=pages)


def _insert_row(state, row_state, slot, table, lengths, cfg, pages):
    caches = _cache_leaves(cfg)
    return {kind: {name: (_scatter_leaf(leaf, row_state[kind][name], table, lengths,
                                        caches[kind][name], pages.page_size)
                          if name in caches.get(kind, {})
                          else leaf.at[:, slot].set(row_state[kind][name][:, 0]))
                   for name, leaf in leaves.items()}
            for kind, leaves in state.items()}


_insert_row_jit = jax.jit(_insert_row, static_argnames=("cfg", "pages"))


# ---- the reference paged decode step ----------------------------------------------------------
def _paged_step(params, state, tokens, positions, page_table, cfg, pages):
    # the contiguous cache holds the tokens before the step; the step writes slot `position`
    contiguous = gather_cache(state, page_table, jnp.maximum(positions, 0), cfg, pages)
    logits, contiguous, aux = reference.RESIDUAL_STEPS[cfg.residual](
        params, contiguous, tokens, positions, cfg)
    return logits, scatter_cache(state, contiguous, page_table, positions + 1, cfg, pages), aux


_paged_step_jit = jax.jit(_paged_step, static_argnames=("cfg", "pages"))


def check_paged_inputs(state: Any, tokens: Any, positions: Any, page_table: Any,
                       cfg: ModelConfig, pages: PagedKVConfig, *, width: int = 1) -> None:
    """The API boundary of a paged step: ValueError (one line) naming what is wrong with the
    tokens [B], positions (-1 = free slot), page table (for positions + width tokens: a verify
    step writes width = K + 1 per row) or paged state."""
    _check_pages(pages).check(cfg)
    if np.ndim(tokens) != 1:
        raise ValueError(f"tokens has shape {np.shape(tokens)}: allowed [B] (one token per row)")
    batch = np.shape(tokens)[0]
    positions = np.asarray(positions)
    if positions.shape != (batch,) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"positions has shape {positions.shape} {positions.dtype}: allowed "
                         f"({batch},) ints")
    if positions.min() < -1:
        raise ValueError(f"positions={positions.tolist()} is invalid: ints >= -1 (-1 = a free "
                         "slot)")
    if np.shape(page_table)[:1] != (batch,):
        raise ValueError(f"page_table has shape {np.shape(page_table)}: allowed [{batch}, "
                         f"{pages.max_pages_per_row}] (one row per token)")
    validate_page_table(page_table, np.where(positions >= 0, positions + width, 0), pages)
    expected = paged_state_shapes(cfg, pages, batch)
    if not isinstance(state, dict) or set(state) != set(expected):
        raise ValueError(f"state is invalid: allowed the dict made by init_paged_state(cfg, "
                         f"pages, {batch}), with keys {sorted(expected)}")
    for kind, leaves in expected.items():
        if not isinstance(state[kind], dict) or set(state[kind]) != set(leaves):
            raise ValueError(f"state[{kind!r}] is invalid: allowed keys {sorted(leaves)}")
        for name, want in leaves.items():
            got = state[kind][name]
            if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
                raise ValueError(f"state[{kind!r}][{name!r}] has shape {tuple(got.shape)} "
                                 f"{got.dtype}: allowed {tuple(want.shape)} {want.dtype} "
                                 f"({pages.n_pages} pages of {pages.page_size} tokens, batch "
                                 f"{batch})")


def paged_decode_step(params: dict[str, Any], state: dict[str, Any], tokens: Any, positions: Any,
                      page_table: Any, cfg: ModelConfig,
                      pages: PagedKVConfig) -> tuple[jax.Array, dict, dict]:
    """One reference decode step on a paged state (jitted, cfg and pages static): tokens [B],
    positions [B] (-1 = free slot), page_table [B, M] covering positions + 1 tokens per row.
    Returns (logits [B, V] f32, new paged state, aux) as `reference.decode_step`."""
    check_paged_inputs(state, tokens, positions, page_table, cfg, pages)
    return _paged_step_jit(params, state, jnp.asarray(tokens, i32), jnp.asarray(positions, i32),
                           jnp.asarray(page_table, i32), cfg=cfg, pages=pages)


def keep_positions(state_all: dict[str, Any], per_position: dict[str, Any], kept: Any,
                   cfg: ModelConfig) -> dict[str, Any]:
    """A paged verify step's rollback: each slot's recurrent leaves after its first kept[b]
    (1..K + 1) tokens, from per_position {kind: {leaf: [K+1, L, B, ...]}}. The caches are kept
    as they are: entries past a row's new length are never read (each row attends below its
    position) and the row's next tokens overwrite them."""
    kept, per_position = np.asarray(kept), per_position or {}
    widths = [leaf.shape[0] for leaves in per_position.values() for leaf in leaves.values()]
    width = widths[0] if widths else None  # a model without recurrent leaves keeps none
    if kept.ndim != 1 or np.any(kept < 1) or (width is not None and np.any(kept > width)):
        raise ValueError(f"kept={kept.tolist()!r} is invalid: [B] ints in [1, K + 1"
                         f"{'' if width is None else f' = {width}'}]")
    rows = np.arange(kept.shape[0])
    caches = _cache_leaves(cfg)
    return {kind: {name: (jnp.swapaxes(per_position[kind][name][kept - 1, :, rows], 0, 1)
                          if name not in caches.get(kind, {}) and kind in per_position
                          else leaf)
                   for name, leaf in leaves.items()}
            for kind, leaves in state_all.items()}
