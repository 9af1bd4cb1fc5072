"""The figures `make figures` (`mkresearch figures`) writes: a registry of name -> drawing function.

Each function takes one argument, the output path of a PNG, and draws with matplotlib's Agg
backend. To add a figure, add one line to FIGURES.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mkresearch.cli.bench import plot_decode_bench
from mkresearch.cli.common import UsageError, output_directory
from mkresearch.cli.options import add_command
from mkresearch.views.plots import plot_expert_bytes, plot_kv_bytes, plot_roofline
from mkresearch.views.scale_out_plots import plot_scale_out

FIGURES: dict[str, Callable[[Path], None]] = {
    "roofline": plot_roofline,
    "decode_bench": plot_decode_bench,
    "expert_bytes": plot_expert_bytes,
    "mla_kv_bytes": plot_kv_bytes,
    "scale_out": plot_scale_out,
}
EXAMPLES = ("mkresearch figures --out figures",
            "mkresearch figures --out build/figures --only roofline scale_out")


def add_parser(commands: Any) -> None:
    p = add_command(commands, "figures", "write every registered figure as PNG", EXAMPLES)
    p.add_argument("--out", default="figures", help="output directory (default figures)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help=f"just these figures, of {', '.join(FIGURES)}")


def run(args: Any) -> int:
    require_matplotlib("mkresearch figures")
    for name in args.only or ():
        if name not in FIGURES:
            raise UsageError(f"--only {name!r} is unknown: choose from {', '.join(FIGURES)}")
    for path in write_figures(output_directory("--out", args.out), args.only):
        print(f"wrote {path}")
    return 0


def require_matplotlib(command: str) -> None:
    """Before any work: a UsageError naming the `plots` extra when matplotlib is not installed
    (it is an extra: the library and `decode` run without it)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"{command} draws with matplotlib, which is not installed here: "
                         'pip install "mkresearch[plots]"')


def figure_function(name: str) -> Callable[[Path], None]:
    """The drawing function registered as `name`."""
    if name not in FIGURES:
        raise ValueError(f"unknown figure {name!r}: choose one of {', '.join(FIGURES)}")
    return FIGURES[name]


def write_figure(name: str, out_dir: str | Path = "figures") -> Path:
    """Draw figure `name` into out_dir/name.png and return the path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    figure_function(name)(path)
    return path


def write_figures(out_dir: str | Path = "figures",
                  names: Iterable[str] | None = None) -> list[Path]:
    """Draw every registered figure (or `names`) into out_dir; returns the written paths."""
    names = list(FIGURES) if names is None else list(names)
    for name in names:
        figure_function(name)  # unknown names fail before anything is drawn
    return [write_figure(name, out_dir) for name in names]
