"""The megakernel: one grid-less `pallas_call` per decode step of a whole Kimi K3 stack.

    tokens [B] --DMA row gather--> e = E[token]           R_0 = P = e, R_1.. = 0    (spec §3.1)
    for ℓ in fori_loop(0, L):                              one traced layer body, not L copies
        h  = Mix(𝒜_ℓ; w_attn[ℓ])                          lax.switch on the candidate count
        R_n ← P  if ℓ mod block == 0
        a  = lax.cond(is_mla[ℓ], MLA body, KDA body)(RMSNorm(h))   weights: stack.at[index]
        P  = a  or  bf(P + a)
        h′ = Mix({R_0..R_n, P}; w_mlp[ℓ])
        m  = lax.cond(is_moe[ℓ], router + FFN stage body, dense FFN stage body)(RMSNorm(h′))
        P  = bf(P + m)
    tokens = sampling body (final mix, norm, LM head tiles, greedy / Gumbel sampling)

Every stage is the stage kernel's own body function (`kernels/kda.py`, `mla.py`, `router.py`,
`experts.py`, `sampling.py`), called on Refs: per-layer weights are views `stack.at[i]` of the
stacked HBM arrays, with `i` the layer's index within its kind, read from an SMEM layer table.
Caches and states are updated in place (input_output_aliases); activations never leave VMEM.

Weights stream HBM->VMEM through ONE global ring (`kernels/weight_stream.py`) that runs across
stage and layer boundaries: the bodies' `blocks.stream_matmul` calls draw from it while it is
active, so the next stage's and the next layer's first blocks are already in flight while the
current stage computes. Expert weights keep their own slot ring (issued right after routing),
KV tiles and the KDA state their own double buffers.

`plan_vmem` computes every VMEM buffer with its bytes before the kernel is built, and
`decode_step` refuses a plan over the chip's VMEM with a message listing it — and, first, a
config whose weights, caches and states exceed the chip's HBM per device
(`roofline.check_fits_hbm`).
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels import blocks, costs, dma, experts, kda, mla, quant, sampling, weight_stream
from mkresearch.kernels.weight_stream import ATTN_INDEX, FFN_INDEX, IS_MLA, IS_MOE, TABLE_FIELDS

from mkresearch import reference, roofline, tpu
from mkresearch import sampling as sampling_ref
from mkresearch.chips import get_chip
from mkresearch.config import BF16_SUBLANE, ModelConfig

# The activation block [B, d] bf16 fills at most one 16-row sublane tile; a larger batch would need
# a batch grid, which a single grid-less call does not have.
MAX_BATCH = BF16_SUBLANE
# VMEM Mosaic may use for its own temporaries (vregs spilled, relayouts) beyond the planned buffers.
VMEM_HEADROOM_BYTES = 4 * 2**20
# Rows of the aligned embedding block fetched per token (the HBM tiling of a bf16 [V, d] array).
EMBED_ROWS = BF16_SUBLANE


# ---- options and plan --------------------------------------------------------------------------
@dataclass(frozen=True)
class MegakernelOptions:
    """How the megakernel streams (config-like, validated by `check_options`).

    The global weight ring's depth and slot bytes are config fields (cfg.ring_depth,
    cfg.ring_block_bytes): they are part of the model's schedule, like cfg.kv_tile.

    expert_slots     VMEM slots per expert matrix (the first ones issued right after routing)
    expert_plan      which experts are fetched: "unique" (each distinct expert of the batch once)
    kv_tile          tokens per MLA KV tile (None: cfg.kv_tile)
    chip             the chip whose VMEM the plan must fit
    """

    expert_slots: int = 2
    expert_plan: str = "unique"
    kv_tile: int | None = None
    chip: str = "tpu7x"
    global_stream: bool = True


def check_options(options: Any, cfg: ModelConfig) -> MegakernelOptions:
    """ValueError naming the option and its allowed values."""
    if not isinstance(options, MegakernelOptions):
        raise ValueError(f"options={options!r} is invalid: a MegakernelOptions")  # noqa: TRY004
    if not isinstance(options.global_stream, bool):
        raise ValueError(f"global_stream={options.global_stream!r} is invalid: True or False")  # noqa: TRY004
    max_depth = weight_stream.max_ring_depth(cfg)
    if options.global_stream and cfg.ring_depth > max_depth:
        raise ValueError(f"ModelConfig.ring_depth={cfg.ring_depth} is invalid for the megakernel: "
                         f"an int in [2, {max_depth}] (the lookahead, ring_depth - 1 blocks, may "
                         f"cross at most one stage boundary; with ring_block_bytes="
                         f"{cfg.ring_block_bytes} the shortest stage of {cfg.name} streams "
                         f"{max_depth - 1} blocks)")
    experts.check_stage_options(options.expert_plan, options.expert_slots, cfg.expert_format)
    if options.expert_slots < 2:
        raise ValueError(f"expert_slots={options.expert_slots} is invalid: an int in [2, 8] (the "
                         "megakernel issues expert DMAs right after routing, ahead of their use)")
    get_chip(options.chip)  # ValueError listing the chips
    return options


@dataclass(frozen=True)
class VmemBuffer:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    scope: str  # "kernel" (whole call) or the stage whose scoped buffers it is


@dataclass(frozen=True)
class VmemPlan:
    """Every VMEM buffer of the megakernel with its bytes. Stage-scoped buffers of different
    stages are never live together (each stage body allocates and frees its own), so the peak is
    the kernel-wide buffers plus the largest stage."""

    buffers: tuple[VmemBuffer, ...]
    limit_bytes: int
    chip: str

    def stage_bytes(self, scope: str) -> int:
        return sum(b.nbytes for b in self.buffers if b.scope == scope)

    @property
    def scopes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(b.scope for b in self.buffers))

    @property
    def peak_stage(self) -> str:
        stages = [s for s in self.scopes if s != "kernel"]
        return max(stages, key=self.stage_bytes) if stages else "kernel"

    @property
    def total_bytes(self) -> int:
        peak = 0 if self.peak_stage == "kernel" else self.stage_bytes(self.peak_stage)
        return self.stage_bytes("kernel") + peak

    def fits(self) -> bool:
        return self.total_bytes <= self.limit_bytes

    def table(self) -> str:
        lines = [(f"VMEM plan for {self.chip}: {self.total_bytes / 2**20:.2f} MiB peak (kernel-wide "
                  f"+ {self.peak_stage}) of {self.limit_bytes / 2**20:.2f} MiB usable")]
        for scope in self.scopes:
            lines.append(f"  [{scope}] {self.stage_bytes(scope) / 2**20:.3f} MiB")
            for b in self.buffers:
                if b.scope == scope:
                    lines.append(f"    {b.name:28s} {list(b.shape)!s:28s} {b.dtype:9s} "
                                 f"{b.nbytes:>12,d} B")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class VmemPlanError(ValueError):
    """The megakernel's VMEM plan does not fit the chip."""


def _buf(name, shape, dtype, scope) -> VmemBuffer:
    shape = tuple(int(s) for s in shape)
    return VmemBuffer(name, shape, jnp.dtype(dtype).name, blocks.nbytes(shape, dtype), scope)


@dataclass(frozen=True)
class MegaPlan:
    """Everything static about one megakernel build (hashable: a jit static argument)."""

    cfg: ModelConfig
    batch: int
    seq_len: int
    options: MegakernelOptions
    kda_plan: Any
    mla_plan: Any
    stage_options: experts.StageOptions
    dense_options: experts.StageOptions
    router_options: tuple
    vocab_tile: int
    layer_table: tuple[int, ...]
    stream: Any  # weight_stream.StreamPlan or None
    vmem: VmemPlan = field(compare=False, hash=False)


def make_plan(cfg: ModelConfig, batch: int, seq_len: int,
              options: MegakernelOptions = MegakernelOptions()) -> MegaPlan:
    """Check sizes and options (ValueError naming them) and fix every static size, VMEM included.

    Raises a ValueError naming the bytes when weights, caches and states do not fit the HBM of
    one options.chip device, and VmemPlanError (a ValueError) listing the plan when it does not
    fit the chip's VMEM."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg={cfg!r} is invalid: a mkresearch.config.ModelConfig")  # noqa: TRY004
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch={batch!r} is invalid: an int in [1, {MAX_BATCH}] (the megakernel "
                         f"holds the [B, d] activations in one {BF16_SUBLANE}-row bf16 tile; split "
                         "larger batches into several calls)")
    if not cfg.kda_layers or not cfg.mla_layers or not cfg.moe_layers or not cfg.dense_layers:
        raise ValueError(f"cfg={cfg.name!r} is not supported: the megakernel needs KDA, MLA, dense "
                         "and MoE layers (every Kimi K3 preset has all four)")
    options = check_options(options, cfg)
    batch = int(batch)
    # weights, caches and states must fit the device's HBM: refused here, not by the compiler
    roofline.check_fits_hbm(cfg, options.chip, batch, seq_len)
    kv_tile = cfg.kv_tile if options.kv_tile is None else options.kv_tile
    kda_plan = kda.make_plan(cfg, batch)
    mla_plan = mla.make_plan(cfg, batch, seq_len, kv_tile=kv_tile)
    stage_options = experts._options(cfg, options.expert_plan, options.expert_slots,
                                     chip=options.chip)
    dense_options, router_options = experts.dense_options(cfg), experts.router_options(cfg)
    vocab_tile = sampling.default_vocab_tile(cfg.d_model, cfg.vocab_size)
    stream = weight_stream.make_stream_plan(cfg) if options.global_stream else None
    chip = get_chip(options.chip)
    vmem = plan_vmem(cfg, batch, mla_plan, stage_options, vocab_tile, stream, chip)
    if not vmem.fits():
        raise VmemPlanError(
            f"the megakernel's VMEM plan needs {vmem.total_bytes / 2**20:.2f} MiB but {chip.name} "
            f"has {vmem.limit_bytes / 2**20:.2f} MiB usable per TensorCore: lower the config's "
            f"ring_depth, ring_block_bytes or kv_tile, the option expert_slots, or the batch.\n{vmem.table()}")
    return MegaPlan(cfg=cfg, batch=batch, seq_len=seq_len, options=options, kda_plan=kda_plan,
                    mla_plan=mla_plan, stage_options=stage_options, dense_options=dense_options,
                    router_options=router_options, vocab_tile=vocab_tile,
                    layer_table=weight_stream.layer_table(cfg), stream=stream, vmem=vmem)


def plan_vmem(cfg: ModelConfig, batch: int, mla_plan: Any, stage_options: Any, vocab_tile: int,
              stream: Any, chip: Any) -> VmemPlan:
    """Every VMEM buffer of the megakernel (the stage bodies' scoped buffers included)."""
    b, d, h = batch, cfg.d_model, cfg.n_heads
    bf, f4, i4 = jnp.bfloat16, jnp.float32, jnp.int32
    out = [_buf("snapshots R", (cfg.n_blocks, b, d), bf, "kernel"),
           _buf("partial P", (b, d), bf, "kernel"),
           _buf("stage input x", (b, d), bf, "kernel"),
           _buf("stage output", (b, d), bf, "kernel"),
           _buf("embedding blocks", (b, EMBED_ROWS, d), bf, "kernel"),
           _buf("mix/norm weights", (4, 1, d), f4, "kernel"),
           _buf("router ids", (b, cfg.top_k), i4, "kernel"),
           _buf("router weights", (b, cfg.top_k), f4, "kernel"),
           _buf("sampling outputs", (2, b, 1), i4, "kernel")]
    if stream is not None:
        out.append(_buf("weight ring", (stream.depth, *stream.slot_shape), bf, "kernel"))

    def max_block(shapes, scope):  # a stage body's own two-slot ring for what is not streamed
        if stream is not None:
            shapes = [s for s in shapes if s[1] % 128]
        if not shapes:
            return []
        rows_n = [(blocks.weight_block_rows(s, bf), s[1]) for s in shapes]
        biggest = max(rows_n, key=lambda r: r[0] * r[1])
        return [_buf(f"{scope} own weight ring", (2, *biggest), bf, scope)]

    hd, dk = cfg.kda_width, cfg.kda_head_dim
    kda_scope = "KDA"
    out += [_buf("conv state", (b, cfg.kda_conv_size - 1, 3, h, dk), bf, kda_scope),
            _buf("recurrent state", (b, h, dk, dk), f4, kda_scope),
            _buf("pre-conv q/k/v", (b, 3, h, dk), f4, kda_scope),
            _buf("y", (b, hd), f4, kda_scope),
            _buf("conv taps", (3, cfg.kda_conv_size, hd), bf, kda_scope)]
    out += max_block([s for n, s in kda.weight_shapes(cfg).items() if n in kda.MATRICES],
                     kda_scope)
    p = mla_plan
    mla_scope = f"MLA ({p.layout})"
    out += [_buf("y", (b, h * p.v_dim), f4, mla_scope)]
    if p.layout == "expanded":
        out += [_buf("K tiles", (2, h, p.kv_tile, p.k_padded), bf, mla_scope),
                _buf("V tiles", (2, h, p.kv_tile, p.v_dim), bf, mla_scope),
                _buf("update block K+V", (h, mla.UPDATE_ROWS, p.k_padded + p.v_dim), bf, mla_scope)]
    else:
        out += [_buf("W_kvb (absorbed)", (p.kv_rank, h * (p.qk_nope + p.v_dim)), bf, mla_scope),
                _buf("ĉ tiles", (2, p.kv_tile, p.kv_rank), bf, mla_scope),
                _buf("k^X tiles", (2, p.kv_tile, p.qk_extra), bf, mla_scope),
                _buf("q latent", (h, p.kv_rank + p.qk_extra), f4, mla_scope)]
    out += max_block([s for n, s in mla.weight_shapes(cfg).items() if len(s) == 2], mla_scope)
    moe_scope = "MoE"
    n_slots = stage_options.n_slots
    for m, (k, n) in zip(experts.EXPERT_MATRICES,
                         ((cfg.moe_latent, cfg.expert_hidden), (cfg.moe_latent, cfg.expert_hidden),
                          (cfg.expert_hidden, cfg.moe_latent))):
        for name, s in zip(quant.part_names(cfg.expert_format),
                           quant.part_structs(cfg.expert_format, k, n)):
            out.append(_buf(f"expert {m}/{name} slots", (n_slots, *s.shape), s.dtype, moe_scope))
    out += [_buf("latent ρ (padded)", (b, cfg.moe_latent_padded), f4, moe_scope),
            _buf("dedupe lists (SMEM)", (0,), i4, moe_scope)]
    out += max_block([(d, cfg.n_experts), (d, cfg.moe_latent), (cfg.moe_latent, d),
                      (d, cfg.shared_hidden), (cfg.shared_hidden, d)], moe_scope)
    out += max_block([(d, cfg.dense_hidden), (cfg.dense_hidden, d)], "dense")
    out += [_buf("LM head tiles", (2, d, vocab_tile), bf, "sampling"),
            _buf("final mix inputs", (cfg.n_blocks + 1, b, d), f4, "sampling")]
    limit = int(chip.vmem_bytes) - VMEM_HEADROOM_BYTES
    return VmemPlan(tuple(out), limit, chip.name)


# ---- the body ----------------------------------------------------------------------------------
def _mix(n_snapshots, snapshots_ref, partial, w, eps, n_blocks):
    """reference.mix over {R_0..R_{n-1}, P} with a traced n: one static branch per count."""
    def branch(k):
        def mixed():
            parts = ([snapshots_ref[0:k]] if k else []) + [partial[None]]
            return reference.mix(jnp.concatenate(parts, axis=0), w, eps)  # [B, d] bf16
        return mixed

    return lax.switch(n_snapshots, [branch(k) for k in range(n_blocks + 1)])


def megakernel_body(plan: MegaPlan, treedef: Any, use_gumbel: bool, use_candidates: bool,
                    *refs: Any) -> None:
    """The whole decode step. refs (inputs, outputs) in the order `_call` builds them:

    tokens, positions [B] i32, seed [1] i32, layer table [4L] i32 (SMEM); positions + 1, top_k
    [B, 1] i32, temperature, top_p [B, 1] f32 (VMEM); the weight pytree leaves (HBM); kda_conv,
    kda_state, mla cache a, b (HBM, aliased) -> tokens, overflow [B, 1] i32 (VMEM), [logits
    [B, V] f32], then the aliased state outputs.
    """
    cfg, batch = plan.cfg, plan.batch
    n_leaves = treedef.num_leaves
    (tokens_smem, positions_smem, seed_smem, table_smem, sample_pos_ref, temperature_ref,
     top_k_ref, top_p_ref) = refs[:8]
    w = jax.tree.unflatten(treedef, refs[8:8 + n_leaves])
    conv_in, kstate_in, cache_a_in, cache_b_in = refs[8 + n_leaves:12 + n_leaves]
    outs = refs[12 + n_leaves:]
    tokens_out, overflow_out = outs[:2]
    logits_out = outs[2] if len(outs) == 7 else None
    conv_out, kstate_out, cache_a_out, cache_b_out = outs[-4:]
    eps, d, n_blocks = cfg.rms_eps, cfg.d_model, cfg.n_blocks

    def scoped(snapshots, partial_ref, x_ref, out_ref, vectors, ids_ref, weights_ref, ids_smem,
               weights_smem, sems, *ring):
        stream = (weight_stream.GlobalStream(plan.stream, *ring, w, table_smem, cfg.n_layers)
                  if plan.stream is not None else None)
        # 1. e = E[token]. HBM is tiled in 16-row bf16 groups: a DMA window must start on one, so
        # each row's aligned 16-row block is fetched and the row picked in VMEM (exact: one hit).
        def gather(blocks_vmem):  # [B, 16, d] bf16
            copies = []
            for b in range(batch):
                start = pl.multiple_of(lax.div(tokens_smem[b], EMBED_ROWS) * EMBED_ROWS, EMBED_ROWS)
                copies.append(dma.Copy(w["embed"].at[pl.ds(start, EMBED_ROWS), :],
                                       blocks_vmem.at[b], sems.at[b], name="embed", row=b))
                copies[-1].start()
            with dma.phase("embed"):
                embedded = jnp.zeros((batch, d), jnp.float32)
                for b, copy in enumerate(copies):
                    copy.wait()
                    row = blocks.select_row(blocks_vmem[b], lax.rem(tokens_smem[b], EMBED_ROWS))
                    embedded = blocks.put_row(embedded, b, row)
                embedded = embedded.astype(jnp.bfloat16)  # [B, d], exactly E[token]
                partial_ref[...] = embedded
                snapshots[...] = jnp.zeros(snapshots.shape, snapshots.dtype)
                snapshots[0] = embedded

        pl.run_scoped(gather, pltpu.VMEM((batch, EMBED_ROWS, d), jnp.bfloat16))
        if stream is not None:  # layer 0's first weight blocks fly from the start
            stream.prologue()

        def load_vectors(layer):  # this layer's mix weights and norm gains, [1, d] each
            names = ("mix_attn", "attn_norm", "mix_mlp", "mlp_norm")
            copies = [dma.Copy(w[n].at[layer], vectors.at[i], sems.at[i], name=n, layer=layer)
                      for i, n in enumerate(names)]
            for copy in copies:
                copy.start()
            for copy in copies:
                copy.wait()

        def layer_step(layer, carry):
            row = layer * len(TABLE_FIELDS)
            is_mla, attn_i = table_smem[row + IS_MLA], table_smem[row + ATTN_INDEX]
            is_moe, ffn_i = table_smem[row + IS_MOE], table_smem[row + FFN_INDEX]
            block, offset = lax.div(layer, cfg.attn_res_block), lax.rem(layer, cfg.attn_res_block)
            block_start = offset == 0
            load_vectors(layer)
            # 2.1 h = Mix(𝒜_ℓ): ℓ = 0 → {P}; block start → {R_0..R_{n-1}, P}; else {R_0..R_n, P}
            with dma.phase("mix_attn", layer=layer):
                n_attn = jnp.where(layer == 0, 0, jnp.where(block_start, block, block + 1))
                h = _mix(n_attn, snapshots, partial_ref[...], vectors[0], eps, n_blocks)

                @pl.when(block_start)  # 2.2 a new block: snapshot the previous block's sum
                def _():
                    snapshots[block] = partial_ref[...]

                x_ref[...] = reference.rms_norm(h, vectors[1].astype(jnp.bfloat16), eps)

            # 2.3 a = Attn_ℓ(x): the stage bodies on this layer's slices of the stacks
            def kda_branch():
                p = w["kda"]
                layer_weights = [p[n].at[attn_i] for n in kda.WEIGHT_NAMES]
                kda.kda_attention_body(plan.kda_plan, x_ref, *layer_weights, conv_in.at[attn_i],
                                       kstate_in.at[attn_i], out_ref, conv_out.at[attn_i],
                                       kstate_out.at[attn_i], layer=layer)

            def mla_branch():
                p = w["mla"]
                layer_weights = [p[n].at[attn_i] for n in mla.WEIGHT_NAMES]
                mla.mla_attention_body(plan.mla_plan, positions_smem, x_ref, *layer_weights,
                                       cache_a_in.at[attn_i], cache_b_in.at[attn_i], out_ref,
                                       cache_a_out.at[attn_i], cache_b_out.at[attn_i],
                                       layer=layer)

            lax.cond(is_mla == 1, _staged(stream, "mla", mla_branch, layer, attn_i),
                     _staged(stream, "kda", kda_branch, layer, attn_i))
            # 2.4 P ← a at a block start, else bf(P + a); 2.5 h′ = Mix({R_0..R_n, P})
            with dma.phase("mix_mlp", layer=layer):
                a = out_ref[...]
                partial = jnp.where(block_start, a, (partial_ref[...].astype(jnp.float32)
                                                     + a.astype(jnp.float32)).astype(jnp.bfloat16))
                partial_ref[...] = partial
                h = _mix(block + 1, snapshots, partial, vectors[2], eps, n_blocks)
                x_ref[...] = reference.rms_norm(h, vectors[3].astype(jnp.bfloat16), eps)

            # 2.6 m = FFN_ℓ(x): router + routed/shared experts, or the dense MLP
            def moe_branch():
                p = w["moe"]
                routed = {"w_ld": p["w_ld"].at[ffn_i], "latent_norm": p["latent_norm"].at[ffn_i],
                          "w_lu": p["w_lu"].at[ffn_i],
                          "experts": {m: tuple(part.at[ffn_i] for part in p["experts"][m])
                                      for m in experts.EXPERT_MATRICES}}
                shared = ({"w_gate": p["w_sg"].at[ffn_i], "w_up": p["w_su"].at[ffn_i],
                           "w_down": p["w_sd"].at[ffn_i]} if cfg.n_shared_experts else None)
                experts.moe_layer_body(x_ref, p["w_router"].at[ffn_i], p["router_bias"].at[ffn_i],
                                       routed, shared, out_ref, ids_ref, weights_ref, ids_smem,
                                       weights_smem, options=plan.stage_options,
                                       router_options=dict(plan.router_options))

            def dense_branch():
                p = w["dense"]
                always_on = {"w_gate": p["w_gate"].at[ffn_i], "w_up": p["w_up"].at[ffn_i],
                             "w_down": p["w_down"].at[ffn_i]}
                experts.ffn_stage_body(None, x_ref, None, None, None, always_on, out_ref,
                                       options=plan.dense_options)

            lax.cond(is_moe == 1, _staged(stream, "moe", moe_branch, layer, ffn_i),
                     _staged(stream, "dense", dense_branch, layer, ffn_i))
            # 2.7 P ← bf(P + m)
            partial_ref[...] = (partial_ref[...].astype(jnp.float32)
                                + out_ref[...].astype(jnp.float32)).astype(jnp.bfloat16)
            return carry

        if stream is None:
            lax.fori_loop(0, cfg.n_layers, layer_step, 0)
        else:  # the stage bodies' stream_matmul calls draw from the global ring
            with blocks.global_weight_stream(stream):
                lax.fori_loop(0, cfg.n_layers, layer_step, 0)

        # 3. final mix, norm, LM head tiles and sampling: the sampling stage's body
        def with_head(mix_out_ref, final_norm_ref, tile_slots, tile_sems):
            copies = [dma.Copy(w["mix_out"], mix_out_ref, sems.at[0], name="mix_out"),
                      dma.Copy(w["final_norm"], final_norm_ref, sems.at[1], name="final_norm")]
            for copy in copies:
                copy.start()
            for copy in copies:
                copy.wait()
            rest = ([logits_out] if logits_out is not None else []) + [tile_slots, tile_sems]
            sampling.sampling_body(seed_smem, sample_pos_ref, temperature_ref, top_k_ref,
                                   top_p_ref, snapshots, partial_ref, mix_out_ref, final_norm_ref,
                                   w["lm_head"], tokens_out, overflow_out, *rest,
                                   vocab_tile=plan.vocab_tile, candidates=sampling.MAX_CANDIDATES,
                                   eps=eps, softcap=cfg.logit_softcap, use_gumbel=use_gumbel,
                                   use_candidates=use_candidates,
                                   return_logits=logits_out is not None)

        pl.run_scoped(with_head, pltpu.VMEM((1, d), jnp.float32), pltpu.VMEM((1, d), jnp.bfloat16),
                      pltpu.VMEM((2, d, plan.vocab_tile), jnp.bfloat16),
                      pltpu.SemaphoreType.DMA((2,)))

    ring = ([pltpu.VMEM((plan.stream.depth, *plan.stream.slot_shape), jnp.bfloat16),
             pltpu.SemaphoreType.DMA((plan.stream.depth,)), pltpu.SMEM((1,), jnp.int32)]
            if plan.stream is not None else [])
    k = cfg.top_k
    pl.run_scoped(scoped, pltpu.VMEM((n_blocks, batch, d), jnp.bfloat16),
                  pltpu.VMEM((batch, d), jnp.bfloat16), pltpu.VMEM((batch, d), jnp.bfloat16),
                  pltpu.VMEM((batch, d), jnp.bfloat16), pltpu.VMEM((4, 1, d), jnp.float32),
                  pltpu.VMEM((batch, k), jnp.int32), pltpu.VMEM((batch, k), jnp.float32),
                  pltpu.SMEM((batch, k), jnp.int32), pltpu.SMEM((batch, k), jnp.float32),
                  pltpu.SemaphoreType.DMA((max(4, batch),)), *ring)  # one per embedding row


def _staged(stream, kind, branch, layer, index):
    """A cond branch running one stage body inside the global stream's bracket for that stage."""
    def run():
        with stream.stage(kind, layer, index) if stream is not None else contextlib.nullcontext():
            branch()
    return run


# ---- the wrapper -------------------------------------------------------------------------------
def _vector_rows(stack: Any) -> Any:
    """A stacked vector [n, x] -> [n, 1, x], so that `stack.at[i]` is a [1, x] row (VMEM tiles)."""
    return stack.reshape(stack.shape[0], 1, -1)


def is_prepared(weights: Any) -> bool:
    """Whether `weights` is already the kernel's pytree (`prepare_weights`), not the parameters."""
    try:
        return isinstance(weights["moe"]["experts"]["w1"], tuple)
    except (KeyError, TypeError):
        return False


def prepare_weights(params: dict, cfg: ModelConfig) -> dict:
    """The parameter pytree as the kernel takes it, made once (not per step): stacked matrices as
    they are, vectors as [n, 1, x] rows (a VMEM row per layer), expert matrices as tuples of their
    stored parts. Every leaf stays in HBM; the kernel DMAs what each layer needs."""
    if is_prepared(params):
        return params
    kda_p = {n: (_vector_rows(params["kda"][n]) if params["kda"][n].ndim == 2 else params["kda"][n])
             for n in kda.WEIGHT_NAMES}
    mla_p = {n: (_vector_rows(params["mla"][n]) if params["mla"][n].ndim == 2
                 and n in ("q_norm", "kv_norm") else params["mla"][n]) for n in mla.WEIGHT_NAMES}
    moe = params["moe"]
    moe_p = {"w_router": moe["w_router"],
             "router_bias": _vector_rows(moe["router_bias"].astype(jnp.float32)),
             "w_ld": moe["w_ld"], "latent_norm": _vector_rows(moe["latent_norm"]),
             "w_lu": moe["w_lu"],
             "experts": {m: tuple(quant.split_parts(moe["experts"][m], cfg.expert_format))
                         for m in experts.EXPERT_MATRICES}}
    if cfg.n_shared_experts:
        moe_p.update(w_sg=moe["w_sg"], w_su=moe["w_su"], w_sd=moe["w_sd"])
    return {"embed": params["embed"], "lm_head": params["lm_head"],
            "final_norm": params["final_norm"].reshape(1, -1),
            "mix_out": params["mix_out"].reshape(1, -1),
            "mix_attn": _vector_rows(params["mix_attn"]), "mix_mlp": _vector_rows(params["mix_mlp"]),
            "attn_norm": _vector_rows(params["attn_norm"].astype(jnp.float32)),
            "mlp_norm": _vector_rows(params["mlp_norm"].astype(jnp.float32)),
            "kda": kda_p, "mla": mla_p, "dense": dict(params["dense"]), "moe": moe_p}


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=(15,))
def _call(plan: MegaPlan, interpret: Any, recording: bool, use_gumbel: bool, use_candidates: bool,
          return_logits: bool, tokens, positions, seed, table, sample_positions, temperature,
          top_k, top_p, weights, state):
    del recording  # static only so recorded and silent traces never share a jit cache entry
    cfg, batch = plan.cfg, plan.batch
    leaves, treedef = jax.tree.flatten(weights)
    names = mla.CACHE_NAMES[cfg.mla_cache_layout]
    state_leaves = [state["kda"]["conv"], state["kda"]["recurrent"], state["mla"][names[0]],
                    state["mla"][names[1]]]
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    column = lambda dtype: jax.ShapeDtypeStruct((batch, 1), dtype)
    out_shape = [column(jnp.int32), column(jnp.int32)]
    if return_logits:
        out_shape.append(jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32))
    # every stage body over its layers (kernels/costs.py); + the SMEM/VMEM operands and results
    cost = costs.megakernel(plan, weights, state).estimate(
        tokens, positions, seed, table, sample_positions, temperature, top_k, top_p, out_shape)
    out_shape += [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in state_leaves]
    n_in = 8 + len(leaves)
    outs = pl.pallas_call(
        functools.partial(megakernel_body, plan, treedef, use_gumbel, use_candidates),
        out_shape=out_shape,
        in_specs=[smem] * 4 + [vmem] * 4 + [hbm] * (len(leaves) + 4),
        out_specs=[vmem] * (3 if return_logits else 2) + [hbm] * 4,
        input_output_aliases={n_in + i: len(out_shape) - 4 + i for i in range(4)},
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=plan.vmem.limit_bytes),
        cost_estimate=cost,
        interpret=interpret,
    )(tokens, positions, seed, table, sample_positions, temperature, top_k, top_p, *leaves,
      *state_leaves)
    new_state = {"kda": {"conv": outs[-4], "recurrent": outs[-3]},
                 "mla": {names[0]: outs[-2], names[1]: outs[-1]}}
    return outs[0][:, 0], outs[1][:, 0] != 0, (outs[2] if return_logits else None), new_state


def check_state(state: Any, cfg: ModelConfig, batch: int) -> int:
    """ValueError naming what is wrong with the state; returns the cache length."""
    return reference.check_state(state, cfg, batch)


def decode_step(params: dict, state: dict, tokens: Any, positions: Any, cfg: ModelConfig, *,
                seed: int = 0, temperature: Any = None, top_k: Any = 0, top_p: Any = 1.0,
                options: MegakernelOptions = MegakernelOptions(),
                return_logits: bool = False) -> tuple[jax.Array, dict, dict]:
    """One decode step of the whole model in ONE pallas_call -> (next tokens [B], state, aux).

    Same contract as `reference.decode_step` followed by `sampling.sample(logits, seed=seed,
    positions=positions + 1, ...)` (the next token is drawn for position p + 1, as in
    `reference.generate`). The state is donated and updated in place. aux: "nucleus_overflow"
    [B] bool, "logits" [B, V] f32 when return_logits (checking only), "plan" (the MegaPlan).
    """
    if np.ndim(tokens) != 1:
        raise ValueError(f"tokens has shape {np.shape(tokens)}: allowed [B] (one token per row)")
    batch = np.shape(tokens)[0]
    if np.shape(positions) != (batch,):
        raise ValueError(f"positions has shape {np.shape(positions)}: allowed ({batch},)")
    if isinstance(cfg, ModelConfig) and batch > MAX_BATCH:
        raise ValueError(f"batch={batch} is invalid: an int in [1, {MAX_BATCH}] (the megakernel "
                         f"holds the [B, d] activations in one {BF16_SUBLANE}-row bf16 tile; "
                         "split larger batches into several calls)")
    seq_len = check_state(state, cfg, batch)
    if not isinstance(positions, jax.core.Tracer):
        pos = np.asarray(positions)
        if pos.min() < 0 or pos.max() >= seq_len:
            raise ValueError(f"positions={pos.tolist()} is invalid: each in [0, {seq_len}) — the "
                             f"cache holds {seq_len} tokens (init_state(cfg, batch, max_seq_len=...)"
                             " for a longer one)")
    if not isinstance(tokens, jax.core.Tracer):
        tok = np.asarray(tokens)
        if tok.min() < 0 or tok.max() >= cfg.vocab_size:
            raise ValueError(f"tokens={tok.tolist()} is invalid: each in [0, {cfg.vocab_size})")
    plan = make_plan(cfg, batch, seq_len, options)
    sampling_ref._check_seed(seed)
    sp = sampling_ref.check_params(batch, cfg.vocab_size, temperature=temperature, top_k=top_k,
                                   top_p=top_p, candidates=sampling.MAX_CANDIDATES)
    sampled = sp.temperature > 0
    truncated = (sp.top_k > 0) | (sp.top_p < 1)
    seed_i32 = np.asarray(np.uint32(int(seed) % 2**32)).view(np.int32).reshape(1)
    positions = jnp.asarray(positions, jnp.int32)
    tokens_out, overflow, logits, new_state = _call(
        plan, tpu.interpret_params(), dma.is_recording(), bool(np.any(sampled & ~truncated)),
        bool(np.any(sampled & truncated)), bool(return_logits),
        jnp.asarray(tokens, jnp.int32), positions, jnp.asarray(seed_i32),
        jnp.asarray(plan.layer_table, jnp.int32), (positions + 1)[:, None],
        jnp.asarray(sp.temperature)[:, None], jnp.asarray(sp.top_k)[:, None],
        jnp.asarray(sp.top_p)[:, None], prepare_weights(params, cfg), state)
    aux = {"nucleus_overflow": overflow, "plan": plan}
    if return_logits:
        aux["logits"] = logits
    return tokens_out, new_state, aux


# ---- compiling for a TPU on this machine -------------------------------------------------------
def step_fn(plan: MegaPlan):
    """(weights, state, tokens [B], positions [B], seed [1], layer table, sample positions,
    temperature, top_k, top_p [B, 1]) -> (tokens, overflow, None, state): the greedy step of `plan`
    on prepared weights, for `tpu.compile_for` (interpret_params() is None there)."""
    def step(weights, state, tokens, positions, seed, table, sample_positions, temperature,
             top_k, top_p):
        return _call(plan, tpu.interpret_params(), False, False, False, False, tokens, positions,
                     seed, table, sample_positions, temperature, top_k, top_p, weights, state)

    return step


def step_shapes(plan: MegaPlan) -> tuple:
    """Shape structs of every argument of `step_fn(plan)` (no allocation: full size is safe)."""
    from mkresearch import weights

    cfg, batch = plan.cfg, plan.batch
    params = weights.param_shapes(cfg)
    prepared = jax.eval_shape(lambda p: prepare_weights(p, cfg), params)
    state = jax.eval_shape(lambda: reference.init_state(cfg, batch, plan.seq_len))
    i32, f32 = jnp.int32, jnp.float32
    s = jax.ShapeDtypeStruct
    column = lambda dtype: s((batch, 1), dtype)
    return (prepared, state, s((batch,), i32), s((batch,), i32), s((1,), i32),
            s((len(plan.layer_table),), i32), column(i32), column(f32), column(i32), column(f32))


def compile_step(cfg: ModelConfig, batch: int = 1, *, chip: str = "tpu7x",
                 options: MegakernelOptions | None = None, seq_len: int | None = None):
    """Compile one megakernel decode step for `chip` from shapes only -> (CompileResult, plan).
    `options.chip`, if options are given, must be `chip`: the plan is built for it."""
    options = MegakernelOptions(chip=chip) if options is None else options
    if getattr(options, "chip", chip) != chip:
        raise ValueError(f"options.chip={options.chip!r} differs from chip={chip!r}: the plan "
                         "(VMEM, MXFP4 decode path) is built for options.chip; pass the same chip")
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    plan = make_plan(cfg, batch, seq_len, options)
    return tpu.compile_for(step_fn(plan), *step_shapes(plan), chip=chip), plan


def compile_reference_step(cfg: ModelConfig, batch: int = 1, *, chip: str = "tpu7x"):
    """Compile `reference.decode_step` (plain XLA) for `chip` -> CompileResult."""
    from mkresearch import weights

    roofline.check_fits_hbm(cfg, chip, batch)
    state = jax.eval_shape(lambda: reference.init_state(cfg, batch))
    ids = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return tpu.compile_for(lambda p, s, t, q: reference._decode_step(p, s, t, q, cfg),
                           weights.param_shapes(cfg), state, ids, ids, chip=chip)


_HLO_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_HLO_CALLS = re.compile(r"(?:body|condition|true_computation|false_computation|to_apply_loop)=%?([\w.\-]+)"
                        r"|branch_computations=\{([^}]*)\}")
# Opcodes XLA emits as kernels of their own on a TPU (everything else is fused or free).
_KERNEL_OPCODES = {"fusion", "custom-call", "copy", "convolution", "dot", "sort", "all-reduce",
                   "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "scatter",
                   "gather", "reduce", "dynamic-update-slice", "dynamic-slice", "copy-start"}


def count_xla_kernels(hlo_text: str) -> int:
    """Kernels a compiled XLA program launches per step: the fusions, custom calls (Mosaic
    kernels among them) and other un-fused ops of the entry computation and of the computations
    it runs as loops and branches (not those inside fusions), each counted once per program."""
    computations, current = {}, None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            computations[current] = []
        elif current is not None and line.startswith("}"):
            current = None
        elif current is not None:
            computations[current].append(line)
    seen, todo, count = set(), ["ENTRY"], 0
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for line in computations[name]:
            match = _HLO_OPCODE.match(line)
            if match and match.group(1) in _KERNEL_OPCODES:
                count += 1
            for single, branches in _HLO_CALLS.findall(line):
                todo += [single] if single else [b.strip().lstrip("%") for b in branches.split(",")]
    return count


# ---- the schedule, read back from a recorded step ---------------------------------------------
def late_prefetches(log: dma.DmaLog, n_layers: int) -> dict[str, list[int]]:
    """Where the global weight stream did NOT run ahead in a recorded step (empty lists: it always did).

    ffn: layers whose FFN's first weight block was not issued before attention's last block was
    waited for; next_layer: layers l whose layer l+1's first block was not issued before l's FFN
    ends; experts: MoE calls (in order) whose first expert DMA did not come right after routing,
    before the latent down-projection was waited for."""
    events = log.events

    def first(kind, names, layer):
        return next(i for i, e in enumerate(events) if e.kind == kind and e.name in names
                    and e.indices.get("layer") == layer)

    def last(kind, names, layer):
        return max(i for i, e in enumerate(events) if e.kind == kind and e.name in names
                   and e.indices.get("layer") == layer)

    late = {"ffn": [], "next_layer": [], "experts": []}
    for layer in range(n_layers):
        if first("dma_start", {"latent/w_ld", "dense/w_gate"}, layer) > last(
                "dma_wait", {"kda.w_o", "mla.w_o"}, layer):
            late["ffn"].append(layer)
        if layer + 1 < n_layers and first("dma_start", {"kda.w_fa", "mla.w_qa"}, layer + 1) > last(
                "dma_wait", {"shared/w_down", "dense/w_down"}, layer):
            late["next_layer"].append(layer)
    routed = [i for i, e in enumerate(events)
              if e.name == "router/weights_to_smem" and e.kind == "dma_wait"]
    for call, i in enumerate(routed):
        expert = next(j for j in range(i, len(events)) if events[j].name.startswith("expert/"))
        latent = next(j for j in range(i, len(events))
                      if events[j].name == "latent/w_ld" and events[j].kind == "dma_wait")
        if events[expert].kind != "dma_start" or expert > latent:
            late["experts"].append(call)
    return late


# ---- bytes: what a step moves against the least it could ----------------------------------------
def hbm_bytes(log: dma.DmaLog) -> int:
    """Bytes of the DMAs of a recorded step that touch HBM (VMEM->SMEM copies excluded)."""
    return sum(e.nbytes for e in log.select("dma_start") if "hbm" in (e.src, e.dst))


@dataclass(frozen=True)
class MinimumBytes:
    """The least HBM traffic of one step: each weight once, each unique routed expert once, the
    cached tokens' KV rows in whole 16-row HBM tiles (`mla.kv_tile_bytes_needed`), the
    recurrent/conv state read and written, the new KV entries written, one embedding row per
    sequence."""

    weights: int
    embedding_rows: int
    routed_experts: int
    kv_tiles: int
    kda_state: int
    kv_entries: int

    @property
    def total(self) -> int:
        return (self.weights + self.embedding_rows + self.routed_experts + self.kv_tiles
                + self.kda_state + self.kv_entries)

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k):,d}" for k in
                          ("weights", "embedding_rows", "routed_experts", "kv_tiles", "kda_state",
                           "kv_entries"))
        return f"minimum {self.total:,d} B = {parts}"


def minimum_step_bytes(cfg: ModelConfig, batch: int, positions: Any,
                       expert_ids: Any) -> MinimumBytes:
    """positions [B] of the step; expert_ids [n_moe, B, k] its routing (reference aux)."""
    step = roofline.step_bytes(cfg, batch)  # every weight but the routed experts and embedding
    weights = sum(step.read[name] for name in ("kda", "mla", "dense", "moe_nonrouted", "lm_head",
                                               "norms_and_mix"))
    unique = sum(len(np.unique(layer)) for layer in np.asarray(expert_ids))
    n_mla = len(cfg.mla_layers)
    return MinimumBytes(
        weights=weights, embedding_rows=step.read["embedding_rows"],
        routed_experts=unique * roofline.expert_bytes(cfg),
        kv_tiles=n_mla * mla.kv_tile_bytes_needed(positions, cfg),
        kda_state=step.read["kda_state"] + step.written["kda_state"],
        kv_entries=n_mla * batch * mla.kv_bytes_per_token(cfg))
