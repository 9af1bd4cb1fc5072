"""GPT-OSS from a checkpoint against transformers (`GptOssForCausalLM`), the independent oracle.

Tiny GPT-OSS models (tests/hf_tiny.py `GPT_OSS_CASES`: widths off the lane grid, head_dim 64,
sinks, sliding windows shorter than the prompts, another layer cycle, a tighter clamp; O(1)
weights, gate and up large enough for the clamps to bite) are saved by transformers in bf16 and
read by our loader. Our reference (bf16 weights and activations, as every family's) decodes
greedily from prompts shorter and longer than the window (and the megakernel, from the
reference's state after the prompt, gives the reference's logits bit for bit), and transformers
in f32 over the same tokens (one forward over the whole sequence, its sliding-window mask and
sinks, eager attention) picks the same token at every step that is not a near-tie: the logits
are within LOGIT_BOUND of its (measured <= 0.07 on logits of RMS ~1; transformers in bf16 is up
to 1.4 from its own f32
where a routing choice flips), so its top two farther apart than 2 LOGIT_BOUND cannot swap, and
at a near-tie our token is within 2 LOGIT_BOUND of its maximum (`_check_same_tokens`; the count
of near-ties is printed: with 512 random logits of RMS 1 about one step in three is one).

The MXFP4 checkpoint is written by us (our quantiser, `write_checkpoint` in the OCP MX layout as
released: `*_blocks`, `*_scales`, quantization_config mxfp4): transformers reads it
(`Mxfp4Config(dequantize=True)`) to the very logits of its dequantized twin (the same values in
bf16 files), our loader reads it straight into our MXFP4 parts bit for bit, and their values
equal the twin's as we load it, bit for bit; our reference's tokens on it are transformers'.
"""

import importlib.util
import os
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.compose import megakernel

from mkresearch.checkpoint import loader as checkpoint
from mkresearch.model import formats, reference

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("torch", "transformers")),
    reason="the hf extra (torch, transformers) is not installed")

LOGIT_BOUND = 0.1  # |ours (bf16 activations) - transformers (f32)| on logits of RMS ~1
STEPS = 8  # greedy tokens after the prompt
# (case, weight seed, prompt length): prompts shorter and longer than each case's window (12,
# 20, 7 tokens), decoding across it; the first runs in make test, the rest are the sweep
CASES = [("padded", 0, 16), ("padded", 1, 5), ("lanes", 0, 22), ("lanes", 3, 9),
         ("cycle", 2, 4), ("cycle", 0, 11)]


def _case(case, seed, prompt):
    marks = (pytest.mark.slow,) + (() if (case, seed) == ("padded", 0) else (
        pytest.mark.exhaustive,))
    return pytest.param(case, seed, prompt, marks=marks, id=f"{case}-seed{seed}-prompt{prompt}")


def _transformers(directory, **kwargs):
    import torch
    import transformers

    return transformers.GptOssForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()


def _their_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()


def _greedy(params, cfg, prompt, steps):
    """Our reference: the prompt fed one decode step per token, then `steps` greedy tokens.
    Returns (every token, our logits at each position from the prompt's last on)."""
    logits, state = reference.prefill(params, reference.init_state(cfg, 1),
                                      jnp.asarray([prompt]), cfg)
    rows, tokens = [np.asarray(logits[0, -1])], list(prompt)
    for i in range(steps):
        tokens.append(int(rows[-1].argmax()))
        if i + 1 < steps:
            step, state, _ = reference.decode_step(params, state, jnp.asarray([tokens[-1]]),
                                                   jnp.asarray([len(tokens) - 1]), cfg)
            rows.append(np.asarray(step[0]))
    return tokens, np.stack(rows)


def _check_same_tokens(model, params, cfg, prompt, what):
    """Our greedy tokens against transformers' greedy choice over the same prefix at every
    step: the same token wherever transformers' top two are more than 2 LOGIT_BOUND apart (no
    rounding within the bound can flip those), and where they are closer (a near-tie), our token
    is one of those within 2 LOGIT_BOUND of its maximum. Returns the whole sequence: the prompt
    and our tokens."""
    tokens, ours = _greedy(params, cfg, prompt, STEPS)
    theirs = _their_logits(model, tokens[:-1])[len(prompt) - 1:]  # [STEPS, V]
    top_two = np.sort(theirs, axis=-1)[:, -2:]
    margins = top_two[:, 1] - top_two[:, 0]
    diff = np.abs(ours - theirs).max(axis=-1)
    chosen = np.asarray(tokens[len(prompt):])
    same = theirs.argmax(axis=-1) == chosen
    ties = margins <= 2 * LOGIT_BOUND
    print(f"\n{what}: window {cfg.sliding_window}, positions {len(prompt) - 1}..{len(tokens) - 2}"
          f", max |logit diff| {diff.max():.3f} (RMS {np.sqrt(np.mean(theirs ** 2)):.2f}); "
          f"{same.sum()} of {STEPS} tokens transformers' own, {ties.sum()} steps near-ties "
          f"(top-two margins {[round(float(m), 3) for m in margins]})")
    assert diff.max() <= LOGIT_BOUND, (what, diff.round(3).tolist())
    assert same[~ties].all(), what
    gap = top_two[:, 1] - theirs[np.arange(STEPS), chosen]  # 0 where the same token
    assert (gap <= 2 * LOGIT_BOUND).all(), (what, gap.round(3).tolist())
    return tokens


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{(case, seed): (directory, our config, our params)}, built on demand."""
    import hf_tiny

    made = {}

    def get(case, seed):
        if (case, seed) not in made:
            directory = str(tmp_path_factory.mktemp(f"gpt-oss-{case}-{seed}"))
            hf_tiny.build_gpt_oss(case, directory, seed)
            cfg = checkpoint.read_config(directory, name=f"hf-{case}", max_seq_len=64,
                                         kv_tile=16)
            made[case, seed] = (directory, cfg, checkpoint.load_params(directory, cfg,
                                                                       progress=False))
        return made[case, seed]

    return get


def test_reads_the_saved_config(built):
    import hf_tiny

    _, cfg, _ = built("padded", 0)
    hf = hf_tiny.GPT_OSS_CASES["padded"]
    assert (cfg.d_norm, cfg.d_model, cfg.expert_hidden_checkpoint, cfg.expert_hidden) == (
        352, 384, 352, 384)
    assert cfg.attention_kinds == ("gqa_sink_window", "gqa_sink") * 2
    assert (cfg.sliding_window, cfg.n_experts, cfg.top_k, cfg.head_dim) == (
        hf["sliding_window"], hf["num_local_experts"], hf["num_experts_per_tok"], 64)
    assert (cfg.yarn_factor, cfg.yarn_truncate, cfg.rope_theta, cfg.expert_format) == (
        32, False, 150000, "bf16")


MK_STEPS = 2  # megakernel steps after the prompt, each from the reference's state


@pytest.mark.parametrize("case, seed, prompt", [_case(*c) for c in CASES])
def test_reference_decodes_the_tokens_of_transformers_in_f32(race_checked, built, case, seed,
                                                             prompt):
    """Then the megakernel from the reference's state after the prompt: MK_STEPS steps of the
    sequence, each step's logits the reference's bits (so its tokens are too)."""
    directory, cfg, params = built(case, seed)
    tokens = np.random.default_rng(seed + 10).integers(0, cfg.vocab_size, prompt).tolist()
    sequence = _check_same_tokens(_transformers(directory), params, cfg, tokens,
                                  f"{case} seed {seed}")
    _, state = reference.prefill(params, reference.init_state(cfg, 1), jnp.asarray([tokens[:-1]]),
                                 cfg)
    for position in range(prompt - 1, prompt - 1 + MK_STEPS):
        token, at = jnp.asarray([sequence[position]]), jnp.asarray([position])
        want, state_after, _ = reference.decode_step(params, state, token, at, cfg)
        _, _, aux = megakernel.decode_step(params, jax.tree.map(jnp.copy, state), token, at, cfg,
                                           return_logits=True)
        np.testing.assert_array_equal(np.asarray(aux["logits"]), np.asarray(want))
        state = state_after


def test_yarn_is_transformers(built):
    """transformers' own inverse frequencies and attention factor for GPT-OSS's untruncated
    YaRN (`ROPE_INIT_FUNCTIONS["yarn"]` on the saved config)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mkresearch.model import rope

    directory, cfg, _ = built("padded", 0)
    hf = transformers.AutoConfig.from_pretrained(directory)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = rope.of(cfg, cfg.head_dim)
    np.testing.assert_allclose(np.asarray(rope.inverse_frequencies(ours)).ravel(),
                               inv_freq.numpy(), rtol=2e-6)
    assert ours.cos_sin_scale == pytest.approx(factor, rel=1e-12)


@pytest.mark.slow
def test_our_mxfp4_checkpoint_is_read_by_transformers_and_loads_bit_equal_to_its_twin(
        built, tmp_path):
    import transformers

    directory, cfg, _ = built("padded", 0)
    stats = {}
    packed = checkpoint.load_params(directory, cfg, expert_format="mxfp4", progress=False,
                                    stats=stats)  # our quantiser, from the bf16 files
    cfg_mx = cfg.replace(expert_format="mxfp4")
    mx_dir, twin_dir = str(tmp_path / "mxfp4"), str(tmp_path / "twin")
    checkpoint.write_checkpoint(mx_dir, packed, cfg_mx)
    twin = jax.tree.map(lambda x: x, packed)
    twin["moe_full"]["experts"] = {
        key: formats.dequantize(value, "mxfp4") if key in formats.EXPERT_MATRICES else value
        for key, value in packed["moe_full"]["experts"].items()}
    checkpoint.write_checkpoint(twin_dir, twin, cfg)
    names = checkpoint.open_checked(mx_dir, cfg_mx)[0].names()
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    print(f"\nour quantiser on the tiny experts: relative RMS error {stats['expert_rel_rms']:.3f}")

    # ours: the MXFP4 files straight into our parts, bit for bit, and their values the twin's
    read = checkpoint.read_config(mx_dir, name="mx", max_seq_len=64, kv_tile=16)
    assert read.expert_format == "mxfp4"
    loaded = checkpoint.load_params(mx_dir, read, progress=False)
    same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), packed, loaded)
    assert all(jax.tree.leaves(same))
    twin_loaded = checkpoint.load_params(twin_dir, checkpoint.read_config(twin_dir), progress=False)
    for key in formats.EXPERT_MATRICES:
        np.testing.assert_array_equal(
            np.asarray(formats.dequantize(loaded["moe_full"]["experts"][key], "mxfp4")),
            np.asarray(twin_loaded["moe_full"]["experts"][key]))

    # transformers: the MXFP4 files dequantized on load give its twin's logits exactly
    theirs_mx = _transformers(mx_dir, quantization_config=transformers.Mxfp4Config(
        dequantize=True))
    theirs_twin = _transformers(twin_dir)
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, 20).tolist()
    np.testing.assert_array_equal(_their_logits(theirs_mx, tokens),
                                  _their_logits(theirs_twin, tokens))
    _check_same_tokens(theirs_mx, loaded, read, tokens[:14], "padded seed 0, MXFP4")


def test_loading_mxfp4_holds_no_bf16_copy_of_the_experts(built, tmp_path):
    """The peak of host memory Python allocates while loading an MXFP4 checkpoint (numpy's
    buffers, `tracemalloc`) stays below one bf16 copy of the model's experts: they are read as
    bytes into our parts, one layer at a time. Measured here on the tiny model; at full size the
    loader holds one layer's blocks and scales and their parts (gpt-oss-20b: ~0.4 GB read, and
    its parts, per layer) beside the model (docs/checkpoints.md §6)."""
    directory, cfg, _ = built("padded", 0)
    packed = checkpoint.load_params(directory, cfg, expert_format="mxfp4", progress=False)
    mx_dir = str(tmp_path / "mxfp4")
    checkpoint.write_checkpoint(mx_dir, packed, cfg.replace(expert_format="mxfp4"))
    read = checkpoint.read_config(mx_dir, max_seq_len=64, kv_tile=16)
    checkpoint.load_params(mx_dir, read, progress=False)  # compiles, caches
    experts = read.n_layers * read.n_experts * 3 * read.d_model * read.expert_hidden
    layer_blocks = sum(os.path.getsize(os.path.join(mx_dir, f)) for f in os.listdir(mx_dir)
                       if f.endswith(".safetensors")) / read.n_layers
    tracemalloc.start()
    checkpoint.load_params(mx_dir, read, progress=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"\npeak Python allocation loading the MXFP4 tiny model: {peak / 1e6:.2f} MB; its "
          f"experts in bf16 {2 * experts / 1e6:.2f} MB, one layer of the files "
          f"{layer_blocks / 1e6:.2f} MB")
    assert peak < 2 * experts  # never a bf16 copy of the experts

