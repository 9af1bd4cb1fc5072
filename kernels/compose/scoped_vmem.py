"""A stage body's scoped VMEM, read off the body itself: its `pl.run_scoped` allocations.

A stage body allocates its own VMEM (`pl.run_scoped(fn, pltpu.VMEM(shape, dtype), ...)`) and frees
it when the scope ends. Those buffers are not listed a second time: the body is traced on shapes
(`trace_body`: the kind's body in a `pallas_call` of one layer, as the megakernel calls it) and
each `run_scoped` equation of the traced program names the buffers it allocates (their avals,
with their memory space). Nested scopes are live together, sibling scopes one after the other,
so the body's peak is the heaviest chain of nested scopes (`peak`); the VMEM plan
(`megakernel_plan.plan_vmem`) lists that chain's VMEM buffers as the stage's.

    buffers = stage_vmem(kind, plan, cfg, batch, seq_len, ring)  # ((name, shape, dtype), ...)

A buffer is named after the function that called `pl.run_scoped` and the parameter of the
scoped function it is passed as (`gqa._attend: k_buffers`, `blocks._ring_matmul: buffers`,
`experts._ExpertLoop.run: slots['w1/codes']`: the traceback and debug info of the equation). The body's matmuls stream their weight blocks
as in the megakernel: a matrix on the global ring allocates nothing in the body (its blocks land
in the kernel-wide ring), any other through a local two-slot ring of its own
(`weight_stream.ShapeStream`). Traces are cached: the VMEM plan of a ring-depth search asks for
the same bodies at every depth (the body's buffers do not depend on it).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core, source_info_util
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, dma, dry_run, registry, weight_stream
from mkresearch.kernels.sharded import collectives

from mkresearch.model import reference, spec, weights
from mkresearch.model.config import ModelConfig
from mkresearch.sharding import layout as layouts


def _is_vmem(aval: Any) -> bool:
    return str(getattr(aval, "memory_space", "")).lower() == "vmem"


def _names(eqn: core.JaxprEqn) -> list[str]:
    """Each buffer a `run_scoped` allocates, named `module.caller: parameter`: the function that
    called `pl.run_scoped` and the parameter of the scoped function the buffer is passed as."""
    inner = eqn.params["jaxpr"]
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    caller = ("run_scoped" if frame is None else  # a nested function by its own name
              f"{Path(frame.file_name).stem}."
              f"{frame.function_name.rsplit('<locals>.', 1)[-1]}")
    args = (inner.debug_info.safe_arg_names(len(inner.invars)) if inner.debug_info is not None
            else ("",) * len(inner.invars))
    return [f"{caller}: {arg}" if arg else f"{caller}: [{i}]" for i, arg in enumerate(args)]


def peak(jaxpr: core.Jaxpr) -> tuple[int, tuple]:
    """(bytes, ((name, shape, dtype), ...)) of the heaviest chain of nested `run_scoped` VMEM
    allocations of a traced program: sibling scopes are never live together, a branch or a loop
    body counts once."""
    best: tuple[int, tuple] = (0, ())
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "run_scoped":
            inner = eqn.params["jaxpr"]
            own = tuple((name, tuple(v.aval.shape), jnp.dtype(v.aval.dtype).name)
                        for name, v in zip(_names(eqn), inner.invars) if _is_vmem(v.aval))
            own_bytes = sum(blocks.nbytes(shape, dtype) for _, shape, dtype in own)
            sub_bytes, sub = peak(inner)
            candidate = (own_bytes + sub_bytes, own + sub)
        else:
            candidate = max((peak(sub) for sub in dry_run.sub_jaxprs(eqn)), key=lambda p: p[0],
                            default=(0, ()))
        if candidate[0] > best[0]:
            best = candidate
    return best


def _layer(tree: Any) -> Any:
    """One layer's shapes of a stacked tree ([n, ...] -> [...])."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), tree)


def _shapes(kind: str, cfg: ModelConfig, batch: int, seq_len: int, shard: Any) -> tuple:
    """One layer's (prepared weights, state) of `kind`, as shape structs: the model's, or on a
    rank of a sharded build (`shard`: its collectives.ShardPlan) the rank's slices."""
    stage = registry.kernel_stage(kind)
    if shard is None:
        params = weights.param_shapes(cfg)[kind]
        state = jax.eval_shape(lambda: reference.init_state(cfg, batch, seq_len))
    else:
        params = layouts.rank_param_shapes(shard.layout)[kind]
        state = layouts.rank_state_shapes(shard.layout, batch, seq_len)
    return (_layer(jax.eval_shape(lambda p: stage.prepare(p, cfg), params)),
            _layer(state.get(kind, {})))


def trace_body(kind: str, plan: Any, cfg: ModelConfig, batch: int, seq_len: int,
               ring: frozenset | None, rows_per_state: int = 1, shard: Any = None) -> core.Jaxpr:
    """The program of one layer of `kind`'s body (its plan `plan`) in a `pallas_call`, on
    shapes (`body_call`)."""
    call, args, axis_env = body_call(kind, plan, cfg, batch, seq_len, ring, rows_per_state, shard)
    return dry_run.kernel_program(call, *args, axis_env=axis_env)


def body_call(kind: str, plan: Any, cfg: ModelConfig, batch: int, seq_len: int,
              ring: frozenset | None, rows_per_state: int = 1, shard: Any = None) -> tuple:
    """(call, args, axis_env): one layer of `kind`'s body (its plan `plan`) in a `pallas_call`,
    and the shapes to call it on: the refs as the megakernel gives them (x and out [B, d] bf16
    in VMEM, the layer's weights and state in HBM, the positions in SMEM, the kind's scratch),
    its matmuls streaming the matrices named in `ring` from the global ring (None: no global
    ring, each matrix through a local ring: the body issues every DMA itself). shard: on a rank
    of a sharded build, its collectives.ShardPlan (the body runs with the rank's collectives and
    slices, cfg the rank's kernel config)."""
    stage = registry.kernel_stage(kind)
    w, state = _shapes(kind, cfg, batch // rows_per_state, seq_len, shard)
    table = spec.state_table(cfg, batch // rows_per_state, seq_len).get(kind, {})
    steps = ({leaf: jax.ShapeDtypeStruct((rows_per_state, *s.shape), s.dtype)
              for leaf, s in state.items() if table[leaf].kind != spec.CACHE}
             if rows_per_state > 1 else {})
    scratch = [shape for _, shape in stage.scratch(cfg, batch)]
    shard_scratch = [] if shard is None else [shape for _, shape in shard.scratch()]
    stream = weight_stream.ShapeStream(ring) if ring is not None else blocks.LOCAL_STREAM
    x = jax.ShapeDtypeStruct((batch, cfg.d_model), jnp.bfloat16)
    smem, vmem = pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)

    def kernel(positions, x_ref, w_refs, state_in, out_ref, state_out, steps_out, *scratch_refs):
        coll = None if shard is None else collectives.Collectives(shard,
                                                                  scratch_refs[len(scratch):])
        with contextlib.nullcontext() if coll is None else dma.on_rank(coll.rank):
            stage.body(plan, registry.StageRefs(
                x=x_ref, out=out_ref, weights=w_refs, state_in=state_in, state_out=state_out,
                positions=positions, stream=stream if coll is None else coll.stream(stream),
                scratch=stage.scratch_bundle(scratch_refs[:len(scratch)]),
                indices={"layer": 0}, shard=coll, steps_out=steps_out))

    call = pl.pallas_call(
        kernel, out_shape=(x, state, steps),
        in_specs=(smem, vmem, jax.tree.map(lambda _: hbm, w), jax.tree.map(lambda _: hbm, state)),
        out_specs=(vmem, jax.tree.map(lambda _: hbm, state), jax.tree.map(lambda _: hbm, steps)),
        scratch_shapes=scratch + shard_scratch)
    axis_env = () if shard is None else ((collectives.AXIS, shard.n_ranks),)
    return call, (jax.ShapeDtypeStruct((batch,), jnp.int32), x, w, state), axis_env


def stage_vmem(kind: str, plan: Any, cfg: ModelConfig, batch: int, seq_len: int,
               ring: frozenset | None, rows_per_state: int = 1, shard: Any = None) -> tuple:
    """((name, shape, dtype), ...): the VMEM buffers `kind`'s body allocates at its peak (the
    heaviest chain of nested scopes; the arguments: `trace_body`'s). The body is traced with cfg
    at the smallest ring depth: its buffers do not depend on the depth (the ring is
    kernel-wide), so every depth of a ring-depth search reads one cached trace."""
    return _stage_vmem(kind, plan, cfg.replace(ring_depth=2), batch, seq_len, ring,
                       rows_per_state, shard)


@functools.lru_cache(maxsize=512)
def _stage_vmem(kind: str, plan: Any, cfg: ModelConfig, batch: int, seq_len: int,
                ring: frozenset | None, rows_per_state: int, shard: Any) -> tuple:
    return peak(trace_body(kind, plan, cfg, batch, seq_len, ring, rows_per_state, shard))[1]
