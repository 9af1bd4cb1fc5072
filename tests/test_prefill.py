"""Chunked prefill (`mkresearch.model.prefill`) against feeding the prompt one decode step at a time
(`reference.prefill`), for every family mini and both MLA cache layouts.

What must hold:
- the greedy tokens decoded after the prompt are equal (four steps from each state);
- the states after the prompt: KDA's recurrent and conv state (a scan of its decode sublayer) and
  the cache entries of the first attention layer (its inputs are the same bits) equal to the bit;
  every cache leaf within STATE_TOL · max|step-by-step| (the chunk's one f32 softmax vs the
  decode step's online one: a bf16 ulp or two in the attention outputs, carried into the
  next layers' cache entries);
- the logits after each prompt token within LOGIT_TOL · max|step-by-step|.
The prompt runs as two chunks of 5 tokens (two jitted calls, the second after cached tokens),
row 1 starting at slot 5.
Measured maxima are printed (pytest -s).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkresearch.model import prefill, reference, weights
from mkresearch.model.config import get_config

STATE_TOL, LOGIT_TOL = 2.0 ** -5, 2.0 ** -5
STEPS = 4

# `make test` runs two cases (KDA's scan, the latent MLA, the residual mix; GQA with its bias,
# partial RoPE and the pre-norm stream); the other three are exhaustive (each ~30 s of CPU:
# a decode step and a chunk compiled), the same chunk forms on other shapes.
EXHAUSTIVE = pytest.mark.exhaustive
CASES = {  # id: (preset, overrides, marks)
    "kimi-k3-mini-latent": ("kimi-k3-mini", {"mla_cache_layout": "latent"}, ()),
    "glm-4.5-mini": ("glm-4.5-mini", {}, ()),
    "kimi-k3-mini-expanded": ("kimi-k3-mini", {"mla_cache_layout": "expanded"}, EXHAUSTIVE),
    "deepseek-v3-mini": ("deepseek-v3-mini", {}, EXHAUSTIVE),
    "qwen3-235b-a22b-mini": ("qwen3-235b-a22b-mini", {}, EXHAUSTIVE),
}


def greedy_after(params, state, logits, start, cfg):
    """STEPS greedy tokens after a prompt ending at positions start - 1 [B]."""
    tokens = [jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)]
    for i in range(STEPS - 1):
        step_logits, state, _ = reference.decode_step(params, state, tokens[-1], start + i, cfg)
        tokens.append(jnp.argmax(step_logits, axis=-1).astype(jnp.int32))
    return np.stack([np.asarray(t) for t in tokens], axis=1)


def relative(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(case, marks=marks, id=case)
                                  for case, (_, _, marks) in CASES.items()])
def test_prefill_equals_step_by_step(case):
    preset, overrides, _ = CASES[case]
    cfg = get_config(preset, **overrides)
    params = weights.init_params(cfg, seed=3)
    # two rows starting at different slots (one mid-cache: a chunk after cached tokens)
    batch, length, start = 2, 10, np.array([0, 5], np.int32)
    prompt = np.random.default_rng(7).integers(0, cfg.vocab_size, (batch, length))
    fresh = reference.init_state(cfg, batch)
    want_logits, want_state = reference.prefill(params, fresh, prompt, cfg, start=start)
    got_logits, got_state = prefill.prefill(params, fresh, prompt, cfg, start=start,
                                            chunk=5)  # two calls of 5 tokens: one compile
    differences = {f"{kind}.{leaf}": relative(got_state[kind][leaf], want)
                   for kind, leaves in want_state.items() for leaf, want in leaves.items()}
    print(f"{case}: state max |chunked - stepwise| / max|stepwise| {differences}; logits "
          f"{relative(got_logits, want_logits):.2e}")
    assert max(differences.values()) <= STATE_TOL, differences
    assert relative(got_logits, want_logits) <= LOGIT_TOL
    # the layers up to the first attention layer with a chunk form see the same inputs: their
    # states (a KDA scan) and that layer's cache entries equal to the bit
    for layer, (kind, _) in enumerate(cfg.layers):
        index = cfg.kind_index(layer, kind)
        for leaf, want in want_state[kind].items():
            np.testing.assert_array_equal(np.asarray(got_state[kind][leaf][index]),
                                          np.asarray(want[index]), f"layer {layer} {leaf}")
        if kind in prefill.CHUNK_SUBLAYERS:
            break
    np.testing.assert_array_equal(greedy_after(params, got_state, got_logits, start + length, cfg),
                                  greedy_after(params, want_state, want_logits, start + length,
                                               cfg))


def test_write_chunk_puts_each_row_at_its_start():
    cache = jnp.zeros((2, 3, 8, 1), jnp.bfloat16)  # [B, H, S, n]
    new = jnp.arange(1, 2 * 3 * 3 + 1, dtype=jnp.bfloat16).reshape(2, 3, 3, 1)  # [B, T, H, n]
    out = np.asarray(prefill.write_chunk(cache, new, jnp.array([0, 4]), axis=1), np.float32)
    np.testing.assert_array_equal(out[0, :, :3, 0], np.asarray(new[0, :, :, 0], np.float32).T)
    np.testing.assert_array_equal(out[1, :, 4:7, 0], np.asarray(new[1, :, :, 0], np.float32).T)
    assert out[0, :, 3:].sum() == 0 and out[1, :, :4].sum() == 0 and out[1, :, 7:].sum() == 0


@pytest.mark.parametrize("bad, message", [
    ({"chunk": 0}, "chunk=0 is invalid"),
    ({"start": 126}, "positions="),
])
def test_bad_input_is_named(bad, message):
    cfg = get_config("qwen3-235b-a22b-mini")
    params = jax.eval_shape(lambda: weights.init_params(cfg, seed=0))
    with pytest.raises(ValueError, match=message):
        prefill.prefill(params, reference.init_state(cfg, 1), np.zeros((1, 4), np.int32), cfg,
                        **bad)
