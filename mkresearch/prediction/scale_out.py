"""The full-size decode step on n ranks, predicted: every rank's program from a layout and a
schedule, simulated together with the interconnect (`mkresearch.prediction.timeline_ranks`).

A rank's program, in layer order (`cfg.layers`): its weight bytes (`layout_bytes.rank_bytes`, per
component, split over each stage's matrices by their per-rank sizes) stream in blocks through a
ring of `banks` blocks in flight; each block is waited, then multiplied. After a MoE layer's
routing, the rank fetches the routed experts of its expert group (counted from a seeded uniform
routing of the batch: ranks differ, and a collective waits for the slowest) through
`expert_slots` DMAs in flight. KDA states are read before the layer and written after it; an MLA
layer reads its cache at `context` tokens. The programs run in `timeline_ranks.simulate_programs` (overlap: a
collective started early and waited later). Every rank's program is data of one kind
(`program`: blocks, fetches, writes, collectives started and waited); the collectives between
stages are the schedule's:

  release      (its program written as data from docs/collectives.md,
               `program.release_collectives`) attention: the sibling's attended features
               gathered before W_o, an all-reduce over the 16 cores of one parity, the halves
               swapped with the sibling; MoE: router scores swapped with the sibling, the latent
               all-gathered behind routing, the shared expert's sum started before the routed
               experts and waited after them, then the routed sum beside W_lu's read; bf16
               partial sums; two-level all-reduces below B = 6, reduce-scatter + all-gather from
               it; its weights issued where its kernel issues them (the next router a layer
               ahead, the experts' first reads inside top-k: `program.release_collectives`).
               ASSUMPTIONS: the layout's
               router kept whole (the release splits its scores between siblings: docs/collectives.md §1), one routed and one
               shared reduction per MoE layer (docs/collectives.md §1: "about two reductions per layer")
  ours         (`our_schedule(cfg, collectives, n_ranks, batch)`: its ring as deep as VMEM
               allows at the batch) every collective read from our kernel's own
               (`kernels/sharded/collective_ops.py`, from the step's sharding plan): "partial-sum"
               (the default: matrices contracting over a split dimension reduce their partial
               sums, each waited for right after it is issued),
               "exact" (bit-equal to one device: gathers around split matrices, the experts'
               chain) or "restructured" (partial sums, rho a one-phase reduce-scatter, W_lu split
               by rows, its partial products and rho's sums of squares beside the shared
               experts' partial sums in their one reduction, rho in flight while the shared
               experts run: the mode's own layout bytes and collectives); each collective
               priced by the algorithm its sharding plan sends it with;
               its router placed as the kernel's option or a design says (`placed_layout`:
               the placed layout's bytes and the kernel's collectives for it)

`predict(...)` returns the step, tok/s and the decomposition of the slowest rank's step into HBM
floor, waiting for peers, collective messages, compute and bubbles (they sum to the step).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

import mkresearch.model.stages  # noqa: F401 - registers the built-in stage kinds
from mkresearch.hardware import interconnect as links
from mkresearch.kernels.base import registry
from mkresearch.kernels.sharded import plan as sharding
from mkresearch.model import roofline, spec
from mkresearch.model.config import ModelConfig
from mkresearch.prediction import designs, program, row_work
from mkresearch.prediction.program import (  # noqa: F401 - scale_out.Program & co.
    F32,
    PARTIAL_SUM_BYTES,
    SAMPLING_LANES,
    Program,
    weight_blocks,
)
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
from mkresearch.prediction.timeline_chip import TimelineChip
from mkresearch.prediction.timeline_ranks import PARTS, simulate_programs
from mkresearch.sharding import layout as layouts
from mkresearch.sharding import layout_bytes

# docs/tpu.md §3: Kimi K3 on 16 TPU7x chips (32 cores), tok/s by batch
PUBLISHED = {
    "kimi-k3": {"chip": "tpu7x", "n_ranks": 32, "tok_s": dict(roofline.PUBLISHED_TPU7X_16_CHIPS),
                "gb200_tok_s": {1: 127, 2: 227, 4: 373, 8: 636},
                "speculative_tok_s": {3: 350, 6: 709}},
}


# ---- every stand-in rank's program ----------------------------------------------------------
@dataclass(frozen=True)
class _Stage:
    kind: str
    matrices: tuple[tuple[str, int], ...]  # (DMA name, bytes of one layer on this rank)


def _stage_bytes(lay: layouts.Layout, counted: layout_bytes.RankBytes) -> dict[str, _Stage]:
    """Each kind's matrices with one layer's bytes on a rank: the kind's component bytes split
    by the matrices' per-rank element counts (the router's as the layout places it)."""
    cfg = lay.cfg
    out = {}
    for kind in cfg.kinds:
        stage = spec.stage(kind)
        params = stage.params(cfg)
        matrices = registry.kernel_stage(kind).streamed(cfg)
        sizes = [math.prod(layouts.local_shape(lay, m.shape, _shard(lay, params[m.key])))
                 for m in matrices]
        per_layer = counted.component(stage.component[0]) / len(cfg.layers_of(kind))
        out[kind] = _Stage(kind, tuple((m.name, per_layer * s / sum(sizes))
                                       for m, s in zip(matrices, sizes, strict=True)))
    return out


def _shard(lay: layouts.Layout, param: spec.Param) -> Any:
    """A matrix's split as the bytes are shared among a stage's matrices: its rule, the router's
    as the layout places it (`layout.place_router`)."""
    return layouts.param_shard(lay, param) if param.router else param.shard


def router_placement(sched: Schedule) -> str:
    """Where the schedule's kernel places its router: its option (`Schedule.router`), else the
    placement its designs name (`designs.router_placement`: priced as the kernel runs it)."""
    if sched.router != layouts.ROUTER_SPLIT:
        return sched.router
    return designs.router_placement(sched.designs)


def placed_layout(cfg: ModelConfig, n_ranks: int, name: str, sched: Schedule) -> layouts.Layout:
    """The layout a schedule's rank runs: `name`'s (its experts split `sched.etp` ways), our
    kernel's router placed as it places it (`router_placement`, `layout.place_router` on the
    schedule's hosts)."""
    # built in the schedule's mode (an etp of a partial-sum mode need not split W2's columns),
    # read as the exact-mode layout the model places its matrices by (each mode's own where
    # it needs one: `rank_bytes`, `_step_collectives`)
    lay = dataclasses.replace(layouts.layout(cfg, n_ranks, name, etp=sched.etp,
                                             collectives=sched.collectives or layouts.EXACT),
                              collectives=layouts.EXACT)
    placement = router_placement(sched)
    if placement == layouts.ROUTER_SPLIT:
        return lay
    return layouts.place_router(lay, placement, sched.ranks_per_host)


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


@functools.lru_cache(maxsize=256)
def _has_cache(cfg: ModelConfig, kind: str) -> bool:
    """`spec.keeps_cache`, remembered: a step asks it once per stage of every rank's program."""
    return spec.keeps_cache(cfg, kind)


@dataclass(frozen=True)
class _Step:
    """What every stand-in rank's program of one step is built from."""

    lay: layouts.Layout
    sched: Schedule
    batch: int
    counted: layout_bytes.RankBytes
    stages: dict
    routed: np.ndarray  # [MoE layers, EP groups] experts fetched
    expert_bytes: float  # one routed expert's bytes on a rank
    mix: float  # one layer's norms and mix
    sequences: int  # the sequences the rows belong to (a verify step: one)
    context: int

    def read_share(self, kind: str) -> float:
        """The share of a stage's state or cache bytes read before it (the rest is written
        after it): a state read once per sequence and written once per row; a cache read at the
        context once per sequence, its new token written (and read) once per row."""
        cache = _has_cache(self.cfg, kind)
        read = self.sequences * (self.context if cache else 1) + (self.batch if cache else 0)
        return read / (read + self.batch)

    @property
    def cfg(self) -> ModelConfig:
        return self.lay.cfg

    def matrices(self, kind: str) -> list[tuple[str, float]]:
        """A stage's matrices in the order the rank streams them."""
        m = self.stages[kind].matrices
        if self.sched.collectives:
            return [a for a in program.our_actions(self.lay, kind, m) if a[0] != program.EXPERTS]
        return program.release_actions(m, False, self.sched.combine == "partial-sum")

    def blocks(self) -> list[int]:
        """The step's weight blocks, in stream order (shared by every rank's program)."""
        blocks: list[int] = []
        for attention, ffn in self.cfg.layers:
            blocks += weight_blocks(self.mix, self.sched.block_bytes)
            for kind in (attention, ffn):
                for _, nbytes in self.matrices(kind):
                    blocks += weight_blocks(nbytes, self.sched.block_bytes)
        return blocks + list(weight_blocks(self.counted.component("lm_head"),
                                           self.sched.block_bytes))

    def group(self, rank: int) -> int:
        """The expert group a rank belongs to."""
        etp, ep = self.lay.etp, self.lay.ep
        return rank // etp % ep if etp > 1 else rank % ep

    def among(self, group: tuple[int, ...]) -> tuple[int, ...]:
        """The stand-in ranks of a group (the first rank of each ETP group)."""
        return _stand_ins(group, self.lay.etp)


@functools.lru_cache(maxsize=4096)  # every collective of every rank's program asks
def _stand_ins(group: tuple[int, ...], etp: int) -> tuple[int, ...]:
    return tuple(r for r in group if r % etp == 0) or (group[0],)


@functools.lru_cache(maxsize=64)  # a sensitivity run's validations reuse ~40 programs
def rank_programs(cfg: ModelConfig, n_ranks: int, name: str = layouts.OURS, batch: int = 1, *,
                  schedule: str | Schedule | None = None, context: int = 0, seed: int = 0,
                  sequences: int | None = None) -> tuple[list[int], list[list]]:
    """(weight blocks, each stand-in rank's ops) of one step: the first rank of every ETP group
    stands for its group (ranks 0, etp, 2 etp, ...; `timeline_ranks.simulate_programs`). A schedule with
    `collectives` takes every collective from the kernel's own (`program.our_collectives`), the
    release's from `program.release_collectives`."""
    sched = schedule_for(cfg, name if schedule is None else schedule)
    lay = placed_layout(cfg, n_ranks, name, sched)
    counted = rank_bytes(lay, sched, batch, context, sequences)
    unique_1 = roofline.expected_unique_experts(cfg.n_experts, cfg.top_k, batch) / lay.ep
    step = _Step(lay, sched, batch, counted, _stage_bytes(lay, counted),
                 routed_experts(cfg, lay, batch, seed),
                 counted.component("routed_experts") / len(cfg.moe_layers) / unique_1
                 if cfg.moe_layers else 0, counted.component("norms_and_mix") / len(cfg.layers),
                 batch if sequences is None else sequences, context)
    blocks = step.blocks()
    built: dict[tuple, list] = {}  # a stage's ops, by what they depend on: built once
    return blocks, [_rank_program(step, blocks, rank, built)
                    for rank in range(0, n_ranks, lay.etp)]


def _rank_program(step: _Step, blocks: list[int], rank: int, built: dict) -> list:
    """One stand-in rank's ops: the embedding, every layer's stages, the LM head."""
    cfg, sched = step.cfg, step.sched
    prog = Program(blocks, step.batch)
    ends = _step_collectives(step, rank)
    prog.fetch(step.counted.component("embedding_rows"), 1, 1)
    for c in ends[0]:
        program.start(prog, c, c.name, step.among)
    states = {kind: step.counted.component(spec.stage(kind).state_component[0])
              / len(cfg.layers_of(kind))
              for kind in dict.fromkeys(cfg.attention_kinds) if spec.stage(kind).state_component}
    shares = {kind: step.read_share(kind) for kind, state in states.items() if state}
    moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
    group = step.group(rank)
    mixes = next(t for t in row_work.terms(cfg, step.lay.n_ranks) if t.term == "residual mix")
    for layer, (attention, ffn) in enumerate(cfg.layers):
        prog.block(len(weight_blocks(step.mix, sched.block_bytes)))  # norms and mix
        prog.compute(step.batch * mixes.per_layer[layer])  # the Mixes on every row
        state = states.get(attention, 0)
        share = shares[attention] if state else 0.0
        if state:  # read before the layer, written after it
            prog.fetch(state * share, 1, 1)
        for kind in (attention, ffn):
            count = None
            if kind == ffn and layer in moe_index:
                count = int(step.routed[moe_index[layer]][group])
            prog.ops += _stage_ops(step, blocks, rank, layer, kind, count, ends[1], built)
            if kind == attention:
                prog.write(state * (1 - share))
    prog.block(len(weight_blocks(step.counted.component("lm_head"), sched.block_bytes)))
    for c in ends[2]:
        program.start(prog, c, c.name, step.among)
    return prog.ops


def _step_collectives(step: _Step, rank: int) -> tuple:
    """(embedding ones, {(layer, stage): ones} or None for the release's, sampling ones)."""
    lay, sched = step.lay, step.sched
    if not sched.collectives:
        wire = PARTIAL_SUM_BYTES if sched.combine == "partial-sum" else F32
        embed, sampling = program.release_step_collectives(lay, step.batch, wire)
        return (embed,), None, (sampling,)
    # the experts this rank's group computes per MoE layer (the kinds with a routed fetch here;
    # otherwise the worst case)
    counts = tuple(int(c) for c in step.routed[:, step.group(rank)]) \
        if len(step.routed) == program.n_routed_layers(lay) else None
    plan = sharding.with_algorithms(dataclasses.replace(lay, collectives=sched.collectives),
                                    step.batch, sched.wire, sched.reductions)
    return program.our_collectives(plan, rank, counts)


def _stage_ops(step: _Step, blocks: list[int], rank: int, layer: int, kind: str,
               count: int | None, ours: dict | None, built: dict) -> list:
    """One stage's ops on `rank` (built once per rank, expert count and collectives)."""
    if ours is not None:
        collectives = tuple(ours.get((layer, kind), ()))
        actions = program.our_actions(step.lay, kind, step.stages[kind].matrices)
    else:
        actions = program.release_actions(step.stages[kind].matrices, count is not None,
                                          step.sched.combine == "partial-sum")
        collectives = program.release_collectives(step.lay, kind, actions, rank, step.batch,
                                                  count is not None)
        if spec.stage(kind).role == "attention" and layer in step.cfg.moe_layers:
            collectives = program.release_router_ahead(
                collectives, step.stages[step.cfg.layers[layer][1]].matrices,
                step.sched.block_bytes)
    key = (kind, rank, count, collectives)
    if key not in built:
        scratch = Program(blocks, step.batch)
        work = row_work.stage_flops(step.cfg, step.lay.n_ranks, step.context, kind)

        def before(matrix: str) -> None:  # the rows' own work at its point of the stage
            point = "experts" if matrix == program.EXPERTS else matrix.rsplit(".", 1)[-1]
            scratch.compute(step.batch * work.pop(point, 0.0))

        def issue_experts() -> None:  # the release's first expert DMAs, issued inside top-k
            if count:
                scratch.prefetch()

        early = None if ours is not None else program.release_experts_issued_after(actions)
        program.place(scratch, kind, actions, collectives, group_of=step.among,
                      blocks=lambda nbytes: scratch.block(
                          len(weight_blocks(nbytes, step.sched.block_bytes))),
                      experts=lambda: scratch.fetch(
                          step.expert_bytes, count or 0, step.sched.expert_slots,
                          program.expert_mix(step.lay, step.sched.mxu_fp8,
                                             step.sched.name == "release", step.batch),
                          step.sched.expert_order), before=before,
                      experts_issued=(early, issue_experts) if early else None)
        scratch.compute(step.batch * sum(work.values()))  # a point the stage lacks: at its end
        built[key] = scratch.ops
    return built[key]


def rank_bytes(lay: layouts.Layout, sched: Schedule, batch: int, context: int,
               sequences: int | None = None) -> layout_bytes.RankBytes:
    """A rank's bytes under the schedule, in the shapes the kernel as built streams: in our
    partial-sum modes the layout's own row splits (`layout.param_shard`, `layout_split`: the
    bytes its planned DMAs stream, tests/test_layout_split.py; restructured: W_lu by its latent
    rows too)."""
    if sched.collectives in layouts.PARTIAL_SUM_MODES:
        lay = dataclasses.replace(layouts.layout(lay.cfg, lay.n_ranks, lay.name, etp=lay.etp,
                                                 collectives=sched.collectives),
                                  router=lay.router, router_ways=lay.router_ways)
    return layout_bytes.rank_bytes(lay, batch, context, sequences=sequences)


# ---- predictions -------------------------------------------------------------------------------
def predict(cfg: ModelConfig, n_ranks: int, name: str = layouts.OURS, batch: int = 1, *,
            chip: str = "tpu7x", interconnect: links.Interconnect | None = None,
            algorithm: str | None = None, schedule: str | Schedule | None = None,
            context: int = 0, seed: int = 0, keep_timeline: bool = False,
            timeline_chip: TimelineChip | None = None, collectives: str = "partial-sum",
            prefetch_across: bool | None = None, sequences: int | None = None) -> dict:
    """The predicted step of `cfg` on n_ranks under layout `name` at `batch` (JSON-able dict;
    with keep_timeline the RanksTimeline under "timeline"). `algorithm` (default: the schedule's
    at this batch; our schedules: each collective's own, its sharding plan's) prices every
    all-reduce; `collectives`: our schedule's mode (`layouts.COLLECTIVES`); `timeline_chip`
    overrides the chip's timeline figures (`timeline_chip.timeline_chip(chip, **fields)`);
    `prefetch_across` True / False: the
    ring runs past every collective, or none (default: as each collective of the program says,
    `program.Collective.streams`); `sequences` (default `batch`): the sequences the rows belong
    to, whose states and cached tokens are read once each (a verify step: one sequence's k + 1
    rows). Cached per arguments: the model is deterministic (pure Python, seeded routing)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} is invalid: an int >= 1")
    if algorithm is not None and algorithm not in links.ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is invalid: one of {links.ALGORITHMS}")
    inter = step_interconnect(chip, n_ranks, interconnect)
    sched = schedule_for(cfg, name if schedule is None else schedule, collectives, n_ranks,
                         batch, chip)
    if prefetch_across is not None:  # a what-if for every collective of either side's program
        sched = dataclasses.replace(sched, prefetch_across=prefetch_across)
    # auto: each collective as its kernel sends it (ours: its sharding plan's; the release's: its
    # program's, `program.release_collectives`)
    out = dict(_predict(cfg, n_ranks, name, batch, chip, inter, algorithm or "auto", sched,
                        context, seed, timeline_chip or chip, sequences))
    if not keep_timeline:
        del out["timeline"]
    return out


# one sensitivity or validation run asks ~130 distinct predictions: they all fit (an entry of
# Kimi K3 on 32 ranks keeps its timeline, ~3 MiB)
@functools.lru_cache(maxsize=256)
def _predict(cfg: ModelConfig, n_ranks: int, name: str, batch: int, chip: str,
             inter: links.Interconnect, algorithm: str, sched: Schedule, context: int,
             seed: int, timeline: str | TimelineChip, sequences: int | None = None) -> dict:
    collecting = gc.isenabled()
    gc.disable()  # a step allocates ~10^5 small objects and frees none: no cycles to look for
    try:
        return _predict_uncollected(cfg, n_ranks, name, batch, chip, inter, algorithm, sched,
                                    context, seed, timeline, sequences)
    finally:
        if collecting:
            gc.enable()


def _predict_uncollected(cfg: ModelConfig, n_ranks: int, name: str, batch: int, chip: str,
                         inter: links.Interconnect, algorithm: str, sched: Schedule,
                         context: int, seed: int, timeline: str | TimelineChip,
                         sequences: int | None) -> dict:
    blocks, programs = rank_programs(cfg, n_ranks, name, batch, schedule=sched, context=context,
                                     seed=seed, sequences=sequences)
    lay = placed_layout(cfg, n_ranks, name, sched)
    ranks = simulate_step(programs, blocks, sched, batch, lay, inter, algorithm, timeline)
    parts = ranks.decomposition()
    counted = rank_bytes(lay, sched, batch, context, sequences)
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
            # rank 0's collectives' prices one after another (each layer's value passes through
            # them in turn): what no overlap with the weight stream can hide; one started early
            # and waited for after other work counts only what the overlap left (`chain_seconds`)
            "serial_chain_s": sum(run.chain_seconds(0) for run in ranks.collectives
                                  if 0 in run.group),
            "interconnect": {k: getattr(inter, k) for k in links.FIGURES},
            "label": "timeline model prediction (mkresearch.prediction.scale_out), not measured",
            "published_step_s": published,
            "gb200_tok_s": PUBLISHED.get(cfg.name, {}).get("gb200_tok_s", {}).get(batch)
            if published else None,
            "timeline": ranks}


def step_interconnect(chip: str, n_ranks: int, interconnect: links.Interconnect | None = None
                      ) -> links.Interconnect:
    """The links a step on n_ranks is priced over: `interconnect` (default the chip's), on a
    slice of at least n_ranks."""
    inter = links.interconnect(chip, n_ranks=n_ranks) if interconnect is None else interconnect
    if inter.slice.n_ranks < n_ranks:
        inter = links.interconnect(inter, n_ranks=n_ranks)
    return inter


def simulate_step(programs: list, blocks: list[int], sched: Schedule, batch: int,
                  lay: layouts.Layout, inter: links.Interconnect, algorithm: str,
                  timeline: str | TimelineChip) -> Any:
    """The stand-in ranks' `programs` (`rank_programs`) simulated together under `sched`'s ring
    (`timeline_ranks.simulate_programs`): every all-reduce by `algorithm`, or "auto": each
    collective's own."""
    return simulate_programs(
        programs, blocks, sched.banks, batch, tuple(range(0, lay.n_ranks, lay.etp)), inter,
        "auto" if algorithm == "auto" else
        {"all_reduce": algorithm, "all_gather": sched.gather_algorithm, "chain": algorithm,
         "reduce_scatter": program.ONE_SHOT},  # one phase: the kernel's only way
        timeline, prefetch_across=sched.prefetch_across)


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
