"""One DMA of a megakernel step as data: the schedule's event (`kernels/compose/schedule.py`).

A `PlannedDma` is what a dry run of the kernel (`kernels/base/dry_run.py`) records for each DMA
start or wait the kernel issues: what the DMA log records of it, and what it belongs to (the
layer and stage, the kind of VMEM buffer it fills). The buffer kinds are named here; the code
that issues each DMA says which it fills (`dma.Copy(..., buffer=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    tags the kernel gives the DMA, as sorted (name, value) pairs. shape and dtype: the block it
    moves (its VMEM window's, e.g. (128, 512) and "bfloat16"; a copy kernel streams the same
    blocks, `kernels/base/copy_stream.py`), not part of what the log records."""

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
    shape: tuple[int, ...] = field(default=(), compare=False)
    dtype: str = field(default="", compare=False)

    @property
    def hbm(self) -> bool:
        """Whether the DMA moves HBM bytes (the VMEM -> SMEM copies of the routing do not)."""
        return "hbm" in (self.src, self.dst)

    @property
    def written(self) -> bool:
        """Whether it writes HBM (a state or cache write-back)."""
        return self.dst == "hbm"

    def log_key(self) -> tuple:
        """What the DMA log records of it: compare with `log_key(event)`."""
        return (self.kind, self.name, self.src, self.dst, self.nbytes, self.slot, self.indices)


@dataclass(frozen=True)
class PlannedPhase:
    """One edge of a compute phase (`dma.phase`), as the DMA log records it: kind
    ("phase_start" or "phase_end"), name, declared FLOPs and VMEM bytes, the loop tags; and the
    layer and stage it belongs to. A dry run plans phases only when asked
    (`dry_run.trace_kernel(phases=True)`: a kernel's whole log, on a chip); schedules hold DMAs."""

    kind: str
    name: str
    flops: int
    vmem_bytes: int
    layer: int | None
    stage: str | None
    indices: tuple[tuple[str, int], ...] = ()


def log_key(event: Any) -> tuple:
    """The `PlannedDma.log_key` of a recorded `dma.Event`."""
    return (event.kind, event.name, event.src, event.dst, event.nbytes, event.slot,
            tuple(sorted(event.indices.items())))

