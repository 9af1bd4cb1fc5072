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
# # 10 · Other families: DeepSeek-V3, GLM-4.5 and Qwen3-235B beside Kimi K3
#
# The megakernel is composed from a registry of stage kinds (notebook 06, `DEVELOPERS.md`), so it
# decodes other giant MoE models too. Three public families (`docs/families.md`), each with a
# `-mini` preset that keeps every feature of its family at small shapes:
#
# * **DeepSeek-V3** (671 B): MLA with a decoupled RoPE key and YaRN, a latent cache of 512 + 64
#   values per token; 3 dense layers, then 256 routed experts (FP8) + 1 shared, group-limited
#   sigmoid routing;
# * **GLM-4.5** (355 B): GQA with 96 query heads over 8 K/V heads, q/k/v bias, QK-norm, partial
#   RoPE; 3 dense layers, then 160 experts + 1 shared;
# * **Qwen3-235B-A22B**: GQA with 64 query heads over 4 K/V heads, QK-norm; 128 experts, softmax
#   routing, no shared expert.
#
# All three use a classic pre-norm residual stream, where Kimi K3 mixes attention residuals. Side
# by side with Kimi K3: what one decode step reads from HBM and where, what a context token
# costs, the megakernel's timeline for each mini, and the modelled TPU7x step for each full model
# (sharded over 32 cores with its sharding rules). The terms this notebook uses, from the
# glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("GQA", "MLA", "RoPE, partial RoPE, YaRN", "RMSNorm, L2 norm, QK-norm",
                    "Pre-norm residual", "Dense FFN, MoE FFN", "Routed, shared experts",
                    "Group-limited routing", "FP8 e4m3", "Active parameters", "Context",
                    "Megakernel", "Pallas", "Mosaic", "Interpret mode", "DMA log", "Timeline",
                    "Modelled", "Bubble", "HBM floor", "Rank", "-rank", "EP × ETP",
                    "Exact mode, partial-sum mode", "Full-size step")

# %%
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel, megakernel_sharded
from tqdm import tqdm

from mkresearch.cli import bench
from mkresearch.measurement import hlo, logs, recorded
from mkresearch.model import reference, roofline, sampling, spec, weights
from mkresearch.model.config import get_config, layer_pattern
from mkresearch.prediction import scale_out, timeline
from mkresearch.prediction.full_size import full_size_step
from mkresearch.sharding import layout, layout_bytes
from mkresearch.views import widgets
from mkresearch.views.facts import bound
from mkresearch.views.label_plots import label_problems
from mkresearch.views.widgets import TableView, show_figure

FULL = ("kimi-k3", "deepseek-v3", "glm-4.5", "qwen3-235b-a22b")
MODELS = {name: get_config(name) for name in FULL}
FAMILIES = FULL[1:]  # Kimi K3 is here for reference: notebooks 06 and 07 run its mini
MINIS = {name: get_config(f"{name}-mini") for name in FAMILIES}
CONTEXT = 4096  # tokens already cached per sequence in the byte tables
LOGIT_TOL = 5e-2  # docs/kimi-k3.md §11
NEAR_TIE_GAP = 2 * LOGIT_TOL
BYTES_SLACK = 1.02
GB = 1e9

# %% [markdown]
# ## 1 · The four models
#
# Parameters counted from the weight shapes (`roofline.parameter_counts`: every weight but the
# multi-token-prediction modules; active = all but the embedding table and the routed experts a
# token does not choose). Publishers count "active" differently (`roofline.PARAMETER_RULES`, each
# rule checked on a sibling model's published figures): DeepSeek as here, GLM without the LM head,
# Qwen with the embedding table. Counted each publisher's way, every total is within 1 % of the
# published one and so are GLM's and Qwen's active counts; DeepSeek's 36.63 B is published rounded
# to whole billions as 37 B (1.01 % off).

# %%
def attention_of(cfg):
    if cfg.attention == "kda+mla":
        return f"KDA + MLA ({len(cfg.mla_layers)} MLA layers), {cfg.n_heads} heads"
    if cfg.attention == "gqa":
        return f"GQA {cfg.n_heads} heads / {cfg.n_kv_heads} K/V heads x {cfg.head_dim}"
    return f"MLA with RoPE, {cfg.n_heads} heads, latent {cfg.mla_kv_rank} + {cfg.mla_qk_extra}"


rows = []
for name, cfg in MODELS.items():
    total, active = roofline.parameter_counts(cfg)
    rows.append({"model": name, "layers": cfg.n_layers, "d": cfg.d_model,
                 "attention": attention_of(cfg),
                 "experts": f"{cfg.n_experts} top-{cfg.top_k} + {cfg.n_shared_experts} shared",
                 "format": cfg.expert_format, "total": f"{total:,d}", "active": f"{active:,d}"})
TableView(rows, list(rows[0]))

# %%
published_rows = []  # each publisher's counting rule
for name, rule in roofline.PARAMETER_RULES.items():
    if name not in MODELS:  # GPT-OSS: notebook 14
        continue
    total, active = roofline.published_counts(MODELS[name], rule)
    off = (total / rule.published[0] - 1, active / rule.published[1] - 1)
    published_rows.append({
        "model": name, "embedding / LM head in active": (
            f"{'in' if rule.embedding_active else 'out'} / {'in' if rule.lm_head_active else 'out'}"),
        "total (B)": f"{total / GB:.2f}", "published": f"{rule.published[0] / GB:.0f}",
        "active (B)": f"{active / GB:.2f}", "published ": f"{rule.published[1] / GB:.0f}",
        "within 1 %": "yes" if max(map(abs, off)) < 0.01 else "active rounds to it",
        "rule checked on": rule.checked_on, "off": off, "active": active})
TableView(published_rows, [c for c in published_rows[0] if c not in ("off", "active")],
          align="left")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · each model's layers and counts; each publisher's way within 1 % of its figures
print(widgets.format_table(rows, ["model", "layers", "d", "format", "total", "active"]))
assert abs(roofline.parameter_counts(MODELS["kimi-k3"])[0] / 2.78e12 - 1) < 0.01
for row in published_rows:
    rule = roofline.PARAMETER_RULES[row["model"]]
    rounds_to_it = round(row["active"] / GB) * GB == rule.published[1]  # DeepSeek: 36.63 B -> 37 B
    print(f"{row['model']}: counted its publisher's way, within 1 %: {row['within 1 %']}")
    assert abs(row["off"][0]) < 0.01 and (abs(row["off"][1]) < 0.01 or rounds_to_it), row["model"]

# %% [markdown]
# ## 2 · What one decode step reads, and where
#
# `roofline.step_bytes` at B = 1 with 4096 tokens of context, each model in its released expert
# format (Kimi K3 MXFP4, DeepSeek-V3 FP8, GLM-4.5 and Qwen3 bf16) and Kimi K3 with the expanded MLA
# cache its released kernels use. The routed experts are the expected unique ones (top_k at B = 1).
# Every number is shape arithmetic: exact on any machine.

# %%
def category(cfg, component):
    """A roofline component of cfg -> the bar chart's category."""
    for kind in spec.stages_of(cfg):
        if kind.component and kind.component[0] == component:
            if kind.role == spec.ATTENTION:
                return "attention weights"
            return "dense FFN" if kind.name == "dense" else "MoE non-routed"
        if kind.routed and kind.routed_component[0] == component:
            return "routed experts"
        if kind.state_component and kind.state_component[0] == component:
            return "KV cache + state"
    return "LM head" if component == "lm_head" else "embedding rows, norms"


CATEGORIES = ("attention weights", "dense FFN", "MoE non-routed", "routed experts", "LM head",
              "KV cache + state", "embedding rows, norms")
steps = {name: roofline.step_bytes(cfg, 1, CONTEXT) for name, cfg in MODELS.items()}
by_category = {name: dict.fromkeys(CATEGORIES, 0) for name in MODELS}
for name, step in steps.items():
    for component in step.components:
        by_category[name][category(MODELS[name], component)] += (
            step.read[component] + step.written.get(component, 0))
category_rows = [{"GB per step": label, **{name: by_category[name][label] / GB for name in MODELS}}
                 for label in CATEGORIES]
category_rows.append({"GB per step": "total", **{name: steps[name].total / GB for name in MODELS}})
TableView(category_rows, ["GB per step", *MODELS], digits=3)

# %%
fig, ax = plt.subplots(figsize=(9, 4.2), layout="constrained")
left = np.zeros(len(MODELS))
for label in CATEGORIES:
    values = np.array([by_category[name][label] / GB for name in MODELS])
    ax.barh(list(MODELS), values, left=left, label=label)
    left += values
ax.invert_yaxis()
ax.set(xlabel=f"GB read + written per decode step (B = 1, context {CONTEXT})",
       title="where one decode step's HBM traffic goes")
widgets.legend_outside(ax)
traffic_figure = fig
show_figure(fig)  # described: an HTML export gives the picture its title

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the categories add up to each step's bytes; the chart's labels read
print(widgets.format_table(category_rows[-1:], ["GB per step", *MODELS], digits=3))
for name, step in steps.items():
    assert sum(by_category[name].values()) == step.total
assert not label_problems(traffic_figure)  # no label runs into another, none is cut

# %% [markdown]
# At B = 1 a step reads every active weight once. The routed experts are the largest part of
# GLM-4.5's and Qwen3's step, the attention weights of DeepSeek-V3's (128 heads of MLA, bf16,
# against 8 FP8 experts) and of Kimi K3's (KDA's projections in 69 layers). DeepSeek-V3's step is
# smaller than GLM-4.5's although the model is twice as large: FP8 experts, a smaller KV cache.
# With more sequences per step (B) the routed experts grow (more unique experts) and so does the
# KV cache, the weights do not.

# %% [markdown]
# ## 3 · What a context token costs
#
# Each cached token is read once per step by every attention layer: GQA reads K and V of its K/V
# heads (2 × n_kv_heads × head_dim bf16 values per layer), DeepSeek's MLA the shared latent and
# rope key (512 + 64), Kimi K3's MLA layers (expanded: K and V of 96 heads) and no bytes at all for
# its KDA layers, which keep a recurrent state of fixed size instead. The last column is the
# context at which the cache reads equal the weight reads of a B = 1 step.

# %%
def cache_layers(cfg):
    """Layers whose attention kind keeps a KV cache (a state leaf with one entry per token)."""
    return sum(len(cfg.layers_of(kind.name)) for kind in spec.stages_of(cfg)
               if any(leaf.kind == spec.CACHE for leaf in kind.state(cfg, 1).values()))


token_rows = []
for name, cfg in MODELS.items():
    per_token = roofline.cache_bytes_per_token(cfg)
    token_rows.append({"model": name, "layers with a KV cache": cache_layers(cfg),
                       "B per token per layer": per_token // cache_layers(cfg),
                       "B per token": per_token,
                       "recurrent state B": roofline.recurrent_state_bytes(cfg),
                       "context where KV = weights": roofline.step_bytes(cfg, 1).weights // per_token})
TableView(token_rows, list(token_rows[0]))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the KV bytes per token per layer of each family (docs/families.md)
per_layer = {row["model"]: row["B per token per layer"] for row in token_rows}
print(f"bytes per context token per layer: {per_layer}")
assert per_layer["glm-4.5"] == 4096 and per_layer["qwen3-235b-a22b"] == 2048  # docs/families.md
assert per_layer["deepseek-v3"] == 1152

# %% [markdown]
# ## 4 · The megakernel on each mini
#
# One decode step of each family's `-mini` preset in ONE `pallas_call`, in TPU interpret mode
# here: from a random state (as if 20 tokens had been decoded) the step at position 20 runs
# through the megakernel with its DMA log recorded, and is checked against
# `reference.decode_step`. The same kernel is compiled for TPU7x from shapes (one Mosaic kernel).
# `tests/test_families_megakernel.py` runs 16 teacher-forced greedy steps of each at B = 1 and 4
# under the race detector. About a minute for the three (the bar counts them).

# %%
PROMPT_LEN = 20  # the step at position 20 reads the 20 cached tokens in two 16-row groups


def pallas_calls(cfg, batch=1):
    """pallas_call equations in one traced megakernel step (nested jaxprs included)."""
    plan = megakernel.make_plan(cfg, batch, cfg.max_seq_len)
    closed = jax.make_jaxpr(megakernel.step_fn(plan))(*megakernel.step_shapes(plan))
    return list(hlo.jaxpr_primitives(closed)).count("pallas_call")


def mini_step(cfg, seed=0):
    """One recorded megakernel step at position PROMPT_LEN (B = 1) against the reference, from a
    random state (caches and recurrent state as if PROMPT_LEN tokens had been decoded)."""
    params = weights.init_params(cfg, seed)
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.5, s.dtype),
                         jax.eval_shape(lambda: reference.init_state(cfg, 1)))
    tokens, positions = rng.integers(0, cfg.vocab_size, 1), np.full(1, PROMPT_LEN, np.int32)
    logits, _, ref_aux = reference.decode_step(params, state, tokens, positions, cfg)
    ref_token = int(sampling.sample(logits, seed=0, positions=positions + 1)[0])
    with dma.recording() as log:
        out, _, aux = megakernel.decode_step(megakernel.prepare_weights(params, cfg),
                                             jax.tree.map(jnp.copy, state), tokens, positions,
                                             cfg, return_logits=True,
                                             expert_ids=ref_aux.get("expert_ids"))
        jax.block_until_ready(out)
    top2 = np.sort(np.asarray(logits[0]))[-2:]
    minimum = logs.minimum_step_bytes(cfg, 1, positions, np.asarray(ref_aux["expert_ids"]))
    return {"log": log, "diff": float(jnp.max(jnp.abs(aux["logits"] - logits))),
            "token_ok": int(out[0]) == ref_token or top2[1] - top2[0] < NEAR_TIE_GAP,
            "bytes_ratio": logs.hbm_bytes(log) / minimum.total,
            "compiled": (megakernel.compile_step(cfg, 1, chip="tpu7x")[0] if tpu.can_compile()
                         else None),
            "pallas_calls": pallas_calls(cfg)}


def mosaic_kernels(run):
    """Mosaic kernels in the mini's step compiled for TPU7x (none compiled without libtpu)."""
    return run["compiled"].n_mosaic_kernels if run["compiled"] else "no libtpu"


runs = {cfg.name: mini_step(cfg) for cfg in tqdm(MINIS.values(), desc="minis", unit="model")}
TableView([{"mini": name, "layers": layer_pattern(get_config(name)),
            "pallas_calls per step": run["pallas_calls"],
            "Mosaic kernels on tpu7x": mosaic_kernels(run)}
           for name, run in runs.items()],
          ["mini", "layers", "pallas_calls per step", "Mosaic kernels on tpu7x"])

# %% [markdown]
# Where each mini's step spends its HBM traffic, read back from the DMA log (bytes of the DMAs
# that touch HBM). At B = 1 a token picks top_k distinct experts, so these are the same on any
# machine. At these shapes the LM head (512 × 2048) and the dense FFN weigh much more than at
# full size.

# %%
def log_category(name):
    """A DMA-log name -> the categories of section 2."""
    if name.startswith("expert/"):
        return "routed experts"
    if ".kv" in name or name.startswith(("kda.state", "kda.conv_state")):
        return "KV cache + state"
    if name.startswith(("router/", "shared/", "latent/")):
        return "MoE non-routed"
    if name.startswith("dense/"):
        return "dense FFN"
    if name.startswith(("kda.", "mla.", "gqa.")):
        return "attention weights"
    return "LM head" if name == "lm_head" else "embedding rows, norms"


log_bytes = {name: dict.fromkeys(CATEGORIES, 0) for name in runs}
for name, run in runs.items():
    for event in run["log"].select("dma_start"):
        if "hbm" in (event.src, event.dst):
            log_bytes[name][log_category(event.name)] += event.nbytes
log_rows = [{"MB DMAd": label, **{name: log_bytes[name][label] / 1e6 for name in runs}}
            for label in CATEGORIES]
TableView(log_rows, ["MB DMAd", *runs], digits=3)

# %% [markdown]
# The timeline model (`mkresearch.prediction.timeline`) replays each DMA log on a TPU7x: every weight
# block, KV tile and state transfer is a span, the compute phases below them. All three minis
# stream their weights and KV tiles; at these tiny shapes most of the modelled step is latency
# (issue gaps, "bubbles"), which full-size blocks amortise (section 5).

# %%
mini_timelines = {name: timeline.simulate(run["log"], "tpu7x") for name, run in runs.items()}
fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs)), layout="constrained")
for ax, (name, simulated) in zip(axes, mini_timelines.items()):
    widgets.plot_gantt(simulated, ax, title=f"{name}: {simulated.total_s * 1e6:.1f} µs on tpu7x "
                       f"(modelled), {simulated.roofline_fraction:.0%} of the HBM roofline")
minis_figure = fig
show_figure(fig)  # described: an HTML export gives the picture its title

# %%
TableView(widgets.summary_rows(mini_timelines),
          ["label", "total_us", "hbm_floor_us", "roofline_fraction", "idle_hbm_busy_us",
           "bubble_us", "dma_bytes"])

# %%
# NBVAL_CHECK_OUTPUT
# Checks · each mini in one pallas_call and one Mosaic kernel, against the reference; its DMA
# log's bytes by category add up; the timelines' labels read
print(widgets.format_table([
    {"mini": name, "pallas_call": run["pallas_calls"],
     "Mosaic (tpu7x)": mosaic_kernels(run),
     f"|logit diff| <= {LOGIT_TOL:g}": "PASS" if run["diff"] <= LOGIT_TOL else "FAIL",
     "token = reference": run["token_ok"],
     f"bytes / minimum <= {BYTES_SLACK:g}": "PASS" if run["bytes_ratio"] <= BYTES_SLACK else "FAIL"}
    for name, run in runs.items()],
    ["mini", "pallas_call", "Mosaic (tpu7x)", f"|logit diff| <= {LOGIT_TOL:g}",
     "token = reference", f"bytes / minimum <= {BYTES_SLACK:g}"]))
for name, run in runs.items():
    assert run["diff"] <= LOGIT_TOL and run["token_ok"] and run["bytes_ratio"] <= BYTES_SLACK
    assert run["pallas_calls"] == 1 and mosaic_kernels(run) in (1, "no libtpu")
    assert sum(log_bytes[name].values()) == logs.hbm_bytes(run["log"])
assert all(0 < t.roofline_fraction <= 1 for t in mini_timelines.values())
assert not label_problems(minis_figure)  # no label runs into another, none is cut

# %% [markdown]
# ## 5 · The full models on TPU7x
#
# One rank of each full model, divided as the release divides Kimi K3 over 32 ranks (16 TPU7x
# chips × 2 TensorCores, docs/kimi-k3.md §9): query heads / 32 (GQA: each rank keeps the one K/V head its
# query heads read), experts over 8 ranks × their hidden over 4, shared and dense hidden and the
# vocab / 32 rounded up to 128 lanes, collectives left out (`'<model>-rank'`: the release layout's
# rank, `get_config("<model>-rank")`, from every family's sharding rules). Three predictions
# per model, all modelled:
#
# * **the floor**: the full model's step bytes split evenly over 32 TPU7x cores
#   (`roofline.decode_floor` on 16 chips);
# * **the timeline**: the mini's recorded step scaled to the rank's shapes
#   (`mkresearch.prediction.scaling.scale_log`: every DMA's bytes by its matrix / KV-token ratio, the layers
#   repeated along the full pattern, the routed experts scaled to the rank's expected share, one
#   expert per MoE layer at B = 1), replayed by the timeline model. A rank reads more than 1/32 of
#   the model: replicated weights (the MLA down-projections, the router, the norms) and padded
#   shards (DeepSeek-V3's 2048-wide shared expert is 64 columns per rank, padded to 128);
# * **sharded over 32 cores** (`mkresearch predict MODEL --ranks 32`, `mkresearch.prediction.scale_out`):
#   every rank's program from our layout (each kind's rules: heads and GQA's K/V heads with their
#   query heads, replicated when fewer; MLA's latent cache whole; experts as EP 8 x ETP 4; shared and
#   dense hidden slices; the router whole) and our schedule, the collectives the sharded megakernel
#   runs priced on the TPU7x links, a collective waiting for its slowest peer (notebook 09). This is
#   the predicted step of each full model.
#
# All at B = 1 and the mini's context (20 tokens). Kimi K3 is shown with its floor and the
# release's published step; its mini's log scaled the same way is notebook 07's.

# %%
floors = {name: roofline.decode_floor(cfg, "tpu7x", 1, PROMPT_LEN, n_chips=16)
          for name, cfg in MODELS.items()}
predictions = {}
for name, mini in zip(FAMILIES, runs):
    rank, events, unique = bench.scale_to_rank(runs[mini]["log"], get_config(mini), 1)
    predictions[name] = {"rank": rank, "timeline": timeline.simulate(events, "tpu7x"),
                         "floor": floors[name], "unique": unique}
TableView([{"model": name, "rank": p["rank"].name, "rank GB/step": p["timeline"].dma_bytes / GB,
            "x model/32": p["timeline"].dma_bytes * 32 / p["floor"].bytes}
           for name, p in predictions.items()],
          ["model", "rank", "rank GB/step", "x model/32"])

# %%
sharded = {name: full_size_step(cfg, 32, "ours", 1, context=PROMPT_LEN).prediction
           for name, cfg in MODELS.items()}
# the bytes the prediction streams: the kernel as built, partial-sum mode (its default)
rank_floors = {name: layout_bytes.rank_bytes(layout.layout(cfg, 32, collectives="partial-sum"),
                                             1, PROMPT_LEN).floor_s("tpu7x")
               for name, cfg in MODELS.items()}
TableView([{"model": name, "rank GB/step": r["rank_bytes"] / GB,
            "floor ms": rank_floors[name] * 1e3, "step ms": r["step_s"] * 1e3,
            **{f"{part} ms": r["parts_s"][part] * 1e3 for part in scale_out.PARTS},
            "collectives": r["collectives_per_rank"], "tokens/s": r["tokens_per_s"]}
           for name, r in sharded.items()],
          ["model", "rank GB/step", "floor ms", "step ms",
           *[f"{part} ms" for part in scale_out.PARTS], "collectives", "tokens/s"])

# %%
fig, ax = plt.subplots(figsize=(9, 3.6), layout="constrained")
y = np.arange(len(MODELS))
ax.barh(y - 0.27, [floor.seconds * 1e3 for floor in floors.values()], 0.27,
        label="floor: model bytes / 32 cores")
ax.barh(y[1:], [p["timeline"].total_s * 1e3 for p in predictions.values()], 0.27,
        label="timeline model, one rank (scaled mini log)")
ax.barh(y + 0.27, [r["step_s"] * 1e3 for r in sharded.values()], 0.27,
        label="sharded over 32 cores (every rank, collectives)")
ax.scatter([1e3 / roofline.PUBLISHED_TPU7X_16_CHIPS[1]], [0], marker="*", s=120, color="k",
           zorder=3, label="Kimi K3 release, published (16 TPU7x chips)")
ax.set_yticks(y, list(MODELS))
ax.invert_yaxis()
ax.set(xlabel="ms per decode step, B = 1 (modelled, not measured)",
       title="the full models on TPU7x, modelled")
widgets.legend_outside(ax)
full_figure = fig
show_figure(fig)  # described: an HTML export gives the picture its title

# %%
# NBVAL_CHECK_OUTPUT
# Checks · floor <= the rank's floor <= its modelled step, one rank and sharded; the chart reads
for p in predictions.values():
    print(f"{p['rank'].name}: " + bound(p["timeline"].hbm_floor_s / p["timeline"].total_s, 1,
                                       name="its HBM floor / the modelled step"))
    assert p["floor"].seconds <= p["timeline"].hbm_floor_s <= p["timeline"].total_s
for name, cfg in MODELS.items():
    print(f"{layout.layout(cfg, 32).describe()}\n  " + bound(
        rank_floors[name] / sharded[name]["step_s"], 1,
        name="its slowest rank's HBM floor / the modelled sharded step"))
    assert floors[name].seconds <= rank_floors[name] < sharded[name]["step_s"]
assert not label_problems(full_figure)  # no label runs into another, none is cut

# %%
print(f"kimi-k3: floor {floors['kimi-k3'].seconds * 1e3:.2f} ms; the release's published step "
      f"{1e3 / roofline.PUBLISHED_TPU7X_16_CHIPS[1]:.2f} ms")
for name, p in predictions.items():
    print(f"{name}: floor {p['floor'].seconds * 1e3:.2f} ms; one rank modelled "
          f"{p['timeline'].total_s * 1e3:.2f} ms ({p['timeline'].roofline_fraction:.0%} of its HBM "
          f"roofline); sharded over 32 cores {sharded[name]['step_s'] * 1e3:.2f} ms = "
          f"{sharded[name]['tokens_per_s']:.0f} tokens/s per sequence")

# %% [markdown]
# Compiled for TPU7x at those rank shapes (libtpu's Mosaic compiler, from shapes: no weights),
# the whole context of each model in HBM: one Mosaic kernel per step for every family. The
# compiles take up to half a minute each on two CPU cores, so the results recorded by
# `make recorded` (`mkresearch.measurement.recorded`) are shown while they match the current plan; with
# `MKRESEARCH_COMPILE_RANK=1` in the environment they are compiled here. The sharded step of
# each full model, one `pallas_call` per rank with its collectives, compiles for the 32 cores of
# tpu7x:2x2x4 to one Mosaic kernel per rank (recorded the same way), each rank's weight ring as
# deep as its VMEM allows (`megakernel_sharded.ring_depth`: 2 MiB kept spare at one row). Qwen3's
# config has a ring of depth 2, which only the exact mode would use: there its FFN streams a
# single block.
# What the compiler reports: its FLOPs and bytes accessed (the cost estimates the kernels
# declare), and its memory analysis: the arguments one device holds in HBM (the weights, caches
# and state of that step), its outputs, and the peak.

# %%
recompile = os.environ.get("MKRESEARCH_COMPILE_RANK") == "1"
compiles = {name: recorded.compile_or_recorded(get_config(name), 1, chip="tpu7x",
                                               recompile=recompile)
            for name in ("kimi-k3-rank", "deepseek-v3-rank", "glm-4.5-rank",
                         "qwen3-235b-a22b-rank")}
sharded_compiles = {
    f"{model} on {n_ranks} ranks": recorded.sharded_compile_or_recorded(
        model, n_ranks, name, batch, chip, recompile=recompile)
    for model, n_ranks, name, batch, chip in recorded.RECORDED_SHARDED}
TableView([{"compiled": name, "Mosaic kernels": result.n_mosaic_kernels,
            "FLOPs": f"{result.flops:.3g}", "bytes accessed": f"{result.bytes_accessed:.3g}",
            "HBM arguments GB": result.memory.get("argument_size_in_bytes", 0) / GB,
            "outputs GB": result.memory.get("output_size_in_bytes", 0) / GB,
            "peak GB": result.memory.get("peak_memory_in_bytes", 0) / GB,
            "compile s": round(result.seconds), "source": source.split(" (")[0]}
           for name, (result, _, source) in {**compiles, **sharded_compiles}.items()],
          ["compiled", "Mosaic kernels", "FLOPs", "bytes accessed", "HBM arguments GB",
           "outputs GB", "peak GB", "compile s", "source"])

# %%
# NBVAL_CHECK_OUTPUT
# Checks · one Mosaic kernel per step (one rank) and per rank (32 ranks); every VMEM plan fits;
# each sharded ring at least the partial-sum depth
print(widgets.format_table(
    [{"compiled": name, "Mosaic kernels": result.n_mosaic_kernels, "chip": result.chip,
      "VMEM plan MiB": f"{plan.vmem.total_bytes / 2**20:.2f}", "fits": plan.vmem.fits(),
      "ring slots": "-"} for name, (result, plan, _) in compiles.items()]
    + [{"compiled": name, "Mosaic kernels": result.n_mosaic_kernels, "chip": result.chip,
        "VMEM plan MiB": f"{plan.mega.vmem.total_bytes / 2**20:.2f}",
        "fits": plan.mega.vmem.fits(), "ring slots": plan.mega.stream.depth}
       for name, (result, plan, _) in sharded_compiles.items()],
    ["compiled", "Mosaic kernels", "chip", "VMEM plan MiB", "fits", "ring slots"]))
for result, plan, _ in compiles.values():
    assert result.n_mosaic_kernels == 1 and plan.vmem.fits()
for result, plan, _ in sharded_compiles.values():
    assert result.n_mosaic_kernels == 1 and plan.mega.vmem.fits()
    assert plan.mega.stream.depth >= megakernel_sharded.PARTIAL_SUM_RING_DEPTH
