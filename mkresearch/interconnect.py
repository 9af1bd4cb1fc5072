"""The links between TPU cores and what a collective costs on them, from its messages.

A rank is one JAX device (one TensorCore on TPU7x); two ranks share a chip. A message from a rank
to another takes `latency + bytes / bandwidth` on the link between them: the *sibling* link to the
other core of the same chip, or *ICI* to a core of another chip. A collective is priced from the
messages of its algorithm (`price`): every round starts when the previous one ends, and within a
round a rank's messages over one link share that link's bandwidth, so a round lasts
`max over links (latency + bytes the rank sends on it / bandwidth)`.

  one-shot    one round: every member sends its message to every other member at once
  ring        n - 1 rounds (all-gather) or 2 (n - 1) (all-reduce: reduce-scatter then all-gather,
              messages of 1/n of the vector), each one message to the next member
  two-level   sibling first, then ICI: siblings exchange (all-reduce: add) over the sibling link,
              then each core sends its share to its counterpart on every other chip in one round;
              an all-reduce ends with the siblings exchanging their halves

Closed forms (one link of latency a and bandwidth b, n members, message m bytes):
one-shot a + (n - 1) m / b; ring all-gather (n - 1)(a + m / b); ring all-reduce of an m-byte
vector 2 (n - 1)(a + m / (n b)). tests/test_interconnect.py holds `price` to them.

Figures (TPU7x) and their sources are in `Interconnect.sources`: the release measured the ICI
bandwidth (~45 GB/s per core per direction) and two sibling copies (101 GB/s at 256 KiB, 610 GB/s
at 16 MiB); a line through those two points gives the sibling link's latency and bandwidth. No
public figure gives the ICI latency: ASSUMPTION, the sibling fit's (a DMA's issue and completion
cost, the same engine). Override any field with `interconnect(chip, **fields)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from mkresearch.chips import with_overrides

ALGORITHMS = ("one-shot", "ring", "two-level")
OPS = ("all_gather", "all_reduce", "chain")
KIB, MIB = 2**10, 2**20
# spec/tpu.md: the release's measured remote VMEM copy to the sibling core: (bytes, bytes/s)
SIBLING_MEASURED = ((256 * KIB, 101e9), (16 * MIB, 610e9))
ICI_BANDWIDTH = 45e9  # spec/tpu.md: cross-chip links, measured by the release, per core per direction


def fit_link(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of the line t = latency + bytes / bandwidth through two measured
    (bytes, effective bytes/s) points."""
    (s1, r1), (s2, r2) = small, large
    t1, t2 = s1 / r1, s2 / r2
    bandwidth = (s2 - s1) / (t2 - t1)
    return t1 - s1 / bandwidth, bandwidth


@dataclass(frozen=True)
class Link:
    latency: float  # seconds from issuing a message to its first byte arriving
    bandwidth: float  # bytes/s one rank can send on it

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Interconnect:
    """The links of one rank: its sibling core on the same chip, and ICI to other chips."""

    chip: str
    cores_per_chip: int
    sibling_latency: float
    sibling_bandwidth: float
    ici_latency: float
    ici_bandwidth: float
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("sibling_bandwidth", "ici_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"Interconnect.{name}={value!r} is invalid: bytes/s, a finite "
                                 "number > 0")
        for name in ("sibling_latency", "ici_latency"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1e-3):
                raise ValueError(f"Interconnect.{name}={value!r} is invalid: seconds in [0, 1e-3)")
        if not (isinstance(self.cores_per_chip, int) and self.cores_per_chip >= 1):
            raise ValueError(f"Interconnect.cores_per_chip={self.cores_per_chip!r} is invalid: "
                             "an int >= 1")

    @property
    def sibling(self) -> Link:
        return Link(self.sibling_latency, self.sibling_bandwidth)

    @property
    def ici(self) -> Link:
        return Link(self.ici_latency, self.ici_bandwidth)

    def chip_of(self, rank: int) -> int:
        return rank // self.cores_per_chip

    def link(self, src: int, dst: int) -> Link:
        return self.sibling if self.chip_of(src) == self.chip_of(dst) else self.ici


def _tpu7x() -> Interconnect:
    latency, bandwidth = fit_link(*SIBLING_MEASURED)
    (s1, r1), (s2, r2) = SIBLING_MEASURED
    fit = (f"fit through the release's two sibling copies ({s1 // KIB} KiB at {r1 / 1e9:g} GB/s, "
           f"{s2 // MIB} MiB at {r2 / 1e9:g} GB/s; spec/tpu.md)")
    return Interconnect(
        chip="tpu7x", cores_per_chip=2, sibling_latency=latency, sibling_bandwidth=bandwidth,
        ici_latency=latency, ici_bandwidth=ICI_BANDWIDTH,
        sources=MappingProxyType({
            "cores_per_chip": "spec/tpu.md: 2 TensorCores per chip, each its own JAX device",
            "sibling_latency": fit, "sibling_bandwidth": fit,
            "ici_latency": "ASSUMPTION: no public figure; the sibling fit's latency (a DMA's "
                           "issue and completion cost)",
            "ici_bandwidth": "spec/tpu.md: measured by the release, ~45 GB/s per core per "
                             "direction; ASSUMPTION: all of a core's ICI messages share it",
        }))


INTERCONNECTS = {"tpu7x": _tpu7x}


def interconnect(chip: str | Interconnect = "tpu7x", **overrides: Any) -> Interconnect:
    """The links of `chip` (figures with sources), optionally overridden (source "override")."""
    if isinstance(chip, Interconnect):
        base = chip
    elif chip in INTERCONNECTS:
        base = INTERCONNECTS[chip]()
    else:
        raise ValueError(f"chip={chip!r} is invalid: the interconnect is known for "
                         f"{', '.join(INTERCONNECTS)} only (spec/tpu.md has no link figures for "
                         "the others)")
    return with_overrides(base, overrides, "interconnect", fixed=("chip",))


# ---- collectives ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Price:
    """A collective's cost on one rank: rounds, messages it sends, bytes per link, seconds."""

    rounds: int
    messages: int
    bytes_by_link: Mapping[str, float]
    seconds: float


def _round(inter: Interconnect, me: int, peers: list[int], nbytes: float) -> tuple[float, dict, int]:
    """One round in which rank `me` sends `nbytes` to each of `peers` at once ->
    (seconds, bytes by link name, messages)."""
    by_link: dict[str, float] = {}
    for peer in peers:
        name = "sibling" if inter.chip_of(me) == inter.chip_of(peer) else "ici"
        by_link[name] = by_link.get(name, 0.0) + nbytes
    links = {"sibling": inter.sibling, "ici": inter.ici}
    return max((links[n].seconds(b) for n, b in by_link.items()), default=0.0), by_link, len(peers)


def check_collective(op: str, algorithm: str, group: tuple[int, ...], nbytes: float) -> None:
    if op not in OPS:
        raise ValueError(f"op={op!r} is invalid: one of {OPS}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is invalid: one of {ALGORITHMS}")
    if len(group) < 1 or len(set(group)) != len(group):
        raise ValueError(f"group={group!r} is invalid: distinct ranks, at least one")
    if not nbytes >= 0:
        raise ValueError(f"nbytes={nbytes!r} is invalid: bytes >= 0")


def price(inter: Interconnect, op: str, algorithm: str, group: tuple[int, ...],
          nbytes: float, rank: int | None = None) -> Price:
    """What `op` costs the members of `group` (ranks), priced on `rank`'s links (default: the
    first member). nbytes: all_gather, each member's piece; all_reduce, the whole vector; chain,
    the running sum passed member to member (len(group) - 1 hops, one after another)."""
    check_collective(op, algorithm, group, nbytes)
    group = tuple(group)
    n = len(group)
    me = group[0] if rank is None else rank
    if n == 1:
        return Price(0, 0, MappingProxyType({}), 0.0)
    rounds: list[tuple[float, dict, int]] = []
    if op == "chain":  # each hop waits for the one before: a ring walked once
        rounds = [_round(inter, group[i], [group[i + 1]], nbytes) for i in range(n - 1)]
    elif algorithm == "one-shot":
        piece = nbytes  # all_reduce one-shot: every member sends its whole vector to every other
        rounds = [_round(inter, me, [p for p in group if p != me], piece)]
    elif algorithm == "ring":
        piece = nbytes if op == "all_gather" else nbytes / n
        hops = [inter.link(group[i], group[(i + 1) % n]).seconds(piece) for i in range(n)]
        _, by_link, _ = _round(inter, me, [group[(group.index(me) + 1) % n]], piece)
        # every member sends at once; a round ends when its slowest hop has arrived
        rounds = [(max(hops), by_link, 1)] * ((n - 1) if op == "all_gather" else 2 * (n - 1))
    else:
        rounds = _two_level(inter, op, group, me, nbytes)
    merged: dict[str, float] = {}
    for _, by_link, _ in rounds:
        for name, b in by_link.items():
            merged[name] = merged.get(name, 0.0) + b
    return Price(len(rounds), sum(m for _, _, m in rounds), MappingProxyType(merged),
                 sum(s for s, _, _ in rounds))


def _two_level(inter: Interconnect, op: str, group: tuple[int, ...], me: int,
               nbytes: float) -> list[tuple[float, dict, int]]:
    siblings = [p for p in group if p != me and inter.chip_of(p) == inter.chip_of(me)]
    on_chip = 1 + len(siblings)
    # one counterpart per other chip of the group: this core's share of its chip's data
    counterparts = sorted({inter.chip_of(p) for p in group} - {inter.chip_of(me)})
    remote = [next(p for p in group if inter.chip_of(p) == c) for c in counterparts]
    rounds = []
    if op == "all_gather":  # the chip's pieces are the siblings' pieces: ICI first, then share
        if remote:
            rounds.append(_round(inter, me, remote, nbytes))
        if siblings:
            rounds.append(_round(inter, me, siblings, nbytes * (1 + len(remote))))
        return rounds
    if siblings:  # all_reduce: add the siblings' vectors, then each core its 1/on_chip share
        rounds.append(_round(inter, me, siblings, nbytes))
    if remote:
        rounds.append(_round(inter, me, remote, nbytes / on_chip))
    if siblings:
        rounds.append(_round(inter, me, siblings, nbytes / on_chip))
    return rounds
