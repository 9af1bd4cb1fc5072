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
# # 03 · MoE routing as a Pallas kernel
#
# Every MoE layer of Kimi K3 sends each token to 16 of its 896 experts. The router decides which,
# and with what weight (spec §6.1):
#
# $$r = x W_r \;(\text{f32}),\qquad s = \sigma(r),\qquad
#   \text{ids} = \operatorname{top-}k(s + b),\qquad
#   w_e = \frac{s_e}{\sum_{j \in \text{ids}} s_j}\cdot\text{routed\_scale}$$
#
# The correction bias $b$ only *selects*: it is how the model balances expert load without
# distorting the mixture. The weights come from the uncorrected scores.
#
# The kernel (`mkresearch.kernels.stages.router.router_body`) does all of it in VMEM: $W_r$ streams from
# HBM through a two-slot ring, the top-k is k rounds of "max, lowest index holding it, mask it
# out" over the whole $[B, E]$ tile (vector work, no sort), and the result is DMA'd from VMEM to
# **SMEM**, where the expert stage reads the ids as scalars to address its weight DMAs
# (notebook 04).
#
# Here, on the `kimi-k3-mini` model (16 experts, top-4): the kernel against the reference, the
# routing it produces, what the bias does, and a compile for a real TPU7x.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from mkresearch.kernels.base import dma
from mkresearch.kernels.stages import router

from mkresearch.model import config, reference, weights
from mkresearch.sharding import layout
from mkresearch.views import facts
from mkresearch.views.label_plots import label_problems
from mkresearch.views.widgets import show_figure

cfg = config.get_config("kimi-k3-mini")
params = weights.init_params(cfg, seed=0)
layer = 1  # the first MoE layer (layer 0 is dense)
p = reference.layer_params(params["moe"], cfg.ffn_index(layer))


def normalised_rows(batch, seed):
    """Router inputs like the model's: embeddings of random tokens through the layer's RMSNorm."""
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, batch)
    return reference.rms_norm(params["embed"][tokens], params["mlp_norm"][layer], cfg.rms_eps)


x = normalised_rows(8, seed=0)

# %%
# NBVAL_CHECK_OUTPUT
print(f"{cfg.name}: {cfg.n_experts} experts, top-{cfg.top_k}, {cfg.router_score} scores, "
      f"bias={cfg.router_bias}, routed_scale={cfg.routed_scale}")
print(f"x {tuple(x.shape)} {x.dtype}, W_r {tuple(p['w_router'].shape)} {p['w_router'].dtype}, "
      f"bias {tuple(p['router_bias'].shape)} {p['router_bias'].dtype}")

# %% [markdown]
# ## The kernel against the reference
#
# Ids must match exactly; weights within 1e-6 relative (the released tests' tolerance, spec §11).
# The DMA log shows the kernel's traffic: the router weight and bias in, ids and weights out to
# SMEM.

# %%
with dma.recording() as log:
    ids, weights_k = router.route(p, x, cfg)
ref_ids, ref_weights = reference.route(p, x, cfg)

# %%
# NBVAL_CHECK_OUTPUT
np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
np.testing.assert_allclose(np.asarray(weights_k), np.asarray(ref_weights), rtol=1e-6)
print("PASS ids equal the reference; weights within 1e-6 relative")
print("row  experts            weights")
for b in range(x.shape[0]):
    print(f"{b:3d}  {str(np.asarray(ids[b]).tolist()):18s} "
          + " ".join(facts.stable(v, ".3f", 1e-5) for v in np.asarray(weights_k[b])))
print("\nDMA log:")
for e in log.select("dma_start"):
    print(f"  {e.name:26s} {e.src} -> {e.dst} {e.nbytes:6d} B")
assert log.dma_bytes("router/w_router") == weights.nbytes(p["w_router"])

# %% [markdown]
# ## Load per expert, and what the correction bias does
#
# Over 256 tokens, how many pick each expert, with the layer's bias and without it. Then a
# deliberate nudge: raise the bias of the least-loaded expert by 0.1 and watch its load grow — the
# lever a load balancer pulls between steps. The weights never see the bias: for the rows whose
# expert set did not change, each expert's weight is the same (up to the f32 rounding of the
# normalising sum, which adds in selection order; only the order of the ids, which
# follows score + bias, can differ).

# %%
rows = normalised_rows(256, seed=1)
no_bias = cfg.replace(router_bias=False)
ids_bias, w_bias = (np.asarray(a) for a in router.route(p, rows, cfg))
ids_plain, w_plain = (np.asarray(a) for a in router.route(p, rows, no_bias))
load_bias = np.bincount(ids_bias.ravel(), minlength=cfg.n_experts)
load_plain = np.bincount(ids_plain.ravel(), minlength=cfg.n_experts)
coldest = int(np.argmin(load_bias))
nudged = {**p, "router_bias": p["router_bias"].at[coldest].add(0.1)}
ids_nudged, w_nudged = (np.asarray(a) for a in router.route(nudged, rows, cfg))
load_nudged = np.bincount(ids_nudged.ravel(), minlength=cfg.n_experts)

# %%
# NBVAL_CHECK_OUTPUT
changed = (np.sort(ids_bias, -1) != np.sort(ids_plain, -1)).any(-1)
print(f"rows whose expert set the layer's bias changes: {changed.sum()} of {len(rows)}")
same = ~changed  # same expert set; the order (by score + bias) may differ, so compare by id


def by_id(ids, w):
    return np.take_along_axis(w, np.argsort(ids, -1), -1)


np.testing.assert_allclose(by_id(ids_bias, w_bias)[same], by_id(ids_plain, w_plain)[same],
                           rtol=1e-6)  # the normalising sum adds in selection order: 1 f32 ulp
print(f"PASS weights of the {same.sum()} unchanged rows equal with and without bias (1e-6)")
print(f"coldest expert {coldest}: load {load_bias[coldest]} -> {load_nudged[coldest]} "
      f"after bias += 0.1")
assert changed.any() and load_nudged[coldest] > load_bias[coldest]
np.testing.assert_array_equal(np.asarray(reference.route(nudged, rows, cfg)[0]), ids_nudged)

# %%
fig, ax = plt.subplots(figsize=(9.5, 3), layout="constrained")
experts_axis = np.arange(cfg.n_experts)
ax.bar(experts_axis - 0.27, load_plain, 0.27, label="no bias")
ax.bar(experts_axis, load_bias, 0.27, label="layer's bias")
ax.bar(experts_axis + 0.27, load_nudged, 0.27, label=f"bias[{coldest}] += 0.1")
ax.axhline(len(rows) * cfg.top_k / cfg.n_experts, color="k", lw=0.8, ls=":",
           label="uniform load")
ax.set_xticks(experts_axis)
ax.set_xlabel("expert")
ax.set_ylabel("tokens routed (of 256)")
ax.set_title("Load per expert, layer 1 of kimi-k3-mini")
# beside the axes: inside, it covered the tallest bars
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
assert not label_problems(fig)  # no label runs into another, none is cut
show_figure(fig)  # described: an HTML export gives the picture its title

# %% [markdown]
# ## Ties and the other router families
#
# Iterated argmax makes ties deterministic: the lower expert id wins, as in the reference (and as
# `jnp.argmax` does). Engineer a tie — four experts with identical router columns and bias — and
# their ids come out in increasing order. The same kernel also does the softmax-then-top-k router
# of other MoE families (`router_score="softmax"`).

# %%
# NBVAL_CHECK_OUTPUT
tied = [3, 5, 9, 12]
w_tied = np.asarray(p["w_router"]).copy()
w_tied[:, tied] = w_tied[:, [3]] + 0.5
bias_tied = np.asarray(p["router_bias"]).copy()
bias_tied[tied] = 0.0
p_tied = {**p, "w_router": jnp.asarray(w_tied, jnp.bfloat16), "router_bias": jnp.asarray(bias_tied)}
x_pos = jnp.abs(x[:4])
ids_tied, _ = router.route(p_tied, x_pos, cfg)
np.testing.assert_array_equal(np.asarray(ids_tied), np.asarray(reference.route(p_tied, x_pos, cfg)[0]))
print("tied experts", tied, "-> ids per row", np.asarray(ids_tied)[0].tolist(), "(every row)")
softmax_cfg = cfg.replace(router_score="softmax")
ids_s, w_s = router.route(p, x, softmax_cfg)
ref_s = reference.route(p, x, softmax_cfg)
np.testing.assert_array_equal(np.asarray(ids_s), np.asarray(ref_s[0]))
np.testing.assert_allclose(np.asarray(w_s), np.asarray(ref_s[1]), rtol=1e-6)
print("PASS softmax router equals the reference")

# %% [markdown]
# ## Compiling for a real TPU7x
#
# Interpret mode accepts layouts a TPU would reject; the Mosaic compiler in libtpu does not.
# `tpu.compile_for` compiles the router for TPU7x here, at the mini shapes and at one rank's
# shapes of the full model (spec §9; the rank config's 112 experts stand in for the router's
# width — the real router scores all 896, a [7168, 896] bf16 matrix, also fine).

# %%
# NBVAL_CHECK_OUTPUT
for name in ("kimi-k3-mini", "kimi-k3-rank", "kimi-k3"):
    c = layout.named_config(name)  # kimi-k3-rank: one rank of the release layout
    moe = weights.param_shapes(c)["moe"]
    shapes = {k: jax.ShapeDtypeStruct(moe[k].shape[1:], moe[k].dtype) for k in ("w_router", "router_bias")}
    xs = jax.ShapeDtypeStruct((8, c.d_model), jnp.bfloat16)
    result = tpu.compile_for(lambda p, x, c=c: router.route(p, x, c), shapes, xs, chip="tpu7x")
    print(f"{name:13s} W_r {tuple(shapes['w_router'].shape)}: {result.n_mosaic_kernels} Mosaic "
          f"kernel compiled for {result.chip}")
    assert result.n_mosaic_kernels == 1
