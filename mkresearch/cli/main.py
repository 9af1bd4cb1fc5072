"""`mkresearch` / `python -m mkresearch`: info, decode, bench, compile, plan, predict, figures, launch.

    mkresearch COMMAND [MODEL] [--batch B[,B...]] [--context C] [options]   (`mkresearch.cli.options`)

The model is positional, first after the command, in every command: it is what each one is about,
and `mkresearch info kimi-k3` reads as a sentence (`decode` and `bench` default to kimi-k3-mini).

    mkresearch info kimi-k3 --batch 8 --context 4096 [--format mxfp4] [--cache-layout latent]
    mkresearch info kimi-k3 --ranks 32                # the per-rank byte table, ours vs release
    mkresearch decode kimi-k3-mini --prompt-len 8 --steps 16 --batch 2 --seed 0 \\
        [--backend megakernel|reference] [--chip tpu7x] [--ranks 1] [--json]
        [--collectives partial-sum|exact|restructured] [--router split|host|sibling|replicated]
        [--etp N] [--wire f32|bf16] [--expert-slots S] [--expert-reads-first] [--expert-mxu fp8]
        [--speculate K [--drafter forced:A|ngram|mtp]]   # speculative decoding (cli.speculative)
    mkresearch bench kimi-k3-mini [--batch 1,2,4,8] [--steps 3] [--chip tpu7x] [--ranks 1] \\
        [--out figures] [--workload FILE|synthetic [--slots B] [--pages N]]
    mkresearch compile kimi-k3-rank [--batch 1] [--chip tpu7x] [--record] \\
        [--ranks 8 [--topology v5e:2x4] [--context C]]   # a sharded step (cli.compile_check)
    mkresearch plan kimi-k3 [--batch 1] [--chip tpu7x] [--cache-layout L] [--format F] \\
        [--context C] [--json]
    mkresearch plan kimi-k3 --ranks 32 [--batch 1] [--wire f32] \\
        [--collectives partial-sum|exact|restructured]
    mkresearch predict kimi-k3 --ranks 32 [--chip tpu7x] [--batch 1,2,4,8] \\
        [--rank-layout ours|release] [--schedule ours|release] \\
        [--collectives partial-sum|exact|restructured] [--algorithm two-level|one-shot|ring] [--json]
    mkresearch figures [--out figures] [--only roofline]
    mkresearch launch --processes 2 -- decode kimi-k3-mini --ranks 8 --backend reference
        # several processes on this machine, as on a multi-host slice (docs/multihost.md)

--ranks N > 1 runs the sharded megakernel on N devices (`mkresearch.cli.ranks`): on CPU N
simulated ones, in a child process started with them when this one has fewer.

Bad input (unknown model, backend or figure, a number out of range) prints one line naming the
option and exits with status 2 — never a traceback. An old spelling of an option prints one line
naming the new one, and runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import mkresearch  # noqa: F401 - selects the platform (CPU unless there is a TPU) before jax loads
from mkresearch.cli import bench_command, decode, figures, info, launch, plan, predict
from mkresearch.cli import compile_check as compile_command
from mkresearch.cli import ranks as cli_ranks
from mkresearch.cli.common import Parser, UsageError
from mkresearch.cli.options import notices, resolve_model

# Every command: its name -> its module, which adds the command's parser (`add_parser(commands)`)
# and runs it (`run(args) -> exit status`), in the order `mkresearch --help` lists them.
COMMANDS = {"info": info, "decode": decode, "bench": bench_command, "compile": compile_command,
            "plan": plan, "predict": predict, "figures": figures, "launch": launch}
DESCRIPTION = f"`mkresearch` / `python -m mkresearch`: {', '.join(COMMANDS)}."
EXAMPLES = ("mkresearch info kimi-k3 --batch 1,8 --context 4096",
            "mkresearch decode kimi-k3-mini --steps 16",
            "mkresearch predict kimi-k3 --ranks 32 --batch 1,2,4,8")


def _parser() -> Parser:
    parser = Parser(prog="mkresearch", description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="examples (`mkresearch COMMAND --help` for each command's):\n"
                            + "\n".join(f"  {line}" for line in EXAMPLES))
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{" + ",".join(COMMANDS) + "}")
    for command in COMMANDS.values():
        command.add_parser(commands)
    return parser


def _run(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)  # a --ranks child runs the same argv
    args = _parser().parse_args(argv)
    args.argv = argv
    if os.environ.get(cli_ranks.CHILD_ENV) != "1":  # a --ranks child: its parent said it
        for line in notices(args):
            print(f"mkresearch: {line}", file=sys.stderr)
    if hasattr(args, "model"):
        resolve_model(args)
    return COMMANDS[args.command].run(args)


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
