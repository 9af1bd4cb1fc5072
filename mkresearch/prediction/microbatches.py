"""Two microbatches on one core, a what-if (not built): whether splitting a step's B rows into two
microbatches of B / 2, run alternately, hides one's collectives behind the other's products.

DeepSeek's decoding does this on GPUs ("dual-batch overlap": DeepSeek-V3/R1 Inference System
Overview, github.com/deepseek-ai/open-infra-index; vLLM's `--enable-dbo`): while one microbatch's
all-to-all is on the wire, the other computes. A TPU core runs one instruction stream, so here
the two alternate stage by stage in one program (`interleave`): the first microbatch's products
up to a collective, that collective started without waiting, the second's products on the same
weight blocks (still in VMEM: read once, multiplied twice), its collective started, then the
first's collective waited for, and so on. Each microbatch is the designs' last step chosen at
B / 2 rows (`design_table.design_steps`), its own routing (seeds 0 and 1).

What it costs: at fewer than 256 rows a weight tile costs the MXU its push however few rows
(`TimelineChip.mxu_seconds_per_byte`), so every weight block shared by the two is pushed twice;
the routed experts are each microbatch's own. What it gains: a collective of one hides behind the
other's products. ASSUMPTIONS, each in the design's favour (the step is the best this
interleave could take): the two microbatches' collectives are priced each alone (no contention
on the links); a weight block the first has multiplied stays in VMEM beside the ring until the
second has (the ring's `("hold", n)` / `("again", n)`), its slot refilled meanwhile: VMEM the
core does not have (`held_vmem_bytes`, beside the ring's `ring_bytes`). A kernel within VMEM
would cut the segments between collectives shorter, or read the blocks twice.

    two_microbatch_step(cfg, 32, batch=8)   # {"two_microbatches_s", "one_microbatch_s", ...}
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mkresearch.model.config import ModelConfig
from mkresearch.prediction import calibration, design_table, scale_out
from mkresearch.prediction.timeline_ranks import PARTS
from mkresearch.sharding import layout as layouts

FIRST, SECOND = "/mb0", "/mb1"  # the suffixes of each microbatch's collectives
BLOCKING = 6  # a ("start", ...) op's `blocking` field (`program.Program.collective`)


def _segments(ops: list) -> list[tuple[list, tuple | None]]:
    """A program cut at its blocking collectives: (the ops before one, that collective's start);
    the last segment's collective None."""
    out, current = [], []
    for op in ops:
        if op[0] == "start" and op[BLOCKING]:
            out.append((current, op))
            current = []
        else:
            current.append(op)
    return out + [(current, None)]


def _renamed(op: tuple, suffix: str) -> tuple:
    """A collective's start or wait under the microbatch's own name; any other op as it is."""
    if op[0] in ("start", "wait"):
        return (op[0], op[1] + suffix, *op[2:])
    return op


def _started_early(op: tuple, suffix: str) -> tuple:
    """A blocking collective's start, renamed and not waited for here."""
    op = _renamed(op, suffix)
    return (*op[:BLOCKING], False, *op[BLOCKING + 1:])


def interleave(first: list, second: list) -> list:
    """One rank's program running two microbatches' programs (the same blocks and collectives,
    their own expert fetches and rows) alternately, segment by segment: the first's segment (its
    blocks held for the second), its collective started; the second's last collective waited
    for, its segment (the held blocks multiplied again), its collective started; then the
    first's collective waited for."""
    cut_first, cut_second = _segments(first), _segments(second)
    if len(cut_first) != len(cut_second):
        raise ValueError(f"the microbatches' programs meet {len(cut_first) - 1} and "
                         f"{len(cut_second) - 1} blocking collectives: they must meet the same")
    ops: list = []
    pending = None  # the second microbatch's last collective, not yet waited for
    for (ops_a, coll_a), (ops_b, coll_b) in zip(cut_first, cut_second):
        for op in ops_a:
            if op[0] == "blocks":
                ops.append(("hold", op[1]))
            ops.append(_renamed(op, FIRST))
        if coll_a is not None:
            ops.append(_started_early(coll_a, FIRST))
        if pending is not None:
            ops.append(("wait", pending))
            pending = None
        ops += [("again", op[1]) if op[0] == "blocks" else _renamed(op, SECOND) for op in ops_b]
        if coll_b is not None:
            ops.append(_started_early(coll_b, SECOND))
            pending = coll_b[1] + SECOND
        if coll_a is not None:
            ops.append(("wait", coll_a[1] + FIRST))
    if pending is not None:
        ops.append(("wait", pending))
    return ops


def two_microbatch_step(cfg: ModelConfig, n_ranks: int = 32, batch: int = 2, *,
                        model: calibration.Model = design_table.SAME_ASSUMPTIONS
                        ) -> dict[str, Any]:
    """Our step at `batch` (even) as two microbatches of batch / 2 rows interleaved on every
    rank, each the designs' last step at batch / 2 (see the module docstring), under `model`:
    its step, the slowest rank's parts, the MXU's second push on the shared blocks, the VMEM the
    held blocks take, and one microbatch alone (the designs' last step at batch / 2, simulated
    the same way)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 2 or batch % 2:
        raise ValueError(f"batch={batch!r} is invalid: an even int >= 2 (two microbatches)")
    half = batch // 2
    label, variant, fields = design_table.design_steps(cfg, n_ranks, half, model=model)[-1]
    sched = design_table.design_schedule(variant, n_ranks, half, **fields)
    if model.prefetch_across is not None:  # as `scale_out.predict` applies the Model's switch
        sched = dataclasses.replace(sched, prefetch_across=model.prefetch_across)
    blocks, first = scale_out.rank_programs(variant, n_ranks, layouts.OURS, half, schedule=sched,
                                            context=model.context, seed=0)
    _, second = scale_out.rank_programs(variant, n_ranks, layouts.OURS, half, schedule=sched,
                                        context=model.context, seed=1)
    lay = scale_out.placed_layout(variant, n_ranks, layouts.OURS, sched)
    inter = scale_out.step_interconnect("tpu7x", n_ranks, model.interconnect)

    def simulate(programs):
        return scale_out.simulate_step(programs, blocks, sched, half, lay, inter, "auto",
                                       model.timeline_chip or "tpu7x")

    both = simulate([interleave(a, b) for a, b in zip(first, second)])
    alone = simulate(first)
    parts = both.decomposition()
    return {"model": cfg.name, "n_ranks": n_ranks, "batch": batch, "microbatch_rows": half,
            "design": label.removeprefix("+ "), "two_microbatches_s": both.total_s,
            "one_microbatch_s": alone.total_s, "parts_s": {p: parts[p] for p in PARTS},
            # the weight blocks kept for the second microbatch, beside the ring (not counted in
            # the kernel's VMEM plan: ASSUMPTION, an optimistic what-if)
            "held_vmem_bytes": max(sim.held_peak_bytes for sim in both.sims),
            # the second microbatch's products on the shared blocks: the MXU's second push
            "second_push_s": both.sims[both.rank_totals().index(both.total_s)].again_s,
            "ring_bytes": sched.banks * sched.block_bytes,
            "label": "timeline model what-if (mkresearch.prediction.microbatches): not built, "
                     "not measured"}
