"""Device time of decode steps on a TPU, side by side in one run: the megakernel and the jitted
reference, each through the library's loop (`generation.loop`: `steps` steps in one compiled
call, nothing read back between steps), timed by the wall clock and by a profile.

    row = device_time.measure(cfg, params, batch=8, context=0)
    row["megakernel"]["device_s"]     # seconds of TPU time per step (the profile's module time)
    row["megakernel"]["wall_s"]       # wall seconds per step of the same calls
    row["hbm_floor_s"]                # the step's bytes (roofline.step_bytes) at the chip's
                                      # published HBM bandwidth

The device time is read from a `jax.profiler` trace (`device_seconds`): the TPU plane's "XLA
Modules" line holds one event per execution of a compiled program, named after its jit; the
loop's chunk of n steps is one such program, so its duration / n is the time per step, every
kernel and copy of it included. Where there is no TPU the same code runs in interpret mode and
its seconds say nothing about a TPU (`platform` says which).
"""

from __future__ import annotations

import functools
import glob
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mkresearch.generation import loop
from mkresearch.hardware import tpu
from mkresearch.hardware.chips import get_chip
from mkresearch.kernels.compose import copy_ceiling, megakernel
from mkresearch.model import reference, roofline
from mkresearch.model.config import ModelConfig

BACKENDS = ("megakernel", "reference")  # measured everywhere; on a TPU also YARDSTICKS
YARDSTICKS = ("jax-kernels",)  # the op-by-op step on JAX's own kernels (interpret mode: slow)
STEPS = 32  # steps per compiled call
CALLS = 4  # calls timed back to back: the host prepares the next while the device runs one


def device_seconds(fn: Callable[[], Any], module: str, calls: int = 3) -> list[float]:
    """Durations (seconds) of the TPU executions of the compiled program whose name contains
    `module` (e.g. "_megakernel_run") during `calls` calls of fn(), from a profile.
    ValueError when the trace holds none (no TPU, or another name)."""
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir):
            for _ in range(calls):
                jax.block_until_ready(fn())
        files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
        return module_seconds(files[-1], module)


def module_seconds(path: str | os.PathLike, module: str) -> list[float]:
    """Durations (seconds) of the TPU executions of the program whose name contains `module` in
    a profile (`.xplane.pb`): the TPU plane's "XLA Modules" line. ValueError when none."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(path))
    found = [event.duration_ns * 1e-9 for plane in data.planes if "/device:TPU" in plane.name
             for line in plane.lines if line.name == "XLA Modules"
             for event in line.events if module in event.name]
    if not found:
        raise ValueError(f"module={module!r} is invalid: no TPU execution of a program named so "
                         "in the profile (device time is measured on a TPU)")
    return found


def measure(cfg: ModelConfig, params: dict, *, batch: int, context: int = 0, steps: int = STEPS,
            backends: tuple[str, ...] | None = None, chip: str | None = None,
            options: Any = None) -> dict:
    """One row: for each backend, wall and device seconds per step of `steps` greedy steps from
    position `context` (the caches hold `context` tokens), and the step's HBM floor. backends:
    None for BACKENDS, and on a TPU also the YARDSTICKS and the copy ceiling ("copy": a kernel
    streaming the step's bytes HBM <-> VMEM in the megakernel's blocks, nothing computed)."""
    on_chip = jax.default_backend() == "tpu"
    if backends is None:
        backends = BACKENDS + (YARDSTICKS if on_chip else ())
    chip = chip or tpu.default_chip()
    seq_len = _cache_length(cfg, context + steps)
    row = {"model": cfg.name, "batch": batch, "context": context, "steps": steps,
           "chip": chip, "platform": jax.default_backend(),
           "hbm_floor_s": _floor(cfg, batch, context, chip)}
    options = options or megakernel.MegakernelOptions(chip=chip)
    for backend in backends:
        row[backend] = _measure_backend(cfg, params, backend, batch, context, steps, seq_len,
                                        options)
    if on_chip and "megakernel" in backends:
        row["copy"] = _measure_copy(cfg, batch, context, seq_len, options)
    return row


def _measure_copy(cfg: ModelConfig, batch: int, context: int, seq_len: int, options: Any) -> dict:
    """The copy ceiling of the step at `context` (worst-case routing: min(E, B·k) experts per
    layer): device seconds per copy, and the bandwidth it reached."""
    plan = megakernel.make_plan(cfg, batch, seq_len, options)
    kernel = copy_ceiling.copy_kernel_for(plan, np.full(batch, context, np.int32),
                                          chip=plan.options.chip)
    run = functools.partial(kernel.fn, *kernel.args)
    jax.block_until_ready(run())
    seconds = float(np.median(device_seconds(run, "_copy_call")))
    return {"device_s": seconds, "bytes": kernel.nbytes, "bandwidth": kernel.nbytes / seconds}


def _measure_backend(cfg, params, backend, batch, context, steps, seq_len, options) -> dict:
    weights = megakernel.prepare_weights(params, cfg) if backend == "megakernel" else params
    tokens = np.arange(batch, dtype=np.int32) * 7 % cfg.vocab_size
    positions = np.full(batch, context, np.int32)
    holder = {"state": reference.init_state(cfg, batch, seq_len)}

    def run():  # `steps` steps, the state threaded through (each call donates it)
        out = loop.decode(weights, holder["state"], tokens, positions, cfg, steps,
                          backend=backend, options=options, steps_per_call=steps)
        holder["state"] = out.state
        # positions restart at `context`: every call writes the same cache slots again
        return out.tokens

    started = time.perf_counter()
    jax.block_until_ready(run())  # compiles
    compile_s = time.perf_counter() - started
    calls = CALLS if jax.default_backend() == "tpu" else 1  # interpret mode: one is slow enough
    started = time.perf_counter()
    jax.block_until_ready([run() for _ in range(calls)])  # dispatched ahead, as a decode runs
    wall_s = (time.perf_counter() - started) / (calls * steps)
    result = {"wall_s": wall_s, "compile_s": compile_s}
    if jax.default_backend() == "tpu":
        module = "_megakernel_run" if backend == "megakernel" else "_reference_run"  # its jit
        # (the jax-kernels step runs in the reference's chunk: one program name for both)
        result["device_s"] = float(np.median(device_seconds(run, module))) / steps
    return result


def _cache_length(cfg: ModelConfig, tokens: int) -> int:
    """A cache length holding `tokens`, a multiple of the config's KV tile."""
    tile = cfg.kv_tile or 1
    return max(cfg.max_seq_len if tokens <= cfg.max_seq_len else 0, -(-tokens // tile) * tile)


def _floor(cfg: ModelConfig, batch: int, context: int, chip: str) -> float:
    """Seconds the step's bytes take at the chip's published HBM bandwidth (per device)."""
    return roofline.step_bytes(cfg, batch, context).total / get_chip(chip).hbm_bandwidth

