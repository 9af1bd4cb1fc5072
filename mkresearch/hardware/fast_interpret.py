"""Private-API speed-up of TPU interpret mode (jax 0.8.0 to 0.10.2), applied by tpu.interpret_params().

Interpret mode simulates every memory op, DMA and semaphore of a kernel through `io_callback`.
jax's `io_callback_impl` first `device_put`s every operand onto CPU device 0 and runs the callback
under `default_device`: per op that is several jax dispatches for arrays that are already numpy.
Passing the numpy operands straight through makes interpret mode several times faster (and lets
multi-device runs with large per-device operands finish instead of deadlocking). Results are
identical: the interpreter's callbacks compute with numpy either way.

Guarded by the exact jax versions it was checked against: written for 0.10.2, and jax's
`io_callback_impl` is the same function in every release from 0.8.0 (the oldest jax mkresearch
supports, pyproject.toml) to 0.10.2 (their sources compared). On any other version `apply()` does
nothing and interpret mode runs at jax's own speed.
"""

from __future__ import annotations

SUPPORTED_JAX = ("0.8.0", "0.8.1", "0.8.2", "0.8.3", "0.9.0", "0.9.0.1", "0.9.1", "0.9.2",
                 "0.10.0", "0.10.1", "0.10.2")
_original = None  # jax's io_callback_impl while ours is installed


def supported() -> bool:
    import jax

    return jax.__version__ in SUPPORTED_JAX


def _numpy_io_callback_impl(*args, result_avals, callback, sharding, ordered):
    """jax._src.callback.io_callback_impl without the device_put: operands arrive as numpy."""
    import numpy as np
    from jax._src import tree_util

    del result_avals, sharding, ordered
    return tree_util.tree_map(np.asarray, callback(*args))


def apply() -> bool:
    """Install the fast path (idempotent). Returns whether it is active."""
    global _original
    if _original is not None:
        return True
    if not supported():
        return False
    from jax._src import callback

    _original = callback.io_callback_impl
    callback.io_callback_impl = _numpy_io_callback_impl  # looked up at call time by the lowering
    return True


def remove() -> None:
    """Restore jax's own io_callback_impl."""
    global _original
    if _original is None:
        return
    from jax._src import callback

    callback.io_callback_impl = _original
    _original = None


def active() -> bool:
    return _original is not None
