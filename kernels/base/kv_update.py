"""The MLA cache update: the new token's entry written in place, in the HBM cache's tiling.

HBM arrays are tiled (16 rows of bf16), so a single row cannot be DMA'd at an arbitrary position:
the aligned 16-row block around the position is read, patched in VMEM and written back, for each
of the layer's two cache arrays (expanded: k, v per head; latent: ĉ, k^X shared by the heads).
With a
paged cache (`kv_tiles.KvRows`) the block is in the row's page of the position (a page is whole
16-row blocks), and a free slot (position -1) writes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma, planned
from mkresearch.kernels.base.kv_tiles import CONTIGUOUS

from mkresearch.model.config import BF16_SUBLANE

# Rows of the aligned HBM block patched to write one new cache entry (bf16 HBM tiling).
UPDATE_ROWS = BF16_SUBLANE
KV_UPDATE_NAME = "mla.kv_update"  # DMA-log name prefix: <prefix>.<cache array>.read / .write


def patch_block(b, row_in_block, window_in, window_out, buffer, sem, patch, name, indices):
    """Read the aligned UPDATE_ROWS block around the new position, patch its row, write it back."""
    dma.Copy(window_in, buffer, sem, name=f"{name}.read", buffer=planned.KV_UPDATE, row=b,
             **indices).start().wait()
    rows = jax.lax.broadcasted_iota(jnp.int32, buffer.shape, len(buffer.shape) - 2)
    patch(rows == row_in_block)
    dma.Copy(buffer, window_out, sem, name=f"{name}.write", buffer=planned.KV_UPDATE, row=b,
             **indices).start().wait()


def update_window(position):
    """The first token of the aligned UPDATE_ROWS block that holds `position`."""
    return pl.multiple_of(jax.lax.div(position, UPDATE_ROWS) * UPDATE_ROWS, UPDATE_ROWS)


def patch_blocks(b, position, caches, buffers, sems, patches, names, indices, kv_rows):
    """For each cache array (in, out HBM refs) the block around `position` of row b patched by
    its patch(is_new) in its VMEM buffer; a paged free slot patches nothing (`KvRows.guard`)."""
    start = update_window(position)

    def write():
        for i, ((cache_in, cache_out), buffer, patch, name) in enumerate(
                zip(caches, buffers, patches, names)):
            patch_block(b, position - start, kv_rows.window(cache_in, b, start, UPDATE_ROWS),
                        kv_rows.window(cache_out, b, start, UPDATE_ROWS), buffer, sems.at[i],
                        patch, name, indices)

    kv_rows.guard(position, write)


def update_expanded(p, b, position, k_c, k_extra, v_new, k_in, v_in, k_out, v_out, names,
                    indices, kv_rows=CONTIGUOUS):
    """Write K = [k^C | k^X | 0] and V of the new token at `position` for every head."""
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

        patch_blocks(b, position, ((k_in, k_out), (v_in, v_out)), (k_block, v_block), sems,
                     (patch_k, patch_v), [f"{KV_UPDATE_NAME}.{name}" for name in names],
                     indices, kv_rows)

    pl.run_scoped(scoped, pltpu.VMEM((p.n_heads, UPDATE_ROWS, p.k_padded), jnp.bfloat16),
                  pltpu.VMEM((p.n_heads, UPDATE_ROWS, p.v_dim), jnp.bfloat16),
                  pltpu.SemaphoreType.DMA((2,)))


def update_latent(p, b, position, c_hat, k_extra, ckv_in, kx_in, ckv_out, kx_out, names,
                  indices, kv_rows=CONTIGUOUS):
    """Write ĉ and k^X of the new token at `position` (one entry for all heads)."""

    def scoped(c_block, x_block, sems):  # [16, kv_rank], [16, extra]
        def patch_c(is_new):
            c_block[...] = jnp.where(is_new, c_hat, c_block[...])

        def patch_x(is_new):
            x_block[...] = jnp.where(is_new, k_extra, x_block[...])

        patch_blocks(b, position, ((ckv_in, ckv_out), (kx_in, kx_out)), (c_block, x_block),
                     sems, (patch_c, patch_x), [f"{KV_UPDATE_NAME}.{name}" for name in names],
                     indices, kv_rows)

    pl.run_scoped(scoped, pltpu.VMEM((UPDATE_ROWS, p.kv_rank), jnp.bfloat16),
                  pltpu.VMEM((UPDATE_ROWS, p.qk_extra), jnp.bfloat16),
                  pltpu.SemaphoreType.DMA((2,)))

