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
# # 04 · The routed-expert GEMM: read exactly the experts you use
#
# A Kimi K3 MoE layer (spec §6) after routing:
#
# $$z = \mathrm{bf}(x W_{ld}),\quad
#   y_e = \mathrm{bf}\big(\mathrm{SiTU}(\mathrm{bf}(z W1_e), \mathrm{bf}(z W3_e))\, W2_e\big),\quad
#   \rho = \mathrm{bf}\Big(\sum_e w_e\, y_e\Big),\quad
#   m = \mathrm{bf}\big(\mathrm{RMSNorm}(\rho) W_{lu} + \text{shared}(x)\big)$$
#
# At decode batch sizes every expert weight byte is used for a handful of rows, so the layer costs
# its **bytes**, and the expert weights are most of them. This notebook builds the stage kernel
# (`mkresearch.kernels.stages.experts`) in five steps, each a static option of the same body and each
# checked against `mkresearch.model.reference.routed_experts`, with the bytes read counted from the
# kernel's own DMA log:
#
# 1. a gather of **all** experts; 2. DMA of the **routed** experts only; 3. **dedupe** across
# rows; 4. a **slot ring** so the next expert streams while the current one computes;
# 5. **quantised** weights (FP8, MXFP4) decoded in VMEM.
#
# Then the bytes per layer against batch size, and a compile for TPU7x at the full model's
# per-rank shapes.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from mkresearch.kernels.base import dma, quant
from mkresearch.kernels.stages import experts, router

from mkresearch.measurement.logs import expert_bytes_by_batch
from mkresearch.model import config, reference, roofline, weights
from mkresearch.prediction import timeline
from mkresearch.sharding import layout
from mkresearch.views import facts, plots
from mkresearch.views.label_plots import label_problems
from mkresearch.views.widgets import show_figure

cfg = config.get_config("kimi-k3-mini", expert_format="bf16")
params = weights.init_params(cfg, seed=0)
layer = 1  # the first MoE layer
p = reference.layer_params(params["moe"], cfg.ffn_index(layer))
# three rows, the first and last the same token: a batch where rows share every expert
tokens = np.array([11, 1500, 11])
x = reference.rms_norm(params["embed"][tokens], params["mlp_norm"][layer], cfg.rms_eps)
ids, w = router.route(p, x, cfg)  # the router kernel of notebook 03
want = np.asarray(reference.routed_experts(p, x, ids, w, cfg))
one_expert = weights.expert_nbytes(cfg)

# %%
# NBVAL_CHECK_OUTPUT
print(f"{cfg.name}: {cfg.n_experts} experts of [{cfg.moe_latent} -> {cfg.expert_hidden} -> "
      f"{cfg.moe_latent}], top-{cfg.top_k}; one expert = {one_expert:,} B in {cfg.expert_format}")
print("routing of the batch:", np.asarray(ids).tolist())
print(f"{x.shape[0] * cfg.top_k} choices, {len(np.unique(np.asarray(ids)))} distinct experts")

# %% [markdown]
# A helper runs one variant under `dma.recording()` and checks it against the reference. The
# tolerance is bf16's: a few ulps of the output's largest entry (2⁻⁷ of it); in practice these
# kernels match the reference bit for bit, because they round where the reference rounds.

# %%
TOL = 2**-7
results = []


def run_step(label, plan, n_slots, p=p, cfg=cfg, x=x, ids=ids, w=w, want=want):
    with dma.recording() as log:
        out = experts.routed_experts(p, x, ids, w, cfg, plan=plan, n_slots=n_slots)
    err = float(np.max(np.abs(np.asarray(out) - want)) / np.max(np.abs(want)))
    assert err <= TOL, (label, err)
    first_part = f"{experts.EXPERT_DMA_PREFIX}w1/{quant.part_names(cfg.expert_format)[0]}"
    loads = len(log.select("dma_start", first_part))  # one per expert load
    nbytes = log.dma_bytes(experts.EXPERT_DMA_PREFIX)
    assert nbytes == loads * weights.expert_nbytes(cfg)  # every expert load is whole, to the byte
    results.append((label, cfg.expert_format, loads, nbytes, err))
    return log


def show(rows):
    # the error's digits depend on the machine's summation order; the bound met does not
    print(f"{'step':28s} {'format':6s} {'expert loads':>12s} {'expert bytes':>13s} "
          f"{'rel err <= ' + format(TOL, 'g'):>15s}")
    for label, fmt, loads, nbytes, err in rows:
        print(f"{label:28s} {fmt:6s} {loads:12d} {nbytes:13,d} {'PASS' if err <= TOL else 'FAIL':>15s}")


# %% [markdown]
# ## Step 1 — gather all experts
#
# The simplest correct kernel: DMA every expert of the layer, run each on all rows, and weight it
# by its routing weight (zero for rows that did not pick it). Correct, and it reads the whole layer.

# %%
# NBVAL_CHECK_OUTPUT
log_all = run_step("1 all experts", "all", 1)
show(results[-1:])
assert results[-1][2] == cfg.n_experts

# %% [markdown]
# ## Step 2 — only the routed experts
#
# The ids sit in SMEM; the kernel reads them as scalars and DMAs `W[e]` for each (row, k) choice:
# B·k loads. Fewer than all, but a row pair that shares an expert loads it twice.

# %%
# NBVAL_CHECK_OUTPUT
run_step("2 routed (row, k) choices", "routed", 1)
show(results[-1:])
assert results[-1][2] == x.shape[0] * cfg.top_k

# %% [markdown]
# ## Step 3 — dedupe across rows
#
# Before any DMA the kernel marks the B·k ids in a "seen" table in SMEM and lists the distinct
# experts in ascending id (scalar work, a few hundred cycles). Each is loaded once and applied to
# every row with that row's summed weight for it — a vector compare of the `[B, k]` ids tile
# against the expert id. Ascending, not first-use, order: every row then adds its experts in id
# order whatever the other rows chose, so a row's ρ does not depend on the batch — and it is the
# reference's order, so the f32 sums round the same way.

# %%
# NBVAL_CHECK_OUTPUT
log_one_slot = run_step("3 unique experts", "unique", 1)
show(results[-1:])
assert results[-1][2] == len(np.unique(np.asarray(ids)))

# %% [markdown]
# ## Step 4 — a ring of expert slots, with overlap
#
# With one slot the kernel copies, waits, computes, copies, … and the MXU idles during every DMA.
# With two (or more) slots per matrix, expert i+1's weights stream into the other slot while
# expert i computes; and the first expert's DMA is issued *before* the latent down-projection, so
# it flies behind that too. The DMA log shows the order of issue:

# %%
# NBVAL_CHECK_OUTPUT
log_ring = run_step("4 unique, 2-slot ring", "unique", 2)
show(results[-1:])
for e in log_ring.events[:14]:
    where = f"item {e.indices['item']} slot {e.slot}" if "item" in e.indices else ""
    print(f"  {e.kind:12s} {e.name:22s} {where}")
order = [(e.kind, e.name.split("/")[0], e.indices.get("item")) for e in log_ring.events]
assert order.index(("dma_start", "expert", 0)) < order.index(("dma_wait", "latent", None))
assert order.index(("dma_start", "expert", 1)) < order.index(("phase_start", "expert", 0))

# %% [markdown]
# What the overlap is worth is a question for a TPU; the timeline model of `mkresearch.prediction.timeline`
# replays the two logs on TPU7x figures (mini shapes, so DMA latency weighs more than it would at
# full size):

# %%
t1, t2 = timeline.simulate(log_one_slot, "tpu7x"), timeline.simulate(log_ring, "tpu7x")
print(f"modelled stage time, 2 slots / 1 slot: {t2.total_s / t1.total_s:.2f}; "
      f"2 slots reach {t2.hbm_floor_s / t2.total_s:.0%} of the HBM floor")

# %% [markdown]
# ## Step 5 — quantised experts, decoded in VMEM
#
# The checkpoint stores experts in MXFP4: 4-bit E2M1 codes, 8 per uint32, plus one E8M0 scale per
# 32 K values. The kernel DMAs codes and scales as they are and decodes them in VMEM, chunk by
# chunk along K, right before the MXU dot (`mkresearch.kernels.base.quant`): a `pltpu.bitcast` of the
# uint32 codes to `float4_e2m1fn` unpacks 8 consecutive K rows per word — the checkpoint's own
# packing — and the scale is built from its exponent bits. FP8 (e4m3 values, a power-of-two bf16
# scale per 256 K values) works the same way. First: the decode alone is exact.

# %%
quantised = {}
for fmt in ("fp8", "mxfp4"):
    qcfg = cfg.replace(expert_format=fmt)
    qp = reference.layer_params(weights.init_params(qcfg, seed=0)["moe"], cfg.ffn_index(layer))
    quantised[fmt] = (qcfg, qp)

# %%
# NBVAL_CHECK_OUTPUT
for fmt, (qcfg, qp) in quantised.items():
    stored = jax.tree.map(lambda a: a[0], qp["experts"]["w1"])  # expert 0's W1, as stored
    decoded = np.asarray(quant.decode(stored, fmt), np.float32)
    np.testing.assert_array_equal(decoded, np.asarray(weights.dequantize(stored, fmt), np.float32))
    parts = ", ".join(f"{n} {tuple(a.shape)} {a.dtype}" for n, a in zip(
        quant.part_names(fmt), quant.split_parts(stored, fmt)))
    print(f"PASS {fmt:5s} decoded in VMEM == reference unpack, exactly; stored as {parts}")

# %%
# NBVAL_CHECK_OUTPUT
for fmt, (qcfg, qp) in quantised.items():
    q_ids, q_w = router.route(qp, x, qcfg)
    q_want = np.asarray(reference.routed_experts(qp, x, q_ids, q_w, qcfg))
    run_step("5 unique, 2 slots, quantised", "unique", 2, p=qp, cfg=qcfg, ids=q_ids, w=q_w,
             want=q_want)
show(results)

# %% [markdown]
# ### Bytes of one expert at full size
#
# At Kimi K3's shapes (W1, W3: 3584 × 3072, W2: 3072 × 3584) the formats cost, per expert:

# %%
# NBVAL_CHECK_OUTPUT
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
# plan "unique" with two slots) on random rows:

# %%
mxfp4_cfg = quantised["mxfp4"][0]
sweep = expert_bytes_by_batch(mxfp4_cfg, batches=(1, 2, 4, 8))

# %%
# NBVAL_CHECK_OUTPUT
one_mx = weights.expert_nbytes(mxfp4_cfg)
print(f"{'B':>3s} {'choices':>8s} {'unique':>7s} {'expert bytes':>13s} {'= unique x expert':>18s}")
for r in sweep:
    print(f"{r['batch']:3d} {r['choices']:8d} {r['unique']:7d} {r['expert_bytes']:13,d} "
          f"{str(r['expert_bytes'] == r['unique'] * one_mx):>18s}")
    assert r["expert_bytes"] == r["unique"] * one_mx
assert sweep[-1]["unique"] < sweep[-1]["choices"]

# %%
# the figure `make figures` writes as figures/expert_bytes.png, of this sweep: the uniform-routing
# estimate is the pale band the measured line runs along
fig = plots.expert_bytes_figure(sweep, mxfp4_cfg)
assert not label_problems(fig)  # no label runs into another, none is cut
show_figure(fig)  # described: an HTML export gives the picture its title

# %% [markdown]
# At full size the same curve is E·(1 − (1 − k/E)^B) experts of 17.55 MB: 16 at B = 1, ≈ 120 at
# B = 8 — still only 13% of the layer's 896.
#
# ## The whole layer, and compiling for TPU7x at full per-rank shapes
#
# `experts.moe_ffn` is one kernel for the MoE layer: the router body leaves ids and weights in
# VMEM and SMEM scratch, the stage body reads them there, and the shared experts run as an
# always-on MLP in the same stage (the dense layer 0 is that stage with no routed part). On the
# mini model it matches `reference.moe_ffn`:

# %%
# NBVAL_CHECK_OUTPUT
qcfg, qp = quantised["mxfp4"]
got = np.asarray(experts.moe_ffn(qp, x, qcfg), np.float32)
ref_m = np.asarray(reference.moe_ffn(qp, x, qcfg), np.float32)
err = float(np.max(np.abs(got - ref_m)) / np.max(np.abs(ref_m)))
assert err <= TOL
print(f"moe_ffn (router + experts + shared, one kernel) vs reference: "
      f"{facts.bound(err, TOL, name='max rel err')}")

# %% [markdown]
# At one rank of the released layout (spec §9: 112 local experts, a 768-wide slice of the
# expert hidden, 256 of the shared hidden, MXFP4 experts, B = 8) the layer compiles for TPU7x with
# the real Mosaic compiler — tiling, layouts and the 64 MiB VMEM budget all checked:

# %%
# NBVAL_CHECK_OUTPUT
rank = layout.named_config("kimi-k3-rank")  # one rank of the release layout (spec §9)
rank_layer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype),
                          weights.param_shapes(rank)["moe"])
x_rank = jax.ShapeDtypeStruct((8, rank.d_model), jnp.bfloat16)
compiled = tpu.compile_for(lambda p, x: experts.moe_ffn(p, x, rank), rank_layer, x_rank,
                           chip="tpu7x")
e1 = rank_layer["experts"]["w1"]
print(f"{rank.name}: {rank.n_experts} experts, w1 codes {tuple(e1['codes'].shape)} "
      f"{e1['codes'].dtype}, scales {tuple(e1['scales'].shape)} {e1['scales'].dtype}")
print(f"one expert slice = {weights.expert_nbytes(rank):,} B; "
      f"{compiled.n_mosaic_kernels} Mosaic kernel compiled for {compiled.chip}")
assert compiled.n_mosaic_kernels == 1

# %%
print(compiled)  # compile time and buffer sizes of this machine's libtpu
