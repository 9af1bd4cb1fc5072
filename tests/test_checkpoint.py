"""Checkpoints in the published layouts (mkresearch.checkpoint, docs/checkpoints.md): written from
`weights.init_params`, read back (names, dtypes, several shards with an index, FP8 128 x 128 block
scales), and every bad input refused with one line naming the tensor or field.

Round trips: bf16 checkpoints load bit-equal to the parameters they were written from (the expert
formats' pack∘unpack∘pack = pack makes FP8 / MXFP4 experts round-trip too), so the logits are the
same; DeepSeek's FP8 release format loses what FP8 e4m3 loses: logits within FP8_LOGIT_BOUND.
"""

import copy
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkresearch.checkpoint import loader as checkpoint
from mkresearch.checkpoint import safetensors_io
from mkresearch.model import config, reference, weights
from mkresearch.model.config import get_config
from mkresearch.sharding import layout

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

FAMILIES = ("deepseek-v3-mini", "glm-4.5-mini", "qwen3-235b-a22b-mini")
FP8_LOGIT_BOUND = 0.25  # relative RMS logit difference after every projection went through FP8
# e4m3 (~2.6 % RMS error per matrix; a routing choice it flips moves a row by O(1))


@pytest.fixture(scope="module")
def family_params():
    return {name: weights.init_params(config.get_config(name), 0) for name in FAMILIES}


def _written(tmp_path, name, params, tag="", **kwargs):
    directory = str(tmp_path / (name + tag))
    checkpoint.write_checkpoint(directory, params, config.get_config(name), **kwargs)
    return directory


def _expected(params, cfg):
    """init_params without what a checkpoint does not carry (Qwen3's unused correction bias)."""
    if not cfg.router_bias and "moe_full" in params:
        params = {**params, "moe_full": {**params["moe_full"],
                                         "router_bias": jnp.zeros_like(params["moe_full"]["router_bias"])}}
    return params


def _equal(a, b):
    return all(jax.tree.leaves(jax.tree.map(
        lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.slow
def test_published_layout_round_trip(tmp_path, family_params, name):
    cfg, params = config.get_config(name), family_params[name]
    directory = _written(tmp_path, name, params, shards=3)
    files = sorted(os.listdir(directory))
    assert safetensors_io.INDEX_FILE in files and len([f for f in files if f.endswith(".safetensors")]) == 3
    shards = safetensors_io.Shards(directory)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in shards.names()
    assert shards.dtype("model.embed_tokens.weight") == "BF16"
    read = checkpoint.read_config(directory, name=name, kv_tile=cfg.kv_tile,
                                  max_seq_len=cfg.max_seq_len, expert_format=cfg.expert_format)
    used = ("d_model", "n_layers", "vocab_size", "n_heads", "attention", "ffn", "residual",
            "n_experts", "top_k", "expert_hidden", "router_score", "router_bias", "routed_scale",
            "router_groups", "router_topk_groups", "router_normalize", "n_shared_experts",
            "rms_eps", "rope_theta", "rope_partial", "n_kv_heads", "head_dim", "qk_norm",
            "attention_bias", "yarn_factor", "yarn_mscale_all_dim", "mla_q_rank", "mla_kv_rank",
            "n_dense_layers")
    assert {f: getattr(read, f) for f in used} == {f: getattr(cfg, f) for f in used}
    loaded = checkpoint.load_params(directory, read, progress=False)
    assert _equal(loaded, _expected(params, cfg)), name


@pytest.fixture(scope="module")
def deepseek_fp8_dir(tmp_path_factory, family_params):
    """DeepSeek-V3's mini as its FP8 release, in 2 shards: written once, only read by the tests."""
    name = "deepseek-v3-mini"
    return _written(tmp_path_factory.mktemp("release"), name, family_params[name], "-fp8",
                    shards=2, fp8=True)


@pytest.mark.slow
def test_same_logits_and_fp8_block_scales(tmp_path, family_params, deepseek_fp8_dir):
    name = "deepseek-v3-mini"
    cfg, params = config.get_config(name), family_params[name]
    bf16_dir = _written(tmp_path, name, params, "-bf16", shards=2)
    fp8_dir = deepseek_fp8_dir
    with open(os.path.join(fp8_dir, "config.json")) as handle:
        raw = json.load(handle)
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    shards = safetensors_io.Shards(fp8_dir)
    name_q = "model.layers.1.self_attn.q_b_proj.weight"
    assert shards.dtype(name_q) == "F8_E4M3" and shards.dtype(name_q + "_scale_inv") == "F32"
    assert shards.shape(name_q + "_scale_inv") == (-(-shards.shape(name_q)[0] // 128), 2)
    tokens, positions = jnp.asarray([5, 9]), jnp.asarray([0, 0])
    state = reference.init_state(cfg, 2)
    want = reference.decode_step(params, state, tokens, positions, cfg)[0]
    got = reference.decode_step(checkpoint.load_params(bf16_dir, cfg, progress=False), state,
                                tokens, positions, cfg)[0]
    assert np.array_equal(np.asarray(got), np.asarray(want))
    stats = {}
    fp8 = checkpoint.load_params(fp8_dir, cfg, progress=False, stats=stats)
    # the loaded weight is the FP8 values times their block scales, transposed, rounded to bf16
    published = np.asarray(params["mla_rope"]["w_kvb"][1], np.float32).T  # [out, in]
    values, scale_inv = safetensors_io.fp8_quantize(published)
    want_w = jnp.asarray(safetensors_io.fp8_dequantize(values, scale_inv).T, jnp.bfloat16)
    assert np.array_equal(np.asarray(fp8["mla_rope"]["w_kvb"][1]), np.asarray(want_w))
    logits = reference.decode_step(fp8, state, tokens, positions, cfg)[0]
    rel = float(jnp.sqrt(jnp.mean((logits - want) ** 2) / jnp.mean(want ** 2)))
    print(f"\nFP8 release -> logits' relative RMS difference {rel:.4f} (bound {FP8_LOGIT_BOUND}, "
          f"max |diff| {float(jnp.max(jnp.abs(logits - want))):.3f}); FP8 e4m3 -> our fp8 "
          f"experts: {stats}")
    assert 0 < rel <= FP8_LOGIT_BOUND
    assert 0 < stats["expert_rel_rms"] < 0.05


# fp8's error is also stated by test_same_logits_and_fp8_block_scales; bf16's is a rounding
@pytest.mark.parametrize("fmt, bound", [pytest.param("bf16", 2.0 ** -8, marks=pytest.mark.exhaustive),
                                        pytest.param("fp8", 0.05, marks=pytest.mark.exhaustive),
                                        ("mxfp4", 0.2)])
def test_expert_conversion_error_is_stated(deepseek_fp8_dir, fmt, bound):
    """FP8 release experts into each of our formats: the error measured against the checkpoint's
    own values (f32, block scales applied)."""
    name = "deepseek-v3-mini"
    directory = deepseek_fp8_dir
    stats = {}
    checkpoint.load_params(directory, config.get_config(name), expert_format=fmt, progress=False,
                           stats=stats)
    print(f"\n{fmt}: {stats}")
    assert stats["expert_rel_rms"] <= bound


def test_ranks(tmp_path, family_params):
    name = "glm-4.5-mini"
    cfg = config.get_config(name)
    directory = _written(tmp_path, name, family_params[name])
    sharded = checkpoint.load_params(directory, cfg, ranks=2, progress=False)
    want = layout.shard_params(family_params[name], layout.layout(cfg, 2))
    assert _equal(sharded, want)


# ---- bad input: one line naming the tensor or field ------------------------------------------
def _rewrite(directory, change):
    """The single-file checkpoint's tensors passed through change(dict) and written back."""
    path = os.path.join(directory, safetensors_io.SINGLE_FILE)
    shards = safetensors_io.Shards(directory)
    tensors = {n: shards.read(n) for n in sorted(shards.names())}
    change(tensors)
    safetensors_io.write_file(path, tensors)


def _refused(directory, cfg, pattern):
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.load_params(directory, cfg, progress=False)
    message = str(caught.value)
    assert "\n" not in message and re.search(pattern, message), message
    return message


@pytest.mark.parametrize("name", FAMILIES)
def test_missing_or_extra_tensor_fails(tmp_path, family_params, name):
    cfg = config.get_config(name)
    directory = _written(tmp_path, name, family_params[name])
    victim = "model.layers.0.self_attn.o_proj.weight"
    _rewrite(directory, lambda t: t.pop(victim))
    _refused(directory, cfg, rf"tensor {re.escape(victim)} is missing: expected \[")
    directory = _written(tmp_path, name, family_params[name], "-extra")
    _rewrite(directory, lambda t: t.update({"model.layers.1.mlp.bogus.weight": np.zeros(4, np.float32)}))
    _refused(directory, cfg, r"tensor model\.layers\.1\.mlp\.bogus\.weight is unexpected")


def test_mtp_module_tensors_are_left_unread(tmp_path, family_params):
    """DeepSeek-V3 publishes its MTP module as the layer after the last: not an extra tensor."""
    name = "deepseek-v3-mini"
    cfg = config.get_config(name)
    directory = _written(tmp_path, name, family_params[name])
    mtp = f"model.layers.{cfg.n_layers}.eh_proj.weight"
    _rewrite(directory, lambda t: t.update({mtp: np.zeros((4, 4), np.float32)}))
    assert _equal(checkpoint.load_params(directory, cfg, progress=False), family_params[name])
    _rewrite(directory, lambda t: t.update({f"model.layers.{cfg.n_layers + 1}.x": np.zeros(1, np.float32)}))
    _refused(directory, cfg, rf"tensor model\.layers\.{cfg.n_layers + 1}\.x is unexpected")


def test_bad_inputs_each_one_line(tmp_path, family_params):
    name = "qwen3-235b-a22b-mini"
    cfg, params = config.get_config(name), family_params[name]
    directory = _written(tmp_path, name, params, "-shape")
    tensor = "model.layers.0.mlp.gate.weight"
    _rewrite(directory, lambda t: t.update({tensor: t[tensor][:, :128]}))
    _refused(directory, cfg, rf"tensor {re.escape(tensor)} has shape \[16, 128\]: expected \[16, 512\]")
    directory = _written(tmp_path, name, params, "-dtype")
    _rewrite(directory, lambda t: t.update({tensor: t[tensor].astype(np.int32)}))
    _refused(directory, cfg, rf"tensor {re.escape(tensor)} has dtype I32: expected one of BF16")
    directory = _written(tmp_path, name, params, "-truncated")
    path = os.path.join(directory, safetensors_io.SINGLE_FILE)
    os.truncate(path, os.path.getsize(path) - 1000)
    _refused(directory, cfg, r"model\.safetensors: truncated: tensor .* ends at byte")
    directory = _written(tmp_path, name, params, "-shard", shards=2)
    os.remove(os.path.join(directory, "model-00002-of-00002.safetensors"))
    _refused(directory, cfg, r"model-00002-of-00002\.safetensors: missing shard")
    directory = _written(tmp_path, name, params, "-quant")
    with open(os.path.join(directory, "config.json")) as handle:
        raw = json.load(handle)
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(raw, handle)
    _refused(directory, cfg, r"quantization_config\.quant_method='gptq' is not supported")
    directory = _written(tmp_path, name, params, "-no-hidden-size")
    with open(os.path.join(directory, "config.json")) as handle:
        raw = json.load(handle)
    del raw["hidden_size"]  # read as transformers' default: the tensors do not fit it
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(raw, handle)
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.check_checkpoint(directory)
    assert "\n" not in str(caught.value)
    assert re.search(r"has shape \[.*\]: expected \[.*\] \(config\.json leaves out "
                     r"hidden_size=2048: read as transformers' defaults for model_type "
                     r"'qwen3_moe'\)$", str(caught.value)), str(caught.value)


def test_missing_block_scales(tmp_path, family_params):
    name = "deepseek-v3-mini"
    directory = _written(tmp_path, name, family_params[name], fp8=True)
    victim = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    _rewrite(directory, lambda t: t.pop(victim))
    _refused(directory, config.get_config(name), rf"tensor {re.escape(victim)} is missing: "
             r"expected \[2, 4\] F32 \(FP8 block scales\)")


@pytest.mark.parametrize("change, pattern", [
    ({"model_type": "llama"}, r"model_type='llama' is not supported: one of 'deepseek_v3'"),
    ({"model_type": "kimi_linear"}, r"field 'linear_attn_config' is missing \(model_type 'kimi_li"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported: one of 'silu'"),
    ({"tie_word_embeddings": True}, r"tie_word_embeddings=True is not supported"),
    ({"q_lora_rank": 100}, r"ModelConfig.mla_q_rank=100 is invalid: 0 \(no query LoRA\)"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_scaling.type='dynamic'"),
    ({"n_group": 3}, r"config.json \(model_type 'deepseek_v3'\): ModelConfig.router_groups=3"),
])
def test_config_refusals_name_the_field(change, pattern):
    raw = checkpoint.config_dict(config.get_config("deepseek-v3-mini"))
    with pytest.raises(checkpoint.CheckpointError, match=pattern) as caught:
        checkpoint.config_from_dict({**raw, **change})
    assert "\n" not in str(caught.value)


def test_hf_extra_is_pinned_in_the_constraints():
    import tomllib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as handle:
        extras = tomllib.load(handle)["project"]["optional-dependencies"]
    with open(os.path.join(root, "requirements", "constraints.txt")) as handle:
        constraints = handle.read().split()
    assert extras["hf"] and all(r in constraints for r in extras["hf"])


def test_small_real_model_presets():
    """Qwen3-30B-A3B, GLM-4.5-Air and Moonlight-16B-A3B from their published config.json fields:
    the totals the model cards give (30.5 B / 106 B / 16 B; active 3.3 B with the embedding / 12 B
    without the head / 3 B with the embedding)."""
    from mkresearch.model import roofline
    qwen, glm = get_config("qwen3-30b-a3b"), get_config("glm-4.5-air")
    assert (qwen.attention, qwen.n_kv_heads, qwen.router_score, qwen.n_shared_experts) == (
        "gqa", 4, "softmax", 0)
    assert (glm.rope_dim, glm.attention_bias, glm.qk_norm, glm.n_dense_layers) == (64, True, False, 1)
    assert glm.dense_hidden == 11008  # 10944 rounded up to 128 lanes, zero-padded at load
    total, active = roofline.parameter_counts(qwen)
    embed = qwen.vocab_size * qwen.d_model
    assert round(total / 1e9, 1) == 30.5 and round((active + embed) / 1e9, 1) == 3.4
    total, active = roofline.parameter_counts(glm)
    assert round(total / 1e9) == 107 and round((active - glm.vocab_size * glm.d_model) / 1e9) == 12
    moonlight = get_config("moonlight-16b-a3b")
    assert (moonlight.attention, moonlight.mla_q_rank, moonlight.router_groups,
            moonlight.n_mtp_layers, moonlight.yarn_factor) == ("mla_rope", 0, 1, 0, 1.0)
    total, active = roofline.parameter_counts(moonlight)
    embed = moonlight.vocab_size * moonlight.d_model
    assert round(total / 1e9) == 16 and round((active + embed) / 1e9) == 3  # 15.96 B, 2.91 B
    raw = checkpoint.config_dict(moonlight)  # q_lora_rank null, as published, and back
    assert raw["q_lora_rank"] is None
    assert checkpoint.config_from_dict(raw, moonlight.name, kv_tile=moonlight.kv_tile) == moonlight


def test_dense_hidden_off_the_lane_grid_is_zero_padded(tmp_path, family_params):
    """A published intermediate_size that is no multiple of 128 (GLM-4.5-Air's 10944) loads into
    the next multiple, the extra hidden units zero: the layer's output is unchanged."""
    name, published = "glm-4.5-mini", 1000
    directory = _written(tmp_path, name, family_params[name])
    with open(os.path.join(directory, "config.json")) as handle:
        raw = json.load(handle)
    raw["intermediate_size"] = published
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(raw, handle)
    prefix = "model.layers.0.mlp."

    def cut(tensors):
        for proj in ("gate_proj", "up_proj"):
            tensors[f"{prefix}{proj}.weight"] = tensors[f"{prefix}{proj}.weight"][:published]
        tensors[f"{prefix}down_proj.weight"] = tensors[f"{prefix}down_proj.weight"][:, :published]
    _rewrite(directory, cut)
    cfg = checkpoint.read_config(directory)
    assert cfg.dense_hidden == 1024
    loaded = checkpoint.load_params(directory, cfg, progress=False)
    want = np.asarray(family_params[name]["dense"]["w_gate"][0])
    got = np.asarray(loaded["dense"]["w_gate"][0])
    assert np.array_equal(got[:, :published], want[:, :published]) and not got[:, published:].any()
    assert not np.asarray(loaded["dense"]["w_down"][0])[published:].any()


def test_kimi_k3_config_round_trip():
    """Kimi K3 has no public config.json: ours (`model_type: kimi_k3`) reads back to every field
    (Kimi Linear's published one: tests/test_kimi_linear.py)."""
    cfg = config.get_config("kimi-k3-mini")
    assert checkpoint.config_from_dict(checkpoint.config_dict(cfg), cfg.name) == cfg


def test_command_line_check_exits_non_zero_with_one_line(tmp_path, family_params, capsys):
    from mkresearch.checkpoint.__main__ import main
    name = "qwen3-235b-a22b-mini"
    directory = _written(tmp_path, name, family_params[name], shards=2)
    assert main([directory]) == 0 and capsys.readouterr().out.startswith("ok: ")
    os.remove(os.path.join(directory, "model-00001-of-00002.safetensors"))
    assert main([directory]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model-00001-of-00002.safetensors: missing shard" in err


# ---- config.json fields of the wrong type, or missing: a config or one line naming the field ----
def _family_raws():
    """A config.json of each model type we read (Kimi Linear's mini: tests/test_kimi_linear.py),
    DeepSeek-V3's with YaRN and FP8 (the nested fields too)."""
    from test_kimi_linear import mini_raw
    raws = {name: checkpoint.config_dict(config.get_config(name)) for name in FAMILIES}
    raws["deepseek-v3-mini"] = checkpoint.config_dict(config.get_config("deepseek-v3-mini"),
                                                      fp8=True)
    raws["kimi-linear-mini"] = mini_raw()
    assert "rope_scaling" in raws["deepseek-v3-mini"]  # the mini's YaRN
    return raws


def _paths(raw, prefix=()):
    """Every field of raw, nested objects' fields as (parent, field) paths too."""
    for key, value in raw.items():
        yield (*prefix, key)
        if isinstance(value, dict):
            yield from _paths(value, (*prefix, key))


def _with(raw, path, value):
    """A deep copy of raw with the field at `path` set to value (or removed: value is _DROP)."""
    out = copy.deepcopy(raw)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is _DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


_DROP = object()
WRONG_TYPES = ("three", [256], {"x": 1}, True, 2.5)


def _read_or_one_line(raw):
    """config_from_dict's result, or its CheckpointError's message (one line); any other
    exception fails the test."""
    try:
        return checkpoint.config_from_dict(raw)
    except checkpoint.CheckpointError as error:
        message = str(error)
        assert "\n" not in message and message.startswith("config.json"), message
        return message


@pytest.mark.parametrize("name", sorted(_family_raws()))
def test_wrong_typed_fields_are_one_line_naming_the_field(name):
    """Every field (nested ones too) set to a string, a list, an object, a bool and a fraction in
    turn: a config (the field is not read, or the value is one it takes) or one line that names
    the file and the field; never a traceback. Before: `"hidden_size": [256]` a TypeError,
    `"rope_scaling": "yarn"` an AttributeError, `"num_hidden_layers": "three"` a ValueError
    naming neither."""
    raw = _family_raws()[name]
    for path in _paths(raw):
        for wrong in WRONG_TYPES:
            got = _read_or_one_line(_with(raw, path, wrong))
            if isinstance(got, str) and path[-1] != "model_type":
                assert ".".join(path) in got or "ModelConfig." in got, (path, wrong, got)


@pytest.mark.parametrize("name", sorted(_family_raws()))
def test_missing_fields_take_a_default_or_are_one_line(name):
    """Each field (nested ones too) left out in turn: transformers' default for the model type
    (`hf_fields.DEFAULTS`, held equal to transformers' in tests/test_checkpoint_hf.py) or one
    line naming it."""
    raw = _family_raws()[name]
    for path in _paths(raw):
        got = _read_or_one_line(_with(raw, path, _DROP))
        if isinstance(got, str) and "is missing" in got:
            assert repr(".".join(path)) in got, (path, got)


def test_yarn_and_fp8_fields_as_transformers_reads_them():
    """YaRN without original_max_position_embeddings: transformers' default, max_position_
    embeddings (was a KeyError); a quantization_config without fmt, as transformers'
    FineGrainedFP8Config writes it: DeepSeek's FP8."""
    raw = checkpoint.config_dict(config.get_config("deepseek-v3-mini"), fp8=True)
    del raw["rope_scaling"]["original_max_position_embeddings"]
    cfg = checkpoint.config_from_dict(raw)
    assert (cfg.yarn_original_max_positions, cfg.yarn_factor) == (raw["max_position_embeddings"],
                                                                   raw["rope_scaling"]["factor"])
    del raw["quantization_config"]["fmt"]
    raw["quantization_config"].update(scale_fmt="float", dequantize=False,
                                      weight_block_size=(128, 128))
    assert checkpoint.fp8_quantized(raw)
    raw["quantization_config"]["fmt"] = "e5m2"
    with pytest.raises(checkpoint.CheckpointError, match="quantization_config.fmt='e5m2'"):
        checkpoint.fp8_quantized(raw)


def test_fp8_checkpoint_with_experts_on_a_d_model_off_the_fp8_blocks(tmp_path):
    """qwen3_moe FP8 with d_model 384 and expert hidden 256: W1/W3 contract over d_model, no whole
    256-value FP8 scale blocks, so the experts load into bf16 (was: fp8 chosen by the hidden
    alone, then refused). The quantization_config as transformers writes it (no fmt) and a
    leftover `rotary_emb.inv_freq` buffer: both read. Loads bit-equal to its dequantized twin."""
    # one layer (the mini's are all MoE layers alike; mla_first: Kimi K3's field, within it)
    cfg = config.get_config("qwen3-235b-a22b-mini", d_model=384, expert_hidden=256,
                            expert_format="bf16", n_layers=1, mla_first=0)
    params = weights.init_params(cfg, 1)
    fp8_dir, twin_dir = str(tmp_path / "fp8"), str(tmp_path / "twin")
    checkpoint.write_checkpoint(fp8_dir, params, cfg, fp8=True)
    with open(os.path.join(fp8_dir, "config.json")) as handle:
        raw = json.load(handle)
    del raw["quantization_config"]["fmt"]
    with open(os.path.join(fp8_dir, "config.json"), "w") as handle:
        json.dump(raw, handle)
    inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _rewrite(fp8_dir, lambda t: t.update({inv_freq: np.ones(64, np.float32)}))
    read = checkpoint.read_config(fp8_dir)
    assert read.expert_format == "bf16" and read.d_model == 384
    shards = safetensors_io.Shards(fp8_dir)
    os.makedirs(twin_dir)
    safetensors_io.write_file(os.path.join(twin_dir, safetensors_io.SINGLE_FILE), {
        name: shards.read_f32(name) for name in shards.names()
        if not name.endswith("_scale_inv") and name != inv_freq})
    del raw["quantization_config"]
    with open(os.path.join(twin_dir, "config.json"), "w") as handle:
        json.dump(raw, handle)
    assert _equal(checkpoint.load_params(fp8_dir, read, progress=False),
                  checkpoint.load_params(twin_dir, checkpoint.read_config(twin_dir),
                                         progress=False))
    # experts whose every contraction is whole FP8 blocks still load as fp8
    assert checkpoint.config_from_dict({**raw, "hidden_size": 512, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}).expert_format == "fp8"
