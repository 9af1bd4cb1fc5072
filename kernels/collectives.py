"""Collectives inside the sharded megakernel: remote DMAs between ranks, and semaphores.

One `pallas_call` per step runs on every rank (`jax.shard_map` over a 1-D mesh axis `AXIS`);
ranks exchange partial results through remote DMAs into each other's VMEM
(`pltpu.make_async_remote_copy`, logged by `dma.RemoteCopy` with source and destination rank):

  all_reduce    x [B, W] f32 over a group of G consecutive ranks (all n, or an ETP group), as a
                reduce-scatter then an all-gather: member i owns lanes [i·c, (i+1)·c) (c = W / G
                in whole lane tiles); every contributing member sends member j its chunk j (phase
                1), member j adds the G chunks in member order (f32, one fixed order: the result
                is the same bits on every rank, whatever the batch or the host) and sends the sum
                to every member (phase 2). `stride` s: only members 0, s, 2s, .. contribute (ranks
                that hold the same heads, or the same experts' ETP group, count once).
  all_gather    x [B, w] from every rank -> n values (the sampling state of each vocab shard)
  rows_of       this rank's slice of a replicated input vector, for a matrix split by its rows
                (K): the partial product is then all-reduced

Receive slots are double-buffered by a parity bit per channel (SMEM), flipped at every
collective: data of collective k + 2 can only arrive once its sender has finished collective
k + 1, which needs this rank's data of k + 1, sent after it finished reading collective k's slots.
Every send and every receive is waited before a collective returns, so the send buffers are
free again and the semaphores back at zero. A barrier (the kernel's barrier semaphore,
`collective_id`) opens the kernel: no rank writes into a peer's VMEM before the peer is in.

`ShardedStream` wraps a stage body's weight stream: a matrix split by its rows multiplies this
rank's slice of the input and all-reduces the f32 partial before the body sees it (rounded once,
as the reference rounds the full contraction); the next stage's weight blocks, issued by the
global ring ahead of the last block, stay in flight while the collective runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels import blocks, dma

from mkresearch import spec
from mkresearch.config import LANE
from mkresearch.layout import Layout, chunk_length

AXIS = "ranks"  # the mesh axis the sharded megakernel runs over
# groups whose row splits multiply a replicated input (its slice is taken); the others' inputs
# are already this rank's (its heads' outputs, its hidden slice)
REPLICATED_INPUT_GROUPS = (spec.MODEL_ROWS, spec.MOE_LATENT)
SUBLANES = 8  # f32 rows of a VMEM tile: a [B, c] f32 buffer takes whole tiles


@dataclass(frozen=True)
class Channel:
    """Ranks that reduce together: groups of `size` consecutive ranks; `chunk` lanes of the
    widest member chunk, `width` lanes of the widest padded vector."""

    name: str
    size: int
    chunk: int
    width: int


@dataclass(frozen=True)
class ShardPlan:
    """Everything static about the collectives of one sharded megakernel build (hashable)."""

    layout: Layout
    batch: int
    channels: tuple[Channel, ...]
    row_width: int  # lanes of the zero-padded replicated input of a row split
    rules: tuple[tuple[str, str, bool], ...]  # DMA-log name -> (group, replicated input)

    @property
    def n_ranks(self) -> int:
        return self.layout.n_ranks

    def channel(self, name: str) -> Channel:
        return next(c for c in self.channels if c.name == name)

    def rule(self, name: str) -> tuple[str, bool] | None:
        for matrix, group, replicated in self.rules:
            if matrix == name:
                return group, replicated
        return None

    def scratch(self) -> list[tuple[str, Any]]:
        """(label, pltpu shape) of every buffer and semaphore, in the order `Collectives` takes
        them (pallas_call scratch_shapes: allocated before the body, the same on every rank)."""
        b, out = self.batch, []
        for ch in self.channels:
            out += [(f"{ch.name}: send", pltpu.VMEM((b, ch.width), jnp.float32)),
                    (f"{ch.name}: reduce-scatter in", pltpu.VMEM((2, ch.size, b, ch.chunk),
                                                                 jnp.float32)),
                    (f"{ch.name}: chunk sum", pltpu.VMEM((b, ch.chunk), jnp.float32)),
                    (f"{ch.name}: all-gather in", pltpu.VMEM((2, ch.size, b, ch.chunk),
                                                             jnp.float32)),
                    (f"{ch.name}: send sems", pltpu.SemaphoreType.DMA((2,))),  # per phase
                    (f"{ch.name}: receive sems", pltpu.SemaphoreType.DMA((2, 2))),  # x parity
                    (f"{ch.name}: parity", pltpu.SMEM((1,), jnp.int32))]
        return out + [("row-split input", pltpu.VMEM((b, self.row_width), jnp.bfloat16))]

    def vmem_buffers(self) -> list[tuple[str, tuple[int, ...], Any]]:
        """(name, shape, dtype) of the VMEM buffers, rows padded to whole f32 tiles."""
        out = []
        for label, shape in self.scratch():
            if getattr(shape, "memory_space", None) == pltpu.VMEM:
                dims = list(shape.shape)
                dims[-2] = max(dims[-2], SUBLANES)
                out.append((f"collectives {label}", tuple(dims), shape.dtype))
        return out


def make_shard_plan(lay: Layout, batch: int, widths: dict[str, tuple[int, ...]],
                    rules: tuple[tuple[str, str, bool], ...], row_inputs: tuple[int, ...],
                    gather_width: int) -> ShardPlan:
    """widths: channel name -> the vector widths W it all-reduces; row_inputs: the widths of the
    replicated inputs sliced for row splits; gather_width: lanes of an all-gathered vector."""
    n = lay.n_ranks
    channels = []
    for name, size in (("all", n), ("etp", lay.etp)):
        if size == 1 or not widths.get(name):
            continue
        ws = widths[name]
        chunk = max(chunk_length(w, size) for w in ws)
        if name == "all":
            chunk = max(chunk, -(-gather_width // LANE) * LANE)
        channels.append(Channel(name, size, chunk, size * chunk))
    row_width = max([LANE] + [lay.n_ranks * chunk_length(k, lay.n_ranks) for k in row_inputs])
    return ShardPlan(layout=lay, batch=batch, channels=tuple(channels), row_width=row_width,
                     rules=rules)


class _Buffers:
    def __init__(self, channel: Channel, refs: tuple) -> None:
        self.channel = channel
        (self.send, self.scatter_in, self.chunk_sum, self.gather_in, self.send_sems,
         self.recv_sems, self.parity) = refs


class Collectives:
    """The collectives of one rank while the sharded megakernel traces (see the module
    docstring). `scratch`: the refs of `ShardPlan.scratch()`, in order."""

    def __init__(self, plan: ShardPlan, scratch: tuple) -> None:
        self.plan, self.layout = plan, plan.layout
        self.rank = lax.axis_index(AXIS)
        per_channel = 7
        self.buffers = {ch.name: _Buffers(ch, tuple(scratch[i * per_channel:(i + 1) * per_channel]))
                        for i, ch in enumerate(plan.channels)}
        self.row_input = scratch[len(plan.channels) * per_channel]

    # -- where this rank sits --------------------------------------------------------------------
    def index(self, group: str) -> Any:
        """This rank's slice of `group` (traced)."""
        split = self.layout.split(group)
        return lax.rem(lax.div(self.rank, split.stride), split.ways)

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

    # -- the collectives -----------------------------------------------------------------------
    def _flip(self, buffers: _Buffers) -> Any:
        parity = buffers.parity[0]
        buffers.parity[0] = 1 - parity
        return parity

    def _copy(self, buffers, phase, src, slot, parity, peer, base, name):
        """The remote copy of `phase` (0: reduce-scatter, 1: all-gather) of `src` (a [B, c] ref
        here) into slot `slot` of the inbox of member `peer`."""
        inbox = buffers.scatter_in if phase == 0 else buffers.gather_in
        c = src.shape[-1]
        return dma.RemoteCopy(src, inbox.at[parity, slot, :, pl.ds(0, c)],
                              buffers.send_sems.at[phase], buffers.recv_sems.at[phase, parity],
                              peer=base + peer, rank=self.rank, name=self._name(name, phase))

    @staticmethod
    def _name(name: str, phase: int) -> str:
        return f"{name}/{'reduce_scatter' if phase == 0 else 'all_gather'}"

    def _wait_all(self, buffers, phase, parity, received, sent, c, name) -> None:
        """Wait for `received` copies of [B, c] into this rank's inbox of `phase` and for `sent`
        copies of [B, c] sent by it: a semaphore counts bytes, so one wait covers them all."""
        args = {"peer": self.rank, "rank": self.rank, "name": self._name(name, phase),
                "log_peer": -1}
        sems = (buffers.send_sems.at[phase], buffers.recv_sems.at[phase, parity])
        if received:
            inbox = (buffers.scatter_in if phase == 0 else buffers.gather_in).at[
                parity, pl.ds(0, received), :, pl.ds(0, c)]  # [received, B, c]
            dma.RemoteCopy(inbox, inbox, *sems, **args).wait_recv()
        if sent:
            out = buffers.send.at[:, pl.ds(0, sent * c)]  # [B, sent·c]: as many bytes
            dma.RemoteCopy(out, out, *sems, **args).wait_send()

    @staticmethod
    def _each_peer(size, member, fn) -> None:
        """fn(peer) for the other members, from member + 1 on (a loop, not unrolled)."""
        def body(k, carry):
            fn(lax.rem(member + k, size))
            return carry

        lax.fori_loop(1, size, body, 0)

    def all_reduce(self, x: Any, *, name: str, channel: str = "all", stride: int = 1) -> Any:
        """Σ over the channel's group of x [B, W] f32 (members 0, stride, 2·stride, .. in order)
        -> [B, W] f32, the same bits on every member."""
        if channel not in self.buffers:  # a group of one rank
            return x
        buffers = self.buffers[channel]
        size, (batch, width) = buffers.channel.size, x.shape
        c = chunk_length(width, size)
        padded = size * c
        member = lax.rem(self.rank, size)
        base = self.rank - member
        parity = self._flip(buffers)
        contributes = lax.rem(member, stride) == 0
        others = size // stride - 1  # contributing members other than a contributing one

        def chunk_of(j):
            return buffers.send.at[:, pl.ds(pl.multiple_of(j * c, LANE), c)]

        with dma.phase(f"{name}/all_reduce"):
            # phase 1 (reduce-scatter): my chunk j -> slot `member` of member j
            @pl.when(contributes)
            def _():
                buffers.send[:, :width] = x
                if padded > width:
                    buffers.send[:, width:padded] = jnp.zeros((batch, padded - width),
                                                              jnp.float32)
                self._each_peer(size, member, lambda j: self._copy(
                    buffers, 0, chunk_of(j), member, parity, j, base, name).start())
                buffers.scatter_in[parity, member, :, :c] = buffers.send[:, pl.ds(
                    pl.multiple_of(member * c, LANE), c)]
                self._wait_all(buffers, 0, parity, others, size - 1, c, name)

            if stride > 1:  # a rank that does not contribute receives from every contributor
                pl.when(jnp.logical_not(contributes))(
                    lambda: self._wait_all(buffers, 0, parity, others + 1, 0, c, name))

            total = buffers.scatter_in[parity, 0, :, :c]
            for src in range(stride, size, stride):  # one fixed order: member 0, stride, ..
                total = total + buffers.scatter_in[parity, src, :, :c]
            buffers.chunk_sum[:, :c] = total
            # phase 2 (all-gather): the sum of chunk `member` -> slot `member` of every member
            self._broadcast(buffers, parity, member, base, c, name)
            return jnp.concatenate([buffers.gather_in[parity, src, :, :c] for src in range(size)],
                                   axis=1)[:, :width]

    def _broadcast(self, buffers, parity, member, base, c, name) -> None:
        """buffers.chunk_sum[:, :c] to slot `member` of every member; wait for all of them."""
        size = buffers.channel.size
        source = buffers.chunk_sum.at[:, pl.ds(0, c)]
        self._each_peer(size, member, lambda j: self._copy(buffers, 1, source, member, parity, j,
                                                           base, name).start())
        buffers.gather_in[parity, member, :, :c] = buffers.chunk_sum[:, :c]
        self._wait_all(buffers, 1, parity, size - 1, size - 1, c, name)

    def all_gather(self, x: Any, *, name: str) -> list:
        """x [B, w] f32 of every rank -> [x of rank 0, .., x of rank n-1] (values [B, w])."""
        if "all" not in self.buffers:
            return [x]
        buffers = self.buffers["all"]
        width = x.shape[1]
        c = -(-width // LANE) * LANE
        parity = self._flip(buffers)
        buffers.chunk_sum[:, :width] = x
        with dma.phase(f"{name}/all_gather"):
            self._broadcast(buffers, parity, self.rank, 0, c, name)
            return [buffers.gather_in[parity, r, :, :width] for r in range(self.plan.n_ranks)]

    def rows_of(self, x: Any, group: str) -> Any:
        """This rank's slice of the replicated input x [B, K] of a matrix split by its K rows in
        `group`: lanes [i·c, (i+1)·c) of x zero-padded to ways·c (c whole lane tiles)."""
        ways = self.layout.ways(group)
        batch, k = x.shape
        c = chunk_length(k, ways)
        self.row_input[:, :k] = x.astype(self.row_input.dtype)
        if ways * c > k:
            self.row_input[:, k:ways * c] = jnp.zeros((batch, ways * c - k), self.row_input.dtype)
        start = pl.multiple_of(self.index(group) * c, LANE)
        return self.row_input[:, pl.ds(start, c)].astype(x.dtype)

    # -- the routed experts (kernels/experts.py) ------------------------------------------------
    def expert_range(self, n_local: int) -> tuple[Any, int]:
        """(first global id, count) of this rank's experts."""
        return self.index(spec.EXPERTS) * n_local, n_local

    def expert_partial_sum(self, y: Any, name: str) -> Any:
        """An expert's output over this rank's hidden slice -> over the whole hidden (ETP)."""
        return self.all_reduce(y, name=name, channel="etp")

    def expert_groups_sum(self, acc: Any, name: str) -> Any:
        """Σ over the expert groups of each group's weighted expert sum (one rank per group)."""
        return self.all_reduce(acc, name=name, stride=self.layout.etp)

    def stream(self, inner: Any) -> ShardedStream:
        return ShardedStream(inner, self)


class ShardedStream:
    """A stage's weight stream on one rank: matrices split by their rows (`ShardPlan.rules`)
    multiply this rank's slice of the input; their f32 partial products are all-reduced."""

    def __init__(self, inner: Any, collectives: Collectives) -> None:
        self.inner, self.collectives = inner, collectives

    def matmul(self, x: Any, w_hbm: Any, *, rows: int, name: str, **indices: Any) -> Any:
        rule = self.collectives.plan.rule(name)
        if rule is None:
            return self.inner.matmul(x, w_hbm, rows=rows, name=name, **indices)
        group, replicated_input = rule
        if replicated_input:
            x = self.collectives.rows_of(x, group)
        rows = blocks.weight_block_rows(tuple(w_hbm.shape), w_hbm.dtype)  # this rank's [K, N]
        partial = self.inner.matmul(x, w_hbm, rows=rows, name=name, **indices)
        stride = self.collectives.layout.head_replicas if group == spec.HEADS else 1
        return self.collectives.all_reduce(partial, name=name, stride=stride)


def vmem_bytes(plan: ShardPlan) -> int:
    return sum(math.prod(shape) * jnp.dtype(dtype).itemsize
               for _, shape, dtype in plan.vmem_buffers())
