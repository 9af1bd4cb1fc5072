"""The yardsticks of the megakernel, timed on a TPU: one JSON line per row.

    python benchmarks/yardsticks_tpu.py [--models M,...] [--batch 1,8] [--context P]
                                        [--calls 50] [--copy-depths 2,3,4] [--stream]

For each config and batch size, each of:
  op-by-op     the op-by-op step on JAX's own kernels (`mkresearch.baselines.jax_kernels`:
               megablox gmm, XLA), its state donated and threaded through the calls
  op-by-op paged   the same with a paged GQA cache through ragged paged attention (GQA configs)
  reference    the jitted reference step (`reference.decode_step_jit`), state threaded
  copy         the copy ceiling: the step's HBM bytes in its DMAs' blocks, nothing computed
               (`kernels/compose/copy_ceiling.py`), at each pipeline depth of --copy-depths
and with --stream: 64 MiB streamed HBM -> VMEM in blocks of 16 KiB to 2 MiB (depth 3).

Per row: wall clock per call (`--calls` jitted calls after a warm-up, the state threaded on the
device, one block at the end), and device time per call from a `jax.profiler` trace of the same
calls read with `jax.profiler.ProfileData`: `device_ms` the summed durations of the TPU's "XLA
Modules" events (each program's run on the chip), `device_span_ms` first start to last end (gaps
between programs included), `device_ops_ms` the summed "XLA Ops" events. The copy rows add the
bytes moved and GB/s over device_ms; the op-by-op rows the largest |Δlogit| against the jitted
reference on the chip, from the same state and tokens (their first call).

Every row runs on its own: a row that fails prints {"error": ...} and the next one runs. The first
line says the chip and the jax, jaxlib and libtpu versions. Rows are at position --context (each
row attends to context + 1 tokens) with random weights (seed 0) and a zero state.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mkresearch.hardware import tpu

tpu.select_platform()

from mkresearch.kernels.base import copy_stream
from mkresearch.kernels.compose.copy_ceiling import copy_kernel_for
from mkresearch.kernels.compose.megakernel_plan import MegakernelOptions, make_plan

from mkresearch.baselines import jax_kernels
from mkresearch.model import on_chip, paged_kv, reference, weights
from mkresearch.model.config import get_config

# name -> (config name, overrides): every mini, Kimi K3's in MXFP4 (its preset) and in bf16, and
# the real-size configs cut to fill one chip
MODELS = {"kimi-k3-mini": ("kimi-k3-mini", {}),
          "kimi-k3-mini-bf16": ("kimi-k3-mini", {"expert_format": "bf16"}),
          "kimi-k3-mini-fp8": ("kimi-k3-mini", {"expert_format": "fp8"}),
          "kimi-k3-mini-latent": ("kimi-k3-mini", {"mla_cache_layout": "latent"}),
          "deepseek-v3-mini": ("deepseek-v3-mini", {}), "glm-4.5-mini": ("glm-4.5-mini", {}),
          "qwen3-235b-a22b-mini": ("qwen3-235b-a22b-mini", {}),
          # real-size layers filling one chip (`on_chip.ON_CHIP`): --models names them
          **{name: (name, {}) for name in on_chip.ON_CHIP}}
DEFAULT_MODELS = ("kimi-k3-mini", "kimi-k3-mini-bf16", "deepseek-v3-mini", "glm-4.5-mini",
                  "qwen3-235b-a22b-mini")
STREAM_BYTES = 64 << 20
STREAM_BLOCKS = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def versions() -> dict:
    found = {}
    for package in ("jax", "jaxlib", "libtpu", "libtpu-nightly"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    device = jax.devices()[0]
    return {"chip": device.device_kind, "platform": device.platform,
            "target_chip": tpu.target_chip(), **found}


# ---- timing -------------------------------------------------------------------------------------
def device_times(logdir: Path, calls: int) -> dict:
    """Per call, from the newest trace under logdir: the TPU's XLA Modules and XLA Ops events
    summed, and the span from the first event to the last."""
    from jax.profiler import ProfileData

    files = sorted(logdir.glob("**/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {"device_ms": None, "note": "no trace written"}
    data = ProfileData.from_file(str(files[-1]))
    modules, ops, starts, ends, seen = 0, 0, [], [], set()
    for plane in data.planes:
        if "/device:TPU:0" not in plane.name:
            continue
        for line in plane.lines:
            seen.add(line.name)
            if line.name not in ("XLA Modules", "XLA Ops"):
                continue
            for event in line.events:
                if line.name == "XLA Modules":
                    modules += int(event.duration_ns)
                    starts.append(int(event.start_ns))
                    ends.append(int(event.start_ns) + int(event.duration_ns))
                else:
                    ops += int(event.duration_ns)
    if not starts:
        return {"device_ms": None, "note": "no XLA Modules events on /device:TPU:0 (its lines: "
                f"{sorted(seen)})"}
    return {"device_ms": modules / calls / 1e6, "device_span_ms": (max(ends) - min(starts))
            / calls / 1e6, "device_ops_ms": ops / calls / 1e6}


def timed(call, carry, calls: int) -> dict:
    """call(carry) -> (result, carry), `calls` times after a warm-up: wall clock and device time
    per call. Returns the timings and the first call's result."""
    first, carry = call(carry)
    jax.block_until_ready((first, carry))
    start = time.perf_counter()
    result = None
    for _ in range(calls):
        result, carry = call(carry)
    jax.block_until_ready((result, carry))
    wall = (time.perf_counter() - start) / calls
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir):
            for _ in range(calls):
                result, carry = call(carry)
            jax.block_until_ready((result, carry))
        device = device_times(Path(logdir), calls)
    return {"wall_ms": wall * 1e3, **device}, first


# ---- rows ---------------------------------------------------------------------------------------
def inputs(cfg, batch: int, context: int):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, batch), jnp.int32)
    positions = jnp.full((batch,), context, jnp.int32)
    return tokens, positions


def reference_row(cfg, params, batch, context, calls):
    tokens, positions = inputs(cfg, batch, context)

    def call(state):
        logits, state, aux = reference.decode_step_jit(params, state, tokens, positions, cfg=cfg)
        return (logits, aux.get("expert_ids")), state

    times, (logits, expert_ids) = timed(call, reference.init_state(cfg, batch), calls)
    return times, logits, expert_ids


def op_by_op_row(cfg, params, batch, context, calls, want):
    tokens, positions = inputs(cfg, batch, context)

    def call(state):
        logits, state, _ = jax_kernels.step_jit(params, state, tokens, positions, cfg=cfg,
                                                interpret=tpu.interpret_params())
        return logits, state

    times, logits = timed(call, reference.init_state(cfg, batch), calls)
    return {**times, "max_abs_dlogit_vs_reference": float(jnp.max(jnp.abs(logits - want)))}


def paged_row(cfg, params, batch, context, calls, want):
    page_size = 16
    per_row = -(-cfg.max_seq_len // page_size)
    pages = paged_kv.PagedKVConfig(page_size, batch * per_row, per_row)
    table = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
    tokens, positions = inputs(cfg, batch, context)

    def call(state):
        logits, state, _ = jax_kernels.paged_step_jit(params, state, tokens, positions, table,
                                                      cfg=cfg, pages=pages,
                                                      interpret=tpu.interpret_params())
        return logits, state

    times, logits = timed(call, jax_kernels.init_paged_state(cfg, pages, batch), calls)
    return {**times, "max_abs_dlogit_vs_reference": float(jnp.max(jnp.abs(logits - want))),
            "page_size": page_size,
            "rpa_block_sizes": list(jax_kernels.rpa_block_sizes(cfg, pages, batch))}


def copy_rows(cfg, batch, context, expert_ids, calls, depths):
    plan = make_plan(cfg, batch, cfg.max_seq_len,
                     MegakernelOptions(chip=tpu.default_chip()))
    positions = np.full((batch,), context, np.int32)
    ids = None if expert_ids is None else np.asarray(expert_ids)
    for depth in depths:
        yield depth, copy_kernel_for(plan, positions, ids, depth=depth)


def copy_timing(kernel, calls):
    times, _ = timed(lambda carry: (kernel.fn(*kernel.args), carry), 0, calls)
    seconds = (times.get("device_ms") or times["wall_ms"]) / 1e3
    return {**times, "bytes": kernel.nbytes, "read_bytes": kernel.read_bytes,
            "written_bytes": kernel.written_bytes, "dmas": len(kernel.blocks),
            "depth": kernel.layout.depth, "GB/s": kernel.nbytes / seconds / 1e9}


def run_model(name, batch, args):
    config_name, overrides = MODELS[name]
    cfg = get_config(config_name, **overrides)
    base = {"model": name, "expert_format": cfg.expert_format,
            "mla_cache_layout": cfg.mla_cache_layout, "batch": batch, "context": args.context}

    def row(yardstick, work):
        try:
            emit({**base, "yardstick": yardstick, **work()})
        except Exception as error:  # noqa: BLE001 - a row that fails says why; the next runs
            emit({**base, "yardstick": yardstick, "error": f"{type(error).__name__}: {error}",
                  "trace": traceback.format_exc(limit=3)[-600:]})

    try:
        params = weights.init_params(cfg, 0)
        ref_times, want, expert_ids = reference_row(cfg, params, batch, args.context, args.calls)
    except Exception as error:  # noqa: BLE001 - the row says why; the next model runs
        emit({**base, "yardstick": "reference", "error": f"{type(error).__name__}: {error}"})
        return
    emit({**base, "yardstick": "reference", **ref_times})
    row("op-by-op", lambda: op_by_op_row(cfg, params, batch, args.context, args.calls, want))
    if set(cfg.attention_kinds) == {"gqa"}:
        row("op-by-op paged",
            lambda: paged_row(cfg, params, batch, args.context, args.calls, want))
    try:
        kernels = list(copy_rows(cfg, batch, args.context, expert_ids, args.calls, args.depths))
    except Exception as error:  # noqa: BLE001 - the row says why; the next model runs
        emit({**base, "yardstick": "copy", "error": f"{type(error).__name__}: {error}"})
        return
    for _, kernel in kernels:
        row("copy", lambda kernel=kernel: copy_timing(kernel, args.calls))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--batch", default="1,8", help="comma list of batch sizes")
    parser.add_argument("--context", type=int, default=0, help="each row's position (tokens "
                        "cached before the step)")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per row")
    parser.add_argument("--copy-depths", default="2,3,4", help="the copy's pipeline depths")
    parser.add_argument("--stream", action="store_true",
                        help="also stream 64 MiB in blocks of 16 KiB to 2 MiB")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models {','.join(unknown)} is invalid: {', '.join(MODELS)}")
    args.depths = [int(d) for d in args.copy_depths.split(",")]
    emit({"versions": versions(), "calls": args.calls, "context": args.context})
    if not tpu.on_tpu():
        emit({"note": "no TPU here: the kernels run in interpret mode and the times mean nothing"})
    for name in models:
        for batch in (int(b) for b in args.batch.split(",")):
            run_model(name, batch, args)
    if args.stream:
        for block in STREAM_BLOCKS:
            base = {"yardstick": "stream", "block_bytes": block}
            try:
                emit({**base, **copy_timing(copy_stream.stream(STREAM_BYTES, block, 3),
                                            args.calls)})
            except Exception as error:  # noqa: BLE001 - the row says why; the next runs
                emit({**base, "error": f"{type(error).__name__}: {error}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
