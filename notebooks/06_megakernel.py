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
# # 06 · The megakernel: a whole decode step in one `pallas_call`
#
# Notebooks 01–05 wrote one kernel per stage: a weight stream, attention, the router, the experts,
# sampling. A decode step of a whole model as one kernel per stage pays a kernel launch, an HBM
# round trip of the activations and a cold weight pipeline at every stage boundary. The
# **megakernel** runs the whole step — every layer, then the LM head and sampling — inside ONE
# grid-less `pallas_call`. Three ideas make that work, and you write all three here, in a toy
# megakernel of about fifty lines, before reading the package's:
#
# 1. **a layer table in SMEM**: which kind of stage each layer is, and where its weights sit in
#    that kind's stacked weights, as int32 scalars the kernel reads while it runs;
# 2. **one traced body per kind, not per layer**: `lax.fori_loop` over the layers, and in it
#    `lax.switch` on the layer's kind: the kernel does not grow with the depth;
# 3. **one weight ring across stage boundaries**: all the step's weight blocks form one
#    sequence through one ring of VMEM slots, so the next layer's first block is already on its
#    way while the current layer computes.
#
# Then the package's megakernel (`mkresearch.kernels.compose.megakernel`): the same three ideas
# over the real stage bodies of notebooks 02–05, checked against the plain-JAX reference on
# `kimi-k3-mini`; its pipeline on the timeline model (a prediction for a TPU7x, not a
# measurement); 8 tokens decoded; and the compile for TPU7x at the shapes of one rank of the full
# model. Terms (SMEM, ring, stage kind, roofline, bubble, …) are defined where they first appear
# and in [00 · glossary](00_megakernels_on_tpu.ipynb#The-glossary).

# %% [markdown]
# The terms this notebook uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Megakernel", "Stage", "Decode step", "Double buffering", "Ring slot", "Ref",
                    ".at[...]", "pl.ds", "pl.multiple_of", "pl.when", "BlockSpec", "Memory space",
                    "Scalar prefetch", "scratch_shapes", "make_async_copy", "DMA semaphore",
                    "lax.fori_loop", "RMSNorm", "Race detector", "Timeline", "Roofline fraction",
                    "Bubble", "Mosaic")

# %%
import functools
import inspect
import os
import textwrap
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma, weight_stream
from mkresearch.kernels.compose import megakernel, megakernel_body, schedule

from mkresearch.hardware import chips
from mkresearch.measurement import recorded
from mkresearch.model import reference, sampling, weights
from mkresearch.model.config import get_config, layer_pattern
from mkresearch.prediction import timeline
from mkresearch.sharding import layout
from mkresearch.views import exercises, facts, widgets
from mkresearch.views.label_plots import label_problems
from mkresearch.views.timeline_plots import legend_outside
from mkresearch.views.widgets import show_figure

# the kernels written below run race-checked: a DMA into a slot still being read is reported
tpu.interpret_options(detect_races=True, vector_clock_size=16)
LOGIT_TOL = 5e-2  # docs/kimi-k3.md §11: whole-step interpret-mode runs

# %% [markdown]
# ## 1 · A toy model and its reference
#
# A toy decoder small enough to read whole: `B = 8` rows, a hidden width `d` (128 here; 256
# further down) and a vocabulary of `V = 128` tokens. A token is embedded, goes through the
# layers, and the LM head gives its logits; the next token is the greedy argmax. Every layer is
# a residual stage of one of two **kinds**:
#
# | kind | weight matrices `[d, d]` | the layer |
# |---|---|---|
# | `mlp` | 2: W₀, W₁ | `x + relu(x W₀) W₁` |
# | `glu` | 3: W₀, W₁, W₂ | `x + (silu(x W₀) ⊙ x W₁) W₂` |
#
# As in the package, the weights of a kind are **stacked**: one HBM array per kind,
# `[layers of that kind, matrices, d, d]`, and a layer is an index into its kind's stack. The
# kernel moves them in **blocks** of one shape, `BLOCK = (R, C)` rows and columns (the ring's
# slot, a parameter): a `[d, d]` matrix is `d / C` column tiles of `d / R` row blocks each, one
# block at `d = 128` with the default `(128, 128)`. Products take bf16 inputs and accumulate in
# f32, as the package's kernels do, a column tile's row blocks added in order (`blocked`). The
# reference below is plain JAX, the toy's spec; it sums in the same order.

# %%
B, D, V = 8, 128, 128  # rows, hidden width, vocabulary
BLOCK = (128, 128)  # one weight block: rows, columns (the ring's slot)


def dot(x, w):  # [B, k] @ [k, n] -> [B, n] f32: bf16 inputs, f32 accumulation
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)


def matrix_blocks(k, n, block):
    """(first row, rows, first column, columns) of each block of a [k, n] matrix, in the order
    the ring streams them: column tiles of min(C, n) columns in turn, each tile's row blocks of
    R rows in turn."""
    rows, cols = block[0], min(block[1], n)
    return [(r, rows, c, cols) for c in range(0, n, cols) for r in range(0, k, rows)]


def blocked(x, weight, k, n, block):
    """x [B, k] @ W [k, n] f32 from W's blocks, weight(0), weight(1), ... in `matrix_blocks`
    order: each column tile's row-block products added in order, the tiles side by side."""
    rows, cols = block[0], min(block[1], n)
    tiles, j = [], 0
    for _ in range(0, n, cols):
        acc = None
        for r in range(0, k, rows):
            product = dot(x[:, r:r + rows], weight(j))
            acc = product if acc is None else acc + product
            j += 1
        tiles.append(acc)
    return jnp.concatenate(tiles, axis=1) if len(tiles) > 1 else tiles[0]


def blocked_dot(x, w, block=BLOCK):  # the reference's product, w [k, n] a whole array
    windows = matrix_blocks(*w.shape, block)
    return blocked(x, lambda j: w[windows[j][0]:sum(windows[j][:2]),
                                  windows[j][2]:sum(windows[j][2:])], *w.shape, block)


# the spec of each kind: (x [B, d] f32, w [matrices, d, d] bf16, v [vectors, d] f32 or None,
# mm: the product) -> x
REFERENCE = {
    "mlp": lambda x, w, v, mm: x + mm(jax.nn.relu(mm(x, w[0])), w[1]),
    "glu": lambda x, w, v, mm: x + mm(jax.nn.silu(mm(x, w[0])) * mm(x, w[1]), w[2]),
}
MATRICES = {"mlp": 2, "glu": 3}  # weight matrices per layer of each kind


def toy_params(pattern, matrices=MATRICES, seed=0, d=D, vectors=None):
    """Random weights of a toy model of width d whose layers are the kinds in `pattern`, in
    order; vectors: {kind: [d] vectors per layer} for the kinds that have some (norm gains)."""
    vectors = vectors or {}
    keys = iter(jax.random.split(jax.random.key(seed), len(matrices) + len(vectors) + 2))

    def normal(shape, scale):
        return jax.random.normal(next(keys), shape) * scale

    return {"pattern": tuple(pattern), "embed": normal((V, d), 1.0).astype(jnp.bfloat16),
            "stacks": {k: normal((pattern.count(k), n, d, d), d**-0.5).astype(jnp.bfloat16)
                       for k, n in matrices.items()},
            "vectors": {k: 1 + normal((pattern.count(k), n, d), 0.1) for k, n in vectors.items()},
            "head": normal((d, V), d**-0.5).astype(jnp.bfloat16)}


def toy_reference(params, tokens, spec=REFERENCE, block=BLOCK):
    """tokens [B] -> logits [B, V] f32 of the next token."""
    mm = functools.partial(blocked_dot, block=block)
    x = params["embed"][tokens].astype(jnp.float32)  # [B, d]
    for layer, kind in enumerate(params["pattern"]):
        index = params["pattern"][:layer].count(kind)  # its place in the kind's stack
        v = params["vectors"][kind][index] if kind in params["vectors"] else None
        x = spec[kind](x, params["stacks"][kind][index], v, mm)
    return mm(x, params["head"])


toy = toy_params(("mlp", "glu"))  # layer 0: mlp, layer 1: glu
tokens = jnp.arange(B, dtype=jnp.int32) * 13 % V

# %% [markdown]
# ## 2 · The toy megakernel
#
# **The layer table, by scalar prefetch.** The kernel must know, for layer `l`, its kind and its
# index in that kind's stack. These are data, not Python: `table = [kind₀, index₀, kind₁,
# index₁, …]` int32. `pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1)` hands the first
# operand to the kernel in **SMEM**, the scalar core's memory, before the body starts. A scalar
# read from SMEM (`table[2 * l]`) is what steers control flow on a TPU: `lax.switch`, `pl.when`
# and the addresses of DMAs all take such scalars.
#
# **The bodies of the kinds.** A kind's body computes its layer from `x` and `matmul(x, m)`,
# the product with the layer's matrix `m`, its blocks already in VMEM (and `vector(i)`, below).
# The body does not know where the blocks came from: that is the ring's business, below.

# %%
from collections.abc import Callable
from typing import NamedTuple

from mkresearch.model import numerics


class Kind(NamedTuple):
    """A stage kind of the toy: its [d, d] weight matrices per layer (streamed in blocks), its
    body(x, matmul, vector) -> x, and its [d] vectors per layer (a norm gain: their own small
    operand, not a weight block)."""
    matrices: int
    body: Callable
    vectors: int = 0


def mlp_body(x, matmul, vector):  # x [B, d] f32; matmul(x, m) -> x @ W_m [B, d] f32
    h = jax.nn.relu(matmul(x, 0))
    return x + matmul(h, 1)


def glu_body(x, matmul, vector):
    gate = matmul(x, 0)
    up = matmul(x, 1)
    return x + matmul(jax.nn.silu(gate) * up, 2)


TOY_KINDS = {"mlp": Kind(2, mlp_body), "glu": Kind(3, glu_body)}

# %% [markdown]
# **The loop, the switch and the ring.** The weight blocks of the whole step form one sequence
# `g = 0, 1, 2, …`: layer 0's blocks, then layer 1's, …, then the LM head's. Block `g` goes
# through slot `g mod 2` of ONE ring of two VMEM slots of the block's shape, with one DMA
# semaphore per slot (the ring of notebook 01). Before it waits for block `g`, the kernel starts
# block `g + 1` into the other slot, free since block `g − 1` was used. Inside a layer, block
# `g + 1` is the layer's next block; at the layer's last block it is **the next layer's first
# block**, whose kind the kernel reads from the table: one `pl.when` per kind picks the stack it
# comes from (after the last layer, the head). So the DMA engine never waits for a layer boundary.
# A block is a window of its matrix, `stack.at[index, m, rows, cols]` (strided when `C < d`,
# notebook 04's column tiles), landing in its slot's top-left corner.
#
# The layers run in `lax.fori_loop`, with `g` in the loop's carry. Each iteration calls
# `lax.switch(kind, branches)`: one branch per kind, traced once, whatever the depth. Each branch
# returns `g` past its blocks, so a kind with more blocks moves the sequence further.
#
# **The contracts.** What a kind may assume, and what it owes:
#
# - `weight(j)`, the kernel's primitive, returns block `j` of the layer's sequence
#   (`j = 0 … n − 1`, `n` = matrices × blocks per matrix) once it has landed, after starting
#   block `j + 1` (at `j = n − 1`: the next layer's first block). So **each `j` is asked for once,
#   in order**: a skipped `j` leaves its copy unwaited and the next layer's first block unstarted
#   (a wait that never returns), a repeated one starts a block twice. `matmul(x, m)` asks for
#   matrix `m`'s blocks in order; a body that uses each of its matrices once, `m = 0, 1, …` in
#   order, keeps the contract, and the kernel refuses one that does not while it is traced, in one
#   line naming the kind.
# - `vector(i)` is the layer's vector `i` as `[1, d]` f32: the vectors of a kind's layer come in
#   their own small operand `[layers, vectors, d]`, one DMA of `vectors · d · 4` bytes per layer
#   into their own VMEM buffer, never a padded weight block.
# - Every kind the kernel has a branch for has a layer in the pattern: its stack is
#   `[layers of the kind, …]`, and an empty operand is refused by the layer table
#   (`weight_stream.kind_table`, the package's) in one line naming the kind.

# %%
def toy_megakernel(table, x_ref, *refs, kinds, block):
    # table [2 L] i32 (SMEM): layer l's kind and its index in that kind's stack; x_ref [B, d]
    # f32 (VMEM); per kind its stack [n, matrices, d, d] bf16, then per kind with vectors its
    # vectors [n, vectors, d] f32, then head [d, V] bf16 (HBM, pl.ANY); logits_ref [B, V] f32
    # (VMEM); scratch: h [B, d] f32, ring [2, R, C] bf16, sems: 2 DMA, vec [vectors, d] f32,
    # vec_sem: 1 DMA
    with_vectors = [k for k, kind in enumerate(kinds) if kind.vectors]
    stacks = refs[:len(kinds)]
    vector_stacks = dict(zip(with_vectors, refs[len(kinds):len(kinds) + len(with_vectors)]))
    head, logits_ref, h, ring, sems, vec, vec_sem = refs[len(kinds) + len(with_vectors):]
    n_layers, d = table.shape[0] // 2, h.shape[1]
    per_matrix = matrix_blocks(d, d, block)  # a [d, d] matrix's block windows

    def copy(src, g):  # block g of the step's one sequence -> ring slot g mod 2, its corner
        slot = lax.rem(g, 2)
        rows, cols = src.shape
        return pltpu.make_async_copy(src, ring.at[slot, pl.ds(0, rows), pl.ds(0, cols)],
                                     sems.at[slot])

    def layer_block(k, index, j):  # block j of a kind-k layer: matrix j // blocks per matrix
        r, rows, c, cols = per_matrix[j % len(per_matrix)]
        return stacks[k].at[index, j // len(per_matrix), pl.ds(r, rows), pl.ds(c, cols)]

    def head_block(j):
        r, rows, c, cols = matrix_blocks(d, head.shape[1], block)[j]
        return head.at[pl.ds(r, rows), pl.ds(c, cols)]

    def start_first_block(layer, g):  # block 0 of `layer`, whatever its kind; after the last: head
        @pl.when(layer == n_layers)
        def _():
            copy(head_block(0), g).start()

        last = jnp.minimum(layer, n_layers - 1)  # a valid row to read the kind from
        for k in range(len(kinds)):  # the kind is data: one pl.when per kind
            @pl.when((layer < n_layers) & (table[2 * last] == k))
            def _(k=k):
                copy(layer_block(k, table[2 * layer + 1], 0), g).start()

    def weights(source, n_blocks, g, after, asked):
        """weight(j) of a sequence of n_blocks blocks numbered from g: start block j + 1 (past
        the last: `after`, the next layer's first block), wait for block j, its value."""
        def weight(j):
            asked.append(j)
            if j + 1 < n_blocks:
                copy(source(j + 1), g + j + 1).start()
            else:
                after(g + n_blocks)
            copy(source(j), g + j).wait()
            rows, cols = source(j).shape
            return ring[lax.rem(g + j, 2), pl.ds(0, rows), pl.ds(0, cols)]

        return weight

    def branch(k):  # lax.switch's branch for kind k: the layer's blocks are g, g + 1, ...
        kind, n_blocks = kinds[k], kinds[k].matrices * len(per_matrix)

        def run(layer, g):
            index, asked = table[2 * layer + 1], []
            weight = weights(functools.partial(layer_block, k, index), n_blocks, g,
                             functools.partial(start_first_block, layer + 1), asked)

            def matmul(x, m):  # x @ the layer's matrix m, from its blocks in order
                return blocked(x, lambda t: weight(m * len(per_matrix) + t), d, d, block)

            if kind.vectors:  # this layer's vectors: one small DMA into their own buffer
                load = pltpu.make_async_copy(vector_stacks[k].at[index],
                                             vec.at[pl.ds(0, kind.vectors)], vec_sem)
                load.start()
                load.wait()
            h[...] = kind.body(h[...], matmul, lambda i: vec[pl.ds(i, 1)])
            if asked != list(range(n_blocks)):
                raise ValueError(f"kind {k} ({kind.body.__name__}) asked for the blocks "
                                 f"{asked}: weight(j) is asked once for each j = 0 … "
                                 f"{n_blocks - 1}, in order (each matrix used once, in order)")
            return g + n_blocks  # the sequence continues past this layer's blocks

        return run

    start_first_block(0, 0)  # the prologue: layer 0's first block flies while x is loaded
    h[...] = x_ref[...]
    branches = [branch(k) for k in range(len(kinds))]
    g = lax.fori_loop(0, n_layers, lambda layer, g: lax.switch(table[2 * layer], branches,
                                                                    layer, g), 0)
    n_head = len(matrix_blocks(d, head.shape[1], block))  # started by the last layer's last block
    head_weight = weights(head_block, n_head, g, lambda g: None, [])
    logits_ref[...] = blocked(h[...], head_weight, d, head.shape[1], block)


# %% [markdown]
# The wrapper: the table from the pattern (the package's `weight_stream.kind_table`: a kind id
# and an index per layer), the embedding row gather in plain JAX (the package does it in the
# kernel, by DMA), and the `pallas_call` with the table as its scalar-prefetch operand. The
# stacks, the vectors and the head stay in HBM (`pl.ANY`); the kernel moves them itself.

# %%
def layer_table(pattern, kind_names):
    """[kind id, index within the kind's stack] per layer, flattened: the SMEM table. A kind
    without a layer is refused here, by name (its stack would be an empty operand)."""
    return jnp.asarray(weight_stream.kind_table(pattern, kind_names), jnp.int32)


@functools.partial(jax.jit, static_argnames=("kinds", "interpret", "block"))
def toy_call(table, x, stacks, head, kinds, interpret, vectors=(), block=BLOCK):
    rows, d = x.shape
    hbm, vmem = pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(
        functools.partial(toy_megakernel, kinds=kinds, block=block),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,  # the first operand, the table, lands in SMEM
            grid=(),  # one invocation: the whole step
            in_specs=[vmem] + [hbm] * (len(stacks) + len(vectors) + 1),
            out_specs=vmem,
            scratch_shapes=[pltpu.VMEM((rows, d), jnp.float32),  # h: the hidden state
                            pltpu.VMEM((2, *block), jnp.bfloat16),  # the ring's two slots
                            pltpu.SemaphoreType.DMA((2,)),  # one per slot
                            pltpu.VMEM((max([k.vectors for k in kinds] + [1]), d), jnp.float32),
                            pltpu.SemaphoreType.DMA(())]),  # the vectors' buffer, its own
        out_shape=jax.ShapeDtypeStruct((rows, head.shape[1]), jnp.float32),
        interpret=interpret,  # None: compiled for a TPU; else TPU interpret mode's parameters
    )(table, x, *stacks, *vectors, head)


def toy_step(params, tokens, kinds=TOY_KINDS, block=BLOCK):
    """tokens [B] -> logits [B, V] f32, the whole step in one pallas_call."""
    names = tuple(kinds)
    table = layer_table(params["pattern"], names)
    stacks = [params["stacks"][name] for name in names]
    vectors = tuple(params["vectors"][name] for name in names if kinds[name].vectors)
    x = params["embed"][tokens].astype(jnp.float32)
    return toy_call(table, x, stacks, params["head"], kinds=tuple(kinds.values()),
                    interpret=tpu.interpret_params(), vectors=vectors, block=block)


def toy_decode(step, params, tokens, n):
    """n greedy tokens per row from `step` (the kernel or the reference) -> [B, n]."""
    out = []
    for _ in range(n):
        tokens = jnp.argmax(step(params, tokens), axis=-1).astype(jnp.int32)
        out.append(tokens)
    return np.stack(out, axis=1)


# %% [markdown]
# The sequence the ring walks for this toy (layer 0 `mlp`, layer 1 `glu`, then the head), and
# when each block is started: always while the block before it is still to be waited for.

# %%
def ring_walk(pattern, matrices=MATRICES, d=D, block=BLOCK):
    """(block g, what it is, its slot) of a toy model's one sequence of weight blocks."""
    per = len(matrix_blocks(d, d, block))
    walk = [f"L{layer} {kind}.W{m}" + (f"[{t}]" if per > 1 else "")
            for layer, kind in enumerate(pattern) for m in range(matrices[kind])
            for t in range(per)]
    walk += [f"head[{t}]" if per > 1 else "head" for t in range(len(matrix_blocks(d, V, block)))]
    return [(g, what, g % 2) for g, what in enumerate(walk)]


for g, what, slot in ring_walk(toy["pattern"]):
    started = "before the loop" if g == 0 else f"before waiting for block {g - 1}"
    print(f"block {g}: {what:9s} slot {slot}, started {started}")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the toy megakernel against the toy reference: one step, then 4 greedy tokens
tpu.reset_races()
toy_logits = toy_step(toy, tokens)
want = toy_reference(toy, tokens)
np.testing.assert_allclose(toy_logits, want, rtol=1e-5, atol=1e-5)
assert not tpu.races_found()  # no DMA wrote a slot while it was read
decoded, expected_tokens = (toy_decode(step, toy, tokens, 4) for step in (toy_step, toy_reference))
assert np.array_equal(decoded, expected_tokens)
print(f"one step, logits [B, V]: {facts.bound(float(jnp.max(jnp.abs(toy_logits - want))), 1e-5)}; "
      f"no race found")
print(f"4 greedy tokens for each of the {B} rows equal the reference's: "
      f"{np.array_equal(decoded, expected_tokens)}")

# %% [markdown]
# The kernel is traced once per kind, not once per layer: a toy of 8 layers traces to exactly
# the kernel of 2 (only the table, an operand, is longer).

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the traced toy kernel does not grow with the depth


def kernel_equations(jaxpr):
    """Equations of a jaxpr, nested jaxprs (loop and switch bodies, the kernel) counted."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (tuple, list)) else [value]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += kernel_equations(inner)
    return total


def toy_equations(pattern):
    params = toy_params(pattern)
    return kernel_equations(jax.make_jaxpr(functools.partial(toy_step, params))(tokens).jaxpr)


toy_sizes = {n: toy_equations(("mlp", "glu") * (n // 2)) for n in (2, 8)}
print("  ".join(f"{n} layers: {size} traced equations" for n, size in toy_sizes.items()))
assert toy_sizes[2] == toy_sizes[8]

# %% [markdown]
# ### Your turn: a third kind
#
# Add a kind `tanh` of **one** weight matrix: the layer is `x + tanh(x W₀)`. Write its body over
# `matmul(x, m)` and register it in `MY_KINDS` as a `Kind` with its number of matrices. The
# kernel itself should not need a change: the switch gets a third branch, the table a third kind
# id, and the ring walks a sequence in which, at a `tanh` layer, *every* block is a layer's last,
# so each wait comes after the next layer's first block has started. The check builds a 4-layer
# toy `mlp, tanh, tanh, glu`, runs your kinds in the kernel above, and compares the logits and 3
# greedy tokens with the reference (which it extends with `tanh`'s spec), race detector on.

# %%
def my_tanh_body(x, matmul, vector):  # x [B, d] f32; matmul(x, m) -> x @ W_m [B, d] f32
    raise NotImplementedError("x + tanh(x W0)")


MY_KINDS = {**TOY_KINDS, "tanh": Kind(None, my_tanh_body)}  # Kind(matrices, body)


# %%
def check_third_kind(kinds):
    matrices, body = kinds["tanh"].matrices, kinds["tanh"].body
    body(jnp.zeros((B, D), jnp.float32), lambda x, m: jnp.zeros((B, D), jnp.float32), None)
    assert matrices == 1, f"tanh has 1 weight matrix per layer, MY_KINDS says {matrices}"
    spec = {**REFERENCE, "tanh": lambda x, w, v, mm: x + jnp.tanh(mm(x, w[0]))}
    params = toy_params(("mlp", "tanh", "tanh", "glu"), {**MATRICES, "tanh": 1}, seed=1)
    tpu.reset_races()
    got = toy_step(params, tokens, kinds)
    assert not tpu.races_found(), "the race detector saw a DMA write a slot while it was read"
    err = float(jnp.max(jnp.abs(got - toy_reference(params, tokens, spec))))
    assert err <= 1e-5, f"max |logit error| against the reference is {err:.3g}"
    mine = toy_decode(lambda p, t: toy_step(p, t, kinds), params, tokens, 3)
    assert np.array_equal(mine, toy_decode(functools.partial(toy_reference, spec=spec), params,
                                           tokens, 3)), "the greedy tokens differ"


exercises.check("a third kind", lambda: check_third_kind(MY_KINDS));


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: a third kind (double-click to open)
# NBVAL_CHECK_OUTPUT
def tanh_body(x, matmul, vector):
    return x + jnp.tanh(matmul(x, 0))


assert exercises.check("a third kind", lambda: check_third_kind({**TOY_KINDS,
                                                                  "tanh": Kind(1, tanh_body)}))

# %% [markdown]
# ### A wider toy, in other blocks, with a vector
#
# `d` and the block shape are parameters. At `d = 256` a `[d, d]` matrix is 2 blocks of
# `[128, 256]` (row blocks, contiguous windows) or 4 of `[128, 128]` (column tiles of row
# blocks: strided windows, notebook 04), and the bodies above run unchanged: `matmul` asks for
# the blocks. A fourth kind, `norm_mlp`, normalises its input first,
# `x + relu(RMSNorm_γ(x) W₀) W₁`, with a gain γ `[d]` per layer: a **vector**, in the kind's
# vector operand `[layers, 1, d]` f32, one DMA of `d · 4` bytes per layer. As a weight block it
# would be a padded `[R, C]` bf16 block in the ring: 128 × 256 × 2 bytes at this block shape,
# for 1 KiB of gain.

# %%
def rms(x, gamma):  # x [B, d] f32, gamma [1, d] f32: RMSNorm in the reference's order (notebook 04)
    scale = numerics.rms_scale(numerics.ordered_sum(x * x, keepdims=True), x.shape[1], 1e-6)
    return x * scale * gamma


def norm_mlp_body(x, matmul, vector):
    return x + matmul(jax.nn.relu(matmul(rms(x, vector(0)), 0)), 1)


WIDE_KINDS = {**TOY_KINDS, "norm_mlp": Kind(2, norm_mlp_body, vectors=1)}
WIDE_SPEC = {**REFERENCE, "norm_mlp": lambda x, w, v, mm: x + mm(jax.nn.relu(mm(rms(x, v[0:1]),
                                                                                 w[0])), w[1])}
wide = toy_params(("mlp", "norm_mlp", "glu", "norm_mlp"), {**MATRICES, "norm_mlp": 2}, seed=2,
                  d=256, vectors={"norm_mlp": 1})
wide_runs = {}
for wide_block in ((128, 256), (128, 128)):
    tpu.reset_races()
    wide_runs[wide_block] = (toy_step(wide, tokens, WIDE_KINDS, wide_block),
                             toy_reference(wide, tokens, WIDE_SPEC, wide_block),
                             tpu.races_found())

# %%
# NBVAL_CHECK_OUTPUT
# Checks · d = 256 in two block shapes, a kind with a vector, against the toy reference
for wide_block, (got, ref, raced) in wide_runs.items():
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert not raced and np.array_equal(np.argmax(got, -1), np.argmax(ref, -1))
    walk = ring_walk(wide["pattern"], {**MATRICES, "norm_mlp": 2}, d=256, block=wide_block)
    print(f"d = 256, blocks of {list(wide_block)}: {len(walk)} blocks through the ring "
          f"({len(matrix_blocks(256, 256, wide_block))} per matrix); logits equal the reference's "
          f"within 1e-5; greedy tokens equal; no race")
print(f"a norm_mlp layer's gain: one DMA of {256 * 4} B, where a padded [128, 256] bf16 block "
      f"would move {128 * 256 * 2:,} B")

# %% [markdown]
# The contracts are checked, not only stated: a body that asks for its matrices out of order,
# and a pattern that leaves a kind of the kernel without a layer, are each refused while the
# kernel is traced, in one line naming the kind (the second by the package's layer table).

# %%
def out_of_order_body(x, matmul, vector):  # uses W1 before W0: the ring would be out of step
    return x + matmul(jax.nn.relu(matmul(x, 1)), 0)


contract_lines = []
for broken in (lambda: toy_step(toy, tokens, {**TOY_KINDS, "mlp": Kind(2, out_of_order_body)}),
               lambda: toy_step(toy_params(("mlp", "mlp")), tokens)):
    try:
        broken()
    except ValueError as error:
        contract_lines.append(str(error))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the contracts refused in one line each, naming the kind
for line in contract_lines:
    print(line)
assert len(contract_lines) == 2 and all("\n" not in line for line in contract_lines)
assert "out_of_order_body" in contract_lines[0] and "'glu'" in contract_lines[1]

# %% [markdown]
# ### From a toy kind to a package stage
#
# A kind of the package is the toy's `Kind` grown two sides, registered once each, by name
# (`kernels/base/registry.py`): the **model side** (`mkresearch.model.spec.Stage`: its weights,
# with their shapes and how they shard, and its reference sublayer, the spec) and the **kernel
# side** (`registry.KernelStage`: its plan, the matrices it streams through the global ring in
# order (`streamed`: the toy's "each matrix once, in order", as a list the planner reads), and
# its body over Refs (`StageRefs`: `x`, `out`, its weights, the stream)). The planner, the
# step's schedule, the VMEM plan, the byte counts and the sharded layout then read the kind
# from those two entries: nothing else lists it. Below, the toy's `tanh` kind as a package FFN
# kind, `m = bf(tanh(x W))`, on `kimi-k3-mini`'s layers, planned and scheduled with nothing run
# (`tests/test_registry.py` runs such a kind through the megakernel against the reference).

# %%
from mkresearch.kernels.base import blocks, registry
from mkresearch.model import spec


def tanh_sublayer(p, x, layer_state, positions, cfg):  # the model side's spec: plain JAX
    return numerics.bf(jnp.tanh(numerics.matmul(x, p["w"]))), layer_state, {}


def tanh_stage_body(plan, refs):  # the kernel side: the toy's body, over the package's Refs
    rows = blocks.weight_block_rows(tuple(refs.weights["w"].shape), jnp.bfloat16)
    product = blocks.stream_matmul(refs.stream, refs.x[...], refs.weights["w"], rows=rows,
                                   name="tanh.w", **refs.indices)  # from the ring, in order
    refs.out[...] = jnp.tanh(product).astype(jnp.bfloat16)


spec.register(spec.Stage(
    name="toy_tanh", role=spec.FFN, sublayer=tanh_sublayer, component=("toy_tanh", lambda cfg: "tanh FFN"),
    params=lambda cfg: {"w": spec.matrix(cfg.d_model, cfg.d_model,
                                         shard=spec.split(1, spec.MODEL_COLS))}))
registry.register(registry.KernelStage(
    name="toy_tanh", plan=lambda cfg, batch, seq_len, options: ("toy_tanh", batch),
    prepare=lambda stack, cfg: dict(stack), body=tanh_stage_body, scope=lambda plan: "toy_tanh",
    streamed=lambda cfg: (registry.Streamed("w", "tanh.w", (cfg.d_model, cfg.d_model)),)))
try:
    tanh_cfg = get_config("kimi-k3-mini", ffn="toy_tanh", n_dense_layers=0, ring_depth=2)
    tanh_plan = megakernel.make_plan(tanh_cfg, 2, tanh_cfg.max_seq_len)
    tanh_dmas = [dma_ for dma_ in schedule.schedule(tanh_plan).starts if dma_.stage == "toy_tanh"]
    tanh_shapes = weights.param_shapes(tanh_cfg)["toy_tanh"]["w"].shape
finally:
    spec.unregister("toy_tanh")
    registry.unregister("toy_tanh")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the toy kind as a package stage: planned and scheduled from its two registered sides
print(f"kimi-k3-mini with FFN kind toy_tanh: {tanh_cfg.n_layers} layers, its stacked weight "
      f"{list(tanh_shapes)}")
print(f"the planner streams its matrix on the global ring: "
      f"{[entry.name for entry in tanh_plan.stream.entries('toy_tanh')]}")
print(f"its DMAs in the step's schedule: {len(tanh_dmas)}, one per layer "
      f"{[dma_.layer for dma_ in tanh_dmas]}, each {tanh_dmas[0].nbytes:,} B")
assert [dma_.layer for dma_ in tanh_dmas] == list(range(tanh_cfg.n_layers))
assert "toy_tanh" not in registry.registered()  # unregistered again

# %% [markdown]
# ### Your turn: the embedding rows by DMA
#
# The toy gathers its embedding rows in plain JAX before the call; the package's megakernel
# gathers them inside it, by DMA, before the layer loop. A row cannot be copied alone: HBM
# arrays are **tiled**, bf16 rows in groups of 16, so a DMA of the table starts at a row that is
# a multiple of 16 (notebook 02's in-place write met the same rule). Write `my_embed_kernel`:
# for each of the `B` rows, copy the aligned 16-row block of `embed_hbm` holding its token into
# its own slot `blocks.at[b]` (each with its own semaphore, all `B` in flight at once), then wait
# for each and write its token's row, as f32, into `x_ref[b]`. The check compares with
# `toy["embed"][tokens]`, race detector on, and compiles the kernel for TPU7x with Mosaic.

# %%
EMBED_ROWS = 16  # bf16 rows of one HBM tile


def my_embed_kernel(tokens_ref, embed_hbm, x_ref, blocks, sems):
    # tokens_ref [B] i32 (SMEM); embed_hbm [V, d] bf16 (HBM); x_ref [B, d] f32 (VMEM);
    # scratch: blocks [B, 16, d] bf16 (VMEM), sems: B DMA semaphores
    raise NotImplementedError("copy each row's aligned block, then pick its row")


# %%
def run_embed(kernel, tokens, embed):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((tokens.shape[0], embed.shape[1]), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((tokens.shape[0], EMBED_ROWS, embed.shape[1]), embed.dtype),
                        pltpu.SemaphoreType.DMA((tokens.shape[0],))],
        interpret=tpu.interpret_params(),
    )(tokens, embed)


def check_embed(kernel):
    rows = jnp.array([0, 15, 16, 17, 100, 127, 64, 3], jnp.int32)  # block edges included
    for chosen in (tokens, rows):
        got = exercises.race_free(lambda chosen=chosen: np.asarray(run_embed(kernel, chosen,
                                                                             toy["embed"])))
        want = np.asarray(toy["embed"][chosen].astype(jnp.float32))
        assert np.array_equal(got, want), (
            f"rows {np.flatnonzero((got != want).any(1)).tolist()} are not their tokens' rows")
    exercises.compiles(lambda t, e: run_embed(kernel, t, e), tokens, toy["embed"])


exercises.check("the embedding rows by DMA", lambda: check_embed(my_embed_kernel))


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: the embedding rows by DMA (double-click to open)
# NBVAL_CHECK_OUTPUT
def embed_solution(tokens_ref, embed_hbm, x_ref, blocks, sems):
    rows = blocks.shape[1]

    def copy(b):  # the aligned block holding row b's token -> slot b, semaphore b
        first = pl.multiple_of(lax.div(tokens_ref[b], rows) * rows, rows)
        return pltpu.make_async_copy(embed_hbm.at[pl.ds(first, rows)], blocks.at[b], sems.at[b])

    for b in range(blocks.shape[0]):  # all B in flight
        copy(b).start()
    for b in range(blocks.shape[0]):
        copy(b).wait()
        hit = lax.broadcasted_iota(jnp.int32, blocks.shape[1:], 0) == lax.rem(tokens_ref[b], rows)
        x_ref[pl.ds(b, 1), :] = jnp.sum(jnp.where(hit, blocks[b].astype(jnp.float32), 0.0),
                                        axis=0, keepdims=True)


assert exercises.check("the embedding rows by DMA", lambda: check_embed(embed_solution))

# %% [markdown]
# ## 3 · The package's megakernel: the same three ideas, at full scale
#
# `mkresearch.kernels.compose.megakernel` is the toy grown up. Where each idea lives:
#
# | the toy | the package |
# |---|---|
# | the table `[kind, index]` per layer, by scalar prefetch | `weight_stream.layer_table(cfg)`: four int32 per layer (attention kind, its index, FFN kind, its index) in `StepInputs.table`, an SMEM operand of the grid-less call |
# | `lax.switch(table[2 l], branches)` | `_run_stage` (`kernels/compose/megakernel_body.py`): per layer, a `lax.switch` over the kinds the model uses for attention, then one over its FFN kinds; each branch is the **registered** kind's stage body (`kernels.base.registry`): the bodies of notebooks 02–05, called on Refs |
# | `stacks[k].at[index, j]` | `_layer_refs(w[kind], index)`: every stacked weight of the kind viewed `.at[index]` |
# | a ring of 2 slots, 1 block ahead, `g` in the loop's carry | `weight_stream.GlobalStream`: `cfg.ring_depth` slots of up to `cfg.ring_block_bytes`, `depth − 1` blocks ahead, the ring's position in SMEM; `StageStream._start_ahead` crosses into this layer's FFN or the next layer's attention with one `pl.when` per kind |
#
# What the toy leaves out and the package adds: two stages per layer with the residual strategy
# between them (Kimi K3's attention residuals, docs/kimi-k3.md §3); each stage's own VMEM
# buffers (`pl.run_scoped`: a stage's buffers are freed for the next stage's); the experts'
# weights in their own ring, started right after routing, KV tiles and the KDA state in double
# buffers; the embedding gather (a DMA per row) and the LM head with sampling in the same call;
# every DMA listed before the step runs, by running the kernel itself on shapes
# (`kernels.compose.schedule`, section 5) and logged as it runs (`dma.recording()`); on several ranks, the collectives inside the kernel (notebook 08).
#
# The two pieces of the package that are the toy's loop and ring, as they are written there:

# %%
# kernels/compose/megakernel_body.py: the loop over layers, a layer's two stages, each a switch
# over its role's kinds, and a kind's body on its Refs with its blocks from the ring (the step
# runs `lax.fori_loop(0, cfg.n_layers, trunk.layer_step, 0)`)
for piece in (megakernel_body._Trunk.layer_step, megakernel_body._Trunk._run_stage,
              megakernel_body._Trunk._run_body):
    print(textwrap.dedent(inspect.getsource(piece)))

# %%
# kernels/base/weight_stream.py: the block `depth - 1` ahead, in this stage or past its end
print(inspect.getsource(weight_stream.StageStream._start_ahead))

# %% [markdown]
# ### Two layers of `kimi-k3-mini`, one of each kind
#
# The smallest model with every kind of layer: layer 0 is KDA attention + the dense FFN, layer 1
# MLA attention + the MoE FFN (router, routed latent experts, shared experts). One call runs the
# embedding row gather, both layers with their attention-residual mixes, and the LM head with
# sampling, and is checked against `reference.decode_step` followed by greedy sampling.

# %%
def run_step(cfg, params, batch, options=megakernel.MegakernelOptions(), position=5, seed=0):
    """One recorded megakernel step vs reference.decode_step + sampling.sample (greedy), and
    the step's schedule (every DMA, planned from the positions and the reference's routing)."""
    prompt = jax.random.randint(jax.random.key(seed), (batch, position + 1), 0, cfg.vocab_size)
    state = reference.init_state(cfg, batch)
    _, state = reference.prefill(params, state, prompt[:, :-1], cfg)
    tokens, positions = prompt[:, -1], np.full(batch, position, np.int32)
    logits, _, ref_aux = reference.decode_step(params, state, tokens, positions, cfg)
    ref_tokens = sampling.sample(logits, seed=0, positions=positions + 1)
    prepared = megakernel.prepare_weights(params, cfg)
    with dma.recording() as log:
        out, _, aux = megakernel.decode_step(prepared, jax.tree.map(jnp.copy, state), tokens,
                                             positions, cfg, options=options, return_logits=True,
                                             expert_ids=ref_aux.get("expert_ids"))
        jax.block_until_ready(out)
    diff = float(jnp.max(jnp.abs(aux["logits"] - logits)))
    step = schedule.schedule(aux["plan"], positions, ref_aux["expert_ids"])
    return {"log": log, "plan": aux["plan"], "tokens_equal": bool(np.all(out == ref_tokens)),
            "logits_ok": diff <= LOGIT_TOL, "diff": diff, "schedule": step,
            "log_is_schedule": step.mismatch(log) is None}


two = get_config("kimi-k3-mini", n_layers=2, mla_first=1)
two_params = weights.init_params(two, 0)
tpu.reset_races()
one_layer = run_step(two, two_params, batch=2)

# %% [markdown]
# The DMA log of that call, replayed by the **timeline model** (`mkresearch.prediction.timeline`,
# notebook 01): every weight block, state read/write and KV tile is one span on the DMA engine,
# the compute phases below. It is a model of a TPU7x from its published HBM bandwidth and MXU
# peak and from an *assumed* DMA latency and engine count, not a measurement: every such figure
# says MODELLED in its title.

# %%
MODELLED = "MODELLED (timeline model of a TPU7x, not measured)"


def show_timeline(log, title, chip="tpu7x", window_us=None, marks=()):
    """The timeline model's replay of `log` as a Gantt chart -> (the timeline, the figure);
    marks: (µs, label) vertical lines."""
    simulated = timeline.simulate(log, chip)
    fig, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
    where = (f"{simulated.total_s * 1e6:.1f} µs" if window_us is None else
             f"{window_us[0]:.1f}–{window_us[1]:.1f} µs of a {simulated.total_s * 1e6:.1f} µs step")
    widgets.plot_gantt(simulated, ax, window_us=window_us, title=(
        f"{title}: {MODELLED}\n{where}, {simulated.roofline_fraction:.0%} of the HBM roofline"))
    lines = [ax.axvline(t, color=color, linestyle="--", label=label)
             for (t, label), color in zip(marks, ("#2ca02c", "#9467bd"))]
    if lines:
        legend_outside(ax, ax.get_legend().legend_handles + lines)
    show_figure(fig)  # described: an HTML export gives the picture its title
    return simulated, fig


two_timeline, two_fig = show_timeline(one_layer["log"], "2 layers of kimi-k3-mini, one call")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the package's megakernel on two layers against the reference
print(f"layers: {layer_pattern(two)} (K = KDA, M = MLA), dense {two.dense_layers}, "
      f"MoE {two.moe_layers}; SMEM table {list(weight_stream.layer_table(two))}")
print(f"greedy tokens equal the reference: {one_layer['tokens_equal']}; logits within "
      f"{LOGIT_TOL}: {one_layer['logits_ok']}; no race found: {not tpu.races_found()}")
assert one_layer["tokens_equal"] and one_layer["logits_ok"] and not tpu.races_found()
assert not label_problems(two_fig)  # the figure: no label runs into another, none is cut

# %% [markdown]
# ## 4 · The layer loop does not grow with the depth
#
# As in the toy: the traced kernel is one `lax.fori_loop` body with a switch per role, so the
# depth is only the table's length. Only the attention-residual mix grows a little with the
# number of *blocks* of layers (one `lax.switch` branch per possible candidate count,
# ⌈L / block⌉ + 1): at the same block count, 7 and 9 layers trace to exactly the same kernel.

# %%
mini = get_config("kimi-k3-mini")
configs = {"2 layers": two, "kimi-k3-mini, 7 layers": mini,
           "kimi-k3-mini with 9 layers": mini.replace(n_layers=9)}


def package_equations(cfg, batch=1):
    plan = megakernel.make_plan(cfg, batch, cfg.max_seq_len)
    return kernel_equations(jax.make_jaxpr(megakernel.step_fn(plan))(
        *megakernel.step_shapes(plan)).jaxpr)


sizes = {name: package_equations(cfg) for name, cfg in configs.items()}

# %%
# NBVAL_CHECK_OUTPUT
# Checks · traced equations of the package's megakernel by depth
for name, n in sizes.items():
    print(f"{name:28s} {configs[name].n_blocks} residual blocks  {n} traced equations")
assert sizes["kimi-k3-mini, 7 layers"] == sizes["kimi-k3-mini with 9 layers"]

# %% [markdown]
# ## 5 · The global ring on the 7 layers of `kimi-k3-mini`
#
# `kimi-k3-mini` has 7 layers (KDA 0, 1, 2, 4, 5 and MLA 3, 6; dense layer 0, MoE after). First
# **without** the global weight stream: each stage body streams its matrices through its own
# two-slot ring, which starts cold at every matrix. Then with it (the default): every stage
# draws its blocks from ONE ring of `cfg.ring_depth` slots, and block `g + depth − 1` of the
# sequence is started before block `g` is waited for, past the stage's end if need be: your
# toy's ring, `depth − 1` blocks ahead instead of one. Expert weights keep their own slots,
# issued right after routing; KV tiles and the KDA state their own double buffers.
#
# That order is known before the step runs: `schedule.schedule(plan, positions, expert_ids)`
# lists every DMA the step will issue (name, bytes, slot, layer, stage) by running the kernel
# itself on shapes, only its scalar work computed (`kernels/base/dry_run.py`), from the same plan
# the kernel runs (`mkresearch plan MODEL` prints its summary). The recorded DMA log of
# the step equals it event for event, and the prefetch checks below read it.

# %%
mini_params = weights.init_params(mini, 0)
no_ring = run_step(mini, mini_params, batch=2,
                   options=megakernel.MegakernelOptions(global_stream=False))
ring = run_step(mini, mini_params, batch=2)
late = ring["schedule"].late_prefetches()  # layers where a prefetch comes late
ffn_early, next_early = not late["ffn"], not late["next_layer"]

# %%
# NBVAL_CHECK_OUTPUT
# Checks · both ways equal the reference; the ring's prefetches come early in every layer
for name, run in (("stage rings", no_ring), ("global ring", ring)):
    print(f"{layer_pattern(mini)}, {name}: greedy tokens equal the reference: "
          f"{run['tokens_equal']}; logits within {LOGIT_TOL}: {run['logits_ok']}")
    assert run["tokens_equal"] and run["logits_ok"]
print(f"the recorded DMA log is the step's schedule, event for event: {ring['log_is_schedule']} "
      f"({len(ring['schedule'].events)} DMA starts and waits)")
print(f"every layer: the FFN's first block starts before attention's last block is waited: "
      f"{ffn_early}")
print(f"every layer: the next layer's first block starts before this FFN ends: {next_early}")
stream = ring["plan"].stream
print(f"ring: {stream.depth} slots of {list(stream.slot_shape)} bf16 "
      f"({stream.slot_bytes / 2**20:.1f} MiB each)")
assert ring["log_is_schedule"] and ffn_early and next_early and not late["experts"]

# %%
no_ring_timeline, no_ring_fig = show_timeline(no_ring["log"], "7 layers, stage rings")
ring_timeline, ring_fig = show_timeline(ring["log"], "7 layers, global ring")

# %% [markdown]
# The same step both ways, on the timeline model: the bytes are the same (each weight once);
# the waits between stages and layers are what the ring removes.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the global ring's modelled step is shorter, for the same bytes
rows = widgets.summary_rows({"stage rings": no_ring_timeline, "global ring": ring_timeline})
print(widgets.format_table(rows, ["label", "total_us", "hbm_floor_us", "roofline_fraction",
                                  "idle_hbm_busy_us", "bubble_us", "dma_bytes"]))
assert ring_timeline.total_s < no_ring_timeline.total_s
assert ring_timeline.dma_bytes == no_ring_timeline.dma_bytes
assert not label_problems(no_ring_fig) and not label_problems(ring_fig)

# %% [markdown]
# ### Why the mini sits at 10–16 % of the roofline
#
# The **roofline** here is the step's bytes over the HBM bandwidth; a **bubble** is time in which
# neither the compute unit nor any DMA works. Both timelines above are mostly bubble, and the
# reason is the mini's size, not the ring: the mini moves its 35 MiB in hundreds of DMAs, most of
# them a few KiB (norm gains, mixing vectors, the experts' scales, the mini's small matrices),
# which HBM delivers in nanoseconds, while the timeline model charges every DMA a fixed latency
# (0.5 µs: an ASSUMPTION, the figure is not published; notebook 01). A DMA whose latency no other
# work covers costs its latency, whatever its size: the mini is bound by the number and the order
# of its DMAs, not by their bytes. The same log replayed with no latency runs at the roofline
# (below). At full size a weight block is 2 MiB, about 0.57 µs of HBM time, as long as a
# latency, and the ring's `depth − 1` blocks in flight keep HBM busy (notebook 09 predicts the
# full model's step).

# %%
hbm_dmas = [e for e in ring["log"].select("dma_start") if e.src == "hbm"]
sizes_kib = np.array([e.nbytes for e in hbm_dmas]) / 1024
chip = timeline.timeline_chip("tpu7x")
no_latency = timeline.simulate(ring["log"], timeline.timeline_chip("tpu7x", dma_latency=0.0))
print(f"{len(hbm_dmas)} DMAs from HBM, {sizes_kib.sum() / 1024:.1f} MiB in all, median "
      f"{np.median(sizes_kib):.0f} KiB: {np.median(sizes_kib) * 1024 / chip.hbm_bandwidth * 1e9:.0f}"
      f" ns of HBM time each, against a {chip.dma_latency * 1e9:.0f} ns latency")
print(f"the same log replayed with no DMA latency: {no_latency.total_s * 1e6:.1f} µs instead of "
      f"{ring_timeline.total_s * 1e6:.1f} µs (MODELLED)")

# %% [markdown]
# **One layer boundary, close up**: the end of layer 2 (KDA + MoE) and the start of layer 3
# (MLA), in the global ring's step. Layer 3's first weight blocks (`mla.w_qa`, `mla.w_kva`) are
# issued while layer 2's shared experts are still being computed, and have landed before layer 3
# needs them: the ring crosses the boundary as your toy's did. What still stalls the boundary is
# not a weight block: the layer's residual vectors (`mix_attn`, `attn_norm`, …: the mix weights
# and norm gains, `load_vectors` in `layer_step` above) are started on entry to the layer and
# waited for at once, so each layer starts with one DMA latency that the ring does not cover.

# %%
def boundary(log, simulated, layer):
    """(DMA event, its timeline span) pairs, with the first weight block of `layer` and the
    first of its residual vectors (what the layer loads on entry)."""
    spans = [s for s in simulated.spans if s.kind == "dma"]  # one per DMA start, in order
    pairs = list(zip(log.select("dma_start"), spans, strict=True))
    assert all(e.name == s.name for e, s in pairs)
    ours = [(e, s) for e, s in pairs if e.indices.get("layer") == layer]
    first_block = next(s for e, s in ours if "block" in e.indices)
    vectors = next(s for e, s in ours if "block" not in e.indices)
    return pairs, first_block, vectors


pairs, first_block, vectors = boundary(ring["log"], ring_timeline, 3)
window = (first_block.issue * 1e6 - 0.5, vectors.end * 1e6 + 0.7)
zoom, zoom_fig = show_timeline(ring["log"], "layers 2 | 3, global ring", window_us=window, marks=(
    (first_block.issue * 1e6, "layer 3's first block issued"),
    (vectors.issue * 1e6, "layer 3 entered: its vectors issued")))
for e, s in pairs:
    if s.end * 1e6 >= window[0] and s.issue * 1e6 <= window[1]:
        print(f"{e.name:18s} layer {e.indices.get('layer', '-')!s:2s} issued {s.issue * 1e6:6.2f} µs, "
              f"moving {s.start * 1e6:6.2f}–{s.end * 1e6:6.2f} µs")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · on the timeline model the mini is latency-bound; layer 3's first block crosses early
print(f"MODELLED: {ring_timeline.roofline_fraction:.0%} of the roofline with the assumed latency, "
      f"{no_latency.roofline_fraction:.0%} with none; layer 3's first weight block lands before "
      f"layer 3 has its vectors: {first_block.end < vectors.end}")
assert ring_timeline.roofline_fraction < 0.2 < 0.9 < no_latency.roofline_fraction
assert first_block.issue < vectors.issue and first_block.end < vectors.end
assert not label_problems(zoom_fig)

# %% [markdown]
# ## 6 · Sampling in the same call: 8 tokens
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
# (32, and B = 1, in its exhaustive tier): logits within docs/kimi-k3.md §11's 5e-2 on every
# row-step, the same experts, tokens equal except at near-ties (a reference top-2 gap under 0.1,
# reported).

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
# The tokens themselves are this machine's: at a near-tie another summation order (another
# processor) can pick the other token, in both backends alike. The checked fact is the agreement.
print(f"prompt {np.asarray(prompt[0]).tolist()}")
print(f"megakernel: {generated}")
print(f"reference:  {np.asarray(expected[0]).tolist()}")
print(f"{prompt.shape[1] + N_TOKENS - 1} calls in {seconds:.1f} s on this machine "
      f"({tpu.describe_backend()}: a simulator, not a TPU timing)")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the megakernel's free-running greedy decode equals the reference's
print(f"{len(generated)} tokens, megakernel = reference: "
      f"{generated == np.asarray(expected[0]).tolist()}")
assert generated == np.asarray(expected[0]).tolist()

# %% [markdown]
# ## 7 · Compiling for TPU7x at the shapes of one rank of Kimi K3
#
# The released kernels run Kimi K3 on 32 ranks (16 TPU7x chips × 2 TensorCores): 3 attention
# heads, 112 local experts with a 768-wide slice of the expert hidden, a 5120-row vocab shard
# (docs/kimi-k3.md §9; the collectives are left out on one device). `kimi-k3-rank`, one rank of
# the release layout (`mkresearch.sharding.layout.rank_config`), has those shapes (the sharded
# kernel with its collectives, on all 32 devices, is compiled by `make recorded`). The VMEM plan
# is computed first — every buffer with its bytes — and checked against the chip; then libtpu's
# Mosaic compiler builds the kernel from shapes alone (no weights are allocated).
#
# That compile takes half a minute to a minute on two CPU cores, so this notebook shows the result
# recorded by `mkresearch compile kimi-k3-rank --record` (`mkresearch.measurement.recorded`), as
# long as it was recorded for this very plan and JAX version; otherwise, or with
# `MKRESEARCH_COMPILE_RANK=1` in the environment, it compiles here. The VMEM plan is always
# computed here.

# %%
rank = get_config("kimi-k3-rank")  # = layout.rank_config(get_config("kimi-k3"))
result, rank_plan, result_source = recorded.compile_or_recorded(
    rank, 1, chip="tpu7x", recompile=os.environ.get("MKRESEARCH_COMPILE_RANK") == "1")

# %% [markdown]
# **The VMEM plan** (`rank_plan.vmem`, a PLAN of the buffers, not a measurement): the kernel-wide
# buffers live for the whole call (the weight ring, the hidden state, the residual snapshots);
# each stage's own buffers (KDA's state, the experts' slots, the LM head's tiles) exist only
# while that stage runs, so the peak is the kernel-wide buffers plus the largest stage, not the
# sum of all. A stage's buffers are not listed anywhere: they are what its body allocates
# (`pl.run_scoped`), read off the body traced on shapes (`kernels/compose/scoped_vmem.py`), at
# the body's peak. The trunk's own scoped buffers (the embedding's blocks, freed before the first
# layer; the sampling stage's LM head tiles) are the one list the step allocates them from
# (`megakernel_plan.trunk_scopes`). Nested scopes add up, sibling scopes do not: at this rank's shapes MLA's KV
# tile rings are smaller than the local ring of its matrices off the global ring, which the
# body allocates before them, so the plan counts that ring alone.

# %%
def vmem_figure(vmem):
    """Per scope: its buffers stacked (MiB), each stage on top of the kernel-wide ones."""
    stages = [s for s in vmem.scopes if s != "kernel"]
    kernel_mib = vmem.stage_bytes("kernel") / 2**20
    fig, ax = plt.subplots(figsize=(10, 3.2), layout="constrained")
    ax.barh(stages, [kernel_mib] * len(stages), color="#9ecae1", label="kernel-wide buffers")
    ax.barh(stages, [vmem.stage_bytes(s) / 2**20 for s in stages], left=kernel_mib,
            color="#3182bd", label="the stage's own buffers")
    ax.axvline(vmem.limit_bytes / 2**20, color="#d62728", label="usable VMEM")
    ax.invert_yaxis()
    ax.set(xlabel="MiB", title=f"VMEM plan of one rank of Kimi K3 on {vmem.chip} (PLANNED, "
           f"not measured): peak {vmem.total_bytes / 2**20:.1f} MiB, during {vmem.peak_stage}")
    legend_outside(ax)
    return fig


vmem_fig = vmem_figure(rank_plan.vmem)
show_figure(vmem_fig)

# %% [markdown]
# **What the compile says.** Mosaic built one kernel for the whole step. XLA's memory analysis of
# the compiled program counts HBM per TensorCore: the arguments are this rank's weights and its
# caches and states; the outputs are the updated caches and states, a second copy because the
# compile does not donate the state (a decode loop that donates it, as `decode_step` does, updates
# it in place); the temporaries are the copies XLA makes around the call (weights put in the
# layouts the kernel's operands ask for). Their sum is the program's peak HBM, which must fit
# the TensorCore's share of the chip's HBM.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the rank's VMEM plan fits; one Mosaic kernel; the compiled program's HBM per core
vmem = rank_plan.vmem
largest = sorted(vmem.buffers, key=lambda b: -b.nbytes)[:3]
print(f"VMEM plan: {vmem.total_bytes:,d} B peak (kernel-wide {vmem.stage_bytes('kernel'):,d} B + "
      f"{vmem.peak_stage} {vmem.stage_bytes(vmem.peak_stage):,d} B) of {vmem.limit_bytes:,d} B "
      f"usable: fits {vmem.fits()}")
print("largest buffers: " + "; ".join(f"{b.name} ({b.scope}) {list(b.shape)} {b.nbytes:,d} B"
                                      for b in largest))
print(f"Mosaic kernels in the compiled program: {result.n_mosaic_kernels}")
memory = result.memory
hbm = {"arguments (weights, caches, states)": memory["argument_size_in_bytes"],
       "outputs (the updated caches and states)": memory["output_size_in_bytes"],
       "temporaries (XLA's copies around the kernel)": memory["temp_size_in_bytes"]}
for what, nbytes in hbm.items():
    print(f"HBM {what}: {nbytes / 2**30:.2f} GiB")
hbm_per_core = chips.get_chip("tpu7x").hbm_bytes
print(f"HBM peak {memory['peak_memory_in_bytes'] / 2**30:.2f} GiB of the "
      f"{hbm_per_core / 2**30:.2f} GiB of a TensorCore: fits {memory['peak_memory_in_bytes'] <= hbm_per_core}")
print(f"[{result_source}]")
assert result.n_mosaic_kernels == 1 and vmem.fits()
assert memory["peak_memory_in_bytes"] <= hbm_per_core
assert not label_problems(vmem_fig)

# %%
print(f"compile: {result.seconds:.0f} s on the machine that recorded it; {result.flops:.3g} flops "
      f"declared per step")

# %% [markdown]
# Your toy megakernel goes through the same compiler: traced with `interpret=None` (what
# `tpu.interpret_params()` gives on a TPU) and compiled by libtpu's Mosaic for a TPU7x, here on
# this CPU, from shapes alone.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the toy megakernel compiles for TPU7x: one Mosaic kernel
if tpu.can_compile():
    toy_compiled = tpu.compile_for(
        functools.partial(toy_call, kinds=tuple(TOY_KINDS.values()), interpret=None),
        layer_table(toy["pattern"], tuple(TOY_KINDS)), toy["embed"][tokens].astype(jnp.float32),
        [toy["stacks"][kind] for kind in TOY_KINDS], toy["head"], chip="tpu7x")
    print(f"the toy megakernel compiled for tpu7x: {toy_compiled.n_mosaic_kernels} Mosaic kernel")
    assert toy_compiled.n_mosaic_kernels == 1
else:  # a CPU runtime without libtpu (Colab's): the tpu extra brings the compiler
    print("no libtpu here to compile for tpu7x: pip install 'mkresearch[tpu]', restart, run again")

# %% [markdown]
# One Mosaic kernel holds all 93 layers' worth of work for a decode step: the layer loop keeps
# the kernel's size independent of depth, so the full model's per-rank shapes compile like
# mini's, and like your toy's 2 and 8 layers.
