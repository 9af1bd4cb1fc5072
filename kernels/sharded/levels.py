"""Partial-sum reductions sent in levels, inside the sharded megakernel: two-level and rs-ag
(`Collectives.reduce` sends the rest one-shot; `MegakernelOptions.reductions` says which).

The ranks form hosts of `host_size` consecutive ranks (`MegakernelOptions.ranks_per_host`: a TPU
slice's cores of one host). Every reduction, whatever its algorithm, adds the same partials in
one order on every rank: a host's partials in rank order, then the hosts' sums in host order
(`numerics.host_ordered_sum`, which the sharded reference uses too), so all ranks hold the same
bits and the algorithm never changes them.

  two-level  level 1: a rank's partial (and the column chunks riding with it) to every member of
             its host, each member adds the host's; level 2: the host's sum (and the host's
             riders) to the same member of every other host, each adds the hosts' sums. h - 1 +
             H - 1 messages per rank instead of n - 1 (the release's all-reduce, docs/collectives.md)
  rs-ag      level 1: member j of a host gets chunk j of every member's partial and adds them;
             level 2: that summed chunk to member j of every other host, which add the hosts'
             chunks; level 3: the summed chunks all-gathered in the host. Each message carries
             1 / h of the vector (the release's B >= 6 variant)

With a bf16 wire every piece a level sends is bf16 and travels 2 bytes a value, packed in pairs
into the f32 slots (`pack_bf16`; the riders stay f32): the partials, a host's sum rounded before
it crosses hosts, rs-ag's summed chunk rounded before it is gathered (the total's rounding, which
`numerics.host_ordered_sum` applies for every algorithm).

Each level has its own inbox and semaphores (a semaphore counts bytes: a level's wait must not
count the next level's early arrivals), double-buffered by one parity bit flipped per reduction,
as the channels of `collectives` are. DMA-log names: "<reduction>/<level>" (LEVEL_PHASES).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma
from mkresearch.kernels.sharded.plan import (  # noqa: F401 - REDUCTION_ALGORITHMS: the options'
    ONE_SHOT,
    REDUCTION_ALGORITHMS,
    RS_AG,
    TWO_LEVEL,
    ShardingPlan,
    lanes,
)

from mkresearch.model import numerics
from mkresearch.model.config import LANE
from mkresearch.sharding.layout import chunk_length

LEVEL_PHASES = ("local", "across", "local_gather")  # DMA-log names of a reduction's levels


@dataclass(frozen=True)
class Levels:
    """The buffers of the reductions sent in levels (`Collectives.reduce`): `hosts` hosts of
    `host_size` consecutive ranks. local: what a rank sends its host's members (two-level: its
    partial; rs-ag: member j's chunk of it), its column chunks riding along; across: what it
    sends its counterparts on the other hosts (the host's sum or summed chunk, the host's
    riders); gather: rs-ag's summed chunk, all-gathered in the host. Widths in lanes."""

    host_size: int
    hosts: int
    local_width: int
    across_width: int
    gather_width: int

    def scratch(self, batch: int) -> list[tuple[str, Any]]:
        h, f32 = self.host_size, jnp.float32
        return [("levels: local out", pltpu.VMEM((h, batch, self.local_width), f32)),
                ("levels: local in", pltpu.VMEM((2, h, batch, self.local_width), f32)),
                ("levels: across out", pltpu.VMEM((batch, self.across_width), f32)),
                ("levels: across in", pltpu.VMEM((2, self.hosts, batch, self.across_width), f32)),
                ("levels: gather out", pltpu.VMEM((batch, self.gather_width), f32)),
                ("levels: gather in", pltpu.VMEM((2, h, batch, self.gather_width), f32)),
                ("levels: send sems", pltpu.SemaphoreType.DMA((3,))),  # per level
                ("levels: receive sems", pltpu.SemaphoreType.DMA((3, 2))),  # x parity
                ("levels: parity", pltpu.SMEM((1,), jnp.int32))]


@dataclass(frozen=True)
class LevelBuffers:
    """The refs of `Levels.scratch`, in order (and the sizes)."""

    sizes: Levels
    local_out: Any
    local_in: Any
    across_out: Any
    across_in: Any
    gather_out: Any
    gather_in: Any
    send_sems: Any
    recv_sems: Any
    parity: Any


def plan_levels(plan: ShardingPlan) -> Levels | None:
    """The buffers of the plan's reductions sent in levels (None if there are none): the widest
    piece each level sends, its riders along."""
    n = plan.layout.n_ranks
    h = plan.ranks_per_host or n
    if n % h:
        raise ValueError(f"ranks_per_host={plan.ranks_per_host!r} is invalid for {n} ranks: 0 "
                         "or an int that divides the rank count")
    sent = [r for r in plan.reductions if r.algorithm != ONE_SHOT]
    if not sent:
        return None
    local = across = gather = LANE
    for r in sent:
        piece = r.width if r.algorithm == TWO_LEVEL else chunk_length(r.width, h)
        local = max(local, lanes(piece + r.riders))
        across = max(across, lanes(piece + h * r.riders))
        if r.algorithm == RS_AG:
            gather = max(gather, piece)
    return Levels(h, n // h, local, across, gather)


def pack_bf16(x: Any) -> Any:
    """x [B, 2h] f32 holding bf16 values (rounded, their low 16 bits zero) -> [B, h] f32 words,
    each two of them: column j's bf16 in the high half, column h + j's in the low half (the bf16
    wire's 2 bytes a value through the f32 slots; `unpack_bf16` gives x back, bit for bit)."""
    h = x.shape[1] // 2
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type(
        (bits[:, :h] & jnp.uint32(0xFFFF0000)) | (bits[:, h:] >> jnp.uint32(16)), jnp.float32)


def unpack_bf16(words: Any) -> Any:
    """`pack_bf16`'s words [B, h] -> the bf16 values [B, 2h] as f32."""
    bits = lax.bitcast_convert_type(words, jnp.uint32)
    return jnp.concatenate([lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32),
                            lax.bitcast_convert_type(bits << jnp.uint32(16), jnp.float32)], axis=1)


def each_peer(size: int, member: Any, fn: Any) -> None:
    """fn(peer) for the other members of a group of `size`, from member + 1 on (a loop, not
    unrolled)."""
    def body(k, carry):
        fn(lax.rem(member + k, size))
        return carry

    lax.fori_loop(1, size, body, 0)


@dataclass(frozen=True)
class _Reducing:
    """One reduction in levels on this rank: its algorithm, the piece each message carries, the
    riders' width, this rank's member index in its host and the buffers' parity."""

    name: str
    algorithm: str
    host_size: int
    piece: int
    riders: int
    member: Any
    base: Any  # the first rank of this rank's host
    parity: Any
    stride: int  # the summed ranks are 0, stride, 2 stride, ..
    n_summed: int
    wire: str  # "bf16": every piece rounded and sent 2 bytes a value (`packed`)

    @property
    def packed(self) -> bool:
        """Whether a piece travels packed in pairs (`pack_bf16`)."""
        return self.wire == "bf16" and self.piece % 2 == 0

    @property
    def sent(self) -> int:
        """A piece's width in its messages (the riders follow it)."""
        return self.piece // 2 if self.packed else self.piece

    def pack(self, x: Any) -> Any:
        return pack_bf16(x) if self.packed else x

    def unpack(self, x: Any) -> Any:
        return unpack_bf16(x) if self.packed else x

    def counted(self, rank: Any) -> Any:
        """Whether rank's partial is one of the summed (traced or static)."""
        return (rank % self.stride == 0) & (rank < self.stride * self.n_summed)


class LevelReductions:
    """The reductions sent in levels of one rank while the sharded megakernel traces: `coll` the
    rank's `collectives.Collectives`, `buffers` its `LevelBuffers`."""

    def __init__(self, coll: Any, buffers: LevelBuffers) -> None:
        self.coll, self.buffers = coll, buffers

    def reduce(self, partial: Any, chunks: list, summed: tuple[int, ...], name: str,
               algorithm: str) -> tuple[Any, list]:
        """`Collectives.reduce` as two-level or rs-ag -> (the sum [B, N], every rank's riders
        [B, Σ c], in rank order)."""
        stride = summed[1] - summed[0] if len(summed) > 1 else 1
        if tuple(summed) != tuple(range(0, stride * len(summed), stride)):
            raise ValueError(f"{name}: summed={summed!r} is invalid for {algorithm}: ranks "
                             "0, s, 2 s, .. (one per slice)")
        lv = self.buffers
        h = lv.sizes.host_size
        width, rw = partial.shape[1], sum(c.shape[1] for c in chunks)
        member = lax.rem(self.coll.rank, h)
        at = _Reducing(name, algorithm, h, width if algorithm == TWO_LEVEL else chunk_length(width, h),
                       rw, member, self.coll.rank - member, lv.parity[0], stride, len(summed),
                       self.coll.plan.wire)
        lv.parity[0] = 1 - at.parity
        self._local(at, partial, jnp.concatenate(chunks, axis=1) if chunks else None)
        host_sum = self._host_sum(at, partial.shape[0])
        everyone = [lv.local_in[at.parity, j, :, at.sent:at.sent + rw] for j in range(h)] \
            if rw else []
        total = host_sum
        if lv.sizes.hosts > 1:
            total, everyone = self._across(at, host_sum, everyone)
        if algorithm == RS_AG:  # level 3: the summed chunks all-gathered in the host
            c3 = lanes(at.sent)
            lv.gather_out[:, :at.sent] = at.pack(total)
            if c3 > at.sent:
                lv.gather_out[:, at.sent:c3] = jnp.zeros((total.shape[0], c3 - at.sent),
                                                         jnp.float32)
            self.level(2, lambda j: lv.gather_out.at[:, pl.ds(0, c3)], lv.gather_in,
                       at.member, at.parity, h, lambda j: at.base + j, c3, name)
            total = jnp.concatenate([at.unpack(lv.gather_in[at.parity, j, :, :at.sent])
                                     for j in range(h)], axis=1)[:, :width]
        return total, everyone

    def _local(self, at: _Reducing, partial: Any, riders: Any) -> None:
        """Level 1, in the host: two-level its whole partial to every member, rs-ag member j its
        chunk j; this rank's column chunks ride along."""
        lv, piece, rw, width, sent = self.buffers, at.piece, at.riders, partial.shape[1], at.sent
        c1 = lanes(sent + rw)
        for j in range(1 if at.algorithm == TWO_LEVEL else at.host_size):
            stop = min(width, (j + 1) * piece)
            chunk = partial[:, j * piece:stop] if j * piece < stop else partial[:, :0]
            if chunk.shape[1] < piece:  # the vector's zero padding
                chunk = jnp.concatenate([chunk, jnp.zeros((partial.shape[0],
                                                           piece - chunk.shape[1]), jnp.float32)],
                                        axis=1)
            lv.local_out[j, :, :sent] = at.pack(chunk)
            if rw:
                lv.local_out[j, :, sent:sent + rw] = riders

        def source(j):
            return lv.local_out.at[0 if at.algorithm == TWO_LEVEL else j, :, pl.ds(0, c1)]

        self.level(0, source, lv.local_in, at.member, at.parity, at.host_size,
                   lambda j: at.base + j, c1, at.name)

    def _host_sum(self, at: _Reducing, batch: int) -> Any:
        """The host's summed partials (only the summed ranks', in rank order), as the wire
        carries it (`numerics.wire_round`)."""
        lv, h, piece = self.buffers, at.host_size, at.piece

        def received(j):
            return at.unpack(lv.local_in[at.parity, j, :, :at.sent])

        if at.stride == 1 and at.n_summed == self.coll.plan.n_ranks:
            host_sum = functools.reduce(lambda a, b: a + b, [received(j) for j in range(h)])
            return numerics.wire_round(host_sum, at.wire)
        host_sum, started = jnp.zeros((batch, piece), jnp.float32), False
        for j in range(h):
            value, mine = received(j), at.counted(at.base + j)
            host_sum = jnp.where(mine, jnp.where(started, host_sum + value, value), host_sum)
            started = jnp.logical_or(started, mine)
        return numerics.wire_round(host_sum, at.wire)

    def _across(self, at: _Reducing, host_sum: Any, local_riders: list) -> tuple[Any, list]:
        """Level 2: the host's sum (and riders) to the same member of every host -> (the sum,
        every rank's riders)."""
        lv, h, sent, rw = self.buffers, at.host_size, at.sent, at.riders
        hosts = lv.sizes.hosts
        c2 = lanes(sent + h * rw)
        lv.across_out[:, :sent] = at.pack(host_sum)
        for j, value in enumerate(local_riders):
            lv.across_out[:, sent + j * rw:sent + (j + 1) * rw] = value
        self.level(1, lambda k: lv.across_out.at[:, pl.ds(0, c2)], lv.across_in,
                   lax.div(self.coll.rank, h), at.parity, hosts, lambda k: k * h + at.member,
                   c2, at.name)
        summing = [k for k in range(hosts) if any(at.counted(k * h + j) for j in range(h))]
        total = functools.reduce(lambda a, b: a + b, [
            at.unpack(lv.across_in[at.parity, k, :, :sent]) for k in summing])
        everyone = [lv.across_in[at.parity, k, :, sent + j * rw:sent + (j + 1) * rw]
                    for k in range(hosts) for j in range(h)] if rw else []
        total = numerics.wire_round(total, at.wire)
        return total, everyone

    def level(self, level: int, source, inbox: Any, me: Any, parity: Any, size: int,
              rank_of, c: int, name: str) -> None:
        """One phase of a reduction in levels: source(j) [B, c] (a ref) to slot `me` of the inbox
        of each other member j of a group of `size` (rank_of(j) its rank), then wait for the
        group's size - 1 pieces here and for this rank's sends."""
        lv = self.buffers
        label = f"{name}/{LEVEL_PHASES[level]}"
        sems = (lv.send_sems.at[level], lv.recv_sems.at[level, parity])
        with dma.phase(label):
            def send(j):
                dma.RemoteCopy(source(j), inbox.at[parity, me, :, pl.ds(0, c)], *sems,
                               peer=rank_of(j), rank=self.coll.rank, name=label).start()

            each_peer(size, me, send)
            inbox[parity, me, :, :c] = source(me)[...]
            self.wait(level, inbox, parity, size - 1, size - 1, c, label)

    def wait(self, level: int, inbox: Any, parity: Any, received: int, sent: int, c: int,
             label: str) -> None:
        """Wait for `received` pieces [B, c] of a level in this rank's inbox and for `sent` sent
        by it (a semaphore counts bytes: one wait covers them all)."""
        lv = self.buffers
        sems = (lv.send_sems.at[level], lv.recv_sems.at[level, parity])
        args = {"peer": self.coll.rank, "rank": self.coll.rank, "name": label, "log_peer": -1}
        if received:
            region = inbox.at[parity, pl.ds(0, received), :, pl.ds(0, c)]
            dma.RemoteCopy(region, region, *sems, **args).wait_recv()
        if sent:
            region = inbox.at[parity, pl.ds(0, sent), :, pl.ds(0, c)]
            dma.RemoteCopy(region, region, *sems, **args).wait_send()
