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
# # 03 · MoE routing: write the router kernel
#
# A **Mixture-of-Experts** (MoE) layer holds many small MLPs, the **experts**, and runs only a few
# of them for each token. Every MoE layer of Kimi K3 sends each token to 16 of its 896 experts. The
# **router** decides which, and with what weight (docs/kimi-k3.md §6.1):
#
# $$r = x W_r \;(\text{f32}),\qquad s = \sigma(r),\qquad
#   \text{ids} = \operatorname{top-}k(s + b),\qquad
#   w_e = \frac{s_e}{\sum_{j \in \text{ids}} s_j}\cdot\text{routed\_scale}$$
#
# - $W_r$ `[d, E]` scores every expert for the row; $\sigma$ is the sigmoid, so each score is in (0, 1).
# - **top-k**: the k experts with the largest $s + b$, taken one pick at a time; a tie goes to
#   the lower expert id.
# - **correction bias** $b$ (f32, one per expert): it only *selects*. It is how the model evens out
#   the experts' load without distorting the mixture: the weights $w_e$ come from the uncorrected
#   scores, renormalised over the k picks.
#
# Terms used here and later are in the glossary (docs/glossary.md). In this notebook you write that
# router as a Pallas kernel, check it against the reference (`mkresearch.model.reference.route`,
# plain JAX), add DeepSeek-V3's group-limited stage to it yourself, and then open the package's
# router (`mkresearch.kernels.stages.router.router_body`) to see what it adds: the weight stream,
# the fixed-order sum, and the copy of the picks to **SMEM** (the core's scalar memory), where the
# expert stage of notebook 04 reads them as scalars. Everything runs on the `kimi-k3-mini` model (16 experts, top-4).

# %% [markdown]
# The terms this notebook uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Mixture-of-Experts", "Router", "Correction bias", "Group-limited routing",
                    "Ref", ".at[...]", "BlockSpec", "Memory space", "SMEM operand",
                    "scratch_shapes", "make_async_copy", "DMA semaphore", "lax.fori_loop",
                    "Race detector", "Mosaic", "HBM")

# %%
import functools
import inspect

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.experimental import pallas as pl
from mkresearch.kernels.base import dma
from mkresearch.kernels.stages import router

from mkresearch.model import config, reference, weights
from mkresearch.views import exercises, facts, widgets
from mkresearch.views.label_plots import label_problems

# Every kernel below runs with the race detector of TPU interpret mode (docs/tpu.md §4): it tracks
# each simulated memory access with vector clocks and flags one that races with a DMA.
tpu.interpret_options(detect_races=True, vector_clock_size=16)
cfg = config.get_config("kimi-k3-mini")
params = weights.init_params(cfg, seed=0)
layer = 1  # the first MoE layer (layer 0 is dense)
p = reference.layer_params(params["moe"], cfg.ffn_index(layer))


def normalised_rows(batch, seed):
    """Router inputs like the model's: embeddings of random tokens through the layer's RMSNorm."""
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, batch)
    return reference.rms_norm(params["embed"][tokens], params["mlp_norm"][layer], cfg.rms_eps)


x = normalised_rows(8, seed=0)

# %%
# NBVAL_CHECK_OUTPUT
print(f"{cfg.name}: {cfg.n_experts} experts, top-{cfg.top_k}, {cfg.router_score} scores, "
      f"bias={cfg.router_bias}, routed_scale={cfg.routed_scale}")
print(f"x {tuple(x.shape)} {x.dtype}, W_r {tuple(p['w_router'].shape)} {p['w_router'].dtype}, "
      f"bias {tuple(p['router_bias'].shape)} {p['router_bias'].dtype}")

# %% [markdown]
# ## 1 · The router as a kernel, pick by pick
#
# At decode sizes everything fits in VMEM at once: `x` is `[8, 512]`, $W_r$ `[512, 16]`. With no
# grid and default `BlockSpec`s, `pallas_call` copies each input whole into VMEM before the body
# runs and each output back to HBM after it, so the body reads and writes plain VMEM refs.
#
# The top-k is no sort. A TPU core computes on `[8, 128]` vector registers; k rounds of three
# vector reductions over the `[B, E]` tile are a few instructions each, where a sort would move
# values across lanes:
#
# 1. `best` = the row's largest `select` value;
# 2. `index` = the **lowest** expert id holding it (a `min` over `where(select == best, id, E)`):
#    that is the tie rule, the same as `jnp.argmax`;
# 3. store `index` as pick i, read the *uncorrected* score there, and set that expert's `select` to
#    −∞ so it is never picked again.
#
# `limit` is a hook for a stage that narrows the choice before the picks; it is unused until your
# turn below.

# %%
def my_router_kernel(x_ref, w_ref, bias_ref, ids_ref, weights_ref, *, top_k, routed_scale,
                     limit=None):
    # x_ref [B, d] bf16, w_ref [d, E] bf16, bias_ref [1, E] f32; ids_ref [B, k] i32 and
    # weights_ref [B, k] f32 are written here (all VMEM)
    logits = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)  # [B, E] f32
    scores = jax.nn.sigmoid(logits)
    select = scores + bias_ref[...]  # the bias moves the choice, never the weights
    batch, n_experts = select.shape
    expert = jax.lax.broadcasted_iota(jnp.int32, (batch, n_experts), 1)  # [B, E]: 0 .. E-1
    if limit is not None:
        select = limit(select, expert)  # experts it rules out are -inf
    picked = []
    for i in range(top_k):  # static: k rounds of "max, lowest index holding it, mask it out"
        best = jnp.max(select, axis=-1, keepdims=True)  # [B, 1]
        index = jnp.min(jnp.where(select == best, expert, n_experts), axis=-1, keepdims=True)
        hit = expert == index  # [B, E]: one True per row
        ids_ref[:, i:i + 1] = index
        picked.append(jnp.sum(jnp.where(hit, scores, 0.0), axis=-1, keepdims=True))  # s, not s+b
        select = jnp.where(hit, -jnp.inf, select)
    chosen = jnp.concatenate(picked, axis=-1)  # [B, k]
    weights_ref[...] = chosen / jnp.sum(chosen, axis=-1, keepdims=True) * routed_scale


def my_route(p, x, cfg, *, top_k=None, limit=None):
    """(ids [B, k] i32, weights [B, k] f32) from my_router_kernel, in interpret mode off a TPU."""
    top_k = top_k or cfg.top_k
    batch, n_experts = x.shape[0], p["w_router"].shape[1]
    kernel = functools.partial(my_router_kernel, top_k=top_k, routed_scale=cfg.routed_scale,
                               limit=limit)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((batch, top_k), jnp.int32),
                   jax.ShapeDtypeStruct((batch, top_k), jnp.float32)),
        interpret=tpu.interpret_params(),  # None on a TPU (compiled); interpret mode elsewhere
    )(x, p["w_router"], p["router_bias"].reshape(1, n_experts))


# %%
# NBVAL_CHECK_OUTPUT
# Checks · my_route against reference.route: the ids exactly, the weights within 1e-6 relative
# (the released tests' tolerance, docs/kimi-k3.md §11), no race
tpu.reset_races()
my_ids, my_weights = my_route(p, x, cfg)
ref_ids, ref_weights = reference.route(p, x, cfg)
np.testing.assert_array_equal(np.asarray(my_ids), np.asarray(ref_ids))
np.testing.assert_allclose(np.asarray(my_weights), np.asarray(ref_weights), rtol=1e-6)
for k in (1, 8):  # another number of picks: the same kernel, k rounds
    got = my_route(p, x, cfg, top_k=k)
    want = reference.route(p, x, cfg.replace(top_k=k))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
# a tie: four experts with the same router column and bias score the same for every row
tied = [3, 5, 9, 12]
w_tied = np.asarray(p["w_router"]).copy()
w_tied[:, tied] = w_tied[:, [3]] + 0.5
bias_tied = np.asarray(p["router_bias"]).copy()
bias_tied[tied] = 0.0
p_tied = {**p, "w_router": jnp.asarray(w_tied, jnp.bfloat16), "router_bias": jnp.asarray(bias_tied)}
x_pos = jnp.abs(x[:4])  # positive rows: the tied experts score highest
tied_ids, _ = my_route(p_tied, x_pos, cfg)
np.testing.assert_array_equal(np.asarray(tied_ids), np.asarray(reference.route(p_tied, x_pos, cfg)[0]))
assert not tpu.races_found()
print("PASS my_route: ids equal the reference's, weights within 1e-6 relative, for k = 4, 1, 8; "
      "no race")
print(f"PASS ties: experts {tied} tie in every row and come out as {np.asarray(tied_ids)[0].tolist()}"
      " (lower id first), as in the reference")
print("row  experts            weights")
for b in range(4):
    print(f"{b:3d}  {str(np.asarray(my_ids[b]).tolist()):18s} "
          + " ".join(facts.stable(v, ".3f", 1e-5) for v in np.asarray(my_weights[b])))

# %% [markdown]
# ### Your turn: a group-limited stage
#
# DeepSeek-V3 and GLM-4.5 route in two stages (**group-limited routing**, glossary): the E experts
# form `groups` equal groups of consecutive ids; a group's score is the sum of its two largest
# `select` values; only the `keep` best groups stay eligible (the lower group wins a tie), and the
# top-k is then taken among their experts. The weights are unchanged: still the uncorrected scores
# of the k picks.
#
# Write `my_limit_to_groups(select, expert, groups=, keep=)`: it gets the `[B, E]` `select` tile
# and the expert-id iota, and returns `select` with every expert outside the kept groups at −∞.
# Vector operations only, as in the kernel: `max`, `min`, `where` over the tile (expert `e` is in
# group `e // (E / groups)`; `jax.lax.div` divides integers in a kernel). The check runs your
# function inside `my_router_kernel` on 64 rows, with 4 groups of 4 experts and 2 kept, against
# `reference.route` with `router_groups=4, router_topk_groups=2`.

# %%
def my_limit_to_groups(select, expert, *, groups, keep):
    # select [B, E] f32, expert [B, E] i32 (0 .. E-1 along each row) -> select, -inf outside
    # the `keep` best groups. Your stage here.
    raise NotImplementedError("write the group-limited stage")


# %%
grouped_cfg = cfg.replace(router_groups=4, router_topk_groups=2)
rows64 = normalised_rows(64, seed=2)


def check_groups(limit_to_groups):
    limit = functools.partial(limit_to_groups, groups=grouped_cfg.router_groups,
                              keep=grouped_cfg.router_topk_groups)
    tpu.reset_races()
    got_ids, got_weights = my_route(p, rows64, cfg, limit=limit)
    want_ids, want_weights = reference.route(p, rows64, grouped_cfg)
    wrong = int((np.asarray(got_ids) != np.asarray(want_ids)).any(-1).sum())
    assert wrong == 0, f"{wrong} of 64 rows pick other experts than the reference"
    assert np.allclose(got_weights, want_weights, rtol=1e-6, atol=0), "the weights differ"
    assert not tpu.races_found(), "the race detector flagged an access"


exercises.check("group-limited routing", lambda: check_groups(my_limit_to_groups));


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: the group-limited stage (double-click to open)
# NBVAL_CHECK_OUTPUT
def limit_to_groups_solution(select, expert, *, groups, keep):
    batch, n_experts = select.shape
    group = jax.lax.div(expert, n_experts // groups)  # [B, E]: each expert's group
    group_score = jnp.zeros_like(select)  # [B, E]: each expert holds its group's score
    for g in range(groups):  # a group's two best: the max, then the max without it
        mine = jnp.where(group == g, select, -jnp.inf)
        first = jnp.max(mine, axis=-1, keepdims=True)
        first_at = jnp.min(jnp.where(mine == first, expert, n_experts), axis=-1, keepdims=True)
        second = jnp.max(jnp.where(expert == first_at, -jnp.inf, mine), axis=-1, keepdims=True)
        group_score = jnp.where(group == g, first + second, group_score)
    kept = jnp.zeros(select.shape, jnp.bool_)
    for _ in range(keep):  # the top-k again, over groups: the lower group wins a tie
        best = jnp.max(group_score, axis=-1, keepdims=True)
        chosen = jnp.min(jnp.where(group_score == best, group, groups), axis=-1, keepdims=True)
        kept = kept | (group == chosen)
        group_score = jnp.where(group == chosen, -jnp.inf, group_score)
    return jnp.where(kept, select, -jnp.inf)


assert exercises.check("group-limited routing", lambda: check_groups(limit_to_groups_solution))
# the exercise is one: on these rows the groups change some picks
group_changes = (np.asarray(reference.route(p, rows64, grouped_cfg)[0])
           != np.asarray(reference.route(p, rows64, cfg)[0])).any(-1)
assert group_changes.any()
print(f"the group stage changes the picks of {group_changes.sum()} of 64 rows")

# %% [markdown]
# ### Your turn: the picks into SMEM
#
# The expert stage (notebook 04) reads each pick as a **scalar**, to address the DMA of that
# expert's weights, and scalars live in SMEM; the router computes its picks in vector registers,
# into VMEM. No vector store reaches SMEM: the ids cross by **DMA**. Write `my_load_kernel`: copy
# the ids `[B, k]` from VMEM into the SMEM scratch `ids_smem` with `pltpu.make_async_copy` (its
# start and its wait), then count with scalar reads how many picks each expert got, into the
# SMEM output `load_ref [E]` (the load the correction bias evens out, section 3). The check runs
# it on your router's picks above, race detector on, against `np.bincount`, and compiles it for
# TPU7x with Mosaic.

# %%
from jax.experimental.pallas import tpu as pltpu


def my_load_kernel(ids_ref, load_ref, ids_smem, sem):
    # ids_ref [B, k] i32 (VMEM); load_ref [E] i32 (SMEM); scratch: ids_smem [B, k] i32 (SMEM),
    # sem one DMA semaphore
    raise NotImplementedError("copy the ids into SMEM, then count each expert's picks")


# %%
def run_load(kernel, ids, n_experts=cfg.n_experts):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n_experts,), jnp.int32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
        scratch_shapes=[pltpu.SMEM(ids.shape, jnp.int32), pltpu.SemaphoreType.DMA(())],
        interpret=tpu.interpret_params(),
    )(ids)


def check_load(kernel):
    load = exercises.race_free(lambda: np.asarray(run_load(kernel, my_ids)))
    want = np.bincount(np.asarray(my_ids).ravel(), minlength=cfg.n_experts)
    assert np.array_equal(load, want), f"load {load.tolist()}, np.bincount {want.tolist()}"
    exercises.compiles(lambda ids: run_load(kernel, ids), my_ids)


exercises.check("the picks into SMEM", lambda: check_load(my_load_kernel))


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: the picks into SMEM (double-click to open)
# NBVAL_CHECK_OUTPUT
def load_solution(ids_ref, load_ref, ids_smem, sem):
    copy = pltpu.make_async_copy(ids_ref, ids_smem, sem)  # VMEM -> SMEM
    copy.start()
    copy.wait()
    for e in range(load_ref.shape[0]):
        load_ref[e] = 0

    def count_row(b, carry):
        for i in range(ids_smem.shape[1]):
            e = ids_smem[b, i]  # a scalar read from SMEM
            load_ref[e] = load_ref[e] + 1
        return carry

    jax.lax.fori_loop(0, ids_smem.shape[0], count_row, 0)


assert exercises.check("the picks into SMEM", lambda: check_load(load_solution))

# %% [markdown]
# ## 2 · What the package's router adds
#
# `router.router_body` is the body the megakernel runs for every MoE layer (imported here, not
# pasted). Its selection loop is yours; around it:
#
# - **$W_r$ stays in HBM and streams** through the kernel's weight ring (`blocks.stream_matmul`,
#   notebook 01's ring, row block by row block); the bias arrives by DMA too. In the megakernel the
#   router is one stage among hundreds, and the ring is shared by all of them: a weight that is
#   not streamed is a weight that does not overlap. At full size $W_r$ is `[7168, 896]` bf16, 12.8 MB.
# - **Every byte is in the DMA log**: `dma.recording()` lists the router's reads and writes below,
#   and the timeline model of notebooks 01 and 07 replays them.
# - **The picks go to SMEM.** The expert stage (notebook 04) reads each expert id as a *scalar* to
#   address the DMA of that expert's weights, and scalars live in SMEM. A vector store into SMEM
#   does not exist, so the ids and weights are written to VMEM scratch and copied VMEM → SMEM by
#   DMA (`to_smem` at the end of the body). The scratch is a `Routing`: both copies, for the two
#   ways the expert stage reads them (scalars to address DMAs, a `[B, k]` tile for vector compares).
# - **The picks are merged into one `[B, k]` value** (`jnp.where(k_iota == i, ...)`) and stored
#   once, instead of k one-column stores.
# - **The normalising sum has a fixed order** (`blocks.ordered_sum`, the reference's own): a row's
#   weights do not depend on the batch it is in nor on the machine; `jnp.sum` lets XLA choose.
# - **Other families**: softmax scores (`router_score="softmax"`), the group-limited stage you just
#   wrote (`limit_to_groups`, the same vector loop), weights without renormalisation
#   (`normalize=False`), and `logits` computed elsewhere (a rank of a sharded model gathers the
#   router's columns together with `W_ld`'s).
# - **The wrapper** checks its arguments before anything is traced (a `ValueError` naming the
#   parameter and the allowed values) and gives XLA a cost estimate.

# %%
print(inspect.getsource(router.router_body))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the package's router against the reference, its DMA log, the other families' routers
with dma.recording() as log:
    ids, weights_k = router.route(p, x, cfg)
np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
np.testing.assert_allclose(np.asarray(weights_k), np.asarray(ref_weights), rtol=1e-6)
assert log.dma_bytes(router.W_ROUTER) == weights.nbytes(p["w_router"])
print("PASS router.route: ids equal the reference's, weights within 1e-6 relative")
print(widgets.format_table([{"DMA": e.name, "from": e.src, "to": e.dst, "bytes": e.nbytes}
                            for e in log.select("dma_start")], ["DMA", "from", "to", "bytes"]))
for name, family in (("softmax scores", cfg.replace(router_score="softmax")),
                     ("4 groups, 2 kept", grouped_cfg)):
    got, want = router.route(p, rows64, family), reference.route(p, rows64, family)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
    print(f"PASS router.route with {name} equals the reference on 64 rows")
assert not tpu.races_found()

# %% [markdown]
# ## 3 · Load per expert, and what the correction bias does
#
# Over 256 tokens, how many pick each expert, with the layer's bias and without it. Then a
# deliberate nudge: raise the bias of the least-loaded expert by 0.1 and watch its load grow — the
# lever a load balancer pulls between steps. The weights never see the bias: for the rows whose
# expert set did not change, each expert's weight is the same (up to the f32 rounding of the
# normalising sum, which adds in selection order; only the order of the ids, which
# follows score + bias, can differ).

# %%
rows = normalised_rows(256, seed=1)
no_bias = cfg.replace(router_bias=False)
ids_bias, w_bias = (np.asarray(a) for a in router.route(p, rows, cfg))
ids_plain, w_plain = (np.asarray(a) for a in router.route(p, rows, no_bias))
load_bias = np.bincount(ids_bias.ravel(), minlength=cfg.n_experts)
load_plain = np.bincount(ids_plain.ravel(), minlength=cfg.n_experts)
coldest = int(np.argmin(load_bias))
nudged = {**p, "router_bias": p["router_bias"].at[coldest].add(0.1)}
ids_nudged, w_nudged = (np.asarray(a) for a in router.route(nudged, rows, cfg))
load_nudged = np.bincount(ids_nudged.ravel(), minlength=cfg.n_experts)

fig, ax = plt.subplots(figsize=(9.5, 3), layout="constrained")
experts_axis = np.arange(cfg.n_experts)
ax.bar(experts_axis - 0.27, load_plain, 0.27, label="no bias")
ax.bar(experts_axis, load_bias, 0.27, label="layer's bias")
ax.bar(experts_axis + 0.27, load_nudged, 0.27, label=f"bias[{coldest}] += 0.1")
ax.axhline(len(rows) * cfg.top_k / cfg.n_experts, color="k", lw=0.8, ls=":",
           label="uniform load")
ax.set_xticks(experts_axis)
ax.set_xlabel("expert")
ax.set_ylabel("tokens routed (of 256)")
ax.set_title("Load per expert, layer 1 of kimi-k3-mini")
# beside the axes: inside, it covered the tallest bars
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
widgets.show_figure(fig)  # described: an HTML export gives the picture its title

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the bias moves choices, never weights; the nudge; the figure's labels
changed = (np.sort(ids_bias, -1) != np.sort(ids_plain, -1)).any(-1)
print(f"rows whose expert set the layer's bias changes: {changed.sum()} of {len(rows)}")
same = ~changed  # same expert set; the order (by score + bias) may differ, so compare by id


def by_id(ids, w):
    return np.take_along_axis(w, np.argsort(ids, -1), -1)


np.testing.assert_allclose(by_id(ids_bias, w_bias)[same], by_id(ids_plain, w_plain)[same],
                           rtol=1e-6)  # the normalising sum adds in selection order: 1 f32 ulp
print(f"PASS weights of the {same.sum()} unchanged rows equal with and without bias (1e-6)")
print(f"coldest expert {coldest}: load {load_bias[coldest]} -> {load_nudged[coldest]} "
      f"after bias += 0.1")
assert changed.any() and load_nudged[coldest] > load_bias[coldest]
np.testing.assert_array_equal(np.asarray(reference.route(nudged, rows, cfg)[0]), ids_nudged)
assert not label_problems(fig)  # no label runs into another, none is cut

# %% [markdown]
# ## 4 · Compiling for a real TPU7x
#
# Interpret mode accepts layouts a TPU would reject; the Mosaic compiler in libtpu does not.
# `tpu.compile_for` compiles for TPU7x here, with no TPU: your kernel at the mini shapes, and the
# package's router at the mini shapes and at the full model's `[7168, 896]` router (the real
# router scores all 896 experts on every rank).

# %%
# NBVAL_CHECK_OUTPUT
# Checks · Mosaic compiles both routers for TPU7x: one kernel each
compiled = []
for kernel, name, fn in (("my_route", "kimi-k3-mini", my_route),
                         ("router.route", "kimi-k3-mini", router.route),
                         ("router.route", "kimi-k3", router.route)) if tpu.can_compile() else ():
    c = config.get_config(name)
    moe = weights.param_shapes(c)["moe"]
    shapes = {k: jax.ShapeDtypeStruct(moe[k].shape[1:], moe[k].dtype)
              for k in ("w_router", "router_bias")}
    xs = jax.ShapeDtypeStruct((8, c.d_model), jnp.bfloat16)
    result = tpu.compile_for(lambda p, x, c=c, fn=fn: fn(p, x, c), shapes, xs, chip="tpu7x")
    assert result.n_mosaic_kernels == 1
    compiled.append({"kernel": kernel, "model": name, "W_r": str(tuple(shapes["w_router"].shape)),
                     "Mosaic kernels": result.n_mosaic_kernels, "chip": result.chip})
print(widgets.format_table(compiled, list(compiled[0])) if compiled else f"not compiled: {tpu.NO_LIBTPU}")
