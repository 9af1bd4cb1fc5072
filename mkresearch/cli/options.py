"""The options every `mkresearch` command spells the same way, and their old spellings.

    mkresearch COMMAND [MODEL] [--batch B[,B...]] [--context C] [--cache-layout L] [--rank-layout L]

* MODEL is positional, the first word after the command (`add_model`); `decode` and `bench`
  default to kimi-k3-mini.
* `--batch` takes one value or a comma list in every command (`add_batch`): a command that runs
  one batch at a time runs once per value, in order (`each_batch`); with `--json` it prints one
  JSON object per line.
* `--context` is the one name of a sequence length (`add_context`): the tokens of context a step
  works on (in `compile`, the length of the cache it is compiled for).
* `--cache-layout` is the MLA cache layout (expanded | latent), `--rank-layout` whose layout
  spreads the model over ranks (ours | release).
* Every command's `--help` ends with examples (`add_command`).

The spellings these replace (`--model M`, `--batches B B`, `--layout`, `--seq-len`) still work for
one release: each prints one line on stderr naming its new spelling (`notices`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from mkresearch.cli.common import UsageError, cpu_models
from mkresearch.model.config import EXPERT_FORMATS, MLA_CACHE_LAYOUTS, config_names
from mkresearch.sharding import layout

NOTICES = "old_spellings"  # the namespace attribute listing the old spellings a command line used
MODEL_OPTION = "model_option"  # where the old `--model M` is stored until `resolve_model`


def add_command(commands: Any, name: str, help: str, examples: Sequence[str]) -> Any:
    """A command's parser: its help line, and its `--help` ending with `examples` (command lines
    a user can paste, each parsed by tests/test_cli_convention.py)."""
    return commands.add_parser(name, help=help, description=help,
                               formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog="examples:\n" + "\n".join(f"  {line}" for line in examples))


class _OldSpelling(argparse.Action):
    """An old option: stores its value where the new one does and notes the new spelling."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: Callable[[Any, Any], str],
                 convert: Callable[[str, Any], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new, self.convert = new, convert

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        value = self.convert(option_string or "", values) if self.convert else values
        setattr(namespace, self.dest, value)
        setattr(namespace, NOTICES, [
            *(getattr(namespace, NOTICES, None) or ()),
            (f"{option_string} is an old spelling, kept for one release: use "
            f"{self.new(parser, value)}")])


def notices(args: argparse.Namespace) -> list[str]:
    """One line per old spelling the command line used, naming the new one."""
    return list(getattr(args, NOTICES, None) or ())


def int_list(option: str, text: str, minimum: int = 1) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4): one int or a comma list, each >= minimum; else one line, exit 2."""
    allowed = f"an int >= {minimum} or a comma list of them, e.g. 1,2,4,8"
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"{option} {text!r} is invalid: {allowed}") from None
    for value in values:
        if value < minimum:
            raise UsageError(f"{option} {value} is invalid: {allowed}")
    return values


class _IntList(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, int_list(option_string or self.dest, values))


def _listed(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def add_model(p: argparse.ArgumentParser, default: str | None = None, runs: bool = False) -> None:
    """MODEL, positional: a preset or '<preset>-rank' (`config.get_config`). `runs`: the command
    runs the model, which only the presets of `common.cpu_models` do here; its help says which."""
    names = ", ".join(config_names())
    p.usage = f"{p.prog} {'[MODEL]' if default else 'MODEL'} [options]  (see the examples below)"
    runnable = (f"; these run on a CPU: {', '.join(cpu_models())} (the others' weights are "
                "too large to run here)") if runs else ""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=f"one of {names}" + (f" (default {default})" if default else "")
                        + runnable)
    p.add_argument("--model", dest=MODEL_OPTION, action=_OldSpelling, default=None,
                   new=lambda parser, value: f"{parser.prog} {value} (the model first)")


def resolve_model(args: argparse.Namespace, default: str | None = None) -> None:
    """args.model from MODEL or the old --model (never both), else `default`."""
    old = getattr(args, MODEL_OPTION, None)
    if old is not None and args.model is not None:
        raise UsageError(f"the model is named twice ({args.model} and --model {old}): name it "
                         "once, first")
    args.model = args.model or old or default


def add_batch(p: argparse.ArgumentParser, default: Sequence[int] = (1,), old: bool = False) -> None:
    """--batch B or B1,B2,...: args.batch is a tuple. `old`: also the old `--batches B B ...`."""
    p.add_argument("--batch", action=_IntList, default=tuple(default), metavar="B[,B...]",
                   help=f"sequences decoded together (rows of each step): one value or a comma "
                        f"list (default {_listed(default)})")
    if old:
        p.add_argument("--batches", dest="batch", action=_OldSpelling, nargs="+",
                       convert=lambda option, values: int_list(option, ",".join(values)),
                       new=lambda parser, value: f"--batch {_listed(value)}")


def each_batch(args: argparse.Namespace, run: Callable[[argparse.Namespace], int]) -> int:
    """`run` once per --batch value, in order, on a copy of args whose batch is that int (and
    whose argv, which a `--ranks` child runs again, names that batch alone); the worst status."""
    status = 0
    for batch in args.batch:
        argv = args.argv if len(args.batch) == 1 else [*args.argv, "--batch", str(batch)]
        status = max(status, run(argparse.Namespace(**{**vars(args), "batch": batch,
                                                       "argv": argv})))
    return status


def add_context(p: argparse.ArgumentParser, default: int | None, help: str,
                old: bool = False) -> None:
    """--context C, the one name of a sequence length. `old`: also the old `--seq-len S`."""
    p.add_argument("--context", type=int, default=default, metavar="C", help=help)
    if old:
        p.add_argument("--seq-len", dest="context", type=int, action=_OldSpelling,
                       new=lambda parser, value: f"--context {value}")


def add_cache_layout(p: argparse.ArgumentParser) -> None:
    """--cache-layout expanded|latent (the old `--layout`)."""
    p.add_argument("--cache-layout", default=None, choices=MLA_CACHE_LAYOUTS,
                   help="MLA cache layout (default: the model's)")
    p.add_argument("--layout", dest="cache_layout", choices=MLA_CACHE_LAYOUTS,
                   action=_OldSpelling, new=lambda parser, value: f"--cache-layout {value}")


def add_expert_format(p: argparse.ArgumentParser, extra: tuple[str, ...] = (),
                      extra_help: str = "") -> None:
    """--format: the routed experts' format (`ModelConfig.expert_format`), default the model's."""
    p.add_argument("--format", dest="expert_format", default=None,
                   choices=EXPERT_FORMATS + extra,
                   help=f"routed-expert format (default: the model's{extra_help})")


def add_rank_layout(p: argparse.ArgumentParser, help: str) -> None:
    """--rank-layout ours|release (the old `--layout` of `predict`)."""
    p.add_argument("--rank-layout", default=None, choices=layout.LAYOUTS, help=help)
    p.add_argument("--layout", dest="rank_layout", choices=layout.LAYOUTS, action=_OldSpelling,
                   new=lambda parser, value: f"--rank-layout {value}")
