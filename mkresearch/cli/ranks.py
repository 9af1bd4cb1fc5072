"""`mkresearch decode --ranks N` and `mkresearch bench --ranks N`: the sharded megakernel
(`kernels/compose/megakernel_sharded.py`) on a mesh of N devices, against the reference and the
single-device megakernel.

Devices. XLA fixes the number of CPU devices when its backend starts, so N simulated devices
cannot be had in a process that already has fewer. `devices_or_rerun` asks JAX how many devices
there are; on CPU, when there are fewer than N, it runs the same command again in a child process
with `--xla_force_host_platform_device_count=N` in XLA_FLAGS (the child's stdout and stderr are
this process's: its progress bar sees the same terminal) and returns the child's exit status.
Why a child and not the flag set in `__main__` before jax loads: the console script `mkresearch`
does not go through `__main__`, `cli.main(argv)` is called in-process by tests and notebooks
after jax started, and an argv pre-parse would duplicate the parser. The child is marked
(`CHILD_ENV`), so a flag XLA ignores ends in a one-line refusal, never in a loop. On a TPU the
real devices are used; too few of them is a one-line refusal naming --ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import mkresearch  # noqa: F401 - selects the platform before jax is imported
from mkresearch.cli import bench, multihost, ranks_reference
from mkresearch.cli.common import (
    UsageError,
    at_least,
    human_bytes,
    options_of,
    refusals,
    wire_with_partial_sums,
)
from mkresearch.hardware import distributed
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel
from mkresearch.kernels.compose import megakernel_plan as mplan
from mkresearch.kernels.compose import megakernel_sharded as sharded
from mkresearch.kernels.sharded import plan as sharding
from mkresearch.measurement import logs
from mkresearch.model import reference, weights
from mkresearch.model.config import EXPERT_MXU_INPUTS, ModelConfig
from mkresearch.prediction import timeline
from mkresearch.prediction.timeline_ranks import rank_events
from mkresearch.sharding import layout, reference_sharded

# the backends --ranks shards: the sharded megakernel, the plain-JAX sharded reference
SHARDED_BACKENDS = ("megakernel", "reference")
CHILD_ENV = "MKRESEARCH_RANKS_CHILD"  # set in the child started with N simulated devices
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def add_decode_arguments(p: Any) -> None:
    """`decode`'s options for the sharded megakernel."""
    p.add_argument("--ranks", type=int, default=1,
                   help="devices the megakernel is sharded across (default 1); on CPU that many "
                        "simulated devices, in a child process when needed")
    p.add_argument("--collectives", default=layout.PARTIAL_SUM, choices=layout.COLLECTIVES,
                   help="with --ranks: partial sums reduced in one fixed order (default), the "
                        "exact schedule (every value whole on one rank: the single device's "
                        "bits), or restructured (partial sums, the MoE latent reduce-scattered "
                        "and W_lu's partial sums beside the shared experts')")
    p.add_argument("--router", default=layout.ROUTER_SPLIT, choices=layout.ROUTER_PLACEMENTS,
                   help="with --ranks: where the MoE router's columns live "
                        "(MegakernelOptions.router_placement): split over every rank (default; "
                        "its scores gathered with the latent before top-k), over one host's "
                        "ranks, between sibling cores, or replicated on every rank (no gather "
                        "before top-k)")
    p.add_argument("--etp", type=int, default=None,
                   help="with --ranks (the megakernel or the reference): the ranks each routed "
                        "expert's hidden "
                        "is split over (expert-tensor parallel; default the layout's, the "
                        "release's 4 where it fits); the partial-sum modes split W2 by its rows, "
                        "so they take more ways than the exact mode")
    # the designs of `predict --designs` that are kernel options (docs/prediction.md §8)
    p.add_argument("--wire", default="f32", choices=sharding.WIRES,
                   help="with --ranks and partial sums: the partial sums' format on the wire "
                        "(bf16: 2 bytes a value, each sum rounded as the wire carries it)")
    p.add_argument("--expert-slots", type=int, default=None,
                   help="with --ranks: VMEM slots per expert matrix "
                        f"(MegakernelOptions.expert_slots, {mplan.EXPERT_SLOTS[0]}.."
                        f"{mplan.EXPERT_SLOTS[-1]}; default 2): n - 1 experts' reads move while "
                        "one is multiplied")
    p.add_argument("--expert-reads-first", action="store_true",
                   help="with --ranks: once routing is known, the routed experts' DMAs go ahead "
                        "of the ring's queued blocks (MegakernelOptions.expert_reads_first)")
    p.add_argument("--expert-mxu", default=None, choices=EXPERT_MXU_INPUTS,
                   help="with --ranks: the routed experts handed to the MXU decoded to bf16 (the "
                        "preset's) or as fp8 with the block scales after the dot "
                        "(ModelConfig.expert_mxu)")


# decode --ranks N's kernel designs, with the value each takes when not given
DESIGN_OPTIONS = (("--wire", "wire", "f32"), ("--expert-slots", "expert_slots", None),
                  ("--expert-reads-first", "expert_reads_first", False),
                  ("--expert-mxu", "expert_mxu", None))


def _sharded_only(args: Any) -> None:
    """--collectives and --router given where nothing is sharded (or, --router, where the
    sharded reference places no router): a UsageError, not an option silently dropped."""
    collectives = getattr(args, "collectives", layout.PARTIAL_SUM)
    router = getattr(args, "router", layout.ROUTER_SPLIT)
    if getattr(args, "ranks", 1) == 1:
        options_of("--ranks N > 1", (("--collectives", collectives, layout.PARTIAL_SUM),
                                     ("--router", router, layout.ROUTER_SPLIT)),
                   "one device sends no collective and splits no router")
    elif router != layout.ROUTER_SPLIT and getattr(args, "backend", None) == "reference":
        raise UsageError(f"--router {router} is an option of the sharded megakernel (--backend "
                         "megakernel): the sharded reference splits the router over every rank")


def design_options(cfg: ModelConfig, args: Any) -> tuple[ModelConfig, str, dict]:
    """`decode --ranks N`'s designs beyond the layout, checked before anything runs (a one-line
    UsageError naming the option): (the config with --expert-mxu, the partial sums' wire, the
    MegakernelOptions fields they set)."""
    _sharded_only(args)
    given = [flag for flag, dest, default in DESIGN_OPTIONS
             if getattr(args, dest, default) != default]
    wire = getattr(args, "wire", "f32")
    if not given:
        return cfg, wire, {}
    if args.ranks == 1 or getattr(args, "backend", None) not in (None, "megakernel"):
        raise UsageError(f"{given[0]} is an option of the sharded megakernel: give --ranks N > 1 "
                         "(and --backend megakernel)")
    wire_with_partial_sums(wire, getattr(args, "collectives", layout.PARTIAL_SUM))
    slots, first = getattr(args, "expert_slots", None), getattr(args, "expert_reads_first", False)
    fields = {**({} if slots is None else {"expert_slots": slots}),
              **({"expert_reads_first": True} if first else {})}
    if slots is not None and slots not in mplan.EXPERT_SLOTS:  # the range the megakernel takes
        raise UsageError(f"--expert-slots {slots} is invalid: an int in "
                         f"[{mplan.EXPERT_SLOTS[0]}, {mplan.EXPERT_SLOTS[-1]}]")
    if getattr(args, "expert_mxu", None) is not None:
        with refusals():  # bf16 experts: refused, naming the field
            cfg = cfg.replace(expert_mxu=args.expert_mxu)
    return cfg, wire, fields


def check_ranks(cfg: ModelConfig, n_ranks: int, backend: str = "megakernel",
                etp: int | None = None, collectives: str | None = None) -> None:
    """--ranks before anything runs: an int >= 1, a backend that shards (SHARDED_BACKENDS), and
    a count the model's layout can split (heads, vocabulary, experts: `layout.check_ranks`);
    --etp, a split the layout of `collectives` takes, on more than one rank."""
    at_least("--ranks", n_ranks, 1)
    if etp is not None and n_ranks == 1:
        raise UsageError(f"--etp {etp} needs --ranks N > 1 (one device splits no expert)")
    if n_ranks > 1 and backend not in SHARDED_BACKENDS:
        raise UsageError(f"--ranks {n_ranks} needs --backend megakernel or reference: the "
                         f"{backend} backend runs one device (use --ranks 1)")
    if n_ranks > 1:
        try:
            layout.check_ranks(cfg, n_ranks)
        except ValueError as error:
            raise UsageError(f"--ranks {n_ranks}: {str(error).splitlines()[0]}") from None
    if etp is not None:
        try:
            layout.layout(cfg, n_ranks, collectives=collectives or layout.PARTIAL_SUM, etp=etp)
        except ValueError as error:
            raise UsageError(f"--etp {etp}: {str(error).splitlines()[0]}") from None


def child_xla_flags(flags: str, n_ranks: int) -> str:
    """XLA_FLAGS with the CPU device count set to n_ranks (an earlier count dropped)."""
    kept = [flag for flag in flags.split() if not flag.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={n_ranks}"])


def devices_or_rerun(n_ranks: int, argv: Sequence[str]) -> int | None:
    """None when JAX has n_ranks devices here; else, on CPU, the exit status of the same command
    run in a child with n_ranks simulated devices (module docstring). UsageError on a TPU (or
    GPU) with fewer devices, and in a child that still has too few."""
    import jax

    have, platform = len(jax.devices()), jax.default_backend()
    if have >= n_ranks:
        return None
    if jax.process_count() > 1:
        raise UsageError(f"--ranks {n_ranks} needs {n_ranks} devices but the run's "
                         f"{jax.process_count()} processes have {have} together: choose --ranks "
                         f"<= {have}, or give each process more (--local-devices on CPU)")
    if platform != "cpu" or os.environ.get(CHILD_ENV) == "1":
        raise UsageError(f"--ranks {n_ranks} needs {n_ranks} devices but this {platform} backend "
                         f"has {have}: choose --ranks <= {have}")
    env = {**os.environ, CHILD_ENV: "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": child_xla_flags(os.environ.get("XLA_FLAGS", ""), n_ranks)}
    return subprocess.run([sys.executable, "-m", "mkresearch", *argv], env=env,
                          check=False).returncode


# ---- one recorded step, per rank ---------------------------------------------------------------
RANK_TIMELINE_LABEL = ("timeline model of this rank's events alone: what it receives taken as "
                       "ready, its remote copies priced as local DMAs (not measured)")


def rank_rows(log: dma.DmaLog, lay: layout.Layout, batch: int, chip: str) -> list[dict]:
    """Per rank of a recorded sharded step: HBM bytes DMA'd (weights apart from caches, states,
    embedding rows and routed experts), remote bytes sent to peers, and the timeline model's step
    for that rank's events alone (`rank_events`, RANK_TIMELINE_LABEL)."""
    rows = []
    for rank in log.ranks:
        events = log.of_rank(rank)
        moved = logs.hbm_bytes_by_component(events)
        weight_bytes = sum(moved.get(name, 0) for name in
                           ("kda", "mla", "dense", "moe_nonrouted", "lm_head", "norms_and_mix"))
        simulated = timeline.simulate(rank_events(log, rank), chip)
        rows.append({"rank": rank, "hbm_bytes": events.dma_bytes(), "weight_bytes": weight_bytes,
                     "routed_expert_bytes": moved.get("routed_experts", 0),
                     "remote_bytes": events.remote_bytes(),
                     "remote_copies": sum(1 for e in events.select("dma_start") if e.remote),
                     "predicted_step_s": simulated.total_s, "chip": chip,
                     "label": RANK_TIMELINE_LABEL})
    return rows


# ---- decode ----------------------------------------------------------------------------------
def decode_sharded(cfg: ModelConfig, prompt_len: int, steps: int, batch: int, seed: int,
                   n_ranks: int, chip: str = "tpu7x", progress: bool = False,
                   collectives: str = layout.PARTIAL_SUM, params: dict | None = None,
                   prompt: Any = None, load: Any = None,
                   router: str = layout.ROUTER_SPLIT, etp: int | None = None,
                   wire: str = "f32", kernel_fields: dict | None = None) -> dict:
    """`bench.decode_megakernel` on n_ranks devices: a random prompt stepped through, then greedy
    tokens, all chosen by the sharded megakernel. The single-device megakernel and the reference
    step over the same tokens with states of their own: per step the sharded logits must EQUAL
    the single device's (bit for bit) with the exact collectives and agree with the reference
    (same greedy token but at near-ties, logits within 5e-2). With partial sums
    (`layout.COLLECTIVES`) they must EQUAL the sharded reference's (`PartialSumCheck`, its own
    state) and keep the partial-sum claim against the reference (`reference_sharded`: logits
    within SAME_ROUTING_BOUND until a row's routing differs from the reference's, another greedy
    token only at a near-tie of twice that or after it); the single device's are reported. One
    more step is recorded for per-rank bytes. `params` and `prompt` [B, T] (a checkpoint's
    weights and its tokenized prompt: `mkresearch.cli.checkpoint`) replace the random ones;
    `load(lay, ranks)` (a checkpoint read per process in a multi-process run:
    `rank_loader.load_rank_params`) gives only this process's ranks' slices, and then no process
    has the weights the single-device checks need: they are left out (`logits_sha256`
    fingerprints every step's logits, to compare with a one-process run). `router`: the router's
    placement (`MegakernelOptions.router_placement`: the weights laid out as `plan.layout`);
    `etp`: the experts' expert-tensor ways (None: the layout's); `wire`: the partial sums'
    format on the wire (the sharded reference rounds as it does); `kernel_fields`: more
    MegakernelOptions (`design_options`: expert slots, expert reads first)."""
    import jax
    import numpy as np
    from tqdm import tqdm

    options = megakernel.MegakernelOptions(chip=chip)
    lay = layout.layout(cfg, n_ranks, collectives=collectives, etp=etp)
    # the reductions sent as the sharding plan chooses for the chip's slice (`kernel_options`)
    plan = sharded.make_sharded_plan(lay, batch, cfg.max_seq_len, sharded.kernel_options(
        lay, batch, chip, wire, router_placement=router, **(kernel_fields or {})),
        wire)  # refuses first
    megakernel.make_plan(cfg, batch, cfg.max_seq_len, options)
    mesh = sharded.make_mesh(n_ranks)
    params, prepared, loaded = _weights_on_ranks(cfg, seed, plan.layout, mesh, params, load)
    prompt = (bench.random_prompt(cfg, batch, prompt_len, seed) if prompt is None
              else np.asarray(prompt))  # [B, T]
    state = sharded.shard_state(reference.init_state(cfg, batch), lay, mesh)
    checks = (None if loaded is not None else
              SingleDeviceChecks(params, lay, batch, options, plan.mega.options.ranks_per_host,
                                 wire))
    bar = tqdm(total=prompt_len + steps - 1, desc=f"{cfg.name} on {n_ranks} ranks", unit="step",
               disable=not progress, leave=False)
    generated, digest, clock, state, token = _step_sharded(prepared, state, prompt, steps, plan,
                                                           mesh, checks, bar)
    bar.close()
    log = _recorded_step(prepared, state, token, prompt_len + steps - 1, plan, mesh)
    result = {
        "model": cfg.name, "backend": "megakernel", "ranks": n_ranks, "layout": lay.describe(),
        "batch": batch, "prompt_len": prompt_len, "steps": steps, "seed": seed,
        "platform": jax.default_backend(), **multihost.processes_facts(),
        "prompt": prompt.tolist(), "generated": np.stack(generated, axis=1).tolist(),  # [B, N]
        "collectives": collectives, "logits_sha256": digest,
        "seconds": {"compile_and_first_step": clock.compile_seconds, "step": clock.step_s},
        "step_label": bench.backend_label("megakernel"),
        "per_rank": rank_rows(log, plan.layout, batch, chip),
        "vmem_plan_bytes": plan.mega.vmem.total_bytes,
        **({} if router == layout.ROUTER_SPLIT else {"router": router}),
        **({} if wire == "f32" else {"wire": wire}), **(kernel_fields or {}),
        **({"expert_mxu": cfg.expert_mxu} if cfg.expert_mxu != "bf16" else {}),
    }
    if checks:
        result.update(checks.result(prompt_len + steps - 1))
    else:
        result["passed"] = True  # nothing to hold it to here: logits_sha256 against one process
        result["bytes_read"] = multihost.bytes_read_rows(loaded)
    return result


def _weights_on_ranks(cfg: ModelConfig, seed: int, lay: layout.Layout, mesh: Any,
                      params: dict | None, load: Any) -> tuple[dict | None, Any, Any]:
    """`decode_sharded`'s weights onto the ranks by the layout: (the whole weights (None when
    read per process), the ranks' weights, what `load` read (None without it))."""
    if load is not None:
        loaded = load(lay, distributed.local_ranks(mesh))
        return params, sharded.prepare_rank_weights(loaded.params, lay, mesh), loaded
    params = weights.init_params(cfg, seed) if params is None else params
    return params, sharded.prepare_weights(params, lay, mesh), None


def _recorded_step(prepared: Any, state: Any, token: Any, position: int, plan: Any,
                   mesh: Any) -> dma.DmaLog:
    """One more step at `position`, recorded: the DMA log of per-rank bytes."""
    import jax
    import numpy as np

    with dma.recording() as log:
        out, _, _ = sharded.decode_step(prepared, state, token,
                                        np.full(len(token), position, np.int32), plan, mesh=mesh)
        jax.block_until_ready(out)
    return log


def _step_sharded(prepared: Any, state: Any, prompt: Any, steps: int, plan: Any, mesh: Any,
                  checks: SingleDeviceChecks | None, bar: Any) -> tuple[list, str, Any, Any,
                                                                       Any]:
    """The sharded megakernel stepped through the prompt [B, T], then through `steps` greedy
    tokens of its own, each step held to `checks` (if any): (the generated tokens [B] per step,
    the sha256 of every step's logits, the StepClock, the state, the last token)."""
    import hashlib

    import numpy as np

    batch, prompt_len = prompt.shape
    generated, digest, clock = [], hashlib.sha256(), bench.StepClock()
    token = prompt[:, 0]
    for t in range(prompt_len + steps - 1):
        positions = np.full(batch, t, np.int32)
        next_token, state, aux = clock.run(sharded.decode_step, prepared, state, token,
                                           positions, plan, mesh=mesh, return_logits=True)
        next_token, logits = distributed.to_host((next_token, aux["logits"]))  # [B], [B, V]
        digest.update(np.asarray(logits).tobytes())
        generated_step = t - prompt_len + 1 if t >= prompt_len - 1 else None
        if checks:
            checks.step(token, positions, logits, next_token, generated_step, state)
        if generated_step is not None:
            generated.append(next_token)
        token = next_token if t >= prompt_len - 1 else prompt[:, t + 1]
        bar.update()
    return generated, digest.hexdigest(), clock, state, token


class SingleDeviceChecks:
    """`decode_sharded`'s checks, step by step: the single-device megakernel and the reference
    (and with partial sums the sharded reference: `PartialSumCheck`) over the same tokens, each
    with its own state. Every rank's slice of every state leaf (caches, recurrent states) must
    equal to the bit the single-device megakernel's (exact collectives) or the sharded
    reference's (partial sums) at every step, not only the logits: a state that differs in its
    last bits leaves the logits equal for many steps (`layout.state_mismatches`)."""

    def __init__(self, params: dict, lay: layout.Layout, batch: int,
                 options: megakernel.MegakernelOptions, ranks_per_host: int,
                 wire: str = "f32") -> None:
        cfg = lay.cfg
        self.params, self.cfg, self.batch, self.options = params, cfg, batch, options
        self.single = megakernel.prepare_weights(params, cfg)
        self.single_state = reference.init_state(cfg, batch)
        self.ref_state = reference.init_state(cfg, batch)
        self.exact = lay.collectives == layout.EXACT
        self.partial = None if self.exact else PartialSumCheck(params, lay, batch, ranks_per_host,
                                                               wire)
        self.tie_gap = (bench.NEAR_TIE_GAP if self.exact
                        else 2 * reference_sharded.SAME_ROUTING_BOUND[wire])
        self.equal, self.near_ties, self.worst = 0, [], 0.0
        self.single_tokens_equal, self.single_bit_equal, self.worst_single = 0, 0, 0.0
        self.tokens = 0
        self.lay, self.state_equal_steps, self.state_mismatches = lay, 0, []
        self.steps = 0

    def step(self, token: Any, positions: Any, logits: Any, next_token: Any,
             generated_step: int | None, state: Any = None) -> None:
        """One step: the sharded run's `logits` [B, V], `next_token` [B] and `state` (every
        rank's, [n_ranks, ...]) at `positions` after `token`; generated_step: the index of the
        generated token it chose (None in the prompt)."""
        import numpy as np

        one_token, self.single_state, one_aux = megakernel.decode_step(
            self.single, self.single_state, token, positions, self.cfg, options=self.options,
            return_logits=True)
        ref_logits, self.ref_state, ref_aux = reference.decode_step(
            self.params, self.ref_state, token, positions, self.cfg)
        if self.partial:
            self.partial.step(logits, token, positions, ref_aux)
        if state is not None:
            self._check_state(state)
        one_logits = np.asarray(one_aux["logits"])
        self.single_tokens_equal += int((np.asarray(one_token) == next_token).sum())
        self.single_bit_equal += int(np.array_equal(logits.view(np.uint32),
                                                    one_logits.view(np.uint32)))
        self.worst_single = max(self.worst_single, float(np.abs(logits - one_logits).max()))
        if generated_step is None:
            return
        ref_logits = np.asarray(ref_logits)  # a generated token: the reference's greedy choice
        self.worst = max(self.worst, float(np.abs(logits - ref_logits).max()))
        self.equal += int((ref_logits.argmax(-1) == next_token).sum())
        self.tokens += len(next_token)
        self.near_ties += [
            {"step": generated_step, "row": row, "top2_gap": gap}
            | ({} if self.exact else {"routing_differed": self.partial.differed(row)})
            for row, gap, differs in bench.near_tie_rows(ref_logits, next_token, self.tie_gap)
            if differs]
        if self.partial:
            self.partial.against_reference(logits, ref_logits)

    MISMATCHES_KEPT = 8  # the first differing (step, leaf)s a result reports

    def _check_state(self, state: Any) -> None:
        """Every rank's state slice against the single-device megakernel's state (exact) or
        the sharded reference's (partial sums), to the bit."""
        want = self.single_state if self.exact else self.partial.state
        found = layout.state_mismatches(distributed.to_host(state), want, self.lay)
        self.state_equal_steps += not found
        kept = self.MISMATCHES_KEPT - len(self.state_mismatches)
        self.state_mismatches += [{"step": self.steps} | m for m in found[:max(kept, 0)]]
        self.steps += 1

    def result(self, n_steps: int) -> dict:
        """The result's "agreement", "single_device" and "passed"."""
        exact, partial, batch = self.exact, self.partial, self.batch
        reference_ok = all(tie["top2_gap"] < self.tie_gap or tie.get("routing_differed")
                           for tie in self.near_ties) and (exact or partial.within)
        single_ok = (self.single_bit_equal == n_steps
                     and self.single_tokens_equal == batch * n_steps if exact
                     else partial.bit_equal_steps == n_steps)
        single_ok = single_ok and self.state_equal_steps == n_steps
        return {
            "agreement": {"check": "sharded megakernel vs reference.decode_step on the same "
                                   "tokens, greedy" + ("" if exact else partial.CLAIM),
                          "tokens_equal": self.equal, "tokens": self.tokens,
                          "max_abs_logit_diff": self.worst, "near_ties": self.near_ties,
                          "passed": reference_ok} | ({} if exact else partial.routing_facts()),
            "single_device": {"check": "sharded vs single-device megakernel on the same tokens, "
                                       "every step (prompt included): " + (
                                           "tokens, logits and every rank's state slice "
                                           "bit-equal" if exact else
                                           "partial sums: reported; logits and every rank's "
                                           "state slice bit-equal to the sharded reference's "
                                           "(reference_sharded, its own state)"),
                              "tokens_equal": self.single_tokens_equal, "tokens": batch * n_steps,
                              "logits_bit_equal_steps": self.single_bit_equal, "steps": n_steps,
                              "max_abs_logit_diff": self.worst_single,
                              "state_bit_equal_steps": self.state_equal_steps,
                              "state_mismatches": self.state_mismatches, "passed": single_ok}
            | ({} if exact else {"sharded_reference_bit_equal_steps": partial.bit_equal_steps}),
            "passed": reference_ok and single_ok,
        }


class PartialSumCheck:
    """`decode --ranks` with partial sums, step by step: the kernel's logits against the sharded
    reference's (stepped with its own state: equal to the bit), each row's routing against the
    single-device reference's, and the reference's logits within the claim until a row's routing
    differed (`reference_sharded.within_claim`)."""

    CLAIM = (": partial sums, logits within reference_sharded.SAME_ROUTING_BOUND until a row's "
             "routing differs from the reference's, another token only at a near-tie of twice "
             "that or after it")

    def __init__(self, params: dict, lay: layout.Layout, batch: int, ranks_per_host: int,
                 wire: str = "f32"):
        import numpy as np

        self.cfg, self.wire = lay.cfg, wire
        self.params = reference_sharded.sharded_params(params, lay, wire, ranks_per_host)
        self.state = reference.init_state(lay.cfg, batch)
        self.routing_differed = np.zeros(batch, bool)  # [B]: at some step so far
        self.bit_equal_steps, self.within, self.worst_same_routing = 0, True, 0.0

    def step(self, logits: Any, tokens: Any, positions: Any, ref_aux: dict) -> None:
        import numpy as np

        want, self.state, aux = reference.decode_step(self.params, self.state, tokens, positions,
                                                      self.cfg)
        self.bit_equal_steps += int(np.array_equal(np.asarray(want).view(np.uint32),
                                                   np.asarray(logits).view(np.uint32)))
        if "expert_ids" in aux:
            self.routing_differed |= reference_sharded.routing_differs(aux["expert_ids"],
                                                                       ref_aux["expert_ids"])

    def differed(self, row: int) -> bool:
        return bool(self.routing_differed[row])

    def against_reference(self, logits: Any, ref_logits: Any) -> None:
        import numpy as np

        self.within &= bool(reference_sharded.within_claim(logits, ref_logits,
                                                           self.routing_differed,
                                                           self.wire).all())
        same = ~self.routing_differed
        if same.any():
            self.worst_same_routing = max(self.worst_same_routing,
                                          float(np.abs(logits - ref_logits)[same].max()))

    def routing_facts(self) -> dict:
        return {"rows_routing_differed": int(self.routing_differed.sum()),
                "max_abs_logit_diff_same_routing": self.worst_same_routing,
                "bound_same_routing": reference_sharded.SAME_ROUTING_BOUND[self.wire]}


def print_decode(result: dict) -> None:
    bench.print_run(result, f"megakernel sharded over {result['ranks']} ranks (one pallas_call "
                            "per step per rank)")
    if "text" in result:  # --checkpoint: the prompt and what followed it
        print(f"text: {result['text']!r}")
    print(f"layout: {result['layout']}"
          + (f"; router {result['router']} (MegakernelOptions.router_placement)"
             if "router" in result else ""))
    designs = [flag if result[dest] is True else f"{flag} {result[dest]}"
               for flag, dest, _ in DESIGN_OPTIONS if dest in result]
    if designs:
        print(f"designs: {', '.join(designs)}")
    multihost.print_processes(result)
    if "agreement" not in result:  # each process read its ranks' shards: nothing to compare
        multihost.print_uncompared(result)
        print_rank_rows(result["per_rank"])
        return
    bench.print_agreement(result["agreement"])
    agree, one = result["agreement"], result["single_device"]
    if "rows_routing_differed" in agree:  # partial sums
        print(f"rows whose routing differed from the reference's: "
              f"{agree['rows_routing_differed']}/{result['batch']}; max |logit diff| before "
              f"{agree['max_abs_logit_diff_same_routing']:.2e} (claim: within "
              f"{agree['bound_same_routing']})")
        print(f"equal to the sharded reference (the same partial sums, plain JAX): logits "
              f"bit-equal at {one['sharded_reference_bit_equal_steps']}/{one['steps']} steps -> "
              f"{'PASS' if one['passed'] else 'FAIL'}")
    verdict = ("" if "sharded_reference_bit_equal_steps" in one
               else f" -> {'PASS' if one['passed'] else 'FAIL'}")
    print(f"equal to the single-device megakernel: {one['tokens_equal']}/{one['tokens']} tokens, "
          f"logits bit-equal at {one['logits_bit_equal_steps']}/{one['steps']} steps (max |diff| "
          f"{one['max_abs_logit_diff']:.2e}){verdict}")
    print_state_check(one)
    print_rank_rows(result["per_rank"])
    seconds = result["seconds"]
    print(f"step time here: {seconds['step']:.3f} s ({result['step_label']}, {result['ranks']} "
          f"simulated devices); compile + first step {seconds['compile_and_first_step']:.1f} s")


def print_state_check(one: dict) -> None:
    """The state check's line, and where the states first differed."""
    against = ("the sharded reference's" if "sharded_reference_bit_equal_steps" in one
               else "the single-device megakernel's")
    print(f"every rank's state slice (caches, recurrent states) bit-equal to {against} at "
          f"{one['state_bit_equal_steps']}/{one['steps']} steps")
    for m in one["state_mismatches"]:
        print(f"  step {m['step']}: {m['leaf']} differs in {m['elements']} elements on ranks "
              f"{m['ranks']} (max |diff| {m['max_abs_diff']:.3g}; first at [rank, layer, row, "
              f"...] {m['first']})")


def print_rank_rows(rows: list[dict]) -> None:
    """One line per rank of a recorded step (rank_rows), then what the prediction is."""
    for row in rows:
        print(f"  rank {row['rank']}: HBM {human_bytes(row['hbm_bytes'])} per step (weights "
              f"{human_bytes(row['weight_bytes'])}, routed experts "
              f"{human_bytes(row['routed_expert_bytes'])}); remote copies sent "
              f"{row['remote_copies']} = {human_bytes(row['remote_bytes'])}; predicted on "
              f"{row['chip']}: {row['predicted_step_s'] * 1e6:.1f} us/step")
    if rows:
        print(f"  (per-rank prediction: {rows[0]['label']})")


# ---- bench -----------------------------------------------------------------------------------
def bench_sharded(cfg: ModelConfig, batches: Sequence[int], steps: int, chip: str, n_ranks: int,
                  seed: int = 0) -> dict:
    """`mkresearch bench --ranks N`: per batch size, seconds per step of the sharded megakernel
    here (interpret mode on CPU) and one recorded step's per-rank rows (rank_rows)."""
    import jax
    import numpy as np

    lay = layout.layout(cfg, n_ranks)
    plans = {batch: sharded.make_sharded_plan(  # the reductions as the model chooses for the chip
        lay, batch, cfg.max_seq_len, sharded.kernel_options(lay, batch, chip))
        for batch in batches}  # every batch refused (VMEM, HBM) before any work
    mesh = sharded.make_mesh(n_ranks)
    params = weights.init_params(cfg, seed)
    prepared = sharded.prepare_weights(params, lay, mesh)
    rows = []
    for batch in batches:
        tokens = (np.arange(batch, dtype=np.int32) * 31 + 7) % cfg.vocab_size
        positions = np.full(batch, 3, np.int32)
        holder = {"state": sharded.shard_state(reference.init_state(cfg, batch), lay, mesh)}

        def step(batch=batch, tokens=tokens, positions=positions, holder=holder):
            out, holder["state"], _ = sharded.decode_step(prepared, holder["state"], tokens,
                                                          positions, plans[batch], mesh=mesh)
            return out

        first, step_s = bench.time_steps(step, steps)
        with dma.recording() as log:
            jax.block_until_ready(step())
        rows.append({"batch": batch, "ranks": n_ranks,
                     "megakernel": {"step_s": step_s, "first_call_s": first,
                                    "label": bench.backend_label("megakernel")},
                     "per_rank": rank_rows(log, lay, batch, chip)})
    return {"model": cfg.name, "platform": jax.default_backend(), "chip": chip, "ranks": n_ranks,
            "layout": lay.describe(), "steps_timed": steps, "rows": rows,
            "note": "sharded megakernel on simulated devices (interpret mode on CPU): seconds say "
                    "nothing about a TPU; per-rank TPU times are the timeline model's."}


def print_bench_row(row: dict) -> None:
    mk = row["megakernel"]
    print(f"B={row['batch']}, {row['ranks']} ranks: sharded megakernel {mk['step_s']:.3f} s/step "
          f"({mk['label']})")
    print_rank_rows(row["per_rank"])


def run_decode(args: Any, cfg: ModelConfig, argv: Sequence[str], progress: bool,
               loaded: Any = None) -> int:
    """decode --ranks N > 1 (checked): here with N devices (every process's, in a multi-process
    run), or in a child that has them. `loaded` (--checkpoint: `cli.checkpoint.Loaded`) gives the
    weights, read only here (in the child; per process, its ranks' shards, when there are
    several), the prompt and the text of the tokens. `--backend reference`: `cli.ranks_reference`."""
    status = devices_or_rerun(args.ranks, argv)
    if status is not None:
        return status
    import json

    load = None if loaded is None or distributed.process_count() == 1 else loaded.rank_params
    if args.backend == "reference":
        return ranks_reference.run_decode(
            args, cfg, progress, None if loaded is None else loaded.rank_params,
            None if loaded is None else loaded.prompt, None if loaded is None else loaded.text)
    multihost.refuse_kernel_across_processes(args.ranks)
    with refusals():
        params, prompt = (None, None) if loaded is None else (
            None if load else loaded.params(), loaded.prompt)
        cfg, wire, fields = design_options(cfg, args)
        result = decode_sharded(cfg, args.prompt_len, args.steps, args.batch, args.seed,
                                args.ranks, args.chip, progress,
                                getattr(args, "collectives", layout.PARTIAL_SUM), params, prompt,
                                load, getattr(args, "router", layout.ROUTER_SPLIT),
                                getattr(args, "etp", None), wire, fields)
    if loaded is not None:
        result["text"] = loaded.text(result["generated"][0])
    if multihost.leader_prints():
        if args.json:
            print(json.dumps(result))
        else:
            print_decode(result)
    return 0 if result["passed"] else 1
