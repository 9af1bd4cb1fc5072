"""Which algorithm each collective should use, chosen from the interconnect model, with the reason.

`choose(inter, kind, group, payload_bytes)` prices the candidates of the collective's kind on the
slice (`interconnect.price`: phases of one-shot messages over the routes) and keeps the fastest:

  one-shot   every member pushes its piece (an all-reduce: its whole partial vector) to every peer
             at once: one phase; wins when a phase's latency dominates and the group sits in one
             host, or the payload is so small that the extra phase of two-level costs more than
             the injection it saves
  two-level  a one-shot among the members of each host, then one among the hosts (the release's
             all-reduce on 4 hosts x 8 cores): two phases, but each core injects 7 + 3 messages
             instead of 31: wins once the one-shot's injection outweighs a phase's latency
  rs-ag      reduce-scatter + all-gather (an all-reduce only): every message carries 1 / n of
             the vector: wins for large payloads (the release's B >= 6 variants)

A chain (the exact mode's experts' running sum) is serial by construction: "chain", its price
the chain's. Ties go to fewer phases, then to the order above. Rings are not candidates: their
n - 1 phases never win at decode payloads (docs/collectives.md: the release has none).
The collective schedule of the sharded megakernel (`kernels/compose/collective_schedule.py`) takes its
`algorithm` field from here; `scale_out` prices each collective by it and `mkresearch plan
--ranks` prints the reason.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from mkresearch.kernels.compose import collective_schedule as contract
from mkresearch.kernels.compose.megakernel_plan import MegakernelOptions
from mkresearch.kernels.sharded.levels import REDUCTION_ALGORITHMS
from mkresearch.prediction import interconnect as links
from mkresearch.sharding import layout as layouts

# candidates per kind, in tie-break order (interconnect.ALGORITHMS names)
CANDIDATES = {"all_gather": ("one-shot", "two-level"),
              "all_reduce": ("one-shot", "two-level", "rs-ag"),
              "chain": ("chain",)}
# the collective schedule's spellings of a kind and of an algorithm
KIND_ALIASES = {"all-gather": "all_gather", "all-reduce": "all_reduce"}
ALGORITHM_ALIASES = {"reduce-scatter+all-gather": "rs-ag"}
US = 1e-6


@dataclass(frozen=True)
class Choice:
    """The algorithm chosen for one collective, its price and why."""

    algorithm: str  # one of CANDIDATES[kind]
    seconds: float
    phases: int
    messages: int  # messages one member sends
    reason: str
    candidates: tuple[tuple[str, float], ...]  # (algorithm, seconds) of every candidate priced


def price_algorithm(inter: links.Interconnect, kind: str, algorithm: str, group: tuple[int, ...],
                    payload_bytes: float) -> links.Price:
    """`interconnect.price` under either spelling of the kind and algorithm ("chain" for a
    chain, whose price does not depend on the algorithm)."""
    op = KIND_ALIASES.get(kind, kind)
    algorithm = ALGORITHM_ALIASES.get(algorithm, algorithm)
    return links.price(inter, op, "one-shot" if algorithm == "chain" else algorithm,
                       tuple(group), float(payload_bytes))


@functools.lru_cache(maxsize=4096)
def choose(inter: links.Interconnect, kind: str, group: tuple[int, ...],
           payload_bytes: float) -> Choice:
    """The fastest candidate algorithm for `kind` ("all_gather" / "all-gather", "all_reduce" /
    "all-reduce", "chain") over `group` with `payload_bytes` (an all-gather: one member's
    piece; an all-reduce: the whole vector; `interconnect.price`), with the reason."""
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


def _reason(inter, op, best, group, payload_bytes, priced) -> str:
    n = len(group)
    hosts = len({inter.slice.host_of(r) for r in group})
    chips = len({inter.slice.chip_of(r) for r in group})
    where = (f"{n} ranks on {hosts} hosts" if hosts > 1 else
             f"{n} ranks on {chips} chip{'s' if chips > 1 else ''} of one host")
    size = f"{payload_bytes / 1024:.3g} KiB"
    if op == "chain" or n == 1:
        why = "serial by construction" if op == "chain" else "a group of one: nothing moves"
        return f"{best}: {why} ({where})"
    others = ", ".join(f"{a} {q.seconds / US:.3g} us" for a, q in priced if a != best)
    costs = dict(priced)[best]
    head = f"{best} {costs.seconds / US:.3g} us in {costs.phases} phase" \
           f"{'s' if costs.phases != 1 else ''} ({where}, {size})"
    why = {"one-shot": "the group sits in one host: two-level is one-shot here" if hosts == 1
           else "one phase: a phase's latency outweighs what fewer messages per core save",
           "two-level": "each core injects its host's peers then the other hosts' counterparts, "
                        "not every peer at once: the one-shot's injection outweighs a phase",
           "rs-ag": "large payload: each message carries 1/n of the vector",
           "chain": ""}[best]
    return f"{head}; {why}" + (f"; vs {others}" if others else "")


def choose_for(inter: links.Interconnect, ops) -> tuple[tuple[object, Choice], ...]:
    """(op, Choice) for each collective of a schedule (`collective_schedule.CollectiveOp`: its
    kind, group and payload_bytes)."""
    return tuple((op, choose(inter, op.kind, tuple(op.group), float(op.payload_bytes)))
                 for op in ops)


def assign(inter: links.Interconnect, ops) -> tuple:
    """The schedule's ops with each `algorithm` field set to its choice (dataclasses with kind,
    group, payload_bytes and algorithm: `collective_schedule.CollectiveOp`)."""
    return tuple(dataclasses.replace(op, algorithm=c.algorithm) for op, c in choose_for(inter, ops))


@dataclass(frozen=True)
class KernelReductions:
    """How our sharded megakernel sends its partial-sum reductions on a slice: the options it is
    built with (`MegakernelOptions.reductions`, `.ranks_per_host`) and each choice's reason."""

    reductions: tuple[tuple[str, str], ...]  # (name, algorithm) of those not sent one-shot
    ranks_per_host: int  # the slice's (0: every rank of the layout on one host)
    reasons: tuple[tuple[str, str], ...]  # (name, why) of every reduction

    def options(self, **fields) -> MegakernelOptions:
        """The kernel's options with these reductions (`fields`: the other options)."""
        return MegakernelOptions(reductions=self.reductions, ranks_per_host=self.ranks_per_host,
                                 **fields)


def ranks_per_host(inter: links.Interconnect, n_ranks: int) -> int:
    """Consecutive ranks sharing a host on the slice (0 when all n_ranks fit in one)."""
    per_host = inter.slice.cores_per_chip * inter.slice.chips_per_host
    return per_host if per_host < n_ranks and n_ranks % per_host == 0 else 0


@functools.lru_cache(maxsize=256)
def kernel_reductions(lay: layouts.Layout, batch: int, wire: str = "f32", chip: str = "tpu7x",
                      inter: links.Interconnect | None = None) -> KernelReductions:
    """Our kernel's partial-sum reductions on `chip`'s slice for `lay` at `batch`: each by the
    algorithm `choose` prices fastest (every one the kernel can send: REDUCTION_ALGORITHMS), with
    the slice's hosts (one source: the CLI builds the kernel with it, `scale_out` prices the
    step with it). Exact mode, or one rank: none."""
    if lay.collectives != layouts.PARTIAL_SUM or lay.n_ranks == 1:
        return KernelReductions((), 0, ())
    inter = inter or links.interconnect(chip, n_ranks=lay.n_ranks)
    chosen: dict[str, Choice] = {}
    for op in contract.collective_schedule(lay, batch, lay.collectives, wire):
        if op.kind == "all-reduce" and op.role == "sum" and op.name not in chosen:
            chosen[op.name] = choose(inter, op.kind, tuple(op.group), float(op.payload_bytes))
    if any(c.algorithm not in REDUCTION_ALGORITHMS for c in chosen.values()):
        raise ValueError(f"a reduction's choice is not one the kernel sends: {chosen}")
    return KernelReductions(
        tuple(sorted((n, c.algorithm) for n, c in chosen.items() if c.algorithm != "one-shot")),
        ranks_per_host(inter, lay.n_ranks), tuple(sorted((n, c.reason) for n, c in chosen.items())))


def kernel_options(lay: layouts.Layout, batch: int, chip: str = "tpu7x",
                   wire: str = "f32") -> MegakernelOptions:
    """The sharded megakernel's options for `chip` with its reductions as `kernel_reductions`
    chooses them (what the CLI and the recorded compiles build)."""
    return kernel_reductions(lay, batch, wire, chip).options(chip=chip)


def sent_algorithm(op) -> str:
    """The `interconnect` algorithm a contract collective (`CollectiveOp`) is sent with by the
    kernel (a chain: "one-shot", its price being the chain's)."""
    return "one-shot" if op.kind == "chain" else ALGORITHM_ALIASES.get(op.algorithm,
                                                                       op.algorithm)
