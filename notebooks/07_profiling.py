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
# # 07 · Profiling whole stages: timelines, VMEM, idle time and bubbles, and the HBM floor
#
# Notebook 01 drew the pipeline of one GEMV. Here the same tools look at the **stage kernels** of
# a Kimi K3 decode step — KDA and MLA attention, the MoE stage (router included) and the dense FFN,
# the final sampling stage — and at the **megakernel** that runs a whole step in one call, each run
# once in TPU interpret mode at `kimi-k3-mini` shapes with the DMA log recording, then replayed on
# TPU7x by the **timeline model** (`mkresearch.prediction.timeline`). Interpret mode's own times
# say nothing about a TPU: every TPU time below is *modelled* from the log and the chip's
# published figures plus stated assumptions (the DMA latency above all), never measured.
#
# * the **timeline**: DMA lanes against the compute lane, per stage;
# * **VMEM occupancy** over time;
# * the compute unit's **idle time by cause**: a DMA moves bytes meanwhile ("compute idle: HBM
#   busy", `hbm_busy`: the step is bound by HBM there, not wasted), or nothing at all moves
#   ("bubble: nothing moves", `bubble`: DMA latency, a serial chain of small copies: waste);
# * the **modelled step time against the HBM floor**, and at full scale the model's floor for one
#   rank next to the published measurement.
#
# The stages are a registry: a stage is a name and a builder that returns a zero-argument callable
# running the kernel. Kernels that have not landed (or fail) are listed and skipped; a new kernel
# is one more registered builder. The terms this notebook uses, from the glossary (notebook 00
# shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Stage", "Megakernel", "Interpret mode", "DMA log", "Timeline", "Modelled",
                    "Compute phase", "HBM, VMEM, SMEM", "Bubble", "HBM floor",
                    "Roofline fraction", "Rank", "-rank", "Full-size step", "xprof")

# %%
import tempfile

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from mkresearch.kernels.base import dma
from tqdm import tqdm

from mkresearch.measurement import profiling
from mkresearch.model import reference, weights
from mkresearch.model.config import get_config
from mkresearch.prediction import timeline as tl
from mkresearch.views import widgets
from mkresearch.views.widgets import TableView

cfg = get_config("kimi-k3-mini")
B = 2
params = weights.init_params(cfg, seed=0)
state = reference.init_state(cfg, B)
x = jax.random.normal(jax.random.key(1), (B, cfg.d_model)).astype(jnp.bfloat16)  # normalised input
positions = jnp.array([37, 90], jnp.int32)  # two sequences at different context lengths


def layer(tree, i):
    """Layer i of a stacked weight or state tree."""
    return jax.tree.map(lambda a: a[i], tree)


# %%
STAGES = {}  # name -> (builder, how many times a decode step runs it)


def stage(name, per_step):
    def register(builder):
        STAGES[name] = (builder, per_step)
        return builder
    return register


@stage("kda", per_step=len(cfg.kda_layers))
def kda_stage():
    from mkresearch.kernels.stages import kda
    p = layer(params["kda"], 0)
    return lambda: kda.kda_attention(p, x, state["kda"]["conv"][0], state["kda"]["recurrent"][0], cfg)


@stage("mla", per_step=len(cfg.mla_layers))
def mla_stage():
    from mkresearch.kernels.stages import mla
    p, cache = layer(params["mla"], 0), layer(state["mla"], 0)
    return lambda: mla.mla_attention(p, x, cache, positions, cfg)


@stage("moe", per_step=len(cfg.moe_layers))
def moe_stage():
    from mkresearch.kernels.stages import experts
    return lambda: experts.moe_ffn(layer(params["moe"], 0), x, cfg)


@stage("dense", per_step=len(cfg.dense_layers))
def dense_stage():
    from mkresearch.kernels.stages import experts
    return lambda: experts.dense_ffn(layer(params["dense"], 0), x, cfg)


@stage("sampling", per_step=1)
def sampling_stage():
    from mkresearch.kernels.stages import sampling
    snapshots = jnp.stack([x] * cfg.n_blocks)
    return lambda: sampling.sample_stage(snapshots, x, params["mix_out"], params["final_norm"],
                                         params["lm_head"], cfg=cfg, seed=0, positions=positions)


@stage("megakernel", per_step=0)  # a whole decode step in one kernel: compared, not summed
def megakernel_stage():
    from mkresearch.kernels.compose import megakernel
    tokens = jnp.array([3, 5], jnp.int32)
    return lambda: megakernel.decode_step(params, reference.init_state(cfg, B), tokens,
                                          positions, cfg)[0]


# %% [markdown]
# Each stage runs once in interpret mode with its DMA log recording (about a minute in all,
# the megakernel the longest: the bar counts the stages).

# %%
logs, skipped = {}, {}
for name, (builder, _) in tqdm(STAGES.items(), desc="stages in interpret mode", unit="stage"):
    try:
        run = builder()
        with dma.recording() as log:
            jax.block_until_ready(run())
        logs[name] = log
    except Exception as error:  # a kernel that has not landed or is broken: say so, keep going
        tpu.reset_interpret_state()
        skipped[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
timelines = {name: tl.simulate(log, "tpu7x") for name, log in logs.items()}

# %%
# NBVAL_CHECK_OUTPUT
# Checks · every stage ran and logged its DMAs; every logged byte is on a DMA lane of its
# timeline, and compute busy + idle is the step
print("profiled:", ", ".join(logs) or "none")
print("skipped: ", ", ".join(f"{k} ({v})" for k, v in skipped.items()) or "none")
for name, timeline in timelines.items():
    assert timeline.dma_bytes == logs[name].dma_bytes()  # every logged byte is on a DMA lane
    assert abs(timeline.idle_s() + timeline.busy_s("compute") - timeline.total_s) < 1e-12
    print(f"{name:9s} {len(logs[name].events):4d} events, {logs[name].dma_bytes():>9,d} DMA bytes, "
          f"timeline bytes match PASS")

# %% [markdown]
# ## 1 · The modelled timeline of each stage (and of the megakernel) on TPU7x

# %%
columns = ["label", "total_us", "hbm_floor_us", "roofline_fraction", "idle_hbm_busy_us",
           "bubble_us", "compute_busy_us", "peak_vmem_bytes"]
TableView(widgets.summary_rows(timelines), columns)

# %%
for name in [n for n in ("kda", "moe", "megakernel") if n in timelines]:
    widgets.show_figure(widgets.timeline_figure(timelines[name],
                                                title=f"{name} on TPU7x (kimi-k3-mini, B={B})"))

# %% [markdown]
# Read the compute lane with care: a phase lasts `max(FLOPs / MXU peak, VMEM bytes / VMEM
# bandwidth)` with the FLOPs and bytes *the kernel declares* in `dma.phase(...)`. Phases that
# declare neither take no time and are not drawn, so those stages' compute is not yet in the model.
#
# ## 2 · Idle time by cause
#
# At `kimi-k3-mini` sizes each weight is a few hundred KiB: on TPU7x it moves in a fraction of a
# microsecond, less than the (assumed) 0.5 µs DMA latency. A stage that waits for each small copy
# before issuing the next one is therefore mostly in bubbles — latency, not bandwidth. That is the
# bubble a megakernel removes: it issues the next stage's weights while the current stage
# computes, so the latency of one hides behind the other.

# %%
idle = [{"stage": name, **{f"{i['cause']}_fraction": i["fraction"]
                           for i in widgets.idle_rows(t)}} for name, t in timelines.items()]
TableView(idle, ["stage", "hbm_busy_fraction", "bubble_fraction"], digits=2)

# %%
split_axes = widgets.plot_time_split(timelines,
                                     title="where each stage's time goes (TPU7x, modelled)")
widgets.show_figure(split_axes.figure)

# %% [markdown]
# ## 3 · VMEM occupancy

# %%
fig, ax = plt.subplots(figsize=(10, 2.8), layout="constrained")
for name, timeline in timelines.items():
    times, values = widgets.vmem_steps(timeline)
    ax.step(times, np.array(values) / 2**20, where="post", label=name)
ax.set(xlabel="time (µs)", ylabel="VMEM (MiB)",
       title="DMA'd bytes held in VMEM, per stage (modelled)")
widgets.legend_outside(ax)
widgets.show_figure(fig)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the idle time has both causes and they add up; each stage is mostly bubbles at mini
# sizes; the peak VMEM of each stage
for name, timeline in timelines.items():
    causes = {row["cause"]: row["fraction"] for row in widgets.idle_rows(timeline)}
    print(f"{name:10s} idle: HBM busy {causes['hbm_busy']:.0%}, bubble {causes['bubble']:.0%}; "
          f"peak VMEM {timeline.peak_vmem_bytes:,d} B")
    assert abs(timeline.idle_s("hbm_busy") + timeline.idle_s("bubble") - timeline.idle_s()) < 1e-12
assert all(t.idle_s("bubble") > t.idle_s("hbm_busy") for t in timelines.values())

# %% [markdown]
# ## 4 · Modelled step time against the HBM floor (kimi-k3-mini)
#
# Stage by stage, a step runs each stage as many times as the model has such layers. Summing the
# stage timelines is the step *without* a megakernel (every stage starts cold: its first DMA
# latency is exposed). The second figure is the same with zero DMA latency — the bubble a perfect
# cross-stage prefetch would remove — and the floor is all the bytes at the HBM bandwidth.
# The megakernel line is its own recorded step on the same model: one kernel, one log, so its
# timeline shows what the stage boundaries cost once weights stream across them. Its bytes differ
# from the stages' sum where it reads more (e.g. the embedding row, every layer's own weights) or
# less. Two caveats, both visible in the tables above: the DMA latency is an assumption (0.5 µs), and
# most stage phases declare no FLOPs yet, so "latency hidden" is an upper bound on what the
# stages could reach, not a prediction that they reach it.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · stages summed, with latency hidden, the floor: floor <= hidden <= summed; the
# megakernel's own step
no_latency = tl.timeline_chip("tpu7x", dma_latency=0.0)
counted = {n: STAGES[n][1] for n in timelines if STAGES[n][1]}
predicted = sum(k * timelines[n].total_s for n, k in counted.items())
predicted_no_latency = sum(k * tl.simulate(logs[n], no_latency).total_s for n, k in counted.items())
floor = sum(k * timelines[n].hbm_floor_s for n, k in counted.items())
print("stages per step:", ", ".join(f"{n} x{k}" for n, k in counted.items()))
print(f"modelled_us {predicted * 1e6:.2f}, without DMA latency {predicted_no_latency * 1e6:.2f}, "
      f"HBM floor {floor * 1e6:.2f}")
print(f"fraction of the HBM roofline: {floor / predicted:.1%} as stages, "
      f"{floor / predicted_no_latency:.1%} with latency hidden")
assert floor <= predicted_no_latency <= predicted
if "megakernel" in timelines:
    mega = timelines["megakernel"]
    print(f"megakernel modelled step_us {mega.total_s * 1e6:.2f}, its HBM floor "
          f"{mega.hbm_floor_s * 1e6:.2f} ({mega.roofline_fraction:.1%} of roofline), DMA bytes "
          f"{mega.dma_bytes:,d} vs {sum(k * logs[n].dma_bytes() for n, k in counted.items()):,d} "
          "for the stages")

# %% [markdown]
# ## 5 · The model against published numbers (full size)
#
# One Kimi K3 rank (docs/tpu.md §3) reads ≈ 6.97 GB of weights per decode step at B = 1. At TPU7x's
# HBM bandwidth per TensorCore that is the floor below; the public release measures 249 tok/s at
# B = 1, i.e. 4.0 ms per step. The gap is reported as it is.
#
# ### The megakernel at Kimi K3 per-rank shapes, on TPU7x (modelled)
#
# The megakernel's recorded mini step, scaled to the shapes of one rank (`kimi-k3-rank`, docs/kimi-k3.md §9)
# by `mkresearch.prediction.scaling.scale_log`: every DMA's bytes scaled by its matrix / state / KV-token ratio,
# the layer segments repeated along the full 93-layer pattern, the routed experts scaled to this
# rank's expected share (112 local experts, 16 of 896 chosen per token). Blocks keep the mini
# count, so the timeline is coarse; the bytes and the order (what is in flight while what
# computes) are the megakernel's. `kimi-k3-rank` keeps the full latent projections and the full
# d on every rank, so it reads more than the ≈ 6.97 GB of the released layout. It is a one-device
# stand-in (one rank's shapes, no collectives), NOT our full-size step: that is the last line of
# the checks, `mkresearch.prediction.full_size.full_size_step` (Kimi K3 on 32 ranks in our layout
# with the partial-sum collectives our sharded kernel issues by default), the line `decode`,
# `bench`, `info --ranks 32` and `predict` print.

# %%
from mkresearch.prediction import scaling
from mkresearch.prediction.full_size import STAND_IN_LABEL, full_size_step

if "megakernel" in logs:
    rank = get_config("kimi-k3-rank")  # one rank of the release layout
    rank_unique = rank.n_experts * (1 - (1 - rank.top_k / get_config("kimi-k3").n_experts) ** B)
    rank_events = scaling.scale_log(logs["megakernel"], cfg, rank, B, unique_experts=rank_unique)
    rank_mega = tl.simulate(rank_events, "tpu7x")
    fig, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
    widgets.plot_gantt(rank_mega, ax, title=f"megakernel, {rank.name} shapes on tpu7x "
                       f"(scaled from the mini log): {rank_mega.total_s * 1e3:.2f} ms modelled")
    widgets.show_figure(fig)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the floor of one published rank, the stand-in's modelled step, the full-size step
rank_bytes = 6.97e9  # docs/tpu.md: weights read per rank per step at B=1
chip = tl.timeline_chip("tpu7x")
floor_ms = tl.hbm_floor_s(rank_bytes, chip) * 1e3
measured_ms = 1e3 / 249  # 249 tok/s aggregate at B=1: one token per step
print(f"TPU7x HBM per TensorCore (model): {chip.hbm_bandwidth / 1e12:.2f} TB per second "
      f"(docs/tpu.md §1: 3.69)")
print(f"HBM floor for one rank at B=1: floor_ms {floor_ms:.2f} (at 3.69 TB per second: "
      f"{rank_bytes / 3.69e12 * 1e3:.2f})")
print(f"published: 249 tokens per second at B=1 -> step_ms {measured_ms:.2f}")
print(f"the release runs at {floor_ms / measured_ms:.0%} of the model's HBM roofline "
      f"(gap_ms {measured_ms - floor_ms:.2f} per step)")
assert 1.85 < floor_ms < 1.95 and 0.45 < floor_ms / measured_ms < 0.5
if "megakernel" in logs:
    print(f"{rank.name}, the {STAND_IN_LABEL}:")
    print(f"megakernel at {rank.name} shapes, B={B}, routed experts per MoE layer "
          f"{rank_unique:.1f}: {rank_mega.dma_bytes / 1e9:.2f} GB per step")
    print(f"modelled on tpu7x: step_ms {rank_mega.total_s * 1e3:.2f}, HBM floor of those bytes "
          f"floor_ms {rank_mega.hbm_floor_s * 1e3:.2f} -> {rank_mega.roofline_fraction:.0%} of "
          f"the HBM roofline (the model; not measured)")
    print(full_size_step("kimi-k3", 32, "ours", B).line())
    assert 0 < rank_mega.roofline_fraction <= 1

# %% [markdown]
# And the Pallas pipelining guide's α/β/F arithmetic (α a DMA's latency, β the HBM bandwidth,
# F the MXU's FLOP/s; X bytes and Y FLOPs per block, N blocks), reproduced by the model
# (notebook 01 shows the same on the GEMV): a compute-bound stream equals `(α + X/β) + N·Y/F`,
# a bandwidth-bound one `α + N·X/β` plus the last block's compute.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the timeline model equals the guide's closed forms, compute- and bandwidth-bound
guide_chip = tl.timeline_chip("tpu7x", vmem_bandwidth=1e18)  # the guide has no VMEM term
a, b, f = guide_chip.dma_latency, guide_chip.hbm_bandwidth, guide_chip.mxu_flops
n, x_mm, y_mm = 64, 2 * 1024 * 1024 * 2, 2 * 1024**3  # 1024^3 bf16 matmul blocks
model_mm = tl.simulate(tl.stream_log(n, x_mm, y_mm, 2), guide_chip).total_s
n, x_add, y_add = 64, 2 * 512 * 512 * 4, 512 * 512  # 512x512 f32 add blocks
model_add = tl.simulate(tl.stream_log(n, x_add, y_add, 3), guide_chip).total_s
guide_mm = tl.guide_compute_bound_s(a, x_mm, b, n, y_mm, f)
guide_add = tl.guide_bandwidth_bound_s(a, x_add, b, n)
assert abs(model_mm / guide_mm - 1) < 1e-9 and abs(model_add / (guide_add + y_add / f) - 1) < 1e-9
print(f"compute-bound:   guide_us {guide_mm * 1e6:.3f}  model_us {model_mm * 1e6:.3f}  PASS")
print(f"bandwidth-bound: guide_us {guide_add * 1e6:.3f}  model_us {model_add * 1e6:.3f}  "
      f"(+ last compute_us {y_add / f * 1e6:.4f})  PASS")

# %% [markdown]
# ## 6 · Measured spans: the xprof path
#
# On a TPU, each `dma.phase` of a kernel is a `jax.named_scope`, which Mosaic lowers to trace
# events: `profiling.capture` records an xprof trace and `profiling.parse_trace` turns the phases
# into spans that the widgets draw under the model's lanes. On this CPU the path runs too, on what
# the CPU can show: XLA ops, named by the scope their HLO instruction carries. Below, the
# *reference* KDA and MoE sublayers under named scopes (CPU time of plain XLA, not TPU kernel
# time — only the shape of the data is the same). Open a trace by hand with
# `python -m xprof.server --logdir <trace_dir> --port 8791` (or `profiling.open_xprof(trace_dir)`).

# %%
def reference_layer(x):
    with jax.named_scope("kda_attention"):
        out, _, _ = reference.kda_attention(layer(params["kda"], 0), x, state["kda"]["conv"][0],
                                            state["kda"]["recurrent"][0], cfg)
    with jax.named_scope("moe_ffn"):
        return reference.moe_ffn(layer(params["moe"], 0), out, cfg)


step = jax.jit(reference_layer)
trace_dir = tempfile.mkdtemp(prefix="mkresearch-07-")  # xprof: profiling.xprof_command(trace_dir)
trace_path = profiling.capture(step, x, logdir=trace_dir, annotation="reference_layer")
scope_names = profiling.hlo_scope_names(step.lower(x).compile())
measured = profiling.parse_trace(trace_path, ["kda_attention", "moe_ffn", "reference_layer"],
                                 scope_names=scope_names)

# %%
fig, ax = plt.subplots(figsize=(10, 2.2), layout="constrained")
widgets.plot_gantt(tl.simulate([], "tpu7x"), ax, measured=measured,
                   title="CPU trace of the reference layer: measured spans by named scope")
widgets.show_figure(fig)

# %%
if tpu.on_tpu() and "kda" in STAGES:  # measured kernel phases over the model, on a real TPU
    run = STAGES["kda"][0]()
    kernel_trace = profiling.capture(run, logdir=tempfile.mkdtemp(prefix="mkresearch-07-kda-"))
    phase_names = ["kda.project", "kda.delta_rule", "kda.output"]
    kernel_spans = profiling.parse_trace(kernel_trace, phase_names, planes=["/device:TPU"])
    display(widgets.timeline_figure(timelines.get("kda", tl.simulate([], "tpu7x")), kernel_spans))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the trace holds every named scope
found = sorted({s.name for s in measured})
print("scopes found in the trace:", ", ".join(found))
assert set(found) == {"kda_attention", "moe_ffn", "reference_layer"}

# %% [markdown]
# ## 7 · Explore a stage
#
# The control bar replays a recorded stage on another chip or batch size (buffer counts replay
# streaming logs; stage kernels with several streams are best left "as recorded"): the model
# again, redrawn.

# %%
if "moe" in logs:
    display(widgets.show(logs["moe"], chip="tpu7x", batch=2, base_batch=B))
