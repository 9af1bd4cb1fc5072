"""Tiny random Hugging Face `transformers` models of the families (tests/test_checkpoint_hf.py):
built from small configs (never downloaded), weights redrawn at O(1) activation scale, saved with
`save_pretrained` in bf16. Imports torch and transformers: import this module only after
`pytest.importorskip` of both."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing touches the network

import torch
import transformers

# Shapes our configs accept (lane dims multiples of 128) with every family feature: group-limited
# routing, shared experts, dense first layer, YaRN, QK-norm, q/k/v bias, partial RoPE, MLA's
# query with and without its LoRA (DeepSeek-V3 / Moonlight).
COMMON = {"vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 3, "intermediate_size": 512,
          "moe_intermediate_size": 128, "num_experts_per_tok": 2, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu"}
CONFIGS = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **COMMON, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 256,
        "kv_lora_rank": 256, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "rope_theta": 10000.0}),
    # Moonlight-16B-A3B's reading of DeepSeek-V3: q_lora_rank None (q_proj), one group, no YaRN
    "moonlight": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **COMMON, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": None, "kv_lora_rank": 256, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 8, "n_group": 1,
        "topk_group": 1, "n_shared_experts": 2, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.446, "norm_topk_prob": True, "rope_theta": 50000.0}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
        "num_experts": 8, "norm_topk_prob": True, "rope_theta": 1e6}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        **COMMON, "rms_norm_eps": 1e-5, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5,
        "n_routed_experts": 8, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "rope_theta": 1e6}),
}


# GPT-OSS (tests/test_gpt_oss_hf.py): the tiny models' shapes by case. hidden and intermediate
# 352 are off the 128-lane grid (our layout pads them to 384, as 2880 to 2944) and whole MXFP4
# blocks (32); head_dim 64; sliding windows shorter than the prompts; transformers' default
# layer_types (sliding first) or another cycle; its default YaRN (factor 32, not truncated).
GPT_OSS = {"vocab_size": 512, "hidden_size": 352, "intermediate_size": 352,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
           "sliding_window": 12, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False}
GPT_OSS_CASES = {
    "padded": GPT_OSS,
    # lane widths (no padding), every expert on 4 of 8, a tighter clamp, full layers first
    "lanes": {**GPT_OSS, "hidden_size": 256, "intermediate_size": 384, "num_experts_per_tok": 4,
              "swiglu_limit": 3.0, "sliding_window": 20,
              "layer_types": ["full_attention", "sliding_attention"] * 2},
    # three layers of one cycle (sliding, sliding, full), 4 query heads per K/V head
    "cycle": {**GPT_OSS, "num_hidden_layers": 3, "num_key_value_heads": 2,
              "num_attention_heads": 8, "sliding_window": 7,
              "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
}


def build_gpt_oss(case: str, directory: str, seed: int = 0) -> torch.nn.Module:
    """A tiny GPT-OSS (GPT_OSS_CASES[case]) with O(1) weights, saved in bf16 to `directory` in
    transformers' layout (experts [in, out], gate and up interleaved); returns it (bf16, eval,
    eager attention: the sinks' softmax as the model code writes it)."""
    config = transformers.GptOssConfig(**GPT_OSS_CASES[case])
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = param.shape
            if "norm" in name:
                value = 0.8 + 0.4 * torch.rand(shape, generator=gen)
            elif "embed_tokens" in name or name.endswith(("sinks", "bias")):
                value = torch.randn(shape, generator=gen)  # O(1): a model forgetting them differs
            elif name.endswith("gate_up_proj"):  # [E, in, out]: ~4 · N(0, 1/in), so both
                value = 4 * torch.randn(shape, generator=gen) * shape[-2] ** -0.5  # clamps bite
            elif name.endswith("down_proj"):  # [E, in, out]
                value = torch.randn(shape, generator=gen) * shape[-2] ** -0.5
            else:  # projections and the router [out, in]
                value = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
            param.copy_(value.to(param.dtype))
    model.config._attn_implementation = "eager"
    model.save_pretrained(directory)
    return model


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations (transformers initialises N(0, 0.02), which makes every logit ~0 and
    any comparison vacuous): matrices N(0, 1/in), norms U(0.8, 1.2), biases N(0, 0.5), the
    embedding N(0, 1), the correction bias N(0, 0.05)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = param.shape
            if param.numel() == 0:
                continue
            if "norm" in name:
                value = 0.8 + 0.4 * torch.rand(shape, generator=gen)
            elif "embed_tokens" in name:
                value = torch.randn(shape, generator=gen)
            elif name.endswith(".bias"):
                value = 0.5 * torch.randn(shape, generator=gen)
            else:  # [.., out, in]
                value = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
            param.copy_(value.to(param.dtype))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=gen))


def build(model_type: str, directory: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model of `model_type` (a key of CONFIGS), saved to `directory`; returns it (bf16, eval mode)."""
    config_class, model_class, values = CONFIGS[model_type]
    config = getattr(transformers, config_class)(**values)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(torch.bfloat16).eval()
    _redraw(model, seed)
    model.save_pretrained(directory)
    return model


def logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' forward over the whole sequence: f32 [T, V]."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False)
    return out.logits[0].float()
