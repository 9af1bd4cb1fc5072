"""A published `config.json` -> our validated `ModelConfig`, and back (docs/checkpoints.md).

Model types read: `deepseek_v3` (DeepSeek-V3, Moonlight, Kimi K2), `qwen3_moe`, `glm4_moe`,
`gpt_oss` (GPT-OSS: `layer_types`, `sliding_window`, `swiglu_limit`, YaRN without truncation,
widths off the lane grid padded, MXFP4 experts as released: `quantization_config`
{"quant_method": "mxfp4"}), `kimi_linear` (Kimi Linear: KDA + MLA) and `kimi_k3` (the name `write_config` gives Kimi K3's
attention-residual model, which has no public config.json). Fields a config.json does not carry
(the KV tile, the weight ring, the MLA cache layout, the expert format) come from the family's
preset (`mkresearch.config`). Fields are read by `hf_fields.Fields`: a missing one takes
transformers' default for the model type, a value of the wrong type is refused. A model type we do
not read, a value of the wrong type, or one our stage kinds cannot run (e.g. `hidden_act: gelu`),
is a `CheckpointError`: one line naming the file, the field, its value and what is allowed.
FP8 checkpoints (`quantization_config`) keep FP8 experts when every expert contraction is whole
FP8 scale blocks (`spec.check` of the fp8 config), else their experts load into bf16.

Both spellings of the RoPE fields are read: `rope_theta` / `rope_scaling` /
`partial_rotary_factor` at the top (the published files) and transformers 5's `rope_parameters`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import mkresearch.model.stages  # noqa: F401 - registers the kinds whose checks spec.check runs
from mkresearch.model import model_config as config_module
from mkresearch.model import spec
from mkresearch.model.hf_fields import (  # CheckpointError: re-exported
    CONFIG_FILE,
    LINEAR_ATTN_DEFAULTS,
    CheckpointError,
    Fields,
)
from mkresearch.model.model_config import ModelConfig

FAMILY_PRESETS = {"deepseek_v3": config_module.DEEPSEEK_V3, "qwen3_moe": config_module.QWEN3_235B,
                  "glm4_moe": config_module.GLM_4_5, "kimi_k3": config_module.KIMI_K3,
                  "kimi_linear": config_module.KIMI_K3, "gpt_oss": config_module.GPT_OSS_20B}
UNSUPPORTED_TYPES: dict[str, str] = {}
MODEL_TYPES = (*FAMILY_PRESETS, *UNSUPPORTED_TYPES)
# DeepSeek's FP8 release; a missing fmt or weight_block_size takes transformers' FP8 defaults
# (FineGrainedFP8Config writes no fmt: e4m3 is its only one; 128 x 128 blocks)
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
FP8_DEFAULTS = {"fmt": "e4m3", "weight_block_size": [128, 128]}


def _unsupported(field: str, value: Any, supported: str) -> CheckpointError:
    return CheckpointError(f"{CONFIG_FILE}: {field}={value!r} is not supported: {supported}")


def _rope(f: Fields) -> dict[str, Any]:
    """theta, partial factor and scaling (a Fields) from either spelling: the top-level fields of
    the published files, or transformers 5's `rope_parameters`."""
    params = f.section("rope_parameters", default={})
    scaling = f.section("rope_scaling") if f.present("rope_scaling") else params

    def top_or_params(field: str) -> float:
        return (params if params.present(field) and not f.present(field) else f).float(field)

    return {"theta": top_or_params("rope_theta"), "partial": top_or_params("partial_rotary_factor"),
            "scaling": scaling}


def _rope_kind(scaling: Fields) -> str:
    field = "rope_type" if scaling.present("rope_type") else "type"
    kind = scaling.get(field, "default")
    if not isinstance(kind, str):
        raise scaling.invalid(field, kind, "a string ('default' or 'yarn')")
    return kind


def _yarn(f: Fields) -> dict[str, Any]:
    """DeepSeek's YaRN as transformers reads it (`modeling_rope_utils._compute_yarn_parameters`):
    original_max_position_embeddings defaults to max_position_embeddings, beta_fast / beta_slow
    to 32 / 1, and cos and sin are scaled by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) only when both are set (else by mscale(factor, 1))."""
    scaling = _rope(f)["scaling"]
    kind = _rope_kind(scaling)
    if kind == "default":
        return {"yarn_factor": 1.0}
    if kind != "yarn":
        raise _unsupported(scaling.name("type"), kind, "'yarn' or none")
    if scaling.present("attention_factor"):
        raise _unsupported(scaling.name("attention_factor"), scaling.get("attention_factor"),
                           "absent (the attention factor from mscale)")
    truncate = scaling.bool("truncate", default=True)
    max_positions = _max_positions(f)
    original = scaling.int("original_max_position_embeddings", default=max_positions)
    factor = scaling.float("factor")  # required by transformers' YaRN validation
    mscale = scaling.float("mscale", default=0.0)
    mscale_all_dim = scaling.float("mscale_all_dim", default=0.0)
    if mscale_all_dim and not mscale:
        raise _unsupported(scaling.name("mscale"), scaling.get("mscale", None),
                           f"a number with mscale_all_dim={mscale_all_dim} (transformers then "
                           "scales cos and sin by mscale(factor, 1), DeepSeek's code by the ratio)")
    return {"yarn_factor": factor, "yarn_original_max_positions": original,
            "yarn_beta_fast": scaling.float("beta_fast", default=0.0) or 32.0,
            "yarn_beta_slow": scaling.float("beta_slow", default=0.0) or 1.0,
            "yarn_mscale": mscale if mscale_all_dim else 1.0,
            "yarn_mscale_all_dim": mscale_all_dim, "yarn_truncate": truncate}


def _max_positions(f: Fields) -> int:
    """max_position_embeddings (Kimi Linear's published file: model_max_length)."""
    if f.raw.get("model_type") == "kimi_linear" and not f.present("max_position_embeddings"):
        return f.int("model_max_length")
    return f.int("max_position_embeddings")


def _common(f: Fields) -> dict[str, Any]:
    """Trunk fields every family spells alike."""
    f.choice("hidden_act", ("silu",))
    if f.bool("tie_word_embeddings"):
        raise _unsupported("tie_word_embeddings", True, "false (a separate LM head)")
    return {"d_model": f.int("hidden_size"), "n_layers": f.int("num_hidden_layers"),
            "vocab_size": f.int("vocab_size"), "n_heads": f.int("num_attention_heads"),
            "rms_eps": f.float("rms_norm_eps"), "residual": "prenorm", "activation": "silu",
            "rope_theta": _rope(f)["theta"], "mla_first": 0}  # mla_first: unused (Kimi pattern)


def _routed(f: Fields, experts: str) -> dict[str, Any]:
    """`experts`: the family's name of the routed expert count (transformers 5 writes
    `num_local_experts` instead)."""
    count = f.int("num_local_experts") if f.present("num_local_experts") and not f.present(
        experts) else f.int(experts)
    return {"n_experts": count, "top_k": f.int("num_experts_per_tok"),
            "expert_hidden": f.int("moe_intermediate_size"),
            "router_normalize": f.bool("norm_topk_prob")}


def lane_multiple(width: int) -> int:
    """A dense FFN hidden rounded up to 128 lanes (GLM-4.5-Air's 10944 -> 11008): the loader
    zero-pads the published weights, which changes no output (SiLU(0) * 0 = 0)."""
    return -(-width // config_module.LANE) * config_module.LANE


def _dense_and_shared(f: Fields, shared_field: str, mtp_field: str) -> dict[str, Any]:
    """The dense first layers, the shared experts and the MTP layers of a sigmoid-routed MoE."""
    dense = f.int("first_k_dense_replace")
    shared = _null_is_zero(f, shared_field)
    return {"n_dense_layers": dense, "ffn": "dense+moe_full" if dense else "moe_full",
            "dense_hidden": lane_multiple(f.int("intermediate_size")), "n_shared_experts": shared,
            "shared_hidden": shared * f.int("moe_intermediate_size") if shared else 128,
            "n_mtp_layers": f.int(mtp_field)}


def _group_limited(f: Fields) -> dict[str, Any]:
    """DeepSeek-V3's / GLM-4.5's sigmoid router with correction bias and groups."""
    f.choice("scoring_func", ("sigmoid",))
    f.choice("topk_method", ("noaux_tc",))
    f.choice("moe_layer_freq", (1,))
    return {"router_score": "sigmoid", "router_bias": True,
            "routed_scale": f.float("routed_scaling_factor"),
            "router_groups": f.int("n_group"), "router_topk_groups": f.int("topk_group"),
            **_dense_and_shared(f, "n_shared_experts", "num_nextn_predict_layers")}


def _null_is_zero(f: Fields, field: str) -> int:
    """A field whose null means none (q_lora_rank null, Moonlight's and Kimi Linear's: the query
    projected directly, our mla_q_rank 0; n_shared_experts null: no shared expert, as DeepSeek's
    code reads it); missing: the model type's default."""
    if field in f.raw and f.raw[field] is None:
        return 0
    return f.int(field, default=0)


def _mla_dims(f: Fields) -> dict[str, Any]:
    return {"mla_q_rank": _null_is_zero(f, "q_lora_rank"), "mla_kv_rank": f.int("kv_lora_rank"),
            "mla_qk_nope": f.int("qk_nope_head_dim"), "mla_qk_extra": f.int("qk_rope_head_dim"),
            "mla_v_dim": f.int("v_head_dim")}


def _deepseek_v3(f: Fields) -> dict[str, Any]:
    if f.bool("attention_bias"):
        raise _unsupported("attention_bias", True, "false for deepseek_v3")
    f.bool("rope_interleave")  # read by the loader (`_entries`): checked here
    return {**_common(f), **_routed(f, "n_routed_experts"), **_group_limited(f), **_yarn(f),
            **_mla_dims(f), "attention": "mla_rope", "mla_cache_layout": "latent"}


def _gqa(f: Fields) -> dict[str, Any]:
    rope = _rope(f)
    if _rope_kind(rope["scaling"]) != "default":
        raise _unsupported("rope_scaling", rope["scaling"].raw, "none for GQA models")
    if f.bool("use_sliding_window", default=False):
        raise _unsupported("use_sliding_window", True, "false")
    heads = f.int("num_attention_heads")
    return {"attention": "gqa", "n_kv_heads": f.int("num_key_value_heads", default=heads),
            "head_dim": f.int("head_dim", default=f.int("hidden_size") // heads),
            "rope_partial": rope["partial"]}


def _qwen3_moe(f: Fields) -> dict[str, Any]:
    f.choice("decoder_sparse_step", (1,))
    if f.ints("mlp_only_layers"):
        raise _unsupported("mlp_only_layers", f.get("mlp_only_layers"), "[] (MoE in every layer)")
    if f.bool("attention_bias"):
        raise _unsupported("attention_bias", True, "false for qwen3_moe (its o_proj bias)")
    return {**_common(f), **_gqa(f), **_routed(f, "num_experts"), "qk_norm": True,
            "attention_bias": False, "router_score": "softmax", "router_bias": False,
            "routed_scale": 1.0, "router_groups": 1, "router_topk_groups": 1,
            "n_dense_layers": 0, "ffn": "moe_full", "n_shared_experts": 0}


def _glm4_moe(f: Fields) -> dict[str, Any]:
    return {**_common(f), **_gqa(f), **_routed(f, "n_routed_experts"), **_group_limited(f),
            "qk_norm": f.bool("use_qk_norm"), "attention_bias": f.bool("attention_bias")}


def _kimi_k3(f: Fields) -> dict[str, Any]:
    """Our own config.json for Kimi K3 (write_config): the ModelConfig fields by name (their
    types checked by ModelConfig's validation)."""
    fields = {field.name for field in config_module.dataclasses.fields(ModelConfig)}
    return {k: v for k, v in f.section("mkresearch", default={}).raw.items() if k in fields}


def _kimi_pattern(f: Fields, n_layers: int) -> dict[str, Any]:
    """linear_attn_config's 1-based MLA layers as our Kimi pattern: every mla_every-th layer from
    mla_first, and the last; the KDA layers the rest."""
    linear = f.section("linear_attn_config", LINEAR_ATTN_DEFAULTS)
    full = sorted({layer - 1 for layer in linear.ints("full_attn_layers", default=[])})
    kda = sorted(layer - 1 for layer in linear.ints("kda_layers", default=[]))
    every = full[1] - full[0] if len(full) > 1 else n_layers
    pattern = set(range(full[0], n_layers, every)) | {n_layers - 1} if full else set()
    if not full or set(full) != pattern and set(full) != pattern - {n_layers - 1} or (
            sorted(set(range(n_layers)) - set(full)) != kda):
        raise _unsupported("linear_attn_config.full_attn_layers", [x + 1 for x in full],
                           f"with linear_attn_config.kda_layers={[x + 1 for x in kda]}: MLA on "
                           "every k-th layer from one (1-based), optionally the last, and KDA on "
                           "every other layer")
    return {"mla_first": full[0], "mla_every": every, "mla_last_layer": n_layers - 1 in full,
            "kda_head_dim": linear.int("head_dim"),
            "kda_conv_size": linear.int("short_conv_kernel_size")}


def _kimi_linear(f: Fields) -> dict[str, Any]:
    """Kimi Linear: KDA (low-rank decay and output gates of rank head_dim, fla's softplus decay)
    + MLA without RoPE (`mla_use_nope`), without a query LoRA and without an output gate; a dense
    first layer, then sigmoid-routed experts with a correction bias."""
    f.choice("mla_use_nope", (True,))
    f.choice("moe_router_activation_func", ("sigmoid",))
    f.choice("moe_layer_freq", (1,))
    common = _common(f)
    linear = f.section("linear_attn_config", LINEAR_ATTN_DEFAULTS)
    if linear.int("num_heads") != common["n_heads"]:
        raise _unsupported("linear_attn_config.num_heads", linear.get("num_heads"),
                           f"num_attention_heads={common['n_heads']} (KDA and MLA share n_heads)")
    head_dim = linear.int("head_dim")
    return {**common, **_kimi_pattern(f, common["n_layers"]), **_mla_dims(f),
            "attention": "kda+mla", "kda_gate_rank": head_dim, "kda_output_gate_rank": head_dim,
            "kda_decay": "softplus", "mla_output_gate": False, "mla_cache_layout": "latent",
            "n_experts": f.int("num_experts"), "top_k": f.int("num_experts_per_token"),
            "expert_hidden": f.int("moe_intermediate_size"),
            "router_normalize": f.bool("moe_renormalize"), "router_score": "sigmoid",
            "router_bias": True, "routed_scale": f.float("routed_scaling_factor"),
            "router_groups": f.int("num_expert_group"), "router_topk_groups": f.int("topk_group"),
            **_dense_and_shared(f, "num_shared_experts", "num_nextn_predict_layers")}


LAYER_TYPES = {"sliding_attention": "gqa_sink_window", "full_attention": "gqa_sink"}


def _attention_cycle(f: Fields, n_layers: int) -> str:
    """GPT-OSS's `layer_types` as our attention pattern: one kind, or a cycle of kinds
    ("gqa_sink_window,gqa_sink": layer l runs the (l mod 2)-th); missing, transformers' default
    (sliding on even layers, full on odd)."""
    default = [("sliding_attention", "full_attention")[layer % 2] for layer in range(n_layers)]
    types = f.get("layer_types", default)
    if not isinstance(types, list) or len(types) != n_layers or not all(
            isinstance(t, str) and t in LAYER_TYPES for t in types):
        raise f.invalid("layer_types", types, f"a list of {n_layers} (num_hidden_layers) of "
                        f"{', '.join(map(repr, LAYER_TYPES))}")
    for period in range(1, n_layers + 1):
        if n_layers % period == 0 and types == types[:period] * (n_layers // period):
            return ",".join(LAYER_TYPES[t] for t in types[:period])
    raise AssertionError  # period n_layers always repeats


def _gpt_oss(f: Fields) -> dict[str, Any]:
    """GPT-OSS: sinks, sliding-window and full layers (`layer_types`), the clamped SwiGLU, biased
    experts and router (softmax over the top-k logits), YaRN; hidden_size and intermediate_size
    off the lane grid (2880) padded to whole lanes (`lane_multiple`), the checkpoint's widths kept
    in d_model_checkpoint / expert_hidden_checkpoint."""
    common = _common(f)
    d, heads = common["d_model"], common["n_heads"]
    hidden = f.int("intermediate_size")
    attention = _attention_cycle(f, common["n_layers"])
    # null is not the default here: transformers' sliding layers then attend to every token
    window = f.raw["sliding_window"] if "sliding_window" in f.raw else f.get("sliding_window")
    if "gqa_sink_window" in attention and (isinstance(window, bool) or not isinstance(
            window, int) or window < 1):
        raise f.invalid("sliding_window", window, "an int >= 1 (layer_types has "
                        "sliding_attention layers)")
    return {**common, **_yarn(f), "d_model": lane_multiple(d),
            "d_model_checkpoint": d if d % config_module.LANE else 0,
            "attention": attention, "n_kv_heads": f.int("num_key_value_heads", default=heads),
            "head_dim": f.int("head_dim", default=d // heads), "rope_partial": 1.0,
            "attention_bias": f.bool("attention_bias"), "qk_norm": False,
            "sliding_window": window if "gqa_sink_window" in attention else 0,
            "n_experts": f.int("num_local_experts"), "top_k": f.int("num_experts_per_tok"),
            "expert_hidden": lane_multiple(hidden),
            "expert_hidden_checkpoint": hidden if hidden % config_module.LANE else 0,
            "expert_bias": True, "router_score": "topk_softmax", "router_bias": True,
            "routed_scale": 1.0, "router_groups": 1, "router_topk_groups": 1,
            "n_dense_layers": 0, "ffn": "moe_full", "n_shared_experts": 0,
            "activation": "clamped_swiglu", "swiglu_alpha": f.float("swiglu_alpha"),
            "swiglu_limit": f.float("swiglu_limit")}


READERS = {"deepseek_v3": _deepseek_v3, "qwen3_moe": _qwen3_moe, "glm4_moe": _glm4_moe,
           "kimi_k3": _kimi_k3, "kimi_linear": _kimi_linear, "gpt_oss": _gpt_oss}
# the MXFP4 release (GPT-OSS): its experts' `*_blocks` and `*_scales` read as they are
MXFP4_QUANTIZATION = {"quant_method": "mxfp4"}


def mxfp4_quantized(raw: dict[str, Any]) -> bool:
    """True for GPT-OSS's MXFP4 release (`quantization_config` with quant_method "mxfp4", as
    OpenAI ships it and transformers' Mxfp4Config writes it)."""
    quant = raw.get("quantization_config")
    return (raw.get("model_type") == "gpt_oss" and isinstance(quant, dict)
            and quant.get("quant_method") == "mxfp4")


def fp8_quantized(raw: dict[str, Any]) -> bool:
    """True for DeepSeek's FP8 release (`quantization_config`, as DeepSeek or transformers'
    FineGrainedFP8Config writes it), False without one; any other quantisation is a
    CheckpointError naming it."""
    quant = raw.get("quantization_config")
    if not quant or mxfp4_quantized(raw):
        return False
    if not isinstance(quant, dict):
        raise Fields(raw).invalid("quantization_config", quant, "a JSON object or null")
    for key, want in FP8_QUANTIZATION.items():
        value = quant.get(key, FP8_DEFAULTS.get(key))
        if (list(value) if isinstance(value, (list, tuple)) else value) != want:
            raise _unsupported(f"quantization_config.{key}", quant.get(key),
                               f"{want!r} (DeepSeek's FP8 e4m3 with 128x128 block scales)")
    return True


def _kv_tile(max_seq_len: int, preset_tile: int) -> int:
    for tile in (preset_tile, 256, 128, 64, 32, 16):
        if max_seq_len % tile == 0 and tile <= max_seq_len:
            return tile
    raise _unsupported("max_position_embeddings", max_seq_len, "a multiple of 16")


def _expert_format(cfg: ModelConfig) -> str:
    """fp8 when the experts' every contraction dim is whole FP8 scale blocks (the config's own
    checks and its FFN kind's: the hidden, the latent, d_model on the full d), else bf16 (the FP8
    values dequantised)."""
    try:
        spec.check(cfg.replace(expert_format="fp8"))
    except ValueError:
        return "bf16"
    return "fp8"


def config_from_dict(raw: dict[str, Any], name: str = "checkpoint", **overrides: Any) -> ModelConfig:
    """`raw` (a parsed config.json) as a validated ModelConfig named `name`; overrides win."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{CONFIG_FILE}: a JSON object expected, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in UNSUPPORTED_TYPES:
        raise _unsupported("model_type", model_type, UNSUPPORTED_TYPES[model_type])
    if not isinstance(model_type, str) or model_type not in READERS:
        raise _unsupported("model_type", model_type, f"one of {', '.join(map(repr, READERS))}")
    fields = Fields(raw)
    values = READERS[model_type](fields)
    preset = FAMILY_PRESETS[model_type]
    fp8 = model_type != "kimi_k3" and fp8_quantized(raw)
    if model_type != "kimi_k3":
        max_seq = _max_positions(fields)
        values.update(max_seq_len=max_seq, kv_tile=_kv_tile(max_seq, preset.kv_tile),
                      expert_format="mxfp4" if mxfp4_quantized(raw) else "bf16")
    try:
        cfg = preset.replace(name=name, **values)
        if fp8 and "expert_format" not in overrides:
            cfg = cfg.replace(expert_format=_expert_format(cfg))
        return cfg.replace(**overrides) if overrides else cfg
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{CONFIG_FILE} (model_type {model_type!r}): {error}") from None


def read_config(directory: str | os.PathLike, *, name: str | None = None,
                **overrides: Any) -> ModelConfig:
    """The checkpoint's `config.json` as a validated ModelConfig (named after the directory
    unless `name`), with optional field overrides (e.g. expert_format="mxfp4")."""
    if not os.path.isdir(directory):  # a file or a typo: said so, not a bare OSError
        why = "not a directory" if os.path.exists(directory) else "no such directory"
        raise CheckpointError(f"{directory}: {why} (a checkpoint directory holds config.json)")
    path = os.path.join(directory, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (a checkpoint directory holds config.json)") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    name = name or os.path.basename(os.path.normpath(directory)) or "checkpoint"
    return config_from_dict(raw, name, **overrides)


def _kimi_linear_dict(cfg: ModelConfig) -> dict[str, Any]:
    """Kimi Linear's spelling of cfg's fields (what `_kimi_linear` reads)."""
    full = [layer + 1 for layer in cfg.mla_layers]
    return {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
            "num_key_value_heads": cfg.n_heads, "q_lora_rank": cfg.mla_q_rank or None,
            "kv_lora_rank": cfg.mla_kv_rank, "qk_nope_head_dim": cfg.mla_qk_nope,
            "qk_rope_head_dim": cfg.mla_qk_extra, "v_head_dim": cfg.mla_v_dim,
            "mla_use_nope": True, "num_experts": cfg.n_experts,
            "num_experts_per_token": cfg.top_k, "moe_renormalize": cfg.router_normalize,
            "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
            "num_expert_group": cfg.router_groups, "topk_group": cfg.router_topk_groups,
            "num_shared_experts": cfg.n_shared_experts and cfg.shared_hidden // cfg.expert_hidden,
            "first_k_dense_replace": cfg.n_dense_layers, "intermediate_size": cfg.dense_hidden,
            "moe_layer_freq": 1, "num_nextn_predict_layers": cfg.n_mtp_layers,
            "linear_attn_config": {
                "head_dim": cfg.kda_head_dim, "num_heads": cfg.n_heads,
                "short_conv_kernel_size": cfg.kda_conv_size,
                "kda_layers": [layer + 1 for layer in cfg.kda_layers], "full_attn_layers": full}}


def _gpt_oss_dict(cfg: ModelConfig) -> dict[str, Any]:
    """GPT-OSS's spelling of cfg's fields (what `_gpt_oss` reads), MXFP4 experts written as
    released when cfg's are MXFP4."""
    kinds = {kind: name for name, kind in LAYER_TYPES.items()}
    raw = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
           "hidden_size": cfg.d_norm, "intermediate_size": cfg.expert_hidden_checkpoint
           or cfg.expert_hidden, "num_hidden_layers": cfg.n_layers,
           "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.n_heads,
           "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
           "layer_types": [kinds[kind] for kind in cfg.attention_kinds],
           "sliding_window": cfg.sliding_window or None, "attention_bias": cfg.attention_bias,
           "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
           "swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit,
           "rms_norm_eps": cfg.rms_eps, "hidden_act": "silu", "tie_word_embeddings": False,
           "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
           "torch_dtype": "bfloat16"}
    if cfg.yarn_factor > 1:
        raw["rope_scaling"] = {
            "rope_type": "yarn", "factor": cfg.yarn_factor,
            "original_max_position_embeddings": cfg.yarn_original_max_positions,
            "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
            "truncate": cfg.yarn_truncate}
    else:
        raw["rope_scaling"] = {"rope_type": "default"}
    if cfg.expert_format == "mxfp4":
        raw["quantization_config"] = {
            **MXFP4_QUANTIZATION, "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                "lm_head"]}
    return raw


def config_dict(cfg: ModelConfig, *, fp8: bool = False) -> dict[str, Any]:
    """The config.json of cfg in its family's published spelling (what `read_config` reads
    back to cfg's fields, bar name, kv_tile and the ring)."""
    if any(kind.startswith("gqa_sink") for kind in cfg.attention_kinds):
        return _gpt_oss_dict(cfg)
    if cfg.residual == "attention_mix":
        raw = {"model_type": "kimi_k3", "architectures": ["KimiK3ForCausalLM"],
               "mkresearch": {f.name: getattr(cfg, f.name)
                              for f in config_module.dataclasses.fields(cfg) if f.name != "name"}}
        return raw
    raw = {"hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
           "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.n_heads,
           "rms_norm_eps": cfg.rms_eps, "hidden_act": "silu", "tie_word_embeddings": False,
           "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
           "moe_intermediate_size": cfg.expert_hidden, "num_experts_per_tok": cfg.top_k,
           "norm_topk_prob": cfg.router_normalize, "torch_dtype": "bfloat16"}
    if cfg.ffn.endswith("moe_full") and cfg.router_score == "sigmoid":
        raw.update(n_routed_experts=cfg.n_experts, scoring_func="sigmoid", topk_method="noaux_tc",
                   routed_scaling_factor=cfg.routed_scale, n_group=cfg.router_groups,
                   topk_group=cfg.router_topk_groups, first_k_dense_replace=cfg.n_dense_layers,
                   intermediate_size=cfg.dense_hidden, moe_layer_freq=1,
                   n_shared_experts=cfg.n_shared_experts and cfg.shared_hidden // cfg.expert_hidden,
                   num_nextn_predict_layers=cfg.n_mtp_layers)
    if cfg.attention == "mla_rope":
        raw.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                   num_key_value_heads=cfg.n_heads, q_lora_rank=cfg.mla_q_rank or None,
                   kv_lora_rank=cfg.mla_kv_rank, qk_nope_head_dim=cfg.mla_qk_nope,
                   qk_rope_head_dim=cfg.mla_qk_extra, v_head_dim=cfg.mla_v_dim,
                   attention_bias=False, rope_interleave=True)
        if cfg.yarn_factor > 1:
            raw["rope_scaling"] = {
                "type": "yarn", "factor": cfg.yarn_factor,
                "original_max_position_embeddings": cfg.yarn_original_max_positions,
                "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                "mscale": cfg.yarn_mscale, "mscale_all_dim": cfg.yarn_mscale_all_dim}
    elif cfg.attention == "gqa":
        raw.update(num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                   attention_bias=cfg.attention_bias)
        if cfg.router_score == "softmax":
            raw.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                       num_experts=cfg.n_experts, decoder_sparse_step=1, mlp_only_layers=[],
                       intermediate_size=cfg.dense_hidden)
        else:
            raw.update(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"],
                       use_qk_norm=cfg.qk_norm, partial_rotary_factor=cfg.rope_partial)
    elif cfg.attention == config_module.KIMI_ATTENTION:  # Kimi Linear
        raw.update(_kimi_linear_dict(cfg))
    if "model_type" not in raw:
        raise CheckpointError(f"ModelConfig {cfg.name!r}: no published config.json spelling for "
                              f"attention={cfg.attention!r}, ffn={cfg.ffn!r}")
    if fp8:
        raw["quantization_config"] = {**FP8_QUANTIZATION, "activation_scheme": "dynamic"}
    return raw
