"""The kernel side of the stage registry: for each sublayer kind of `mkresearch.model.spec`, its body.

A stage kind's core entry (`mkresearch.model.spec.Stage`) owns its weight schema, state and reference;
its `KernelStage` here owns what the kernel needs on top, keyed by the same name:

    plan      the body's static sizes for a config and batch (a hashable dataclass)
    prepare   one kind's stacked parameters -> the pytree its body reads (stays in HBM)
    streamed  the matrices the body multiplies through its weight stream, in the body's order:
              (weights key, DMA-log name, (K, N)); the megakernel's global ring streams these
    body      body(plan, refs: StageRefs): one layer of the kind, on Refs

A kind's DMAs, VMEM buffers and cost are not listed anywhere but in its body: the step's
schedule is the body run on shapes (`kernels/base/dry_run.py`, `kernels/compose/schedule.py`),
its scope of the megakernel's VMEM plan the buffers the body allocates (`pl.run_scoped`), read
off the body traced on shapes (`kernels/compose/scoped_vmem.py`), and its cost (FLOPs,
transcendentals, HBM bytes: XLA's cost estimate) counted over the same dry run
(`kernels/base/costs.py`).

The body reads its inputs from a typed bundle (`StageRefs`), never from positional Refs: the
stand-alone `pallas_call` wrapper of a kind builds one from its own refs (with a local weight
stream), the megakernel builds one per layer (with the global ring). So one body serves both.
Each kernel module registers its kinds at import (`kernels/stages/kda.py`, `mla.py`, `experts.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mkresearch.model.config import ModelConfig


@dataclass(frozen=True)
class StageRefs:
    """What one layer's stage body works on (all Refs are of that layer).

    x          [B, d] bf16 VMEM: the normalised input
    out        [B, d] bf16 VMEM: the sublayer's output
    weights    the kind's prepared weights (HBM refs, the layout of KernelStage.prepare)
    state_in   {leaf: [B, ...] HBM ref} this layer's state (empty for a stateless kind)
    state_out  the same buffers, aliased, for in-place writes
    positions  [B] i32 SMEM: each row's position (its cache slot)
    stream     where the body's matmuls get weight blocks (blocks.LOCAL_STREAM, or the global ring)
    scratch    the kind's scratch shared across layers (e.g. the MoE routing in VMEM and SMEM)
    indices    tags of the DMA log (layer=...)
    shard      on a rank of a sharded model, its collectives (`kernels/sharded/collectives.py`), else None
    steps_out  a verify step's per-token states {leaf: [K+1, B, ...] HBM ref} (kinds whose plan
               has rows_per_state; `kernels/compose/megakernel_verify.py`), else empty
    kv_rows    a paged KV cache: where each row's tokens are (`kv_tiles.KvRows`: the page table
               in SMEM; the cache leaves of state_in are pools), else None (contiguous caches)
    """

    x: Any
    out: Any
    weights: Any
    state_in: dict = field(default_factory=dict)
    state_out: dict = field(default_factory=dict)
    positions: Any = None
    stream: Any = None
    scratch: Any = None
    indices: dict = field(default_factory=dict)
    shard: Any = None
    steps_out: dict = field(default_factory=dict)
    kv_rows: Any = None


@dataclass(frozen=True)
class Streamed:
    """One matrix a body multiplies through its weight stream: where it is in the kind's prepared
    weights, its DMA-log name and its shape [K, N]."""

    key: str
    name: str
    shape: tuple[int, int]


@dataclass(frozen=True)
class KernelStage:
    name: str
    plan: Callable[..., Any]  # (cfg, batch, seq_len, options) -> the body's static plan
    prepare: Callable[[Any, ModelConfig], Any]  # (params[kind], cfg) -> the body's weights
    streamed: Callable[[ModelConfig], tuple[Streamed, ...]]
    body: Callable[[Any, StageRefs], None]
    scope: Callable[[Any], str] = lambda plan: ""  # the VMEM plan's label of the body's scope
    # scratch the megakernel allocates once for every layer of the kind: (label, pltpu shape)
    # pairs, and how the body wants the refs bundled (refs.scratch)
    scratch: Callable[[ModelConfig, int], tuple] = lambda cfg, batch: ()
    scratch_bundle: Callable[[tuple], Any] = lambda refs: refs


_KERNELS: dict[str, KernelStage] = {}


def register(stage: KernelStage) -> KernelStage:
    if stage.name in _KERNELS and _KERNELS[stage.name] is not stage:
        raise ValueError(f"a kernel stage {stage.name!r} is registered already")
    _KERNELS[stage.name] = stage
    return stage


def unregister(name: str) -> None:
    _KERNELS.pop(name, None)


def kernel_stage(name: str) -> KernelStage:
    """The kernel of stage kind `name` (ValueError naming the kinds that have one)."""
    if name not in _KERNELS:
        raise ValueError(f"stage kind {name!r} has no kernel: the megakernel runs "
                         f"{', '.join(_KERNELS)}")
    return _KERNELS[name]


def registered() -> tuple[str, ...]:
    return tuple(_KERNELS)
