"""The op-by-op step (`jax_kernels`) against the reference, over seeds: the measurement behind
`jax_kernels.BOUND`.

    python -m mkresearch.baselines.jax_kernels_sweep [--quick] [--seeds N] [--steps T] [--out F]

Each case is a mini (an expert format, a cache layout, the paged GQA step) at a batch size. Per
seed: the config's weights drawn with that seed, a random state (every cache and recurrent
state drawn from a normal distribution, `random_state`) with each row at its own random
position, then T steps of random tokens fed to both steps, each from its own copy of the state
(the contiguous step against `reference.decode_step`, the paged one against
`paged_kv.paged_decode_step` on a random page table). A random state is any state the step may
be handed: the two must agree on it, and it puts every row at a long context without a prefill.
Per row and step (`RowStep`): the largest |Δlogit|, whether the greedy token and the routing
differ; `summary` reads the bound off them: the largest |Δlogit| of a row whose routing has not
differed (where a MoE layer picks another expert for a row, at a near-tie of the router's
scores, that row's logits move by whole units from then on, as between any two orders of the
same sums).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkresearch.baselines import jax_kernels
from mkresearch.model import paged_kv, reference, spec, weights
from mkresearch.model.config import ModelConfig, get_config


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    overrides: tuple[tuple[str, Any], ...] = ()
    paged: bool = False

    @property
    def cfg(self) -> ModelConfig:
        return get_config(self.name).replace(**dict(self.overrides))

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.overrides) + (" paged" if self.paged else "")
        return f"{self.name}{extra} B={self.batch}"


# every mini, each expert format and MLA cache layout of Kimi K3's, the paged GQA step
VARIANTS = ((("kimi-k3-mini", ()), False), (("kimi-k3-mini", (("expert_format", "bf16"),)), False),
            (("kimi-k3-mini", (("expert_format", "fp8"),)), False),
            (("kimi-k3-mini", (("mla_cache_layout", "latent"),)), False),
            (("deepseek-v3-mini", ()), False), (("glm-4.5-mini", ()), False),
            (("qwen3-235b-a22b-mini", ()), False), (("glm-4.5-mini", ()), True),
            (("qwen3-235b-a22b-mini", ()), True))
SWEEP = tuple(Case(name, batch, overrides, paged) for (name, overrides), paged in VARIANTS
              for batch in (1, 8))
QUICK = tuple(Case(name, 3, overrides, paged) for (name, overrides), paged in VARIANTS)
PAGES = paged_kv.PagedKVConfig(page_size=16, n_pages=160, max_pages_per_row=8)  # 128 tokens a row


@dataclasses.dataclass(frozen=True)
class RowStep:
    """One row at one step: the largest |Δlogit| over the vocabulary, whether its greedy token
    differs, the gap between the reference's two largest logits, whether its routing differs at
    this step in any MoE layer and whether it differed at this step or an earlier one (from then
    on the row's caches and states differ: its logits may move by whole units)."""

    case: Case
    seed: int
    row: int
    step: int
    dlogit: float
    token_differs: bool
    top_two_gap: float
    routing_differs: bool
    diverged: bool

    def record(self) -> dict[str, Any]:
        return {"case": self.case.label, **{f.name: getattr(self, f.name)
                                            for f in dataclasses.fields(self)[1:]}}


def random_state(shapes: Any, rng: np.random.Generator) -> Any:
    """A state of these shapes with every leaf drawn from a normal distribution (recurrent f32
    states scaled by 0.3, about a running KDA state's size)."""
    def draw(s):
        scale = 0.3 if s.dtype == jnp.float32 else 1.0
        return jnp.asarray(rng.standard_normal(s.shape) * scale, s.dtype)

    return jax.tree.map(draw, shapes)


def _positions(rng: np.random.Generator, batch: int, length: int, steps: int) -> np.ndarray:
    return rng.integers(0, length - steps + 1, batch).astype(np.int32)


def compare(case: Case, seed: int, steps: int, params: Any = None) -> list[RowStep]:
    """T steps of both steps from one random state (the module docstring): one RowStep per row
    and step."""
    cfg, batch = case.cfg, case.batch
    rng = np.random.default_rng(seed)
    params = weights.init_params(cfg, seed) if params is None else params
    if case.paged:
        pool = random_state(paged_kv.paged_state_shapes(cfg, PAGES, batch), rng)
        table = rng.permutation(PAGES.n_pages)[:batch * PAGES.max_pages_per_row].reshape(
            batch, -1).astype(np.int32)
        positions = _positions(rng, batch, PAGES.max_context, steps)
        ours, theirs = jax_kernels.from_paged_kv(pool), pool
    else:
        theirs = random_state(spec.state_shapes(cfg, batch, cfg.max_seq_len), rng)
        positions = _positions(rng, batch, cfg.max_seq_len, steps)
        ours = jax.tree.map(jnp.copy, theirs)
    rows, diverged = [], np.zeros(batch, bool)
    for t in range(steps):
        tokens = rng.integers(0, cfg.vocab_size, batch).astype(np.int32)
        at = positions + t
        if case.paged:
            want, theirs, want_aux = paged_kv.paged_decode_step(params, theirs, tokens, at, table,
                                                                cfg, PAGES)
            got, ours, got_aux = jax_kernels.paged_decode_step(params, ours, tokens, at, table,
                                                               cfg, PAGES)
        else:
            want, theirs, want_aux = reference.decode_step(params, theirs, tokens, at, cfg)
            got, ours, got_aux = jax_kernels.decode_step(params, ours, tokens, at, cfg)
        want, got = np.asarray(want), np.asarray(got)
        routing = np.zeros(batch, bool)
        if "expert_ids" in want_aux:  # [n_moe, B, k]: the same set of experts per layer
            routing = np.any(np.any(np.sort(np.asarray(want_aux["expert_ids"]), -1)
                                    != np.sort(np.asarray(got_aux["expert_ids"]), -1), -1), 0)
        diverged |= routing
        top_two = np.sort(want, -1)[:, -2:]
        for b in range(batch):
            rows.append(RowStep(case, seed, b, t, float(np.max(np.abs(want[b] - got[b]))),
                                bool(np.argmax(want[b]) != np.argmax(got[b])),
                                float(top_two[b, 1] - top_two[b, 0]), bool(routing[b]),
                                bool(diverged[b])))
    return rows


def sweep(cases: Any = SWEEP, seeds: int = 16, steps: int = 4, progress: bool = True
          ) -> list[RowStep]:
    """compare() for every case and seed; one line printed per case and seed with progress."""
    results = []
    for case in cases:
        for seed in range(seeds):
            start = time.perf_counter()
            rows = compare(case, seed, steps)
            results += rows
            if progress:
                print(json.dumps({"case": case.label, "seed": seed, **summary(rows)["all"],
                                  "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return results


def summary(rows: list[RowStep]) -> dict[str, Any]:
    """Per case and over all: row-steps compared; the largest |Δlogit| over row-steps whose
    routing never differed (`same_routing_max`) and over all; row-steps with a routing
    difference; greedy tokens that differ, and of them those with the same routing so far and
    the reference's top two logits more than twice the same-routing bound apart (none expected:
    `unexplained_tokens`)."""
    def total(group):
        same = [r.dlogit for r in group if not r.diverged]
        bound = max(same, default=0.0)
        return {"row_steps": len(group), "same_routing_max": bound,
                "max_abs_dlogit": max(r.dlogit for r in group),
                "differing_row_steps": sum(r.dlogit > 0 for r in group),
                "routing_differences": sum(r.routing_differs for r in group),
                "diverged_row_steps": sum(r.diverged for r in group),
                "token_differences": sum(r.token_differs for r in group),
                "unexplained_tokens": sum(r.token_differs and not r.diverged
                                          and r.top_two_gap > 2 * bound for r in group)}

    labels = dict.fromkeys(r.case.label for r in rows)
    return {"cases": {label: total([r for r in rows if r.case.label == label])
                      for label in labels}, "all": total(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one batch size (3) per variant")
    parser.add_argument("--seeds", type=int, default=16, help="seeds per case (default 16)")
    parser.add_argument("--steps", type=int, default=4, help="steps per seed (default 4)")
    parser.add_argument("--out", help="write every row-step as JSON lines to this file")
    args = parser.parse_args(argv)
    results = sweep(QUICK if args.quick else SWEEP, args.seeds, args.steps)
    if args.out:
        with open(args.out, "w") as out:
            out.writelines(json.dumps(r.record()) + "\n" for r in results)
    print(json.dumps(summary(results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
