"""mkresearch.model.config: every field validates itself; the presets match docs/kimi-k3.md §1."""

import dataclasses
import re

import pytest

from mkresearch.model.config import (
    EXPERT_FORMATS,
    LANE,
    MLA_CACHE_LAYOUTS,
    PRESETS,
    ModelConfig,
    get_config,
)

# One invalid value per field. A new field without an example here fails
# `test_every_field_has_an_invalid_example`: add one.
INVALID_VALUE = {
    "name": "",
    "d_model": 100,  # not a multiple of 128
    "n_layers": 0,
    "vocab_size": 1000,
    "n_heads": 0,
    "mla_first": -1,
    "mla_every": 0,
    "mla_last_layer": "yes",
    "kda_head_dim": 96,
    "kda_gate_rank": 0,
    "kda_conv_size": 0,
    "kda_decay_bound": 1.0,
    "mla_q_rank": 100,
    "mla_kv_rank": 500,
    "mla_qk_nope": 64,
    "mla_qk_extra": 0,
    "mla_v_dim": 100,
    "mla_cache_layout": "compressed",
    "n_dense_layers": -1,
    "dense_hidden": 1000,
    "n_experts": 0,
    "top_k": 10_000,  # more than n_experts
    "router_score": "relu",
    "router_bias": 1,  # an int, not a bool
    "routed_scale": 0.0,
    "expert_hidden": 100,
    "moe_latent": 100,
    "moe_latent_padded": 128,  # smaller than moe_latent
    "n_shared_experts": -1,
    "shared_hidden": 100,
    "activation": "gelu",
    "expert_format": "int8",
    "expert_mxu": "int8",
    "rms_eps": 0.0,
    "l2_eps": -1.0,
    "attn_res_block": 0,
    "logit_softcap": -1.0,
    "kv_tile": 10,  # not a multiple of the bf16 sublane tile (16)
    "max_seq_len": 100,  # not a multiple of kv_tile
    "ring_depth": 1,  # no slot to prefetch into
    "ring_block_bytes": 100_000,  # not a whole number of 64 KiB
    "attention": "kda mla",  # not a kind name
    "ffn": "",
    "residual": "post-norm",
    "n_kv_heads": 5,  # divides neither 96 nor 2 query heads
    "head_dim": 96,
    "attention_bias": 1,
    "qk_norm": "yes",
    "rope_theta": 0.0,
    "rope_partial": 0.3,  # 38.4 of 128 dims: not an even number of dims
    "yarn_factor": 0.5,
    "yarn_original_max_positions": 0,
    "yarn_beta_fast": 0.5,  # not above yarn_beta_slow
    "yarn_beta_slow": -1.0,
    "yarn_mscale": -1.0,
    "yarn_mscale_all_dim": float("inf"),
    "router_groups": 3,  # divides neither 896 nor 16 experts
    "router_topk_groups": 2,  # more than router_groups
    "router_normalize": None,
    "n_mtp_layers": -1,
    "kda_output_gate_rank": 100,  # not a multiple of 128
    "kda_decay": "exp",
    "mla_output_gate": "no",
    "d_model_checkpoint": 100,  # 7168 is not it rounded up to whole lanes
    "expert_hidden_checkpoint": -1,
    "sliding_window": -1,
    "swiglu_alpha": 0.0,
    "swiglu_limit": float("nan"),
    "expert_bias": 1,
    "yarn_truncate": "no",
}

FIELD_NAMES = [field.name for field in dataclasses.fields(ModelConfig)]


@pytest.mark.parametrize("field", FIELD_NAMES)
def test_every_field_has_an_invalid_example(field):
    if field not in INVALID_VALUE:
        pytest.fail(f"ModelConfig.{field} has no invalid example in INVALID_VALUE: add one")


@pytest.mark.parametrize("field", FIELD_NAMES)
@pytest.mark.parametrize("preset", ["kimi-k3", "kimi-k3-mini"])
def test_invalid_field_raises_value_error_naming_it(preset, field):
    if field not in INVALID_VALUE:
        pytest.skip("no example (reported by test_every_field_has_an_invalid_example)")
    with pytest.raises(ValueError) as raised:
        get_config(preset).replace(**{field: INVALID_VALUE[field]})
    # the field itself, not a longer name containing it (moe_latent vs moe_latent_padded)
    assert re.search(rf"\b{re.escape(field)}\b", str(raised.value)), str(raised.value)


@pytest.mark.parametrize("field", ["n_layers", "d_model", "top_k"])
def test_bool_is_not_an_int(field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        get_config("kimi-k3-mini").replace(**{field: True})


def test_presets_by_name():
    assert set(PRESETS) >= {"kimi-k3", "kimi-k3-mini"}
    for name, config in PRESETS.items():
        assert get_config(name) is config
        assert config.name == name
    latent = get_config("kimi-k3-mini", mla_cache_layout="latent")
    assert latent.mla_cache_layout == "latent" and latent.d_model == PRESETS["kimi-k3-mini"].d_model
    with pytest.raises(ValueError, match="kimi-k3-mini"):  # lists the presets
        get_config("kimi-k4")
    with pytest.raises(ValueError, match="mla_cache_layout"):
        get_config("kimi-k3", mla_cache_layout="paged")


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_config("kimi-k3").d_model = 1


def test_kimi_k3_is_spec_section_1():
    c = get_config("kimi-k3")
    assert (c.d_model, c.n_layers, c.vocab_size, c.n_heads) == (7168, 93, 163840, 96)
    assert c.mla_layers == tuple(range(3, 92, 4)) + (92,) and len(c.mla_layers) == 24
    assert len(c.kda_layers) == 69 and c.kda_layers[0] == 0
    assert c.dense_layers == (0,) and c.moe_layers == tuple(range(1, 93))
    assert c.dense_hidden == 33792
    assert (c.kda_head_dim, c.kda_width, c.kda_gate_rank, c.kda_conv_size) == (128, 12288, 128, 4)
    assert c.kda_decay_bound == -5
    assert (c.mla_q_rank, c.mla_kv_rank, c.mla_qk_nope, c.mla_qk_extra, c.mla_v_dim) == (
        1536, 512, 128, 64, 128)
    assert c.mla_qk_dim == 192 and c.mla_k_padded == 256 and c.mla_latent_cache_dim == 576
    assert (c.n_experts, c.top_k, c.router_score, c.router_bias, c.routed_scale) == (
        896, 16, "sigmoid", True, 1.0)
    assert (c.expert_hidden, c.moe_latent, c.moe_latent_padded) == (3072, 3584, 4096)
    assert c.n_shared_experts * c.expert_hidden == c.shared_hidden == 6144
    assert c.activation == "situ"
    assert (c.rms_eps, c.l2_eps) == (1e-5, 1e-6)
    assert c.attn_res_block == 12 and c.n_blocks == 8
    assert c.logit_softcap is None
    assert c.expert_format == "mxfp4"  # the checkpoint format of the routed experts (docs/kimi-k3.md §7)


def test_mini_exercises_every_feature():
    c = get_config("kimi-k3-mini")
    # KDA and MLA in one pattern: every `mla_every`-th from `mla_first`, plus the last layer
    assert c.mla_last_layer and c.n_layers - 1 in c.mla_layers
    assert c.mla_first in c.mla_layers and c.mla_first != c.n_layers - 1
    assert 0 in c.kda_layers and len(c.kda_layers) >= 2
    assert c.dense_layers == (0,) and len(c.moe_layers) == c.n_layers - 1
    assert c.n_blocks >= 3  # attention-residual snapshots R_0..R_2 at least
    assert c.moe_latent_padded > c.moe_latent  # padded latent
    assert c.n_shared_experts >= 1 and c.shared_hidden > 0
    assert c.router_score == "sigmoid" and c.router_bias
    assert c.activation == "situ"
    assert 1 < c.top_k < c.n_experts
    lane_dims = {
        "d_model": c.d_model, "vocab_size": c.vocab_size, "kda_head_dim": c.kda_head_dim,
        "kda_width": c.kda_width, "kda_gate_rank": c.kda_gate_rank, "mla_q_rank": c.mla_q_rank,
        "mla_kv_rank": c.mla_kv_rank, "mla_qk_nope": c.mla_qk_nope, "mla_v_dim": c.mla_v_dim,
        "mla_k_padded": c.mla_k_padded, "mla_latent_cache_dim": c.mla_latent_cache_dim,
        "dense_hidden": c.dense_hidden, "expert_hidden": c.expert_hidden,
        "moe_latent": c.moe_latent, "moe_latent_padded": c.moe_latent_padded,
        "shared_hidden": c.shared_hidden,
    }
    assert {k: v for k, v in lane_dims.items() if v % LANE} == {}
    assert c.max_seq_len % c.kv_tile == 0
    # small: a reference step must take well under a second on a CPU
    assert c.d_model <= 1024 and c.n_layers <= 8 and c.vocab_size <= 4096


@pytest.mark.parametrize("layout", MLA_CACHE_LAYOUTS)
@pytest.mark.parametrize("expert_format", EXPERT_FORMATS)
def test_mini_accepts_every_layout_and_format(layout, expert_format):
    c = get_config("kimi-k3-mini", mla_cache_layout=layout, expert_format=expert_format)
    assert (c.mla_cache_layout, c.expert_format) == (layout, expert_format)


def test_derived_indices():
    c = get_config("kimi-k3")
    assert c.attention_index(0) == 0 and c.attention_index(3) == 0 and c.attention_index(92) == 23
    assert c.attention_index(4) == 3  # KDA layers 0, 1, 2, 4
    assert c.ffn_index(0) == 0 and c.ffn_index(1) == 0 and c.ffn_index(92) == 91


def test_fp8_mxu_needs_quantised_experts():
    """expert_mxu="fp8" hands the MXU stored fp8 / MXFP4 values: bf16 experts are refused, naming
    the field and what it needs."""
    with pytest.raises(ValueError, match=r"expert_mxu='fp8' is invalid: .*'fp8' or 'mxfp4'"):
        get_config("kimi-k3-mini", expert_format="bf16", expert_mxu="fp8")
    assert get_config("kimi-k3-mini", expert_mxu="fp8").expert_mxu == "fp8"


def test_fields_kept_out_of_the_repr_show_only_when_set():
    """A config's repr keys recorded compiles: a field kept out of it at its default leaves the
    preset's repr as it was; set, it shows (an fp8-MXU build gets its own record)."""
    cfg = get_config("kimi-k3")
    assert "expert_mxu=" not in repr(cfg) and "kda_decay=" not in repr(cfg)
    assert "expert_mxu='fp8'" in repr(cfg.replace(expert_mxu="fp8"))
