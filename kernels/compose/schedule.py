"""The schedule as data: every DMA one megakernel step will issue, in order, before tracing.

    sched = schedule(plan, positions, expert_ids)  # exact: the step's positions and routing
    sched = schedule(plan)                         # the cost estimate's worst case (assumptions)
    sched.events                  # (PlannedDma, ...): kind, name, src, dst, nbytes, slot, layer,
                                  # stage, buffer, indices
    sched.mismatch(log)           # None when a recorded DMA log is this schedule, event for event
    sched.late_prefetches()       # where the weight stream would not run ahead
    sched.summary()               # DMAs and bytes per stage, layer kind, buffer; ring; VMEM plan

The DMAs depend on data in two places only: the MLA KV tiles a row reads (from its position) and
the routed experts a MoE layer fetches (the distinct experts of the batch, ascending id). Given
the step's positions and routing (`expert_ids` [n_routed_layers, B, k], e.g. the reference's
aux["expert_ids"]) the schedule is exact; without them it takes `kernels/base/costs.py`'s worst case
and says so in `assumptions`: every row at the last position, min(E, B·k) distinct experts.

Data and code. The schedule is composed from the same static data the kernel runs: the plan
(`MegaPlan`: the stage plans, the layer table, the ring's `StreamPlan`, the VMEM plan), the
prepared weights' and the state's shapes (the kernel's Refs), the residual strategy's vectors,
EMBED_ROWS. What each piece of kernel code does with them is still code: the trunk below mirrors
`megakernel_body`, and every DMA-issuing piece has its twin beside it, stating the same order as
data (`registry.KernelStage.schedule` of each kind, `weight_stream.RingSchedule`,
`blocks.ring_matmul_dmas`, `kv_tiles.tile_loop_dmas`, ...). tests/test_schedule.py holds the
twins to the recorded DMA log, event for event.
"""

from __future__ import annotations

import bisect
import functools
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import jax
import numpy as np
from mkresearch.kernels.base import blocks, costs, planned, registry
from mkresearch.kernels.base.planned import PlannedDma, StageCall
from mkresearch.kernels.base.weight_stream import (
    ATTN_INDEX,
    ATTN_KIND,
    FFN_INDEX,
    FFN_KIND,
    TABLE_FIELDS,
    RingSchedule,
)
from mkresearch.kernels.compose import megakernel, megakernel_sharded
from mkresearch.kernels.compose.megakernel_plan import EMBED_ROWS, MegaPlan
from mkresearch.kernels.stages import gate_up, residuals, sampling

from mkresearch.model import spec
from mkresearch.sharding import layout_split

TRUNK_STAGES = ("embedding", "residual", "sampling")  # the stages of the trunk, in step order
WEIGHT_BUFFERS = (planned.WEIGHT_RING, planned.LOCAL_RING)  # a stage's streamed weight blocks


# ---- the step's data: positions and routing ----------------------------------------------------
def routed_layers(plan: MegaPlan) -> tuple[int, ...]:
    """The layers whose FFN routes to experts (expert_ids[i] is the routing of the i-th)."""
    return tuple(layer for layer, (_, ffn) in enumerate(plan.cfg.layers)
                 if spec.stage(ffn).routed)


def _positions(plan: MegaPlan, positions: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    batch, seq_len = plan.batch, plan.seq_len
    if positions is None:
        return (seq_len - 1,) * batch, (
            f"every row at the last position {seq_len - 1}: each row reads its whole cache",)
    values = np.asarray(positions)
    if values.shape != (batch,) or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"positions has shape {values.shape} ({values.dtype}): expected [B="
                         f"{batch}] ints, each row's position")
    if values.min() < 0 or values.max() >= seq_len:
        raise ValueError(f"positions={values.tolist()} is invalid: each in [0, {seq_len})")
    return tuple(int(v) for v in values), ()


def _routing(plan: MegaPlan, expert_ids: Any) -> tuple[dict[int, np.ndarray], tuple[str, ...]]:
    """layer -> its routing [B, k], and the assumption made if none was given."""
    cfg, batch, layers = plan.cfg, plan.batch, routed_layers(plan)
    shape = (len(layers), batch, cfg.top_k)
    if expert_ids is None:
        fetched = min(cfg.n_experts, batch * cfg.top_k)
        worst = np.arange(batch * cfg.top_k).reshape(batch, cfg.top_k) % cfg.n_experts
        note = (f"{fetched} distinct experts per routed layer, min(E={cfg.n_experts}, "
                f"B·k={batch * cfg.top_k}): no two choices share one")
        return {layer: worst for layer in layers}, (note,) if layers else ()
    ids = np.asarray(expert_ids)
    if ids.shape != shape or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"expert_ids has shape {ids.shape} ({ids.dtype}): expected {list(shape)} "
                         "ints, the routing of each routed layer (the reference's "
                         "aux['expert_ids'])")
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.n_experts):
        raise ValueError(f"expert_ids is invalid: each in [0, n_experts={cfg.n_experts}), got "
                         f"[{ids.min()}, {ids.max()}]")
    return dict(zip(layers, ids)), ()


# ---- the schedule --------------------------------------------------------------------------------
def schedule(plan: MegaPlan, positions: Any = None, expert_ids: Any = None, *,
             operands: tuple | None = None, live: dict | None = None) -> StepSchedule:
    """Every DMA the megakernel step of `plan` issues, in order (see the module docstring).
    positions [B]; expert_ids [n_routed_layers, B, k]; either None: the worst case. operands:
    (prepared weights, state) shape structs of the kernel's Refs when they are not those of
    plan.cfg: one rank of the sharded megakernel (its slices of W_o, W_lu, ..., `rank_operands`);
    live: that rank's ring matrices it skips, {name: False} (`rank_live`)."""
    if not isinstance(plan, MegaPlan):
        raise ValueError(f"plan={plan!r} is invalid: a MegaPlan (megakernel_plan.make_plan)")
    cfg, batch = plan.cfg, plan.batch
    rows, row_note = _positions(plan, positions)
    routing, routing_note = _routing(plan, expert_ids)
    # the kernel's operands, shapes only
    prepared, state = megakernel.step_shapes(plan)[1:] if operands is None else operands
    residual = residuals.RESIDUALS[cfg.residual]
    ring = (RingSchedule(plan.stream, plan.layer_table, cfg.n_layers, live)
            if plan.stream is not None else None)

    def trunk(stage, layer=None):
        return StageCall(stage, layer, 0, batch, prepared, {}, rows, None, None)

    # 1. each token's aligned 16-row embedding block, all started, then waited for; the ring's
    # first blocks
    embed, call = prepared["embed"], trunk("embedding")  # embed [V, d]
    block = planned.nbytes((EMBED_ROWS, embed.shape[1]), embed.dtype)
    started = [call.start("embed", block, buffer=planned.EMBEDDING, row=b) for b in range(batch)]
    events = started + [dma.waited() for dma in started] + (ring.prologue() if ring else [])
    # 2. the layers: the residual strategy's vectors, then the two stages the table selects
    kinds = {kind: (costs.per_layer(prepared[kind]), costs.per_layer(state.get(kind, {})))
             for kind in cfg.kinds}
    for layer in range(cfg.n_layers):
        call = trunk("residual", layer)
        vectors = [call.start(name, planned.nbytes(costs.per_layer(prepared[name])),
                              buffer=planned.LAYER_VECTORS, layer=layer)
                   for name in residual.vectors]
        events += vectors + [dma.waited() for dma in vectors]
        row = layer * len(TABLE_FIELDS)
        for stage_kinds, kind_column, index_column in ((plan.attention_kinds, ATTN_KIND, ATTN_INDEX),
                                                       (plan.ffn_kinds, FFN_KIND, FFN_INDEX)):
            kind = stage_kinds[plan.layer_table[row + kind_column]]
            stage = registry.kernel_stage(kind)
            if stage.schedule is None:
                raise ValueError(f"stage kind {kind!r} states no schedule: give its KernelStage a "
                                 "schedule function (registry.KernelStage.schedule)")
            stream = ring.stage(kind, layer) if ring else blocks.LOCAL_RING_SCHEDULE
            events += stage.schedule(plan.stage_plan(kind), StageCall(
                kind, layer, plan.layer_table[row + index_column], batch, *kinds[kind], rows,
                routing.get(layer), stream))
            if ring:
                stream.close()
    # 3. the head: the final mix and norm vectors, then the LM head tiles
    call = trunk("sampling")
    head = [call.start(name, planned.nbytes(prepared[name]), buffer=planned.HEAD_VECTORS)
            for name in residual.head_vectors]
    events += head + [dma.waited() for dma in head]
    events += sampling.lm_head_dmas(call, prepared["lm_head"], plan.vocab_tile)
    return StepSchedule(plan, tuple(events), rows, row_note + routing_note)


def rank_operands(plan: Any) -> tuple:
    """(prepared weights, state) shape structs of one rank of a sharded megakernel build
    (`megakernel_sharded.ShardedPlan`): what `schedule(plan.mega, operands=...)` streams, every
    rank's slices having one shape."""
    _, weights, state = megakernel_sharded.step_shapes(plan)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), (weights, state))


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
