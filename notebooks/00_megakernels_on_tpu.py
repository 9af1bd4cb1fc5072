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
# # 00 · Megakernels on TPU: what one decode step of Kimi K3 costs
#
# Start here. This notebook opens with the map of every notebook (what each teaches, what you
# write in it) and the glossary of the terms they use; then it asks the question they all come
# back to: what does one **decode step** (one new token for every sequence of the batch) of a
# giant Mixture-of-Experts model cost on a TPU, and where does the time go?

# %% [markdown]
# ## The notebooks
#
# The stage notebooks (01–06, 08) have you write each piece of the megakernel as a small Pallas
# kernel, check it against the plain-JAX reference, then show the package's kernel; the others
# run the package's pieces at full size, on other models, on checkpoints and in serving. The map
# is `docs/notebooks.md`, installed with the package, so Colab shows it too.

# %%
from mkresearch.views import guide

guide.map_view()

# %% [markdown]
# ## The glossary
#
# Every term the notebooks use is defined once, in `docs/glossary.md` (installed with the
# package too): open it below. Each later notebook shows, near its top, the entries of the terms
# it uses; `guide.glossary_view("KDA", "MLA")` shows any of them.

# %%
guide.glossary_view(folded=True)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the map names every notebook once, in order; every glossary entry has a definition
entries = guide.notebook_map()
numbers = [entry.number for entry in entries]
print(f"the map: notebooks {numbers[0]} to {numbers[-1]}, each once, in order: "
      f"{numbers == [f'{i:02d}' for i in range(len(entries))]}")
print(f"every glossary entry defines its term: {all(e.text for e in guide.glossary())}")
assert numbers == [f"{i:02d}" for i in range(len(entries))]
assert all(entry.text for entry in guide.glossary())

# %% [markdown]
# Decoding one token of a giant Mixture-of-Experts model does very little arithmetic per byte:
# every weight the step uses is read from **HBM** (the chip's large high-bandwidth memory) once
# and multiplied by one vector per sequence. So the time of a step is bounded below by **bytes
# moved / HBM bandwidth** (the *HBM floor*, or roofline), and everything this project builds —
# stage kernels, the DMA pipeline, the megakernel — is judged by how close it gets to that floor.
#
# This notebook computes the floor for **Kimi K3** from the package itself: the byte counts come
# from `mkresearch.model.weights.param_shapes` (shapes only, no allocation), the chip figures
# from `mkresearch.hardware.chips`. Nothing below needs a TPU.
#
# ## 1 · Kimi K3
#
# 93 layers. Each has an attention sublayer — **KDA** (Kimi Delta Attention: linear attention
# with a fixed-size recurrent state per head) in most layers, **MLA** (multi-head latent
# attention, with a cache of every past token) in every fourth — and an FFN sublayer: a dense one
# in the first layer, then a **Mixture-of-Experts**: a router picks 16 of 896 *routed experts*
# per token, next to *shared experts* every token uses. The routed experts are stored in
# **MXFP4** (4-bit floats with one 8-bit scale per 32 values).

# %%
import matplotlib.pyplot as plt

from mkresearch.hardware.chips import CHIPS
from mkresearch.model import roofline
from mkresearch.model.config import get_config, layer_pattern
from mkresearch.model.weights import param_shapes
from mkresearch.views.label_plots import label_problems
from mkresearch.views.widgets import TableView, show_figure

cfg = get_config("kimi-k3")
total_params, active_params = roofline.parameter_counts(cfg)
print(f"{cfg.name}: d={cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab_size}")
print(f"KDA layers: {len(cfg.kda_layers)}, MLA layers: {len(cfg.mla_layers)} "
      f"(every {cfg.mla_every}th from {cfg.mla_first}, plus {cfg.n_layers - 1})")
print("pattern (K = KDA, M = MLA; attention-residual blocks of 12):")
print(" ", layer_pattern(cfg))
print(f"routed experts: {cfg.n_experts}, top-{cfg.top_k}, in {cfg.expert_format}")
print(f"parameters: total {total_params / 1e12:.2f} T, active per token {active_params / 1e9:.1f} B")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the layer counts and the parameters against the published 2.78 T total, 104 B active
print(f"{cfg.n_layers} layers = {len(cfg.kda_layers)} KDA + {len(cfg.mla_layers)} MLA; "
      f"{cfg.n_experts} routed experts, top-{cfg.top_k}, {cfg.expert_format}")
print(f"parameters: total {total_params / 1e12:.2f} T, active per token {active_params / 1e9:.1f} B")
assert len(cfg.kda_layers) + len(cfg.mla_layers) == cfg.n_layers
assert abs(total_params / 2.78e12 - 1) < 0.01 and abs(active_params / 104e9 - 1) < 0.01

# %% [markdown]
# ## 2 · What one decode step reads from HBM
#
# At batch 1 and an empty context, by component (`roofline.step_bytes`). Routed experts: 16 of
# 896 per MoE layer, in MXFP4 as in the checkpoint. KDA keeps a recurrent state per sequence
# (a 128×128 f32 matrix per head per layer) that is read *and* written every step.

# %%
step = roofline.step_bytes(cfg, batch=1, context=0)
rows = [(label, step.read[name] / 1e9, step.written.get(name, 0) / 1e9)
        for name, label in step.components.items()]
TableView([{"component": label, "read GB": read_gb, "written GB": written_gb}
           for label, read_gb, written_gb in rows]
          + [{"component": "total", "read GB": step.total_read / 1e9,
              "written GB": step.total_written / 1e9}],
          ["component", "read GB", "written GB"], digits=2)

# %%
fig, ax = plt.subplots(figsize=(8, 3.5))
labels = [label for label, _, _ in rows]
ax.barh(labels, [r + w for _, r, w in rows], color="tab:blue")
ax.invert_yaxis()
ax.set_xlabel("GB per decode step (batch 1, read + written)")
ax.set_title("Kimi K3: HBM bytes of one decode step by component")
for i, (_, r, w) in enumerate(rows):
    ax.text(r + w + 0.5, i, f"{r + w:.2f}", va="center", fontsize=8)
ax.set_xlim(right=max(r + w for _, r, w in rows) * 1.12)  # room for the longest bar's value
fig.tight_layout()
bytes_figure = fig
show_figure(fig)  # described: an HTML export gives the picture its title

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the step's bytes against docs/kimi-k3.md §10; the chart's labels read
print(f"weights alone: {step.weights / 1e9:.1f} GB; read + written: {step.total / 1e9:.1f} GB")
released = roofline.step_bytes(cfg, expert_format="released")
print(f"with the released FP8 gate/up repack: {released.weights / 1e9:.1f} GB of weights")
assert abs(step.total / 137e9 - 1) < 0.01  # docs/kimi-k3.md §10: ≈ 137 GB per token
assert abs(released.weights / 152.4e9 - 1) < 0.01  # docs/kimi-k3.md §10: ≈ 152.4 GB with the repack
assert not label_problems(bytes_figure)  # no label runs into another, none is cut

# %% [markdown]
# Attention weights (KDA, 69 layers) are nearly half the step; the non-routed MoE part (router,
# latent projections and shared experts, read for every token) outweighs the 16 routed experts.
#
# ## 3 · The MLA cache: expanded or latent
#
# MLA can cache K expanded per head (what the released kernels do: 96 heads × (256 padded K + 128
# V) × 24 layers) or cache the 512-wide latent ĉ plus the shared 64-wide k^X and absorb W_kvb
# (the matrix that expands the latent into each head's K and V) into the query and output. Both
# give the same attention output (tested in `tests/`); the bytes per token of *context* (tokens
# already cached) differ:

# %%
per_token = {layout: roofline.mla_cache_bytes_per_token(cfg, layout) for layout in ("expanded", "latent")}
TableView([{"context": context,
            **{f"{layout} GB": roofline.step_bytes(cfg, 1, context, mla_cache_layout=layout)
               .read["mla_cache"] / 1e9 for layout in per_token}}
           for context in (1024, 8192, 32768)], ["context", "expanded GB", "latent GB"])

# %%
# NBVAL_CHECK_OUTPUT
# Checks · bytes per context token of each layout: the latent cache is 64x smaller
print(f"MLA cache per context token: expanded {per_token['expanded']:,} B, latent "
      f"{per_token['latent']:,} B -> {per_token['expanded'] // per_token['latent']}x fewer")
assert per_token == {"expanded": 1_769_472, "latent": 27_648}
assert per_token["expanded"] == 64 * per_token["latent"]

# %% [markdown]
# At a 32k context the expanded cache alone is 58 GB per sequence per step — 42% of all the
# weights; the latent cache makes it 0.9 GB.
#
# ## 4 · Batching: weights are shared, experts and state are not
#
# With B sequences the dense weights are read once for all of them, but more distinct experts get
# selected: under uniform routing a MoE layer reads E·(1 − (1 − k/E)^B) experts, and every
# sequence brings its own KDA state and MLA cache.

# %%
batched = {batch: roofline.step_bytes(cfg, batch, context=512) for batch in (1, 8, 64, 256)}
TableView([{"batch": batch, "experts/layer": s.unique_experts_per_layer, "GB/step": s.total / 1e9,
            "GB/token": s.total / 1e9 / batch} for batch, s in batched.items()],
          ["batch", "experts/layer", "GB/step", "GB/token"])

# %%
# NBVAL_CHECK_OUTPUT
# Checks · at B = 256 almost every expert is read; bytes per token fall with the batch
per_token_gb = [s.total / 1e9 / batch for batch, s in batched.items()]
print(f"experts read per MoE layer at B = 256: "
      f"{batched[256].unique_experts_per_layer:.0f} of {cfg.n_experts}")
print(f"GB per token falls with every batch: {per_token_gb == sorted(per_token_gb, reverse=True)}")
assert batched[256].unique_experts_per_layer > 0.98 * cfg.n_experts
assert per_token_gb == sorted(per_token_gb, reverse=True)

# %% [markdown]
# ## 5 · The roofline for B = 1 … 256
#
# Floor = (bytes read + written) / HBM bandwidth. The model needs many chips (1.5 TB of weights);
# here on 16 chips, as in the published deployment, with the bytes split evenly — an ideal that
# ignores replication — at a context of 512 tokens (about the mean of the published 1-in /
# 1000-out benchmark). Chip bandwidths come from `pltpu.get_tpu_info_for_chip` where it answers,
# else from docs/tpu.md (`mkresearch.hardware.chips` records which).

# %%
N_CHIPS, CONTEXT = roofline.ROOFLINE_N_CHIPS, roofline.ROOFLINE_CONTEXT
table = roofline.roofline_table(cfg, context=CONTEXT, n_chips=N_CHIPS)
fig, ax = plt.subplots(figsize=(7, 4))
for chip in roofline.ROOFLINE_CHIPS:
    chip_rows = [r for r in table if r["chip"] == chip]
    ax.plot([r["batch"] for r in chip_rows], [r["tokens_per_s"] for r in chip_rows], marker="o",
            label=f"{N_CHIPS}× {chip} floor")
ax.plot(*zip(*sorted(roofline.PUBLISHED_TPU7X_16_CHIPS.items())), "k*", markersize=10,
        label="published, 16× TPU7x")
ax.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="tokens/s (aggregate)",
       title=f"Kimi K3 decode floor, {N_CHIPS} chips, context {CONTEXT}")
batches = sorted({r["batch"] for r in table})
ax.set_xticks(batches, [str(b) for b in batches])  # 1, 2, 4 … 256, not 10^0, 10^1, 10^2
ax.minorticks_off()
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
roofline_figure = fig
show_figure(fig)  # described: an HTML export gives the picture its title

# %%
TableView([{"batch": batch, **{chip: next(r["tokens_per_s"] for r in table
                                          if r["chip"] == chip and r["batch"] == batch)
                               for chip in roofline.ROOFLINE_CHIPS}}
           for batch in (1, 8, 64, 256)], ["batch", *roofline.ROOFLINE_CHIPS])

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the published steps against this floor; which chips hold the weights; the chart reads
print(f"floor tokens/s on {N_CHIPS} chips (3 significant digits):")
print(f"{'batch':>5s}" + "".join(f"{chip:>9s}" for chip in roofline.ROOFLINE_CHIPS))
for batch in (1, 8, 64, 256):
    rates = {r["chip"]: r["tokens_per_s"] for r in table if r["batch"] == batch}
    print(f"{batch:5d}" + "".join(f"{float(f'{rates[c]:.3g}'):9g}" for c in roofline.ROOFLINE_CHIPS))
print("published 16x TPU7x as a fraction of its floor:")
for batch, published in roofline.PUBLISHED_TPU7X_16_CHIPS.items():
    floor = next(r for r in table if r["chip"] == "tpu7x" and r["batch"] == batch)
    print(f"  batch {batch}: {published} of {floor['tokens_per_s']:.0f} tok/s floor = "
          f"{published / floor['tokens_per_s']:.0%}")
weight_bytes = roofline.tree_bytes(param_shapes(cfg))
print(f"do {N_CHIPS} chips hold the {weight_bytes / 1e12:.2f} TB of weights?")
for chip in roofline.ROOFLINE_CHIPS:
    chip_hbm = CHIPS[chip].hbm_bytes * CHIPS[chip].tensorcores_per_chip // CHIPS[chip].tensorcores_per_device
    print(f"  {chip:6s} {N_CHIPS} x {chip_hbm / 1e9:.0f} GB: {'yes' if N_CHIPS * chip_hbm > weight_bytes else 'no'}")
assert all(r["memory_bound"] for r in table)
assert all(published < next(r["tokens_per_s"] for r in table if r["chip"] == "tpu7x" and r["batch"] == b)
           for b, published in roofline.PUBLISHED_TPU7X_16_CHIPS.items())
assert not label_problems(roofline_figure)  # no label runs into another, none is cut

# %% [markdown]
# 16 v5e or v6e chips cannot even hold the weights: their rows compare bandwidth only.
# Even on TPU7x the published numbers reach about 30% of this even-split floor: the weights are
# not split evenly (next section), and a step is more than its weight reads.
#
# ## 6 · Why kernel launches and pipeline bubbles dominate decode
#
# The published TPU7x release runs Kimi K3 at 249 tok/s at batch 1: **4.0 ms per step**. Each of
# its 32 *ranks* (16 chips × 2 TensorCores, each its own JAX device) reads ≈ 6.97 GB of weights
# per step (docs/kimi-k3.md §9; more than 1/32 of the total because attention, latent and shared
# weights are replicated or sliced), which at ≈ 3.69 TB/s per core is a **1.9 ms floor**. Half the
# step is not spent reading weights.
#
# Where does it go? A conventional implementation launches one kernel per operation. Count the
# operations of one step (an assumption, spelled out below) and price each **kernel launch** at
# the ≈ 1.3 µs a dummy launch costs on a GPU even with CUDA graphs; every kernel also starts with
# an empty DMA pipeline — its first weight tile arrives before any compute overlaps it (a 2 MiB
# tile at 3.69 TB/s is ≈ 0.57 µs): a *bubble*, time in which nothing computes.

# %%
# Operations per layer of an unfused decode step (one kernel each): an explicit assumption.
KERNELS_PER_LAYER = {
    "KDA attention": ["mix", "rms_norm", "q/k/v/g/b/gate projections", "short conv",
                      "delta-rule state update", "output norm × gate", "output projection"],
    "MLA attention": ["mix", "rms_norm", "q down + norm", "q up", "kv down + norm", "kv up",
                      "attention", "output gate", "output projection"],
    "dense FFN": ["mix", "rms_norm", "gate/up", "down"],
    "MoE FFN": ["mix", "rms_norm", "router", "top-k", "latent down", "expert GEMMs", "combine",
                "latent norm", "latent up", "shared gate/up", "shared down", "add"],
    "head": ["mix", "rms_norm", "LM head", "sample"],
}
layer_count = {"KDA attention": len(cfg.kda_layers), "MLA attention": len(cfg.mla_layers),
               "dense FFN": len(cfg.dense_layers), "MoE FFN": len(cfg.moe_layers), "head": 1}
launches = sum(len(ops) * layer_count[kind] for kind, ops in KERNELS_PER_LAYER.items())

LAUNCH_SECONDS = 1.3e-6  # docs/tpu.md: a dummy kernel launch with CUDA graphs
PUBLISHED_STEP_SECONDS = 1 / 249  # docs/tpu.md: TPU7x, batch 1
RANK_WEIGHT_BYTES = 6.97e9  # docs/kimi-k3.md §9: weights one rank reads per step at batch 1
core_bandwidth = CHIPS["tpu7x"].hbm_bandwidth  # per TensorCore (one JAX device)
rank_floor = RANK_WEIGHT_BYTES / core_bandwidth
first_tile_bubble = 2 * 2**20 / core_bandwidth  # an un-overlapped 2 MiB weight tile per kernel
TableView([{"kind": kind, "layers": layer_count[kind], "kernels per layer": len(ops),
            "kernels": len(ops) * layer_count[kind]} for kind, ops in KERNELS_PER_LAYER.items()],
          ["kind", "layers", "kernels per layer", "kernels"])

# %%
# NBVAL_CHECK_OUTPUT
# Checks · launches and first-tile bubbles against the HBM floor of one rank
print(f"kernels per step if unfused: {launches}")
print(f"  launch overhead: {launches} x 1.3 us = {launches * LAUNCH_SECONDS * 1e3:.2f} ms")
print(f"  first-tile bubbles: {launches} x {first_tile_bubble * 1e6:.2f} us = "
      f"{launches * first_tile_bubble * 1e3:.2f} ms")
print(f"HBM floor per rank: {RANK_WEIGHT_BYTES / 1e9:.2f} GB / {core_bandwidth / 1e12:.2f} TB/s = "
      f"{rank_floor * 1e3:.2f} ms")
print(f"published step: {PUBLISHED_STEP_SECONDS * 1e3:.2f} ms = "
      f"{rank_floor / PUBLISHED_STEP_SECONDS:.0%} of the HBM roofline")
assert 1.8e-3 < rank_floor < 2.0e-3 and 3.9e-3 < PUBLISHED_STEP_SECONDS < 4.1e-3
assert launches * LAUNCH_SECONDS > rank_floor  # launches alone would exceed the weight time

# %% [markdown]
# About 1,800 kernels would cost ≈ 2.4 ms in launches alone — more than the 1.9 ms of weight
# reads — plus ≈ 1 ms of first-tile bubbles. That is why the release fuses the step into one
# persistent kernel per rank (a *megakernel*: one Pallas `pallas_call`): one launch, weight DMAs
# for the next operation issued while the current one computes, expert DMAs started right after
# routing. What is left of the 4.0 ms (the 816B model of the same release: ≈ 55 µs per layer +
# 195 µs fixed, 61% of its roofline) is synchronisation, cross-chip traffic and the bubbles that
# remain at operation boundaries — the subject of notebooks 01, 06 and 09.
#
# ## Map of the package
#
# | module | what it is |
# |---|---|
# | `mkresearch.model.config` | `ModelConfig` and the presets `kimi-k3`, `kimi-k3-mini` (and the other families') |
# | `mkresearch.sharding.layout` | weights, caches and states over N ranks; `kimi-k3-rank` is one of 32 |
# | `mkresearch.model.weights` | parameter shapes, deterministic weights, MXFP4 / FP8 formats |
# | `mkresearch.model.reference` | the decode step in plain JAX: the oracle every kernel is tested against |
# | `mkresearch.model.sampling` | the sampling reference (counter-based random numbers a kernel can reproduce) |
# | `mkresearch.decoding.speculative` | speculative decoding's reference: verify, rollback, acceptance, drafters |
# | `mkresearch.hardware.chips`, `mkresearch.hardware.tpu` | chip figures; compile for a TPU on CPU, interpret mode elsewhere |
# | `mkresearch.model.roofline` | the byte counts and floors of this notebook |
# | `mkresearch.kernels` | Pallas TPU kernels: the DMA recorder, the stages, the megakernel (and its verify step) |
# | `mkresearch.views.guide` | the map of the notebooks and the glossary shown above |
# | `mkresearch.cli.main` | `mkresearch info / decode / figures` |

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the modules of the table are present
core_modules = ["mkresearch.model.config", "mkresearch.model.weights", "mkresearch.model.reference",
                "mkresearch.model.sampling", "mkresearch.hardware.chips", "mkresearch.hardware.tpu", "mkresearch.model.roofline",
                "mkresearch.kernels", "mkresearch.kernels.base.dma", "mkresearch.views.guide",
                "mkresearch.cli.main"]
missing = [name for name in core_modules if importlib.util.find_spec(name) is None]
print("package modules present:", "all" if not missing else f"missing {missing}")
assert not missing
