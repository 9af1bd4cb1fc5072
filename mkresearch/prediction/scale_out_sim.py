"""The scale-out programs simulated fast: every rank's weight ring, fetches and collectives, joined
at collectives, with overlap (a collective started now, waited later).

A rank's program (`program.Program`) is a short list of ops over a shared list of weight
blocks, not a DMA log: the same model as `timeline.rank_program` with one DMA engine (the
timeline's assumption: DMAs served in issue order at the HBM bandwidth, each after the DMA
latency), computed in closed form per DMA, so a 32-rank step takes a few hundredths of a second.

  ("blocks", n)                       the next n ring blocks: each waited, then multiplied; the
                                      ring keeps `banks` blocks in flight ahead of the one consumed
  ("fetch", nbytes, count, slots)     count DMAs, `slots` in flight, each multiplied when it lands
  ("write", nbytes)                   a write back to HBM, waited at the end of the step
  ("start", name, op, group, path, nbytes, blocking[, algorithm])
                                      a collective; blocking: the rank waits for it here;
                                      algorithm: how the kernel sends it (priced so under "auto")
  ("wait", name)                      wait for the last collective started under that name

Overlap: between a collective's start and its wait the rank goes on issuing and consuming weight
blocks. While it waits, the blocks already issued keep landing; with `prefetch_across` the ring
also runs ahead past a blocking collective (as far as its banks, i.e. the VMEM for weight banks),
without it the blocks after a blocking collective are issued only once the rank is past it.
Tests hold this to `timeline_ranks.simulate_ranks` over the equivalent DMA logs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mkresearch.hardware import interconnect as links
from mkresearch.prediction.timeline import (
    COMPUTE_LANE,
    Span,
    Timeline,
    TimelineChip,
    append_interval,
    timeline_chip,
)
from mkresearch.prediction.timeline_ranks import CollectiveRun, RanksTimeline, decompose


class _Rank:
    def __init__(self, ops, blocks, banks, batch, chip: TimelineChip, prefetch_across: bool):
        self.ops, self.blocks, self.banks, self.batch = ops, blocks, banks, batch
        self.lat, self.bw = chip.dma_latency, chip.hbm_bandwidth
        self.per_flop, self.per_vmem = 1.0 / chip.mxu_flops, 1.0 / chip.vmem_bandwidth
        self.t = self.free = 0.0
        self.issued = self.consumed = 0
        self.ends = [0.0] * len(blocks)
        self.dma: list = []
        self.compute: list = []
        self.dma_bytes = 0.0
        self.flops = 0.0
        self.writes: list[float] = []
        # the ring's horizon: without prefetch_across, the block index of each blocking collective
        self.barriers: list[int] = []
        if not prefetch_across:
            at = 0
            for op in ops:
                if op[0] == "blocks":
                    at += op[1]
                elif op[0] == "start" and op[6]:
                    self.barriers.append(at)
        self.barriers.append(len(blocks))
        self.next_barrier = 0

    def _dma(self, nbytes: float) -> float:
        start = max(self.t + self.lat, self.free)
        end = start + nbytes / self.bw
        self.free = end
        self.dma_bytes += nbytes
        append_interval(self.dma, start, end)
        return end

    def _fill(self) -> None:
        blocks, ends, dma, lat, per_byte = self.blocks, self.ends, self.dma, self.lat, 1 / self.bw
        t, free, issued = self.t, self.free, self.issued
        limit = min(self.consumed + self.banks, self.barriers[self.next_barrier])
        while issued < limit:  # _dma inlined: the ring refills a dozen blocks at once
            start = t + lat
            start = max(start, free)
            free = start + blocks[issued] * per_byte
            ends[issued] = free
            self.dma_bytes += blocks[issued]
            append_interval(dma, start, free)
            issued += 1
        self.free, self.issued = free, issued

    def run(self):
        """A generator: yields ("start", op, t) and ("wait", name, t); a wait is sent the time
        its collective ends."""
        self._fill()
        for op in self.ops:
            kind = op[0]
            if kind == "blocks":  # the hot loop: _fill and _dma inlined, then the multiply
                blocks, ends, dma, compute = self.blocks, self.ends, self.dma, self.compute
                lat, per_byte, banks = self.lat, 1.0 / self.bw, self.banks
                per_block = self.batch * self.per_flop
                per_block = max(per_block, self.per_vmem)
                t, free, issued, consumed = self.t, self.free, self.issued, self.consumed
                horizon = self.barriers[self.next_barrier]
                issued_bytes = 0.0
                for _ in range(op[1]):
                    t = max(t, ends[consumed])
                    nbytes = blocks[consumed]
                    consumed += 1
                    limit = consumed + banks
                    limit = min(limit, horizon)
                    while issued < limit:
                        start = t + lat
                        start = max(start, free)
                        free = start + blocks[issued] * per_byte
                        ends[issued] = free
                        issued_bytes += blocks[issued]
                        if dma and start <= dma[-1][1]:
                            dma[-1][1] = free
                        else:
                            dma.append([start, free])
                        issued += 1
                    end = t + nbytes * per_block
                    if compute and t <= compute[-1][1]:
                        compute[-1][1] = end
                    else:
                        compute.append([t, end])
                    t = end
                self.flops += self.batch * sum(blocks[self.consumed:consumed])
                self.t, self.free, self.issued, self.consumed = t, free, issued, consumed
                self.dma_bytes += issued_bytes
            elif kind == "fetch":
                _, nbytes, count, slots = op
                ends = [self._dma(nbytes) for _ in range(min(slots, count))]
                duration = nbytes * max(self.batch * self.per_flop, self.per_vmem)
                compute, t = self.compute, self.t
                for i in range(count):
                    t = max(t, ends[i])
                    if compute and t <= compute[-1][1]:
                        compute[-1][1] = t + duration
                    else:
                        compute.append([t, t + duration])
                    t += duration
                    if i + slots < count:
                        self.t = t
                        ends.append(self._dma(nbytes))
                self.t = t
                self.flops += self.batch * nbytes * count
            elif kind == "write":
                self.writes.append(self._dma(op[1]))
            elif kind == "start":
                yield "start", op, self.t
                if op[6]:
                    self.t = max(self.t, (yield "wait", op[1], self.t))
                    if self.barriers[self.next_barrier] < len(self.blocks):
                        self.next_barrier += 1
                    self._fill()
            else:  # wait
                self.t = max(self.t, (yield "wait", op[1], self.t))
        self.total = max([self.t, self.free] + self.writes)


def simulate(programs: Sequence[Any], blocks: Sequence[float], banks: int, batch: int,
             ranks: Sequence[int], inter: links.Interconnect, algorithm: str | dict,
             chip: str | TimelineChip = "tpu7x", *, prefetch_across: bool = True
             ) -> RanksTimeline:
    """Every rank's program together (programs[i] is rank ranks[i]); see the module docstring.
    `algorithm`: one for every collective, a dict by op (all_reduce, all_gather, chain), or
    "auto": each collective's own algorithm where its op names one (our kernel's, from its
    sharding plan), else `interconnect.choose`'s."""
    chip = chip if isinstance(chip, TimelineChip) else timeline_chip(chip)
    sims = [_Rank(p, blocks, banks, batch, chip, prefetch_across) for p in programs]
    gens = [s.run() for s in sims]
    index = {r: i for i, r in enumerate(ranks)}
    seen: list[dict] = [{} for _ in sims]
    latest: list[dict] = [{} for _ in sims]  # name -> instance key
    instances: dict[tuple, dict] = {}
    parked: dict[tuple, list[int]] = {}
    runs: list[dict] = []

    def algo(op: str, group: tuple[int, ...] = (), nbytes: float = 0.0) -> str:
        if algorithm == "auto":  # each collective's own choice (chain: any, its price is one)
            return "one-shot" if op == "chain" or not group else \
                links.choose(inter, op, group, nbytes).algorithm
        return algorithm if isinstance(algorithm, str) else algorithm[op]

    def drive(i: int, value: float | None) -> None:
        gen = gens[i]
        while True:
            try:
                what, arg, t = gen.send(value)
            except StopIteration:
                return
            value = None
            if what == "start":
                _, name, op, group, path, nbytes, _blocking, *own = arg
                k = seen[i].get(group, 0)
                seen[i][group] = k + 1
                key = (group, k)
                latest[i][name] = key
                inst = instances.get(key)
                if inst is None:
                    if ranks[i] not in group or any(m not in index for m in group):
                        raise ValueError(f"collective {name!r}: group {group} does not hold "
                                         f"rank {ranks[i]} or names ranks without a program")
                    inst = instances[key] = {"name": name, "op": op, "group": group,
                                             "path": path or group, "nbytes": nbytes,
                                             "arrivals": {}, "waited": {}, "end": None}
                    runs.append(inst)
                elif inst["name"] != name:
                    raise ValueError(f"collective {k} of group {group}: the ranks disagree "
                                     f"({inst['name']!r}, {name!r})")
                inst["arrivals"][ranks[i]] = t
                if len(inst["arrivals"]) == len(group):
                    inst["start"] = max(inst["arrivals"].values())
                    path = tuple(inst["path"])
                    how = own[0] if own and own[0] and algorithm == "auto" else \
                        algo(op, path, nbytes)
                    inst["price"] = links.price(inter, op, how, path, nbytes)
                    inst["end"] = inst["start"] + inst["price"].seconds
                    for j in parked.pop(key, []):
                        ready.append((j, inst["end"]))
            else:
                key = latest[i][arg]
                inst = instances[key]
                inst["waited"][ranks[i]] = t
                if inst["end"] is None:
                    parked.setdefault(key, []).append(i)
                    return
                value = inst["end"]

    ready: list[tuple[int, float | None]] = [(i, None) for i in range(len(sims))]
    while ready:
        i, value = ready.pop()
        drive(i, value)
    if parked or any(inst["end"] is None for inst in runs):
        inst = next(inst for inst in runs if inst["end"] is None)
        raise ValueError(f"collective {inst['name']!r} of group {inst['group']}: only ranks "
                         f"{sorted(inst['arrivals'])} arrive (the programs disagree)")
    collectives = tuple(CollectiveRun(
        inst["name"], inst["op"], inst["group"], int(inst["nbytes"]),
        tuple(inst["arrivals"][r] for r in inst["group"]), inst["start"], inst["end"],
        inst["price"], tuple(inst["waited"].get(r, inst["arrivals"][r]) for r in inst["group"]))
        for inst in runs)
    return SimulatedRanks(sims, collectives, inter, algorithm if algorithm == "auto"
                          else algo("all_reduce"), tuple(ranks), chip)


class SimulatedRanks(RanksTimeline):
    """A RanksTimeline whose per-rank Timelines (spans) are built only when asked for: the
    decomposition reads the simulation's merged intervals directly."""

    def __init__(self, sims, collectives, inter, algorithm, ranks, chip) -> None:
        object.__setattr__(self, "_sims", sims)
        object.__setattr__(self, "_chip", chip)
        object.__setattr__(self, "collectives", collectives)
        object.__setattr__(self, "interconnect", inter)
        object.__setattr__(self, "algorithm", algorithm)
        object.__setattr__(self, "ranks", ranks)

    def __getattr__(self, name: str):
        # called only for attributes not set: `timelines` is built here on first use (the
        # explorer draws spans; a prediction reads the intervals), then set like a field
        if name != "timelines":
            raise AttributeError(name)
        timelines = []
        for s in self._sims:
            spans = [Span(lane="DMA 0", name="hbm", start=a, end=b, kind="dma") for a, b in s.dma]
            spans += [Span(lane=COMPUTE_LANE, name="compute", start=a, end=b, kind="compute")
                      for a, b in s.compute]
            timelines.append(Timeline(chip=self._chip, spans=tuple(spans), vmem=((0.0, 0),),
                                      total_s=s.total, dma_bytes=round(s.dma_bytes),
                                      flops=s.flops, idle=()))
        object.__setattr__(self, "timelines", tuple(timelines))
        return self.timelines

    def rank_totals(self) -> list[float]:
        return [s.total for s in self._sims]

    def dma_bytes(self, rank: int) -> float:
        return self._sims[self.ranks.index(rank)].dma_bytes

    def decomposition(self, rank: int | None = None) -> dict[str, float]:
        rank = self.slowest_rank if rank is None else rank
        s = self._sims[self.ranks.index(rank)]
        return decompose(s.total, s.dma, s.compute, self.collectives, rank)
