"""Measurements on a TPU, written to benchmarks/recorded/<chip>/ with the chip, JAX, jaxlib and
libtpu versions (`environment.json`). Run on a TPU machine (`.ci/tpu-run` where the machine has its
own JAX):

    python benchmarks/tpu_v5e.py decode       # mkresearch decode's run for every mini and expert
                                              # format (and both MLA layouts): the agreement line
    python benchmarks/tpu_v5e.py time         # device and wall time per step of the megakernel and
                                              # the jitted reference (32 steps per call), HBM floor;
                                              # a profile of kimi-k3-mini's loop at B = 8
    python benchmarks/tpu_v5e.py agreement    # decode's check over 24 seed pairs, every mini,
                                              # format, MLA layout, B = 1 and 8 (--models, --seeds)
    python benchmarks/tpu_v5e.py predicted    # on any machine: the timeline model's v5e step from
                                              # a recorded step, beside the recorded device time

Each writes one JSON file (`--out DIR`, default benchmarks/recorded/<chip>). Speed is measured
here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from mkresearch.hardware import tpu

tpu.select_platform()

import jax  # noqa: E402
from mkresearch.kernels.base import dma  # noqa: E402
from mkresearch.kernels.compose import megakernel as mk  # noqa: E402

from mkresearch.cli import bench  # noqa: E402
from mkresearch.generation import loop  # noqa: E402
from mkresearch.measurement import device_time  # noqa: E402
from mkresearch.model import reference, weights  # noqa: E402
from mkresearch.model.config import get_config  # noqa: E402
from mkresearch.prediction import timeline  # noqa: E402

MINIS = ("kimi-k3-mini", "deepseek-v3-mini", "glm-4.5-mini", "qwen3-235b-a22b-mini")
FORMATS = ("mxfp4", "fp8", "bf16")
MLA = ("kimi-k3-mini", "deepseek-v3-mini")


def variants(layouts: bool = True) -> list[tuple[str, dict]]:
    """Every mini in every expert format, the MLA minis in both cache layouts."""
    return [(name, {"expert_format": fmt, **({"mla_cache_layout": layout} if layout else {})})
            for name in MINIS for fmt in FORMATS
            for layout in (("expanded", "latent") if layouts and name in MLA else (None,))]


def environment() -> dict:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    device = jax.devices()[0]
    return {"platform": jax.default_backend(), "device_kind": device.device_kind,
            "chip": tpu.present_chip(), "jax": jax.__version__, "jaxlib": version("jaxlib"),
            "libtpu": version("libtpu") or version("libtpu-nightly"),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "argv": sys.argv}


def decode_all() -> list:
    rows = []
    for name, over in variants():
        try:
            result = bench.decode_megakernel(get_config(name, **over), 8, 16, 2, 0)
        except Exception:  # one variant failing says so and the others run
            traceback.print_exc()
            continue
        keep = ("model", "batch", "chip", "agreement", "agreement_line", "seconds", "prediction")
        rows.append({**{k: result[k] for k in keep}, "over": over})
        print(name, over, result["agreement_line"], flush=True)
    return rows


def time_all(out: Path) -> list:
    rows = []
    for name in MINIS:
        cfg = get_config(name)
        params = weights.init_params(cfg, 0)
        for batch in (1, 8):
            row = device_time.measure(cfg, params, batch=batch)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if jax.default_backend() == "tpu":
        profile_loop(out / "kimi-k3-mini_loop_B8.xplane.pb")
    return rows


def profile_loop(path: Path, batch: int = 8, steps: int = 32) -> None:
    """A profile of one call of the loop (`steps` steps of kimi-k3-mini at B = `batch`)."""
    cfg = get_config("kimi-k3-mini")
    prepared = mk.prepare_weights(weights.init_params(cfg, 0), cfg)
    holder = {"state": reference.init_state(cfg, batch)}
    zeros = np.zeros(batch, np.int32)

    def run():
        out = loop.decode(prepared, holder["state"], zeros, zeros, cfg, steps,
                          steps_per_call=steps)
        holder["state"] = out.state
        return out.tokens

    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir):
            jax.block_until_ready(run())
        shutil.copy(sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))[-1], path)


def agreement_sweep(out: Path, seeds: int = 24, steps: int = 16, prompt_len: int = 8,
                    models: tuple = MINIS) -> list:
    """`mkresearch decode`'s run and check (`bench.decode_and_compare`: the megakernel's greedy
    decode, the reference teacher-forced on the same tokens, `generation.agreement.compare`) for
    every mini, expert format, MLA cache layout, B = 1 and 8, and weight seeds 0..seeds-1 with
    prompt seeds 1000 + seed. One JSON line per run appended to agreement_sweep.jsonl as it ends
    (a run cut by a time limit keeps what it did)."""
    records, path = [], out / "agreement_sweep.jsonl"
    for name, over in variants():
        if name not in models:
            continue
        cfg = get_config(name, **over)
        for batch in (1, 8):
            for seed in range(seeds):
                started = time.perf_counter()  # the whole run: weights, compiles, both decodes
                result = bench.decode_and_compare(cfg, prompt_len, steps, batch, seed,
                                                  prompt_seed=1000 + seed)[0]
                run_s = time.perf_counter() - started
                record = {"model": name, "over": over, "B": batch, "seed": [seed, 1000 + seed],
                          "agreement": result["agreement"], "line": result["agreement_line"],
                          "seconds": {**result["seconds"], "run": run_s}}
                records.append(record)
                with path.open("a") as log:
                    log.write(json.dumps(record, default=str) + "\n")
            print(name, over, batch, sum(r["agreement"]["passed"] for r in records[-seeds:]),
                  "of", seeds, "passed", flush=True)
    return records


def predicted(recorded: Path) -> list:
    """The timeline model's v5e step of each mini at B = 1 and 8 (a step recorded here, the first
    of the timed run's inputs) beside the device time recorded in device_time.json."""
    measured = {(r["model"], r["batch"]): r["megakernel"]["device_s"]
                for r in json.loads((recorded / "device_time.json").read_text())}
    rows = []
    for name in MINIS:
        cfg = get_config(name)
        params = weights.init_params(cfg, 0)
        for batch in (1, 8):
            tokens = np.arange(batch, dtype=np.int32) * 7 % cfg.vocab_size
            with dma.recording() as log:
                jax.block_until_ready(mk.decode_step(
                    params, reference.init_state(cfg, batch), tokens, np.zeros(batch, np.int32),
                    cfg, options=mk.MegakernelOptions(chip="v5e"))[0])
            step = timeline.simulate(log, "v5e").total_s
            rows.append([name, batch, step, measured[(name, batch)]])
            print(f"{name} B={batch}: predicted {step * 1e6:.1f} us, measured "
                  f"{measured[(name, batch)] * 1e6:.1f} us", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("decode", "time", "agreement", "predicted"))
    parser.add_argument("--out", default=None, help="folder (default benchmarks/recorded/CHIP)")
    parser.add_argument("--models", default=",".join(MINIS), help="agreement: the minis (comma)")
    parser.add_argument("--seeds", type=int, default=24, help="agreement: seed pairs per case")
    args = parser.parse_args()
    out = Path(args.out or Path(__file__).parent / "recorded" / f"tpu-{tpu.default_chip()}")
    out.mkdir(parents=True, exist_ok=True)
    if args.what != "predicted":
        (out / "environment.json").write_text(json.dumps(environment(), indent=1))
    result = {"decode": decode_all, "agreement": lambda: agreement_sweep(out, args.seeds, models=tuple(args.models.split(","))),
              "time": lambda: time_all(out), "predicted": lambda: predicted(out)}[args.what]()
    name = {"time": "device_time", "agreement": "agreement_sweep",
            "predicted": "predicted_vs_measured"}.get(args.what, args.what)
    if args.what != "agreement":  # the sweep appended its lines as it went
        (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
