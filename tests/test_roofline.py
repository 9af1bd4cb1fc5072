"""mkresearch.model.roofline and `mkresearch info`: bytes per decode step against docs/kimi-k3.md §10."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from mkresearch.hardware.chips import CHIPS
from mkresearch.model import roofline, weights
from mkresearch.model.config import get_config
from mkresearch.views import plots

GB = 1e9
# docs/kimi-k3.md §10: HBM bytes per token at B = 1, whole model, routed experts MXFP4
SPEC_GB = {"kda": 61.26, "mla": 11.15, "dense": 1.45, "moe_nonrouted": 34.95,
           "routed_experts": 25.83, "lm_head": 2.35}
SPEC_TOTAL_GB = 137.0
SPEC_RELEASED_TOTAL_GB = 152.4  # with the FP8 gate/up repack
SPEC_KDA_STATE_BYTES = 449e6  # read, and the same written
SPEC_MLA_EXPANDED, SPEC_MLA_LATENT = 1_769_472, 27_648


@pytest.fixture(scope="module")
def info_kimi_k3():
    """`mkresearch info kimi-k3 --json`, run as a user would."""
    done = subprocess.run([sys.executable, "-m", "mkresearch", "info", "kimi-k3", "--json"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_info_total_bytes_per_token_matches_spec(info_kimi_k3):
    step = info_kimi_k3["step_bytes"]
    assert (step["batch"], step["context"], step["expert_format"]) == (1, 0, "mxfp4")
    assert step["weights"] / GB == pytest.approx(SPEC_TOTAL_GB, rel=0.01)
    assert step["total"] / GB == pytest.approx(SPEC_TOTAL_GB, rel=0.01)  # + state, still < 1%


@pytest.mark.parametrize("component", SPEC_GB)
def test_info_component_bytes_match_spec(info_kimi_k3, component):
    assert info_kimi_k3["step_bytes"]["read"][component] / GB == pytest.approx(
        SPEC_GB[component], rel=0.01)


def test_info_state_and_cache_bytes(info_kimi_k3):
    step = info_kimi_k3["step_bytes"]
    assert step["read"]["kda_state"] == step["written"]["kda_state"]
    assert step["read"]["kda_state"] == pytest.approx(SPEC_KDA_STATE_BYTES, rel=0.01)
    assert step["read"]["mla_cache"] == 0  # context 0
    cache = info_kimi_k3["mla_cache_bytes_per_token"]
    assert (cache["expanded"], cache["latent"]) == (SPEC_MLA_EXPANDED, SPEC_MLA_LATENT)
    assert cache["ratio"] == 64


def test_info_parameters_and_pattern(info_kimi_k3):
    params = info_kimi_k3["parameters"]
    assert params["total"] == pytest.approx(2.78e12, rel=0.01)
    assert params["active"] == pytest.approx(104e9, rel=0.01)
    assert len(info_kimi_k3["mla_layers"]) == 24 and len(info_kimi_k3["kda_layers"]) == 69
    assert info_kimi_k3["layer_pattern"].replace(" ", "") == "".join(
        "M" if layer in info_kimi_k3["mla_layers"] else "K" for layer in range(93))


def test_latent_cache_reads_64x_fewer_bytes_per_context_token():
    cfg = get_config("kimi-k3")
    context = 4096
    reads = {layout: roofline.step_bytes(cfg, 1, context, mla_cache_layout=layout).read["mla_cache"]
             for layout in ("expanded", "latent")}
    assert reads["expanded"] == context * SPEC_MLA_EXPANDED
    assert reads["expanded"] == 64 * reads["latent"]


def test_released_repack_total():
    step = roofline.step_bytes(get_config("kimi-k3"), expert_format="released")
    assert step.weights / GB == pytest.approx(SPEC_RELEASED_TOTAL_GB, rel=0.01)
    # docs/kimi-k3.md §7: 28.04 MB per expert repacked vs 17.55 MB in MXFP4
    assert roofline.expert_bytes(get_config("kimi-k3"), "released") / 1e6 == pytest.approx(28.04, rel=0.005)
    assert roofline.expert_bytes(get_config("kimi-k3"), "mxfp4") / 1e6 == pytest.approx(17.55, rel=0.005)


def test_expected_unique_experts():
    assert roofline.expected_unique_experts(896, 16, 1) == pytest.approx(16)
    assert roofline.expected_unique_experts(896, 16, 10_000) == pytest.approx(896)
    # against a simulation of uniform top-k routing (k distinct experts per token)
    rng = np.random.default_rng(0)
    experts, top_k, batch = 16, 4, 5
    seen = [len({int(e) for _ in range(batch) for e in rng.choice(experts, top_k, replace=False)})
            for _ in range(4000)]
    assert np.mean(seen) == pytest.approx(
        roofline.expected_unique_experts(experts, top_k, batch), rel=0.02)


def test_shapes_are_the_real_arrays():
    """The byte counts use param_shapes; the arrays init_params builds have the same bytes."""
    from mkresearch.model.weights import init_params

    cfg = get_config("kimi-k3-mini")
    params = init_params(cfg, 0)
    assert roofline.tree_bytes(params) == roofline.tree_bytes(weights.param_shapes(cfg))
    step = roofline.step_bytes(cfg, batch=1)
    unselected = len(cfg.moe_layers) * (cfg.n_experts - cfg.top_k) * roofline.expert_bytes(cfg)
    one_row = cfg.d_model * 2
    assert step.weights == roofline.tree_bytes(params) - roofline.tree_bytes(params["embed"]) \
        + one_row - unselected


def test_decode_floor_and_table():
    cfg = get_config("kimi-k3")
    floor = roofline.decode_floor(cfg, "tpu7x", batch=1)
    step = roofline.step_bytes(cfg)
    chip = CHIPS["tpu7x"]
    assert floor.seconds == pytest.approx(step.total / (2 * chip.hbm_bandwidth))  # 2 cores/chip
    assert floor.tokens_per_s == pytest.approx(1 / floor.seconds)
    rows = roofline.roofline_table(cfg)
    assert len(rows) == 4 * 9 and {r["chip"] for r in rows} == {"v5e", "v6e", "v5p", "tpu7x"}
    assert all(r["memory_bound"] for r in rows)  # decode is memory-bound up to B = 256
    for chip_name in ("v5e", "v6e", "v5p", "tpu7x"):
        rates = [r["tokens_per_s"] for r in rows if r["chip"] == chip_name]
        assert rates == sorted(rates)  # batching amortises the weights
    # the published 16-chip TPU7x throughputs stay below the computed 16-chip floor
    for batch, published in roofline.PUBLISHED_TPU7X_16_CHIPS.items():
        bound = roofline.decode_floor(cfg, "tpu7x", batch, roofline.ROOFLINE_CONTEXT, n_chips=16)
        assert published < bound.tokens_per_s


def test_hbm_footprint_counts_every_weight_cache_and_state():
    """Bytes from param_shapes and init_state shapes, which the arrays really have (mini)."""
    from mkresearch.model.reference import init_state
    from mkresearch.model.weights import init_params

    cfg = get_config("kimi-k3-mini")
    footprint = roofline.check_fits_hbm(cfg, "v5e", batch=2, seq_len=64)
    assert footprint.weights == roofline.tree_bytes(init_params(cfg, 0))
    assert footprint.states == roofline.tree_bytes(init_state(cfg, 2, 64))
    assert footprint.available == CHIPS["v5e"].hbm_bytes and footprint.fits()
    assert roofline.hbm_footprint(cfg, "v5e").seq_len == cfg.max_seq_len


@pytest.mark.parametrize("chip, fits", [("v5e", False), ("v6e", False), ("v5p", True),
                                        ("tpu7x", True)])
def test_one_rank_fits_the_hbm_of_v5p_and_tpu7x_only(chip, fits):
    """kimi-k3-rank holds ≈ 61 GB at B = 1 (MXFP4 experts, 32768-token cache): over the 17 / 34 GB
    of a v5e / v6e device, under the ≈ 103 GB of a v5p / TPU7x device."""
    cfg = get_config("kimi-k3-rank")
    footprint = roofline.hbm_footprint(cfg, chip)
    assert 60 * GB < footprint.needed < 62 * GB and footprint.fits() == fits
    if fits:
        assert roofline.check_fits_hbm(cfg, chip) == footprint
    else:
        with pytest.raises(ValueError, match=rf"one {chip} device: it needs "
                                             rf"{footprint.needed:,d} B .* but {chip} has "
                                             rf"{footprint.available:,d} B"):
            roofline.check_fits_hbm(cfg, chip)


@pytest.mark.parametrize("kwargs, name", [
    ({"batch": 0}, "batch"), ({"context": -1}, "context"), ({"expert_format": "int4"}, "expert_format"),
    ({"mla_cache_layout": "paged"}, "mla_cache_layout"),
])
def test_bad_input_names_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        roofline.step_bytes(get_config("kimi-k3-mini"), **kwargs)


def test_bad_chip_and_n_chips():
    cfg = get_config("kimi-k3-mini")
    with pytest.raises(ValueError, match="chip"):
        roofline.decode_floor(cfg, "v4")
    with pytest.raises(ValueError, match="n_chips"):
        roofline.decode_floor(cfg, "v5e", n_chips=0)


def test_plot_roofline(tmp_path):
    path = tmp_path / "roofline.png"
    plots.plot_roofline(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_unique_experts_formula_is_not_typed_in():
    cfg = get_config("kimi-k3")
    step = roofline.step_bytes(cfg, batch=8)
    expected = cfg.n_experts * (1 - (1 - cfg.top_k / cfg.n_experts) ** 8)
    assert step.unique_experts_per_layer == pytest.approx(expected)
    assert step.read["routed_experts"] == round(
        len(cfg.moe_layers) * expected * roofline.expert_bytes(cfg))
    assert math.isclose(step.read["embedding_rows"], 8 * cfg.d_model * 2)


def test_step_bytes_at_a_given_count_of_unique_experts():
    """unique_experts prices that many distinct experts per MoE layer (a schedule's worst case,
    min(E, B·k)) instead of the expectation under uniform routing; the rest is unchanged."""
    cfg = get_config("kimi-k3")
    uniform, worst = roofline.step_bytes(cfg, 4), roofline.step_bytes(cfg, 4, unique_experts=64)
    assert worst.unique_experts_per_layer == 64 < cfg.n_experts
    assert worst.read["routed_experts"] == len(cfg.moe_layers) * 64 * roofline.expert_bytes(cfg)
    assert {k: v for k, v in worst.read.items() if k != "routed_experts"} == {
        k: v for k, v in uniform.read.items() if k != "routed_experts"}
    for bad in (-1, cfg.n_experts + 1, "16", True):
        with pytest.raises(ValueError, match=r"unique_experts=.* is invalid: a number in \[0, "
                                             r"n_experts=896\]"):
            roofline.step_bytes(cfg, 4, unique_experts=bad)
