"""The scale-out model's work per batch row (`prediction.row_work`): each term recomputed from
the model's shapes and the chip's vector rate, growing with the rows, in both sides' programs
alike, and shown by `predict --explain` and `--json`."""

import json

import pytest

from mkresearch.cli import main as cli
from mkresearch.model import spec
from mkresearch.model.config import get_config
from mkresearch.prediction import calibration, row_work, scale_out
from mkresearch.prediction import timeline as tl
from mkresearch.prediction.timeline_chip import timeline_chip
from mkresearch.sharding import layout as layouts

CONTEXT = 512


def _by_term(cfg, n_ranks=32, context=CONTEXT):
    return {t.term: t for t in row_work.terms(cfg, n_ranks, context)}


def test_each_term_is_its_formula_over_the_shapes():
    """Kimi K3 on 32 ranks (docs/kimi-k3.md §1, §9): 3 heads of 128 per rank, 896 experts, top
    16, d = 7168, attention-residual blocks of 12 layers."""
    cfg = get_config("kimi-k3")
    terms = _by_term(cfg)
    heads, dim, d = 3, 128, 7168
    assert row_work.heads_per_rank(cfg, 32) == heads
    assert terms["delta rule"].per_step == 69 * 3 * heads * dim * dim
    assert terms["softmax"].per_step == 24 * 4 * heads * (CONTEXT + 1)
    assert terms["top-k"].per_step == 92 * (896 + 3 * 16 * 896)
    candidates = 0  # 𝒜_ℓ and {R_0..R_n, P}, written out from docs/kimi-k3.md §3
    for layer in range(93):
        n, offset = divmod(layer, 12)
        candidates += (1 if layer == 0 else n + 1 if offset == 0 else n + 2) + n + 2
    assert terms["residual mix"].per_step == 6 * d * candidates + 93 * 2 * 4 * d


def test_a_prenorm_family_adds_its_residuals_and_norms():
    cfg = get_config("qwen3-235b-a22b-mini")
    mix = _by_term(cfg, 2)["residual mix"]
    assert mix.per_layer == (2 * cfg.d_model + 2 * 4 * cfg.d_model,) * cfg.n_layers


@pytest.mark.parametrize("batches", [(1, 2, 4, 8)])
def test_the_seconds_are_rows_times_flops_over_the_vector_rate_and_grow_with_b(batches):
    cfg = get_config("kimi-k3")
    chip = timeline_chip("tpu7x")
    assert chip.vpu_flops == chip.mxu_flops / 16  # the ASSUMPTION the docs name
    for row in row_work.table(cfg, 32, batches, chip.vpu_flops, CONTEXT):
        seconds = [row["seconds"][b] for b in batches]
        assert seconds == sorted(seconds) and seconds[0] > 0
        for b in batches:
            assert row["seconds"][b] == pytest.approx(b * row["flops_per_row"] / chip.vpu_flops)


def test_the_simulator_runs_compute_at_the_vector_rate():
    chip = timeline_chip("tpu7x", vpu_flops=1e12)
    sim = tl.RankSimulation([("compute", 3e6)], chip)
    for request in sim.run():
        raise AssertionError(request)
    assert sim.total == pytest.approx(3e-6) and sim.flops == 3e6


def _compute_flops(ops) -> float:
    return sum(op[1] for op in ops if op[0] == "compute")


@pytest.mark.parametrize("model, n_ranks, batch", [("kimi-k3", 32, 1), ("kimi-k3", 32, 4),
                                                   ("deepseek-v3-mini", 8, 3)])
def test_both_sides_carry_the_same_row_work(model, n_ranks, batch):
    """Ours and the release's programs hold the same per-row FLOPs per step (the same terms at
    the same rows), and it is the terms' sum times the rows."""
    cfg = get_config(model)
    expected = batch * sum(t.per_step for t in row_work.terms(cfg, n_ranks, CONTEXT))
    for name in (layouts.OURS, layouts.RELEASE):
        _, programs = scale_out.rank_programs(cfg, n_ranks, name, batch, context=CONTEXT)
        for ops in programs:
            assert _compute_flops(ops) == pytest.approx(expected, rel=1e-12), name


def test_the_row_work_lengthens_both_sides_step():
    """Taking the terms away (a vector rate 10^6 x faster) shortens both sides by about the
    terms' seconds: the model prices them on the compute unit of every rank."""
    cfg = get_config("kimi-k3")
    base = timeline_chip("tpu7x")
    fast = timeline_chip(base, vpu_flops=base.vpu_flops * 1e6)
    for name in (layouts.OURS, layouts.RELEASE):
        with_work = calibration.Model(timeline_chip=base).predict(cfg, 8, name)["step_s"]
        without = calibration.Model(timeline_chip=fast).predict(cfg, 8, name)["step_s"]
        assert with_work > without, name


def test_vpu_flops_is_in_the_sensitivity_set():
    assert any(field == "vpu_flops" for _, _, field, _ in calibration.ASSUMPTIONS)
    assert "vpu_flops" in calibration.TIMELINE_FIELDS


def test_explain_and_json_show_each_term_per_batch(capsys):
    assert cli.main(["predict", "kimi-k3", "--explain", "--batch", "1,8"]) == 0
    out = capsys.readouterr().out
    for term in row_work.TERMS:
        assert term in out
    assert "us per step at B = 1, 8" in out
    for side in (layouts.OURS, layouts.RELEASE):  # the bytes that grow with the batch, each side
        assert any(line.split()[:3] == [side, "routed", "experts"] for line in out.splitlines())
    assert cli.main(["predict", "kimi-k3-mini", "--ranks", "8", "--batch", "1,2", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)["row_work"]
    assert {row["term"] for row in table} <= set(row_work.TERMS)
    assert all(set(row["seconds"]) == {"1", "2"} for row in table)


def test_which_kinds_keep_a_cache():
    """The delta rule is counted where a stage keeps a fixed state, softmax where it keeps a
    cache read at the context (`spec.keeps_cache`, which the scale-out model also asks)."""
    kimi, glm = get_config("kimi-k3-mini"), get_config("glm-4.5-mini")
    assert spec.keeps_cache(kimi, "mla") and not spec.keeps_cache(kimi, "kda")
    assert spec.keeps_cache(glm, "gqa") and not spec.keeps_cache(kimi, "moe")
