"""What is static about one megakernel build: its options, the plan, and the VMEM plan.

`make_plan` checks the sizes and options (ValueError naming them) and fixes every static size;
`plan_vmem` computes every VMEM buffer with its bytes before the kernel is built, so that
`megakernel.decode_step` refuses a plan over the chip's VMEM with a message listing it — and,
first, a config whose weights, caches and states exceed the chip's HBM per device
(`roofline.check_fits_hbm`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np
from mkresearch.kernels import blocks, experts, kda, mla, quant, sampling, weight_stream

from mkresearch import roofline
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
