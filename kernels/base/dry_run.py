"""A kernel run on shapes: every DMA it issues, in order, without moving or computing a byte.

A stage body is the one description of what its kernel does. Its DMA schedule is not written a
second time: the body is traced as the kernel is (`trace_kernel`: the very `pallas_call`, with
each `dma.Copy` also tracing a callback that states it as a `planned.PlannedDma`), and the traced
program is then run here (`run`) on shapes. The run computes only what decides which DMAs happen:
loop counters, the positions and the layer table in SMEM, slots, conditions. Vector work (every
matmul, the softmax, the delta rule) is never computed: its values are `Unknown` (an aval). What
the kernel reads from data to decide its DMAs is given to the run: the positions (an SMEM input)
and the routing, which the router states as given (`given`): a dry run of a routed layer fetches
the experts of the routing it is given.

    kernel = trace_kernel(fn, *shape_structs)        # fn calls one pallas_call
    dmas = run(kernel, {1: positions, 3: table}, given={"routing": ...})   # [PlannedDma, ...]

Trace-time hooks (used by `kernels/base/dma.py` and the kernels):
    tracing()       whether a dry run's trace is on (the kernels then trace no log callbacks)
    owned_by(stage, layer)   the stage and layer the DMAs traced inside belong to
    emit(...)       a DMA's planned event (dma.Copy calls it)
    given(key, result, *operands)   a value the run supplies (None outside a dry run's trace)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax.experimental import io_callback
from mkresearch.kernels.base import shape_run
from mkresearch.kernels.base.planned import PlannedDma, PlannedPhase

# ---- trace time: the hooks the kernels call ------------------------------------------------------
_tracing: list[bool] = []  # one entry per dry-run trace open: whether it plans phases too
_owners: list[tuple[str, Any]] = []
# run time: where a run's planned DMAs go, and the values it supplies
_sinks: list[list[PlannedDma]] = []
_givens: list[dict] = []
_ranks: list[int | None] = []


def tracing() -> bool:
    """Whether the kernel is being traced for a dry run (`trace_kernel`)."""
    return bool(_tracing)


def planning_phases() -> bool:
    """Whether the dry run traced now plans compute phases too (`trace_kernel(phases=True)`)."""
    return bool(_tracing) and _tracing[-1]


@contextlib.contextmanager
def owned_by(stage: str, layer: Any = None) -> Iterator[None]:
    """The DMAs traced inside belong to `stage` of `layer` (a traced index, or None outside the
    layer loop): the fields `PlannedDma.stage` and `.layer`."""
    _owners.append((stage, layer))
    try:
        yield
    finally:
        _owners.pop()


def owner() -> tuple[str | None, Any]:
    """(stage, layer) of the DMAs traced now ((None, None) outside any `owned_by`)."""
    return _owners[-1] if _owners else (None, None)


def _int32(value: Any) -> Any:
    return jnp.asarray(-1 if value is None else value, jnp.int32)


def _static(value: Any) -> bool:
    """Whether a tag is known when traced (a Python or numpy int, or None)."""
    return value is None or isinstance(value, (int, np.integer))


def emit(kind: str, name: str, slot: Any, indices: dict[str, Any], *, src: str, dst: str,
         nbytes: int, buffer: str | None, owner: tuple[str | None, Any],
         shape: tuple[int, ...] = (), dtype: str = "") -> None:
    """Trace the planned event of one DMA start or wait: the static facts now (shape and dtype:
    the block it moves), the slot, the layer and the log's tags that are traced values when the
    run reaches it."""
    stage, layer = owner
    tags = {"slot": slot, "layer": layer, **{f"index:{k}": v for k, v in indices.items()}}
    traced = tuple(k for k, v in tags.items() if not _static(v))
    # each field: its static value, or the position of its traced value among the operands
    where = {k: ("operand", traced.index(k)) if k in traced else ("static", v)
             for k, v in tags.items()}
    order = sorted(k for k in tags if k.startswith("index:"))

    def value(k, values):
        source, v = where[k]
        return int(values[v]) if source == "operand" else v

    def record(*values):
        slot_value, layer_value = value("slot", values), value("layer", values)
        _sinks[-1].append(PlannedDma(
            kind, name, src, dst, int(nbytes), None if slot_value is None else int(slot_value),
            None if layer_value is None else int(layer_value), stage, buffer,
            tuple((k[6:], int(value(k, values))) for k in order), tuple(shape), dtype))

    record.dry_run = True
    io_callback(record, None, *(_int32(tags[k]) for k in traced), ordered=True)


def emit_phase(kind: str, name: str, indices: dict[str, Any], *, flops: int, vmem_bytes: int,
               owner: tuple[str | None, Any]) -> None:
    """Trace the planned edge of one compute phase (`dma.phase`, when `planning_phases()`)."""
    stage, layer = owner
    tags = {"layer": layer, **{f"index:{k}": v for k, v in indices.items()}}
    traced = tuple(k for k, v in tags.items() if not _static(v))
    order = sorted(k for k in tags if k.startswith("index:"))

    def record(*values):
        value = {k: int(values[traced.index(k)]) if k in traced else tags[k] for k in tags}
        _sinks[-1].append(PlannedPhase(kind, name, int(flops), int(vmem_bytes), value["layer"],
                                       stage, tuple((k[6:], value[k]) for k in order)))

    record.dry_run = True
    io_callback(record, None, *(_int32(tags[k]) for k in traced), ordered=True)


def given(key: str, result: jax.ShapeDtypeStruct, *operands: Any) -> Any:
    """In a dry run's trace: a value of shape `result` that the run supplies, `run(...,
    given={key: fn})` calling fn(*operands) (e.g. a layer's routing, by the layer index).
    None outside a dry run's trace: the kernel computes the value itself."""
    if not tracing():
        return None

    def supply(*values):
        return np.asarray(_givens[-1][key](*(int(v) for v in values)), result.dtype)

    supply.dry_run = True
    return io_callback(supply, result, *(_int32(v) for v in operands), ordered=True)


@dataclass(frozen=True)
class Kernel:
    """A kernel program traced for dry runs (`trace_kernel`), and what its runs compute of it."""

    jaxpr: core.Jaxpr
    slicer: shape_run.Slicer = field(compare=False)  # what its runs compute (`trace_kernel`)


def trace_kernel(fn: Any, *args: Any, axis_env: tuple = (), every_loop: bool = False,
                 phases: bool = False) -> Kernel:
    """The kernel program of the one `pallas_call` that fn(*args) makes (args: shape structs),
    traced for a dry run: its DMAs trace their planned events (`emit`). axis_env: ((name,
    size),) of a kernel that runs on one rank of a mesh (`lax.axis_index`: the run's rank);
    every_loop: its runs run every while loop (`shape_run.Slicer`: a cost's trip counts);
    phases: its compute phases are planned too (`emit_phase`: the kernel's whole log)."""
    return kernel_of(kernel_call_traced(fn, *args, axis_env=axis_env, phases=phases)[0]
                     .params["jaxpr"], every_loop)


def kernel_call_traced(fn: Any, *args: Any, axis_env: tuple = (),
                       phases: bool = False) -> tuple[core.JaxprEqn, core.ClosedJaxpr]:
    """(the `pallas_call` equation, the whole traced program) of fn(*args), traced for a dry
    run as `trace_kernel` says."""
    _tracing.append(bool(phases))
    try:
        closed = jax.make_jaxpr(fn, axis_env=list(axis_env))(*args)
    finally:
        _tracing.pop()
    return _only_call(closed), closed


def kernel_of(jaxpr: core.Jaxpr, every_loop: bool = False) -> Kernel:
    """A program `trace_kernel` traced, for runs of their own (every_loop: as `trace_kernel`)."""
    return Kernel(jaxpr, shape_run.Slicer({"io_callback": _callback, "axis_index": _axis_index},
                                          every_loop=every_loop))


def kernel_program(fn: Any, *args: Any, axis_env: tuple = ()) -> core.Jaxpr:
    """The program (a jaxpr over Refs) of the one `pallas_call` that fn(*args) makes, traced on
    shapes as it is compiled (no planned events: `trace_kernel` adds them)."""
    return kernel_call(fn, *args, axis_env=axis_env).params["jaxpr"]


def kernel_call(fn: Any, *args: Any, axis_env: tuple = ()) -> core.JaxprEqn:
    """The equation of the one `pallas_call` that fn(*args) makes (its params: the program, the
    cost estimate, ...), traced on shapes."""
    return _only_call(jax.make_jaxpr(fn, axis_env=list(axis_env))(*args))


def _only_call(closed: core.ClosedJaxpr) -> core.JaxprEqn:
    calls = [eqn for eqn in _eqns(closed.jaxpr) if eqn.primitive.name == "pallas_call"]
    if len(calls) != 1:
        raise ValueError(f"a kernel program needs exactly one pallas_call, the traced function made "
                         f"{len(calls)}")
    return calls[0]


def operand_sources(closed: core.ClosedJaxpr, call: core.JaxprEqn) -> dict[int, int]:
    """{index of a `pallas_call` operand: index of the traced function's argument (flattened)
    that it is, passed unchanged through the calls around it}: the operands a run can be given
    the concrete values of."""
    top = {v: i for i, v in enumerate(closed.jaxpr.invars)}

    def find(jaxpr: core.Jaxpr, names: dict) -> dict | None:
        for eqn in jaxpr.eqns:
            if eqn is call:
                return {i: names[v] for i, v in enumerate(eqn.invars)
                        if isinstance(v, core.Var) and v in names}
            for sub in sub_jaxprs(eqn):
                if len(sub.invars) != len(eqn.invars):  # a loop or a branch: not a plain call
                    continue
                inner = {w: names[v] for v, w in zip(eqn.invars, sub.invars)
                         if isinstance(v, core.Var) and v in names}
                found = find(sub, inner)
                if found is not None:
                    return found
        return None

    return find(closed.jaxpr, top) or {}


def sub_jaxprs(eqn: core.JaxprEqn) -> Iterator[core.Jaxpr]:
    """The programs an equation runs inside it (a loop's body, a branch, a scope)."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (core.ClosedJaxpr, core.Jaxpr)):
                yield getattr(item, "jaxpr", item)


def _eqns(jaxpr: core.Jaxpr) -> Iterator[core.JaxprEqn]:
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from _eqns(sub)


def run(kernel: Kernel, inputs: dict[int, Any], given: dict | None = None,
        rank: int | None = None, runs: dict | None = None) -> list[PlannedDma]:
    """The planned DMAs of one run of the kernel, in program order. inputs: {index of a kernel
    argument: its concrete value} (the SMEM scalars its DMAs depend on; every other argument is
    a buffer of shapes); given: {key: fn} the values the kernel states as given (`given`);
    rank: the rank a kernel of a mesh runs on (its `lax.axis_index`); runs: a dict the run
    fills with {program: times it evaluated it} (the kernel's program and each loop body,
    branch and scope the run computes: `kernels/base/costs.py` counts FLOPs by them)."""
    jaxpr = kernel.jaxpr
    args = [shape_run.Ref(v.aval, inputs.get(i)) for i, v in enumerate(jaxpr.invars)]
    planned: list[PlannedDma] = []
    _sinks.append(planned)
    _givens.append(dict(given or {}))
    _ranks.append(rank)
    kernel.slicer.runs = runs
    try:
        shape_run.evaluate(jaxpr, [shape_run.UNKNOWN] * len(jaxpr.constvars), args,
                           (False,) * len(jaxpr.outvars), kernel.slicer)
    finally:
        kernel.slicer.runs = None
        _sinks.pop()
        _givens.pop()
        _ranks.pop()
    return planned


def _callback(eqn: core.JaxprEqn, mask: tuple, values: list) -> list:
    """A traced planned DMA or supplied value (`emit`, `given`): called with the run's values."""
    callback = eqn.params["callback"]
    if not getattr(callback.callback_func, "dry_run", False):
        return [shape_run.UNKNOWN] * len(eqn.outvars)
    operands = [shape_run.known(v, "a planned DMA's slot, layer or tags") for v in values]
    out = callback.callback_func(*operands)  # flat operands: ours take them as they come
    return [] if out is None else [shape_run.scalar(np.asarray(out))]


def _axis_index(eqn: core.JaxprEqn, mask: tuple, values: list) -> list:
    if _ranks[-1] is None:
        raise shape_run.DryRunError("the kernel runs on a rank of a mesh: give the dry run its "
                                    "rank (run(rank=))")
    return [_ranks[-1]]
