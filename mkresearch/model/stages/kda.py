"""KDA, Kimi Delta Attention (docs/kimi-k3.md §4): weights, recurrent state, reference sublayer.

One decode step per row: low-rank decay gate, short causal depthwise conv on q, k, v, L2 norms,
the gated delta rule on a [D, D] f32 state per head, output RMSNorm and sigmoid gate. Where the
spec leaves the order open the update is S̄ + k (β (v − S̄ᵀk))ᵀ, the kernel's association.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mkresearch.model import numerics, spec
from mkresearch.model.model_config import ModelConfig
from mkresearch.model.numerics import (
    bf,
    bf16,
    f32,
    matmul,
    ordered_sum,
    rms_norm,
    sequence_sum,
)


def params(cfg: ModelConfig) -> dict[str, spec.Param]:
    """Sharding (`mkresearch.sharding.layout`): every per-head axis splits by heads; W_o by its d columns,
    the heads' outputs gathered first; the low-rank gate's W_fa by its columns (a single lane
    tile: whole on every rank)."""
    d, h, hd, rank = cfg.d_model, cfg.n_heads, cfg.kda_width, cfg.kda_gate_rank
    cols, rows = spec.split(1, spec.HEADS), spec.split(0, spec.HEADS)
    if cfg.kda_output_gate_rank:  # Kimi Linear: u = bf(bf(x W_ga) W_gb), W_ga whole per rank
        gate = {"w_ga": spec.matrix(d, cfg.kda_output_gate_rank,
                                    shard=spec.split(1, spec.DOWN_COLS)),
                "w_gb": spec.matrix(cfg.kda_output_gate_rank, hd, shard=cols)}
    else:
        gate = {"w_g": spec.matrix(d, hd, shard=cols)}
    return {
        "w_fa": spec.matrix(d, rank, shard=spec.split(1, spec.DOWN_COLS)),
        "w_fb": spec.matrix(rank, hd, shard=cols),
        "w_q": spec.matrix(d, hd, shard=cols), "w_k": spec.matrix(d, hd, shard=cols),
        "w_v": spec.matrix(d, hd, shard=cols), **gate,
        "w_b": spec.matrix(d, h, shard=cols),
        "conv_w": spec.Param((3, cfg.kda_conv_size, hd), bf16,
                             ("normal", cfg.kda_conv_size ** -0.5), shard=spec.split(2, spec.HEADS)),
        # exp(a_log) in [1, 4]: the decay gate responds to g_raw without saturating
        "a_log": spec.Param((h,), f32, ("log_uniform", 1.0, 4.0), shard=rows),
        "dt_bias": spec.Param((hd,), f32, ("uniform", -1.0, 1.0), shard=rows),
        "o_norm": spec.norm((cfg.kda_head_dim,)),
        "w_o": spec.matrix(hd, d, shard=spec.split(1, spec.MODEL_COLS), gather=spec.HEADS),
    }


def state(cfg: ModelConfig, seq_len: int) -> dict[str, spec.StateLeaf]:
    """conv: the last conv_size-1 pre-conv q/k/v, oldest first; recurrent: S[key, value] per head.
    Both split by heads."""
    h, dk = cfg.n_heads, cfg.kda_head_dim
    return {"conv": spec.StateLeaf((cfg.kda_conv_size - 1, 3, h, dk), bf16,
                                   shard=spec.split(2, spec.HEADS)),
            "recurrent": spec.StateLeaf((h, dk, dk), f32, shard=spec.split(0, spec.HEADS))}


def kda_projections(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, ...]:
    """The matmuls of a KDA step, bf16: q̃, k̃, ṽ, u [B, H, D], b [B, H], g_raw [B, H, D]."""
    B = x.shape[0]
    H, D = cfg.n_heads, cfg.kda_head_dim
    q_pre, k_pre, v_pre = (bf(matmul(x, p[name])).reshape(B, H, D)
                           for name in ("w_q", "w_k", "w_v"))
    if cfg.kda_output_gate_rank:  # low-rank output gate (Kimi Linear)
        u = bf(matmul(bf(matmul(x, p["w_ga"])), p["w_gb"])).reshape(B, H, D)
    else:
        u = bf(matmul(x, p["w_g"])).reshape(B, H, D)
    b = bf(matmul(x, p["w_b"]))  # [B, H]
    # low-rank decay gate: f = bf(x W_fa), g_raw = bf(f W_fb)
    f = bf(matmul(x, p["w_fa"]))  # [B, R]
    g_raw = bf(matmul(f, p["w_fb"])).reshape(B, H, D)
    return q_pre, k_pre, v_pre, u, b, g_raw


def kda_log_decay(p: dict[str, Any], g_raw: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Log decay per key channel λ [B, H, D] f32 of g_raw [B, H, D] f32: "bounded" (Kimi K3)
    bound · σ(exp(A_log_h) · (g_raw + dt_bias)) ∈ (bound, 0); "softplus" (Kimi Linear)
    −exp(A_log_h) · softplus(g_raw + dt_bias) < 0."""
    H, D = cfg.n_heads, cfg.kda_head_dim
    decay_rate = jnp.exp(p["a_log"].astype(f32))[:, None]  # [H, 1]
    g = g_raw + p["dt_bias"].astype(f32).reshape(H, D)
    if cfg.kda_decay == "softplus":
        return -decay_rate * jax.nn.softplus(g)
    return cfg.kda_decay_bound * jax.nn.sigmoid(decay_rate * g)


def kda_attention(p: dict[str, Any], x: jax.Array, conv: jax.Array, state: jax.Array,
                  cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One KDA decode step. x [B, d] bf16 (normalised); conv [B, conv_size-1, 3, H, D] bf16
    (pre-conv q/k/v, oldest first); state [B, H, D, D] f32 (S[key, value]).
    Returns (out [B, d] bf16, new conv, new state)."""
    B = x.shape[0]
    H, D = cfg.n_heads, cfg.kda_head_dim
    q_pre, k_pre, v_pre, u, b, g_raw = kda_projections(p, x, cfg)
    g_raw = g_raw.astype(f32)
    log_decay = kda_log_decay(p, g_raw, cfg)  # [B, H, D]

    # short causal depthwise conv over [conv state (oldest first) ; current], tap -1 = current
    current = jnp.stack([q_pre, k_pre, v_pre], axis=1)  # [B, 3, H, D]
    window = jnp.concatenate([conv, current[:, None]], axis=1)  # [B, conv_size, 3, H, D]
    taps = p["conv_w"].astype(f32).reshape(3, cfg.kda_conv_size, H, D).transpose(1, 0, 2, 3)
    conv_out = bf(jax.nn.silu(sequence_sum(window[:, j].astype(f32) * taps[j]
                                            for j in range(cfg.kda_conv_size))))  # [B, 3, H, D]
    new_conv = window[:, 1:]  # drop the oldest: [B, conv_size-1, 3, H, D]
    q_hat, k_hat, v_hat = (conv_out[:, i].astype(f32) for i in range(3))  # [B, H, D] each

    # L2 norms (eps cfg.l2_eps); q also scaled by D^-½; β = σ(b)
    q = q_hat * lax.rsqrt(ordered_sum(q_hat * q_hat, keepdims=True) + cfg.l2_eps) * D ** -0.5
    k = k_hat * lax.rsqrt(ordered_sum(k_hat * k_hat, keepdims=True) + cfg.l2_eps)
    v = v_hat
    beta = jax.nn.sigmoid(b.astype(f32))  # [B, H]

    # delta rule: S̄ = Diag(e^λ) S (scales key row c); S = S̄ + β k (v − S̄ᵀk)ᵀ; o = Sᵀq
    decayed = jnp.exp(log_decay)[..., None] * state  # [B, H, D, D]
    predicted = head_rows(k, decayed)  # S̄ᵀk [B, H, D]
    new_state = decayed + k[..., :, None] * (beta[..., None] * (v - predicted))[..., None, :]
    o = head_rows(q, new_state)  # Sᵀq [B, H, D]

    # y_h = bf(RMSNorm_γo(bf(o_h)) ⊙ bf(σ(u_h))), γ_o shared by all heads; out = y W_o
    gate = bf(jax.nn.sigmoid(u.astype(f32)))
    y = bf(rms_norm(bf(o), p["o_norm"], cfg.rms_eps).astype(f32) * gate.astype(f32))
    out = bf(matmul(y.reshape(B, H * D), p["w_o"]))
    return out, new_conv, new_state


def head_rows(v: jax.Array, m: jax.Array) -> jax.Array:
    """vᵀ M per row and head: v [B, H, D], m [B, H, D, D] f32 -> [B, H, D] f32 at HIGHEST, each
    row and head multiplied alone as the kernel's loops do (`numerics.row_product`)."""
    def row(v_row, m_row):  # [H, D], [H, D, D]
        return jnp.stack([numerics.row_product(v_row[h], m_row[h])
                          for h in range(v.shape[1])])  # [H, D]

    return jax.lax.map(lambda args: row(*args), (v, m))


def sublayer(p: dict[str, Any], x: jax.Array, layer_state: dict, positions: jax.Array,
             cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    del positions  # a recurrent state: no cache slot
    out, conv, recurrent = kda_attention(p, x, layer_state["conv"], layer_state["recurrent"], cfg)
    return out, {"conv": conv, "recurrent": recurrent}, {}


STAGE = spec.register(spec.Stage(
    name="kda", role=spec.ATTENTION, params=params, state=state, sublayer=sublayer,
    component=("kda", lambda cfg: "KDA weights"),
    state_component=("kda_state", "KDA state (conv + recurrent)"),
    description="Kimi Delta Attention: gated delta rule on a recurrent [D, D] state per head"))
