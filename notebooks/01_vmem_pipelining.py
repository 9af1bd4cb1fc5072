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
# # 01 · VMEM pipelining: a GEMV that streams its weights
#
# One **decode step** of a giant **MoE** (mixture-of-experts) model is, byte for byte, mostly one
# operation: a **GEMV**, a few activation rows `x [B, K]` times a weight matrix `W [K, N]` that
# nobody else will read this step. At decode batch sizes each weight byte feeds only `2·B` FLOPs,
# so the time is the time to move `W` from HBM. This notebook writes that GEMV in Pallas three
# times (Pallas's own pipeline, then a ring of buffers with the DMA primitive itself, then a ring
# of three as your turn), each checked against `jnp.dot`, and then *looks* at the pipeline: when
# the DMA engine moves bytes, when the MXU works, and where neither does.
#
# **The memory hierarchy.** A TensorCore computes only on vector registers, loaded from **VMEM**
# (tens of MiB of on-chip SRAM). Kernel inputs live in **HBM** (many GB, but ~1–4 TB/s per core).
# Bytes get from HBM to VMEM by **DMA**: asynchronous copies that the scalar core *starts* and
# later *waits* on, while the vector units and the **MXU** (the matrix unit) keep computing.
# Hiding those copies behind compute is what "pipelining" means on a TPU, and a kernel is at the
# **roofline** when it runs as fast as HBM can feed it. Every term is also in
# [00 · glossary](00_megakernels_on_tpu.ipynb#The-glossary).
#
# Every kernel here runs in TPU **interpret mode** off a TPU (`tpu.interpret_params()`: HBM, VMEM,
# DMAs and semaphores simulated on the CPU, with its race detector on) and compiled on a TPU.

# %% [markdown]
# The terms this notebook uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Ref", ".at[...]", "pl.ds", "pl.multiple_of", "pl.when", "BlockSpec",
                    "Memory space", "SMEM operand", "scratch_shapes", "make_async_copy",
                    "DMA semaphore",
                    "Ring slot", "Double buffering", "Dimension semantics", "lax.fori_loop",
                    "Race detector", "Interpret mode", "GEMV", "HBM", "MXU", "DMA log", "Timeline",
                    "Bubble", "Modelled")

# %%
import inspect
import tempfile

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma, gemv

from mkresearch.prediction import timeline as tl
from mkresearch.views import exercises, facts, label_plots, widgets

# the kernels written below run race-checked: a DMA into a slot still being read is reported
tpu.interpret_options(detect_races=True, vector_clock_size=16)
CHIPS = ("tpu7x", "v5e")  # the newest chip and the smallest: 3.7 TB/s vs 0.82 TB/s per core

# %% [markdown]
# ## 0 · Pallas in a page
#
# A Pallas kernel is a Python function over **Refs**; `pl.pallas_call` turns it into a JAX
# function (compiled by Mosaic on a TPU, interpreted here). These are the words every kernel of
# these notebooks is written with, each with two lines of it (all of them are in the glossary
# above); the cell after runs the short ones in one small kernel.
#
# - **Ref and value.** The body's arguments are Refs, references to buffers (in HBM, VMEM, SMEM,
#   or semaphores). Indexing one reads a *value*, an array `jnp` computes on; assigning writes.
#   ```python
#   x = x_ref[...]                 # a value [B, K]
#   o_ref[...] = 2 * x             # a write into the output's VMEM buffer
#   ```
# - **`.at[...]`, a view.** A Ref of part of a Ref: no bytes move. DMAs copy views.
#   ```python
#   block = w_hbm.at[pl.ds(512, 256)]     # rows 512 … 767 of W, still in HBM
#   slot = slots.at[1]                    # ring slot 1 of a [2, 256, N] VMEM buffer
#   ```
# - **`pl.ds(start, size)`**: a slice whose start may be traced (a loop index, a scalar from
#   SMEM); its size is a Python int: shapes are fixed when the kernel is traced, offsets are not.
#   ```python
#   cols = pl.ds(k * 256, 256)            # k traced
#   x_ref[:, cols]                        # x[:, 256 k : 256 k + 256], a value
#   ```
# - **`pl.multiple_of(v, n)`**: tells Mosaic that the traced `v` is a multiple of `n`, so a
#   window starting there is aligned to whole tiles; the value is unchanged.
#   ```python
#   start = pl.multiple_of(k * 256, 256)
#   w_hbm.at[pl.ds(start, 256)]
#   ```
# - **`pl.when(cond)`**: runs the function under it only where a traced condition holds
#   (Python's `if` cannot branch on a traced value).
#   ```python
#   @pl.when(k + 1 < n_blocks)
#   def _(): copy(k + 1, 1 - slot).start()
#   ```
# - **Memory spaces.** `BlockSpec(memory_space=...)` of an operand: `pl.ANY` leaves it in HBM
#   (the kernel moves it), `pltpu.VMEM` copies it whole into VMEM first, `pltpu.SMEM` into SMEM.
#   ```python
#   in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM),    # x: in VMEM before the body starts
#             pl.BlockSpec(memory_space=pl.ANY)]        # W: stays in HBM
#   ```
# - **`scratch_shapes`**: buffers the kernel owns for the whole call, passed after the outputs.
#   ```python
#   scratch_shapes=[pltpu.VMEM((2, 256, N), jnp.bfloat16),    # slots: a ring of 2
#                   pltpu.SemaphoreType.DMA((2,))]            # sems: one per slot
#   ```
# - **SMEM by `in_specs`, or by scalar prefetch.** Both hand the body int32 scalars in SMEM (a
#   table, a position). Scalar prefetch also hands them to every `index_map`, so data can pick
#   which block Pallas copies (notebook 04: an expert id picks the expert's weights).
#   ```python
#   in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), ...]               # the body reads n_ref[0]
#   grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, ...)  # and every index_map
#   ```
# - **`make_async_copy`, start, wait.** A DMA from one view to another of the same shape and
#   dtype, signalling a semaphore: `start()` issues it and returns at once, `wait()` blocks until
#   its bytes have landed. The wait is given the same three arguments as the start.
#   ```python
#   pltpu.make_async_copy(w_hbm.at[rows], slots.at[s], sems.at[s]).start()
#   pltpu.make_async_copy(w_hbm.at[rows], slots.at[s], sems.at[s]).wait()
#   ```
# - **DMA semaphore, ring slot.** A DMA semaphore counts a copy's bytes as they land; the wait
#   takes them. A ring slot is one buffer of a ring (`slots.at[s]`) with its own semaphore
#   (`sems.at[s]`): a copy into slot s signals semaphore s, and the wait for it waits there (not a
#   *batch slot*, a row of a served batch: notebook 13).
#   ```python
#   copy = pltpu.make_async_copy(src, slots.at[s], sems.at[s])    # slot s, semaphore s
#   copy.start(); ...; copy.wait()
#   ```
# - **`lax.fori_loop`**: a traced loop: the body is traced once and its index is a traced value
#   (hence `pl.ds`, `pl.when` and `pl.multiple_of` above).
#   ```python
#   def step(k, carry): ...; return carry
#   jax.lax.fori_loop(0, n_blocks, step, 0)
#   ```

# %%
def primer_kernel(n_ref, x_hbm, o_ref, buf, sem):
    # n_ref [1] int32 (SMEM): which row block to read; x_hbm [32, 128] f32 (HBM, pl.ANY);
    # o_ref [8, 128] f32 (VMEM); scratch: buf [8, 128] f32 (VMEM), sem: one DMA semaphore
    start = pl.multiple_of(n_ref[0] * 8, 8)  # a scalar read from SMEM; a whole 8-row tile
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(start, 8)], buf, sem)  # a view of HBM -> VMEM
    copy.start()
    copy.wait()  # the same descriptor: its bytes have landed in buf
    o_ref[...] = 2 * buf[...]  # read a value, write the output

    @pl.when(n_ref[0] == 0)  # a traced condition
    def _():
        o_ref[0, :] = jnp.zeros(128, jnp.float32)


def primer(n, x):
    return pl.pallas_call(
        primer_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=tpu.interpret_params(),
    )(jnp.array([n], jnp.int32), x)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · the primer's kernel: block n of x, doubled (row 0 zeroed for block 0)
primer_x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
for n in (0, 2):
    want = 2 * np.asarray(primer_x[8 * n:8 * n + 8])
    want[0] = 0 if n == 0 else want[0]
    np.testing.assert_array_equal(np.asarray(primer(n, primer_x)), want)
    print(f"block {n}: equals 2 x[{8 * n}:{8 * n + 8}]" + (" with row 0 zeroed" if n == 0 else ""))

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
# `x [8, 4096] @ W [4096, 1024]` in **bf16** (bfloat16: 16-bit floats with f32's exponent range): an
# 8 MiB weight, a 64 KiB activation. We cut `W` into row blocks of `block_k = 512` rows (1 MiB each, one contiguous HBM window) and accumulate
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
# block `k+1` is copied while the body works on block `k`. Write it (edit and rerun freely):

# %%
def my_blockspec_kernel(x_ref, w_ref, o_ref):
    # x_ref [B, bk], w_ref [bk, N]: this grid step's blocks, already in VMEM; o_ref [B, N] f32:
    # the same block at every step, so it stays in VMEM and accumulates
    @pl.when(pl.program_id(0) == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)


def my_blockspec_gemv(x, w, block_k=BLOCK_K):
    batch, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        my_blockspec_kernel,
        grid=(k // block_k,),  # one step per row block of W
        in_specs=[pl.BlockSpec((batch, block_k), lambda i: (0, i)),  # x[:, block i]
                  pl.BlockSpec((block_k, n), lambda i: (i, 0))],  # W[block i, :]
        out_specs=pl.BlockSpec((batch, n), lambda i: (0, 0)),  # one block: the accumulator
        out_shape=jax.ShapeDtypeStruct((batch, n), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),  # a reduction
        interpret=tpu.interpret_params(),  # None on a TPU (compiled), interpret mode elsewhere
    )(x, w)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · your BlockSpec GEMV against jnp.dot
y_mine = my_blockspec_gemv(x, w)
np.testing.assert_allclose(y_mine, expected, rtol=1e-5, atol=1e-5)
# the error's digits depend on the machine's summation order; the bound met does not
print(f"my_blockspec_gemv {y_mine.shape} {y_mine.dtype}: matches jnp.dot, "
      f"{facts.bound(float(jnp.max(jnp.abs(y_mine - expected))), 1e-5)}")

# %% [markdown]
# **What the package's kernel adds** (`mkresearch.kernels.base.gemv`, imported, not pasted): the
# same body, with the block's work inside `dma.phase(...)`. In interpret mode a phase is an event in
# the **DMA log** (below: it is what the timelines are drawn from), with the FLOPs and VMEM bytes
# it declares; on a TPU it is a `jax.named_scope`, which becomes a trace event in a profile. Its
# wrapper checks `block_k` before anything is traced (a `ValueError` naming it and the allowed
# values) and gives XLA a cost estimate.

# %%
print(inspect.getsource(gemv.gemv_blockspec_body))
print(inspect.getsource(gemv.accumulate_block))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the package's BlockSpec GEMV against jnp.dot
with dma.recording() as blockspec_phases:  # the body's phases; Pallas's own copies are not logged
    y = gemv.gemv_blockspec(x, w, block_k=BLOCK_K)
np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
print(f"BlockSpec GEMV {y.shape} {y.dtype}: matches jnp.dot, "
      f"{facts.bound(float(jnp.max(jnp.abs(y - expected))), 1e-5)}; "
      f"{len(blockspec_phases.select('phase_start'))} phases logged")

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
# ## 3 · The same GEMV with manual DMA: a ring of two slots
#
# Now the kernel moves `W` itself. `W` stays in HBM (`memory_space=pl.ANY`: the kernel gets a
# reference to HBM, not a VMEM block), and the kernel owns two VMEM **slots** and two **DMA
# semaphores**, both *scratch*: allocated for the kernel's lifetime by `scratch_shapes`
# (`pltpu.VMEM(shape, dtype)` and `pltpu.SemaphoreType.DMA((2,))`). The primitive is
#
# ```python
# copy = pltpu.make_async_copy(src_ref, dst_ref, sem)   # a descriptor: HBM window -> VMEM slot
# copy.start()   # the DMA engine starts moving; the kernel goes on at once
# copy.wait()    # block until the semaphore says the bytes have landed
# ```
#
# A wait needs the same descriptor as its start (the semaphore counts bytes), so the kernel
# rebuilds it from the same arguments. With two slots, step `k` first starts block `k+1` into the
# *other* slot (the one block `k-1` was read from: free again), then waits for block `k` and
# computes on it. The DMA of block `k+1` flies while block `k` is multiplied.

# %%
def my_ring2_kernel(x_ref, w_hbm, o_ref, slots, sems):
    # x_ref [n_blocks, B, bk] (VMEM: x cut into K slices), w_hbm [K, N] (HBM), o_ref [B, N] f32;
    # scratch: slots [2, bk, N] bf16 (VMEM), sems: 2 DMA semaphores, one per slot
    n_blocks, _, block_k = x_ref.shape

    def copy(k, slot):  # W's row block k -> one slot, signalling that slot's semaphore
        rows = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        return pltpu.make_async_copy(w_hbm.at[rows], slots.at[slot], sems.at[slot])

    copy(0, 0).start()  # prologue: block 0 on its way
    o_ref[...] = jnp.zeros_like(o_ref)

    def step(k, carry):
        slot = jax.lax.rem(k, 2)

        @pl.when(k + 1 < n_blocks)  # block k+1 into the other slot, free since step k-1
        def _():
            copy(k + 1, 1 - slot).start()

        copy(k, slot).wait()  # block k has landed
        o_ref[...] += jnp.dot(x_ref[k], slots[slot], preferred_element_type=jnp.float32)
        return carry

    jax.lax.fori_loop(0, n_blocks, step, 0)


def run_ring(kernel, n_slots, block_k=BLOCK_K):
    """x @ w with `kernel` streaming W through `n_slots` VMEM slots."""
    batch, k = x.shape
    x_blocks = x.reshape(batch, k // block_k, block_k).transpose(1, 0, 2)  # [n_blocks, B, bk]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, N), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((n_slots, block_k, N), jnp.bfloat16),
                        pltpu.SemaphoreType.DMA((n_slots,))],
        interpret=tpu.interpret_params(),
    )(x_blocks, w)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · your 2-slot ring against jnp.dot, with the race detector on
tpu.reset_races()
y_ring = run_ring(my_ring2_kernel, n_slots=2)
np.testing.assert_allclose(y_ring, expected, rtol=1e-5, atol=1e-5)
assert not tpu.races_found()  # no DMA wrote a slot while the MXU read it
print(f"my_ring2_kernel: matches jnp.dot, "
      f"{facts.bound(float(jnp.max(jnp.abs(y_ring - expected))), 1e-5)}; no race found")

# %% [markdown]
# ### `dma.Ring`: the same, plus the log
#
# The package's kernels never call `make_async_copy` directly: they go through
# `mkresearch.kernels.base.dma`. A `dma.Copy` is exactly the descriptor above (`_descriptor`), and
# its `start` / `wait` are the primitive's, each followed by `_log`: when a `dma.recording()` is
# open and the kernel is interpreted, an ordered callback appends an event (what moved, its bytes,
# memory spaces, slot and loop indices) to the log *while the kernel runs*, in execution order. On
# a TPU, or when nothing is recording, `_log` emits nothing: the compiled kernel is the one you
# wrote. `dma.Ring` is your two slots and semaphores with a name for the log.

# %%
print(inspect.getsource(dma.Copy))
print(inspect.getsource(dma.Ring))

# %% [markdown]
# The package's GEMV (`gemv.gemv_stream_body`) is your ring with `n_buffers` slots instead of two:
# a prologue that fills all slots but one, and each step refills the slot block `k-1` freed with
# block `k + n_buffers - 1`. With one buffer that is "copy, wait, compute": nothing overlaps.
# `dma.recording()` logs each copy and compute phase with its bytes, slot and block index.

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
# Checks · every weight byte moved once; the programs the logs record
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
assert not tpu.races_found()
print(f"BlockSpec (modelled pipeline): W + x + output = {blockspec_bytes:,d} bytes")

# %% [markdown]
# `S3` = start the DMA of block 3, `W3` = wait for it, `(` = a compute phase. With one buffer the
# program is `S0 W0 ( S1 W1 ( …`; with two, block `k+1` is already on its way while block `k` is
# computed; with three, two blocks are ahead.
#
# ### Your turn: a ring of three slots
#
# Write `my_ring3_kernel`: the same GEMV with three slots, so that **two** blocks are in flight
# while one is computed. Start blocks 0 and 1 before the loop; at step `k`, start block `k+2`
# into the slot block `k-1` used (`(k+2) mod 3`), then wait for block `k` in slot `k mod 3`.
# `run_ring(kernel, n_slots=3)` allocates three slots and three semaphores. The check below says
# whether your kernel matches `jnp.dot`, runs without a race, and starts two copies before its loop.

# %%
def my_ring3_kernel(x_ref, w_hbm, o_ref, slots, sems):
    # slots [3, bk, N] bf16, sems: 3 DMA semaphores. Your ring here (start from my_ring2_kernel).
    raise NotImplementedError("write the 3-slot ring")


# %%
def copies_before_loop(kernel, n_slots):
    """How many DMAs the kernel starts before its first loop (its prologue), from its jaxpr."""
    outer = jax.make_jaxpr(lambda: run_ring(kernel, n_slots))()
    body = next(e for e in outer.eqns if e.primitive.name == "pallas_call").params["jaxpr"]
    loop = next(i for i, e in enumerate(body.eqns) if e.primitive.name in ("scan", "while"))
    return sum(e.primitive.name == "dma_start" for e in body.eqns[:loop])


def check_ring3(kernel):
    tpu.reset_races()
    got = np.asarray(run_ring(kernel, n_slots=3))
    assert not tpu.races_found(), "the race detector saw a DMA write a slot while it was read"
    assert np.isfinite(got).all(), "the output holds NaN or inf: is every block accumulated?"
    assert np.allclose(got, expected, rtol=1e-5, atol=1e-5), (
        f"max |error| against jnp.dot is {np.abs(got - expected).max():.3g}")
    ahead = copies_before_loop(kernel, 3)
    assert ahead == 2, f"{ahead} copies started before the loop; three slots keep two ahead"


exercises.check("a 3-slot ring", lambda: check_ring3(my_ring3_kernel))


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: a 3-slot ring (double-click to open)
# NBVAL_CHECK_OUTPUT
def ring3_solution(x_ref, w_hbm, o_ref, slots, sems):
    n_blocks, _, block_k = x_ref.shape
    n_slots = slots.shape[0]  # 3: n_slots - 1 = 2 blocks ahead

    def copy(k, slot):
        rows = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        return pltpu.make_async_copy(w_hbm.at[rows], slots.at[slot], sems.at[slot])

    for k in range(n_slots - 1):  # prologue: blocks 0 and 1 on their way
        copy(k, k).start()
    o_ref[...] = jnp.zeros_like(o_ref)

    def step(k, carry):
        ahead = k + n_slots - 1

        @pl.when(ahead < n_blocks)  # into the slot block k-1 was read from
        def _():
            copy(ahead, jax.lax.rem(ahead, n_slots)).start()

        slot = jax.lax.rem(k, n_slots)
        copy(k, slot).wait()
        o_ref[...] += jnp.dot(x_ref[k], slots[slot], preferred_element_type=jnp.float32)
        return carry

    jax.lax.fori_loop(0, n_blocks, step, 0)


assert exercises.check("a 3-slot ring", lambda: check_ring3(ring3_solution))

# %% [markdown]
# ## 4 · The timelines (modelled)
#
# `mkresearch.prediction.timeline.simulate(log, chip)` replays the log on a chip: DMAs in issue order at the
# HBM bandwidth after a fixed latency, each compute phase when its DMA has landed and the previous
# phase is done, lasting `max(FLOPs / MXU peak, VMEM bytes / VMEM bandwidth)`. These are **modelled**
# timelines, not measurements: the log is real (it is what the kernel did), the durations come from
# the chip figures above, some of them assumptions. Below: TPU7x and v5e.
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
gantt_fig, axes = plt.subplots(4, 2, figsize=(14, 9.5), layout="constrained")
for (n, chip), timeline in timelines.items():
    ax = axes[VARIANTS.index(n), CHIPS.index(chip)]
    label = n if n == "BlockSpec" else f"{n} buffer(s)"
    widgets.plot_gantt(timeline, ax, title=f"modelled: {chip}, {label}: "
                       f"{timeline.total_s * 1e6:.2f} µs, {timeline.roofline_fraction:.0%} of roofline")
    if CHIPS.index(chip) == 0:
        ax.get_legend().remove()  # one legend per row is enough
widgets.show_figure(gantt_fig)  # described: an HTML export gives the picture its title

# %%
vmem_fig, ax = plt.subplots(figsize=(10, 2.5), layout="constrained")
for n in (1, 2, 3):
    times, values = widgets.vmem_steps(timelines[n, "tpu7x"])
    ax.step(times, np.array(values) / 2**20, where="post", label=f"{n} buffer(s)")
ax.set(xlabel="time (µs)", ylabel="weight bytes in VMEM (MiB)",
       title="TPU7x: VMEM occupancy (modelled)")
widgets.legend_outside(ax)
widgets.show_figure(vmem_fig)  # described: an HTML export gives the picture its title

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the modelled timelines: more buffers never hurt; v5e x2 is near the roofline
assert not label_plots.label_problems(gantt_fig)  # no label runs into another
assert not label_plots.label_problems(vmem_fig)
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
# long stream (`modelled_period` below, the first check); the batch sweep after it replays the
# recorded log with more FLOPs per block (`widgets.what_if`): weight bytes stay, compute grows
# with `B`.

# %%
TPU7X = tl.timeline_chip("tpu7x")


def modelled_period(n_buffers, block_k, chip=TPU7X):
    """Seconds per block in the steady state of a long stream of [block_k, N] blocks (modelled)."""
    long_stream = tl.stream_log(64, block_k * N * 2, gemv.block_flops(B, block_k, N), n_buffers,
                                block_vmem_bytes=gemv.block_vmem_bytes(B, block_k, N))
    ends = [s.end for s in tl.simulate(long_stream, chip).spans_on(tl.COMPUTE_LANE)]
    return (ends[54] - ends[30]) / 24


def formula_period(n_buffers, block_k, chip=TPU7X):
    transfer = block_k * N * 2 / chip.hbm_bandwidth
    compute = gemv.block_vmem_bytes(B, block_k, N) / chip.vmem_bandwidth  # VMEM-bound at B=8
    return max(transfer, compute, (transfer + compute + chip.dma_latency) / n_buffers)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · the model's period is the formula's
for n in (1, 2, 3):
    period = modelled_period(n, BLOCK_K)
    assert abs(period / formula_period(n, BLOCK_K) - 1) < 1e-9
    transfer = BLOCK_K * N * 2 / TPU7X.hbm_bandwidth
    print(f"TPU7x, {n} buffer(s): per-block period_us {period * 1e6:.3f} = formula, "
          f"{transfer / period:.0%} of the HBM roofline in steady state")

# %% [markdown]
# ### Your turn: the period at another block size
#
# Halve the blocks: `block_k = 256` (512 KiB each, twice as many). Predict, in seconds, the
# steady-state time per block on TPU7x with two and with three buffers, from the figures of the
# chip (`TPU7X.hbm_bandwidth`, `TPU7X.vmem_bandwidth`, `TPU7X.dma_latency`) and
# `gemv.block_vmem_bytes(B, 256, N)`, without calling `formula_period`. Does a third buffer still
# help, and does either reach the HBM roofline? The check replays the model.

# %%
def my_period(n_buffers, block_k=256):
    # seconds per block in the steady state, TPU7x, B = 8, N = 1024
    raise NotImplementedError("your prediction")


# %%
def check_period(period_of):
    for n in (2, 3):
        want, got = modelled_period(n, 256), period_of(n, 256)
        assert abs(got / want - 1) < 1e-6, (
            f"{n} buffers: you predict {got * 1e6:.4g} µs per block, the model gives "
            f"{want * 1e6:.4g} µs")


exercises.check("the period at block_k = 256", lambda: check_period(my_period))


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: the period at block_k = 256 (double-click to open)
# NBVAL_CHECK_OUTPUT
def period_solution(n_buffers, block_k=256):
    transfer = block_k * N * 2 / TPU7X.hbm_bandwidth  # 0.14 µs: half the latency
    compute = gemv.block_vmem_bytes(B, block_k, N) / TPU7X.vmem_bandwidth
    return max(transfer, compute, (transfer + compute + TPU7X.dma_latency) / n_buffers)


assert exercises.check("the period at block_k = 256", lambda: check_period(period_solution))
for n in (2, 3):  # smaller blocks: the latency weighs more, neither reaches the roofline
    share = 256 * N * 2 / TPU7X.hbm_bandwidth / period_solution(n)
    print(f"{n} buffers: {share:.0%} of the HBM roofline")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the batch sweep: v5e reaches the roofline with two buffers, TPU7x needs three
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
# Checks · the model against the guide's formulas
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
# The control bar replays the two-buffer log on another chip, batch or buffer count: a modelled
# timeline, as in section 4 (it needs a live kernel; a notebook rendered without one shows the
# figure as first drawn, a picture).

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

# %% [markdown]
# ## 9 · When a kernel goes wrong
#
# Four mistakes a kernel writer meets, each run below with its symptom and then its cure. Two
# facts of interpret mode shape the symptoms: a DMA moves its bytes when its **wait** runs (the
# interpreter's `dma_execution_mode="on_wait"`), and VMEM the kernel never wrote holds **NaN**.
#
# **1 · A copy that signals another slot's semaphore.** The two-slot ring of section 3, but the
# next block's copy signals the semaphore of the slot being read (`sems.at[slot]` for a copy into
# `slots.at[1 - slot]`). Some wait then waits on a semaphore that no started copy will signal:
# on a TPU the core stalls, in interpret mode the call never returns, with no message. Here it
# runs under `tpu.run_timed`, which stops it after 3 s in one line.

# %%
import functools

from mkresearch.kernels.base import weight_stream


def wrong_semaphore_ring(x_ref, w_hbm, o_ref, slots, sems):
    n_blocks, _, block_k = x_ref.shape

    def copy(k, slot, sem):  # the mistake: the slot and the semaphore passed apart
        rows = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        return pltpu.make_async_copy(w_hbm.at[rows], slots.at[slot], sems.at[sem])

    copy(0, 0, 0).start()
    o_ref[...] = jnp.zeros_like(o_ref)

    def step(k, carry):
        slot = jax.lax.rem(k, 2)

        @pl.when(k + 1 < n_blocks)
        def _():
            copy(k + 1, 1 - slot, slot).start()  # into the other slot, signalling this one's

        copy(k, slot, slot).wait()
        o_ref[...] += jnp.dot(x_ref[k], slots[slot], preferred_element_type=jnp.float32)
        return carry

    jax.lax.fori_loop(0, n_blocks, step, 0)


MESSAGE_LINES = {}  # symptom -> how many lines its error message had


def symptom(run, seconds=60):
    """What running `run()` raises, in one line: the error's type and the line of its message
    that names the problem (for an error inside the interpreter, the last line of the traceback
    it carries); its message's length in MESSAGE_LINES."""
    try:
        tpu.run_timed(run, seconds, what="the kernel")
    except Exception as error:  # noqa: BLE001 - shown, not raised: this is a gallery of failures
        lines = str(error).strip().splitlines()
        named = lines[-1] if "CpuCallback error" in lines[0] else lines[0]
        said = f"{type(error).__name__}: {named}"
        MESSAGE_LINES[said] = len(lines)
        return said
    return "no error"


hang = symptom(lambda: run_ring(wrong_semaphore_ring, n_slots=2), seconds=3)
print(hang)

# %% [markdown]
# **The cure.** Give each copy its slot once and index both the slot and its semaphore with it
# (`copy(k, slot)` of section 3). The package's `dma.Copy` holds a kernel to this: built with
# `slot=s`, it refuses a destination or a semaphore viewed at another index, in one line naming
# the copy, when the kernel is traced, before anything runs.

# %%
def checked_wrong_semaphore_ring(x_ref, w_hbm, o_ref, slots, sems):
    n_blocks, _, block_k = x_ref.shape

    def copy(k, slot, sem):  # the same mistake, through dma.Copy
        rows = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        return dma.Copy(w_hbm.at[rows], slots.at[slot], sems.at[sem], name="w", slot=slot)

    copy(0, 0, 0).start()
    o_ref[...] = jnp.zeros_like(o_ref)

    def step(k, carry):
        slot = jax.lax.rem(k, 2)
        other = 1 - slot

        @pl.when(k + 1 < n_blocks)
        def _():
            copy(k + 1, other, slot).start()

        copy(k, slot, slot).wait()
        o_ref[...] += jnp.dot(x_ref[k], slots[slot], preferred_element_type=jnp.float32)
        return carry

    jax.lax.fori_loop(0, n_blocks, step, 0)


refused_semaphore = symptom(lambda: run_ring(checked_wrong_semaphore_ring, n_slots=2))
print(refused_semaphore)

# %% [markdown]
# **2 · A missing wait.** The ring without `copy(k, slot).wait()`: the blocks are started and
# the MXU reads the slots anyway. In interpret mode no copy ever runs (nothing waits for it), so
# every slot still holds NaN; no DMA wrote a slot while it was read, so the race detector has
# nothing to report. On a TPU the copies do run, and the product is whatever the slot held at
# that instant. The cure: wait for a block before reading its slot; and check the output for
# NaN, as `check_ring3` above does (`np.isfinite`).

# %%
def no_wait_ring(x_ref, w_hbm, o_ref, slots, sems):
    n_blocks, _, block_k = x_ref.shape

    def copy(k, slot):
        rows = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        return pltpu.make_async_copy(w_hbm.at[rows], slots.at[slot], sems.at[slot])

    copy(0, 0).start()
    o_ref[...] = jnp.zeros_like(o_ref)

    def step(k, carry):
        slot = jax.lax.rem(k, 2)

        @pl.when(k + 1 < n_blocks)
        def _():
            copy(k + 1, 1 - slot).start()

        # the mistake: no copy(k, slot).wait() before the slot is read
        o_ref[...] += jnp.dot(x_ref[k], slots[slot], preferred_element_type=jnp.float32)
        return carry

    jax.lax.fori_loop(0, n_blocks, step, 0)


tpu.reset_races()
no_wait = np.asarray(run_ring(no_wait_ring, n_slots=2))
no_wait_symptom = (f"{np.isnan(no_wait).sum()} of {no_wait.size} outputs NaN, race found: "
                   f"{tpu.races_found()}")
tpu.reset_interpret_state()  # the unwaited copies are left pending in the simulated TPU
print(no_wait_symptom)

# %% [markdown]
# **3 · A window of another shape.** A copy of half of W's columns (`w_hbm.at[rows, :N // 2]`)
# into a whole slot: `make_async_copy` accepts it; the copy fails when its wait runs it, as a
# numpy broadcast error at the end of a traceback from inside the interpreter, naming no copy (a
# window *larger* than its destination is not even refused: interpret mode copies part of it).
# The cure: `dma.Copy` compares the two shapes (and dtypes) when it is built, naming the copy.

# %%
def half_window_ring(x_ref, w_hbm, o_ref, slots, sems, copy_class):
    n_blocks, _, block_k = x_ref.shape

    def copy(k, slot):  # the mistake: half of W's columns into a whole slot
        rows = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        if copy_class is dma.Copy:
            return dma.Copy(w_hbm.at[rows, pl.ds(0, N // 2)], slots.at[slot], sems.at[slot],
                            name="w", slot=slot)
        return pltpu.make_async_copy(w_hbm.at[rows, pl.ds(0, N // 2)], slots.at[slot],
                                     sems.at[slot])

    copy(0, 0).start()
    copy(0, 0).wait()
    o_ref[...] = jnp.dot(x_ref[0], slots[0], preferred_element_type=jnp.float32)


half_window = symptom(lambda: run_ring(functools.partial(half_window_ring,
                                                         copy_class=pltpu.make_async_copy), 2))
refused_window = symptom(lambda: run_ring(functools.partial(half_window_ring,
                                                            copy_class=dma.Copy), 2))
for said in (half_window, refused_window):
    print(f"{said}  [a message of {MESSAGE_LINES[said]} line(s)]")

# %% [markdown]
# **4 · An empty operand.** A megakernel stacks each stage kind's weights, `[layers of the
# kind, ...]`; a kind that no layer uses has a stack of 0 layers (notebook 06's toy megakernel,
# a kind registered and left out of the pattern). Pallas fails on the empty operand deep inside
# its block padding, with a bare `ZeroDivisionError`. The cure: build the layer table with
# `weight_stream.kind_table(pattern, kinds)` (the package's megakernel's), which refuses the
# unused kind by name before anything is traced.

# %%
def empty_stack_kernel(stack_hbm, o_ref):  # stack_hbm [0, 2, 128, 128] bf16: no layer
    o_ref[...] = jnp.zeros_like(o_ref)


empty_stack = symptom(lambda: pl.pallas_call(
    empty_stack_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    in_specs=[pl.BlockSpec(memory_space=pl.ANY)], interpret=tpu.interpret_params(),
)(jnp.zeros((0, 2, 128, 128), jnp.bfloat16)))
refused_kind = symptom(lambda: weight_stream.kind_table(("mlp", "mlp"), ("mlp", "glu")))
print(empty_stack)
print(refused_kind)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · each mistake: its symptom, and the one line that names it
gallery = {"another slot's semaphore": (hang, refused_semaphore),
           "a missing wait": (no_wait_symptom, "wait before reading; check np.isfinite"),
           "a window of another shape": (half_window, refused_window),
           "an empty operand": (empty_stack, refused_kind)}
for mistake, (seen, cure) in gallery.items():
    print(f"{mistake}:\n  symptom: {seen}\n  cure:    {cure}")
assert hang.startswith("KernelTimeout") and "did not finish in 3 s" in hang
assert refused_semaphore.startswith("ValueError: Copy 'w':")
assert no_wait_symptom == f"{B * N} of {B * N} outputs NaN, race found: False"
assert "could not broadcast" in half_window and "Copy" not in half_window
assert refused_window.startswith("ValueError: Copy 'w': src shape (512, 512) != dst")
assert MESSAGE_LINES[refused_semaphore] == MESSAGE_LINES[refused_window] == 1
assert empty_stack.startswith("ZeroDivisionError") and "'glu'" in refused_kind
assert np.allclose(run_ring(my_ring2_kernel, n_slots=2), expected, rtol=1e-5, atol=1e-5)
