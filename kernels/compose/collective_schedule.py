"""Every collective of one sharded decode step, as data: what the kernel issues and the
prediction prices, from one description (`collective_schedule`).

A rank's step, in issue order, is a tuple of `CollectiveOp`: the layer and stage it belongs to,
its kind (all-gather, all-reduce, chain), the ranks taking part, the bytes it moves, what it is
issued after and what waits for it. Two modes:

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
               and the partial sums are all-reduced (one-shot, two-level or rs-ag: the kernel's
               `reductions`), every rank adding the same partials in one fixed order (`summed`:
               one rank per slice, slice 0 first; a host's first, then the hosts' sums), so all
               ranks hold the same bits. The routed experts'
               weighted sum is such a reduction over every rank in rank order (no chain, no
               gather of an expert's hidden). The column gathers of the small down-projections
               (W_qa, W_kva, the router, W_ld) stay: the model needs those vectors whole (a norm
               or top-k follows), two of them fused (FUSED_GATHERS, `Rule.joins`): the
               router's and W_ld's chunks (both of the normed x) travel in one all-gather, issued
               right after W_ld's last block and waited for before top-k; W_qa's and W_kva's
               likewise (the MLA body streams W_kva before W_qb). W_lu's column chunks (RIDERS:
               needed only at the stage's end) travel in the messages of the shared expert's
               W_down reduction (`carries`), no collective of their own. Partial sums travel as
               `wire` (f32, or bf16: each rank's partial rounded once before the sum). Per MoE
               layer three reductions (attention, routed, shared) and one gather, each waited
               for right after it is issued (`critical`: only the weight blocks the global ring
               has in flight overlap it); not yet: the shared expert's sum hidden behind the
               routed experts' stream, ETP > 1 numerics (each expert's partial output is rounded
               to bf16 before the sum).

Names follow the kernel's DMA log (a fused gather: its matrices' names joined by "+",
`sharded_stream.fused_name`): a collective named N logs its remote copies as
`N/all_gather` (and `N/reduce_scatter` for the exact mode's reduce-scatter + all-gather, `N/chain`
for the chain, `N/local`, `N/across`, `N/local_gather` for a reduction's levels). `payload_bytes`
is `interconnect.price`'s nbytes: an all-gather's piece per member, an all-reduce's whole vector, a
chain's running sum. `algorithm` is how the kernel sends it: "one-shot" for every all-gather, a
partial-sum reduction's from the kernel's options (`reductions`: "two-level" or "rs-ag", chosen by
`mkresearch.prediction.collective_choice.kernel_reductions`, which the prediction prices).

Pure Python over the layout and the kinds' streamed matrices: the full Kimi K3 on 32 ranks takes
milliseconds, nothing is traced.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from mkresearch.kernels.base import registry
from mkresearch.kernels.compose import megakernel_plan
from mkresearch.kernels.sharded import collectives, sharded_stream
from mkresearch.kernels.sharded.rules import expert_sum_merged
from mkresearch.kernels.stages import experts, router

from mkresearch.model import spec
from mkresearch.model.config import LANE
from mkresearch.sharding import layout as layouts

MODES = layouts.COLLECTIVES  # the layout's mode names, partial-sum first (the default)
WIRES = ("f32", "bf16")
WIRE_BYTES = {"f32": 4, "bf16": 2}
KINDS = ("all-gather", "all-reduce", "chain")
F32 = 4
FUSED_WHY = ("one all-gather for both matrices' column chunks (the same input): issued after "
             "the second's last block, waited right away (its values are needed next)")
RIDING_WHY = ("not issued before the routed experts' stream (where the release hides it): it "
              "carries W_lu's chunks, which need the routed sum; streaming the shared expert "
              "first would give W_lu a collective of its own on the critical path, 2 per MoE "
              "layer either way, so no shorter predicted step")
ADDING_WHY = ("the routed experts' partial sums added to the shared experts' on each rank: one "
              "reduction for both, not two (experts on the full d, `layout.merges_shared_sum`)")
EXPERTS = "routed experts"  # the routed experts' step of a MoE stage (a wait label)
SHARED_DOWN = "shared/w_down"  # the shared experts' W_down (its reduction: "shared/w_down/sum")
ROUTED_OUTPUT = experts.LATENT_UP  # the routed experts' output as `ffn_stage_body` settles it
SAMPLING_LANES = 3 * LANE  # the packed sampling state of a vocab shard (`sharded_stages`)
# column splits whose chunks are gathered after the matmul (the next step needs the whole vector);
# heads, FFN hidden and expert columns stay this rank's
GATHERED_COLUMNS = (spec.MODEL_COLS, spec.DOWN_COLS, spec.MOE_LATENT)
# matrices whose whole output is needed only at their stage's end (it joins the stage's sum):
# in partial-sum mode their column chunks ride with the stage's next reduction (`Rule.rides`)
RIDERS = (experts.LATENT_UP,)
# (first, second): column-split matrices of one stage computed from the same input, whose chunks
# one all-gather carries in partial-sum mode (`Rule.joins`): the router's logits with W_ld's
# latent (both of the normed x), W_qa's columns with W_kva's
FUSED_GATHERS = ((router.W_ROUTER, experts.LATENT_DOWN), ("mla.w_qa", "mla.w_kva"))


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

    @property
    def op(self) -> str:
        """`interconnect.price`'s name of the kind."""
        return self.kind.replace("-", "_")


def _check(lay: layouts.Layout, batch: int, mode: str, wire: str) -> None:
    if not isinstance(lay, layouts.Layout):
        raise ValueError(f"lay={lay!r} is invalid: a mkresearch.layout.Layout")  # noqa: TRY004
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} is invalid: an int >= 1")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: one of {MODES}")
    if wire not in WIRES:
        raise ValueError(f"wire={wire!r} is invalid: one of {WIRES}")


def _lanes(width: int) -> int:
    return -(-width // LANE) * LANE


@functools.lru_cache(maxsize=64)
def collective_rules(lay: layouts.Layout) -> tuple[collectives.Rule, ...]:
    """Every streamed matrix with a collective around it: exact, its input gathered
    (Param.gather) or its output's column chunks gathered (split by a padded group); partial-sum,
    a matrix split by its rows (`layout.param_shard`) has its products reduced instead."""
    cfg, rules = lay.cfg, []
    for kind in cfg.kinds:
        first = len(rules)
        params = spec.stage(kind).params(cfg)
        for m in registry.kernel_stage(kind).streamed(cfg):
            p = params[m.key]
            k, n = m.shape
            active = layouts.active_shard(lay, layouts.param_shard(lay, p), p.shape)
            out = next((group for axis, group in active
                        if axis == 1 and group in GATHERED_COLUMNS), None)
            reduce = next((group for axis, group in active if axis == 0 and group == p.gather),
                          None)
            gather = (p.gather if reduce is None and p.gather is not None
                      and lay.divides(p.gather, k) else None)
            if out is not None or gather is not None or reduce is not None:
                rules.append(collectives.Rule(m.name, out, n, gather, k, reduce))
        rules[first:] = _riding(rules[first:])
        if lay.collectives == layouts.PARTIAL_SUM:
            rules[first:] = _joining(rules[first:])
        if layouts.merges_shared_sum(lay, kind):  # the routed experts' sum joins W_sd's
            rules[first:] = [dataclasses.replace(r, adds=ROUTED_OUTPUT) if r.name == SHARED_DOWN
                             else r for r in rules[first:]]
    return tuple(rules)


def merged_expert_sum(lay: layouts.Layout) -> bool:
    """Whether the routed experts' partial sums travel in the shared experts' reduction (one
    reduction for both, `layout.merges_shared_sum`): no "expert/sum" of its own."""
    return expert_sum_merged(collective_rules(lay))


def _joining(rules: list[collectives.Rule]) -> list[collectives.Rule]:
    """One stage's rules with the first matrix of each FUSED_GATHERS pair whose both chunks are
    gathered joining the second's gather (`Rule.joins`): one collective less per pair."""
    by_name = {r.name: i for i, r in enumerate(rules)}
    out = list(rules)
    for first, second in FUSED_GATHERS:
        if first in by_name and second in by_name and all(
                out[by_name[m]].out is not None and out[by_name[m]].rides is None
                and out[by_name[m]].gather is None for m in (first, second)):
            out[by_name[first]] = dataclasses.replace(out[by_name[first]], joins=second)
    return out


def _riding(rules: list[collectives.Rule]) -> list[collectives.Rule]:
    """One stage's rules with the column gathers of RIDERS sent with the stage's next
    reduction (`Rule.rides`) when it has one after them: one collective less per stage."""
    out = list(rules)
    for i, rule in enumerate(out):
        later = next((r for r in out[i + 1:] if r.reduce is not None), None)
        if rule.name in RIDERS and rule.out is not None and later is not None:
            out[i] = dataclasses.replace(rule, rides=later.name)
    return out


def collective_schedule(lay: layouts.Layout, batch: int, mode: str = layouts.DEFAULT_COLLECTIVES,
                        wire: str = "f32", *, rank: int = 0,
                        expert_counts: tuple[int, ...] | None = None,
                        reductions: tuple = ()) -> tuple[CollectiveOp, ...]:
    """One step's collectives of `rank` in issue order (see the module docstring).
    expert_counts: per MoE layer, the experts this rank's group computes (data: the batch's
    distinct experts of the group); default the worst case min(E / EP, B·k). reductions: the
    kernel's (`MegakernelOptions.reductions`: (name, algorithm) of the reductions not sent
    one-shot), each such reduction's `algorithm`."""
    if not isinstance(reductions, tuple):
        raise ValueError(f"reductions={reductions!r} is invalid: a tuple of (name, algorithm)")  # noqa: TRY004
    _check(lay, batch, mode, wire)
    if not 0 <= rank < lay.n_ranks:
        raise ValueError(f"rank={rank!r} is invalid: an int in [0, {lay.n_ranks})")
    if lay.n_ranks == 1:
        return ()
    return _schedule(lay, batch, mode, wire, rank, expert_counts, reductions)


@functools.lru_cache(maxsize=256)
def _schedule(lay, batch, mode, wire, rank, expert_counts, reductions=()
              ) -> tuple[CollectiveOp, ...]:
    cfg, n = lay.cfg, lay.n_ranks
    worst_items = min(cfg.n_experts // lay.ep, batch * cfg.top_k)
    moe_layers = [ly for ly, (_, ffn) in enumerate(cfg.layers) if _routing_point(lay, ffn)]
    if expert_counts is not None and len(expert_counts) != len(moe_layers):
        raise ValueError(f"expert_counts has {len(expert_counts)} entries: one per MoE layer "
                         f"({len(moe_layers)})")
    counts = dict(zip(moe_layers, expert_counts or [worst_items] * len(moe_layers), strict=True))
    ops = [_embed(cfg, batch, tuple(range(n)))]
    for layer, kinds in enumerate(cfg.layers):
        for kind in kinds:
            ops += [dataclasses.replace(op, layer=layer) for op in _stage(
                lay, batch, mode, wire, rank, kind, counts.get(layer, 0), reductions)]
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
def _stage(lay, batch, mode, wire, rank, kind, items, reductions=()
           ) -> tuple[CollectiveOp, ...]:
    """One stage's collectives (layer -2: the caller sets it), as `sharded_stream.ShardedStream`
    and `Collectives.combine_items` issue them."""
    lay = dataclasses.replace(lay, collectives=mode)
    names = tuple(m.name for m in registry.kernel_stage(kind).streamed(lay.cfg))
    ctx = _Ctx(lay, batch, wire, kind, rank, names, reductions)
    rules = {r.name: r for r in collective_rules(lay)}
    routing = _routing_point(lay, kind)
    out, b = [], batch
    for i, name in enumerate(names):
        rule = rules.get(name)
        if rule is not None and rule.gather is not None:
            etp = rule.gather == spec.EXPERT_TP
            out.append(ctx.op(f"{name}/input", "all-gather", ctx.etp_group if etp else ctx.everyone,
                              b * F32 * _lanes(lay.local_length(rule.gather, rule.k)),
                              issue_after=names[i - 1] if i else f"{kind} start",
                              wait_before=name, matrix=name, role="input"))
        if rule is not None and rule.reduce is not None:
            riders = [r for r in rules.values() if r.rides == name]
            out.append(dataclasses.replace(
                ctx.sum(f"{name}/sum", b * rule.n, name, ctx.after(i),
                        lay.slice_firsts(rule.reduce), matrix=name),
                payload_bytes=b * rule.n * WIRE_BYTES[wire] + sum(
                    b * F32 * _lanes(lay.local_length(r.out, r.n)) for r in riders),
                carries=tuple(r.name for r in riders),
                why=RIDING_WHY if riders else ADDING_WHY if rule.adds else ""))
        if (rule is not None and rule.out is not None and rule.rides is None
                and rule.joins is None):
            joined = [r for r in rules.values() if r.joins == name]
            width = sum(lay.local_length(r.out, r.n) for r in (*joined, rule))
            out.append(ctx.op(sharded_stream.fused_name([*(r.name for r in joined), name]),
                              "all-gather", ctx.everyone, b * F32 * _lanes(width),
                              issue_after=name,
                              wait_before=EXPERTS if name == routing else ctx.after(i),
                              matrix=name, role="output",
                              carries=tuple(r.name for r in joined),
                              why=FUSED_WHY if joined else ""))
        if name == routing:
            out += _experts(ctx, items, ctx.after(i), expert_sum_merged(tuple(rules.values())))
    return tuple(out)


@dataclass(frozen=True)
class _Ctx:
    lay: layouts.Layout
    batch: int
    wire: str
    kind: str
    rank: int
    names: tuple[str, ...]
    reductions: tuple = ()  # the kernel's (name, algorithm) of reductions not sent one-shot

    @property
    def everyone(self) -> tuple[int, ...]:
        return tuple(range(self.lay.n_ranks))

    @property
    def etp_group(self) -> tuple[int, ...]:
        first = self.rank // self.lay.etp * self.lay.etp
        return tuple(range(first, first + self.lay.etp))

    def after(self, i: int) -> str:
        """What follows streamed matrix i."""
        return self.names[i + 1] if i + 1 < len(self.names) else f"{self.kind} end"

    def op(self, name, kind, group, nbytes, **fields) -> CollectiveOp:
        fields.setdefault("dtype", "f32")
        return CollectiveOp(-2, self.kind, name, kind, group, int(nbytes), **fields)

    def sum(self, name, values, after, before, summed, matrix="") -> CollectiveOp:
        """A partial-sum all-reduce of `values` numbers (`Collectives.reduce`), sent as the
        kernel's `reductions` say (default one-shot)."""
        return self.op(name, "all-reduce", self.everyone, values * WIRE_BYTES[self.wire],
                       dtype=self.wire, issue_after=after, wait_before=before, summed=summed,
                       matrix=matrix, role="sum",
                       algorithm=dict(self.reductions).get(name, "one-shot"))


def _experts(ctx: _Ctx, items: int, before: str, merged: bool = False) -> list[CollectiveOp]:
    """The routed experts' collectives. Exact: an expert's hidden gathered in its ETP group, the
    weighted sum down the chain of expert groups, the last group's sum all-gathered.
    Partial-sum: W2's rows split by ETP, every rank's Σ w_e y_e over its experts and hidden slice
    all-reduced in rank order."""
    lay, b, cfg = ctx.lay, ctx.batch, ctx.lay.cfg
    if lay.collectives != layouts.EXACT:
        if merged:  # in the shared experts' reduction (`Rule.adds`)
            return []
        width = layouts.expert_output_width(cfg)
        return [ctx.sum("expert/sum", b * width, EXPERTS, before, ctx.everyone)]
    out = []
    if lay.etp > 1 and items:
        out.append(ctx.op("expert/h", "all-gather", ctx.etp_group,
                          b * F32 * _lanes(lay.local_length(spec.EXPERT_TP, cfg.expert_hidden)),
                          issue_after="expert W1, W3", wait_before="expert W2", count=items,
                          role="input"))
    latent = lay.local_length(spec.EXPERT_TP, layouts.expert_output_width(cfg))
    if lay.ep > 1:
        chain = tuple(range(ctx.rank % lay.etp, lay.n_ranks, lay.etp))
        out.append(ctx.op("expert/chain", "chain", chain, b * F32 * latent,
                          issue_after="the group's experts", wait_before="expert/sum",
                          algorithm="chain", summed=chain, role="sum"))
    out.append(ctx.op("expert/sum", "all-gather", ctx.everyone, b * F32 * _lanes(latent),
                      issue_after="the last group's sum", wait_before=before, role="output"))
    return out


def _routing_point(lay: layouts.Layout, kind: str) -> str | None:
    """The streamed matrix after which a MoE kind runs its routed experts (the latent
    down-projection, else the router), None for a kind without experts."""
    if kind not in lay.cfg.kinds or spec.stage(kind).role != "ffn":
        return None
    names = [m.name for m in registry.kernel_stage(kind).streamed(lay.cfg)]
    if not any(n.endswith("w_router") for n in names):
        return None
    return next((n for n in names if n.endswith("w_ld")),
                next(n for n in names if n.endswith("w_router")))


def has_routed_experts(lay: layouts.Layout) -> bool:
    """Whether a step of the layout's model runs routed experts (sends "expert/sum")."""
    return any(_routing_point(lay, ffn) for _, ffn in lay.cfg.layers)


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
