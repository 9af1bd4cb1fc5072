"""What fewer collectives would cost (`mkresearch.prediction.replication_floor`): the frontier from
the step as built, each avoided collective's bytes per rank, and what it says of issue targets
such as "at most 200 collectives" beside "at most 2.5 ms" (docs/collectives.md §1's ~188)."""

from __future__ import annotations

import itertools
import json

import pytest

from mkresearch.cli import main as cli
from mkresearch.model.config import get_config
from mkresearch.prediction import collective_plan
from mkresearch.prediction import replication_floor as floor
from mkresearch.sharding import layout as layouts
from mkresearch.sharding import layout_bytes

FAMILIES = ("kimi-k3", "deepseek-v3", "glm-4.5", "qwen3-235b-a22b")


@pytest.mark.parametrize("name", FAMILIES)
def test_frontier_starts_at_the_step_as_built_and_only_trades_bytes_for_collectives(name):
    cfg = get_config(name)
    front = floor.frontier(cfg, 32)
    built, rows = front["rows"][0], front["rows"]
    plan = collective_plan.collective_plan(cfg, 32)
    lay = layouts.layout(cfg, 32, collectives=layouts.PARTIAL_SUM)
    # one answer per quantity: the plan's count and the per-rank bytes `info` / `predict` print
    assert built["collectives"] == plan["count"]
    assert built["rank_bytes"] == layout_bytes.rank_bytes(lay, 1, 0, "partial-sum").total
    for before, after in itertools.pairwise(rows):
        assert after["collectives"] < before["collectives"]
        assert after["rank_bytes"] >= before["rank_bytes"]
        assert after["collectives_ms"] <= before["collectives_ms"]
    # the collectives' latency as built: the plan's price of every collective, one after another
    assert built["collectives_ms"] == pytest.approx(plan["priced_us"] / 1e3, rel=1e-9)
    assert all(r["bound_ms"] == max(r["floor_ms"], r["collectives_ms"]) for r in rows)
    best = floor.fastest(cfg, 32)
    assert best["bound_ms"] <= min(r["bound_ms"] for r in rows)  # every combination, not one order
    # the routed experts' sum stays (in the shared experts' reduction where they are on the full
    # d): every expert on every rank is more than one device's HBM
    merged = layouts.merges_shared_sum(lay, "moe_full") if "moe_full" in cfg.kinds else False
    assert front["unfit"] == [floor.SHARED_SUM if merged else "expert/sum"]
    assert rows[1]["avoided"] in ("embed", floor.SHARED_SUM) and rows[1]["rank_bytes"] == \
        built["rank_bytes"]


def test_kimi_k3_two_hundred_collectives_need_three_times_the_bytes():
    """Kimi K3's MoE needs four collectives a layer with every matrix split: the router + W_ld
    gather before top-k, ρ's sum before its RMSNorm, the output's sum, the attention's sum (MLA
    one more: W_qa + W_kva before their RMSNorms). At most 200 per step means every rank reading
    the whole router, W_ld and W_lu: an HBM floor above both 2.5 ms and the release's 4.02 ms."""
    front = floor.frontier(get_config("kimi-k3"), 32)
    built = front["rows"][0]
    assert built["collectives"] == 396
    fewest = floor.bytes_for(front, 200)
    assert fewest["collectives"] == 187 and fewest["avoided"] == "router/w_router+latent/w_ld"
    assert fewest["rank_bytes"] > 3 * built["rank_bytes"] and fewest["floor_ms"] > 4.02
    # within the step's own bytes: only the embedding's sum goes (the table on every rank)
    assert floor.fewest_within(front, built["rank_bytes"])["collectives"] == 395
    assert floor.fewest_within(front, built["rank_bytes"] - 1) is None
    assert floor.bytes_for(front, 10) is None


def test_kimi_k3_no_design_meets_the_issue_targets_together():
    """Lower bounds on the step (the larger of the HBM floor and the collectives' latencies, one
    after another) over every combination of avoided collectives: within 4.6 GB per rank none
    is under 2.5 ms (the collectives alone take 2.64 ms); with at most 200 collectives none is
    under the release's measured 4.02 ms; the fastest of all (2.45 ms) reads 9.07 GB per rank."""
    cfg = get_config("kimi-k3")
    within = floor.fastest(cfg, 32, max_rank_bytes=4.6e9)
    assert within["bound_ms"] > 2.5 and within["avoided"] == ["embed"]
    assert floor.fastest(cfg, 32, max_collectives=200)["bound_ms"] > 4.02
    best = floor.fastest(cfg, 32)
    assert best["rank_bytes"] > 9e9 and best["avoided"] == [floor.SHARED_SUM]
    assert floor.fastest(cfg, 32, max_rank_bytes=1e9) is None
    assert "no combination" in floor.format_fastest(None, "within 1 GB per rank")
    print(floor.format_fastest(within, "within 4.6 GB per rank"))
    print(floor.format_fastest(best))


@pytest.mark.parametrize("name", ("deepseek-v3", "glm-4.5"))
def test_experts_on_the_full_d_share_one_reduction(name):
    """Routed and shared experts on the full d both give [B, d] partial sums: the kernel adds them
    on each rank before one reduction (`layout.merges_shared_sum`), one collective a layer less
    than two reductions; that reduction is the routed experts' sum too (unfit to avoid)."""
    cfg = get_config(name)
    found = {a.name: a for a in floor.avoidances(cfg, 32)}
    assert "expert/sum" not in found
    shared = found[floor.SHARED_SUM]
    assert not shared.fits_hbm and shared.count == len(cfg.layers_of("moe_full"))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="cfg="):
        floor.avoidances("kimi-k3", 32)


@pytest.mark.slow  # ~9 s: plan kimi-k3 --ranks 32 in three modes
def test_plan_prints_the_frontier(capsys):
    assert cli.main(["plan", "kimi-k3", "--ranks", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["frontier"]["rows"][0]["collectives"] == report["count"]
    assert report["fastest"]["bound_ms"] <= report["frontier"]["rows"][0]["bound_ms"]
    assert cli.main(["plan", "kimi-k3", "--ranks", "32"]) == 0
    text = capsys.readouterr().out
    assert "fewer collectives by replication, and what they cost" in text
    assert "not listed: expert/sum" in text
    assert "the lowest bound over replication designs (not over restructured" in text
    for mode in ("exact", "restructured"):  # replication's bound: the partial-sum mode's alone
        assert cli.main(["plan", "kimi-k3", "--ranks", "32", "--collectives", mode, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["frontier"] is None and report["fastest"] is None
    # restructured: rho's reduce-scatter in every MoE layer, one phase, priced by the model
    assert report["summary"]["by_kind"]["reduce-scatter"] == 92
    assert {(r["algorithm"], r["phases"]) for r in report["rows"]
            if r["kind"] == "reduce-scatter"} == {("one-shot", 1)}
