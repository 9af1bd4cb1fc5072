"""How the partial-sum mode shares each width among ranks, and where that streams zeros.

One answer: `partial_sum_shape` is the shape the kernel builds and streams for one rank in
partial-sum mode (`layout.layout(..., collectives="partial-sum")`, `layout.param_shard`), the
shape `layout_bytes.rank_bytes` counts and the sharded megakernel's planned DMAs read
(tests/test_layout_split.py holds them equal at full size, the recorded DMA log at mini scale):

  - a matrix whose input arrives split (`Param.gather`: W_o over the heads, a W_down over the
    FFN hidden, an expert's W2 over its ETP slice) is split by those ROWS, in the pieces its input
    arrives in: its product is a partial sum over every output column, reduced;
  - any other split of a padded group (`layout.PADDED_GROUPS`: d's columns, the small
    down-projections' columns, the MoE latent) is in chunks of whole lane tiles
    (`partition.chunk_length`), zero-padded; the FFN hidden in half-lane chunks (64,
    `Layout._chunk`): a rank's gate and up columns fused side by side fill whole lanes
    (`kernels/stages/gate_up.py`), its W_down rows whole sublane tiles;
  - rank r holds chunk `Split.index(r)`: our layout rotates the column chunks of d, of the small
    down-projections and of the MoE latent (`layout.rotations`) so that a rank holding only
    padding of one matrix holds real chunks of another.

Every rank's arrays have the same shape (one SPMD program), zero-padded in HBM. `streamed_zeros`
says how much of each rank's slice is padding and which ranks hold a slice that is only padding:
on 32 ranks 7,168 columns are 28 chunks of 256 (W_lu's on ranks 3-30, ranks 0-2 and 31 hold only
zeros), W_ld's 3,584 latent columns 28 chunks of 128 (ranks 28-31 only zeros), the router's 896
scores 7 chunks of 128 (on ranks 28-31 and 0-2); the shared experts' 6,144 hidden are 192 on
every rank. A rank skips its slices of padding only (`zero_only`; the kernel's
`Collectives.live`, the planned schedule's `schedule.rank_live`): it issues none of their DMAs and
takes their products as zeros, so no rank streams a slice that is only padding, and a rank's bytes
(`layout_bytes.rank_bytes(..., rank=r)`) are its real slices (a slice partly past its axis' end,
e.g. W_kva's chunk 4 on 32 ranks, streams its tail of zeros). The bytes per rank the step is
priced at are the most any rank reads (`layout_bytes.rank_bytes(..., rank=None)`; every rank's:
`mkresearch info kimi-k3 --ranks 32`).

Why the other chunks are whole lane tiles: HBM stores a bf16 array in tiles of 16 rows x 128
lanes (`tiled_nbytes`), so a column slice narrower than a lane tile is not read for less. An even
split of the router's 896 columns gives each rank [7168, 28], which HBM holds and a DMA reads as
[7168, 128]: the bytes of today's chunk. A split finer than a lane tile saves HBM bytes only along
rows (16-row tiles), i.e. for a matrix split by its rows (W_down over the FFN hidden), or where
two slices side by side fill whole lanes (the FFN hidden's gate and up).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from mkresearch.model import spec
from mkresearch.model.config import BF16_SUBLANE, LANE
from mkresearch.sharding.layout import (
    PARTIAL_SUM,
    Layout,
    active_shard,
    leaves_with_path,
    local_shape,
    param_shard,
)

# HBM tile rows of a 4-, 2- and 1-byte element type (the lanes are LANE for all)
SUBLANES = {4: BF16_SUBLANE // 2, 2: BF16_SUBLANE, 1: BF16_SUBLANE * 2}


def partial_layout(lay: Layout) -> Layout:
    """The same layout in partial-sum mode (what the sharded megakernel builds by default; a
    layout in a partial-sum mode already, e.g. restructured, as it is)."""
    if not isinstance(lay, Layout):
        raise ValueError(f"lay={lay!r} is invalid: a mkresearch.sharding.layout.Layout")  # noqa: TRY004
    return lay if lay.partial_sums else dataclasses.replace(lay, collectives=PARTIAL_SUM)


def partial_sum_shape(lay: Layout, param: spec.Param) -> tuple[int, ...]:
    """One rank's shape of `param` in partial-sum mode: the kernel's (every rank the same)."""
    ps = partial_layout(lay)
    return local_shape(ps, param.shape, param_shard(ps, param))


def padded_splits(lay: Layout, param: spec.Param) -> tuple[tuple[str, int, int], ...]:
    """(group, axis length, per-rank chunk) of each split of `param` in partial-sum mode that
    leaves some rank only padding (a chunk starting past the axis' end): the sharded kernel
    skips such a rank's DMAs of it (`Collectives.live`)."""
    ps = partial_layout(lay)
    out = []
    for axis, group in active_shard(ps, param_shard(ps, param), param.shape):
        length = param.shape[axis]
        chunk = ps.local_length(group, length)
        if (ps.ways(group) - 1) * chunk >= length:
            out.append((group, length, chunk))
    return tuple(out)


def zero_only(lay: Layout, param: spec.Param, rank: int) -> bool:
    """Whether `rank`'s partial-sum slice of `param` is only padding (what it skips)."""
    ps = partial_layout(lay)
    return any(ps.split(group).index(rank) * chunk >= length
               for group, length, chunk in padded_splits(ps, param))


def tiled_nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes an array of `shape` takes in HBM tiles: the last axis in whole lanes (128), the one
    before it in whole sublane rows (16 for bf16, 8 for f32, 32 for 8-bit types)."""
    itemsize = np.dtype(dtype).itemsize
    dims = list(shape)
    if dims:
        dims[-1] = -(-dims[-1] // LANE) * LANE
    if len(dims) > 1:
        sub = SUBLANES.get(itemsize, BF16_SUBLANE)
        dims[-2] = -(-dims[-2] // sub) * sub
    return math.prod(dims) * itemsize


@dataclass(frozen=True)
class Zeros:
    """One parameter's split in partial-sum mode: the fraction of a rank's streamed slice that is
    real (per rank) and the ranks whose slice is only padding."""

    path: str
    shape: tuple[int, ...]  # the whole parameter's
    local: tuple[int, ...]  # one rank's (every rank's)
    real: tuple[float, ...]  # per rank: real elements / streamed elements
    zero_only: tuple[int, ...]  # ranks streaming only padding of it


def streamed_zeros(lay: Layout) -> list[Zeros]:
    """Every parameter that some rank streams with zero padding in partial-sum mode (see the
    module docstring), from the bounds the kernel's weights are sliced with (`Layout.bounds`,
    `layout.shard_params`)."""
    ps = partial_layout(lay)
    out = []
    for path, param in leaves_with_path(spec.param_table(ps.cfg)):
        shard = param_shard(ps, param)
        local = local_shape(ps, param.shape, shard)
        real = []
        for rank in range(ps.n_ranks):
            fraction = 1.0
            for axis, group in active_shard(ps, shard, param.shape):
                start, stop, length = ps.bounds(group, param.shape[axis], rank)
                fraction *= (stop - start) / length
            real.append(fraction)
        if min(real) < 1.0:
            out.append(Zeros(path, tuple(param.shape), local, tuple(real),
                             tuple(r for r, f in enumerate(real) if f == 0.0)))
    return out


def zero_bytes(lay: Layout) -> dict[str, int]:
    """Per parameter path, the padding bytes of the rank whose slice holds the most padding (a
    slice of padding only is skipped, `zero_only`: what skipping saves that rank)."""
    ps = partial_layout(lay)
    params = dict(leaves_with_path(spec.param_table(ps.cfg)))
    out = {}
    for z in streamed_zeros(ps):
        local = jax.ShapeDtypeStruct(z.local, params[z.path].dtype)
        out[z.path] = int(round(math.prod(local.shape) * np.dtype(local.dtype).itemsize
                                * (1.0 - min(z.real))))
    return out
