"""The full-size decode step on n ranks, predicted: every rank's program from a layout and a
schedule, simulated together with the interconnect (`mkresearch.timeline_ranks`).

A rank's program, in layer order (`cfg.layers`): its weight bytes (`layout_bytes.rank_bytes`, per
component, split over each stage's matrices by their per-rank sizes) stream in blocks through a
ring of `banks` blocks in flight that runs ahead across stages and layers; each block is waited,
then multiplied. After a MoE layer's routing, the rank fetches the routed experts of its expert
group (counted from a seeded uniform routing of the batch: ranks differ, and a collective waits
for the slowest) through `expert_slots` DMAs in flight. KDA states are read before the layer and
written after it; an MLA layer reads its cache at `context` tokens. The collectives between
stages are the schedule's:

  partial-sum  (the release, ASSUMPTION: spec/tpu.md gives its layout and ~186 combines per step,
               not its algorithm) each attention and FFN sublayer's [B, d] partial sums all-reduced
               in f32 (the experts' outputs inside the FFN's); the embedding all-reduced; the
               vocab shards' sampling candidates all-gathered
  exact        (ours: `kernels/megakernel_sharded.py`, bit-equal to one device) the kernel's own
               collective rules (`collective_rules`): a matrix's input gathered before it, its
               output's column chunks gathered after it; each routed expert's hidden slice
               gathered in its ETP group; the experts' sum passed down the chain of expert groups
               and all-gathered; the embedding all-reduced, the sampling states all-gathered

`predict(...)` returns the step, tok/s and the decomposition of the slowest rank's step into HBM
floor, waiting for peers, collective messages, compute and bubbles (they sum to the step).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

import mkresearch.stages  # noqa: F401 - registers the stage kinds spec.stage looks up
from mkresearch import interconnect as links
from mkresearch import layout as layouts
from mkresearch import layout_bytes, roofline, spec
from mkresearch.config import ModelConfig
from mkresearch.kernels import megakernel_sharded
from mkresearch.kernels.megakernel_plan import MegakernelOptions
from mkresearch.timeline_events import CollectiveEvent, LogEvent
from mkresearch.timeline_ranks import PARTS, RanksTimeline, simulate_ranks

MIB = 2**20
COMBINES = ("partial-sum", "exact")
F32 = 4
SAMPLING_LANES = 384  # the sampling state a vocab shard sends: `sharded_stages.STATE_LANES`
# spec/tpu.md "Published decode numbers": Kimi K3 on 16 TPU7x chips (32 cores), tok/s by batch
PUBLISHED = {
    "kimi-k3": {"chip": "tpu7x", "n_ranks": 32, "tok_s": dict(roofline.PUBLISHED_TPU7X_16_CHIPS),
                "gb200_tok_s": {1: 127, 2: 227, 4: 373, 8: 636},
                "speculative_tok_s": {3: 350, 6: 709}},
}


@dataclass(frozen=True)
class Schedule:
    """How a rank streams and combines: block size, blocks and expert DMAs in flight, collectives."""

    name: str
    block_bytes: int
    banks: int  # weight blocks in flight ahead of the one multiplied
    expert_slots: int  # routed-expert DMAs in flight, the first issued right after routing
    combine: str  # one of COMBINES
    source: str

    def __post_init__(self) -> None:
        for name in ("block_bytes", "banks", "expert_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Schedule.{name}={value!r} is invalid: an int >= 1")
        if self.combine not in COMBINES:
            raise ValueError(f"Schedule.combine={self.combine!r} is invalid: one of {COMBINES}")


RELEASE_SCHEDULE = Schedule(
    "release", block_bytes=2 * MIB, banks=12, expert_slots=4, combine="partial-sum",
    source="spec/tpu.md: 12 x 2 MiB VMEM weight banks in flight and 4 expert DMA slots issued "
           "right after routing (published for the release's second model; ASSUMPTION: the same "
           "for Kimi K3); partial sums all-reduced after every sublayer (ASSUMPTION: f32)")


def our_schedule(cfg: ModelConfig) -> Schedule:
    """Our megakernel's: cfg.ring_depth slots of cfg.ring_block_bytes (depth - 1 blocks fly
    ahead), MegakernelOptions.expert_slots, the exact (bit-equal) collectives."""
    return Schedule("ours", block_bytes=cfg.ring_block_bytes, banks=cfg.ring_depth - 1,
                    expert_slots=MegakernelOptions().expert_slots, combine="exact",
                    source="the megakernel's plan (cfg.ring_depth, cfg.ring_block_bytes, "
                           "MegakernelOptions.expert_slots) and kernels/megakernel_sharded.py")


SCHEDULES = ("release", "ours")


def schedule_for(cfg: ModelConfig, name: str | Schedule) -> Schedule:
    """A schedule by name ("release": the release's, "ours": our megakernel's), or as given."""
    if isinstance(name, Schedule):
        return name
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is invalid: one of {SCHEDULES} or a Schedule")
    return RELEASE_SCHEDULE if name == "release" else our_schedule(cfg)


# ---- one rank's program ------------------------------------------------------------------------
@functools.cache
def _event(kind: str, name: str, src: str = "", dst: str = "", nbytes: int = 0,
           slot: int | None = None, *, flops: float = 0.0, vmem_bytes: int = 0) -> LogEvent:
    # one object per distinct event: a step repeats the same few thousand (ring slots, not DMA
    # serial numbers: a wait matches the oldest start of its name and slot, as the ring does)
    return LogEvent(kind, name, src, dst, nbytes, slot=slot, flops=flops, vmem_bytes=vmem_bytes)


class RankProgram:
    """Events of one rank, with the ring: `blocks` issued `banks` ahead of the one consumed."""

    def __init__(self, blocks: list[tuple[str, int]], sched: Schedule, batch: int) -> None:
        self.events: list[Any] = []
        self.blocks, self.sched, self.batch = blocks, sched, batch
        self.issued = self.consumed = 0
        self.late: list[LogEvent] = []  # writes waited at the end of the step
        self._fill()

    def _fill(self) -> None:
        while self.issued < len(self.blocks) and self.issued - self.consumed < self.sched.banks:
            name, nbytes = self.blocks[self.issued]
            self.events.append(_event("dma_start", name, "hbm", "vmem", nbytes,
                                      self.issued % self.sched.banks))
            self.issued += 1

    def _multiply(self, name: str, nbytes: int) -> None:
        # decode is HBM-bound: 2 FLOP per weight element per row, each element read from VMEM once
        self.events += [_event("phase_start", name, flops=self.batch * nbytes, vmem_bytes=nbytes),
                        _event("phase_end", name)]

    def block(self) -> None:
        name, nbytes = self.blocks[self.consumed]
        self.events.append(_event("dma_wait", name, "hbm", "vmem", nbytes,
                                  self.consumed % self.sched.banks))
        self.consumed += 1
        self._fill()
        self._multiply(name, nbytes)

    def fetch(self, name: str, nbytes: int, count: int, slots: int) -> None:
        """`count` DMAs of nbytes, `slots` in flight, each multiplied when it lands."""
        for i in range(min(slots, count)):
            self.events.append(_event("dma_start", name, "hbm", "vmem", nbytes, i % slots))
        for i in range(count):
            self.events.append(_event("dma_wait", name, "hbm", "vmem", nbytes, i % slots))
            self._multiply(name, nbytes)
            if i + slots < count:
                self.events.append(_event("dma_start", name, "hbm", "vmem", nbytes,
                                          (i + slots) % slots))

    def write(self, name: str, nbytes: int) -> None:
        if nbytes:
            event = _event("dma_start", name, "vmem", "hbm", nbytes)
            self.events.append(event)
            self.late.append(_event("dma_wait", name, "vmem", "hbm", nbytes))

    def collective(self, event: CollectiveEvent) -> None:
        self.events.append(event)

    def finish(self) -> list[Any]:
        return self.events + self.late


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


def weight_blocks(name: str, nbytes: float, block_bytes: int) -> list[tuple[str, int]]:
    n = max(1, math.ceil(nbytes / block_bytes))
    whole = round(nbytes)
    return [(name, whole // n + (1 if i < whole % n else 0)) for i in range(n)]


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
def rank_logs(cfg: ModelConfig, n_ranks: int, name: str = layouts.OURS, batch: int = 1, *,
              schedule: str | Schedule | None = None, context: int = 0, seed: int = 0
              ) -> list[list]:
    """The program of one step of the first rank of every ETP group, which stands for its group
    (events for `timeline_ranks.simulate_ranks`, ranks 0, etp, 2 etp, ...)."""
    lay = layouts.layout(cfg, n_ranks, name)
    sched = schedule_for(cfg, name if schedule is None else schedule)
    counted = layout_bytes.rank_bytes(lay, batch, context)
    stages = _stage_bytes(lay, counted)
    routed = routed_experts(cfg, lay, batch, seed)
    unique_1 = roofline.expected_unique_experts(cfg.n_experts, cfg.top_k, batch) / lay.ep
    expert_bytes = counted.component("routed_experts") / len(cfg.moe_layers) / unique_1 \
        if cfg.moe_layers else 0
    rules = {r.name: r for r in megakernel_sharded.collective_rules(lay)} \
        if sched.combine == "exact" else {}
    # the ranks of one ETP group run the same program (same experts, same bytes): one of them
    # (the first) stands for its group; a collective's group lists the stand-ins, its `path` the
    # real ranks its messages go between
    reps = tuple(range(0, n_ranks, lay.etp))
    everyone = tuple(range(n_ranks))
    mix = counted.component("norms_and_mix") / len(cfg.layers)
    blocks: list[tuple[str, int]] = []
    for attention, ffn in cfg.layers:
        blocks += weight_blocks("norms_and_mix", mix, sched.block_bytes)
        for kind in (attention, ffn):
            for matrix, nbytes in stages[kind].matrices:
                blocks += weight_blocks(matrix, nbytes, sched.block_bytes)
    blocks += weight_blocks("lm_head", counted.component("lm_head"), sched.block_bytes)
    states = {kind: counted.component(spec.stage(kind).state_component[0]) / len(cfg.layers_of(kind))
              for kind in cfg.attention_kinds if spec.stage(kind).state_component}

    def vector(lanes: int) -> int:
        return batch * lanes * F32

    logs = []
    for rank in reps:
        prog = RankProgram(blocks, sched, batch)
        prog.fetch("embed", counted.component("embedding_rows"), 1, 1)
        prog.collective(CollectiveEvent("embed", "all_reduce", reps, vector(cfg.d_model),
                                        everyone))
        moe_index = 0
        for layer, (attention, ffn) in enumerate(cfg.layers):
            prog.block()  # norms and mix
            state = states.get(attention, 0)
            if state:  # read before the layer, written after it (half each)
                prog.fetch(f"{attention}_state", int(state / 2), 1, 1)
            for kind in (attention, ffn):
                _stage(prog, lay, sched, cfg, kind, stages[kind], rules, rank, layer,
                       routed[moe_index] if kind in cfg.ffn_kinds and layer in cfg.moe_layers
                       else None, expert_bytes)
                if kind == attention:
                    prog.write(f"{attention}_state", int(state / 2))
                if sched.combine == "partial-sum":
                    prog.collective(CollectiveEvent(f"{kind}_sum", "all_reduce", reps,
                                                    vector(cfg.d_model), everyone))
            moe_index += layer in cfg.moe_layers
        for _ in weight_blocks("lm_head", counted.component("lm_head"), sched.block_bytes):
            prog.block()
        prog.collective(CollectiveEvent("sampling_state", "all_gather", reps,
                                        vector(SAMPLING_LANES), everyone))
        logs.append(prog.finish())
    return logs


def _stage(prog: RankProgram, lay, sched, cfg, kind, stage, rules, rank, layer, routed,
           expert_bytes) -> None:
    everyone, reps = tuple(range(lay.n_ranks)), tuple(range(0, lay.n_ranks, lay.etp))
    for matrix, nbytes in stage.matrices:
        rule = rules.get(matrix)
        if rule is not None and rule.gather is not None:
            etp = rule.gather == spec.EXPERT_TP
            prog.collective(CollectiveEvent(
                f"{matrix}/input", "all_gather", (rank,) if etp else reps,
                prog.batch * F32 * lay.local_length(rule.gather, rule.k),
                _group(lay, rank, lay.etp) if etp else everyone))
        for _ in weight_blocks(matrix, nbytes, sched.block_bytes):
            prog.block()
        if rule is not None and rule.out is not None:
            prog.collective(CollectiveEvent(matrix, "all_gather", reps,
                                            prog.batch * F32 * lay.local_length(rule.out, rule.n),
                                            everyone))
        if routed is not None and matrix == _routing_point(stage):
            _experts(prog, lay, sched, cfg, rank, routed, expert_bytes)


def _routing_point(stage: _Stage) -> str:
    """The matrix after which the experts run: the latent down-projection, else the router."""
    names = [m for m, _ in stage.matrices]
    return next((m for m in names if m.endswith("w_ld")), next(m for m in names
                                                               if m.endswith("w_router")))


def _experts(prog: RankProgram, lay, sched, cfg, rank, routed, expert_bytes) -> None:
    group_index = rank // lay.etp % lay.ep if lay.etp > 1 else rank % lay.ep
    count = int(routed[group_index])
    prog.fetch("experts", int(expert_bytes), count, sched.expert_slots)
    if sched.combine != "exact":
        return
    for _ in range(count):  # each expert's hidden slice gathered in its ETP group
        prog.collective(CollectiveEvent("experts/hidden", "all_gather", (rank,),
                                        prog.batch * F32 * lay.local_length(spec.EXPERT_TP,
                                                                            cfg.expert_hidden),
                                        _group(lay, rank, lay.etp)))
    # the experts' weighted sum: W2's output columns on a rank (the latent, or d on the full d)
    latent = prog.batch * F32 * lay.local_length(spec.EXPERT_TP, layouts.expert_output_width(cfg))
    reps = tuple(range(0, lay.n_ranks, lay.etp))  # one rank per expert group: the chain's path
    prog.collective(CollectiveEvent("experts/chain", "chain", reps, latent, reps))
    prog.collective(CollectiveEvent("experts/sum", "all_gather", reps, latent,
                                    tuple(range(lay.n_ranks))))


# ---- predictions -------------------------------------------------------------------------------
def predict(cfg: ModelConfig, n_ranks: int, name: str = layouts.OURS, batch: int = 1, *,
            chip: str = "tpu7x", interconnect: links.Interconnect | None = None,
            algorithm: str = "two-level", schedule: str | Schedule | None = None, context: int = 0,
            seed: int = 0, keep_timeline: bool = False) -> dict:
    """The predicted step of `cfg` on n_ranks under layout `name` at `batch` (JSON-able dict;
    with keep_timeline the RanksTimeline under "timeline"). Results are cached per arguments:
    the model is deterministic (pure Python, seeded routing)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} is invalid: an int >= 1")
    inter = links.interconnect(chip) if interconnect is None else interconnect
    sched = schedule_for(cfg, name if schedule is None else schedule)
    out = dict(_predict(cfg, n_ranks, name, batch, chip, inter, algorithm, sched, context, seed))
    if not keep_timeline:
        del out["timeline"]
    return out


@functools.lru_cache(maxsize=32)
def _predict(cfg: ModelConfig, n_ranks: int, name: str, batch: int, chip: str,
             inter: links.Interconnect, algorithm: str, sched: Schedule, context: int,
             seed: int) -> dict:
    logs = rank_logs(cfg, n_ranks, name, batch, schedule=sched, context=context, seed=seed)
    lay = layouts.layout(cfg, n_ranks, name)
    ranks: RanksTimeline = simulate_ranks(logs, chip, interconnect=inter, algorithm=algorithm,
                                          ranks=tuple(range(0, n_ranks, lay.etp)))
    parts = ranks.decomposition()
    counted = layout_bytes.rank_bytes(lay, batch, context)
    slowest = ranks.slowest_rank
    out = {"model": cfg.name, "n_ranks": n_ranks, "layout": name, "batch": batch, "chip": chip,
           "algorithm": algorithm, "schedule": dataclasses.asdict(sched),
           "step_s": ranks.total_s, "tokens_per_s": batch / ranks.total_s,
           "parts_s": {p: parts[p] for p in PARTS}, "slowest_rank": slowest,
           "rank_bytes": counted.total,
           "dma_bytes_slowest_rank": ranks.timeline(slowest).dma_bytes,
           "collectives_per_rank": sum(1 for run in ranks.collectives if 0 in run.group),
           "interconnect": {k: getattr(inter, k) for k in ("sibling_latency", "sibling_bandwidth",
                                                           "ici_latency", "ici_bandwidth")},
           "label": "timeline model prediction (mkresearch.scale_out), not measured",
           "published_step_s": published_step_s(cfg, n_ranks, chip, batch),
           "gb200_tok_s": PUBLISHED.get(cfg.name, {}).get("gb200_tok_s", {}).get(batch)
           if published_step_s(cfg, n_ranks, chip, batch) else None,
           "timeline": ranks}
    return out


def published_step_s(cfg: ModelConfig, n_ranks: int, chip: str, batch: int) -> float | None:
    """The release's published step for this model, ranks, chip and batch (None: none)."""
    published = PUBLISHED.get(cfg.name)
    if not published or published["n_ranks"] != n_ranks or published["chip"] != chip:
        return None
    tok_s = published["tok_s"].get(batch)
    return batch / tok_s if tok_s else None
