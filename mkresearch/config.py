"""Model configurations: one frozen, self-validating dataclass and named presets.

The `kimi-k3` preset carries exactly the values of spec/kimi-k3.md §1. `kimi-k3-mini` keeps every
Kimi K3 feature (KDA+MLA pattern, dense layer 0, attention-residual blocks, padded latent MoE,
shared experts, sigmoid router with correction bias, SiTU) at sizes where a whole decode step runs
in TPU interpret mode in seconds. The shapes one rank of a sharded model sees come from
`mkresearch.layout` (`layout.rank_config(get_config("kimi-k3"))`: one of the release's 32 ranks).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

MLA_CACHE_LAYOUTS = ("expanded", "latent")
# Layer patterns: a pattern spans two kinds by the pattern fields, any other value is one stage
# kind (registered in mkresearch.spec) used by every layer.
KIMI_ATTENTION = "kda+mla"  # MLA at mla_first, every mla_every after it and (mla_last_layer) last
DENSE_THEN_MOE = "dense+moe"  # dense FFN in the first n_dense_layers, MoE after
RESIDUALS = ("attention_mix", "prenorm")  # Kimi's attention residuals; a classic residual stream
EXPERT_FORMATS = ("bf16", "fp8", "mxfp4")
ROUTER_SCORES = ("sigmoid", "softmax")
ACTIVATIONS = ("situ", "silu")

RING_MAX_DEPTH = 8  # slots of the megakernel's global weight ring, at most
RING_BLOCK_MULTIPLE = 64 * 1024  # one ring slot is a whole number of 64 KiB

LANE = 128  # TPU vreg lane width: the last dim of every VMEM block is a multiple of it
BF16_SUBLANE = 16  # bf16 packs two rows per 32-bit sublane: 16 x 128 tiles
FP8_BLOCK = 256  # K values sharing one power-of-two scale in the FP8 expert format (spec §7)
MXFP4_BLOCK = 32  # K values sharing one E8M0 scale in MXFP4 (spec §7)


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
    # KDA (spec §4)
    kda_head_dim: int
    kda_gate_rank: int
    kda_conv_size: int
    kda_decay_bound: float  # lower bound of the per-channel log decay (−5 in Kimi K3)
    # MLA (spec §5)
    mla_q_rank: int
    mla_kv_rank: int
    mla_qk_nope: int
    mla_qk_extra: int
    mla_v_dim: int
    mla_cache_layout: str
    # FFN (spec §6)
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
    # the megakernel's global weight ring (kernels/weight_stream.py): ring_depth VMEM slots of
    # ring_block_bytes each; ring_depth - 1 weight blocks fly ahead of the one being multiplied
    ring_depth: int
    ring_block_bytes: int
    # the model spec: which stage kind each layer's attention and FFN is (a pattern or one kind
    # for every layer), and how sublayer outputs join (mkresearch.spec)
    attention: str = KIMI_ATTENTION
    ffn: str = DENSE_THEN_MOE
    residual: str = "attention_mix"

    def __post_init__(self) -> None:
        _validate(self)

    # ---- the layers: (attention kind, FFN kind) each ---------------------------------------
    @property
    def layers(self) -> tuple[tuple[str, str], ...]:
        """(attention kind, FFN kind) of every layer, from the `attention` and `ffn` patterns."""
        return tuple(zip(self.attention_kinds, self.ffn_kinds))

    @property
    def attention_kinds(self) -> tuple[str, ...]:
        if self.attention != KIMI_ATTENTION:
            return (self.attention,) * self.n_layers
        mla = set(range(self.mla_first, self.n_layers, self.mla_every))
        if self.mla_last_layer:
            mla.add(self.n_layers - 1)
        return tuple("mla" if layer in mla else "kda" for layer in range(self.n_layers))

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        if self.ffn != DENSE_THEN_MOE:
            return (self.ffn,) * self.n_layers
        return tuple("dense" if layer < self.n_dense_layers else "moe"
                     for layer in range(self.n_layers))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The stage kinds the model uses, attention kinds first, each once, in layer order."""
        return tuple(dict.fromkeys(self.attention_kinds + self.ffn_kinds))

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """The layers whose attention or FFN is `kind` (its weights are stacked in this order)."""
        return tuple(layer for layer, pair in enumerate(self.layers) if kind in pair)

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

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# ---- validation ------------------------------------------------------------------------------
def _fail(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"ModelConfig.{field}={value!r} is invalid: {allowed}")


def _positive_int(cfg: ModelConfig, field: str, multiple: int = 1) -> None:
    value = getattr(cfg, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value % multiple:
        allowed = "a positive int" + (f" that is a multiple of {multiple}" if multiple > 1 else "")
        _fail(field, value, allowed)


def _choice(cfg: ModelConfig, field: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, field)
    if value not in choices:
        _fail(field, value, f"one of {', '.join(map(repr, choices))}")


def _positive_float(cfg: ModelConfig, field: str) -> None:
    value = getattr(cfg, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        _fail(field, value, "a finite number > 0")


def _validate(cfg: ModelConfig) -> None:
    if not isinstance(cfg.name, str) or not cfg.name:
        _fail("name", cfg.name, "a non-empty string")
    # lane dims of weight blocks: multiples of 128
    for field in ("d_model", "vocab_size", "kda_head_dim", "kda_gate_rank", "mla_q_rank",
                  "mla_kv_rank", "mla_qk_nope", "mla_v_dim", "dense_hidden", "expert_hidden",
                  "moe_latent", "moe_latent_padded", "shared_hidden"):
        _positive_int(cfg, field, LANE)
    for field in ("n_layers", "n_heads", "mla_every", "n_experts", "top_k", "attn_res_block",
                  "kda_conv_size", "mla_qk_extra"):
        _positive_int(cfg, field)
    _positive_int(cfg, "kv_tile", BF16_SUBLANE)
    _positive_int(cfg, "max_seq_len", cfg.kv_tile)
    if (isinstance(cfg.ring_depth, bool) or not isinstance(cfg.ring_depth, int)
            or not 2 <= cfg.ring_depth <= RING_MAX_DEPTH):
        _fail("ring_depth", cfg.ring_depth, f"an int in [2, {RING_MAX_DEPTH}] (2 = double buffering)")
    _positive_int(cfg, "ring_block_bytes", RING_BLOCK_MULTIPLE)
    if not isinstance(cfg.mla_first, int) or not 0 <= cfg.mla_first < cfg.n_layers:
        _fail("mla_first", cfg.mla_first, f"an int in [0, n_layers={cfg.n_layers})")
    if not isinstance(cfg.mla_last_layer, bool):
        _fail("mla_last_layer", cfg.mla_last_layer, "True or False")
    if not isinstance(cfg.router_bias, bool):
        _fail("router_bias", cfg.router_bias, "True or False")
    if (isinstance(cfg.kda_decay_bound, bool) or not isinstance(cfg.kda_decay_bound, (int, float))
            or not cfg.kda_decay_bound < 0):
        _fail("kda_decay_bound", cfg.kda_decay_bound, "a negative number (Kimi K3: -5)")
    _choice(cfg, "mla_cache_layout", MLA_CACHE_LAYOUTS)
    _choice(cfg, "expert_format", EXPERT_FORMATS)
    _choice(cfg, "router_score", ROUTER_SCORES)
    _choice(cfg, "activation", ACTIVATIONS)
    if not isinstance(cfg.n_dense_layers, int) or not 0 <= cfg.n_dense_layers < cfg.n_layers:
        _fail("n_dense_layers", cfg.n_dense_layers, f"an int in [0, n_layers={cfg.n_layers})")
    if cfg.top_k > cfg.n_experts:
        _fail("top_k", cfg.top_k, f"at most n_experts={cfg.n_experts}")
    if cfg.moe_latent_padded < cfg.moe_latent:
        _fail("moe_latent_padded", cfg.moe_latent_padded, f">= moe_latent={cfg.moe_latent}")
    # quantised experts are blocked along K (the input dim): latent for W1/W3, hidden for W2
    block = {"bf16": 1, "fp8": FP8_BLOCK, "mxfp4": MXFP4_BLOCK}.get(cfg.expert_format, 1)
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
    # stage kinds are checked against the registry where the model is built (mkresearch.spec)
    for field in ("attention", "ffn"):
        value = getattr(cfg, field)
        if not isinstance(value, str) or not value.replace("+", "").replace("_", "").isalnum():
            _fail(field, value, "a stage kind registered in mkresearch.spec, or the pattern "
                  f"{KIMI_ATTENTION!r} / {DENSE_THEN_MOE!r}")
    _choice(cfg, "residual", RESIDUALS)


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

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (KIMI_K3, KIMI_K3_MINI)}


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The preset called `name`, with optional field overrides (validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(PRESETS)}")
    config = PRESETS[name]
    return config.replace(**overrides) if overrides else config


def layer_pattern(cfg: ModelConfig) -> str:
    """'K' (KDA) or 'M' (MLA) per layer, attention-residual blocks separated by spaces."""
    letters = ["M" if cfg.is_mla(layer) else "K" for layer in range(cfg.n_layers)]
    blocks = ["".join(letters[i:i + cfg.attn_res_block])
              for i in range(0, cfg.n_layers, cfg.attn_res_block)]
    return " ".join(blocks)
