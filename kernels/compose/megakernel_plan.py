"""What is static about one megakernel build: its options, the plan, and the VMEM plan.

`make_plan` checks the sizes and options (ValueError naming them) and fixes every static size;
`plan_vmem` computes every VMEM buffer with its bytes before the kernel is built, so that
`megakernel.decode_step` refuses a plan over the chip's VMEM with a message listing it — and,
first, a config whose weights, caches and states exceed the chip's HBM per device
(`roofline.check_fits_hbm`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, costs, registry, weight_stream
from mkresearch.kernels.base.blocks import EMBED_ROWS
from mkresearch.kernels.compose import scoped_vmem
from mkresearch.kernels.sharded.levels import REDUCTION_ALGORITHMS
from mkresearch.kernels.stages import (  # noqa: F401 - kda, mla, experts register their kinds
    experts,
    ffn_kinds,
    gqa,
    gqa_sink,
    kda,
    mla,
    mla_rope,
    moe_full,
    residuals,
    router,
    sampling,
)

from mkresearch.hardware import tpu
from mkresearch.hardware.chips import get_chip
from mkresearch.model import roofline, spec
from mkresearch.model.config import BF16_SUBLANE, ModelConfig
from mkresearch.model.partition import ROUTER_PLACEMENTS, ROUTER_SPLIT

# The activation block [B, d] bf16 fills at most one 16-row sublane tile; a larger batch would need
# a batch grid, which a single grid-less call does not have.
MAX_BATCH = BF16_SUBLANE
# A verify step (`kernels/compose/megakernel_verify.py`) scores B rows x (K + 1) tokens: its activation
# block [R, d] spans up to four 16-row tiles (the stage bodies loop over rows; nothing needs one).
MAX_VERIFY_ROWS = 4 * BF16_SUBLANE
# VMEM Mosaic may use for its own temporaries (vregs spilled, relayouts) beyond the planned buffers.
VMEM_HEADROOM_BYTES = 4 * 2**20
# VMEM slots per expert matrix the megakernel takes: at least two, since it issues the first
# experts' DMAs right after routing, ahead of their use
EXPERT_SLOTS = tuple(range(2, experts.MAX_SLOTS + 1))


# ---- options and plan --------------------------------------------------------------------------
@dataclass(frozen=True)
class MegakernelOptions:
    """How the megakernel streams (config-like, validated by `check_options`).

    The global weight ring's depth and slot bytes are config fields (cfg.ring_depth,
    cfg.ring_block_bytes): they are part of the model's schedule, like cfg.kv_tile.

    expert_slots     VMEM slots per expert matrix (the first ones issued right after routing)
    expert_plan      which experts are fetched: "unique" (each distinct expert of the batch once)
    kv_tile          tokens per MLA KV tile (None: cfg.kv_tile)
    chip             the chip the step is built for: its VMEM, HBM and MXFP4 decode path (None:
                     `tpu.default_chip()`, the TPU present, else tpu7x; a plan holds the name)
    reductions       sharded, partial-sum: (name, algorithm) of each reduction not sent one-shot
                     ("two-level" or "rs-ag", `kernels/sharded/collectives.py`), e.g. the choice
                     of `megakernel_sharded.kernel_options` (the sharding plan's choice)
    ranks_per_host   sharded: consecutive ranks that share a host (0: every rank one host); every
                     reduction adds a host's partials first, then the hosts' sums
    expert_reads_first  once routing is known, the routed experts' first DMAs are issued ahead
                     of the ring's prefetches of the blocks after the routing point: the ring
                     holds them back until the experts' slots are started
                     (`weight_stream.StageStream.hold_after`); DMAs go out in issue order, so
                     the experts' reads are not queued behind the ring's (issue 46)
    router_placement sharded: where the MoE router's columns live (`layout.ROUTER_PLACEMENTS`,
                     `layout.place_router`): "split" over every rank (its scores gathered with
                     W_ld's latent in one all-gather before top-k), "host" over the ranks of one
                     host (`ranks_per_host`), "sibling" between ranks r and r ^ 1, "replicated"
                     whole on every rank (no gather before top-k); in all but "split" W_ld's
                     latent is gathered on its own after routing (issue 46)
    """

    expert_slots: int = 2
    expert_plan: str = "unique"
    kv_tile: int | None = None
    chip: str | None = None
    global_stream: bool = True
    # out of the repr (a plan's fingerprint, `measurement.recorded`): a sharded plan's ShardPlan
    # carries both, and a single-device plan ignores them
    reductions: tuple = field(default=(), repr=False)
    ranks_per_host: int = field(default=0, repr=False)
    # in the repr (the fingerprint) only when set: plans without it keep their records
    expert_reads_first: bool = field(default=False, repr=False)
    router_placement: str = field(default=ROUTER_SPLIT, repr=False)

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.repr or (f.name == "expert_reads_first" and self.expert_reads_first)
                 or (f.name == "router_placement" and self.router_placement != ROUTER_SPLIT)]
        return f"MegakernelOptions({', '.join(shown)})"


def chip_of(options: MegakernelOptions) -> str:
    """The chip options build for: options.chip, or the chip present (read now, not when the
    options were made: `tpu.default_chip`)."""
    return tpu.default_chip() if options.chip is None else options.chip


def check_options(options: Any, cfg: ModelConfig) -> MegakernelOptions:
    """ValueError naming the option and its allowed values."""
    if not isinstance(options, MegakernelOptions):
        raise ValueError(f"options={options!r} is invalid: a MegakernelOptions")  # noqa: TRY004
    if not isinstance(options.global_stream, bool):
        raise ValueError(f"global_stream={options.global_stream!r} is invalid: True or False")  # noqa: TRY004
    if not isinstance(options.expert_reads_first, bool):
        raise ValueError(f"expert_reads_first={options.expert_reads_first!r} is invalid: True or "  # noqa: TRY004
                         "False")
    stream = weight_stream.make_stream_plan(cfg)
    empty = [kind for kind, _ in stream.stages if not stream.blocks(kind)]
    if options.global_stream and empty and not stream.ffn_transparent:
        raise ValueError(f"cfg={cfg.name!r} is not supported with global_stream=True: the "
                         f"stage kinds {empty} stream no block through the weight ring, so its "
                         "lookahead would cross two stage boundaries (allowed only when every "
                         "FFN kind streams none); use MegakernelOptions(global_stream=False)")
    max_depth = weight_stream.max_ring_depth(cfg)
    if options.global_stream and cfg.ring_depth > max_depth:
        raise ValueError(f"ModelConfig.ring_depth={cfg.ring_depth} is invalid for the megakernel: "
                         f"an int in [2, {max_depth}] (the lookahead, ring_depth - 1 blocks, may "
                         f"cross at most one stage boundary; with ring_block_bytes="
                         f"{cfg.ring_block_bytes} the shortest stage of {cfg.name} streams "
                         f"{max_depth - 1} blocks)")
    experts.check_stage_options(options.expert_plan, options.expert_slots, cfg.expert_format)
    if options.expert_slots not in EXPERT_SLOTS:
        raise ValueError(f"expert_slots={options.expert_slots} is invalid: an int in "
                         f"[{EXPERT_SLOTS[0]}, {EXPERT_SLOTS[-1]}] (the megakernel issues expert "
                         "DMAs right after routing, ahead of their use)")
    options = replace(options, chip=chip_of(options))
    get_chip(options.chip)  # ValueError listing the chips
    rph = options.ranks_per_host
    if isinstance(rph, bool) or not isinstance(rph, int) or rph < 0:
        raise ValueError(f"ranks_per_host={rph!r} is invalid: 0 (every rank one host) or an int "
                         ">= 1")
    if options.router_placement not in ROUTER_PLACEMENTS:
        raise ValueError(f"router_placement={options.router_placement!r} is invalid: one of "
                         f"{ROUTER_PLACEMENTS}")
    pairs = options.reductions
    if not isinstance(pairs, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
            and p[1] in REDUCTION_ALGORITHMS for p in pairs):
        raise ValueError(f"reductions={pairs!r} is invalid: a tuple of (reduction name, "
                         f"algorithm) pairs, the algorithm one of {REDUCTION_ALGORITHMS}")
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
        width = max([28, *(len(b.name) for b in self.buffers)])
        for scope in self.scopes:
            lines.append(f"  [{scope}] {self.stage_bytes(scope) / 2**20:.3f} MiB")
            for b in self.buffers:
                if b.scope == scope:
                    lines.append(f"    {b.name:{width}s} {list(b.shape)!s:28s} {b.dtype:9s} "
                                 f"{b.nbytes:>12,d} B")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class VmemPlanError(ValueError):
    """The megakernel's VMEM plan does not fit the chip."""


def vmem_buffer(name, shape, dtype, scope) -> VmemBuffer:
    shape = tuple(int(s) for s in shape)
    return VmemBuffer(name, shape, jnp.dtype(dtype).name, blocks.nbytes(shape, dtype), scope)


@dataclass(frozen=True)
class MegaPlan:
    """Everything static about one megakernel build (hashable: a jit static argument)."""

    cfg: ModelConfig
    batch: int
    seq_len: int
    options: MegakernelOptions
    stage_plans: tuple[tuple[str, Any], ...]  # kind -> its body's plan, for every kind used
    vocab_tile: int
    layer_table: tuple[int, ...]
    stream: Any  # weight_stream.StreamPlan or None
    vmem: VmemPlan = field(compare=False, hash=False)
    # rows sharing one state row: 1 for a decode step; K + 1 for a verify step, whose row r is
    # token r mod (K + 1) of batch row r // (K + 1) (its cache and recurrent state)
    # (not in the repr: a decode plan's repr, the key of the recorded compiles, `mkresearch.measurement.recorded`,
    # stays what it was; a verify plan's differs anyway, by its rows and its VMEM plan)
    rows_per_state: int = field(default=1, repr=False)

    @property
    def state_batch(self) -> int:
        """Rows of the caches and states (the batch of `init_state`)."""
        return self.batch // self.rows_per_state

    def stage_plan(self, kind: str) -> Any:
        return dict(self.stage_plans)[kind]

    @property
    def attention_kinds(self) -> tuple[str, ...]:
        return weight_stream.stage_kinds(self.cfg)[0]

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        return weight_stream.stage_kinds(self.cfg)[1]


def check_model(cfg: ModelConfig) -> ModelConfig:
    """ValueError naming the field when the megakernel cannot compose the model: a kind without
    a kernel, or a residual strategy it does not run."""
    spec.check(cfg)
    for field_name, kinds in (("attention", cfg.attention_kinds), ("ffn", cfg.ffn_kinds)):
        for kind in dict.fromkeys(kinds):
            if kind not in registry.registered():
                raise ValueError(f"ModelConfig.{field_name}={getattr(cfg, field_name)!r} is "
                                 f"invalid for the megakernel: layer kind {kind!r} has no kernel "
                                 f"(kinds with one: {', '.join(registry.registered())})")
    if cfg.residual not in residuals.RESIDUALS:
        raise ValueError(f"ModelConfig.residual={cfg.residual!r} is invalid for the megakernel: "
                         f"one of {', '.join(residuals.RESIDUALS)}")
    return cfg


def make_plan(cfg: ModelConfig, batch: int, seq_len: int,
              options: MegakernelOptions = MegakernelOptions(),
              *, check_fits: bool = True, rows_per_state: int = 1) -> MegaPlan:
    """Check sizes and options (ValueError naming them) and fix every static size, VMEM included.

    Raises a ValueError naming the bytes when weights, caches and states do not fit the HBM of
    one options.chip device, and VmemPlanError (a ValueError) listing the plan when it does not
    fit the chip's VMEM. check_fits=False skips those two refusals (a plan to look at, e.g. the
    schedule of the full model on one device: `mkresearch plan`; never one to build).
    rows_per_state > 1: a verify step's plan (batch = its rows, each state row shared by
    rows_per_state consecutive rows; `kernels/compose/megakernel_verify.py` checks its arguments)."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg={cfg!r} is invalid: a mkresearch.model.config.ModelConfig")  # noqa: TRY004
    if isinstance(options, MegakernelOptions):  # the chip present, named before remembering
        options = replace(options, chip=chip_of(options))
    try:
        hash((batch, seq_len, options))
    except TypeError:  # an unhashable argument: refused below, naming it
        return _make_plan(cfg, batch, seq_len, options, check_fits, rows_per_state)
    return _remembered_plan(cfg, batch, seq_len, options, check_fits, rows_per_state)


@functools.lru_cache(maxsize=64)
def _remembered_plan(cfg: ModelConfig, batch: Any, seq_len: Any, options: Any, check_fits: bool,
                     rows_per_state: int) -> MegaPlan:
    """A plan made once per arguments (20 ms here for kimi-k3-mini: a step's call, the loop's
    chunk and the schedule ask for the same one; a refused plan raises again, not cached)."""
    return _make_plan(cfg, batch, seq_len, options, check_fits, rows_per_state)


def _make_plan(cfg: ModelConfig, batch: Any, seq_len: Any, options: Any, check_fits: bool,
               rows_per_state: int) -> MegaPlan:
    if rows_per_state > 1:
        return _verify_plan(cfg, batch, seq_len, options, check_fits, rows_per_state)
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch={batch!r} is invalid: an int in [1, {MAX_BATCH}] (the megakernel "
                         f"holds the [B, d] activations in one {BF16_SUBLANE}-row bf16 tile; split "
                         "larger batches into several calls)")
    return _plan(cfg, int(batch), seq_len, options, check_fits, 1)


def _verify_plan(cfg: ModelConfig, rows: int, seq_len: int, options: Any, check_fits: bool,
                 rows_per_state: int) -> MegaPlan:
    """A verify step's plan: every kind with state runs its rows in order on a shared state row,
    which its plan says (a `rows_per_state` field); other kinds are refused, naming the field."""
    if not 1 <= rows <= MAX_VERIFY_ROWS or rows % rows_per_state:
        raise ValueError(f"rows={rows} is invalid for a verify step: a multiple of "
                         f"rows_per_state={rows_per_state} in [1, {MAX_VERIFY_ROWS}]")
    check_model(cfg)
    for field_name, kinds in (("attention", cfg.attention_kinds), ("ffn", cfg.ffn_kinds)):
        for kind in dict.fromkeys(kinds):
            stateful = bool(spec.stage(kind).state(cfg, seq_len))
            plan = registry.kernel_stage(kind).plan(cfg, rows, seq_len, options)
            if stateful and "rows_per_state" not in {f.name for f in fields(plan)}:
                raise ValueError(f"ModelConfig.{field_name}={getattr(cfg, field_name)!r} is "
                                 f"invalid for a verify step: layer kind {kind!r} keeps state but "
                                 "its body does not run several rows on one state row")
    return _plan(cfg, rows, seq_len, options, check_fits, rows_per_state)


def _plan(cfg: ModelConfig, batch: int, seq_len: int, options: Any, check_fits: bool,
          rows_per_state: int) -> MegaPlan:
    check_model(cfg)
    options = check_options(options, cfg)
    # weights, caches and states must fit the device's HBM: refused here, not by the compiler
    if check_fits:
        roofline.check_fits_hbm(cfg, options.chip, batch // rows_per_state, seq_len)

    def stage_plan(kind):
        plan = registry.kernel_stage(kind).plan(cfg, batch, seq_len, options)
        return replace(plan, rows_per_state=rows_per_state) if rows_per_state > 1 and (
            "rows_per_state" in {f.name for f in fields(plan)}) else plan

    stage_plans = tuple((kind, stage_plan(kind)) for kind in cfg.kinds)
    vocab_tile = sampling.default_vocab_tile(cfg.d_model, cfg.vocab_size)
    stream = weight_stream.make_stream_plan(cfg) if options.global_stream else None
    chip = get_chip(options.chip)
    vmem = plan_vmem(cfg, batch, stage_plans, vocab_tile, stream, chip, seq_len, rows_per_state)
    if check_fits and not vmem.fits():
        raise VmemPlanError(
            f"the megakernel's VMEM plan needs {vmem.total_bytes / 2**20:.2f} MiB but {chip.name} "
            f"has {vmem.limit_bytes / 2**20:.2f} MiB usable per TensorCore: lower the config's "
            f"ring_depth, ring_block_bytes or kv_tile, the option expert_slots, or the batch.\n{vmem.table()}")
    return MegaPlan(cfg=cfg, batch=batch, seq_len=seq_len, options=options,
                    stage_plans=stage_plans, vocab_tile=vocab_tile,
                    layer_table=weight_stream.layer_table(cfg), stream=stream, vmem=vmem,
                    rows_per_state=rows_per_state)


def kernel_buffers(cfg: ModelConfig, batch: int, stream: Any) -> tuple[tuple[str, Any], ...]:
    """(label, pltpu type) of every buffer the step allocates for its whole run, in the order
    `megakernel_body._step` allocates them (the VMEM plan's kernel-wide VMEM ones): the stage
    input and output, the layer's residual vectors and their DMA semaphores (one per vector or
    embedding row), the residual strategy's hidden state, each kind's scratch, and the weight
    ring with its semaphores and base slot (stream: the StreamPlan, None without a global ring)."""
    d, bf = cfg.d_model, jnp.bfloat16
    residual = residuals.RESIDUALS[cfg.residual]
    n_vectors = len(residual.vectors)
    out = [("stage input x", pltpu.VMEM((batch, d), bf)),
           ("stage output", pltpu.VMEM((batch, d), bf)),
           (f"{residual.vectors_label} weights", pltpu.VMEM((n_vectors, 1, d), jnp.float32)),
           ("vector and embedding DMAs", pltpu.SemaphoreType.DMA((max(n_vectors, batch),)))]
    out += [(name, pltpu.VMEM(shape, dtype)) for name, shape, dtype in residual.vmem(cfg, batch)]
    out += [(label, shape) for kind in cfg.kinds
            for label, shape in registry.kernel_stage(kind).scratch(cfg, batch)]
    if stream is not None:
        out += [("weight ring", pltpu.VMEM((stream.depth, *stream.slot_shape), bf)),
                ("weight ring DMAs", pltpu.SemaphoreType.DMA((stream.depth,))),
                ("weight ring base", pltpu.SMEM((1,), jnp.int32))]
    return tuple(out)


def trunk_scopes(cfg: ModelConfig, batch: int, vocab_tile: int) -> dict[str, tuple]:
    """{scope: ((label, pltpu type), ...)}: the buffers the step's trunk allocates for a part of
    its run, in the order `megakernel_body._Trunk` allocates them (`pl.run_scoped`; the VMEM
    plan's "embedding" and "sampling" scopes, never live with a stage's): the embedding's
    [B, 16, d] bf16 blocks (each row's aligned 16-row block of E) and its DMA semaphores are the
    kernel-wide ones; the sampling stage's final norm gain [1, d] bf16, the LM head's two VMEM
    slots [2, d, vocab_tile] bf16 (its ring) with their semaphores, and the final mix's output
    weights [1, d] f32 for a residual strategy that has them."""
    d, bf = cfg.d_model, jnp.bfloat16
    residual = residuals.RESIDUALS[cfg.residual]
    mix_out = ([("final mix weights", pltpu.VMEM((1, d), jnp.float32))]
               if "mix_out" in residual.head_vectors else [])
    return {"embedding": (("embedding blocks", pltpu.VMEM((batch, EMBED_ROWS, d), bf)),),
            "sampling": (("final norm", pltpu.VMEM((1, d), bf)),
                         ("LM head tiles", pltpu.VMEM((2, d, vocab_tile), bf)),
                         ("LM head DMAs", pltpu.SemaphoreType.DMA((2,))), *mix_out)}


def sampled_outputs(batch: int) -> tuple[tuple[str, Any], ...]:
    """(label, shape struct) of the step's sampled outputs, [B, 1] i32 each in VMEM for the whole
    call (`megakernel.step_call`'s tokens and nucleus overflow)."""
    column = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    return (("sampled tokens", column), ("nucleus overflow", column))


def plan_vmem(cfg: ModelConfig, batch: int, stage_plans: tuple, vocab_tile: int, stream: Any,
              chip: Any, seq_len: int | None = None, rows_per_state: int = 1,
              shard: Any = None) -> VmemPlan:
    """Every VMEM buffer of the megakernel: the kernel-wide ones (`kernel_buffers`: the stage
    input and output, per-layer vectors, the residual strategy's hidden state, each kind's
    scratch, the weight ring; `sampled_outputs`: the sampled tokens), the trunk's scoped ones
    (`trunk_scopes`: the embedding's, the sampling stage's; the lists the step allocates from)
    and each stage body's scoped ones: what the body allocates at its peak, read off the body
    traced on shapes (`scoped_vmem.stage_vmem`: its `run_scoped` buffers, a local two-slot ring for each matrix
    the global ring does not stream among them).
    shard: on a rank of a sharded build, its collectives.ShardPlan (its bodies traced on the
    rank's slices, with its collectives; their buffers are the caller's)."""
    b = batch
    seq_len = cfg.max_seq_len if seq_len is None else int(seq_len)

    def buffers(pairs, scope, vmem):  # the VMEM ones of (label, type) pairs
        return [vmem_buffer(label, shape.shape, shape.dtype, scope) for label, shape in pairs
                if vmem(shape)]

    allocated = lambda shape: getattr(shape, "memory_space", None) == pltpu.VMEM
    out = (buffers(kernel_buffers(cfg, b, stream), "kernel", allocated)
           + buffers(sampled_outputs(b), "kernel", lambda _: True))
    trunk = trunk_scopes(cfg, b, vocab_tile)
    out += buffers(trunk["embedding"], "embedding", allocated)
    for kind, plan in stage_plans:
        scope = registry.kernel_stage(kind).scope(plan)
        ring = stream.ring_names(kind) if stream is not None else None
        out += [vmem_buffer(name, shape, dtype, scope) for name, shape, dtype in
                scoped_vmem.stage_vmem(kind, plan, cfg, b, seq_len, ring, rows_per_state, shard)]
    out += buffers(trunk["sampling"], "sampling", allocated)
    limit = int(chip.vmem_bytes) - VMEM_HEADROOM_BYTES
    return VmemPlan(tuple(out), limit, chip.name)


# ---- a stage's cost ----------------------------------------------------------------------------
def stage_cost(kind: str, plan: Any, cfg: ModelConfig, batch: int, seq_len: int) -> costs.Cost:
    """One layer of `kind`'s cost as the megakernel runs it (its body's FLOPs, transcendentals
    and HBM bytes, each matrix streamed by the body itself), read off the body in the cost
    estimate's worst case (`kernels/base/costs.py`): no kind writes its cost down. The step's
    own cost is its whole kernel's (`megakernel.step_cost`), the same bodies in it."""
    call, args, _ = scoped_vmem.body_call(kind, plan, cfg, batch, seq_len, None)
    routing = router.worst_routing(cfg.n_experts, batch, cfg.top_k)
    return costs.body_cost(call, *args, inputs={0: costs.worst_positions(batch, seq_len)},
                           given={router.ROUTING: lambda layer: routing})


# ---- the routing a step's schedule is given (the one choice it takes from data) ----------------
def routed_layers(plan: MegaPlan) -> tuple[int, ...]:
    """The layers whose FFN routes to experts (expert_ids[i] is the routing of the i-th)."""
    return tuple(layer for layer, (_, ffn) in enumerate(plan.cfg.layers)
                 if spec.stage(ffn).routed)


def routing_by_layer(plan: MegaPlan, expert_ids: Any) -> dict[int, np.ndarray]:
    """layer -> its routing [B, k] from expert_ids [n_routed_layers, B, k] (the reference's
    aux["expert_ids"]); ValueError naming what is wrong."""
    cfg, batch, layers = plan.cfg, plan.batch, routed_layers(plan)
    shape = (len(layers), batch, cfg.top_k)
    ids = np.asarray(expert_ids)
    if ids.shape != shape or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"expert_ids has shape {ids.shape} ({ids.dtype}): expected {list(shape)} "
                         "ints, the routing of each routed layer (the reference's "
                         "aux['expert_ids'])")
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.n_experts):
        raise ValueError(f"expert_ids is invalid: each in [0, n_experts={cfg.n_experts}), got "
                         f"[{ids.min()}, {ids.max()}]")
    return dict(zip(layers, ids))
