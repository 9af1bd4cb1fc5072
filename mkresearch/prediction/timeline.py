"""A TPU timeline model: a recorded DMA/phase log plus a chip -> who does what, when.

Pure Python, no JAX: the input is the program-order log of `mkresearch.kernels.base.dma` (or its JSON
records), the output a `Timeline` of per-lane spans, VMEM bytes in use over time, the step time,
the HBM-roofline fraction and the times the compute unit is idle. The simulation is event-driven:

* The program (the TensorCore's scalar unit) runs the log in order. `dma_start` issues a DMA and
  moves on; `dma_wait` blocks until that DMA has completed; a compute phase (`phase_start` ..
  `phase_end`) occupies the compute unit for `max(flops / peak, vmem_bytes / vmem_bandwidth)`.
  So a phase starts when the DMAs it waited on are done and the previous phase has finished.
* DMAs: each becomes ready `dma_latency` after its issue, then takes a free DMA engine in issue
  order. The engines share the HBM bandwidth (each of the k engines moving bytes gets 1/k of it),
  so one engine alone gets the full bandwidth and k engines together never exceed it.
* The compute unit's idle time has two causes, told apart because only one of them is waste:
  `hbm_busy` when a DMA moves bytes meanwhile ("compute idle: HBM busy": the step is bound by
  HBM there, which is what a bandwidth-bound step at the roofline looks like), and `bubble` when
  nothing moves, neither compute nor any DMA ("bubble: nothing moves": DMA latency, issue gaps).

Every chip parameter is a `TimelineChip` field whose source is in `TimelineChip.sources`: figures
come from `mkresearch.hardware.chips.CHIPS` (per JAX device); what no public source gives is marked as an
ASSUMPTION. Calibrate them on a TPU with `mkresearch.measurement.profiling` and `timeline_chip(name, **fields)`.
"""


from __future__ import annotations

import bisect
import functools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mkresearch.prediction.timeline_chip import (  # noqa: F401
    DMA_LATENCY_S,
    N_DMA_ENGINES,
    VMEM_OVER_HBM,
    VPU_OVER_MXU,
    TimelineChip,
    hbm_floor_s,
    timeline_chip,
)
from mkresearch.prediction.timeline_events import (  # noqa: F401
    DMA_KINDS,
    CollectiveEvent,
    LogEvent,
    events_of,
    match_keys,
    to_records,
)
from mkresearch.prediction.timeline_whatif import (  # noqa: F401
    blockspec_log,
    guide_bandwidth_bound_s,
    guide_compute_bound_s,
    rebuffer,
    scale_batch,
    stream_log,
)

IDLE_CAUSES = ("hbm_busy", "bubble")
# a program's ("start", name, op, group, path, nbytes, blocking, algorithm, streams, ahead): the
# index of `streams`, whether the weight ring keeps running ahead past this collective while it is
# waited, and of `ahead`, the ring's blocks after it issued anyway where it does not (the kernel
# issued those earlier)
STREAMS, AHEAD = 8, 9
COMPUTE_LANE = "MXU/VPU"
BF16_WEIGHTS_PER_BYTE = 0.5
# How a fetch op's DMAs (the routed experts, issued once routing is known) meet the weight ring's
# blocks already issued (`RankSimulation._fetch`): QUEUED, behind them in issue order (one DMA
# queue; with TimelineChip.n_dma_engines >= 2, on a queue of their own sharing the bandwidth);
# FIRST, ahead of those not yet moving (the kernel reorders: "expert reads first"); HELD, the ring
# issues nothing past the fetch until it is done (the release issues its next weights after its
# expert stream), so nothing is queued ahead of it.
QUEUED, FIRST, HELD = "queued", "first", "held"
FETCH_ORDERS = (QUEUED, FIRST, HELD)
COLLECTIVE_LANE = "ICI"  # a rank's collectives: from its arrival to the collective's end


# ---- the result ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Span:
    """One busy interval on one lane. Times in seconds from the start of the step."""

    lane: str  # "DMA 0".."DMA k-1", COMPUTE_LANE, or a measured lane from a trace
    name: str
    start: float
    end: float
    kind: str  # "dma" | "compute" | "collective" | "measured"
    nbytes: int = 0
    flops: float = 0.0
    slot: int | None = None
    issue: float | None = None  # DMAs: when the program issued it (start - issue = latency + queue)
    bound: str = ""  # compute: "flops" or "vmem", whichever set the duration

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Idle:
    """An interval in which the compute unit is idle, with its cause (one of IDLE_CAUSES).

    "hbm_busy": a DMA moves bytes meanwhile: compute waits on HBM, and HBM is busy, so the time
    is not lost (a bandwidth-bound step at the roofline is compute-idle most of the time).
    "bubble": nothing moves, no compute and no DMA: DMA latency or issue gaps, real waste.
    """

    start: float
    end: float
    cause: str

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    chip: TimelineChip
    spans: tuple[Span, ...]
    vmem: tuple[tuple[float, int], ...]  # (time, bytes in use from then on), a step function
    total_s: float
    dma_bytes: int
    flops: float
    idle: tuple[Idle, ...]  # the compute unit's idle intervals, by cause

    @property
    def hbm_floor_s(self) -> float:
        """Time to move `dma_bytes` at the HBM bandwidth: the roofline for this log."""
        return self.dma_bytes / self.chip.hbm_bandwidth

    @property
    def roofline_fraction(self) -> float:
        """hbm_floor / total: 1.0 means the step runs at the HBM roofline."""
        return self.hbm_floor_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def peak_vmem_bytes(self) -> int:
        return max((b for _, b in self.vmem), default=0)

    @property
    def lanes(self) -> list[str]:
        dma = sorted({s.lane for s in self.spans if s.kind == "dma"}, key=_lane_key)
        rest = [lane for lane in dict.fromkeys(s.lane for s in self.spans) if lane not in dma]
        return dma + rest

    def spans_on(self, lane: str) -> list[Span]:
        return [s for s in self.spans if s.lane == lane]

    def busy_s(self, kind: str) -> float:
        """Seconds during which at least one span of `kind` runs ("dma" or "compute")."""
        return _union_length([(s.start, s.end) for s in self.spans if s.kind == kind])

    def idle_s(self, cause: str | None = None) -> float:
        """Seconds the compute unit is idle for `cause` ("hbm_busy" or "bubble"; None: both)."""
        if cause is not None and cause not in IDLE_CAUSES:
            raise ValueError(f"cause={cause!r} is invalid: None or one of {IDLE_CAUSES}")
        return sum(i.duration for i in self.idle if cause is None or i.cause == cause)

    def idle_by_cause(self) -> dict[str, float]:
        return {cause: self.idle_s(cause) for cause in IDLE_CAUSES}

    def step_fraction(self, seconds: float) -> float:
        """`seconds` as a fraction of the step (0 for an empty step)."""
        return seconds / self.total_s if self.total_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The headline numbers, for a table row."""
        return {
            "chip": self.chip.name,
            "total_us": self.total_s * 1e6,
            "hbm_floor_us": self.hbm_floor_s * 1e6,
            "roofline_fraction": self.roofline_fraction,
            "dma_bytes": self.dma_bytes,
            "flops": self.flops,
            "compute_busy_us": self.busy_s("compute") * 1e6,
            "dma_busy_us": self.busy_s("dma") * 1e6,
            "idle_hbm_busy_us": self.idle_s("hbm_busy") * 1e6,
            "bubble_us": self.idle_s("bubble") * 1e6,
            "idle_hbm_busy_fraction": self.step_fraction(self.idle_s("hbm_busy")),
            "bubble_fraction": self.step_fraction(self.idle_s("bubble")),
            "peak_vmem_bytes": self.peak_vmem_bytes,
        }


def _lane_key(lane: str):
    head, _, tail = lane.rpartition(" ")
    return (head, int(tail)) if tail.isdigit() else (lane, -1)


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def append_interval(merged: list[list[float]], a: float, b: float) -> None:
    """Add [a, b) to sorted, disjoint [start, end] lists whose starts are all <= a (empty
    intervals dropped, an overlapping one merged into the last)."""
    if b <= a:
        return
    if merged and a <= merged[-1][1]:
        merged[-1][1] = max(merged[-1][1], b)
    else:
        merged.append([a, b])


def _interval_end(interval: list[float]) -> float:
    return interval[1]


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals (empty ones dropped)."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        append_interval(merged, a, b)
    return [(a, b) for a, b in merged]


# ---- the DMA engines: FIFO admission, bandwidth shared by the engines moving bytes --------------
class _Dma:
    __slots__ = ("consumed", "end", "engine", "event", "issue", "ready", "remaining", "start")

    def __init__(self, event: LogEvent, issue: float, latency: float):
        self.event, self.issue, self.ready = event, issue, issue + latency
        self.start = self.end = self.consumed = None
        self.engine = -1
        self.remaining = float(event.nbytes)


class _DmaEngines:
    def __init__(self, chip: TimelineChip):
        self.bandwidth, self.n_engines = chip.hbm_bandwidth, chip.n_dma_engines
        self.now = 0.0
        self.queue: deque[_Dma] = deque()  # issued, not yet on an engine (issue order)
        self.active: dict[int, _Dma] = {}  # engine -> DMA moving bytes

    def issue(self, dma: _Dma) -> None:
        self.advance_to(dma.issue)
        self.queue.append(dma)
        self._step(self.now)  # a zero-latency DMA may start at once

    def _next_event(self) -> float:
        t = math.inf
        if self.active:
            rate = self.bandwidth / len(self.active)
            t = self.now + min(d.remaining for d in self.active.values()) / rate
        if self.queue and len(self.active) < self.n_engines:
            t = min(t, max(self.now, self.queue[0].ready))
        return t

    def _step(self, t: float) -> bool:
        """Move time to t (no event strictly before it), then retire and admit DMAs.
        Returns whether anything happened (time moved, a DMA finished or started)."""
        before = (self.now, len(self.active), len(self.queue))
        if self.active and t > self.now:
            moved = (t - self.now) * self.bandwidth / len(self.active)
            for d in self.active.values():
                d.remaining -= moved
        self.now = max(self.now, t)
        rate = self.bandwidth / max(1, len(self.active))
        for engine, d in list(self.active.items()):
            # done: no bytes left, or too few to move the clock (float rounding must not loop)
            if d.remaining <= 1e-9 * max(1.0, d.event.nbytes) or \
                    self.now + d.remaining / rate <= self.now:
                d.remaining, d.end = 0.0, self.now
                del self.active[engine]
        while self.queue and len(self.active) < self.n_engines and self.queue[0].ready <= self.now:
            d = self.queue.popleft()
            d.engine = min(set(range(self.n_engines)) - set(self.active))
            d.start = self.now
            self.active[d.engine] = d
            if d.remaining <= 0:  # zero-byte DMA: done as it starts
                d.end = self.now
                del self.active[d.engine]
        return (self.now, len(self.active), len(self.queue)) != before

    def _event(self, te: float) -> None:
        if not self._step(te):  # a model bug, never an input error: fail instead of spinning
            raise RuntimeError(f"DMA simulation made no progress at t={self.now!r}")

    def advance_to(self, t: float) -> None:
        while (te := self._next_event()) <= t:
            self._event(te)
        self._step(t)

    def finish(self, dma: _Dma) -> float:
        while dma.end is None:
            self._event(self._next_event())
        return dma.end


# ---- the simulation: one rank's program on a chip ----------------------------------------------
def simulate(log: Any, chip: str | TimelineChip = "tpu7x", *,
             vpu_phases: Sequence[str] = (), collective_s: Any = None) -> Timeline:
    """The timeline of `log` (a `dma.recording()` log, its events or JSON records) on `chip`.

    Phases whose name starts with one of `vpu_phases` run at the VPU peak, all others at the MXU
    peak; either way a phase lasts at least `vmem_bytes / vmem_bandwidth`. A `CollectiveEvent`
    blocks the program for `collective_s(event)` seconds (its peers taken to arrive with it; the
    ranks together: `mkresearch.prediction.timeline_ranks.simulate_ranks`).
    """
    rank = RankSimulation(events_of(log), chip, vpu_phases=vpu_phases)
    program = rank.run()
    try:
        request = next(program)
        while True:
            what, op, arrival = request
            if what == "start":
                request = program.send(None)
                continue
            if collective_s is None:
                raise ValueError(f"collective {op!r} in the log: pass collective_s "
                                 "(seconds of a CollectiveEvent) or use simulate_ranks")
            request = program.send(arrival + collective_s(rank.waiting))
    except StopIteration:
        return rank.timeline()


class RankSimulation:
    """One rank's program run on a chip (`run`, then `timeline`): the one simulator of the
    timeline model, for one chip's recorded log and for every rank of a scale-out prediction.

    A program is a sequence of ops (`mkresearch.prediction.program`):

      LogEvent dma_start / dma_wait   one DMA, issued and waited (a recorded log's): DMA engines
                                      in issue order sharing the HBM bandwidth (`_DmaEngines`)
      LogEvent phase_start / _end     a compute phase: max(flops / peak, vmem_bytes / VMEM rate)
      CollectiveEvent                 a blocking collective of a recorded log
      ("blocks", n)                   the next n blocks of the shared weight ring `blocks`:
                                      each waited, then multiplied; `banks` blocks in flight
      ("hold", n)                     the next n blocks multiplied stay in VMEM beside the
                                      ring (a second microbatch multiplies them later; the ring
                                      refills their slots: `microbatches`, a what-if)
      ("again", n)                    the n oldest held blocks multiplied again on the MXU,
                                      their VMEM freed (`held_peak_bytes`: the most held)
      ("fetch", nbytes, count, slots[, mix[, order]])
                                      count DMAs, `slots` in flight, each multiplied on landing;
                                      order: how they meet the ring's issued blocks (FETCH_ORDERS)
      ("write", nbytes)               a write back to HBM, waited at the end of the step
      ("compute", flops)              element-wise work on the rows at `TimelineChip.vpu_flops`
                                      (`row_work`): the compute unit is busy, the ring streams on
      ("prefetch",)                   the next fetch's first DMAs (as many as its slots) issued
                                      here, in its order; the fetch waits for them where it is
      ("start", name, op, group, path, nbytes, blocking[, algorithm[, streams[, ahead]]])
                                      a collective; blocking: the rank waits for it here;
                                      streams (default True): the ring runs ahead past it; where
                                      it does not, still its next `ahead` blocks (default 0)
      ("wait", name)                  wait for the last collective started under that name

    The ring's ops are its DMAs in closed form: one DMA engine, each DMA after the one before it
    at the rate a weight stream sustains (`TimelineChip.weight_dma_bandwidth`: what `_DmaEngines`
    does with one engine at that rate; one DMA at a time, so a 32-rank step takes a few hundredths
    of a second), each block multiplied on the MXU at `TimelineChip.mxu_seconds_per_byte` (a
    weight tile costs at least the array's rows, whatever the batch). A program uses one kind of DMA
    op or the other. The ring runs past a blocking collective (its blocks after it issued while
    the rank waits, as far as its banks) where the program says so (the op's `streams`: how the
    kernel issues its weights around that collective); `prefetch_across` True / False overrides
    every collective alike (the model's what-if and sensitivity switch); where it does not, its
    blocks after the collective are issued once the rank is past it.

    `run()` is a generator: it yields ("start", op, t) for every collective (sent None back) and
    ("wait", name, t) where the rank waits for one (sent the time it ends): the ranks are joined
    by `timeline_ranks.simulate_programs`, or by `simulate` for one chip's log.
    """

    def __init__(self, ops: Sequence[Any], chip: str | TimelineChip = "tpu7x", *,
                 blocks: Sequence[float] = (), banks: int = 1, batch: int = 1,
                 prefetch_across: bool | None = None, vpu_phases: Sequence[str] = ()) -> None:
        self.ops = ops
        self.chip = chip = timeline_chip(chip) if not isinstance(chip, TimelineChip) else chip
        self.vpu_phases = tuple(vpu_phases)
        self.t = 0.0  # the program's clock
        self.waiting: Any = None  # the collective the rank waits for (its op or event)
        self.collective_spans: list[Span] = []
        # a recorded log's DMAs and phases
        self.engines = _DmaEngines(chip)
        self.in_flight: dict[Any, deque[_Dma]] = {}  # match key -> DMAs issued, not yet waited
        self.dmas: list[_Dma] = []
        self.waited_unconsumed: list[_Dma] = []  # waited into VMEM, not yet read by a phase
        self.compute_spans: list[Span] = []
        self.open_phases: list[dict] = []
        # the weight ring, fetches and writes, in closed form
        self.blocks, self.banks, self.batch = blocks, banks, batch
        self.lat, self.bw = chip.dma_latency, chip.weight_dma_bandwidth
        # a ring block is a bf16 matrix's bytes on the MXU (`TimelineChip.mxu_seconds_per_byte`)
        self.per_byte_bf16 = chip.mxu_seconds_per_byte(batch, BF16_WEIGHTS_PER_BYTE, False)
        self.free = 0.0
        self.issued = self.consumed = 0
        self.held: deque[int] = deque()  # blocks kept in VMEM (("hold", n), ("again", n))
        self.held_bytes = self.held_peak_bytes = 0
        self.again_s = 0.0  # the MXU's time on held blocks multiplied again
        self.to_hold = 0  # of the blocks next multiplied, how many to hold
        self.ends = [0.0] * len(blocks)
        self.dma: list = []  # merged busy intervals of the ring's DMAs
        self.compute: list = []  # merged busy intervals of its compute
        self.dma_bytes = 0.0
        self.flops = 0.0
        self.writes: list[float] = []
        self.fetch_free = 0.0  # when the fetches' own DMA FIFO is free
        self.prefetched: list[float] = []  # landings of the next fetch's DMAs issued ahead
        self.barriers, self.holding = self._barriers(ops, len(blocks), prefetch_across)
        self.prefetch_across = prefetch_across
        self.next_barrier = 0
        self.total = 0.0

    @classmethod
    def _barriers(cls, ops, n_blocks: int, prefetch_across: bool | None
                  ) -> tuple[list[int], frozenset[int]]:
        """The ring's horizon: the block index of each blocking collective the stream does not
        run past (then the end of the ring), and the indices of those ops in the program.
        prefetch_across None: each collective's own `STREAMS` field (default True); True /
        False: every blocking collective alike."""
        out, at, holding = [], 0, []
        for i, op in enumerate(ops):
            if not isinstance(op, tuple):  # a recorded log's event: never holds the ring
                continue
            kind = op[0]
            if kind == "blocks":
                at += op[1]
            elif (kind == "start" or kind == "fetch") and cls._holds_ring(op, prefetch_across):
                ahead = op[AHEAD] if kind == "start" and len(op) > AHEAD else 0
                out.append(min(at + ahead, n_blocks))
                holding.append(i)
        return out + [n_blocks], frozenset(holding)

    @staticmethod
    def _holds_ring(op, prefetch_across: bool | None) -> bool:
        """Is op a blocking collective the ring does not run past, or a fetch it waits for?"""
        if isinstance(op, tuple) and op[0] == "fetch":
            return len(op) > 5 and op[5] == HELD
        if not (isinstance(op, tuple) and op[0] == "start" and op[6]):
            return False
        streams = (op[STREAMS] if len(op) > STREAMS else True) \
            if prefetch_across is None else prefetch_across
        return not streams

    # ---- the program ------------------------------------------------------------------------
    def run(self):
        """A generator over the program (see the class docstring)."""
        if self.blocks:
            self._fill()
        for i, op in enumerate(self.ops):
            if not isinstance(op, tuple):  # a recorded log's event
                if op.kind == "collective":  # blocking, priced over its path
                    yield "start", ("start", op.name, op.op, tuple(op.group), tuple(op.path),
                                    op.nbytes, True, None), self.t
                    self.waiting = op
                    done = yield "wait", op.name, self.t
                    self.collective_spans.append(Span(
                        lane=COLLECTIVE_LANE, name=op.name, start=self.t, end=done,
                        kind="collective", nbytes=op.nbytes))
                    self.t = max(self.t, done)
                else:
                    self._event(op, i)
                continue
            kind = op[0]
            if kind == "blocks":
                self._blocks(op[1])
            elif kind == "hold":
                self.to_hold += op[1]
            elif kind == "again":
                self._again(op[1])
            elif kind == "prefetch":
                self._prefetch(i)
            elif kind == "fetch":
                self._fetch(*op[1:])
                if i in self.holding:
                    self.next_barrier += 1
                    self._fill()
            elif kind == "write":
                self.writes.append(self._dma(op[1]))
            elif kind == "compute":
                self._compute(op[1])
            elif kind == "start":
                # its remote copies leave behind the weight DMAs issued before them, or apart
                sent = max(self.t, self.free) if self.chip.remote_copies_queued else self.t
                yield "start", op, sent
                if op[6]:
                    self.waiting = op
                    self.t = max(self.t, (yield "wait", op[1], self.t))
                    if i in self.holding:
                        self.next_barrier += 1
                    self._fill()
            else:  # wait
                self.waiting = op
                self.t = max(self.t, (yield "wait", op[1], self.t))
        self._finish()

    # ---- a recorded log's DMAs and phases ---------------------------------------------------
    def _event(self, ev: LogEvent, i: int) -> None:
        if ev.kind == "dma_start":
            d = _Dma(ev, self.t, self.chip.dma_latency)
            self.dmas.append(d)
            for key in match_keys(ev):
                self.in_flight.setdefault(key, deque()).append(d)
            self.engines.issue(d)
        elif ev.kind == "dma_wait":
            d = _take_match(self.in_flight, ev, i)
            self.t = max(self.t, self.engines.finish(d))
            if _to_vmem(d.event):
                self.waited_unconsumed.append(d)
            else:
                d.consumed = d.end
        elif ev.kind == "phase_start":
            if self.open_phases:
                self.open_phases[-1]["children"] = True
            self.open_phases.append({"event": ev, "start": self.t, "children": False})
        else:  # phase_end
            self._phase_end(ev, i)

    def _phase_end(self, ev: LogEvent, i: int) -> None:
        if not self.open_phases:
            raise ValueError(f"event {i}: phase_end {ev.name!r} without a phase_start")
        opened = self.open_phases.pop()
        if opened["children"]:
            return  # an enclosing phase: its leaves carry the time
        start_ev, chip = opened["event"], self.chip
        flops = start_ev.flops or ev.flops
        vmem_bytes = start_ev.vmem_bytes or ev.vmem_bytes
        peak = chip.vpu_flops if start_ev.name.startswith(self.vpu_phases) else chip.mxu_flops
        flop_time, vmem_time = flops / peak, vmem_bytes / chip.vmem_bandwidth
        duration = max(flop_time, vmem_time)
        start = max(self.t, opened["start"])
        self.compute_spans.append(Span(lane=COMPUTE_LANE, name=start_ev.name, start=start,
                                       end=start + duration, kind="compute", flops=flops,
                                       bound="flops" if flop_time >= vmem_time else "vmem"))
        self.t = start + duration
        self.flops += flops
        for d in self.waited_unconsumed:  # the phase after a wait is the one that reads the block
            d.consumed = self.t
        self.waited_unconsumed.clear()

    # ---- the ring, fetches and writes in closed form ----------------------------------------
    def _dma(self, nbytes: float) -> float:
        start = max(self.t + self.lat, self.free)
        end = start + nbytes / self.bw
        self.free = end
        self.dma_bytes += nbytes
        append_interval(self.dma, start, end)
        return end

    def _fill(self) -> None:
        issued = self.issued
        limit = min(self.consumed + self.banks, self.barriers[self.next_barrier])
        if issued >= limit:  # most calls (after each collective): the ring is full already
            return
        blocks, ends, dma, lat, per_byte = self.blocks, self.ends, self.dma, self.lat, 1 / self.bw
        t, free = self.t, self.free
        while issued < limit:  # _dma inlined: the ring refills a dozen blocks at once
            start = t + lat
            start = max(start, free)
            free = start + blocks[issued] * per_byte
            ends[issued] = free
            self.dma_bytes += blocks[issued]
            append_interval(dma, start, free)
            issued += 1
        self.free, self.issued = free, issued

    def _blocks(self, n: int) -> None:
        """The hot loop: n blocks waited and multiplied, the ring refilled (inlined)."""
        blocks, ends, dma, compute = self.blocks, self.ends, self.dma, self.compute
        lat, per_byte, banks = self.lat, 1.0 / self.bw, self.banks
        per_block = self.per_byte_bf16
        t, free, issued, consumed = self.t, self.free, self.issued, self.consumed
        horizon = self.barriers[self.next_barrier]
        issued_bytes = 0.0
        for _ in range(n):  # max and min as comparisons: the same floats, without the calls
            if ends[consumed] > t:  # noqa: PLR1730
                t = ends[consumed]
            nbytes = blocks[consumed]
            consumed += 1
            limit = consumed + banks
            if horizon < limit:  # noqa: PLR1730
                limit = horizon
            while issued < limit:
                start = t + lat
                if free > start:  # noqa: PLR1730
                    start = free
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
        if self.to_hold:  # kept in VMEM for a second microbatch
            self._hold(self.consumed, min(n, self.to_hold))
        self.flops += self.batch * sum(blocks[self.consumed:consumed])
        self.t, self.free, self.issued, self.consumed = t, free, issued, consumed
        self.dma_bytes += issued_bytes

    def _hold(self, first: int, n: int) -> None:
        """Blocks first .. first + n - 1 kept in VMEM for a second microbatch."""
        self.held.extend(range(first, first + n))
        self.held_bytes += sum(self.blocks[first:first + n])
        self.held_peak_bytes = max(self.held_peak_bytes, self.held_bytes)
        self.to_hold -= n

    def _again(self, n: int) -> None:
        """The n oldest held blocks multiplied again (in VMEM already: the MXU alone), their
        VMEM freed."""
        if n > len(self.held):
            raise ValueError(f"('again', {n}): only {len(self.held)} blocks are held")
        nbytes = sum(self.blocks[self.held.popleft()] for _ in range(n))
        end = self.t + nbytes * self.per_byte_bf16
        append_interval(self.compute, self.t, end)
        self.again_s += end - self.t
        self.t, self.held_bytes = end, self.held_bytes - nbytes
        self.flops += self.batch * nbytes

    def _fetch(self, nbytes: float, count: int, slots: int, mix: tuple = (),
               order: str = QUEUED) -> None:
        """count DMAs of nbytes, `slots` in flight, each multiplied when it lands; mix: the
        matrices of one DMA as (fraction of its bytes, weights per byte, on the MXU as fp8, MXU
        rows per batch row) (default bf16); order: how its DMAs meet the ring's already issued
        (FETCH_ORDERS)."""
        issue = self._fetch_issuer(order)
        ends = self.prefetched or [issue(nbytes) for _ in range(min(slots, count))]
        self.prefetched = []
        duration = nbytes * (sum(share * self.chip.mxu_seconds_per_byte(self.batch * spread,
                                                                        weights, fp8)
                                 for share, weights, fp8, spread in mix)
                             if mix else self.per_byte_bf16)
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
                ends.append(issue(nbytes))
        self.t = t
        self.flops += self.batch * nbytes * count

    def _fetch_issuer(self, order: str):
        """How a fetch in `order` issues one DMA (returns when it lands)."""
        return self._dma if order in (QUEUED, HELD) and self.chip.n_dma_engines == 1 \
            else functools.partial(self._fetch_dma, first=order == FIRST)

    def _prefetch(self, i: int) -> None:
        """The first DMAs of the fetch after op i, issued now (`prefetched`: their landings)."""
        fetch = next((op for op in self.ops[i + 1:] if isinstance(op, tuple)
                      and op[0] == "fetch"), None)
        if fetch is None:
            raise ValueError(f"op {i}: a prefetch with no fetch after it")
        nbytes, count, slots, *rest = fetch[1:]
        issue = self._fetch_issuer(rest[1] if len(rest) > 1 else QUEUED)
        self.prefetched = [issue(nbytes) for _ in range(min(slots, count))]

    def _compute(self, flops: float) -> None:
        """Element-wise work of `flops` on the vector unit, after whatever the rank did before."""
        end = self.t + flops / self.chip.vpu_flops
        append_interval(self.compute, self.t, end)
        self.t = end
        self.flops += flops

    def _fetch_dma(self, nbytes: float, *, first: bool) -> float:
        """One fetched DMA issued now beside the ring's issued blocks (the fetches' own FIFO):
        first, ahead of the ring blocks not yet moving (the block in flight finishes first;
        those after it wait the fetch's time); else on a DMA queue of its own, sharing the
        bandwidth with the ring's queued blocks while both move (each at half the rate).
        Returns when it lands."""
        ready, size = self.t + self.lat, nbytes / self.bw
        if first:
            start = max(ready, self.fetch_free)
            start = self._ring_block_end(start)
            end = start + size

            def delayed(e: float) -> float:
                return e + size
        else:
            start = max(ready, self.fetch_free)
            end = start + size + min(size, max(0.0, self.free - start))

            def delayed(e: float) -> float:
                return e + min(e - start, size)
        ends = self.ends
        for i in range(self.consumed, self.issued):
            if ends[i] > start:
                ends[i] = delayed(ends[i])
        self.free = delayed(self.free) if self.free > start else max(self.free, end)
        self._delay_intervals(start, end, delayed)
        self.fetch_free = end
        self.dma_bytes += nbytes
        return end

    def _ring_block_end(self, t: float) -> float:
        """When the ring block moving at t ends (t: none moves)."""
        ends, blocks, bw = self.ends, self.blocks, self.bw
        for i in range(self.consumed, self.issued):
            if ends[i] - blocks[i] / bw <= t < ends[i]:
                return ends[i]
        return t

    def _delay_intervals(self, start: float, end: float, delayed) -> None:
        """The HBM-busy intervals with the ring's after `start` delayed and [start, end) added."""
        # the intervals' ends increase (sorted, disjoint): those ending by `start` are a prefix,
        # kept as they are; only the tail after it is cut and delayed (linear in the tail, not
        # in the step's intervals so far)
        kept = self.dma
        first = bisect.bisect_right(kept, start, key=_interval_end)
        tail, moved = kept[first:], [(start, end)]
        del kept[first:]
        for a, b in tail:
            if a < start:
                kept.append([a, start])
            moved.append((delayed(max(a, start)), delayed(b)))
        for a, b in sorted(moved):
            append_interval(kept, a, b)

    # ---- the result ---------------------------------------------------------------------------
    def _finish(self) -> None:
        if self.open_phases:
            raise ValueError(f"phase {self.open_phases[-1]['event'].name!r} has no phase_end")
        for d in self.dmas:  # DMAs never waited still finish: the step ends when they do
            self.engines.finish(d)
        self.total = max([self.t, self.free] + self.writes + [d.end for d in self.dmas])
        for d in self.dmas:
            if d.consumed is None:
                d.consumed = max(d.end, self.t)

    def busy(self) -> tuple[list, list]:
        """(HBM-busy, compute-busy) intervals, sorted and disjoint."""
        if not self.dmas and not self.compute_spans:
            return self.dma, self.compute
        return (merge_intervals((d.start, d.end) for d in self.dmas),
                merge_intervals((s.start, s.end) for s in self.compute_spans))

    def timeline(self) -> Timeline:
        """The rank's Timeline: a recorded log's DMAs each on its engine's lane, with the VMEM in
        use and the compute unit's idle times; the ring's as its merged busy intervals."""
        if not self.dmas and not self.compute_spans and not self.collective_spans:
            spans = [Span(lane="DMA 0", name="hbm", start=a, end=b, kind="dma")
                     for a, b in self.dma]
            spans += [Span(lane=COMPUTE_LANE, name="compute", start=a, end=b, kind="compute")
                      for a, b in self.compute]
            return Timeline(chip=self.chip, spans=tuple(spans), vmem=((0.0, 0),),
                            total_s=self.total, dma_bytes=round(self.dma_bytes),
                            flops=self.flops, idle=())
        dma_spans = [Span(lane=f"DMA {d.engine}", name=d.event.name, start=d.start, end=d.end,
                          kind="dma", nbytes=d.event.nbytes, slot=d.event.slot, issue=d.issue)
                     for d in self.dmas]
        spans = tuple(sorted(dma_spans + self.compute_spans + self.collective_spans,
                             key=lambda s: (s.start, s.lane)))
        return Timeline(chip=self.chip, spans=spans, vmem=_vmem_curve(self.dmas),
                        total_s=self.total, dma_bytes=sum(d.event.nbytes for d in self.dmas),
                        flops=self.flops,
                        idle=tuple(_compute_idle(self.compute_spans, dma_spans, self.total)))


def _take_match(in_flight: dict, ev: LogEvent, i: int) -> _Dma:
    for key in match_keys(ev):
        queue = in_flight.get(key)
        if queue:
            d = queue.popleft()
            for other in match_keys(d.event):  # remove it from the other keys' queues too
                q = in_flight.get(other)
                if q and d in q:
                    q.remove(d)
            return d
    raise ValueError(f"event {i}: dma_wait {ev.name!r} (slot {ev.slot}) has no matching dma_start")


def _to_vmem(ev: LogEvent) -> bool:
    """Does this DMA land in VMEM? Yes unless its destination is another memory (HBM for a
    writeback, SMEM for scalars); an unnamed destination counts as VMEM."""
    dst = ev.dst.lower()
    return dst in ("", "vmem") or "vmem" in dst


def _vmem_curve(dmas: list[_Dma]) -> tuple[tuple[float, int], ...]:
    # a block holds VMEM from its issue (the slot is reserved) until the phase that reads it ends
    deltas: dict[float, int] = {}
    for d in dmas:
        if not _to_vmem(d.event):
            continue
        deltas[d.issue] = deltas.get(d.issue, 0) + d.event.nbytes
        deltas[d.consumed] = deltas.get(d.consumed, 0) - d.event.nbytes
    curve, level = [(0.0, 0)], 0
    for time in sorted(deltas):
        level += deltas[time]
        if curve[-1][0] == time:
            curve[-1] = (time, level)
        else:
            curve.append((time, level))
    return tuple(curve)


def _compute_idle(compute: list[Span], dma_spans: list[Span], total: float) -> list[Idle]:
    busy = merge_intervals((s.start, s.end) for s in compute)
    moving = merge_intervals((s.start, s.end) for s in dma_spans)
    idle_compute, cursor = [], 0.0
    for a, b in busy:
        if a > cursor:
            idle_compute.append((cursor, a))
        cursor = max(cursor, b)
    if total > cursor:
        idle_compute.append((cursor, total))
    # Split each compute gap by whether a DMA moves bytes meanwhile: one sweep over both sorted
    # lists (gaps and the merged, disjoint moving intervals), linear in the number of spans.
    idle: list[Idle] = []
    i = 0
    for a, b in idle_compute:
        cursor = a
        while cursor < b:
            while i < len(moving) and moving[i][1] <= cursor:
                i += 1
            if i < len(moving) and moving[i][0] <= cursor:
                end, cause = min(b, moving[i][1]), "hbm_busy"
            else:
                end, cause = (min(b, moving[i][0]) if i < len(moving) else b), "bubble"
            if idle and idle[-1].cause == cause and idle[-1].end == cursor:
                idle[-1] = Idle(idle[-1].start, end, cause)
            else:
                idle.append(Idle(cursor, end, cause))
            cursor = end
    return idle


def vmem_at(timeline: Timeline, time: float) -> int:
    """VMEM bytes in use at `time` (the step function of `timeline.vmem`)."""
    times = [t for t, _ in timeline.vmem]
    i = bisect.bisect_right(times, time) - 1
    return timeline.vmem[i][1] if i >= 0 else 0
