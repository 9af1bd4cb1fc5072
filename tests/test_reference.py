"""The reference decode step against independent formulations: a per-element KDA loop, the two MLA
cache layouts, the attention-residual mix formula, engineered router ties, the §3 skeleton, and
decoding vs teacher forcing. Tolerances are docs/kimi-k3.md §11 unless stated."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from cuts import first_layers
from tiers import EXHAUSTIVE

from mkresearch.model import reference as R
from mkresearch.model import weights
from mkresearch.model.config import get_config
from mkresearch.sharding import reference_sharded

MINI = get_config("kimi-k3-mini")
BF16 = ml_dtypes.bfloat16
# jitted sublayers shared by the tests below (same shapes: compiled once per module)
mla_step = jax.jit(R.mla_attention, static_argnames="cfg")
kda_step = jax.jit(R.kda_attention, static_argnames="cfg")


@pytest.fixture(scope="module")
def params():
    return weights.init_params(MINI, seed=0)


def _bf(x) -> np.ndarray:
    """Round to bf16 and back to float64 (the spec's bf(...)), in numpy."""
    return np.asarray(x, np.float64).astype(BF16).astype(np.float64)


def _random_bf16(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


# ---- §4 KDA against a per-element loop -------------------------------------------------------
def _sigmoid(t: float) -> float:
    return 1 / (1 + math.exp(-t))


def _naive_kda(p, x, conv, state, cfg):
    """docs/kimi-k3.md §4 one element at a time in float64 (bf16 roundings where the spec says bf)."""
    H, D, width = cfg.n_heads, cfg.kda_head_dim, cfg.kda_conv_size
    q_pre, k_pre, v_pre, u, b, g_raw = (np.asarray(a, np.float64)
                                        for a in R.kda_projections(p, x, cfg))
    conv_w = np.asarray(p["conv_w"], np.float64)  # [3, width, H*D]
    a_log, dt_bias = np.asarray(p["a_log"], np.float64), np.asarray(p["dt_bias"], np.float64)
    o_norm = np.asarray(p["o_norm"], np.float64)
    conv = np.asarray(conv, np.float64)  # [B, width-1, 3, H, D]
    state = np.array(state, np.float64)  # [B, H, D, D]
    batch = x.shape[0]
    new_conv = np.zeros_like(conv)
    new_state = np.zeros_like(state)
    y = np.zeros((batch, H, D))
    for bi in range(batch):
        current = np.stack([q_pre[bi], k_pre[bi], v_pre[bi]])  # [3, H, D]
        window = np.concatenate([conv[bi], current[None]])  # [width, 3, H, D], oldest first
        new_conv[bi] = window[1:]
        for h in range(H):
            post = np.zeros((3, D))
            for kind in range(3):
                for c in range(D):
                    acc = sum(conv_w[kind, j, h * D + c] * window[j, kind, h, c]
                              for j in range(width))
                    post[kind, c] = _bf(acc * _sigmoid(acc))  # bf(SiLU(conv))
            q_hat, k_hat, v = post
            q = q_hat / math.sqrt(sum(t * t for t in q_hat) + cfg.l2_eps) / math.sqrt(D)
            k = k_hat / math.sqrt(sum(t * t for t in k_hat) + cfg.l2_eps)
            beta = _sigmoid(b[bi, h])
            rate = math.exp(a_log[h])
            decay = [math.exp(cfg.kda_decay_bound * _sigmoid(rate * (g_raw[bi, h, c]
                                                                    + dt_bias[h * D + c])))
                     for c in range(D)]
            s = state[bi, h]
            s_bar = [[decay[c] * s[c, j] for j in range(D)] for c in range(D)]
            predicted = [sum(s_bar[c][j] * k[c] for c in range(D)) for j in range(D)]  # S̄ᵀk
            for c in range(D):
                for j in range(D):
                    new_state[bi, h, c, j] = s_bar[c][j] + beta * k[c] * (v[j] - predicted[j])
            o = _bf([sum(new_state[bi, h, c, j] * q[c] for c in range(D)) for j in range(D)])
            normed = _bf(o / math.sqrt(np.mean(o * o) + cfg.rms_eps) * o_norm)
            gate = _bf([_sigmoid(t) for t in u[bi, h]])
            y[bi, h] = _bf(normed * gate)
    out = y.reshape(batch, H * D) @ np.asarray(p["w_o"], np.float64)
    return out, new_conv, new_state


@pytest.mark.slow
def test_kda_step_matches_a_per_element_loop(params):
    cfg, rng = MINI, np.random.default_rng(0)
    p = R.layer_params(params["kda"], 1)
    batch, H, D = 2, cfg.n_heads, cfg.kda_head_dim
    conv = _random_bf16(rng, (batch, cfg.kda_conv_size - 1, 3, H, D))
    state = jnp.asarray(rng.standard_normal((batch, H, D, D)) * 0.3, jnp.float32)
    naive_conv, naive_state = np.asarray(conv, np.float64), np.asarray(state, np.float64)
    for _ in range(3):  # three steps: the conv window shifts, the state carries over
        x = _random_bf16(rng, (batch, cfg.d_model))
        out, conv, state = kda_step(p, x, conv, state, cfg=cfg)
        naive_out, naive_conv, naive_state = _naive_kda(p, x, naive_conv, naive_state, cfg)
        np.testing.assert_array_equal(np.asarray(conv, np.float64), naive_conv)  # exact
        np.testing.assert_allclose(np.asarray(state), naive_state, rtol=2e-5, atol=2e-6)
        # out = bf(y W_o): one bf16 rounding after an f32-accumulated matmul
        np.testing.assert_allclose(np.asarray(out, np.float64), naive_out, rtol=1e-2, atol=1e-2)
    assert conv.dtype == jnp.bfloat16 and state.dtype == jnp.float32


# ---- §5 MLA: both cache layouts --------------------------------------------------------------
@pytest.mark.slow
def test_mla_cache_layouts_agree(params):
    """Expanded and latent caches give the same output to bf16 precision: |Δ| ≤ 4 bf16 ulps of the
    output's scale (2^-8 · 4 · max|out|), at positions 1..9 with a filled cache (observed: 1 ulp)."""
    expanded, latent = MINI, MINI.replace(mla_cache_layout="latent")
    p = R.layer_params(params["mla"], 1)
    batch, seq = 2, 16
    caches = {cfg.mla_cache_layout: R.layer_params(R.init_state(cfg, batch, seq)["mla"], 0)
              for cfg in (expanded, latent)}
    rng = np.random.default_rng(1)
    worst = 0.0
    for t in range(10):
        x = _random_bf16(rng, (batch, MINI.d_model))
        positions = jnp.full((batch,), t, jnp.int32)
        out_e, caches["expanded"] = mla_step(p, x, caches["expanded"], positions, cfg=expanded)
        out_l, caches["latent"] = mla_step(p, x, caches["latent"], positions, cfg=latent)
        out_e, out_l = np.asarray(out_e, np.float64), np.asarray(out_l, np.float64)
        tolerance = 4 * 2.0 ** -8 * np.abs(out_e).max()
        worst = max(worst, np.abs(out_e - out_l).max() / (2.0 ** -8 * np.abs(out_e).max()))
        assert np.abs(out_e - out_l).max() <= tolerance, (t, np.abs(out_e - out_l).max())
    assert worst > 0  # the layouts round differently: an exact match would mean a vacuous test
    # the caches hold the same keys: expanded k = [bf(ĉ W_kb) | k^X | 0] per head
    k, ckv, kx = caches["expanded"]["k"], caches["latent"]["ckv"], caches["latent"]["kx"]
    nope, qk = MINI.mla_qk_nope, MINI.mla_qk_dim
    w_kb = p["w_kvb"].reshape(MINI.mla_kv_rank, MINI.n_heads, -1)[..., :nope]
    k_nope = jnp.einsum("bsr,rhn->bhsn", ckv, w_kb, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(k[..., :nope], k_nope.astype(jnp.bfloat16))
    np.testing.assert_array_equal(k[..., nope:qk], jnp.broadcast_to(kx[:, None], k[..., nope:qk].shape))
    assert not np.asarray(k[..., qk:], np.float32).any()


def _slot_mask(cache, positions, slot_axis, later):
    """Per cache leaf: True at the slots of row b after (later) or at (not later) positions[b]."""
    def mask(leaf):
        slots = np.arange(leaf.shape[slot_axis]).reshape((-1,) + (1,) * (leaf.ndim - slot_axis - 1))
        row_positions = np.asarray(positions).reshape((-1,) + (1,) * (leaf.ndim - 1))
        return slots > row_positions if later else slots == row_positions

    return jax.tree.map(mask, cache)


def test_mla_rows_attend_only_to_their_own_past(params):
    """Row b at position p sees slots 0..p: garbage in later slots changes nothing, and only
    slot p of row b is written."""
    p = R.layer_params(params["mla"], 1)
    positions = jnp.asarray([9, 4], jnp.int32)
    for cfg in (MINI, MINI.replace(mla_cache_layout="latent")):
        rng = np.random.default_rng(2)
        empty = R.layer_params(R.init_state(cfg, 2, 16)["mla"], 0)
        cache = {name: _random_bf16(rng, leaf.shape) for name, leaf in empty.items()}
        slot_axis = 2 if cfg.mla_cache_layout == "expanded" else 1
        later = _slot_mask(cache, positions, slot_axis, later=True)
        garbage = {name: jnp.where(later[name], _random_bf16(rng, leaf.shape, 50.0), leaf)
                   for name, leaf in cache.items()}
        x = _random_bf16(rng, (2, cfg.d_model))
        out, new_cache = mla_step(p, x, cache, positions, cfg=cfg)
        out_garbage, _ = mla_step(p, x, garbage, positions, cfg=cfg)
        np.testing.assert_array_equal(out, out_garbage)
        written = _slot_mask(cache, positions, slot_axis, later=False)
        for name, leaf in cache.items():
            kept = np.broadcast_to(~written[name], leaf.shape)
            np.testing.assert_array_equal(np.asarray(new_cache[name])[kept], np.asarray(leaf)[kept])


# ---- §3 the attention-residual mix -----------------------------------------------------------
def test_mix_matches_the_direct_formula():
    rng = np.random.default_rng(3)
    n, batch, d = 4, 3, MINI.d_model
    scales = np.array([0.5, 1.0, 2.0, 4.0])[:, None, None]
    candidates = _random_bf16(rng, (n, batch, d)) * jnp.asarray(scales, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(d) * 3 / math.sqrt(d), jnp.float32)
    out = np.asarray(R.mix(candidates, w, MINI.rms_eps), np.float64)
    v, w64 = np.asarray(candidates, np.float64), np.asarray(w, np.float64)
    score = (v @ w64) / np.sqrt((v * v).mean(-1) + MINI.rms_eps)  # [N, B]
    alpha = np.exp(score - score.max(0)) / np.exp(score - score.max(0)).sum(0)
    direct = (alpha[..., None] * v).sum(0)
    assert alpha.max() < 0.99  # not one-hot: every candidate matters
    np.testing.assert_allclose(out, direct, rtol=4e-3, atol=4e-3)


# ---- §6.1 the router -------------------------------------------------------------------------
def _router_params(row_logits, bias=None):
    """Router weights whose logits for x = e_i are exactly row_logits[i] (bf16-exact values)."""
    rows = np.asarray(row_logits, np.float32)
    w = np.zeros((MINI.d_model, MINI.n_experts), np.float32)
    w[:len(rows)] = rows
    x = np.zeros((len(rows), MINI.d_model), np.float32)
    x[np.arange(len(rows)), np.arange(len(rows))] = 1
    bias = np.zeros(MINI.n_experts, np.float32) if bias is None else np.asarray(bias, np.float32)
    p = {"w_router": jnp.asarray(w, jnp.bfloat16), "router_bias": jnp.asarray(bias)}
    return p, jnp.asarray(x, jnp.bfloat16)


def _expected_route(row_logits, bias, cfg):
    logits = np.asarray(row_logits, np.float64)
    scores = 1 / (1 + np.exp(-logits))
    selection = scores + (np.asarray(bias) if cfg.router_bias else 0)
    ids = np.array([sorted(range(cfg.n_experts), key=lambda e: (-row[e], e))[:cfg.top_k]
                    for row in selection])
    top = np.take_along_axis(scores, ids, -1)
    return ids, top / top.sum(-1, keepdims=True) * cfg.routed_scale


def test_router_ties_go_to_the_lowest_index_and_bias_only_selects():
    logits = np.zeros((3, MINI.n_experts))
    logits[0, [1, 3, 5]] = 2.0  # a three-way tie at the top
    logits[0, [2, 7, 9]] = 1.0  # a tie for the last slot: 2 wins
    logits[1, :] = 0.5  # every expert tied: 0, 1, 2, 3
    logits[2, [15, 14, 13, 12, 0]] = [3.0, 2.5, 2.0, 1.5, 1.5]  # 0 beats 12 on the tie
    expectations = {
        "no bias": np.zeros(MINI.n_experts),
        "bias lifts expert 4": np.eye(MINI.n_experts)[4] * 3.0,
        "bias breaks a tie": np.eye(MINI.n_experts)[9] * 1e-3,
    }
    for name, bias in expectations.items():
        p, x = _router_params(logits, bias)
        ids, weights_ = R.route(p, x, MINI)
        expected_ids, expected_weights = _expected_route(logits, bias, MINI)
        assert ids.dtype == jnp.int32 and weights_.dtype == jnp.float32
        np.testing.assert_array_equal(ids, expected_ids, err_msg=name)
        np.testing.assert_allclose(weights_, expected_weights, rtol=1e-6, err_msg=name)
    assert list(R.route(*_router_params(logits), MINI)[0][0]) == [1, 3, 5, 2]
    assert list(R.route(*_router_params(logits, expectations["bias lifts expert 4"]), MINI)[0][0]
                ) == [4, 1, 3, 5]
    # the weight of expert 4 comes from its UNcorrected score σ(0), not σ(0) + 3
    _, w4 = R.route(*_router_params(logits, expectations["bias lifts expert 4"]), MINI)
    s = 1 / (1 + np.exp(-np.array([0.0, 2.0, 2.0, 2.0])))
    np.testing.assert_allclose(w4[0], s / s.sum(), rtol=1e-6)
    # router_bias=False ignores the bias; routed_scale scales the weights
    no_bias = MINI.replace(router_bias=False, routed_scale=2.5)
    ids, w = R.route(*_router_params(logits, expectations["bias lifts expert 4"]), no_bias)
    np.testing.assert_array_equal(ids[0], [1, 3, 5, 2])
    np.testing.assert_allclose(np.asarray(w).sum(-1), 2.5, rtol=1e-6)


def test_softmax_router_renormalises():
    cfg = MINI.replace(router_score="softmax")
    rng = np.random.default_rng(4)
    logits = np.round(rng.standard_normal((2, MINI.n_experts)) * 4) / 4  # bf16-exact
    p, x = _router_params(logits)
    ids, w = R.route(p, x, cfg)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    expected_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :cfg.top_k]
    np.testing.assert_array_equal(ids, expected_ids)
    top = np.take_along_axis(probs, expected_ids, -1)
    np.testing.assert_allclose(w, top / top.sum(-1, keepdims=True), rtol=1e-6)


# ---- §3 the skeleton -------------------------------------------------------------------------
def _spec_candidate_counts(cfg):
    """Number of Mix candidates per the spec: (attention, ffn) per layer, then the final mix."""
    counts = []
    for layer in range(cfg.n_layers):
        n, offset = divmod(layer, cfg.attn_res_block)
        attention = 1 if layer == 0 else (n + 1 if offset == 0 else n + 2)
        counts += [attention, n + 2]
    return counts + [cfg.n_blocks + 1]


# Kimi K3 at full size cut to its first 25 layers (two whole blocks of 12 and a block begun, as
# its 93 layers end in a partial block): the same widths, a quarter of the trace; its 93 layers:
# exhaustive (the mini's 7 run whole)
FULL_SIZE_LAYERS = None if EXHAUSTIVE else 25


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kimi-k3-mini", "kimi-k3"])
def test_step_skeleton_mixes_the_spec_candidates(name, monkeypatch):
    """Trace one step (no compile, no allocation at full size) and count the Mix candidates."""
    cfg = get_config(name)
    if name == "kimi-k3" and FULL_SIZE_LAYERS is not None:
        cfg = first_layers(cfg, FULL_SIZE_LAYERS)
        assert cfg.n_blocks == 3 and cfg.n_layers % cfg.attn_res_block == 1
    counts = []
    real_mix = R.mix

    def counting_mix(candidates, w, eps):
        counts.append(candidates.shape[0])
        return real_mix(candidates, w, eps)

    monkeypatch.setattr(R, "mix", counting_mix)
    state = jax.eval_shape(lambda: R.init_state(cfg, 1, 256))
    token = jax.ShapeDtypeStruct((1,), jnp.int32)
    logits, _, aux = jax.eval_shape(_traced_step(cfg), weights.param_shapes(cfg), state,
                                    token, token)
    assert counts == _spec_candidate_counts(cfg)
    assert logits.shape == (1, cfg.vocab_size) and logits.dtype == jnp.float32
    assert aux["snapshots"].shape == (cfg.n_blocks, 1, cfg.d_model)
    assert aux["hidden_rms"].shape == (cfg.n_layers, 1)


def _traced_step(cfg):
    return lambda params, state, tokens, positions: R.decode_step_unchecked(params, state, tokens,
                                                                   positions, cfg)


@pytest.mark.slow
def test_first_snapshot_is_the_embedding_and_state_layout(params):
    batch = 2
    state = R.init_state(MINI, batch)
    tokens = np.array([5, 1999])
    logits, new_state, aux = R.decode_step(params, state, tokens, np.zeros(batch, np.int32), MINI)
    np.testing.assert_array_equal(aux["snapshots"][0], params["embed"][tokens])
    assert jax.tree.map(lambda a: (a.shape, a.dtype), new_state) == jax.tree.map(
        lambda a: (a.shape, a.dtype), state)
    assert new_state["kda"]["conv"].shape == (5, batch, 3, 3, 2, 128)
    assert new_state["mla"]["k"].shape == (2, batch, 2, MINI.max_seq_len, 256)
    assert np.isfinite(np.asarray(logits)).all() and logits.shape == (batch, MINI.vocab_size)


@pytest.mark.slow
def test_softcap_bounds_the_logits(params):
    rng = np.random.default_rng(5)
    snapshots = _random_bf16(rng, (MINI.n_blocks, 2, MINI.d_model))
    partial = _random_bf16(rng, (2, MINI.d_model))
    plain = R.final_logits(params, snapshots, partial, MINI)
    capped = R.final_logits(params, snapshots, partial, MINI.replace(logit_softcap=0.5))
    np.testing.assert_allclose(capped, 0.5 * np.tanh(np.asarray(plain) / 0.5), rtol=1e-6, atol=1e-7)
    assert np.abs(np.asarray(capped)).max() < 0.5


# ---- decoding vs teacher forcing -------------------------------------------------------------
@pytest.mark.parametrize("temperature", [None, 1.0])  # None = greedy
@pytest.mark.slow
def test_decoding_equals_teacher_forced_stepping(params, temperature):
    batch, n_steps = 2, 5
    prompt = np.random.default_rng(6).integers(0, MINI.vocab_size, (batch, 3))
    tokens, state = R.generate(params, R.init_state(MINI, batch), prompt, n_steps, MINI,
                               seed=7, temperature=temperature)
    assert tokens.shape == (batch, n_steps) and tokens.dtype == jnp.int32
    forced = np.concatenate([prompt, np.asarray(tokens)[:, :-1]], axis=1)
    logits, forced_state = R.prefill(params, R.init_state(MINI, batch), forced, MINI)
    # the logits after token t predict token t+1: resample them at the same positions
    from mkresearch.model.sampling import sample
    for i in range(n_steps):
        position = prompt.shape[1] + i
        again = sample(logits[:, position - 1], seed=7, positions=np.full(batch, position),
                       temperature=temperature)
        np.testing.assert_array_equal(again, tokens[:, i])
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(forced_state)):
        np.testing.assert_array_equal(a, b)
    if temperature is None:
        np.testing.assert_array_equal(np.argmax(logits[:, 2:], -1), tokens)


def test_latent_layout_step_shapes():
    """The whole step with the latent cache traces and keeps the DEVELOPERS.md state layout (its
    numerics are the sublayer tests above: compiling a second whole step costs ~5-30 s)."""
    cfg = MINI.replace(mla_cache_layout="latent")
    state = jax.eval_shape(lambda: R.init_state(cfg, 2, 32))
    assert state["mla"]["ckv"].shape == (2, 2, 32, cfg.mla_kv_rank)
    assert state["mla"]["kx"].shape == (2, 2, 32, cfg.mla_qk_extra)
    token = jax.ShapeDtypeStruct((2,), jnp.int32)
    logits, new_state, _ = jax.eval_shape(_traced_step(cfg), weights.param_shapes(cfg), state,
                                          token, token)
    assert logits.shape == (2, cfg.vocab_size)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), new_state) == jax.tree.map(
        lambda a: (a.shape, a.dtype), state)


def test_bad_inputs_raise_value_error(params):
    state = R.init_state(MINI, 2)
    with pytest.raises(ValueError, match="positions"):
        R.decode_step(params, state, np.array([1, 2]), np.array([0]), MINI)
    with pytest.raises(ValueError, match="positions"):
        R.decode_step(params, state, np.array([1, 2]), np.array([0, MINI.max_seq_len]), MINI)
    with pytest.raises(ValueError, match="tokens"):
        R.decode_step(params, state, np.array([[1, 2]]), np.array([0, 0]), MINI)
    with pytest.raises(ValueError, match="batch"):
        R.init_state(MINI, 0)
    with pytest.raises(ValueError, match="n_steps"):
        R.generate(params, state, np.array([[1], [2]]), 0, MINI)
    with pytest.raises(ValueError, match="prompt"):
        R.prefill(params, state, np.array([1, 2]), MINI)
    # a token id past the table: the embedding's gather would clamp it to another token
    vocab = MINI.vocab_size
    with pytest.raises(ValueError, match=rf"tokens\[1\]={vocab} is invalid: token ids in \[0, {vocab}\)"):
        R.decode_step(params, state, np.array([1, vocab]), np.array([0, 0]), MINI)
    with pytest.raises(ValueError, match=r"tokens\[0\]=-1 is invalid"):
        R.decode_step(params, state, np.array([-1, 2]), np.array([0, 0]), MINI)
    with pytest.raises(ValueError, match=r"tokens.dtype=float32 is invalid: integer token ids"):
        R.decode_step(params, state, np.array([1.0, 2.0], np.float32), np.array([0, 0]), MINI)
    with pytest.raises(ValueError, match=rf"prompt\[1, 0\]={vocab + 5} is invalid"):
        R.generate(params, state, np.array([[1], [vocab + 5]]), 2, MINI)


# ---- expert_mxu="fp8": the same products, summed in another order ---------------------------------
# The project's bound for a step whose sums run in another order while a row's routing agrees
# (`reference_sharded.within_claim`, 0.3): an f32 difference flips a bf16 rounding now and then and
# the mini's random weights carry that ulp through later layers. Measured worst (make
# test-exhaustive, 8 seeds x 6 steps x 4 rows from an empty cache): 0.0117 MXFP4, 0.0243 FP8; one
# step from 8 prefilled states of 3 rows reached 0.0714 (FP8).
FP8_MXU_BOUND = reference_sharded.SAME_ROUTING_BOUND["f32"]
# both formats, 8 seeds each (~6 min here: the exhaustive tier; make test checks the stage
# kernel's bits against the reference's fp8 path and the product's bound, test_expert_kernel and
# test_weights)
FP8_MXU_CASES = [(fmt, seed) for fmt in ("mxfp4", "fp8") for seed in range(8)]


@pytest.mark.parametrize("fmt, seed", FP8_MXU_CASES)
@pytest.mark.exhaustive
def test_fp8_mxu_steps_stay_within_the_reordered_sums_bound(fmt, seed):
    """The reference decoding 6 tokens of 4 rows with experts handed to the MXU as fp8 (block
    scales after the dot) and as decoded bf16, each step from the same state (the decoded
    path's, as the kernel tests start each step from the reference's): each row's logits within
    FP8_MXU_BOUND while its routing agrees, greedy tokens equal off near-ties (top two logits
    within twice the bound). The products are exact; only the order of the f32 sums differs."""
    decoded = get_config("kimi-k3-mini", expert_format=fmt)
    fp8 = decoded.replace(expert_mxu="fp8")
    params = weights.init_params(decoded, seed)
    prompt = jax.random.randint(jax.random.key(seed), (4, 6), 0, decoded.vocab_size)
    state = R.init_state(decoded, 4)
    for t in range(prompt.shape[1]):
        positions = jnp.full(4, t, jnp.int32)
        a, next_state, aux_a = _step(params, state, prompt[:, t], positions, cfg=decoded)
        b, _, aux_b = _step(params, state, prompt[:, t], positions, cfg=fp8)
        moved = reference_sharded.routing_differs(aux_b["expert_ids"], aux_a["expert_ids"])
        assert reference_sharded.within_claim(b, a, moved).all(), f"step {t}"
        top2 = jnp.sort(a, -1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * FP8_MXU_BOUND  # not a near-tie
        np.testing.assert_array_equal(jnp.argmax(a, -1)[clear], jnp.argmax(b, -1)[clear])
        state = next_state


_step = jax.jit(R.decode_step_unchecked, static_argnames="cfg")
