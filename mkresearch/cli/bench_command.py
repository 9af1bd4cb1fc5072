"""`mkresearch bench [MODEL]`: decode steps at each batch size on both backends, timed here, with
the timeline model's TPU prediction (`cli.bench.run_bench`), written to decode_bench.json and
decode_bench.png; `--speculate K` adds verify-step rows (`cli.speculative`), `--ranks N` the
sharded megakernel's per-rank rows (`cli.ranks`), `--workload` serves an arrival trace instead
(`cli.workload`). The command's options, checks and printing; the bench itself is `cli.bench`."""

from __future__ import annotations

import json
from typing import Any

from mkresearch.cli import bench, figures, workload
from mkresearch.cli import multihost as cli_multihost
from mkresearch.cli import ranks as cli_ranks
from mkresearch.cli import speculative as cli_speculative
from mkresearch.cli.common import (
    CHIP_DEFAULT_HELP,
    at_least,
    check_runs_on_cpu,
    known_chip,
    known_model,
    megakernel_batch,
    output_directory,
    refusals,
)
from mkresearch.cli.options import add_batch, add_command, add_model
from mkresearch.hardware.chips import CHIPS

DEFAULT_MODEL = "kimi-k3-mini"
EXAMPLES = ("mkresearch bench kimi-k3-mini --batch 1,2,4,8 --steps 3",
            "mkresearch bench deepseek-v3-mini --batch 2 --speculate 3 --out build/bench",
            "mkresearch bench kimi-k3-mini --workload synthetic --slots 4 --pages 24")


def add_parser(commands: Any) -> None:
    p = add_command(commands, "bench", "decode steps per batch size on both backends, with the "
                                       "timeline model's TPU prediction", EXAMPLES)
    add_model(p, DEFAULT_MODEL, runs=True)
    add_batch(p, bench.BENCH_BATCHES, old=True)
    p.add_argument("--steps", type=int, default=3,
                   help="timed steps per batch size (default %(default)s)")
    p.add_argument("--chip", default=None,
                   help=f"TPU chip the megakernel is built for and of the predictions: one of "
                        f"{', '.join(CHIPS)} ({CHIP_DEFAULT_HELP})")
    p.add_argument("--ranks", type=int, default=1,
                   help="also the sharded megakernel on this many devices, per-rank rows "
                        "(default 1: none)")
    p.add_argument("--out", default="figures",
                   help="directory of decode_bench.json and decode_bench.png (default figures)")
    cli_speculative.add_bench_arguments(p)
    workload.add_bench_arguments(p)
    cli_multihost.add_arguments(p)


def run(args: Any) -> int:
    if cli_multihost.join(args):  # one process of several: first, before JAX's devices are used
        cli_multihost.check_sharded(args.ranks, "bench")
        cli_multihost.refuse_kernel_across_processes(args.ranks, "bench")
    args.model = args.model or DEFAULT_MODEL
    if args.workload is not None:  # a trace served: cli.workload
        return workload.run(args)
    workload.check_without_workload(args)
    cfg = known_model(args.model)
    check_runs_on_cpu(cfg)
    at_least("--steps", args.steps, 1)
    for batch in args.batch:
        megakernel_batch("--batch", batch)
    args.chip = known_chip(args.chip)
    figures.require_matplotlib("mkresearch bench")  # it draws decode_bench.png
    cli_speculative.check_bench(args)
    cli_ranks.check_ranks(cfg, args.ranks)
    out = output_directory("--out", args.out)
    if args.ranks > 1 and (status := cli_ranks.devices_or_rerun(args.ranks, args.argv)) is not None:
        return status
    leader = cli_multihost.leader_prints()  # process 0 writes and prints; the others run along
    with refusals():
        result = bench.run_bench(cfg, args.batch, args.steps, args.chip,
                                 out_json=out / "decode_bench.json" if leader else None,
                                 figure=out / "decode_bench.png" if leader else None)
        if leader:
            cli_speculative.add_bench_rows(result, cfg, args, out / "decode_bench.json")
        if args.ranks > 1:  # the sharded rows, beside the single device's in the JSON
            result["sharded"] = cli_ranks.bench_sharded(cfg, args.batch, args.steps, args.chip,
                                                        args.ranks)
            if leader:
                (out / "decode_bench.json").write_text(json.dumps(result, indent=1))
    if not leader:
        return 0
    for row in result["rows"]:
        bench.print_bench_row(row)
    for row in result.get("sharded", {}).get("rows", ()):
        cli_ranks.print_bench_row(row)
    cli_speculative.print_bench_rows(result)
    print(f"wrote {out / 'decode_bench.json'} and {out / 'decode_bench.png'}")
    return 0
