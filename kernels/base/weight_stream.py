"""The megakernel's global weight stream: one sequence of weight blocks through one VMEM ring,
across stage and layer boundaries.

Every layer streams a static sequence of weight blocks per stage kind: the matrices its body
multiplies, in the body's order, as its kernel registry entry lists them (`KernelStage.streamed`):

    attention  KDA: w_fa w_fb w_q w_k w_v w_g [w_b] w_o      MLA: w_qa w_qb w_kva w_g [w_kvb] w_o
    FFN        dense: w_gate w_up w_down                     MoE: w_router w_ld w_sg w_su w_sd w_lu

Matrices whose N is not a multiple of 128 lanes (KDA's w_b [d, H], the router at mini sizes) stay
on a local two-slot ring. A stage body draws its blocks from the stream it is given
(`GlobalStream.stage(kind, layer, index)`): block g of the stage is waited for in ring slot
(base + g) mod depth, and block g + depth - 1 of the *continued* sequence is started first. When
that block lies past the end of the stage, it is the next stage's: the FFN of this layer after
attention, the attention of the next layer after the FFN. Which kind is read from the SMEM layer
table, so the prefetch is a `pl.when` per kind. So while a stage computes, the next stage's and
the next layer's first blocks are already in flight.

The ring is `cfg.ring_depth` slots of [R, C] bf16: C the widest streamed N, R = cfg.ring_block_bytes
/ (2 C) rows (a multiple of 128, at least 128). A block of a [K, N] matrix is [rows, N] with rows
the largest multiple of 128 dividing K and at most R. At the default 2 MiB these are the
stand-alone stage kernels' blocks (at mini sizes every matrix is one block), so the f32
accumulation order is theirs. The lookahead may cross at most one stage boundary:
ring_depth - 1 <= the fewest blocks any stage streams (`max_ring_depth`).

Each block's DMA names the stage and layer it belongs to (`dma.Copy(owner=...)`: a block started
ahead is the next stage's), so the step's schedule (`kernels/compose/schedule.py`) groups it there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from mkresearch.kernels.base import blocks, dma, planned
from mkresearch.kernels.base.registry import kernel_stage

from mkresearch.model.config import LANE, ModelConfig

# The SMEM layer table, a row per layer: what the megakernel's traced layer index selects. A kind
# id indexes the model's attention (or FFN) kinds in `stage_kinds` order.
ATTN_KIND, ATTN_INDEX, FFN_KIND, FFN_INDEX = TABLE_FIELDS = range(4)


def stage_kinds(cfg: ModelConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(attention kinds, FFN kinds) of the model, each in the order of first use."""
    return tuple(dict.fromkeys(cfg.attention_kinds)), tuple(dict.fromkeys(cfg.ffn_kinds))


def kind_table(pattern: Sequence[str], kinds: Sequence[str]) -> tuple[int, ...]:
    """[kind id, index within the kind's stacked weights] per layer of `pattern` (each layer's
    kind, in order), flattened: what a megakernel's layer loop reads from SMEM, a kind id being
    the kind's place in `kinds` (the kernel's `lax.switch` branches). Each kind's weights are
    stacked `[layers of the kind, ...]`, so every kind of `kinds` must have a layer: ValueError
    naming a kind that none uses (an empty stack, which Pallas cannot take as an operand: it
    would fail later in its block padding with a bare ZeroDivisionError) or one of `pattern` that
    `kinds` lacks."""
    kinds, pattern = tuple(kinds), tuple(pattern)
    unused = [kind for kind in kinds if kind not in pattern]
    if unused:
        raise ValueError(f"kind {unused[0]!r} has no layer in the pattern {list(pattern)}: its "
                         f"stacked weights would be empty, which a pallas_call cannot take; "
                         f"drop it from the kinds {list(kinds)} or give it a layer")
    unknown = [kind for kind in pattern if kind not in kinds]
    if unknown:
        raise ValueError(f"kind {unknown[0]!r} of the pattern is not one of the kinds "
                         f"{list(kinds)}: register it (its blocks and body)")
    rows = [(kinds.index(kind), pattern[:layer].count(kind)) for layer, kind in enumerate(pattern)]
    return tuple(value for row in rows for value in row)


def layer_table(cfg: ModelConfig) -> tuple[int, ...]:
    """The flattened [n_layers, len(TABLE_FIELDS)] table of int32 for SMEM: each layer's
    attention row of `kind_table`, then its FFN row."""
    attention, ffn = stage_kinds(cfg)
    attn_rows = kind_table(cfg.attention_kinds, attention)
    ffn_rows = kind_table(cfg.ffn_kinds, ffn)
    return tuple(value for layer in range(cfg.n_layers)
                 for value in (*attn_rows[2 * layer:2 * layer + 2],
                               *ffn_rows[2 * layer:2 * layer + 2]))


@dataclass(frozen=True)
class Entry:
    """One streamed matrix of a stage: where it lives in the kernel's weight pytree, its DMA-log
    name (the stage body's), its shape and its row blocks."""

    group: str  # the stage kind
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
    attention: tuple[str, ...] = ()  # the model's attention kinds (table kind ids)
    ffn: tuple[str, ...] = ()  # and FFN kinds

    def entries(self, kind: str) -> tuple[Entry, ...]:
        return dict(self.stages)[kind]

    def ring_names(self, kind: str) -> frozenset:
        """The DMA-log names of the matrices of `kind` the ring streams (its body streams any
        other through a local ring)."""
        return frozenset(e.name for e in self.entries(kind))

    def blocks(self, kind: str) -> tuple[tuple[Entry, int], ...]:
        """The stage's block sequence: (entry, row block) in streaming order."""
        return tuple((e, i) for e in self.entries(kind) for i in range(e.n_blocks))

    @property
    def slot_bytes(self) -> int:
        return self.slot_shape[0] * self.slot_shape[1] * 2

    @property
    def ffn_transparent(self) -> bool:
        """Every FFN kind streams nothing through the ring (e.g. a MoE whose router is narrower
        than 128 lanes and has no shared experts): attention's lookahead runs on into the next
        layer's attention."""
        return all(not self.blocks(kind) for kind in self.ffn)

    def shortest(self) -> int:
        """The fewest blocks a stage the lookahead crosses streams (FFN kinds left out when
        transparent): ring_depth - 1 may not exceed it."""
        skip = self.ffn if self.ffn_transparent else ()
        return min(len(self.blocks(kind)) for kind, _ in self.stages if kind not in skip)


def streamed_matrices(cfg: ModelConfig) -> dict[str, tuple]:
    """kind -> the matrices its body streams (registry.Streamed), for every kind of the model."""
    return {kind: kernel_stage(kind).streamed(cfg) for kind in cfg.kinds}


def make_stream_plan(cfg: ModelConfig, local: Any = None) -> StreamPlan:
    """The ring (cfg.ring_depth slots of [R, C], R · C · 2 <= cfg.ring_block_bytes unless R is the
    minimum 128) and every stage's blocks. local(kind, (Streamed, ...)) -> (Streamed, ...): the
    matrices one rank streams, in its shapes (the sharded megakernel)."""
    depth, block_bytes = cfg.ring_depth, cfg.ring_block_bytes
    matrices = streamed_matrices(cfg)
    if local is not None:
        matrices = {kind: tuple(local(kind, ms)) for kind, ms in matrices.items()}
    streamed = {kind: [m for m in ms if m.shape[1] % LANE == 0] for kind, ms in matrices.items()}
    width = max(m.shape[1] for ms in streamed.values() for m in ms)  # C
    slot_rows = max(LANE, block_bytes // (2 * width) // LANE * LANE)  # R
    stages = []
    for kind, ms in streamed.items():
        entries = []
        for m in ms:
            rows = blocks.weight_block_rows(m.shape, jnp.bfloat16, block_rows=slot_rows)
            entries.append(Entry(kind, m.key, m.name, *m.shape, rows))
        stages.append((kind, tuple(entries)))
    max_rows = max(e.rows for _, es in stages for e in es)
    attention, ffn = stage_kinds(cfg)
    return StreamPlan(depth=depth, slot_shape=(max_rows, width), stages=tuple(stages),
                      attention=attention, ffn=ffn)


def max_ring_depth(cfg: ModelConfig) -> int:
    """The deepest ring (at cfg.ring_block_bytes) whose lookahead, ring_depth - 1 blocks, crosses
    at most one stage boundary: 1 + the fewest blocks any stage streams."""
    return 1 + make_stream_plan(cfg.replace(ring_depth=2)).shortest()


class GlobalStream:
    """The ring while the megakernel traces. `stage(kind, layer, index)` is the weight stream one
    stage body is given: its `matmul` draws the stage's streamed matrices from the ring (and the
    others from a local ring, blocks.LOCAL_STREAM)."""

    def __init__(self, plan: StreamPlan, ring_ref: Any, sems_ref: Any, base_smem: Any,
                 weights: dict, table_smem: Any, n_layers: int, live: dict | None = None,
                 experts_first: bool = False) -> None:
        self.plan, self.ring, self.sems, self.base = plan, ring_ref, sems_ref, base_smem
        # `MegakernelOptions.expert_reads_first`: a MoE stage holds back the ring's prefetches
        # past its routing point until its experts' first DMAs are issued (`StageStream.hold_after`)
        self.experts_first = experts_first
        self.weights, self.table, self.n_layers = weights, table_smem, n_layers
        # matrix name -> (traced) whether this rank's slice holds real data: a slice that is only
        # padding (a sharded rank's, `Collectives.live`) is neither fetched nor multiplied; its
        # ring slots stay reserved, so every other block keeps its slot
        self.live = live or {}

    def when_live(self, kind: str, position: int, fn: Any) -> None:
        """fn() for block `position` of the stage `kind`, only where its slice is real."""
        live = self.live.get(self.plan.blocks(kind)[position][0].name)
        if live is None:
            fn()
        else:
            pl.when(live)(lambda: [fn(), None][1])  # a cond branch returns nothing

    # -- the layer table: kind and index within its kind of a (traced) layer ---------------------
    def _row(self, layer, column):
        return self.table[layer * len(TABLE_FIELDS) + column]

    def layer_kinds(self, layer, attention: bool):
        """((kind, predicate, index within kind), ...) for the attention or the FFN of `layer`."""
        kinds, kind_col, index_col = ((self.plan.attention, ATTN_KIND, ATTN_INDEX) if attention
                                      else (self.plan.ffn, FFN_KIND, FFN_INDEX))
        kind_id, index = self._row(layer, kind_col), self._row(layer, index_col)
        return tuple((kind, kind_id == i, index) for i, kind in enumerate(kinds))

    # -- DMAs ------------------------------------------------------------------------------------
    def block_copy(self, kind: str, position: int, index, base, layer) -> dma.Copy:
        """The DMA of block `position` of the stage `kind` (the index-th of its kind, in `layer`)
        into its ring slot, the ring's sequence starting at slot `base`."""
        entry, block = self.plan.blocks(kind)[position]
        source = self.weights[entry.group][entry.key].at[index]  # [K, N] of this layer
        window = source.at[pl.ds(block * entry.rows, entry.rows), :]
        slot = lax.rem(base + position, self.plan.depth)
        target = self.ring.at[slot, pl.ds(0, entry.rows), pl.ds(0, entry.n)]
        return dma.Copy(window, target, self.sems.at[slot], name=entry.name, slot=slot,
                        buffer=planned.WEIGHT_RING, owner=(kind, layer), block=block,
                        layer=layer)

    def prologue(self) -> None:
        """Before the layer loop: the first depth - 1 blocks of layer 0's attention."""
        self.base[0] = 0
        for kind, predicate, index in self.layer_kinds(0, attention=True):
            for position in range(self.plan.depth - 1):
                @pl.when(predicate)
                def _(kind=kind, position=position, index=index):
                    self.when_live(kind, position,
                                   lambda: self.block_copy(kind, position, index, 0, 0).start())

    def stage(self, kind: str, layer, index) -> StageStream:
        return StageStream(self, kind, layer, index)


def on_ring(ring_names: frozenset, name: str) -> bool:
    """Whether a stage's matmul of matrix `name` draws its blocks from the global ring (else from
    a local ring of its own, blocks.LOCAL_STREAM)."""
    return name in ring_names


class ShapeStream:
    """A stage's stream on shapes (`kernels/compose/scoped_vmem.py`): what the body allocates as
    under `StageStream`, nothing moved. A matrix on the ring (`ring_names`) allocates nothing in
    the body (its blocks land in the kernel-wide ring): its product is zeros, made from x so that
    the trace keeps whatever computed x (a producer left unused would be dropped from the traced
    program, and its scoped VMEM from the plan: the routed experts' slots feed only W_lu's
    product); any other streams through its local ring, as `StageStream.matmul` sends it."""

    def __init__(self, ring_names: frozenset) -> None:
        self.ring_names = ring_names

    def matmul(self, x: jax.Array, w_hbm: Any, *, rows: int, name: str,
               **indices: Any) -> jax.Array:
        if not on_ring(self.ring_names, name):
            return blocks.LOCAL_STREAM.matmul(x, w_hbm, rows=rows, name=name, **indices)
        zero = x[:, :1].astype(jnp.float32) * 0.0  # [B, 1]
        return jnp.broadcast_to(zero, (x.shape[0], w_hbm.shape[1]))


class StageStream:
    """The weight stream of one stage of one layer (a context: it checks on exit that the body
    streamed exactly the stage's blocks, then moves the ring's base past them)."""

    def __init__(self, stream: GlobalStream, kind: str, layer, index) -> None:
        self.stream, self.kind, self.layer, self.index = stream, kind, layer, index
        self.plan = stream.plan
        self.entries = self.plan.entries(kind)
        self.entry = self.position = 0
        self.hold_from: int | None = None  # blocks from here on are held back while set
        self.held: list[int] = []  # the targets held back, in issue order

    def __enter__(self) -> StageStream:
        return self

    def __exit__(self, *exc: object) -> bool:
        if exc[0] is None:
            length = len(self.plan.blocks(self.kind))
            if self.held or self.hold_from is not None:
                raise ValueError(f"the {self.kind} stage held back ring blocks {self.held} and "
                                 "never released them (`release_held` after the experts' DMAs)")
            if self.position != length:
                raise ValueError(f"the {self.kind} stage streamed {self.position} of its {length} "
                                 "blocks: the global weight stream and the body disagree")
            base = self.stream.base
            base[0] = lax.rem(base[0] + length, self.plan.depth)
        return False

    def hold_after(self, name: str) -> None:
        """With `experts_first`: hold back the ring's prefetches of every block after matrix
        `name` (the last one streamed before routing; a matrix off the ring: from the stage's
        first block) until `release_held`, so that the routed experts' first DMAs, issued once
        routing is known, go out ahead of them."""
        if not self.stream.experts_first:
            return
        positions = [i for i, (entry, _) in enumerate(self.plan.blocks(self.kind))
                     if entry.name == name]
        self.hold_from = positions[-1] + 1 if positions else 0

    def release_held(self) -> None:
        """Issue the held-back prefetches, in the order they were due (after the experts' DMAs)."""
        held, self.held, self.hold_from = self.held, [], None
        for target in held:
            self._start_ahead(target)

    def _start_ahead(self, target: int) -> None:
        """Start block `target` of the sequence continuing from this stage's block 0 (held
        back past the routing point until the experts' first DMAs: `hold_after`)."""
        if self.hold_from is not None and target >= self.hold_from:
            self.held.append(target)
            return
        stream, kind, length = self.stream, self.kind, len(self.plan.blocks(self.kind))
        if target < length:
            stream.when_live(kind, target, lambda: stream.block_copy(
                kind, target, self.index, stream.base[0], self.layer).start())
            return
        position = target - length
        base = lax.rem(stream.base[0] + length, self.plan.depth)
        if kind in self.plan.attention and not self.plan.ffn_transparent:  # next: this FFN
            layer, guard = self.layer, True
            options = stream.layer_kinds(layer, attention=False)
        else:  # next: the next layer's attention (none after the last layer)
            layer = jnp.minimum(self.layer + 1, stream.n_layers - 1)
            guard = self.layer + 1 < stream.n_layers
            options = stream.layer_kinds(layer, attention=True)
        for next_kind, predicate, index in options:
            @pl.when(jnp.logical_and(guard, predicate))
            def _(next_kind=next_kind, index=index):
                stream.when_live(next_kind, position, lambda: stream.block_copy(
                    next_kind, position, index, base, layer).start())

    def matmul(self, x: jax.Array, w_hbm: Any, *, rows: int, name: str,
               **indices: Any) -> jax.Array:
        """x [M, K] @ the next streamed matrix -> [M, N] f32 (a matrix not in the stream: from
        a local ring)."""
        if not on_ring(self.plan.ring_names(self.kind), name):
            return blocks.LOCAL_STREAM.matmul(x, w_hbm, rows=rows, name=name, **indices)
        entry = self.entries[self.entry]
        if name != entry.name or tuple(w_hbm.shape) != (entry.k, entry.n):
            raise ValueError(f"the {self.kind} stage body streamed {name!r} {tuple(w_hbm.shape)} "
                             f"where the global weight stream expects {entry.name!r} "
                             f"{(entry.k, entry.n)}: its KernelStage.streamed must list the "
                             "matrices in the body's order")
        self.entry += 1
        stream, depth = self.stream, self.plan.depth
        acc = jnp.zeros((x.shape[0], entry.n), jnp.float32)
        for block in range(entry.n_blocks):
            position = self.position
            self._start_ahead(position + depth - 1)
            stream.when_live(self.kind, position, lambda position=position: stream.block_copy(
                self.kind, position, self.index, stream.base[0], self.layer).wait())
            slot = lax.rem(stream.base[0] + position, depth)
            w_block = stream.ring[slot, pl.ds(0, entry.rows), pl.ds(0, entry.n)]  # [rows, N]
            with dma.phase(f"{entry.name}/matmul", flops=2 * x.shape[0] * entry.rows * entry.n,
                           vmem_bytes=entry.rows * entry.n * 2, block=block, layer=self.layer):
                acc += blocks.dot(x[:, block * entry.rows:(block + 1) * entry.rows], w_block)
            self.position += 1
        live = stream.live.get(entry.name)
        # a slice of padding only: zeros (the product of its zero rows or columns), not the
        # stale slot it did not fetch
        return acc if live is None else jnp.where(live, acc, 0.0)
