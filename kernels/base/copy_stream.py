"""The copy ceiling: a Pallas kernel that moves given blocks between HBM and VMEM and computes
nothing, so that its device time is the bandwidth a step's bytes can reach on the chip.

    kernel = copy_kernel([Block((512, 256), "bfloat16"), ...], depth=3)
    out = kernel.fn(*kernel.args)           # one run: every block's DMA, in order
    kernel = stream(64 << 20, 256 << 10, depth=3)   # 64 MiB in 256 KiB blocks

A `Block` is one DMA: its shape and dtype (the VMEM window the DMA fills or drains) and its
direction (HBM -> VMEM, or VMEM -> HBM for a state's write-back). The kernel issues them in the
given order through a pipeline `depth` deep: block i + depth - 1 is started before block i is
waited for, so `depth` DMAs are in flight at any time, as the megakernel's weight ring keeps
`ring_depth` blocks in flight (`kernels/base/weight_stream.py`). No vector work is done between
them: the kernel's device time is DMA issue and transfer only. Every copy goes through
`mkresearch.kernels.base.dma`, so a DMA log records each of them (the test: the log's bytes,
DMA by DMA, are the blocks', and a megakernel step's are its schedule's:
`kernels/compose/copy_ceiling.py`).

How a block is moved (`Block.moved`):
- a block of whole 32-bit tiles (a multiple of 4 KiB: every weight block, KV tile, state) moves
  as uint32 rows of 128 lanes, [nbytes / 512, 128]: in HBM's tiled layout a [rows, N] window
  of a bf16 matrix (rows a multiple of 16) is (rows / 16)·(N / 128) contiguous 4 KiB tiles, and
  so is this; these share one VMEM ring of `depth` slots of the largest such block;
- any other block (a norm row, a router bias, a few rows of a small matrix) moves in its own
  shape and dtype, through a ring of its own shape.
Each block moves its own region of its HBM array: the arrays together hold the blocks' bytes
once (what the step reads), contiguous. Where the megakernel's source is a strided window (a KV
tile across heads, one row of a stacked vector), this copy is one contiguous region of the same
size: the ceiling is the same bytes in the same DMA sizes, each as cheap to move as it can be.

The DMA order lives in SMEM (one class id per DMA); the kernel loops over it, picking each DMA's
class by a binary tree of conditions (log2 of the classes deep), so its code stays small for tens
of thousands of DMAs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import costs, dma

from mkresearch.hardware import tpu
from mkresearch.hardware.chips import get_chip

LANE = 128
TILE_BYTES = 4096  # one [8, 128] tile of 32-bit words: a block of whole tiles moves as rows of them
ROW_BYTES = LANE * 4  # one uint32 row of 128 lanes
SCOPED_VMEM_DEFAULT = 16 * 1024 * 1024  # Mosaic's scoped VMEM limit unless a kernel sets one
VMEM_MARGIN = 1024 * 1024  # beside the rings: Mosaic's own scratch


@dataclass(frozen=True)
class Block:
    """One DMA of the copy: a block of `shape` and `dtype` from HBM into VMEM, or with `write`
    from VMEM into HBM (a state or cache write-back)."""

    shape: tuple[int, ...]
    dtype: str
    write: bool = False

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not shape or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1
                            for n in shape):
            raise ValueError(f"Block.shape={self.shape!r} is invalid: a tuple of ints >= 1")
        try:
            jnp.dtype(self.dtype)
        except TypeError:
            raise ValueError(f"Block.dtype={self.dtype!r} is invalid: a numpy dtype name, e.g. "
                             "'bfloat16'") from None
        object.__setattr__(self, "shape", tuple(int(n) for n in shape))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _bits(self.dtype) // 8

    def moved(self) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) the kernel moves it as: [nbytes / 512, 128] uint32 for whole 4 KiB
        tiles, else its own (the module docstring)."""
        if self.nbytes % TILE_BYTES == 0:
            return (self.nbytes // ROW_BYTES, LANE), "uint32"
        return self.shape, self.dtype


def _bits(dtype: Any) -> int:
    return getattr(jax.dtypes, "itemsize_bits", lambda d: jnp.dtype(d).itemsize * 8)(
        jnp.dtype(dtype))


# ---- the layout: classes of DMAs, their rings, the order ----------------------------------------
@dataclass(frozen=True)
class Ring:
    """VMEM slots that DMAs of one or more classes fill or drain: [depth, *slot] of dtype."""

    slot: tuple[int, ...]
    dtype: str

    @property
    def slot_bytes(self) -> int:
        return math.prod(self.slot) * _bits(self.dtype) // 8


@dataclass(frozen=True)
class Class:
    """DMAs of one shape, dtype and direction: `count` of them, each its own region of one HBM
    array [count, *shape], through ring `ring`."""

    shape: tuple[int, ...]
    dtype: str
    write: bool
    ring: int
    count: int


@dataclass(frozen=True)
class Layout:
    """Everything the kernel is built from (static, hashable): the classes, the rings, the
    pipeline depth and the order (one class id per DMA, int32 bytes: hashed once)."""

    classes: tuple[Class, ...]
    rings: tuple[Ring, ...]
    depth: int
    order: bytes

    @property
    def n_dmas(self) -> int:
        return len(self.order) // 4

    def order_array(self) -> np.ndarray:
        return np.frombuffer(self.order, np.int32)

    @property
    def vmem_bytes(self) -> int:
        return self.depth * sum(ring.slot_bytes for ring in self.rings)

    @property
    def sources(self) -> tuple[int, ...]:
        """The classes read from HBM, in argument order."""
        return tuple(i for i, c in enumerate(self.classes) if not c.write)

    @property
    def targets(self) -> tuple[int, ...]:
        """The classes written to HBM, in output order."""
        return tuple(i for i, c in enumerate(self.classes) if c.write)


def _check_depth(depth: Any) -> int:
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 2:
        raise ValueError(f"depth={depth!r} is invalid: an int >= 2 (the DMAs in flight: 2 is "
                         "double buffering)")
    return int(depth)


def make_layout(blocks: Any, depth: int) -> Layout:
    """The classes, rings and order of a copy of `blocks` (a sequence of `Block`), `depth` deep."""
    depth = _check_depth(depth)
    blocks = tuple(blocks)
    if not blocks or not all(isinstance(b, Block) for b in blocks):
        raise ValueError(f"blocks={blocks!r:.80} is invalid: a non-empty sequence of "
                         "copy_stream.Block")
    moved = [b.moved() for b in blocks]
    tiled = [m for m in moved if m[1] == "uint32" and len(m[0]) == 2 and m[0][1] == LANE]
    rings: list[Ring] = []
    ring_of: dict[Any, int] = {}
    if tiled:  # one ring of the largest tiled block's rows: every tiled block fills its top rows
        rings.append(Ring((max(shape[0] for shape, _ in tiled), LANE), "uint32"))
    keys: dict[tuple, int] = {}
    counts: list[int] = []
    order = []
    for block, (shape, dtype) in zip(blocks, moved, strict=True):
        key = (shape, dtype, block.write)
        if key not in keys:
            is_tiled = dtype == "uint32" and len(shape) == 2 and shape[1] == LANE
            ring_key = "tiled" if is_tiled else (shape, dtype)
            if ring_key not in ring_of:
                ring_of[ring_key] = 0 if is_tiled else len(rings)
                if not is_tiled:
                    rings.append(Ring(shape, dtype))
            keys[key] = len(keys)
            counts.append(0)
        order.append(keys[key])
        counts[keys[key]] += 1
    classes = []
    for (shape, dtype, write), index in sorted(keys.items(), key=lambda kv: kv[1]):
        is_tiled = dtype == "uint32" and len(shape) == 2 and shape[1] == LANE
        classes.append(Class(shape, dtype, write, ring_of["tiled" if is_tiled else (shape, dtype)],
                             counts[index]))
    return Layout(tuple(classes), tuple(rings), depth, np.asarray(order, np.int32).tobytes())


# ---- the kernel ---------------------------------------------------------------------------------
# SMEM counters: a ring's next slot, a class's next region, and for each DMA in flight (by its
# position mod depth) the slot and region its wait must name
def _counter_offsets(layout: Layout) -> tuple[int, int, int, int, int]:
    rings, classes, depth = len(layout.rings), len(layout.classes), layout.depth
    return 0, rings, rings + classes, rings + classes + depth, rings + classes + 2 * depth


def _branch(index: Any, lo: int, hi: int, fn: Any) -> None:
    """fn(c) for the static class c == index (traced), by a binary tree of conditions."""
    if hi - lo == 1:
        fn(lo)
        return
    mid = (lo + hi) // 2
    lax.cond(index < mid, lambda: _branch(index, lo, mid, fn),
             lambda: _branch(index, mid, hi, fn))


def copy_body(layout: Layout, order_ref: Any, *refs: Any) -> None:
    """The copy on Refs: order_ref [n_dmas] i32 (SMEM: each DMA's class), then one HBM array per
    read class [count, *shape], one per written class (outputs), the DMA count (SMEM output),
    the rings [depth, *slot], their semaphores [depth] each, the SMEM counters."""
    classes, rings, depth = layout.classes, layout.rings, layout.depth
    n_src, n_dst = len(layout.sources), len(layout.targets)
    arrays = dict(zip(layout.sources + layout.targets, refs[:n_src + n_dst], strict=True))
    done_ref = refs[n_src + n_dst]
    ring_refs = refs[n_src + n_dst + 1:n_src + n_dst + 1 + len(rings)]
    sem_refs = refs[n_src + n_dst + 1 + len(rings):n_src + n_dst + 1 + 2 * len(rings)]
    counters = refs[-1]
    ring_at, class_at, slot_at, region_at, _ = _counter_offsets(layout)
    n = layout.n_dmas

    def copy(cls: int, slot: Any, region: Any) -> dma.Copy:
        spec = classes[cls]
        hbm = arrays[cls].at[region]
        vmem = ring_refs[spec.ring].at[slot]
        if vmem.shape != spec.shape:  # a tiled block in the shared ring: its top rows
            vmem = vmem.at[pl.ds(0, spec.shape[0]), :]
        src, dst = (vmem, hbm) if spec.write else (hbm, vmem)
        return dma.Copy(src, dst, sem_refs[spec.ring].at[slot],
                        name="copy.write" if spec.write else "copy.read", slot=slot)

    def start(i: Any) -> None:
        def one(cls: int) -> None:
            ring = classes[cls].ring
            slot = counters[ring_at + ring]
            counters[ring_at + ring] = jnp.where(slot + 1 == depth, 0, slot + 1)
            region = counters[class_at + cls]
            counters[class_at + cls] = region + 1
            in_flight = lax.rem(i, depth)
            counters[slot_at + in_flight] = slot
            counters[region_at + in_flight] = region
            copy(cls, slot, region).start()

        _branch(order_ref[i], 0, len(classes), one)

    def wait(i: Any) -> None:
        in_flight = lax.rem(i, depth)
        slot, region = counters[slot_at + in_flight], counters[region_at + in_flight]
        _branch(order_ref[i], 0, len(classes), lambda cls: copy(cls, slot, region).wait())

    for k in range(_counter_offsets(layout)[-1]):
        counters[k] = 0
    ahead = depth - 1
    for i in range(min(ahead, n)):  # the prologue: the first depth - 1 DMAs in flight
        start(i)

    def steady(i: Any, carry: Any) -> Any:  # start DMA i + depth - 1, wait for DMA i
        start(i + ahead)
        wait(i)
        return carry

    lax.fori_loop(0, max(n - ahead, 0), steady, 0)
    lax.fori_loop(max(n - ahead, 0), n, lambda i, carry: [wait(i), carry][1], 0)
    done_ref[0] = n


def vmem_limit(layout: Layout, chip: str | None) -> int | None:
    """The scoped VMEM limit the rings need (None: Mosaic's default suffices); ValueError if
    `chip` (None: not checked) has less VMEM."""
    need = layout.vmem_bytes + VMEM_MARGIN
    if chip is not None and need > get_chip(chip).vmem_bytes:
        raise ValueError(f"depth={layout.depth} is invalid for these blocks on {chip}: "
                         f"{layout.depth} slots of each ring take {layout.vmem_bytes / 2**20:.1f} "
                         f"MiB of VMEM, the chip has {get_chip(chip).vmem_bytes / 2**20:.0f} MiB")
    return None if need <= SCOPED_VMEM_DEFAULT else need


@functools.partial(jax.jit, static_argnames=("layout", "interpret", "recording", "chip"))
def _copy_call(*sources: jax.Array, layout: Layout, interpret: Any, recording: bool,
               chip: str | None) -> tuple:
    del recording  # static only so recorded and silent traces never share a jit cache entry
    order = jnp.asarray(layout.order_array())
    hbm, smem = pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.SMEM)
    targets = tuple(jax.ShapeDtypeStruct((layout.classes[c].count, *layout.classes[c].shape),
                                         layout.classes[c].dtype) for c in layout.targets)
    out_shape = (*targets, jax.ShapeDtypeStruct((1,), jnp.int32))
    limit = vmem_limit(layout, chip)
    call = functools.partial(
        pl.pallas_call, functools.partial(copy_body, layout),
        out_shape=out_shape,
        in_specs=[smem, *(hbm for _ in sources)],
        out_specs=(*(hbm for _ in targets), smem),
        scratch_shapes=[*(pltpu.VMEM((layout.depth, *ring.slot), ring.dtype)
                          for ring in layout.rings),
                        *(pltpu.SemaphoreType.DMA((layout.depth,)) for _ in layout.rings),
                        pltpu.SMEM((_counter_offsets(layout)[-1],), jnp.int32)],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=limit),
        interpret=interpret)
    # the cost read off the body (every DMA's bytes); the order is data the body's DMAs follow
    return costs.costed_call(call, order, *sources, inputs={0: layout.order_array()})


def run_copy(layout: Layout, *sources: jax.Array) -> tuple:
    """One run of the copy: every DMA of `layout`, in order. sources: the read classes' HBM
    arrays (`CopyKernel.args`). Returns the written classes' arrays and the DMA count [1] i32.
    Compiled on a TPU (for `chip=` inside `tpu.compile_for`), interpreted elsewhere."""
    return _copy_call(*sources, layout=layout, interpret=tpu.interpret_params(),
                      recording=dma.is_recording(), chip=tpu.target_chip())


@dataclass(frozen=True)
class CopyKernel:
    """A copy ready to run: `fn(*args)` moves every block once (jit-compiled on first call).
    args: the source arrays on the device (each read class's blocks, zeros)."""

    blocks: tuple[Block, ...]
    layout: Layout
    args: tuple

    @property
    def fn(self) -> Any:
        return functools.partial(run_copy, self.layout)

    @property
    def arg_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.args)

    @property
    def read_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks if not b.write)

    @property
    def written_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks if b.write)

    @property
    def nbytes(self) -> int:
        return self.read_bytes + self.written_bytes


def source_shapes(layout: Layout) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The read classes' HBM arrays [count, *shape], in argument order."""
    return tuple(jax.ShapeDtypeStruct((layout.classes[c].count, *layout.classes[c].shape),
                                      layout.classes[c].dtype) for c in layout.sources)


def copy_kernel(blocks: Any, depth: int = 3, *, allocate: bool = True,
                chip: str | None = None) -> CopyKernel:
    """The copy of `blocks` (a sequence of `Block`, in DMA order), `depth` DMAs in flight.
    allocate=False: args as shape structs (to compile it with `tpu.compile_for` without
    allocating the sources). chip: whose VMEM the rings must fit (default: this TPU's; none
    checked in interpret mode)."""
    layout = make_layout(blocks, depth)
    vmem_limit(layout, chip or tpu.target_chip())
    shapes = source_shapes(layout)
    args = (tuple(jnp.zeros(s.shape, s.dtype) for s in shapes) if allocate else shapes)
    return CopyKernel(tuple(blocks), layout, args)


def stream(nbytes: int, block_bytes: int, depth: int = 3, *, allocate: bool = True,
           chip: str | None = None) -> CopyKernel:
    """A copy of `nbytes` from HBM into VMEM in blocks of `block_bytes` (the last one smaller
    if block_bytes does not divide nbytes), `depth` in flight. Both whole 4 KiB tiles."""
    for name, value in (("nbytes", nbytes), ("block_bytes", block_bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1 \
                or value % TILE_BYTES:
            raise ValueError(f"{name}={value!r} is invalid: a positive multiple of {TILE_BYTES} "
                             "(whole 4 KiB tiles)")
    whole, rest = divmod(int(nbytes), int(block_bytes))
    blocks = [Block((block_bytes // ROW_BYTES, LANE), "uint32")] * whole
    if rest:
        blocks.append(Block((rest // ROW_BYTES, LANE), "uint32"))
    return copy_kernel(blocks, depth, allocate=allocate, chip=chip)
