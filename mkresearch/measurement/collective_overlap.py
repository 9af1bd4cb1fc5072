"""What a recorded sharded step says about overlap: is HBM busy while a collective is outstanding?

A rank's events (`dma.DmaLog.of_rank`) are in its program order. A collective is a run of remote
copies of one name (`kernels/sharded/collectives.py`: its starts, then its waits); an HBM DMA is
in flight from its start to its wait (the weight blocks the global ring issues ahead, the expert
slots issued ahead). Time here is the event index, not seconds: the log orders events, the
timeline model (`mkresearch.prediction`) prices them.
"""

from __future__ import annotations

from typing import Any

from mkresearch.kernels.base import dma


def _key(e: dma.Event) -> tuple:
    return e.name, e.slot, tuple(sorted(e.indices.items()))


def collective_overlap(log: dma.DmaLog, rank: int) -> list[dict[str, Any]]:
    """Each collective of `rank`'s step in order -> {"name", "start" (its first remote start),
    "wait" (its first remote wait: where the rank stops for it), "end" (its last remote wait),
    event indices; "hbm_in_flight" (HBM DMAs started and not yet waited at "wait") and
    "hbm_bytes_in_flight"}."""
    events = log.of_rank(rank).events
    in_flight: dict[tuple, list[int]] = {}  # key -> the bytes of each DMA started, not waited
    out: list[dict[str, Any]] = []
    for i, e in enumerate(events):
        if e.kind not in ("dma_start", "dma_wait"):
            continue
        if not e.remote:
            if "hbm" not in (e.src, e.dst):
                continue
            if e.kind == "dma_start":
                in_flight.setdefault(_key(e), []).append(e.nbytes)
            elif in_flight.get(_key(e)):
                in_flight[_key(e)].pop(0)
            continue
        if e.kind == "dma_start" and (not out or out[-1]["name"] != e.name
                                      or out[-1]["wait"] is not None):
            out.append({"name": e.name, "start": i, "wait": None, "end": i})
        current = out[-1] if out and out[-1]["name"] == e.name else None
        if current is None:
            continue
        current["end"] = i
        if e.kind == "dma_wait" and current["wait"] is None:
            current["wait"] = i
            current["hbm_in_flight"] = sum(len(v) for v in in_flight.values())
            current["hbm_bytes_in_flight"] = sum(sum(v) for v in in_flight.values())
    return out


def overlap_rows(log: dma.DmaLog, rank: int, first: int = 0, last: int | None = None
                 ) -> list[dict[str, Any]]:
    """The picture's data: {"lane": "HBM" | "collective", "name", "start", "end"} (event indices)
    of `rank`'s step within [first, last): the spans with an HBM DMA in flight, and each
    collective from its first remote start to its last remote wait."""
    events = log.of_rank(rank).events
    last = len(events) if last is None else last
    rows, open_dmas, busy_from = [], 0, None
    for i, e in enumerate(events):
        if e.remote or e.kind not in ("dma_start", "dma_wait") or "hbm" not in (e.src, e.dst):
            continue
        was = open_dmas
        open_dmas = max(0, open_dmas + (1 if e.kind == "dma_start" else -1))
        if was == 0 and open_dmas > 0:
            busy_from = i
        elif was > 0 and open_dmas == 0:
            rows.append({"lane": "HBM", "name": "weights", "start": busy_from, "end": i})
    rows += [{"lane": "collective", "name": c["name"], "start": c["start"], "end": c["end"]}
             for c in collective_overlap(log, rank)]
    return [r for r in rows if r["end"] > first and r["start"] < last]
