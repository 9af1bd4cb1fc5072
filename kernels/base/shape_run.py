"""A kernel program run on shapes: only what decides its DMAs is computed.

`kernels/base/dry_run.py` traces a kernel (its `pallas_call`'s program, a jaxpr over Refs) and
runs it here. The run is a slice of the program: the equations that the program's *roots* depend
on, where a root is a traced callback (a planned DMA, a value the dry run supplies), a DMA (which
may fill SMEM) or a write to SMEM. Those are scalar work: loop counters, positions and the layer
table read from SMEM, slots, conditions. Everything else, every vector value of the kernel, is
never computed (`UNKNOWN`). A decision that needs an unknown value is a `DryRunError`.

SMEM buffers hold concrete values (`Ref`); VMEM, HBM and semaphores hold nothing.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import jax
import numpy as np
from jax._src import core
from jax._src.pallas.mosaic import primitives as tpu_primitives
from jax._src.state import indexing
from jax._src.state import types as state_types


class DryRunError(ValueError):
    """The kernel decides a DMA by a value a dry run does not compute (vector data)."""


class Unknown:
    """A value the run does not compute."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = Unknown()


def _is_smem(aval: Any) -> bool:
    return str(getattr(aval, "memory_space", "")).lower() == "smem"


class Ref:
    """A buffer of the run: SMEM holds its scalars (`data`; `known`: which hold a value the run
    computed); VMEM, HBM and semaphores hold nothing."""

    def __init__(self, aval: Any, data: Any = None) -> None:
        self.smem = _is_smem(aval)
        if self.smem:
            shape, dtype = aval.shape, np.dtype(aval.dtype)
            self.data = np.zeros(shape, dtype) if data is None else np.array(data, dtype)
            self.known = np.full(shape, data is not None)

    def read(self, where: tuple | None, shape: tuple) -> Any:
        """The values at a numpy index (None: an unknown index), UNKNOWN unless all known."""
        if not self.smem or where is None:
            return UNKNOWN
        if shape == () and _ints(where):  # a scalar: most reads
            return self.data[where].item() if self.known[where] else UNKNOWN
        if not np.all(self.known[where]):
            return UNKNOWN
        return scalar(np.asarray(self.data[where]).reshape(shape))

    def write(self, where: tuple | None, value: Any) -> None:
        if not self.smem:
            return
        if where is None:  # written somewhere unknown: nothing of it is known any more
            self.known[...] = False
        elif value is UNKNOWN:
            self.known[where] = False
        elif _ints(where) and len(where) == self.data.ndim:  # a scalar: most writes
            self.data[where] = value
            self.known[where] = True
        else:
            self.data[where] = np.broadcast_to(np.asarray(value), self.data[where].shape)
            self.known[where] = True


def _ints(where: tuple) -> bool:
    for i in where:
        if type(i) is not int:
            return False
    return True


def dma_endpoints(tree: Any, leaves: list) -> tuple[tuple[Any, tuple], tuple[Any, tuple]]:
    """((source Ref, its transforms), (target Ref, its transforms)) of a dma_start's flat
    operands: jax 0.10 flattens (src, dst, dst_sem, src_sem, device_id) with transformed Refs,
    jax 0.8-0.9 (the supported range's floor, Colab's runtime) each Ref beside its transforms."""
    # JAX's own private helper, kept: jax has no public call that unflattens a dma_start's
    # operands, and it is the one that knows how each version flattens them
    args = tpu_primitives._dma_unflatten(tree, leaves)
    if len(args) == 5:
        return split_ref(args[0]), split_ref(args[1])
    return (args[0], tuple(args[1])), (args[2], tuple(args[3]))


def split_ref(value: Any) -> tuple[Any, tuple]:
    """(the Ref, its transforms) of a Ref or a TransformedRef."""
    if isinstance(value, state_types.TransformedRef):
        return value.ref, tuple(value.transforms)
    return value, ()


def known(value: Any, what: str) -> int:
    """A scalar decision's value (DryRunError naming `what` if the run does not know it)."""
    if type(value) is int:
        return value
    if value is UNKNOWN:
        raise DryRunError(f"a dry run cannot decide {what}: it depends on data (vector values) "
                          "the run does not compute")
    return int(np.asarray(value))


# ---- the slice: which equations a run computes ------------------------------------------------
def _closed(value: Any) -> tuple[core.Jaxpr, tuple]:
    return (value.jaxpr, tuple(value.consts)) if isinstance(value, core.ClosedJaxpr) else (value, ())


_CALLS = ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call")


class Slicer:
    """Which equations of a program (and of the programs inside it) a run computes, for which
    of their outputs, compiled to steps: worked out once per (program, needed outputs) and kept.
    extra: rules beyond refs and control flow ({primitive name: rule(eqn, mask, values)});
    every_loop: every `while` loop is run (its condition computed) even if nothing needs its
    outputs, so that a run knows every loop's trip count (a cost's, `kernels/base/costs.py`);
    one whose end data decides (vector values) runs its body once."""

    def __init__(self, extra: dict | None = None, every_loop: bool = False) -> None:
        self.every_loop = every_loop  # run every while loop, needed or not (its trip count)
        self._memo: dict = {}
        self._programs: dict = {}
        self.runs: dict | None = None  # {program: times a run evaluated it}, while counted
        self.rules = control_rules(dict(extra or {}), self)

    def program(self, jaxpr: core.Jaxpr, outs: tuple[bool, ...]) -> Any:
        """The slice of `jaxpr` for `outs` as one Python function (consts, args) -> outputs
        (`generate`)."""
        key = (jaxpr, outs)
        if key not in self._programs:
            self._programs[key] = generate(jaxpr, self.slice_of(jaxpr, outs)[0], self.rules)
        return self._programs[key]

    def slice_of(self, jaxpr: core.Jaxpr, outs: tuple[bool, ...]) -> tuple[tuple, tuple]:
        """((eqn, its needed outputs), ...) of `jaxpr` that `outs` of its outputs need, and
        which of its inputs (constvars, then invars) those read."""
        key = (jaxpr, outs)
        if key not in self._memo:
            self._memo[key] = self._slice(jaxpr, outs)
        return self._memo[key]

    def _slice(self, jaxpr: core.Jaxpr, outs: tuple[bool, ...]) -> tuple[tuple, tuple]:
        needed = {v for v, n in zip(jaxpr.outvars, outs) if n and isinstance(v, core.Var)}
        steps = []
        for eqn in reversed(jaxpr.eqns):
            mask = tuple(v in needed for v in eqn.outvars)
            ins = self._inputs(eqn, mask)
            if ins is None:
                continue
            steps.append((eqn, mask))
            needed.update(v for v, n in zip(eqn.invars, ins) if n and isinstance(v, core.Var))
        steps.reverse()
        return tuple(steps), tuple(v in needed for v in (*jaxpr.constvars, *jaxpr.invars))

    def sub_inputs(self, program: Any, outs: tuple[bool, ...]) -> tuple[bool, ...] | None:
        """The invars a sub-program (ClosedJaxpr or Jaxpr) reads; None if it runs nothing."""
        inner, _ = _closed(program)
        steps, ins = self.slice_of(inner, outs)
        return ins[len(inner.constvars):] if steps or any(outs) else None

    def loop_inputs(self, eqn: core.JaxprEqn, outs: tuple[bool, ...]) -> tuple | None:
        """A while's or scan's needed inputs (its carry's needed part grown to a fixed point);
        None if the loop runs nothing the run needs."""
        p, is_while = eqn.params, eqn.primitive.name == "while"
        body = p["body_jaxpr"] if is_while else p["jaxpr"]
        n_consts = p["body_nconsts"] if is_while else p["num_consts"]
        n_carry = len(eqn.outvars) if is_while else p["num_carry"]
        n_cond = p["cond_nconsts"] if is_while else 0
        carry, extra = tuple(outs[:n_carry]), tuple(outs[n_carry:])
        run_anyway = self.every_loop and is_while
        n_body = len(_closed(body)[0].invars)

        def body_inputs(needed):  # None: the loop runs nothing the run needs
            found = self.sub_inputs(body, needed)
            return (False,) * n_body if found is None and run_anyway else found

        body_in = body_inputs(carry + extra)
        if body_in is None:
            return None
        while True:
            cond_in = self.sub_inputs(p["cond_jaxpr"], (True,)) if is_while else None
            grown = [c or b for c, b in zip(carry, body_in[n_consts:n_consts + n_carry])]
            if cond_in is not None:
                grown = [g or c for g, c in zip(grown, cond_in[n_cond:])]
            if tuple(grown) == carry:
                break
            carry = tuple(grown)
            body_in = body_inputs(carry + extra)
        if not is_while:  # consts, carry, xs
            return (*body_in[:n_consts], *carry, *body_in[n_consts + n_carry:])
        return (*cond_in[:n_cond], *body_in[:n_consts], *carry)

    def loop_carry(self, eqn: core.JaxprEqn, outs: tuple[bool, ...]) -> tuple[bool, ...]:
        p, ins = eqn.params, self.loop_inputs(eqn, outs)
        if eqn.primitive.name == "while":
            return ins[p["cond_nconsts"] + p["body_nconsts"]:]
        return ins[p["num_consts"]:p["num_consts"] + p["num_carry"]]

    def _inputs(self, eqn: core.JaxprEqn, mask: tuple[bool, ...]) -> tuple[bool, ...] | None:
        """Which inputs of `eqn` the run reads when `mask` of its outputs are needed; None: the
        eqn is not run (its outputs, if read, are UNKNOWN)."""
        name, p, every = eqn.primitive.name, eqn.params, (True,) * len(eqn.invars)
        if name == "io_callback":  # a planned DMA or a supplied value
            return every
        if name == "dma_start":  # what fills SMEM (the run moves no other data)
            _, (dst_ref, _) = dma_endpoints(p["tree"], eqn.invars)
            return every if _is_smem(dst_ref.aval) else None
        if name in ("swap", "addupdate"):
            return every if _is_smem(eqn.invars[0].aval) else None
        if name == "get":
            return every if any(mask) and _is_smem(eqn.invars[0].aval) else None
        if name == "run_scoped":  # its inputs are the body's constants
            body = p["jaxpr"]
            steps, ins = self.slice_of(body, mask)
            return ins[:len(body.constvars)] if steps or any(mask) else None
        if name == "cond":
            branches = [self.sub_inputs(b, mask) for b in p["branches"]]
            if all(b is None for b in branches):
                return None
            return (True, *(any(b[i] for b in branches if b is not None)
                            for i in range(len(eqn.invars) - 1)))
        if name in ("while", "scan"):
            return self.loop_inputs(eqn, mask)
        if name in _CALLS:
            return self.sub_inputs(p.get("jaxpr") or p["call_jaxpr"], mask)
        return every if any(mask) else None


# ---- the run ------------------------------------------------------------------------------------
def evaluate(jaxpr: core.Jaxpr, consts: list, args: list, outs: tuple[bool, ...],
             slicer: Slicer) -> list:
    """Run the slice of `jaxpr` that `outs` of its outputs need (`Slicer.program`), counting
    the evaluation when the run counts them (`Slicer.runs`: a cost's loop trip counts)."""
    if slicer.runs is not None:
        slicer.runs[jaxpr] = slicer.runs.get(jaxpr, 0) + 1
    return slicer.program(jaxpr, outs)(consts, args)


# how an equation on scalar ints and bools is written in Python (most of what a run computes:
# indices, counters, conditions), {i} its i-th input
_INLINE = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "neg": "-{0}",
    "lt": "{0} < {1}", "le": "{0} <= {1}", "gt": "{0} > {1}", "ge": "{0} >= {1}",
    "eq": "{0} == {1}", "ne": "{0} != {1}", "and": "{0} & {1}", "or": "{0} | {1}",
    "xor": "{0} ^ {1}", "max": "max({0}, {1})", "min": "min({0}, {1})", "abs": "abs({0})",
    "rem": "_crem({0}, {1})", "div": "_cdiv({0}, {1})", "clamp": "min(max({1}, {0}), {2})",
    "multiple_of": "{0}", "squeeze": "{0}", "reshape": "{0}",
}


def _inline(eqn: core.JaxprEqn) -> str | None:
    """The Python expression of a scalar int/bool equation (None if it is not one)."""
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    if len(eqn.outvars) != 1 or any(getattr(a, "shape", None) != () for a in avals):
        return None
    if not all(np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_ for a in avals):
        return None
    name, boolean = eqn.primitive.name, eqn.outvars[0].aval.dtype == np.bool_
    if name == "convert_element_type":
        return "bool({0})" if boolean else "int({0})"
    if name == "not":
        return "(not {0})" if boolean else "(~{0})"
    if name == "select_n":
        cases = ", ".join(f"{{{i}}}" for i in range(1, len(eqn.invars)))
        return f"({cases},)[int({{0}})]"
    return _INLINE.get(name)


def generate(jaxpr: core.Jaxpr, steps: tuple, rules: dict) -> Any:
    """The steps of a slice as the source of one Python function, compiled: scalar equations
    inline (an unknown input makes the output UNKNOWN), every other one a call of its
    `compile_step` function. Locals instead of an environment: a run is mostly such steps."""
    names: dict = {}
    calls: list = []
    constants: list = []

    def read(v: Any) -> str:
        if isinstance(v, core.Literal):
            constants.append(scalar(v.val))
            return f"K[{len(constants) - 1}]"
        return names.get(v, "U")

    def bind(v: Any) -> str:
        if isinstance(v, core.DropVar):
            return "_"
        names[v] = f"v{len(names)}"
        return names[v]

    lines = ["def program(consts, args):"]
    lines += [f"    {bind(v)} = consts[{i}]" for i, v in enumerate(jaxpr.constvars)]
    lines += [f"    {bind(v)} = args[{i}]" for i, v in enumerate(jaxpr.invars)]
    for eqn, mask in steps:
        ins = [read(v) for v in eqn.invars]
        expr = _inline(eqn)
        if expr is not None:
            variables = [n for v, n in zip(eqn.invars, ins) if not isinstance(v, core.Literal)]
            guard = " or ".join(f"{n} is U" for n in variables) or "False"
            lines.append(f"    {bind(eqn.outvars[0])} = U if ({guard}) else ({expr.format(*ins)})")
            continue
        calls.append(compile_step(eqn, mask, rules))
        call = f"S[{len(calls) - 1}]([{', '.join(ins)}])"
        outs = [bind(v) for v in eqn.outvars]
        lines.append(f"    {', '.join(outs)}{',' if len(outs) == 1 else ''} = {call}" if outs
                     else f"    {call}")
    lines.append(f"    return [{', '.join(read(v) for v in jaxpr.outvars)}]")
    scope = {"S": calls, "K": constants, "U": UNKNOWN, "_crem": _crem, "_cdiv": _cdiv}
    exec(compile("\n".join(lines), "<dry run>", "exec"), scope)  # noqa: S102 - our own source
    return scope["program"]


def compile_step(eqn: core.JaxprEqn, mask: tuple[bool, ...], rules: dict) -> Any:
    """run(values) -> outputs of one equation that is not scalar arithmetic: its rule (refs,
    DMAs, callbacks, control flow), or numpy on known values (UNKNOWN from unknown ones)."""
    rule = rules.get(eqn.primitive.name)
    if rule is not None:
        return functools.partial(rule, eqn, mask)
    unknowns = [UNKNOWN] * len(eqn.outvars)
    if eqn.effects:  # semaphores, waits: nothing a decision reads
        return lambda values: unknowns
    compute = _scalar_op(eqn) or functools.partial(_arithmetic, eqn)

    def run(values):
        for v in values:
            if v is UNKNOWN or isinstance(v, Ref):
                return unknowns
        return compute(values)

    return run


def scalar(value: Any) -> Any:
    """A 0-d value as a Python scalar (the run's scalars are Python's: fast)."""
    return value.item() if getattr(value, "shape", None) == () else value


def _crem(a: int, b: int) -> int:  # lax.rem on ints: the sign of a
    r = abs(a) % abs(b)
    return r if a >= 0 else -r


def _cdiv(a: int, b: int) -> int:  # lax.div on ints: towards zero
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


_SCALAR = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "neg": operator.neg,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "eq": operator.eq, "ne": operator.ne, "and": operator.and_, "or": operator.or_,
    "xor": operator.xor, "max": max, "min": min, "abs": abs,
    "multiple_of": lambda x: x, "squeeze": lambda x: x, "reshape": lambda x: x,
    "select_n": lambda pred, *cases: cases[int(pred)],
    "clamp": lambda low, x, high: min(max(x, low), high),
}


def _scalar_op(eqn: core.JaxprEqn) -> Any:
    """A Python function of the equation on scalar ints and bools, if it is such (most of what
    a run computes: indices, counters, conditions); None otherwise."""
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    if len(eqn.outvars) != 1 or any(getattr(a, "shape", None) != () for a in avals):
        return None
    if not all(np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_ for a in avals):
        return None
    name, out = eqn.primitive.name, eqn.outvars[0].aval.dtype
    if name == "convert_element_type":
        cast = bool if out == np.bool_ else int
        return lambda values: [cast(values[0])]
    if name == "not":
        return (lambda values: [not values[0]]) if out == np.bool_ else (lambda values: [~values[0]])
    fn = {"rem": _crem, "div": _cdiv, **_SCALAR}.get(name)
    return None if fn is None else (lambda values: [fn(*values)])


_NUMPY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "neg": operator.neg,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "eq": operator.eq, "ne": operator.ne, "and": np.bitwise_and, "or": np.bitwise_or,
    "xor": np.bitwise_xor, "not": np.invert, "max": np.maximum, "min": np.minimum,
    "rem": np.fmod, "abs": np.abs, "sign": np.sign,
}
_MAX_ELEMENTS = 4096  # no decision reads a larger value: left unknown


def _arithmetic(eqn: core.JaxprEqn, values: list) -> list:
    """An equation on known arrays, computed with numpy (JAX itself for the rare others)."""
    if any(math.prod(getattr(v.aval, "shape", ())) > _MAX_ELEMENTS for v in eqn.outvars):
        return [UNKNOWN] * len(eqn.outvars)
    return [scalar(out) for out in _numpy(eqn, [np.asarray(v) for v in values])]


def _numpy(eqn: core.JaxprEqn, arrays: list) -> list:
    name, params = eqn.primitive.name, eqn.params
    dtype = eqn.outvars[0].aval.dtype if eqn.outvars else None
    if name in _NUMPY:
        return [np.asarray(_NUMPY[name](*arrays)).astype(dtype)]
    if name == "div" and np.issubdtype(arrays[0].dtype, np.integer):  # towards zero
        a, b = arrays
        return [(np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))).astype(dtype)]
    if name in ("convert_element_type", "multiple_of", "optimization_barrier"):
        return [a.astype(v.aval.dtype) for a, v in zip(arrays, eqn.outvars)]
    if name == "select_n":
        return [np.choose(arrays[0].astype(np.intp), arrays[1:]).astype(dtype)]
    if name in ("squeeze", "reshape"):
        return [arrays[0].reshape(eqn.outvars[0].aval.shape)]
    if name == "broadcast_in_dim":
        shape, dims = params["shape"], params["broadcast_dimensions"]
        expanded = arrays[0].reshape([arrays[0].shape[dims.index(i)] if i in dims else 1
                                      for i in range(len(shape))])
        return [np.broadcast_to(expanded, shape).astype(dtype)]
    if name == "iota":
        shape, dim = params["shape"], params["dimension"]
        ramp = np.arange(shape[dim], dtype=dtype).reshape(
            [shape[dim] if i == dim else 1 for i in range(len(shape))])
        return [np.broadcast_to(ramp, shape)]
    try:
        with core.eval_context():
            out = eqn.primitive.bind(*arrays, **eqn.primitive.get_bind_params(params))
    except NotImplementedError:  # a kernel-only primitive: nothing a decision reads
        return [UNKNOWN] * len(eqn.outvars)
    return [np.asarray(o) for o in (out if eqn.primitive.multiple_results else [out])]


# ---- rules: refs and control flow -----------------------------------------------------------------
class _Leaf:
    """A placeholder for the i-th flat input of a ref's transforms (`_indexer`)."""

    def __init__(self, i: int) -> None:
        self.i = i


@functools.cache
def _indexer(tree: Any, offset: int) -> Any:
    """values -> the numpy index of the NDIndexer whose flat inputs start at values[offset]
    (None where one is unknown): the transforms' structure worked out once, not per read."""
    transforms = jax.tree.unflatten(tree, [_Leaf(i + offset) for i in range(tree.num_leaves)])
    if not transforms:
        return lambda values: (...,)
    if len(transforms) != 1 or not isinstance(transforms[0], indexing.NDIndexer):
        return lambda values: None

    def value(x, values):
        return values[x.i] if isinstance(x, _Leaf) else x

    dims = transforms[0].indices

    def index(values):
        out = []
        for i in dims:
            if isinstance(i, indexing.Slice):
                start, size = value(i.start, values), value(i.size, values)
                if start is UNKNOWN or size is UNKNOWN:
                    return None
                start = int(start)
                out.append(slice(start, start + int(size) * i.stride, i.stride))
            else:
                i = value(i, values)
                if i is UNKNOWN:
                    return None
                out.append(i if isinstance(i, int) else np.asarray(i).astype(np.intp))
        return tuple(out)

    return index


def _get(eqn, mask, values):
    where = _indexer(eqn.params["tree"], 1)(values)
    return [values[0].read(where, eqn.outvars[0].aval.shape)]


def _swap(eqn, mask, values):
    ref, value = values[0], values[1]
    where = _indexer(eqn.params["tree"], 2)(values)
    old = ref.read(where, eqn.outvars[0].aval.shape)
    ref.write(where, value)
    return [old]


def _addupdate(eqn, mask, values):
    ref, value = values[0], values[1]
    where = _indexer(eqn.params["tree"], 2)(values)
    old = ref.read(where, eqn.invars[1].aval.shape)
    ref.write(where, UNKNOWN if UNKNOWN in (old, value) else old + value)
    return []


def _dma_start(eqn, mask, values):
    """A DMA into SMEM (the slice runs no other): its target holds what the source held,
    unknown from VMEM (the run moves no vector data; a value that must be known is supplied,
    `dry_run.given`)."""
    (src_ref, src_at), (dst_ref, dst_at) = dma_endpoints(eqn.params["tree"], values)
    data = UNKNOWN
    if src_ref.smem:
        data = src_ref.read(_transforms_index(src_at), eqn.invars[0].aval.shape)
    dst_ref.write(_transforms_index(dst_at), data)
    return []


def _transforms_index(transforms: tuple) -> tuple | None:
    """The numpy index of transforms holding run values (a DMA's, unflattened)."""
    leaves, tree = jax.tree.flatten(transforms)
    return _indexer(tree, 0)(leaves)


def control_rules(extra: dict, slicer: Slicer) -> dict:
    """The rules of refs and control flow, which run their sub-programs' slices, and `extra`."""
    rules: dict = {}

    def sub(program, args, mask):  # a sub-program's invars are args; its own consts constvars
        inner, consts = _closed(program)
        return evaluate(inner, list(consts), args, mask, slicer)

    def run_scoped(eqn, mask, values):  # its inputs are the body's constants; then the new
        body = eqn.params["jaxpr"]
        return evaluate(body, values, [Ref(v.aval) for v in body.invars], mask, slicer)

    def cond(eqn, mask, values):
        branches = eqn.params["branches"]
        chosen = branches[min(max(known(values[0], "which branch runs"), 0), len(branches) - 1)]
        return sub(chosen, values[1:], mask)

    def while_(eqn, mask, values):
        p = eqn.params
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = values[:n_cond], values[n_cond:n_cond + n_body]
        carry, carry_mask = values[n_cond + n_body:], slicer.loop_carry(eqn, mask)
        while True:
            go = sub(p["cond_jaxpr"], [*cond_consts, *carry], (True,))[0]
            if go is UNKNOWN and slicer.every_loop:  # a cost's run: a trip count data
                # decide counts once; what reads its outputs knows none of them
                sub(p["body_jaxpr"], [*body_consts, *carry], carry_mask)
                return [UNKNOWN] * len(carry)
            if not known(go, "a loop's end"):
                return carry
            carry = sub(p["body_jaxpr"], [*body_consts, *carry], carry_mask)

    def scan(eqn, mask, values):
        p = eqn.params
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        consts, carry = values[:n_consts], values[n_consts:n_consts + n_carry]
        xs = values[n_consts + n_carry:]
        body_mask = (*slicer.loop_carry(eqn, mask), *mask[n_carry:])
        steps = range(p["length"])
        for i in reversed(steps) if p["reverse"] else steps:
            x = [UNKNOWN if a is UNKNOWN else np.asarray(a)[i] for a in xs]
            carry = sub(p["jaxpr"], [*consts, *carry, *x], body_mask)[:n_carry]
        return [*carry, *[UNKNOWN] * (len(eqn.outvars) - n_carry)]

    def call(eqn, mask, values):
        return sub(eqn.params.get("jaxpr") or eqn.params["call_jaxpr"], values, mask)

    rules.update({"get": _get, "swap": _swap, "addupdate": _addupdate, "dma_start": _dma_start,
                  "run_scoped": run_scoped, "cond": cond, "while": while_, "scan": scan,
                  **dict.fromkeys(_CALLS, call), **extra})
    return rules
