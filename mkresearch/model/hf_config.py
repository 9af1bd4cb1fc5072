"""A published `config.json` -> our validated `ModelConfig`, and back (spec/checkpoints.md).

Model types read: `deepseek_v3` (DeepSeek-V3, Moonlight, Kimi K2), `qwen3_moe`, `glm4_moe`,
`kimi_linear` (Kimi Linear: KDA + MLA) and `kimi_k3` (the name `write_config` gives Kimi K3's
attention-residual model, which has no public config.json). Fields a config.json does not carry
(the KV tile, the weight ring, the MLA cache layout, the expert format) come from the family's
preset (`mkresearch.config`). A model type we do not read, or a field value our stage kinds cannot
run (e.g. `hidden_act: gelu`), is a `CheckpointError`: one line naming the
field, its value and what is supported.

Both spellings of the RoPE fields are read: `rope_theta` / `rope_scaling` /
`partial_rotary_factor` at the top (the published files) and transformers 5's `rope_parameters`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mkresearch.model import model_config as config_module
from mkresearch.model.model_config import ModelConfig


class CheckpointError(ValueError):
    """Bad checkpoint input: one line naming the tensor, file or field and what was expected."""


CONFIG_FILE = "config.json"
FAMILY_PRESETS = {"deepseek_v3": config_module.DEEPSEEK_V3, "qwen3_moe": config_module.QWEN3_235B,
                  "glm4_moe": config_module.GLM_4_5, "kimi_k3": config_module.KIMI_K3,
                  "kimi_linear": config_module.KIMI_K3}
UNSUPPORTED_TYPES: dict[str, str] = {}
MODEL_TYPES = (*FAMILY_PRESETS, *UNSUPPORTED_TYPES)
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _unsupported(field: str, value: Any, supported: str) -> CheckpointError:
    return CheckpointError(f"{CONFIG_FILE}: {field}={value!r} is not supported: {supported}")


class _Fields:
    """The config.json dict, read field by field with one-line errors."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw

    def get(self, field: str, default: Any = ...) -> Any:
        if field in self.raw and self.raw[field] is not None:
            return self.raw[field]
        if default is ...:
            raise CheckpointError(f"{CONFIG_FILE}: field {field!r} is missing "
                                  f"(model_type {self.raw.get('model_type')!r} needs it)")
        return default

    def require(self, field: str, allowed: tuple, default: Any = ...) -> Any:
        value = self.get(field, default)
        if value not in allowed:
            raise _unsupported(field, value, f"one of {', '.join(map(repr, allowed))}")
        return value

    def rope(self) -> dict[str, Any]:
        """theta, partial factor and scaling from either spelling."""
        params = self.raw.get("rope_parameters") or {}
        scaling = self.raw.get("rope_scaling") or dict(params)
        theta = self.raw.get("rope_theta", params.get("rope_theta", 10000.0))
        partial = self.raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
        return {"theta": float(theta), "partial": float(partial), "scaling": scaling}


def _yarn(fields: _Fields) -> dict[str, Any]:
    scaling = fields.rope()["scaling"]
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return {"yarn_factor": 1.0}
    if kind != "yarn":
        raise _unsupported("rope_scaling.type", kind, "'yarn' or none")
    return {"yarn_factor": float(scaling["factor"]),
            "yarn_original_max_positions": int(scaling["original_max_position_embeddings"]),
            "yarn_beta_fast": float(scaling.get("beta_fast", 32)),
            "yarn_beta_slow": float(scaling.get("beta_slow", 1)),
            "yarn_mscale": float(scaling.get("mscale", 1)),
            "yarn_mscale_all_dim": float(scaling.get("mscale_all_dim", 0))}


def _common(f: _Fields) -> dict[str, Any]:
    """Trunk fields every family spells alike."""
    f.require("hidden_act", ("silu",), "silu")
    if f.get("tie_word_embeddings", False):
        raise _unsupported("tie_word_embeddings", True, "false (a separate LM head)")
    return {"d_model": int(f.get("hidden_size")), "n_layers": int(f.get("num_hidden_layers")),
            "vocab_size": int(f.get("vocab_size")), "n_heads": int(f.get("num_attention_heads")),
            "rms_eps": float(f.get("rms_norm_eps")), "residual": "prenorm", "activation": "silu",
            "rope_theta": f.rope()["theta"], "mla_first": 0}  # mla_first: unused (Kimi pattern)


def _routed(f: _Fields, experts: str) -> dict[str, Any]:
    """`experts`: the family's name of the routed expert count (transformers 5 writes
    `num_local_experts` instead)."""
    count = f.get(experts, None) or f.get("num_local_experts", None) or f.get(experts)
    return {"n_experts": int(count), "top_k": int(f.get("num_experts_per_tok")),
            "expert_hidden": int(f.get("moe_intermediate_size")),
            "router_normalize": bool(f.get("norm_topk_prob", True))}


def lane_multiple(width: int) -> int:
    """A dense FFN hidden rounded up to 128 lanes (GLM-4.5-Air's 10944 -> 11008): the loader
    zero-pads the published weights, which changes no output (SiLU(0) * 0 = 0)."""
    return -(-width // config_module.LANE) * config_module.LANE


def _group_limited(f: _Fields) -> dict[str, Any]:
    """DeepSeek-V3's / GLM-4.5's sigmoid router with correction bias and groups."""
    f.require("scoring_func", ("sigmoid",), "sigmoid")
    f.require("topk_method", ("noaux_tc",), "noaux_tc")
    f.require("moe_layer_freq", (1,), 1)
    dense = int(f.get("first_k_dense_replace", 0))
    shared = int(f.get("n_shared_experts", 0) or 0)
    return {"router_score": "sigmoid", "router_bias": True,
            "routed_scale": float(f.get("routed_scaling_factor", 1.0)),
            "router_groups": int(f.get("n_group", 1)), "router_topk_groups": int(f.get("topk_group", 1)),
            "n_dense_layers": dense, "ffn": "dense+moe_full" if dense else "moe_full",
            "dense_hidden": lane_multiple(int(f.get("intermediate_size"))),
            "n_shared_experts": shared,
            "shared_hidden": shared * int(f.get("moe_intermediate_size")) if shared else 128,
            "n_mtp_layers": int(f.get("num_nextn_predict_layers", 0))}


def _deepseek_v3(f: _Fields) -> dict[str, Any]:
    if f.get("attention_bias", False):
        raise _unsupported("attention_bias", True, "false for deepseek_v3")
    return {**_common(f), **_routed(f, "n_routed_experts"), **_group_limited(f), **_yarn(f),
            "attention": "mla_rope", "mla_cache_layout": "latent",
            # q_lora_rank null (Moonlight): the query projected directly, our mla_q_rank 0
            "mla_q_rank": int(f.get("q_lora_rank", 0)), "mla_kv_rank": int(f.get("kv_lora_rank")),
            "mla_qk_nope": int(f.get("qk_nope_head_dim")),
            "mla_qk_extra": int(f.get("qk_rope_head_dim")), "mla_v_dim": int(f.get("v_head_dim"))}


def _gqa(f: _Fields) -> dict[str, Any]:
    rope = f.rope()
    if rope["scaling"].get("rope_type", rope["scaling"].get("type", "default")) not in ("default",):
        raise _unsupported("rope_scaling", rope["scaling"], "none for GQA models")
    if f.get("use_sliding_window", False):
        raise _unsupported("use_sliding_window", True, "false")
    heads = int(f.get("num_attention_heads"))
    return {"attention": "gqa", "n_kv_heads": int(f.get("num_key_value_heads", heads)),
            "head_dim": int(f.get("head_dim", int(f.get("hidden_size")) // heads)),
            "rope_partial": rope["partial"]}


def _qwen3_moe(f: _Fields) -> dict[str, Any]:
    f.require("decoder_sparse_step", (1,), 1)
    if f.get("mlp_only_layers", []):
        raise _unsupported("mlp_only_layers", f.get("mlp_only_layers"), "[] (MoE in every layer)")
    if f.get("attention_bias", False):
        raise _unsupported("attention_bias", True, "false for qwen3_moe (its o_proj bias)")
    return {**_common(f), **_gqa(f), **_routed(f, "num_experts"), "qk_norm": True,
            "attention_bias": False, "router_score": "softmax", "router_bias": False,
            "routed_scale": 1.0, "router_groups": 1, "router_topk_groups": 1,
            "n_dense_layers": 0, "ffn": "moe_full", "n_shared_experts": 0}


def _glm4_moe(f: _Fields) -> dict[str, Any]:
    return {**_common(f), **_gqa(f), **_routed(f, "n_routed_experts"), **_group_limited(f),
            "qk_norm": bool(f.get("use_qk_norm", False)),
            "attention_bias": bool(f.get("attention_bias", False))}


def _kimi_k3(f: _Fields) -> dict[str, Any]:
    """Our own config.json for Kimi K3 (write_config): the ModelConfig fields by name."""
    fields = {field.name for field in config_module.dataclasses.fields(ModelConfig)}
    return {k: v for k, v in f.get("mkresearch", {}).items() if k in fields}


def _kimi_pattern(f: _Fields, n_layers: int) -> dict[str, Any]:
    """linear_attn_config's 1-based MLA layers as our Kimi pattern: every mla_every-th layer from
    mla_first, and the last; the KDA layers the rest."""
    linear = f.get("linear_attn_config")
    full = sorted(int(layer) - 1 for layer in linear.get("full_attn_layers") or ())
    kda = sorted(int(layer) - 1 for layer in linear.get("kda_layers") or ())
    every = full[1] - full[0] if len(full) > 1 else n_layers
    pattern = set(range(full[0], n_layers, every)) | {n_layers - 1} if full else set()
    if not full or set(full) != pattern and set(full) != pattern - {n_layers - 1} or (
            sorted(set(range(n_layers)) - set(full)) != kda):
        raise _unsupported("linear_attn_config.full_attn_layers", [x + 1 for x in full],
                           "MLA on every k-th layer from one (1-based), optionally the last, and "
                           "KDA (kda_layers) on every other layer")
    return {"mla_first": full[0], "mla_every": every, "mla_last_layer": n_layers - 1 in full,
            "kda_head_dim": int(linear.get("head_dim")),
            "kda_conv_size": int(linear.get("short_conv_kernel_size"))}


def _kimi_linear(f: _Fields) -> dict[str, Any]:
    """Kimi Linear: KDA (low-rank decay and output gates of rank head_dim, fla's softplus decay)
    + MLA without RoPE (`mla_use_nope`), without a query LoRA and without an output gate; a dense
    first layer, then sigmoid-routed experts with a correction bias."""
    f.require("mla_use_nope", (True,), True)
    f.require("moe_router_activation_func", ("sigmoid",), "sigmoid")
    f.require("moe_layer_freq", (1,), 1)
    heads = int(f.get("num_attention_heads"))
    if int(f.get("linear_attn_config").get("num_heads", heads)) != heads:
        raise _unsupported("linear_attn_config.num_heads", f.get("linear_attn_config")["num_heads"],
                           f"num_attention_heads={heads} (KDA and MLA share n_heads)")
    common = _common(f)
    shared = int(f.get("num_shared_experts", 0) or 0)
    head_dim = int(f.get("linear_attn_config").get("head_dim"))
    dense = int(f.get("first_k_dense_replace", 0))
    return {**common, **_kimi_pattern(f, common["n_layers"]), "attention": "kda+mla",
            "kda_gate_rank": head_dim, "kda_output_gate_rank": head_dim, "kda_decay": "softplus",
            "mla_output_gate": False, "mla_cache_layout": "latent",
            "mla_q_rank": int(f.get("q_lora_rank", 0)), "mla_kv_rank": int(f.get("kv_lora_rank")),
            "mla_qk_nope": int(f.get("qk_nope_head_dim")),
            "mla_qk_extra": int(f.get("qk_rope_head_dim")), "mla_v_dim": int(f.get("v_head_dim")),
            "n_experts": int(f.get("num_experts")), "top_k": int(f.get("num_experts_per_token")),
            "expert_hidden": int(f.get("moe_intermediate_size")),
            "router_normalize": bool(f.get("moe_renormalize", True)),
            "router_score": "sigmoid", "router_bias": True,
            "routed_scale": float(f.get("routed_scaling_factor", 1.0)),
            "router_groups": int(f.get("num_expert_group", 1)),
            "router_topk_groups": int(f.get("topk_group", 1)),
            "n_dense_layers": dense, "ffn": "dense+moe_full" if dense else "moe_full",
            "dense_hidden": lane_multiple(int(f.get("intermediate_size"))),
            "n_shared_experts": shared,
            "shared_hidden": shared * int(f.get("moe_intermediate_size")) if shared else 128,
            "n_mtp_layers": int(f.get("num_nextn_predict_layers", 0))}


READERS = {"deepseek_v3": _deepseek_v3, "qwen3_moe": _qwen3_moe, "glm4_moe": _glm4_moe,
           "kimi_k3": _kimi_k3, "kimi_linear": _kimi_linear}


def fp8_quantized(raw: dict[str, Any]) -> bool:
    """True for DeepSeek's FP8 release (`quantization_config`), False without one; any other
    quantisation is a CheckpointError naming it."""
    quant = raw.get("quantization_config")
    if not quant:
        return False
    for key, want in FP8_QUANTIZATION.items():
        if quant.get(key) != want:
            raise _unsupported(f"quantization_config.{key}", quant.get(key),
                               f"{want!r} (DeepSeek's FP8 e4m3 with 128x128 block scales)")
    return True


def _kv_tile(max_seq_len: int, preset_tile: int) -> int:
    for tile in (preset_tile, 256, 128, 64, 32, 16):
        if max_seq_len % tile == 0 and tile <= max_seq_len:
            return tile
    raise _unsupported("max_position_embeddings", max_seq_len, "a multiple of 16")


def config_from_dict(raw: dict[str, Any], name: str = "checkpoint", **overrides: Any) -> ModelConfig:
    """`raw` (a parsed config.json) as a validated ModelConfig named `name`; overrides win."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{CONFIG_FILE}: a JSON object expected, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type in UNSUPPORTED_TYPES:
        raise _unsupported("model_type", model_type, UNSUPPORTED_TYPES[model_type])
    if model_type not in READERS:
        raise _unsupported("model_type", model_type, f"one of {', '.join(map(repr, READERS))}")
    fields = _Fields(raw)
    values = READERS[model_type](fields)
    preset = FAMILY_PRESETS[model_type]
    if model_type != "kimi_k3":
        max_seq = int(fields.get("max_position_embeddings", None)
                      or fields.get("model_max_length"))  # Kimi Linear: model_max_length
        values.update(max_seq_len=max_seq, kv_tile=_kv_tile(max_seq, preset.kv_tile))
        fp8 = fp8_quantized(raw)
        hidden_ok = int(values["expert_hidden"]) % config_module.FP8_BLOCK == 0
        values["expert_format"] = "fp8" if fp8 and hidden_ok else "bf16"
    values.update(overrides)
    try:
        return preset.replace(name=name, **values)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{CONFIG_FILE} (model_type {model_type!r}): {error}") from None


def read_config(directory: str | os.PathLike, *, name: str | None = None,
                **overrides: Any) -> ModelConfig:
    """The checkpoint's `config.json` as a validated ModelConfig (named after the directory
    unless `name`), with optional field overrides (e.g. expert_format="mxfp4")."""
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


def config_dict(cfg: ModelConfig, *, fp8: bool = False) -> dict[str, Any]:
    """The config.json of cfg in its family's published spelling (what `read_config` reads
    back to cfg's fields, bar name, kv_tile and the ring)."""
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
