"""What-if logs without re-running a kernel: the canonical streaming loop, the same log with
another buffer count, a BlockSpec pipeline's implicit copies, another batch; and the Pallas
pipelining guide's closed forms that `mkresearch.prediction.timeline.simulate` is checked against."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mkresearch.prediction.timeline_events import LogEvent, events_of, match_keys


def stream_log(n_blocks: int, block_bytes: int, block_flops: float, n_buffers: int, *,
               name: str = "w", block_vmem_bytes: int | None = None) -> list[LogEvent]:
    """The log of the canonical streaming loop with `n_buffers` VMEM slots (a ring):

    issue the first n_buffers-1 blocks; then for each block i: issue block i+n_buffers-1 (into the
    slot block i-1 just freed), wait for block i, compute on it. One buffer = no overlap.
    """
    for pname, value in (("n_blocks", n_blocks), ("n_buffers", n_buffers)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{pname}={value!r} is invalid: an int >= 1")
    vmem = block_bytes if block_vmem_bytes is None else block_vmem_bytes
    steps = [[LogEvent("dma_start", name, "hbm", "vmem", block_bytes, i % n_buffers, (("k", i),))]
             for i in range(n_blocks)]
    events: list[LogEvent] = []
    issued = 0
    for i in range(n_blocks):
        while issued < n_blocks and issued <= i + n_buffers - 1:
            events += steps[issued]
            issued += 1
        events.append(dataclasses.replace(steps[i][0], kind="dma_wait"))
        events.append(LogEvent("phase_start", f"{name}_block", flops=block_flops, vmem_bytes=vmem,
                               indices=(("k", i),)))
        events.append(LogEvent("phase_end", f"{name}_block", indices=(("k", i),)))
    return events


def rebuffer(log: Any, n_buffers: int) -> list[LogEvent]:
    """The same log replayed with `n_buffers` slots per stream: what the kernel would record.

    The log is cut into steps: the DMAs waited before a top-level phase are that phase's inputs.
    Replayed, the inputs of step k are issued before the waits of step k - (n_buffers - 1), in
    their original order, and go to slot k % n_buffers. DMAs waited after the last phase (output
    writebacks) keep their place at the end. Valid for streaming kernels, where each block feeds
    the phase right after its wait; the control bar of `mkresearch.views.widgets` uses it.
    """
    if not isinstance(n_buffers, int) or n_buffers < 1:
        raise ValueError(f"n_buffers={n_buffers!r} is invalid: an int >= 1")
    events = events_of(log)
    steps: list[tuple[list[tuple[LogEvent, LogEvent]], list[LogEvent]]] = []
    waits: list[tuple[LogEvent, LogEvent]] = []
    phase: list[LogEvent] = []
    depth = 0
    unmatched: list[LogEvent] = []
    for ev in events:
        if ev.kind == "dma_start":
            unmatched.append(ev)
        elif ev.kind == "dma_wait":
            start = next((s for level in range(3) for s in unmatched
                          if match_keys(s)[level] == match_keys(ev)[level]), None)
            if start is None:
                raise ValueError(f"dma_wait {ev.name!r} has no matching dma_start")
            unmatched.remove(start)
            waits.append((start, ev))
        else:
            phase.append(ev)
            depth += 1 if ev.kind == "phase_start" else -1
            if depth == 0:
                steps.append((waits, phase))
                waits, phase = [], []
    tail_waits = waits
    out: list[LogEvent] = []
    issued = 0

    def slotted(ev: LogEvent, k: int) -> LogEvent:
        return dataclasses.replace(ev, slot=k % n_buffers) if ev.slot is not None else ev

    for k, (step_waits, step_phase) in enumerate(steps):
        while issued < len(steps) and issued <= k + n_buffers - 1:
            out += [slotted(s, issued) for s, _ in steps[issued][0]]
            issued += 1
        out += [slotted(w, k) for _, w in step_waits]
        out += step_phase
    out += [s for s, _ in tail_waits] + [w for _, w in tail_waits] + unmatched
    return out


def blockspec_log(log: Any, block_bytes: Mapping[str, int], *, out_bytes: int = 0,
                  out_name: str = "out") -> list[LogEvent]:
    """The DMAs a BlockSpec + grid pipeline issues, put around a BlockSpec kernel's phases.

    Pallas emits those copies itself, so a BlockSpec kernel's log holds only its phases (one
    top-level phase per grid step). Its TPU pipeline double-buffers each input whose block changes:
    at step k it starts the copies of step k+1's blocks, waits for step k's, runs the body. This
    puts those events in: one DMA per name in `block_bytes` (bytes of that input's block) per
    step, and, if `out_bytes`, the writeback of a resident output block after the last step.
    """
    steps: list[list[LogEvent]] = []
    depth = 0
    for ev in events_of(log):
        if ev.kind not in ("phase_start", "phase_end"):
            raise ValueError(f"log is invalid: a BlockSpec kernel's log has only phases, got "
                             f"{ev.kind} {ev.name!r}")
        if depth == 0:
            steps.append([])
        steps[-1].append(ev)
        depth += 1 if ev.kind == "phase_start" else -1

    def copies(k: int, kind: str) -> list[LogEvent]:
        return [LogEvent(kind, name, "hbm", "vmem", int(nbytes), k % 2, (("k", k),))
                for name, nbytes in block_bytes.items()]

    serial = [ev for k, phase_events in enumerate(steps)
              for ev in copies(k, "dma_start") + copies(k, "dma_wait") + phase_events]
    out = rebuffer(serial, 2)
    if out_bytes:
        writeback = LogEvent("dma_start", out_name, "vmem", "hbm", int(out_bytes))
        out += [writeback, dataclasses.replace(writeback, kind="dma_wait")]
    return out


def scale_batch(log: Any, factor: float) -> list[LogEvent]:
    """The log with every phase's FLOPs multiplied by `factor` (batch B -> factor * B).

    Weight bytes do not depend on the batch; activation bytes are small at decode batch sizes and
    are left as recorded.
    """
    if not (isinstance(factor, (int, float)) and factor > 0):
        raise ValueError(f"factor={factor!r} is invalid: a number > 0")
    return [dataclasses.replace(ev, flops=ev.flops * factor) if ev.kind.startswith("phase") else ev
            for ev in events_of(log)]


# ---- closed forms to check the model against -------------------------------------------------
def guide_compute_bound_s(alpha: float, x_bytes: float, beta: float, n: int, y_flops: float,
                          f: float) -> float:
    """Pallas pipelining guide, compute-bound: (α + X/β) + N·Y/F (the first copy is exposed)."""
    return (alpha + x_bytes / beta) + n * (y_flops / f)


def guide_bandwidth_bound_s(alpha: float, x_bytes: float, beta: float, n: int) -> float:
    """Pallas pipelining guide, bandwidth-bound: α + N·X/β (copies back to back)."""
    return alpha + n * (x_bytes / beta)
