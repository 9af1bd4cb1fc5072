"""Our loader and reference against an independent implementation: Hugging Face `transformers`.

Tiny random DeepSeek-V3 (with its query LoRA, and without it as Moonlight-16B-A3B configures it:
`q_lora_rank` None), Qwen3-MoE and GLM-4.5 models (tests/hf_tiny.py: built from small
configs, weights redrawn at O(1) scale, saved with `save_pretrained`; nothing downloaded) load
through `mkresearch.checkpoint`. Our reference over a 12-token sequence (`mkresearch.model.prefill`, one
jitted call over the first PROMPT_LEN tokens, then `reference.decode_step` for the rest) gives logits within LOGIT_BOUND of
transformers' own forward pass over the whole sequence (bf16 weights and activations on both
sides, logits of RMS ~1: the two round in different places, ~0.03-0.07 apart measured). Then the
megakernel, from the reference's state after the prompt, decodes greedy tokens equal to the
reference's.

Routing near-ties: a top-k choice whose competing scores are closer than the two sides' bf16
rounding can flip (a flip in DeepSeek-V3's group selection changes the layer output by O(1));
both routers agree on the same input (checked while writing this test), so each family's
weight seed is one where no choice along the sequence is that close (SEEDS).

config.json as transformers reads it: the defaults of missing fields (`hf_fields.DEFAULTS`
against transformers' config classes), YaRN with fields left out (inverse frequencies and scales
against transformers' own), and an FP8 checkpoint as transformers' FineGrainedFP8Config writes
its config, with d_model off the FP8 expert blocks (against its dequantized twin in transformers).

Needs the optional extra `mkresearch[hf]` (torch, transformers): without it, the tests skip.
"""

import importlib.util
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.compose import megakernel as mk

from mkresearch.checkpoint import loader as checkpoint
from mkresearch.checkpoint.tokenizer import TextStream
from mkresearch.model import hf_fields, reference, sampling
from mkresearch.model import prefill as chunked

# torch, transformers and tests/hf_tiny.py (which imports both) are imported inside the tests:
# every pytest worker collects every module of tests/, and importing them at collection cost
# each worker ~6 s and their memory here
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("torch", "transformers")),
    reason="the hf extra (torch, transformers) is not installed")


LOGIT_BOUND = 0.125  # |ours - transformers| on logits of RMS ~1 (bf16 both sides)
SEQ_LEN, PROMPT_LEN, MK_STEPS = 12, 8, 1  # one megakernel step each: make test's budget
SEEDS = {"deepseek_v3": 2, "moonlight": 0, "qwen3_moe": 0, "glm4_moe": 0}  # module docstring: no routing near-tie


@pytest.fixture(scope="module", params=sorted(SEEDS))
def loaded(request, tmp_path_factory):
    import hf_tiny

    model_type = request.param
    directory = str(tmp_path_factory.mktemp(model_type))
    model = hf_tiny.build(model_type, directory, seed=SEEDS[model_type])
    cfg = checkpoint.read_config(directory, name=f"hf-{model_type}", max_seq_len=64, kv_tile=32)
    params = checkpoint.load_params(directory, cfg, progress=False)
    tokens = np.random.default_rng(SEEDS[model_type]).integers(0, cfg.vocab_size, SEQ_LEN)
    return model_type, model, cfg, params, tokens.tolist()


def _ours(params, cfg, tokens):
    """Prefill over the prompt, then one decode step per remaining token: logits [T, V], and the
    state after the prompt."""
    prompt = jnp.asarray([tokens[:PROMPT_LEN]])
    logits, state = chunked.prefill(params, reference.init_state(cfg, 1), prompt, cfg)
    after_prompt = state
    rows = [np.asarray(logits[0])]
    for t in range(PROMPT_LEN, len(tokens)):
        step, state, _ = reference.decode_step(params, state, jnp.asarray([tokens[t]]),
                                               jnp.asarray([t]), cfg)
        rows.append(np.asarray(step))
    return np.concatenate(rows), after_prompt


def test_reads_the_saved_config(loaded):
    model_type, model, cfg, _, _ = loaded
    hf = model.config
    assert (cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.top_k) == (
        hf.hidden_size, hf.num_hidden_layers, hf.vocab_size, hf.num_experts_per_tok)
    assert cfg.attention == ("mla_rope" if hf.model_type == "deepseek_v3" else "gqa")
    if hf.model_type == "deepseek_v3":  # q_lora_rank None (Moonlight): W_q, our mla_q_rank 0
        assert cfg.mla_q_rank == (hf.q_lora_rank or 0)


@pytest.mark.slow
def test_logits_match_transformers_and_megakernel_tokens_match_reference(race_checked, loaded):
    import hf_tiny

    model_type, model, cfg, params, tokens = loaded
    theirs = hf_tiny.logits(model, tokens).numpy()  # [T, V]
    ours, state = _ours(params, cfg, tokens)
    diff = np.abs(ours - theirs).max(axis=-1)
    print(f"\n{model_type}: max |logit diff| vs transformers per position {diff.round(3).tolist()}"
          f" (logit RMS {np.sqrt(np.mean(theirs ** 2)):.2f}, bound {LOGIT_BOUND})")
    assert diff.max() <= LOGIT_BOUND, (model_type, diff.round(3).tolist())
    # the megakernel from the reference's state after the prompt: its greedy tokens
    prepared = mk.prepare_weights(params, cfg)
    ref_state, mk_state = state, state
    token, position = jnp.asarray([tokens[PROMPT_LEN - 1]]), PROMPT_LEN - 1
    ref_token = mk_token = token
    for _ in range(MK_STEPS):
        positions = jnp.asarray([position])
        logits, ref_state, _ = reference.decode_step(params, ref_state, ref_token, positions, cfg)
        ref_token = sampling.sample(logits, seed=0, positions=positions + 1)
        mk_token, mk_state, _ = mk.decode_step(prepared, mk_state, mk_token, positions, cfg)
        assert np.asarray(mk_token).tolist() == np.asarray(ref_token).tolist(), model_type
        position += 1


def test_offline():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


# ---- config.json as transformers reads it: defaults of missing fields, YaRN, FP8 ------------------
def _transformers_default(hf, field):
    """transformers' value of `field` in a default config `hf` (None: not a field of its class)."""
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": 10000.0}  # Kimi: NoPE MLA
    if field in ("rope_theta", "partial_rotary_factor"):
        return rope.get(field, 1.0 if field == "partial_rotary_factor" else None)
    if field == "first_k_dense_replace" and hf.model_type == "kimi_linear":
        return hf.mlp_layer_types.index("sparse")  # its dense first layers
    if field == "num_nextn_predict_layers":
        return getattr(hf, "num_mtp_layers", None)
    return getattr(hf, field, None)


@pytest.mark.parametrize("model_type", sorted(hf_fields.DEFAULTS))
def test_missing_fields_take_transformers_defaults(model_type):
    """Every default hf_fields gives a missing config.json field is transformers' own (its config
    class's), bar the fields its classes do not have (remote code: the only value its model
    implements). Before: qwen3_moe without norm_topk_prob was normalised (transformers: not),
    glm4_moe without partial_rotary_factor rotated all dims (transformers: half)."""
    import transformers

    hf = transformers.AutoConfig.for_model(model_type)
    remote = {"scoring_func", "topk_method", "moe_layer_freq", "mla_use_nope",
              "moe_router_activation_func"} | ({"num_nextn_predict_layers"}
                                               if model_type == "kimi_linear" else set())
    for field, ours in hf_fields.DEFAULTS[model_type].items():
        if field in remote:
            continue
        assert _transformers_default(hf, field) == ours, (model_type, field)
    assert all(getattr(hf, field, None) is None for field in remote - {"num_nextn_predict_layers"})


YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("drop, change", [
    ((), {}), (("original_max_position_embeddings",), {}), (("beta_fast", "beta_slow"), {}),
    (("mscale_all_dim",), {"mscale": 0.707}), (("mscale", "mscale_all_dim"), {}),
    ((), {"mscale": 0.707, "mscale_all_dim": 0.5})])
def test_yarn_reads_as_transformers(drop, change):
    """DeepSeek-V3's YaRN with fields left out or changed: our inverse frequencies, cos/sin scale
    and softmax scale are transformers' (`ROPE_INIT_FUNCTIONS["yarn"]`, DeepseekV3Attention's
    scaling). original_max_position_embeddings left out was a KeyError; transformers takes
    max_position_embeddings."""
    import hf_tiny
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from mkresearch.model import rope

    _, _, values = hf_tiny.CONFIGS["deepseek_v3"]
    scaling = {k: v for k, v in {**YARN, **change}.items() if k not in drop}
    raw = {**values, "model_type": "deepseek_v3", "rope_scaling": scaling}
    hf = transformers.DeepseekV3Config(**{**values, "rope_scaling": dict(scaling)})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = checkpoint.config_from_dict(raw)
    ours = rope.of(cfg, cfg.mla_qk_extra)
    np.testing.assert_allclose(np.asarray(rope.inverse_frequencies(ours)).ravel(),
                               inv_freq.numpy(), rtol=2e-6)  # f32 powers computed apart
    assert ours.cos_sin_scale == pytest.approx(attention_factor, rel=1e-12)
    qk_dim = cfg.mla_qk_nope + cfg.mla_qk_extra
    assert rope.attention_scale(cfg, qk_dim) == pytest.approx(
        yarn_apply_mscale(hf.rope_parameters, qk_dim ** -0.5), rel=1e-12)


def test_yarn_mscale_left_out_with_mscale_all_dim_is_one_line():
    """transformers and DeepSeek's code scale cos and sin differently then: refused, naming it."""
    import hf_tiny

    _, _, values = hf_tiny.CONFIGS["deepseek_v3"]
    raw = {**values, "model_type": "deepseek_v3",
           "rope_scaling": {k: v for k, v in YARN.items() if k != "mscale"}}
    with pytest.raises(checkpoint.CheckpointError, match=r"rope_scaling.mscale=None is not supp"):
        checkpoint.config_from_dict(raw)


@pytest.mark.slow
def test_fp8_qwen3_with_d_model_off_the_fp8_blocks_matches_transformers(tmp_path):
    """A qwen3_moe FP8 checkpoint (d_model 384, expert hidden 256; the quantization_config
    transformers' FineGrainedFP8Config writes, without fmt; a leftover rotary_emb.inv_freq):
    our reference's logits within LOGIT_BOUND of transformers' forward over its dequantized twin
    (the same values in bf16 files, through from_pretrained: transformers' own FP8 loader needs
    accelerate, not in our extra)."""
    import hf_tiny
    import torch
    import transformers

    from mkresearch.checkpoint import safetensors_io

    hf_tiny.CONFIGS["qwen3_moe_384"] = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **hf_tiny.CONFIGS["qwen3_moe"][2], "hidden_size": 384, "moe_intermediate_size": 256})
    bf16_dir, fp8_dir, twin_dir = (str(tmp_path / d) for d in ("bf16", "fp8", "twin"))
    hf_tiny.build("qwen3_moe_384", bf16_dir, seed=SEEDS["qwen3_moe"])
    del hf_tiny.CONFIGS["qwen3_moe_384"]
    raw = checkpoint._read_raw_config(bf16_dir)
    shards = safetensors_io.Shards(bf16_dir)
    linear = {name for group in checkpoint._entries(checkpoint.read_config(bf16_dir), raw)
              for entry in group if entry.linear for name in entry.names}
    tensors, twin = {}, {}
    for name in sorted(shards.names()):
        twin[name] = tensors[name] = shards.read_f32(name)
        if name in linear:
            tensors[name], tensors[name + "_scale_inv"] = safetensors_io.fp8_quantize(twin[name])
            twin[name] = safetensors_io.fp8_dequantize(tensors[name], tensors[name + "_scale_inv"])
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(64, np.float32)
    for directory, files in ((fp8_dir, tensors), (twin_dir, twin)):
        os.makedirs(directory)
        safetensors_io.write_file(os.path.join(directory, safetensors_io.SINGLE_FILE), files)
    with open(os.path.join(twin_dir, "config.json"), "w") as handle:
        json.dump(raw, handle)
    quant = transformers.FineGrainedFP8Config().to_dict()
    assert "fmt" not in quant
    raw["quantization_config"] = {**quant, "quant_method": "fp8",
                                  "weight_block_size": list(quant["weight_block_size"])}
    with open(os.path.join(fp8_dir, "config.json"), "w") as handle:
        json.dump(raw, handle)
    cfg = checkpoint.read_config(fp8_dir, max_seq_len=64, kv_tile=32)
    assert cfg.expert_format == "bf16"  # W1/W3 contract over d_model 384: no whole FP8 blocks
    params = checkpoint.load_params(fp8_dir, cfg, progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(twin_dir, dtype=torch.bfloat16)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, SEQ_LEN).tolist()
    theirs = hf_tiny.logits(model.eval(), tokens).numpy()
    ours, _ = _ours(params, cfg, tokens)
    diff = np.abs(ours - theirs).max()
    print(f"\nqwen3_moe FP8, d_model 384: max |logit diff| vs transformers {diff:.3f}")
    assert diff <= LOGIT_BOUND


@pytest.mark.parametrize("text, cut", [("a ✓", 2), ("a ✓", 3), ("x ✓ café", 7), ("x ✓ café", 9)])
def test_text_stream_prints_what_transformers_prints(tmp_path, capsys, text, cut):
    """Generated ids streamed through our TextStream and through transformers' TextStreamer
    (the same tokenizer.json): the same text, also when the ids stop inside a multi-byte
    character (replacement characters, and the space held with them)."""
    import torch
    import transformers
    from test_tokenizer import split_character_tokenizer

    tokenizer = split_character_tokenizer()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    ids = tokenizer.encode(text).ids[:cut]
    prompt, generated = ids[:1], ids[1:]
    streamer = transformers.TextStreamer(fast, skip_prompt=True)
    streamer.put(torch.tensor([prompt]))  # the prompt, skipped
    for token in generated:
        streamer.put(torch.tensor([token]))
    streamer.end()
    theirs = capsys.readouterr().out
    stream = TextStream(tokenizer, prompt)
    assert "".join(stream.push(t) for t in generated) + stream.end() + "\n" == theirs
