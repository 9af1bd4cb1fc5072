"""Every collective of one sharded decode step, as data: what the kernel issues and the
prediction prices, derived from the step's sharding plan (`collective_ops(plan)`,
`kernels/sharded/plan.py`).

A rank's step, in issue order, is a tuple of `CollectiveOp`: the layer and stage it belongs to,
its kind (all-gather, all-reduce, chain), the ranks taking part, the bytes it moves, what it is
issued after and what waits for it. Three modes:

  exact        the kernel as built (`kernels/compose/megakernel_sharded.py`, bit-equal to one device):
               every matrix split by its output columns, so a matrix whose input arrives split
               gets it all-gathered first (the heads' outputs before W_o, a hidden slice before
               W_down) and a matrix split by padded column chunks has its chunks all-gathered
               after; each routed expert's hidden gathered in its ETP group; the experts' weighted
               sum passed down the chain of expert groups and the last group's sum all-gathered;
               the embedding all-reduced, the vocab shards' sampling states all-gathered. Values
               move as f32 (`wire` does not apply: nothing is added on the wire's behalf).
  partial-sum  a matrix contracting over a split dimension (its `Param.gather` group: W_o over
               the heads, W_down over the FFN hidden, an expert's W2 over its ETP hidden slice) is
               split by its ROWS instead (`layout.param_shard`): each rank multiplies its slice
               and the partial sums are all-reduced (one-shot, two-level or rs-ag: the plan's
               `Reduction.algorithm`), every rank adding the same partials in one fixed order (`summed`:
               one rank per slice, slice 0 first; a host's first, then the hosts' sums), so all
               ranks hold the same bits. The routed experts'
               weighted sum is such a reduction over every rank in rank order (no chain, no
               gather of an expert's hidden). The column gathers of the small down-projections
               (W_qa, W_kva, the router, W_ld) stay: the model needs those vectors whole (a norm
               or top-k follows), two of them fused (FUSED_GATHERS, `Rule.joins`): the
               router's and W_ld's chunks (both of the normed x) travel in one all-gather, issued
               right after W_ld's last block and waited for before top-k; W_qa's and W_kva's
               likewise (the MLA body streams W_kva before W_qb). The router placed apart
               (`MegakernelOptions.router_placement`, `layout.place_router`): its scores are
               gathered among its group alone ("host", "sibling"; none "replicated") before
               top-k, and W_ld, streamed after routing and the first experts' DMAs, has its
               latent gathered over every rank on its own, waited for before the first expert
               is computed. W_lu's column chunks (RIDERS:
               needed only at the stage's end) travel in the messages of the shared expert's
               W_down reduction (`carries`), no collective of their own. Partial sums travel as
               `wire` (f32, or bf16: every value on the wire rounded and 2 bytes, in pairs,
               `Reduction.payload_bytes`; docs/sharding.md §4). Per MoE
               layer three reductions (attention, routed, shared) and one gather, each waited
               for right after it is issued (`critical`: only the weight blocks the global ring
               has in flight overlap it). A reduction others travel with or add to is run at
               the stage's end (`Collectives.settle`): issued after its last matrix. With
               ETP > 1 each rank's expert outputs are partial (its hidden slice times its rows
               of W2), each rounded to bf16 before the sum (`numerics.ExpertGroups.ranks` in
               the sharded reference).
  restructured partial-sum, with the latent MoE's two reductions restructured (`plan.py`): ρ
               a one-phase reduce-scatter (kind "reduce-scatter", `payload_bytes` the chunk each
               rank sends each peer), no W_lu column chunks riding; the shared experts'
               reduction carries W_lu's partial products and ρ's partial sums of squares beside
               its own ([B, d | d | 128]: `Reduction.besides`, about twice as wide). The
               reduce-scatter is in flight while the shared experts run (the stage streams
               them before W_lu, `ffn_kinds._moe_streamed`): waited for before W_lu, the one
               reduction of the three not waited right after it is issued.

Names follow the kernel's DMA log (a fused gather: its matrices' names joined by "+",
`sharded_stream.fused_name`): a collective named N logs its remote copies as
`N/all_gather` (and `N/reduce_scatter` for the exact mode's reduce-scatter + all-gather, `N/chain`
for the chain, `N/local`, `N/across`, `N/local_gather` for a reduction's levels). `payload_bytes`
is `interconnect.price`'s nbytes: an all-gather's piece per member, an all-reduce's whole vector, a
chain's running sum. `algorithm` is how the kernel sends it: "one-shot" for every all-gather, a
partial-sum reduction's the plan's (`Reduction.algorithm`: chosen by the interconnect model of
the plan's chip, the kernel built with it, the prediction pricing it).

Pure Python over the layout and the kinds' streamed matrices: the full Kimi K3 on 32 ranks takes
milliseconds, nothing is traced.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from mkresearch.kernels.base import registry
from mkresearch.kernels.sharded import sharded_stream
from mkresearch.kernels.sharded.plan import (
    EXPERT_SUM,
    F32,
    WIRE_BYTES,
    Reduction,
    ShardingPlan,
    carries,
    expert_sum_merged,
    lanes,
    routing_point,
)
from mkresearch.kernels.stages.experts import LATENT_UP

from mkresearch.model import spec
from mkresearch.model.config import LANE
from mkresearch.sharding import layout as layouts

MODES = layouts.COLLECTIVES  # the layout's mode names, partial-sum first (the default)
# a reduce-scatter (restructured's ρ, `Reduction.scatter`): one phase, each rank sending every
# peer that peer's chunk (payload: the chunk), the messages of an all-gather of the chunk; priced
# so (`interconnect.price`'s op "reduce_scatter")
KINDS = ("all-gather", "all-reduce", "chain", "reduce-scatter")
FUSED_WHY = ("one all-gather for both matrices' column chunks (the same input): issued after "
             "the second's last block, waited right away (its values are needed next)")
RIDING_WHY = ("issued at the stage's end, after W_lu, not behind the routed experts' stream "
              "(where the release hides it): it carries W_lu's chunks, which need the routed "
              "sum; sent before them, W_lu would need a collective of its own on the critical "
              "path, 2 per MoE layer either way, so no shorter predicted step")
ADDING_WHY = ("the routed experts' partial sums added to the shared experts' on each rank: one "
              "reduction for both, not two (experts on the full d, `layout.merges_shared_sum`)")
BESIDE_WHY = ("restructured: W_lu's partial products and ρ's partial sums of squares summed "
              "beside the shared experts' partial sums, in the same messages; ρ's RMSNorm scale "
              "applied after the sum (no collective of W_lu's own)")
SCATTER_WHY = ("restructured: ρ reduce-scattered in one phase, each rank receiving only the sum "
               "of its latent chunk, the one its W_lu rows need")
EXPERTS = "routed experts"  # the routed experts' step of a MoE stage (a wait label)
# the router placed apart (`layout.place_router`): W_ld's latent gathered on its own, issued after
# routing and the first experts' DMAs, waited for before the first expert is computed (a wait
# label: the prediction prices it beside the experts' reads, `program.FIRST_EXPERT_WAIT`)
FIRST_EXPERT = "the first expert computed"
LATENT_APART_WHY = ("the router placed apart: W_ld's latent gathered on its own after routing, "
                    "the first experts' DMAs in flight, waited for before the first expert is "
                    "computed (ASSUMPTION: done before that expert lands)")
SAMPLING_LANES = 3 * LANE  # the packed sampling state of a vocab shard (`sharded_stages`)


@dataclass(frozen=True)
class CollectiveOp:
    """One collective of one rank's step."""

    layer: int  # -1: the embedding; cfg.n_layers: the sampling stage
    stage: str  # the stage kind ("kda", "moe", ...), "embed" or "sampling"
    name: str  # the kernel's DMA-log name of its remote copies (before "/all_gather", ...)
    kind: str  # one of KINDS
    group: tuple[int, ...]  # the ranks taking part (this rank among them)
    payload_bytes: int  # all-gather: one member's piece; all-reduce: the vector; chain: the sum
    dtype: str  # on the wire: "f32" | "bf16"
    issue_after: str  # the step it follows
    wait_before: str  # the step that needs its result
    algorithm: str = "one-shot"
    count: int = 1  # times per step (an expert's hidden: once per expert computed, worst case)
    critical: bool = True  # False: overlapped with other work between issue and wait
    summed: tuple[int, ...] = ()  # all-reduce: the ranks whose partials are added, in order
    matrix: str = ""  # the streamed matrix it serves (DMA-log name), if any
    role: str = ""  # "input" (gathered before the matrix), "output" (after), "sum", ""
    carries: tuple[str, ...] = ()  # matrices whose column chunks ride in its messages
    why: str = ""  # why it is issued and waited where it is (the plan's listing says it)
    # the weight stream runs ahead past it while it is waited for: the sharded megakernel's one
    # global ring (`megakernel_sharded.ring_depth`) issues block i + depth when block i is used,
    # across stage and layer boundaries, so the blocks after a collective are in flight before
    # its wait (the prediction's ring horizon, `prediction.timeline.RankSimulation`)
    streams: bool = True

    @property
    def op(self) -> str:
        """`interconnect.price`'s name of the kind."""
        return self.kind.replace("-", "_")

    @property
    def sent_algorithm(self) -> str:
        """The `interconnect` algorithm the kernel sends it with (a chain: "one-shot", its price
        being the chain's)."""
        return "one-shot" if self.kind == "chain" else (
            "rs-ag" if self.algorithm == "reduce-scatter+all-gather" else self.algorithm)


def collective_ops(plan: ShardingPlan, *, rank: int = 0,
                   expert_counts: tuple[int, ...] | None = None) -> tuple[CollectiveOp, ...]:
    """One step's collectives of `rank` in issue order (see the module docstring).
    expert_counts: per MoE layer, the experts this rank's group computes (data: the batch's
    distinct experts of the group); default the worst case min(E / EP, B·k)."""
    if not isinstance(plan, ShardingPlan):
        raise ValueError(f"plan={plan!r} is invalid: a ShardingPlan (`sharding_plan`)")  # noqa: TRY004
    lay, batch = plan.layout, plan.batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} is invalid: an int >= 1")
    if not 0 <= rank < lay.n_ranks:
        raise ValueError(f"rank={rank!r} is invalid: an int in [0, {lay.n_ranks})")
    if lay.n_ranks == 1:
        return ()
    return _ops(plan, rank, expert_counts)


@functools.lru_cache(maxsize=256)
def _ops(plan: ShardingPlan, rank: int, expert_counts) -> tuple[CollectiveOp, ...]:
    lay, batch = plan.layout, plan.batch
    cfg, n = lay.cfg, lay.n_ranks
    worst_items = min(cfg.n_experts // lay.ep, batch * cfg.top_k)
    moe_layers = [ly for ly, (_, ffn) in enumerate(cfg.layers) if routing_point(lay, ffn)]
    if expert_counts is not None and len(expert_counts) != len(moe_layers):
        raise ValueError(f"expert_counts has {len(expert_counts)} entries: one per MoE layer "
                         f"({len(moe_layers)})")
    counts = dict(zip(moe_layers, expert_counts or [worst_items] * len(moe_layers), strict=True))
    ops = [_embed(cfg, batch, tuple(range(n)))]
    for layer, kinds in enumerate(cfg.layers):
        for kind in kinds:
            ops += [dataclasses.replace(op, layer=layer)
                    for op in _stage(plan, rank, kind, counts.get(layer, 0))]
    ops.append(CollectiveOp(cfg.n_layers, "sampling", "sampling_state", "all-gather",
                            tuple(range(n)), batch * SAMPLING_LANES * F32, "f32",
                            "LM head (last block)", "sampling merge"))
    return tuple(ops)


def _embed(cfg, batch, everyone) -> CollectiveOp:
    """The owner's embedding row, zeros elsewhere, all-reduced as a reduce-scatter + all-gather
    in f32, either mode (exact: one non-zero term)."""
    return CollectiveOp(-1, "embed", "embed", "all-reduce", everyone, batch * cfg.d_model * F32,
                        "f32", "embedding row DMA", "layer 0",
                        algorithm="reduce-scatter+all-gather", summed=everyone)


@functools.lru_cache(maxsize=1024)
def _stage(plan: ShardingPlan, rank: int, kind: str, items: int) -> tuple[CollectiveOp, ...]:
    """One stage's collectives (layer -2: the caller sets it), as `sharded_stream.ShardedStream`
    and `Collectives.combine_items` issue them."""
    ctx = _Ctx(plan, kind, rank,
               tuple(m.name for m in registry.kernel_stage(kind).streamed(plan.layout.cfg)))
    rules = {r.name: r for r in plan.rules}
    routing = routing_point(plan.layout, kind)
    out, settled = [], []  # settled: reductions run at the stage's end, after its last matrix
    for i, name in enumerate(ctx.names):
        rule = rules.get(name)
        if rule is not None and rule.gather is not None:
            out.append(ctx.input_gather(i, rule))
        if rule is not None and rule.reduce is not None and rule.beside is None:
            op = ctx.sum(plan.reduction(f"{name}/sum"), ctx.after(i))
            if carries(plan.rules, name):  # others travel in it (`Collectives.settle`)
                settled.append(dataclasses.replace(op, issue_after=ctx.names[-1],
                                                   wait_before=f"{kind} end"))
            else:
                out.append(op)
        if (rule is not None and rule.out is not None and rule.rides is None
                and rule.joins is None):
            joined = [r for r in rules.values() if r.joins == name]
            apart = name == routing and plan.layout.router != layouts.ROUTER_SPLIT
            op = ctx.output_gather(i, rule, joined, FIRST_EXPERT if apart
                                   else EXPERTS if name == routing else ctx.after(i))
            out.append(dataclasses.replace(op, why=LATENT_APART_WHY) if apart else op)
        if name == routing:
            out += _experts(ctx, items, ctx.after(i), expert_sum_merged(tuple(rules.values())))
    return (*out, *settled)


@dataclass(frozen=True)
class _Ctx:
    plan: ShardingPlan
    kind: str
    rank: int
    names: tuple[str, ...]

    @property
    def lay(self) -> layouts.Layout:
        return self.plan.layout

    @property
    def batch(self) -> int:
        return self.plan.batch

    @property
    def everyone(self) -> tuple[int, ...]:
        return tuple(range(self.lay.n_ranks))

    @property
    def etp_group(self) -> tuple[int, ...]:
        first = self.rank // self.lay.etp * self.lay.etp
        return tuple(range(first, first + self.lay.etp))

    @property
    def router_group(self) -> tuple[int, ...]:
        """The ranks the router's columns split over when placed apart (`layout.place_router`:
        consecutive, this rank among them)."""
        ways = self.lay.ways(spec.ROUTER_COLS)
        first = self.rank // ways * ways
        return tuple(range(first, first + ways))

    def after(self, i: int) -> str:
        """What follows streamed matrix i."""
        return self.names[i + 1] if i + 1 < len(self.names) else f"{self.kind} end"

    def op(self, name, kind, group, nbytes, **fields) -> CollectiveOp:
        fields.setdefault("dtype", "f32")
        return CollectiveOp(-2, self.kind, name, kind, group, int(nbytes), **fields)

    def input_gather(self, i: int, rule) -> CollectiveOp:
        """Matrix i's input, arriving split by `rule.gather`, all-gathered before it."""
        name, etp = self.names[i], rule.gather == spec.EXPERT_TP
        return self.op(f"{name}/input", "all-gather", self.etp_group if etp else self.everyone,
                       self.batch * F32 * lanes(self.lay.local_length(rule.gather, rule.k)),
                       issue_after=self.names[i - 1] if i else f"{self.kind} start",
                       wait_before=name, matrix=name, role="input")

    def output_gather(self, i: int, rule, joined: list, before: str) -> CollectiveOp:
        """Matrix i's column chunks (and those of the matrices joining it) all-gathered after it."""
        width = sum(self.lay.local_length(r.out, r.n) for r in (*joined, rule))
        group = self.router_group if rule.out == spec.ROUTER_COLS else self.everyone
        return self.op(sharded_stream.fused_name([*(r.name for r in joined), rule.name]),
                       "all-gather", group, self.batch * F32 * lanes(width),
                       issue_after=rule.name, wait_before=before, matrix=rule.name,
                       role="output", carries=tuple(r.name for r in joined),
                       why=FUSED_WHY if joined else "")

    def sum(self, r: Reduction, before: str) -> CollectiveOp:
        """A partial-sum all-reduce of the plan (`Collectives.reduce`), sent as it says."""
        wire = self.plan.wire
        return self.op(r.name, "all-reduce", self.everyone, r.payload_bytes(self.batch, wire),
                       dtype=wire, issue_after=r.matrix or EXPERTS, wait_before=before,
                       summed=r.summed, matrix=r.matrix, role="sum", algorithm=r.algorithm,
                       carries=r.carries + r.besides,
                       why=(RIDING_WHY if r.carries else BESIDE_WHY if r.besides
                            else ADDING_WHY if r.adds else ""))

    def scatter(self, r: Reduction, before: str) -> CollectiveOp:
        """Restructured's ρ: a one-phase reduce-scatter (`Collectives.reduce_scatter`)."""
        chunk = self.lay.local_length(spec.MOE_LATENT, r.width)
        return self.op(r.name, "reduce-scatter", self.everyone,
                       self.batch * chunk * WIRE_BYTES[self.plan.wire], dtype=self.plan.wire,
                       issue_after=EXPERTS, wait_before=before, summed=r.summed, role="sum",
                       why=SCATTER_WHY)


def _experts(ctx: _Ctx, items: int, before: str, merged: bool = False) -> list[CollectiveOp]:
    """The routed experts' collectives. Exact: an expert's hidden gathered in its ETP group, the
    weighted sum down the chain of expert groups, the last group's sum all-gathered.
    Partial-sum: W2's rows split by ETP, every rank's Σ w_e y_e over its experts and hidden slice
    all-reduced in rank order."""
    lay, b, cfg = ctx.lay, ctx.batch, ctx.lay.cfg
    if lay.collectives != layouts.EXACT:
        if merged:  # in the shared experts' reduction (`Rule.adds`)
            return []
        reduction = ctx.plan.reduction(EXPERT_SUM)
        if reduction.scatter:  # waited for before W_lu's rows: the shared experts run meanwhile
            return [ctx.scatter(reduction, LATENT_UP)]
        return [ctx.sum(reduction, before)]
    out = []
    if lay.etp > 1 and items:
        out.append(ctx.op("expert/h", "all-gather", ctx.etp_group,
                          b * F32 * lanes(lay.local_length(spec.EXPERT_TP, cfg.expert_hidden)),
                          issue_after="expert W1, W3", wait_before="expert W2", count=items,
                          role="input"))
    latent = lay.local_length(spec.EXPERT_TP, layouts.expert_output_width(cfg))
    if lay.ep > 1:
        chain = tuple(range(ctx.rank % lay.etp, lay.n_ranks, lay.etp))
        out.append(ctx.op("expert/chain", "chain", chain, b * F32 * latent,
                          issue_after="the group's experts", wait_before=EXPERT_SUM,
                          algorithm="chain", summed=chain, role="sum"))
    out.append(ctx.op(EXPERT_SUM, "all-gather", ctx.everyone, b * F32 * lanes(latent),
                      issue_after="the last group's sum", wait_before=before, role="output"))
    return out


def summary(ops: tuple[CollectiveOp, ...]) -> dict:
    """Counts of one step: collectives (an op run `count` times counts that often), per kind,
    on the critical path, and the largest per layer."""
    per_layer: dict[int, int] = {}
    for op in ops:
        per_layer[op.layer] = per_layer.get(op.layer, 0) + op.count
    return {"collectives": sum(op.count for op in ops),
            "by_kind": {k: sum(op.count for op in ops if op.kind == k) for k in KINDS},
            "reductions_critical_max": max(
                (sum(op.count for op in ops if op.layer == ly and op.kind == "all-reduce"
                     and op.critical) for ly in per_layer if ly >= 0), default=0),
            "max_per_layer": max((c for ly, c in per_layer.items() if ly >= 0), default=0)}
