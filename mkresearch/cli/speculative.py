"""`mkresearch decode --speculate K [--drafter forced:A|ngram|mtp]`: speculative decoding.

A random prompt (from --seed, as `decode`) is prefilled, then --steps tokens per row are emitted
by verify steps of K drafts each (`mkresearch.decoding.speculative.speculative_generate`), greedy. It
reports the tokens per step, the drafts accepted per step (and that over K), the verify step's time
here (`bench.StepClock`: the first call compiles) and the tokens per second that makes here, and
checks losslessness: the tokens against plain greedy decoding of the same prompt
(`reference.generate`), which also gives the forced drafter its oracle.

Drafters: forced:A (the release's benchmark mode: exactly A drafts accepted per step; the
default is forced:K), ngram (prompt lookup), mtp (DeepSeek-V3's MTP module, models with one).
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

from mkresearch.cli import bench
from mkresearch.cli.common import UsageError, refusals
from mkresearch.decoding import drafters, speculative
from mkresearch.kernels.compose import megakernel, megakernel_verify
from mkresearch.model import mtp, reference, weights
from mkresearch.model.config import ModelConfig

# The backends with a verify call for `speculative_generate` (the contract of
# `speculative.verify_step`): the megakernel's (one pallas_call per verify step, the default)
# and the reference's.
BACKENDS = ("megakernel", "reference")


def verify_call(name: str) -> Any:
    """The verify of backend `name` (the kernels are imported only when asked for)."""
    if name == "megakernel":
        return megakernel_verify.as_verify()
    return speculative.verify_step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """decode's speculative options."""
    parser.add_argument("--speculate", type=int, default=None, metavar="K",
                        help=f"speculative decoding: verify K drafts per row and step, K in "
                             f"[1, {speculative.MAX_DRAFTS}] (default off)")
    parser.add_argument("--drafter", default=None,
                        help=f"with --speculate: one of {', '.join(drafters.DRAFTERS)} "
                             "(default forced:K, the release's benchmark mode)")


def backend(requested: str | None) -> str:
    """The backend a speculative decode runs on: the one asked for if it has a verify call, by
    default the first that has one."""
    if requested is None:
        return BACKENDS[0]
    if requested not in BACKENDS:
        raise UsageError(f"--backend {requested!r} has no verify call for --speculate yet: "
                         f"choose one of {', '.join(BACKENDS)}")
    return requested


def check(args: argparse.Namespace, cfg: ModelConfig) -> tuple[int, str]:
    """(K, drafter name) after the command-line checks (one line, exit status 2)."""
    check_bench(args)
    k = args.speculate
    if args.batch * (k + 1) > speculative.MAX_ROWS:
        raise UsageError(f"--batch {args.batch} x (--speculate {k} + 1) = "
                         f"{args.batch * (k + 1)} rows is invalid: at most "
                         f"{speculative.MAX_ROWS} per verify call")
    if args.prompt_len + args.steps - 1 + k > cfg.max_seq_len:
        raise UsageError(f"--prompt-len + --steps - 1 + --speculate = "
                         f"{args.prompt_len + args.steps - 1 + k} exceeds max_seq_len="
                         f"{cfg.max_seq_len} of {cfg.name}")
    name = args.drafter or f"forced:{k}"
    with refusals():
        drafter = drafters.get_drafter(name)
        if isinstance(drafter, drafters.ForcedDrafter) and drafter.accept > k:
            raise ValueError(f"--drafter {name} is invalid with --speculate {k}: forced:A with A "
                             f"in [0, {k}]")
        if isinstance(drafter, drafters.MtpDrafter):
            mtp.check(cfg)
    return k, name


def decode(cfg: ModelConfig, prompt_len: int, steps: int, batch: int, seed: int, k: int,
           drafter: str, backend_name: str = "reference", params: dict | None = None,
           prompt: Any = None) -> dict:
    """Greedy speculative decoding of a random prompt; the plain greedy decode beside it.
    `params` and `prompt` [B, T] (a checkpoint's: `mkresearch.cli.checkpoint`) replace the
    random ones."""
    import jax
    import numpy as np

    params = weights.init_params(cfg, seed) if params is None else params
    prompt = (bench.random_prompt(cfg, batch, prompt_len, seed) if prompt is None
              else np.asarray(prompt))  # [B, T]
    plain, _ = reference.generate(params, reference.init_state(cfg, batch), prompt, steps + k,
                                  cfg)  # k further: the forced drafter's oracle
    plain = np.asarray(plain)
    oracle = np.concatenate([prompt, plain], axis=1)
    clock = bench.StepClock()
    call = verify_call(backend_name)
    verify = functools.partial(clock.run, call)
    verify.samples_in_call = getattr(call, "samples_in_call", False)
    tokens, _, stats = speculative.speculative_generate(
        params, reference.init_state(cfg, batch), prompt, steps, cfg, k=k,
        drafter=drafters.get_drafter(drafter, oracle=oracle, seed=seed), verify=verify)
    tokens = np.asarray(tokens)
    equal = int((tokens == plain[:, :steps]).sum())
    step_s = clock.step_s
    return {
        "model": cfg.name, "backend": backend_name, "batch": batch, "prompt_len": prompt_len,
        "steps": steps, "seed": seed, "platform": jax.default_backend(),
        "speculate": k, "drafter": drafter,
        "prompt": prompt.tolist(), "generated": tokens.tolist(),
        "verify_steps": stats["steps"], "tokens_per_step": stats["tokens_per_step"],
        "mean_accepted": stats["mean_accepted"], "acceptance_rate": stats["acceptance_rate"],
        "lossless": {"check": "speculative greedy == plain greedy decoding (reference.generate)",
                     "tokens_equal": equal, "tokens": int(tokens.size),
                     "passed": equal == tokens.size},
        "seconds": {"compile_and_first_step": clock.compile_seconds, "verify_step": step_s},
        "step_label": bench.backend_label(backend_name),
        "tokens_per_s": batch * stats["tokens_per_step"] / step_s if step_s else None,
    }


def print_decode(result: dict) -> None:
    bench.print_run(result, f"{result['backend']}, speculative (K={result['speculate']}, "
                            f"drafter {result['drafter']})")
    lossless, seconds, k = result["lossless"], result["seconds"], result["speculate"]
    verdict = "PASS" if lossless["passed"] else "FAIL"
    if "text" in result:  # --checkpoint: the prompt and what followed it
        print(f"text: {result['text']!r}")
    print("\n".join([
        (f"speculative: {result['verify_steps']} verify steps, {result['tokens_per_step']:.2f} "
         f"tokens per step, {result['mean_accepted']:.2f} of K={k} drafts accepted per step "
         f"({result['acceptance_rate']:.0%})"),
        (f"lossless: {lossless['check']}: {lossless['tokens_equal']}/{lossless['tokens']} tokens "
         f"equal -> {verdict}"),
        (f"verify step time here: {seconds['verify_step']:.3f} s ({result['step_label']}; K + 1 = "
         f"{k + 1} tokens per row), {result['tokens_per_s']:.1f} tokens/s; first verify step "
         f"{seconds['compile_and_first_step']:.1f} s")]))


def run_decode(args: argparse.Namespace, cfg: ModelConfig, loaded: Any = None) -> int:
    """`decode --speculate K`: checks, run, print (JSON with --json); 0 when lossless. `loaded`
    (--checkpoint: `cli.checkpoint.Loaded`) gives the weights, the prompt and the text."""
    name = backend(args.backend)
    if args.drafter == "mtp":  # it reads the target's hidden states, which only the reference's
        if args.backend == "megakernel":  # verify returns (per_position["hidden"])
            raise UsageError("--drafter mtp runs with --backend reference: the megakernel's "
                             "verify does not return the final hidden states the MTP module reads")
        name = "reference"
    if args.ranks != 1:
        raise UsageError("--speculate runs on one device: --ranks 1")
    k, drafter = check(args, cfg)
    with refusals():
        params, prompt = (None, None) if loaded is None else (loaded.params(), loaded.prompt)
        result: Any = decode(cfg, args.prompt_len, args.steps, args.batch, args.seed, k, drafter,
                             name, params, prompt)
    if loaded is not None:
        result["text"] = loaded.text(result["generated"][0])
    if args.json:
        print(json.dumps(result))
    else:
        print_decode(result)
    return 0 if result["lossless"]["passed"] else 1


# ---- bench --speculate K ------------------------------------------------------------------------
def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculate", type=int, default=None, metavar="K",
                        help="also speculative rows: the verify step of K drafts per row on both "
                             "backends (default off)")


def check_bench(args: argparse.Namespace) -> None:
    k = args.speculate
    if k is not None and not 1 <= k <= speculative.MAX_DRAFTS:
        raise UsageError(f"--speculate {k} is invalid: an int in [1, {speculative.MAX_DRAFTS}] "
                         "(drafts verified per row and step)")


def add_bench_rows(result: dict, cfg: ModelConfig, args: argparse.Namespace, path: Any) -> None:
    """With --speculate: result["speculative"] = `bench_rows`, written to the bench's JSON too."""
    if args.speculate is not None:
        result["speculative"] = bench_rows(cfg, tuple(args.batch), args.speculate, args.steps)
        path.write_text(json.dumps(result, indent=1))


def print_bench_rows(result: dict) -> None:
    for row in result.get("speculative", ()):
        print_bench_row(row)


def _plain_step(name: str) -> Any:
    """The plain decode step of backend `name` on a copy of the state (the megakernel donates)."""
    if name == "reference":
        return reference.decode_step
    import jax
    import jax.numpy as jnp

    def step(params, state, tokens, positions, cfg):
        return megakernel.decode_step(params, jax.tree.map(jnp.copy, state), tokens, positions,
                                      cfg)
    return step


def bench_rows(cfg: ModelConfig, batches: tuple[int, ...], k: int, steps: int,
               seed: int = 0) -> list[dict]:
    """Per backend and batch size with B x (K + 1) <= 64: the verify step of K + 1 tokens per row
    beside the plain decode step (median of `steps` after a first call), and the tokens per
    second each makes here at forced acceptance K (K + 1 tokens per verify step)."""
    import numpy as np

    params = weights.init_params(cfg, seed)
    rows = []
    for name in BACKENDS:
        verify, plain = verify_call(name), _plain_step(name)
        for batch in batches:
            if batch * (k + 1) > speculative.MAX_ROWS:
                continue
            state = reference.init_state(cfg, batch)
            tokens = (np.arange(batch * (k + 1), dtype=np.int32).reshape(batch, k + 1) * 31 + 7
                      ) % cfg.vocab_size
            positions = np.full(batch, 3, np.int32)
            verify_clock, plain_clock = bench.StepClock(), bench.StepClock()
            for _ in range(steps + 1):
                plain_clock.run(plain, params, state, tokens[:, 0], positions, cfg)
                verify_clock.run(verify, params, state, tokens, positions, cfg)
            rows.append({"batch": batch, "k": k, "backend": name,
                         "verify_step_s": verify_clock.step_s, "plain_step_s": plain_clock.step_s,
                         "tokens_per_s": batch * (k + 1) / verify_clock.step_s,
                         "plain_tokens_per_s": batch / plain_clock.step_s,
                         "label": bench.backend_label(name)})
    return rows


def print_bench_row(row: dict) -> None:
    print(f"B={row['batch']}, speculative K={row['k']} ({row['backend']}, {row['label']}): verify "
          f"step {row['verify_step_s']:.4f} s for K + 1 = {row['k'] + 1} tokens per row, plain "
          f"step {row['plain_step_s']:.4f} s; at forced acceptance K {row['tokens_per_s']:.1f} "
          f"tokens/s vs {row['plain_tokens_per_s']:.1f} plain"
          + (" (the reference verifies token by token: no speed-up is expected from it)"
             if row["backend"] == "reference" else ""))
