"""One DMA of a megakernel step as data, known before anything is traced: the schedule's event.

`kernels/compose/schedule.py` lists every DMA a step will issue, in order, as `PlannedDma`s. Each piece of
kernel code that issues DMAs has its twin beside it, a function that states the same DMAs as data
from the same static plan (`blocks.ring_matmul_dmas` beside `blocks._ring_matmul`,
`weight_stream.RingSchedule` beside `GlobalStream`, `kv_tiles.tile_loop_dmas` beside `tile_loop`,
each kind's `KernelStage.schedule` beside its body, ...). A stage kind's schedule function works
from a `StageCall`, the data twin of the `StageRefs` its body gets: one layer's weight and state
shapes (the very shapes of the Refs), each row's position, the layer's routing, and the weight
stream the body draws from. `tests/test_schedule.py` holds the twins equal to the recorded DMA log,
event for event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

DMA_KINDS = ("dma_start", "dma_wait")

# The VMEM buffer a DMA fills (or a write drains): what the schedule's summaries group DMAs by.
WEIGHT_RING = "weight ring"  # the megakernel's global ring (kernels/base/weight_stream.py)
LOCAL_RING = "local ring"  # a matrix's own two-slot ring (blocks.LOCAL_STREAM)
WHOLE = "whole weight"  # a small weight copied whole (blocks.load_whole, load_into)
STATE = "recurrent state"  # a layer's recurrent state, read and written whole
KV_TILES = "KV tiles"  # the MLA cache read tile by tile (kernels/base/kv_tiles.py)
KV_UPDATE = "KV update block"  # the new entry's aligned 16-row block, read and written back
EXPERT_SLOTS = "expert slots"  # the routed experts' slot ring (kernels/stages/experts.py)
ROUTING = "routing"  # the router's choices VMEM -> SMEM (not HBM traffic)
EMBEDDING = "embedding blocks"  # each token's aligned 16-row block of E
LAYER_VECTORS = "layer vectors"  # the residual strategy's per-layer weights and norm gains
HEAD_VECTORS = "head vectors"  # the final mix weights and norm gain
LM_HEAD_TILES = "LM head tiles"
STATE_BUFFERS = (STATE, KV_TILES, KV_UPDATE)  # a kind's state, not its weights


@dataclass(frozen=True)
class PlannedDma:
    """One start or wait of a DMA, as the DMA log records it (kind, name, src, dst, nbytes, slot,
    indices: `dma.Event`), and what it belongs to: the layer and stage whose data it moves (a
    weight block started ahead belongs to the stage that will use it) and the VMEM buffer.

    stage: a kind ("kda", "mla", "dense", "moe", ...) or a part of the trunk ("embedding",
    "residual", "sampling"); layer None for the trunk outside the layer loop. indices: the log
    tags the kernel gives the DMA, as sorted (name, value) pairs."""

    kind: str
    name: str
    src: str
    dst: str
    nbytes: int
    slot: int | None
    layer: int | None
    stage: str
    buffer: str
    indices: tuple[tuple[str, int], ...] = ()

    @property
    def hbm(self) -> bool:
        """Whether the DMA moves HBM bytes (the VMEM -> SMEM copies of the routing do not)."""
        return "hbm" in (self.src, self.dst)

    @property
    def written(self) -> bool:
        """Whether it writes HBM (a state or cache write-back)."""
        return self.dst == "hbm"

    def waited(self) -> PlannedDma:
        """The wait of this DMA (same description, kind dma_wait)."""
        return PlannedDma("dma_wait", self.name, self.src, self.dst, self.nbytes, self.slot,
                          self.layer, self.stage, self.buffer, self.indices)

    def log_key(self) -> tuple:
        """What the DMA log records of it: compare with `log_key(event)`."""
        return (self.kind, self.name, self.src, self.dst, self.nbytes, self.slot, self.indices)


def log_key(event: Any) -> tuple:
    """The `PlannedDma.log_key` of a recorded `dma.Event`."""
    return (event.kind, event.name, event.src, event.dst, event.nbytes, event.slot,
            tuple(sorted(event.indices.items())))


def nbytes(shape: Any, dtype: Any = None) -> int:
    """Bytes of a shape struct (or of a shape and a dtype)."""
    if dtype is None:
        shape, dtype = shape.shape, shape.dtype
    return math.prod(int(s) for s in shape) * np.dtype(dtype).itemsize


def double_buffered(steps: list[list[PlannedDma]]) -> list[PlannedDma]:
    """The order of a two-slot pipeline over steps (each a list of DMA starts, step i in slot
    i mod 2): step 0 started, then per step the next one started before this one is waited for."""
    out = list(steps[0]) if steps else []
    for i, started in enumerate(steps):
        out += (steps[i + 1] if i + 1 < len(steps) else []) + [dma.waited() for dma in started]
    return out


def token_bytes(cache: Any) -> int:
    """Bytes of one token of one row of a cache array [B, (H,) S, n] (a window of the token
    axis, the second-to-last, of row b: every head's entry)."""
    return nbytes((*cache.shape[1:-2], cache.shape[-1]), cache.dtype)


@dataclass(frozen=True)
class StageCall:
    """What one layer's stage schedule works from: the data twin of `registry.StageRefs`.

    weights    the kind's prepared weights of this layer (shape structs: the Refs' shapes)
    state      this layer's state {leaf: [B, ...] shape struct}
    positions  each row's position (its cache slot), as the step's SMEM positions
    expert_ids [B, k] this layer's routing (a kind that routes), else None
    stream     where the body's matmuls get weight blocks (`weight_stream.StageRingSchedule`
               or `blocks.LOCAL_RING_SCHEDULE`): stream.matmul(call, name, weight, rows, indices)
    """

    kind: str
    layer: int
    index: int  # the layer's index within its kind
    batch: int
    weights: Any
    state: Any
    positions: tuple[int, ...]
    expert_ids: Any
    stream: Any

    @property
    def indices(self) -> dict[str, int]:
        """The DMA-log tags the megakernel gives the body (refs.indices)."""
        return {"layer": self.layer}

    def start(self, name: str, nbytes: int, *, buffer: str, src: str = "hbm", dst: str = "vmem",
              slot: int | None = None, **indices: int) -> PlannedDma:
        """The start of a DMA of this stage and layer (its wait: `.waited()`)."""
        return PlannedDma("dma_start", name, src, dst, int(nbytes), slot, self.layer, self.kind,
                          buffer, tuple(sorted(indices.items())))

    def copy(self, name: str, nbytes: int, **kwargs: Any) -> list[PlannedDma]:
        """A DMA started and waited for at once (`dma.Copy(...).start().wait()`)."""
        started = self.start(name, nbytes, **kwargs)
        return [started, started.waited()]

    def matmul(self, name: str, weight: Any, rows: int, **indices: int) -> list[PlannedDma]:
        """The DMAs of `blocks.stream_matmul(refs.stream, x, w, rows=rows, name=name,
        **indices)`, weight the shape struct of w [K, N]."""
        return self.stream.matmul(self, name, weight, rows, indices)
