"""`python -m mkresearch`: decode --json works; bad input is one line on stderr and exit 2.

The commands run in this process (`cli.main`, what `python -m mkresearch` exits with): a child
per command would start Python and JAX again; the command itself runs in
test_bad_input_exits_2_from_the_command."""

import json
import subprocess
import sys

import pytest

from mkresearch.cli import main as cli


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mkresearch", *args], check=False,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_decode_json_and_text(capsys):
    assert cli.main(["decode", "kimi-k3-mini", "--prompt-len", "3", "--steps", "3", "--batch",
                     "2", "--seed", "1", "--backend", "reference", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)  # stdout is exactly one JSON object
    assert result["model"] == "kimi-k3-mini" and result["backend"] == "reference"
    assert len(result["prompt"]) == 2 and all(len(row) == 3 for row in result["prompt"])
    assert len(result["generated"]) == 2 and all(len(row) == 3 for row in result["generated"])
    assert all(0 <= t < 2048 for row in result["generated"] for t in row)
    assert result["parity"]["passed"] and result["parity"]["tokens_equal"] == 6
    assert result["tokens_per_s"] > 0
    # the text form of the same result: tokens, parity, timing
    from mkresearch.cli.decode import print_decode

    print_decode(result)
    text = capsys.readouterr().out
    assert "generated" in text and "parity:" in text and "PASS" in text and "tokens/s" in text


@pytest.mark.parametrize("args, reason", [
    (["decode", "--backend", "stages"], "'stages' is unknown: choose one of megakernel, reference"),
    (["decode", "--backend", "cuda"], "--backend 'cuda' is unknown"),
    (["decode", "kimi-k4"], "kimi-k3-mini"),  # lists the presets
    (["info", "llama"], "kimi-k3, kimi-k3-mini"),
    (["decode", "--steps", "-2"], "--steps"),
    (["decode", "--batch", "0"], "--batch"),
    (["decode", "--batch", "17"], "--batch 17 is invalid: each in [1, 16]"),
    (["decode", "--chip", "h100"], "--chip 'h100' is unknown"),
    (["decode", "--backend", "reference", "--chip", "nope"], "--chip 'nope' is unknown"),
    (["info", "kimi-k3-mini", "--context", "128"], "--context 128 is invalid: an int in [0, 127]"),
    (["info", "kimi-k3", "--context", "-1"], "--context -1 is invalid: an int in [0, 32767]"),
    (["decode", "--prompt-len", "0"], "--prompt-len"),
    (["decode", "--prompt-len", "200"], "max_seq_len"),
    (["decode", "--seed", "x"], "--seed"),
    (["decode", "kimi-k3"], "too many to decode here: use one of kimi-k3-mini, deepseek-v3-mini"),
    (["bench", "glm-4.5-rank"], "glm-4.5-rank has 22.47 GB of weights, too many to decode here"),
    (["info", "kimi-k3", "--batch", "0"], "--batch"),
    (["info", "kimi-k3", "--format", "int4"], "--format"),
    (["info", "kimi-k3", "--cache-layout", "paged"], "--cache-layout"),
    (["figures", "--only", "nope"], "--only"),
    (["plan", "llama"], "kimi-k3, kimi-k3-mini"),
    (["plan", "kimi-k3", "--batch", "17"], "--batch 17 is invalid: each in [1, 16]"),
    (["plan", "kimi-k3", "--chip", "h100"], "--chip 'h100' is unknown"),
    (["plan", "kimi-k3-mini", "--context", "128"], "--context 128 is invalid: an int in [0, 127]"),
    (["predict", "kimi-k3", "--context", "32768"], "--context 32768 is invalid: an int in [0, 32767]"),
    (["predict", "kimi-k3", "--designs", "--context", "-1"], "--context -1 is invalid"),
    (["plan", "kimi-k3", "--format", "released"], "--format"),
    (["plan", "kimi-k3", "--cache-layout", "paged"], "--cache-layout"),
    (["decode", "--ranks", "2", "--etp", "0"], "etp=0 is invalid for kimi-k3-mini on 2 ranks"),
    (["decode", "--ranks", "2", "--etp", "-2"], "etp=-2 is invalid for kimi-k3-mini on 2 ranks"),
    (["decode", "--collectives", "exact"], "--collectives exact is an option of --ranks N > 1"),
    (["decode", "--router", "host"], "--router host is an option of --ranks N > 1"),
    (["decode", "--ranks", "2", "--backend", "reference", "--router", "host"],
     "--router host is an option of the sharded megakernel"),
    (["decode", "--checkpoint", "nowhere", "--prompt", "a", "--prompt-len", "4"],
     "--prompt-len 4 is invalid with --checkpoint"),
    (["launch", "--processes", "2", "--port", "-1", "--", "info"], "--port -1 is invalid"),
    (["launch", "--processes", "2", "--port", "65536", "--", "info"], "--port 65536 is invalid"),
    (["launch", "--processes", "2", "--timeout", "0", "--", "info"], "--timeout 0 is invalid"),
    (["predict", "kimi-k3", "--json", "--explain"], "--json is invalid with --explain"),
    (["predict", "kimi-k3", "--json", "--validate"], "--json is invalid with --validate"),
    (["predict", "kimi-k3", "--acceptance", "2"], "--acceptance 2 is an option of --speculate K"),
    (["predict", "kimi-k3-mini"], "--ranks 32 (the default): n_ranks=32 is invalid for kimi"),
    (["predict", "kimi-k3-mini", "--ranks", "1", "--designs"], "--ranks must be an int >= 2"),
    (["plan", "kimi-k3-mini", "--collectives", "exact"], "--collectives exact is an option of"),
    (["plan", "kimi-k3-mini", "--wire", "bf16"], "--wire bf16 is an option of --ranks N"),
    (["plan", "kimi-k3", "--ranks", "32", "--collectives", "exact", "--wire", "bf16"],
     "--wire bf16 needs partial sums"),
    (["bench", "--slots", "4"], "--slots 4 is an option of --workload"),
    (["compile", "kimi-k3-mini", "--context", "48"], "a multiple of its KV tile of 32 tokens"),
    (["info", "qwen3-30b-a3b", "--cache-layout", "latent"], "it lays out MLA's cache"),
    (["decode", "glm-4.5-mini", "--cache-layout", "latent"], "it lays out MLA's cache"),
    (["decode", "deepseek-v3-mini", "--cache-layout", "expanded"],
     "MLA with RoPE caches the latent"),
    (["decode", "--format", "int4"], "--format"),
    (["frobnicate"], "frobnicate"),
    ([], "required"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, reason):
    """In this process: `cli.main` is what `python -m mkresearch` exits with (one child for every
    case started Python and JAX again; the command itself: the test below)."""
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err  # no traceback, no usage block
    assert reason in lines[0]
    assert captured.out == ""


@pytest.mark.parametrize("options, layout, expert_format", [
    ([], "expanded", "mxfp4"), (["--format", "fp8"], "expanded", "fp8"),
    (["--cache-layout", "latent", "--format", "bf16"], "latent", "bf16")])
def test_decode_builds_the_format_and_layout_asked_for(options, layout, expert_format):
    """decode --format / --cache-layout: the config decoded (every mini and format on a TPU:
    docs/tpu.md), the model's own where not given."""
    from mkresearch.cli.common import known_model, with_formats
    from mkresearch.cli.main import _parser

    args = _parser().parse_args(["decode", "kimi-k3-mini", *options])
    cfg = with_formats(known_model(args.model), args)
    assert (cfg.mla_cache_layout, cfg.expert_format) == (layout, expert_format)


@pytest.mark.slow
def test_bad_input_exits_2_from_the_command():
    done = run("decode", "--steps", "-2", timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--steps" in lines[0], done.stderr
    assert done.stdout == ""


def test_info_text(capsys):
    assert cli.main(["info", "kimi-k3-mini", "--batch", "4", "--context", "16"]) == 0
    out = capsys.readouterr().out
    assert "KKK MKK M" in out  # MLA at 3 and at the last layer, blocks of 3
    assert "routed experts" in out and "tokens/s" in out


def test_figures(tmp_path):
    assert cli.main(["figures", "--out", str(tmp_path), "--only", "roofline"]) == 0
    assert (tmp_path / "roofline.png").stat().st_size > 10_000


@pytest.mark.parametrize("command", [["figures", "--only", "roofline"], ["bench", "kimi-k3-mini"]])
def test_an_out_directory_that_cannot_be_made_is_one_line_before_any_work(tmp_path, capsys,
                                                                          command):
    """A file where --out's directory would be (root may write anywhere, so not a permission):
    refused before anything is drawn or benched (bench: minutes of steps)."""
    taken = tmp_path / "taken"
    taken.write_text("a file")
    for out in (taken, taken / "figures"):
        assert cli.main([*command, "--out", str(out)]) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and f"--out {str(out)!r} is invalid" in lines[0], captured.err
        assert captured.out == ""
    assert taken.read_text() == "a file"


# `make demo` (kimi-k3-mini's `decode` on the megakernel): tests/test_full_size.py, whose decode
# and bench of the same mini share its compiled step


@pytest.mark.parametrize("command", [["decode"], ["bench", "--batch", "1"]])
def test_chip_refusal_is_one_line_exit_2(monkeypatch, capsys, command):
    """A ValueError the library raises before running (here: a config over the chip's HBM) is
    one line on stderr and exit status 2, like bad input. No preset the CLI decodes is refused,
    so the megakernel entry points are swapped for the HBM check of kimi-k3-rank on --chip."""
    from mkresearch.cli import bench
    from mkresearch.cli import main as cli
    from mkresearch.model import roofline
    from mkresearch.model.config import get_config

    def refuse(cfg, *args, **kwargs):
        assert "v5e" in args  # --chip reaches the megakernel
        roofline.check_fits_hbm(get_config("kimi-k3-rank"), "v5e")

    monkeypatch.setattr(bench, "decode_megakernel", refuse)
    monkeypatch.setattr(bench, "run_bench", refuse)
    assert cli.main([*command, "--chip", "v5e"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "does not fit the HBM of one v5e device" in lines[0]


# ---- the other families (docs/families.md) -----------------------------------------------------
# The CLI's decode path is the same for every model (tests/test_families.py and
# tests/test_families_megakernel.py check each family's step): a family on the reference here, a
# family on the megakernel through `bench` below (and kimi-k3-mini's `decode` on the megakernel
# in tests/test_full_size.py); a family's `decode` on the megakernel is in the exhaustive tier
@pytest.mark.slow
@pytest.mark.parametrize("model, backend", [
    ("glm-4.5-mini", "reference"),
    pytest.param("deepseek-v3-mini", "megakernel", marks=pytest.mark.exhaustive)])
def test_decode_family_minis(capsys, model, backend):
    """`decode <family mini>`: tokens, parity (reference) or agreement (megakernel), and
    for the megakernel one rank of the full model predicted on TPU7x."""
    from mkresearch.cli import main as cli

    assert cli.main(["decode", model, "--prompt-len", "2", "--steps", "2", "--batch",
                     "2", "--backend", backend, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == model and result["backend"] == backend
    assert [len(row) for row in result["generated"]] == [2, 2]
    if backend == "reference":
        assert result["parity"]["passed"]
        return
    assert result["agreement"]["passed"] and result["agreement"]["max_abs_logit_diff"] <= 5e-2
    full = result["full_size"]  # full_size.full_size_step: the full model on 32 ranks, ours
    assert full["model"] == model.removesuffix("-mini") and full["step_s"] > 0
    assert (full["n_ranks"], full["layout"], full["collectives"]) == (32, "ours", "partial-sum")
    assert full["published_step_s"] is None  # only Kimi K3's release has a published number


@pytest.mark.slow
def test_bench_a_family_mini(tmp_path, capsys):
    from mkresearch.cli import main as cli

    assert cli.main(["bench", "qwen3-235b-a22b-mini", "--batch", "1", "--steps", "1",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "B=1: megakernel" in out
    assert ("full-size step (qwen3-235b-a22b on 32 ranks of tpu7x, ours layout, partial-sum"
            in out)
    result = json.loads((tmp_path / "decode_bench.json").read_text())
    assert result["model"] == "qwen3-235b-a22b-mini" and result["rows"][0]["prediction"]["step_s"] > 0
    full = result["rows"][0]["full_size"]  # the full model's step (full_size.full_size_step)
    assert full["model"] == "qwen3-235b-a22b" and full["published_step_s"] is None
    assert full["step_s"] > 0 and full["rank_bytes"] > 0


def test_compile_a_family_mini(capsys):
    from mkresearch.cli import main as cli

    assert cli.main(["compile", "glm-4.5-mini"]) == 0
    assert "1 Mosaic kernel(s)" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["deepseek-v3", "glm-4.5", "qwen3-235b-a22b", "deepseek-v3-rank",
                                   "glm-4.5-rank", "qwen3-235b-a22b-rank"])
def test_info_full_presets_and_their_ranks(capsys, model):
    from mkresearch.cli import main as cli

    assert cli.main(["info", model, "--context", "4096"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{model}: ") and "routed experts" in text and "tokens/s" in text


# ---- mkresearch plan: the schedule of one step, against the roofline -------------------------------
def expected_differences(cfg, batch, context):
    """What the kernel moves beyond roofline.step_bytes, by component (schedule_report.DIFFERENCES):
    each token's 16-row embedding block, not one row; the two norm gains of every layer as f32
    rows, not bf16; per MLA layer and row the KV rows rounded up to 16-row groups plus the new
    entry's 16-row block read, and that block written, not one row (a sliding window's from its
    first tile's start, beside the window's tokens)."""
    from mkresearch.kernels.base.kv_update import UPDATE_ROWS
    from mkresearch.kernels.compose.megakernel_plan import EMBED_ROWS

    from mkresearch.model import kv_cache, roofline, spec

    tokens = kv_cache.rows_read(context) - context + UPDATE_ROWS + (UPDATE_ROWS - 1)
    out = {"embedding_rows": batch * (EMBED_ROWS - 1) * cfg.d_model * 2,
           "norms_and_mix": cfg.n_layers * 2 * cfg.d_model * (4 - 2)}
    for kind in spec.stages_of(cfg):  # every kind with a cache: its bytes per token of a row
        per_token = roofline.state_bytes(cfg, kind, spec.CACHE)
        window = kind.window(cfg)  # a sliding window: read from its first tile's start
        first = max(0, context - window + 1) // cfg.kv_tile * cfg.kv_tile if window else 0
        counted = min(context, window) if window else context
        extra = kv_cache.rows_read(context) - first - counted + UPDATE_ROWS + (UPDATE_ROWS - 1)
        if per_token:
            out[kind.state_component[0]] = batch * (extra if window else tokens) * per_token
        if "router_bias" in kind.params(cfg) and not cfg.router_bias:  # stored, never read
            out[kind.component[0]] = -len(cfg.layers_of(kind.name)) * cfg.n_experts * 4
    return out


def assert_plan_matches_the_roofline(report, cfg, batch, context):
    from mkresearch.model import roofline

    comparison = report["roofline"]
    unique = min(cfg.n_experts, batch * cfg.top_k)
    assert comparison["context"] == context and comparison["unique_experts_per_layer"] == unique
    step = roofline.step_bytes(cfg, batch, context, unique_experts=unique)
    assert comparison["roofline_total"] == step.total
    assert comparison["schedule_total"] == report["hbm_bytes"]["total"]
    differing = {row["component"]: row["difference"] for row in comparison["components"]
                 if row["difference"]}
    assert differing == expected_differences(cfg, batch, context)  # every other one: equal
    assert all(row["why"] not in (None, "unexplained") for row in comparison["components"]
               if row["difference"])
    assert comparison["difference"] == sum(differing.values())


# `make test` plans every -mini (each family's, which exercise every feature), Kimi Linear
# (a real config of Kimi K3's layers, KDA + MLA, at full size: over one chip's HBM, the
# footprint's refusal branch, in 27 layers) and one small real model's config; the other
# full-size presets (Kimi K3's 93 layers, ~24 s here: `plan kimi-k3-rank` runs them in
# tests/test_full_size.py, the full-size kimi-k3's schedule in
# test_schedule.test_worst_case_is_the_cost_estimate), the ranks and the other real models'
# configs (~65 s here, the same code over other shapes) are the exhaustive tier's, as in
# test_schedule.test_worst_case_is_the_cost_estimate
PLANNED_IN_MAKE_TEST = ("kimi-linear-48b-a3b", "moonlight-16b-a3b")


def _plan_case(name):
    named = name in PLANNED_IN_MAKE_TEST or name.endswith("-mini")
    return pytest.param(name, marks=() if named else pytest.mark.exhaustive)


@pytest.mark.slow
@pytest.mark.parametrize("name", [_plan_case(name) for name in sorted(
    __import__("mkresearch.model.config").model.config.config_names())])
def test_plan_on_every_preset(capsys, name):
    """`mkresearch plan MODEL --json` from shapes (full models and their ranks too): one JSON
    object whose HBM bytes are the roofline's at the same assumptions (the last position, min(E, B·k)
    experts) plus the named differences, and no late prefetch. In this process (a subprocess
    per preset would import JAX a dozen times)."""
    from mkresearch.cli import main as cli
    from mkresearch.model.config import get_config

    assert cli.main(["plan", name, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = get_config(name)
    assert report["model"] == name and not report["exact"] and len(report["assumptions"]) == 2
    assert_plan_matches_the_roofline(report, cfg, 1, cfg.max_seq_len - 1)
    assert report["late_prefetches"] == {"ffn": [], "next_layer": [], "experts": []}
    assert report["ring"]["depth"] == cfg.ring_depth and report["kv_tile"] == cfg.kv_tile
    assert {b["name"] for b in report["vmem"]["buffers"]} >= {"weight ring", "LM head tiles"}
    from mkresearch.model import roofline

    assert report["hbm_footprint"]["fits"] == roofline.hbm_footprint(cfg, "tpu7x").fits()


@pytest.mark.slow
def test_plan_options_and_text(capsys):
    from mkresearch.model.config import get_config

    args = ["plan", "kimi-k3-mini", "--batch", "4", "--cache-layout", "latent", "--format", "fp8",
            "--context", "40"]
    assert cli.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = get_config("kimi-k3-mini", mla_cache_layout="latent", expert_format="fp8")
    assert report["positions"] == [40] * 4 and report["mla_cache_layout"] == "latent"
    assert_plan_matches_the_roofline(report, cfg, 4, 40)
    assert report["by_layer_kind"]["mla+moe"]["layers"] == 2
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    for line in ("kimi-k3-mini on tpu7x, B=4, MLA cache latent, experts fp8", "by stage",
                 "by layer kind", "by buffer", "weight ring: 3 slots",
                 "HBM bytes against roofline.step_bytes (context 40, 16 unique experts",
                 "VMEM plan for tpu7x"):
        assert line in text, line


def test_predict_shows_a_progress_bar_on_a_terminal_only(monkeypatch):
    """`predict` and `predict --designs` (~35 s a batch) show a bar on stderr when it is a
    terminal, over more than one item, unless the output is JSON."""
    import argparse
    import io

    from mkresearch.cli import predict

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    args = argparse.Namespace(json=False)
    assert list(predict._progress(args, [1, 2], "designs", "batch")) == [1, 2]
    assert "designs" in terminal.getvalue() and "2/2" in terminal.getvalue()
    for quiet, items in ((argparse.Namespace(json=True), [1, 2]), (args, [1])):
        assert predict._progress(quiet, items, "designs", "batch") is items
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    assert predict._progress(args, [1, 2], "designs", "batch") == [1, 2]
