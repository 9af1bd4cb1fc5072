"""Compile results recorded by a command and committed, so that a notebook can show them
instead of spending most of its time budget compiling.

Compiling the megakernel for TPU7x at `kimi-k3-rank` shapes takes 25-55 s on two CPU cores;
notebook 06 shows the recorded result unless asked to compile (or the record does not match):

    mkresearch compile kimi-k3-rank --chip tpu7x --record     # (re)writes the record
    make recorded        # python -m mkresearch.recorded: the same, for every record

A record is keyed by the megakernel's plan (every static size, the VMEM plan included) and the
JAX version: `compile_or_recorded` uses it only when both match the current ones, and compiles
otherwise. It does not see a kernel change that keeps the plan: re-record after such changes
(`tests/test_recorded.py` checks that every record matches its plan).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax

from mkresearch.kernels import megakernel
from mkresearch.tpu import CompileResult

RECORDED_DIR = Path(__file__).resolve().parent / "recorded"
# The compiles the notebooks show, as (model, batch, chip): `make recorded` writes each. A model is
# a preset or '<preset>-rank', one rank of its release layout (`mkresearch.layout.named_config`).
RECORDED_COMPILES = (("kimi-k3-rank", 1, "tpu7x"),)


def compile_path(model: str, batch: int, chip: str) -> Path:
    return RECORDED_DIR / f"compile_{model}_b{batch}_{chip}.json"


def plan_fingerprint(plan: Any) -> str:
    """A digest of a megakernel plan (its repr: config, sizes, options, VMEM buffers) and the JAX
    version: what a recorded compile result is valid for."""
    return hashlib.sha256(f"{plan!r}|jax {jax.__version__}".encode()).hexdigest()[:16]


def record_compile(result: Any, plan: Any, path: str | Path) -> Path:
    """Write a `tpu.CompileResult` (without its HLO text) and its plan's fingerprint as JSON."""
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)
              if f.name != "hlo_text"}
    record = {"model": plan.cfg.name, "batch": plan.batch, "fingerprint": plan_fingerprint(plan),
              "result": {k: dict(v) if hasattr(v, "items") else v for k, v in fields.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def load_compile(plan: Any, path: str | Path) -> Any | None:
    """The recorded `tpu.CompileResult` for `plan`, or None if there is no record at `path` or it
    was recorded for another plan or JAX version."""
    path = Path(path)
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if record.get("fingerprint") != plan_fingerprint(plan):
        return None
    return CompileResult(**record["result"])


def compile_or_recorded(cfg: Any, batch: int = 1, *, chip: str = "tpu7x",
                        recompile: bool = False) -> tuple[Any, Any, str]:
    """(CompileResult, plan, where the result comes from) for one megakernel step of `cfg` on
    `chip`: the committed record when it matches the plan, else a compile here (also when
    `recompile`). The plan is always computed here (it is cheap)."""
    options = megakernel.MegakernelOptions(chip=chip)
    plan = megakernel.make_plan(cfg, batch, cfg.max_seq_len, options)
    path = compile_path(cfg.name, batch, chip)
    result = None if recompile else load_compile(plan, path)
    if result is not None:
        return result, plan, (f"recorded ({path.name}; `mkresearch compile {cfg.name} --record` "
                              "re-records it)")
    result, plan = megakernel.compile_step(cfg, batch, chip=chip, options=options)
    return result, plan, "compiled here"


def main() -> int:
    """`python -m mkresearch.recorded`: compile and record every entry of RECORDED_COMPILES."""
    from mkresearch import cli  # cli imports this module: importing it at the top is a cycle

    for model, batch, chip in RECORDED_COMPILES:
        status = cli.main(["compile", model, "--batch", str(batch), "--chip", chip, "--record"])
        if status:
            return status
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
