"""The timeline model over many ranks: every rank's log simulated together, joined at collectives.

Each rank runs its own program (`timeline.rank_program`: DMAs on its own HBM and DMA engines,
phases on its own compute unit). A `CollectiveEvent` in the logs joins the ranks of its group: it
starts when the last member arrives (a collective waits for its slowest peer) and ends after the
messages of its algorithm (`mkresearch.hardware.interconnect.price`). The weight DMAs a rank issued before
it keep moving meanwhile: a collective hides behind HBM traffic only as far as the stream runs
ahead. The logs are SPMD: every rank meets the same collectives in the same order (groups may
differ, e.g. each expert group its own). `scale_out`'s programs run in `scale_out_sim` instead:
the same model with one DMA engine in closed form, and collectives that may be started early
and waited later (overlap); tests hold the two equal on a blocking program.

`RanksTimeline.decomposition()` splits the slowest rank's step exactly: the HBM floor (its DMA
bytes at full bandwidth: HBM moves bytes in exactly that much time) plus the time HBM is idle,
told apart by what the program does meanwhile: waiting for peers, moving collective messages,
computing, or nothing (a bubble: DMA latency, a fetch that could not be issued earlier).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mkresearch.kernels.base import dma
from mkresearch.hardware import interconnect as links
from mkresearch.prediction.timeline import Timeline, TimelineChip, merge_intervals, rank_program
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


@dataclass(frozen=True)
class RanksTimeline:
    timelines: tuple[Timeline, ...]  # one per rank
    collectives: tuple[CollectiveRun, ...]
    interconnect: links.Interconnect
    algorithm: str
    ranks: tuple[int, ...]  # the rank id of each timeline

    def rank_totals(self) -> list[float]:
        """Each rank's step, in `ranks` order."""
        return [t.total_s for t in self.timelines]

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

    def decomposition(self, rank: int | None = None) -> dict[str, float]:
        """Seconds of `rank`'s step (default the slowest) by PARTS; they sum to its total."""
        rank = self.slowest_rank if rank is None else rank
        tl = self.timeline(rank)
        return decompose(tl.total_s,
                         merge_intervals((s.start, s.end) for s in tl.spans if s.kind == "dma"),
                         merge_intervals((s.start, s.end) for s in tl.spans
                                         if s.kind == "compute"), self.collectives, rank)


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


def simulate_ranks(logs: Sequence[Any], chip: str | TimelineChip = "tpu7x", *,
                   interconnect: links.Interconnect | None = None,
                   algorithm: str = "two-level", ranks: Sequence[int] | None = None
                   ) -> RanksTimeline:
    """Simulate the ranks' logs together (logs[i] is rank ranks[i], default i); see the module
    docstring. A collective's group names ranks; its `path` (default the group) the ranks its
    messages are priced between: a rank may stand for others that run the same program."""
    if algorithm not in links.ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is invalid: one of {links.ALGORITHMS}")
    chip_name = chip.name if isinstance(chip, TimelineChip) else chip
    inter = links.interconnect(chip_name) if interconnect is None else interconnect
    programs = [rank_program(events_of(log), chip, ()) for log in logs]
    n = len(programs)
    ids = tuple(range(n)) if ranks is None else tuple(ranks)
    if len(ids) != n or len(set(ids)) != n:
        raise ValueError(f"ranks={ranks!r} is invalid: {n} distinct rank ids, one per log")
    index = {rank: i for i, rank in enumerate(ids)}
    done: list[Timeline | None] = [None] * n
    seen: list[dict[tuple[int, ...], int]] = [{} for _ in range(n)]  # group -> collectives met
    open_runs: dict[tuple, dict[int, tuple[Any, float]]] = {}  # (group, k) -> rank -> arrival
    runs: list[CollectiveRun] = []

    def advance(i: int, end: float | None = None) -> None:
        """Run log i to its next collective (registered in open_runs) or to its end."""
        try:
            event, arrival = programs[i].send(end) if end is not None else next(programs[i])
        except StopIteration as stop:
            done[i] = stop.value
            return
        rank, group = ids[i], tuple(event.group)
        if any(member not in index for member in group):
            raise ValueError(f"collective {event.name!r}: group {group} names ranks without a log")
        if rank not in group:
            raise ValueError(f"rank {rank}: collective {event.name!r} of group {group} without it")
        k = seen[i].get(group, 0)
        seen[i][group] = k + 1
        open_runs.setdefault((group, k), {})[rank] = (event, arrival)

    for i in range(n):
        advance(i)
    while open_runs:
        ready = [key for key, arrived in open_runs.items() if len(arrived) == len(key[0])]
        if not ready:
            key, arrived = next(iter(open_runs.items()))
            raise ValueError(f"collective {next(iter(arrived.values()))[0].name!r} of group "
                             f"{key[0]}: only ranks {sorted(arrived)} arrive (the logs disagree)")
        for key in sorted(ready, key=lambda key: max(a for _, a in open_runs[key].values())):
            group, arrived = key[0], open_runs.pop(key)
            event = arrived[group[0]][0]
            if {e.name for e, _ in arrived.values()} != {event.name}:
                raise ValueError(f"collective {key[1]} of group {group}: the ranks disagree "
                                 f"({sorted({e.name for e, _ in arrived.values()})})")
            arrivals = tuple(arrived[r][1] for r in group)
            price = links.price(inter, event.op, algorithm, tuple(event.path or group),
                                event.nbytes)
            start = max(arrivals)
            runs.append(CollectiveRun(event.name, event.op, group, event.nbytes, arrivals, start,
                                      start + price.seconds, price))
            for rank in group:
                advance(index[rank], start + price.seconds)
    if any(t is None for t in done):
        raise ValueError("a rank's program did not finish")
    return RanksTimeline(timelines=tuple(done), collectives=tuple(runs), interconnect=inter,
                         algorithm=algorithm, ranks=ids)


def rank_events(log: dma.DmaLog, rank: int) -> list[dma.Event]:
    """One rank's events for `timeline.simulate`, which models one device: its waits for copies
    a peer sends it are dropped (their start is in the peer's program, so one rank's timeline
    cannot place them); its own sends and their waits stay."""
    return [e for e in log.of_rank(rank).events
            if not (e.kind == "dma_wait" and e.remote and e.dst_rank == rank
                    and e.src_rank != rank)]
