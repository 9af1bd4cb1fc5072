"""GQA decode attention (kind "gqa": GLM-4.5, Qwen3; docs/families.md): weights, KV cache,
reference sublayer.

n_heads query heads share n_kv_heads K/V heads in groups of G = n_heads / n_kv_heads (query head
h reads K/V head h // G), each head_dim wide. One decode step per row at position p:

    q = bf(x W_q + b_q) [H, D], k = bf(x W_k + b_k), v = bf(x W_v + b_v) [KV, D]
                                             (biases when cfg.attention_bias, added in f32)
    q_h = RMSNorm_γq(q_h), k_g = RMSNorm_γk(k_g)   per head, when cfg.qk_norm (before RoPE)
    q_h = bf(RoPE_p(q_h)), k_g = bf(RoPE_p(k_g))   the first cfg.rope_dim dims (`mkresearch.model.rope`)
    cache[g, p] = (k_g, v_g)                       the roped key is cached
    o_h = Σ_j α_hj v_{g,j} over slots 0..p, α = softmax(q_h · k_{g,j} · D^-½) (f32, online)
    out = bf(bf(o) W_o)

Order choices (module of record, the kernels follow them): the softmax runs online seeded by the
new token, then the cache `cfg.kv_tile` slots at a time (`numerics.online_softmax`); products
are per (row, K/V head), its G query heads padded to 8 rows (batch- and rank-invariant). HF
rounds q·W + b, the norm and each RoPE product to bf16; here each of the three steps rounds
once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mkresearch.model import numerics, rope, spec
from mkresearch.model.model_config import ModelConfig
from mkresearch.model.numerics import bf, bf16, f32, matmul, rms_norm


def params(cfg: ModelConfig) -> dict[str, spec.Param]:
    """Sharding (`mkresearch.sharding.layout`): W_q (and b_q) by the query heads, W_k, W_v (b_k, b_v) by
    the K/V heads, which split with the query heads that read them (with fewer K/V heads than head
    slices, each K/V head is replicated on the ranks of its query heads, as serving systems do);
    W_o by its d columns, the heads' outputs gathered first; the QK-norm gains whole."""
    d, heads, kv, dim = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q_cols, kv_cols = spec.split(1, spec.HEADS), spec.split(1, spec.KV_HEADS)
    table = {"w_q": spec.matrix(d, heads * dim, shard=q_cols),
             "w_k": spec.matrix(d, kv * dim, shard=kv_cols),
             "w_v": spec.matrix(d, kv * dim, shard=kv_cols)}
    if cfg.attention_bias:  # O(1) like the projections, so a kernel that drops it fails its test
        table.update({f"b_{n}": spec.Param((width,), bf16, ("normal", 0.5), shard=spec.split(0, by))
                      for n, width, by in (("q", heads * dim, spec.HEADS),
                                           ("k", kv * dim, spec.KV_HEADS),
                                           ("v", kv * dim, spec.KV_HEADS))})
    if cfg.qk_norm:
        table.update(q_norm=spec.norm((dim,)), k_norm=spec.norm((dim,)))
    table["w_o"] = spec.matrix(heads * dim, d, shard=spec.split(1, spec.MODEL_COLS),
                               gather=spec.HEADS)
    return table


def state(cfg: ModelConfig, seq_len: int) -> dict[str, spec.StateLeaf]:
    """The KV cache of one row: {"k", "v"} [n_kv_heads, S, head_dim] bf16 (k roped), split by
    the K/V heads."""
    shape, kv_heads = (cfg.n_kv_heads, seq_len, cfg.head_dim), spec.split(0, spec.KV_HEADS)
    return {"k": spec.StateLeaf(shape, bf16, spec.CACHE, 1, kv_heads),
            "v": spec.StateLeaf(shape, bf16, spec.CACHE, 1, kv_heads)}


def projections(p: dict[str, Any], x: jax.Array, positions: jax.Array,
                cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, H, D], k, v [B, KV, D] bf16: biased projections, QK-norm, RoPE at `positions`."""
    batch, dim = x.shape[0], cfg.head_dim

    def project(name: str, heads: int) -> jax.Array:
        y = matmul(x, p[f"w_{name}"])  # [B, heads·D] f32
        if cfg.attention_bias:
            y = y + p[f"b_{name}"].astype(f32)
        return bf(y).reshape(batch, heads, dim)

    q, k, v = project("q", cfg.n_heads), project("k", cfg.n_kv_heads), project("v", cfg.n_kv_heads)
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], cfg.rms_eps), rms_norm(k, p["k_norm"], cfg.rms_eps)
    cos, sin = rope.cos_sin(positions[:, None], rope.of(cfg, cfg.rope_dim))  # [B, 1, R/2]
    return bf(rope.rotate(q, cos, sin)), bf(rope.rotate(k, cos, sin)), v


def gqa_attention(p: dict[str, Any], x: jax.Array, cache: dict[str, jax.Array],
                  positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, dict]:
    """One GQA decode step. x [B, d] bf16 (normalised); cache {"k", "v"} [B, KV, S, D] bf16
    (this layer, batch-major); positions [B] i32. Returns (out [B, d] bf16, updated cache)."""
    batch, group = x.shape[0], cfg.n_heads // cfg.n_kv_heads
    q, k, v = projections(p, x, positions, cfg)
    cache = {"k": numerics.write_slot(cache["k"], k, positions, axis=1),  # [B, KV, S, D]
             "v": numerics.write_slot(cache["v"], v, positions, axis=1)}
    # query head h reads K/V head h // G: the new token's K/V repeated per query head
    k_new, v_new = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # [B, H, D]
    scale = rope.attention_scale(cfg, cfg.head_dim)
    new_score = numerics.dot_exact(q, k_new) * scale  # [B, H]
    # the cached scores as a [G, D] x [S, D]ᵀ product per (row, K/V head), the kernel's form:
    # one product per query head (a batched matvec) rounds some scores to other floats. Its G
    # rows padded to a multiple of 8 (`padded_rows`), as the kernel's (`kv_tiles.rows_dot_t`):
    # a rank holding one query head of a K/V head multiplies one row, which XLA:CPU sums in
    # another order than a row of the single device's G (issue 79: Qwen3's mini on 4 and 8
    # ranks); so are the softmax weights' products with the values (`online_softmax(padded=)`)
    q_groups = q.reshape(batch, cfg.n_kv_heads, group, cfg.head_dim)  # [B, KV, G, D]
    scores = numerics.padded_rows(lambda rows: numerics.einsum(
        "bkgd,bksd->bkgs", rows, cache["k"]), q_groups, axis=2)
    scores = scores.reshape(batch, cfg.n_heads, -1) * scale  # [B, H, S]
    o = bf(numerics.online_softmax(new_score, v_new, scores, cache["v"], positions,
                                   cfg.kv_tile, padded=True))  # [B, H, D]
    return bf(matmul(o.reshape(batch, cfg.n_heads * cfg.head_dim), p["w_o"])), cache


def sublayer(p: dict[str, Any], x: jax.Array, layer_state: dict, positions: jax.Array,
             cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    out, cache = gqa_attention(p, x, layer_state, positions, cfg)
    return out, cache, {}


STAGE = spec.register(spec.Stage(
    name="gqa", role=spec.ATTENTION, params=params, state=state, sublayer=sublayer,
    component=("gqa", lambda cfg: "GQA weights"), state_component=("gqa_cache", "GQA KV cache"),
    context_flops=lambda cfg: 2 * cfg.n_heads * 2 * cfg.head_dim,  # q·k and α·v per head
    description="grouped-query attention: K/V heads shared by query-head groups, QK-norm, "
                "partial RoPE, q/k/v bias"))
