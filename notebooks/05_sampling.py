# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %%
# Setup: works on Colab, on a TPU VM and on a laptop. Installs mkresearch if it is missing.
# Only what this runtime lacks: mkresearch[plots] (the library with JAX; matplotlib and ipywidgets
# unless recent ones are here), never Jupyter, ipykernel or a notebook server, which a hosted
# runtime brings and depends on. From this checkout, else the git URL in MKRESEARCH_REPO.
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

_lacking = [name for name in ("matplotlib", "ipywidgets") if importlib.util.find_spec(name) is None]
if importlib.util.find_spec("mkresearch") is None:
    _lacking.insert(0, "mkresearch")
if _lacking:
    _root = os.path.abspath("..")
    _local = os.path.exists(os.path.join(_root, "pyproject.toml"))
    _repo = os.environ.get("MKRESEARCH_REPO", "https://github.com/mkresearch/mkresearch")
    _source = f"file://{_root}" if _local else f"git+{_repo}"
    _before = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           f"mkresearch[plots] @ {_source}"])
    importlib.invalidate_caches()
    _new = sorted(f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions()
                  if _before.get(d.metadata["Name"]) != d.version)
    print(f"setup: {', '.join(_lacking)} lacking; installed from "
          f"{'this checkout' if _local else _repo}: {', '.join(_new) or 'nothing new'}")
else:
    print("setup: nothing to install (mkresearch, matplotlib and ipywidgets are here)")
if "google.colab" in sys.modules:  # Colab draws ipywidgets 8 through its custom widget manager
    from google.colab import output as _colab_output
    _colab_output.enable_custom_widget_manager()
import mkresearch  # sets JAX_PLATFORMS=cpu when this machine has no TPU
from mkresearch.hardware import tpu

print(tpu.describe_backend())  # compiled on a TPU, TPU interpret mode elsewhere

# %% [markdown]
# # 05 · The tail of a decode step: final norm, LM head and sampling in one kernel
#
# The last stage of a Kimi K3 decode step mixes the attention-residual snapshots one final time,
# normalises, multiplies by the LM head — at 163840 × 7168 bf16 (2.35 GB) the largest single
# matrix of the model — and turns the logits into a token. Writing the `[B, V]` logits to HBM and
# sampling them in a separate XLA program costs a round trip and a launch per step. The released
# kernels do greedy inside the kernel but top-p outside it.
#
# This notebook builds the fused stage in four steps, each checked against the plain-JAX reference
# (`mkresearch.model.sampling`), then runs the Pallas kernel (`mkresearch.kernels.stages.sampling`):
#
# 1. greedy over materialised logits;
# 2. streamed greedy: the LM head arrives tile by tile, only a running best survives a tile;
# 3. Gumbel-max: exact temperature sampling with the same one-pass streaming;
# 4. top-k and top-p: a running list of 128 candidates and an exact running log-sum-exp.
#
# Every step calls the very functions the kernel body calls on its VMEM values
# (`initial_state`, `update_running_state`, `finish_sampling`): nothing here is pasted.

# %%
import inspect

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from mkresearch.kernels.base import dma
from mkresearch.kernels.stages import sampling as stage

from mkresearch.model import reference, sampling
from mkresearch.model.config import get_config
from mkresearch.sharding import layout
from mkresearch.views import facts
from mkresearch.views.label_plots import label_problems
from mkresearch.views.widgets import show_figure

cfg = get_config("kimi-k3-mini")
B, d, V = 8, cfg.d_model, cfg.vocab_size
TILE = 512  # vocab columns per LM head tile: 4 tiles at mini size

# Stand-ins for what the stage receives: the step's snapshots R_0..R_2 and partial sum P, and the
# final mix weight, final norm and LM head (random, of the model's shapes and dtypes).
keys = jax.random.split(jax.random.key(0), 5)
inputs = {
    "snapshots": jax.random.normal(keys[0], (cfg.n_blocks, B, d)).astype(jnp.bfloat16),  # [N-1, B, d]
    "partial": jax.random.normal(keys[1], (B, d)).astype(jnp.bfloat16),  # [B, d]
    "mix_out": jax.random.normal(keys[2], (d,)) * 0.05,  # [d] f32
    "final_norm": (1 + 0.1 * jax.random.normal(keys[3], (d,))).astype(jnp.bfloat16),  # [d]
    "lm_head": (jax.random.normal(keys[4], (d, V)) * 0.12).astype(jnp.bfloat16),  # [d, V]
}
params = {k: inputs[k] for k in ("mix_out", "final_norm", "lm_head")}
logits = reference.final_logits(params, inputs["snapshots"], inputs["partial"], cfg)  # [B, V] f32
# the normalised hidden state x that meets the LM head (reference.mix, then reference.rms_norm)
x = reference.rms_norm(reference.mix(jnp.concatenate([inputs["snapshots"], inputs["partial"][None]]),
                                     inputs["mix_out"], cfg.rms_eps), inputs["final_norm"], cfg.rms_eps)
positions = jnp.arange(B, dtype=jnp.int32) + 100
SEED = 7
print(f"x {x.shape} {x.dtype}, lm_head {inputs['lm_head'].shape}, logits {logits.shape} {logits.dtype}")

# %% [markdown]
# ## Randomness from counters
#
# A kernel has no PRNG state to carry between steps, and the same token must come out on CPU and on
# a TPU. So every uniform is a pure function of four integers, `U(seed, row, position, index)`:
# a chain of murmur3 `fmix32` finalisers (uint32 xor, shift, multiply, add — all VPU ops), keeping
# 23 bits as an odd multiple of 2⁻²⁴, so `U` is never 0 or 1. The Gumbel noise is `G = -log(-log U)`.

# %%
print(inspect.getsource(sampling.fmix32))
print(inspect.getsource(sampling.counter_key))
print(inspect.getsource(sampling.uniform_from_key))

# %%
# NBVAL_CHECK_OUTPUT
# Pinned values: any machine, kernel or reference, must give these bits.
for counters in [(0, 0, 0, 0), (1, 2, 3, 4), (7, 0, 100, 163839)]:
    print(f"U{counters} = {float(sampling.counter_uniform(*counters)):.10f}")
many = sampling.counter_uniform(SEED, jnp.arange(64)[:, None], 5, jnp.arange(4096)[None, :])
print(f"64 x 4096 uniforms: min > 0: {bool(many.min() > 0)}, max < 1: {bool(many.max() < 1)}, "
      f"mean {facts.stable(many.mean(), '.3f', 1e-5)}, var {facts.stable(many.var(), '.4f', 1e-5)}"
      " (1/12 = 0.0833)")

# %% [markdown]
# ## Step 1 · Greedy over materialised logits
#
# Greedy is an argmax where the **lower index wins ties**. It is spelled `temperature=None` (the
# default); `temperature=0` is not greedy but a `ValueError`, like any T ≤ 0. The running state
# starts empty (`initial_state`) and `update_running_state` folds a block of logits into it: row
# max, then the lowest index attaining it. Given all V logits at once it is just an argmax.

# %%
print(inspect.getsource(stage.row_best))
print(inspect.getsource(stage.take_better))

# %%
# NBVAL_CHECK_OUTPUT
all_indices = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (B, V))
rows = jnp.arange(B, dtype=jnp.int32)[:, None]
key = sampling.counter_key(SEED, rows, positions[:, None])  # [B, 1] uint32
state = stage.update_running_state(stage.initial_state(B), logits, all_indices, key,
                                   use_gumbel=False, use_candidates=False)
greedy_reference = sampling.sample(logits, seed=SEED, positions=positions)  # temperature=None
assert np.array_equal(state.greedy_index[:, 0], greedy_reference)
# engineered ties: three equal maxima, the first one wins
tied = logits.at[:, [9, 700, 1500]].set(100.0)
tied_state = stage.update_running_state(stage.initial_state(B), tied, all_indices, key,
                                        use_gumbel=False, use_candidates=False)
assert np.all(tied_state.greedy_index == 9)
assert np.all(sampling.sample(tied, seed=0, positions=positions) == 9)
for bad_temperature in (0.0, -1.0):  # greedy is None, never 0: T <= 0 is a ValueError
    try:
        sampling.sample(logits, seed=SEED, positions=positions, temperature=bad_temperature)
        raise AssertionError(f"temperature={bad_temperature} was accepted")
    except ValueError as error:
        assert "use temperature=None for greedy" in str(error)
print("step 1 greedy tokens:", state.greedy_index[:, 0].tolist())
print("step 1 PASS: equals the reference; ties go to the lowest index")

# %% [markdown]
# ## Step 2 · Streamed greedy
#
# The kernel never holds the `[B, V]` logits: the LM head streams through VMEM in column tiles
# `lm_head[:, t·TILE:(t+1)·TILE]`, and each tile's logits `x @ tile` are folded into the running
# state and dropped. Tiles come in vocabulary order, so on equal values the state (earlier tiles,
# lower indices) keeps its index: the result is exactly the one-shot argmax.

# %%
# NBVAL_CHECK_OUTPUT
def stream(z_of_tile, **flags):
    """Fold the logits of each LM head tile into the running state, in vocabulary order."""
    state = stage.initial_state(B)
    for t in range(V // TILE):
        tile = inputs["lm_head"][:, t * TILE:(t + 1) * TILE]  # [d, TILE]: what one DMA brings
        tile_logits = jnp.dot(x, tile, preferred_element_type=jnp.float32)  # [B, TILE]
        indices = t * TILE + jnp.broadcast_to(jnp.arange(TILE, dtype=jnp.int32), (B, TILE))
        state = stage.update_running_state(state, z_of_tile(tile_logits), indices, key, **flags)
    return state

streamed = stream(lambda l: l, use_gumbel=False, use_candidates=False)
assert np.array_equal(streamed.greedy_index, state.greedy_index)
state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(streamed))
print(f"step 2 PASS: streamed greedy over {V // TILE} tiles = one-shot greedy")
print(f"running state: {state_bytes} bytes for B={B} (logits would be {B * V * 4} bytes; "
      f"at the full vocab {B * 163840 * 4} bytes written to HBM and read back per step)")

# %% [markdown]
# ## Step 3 · Gumbel-max: exact temperature sampling in the same pass
#
# With `z = logits / T` and independent Gumbel noise `G_i`, `argmax_i (z_i + G_i)` is an exact
# sample of `softmax(z)`. It is another running argmax, now of `z + G`, with `G` from the counter
# of `(seed, row, position, index)`: one pass over the vocabulary, no normaliser needed.

# %%
# NBVAL_CHECK_OUTPUT
T = 0.8
gumbel_state = stream(lambda l: l / T, use_gumbel=True, use_candidates=False)
gumbel_reference = sampling.sample(logits, seed=SEED, positions=positions, temperature=T)
assert np.array_equal(gumbel_state.gumbel_index[:, 0], gumbel_reference)
print("step 3 sampled tokens:", gumbel_state.gumbel_index[:, 0].tolist())
print("step 3 PASS: streamed Gumbel-max = reference sample(temperature=0.8), token for token")

# %% [markdown]
# ## Step 4 · Top-k and top-p over 128 candidates
#
# Top-k and top-p need the *order* of the largest logits and the *total* mass. The running state
# keeps the 128 best `(z, index)` pairs, sorted (z descending, index ascending: `merge_candidates`
# inserts each tile element that beats the 128th candidate at its rank, best first, with a lane
# roll), and an online log-sum-exp (running max `m`, running `Σ exp(z − m)` rescaled when `m`
# grows) — exact, not an estimate.
#
# At the end (`finish_sampling`): `p_j = exp(z_j − lse)`, the mass before candidate `j` is one
# triangular matmul, and candidate `j` is kept while `j < top_k` and the mass before it is
# `< top_p` (the first always). Gumbel-max over the kept candidates samples the renormalised
# truncated distribution. **Top-p is exact whenever the nucleus fits in the 128 candidates**; when
# the candidates hold less than `top_p` of the mass, the row's `nucleus_overflow` flag is set.

# %%
print(inspect.getsource(stage.finish_sampling))

# %%
# NBVAL_CHECK_OUTPUT
modes = {"temperature": [None, 1.0, 0.7, 1.0, 0.8, 1.2, 1.0, 8.0],  # None: a greedy row
             "top_k": [0, 0, 0, 1, 5, 128, 0, 0],
             "top_p": [1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.5, 0.95]}
# the per-row arrays the kernel takes (validated; a greedy row's temperature is encoded as 0)
row_params = sampling.check_params(B, V, candidates=128, **modes)
scale = np.where(row_params.temperature > 0, row_params.temperature, 1.0)[:, None]  # [B, 1]
candidate_state = stream(lambda l: l / scale, use_gumbel=True, use_candidates=True)
tokens, overflow = stage.finish_sampling(
    candidate_state, key, jnp.asarray(row_params.temperature)[:, None],
    jnp.asarray(row_params.top_k)[:, None], jnp.asarray(row_params.top_p)[:, None], candidates=128)
want = sampling.sample(logits, seed=SEED, positions=positions, candidates=128, **modes)
want_overflow = sampling.nucleus_overflow(logits, candidates=128, **modes)
sizes = sampling.nucleus_size(logits, temperature=modes["temperature"], top_p=modes["top_p"])
assert np.array_equal(tokens[:, 0], want) and np.array_equal(overflow[:, 0] != 0, want_overflow)
assert np.asarray(want_overflow).tolist() == [False] * 7 + [True]  # only row 7 (see below)
# nucleus: tokens in the top_p nucleus of softmax(logits / T) (all V when top_p = 1)
print(f"{'row':>3} {'T':>4} {'top_k':>5} {'top_p':>5} {'nucleus':>7} {'overflow':>8} {'token':>5}")
for b in range(B):
    print(f"{b:>3} {modes['temperature'][b]!s:>4} {modes['top_k'][b]:>5} {modes['top_p'][b]:>5} "
          f"{int(sizes[b]):>7} {bool(overflow[b, 0])!s:>8} {int(tokens[b, 0]):>5}")
print("step 4 PASS: candidates + exact lse = reference sample(candidates=128), overflow flags equal")

# %% [markdown]
# Row 7 (T = 8, top_p = 0.95) needs more than 128 tokens for its nucleus: the stage samples among
# its 128 candidates and says so. The reference with `candidates=128` does the same; without a
# capacity it would draw from the full nucleus. Greedy and pure-temperature rows never need
# candidates, and `0 < top_k ≤ 128` rows always fit.
#
# ## The fused Pallas stage
#
# `sample_stage` is one `pallas_call`: the body (`sampling_body`) starts the DMA of LM head tile 0,
# runs `reference.mix` and `reference.rms_norm` on the VMEM snapshots while it flies, then loops
# over tiles with a two-slot `dma.Ring` (tile t+1 in flight while tile t is multiplied and folded
# into the state), and writes only `tokens [B]` and `nucleus_overflow [B]`. `return_logits=True`
# also writes the logits — for checking only.

# %%
# NBVAL_CHECK_OUTPUT
with dma.recording() as log:
    result = stage.sample_stage(**inputs, cfg=cfg, seed=SEED, positions=positions, vocab_tile=TILE,
                                return_logits=True, **modes)
    result.tokens.block_until_ready()
max_error = float(jnp.max(jnp.abs(result.logits - logits)))
assert max_error < 0.1  # a few bf16 ulps of x (XLA on CPU may skip one bf16 rounding when fusing)
kernel_want = sampling.sample(result.logits, seed=SEED, positions=positions, candidates=128, **modes)
assert np.array_equal(result.tokens, kernel_want)
assert np.array_equal(result.nucleus_overflow,
                      sampling.nucleus_overflow(result.logits, candidates=128, **modes))
lm_head_bytes = log.dma_bytes(stage.LM_HEAD)
assert lm_head_bytes == inputs["lm_head"].nbytes == log.dma_bytes()
tiles = [e.indices["tile"] for e in log.select("dma_start", stage.LM_HEAD)]
assert tiles == list(range(V // TILE))
print(f"kernel tokens: {result.tokens.tolist()}")
print(f"kernel overflow: {result.nucleus_overflow.tolist()}")
print(f"logits vs reference: max |error| < 0.1: {max_error < 0.1}; tokens = reference sampler on them")
print(f"DMA: {lm_head_bytes} bytes of lm_head (= its size, read once), tiles {tiles}, nothing else")
print("phases:", [e.name for e in log.select("phase_start")])

# %% [markdown]
# ## Many draws: the histogram against the exact distribution
#
# One kernel call with 4096 identical rows and positions 0..4095 draws 4096 independent samples
# (the counter includes row and position). Vocabulary 256 in two tiles of 128, top_p = 0.9 at
# T = 1. The total-variation distance must stay below a bound derived from the number of draws:
# `E[TV] ≤ ½ Σ √(p(1−p)/n)`, plus `√(ln(10⁶)/2n)` since one draw moves TV by at most 1/n.

# %%
# NBVAL_CHECK_OUTPUT
small = cfg.replace(vocab_size=256)
DRAWS = 4096
head_small = inputs["lm_head"][:, :256]
many_rows = dict(inputs, lm_head=head_small,
                 snapshots=jnp.broadcast_to(inputs["snapshots"][:, :1], (cfg.n_blocks, DRAWS, d)),
                 partial=jnp.broadcast_to(inputs["partial"][:1], (DRAWS, d)))
draws = stage.sample_stage(**many_rows, cfg=small, seed=1, positions=np.arange(DRAWS), vocab_tile=128,
                           temperature=1.0, top_p=0.9, return_logits=True)
exact = np.asarray(sampling.truncated_distribution(draws.logits[:1], temperature=1.0, top_p=0.9,
                                                   candidates=128))[0]
histogram = np.bincount(np.asarray(draws.tokens), minlength=256) / DRAWS
tv = 0.5 * np.abs(histogram - exact).sum()
bound = 0.5 * np.sum(np.sqrt(exact * (1 - exact) / DRAWS)) + np.sqrt(np.log(1e6) / (2 * DRAWS))
assert tv < bound and not np.any(histogram[exact == 0]) and not bool(draws.nucleus_overflow.any())
print(f"{DRAWS} draws, nucleus of {int((exact > 0).sum())} tokens: TV < bound "
      f"{facts.stable(bound, '.3f', 1e-4)}: PASS")

# %%
order = np.argsort(-exact, kind="stable")[:24]  # the nucleus and a few tokens outside it
fig, ax = plt.subplots(figsize=(9, 3))
ax.bar(np.arange(len(order)) - 0.2, exact[order], width=0.4, label="exact (renormalised nucleus)")
ax.bar(np.arange(len(order)) + 0.2, histogram[order], width=0.4, label=f"kernel, {DRAWS} draws")
ax.set_xticks(np.arange(len(order)), order, rotation=90, fontsize=7)
ax.set_xlabel("token (most likely first)")
ax.set_ylabel("probability")
ax.set_title("top-p 0.9 sampling in the fused stage vs the exact distribution")
ax.legend()
plt.tight_layout()
assert not label_problems(fig)  # no label runs into another, none is cut
show_figure(fig)  # described: an HTML export gives the picture its title

# %% [markdown]
# ## Compiling for TPU7x at the full per-rank vocab shard
#
# On a real chip each of the 32 ranks owns 5120 vocabulary rows of 7168 (spec §9). The stage is
# compiled by libtpu's Mosaic compiler for TPU7x on this machine: the tile size is chosen so one
# tile is ≤ 4 MiB (256 columns: 20 tiles, two in flight).

# %%
rank = layout.named_config("kimi-k3-rank")  # one rank of the release layout (spec §9)
shape = jax.ShapeDtypeStruct
rank_args = (shape((rank.n_blocks, B, rank.d_model), jnp.bfloat16), shape((B, rank.d_model), jnp.bfloat16),
             shape((rank.d_model,), jnp.float32), shape((rank.d_model,), jnp.bfloat16),
             shape((rank.d_model, rank.vocab_size), jnp.bfloat16))

def tail(snapshots, partial, mix_out, final_norm, lm_head):
    return stage.sample_stage(snapshots, partial, mix_out, final_norm, lm_head, cfg=rank, seed=SEED,
                              positions=np.arange(B), **modes).tokens

compiled = tpu.compile_for(tail, *rank_args, chip="tpu7x")
print(compiled)

# %%
# NBVAL_CHECK_OUTPUT
assert compiled.n_mosaic_kernels == 1
print(f"compiled for {compiled.chip}: {compiled.n_mosaic_kernels} Mosaic kernel, "
      f"LM head shard {rank.d_model} x {rank.vocab_size} bf16 = {rank.d_model * rank.vocab_size * 2} bytes, "
      f"vocab tile {stage.default_vocab_tile(rank.d_model, rank.vocab_size)} "
      f"({rank.vocab_size // stage.default_vocab_tile(rank.d_model, rank.vocab_size)} tiles)")

# %% [markdown]
# ## What this stage does and does not promise
#
# - Greedy, temperature (Gumbel-max over the whole vocabulary) and top-k (k ≤ 128) are exact.
# - Top-p is exact when its nucleus fits in the 128 candidates; otherwise it samples from the
#   candidates and reports `nucleus_overflow` for that row. On a vocab-sharded model the same holds
#   per shard (128 candidates per shard, as in the released code).
# - The token is a pure function of the logits and `(seed, row, position)`: rerunning a step, or
#   running it on another machine, gives the same token.
