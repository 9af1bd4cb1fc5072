"""Speculative decoding at full size, predicted: the reading of the published numbers, verify
steps of B (k + 1) rows, tok/s at acceptance 3 and 6 beside the published 350 and 709, the
`predict --speculate` command and its refusals."""

import json

import pytest

from mkresearch.cli import main as cli
from mkresearch.model.config import get_config
from mkresearch.prediction import scale_out
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
    # sequence and its DSpark draft pass, tok/s 12-15 % under the published (test_scale_out's
    # RATIO_WINDOWS name it)
    assert all(0.85 < r["ratio"] < 0.9 for r in rows)
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
