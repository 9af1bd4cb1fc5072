"""What every `mkresearch` command shares: the one-line usage error, the parser that raises it,
and the checks of command-line values (a named option and its allowed values, exit status 2)."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mkresearch.hardware import tpu
from mkresearch.hardware.chips import CHIPS
from mkresearch.kernels.compose.megakernel_plan import MAX_BATCH
from mkresearch.model import spec
from mkresearch.model.config import ModelConfig, config_names, get_config
from mkresearch.model.roofline import tree_bytes
from mkresearch.model.weights import param_shapes
from mkresearch.sharding import layout

MAX_DECODE_WEIGHT_BYTES = 2 * 10**9  # beyond this many weight bytes: not in a laptop's memory


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a one-line UsageError."""

    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def known_model(name: str | None) -> ModelConfig:
    """A preset, or '<preset>-rank': one rank of its release layout (`config.get_config`)."""
    if name is None:
        raise UsageError(f"MODEL is missing: name one of {', '.join(config_names())} "
                         "after the command")
    if name not in config_names():
        raise UsageError(f"unknown model {name!r}: choose one of "
                         f"{', '.join(config_names())}")
    return get_config(name)


def runs_on_cpu(cfg: ModelConfig) -> bool:
    """Whether `decode` and `bench` run the model on a laptop's CPU: its weights fit in
    MAX_DECODE_WEIGHT_BYTES (they refuse the others anywhere). Every preset is shapes to info,
    plan, compile and predict."""
    return tree_bytes(param_shapes(cfg)) <= MAX_DECODE_WEIGHT_BYTES


def cpu_models() -> list[str]:
    """The presets that `runs_on_cpu`, in `config_names` order."""
    return [name for name in config_names() if runs_on_cpu(get_config(name))]


def check_runs_on_cpu(cfg: ModelConfig) -> None:
    """A model too large to decode here: a UsageError naming the ones that run."""
    if not runs_on_cpu(cfg):
        raise UsageError(f"{cfg.name} has {human_bytes(tree_bytes(param_shapes(cfg)))} of "
                         f"weights, too many to decode here: use one of "
                         f"{', '.join(cpu_models())} (or `mkresearch info {cfg.name}`)")


def at_least(option: str, value: int, minimum: int) -> None:
    """An option's int is at least `minimum`, else a UsageError naming it."""
    if value < minimum:
        raise UsageError(f"{option} must be an int >= {minimum}, got {value}")


def options_of(parent: str, options: Iterable[tuple[str, Any, Any]], why: str) -> None:
    """Options that mean something only with `parent`, as (flag, value, its default): the first
    given (not its default) is a UsageError naming both, not an option silently dropped."""
    for flag, value, default in options:
        if value != default:
            raise UsageError(f"{flag} {value} is an option of {parent}: give both ({why})")


def cache_layout_applies(cfg: ModelConfig, cache_layout: str | None) -> None:
    """--cache-layout names an MLA cache: refused for a model without an MLA layer."""
    kinds = sorted(set(cfg.attention_kinds))
    if cache_layout is not None and not any(kind.startswith("mla") for kind in kinds):
        raise UsageError(f"--cache-layout {cache_layout} is invalid for {cfg.name}: it lays out "
                         f"MLA's cache, and its attention is {', '.join(kinds)}")


def with_formats(cfg: ModelConfig, args: Any) -> ModelConfig:
    """cfg with --cache-layout and --format where given (each refused in one line where it does
    not apply: `cache_layout_applies`, the config's own checks)."""
    cache_layout_applies(cfg, args.cache_layout)
    with refusals():
        return spec.check(cfg.replace(mla_cache_layout=args.cache_layout or cfg.mla_cache_layout,
                                      expert_format=args.expert_format or cfg.expert_format))


def wire_with_partial_sums(wire: str, collectives: str) -> None:
    """--wire bf16 asks for partial sums: refused with the exact mode, which sends none."""
    if wire != "f32" and collectives == layout.EXACT:
        raise UsageError(f"--wire {wire} needs partial sums (--collectives "
                         f"{' or '.join(layout.PARTIAL_SUM_MODES)}): the exact mode sends every "
                         "value whole")


def in_range(option: str, value: int, low: int, high: int, why: str) -> None:
    """An option's int is in [low, high], else a UsageError naming it and saying why."""
    if not low <= value <= high:
        raise UsageError(f"{option} {value} is invalid: an int in [{low}, {high}] ({why})")


def context_in_cache(cfg: ModelConfig, context: int) -> None:
    """--context: tokens already in each sequence's KV cache (or a row's position), which with
    the new token must fit the cache: in [0, max_seq_len - 1], else a UsageError saying so."""
    in_range("--context", context, 0, cfg.max_seq_len - 1,
             f"the KV cache of {cfg.name} holds max_seq_len={cfg.max_seq_len} tokens, the new "
             "one included")


CHIP_DEFAULT_HELP = f"default: this machine's TPU, else {tpu.DEFAULT_CHIP}"


def known_chip(name: str | None) -> str:
    """--chip's value, when it names one of `chips.CHIPS`; None (not given): the TPU present,
    else tpu7x (`tpu.default_chip`)."""
    if name is None:
        return tpu.default_chip()
    if name not in CHIPS:
        raise UsageError(f"--chip {name!r} is unknown: choose one of {', '.join(CHIPS)}")
    return name


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """A ValueError of the library (a config the chip cannot run: VMEM plan, HBM; bad input it
    checks before tracing) -> a UsageError of its first line: one line, exit status 2."""
    try:
        yield
    except ValueError as error:
        raise UsageError(str(error).splitlines()[0]) from None


def output_directory(option: str, path: str | Path) -> Path:
    """Before any work: the directory an option names, created if missing, else a UsageError
    naming the option and why (a command that benches for minutes fails before, not after)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{option} {str(path)!r} is invalid: no directory can be made there "
                         f"({error.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {str(path)!r} is invalid: that directory is not writable")
    return path


def megakernel_batch(option: str, value: int) -> None:
    """A batch the megakernel backend runs: in [1, MAX_BATCH]."""
    if not 1 <= value <= MAX_BATCH:
        raise UsageError(f"{option} {value} is invalid: each in [1, {MAX_BATCH}] (the megakernel "
                         "backend)")


def human_bytes(n: float) -> str:
    """Bytes in decimal units: '1.23 GB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def human_count(n: float) -> str:
    """A count in decimal units: '1.23 B' (billions)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"
