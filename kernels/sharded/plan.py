"""The sharding plan of one step: which streamed matrices split how, which partial sums are reduced
or gathered, and with which algorithm (`ShardingPlan`, made by `sharding_plan`).

One plan per layout (model, rank count, layout name, collectives mode), batch, wire format and
chip. Everything about the step's collectives is read from it:

  rules       every streamed matrix with a collective around it (`Rule`, `collective_rules`):
              exact, its input gathered (`Param.gather`) or its output's column chunks gathered;
              partial-sum, a matrix split by its rows has its products reduced instead, small
              column gathers of one input fused (`Rule.joins`), W_lu's chunks riding in the
              stage's next reduction (`Rule.rides`), the routed experts' partial sums added to the
              shared experts' when both are on the full d (`Rule.adds`); the router placed
              apart (`layout.place_router`, `MegakernelOptions.router_placement`): its columns
              in spec.ROUTER_COLS, gathered among its group (the "router" channel), joining no
              gather (W_ld's latent then has its own)
  reductions  the one list of the partial sums a rank reduces (`Reduction`: name, width, the
              column chunks riding along, the algorithm it is sent with and why); the kernel's
              buffers (`collectives.make_shard_plan`, `levels`), the step's collectives as data
              (`collective_ops`) and the prediction's per-rank program all read it
  restructured  the mode `layouts.RESTRUCTURED`: partial-sum, with the latent MoE's reductions
              restructured: ρ (the routed experts' latent sum) reduce-scattered in one phase
              (`Reduction.scatter`: each rank receives only its latent chunk), W_lu split by
              its latent rows (`spec.Param.scattered`), its partial products and the partial
              sums of squares of ρ's chunks beside the shared experts' in that reduction's
              messages (`Rule.beside`), ρ's RMSNorm scale applied after the sum
              (`numerics.rms_scale`): as many collectives per MoE layer as partial-sum mode
              (W_lu's partial sums rode in the shared experts' reduction there too), ρ's a
              one-phase reduce-scatter instead of an all-reduce, the shared reduction's payload
              about twice as wide; the latent norm's rounding of ρ̂ to bf16 moved
              (`reference_sharded`: what holds)
  algorithms  each reduction's, chosen from the interconnect model of the chip's slice
              (`mkresearch.hardware.interconnect.choose`: the cheapest of one-shot, two-level and
              rs-ag for its payload on its hosts) and passed to the kernel as an input
              (`MegakernelOptions.reductions`, `.ranks_per_host`): the kernel never chooses

Pure Python over the layout and the kinds' streamed matrices: nothing is traced.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from mkresearch.kernels.base import registry
from mkresearch.kernels.stages import experts, router

from mkresearch.hardware import interconnect as links
from mkresearch.model import spec
from mkresearch.model.config import LANE
from mkresearch.sharding import layout as layouts

ONE_SHOT, TWO_LEVEL, RS_AG = "one-shot", "two-level", "rs-ag"  # a reduction's algorithms
REDUCTION_ALGORITHMS = (ONE_SHOT, TWO_LEVEL, RS_AG)  # the default first
WIRES = ("f32", "bf16")
WIRE_BYTES = {"f32": 4, "bf16": 2}
SCATTER_REASON = ("one-phase reduce-scatter (restructured): each rank receives only the sum of "
                  "its latent chunk, the one W_lu's rows need")
F32 = 4
EXPERT_SUM = "expert/sum"  # the routed experts' reduction (partial-sum mode)
SHARED_DOWN = "shared/w_down"  # the shared experts' W_down (its reduction: "shared/w_down/sum")
ROUTED_OUTPUT = experts.LATENT_UP  # the routed experts' output as `ffn_stage_body` settles it
# column splits whose chunks are gathered after the matmul (the next step needs the whole vector);
# heads, FFN hidden and expert columns stay this rank's
GATHERED_COLUMNS = (spec.MODEL_COLS, spec.DOWN_COLS, spec.MOE_LATENT, spec.ROUTER_COLS)
# the router's columns placed apart (`layout.place_router`): gathered among the router's group
# of consecutive ranks (the collectives' "router" channel), never fused with W_ld's latent
ROUTER_CHANNEL = "router"
# matrices whose whole output is needed only at their stage's end (it joins the stage's sum):
# in partial-sum mode their column chunks ride with the stage's next reduction (`Rule.rides`)
RIDERS = (experts.LATENT_UP,)
# (first, second): column-split matrices of one stage computed from the same input, whose chunks
# one all-gather carries in partial-sum mode (`Rule.joins`): the router's logits with W_ld's
# latent (both of the normed x), W_qa's columns with W_kva's
FUSED_GATHERS = ((router.W_ROUTER, experts.LATENT_DOWN), ("mla.w_qa", "mla.w_kva"))


@dataclass(frozen=True)
class Rule:
    """How one streamed matrix runs on a rank: its input gathered over `gather` first (to its
    whole `k` columns), its output's column chunks gathered over `out` after (to `n`)."""

    name: str  # DMA-log name
    out: str | None
    n: int
    gather: str | None
    k: int
    reduce: str | None = None  # partial-sum: rows split by this group, the products all-reduced
    # partial-sum: the output's column chunks travel in the messages of this later reduction of
    # the stage (a matrix whose whole output is needed only at the stage's end: W_lu), not alone
    rides: str | None = None
    # partial-sum: the output's column chunks travel in the gather of this later matrix of the
    # stage, computed from the same input (the router's with W_ld's, W_qa's with W_kva's): one
    # all-gather carries both (`sharded_stream.ShardedStream.matmuls`)
    joins: str | None = None
    # partial-sum: the stage output (its `settle` key) whose partial sums are added to this
    # matrix's before its one reduction (routed experts on the full d into the shared experts')
    adds: str | None = None
    # restructured: this matrix's partial products (rows split by `reduce`), with the partial
    # sums of squares of its input's chunks, travel beside this later matrix's in its
    # reduction's messages, summed with them; its input's RMSNorm scale applied after the sum.
    # Out of the repr (a recorded compile's fingerprint, `measurement.recorded`) while None: the
    # other modes' plans, and so their records, stay as they were
    beside: str | None = dataclasses.field(default=None, repr=False)

    def __repr__(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                  if f.repr or getattr(self, f.name) is not None]
        return f"Rule({', '.join(fields)})"


def expert_sum_merged(rules: tuple[Rule, ...] | list[Rule]) -> bool:
    """Whether the routed experts' partial sums travel in another matrix's reduction
    (`Rule.adds`): then they have no reduction (EXPERT_SUM) of their own."""
    return any(rule.adds for rule in rules)


@functools.lru_cache(maxsize=64)
def collective_rules(lay: layouts.Layout) -> tuple[Rule, ...]:
    """Every streamed matrix with a collective around it: exact, its input gathered
    (Param.gather) or its output's column chunks gathered (split by a padded group); partial-sum,
    a matrix split by its rows (`layout.param_shard`) has its products reduced instead."""
    cfg, rules = lay.cfg, []
    for kind in cfg.kinds:
        first = len(rules)
        params = spec.stage(kind).params(cfg)
        streamed = registry.kernel_stage(kind).streamed(cfg)
        for m in streamed:
            rule = _rule(lay, m, params[m.key])
            if rule is not None:
                rules.append(rule)
        rules[first:] = _riding(rules[first:])
        if lay.partial_sums:
            rules[first:] = _joining(rules[first:])
        if lay.collectives == layouts.RESTRUCTURED:
            rules[first:] = _beside(rules[first:], kind, streamed, params)
        if layouts.merges_shared_sum(lay, kind):  # the routed experts' sum joins W_sd's
            rules[first:] = [dataclasses.replace(r, adds=ROUTED_OUTPUT) if r.name == SHARED_DOWN
                             else r for r in rules[first:]]
    return tuple(rules)


def _rule(lay: layouts.Layout, m: registry.Streamed, p: spec.Param) -> Rule | None:
    """A streamed matrix's rule, None when nothing is gathered or reduced around it."""
    k, n = m.shape
    active = layouts.active_shard(lay, layouts.param_shard(lay, p), p.shape)
    out = next((group for axis, group in active if axis == 1 and group in GATHERED_COLUMNS), None)
    reduce = next((group for axis, group in active if axis == 0 and group in (p.gather, p.scattered)
                   and group is not None), None)
    gather = (p.gather if reduce is None and p.gather is not None and lay.divides(p.gather, k)
              else None)
    if out is None and gather is None and reduce is None:
        return None
    return Rule(m.name, out, n, gather, k, reduce)


def _joining(rules: list[Rule]) -> list[Rule]:
    """One stage's rules with the first matrix of each FUSED_GATHERS pair whose both chunks are
    gathered joining the second's gather (`Rule.joins`): one collective less per pair."""
    by_name = {r.name: i for i, r in enumerate(rules)}
    out = list(rules)
    for first, second in FUSED_GATHERS:
        if first in by_name and second in by_name and all(
                out[by_name[m]].out not in (None, spec.ROUTER_COLS) and out[by_name[m]].rides is None
                and out[by_name[m]].gather is None for m in (first, second)):
            out[by_name[first]] = dataclasses.replace(out[by_name[first]], joins=second)
    return out


def carries(rules: tuple[Rule, ...], name: str) -> bool:
    """Whether the reduction of matrix `name` carries more than its own partial sums: another
    output's partial sums (`Rule.adds`), column chunks riding (`Rule.rides`) or rows beside it
    (`Rule.beside`). Such a reduction runs once, at its stage's end (`Collectives.settle`): the
    stream, the collectives and their model all ask here."""
    rule = next((r for r in rules if r.name == name), None)
    return rule is not None and rule.reduce is not None and bool(
        rule.adds or any(name in (r.rides, r.beside) for r in rules))


def _riding(rules: list[Rule]) -> list[Rule]:
    """One stage's rules with the column gathers of RIDERS sent with a reduction of the stage
    (`Rule.rides`), its last, when it has one: that reduction then waits for the stage's end
    (`Collectives.settle`). One collective less per stage."""
    out = list(rules)
    for i, rule in enumerate(out):
        carrier = next((r for r in reversed(out) if r.reduce is not None and r is not rule),
                       None)
        if rule.name in RIDERS and rule.out is not None and carrier is not None:
            out[i] = dataclasses.replace(rule, rides=carrier.name)
    return out


def _beside(rules: list[Rule], kind: str, streamed: tuple, params: dict) -> list[Rule]:
    """Restructured: one stage's rules with each matrix split by its scattered rows (W_lu)
    beside the reduction its parameter names (`Param.beside`, the model's choice:
    `Rule.beside`), which then waits for the stage's end (`Collectives.settle`). ValueError for
    a stage without that reduction (a latent MoE without shared experts: its scale would need a
    reduction of its own)."""
    key_of = {m.name: m.key for m in streamed}
    name_of = {m.key: m.name for m in streamed}
    out = list(rules)
    for i, rule in enumerate(out):
        wanted = params[key_of[rule.name]].beside
        if wanted is None or rule.reduce is None:
            continue
        carrier = next((r for r in out if r.reduce is not None and r.name == name_of.get(wanted)),
                       None)
        if carrier is None:
            raise ValueError(f"collectives='restructured' is invalid for the {kind!r} stage: "
                             f"{rule.name} has no reduction of {wanted} to travel beside "
                             "(a latent MoE needs shared experts for it); use 'partial-sum'")
        out[i] = dataclasses.replace(rule, beside=carrier.name)
    return out


def routing_point(lay: layouts.Layout, kind: str) -> str | None:
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
    """Whether a step of the layout's model runs routed experts."""
    return any(routing_point(lay, ffn) for _, ffn in lay.cfg.layers)


def value_bytes(width: int, wire: str) -> int:
    """Bytes a value of a reduced vector of `width` moves: the wire's, a bf16 wire's in pairs
    (an odd width travels in f32 slots)."""
    return WIRE_BYTES[wire] if width % 2 == 0 else F32


def lanes(width: int) -> int:
    """A width in whole lanes."""
    return -(-width // LANE) * LANE


# ---- the reductions ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Reduction:
    """One partial-sum reduction a rank sends per layer of its stage (`Collectives.reduce`)."""

    name: str  # "<matrix>/sum" or EXPERT_SUM: its DMA-log name
    matrix: str  # the matrix whose partial products it adds (EXPERT_SUM: "")
    width: int  # values per batch row, [B, width]
    summed: tuple[int, ...]  # the ranks whose partials are added, in order
    carries: tuple[str, ...] = ()  # matrices whose column chunks ride in its messages
    rider_widths: tuple[int, ...] = ()  # a rank's column chunk of each carried matrix
    adds: str | None = None  # a stage output whose partial sums it adds too (`Rule.adds`)
    algorithm: str = ONE_SHOT  # how the kernel sends it (REDUCTION_ALGORITHMS)
    reason: str = ""  # why that algorithm (the interconnect model's choice)
    # restructured: matrices whose partial products (then their input's partial sums of
    # squares, one lane tile) travel beside this one's in its messages (`Rule.beside`): width
    # counts them ([B, n | n_b | LANE ...])
    besides: tuple[str, ...] = ()
    # restructured's ρ: a one-phase reduce-scatter, each rank receiving the sum of its own
    # chunk of the vector only (`Collectives.reduce_scatter`), never sent in levels
    scatter: bool = False

    @property
    def riders(self) -> int:
        """The riders' width per rank (side by side in its messages, `levels`)."""
        return sum(self.rider_widths)

    def payload_bytes(self, batch: int, wire: str) -> int:
        """`interconnect.price`'s nbytes: the vector on the wire and the riders' chunks (f32,
        each in whole lanes); a reduce-scatter: the whole vector, each rank sending every peer
        its chunk of it. The values travel in f32 slots of whole lanes, a bf16 wire's two to a
        slot where they pack in pairs (an even width: `levels.pack_bf16`)."""
        slots = self.width * value_bytes(self.width, wire) // F32
        return batch * F32 * (lanes(slots) + sum(lanes(w) for w in self.rider_widths))


@functools.lru_cache(maxsize=64)
def reductions(lay: layouts.Layout) -> tuple[Reduction, ...]:
    """Partial-sum mode: every reduction a rank sends, each sent one-shot (the rules' order, the
    routed experts' last); exact mode, or one rank: none."""
    if not lay.partial_sums or lay.n_ranks == 1:
        return ()
    rules = collective_rules(lay)
    out = []
    for rule in (r for r in rules if r.reduce is not None and r.beside is None):
        riders = [r for r in rules if r.rides == rule.name]
        besides = tuple(r.name for r in rules if r.beside == rule.name)
        summed = lay.slice_firsts(rule.reduce)
        for b in (r for r in rules if r.beside == rule.name):
            if set(lay.slice_firsts(b.reduce)) != set(summed):
                raise ValueError(f"collectives='restructured' is invalid here: {b.name}'s slices "
                                 f"(ranks {lay.slice_firsts(b.reduce)}) are not those "
                                 f"{rule.name}'s reduction adds ({summed}); use 'partial-sum'")
        out.append(Reduction(f"{rule.name}/sum", rule.name,
                             rule.n + sum(b.n + LANE for b in rules if b.beside == rule.name),
                             summed, tuple(r.name for r in riders),
                             tuple(lay.local_length(r.out, r.n) for r in riders), rule.adds,
                             besides=besides))
    if has_routed_experts(lay) and not expert_sum_merged(rules):  # else in W_sd's
        scatter = any(r.beside for r in rules)  # restructured: ρ reduce-scattered
        latent = lay.split(spec.MOE_LATENT)
        if scatter and (latent.ways != lay.n_ranks or latent.stride != 1):
            raise ValueError(f"collectives='restructured' is invalid on {lay.n_ranks} ranks of "
                             f"{lay.cfg.name}: ρ's reduce-scatter needs the MoE latent split one "
                             f"slice per rank (it splits {latent.ways} ways); use 'partial-sum'")
        out.append(Reduction(EXPERT_SUM, "", layouts.expert_output_width(lay.cfg),
                             tuple(range(lay.n_ranks)), scatter=scatter,
                             reason=SCATTER_REASON if scatter else ""))
    return tuple(out)


# ---- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardingPlan:
    """One step's sharding: the layout, its rules and reductions with their algorithms."""

    layout: layouts.Layout
    batch: int
    wire: str
    reductions: tuple[Reduction, ...]
    ranks_per_host: int = 0  # consecutive ranks of a host (every reduction adds theirs first); 0: all
    chip: str | None = None  # whose slice chose the algorithms (None: every reduction one-shot)

    @property
    def rules(self) -> tuple[Rule, ...]:
        return collective_rules(self.layout)

    @property
    def algorithms(self) -> tuple[tuple[str, str], ...]:
        """(name, algorithm) of the reductions not sent one-shot, by name: the kernel's input
        (`MegakernelOptions.reductions`)."""
        return tuple(sorted((r.name, r.algorithm) for r in self.reductions
                            if r.algorithm != ONE_SHOT))

    @property
    def reasons(self) -> tuple[tuple[str, str], ...]:
        """(name, why its algorithm) of every reduction, by name."""
        return tuple(sorted((r.name, r.reason) for r in self.reductions))

    def reduction(self, name: str) -> Reduction | None:
        return next((r for r in self.reductions if r.name == name), None)

    def algorithm(self, name: str) -> str:
        """How the reduction `name` is sent (one-shot when it is not a reduction of the plan)."""
        found = self.reduction(name)
        return found.algorithm if found else ONE_SHOT


def check_wire(wire: str) -> None:
    if wire not in WIRES:
        raise ValueError(f"wire={wire!r} is invalid: one of {WIRES}")


@functools.lru_cache(maxsize=256)
def sharding_plan(lay: layouts.Layout, batch: int = 1, wire: str = "f32",
                  chip: str | None = "tpu7x", inter: links.Interconnect | None = None
                  ) -> ShardingPlan:
    """The plan of `lay` at `batch`: each reduction by the algorithm the interconnect model of
    `chip`'s slice prices fastest for its payload (`interconnect.choose`), with the slice's
    hosts. chip None: every reduction one-shot on one host (what a kernel built without a chip's
    choice sends)."""
    check_wire(wire)
    found = reductions(lay)
    if chip is None or not found:
        return ShardingPlan(lay, batch, wire, found)
    inter = inter or links.interconnect(chip, n_ranks=lay.n_ranks)
    chosen = []
    for r in found:
        if r.scatter:  # one phase, the kernel's only way to send it
            chosen.append(r)
            continue
        c = links.choose(inter, "all_reduce", tuple(range(lay.n_ranks)),
                         float(r.payload_bytes(batch, wire)))
        if c.algorithm not in REDUCTION_ALGORITHMS:
            raise ValueError(f"{r.name}: the choice {c.algorithm!r} is not one the kernel sends")
        chosen.append(dataclasses.replace(r, algorithm=c.algorithm, reason=c.reason))
    return ShardingPlan(lay, batch, wire, tuple(chosen),
                        links.ranks_per_host(inter, lay.n_ranks), chip)


def with_algorithms(lay: layouts.Layout, batch: int, wire: str, algorithms: tuple,
                    ranks_per_host: int = 0) -> ShardingPlan:
    """The plan with the algorithms given ((name, algorithm) pairs; the rest one-shot): how a
    kernel's options (`MegakernelOptions.reductions`, `.ranks_per_host`, checked by
    `megakernel_plan.check_options`) read back as a plan. ValueError naming a reduction that is
    not one of the step's."""
    check_wire(wire)
    found = reductions(lay)
    unknown = sorted({name for name, _ in algorithms} - {r.name for r in found})
    if unknown:
        raise ValueError(f"reductions={algorithms!r} is invalid: {unknown} are not reductions of "
                         f"this step (those are {sorted(r.name for r in found)})")
    scattered = sorted({name for name, _ in algorithms} & {r.name for r in found if r.scatter})
    if scattered:
        raise ValueError(f"reductions={algorithms!r} is invalid: {scattered} are one-phase "
                         "reduce-scatters (restructured), sent no other way")
    given = dict(algorithms)
    return ShardingPlan(lay, batch, wire, tuple(
        dataclasses.replace(r, algorithm=given.get(r.name, ONE_SHOT)) for r in found),
        ranks_per_host)
