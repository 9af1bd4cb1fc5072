"""The families' reference sublayers (mkresearch.model.stages.gqa, mla_rope, moe_full, the routers,
mkresearch.model.rope) against independent float64 NumPy implementations written from the public model
code, with bf16 roundings where the reference rounds. The NumPy side calls none of the
reference's functions (only its weights and inputs are shared).

Tolerances (stated once):
- RoPE, f32 vs the float64 closed form: atol 8e-6 · (1 + p) for |x| ≤ 4 (the f32 angle p·θ and
  cos/sin); position 0 and the pass-through dims exactly;
- router ids exact (engineered ties included); weights rtol 4e-6 (f32 logits and scores: a logit
  of a few units is off by ~|logit|·2^-24, and e^logit by as much);
- sublayer outputs, which the reference rounds to bf16 after f32 accumulation while NumPy
  accumulates in float64 (a bf16 rounding may flip by an ulp and propagate):
  |ref − np| ≤ 2^-6 · max|np| and mean |ref − np| ≤ 2^-9 · max|np|.
Measured maxima are printed (pytest -s).
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mkresearch.model import reference, rope, weights
from mkresearch.model.config import get_config
from mkresearch.model.stages import ffn, gqa, mla_rope, moe_full

OUT_TOL, MEAN_TOL = 2.0 ** -6, 2.0 ** -9


def bf(x):
    """Round to bf16 and back to float64 (the spec's bf(...))."""
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def rms(v, gamma, eps):
    return bf(v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * f64(gamma))


def silu(t):
    return t / (1 + np.exp(-t))


def assert_output_close(got, want, what):
    got, want = f64(got), np.asarray(want)
    scale = np.abs(want).max()
    err = np.abs(got - want)
    print(f"{what}: max |ref - float64| = {err.max():.3g} ({err.max() / scale:.2e} of max), "
          f"mean {err.mean() / scale:.2e}")
    assert err.max() <= OUT_TOL * scale, what
    assert err.mean() <= MEAN_TOL * scale, what


# ---- RoPE -----------------------------------------------------------------------------------------
def np_inverse_frequencies(dim, theta, factor=1.0, original=4096, beta_fast=32, beta_slow=1):
    """HF DeepseekV3YarnRotaryEmbedding / LlamaRotaryEmbedding, float64."""
    freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    if factor <= 1:
        return freq

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / ((high + 0.001 if high == low else high) - low),
                   0, 1)
    keep = 1 - ramp  # HF: inv_freq_mask
    return freq / factor * (1 - keep) + freq * keep


def np_rotate_half(x, position, freq, dims):
    """GPT-NeoX apply_rotary_pos_emb on the first `dims` of x (HF, float64)."""
    angle = position * freq
    cos, sin = np.cos(np.concatenate([angle, angle])), np.sin(np.concatenate([angle, angle]))
    rot, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    rotated_half = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return np.concatenate([rot * cos + rotated_half * sin, rest], axis=-1)


def np_rotate_interleaved(x, position, freq):
    """DeepSeek's apply_rotary_emb: consecutive pairs as complex numbers times e^{i p θ}."""
    pairs = x[..., 0::2] + 1j * x[..., 1::2]
    out = pairs * np.exp(1j * position * freq)
    return np.stack([out.real, out.imag], axis=-1).reshape(x.shape)


@pytest.mark.parametrize("width, dims, theta", [(128, 64, 1e6), (128, 128, 1e6),
                                                 (64, 64, 1e4)])
def test_rope_is_the_closed_form(width, dims, theta):
    x = np.random.default_rng(0).standard_normal((4, width))
    spec = rope.Rope(dim=dims, theta=theta)
    freq = np_inverse_frequencies(dims, theta)
    np.testing.assert_allclose(f64(rope.inverse_frequencies(spec))[0], freq, rtol=2e-6)
    for position in (0, 1, 7, 100, 4095):
        cos, sin = rope.cos_sin(jnp.int32(position), spec)
        got = f64(rope.rotate(jnp.asarray(x, jnp.float32), cos, sin))
        want = np_rotate_half(f64(jnp.asarray(x, jnp.float32)), position, freq, dims)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * (1 + position) * 4)
        if position == 0:  # the identity, exactly
            np.testing.assert_array_equal(got, f64(jnp.asarray(x, jnp.float32)))
    # the pass-through dims of partial RoPE are untouched at any position
    cos, sin = rope.cos_sin(jnp.int32(77), spec)
    np.testing.assert_array_equal(f64(rope.rotate(jnp.asarray(x, jnp.float32), cos, sin))[:, dims:],
                                  f64(jnp.asarray(x, jnp.float32))[:, dims:])


def test_yarn_frequencies_and_softmax_scale_are_deepseek_v3s():
    cfg = get_config("deepseek-v3")
    spec = rope.of(cfg, cfg.mla_qk_extra)
    want = np_inverse_frequencies(64, 10000.0, factor=40, original=4096)
    np.testing.assert_allclose(f64(rope.inverse_frequencies(spec))[0], want, rtol=2e-6)
    assert not np.allclose(want, np_inverse_frequencies(64, 10000.0))  # YaRN moved some
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert rope.attention_scale(cfg, 192) == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-12)
    assert spec.cos_sin_scale == 1.0  # mscale / mscale_all_dim = 1 / 1


def test_rotate_half_on_deinterleaved_dims_is_deepseeks_interleaved_rope():
    """The load-time column permutation (`rope.deinterleave`) turns DeepSeek's interleaved
    rotation into this module's rotate-half: same vectors (permuted), same dot products."""
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 64))
    freq = np_inverse_frequencies(64, 1e4, factor=40, original=4096)
    perm = rope.deinterleave(64)
    for position in (0, 3, 1000):
        q_i, k_i = np_rotate_interleaved(q, position, freq), np_rotate_interleaved(k, position, freq)
        q_h, k_h = (np_rotate_half(v[perm], position, freq, 64) for v in (q, k))
        np.testing.assert_allclose(q_h, q_i[perm], atol=1e-12)
        assert q_h @ k_h == pytest.approx(q_i @ k_i, rel=1e-12)


# ---- GQA ------------------------------------------------------------------------------------------
def np_gqa(p, x, cache, positions, cfg):
    """HF Glm4MoeAttention / Qwen3MoeAttention decode, float64, bf16 where the reference rounds."""
    B, H, KV, D = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    x = f64(x)
    proj = {}
    for name, heads in (("q", H), ("k", KV), ("v", KV)):
        y = x @ f64(p[f"w_{name}"])
        if cfg.attention_bias:
            y = y + f64(p[f"b_{name}"])
        proj[name] = bf(y).reshape(B, heads, D)
    q, k, v = proj["q"], proj["k"], proj["v"]
    if cfg.qk_norm:
        q, k = rms(q, p["q_norm"], cfg.rms_eps), rms(k, p["k_norm"], cfg.rms_eps)
    freq = np_inverse_frequencies(cfg.rope_dim, cfg.rope_theta)
    q = bf(np.stack([np_rotate_half(q[b], positions[b], freq, cfg.rope_dim) for b in range(B)]))
    k = bf(np.stack([np_rotate_half(k[b], positions[b], freq, cfg.rope_dim) for b in range(B)]))
    keys, values = f64(cache["k"]).copy(), f64(cache["v"]).copy()  # [B, KV, S, D]
    out = np.zeros((B, H, D))
    for b in range(B):
        keys[b, :, positions[b]], values[b, :, positions[b]] = k[b], v[b]
        for h in range(H):
            g = h // (H // KV)
            s = keys[b, g, :positions[b] + 1] @ q[b, h] / math.sqrt(D)
            a = np.exp(s - s.max())
            out[b, h] = bf((a / a.sum()) @ values[b, g, :positions[b] + 1])
    return bf(out.reshape(B, H * D) @ f64(p["w_o"])), keys, values


def random_cache(shapes, seed):
    rng = np.random.default_rng(seed)
    return {name: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
            for name, shape in shapes.items()}


def normalised(batch, d, seed):
    x = np.random.default_rng(seed).standard_normal((batch, d))
    return jnp.asarray(x / np.sqrt(np.mean(x * x, -1, keepdims=True)), jnp.bfloat16)


GQA_CASES = {"glm-4.5-mini": {}, "qwen3-235b-a22b-mini": {},
             "glm-4.5-mini plain": {"attention_bias": False, "qk_norm": False}}


@pytest.mark.parametrize("case", GQA_CASES)
@pytest.mark.slow
def test_gqa_matches_float64(case):
    cfg = get_config(case.split()[0], **GQA_CASES[case])
    p = reference.layer_params(weights.init_params(cfg, 3)["gqa"], 1)
    assert ("b_q" in p) == cfg.attention_bias and ("q_norm" in p) == cfg.qk_norm
    positions = np.array([0, 31, 77])
    shape = (3, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim)
    cache = random_cache({"k": shape, "v": shape}, seed=4)
    x = normalised(3, cfg.d_model, seed=5)
    out, new_cache = jax.jit(gqa.gqa_attention, static_argnames="cfg")(
        p, x, cache, jnp.asarray(positions, jnp.int32), cfg)
    want, keys, values = np_gqa(p, x, cache, positions, cfg)
    assert_output_close(out, want, f"gqa {case}")
    # the cached key (normed, roped, bf16) and value: an ulp at most where f32 and float64 round
    # differently
    np.testing.assert_allclose(f64(new_cache["v"]), values, rtol=0, atol=0)
    np.testing.assert_allclose(f64(new_cache["k"]), keys, rtol=2 ** -7, atol=1e-6)


# ---- MLA with RoPE (DeepSeek-V3) ------------------------------------------------------------------
def np_deepseek_mla(p, x, cache, positions, cfg):
    """DeepSeek-V3's inference MLA (absorbed), float64, on RELEASED-layout weights: the rope
    columns interleaved (this builds them from the reference's rotate-half layout), rope applied
    to interleaved pairs, the cache's rope key interleaved."""
    B, H, nope, rope_dim, rank, v_dim = (x.shape[0], cfg.n_heads, cfg.mla_qk_nope,
                                         cfg.mla_qk_extra, cfg.mla_kv_rank, cfg.mla_v_dim)
    back = np.argsort(rope.deinterleave(rope_dim))  # released order from ours
    w_qb = f64(p["w_qb"]).reshape(-1, H, nope + rope_dim)
    w_qb[..., nope:] = w_qb[..., nope:][..., back]
    w_kva = f64(p["w_kva"])
    w_kva[:, rank:] = w_kva[:, rank:][:, back]
    kpe_cache = f64(cache["kpe"])[..., back].copy()
    ckv_cache = f64(cache["ckv"]).copy()
    x = f64(x)
    c_q = rms(bf(x @ f64(p["w_qa"])), p["q_norm"], cfg.rms_eps)
    q = bf(c_q @ w_qb.reshape(-1, H * (nope + rope_dim))).reshape(B, H, nope + rope_dim)
    kv = bf(x @ w_kva)
    c_hat = rms(kv[:, :rank], p["kv_norm"], cfg.rms_eps)
    freq = np_inverse_frequencies(rope_dim, cfg.rope_theta, cfg.yarn_factor,
                                  cfg.yarn_original_max_positions)
    mscale = 0.1 * cfg.yarn_mscale_all_dim * math.log(cfg.yarn_factor) + 1
    scale = (nope + rope_dim) ** -0.5 * mscale ** 2
    w_kvb = f64(p["w_kvb"]).reshape(rank, H, nope + v_dim)
    out = np.zeros((B, H, v_dim))
    for b in range(B):
        k_pe = bf(np_rotate_interleaved(kv[b, rank:], positions[b], freq))
        ckv_cache[b, positions[b]], kpe_cache[b, positions[b]] = c_hat[b], k_pe
        for h in range(H):
            q_pe = bf(np_rotate_interleaved(q[b, h, nope:], positions[b], freq))
            q_absorbed = bf(w_kvb[:, h, :nope] @ q[b, h, :nope])  # [rank]
            s = (ckv_cache[b, :positions[b] + 1] @ q_absorbed
                 + kpe_cache[b, :positions[b] + 1] @ q_pe) * scale
            a = np.exp(s - s.max())
            context = bf((a / a.sum()) @ ckv_cache[b, :positions[b] + 1])
            out[b, h] = bf(context @ w_kvb[:, h, nope:])
    return bf(out.reshape(B, -1) @ f64(p["w_o"])), ckv_cache, kpe_cache


@pytest.mark.slow
def test_mla_rope_with_yarn_matches_deepseeks_interleaved_float64():
    cfg = get_config("deepseek-v3-mini")
    p = reference.layer_params(weights.init_params(cfg, 6)["mla_rope"], 2)
    assert "w_g" not in p  # no output gate
    positions = np.array([0, 45, 127])
    cache = random_cache({"ckv": (3, cfg.max_seq_len, cfg.mla_kv_rank),
                          "kpe": (3, cfg.max_seq_len, cfg.mla_qk_extra)}, seed=7)
    x = normalised(3, cfg.d_model, seed=8)
    out, new_cache = jax.jit(mla_rope.mla_rope_attention, static_argnames="cfg")(
        p, x, cache, jnp.asarray(positions, jnp.int32), cfg)
    want, ckv, kpe = np_deepseek_mla(p, x, cache, positions, cfg)
    assert_output_close(out, want, "mla_rope (YaRN) vs DeepSeek interleaved")
    np.testing.assert_allclose(f64(new_cache["ckv"]), ckv, rtol=2 ** -7, atol=0)
    # the cached rope key is the released (interleaved) one in rotate-half order
    np.testing.assert_allclose(f64(new_cache["kpe"]), kpe[..., rope.deinterleave(64)],
                               rtol=2 ** -7, atol=1e-6)


# ---- routers ----------------------------------------------------------------------------------------
def np_route(w_router, bias, x, cfg):
    """DeepSeek MoEGate (noaux_tc, group-limited) / Qwen3 softmax top-k, float64; ties to the
    lowest index (a stable descending sort)."""
    logits = f64(x) @ f64(w_router)
    if cfg.router_score == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    choice = scores + f64(bias) if cfg.router_bias else scores.copy()
    B, E, G = choice.shape[0], cfg.n_experts, cfg.router_groups
    ids = np.zeros((B, cfg.top_k), int)
    for b in range(B):
        groups = choice[b].reshape(G, E // G)
        group_score = np.sort(groups, axis=-1)[:, -2:].sum(-1) if G > 1 else np.zeros(1)
        kept = np.argsort(-group_score, kind="stable")[:cfg.router_topk_groups]
        masked = np.full(E, -np.inf)
        for g in kept:
            masked[g * (E // G):(g + 1) * (E // G)] = groups[g]
        ids[b] = np.argsort(-masked, kind="stable")[:cfg.top_k]
    top = np.take_along_axis(scores, ids, -1)
    if cfg.router_normalize:
        top = top / top.sum(-1, keepdims=True)
    return ids, top * cfg.routed_scale


def engineered_ties(p, cfg):
    """W_r columns and biases equal in pairs: the second group of `size` experts copies the first
    (with groups: their group scores tie) and expert 2 copies expert 1; the selection scores tie
    exactly in f32 and float64."""
    w = np.asarray(p["w_router"].astype(jnp.float32)).copy()
    bias = np.asarray(p["router_bias"]).copy()
    size = cfg.n_experts // max(cfg.router_groups, 2)
    for e in range(size):  # experts size.. copy 0..: with groups, group 1 ties group 0
        w[:, size + e], bias[size + e] = w[:, e], bias[e]
    w[:, 2], bias[2] = w[:, 1], bias[1]  # a tie inside group 0 (and 1)
    w[:, [1, 2]] += 0.01  # x >= 0: logits +4 or so, the tied experts (groups 0, 1) win
    return {**p, "w_router": jnp.asarray(w, jnp.bfloat16), "router_bias": jnp.asarray(bias)}


ROUTER_CASES = ["deepseek-v3-mini", "glm-4.5-mini", "qwen3-235b-a22b-mini",
                "deepseek-v3-mini ties", "qwen3-235b-a22b-mini ties"]


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_matches_float64(case):
    cfg = get_config(case.split()[0])
    p = reference.layer_params(weights.init_params(cfg, 9)["moe_full"], 0)
    if case.endswith("ties"):
        p = engineered_ties(p, cfg)
    x = jnp.abs(normalised(16, cfg.d_model, seed=10)) if case.endswith("ties") else \
        normalised(16, cfg.d_model, seed=10)
    ids, w = jax.jit(ffn.route, static_argnames="cfg")(p, x, cfg)
    want_ids, want_w = np_route(p["w_router"], p["router_bias"], x, cfg)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    err = np.abs(f64(w) - want_w) / np.abs(want_w)
    print(f"router {case}: weights max rel error {err.max():.2e}")
    np.testing.assert_allclose(f64(w), want_w, rtol=4e-6)
    if case == "deepseek-v3-mini ties":  # both tied groups kept; expert 1 before its twin 2
        assert (np.asarray(ids)[:, :2] == [1, 2]).all()
    if cfg.router_groups > 1:  # every choice within router_topk_groups groups
        size = cfg.n_experts // cfg.router_groups
        assert all(len(set(row // size)) <= cfg.router_topk_groups for row in np.asarray(ids))


def test_group_limit_excludes_a_better_expert_of_a_weaker_group():
    """Group scores are sums of the two best: a group with one excellent expert loses to groups
    with two good ones, and its excellent expert is not chosen."""
    scores = np.full((1, 16), -5.0)
    scores[0, 0] = 9.0  # group 0: 9 + (-5) = 4
    scores[0, [4, 5, 8, 9]] = 3.0  # groups 1 and 2: 6 each
    # deepseek-v3-mini's router: 4 groups of 4, the best 2 kept
    kept = np.asarray(ffn.limit_to_groups(jnp.asarray(scores, jnp.float32), 4, 2))
    assert np.isneginf(kept[0, :4]).all() and np.isneginf(kept[0, 12:]).all()
    np.testing.assert_array_equal(kept[0, 4:12], scores[0, 4:12])


# ---- the MoE on the full d --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepseek-v3-mini", "glm-4.5-mini", "qwen3-235b-a22b-mini"])
def test_moe_full_matches_float64(name):
    cfg = get_config(name, expert_format="bf16")  # the stored format: tested in test_weights
    p = reference.layer_params(weights.init_params(cfg, 11)["moe_full"], 0)
    x = normalised(5, cfg.d_model, seed=12)
    ids, w = np_route(p["w_router"], p["router_bias"], x, cfg)
    xs = f64(x)
    routed = np.zeros((5, cfg.d_model))
    for b in range(5):
        for j in np.argsort(ids[b]):  # ascending expert id
            e = ids[b, j]
            g, u = bf(xs[b] @ f64(p["experts"]["w1"][e])), bf(xs[b] @ f64(p["experts"]["w3"][e]))
            routed[b] += w[b, j] * bf(bf(silu(g) * u) @ f64(p["experts"]["w2"][e]))
    if cfg.n_shared_experts:
        g, u = bf(xs @ f64(p["w_sg"])), bf(xs @ f64(p["w_su"]))
        routed += bf(silu(g) * u) @ f64(p["w_sd"])
    got = jax.jit(moe_full.moe_full_ffn, static_argnames="cfg")(p, x, cfg)
    assert_output_close(got, bf(routed), f"moe_full {name}")
