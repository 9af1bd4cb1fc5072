"""gpt-oss-20b at full size on one TPU v5e (15.7 GiB of HBM): random weights in the released
MXFP4 layout, decoded by the megakernel at B = 1..8 and a 4,096-token context.

    python benchmarks/gpt_oss_v5e.py [--batch 1,2,3,4,5,6,7,8] [--context 4096] [--steps 64]
                                     [--model gpt-oss-20b] [--json OUT]

The weights are drawn on the device straight into their stored formats (`weights.random_params`:
the experts as random MXFP4 codes and scales, never a bf16 or f32 copy: 14.30 GB in all, 10.7 GB
of it experts), then each batch size gets its KV caches (rows at position `--context`) and runs
`--steps` greedy steps in the library's decode loop (`generation.loop.decode`: chunks of 16
megakernel steps in one compiled call, tokens never leave the device), after one warm-up chunk
that compiles it. Printed per batch: the time per step (the timed steps' wall clock / their
count: the host dispatches one call per 16 steps, so this is the device's time per step to within
the dispatch), tokens/s, the HBM floor at that batch and context (`roofline.decode_floor`: every
byte the step must move / the chip's HBM bandwidth) and the measured step's share of it, and the
device's peak HBM in use. Off a TPU (interpret mode) only a mini is run, as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mkresearch.hardware import tpu

tpu.select_platform()  # before jax starts: CPU unless this machine has a TPU

import jax  # noqa: E402
import numpy as np  # noqa: E402
from mkresearch.kernels.compose import megakernel  # noqa: E402

from mkresearch.generation import loop  # noqa: E402
from mkresearch.model import kv_cache, reference, roofline, weights  # noqa: E402
from mkresearch.model.config import get_config  # noqa: E402

WARM_STEPS = loop.STEPS_PER_CALL  # one compiled chunk


def hbm_in_use() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {key: stats.get(key) for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def one_batch(cfg, prepared, batch: int, context: int, steps: int, chip: str) -> dict:
    seq_len = kv_cache.cache_length(cfg, context + WARM_STEPS + steps + 1)
    state = reference.init_state(cfg, batch, seq_len)
    tokens = (np.arange(batch, dtype=np.int32) * 7919 + 13) % cfg.vocab_size
    positions = np.full(batch, context, np.int32)
    started = time.perf_counter()
    run = loop.decode(prepared, state, tokens, positions, cfg, WARM_STEPS)
    jax.block_until_ready(run.tokens)
    warm = time.perf_counter() - started
    started = time.perf_counter()
    run = loop.decode(prepared, run.state, run.next_tokens, run.next_positions, cfg, steps)
    jax.block_until_ready(run.tokens)
    step_s = (time.perf_counter() - started) / steps
    floor = roofline.decode_floor(cfg, chip, batch, context + WARM_STEPS + steps // 2)
    return {"batch": batch, "context": context, "cache_tokens": seq_len, "steps_timed": steps,
            "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
            "hbm_floor_ms": floor.seconds * 1e3, "share_of_floor": floor.seconds / step_s,
            "floor_bytes": floor.bytes, "first_chunk_s": warm, "hbm": hbm_in_use(),
            "finite_tokens": bool(np.all((np.asarray(run.tokens) >= 0)
                                         & (np.asarray(run.tokens) < cfg.vocab_size)))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument("--batch", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the results there too")
    args = parser.parse_args()
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not args.model.endswith("-mini"):
        print(f"no TPU here: {args.model} at full size runs on a TPU; a mini (gpt-oss-mini) runs "
              "in interpret mode as a smoke test", file=sys.stderr)
        return 2
    cfg = get_config(args.model)
    chip = tpu.target_chip() or "v5e"
    batches = [int(b) for b in args.batch.split(",")]
    for batch in batches:  # refused before any work: a plan over VMEM, a model over HBM
        megakernel.make_plan(cfg, batch, kv_cache.cache_length(
            cfg, args.context + WARM_STEPS + args.steps + 1),
            megakernel.MegakernelOptions(chip=chip))
    started = time.perf_counter()
    params = jax.block_until_ready(weights.random_params(cfg, seed=0))
    prepared = jax.block_until_ready(megakernel.prepare_weights(params, cfg))
    del params  # the prepared weights hold the same expert arrays
    print(f"{cfg.name} on {jax.devices()[0].device_kind} ({jax.default_backend()}): random "
          f"weights in {cfg.expert_format} drawn on the device in "
          f"{time.perf_counter() - started:.1f} s, {weights.nbytes(prepared) / 1e9:.2f} GB; HBM "
          f"{hbm_in_use()}", flush=True)
    rows = []
    for batch in batches:
        row = one_batch(cfg, prepared, batch, args.context, args.steps, chip)
        rows.append(row)
        print(f"B={batch}: {row['step_ms']:.3f} ms/step, {row['tokens_per_s']:.1f} tokens/s; HBM "
              f"floor {row['hbm_floor_ms']:.3f} ms ({row['floor_bytes'] / 1e9:.2f} GB), "
              f"{100 * row['share_of_floor']:.1f} % of it; first chunk (compile) "
              f"{row['first_chunk_s']:.1f} s; peak HBM {row['hbm']['peak_bytes_in_use']}",
              flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": cfg.name, "chip": chip, "backend": jax.default_backend(),
                       "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
