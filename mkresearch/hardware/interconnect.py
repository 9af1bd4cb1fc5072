"""The links between TPU cores and what a collective costs on them, priced by phases of messages.

A rank is one JAX device (one TensorCore on TPU7x). Its links (`mkresearch.hardware.topology`): the
sibling path to the other core of its chip, and the chip's ICI links by direction in the slice's
torus. A collective is a sequence of *phases*; in a phase every member pushes its messages at once
(one-shot: to every peer, farthest first, then waits on semaphores), each message routed over the
links between its source and destination chips, messages on different links in parallel. A phase
lasts

    ICI:      ici_latency + hop_latency x (hops beyond the measured slice's farthest)
              + max(bytes on the busiest link / ici_bandwidth,
                    bytes a core injects / injection_bandwidth)
    sibling:  sibling_latency + bytes to the sibling / sibling_bandwidth   (its own path)

whichever is longer; phases run one after another (`price`). Algorithms (n members, m bytes):

  one-shot   all_gather: 1 phase, m to every peer; all_reduce: 1 phase, the whole vector to every
             peer, each sums locally (the release's partial sums)
  two-level  a one-shot inside each host, then one among the hosts (the same core of every other
             host, `rank ^ 8, ^ 16, ^ 24` on tpu7x:2x2x4): 2 phases when the group spans hosts
  rs-ag      reduce-scatter + all-gather, both one-shot (messages of m / members): 2 phases in one
             host (the second model's 14 messages in 2 phases); over hosts the reduce-scatter
             and the all-gather stay in the host and the owned slice is all-reduced one-shot
             across hosts between them (3 phases)
  ring       all_gather n - 1 phases of m to the next member; all_reduce 2 (n - 1) of m / n
  chain      (op) the running sum passed member to member: n - 1 phases of one message
  reduce_scatter (op) one-shot only: 1 phase in which every member sends every peer that peer's
             chunk of its vector (m: the chunk), each adding the chunks it receives: the
             messages of a one-shot all-gather of the chunk (the restructured mode's rho,
             `kernels/sharded/collective_ops.py`'s kind "reduce-scatter")

`choose(inter, kind, group, payload_bytes)` keeps the fastest of a kind's CANDIDATES, with the
reason: one-shot wins when a phase's latency dominates (or the group sits in one host),
two-level once the one-shot's injection outweighs a phase, rs-ag for large payloads (each message
1 / n of the vector). A chain is serial by construction. Ties go to fewer phases, then to the
order of CANDIDATES. Rings are not candidates: their n - 1 phases never win at decode payloads
(the release has none). The sharding plan (`mkresearch.kernels.sharded.plan`) picks each
reduction's algorithm here and passes it to the kernel: the choice sits with the prices, below the
model's kernels, so building a kernel never imports the prediction layer.

Figures (`sources`, each labelled MEASURED, PUBLISHED or ASSUMPTION; `explain()` lists them):
the ICI phase latency and link bandwidth are the least-squares line through the release's four
measured all-reduces of its second model (8 cores, rs-ag; docs/collectives.md), whose busiest link
carries the whole vector per phase on tpu7x:2x2x1; the sibling path is the line through the two
measured sibling copies; a core's injection is the measured three-links-together figure. Nothing
here is set from a decode step time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from mkresearch.hardware.chips import with_overrides
from mkresearch.hardware.topology import Slice, get_slice, slice_for

ALGORITHMS = ("two-level", "one-shot", "rs-ag", "ring")
OPS = ("all_gather", "all_reduce", "chain", "reduce_scatter")
KIB, MIB = 2**10, 2**20
US = 1e-6
# docs/tpu.md: the release's measured remote VMEM copy to the sibling core: (bytes, bytes/s)
SIBLING_MEASURED = ((256 * KIB, 101e9), (16 * MIB, 610e9))
# docs/collectives.md: the second model's all-reduces on 8 cores (4 chips), one-shot reduce-scatter
# + all-gather, measured: (payload bytes, seconds); [8, 8192] and [64, 4096] in bf16 and f32
COLLECTIVE_MEASURED = ((8 * 8192 * 2, 7.3 * US), (8 * 8192 * 4, 9.4 * US),
                       (64 * 4096 * 2, 14.5 * US), (64 * 4096 * 4, 25.4 * US))
COLLECTIVE_MEASURED_BF16 = COLLECTIVE_MEASURED[0::2]  # bf16 on the wire, as the release sends
COLLECTIVE_MEASURED_ON = "tpu7x:2x2x1"
# docs/collectives.md §2: the same release's one-shot all-gathers of bf16 on those 8 cores,
# [8, 512] and [8, 1024], measured; not in the fit (the second model's validation checks them)
GATHER_MEASURED = ((8 * 512 * 2, 3.67 * US), (8 * 1024 * 2, 3.87 * US))
ICI_PER_CORE = 45e9  # docs/collectives.md: one cross-chip link, per core per direction, measured
INJECTION_MEASURED = 134e9  # docs/collectives.md: three links together, one core, measured
HOP_LATENCY = 0.5 * US  # docs/collectives.md: "~0.5-1 us per hop is the usual estimate": ASSUMPTION
# published architecture figures, per link one way (docs/collectives.md §3)
PUBLISHED_LINK = {"tpu7x": 100e9, "v5p": 100e9, "v6e": 100e9, "v5e": 50e9}
DEFAULT_SLICE = {"tpu7x": "tpu7x:2x2x4", "v5p": "v5p:2x2x2", "v6e": "v6e:4x4", "v5e": "v5e:4x4"}


def fit_link(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of the line t = latency + bytes / bandwidth through two measured
    (bytes, effective bytes/s) points."""
    (s1, r1), (s2, r2) = small, large
    t1, t2 = s1 / r1, s2 / r2
    bandwidth = (s2 - s1) / (t2 - t1)
    return t1 - s1 / bandwidth, bandwidth


def fit_phases(points, phases: int = 2) -> tuple[float, float]:
    """(phase latency s, link bandwidth B/s): least squares of t = phases (latency + bytes /
    bandwidth) through measured (bytes on the busiest link per phase, seconds) points."""
    xs, ys = [b for b, _ in points], [t / phases for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / \
        sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, 1.0 / slope


@dataclass(frozen=True)
class Link:
    latency: float  # seconds from issuing a message to its first byte arriving
    bandwidth: float  # bytes/s

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Interconnect:
    """The links of a slice: the sibling path, and the chips' ICI links (figures in `sources`)."""

    chip: str
    slice: Slice
    sibling_latency: float
    sibling_bandwidth: float
    ici_latency: float  # one ICI phase: issue, semaphores, the first byte (measured slice's hops)
    ici_bandwidth: float  # one chip link, one direction, shared by the chip's cores
    injection_bandwidth: float  # what one core pushes over all its links together
    hop_latency: float  # each hop beyond the farthest of the slice ici_latency was measured on
    measured_hops: int = 2
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("sibling_bandwidth", "ici_bandwidth", "injection_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and not math.isnan(value)):
                raise ValueError(f"Interconnect.{name}={value!r} is invalid: bytes/s, a number > 0")
        for name in ("sibling_latency", "ici_latency", "hop_latency"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1e-3):
                raise ValueError(f"Interconnect.{name}={value!r} is invalid: seconds in [0, 1e-3)")
        if not isinstance(self.slice, Slice):  # bad input: a ValueError, the house rule
            raise ValueError(  # noqa: TRY004
                f"Interconnect.slice={self.slice!r} is invalid: a topology.Slice")

    @property
    def cores_per_chip(self) -> int:
        return self.slice.cores_per_chip

    @property
    def sibling(self) -> Link:
        return Link(self.sibling_latency, self.sibling_bandwidth)

    @property
    def ici(self) -> Link:
        return Link(self.ici_latency, self.ici_bandwidth)

    def chip_of(self, rank: int) -> int:
        return self.slice.chip_of(rank)

    def explain(self) -> list[tuple[str, float, str]]:
        """(field, value, source) of every figure, its source saying MEASURED / PUBLISHED /
        ASSUMPTION / override."""
        return [(k, getattr(self, k), self.sources.get(k, "")) for k in FIGURES]


FIGURES = ("sibling_latency", "sibling_bandwidth", "ici_latency", "ici_bandwidth",
           "injection_bandwidth", "hop_latency")


def _figures(chip: str) -> tuple[dict, dict]:
    sib_latency, sib_bandwidth = fit_link(*SIBLING_MEASURED)
    phase_latency, link_bandwidth = fit_phases(COLLECTIVE_MEASURED)
    (s1, r1), (s2, r2) = SIBLING_MEASURED
    sib = (f"MEASURED: line through the release's two sibling copies ({s1 // KIB} KiB at "
           f"{r1 / 1e9:g} GB/s, {s2 // MIB} MiB at {r2 / 1e9:g} GB/s; docs/tpu.md)")
    coll = ("MEASURED: least-squares line through the release's 4 all-reduces on 8 cores "
            "([8, 8192] 7.3 / 9.4 us, [64, 4096] 14.5 / 25.4 us bf16 / f32; rs-ag, 2 phases, the "
            "busiest link carrying the vector each phase; docs/collectives.md)")
    values = {"sibling_latency": sib_latency, "sibling_bandwidth": sib_bandwidth,
              "ici_latency": phase_latency, "ici_bandwidth": link_bandwidth,
              "injection_bandwidth": INJECTION_MEASURED, "hop_latency": HOP_LATENCY}
    sources = {"sibling_latency": sib, "sibling_bandwidth": sib, "ici_latency": coll,
               "ici_bandwidth": coll + f"; cross-check: PUBLISHED ~100 GB/s per link, 2 cores x "
                                       f"{ICI_PER_CORE / 1e9:g} GB/s MEASURED per core",
               "injection_bandwidth": "MEASURED: one core over three links together, 134 GB/s "
                                      "(docs/collectives.md)",
               "hop_latency": f"ASSUMPTION: {HOP_LATENCY / US:g} us per hop beyond the 2 of the "
                              "measured 4-chip slice (docs/collectives.md: ~0.5-1 us usual)"}
    if chip != "tpu7x":  # no measured collective on these chips: their link is the published one
        axes = len(get_slice(DEFAULT_SLICE[chip]).dims)
        values |= {"ici_bandwidth": PUBLISHED_LINK[chip],
                   "injection_bandwidth": PUBLISHED_LINK[chip] * 2 * axes}
        sources |= {"ici_bandwidth": "PUBLISHED: architecture figure per link one way "
                                     "(docs/collectives.md)",
                    "injection_bandwidth": "ASSUMPTION: every link of the chip at once",
                    "ici_latency": "ASSUMPTION: TPU7x's measured phase latency",
                    "sibling_latency": "ASSUMPTION: one core per device (unused)",
                    "sibling_bandwidth": "ASSUMPTION: one core per device (unused)"}
    return values, sources


def interconnect(chip: str | Interconnect = "tpu7x", *, n_ranks: int | None = None,
                 slice: str | Slice | None = None, **overrides: Any) -> Interconnect:
    """The links of `chip` on its slice (named, or the one with n_ranks ranks, default the
    release's), figures with sources, optionally overridden (source "override")."""
    if isinstance(chip, Interconnect):
        base = chip
        if slice is not None or n_ranks is not None:
            base = with_overrides(base, {"slice": get_slice(slice) if slice is not None
                                         else slice_for(base.chip, n_ranks)}, "interconnect",
                                  fixed=("chip",))
    elif chip in DEFAULT_SLICE:
        sl = get_slice(slice) if slice is not None else \
            slice_for(chip, n_ranks) if n_ranks is not None else get_slice(DEFAULT_SLICE[chip])
        values, sources = _figures(chip)
        sources["slice"] = f"{sl.name}: docs/collectives.md (torus, wraparound, cores per chip)"
        base = Interconnect(chip=chip, slice=sl, **values, sources=MappingProxyType(sources))
    else:
        raise ValueError(f"chip={chip!r} is invalid: the interconnect is known for "
                         f"{', '.join(DEFAULT_SLICE)}")
    return with_overrides(base, overrides, "interconnect", fixed=("chip",))


INTERCONNECTS = tuple(DEFAULT_SLICE)


# ---- collectives, by phases ---------------------------------------------------------------------
@dataclass(frozen=True)
class Price:
    """A collective's cost: phases, messages one member sends, busiest-link bytes, seconds."""

    phases: int
    messages: int
    link_bytes: float  # bytes on the busiest ICI link, summed over phases
    seconds: float


def phase_seconds(inter: Interconnect, messages) -> tuple[float, float]:
    """(seconds, busiest-link bytes) of one phase: messages (src rank, dst rank, bytes) sent at
    once, each over its route."""
    sibling: dict[int, float] = {}
    links: dict[tuple, float] = {}
    injected: dict[int, float] = {}
    hops = 0
    for src, dst, nbytes in messages:
        route = inter.slice.route(src, dst)
        if not route:
            sibling[src] = sibling.get(src, 0.0) + nbytes
            continue
        injected[src] = injected.get(src, 0.0) + nbytes
        hops = max(hops, len(route))
        for link in route:
            links[link] = links.get(link, 0.0) + nbytes
    seconds, busiest = 0.0, max(links.values(), default=0.0)
    if sibling:
        seconds = inter.sibling_latency + max(sibling.values()) / inter.sibling_bandwidth
    if links:
        seconds = max(seconds, inter.ici_latency + inter.hop_latency * max(0, hops -
                      inter.measured_hops) + max(busiest / inter.ici_bandwidth,
                                                 max(injected.values()) / inter.injection_bandwidth))
    return seconds, busiest


def check_collective(op: str, algorithm: str, group: tuple[int, ...], nbytes: float) -> None:
    if op not in OPS:
        raise ValueError(f"op={op!r} is invalid: one of {OPS}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is invalid: one of {ALGORITHMS}")
    if len(group) < 1 or len(set(group)) != len(group):
        raise ValueError(f"group={group!r} is invalid: distinct ranks, at least one")
    if not nbytes >= 0:
        raise ValueError(f"nbytes={nbytes!r} is invalid: bytes >= 0")
    if op == "reduce_scatter" and algorithm not in CANDIDATES[op]:
        raise ValueError(f"algorithm={algorithm!r} is invalid for a reduce_scatter: one of "
                         f"{CANDIDATES[op]} (one phase, each member sending each peer its chunk)")


def phases_of(inter: Interconnect, op: str, algorithm: str, group: tuple[int, ...],
              nbytes: float) -> list[list[tuple[int, int, float]]]:
    """The phases of a collective: each the list of (src, dst, bytes) its members send at once."""
    n = len(group)
    if n == 1:
        return []
    if op == "chain":
        return [[(group[i], group[i + 1], nbytes)] for i in range(n - 1)]

    def one_shot(members, m):
        return [(a, b, m) for a in members for b in members if a != b]

    if algorithm == "one-shot":  # a reduce_scatter's too: each peer its chunk (nbytes)
        return [one_shot(group, nbytes)]
    if algorithm == "ring":
        piece = nbytes if op == "all_gather" else nbytes / n
        hop = [(group[i], group[(i + 1) % n], piece) for i in range(n)]
        return [hop] * ((n - 1) if op == "all_gather" else 2 * (n - 1))
    hosts: dict[int, list[int]] = {}
    for r in group:
        hosts.setdefault(inter.slice.host_of(r), []).append(r)
    local = list(hosts.values())
    # the counterparts: the i-th member of every host (hosts of equal membership)
    across = [list(c) for c in zip(*local, strict=False)] if len(local) > 1 else []
    if algorithm == "rs-ag" and op == "all_reduce":
        h = len(local[0])
        piece = nbytes / h
        rs = [msg for members in local for msg in one_shot(members, piece)]
        middle = [msg for members in across for msg in one_shot(members, piece)]
        return [p for p in (rs, middle, rs) if p]
    if algorithm == "rs-ag":  # a gather has nothing to scatter: one-shot
        return [one_shot(group, nbytes)]
    first = [msg for members in local for msg in one_shot(members, nbytes)]
    second = [msg for members in across for msg in one_shot(
        members, nbytes * (len(local[0]) if op == "all_gather" else 1))]
    return [p for p in (first, second) if p]


@functools.lru_cache(maxsize=4096)
def price(inter: Interconnect, op: str, algorithm: str, group: tuple[int, ...],
          nbytes: float, rank: int | None = None) -> Price:
    """What `op` costs the members of `group` (ranks of inter.slice). nbytes: all_gather, each
    member's piece; all_reduce, the whole vector; chain, the running sum; reduce_scatter, the
    chunk each member sends each peer. `rank` (default the first member) is whose messages are
    counted."""
    check_collective(op, algorithm, group, nbytes)
    group = tuple(group)
    if max(group) >= inter.slice.n_ranks:
        raise ValueError(f"group={group!r} is invalid on {inter.slice.name}: ranks < "
                         f"{inter.slice.n_ranks}")
    me = group[0] if rank is None else rank
    phases = phases_of(inter, op, algorithm, group, nbytes)
    seconds = busiest = 0.0
    for phase in phases:
        s, b = phase_seconds(inter, phase)
        seconds, busiest = seconds + s, busiest + b
    sent = sum(1 for phase in phases for src, _, _ in phase if src == me)
    return Price(len(phases), sent, busiest, seconds)


# ---- the cheapest algorithm ------------------------------------------------------------------
# candidates per op, in tie-break order
CANDIDATES = {"all_gather": ("one-shot", "two-level"),
              "all_reduce": ("one-shot", "two-level", "rs-ag"),
              "chain": ("chain",),
              "reduce_scatter": ("one-shot",)}  # the one way the kernel sends it
# the collective ops' spellings (`kernels.sharded.collective_ops`) of an op and of an algorithm
KIND_ALIASES = {"all-gather": "all_gather", "all-reduce": "all_reduce",
                "reduce-scatter": "reduce_scatter"}
ALGORITHM_ALIASES = {"reduce-scatter+all-gather": "rs-ag"}


@dataclass(frozen=True)
class Choice:
    """The algorithm chosen for one collective, its price and why."""

    algorithm: str  # one of CANDIDATES[op]
    seconds: float
    phases: int
    messages: int  # messages one member sends
    reason: str
    candidates: tuple[tuple[str, float], ...]  # (algorithm, seconds) of every candidate priced


def price_algorithm(inter: Interconnect, kind: str, algorithm: str, group: tuple[int, ...],
                    payload_bytes: float) -> Price:
    """`price` under either spelling of the kind and algorithm ("chain" for a chain, whose
    price does not depend on the algorithm)."""
    op = KIND_ALIASES.get(kind, kind)
    algorithm = ALGORITHM_ALIASES.get(algorithm, algorithm)
    return price(inter, op, "one-shot" if algorithm == "chain" else algorithm, tuple(group),
                 float(payload_bytes))


@functools.lru_cache(maxsize=4096)
def choose(inter: Interconnect, kind: str, group: tuple[int, ...], payload_bytes: float) -> Choice:
    """The fastest candidate algorithm for `kind` ("all_gather" / "all-gather", "all_reduce" /
    "all-reduce", "chain", "reduce_scatter" / "reduce-scatter") over `group` with
    `payload_bytes` (an all-gather: one member's piece; an all-reduce: the whole vector; a
    reduce-scatter: the chunk each member sends each peer; `price`), with the reason."""
    op = KIND_ALIASES.get(kind, kind)
    if op not in CANDIDATES:
        raise ValueError(f"kind={kind!r} is invalid: one of {', '.join(CANDIDATES)} "
                         f"(or {', '.join(KIND_ALIASES)})")
    group = tuple(group)
    priced = [(a, price_algorithm(inter, op, a, group, payload_bytes)) for a in CANDIDATES[op]]
    best, p = min(priced, key=lambda ap: (round(ap[1].seconds / US, 6), ap[1].phases))
    return Choice(best, p.seconds, p.phases, p.messages,
                  _reason(inter, op, best, group, payload_bytes, priced),
                  tuple((a, q.seconds) for a, q in priced))


def _where(inter: Interconnect, group: tuple[int, ...]) -> tuple[int, str]:
    """(hosts, the group in words) of a group on the slice."""
    hosts = len({inter.slice.host_of(r) for r in group})
    chips = len({inter.slice.chip_of(r) for r in group})
    where = (f"{len(group)} ranks on {hosts} hosts" if hosts > 1 else
             f"{len(group)} ranks on {chips} chip{'s' if chips > 1 else ''} of one host")
    return hosts, where


WHY = {"two-level": "each core injects its host's peers then the other hosts' counterparts, not "
                    "every peer at once: the one-shot's injection outweighs a phase",
       "rs-ag": "large payload: each message carries 1/n of the vector", "chain": ""}
SCATTER_WHY = ("one phase, each member sending each peer that peer's chunk (a reduce-scatter's "
               "only way)")


def _reason(inter, op, best, group, payload_bytes, priced) -> str:
    hosts, where = _where(inter, group)
    if op == "chain" or len(group) == 1:
        why = "serial by construction" if op == "chain" else "a group of one: nothing moves"
        return f"{best}: {why} ({where})"
    others = ", ".join(f"{a} {q.seconds / US:.3g} us" for a, q in priced if a != best)
    costs = dict(priced)[best]
    head = f"{best} {costs.seconds / US:.3g} us in {costs.phases} phase" \
           f"{'s' if costs.phases != 1 else ''} ({where}, {payload_bytes / 1024:.3g} KiB)"
    why = SCATTER_WHY if op == "reduce_scatter" else WHY.get(best) or (
        "the group sits in one host: two-level is one-shot here" if hosts == 1
        else "one phase: a phase's latency outweighs what fewer messages per core save")
    return f"{head}; {why}" + (f"; vs {others}" if others else "")


def ranks_per_host(inter: Interconnect, n_ranks: int) -> int:
    """Consecutive ranks sharing a host on the slice (0 when all n_ranks fit in one)."""
    per_host = inter.slice.cores_per_chip * inter.slice.chips_per_host
    return per_host if per_host < n_ranks and n_ranks % per_host == 0 else 0
