"""Collectives inside the sharded megakernel: remote DMAs between ranks, and semaphores.

One `pallas_call` per step runs on every rank (`jax.shard_map` over a 1-D mesh axis `AXIS`);
ranks exchange data through remote DMAs into each other's VMEM (`pltpu.make_async_remote_copy`,
logged by `dma.RemoteCopy`); a stage's weight stream on a rank: `sharded_stream.ShardedStream`.

  all_gather     x [B, w] of every member of a group (all n ranks, or an ETP group) -> every
                 member's x: each sends its x into slot `me` of every other member's inbox
  gather         the pieces of a vector split by a group, put together in order (the heads'
                 outputs before W_o, a matrix's column chunks after it, `ShardedStream`); the
                 router's columns placed apart (`layout.place_router`): among the router's
                 group of consecutive ranks (channel "router": a host, a sibling pair)
  all_reduce     the embedding: a reduce-scatter then an all-gather (one rank holds the row, the
                 others add zeros: exact)
  combine_items  exact mode: the routed experts' weighted sum in ascending expert id, passed down
                 the chain of expert groups (the single-device order, bit for bit), the last
                 group's sum all-gathered
  reduce         partial-sum mode (`kernels/sharded/plan.py`): partial products
                 [B, N] of a matrix split by its rows (and the routed experts' sum) added in one
                 fixed order on every rank, sent one-shot or in levels (`levels`: two-level,
                 rs-ag); column chunks needed only at the stage's end (`Rule.rides`: W_lu) ride
                 in the stage's last reduction (`settle`); the chunks of two matrices of one
                 input (`Rule.joins`) travel in one all-gather (`ShardedStream.matmuls`)

Receive slots are double-buffered by a parity bit per channel (SMEM), flipped at every
collective: data of collective k + 2 can only arrive once its sender has finished collective
k + 1, which needs this rank's data of k + 1, sent after it finished reading collective k's slots.
A semaphore counts bytes, so one wait covers all of a collective's receives (and one its sends);
every collective waits for both before it returns, so buffers are free and semaphores back at
zero. A barrier (the kernel's barrier semaphore, `collective_id`) opens the kernel: no rank writes
into a peer's VMEM before the peer is in. The next stage's weight blocks, issued by the global
ring ahead of a stage's last block, stay in flight while a collective runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma
from mkresearch.kernels.sharded import sharded_stream
from mkresearch.kernels.sharded.levels import (
    LevelBuffers,
    LevelReductions,
    Levels,
    each_peer,
    pack_bf16,
    plan_levels,
    unpack_bf16,
)
from mkresearch.kernels.sharded.plan import (
    ONE_SHOT,
    ROUTER_CHANNEL,
    Rule,
    ShardingPlan,
    carries,
    expert_sum_merged,
)
from mkresearch.kernels.stages import gate_up

from mkresearch.model import numerics, spec
from mkresearch.model.config import LANE
from mkresearch.sharding import layout_split
from mkresearch.sharding.layout import Layout, chunk_length

AXIS = "ranks"  # the mesh axis the sharded megakernel runs over
SUBLANES = 8  # f32 rows of a VMEM tile: a [B, c] f32 buffer takes whole tiles


@dataclass(frozen=True)
class Channel:
    """Ranks that reduce together: groups of `size` consecutive ranks; `chunk` lanes of the
    widest member piece (an all-gather's), `scatter_chunk` lanes of a member's chunk of the widest
    vector a reduce-scatter splits (`all_reduce`), `width` lanes of that vector, padded."""

    name: str
    size: int
    chunk: int
    width: int
    scatter_chunk: int = LANE


@dataclass(frozen=True)
class ShardPlan:
    """Everything static about the collectives of one sharded megakernel build (hashable)."""

    layout: Layout
    batch: int
    channels: tuple[Channel, ...]
    rules: tuple[Rule, ...]  # the sharding plan's (`plan.collective_rules`)
    expert_items: int  # the most routed experts a rank computes in one layer: min(E_loc, B·k)
    expert_latent: int  # a rank's columns of an expert's output (the latent / ETP)
    mode: str = "exact"  # or "partial-sum" (the layout's `collectives`)
    wire: str = "f32"  # partial sums on the wire: "f32" or "bf16" (rounded once before the sum)
    host_size: int = 0  # consecutive ranks of a host (every reduction adds theirs first); 0: all
    algorithms: tuple = ()  # (reduction name, "two-level" | "rs-ag"): the rest go one-shot
    levels: Levels | None = None  # the two-level and rs-ag reductions' buffers, if any

    @property
    def n_ranks(self) -> int:
        return self.layout.n_ranks

    @property
    def ranks_per_host(self) -> int:
        return self.host_size or self.layout.n_ranks

    def algorithm(self, name: str) -> str:
        """How the reduction `name` is sent: "one-shot" unless `algorithms` says otherwise."""
        return dict(self.algorithms).get(name, ONE_SHOT)

    def channel(self, name: str) -> Channel:
        return next(c for c in self.channels if c.name == name)

    def rule(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)

    def scratch(self) -> list[tuple[str, Any]]:
        """(label, pltpu shape) of every buffer and semaphore, in the order `Collectives` takes
        them (pallas_call scratch_shapes: allocated before the body, the same on every rank)."""
        b, out = self.batch, []
        for ch in self.channels:
            out += [(f"{ch.name}: send", pltpu.VMEM((b, ch.width), jnp.float32)),
                    (f"{ch.name}: reduce-scatter in", pltpu.VMEM(
                        (2, ch.size, b, ch.scatter_chunk), jnp.float32)),
                    (f"{ch.name}: chunk", pltpu.VMEM((b, ch.chunk), jnp.float32)),
                    (f"{ch.name}: all-gather in", pltpu.VMEM((2, ch.size, b, ch.chunk),
                                                             jnp.float32)),
                    (f"{ch.name}: send sems", pltpu.SemaphoreType.DMA((2,))),  # per phase
                    (f"{ch.name}: receive sems", pltpu.SemaphoreType.DMA((2, 2))),  # x parity
                    (f"{ch.name}: parity", pltpu.SMEM((1,), jnp.int32))]
        if self.levels is not None:
            out += self.levels.scratch(b)
        if self.mode == "exact":  # the items kept for the ordered chain (`combine_items`)
            lat = self.expert_latent
            out += [("expert outputs", pltpu.VMEM((self.expert_items, b, lat), jnp.float32)),
                    ("expert weights", pltpu.VMEM((self.expert_items, b, 1), jnp.float32)),
                    ("expert sum in", pltpu.VMEM((b, lat), jnp.float32)),
                    ("expert sum out", pltpu.VMEM((b, lat), jnp.float32)),
                    ("expert sum sems", pltpu.SemaphoreType.DMA((2,)))]
        if self.packs_scatter:
            ch = self.channel("all")
            out += [("reduce-scatter bf16 send", pltpu.VMEM((b, ch.size * ch.scatter_chunk),
                                                            jnp.bfloat16)),
                    ("reduce-scatter bf16 in", pltpu.VMEM((2, ch.size, b, ch.scatter_chunk),
                                                          jnp.bfloat16))]
        return out

    @property
    def packs_scatter(self) -> bool:
        """A bf16 wire's reduce-scatter (restructured's ρ): its chunks staged and sent as bf16,
        2 bytes a value in their own lane-aligned buffers (`Collectives.reduce_scatter`)."""
        return self.wire == "bf16" and any(r.beside for r in self.rules) and \
            any(c.name == "all" for c in self.channels)

    def vmem_buffers(self) -> list[tuple[str, tuple[int, ...], Any]]:
        """(name, shape, dtype) of the VMEM buffers, rows padded to whole f32 tiles."""
        out = []
        for label, shape in self.scratch():
            if getattr(shape, "memory_space", None) == pltpu.VMEM:
                dims = list(shape.shape)
                dims[-2] = max(dims[-2], SUBLANES * 4 // jnp.dtype(shape.dtype).itemsize)
                dims[-1] = max(dims[-1], LANE)
                out.append((f"collectives {label}", tuple(dims), shape.dtype))
        return out


def make_shard_plan(sharding: ShardingPlan, pieces: dict, reduced: tuple[int, ...],
                    expert_items: int, expert_latent: int) -> ShardPlan:
    """The kernel's collectives of a sharding plan (a flat copy of what they read: its repr is
    the recorded compiles' fingerprint). pieces: channel name -> the widths of the pieces it
    all-gathers; reduced: the widths it all-reduces (channel "all"); the plan's reductions sent
    in levels get the level buffers (`levels.plan_levels`)."""
    lay = sharding.layout
    levels = plan_levels(sharding)
    channels = []
    for name, size in (("all", lay.n_ranks), ("etp", lay.etp),
                       (ROUTER_CHANNEL, lay.ways(spec.ROUTER_COLS))):
        widths = tuple(pieces.get(name, ()))
        if size == 1 or not widths:
            continue
        scattered = reduced if name == "all" else ()
        scatter_chunk = max([chunk_length(w, size) for w in scattered] + [LANE])
        chunk = max([-(-w // LANE) * LANE for w in widths] + [scatter_chunk])
        # the send buffer stages only an all-reduced vector (one-shot pieces go from their own
        # buffers, and a wait counts its bytes on the inbox, `_wait_all`)
        channels.append(Channel(name, size, chunk, size * scatter_chunk, scatter_chunk))
    return ShardPlan(layout=lay, batch=sharding.batch, channels=tuple(channels),
                     rules=sharding.rules, expert_items=expert_items, expert_latent=expert_latent,
                     mode=lay.collectives, wire=sharding.wire, host_size=sharding.ranks_per_host,
                     algorithms=sharding.algorithms, levels=levels)


class _Buffers:
    def __init__(self, channel: Channel, refs: tuple) -> None:
        self.channel = channel
        (self.send, self.scatter_in, self.chunk_sum, self.gather_in, self.send_sems,
         self.recv_sems, self.parity) = refs


class ScatterInFlight(NamedTuple):
    """A reduce-scatter started (`Collectives.reduce_scatter_start`), its copies in flight."""

    buffers: _Buffers
    inbox: Any  # where the peers' chunks land: [2 parities, members, B, c]
    parity: Any  # the inbox half this one uses (traced)
    c: int  # the chunk's width
    name: str


class Collectives:
    """The collectives of one rank while the sharded megakernel traces (see the module
    docstring). `scratch`: the refs of `ShardPlan.scratch()`, in order."""

    def __init__(self, plan: ShardPlan, scratch: tuple) -> None:
        self.plan, self.layout = plan, plan.layout
        self.rank = lax.axis_index(AXIS)
        per_channel = 7
        self.buffers = {ch.name: _Buffers(ch, tuple(scratch[i * per_channel:(i + 1) * per_channel]))
                        for i, ch in enumerate(plan.channels)}
        rest = scratch[len(plan.channels) * per_channel:]
        self.levels = None
        if plan.levels is not None:  # the reductions sent in levels (`levels`)
            self.levels, rest = LevelReductions(self, LevelBuffers(plan.levels, *rest[:9])), rest[9:]
        self.chains_items = plan.mode == "exact"  # else each item is added as it lands
        if self.chains_items:
            (self.items_y, self.items_coef, self.sum_in, self.sum_out, self.sum_sems) = rest[:5]
            rest = rest[5:]
        # a bf16 wire's reduce-scatter: (send [B, W], inbox [2, size, B, c]) as bf16
        self.scatter_bf16 = tuple(rest[:2]) if plan.packs_scatter else None

    # -- where this rank sits --------------------------------------------------------------------
    def index(self, group: str) -> Any:
        """This rank's slice of `group` (traced)."""
        split = self.layout.split(group)
        return lax.rem(lax.div(self.rank, split.stride) + split.start, split.ways)

    def live(self, stream: Any) -> dict:
        """Partial-sum mode: {matrix name: (traced) whether this rank's slice of it holds real
        data}, for every matrix of the global weight ring (`weight_stream.StreamPlan`) that some
        rank holds only padding of (a lane-tile chunk past the end of its axis,
        `layout_split.streamed_zeros`): that rank neither fetches nor multiplies it
        (`GlobalStream.live`). The exact mode streams every chunk (its bytes are its tests')."""
        if self.plan.mode == "exact" or stream is None:
            return {}
        out = {}
        for entry in (e for _, entries in stream.stages for e in entries):
            param = spec.stage(entry.group).params(self.layout.cfg)[gate_up.param_key(entry.key)]
            for group, length, chunk in layout_split.padded_splits(self.layout, param):
                real = self.index(group) * chunk < length  # the slice starts inside the axis
                out[entry.name] = jnp.logical_and(out.get(entry.name, True), real)
        return out

    def vocab_limit(self) -> int | None:
        """The vocabulary size when the vocab shards are padded (the last one's tail), else
        None: what the sampling stage masks beyond."""
        vocab, lay = self.layout.cfg.vocab_size, self.layout
        padded = lay.ways(spec.VOCAB) * lay.local_length(spec.VOCAB, vocab) > vocab
        return vocab if padded else None

    def barrier(self) -> None:
        """Every rank signals every other on the kernel's barrier semaphore and waits for all:
        after it, every peer is inside this kernel (its receive slots exist)."""
        n = self.plan.n_ranks
        if n > 1:
            barrier = pltpu.get_barrier_semaphore()

            def signal(k, carry):
                pl.semaphore_signal(barrier, 1, device_id=(lax.rem(self.rank + k, n),),
                                    device_id_type=pl.DeviceIdType.MESH)
                return carry

            lax.fori_loop(1, n, signal, 0)
            pl.semaphore_wait(barrier, n - 1)
        for buffers in self.buffers.values():
            buffers.parity[0] = 0
        if self.levels is not None:
            self.levels.buffers.parity[0] = 0
        if self.chains_items:
            self.sum_in[...] = jnp.zeros(self.sum_in.shape, jnp.float32)  # the first group's start

    # -- the collectives -----------------------------------------------------------------------
    def _flip(self, buffers: _Buffers) -> Any:
        parity = buffers.parity[0]
        buffers.parity[0] = 1 - parity
        return parity

    def _copy(self, buffers, phase, src, slot, parity, peer, base, name, inbox=None):
        """The remote copy of `phase` (0: reduce-scatter, 1: all-gather) of `src` (a [B, c] ref
        here) into slot `slot` of the inbox of member `peer` (default the phase's own)."""
        if inbox is None:
            inbox = buffers.scatter_in if phase == 0 else buffers.gather_in
        c = src.shape[-1]
        return dma.RemoteCopy(src, inbox.at[parity, slot, :, pl.ds(0, c)],
                              buffers.send_sems.at[phase], buffers.recv_sems.at[phase, parity],
                              peer=base + peer, rank=self.rank, name=self._name(name, phase))

    @staticmethod
    def _name(name: str, phase: int) -> str:
        return f"{name}/{'reduce_scatter' if phase == 0 else 'all_gather'}"

    def _wait_all(self, buffers, phase, parity, received, sent, c, name, inbox=None) -> None:
        """Wait for `received` copies of [B, c] into this rank's inbox of `phase` (default the
        phase's own) and for `sent` copies of [B, c] sent by it: a semaphore counts bytes, so one
        wait covers them all."""
        args = {"peer": self.rank, "rank": self.rank, "name": self._name(name, phase),
                "log_peer": -1}
        sems = (buffers.send_sems.at[phase], buffers.recv_sems.at[phase, parity])
        if inbox is None:
            inbox = buffers.scatter_in if phase == 0 else buffers.gather_in
        if received:
            region = inbox.at[parity, pl.ds(0, received), :, pl.ds(0, c)]  # [received, B, c]
            dma.RemoteCopy(region, region, *sems, **args).wait_recv()
        if sent:  # as many bytes as sent: `sent` slots of the inbox [sent, B, c]
            region = inbox.at[parity, pl.ds(0, sent), :, pl.ds(0, c)]
            dma.RemoteCopy(region, region, *sems, **args).wait_send()

    def all_reduce(self, x: Any, *, name: str) -> Any:
        """Σ over all ranks of x [B, W] f32, added in rank order -> [B, W] f32 on every rank."""
        if "all" not in self.buffers:  # one rank
            return x
        buffers = self.buffers["all"]
        size, (batch, width) = buffers.channel.size, x.shape
        c = chunk_length(width, size)
        padded, member = size * c, self.rank
        parity = self._flip(buffers)

        def chunk_of(j):
            return buffers.send.at[:, pl.ds(pl.multiple_of(j * c, LANE), c)]

        with dma.phase(f"{name}/all_reduce"):
            # reduce-scatter: my chunk j -> slot `member` of rank j; rank j adds its slots in order
            buffers.send[:, :width] = x
            if padded > width:
                buffers.send[:, width:padded] = jnp.zeros((batch, padded - width), jnp.float32)
            each_peer(size, member, lambda j: self._copy(
                buffers, 0, chunk_of(j), member, parity, j, 0, name).start())
            buffers.scatter_in[parity, member, :, :c] = buffers.send[:, pl.ds(
                pl.multiple_of(member * c, LANE), c)]
            self._wait_all(buffers, 0, parity, size - 1, size - 1, c, name)
            total = buffers.scatter_in[parity, 0, :, :c]
            for src in range(1, size):  # one fixed order: rank 0, 1, ..
                total = total + buffers.scatter_in[parity, src, :, :c]
            buffers.chunk_sum[:, :c] = total
            # all-gather: the sum of chunk `member` -> slot `member` of every rank
            self._broadcast(buffers, parity, member, 0, c, name)
            return jnp.concatenate([buffers.gather_in[parity, src, :, :c] for src in range(size)],
                                   axis=1)[:, :width]

    def _broadcast(self, buffers, parity, member, base, c, name) -> None:
        """buffers.chunk_sum[:, :c] to slot `member` of every member; wait for all of them."""
        size = buffers.channel.size
        source = buffers.chunk_sum.at[:, pl.ds(0, c)]
        each_peer(size, member, lambda j: self._copy(buffers, 1, source, member, parity, j,
                                                           base, name).start())
        buffers.gather_in[parity, member, :, :c] = buffers.chunk_sum[:, :c]
        self._wait_all(buffers, 1, parity, size - 1, size - 1, c, name)

    def all_gather(self, x: Any, *, name: str, channel: str = "all") -> list:
        """x [B, w] of every member of the channel's group -> [x of member 0, .., member G-1]
        (values [B, w], x's dtype; moved through f32 slots, exactly)."""
        if channel not in self.buffers:
            return [x]
        buffers = self.buffers[channel]
        size, width = buffers.channel.size, x.shape[1]
        c = -(-width // LANE) * LANE
        member = lax.rem(self.rank, size)
        parity = self._flip(buffers)
        buffers.chunk_sum[:, :width] = x.astype(jnp.float32)
        with dma.phase(f"{name}/all_gather"):
            self._broadcast(buffers, parity, member, self.rank - member, c, name)
            return [buffers.gather_in[parity, m, :, :width].astype(x.dtype) for m in range(size)]

    def gather(self, piece: Any, group: str, full: int, *, name: str) -> Any:
        """The vector [B, full] split by `group` into pieces [B, w] (this rank's is `piece`): the
        pieces of the slices 0, 1, .. in order (one rank of each, `Split.stride`), cut to full."""
        if group == spec.EXPERT_TP:  # within this rank's expert group
            return jnp.concatenate(self.all_gather(piece, name=name, channel="etp"),
                                   axis=1)[:, :full]
        if group == spec.ROUTER_COLS:  # the router placed apart: within its group of ranks
            return jnp.concatenate(self.all_gather(piece, name=name, channel=ROUTER_CHANNEL),
                                   axis=1)[:, :full]
        return self._assemble(self.all_gather(piece, name=name), group, full)

    def _assemble(self, everyone: list, group: str, full: int) -> Any:
        """Every rank's piece of a vector split by `group` -> [B, full]: the pieces of the slices
        0, 1, .. in order (one rank of each, `Split.stride`)."""
        split = self.layout.split(group)
        pieces = [everyone[split.rank_of(i)] for i in range(split.ways)]
        return jnp.concatenate(pieces, axis=1)[:, :full]

    def reduce(self, partial: Any, summed: tuple[int, ...], *, name: str,
               riders: tuple = ()) -> tuple[Any, list]:
        """Σ of the partial sums [B, N] f32 of the ranks `summed`, the same bits on every rank
        and under every algorithm (`numerics.host_ordered_sum`: a host's partials in rank order,
        then the hosts' sums). Sent as `ShardPlan.algorithm(name)` says: one-shot (every rank's
        partial to every peer), or two-level / rs-ag (`levels`). A bf16 wire rounds each partial,
        each host's sum and the total to bf16 (`numerics.host_ordered_sum`) and sends every value
        2 bytes a value (`pack_bf16`, the partials of a width that packs in pairs).
        riders: (rule, column chunk [B, c]) of matrices whose chunks ride in the same messages
        (`Rule.rides`) -> (the sum, [each rider's whole output])."""
        if self.plan.wire == "bf16":
            partial = partial.astype(jnp.bfloat16).astype(jnp.float32)
        width = partial.shape[1]
        chunks = [chunk.astype(jnp.float32) for _, chunk in riders]
        pieces = [(rule, chunk.shape[1]) for (rule, _), chunk in zip(riders, chunks, strict=True)]
        algorithm = self.plan.algorithm(name)
        if algorithm == ONE_SHOT or "all" not in self.buffers or self.levels is None:
            packed = self.plan.wire == "bf16" and width % 2 == 0  # 2 bytes a value, in pairs
            sent = pack_bf16(partial) if packed else partial
            everyone = self.all_gather(jnp.concatenate([sent, *chunks], axis=1), name=name)
            own = sent.shape[1]  # each rank's partial in the message, then the riders' chunks
            received = [everyone[r][:, :own] for r in summed]
            total = self._host_ordered([unpack_bf16(x) for x in received] if packed else received,
                                       summed)
            wholes = self.unpack(everyone, pieces, own)
        else:
            total, everyone = self.levels.reduce(partial, chunks, summed, name, algorithm)
            wholes = self.unpack(everyone, pieces, 0)
        return total, [whole.astype(chunk.dtype) for whole, (_, chunk) in zip(wholes, riders,
                                                                               strict=True)]

    def reduce_scatter_start(self, partial: Any, group: str, *, name: str) -> ScatterInFlight:
        """Restructured's ρ: the partial sums [B, W] f32 of every rank, this rank's chunk [B, c]
        of their sum to come (its slice of `group`, split one slice per rank). One phase: each
        rank sends every peer that peer's chunk of its partial; `reduce_scatter_wait` waits for
        the copies and adds the chunks. The buffers stay untouched meanwhile: nothing else of
        the stage uses them until then (the shared experts run, `experts.ffn_stage_body`)."""
        buffers, width = self.buffers["all"], partial.shape[1]
        send, inbox = self.scatter_bf16 or (buffers.send, buffers.scatter_in)
        partial = numerics.wire_round(partial, self.plan.wire).astype(send.dtype)
        size, split = buffers.channel.size, self.layout.split(group)
        c = self.layout.local_length(group, width)
        padded, member = split.ways * c, self.rank
        parity = self._flip(buffers)

        def chunk_of(rank):  # rank's slice of the group, in the staged vector
            start = lax.rem(rank + split.start, split.ways) * c
            return send.at[:, pl.ds(pl.multiple_of(start, LANE), c)]

        with dma.phase(f"{name}/reduce_scatter"):
            send[:, :width] = partial
            if padded > width:
                send[:, width:padded] = jnp.zeros((partial.shape[0], padded - width), send.dtype)
            each_peer(size, member, lambda j: self._copy(
                buffers, 0, chunk_of(j), member, parity, j, 0, name, inbox=inbox).start())
            inbox[parity, member, :, :c] = chunk_of(member)[...]
        return ScatterInFlight(buffers, inbox, parity, c, name)

    def reduce_scatter_wait(self, scatter: ScatterInFlight) -> Any:
        """This rank's chunk [B, c] of the sum `reduce_scatter_start` began, added as `reduce`
        adds (`numerics.host_ordered_sum`, all ranks in order; a bf16 wire rounds each partial,
        each host's sum and the chunk's sum, and its chunks move as bf16, 2 bytes a value, from
        and into buffers of their own, `ShardPlan.packs_scatter`)."""
        buffers, inbox, parity, c, name = scatter
        size = buffers.channel.size
        with dma.phase(f"{name}/reduce_scatter"):
            self._wait_all(buffers, 0, parity, size - 1, size - 1, c, name, inbox=inbox)
            return self._host_ordered([inbox[parity, r, :, :c].astype(jnp.float32)
                                       for r in range(size)], tuple(range(size)))

    @property
    def scatters_latent(self) -> bool:
        """Restructured: ρ reduce-scattered, W_lu's partial products beside a later reduction."""
        return any(r.beside for r in self.plan.rules)

    def latent_chunk(self, latent: int) -> tuple[Any, int, int]:
        """Restructured: (first column (traced), width c, the slices' padded width) of this
        rank's chunk of the MoE latent (its W_lu rows)."""
        c = self.layout.local_length(spec.MOE_LATENT, latent)
        return self.index(spec.MOE_LATENT) * c, c, self.layout.ways(spec.MOE_LATENT) * c

    def _host_ordered(self, values: list, ranks: tuple[int, ...]) -> Any:
        h = self.plan.ranks_per_host
        return numerics.host_ordered_sum(values, tuple(r // h for r in ranks), self.plan.wire)

    def unpack(self, everyone: list, pieces: list, start: int) -> list:
        """Every member's message [B, w] -> for each (rule, width) of `pieces`, laid side by
        side from column `start` on: its whole output [B, rule.n] (the members' column chunks
        put together by `rule.out`)."""
        wholes = []
        for rule, width in pieces:
            stop = start + width
            wholes.append(self._assemble([m[:, start:stop] for m in everyone], rule.out, rule.n))
            start = stop
        return wholes

    def settle(self, outputs: dict) -> dict:
        """A stage's outputs {matrix name: value} with the collectives its stream left to the
        stage's end done (`sharded_stream.ShardedStream.matmul`): each reduction of a matrix that
        others ride with (their column chunks in its messages) or that adds another output's
        partial sums (`Rule.adds`), run once -> {name: the whole value} (the others as were)."""
        out = dict(outputs)
        for rule in self.plan.rules:
            if not carries(self.plan.rules, rule.name) or rule.name not in out:
                continue
            riders = [r for r in self.plan.rules if r.rides == rule.name]
            besides = [r for r in self.plan.rules if r.beside == rule.name]
            missing = [n for n in [r.name for r in riders + besides] + [rule.adds]
                       if n and n not in out]
            if missing:
                raise ValueError(f"the stage's outputs lack {missing}, which travel with the "
                                 f"reduction of {rule.name}")
            partial = out[rule.name] + out[rule.adds] if rule.adds else out[rule.name]
            if rule.adds:  # its partial sums are in this reduction: the stage adds zeros
                out[rule.adds] = jnp.zeros_like(out[rule.adds])
            width = partial.shape[1]
            total, wholes = self.reduce(
                jnp.concatenate([partial, *[out[b.name] for b in besides]], axis=1),
                self.layout.slice_firsts(rule.reduce), name=f"{rule.name}/sum",
                riders=tuple((r, out[r.name]) for r in riders))
            out[rule.name] = total[:, :width]
            out.update({r.name: whole for r, whole in zip(riders, wholes, strict=True)})
            for b in besides:  # [Σ partial products | Σ sums of squares, one lane tile]
                cfg = self.layout.cfg
                scale = numerics.rms_scale(total[:, width + b.n:width + b.n + 1],
                                              cfg.moe_latent, cfg.rms_eps)
                out[b.name] = total[:, width:width + b.n] * scale  # ρ's norm scale after the sum
                width += b.n + LANE
        return out

    # -- the routed experts (kernels/stages/experts.py) -----------------------------------------
    def expert_range(self, n_local: int) -> tuple[Any, int]:
        """(first global id, count) of this rank's experts."""
        return self.index(spec.EXPERTS) * n_local, n_local

    def expert_hidden(self, h: Any) -> Any:
        """An expert's activations over this rank's hidden slice -> the whole hidden (ETP)."""
        if self.layout.etp == 1 or self.plan.mode != "exact":  # partial-sum: W2's rows split
            return h
        return self.gather(h, spec.EXPERT_TP, h.shape[1] * self.layout.etp, name="expert/h")

    def keep_item(self, i: Any, coef: Any, y: Any, acc: Any) -> Any:
        """Expert item i's weight [B, 1] and output [B, Lat / ETP]: the exact mode keeps them for
        `combine_items`'s chain; the others add them to this rank's partial sum acc [B, Lat]
        as they land (the order `combine_items` would add them in: the same bits, and no
        [items, B, Lat] buffer in VMEM)."""
        if not self.chains_items:
            return acc + coef * y
        self.items_y[i] = y
        self.items_coef[i] = coef
        return acc

    def combine_items(self, n_items: Any, acc: Any, latent: int, *, name: str) -> Any:
        """Σ over the batch's experts, in ascending id, of weight x output -> [B, latent] f32 on
        every rank: this group continues the sum of the groups before it (received from the rank
        ETP below), passes it on, and the last group's sum is all-gathered. acc: this rank's
        items summed as they landed (`keep_item`; not the exact mode's)."""
        if not self.chains_items:  # partial sums over this rank's experts and hidden slice
            with dma.phase(f"{name}/combine"):
                if expert_sum_merged(self.plan.rules):  # reduced with a later one (`settle`)
                    return acc[:, :latent]
                if self.scatters_latent:  # this rank's latent chunk [B, c] of ρ only
                    return self.reduce_scatter_start(acc[:, :latent], spec.MOE_LATENT,
                                                     name=f"{name}/sum")
                return self.reduce(acc, tuple(range(self.plan.n_ranks)),
                                   name=f"{name}/sum")[0][:, :latent]
        ep, etp = self.layout.ep, self.layout.etp
        group = self.index(spec.EXPERTS)
        link = functools.partial(dma.RemoteCopy, self.sum_out, self.sum_in, self.sum_sems.at[0],
                                 self.sum_sems.at[1], rank=self.rank, name=f"{name}/chain")
        with dma.phase(f"{name}/combine"):
            if ep > 1:
                @pl.when(group > 0)
                def _():
                    link(peer=self.rank - etp).wait_recv()

            acc = self._items_sum(n_items, self.sum_in[...])
            if ep > 1:
                @pl.when(group < ep - 1)
                def _():
                    self.sum_out[...] = acc
                    link(peer=self.rank + etp).start().wait_send()

            everyone = self.all_gather(acc, name=f"{name}/sum")
            last = (ep - 1) * etp
            return jnp.concatenate(everyone[last:last + etp], axis=1)[:, :latent]

    def combined_items(self, combined: Any) -> Any:
        """`combine_items`'s sum once its reduction is done: restructured, this rank's chunk
        [B, c] of ρ (the reduce-scatter waited for here, after the shared experts); otherwise
        the sum as `combine_items` returned it (its reduction waited for there)."""
        return self.reduce_scatter_wait(combined) if self.scatters_latent else combined

    def _items_sum(self, n_items: Any, start: Any) -> Any:
        """start + Σ over the kept items, in order, of weight x output [B, Lat / ETP] f32."""
        return lax.fori_loop(0, n_items, lambda i, acc: acc + self.items_coef[i] * self.items_y[i],
                             start)

    def stream(self, inner: Any) -> Any:
        """The stage's weight stream `inner` as this rank streams it (`sharded_stream`)."""
        return sharded_stream.ShardedStream(inner, self)


def vmem_bytes(plan: ShardPlan) -> int:
    return sum(math.prod(shape) * jnp.dtype(dtype).itemsize
               for _, shape, dtype in plan.vmem_buffers())
