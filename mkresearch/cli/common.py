"""What every `mkresearch` command shares: the one-line usage error, the parser that raises it,
and the checks of command-line values (a named option and its allowed values, exit status 2)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from mkresearch.hardware.chips import CHIPS
from mkresearch.kernels.compose.megakernel_plan import MAX_BATCH
from mkresearch.model.config import ModelConfig
from mkresearch.sharding import layout


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _model(name: str | None) -> ModelConfig:
    """A preset, or '<preset>-rank': one rank of its release layout (`layout.named_config`)."""
    if name is None:
        raise UsageError(f"MODEL is missing: name one of {', '.join(layout.config_names())} "
                         "after the command")
    if name not in layout.config_names():
        raise UsageError(f"unknown model {name!r}: choose one of "
                         f"{', '.join(layout.config_names())}")
    return layout.named_config(name)


def _at_least(option: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise UsageError(f"{option} must be an int >= {minimum}, got {value}")


def _in_range(option: str, value: int, low: int, high: int, why: str) -> None:
    if not low <= value <= high:
        raise UsageError(f"{option} {value} is invalid: an int in [{low}, {high}] ({why})")


def _chip(name: str) -> str:
    if name not in CHIPS:
        raise UsageError(f"--chip {name!r} is unknown: choose one of {', '.join(CHIPS)}")
    return name


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """A ValueError of the library (a config the chip cannot run: VMEM plan, HBM; bad input it
    checks before tracing) -> a UsageError of its first line: one line, exit status 2."""
    try:
        yield
    except ValueError as error:
        raise UsageError(str(error).splitlines()[0]) from None


def _megakernel_batch(option: str, value: int) -> None:
    if not 1 <= value <= MAX_BATCH:
        raise UsageError(f"{option} {value} is invalid: each in [1, {MAX_BATCH}] (the megakernel "
                         "backend)")


def _human_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"
