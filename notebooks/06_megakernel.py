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
                    ".at[...]", "pl.when", "BlockSpec", "Memory space", "Scalar prefetch",
                    "scratch_shapes", "make_async_copy", "DMA semaphore", "lax.fori_loop",
                    "Race detector", "Timeline", "Roofline fraction", "Bubble", "Mosaic")

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
# A toy decoder small enough to read whole: `B = 8` rows, a hidden width `d = 128` and a
# vocabulary of `V = 128` tokens (one bf16 weight block is one `[128, 128]` tile). A token is
# embedded, goes through the layers, and the LM head gives its logits; the next token is the
# greedy argmax. Every layer is a residual stage of one of two **kinds**:
#
# | kind | weight blocks | the layer |
# |---|---|---|
# | `mlp` | 2: W₀, W₁ | `x + relu(x W₀) W₁` |
# | `glu` | 3: W₀, W₁, W₂ | `x + (silu(x W₀) ⊙ x W₁) W₂` |
#
# As in the package, the weights of a kind are **stacked**: one HBM array per kind,
# `[layers of that kind, blocks, d, d]`, and a layer is an index into its kind's stack. Products
# take bf16 inputs and accumulate in f32, as the package's kernels do. The reference below is
# plain JAX, the toy's spec.

# %%
B, D, V = 8, 128, 128  # rows, hidden width, vocabulary: one [128, 128] bf16 tile per block


def dot(x, w):  # [B, k] @ [k, n] -> [B, n] f32: bf16 inputs, f32 accumulation
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)


# the spec of each kind: (x [B, D] f32, w [blocks, D, D] bf16: this layer's weights) -> x
REFERENCE = {
    "mlp": lambda x, w: x + dot(jax.nn.relu(dot(x, w[0])), w[1]),
    "glu": lambda x, w: x + dot(jax.nn.silu(dot(x, w[0])) * dot(x, w[1]), w[2]),
}
BLOCKS = {"mlp": 2, "glu": 3}  # weight blocks per layer of each kind


def toy_params(pattern, blocks=BLOCKS, seed=0):
    """Random weights of a toy model whose layers are the kinds in `pattern`, in order."""
    keys = iter(jax.random.split(jax.random.key(seed), len(blocks) + 2))

    def normal(shape, scale):
        return (jax.random.normal(next(keys), shape) * scale).astype(jnp.bfloat16)

    return {"pattern": tuple(pattern), "embed": normal((V, D), 1.0),
            "stacks": {k: normal((pattern.count(k), n, D, D), D**-0.5) for k, n in blocks.items()},
            "head": normal((D, V), D**-0.5)}


def toy_reference(params, tokens, spec=REFERENCE):
    """tokens [B] -> logits [B, V] f32 of the next token."""
    x = params["embed"][tokens].astype(jnp.float32)  # [B, D]
    for layer, kind in enumerate(params["pattern"]):
        index = params["pattern"][:layer].count(kind)  # its place in the kind's stack
        x = spec[kind](x, params["stacks"][kind][index])
    return dot(x, params["head"])


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
# **The bodies of the kinds.** A kind's body computes its layer from `x` and a function
# `weight(j)` that returns the layer's block `j`, already in VMEM. The body does not know where
# the block came from: that is the ring's business, below.

# %%
def mlp_body(x, weight):  # x [B, D] f32; weight(j) -> block j [D, D] bf16, in VMEM
    h = jax.nn.relu(dot(x, weight(0)))
    return x + dot(h, weight(1))


def glu_body(x, weight):
    gate = dot(x, weight(0))
    up = dot(x, weight(1))
    return x + dot(jax.nn.silu(gate) * up, weight(2))


TOY_KINDS = {"mlp": (2, mlp_body), "glu": (3, glu_body)}  # kind -> (blocks per layer, body)

# %% [markdown]
# **The loop, the switch and the ring.** The weight blocks of the whole step form one sequence
# `g = 0, 1, 2, …`: layer 0's blocks, then layer 1's, …, then the LM head's. Block `g` goes
# through slot `g mod 2` of ONE ring of two VMEM slots, with one DMA semaphore per slot (the
# ring of notebook 01). Before it waits for block `g`, the kernel starts block `g + 1` into the
# other slot, free since block `g − 1` was used. Inside a layer, block `g + 1` is the layer's next
# block; at the layer's last block it is **the next layer's first block**, whose kind the kernel
# reads from the table: one `pl.when` per kind picks the stack it comes from (after the last
# layer, the head). So the DMA engine never waits for a layer boundary.
#
# The layers run in `lax.fori_loop`, with `g` in the loop's carry. Each iteration calls
# `lax.switch(kind, branches)`: one branch per kind, traced once, whatever the depth. Each branch
# returns `g` past its blocks, so a kind with more blocks moves the sequence further.

# %%
def toy_megakernel(table, x_ref, *refs, kinds):
    # table [2 L] i32 (SMEM): layer l's kind and its index in that kind's stack; x_ref [B, D] f32
    # (VMEM); a stack per kind [n, blocks, D, D] bf16 and head [D, V] bf16 (HBM, pl.ANY);
    # logits_ref [B, V] f32 (VMEM); scratch: h [B, D] f32, ring [2, D, D] bf16, sems: 2 DMA
    stacks, (head, logits_ref, h, ring, sems) = refs[:len(kinds)], refs[len(kinds):]
    n_layers = table.shape[0] // 2

    def copy(src, g):  # block g of the step's one sequence <-> ring slot g mod 2
        slot = lax.rem(g, 2)
        return pltpu.make_async_copy(src, ring.at[slot], sems.at[slot])

    def start_first_block(layer, g):  # block 0 of `layer`, whatever its kind; after the last: head
        @pl.when(layer == n_layers)
        def _():
            copy(head, g).start()

        last = jnp.minimum(layer, n_layers - 1)  # a valid row to read the kind from
        for k in range(len(kinds)):  # the kind is data: one pl.when per kind
            @pl.when((layer < n_layers) & (table[2 * last] == k))
            def _(k=k):
                copy(stacks[k].at[table[2 * layer + 1], 0], g).start()

    def branch(k):  # lax.switch's branch for kind k: the layer's blocks are g, g + 1, ...
        n_blocks, body = kinds[k]

        def run(layer, g):
            index = table[2 * layer + 1]

            def weight(j):  # start the block after block j (maybe the next layer's), wait for j
                if j + 1 < n_blocks:
                    copy(stacks[k].at[index, j + 1], g + j + 1).start()
                else:
                    start_first_block(layer + 1, g + j + 1)
                copy(stacks[k].at[index, j], g + j).wait()
                return ring[lax.rem(g + j, 2)]

            h[...] = body(h[...], weight)
            return g + n_blocks  # the sequence continues past this layer's blocks

        return run

    start_first_block(0, 0)  # the prologue: layer 0's first block flies while x is loaded
    h[...] = x_ref[...]
    branches = [branch(k) for k in range(len(kinds))]
    g = lax.fori_loop(0, n_layers, lambda layer, g: lax.switch(table[2 * layer], branches,
                                                                    layer, g), 0)
    copy(head, g).wait()  # started by the last layer's last block
    logits_ref[...] = dot(h[...], ring[lax.rem(g, 2)])


# %% [markdown]
# The wrapper: the table from the pattern, the embedding row gather in plain JAX (the package
# does it in the kernel, by DMA), and the `pallas_call` with the table as its scalar-prefetch
# operand. The stacks and the head stay in HBM (`pl.ANY`); the kernel moves them itself.

# %%
def layer_table(pattern, kind_names):
    """[kind id, index within the kind's stack] per layer, flattened: the SMEM table."""
    rows = [[kind_names.index(kind), pattern[:layer].count(kind)]
            for layer, kind in enumerate(pattern)]
    return jnp.asarray(rows, jnp.int32).reshape(-1)


@functools.partial(jax.jit, static_argnames=("kinds", "interpret"))
def toy_call(table, x, stacks, head, kinds, interpret):
    hbm, vmem = pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(
        functools.partial(toy_megakernel, kinds=kinds),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,  # the first operand, the table, lands in SMEM
            grid=(),  # one invocation: the whole step
            in_specs=[vmem] + [hbm] * (len(stacks) + 1),
            out_specs=vmem,
            scratch_shapes=[pltpu.VMEM((B, D), jnp.float32),  # h: the hidden state
                            pltpu.VMEM((2, D, D), jnp.bfloat16),  # the ring's two slots
                            pltpu.SemaphoreType.DMA((2,))]),  # one per slot
        out_shape=jax.ShapeDtypeStruct((B, V), jnp.float32),
        interpret=interpret,  # None: compiled for a TPU; else TPU interpret mode's parameters
    )(table, x, *stacks, head)


def toy_step(params, tokens, kinds=TOY_KINDS):
    """tokens [B] -> logits [B, V] f32, the whole step in one pallas_call."""
    names = tuple(kinds)
    stacks = [params["stacks"][name] for name in names]
    x = params["embed"][tokens].astype(jnp.float32)
    return toy_call(layer_table(params["pattern"], names), x, stacks, params["head"],
                    kinds=tuple(kinds.values()), interpret=tpu.interpret_params())


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
def ring_walk(pattern, blocks=BLOCKS):
    """(block g, what it is, its slot) of a toy model's one sequence of weight blocks."""
    walk = [f"L{layer} {kind}.W{j}" for layer, kind in enumerate(pattern)
            for j in range(blocks[kind])] + ["head"]
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
# Add a kind `tanh` of **one** weight block: the layer is `x + tanh(x W₀)`. Write its body over
# `weight(j)` and register it in `MY_KINDS` with its number of blocks. The kernel itself should
# not need a change: the switch gets a third branch, the table a third kind id, and the ring
# walks a sequence in which, at a `tanh` layer, *every* block is a layer's last, so each wait
# comes after the next layer's first block has started. The check builds a 4-layer toy
# `mlp, tanh, tanh, glu`, runs your kinds in the kernel above, and compares the logits and 3
# greedy tokens with the reference (which it extends with `tanh`'s spec), race detector on.

# %%
def my_tanh_body(x, weight):  # x [B, D] f32; weight(j) -> block j [D, D] bf16
    raise NotImplementedError("x + tanh(x W0)")


MY_KINDS = {**TOY_KINDS, "tanh": (None, my_tanh_body)}  # (blocks per layer, body)


# %%
def check_third_kind(kinds):
    n_blocks, body = kinds["tanh"]
    body(jnp.zeros((B, D), jnp.float32), lambda j: jnp.zeros((D, D), jnp.bfloat16))  # written?
    assert n_blocks == 1, f"tanh has 1 weight block per layer, MY_KINDS says {n_blocks}"
    spec = {**REFERENCE, "tanh": lambda x, w: x + jnp.tanh(dot(x, w[0]))}
    params = toy_params(("mlp", "tanh", "tanh", "glu"), {**BLOCKS, "tanh": 1}, seed=1)
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
def tanh_body(x, weight):
    return x + jnp.tanh(dot(x, weight(0)))


assert exercises.check("a third kind", lambda: check_third_kind({**TOY_KINDS,
                                                                  "tanh": (1, tanh_body)}))

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
                                             positions, cfg, options=options, return_logits=True)
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
