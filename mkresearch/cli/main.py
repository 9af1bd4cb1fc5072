"""`mkresearch` / `python -m mkresearch`: info, decode, bench, compile, plan, predict, figures.

    mkresearch info kimi-k3 --batch 8 --context 4096 [--format mxfp4] [--layout latent] [--json]
    mkresearch info kimi-k3 --ranks 32                # the per-rank byte table, ours vs release
    mkresearch decode --model kimi-k3-mini --prompt-len 8 --steps 16 --batch 2 --seed 0 \
        [--backend megakernel|reference] [--chip tpu7x] [--ranks 1] [--json]
        [--speculate K [--drafter forced:A|ngram|mtp]]   # speculative decoding (cli_speculative)
    mkresearch bench [--model kimi-k3-mini] [--batches 1 2 4 8] [--steps 3] [--chip tpu7x] \
        [--ranks 1] [--out figures] [--workload FILE|synthetic [--slots B] [--pages N]]
    mkresearch compile kimi-k3-rank [--batch 1] [--chip tpu7x] [--record] \
        [--ranks 8 [--topology v5e:2x4] [--seq-len S]]   # a sharded step (cli_compile_check)
    mkresearch plan kimi-k3 [--batch 1] [--chip tpu7x] [--layout L] [--format F] [--context C] \
        [--json]
    mkresearch plan kimi-k3 --ranks 32 [--batch 1] [--collectives partial-sum|exact] [--wire f32]
    mkresearch predict kimi-k3 --ranks 32 [--chip tpu7x] [--batch 1,2,4,8] [--layout ours|release] \
        [--schedule ours|release] [--algorithm two-level|one-shot|ring] [--json]
    mkresearch figures [--out figures] [--only roofline]

--ranks N > 1 runs the sharded megakernel on N devices (`mkresearch.cli.ranks`): on CPU N
simulated ones, in a child process started with them when this one has fewer.

Bad input (unknown model, backend or figure, a number out of range) prints one line naming the
option and exits with status 2 — never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import mkresearch  # noqa: F401 - selects the platform (CPU unless there is a TPU) before jax loads
from mkresearch.cli import bench, figures, workload
from mkresearch.cli import checkpoint as cli_checkpoint
from mkresearch.cli import compile_check as cli_compile_check
from mkresearch.cli import plan_ranks as cli_plan_ranks
from mkresearch.cli import predict as cli_predict
from mkresearch.cli import ranks as cli_ranks
from mkresearch.cli import speculative as cli_speculative
from mkresearch.hardware.chips import CHIPS
from mkresearch.model import reference, roofline, sampling, weights
from mkresearch.model.config import EXPERT_FORMATS, MLA_CACHE_LAYOUTS, ModelConfig, layer_pattern
from mkresearch.model.roofline import tree_bytes
from mkresearch.model.weights import param_shapes
from mkresearch.prediction import schedule_report
from mkresearch.prediction.full_size import full_size_steps, stand_in_note
from mkresearch.sharding import layout, layout_bytes

# Backends `decode` can run; the first is the default. Planned ones are refused clearly.
BACKENDS = {"megakernel": "one pallas_call per decode step, mkresearch.kernels.compose.megakernel",
            "reference": "plain-JAX oracle, mkresearch.model.reference"}
PLANNED_BACKENDS = ("stages",)
# Commands that live in a module of their own (`add_parser(subparsers)`, `run(args) -> status`).
COMMANDS = {"predict": cli_predict, "compile": cli_compile_check}
MAX_DECODE_WEIGHT_BYTES = 2 * 10**9  # beyond this many weight bytes: not in a laptop's memory


from mkresearch.cli.common import (
    UsageError,
    _at_least,
    _chip,
    _human_bytes,
    _human_count,
    _in_range,
    _megakernel_batch,
    _model,
    _Parser,
    _refusals,
)


# ---- info ------------------------------------------------------------------------------------
def info(cfg: ModelConfig, batch: int, context: int, expert_format: str, layout: str) -> dict:
    total, active = roofline.parameter_counts(cfg)
    step = roofline.step_bytes(cfg, batch, context, expert_format, layout)
    routed = roofline.routed_kind(cfg)  # the FFN kind with routed experts
    floors = {}
    for name in CHIPS:
        floor = roofline.decode_floor(cfg, name, batch, context, expert_format=expert_format,
                                      mla_cache_layout=layout)
        floors[name] = {"ms": floor.seconds * 1e3, "tokens_per_s": floor.tokens_per_s,
                        "memory_bound": floor.memory_bound}
    report = {
        "model": cfg.name,
        "layers": cfg.n_layers,
        "layer_pattern": layer_pattern(cfg),
        "residual": cfg.residual,
        "layers_by_kind": {kind: list(cfg.layers_of(kind)) for kind in cfg.kinds},
        "kda_layers": list(cfg.kda_layers),
        "mla_layers": list(cfg.mla_layers),
        "dense_layers": list(cfg.dense_layers),
        "moe_layers": list(cfg.layers_of(routed.name)) if routed else [],
        "parameters": {"total": total, "active": active,
                       "mtp_modules": roofline.mtp_parameters(cfg), **roofline.as_published(cfg)},
        "step_bytes": step.as_dict(),
        "cache_bytes_per_token": roofline.cache_bytes_per_token(
            cfg.replace(mla_cache_layout=step.mla_cache_layout)),
        "floor_one_chip": floors,
    }
    if cfg.mla_layers:  # Kimi's MLA caches either layout: both, side by side
        per_token = {name: roofline.mla_cache_bytes_per_token(cfg, name)
                     for name in MLA_CACHE_LAYOUTS}
        report["mla_cache_bytes_per_token"] = {
            **per_token, "ratio": per_token["expanded"] / per_token["latent"]}
    return report


def _print_info(report: dict) -> None:
    step = report["step_bytes"]
    kinds = report["layers_by_kind"]
    if report["residual"] == "attention_mix":
        print(f"{report['model']}: {report['layers']} layers, pattern (K = KDA, M = MLA; "
              f"attention-residual blocks):")
    else:
        print(f"{report['model']}: {report['layers']} layers, {report['residual']} residual "
              f"stream, pattern (G = GQA, R = MLA with RoPE):")
    print(f"  {report['layer_pattern']}")
    if stand_in_note(report["model"]):
        print(f"  {stand_in_note(report['model'])}")
    print("  " + "; ".join(f"{kind} {len(layers)} layers" + (
        f" ({', '.join(map(str, layers))})" if len(layers) < min(8, report["layers"]) else "")
        for kind, layers in kinds.items()))
    params = report["parameters"]
    mtp = (f" (+ {_human_count(params['mtp_modules'])} in multi-token-prediction modules, not "
           "part of the step)" if params["mtp_modules"] else "")
    print(f"parameters: total {_human_count(params['total'])}, "
          f"active per token {_human_count(params['active'])}{mtp}")
    if "publisher_rule" in params:  # the publisher's figures, counted its way
        rule, n = params["publisher_rule"], _human_count
        print(f"  as published (embedding {'in' if rule['embedding_active'] else 'out'}, LM head "
              f"{'in' if rule['lm_head_active'] else 'out'} of active): total {n(rule['total'])}, "
              f"active {n(rule['active'])} (published {n(rule['published'][0])} / "
              f"{n(rule['published'][1])})")
    print(f"bytes per decode step: batch {step['batch']}, context {step['context']}, experts "
          f"{step['expert_format']}" + (f", MLA cache {step['mla_cache_layout']}"
                                        if "mla_cache_bytes_per_token" in report else "")
          + f" ({step['unique_experts_per_layer']:.1f} unique experts per MoE layer):")
    for name, label in step["components"].items():
        read, written = step["read"][name], step["written"].get(name, 0)
        extra = f"  (+ {_human_bytes(written)} written)" if written else ""
        print(f"  {label:42s} {_human_bytes(read):>10}{extra}")
    print(f"  {'total read + written':42s} {_human_bytes(step['total']):>10}")
    print(f"KV cache per context token (all layers): {report['cache_bytes_per_token']:,} B")
    if "mla_cache_bytes_per_token" in report:
        cache = report["mla_cache_bytes_per_token"]
        print(f"MLA cache per context token: expanded {cache['expanded']:,} B, latent "
              f"{cache['latent']:,} B ({cache['ratio']:.0f}x fewer)")
    print("HBM floor on one chip (bytes / bandwidth):")
    for chip, floor in report["floor_one_chip"].items():
        print(f"  {chip:6s} {floor['ms']:10.2f} ms/step  {floor['tokens_per_s']:10.1f} tokens/s")


# ---- decode ----------------------------------------------------------------------------------
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
    prompt = jax.random.randint(jax.random.PRNGKey(seed), (batch, prompt_len), 0, cfg.vocab_size,
                                dtype=jnp.int32)  # [B, T]
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


def _print_decode(result: dict) -> None:
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


# ---- main ------------------------------------------------------------------------------------
def _parser() -> _Parser:
    parser = _Parser(prog="mkresearch", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{info,decode,bench,compile,plan,predict,figures}")

    p = commands.add_parser("info", help="layer pattern, parameters, bytes per decode step")
    p.add_argument("model", help=f"one of {', '.join(layout.config_names())}")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--context", type=int, default=0,
                   help="tokens already in each sequence's KV cache (default 0)")
    p.add_argument("--format", dest="expert_format", default=None,
                   choices=EXPERT_FORMATS + ("released",),
                   help="routed-expert format (default: the model's; released = FP8 gate/up + "
                        "MXFP4 down)")
    p.add_argument("--layout", default=None, choices=MLA_CACHE_LAYOUTS,
                   help="MLA cache layout (default: the model's)")
    p.add_argument("--ranks", type=int, default=1,
                   help="ranks (devices) the model is sharded across: the per-rank byte table, "
                        "ours beside the release's layout (default 1: the whole model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = commands.add_parser("decode", help="prefill + greedy decode of a random prompt")
    p.add_argument("--model", default="kimi-k3-mini", help=f"one of {', '.join(layout.config_names())}")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--steps", type=int, default=16, help="tokens to generate per sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None,
                   help=f"one of {', '.join(BACKENDS)} (default megakernel; with --speculate "
                        f"the first with a verify call; planned: {', '.join(PLANNED_BACKENDS)})")
    p.add_argument("--chip", default="tpu7x",
                   help="TPU chip the megakernel is built for (VMEM plan, HBM check, MXFP4 "
                        "decode path) and of the timeline model's prediction")
    cli_ranks.add_decode_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object, no progress bar")
    cli_speculative.add_arguments(p)
    cli_checkpoint.add_arguments(p)

    p = commands.add_parser("bench", help="decode steps per batch size on both backends, with "
                                          "the timeline model's TPU prediction")
    p.add_argument("--model", default="kimi-k3-mini", help=f"one of {', '.join(layout.config_names())}")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8], metavar="B")
    p.add_argument("--steps", type=int, default=3, help="timed steps per batch size")
    p.add_argument("--chip", default="tpu7x",
                   help="TPU chip the megakernel is built for and of the predictions")
    p.add_argument("--ranks", type=int, default=1,
                   help="also the sharded megakernel on this many devices, per-rank rows "
                        "(default 1: none)")
    p.add_argument("--out", default="figures",
                   help="directory of decode_bench.json and decode_bench.png (default figures)")
    cli_speculative.add_bench_arguments(p)
    workload.add_bench_arguments(p)

    p = commands.add_parser("plan", help="the schedule of one megakernel step from shapes: DMAs "
                                         "and bytes per stage and layer kind, the ring, the VMEM "
                                         "plan, HBM bytes against the roofline")
    p.add_argument("model", help=f"one of {', '.join(layout.config_names())}")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chip", default="tpu7x", help="TPU chip the step is built for (VMEM plan)")
    p.add_argument("--layout", default=None, choices=MLA_CACHE_LAYOUTS,
                   help="MLA cache layout (default: the model's)")
    p.add_argument("--format", dest="expert_format", default=None, choices=EXPERT_FORMATS,
                   help="routed-expert format (default: the model's)")
    p.add_argument("--context", type=int, default=None,
                   help="every row's position (default: the last one, the worst case)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    cli_plan_ranks.add_arguments(p)

    for command in COMMANDS.values():  # the commands with a module of their own
        command.add_parser(commands)

    p = commands.add_parser("figures", help="write every registered figure as PNG")
    p.add_argument("--out", default="figures", help="output directory (default figures)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="just these figures")
    return parser


def _run(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)  # a --ranks child runs the same argv
    args = _parser().parse_args(argv)
    if args.command in COMMANDS:
        return COMMANDS[args.command].run(args)
    if args.command == "info":
        cfg = _model(args.model)
        _at_least("--batch", args.batch, 1)
        _in_range("--context", args.context, 0, cfg.max_seq_len - 1,
                  f"the KV cache of {cfg.name} holds max_seq_len={cfg.max_seq_len} tokens, the "
                  "new one included")
        with _refusals():  # e.g. --layout expanded for a model whose MLA caches the latent
            report = info(cfg, args.batch, args.context, args.expert_format, args.layout)
        if args.ranks != 1:
            with _refusals():
                layout.check_ranks(cfg, args.ranks)
                mla = cfg.replace(mla_cache_layout=args.layout) if args.layout else cfg
                report["ranks"] = layout_bytes.compare(mla, args.ranks, args.batch, args.context)
                report["full_size"] = [step.as_dict() for step in full_size_steps(
                    mla, args.ranks, args.batch, args.context)]
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            _print_info(report)
            if "ranks" in report:
                print(layout_bytes.format_table(report["ranks"]))
            for step in report.get("full_size", ()):
                print(step["line"])
        return 0

    if args.command == "decode":
        cli_checkpoint.check(args)
        if args.checkpoint is not None:  # text from a checkpoint on disk
            return cli_checkpoint.run_decode(args, argv)
        if args.speculate is None and args.backend is None:
            args.backend = next(iter(BACKENDS))
        if args.drafter is not None and args.speculate is None:
            raise UsageError("--drafter is an option of --speculate K: give both")
        if args.backend is not None and args.backend not in BACKENDS:
            planned = " is not available yet" if args.backend in PLANNED_BACKENDS else ""
            raise UsageError(f"--backend {args.backend!r}{planned or ' is unknown'}: choose one "
                             f"of {', '.join(BACKENDS)}")
        cfg = _model(args.model)
        _chip(args.chip)  # checked for every backend, before anything runs
        _at_least("--prompt-len", args.prompt_len, 1)
        _at_least("--steps", args.steps, 1)
        _at_least("--batch", args.batch, 1)
        _at_least("--seed", args.seed, 0)
        if args.prompt_len + args.steps > cfg.max_seq_len:
            raise UsageError(f"--prompt-len + --steps = {args.prompt_len + args.steps} exceeds "
                             f"max_seq_len={cfg.max_seq_len} of {cfg.name}")
        weight_bytes = tree_bytes(param_shapes(cfg))
        if weight_bytes > MAX_DECODE_WEIGHT_BYTES:
            raise UsageError(f"--model {cfg.name} has {_human_bytes(weight_bytes)} of weights, too "
                             f"many to decode here: use kimi-k3-mini (or `mkresearch info`)")
        if args.speculate is not None:  # speculative decoding: verify K drafts per row and step
            return cli_speculative.run_decode(args, cfg)
        cli_ranks.check_ranks(cfg, args.ranks, args.backend)
        progress = not args.json and sys.stderr.isatty()
        if args.backend == "megakernel":
            _megakernel_batch("--batch", args.batch)
            if args.ranks > 1:
                return cli_ranks.run_decode(args, cfg, argv, progress)
            with _refusals():
                result = bench.decode_megakernel(cfg, args.prompt_len, args.steps, args.batch,
                                                 args.seed, args.chip, progress)
            if args.json:
                print(json.dumps(result))
            else:
                bench.print_decode(result)
            return 0 if result["agreement"]["passed"] else 1
        with _refusals():
            result = decode(cfg, args.prompt_len, args.steps, args.batch, args.seed, progress)
        if args.json:
            print(json.dumps(result))
        else:
            _print_decode(result)
        return 0 if result["parity"]["passed"] else 1

    if args.command == "bench" and args.workload is not None:  # a trace served: cli.workload
        return workload.run(args)
    if args.command == "bench":
        from pathlib import Path

        cfg = _model(args.model)
        _at_least("--steps", args.steps, 1)
        for batch in args.batches:
            _megakernel_batch("--batches", batch)
        _chip(args.chip)
        cli_speculative.check_bench(args)
        cli_ranks.check_ranks(cfg, args.ranks)
        figures.require_matplotlib("mkresearch bench")  # it draws decode_bench.png
        if args.ranks > 1 and (status := cli_ranks.devices_or_rerun(args.ranks, argv)) is not None:
            return status
        out = Path(args.out)
        with _refusals():
            result = bench.run_bench(cfg, tuple(args.batches), args.steps, args.chip,
                                     out_json=out / "decode_bench.json",
                                     figure=out / "decode_bench.png")
            cli_speculative.add_bench_rows(result, cfg, args, out / "decode_bench.json")
            if args.ranks > 1:  # the sharded rows, beside the single device's in the JSON
                result["sharded"] = cli_ranks.bench_sharded(cfg, tuple(args.batches), args.steps,
                                                            args.chip, args.ranks)
                (out / "decode_bench.json").write_text(json.dumps(result, indent=1))
        for row in result["rows"]:
            bench.print_bench_row(row)
        for row in result.get("sharded", {}).get("rows", ()):
            cli_ranks.print_bench_row(row)
        cli_speculative.print_bench_rows(result)
        print(f"wrote {out / 'decode_bench.json'} and {out / 'decode_bench.png'}")
        return 0

    if args.command == "plan":
        if args.ranks is not None:  # every collective of a sharded step
            return cli_plan_ranks.run(args)
        cfg = _model(args.model)
        _megakernel_batch("--batch", args.batch)
        chip = _chip(args.chip)
        if args.context is not None:
            _in_range("--context", args.context, 0, cfg.max_seq_len - 1,
                      f"a position in the MLA cache of {cfg.name}, max_seq_len={cfg.max_seq_len}")
        with _refusals():
            cfg = cfg.replace(mla_cache_layout=args.layout or cfg.mla_cache_layout,
                              expert_format=args.expert_format or cfg.expert_format)
            sched = schedule_report.plan_schedule(cfg, args.batch, chip, args.context)
            report = schedule_report.report(sched)
        print(json.dumps(report) if args.json else schedule_report.format_report(sched, report))
        return 0

    if args.command == "figures":
        figures.require_matplotlib("mkresearch figures")
        for name in args.only or ():
            if name not in figures.FIGURES:
                raise UsageError(f"--only {name!r} is unknown: choose from "
                                 f"{', '.join(figures.FIGURES)}")
        for path in figures.write_figures(args.out, args.only):
            print(f"wrote {path}")
        return 0
    raise AssertionError(args.command)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except UsageError as error:
        message = str(error)
        print(message if message.startswith("mkresearch") else f"mkresearch: {message}",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # `mkresearch info ... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
