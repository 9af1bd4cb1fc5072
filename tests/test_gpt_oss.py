"""GPT-OSS (docs/families.md §6): the presets carry the public config.json values, the mini keeps
every feature, the parameter counts are the model card's, bad fields are one line naming the
field, `mkresearch info` shows the bytes and the fit on one v5e and v6e, and the reference's new
pieces (sinks, the sliding window, the clamped SwiGLU with the experts' biases, the router's
softmax over its top-k biased logits, YaRN without truncation, widths padded to whole lanes)
against float64 NumPy written from transformers' GptOss code (tests/test_gpt_oss_hf.py runs
transformers itself). Tolerances as tests/test_families_reference.py states them."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_families_reference import (
    assert_output_close,
    bf,
    f64,
    normalised,
    np_rotate_half,
    random_cache,
)

from mkresearch.cli import main as cli_main
from mkresearch.model import formats, reference, roofline, rope, weights
from mkresearch.model.config import LANE, get_config
from mkresearch.model.stages import ffn, gqa_sink, moe_full

GPT_OSS = ("gpt-oss-20b", "gpt-oss-120b")


# ---- presets ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, layers, experts", [("gpt-oss-20b", 24, 32),
                                                    ("gpt-oss-120b", 36, 128)])
def test_presets_are_the_public_config(name, layers, experts):
    c = get_config(name)
    assert (c.n_layers, c.d_norm, c.d_model, c.vocab_size) == (layers, 2880, 2944, 201088)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.attention_bias, c.qk_norm) == (
        64, 8, 64, True, False)
    # transformers' default layer_types: sliding on even layers (0-based), full on odd
    assert c.attention_kinds == ("gqa_sink_window", "gqa_sink") * (layers // 2)
    assert (c.sliding_window, c.rope_theta, c.rope_partial, c.max_seq_len) == (
        128, 150000, 1.0, 131072)
    assert (c.yarn_factor, c.yarn_original_max_positions, c.yarn_beta_fast, c.yarn_beta_slow,
            c.yarn_truncate, c.yarn_mscale_all_dim) == (32, 4096, 32, 1, False, 0)
    assert (c.n_experts, c.top_k, c.expert_hidden_checkpoint, c.expert_hidden) == (
        experts, 4, 2880, 2944)
    assert (c.router_score, c.router_bias, c.expert_bias, c.n_shared_experts) == (
        "topk_softmax", True, True, 0)
    assert (c.activation, c.swiglu_alpha, c.swiglu_limit, c.expert_format) == (
        "clamped_swiglu", 1.702, 7.0, "mxfp4")
    assert (c.rms_eps, c.residual, c.ffn, c.n_dense_layers) == (1e-5, "prenorm", "moe_full", 0)


def test_mini_keeps_every_feature():
    mini, full = get_config("gpt-oss-mini"), get_config("gpt-oss-20b")
    same = ("attention", "ffn", "residual", "activation", "router_score", "router_bias",
            "expert_bias", "attention_bias", "qk_norm", "head_dim", "rope_theta", "yarn_factor",
            "yarn_truncate", "swiglu_alpha", "swiglu_limit", "expert_format", "rms_eps")
    assert {f: getattr(mini, f) for f in same} == {f: getattr(full, f) for f in same}
    assert mini.n_layers == 4 and mini.vocab_size <= 2048 and 1 < mini.top_k < mini.n_experts
    assert mini.n_heads > mini.n_kv_heads and mini.head_dim % LANE  # 64: half a lane tile
    # both widths padded to whole lanes from whole MXFP4 blocks, as the checkpoint's 2880
    assert mini.d_model % LANE == 0 and mini.d_norm < mini.d_model and mini.d_norm % 32 == 0
    assert mini.expert_hidden_checkpoint < mini.expert_hidden
    # a window not of whole tiles, shorter than the cache: tiles before it are skipped
    assert mini.sliding_window % mini.kv_tile and mini.sliding_window < mini.max_seq_len


# ---- parameters: hand arithmetic, the model card's figures ----------------------------------------
def hand_counts(layers, experts, d=2880, vocab=201088, heads=64, kv=8, dim=64, hidden=2880):
    q, k = heads * dim, kv * dim
    attention = d * q + q + 2 * (d * k + k) + q * d + d + heads  # q/k/v/o bias, sinks
    expert = 3 * d * hidden + 2 * hidden + d  # W1, W3, W2 and their biases
    router = d * experts + experts
    norms = 2 * layers * d + d
    total = 2 * vocab * d + layers * (attention + router + experts * expert) + norms
    return total, total - vocab * d - layers * (experts - 4) * expert


@pytest.mark.parametrize("name, layers, experts", [("gpt-oss-20b", 24, 32),
                                                    ("gpt-oss-120b", 36, 128)])
def test_parameters_are_hand_arithmetic_and_the_model_card(name, layers, experts):
    """The lanes' padding (2880 -> 2944) is bytes, never parameters: the counts are the
    checkpoint's, the model card's 20.91 B / 3.61 B and 116.83 B / 5.13 B."""
    cfg = get_config(name)
    counts = roofline.parameter_breakdown(cfg)
    assert (counts["total"], counts["active"]) == hand_counts(layers, experts)
    rule = roofline.counting_rule(cfg)
    assert roofline.published_counts(cfg, rule) == (counts["total"], counts["active"])
    # the model card's figures, to its one decimal of billions
    assert (round(counts["total"] / 1e8), round(counts["active"] / 1e8)) == (
        round(rule.published[0] / 1e8), round(rule.published[1] / 1e8))
    padded = weights.param_shapes(cfg)
    assert roofline.padding_bytes(cfg) == roofline.tree_bytes(padded) - _unpadded_bytes(cfg)


def _unpadded_bytes(cfg):
    """The weights' bytes with every padded axis at the checkpoint's width, by hand: bf16 2 B a
    value, MXFP4 4 bits + one byte per 32 values, f32 4 B."""
    d, f, v, layers, e = cfg.d_norm, cfg.expert_hidden_checkpoint, cfg.vocab_size, cfg.n_layers, \
        cfg.n_experts
    q, k = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    bf16 = 2 * (2 * v * d + 2 * layers * d + d  # embedding, head, norms
                + layers * (d * q + q + 2 * (d * k + k) + q * d + d  # attention and biases
                            + d * e  # router
                            + e * (2 * f + d)))  # expert biases
    f32 = 4 * layers * (cfg.n_heads + e)  # sinks, router bias
    mxfp4 = layers * e * 3 * d * f * (0.5 + 1 / 32)
    return round(bf16 + f32 + mxfp4)


# ---- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, field", [
    ({"sliding_window": -1}, "sliding_window"),
    ({"d_model_checkpoint": 2816}, "d_model_checkpoint"),  # 2944 is not 2816 rounded up
    ({"expert_hidden_checkpoint": 3000}, "expert_hidden_checkpoint"),
    ({"expert_hidden_checkpoint": 2848}, "expert_hidden_checkpoint"),  # ambiguous axes
    ({"swiglu_limit": 0.0}, "swiglu_limit"),
    ({"swiglu_alpha": float("nan")}, "swiglu_alpha"),
    ({"expert_bias": 1}, "expert_bias"),
    ({"yarn_truncate": "no"}, "yarn_truncate"),
    ({"head_dim": 96}, "head_dim"),
    ({"router_groups": 4, "router_topk_groups": 2}, "router_groups"),
    ({"attention": "gqa_sink_window,gqa sink"}, "attention"),
])
def test_bad_fields_are_one_line_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}=") as raised:
        get_config("gpt-oss-20b", **changes)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("changes, field", [({"sliding_window": 0}, "sliding_window"),
                                            ({"qk_norm": True}, "qk_norm"),
                                            ({"attention": "gqa_sink,dense"}, "attention")])
def test_kinds_refuse_what_they_cannot_run(changes, field):
    """Checked where the model is built (the kinds' `spec.Stage.check`), one line naming it."""
    cfg = get_config("gpt-oss-mini", **changes)
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}=") as raised:
        weights.param_shapes(cfg)
    assert "\n" not in str(raised.value)


def test_info_shows_the_bytes_and_that_it_fits_a_v5e_and_a_v6e(capsys):
    assert cli_main.main(["info", "gpt-oss-20b", "--batch", "8", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "parameters: total 20.91 B, active per token 3.61 B" in out
    assert "of the weights are the zero padding of widths rounded up to whole lanes" in out
    lines = {line.split()[0]: line for line in out.splitlines() if "per device:" in line}
    assert "fits" in lines["v5e"] and "does not" not in lines["v5e"]
    assert "fits" in lines["v6e"] and "does not" not in lines["v6e"]
    cfg = get_config("gpt-oss-20b")  # 14.30 GB of weights + 1.66 GB of caches at 8 x 4224
    needed = roofline.hbm_footprint(cfg, "v5e", 8, 4224).needed
    assert needed < 16 * 2 ** 30 - 2 ** 30  # within the 15.7 GiB a v5e's runtime leaves
    assert not roofline.hbm_footprint(get_config("gpt-oss-120b"), "v5e", 1, 128).fits()


# ---- the reference against float64 ---------------------------------------------------------------
def np_inverse_frequencies(dim, theta, factor, original, beta_fast, beta_slow, truncate):
    """transformers' `_compute_yarn_parameters`, float64."""
    freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / ((high + 0.001 if high == low else high) - low),
                   0, 1)
    return freq / factor * ramp + freq * (1 - ramp)


def test_untruncated_yarn_is_transformers_closed_form():
    cfg = get_config("gpt-oss-20b")
    ours = rope.of(cfg, cfg.head_dim)
    want = np_inverse_frequencies(64, 150000.0, 32.0, 4096, 32, 1, truncate=False)
    np.testing.assert_allclose(np.asarray(rope.inverse_frequencies(ours)).ravel(), want,
                               rtol=2e-6)
    truncated = np_inverse_frequencies(64, 150000.0, 32.0, 4096, 32, 1, truncate=True)
    assert np.abs(want / truncated - 1).max() > 0.05  # truncating would change them
    assert ours.cos_sin_scale == pytest.approx(0.1 * math.log(32) + 1)  # attention factor


def np_sink_attention(p, x, cache, positions, cfg, window):
    """transformers' GptOssAttention for one decode token per row, float64 (eager attention:
    the sinks concatenated to the scores, dropped after the softmax; the sliding window masks
    slots j <= p - window)."""
    B, H, KV, D = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    x = f64(x)
    proj = {n: bf(x @ f64(p[f"w_{n}"]) + f64(p[f"b_{n}"])).reshape(B, -1, D) for n in "qkv"}
    r = cfg.rope_dim
    freq = np_inverse_frequencies(r, cfg.rope_theta, cfg.yarn_factor,
                                  cfg.yarn_original_max_positions, cfg.yarn_beta_fast,
                                  cfg.yarn_beta_slow, cfg.yarn_truncate)
    scale = 0.1 * math.log(cfg.yarn_factor) + 1  # cos and sin times the attention factor
    q = bf(np.stack([np_rotate_half(proj["q"][b], positions[b], freq, r) for b in range(B)])
           * scale)
    k = bf(np.stack([np_rotate_half(proj["k"][b], positions[b], freq, r) for b in range(B)])
           * scale)
    # the cache [B, S, KV·D] as [B, KV, S, D]
    keys, values = (f64(cache[n]).reshape(B, -1, KV, D).transpose(0, 2, 1, 3).copy()
                    for n in ("k", "v"))
    sinks = f64(p["sinks"])
    out = np.zeros((B, H, D))
    for b in range(B):
        pos = positions[b]
        keys[b, :, pos], values[b, :, pos] = k[b], proj["v"][b]
        first = max(0, pos - window + 1) if window else 0
        for h in range(H):
            g = h // (H // KV)
            s = keys[b, g, first:pos + 1] @ q[b, h] / math.sqrt(D)
            logits = np.append(s, sinks[h])
            a = np.exp(logits - logits.max())
            out[b, h] = bf((a[:-1] / a.sum()) @ values[b, g, first:pos + 1])
    back = [a.transpose(0, 2, 1, 3).reshape(B, -1, KV * D) for a in (keys, values)]
    return bf(out.reshape(B, H * D) @ f64(p["w_o"]) + f64(p["b_o"])), *back


@pytest.mark.slow
@pytest.mark.parametrize("kind", [gqa_sink.FULL, gqa_sink.WINDOW])
def test_sink_attention_matches_float64(kind):
    """Positions before, at and past the window (48 tokens in the mini), both kinds."""
    cfg = get_config("gpt-oss-mini")
    p = reference.layer_params(weights.init_params(cfg, 3)[kind], 1)
    positions = np.array([0, 47, 48, 100])
    shape = (4, cfg.max_seq_len, cfg.n_kv_heads * cfg.head_dim)  # lane-dense
    cache = random_cache({"k": shape, "v": shape}, seed=4)
    x = normalised(4, cfg.d_model, seed=5)
    window = gqa_sink.window_of(kind, cfg)
    out, new_cache = jax.jit(gqa_sink.sink_attention, static_argnames=("cfg", "window"))(
        p, x, cache, jnp.asarray(positions, jnp.int32), cfg, window)
    want, keys, values = np_sink_attention(p, x, cache, positions, cfg, window)
    assert_output_close(out, want, f"sink attention {kind}")
    np.testing.assert_allclose(f64(new_cache["v"]), values, rtol=0, atol=0)
    np.testing.assert_allclose(f64(new_cache["k"]), keys, rtol=2 ** -7, atol=1e-6)


def test_tokens_outside_the_window_change_no_bit():
    """A window layer's output is the same bits whatever the cache holds before the window: the
    tiles there add exactly nothing (so a kernel may skip them)."""
    cfg = get_config("gpt-oss-mini")
    p = reference.layer_params(weights.init_params(cfg, 3)[gqa_sink.WINDOW], 0)
    positions = jnp.asarray([100, 60], jnp.int32)
    shape = (2, cfg.max_seq_len, cfg.n_kv_heads * cfg.head_dim)
    cache = random_cache({"k": shape, "v": shape}, seed=6)
    slots = np.arange(cfg.max_seq_len)
    before = slots[None, :] <= np.asarray(positions)[:, None] - cfg.sliding_window  # [B, S]
    other = jax.tree.map(lambda c: jnp.where(before[:, :, None], 1e4, c), cache)
    run = jax.jit(gqa_sink.sink_attention, static_argnames=("cfg", "window"))
    a, _ = run(p, normalised(2, cfg.d_model, 7), cache, positions, cfg, cfg.sliding_window)
    b, _ = run(p, normalised(2, cfg.d_model, 7), other, positions, cfg, cfg.sliding_window)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def np_route(p, x, cfg):
    """GptOssTopKRouter, float64: logits = x W + b, top k, softmax over those k."""
    logits = f64(x) @ f64(p["w_router"]) + f64(p["router_bias"])
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :cfg.top_k]
    top = np.take_along_axis(logits, ids, axis=-1)
    weights_ = np.exp(top - top.max(-1, keepdims=True))
    return ids, weights_ / weights_.sum(-1, keepdims=True)


def np_clamped_swiglu(g, u, alpha, limit):
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return bf((u + 1) * (g / (1 + np.exp(-alpha * g))))


def test_router_is_a_softmax_over_the_top_k_biased_logits():
    cfg = get_config("gpt-oss-mini")
    p = reference.layer_params(weights.init_params(cfg, 9)["moe_full"], 0)
    p = {**p, "router_bias": p["router_bias"] * 20}  # large enough to change choices
    x = normalised(16, cfg.d_model, seed=10)
    ids, w = jax.jit(ffn.route, static_argnames="cfg")(p, x, cfg)
    want_ids, want_w = np_route(p, x, cfg)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(f64(w), want_w, rtol=4e-6)
    unbiased = np_route({**p, "router_bias": jnp.zeros_like(p["router_bias"])}, x, cfg)[0]
    assert (unbiased != want_ids).any()  # the bias is in the choice, not only the weights


def test_experts_with_biases_and_the_clamped_swiglu_match_float64():
    cfg = get_config("gpt-oss-mini", expert_format="bf16")  # MXFP4: tests/test_weights.py
    p = reference.layer_params(weights.init_params(cfg, 11)["moe_full"], 0)
    # projections large enough for both clamps (gate above 7, up beyond ±7) to bite
    experts = {**p["experts"], "w1": p["experts"]["w1"] * 8, "w3": p["experts"]["w3"] * 8}
    p = {**p, "experts": experts}
    x = normalised(5, cfg.d_model, seed=12)
    ids, w = np_route(p, x, cfg)
    xs, ex = f64(x), {k: f64(v) for k, v in p["experts"].items()}
    routed, clamped = np.zeros((5, cfg.d_model)), 0
    for b in range(5):
        for j in np.argsort(ids[b]):  # ascending expert id
            e = ids[b, j]
            g, u = bf(xs[b] @ ex["w1"][e] + ex["b1"][e]), bf(xs[b] @ ex["w3"][e] + ex["b3"][e])
            clamped += (g > 7).sum() + (np.abs(u) > 7).sum()
            h = np_clamped_swiglu(g, u, cfg.swiglu_alpha, cfg.swiglu_limit)
            routed[b] += w[b, j] * bf(h @ ex["w2"][e] + ex["b2"][e])
    assert clamped > 0
    got = jax.jit(moe_full.moe_full_ffn, static_argnames="cfg")(p, x, cfg)
    assert_output_close(got, bf(routed), "gpt-oss experts")


@pytest.mark.slow
def test_padding_stays_zero_through_the_step():
    """d_model 384 holds the checkpoint's 352: every weight's padding is zero, so the hidden
    state's padding columns stay exactly zero, and RMSNorm divides by 352."""
    cfg = get_config("gpt-oss-mini")
    params = weights.init_params(cfg, 0)
    assert not np.asarray(params["embed"][:, cfg.d_norm:], np.float32).any()
    assert not np.asarray(params["moe_full"]["experts"]["b2"][..., cfg.d_norm:], np.float32).any()
    state = reference.init_state(cfg, 2)
    for t in range(3):
        _, state, aux = reference.decode_step(params, state, jnp.asarray([5, 9]),
                                              jnp.asarray([t, t]), cfg)
        assert not np.asarray(aux["hidden"][:, cfg.d_norm:], np.float32).any()
    h = jnp.asarray(np.random.default_rng(0).standard_normal((2, cfg.d_model)), jnp.bfloat16)
    h = h.at[:, cfg.d_norm:].set(0)
    normed = reference.rms_norm(h, jnp.ones(cfg.d_model), cfg.rms_eps, cfg.d_norm)
    want = bf(f64(h) / np.sqrt((f64(h) ** 2).sum(-1, keepdims=True) / cfg.d_norm + cfg.rms_eps))
    np.testing.assert_allclose(f64(normed), want, rtol=2 ** -7)


def test_random_params_are_drawn_on_the_device_in_the_stored_format():
    """`weights.random_params` (gpt-oss-20b timed on one v5e: benchmarks/gpt_oss_v5e.py): the
    pytree of `param_shapes`, MXFP4 experts drawn as codes and scales (no full-precision matrix),
    their RMS the leaf's normal's to within the E8M0 scale's power of two, the padding zero, and
    a decode step's logits finite and O(1)."""
    cfg = get_config("gpt-oss-mini")
    params = weights.random_params(cfg, seed=1)
    shapes = weights.param_shapes(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(shapes)))
    w1 = np.asarray(formats.mxfp4_unpack(jax.tree.map(lambda a: a[2], params["moe_full"]["experts"]
                                                      ["w1"])))
    d, f = cfg.d_norm, cfg.expert_hidden_checkpoint
    rms = np.sqrt(np.mean(w1[:, :d, :f] ** 2))
    assert 2 ** -0.5 < rms * np.sqrt(cfg.d_model) < 2 ** 0.5
    assert not w1[:, d:].any() and not w1[:, :, f:].any()
    assert not np.asarray(params["embed"][:, d:], np.float32).any()
    logits, _, _ = reference.decode_step(params, reference.init_state(cfg, 2),
                                         jnp.asarray([3, 4]), jnp.asarray([0, 0]), cfg)
    assert np.isfinite(np.asarray(logits)).all() and 0.1 < float(np.std(logits)) < 10
