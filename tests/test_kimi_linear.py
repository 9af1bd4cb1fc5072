"""Kimi-Linear-48B-A3B (`kimi_linear`, spec/checkpoints.md): its config.json read into our config,
its published tensor names, a checkpoint-layout round trip, and the reference running it.

transformers 5 has no implementation of `kimi_linear` (the published checkpoint ships its own
modeling file, which needs fla's Triton kernels), so nothing independent checks the math here:
the round trip is against our own published layout (`write_checkpoint` then `load_params`,
bit-equal), and the reference runs it (its chunked prefill against its step-by-step decode: opt-in
tier, equal to 0.0000 measured).

Kimi Linear differs from Kimi K3 in four places, each a config field: MLA without a query LoRA
(mla_q_rank 0), without RoPE and without an output gate (mla_output_gate False); KDA's output
gate through a rank-128 bottleneck (kda_output_gate_rank, g_a_proj / g_b_proj) and its decay
−exp(A_log)·softplus(g + dt_bias) (kda_decay "softplus", fla's gate without a lower bound).
The megakernel's KDA and MLA stages refuse the last three with one line naming the field.
"""

import copy
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkresearch.checkpoint import loader as checkpoint
from mkresearch.checkpoint import safetensors_io
from mkresearch.model import config, prefill, reference, weights
from mkresearch.model.published import PUBLISHED
from mkresearch.sharding import layout

# the published config at mini sizes: 4 layers, KDA on 1 and 3, MLA on 2 and 4 (1-based)
MINI_FIELDS = {
    "hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 512, "num_attention_heads": 2,
    "num_key_value_heads": 2, "kv_lora_rank": 128, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_token": 2,
    "model_max_length": 128}
MINI_LINEAR = {"num_heads": 2, "kda_layers": [1, 3], "full_attn_layers": [2, 4]}
PROMPT = jnp.asarray(np.random.default_rng(0).integers(0, 512, (1, 6)))
PREFILL_LOGIT_BOUND = 2e-2  # chunked prefill vs step-by-step: MLA's one softmax vs the online one


def mini_raw() -> dict:
    raw = copy.deepcopy(PUBLISHED["kimi-linear-48b-a3b"])
    raw.update(MINI_FIELDS)
    raw["linear_attn_config"].update(MINI_LINEAR)
    return raw


@pytest.fixture(scope="module")
def mini():
    cfg = checkpoint.config_from_dict(mini_raw(), "kimi-linear-mini", kv_tile=32)
    return cfg, weights.init_params(cfg, 0)


def test_preset_reads_the_published_config():
    cfg = layout.named_config("kimi-linear-48b-a3b")
    assert config.layer_pattern(cfg) == "KKKMKKKMKKKMKKKMKKKMKKKMKKM"
    assert (cfg.residual, cfg.ffn, cfg.n_dense_layers, cfg.dense_hidden) == (
        "prenorm", "dense+moe_full", 1, 9216)
    assert (cfg.mla_q_rank, cfg.mla_output_gate, cfg.mla_qk_extra, cfg.kda_output_gate_rank,
            cfg.kda_gate_rank, cfg.kda_decay) == (0, False, 64, 128, 128, "softplus")
    from mkresearch.model import roofline
    total, active = roofline.parameter_counts(cfg)
    # the name says 48 B; the config counts 49.12 B (routed experts alone 47.1 B), 3.1 B active
    assert round(total / 1e9, 1) == 49.1 and round(active / 1e9) == 3


def test_published_layout_round_trip_and_reference(tmp_path, mini):
    cfg, params = mini
    assert cfg.kda_layers == (0, 2) and cfg.mla_layers == (1, 3)
    directory = str(tmp_path / cfg.name)
    checkpoint.write_checkpoint(directory, params, cfg, shards=2)
    shards = safetensors_io.Shards(directory)
    kda, mla = "model.layers.0.self_attn.", "model.layers.1.self_attn."
    assert shards.shape(kda + "A_log") == (1, 1, 2, 1) and shards.dtype(kda + "A_log") == "F32"
    assert shards.shape(kda + "q_conv1d.weight") == (256, 1, 4)
    assert shards.shape(kda + "g_a_proj.weight") == (128, 256)
    assert shards.shape(mla + "q_proj.weight") == (2 * 192, 256)
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in shards.names()
    assert not any("q_a_proj" in n or "rotary" in n for n in shards.names())
    read = checkpoint.read_config(directory, name=cfg.name, kv_tile=cfg.kv_tile)
    assert read == cfg
    loaded = checkpoint.load_params(directory, read, progress=False)
    assert all(jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), loaded, params)))
    # the reference runs it: a prompt fed step by step (the chunked prefill: the test below)
    stepped, _ = reference.prefill(loaded, reference.init_state(cfg, 1), PROMPT, cfg)
    logits = np.asarray(stepped)
    assert np.isfinite(logits).all() and logits.std() > 0.1


@pytest.mark.exhaustive
def test_prefill_equals_step_by_step(mini):
    cfg, params = mini
    chunked, _ = prefill.prefill(params, reference.init_state(cfg, 1), PROMPT, cfg)
    stepped, _ = reference.prefill(params, reference.init_state(cfg, 1), PROMPT, cfg)
    diff = float(np.abs(np.asarray(chunked) - np.asarray(stepped)).max())
    print(f"\nkimi-linear-mini: prefill vs step-by-step max |logit diff| {diff:.4f}")
    assert diff <= PREFILL_LOGIT_BOUND


def test_missing_tensor_and_unsupported_fields_fail(tmp_path, mini):
    cfg, params = mini
    directory = str(tmp_path / cfg.name)
    checkpoint.write_checkpoint(directory, params, cfg)
    path = os.path.join(directory, safetensors_io.SINGLE_FILE)
    shards = safetensors_io.Shards(directory)
    tensors = {n: shards.read(n) for n in sorted(shards.names())}
    victim = "model.layers.2.self_attn.g_b_proj.weight"
    tensors.pop(victim)
    safetensors_io.write_file(path, tensors)
    with pytest.raises(checkpoint.CheckpointError, match=f"tensor {victim} is missing") as caught:
        checkpoint.load_params(directory, cfg, progress=False)
    assert "\n" not in str(caught.value)
    bad = mini_raw()
    bad["linear_attn_config"]["full_attn_layers"] = [2, 3]
    with pytest.raises(checkpoint.CheckpointError, match=r"full_attn_layers=\[2, 3\] is not "):
        checkpoint.config_from_dict(bad)
    with pytest.raises(checkpoint.CheckpointError, match="mla_use_nope=False is not supported"):
        checkpoint.config_from_dict({**mini_raw(), "mla_use_nope": False})


def test_kernels_refuse_what_they_do_not_run(mini):
    from mkresearch.kernels.stages import kda, mla
    cfg, _ = mini
    with pytest.raises(ValueError, match=r"ModelConfig.kda_output_gate_rank=128 is invalid for "
                                         r"the KDA kernel"):
        kda.make_plan(cfg, 1)
    with pytest.raises(ValueError, match="ModelConfig.mla_output_gate=False is invalid"):
        mla.make_plan(cfg, 1, cfg.max_seq_len)
