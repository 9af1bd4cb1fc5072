"""Splits without streamed zeros: how the partial-sum mode shares a width among ranks.

The exact mode splits a padded group (`layout.PADDED_GROUPS`: d's columns, the latent, the FFN
hidden) in chunks of whole lane tiles: 7,168 over 32 ranks is 28 chunks of 256, so ranks 28-31
hold only zero columns of W_o, W_down and W_lu, and the router's 896 scores (28 per rank, padded
to 128) are 78 % zeros. In partial-sum mode:

  - a matrix whose input arrives split (`Param.gather`: W_o over the heads, a W_down over the
    FFN hidden) is split by those ROWS, exactly (`balanced`): each rank multiplies its rows
    into a partial sum [B, N] over every column: no output column is split at all;
  - any other split of a padded group is `balanced` too: every rank ceil(length / ways) or one
    unit less, never an empty or all-zero slice (HBM holds each rank's slice at its real width;
    a VMEM block may pad lanes, but only real columns stream from HBM).

`partial_sum_shape` is one rank's shape of a parameter under these rules, which
`layout_bytes.rank_bytes(..., collectives="partial-sum")` counts.
"""

from __future__ import annotations

from mkresearch.model import spec
from mkresearch.sharding.layout import PADDED_GROUPS, Layout, active_shard


def balanced(length: int, ways: int, unit: int = 1) -> tuple[int, ...]:
    """`length` split `ways` ways in multiples of `unit` (the last piece takes the remainder when
    unit does not divide length), the pieces differing by at most one unit, the larger first;
    every piece > 0 when length >= ways x unit. ValueError for a split that would leave a rank
    empty."""
    for name, value in (("length", length), ("ways", ways), ("unit", unit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: an int >= 1")
    units = -(-length // unit)
    if units < ways:
        raise ValueError(f"length={length} is invalid for ways={ways}: {units} units of {unit}, "
                         "fewer than the ranks (a rank would stream nothing)")
    pieces = [unit * (units // ways + (1 if i < units % ways else 0)) for i in range(ways)]
    pieces[-1] -= sum(pieces) - length  # a short last unit
    return tuple(pieces)


def reduced_rows(lay: Layout, param: spec.Param) -> str | None:
    """The group by which the partial-sum mode splits a matrix's rows (its `gather` group, when
    the layout splits it), or None: the matrix keeps its column split."""
    if param.gather is None or param.gather == spec.EXPERT_TP or len(param.shape) < 2:
        return None
    rows = param.shape[-2]
    return param.gather if lay.ways(param.gather) > 1 and rows >= lay.ways(param.gather) else None


def partial_sum_shape(lay: Layout, param: spec.Param) -> tuple[int, ...]:
    """One rank's shape of `param` in partial-sum mode (the largest rank's: `balanced`)."""
    shape = list(param.shape)
    rows = reduced_rows(lay, param)
    if rows is not None:
        shape[-2] = balanced(shape[-2], lay.ways(rows))[0]
        return tuple(shape)
    for axis, group in active_shard(lay, param.shard, param.shape):
        ways = lay.ways(group)
        shape[axis] = balanced(shape[axis], ways)[0] if group in PADDED_GROUPS \
            else lay.local_length(group, shape[axis])
    return tuple(shape)
