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
# # 06 · The megakernel: a whole decode step in one `pallas_call`
#
# Notebooks 02–05 built one kernel per stage: KDA and MLA attention, the router, the expert FFN,
# the final mix + LM head + sampling. Each is a **body function over Refs** plus a thin
# `pallas_call` wrapper. The megakernel (`mkresearch.kernels.compose.megakernel`) calls those same bodies
# — it rewrites none of them — inside ONE grid-less `pallas_call` per decode step:
#
# 1. **one layer of each kind** (KDA + dense FFN, MLA + MoE FFN): the bodies composed on Refs;
# 2. **the layer loop**: `lax.fori_loop` over layers, `lax.cond` on the layer's kind read from an
#    SMEM table, per-layer weights as views `stack.at[i]` of the stacked HBM arrays;
# 3. **the cross-layer prefetch ring**: one global weight stream through a ring of VMEM slots, so
#    the next stage's and the next layer's first weight blocks fly while the current stage computes;
# 4. **sampling in the same call**: the final mix, norm, LM head tiles and the sampler.
#
# At each step we check against the plain-JAX reference and look at the timeline the DMA log
# predicts for a TPU7x. Then we decode 8 tokens, and compile the megakernel for TPU7x at the
# per-rank shapes of the full model.

# %%
import os
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel, schedule

from mkresearch.measurement import recorded
from mkresearch.model import reference, sampling, weights
from mkresearch.model.config import get_config, layer_pattern
from mkresearch.prediction import timeline
from mkresearch.sharding import layout
from mkresearch.views import widgets
from mkresearch.views.label_plots import label_problems
from mkresearch.views.widgets import show_figure

LOGIT_TOL = 5e-2  # spec §11: whole-step interpret-mode runs


def run_step(cfg, params, batch, options=megakernel.MegakernelOptions(), position=5, seed=0):
    """One recorded megakernel step vs reference.decode_step + sampling.sample (greedy), and
    the step's schedule (every DMA, planned from the positions and the reference's routing)."""
    prompt = jax.random.randint(jax.random.key(seed), (batch, position + 1), 0, cfg.vocab_size)
    state = reference.init_state(cfg, batch)
    _, state = reference.prefill(params, state, prompt[:, :-1], cfg)
    tokens, positions = prompt[:, -1], np.full(batch, position, np.int32)
    logits, ref_state, ref_aux = reference.decode_step(params, state, tokens, positions, cfg)
    ref_tokens = sampling.sample(logits, seed=0, positions=positions + 1)
    prepared = megakernel.prepare_weights(params, cfg)
    with dma.recording() as log:
        out, new_state, aux = megakernel.decode_step(prepared, jax.tree.map(jnp.copy, state),
                                                     tokens, positions, cfg, options=options,
                                                     return_logits=True)
        jax.block_until_ready(out)
    diff = float(jnp.max(jnp.abs(aux["logits"] - logits)))
    step = schedule.schedule(aux["plan"], positions, ref_aux["expert_ids"])
    return {"log": log, "plan": aux["plan"], "tokens_equal": bool(np.all(out == ref_tokens)),
            "logits_ok": diff <= LOGIT_TOL, "diff": diff, "schedule": step,
            "log_is_schedule": step.mismatch(log) is None}


# %% [markdown]
# ## 1 · One layer of each kind
#
# The smallest model with every kind of layer: layer 0 is KDA attention + the dense FFN, layer 1
# MLA attention + the MoE FFN (router, routed latent experts, shared experts). One call runs the
# embedding row gather (a DMA of the token's aligned 16-row block), both layers with their
# attention-residual mixes, and the LM head with sampling.

# %%
# NBVAL_CHECK_OUTPUT
two = get_config("kimi-k3-mini", n_layers=2, mla_first=1)
two_params = weights.init_params(two, 0)
one_layer = run_step(two, two_params, batch=2)
print(f"layers: {layer_pattern(two)} (K = KDA, M = MLA), dense {two.dense_layers}, "
      f"MoE {two.moe_layers}")
print(f"greedy tokens equal the reference: {one_layer['tokens_equal']}; logits within "
      f"{LOGIT_TOL}: {one_layer['logits_ok']}")
assert one_layer["tokens_equal"] and one_layer["logits_ok"]

# %% [markdown]
# The DMA log of that call, replayed on a TPU7x by the timeline model (`mkresearch.prediction.timeline`):
# every weight block, state read/write and KV tile is one span, the compute phases below them.

# %%
def show_timeline(log, title, chip="tpu7x"):
    simulated = timeline.simulate(log, chip)
    fig, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
    widgets.plot_gantt(simulated, ax, title=f"{title}: {simulated.total_s * 1e6:.1f} µs on "
                       f"{chip} (predicted), {simulated.roofline_fraction:.0%} of the HBM roofline")
    assert not label_problems(fig)  # no label runs into another, none is cut
    show_figure(fig)  # described: an HTML export gives the picture its title
    return simulated


two_timeline = show_timeline(one_layer["log"], "2 layers, one call")

# %% [markdown]
# ## 2 · The layer loop
#
# The layers are not unrolled in Python: the kernel body is one `lax.fori_loop` whose step reads
# the layer's kind and its index within the stacked weights from an SMEM table, then
# `lax.cond`s between the KDA and MLA bodies and between the dense and MoE bodies. So the traced
# kernel does not grow with the depth. Only the attention-residual mix grows a little with the
# number of *blocks* (one `lax.switch` branch per possible candidate count, ⌈L / block⌉ + 1): at
# the same block count, 7 and 9 layers trace to exactly the same kernel.

# %%
def kernel_equations(cfg, batch=1):
    """Equations in the megakernel's traced body (all nested jaxprs counted)."""
    plan = megakernel.make_plan(cfg, batch, cfg.max_seq_len)
    closed = jax.make_jaxpr(megakernel.step_fn(plan))(*megakernel.step_shapes(plan))

    def count(jaxpr):
        total = 0
        for eqn in jaxpr.eqns:
            total += 1
            for value in eqn.params.values():
                for sub in (value if isinstance(value, (tuple, list)) else [value]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        total += count(inner)
        return total

    return count(closed.jaxpr)


mini = get_config("kimi-k3-mini")
configs = {"2 layers": two, "kimi-k3-mini, 7 layers": mini,
           "kimi-k3-mini with 9 layers": mini.replace(n_layers=9)}
sizes = {name: kernel_equations(cfg) for name, cfg in configs.items()}

# %%
# NBVAL_CHECK_OUTPUT
for name, n in sizes.items():
    print(f"{name:28s} {configs[name].n_blocks} residual blocks  {n} traced equations")
assert sizes["kimi-k3-mini, 7 layers"] == sizes["kimi-k3-mini with 9 layers"]

# %% [markdown]
# Now the 7 layers of `kimi-k3-mini` (KDA 0, 1, 2, 4, 5 and MLA 3, 6; dense layer 0, MoE after),
# first **without** the global weight stream: each stage body streams its matrices through its
# own two-slot ring, which starts cold at every matrix.

# %%
mini_params = weights.init_params(mini, 0)
no_ring = run_step(mini, mini_params, batch=2,
                   options=megakernel.MegakernelOptions(global_stream=False))

# %%
# NBVAL_CHECK_OUTPUT
print(f"{layer_pattern(mini)}: greedy tokens equal the reference: {no_ring['tokens_equal']}; "
      f"logits within {LOGIT_TOL}: {no_ring['logits_ok']}")
assert no_ring["tokens_equal"] and no_ring["logits_ok"]

# %%
no_ring_timeline = show_timeline(no_ring["log"], "7 layers, stage rings")

# %% [markdown]
# ## 3 · The cross-layer prefetch ring
#
# With the global weight stream (the default), `blocks.stream_matmul` — which every stage body
# uses — draws its blocks from ONE ring of `cfg.ring_depth` VMEM slots of at most
# `cfg.ring_block_bytes` (config fields, checked against the chip's VMEM in the plan). Block g of a stage waits in
# slot (base + g) mod depth, and block g + depth − 1 of the sequence that *continues* past the
# stage is started first: the FFN's first blocks during attention, the next layer's first blocks
# during the FFN (which kind comes next is read from the SMEM table, one `pl.when` per kind).
# Expert weights keep their own slots, issued right after routing; KV tiles and the KDA state
# their own double buffers.
#
# That order is data before anything is traced: `schedule.schedule(plan, positions, expert_ids)`
# lists every DMA the step will issue (name, bytes, slot, layer, stage), from the same plan the
# kernel runs (`mkresearch plan MODEL` prints its summary). The recorded DMA log of the step
# equals it event for event, and the prefetch checks read it.

# %%
ring = run_step(mini, mini_params, batch=2)
late = ring["schedule"].late_prefetches()  # layers where a prefetch comes late
ffn_early, next_early = not late["ffn"], not late["next_layer"]

# %%
# NBVAL_CHECK_OUTPUT
print(f"greedy tokens equal the reference: {ring['tokens_equal']}; logits within {LOGIT_TOL}: "
      f"{ring['logits_ok']}")
print(f"the recorded DMA log is the step's schedule, event for event: {ring['log_is_schedule']} "
      f"({len(ring['schedule'].events)} DMA starts and waits)")
print(f"every layer: the FFN's first block starts before attention's last block is waited: "
      f"{ffn_early}")
print(f"every layer: the next layer's first block starts before this FFN ends: {next_early}")
stream = ring["plan"].stream
print(f"ring: {stream.depth} slots of {list(stream.slot_shape)} bf16 "
      f"({stream.slot_bytes / 2**20:.1f} MiB each)")
assert ring["tokens_equal"] and ring["logits_ok"] and ring["log_is_schedule"]
assert ffn_early and next_early and not late["experts"]

# %%
ring_timeline = show_timeline(ring["log"], "7 layers, global ring")

# %% [markdown]
# The same step, both ways, on the timeline model of a TPU7x: the bytes are the same (each weight
# once), the waits between stages and layers are what the ring removes.

# %%
# NBVAL_CHECK_OUTPUT
rows = widgets.summary_rows({"stage rings": no_ring_timeline, "global ring": ring_timeline})
print(widgets.format_table(rows, ["label", "total_us", "hbm_floor_us", "roofline_fraction",
                                  "idle_hbm_busy_us", "bubble_us", "dma_bytes"]))
assert ring_timeline.total_s < no_ring_timeline.total_s

# %% [markdown]
# ## 4 · Sampling in the same call: 8 tokens
#
# The last stage of the call is the sampling body of notebook 05: final mix, RMSNorm, the LM head
# streamed in vocab tiles, greedy (or Gumbel-max) sampling — the logits never reach HBM. We feed
# a 3-token prompt through the megakernel one token per call, then generate 8 greedy tokens, and
# compare with `reference.generate`.
#
# This free-running decode can only match if the kernels compute what the reference computes in
# the same order: with mini's *random* weights one flipped bf16 rounding moves the logits by
# ~0.04 and can tip a router's near-tie to another expert. Where the spec leaves an order open
# (the online softmax's tiles, the MoE combine, the KDA update), the reference takes the order
# the kernels stream in — so here the megakernel reproduces it token for token.
# `tests/test_megakernel.py` checks 16 teacher-forced steps at B = 4 across a KV tile boundary
# (32, and B = 1, in its exhaustive tier): logits within the spec's 5e-2 on every row-step, the
# same experts, tokens equal except at near-ties (a reference top-2 gap under 0.1, reported).

# %%
N_TOKENS = 8  # each call is ≈1 s of TPU interpret mode here: enough tokens to run free for a while
prompt = jax.random.randint(jax.random.key(0), (1, 3), 0, mini.vocab_size)
expected, _ = reference.generate(mini_params, reference.init_state(mini, 1), prompt, N_TOKENS, mini)
prepared = megakernel.prepare_weights(mini_params, mini)
state, token, generated = reference.init_state(mini, 1), prompt[:, 0], []
started = time.perf_counter()
for t in range(prompt.shape[1] + N_TOKENS - 1):
    next_token, state, _ = megakernel.decode_step(prepared, state, token, np.array([t]), mini)
    if t >= prompt.shape[1] - 1:
        generated.append(int(next_token[0]))
    token = next_token if t >= prompt.shape[1] - 1 else prompt[:, t + 1]
seconds = time.perf_counter() - started

# %%
# The tokens themselves are this machine's: at a near-tie another summation order (another
# processor) can pick the other token, in both backends alike. The checked fact is the agreement.
print(f"prompt {np.asarray(prompt[0]).tolist()}")
print(f"megakernel: {generated}")
print(f"reference:  {np.asarray(expected[0]).tolist()}")

# %%
# NBVAL_CHECK_OUTPUT
print(f"{len(generated)} tokens, megakernel = reference: "
      f"{generated == np.asarray(expected[0]).tolist()}")
assert generated == np.asarray(expected[0]).tolist()

# %%
print(f"{prompt.shape[1] + N_TOKENS - 1} calls in {seconds:.1f} s on this machine "
      f"({tpu.describe_backend()}: a simulator, not a TPU timing)")

# %% [markdown]
# ## 5 · Compiling for TPU7x at the shapes of one rank of Kimi K3
#
# The released kernels run Kimi K3 on 32 ranks (16 TPU7x chips × 2 TensorCores): 3 attention
# heads, 112 local experts with a 768-wide slice of the expert hidden, a 5120-row vocab shard
# (spec §9; the collectives are left out on one device). `kimi-k3-rank`, one rank of the release
# layout (`mkresearch.sharding.layout.rank_config`), has those shapes (the sharded kernel with its
# collectives, on all 32 devices, is compiled by `make recorded`). The
# VMEM plan is computed first — every buffer with its bytes — and checked against the chip; then
# libtpu's Mosaic compiler builds the kernel from shapes alone (no weights are allocated).
#
# That compile takes half a minute to a minute on two CPU cores, so this notebook shows the result
# recorded by `mkresearch compile kimi-k3-rank --record` (`mkresearch.measurement.recorded`), as long as it
# was recorded for this very plan and JAX version; otherwise, or with `MKRESEARCH_COMPILE_RANK=1`
# in the environment, it compiles here. The VMEM plan is always computed here.

# %%
rank = layout.named_config("kimi-k3-rank")  # = layout.rank_config(get_config("kimi-k3"))
result, rank_plan, result_source = recorded.compile_or_recorded(
    rank, 1, chip="tpu7x", recompile=os.environ.get("MKRESEARCH_COMPILE_RANK") == "1")

# %%
# NBVAL_CHECK_OUTPUT
print(rank_plan.vmem.table())

# %%
print(f"{result} [{result_source}]")
print(f"Mosaic kernels in the compiled program: {result.n_mosaic_kernels}")
assert result.n_mosaic_kernels == 1
assert rank_plan.vmem.fits()

# %% [markdown]
# One Mosaic kernel holds all 93 layers' worth of work for a decode step: the layer loop keeps the
# kernel's size independent of depth, so the full model's per-rank shapes compile like mini's.
# The compiled program also holds a few XLA copies around the call (weight layouts chosen for
# the kernel's operands, and the state aliasing when the caller does not donate), which a
# deployment that stores the weights in the kernel's layout and donates the state avoids.
