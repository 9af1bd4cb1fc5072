"""The DMA log where kernels are compiled (a TPU): the kernel run on shapes.

In TPU interpret mode every `dma.Copy` and `dma.phase` of a kernel appends its event to the open
`dma.recording()` log while the kernel runs. A compiled kernel cannot call back into Python, so on
a TPU the same log is made from the kernel's own program: `run(fn, *args)` calls fn(*args) (the
real, compiled kernel) and, while a log is recording there, traces fn's one `pallas_call` for a
dry run (`dry_run.trace_kernel(phases=True)`: each copy and phase states its planned event) and
runs it on shapes (`dry_run.run`) with the concrete values of the operands its DMAs depend on
(the integer operands passed to fn: positions, layer tables, routing ids). The events are the
ones interpret mode records for the same inputs, event for event (tests/test_chip_log.py holds
the two equal on every stage kernel and the megakernel).

What a kernel decides from vector data (the router's choice of experts) is stated by the caller as
given (`given={router.ROUTING: fn}`), as the schedule does (`kernels/compose/schedule.py`).

    with dma.recording() as log:
        y = chip_log.run(my_kernel_call, x, w)   # the same log in interpret mode and on a TPU
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from mkresearch.kernels.base import dma, dry_run

from mkresearch.hardware import tpu


def logs_from_shapes() -> bool:
    """Whether a kernel run now is logged from its program rather than as it runs: a log is
    recording and kernels are compiled (a TPU; `tpu.interpret_params()` is None)."""
    return dma.is_recording() and tpu.interpret_params() is None


def run(fn: Callable, *args: Any, given: Any = None) -> Any:
    """fn(*args), fn making one `pallas_call`; on a TPU, while recording, its events from shapes
    appended to the log (`record`). given: {key: fn(layer) -> value} the kernel states as given,
    or a function of fn's result returning that dict (a kernel whose outputs hold its choice)."""
    if not logs_from_shapes():
        return fn(*args)
    known = jax.tree.map(_known, args)  # before fn runs: it may donate its arguments
    out = fn(*args)
    record(fn, *known, given=given(out) if callable(given) else given)
    return out


def _known(leaf: Any) -> Any:
    """What a run on shapes keeps of an argument: an integer array's values, else its shape."""
    if np.issubdtype(np.dtype(leaf.dtype), np.integer) and not isinstance(leaf, jax.core.Tracer):
        return np.asarray(leaf)
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)


def record(fn: Callable, *args: Any, given: dict | None = None, axis_env: tuple = ()) -> None:
    """Append to the open log the events of the one `pallas_call` fn(*args) makes, run on shapes
    with fn's concrete integer arguments. ValueError naming the argument if one its DMAs need is
    traced (record outside jit)."""
    leaves = jax.tree.leaves(args)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    call, closed = dry_run.kernel_call_traced(fn, *shapes, axis_env=axis_env, phases=True)
    inputs = {}
    for operand, arg in dry_run.operand_sources(closed, call).items():
        leaf = leaves[arg]
        if not np.issubdtype(np.dtype(leaf.dtype), np.integer):
            continue  # a vector operand: its values never decide a DMA
        if isinstance(leaf, (jax.core.Tracer, jax.ShapeDtypeStruct)):
            raise ValueError(f"argument {arg} of {getattr(fn, '__name__', fn)!r} is traced: a "  # noqa: TRY004
                             "DMA log on a TPU is the kernel run on shapes with its integer "
                             "inputs known; record outside jit")
        inputs[operand] = np.asarray(leaf)
    kernel = dry_run.kernel_of(call.params["jaxpr"])
    dma.append_planned(dry_run.run(kernel, inputs, given))
