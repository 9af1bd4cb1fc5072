"""MLA decode attention, no RoPE, output-gated (docs/kimi-k3.md §5): weights, KV cache, reference.

Two cache layouts (`cfg.mla_cache_layout`): expanded per-head K and V, as the released kernels
cache them, or the latent ĉ and k^X shared by all heads with W_kvb absorbed (64x fewer bytes per
token). The softmax runs online in f32, seeded by the new token, then the cache `cfg.kv_tile`
slots at a time: the order a decode kernel streams in.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mkresearch.model import numerics, spec
from mkresearch.model.model_config import ModelConfig
from mkresearch.model.numerics import bf, bf16, f32, matmul, rms_norm


def params(cfg: ModelConfig) -> dict[str, spec.Param]:
    """Sharding (`mkresearch.sharding.layout`): per-head columns (W_qb, W_kvb, W_g) split by heads; W_o by
    its d columns, the heads' outputs gathered first; the latent down-projections W_qa, W_kva by
    their columns."""
    d, h = cfg.d_model, cfg.n_heads
    cols, d_rows = spec.split(1, spec.HEADS), spec.split(1, spec.DOWN_COLS)
    if cfg.mla_q_rank == 0:  # no query LoRA (Moonlight, Kimi Linear): W_q [d, H·qk] by heads
        queries = {"w_q": spec.matrix(d, h * cfg.mla_qk_dim, shard=cols)}
    else:
        queries = {"w_qa": spec.matrix(d, cfg.mla_q_rank, shard=d_rows),
                   "q_norm": spec.norm((cfg.mla_q_rank,)),
                   "w_qb": spec.matrix(cfg.mla_q_rank, h * cfg.mla_qk_dim, shard=cols)}
    return {
        **queries,
        "w_kva": spec.matrix(d, cfg.mla_kv_rank + cfg.mla_qk_extra, shard=d_rows),
        "kv_norm": spec.norm((cfg.mla_kv_rank,)),
        "w_kvb": spec.matrix(cfg.mla_kv_rank, h * (cfg.mla_qk_nope + cfg.mla_v_dim), shard=cols),
        **({"w_g": spec.matrix(d, h * cfg.mla_v_dim, shard=cols)} if cfg.mla_output_gate else {}),
        "w_o": spec.matrix(h * cfg.mla_v_dim, d, shard=spec.split(1, spec.MODEL_COLS),
                           gather=spec.HEADS),
    }


def state(cfg: ModelConfig, seq_len: int) -> dict[str, spec.StateLeaf]:
    """The KV cache of one row: expanded {"k" [H, S, k_padded], "v" [H, S, v]} (split by heads)
    or latent {"ckv" [S, kv_rank], "kx" [S, extra]} (shared by all heads: every rank holds it
    whole), bf16."""
    h, cache = cfg.n_heads, spec.CACHE
    if cfg.mla_cache_layout == "expanded":
        heads = spec.split(0, spec.HEADS)
        return {"k": spec.StateLeaf((h, seq_len, cfg.mla_k_padded), bf16, cache, 1, heads),
                "v": spec.StateLeaf((h, seq_len, cfg.mla_v_dim), bf16, cache, 1, heads)}
    return {"ckv": spec.StateLeaf((seq_len, cfg.mla_kv_rank), bf16, cache, 0, spec.REPLICATED),
            "kx": spec.StateLeaf((seq_len, cfg.mla_qk_extra), bf16, cache, 0, spec.REPLICATED)}


def mla_attention(p: dict[str, Any], x: jax.Array, cache: dict[str, jax.Array],
                  positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One MLA decode step (no RoPE, output-gated). x [B, d] bf16 (normalised); positions [B] i32.

    cache (this layer, batch-major), by cfg.mla_cache_layout:
      expanded: {"k": [B, H, S, mla_k_padded] ([k^C | k^X | 0]), "v": [B, H, S, v]} bf16
      latent:   {"ckv": [B, S, kv_rank] (ĉ), "kx": [B, S, extra]} bf16
    The latent layout absorbs W_kvb: score_h = q̃_h·ĉ + q^X_h·k^X with q̃_h = bf(q^C_h W_kb_hᵀ),
    and o_h = bf(bf(Σ α ĉ) W_vb_h). Rounding differs from expanded only there: expanded rounds
    k^C = bf(ĉ W_kb) and V = bf(ĉ W_vb) per cached token, latent rounds q̃ and Σαĉ instead.
    Returns (out [B, d] bf16, updated cache).
    """
    nope, extra = cfg.mla_qk_nope, cfg.mla_qk_extra
    q_nope, q_extra, c_hat, k_extra = mla_inputs(p, x, cfg)
    w_kb, w_vb = split_kvb(p, cfg)  # [rank, H, nope], [rank, H, v]
    scale = cfg.mla_qk_dim ** -0.5
    # scores over slots 0..p: the new token's (slot p) and the cache's (slot p is masked there)

    if cfg.mla_cache_layout == "expanded":
        k_nope, v_new, k_new = expanded_entry(p, c_hat, k_extra, cfg)
        cache = {"k": numerics.write_slot(cache["k"], k_new, positions, axis=1),  # [B, H, S, k_padded]
                 "v": numerics.write_slot(cache["v"], v_new, positions, axis=1)}  # [B, H, S, v]
        # per head: q^C·k^C + q^X·k^X (the zero pad columns of the cache are left out)
        new_score = (numerics.dot_exact(q_nope, k_nope) + numerics.dot_exact(q_extra, k_extra[:, None])) * scale
        scores = (numerics.einsum("bhn,bhsn->bhs", q_nope, cache["k"][..., :nope])
                  + numerics.einsum("bhe,bhse->bhs", q_extra,
                                    cache["k"][..., nope:nope + extra])) * scale  # [B, H, S]
        o = bf(numerics.online_softmax(new_score, v_new, scores, cache["v"], positions, cfg.kv_tile))
    else:
        cache = {"ckv": numerics.write_slot(cache["ckv"], c_hat, positions, axis=0),  # [B, S, rank]
                 "kx": numerics.write_slot(cache["kx"], k_extra, positions, axis=0)}  # [B, S, extra]
        q_absorbed = bf(head_products(q_nope, w_kb, contract=1))  # [B, H, rank]
        new_score = (numerics.dot_exact(q_absorbed, c_hat[:, None])
                     + numerics.dot_exact(q_extra, k_extra[:, None])) * scale  # [B, H]
        scores = latent_scores(q_absorbed, cache["ckv"], q_extra, cache["kx"]) * scale
        context = bf(numerics.online_softmax(new_score, c_hat, scores, cache["ckv"], positions,
                                     cfg.kv_tile, padded=True))  # [B, H, rank]: Σ α ĉ
        o = bf(head_products(context, w_vb, contract=0))  # [B, H, v]
    return gated_output(p, x, o, cfg), cache


def latent_scores(q_absorbed: jax.Array, ckv: jax.Array, q_extra: jax.Array,
                  k_extra: jax.Array) -> jax.Array:
    """The latent layout's cached scores before the scale, q̃ ĉᵀ + q^X k^Xᵀ [B, H, S] f32: q̃
    [B, H, rank] and q^X [B, H, e] against the cache ĉ [B, S, rank] and k^X [B, S, e], all
    heads of a row in one product each, its H rows padded to a multiple of 8
    (`numerics.padded_rows`) as the kernel's (`kv_tiles.rows_dot_t`: a rank holding fewer
    heads multiplies fewer rows)."""
    def heads(q, cached):
        return numerics.padded_rows(lambda rows: numerics.einsum(
            "bhr,bsr->bhs", rows, cached), q, axis=1)

    return heads(q_absorbed, ckv) + heads(q_extra, k_extra)


def head_products(a: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    """a [B, H, K] times each head's matrix of w ([N, H, K] contracting its K, contract=1, or
    [K, H, N], contract=0) -> [B, H, N] f32: row by row, head by head, as the kernel's row loop
    multiplies (kernels/stages/mla.py), each row as `numerics.row_product` multiplies it. A
    product batched over rows and heads sums an element in another order now and then on XLA:CPU
    (a head's q̃ rounded to another bf16 at seed 5 of kimi-k3-mini, the logits then 0.045 apart)."""
    def row(a_row):  # [H, K]
        return jnp.stack([numerics.row_product(a_row[h], w[:, h, :], contract)
                          for h in range(a.shape[1])])  # [H, N]

    return jax.lax.map(row, a)


def mla_inputs(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, ...]:
    """The per-token projections of rows x [N, d] bf16: q^C [N, H, nope], q^X [N, H, extra],
    ĉ [N, kv_rank], k^X [N, extra] (bf16)."""
    B = x.shape[0]
    H, nope, rank, eps = cfg.n_heads, cfg.mla_qk_nope, cfg.mla_kv_rank, cfg.rms_eps
    q = queries(p, x, cfg).reshape(B, H, nope + cfg.mla_qk_extra)  # per head [q^C | q^X]
    # keys/values: [c_kv | k^X] = bf(x W_kva); ĉ = RMSNorm(c_kv); k^X shared, not normalised
    kv = bf(matmul(x, p["w_kva"]))
    c_hat = rms_norm(kv[:, :rank], p["kv_norm"], eps)
    return q[..., :nope], q[..., nope:], c_hat, kv[:, rank:]


def queries(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The queries of rows x [N, d] bf16, [N, H·qk] bf16: c_q = RMSNorm(bf(x W_qa)), q = bf(c_q
    W_qb); without a query LoRA (mla_q_rank 0) q = bf(x W_q)."""
    if cfg.mla_q_rank == 0:
        return bf(matmul(x, p["w_q"]))
    c_q = rms_norm(bf(matmul(x, p["w_qa"])), p["q_norm"], cfg.rms_eps)
    return bf(matmul(c_q, p["w_qb"]))


def split_kvb(p: dict[str, Any], cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """W_kvb per head: W_kb [rank, H, nope] and W_vb [rank, H, v]."""
    w_kvb = p["w_kvb"].reshape(cfg.mla_kv_rank, cfg.n_heads, cfg.mla_qk_nope + cfg.mla_v_dim)
    return w_kvb[..., :cfg.mla_qk_nope], w_kvb[..., cfg.mla_qk_nope:]


def expanded_entry(p: dict[str, Any], c_hat: jax.Array, k_extra: jax.Array,
                   cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The expanded cache entry of rows ĉ [N, rank], k^X [N, extra]: k^C [N, H, nope], v [N, H, v]
    and the cached key [k^C | k^X | 0] [N, H, mla_k_padded] (bf16)."""
    B, H, nope, extra = c_hat.shape[0], cfg.n_heads, cfg.mla_qk_nope, cfg.mla_qk_extra
    kvb = bf(matmul(c_hat, p["w_kvb"])).reshape(B, H, nope + cfg.mla_v_dim)
    k_nope, v_new = kvb[..., :nope], kvb[..., nope:]  # [B, H, nope], [B, H, v]
    pad = jnp.zeros((B, H, cfg.mla_k_padded - cfg.mla_qk_dim), bf16)
    k_new = jnp.concatenate([k_nope, jnp.broadcast_to(k_extra[:, None], (B, H, extra)), pad], -1)
    return k_nope, v_new, k_new


def gated_output(p: dict[str, Any], x: jax.Array, o: jax.Array, cfg: ModelConfig) -> jax.Array:
    """y_h = bf(o_h ⊙ bf(σ(bf(x W_g)_h))); out = bf(y W_o) [N, d]: x [N, d], o [N, H, v] bf16.
    Without the gate (mla_output_gate False: Kimi Linear) y = o."""
    y = o.reshape(x.shape[0], cfg.n_heads * cfg.mla_v_dim)  # [N, H*v]
    if cfg.mla_output_gate:
        gate = bf(jax.nn.sigmoid(bf(matmul(x, p["w_g"])).astype(f32)))  # [N, H*v]
        y = bf(y.astype(f32) * gate.astype(f32))
    return bf(matmul(y, p["w_o"]))


def sublayer(p: dict[str, Any], x: jax.Array, layer_state: dict, positions: jax.Array,
             cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    out, cache = mla_attention(p, x, layer_state, positions, cfg)
    return out, cache, {}


STAGE = spec.register(spec.Stage(
    name="mla", role=spec.ATTENTION, params=params, state=state, sublayer=sublayer,
    component=("mla", lambda cfg: "MLA weights"), state_component=("mla_cache", "MLA KV cache"),
    context_flops=lambda cfg: 2 * cfg.n_heads * (cfg.mla_qk_dim + cfg.mla_v_dim),  # q·K, α·V
    description="multi-head latent attention, expanded or latent KV cache, output-gated"))
