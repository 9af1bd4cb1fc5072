"""Speculative decoding at full size, predicted: the reading of the published numbers, verify
steps of B (k + 1) rows, tok/s at acceptance 3 and 6 beside the published 350 and 709, the
drafter's pass over every sequence's block, the `predict --speculate` command and its refusals;
each design of our step in a verify step (`speculative_designs`, `predict --speculate K
--designs`), priced as the plain designs table prices it."""

import json

import pytest

from mkresearch.cli import main as cli
from mkresearch.model.config import get_config
from mkresearch.prediction import design_table, scale_out, speculative_designs, step_bounds
from mkresearch.prediction import speculative_predict as speculative
from mkresearch.sharding import layout as layouts


def test_the_published_numbers_imply_one_verify_step_when_acceptance_counts_tokens():
    short, long = speculative.implied_steps_s(350, 3), speculative.implied_steps_s(709, 6)
    # tokens per step: 8.57 vs 8.46 ms (1.3 % apart); drafts + bonus: 11.43 vs 9.87 ms (16 %)
    assert abs(short["tokens_per_step"] / long["tokens_per_step"] - 1) < 0.02
    assert short["drafts_plus_bonus"] / long["drafts_plus_bonus"] - 1 > 0.15


@pytest.fixture(scope="module")
def mini_rows():
    cfg = get_config("kimi-k3-mini")
    return speculative.predict_speculative(cfg, 2, layouts.OURS, batch=2, drafts=3,
                                           acceptances=(1, 2, 4))


def test_a_verify_step_is_the_step_of_b_times_k_plus_1_rows(mini_rows):
    cfg = get_config("kimi-k3-mini")
    verify = scale_out.predict(cfg, 2, layouts.OURS, 8, sequences=2)  # 2 sequences' 8 rows
    for row in mini_rows:
        assert row["verify_rows"] == 8 and row["verify_step_s"] == verify["step_s"]
        assert row["draft_step_s"] == 0 and row["step_s"] == verify["step_s"]  # no drafter known
        assert row["tokens_per_step"] == 2 * row["acceptance"]
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / verify["step_s"],
                                                    rel=1e-12)
        assert row["published_tok_s"] is None  # no published numbers for the mini
    # one weight pass serves more tokens: tok/s grows with the acceptance length
    assert [r["tokens_per_s"] for r in mini_rows] == sorted(r["tokens_per_s"] for r in mini_rows)


def test_release_rows_beside_the_published_350_and_709():
    cfg = get_config("kimi-k3")
    rows = speculative.release_rows(cfg)
    assert [(r["acceptance"], r["verify_rows"], r["published_tok_s"]) for r in rows] == [
        (3, 8, 350), (6, 8, 709)]
    # out of sample (nothing fitted to a step time): the release's 8-row verify step of one
    # sequence and its DSpark draft pass, tok/s within 1 % of the published (test_scale_out's
    # RATIO_WINDOWS name it)
    assert all(0.98 < r["ratio"] < 1.02 for r in rows)
    plain_b8 = scale_out.predict(cfg, 32, layouts.RELEASE, 8)
    one_sequence = scale_out.predict(cfg, 32, layouts.RELEASE, 8, sequences=1)
    assert rows[0]["verify_step_s"] == one_sequence["step_s"] < plain_b8["step_s"]
    assert one_sequence["rank_bytes"] < plain_b8["rank_bytes"]  # states read once, not 8 times
    assert rows[0]["step_s"] == rows[0]["verify_step_s"] + rows[0]["draft_step_s"]
    assert 0 < rows[0]["draft_step_s"] < 0.1 * rows[0]["verify_step_s"]
    assert sum(speculative.draft_bytes()) == pytest.approx(225e6, rel=0.01)


def test_acceptance_curve_has_both_draft_policies():
    cfg = get_config("kimi-k3-mini")
    points = speculative.acceptance_curve(cfg, 2, layouts.OURS)
    assert [p["acceptance"] for p in points] == list(range(1, 9))
    assert [p["exact_verify_rows"] for p in points] == list(range(1, 9))
    assert all(p["k7_verify_rows"] == 8 for p in points)
    # with all 8 rows kept, both policies verify the same rows
    assert points[-1]["exact_tokens_per_s"] == pytest.approx(points[-1]["k7_tokens_per_s"])


@pytest.mark.parametrize("kwargs, message", [
    ({"drafts": 0}, "drafts=0 is invalid: an int in [1, 7]"),
    ({"drafts": 8}, "drafts=8 is invalid: an int in [1, 7]"),
    ({"batch": 9, "drafts": 7}, "72 verify rows, at most 64 (batch <= 8)"),
    ({"drafts": 3, "acceptances": (5,)}, "acceptance=5 is invalid: an int in [1, 4]"),
])
def test_bad_speculative_input_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        speculative.predict_speculative(get_config("kimi-k3-mini"), 2, **kwargs)


def test_predict_speculate_command(capsys):
    assert cli.main(["predict", "kimi-k3-mini", "--ranks", "2", "--batch", "1",
                     "--rank-layout", "ours", "--speculate", "3", "--acceptance", "2,4",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["predictions"]
    assert [(r["acceptance"], r["verify_rows"]) for r in rows] == [(2, 4), (4, 4)]
    assert cli.main(["predict", "kimi-k3-mini", "--ranks", "2", "--batch", "1",
                     "--rank-layout", "ours", "--speculate", "3"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding with 3 drafts per verify step" in out


@pytest.mark.parametrize("argv, message", [
    (["--speculate", "8"], "drafts=8 is invalid"),
    (["--speculate", "-1"], "--speculate must be an int >= 0"),
    (["--speculate", "3", "--acceptance", "2,x"], "--acceptance '2,x' is invalid"),
    (["--speculate", "7", "--batch", "9"], "72 verify rows"),
])
def test_predict_speculate_refuses_bad_input(argv, message, capsys):
    assert cli.main(["predict", "kimi-k3-mini", "--ranks", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_drafter_passes_over_every_sequences_block():
    """B sequences with k drafts: one pass of the drafter over B (k + 1) block rows (a model
    whose drafter is not known: none)."""
    cfg = get_config("kimi-k3")
    one, two = speculative.drafter_s(cfg, 3), speculative.drafter_s(cfg, 3, 2)
    assert one == speculative.draft_step(4).total_s
    assert two == speculative.draft_step(8).total_s > one
    assert speculative.drafter_s(get_config("kimi-k3-mini"), 3, 2) == 0


# ---- each design of our step in a verify step --------------------------------------------------
DESIGN_ROWS = 2  # B = 1, k = 1: the cheapest verify step (2 rows) of the full-size model


@pytest.fixture(scope="module")
def k3_designs():
    """Kimi K3 on 32 ranks, B = 1, k = 1: the speculative table and the plain designs table at
    its verify rows (both under the default Model; cached predictions the command reuses)."""
    cfg = get_config("kimi-k3")
    spec = speculative_designs.speculative_designs(cfg, 32, (1,), drafts=1, acceptances=(1, 2))
    plain = design_table.designs_table(cfg, 32, (DESIGN_ROWS,))
    return spec, plain


@pytest.mark.slow  # ~20 full-size predictions of 1 and 2 rows (~10 s)
def test_a_designs_verify_step_is_its_plain_step_less_the_same_state_reads(k3_designs):
    """The verify step of B rows with k drafts runs each design's plain schedule at B (k + 1)
    rows (the same list, the same router placement, the same Schedule), and reads each
    sequence's states once: it is the plain B (k + 1)-row step less one saving, the same bytes and
    the same time for every design and for the release. So a design buys the verify step
    exactly what it buys the plain step of B (k + 1) rows."""
    spec, plain = k3_designs
    assert [r["design"] for r in spec] == [r["design"] for r in plain]
    assert spec[-1]["design"] == speculative_designs.RELEASE_LABEL
    cfg = get_config("kimi-k3")
    for row, (label, p) in zip(spec, design_table.design_predictions(cfg, 32, DESIGN_ROWS),
                               strict=False):
        assert row["design"] == label and row["schedule"] == p["schedule"]
    saved_ms = [n["step_ms"] - s["verify_ms"] for s, n in zip(spec, plain, strict=True)]
    saved_gb = [n["rank_gb"] - s["rank_gb"] for s, n in zip(spec, plain, strict=True)]
    assert all(ms > 0 for ms in saved_ms) and all(gb > 0 for gb in saved_gb)
    # the one state read saved (K3: 1 sequence's instead of 2 rows' KDA states and MLA cache)
    assert saved_ms == pytest.approx([saved_ms[0]] * len(spec), abs=1e-9)  # float rounding
    assert saved_gb == pytest.approx([saved_gb[0]] * len(spec), abs=1e-9)  # (bytes / 1e9)
    for i in range(1, len(spec)):
        assert spec[i]["verify_ms"] - spec[i - 1]["verify_ms"] == pytest.approx(
            plain[i]["step_ms"] - plain[i - 1]["step_ms"], abs=1e-9)


@pytest.mark.slow  # the fixture's predictions, and two of the speculative path
def test_speculative_designs_rows_as_built_and_the_release(k3_designs):
    """As built is `predict --speculate`'s ours and the release is its release (the call
    `calibration.validation` makes), under the same Model; tok/s = B a / (verify + draft)."""
    spec, _ = k3_designs
    cfg, model = get_config("kimi-k3"), design_table.SAME_ASSUMPTIONS
    for row, name in ((spec[0], layouts.OURS), (spec[-1], layouts.RELEASE)):
        side = speculative.predict_speculative(
            cfg, 32, name, drafts=1, acceptances=(1, 2), context=model.context,
            schedule=model.schedule if name == layouts.RELEASE else None)
        assert row["verify_ms"] == side[0]["verify_step_s"] * 1e3
        assert row["draft_ms"] == side[0]["draft_step_s"] * 1e3 > 0
        assert row["tokens_per_s"] == {str(r["acceptance"]): r["tokens_per_s"] for r in side}
        assert row["rank_gb"] == side[0]["rank_bytes"] / 1e9
    release_step = spec[-1]["step_ms"]
    for row in spec:
        assert row["verify_rows"] == DESIGN_ROWS and row["draft_ms"] == spec[0]["draft_ms"]
        assert row["step_ms"] == pytest.approx(row["verify_ms"] + row["draft_ms"], rel=1e-12)
        for a, tok_s in row["tokens_per_s"].items():
            assert tok_s == pytest.approx(int(a) / row["step_ms"] * 1e3, rel=1e-12)
        assert row["over_release"] == pytest.approx(row["step_ms"] / release_step, rel=1e-12)
        assert row["published_tok_s"] is None  # none published at acceptance 1 and 2
    assert spec[-1]["over_release"] == 1


@pytest.mark.slow  # the fixture's predictions again, through the command
def test_predict_speculate_designs_command(k3_designs, capsys):
    spec, _ = k3_designs
    argv = ["predict", "kimi-k3", "--designs", "--speculate", "1", "--acceptance", "1,2",
            "--batch", "1"]
    assert cli.main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(spec))
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "speculative decoding with each design of our step (kimi-k3 on 32 ranks" in out
    assert "tok/s a=1" in out and "tok/s a=2" in out and "context 512" in out
    assert all(r["design"] in out for r in spec)
    print(out)
    capsys.readouterr()
    # what the verify step waits for: the designs' last row of B (k + 1) rows, B sequences
    assert cli.main([*argv, "--bounds", "--json"]) == 0
    bounds = json.loads(capsys.readouterr().out)["bounds"]
    assert bounds == step_bounds.step_bounds(get_config("kimi-k3"), 32, DESIGN_ROWS, sequences=1)
    ours = {r["resource"]: r for r in bounds if r["side"].startswith("ours")}
    assert spec[-2]["design"] != speculative_designs.RELEASE_LABEL  # the last design's row
    assert ours[step_bounds.AS_MODELLED]["step_ms"] == pytest.approx(spec[-2]["verify_ms"])


@pytest.mark.exhaustive  # the designs at 8 rows (~35 s)
def test_the_k7_verify_step_waits_on_the_mxu_where_the_releases_does_not():
    """docs/prediction.md §9: Kimi K3's verify step of B = 1, K = 7 (8 rows): ours saves more
    with a 10x faster MXU than with 10x faster reads by far, and about what 1,000 tok/s at an
    acceptance length of 6 asks of it; the release's MXU is not its bound."""
    cfg = get_config("kimi-k3")
    rows = step_bounds.step_bounds(cfg, 32, 8, sequences=1)
    ours = {r["resource"]: r for r in rows if r["side"].startswith("ours")}
    release = {r["resource"]: r for r in rows if r["side"].startswith("the release")}
    drafting_ms = speculative.drafter_s(cfg, 7, 1, n_ranks=32) * 1e3
    asked_ms = ours[step_bounds.AS_MODELLED]["step_ms"] - (6 / 1000 * 1e3 - drafting_ms)
    assert ours["the MXU"]["saved_ms"] > 10 * ours["weight and expert reads"]["saved_ms"]
    assert ours["the MXU"]["saved_ms"] == pytest.approx(asked_ms, abs=0.05)
    assert release["the MXU"]["saved_ms"] < 0.4 * ours["the MXU"]["saved_ms"]


def test_speculative_designs_without_the_release_or_a_drafter():
    """kimi-k3-mini on 2 ranks: no release modelled, no drafter known (the verify step alone)."""
    cfg = get_config("kimi-k3-mini")
    rows = speculative_designs.speculative_designs(cfg, 2, (1,), drafts=1, acceptances=(2,))
    assert rows[0]["design"] == "as built"
    assert all(r["design"] != speculative_designs.RELEASE_LABEL for r in rows)
    assert all(r["over_release"] is None and r["draft_ms"] == 0 for r in rows)
    text = speculative_designs.format_speculative_designs(rows, cfg.name, 2, 512)
    assert "no drafter known for kimi-k3-mini" in text and "ours and the release" not in text


@pytest.mark.parametrize("kwargs, message", [
    ({"drafts": 0}, "drafts=0 is invalid: an int in [1, 7]"),
    ({"batches": (1, 9)}, "72 verify rows, at most 64 (batch <= 8)"),
    ({"drafts": 3, "acceptances": (5,)}, "acceptance=5 is invalid: an int in [1, 4]"),
])
def test_speculative_designs_refuse_bad_input_before_any_prediction(kwargs, message,
                                                                    monkeypatch):
    def no_prediction(*args, **kw):
        raise AssertionError("a prediction before the checks")

    monkeypatch.setattr(design_table, "design_predictions", no_prediction)
    monkeypatch.setattr(speculative, "predict_speculative", no_prediction)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        speculative_designs.speculative_designs(get_config("kimi-k3"), 32,
                                                **{"drafts": 7, **kwargs})


@pytest.mark.parametrize("argv, message", [
    (["--validate"], "--validate is invalid with --designs"),
    (["--explain"], "--explain is invalid with --designs"),
    (["--rank-layout", "release"], "--rank-layout is invalid with --designs"),
    (["--collectives", "exact"], "--collectives is invalid with --designs"),
    (["--expert-mxu", "fp8"], "--expert-mxu is invalid with --designs"),
    (["--speculate", "8"], "drafts=8 is invalid: an int in [1, 7]"),
    (["--speculate", "7", "--batch", "9"], "72 verify rows"),
    (["--speculate", "3", "--acceptance", "5"], "acceptance=5 is invalid: an int in [1, 4]"),
    (["--speculate", "-1"], "--speculate must be an int >= 0"),
])
def test_predict_designs_refuses_bad_combinations(argv, message, capsys):
    """One line, exit status 2, the option named with what --designs takes."""
    assert cli.main(["predict", "kimi-k3", "--designs", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    if "with --designs" in message:
        assert "--designs takes --ranks, --chip, --batch, --context, --speculate, " \
               "--acceptance, --bounds, --json" in err
