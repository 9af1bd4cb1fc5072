"""The copy ceiling of a megakernel step: every HBM byte its schedule lists, moved in the same
DMAs (sizes, order, direction) by a kernel that computes nothing (`kernels/base/copy_stream.py`).
Its device time is the fastest the chip moves that step's bytes in those blocks: what the
megakernel's time is measured against (`benchmarks/yardsticks_tpu.py`).

    kernel = copy_kernel_for(plan)                        # the worst-case schedule's DMAs
    kernel = copy_kernel_for(plan, positions, expert_ids) # one step's exact DMAs
    kernel = copy_kernel_for(schedule(plan, ...))         # or a schedule made already
    out = kernel.fn(*kernel.args)

Every DMA of the schedule that moves HBM bytes becomes one `copy_stream.Block` of the DMA's
block shape and dtype: reads HBM -> VMEM, write-backs (KV entries, recurrent states) VMEM -> HBM.
The routing's VMEM -> SMEM copies move no HBM byte and are left out. The pipeline is the
megakernel's ring depth (`cfg.ring_depth`) unless `depth` is given: the megakernel keeps that
many weight blocks in flight.
"""

from __future__ import annotations

from typing import Any

from mkresearch.kernels.base import copy_stream
from mkresearch.kernels.compose.megakernel_plan import MegaPlan
from mkresearch.kernels.compose.schedule import StepSchedule, schedule


def blocks_of(sched: StepSchedule) -> tuple[copy_stream.Block, ...]:
    """One block per DMA of the schedule that moves HBM bytes, in its order."""
    return tuple(copy_stream.Block(dma.shape, dma.dtype, write=dma.written)
                 for dma in sched.starts if dma.hbm)


def copy_kernel_for(plan: Any, positions: Any = None, expert_ids: Any = None, *,
                    depth: int | None = None, allocate: bool = True,
                    chip: str | None = None) -> copy_stream.CopyKernel:
    """The copy of one megakernel step's HBM bytes. plan: a MegaPlan (its schedule at
    `positions` [B] and `expert_ids` [n_routed_layers, B, k], each None for the worst case) or a
    StepSchedule. depth: DMAs in flight (default the plan's cfg.ring_depth). allocate=False: the
    arguments as shape structs (to compile without allocating). chip: whose VMEM the rings must
    fit (`copy_stream.copy_kernel`)."""
    if isinstance(plan, StepSchedule):
        if positions is not None or expert_ids is not None:
            raise ValueError("positions and expert_ids are invalid with a StepSchedule: its own "
                             "were given to schedule(); pass None")
        sched = plan
    elif isinstance(plan, MegaPlan):
        sched = schedule(plan, positions, expert_ids)
    else:
        raise ValueError(f"plan={plan!r:.80} is invalid: a MegaPlan (megakernel_plan.make_plan) "  # noqa: TRY004
                         "or a StepSchedule (schedule.schedule)")
    depth = sched.plan.cfg.ring_depth if depth is None else depth
    return copy_stream.copy_kernel(blocks_of(sched), depth, allocate=allocate, chip=chip)
