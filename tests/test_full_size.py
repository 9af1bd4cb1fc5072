"""One answer per quantity: `decode`, `bench`, `info` and `predict` print the same full-size step
(time and bytes per rank) for the same model, layout and rank count, from one function
(`mkresearch.prediction.full_size.full_size_step`), and the one-device stand-in is labelled as
what it is wherever it prints."""

from __future__ import annotations

import json

import pytest

from mkresearch.cli import main as cli
from mkresearch.model.config import get_config
from mkresearch.prediction import scale_out
from mkresearch.prediction.full_size import (
    STAND_IN_LABEL,
    full_size_of,
    full_size_step,
    full_size_steps,
)
from mkresearch.sharding import layout, layout_bytes


@pytest.fixture(scope="module")
def kimi_32():
    """Kimi K3 on 32 ranks at B = 1: ours (exact collectives, the kernel as built), the release's."""
    return {name: full_size_step("kimi-k3", 32, name, 1) for name in layout.LAYOUTS}


def run(capsys, *argv: str) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def test_the_step_names_what_it_is_and_takes_its_figures_from_the_models(kimi_32):
    ours, release = kimi_32["ours"], kimi_32["release"]
    # ours: the sharded megakernel as built, partial sums by default (decode --ranks)
    assert (ours.n_ranks, ours.layout, ours.collectives) == (32, "ours", "partial-sum")
    assert (release.layout, release.collectives) == ("release", "partial-sum")
    for step in kimi_32.values():  # the time: scale-out's; the bytes: the layout's (info's table)
        row = scale_out.predict(get_config("kimi-k3"), 32, step.layout, 1)
        assert step.step_s == row["step_s"] and step.prediction == row
        built = "partial-sum" if step.layout == "ours" else "exact"  # the shapes the kernel streams
        counted = layout_bytes.rank_bytes(layout.layout(get_config("kimi-k3"), 32,
                                                        step.layout, collectives=built), 1, 0)
        assert step.rank_bytes == counted.total
        assert step.published_step_s == pytest.approx(1 / 249)  # the release: 249 tok/s at B = 1
        line = step.line()
        assert f"{step.step_s * 1e3:.2f} ms/step" in line and "on 32 ranks of tpu7x" in line
        assert f"{step.layout} layout, {step.collectives} collectives" in line
        assert f"{step.rank_bytes / 1e9:.2f} GB per rank per step" in line
    assert full_size_steps(get_config("kimi-k3"), 32) == list(kimi_32.values())
    assert full_size_steps(get_config("kimi-k3"), 12) == []  # no slice of 12 ranks
    assert full_size_of("kimi-k3-mini") == full_size_of("kimi-k3-rank") == "kimi-k3"
    with pytest.raises(ValueError, match="collectives='approximate' is invalid"):
        full_size_step("kimi-k3", collectives="approximate")


def test_info_and_predict_print_the_same_full_size_lines(capsys, kimi_32):
    info = run(capsys, "info", "kimi-k3", "--ranks", "32")
    predict = run(capsys, "predict", "kimi-k3", "--ranks", "32", "--batch", "1")
    for step in kimi_32.values():
        assert step.line() in info.splitlines() and step.line() in predict.splitlines()
    report = json.loads(run(capsys, "info", "kimi-k3", "--ranks", "32", "--json"))
    assert [s["line"] for s in report["full_size"]] == [s.line() for s in kimi_32.values()]


# plan: also make test's plan of Kimi K3's 93 layers (tests/test_cli.py plans the full-size
# kimi-k3 in the exhaustive tier)
@pytest.mark.parametrize("command", ["info", pytest.param("plan", marks=pytest.mark.slow)])
def test_the_stand_in_is_labelled_where_its_bytes_print(capsys, command):
    text = run(capsys, command, "kimi-k3-rank")
    assert STAND_IN_LABEL in text and "mkresearch info kimi-k3 --ranks 32" in text


@pytest.fixture(scope="module")
def demo_decode():
    """`make demo`'s command, in this process (its compiled step serves the bench below): stdout."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["decode", "kimi-k3-mini", "--prompt-len", "2", "--steps", "2",
                         "--batch", "1", "--seed", "0"]) == 0
    return out.getvalue()


@pytest.mark.slow
def test_demo_decodes_with_the_megakernel(demo_decode):
    """`make demo`: the product — megakernel tokens, agreement with the reference, the step time
    here labelled as a simulator, and the full model's predicted TPU7x step beside the release's.
    (Here beside the full-size line's other checks: one compile of the mini's step for both.)"""
    import re
    from pathlib import Path

    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n\t(.*)$", makefile, re.MULTILINE).group(1)
    assert "mkresearch decode" in demo and "--backend reference" not in demo
    text = demo_decode
    assert "backend megakernel (one pallas_call per step)" in text
    assert "agreement with the reference backend: 2/2 tokens equal" in text and "PASS" in text
    assert "TPU interpret mode on CPU (a simulator)" in text
    # the last line: the full-size step (full_size.full_size_step), as info and predict print it
    assert re.fullmatch(r"full-size step \(kimi-k3 on 32 ranks of tpu7x, ours layout, partial-sum "
                        r"collectives \(each its own algorithm\), B=1\): [\d.]+ ms/step, [\d.]+ GB "
                        r"per rank "
                        r"per step \(timeline model prediction, not measured\); the release "
                        r"publishes 4\.02 ms", text.splitlines()[-1]), text


@pytest.mark.slow
def test_decode_and_bench_print_the_full_size_line_of_info_and_predict(capsys, tmp_path, kimi_32,
                                                                         demo_decode):
    """`make demo`'s last line is the full-size step, not the stand-in's scaled one."""
    ours = kimi_32["ours"].line()
    decode = demo_decode
    assert decode.splitlines()[-1] == ours and "kimi-k3-rank" not in decode
    bench = run(capsys, "bench", "kimi-k3-mini", "--batch", "1", "--steps", "1",
                "--out", str(tmp_path))
    assert ours in bench.splitlines() and "kimi-k3-rank" not in bench
    saved = json.loads((tmp_path / "decode_bench.json").read_text())["rows"][0]["full_size"]
    assert saved["line"] == ours and saved["step_s"] == kimi_32["ours"].step_s
