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
# # 02 · Attention: MLA and KDA decode kernels
#
# Every Kimi K3 layer starts with attention, of one of two kinds:
#
# * **MLA** (multi-head latent attention, 24 layers): softmax attention over every earlier token.
#   Each token leaves an entry in the **KV cache** (its keys and values), which a decode step reads
#   back whole: the only per-token cost that grows with the context. MLA compresses what it
#   caches: a token's keys and values are made from one small **latent** vector `ĉ` (512 values)
#   by the matrix **W_kvb**, so the cache can hold `ĉ` instead of every head's keys and values.
# * **KDA** (Kimi delta attention, 69 layers): linear attention with a fixed-size f32 **state**
#   per head, read and written every step, whatever the context.
#
# This notebook writes the MLA decode kernel in four steps and the KDA step as a kernel, each
# checked against the plain-JAX reference (`mkresearch.model.reference`) in the next cell; you
# write the in-place cache write. After each, the package's kernel (`kernels/stages/mla.py`,
# `kernels/stages/kda.py`) is shown with what it adds, and run against the reference. Then it
# measures KV bytes from the DMA log and compiles both kernels for TPU7x at the shapes of one of
# the 32 **ranks** (TensorCores, each with its share of the weights) of the released layout. Terms
# are also in
# [00 · glossary](00_megakernels_on_tpu.ipynb#The-glossary).

# %% [markdown]
# The terms this notebook uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("MLA", "KDA", "Expanded", "KV tile", "Online softmax", "Context", "Rank",
                    "Ref", ".at[...]", "pl.ds", "pl.multiple_of", "BlockSpec", "Memory space",
                    "SMEM operand", "scratch_shapes", "make_async_copy", "DMA semaphore",
                    "Ring slot", "lax.fori_loop", "Race detector", "Mosaic")

# %%
# NBVAL_CHECK_OUTPUT
import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma, kv_tiles, kv_update
from mkresearch.kernels.sharded import mla_sharded
from mkresearch.kernels.stages import kda, mla

from mkresearch.measurement.logs import kv_bytes_at, kv_bytes_per_rank
from mkresearch.model import config, kv_cache, reference, weights
from mkresearch.model.numerics import ordered_sum, sequence_sum
from mkresearch.model.stages.kda import kda_log_decay
from mkresearch.model.config import get_config
from mkresearch.views import exercises, facts, plots

tpu.interpret_options(detect_races=True, vector_clock_size=16)  # every run below is race-checked
cfg = config.get_config("kimi-k3-mini")
params = weights.init_params(cfg, 0)
T = cfg.kv_tile
print(f"{cfg.name}: d={cfg.d_model}, heads={cfg.n_heads}, kv_rank={cfg.mla_kv_rank}, "
      f"qk={cfg.mla_qk_nope}+{cfg.mla_qk_extra}, v={cfg.mla_v_dim}, cache={cfg.max_seq_len} "
      f"tokens in tiles of {T}")

# %% [markdown]
# ## MLA, step by step
#
# For one head the decode step is `o = softmax(q·Kᵀ/√d) V` over the cached tokens `0..p`. We start
# with that core alone, on one row and one head of an expanded cache (K `[S, 256]`, V `[S, 128]`),
# with the new token already in the cache, and compare with a plain `jnp` softmax.

# %%
S, DK, DV = cfg.max_seq_len, cfg.mla_k_padded, cfg.mla_v_dim
scale = cfg.mla_qk_dim ** -0.5
keys = jax.random.split(jax.random.key(0), 3)
q1 = jax.random.normal(keys[0], (1, DK)).astype(jnp.bfloat16)  # [1, 256]
k1 = jax.random.normal(keys[1], (S, DK)).astype(jnp.bfloat16)  # [S, 256]
v1 = jax.random.normal(keys[2], (S, DV)).astype(jnp.bfloat16)  # [S, 128]
position = 77  # tokens 0..77 are visible: two full tiles and a part of the third


def core_reference(q, k, v, position):
    scores = (q.astype(jnp.float32) @ k.astype(jnp.float32).T) * scale  # [1, S]
    scores = jnp.where(jnp.arange(k.shape[0]) <= position, scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1) @ v.astype(jnp.float32)  # [1, DV]


expected_core = core_reference(q1, k1, v1, position)


def check(name, got, want, tol=2e-3):
    err = float(jnp.max(jnp.abs(jnp.asarray(got, jnp.float32) - jnp.asarray(want, jnp.float32))))
    assert err <= tol * max(1.0, float(jnp.max(jnp.abs(want)))), (name, err)
    print(f"PASS {name}: max |error| <= {tol:g}")


# %% [markdown]
# ### Step 1 · naive: the whole cache in VMEM
# The simplest kernel: the default BlockSpecs copy all of K and V into VMEM before the body runs
# (the position goes to **SMEM**, the scalar core's memory, where a kernel keeps loop bounds and
# indices), and the body does one masked softmax. It is correct, but it reads all `S` tokens whatever the
# position, and the cache must fit in VMEM: at Kimi K3 shapes one row's expanded cache for a 32k
# context is 96 heads × 32768 × 384 × 2 B = 2.4 GB, against 64 MiB of VMEM.

# %%
def naive_kernel(position_ref, q_ref, k_ref, v_ref, o_ref):
    scores = kv_tiles.dot_t(q_ref[...], k_ref[...]) * scale  # [1, S]
    token = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    scores = jnp.where(token <= position_ref[0], scores, -jnp.inf)
    weights_ = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    o_ref[...] = jnp.dot(weights_ / jnp.sum(weights_, axis=-1, keepdims=True),
                         v_ref[...].astype(jnp.float32))


def run_naive(q, k, v, position):
    return pl.pallas_call(
        naive_kernel, out_shape=jax.ShapeDtypeStruct((1, DV), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [pl.BlockSpec()] * 3,
        interpret=tpu.interpret_params())(jnp.array([position], jnp.int32), q, k, v)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · step 1 against the plain softmax
check("step 1 naive (whole cache in VMEM)", run_naive(q1, k1, v1, position), expected_core)

# %% [markdown]
# ### Step 2 · tiles and an online softmax
# Walk the cache in tiles of `T` tokens and keep a running max `m`, normaliser `l` and
# accumulator: `kv_tiles.online_softmax_step` — the very function the MLA kernel uses. Only the
# `⌈(p+1)/T⌉` tiles holding visible tokens are touched; the loop bound is dynamic. The cache is
# still all in VMEM.

# %%
plan1 = mla.make_plan(cfg, batch=1, seq_len=S)


def tiled_kernel(position_ref, q_ref, k_ref, v_ref, o_ref):
    visible = position_ref[0] + 1  # online_softmax_step masks tokens >= its `position`
    q = q_ref[...]

    def step(t, carry):
        tokens = pl.ds(pl.multiple_of(t * T, T), T)
        scores = kv_tiles.dot_t(q, k_ref[tokens, :]) * scale  # [1, T]
        return kv_tiles.online_softmax_step(plan1, t, visible, scores,
                                            v_ref[tokens, :].astype(jnp.float32), carry)

    start = (jnp.full((1, 1), -jnp.inf), jnp.zeros((1, 1)), jnp.zeros((1, DV)))
    _, l, acc = jax.lax.fori_loop(0, jax.lax.div(visible + T - 1, T), step, start)
    o_ref[...] = acc / l


def run_tiled(q, k, v, position):
    return pl.pallas_call(
        tiled_kernel, out_shape=jax.ShapeDtypeStruct((1, DV), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [pl.BlockSpec()] * 3,
        interpret=tpu.interpret_params())(jnp.array([position], jnp.int32), q, k, v)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · step 2 against the plain softmax
check("step 2 tiled online softmax", run_tiled(q1, k1, v1, position), expected_core)

# %% [markdown]
# ### Step 3 · the cache stays in HBM: double-buffered DMA
# Now K and V stay in HBM (`memory_space=pl.ANY`) and each tile is copied into one of two VMEM
# slots by DMA: tile `t+1` flies while tile `t` is used (notebook 01's ring). `kv_tiles.tile_loop`
# is the kernel's loop: it reads tile t of row b of each cache ([B, S, n] here with B = 1; a paged
# cache goes through its page table instead, notebook 13); its rings are `dma.Ring`s (01: your
# ring, plus the log), so the DMA log shows every tile it read — and only those.

# %%
def dma_kernel(position_ref, q_ref, k_hbm, v_hbm, o_ref):  # k_hbm [1, S, DK], v_hbm [1, S, DV]
    visible = position_ref[0] + 1
    q = q_ref[...]

    def update(t, tiles, carry):
        k_tile, v_tile = tiles  # [T, DK], [T, DV] in VMEM
        return kv_tiles.online_softmax_step(plan1, t, visible, kv_tiles.dot_t(q, k_tile) * scale,
                                            v_tile.astype(jnp.float32), carry)

    def scoped(k_slots, v_slots, sems):
        rings = (dma.Ring(k_slots, sems.at[0], name="mla.kv.k"),
                 dma.Ring(v_slots, sems.at[1], name="mla.kv.v"))
        start = (jnp.full((1, 1), -jnp.inf), jnp.zeros((1, 1)), jnp.zeros((1, DV)))
        _, l, acc = kv_tiles.tile_loop(plan1, 0, visible, rings, (k_hbm, v_hbm), update, start,
                                       {})
        o_ref[...] = acc / l

    pl.run_scoped(scoped, pltpu.VMEM((2, T, DK), jnp.bfloat16), pltpu.VMEM((2, T, DV), jnp.bfloat16),
                  pltpu.SemaphoreType.DMA((2, 2)))


def run_dma(q, k, v, position):
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        dma_kernel, out_shape=jax.ShapeDtypeStruct((1, DV), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(), hbm, hbm],
        interpret=tpu.interpret_params())(jnp.array([position], jnp.int32), q, k[None], v[None])


with dma.recording() as log3:
    out3 = jax.block_until_ready(run_dma(q1, k1, v1, position))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · step 3 against the plain softmax; the tiles it read
check("step 3 double-buffered DMA from HBM", out3, expected_core)
tiles_read = len(log3.select("dma_start", "mla.kv.k"))
print(f"tiles read: {tiles_read} of {S // T}, slots used: "
      f"{[e.slot for e in log3.select('dma_start', 'mla.kv.k')]}, "
      f"KV bytes: {log3.dma_bytes('mla.kv.'):,}")
assert tiles_read == -(-(position + 1) // T) == 3
assert not tpu.races_found()

# %% [markdown]
# ### Step 4 · the new token never goes through HBM
# In a decode step the new token's key and value are computed in VMEM a moment before attention,
# and the cache holds only tokens `0..p−1`. Writing the new entry to HBM and reading it back costs
# a round trip; instead its score **seeds** the online softmax: `m` = its score, `l = 1`, `acc` =
# its value, as if it were a tile of one token already folded in. The tile loop then reads only
# the `⌈p/T⌉` tiles of tokens `0..p−1`. Run at `p = 77` (the new entry is token 77 of step 3: the
# same answer) and at `p = 64`, where step 3 would read a third tile for one token.

# %%
def seeded_kernel(position_ref, q_ref, k_new_ref, v_new_ref, k_hbm, v_hbm, o_ref):
    # k_new [1, DK], v_new [1, DV]: the new token's entry, in VMEM; the cache holds 0..p-1
    cached = position_ref[0]  # tokens 0..cached-1 are in the cache
    q = q_ref[...]

    def update(t, tiles, carry):
        k_tile, v_tile = tiles
        return kv_tiles.online_softmax_step(plan1, t, cached, kv_tiles.dot_t(q, k_tile) * scale,
                                            v_tile.astype(jnp.float32), carry)

    def scoped(k_slots, v_slots, sems):
        rings = (dma.Ring(k_slots, sems.at[0], name="mla.kv.k"),
                 dma.Ring(v_slots, sems.at[1], name="mla.kv.v"))
        score = kv_tiles.dot_t(q, k_new_ref[...]) * scale  # [1, 1]: the new token's score
        seed = (score, jnp.ones((1, 1)), v_new_ref[...].astype(jnp.float32))  # m, l, acc
        _, l, acc = kv_tiles.tile_loop(plan1, 0, cached, rings, (k_hbm, v_hbm), update, seed, {})
        o_ref[...] = acc / l

    pl.run_scoped(scoped, pltpu.VMEM((2, T, DK), jnp.bfloat16), pltpu.VMEM((2, T, DV), jnp.bfloat16),
                  pltpu.SemaphoreType.DMA((2, 2)))


def run_seeded(q, k_new, v_new, k, v, position):
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        seeded_kernel, out_shape=jax.ShapeDtypeStruct((1, DV), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [pl.BlockSpec()] * 3 + [hbm, hbm],
        interpret=tpu.interpret_params())(jnp.array([position], jnp.int32), q, k_new, v_new,
                                          k[None], v[None])


seeded, seeded_logs = {}, {}
for p in (77, 64):
    with dma.recording() as seeded_logs[p]:
        seeded[p] = jax.block_until_ready(run_seeded(q1, k1[p:p + 1], v1[p:p + 1], k1, v1, p))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · step 4 against the plain softmax over tokens 0..p; the tiles it read
for p in (77, 64):
    check(f"step 4 new token seeds the softmax, p = {p}", seeded[p], core_reference(q1, k1, v1, p))
    tiles = len(seeded_logs[p].select("dma_start", "mla.kv.k"))
    assert tiles == -(-p // T)  # ⌈p/T⌉: tokens 0..p-1 only
    print(f"p = {p}: {tiles} tiles read (step 3 reads {-(-(p + 1) // T)}), KV bytes "
          f"{seeded_logs[p].dma_bytes('mla.kv.'):,}")
assert not tpu.races_found()

# %% [markdown]
# ### Your turn: write the new entry in place
#
# After attention the new entry must land in the cache at position `p`, in place: the kernel's
# cache output is the same HBM buffer as its input (`input_output_aliases`), so nothing else is
# copied. HBM arrays are **tiled**: bf16 rows in groups of 16 (two per 32-bit sublane, 8
# sublanes), so a DMA can only start at a row that is a multiple of 16. One row cannot be copied to
# an arbitrary position. Write `my_write_entry_kernel`: read the aligned 16-row block holding `p`
# into the VMEM scratch `block`, replace its row `p mod 16` with `entry`, and write the block
# back. The check runs it at positions 77, 127 and 0 against `cache.at[p].set(entry)`, race-checked,
# and compiles it for TPU7x with **Mosaic** (the compiler from a Pallas TPU kernel to TPU code, run
# here on the CPU by `tpu.compile_for`): interpret mode accepts a one-row DMA at any position,
# Mosaic refuses it as the chip would.

# %%
def my_write_entry_kernel(position_ref, entry_ref, cache_hbm, cache_out_hbm, block, sem):
    # position_ref [1] i32 (SMEM); entry_ref [1, DK] bf16 (VMEM); cache_hbm [S, DK] bf16 (HBM) and
    # cache_out_hbm, the same buffer; scratch: block [16, DK] bf16 (VMEM), sem one DMA semaphore
    raise NotImplementedError("read the aligned block, patch one row, write it back")


# %%
def run_write_entry(kernel, cache, entry, position):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM((kv_update.UPDATE_ROWS, cache.shape[1]), cache.dtype),
                        pltpu.SemaphoreType.DMA(())],
        input_output_aliases={2: 0},  # the cache out is the cache in: written in place
        interpret=tpu.interpret_params(),
    )(jnp.array([position], jnp.int32), entry, cache)


def check_write_entry(kernel):
    tpu.reset_races()
    entry = jax.random.normal(jax.random.key(9), (1, DK)).astype(jnp.bfloat16)
    for p in (77, 127, 0):
        written = run_write_entry(kernel, k1, entry, p)
        wrong = jnp.flatnonzero(jnp.any(written != k1.at[p].set(entry[0]), axis=1)).tolist()
        assert not wrong, f"at p = {p}, rows {wrong} differ from cache.at[p].set(entry)"
    assert not tpu.races_found(), "the race detector saw a DMA touch the block while it was used"
    if not tpu.can_compile():  # a CPU runtime without libtpu (Colab's): interpret mode's check only
        print(f"not compiled: {tpu.NO_LIBTPU}")
        return
    shapes = (jax.ShapeDtypeStruct((S, DK), jnp.bfloat16), jax.ShapeDtypeStruct((1, DK), jnp.bfloat16))
    try:
        tpu.compile_for(lambda cache, entry: run_write_entry(kernel, cache, entry, 77), *shapes)
    except Exception as error:  # noqa: BLE001 - the compiler's message is the answer's fault
        raise AssertionError(f"Mosaic refuses it for TPU7x: {str(error).splitlines()[0]}") from None


exercises.check("the new entry in place", lambda: check_write_entry(my_write_entry_kernel))


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: the new entry in place (double-click to open)
# NBVAL_CHECK_OUTPUT
def write_entry_solution(position_ref, entry_ref, cache_hbm, cache_out_hbm, block, sem):
    position = position_ref[0]
    rows = block.shape[0]  # 16: the bf16 rows of one HBM tile
    first = pl.multiple_of(jax.lax.div(position, rows) * rows, rows)  # the block holding p
    window = pl.ds(first, rows)
    read = pltpu.make_async_copy(cache_hbm.at[window], block, sem)
    read.start()
    read.wait()
    is_new = jax.lax.broadcasted_iota(jnp.int32, block.shape, 0) == position - first
    block[...] = jnp.where(is_new, entry_ref[...], block[...])
    write = pltpu.make_async_copy(block, cache_out_hbm.at[window], sem)
    write.start()
    write.wait()


assert exercises.check("the new entry in place", lambda: check_write_entry(write_entry_solution))

# %% [markdown]
# ### Step 5 · the package's sublayer: expanded and latent (absorbed)
# The kernel `mla.mla_attention` does the whole sublayer from the normalised input `x`, with the
# steps above as its core. What it adds around them:
#
# * **projections**: `q`, the latent `ĉ` and `k^X` (the part of the key every head shares), the
#   output gate, and after attention `W_o`: weights streamed HBM → VMEM in row blocks by DMA
#   (`blocks.stream_matmul`; in the megakernel, one weight ring for the whole step), logged;
# * **a batch**: a `fori_loop` over rows, each at its own position (its own tile count), and
#   every head of a row over the same tiles;
# * **the in-place write** of the new entry, your exercise (`kv_update.patch_block`), for both
#   cache arrays;
# * **the latent layout**. Instead of `K, V` per head (`H × 384` values per token), cache the
#   normalised latent `ĉ` (512) and the shared `k^X` (64), and absorb `W_kvb` into both sides:
#   `q^C_h · k^C_h = (q^C_h W_kvbK_hᵀ) · ĉ` and `Σ α v_h = (Σ α ĉ) W_kvbV_h`. One latent tile serves
#   every head, and a token costs 1,152 bytes instead of 73,728 at Kimi K3's 96 heads.
#
# The expanded layout's attention, and the in-place write (its patch is your solution's):

# %%
print(inspect.getsource(mla._attend_expanded))
print(inspect.getsource(kv_update.patch_block))

# %% [markdown]
# Three rows at positions 0, 32 (a tile boundary) and 127 (the last slot, not a multiple of the
# tile), against the reference, both layouts.

# %%
positions = jnp.array([0, 32, 127], jnp.int32)
x = reference.rms_norm(jax.random.normal(jax.random.key(1), (3, cfg.d_model)),
                       jnp.ones((cfg.d_model,), jnp.bfloat16), cfg.rms_eps)  # [B, d] bf16
p_mla = reference.layer_params(params["mla"], 0)
logs, sublayer = {}, {}
for layout in ("expanded", "latent"):
    lcfg = cfg.replace(mla_cache_layout=layout)
    cache = {name: jax.random.normal(key, shape).astype(jnp.bfloat16) for (name, shape), key in
             zip(mla.cache_shapes(lcfg, 3, S).items(), jax.random.split(jax.random.key(2), 2))}
    if layout == "expanded":
        cache["k"] = cache["k"].at[..., cfg.mla_qk_dim:].set(0)  # the K padding is zero
    with dma.recording() as logs[layout]:
        out, new_cache = mla.mla_attention(p_mla, x, cache, positions, lcfg)
        jax.block_until_ready(out)
    sublayer[layout] = (out, new_cache, *reference.mla_attention(p_mla, x, cache, positions, lcfg))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the package's MLA sublayer against the reference, both layouts; the bytes it read
for layout, (out, new_cache, ref_out, ref_cache) in sublayer.items():
    lcfg = cfg.replace(mla_cache_layout=layout)
    check(f"step 5 MLA sublayer, {layout} cache: output (bf16 tolerance 2^-7 of max)", out,
          ref_out, tol=2 ** -7)
    assert all(bool(jnp.array_equal(new_cache[n], ref_cache[n])) for n in ref_cache)
    assert logs[layout].dma_bytes("mla.kv.") == kv_cache.kv_tile_bytes_needed(positions, lcfg)
    print(f"PASS {layout}: cache after the step equals the reference's; KV tiles read "
          f"{logs[layout].dma_bytes('mla.kv.'):,} B = the tiles needed")
assert not tpu.races_found()
for layout in ("expanded", "latent"):
    log = logs[layout]
    print(f"{layout:9s} weights {log.dma_bytes('mla.w_'):>9,} B   KV tiles "
          f"{log.dma_bytes('mla.kv.'):>7,} B   in-place update {log.dma_bytes('mla.kv_update'):>7,} B")

# %% [markdown]
# ## KDA, step by step
#
# KDA keeps, per head, a `D × D` f32 state `S[key, value]`. One step (docs/kimi-k3.md §4): project `x`,
# run a causal depthwise conv of size 4 over the last 3 pre-conv vectors and this one (then
# SiLU, `x·σ(x)`), L2-normalise `q` and `k`, then the gated **delta rule**
#
# `S̄ = Diag(e^λ) S`,  `S ← S̄ + β k (v − S̄ᵀk)ᵀ`,  `o = Sᵀq`,  with `λ = −5·σ(exp(A_log)·(g + b))`,
#
# and finally an RMSNorm of `o` times a sigmoid gate. The state forgets (`e^λ < 1` per key
# channel), then corrects what it predicts for key `k` (`S̄ᵀk`) towards `v` by a step `β = σ(b)`.
# **Step 1**: the decay gate alone. `λ` lives in `(−5, 0)`: a key channel keeps between
# `e^−5 ≈ 0.7%` and all of its memory each step.

# %%
p_kda = reference.layer_params(params["kda"], 0)
xk = x[:1]
g_raw = reference.bf(reference.bf(xk @ p_kda["w_fa"]) @ p_kda["w_fb"]).astype(jnp.float32)
log_decay = cfg.kda_decay_bound * jax.nn.sigmoid(
    jnp.exp(p_kda["a_log"]).repeat(cfg.kda_head_dim) * (g_raw + p_kda["dt_bias"]))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · λ in its range
assert float(log_decay.min()) > cfg.kda_decay_bound and float(log_decay.max()) < 0
# printed digits that no other summation order can change (mkresearch.views.facts.stable): λ moves by
# about an f32 ulp of the gate's matmul from machine to machine
print(f"λ in ({cfg.kda_decay_bound:g}, 0): min {facts.stable(log_decay.min(), '.2f', 1e-4)}, "
      f"max {facts.stable(log_decay.max(), '.1e', 1e-7)}")

# %% [markdown]
# ### Step 2 · the delta rule as a kernel, the state in VMEM
# The state is the biggest thing KDA touches: `H × D × D` f32 per row (64 KiB per head). It lives
# in HBM between steps; the kernel copies it into VMEM once (`make_async_copy` into a scratch
# buffer), updates every head there, and copies it back **in place**: the state output is the
# state input's buffer (`input_output_aliases`). The inputs of the rule, `q, k, v, β, e^λ` of one
# row, come from the reference's projections, conv and norms (plain JAX, below), so the kernel is
# the rule alone. Two of them are needed as columns (`e^λ` scales the state's key *rows*, `k` is
# the left factor of the rank-1 update): they come in already as `[D, 1]` here.

# %%
H, D = cfg.n_heads, cfg.kda_head_dim
CONV = cfg.kda_conv_size
conv_state = jax.random.normal(jax.random.key(3), (1, CONV - 1, 3, H, D)).astype(jnp.bfloat16)
state = jax.random.normal(jax.random.key(4), (1, H, D, D), jnp.float32) * 0.1  # an earlier state

# the delta rule's inputs, as reference.kda_attention computes them (model/stages/kda.py)
q_pre, k_pre, v_pre, _, b, g_pre = reference.kda_projections(p_kda, xk, cfg)
decay = jnp.exp(kda_log_decay(p_kda, g_pre.astype(jnp.float32), cfg))[0]  # e^λ [H, D]
window = jnp.concatenate([conv_state, jnp.stack([q_pre, k_pre, v_pre], 1)[:, None]], axis=1)
taps = p_kda["conv_w"].astype(jnp.float32).reshape(3, CONV, H, D).transpose(1, 0, 2, 3)
conv_out = reference.bf(jax.nn.silu(sequence_sum(
    window[:, j].astype(jnp.float32) * taps[j] for j in range(CONV))))  # [1, 3, H, D]
q_hat, k_hat, v_in = (conv_out[0, i].astype(jnp.float32) for i in range(3))  # [H, D] each
q_in = q_hat * jax.lax.rsqrt(ordered_sum(q_hat * q_hat, keepdims=True) + cfg.l2_eps) * D ** -0.5
k_in = k_hat * jax.lax.rsqrt(ordered_sum(k_hat * k_hat, keepdims=True) + cfg.l2_eps)
beta = jax.nn.sigmoid(b.astype(jnp.float32))[0][:, None]  # [H, 1]


# %%
def delta_rule_kernel(q_ref, k_ref, v_ref, beta_ref, k_col_ref, decay_col_ref, state_hbm,
                      o_ref, state_out_hbm, state_vmem, sem):
    # q, k, v [H, D], beta [H, 1], k_col, decay_col [H, D, 1] f32 (VMEM); state_hbm [H, D, D]
    # f32 (HBM) and state_out_hbm, the same buffer; o_ref [H, D] f32; scratch: state_vmem
    # [H, D, D] f32, one DMA semaphore
    read = pltpu.make_async_copy(state_hbm, state_vmem, sem)
    read.start()
    read.wait()
    for h in range(q_ref.shape[0]):  # heads: a static loop
        decayed = decay_col_ref[h] * state_vmem[h]  # S̄ = Diag(e^λ) S   [D, D]
        k = k_ref[h:h + 1, :]  # [1, D]
        predicted = jnp.dot(k, decayed, preferred_element_type=jnp.float32)  # S̄ᵀk   [1, D]
        new = decayed + k_col_ref[h] * (beta_ref[h:h + 1, :] * (v_ref[h:h + 1, :] - predicted))
        state_vmem[h] = new  # S̄ + β k (v − S̄ᵀk)ᵀ
        o_ref[h:h + 1, :] = jnp.dot(q_ref[h:h + 1, :], new, preferred_element_type=jnp.float32)
    write = pltpu.make_async_copy(state_vmem, state_out_hbm, sem)
    write.start()
    write.wait()


def run_delta_rule(q, k, v, beta, decay, state):
    vmem, hbm = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        delta_rule_kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, jnp.float32),
                   jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        in_specs=[vmem] * 6 + [hbm], out_specs=(vmem, hbm),
        scratch_shapes=[pltpu.VMEM(state.shape, jnp.float32), pltpu.SemaphoreType.DMA(())],
        input_output_aliases={6: 1},  # the new state goes where the old one was
        interpret=tpu.interpret_params(),
    )(q, k, v, beta, k[..., None], decay[..., None], state)


o_rule, state_rule = run_delta_rule(q_in, k_in, v_in, beta, decay, state[0])

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the delta-rule kernel against the reference's step: its new state, and o = Sᵀq
_, conv_ref, state_ref = reference.kda_attention(p_kda, xk, conv_state, state, cfg)
state_error = float(jnp.max(jnp.abs(state_rule - state_ref[0])))
assert state_error < 1e-5, state_error
check("step 2 delta-rule kernel: o = Sᵀq of the reference's state", o_rule,
      jnp.einsum("hc,hcj->hj", q_in, state_ref[0]), tol=1e-5)
assert not tpu.races_found()
print(f"PASS step 2 delta-rule kernel: new state = reference.kda_attention's, "
      f"{facts.bound(state_error, 1e-5)}; {H} heads x {D}x{D} f32 = {state_rule.nbytes:,} B "
      "read and written in place")

# %% [markdown]
# ### Step 3 · the package's KDA sublayer
# `kda.kda_attention` is the whole sublayer in one kernel, with your rule at its heart
# (`_head_step`, below: the conv, the norms, the rule and the output gate for one row and head).
# What it adds around it:
#
# * **everything from `x`**: the seven projections (`W_fa`, `W_fb` for the decay gate, `W_q`,
#   `W_k`, `W_v`, the output gate `W_g`, `W_b` for `β`) and `W_o` stream from HBM in row blocks,
#   logged; the conv window (the last 3 pre-conv `q, k, v`) is a second state, shifted in VMEM and
#   written back in place beside the recurrent one;
# * **the states' DMAs hidden**: both start before the projections and are waited for after them,
#   so they fly while the weights stream; the write-backs fly while `W_o` streams;
# * **the columns made in the kernel**: `e^λ` and `k` as columns from one transpose of an
#   `[8, D]` block (one vreg) instead of two `[D, D]` transposes or inputs from outside;
# * **a batch** (a `fori_loop` over rows) and a verify step's rows (each token's states kept for
#   a rollback, notebook 11).
#
# Three decode steps, feeding the kernel its own states, against the reference fed its own.

# %%
print(inspect.getsource(kda._head_step))

# %%
conv_k = conv_r = jnp.zeros((3, cfg.kda_conv_size - 1, 3, H, D), jnp.bfloat16)
state_k = state_r = jnp.zeros((3, H, D, D), jnp.float32)
kda_steps = []
for step in range(3):
    xs = reference.rms_norm(jax.random.normal(jax.random.key(10 + step), (3, cfg.d_model)),
                            jnp.ones((cfg.d_model,), jnp.bfloat16), cfg.rms_eps)
    with dma.recording() as kda_log:
        out_k, conv_k, state_k = kda.kda_attention(p_kda, xs, conv_k, state_k, cfg)
    out_r, conv_r, state_r = reference.kda_attention(p_kda, xs, conv_r, state_r, cfg)
    kda_steps.append((out_k, out_r, conv_k, conv_r, state_k, state_r))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the package's KDA sublayer against the reference over three steps; its DMA bytes
for step, (out_k, out_r, conv_k, conv_r, state_k, state_r) in enumerate(kda_steps):
    check(f"KDA step {step}: output", out_k, out_r, tol=2 ** -7)
    assert bool(jnp.array_equal(conv_k, conv_r))
    state_err = float(jnp.max(jnp.abs(state_k - state_r)))
    assert state_err < 1e-5, state_err
print("PASS KDA: conv state bit-equal, f32 state within 1e-5 after 3 steps")
print(f"per step: state read {kda_log.dma_bytes('kda.state.read'):,} B, written "
      f"{kda_log.dma_bytes('kda.state.write'):,} B; weights {kda_log.dma_bytes('kda.w_'):,} B")
assert not tpu.races_found()

# %% [markdown]
# ## KV bytes per step against context
# The dots are the KV tile bytes each row of the step-5 runs read, from the DMA log, priced at
# Kimi K3's bytes per token (the log counts tokens; the config prices them). The lines extend the
# same rule — whole tiles of 256 tokens up to the position — to a 32k context. At full Kimi K3
# (96 heads) latent reads 64× less. **On one rank** of the released layout (3 of the 96 heads) the
# ratio is only 2×: each rank still needs the whole latent (1,152 B/token) against 3 heads of
# expanded K and V (2,304 B/token) — the 64× is a whole-model saving. The next section gets it per
# rank by sharding the latent cache by sequence.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · KV bytes priced at Kimi K3 and at one rank: latent reads >= 50x less on the whole model
fig = plots.plot_kv_bytes(logs=logs, recorded=cfg, positions=[int(v) for v in positions])
full = config.get_config("kimi-k3")
rank = get_config("kimi-k3-rank", max_seq_len=32768)  # one rank of the release layout
for name, target in (("kimi-k3", full), ("kimi-k3-rank", rank)):
    e = kv_bytes_at(logs["expanded"], cfg.replace(mla_cache_layout="expanded"),
                    target.replace(mla_cache_layout="expanded"))
    lat = kv_bytes_at(logs["latent"], cfg.replace(mla_cache_layout="latent"),
                      target.replace(mla_cache_layout="latent"))
    print(f"{name:13s} step-5 tokens priced: expanded {e:>11,} B  latent {lat:>9,} B  "
          f"ratio {e / lat:.0f}x")
assert kv_bytes_at(logs["expanded"], cfg.replace(mla_cache_layout="expanded"), full) >= \
    50 * kv_bytes_at(logs["latent"], cfg.replace(mla_cache_layout="latent"),
                     full.replace(mla_cache_layout="latent"))

# %% [markdown]
# ## Per rank: the latent cache sharded by sequence
# The latent cache has no head axis, so nothing forces it to follow the heads. Shard it by
# **sequence** over the 32 ranks instead (weights stay head-sharded):
#
# 1. each head's owner absorbs its queries, `q̃_h = q^C_h W_kvbK_hᵀ` and `q^X_h`, and all ranks
#    all-gather them (`[B, 96, 512 + 64]` bf16: about 110 KB at B = 1);
# 2. every rank runs `mla_sharded.mla_latent_partial` over its shard — the same double-buffered
#    tile loop and online softmax as above (`mla.latent_partial`), for all heads — and keeps the
#    softmax state `(m, l, acc)` instead of normalising;
# 3. the states are merged across ranks by a log-sum-exp (`mla_sharded.combine_partials`) and each
#    head's owner finishes: `o_h = (acc / l) W_kvbV_h`, the gate and `W_o`.
#
# On one device the collectives are left out: the four shards of the mini cache run one after the
# other and merge in plain JAX. The new entries are already in the cache (the shard holding each
# position writes it first), so a shard attends to its tokens up to the row's position. The merged
# state must equal the unsharded one and a plain softmax; the whole sublayer against the reference
# is checked in `tests/test_attention_kernels.py`.

# %%
lcfg = cfg.replace(mla_cache_layout="latent")
H, R, E = cfg.n_heads, cfg.mla_kv_rank, cfg.mla_qk_extra
keys = jax.random.split(jax.random.key(5), 4)
q_absorbed = jax.random.normal(keys[0], (3, H, R)).astype(jnp.bfloat16)  # [B, H, kv_rank]: q̃
q_extra = jax.random.normal(keys[1], (3, H, E)).astype(jnp.bfloat16)  # [B, H, extra]: q^X
latent_cache = {"ckv": jax.random.normal(keys[2], (3, S, R)).astype(jnp.bfloat16),  # [B, S, kv_rank]
                "kx": jax.random.normal(keys[3], (3, S, E)).astype(jnp.bfloat16)}  # [B, S, extra]
n_shards, shard_tile = 4, 16  # shards of 32 tokens: two tiles each, so the ring alternates
shard_len = S // n_shards
partials, shard_logs = [], []
for i in range(n_shards):
    shard = {n: a[:, i * shard_len:(i + 1) * shard_len] for n, a in latent_cache.items()}
    with dma.recording() as shard_log:
        partials.append(jax.block_until_ready(mla_sharded.mla_latent_partial(
            q_absorbed, q_extra, shard, positions, i * shard_len, lcfg, kv_tile=shard_tile,
            shard=i)))
    shard_logs.append(shard_log)
m_all, l_all, acc_all = mla_sharded.combine_partials(partials)
whole = mla_sharded.mla_latent_partial(q_absorbed, q_extra, latent_cache, positions, 0, lcfg,
                                       kv_tile=shard_tile)
scores = (jnp.einsum("bhr,bsr->bhs", q_absorbed, latent_cache["ckv"],
                     preferred_element_type=jnp.float32)
          + jnp.einsum("bhe,bse->bhs", q_extra, latent_cache["kx"],
                       preferred_element_type=jnp.float32)) * scale
scores = jnp.where(jnp.arange(S) <= positions[:, None, None], scores, -jnp.inf)
plain_context = jax.nn.softmax(scores, -1) @ latent_cache["ckv"].astype(jnp.float32)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the merged shards against the unsharded partial and a plain softmax; the tiles each read
check("4 shards merged = unsharded partial", acc_all / l_all, whole[2] / whole[1], tol=1e-5)
check("4 shards merged = plain softmax context", acc_all / l_all, plain_context, tol=1e-5)
assert not tpu.races_found()
for i, shard_log in enumerate(shard_logs):
    tiles = {b: [e.indices["tile"] for e in shard_log.select("dma_start", "mla.kv.ckv")
                 if e.indices["row"] == b] for b in range(3)}
    print(f"shard {i} (tokens {i * shard_len:3d}..{(i + 1) * shard_len - 1:3d}): tiles read per row "
          f"at positions {[int(v) for v in positions]}: {list(tiles.values())}")
    for b, position in enumerate(positions.tolist()):
        tokens = min(max(position + 1 - i * shard_len, 0), shard_len)
        assert tiles[b] == list(range(-(-tokens // shard_tile)))

# %% [markdown]
# **Bytes per rank.** Row 2 sits at the last position, so it attends to the whole mini context.
# From the logs: the head-sharded kernels read every token (for their heads, or the whole latent);
# the busiest shard reads 1/4 of the tokens. Scaled by the config to one rank of Kimi K3 (3 heads,
# 32 ranks, context 32,768): the share of the context each rank reads (1/4 of the shards → 1/32),
# priced at that rank's bytes per token.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · KV bytes per rank: head-sharded latent 2x fewer than expanded, sequence-sharded 64x
per_rank = kv_bytes_per_rank({**logs, "latent-sequence": shard_logs}, cfg, rank, n_ranks=32,
                             row=2)
for layout, nbytes in per_rank.items():
    print(f"{layout:16s} {nbytes:>11,} B per rank per MLA layer per step   "
          f"{per_rank['expanded'] / nbytes:3.0f}x fewer than expanded")
assert per_rank["expanded"] == 2 * per_rank["latent"]  # head-sharded latent: only 2x per rank
assert per_rank["expanded"] >= 50 * per_rank["latent-sequence"]  # sequence-sharded: 64x
assert per_rank["expanded"] == 64 * per_rank["latent-sequence"]

# %% [markdown]
# ## Compiling for TPU7x at Kimi K3 per-rank shapes
# No TPU here, but libtpu's Mosaic compiler runs on the CPU (`tpu.compile_for`): tiling, layout
# and VMEM errors surface exactly as on the chip. Shapes of one rank (3 heads), a 32,768-token
# context, batch 1 (the sequence-sharded partial: 1,024 tokens of it); only shapes are needed.

# %%
S_ = jax.ShapeDtypeStruct
results = {}
for layout in ("expanded", "latent") if tpu.can_compile() else ():  # no libtpu: nothing to compile
    rcfg = rank.replace(mla_cache_layout=layout)
    structs = ({n: S_(s, jnp.bfloat16) for n, s in mla.weight_shapes(rcfg).items()},
               S_((1, rcfg.d_model), jnp.bfloat16),
               {n: S_(s, jnp.bfloat16) for n, s in mla.cache_shapes(rcfg, 1, 32768).items()},
               S_((1,), jnp.int32))
    results[f"MLA {layout}"] = tpu.compile_for(
        lambda p, x, c, pos, rcfg=rcfg: mla.mla_attention(p, x, c, pos, rcfg), *structs,
        chip="tpu7x")
kda_structs = ({n: S_(s, kda.WEIGHT_DTYPES.get(n, jnp.bfloat16))
                for n, s in kda.weight_shapes(rank).items()},
               S_((1, rank.d_model), jnp.bfloat16),
               S_((1, rank.kda_conv_size - 1, 3, rank.n_heads, rank.kda_head_dim), jnp.bfloat16),
               S_((1, rank.n_heads, rank.kda_head_dim, rank.kda_head_dim), jnp.float32))
# the sequence-sharded partial: one rank's 1/32 of the context (1,024 tokens), all 96 heads' q̃
shard_structs = (S_((1, 96, rank.mla_kv_rank), jnp.bfloat16),
                 S_((1, 96, rank.mla_qk_extra), jnp.bfloat16),
                 {"ckv": S_((1, 32768 // 32, rank.mla_kv_rank), jnp.bfloat16),
                  "kx": S_((1, 32768 // 32, rank.mla_qk_extra), jnp.bfloat16)},
                 S_((1,), jnp.int32), S_((), jnp.int32))
if tpu.can_compile():
    results["MLA partial"] = tpu.compile_for(
        lambda q, qx, c, pos, start: mla_sharded.mla_latent_partial(
            q, qx, c, pos, start, rank.replace(mla_cache_layout="latent")),
        *shard_structs, chip="tpu7x")
    results["KDA"] = tpu.compile_for(lambda p, x, c, s: kda.kda_attention(p, x, c, s, rank),
                                     *kda_structs, chip="tpu7x")
else:  # a CPU runtime without libtpu (Colab's)
    print(f"not compiled: {tpu.NO_LIBTPU}")

# %%
# Checks · one Mosaic kernel per stage at a rank's shapes (compile times vary: not a checked output)
for name, result in results.items():
    print(f"{name:13s} {result}")
    assert result.n_mosaic_kernels == 1
