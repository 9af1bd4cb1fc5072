"""`mkresearch decode --speculate K [--drafter ...]` and `bench --speculate K`, in-process (main()):
the report (tokens per step, acceptance, the verify step's time, the lossless line) and bad input
as one line with exit status 2."""

import json

import pytest

from mkresearch.cli import main as cli


@pytest.mark.slow
def test_decode_speculate_forced_reports_steps_acceptance_and_lossless(capsys):
    """deepseek-v3-mini (the quickest mini to compile) at forced acceptance 2 of K = 3 on the
    reference's verify: every step emits 3 tokens, and the tokens are plain greedy decoding's."""
    assert cli.main(["decode", "deepseek-v3-mini", "--prompt-len", "3", "--steps", "7",
                     "--batch", "2", "--speculate", "3", "--drafter", "forced:2", "--backend",
                     "reference", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == "reference" and result["speculate"] == 3
    assert result["verify_steps"] == 2 and result["mean_accepted"] == 2  # 1 + 3 + 3 tokens
    assert result["tokens_per_step"] == 3 and result["acceptance_rate"] == pytest.approx(2 / 3)
    assert result["lossless"]["passed"] and result["lossless"]["tokens_equal"] == 14
    assert result["seconds"]["verify_step"] > 0
    from mkresearch.cli.speculative import print_decode

    print_decode(result)
    text = capsys.readouterr().out
    assert "2 verify steps, 3.00 tokens per step, 2.00 of K=3 drafts accepted per step" in text
    assert "lossless: speculative greedy == plain greedy decoding" in text and "14/14" in text
    assert "PASS" in text and "verify step time here" in text


@pytest.mark.slow
def test_decode_speculate_on_the_megakernel_by_default(capsys):
    """The default backend: one megakernel pallas_call per verify step (kimi-k3-mini: KDA, MLA,
    MoE), forced acceptance 2 of K = 4, lossless against plain greedy decoding. (B = 1 and K = 4:
    the verify step and reference step test_bench_speculative_rows runs, compiled once.)"""
    assert cli.main(["decode", "kimi-k3-mini", "--prompt-len", "3", "--steps", "7",
                     "--batch", "1", "--speculate", "4", "--drafter", "forced:2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == "megakernel" and result["verify_steps"] == 2
    assert result["tokens_per_step"] == 3 and result["lossless"]["tokens_equal"] == 7


@pytest.mark.slow  # a deepseek-v3-mini decode with its MTP drafter (~12 s); B = 2 and K = 3:
# the reference steps and rollback the forced decode above compiled
def test_decode_speculate_mtp(capsys):
    assert cli.main(["decode", "deepseek-v3-mini", "--prompt-len", "3", "--steps", "4",
                     "--batch", "2", "--speculate", "3", "--drafter", "mtp"]) == 0
    text = capsys.readouterr().out
    assert "drafter mtp" in text and "8/8 tokens equal -> PASS" in text


@pytest.mark.slow
def test_bench_speculative_rows(tmp_path, capsys, monkeypatch):
    """`bench --speculate K` adds verify rows of both backends (B x (K + 1) <= 64 only) to the
    bench's output and JSON; the plain megakernel bench rows are stubbed out (tests/test_cli.py
    runs them). kimi-k3-mini at B = 1, K = 4: the verify steps the decode above compiled."""
    from mkresearch.cli import bench

    def stub(cfg, batches, steps, chip, out_json, figure):
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text("{}")
        return {"rows": []}

    monkeypatch.setattr(bench, "run_bench", stub)
    assert cli.main(["bench", "kimi-k3-mini", "--batch", "1,16", "--steps",
                     "1", "--speculate", "4", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "B=1, speculative K=4 (reference" in text and "B=16" not in text  # 16 x 5 > 64
    assert "B=1, speculative K=4 (megakernel" in text
    rows = json.loads((tmp_path / "decode_bench.json").read_text())["speculative"]
    assert [(row["backend"], row["batch"]) for row in rows] == [("megakernel", 1),
                                                                  ("reference", 1)]
    assert all(row["verify_step_s"] > 0 for row in rows)


@pytest.mark.parametrize("args, reason", [
    (["decode", "--speculate", "0"], "--speculate 0 is invalid: an int in [1, 7]"),
    (["decode", "--speculate", "8"], "--speculate 8 is invalid: an int in [1, 7]"),
    (["decode", "--speculate", "7", "--batch", "9"],
     "--batch 9 x (--speculate 7 + 1) = 72 rows is invalid: at most 64 per verify call"),
    (["decode", "--speculate", "3", "--drafter", "eagle"],
     "drafter='eagle' is unknown: one of forced:A, ngram, mtp"),
    (["decode", "--speculate", "3", "--drafter", "forced:4"],
     "--drafter forced:4 is invalid with --speculate 3: forced:A with A in [0, 3]"),
    (["decode", "--speculate", "3", "--drafter", "mtp"],
     "drafter='mtp' is invalid for kimi-k3-mini: it has n_mtp_layers=0"),
    (["decode", "--drafter", "ngram"], "--drafter is an option of --speculate K"),
    (["decode", "deepseek-v3-mini", "--speculate", "3", "--drafter", "mtp",
      "--backend", "megakernel"], "--drafter mtp runs with --backend reference"),
    (["decode", "--speculate", "3", "--backend", "mine"], "--backend 'mine'"),
    (["decode", "--speculate", "3", "--prompt-len", "120", "--steps", "8"],
     "--prompt-len + --steps - 1 + --speculate = 130 exceeds max_seq_len=128"),
    (["bench", "--speculate", "9"], "--speculate 9 is invalid: an int in [1, 7]"),
])
def test_bad_speculative_input_is_one_line_exit_2(capsys, args, reason):
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and reason in lines[0], captured.err
