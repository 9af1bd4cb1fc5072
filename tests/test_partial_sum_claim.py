"""The partial-sum claim (`mkresearch.sharding.reference_sharded`'s docstring) over seeds, in
plain JAX: the sharded reference (equal to the partial-sum kernel to the bit: tests/sharded/
test_partial_sum.py) against the single-device reference, beside the single device with its sums
in another order (`partial_sum_sweep.reordered_params`).

At every row-step of every case: the logits within `SAME_ROUTING_BOUND[wire]` of the single
device's until the row's routing has differed from the single device's (`within_claim`); a
greedy token other than the single device's only after that or at a near-tie of twice the bound.
Over the sweep: routing flips with the f32 wire no more frequent than with another order on one
device (within FLIP_SLACK). `make test` runs FAST (the f32 wire: the issue's configuration on
two seed pairs, three more on the 2-layer cuts of both minis, ~40 s of compiles here); the exhaustive tier runs `partial_sum_sweep.SWEEP` (48 seed
pairs, both models, both MLA cache layouts, 2/4/8 ranks, B 1-5, three expert formats, both
wires and the yardstick: ~15 min of compiles here) and prints the table
`python -m mkresearch.sharding.partial_sum_sweep` prints.
"""

import cuts
import numpy as np
import pytest

from mkresearch.model.config import get_config
from mkresearch.sharding import partial_sum_sweep as sweep
from mkresearch.sharding import reference_sharded

# each mini cut to 2 layers: Kimi K3's KDA + dense and MLA + latent MoE (tests/cuts.py),
# DeepSeek-V3's dense and MLA + MoE on the full d
KIMI, DEEPSEEK = get_config("kimi-k3-mini"), get_config("deepseek-v3-mini")
KIMI_CUT = cuts.changed_fields(KIMI, cuts.kimi_kinds(KIMI))
DEEPSEEK_CUT = cuts.changed_fields(DEEPSEEK, cuts.first_layers(DEEPSEEK, 2))
FAST = (sweep.Case("kimi-k3-mini", "latent", "bf16", 4, 2, 3, 1003),  # issue 42's seeds
        # the same compiled steps: one row's routing differs from step 4 here (1.0 apart, the
        # greedy token changed), which the claim allows
        sweep.Case("kimi-k3-mini", "latent", "bf16", 4, 2, 4, 1004),
        sweep.Case("kimi-k3-mini", "expanded", "mxfp4", 8, 3, 11, 1011, KIMI_CUT),
        sweep.Case("deepseek-v3-mini", "latent", "fp8", 8, 3, 12, 1012, DEEPSEEK_CUT),
        sweep.Case("deepseek-v3-mini", "latent", "bf16", 2, 2, 13, 1013, DEEPSEEK_CUT))
KIMI_FAST = [c for c in FAST if c.model == "kimi-k3-mini"]
# the variants of the fast set's Kimi K3 cases: both fast tests' (each variant's state is its own,
# so its rows are the same bits as alone), the single device stepped once for both
KIMI_VARIANTS = ("partial-sum f32", "restructured f32")
# routing flips (rows whose routing ever differed): partial sums' f32 count at most this factor
# of the yardstick's, plus a few rows (both are counts of rare events on fixed seeds)
FLIP_SLACK = (1.5, 3)


def check_claim(rows: list) -> None:
    """Every row-step as the claim allows: within the bound until the row's routing differed; a
    greedy token other than the single device's only after it or at a near-tie."""
    assert rows
    for r in rows:
        bound = reference_sharded.SAME_ROUTING_BOUND[sweep.WIRE[r.variant]]
        assert r.routing_differed or r.max_abs_diff <= bound, r
        assert not r.greedy_differs or r.routing_differed or r.top2_gap <= 2 * bound, r


@pytest.fixture(scope="module")
def kimi_fast_rows():
    """The fast set's Kimi K3 cases through `sweep` with both fast tests' variants at once."""
    return sweep.sweep(KIMI_FAST, variants=KIMI_VARIANTS)


def of_variant(rows: list, variant: str) -> list:
    return [r for r in rows if r.variant == variant]


@pytest.mark.slow  # a seed sweep on the sharded reference (~45 s, with kimi_fast_rows: the
# restructured variant's rows too)
def test_claim_on_a_few_seeds(kimi_fast_rows):
    """The fast set: the sharded reference's f32 wire against the single device at every step of
    5 cases (both families, both cache layouts, 2/4/8 ranks): 2 compiled steps per config."""
    assert FAST[:len(KIMI_FAST)] == tuple(KIMI_FAST)  # FAST's order: Kimi K3's cases first
    rows = (of_variant(kimi_fast_rows, "partial-sum f32")
            + sweep.sweep(FAST[len(KIMI_FAST):], variants=("partial-sum f32",)))
    check_claim(rows)
    table = sweep.summary(rows)
    print(f"\n{len(FAST)} cases, {len(rows)} row-steps\n{sweep.format_table(table)}")
    # both configs agree bit for bit at some steps and differ at others: the sums do differ
    s = table["partial-sum f32"]
    assert 0 < s["bit_equal"] < s["row_steps"]


@pytest.mark.exhaustive  # 16 configurations x 4 compiled steps: ~15 min here
def test_claim_over_the_sweep():
    cases = sweep.SWEEP
    assert len({(c.params_seed, c.prompt_seed) for c in cases}) >= 24
    assert {c.model for c in cases} == {"kimi-k3-mini", "deepseek-v3-mini"}
    assert {c.cache for c in cases if c.model == "kimi-k3-mini"} == {"expanded", "latent"}
    assert {c.fmt for c in cases} == {"bf16", "fp8", "mxfp4"}
    assert {c.ranks for c in cases} == {2, 4, 8} and len({c.batch for c in cases}) >= 4
    rows = sweep.sweep(cases)
    table = sweep.summary(rows)
    print(f"\n{len(cases)} cases\n{sweep.format_table(table)}")
    check_claim(rows)
    factor, extra = FLIP_SLACK
    flips = {name: s["rows_routing_differed"] for name, s in table.items()}
    assert flips["partial-sum f32"] <= factor * flips[sweep.REORDERED] + extra, flips
    # the yardstick does flip routing: the comparison is not against nothing
    assert flips[sweep.REORDERED] > 0
    assert np.isfinite([s["max_all"] for s in table.values()]).all()


@pytest.mark.slow  # a seed sweep on the sharded reference (kimi_fast_rows': once per module)
def test_restructured_claim_on_a_few_seeds(kimi_fast_rows):
    """The restructured mode's sharded reference (equal to its kernel to the bit: tests/sharded/
    test_partial_sum.py) holds the same claim with the same bounds, on the fast set's Kimi K3
    cases (the other mini has no latent to restructure)."""
    cases = KIMI_FAST
    rows = of_variant(kimi_fast_rows, "restructured f32")
    check_claim(rows)
    print(f"\n{len(cases)} cases, {len(rows)} row-steps\n"
          f"{sweep.format_table(sweep.summary(rows))}")


@pytest.mark.exhaustive  # Kimi K3's 24 sweep cases, 3 variants: ~20 min here
def test_restructured_claim_over_the_sweep():
    cases = [c for c in sweep.SWEEP if c.model == "kimi-k3-mini"]
    rows = sweep.sweep(cases, variants=(sweep.REORDERED, *sweep.RESTRUCTURED_VARIANTS))
    table = sweep.summary(rows)
    print(f"\n{len(cases)} cases\n{sweep.format_table(table)}")
    check_claim(rows)
    # NOT claimed: routing as rare as with another order. Measured (8 seed pairs, --seeds 1):
    # routing differed in 18 of 22 rows with the f32 wire (partial-sum f32: 8 of 22): the moved
    # rounding of the latent norm changes every row-step's values from the first MoE layer on
    flips = {name: s["rows_routing_differed"] for name, s in table.items()}
    print(f"rows whose routing differed: {flips}")
