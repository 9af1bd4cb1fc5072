"""Shared pieces of the attention stage kernels: block-size checks and weight streaming.

`stream_matmul` is how a stage kernel multiplies a small VMEM activation by a weight matrix that
stays in HBM: the matrix streams through a two-slot VMEM ring in row blocks (each a whole
`[rows, N]` slab, so every DMA is one contiguous HBM window) while the MXU works on the previous
block. Every block goes through `mkresearch.kernels.base.dma`, so the DMA log counts every weight byte.

Block sizes are checked in Python (ValueError naming the parameter) before a kernel is built:
TPU tiling wants the last dim of a VMEM block to be a multiple of 128 lanes and the second-last a
multiple of 8 (f32) or 16 (bf16) sublanes; interpret mode would accept anything silently.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import costs, dma, planned
from mkresearch.kernels.base.registry import StageRefs

from mkresearch.model import numerics, reference
from mkresearch.model.config import BF16_SUBLANE, LANE

# The public release keeps weight banks of 2 MiB in flight; one block of a streamed matrix is at
# most this many bytes unless the caller asks for other block rows.
WEIGHT_BLOCK_BYTES = 2 * 1024 * 1024
# Rows of the aligned embedding block fetched per token (the HBM tiling of a bf16 [V, d] array).
EMBED_ROWS = BF16_SUBLANE


def check_positive_multiple(name: str, value: Any, multiple: int, why: str) -> None:
    """ValueError naming `name` unless value is a positive int multiple of `multiple`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value % multiple:
        raise ValueError(f"{name}={value!r} is invalid: a positive multiple of {multiple} ({why})")


def check_kv_tile(kv_tile: Any, seq_len: int) -> None:
    """A KV tile is `[kv_tile, lanes]` bf16 in VMEM and a window of the HBM cache."""
    check_positive_multiple("kv_tile", kv_tile, BF16_SUBLANE,
                            "bf16 VMEM tiles are 16 x 128, so KV tiles are whole sublane groups")
    if seq_len % kv_tile:
        raise ValueError(f"kv_tile={kv_tile} is invalid: it must divide the cache length "
                         f"{seq_len} (allowed: the divisors of {seq_len} that are multiples of "
                         f"{BF16_SUBLANE})")


def check_block_rows(block_rows: Any) -> None:
    """Weight row blocks slice the activation's lane dim, so they are whole 128-lane groups."""
    if block_rows is not None:
        check_positive_multiple("weight_block_rows", block_rows, LANE,
                                "a row block of W is a lane slice of the activation x[:, rows]")


def weight_block_rows(shape: tuple[int, int], dtype: Any, block_rows: int | None = None) -> int:
    """Rows of one streamed block of a [K, N] matrix: a multiple of 128 dividing K.

    The largest such divisor with at most `WEIGHT_BLOCK_BYTES` per block, or at most `block_rows`
    rows when the caller gives it. K is a multiple of 128 for every matrix of the model (the config
    validates it), so 128 always works. A rank's W_down slice of a hidden split in half-lane
    chunks (`kernels/stages/gate_up.py`: K = 192 of Kimi K3's shared experts on 32 ranks) has K a
    multiple of 16 only: its blocks are whole sublane tiles (16 rows), the largest such divisor.
    """
    k, n = shape
    if block_rows is None:
        limit = max(LANE, WEIGHT_BLOCK_BYTES // (n * jnp.dtype(dtype).itemsize))
    else:
        limit = block_rows
    step = LANE if k % LANE == 0 else BF16_SUBLANE
    best = step
    for rows in range(step, min(k, limit) + 1, step):
        if k % rows == 0:
            best = rows
    return best


class LocalStream:
    """Where a stage kernel that runs alone gets its weight blocks: each matrix streams through a
    two-slot VMEM ring of its own (the next block flies while this one is multiplied). The
    megakernel gives its bodies the global ring instead (`weight_stream.GlobalStream.stage`),
    which falls back to this for the matrices it does not stream."""

    def matmul(self, x: jax.Array, w_hbm: Any, *, rows: int, name: str,
               **indices: Any) -> jax.Array:
        """x [M, K] (VMEM value) @ w_hbm [K, N] (HBM ref) -> [M, N] f32, double-buffered row blocks.

        The block loop is a static Python loop: K / rows is small (4 blocks for a 7168-row matrix
        at 2 MiB), and static lane slices of x need no dynamic relayout."""
        return _ring_matmul(x, w_hbm, rows=rows, name=name, **indices)

    def __repr__(self) -> str:
        return "LocalStream()"


LOCAL_STREAM = LocalStream()


def stream_matmul(stream: Any, x: jax.Array, w_hbm: Any, *, rows: int, name: str,
                  **indices: Any) -> jax.Array:
    """x [M, K] @ w_hbm [K, N] -> [M, N] f32, the blocks of W drawn from `stream`: LOCAL_STREAM
    for a stage kernel alone, the megakernel's global ring inside it."""
    return stream.matmul(x, w_hbm, rows=rows, name=name, **indices)


def hold_after(stream: Any, name: str) -> None:
    """The stream's ring prefetches past matrix `name` held back (`StageStream.hold_after`;
    a stream without a global ring: nothing to hold)."""
    if hasattr(stream, "hold_after"):
        stream.hold_after(name)


def release_held(stream: Any) -> None:
    """The held-back prefetches issued (`StageStream.release_held`)."""
    if hasattr(stream, "release_held"):
        stream.release_held()


def stream_matmuls(stream: Any, x: jax.Array, parts: tuple, **indices: Any) -> list:
    """x [M, K] times each (w_hbm [K, N], rows, name) of `parts`, in order -> [[M, N] f32 each]:
    the stream's own `matmuls` if it has one (a rank's: matrices of the same input whose column
    chunks one all-gather carries, `sharded_stream.ShardedStream`), else one matmul after another."""
    if hasattr(stream, "matmuls"):
        return stream.matmuls(x, parts, **indices)
    return [stream.matmul(x, w, rows=rows, name=name, **indices) for w, rows, name in parts]


def _ring_matmul(x: jax.Array, w_hbm: Any, *, rows: int, name: str, **indices: Any) -> jax.Array:
    k, n = w_hbm.shape
    m = x.shape[0]
    n_blocks = k // rows

    def scoped(buffers, sems):
        ring = dma.Ring(buffers, sems, name=name, buffer=planned.LOCAL_RING)

        def block(i):  # [rows, N] window of the HBM matrix
            return w_hbm.at[pl.ds(i * rows, rows), :]

        ring.start(block(0), 0, block=0, **indices)
        acc = jnp.zeros((x.shape[0], n), jnp.float32)
        for i in range(n_blocks):
            slot = i % 2
            if i + 1 < n_blocks:  # the next block flies while this one is multiplied
                ring.start(block(i + 1), 1 - slot, block=i + 1, **indices)
            ring.wait(block(i), slot, block=i, **indices)
            with dma.phase(f"{name}/matmul", flops=2 * m * rows * n,
                           vmem_bytes=rows * n * w_hbm.dtype.itemsize, block=i, **indices):
                acc += dot(x[:, i * rows:(i + 1) * rows], ring.buffer(slot)[...])
        return acc

    return pl.run_scoped(scoped, pltpu.VMEM((2, rows, n), w_hbm.dtype),
                         pltpu.SemaphoreType.DMA((2,)))


def load_whole(hbm_ref: Any, *, name: str, **indices: Any) -> jax.Array:
    """Copy a small HBM array (a norm weight, a bias) into VMEM by DMA and return its value."""

    def scoped(buffer, sem):
        dma.Copy(hbm_ref, buffer, sem.at[0], name=name, buffer=planned.WHOLE,
                 **indices).start().wait()
        return buffer[...]

    return pl.run_scoped(scoped, pltpu.VMEM(hbm_ref.shape, hbm_ref.dtype),
                         pltpu.SemaphoreType.DMA((1,)))


def load_into(hbm_ref: Any, vmem_ref: Any, *, rows: int, name: str, **indices: Any) -> None:
    """Fill vmem_ref [K, N] with the HBM matrix hbm_ref [K, N] in row blocks (all in flight)."""
    n_blocks = hbm_ref.shape[0] // rows

    def scoped(sems):
        copies = [dma.Copy(hbm_ref.at[pl.ds(i * rows, rows), :],
                           vmem_ref.at[pl.ds(i * rows, rows), :], sems.at[i], name=name,
                           slot=i, buffer=planned.WHOLE, block=i, **indices) for i in range(n_blocks)]
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()

    pl.run_scoped(scoped, pltpu.SemaphoreType.DMA((n_blocks,)))


# The reference's RMSNorm runs as is on VMEM values (v [M, N], gamma [1, N]): one definition.
rms_norm = reference.rms_norm
# Sums over lanes in the reference's one fixed order (batch-invariant, the same bits as it).
ordered_sum = reference.ordered_sum
softmax = reference.softmax


def dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] -> f32 [M, N] (bf16 operands on the MXU), as the reference's matmuls:
    the rows padded to a multiple of 8 (`reference.padded_rows`), so a row's result is the same
    whatever the batch, in interpret mode too, and a one-column w as a lane of its copies
    (`reference.lane_columns`), so a rank's one-column slice of a matrix (KDA's W_b on a rank
    holding one head) gives that column's bits of the whole product. On a TPU 8 rows are one
    sublane tile, and a column fills a lane tile."""
    return reference.padded_rows(lambda rows: reference.lane_columns(
        lambda cols: jnp.dot(rows, cols, preferred_element_type=jnp.float32,
                             precision=numerics.precision_for(rows, cols)), w), x)


def select_row(values: jax.Array, row) -> jax.Array:
    """values[row] as [1, N] for a traced row: a masked sum over the (few) sublanes, so a loop
    over batch rows needs no dynamic sublane slicing. values [M, N]; the sum runs in f32 (one
    nonzero term: exact) and the row keeps values' dtype."""
    rows = jax.lax.broadcasted_iota(jnp.int32, values.shape, 0)
    picked = jnp.where(rows == row, values.astype(jnp.float32), 0.0)
    return jnp.sum(picked, axis=0, keepdims=True).astype(values.dtype)


def state_row(row, rows_per_state: int):
    """The state row (cache and recurrent state) of traced row `row` when rows_per_state
    consecutive rows share one (a verify step's K + 1 tokens of a batch row); the row itself in a
    decode step (rows_per_state 1), so that step traces as before."""
    return row if rows_per_state == 1 else jax.lax.div(row, rows_per_state)


def put_row(values: jax.Array, row, new_row: jax.Array) -> jax.Array:
    """values [M, N] with values[row] = new_row [1, N] for a traced row (a masked select)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, values.shape, 0)
    return jnp.where(rows == row, new_row, values)


def bf16(v: jax.Array) -> jax.Array:
    """Round to bf16 (spec: bf(x)); the value stays bf16."""
    return v.astype(jnp.bfloat16)


def f32(v: jax.Array) -> jax.Array:
    return v.astype(jnp.float32)


def nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def cache_stage_call(body, plan, interpret, indices: tuple, positions, x, weights, cache):
    """A standalone attention stage over a KV cache as one pallas_call: positions in SMEM, x and
    the output in VMEM, weights and the cache in HBM (pl.ANY; the cache updated in place), weight
    blocks drawn from LOCAL_STREAM. `body(plan, refs)` is the stage's kernel body. Its cost is
    read off the body with every row at the cache's last position (`costs.body_cost`)."""
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    n_in = 2 + len(weights)  # then the cache leaves (a dict flattens sorted)
    out = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    cache_specs = {name: hbm for name in cache}

    def kernel(positions_ref, x_ref, weight_refs, cache_in, out_ref, cache_out):
        body(plan, StageRefs(x=x_ref, out=out_ref, weights=weight_refs, state_in=cache_in,
                             state_out=cache_out, positions=positions_ref, stream=LOCAL_STREAM,
                             indices=dict(indices)))

    call = functools.partial(
        pl.pallas_call, kernel,
        out_shape=(out, {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in cache.items()}),
        in_specs=(pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM),
                  {name: hbm for name in weights}, cache_specs),
        out_specs=(pl.BlockSpec(memory_space=pltpu.VMEM), cache_specs),
        input_output_aliases={n_in + i: 1 + i for i in range(len(cache))},
        interpret=interpret)
    return costs.costed_call(call, positions, x, weights, cache, io=(positions, x, out),
                             inputs={0: costs.worst_positions(plan.batch, plan.seq_len)})
