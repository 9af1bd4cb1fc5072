"""The other families (DeepSeek-V3, GLM-4.5, Qwen3-235B) sharded: the sharded megakernel on each
mini against the single-device one (tests/sharded/test_families_decode.py, in a child process with
8 simulated CPU devices), each full preset's sharded step compiled for the 32 cores of tpu7x:2x2x4
(recorded: `make recorded`), and rank counts that do not split them."""

import json

import pytest
from test_sharded import check_recorded_compile, run_sharded

from mkresearch.cli import main as cli
from mkresearch.measurement import recorded
from mkresearch.model import config
from mkresearch.sharding import layout, layout_bytes

FAMILIES = ("deepseek-v3", "glm-4.5", "qwen3-235b-a22b")


@pytest.mark.slow
@pytest.mark.exhaustive
def test_families_sharded_on_simulated_devices():
    """Each family's mini: 2 greedy steps sharded (2 or 8 ranks) equal the single-device
    megakernel's tokens, logits and cache slices to the bit; per-rank DMA bytes = the layout's
    (~2.3 min on 2 shared cores, interpret mode with the race detector)."""
    run_sharded(timeout=900, files=("test_families_decode.py",))


@pytest.mark.parametrize("model, n_ranks, name, batch, chip",
                         [r for r in recorded.RECORDED_SHARDED if r[0] in FAMILIES])
def test_full_size_compile_one_mosaic_kernel_per_rank(model, n_ranks, name, batch, chip):
    """Each full preset sharded over the 32 TPU7x cores of tpu7x:2x2x4 with our layout: one Mosaic
    kernel per rank, a VMEM plan within the core's limit (the committed record, checked against
    the plan; `make recorded` re-records it)."""
    check_recorded_compile(model, n_ranks, name, batch, chip)


def test_every_family_is_recorded_on_32_cores():
    assert {r[0] for r in recorded.RECORDED_SHARDED if r[1] == 32} >= set(FAMILIES)


@pytest.mark.parametrize("model, n_ranks, field", [
    ("deepseek-v3", 3, "n_heads=128"), ("deepseek-v3", 128, "vocab_size=129280"),
    ("glm-4.5", 12, "n_kv_heads=8"), ("glm-4.5", 48, "n_experts=160"),
    ("qwen3-235b-a22b", 3, "n_heads=64"), ("qwen3-235b-a22b-mini", 32, "vocab_size=2048")])
def test_rank_count_that_does_not_split_a_family_is_refused(model, n_ranks, field):
    cfg = config.get_config(model)
    allowed = ", ".join(map(str, layout.allowed_ranks(cfg)))
    with pytest.raises(ValueError, match=rf"n_ranks={n_ranks} is invalid for {cfg.name}: .*"
                                         rf"{field}.*\(allowed rank counts: {allowed}\)"):
        layout.layout(cfg, n_ranks)


@pytest.mark.parametrize("model", FAMILIES)
def test_full_presets_split_32_ways_with_every_rule(model):
    """Every parameter and state leaf has a rule; 32 ranks split heads (GQA's K/V heads with
    their query heads, replicated when fewer), the vocabulary (padded to whole lane tiles) and
    the experts as EP 8 x ETP 4; '<model>-rank' is the release layout's rank."""
    cfg = config.get_config(model)
    assert layout.has_rules(cfg) and 32 in layout.allowed_ranks(cfg)
    lay = layout.layout(cfg, 32)
    assert (lay.ep, lay.etp) == (8, 4)
    assert config.get_config(f"{model}-rank") == layout.rank_config(cfg)


@pytest.mark.parametrize("model", FAMILIES)
def test_predict_a_family_above_its_hbm_floor(model, capsys):
    """`mkresearch predict MODEL --ranks 32`: the timeline over every rank predicts a step above
    the slowest rank's HBM floor (its bytes over one TPU7x core's bandwidth)."""
    assert cli.main(["predict", model, "--ranks", "32", "--batch", "1", "--rank-layout", "ours",
                     "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["predictions"]
    cfg = config.get_config(model)
    # the default: our partial-sum collectives, and the shapes that kernel streams
    counted = layout_bytes.rank_bytes(layout.layout(cfg, 32, collectives="partial-sum"), 1)
    floor = counted.floor_s("tpu7x")
    print(f"{model}: predicted {row['step_s'] * 1e3:.2f} ms per step on 32 TPU7x cores, HBM "
          f"floor {floor * 1e3:.3f} ms, {row['collectives_per_rank']} collectives per rank")
    assert row["step_s"] > floor > 0 and row["rank_bytes"] == counted.total


@pytest.mark.parametrize("model", FAMILIES)
def test_info_ranks_for_a_family(model, capsys):
    assert cli.main(["info", model, "--ranks", "32"]) == 0
    out = capsys.readouterr().out
    assert f"{model} on 32 ranks, per rank and step" in out and "tpu7x  ours" in out
    assert cli.main(["info", model, "--ranks", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "n_ranks=3 is invalid" in err[0]


@pytest.mark.slow  # a full-size compile for 32 cores (~11 s)
def test_glm_compiles_live_on_32_cores():
    """One family compiled here, not read from a record (GLM-4.5: ~8 s on 2 cores): one Mosaic
    kernel per rank, as its record says."""
    result, plan, where = recorded.sharded_compile_or_recorded("glm-4.5", 32, "ours", 1, "tpu7x",
                                                               recompile=True)
    print(f"glm-4.5 on 32 cores compiled here in {result.seconds:.1f} s: "
          f"{result.n_mosaic_kernels} Mosaic kernel per rank, VMEM "
          f"{plan.mega.vmem.total_bytes / 2**20:.2f} MiB")
    assert where == "compiled here" and result.n_mosaic_kernels == 1 and plan.mega.vmem.fits()
