"""What each kernel costs, for XLA: the `pl.CostEstimate` every `pallas_call` declares.

A Mosaic kernel is opaque to XLA. Without `pallas_call(cost_estimate=...)` its cost analysis
counts 0 FLOPs and none of the bytes the kernel moves by its own DMAs, only what XLA copies
around the call: an MoE layer that streams a GB looked like a few kB to XLA's scheduler and to
`tpu.compile_for(...).bytes_accessed`.

A body's cost is not written beside it: it is read off the body (`body_cost`), from the same
dry run that states its DMA schedule (`kernels/base/dry_run.py`: the very `pallas_call` traced
on shapes, its program run with only its scalar work computed):

  bytes_accessed  the HBM bytes of the DMAs the run issues (read and written), in the worst case
                  the estimate assumes (below)
  flops, transcendentals   counted over the traced program (`program_cost`), each equation as
                  often as the run executes it: a loop body the run computes as many times as it
                  ran (a KV tile loop, the expert loop: their trip counts come from the
                  positions and the routing), a loop it does not compute its static trip count
                  times (a `fori_loop` with static bounds is a scan), a while loop whose end
                  vector data decide (the nucleus's candidates) once, a branch the run decides
                  the branch it took, one it does not the costlier branch.

What counts (`equation_cost`, the one rule; XLA's own HloCostAnalysis counts the same way):
  dot_general     2·M·K·N: 2 × output elements × the contracted size
  transcendental  one per output element of exp, exp2, log, log1p, expm1, logistic (sigmoid),
                  tanh, rsqrt, sqrt, erf, sin, cos, pow..., and no FLOP
  element-wise    one FLOP per output element of arithmetic on floating-point values (add, sub,
                  mul, div, max, min, neg, abs, square, integer_pow, comparisons, ...)
  reductions      one FLOP per input element (reduce_sum, reduce_max, argmax, ...)
Data movement (loads, stores, DMAs, broadcasts, reshapes, slices, converts, selects) and integer
work (loop counters, indices, the positions) count nothing. XLA uses the numbers for scheduling
only, so an exact count of every VPU op matters less than one rule, applied the same everywhere.
The count is of the program as it runs: a product's rows are padded to a multiple of 8
(`blocks.dot`, so that a row's result is the same at any batch), so below B = 8 the matmuls count
8 rows; the expert loop
multiplies all B rows by each fetched expert; the attention scores every row of a KV tile.

Where the bytes depend on data, an estimate takes the most a call can move, so a run in that
worst case moves exactly the estimate (the dry run is given that case: `worst_positions`,
`kernels/stages/router.py`'s `worst_routing`):
  MLA KV          every row at the cache's last position S - 1: its S - 1 cached tokens, rounded
                  up to 16-row HBM tiles, are all S rows of the cache (the whole cache is read)
  routed experts  plan "unique": min(E, B·k) distinct experts (no two choices share one);
                  "routed": B·k fetches; "all": E
A stand-alone wrapper adds the operands and results Pallas copies between HBM and VMEM/SMEM
around the body (`Cost.estimate(*io)`). The megakernel's cost is its whole step kernel's
(`megakernel.step_cost`: every stage body over its layers, the embedding rows, the per-layer
vectors and the sampling stage, its activations never leaving VMEM), its bytes exactly the
worst-case schedule's (`schedule.schedule(plan)`); a rank of a sharded build, one program serving
every rank, declares rank 0's own worst case, the most any rank's own worst case moves (each
rank's: `megakernel.rank_costs`, tested). One layer of a kind as the megakernel runs it is
`megakernel_plan.stage_cost`. A kind writes no cost down: a new one has its cost from its body.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax.experimental import pallas as pl
from mkresearch.kernels.base import dry_run, shape_run

from mkresearch.hardware import tpu


@dataclass(frozen=True)
class Cost:
    """FLOPs, transcendentals and HBM bytes (read + written) of a kernel or a stage body."""

    flops: int = 0
    transcendentals: int = 0
    bytes_accessed: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, count: int) -> Cost:  # a stage run `count` times (layers, experts)
        return Cost(*(int(count) * a for a in astuple(self)))

    __rmul__ = __mul__

    def estimate(self, *io: Any) -> pl.CostEstimate:
        """This cost plus the bytes of `io` (pytrees of arrays or shape structs: the operands
        and results Pallas copies into and out of VMEM/SMEM around the body), for pallas_call."""
        return pl.CostEstimate(flops=int(self.flops), transcendentals=int(self.transcendentals),
                               bytes_accessed=int(self.bytes_accessed + nbytes(*io)))


def nbytes(*trees: Any) -> int:
    """Bytes of every array (or shape struct) in the pytrees; None leaves count 0."""
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(trees))


# ---- the cost read off a body -------------------------------------------------------------------
TRANSCENDENTAL = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "logistic", "tanh", "rsqrt", "sqrt", "cbrt", "erf",
    "erfc", "erf_inv", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
    "asinh", "acosh", "atanh", "pow", "lgamma", "digamma"})
ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "square",
    "integer_pow", "reciprocal", "floor", "ceil", "round", "clamp", "nextafter", "add_any",
    "lt", "le", "gt", "ge", "eq", "ne", "is_finite"})
REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "cumsum",
    "cummax", "cummin", "cumprod", "cumlogsumexp"})


def _elements(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _floating(eqn: core.JaxprEqn) -> bool:
    return any(jnp.issubdtype(getattr(v.aval, "dtype", np.int32), jnp.floating)
               for v in (*eqn.invars, *eqn.outvars))


def equation_cost(eqn: core.JaxprEqn) -> tuple[int, int]:
    """(FLOPs, transcendentals) of one execution of one equation (the module docstring's rule;
    an equation holding programs, a loop or a branch, counts only what they hold)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2 * _elements(eqn.outvars[0].aval) * math.prod(lhs[d] for d in contracting), 0
    if not _floating(eqn):
        return 0, 0
    if name in TRANSCENDENTAL:
        return 0, _elements(eqn.outvars[0].aval)
    if name in ELEMENTWISE:
        return _elements(eqn.outvars[0].aval), 0
    if name in REDUCTIONS:
        return _elements(eqn.invars[0].aval), 0
    return 0, 0


def program_cost(jaxpr: core.Jaxpr, runs: dict) -> tuple[int, int]:
    """(FLOPs, transcendentals) of a kernel program run once, each equation counted as often as
    it executes: runs is the dry run's {program: times evaluated} (`dry_run.run(runs=)`); a
    program the run did not compute executes as often as its equation does (a scan's length
    times, the costlier branch of a cond). A `while` the run did not compute (a cost's run
    computes every one it reaches: `dry_run.trace_kernel(every_loop=True)`) must compute nothing
    that counts: its trip count is unknown."""
    counted: set = set()

    def walk(program, times):
        total = np.zeros(2, np.int64)
        for eqn in program.eqns:
            total += times * np.asarray(equation_cost(eqn))
            total += inner(eqn, times)
        return total

    def ran(sub):  # a program the run computed: counted once, by its own count
        if sub in counted:
            return np.zeros(2, np.int64)
        counted.add(sub)
        return walk(sub, runs[sub])

    def inner(eqn, times):
        subs = list(dry_run.sub_jaxprs(eqn))
        if any(sub in runs for sub in subs):
            return sum((ran(sub) for sub in subs if sub in runs), np.zeros(2, np.int64))
        name = eqn.primitive.name
        if name == "cond":
            return max((walk(sub, times) for sub in subs), key=tuple, default=np.zeros(2, np.int64))
        if name == "while" and times:  # its trip count unknown: fine if it computes nothing
            if any(walk(sub, 1).any() for sub in subs):
                raise shape_run.DryRunError("a while loop whose trip count the dry run does "
                                            "not compute computes FLOPs: their count is "
                                            "unknown")
            return np.zeros(2, np.int64)
        if name == "scan":
            times *= eqn.params["length"]
        return sum((walk(sub, times) for sub in subs), np.zeros(2, np.int64))

    flops, transcendentals = walk(jaxpr, runs.get(jaxpr, 1))
    return int(flops), int(transcendentals)


def shapes(tree: Any) -> Any:
    """Shape structs of a pytree of arrays (None leaves kept)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def kernel_cost(kernel: dry_run.Kernel, inputs: dict | None = None, given: dict | None = None,
                rank: int | None = None) -> Cost:
    """The cost of a kernel traced for dry runs (`dry_run.trace_kernel(every_loop=True)`: its
    runs know every loop's trip count), from one run in the worst case: `inputs` and `given` as
    `dry_run.run` takes them (the positions, the routing)."""
    runs: dict = {}
    events = dry_run.run(kernel, dict(inputs or {}), given, rank, runs=runs)
    flops, transcendentals = program_cost(kernel.jaxpr, runs)
    moved = sum(dma.nbytes for dma in events if dma.kind == "dma_start" and dma.hbm)
    return Cost(flops, transcendentals, moved)


def body_cost(call: Any, *args: Any, inputs: dict | None = None, given: dict | None = None,
              axis_env: tuple = (), rank: int | None = None) -> Cost:
    """The cost of the body of the one `pallas_call` that call(*args) makes (args: arrays or
    shape structs; the call without a cost estimate), read off the body: traced and dry-run in
    the worst case (`kernel_cost`)."""
    kernel = dry_run.trace_kernel(call, *shapes(args), axis_env=axis_env, every_loop=True)
    return kernel_cost(kernel, inputs, given, rank)


def wanted(interpret: Any) -> bool:
    """Whether a `pallas_call` built with `interpret` needs its cost estimate: only one built for
    Mosaic (interpret None or False), whose estimate XLA's TPU scheduler reads. Interpret mode
    drops it (jax's `interpret_pallas_call` deletes the parameter), so reading the body's cost
    there would trace the kernel a second time for nothing. `declared` builds for Mosaic."""
    return not interpret


def costed_call(call: Any, *args: Any, io: tuple = (), inputs: dict | None = None,
                given: dict | None = None, times: int = 1) -> Any:
    """call(cost_estimate=...)(*args): a stand-alone kernel run with the cost read off its body.
    call: `functools.partial(pl.pallas_call, body, ..., interpret=...)` without an estimate; the
    body's cost (`body_cost`, with `inputs` and `given` its worst case; `times` bodies: a grid's
    steps) plus the bytes of `io`, the operands and results Pallas copies around the body. In
    interpret mode no estimate (`wanted`)."""
    if dry_run.tracing() or not wanted(call.keywords.get("interpret")):
        return call()(*args)  # a dry run's trace (`chip_log`) states no estimate
    cost = body_cost(call(), *args, inputs=inputs, given=given) * times
    return call(cost_estimate=cost.estimate(*io))(*args)


def worst_positions(batch: int, seq_len: int) -> np.ndarray:
    """[B] i32: every row at the cache's last position (the estimate's worst case)."""
    return np.full((batch,), seq_len - 1, np.int32)


def declared(fn: Any, *args: Any, axis_env: tuple = ()) -> Cost:
    """What the one `pallas_call` of fn(*args) declares to XLA (its `cost_estimate`), traced on
    shapes as it is built for Mosaic (`tpu.compiling`: interpret mode declares none, `wanted`):
    the cost read off its body plus the operands and results Pallas copies around it."""
    def built(*values):  # a new function: a trace of fn cached from interpret mode is not reused
        return fn(*values)

    with tpu.compiling():
        call = dry_run.kernel_call(built, *shapes(args), axis_env=axis_env)
    estimate = call.params["cost_estimate"]
    return Cost(estimate.flops, estimate.transcendentals, estimate.bytes_accessed)
