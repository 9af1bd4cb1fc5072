"""Presets of the small real models (docs/checkpoints.md): each one's published `config.json`
fields, read by `hf_config.config_from_dict` like a checkpoint's, with where they come from.

`mkresearch.sharding.layout.named_config("qwen3-30b-a3b")` (and the command line's MODEL) find
them; `config.get_config` knows only the presets typed in `mkresearch.model.config`.
Each value was transcribed from a first public copy (docs/families.md §5) and checked against a second public copy of the
config (noted per model); where copies disagree the note says which value was kept and why.

Moonlight's MLA has no query LoRA (mla_q_rank 0); Kimi Linear's KDA a low-rank output gate and
fla's softplus decay, its MLA no RoPE and no output gate (`hf_config._kimi_linear`).
"""

from __future__ import annotations

from typing import Any

from mkresearch.model.config import ModelConfig
from mkresearch.model.hf_config import config_from_dict

PUBLISHED: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B config.json. Second copies: several public loaders' test fixtures
    # (hidden 2048, 48 layers, 32 q / 4 kv heads, head_dim 128, 128 experts of 768, top-8,
    # norm_topk_prob true, theta 1e6, 40960 positions); one fixture's 8 kv heads is a typo
    # against the others and the first copy's 4.
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
        "vocab_size": 151936, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "rope_scaling": None, "max_position_embeddings": 40960,
        "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False},
    # zai-org/GLM-4.5-Air config.json. Our first copy's row came from training arguments; checked
    # against a public conversion script's Glm4MoeForCausalLM config (hidden 4096, 46 layers,
    # 96 q / 8 kv heads, head_dim 128, q/k/v bias, partial RoPE 0.5, 128 experts of 1408 + 1
    # shared, top-8, first layer dense 10944, n_group 1, routed_scaling_factor 1.0, eps 1e-5,
    # no QK-norm). That copy says rope_theta 10000; the first copy and GLM-4.5's config say 1e6, kept.
    "glm-4.5-air": {
        "model_type": "glm4_moe", "hidden_size": 4096, "num_hidden_layers": 46,
        "vocab_size": 151552, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "attention_bias": True, "use_qk_norm": False,
        "partial_rotary_factor": 0.5, "rope_theta": 1e6, "max_position_embeddings": 131072,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 128,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "routed_scaling_factor": 1.0, "norm_topk_prob": True, "rms_norm_eps": 1e-5,
        "num_nextn_predict_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False},
    # moonshotai/Moonlight-16B-A3B config.json: DeepSeek-V3's architecture with q_lora_rank null
    # (the query projected directly: our mla_q_rank 0), one group, no MTP module. Second copy: a
    # public loader's test fixture of the whole file (the same values, field for field, with
    # eos 163586, max_position_embeddings 8192, no rope_scaling).
    "moonlight-16b-a3b": {
        "model_type": "deepseek_v3", "hidden_size": 2048, "num_hidden_layers": 27,
        "vocab_size": 163840, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "attention_bias": False,
        "intermediate_size": 11264, "moe_intermediate_size": 1408, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "routed_scaling_factor": 2.446, "norm_topk_prob": True,
        "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "rope_scaling": None, "max_position_embeddings": 8192, "hidden_act": "silu",
        "tie_word_embeddings": False},
    # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json: KDA + MLA (no RoPE: mla_use_nope, no
    # q LoRA), MLA on layers 4, 8, ..., 24 and 27 (1-based). Second copies: two public loaders'
    # pinned field lists (the same values; both say num_key_value_heads 32, which MLA does not
    # read; one earlier transcription had 1). No max_position_embeddings: model_max_length.
    "kimi-linear-48b-a3b": {
        "model_type": "kimi_linear", "hidden_size": 2304, "num_hidden_layers": 27,
        "vocab_size": 163840, "num_attention_heads": 32, "num_key_value_heads": 32,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
        "linear_attn_config": {
            "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27]},
        "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_experts": 256,
        "num_experts_per_token": 8, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.446, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": None, "model_max_length": 1048576,
        "hidden_act": "silu", "tie_word_embeddings": False},
}


def published_config(name: str, **overrides: Any) -> ModelConfig:
    """The preset `name` of PUBLISHED as a ModelConfig (KeyError for another name)."""
    return config_from_dict(PUBLISHED[name], name, **overrides)
