"""What the partial-sum mode keeps of the single-device reference, measured over seeds.

The sharded reference (`reference_sharded`, equal to the partial-sum kernel to the bit) adds each
row-split contraction's partial products and the expert groups' sums in another order than one
device does. A re-associated f32 sum differs in its last bits; where that crosses a bf16
rounding, the difference grows, and where it changes which experts a row picks, the row's
logits move by whole units. This module measures how often and how far, beside a yardstick:
the single-device reference with its sums in another order (`reordered_params`: every
contraction the partial-sum mode splits summed from its last term to its first, the routed
experts added in descending id). Two orders on one device differ the same way, so a user can
tell what the partial sums change from what any other order of the same sums would.

`sweep(cases)` -> one `RowStep` per (case, row, step, variant); `summary(rows)` -> per variant the
distribution and the flips; `python -m mkresearch.sharding.partial_sum_sweep [--quick]` prints
the table (SWEEP: 16 configurations x 4 compiled steps, ~50 min on a loaded 2-core machine,
the compiles most of it; --quick: 4 cases; --restructured: the restructured mode's variants
beside partial-sum f32 on Kimi K3's mini; --seeds N: seed pairs per configuration). The claim it
measures is stated in
`reference_sharded` and tested over SWEEP in tests/test_partial_sum_claim.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from mkresearch.model import config, reference, weights
from mkresearch.model.numerics import Partials, matmul
from mkresearch.sharding import layout as layouts
from mkresearch.sharding import reference_sharded

SINGLE, REORDERED = "single", "reordered"
VARIANTS = (REORDERED, "partial-sum f32", "partial-sum bf16")
# the restructured mode's sharded reference (`layouts.RESTRUCTURED`): `--restructured`
RESTRUCTURED_VARIANTS = ("restructured f32", "restructured bf16")
WIRE = {REORDERED: "f32", "partial-sum f32": "f32", "partial-sum bf16": "bf16",
        "restructured f32": "f32", "restructured bf16": "bf16"}  # its bound's


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pieces"],
                   meta_fields=["bounds", "wire", "hosts"])
@dataclasses.dataclass(frozen=True)
class ReversedContraction(Partials):
    """A whole matrix (one piece) whose contraction runs from its last term to its first: the
    same products as `matmul`, added in another order, on one device."""

    def contract(self, a: jax.Array) -> jax.Array:
        (w,) = self.pieces
        return matmul(a[..., ::-1], w[..., ::-1, :])


def reordered_params(params: dict, lay: layouts.Layout) -> dict:
    """The yardstick: params whose every matrix the partial-sum layout splits by its rows
    contracts in reverse (`ReversedContraction`), and whose routed experts are numbered
    backwards (experts, router columns and bias mirrored: the same model, its ascending-id
    expert sum taken in descending id). Routing ids come out mirrored: `unmirror`."""
    split = reference_sharded.sharded_params(params, lay)
    out = dict(params)
    for kind, stack in split.items():
        if not isinstance(stack, dict):
            continue
        new = dict(params[kind])
        for key, value in stack.items():
            if isinstance(value, Partials):
                new[key] = ReversedContraction((params[kind][key],), ((0, 0),))
        if "experts" in new:
            new["experts"] = jax.tree.map(lambda w: w[:, ::-1], params[kind]["experts"])
            new["w_router"] = params[kind]["w_router"][..., ::-1]
            if "router_bias" in new:
                new["router_bias"] = params[kind]["router_bias"][..., ::-1]
        out[kind] = new
    return out


def unmirror(expert_ids: np.ndarray, cfg: config.ModelConfig) -> np.ndarray:
    """The reordered model's routing as the original's expert ids."""
    return cfg.n_experts - 1 - expert_ids


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration of the sweep: a mini model with its MLA cache layout and expert format,
    the rank count and batch, the weights' seed and the prompts' seed."""

    model: str
    cache: str
    fmt: str
    ranks: int
    batch: int
    params_seed: int
    prompt_seed: int
    overrides: tuple = ()  # more (field, value) pairs of the config: a cut model

    def config(self) -> config.ModelConfig:
        return config.get_config(self.model).replace(
            mla_cache_layout=self.cache, expert_format=self.fmt, **dict(self.overrides))

    def label(self) -> str:
        return (f"{self.model} {self.cache} {self.fmt} {self.ranks} ranks B={self.batch} "
                f"seeds {self.params_seed}/{self.prompt_seed}")


# (MLA cache layout, expert format, ranks, batch) per model: every layout the model has (MLA with
# RoPE caches only the latent), every format, 2, 4 and 8 ranks (the most with ETP 1), B 1 to 5
COMBOS = {
    "kimi-k3-mini": (("expanded", "mxfp4", 8, 5), ("latent", "bf16", 4, 2),
                     ("expanded", "bf16", 2, 3), ("latent", "fp8", 8, 1),
                     ("expanded", "fp8", 4, 2), ("latent", "mxfp4", 2, 5),
                     ("latent", "bf16", 8, 3), ("expanded", "mxfp4", 4, 1)),
    "deepseek-v3-mini": (("latent", "fp8", 8, 5), ("latent", "bf16", 4, 2),
                         ("latent", "mxfp4", 2, 3), ("latent", "fp8", 4, 1),
                         ("latent", "bf16", 8, 3), ("latent", "mxfp4", 8, 2),
                         ("latent", "fp8", 2, 5), ("latent", "bf16", 2, 1)),
}
SEEDS_PER_COMBO = 3


def sweep_cases(combos: dict = COMBOS, seeds_per_combo: int = SEEDS_PER_COMBO) -> list:
    """Each model's combos with `seeds_per_combo` seed pairs each, every pair its own (weights
    seed s, prompt seed 1000 + s): 2 x 8 x 3 = 48 seed pairs by default. The cases of a combo
    share their compiled steps (the seeds are data)."""
    cases, seed = [], 0
    for model, rows in combos.items():
        for cache, fmt, ranks, batch in rows:
            for _ in range(seeds_per_combo):
                cases.append(Case(model, cache, fmt, ranks, batch, seed, 1000 + seed))
                seed += 1
    return cases


SWEEP = sweep_cases()
PROMPT_LEN, STEPS = 8, 4


@dataclasses.dataclass(frozen=True)
class RowStep:
    """One row at one step of one variant, against the single-device reference at the same
    step (both fed the same tokens, each with its own state)."""

    case: Case
    variant: str
    step: int
    row: int
    max_abs_diff: float  # max over the vocabulary of |logits - single-device logits|
    routing_differs: bool  # some MoE layer picked other experts for this row at this step
    routing_differed: bool  # ... at this step or an earlier one (its caches differ since)
    greedy_differs: bool  # the argmax differs
    top2_gap: float  # the single-device logits' gap between its best two tokens


def measure(case: Case, prompt_len: int = PROMPT_LEN, steps: int = STEPS,
            variants: tuple = VARIANTS) -> list:
    """The case's prompt stepped through the single device and `variants` from an empty state,
    then `steps` greedy steps (the single device's tokens fed to all): one `RowStep` per
    variant, step and row. Every step counts, the prompt's included (each variant's state is its
    own since step 0)."""
    cfg = case.config()
    lay = layouts.layout(cfg, case.ranks, collectives=layouts.PARTIAL_SUM)
    if lay.etp != 1:  # ETP > 1 rounds each partial expert output: not modelled (reference_sharded)
        raise ValueError(f"ranks={case.ranks} is invalid for {cfg.name}: ETP {lay.etp} > 1")
    params = weights.init_params(cfg, case.params_seed)
    restructured = dataclasses.replace(lay, collectives=layouts.RESTRUCTURED)
    made = {REORDERED: lambda: reordered_params(params, lay),
            "partial-sum f32": lambda: reference_sharded.sharded_params(params, lay, "f32"),
            "partial-sum bf16": lambda: reference_sharded.sharded_params(params, lay, "bf16"),
            "restructured f32": lambda: reference_sharded.sharded_params(params, restructured,
                                                                         "f32"),
            "restructured bf16": lambda: reference_sharded.sharded_params(params, restructured,
                                                                          "bf16")}
    params_of = {SINGLE: params} | {name: made[name]() for name in variants}
    prompt = np.asarray(jax.random.randint(jax.random.key(case.prompt_seed),
                                           (case.batch, prompt_len), 0, cfg.vocab_size))
    states = dict.fromkeys(params_of, reference.init_state(cfg, case.batch))
    flipped = {name: np.zeros(case.batch, bool) for name in variants}
    tokens, rows = prompt[:, 0], []
    for t in range(prompt_len + steps - 1):
        positions = np.full(case.batch, t, np.int32)
        out = {}
        for name, p in params_of.items():
            logits, states[name], aux = reference.decode_step(p, states[name], tokens, positions,
                                                              cfg)
            ids = np.asarray(aux["expert_ids"])  # [n_moe, B, k]
            out[name] = (np.asarray(logits), unmirror(ids, cfg) if name == REORDERED else ids)
        logits, ids = out[SINGLE]
        top2 = np.sort(logits, -1)[:, -2:]
        for name in variants:
            differs = reference_sharded.routing_differs(out[name][1], ids)  # [B]
            flipped[name] |= differs
            diff = np.abs(out[name][0] - logits).max(-1)
            greedy = out[name][0].argmax(-1) != logits.argmax(-1)
            rows += [RowStep(case, name, t, b, float(diff[b]), bool(differs[b]),
                             bool(flipped[name][b]), bool(greedy[b]),
                             float(top2[b, 1] - top2[b, 0])) for b in range(case.batch)]
        tokens = prompt[:, t + 1] if t + 1 < prompt_len else logits.argmax(-1).astype(np.int32)
    return rows


def sweep(cases=SWEEP, prompt_len: int = PROMPT_LEN, steps: int = STEPS,
          variants: tuple = VARIANTS, progress: bool = False) -> list:
    """`measure` over cases -> every RowStep."""
    from tqdm import tqdm

    rows = []
    for case in tqdm(cases, desc="partial-sum sweep", unit="case", disable=not progress):
        rows += measure(case, prompt_len, steps, variants)
    return rows


def summary(rows: list) -> dict:
    """Per variant: row-steps, how many have bit-equal logits, the max |logit diff| quantiles
    and maximum over the row-steps whose routing never differed, how many routing flips (row-
    steps where it differs, and rows where it ever did) and greedy-token flips (all, and those
    without a routing difference so far), and the smallest top-2 gap of a greedy flip without
    one."""
    table = {}
    for name in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == name]
        clean = np.array([r.max_abs_diff for r in mine if not r.routing_differed])
        rows_ever = {(r.case, r.row) for r in mine if r.routing_differed}
        quiet_flips = [r for r in mine if r.greedy_differs and not r.routing_differed]
        table[name] = {
            "row_steps": len(mine),
            "bit_equal": sum(r.max_abs_diff == 0 for r in mine),
            "unrouted_row_steps": len(clean),
            "p50": float(np.quantile(clean, 0.5)), "p90": float(np.quantile(clean, 0.9)),
            "p99": float(np.quantile(clean, 0.99)), "max_unrouted": float(clean.max()),
            "max_all": max(r.max_abs_diff for r in mine),
            "routing_differs": sum(r.routing_differs for r in mine),
            "rows": len({(r.case, r.row) for r in mine}),
            "rows_routing_differed": len(rows_ever),
            "greedy_differs": sum(r.greedy_differs for r in mine),
            "greedy_differs_unrouted": len(quiet_flips),
            "max_gap_quiet_flip": max((r.top2_gap for r in quiet_flips), default=0.0),
        }
    return table


def format_table(table: dict) -> str:
    """The summary as printed rows, one per variant."""
    head = (f"{'variant':<18} {'row-steps':>9} {'bit-equal':>9} "
            f"{'p50':>8} {'p90':>8} {'p99':>8} {'max*':>8} {'max':>7} {'route≠':>7} "
            f"{'rows':>9} {'greedy≠':>8} {'greedy≠*':>8}")
    lines = [head]
    for name, s in table.items():
        lines.append(
            f"{name:<18} {s['row_steps']:>9} {s['bit_equal']:>9} {s['p50']:>8.2g} "
            f"{s['p90']:>8.2g} {s['p99']:>8.2g} {s['max_unrouted']:>8.3g} {s['max_all']:>7.3g} "
            f"{s['routing_differs']:>7} {s['rows_routing_differed']:>4}/{s['rows']:<4} "
            f"{s['greedy_differs']:>8} {s['greedy_differs_unrouted']:>8}")
    lines.append("each against the single-device reference at the same step (reordered: the "
                 "single device with its sums in another order); "
                 "p50..max*: |logit diff| over the row-steps whose routing never differed; "
                 "route≠: row-steps whose routing differs; rows: rows whose routing ever did; "
                 "greedy≠*: argmax flips without a routing difference")
    return "\n".join(lines)


def main(argv: Any = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the first two configurations of each model, one seed pair each "
                             "(4 cases, a quarter of the compiles) instead of SWEEP")
    parser.add_argument("--restructured", action="store_true",
                        help="the restructured mode's variants beside partial-sum f32, on Kimi "
                             "K3's mini only (the other mini has no latent to restructure)")
    parser.add_argument("--seeds", type=int, default=SEEDS_PER_COMBO,
                        help=f"seed pairs per configuration (default {SEEDS_PER_COMBO})")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be an int >= 1, got {args.seeds}")
    combos = {m: c for m, c in COMBOS.items() if m == "kimi-k3-mini" or not args.restructured}
    quick = {model: rows[:2] for model, rows in combos.items()}
    cases = (sweep_cases(quick, seeds_per_combo=1) if args.quick
             else sweep_cases(combos, seeds_per_combo=args.seeds))
    variants = (("partial-sum f32", *RESTRUCTURED_VARIANTS) if args.restructured else VARIANTS)
    rows = sweep(cases, variants=variants, progress=True)
    print(f"{len(cases)} cases (seed pairs), {PROMPT_LEN} prompt + {STEPS} greedy steps each")
    print(format_table(summary(rows)))


if __name__ == "__main__":
    main()
