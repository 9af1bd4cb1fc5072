"""The checks a kernel's wrapper makes of its inputs before it traces anything: a bad argument is
refused in one line that names it and says what is allowed, never a traceback from inside JAX.
The stage kernels (`kernels/stages/*.py`: x, their weights, caches and positions) and the
megakernel's calls (tokens and positions, `kernels/compose/*.py`) share them, so one mistake
reads the same whichever kernel it is made with.

A traced value (under `jax.jit`) is checked for its shape and dtype only: its values are checked
where they are concrete.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_x(x: Any, d_model: int) -> int:
    """x [B, d] bf16, a sublayer's normalised input; returns B."""
    if getattr(x, "ndim", None) != 2 or x.shape[1] != d_model:
        raise ValueError(f"x has shape {getattr(x, 'shape', None)}: expected [B, d={d_model}]")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x.dtype={x.dtype} is invalid: bfloat16 (the normalised input)")
    return x.shape[0]


def check_arrays(tree: Any, label: str, shapes: dict[str, tuple[int, ...]],
                 dtypes: dict[str, Any] | None = None, note: str = "") -> None:
    """tree[name] of shapes[name] and dtypes[name] (bfloat16 where not named) for every name of
    `shapes` (`label`: what the caller calls the dict: "p", "cache"; `note`: why these shapes,
    e.g. the batch and cache length)."""
    for name, shape in shapes.items():
        array = tree.get(name) if isinstance(tree, dict) else None
        if array is None or tuple(array.shape) != shape:
            raise ValueError(f"{label}[{name!r}] has shape {getattr(array, 'shape', None)}: "
                             f"expected {shape}{note}")
        dtype = (dtypes or {}).get(name, jnp.bfloat16)
        if array.dtype != dtype:
            raise ValueError(f"{label}[{name!r}].dtype={array.dtype} is invalid: "
                             f"{jnp.dtype(dtype).name}")


def check_keys(tree: Any, label: str, names: Any, note: str = "") -> None:
    """A dict with exactly the keys `names`."""
    if not isinstance(tree, dict) or set(tree) != set(names):
        got = sorted(tree) if isinstance(tree, dict) else repr(tree)
        raise ValueError(f"{label} has keys {got}: expected {sorted(names)}{note}")


def check_each_in(name: str, values: Any, high: int, why: str = "") -> None:
    """Every row's value of `name` (concrete: a traced one passes) in [0, high); `why` says what
    `high` is."""
    if isinstance(values, jax.core.Tracer):
        return
    concrete = np.asarray(values)
    if concrete.min() < 0 or concrete.max() >= high:
        raise ValueError(f"{name}={concrete.tolist()} is invalid: each in [0, {high}){why}")


def check_positions(positions: Any, batch: int, seq_len: int) -> None:
    """positions [B] int32, each row's in [0, seq_len) (the cache's length)."""
    if getattr(positions, "shape", None) != (batch,):
        raise ValueError(f"positions has shape {getattr(positions, 'shape', None)}: "
                         f"expected [B={batch}]")
    if positions.dtype != jnp.int32:
        raise ValueError(f"positions.dtype={positions.dtype} is invalid: int32")
    if isinstance(positions, jax.core.Tracer):
        return
    last = int(np.max(positions))
    check_each_in("positions", positions, seq_len, f" — the cache holds {seq_len} tokens, too "
                  f"short for position {last}" if last >= seq_len else "")
