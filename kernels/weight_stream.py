"""The megakernel's global weight stream: one sequence of weight blocks through one VMEM ring,
across stage and layer boundaries.

Every layer streams a static sequence of weight blocks per stage kind:

    attention  KDA: w_fa w_fb w_q w_k w_v w_g [w_b] w_o      MLA: w_qa w_qb w_kva w_g [w_kvb] w_o
    FFN        dense: w_gate w_up w_down                     MoE: [w_router] w_ld w_lu w_sg w_su w_sd

(in the order the stage bodies call `blocks.stream_matmul`; matrices whose N is not a multiple of
128 lanes, like KDA's w_b [d, H], stay on the body's own two-slot ring). While the megakernel
traces, `blocks.stream_matmul` asks this stream first: block g of a stage is waited for in ring
slot (base + g) mod depth, and block g + depth - 1 of the *continued* sequence is started first.
When that block lies past the end of the stage, it is the next stage's: the FFN of this layer
after attention, the attention of the next layer after the FFN. Which kind (KDA or MLA, dense or
MoE) is read from the SMEM layer table, so the prefetch is a `pl.when` per kind. So while a stage
computes, the next stage's and the next layer's first blocks are already in flight.

The ring is `cfg.ring_depth` slots of [R, C] bf16: C the widest streamed N, R = cfg.ring_block_bytes / (2 C)
rows (a multiple of 128, at least 128). A block of a [K, N] matrix is [rows, N] with rows the
largest multiple of 128 dividing K and at most R. At the default 2 MiB these are the stand-alone
stage kernels' blocks (at mini sizes every matrix is one block), so the f32 accumulation order is
theirs. The lookahead may cross at
most one stage boundary: ring_depth - 1 <= the fewest blocks any stage streams (`max_ring_depth`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from mkresearch.kernels import blocks, dma, kda, mla

from mkresearch.config import LANE, ModelConfig
ATTENTION, FFN = ("kda", "mla"), ("dense", "moe")
# The SMEM layer table, a row per layer: what the megakernel's traced layer index selects.
IS_MLA, ATTN_INDEX, IS_MOE, FFN_INDEX = TABLE_FIELDS = range(4)


def layer_table(cfg: ModelConfig) -> tuple[int, ...]:
    """The flattened [n_layers, len(TABLE_FIELDS)] table of int32 for SMEM."""
    rows = []
    for layer in range(cfg.n_layers):
        rows += [int(cfg.is_mla(layer)), cfg.attention_index(layer),
                 int(layer >= cfg.n_dense_layers), cfg.ffn_index(layer)]
    return tuple(rows)


@dataclass(frozen=True)
class Entry:
    """One streamed matrix of a stage: where it lives in the kernel's weight pytree, its DMA-log
    name (the stage body's), its shape and its row blocks."""

    group: str  # "kda" | "mla" | "dense" | "moe"
    key: str
    name: str
    k: int
    n: int
    rows: int

    @property
    def n_blocks(self) -> int:
        return self.k // self.rows


@dataclass(frozen=True)
class StreamPlan:
    depth: int
    slot_shape: tuple[int, int]  # [R, C]
    stages: tuple[tuple[str, tuple[Entry, ...]], ...]  # kind -> entries, in body call order

    def entries(self, kind: str) -> tuple[Entry, ...]:
        return dict(self.stages)[kind]

    def blocks(self, kind: str) -> tuple[tuple[Entry, int], ...]:
        """The stage's block sequence: (entry, row block) in streaming order."""
        return tuple((e, i) for e in self.entries(kind) for i in range(e.n_blocks))

    @property
    def slot_bytes(self) -> int:
        return self.slot_shape[0] * self.slot_shape[1] * 2


def _stage_matrices(cfg: ModelConfig) -> dict[str, list[tuple[str, str, str, tuple[int, int]]]]:
    """kind -> [(group, key, DMA-log name, (K, N))] in the order the stage bodies stream them."""
    d = cfg.d_model
    kda_shapes, mla_shapes = kda.weight_shapes(cfg), mla.weight_shapes(cfg)
    kda_ = [(name, kda_shapes[name]) for name in kda.MATRICES]
    # the latent layout keeps W_kvb whole in VMEM (mla_attention_body), so it is not streamed
    mla_names = ("w_qa", "w_qb", "w_kva", "w_g") + (
        ("w_kvb",) if cfg.mla_cache_layout == "expanded" else ()) + ("w_o",)
    mla_ = [(name, mla_shapes[name]) for name in mla_names]
    moe = [("w_router", "router/w_router", (d, cfg.n_experts)),
           ("w_ld", "latent/w_ld", (d, cfg.moe_latent)), ("w_lu", "latent/w_lu", (cfg.moe_latent, d))]
    if cfg.n_shared_experts:
        moe += [("w_sg", "shared/w_gate", (d, cfg.shared_hidden)),
                ("w_su", "shared/w_up", (d, cfg.shared_hidden)),
                ("w_sd", "shared/w_down", (cfg.shared_hidden, d))]
    dense = [("w_gate", "dense/w_gate", (d, cfg.dense_hidden)),
             ("w_up", "dense/w_up", (d, cfg.dense_hidden)),
             ("w_down", "dense/w_down", (cfg.dense_hidden, d))]
    return {"kda": [("kda", k, f"kda.{k}", s) for k, s in kda_],
            "mla": [("mla", k, f"mla.{k}", s) for k, s in mla_],
            "dense": [("dense", k, name, s) for k, name, s in dense],
            "moe": [("moe", k, name, s) for k, name, s in moe]}


def make_stream_plan(cfg: ModelConfig) -> StreamPlan:
    """The ring (cfg.ring_depth slots of [R, C], R · C · 2 <= cfg.ring_block_bytes unless R is the
    minimum 128) and every stage's blocks."""
    depth, block_bytes = cfg.ring_depth, cfg.ring_block_bytes
    streamed = {kind: [m for m in ms if m[3][1] % LANE == 0]
                for kind, ms in _stage_matrices(cfg).items()}
    width = max(shape[1] for ms in streamed.values() for *_, shape in ms)  # C
    slot_rows = max(LANE, block_bytes // (2 * width) // LANE * LANE)  # R
    stages = []
    for kind, ms in streamed.items():
        entries = []
        for group, key, name, (k, n) in ms:
            rows = blocks.weight_block_rows((k, n), jnp.bfloat16, block_rows=slot_rows)
            entries.append(Entry(group, key, name, k, n, rows))
        stages.append((kind, tuple(entries)))
    max_rows = max(e.rows for _, es in stages for e in es)
    return StreamPlan(depth=depth, slot_shape=(max_rows, width), stages=tuple(stages))


def max_ring_depth(cfg: ModelConfig) -> int:
    """The deepest ring (at cfg.ring_block_bytes) whose lookahead, ring_depth - 1 blocks, crosses
    at most one stage boundary: 1 + the fewest blocks any stage streams."""
    plan = make_stream_plan(cfg.replace(ring_depth=2))
    return 1 + min(len(plan.blocks(kind)) for kind, _ in plan.stages)


class GlobalStream:
    """The ring while the megakernel traces. `stage(kind, layer, index)` brackets one stage body;
    `matmul` is what `blocks.stream_matmul` calls (None for matrices not in the stream)."""

    def __init__(self, plan: StreamPlan, ring_ref: Any, sems_ref: Any, base_smem: Any,
                 weights: dict, table_smem: Any, n_layers: int) -> None:
        self.plan, self.ring, self.sems, self.base = plan, ring_ref, sems_ref, base_smem
        self.weights, self.table, self.n_layers = weights, table_smem, n_layers
        self.kind = None

    # -- the layer table: kind and index within its kind of a (traced) layer ---------------------
    def _row(self, layer, column):
        return self.table[layer * len(TABLE_FIELDS) + column]

    def _kinds(self, layer, attention: bool):
        """((kind, predicate, index within kind), ...) for the attention or the FFN of `layer`."""
        if attention:
            is_mla, index = self._row(layer, IS_MLA), self._row(layer, ATTN_INDEX)
            return (("kda", is_mla == 0, index), ("mla", is_mla == 1, index))
        is_moe, index = self._row(layer, IS_MOE), self._row(layer, FFN_INDEX)
        return (("dense", is_moe == 0, index), ("moe", is_moe == 1, index))

    # -- DMAs ------------------------------------------------------------------------------------
    def _copy(self, kind: str, position: int, index, base, layer) -> dma.Copy:
        entry, block = self.plan.blocks(kind)[position]
        source = self.weights[entry.group][entry.key].at[index]  # [K, N] of this layer
        window = source.at[pl.ds(block * entry.rows, entry.rows), :]
        slot = lax.rem(base + position, self.plan.depth)
        target = self.ring.at[slot, pl.ds(0, entry.rows), pl.ds(0, entry.n)]
        return dma.Copy(window, target, self.sems.at[slot], name=entry.name, slot=slot,
                        block=block, layer=layer)

    def _start_ahead(self, target: int) -> None:
        """Start block `target` of the sequence continuing from the current stage's block 0."""
        kind, length = self.kind, len(self.plan.blocks(self.kind))
        if target < length:
            self._copy(kind, target, self.index, self.base[0], self.layer).start()
            return
        position, base = target - length, lax.rem(self.base[0] + length, self.plan.depth)
        if kind in ATTENTION:  # next: this layer's FFN
            layer, guard = self.layer, True
            options = self._kinds(layer, attention=False)
        else:  # next: the next layer's attention (none after the last layer)
            layer = jnp.minimum(self.layer + 1, self.n_layers - 1)
            guard = self.layer + 1 < self.n_layers
            options = self._kinds(layer, attention=True)
        for next_kind, predicate, index in options:
            @pl.when(jnp.logical_and(guard, predicate))
            def _(next_kind=next_kind, index=index):
                self._copy(next_kind, position, index, base, layer).start()

    def prologue(self) -> None:
        """Before the layer loop: the first depth - 1 blocks of layer 0's attention."""
        self.base[0] = 0
        for kind, predicate, index in self._kinds(0, attention=True):
            for position in range(self.plan.depth - 1):
                @pl.when(predicate)
                def _(kind=kind, position=position, index=index):
                    self._copy(kind, position, index, 0, 0).start()

    # -- a stage ---------------------------------------------------------------------------------
    def stage(self, kind: str, layer, index) -> _Stage:
        return _Stage(self, kind, layer, index)

    def matmul(self, x: jax.Array, w_hbm: Any, *, rows: int, name: str, **indices: Any):
        """x [M, K] @ the next streamed matrix -> [M, N] f32, or None if `name` is not streamed."""
        del rows, indices  # the stream has its own blocks; the layer tags its DMAs
        if self.kind is None:
            return None
        entries = self.plan.entries(self.kind)
        if name not in {e.name for e in entries}:
            return None  # a narrow matrix: the body's own ring
        entry = entries[self.entry]
        if name != entry.name or tuple(w_hbm.shape) != (entry.k, entry.n):
            raise ValueError(f"the {self.kind} stage body streamed {name!r} {tuple(w_hbm.shape)} "
                             f"where the global weight stream expects {entry.name!r} "
                             f"{(entry.k, entry.n)}: update weight_stream._stage_matrices to the "
                             "body's order")
        self.entry += 1
        acc = jnp.zeros((x.shape[0], entry.n), jnp.float32)
        for block in range(entry.n_blocks):
            position = self.position
            self._start_ahead(position + self.plan.depth - 1)
            copy = self._copy(self.kind, position, self.index, self.base[0], self.layer)
            copy.wait()
            slot = lax.rem(self.base[0] + position, self.plan.depth)
            w_block = self.ring[slot, pl.ds(0, entry.rows), pl.ds(0, entry.n)]  # [rows, N]
            with dma.phase(f"{entry.name}/matmul", flops=2 * x.shape[0] * entry.rows * entry.n,
                           vmem_bytes=entry.rows * entry.n * 2, block=block, layer=self.layer):
                acc += blocks.dot(x[:, block * entry.rows:(block + 1) * entry.rows], w_block)
            self.position += 1
        return acc


class _Stage:
    def __init__(self, stream: GlobalStream, kind: str, layer, index) -> None:
        self.stream, self.kind, self.layer, self.index = stream, kind, layer, index

    def __enter__(self) -> GlobalStream:
        s = self.stream
        s.kind, s.layer, s.index, s.entry, s.position = self.kind, self.layer, self.index, 0, 0
        return s

    def __exit__(self, *exc: object) -> bool:
        s = self.stream
        if exc[0] is None:
            length = len(s.plan.blocks(s.kind))
            if s.position != length:
                raise ValueError(f"the {s.kind} stage streamed {s.position} of its {length} "
                                 "blocks: the global weight stream and the body disagree")
            s.base[0] = lax.rem(s.base[0] + length, s.plan.depth)
        s.kind = None
        return False
