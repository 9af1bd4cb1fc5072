"""`mkresearch decode [MODEL]`: prefill a random prompt (from --seed) and decode greedy tokens, on
the megakernel (one pallas_call per step, checked step by step against the reference:
`bench.decode_megakernel`) or on the plain-JAX reference (checked against a teacher-forced
prefill of the same tokens: `decode` below). `--ranks N` shards the megakernel (`cli.ranks`),
`--speculate K` verifies K drafts per step (`cli.speculative`), `--checkpoint DIR` decodes a
published checkpoint's text (`cli.checkpoint`)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any

from mkresearch.cli import bench
from mkresearch.cli import checkpoint as cli_checkpoint
from mkresearch.cli import multihost as cli_multihost
from mkresearch.cli import ranks as cli_ranks
from mkresearch.cli import speculative as cli_speculative
from mkresearch.cli.common import (
    CHIP_DEFAULT_HELP,
    UsageError,
    at_least,
    check_runs_on_cpu,
    known_chip,
    known_model,
    megakernel_batch,
    refusals,
    with_formats,
)
from mkresearch.cli.options import (
    add_batch,
    add_cache_layout,
    add_command,
    add_expert_format,
    add_model,
    each_batch,
)
from mkresearch.hardware.chips import CHIPS
from mkresearch.model import reference, sampling, weights
from mkresearch.model.config import ModelConfig

DEFAULT_MODEL = "kimi-k3-mini"
DEFAULT_PROMPT_LEN = 8  # tokens of the random prompt
# Backends `decode` can run; the first is the default.
BACKENDS = {"megakernel": "one pallas_call per decode step, mkresearch.kernels.compose.megakernel",
            "reference": "plain-JAX oracle, mkresearch.model.reference"}
EXAMPLES = ("mkresearch decode kimi-k3-mini --prompt-len 8 --steps 16 --batch 1,2",
            "mkresearch decode deepseek-v3-mini --backend reference --speculate 3 --drafter mtp",
            'mkresearch decode --checkpoint DIR --prompt "The capital of France is" --steps 8')


def add_parser(commands: Any) -> None:
    """The common options first (`options:` in --help), then one group each for --ranks,
    --speculate, --checkpoint and several processes."""
    p = add_command(commands, "decode", "prefill + greedy decode of a random prompt", EXAMPLES)
    add_model(p, DEFAULT_MODEL, runs=True)
    p.add_argument("--prompt-len", type=int, default=None,
                   help=f"tokens of the random prompt (default {DEFAULT_PROMPT_LEN}; with "
                        "--checkpoint the prompt is --prompt's tokens)")
    p.add_argument("--steps", type=int, default=16,
                   help="tokens to generate per sequence (default %(default)s)")
    add_batch(p)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights, prompt and sampling (default %(default)s)")
    p.add_argument("--backend", default=None,
                   help=f"one of {', '.join(BACKENDS)} (default {next(iter(BACKENDS))}; with "
                        "--speculate the first with a verify call)")
    add_expert_format(p)
    add_cache_layout(p)
    p.add_argument("--chip", default=None,
                   help=f"TPU chip the megakernel is built for (VMEM plan, HBM check, MXFP4 decode path) and of the timeline model's prediction: one of "
                        f"{', '.join(CHIPS)} ({CHIP_DEFAULT_HELP})")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (per batch), no progress bar")
    cli_ranks.add_decode_arguments(p.add_argument_group(
        "several devices (--ranks N > 1: the sharded megakernel and its options)"))
    cli_speculative.add_arguments(p.add_argument_group("speculative decoding"))
    cli_checkpoint.add_arguments(p.add_argument_group("a published checkpoint's text"))
    cli_multihost.add_arguments(p)


def run(args: Any) -> int:
    if cli_multihost.join(args):  # one process of several: first, before JAX's devices are used
        cli_multihost.check_sharded(args.ranks, "decode")
    if args.checkpoint is not None and args.model is not None:
        raise UsageError(f"--checkpoint DIR is the model: drop {args.model}")
    args.chip = known_chip(args.chip)  # every path, the checkpoint's too: before anything runs
    args.model = args.model or (DEFAULT_MODEL if args.checkpoint is None else None)
    for batch in args.batch:  # --prompt needs --checkpoint, which decodes one row: before any run
        cli_checkpoint.check(argparse.Namespace(**{**vars(args), "batch": batch}))
    if args.checkpoint is not None:  # text from a checkpoint on disk
        return each_batch(args, lambda one: cli_checkpoint.run_decode(one, one.argv))
    args.prompt_len = DEFAULT_PROMPT_LEN if args.prompt_len is None else args.prompt_len
    if args.speculate is None and args.backend is None:
        args.backend = next(iter(BACKENDS))
    if args.drafter is not None and args.speculate is None:
        raise UsageError("--drafter is an option of --speculate K: give both")
    if args.backend is not None and args.backend not in BACKENDS:
        raise UsageError(f"--backend {args.backend!r} is unknown: choose one of "
                         f"{', '.join(BACKENDS)}")
    cfg = with_formats(known_model(args.model), args)
    at_least("--prompt-len", args.prompt_len, 1)
    at_least("--steps", args.steps, 1)
    at_least("--seed", args.seed, 0)
    if args.prompt_len + args.steps > cfg.max_seq_len:
        raise UsageError(f"--prompt-len + --steps = {args.prompt_len + args.steps} exceeds "
                         f"max_seq_len={cfg.max_seq_len} of {cfg.name}")
    check_runs_on_cpu(cfg)
    if args.backend == "megakernel" and args.speculate is None:
        for batch in args.batch:  # every batch checked before the first runs
            megakernel_batch("--batch", batch)
    return each_batch(args, lambda one: _run_one(cfg, one))


def _run_one(cfg: ModelConfig, args: Any) -> int:
    """One batch size (args.batch an int) on the chosen backend."""
    if args.speculate is not None:  # speculative decoding: verify K drafts per row and step
        return cli_speculative.run_decode(args, cfg)
    cli_ranks.check_ranks(cfg, args.ranks, args.backend, getattr(args, "etp", None),
                              getattr(args, "collectives", None))
    cli_ranks.design_options(cfg, args)  # refused here, before a child with N devices starts
    progress = not args.json and sys.stderr.isatty()
    if args.ranks > 1:  # the sharded megakernel, or the sharded reference (cli.ranks_reference)
        return cli_ranks.run_decode(args, cfg, args.argv, progress)
    if args.backend == "megakernel":
        with refusals():
            result = bench.decode_megakernel(cfg, args.prompt_len, args.steps, args.batch,
                                             args.seed, args.chip, progress)
        if args.json:
            print(json.dumps(result))
        else:
            bench.print_decode(result)
        return 0 if result["agreement"]["passed"] else 1
    with refusals():
        result = decode(cfg, args.prompt_len, args.steps, args.batch, args.seed, progress)
    if args.json:
        print(json.dumps(result))
    else:
        print_decode(result)
    return 0 if result["parity"]["passed"] else 1


def decode(cfg: ModelConfig, prompt_len: int, steps: int, batch: int, seed: int,
           progress: bool = False) -> dict:
    """Random prompt from `seed`; prefill and greedy decode with `reference.decode_step`; parity.

    Parity: the prompt and the generated tokens are fed teacher-forced through
    `reference.prefill` (one `lax.scan`, a separately compiled program, fresh state); its greedy
    choices must equal the generated tokens, and its logits the step-by-step ones.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    params = weights.init_params(cfg, seed)
    prompt = bench.random_prompt(cfg, batch, prompt_len, seed)  # [B, T]
    step = functools.partial(reference.decode_step, cfg=cfg)  # jitted inside, cfg static
    state = reference.init_state(cfg, batch)
    bar = tqdm(total=prompt_len + steps, desc=f"{cfg.name} decode", unit="step",
               disable=not progress, file=sys.stderr, leave=False)

    # Prefill: step through the prompt. The first step compiles; it is timed on its own.
    started = time.perf_counter()
    for t in range(prompt_len):
        logits, state, _ = step(params, state, prompt[:, t], jnp.full((batch,), t, jnp.int32))
        if t == 0:
            jax.block_until_ready(logits)
            compile_seconds = time.perf_counter() - started
        bar.update()
    jax.block_until_ready(logits)  # [B, V]: the logits after the last prompt token
    prefill_seconds = time.perf_counter() - started - compile_seconds

    generated, step_logits = [], []  # N x [B], N x [B, V]
    started = time.perf_counter()
    for i in range(steps):
        positions = jnp.full((batch,), prompt_len + i, jnp.int32)  # where the new token goes
        token = sampling.sample(logits, seed=seed, positions=positions, temperature=None)  # greedy
        generated.append(token)
        step_logits.append(logits)
        logits, state, _ = step(params, state, token, positions)
        bar.update()
    jax.block_until_ready(logits)
    decode_seconds = time.perf_counter() - started
    bar.close()

    generated_ids = np.stack([np.asarray(t) for t in generated], axis=1)  # [B, N]
    parity = _teacher_forced_parity(cfg, params, np.asarray(prompt), generated_ids,
                                    np.stack([np.asarray(x) for x in step_logits], axis=1))
    return {
        "model": cfg.name, "backend": "reference", "batch": batch, "prompt_len": prompt_len,
        "steps": steps, "seed": seed, "platform": jax.default_backend(),
        "prompt": np.asarray(prompt).tolist(), "generated": generated_ids.tolist(),
        "parity": parity,
        "seconds": {"compile_and_first_step": compile_seconds, "prefill": prefill_seconds,
                    "decode": decode_seconds},
        "tokens_per_s": batch * steps / decode_seconds,
    }


def _teacher_forced_parity(cfg: ModelConfig, params: Any, prompt, generated, step_logits) -> dict:
    """Compare step-by-step greedy decoding with teacher-forced `reference.prefill`."""
    import numpy as np

    batch, prompt_len = prompt.shape
    tokens = np.concatenate([prompt, generated], axis=1)  # [B, T+N]
    logits, _ = reference.prefill(params, reference.init_state(cfg, batch), tokens, cfg)
    forced = np.asarray(logits)[:, prompt_len - 1:-1]  # [B, N, V]: the logits that chose each token
    greedy = forced.argmax(-1)  # [B, N]; lowest index wins ties, like sampling.sample
    equal = int((greedy == generated).sum())
    return {"check": "greedy decode == teacher-forced prefill of the same tokens",
            "tokens_equal": equal, "tokens": int(generated.size),
            "max_abs_logit_diff": float(np.abs(forced - step_logits).max()),
            "passed": equal == generated.size}


def print_decode(result: dict) -> None:
    """The text of a reference decode (`decode`'s result)."""
    bench.print_run(result, result["backend"])
    parity = result["parity"]
    print(f"parity: {parity['check']}: {parity['tokens_equal']}/{parity['tokens']} tokens equal, "
          f"max |logit diff| {parity['max_abs_logit_diff']:.2e} -> "
          f"{'PASS' if parity['passed'] else 'FAIL'}")
    seconds = result["seconds"]
    print(f"timing: compile + first step {seconds['compile_and_first_step']:.2f} s, rest of "
          f"prefill {seconds['prefill']:.2f} s, decode {seconds['decode']:.2f} s = "
          f"{result['tokens_per_s']:.1f} tokens/s (plain JAX on {result['platform']}, "
          f"not a TPU kernel)")
