"""DeepSeek-V3's MLA (kind "mla_rope"; docs/families.md): multi-head latent attention with the
decoupled rope key, YaRN, no output gate, the latent cache.

    c_q = RMSNorm(bf(x W_qa)); q = bf(c_q W_qb), per head [q^C nope | q^R rope]
                                                               (no query LoRA: q = bf(x W_q))
    [c_kv | k^R] = bf(x W_kva); ĉ = RMSNorm(c_kv)             k^R: one rope key shared by heads
    q^R_h = bf(RoPE_p(q^R_h)), k^R = bf(RoPE_p(k^R))           the mla_qk_extra dims, YaRN
    cache[p] = (ĉ, k^R)                                        [kv_rank] + [rope] per token
    score_hj = (q̃_h · ĉ_j + q^R_h · k^R_j) · scale             q̃_h = bf(q^C_h W_kb_hᵀ) (absorbed)
    o_h = bf(bf(Σ_j α_hj ĉ_j) W_vb_h); out = bf(bf(o) W_o)     α = softmax (f32, online)

scale = (nope + rope)^-½ · mscale(factor, mscale_all_dim)² (`rope.attention_scale`: DeepSeek-V3
192^-½ · 1.3689²). The cache holds the rope key already rotated (DeepSeek's pe_cache), in the
rotate-half convention of `mkresearch.model.rope` (the released W_qb / W_kva rope columns are
de-interleaved once at load). W_kvb is absorbed as in Kimi's latent layout (`stages.mla`, whose
online softmax and cache write this reuses); the weights are MLA's without the gate W_g.
"""

from __future__ import annotations

from typing import Any

import jax

from mkresearch.model import numerics, rope, spec
from mkresearch.model.model_config import ModelConfig
from mkresearch.model.numerics import bf, bf16, matmul, rms_norm
from mkresearch.model.stages import mla


def params(cfg: ModelConfig) -> dict[str, spec.Param]:
    """MLA's weights and sharding rules (`stages.mla.params`: heads tensor parallel, W_o by its d
    columns, the latent down-projections by their columns) without the gate."""
    table = mla.params(cfg)
    table.pop("w_g", None)  # DeepSeek's MLA has no output gate
    return table


def state(cfg: ModelConfig, seq_len: int) -> dict[str, spec.StateLeaf]:
    """The latent cache of one row: {"ckv" [S, kv_rank] (ĉ), "kpe" [S, rope] (k^R, roped)},
    shared by all heads: every rank holds it whole (as Kimi K3's latent MLA cache)."""
    whole = spec.REPLICATED
    return {"ckv": spec.StateLeaf((seq_len, cfg.mla_kv_rank), bf16, spec.CACHE, 0, whole),
            "kpe": spec.StateLeaf((seq_len, cfg.mla_qk_extra), bf16, spec.CACHE, 0, whole)}


def queries_and_keys(p: dict[str, Any], x: jax.Array, positions: jax.Array,
                     cfg: ModelConfig) -> tuple[jax.Array, ...]:
    """q^C [B, H, nope], q^R [B, H, rope] (roped), ĉ [B, kv_rank], k^R [B, rope] (roped), bf16."""
    batch, heads, nope, rank = x.shape[0], cfg.n_heads, cfg.mla_qk_nope, cfg.mla_kv_rank
    q = mla.queries(p, x, cfg).reshape(batch, heads, cfg.mla_qk_dim)
    kv = bf(matmul(x, p["w_kva"]))  # [B, rank + rope]
    c_hat = rms_norm(kv[:, :rank], p["kv_norm"], cfg.rms_eps)
    cos, sin = rope.cos_sin(positions, rope.of(cfg, cfg.mla_qk_extra))  # [B, rope/2]
    q_rope = bf(rope.rotate(q[..., nope:], cos[:, None], sin[:, None]))
    k_rope = bf(rope.rotate(kv[:, rank:], cos, sin))
    return q[..., :nope], q_rope, c_hat, k_rope


def mla_rope_attention(p: dict[str, Any], x: jax.Array, cache: dict[str, jax.Array],
                       positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, dict]:
    """One decode step. x [B, d] bf16 (normalised); cache {"ckv" [B, S, kv_rank], "kpe"
    [B, S, rope]} bf16; positions [B] i32. Returns (out [B, d] bf16, updated cache)."""
    batch, heads, nope, rank = x.shape[0], cfg.n_heads, cfg.mla_qk_nope, cfg.mla_kv_rank
    q_nope, q_rope, c_hat, k_rope = queries_and_keys(p, x, positions, cfg)
    cache = {"ckv": numerics.write_slot(cache["ckv"], c_hat, positions, axis=0),  # [B, S, rank]
             "kpe": numerics.write_slot(cache["kpe"], k_rope, positions, axis=0)}  # [B, S, rope]
    w_kvb = p["w_kvb"].reshape(rank, heads, nope + cfg.mla_v_dim)
    w_kb, w_vb = w_kvb[..., :nope], w_kvb[..., nope:]  # [rank, H, nope], [rank, H, v]
    q_absorbed = bf(mla.head_products(q_nope, w_kb, contract=1))  # [B, H, rank], as the kernel
    scale = rope.attention_scale(cfg, cfg.mla_qk_dim)
    new_score = (numerics.dot_exact(q_absorbed, c_hat[:, None])
                 + numerics.dot_exact(q_rope, k_rope[:, None])) * scale  # [B, H]
    scores = mla.latent_scores(q_absorbed, cache["ckv"], q_rope, cache["kpe"]) * scale
    context = bf(numerics.online_softmax(new_score, c_hat, scores, cache["ckv"], positions,
                                 cfg.kv_tile, padded=True))  # [B, H, rank]: Σ α ĉ
    o = bf(mla.head_products(context, w_vb, contract=0))  # [B, H, v]
    return bf(matmul(o.reshape(batch, heads * cfg.mla_v_dim), p["w_o"])), cache


def sublayer(p: dict[str, Any], x: jax.Array, layer_state: dict, positions: jax.Array,
             cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    out, cache = mla_rope_attention(p, x, layer_state, positions, cfg)
    return out, cache, {}


def check(cfg: ModelConfig) -> None:
    if cfg.mla_cache_layout != "latent":
        raise ValueError(f"ModelConfig.mla_cache_layout={cfg.mla_cache_layout!r} is invalid with "
                         f"attention={cfg.attention!r}: MLA with RoPE caches the latent "
                         "(mla_cache_layout='latent')")
    if cfg.mla_qk_extra % 2:
        raise ValueError(f"ModelConfig.mla_qk_extra={cfg.mla_qk_extra} is invalid with "
                         f"attention={cfg.attention!r}: the rope dims rotate in pairs (even)")


STAGE = spec.register(spec.Stage(
    name="mla_rope", role=spec.ATTENTION, params=params, state=state, sublayer=sublayer,
    check=check, component=("mla_rope", lambda cfg: "MLA weights"),
    state_component=("mla_rope_cache", "MLA latent cache (ĉ + rope key)"),
    # absorbed: q̃·ĉ + q^R·k^R, then Σ α ĉ, per head and cached token
    context_flops=lambda cfg: 2 * cfg.n_heads * (2 * cfg.mla_kv_rank + cfg.mla_qk_extra),
    description="DeepSeek MLA: latent cache + decoupled rope key, YaRN, no output gate"))
