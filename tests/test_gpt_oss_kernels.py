"""GPT-OSS's kernel pieces (docs/families.md §6) against the reference, in TPU interpret mode with
the race detector on: the sinks inside the online softmax and the sliding window as a KV-tile range
(`kernels/stages/gqa_sink.py` on gqa.py's body: only the window's tiles in the DMA log), the
router's bias and top-k softmax (`kernels/stages/router.py`), the experts' biases and the clamped
SwiGLU (`kernels/stages/experts.py`), widths padded to whole lanes (the trunk's norms divide by
the checkpoint's). Each is the same bits as the reference on gpt-oss-mini; so is the megakernel
composing them (tokens, logits and caches, teacher-forced steps at rows before and after the
window's first skipped tile); and it compiles with Mosaic for v5e and TPU7x (one kernel).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.stages import gqa_sink, moe_full, router
from tiers import EXHAUSTIVE

from mkresearch.model import reference, weights
from mkresearch.model.config import get_config
from mkresearch.model.stages import ffn
from mkresearch.model.stages import gqa_sink as gqa_sink_stage
from mkresearch.model.stages import moe_full as moe_full_stage

MINI = get_config("gpt-oss-mini")
# rows before the window's first tile moves (47), just past the window (48), and two whose window
# starts in tile 1 and tile 2 (tiles of 32, window 48: tile 0 skipped from position 79 on)
POSITIONS = [47, 48, 100, 126]


@pytest.fixture(scope="module")
def params():
    return weights.init_params(MINI, 0)


def _bits_equal(a, b):
    return all(bool((np.asarray(x) == np.asarray(y)).all())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _random_cache(batch, seed):
    shape = (batch, MINI.max_seq_len, MINI.n_kv_heads * MINI.head_dim)  # lane-dense
    rng = np.random.default_rng(seed)
    return {n: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for n in "kv"}


def _x(batch, seed):
    x = np.random.default_rng(seed).standard_normal((batch, MINI.d_model))
    x[:, MINI.d_norm:] = 0  # the padding of a normalised hidden state
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [gqa_sink_stage.FULL, gqa_sink_stage.WINDOW])
def test_sink_attention_kernel_is_the_reference_and_reads_the_window_only(race_checked, params,
                                                                         kind):
    p = reference.layer_params(params[kind], 1)
    cache, x = _random_cache(4, 4), _x(4, 5)
    positions = jnp.asarray(POSITIONS, jnp.int32)
    window = gqa_sink_stage.window_of(kind, MINI)
    want, want_cache = jax.jit(gqa_sink_stage.sink_attention, static_argnames=("cfg", "window"))(
        p, x, cache, positions, MINI, window)
    with dma.recording() as log:
        got, got_cache = gqa_sink.sink_attention(p, x, cache, positions, MINI, kind)
    assert _bits_equal(got, want) and _bits_equal(got_cache, want_cache)
    # the KV tiles each row read: the window's (a full layer: every tile up to its position)
    tiles = {}
    for event in log.events:
        if event.kind == "dma_start" and event.name == f"{kind}.kv.k":
            tiles.setdefault(event.indices["row"], set()).add(event.indices["tile"])
    tile = MINI.kv_tile
    for row, position in enumerate(POSITIONS):
        first = max(0, position - window + 1) // tile if window else 0
        assert tiles[row] == set(range(first, -(-position // tile))), (kind, row, tiles[row])
    if window:  # the rows past 79 skip tile 0 (and the one at 126, tiles 0 and 1... as it may)
        assert 0 not in tiles[2] and 0 not in tiles[3]


def test_router_kernel_is_a_softmax_over_the_top_k_biased_logits(race_checked, params):
    p = reference.layer_params(params["moe_full"], 0)
    p = {**p, "router_bias": p["router_bias"] * 20}  # large enough to change choices
    x = _x(8, 6)
    got = router.route(p, x, MINI)
    want = jax.jit(ffn.route, static_argnames="cfg")(p, x, MINI)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp4", pytest.param("bf16", marks=pytest.mark.exhaustive)])
def test_moe_layer_kernel_with_biases_and_clamped_swiglu_is_the_reference(race_checked, fmt):
    """Router, experts with their biases (fetched with each expert into slots of their own) and
    the clamped SwiGLU, gate and up projections large enough for both clamps to bite."""
    cfg = MINI.replace(expert_format=fmt)
    p = reference.layer_params(weights.init_params(cfg, 11)["moe_full"], 0)
    scaled = weights.init_params(cfg.replace(expert_format="bf16"), 11)["moe_full"]["experts"]
    experts = {**p["experts"], **{m: weights.quantize(scaled[m][0].astype(jnp.float32) * 8, fmt)
                                  for m in ("w1", "w3")}}
    p = {**p, "experts": experts}
    x = _x(3, 4)
    want = jax.jit(moe_full_stage.moe_full_ffn, static_argnames="cfg")(p, x, cfg)
    with dma.recording() as log:
        got = moe_full.moe_full_ffn(p, x, cfg)
    assert _bits_equal(got, want)
    assert not np.asarray(got, np.float32)[:, cfg.d_norm:].any()  # the padding stays zero
    ids = np.asarray(jax.jit(ffn.route, static_argnames="cfg")(p, x, cfg)[0])
    bias_bytes = log.dma_bytes("expert/b1/") + log.dma_bytes("expert/b3/") + log.dma_bytes(
        "expert/b2/")
    assert bias_bytes == len(set(ids.ravel())) * 2 * (2 * cfg.expert_hidden + cfg.d_model)


STEPS = 4 if EXHAUSTIVE else 2


@pytest.mark.slow
def test_megakernel_decodes_gpt_oss_mini_as_the_reference(race_checked, params):
    """Teacher-forced steps of the whole model in one pallas_call, from a state with every cache
    filled (random) and rows at POSITIONS: tokens, logits and caches the reference's bits."""
    batch = len(POSITIONS)
    state = reference.init_state(MINI, batch)
    rng = np.random.default_rng(3)
    state = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), state)
    tokens = jnp.asarray(rng.integers(0, MINI.vocab_size, batch), jnp.int32)
    positions = np.asarray(POSITIONS, np.int32)
    for step in range(STEPS):
        ref_logits, ref_state, _ = reference.decode_step(params, state, tokens, positions, MINI)
        got, got_state, aux = mk.decode_step(params, jax.tree.map(jnp.copy, state), tokens,
                                             positions, MINI, return_logits=True)
        np.testing.assert_array_equal(np.asarray(aux["logits"]), np.asarray(ref_logits))
        assert np.asarray(got).tolist() == np.asarray(ref_logits).argmax(-1).tolist()
        assert _bits_equal(got_state, ref_state), step
        state, tokens = ref_state, jnp.asarray(got)
        positions = np.minimum(positions + 1, MINI.max_seq_len - 1)


@pytest.mark.slow
@pytest.mark.parametrize("chip", ["v5e", "tpu7x"])
def test_mini_compiles_to_one_mosaic_kernel(chip):
    """head_dim 64 (half a lane tile), the window's tile range, the sinks, the MXFP4 experts with
    their biases: Mosaic lowers all of it for each chip (v5e: the integer MXFP4 decode, TPU7x the
    native one)."""
    result, plan = mk.compile_step(MINI, 4, chip=chip)
    print(f"gpt-oss-mini on {chip}: {result}; VMEM plan {plan.vmem.total_bytes / 2**20:.2f} MiB")
    assert result.n_mosaic_kernels == 1 and plan.vmem.fits()


@pytest.mark.slow
@pytest.mark.exhaustive
def test_gpt_oss_20b_fits_one_v5e_at_batch_8_and_4096_tokens():
    """The full model's step compiled for a v5e (Mosaic and XLA, ~1.5 min here) with its state
    donated, as a decode step runs: one Mosaic kernel, and XLA's HBM for the weights (14.30 GB),
    the caches of 8 rows of 4,224 tokens and its temporaries within the chip's 15.75 GiB."""
    from mkresearch.hardware import tpu

    cfg = get_config("gpt-oss-20b")
    plan = mk.make_plan(cfg, 8, 4224, mk.MegakernelOptions(chip="v5e"))
    result = tpu.compile_for(mk.step_fn(plan), *mk.step_shapes(plan), chip="v5e",
                             donate_argnums=(2,))
    memory = result.memory
    needed = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
              - memory["alias_size_in_bytes"] + memory["temp_size_in_bytes"])
    print(f"gpt-oss-20b, B = 8, 4,224 tokens on v5e: {result}; HBM {needed / 2**30:.2f} GiB")
    assert result.n_mosaic_kernels == 1 and needed < 15.75 * 2 ** 30
