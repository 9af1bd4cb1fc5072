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
# # 04 · The routed experts: write the expert kernel, read only the experts you use
#
# After the router of notebook 03, a Kimi K3 MoE layer runs its chosen experts in a **latent**
# (docs/kimi-k3.md §6; `W_ld`, `W_lu`, ρ in the glossary, docs/glossary.md):
#
# $$z = \mathrm{bf}(x W_{ld}),\quad
#   y_e = \mathrm{bf}\big(\mathrm{SiTU}(\mathrm{bf}(z W1_e), \mathrm{bf}(z W3_e))\, W2_e\big),\quad
#   \rho = \mathrm{bf}\Big(\sum_e w_e\, y_e\Big),\quad
#   \text{routed} = \mathrm{RMSNorm}(\rho)\, W_{lu}$$
#
# `bf(·)` rounds to bf16; **SiTU** is Kimi K3's gated activation,
# `4·tanh(g/4)·σ(g)·25·tanh(u/25)`; the sum runs over the row's k chosen experts, with the
# router's weights $w_e$, in f32 and in ascending expert id.
#
# At decode batch sizes each expert weight byte is used by a handful of rows: the layer costs its
# **bytes**, and the expert weights are most of them. You write the expert kernel here in five
# steps, each a small change to the one before and each checked against
# `mkresearch.model.reference.routed_experts`:
#
# 1. a grid over **all** experts (Pallas copies each expert's weights into VMEM);
# 2. only the **routed** experts: the router's ids are *scalar-prefetched* into the weights'
#    `index_map`;
# 3. each **distinct** expert of the batch once;
# 4. the same loop with a hand-written **2-slot ring** of DMAs, the form a megakernel needs;
# 5. **MXFP4** weights (a 4-bit format, defined there), 4.25 bits each, decoded in VMEM.
#
# Then you open the package's expert stage (`mkresearch.kernels.stages.experts`) to see what it
# adds, measure the bytes from its DMA log, and compile the whole layer for TPU7x.

# %% [markdown]
# The terms this notebook uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Latent MoE", "Routed", "SiTU", "bf(x)", "MXFP4", "E2M1", "FP8 e4m3",
                    "Dense FFN", "RMSNorm", "Ref", ".at[...]", "pl.ds", "pl.multiple_of",
                    "pl.when", "BlockSpec", "Memory space", "SMEM operand", "Scalar prefetch",
                    "scratch_shapes", "make_async_copy", "DMA semaphore", "Ring slot",
                    "Dimension semantics", "lax.fori_loop", "Race detector", "HBM floor", "Mosaic")

# %%
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma, quant
from mkresearch.kernels.stages import experts, router

from mkresearch.measurement.logs import expert_bytes_by_batch
from mkresearch.model import config, reference, roofline, weights
from mkresearch.prediction import timeline
from mkresearch.views import exercises, facts, plots, widgets
from mkresearch.views.label_plots import label_problems

# every kernel below runs with the race detector of TPU interpret mode (docs/tpu.md §4)
tpu.interpret_options(detect_races=True, vector_clock_size=16)
cfg = config.get_config("kimi-k3-mini", expert_format="bf16")
params = weights.init_params(cfg, seed=0)
layer = 1  # the first MoE layer
p = reference.layer_params(params["moe"], cfg.ffn_index(layer))
# three rows, the first and last the same token: a batch where rows share every expert
tokens = np.array([11, 1500, 11])
x = reference.rms_norm(params["embed"][tokens], params["mlp_norm"][layer], cfg.rms_eps)
ids, w = router.route(p, x, cfg)  # the router kernel of notebook 03: ids [B, k], weights [B, k]
want = np.asarray(reference.routed_experts(p, x, ids, w, cfg))  # [B, d] f32: every step's target
B, TOP_K = ids.shape
LAT, F = cfg.moe_latent, cfg.expert_hidden

# %%
# NBVAL_CHECK_OUTPUT
print(f"{cfg.name}: {cfg.n_experts} experts of [{LAT} -> {F} -> {LAT}], top-{TOP_K}; "
      f"one expert = {weights.expert_nbytes(cfg):,} B in {cfg.expert_format}")
print("routing of the batch:", np.asarray(ids).tolist())
print(f"{B * TOP_K} choices, {len(np.unique(np.asarray(ids)))} distinct experts")

# %% [markdown]
# ## The part you write, and the check
#
# Your kernels do the expert loop: from the latent `z [B, Lat]` to `acc = Σ w_e y_e [B, Lat]` f32.
# The latent projections around it are plain GEMVs (matrix-vector products, notebook 01): here
# `latent_in` and
# `latent_out` do them in plain JAX, with the reference's own functions, so each step is checked
# against `reference.routed_experts` whole. `expert_mlp` is one expert on every row, the same
# jnp code inside a kernel and out. The steps round where the reference rounds and add in its
# order, so they usually match it to the bit; the check allows bf16's tolerance, 2⁻⁷ of the
# output's largest entry, because another machine may order a dot's sum differently.

# %%
def latent_in(p, x):
    """z = bf(x W_ld) [B, Lat] bf16: once per row, shared by all its experts."""
    return reference.bf(reference.matmul(x, p["w_ld"]))


def latent_out(p, acc, cfg=cfg):
    """acc = Σ w_e y_e [B, Lat] f32 -> routed [B, d] f32: ρ = bf(acc), RMSNorm, W_lu."""
    rho_hat = reference.rms_norm(reference.bf(acc), p["latent_norm"], cfg.rms_eps, n=cfg.moe_latent)
    return reference.matmul(rho_hat, p["w_lu"])


def expert_mlp(z, w1, w3, w2):
    """One expert on every row: y = bf(SiTU(bf(z W1), bf(z W3)) W2), as f32 [B, Lat]."""
    g = jnp.dot(z, w1, preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # [B, F]
    u = jnp.dot(z, w3, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    h = reference.situ(g, u)  # plain jnp: it runs inside a kernel as it is
    y = jnp.dot(h, w2, preferred_element_type=jnp.float32)  # [B, Lat]
    return y.astype(jnp.bfloat16).astype(jnp.float32)


TOL = 2**-7
z = latent_in(p, x)


def check_step(name, acc, p=p, want=want, cfg=cfg):
    """Assert a step's acc gives reference.routed_experts (and no race); print a PASS line."""
    got = np.asarray(latent_out(p, acc, cfg))
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert err <= TOL, (name, err)
    assert not tpu.races_found(), name
    print(f"PASS {name}: equals reference.routed_experts within {TOL:g} of its largest entry; "
          "no race")


def block_loads(indices):
    """Copies a BlockSpec pipeline makes of a block whose index runs through `indices`: Pallas
    copies a block only when its index differs from the previous grid step's."""
    indices = np.asarray(indices)
    return 1 + int(np.sum(indices[1:] != indices[:-1]))


# %% [markdown]
# ## Step 1 · a grid over all experts
#
# The simplest correct kernel lets Pallas move the weights. The grid has one step per expert; the
# `BlockSpec` of each expert matrix says which block step `e` needs: `index_map = lambda e: (e, 0,
# 0)`, block shape `(None, Lat, F)` (`None` squeezes the expert axis out: the body sees `[Lat, F]`).
# Before each step Pallas copies that block HBM → VMEM, and it double-buffers: expert `e+1`'s copy
# runs while the body works on expert `e`. The output's block never changes, so it stays in VMEM
# across the grid and accumulates (the grid axis is a reduction: "arbitrary").
#
# Every expert runs on every row; a row that did not pick expert `e` weights it by 0. Correct, and
# it reads the whole layer.

# %%
def all_experts_kernel(z_ref, ids_ref, weights_ref, w1_ref, w3_ref, w2_ref, acc_ref):
    # grid step e: expert e's W1, W3 [Lat, F] and W2 [F, Lat] are in VMEM; z_ref [B, Lat] bf16,
    # ids_ref [B, k] i32, weights_ref [B, k] f32; acc_ref [B, Lat] f32 accumulates across steps
    e = pl.program_id(0)

    @pl.when(e == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    y = expert_mlp(z_ref[...], w1_ref[...], w3_ref[...], w2_ref[...])  # [B, Lat]: every row
    hit = ids_ref[...] == e  # [B, k]: where a row picked expert e
    coef = jnp.sum(jnp.where(hit, weights_ref[...], 0.0), axis=-1, keepdims=True)  # [B, 1]
    acc_ref[...] += coef * y


def all_experts(z, ids, weights_, experts_):
    batch, top_k = ids.shape
    n_experts, lat, hidden = experts_["w1"].shape
    whole = lambda e: (0, 0)  # the same block at every step
    expert = lambda e: (e, 0, 0)  # block e along the expert axis
    return pl.pallas_call(
        all_experts_kernel,
        grid=(n_experts,),
        in_specs=[pl.BlockSpec((batch, lat), whole),
                  pl.BlockSpec((batch, top_k), whole), pl.BlockSpec((batch, top_k), whole),
                  pl.BlockSpec((None, lat, hidden), expert),
                  pl.BlockSpec((None, lat, hidden), expert),
                  pl.BlockSpec((None, hidden, lat), expert)],
        out_specs=pl.BlockSpec((batch, lat), whole),
        out_shape=jax.ShapeDtypeStruct((batch, lat), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=tpu.interpret_params(),  # None on a TPU (compiled); interpret mode elsewhere
    )(z, ids, weights_, experts_["w1"], experts_["w3"], experts_["w2"])


# %%
# NBVAL_CHECK_OUTPUT
# Checks · step 1 against the reference; its expert loads
tpu.reset_races()
check_step("step 1, all experts", all_experts(z, ids, w, p["experts"]))
loads = {"1 all experts": block_loads(np.arange(cfg.n_experts))}
print(f"expert loads: {loads['1 all experts']} (every expert of the layer)")

# %% [markdown]
# ## Step 2 · only the routed experts: scalar prefetch
#
# Now the grid runs over the B·k (row, pick) **choices**, and step `i` must get the weights of the
# expert that choice names. An `index_map` runs *before* its grid step (Pallas issues the next
# step's copy while the current one computes), so it cannot read a kernel input: it reads
# **scalar-prefetched** operands. With `pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, ...)`
# the first two operands of the call are copied to **SMEM** (the scalar memory) before the grid
# starts; every `index_map` gets them after the grid indices, and so does the body, first. The
# expert `index_map` becomes `lambda i, choice_ids, choice_weights: (choice_ids[i], 0, 0)`.
#
# Each row's picks are sorted by id first, so every row adds its experts in ascending id, as the
# reference does. The body still runs the expert on the whole `[B, Lat]` tile (the MXU pads the
# rows anyway) and keeps it for the choice's row only.

# %%
def routed_kernel(choice_ids_ref, choice_weights_ref, z_ref, w1_ref, w3_ref, w2_ref, acc_ref, *,
                  top_k):
    # choice_ids_ref, choice_weights_ref [B*k] (SMEM, prefetched); grid step i: choice i, that is
    # row i // k, and its expert's W1, W3, W2 in VMEM
    i = pl.program_id(0)

    @pl.when(i == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    y = expert_mlp(z_ref[...], w1_ref[...], w3_ref[...], w2_ref[...])  # [B, Lat]
    row = lax.broadcasted_iota(jnp.int32, (y.shape[0], 1), 0)  # [B, 1]
    coef = jnp.where(row == lax.div(i, top_k), choice_weights_ref[i], 0.0)  # this choice's row
    acc_ref[...] += coef * y


def routed(z, ids, weights_, experts_):
    batch, top_k = ids.shape
    n_experts, lat, hidden = experts_["w1"].shape
    by_id = jnp.argsort(ids, axis=-1)  # each row's picks in ascending id: the reference's order
    choice_ids = jnp.take_along_axis(ids, by_id, axis=-1).reshape(-1)  # [B*k]
    choice_weights = jnp.take_along_axis(weights_, by_id, axis=-1).reshape(-1)
    whole = lambda i, choice_ids, choice_weights: (0, 0)
    expert = lambda i, choice_ids, choice_weights: (choice_ids[i], 0, 0)  # the routed expert
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # choice_ids, choice_weights: to SMEM before the grid starts
        grid=(batch * top_k,),
        in_specs=[pl.BlockSpec((batch, lat), whole),
                  pl.BlockSpec((None, lat, hidden), expert),
                  pl.BlockSpec((None, lat, hidden), expert),
                  pl.BlockSpec((None, hidden, lat), expert)],
        out_specs=pl.BlockSpec((batch, lat), whole))
    return pl.pallas_call(
        functools.partial(routed_kernel, top_k=top_k),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, lat), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=tpu.interpret_params(),
    )(choice_ids, choice_weights, z, experts_["w1"], experts_["w3"], experts_["w2"])


# %%
# NBVAL_CHECK_OUTPUT
# Checks · step 2 against the reference; its expert loads
tpu.reset_races()
check_step("step 2, routed choices (scalar prefetch)", routed(z, ids, w, p["experts"]))
loads["2 routed choices"] = block_loads(np.sort(np.asarray(ids), axis=-1).ravel())
print(f"expert loads: {loads['2 routed choices']} of {B * TOP_K} choices: rows 0 and 2 chose the "
      "same experts and load them twice")

# %% [markdown]
# ## Step 3 · each distinct expert once
#
# Rows share experts. List the batch's **distinct** experts in ascending id, and run each once on
# every row, with each row's weight for it: a vector compare of the `[B, k]` ids tile against the
# expert's id, then a sum (0 for a row that did not pick it). Ascending order makes every row add
# its experts in id order whatever the other rows chose, so a row's result does not depend on the
# batch, and it is the reference's order.
#
# The grid is static, but the number of distinct experts is not: the list is padded to B·k with
# its last entry and prefetched with its length. A padding step asks for the same block as the step
# before, so Pallas copies nothing, and `pl.when` skips its work.

# %%
def unique_kernel(unique_ref, count_ref, z_ref, ids_ref, weights_ref, w1_ref, w3_ref, w2_ref,
                  acc_ref):
    # unique_ref [B*k]: the distinct experts in ascending id, padded with the last; count_ref [1]:
    # how many are real (both SMEM, prefetched); grid step i: expert unique_ref[i] in VMEM
    i = pl.program_id(0)

    @pl.when(i == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(i < count_ref[0])  # a padding step: no copy (same block), no work
    def _():
        y = expert_mlp(z_ref[...], w1_ref[...], w3_ref[...], w2_ref[...])  # [B, Lat]
        hit = ids_ref[...] == unique_ref[i]  # [B, k]: every row that picked this expert
        coef = jnp.sum(jnp.where(hit, weights_ref[...], 0.0), axis=-1, keepdims=True)  # [B, 1]
        acc_ref[...] += coef * y


def unique_experts(ids):
    """The distinct ids in ascending order, padded to B*k with the last one; their count [1]."""
    flat = ids.reshape(-1)
    distinct = jnp.unique(flat, size=flat.size, fill_value=flat.max())
    return distinct, (1 + jnp.sum(distinct[1:] != distinct[:-1])).reshape(1).astype(jnp.int32)


def unique(z, ids, weights_, experts_):
    batch, top_k = ids.shape
    n_experts, lat, hidden = experts_["w1"].shape
    distinct, count = unique_experts(ids)
    whole = lambda i, distinct, count: (0, 0)
    expert = lambda i, distinct, count: (distinct[i], 0, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # distinct, count
        grid=(batch * top_k,),
        in_specs=[pl.BlockSpec((batch, lat), whole),
                  pl.BlockSpec((batch, top_k), whole), pl.BlockSpec((batch, top_k), whole),
                  pl.BlockSpec((None, lat, hidden), expert),
                  pl.BlockSpec((None, lat, hidden), expert),
                  pl.BlockSpec((None, hidden, lat), expert)],
        out_specs=pl.BlockSpec((batch, lat), whole))
    return pl.pallas_call(
        unique_kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, lat), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=tpu.interpret_params(),
    )(distinct, count, z, ids, weights_, experts_["w1"], experts_["w3"], experts_["w2"])


# %%
# NBVAL_CHECK_OUTPUT
# Checks · step 3 against the reference; its expert loads
tpu.reset_races()
check_step("step 3, distinct experts", unique(z, ids, w, p["experts"]))
loads["3 distinct experts"] = block_loads(unique_experts(ids)[0])
assert loads["3 distinct experts"] == len(np.unique(np.asarray(ids)))
print(f"expert loads: {loads['3 distinct experts']}, one per distinct expert")

# %% [markdown]
# ### Your turn: predict the bytes of the distinct-experts plan
#
# Write `my_unique_bytes(ids, cfg)`: the HBM bytes of expert weights that step 3 reads for a batch
# whose router chose `ids` `[B, k]`, with the experts stored in `cfg.expert_format`. An expert is
# three matrices, `W1` and `W3` `[Lat, F]` and `W2` `[F, Lat]` (`cfg.moe_latent`,
# `cfg.expert_hidden`); a bf16 weight is 2 bytes; an MXFP4 matrix `[K, N]` is K·N/2 bytes of 4-bit
# codes plus one 1-byte scale per 32 values along K (step 5 below).
#
# The check measures: it runs the package's expert kernel (opened at the end of this notebook) on
# this batch in bf16 and on 8 other rows in MXFP4, and reads the bytes it moved from its DMA log.

# %%
def my_unique_bytes(ids, cfg):
    # ids [B, k] int (numpy); cfg.expert_format "bf16" or "mxfp4". Your prediction here.
    raise NotImplementedError("predict the bytes")


# %%
mx_cfg = cfg.replace(expert_format="mxfp4")
mx_p = reference.layer_params(weights.init_params(mx_cfg, seed=0)["moe"], cfg.ffn_index(layer))
rows8 = reference.rms_norm(params["embed"][np.arange(8) * 97 + 5], params["mlp_norm"][layer],
                           cfg.rms_eps)  # 8 other tokens


@functools.cache
def measured_unique_bytes(fmt):
    """(ids [B, k], expert bytes in the DMA log) of the package's distinct-experts plan."""
    c, lp, rows = {"bf16": (cfg, p, x), "mxfp4": (mx_cfg, mx_p, rows8)}[fmt]
    batch_ids, batch_weights = router.route(lp, rows, c)
    with dma.recording() as log:
        experts.routed_experts(lp, rows, batch_ids, batch_weights, c, plan="unique")
    return np.asarray(batch_ids), log.dma_bytes(experts.EXPERT_DMA_PREFIX)


def check_unique_bytes(predict):
    for fmt, c in (("bf16", cfg), ("mxfp4", mx_cfg)):
        batch_ids, measured = measured_unique_bytes(fmt)
        predicted = predict(batch_ids, c)
        assert predicted == measured, f"{fmt}: predicted {predicted:,} B, measured {measured:,} B"


exercises.check("bytes of the distinct experts", lambda: check_unique_bytes(my_unique_bytes));


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: the bytes of the distinct experts (double-click to open)
# NBVAL_CHECK_OUTPUT
def unique_bytes_solution(ids, cfg):
    lat, hidden = cfg.moe_latent, cfg.expert_hidden  # each matrix holds lat x hidden weights
    per_matrix = {"bf16": lat * hidden * 2,
                  "mxfp4": lat * hidden // 2 + lat * hidden // 32}  # codes + E8M0 scales
    return len(np.unique(ids)) * 3 * per_matrix[cfg.expert_format]


assert exercises.check("bytes of the distinct experts",
                       lambda: check_unique_bytes(unique_bytes_solution))
for fmt in ("bf16", "mxfp4"):
    batch_ids, measured = measured_unique_bytes(fmt)
    print(f"{fmt:5s}: {len(batch_ids)} rows, {len(np.unique(batch_ids))} distinct experts of "
          f"{batch_ids.size} choices, {measured:,} B measured")

# %% [markdown]
# ## Step 4 · the same loop with a ring you write
#
# Pallas's pipeline already double-buffers step 3. Why write the copies by hand? Because a
# megakernel has no grid per stage: the whole decode step is one kernel invocation, each stage a
# loop inside it, and its weights must stream through a ring it drives itself (notebook 06). That
# is what this step does: one call, no grid. The expert weights stay in HBM (`memory_space=pl.ANY`);
# the distinct list and its count are plain SMEM inputs (no `index_map` reads them now); each
# matrix gets two VMEM slots, and each slot a DMA semaphore, as in notebook 01's ring. The loop's
# trip count is the count itself, read from SMEM: no padding steps. At step `i` the kernel starts
# expert `i+1`'s copies into the other slot, waits for expert `i`'s, and computes.

# %%
def ring_kernel(unique_ref, count_ref, z_ref, ids_ref, weights_ref, w1_hbm, w3_hbm, w2_hbm,
                acc_ref, w1_slots, w3_slots, w2_slots, sems):
    # w*_hbm [E, ...] stay in HBM; w*_slots [2, ...] VMEM scratch; sems [3, 2]: one DMA
    # semaphore per (matrix, slot)
    n = count_ref[0]
    matrices = ((w1_hbm, w1_slots), (w3_hbm, w3_slots), (w2_hbm, w2_slots))

    def copies(i, slot):  # expert unique_ref[i]'s three matrices -> slot
        e = unique_ref[i]
        return [pltpu.make_async_copy(hbm.at[e], slots.at[slot], sems.at[m, slot])
                for m, (hbm, slots) in enumerate(matrices)]

    for copy in copies(0, 0):  # the first expert is on its way before the loop
        copy.start()
    acc_ref[...] = jnp.zeros_like(acc_ref)

    def step(i, carry):
        slot = lax.rem(i, 2)

        @pl.when(i + 1 < n)  # the next expert into the other slot, free since step i-1
        def _():
            for copy in copies(i + 1, 1 - slot):
                copy.start()

        for copy in copies(i, slot):
            copy.wait()
        y = expert_mlp(z_ref[...], w1_slots[slot], w3_slots[slot], w2_slots[slot])  # [B, Lat]
        hit = ids_ref[...] == unique_ref[i]
        coef = jnp.sum(jnp.where(hit, weights_ref[...], 0.0), axis=-1, keepdims=True)
        acc_ref[...] += coef * y
        return carry

    lax.fori_loop(0, n, step, 0)


def ring(z, ids, weights_, experts_):
    batch, top_k = ids.shape
    lat = z.shape[1]
    distinct, count = unique_experts(ids)
    smem, vmem, hbm = (pl.BlockSpec(memory_space=space) for space in (pltpu.SMEM, pltpu.VMEM, pl.ANY))
    matrices = [experts_[m] for m in ("w1", "w3", "w2")]
    return pl.pallas_call(
        ring_kernel,
        in_specs=[smem, smem, vmem, vmem, vmem, hbm, hbm, hbm],
        out_specs=vmem,
        out_shape=jax.ShapeDtypeStruct((batch, lat), jnp.float32),
        scratch_shapes=[pltpu.VMEM((2, *a.shape[1:]), a.dtype) for a in matrices]
        + [pltpu.SemaphoreType.DMA((3, 2))],
        interpret=tpu.interpret_params(),
    )(distinct, count, z, ids, weights_, *matrices)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · step 4 against the reference, with the race detector watching the slots
tpu.reset_races()
check_step("step 4, distinct experts through a 2-slot ring", ring(z, ids, w, p["experts"]))
loads["4 ring of 2 slots"] = len(np.unique(np.asarray(ids)))  # one copy per expert in the list

# %% [markdown]
# ## Step 5 · MXFP4 weights, decoded in VMEM
#
# The published checkpoint stores the routed experts in **MXFP4** (docs/kimi-k3.md §7), a
# microscaling format: each weight is a 4-bit **E2M1** code (a sign bit, 2 exponent bits, 1
# mantissa bit: the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), and every 32 consecutive weights along
# K share one **E8M0** scale (an 8-bit exponent, no sign, no mantissa: 2^(s − 127)). Eight codes
# are packed in a uint32, the lowest nibble holding the lowest K. A matrix `[K, N]` is stored as
# `codes` uint32 `[K/8, N]` and `scales` uint8 `[K/32, N]`: 4.25 bits a weight instead of bf16's 16.
#
# The kernel DMAs the codes and scales as they are (the bytes that matter are HBM's) and decodes
# in VMEM, right before the dot. `decode_mxfp4` is plain jnp on values, so it runs in a kernel and
# out: first, out of one, against the reference's unpacking.

# %%
def decode_mxfp4(codes, scales):
    """codes uint32 [K/8, N], scales uint8 [K/32, N] -> bf16 [K, N]."""
    words, n = codes.shape
    nibble = jnp.broadcast_to(codes[:, None, :], (words, 8, n))  # each word once per nibble
    shift = lax.broadcasted_iota(jnp.uint32, (words, 8, n), 1) * 4
    code = ((nibble >> shift) & 0xF).astype(jnp.int32).reshape(words * 8, n)  # row 8r+j: nibble j
    exponent, mantissa = (code >> 1) & 3, (code & 1).astype(jnp.float32)
    magnitude = jnp.where(exponent == 0, 0.5 * mantissa,  # 0 or 0.5; else 2^(e-1) (1 + m/2)
                          (2 + mantissa) * (1 << exponent).astype(jnp.float32) / 4)
    value = jnp.where(code & 8, -magnitude, magnitude)
    # E8M0: s is an f32 exponent field as it is, so 2^(s-127) is s shifted into place
    scale = lax.bitcast_convert_type(scales.astype(jnp.int32) << 23, jnp.float32)  # [K/32, N]
    blocks = scales.shape[0]
    per_row = jnp.broadcast_to(scale[:, None, :], (blocks, 32, n)).reshape(blocks * 32, n)
    return (value * per_row).astype(jnp.bfloat16)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · decode_mxfp4 equals the reference's unpacking exactly (expert 0's W1 and W2)
for matrix in ("w1", "w2"):
    stored = jax.tree.map(lambda a: a[0], mx_p["experts"][matrix])
    np.testing.assert_array_equal(np.asarray(decode_mxfp4(stored["codes"], stored["scales"]), np.float32),
                                  np.asarray(weights.dequantize(stored, "mxfp4"), np.float32))
    print(f"PASS decode_mxfp4 == weights.dequantize, exactly: {matrix} codes "
          f"{tuple(stored['codes'].shape)} {stored['codes'].dtype}, scales "
          f"{tuple(stored['scales'].shape)} {stored['scales'].dtype}")

# %% [markdown]
# The kernel is step 4's with each matrix now a tuple of parts (`codes`, `scales`): one slot pair
# and one semaphore pair per part, and a `decode` between the slots and the dot. `pallas_call`
# takes inputs and scratch as pytrees, so the tuples pass through as they are. `quantised_ring`
# takes the part names and the decoder, so another format is one more decoder.

# %%
def quantised_ring_kernel(unique_ref, count_ref, z_ref, ids_ref, weights_ref, w1_hbm, w3_hbm,
                          w2_hbm, acc_ref, w1_slots, w3_slots, w2_slots, sems, *, decode):
    # w*_hbm: a tuple of parts [E, ...] each; w*_slots: the same parts [2, ...] in VMEM;
    # sems [3, n_parts, 2]: one DMA semaphore per (matrix, part, slot)
    n = count_ref[0]
    matrices = ((w1_hbm, w1_slots), (w3_hbm, w3_slots), (w2_hbm, w2_slots))

    def copies(i, slot):  # every part of expert unique_ref[i]'s three matrices -> slot
        e = unique_ref[i]
        return [pltpu.make_async_copy(part.at[e], part_slots.at[slot], sems.at[m, j, slot])
                for m, (hbm, slots) in enumerate(matrices)
                for j, (part, part_slots) in enumerate(zip(hbm, slots))]

    for copy in copies(0, 0):
        copy.start()
    acc_ref[...] = jnp.zeros_like(acc_ref)

    def step(i, carry):
        slot = lax.rem(i, 2)

        @pl.when(i + 1 < n)
        def _():
            for copy in copies(i + 1, 1 - slot):
                copy.start()

        for copy in copies(i, slot):
            copy.wait()
        w1, w3, w2 = (decode(*(part_slots[slot] for part_slots in slots))  # bf16, in VMEM
                      for _, slots in matrices)
        y = expert_mlp(z_ref[...], w1, w3, w2)  # [B, Lat]
        hit = ids_ref[...] == unique_ref[i]
        coef = jnp.sum(jnp.where(hit, weights_ref[...], 0.0), axis=-1, keepdims=True)
        acc_ref[...] += coef * y
        return carry

    lax.fori_loop(0, n, step, 0)


def quantised_ring(z, ids, weights_, experts_, *, parts=("codes", "scales"), decode=decode_mxfp4):
    batch, top_k = ids.shape
    lat = z.shape[1]
    distinct, count = unique_experts(ids)
    smem, vmem, hbm = (pl.BlockSpec(memory_space=space) for space in (pltpu.SMEM, pltpu.VMEM, pl.ANY))
    matrices = [tuple(experts_[m][part] for part in parts) for m in ("w1", "w3", "w2")]
    return pl.pallas_call(
        functools.partial(quantised_ring_kernel, decode=decode),
        in_specs=[smem, smem, vmem, vmem, vmem] + [tuple(hbm for _ in parts)] * 3,
        out_specs=vmem,
        out_shape=jax.ShapeDtypeStruct((batch, lat), jnp.float32),
        scratch_shapes=[tuple(pltpu.VMEM((2, *a.shape[1:]), a.dtype) for a in m) for m in matrices]
        + [pltpu.SemaphoreType.DMA((3, len(parts), 2))],
        interpret=tpu.interpret_params(),
    )(distinct, count, z, ids, weights_, *matrices)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · step 5 against the reference of the MXFP4 layer (same rows; the router sees the same
# router weights, the experts are the MXFP4 ones)
mx_ids, mx_w = router.route(mx_p, x, mx_cfg)
mx_want = np.asarray(reference.routed_experts(mx_p, x, mx_ids, mx_w, mx_cfg))
tpu.reset_races()
check_step("step 5, MXFP4 experts decoded in VMEM",
           quantised_ring(latent_in(mx_p, x), mx_ids, mx_w, mx_p["experts"]),
           p=mx_p, want=mx_want, cfg=mx_cfg)
loads["5 MXFP4, ring of 2 slots"] = len(np.unique(np.asarray(mx_ids)))
print(f"one expert: {weights.expert_nbytes(mx_cfg):,} B in MXFP4, "
      f"{weights.expert_nbytes(cfg):,} B in bf16")

# %% [markdown]
# ### Your turn: the FP8 variant
#
# The release repacked the gate and up projections into **FP8 e4m3** (glossary): each weight an
# 8-bit float (4 exponent bits, 3 mantissa bits), and one bf16 scale, a power of two, per 256
# consecutive weights along K. A matrix `[K, N]` is stored as `values` float8_e4m3fn `[K, N]` and
# `scales` bf16 `[K/256, N]`; a weight is its value times its block's scale.
#
# Write `my_decode_fp8(values, scales)` -> bf16 `[K, N]`. The check compares it with the
# reference's unpacking, then runs step 5's kernel with it on the FP8 layer against
# `reference.routed_experts`.

# %%
def my_decode_fp8(values, scales):
    # values float8_e4m3fn [K, N], scales bf16 [K/256, N] -> bf16 [K, N]. Your decoder here.
    raise NotImplementedError("write the FP8 decoder")


# %%
fp8_cfg = cfg.replace(expert_format="fp8")
fp8_p = reference.layer_params(weights.init_params(fp8_cfg, seed=0)["moe"], cfg.ffn_index(layer))


def check_fp8(decode):
    stored = jax.tree.map(lambda a: a[0], fp8_p["experts"]["w2"])
    decoded = np.asarray(decode(stored["values"], stored["scales"]), np.float32)
    assert decoded.shape == (F, LAT), f"decoded shape {decoded.shape}, expected {(F, LAT)}"
    assert np.array_equal(decoded, np.asarray(weights.dequantize(stored, "fp8"), np.float32)), \
        "the decoded weights differ from weights.dequantize"
    fp8_ids, fp8_w = router.route(fp8_p, x, fp8_cfg)
    fp8_want = np.asarray(reference.routed_experts(fp8_p, x, fp8_ids, fp8_w, fp8_cfg))
    tpu.reset_races()
    acc = quantised_ring(latent_in(fp8_p, x), fp8_ids, fp8_w, fp8_p["experts"],
                         parts=("values", "scales"), decode=decode)
    got = np.asarray(latent_out(fp8_p, acc, fp8_cfg))
    err = float(np.max(np.abs(got - fp8_want)) / np.max(np.abs(fp8_want)))
    assert err <= TOL, f"the layer differs from the reference by {err:.3g} of its largest entry"
    assert not tpu.races_found(), "the race detector flagged an access"


exercises.check("the FP8 variant", lambda: check_fp8(my_decode_fp8));


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: the FP8 decoder (double-click to open)
# NBVAL_CHECK_OUTPUT
def decode_fp8_solution(values, scales):
    blocks, n = scales.shape
    per_row = jnp.broadcast_to(scales.astype(jnp.float32)[:, None, :], (blocks, 256, n))
    return (values.astype(jnp.float32) * per_row.reshape(blocks * 256, n)).astype(jnp.bfloat16)


assert exercises.check("the FP8 variant", lambda: check_fp8(decode_fp8_solution))

# %% [markdown]
# ## Step 6 · a dense FFN in column tiles, its norm inside the kernel
#
# Beside the experts, Kimi K3's first layer has a **dense FFN**: every row uses all of its
# weights, `m = bf(SiTU(bf(x W_g), bf(x W_u)) W_d)` on the normed input `x = RMSNorm_γ(h)`
# (`reference.dense_ffn`). Two things no kernel above does: the **norm inside the kernel**, and
# the weights streamed in **column tiles** instead of row blocks.
#
# **The norm.** `numerics.rms_norm` is `bf(h · rms_scale(ordered_sum(h²), d, eps) · γ)` in f32:
# `ordered_sum` adds the row's squares in one written-out order (128-lane chunks in sequence, then
# halves), which no compiler reorders, and `rms_scale` is `(Σ/d + eps)^-½`. The kernel calls the
# same two functions on the same values, so its normed rows are the reference's to the bit on
# any machine.
#
# **Column tiles.** A column window `w_hbm.at[:, pl.ds(j * tf, tf)]` is a legal DMA source: all
# `d` rows of W_g, `tf` of its columns. It is **strided**: in W's row-major layout its bytes are
# `d` pieces of `tf · 2` bytes, one per row, where a row block `w_hbm.at[pl.ds(r, n)]` is one
# contiguous piece. Why take them: a column tile of W_g and of W_u gives `tf` hidden units
# complete, `a[:, j] = SiTU(bf(x W_g[:, j]), bf(x W_u[:, j]))`, each a dot over the whole of `d`,
# as the reference's matmul takes it; W_d then goes by column tiles too, each output column a dot
# over the whole hidden. A row block would split a dot's sum into partial sums added in another
# order (at mini sizes the package's stages stream each matrix as one block, so their sums are
# the reference's; at full size their row blocks split them: `kernels/base/weight_stream.py`).
# Two rings of two slots: W_g's and W_u's tiles share a slot index, W_d's come after; semaphores
# `[3, 2]`, one per matrix and slot. The copies go through `dma.Copy`, so the DMA log counts them.

# %%
from mkresearch.model import numerics

dense_layer = cfg.dense_layers[0]  # layer 0
dense_p = reference.layer_params(params["dense"], cfg.ffn_index(dense_layer))
ROWS = 8
h_dense = params["embed"][np.arange(ROWS) * 131 + 7]  # [8, d] bf16: a stand-in of the layer's input
gamma = params["mlp_norm"][dense_layer]  # [d] bf16
x_dense = reference.rms_norm(h_dense, gamma, cfg.rms_eps)
dense_want = reference.dense_ffn(dense_p, x_dense, cfg)  # [8, d] bf16


def dense_ffn_kernel(h_ref, gamma_ref, wg_hbm, wu_hbm, wd_hbm, out_ref, x_ref, a_ref, gu_slots,
                     d_slots, sems, *, tf, td):
    # h_ref [B, d] bf16, gamma_ref [1, d] bf16 (VMEM); wg_hbm, wu_hbm [d, F], wd_hbm [F, d]
    # (HBM); out_ref [B, d] bf16 and x_ref [B, d] bf16, the normed rows (VMEM); scratch: a_ref
    # [B, F] bf16 (the hidden), gu_slots [2, 2, d, tf] (slot, gate|up), d_slots [2, F, td],
    # sems [3, 2]: a DMA semaphore per (matrix, slot)
    d, f = wg_hbm.shape
    n_hidden, n_out = f // tf, d // td

    def gate_up(j, slot):  # hidden tile j: a column window of W_g and one of W_u
        cols = pl.ds(pl.multiple_of(j * tf, tf), tf)
        return [dma.Copy(w.at[:, cols], gu_slots.at[slot, m], sems.at[m, slot], name=name,
                         slot=slot, tile=j)
                for m, (w, name) in enumerate(((wg_hbm, "w_gate"), (wu_hbm, "w_up")))]

    def down(c, slot):  # output tile c: a column window of W_d
        cols = pl.ds(pl.multiple_of(c * td, td), td)
        return dma.Copy(wd_hbm.at[:, cols], d_slots.at[slot], sems.at[2, slot], name="w_down",
                        slot=slot, tile=c)

    for copy in [*gate_up(0, 0), down(0, 0)]:  # in flight while the kernel norms the rows
        copy.start()
    h = h_ref[...].astype(jnp.float32)  # [B, d]
    scale = numerics.rms_scale(numerics.ordered_sum(h * h, keepdims=True), d, cfg.rms_eps)
    x_ref[...] = (h * scale * gamma_ref[...].astype(jnp.float32)).astype(jnp.bfloat16)

    def hidden_tile(j, carry):
        slot = lax.rem(j, 2)

        @pl.when(j + 1 < n_hidden)
        def _():
            for copy in gate_up(j + 1, 1 - slot):
                copy.start()

        for copy in gate_up(j, slot):
            copy.wait()
        g = jnp.dot(x_ref[...], gu_slots[slot, 0], preferred_element_type=jnp.float32)
        u = jnp.dot(x_ref[...], gu_slots[slot, 1], preferred_element_type=jnp.float32)
        a_ref[:, pl.ds(pl.multiple_of(j * tf, tf), tf)] = numerics.activation(
            g.astype(jnp.bfloat16), u.astype(jnp.bfloat16), cfg)
        return carry

    def out_tile(c, carry):
        slot = lax.rem(c, 2)

        @pl.when(c + 1 < n_out)
        def _():
            down(c + 1, 1 - slot).start()

        down(c, slot).wait()
        y = jnp.dot(a_ref[...], d_slots[slot], preferred_element_type=jnp.float32)
        out_ref[:, pl.ds(pl.multiple_of(c * td, td), td)] = y.astype(jnp.bfloat16)
        return carry

    lax.fori_loop(0, n_hidden, hidden_tile, 0)
    lax.fori_loop(0, n_out, out_tile, 0)


def dense_ffn(h, gamma, w_gate, w_up, w_down, tf=128, td=128):
    """-> (m [B, d] bf16, the normed rows x [B, d] bf16): RMSNorm, then the FFN in column tiles."""
    rows, d = h.shape
    f = w_gate.shape[1]
    vmem, hbm = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(dense_ffn_kernel, tf=tf, td=td),
        in_specs=[vmem, vmem, hbm, hbm, hbm], out_specs=(vmem, vmem),
        out_shape=(jax.ShapeDtypeStruct((rows, d), jnp.bfloat16),) * 2,
        scratch_shapes=[pltpu.VMEM((rows, f), jnp.bfloat16),
                        pltpu.VMEM((2, 2, d, tf), jnp.bfloat16),
                        pltpu.VMEM((2, f, td), jnp.bfloat16),
                        pltpu.SemaphoreType.DMA((3, 2))],
        interpret=tpu.interpret_params(),
    )(h, gamma.reshape(1, d), w_gate, w_up, w_down)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · the dense FFN in column tiles against reference.dense_ffn, at two tile sizes
dense_logs = {}
for tf, td in ((128, 128), (512, 256)):
    tpu.reset_races()
    with dma.recording() as dense_logs[tf, td]:
        dense_m, dense_x = dense_ffn(h_dense, gamma, dense_p["w_gate"], dense_p["w_up"],
                                     dense_p["w_down"], tf, td)
        jax.block_until_ready(dense_m)
    np.testing.assert_array_equal(np.asarray(dense_x, np.float32), np.asarray(x_dense, np.float32))
    dense_err = np.max(np.abs(np.asarray(dense_m, np.float32) - np.asarray(dense_want, np.float32)))
    assert dense_err <= TOL * np.max(np.abs(np.asarray(dense_want, np.float32))), (tf, td)
    assert not tpu.races_found()
    print(f"tiles of {tf} hidden and {td} output columns: the normed rows equal "
          f"reference.rms_norm to the bit; m equals reference.dense_ffn within {TOL:g} of its "
          "largest entry; no race")

# %%
# the output's bits on this machine (another one may order a dot's sum otherwise: not a fact)
dense_bits = np.array_equal(np.asarray(dense_m), np.asarray(dense_want))
print(f"m equal to reference.dense_ffn to the bit here: {dense_bits}")

# %% [markdown]
# **What the column tiles cost.** Every weight byte crosses HBM once at either tile size: the
# bytes are the matrices'. What the tile size changes is the number of DMAs, `F / tf` per gate
# or up matrix and `d / td` for W_d, and each DMA's pieces: a window of `tf` columns is `d` rows
# of `tf · 2` bytes (256 B at `tf = 128`). The timeline model (notebook 01) charges every DMA a
# fixed latency (0.5 µs, an ASSUMPTION) and its bytes at the HBM bandwidth; it does not price the
# pieces of a strided window (an ASSUMPTION too: that a window of whole 128-lane columns moves
# as fast as a block). Both tilings below, replayed on a TPU7x: fewer, larger tiles wait less.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the DMAs and bytes of each tiling, from the DMA log; the modelled step on TPU7x
dense_rows = []
for (tf, td), dense_log in dense_logs.items():
    simulated = timeline.simulate(dense_log, "tpu7x")
    row = {"tiles (tf, td)": f"{tf}, {td}"}
    for name, window in (("w_gate", (cfg.d_model, tf)), ("w_up", (cfg.d_model, tf)),
                         ("w_down", (cfg.dense_hidden, td))):
        starts = dense_log.select("dma_start", name)
        row[f"{name} DMAs"] = len(starts)
        assert dense_log.dma_bytes(name) == cfg.d_model * cfg.dense_hidden * 2  # each byte once
        assert {e.nbytes for e in starts} == {window[0] * window[1] * 2}
    row["pieces of a gate window"] = f"{cfg.d_model} x {tf * 2} B"
    row["MiB moved"] = dense_log.dma_bytes() / 2**20
    row["modelled_us"] = simulated.total_s * 1e6
    row["hbm_floor_us"] = simulated.hbm_floor_s * 1e6
    dense_rows.append(row)
print(widgets.format_table(dense_rows, list(dense_rows[0])))
assert dense_rows[0]["w_gate DMAs"] == cfg.dense_hidden // 128 and dense_rows[1]["w_gate DMAs"] == 2
assert dense_rows[1]["modelled_us"] < dense_rows[0]["modelled_us"]

# %% [markdown]
# Mosaic takes the strided windows: the kernel compiles for a TPU7x and a v5e here, from shapes.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the dense FFN kernel compiles for TPU7x and v5e: one Mosaic kernel each
if tpu.can_compile():
    for dense_chip in ("tpu7x", "v5e"):
        dense_compiled = tpu.compile_for(dense_ffn, h_dense, gamma, dense_p["w_gate"],
                                         dense_p["w_up"], dense_p["w_down"], chip=dense_chip)
        print(f"the dense FFN in column tiles compiled for {dense_chip}: "
              f"{dense_compiled.n_mosaic_kernels} Mosaic kernel")
        assert dense_compiled.n_mosaic_kernels == 1
else:  # a CPU runtime without libtpu (Colab's): the tpu extra brings the compiler
    print("no libtpu here to compile for tpu7x: pip install 'mkresearch[tpu]', restart, run again")

# %% [markdown]
# ### Your turn: one expert in K tiles
#
# Step 4 moved an expert's matrix whole. A full-size expert slice does not always fit a slot:
# stream it in **K tiles**, row blocks of `TK` rows, through a two-slot ring. Write
# `my_k_tiles_kernel`: `out = z W1[e]` for the expert `e` in SMEM, with `W1[e]`'s row blocks
# `w1_hbm.at[e, pl.ds(k * TK, TK)]` copied one ahead of the one multiplied, and `out` the sum of
# `z[:, tile k] @ tile k` in order. The check runs it on expert 5 of the layer with the race
# detector on, against `jnp.dot` (within f32 rounding: a sum split in tiles adds in another
# order), and compiles it for TPU7x with Mosaic.

# %%
TK = 128  # rows of one K tile of W1 [Lat, F]


def my_k_tiles_kernel(e_ref, z_ref, w1_hbm, out_ref, slots, sems):
    # e_ref [1] i32 (SMEM); z_ref [B, Lat] bf16 (VMEM); w1_hbm [E, Lat, F] bf16 (HBM); out_ref
    # [B, F] f32 (VMEM); scratch: slots [2, TK, F] bf16, sems: 2 DMA semaphores
    raise NotImplementedError("stream W1[e] in K tiles through two slots")


# %%
def run_k_tiles(kernel, e, z, w1):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((z.shape[0], w1.shape[2]), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((2, TK, w1.shape[2]), w1.dtype), pltpu.SemaphoreType.DMA((2,))],
        interpret=tpu.interpret_params(),
    )(jnp.array([e], jnp.int32), z, w1)


def check_k_tiles(kernel):
    w1 = p["experts"]["w1"]  # [E, Lat, F] bf16
    got = exercises.race_free(lambda: np.asarray(run_k_tiles(kernel, 5, z, w1)))
    want = np.asarray(jnp.dot(z, w1[5], preferred_element_type=jnp.float32))
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (
        f"max |error| against z @ W1[5] is {np.abs(got - want).max():.3g}")
    exercises.compiles(lambda z_, w1_: run_k_tiles(kernel, 5, z_, w1_), z, w1)


exercises.check("one expert in K tiles", lambda: check_k_tiles(my_k_tiles_kernel))


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: one expert in K tiles (double-click to open)
# NBVAL_CHECK_OUTPUT
def k_tiles_solution(e_ref, z_ref, w1_hbm, out_ref, slots, sems):
    e, tk = e_ref[0], slots.shape[1]
    n_tiles = w1_hbm.shape[1] // tk

    def copy(k, slot):  # K tile k of W1[e] -> one slot
        rows = pl.ds(pl.multiple_of(k * tk, tk), tk)
        return pltpu.make_async_copy(w1_hbm.at[e, rows], slots.at[slot], sems.at[slot])

    copy(0, 0).start()
    out_ref[...] = jnp.zeros_like(out_ref)

    def step(k, carry):
        slot = lax.rem(k, 2)

        @pl.when(k + 1 < n_tiles)
        def _():
            copy(k + 1, 1 - slot).start()

        copy(k, slot).wait()
        columns = pl.ds(pl.multiple_of(k * tk, tk), tk)
        out_ref[...] += jnp.dot(z_ref[:, columns], slots[slot], preferred_element_type=jnp.float32)
        return carry

    lax.fori_loop(0, n_tiles, step, 0)


assert exercises.check("one expert in K tiles", lambda: check_k_tiles(k_tiles_solution))

# %% [markdown]
# ## What the package's expert stage adds
#
# `experts.routed_part` picks the work list (its `plan`: all experts, the routed choices, or the
# distinct ones) and `experts._ExpertLoop` is the loop over it: your step 5, in the body the
# megakernel runs for every MoE layer (imported here, not pasted). Around your loop it adds:
#
# - **The ids come from the router in the same kernel**, in SMEM (notebook 03's `Routing`), so the
#   distinct list is built in the kernel too: `router.dedupe_experts` marks each id in a "seen"
#   table in SMEM and compacts it in ascending id, a scalar loop of about 3E + 2·B·k SMEM accesses
#   before any expert DMA.
# - **The first experts' DMAs start before the latent down-projection**, right after routing, so
#   they fly behind `W_ld`'s stream; `W_ld`, the latent RMSNorm's γ and `W_lu` stream through the
#   kernel's weight ring as well (your `latent_in` and `latent_out`).
# - **Any number of slots** (`n_slots`, 1 to 8; 1 is "copy, wait, compute") and the three plans,
#   so tests and this notebook compare them.
# - **Every copy through `dma.Ring`** (notebook 01: your `make_async_copy`, plus the log), so the
#   bytes are measured, not computed, and the timeline model can replay the stage.
# - **Decoding chunk by chunk along K** (`quant.matmul`): at full size a `[3584, 3072]` matrix
#   decoded at once would be 44 MB of f32 temporaries. On TPU7x the E2M1 codes are decoded by
#   `pltpu.bitcast` to `float4_e2m1fn`, a native type there; elsewhere by integer operations, like
#   your `decode_mxfp4`. FP8 and bf16 too, each format's shapes checked before tracing.
# - **Sharding**: on a rank of a sharded model (**EP × ETP**, glossary: experts split over EP
#   groups of ETP ranks; inside a group each rank holds a slice of each of the group's experts), the
#   loop runs over the rank's own experts (`shard.expert_range`) and their sums join across ranks
#   (`shard.keep_item`, `shard.combine_items`; notebook 08).
# - **The shared experts** run in the same stage (`experts.moe_ffn`: router, experts and shared
#   experts in one kernel), with a cost estimate for XLA and a VMEM limit that fits two bf16
#   expert slots at one rank's shapes.

# %%
print(inspect.getsource(experts.routed_part))
print(inspect.getsource(experts._ExpertLoop.run))
print(inspect.getsource(experts._ExpertLoop._step))
print(inspect.getsource(router.dedupe_experts))

# %% [markdown]
# ### The package's stage, measured
#
# The package's kernel against the reference for each plan and format, with the loads and bytes
# read from its DMA log, beside the loads your steps made. Then its DMA log's order of issue with
# two slots: `S3` starts expert 3's copy, `W3` waits for it, `C3` computes it, `L` is the latent
# down-projection. The first expert's copy is issued before the latent down-projection, and each
# next expert's before the current one computes.

# %%
def run_package(label, plan, n_slots, p=p, cfg=cfg, ids=ids, w=w, want=want):
    with dma.recording() as log:
        out = experts.routed_experts(p, x, ids, w, cfg, plan=plan, n_slots=n_slots)
    err = float(np.max(np.abs(np.asarray(out) - want)) / np.max(np.abs(want)))
    first = experts.expert_dma_name("w1", quant.part_names(cfg.expert_format)[0])
    n_loads = len(log.select("dma_start", first))  # one per expert load
    nbytes = log.dma_bytes(experts.EXPERT_DMA_PREFIX)
    return log, {"step": label, "plan": plan, "slots": n_slots, "format": cfg.expert_format,
                 "loads": n_loads, "expert bytes": nbytes, "err": err}


tpu.reset_races()
package = [run_package("1 all experts", "all", 1)[1],
           run_package("2 routed choices", "routed", 1)[1]]
log_one_slot, row = run_package("3 distinct experts", "unique", 1)
package.append(row)
log_ring, row = run_package("4 ring of 2 slots", "unique", 2)
package.append(row)
package.append(run_package("5 MXFP4, ring of 2 slots", "unique", 2, p=mx_p, cfg=mx_cfg, ids=mx_ids,
                           w=mx_w, want=mx_want)[1])


def program(log, n=16):
    """The log's order of issue: S/W i = start/wait expert i's copies, C i its compute, L W_ld."""
    marks = []
    for e in log.events:
        if e.name == experts.expert_dma_name("w1", "weight"):
            marks.append(("S" if e.kind == "dma_start" else "W") + str(e.indices["item"]))
        elif e.name == "expert/compute" and e.kind == "phase_start":
            marks.append(f"C{e.indices['item']}")
        elif e.name == experts.LATENT_DOWN and (not marks or marks[-1] != "L"):
            marks.append("L")
    return " ".join(marks[:n])


# %%
# NBVAL_CHECK_OUTPUT
# Checks · the package's stage: each plan against the reference, its loads and bytes against
# your steps' loads, its order of issue
for row in package:
    assert row["err"] <= TOL, row
    assert row["loads"] == loads[row["step"]], (row, loads)
    cfg_of = mx_cfg if row["format"] == "mxfp4" else cfg
    assert row["expert bytes"] == row["loads"] * weights.expert_nbytes(cfg_of)  # whole experts
    row["your loads"] = loads[row["step"]]
    row["vs reference"] = "PASS" if row["err"] <= TOL else "FAIL"  # digits vary by machine
assert not tpu.races_found()
print(widgets.format_table(package, ["step", "plan", "slots", "format", "your loads", "loads",
                                     "expert bytes", "vs reference"]))
print("\nissue order, 2 slots:", program(log_ring), "...")
order = [(e.kind, e.name.split("/")[0], e.indices.get("item")) for e in log_ring.events]
assert order.index(("dma_start", "expert", 0)) < order.index(("dma_wait", "latent", None))
assert order.index(("dma_start", "expert", 1)) < order.index(("phase_start", "expert", 0))

# %% [markdown]
# What the overlap is worth is a question for a TPU; the timeline model of
# `mkresearch.prediction.timeline` replays the two logs on TPU7x figures (modelled, not measured:
# its DMA latency and engine count are assumptions, notebook 01; at mini shapes the latency weighs
# more than it would at full size; the **HBM floor**, glossary, is the bytes over HBM bandwidth):

# %%
# NBVAL_CHECK_OUTPUT
# Checks · modelled stage time with two slots against one (the model is pure Python over the
# logs: the same on any machine)
t1, t2 = timeline.simulate(log_one_slot, "tpu7x"), timeline.simulate(log_ring, "tpu7x")
assert t2.total_s < t1.total_s
print(f"modelled: 2 slots take {facts.stable(t2.total_s / t1.total_s, '.2f', 1e-9)} of 1 slot's "
      f"time and reach {facts.stable(t2.hbm_floor_s / t2.total_s, '.0%', 1e-9)} of the HBM floor")

# %% [markdown]
# ### Bytes of one expert at full size
#
# At Kimi K3's shapes (W1, W3: 3584 × 3072, W2: 3072 × 3584) the formats cost, per expert:

# %%
# NBVAL_CHECK_OUTPUT
# Checks · bytes per expert at full size, and what decoding MXFP4 in the kernel saves
full = config.get_config("kimi-k3")
lat, hid = full.moe_latent, full.expert_hidden
per_expert = {fmt: 2 * quant.matrix_nbytes(fmt, lat, hid) + quant.matrix_nbytes(fmt, hid, lat)
              for fmt in ("bf16", "fp8", "mxfp4")}
per_expert["released (FP8 gate/up + MXFP4 down)"] = roofline.expert_bytes(full, "released")
for fmt, nbytes in per_expert.items():
    print(f"{fmt:38s} {nbytes / 1e6:7.2f} MB")
saving = (per_expert["released (FP8 gate/up + MXFP4 down)"] - per_expert["mxfp4"]) \
    * full.top_k * len(full.moe_layers)
print(f"decoding MXFP4 in the kernel instead of the FP8 repack saves {saving / 1e9:.1f} GB of HBM "
      f"reads per token (16 experts x {len(full.moe_layers)} layers)")
assert per_expert["mxfp4"] == roofline.expert_bytes(full, "mxfp4")
assert abs(per_expert["mxfp4"] / 17.55e6 - 1) < 1e-3 and abs(saving / 15e9 - 1) < 0.05

# %% [markdown]
# ## Bytes per layer against batch size
#
# More rows pick more distinct experts, but sub-linearly: rows share experts, and a layer never
# reads more than all of them. Measured from the DMA log of the MXFP4 stage (router kernel, then
# the distinct-experts plan with two slots) on random rows:

# %%
sweep = expert_bytes_by_batch(mx_cfg, batches=(1, 2, 4, 8))
# the figure `make figures` writes as figures/expert_bytes.png, of this sweep: the uniform-routing
# estimate is the pale band the measured line runs along
fig = plots.expert_bytes_figure(sweep, mx_cfg)
widgets.show_figure(fig)  # described: an HTML export gives the picture its title

# %%
# NBVAL_CHECK_OUTPUT
# Checks · every batch's expert bytes are its distinct experts, whole
one_mx = weights.expert_nbytes(mx_cfg)
print(widgets.format_table([{"B": r["batch"], "choices": r["choices"], "distinct": r["unique"],
                             "expert bytes": r["expert_bytes"]} for r in sweep],
                           ["B", "choices", "distinct", "expert bytes"]))
for r in sweep:
    assert r["expert_bytes"] == r["unique"] * one_mx
assert sweep[-1]["unique"] < sweep[-1]["choices"]
assert not label_problems(fig)  # no label runs into another, none is cut

# %% [markdown]
# At full size the same curve is E·(1 − (1 − k/E)^B) experts of 17.55 MB: 16 at B = 1, ≈ 120 at
# B = 8 — still only 13% of the layer's 896.
#
# ## The whole layer, and compiling for TPU7x at full per-rank shapes
#
# `experts.moe_ffn` is one kernel for the MoE layer: the router body leaves ids and weights in
# VMEM and SMEM scratch, the stage body reads them there, and the shared experts run as an
# always-on MLP in the same stage (the dense layer 0 is that stage with no routed part). At one
# rank of the released layout (docs/kimi-k3.md §9: 112 local experts, a 768-wide slice of the
# expert hidden, 256 of the shared hidden, MXFP4 experts, B = 8) the layer compiles for TPU7x with
# the real Mosaic compiler: tiling, layouts and the 64 MiB VMEM budget all checked. Your step 5
# compiles too, at the mini shapes: nothing in it works only in interpret mode.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · moe_ffn (router + experts + shared, one kernel) against the reference; your step 5 and
# the per-rank layer compile for TPU7x
got = np.asarray(experts.moe_ffn(mx_p, x, mx_cfg), np.float32)
ref_m = np.asarray(reference.moe_ffn(mx_p, x, mx_cfg), np.float32)
err = float(np.max(np.abs(got - ref_m)) / np.max(np.abs(ref_m)))
assert err <= TOL
print(f"moe_ffn vs reference.moe_ffn: {facts.bound(err, TOL, name='max rel err')}")
rank = config.get_config("kimi-k3-rank")  # one rank of the release layout (docs/kimi-k3.md §9)
rank_layer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype),
                          weights.param_shapes(rank)["moe"])
e1 = rank_layer["experts"]["w1"]
print(f"{rank.name}: {rank.n_experts} experts, w1 codes {tuple(e1['codes'].shape)} "
      f"{e1['codes'].dtype}, scales {tuple(e1['scales'].shape)} {e1['scales'].dtype}")
compiled = None
if tpu.can_compile():
    step5_args = (latent_in(mx_p, x), mx_ids, mx_w, mx_p["experts"])
    mine = tpu.compile_for(quantised_ring, *jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), step5_args), chip="tpu7x")
    assert mine.n_mosaic_kernels == 1
    print(f"your step 5 (MXFP4 through a 2-slot ring), mini shapes: {mine.n_mosaic_kernels} Mosaic "
          f"kernel compiled for {mine.chip}")
    x_rank = jax.ShapeDtypeStruct((8, rank.d_model), jnp.bfloat16)
    compiled = tpu.compile_for(lambda p, x: experts.moe_ffn(p, x, rank), rank_layer, x_rank,
                               chip="tpu7x")
    print(f"one expert slice = {weights.expert_nbytes(rank):,} B; "
          f"{compiled.n_mosaic_kernels} Mosaic kernel compiled for {compiled.chip}")
    assert compiled.n_mosaic_kernels == 1
else:  # a CPU runtime without libtpu (Colab's)
    print(f"not compiled: {tpu.NO_LIBTPU}")

# %%
# compile time and sizes from this machine's libtpu; "buffers" are the call's HBM arguments and
# result, mostly the rank's 112 experts of 4.39 MB each
print(compiled or "not compiled (no libtpu)")
