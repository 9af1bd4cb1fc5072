"""The timeline model over many ranks: every rank's program simulated together, joined at its
collectives: one simulator for a scale-out prediction's programs (`simulate_programs`) and for
the recorded logs of a sharded step (`simulate_ranks`).

Each rank runs its own program (`timeline.RankSimulation`: DMAs on its own HBM, phases on its own
compute unit). A collective joins the ranks of its group: it starts when the last member arrives
(a collective waits for its slowest peer) and ends after the messages of its algorithm
(`mkresearch.hardware.interconnect.price`, over its `path`: a rank may stand for others that run
the same program). A collective started early and waited later overlaps the work between
(a scale-out program's `("start", ..., blocking=False)` and `("wait", name)`); a recorded log's
collectives block. The weight DMAs a rank issued before it keep moving meanwhile: a collective
hides behind HBM traffic only as far as the stream runs ahead. The programs are SPMD: every rank
meets the same collectives in the same order (groups may differ, e.g. each expert group its own).

`RanksTimeline.decomposition()` splits the slowest rank's step exactly: the HBM floor (its DMA
bytes at full bandwidth: HBM moves bytes in exactly that much time) plus the time HBM is idle,
told apart by what the program does meanwhile: waiting for peers, moving collective messages,
computing, or nothing (a bubble: DMA latency, a fetch that could not be issued earlier).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mkresearch.hardware import interconnect as links
from mkresearch.kernels.base import dma
from mkresearch.prediction.timeline import (
    RankSimulation,
    Timeline,
    TimelineChip,
    merge_intervals,
    timeline_chip,
)
from mkresearch.prediction.timeline_events import events_of

PARTS = ("hbm_floor", "waiting_for_peers", "collective_messages", "compute", "bubble")


@dataclass(frozen=True)
class CollectiveRun:
    """One collective of one group: when its members arrived, when it started and ended."""

    name: str
    op: str
    group: tuple[int, ...]
    nbytes: int
    arrivals: tuple[float, ...]  # per member, in group order
    start: float  # the last arrival
    end: float
    price: links.Price
    waited: tuple[float, ...] = ()  # per member, when it began to wait (default its arrival;
    # later for a collective started early and waited after other work: overlap)

    def wait_from(self, rank: int) -> float:
        i = self.group.index(rank)
        return self.waited[i] if self.waited else self.arrivals[i]

    def chain_seconds(self, rank: int) -> float:
        """Its share of `rank`'s serial chain of collective latencies: its price, or for one
        started early and waited for after other work (overlap: waited later than arrived),
        only the part still to run when the rank began to wait (what the overlap did not hide)."""
        waited = self.wait_from(rank)
        if waited <= self.arrivals[self.group.index(rank)]:
            return self.price.seconds
        return min(self.price.seconds, max(0.0, self.end - waited))


class RanksTimeline:
    """Every rank's simulated step and the collectives that joined them. `timelines` (one per
    rank, `timeline.Timeline`) are built when first asked for: a prediction reads the
    simulations' merged busy intervals directly."""

    def __init__(self, sims: list, collectives: tuple[CollectiveRun, ...],
                 interconnect: links.Interconnect, algorithm: str, ranks: tuple[int, ...]) -> None:
        self.sims, self.collectives, self.interconnect = sims, collectives, interconnect
        self.algorithm, self.ranks = algorithm, ranks
        self._timelines: tuple[Timeline, ...] | None = None

    @property
    def timelines(self) -> tuple[Timeline, ...]:
        """One Timeline per rank, in `ranks` order."""
        if self._timelines is None:
            self._timelines = tuple(s.timeline() for s in self.sims)
        return self._timelines

    def rank_totals(self) -> list[float]:
        """Each rank's step, in `ranks` order."""
        return [s.total for s in self.sims]

    @property
    def total_s(self) -> float:
        return max(self.rank_totals())

    @property
    def slowest_rank(self) -> int:
        """The id of the rank whose step ends last (the lowest id of a tie)."""
        totals = self.rank_totals()
        return self.ranks[max(range(len(totals)), key=lambda i: (totals[i], -i))]

    def timeline(self, rank: int) -> Timeline:
        return self.timelines[self.ranks.index(rank)]

    def dma_bytes(self, rank: int) -> float:
        """The bytes `rank`'s DMAs move in the step."""
        sim = self.sims[self.ranks.index(rank)]
        return sim.dma_bytes if not sim.dmas else sum(d.event.nbytes for d in sim.dmas)

    def decomposition(self, rank: int | None = None) -> dict[str, float]:
        """Seconds of `rank`'s step (default the slowest) by PARTS; they sum to its total."""
        rank = self.slowest_rank if rank is None else rank
        sim = self.sims[self.ranks.index(rank)]
        moving, compute = sim.busy()
        return decompose(sim.total, moving, compute, self.collectives, rank)


def decompose(total_s: float, moving: list, compute: list, collectives, rank: int
              ) -> dict[str, float]:
    """A rank's step by PARTS from its HBM-busy and compute intervals (sorted, disjoint) and the
    collectives it is in: the HBM floor first, then of the time HBM idles waiting for peers,
    collective messages, compute, and the rest (bubbles)."""
    waiting, messages = [], []
    for run in collectives:
        if rank in run.group:  # the part of the collective the rank waits for
            since = run.wait_from(rank)
            waiting.append((since, run.start))
            messages.append((max(since, run.start), run.end))
    layers = (("waiting_for_peers", merge_intervals(waiting)),
              ("collective_messages", merge_intervals(messages)), ("compute", compute))
    out = {"hbm_floor": sum(b - a for a, b in moving)}
    free = _subtract([(0.0, total_s)], moving)
    for name, busy in layers:
        taken = _intersect(free, busy)
        out[name] = sum(b - a for a, b in taken)
        free = _subtract(free, taken)
    out["bubble"] = sum(b - a for a, b in free)
    out["total"] = total_s
    return out


def _intersect(a: list, b: list) -> list:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list, b: list) -> list:
    """a minus b, both sorted and disjoint: one sweep."""
    out, j = [], 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        cursor, k = lo, j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < hi:
            out.append((cursor, hi))
    return out


def simulate_programs(programs: Sequence[Any], blocks: Sequence[float], banks: int, batch: int,
                      ranks: Sequence[int], inter: links.Interconnect, algorithm: str | dict,
                      chip: str | TimelineChip = "tpu7x", *, prefetch_across: bool | None = None
                      ) -> RanksTimeline:
    """Every rank's program together (programs[i] is rank ranks[i], over the shared weight ring
    `blocks` with `banks` in flight, `timeline.RankSimulation`), joined at their collectives (see
    the module docstring). `algorithm`: one for every collective, a dict by op (all_reduce,
    all_gather, chain), or "auto": each collective's own algorithm where its op names one (our
    kernel's, from its sharding plan), else `interconnect.choose`'s."""
    chip = chip if isinstance(chip, TimelineChip) else timeline_chip(chip)
    sims = [RankSimulation(p, chip, blocks=blocks, banks=banks, batch=batch,
                           prefetch_across=prefetch_across) for p in programs]
    return _join(sims, tuple(ranks), inter, algorithm)


def simulate_ranks(logs: Sequence[Any], chip: str | TimelineChip = "tpu7x", *,
                   interconnect: links.Interconnect | None = None,
                   algorithm: str = "two-level", ranks: Sequence[int] | None = None
                   ) -> RanksTimeline:
    """The ranks' recorded logs together (logs[i] is rank ranks[i], default i), the same
    simulation as `simulate_programs`: a collective's group names ranks; its `path` (default the
    group) the ranks its messages are priced between: a rank may stand for others that run the
    same program."""
    if algorithm not in links.ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is invalid: one of {links.ALGORITHMS}")
    chip = chip if isinstance(chip, TimelineChip) else timeline_chip(chip)
    inter = links.interconnect(chip.name) if interconnect is None else interconnect
    ids = tuple(range(len(logs))) if ranks is None else tuple(ranks)
    if len(ids) != len(logs) or len(set(ids)) != len(logs):
        raise ValueError(f"ranks={ranks!r} is invalid: {len(logs)} distinct rank ids, one per log")
    return _join([RankSimulation(events_of(log), chip) for log in logs], ids, inter, algorithm)


def _join(sims: list, ranks: tuple[int, ...], inter: links.Interconnect,
          algorithm: str | dict) -> RanksTimeline:
    """Run the ranks' simulations, each to its next wait, a collective starting at its last
    member's arrival and ending after its price (`interconnect.price`)."""
    joiner = _Joiner(sims, ranks, inter, algorithm)
    joiner.run()
    return RanksTimeline(sims, joiner.collectives(), inter, algorithm if algorithm == "auto"
                         else joiner.algorithm_of("all_reduce"), ranks)


class _Joiner:
    """The ranks' generators (`RankSimulation.run`) driven together: the k-th collective of a
    group on each member is one instance; a rank that waits for an instance not yet complete is
    parked until its last member arrives."""

    def __init__(self, sims: list, ranks: tuple[int, ...], inter: links.Interconnect,
                 algorithm: str | dict) -> None:
        self.gens = [s.run() for s in sims]
        self.ranks, self.inter, self.algorithm = ranks, inter, algorithm
        self.index = {r: i for i, r in enumerate(ranks)}
        self.seen: list[dict] = [{} for _ in sims]  # group -> collectives met
        self.latest: list[dict] = [{} for _ in sims]  # name -> instance key
        self.instances: dict[tuple, dict] = {}
        self.parked: dict[tuple, list[int]] = {}
        self.runs: list[dict] = []
        self.ready: list[tuple[int, float | None]] = [(i, None) for i in range(len(sims))]

    def algorithm_of(self, op: str, group: tuple[int, ...] = (), nbytes: float = 0.0) -> str:
        if self.algorithm == "auto":  # each collective's own choice (chain: any, its price is one)
            return "one-shot" if op == "chain" or not group else \
                links.choose(self.inter, op, group, nbytes).algorithm
        return self.algorithm if isinstance(self.algorithm, str) else self.algorithm[op]

    def run(self) -> None:
        while self.ready:
            i, value = self.ready.pop()
            self.drive(i, value)
        if self.parked or any(inst["end"] is None for inst in self.runs):
            inst = next(inst for inst in self.runs if inst["end"] is None)
            raise ValueError(f"collective {inst['name']!r} of group {inst['group']}: only ranks "
                             f"{sorted(inst['arrivals'])} arrive (the programs disagree)")

    def drive(self, i: int, value: float | None) -> None:
        """Rank i's generator to its next wait for an incomplete collective (or its end)."""
        gen = self.gens[i]
        while True:
            try:
                what, arg, t = gen.send(value)
            except StopIteration:
                return
            value = None
            if what == "start":
                self.arrive(i, arg, t)
                continue
            key = self.latest[i][arg]
            inst = self.instances[key]
            inst["waited"][self.ranks[i]] = t
            if inst["end"] is None:
                self.parked.setdefault(key, []).append(i)
                return
            value = inst["end"]

    def arrive(self, i: int, arg: tuple, t: float) -> None:
        """Rank i starts a collective at t: the instance starts when its last member does."""
        name, op, group, path, nbytes = arg[1], arg[2], arg[3], arg[4], arg[5]
        own = arg[7] if len(arg) > 7 else None  # the collective's own algorithm, if it names one
        k = self.seen[i].get(group, 0)
        self.seen[i][group] = k + 1
        key = self.latest[i][name] = (group, k)
        inst = self.instances.get(key) or self._new(i, key, name, op, path, nbytes)
        if inst["name"] != name:
            raise ValueError(f"collective {k} of group {group}: the ranks disagree "
                             f"({inst['name']!r}, {name!r})")
        inst["arrivals"][self.ranks[i]] = t
        if len(inst["arrivals"]) == len(group):
            inst["start"] = max(inst["arrivals"].values())
            how = own if own and self.algorithm == "auto" else \
                self.algorithm_of(op, tuple(inst["path"]), nbytes)
            inst["price"] = links.price(self.inter, op, how, tuple(inst["path"]), nbytes)
            inst["end"] = inst["start"] + inst["price"].seconds
            self.ready.extend((j, inst["end"]) for j in self.parked.pop(key, []))

    def _new(self, i: int, key: tuple, name: str, op: str, path: tuple, nbytes: float) -> dict:
        group = key[0]
        if self.ranks[i] not in group or any(m not in self.index for m in group):
            raise ValueError(f"collective {name!r}: group {group} does not hold rank "
                             f"{self.ranks[i]} or names ranks without a log or program")
        inst = self.instances[key] = {"name": name, "op": op, "group": group,
                                      "path": path or group, "nbytes": nbytes,
                                      "arrivals": {}, "waited": {}, "end": None}
        self.runs.append(inst)
        return inst

    def collectives(self) -> tuple[CollectiveRun, ...]:
        return tuple(CollectiveRun(
            inst["name"], inst["op"], inst["group"], int(inst["nbytes"]),
            tuple(inst["arrivals"][r] for r in inst["group"]), inst["start"], inst["end"],
            inst["price"], tuple(inst["waited"].get(r, inst["arrivals"][r])
                                 for r in inst["group"]))
            for inst in self.runs)


def rank_events(log: dma.DmaLog, rank: int) -> list[dma.Event]:
    """One rank's events for `timeline.simulate`, which models one device: its waits for copies
    a peer sends it are dropped (their start is in the peer's program, so one rank's timeline
    cannot place them); its own sends and their waits stay."""
    return [e for e in log.of_rank(rank).events
            if not (e.kind == "dma_wait" and e.remote and e.dst_rank == rank
                    and e.src_rank != rank)]
