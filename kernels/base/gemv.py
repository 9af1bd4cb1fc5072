"""The decode GEMV of notebook 01: y [B, N] = x [B, K] @ W [K, N], W streamed HBM -> VMEM.

At decode batch sizes the weight matrix is the whole cost: every byte of W crosses HBM once per
step and each byte feeds only 2·B FLOPs. So the kernel is a stream: W is cut into row blocks
`W[k·bk:(k+1)·bk, :]` (each one contiguous HBM window), and each block is multiplied by the
matching slice of x and added to an f32 accumulator that stays in VMEM.

Two ways to stream, one block computation (`accumulate_block`):

* `gemv_blockspec`: BlockSpec + grid. Pallas emits the pipeline (two VMEM buffers per input,
  prefetching block k+1 while block k is computed); its DMAs are not in our log.
* `gemv_stream(..., n_buffers=1|2|3)`: W stays in HBM (`pl.ANY`) and the kernel moves it itself
  through `dma.Ring`, a ring of `n_buffers` VMEM slots. One buffer: copy, wait, compute — no
  overlap. Two: block k+1 moves while block k is computed (double buffering). Three: two blocks
  ahead, which also hides the DMA latency when one block's compute is shorter than it.
  Every block is a `dma` event, so `dma.recording()` logs every weight byte.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import chip_log, costs, dma

from mkresearch.hardware import tpu
from mkresearch.model import numerics
from mkresearch.model.config import LANE

N_BUFFERS = (1, 2, 3)
WEIGHT_NAME = "w"  # the DMA log name of the streamed weight blocks


# ---- checks (Python, before tracing) --------------------------------------------------------
def check_gemv_args(x: Any, w: Any, block_k: Any, n_buffers: Any = 2) -> None:
    """ValueError naming the bad parameter; shapes must tile onto TPU vregs (8 x 128)."""
    if getattr(x, "ndim", None) != 2 or getattr(w, "ndim", None) != 2:
        raise ValueError(f"x and w must be 2-D ([B, K] and [K, N]); got x.shape="
                         f"{getattr(x, 'shape', None)}, w.shape={getattr(w, 'shape', None)}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"x.dtype={x.dtype}, w.dtype={w.dtype} are invalid: both must be bfloat16")
    k = x.shape[1]
    if w.shape[0] != k:
        raise ValueError(f"w.shape={w.shape} is invalid: its first dim must be K={k} (x is [B, K])")
    if w.shape[1] % LANE:
        raise ValueError(f"w.shape[1]={w.shape[1]} is invalid: a multiple of {LANE} (lanes)")
    if not isinstance(block_k, int) or isinstance(block_k, bool) or block_k < 1 \
            or block_k % LANE or k % block_k:
        allowed = [d for d in range(LANE, k + 1, LANE) if k % d == 0]
        raise ValueError(f"block_k={block_k!r} is invalid: a multiple of {LANE} dividing K={k} "
                         f"(a block is a lane slice of x); allowed: {allowed}")
    if n_buffers not in N_BUFFERS:
        raise ValueError(f"n_buffers={n_buffers!r} is invalid: one of {N_BUFFERS}")


def block_flops(batch: int, block_k: int, n: int) -> int:
    """FLOPs of one block: a [B, bk] @ [bk, N] matmul."""
    return 2 * batch * block_k * n


def block_vmem_bytes(batch: int, block_k: int, n: int) -> int:
    """VMEM bytes one block reads and writes: the W block, the x slice and the f32 accumulator."""
    return block_k * n * 2 + batch * block_k * 2 + 2 * batch * n * 4


def blockspec_block_bytes(batch: int, block_k: int, n: int) -> dict[str, int]:
    """Bytes of the blocks the BlockSpec pipeline copies per grid step (for `tl.blockspec_log`)."""
    return {"x": batch * block_k * 2, WEIGHT_NAME: block_k * n * 2}


# ---- the block computation, shared by both kernels -------------------------------------------
def accumulate_block(x_block: jax.Array, w_block_ref: Any, acc_ref: Any) -> None:
    """acc [B, N] f32 += x_block [B, bk] bf16 @ W block [bk, N] bf16 (MXU, f32 accumulation)."""
    acc_ref[...] += jnp.dot(x_block, w_block_ref[...], preferred_element_type=jnp.float32,
                            precision=numerics.EXACT_PRODUCTS)  # bf16 x bf16


# ---- BlockSpec + grid ------------------------------------------------------------------------
def gemv_blockspec_body(x_ref, w_ref, o_ref):
    # x_ref [B, bk], w_ref [bk, N] (this grid step's blocks, in VMEM), o_ref [B, N] f32: the same
    # output block for every k, so it stays in VMEM and accumulates (k is the last grid axis).
    k = pl.program_id(0)
    batch, block_k = x_ref.shape
    n = w_ref.shape[1]

    @pl.when(k == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    with dma.phase("w_block", flops=block_flops(batch, block_k, n),
                   vmem_bytes=block_vmem_bytes(batch, block_k, n), k=k):
        accumulate_block(x_ref[...], w_ref, o_ref)


@functools.partial(jax.jit, static_argnames=("block_k", "interpret", "recording"))
def _gemv_blockspec_call(x, w, *, block_k, interpret, recording):
    del recording  # a static arg only so that recorded and silent traces are cached apart
    batch, k = x.shape
    n = w.shape[1]
    out_shape = jax.ShapeDtypeStruct((batch, n), jnp.float32)
    call = functools.partial(
        pl.pallas_call, gemv_blockspec_body,
        grid=(k // block_k,),
        in_specs=[pl.BlockSpec((batch, block_k), lambda i: (0, i)),
                  pl.BlockSpec((block_k, n), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((batch, n), lambda i: (0, 0)),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret)
    # the body (one grid step: it issues no DMA) once per block; the pipeline copies x, the w
    # blocks and the output, each once
    return costs.costed_call(call, x, w, io=(x, w, out_shape), times=k // block_k)


def gemv_blockspec(x: jax.Array, w: jax.Array, *, block_k: int = 256) -> jax.Array:
    """x [B, K] bf16 @ w [K, N] bf16 -> [B, N] f32, pipelined by Pallas over row blocks of w."""
    check_gemv_args(x, w, block_k)
    return _gemv_blockspec_call(x, w, block_k=block_k, interpret=tpu.interpret_params(),
                                recording=dma.is_recording())


# ---- manual DMA through a ring of n_buffers VMEM slots ----------------------------------------
def gemv_stream_body(x_ref, w_hbm, o_ref, w_slots, sems, *, block_k: int):
    # x_ref [n_blocks, B, bk] bf16 (VMEM: x cut into the K slices, so block k is x_ref[k]),
    # w_hbm [K, N] bf16 (HBM), o_ref [B, N] f32 (VMEM accumulator),
    # w_slots [n_buffers, bk, N] bf16 (VMEM ring), sems [n_buffers] DMA semaphores.
    n_blocks, batch, _ = x_ref.shape
    n = w_hbm.shape[1]
    ring = dma.Ring(w_slots, sems, name=WEIGHT_NAME)
    ahead = ring.n_slots - 1  # blocks in flight beyond the one being computed

    def w_block(k):  # [bk, N] window of W in HBM
        return w_hbm.at[pl.ds(pl.multiple_of(k * block_k, block_k), block_k)]

    def slot_of(k):
        return lax.rem(k, ring.n_slots)

    for k in range(min(ahead, n_blocks)):  # prologue: fill all slots but one
        ring.start(w_block(k), k, k=k)
    o_ref[...] = jnp.zeros_like(o_ref)

    def step(k, carry):
        # Refill first: block k+ahead goes to the slot block k-1 used, which step k-1 has read.
        # With one buffer (ahead = 0) this is block k itself: copy, then wait at once.
        @pl.when(k + ahead < n_blocks)
        def _():
            ring.start(w_block(k + ahead), slot_of(k + ahead), k=k + ahead)

        ring.wait(w_block(k), slot_of(k), k=k)
        with dma.phase("w_block", flops=block_flops(batch, block_k, n),
                       vmem_bytes=block_vmem_bytes(batch, block_k, n), k=k):
            accumulate_block(x_ref[k], ring.buffer(slot_of(k)), o_ref)
        return carry

    lax.fori_loop(0, n_blocks, step, 0)


@functools.partial(jax.jit, static_argnames=("block_k", "n_buffers", "interpret", "recording"))
def _gemv_stream_call(x, w, *, block_k, n_buffers, interpret, recording):
    del recording  # see _gemv_blockspec_call
    batch, k = x.shape
    n = w.shape[1]
    n_blocks = k // block_k
    x_blocks = x.reshape(batch, n_blocks, block_k).transpose(1, 0, 2)  # [n_blocks, B, bk]
    out_shape = jax.ShapeDtypeStruct((batch, n), jnp.float32)
    call = functools.partial(
        pl.pallas_call, functools.partial(gemv_stream_body, block_k=block_k),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((n_buffers, block_k, n), w.dtype),
                        pltpu.SemaphoreType.DMA((n_buffers,))],
        interpret=interpret)
    # read off the body (kernels/base/costs.py)
    return costs.costed_call(call, x_blocks, w, io=(x_blocks, out_shape))


def gemv_stream(x: jax.Array, w: jax.Array, *, block_k: int = 256, n_buffers: int = 2) -> jax.Array:
    """x [B, K] bf16 @ w [K, N] bf16 -> [B, N] f32; w streams through `n_buffers` VMEM slots."""
    check_gemv_args(x, w, block_k, n_buffers)
    return chip_log.run(lambda x, w: _gemv_stream_call(
        x, w, block_k=block_k, n_buffers=n_buffers, interpret=tpu.interpret_params(),
        recording=dma.is_recording()), x, w)


def vmem_bytes(batch: int, k: int, n: int, *, block_k: int, n_buffers: int) -> int:
    """VMEM the streaming kernel allocates: x, the f32 output and the W ring."""
    return batch * k * 2 + batch * n * 4 + n_buffers * block_k * n * 2
