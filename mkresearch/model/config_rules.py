"""What a valid `mkresearch.model.model_config.ModelConfig` is: the allowed values and the checks that
`ModelConfig.__post_init__` runs (ValueError naming the field and the allowed values).

Kept apart from the dataclass and its presets so each file stays readable;
`mkresearch.model.model_config` and `mkresearch.model.config` re-export the constants.
"""

from __future__ import annotations

import math
from typing import Any

MLA_CACHE_LAYOUTS = ("expanded", "latent")
# KDA's log decay from g = g_raw + dt_bias: "bounded" bound·σ(e^A g) (Kimi K3, docs/kimi-k3.md §4),
# "softplus" −e^A·softplus(g) (Kimi Linear, fla's fused_kda_gate without a lower bound)
KDA_DECAYS = ("bounded", "softplus")
# Layer patterns: a pattern spans two kinds by the pattern fields, any other value is one stage
# kind (registered in mkresearch.model.spec) used by every layer.
KIMI_ATTENTION = "kda+mla"  # MLA at mla_first, every mla_every after it and (mla_last_layer) last
DENSE_THEN_MOE = "dense+moe"  # dense FFN in the first n_dense_layers, MoE after
DENSE_THEN = "dense+"  # "dense+<kind>": dense FFN in the first n_dense_layers, <kind> after
# "<kind>,<kind>,...": a cycle of attention kinds, layer l runs the (l mod n)-th (GPT-OSS's
# sliding-window and full layers in turn: "gqa_sink_window,gqa_sink")
KIND_CYCLE = ","
RESIDUALS = ("attention_mix", "prenorm")  # Kimi's attention residuals; a classic residual stream
EXPERT_FORMATS = ("bf16", "fp8", "mxfp4")
# what the MXU is handed for a routed expert's product (`ModelConfig.expert_mxu`): its weights
# decoded to bf16, or its fp8 / MXFP4 values as fp8 e4m3 with the block scales applied after the dot
EXPERT_MXU_INPUTS = ("bf16", "fp8")
# "topk_softmax": the top k of the logits x W_r (+ the bias with router_bias), weighted by a
# softmax over those k logits alone (GPT-OSS)
ROUTER_SCORES = ("sigmoid", "softmax", "topk_softmax")
# "clamped_swiglu": GPT-OSS's (up + 1) · g σ(α g) with g clamped above and up both sides at a limit
ACTIVATIONS = ("situ", "silu", "clamped_swiglu")

# slots of the megakernel's global weight ring, at most: a rank in partial-sum mode deepens its ring
# as far as VMEM allows (`megakernel_sharded.ring_depth`; Kimi K3 on 32 ranks at B = 1: 17)
RING_MAX_DEPTH = 32
RING_BLOCK_MULTIPLE = 64 * 1024  # one ring slot is a whole number of 64 KiB

LANE = 128  # TPU vreg lane width: the last dim of every VMEM block is a multiple of it
BF16_SUBLANE = 16  # bf16 packs two rows per 32-bit sublane: 16 x 128 tiles
FP8_BLOCK = 256  # K values sharing one power-of-two scale in the FP8 expert format (docs/kimi-k3.md §7)
MXFP4_BLOCK = 32  # K values sharing one E8M0 scale in MXFP4 (docs/kimi-k3.md §7)
# K values sharing one scale per expert format: an expert matrix's contraction is whole blocks
EXPERT_BLOCKS = {"bf16": 1, "fp8": FP8_BLOCK, "mxfp4": MXFP4_BLOCK}


# ---- the checks ------------------------------------------------------------------------------
def _fail(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"ModelConfig.{field}={value!r} is invalid: {allowed}")


def _positive_int(cfg: Any, field: str, multiple: int = 1) -> None:
    value = getattr(cfg, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value % multiple:
        allowed = "a positive int" + (f" that is a multiple of {multiple}" if multiple > 1 else "")
        _fail(field, value, allowed)


def _choice(cfg: Any, field: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, field)
    if value not in choices:
        _fail(field, value, f"one of {', '.join(map(repr, choices))}")


def _positive_float(cfg: Any, field: str) -> None:
    value = getattr(cfg, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        _fail(field, value, "a finite number > 0")


def _boolean(cfg: Any, field: str) -> None:
    if not isinstance(getattr(cfg, field), bool):
        _fail(field, getattr(cfg, field), "True or False")


def _validate_families(cfg: Any) -> None:
    """The fields of the GQA, RoPE/YaRN and group-limited routing options (docs/families.md)."""
    _positive_int(cfg, "n_kv_heads")
    if cfg.n_heads % cfg.n_kv_heads:
        _fail("n_kv_heads", cfg.n_kv_heads, f"a divisor of n_heads={cfg.n_heads} (query heads "
              "share K/V heads in equal groups)")
    _positive_int(cfg, "head_dim", LANE // 2)  # GPT-OSS: 64
    for field in ("attention_bias", "qk_norm", "router_normalize", "yarn_truncate"):
        _boolean(cfg, field)
    _positive_float(cfg, "rope_theta")
    partial = cfg.rope_partial
    if (isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1
            or cfg.head_dim * partial != cfg.rope_dim or cfg.rope_dim % 2):
        _fail("rope_partial", partial, f"a fraction in (0, 1] of head_dim={cfg.head_dim} that is "
              "an even number of dims (rotated in pairs)")
    factor = cfg.yarn_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor < math.inf:
        _fail("yarn_factor", factor, "a finite number >= 1 (1 = no YaRN)")
    _positive_int(cfg, "yarn_original_max_positions")
    for field in ("yarn_beta_fast", "yarn_beta_slow"):
        _positive_float(cfg, field)
    if cfg.yarn_beta_fast <= cfg.yarn_beta_slow:
        _fail("yarn_beta_fast", cfg.yarn_beta_fast, f"> yarn_beta_slow={cfg.yarn_beta_slow}")
    for field in ("yarn_mscale", "yarn_mscale_all_dim"):
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            _fail(field, value, "a finite number >= 0")
    _positive_int(cfg, "router_groups")
    if cfg.n_experts % cfg.router_groups or (cfg.router_groups > 1 and cfg.experts_per_group < 2):
        _fail("router_groups", cfg.router_groups, f"a divisor of n_experts={cfg.n_experts} "
              "leaving at least 2 experts per group (a group scores its two best)")
    topk_groups = cfg.router_topk_groups
    if (isinstance(topk_groups, bool) or not isinstance(topk_groups, int)
            or not 1 <= topk_groups <= cfg.router_groups):
        _fail("router_topk_groups", topk_groups, f"an int in [1, router_groups={cfg.router_groups}]")
    if cfg.top_k > topk_groups * cfg.experts_per_group:
        _fail("router_topk_groups", topk_groups, f"enough groups for top_k={cfg.top_k}: at least "
              f"{-(-cfg.top_k // cfg.experts_per_group)} of {cfg.experts_per_group} experts")
    if isinstance(cfg.n_mtp_layers, bool) or not isinstance(cfg.n_mtp_layers, int) or cfg.n_mtp_layers < 0:
        _fail("n_mtp_layers", cfg.n_mtp_layers, "an int >= 0")
    if cfg.router_score == "topk_softmax" and cfg.router_groups > 1:
        _fail("router_groups", cfg.router_groups, "1 with router_score='topk_softmax'")
    _validate_gpt_oss(cfg)


def _validate_gpt_oss(cfg: Any) -> None:
    """GPT-OSS's fields: the checkpoint widths off the lane grid, the sliding window, the clamped
    SwiGLU and the experts' biases (docs/families.md §6)."""
    for field, padded in (("d_model_checkpoint", "d_model"),
                          ("expert_hidden_checkpoint", "expert_hidden")):
        value, width = getattr(cfg, field), getattr(cfg, padded)
        if (isinstance(value, bool) or not isinstance(value, int)
                or not (value == 0 or width - LANE < value <= width)):
            _fail(field, value, f"0 (the checkpoint's width is {padded}) or the checkpoint's "
                  f"width that {padded}={width} rounds up to whole lanes: in ({width - LANE}, "
                  f"{width}]")
    if (cfg.d_model == cfg.expert_hidden and cfg.d_model_checkpoint != cfg.expert_hidden_checkpoint
            and cfg.d_model_checkpoint and cfg.expert_hidden_checkpoint):
        _fail("expert_hidden_checkpoint", cfg.expert_hidden_checkpoint,
              f"d_model_checkpoint={cfg.d_model_checkpoint} when expert_hidden equals d_model "
              "(an axis of that width is padded from one checkpoint width)")
    window = cfg.sliding_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        _fail("sliding_window", window, "an int >= 0 (tokens a window layer attends to, itself "
              "included; 0: none)")
    for field in ("swiglu_alpha", "swiglu_limit"):
        _positive_float(cfg, field)
    _boolean(cfg, "expert_bias")


def validate(cfg: Any) -> None:
    """Every field of cfg (a ModelConfig), in declaration order of what each check needs."""
    if not isinstance(cfg.name, str) or not cfg.name:
        _fail("name", cfg.name, "a non-empty string")
    _validate_sizes(cfg)
    _validate_options(cfg)
    _validate_experts(cfg)
    _validate_layer_kinds(cfg)
    _validate_families(cfg)


def _validate_sizes(cfg: Any) -> None:
    """Widths, counts, the KV tile and the weight ring."""
    # lane dims of weight blocks: multiples of 128
    for field in ("d_model", "vocab_size", "kda_head_dim", "kda_gate_rank", "mla_kv_rank",
                  "mla_qk_nope", "mla_v_dim", "dense_hidden", "expert_hidden", "moe_latent",
                  "moe_latent_padded", "shared_hidden"):
        _positive_int(cfg, field, LANE)
    q_rank = cfg.mla_q_rank  # 0: no query LoRA, q = bf(x W_q) (Moonlight, Kimi Linear)
    if not isinstance(q_rank, int) or isinstance(q_rank, bool) or q_rank < 0 or q_rank % LANE:
        _fail("mla_q_rank", q_rank, f"0 (no query LoRA) or a positive multiple of {LANE}")
    for field in ("n_layers", "n_heads", "mla_every", "n_experts", "top_k", "attn_res_block",
                  "kda_conv_size", "mla_qk_extra"):
        _positive_int(cfg, field)
    _positive_int(cfg, "kv_tile", BF16_SUBLANE)
    _positive_int(cfg, "max_seq_len", cfg.kv_tile)
    if (isinstance(cfg.ring_depth, bool) or not isinstance(cfg.ring_depth, int)
            or not 2 <= cfg.ring_depth <= RING_MAX_DEPTH):
        _fail("ring_depth", cfg.ring_depth,
              f"an int in [2, {RING_MAX_DEPTH}] (2 = double buffering)")
    _positive_int(cfg, "ring_block_bytes", RING_BLOCK_MULTIPLE)
    if not isinstance(cfg.mla_first, int) or not 0 <= cfg.mla_first < cfg.n_layers:
        _fail("mla_first", cfg.mla_first, f"an int in [0, n_layers={cfg.n_layers})")


def _validate_options(cfg: Any) -> None:
    """The attention kinds' switches and choices."""
    _boolean(cfg, "mla_last_layer")
    _boolean(cfg, "router_bias")
    if (isinstance(cfg.kda_decay_bound, bool) or not isinstance(cfg.kda_decay_bound, (int, float))
            or not cfg.kda_decay_bound < 0):
        _fail("kda_decay_bound", cfg.kda_decay_bound, "a negative number (Kimi K3: -5)")
    _choice(cfg, "mla_cache_layout", MLA_CACHE_LAYOUTS)
    _choice(cfg, "kda_decay", KDA_DECAYS)
    _boolean(cfg, "mla_output_gate")
    gate_rank = cfg.kda_output_gate_rank  # 0: a full-rank W_g (Kimi K3)
    if (not isinstance(gate_rank, int) or isinstance(gate_rank, bool) or gate_rank < 0
            or gate_rank % LANE):
        _fail("kda_output_gate_rank", gate_rank,
              f"0 (a full-rank W_g) or a positive multiple of {LANE}")


def _validate_experts(cfg: Any) -> None:
    """The experts' format, routing and widths; the dense layers; the small floats."""
    _choice(cfg, "expert_format", EXPERT_FORMATS)
    _choice(cfg, "expert_mxu", EXPERT_MXU_INPUTS)
    if cfg.expert_mxu == "fp8" and cfg.expert_format == "bf16":
        _fail("expert_mxu", cfg.expert_mxu, "'bf16' for expert_format='bf16' (bf16 weights are "
              "not fp8 values: 'fp8' needs expert_format 'fp8' or 'mxfp4')")
    _choice(cfg, "router_score", ROUTER_SCORES)
    _choice(cfg, "activation", ACTIVATIONS)
    if not isinstance(cfg.n_dense_layers, int) or not 0 <= cfg.n_dense_layers < cfg.n_layers:
        _fail("n_dense_layers", cfg.n_dense_layers, f"an int in [0, n_layers={cfg.n_layers})")
    if cfg.top_k > cfg.n_experts:
        _fail("top_k", cfg.top_k, f"at most n_experts={cfg.n_experts}")
    if cfg.moe_latent_padded < cfg.moe_latent:
        _fail("moe_latent_padded", cfg.moe_latent_padded, f">= moe_latent={cfg.moe_latent}")
    # quantised experts are blocked along K (the input dim): latent for W1/W3, hidden for W2
    block = EXPERT_BLOCKS.get(cfg.expert_format, 1)
    for field in ("moe_latent", "expert_hidden"):
        if getattr(cfg, field) % block:
            _fail(field, getattr(cfg, field),
                  f"a multiple of {block} for {cfg.expert_format} scale blocks")
    if not isinstance(cfg.n_shared_experts, int) or cfg.n_shared_experts < 0:
        _fail("n_shared_experts", cfg.n_shared_experts, "an int >= 0")
    _positive_float(cfg, "routed_scale")
    _positive_float(cfg, "rms_eps")
    _positive_float(cfg, "l2_eps")
    if cfg.logit_softcap is not None:
        _positive_float(cfg, "logit_softcap")


def _validate_layer_kinds(cfg: Any) -> None:
    """The layer patterns' spelling (the kinds themselves are checked against the registry
    where the model is built, mkresearch.model.spec) and the residual strategy."""
    for field in ("attention", "ffn"):
        value = getattr(cfg, field)
        spelled = value.replace("+", "").replace("_", "") if isinstance(value, str) else ""
        if field == "attention":
            spelled = spelled.replace(KIND_CYCLE, "")
        if not isinstance(value, str) or not spelled.isalnum():
            _fail(field, value, "a stage kind registered in mkresearch.model.spec, or the pattern "
                  f"{KIMI_ATTENTION!r} / {DENSE_THEN!r}<kind> / '<kind>,<kind>' (attention)")
    if cfg.n_dense_layers and not cfg.ffn.startswith(DENSE_THEN):
        _fail("n_dense_layers", cfg.n_dense_layers, f"0 with ffn={cfg.ffn!r} (one kind for every "
              f"layer); dense first layers need an ffn pattern {DENSE_THEN!r}<kind>")
    _choice(cfg, "residual", RESIDUALS)

