"""Slices of TPU chips as tori: which chip a rank is on, a chip's links by direction, and the
links a message crosses on its way to its destination.

A slice is a grid of chips (`dims`, x fastest) with a link to each neighbour along every axis
(+ and - directions, each one way); an axis wraps around (a link from its last chip back to its
first) only where the slice says so: docs/collectives.md, "a 2x2x4 slice has no wraparound
links" and "wraparound only on full axes". Rank r is core r % cores_per_chip of chip
r // cores_per_chip; a chip's index is x + X (y + Y z). A host is `chips_per_host` consecutive
chips (the release's Kimi K3: 4 hosts x 8 cores, so a host is one 2x2 plane of the 2x2x4 slice
and rank ^ 8, ^ 16, ^ 24 are the same core on the other hosts).

Routing is dimension-ordered (x, then y, then z), the shorter way round a wrapped axis: a
message's links are fixed by its source and destination (`route`). Two cores of one chip send
over the chip's links; a message to the sibling core never touches them (its own path).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

Link = tuple[int, int, int]  # (chip, axis, +1 | -1): the link leaving `chip` along `axis`


@dataclass(frozen=True)
class Slice:
    """One slice: its chip grid, which axes wrap, cores per chip, chips per host."""

    name: str
    dims: tuple[int, ...]
    wrap: tuple[bool, ...]
    cores_per_chip: int
    chips_per_host: int

    def __post_init__(self) -> None:
        if not self.dims or any(not isinstance(d, int) or d < 1 for d in self.dims):
            raise ValueError(f"Slice.dims={self.dims!r} is invalid: ints >= 1")
        if len(self.wrap) != len(self.dims):
            raise ValueError(f"Slice.wrap={self.wrap!r} is invalid: one bool per axis of "
                             f"{self.dims}")
        if self.cores_per_chip < 1 or self.chips_per_host < 1:
            raise ValueError("Slice.cores_per_chip and chips_per_host are invalid: ints >= 1")

    @property
    def n_chips(self) -> int:
        return math.prod(self.dims)

    @property
    def n_ranks(self) -> int:
        return self.n_chips * self.cores_per_chip

    def chip_of(self, rank: int) -> int:
        return rank // self.cores_per_chip

    def host_of(self, rank: int) -> int:
        return self.chip_of(rank) // self.chips_per_host

    def coords(self, chip: int) -> tuple[int, ...]:
        out = []
        for d in self.dims:
            out.append(chip % d)
            chip //= d
        return tuple(out)

    def chip_at(self, coords: tuple[int, ...]) -> int:
        index = 0
        for c, d in zip(reversed(coords), reversed(self.dims), strict=True):
            index = index * d + c
        return index

    def links_of(self, chip: int) -> tuple[Link, ...]:
        """The links leaving `chip`, by direction (axis, sign): none past an unwrapped edge, one
        per axis of length 2 (both directions reach the same chip)."""
        here = self.coords(chip)
        out = []
        for axis, (c, d, wraps) in enumerate(zip(here, self.dims, self.wrap, strict=True)):
            if d == 1:
                continue
            if c + 1 < d or (wraps and d > 2):
                out.append((chip, axis, +1))
            if c > 0 or (wraps and d > 2):
                out.append((chip, axis, -1))
        return tuple(out)

    def route(self, src_rank: int, dst_rank: int) -> tuple[Link, ...]:
        """The chip links a message from src_rank to dst_rank crosses (empty: same chip)."""
        return _route(self, self.chip_of(src_rank), self.chip_of(dst_rank))


@functools.lru_cache(maxsize=4096)
def _route(sl: Slice, src: int, dst: int) -> tuple[Link, ...]:
    here, there = list(sl.coords(src)), sl.coords(dst)
    hops: list[Link] = []
    for axis, d in enumerate(sl.dims):
        forward = (there[axis] - here[axis]) % d
        if sl.wrap[axis] and d > 2:
            sign = +1 if forward <= d - forward else -1
            steps = forward if sign > 0 else d - forward
        else:
            sign = +1 if there[axis] >= here[axis] else -1
            steps = abs(there[axis] - here[axis])
        for _ in range(steps):
            hops.append((sl.chip_at(tuple(here)), axis, sign))
            here[axis] = (here[axis] + sign) % d
    return tuple(hops)


# docs/collectives.md §3: Ironwood (TPU7x) is a 3D torus of chips with 2 cores each (each its
# own JAX device); the release runs Kimi K3 on tpu7x:2x2x4 (no wraparound, 4 hosts x 8 cores) and
# its second model on 4 chips (2x2x1). v5p: 3D torus, one JAX device per chip (megacore); v5e /
# v6e: 2D torus, 4 neighbours, wraparound only on full axes (none of these small slices).
SLICES = {
    "tpu7x:2x2x4": Slice("tpu7x:2x2x4", (2, 2, 4), (False, False, False), 2, 4),
    "tpu7x:2x2x2": Slice("tpu7x:2x2x2", (2, 2, 2), (False, False, False), 2, 4),
    "tpu7x:2x2x1": Slice("tpu7x:2x2x1", (2, 2, 1), (False, False, False), 2, 4),
    "tpu7x:2x1x1": Slice("tpu7x:2x1x1", (2, 1, 1), (False, False, False), 2, 4),
    "tpu7x:1x1x1": Slice("tpu7x:1x1x1", (1, 1, 1), (False, False, False), 2, 4),
    "v5p:2x2x2": Slice("v5p:2x2x2", (2, 2, 2), (False, False, False), 1, 4),
    "v5p:4x4x4": Slice("v5p:4x4x4", (4, 4, 4), (True, True, True), 1, 4),
    "v6e:4x4": Slice("v6e:4x4", (4, 4), (False, False), 1, 8),
    "v5e:4x4": Slice("v5e:4x4", (4, 4), (False, False), 1, 8),
    # one TPU VM (v6e-8 / v5e-8: one host, 8 chips as 2x4): the small real models' slices
    "v6e:2x4": Slice("v6e:2x4", (2, 4), (False, False), 1, 8),
    "v5e:2x4": Slice("v5e:2x4", (2, 4), (False, False), 1, 8),
}


def get_slice(name: str | Slice) -> Slice:
    if isinstance(name, Slice):
        return name
    if name not in SLICES:
        raise ValueError(f"slice={name!r} is invalid: one of {', '.join(SLICES)}")
    return SLICES[name]


def slice_for(chip: str, n_ranks: int) -> Slice:
    """The smallest known slice of `chip` with exactly n_ranks ranks (the release's shapes)."""
    fits = [s for s in SLICES.values() if s.name.split(":")[0] == chip and s.n_ranks == n_ranks]
    if not fits:
        allowed = sorted({s.n_ranks for s in SLICES.values() if s.name.split(":")[0] == chip})
        raise ValueError(f"n_ranks={n_ranks} is invalid for chip={chip!r}: a known slice has "
                         f"{allowed} ranks ({', '.join(SLICES)})")
    return fits[0]
