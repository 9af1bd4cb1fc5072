"""The DMA log where kernels are compiled (a TPU): the kernel run on shapes.

In TPU interpret mode every `dma.Copy` and `dma.phase` of a kernel appends its event to the open
`dma.recording()` log while the kernel runs. A compiled kernel cannot call back into Python, so on
a TPU the same log is made from the kernel's own program: `run(fn, *args)` calls fn(*args) (the
real, compiled kernel) and, while a log is recording there, traces fn's one `pallas_call` for a
dry run (each copy and phase states its planned event) and runs it on shapes with the concrete
values of the operands its DMAs depend on (the integer operands passed to fn: positions, layer
tables, routing ids): `dma.record_from_shapes`, which `dma.recording()` also applies to any
`pl.pallas_call` called outside jit (a notebook's own kernel). The events are the
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
from mkresearch.kernels.base import dma


def run(fn: Callable, *args: Any, given: Any = None) -> Any:
    """fn(*args), fn making one `pallas_call`; on a TPU, while recording, its events from shapes
    appended to the log (`dma.record_from_shapes`). given: {key: fn(layer) -> value} the kernel
    states as given, or a function of fn's result returning that dict (a kernel whose outputs
    hold its choice). Called inside jit or shard_map (traced arguments) it only runs fn: a log
    from shapes needs the integer inputs' values (record a call made outside jit)."""
    if not dma.logs_from_shapes() or any(isinstance(leaf, jax.core.Tracer)
                                         for leaf in jax.tree.leaves(args)):
        return fn(*args)
    known = jax.tree.map(dma.known_for_shapes, args)  # before fn runs: it may donate them
    out = fn(*args)
    dma.record_from_shapes(fn, *known, given=given(out) if callable(given) else given)
    return out
