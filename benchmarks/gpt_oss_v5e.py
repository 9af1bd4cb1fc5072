"""gpt-oss-20b at full size on one TPU v5e (15.7 GiB of HBM): random weights in the released
MXFP4 layout, decoded by the megakernel at B = 1..8 and a 4,096-token context.

    python benchmarks/gpt_oss_v5e.py [--batch 1,2,3,4,5,6,7,8] [--context 4096]
                                     [--backends megakernel] [--model gpt-oss-20b] [--json OUT]

The weights are drawn on the device straight into their stored formats (`weights.random_params`:
the experts as random MXFP4 codes and scales, never a bf16 or f32 copy: 14.30 GB in all), then for
each batch size `measurement.device_time.measure` runs 32 greedy steps per call of the library's
decode loop from rows at position `--context`: the device time per step read from a profile of
the TPU's executions, the wall time, and (on a TPU) the copy ceiling of the same step (its bytes
streamed HBM <-> VMEM, nothing computed). Printed per batch: the device time per step, tokens/s,
the HBM floor (`roofline.step_bytes` / the chip's bandwidth) and the step's share of it, the copy
ceiling's time, and the device's peak HBM in use. `--backends megakernel,reference` also times the
plain-JAX reference step (XLA) beside it; the op-by-op step on JAX's kernels ("jax-kernels") has
no GPT-OSS attention kind yet. Off a TPU (interpret mode) only a mini runs, as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mkresearch.hardware import tpu

tpu.select_platform()  # before jax starts: CPU unless this machine has a TPU

import jax  # noqa: E402

from mkresearch.measurement import device_time  # noqa: E402
from mkresearch.model import weights  # noqa: E402
from mkresearch.model.config import get_config  # noqa: E402


def hbm_in_use() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {key: stats.get(key) for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument("--batch", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--backends", default="megakernel")
    parser.add_argument("--json", default=None, help="write the rows there too")
    args = parser.parse_args()
    if jax.default_backend() != "tpu" and not args.model.endswith("-mini"):
        print(f"no TPU here: {args.model} at full size runs on a TPU; a mini (gpt-oss-mini) runs "
              "in interpret mode as a smoke test", file=sys.stderr)
        return 2
    cfg = get_config(args.model)
    started = time.perf_counter()
    params = jax.block_until_ready(weights.random_params(cfg, seed=0))
    print(f"{cfg.name} on {jax.devices()[0].device_kind} ({jax.default_backend()}): random "
          f"weights in {cfg.expert_format} drawn on the device in "
          f"{time.perf_counter() - started:.1f} s, {weights.nbytes(params) / 1e9:.2f} GB; HBM "
          f"{hbm_in_use()}", flush=True)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        row = device_time.measure(cfg, params, batch=batch, context=args.context,
                                  backends=tuple(args.backends.split(",")))
        row["hbm"] = hbm_in_use()
        rows.append(row)
        floor = row["hbm_floor_s"]
        for backend in args.backends.split(","):
            one = row[backend]
            seconds = one.get("device_s", one["wall_s"])
            which = "device" if "device_s" in one else "wall (no profile off a TPU)"
            print(f"B={batch} {backend}: {seconds * 1e3:.3f} ms/step {which} (wall "
                  f"{one['wall_s'] * 1e3:.3f}), {batch / seconds:.1f} tokens/s; HBM floor "
                  f"{floor * 1e3:.3f} ms, {100 * floor / seconds:.1f} % of it; first call "
                  f"(compile) {one['compile_s']:.1f} s", flush=True)
        if "copy" in row:
            print(f"B={batch} copy ceiling: {row['copy']['device_s'] * 1e3:.3f} ms for "
                  f"{row['copy']['bytes'] / 1e9:.2f} GB ({row['copy']['bandwidth'] / 1e9:.0f} "
                  "GB/s)", flush=True)
        print(f"B={batch} HBM: {row['hbm']}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
