"""Compile results recorded by a command and committed, so that a notebook can show them
instead of spending most of its time budget compiling.

Compiling the megakernel for TPU7x at `kimi-k3-rank` shapes takes 25-55 s on two CPU cores (one
rank of DeepSeek-V3 or GLM-4.5 20-25 s); notebooks 06 and 10 show the recorded results unless asked
to compile (or a record does not match):

    mkresearch compile kimi-k3-rank --chip tpu7x --record     # (re)writes the record
    make recorded        # python -m mkresearch.cli.record: the same, for every record

A record is keyed by the megakernel's plan (every static size, the VMEM plan included) and the
JAX version: `compile_or_recorded` uses it only when both match the current ones, and compiles
otherwise. It does not see a kernel change that keeps the plan: re-record after such changes
(`tests/test_recorded.py` checks that every record matches its plan).

The sharded megakernel of a full-size model on a TPU topology (`RECORDED_SHARDED`: kimi-k3 and
the other families on the 32 cores of tpu7x:2x2x4, one Mosaic kernel per rank) is recorded the same way, keyed by its
`ShardedPlan` (`sharded_compile_or_recorded`; `make recorded` re-records it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax

from mkresearch.hardware.tpu import CompileResult
from mkresearch.kernels.compose import megakernel
from mkresearch.kernels.compose import megakernel_sharded as sharded
from mkresearch.model.config import get_config
from mkresearch.sharding import layout

RECORDED_DIR = Path(__file__).resolve().parent / "recorded"
# The compiles the notebooks show, as (model, batch, chip): `make recorded` writes each. A model is
# a preset or '<preset>-rank', one rank of it (`mkresearch.model.config.get_config`).
RECORDED_COMPILES = (("kimi-k3-rank", 1, "tpu7x"),
                     # notebook 10: one rank of each other family (`partition.rank_config`)
                     ("deepseek-v3-rank", 1, "tpu7x"), ("glm-4.5-rank", 1, "tpu7x"),
                     ("qwen3-235b-a22b-rank", 1, "tpu7x"))


# (model, ranks, layout, batch, chip): the sharded step on `sharded.FULL_TOPOLOGY`
RECORDED_SHARDED = (("kimi-k3", 32, "ours", 1, "tpu7x"),
                    # notebook 10: the other families with their sharding rules
                    ("deepseek-v3", 32, "ours", 1, "tpu7x"), ("glm-4.5", 32, "ours", 1, "tpu7x"),
                    ("qwen3-235b-a22b", 32, "ours", 1, "tpu7x"))
# Config overrides of a sharded record: in exact mode on 32 ranks Qwen3's FFN streams one block
# (its router, [4096, 128], whole on every rank; no shared expert), so the ring's lookahead
# (ring_depth - 1 blocks) may be 1 at most there: make_sharded_plan refuses its preset depth 3
# (partial-sum mode picks its own depth, `megakernel_sharded.ring_depth`)
SHARDED_OVERRIDES = {"qwen3-235b-a22b": {"ring_depth": 2}}
# The collectives a sharded record is compiled with: the kernel's default, partial sums, unless a
# model is listed here with another mode (one whose partial-sum VMEM plan would not fit). None is:
# each model's ring is deepened within TPU7x's 60 MiB (`megakernel_sharded.ring_depth`); its VMEM
# plan: `mkresearch compile MODEL --ranks 32`, or the record `make recorded` writes
SHARDED_COLLECTIVES: dict[str, str] = {}
# The same sharded steps in the restructured collectives mode (`layout.RESTRUCTURED`: issue 46's
# MoE reductions; the families without a MoE latent build the partial-sum kernel's step there),
# each recorded beside its default-mode record
RECORDED_RESTRUCTURED = RECORDED_SHARDED


def sharded_collectives(model: str) -> str:
    return SHARDED_COLLECTIVES.get(model, "partial-sum")


def compile_path(model: str, batch: int, chip: str) -> Path:
    return RECORDED_DIR / f"compile_{model}_b{batch}_{chip}.json"


# The jax whose libtpu compiled the committed records (`make recorded` under the pins of
# requirements/constraints.txt; tests/test_recorded.py holds the two equal). Under another jax in
# pyproject.toml's range (a runtime's own: Colab's) a record of the same plan is still what the
# notebooks show, saying which jax compiled it: compiling here needs the tpu extra's libtpu.
RECORDED_JAX = "0.10.2"


def plan_fingerprint(plan: Any, jax_version: str | None = None) -> str:
    """A digest of a megakernel plan (its repr: config, sizes, options, VMEM buffers) and the JAX
    version (this one unless given): what a recorded compile result is valid for."""
    version = jax_version or jax.__version__
    return hashlib.sha256(f"{plan!r}|jax {version}".encode()).hexdigest()[:16]


def _recorded_with() -> str:
    """What the where-from line adds when this jax is not the one that compiled the records."""
    return "" if jax.__version__ == RECORDED_JAX else f", compiled with jax {RECORDED_JAX}"


def record_compile(result: Any, plan: Any, path: str | Path) -> Path:
    """Write a `tpu.CompileResult` (without its HLO text) and its plan's fingerprint as JSON (a
    megakernel plan or a sharded one)."""
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)
              if f.name != "hlo_text"}
    step = getattr(plan, "mega", plan)  # a ShardedPlan: one rank's megakernel plan
    record = {"model": step.cfg.name, "batch": step.batch, "fingerprint": plan_fingerprint(plan),
              "result": {k: dict(v) if hasattr(v, "items") else v for k, v in fields.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def load_compile(plan: Any, path: str | Path) -> Any | None:
    """The recorded `tpu.CompileResult` for `plan`, or None if there is no record at `path` or it
    was recorded for another plan, or by a JAX other than this one and RECORDED_JAX."""
    path = Path(path)
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    valid = (plan_fingerprint(plan), plan_fingerprint(plan, RECORDED_JAX))
    if record.get("fingerprint") not in valid:
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
        return result, plan, (f"recorded ({path.name}{_recorded_with()}; `mkresearch compile "
                              f"{cfg.name} --record` re-records it)")
    result, plan = megakernel.compile_step(cfg, batch, chip=chip, options=options)
    return result, plan, "compiled here"


def sharded_path(model: str, n_ranks: int, name: str, batch: int, chip: str,
                 collectives: str | None = None) -> Path:
    """A sharded record's file (a mode other than the model's default named in it)."""
    mode = "" if collectives in (None, sharded_collectives(model)) else f"_{collectives}"
    return RECORDED_DIR / f"compile_{model}_{n_ranks}ranks_{name}{mode}_b{batch}_{chip}.json"


def sharded_compile_or_recorded(model: str, n_ranks: int, name: str, batch: int = 1,
                                chip: str = "tpu7x", *, record: bool = False,
                                recompile: bool = False, collectives: str | None = None
                                ) -> tuple[Any, Any, str]:
    """(CompileResult of one rank's program, ShardedPlan, where it comes from) for the sharded
    step of preset `model` on n_ranks devices of `sharded.FULL_TOPOLOGY`, with the kernel's
    default partial-sum collectives (`sharded_collectives`) or `collectives`
    (`layout.COLLECTIVES`): the committed record when it matches the plan, else a compile
    here (recorded with `record`)."""
    cfg = get_config(model, **SHARDED_OVERRIDES.get(model, {}))
    mode = collectives or sharded_collectives(model)
    lay = layout.layout(cfg, n_ranks, name, collectives=mode)
    options = sharded.kernel_options(lay, batch, chip)
    plan = sharded.make_sharded_plan(lay, batch, None, options)
    path = sharded_path(model, n_ranks, name, batch, chip, mode)
    result = None if recompile or record else load_compile(plan, path)
    if result is not None:
        return result, plan, (f"recorded ({path.name}{_recorded_with()}; `make recorded` "
                              "re-records it)")
    result, plan = sharded.compile_sharded_step(cfg, n_ranks, name, batch, chip=chip,
                                                collectives=mode, options=options)
    if record:
        record_compile(result, plan, path)
    return result, plan, "compiled here"

