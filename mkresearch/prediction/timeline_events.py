"""The DMA/phase log as the timeline model reads it: `LogEvent`, from a recorded log or JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DMA_KINDS = ("dma_start", "dma_wait", "phase_start", "phase_end")


@dataclass(frozen=True)
class LogEvent:
    """One entry of the DMA/phase log, as the timeline reads it (mirrors `dma.Event`)."""

    kind: str
    name: str
    src: str = ""
    dst: str = ""
    nbytes: int = 0
    slot: int | None = None
    indices: tuple = ()
    flops: float = 0.0
    vmem_bytes: int = 0


@dataclass(frozen=True)
class CollectiveEvent:
    """A collective in a rank's program (`mkresearch.prediction.timeline_ranks`): the program waits until
    every member of `group` has arrived and the messages of `op` (`mkresearch.hardware.interconnect`,
    priced over `path`: the members in message order, default the group) have arrived.
    nbytes: all_gather, one member's piece; all_reduce, the vector; chain, the running sum."""

    name: str
    op: str
    group: tuple[int, ...]
    nbytes: int
    path: tuple[int, ...] = ()
    kind: str = "collective"


def events_of(log: Any) -> list[LogEvent]:
    """The events of a `dma.recording()` log, a list of `dma.Event`s, or their JSON records.

    Accepts an object with `.events`, a JSON string, or a sequence of objects/dicts with the
    `Event` fields. Raises ValueError naming the bad field.
    """
    if isinstance(log, str):
        log = json.loads(log)
    if isinstance(log, Mapping) and "events" in log:
        log = log["events"]
    events = getattr(log, "events", log)
    out = []
    for i, ev in enumerate(events):
        if isinstance(ev, (LogEvent, CollectiveEvent)):
            out.append(ev)
            continue
        get = ev.get if isinstance(ev, Mapping) else (lambda k, d=None, ev=ev: getattr(ev, k, d))
        kind = get("kind")
        if kind not in DMA_KINDS:
            raise ValueError(f"event {i}: kind={kind!r} is invalid: one of {DMA_KINDS}")
        indices = get("indices", ()) or ()
        if isinstance(indices, Mapping):
            indices = tuple(sorted(indices.items()))
        else:
            indices = tuple(tuple(x) if isinstance(x, list) else x for x in indices)
        out.append(LogEvent(kind=kind, name=str(get("name", "") or ""), src=str(get("src", "") or ""),
                            dst=str(get("dst", "") or ""), nbytes=int(get("nbytes", 0) or 0),
                            slot=get("slot", None), indices=indices,
                            flops=float(get("flops", 0) or 0),
                            vmem_bytes=int(get("vmem_bytes", 0) or 0)))
    return out


def to_records(log: Any) -> list[dict]:
    """JSON-ready dicts of a log's events (what `events_of` reads back)."""
    return [dataclasses.asdict(ev) | {"indices": [list(i) if isinstance(i, tuple) else i
                                                  for i in ev.indices]}
            for ev in events_of(log)]


def match_keys(ev: LogEvent) -> list[tuple]:
    # a wait names its DMA like the start did; fall back to coarser keys if it carries less
    return [("exact", ev.name, ev.slot, ev.indices), ("slot", ev.name, ev.slot), ("name", ev.name)]
