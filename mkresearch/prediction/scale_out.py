"""The full-size decode step on n ranks, predicted: every rank's program from a layout and a
schedule, simulated together with the interconnect (`mkresearch.prediction.timeline_ranks`).

A rank's program, in layer order (`cfg.layers`): its weight bytes (`layout_bytes.rank_bytes`, per
component, split over each stage's matrices by their per-rank sizes) stream in blocks through a
ring of `banks` blocks in flight; each block is waited, then multiplied. After a MoE layer's
routing, the rank fetches the routed experts of its expert group (counted from a seeded uniform
routing of the batch: ranks differ, and a collective waits for the slowest) through
`expert_slots` DMAs in flight. KDA states are read before the layer and written after it; an MLA
layer reads its cache at `context` tokens. The programs run in `scale_out_sim` (overlap: a
collective started early and waited later). The collectives between stages are the schedule's:

  release      (a hand-kept program of partial sums, docs/collectives.md) attention: the
               sibling's attended features
               gathered before W_o, an all-reduce over the 16 cores of one parity, the halves
               swapped with the sibling; MoE: router scores swapped with the sibling, the latent
               all-gathered behind routing, the shared expert's sum started before the routed
               experts and waited after them, then the routed sum; bf16 partial sums; two-level
               all-reduces below B = 6, reduce-scatter + all-gather from it; the ring does not run
               past a blocking collective (the release's own open items). ASSUMPTIONS: the layout's
               router kept whole (the release splits its scores between siblings: docs/collectives.md §1), one routed and one
               shared reduction per MoE layer (docs/collectives.md §1: "about two reductions per layer")
  ours         (`our_schedule(cfg, collectives, n_ranks, batch)`: its ring as deep as VMEM
               allows at the batch) every collective read from our kernel's own
               schedule (`kernels/compose/collective_schedule.py`, `scale_out_contract`): "partial-sum"
               (the default: matrices contracting over a split dimension reduce their partial
               sums, the shared expert's sum hidden behind the routed experts' stream) or
               "exact" (bit-equal to one device: gathers around split matrices, the experts'
               chain); each collective priced by the algorithm `collective_choice` picks for it

`predict(...)` returns the step, tok/s and the decomposition of the slowest rank's step into HBM
floor, waiting for peers, collective messages, compute and bubbles (they sum to the step).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
from dataclasses import dataclass

import numpy as np

import mkresearch.model.stages
from mkresearch.prediction import interconnect as links
from mkresearch.sharding import layout as layouts
from mkresearch.sharding import layout_bytes
from mkresearch.model import roofline, spec
from mkresearch.prediction import scale_out_contract as contract
from mkresearch.model.config import ModelConfig
from mkresearch.kernels.compose import megakernel_sharded
from mkresearch.prediction.scale_out_schedule import (  # noqa: F401 - scale_out.Schedule & co.
    COMBINES,
    MIB,
    RELEASE_SCHEDULE,
    RS_FROM_BATCH,
    SCHEDULES,
    Schedule,
    our_schedule,
    schedule_for,
)
from mkresearch.prediction.scale_out_sim import simulate
from mkresearch.prediction.timeline_chip import TimelineChip
from mkresearch.prediction.timeline_ranks import PARTS

F32 = 4
# docs/collectives.md: "Partial sums travel as bf16 pairs packed into 32-bit words"
PARTIAL_SUM_BYTES = 2
SAMPLING_LANES = 384  # the sampling state a vocab shard sends: `sharded_stages.STATE_LANES`
# docs/tpu.md §3: Kimi K3 on 16 TPU7x chips (32 cores), tok/s by batch
PUBLISHED = {
    "kimi-k3": {"chip": "tpu7x", "n_ranks": 32, "tok_s": dict(roofline.PUBLISHED_TPU7X_16_CHIPS),
                "gb200_tok_s": {1: 127, 2: 227, 4: 373, 8: 636},
                "speculative_tok_s": {3: 350, 6: 709}},
}


# ---- one rank's program ------------------------------------------------------------------------
class Program:
    """One rank's ops for `scale_out_sim` over the shared ring of weight `blocks`."""

    def __init__(self, blocks: list[int], batch: int) -> None:
        self.blocks, self.batch, self.ops = blocks, batch, []

    def block(self, count: int = 1) -> None:
        if self.ops and self.ops[-1][0] == "blocks":
            self.ops[-1] = ("blocks", self.ops[-1][1] + count)
        else:
            self.ops.append(("blocks", count))

    def fetch(self, nbytes: float, count: int, slots: int) -> None:
        if count:
            self.ops.append(("fetch", nbytes, count, slots))

    def write(self, nbytes: float) -> None:
        if nbytes:
            self.ops.append(("write", nbytes))

    def collective(self, name: str, op: str, group: tuple[int, ...], nbytes: float,
                   path: tuple[int, ...] = (), *, blocking: bool = True,
                   algorithm: str | None = None) -> None:
        self.ops.append(("start", name, op, tuple(group), tuple(path), nbytes, blocking,
                         algorithm))

    def wait(self, name: str) -> None:
        self.ops.append(("wait", name))


@dataclass(frozen=True)
class _Stage:
    kind: str
    matrices: tuple[tuple[str, int], ...]  # (DMA name, bytes of one layer on this rank)


def _stage_bytes(lay: layouts.Layout, counted: layout_bytes.RankBytes) -> dict[str, _Stage]:
    """Each kind's matrices with one layer's bytes on a rank: the kind's component bytes split
    by the matrices' per-rank element counts."""
    cfg = lay.cfg
    out = {}
    for kind in cfg.kinds:
        stage = spec.stage(kind)
        params = stage.params(cfg)
        matrices = megakernel_sharded.registry.kernel_stage(kind).streamed(cfg)
        sizes = [math.prod(layouts.local_shape(lay, m.shape, params[m.key].shard))
                 for m in matrices]
        per_layer = counted.component(stage.component[0]) / len(cfg.layers_of(kind))
        out[kind] = _Stage(kind, tuple((m.name, per_layer * s / sum(sizes))
                                       for m, s in zip(matrices, sizes, strict=True)))
    return out


@functools.lru_cache(maxsize=1024)
def weight_blocks(nbytes: float, block_bytes: int) -> tuple[int, ...]:
    """nbytes in blocks of at most block_bytes, as equal as whole bytes allow."""
    n = max(1, math.ceil(nbytes / block_bytes))
    whole = round(nbytes)
    return tuple(whole // n + (1 if i < whole % n else 0) for i in range(n))


def routed_experts(cfg: ModelConfig, lay: layouts.Layout, batch: int, seed: int = 0) -> np.ndarray:
    """[MoE layers, EP groups] distinct experts each expert group fetches: every row picks top_k
    of n_experts uniformly (seeded; ASSUMPTION: uniform routing, as roofline's expected count)."""
    rng = np.random.default_rng(seed)
    per_group = cfg.n_experts // lay.ep
    counts = np.zeros((len(cfg.moe_layers), lay.ep), np.int64)
    for i in range(len(cfg.moe_layers)):
        chosen = set()
        for _ in range(batch):
            chosen.update(rng.choice(cfg.n_experts, cfg.top_k, replace=False).tolist())
        for expert in chosen:
            counts[i, expert // per_group] += 1
    return counts


def _group(lay: layouts.Layout, rank: int, size: int) -> tuple[int, ...]:
    first = rank // size * size
    return tuple(range(first, first + size))


@functools.lru_cache(maxsize=16)
def rank_programs(cfg: ModelConfig, n_ranks: int, name: str = layouts.OURS, batch: int = 1, *,
                  schedule: str | Schedule | None = None, context: int = 0, seed: int = 0
                  ) -> tuple[list[int], list[list]]:
    """(weight blocks, each stand-in rank's ops) of one step: the first rank of every ETP group
    stands for its group (ranks 0, etp, 2 etp, ...; `scale_out_sim.simulate`). A schedule with
    `collectives` takes every collective from the kernel's own schedule (`scale_out_contract`)."""
    lay = layouts.layout(cfg, n_ranks, name)
    sched = schedule_for(cfg, name if schedule is None else schedule)
    counted = rank_bytes(lay, sched, batch, context)
    stages = _stage_bytes(lay, counted)
    routed = routed_experts(cfg, lay, batch, seed)
    unique_1 = roofline.expected_unique_experts(cfg.n_experts, cfg.top_k, batch) / lay.ep
    expert_bytes = counted.component("routed_experts") / len(cfg.moe_layers) / unique_1 \
        if cfg.moe_layers else 0
    reps = tuple(range(0, n_ranks, lay.etp))
    everyone = tuple(range(n_ranks))
    mix = counted.component("norms_and_mix") / len(cfg.layers)
    actions = {kind: _actions(lay, sched, kind, stages[kind].matrices) for kind in cfg.kinds}
    blocks: list[int] = []
    layers = cfg.layers
    for attention, ffn in layers:
        blocks += weight_blocks(mix, sched.block_bytes)
        for kind in (attention, ffn):
            for matrix, nbytes in actions[kind]:
                if matrix != contract.EXPERTS:
                    blocks += weight_blocks(nbytes, sched.block_bytes)
    head = weight_blocks(counted.component("lm_head"), sched.block_bytes)
    blocks += head
    states = {kind: counted.component(spec.stage(kind).state_component[0]) / len(cfg.layers_of(kind))
              for kind in cfg.attention_kinds if spec.stage(kind).state_component}
    wire = PARTIAL_SUM_BYTES if sched.combine == "partial-sum" else F32
    programs = []
    moe_layers = set(cfg.moe_layers)
    stage_ops: dict[tuple, list] = {}

    def among(group):  # the stand-in ranks of a group
        return tuple(r for r in group if r % lay.etp == 0) or (group[0],)

    for rank in reps:
        prog = Program(blocks, batch)
        # the experts this rank's group computes per MoE layer (the kinds with a routed fetch
        # here; otherwise the schedule's worst case)
        counts = tuple(int(c) for c in routed[:, _expert_group(lay, rank)]) \
            if len(routed) == contract.n_routed_layers(lay) else None
        ops = contract.schedule_ops(lay, batch, sched.collectives, sched.wire, rank, counts,
                                    sched.reductions) if sched.collectives else None
        prog.fetch(counted.component("embedding_rows"), 1, 1)
        if ops:
            for op in ops[0]:
                contract.collective(prog, op, op.name, among)
        else:
            prog.collective("embed", "all_reduce", reps, batch * cfg.d_model * wire, everyone)
        moe_index = 0
        for layer, (attention, ffn) in enumerate(layers):
            prog.block(len(weight_blocks(mix, sched.block_bytes)))  # norms and mix
            state = states.get(attention, 0)
            if state:  # read before the layer, written after it (half each)
                prog.fetch(state / 2, 1, 1)
            routed_here = routed[moe_index] if layer in moe_layers else None
            for kind in (attention, ffn):
                routed_stage = routed_here if kind == ffn else None
                count = None if routed_stage is None else int(
                    routed_stage[_expert_group(lay, rank)])
                if ops:
                    stage_key = (kind, rank, count, tuple(dataclasses.replace(op, layer=0)
                                                       for op in ops[1].get((layer, kind), ())))
                else:  # a stage's ops depend on the rank and its expert count only: built once
                    stage_key = (kind, rank, count)
                if stage_key not in stage_ops:
                    scratch = Program(blocks, batch)
                    if ops:
                        contract.stage_program(
                            scratch, kind, actions[kind], stage_key[3], group_of=among,
                            blocks=functools.partial(_blocks_of, scratch, sched=sched),
                            experts=functools.partial(scratch.fetch, expert_bytes, count or 0,
                                                      sched.expert_slots))
                    else:
                        _release_stage(scratch, lay, sched, cfg, kind, stages[kind], rank,
                                       routed_stage, expert_bytes)
                    stage_ops[stage_key] = scratch.ops
                prog.ops += stage_ops[stage_key]
                if kind == attention:
                    prog.write(state / 2)
            moe_index += layer in moe_layers
        prog.block(len(head))
        if ops:
            for op in ops[2]:
                contract.collective(prog, op, op.name, among)
        else:
            prog.collective("sampling_state", "all_gather", reps, batch * SAMPLING_LANES * F32,
                            everyone)
        programs.append(prog.ops)
    return blocks, programs


def rank_bytes(lay: layouts.Layout, sched: Schedule, batch: int, context: int
               ) -> layout_bytes.RankBytes:
    """A rank's bytes under the schedule, in the shapes the kernel as built streams: in our
    partial-sum mode the layout's own row splits (`layout.param_shard`, `layout_split`: the
    bytes its planned DMAs stream, tests/test_layout_split.py)."""
    if sched.collectives == "partial-sum":
        lay = layouts.layout(lay.cfg, lay.n_ranks, lay.name, collectives="partial-sum")
    return layout_bytes.rank_bytes(lay, batch, context)


def _actions(lay, sched: Schedule, kind: str, matrices) -> list[tuple[str, float]]:
    """A stage's matrices (and the routed experts' point) in the order the rank streams them."""
    if sched.collectives:
        return contract.stage_actions(kind, matrices, sched.collectives,
                                      contract.routing_point(lay, kind))
    return list(_ordered(matrices, sched))


@functools.lru_cache(maxsize=256)
def _ordered(matrices, sched: Schedule):
    """The release computes the shared expert before the routed ones (its reduction hides
    behind their stream: docs/collectives.md): the shared matrices move before W_lu."""
    if sched.combine != "partial-sum":
        return matrices
    shared = [m for m in matrices if m[0].startswith("shared/")]
    return [m for m in matrices if m not in shared and not m[0].endswith("w_lu")] + shared + \
        [m for m in matrices if m[0].endswith("w_lu")]


def _blocks_of(prog: Program, nbytes: float, sched: Schedule) -> None:
    prog.block(len(weight_blocks(nbytes, sched.block_bytes)))


def _release_stage(prog: Program, lay, sched, cfg, kind, stage, rank, routed, expert_bytes
                   ) -> None:
    """The release's collectives (docs/collectives.md), partial sums as bf16 on the wire:
    attention: the sibling's attended features gathered before W_o, each core half the hidden
    width, an all-reduce over the 16 cores of its parity, the halves swapped with the sibling;
    MoE: router scores swapped with the sibling, the latent all-gathered behind routing, the
    shared expert's sum started before the routed experts and waited after them, the routed
    sum reduced last; a dense FFN's sum reduced at its end."""
    n, b = lay.n_ranks, prog.batch
    reps = tuple(range(0, n, _ways(lay)[0]))
    pair = (rank, rank ^ 1)
    vector = b * cfg.d_model * PARTIAL_SUM_BYTES
    matrices = _ordered(stage.matrices, sched)
    role = spec.stage(kind).role
    for matrix, nbytes in matrices:
        if role == "attention" and matrix.endswith("w_o"):
            features = b * nbytes / cfg.d_model  # W_o's rows on this rank, bf16
            prog.collective(f"{kind}/features", "all_gather", (rank,), features, pair)
        _blocks_of(prog, nbytes, sched)
        if matrix.endswith("w_router"):
            prog.collective("router/scores", "all_gather", (rank,),
                            b * cfg.n_experts * F32 / 2, pair)
        if routed is not None and matrix.endswith("w_ld"):
            prog.collective("latent", "all_gather", reps, b * cfg.moe_latent * 2 / n,
                            tuple(range(n)), blocking=False)
        if routed is not None and matrix.endswith("shared/w_down"):
            prog.collective("shared_sum", "all_reduce", reps, vector, tuple(range(n)),
                            blocking=False)
            prog.wait("latent")
            _experts(prog, lay, sched, rank, routed, expert_bytes)
    if role == "attention":
        parity = tuple(r for r in range(n) if r % 2 == rank % 2)
        prog.collective(f"{kind}_sum", "all_reduce", reps, vector / 2, parity)
        prog.collective(f"{kind}/halves", "all_gather", (rank,), vector / 2, pair)
    elif routed is not None:
        prog.wait("shared_sum")
        prog.collective(f"{kind}_sum", "all_reduce", reps, vector, tuple(range(n)))
    else:
        prog.collective(f"{kind}_sum", "all_reduce", reps, vector, tuple(range(n)))


def _expert_group(lay, rank: int) -> int:
    etp, ep = _ways(lay)
    return rank // etp % ep if etp > 1 else rank % ep


@functools.lru_cache(maxsize=64)
def _ways(lay: layouts.Layout) -> tuple[int, int]:
    return lay.etp, lay.ep  # (computed from the layout's splits: once per layout)


def _experts(prog: Program, lay, sched, rank, routed, expert_bytes) -> None:
    prog.fetch(expert_bytes, int(routed[_expert_group(lay, rank)]), sched.expert_slots)


# ---- predictions -------------------------------------------------------------------------------
def predict(cfg: ModelConfig, n_ranks: int, name: str = layouts.OURS, batch: int = 1, *,
            chip: str = "tpu7x", interconnect: links.Interconnect | None = None,
            algorithm: str | None = None, schedule: str | Schedule | None = None,
            context: int = 0, seed: int = 0, keep_timeline: bool = False,
            timeline_chip: TimelineChip | None = None, collectives: str = "partial-sum") -> dict:
    """The predicted step of `cfg` on n_ranks under layout `name` at `batch` (JSON-able dict;
    with keep_timeline the RanksTimeline under "timeline"). `algorithm` (default: the schedule's
    at this batch; our schedules: each collective's own, `collective_choice`) prices every
    all-reduce; `collectives`: our schedule's mode ("partial-sum" or "exact"); `timeline_chip` overrides the chip's timeline
    figures (`timeline_chip.timeline_chip(chip, **fields)`). Cached per arguments: the model is deterministic
    (pure Python, seeded routing)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} is invalid: an int >= 1")
    if algorithm is not None and algorithm not in links.ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is invalid: one of {links.ALGORITHMS}")
    inter = links.interconnect(chip, n_ranks=n_ranks) if interconnect is None else interconnect
    if inter.slice.n_ranks < n_ranks:
        inter = links.interconnect(inter, n_ranks=n_ranks)
    sched = schedule_for(cfg, name if schedule is None else schedule, collectives, n_ranks,
                         batch, chip)
    auto = "auto" if sched.collectives else sched.algorithm(batch)  # auto: collective_choice's
    out = dict(_predict(cfg, n_ranks, name, batch, chip, inter, algorithm or auto, sched,
                        context, seed, timeline_chip or chip))
    if not keep_timeline:
        del out["timeline"]
    return out


@functools.lru_cache(maxsize=64)
def _predict(cfg: ModelConfig, n_ranks: int, name: str, batch: int, chip: str,
             inter: links.Interconnect, algorithm: str, sched: Schedule, context: int,
             seed: int, timeline: str | TimelineChip) -> dict:
    collecting = gc.isenabled()
    gc.disable()  # a step allocates ~10^5 small objects and frees none: no cycles to look for
    try:
        return _predict_uncollected(cfg, n_ranks, name, batch, chip, inter, algorithm, sched,
                                    context, seed, timeline)
    finally:
        if collecting:
            gc.enable()


def _predict_uncollected(cfg: ModelConfig, n_ranks: int, name: str, batch: int, chip: str,
                         inter: links.Interconnect, algorithm: str, sched: Schedule,
                         context: int, seed: int, timeline: str | TimelineChip) -> dict:
    blocks, programs = rank_programs(cfg, n_ranks, name, batch, schedule=sched, context=context,
                                     seed=seed)
    lay = layouts.layout(cfg, n_ranks, name)
    ranks = simulate(
        programs, blocks, sched.banks, batch, tuple(range(0, n_ranks, lay.etp)), inter,
        "auto" if algorithm == "auto" else
        {"all_reduce": algorithm, "all_gather": sched.gather_algorithm, "chain": algorithm},
        timeline, prefetch_across=sched.prefetch_across)
    parts = ranks.decomposition()
    counted = rank_bytes(lay, sched, batch, context)
    slowest = ranks.slowest_rank
    published = published_step_s(cfg, n_ranks, chip, batch)
    return {"model": cfg.name, "n_ranks": n_ranks, "layout": name, "batch": batch, "chip": chip,
            "algorithm": algorithm, "schedule": dataclasses.asdict(sched),
            "slice": inter.slice.name,
            "step_s": ranks.total_s, "tokens_per_s": batch / ranks.total_s,
            "parts_s": {p: parts[p] for p in PARTS}, "slowest_rank": slowest,
            "rank_bytes": counted.total,
            "dma_bytes_slowest_rank": ranks.dma_bytes(slowest),
            "collectives_per_rank": sum(1 for run in ranks.collectives if 0 in run.group),
            "interconnect": {k: getattr(inter, k) for k in links.FIGURES},
            "label": "timeline model prediction (mkresearch.prediction.scale_out), not measured",
            "published_step_s": published,
            "gb200_tok_s": PUBLISHED.get(cfg.name, {}).get("gb200_tok_s", {}).get(batch)
            if published else None,
            "timeline": ranks}


def clear_caches() -> None:
    """Forget every cached program, prediction and collective price (for a fair timing)."""
    for cached in (rank_programs, _predict, weight_blocks, links.price):
        cached.cache_clear()


def published_step_s(cfg: ModelConfig, n_ranks: int, chip: str, batch: int) -> float | None:
    """The release's published step for this model, ranks, chip and batch (None: none)."""
    published = PUBLISHED.get(cfg.name)
    if not published or published["n_ranks"] != n_ranks or published["chip"] != chip:
        return None
    tok_s = published["tok_s"].get(batch)
    return batch / tok_s if tok_s else None
