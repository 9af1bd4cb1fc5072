"""DeepSeek-V3, GLM-4.5 and Qwen3-235B-A22B (docs/families.md): presets carry the public values,
the minis keep every feature, `mkresearch info` numbers equal hand arithmetic from the public
configs (parameters against the published totals), configs the composer cannot run are refused
naming the field, and the pre-norm decode step composes the registry's sublayers."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import dense_and_one_moe

from mkresearch.cli import info as cli_info
from mkresearch.cli import main as cli_main
from mkresearch.model import reference, roofline, spec, weights
from mkresearch.model.config import LANE, get_config

FAMILIES = ("deepseek-v3", "glm-4.5", "qwen3-235b-a22b")
MINIS = tuple(f"{name}-mini" for name in FAMILIES)


# ---- presets ------------------------------------------------------------------------------------
def test_deepseek_v3_is_the_public_config():
    c = get_config("deepseek-v3")
    assert (c.n_layers, c.d_model, c.vocab_size, c.n_heads) == (61, 7168, 129280, 128)
    assert (c.mla_q_rank, c.mla_kv_rank, c.mla_qk_nope, c.mla_qk_extra, c.mla_v_dim) == (
        1536, 512, 128, 64, 128)
    assert c.attention_kinds == ("mla_rope",) * 61 and c.mla_cache_layout == "latent"
    assert (c.rope_theta, c.yarn_factor, c.yarn_original_max_positions) == (10000, 40, 4096)
    assert (c.yarn_mscale, c.yarn_mscale_all_dim, c.yarn_beta_fast, c.yarn_beta_slow) == (
        1, 1, 32, 1)
    assert c.dense_layers == (0, 1, 2) and c.dense_hidden == 18432
    assert c.layers_of("moe_full") == tuple(range(3, 61))
    assert (c.n_experts, c.expert_hidden, c.n_shared_experts, c.shared_hidden, c.top_k) == (
        256, 2048, 1, 2048, 8)
    assert (c.router_score, c.router_bias, c.router_groups, c.router_topk_groups) == (
        "sigmoid", True, 8, 4)
    assert (c.router_normalize, c.routed_scale, c.activation, c.rms_eps) == (True, 2.5, "silu", 1e-6)
    assert c.residual == "prenorm" and c.logit_softcap is None and c.n_mtp_layers == 1


def test_glm_4_5_is_the_public_config():
    c = get_config("glm-4.5")
    assert (c.n_layers, c.d_model, c.vocab_size) == (92, 5120, 151552)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.attention_bias, c.qk_norm) == (
        96, 8, 128, True, True)
    assert (c.rope_partial, c.rope_dim, c.rope_theta, c.yarn_factor) == (0.5, 64, 1e6, 1)
    assert c.attention_kinds == ("gqa",) * 92
    assert c.dense_layers == (0, 1, 2) and c.dense_hidden == 12288
    assert (c.n_experts, c.expert_hidden, c.n_shared_experts, c.shared_hidden, c.top_k) == (
        160, 1536, 1, 1536, 8)
    assert (c.router_score, c.router_bias, c.router_groups, c.router_topk_groups) == (
        "sigmoid", True, 1, 1)
    assert (c.router_normalize, c.routed_scale, c.rms_eps, c.residual) == (True, 2.5, 1e-5, "prenorm")


def test_qwen3_235b_is_the_public_config():
    c = get_config("qwen3-235b-a22b")
    assert (c.n_layers, c.d_model, c.vocab_size) == (94, 4096, 151936)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.attention_bias, c.qk_norm) == (
        64, 4, 128, False, True)
    assert (c.rope_partial, c.rope_theta, c.yarn_factor) == (1.0, 1e6, 1)
    assert c.attention_kinds == ("gqa",) * 94 and c.ffn_kinds == ("moe_full",) * 94
    assert (c.n_experts, c.expert_hidden, c.n_shared_experts, c.top_k) == (128, 1536, 0, 8)
    assert (c.router_score, c.router_bias, c.router_normalize, c.routed_scale) == (
        "softmax", False, True, 1.0)
    assert (c.rms_eps, c.residual) == (1e-6, "prenorm")


@pytest.mark.parametrize("name", MINIS)
def test_mini_keeps_every_feature_of_its_family(name):
    mini, full = get_config(name), get_config(name.removesuffix("-mini"))
    assert mini.d_model <= 512 and mini.n_layers <= 4 and mini.vocab_size <= 2048
    assert (mini.kv_tile, mini.max_seq_len) == (32, 128)
    same = ("attention", "ffn", "residual", "activation", "router_score", "router_bias",
            "router_normalize", "routed_scale", "attention_bias", "qk_norm", "rope_partial",
            "rope_theta", "yarn_factor", "yarn_mscale_all_dim", "mla_qk_extra", "head_dim",
            "mla_cache_layout", "expert_format", "rms_eps")
    assert {f: getattr(mini, f) for f in same} == {f: getattr(full, f) for f in same}
    assert bool(mini.dense_layers) == bool(full.dense_layers)
    assert bool(mini.n_shared_experts) == bool(full.n_shared_experts)
    assert 1 < mini.top_k < mini.n_experts
    if full.router_groups > 1:  # several groups, only some eligible
        assert 1 < mini.router_topk_groups < mini.router_groups
    if "gqa" in mini.kinds:  # heads share K/V heads in groups
        assert mini.n_heads > mini.n_kv_heads and mini.head_dim % LANE == 0
    assert mini.d_model % LANE == 0 and mini.max_seq_len % mini.kv_tile == 0


# ---- parameters and info: hand arithmetic from the public configs ---------------------------------
def hand_counts(name):
    """(total, active) from the config.json values, written out: per layer attention + FFN, the
    embedding and LM head, norms; active = all but the embedding table and unselected experts."""
    if name == "deepseek-v3":
        d, vocab, layers, dense = 7168, 129280, 61, 3
        attention = (d * 1536 + 1536 + 1536 * 128 * 192 + d * (512 + 64) + 512
                     + 512 * 128 * (128 + 128) + 128 * 128 * d)
        dense_ffn, expert, shared, n_experts = 3 * d * 18432, 3 * d * 2048, 3 * d * 2048, 256
    elif name == "glm-4.5":
        d, vocab, layers, dense = 5120, 151552, 92, 3
        q, kv = 96 * 128, 8 * 128
        attention = d * q + q + 2 * (d * kv + kv) + 2 * 128 + q * d  # + q/k/v bias, QK-norm
        dense_ffn, expert, shared, n_experts = 3 * d * 12288, 3 * d * 1536, 3 * d * 1536, 160
    else:
        d, vocab, layers, dense = 4096, 151936, 94, 0
        q, kv = 64 * 128, 4 * 128
        attention = d * q + 2 * d * kv + 2 * 128 + q * d
        dense_ffn, expert, shared, n_experts = 0, 3 * d * 1536, 0, 128
    router = d * n_experts + n_experts  # W_r, correction bias (stored for every router)
    moe_layers = layers - dense
    norms = 2 * layers * d + d
    total = (2 * vocab * d + layers * attention + dense * dense_ffn + norms
             + moe_layers * (router + shared + n_experts * expert))
    active = total - vocab * d - moe_layers * (n_experts - 8) * expert
    return total, active


# Each publisher's counting rule (roofline.PARAMETER_RULES) beside ours (embedding table out of
# the active count, LM head in): DeepSeek counts as we do, GLM leaves the LM head out of "active",
# Qwen puts the embedding table in. Active as published, in the rule's own arithmetic:
PUBLISHER_ACTIVE = {"deepseek-v3": 36_625_618_432,  # ours
                    "glm-4.5": 32_856_319_904 - 151552 * 5120,  # ours - LM head
                    "qwen3-235b-a22b": 21_568_445_696 + 151936 * 4096}  # + embedding table


@pytest.mark.parametrize("name", FAMILIES)
def test_parameters_are_hand_arithmetic_and_the_published_totals(name):
    cfg = get_config(name)
    counts = roofline.parameter_breakdown(cfg)
    assert (counts["total"], counts["active"]) == hand_counts(name)
    rule = roofline.counting_rule(cfg)
    total, active = roofline.published_counts(cfg, rule)
    assert (total, active) == (counts["total"], PUBLISHER_ACTIVE[name])
    published_total, published_active = rule.published
    assert abs(total / published_total - 1) < 0.01  # -0.03 %, -0.62 %, +0.04 %
    if name == "deepseek-v3":  # 36.63 B, published rounded to whole billions: 1.01 % under 37 B
        assert round(active / 1e9) == 37 and abs(active / published_active - 1) < 0.0102
    else:  # GLM-4.5 32.08 B (+0.25 %), Qwen3 22.19 B (+0.87 %)
        assert abs(active / published_active - 1) < 0.01


@pytest.mark.parametrize("name, sibling, published", [
    # DeepSeek-V2: 236 B / 21 B (its shared experts: 2 x 1536 wide, one MLP of 3072)
    ("deepseek-v3", {"d_model": 5120, "n_layers": 60, "vocab_size": 102400, "n_dense_layers": 1,
                     "dense_hidden": 12288, "n_experts": 160, "top_k": 6, "expert_hidden": 1536,
                     "shared_hidden": 3072, "router_groups": 8, "router_topk_groups": 3},
     (236e9, 21e9)),
    # Qwen3-30B-A3B: 30.5 B / 3.3 B
    ("qwen3-235b-a22b", {"d_model": 2048, "n_layers": 48, "n_heads": 32, "n_kv_heads": 4,
                         "expert_hidden": 768}, (30.5e9, 3.3e9)),
])
def test_each_counting_rule_reproduces_a_sibling_model(name, sibling, published):
    """The rule is the publisher's, not fitted to one figure: it gives a sibling model's published
    figures too (GLM-4.5-Air's dense width 10944 is no multiple of 128: by hand in the rule's
    `checked_on`)."""
    rule = roofline.counting_rule(get_config(name))
    total, active = roofline.published_counts(get_config(name).replace(**sibling), rule)
    assert abs(total / published[0] - 1) < 0.01 and abs(active / published[1] - 1) < 0.02
    assert f"{total / 1e9:.2f} B / {active / 1e9:.2f} B" in rule.checked_on


def test_deepseek_mtp_module_is_counted_apart():
    cfg = get_config("deepseek-v3")
    d = 7168
    layer = roofline.parameter_breakdown(cfg)  # the main model: 671 B, no MTP
    attention = 187_107_328  # one MLA layer (hand_counts)
    moe = 256 * 3 * d * 2048 + 3 * d * 2048 + d * 256 + 256
    assert roofline.mtp_parameters(cfg) == attention + moe + 2 * d + 2 * d * d + 3 * d
    assert layer["total"] + roofline.mtp_parameters(cfg) == pytest.approx(682.6e9, rel=1e-3)
    assert roofline.mtp_parameters(get_config("qwen3-235b-a22b")) == 0


@pytest.fixture(scope="module")
def reports():
    return {name: cli_info.info(get_config(name), 1, 0, None, None) for name in FAMILIES}


def test_info_kv_bytes_per_token_and_bytes_per_step(reports):
    # docs/families.md §4: 2 x n_kv_heads x head_dim x 2 B per layer for GQA, (512 + 64) x 2 B for MLA
    assert reports["glm-4.5"]["cache_bytes_per_token"] == 92 * 4096
    assert reports["qwen3-235b-a22b"]["cache_bytes_per_token"] == 94 * 2048
    assert reports["deepseek-v3"]["cache_bytes_per_token"] == 61 * 1152
    for name, report in reports.items():
        cfg, step = get_config(name), report["step_bytes"]
        params = weights.param_shapes(cfg)
        experts = params["moe_full"]["experts"]
        one_expert = roofline.tree_bytes(experts) // (len(report["moe_layers"]) * cfg.n_experts)
        # B = 1: top_k experts per MoE layer, every other weight once, one embedding row
        expected = (roofline.tree_bytes(params) - roofline.tree_bytes(params["embed"])
                    - len(report["moe_layers"]) * (cfg.n_experts - cfg.top_k) * one_expert
                    + cfg.d_model * 2)
        assert step["weights"] == expected
        assert report["parameters"]["total"] == roofline.parameter_counts(cfg)[0]
        as_published = report["parameters"]["publisher_rule"]
        assert as_published["active"] == PUBLISHER_ACTIVE[name]
        assert as_published["published"] == roofline.counting_rule(cfg).published
        assert report["floor_one_chip"]["tpu7x"]["ms"] == pytest.approx(
            step["total"] / 7.37e12 * 1e3, rel=0.02)
        assert "mla_cache_bytes_per_token" not in report  # Kimi's two MLA layouts only


@pytest.mark.parametrize("name", ["deepseek-v3", "glm-4.5-mini"])
def test_info_command_prints_each_family(name, capsys):
    """The command in this process (`python -m mkresearch info deepseek-v3` in a child:
    test_cli_refuses_an_expanded_layout_for_deepseek_in_one_line)."""
    assert cli_main.main(["info", name, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == name and report["cache_bytes_per_token"] > 0
    assert cli_main.main(["info", name, "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "KV cache per context token" in out and "tokens/s" in out
    assert ("as published (embedding out, LM head in of active): total 671.03 B, active 36.63 B "
            "(published 671.00 B / 37.00 B)" in out) == (name == "deepseek-v3")


# ---- configs the composer cannot run ----------------------------------------------------------------
@pytest.mark.parametrize("name, changes, field", [
    ("deepseek-v3-mini", {"mla_cache_layout": "expanded"}, "mla_cache_layout"),
    ("deepseek-v3-mini", {"mla_qk_extra": 63}, "mla_qk_extra"),
    ("glm-4.5-mini", {"attention": "moe_full"}, "attention"),
    ("glm-4.5-mini", {"ffn": "dense+gqa"}, "ffn"),
    ("qwen3-235b-a22b-mini", {"ffn": "moe_full", "expert_format": "fp8", "d_model": 640},
     "expert_format"),
    ("kimi-k3-mini", {"attention": "gqa", "ffn": "moe_full"}, "n_dense_layers"),
])
def test_configs_the_composer_cannot_run_are_refused(name, changes, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        spec.check(get_config(name).replace(**changes))  # init_params, decode_step call it


def test_cli_refuses_an_expanded_layout_for_deepseek_in_one_line():
    done = subprocess.run([sys.executable, "-m", "mkresearch", "info", "deepseek-v3",
                           "--cache-layout", "expanded"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "mla_cache_layout" in done.stderr


# ---- the pre-norm decode step -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", [  # MLA with RoPE, and GQA with its biases and partial RoPE;
    "deepseek-v3-mini", "glm-4.5-mini",  # Qwen3's plain GQA is the exhaustive tier's
    pytest.param("qwen3-235b-a22b-mini", marks=pytest.mark.exhaustive)])
def test_prenorm_step_composes_the_registry_sublayers(name):
    """decode_step = h ← bf(h + Attn(RMSNorm(h))), h ← bf(h + FFN(RMSNorm(h))) layer by layer
    with the kinds of cfg.layers (dense first layers), logits = RMSNorm(h) W_lm: written out here
    with each kind's sublayer, bit for bit. On the mini's dense layers and first MoE layer (the
    later ones repeat its kinds)."""
    cfg = dense_and_one_moe(get_config(name))
    params = weights.init_params(cfg, seed=1)
    state = jax.tree.map(lambda s: jnp.asarray(
        np.random.default_rng(2).standard_normal(s.shape) * 0.5, s.dtype),
        jax.eval_shape(lambda: reference.init_state(cfg, 3)))
    tokens, positions = jnp.array([5, 700, 2047], jnp.int32), jnp.array([0, 40, 127], jnp.int32)
    logits, new_state, aux = reference.decode_step(params, state, tokens, positions, cfg)

    h, expect_state, ids = params["embed"][tokens], state, []
    for layer, kinds in enumerate(cfg.layers):
        for kind, norm in zip(kinds, ("attn_norm", "mlp_norm")):
            i = cfg.kind_index(layer, kind)
            x = reference.rms_norm(h, params[norm][layer], cfg.rms_eps)
            layer_state = (reference.layer_params(expect_state[kind], i)
                           if kind in expect_state else {})
            out, layer_state, extra = spec.stage(kind).sublayer(
                reference.layer_params(params[kind], i), x, layer_state, positions, cfg)
            if kind in expect_state:
                expect_state = {**expect_state, kind: jax.tree.map(
                    lambda whole, part, i=i: whole.at[i].set(part), expect_state[kind],
                    layer_state)}
            ids += [extra["expert_ids"]] if "expert_ids" in extra else []
            h = reference.bf(h.astype(jnp.float32) + out.astype(jnp.float32))
    expected = reference.matmul(reference.rms_norm(h, params["final_norm"], cfg.rms_eps),
                                params["lm_head"])
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(aux["hidden"]), np.asarray(h))
    np.testing.assert_array_equal(np.asarray(aux["expert_ids"]), np.asarray(jnp.stack(ids)))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(new_state),
                                 jax.tree.leaves(expect_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                      err_msg=jax.tree_util.keystr(path))
    assert [kinds for kinds in cfg.layers][:len(cfg.dense_layers)] == [
        (cfg.attention_kinds[0], "dense")] * len(cfg.dense_layers)


@pytest.mark.slow
@pytest.mark.parametrize("name", [  # one MLA-with-RoPE and one GQA family; GLM's GQA: exhaustive
    "deepseek-v3-mini", pytest.param("glm-4.5-mini", marks=pytest.mark.exhaustive),
    "qwen3-235b-a22b-mini"])
def test_reference_step_is_batch_invariant(name):
    """A row's logits and caches are the same bits at B = 8 and alone or in a batch of three
    (rows at other indices): per-(row, head) attention, ordered sums, experts combined in id
    order. On the mini's dense layers and first MoE layer (the later ones repeat its kinds)."""
    cfg = dense_and_one_moe(get_config(name))
    params = weights.init_params(cfg, 3)
    rng = np.random.default_rng(11)
    state = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.5, s.dtype),
                         jax.eval_shape(lambda: reference.init_state(cfg, 8)))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, 8), jnp.int32)
    positions = jnp.asarray(rng.integers(0, cfg.max_seq_len - 1, 8), jnp.int32)
    logits, new_state, _ = reference.decode_step(params, state, tokens, positions, cfg)
    for rows in ([5], [2, 7, 0]):
        idx = np.array(rows)
        part = jax.tree.map(lambda leaf, idx=idx: leaf[:, idx], state)
        got, got_state, _ = reference.decode_step(params, part, tokens[idx], positions[idx], cfg)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(logits)[idx])
        for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(new_state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:, idx])
