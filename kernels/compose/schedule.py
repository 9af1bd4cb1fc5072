"""The schedule as data: every DMA one megakernel step will issue, in order, before it runs.

    sched = schedule(plan, positions, expert_ids)  # exact: the step's positions and routing
    sched = schedule(plan)                         # the cost estimate's worst case (assumptions)
    sched = schedule(sharded_plan, rank=r)         # one rank of a sharded build (its DMAs)
    sched.events                  # (PlannedDma, ...): kind, name, src, dst, nbytes, slot, layer,
                                  # stage, buffer, indices
    sched.mismatch(log)           # None when a recorded DMA log is this schedule, event for event
    sched.late_prefetches()       # where the weight stream would not run ahead
    sched.summary()               # DMAs and bytes per stage, layer kind, buffer; ring; VMEM plan

The schedule is not written down a second time: it is the kernel itself run on shapes
(`kernels/base/dry_run.py`). The step's `pallas_call` is traced as it is built, every
`dma.Copy` also tracing its planned event, and the traced program is run with only its scalar
work computed: loop counters, slots, conditions, the positions and the layer table. So every
stage body, the global weight ring and the trunk state their DMAs once, by issuing them.

The DMAs depend on data in two places only: the KV tiles a row reads (from its position) and the
routed experts a MoE layer fetches (the distinct experts of the batch, ascending id). Given the
step's positions and routing (`expert_ids` [n_routed_layers, B, k], e.g. the reference's
aux["expert_ids"]) the schedule is exact; without them it takes the cost estimate's worst case
and says so in `assumptions`: every row at the last position, min(E, B·k) distinct experts.
A rank of a sharded build also reads the tokens: the rank holding a row's vocabulary row
fetches its embedding block.
"""

from __future__ import annotations

import bisect
import functools
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import jax
import numpy as np
from mkresearch.kernels.base import costs, dry_run, input_checks, planned
from mkresearch.kernels.base.planned import PlannedDma
from mkresearch.kernels.compose import megakernel, megakernel_sharded
from mkresearch.kernels.compose.megakernel_plan import (
    MegaPlan,
    routed_layers,
    routing_by_layer,
)
from mkresearch.kernels.stages import gate_up, router

from mkresearch.model import spec
from mkresearch.sharding import layout_split

TRUNK_STAGES = ("embedding", "residual", "sampling")  # the stages of the trunk, in step order
WEIGHT_BUFFERS = (planned.WEIGHT_RING, planned.LOCAL_RING)  # a stage's streamed weight blocks


# ---- the step's data: positions and routing ----------------------------------------------------
def _positions(plan: MegaPlan, positions: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    batch, seq_len = plan.batch, plan.seq_len
    if positions is None:  # the cost estimate's worst case (`costs.worst_positions`)
        return tuple(costs.worst_positions(batch, seq_len).tolist()), (
            f"every row at the last position {seq_len - 1}: each row reads its whole cache",)
    values = np.asarray(positions)
    if values.shape != (batch,) or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"positions has shape {values.shape} ({values.dtype}): expected [B="
                         f"{batch}] ints, each row's position")
    input_checks.check_each_in("positions", values, seq_len)
    return tuple(int(v) for v in values), ()


def _routing(plan: MegaPlan, expert_ids: Any) -> tuple[dict[int, np.ndarray], tuple[str, ...]]:
    """layer -> its routing [B, k], and the assumption made if none was given."""
    cfg, batch, layers = plan.cfg, plan.batch, routed_layers(plan)
    if expert_ids is None:
        fetched = min(cfg.n_experts, batch * cfg.top_k)
        worst = router.worst_routing(cfg.n_experts, batch, cfg.top_k)
        note = (f"{fetched} distinct experts per routed layer, min(E={cfg.n_experts}, "
                f"B·k={batch * cfg.top_k}): no two choices share one")
        return {layer: worst for layer in layers}, (note,) if layers else ()
    return routing_by_layer(plan, expert_ids), ()


# ---- the schedule --------------------------------------------------------------------------------
def schedule(plan: Any, positions: Any = None, expert_ids: Any = None, *, rank: int | None = None,
             tokens: Any = None) -> StepSchedule:
    """Every DMA the megakernel step of `plan` issues, in order (see the module docstring).
    positions [B]; expert_ids [n_routed_layers, B, k]; either None: the worst case. plan: a
    MegaPlan, or a sharded build's `ShardedPlan` with the `rank` whose DMAs to list (its own
    slices; the embedding block of a row is fetched by the rank holding the row's token:
    tokens [B], None: token 0 in every row)."""
    sharded = _sharded(plan, rank)
    mega = sharded.mega if sharded is not None else plan
    if not isinstance(mega, MegaPlan):
        raise ValueError(f"plan={plan!r} is invalid: a MegaPlan (megakernel_plan.make_plan) or "  # noqa: TRY004
                         "a ShardedPlan (megakernel_sharded.make_sharded_plan)")
    rows, row_note = _positions(mega, positions)
    routing, routing_note = _routing(mega, expert_ids)
    token_note = ()
    if tokens is None:
        tokens = np.zeros(mega.batch, np.int32)
        token_note = ("token 0 in every row (a rank fetches the embedding rows it holds)",
                      ) if sharded is not None else ()
    inputs = {megakernel.STEP_INPUTS["tokens"]: np.asarray(tokens, np.int32),
              megakernel.STEP_INPUTS["positions"]: np.asarray(rows, np.int32),
              megakernel.STEP_INPUTS["table"]: np.asarray(mega.layer_table, np.int32)}
    events = dry_run.run(_traced(mega, sharded), inputs, rank=rank,
                         given={router.ROUTING: lambda layer: routing[layer]})
    return StepSchedule(mega, tuple(events), rows, row_note + routing_note + token_note)


def _sharded(plan: Any, rank: int | None) -> Any:
    """The ShardedPlan if `plan` is one (ValueError unless rank is one of its ranks)."""
    if not isinstance(plan, megakernel_sharded.ShardedPlan):
        if rank is not None:
            raise ValueError(f"rank={rank!r} is invalid for a single-device plan: None")
        return None
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.n_ranks:
        raise ValueError(f"rank={rank!r} is invalid: an int in [0, {plan.n_ranks}) (the rank "
                         "whose DMAs to list)")
    return plan


def _traced(plan: MegaPlan, sharded: Any) -> dry_run.Kernel:
    """The step's kernel traced for dry runs (`megakernel.traced_step`: one trace per plan, its
    schedules differing only in data)."""
    inputs, weights, state = megakernel.step_shapes(plan)
    if sharded is not None:  # one rank's slices, every rank's having one shape
        _, weights, state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype),
                                         megakernel_sharded.step_shapes(sharded))
    return megakernel.traced_step(plan, inputs, weights, state,
                                  shard=None if sharded is None else sharded.shard)


def rank_live(plan: Any, rank: int) -> dict:
    """{ring matrix name: False} for the matrices of which `rank` of a sharded build holds only
    padding in partial-sum mode: it skips their DMAs (`Collectives.live`)."""
    lay = plan.layout
    if lay.collectives == "exact" or plan.mega.stream is None:
        return {}
    return {e.name: False for _, entries in plan.mega.stream.stages for e in entries
            if layout_split.zero_only(lay, spec.stage(e.group).params(lay.cfg)[
                gate_up.param_key(e.key)], rank)}


@dataclass(frozen=True)
class Tally:
    """DMAs (starts) and the bytes they move: HBM read, HBM written, other (VMEM -> SMEM)."""

    dmas: int = 0
    read: int = 0
    written: int = 0
    other: int = 0

    @staticmethod
    def of(dmas) -> Tally:
        counts = [0, 0, 0, 0]
        for dma in dmas:
            counts[0] += 1
            counts[3 if not dma.hbm else 2 if dma.written else 1] += dma.nbytes
        return Tally(*counts)


def component(dma: PlannedDma) -> str | None:
    """The roofline component (`roofline.step_bytes`) whose bytes a DMA moves; None off HBM."""
    if not dma.hbm:
        return None
    trunk = {planned.EMBEDDING: "embedding_rows", planned.LAYER_VECTORS: "norms_and_mix",
             planned.HEAD_VECTORS: "norms_and_mix", planned.LM_HEAD_TILES: "lm_head"}
    if dma.buffer in trunk:
        return trunk[dma.buffer]
    kind = spec.stage(dma.stage)
    if dma.buffer in planned.STATE_BUFFERS:
        return kind.state_component[0]
    if dma.buffer == planned.EXPERT_SLOTS:
        return kind.routed_component[0]
    return kind.component[0]


@dataclass(frozen=True)
class StepSchedule:
    """The ordered DMAs of one step of `plan` (schedule()), its VMEM plan (plan.vmem), and what
    was assumed where data decides (empty: exact)."""

    plan: MegaPlan
    events: tuple[PlannedDma, ...]
    positions: tuple[int, ...]
    assumptions: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return not self.assumptions

    @property
    def vmem(self) -> Any:
        return self.plan.vmem

    @functools.cached_property
    def starts(self) -> tuple[PlannedDma, ...]:
        """The DMAs (each event pair's start)."""
        return tuple(dma for dma in self.events if dma.kind == "dma_start")

    def tally(self, key) -> dict[Any, Tally]:
        """The DMAs (starts) grouped by key(dma), in order of first appearance."""
        groups: dict[Any, list] = {}
        for dma in self.starts:
            groups.setdefault(key(dma), []).append(dma)
        return {group: Tally.of(dmas) for group, dmas in groups.items()}

    @functools.cached_property
    def total(self) -> Tally:
        return Tally.of(self.starts)

    def layer_kind(self, dma: PlannedDma) -> str:
        """"attention+ffn" kinds of the DMA's layer (the trunk outside the layers: its stage)."""
        return dma.stage if dma.layer is None else self._layer_kinds[dma.layer]

    @functools.cached_property
    def _layer_kinds(self) -> tuple[str, ...]:
        return tuple("+".join(pair) for pair in self.plan.cfg.layers)

    def experts_fetched(self) -> dict[int, int]:
        """layer -> experts its FFN fetched (the expert loop's items)."""
        items: dict[int, set] = defaultdict(set)
        for dma in self.starts:
            if dma.buffer == planned.EXPERT_SLOTS:
                items[dma.layer].add(dict(dma.indices)["item"])
        return {layer: len(found) for layer, found in items.items()}

    # -- checks ------------------------------------------------------------------------------------
    def mismatch(self, log: Any) -> str | None:
        """None when the DMA events of a recorded log (`dma.recording()`) are this schedule's,
        event for event (kind, name, src, dst, nbytes, slot, indices); else the first difference."""
        recorded = [planned.log_key(e) for e in log.events if e.kind in planned.DMA_KINDS]
        expected = [dma.log_key() for dma in self.events]
        for i, (want, got) in enumerate(zip(expected, recorded)):
            if want != got:
                return f"DMA {i} of {len(expected)}: planned {want}, recorded {got}"
        if len(expected) != len(recorded):
            extra = (expected if len(expected) > len(recorded) else recorded)[min(len(expected),
                                                                                  len(recorded))]
            return (f"planned {len(expected)} DMAs, recorded {len(recorded)}; the first unmatched "
                    f"is {extra}")
        return None

    def late_prefetches(self) -> dict[str, list[int]]:
        """Where the weight stream does NOT run ahead (empty lists: it always does).

        ffn: layers whose FFN's first weight block is not started before the attention's last
        weight block is waited for (an FFN with no block on the global ring is not checked); next_layer: layers l whose layer l+1's first attention
        block is not started before l's FFN waits for its last one; experts: routed layers
        whose first expert DMA does not come right after routing, before the stage waits for
        its next weight block (the latent down-projection)."""
        first, last = {}, {}
        weight_waits: dict[tuple, list[int]] = defaultdict(list)
        for i, dma in enumerate(self.events):
            group = ("weights" if dma.buffer in WEIGHT_BUFFERS else dma.buffer)
            key = (dma.kind, dma.stage, dma.layer, group)
            first.setdefault(key, i)
            last[key] = i
            if group == "weights" and dma.kind == "dma_wait":
                weight_waits[dma.stage, dma.layer].append(i)
        layers = self.plan.cfg.layers
        never = len(self.events)
        late = {"ffn": [], "next_layer": [], "experts": []}
        stream = self.plan.stream
        for layer, (attention, ffn) in enumerate(layers):
            ffn_first = first.get(("dma_start", ffn, layer, "weights"), never)
            # an FFN with no block on the global ring cannot be prefetched (its ring is local)
            on_ring = stream is None or bool(stream.blocks(ffn))
            if on_ring and ffn_first > last.get(("dma_wait", attention, layer, "weights"), never):
                late["ffn"].append(layer)
            if layer + 1 < len(layers):
                next_first = first.get(("dma_start", layers[layer + 1][0], layer + 1, "weights"),
                                       never)
                if next_first > last.get(("dma_wait", ffn, layer, "weights"), never):
                    late["next_layer"].append(layer)
            routed = ("dma_wait", ffn, layer, planned.ROUTING)
            expert = first.get(("dma_start", ffn, layer, planned.EXPERT_SLOTS))
            if routed in last and expert is not None:
                waits = weight_waits[ffn, layer]
                k = bisect.bisect(waits, last[routed])  # the first weight wait after routing
                if expert > (waits[k] if k < len(waits) else never):
                    late["experts"].append(layer)
        return late

    # -- the summary -------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """A JSON-able summary: DMAs and bytes per stage kind, layer kind, buffer and roofline
        component; the ring, the expert slots, the KV tile; the VMEM plan; the assumptions."""
        plan, cfg = self.plan, self.plan.cfg
        stream = plan.stream
        layer_counts = defaultdict(int)
        for pair in cfg.layers:
            layer_counts["+".join(pair)] += 1

        def table(groups, counts=None):
            return {str(k): {**({"layers": counts[k]} if counts and k in counts else {}),
                             **asdict(v)} for k, v in groups.items()}

        vmem = plan.vmem
        return {
            "model": cfg.name, "batch": plan.batch, "seq_len": plan.seq_len,
            "chip": plan.options.chip, "mla_cache_layout": cfg.mla_cache_layout,
            "expert_format": cfg.expert_format, "exact": self.exact,
            "assumptions": list(self.assumptions), "positions": list(self.positions),
            "dmas": self.total.dmas, "events": len(self.events),
            "hbm_bytes": {"read": self.total.read, "written": self.total.written,
                          "total": self.total.read + self.total.written},
            "ring": None if stream is None else {
                "depth": stream.depth, "slot_shape": list(stream.slot_shape),
                "slot_bytes": stream.slot_bytes,
                "blocks_per_stage": {kind: len(stream.blocks(kind)) for kind, _ in stream.stages}},
            "expert_slots": plan.options.expert_slots, "expert_plan": plan.options.expert_plan,
            "experts_fetched": {str(k): v for k, v in self.experts_fetched().items()},
            "kv_tile": plan.options.kv_tile or cfg.kv_tile, "vocab_tile": plan.vocab_tile,
            "by_stage": table(self.tally(lambda dma: dma.stage)),
            "by_layer_kind": table(self.tally(self.layer_kind), layer_counts),
            "by_buffer": table(self.tally(lambda dma: dma.buffer)),
            "by_component": table({k: v for k, v in self.tally(component).items()
                                   if k is not None}),
            "late_prefetches": self.late_prefetches(),
            "vmem": {"chip": vmem.chip, "total_bytes": vmem.total_bytes,
                     "limit_bytes": vmem.limit_bytes, "fits": vmem.fits(),
                     "peak_stage": vmem.peak_stage,
                     "buffers": [asdict(b) for b in vmem.buffers]},
        }

