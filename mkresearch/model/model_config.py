"""The model configuration: one frozen, self-validating dataclass (`ModelConfig`) and the named
presets. A config is had by name from `mkresearch.model.config.get_config` (presets, their minis,
one rank of a full-size preset, published checkpoints' models); the modules below it in the model
layer (the stage kinds, the split arithmetic, the published configs) import this one.

The `kimi-k3` preset carries exactly the values of docs/kimi-k3.md §1. `kimi-k3-mini` keeps every
Kimi K3 feature (KDA+MLA pattern, dense layer 0, attention-residual blocks, padded latent MoE,
shared experts, sigmoid router with correction bias, SiTU) at sizes where a whole decode step runs
in TPU interpret mode in seconds. The shapes one rank of a sharded model sees come from the kinds'
sharding rules (`mkresearch.model.partition.rank_config`: `get_config("kimi-k3-rank")`, one of the
release's 32 ranks).

Other MoE families (docs/families.md): `deepseek-v3`, `glm-4.5` and `qwen3-235b-a22b` carry the
public config.json values, each with a `-mini` sibling that keeps every feature of its family
(groups of the group-limited router, partial RoPE, QK-norm, attention bias, dense first layers,
shared experts, YaRN) at mini sizes. Fields of stage kinds a model does not use keep Kimi K3's
values and are ignored (e.g. the KDA fields of a GQA model).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from mkresearch.model.config_rules import (  # noqa: F401 - the allowed values, re-exported
    ACTIVATIONS,
    BF16_SUBLANE,
    DENSE_THEN,
    DENSE_THEN_MOE,
    EXPERT_FORMATS,
    EXPERT_MXU_INPUTS,
    FP8_BLOCK,
    KDA_DECAYS,
    KIMI_ATTENTION,
    KIND_CYCLE,
    LANE,
    MLA_CACHE_LAYOUTS,
    MXFP4_BLOCK,
    RESIDUALS,
    RING_BLOCK_MULTIPLE,
    RING_MAX_DEPTH,
    ROUTER_SCORES,
    validate,
)


@dataclass(frozen=True)
class ModelConfig:
    """Every size and switch of one decode-step model. Invalid values raise ValueError on creation."""

    name: str
    # trunk
    d_model: int
    n_layers: int
    vocab_size: int
    # attention: layer l is MLA if l >= mla_first and (l - mla_first) % mla_every == 0, or the last
    n_heads: int
    mla_first: int
    mla_every: int
    mla_last_layer: bool
    # KDA (docs/kimi-k3.md §4)
    kda_head_dim: int
    kda_gate_rank: int
    kda_conv_size: int
    kda_decay_bound: float  # lower bound of the per-channel log decay (−5 in Kimi K3)
    # MLA (docs/kimi-k3.md §5)
    mla_q_rank: int
    mla_kv_rank: int
    mla_qk_nope: int
    mla_qk_extra: int
    mla_v_dim: int
    mla_cache_layout: str
    # FFN (docs/kimi-k3.md §6)
    n_dense_layers: int
    dense_hidden: int
    n_experts: int
    top_k: int
    router_score: str
    router_bias: bool
    routed_scale: float
    expert_hidden: int
    moe_latent: int
    moe_latent_padded: int
    n_shared_experts: int
    shared_hidden: int
    activation: str
    expert_format: str
    # norms, residual mixing, head
    rms_eps: float
    l2_eps: float
    attn_res_block: int
    logit_softcap: float | None
    # kernel blocking
    kv_tile: int
    max_seq_len: int
    # the megakernel's global weight ring (kernels/base/weight_stream.py): ring_depth VMEM slots of
    # ring_block_bytes each; ring_depth - 1 weight blocks fly ahead of the one being multiplied
    ring_depth: int
    ring_block_bytes: int
    # the model spec: which stage kind each layer's attention and FFN is (a pattern or one kind
    # for every layer), and how sublayer outputs join (mkresearch.model.spec)
    attention: str = KIMI_ATTENTION
    ffn: str = DENSE_THEN_MOE
    residual: str = "attention_mix"
    # GQA attention (kind "gqa": GLM-4.5, Qwen3): n_heads query heads share n_kv_heads K/V heads
    # in groups of n_heads / n_kv_heads, each of head_dim
    n_kv_heads: int = 1
    head_dim: int = 128
    attention_bias: bool = False  # a bias on the q, k and v projections (GLM-4.5)
    qk_norm: bool = False  # RMSNorm per head on q and k, before RoPE (GLM-4.5, Qwen3)
    # rotary position embedding (kinds "gqa" and "mla_rope", mkresearch.model.rope): the first
    # rope_partial of a head's dims rotate (HF partial_rotary_factor); MLA rotates its
    # mla_qk_extra dims (DeepSeek's qk_rope_head_dim)
    rope_theta: float = 10000.0
    rope_partial: float = 1.0
    # YaRN context extension (DeepSeek-V3's rope_scaling), on when yarn_factor > 1
    yarn_factor: float = 1.0
    yarn_original_max_positions: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # group-limited routing (DeepSeek's noaux_tc): experts in router_groups groups of equal size;
    # only the router_topk_groups groups whose two best biased scores sum highest are eligible
    router_groups: int = 1
    router_topk_groups: int = 1
    router_normalize: bool = True  # top-k weights divided by their sum (HF norm_topk_prob)
    # multi-token-prediction modules (DeepSeek's num_nextn_predict_layers): a draft for
    # speculative decoding, not part of the decode step; counted apart (roofline.mtp_parameters)
    n_mtp_layers: int = 0
    # Kimi Linear (docs/checkpoints.md) beside Kimi K3: KDA's output gate through a rank-r
    # bottleneck (W_ga [d, r], W_gb [r, H·D]; 0 = K3's full-rank W_g), its decay form
    # (config_rules.KDA_DECAYS), and MLA without K3's sigmoid output gate W_g. Out of the repr:
    # recorded compiles are keyed by a plan's repr, which holds the config (measurement.recorded)
    kda_output_gate_rank: int = dataclasses.field(default=0, repr=False)
    kda_decay: str = dataclasses.field(default="bounded", repr=False)
    mla_output_gate: bool = dataclasses.field(default=True, repr=False)
    # what a routed expert's product hands the MXU (EXPERT_MXU_INPUTS): "bf16", its weights decoded
    # (every preset), or "fp8": its stored fp8 / MXFP4 values as e4m3 (exact) and the bf16
    # activation, each scale block's partial product scaled after the dot and the blocks summed in
    # one order (`numerics.block_scaled_matmul`), as the public Kimi K3 release's kernel does. TPU7x
    # multiplies fp8 at twice the bf16 rate. Out of the repr, as above.
    expert_mxu: str = dataclasses.field(default="bf16", repr=False)
    # GPT-OSS (docs/families.md §6). Widths off the 128-lane grid: d_model and expert_hidden are
    # the checkpoint's widths rounded up to whole lanes (2880 -> 2944), the padding zero in every
    # weight, so the hidden state's padding stays zero; RMSNorms over d divide by the checkpoint's
    # width (`d_norm`). 0: the checkpoint's width is ours. Out of the repr, as above.
    d_model_checkpoint: int = dataclasses.field(default=0, repr=False)
    expert_hidden_checkpoint: int = dataclasses.field(default=0, repr=False)
    # tokens a sliding-window layer (kind "gqa_sink_window") attends to, the new one included
    sliding_window: int = dataclasses.field(default=0, repr=False)
    # activation "clamped_swiglu": (clip(u, ±limit) + 1) · g σ(α g), g = min(g, limit)
    swiglu_alpha: float = dataclasses.field(default=1.702, repr=False)
    swiglu_limit: float = dataclasses.field(default=7.0, repr=False)
    # a bias on each routed expert's W1, W3 and W2 (moe_full)
    expert_bias: bool = dataclasses.field(default=False, repr=False)
    # YaRN's correction range floored / ceiled (transformers' `truncate`, true by default;
    # GPT-OSS: false)
    yarn_truncate: bool = dataclasses.field(default=True, repr=False)

    def __post_init__(self) -> None:
        validate(self)

    def __repr__(self) -> str:
        """Every field, but those kept out of the repr (fields(repr=False)) only when set: a
        recorded compile is keyed by a plan's repr (above), so a config with such a field at
        its default keeps its records and one with it set gets its own."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.repr or getattr(self, f.name) != f.default]
        return f"ModelConfig({', '.join(shown)})"

    # ---- the layers: (attention kind, FFN kind) each ---------------------------------------
    # Cached per config (functools.cached_property writes the instance's __dict__, which a frozen
    # dataclass allows; fields, eq, hash and repr are untouched): the schedule's dry run and its
    # checks ask for them hundreds of thousands of times on a full-size preset.
    @functools.cached_property
    def layers(self) -> tuple[tuple[str, str], ...]:
        """(attention kind, FFN kind) of every layer, from the `attention` and `ffn` patterns."""
        return tuple(zip(self.attention_kinds, self.ffn_kinds))

    @functools.cached_property
    def attention_kinds(self) -> tuple[str, ...]:
        if KIND_CYCLE in self.attention:  # a cycle of kinds: layer l runs the (l mod n)-th
            cycle = self.attention.split(KIND_CYCLE)
            return tuple(cycle[layer % len(cycle)] for layer in range(self.n_layers))
        if self.attention != KIMI_ATTENTION:
            return (self.attention,) * self.n_layers
        mla = set(range(self.mla_first, self.n_layers, self.mla_every))
        if self.mla_last_layer:
            mla.add(self.n_layers - 1)
        return tuple("mla" if layer in mla else "kda" for layer in range(self.n_layers))

    @functools.cached_property
    def ffn_kinds(self) -> tuple[str, ...]:
        """One kind for every layer, or "dense+<kind>" (Kimi K3's "dense+moe"): dense in the
        first n_dense_layers, <kind> after."""
        if not self.ffn.startswith(DENSE_THEN):
            return (self.ffn,) * self.n_layers
        after = self.ffn[len(DENSE_THEN):]
        return tuple("dense" if layer < self.n_dense_layers else after
                     for layer in range(self.n_layers))

    @functools.cached_property
    def kinds(self) -> tuple[str, ...]:
        """The stage kinds the model uses, attention kinds first, each once, in layer order."""
        return tuple(dict.fromkeys(self.attention_kinds + self.ffn_kinds))

    @functools.cached_property
    def _layers_by_kind(self) -> dict[str, tuple[int, ...]]:
        by_kind: dict[str, list[int]] = {}
        for layer, pair in enumerate(self.layers):
            for kind in dict.fromkeys(pair):
                by_kind.setdefault(kind, []).append(layer)
        return {kind: tuple(layers) for kind, layers in by_kind.items()}

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """The layers whose attention or FFN is `kind` (its weights are stacked in this order)."""
        return self._layers_by_kind.get(kind, ())

    def kind_index(self, layer: int, kind: str) -> int:
        """Index of `layer` within the stacked weights and state of `kind`."""
        return self.layers_of(kind).index(layer)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return self.layers_of("mla")

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return self.layers_of("kda")

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return self.layers_of("dense")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.layers_of("moe")

    def is_mla(self, layer: int) -> bool:
        return self.attention_kinds[layer] == "mla"

    def attention_index(self, layer: int) -> int:
        """Index of `layer` within the stacked weights and state of its attention kind."""
        return self.kind_index(layer, self.attention_kinds[layer])

    def ffn_index(self, layer: int) -> int:
        """Index of `layer` within the stacked weights of its FFN kind."""
        return self.kind_index(layer, self.ffn_kinds[layer])

    @property
    def n_blocks(self) -> int:
        """Number of attention-residual snapshot slots R_0..R_{n_blocks-1}."""
        return math.ceil(self.n_layers / self.attn_res_block)

    @property
    def kda_width(self) -> int:
        return self.n_heads * self.kda_head_dim

    @property
    def mla_qk_dim(self) -> int:
        return self.mla_qk_nope + self.mla_qk_extra

    @property
    def mla_k_padded(self) -> int:
        """Per-head K width in the expanded cache: qk_nope + qk_extra rounded up to a lane multiple."""
        return _round_up(self.mla_qk_dim, LANE)

    @property
    def mla_latent_cache_dim(self) -> int:
        return self.mla_kv_rank + self.mla_qk_extra

    @property
    def rope_dim(self) -> int:
        """Rotated dims of a GQA head: the first rope_partial of head_dim."""
        return round(self.head_dim * self.rope_partial)

    @property
    def d_norm(self) -> int:
        """The width RMSNorms over the hidden state divide by: the checkpoint's d (GPT-OSS's
        2880), not the zero-padded lanes of d_model."""
        return self.d_model_checkpoint or self.d_model

    @property
    def experts_per_group(self) -> int:
        return self.n_experts // self.router_groups

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# ---- presets ---------------------------------------------------------------------------------
KIMI_K3 = ModelConfig(
    name="kimi-k3",
    d_model=7168,
    n_layers=93,
    vocab_size=163840,
    n_heads=96,
    mla_first=3,
    mla_every=4,
    mla_last_layer=True,
    kda_head_dim=128,
    kda_gate_rank=128,
    kda_conv_size=4,
    kda_decay_bound=-5.0,
    mla_q_rank=1536,
    mla_kv_rank=512,
    mla_qk_nope=128,
    mla_qk_extra=64,
    mla_v_dim=128,
    mla_cache_layout="expanded",  # what the released kernels do; "latent" is 64x fewer KV bytes
    n_dense_layers=1,
    dense_hidden=33792,
    n_experts=896,
    top_k=16,
    router_score="sigmoid",
    router_bias=True,
    routed_scale=1.0,
    expert_hidden=3072,
    moe_latent=3584,
    moe_latent_padded=4096,
    n_shared_experts=2,
    shared_hidden=6144,
    activation="situ",
    expert_format="mxfp4",
    rms_eps=1e-5,
    l2_eps=1e-6,
    attn_res_block=12,
    logit_softcap=None,
    kv_tile=256,
    max_seq_len=32768,
    ring_depth=3,
    ring_block_bytes=2 * 2**20,  # 2 MiB weight blocks, as the released kernels stream
)

# 7 layers: KDA 0,1,2,4,5 and MLA 3 (every 4th from 3) and 6 (the last); blocks of 3 give
# snapshots R_0..R_2. The latent (256) is padded to 384 in VMEM as 3584 is to 4096.
KIMI_K3_MINI = KIMI_K3.replace(
    name="kimi-k3-mini",
    d_model=512,
    n_layers=7,
    vocab_size=2048,
    n_heads=2,
    mla_q_rank=256,
    mla_kv_rank=256,
    mla_qk_extra=128,
    dense_hidden=1024,
    n_experts=16,
    top_k=4,
    expert_hidden=256,
    moe_latent=256,
    moe_latent_padded=384,
    shared_hidden=512,
    attn_res_block=3,
    kv_tile=32,
    max_seq_len=128,
)

# ---- other MoE families (docs/families.md): the public config.json values ----------------------
# Fields of kinds these models do not use (KDA, the Kimi pattern, the MoE latent, the attention-
# residual block) keep Kimi K3's values and are ignored. max_seq_len is each config's
# max_position_embeddings.
DEEPSEEK_V3 = KIMI_K3.replace(
    name="deepseek-v3",
    d_model=7168,
    n_layers=61,
    vocab_size=129280,
    n_heads=128,
    mla_q_rank=1536,
    mla_kv_rank=512,
    mla_qk_nope=128,
    mla_qk_extra=64,  # qk_rope_head_dim: the decoupled rope dims
    mla_v_dim=128,
    mla_cache_layout="latent",  # ĉ (512) + the roped key (64) per token, shared by all heads
    n_dense_layers=3,
    dense_hidden=18432,
    n_experts=256,
    top_k=8,
    router_score="sigmoid",
    router_bias=True,  # e_score_correction_bias (noaux_tc)
    routed_scale=2.5,
    expert_hidden=2048,
    n_shared_experts=1,
    shared_hidden=2048,
    activation="silu",
    expert_format="fp8",  # the release is FP8 e4m3 (128x128 block scales; here 256-row blocks)
    rms_eps=1e-6,
    max_seq_len=163840,
    attention="mla_rope",
    ffn="dense+moe_full",
    residual="prenorm",
    rope_theta=10000.0,
    yarn_factor=40.0,
    yarn_original_max_positions=4096,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=1.0,
    router_groups=8,
    router_topk_groups=4,
    router_normalize=True,
    n_mtp_layers=1,
)

GLM_4_5 = KIMI_K3.replace(
    name="glm-4.5",
    d_model=5120,
    n_layers=92,
    vocab_size=151552,
    n_heads=96,
    n_kv_heads=8,
    head_dim=128,
    attention_bias=True,
    qk_norm=True,
    rope_theta=1e6,
    rope_partial=0.5,
    n_dense_layers=3,
    dense_hidden=12288,
    n_experts=160,
    top_k=8,
    router_score="sigmoid",
    router_bias=True,
    routed_scale=2.5,
    router_groups=1,
    router_topk_groups=1,
    router_normalize=True,
    expert_hidden=1536,
    n_shared_experts=1,
    shared_hidden=1536,
    activation="silu",
    expert_format="bf16",
    rms_eps=1e-5,
    max_seq_len=131072,
    attention="gqa",
    ffn="dense+moe_full",
    residual="prenorm",
    n_mtp_layers=1,  # config.json num_nextn_predict_layers
)

QWEN3_235B = KIMI_K3.replace(
    name="qwen3-235b-a22b",
    d_model=4096,
    n_layers=94,
    vocab_size=151936,
    n_heads=64,
    n_kv_heads=4,
    head_dim=128,
    attention_bias=False,
    qk_norm=True,
    rope_theta=1e6,
    rope_partial=1.0,
    n_dense_layers=0,
    n_experts=128,
    top_k=8,
    router_score="softmax",
    router_bias=False,
    routed_scale=1.0,
    router_normalize=True,  # norm_topk_prob
    expert_hidden=1536,
    n_shared_experts=0,
    shared_hidden=1536,  # unused: no shared expert
    activation="silu",
    expert_format="bf16",
    rms_eps=1e-6,
    max_seq_len=40960,
    attention="gqa",
    ffn="moe_full",
    residual="prenorm",
)

# Minis: every feature of the family at mini sizes (d 512, 4 layers, vocab 2048, KV tiles of 32
# over a 128-token cache). Head dims stay 128 (a lane width); the rope dims stay the family's.
_MINI_SIZES = {"d_model": 512, "n_layers": 4, "vocab_size": 2048, "n_experts": 16, "top_k": 4,
               "expert_hidden": 256, "dense_hidden": 1024, "kv_tile": 32, "max_seq_len": 128}
DEEPSEEK_V3_MINI = DEEPSEEK_V3.replace(
    name="deepseek-v3-mini", **_MINI_SIZES, n_dense_layers=1, n_heads=2, mla_q_rank=256,
    mla_kv_rank=256, shared_hidden=256,
    router_groups=4, router_topk_groups=2)  # 4 groups of 4 experts, the best 2 groups eligible
GLM_4_5_MINI = GLM_4_5.replace(
    name="glm-4.5-mini", **_MINI_SIZES, n_dense_layers=1, n_heads=4, n_kv_heads=2,
    shared_hidden=256)
QWEN3_235B_MINI = QWEN3_235B.replace(
    name="qwen3-235b-a22b-mini", **_MINI_SIZES, n_heads=4, n_kv_heads=1, shared_hidden=256)


# GPT-OSS (openai/gpt-oss-20b and -120b config.json, docs/families.md §6): 2880 wide (padded to
# 23 lanes), 64 query / 8 K/V heads of 64 with biases and learned sinks, sliding-window (128) and
# full layers in turn, YaRN without truncation, 32 (128) experts of 2880 with biases, top 4 by a
# softmax over the 4 largest router logits, the clamped SwiGLU, MXFP4 experts as released.
GPT_OSS_20B = KIMI_K3.replace(
    name="gpt-oss-20b",
    d_model=2944,
    d_model_checkpoint=2880,
    n_layers=24,
    mla_first=0,  # unused (the Kimi pattern): any layer count
    vocab_size=201088,
    n_heads=64,
    n_kv_heads=8,
    head_dim=64,
    attention_bias=True,
    qk_norm=False,
    rope_theta=150000.0,
    rope_partial=1.0,
    yarn_factor=32.0,
    yarn_original_max_positions=4096,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=0.0,
    yarn_truncate=False,
    sliding_window=128,
    n_dense_layers=0,
    n_experts=32,
    top_k=4,
    router_score="topk_softmax",
    router_bias=True,
    routed_scale=1.0,
    router_groups=1,
    router_topk_groups=1,
    router_normalize=True,
    expert_hidden=2944,
    expert_hidden_checkpoint=2880,
    expert_bias=True,
    n_shared_experts=0,
    shared_hidden=128,  # unused: no shared expert
    activation="clamped_swiglu",
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    expert_format="mxfp4",
    rms_eps=1e-5,
    kv_tile=128,  # the window's 128 tokens span at most two tiles
    max_seq_len=131072,
    attention="gqa_sink_window,gqa_sink",
    ffn="moe_full",
    residual="prenorm",
)
GPT_OSS_120B = GPT_OSS_20B.replace(name="gpt-oss-120b", n_layers=36, n_experts=128)
# every GPT-OSS feature: both widths padded (352 -> 384, whole MXFP4 blocks as the checkpoint's
# 2880), head_dim 64 in groups of 4, a window of 48 tokens (not whole tiles) in a 128-token cache
GPT_OSS_MINI = GPT_OSS_20B.replace(
    name="gpt-oss-mini", d_model=384, d_model_checkpoint=352, n_layers=4, vocab_size=2048,
    n_heads=8, n_kv_heads=2, n_experts=16, top_k=4, expert_hidden=384,
    expert_hidden_checkpoint=352, sliding_window=48, kv_tile=32, max_seq_len=128)


PRESETS: dict[str, ModelConfig] = {c.name: c for c in (
    KIMI_K3, KIMI_K3_MINI, DEEPSEEK_V3, DEEPSEEK_V3_MINI, GLM_4_5, GLM_4_5_MINI,
    QWEN3_235B, QWEN3_235B_MINI, GPT_OSS_20B, GPT_OSS_120B, GPT_OSS_MINI)}


# One letter per attention kind in `layer_pattern` (another kind: its first letter, upper case).
PATTERN_LETTERS = {"kda": "K", "mla": "M", "gqa": "G", "mla_rope": "R", "gqa_sink": "S",
                   "gqa_sink_window": "W"}


def layer_pattern(cfg: ModelConfig) -> str:
    """One letter per layer's attention kind ('K' KDA, 'M' MLA, 'G' GQA, 'R' MLA with RoPE, 'S'
    GQA with sinks, 'W' the same over a sliding window);
    with attention residuals, blocks separated by spaces."""
    letters = [PATTERN_LETTERS.get(kind, kind[:1].upper()) for kind in cfg.attention_kinds]
    if cfg.residual != "attention_mix":
        return "".join(letters)
    blocks = ["".join(letters[i:i + cfg.attn_res_block])
              for i in range(0, cfg.n_layers, cfg.attn_res_block)]
    return " ".join(blocks)
