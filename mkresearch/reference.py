"""The reference decode step of Kimi K3 in plain JAX: the oracle every kernel is tested against.

This module IS the spec (spec/kimi-k3.md §2–§6): read it side by side with the spec. Conventions:
- `bf(x)` rounds to bf16 exactly where the spec writes bf(...);
- every matmul takes bf16 inputs and accumulates in f32 (`_mm`); f32 x f32 contractions (the KDA
  recurrence, softmax-weighted sums) use Precision.HIGHEST so a TPU computes them in full f32 too;
- weights are [in, out]; one layer's weights `p` are a slice of the stacked pytree (`layer_params`).

Choices where the spec is silent (documented, used by the kernels too):
- Sublayer outputs that feed the bf16 partial sum P are rounded once: attention `a = bf(y W_o)`;
  `routed_experts` returns f32 so `moe_ffn` rounds `bf(routed + shared)` once, as §6.6 says.
- `hidden_rms[ℓ]` is the RMS (f32) of h, the Mix output that enters layer ℓ (§3 step 2.1).
- Latent MLA rounds its absorbed query q̃ and its latent context Σαĉ to bf16 (they feed the MXU);
  see `mla_attention` for where that differs from the expanded layout.
- A token's position p is the cache slot it is written to; it attends to slots 0..p.
- Where the spec leaves a summation order open, the order is one a decode kernel streams in, so
  the kernels can match to the bit: MLA's f32 online softmax starts from the new token and then
  takes the cache `cfg.kv_tile` slots at a time (`_online_softmax`); the MoE combine
  Σ w_e y_e adds the experts in ascending id (batch-invariant); the KDA update is
  S̄ + k (β (v − S̄ᵀk))ᵀ.
- Batch invariance: a row's logits, caches and states are the same bits whatever the other rows
  and the batch size. Every reduction is `ordered_sum` (one written-out order) and no matmul
  runs with a single row (`rows_at_least_two`); per-row products (attention, experts) are
  batched over (row, head) or (row, expert), never stacked along their rows.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mkresearch.config import LANE, ModelConfig
from mkresearch.sampling import sample
from mkresearch.weights import dequantize

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
HIGHEST = lax.Precision.HIGHEST


def bf(x: jax.Array) -> jax.Array:
    """Round to bf16 (the spec's bf(...))."""
    return x.astype(bf16)


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] with bf16 inputs and f32 accumulation (how every matmul of the model
    runs), batch-invariant: see `rows_at_least_two`."""
    return rows_at_least_two(
        lambda a2: jnp.matmul(a2.astype(bf16), b.astype(bf16), preferred_element_type=f32), a)


def rows_at_least_two(product, a: jax.Array, axis: int = -2) -> jax.Array:
    """product(a) computed with at least two rows along `axis`, so that a row's result never
    depends on how many rows there are (batch invariance).

    XLA:CPU runs a one-row product as a matrix-vector kernel, which sums K in another order than
    the matrix-matrix kernel it uses from two rows up; every row of the latter sums in one order
    whatever the row count and the row's place (checked for 2..64 rows, AVX-512 and AVX2; the
    batch-invariance tests keep checking it). A lone row is doubled and the copy dropped. On a
    TPU both are one MXU tile.
    """
    axis = axis % a.ndim
    if a.shape[axis] != 1:
        return product(a)
    doubled = jnp.broadcast_to(a, a.shape[:axis] + (2,) + a.shape[axis + 1:])
    return lax.slice_in_dim(product(doubled), 0, 1, axis=axis)


def ordered_sum(v: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Σ over `axis` in one fixed order, whatever the other axes (the batch rows) or the host.

    XLA:CPU picks a reduction's summation order from the whole shape, so a row's sum would change
    with the batch size. Here the order is written out as element-wise adds, which no compiler
    reorders: 128-wide chunks are added in sequence (one vreg column group at a time on a TPU),
    then the remaining width is folded in halves while it is even, and the rest added in sequence.
    The kernels call this same function, so they sum in the same order as the reference.
    """
    axis = axis % v.ndim
    width = v.shape[axis]

    def columns(start: int, stop: int) -> jax.Array:
        return lax.slice_in_dim(v, start, stop, axis=axis)

    if width > LANE and width % LANE == 0:
        chunks = [columns(c, c + LANE) for c in range(0, width, LANE)]
        v, width = functools.reduce(jnp.add, chunks), LANE
    while width > 1 and width % 2 == 0:
        width //= 2
        v = columns(0, width) + columns(width, 2 * width)
    if width > 1:
        v = functools.reduce(jnp.add, [columns(i, i + 1) for i in range(width)])
    return v if keepdims else jnp.squeeze(v, axis)


def _sequence_sum(terms) -> jax.Array:
    """t_0 + t_1 + ... added in this order (a short static sum: candidates, conv taps)."""
    return functools.reduce(jnp.add, terms)


def softmax(v: jax.Array, axis: int = -1) -> jax.Array:
    """exp(v − max) / Σ exp(v − max) over `axis`, summed by `ordered_sum` (batch-invariant)."""
    shifted = jnp.exp(v - jnp.max(v, axis=axis, keepdims=True))
    return shifted / ordered_sum(shifted, axis=axis, keepdims=True)


def _einsum_f32(spec: str, *operands: jax.Array) -> jax.Array:
    """A contraction in full f32 (also on a TPU, whose default f32 matmul uses bf16 passes)."""
    return jnp.einsum(spec, *(o.astype(f32) for o in operands), precision=HIGHEST)


def layer_params(stack: dict[str, Any], index: int) -> dict[str, Any]:
    """One layer's weights from a per-kind stack: `layer_params(params["kda"], i)`."""
    return jax.tree.map(lambda leaf: leaf[index], stack)


# ---- §2 norms and activation -----------------------------------------------------------------
def rms_norm(v: jax.Array, gamma: jax.Array, eps: float, n: int | None = None) -> jax.Array:
    """RMSNorm_γ(v) = bf(v · (mean(v²) + eps)^-½ · γ) in f32 over the last axis.

    n: the width the mean divides by (default v.shape[-1]); the MoE latent norm passes
    cfg.moe_latent so zero padding columns do not change the result.
    """
    v32 = v.astype(f32)
    width = v.shape[-1] if n is None else n
    mean_square = ordered_sum(v32 * v32, keepdims=True) / width
    return bf(v32 * lax.rsqrt(mean_square + eps) * gamma.astype(f32))


def situ(g: jax.Array, u: jax.Array) -> jax.Array:
    """SiTU(g, u) = bf(4·tanh(g/4) · σ(g) · 25·tanh(u/25)); g and u are bf16 projections."""
    g32, u32 = g.astype(f32), u.astype(f32)
    return bf(4 * jnp.tanh(g32 / 4) * jax.nn.sigmoid(g32) * 25 * jnp.tanh(u32 / 25))


def _activation(g: jax.Array, u: jax.Array, cfg: ModelConfig) -> jax.Array:
    if cfg.activation == "situ":
        return situ(g, u)
    return bf(jax.nn.silu(g.astype(f32)) * u.astype(f32))  # "silu": SwiGLU, for comparison


# ---- §3 attention residuals --------------------------------------------------------------------
def mix(candidates: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Mix over candidates [N, B, d] with the folded weight w [d] (f32) -> [B, d] bf16.

    s_i = <v_i, w> · (mean(v_i²) + eps)^-½; α = softmax_i(s); out = bf(Σ α_i v_i).
    """
    v = candidates.astype(f32)  # [N, B, d]
    d = v.shape[-1]
    scores = ordered_sum(v * w.astype(f32)) * lax.rsqrt(ordered_sum(v * v) / d + eps)  # [N, B]
    alpha = softmax(scores, axis=0)  # [N, B]
    return bf(_sequence_sum(alpha[i, :, None] * v[i] for i in range(v.shape[0])))


# ---- §4 KDA ----------------------------------------------------------------------------------
def kda_projections(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, ...]:
    """The matmuls of a KDA step, bf16: q̃, k̃, ṽ, u [B, H, D], b [B, H], g_raw [B, H, D]."""
    B = x.shape[0]
    H, D = cfg.n_heads, cfg.kda_head_dim
    q_pre, k_pre, v_pre, u = (bf(_mm(x, p[name])).reshape(B, H, D)
                              for name in ("w_q", "w_k", "w_v", "w_g"))
    b = bf(_mm(x, p["w_b"]))  # [B, H]
    # low-rank decay gate: f = bf(x W_fa), g_raw = bf(f W_fb)
    f = bf(_mm(x, p["w_fa"]))  # [B, R]
    g_raw = bf(_mm(f, p["w_fb"])).reshape(B, H, D)
    return q_pre, k_pre, v_pre, u, b, g_raw


def kda_attention(p: dict[str, Any], x: jax.Array, conv: jax.Array, state: jax.Array,
                  cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One KDA decode step. x [B, d] bf16 (normalised); conv [B, conv_size-1, 3, H, D] bf16
    (pre-conv q/k/v, oldest first); state [B, H, D, D] f32 (S[key, value]).
    Returns (out [B, d] bf16, new conv, new state)."""
    B = x.shape[0]
    H, D = cfg.n_heads, cfg.kda_head_dim
    q_pre, k_pre, v_pre, u, b, g_raw = kda_projections(p, x, cfg)
    g_raw = g_raw.astype(f32)
    # log-decay per key channel λ = bound · σ(exp(A_log_h) · (g_raw + dt_bias)) ∈ (bound, 0)
    decay_rate = jnp.exp(p["a_log"].astype(f32))[:, None]  # [H, 1]
    log_decay = cfg.kda_decay_bound * jax.nn.sigmoid(
        decay_rate * (g_raw + p["dt_bias"].astype(f32).reshape(H, D)))  # [B, H, D]

    # short causal depthwise conv over [conv state (oldest first) ; current], tap -1 = current
    current = jnp.stack([q_pre, k_pre, v_pre], axis=1)  # [B, 3, H, D]
    window = jnp.concatenate([conv, current[:, None]], axis=1)  # [B, conv_size, 3, H, D]
    taps = p["conv_w"].astype(f32).reshape(3, cfg.kda_conv_size, H, D).transpose(1, 0, 2, 3)
    conv_out = bf(jax.nn.silu(_sequence_sum(window[:, j].astype(f32) * taps[j]
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
    predicted = _einsum_f32("bhc,bhcj->bhj", k, decayed)  # S̄ᵀk [B, H, D]
    new_state = decayed + k[..., :, None] * (beta[..., None] * (v - predicted))[..., None, :]
    o = _einsum_f32("bhc,bhcj->bhj", q, new_state)  # [B, H, D]

    # y_h = bf(RMSNorm_γo(bf(o_h)) ⊙ bf(σ(u_h))), γ_o shared by all heads; out = y W_o
    gate = bf(jax.nn.sigmoid(u.astype(f32)))
    y = bf(rms_norm(bf(o), p["o_norm"], cfg.rms_eps).astype(f32) * gate.astype(f32))
    out = bf(_mm(y.reshape(B, H * D), p["w_o"]))
    return out, new_conv, new_state


# ---- §5 MLA ----------------------------------------------------------------------------------
def _write_slot(cache: jax.Array, new: jax.Array, positions: jax.Array, axis: int) -> jax.Array:
    """cache with row b's slot positions[b] (along `axis` of one row) set to new[b].

    A select against the slot index rather than a scatter: same result, and XLA compiles it fast.
    """
    slot_axis = axis + 1  # in the batched cache
    slots = jnp.arange(cache.shape[slot_axis]).reshape(
        (-1,) + (1,) * (cache.ndim - slot_axis - 1))
    hit = slots == positions.reshape((-1,) + (1,) * (cache.ndim - 1))  # broadcasts like cache
    return jnp.where(hit, jnp.expand_dims(new, slot_axis).astype(cache.dtype), cache)


def _dot_exact(a: jax.Array, b: jax.Array) -> jax.Array:
    """Σ a·b over the last axis of bf16 vectors: each product is exact in f32, summed in f32."""
    return ordered_sum(a.astype(f32) * b.astype(f32))


def _online_softmax(new_score: jax.Array, new_value: jax.Array, scores: jax.Array,
                    values: jax.Array, positions: jax.Array, tile: int) -> jax.Array:
    """Σ_j α_j V_j over slots 0..p with α = softmax(scores) in f32, computed online (§5).

    new_score [B, H] and new_value [B, H, n] or [B, n]: slot p (the new token); scores [B, H, S]
    and values [B, H, S, n] or [B, S, n] (shared by the heads): the cache. The order is the one a
    decode kernel can stream: the new token seeds the running state (m = its score, norm = 1, acc = its value),
    then the cached slots 0..p−1 come `tile` at a time, each tile rescaling the state by
    e^(m_old − m_new). A tile past p changes nothing (exactly: correction 1, weights 0), so every
    row runs all ⌈S/tile⌉ tiles. Returns acc / norm [B, H, n] f32.
    """
    B, H, S = scores.shape
    slots = jnp.arange(tile)
    slot_axis, spec = (1, "bht,btn->bhn") if values.ndim == 3 else (2, "bht,bhtn->bhn")
    n_tiles = -(-S // tile)  # a cache shorter than a tile, or not a multiple: pad (masked anyway)
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, n_tiles * tile - S)))
    values = jnp.pad(values, [(0, n_tiles * tile - S) if axis == slot_axis else (0, 0)
                              for axis in range(values.ndim)])

    def one_tile(t, carry):
        m, norm, acc = carry  # [B, H, 1], [B, H, 1], [B, H, n]
        tile_scores = lax.dynamic_slice_in_dim(scores, t * tile, tile, axis=2)  # [B, H, T]
        tile_values = lax.dynamic_slice_in_dim(values, t * tile, tile, slot_axis).astype(f32)
        valid = (t * tile + slots)[None, None, :] < positions[:, None, None]  # [B, 1, T]
        tile_scores = jnp.where(valid, tile_scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(tile_scores, axis=-1, keepdims=True))  # finite
        correction = jnp.exp(m - m_new)
        weights = jnp.where(valid, jnp.exp(tile_scores - m_new), 0.0)
        norm = correction * norm + ordered_sum(weights, keepdims=True)
        acc = correction * acc + jnp.einsum(spec, weights, tile_values, precision=HIGHEST)
        return m_new, norm, acc

    m = new_score[..., None]
    acc = jnp.broadcast_to(new_value.astype(f32)[:, None] if new_value.ndim == 2
                           else new_value.astype(f32), (B, H, new_value.shape[-1]))
    _, norm, acc = lax.fori_loop(0, n_tiles, one_tile, (m, jnp.ones_like(m), acc))
    return acc / norm


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
    B = x.shape[0]
    H, nope, extra, v_dim = cfg.n_heads, cfg.mla_qk_nope, cfg.mla_qk_extra, cfg.mla_v_dim
    rank, eps = cfg.mla_kv_rank, cfg.rms_eps
    # queries: c_q = RMSNorm(bf(x W_qa)); q = bf(c_q W_qb), per head [q^C | q^X]
    c_q = rms_norm(bf(_mm(x, p["w_qa"])), p["q_norm"], eps)
    q = bf(_mm(c_q, p["w_qb"])).reshape(B, H, nope + extra)
    q_nope, q_extra = q[..., :nope], q[..., nope:]
    # keys/values: [c_kv | k^X] = bf(x W_kva); ĉ = RMSNorm(c_kv); k^X shared, not normalised
    kv = bf(_mm(x, p["w_kva"]))
    c_kv, k_extra = kv[:, :rank], kv[:, rank:]  # [B, rank], [B, extra]
    c_hat = rms_norm(c_kv, p["kv_norm"], eps)
    w_kvb = p["w_kvb"].reshape(rank, H, nope + v_dim)  # head h: [k^C | v]
    w_kb, w_vb = w_kvb[..., :nope], w_kvb[..., nope:]  # [rank, H, nope], [rank, H, v]
    scale = cfg.mla_qk_dim ** -0.5
    # scores over slots 0..p: the new token's (slot p) and the cache's (slot p is masked there)

    if cfg.mla_cache_layout == "expanded":
        kvb = bf(_mm(c_hat, p["w_kvb"])).reshape(B, H, nope + v_dim)
        k_nope, v_new = kvb[..., :nope], kvb[..., nope:]  # [B, H, nope], [B, H, v]
        pad = jnp.zeros((B, H, cfg.mla_k_padded - cfg.mla_qk_dim), bf16)
        k_new = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_extra[:, None], (B, H, extra)), pad], -1)
        cache = {"k": _write_slot(cache["k"], k_new, positions, axis=1),  # [B, H, S, k_padded]
                 "v": _write_slot(cache["v"], v_new, positions, axis=1)}  # [B, H, S, v]
        # per head: q^C·k^C + q^X·k^X (the zero pad columns of the cache are left out)
        new_score = (_dot_exact(q_nope, k_nope) + _dot_exact(q_extra, k_extra[:, None])) * scale
        scores = (jnp.einsum("bhn,bhsn->bhs", q_nope, cache["k"][..., :nope],
                             preferred_element_type=f32)
                  + jnp.einsum("bhe,bhse->bhs", q_extra, cache["k"][..., nope:nope + extra],
                               preferred_element_type=f32)) * scale  # [B, H, S]
        o = bf(_online_softmax(new_score, v_new, scores, cache["v"], positions, cfg.kv_tile))
    else:
        cache = {"ckv": _write_slot(cache["ckv"], c_hat, positions, axis=0),  # [B, S, rank]
                 "kx": _write_slot(cache["kx"], k_extra, positions, axis=0)}  # [B, S, extra]
        # per (row, head) vector-matrix products, as the kernel's row loop: batch-invariant
        w_kb_rows = jnp.broadcast_to(w_kb, (B, *w_kb.shape))  # [B, rank, H, nope]
        q_absorbed = bf(jnp.einsum("bhn,brhn->bhr", q_nope, w_kb_rows,
                                   preferred_element_type=f32))
        new_score = (_dot_exact(q_absorbed, c_hat[:, None])
                     + _dot_exact(q_extra, k_extra[:, None])) * scale  # [B, H]
        scores = (jnp.einsum("bhr,bsr->bhs", q_absorbed, cache["ckv"], preferred_element_type=f32)
                  + jnp.einsum("bhe,bse->bhs", q_extra, cache["kx"],
                               preferred_element_type=f32)) * scale  # [B, H, S]
        context = bf(_online_softmax(new_score, c_hat, scores, cache["ckv"], positions,
                                     cfg.kv_tile))  # [B, H, rank]: Σ α ĉ
        w_vb_rows = jnp.broadcast_to(w_vb, (B, *w_vb.shape))  # [B, rank, H, v]
        o = bf(jnp.einsum("bhr,brhv->bhv", context, w_vb_rows, preferred_element_type=f32))

    # output gate: y_h = bf(o_h ⊙ bf(σ(bf(x W_g)_h))); out = y W_o
    gate = bf(jax.nn.sigmoid(bf(_mm(x, p["w_g"])).astype(f32)))  # [B, H*v]
    y = bf(o.reshape(B, H * v_dim).astype(f32) * gate.astype(f32))
    return bf(_mm(y, p["w_o"])), cache


# ---- §6 FFNs ---------------------------------------------------------------------------------
def route(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Router: expert_ids [B, k] i32 and expert_weights [B, k] f32 (§6.1).

    r = x W_r (f32); s = σ(r) (or softmax); top-k of s + bias by iterated argmax (lowest index
    wins ties); weights = s / Σ_top s from the UNcorrected scores, times cfg.routed_scale.
    """
    logits = _mm(x, p["w_router"])  # [B, E]
    if cfg.router_score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = softmax(logits)
    selection = scores + p["router_bias"].astype(f32) if cfg.router_bias else scores
    chosen = []
    for _ in range(cfg.top_k):
        best = jnp.argmax(selection, axis=-1)  # first maximum: the lowest index wins a tie
        chosen.append(best)
        selection = jnp.where(jax.nn.one_hot(best, cfg.n_experts, dtype=bool), -jnp.inf, selection)
    expert_ids = jnp.stack(chosen, axis=-1).astype(i32)  # [B, k]
    top_scores = jnp.take_along_axis(scores, expert_ids, axis=-1)
    expert_weights = top_scores / ordered_sum(top_scores, keepdims=True) * cfg.routed_scale
    return expert_ids, expert_weights


def routed_experts(p: dict[str, Any], x: jax.Array, expert_ids: jax.Array,
                   expert_weights: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Latent routed experts (§6.2–6.5): latent down, each expert, weighted combine, latent norm,
    up. Returns routed [B, d] in f32 (moe_ffn rounds it together with the shared experts)."""
    fmt = cfg.expert_format
    z = bf(_mm(x, p["w_ld"]))  # [B, Lat]
    chosen = jax.tree.map(lambda w: w[expert_ids], p["experts"])  # each leaf [B, k, ...]
    w1, w3, w2 = (dequantize(chosen[name], fmt) for name in ("w1", "w3", "w2"))
    def per_expert(spec, v, w):  # each (row, expert) product with two rows, as `_mm`
        return rows_at_least_two(
            lambda v2: jnp.einsum(spec, v2, w, preferred_element_type=f32), v, axis=-2)
    zk = jnp.broadcast_to(z[:, None, None], (z.shape[0], w1.shape[1], 1, z.shape[-1]))
    g = bf(per_expert("bkml,bklf->bkmf", zk, w1))[:, :, 0]  # [B, k, F_e]
    u = bf(per_expert("bkml,bklf->bkmf", zk, w3))[:, :, 0]
    y = bf(per_expert("bkmf,bkfl->bkml", _activation(g, u, cfg)[:, :, None], w2))[:, :, 0]  # [B, k, Lat]
    # ρ = bf(Σ w_e y_e), the f32 sum taken in ascending expert id: a row's ρ depends neither on
    # the router's ranking nor on the other rows of the batch (kernels fetch each distinct expert
    # of the batch once, in id order, and add it to the rows that chose it)
    order = jnp.argsort(expert_ids, axis=-1)  # [B, k]
    coef = jnp.take_along_axis(expert_weights.astype(f32), order, axis=-1)  # [B, k]
    y = jnp.take_along_axis(y.astype(f32), order[..., None], axis=1)  # [B, k, Lat]
    rho = bf(lax.fori_loop(0, y.shape[1], lambda j, acc: acc + coef[:, j, None] * y[:, j],
                           jnp.zeros(y.shape[::2], f32)))  # [B, Lat]
    rho_hat = rms_norm(rho, p["latent_norm"], cfg.rms_eps, n=cfg.moe_latent)
    return _mm(rho_hat, p["w_lu"])  # [B, d] f32


def moe_ffn(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """MoE layer (§6): m = bf(routed + shared) [B, d] bf16."""
    expert_ids, expert_weights = route(p, x, cfg)
    routed = routed_experts(p, x, expert_ids, expert_weights, cfg)
    if not cfg.n_shared_experts:
        return bf(routed)
    hidden = _activation(bf(_mm(x, p["w_sg"])), bf(_mm(x, p["w_su"])), cfg)  # [B, S]
    return bf(routed + _mm(hidden, p["w_sd"]))


def dense_ffn(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Dense layer (§6): m = bf(SiTU(bf(x W_g), bf(x W_u)) W_d) [B, d] bf16."""
    hidden = _activation(bf(_mm(x, p["w_gate"])), bf(_mm(x, p["w_up"])), cfg)
    return bf(_mm(hidden, p["w_down"]))


def final_logits(params: dict[str, Any], snapshots: jax.Array, partial: jax.Array,
                 cfg: ModelConfig) -> jax.Array:
    """h_L = Mix({R_0..R_last, P}; w_out); logits = RMSNorm(h_L) W_lm (f32) [B, V] (§3.3),
    soft-capped cap·tanh(l/cap) when cfg.logit_softcap is set (Kimi K3: not set)."""
    h = mix(jnp.concatenate([snapshots, partial[None]], axis=0), params["mix_out"], cfg.rms_eps)
    logits = _mm(rms_norm(h, params["final_norm"], cfg.rms_eps), params["lm_head"])
    if cfg.logit_softcap is not None:
        logits = cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap)
    return logits


# ---- state -----------------------------------------------------------------------------------
def _check_cfg(cfg: Any) -> None:
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg={cfg!r} is invalid: a mkresearch.config.ModelConfig")  # noqa: TRY004


def init_state(cfg: ModelConfig, batch: int, max_seq_len: int | None = None) -> dict[str, Any]:
    """Zero decode state for `batch` sequences (DEVELOPERS.md "State")."""
    _check_cfg(cfg)
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch={batch!r} is invalid: an int >= 1")
    seq = cfg.max_seq_len if max_seq_len is None else max_seq_len
    if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or seq < 1:
        raise ValueError(f"max_seq_len={max_seq_len!r} is invalid: None or an int >= 1")
    H, D, n_kda, n_mla = cfg.n_heads, cfg.kda_head_dim, len(cfg.kda_layers), len(cfg.mla_layers)
    if cfg.mla_cache_layout == "expanded":
        mla = {"k": jnp.zeros((n_mla, batch, H, seq, cfg.mla_k_padded), bf16),
               "v": jnp.zeros((n_mla, batch, H, seq, cfg.mla_v_dim), bf16)}
    else:
        mla = {"ckv": jnp.zeros((n_mla, batch, seq, cfg.mla_kv_rank), bf16),
               "kx": jnp.zeros((n_mla, batch, seq, cfg.mla_qk_extra), bf16)}
    return {
        "kda_conv": jnp.zeros((n_kda, batch, cfg.kda_conv_size - 1, 3, H, D), bf16),
        "kda_state": jnp.zeros((n_kda, batch, H, D, D), f32),
        "mla": mla,
    }


# ---- §3 the decode step ----------------------------------------------------------------------
def _set_layer(stack: Any, index: int, layer: Any) -> Any:
    """The stacked pytree with entry `index` replaced by `layer` (the inverse of layer_params)."""
    return jax.tree.map(lambda whole, part: whole.at[index].set(part), stack, layer)


def _candidates(layer: int, snapshots: list, partial: jax.Array, cfg: ModelConfig) -> jax.Array:
    """𝒜_ℓ: ℓ = 0 → {P}; ℓ = block·n, n ≥ 1 → {R_0..R_{n−1}, P}; otherwise {R_0..R_n, P}."""
    block, offset = divmod(layer, cfg.attn_res_block)
    if layer == 0:
        chosen = []
    elif offset == 0:
        chosen = snapshots[:block]
    else:
        chosen = snapshots[:block + 1]
    return jnp.stack([*chosen, partial])  # [N, B, d]


def _rms(h: jax.Array) -> jax.Array:
    h32 = h.astype(f32)
    return jnp.sqrt(ordered_sum(h32 * h32) / h.shape[-1])  # [B]


def _decode_step(params, state, tokens, positions, cfg):
    eps, n_dense = cfg.rms_eps, cfg.n_dense_layers
    kda_conv, kda_state, mla_cache = state["kda_conv"], state["kda_state"], state["mla"]
    # 1. e = E[token]; R_0 = e, R_1.. = 0; P = e
    embedded = params["embed"][tokens]  # [B, d] bf16
    snapshots = [embedded] + [jnp.zeros_like(embedded)] * (cfg.n_blocks - 1)
    partial = embedded
    hidden_rms, expert_ids = [], []
    for layer in range(cfg.n_layers):
        block, offset = divmod(layer, cfg.attn_res_block)
        # 2.1 h = Mix(𝒜_ℓ; w_attn[ℓ])
        h = mix(_candidates(layer, snapshots, partial, cfg), params["mix_attn"][layer], eps)
        hidden_rms.append(_rms(h))
        # 2.2 a new block starts: snapshot the partial sum of the previous one
        if offset == 0:
            snapshots[block] = partial
        # 2.3 a = Attn_ℓ(RMSNorm(h))
        x = rms_norm(h, params["attn_norm"][layer], eps)
        index = cfg.attention_index(layer)
        if cfg.is_mla(layer):
            layer_cache = layer_params(mla_cache, index)
            a, layer_cache = mla_attention(layer_params(params["mla"], index), x, layer_cache,
                                           positions, cfg)
            mla_cache = _set_layer(mla_cache, index, layer_cache)
        else:
            a, conv, recurrent = kda_attention(layer_params(params["kda"], index), x,
                                               kda_conv[index], kda_state[index], cfg)
            kda_conv, kda_state = kda_conv.at[index].set(conv), kda_state.at[index].set(recurrent)
        # 2.4 P ← a at a block start, else bf(P + a)
        partial = a if offset == 0 else bf(partial.astype(f32) + a.astype(f32))
        # 2.5 h′ = Mix({R_0..R_n, P}; w_mlp[ℓ])
        h_ffn = mix(jnp.stack([*snapshots[:block + 1], partial]), params["mix_mlp"][layer], eps)
        # 2.6 m = FFN_ℓ(RMSNorm(h′)): dense for the first layers, MoE after
        x = rms_norm(h_ffn, params["mlp_norm"][layer], eps)
        if layer < n_dense:
            m = dense_ffn(layer_params(params["dense"], cfg.ffn_index(layer)), x, cfg)
        else:
            moe_params = layer_params(params["moe"], cfg.ffn_index(layer))
            expert_ids.append(route(moe_params, x, cfg)[0])  # for aux only: moe_ffn routes again
            m = moe_ffn(moe_params, x, cfg)
        # 2.7 P ← bf(P + m)
        partial = bf(partial.astype(f32) + m.astype(f32))
    # 3. logits from Mix({R_0..R_last, P}; w_out)
    snapshots = jnp.stack(snapshots)  # [n_blocks, B, d]
    logits = final_logits(params, snapshots, partial, cfg)
    new_state = {"kda_conv": kda_conv, "kda_state": kda_state, "mla": mla_cache}
    aux = {"snapshots": snapshots, "hidden_rms": jnp.stack(hidden_rms)}  # [L, B]
    if expert_ids:
        aux["expert_ids"] = jnp.stack(expert_ids)  # [n_moe, B, k]
    return logits, new_state, aux


_decode_step_jit = jax.jit(_decode_step, static_argnames="cfg")


def _check_step_inputs(state: Any, tokens: Any, positions: Any, cfg: ModelConfig) -> None:
    _check_cfg(cfg)
    if np.ndim(tokens) != 1:
        raise ValueError(f"tokens has shape {np.shape(tokens)}: allowed [B] (one token per row)")
    batch = np.shape(tokens)[0]
    if np.shape(positions) != (batch,):
        raise ValueError(f"positions has shape {np.shape(positions)}: allowed ({batch},)")
    if not isinstance(state, dict) or set(state) != {"kda_conv", "kda_state", "mla"}:
        raise ValueError("state is invalid: allowed the dict made by init_state(cfg, batch)")
    if state["kda_state"].shape[1] != batch:
        raise ValueError(f"state has batch {state['kda_state'].shape[1]}, tokens {batch}: "
                         "allowed equal batches")
    if not isinstance(positions, jax.core.Tracer):
        seq = jax.tree.leaves(state["mla"])[0].shape[-2] if cfg.mla_layers else None
        pos = np.asarray(positions)
        if seq is not None and (pos.min() < 0 or pos.max() >= seq):
            raise ValueError(f"positions={pos.tolist()} is invalid: ints in [0, {seq}) "
                             "(the cache length)")


def decode_step(params: dict[str, Any], state: dict[str, Any], tokens: jax.Array,
                positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    """One decode step (§3), jitted with cfg static. tokens [B] i32, positions [B] i32.

    Returns (logits [B, V] f32, new state, aux): aux["snapshots"] [n_blocks, B, d] bf16 (R after
    the step), aux["hidden_rms"] [L, B] f32 (RMS of each layer's input h) and, with MoE layers,
    aux["expert_ids"] [n_moe, B, top_k] i32 (the routing of each MoE layer).
    """
    _check_step_inputs(state, tokens, positions, cfg)
    return _decode_step_jit(params, state, jnp.asarray(tokens, i32), jnp.asarray(positions, i32),
                            cfg=cfg)


def _check_prompt(prompt: Any) -> None:
    if np.ndim(prompt) != 2 or np.shape(prompt)[1] < 1:
        raise ValueError(f"prompt has shape {np.shape(prompt)}: allowed [B, T] with T >= 1")


def prefill(params: dict[str, Any], state: dict[str, Any], prompt: jax.Array, cfg: ModelConfig,
            *, start: Any = 0) -> tuple[jax.Array, dict]:
    """Teacher-forced decode of prompt [B, T] at positions start .. start+T-1 (start: int or [B]).

    One `decode_step` per prompt token (the same compiled step as decoding: no second compile).
    Returns (logits [B, T, V] f32, the logits after each prompt token, and the new state).
    """
    _check_prompt(prompt)
    batch, length = np.shape(prompt)
    start = np.broadcast_to(np.asarray(start, np.int32), (batch,))
    _check_step_inputs(state, np.zeros(batch, np.int32), start + length - 1, cfg)
    prompt = jnp.asarray(prompt, i32)
    all_logits = []
    for t in range(length):
        logits, state, _ = decode_step(params, state, prompt[:, t], start + t, cfg)
        all_logits.append(logits)
    return jnp.stack(all_logits, axis=1), state


def generate(params: dict[str, Any], state: dict[str, Any], prompt: jax.Array, n_steps: int,
             cfg: ModelConfig, *, seed: int = 0, temperature: Any = None, top_k: Any = 0,
             top_p: Any = 1.0) -> tuple[jax.Array, dict]:
    """Prefill prompt [B, T] at positions 0..T-1, then sample n_steps tokens with
    mkresearch.sampling.sample (temperature None = greedy, else > 0, per row or scalar); token i
    is drawn with position T + i.

    Returns (tokens [B, n_steps] i32, state). The state has consumed the prompt and all generated
    tokens but the last (which has not been fed back yet).
    """
    if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 1:
        raise ValueError(f"n_steps={n_steps!r} is invalid: an int >= 1")
    _check_prompt(prompt)
    batch, length = np.shape(prompt)
    _check_step_inputs(state, np.zeros(batch, np.int32),
                       np.full(batch, length + n_steps - 2, np.int32), cfg)
    logits, state = prefill(params, state, prompt, cfg)
    logits = logits[:, -1]
    tokens = []
    for i in range(n_steps):
        position = np.full(batch, length + i, np.int32)
        tokens.append(sample(logits, seed=seed, positions=position, temperature=temperature,
                             top_k=top_k, top_p=top_p))
        if i + 1 < n_steps:  # feed the token back (the last one is only returned)
            logits, state, _ = decode_step(params, state, tokens[-1], position, cfg)
    return jnp.stack(tokens, axis=1), state
