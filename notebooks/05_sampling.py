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
# Setup: works on Colab, on a TPU VM and on a laptop. Installs mkresearch if it is missing, and
# only what this runtime lacks: mkresearch[plots] (the library with JAX; matplotlib and ipywidgets 8
# unless here; on a TPU also the tpu extra), never Jupyter, ipykernel or a notebook server, which a
# hosted runtime brings and depends on. The runtime's own jax and numpy stay if recent enough.
# From this checkout, else the git URL in MKRESEARCH_REPO. If the install replaces a package this
# kernel has imported, the kernel must restart: on Colab this cell restarts it, elsewhere it stops
# and says so; then run the notebook again.
import glob
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys


class _SetupStop(Exception):  # ends the cell with one line instead of a traceback
    def _render_traceback_(self):
        return [f"setup: {self}"]


def _versions():
    return {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version
            for d in importlib.metadata.distributions()}


_had = _versions()
_lacking = [name for name in ("mkresearch", "matplotlib") if importlib.util.find_spec(name) is None]
if int(_had.get("ipywidgets", "0").split(".")[0]) < 8:  # the explorers' controls are ipywidgets 8
    _lacking.append("ipywidgets 8")
if _lacking:
    _root = pathlib.Path("..").resolve()
    _local = (_root / "pyproject.toml").is_file() and \
        'name = "mkresearch"' in (_root / "pyproject.toml").read_text()
    _repo = os.environ.get("MKRESEARCH_REPO", "https://github.com/mkresearch/mkresearch")
    _extras = "plots,tpu" if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") else "plots"
    _source = _root.as_uri() if _local else f"git+{_repo}"
    _pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                           f"mkresearch[{_extras}] @ {_source}"],
                          capture_output=True, text=True, check=False)
    if _pip.returncode:
        _errors = [line for line in _pip.stderr.splitlines() if line.startswith("ERROR")]
        raise _SetupStop(f"pip could not install mkresearch[{_extras}]: "
                         f"{(_errors or _pip.stderr.splitlines() or ['no message'])[0]}")
    importlib.invalidate_caches()
    _now = _versions()
    _new = [f"{name} {version}" for name, version in sorted(_now.items()) if name not in _had]
    _replaced = {name: f"{name} {_had[name]} -> {version}" for name, version in sorted(_now.items())
                 if _had.get(name, version) != version}
    for _name in _replaced:  # why: the floor mkresearch (or its tpu extra) asks of it
        _asks = [r.split(";")[0].replace(" ", "") for r in importlib.metadata.requires("mkresearch")
                 or () if re.match(rf"{_name}(\[[^]]*\])?\s*[<>=!~]",
                                   re.sub(r"[-_.]+", "-", r), re.I)]
        _replaced[_name] += f" (mkresearch asks {' and '.join(_asks)})" if _asks else ""
    _kept = [f"{name} {_had[name]}" for name in ("jax", "numpy") if name in _had and name in _now
             and name not in _replaced]
    print(f"setup: {', '.join(_lacking)} lacking; installed from "
          f"{'this checkout' if _local else _repo}: {', '.join(_new) or 'nothing new'}"
          + (f"; replaced {', '.join(_replaced.values())}" if _replaced else "")
          + (f"; kept this runtime's {', '.join(_kept)}" if _kept else ""))
    _imported = {re.sub(r"[-_.]+", "-", dist).lower() for module, dists
                 in importlib.metadata.packages_distributions().items()
                 if module in sys.modules for dist in dists}
    _stale = [_replaced[name] for name in _replaced if name in _imported]
    if _stale:  # only a new kernel imports the new versions
        _colab = "google.colab" in sys.modules
        if _colab:  # Colab brings a kernel that shut down this way back by itself
            import IPython

            IPython.Application.instance().kernel.do_shutdown(True)
        raise _SetupStop(f"{', '.join(_stale)} replaced a package this kernel had imported: "
                         f"{'restarting' if _colab else 'restart'} the kernel, then run the "
                         "notebook again")
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
# The last stage of a Kimi K3 decode step mixes the **attention-residual** snapshots one final time
# (instead of a plain residual sum, Kimi K3 mixes the outputs of earlier blocks with softmax
# weights computed from them; notebook 06), normalises, multiplies by the **LM head** — at
# 163840 × 7168 bf16 (2.35 GB) the largest single matrix of the model — and turns the **logits**
# (one score per vocabulary token) into a token.
# Writing the `[B, V]` logits to HBM and sampling them in a separate XLA program costs a round
# trip and a launch per step. The released kernels do greedy inside the kernel but top-p outside it.
#
# Three ways to pick the token, each defined where it first appears below: **greedy** (the
# highest logit), **temperature** sampling (a draw from `softmax(logits / T)`) and **top-p**
# (a draw from the smallest set of most likely tokens holding a share `p` of the probability, the
# *nucleus*). Terms are also in [00 · glossary](00_megakernels_on_tpu.ipynb#The-glossary).
#
# This notebook **writes a sampling kernel** over vocab tiles in three steps (greedy, temperature,
# top-p), each checked against the plain-JAX reference (`mkresearch.model.sampling`) in the next
# cell; you then add top-k to it. After that, the package's stage
# (`mkresearch.kernels.stages.sampling`) is shown with what it adds, and run.

# %% [markdown]
# The terms this notebook uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Greedy", "Top-p", "Snapshots", "RMSNorm", "W_lm", "Ref", ".at[...]", "pl.ds",
                    "pl.multiple_of", "pl.when", "BlockSpec", "Memory space", "scratch_shapes",
                    "make_async_copy", "DMA semaphore", "Ring slot", "lax.fori_loop")

# %%
import functools
import inspect

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma
from mkresearch.kernels.stages import sampling as stage

from mkresearch.model import reference, sampling
from mkresearch.model.config import get_config
from mkresearch.views import exercises, facts
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
# Checks · pinned values: any machine, kernel or reference, must give these bits
for counters in [(0, 0, 0, 0), (1, 2, 3, 4), (7, 0, 100, 163839)]:
    print(f"U{counters} = {float(sampling.counter_uniform(*counters)):.10f}")
many = sampling.counter_uniform(SEED, jnp.arange(64)[:, None], 5, jnp.arange(4096)[None, :])
print(f"64 x 4096 uniforms: min > 0: {bool(many.min() > 0)}, max < 1: {bool(many.max() < 1)}, "
      f"mean {facts.stable(many.mean(), '.3f', 1e-5)}, var {facts.stable(many.var(), '.4f', 1e-5)}"
      " (1/12 = 0.0833)")

# %% [markdown]
# ## Step 1 · A kernel over vocab tiles: greedy
#
# The kernel never holds the whole LM head: it streams through VMEM in column tiles
# `lm_head[:, t·TILE:(t+1)·TILE]` by a two-slot ring (notebook 01: `make_async_copy` into one
# slot while the other is used), and each tile's logits `x @ tile` are folded into a small
# **running state** and dropped. What the state is, and how a tile folds into it, is the sampler:
# the loop below takes them as functions (`init`, `fold`, `finish`), so the three steps only
# write those. The kernel also writes the logits it computes to an output, for checking only: a
# sampler that writes them has lost the point of fusing.
#
# **Greedy** is an argmax where the **lower index wins ties**. Its state is the best logit so far
# and its index; tiles come in vocabulary order, so on equal values the state (earlier tiles,
# lower indices) keeps its index, and the result is the one-shot argmax.

# %%
NO_INDEX = np.iinfo(np.int32).max  # sorts after every vocab index


def my_sampler_kernel(x_ref, key_ref, lm_head_hbm, tokens_ref, logits_ref, slots, sems, *,
                      init, fold, finish):
    # x_ref [B, d] bf16, key_ref [B, 1] uint32 (VMEM); lm_head_hbm [d, V] bf16 (HBM);
    # tokens_ref [B, 1] i32, logits_ref [B, V] f32 (VMEM); slots [2, d, TILE] bf16, sems: 2 DMA
    n_tiles = lm_head_hbm.shape[1] // TILE

    def copy(t, slot):  # LM head columns of tile t -> one slot
        columns = pl.ds(pl.multiple_of(t * TILE, TILE), TILE)
        return pltpu.make_async_copy(lm_head_hbm.at[:, columns], slots.at[slot], sems.at[slot])

    copy(0, 0).start()
    x, key = x_ref[...], key_ref[...]

    def step(t, state):
        slot = jax.lax.rem(t, 2)

        @pl.when(t + 1 < n_tiles)
        def _():
            copy(t + 1, 1 - slot).start()

        copy(t, slot).wait()
        tile_logits = jnp.dot(x, slots[slot], preferred_element_type=jnp.float32)  # [B, TILE]
        logits_ref[:, pl.ds(pl.multiple_of(t * TILE, TILE), TILE)] = tile_logits  # checking only
        indices = t * TILE + jax.lax.broadcasted_iota(jnp.int32, tile_logits.shape, 1)
        return fold(state, tile_logits, indices, key)

    state = jax.lax.fori_loop(0, n_tiles, step, init(x.shape[0]))
    tokens_ref[...] = finish(state, key)


def run_sampler(init, fold, finish, lm_head=inputs["lm_head"]):
    """(tokens [B], logits [B, V]) of the kernel with this running state."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    rows = jnp.arange(B, dtype=jnp.uint32)
    key = sampling.counter_key(SEED, rows, positions)[:, None]  # [B, 1]: (seed, row, position)
    tokens, kernel_logits = pl.pallas_call(
        functools.partial(my_sampler_kernel, init=init, fold=fold, finish=finish),
        out_shape=(jax.ShapeDtypeStruct((B, 1), jnp.int32),
                   jax.ShapeDtypeStruct((B, lm_head.shape[1]), jnp.float32)),
        in_specs=[vmem, vmem, pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=(vmem, vmem),
        scratch_shapes=[pltpu.VMEM((2, d, TILE), jnp.bfloat16), pltpu.SemaphoreType.DMA((2,))],
        interpret=tpu.interpret_params(),
    )(x, key, lm_head)
    return tokens[:, 0], kernel_logits


def best(values, indices):
    """Row max [B, 1] and the lowest index attaining it [B, 1]."""
    top = jnp.max(values, axis=1, keepdims=True)
    return top, jnp.min(jnp.where(values == top, indices, NO_INDEX), axis=1, keepdims=True)


def better(value, index, new_value, new_index):
    """Keep (value, index) unless the new one is larger, or equal with a lower index."""
    take = (new_value > value) | ((new_value == value) & (new_index < index))
    return jnp.where(take, new_value, value), jnp.where(take, new_index, index)


def greedy_init(batch):
    return jnp.full((batch, 1), -jnp.inf), jnp.full((batch, 1), NO_INDEX, jnp.int32)


def greedy_fold(state, tile_logits, indices, key):
    return better(*state, *best(tile_logits, indices))


def greedy_finish(state, key):
    return state[1]  # the best index


greedy_tokens, greedy_logits = run_sampler(greedy_init, greedy_fold, greedy_finish)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · greedy against the reference: its logits, its tokens, ties to the lowest index
logit_error = float(jnp.max(jnp.abs(greedy_logits - logits)))
assert logit_error < 0.1  # a few bf16 ulps of x: XLA on CPU may skip one bf16 rounding when fusing
assert np.array_equal(greedy_tokens, sampling.sample(greedy_logits, seed=SEED, positions=positions))
# engineered ties across tiles: three equal maxima at 9, 700 and 1500, the first one wins
tied = logits.at[:, [9, 700, 1500]].set(100.0)
tied_state = greedy_init(B)
for t in range(V // TILE):
    columns = slice(t * TILE, (t + 1) * TILE)
    indices = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32)[columns], (B, TILE))
    tied_state = greedy_fold(tied_state, tied[:, columns], indices, None)
assert np.all(greedy_finish(tied_state, None) == 9)
assert np.all(sampling.sample(tied, seed=0, positions=positions) == 9)
for bad_temperature in (0.0, -1.0):  # greedy is temperature=None, never 0: T <= 0 is a ValueError
    try:
        sampling.sample(logits, seed=SEED, positions=positions, temperature=bad_temperature)
        raise AssertionError(f"temperature={bad_temperature} was accepted")
    except ValueError as error:
        assert "use temperature=None for greedy" in str(error)
print(f"step 1 greedy tokens: {greedy_tokens.tolist()}")
print(f"step 1 PASS: logits within 0.1 of the reference's, tokens = reference sample(temperature=None)"
      f" on them; ties go to the lowest index; {V // TILE} tiles of {TILE} columns")
print(f"running state: {B * 8} bytes for B={B} (logits would be {B * V * 4} bytes; at the full "
      f"vocab {B * 163840 * 4} bytes written to HBM and read back per step)")

# %% [markdown]
# ## Step 2 · Temperature: Gumbel-max in the same pass
#
# Sampling with **temperature** `T` draws token `i` with probability `softmax(z)_i`, `z = logits / T`
# (`T` → 0 is greedy, large `T` flattens the distribution). With independent **Gumbel** noise `G_i`,
# `argmax_i (z_i + G_i)` is an exact sample of `softmax(z)`: the **Gumbel-max** trick. So sampling
# is another running argmax, now of `z + G`, with `G` from the counter of `(seed, row, position,
# index)`: one pass over the vocabulary, no normaliser needed. Only the fold changes.

# %%
T = 0.8


def gumbel_fold(state, tile_logits, indices, key):
    scores = tile_logits / T + sampling.gumbel_from_key(key, indices)  # z + G
    return better(*state, *best(scores, indices))


gumbel_tokens, gumbel_logits = run_sampler(greedy_init, gumbel_fold, greedy_finish)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · temperature sampling against the reference, token for token
want = sampling.sample(gumbel_logits, seed=SEED, positions=positions, temperature=T)
assert np.array_equal(gumbel_tokens, want)
print(f"step 2 sampled tokens: {gumbel_tokens.tolist()}")
print(f"step 2 PASS: Gumbel-max over the tiles = reference sample(temperature={T}), token for token")

# %% [markdown]
# ## Step 3 · Top-p over a running list of candidates
#
# **Top-p** (nucleus sampling) keeps the most likely tokens, best first, while the probability
# of those before them is `< p` (the first always), and samples among them renormalised. That
# needs the *order* of the largest `z` and the *total* mass, in one pass:
#
# * the total: an **online log-sum-exp**, a running max `m` and `Σ exp(z − m)`, rescaled when `m`
#   grows (exact, as in 02's online softmax);
# * the order: a running list of the `C = 32` best `(z, index)`, sorted. Each tile merges into it
#   by `C` rounds of "take the better of the list's best and the tile's best": simple, and `C`
#   rounds per tile whatever the tile holds.
#
# At the end `p_j = exp(z_j − lse)`; the mass before candidate `j` is one matmul with a strictly
# upper-triangular matrix (Mosaic has no cumulative sum), and Gumbel-max over the kept candidates
# samples the truncated distribution. It is exact when the nucleus fits in the `C` candidates:
# the reference's `candidates=C` is the same sampler, and `sampling.nucleus_overflow` says when a
# row's nucleus would not fit.

# %%
C, TOP_P = 32, 0.5


def top_p_init(batch):
    lane = jax.lax.broadcasted_iota(jnp.int32, (batch, C), 1)
    return (jnp.full((batch, 1), -jnp.inf), jnp.zeros((batch, 1)),  # running max, Σ exp(z - max)
            jnp.full((batch, C), -jnp.inf), NO_INDEX - C + lane)  # candidates, distinct indices


def merge_best(cand_values, cand_indices, z, indices):
    """The C best of the candidates and the tile, best first (ties: lower index)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, cand_values.shape, 1)

    def take_one(j, carry):
        cand_values, z, new_values, new_indices = carry
        kept_value, kept_index = best(cand_values, cand_indices)
        tile_value, tile_index = best(z, indices)
        value, index = better(kept_value, kept_index, tile_value, tile_index)
        from_tile = index == tile_index
        cand_values = jnp.where(~from_tile & (cand_indices == index), -jnp.inf, cand_values)
        z = jnp.where(from_tile & (indices == index), -jnp.inf, z)
        return (cand_values, z, jnp.where(lane == j, value, new_values),
                jnp.where(lane == j, index, new_indices))

    _, _, values, new = jax.lax.fori_loop(0, C, take_one,
                                          (cand_values, z, cand_values, cand_indices))
    return values, new


def top_p_fold(state, tile_logits, indices, key):
    running_max, running_sum, cand_values, cand_indices = state
    z = tile_logits / T
    new_max = jnp.maximum(running_max, jnp.max(z, axis=1, keepdims=True))
    running_sum = (running_sum * jnp.exp(running_max - new_max)
                   + jnp.sum(jnp.exp(z - new_max), axis=1, keepdims=True))
    return (new_max, running_sum, *merge_best(cand_values, cand_indices, z, indices))


def mass_before(state):
    """p_j = exp(z_j - lse) of each candidate, and the mass of the candidates before it."""
    running_max, running_sum, cand_values, _ = state
    probs = jnp.exp(cand_values - (running_max + jnp.log(running_sum)))  # [B, C]
    row, column = (jax.lax.broadcasted_iota(jnp.int32, (C, C), axis) for axis in (0, 1))
    upper = (row < column).astype(jnp.float32)  # mass before lane j = Σ_{i<j} p_i
    return probs, jnp.dot(probs, upper, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)


def sample_kept(state, key, keep):
    """Gumbel-max over the kept candidates: the truncated distribution, renormalised."""
    _, _, cand_values, cand_indices = state
    scores = jnp.where(keep, cand_values + sampling.gumbel_from_key(key, cand_indices), -jnp.inf)
    return best(scores, cand_indices)[1]


def top_p_finish(state, key):
    _, before = mass_before(state)
    lane = jax.lax.broadcasted_iota(jnp.int32, before.shape, 1)
    return sample_kept(state, key, (lane == 0) | (before < TOP_P))


top_p_tokens, top_p_logits = run_sampler(top_p_init, top_p_fold, top_p_finish)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · top-p against the reference with the same capacity; every nucleus fits, so it is exact
want = sampling.sample(top_p_logits, seed=SEED, positions=positions, temperature=T, top_p=TOP_P,
                       candidates=C)
assert np.array_equal(top_p_tokens, want)
assert not np.any(sampling.nucleus_overflow(top_p_logits, temperature=T, top_p=TOP_P, candidates=C))
sizes = sampling.nucleus_size(top_p_logits, temperature=T, top_p=TOP_P)
print(f"step 3 top-p {TOP_P} at T = {T}: tokens {top_p_tokens.tolist()}, nucleus sizes "
      f"{np.asarray(sizes).tolist()} (all <= {C})")
print(f"step 3 PASS: = reference sample(top_p={TOP_P}, candidates={C}), token for token")

# %% [markdown]
# ### Your turn: top-k beside top-p
#
# **Top-k** keeps only the `k` most likely tokens. Write `my_top_k_finish(state, key)`: keep
# candidate `j` while `j < TOP_K` **and** it is in the top-p nucleus (the mass before it
# `< TOP_P`, the first always), then sample among the kept ones. The state is step 3's
# (`top_p_init`, `top_p_fold` run unchanged); `mass_before(state)` and `sample_kept(state, key,
# keep)` are there to use. The check runs your finish in the kernel against the reference sampler
# with `top_k=TOP_K, top_p=TOP_P`.

# %%
TOP_K = 3


def my_top_k_finish(state, key):
    # tokens [B, 1] i32 from the running state of step 3
    raise NotImplementedError("keep j < TOP_K and the top-p nucleus, then sample")


# %%
def check_top_k(finish):
    tokens, kernel_logits = run_sampler(top_p_init, top_p_fold, finish)
    want = sampling.sample(kernel_logits, seed=SEED, positions=positions, temperature=T,
                           top_k=TOP_K, top_p=TOP_P, candidates=C)
    wrong = np.flatnonzero(np.asarray(tokens) != np.asarray(want)).tolist()
    assert not wrong, f"rows {wrong} draw other tokens than the reference: {tokens.tolist()} " \
                      f"vs {np.asarray(want).tolist()}"


exercises.check("top-k beside top-p", lambda: check_top_k(my_top_k_finish))


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: top-k beside top-p (double-click to open)
# NBVAL_CHECK_OUTPUT
def top_k_solution(state, key):
    _, before = mass_before(state)
    lane = jax.lax.broadcasted_iota(jnp.int32, before.shape, 1)
    return sample_kept(state, key, (lane < TOP_K) & ((lane == 0) | (before < TOP_P)))


assert exercises.check("top-k beside top-p", lambda: check_top_k(top_k_solution))

# %% [markdown]
# ### Your turn: the logits to HBM, tile by tile
#
# The kernels above keep the whole `[B, V]` logits in a VMEM output (for checking only): at full
# size that is 160 K floats a row. Write the greedy sampler's logits out to **HBM** instead, one
# tile at a time, by DMA: each tile's logits go into one of two VMEM staging slots `out_slots`
# and from there to `logits_hbm.at[:, tile]` (a VMEM → HBM copy, signalling `out_sems`). A
# staging slot is reused two tiles later: wait for its last write to have left before writing
# into it, and wait for the last two writes before the kernel ends. The LM head comes in as
# before (`slots`, `sems`). The check compares the logits with `x @ lm_head` and the tokens with
# greedy's above, race detector on, and compiles the kernel for TPU7x with Mosaic.

# %%
def my_logits_out_kernel(x_ref, lm_head_hbm, tokens_ref, logits_hbm, slots, sems, out_slots,
                         out_sems):
    # x_ref [B, d] bf16 (VMEM); lm_head_hbm [d, V] bf16 (HBM); tokens_ref [B, 1] i32 (VMEM);
    # logits_hbm [B, V] f32 (HBM, written by DMA); scratch: slots [2, d, TILE] bf16, sems: 2 DMA,
    # out_slots [2, B, TILE] f32, out_sems: 2 DMA
    raise NotImplementedError("greedy, each tile's logits copied out to HBM from two slots")


# %%
def run_logits_out(kernel, x, lm_head):
    vmem, hbm = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((x.shape[0], 1), jnp.int32),
                   jax.ShapeDtypeStruct((x.shape[0], lm_head.shape[1]), jnp.float32)),
        in_specs=[vmem, hbm], out_specs=(vmem, hbm),
        scratch_shapes=[pltpu.VMEM((2, d, TILE), jnp.bfloat16), pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((2, x.shape[0], TILE), jnp.float32),
                        pltpu.SemaphoreType.DMA((2,))],
        interpret=tpu.interpret_params(),
    )(x, lm_head)


def check_logits_out(kernel):
    tokens, out = exercises.race_free(lambda: run_logits_out(kernel, x, inputs["lm_head"]))
    want = np.asarray(jnp.dot(x, inputs["lm_head"], preferred_element_type=jnp.float32))
    assert np.allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5), (
        f"max |error| against x @ lm_head is {np.abs(np.asarray(out) - want).max():.3g}")
    assert np.array_equal(np.asarray(tokens[:, 0]), np.asarray(greedy_tokens)), "other tokens"
    exercises.compiles(lambda x_, head: run_logits_out(kernel, x_, head), x, inputs["lm_head"])


exercises.check("the logits to HBM", lambda: check_logits_out(my_logits_out_kernel))


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: the logits to HBM, tile by tile (double-click to open)
# NBVAL_CHECK_OUTPUT
def logits_out_solution(x_ref, lm_head_hbm, tokens_ref, logits_hbm, slots, sems, out_slots,
                        out_sems):
    n_tiles = lm_head_hbm.shape[1] // TILE

    def columns(t):
        return pl.ds(pl.multiple_of(t * TILE, TILE), TILE)

    def read(t, slot):  # LM head tile t -> a slot
        return pltpu.make_async_copy(lm_head_hbm.at[:, columns(t)], slots.at[slot], sems.at[slot])

    def write(t, slot):  # tile t's logits: a staging slot -> HBM
        return pltpu.make_async_copy(out_slots.at[slot], logits_hbm.at[:, columns(t)],
                                     out_sems.at[slot])

    read(0, 0).start()

    def step(t, state):
        slot = jax.lax.rem(t, 2)

        @pl.when(t + 1 < n_tiles)
        def _():
            read(t + 1, 1 - slot).start()

        read(t, slot).wait()

        @pl.when(t >= 2)  # the staging slot's last write (tile t - 2) has left
        def _():
            write(t - 2, slot).wait()

        out_slots[slot] = jnp.dot(x_ref[...], slots[slot], preferred_element_type=jnp.float32)
        write(t, slot).start()
        indices = t * TILE + jax.lax.broadcasted_iota(jnp.int32, out_slots.shape[1:], 1)
        return greedy_fold(state, out_slots[slot], indices, None)

    state = jax.lax.fori_loop(0, n_tiles, step, greedy_init(x_ref.shape[0]))
    for t in range(max(n_tiles - 2, 0), n_tiles):  # the last two writes have left
        write(t, t % 2).wait()
    tokens_ref[...] = greedy_finish(state, None)


assert exercises.check("the logits to HBM", lambda: check_logits_out(logits_out_solution))

# %% [markdown]
# ## The package's stage, and what it adds
#
# `stage.sample_stage` is one `pallas_call` whose body, `sampling_body`, is your kernel with the
# three steps in one running state (`RunningState`: greedy, Gumbel, log-sum-exp and candidates
# side by side), plus what a decode step needs:
#
# * **the final mix and RMSNorm in the kernel**: the DMA of LM head tile 0 starts first and flies
#   while `reference.mix` and `reference.rms_norm` run on the snapshots in VMEM, so `x` never goes
#   through HBM either;
# * **a batch of rows with their own settings**: greedy, temperature, top-k and top-p per row (the
#   row's `T`, `k`, `p` are VMEM arrays, not Python constants), and static flags skip the Gumbel
#   noise or the candidates when no row needs them;
# * **128 candidates, one vreg row of lanes**: `merge_candidates` inserts each tile element that
#   beats the 128th candidate at its rank with a lane roll, and stops as soon as no row has such an
#   element left: the first tile costs 128 rounds, a later one only as many as it has new
#   top-128 elements (about `128/(t+1)` for random logits), not 128 every time;
# * **a `nucleus_overflow` flag** per row when the candidates hold less than `top_p` of the mass:
#   the one case where top-p is not exact is reported, never silent;
# * the key computed in the kernel from the seed in SMEM; soft-capped logits; vocab shards (the
#   sharded megakernel: `index_offset`, `merge`, a padded last shard masked); a verify step's rows;
# * the LM head through `dma.Ring`, so every byte is in the DMA log.

# %%
print(inspect.getsource(stage.sampling_body))
print(inspect.getsource(stage.merge_candidates))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the package's stage on 8 rows of mixed settings: its tokens and overflow flags are the
# reference sampler's on its logits; the LM head is read once, tile by tile
modes = {"temperature": [None, 1.0, 0.7, 1.0, 0.8, 1.2, 1.0, 8.0],  # None: a greedy row
         "top_k": [0, 0, 0, 1, 5, 128, 0, 0],
         "top_p": [1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.5, 0.95]}
with dma.recording() as log:
    result = stage.sample_stage(**inputs, cfg=cfg, seed=SEED, positions=positions, vocab_tile=TILE,
                                return_logits=True, **modes)
    result.tokens.block_until_ready()
max_error = float(jnp.max(jnp.abs(result.logits - logits)))
assert max_error < 0.1  # a few bf16 ulps of x (XLA on CPU may skip one bf16 rounding when fusing)
kernel_want = sampling.sample(result.logits, seed=SEED, positions=positions, candidates=128, **modes)
want_overflow = sampling.nucleus_overflow(result.logits, candidates=128, **modes)
assert np.array_equal(result.tokens, kernel_want)
assert np.array_equal(result.nucleus_overflow, want_overflow)
assert np.asarray(want_overflow).tolist() == [False] * 7 + [True]  # only row 7 (see below)
lm_head_bytes = log.dma_bytes(stage.LM_HEAD)
assert lm_head_bytes == inputs["lm_head"].nbytes == log.dma_bytes()
tiles = [e.indices["tile"] for e in log.select("dma_start", stage.LM_HEAD)]
assert tiles == list(range(V // TILE))
sizes = sampling.nucleus_size(result.logits, temperature=modes["temperature"], top_p=modes["top_p"])
# nucleus: tokens in the top_p nucleus of softmax(logits / T) (all V when top_p = 1)
print(f"{'row':>3} {'T':>4} {'top_k':>5} {'top_p':>5} {'nucleus':>7} {'overflow':>8} {'token':>5}")
for b in range(B):
    print(f"{b:>3} {modes['temperature'][b]!s:>4} {modes['top_k'][b]:>5} {modes['top_p'][b]:>5} "
          f"{int(sizes[b]):>7} {bool(result.nucleus_overflow[b])!s:>8} {int(result.tokens[b]):>5}")
print(f"logits vs reference: max |error| < 0.1: {max_error < 0.1}; tokens and overflow flags = "
      "reference sampler on them")
print(f"DMA: {lm_head_bytes} bytes of lm_head (= its size, read once), tiles {tiles}, nothing else")
print("phases:", [e.name for e in log.select("phase_start")])

# %% [markdown]
# Row 7 (T = 8, top_p = 0.95) needs more than 128 tokens for its nucleus: the stage samples among
# its 128 candidates and says so. The reference with `candidates=128` does the same; without a
# capacity it would draw from the full nucleus. Greedy and pure-temperature rows never need
# candidates, and `0 < top_k ≤ 128` rows always fit.
#
# ## Many draws: the histogram against the exact distribution
#
# One kernel call with 4096 identical rows and positions 0..4095 draws 4096 independent samples
# (the counter includes row and position). Vocabulary 256 in two tiles of 128, top_p = 0.9 at
# T = 1. The total-variation distance must stay below a bound derived from the number of draws:
# `E[TV] ≤ ½ Σ √(p(1−p)/n)`, plus `√(ln(10⁶)/2n)` since one draw moves TV by at most 1/n.

# %%
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
show_figure(fig)  # described: an HTML export gives the picture its title

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the draws: total variation under the bound, nothing outside the nucleus
assert not label_problems(fig)  # no label runs into another, none is cut
tv = 0.5 * np.abs(histogram - exact).sum()
bound = 0.5 * np.sum(np.sqrt(exact * (1 - exact) / DRAWS)) + np.sqrt(np.log(1e6) / (2 * DRAWS))
assert tv < bound and not np.any(histogram[exact == 0]) and not bool(draws.nucleus_overflow.any())
print(f"{DRAWS} draws, nucleus of {int((exact > 0).sum())} tokens: TV < bound "
      f"{facts.stable(bound, '.3f', 1e-4)}: PASS")

# %% [markdown]
# ## Compiling for TPU7x at the full per-rank vocab shard
#
# On a real chip each of the 32 ranks owns 5120 vocabulary rows of 7168 (docs/kimi-k3.md §9). The stage is
# compiled by libtpu's Mosaic compiler for TPU7x on this machine: the tile size is chosen so one
# tile is ≤ 4 MiB (256 columns: 20 tiles, two in flight).

# %%
rank = get_config("kimi-k3-rank")  # one rank of the release layout (docs/kimi-k3.md §9)
shape = jax.ShapeDtypeStruct
rank_args = (shape((rank.n_blocks, B, rank.d_model), jnp.bfloat16), shape((B, rank.d_model), jnp.bfloat16),
             shape((rank.d_model,), jnp.float32), shape((rank.d_model,), jnp.bfloat16),
             shape((rank.d_model, rank.vocab_size), jnp.bfloat16))

def tail(snapshots, partial, mix_out, final_norm, lm_head):
    return stage.sample_stage(snapshots, partial, mix_out, final_norm, lm_head, cfg=rank, seed=SEED,
                              positions=np.arange(B), **modes).tokens

compiled = tpu.compile_for(tail, *rank_args, chip="tpu7x") if tpu.can_compile() else None
print(compiled or f"not compiled: {tpu.NO_LIBTPU}")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · one Mosaic kernel for the whole stage at a rank's shapes
assert compiled is None or compiled.n_mosaic_kernels == 1  # None: no libtpu here (see above)
built = (f"compiled for {compiled.chip}: {compiled.n_mosaic_kernels} Mosaic kernel" if compiled
         else "not compiled (no libtpu)")
print(f"{built}, LM head shard {rank.d_model} x {rank.vocab_size} bf16 = {rank.d_model * rank.vocab_size * 2} bytes, "
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
