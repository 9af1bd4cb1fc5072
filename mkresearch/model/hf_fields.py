"""config.json read field by field (`mkresearch.model.hf_config`'s readers): each value checked for
its type, and a field that is missing taking transformers' default for the model type.

    fields = Fields(raw)                  raw: the parsed config.json
    fields.int("hidden_size")             the value, or DEFAULTS[model_type]["hidden_size"]
    fields.int("head_dim", default=d)     a default transformers derives (here: d)
    fields.choice("hidden_act", ("silu",))
    fields.section("rope_scaling")        a nested object, read the same way ("rope_scaling.factor")

A value of the wrong type (`"num_hidden_layers": "three"`, `"hidden_size": [256]`, `"rope_scaling":
"yarn"`) or a missing field without a default is a `CheckpointError`: one line naming the file
and the field. A `null` reads as missing, as transformers' configs take `None` for "the default".

`DEFAULTS` are transformers' (its config classes' own defaults, `transformers.AutoConfig.for_model`;
tests/test_checkpoint_hf.py holds every value equal to them): a config.json without, say,
`norm_topk_prob` is read as transformers reads it (false for qwen3_moe, true for the others). The
fields marked "remote code" are not in transformers' classes: their default is the only value
transformers' model implements (DeepSeek's sigmoid router with the correction bias, an MoE layer in
every layer, Kimi Linear's MLA without RoPE). Kimi Linear is read in its published (remote code)
spelling; transformers' own `kimi_linear` class keeps the same names for these fields.
"""

from __future__ import annotations

import math
from typing import Any

CONFIG_FILE = "config.json"
MISSING = object()  # no default: the field is required


class CheckpointError(ValueError):
    """Bad checkpoint input: one line naming the tensor, file or field and what was expected."""


_REMOTE_ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc",  # remote code
                  "moe_layer_freq": 1}

DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {  # transformers.DeepseekV3Config
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "partial_rotary_factor": 1.0, "rope_interleave": True,
        "attention_bias": False, "num_nextn_predict_layers": 1, **_REMOTE_ROUTER},
    "qwen3_moe": {  # transformers.Qwen3MoeConfig
        "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "partial_rotary_factor": 1.0, "attention_bias": False,
        "use_sliding_window": False, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
        "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
        "mlp_only_layers": []},
    "glm4_moe": {  # transformers.Glm4MoeConfig
        "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
        "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "attention_bias": False, "moe_intermediate_size": 1408, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "use_qk_norm": False, "num_nextn_predict_layers": 1, **_REMOTE_ROUTER},
    "kimi_linear": {  # transformers.KimiLinearConfig, the fields of the published spelling
        "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32,
        "num_shared_experts": 1, "routed_scaling_factor": 2.446, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "num_expert_group": 1, "topk_group": 1, "num_experts_per_token": 8,
        "moe_renormalize": True, "hidden_act": "silu", "model_max_length": 1048576,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_experts": 256,
        "first_k_dense_replace": 1, "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "mla_use_nope": True, "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0},  # the last four: remote code
    "gpt_oss": {  # transformers.GptOssConfig (layer_types: sliding, full, ... from layer 0)
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4,
        "sliding_window": 128, "hidden_act": "silu", "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True,
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rope_theta": 150000.0,
        "partial_rotary_factor": 1.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}},
}
# linear_attn_config's fields (transformers.KimiLinearConfig: linear_head_dim, linear_num_heads,
# linear_conv_kernel_dim)
LINEAR_ATTN_DEFAULTS = {"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4}


class Fields:
    """One JSON object of config.json (the file, or a section of it: `where` is its name),
    read field by field with one-line errors naming the field."""

    def __init__(self, raw: dict[str, Any], defaults: dict[str, Any] | None = None,
                 where: str = "") -> None:
        self.raw = raw
        self.defaults = DEFAULTS.get(raw.get("model_type"), {}) if defaults is None else defaults
        self.where = where

    def name(self, field: str) -> str:
        return f"{self.where}.{field}" if self.where else field

    def present(self, field: str) -> bool:
        return self.raw.get(field) is not None

    def get(self, field: str, default: Any = MISSING) -> Any:
        """The raw value; missing or null: transformers' default (DEFAULTS), else `default`."""
        if self.present(field):
            return self.raw[field]
        if field in self.defaults:
            return self.defaults[field]
        if default is MISSING:
            raise CheckpointError(f"{CONFIG_FILE}: field {self.name(field)!r} is missing "
                                  f"(model_type {self.raw.get('model_type')!r} needs it)")
        return default

    def invalid(self, field: str, value: Any, wanted: str) -> CheckpointError:
        return CheckpointError(f"{CONFIG_FILE}: {self.name(field)}={value!r} is invalid: {wanted}")

    def int(self, field: str, default: Any = MISSING) -> int:
        """An int (a float with an integral value is taken, as JSON writers may give 8.0)."""
        value = self.get(field, default)
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.invalid(field, value, "an int")
        return value

    def float(self, field: str, default: Any = MISSING) -> float:
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.invalid(field, value, "a finite number")
        return float(value)

    def bool(self, field: str, default: Any = MISSING) -> bool:
        value = self.get(field, default)
        if not isinstance(value, bool):
            raise self.invalid(field, value, "true or false")
        return value

    def choice(self, field: str, allowed: tuple, default: Any = MISSING) -> Any:
        value = self.get(field, default)
        if isinstance(value, bool) != isinstance(allowed[0], bool) or value not in allowed:
            raise CheckpointError(f"{CONFIG_FILE}: {self.name(field)}={value!r} is not "
                                  f"supported: one of {', '.join(map(repr, allowed))}")
        return value

    def ints(self, field: str, default: Any = MISSING) -> list[int]:
        """A list of ints."""
        value = self.get(field, default)
        if not isinstance(value, list):
            raise self.invalid(field, value, "a list of ints")
        return [Fields({field: v}, {}, self.where).int(field) for v in value]

    def section(self, field: str, defaults: dict[str, Any] | None = None,
                default: Any = MISSING) -> Fields:
        """A nested object, read with its own defaults; its errors name `field.<name>`."""
        value = self.get(field, default)
        if not isinstance(value, dict):
            raise self.invalid(field, value, "a JSON object")
        return Fields(value, defaults or {}, self.name(field))
