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
# # 01 · VMEM pipelining: a GEMV that streams its weights
#
# One decode step of a giant MoE model is, byte for byte, mostly one operation: multiply a few
# activation rows `x [B, K]` by a weight matrix `W [K, N]` that nobody else will read this step.
# At decode batch sizes each weight byte feeds only `2·B` FLOPs, so the time is the time to move
# `W` from HBM. This notebook builds that GEMV in Pallas from the ground up and then *looks* at
# its pipeline: when the DMA engine moves bytes, when the MXU works, and where neither does.
#
# **The memory hierarchy.** A TensorCore computes only on vector registers, loaded from **VMEM**
# (tens of MiB of on-chip SRAM). Kernel inputs live in **HBM** (many GB, but ~1–4 TB/s per core).
# Bytes get from HBM to VMEM by **DMA**: asynchronous copies that the scalar core *starts* and
# later *waits* on, while the vector units and the MXU keep computing. Hiding those copies behind
# compute is what "pipelining" means on a TPU.

# %%
import inspect
import tempfile

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from mkresearch.kernels.base import dma, gemv

from mkresearch.prediction import timeline as tl
from mkresearch.views import facts, label_plots, widgets

CHIPS = ("tpu7x", "v5e")  # the newest chip and the smallest: 3.7 TB/s vs 0.82 TB/s per core

# %%
# NBVAL_CHECK_OUTPUT
# The chip figures the timeline uses, per JAX device, and where each comes from.
rows = []
for name in ("v5e", "v6e", "v5p", "tpu7x"):
    chip = tl.timeline_chip(name)
    rows.append({"chip": name, "HBM_GB/s": chip.hbm_bandwidth / 1e9,
                 "bf16_TFLOP/s": chip.mxu_flops / 1e12, "VMEM_MiB": chip.vmem_capacity / 2**20,
                 "DMA_latency_us": chip.dma_latency * 1e6, "DMA_engines": chip.n_dma_engines})
print(widgets.format_table(rows, list(rows[0])))
print()
for field, source in tl.timeline_chip("tpu7x").sources.items():
    print(f"{field:15s} <- {source}")

# %% [markdown]
# The HBM and MXU figures come from `pltpu.get_tpu_info_for_chip` (via `mkresearch.hardware.chips`); the
# DMA latency, the number of DMA engines, the VMEM bandwidth and the VPU peak are not published
# and are marked **ASSUMPTION**: change them with `tl.timeline_chip("tpu7x", dma_latency=...)`
# and every timeline below changes with them.
#
# ## The problem
#
# `x [8, 4096] @ W [4096, 1024]` in bf16: an 8 MiB weight, a 64 KiB activation. We cut `W` into
# row blocks of `block_k = 512` rows (1 MiB each, one contiguous HBM window) and accumulate
# `x[:, block] @ W[block, :]` into an f32 `[8, 1024]` accumulator that stays in VMEM.

# %%
B, K, N, BLOCK_K = 8, 4096, 1024, 512
N_BLOCKS = K // BLOCK_K
kx, kw = jax.random.split(jax.random.key(0))
x = jax.random.normal(kx, (B, K), jnp.float32).astype(jnp.bfloat16)
w = (jax.random.normal(kw, (K, N), jnp.float32) / 64).astype(jnp.bfloat16)
expected = jnp.dot(x, w, preferred_element_type=jnp.float32)  # what every variant must match
WEIGHT_BYTES = w.size * w.dtype.itemsize

# %%
# NBVAL_CHECK_OUTPUT
print(f"W: {w.shape} {w.dtype}, {WEIGHT_BYTES / 2**20:.0f} MiB in {N_BLOCKS} blocks of "
      f"{BLOCK_K * N * 2 / 2**20:.0f} MiB")
print(f"FLOPs per weight byte: {2 * B * K * N / WEIGHT_BYTES:.0f} "
      f"(critical intensity of TPU7x: {tl.timeline_chip('tpu7x').mxu_flops / tl.timeline_chip('tpu7x').hbm_bandwidth:.0f})")

# %% [markdown]
# ## 1 · BlockSpec and grid: Pallas writes the pipeline
#
# `pallas_call(grid=(K // block_k,), in_specs=[BlockSpec(...)])` runs the body once per grid step
# and, before each step, copies that step's blocks HBM → VMEM. The `index_map` of a `BlockSpec`
# says which block: `lambda k: (k, 0)` is row block `k` of `W`. The output block index never
# changes, so the output stays in VMEM across the grid and the body accumulates into it (the
# reduction axis must be the last, "arbitrary" grid axis). Pallas double-buffers every input:
# block `k+1` is copied while the body works on block `k`.
#
# The body (imported from `mkresearch.kernels.base.gemv`, not pasted):

# %%
print(inspect.getsource(gemv.gemv_blockspec_body))
print(inspect.getsource(gemv.accumulate_block))

# %%
# NBVAL_CHECK_OUTPUT
with dma.recording() as blockspec_phases:  # the body's phases; Pallas's own copies are not logged
    y = gemv.gemv_blockspec(x, w, block_k=BLOCK_K)
np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
# the error's digits depend on the machine's summation order; the bound met does not
print(f"BlockSpec GEMV {y.shape} {y.dtype}: matches jnp.dot, "
      f"{facts.bound(float(jnp.max(jnp.abs(y - expected))), 1e-5)}")

# %% [markdown]
# ## 2 · VMEM: what the kernel holds
#
# Everything the body touches is in VMEM: `x`, the f32 accumulator and the weight buffers. With
# `n` buffers of one block each, the weight stream costs `n × 1 MiB`. TPU7x has 64 MiB of VMEM per
# TensorCore, v5e 128 MiB — so the question is never *whether* a few buffers fit, but how many
# blocks must be in flight to keep HBM busy.

# %%
# NBVAL_CHECK_OUTPUT
for n_buffers in (1, 2, 3):
    vmem = gemv.vmem_bytes(B, K, N, block_k=BLOCK_K, n_buffers=n_buffers)
    print(f"{n_buffers} buffer(s): {vmem / 2**20:.3f} MiB of VMEM "
          f"({vmem / tl.timeline_chip('tpu7x').vmem_capacity:.1%} of TPU7x)")

# %% [markdown]
# ## 3 · The same GEMV with manual DMA: 1, 2 and 3 buffers
#
# Now `W` stays in HBM (`memory_space=pl.ANY`) and the kernel moves it itself, through
# `dma.Ring`: a ring of `n_buffers` VMEM slots with one DMA semaphore each. Step `k` first refills
# the slot block `k-1` just freed with block `k + n_buffers - 1`, then waits for block `k` and
# computes on it. With one buffer that is "copy, wait, compute": nothing overlaps. Every copy and
# every compute phase goes through `mkresearch.kernels.base.dma`, so `dma.recording()` logs them with
# their bytes, slot and block index — in interpret mode, in the order they execute.

# %%
print(inspect.getsource(gemv.gemv_stream_body))


# %%
def record(n_buffers):
    """Run the ring GEMV, check it, and return its DMA/phase log."""
    with dma.recording() as log:
        y = gemv.gemv_stream(x, w, block_k=BLOCK_K, n_buffers=n_buffers)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    if log.events:
        return log.events
    # On a TPU the kernel is compiled and records nothing: model the same program instead (the
    # tests check that the recorded log has exactly this shape).
    return tl.stream_log(N_BLOCKS, BLOCK_K * N * 2, gemv.block_flops(B, BLOCK_K, N), n_buffers,
                         name=gemv.WEIGHT_NAME,
                         block_vmem_bytes=gemv.block_vmem_bytes(B, BLOCK_K, N))


logs = {n: record(n) for n in (1, 2, 3)}
# The BlockSpec kernel's log holds only its phases: put in the copies its pipeline issues (x and W
# blocks one grid step ahead, two slots each, and the output written back at the end).
phases = blockspec_phases.events or [e for e in logs[2] if e.kind.startswith("phase")]
blockspec_events = tl.blockspec_log(phases, gemv.blockspec_block_bytes(B, BLOCK_K, N),
                                    out_bytes=B * N * 4)

# %%
# NBVAL_CHECK_OUTPUT
for n_buffers, events in logs.items():
    dma_bytes = sum(e.nbytes for e in events if e.kind == "dma_start")
    assert dma_bytes == WEIGHT_BYTES  # every weight byte crossed HBM -> VMEM exactly once
    program = " ".join({"dma_start": "S", "dma_wait": "W", "phase_start": "(",
                        "phase_end": ")"}[e.kind] + (str(e.indices["k"]) if e.kind[0] == "d" else "")
                       for e in list(events)[:14] if e.kind != "phase_end")
    print(f"{n_buffers} buffer(s): matches jnp.dot PASS, {dma_bytes / 2**20:.0f} MiB moved; "
          f"program: {program} ...")
blockspec_bytes = sum(e.nbytes for e in blockspec_events if e.kind == "dma_start")
assert blockspec_bytes == WEIGHT_BYTES + x.size * 2 + B * N * 4
print(f"BlockSpec (modelled pipeline): W + x + output = {blockspec_bytes:,d} bytes")

# %% [markdown]
# `S3` = start the DMA of block 3, `W3` = wait for it, `(` = a compute phase. With one buffer the
# program is `S0 W0 ( S1 W1 ( …`; with two, block `k+1` is already on its way while block `k` is
# computed; with three, two blocks are ahead.
#
# ## 4 · The timelines
#
# `mkresearch.prediction.timeline.simulate(log, chip)` replays the log on a chip: DMAs in issue order at the
# HBM bandwidth after a fixed latency, each compute phase when its DMA has landed and the previous
# phase is done, lasting `max(FLOPs / MXU peak, VMEM bytes / VMEM bandwidth)`. Below: TPU7x and v5e.
# The BlockSpec pipeline is the two-slot ring plus a small `x` block per step and the output
# writeback, which the manual kernels leave to Pallas outside their logs (`x` whole in VMEM).
#
# Below the compute lane, the compute unit's idle time is split by what happens meanwhile:
# **compute idle: HBM busy** (a DMA moves bytes: the step is bound by HBM there — a
# bandwidth-bound kernel at the roofline spends most of its step like this, and that is not
# waste) and **bubble: nothing moves** (no compute and no DMA: latency and issue gaps, the time a
# better pipeline wins back). The legend gives each one's share of the step.

# %%
timelines = {(n, chip): tl.simulate(logs[n], chip) for n in (1, 2, 3) for chip in CHIPS}
timelines |= {("BlockSpec", chip): tl.simulate(blockspec_events, chip) for chip in CHIPS}
VARIANTS = ("BlockSpec", 1, 2, 3)
fig, axes = plt.subplots(4, 2, figsize=(14, 9.5), layout="constrained")
for (n, chip), timeline in timelines.items():
    ax = axes[VARIANTS.index(n), CHIPS.index(chip)]
    label = n if n == "BlockSpec" else f"{n} buffer(s)"
    widgets.plot_gantt(timeline, ax, title=f"{chip}, {label}: {timeline.total_s * 1e6:.2f} µs, "
                       f"{timeline.roofline_fraction:.0%} of roofline")
    if CHIPS.index(chip) == 0:
        ax.get_legend().remove()  # one legend per row is enough
assert not label_plots.label_problems(fig)  # no label runs into another
widgets.show_figure(fig)  # described: an HTML export gives the picture its title

# %%
# NBVAL_CHECK_OUTPUT
columns = ["label", "total_us", "hbm_floor_us", "roofline_fraction", "idle_hbm_busy_fraction",
           "bubble_fraction", "peak_vmem_bytes"]
rows = widgets.summary_rows({f"{chip} {n if n == 'BlockSpec' else f'x{n}'}": t
                             for (n, chip), t in timelines.items()})
print(widgets.format_table(rows, columns))
for chip in CHIPS:
    totals = [timelines[n, chip].total_s for n in (1, 2, 3)]
    assert totals[0] > totals[1] >= totals[2]  # more buffers never hurt
# v5e, two buffers: near the roofline, the compute unit idles while HBM is busy; few bubbles
v5e_x2 = timelines[2, "v5e"].summary()
assert v5e_x2["roofline_fraction"] > 0.9 and v5e_x2["bubble_fraction"] < 0.1

# %%
fig, ax = plt.subplots(figsize=(10, 2.5), layout="constrained")
for n in (1, 2, 3):
    times, values = widgets.vmem_steps(timelines[n, "tpu7x"])
    ax.step(times, np.array(values) / 2**20, where="post", label=f"{n} buffer(s)")
ax.set(xlabel="time (µs)", ylabel="weight bytes in VMEM (MiB)", title="TPU7x: VMEM occupancy")
widgets.legend_outside(ax)
assert not label_plots.label_problems(fig)
widgets.show_figure(fig)  # described: an HTML export gives the picture its title

# %% [markdown]
# ## 5 · Why double buffering reaches the roofline only sometimes
#
# Buffering *overlaps*; it makes nothing faster. With `n` slots, the DMA of block `k+n` can only be
# issued once block `k` has been computed (its slot is the one being refilled). So `n` blocks share
# one chain of "compute one block, issue, wait α, transfer", and in steady state each block costs
#
# $$\max\Big(\frac{X}{β},\ c,\ \frac{X/β + c + α}{n}\Big)$$
#
# with `X/β` one block's transfer, `c` the compute on one block and `α` the DMA latency (one
# buffer: `X/β + c + α`, nothing overlaps). The step runs at the HBM roofline when the first term
# wins: for double buffering, when **one block's transfer hides the compute on the other block
# plus the latency of issuing the next copy** (`X/β ≥ c + α`). If `c` wins (large batch) the
# kernel is compute-bound and the copies hide behind the MXU instead; if the last term wins, the
# DMA engine idles between blocks and only more buffers (or bigger blocks) help.
#
# On v5e a 1 MiB block takes 1.28 µs to move, more than `c + α` ≈ 0.6 µs: two buffers are enough.
# TPU7x moves it in 0.28 µs — less than the (assumed) 0.5 µs latency — so with two buffers the
# engine waits after every other block, and a third buffer is needed. That is why the released
# kernels keep many 2 MiB weight banks in flight. The model reproduces the formula exactly over a
# long stream (the first check below); the batch sweep after it replays the recorded log with more
# FLOPs per block (`widgets.what_if`): weight bytes stay, compute grows with `B`.

# %%
# NBVAL_CHECK_OUTPUT
chip = tl.timeline_chip("tpu7x")
transfer = BLOCK_K * N * 2 / chip.hbm_bandwidth
compute = gemv.block_vmem_bytes(B, BLOCK_K, N) / chip.vmem_bandwidth  # VMEM-bound at B=8
for n in (1, 2, 3):
    long_stream = tl.stream_log(64, BLOCK_K * N * 2, gemv.block_flops(B, BLOCK_K, N), n,
                                block_vmem_bytes=gemv.block_vmem_bytes(B, BLOCK_K, N))
    ends = [s.end for s in tl.simulate(long_stream, chip).spans_on(tl.COMPUTE_LANE)]
    period = (ends[54] - ends[30]) / 24
    formula = max(transfer, compute, (transfer + compute + chip.dma_latency) / n)
    assert abs(period / formula - 1) < 1e-9
    print(f"TPU7x, {n} buffer(s): per-block period_us {period * 1e6:.3f} = formula, "
          f"{transfer / period:.0%} of the HBM roofline in steady state")

# %%
# NBVAL_CHECK_OUTPUT
rows = []
for chip in CHIPS:
    for batch in (1, 8, 64, 256, 1024):
        row = {"chip": chip, "batch": batch}
        for n in (1, 2, 3):
            t = widgets.what_if(logs[2], chip, batch=batch, n_buffers=n, base_batch=B)
            row[f"roofline_x{n}"] = t.roofline_fraction
        rows.append(row)
print(widgets.format_table(rows, list(rows[0]), digits=2))
by = {(r["chip"], r["batch"]): r for r in rows}
assert by["v5e", 8]["roofline_x2"] > 0.85  # v5e: double buffering reaches the roofline
assert by["tpu7x", 8]["roofline_x2"] < 0.7 < by["tpu7x", 8]["roofline_x3"]  # TPU7x needs 3

# %% [markdown]
# ## 6 · The model against the Pallas pipelining guide
#
# The guide's arithmetic, with `α` the latency, `β` the bandwidth, `F` the FLOP/s, `X` bytes and
# `Y` FLOPs per iteration and `N` iterations: a **compute-bound** pipeline takes
# `(α + X/β) + N·Y/F`, a **bandwidth-bound** one `α + N·X/β`. The model gives the same numbers for
# the guide's two kinds of kernel on TPU7x: a 1024³ bf16 matmul block (512 FLOP per byte, above
# TPU7x's critical intensity: compute-bound, two buffers) and the guide's elementwise add of
# 512×512 f32 blocks (bandwidth-bound, three buffers so the latency hides). The
# guide leaves out the last iteration's compute; the model does not, so it adds exactly `Y/F`.

# %%
# NBVAL_CHECK_OUTPUT
chip = tl.timeline_chip("tpu7x")
alpha, beta, f = chip.dma_latency, chip.hbm_bandwidth, chip.mxu_flops
examples = {  # name: (N, X bytes, Y FLOPs, buffers, guide formula)
    "matmul 1024^3 bf16 (compute-bound)": (64, 2 * 1024 * 1024 * 2, 2 * 1024**3, 2,
                                          lambda n, x, y: tl.guide_compute_bound_s(alpha, x, beta, n, y, f)),
    "add 512x512 f32 (bandwidth-bound)": (64, 2 * 512 * 512 * 4, 512 * 512, 3,
                                          lambda n, x, y: tl.guide_bandwidth_bound_s(alpha, x, beta, n)),
}
for name, (n, x_bytes, y_flops, n_buffers, guide) in examples.items():
    fast_vmem = tl.timeline_chip(chip, vmem_bandwidth=1e18)  # the guide has no VMEM term
    model = tl.simulate(tl.stream_log(n, x_bytes, y_flops, n_buffers), fast_vmem).total_s
    expected_s = guide(n, x_bytes, y_flops)
    tail = 0.0 if "compute" in name else y_flops / f
    assert abs(model / (expected_s + tail) - 1) < 1e-9
    print(f"{name}: guide_us {expected_s * 1e6:.3f}, model_us {model * 1e6:.3f}, "
          f"model - guide = last compute_us {tail * 1e6:.4f}")

# %% [markdown]
# ## 7 · Explore
#
# The control bar replays the two-buffer log on another chip, batch or buffer count (it needs a
# live kernel; a notebook rendered without one shows the figure as first drawn, a picture).

# %%
widgets.show(logs[2], chip="tpu7x", batch=8, base_batch=B)

# %% [markdown]
# ## 8 · On a real TPU
#
# There the kernels are compiled, not interpreted, and record no log. Every `dma.phase` is also a
# `jax.named_scope`, which Mosaic turns into trace events: `mkresearch.measurement.profiling` captures an xprof
# trace and parses the phases into spans that overlay the model. To browse a trace by hand:
# `python -m xprof.server --logdir DIR --port 8791` (`profiling.open_xprof(DIR)` starts it).

# %%
if tpu.on_tpu():
    from mkresearch.measurement import profiling

    trace = profiling.capture(lambda a, b: gemv.gemv_stream(a, b, block_k=BLOCK_K, n_buffers=2),
                              x, w, logdir=tempfile.mkdtemp(prefix="mkresearch-01-"))
    measured = profiling.parse_trace(trace, ["w_block"], planes=["/device:TPU"])
    display(widgets.timeline_figure(timelines[2, "tpu7x"], measured))
else:
    print("not on a TPU: the measured overlay is shown in notebook 07 with a CPU trace")
