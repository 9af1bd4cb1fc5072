"""The FFN stage as one Pallas TPU kernel: routed latent experts + always-on experts (docs/kimi-k3.md §6.2–6.6).

    z  = bf(x W_ld)                                   latent down          x [B, d] -> z [B, Lat]
    for each expert e in the work list:               weights DMA'd from HBM into a slot ring
        h   = SiTU(bf(z W1_e), bf(z W3_e))            [B, F]
        acc += coef_e · bf(h W2_e)                    f32, coef_e [B, 1] = this row's weight of e
    ρ̂  = RMSNorm_γ(bf(acc)) over moe_latent          (acc is [B, moe_latent_padded], zero padding)
    routed = ρ̂ W_lu (f32);  always-on = SiTU(bf(x Wg), bf(x Wu)) Wd (f32)
    m = bf(routed + always-on)

The always-on part is the shared experts of an MoE layer, or — with no routed part at all — the
dense MLP of layer 0: "the same stage with one always-on expert". It runs between the experts'
weighted sum and W_lu (the stage streams W_ld, the always-on MLP, then W_lu): on a rank of the
restructured mode, while ρ's reduce-scatter is in flight. The two outputs are added in one
order whatever ran first: the same bits.

Which experts are fetched (`plan`, the steps of notebook 04):
  "all"     every expert of the layer (a gather of all; unselected ones get coefficient 0)
  "routed"  each (row, k) choice, duplicates fetched again (B·k DMAs)
  "unique"  each distinct expert of the batch once: a scalar dedupe over the SMEM ids
and how: `n_slots` VMEM slots per expert matrix. One slot: copy, wait, compute. Two or more: the
next expert's weights stream while the current one computes, and the first ones are issued before
the latent down-projection, right after routing, so they fly behind it.

Expert weights stay in HBM (`pl.ANY`) in their stored format (bf16 / fp8 / mxfp4, see
`mkresearch.kernels.base.quant`), are DMA'd as stored and decoded in VMEM. Every DMA goes through
`mkresearch.kernels.base.dma`; expert DMAs are named "expert/<matrix>/<part>", so
`log.dma_bytes("expert/")` is the routed-expert bytes of a step.

The ids are read twice: as SMEM scalars (to address the DMAs and build the work list) and as a
VMEM tile [B, k] (to build each expert's per-row coefficient with vector compares).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, chip_log, costs, dma, planned, quant
from mkresearch.kernels.base.registry import StageRefs
from mkresearch.kernels.stages import gate_up, router
from mkresearch.kernels.stages.gate_up import SHARED_KEYS

from mkresearch.hardware import tpu
from mkresearch.model import numerics, reference
from mkresearch.model.config import LANE, ModelConfig
from mkresearch.model.stages.ffn import EXPERT_BIASES

PLANS = ("all", "routed", "unique")
EXPERT_MATRICES = ("w1", "w3", "w2")
EXPERT_DMA_PREFIX = "expert/"
LATENT_DOWN, LATENT_UP, LATENT_NORM = "latent/w_ld", "latent/w_lu", "latent/norm"  # DMA-log names
# Mosaic's default scoped-VMEM limit is far below the chip's VMEM; two bf16 expert slots at the
# per-rank shapes (2 x 16.5 MB) need more. 60 MiB fits TPU7x's 64 MiB per TensorCore.
VMEM_LIMIT_BYTES = 60 * 2**20


def activation(g: jax.Array, u: jax.Array, kind: str,
               swiglu: tuple[float, float] = (1.702, 7.0)) -> jax.Array:
    """bf16 [B, F] from the bf16 gate and up projections: SiTU (Kimi K3), SwiGLU, or GPT-OSS's
    clamped SwiGLU (swiglu: its alpha and limit), the reference's functions."""
    if kind == "situ":
        return reference.situ(g, u)
    if kind == "clamped_swiglu":
        return numerics.clamped_swiglu(g, u, *swiglu)
    return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(jnp.bfloat16)


def gated_mlp(x: jax.Array, parts: dict, *, stream: Any, kind: str, name: str) -> jax.Array:
    """x [B, d] bf16 -> f32 [B, d]: act(bf(x Wg), bf(x Wu)) Wd, each weight streamed from HBM.
    parts: `gate_up.parts` (W_gate and W_up, or the two as one [d, 2 S], and W_down)."""
    def project(v, w, part):
        rows = blocks.weight_block_rows(tuple(w.shape), w.dtype)
        return blocks.stream_matmul(stream, v, w, rows=rows, name=f"{name}/{part}")

    if gate_up.GATE_UP in parts:  # a rank's hidden slice narrower than whole lanes
        g, u = gate_up.split(project(x, parts[gate_up.GATE_UP], gate_up.GATE_UP),
                             parts["w_down"].shape[0])
    else:
        g = project(x, parts["w_gate"], "w_gate").astype(jnp.bfloat16)  # [B, S]
        u = project(x, parts["w_up"], "w_up").astype(jnp.bfloat16)
    return project(activation(g, u, kind), parts["w_down"], "w_down")  # [B, d]


def expert_dma_name(matrix: str, part: str) -> str:
    """The DMA-log name of one stored part of one expert matrix, e.g. "expert/w1/codes"."""
    return f"{EXPERT_DMA_PREFIX}{matrix}/{part}"


def routed_part(ids_smem: Any, x: jax.Array, ids: jax.Array, weights: jax.Array, w_ld: Any,
                latent_norm: Any, w_lu: Any, experts: dict, *, stream: Any, expert_format: str,
                mxfp4_decode: str, plan: str, n_slots: int, latent: int, latent_padded: int,
                eps: float, kind: str, shard: Any = None, z: Any = None,
                mxu_input: str = "bf16", swiglu: tuple = (1.702, 7.0)) -> Callable[[], jax.Array]:
    """Routed experts of one layer, up to their weighted sum (on a rank, its reduction started)
    -> a function that finishes them: () -> f32 [B, d] (`_ExpertLoop.finish`: the sum's wait,
    the latent norm and W_lu, streamed last). experts[m] is a tuple of HBM part refs
    [E, ...] per matrix m of EXPERT_MATRICES; ids_smem [B, k] i32 (SMEM), ids/weights [B, k];
    shard: a sharded model's rank (`collectives.Collectives`): experts are its own (hidden slice);
    z: the latent bf(x W_ld) [B, Lat] bf16 when the caller streamed W_ld already; mxu_input: what
    each expert's product hands the MXU (ModelConfig.expert_mxu, `quant.matmul`); experts may
    hold biases (GPT-OSS: "b1", "b3", "b2", 1-tuples of HBM refs [E, 1, n]), each fetched with its
    expert into a slot ring of its own; swiglu: the clamped SwiGLU's (alpha, limit)."""
    batch, top_k = ids.shape
    n_experts = experts["w1"][0].shape[0]
    loop = _ExpertLoop(ids_smem, x, ids, weights, stream, w_ld, latent_norm, w_lu, experts,
                       expert_format, mxfp4_decode, plan, n_slots, latent, latent_padded, eps, kind,
                       shard, z, mxu_input, swiglu)
    if plan == "all":
        n_items, acc = n_experts, loop.run(n_experts, lambda i: i)
    elif plan == "routed":
        n_items = batch * top_k
        acc = loop.run(n_items, lambda i: ids_smem[router.choice(i, top_k)])
    else:
        local = () if shard is None else shard.expert_range(n_experts)

        def with_unique(unique_ref, seen_ref):
            n_unique = router.dedupe_experts(ids_smem, unique_ref, seen_ref, *local)
            return n_unique, loop.run(n_unique, lambda i: unique_ref[i])

        n_ids = n_experts if shard is None else shard.layout.cfg.n_experts  # global ids
        n_items, acc = pl.run_scoped(with_unique, pltpu.SMEM((batch * top_k,), jnp.int32),
                                     pltpu.SMEM((n_ids,), jnp.int32))
    return functools.partial(loop.finish, loop.combine(n_items, acc))


@dataclass(frozen=True)
class _ExpertLoop:
    """The expert loop of one layer (`routed_part`'s arguments): item i of a work list fetches
    expert expert_of(i) into slot i mod n_slots of a ring per stored part of W1, W3, W2."""

    ids_smem: Any
    x: Any
    ids: Any
    weights: Any
    stream: Any
    w_ld: Any
    latent_norm: Any
    w_lu: Any
    experts: dict
    expert_format: str
    mxfp4_decode: str
    plan: str
    n_slots: int
    latent: int
    latent_padded: int
    eps: float
    kind: str
    shard: Any = None
    latent_in: Any = None  # z [B, Lat] bf16 when the caller streamed W_ld already
    mxu_input: str = "bf16"  # ModelConfig.expert_mxu (`quant.matmul`)
    swiglu: tuple = (1.702, 7.0)  # the clamped SwiGLU's alpha and limit (GPT-OSS)

    def _keys(self) -> list[tuple[str, int]]:
        """(matrix, part index) of every ring: each matrix's stored parts, then each expert
        bias present (GPT-OSS's b1, b3, b2: one part each, `experts[bias]` a 1-tuple)."""
        names = quant.part_names(self.expert_format)
        return ([(m, j) for m in EXPERT_MATRICES for j in range(len(names))]
                + [(b, 0) for b in EXPERT_BIASES.values() if b in self.experts])

    def _ring_name(self, key: tuple[str, int]) -> str:
        """"w1/codes", ..., "b1/bias": the ring's name in the VMEM plan (after "expert/" in the
        DMA log, `expert_dma_name`)."""
        m, j = key
        part = "bias" if m in EXPERT_BIASES.values() else quant.part_names(self.expert_format)[j]
        return f"{m}/{part}"

    def run(self, n_items: Any, expert_of: Any) -> jax.Array:
        """The loop over n_items items (may be traced) -> Σ w_e y_e [B, Lat] f32 (on a rank: its
        experts' and hidden slice's, or kept for the exact mode's ordered sum)."""
        # one ring per (matrix, part) "w1/codes" (and bias "b1/bias"): slot buffers [n_slots,
        # *part shape] (named so in the VMEM plan), a semaphore per slot
        parts = {self._ring_name(key): key for key in self._keys()}
        slot_shapes = [pltpu.VMEM((self.n_slots, *self.experts[m][j].shape[1:]),
                                  self.experts[m][j].dtype) for m, j in parts.values()]
        sem_shapes = [pltpu.SemaphoreType.DMA((self.n_slots,))] * len(slot_shapes)
        return pl.run_scoped(functools.partial(self._in_slots, n_items, expert_of),
                             dict(zip(parts, slot_shapes)), sem_shapes)

    def _in_slots(self, n_items: Any, expert_of: Any, slots: dict, sems: list) -> jax.Array:
        """slots: {"w1/codes": [n_slots, ...] VMEM, ...}, sems: a DMA semaphore array each, in
        the order of the parts (matrix, then part)."""
        rings = {key: dma.Ring(slots[self._ring_name(key)], sems[r],
                               name=expert_dma_name(*self._ring_name(key).split("/")),
                               buffer=planned.EXPERT_SLOTS) for r, key in enumerate(self._keys())}
        slots = _Slots(rings, self.experts, expert_of, self.n_slots)
        first = (0 if self.shard is None
                 else self.shard.expert_range(self.experts["w1"][0].shape[0])[0])
        for i in range(self.n_slots - 1):  # the first experts fly behind W_ld
            pl.when(i < n_items)(functools.partial(slots.start, i))
        blocks.release_held(self.stream)  # the ring's prefetches held back behind them, if any
        z = self._latent_input()
        batch, top_k = self.ids.shape
        flat_choice = (lax.broadcasted_iota(jnp.int32, (batch, top_k), 0) * top_k
                       + lax.broadcasted_iota(jnp.int32, (batch, top_k), 1))  # [B, k]: b·k + j
        step = functools.partial(self._step, slots, n_items, z, flat_choice, first)
        return lax.fori_loop(0, n_items, step, jnp.zeros((batch, self.latent), jnp.float32))

    def _latent_input(self) -> jax.Array:
        """What the experts multiply: the latent z = bf(x W_ld) [B, Lat] (streamed here unless
        given), or x itself for experts on the full d (stages.moe_full)."""
        if self.latent_in is not None:  # streamed before routing (a rank's fused gather)
            return self.latent_in
        if self.w_ld is None:
            return self.x  # [B, d] bf16
        return blocks.stream_matmul(self.stream, self.x, self.w_ld, rows=blocks.weight_block_rows(
            tuple(self.w_ld.shape), self.w_ld.dtype), name=LATENT_DOWN).astype(jnp.bfloat16)

    def _step(self, slots: _Slots, n_items: Any, z: Any, flat_choice: Any, first: Any, i: Any,
              acc: Any) -> Any:
        """Item i: the item n_slots - 1 ahead started, this one waited for and computed;
        acc [B, Lat] f32 += its weighted output (on a rank: kept for the ordered sum)."""
        if self.n_slots == 1:
            slots.start(i)
        else:
            ahead = i + self.n_slots - 1
            pl.when(ahead < n_items)(functools.partial(slots.start, ahead))
        slots.wait(i)
        part = slots.parts(i)
        hidden = self.experts["w1"][0].shape[-1]  # F: the last dim of every W1 part
        batch = self.ids.shape[0]
        with dma.phase("expert/compute", item=i, flops=6 * batch * self.latent * hidden,
                       vmem_bytes=3 * self.latent * hidden * 2):  # decoded bf16 W1, W3, W2
            y = self._expert_output(part, z)
            if self.plan == "routed":  # this item is one (row, k) choice
                hit = flat_choice == i
            else:  # every choice of this expert, in every row
                e = slots.expert_of(i)
                hit = self.ids == (e if self.shard is None else e + first)
            coef = jnp.sum(jnp.where(hit, self.weights, 0.0), axis=-1, keepdims=True)  # [B, 1]
            if self.shard is None:
                return acc + coef * y
            return self.shard.keep_item(i, coef, y, acc)  # exact: added in id order after it

    def _expert_output(self, part: dict, z: Any) -> jax.Array:
        """y_e = bf(act(bf(z W1), bf(z W3)) W2) [B, Lat] f32 from the slots' stored parts (with
        GPT-OSS's biases: each product + its bias [1, n] in f32 before its rounding)."""
        matmul = functools.partial(quant.matmul, expert_format=self.expert_format,
                                   mxfp4_decode=self.mxfp4_decode, mxu_input=self.mxu_input)

        def biased(y, m):
            bias = EXPERT_BIASES[m]
            return y + part[bias][0][...].astype(jnp.float32) if bias in part else y

        g = biased(matmul(z, part["w1"]), "w1").astype(jnp.bfloat16)  # [B, F]
        u = biased(matmul(z, part["w3"]), "w3").astype(jnp.bfloat16)
        h = activation(g, u, self.kind, self.swiglu)  # on a rank: its hidden slice, then all
        y = matmul(h if self.shard is None else self.shard.expert_hidden(h), part["w2"])
        return biased(y, "w2").astype(jnp.bfloat16).astype(jnp.float32)

    def combine(self, n_items: Any, acc: Any) -> Any:
        """Σ w_e y_e of every rank (a rank: every group's, in id order), its reduction started
        (`Collectives.combine_items`): restructured, ρ's reduce-scatter flies until `finish`."""
        if self.shard is None:
            return acc
        return self.shard.combine_items(n_items, acc, self.latent, name="expert")

    def finish(self, combined: Any) -> jax.Array:
        """`combine`'s sum, its reduction waited for; with a latent: RMSNorm, then W_lu
        -> the routed output [B, d] f32 (restructured: this rank's rows' partial product)."""
        acc = combined if self.shard is None else self.shard.combined_items(combined)
        if self.w_ld is None:
            return acc  # [B, d] f32: Σ w_e y_e is the routed output
        if self.shard is not None and self.shard.scatters_latent:  # acc: this rank's ρ chunk
            start, _, padded = self.shard.latent_chunk(self.latent)
            return pl.run_scoped(functools.partial(self._latent_rows, acc, start),
                                 pltpu.VMEM((1, padded), jnp.float32),
                                 pltpu.SemaphoreType.DMA((1,)))
        rho_hat = pl.run_scoped(
            functools.partial(_latent_norm, acc, self.latent_norm, eps=self.eps,
                              latent=self.latent),
            pltpu.VMEM((self.ids.shape[0], self.latent_padded), jnp.float32),
            pltpu.VMEM((1, self.latent_padded), jnp.float32), pltpu.SemaphoreType.DMA((1,)))
        return blocks.stream_matmul(self.stream, rho_hat, self.w_lu,
                                    rows=blocks.weight_block_rows(tuple(self.w_lu.shape),
                                                                  self.w_lu.dtype),
                                    name=LATENT_UP)  # [B, d] f32

    def _latent_rows(self, rho: Any, start: Any, gamma_ref: Any, sem: Any) -> jax.Array:
        """Restructured (a rank's W_lu rows: its chunk [B, c] of ρ) -> [B, d + LANE] f32: the
        partial product bf(bf(ρ_c) γ_c) W_lu_c and, in the next lane tile's first column, the
        partial Σ bf(ρ_c)²; summed over the ranks, RMSNorm's scale applies after the sum
        (`Collectives.settle`, `numerics.rms_scale`)."""
        copy = dma.Copy(self.latent_norm, gamma_ref.at[:, pl.ds(0, self.latent)], sem.at[0],
                        name=LATENT_NORM, buffer=planned.WHOLE).start()
        if gamma_ref.shape[1] > self.latent:  # the padding slices' γ: zero
            gamma_ref[:, self.latent:] = jnp.zeros((1, gamma_ref.shape[1] - self.latent),
                                                   jnp.float32)
        v = rho.astype(jnp.bfloat16).astype(jnp.float32)  # ρ = bf(Σ w_e y_e), this chunk
        batch, c = v.shape
        squares = reference.ordered_sum(v * v, keepdims=True)  # [B, 1]
        copy.wait()
        gamma = gamma_ref[:, pl.ds(pl.multiple_of(start, LANE), c)]  # [1, c]
        product = blocks.stream_matmul(
            self.stream, (v * gamma).astype(jnp.bfloat16), self.w_lu,
            rows=blocks.weight_block_rows(tuple(self.w_lu.shape), self.w_lu.dtype),
            name=LATENT_UP)  # [B, d] f32: this rank's rows
        first = lax.broadcasted_iota(jnp.int32, (batch, LANE), 1) == 0
        return jnp.concatenate([product, jnp.where(first, squares, 0.0)], axis=1)


@dataclass(frozen=True)
class _Slots:
    """The expert slot rings: item i's stored parts go to slot i mod n_slots."""

    rings: dict  # (matrix, part index) -> dma.Ring
    experts: dict  # matrix -> (HBM part refs [E, ...], ...)
    expert_of: Any
    n_slots: int

    def _copies(self, i: Any, action: str) -> None:
        e, slot = self.expert_of(i), lax.rem(i, self.n_slots)
        for (m, j), ring in self.rings.items():
            getattr(ring, action)(self.experts[m][j].at[e], slot, item=i)

    def start(self, i: Any) -> None:
        self._copies(i, "start")

    def wait(self, i: Any) -> None:
        self._copies(i, "wait")

    def parts(self, i: Any) -> dict:
        """matrix (or bias) -> its parts' VMEM slots of item i."""
        slot = lax.rem(i, self.n_slots)
        return {m: tuple(ring.buffer(slot) for (mm, _), ring in self.rings.items() if mm == m)
                for m in dict.fromkeys(m for m, _ in self.rings)}


def _latent_norm(acc, latent_norm_hbm, rho_ref, gamma_ref, sem, *, eps, latent):
    """ρ̂ = RMSNorm_γ(bf(acc)) -> bf16 [B, Lat]. The latent sits at its padded width in VMEM
    (rho_ref [B, Lat_p]) with zero padding columns and zero γ there; the mean divides by Lat."""
    copy = dma.Copy(latent_norm_hbm, gamma_ref.at[:, pl.ds(0, latent)], sem.at[0],
                    name=LATENT_NORM, buffer=planned.WHOLE).start()
    rho_ref[...] = jnp.zeros(rho_ref.shape, jnp.float32)
    rho_ref[:, :latent] = acc.astype(jnp.bfloat16).astype(jnp.float32)  # ρ = bf(Σ w_e y_e)
    if gamma_ref.shape[1] > latent:
        gamma_ref[:, latent:] = jnp.zeros((1, gamma_ref.shape[1] - latent), jnp.float32)
    copy.wait()
    return blocks.rms_norm(rho_ref[...], gamma_ref[...], eps, n=latent)[:, :latent]


def _n_experts(routed: dict) -> int:
    """E of routed experts stacked [E, ...] in their stored parts."""
    return jax.tree.leaves(routed["experts"])[0].shape[0]


# ---- the stage body and its wrappers -----------------------------------------------------------
@dataclass(frozen=True)
class StageOptions:
    """Static choices of one FFN stage (hashable: part of the jit cache key)."""

    expert_format: str = "bf16"
    mxfp4_decode: str = "integer"  # how MXFP4 codes are decoded (quant.MXFP4_DECODES), per chip
    # what an expert's product hands the MXU: ModelConfig.expert_mxu (out of the repr: a plan's
    # repr, which keys recorded compiles, shows it in its config's)
    mxu_input: str = field(default="bf16", repr=False)
    plan: str = "unique"
    n_slots: int = 2
    latent: int = 0  # cfg.moe_latent: the checkpoint width, what the norm divides by
    latent_padded: int = 0  # cfg.moe_latent_padded: the latent's width in VMEM
    eps: float = 1e-5
    activation: str = "situ"
    always_on_name: str = "shared"  # DMA-log prefix of the always-on MLP: "shared" or "dense"
    # the clamped SwiGLU's (alpha, limit) (GPT-OSS; out of the repr, read only by it)
    swiglu: tuple = field(default=(1.702, 7.0), repr=False)


@dataclass(frozen=True)
class MoePlan:
    """The static options of a whole MoE layer: the expert stage and the router."""

    stage: StageOptions
    router: tuple  # router_options(cfg): (name, value) pairs
    batch: int = 1


def ffn_stage_body(x_ref: Any, out_ref: Any, *, stream: Any, options: StageOptions,
                   routed: dict | None = None, routing: router.Routing | None = None,
                   always_on: dict | None = None, shard: Any = None, z: Any = None) -> None:
    """out_ref [B, d] = routed experts (if `routed`) + always-on MLP (if `always_on`).

    routed: {"w_ld" [d, Lat], "latent_norm" [1, Lat] f32, "w_lu" [Lat, d],
             "experts": {"w1"|"w3"|"w2": tuple of HBM parts [E, ...]}}  (HBM refs), with the
             choices of the router in `routing`; without "w_ld" the experts work on the full d
             (options.latent = d) and their weighted sum is the routed output (stages.moe_full)
    always_on: {"w_gate" [d, S], "w_up" [d, S], "w_down" [S, d]} or `gate_up.parts` (HBM refs)
    x_ref [B, d] bf16 (VMEM); stream: where the matmuls get their weight blocks; z: the latent
    [B, Lat] bf16 if W_ld was streamed already (`moe_layer_body` on a rank).
    """
    x = x_ref[...]  # [B, d] bf16
    total = jnp.zeros(out_ref.shape, jnp.float32)
    finish_routed = routed_out = shared_out = None
    if routed is not None:  # up to Σ w_e y_e: on a rank, its reduction started
        finish_routed = routed_part(routing.ids_smem, x, routing.ids[...], routing.weights[...],
                                routed.get("w_ld"), routed.get("latent_norm"), routed.get("w_lu"),
                                routed["experts"], stream=stream,
                                expert_format=options.expert_format,
                                mxfp4_decode=options.mxfp4_decode, plan=options.plan,
                                n_slots=options.n_slots, latent=options.latent,
                                latent_padded=options.latent_padded, eps=options.eps,
                                kind=options.activation, shard=shard, z=z,
                                mxu_input=options.mxu_input, swiglu=options.swiglu)
    if always_on is not None:  # meanwhile restructured's ρ reduce-scatter flies (W_lu after)
        shared_out = gated_mlp(x, always_on, stream=stream, kind=options.activation,
                               name=options.always_on_name)
    if finish_routed is not None:
        routed_out = finish_routed()
    if shard is not None:  # a rank: the collectives its stream left to the stage's end
        # (W_lu's column chunks riding with the always-on MLP's reduction, `Collectives.settle`)
        down = f"{options.always_on_name}/w_down"
        settled = shard.settle({name: value for name, value in ((LATENT_UP, routed_out),
                                                               (down, shared_out))
                                if value is not None})
        routed_out, shared_out = settled.get(LATENT_UP), settled.get(down)
    if routed_out is not None:  # added in the single-device order
        total += routed_out
    if shared_out is not None:
        total += shared_out
    out_ref[...] = total.astype(out_ref.dtype)


ROUTED_KEYS = ("w_ld", "latent_norm", "w_lu", "experts")


def moe_layer_body(plan: MoePlan, refs: StageRefs) -> None:
    """A whole MoE layer in one kernel: the router leaves ids/weights in the routing scratch
    (refs.scratch, VMEM and SMEM), the expert stage reads them there (no round trip through HBM).
    refs.weights: {"w_router", "router_bias" [1, E] f32, *ROUTED_KEYS, [w_sg, w_su, w_sd]}."""
    w, routing = refs.weights, refs.scratch
    logits = z = None
    rule = None if refs.shard is None else refs.shard.plan.rule(router.W_ROUTER)
    joined = rule is not None and rule.joins == LATENT_DOWN
    # expert reads first (`MegakernelOptions.expert_reads_first`): the ring's prefetches past the
    # last matrix streamed before routing wait for the experts' first DMAs (`_ExpertLoop`)
    blocks.hold_after(refs.stream, LATENT_DOWN if joined else router.W_ROUTER)
    if joined:
        # a rank: the router's and W_ld's column chunks (both of x) gathered in one collective,
        # before top-k; the first experts' DMAs then start after routing, as on one device
        rows = dict(plan.router)["block_rows"]
        ld_rows = blocks.weight_block_rows(tuple(w["w_ld"].shape), w["w_ld"].dtype)
        logits, z = refs.stream.matmuls(refs.x[...], ((w["w_router"], rows, router.W_ROUTER),
                                                      (w["w_ld"], ld_rows, LATENT_DOWN)))
        z = z.astype(jnp.bfloat16)  # [B, Lat]
    router.router_body(refs.x, w["w_router"], w["router_bias"], routing, stream=refs.stream,
                       logits=logits, **dict(plan.router))
    shared = gate_up.parts(w, SHARED_KEYS)
    ffn_stage_body(refs.x, refs.out, stream=refs.stream, options=plan.stage,
                   routed={key: w[key] for key in ROUTED_KEYS if key in w}, routing=routing,
                   always_on=shared, shard=refs.shard, z=z)


def dense_body(plan: StageOptions, refs: StageRefs) -> None:
    """The dense FFN: the stage with one always-on expert. refs.weights: w_gate, w_up, w_down."""
    ffn_stage_body(refs.x, refs.out, stream=refs.stream, options=plan,
                   always_on=gate_up.parts(refs.weights, gate_up.DENSE_KEYS))


_VMEM, _SMEM = pltpu.MemorySpace.VMEM, pltpu.MemorySpace.SMEM


def _spec(space):
    return pl.BlockSpec(memory_space=space)


def _hbm_specs(tree):
    return jax.tree.map(lambda _: _spec(pl.ANY), tree)


@functools.partial(jax.jit, static_argnames=("options", "out_dtype", "interpret", "recording"))
def stage_call(x, ids, weights, routed, always_on, *, options, out_dtype, interpret, recording):
    del recording  # static only so recorded and silent traces never share a jit cache entry
    args = (ids, x, ids, weights, routed, always_on)
    in_specs = (None if ids is None else _spec(_SMEM), _spec(_VMEM),
                None if ids is None else _spec(_VMEM), None if weights is None else _spec(_VMEM),
                _hbm_specs(routed), _hbm_specs(always_on))
    out_shape = jax.ShapeDtypeStruct(x.shape, out_dtype)

    def kernel(ids_smem, x_ref, ids_ref, weights_ref, routed_refs, always_on_refs, out_ref):
        routing = None if ids_ref is None else router.Routing(ids_ref, weights_ref, ids_smem, None)
        ffn_stage_body(x_ref, out_ref, stream=blocks.LOCAL_STREAM, options=options,
                       routed=routed_refs, routing=routing, always_on=always_on_refs)

    call = functools.partial(
        pl.pallas_call, kernel,
        out_shape=out_shape, in_specs=in_specs, out_specs=_spec(_VMEM), interpret=interpret,
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=VMEM_LIMIT_BYTES))
    # read off the body (kernels/base/costs.py), the routing sharing no expert while it can
    worst = {} if ids is None else {0: router.worst_routing(
        _n_experts(routed), ids.shape[0], ids.shape[1])}
    return costs.costed_call(call, *args, io=(ids, x, ids, weights, out_shape), inputs=worst)


@functools.partial(jax.jit, static_argnames=("options", "router_options", "interpret",
                                             "recording"))
def moe_layer_call(x, w_router, router_bias, routed, always_on, *, options, router_options,
                    interpret, recording):
    del recording
    batch, top_k = x.shape[0], dict(router_options)["top_k"]
    out_shape = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    plan = MoePlan(options, router_options, batch)
    weights = {"w_router": w_router, "router_bias": router_bias, **routed,
               **({SHARED_KEYS[part]: ref for part, ref in always_on.items()} if always_on
                  else {})}

    def kernel(x_ref, weight_refs, out_ref, *scratch):
        moe_layer_body(plan, StageRefs(x=x_ref, out=out_ref, weights=weight_refs,
                                       stream=blocks.LOCAL_STREAM, scratch=router.Routing(*scratch)))

    call = functools.partial(
        pl.pallas_call, kernel,
        out_shape=out_shape,
        in_specs=(_spec(_VMEM), _hbm_specs(weights)),
        out_specs=_spec(_VMEM),
        scratch_shapes=router.routing_scratch(batch, top_k),
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=VMEM_LIMIT_BYTES))
    # read off the body (kernels/base/costs.py), the routing sharing no expert while it can
    worst = router.worst_routing(_n_experts(routed), batch, top_k)
    return costs.costed_call(call, x, weights, io=(x, out_shape),
                             given={router.ROUTING: lambda layer: worst})


MAX_SLOTS = 8  # VMEM slots per expert matrix at most

# ---- checks (Python, before tracing) ----------------------------------------------------------
def check_stage_options(plan: Any, n_slots: Any, expert_format: Any) -> None:
    quant.check_format(expert_format)
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r} is invalid: one of {', '.join(map(repr, PLANS))}")
    if isinstance(n_slots, bool) or not isinstance(n_slots, int) \
            or not 1 <= n_slots <= MAX_SLOTS:
        raise ValueError(f"n_slots={n_slots!r} is invalid: an int in [1, {MAX_SLOTS}] (VMEM "
                         "slots per expert matrix; 1 = no overlap, 2 = double buffering)")


def check_input(x: Any, d_model: int) -> None:
    if getattr(x, "ndim", None) != 2 or x.shape[1] != d_model or x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 [B, d={d_model}], got {getattr(x, 'shape', x)} "
                         f"{getattr(x, 'dtype', '')}")


def check_routing(expert_ids: Any, expert_weights: Any, batch: int, n_experts: int) -> None:
    """ids [B, k] int32 with 1 <= k <= n_experts and values in [0, n_experts); weights [B, k]."""
    shape = getattr(expert_ids, "shape", None)
    if (shape is None or len(shape) != 2 or shape[0] != batch or not 1 <= shape[1] <= n_experts
            or expert_ids.dtype != jnp.int32):
        raise ValueError(f"expert_ids must be int32 [B={batch}, k] with 1 <= k <= "
                         f"n_experts={n_experts}, got {shape} {getattr(expert_ids, 'dtype', '')}")
    if getattr(expert_weights, "shape", None) != shape:
        raise ValueError(f"expert_weights must be [B, k]={shape} like expert_ids, got "
                         f"{getattr(expert_weights, 'shape', None)}")
    if not isinstance(expert_ids, jax.core.Tracer):
        values = np.asarray(expert_ids)
        if values.min() < 0 or values.max() >= n_experts:
            raise ValueError(f"expert_ids values must be in [0, n_experts={n_experts}), got "
                             f"[{values.min()}, {values.max()}]")


def expert_parts(experts: dict, cfg: ModelConfig, width: int | None = None) -> dict:
    """The experts subtree -> {"w1"|"w3"|"w2": tuple of parts [E, ...]}, shapes checked.
    width: what the experts work on (default the latent cfg.moe_latent)."""
    fmt, lat, hidden = cfg.expert_format, width or cfg.moe_latent, cfg.expert_hidden
    out = {}
    for m, (k, n) in zip(EXPERT_MATRICES, ((lat, hidden), (lat, hidden), (hidden, lat))):
        parts = quant.split_parts(experts[m], fmt)
        for name, got, want in zip(quant.part_names(fmt), parts, quant.part_structs(fmt, k, n)):
            if got.shape[1:] != want.shape or got.dtype != want.dtype:
                raise ValueError(f"experts[{m!r}] part {name!r} is {got.shape} {got.dtype}: "
                                 f"expected [E, {', '.join(map(str, want.shape))}] {want.dtype} "
                                 f"for expert_format={fmt!r}")
        out[m] = tuple(parts)
    return out


def stage_options(cfg: ModelConfig, plan: str, n_slots: int, always_on_name: str = "shared",
             chip: Any = None):
    """The stage's static options for cfg, built for `chip` (None: quant.mxfp4_decode_path's)."""
    check_stage_options(plan, n_slots, cfg.expert_format)  # cfg validated its activation
    return StageOptions(expert_format=cfg.expert_format,
                        mxfp4_decode=quant.mxfp4_decode_path(chip), mxu_input=cfg.expert_mxu,
                        plan=plan, n_slots=n_slots,
                        latent=cfg.moe_latent, latent_padded=cfg.moe_latent_padded,
                        eps=float(cfg.rms_eps), activation=cfg.activation,
                        always_on_name=always_on_name,
                        swiglu=(float(cfg.swiglu_alpha), float(cfg.swiglu_limit)))


def _routed_tree(p: dict, cfg: ModelConfig) -> dict:
    return {"w_ld": p["w_ld"], "latent_norm": p["latent_norm"].reshape(1, cfg.moe_latent),
            "w_lu": p["w_lu"], "experts": expert_parts(p["experts"], cfg)}


def _shared_tree(p: dict, cfg: ModelConfig) -> dict | None:
    if not cfg.n_shared_experts:
        return None
    return {"w_gate": p["w_sg"], "w_up": p["w_su"], "w_down": p["w_sd"]}


# ---- public wrappers: kernel twins of the reference sublayers ----------------------------------
def routed_experts(p: dict, x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array,
                   cfg: ModelConfig, *, plan: str = "unique", n_slots: int = 2,
                   chip: Any = None) -> jax.Array:
    """Kernel twin of reference.routed_experts -> f32 [B, d] (routed part only, no shared).
    chip: the kernel is built for it (None: tpu.target_chip(), see quant.mxfp4_decode_path)."""
    quant.check_runs_here(chip)
    options = stage_options(cfg, plan, n_slots, chip=chip)
    check_input(x, cfg.d_model)
    check_routing(expert_ids, expert_weights, x.shape[0], cfg.n_experts)
    return chip_log.run(
        lambda *args: stage_call(*args, None, options=options, out_dtype=jnp.float32,
                                 interpret=tpu.interpret_params(), recording=dma.is_recording()),
        x, expert_ids, expert_weights.astype(jnp.float32), _routed_tree(p, cfg))


def router_options(cfg: ModelConfig) -> tuple:
    """The router body's static options for cfg (hashable: part of a jit cache key)."""
    w_router = (cfg.d_model, cfg.n_experts)
    return (("top_k", cfg.top_k), ("router_score", cfg.router_score),
            ("use_bias", cfg.router_bias), ("routed_scale", float(cfg.routed_scale)),
            ("block_rows", blocks.weight_block_rows(w_router, jnp.bfloat16)))


def dense_options(cfg: ModelConfig) -> StageOptions:
    """The FFN stage as the dense layer: one always-on expert, no routing."""
    return StageOptions(eps=float(cfg.rms_eps), activation=cfg.activation, always_on_name="dense")


def moe_ffn(p: dict, x: jax.Array, cfg: ModelConfig, *, plan: str = "unique",
            n_slots: int = 2, chip: Any = None) -> jax.Array:
    """Kernel twin of reference.moe_ffn -> bf16 [B, d]: router + experts + shared, one kernel.
    chip: the kernel is built for it (None: tpu.target_chip(), see quant.mxfp4_decode_path)."""
    quant.check_runs_here(chip)
    options = stage_options(cfg, plan, n_slots, chip=chip)
    check_input(x, cfg.d_model)
    router.check_router_args(x, p["w_router"], p["router_bias"], cfg.top_k, cfg.router_score)
    bias = p["router_bias"].astype(jnp.float32).reshape(1, -1)  # not read unless cfg.router_bias
    return chip_log.run(
        lambda *args: moe_layer_call(*args, options=options, router_options=router_options(cfg),
                                     interpret=tpu.interpret_params(),
                                     recording=dma.is_recording()),
        x, p["w_router"], bias, _routed_tree(p, cfg), _shared_tree(p, cfg),
        given=lambda _: reference_routing(p, x, cfg))


def reference_routing(p: dict, x: jax.Array, cfg: ModelConfig) -> dict:
    """What a fused router + experts kernel's log on a TPU is given (`chip_log.run`): the
    reference router's choice on the same input (the kernel's own, but at a near-tie)."""
    ids = np.asarray(reference.route(p, x, cfg)[0])  # [B, k]
    return {router.ROUTING: lambda layer: ids}


def dense_ffn(p: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Kernel twin of reference.dense_ffn -> bf16 [B, d]: the stage with one always-on expert."""
    check_input(x, cfg.d_model)
    always_on = {"w_gate": p["w_gate"], "w_up": p["w_up"], "w_down": p["w_down"]}
    return chip_log.run(
        lambda x, always_on: stage_call(x, None, None, None, always_on,
                                        options=dense_options(cfg), out_dtype=jnp.bfloat16,
                                        interpret=tpu.interpret_params(),
                                        recording=dma.is_recording()),
        x, always_on)
