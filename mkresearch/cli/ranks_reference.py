"""`mkresearch decode --ranks N --backend reference`: the plain-JAX sharded reference on a mesh
of N devices (`mkresearch.sharding.reference_mesh`), in one process or across several
(`cli.multihost`, docs/multihost.md).

Each process holds only its ranks' slices of the weights: a random model's from its seed, a
checkpoint's read by byte ranges (`checkpoint.rank_loader`; the bytes each process read are
gathered and printed by process 0). A random prompt (or the checkpoint's) is stepped through,
then greedy tokens (argmax, the lowest id winning a tie). With every weight at hand (a random
model), process 0 steps the single-device sharded reference of the same --collectives
(`reference_sharded.decode_step` of the partial-sum or restructured layout, or
`reference.decode_step` with --collectives exact) over the same tokens: the mesh's logits
must equal its logits bit for bit at every step. `logits_sha256` fingerprints every step's
logits, so runs on other meshes (2 processes x 4 devices, 1 x 8) compare by one string.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

from mkresearch.cli import bench, multihost
from mkresearch.cli.common import refusals
from mkresearch.hardware import distributed
from mkresearch.model import reference, weights
from mkresearch.model.config import ModelConfig
from mkresearch.sharding import layout, reference_mesh, reference_sharded

CHECK = ("mesh logits vs the single-device sharded reference of the same collectives "
         "(reference_sharded.decode_step; exact collectives: reference.decode_step) on the "
         "same tokens, every step")


def decode(cfg: ModelConfig, prompt_len: int, steps: int, batch: int, seed: int, n_ranks: int,
           collectives: str = layout.PARTIAL_SUM, progress: bool = False,
           load: Callable[[layout.Layout, tuple], Any] | None = None, prompt: Any = None,
           etp: int | None = None) -> dict:
    """The decode (module docstring) -> its result, the same on every process. `load(lay,
    ranks)` (a checkpoint: `rank_loader.load_rank_params`) gives this process's ranks' slices
    in place of the random model's, and `prompt` [B, T] the checkpoint's tokens; `etp`: the
    ranks each routed expert's hidden is split over (None: the layout's)."""
    import jax
    import numpy as np

    lay = layout.layout(cfg, n_ranks, collectives=collectives, etp=etp)
    plan = reference_mesh.MeshReference(lay)  # refuses what it cannot run, before any work
    mesh = reference_mesh.make_mesh(n_ranks)
    ranks = distributed.local_ranks(mesh)
    params, loaded = None, None
    if load is None:
        params = weights.init_params(cfg, seed)
        local = layout.shard_params(params, lay, ranks)
    else:
        loaded = load(lay, ranks)
        local = loaded.params
    prompt = (bench.random_prompt(cfg, batch, prompt_len, seed) if prompt is None
              else np.asarray(prompt))  # [B, T]
    # with every weight at hand, process 0 checks each step against one device
    check = (SingleDeviceCheck(params, lay, batch)
             if params is not None and multihost.leader_prints() else None)
    run = _steps(plan, mesh, reference_mesh.place_params(local, mesh), prompt, steps, check,
                 progress)
    result = {"model": cfg.name, "backend": "reference", "ranks": n_ranks,
              "layout": lay.describe(), "collectives": collectives, "batch": batch,
              "prompt_len": prompt_len, "steps": steps, "seed": seed,
              "platform": jax.default_backend(), **multihost.processes_facts(),
              "prompt": prompt.tolist(), **run}
    if check is not None:
        result["single_device"] = check.result()
    if loaded is not None:
        result["bytes_read"] = multihost.bytes_read_rows(loaded)
    return result


def _steps(plan: reference_mesh.MeshReference, mesh: Any, placed: dict, prompt: Any,
           steps: int, check: SingleDeviceCheck | None, progress: bool) -> dict:
    """The prompt [B, T] stepped through, then `steps` greedy tokens (argmax: the lowest id wins
    a tie) -> {"generated", "logits_sha256", "seconds"}."""
    import numpy as np
    from tqdm import tqdm

    cfg, (batch, prompt_len) = plan.layout.cfg, prompt.shape
    state = reference_mesh.place_state(reference.init_state(cfg, batch), mesh)
    bar = tqdm(total=prompt_len + steps - 1, desc=f"{cfg.name} reference on "
               f"{plan.layout.n_ranks} ranks", unit="step", disable=not progress, leave=False)
    clock, digest, generated = bench.StepClock(), hashlib.sha256(), []
    token = prompt[:, 0]
    for t in range(prompt_len + steps - 1):
        positions = np.full(batch, t, np.int32)
        logits, state, _ = clock.run(reference_mesh.decode_step, placed, state, token,
                                     positions, plan, mesh)
        logits = distributed.to_host(logits)  # [B, V] f32
        digest.update(logits.tobytes())
        if check is not None:
            check.step(token, positions, logits)
        next_token = logits.argmax(-1).astype(np.int32)  # greedy: the lowest id wins a tie
        if t >= prompt_len - 1:
            generated.append(next_token)
        token = next_token if t >= prompt_len - 1 else prompt[:, t + 1]
        bar.update()
    bar.close()
    return {"generated": np.stack(generated, axis=1).tolist(),
            "logits_sha256": digest.hexdigest(),
            "seconds": {"compile_and_first_step": clock.compile_seconds, "step": clock.step_s}}


class SingleDeviceCheck:
    """The single-device sharded reference of the layout's collectives
    (`reference_sharded.decode_step`, partial-sum or restructured; exact collectives:
    `reference.decode_step`) stepped over the same tokens with its own state: each step's logits
    bit-equal to the mesh's?"""

    def __init__(self, params: dict, lay: layout.Layout, batch: int) -> None:
        self.cfg = lay.cfg
        self.params = (reference_sharded.sharded_params(params, lay)
                       if lay.partial_sums else params)  # partial-sum or restructured
        self.state = reference.init_state(lay.cfg, batch)
        self.steps = self.bit_equal = 0

    def step(self, token: Any, positions: Any, logits: Any) -> None:
        import numpy as np

        want, self.state, _ = reference.decode_step(self.params, self.state, token, positions,
                                                    self.cfg)
        self.steps += 1
        self.bit_equal += int(np.array_equal(np.asarray(want).view(np.uint32),
                                             np.asarray(logits).view(np.uint32)))

    def result(self) -> dict:
        return {"check": CHECK, "logits_bit_equal_steps": self.bit_equal, "steps": self.steps,
                "passed": self.bit_equal == self.steps}


def passed(result: dict) -> bool:
    return result.get("single_device", {}).get("passed", True)


def print_decode(result: dict) -> None:
    bench.print_run(result, f"plain-JAX sharded reference over {result['ranks']} ranks")
    if "text" in result:
        print(f"text: {result['text']!r}")
    print(f"layout: {result['layout']}; collectives {result['collectives']}")
    multihost.print_processes(result)
    one = result.get("single_device")
    if one is None:
        multihost.print_uncompared(result)
    else:
        print(f"equal to the single-device sharded reference: logits bit-equal at "
              f"{one['logits_bit_equal_steps']}/{one['steps']} steps -> "
              f"{'PASS' if one['passed'] else 'FAIL'}; every step's logits: sha256 "
              f"{result['logits_sha256'][:16]}...")
    seconds = result["seconds"]
    print(f"step time here: {seconds['step']:.3f} s (plain JAX, every rank computing the step "
          f"whole but its partial sums); compile + first step "
          f"{seconds['compile_and_first_step']:.1f} s")


def run_decode(args: Any, cfg: ModelConfig, progress: bool, load: Callable | None = None,
               prompt: Any = None, text: Callable | None = None) -> int:
    """decode --ranks N --backend reference (checked): here, on the run's devices."""
    started = time.perf_counter()
    with refusals():
        result = decode(cfg, args.prompt_len, args.steps, args.batch, args.seed, args.ranks,
                        args.collectives, progress, load, prompt, getattr(args, "etp", None))
    result["seconds"]["total"] = time.perf_counter() - started
    if text is not None:
        result["text"] = text(result["generated"][0])
    if multihost.leader_prints():
        if args.json:
            print(json.dumps(result))
        else:
            print_decode(result)
    return 0 if passed(result) else 1
