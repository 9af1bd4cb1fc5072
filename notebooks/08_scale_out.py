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
# 8 simulated CPU devices for the sharded step: XLA fixes the count when JAX starts, so the flag
# goes in before jax is imported (on a TPU the real devices are used; the flag only shapes CPU)
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
import mkresearch  # sets JAX_PLATFORMS=cpu when this machine has no TPU
from mkresearch.hardware import tpu

print(tpu.describe_backend())  # compiled on a TPU, TPU interpret mode elsewhere

# %% [markdown]
# # 08 · Scale-out: the megakernel sharded across ranks, collectives inside the kernel
#
# The release decodes Kimi K3 on 16 TPU7x chips, 32 TensorCores (docs/kimi-k3.md §9): each core
# is a *rank* that holds a slice of every weight and runs one persistent kernel per step. Ours so
# far ran one device. Here the same megakernel (notebook 06) runs on every rank of a layout
# (`mkresearch.sharding.layout`), and what a rank needs from its peers arrives by **remote DMAs
# inside the kernel**: still one `pallas_call` per step per rank, under `jax.shard_map`
# (`kernels/compose/megakernel_sharded.py`).
#
# First you write the smallest collective there is, an **all-reduce** (every rank ends with the
# sum of every rank's vector) between two devices, with `pltpu.make_async_remote_copy` and
# semaphores, run on this notebook's simulated devices; then 4 devices as your turn. Then the
# package's collectives and what they add; then the sharded megakernel:
#
# 1. an all-reduce written here; your turn: four devices, in rank order;
# 2. the package's collectives (`kernels/sharded/`): what they add;
# 3. who holds what: a layout;
# 4. one layer (MLA attention + routed experts) sharded 2, 4 and 8 ways, each step checked
#    against the reference and the single-device megakernel;
# 5. the collectives on a timeline, per rank;
# 6. the per-rank bytes of the full model, our layout beside the release's;
# 7. the full model's sharded step compiled for the 32 cores of `tpu7x:2x2x4` (recorded);
# 8. exact vs partial-sum collectives, predicted at full size;
# 9. fewer collectives, and what they cost;
# 10. beyond one host: one process per host, each loading only its shards.
#
# Terms (rank, all-gather, reduce-scatter, EP × ETP, one-shot, two-level, rs-ag, sibling swap, …)
# are defined where they first appear and in [00 · glossary](00_megakernels_on_tpu.ipynb#The-glossary).

# %% [markdown]
# The terms this notebook uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Rank", "All-reduce", "One-shot", "EP × ETP", "Exact mode", "Sibling",
                    "Layout", "Remote copy", "Barrier semaphore", "DMA semaphore", "Ref",
                    ".at[...]", "pl.when", "BlockSpec", "Memory space", "scratch_shapes",
                    "lax.fori_loop", "Race detector")

# %%
import contextlib
import functools
import inspect
import io
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel
from mkresearch.kernels.compose import megakernel_sharded as sharded
from mkresearch.kernels.sharded import collectives

from mkresearch.measurement import logs, recorded
from mkresearch.model import numerics, reference, weights
from mkresearch.model.config import get_config, layer_pattern
from mkresearch.sharding import layout, layout_bytes
from mkresearch.views import exercises, ranks_plots, widgets
from mkresearch.views.facts import bound
from mkresearch.views.label_plots import label_problems
from mkresearch.views.widgets import show_figure

started = time.perf_counter()
print(f"devices: {len(jax.devices())} ({jax.default_backend()})")
assert len(jax.devices()) >= 8, "the first cell sets XLA_FLAGS before jax starts"

# %% [markdown]
# ## 1 · An all-reduce, written here
#
# Two devices each hold a partial sum `x` `[B, W]` f32 of some vector (in the sharded megakernel:
# the products of a matrix whose rows are split between them); both need the whole sum. On a
# TPU each device sends its `x` straight into the other's VMEM by a **remote DMA**:
#
# ```python
# copy = pltpu.make_async_remote_copy(src_ref, dst_ref, send_sem, recv_sem,
#                                     device_id=(peer,), device_id_type=pl.DeviceIdType.MESH)
# copy.start()       # the DMA engine sends src_ref (here) into dst_ref (on `peer`)
# copy.wait_recv()   # wait until the peer's copy into MY dst_ref has landed (my recv_sem)
# copy.wait_send()   # wait until mine has left: src_ref may be written again (my send_sem)
# ```
#
# `dst_ref` names a buffer of the *peer's* kernel: the same scratch buffer (the **inbox**) on
# every device. Three kinds of semaphore keep it safe:
#
# - **DMA semaphores** (`pltpu.SemaphoreType.DMA`), one for sending and one for receiving: a
#   remote copy signals the sender's when its bytes have left and the receiver's when they have
#   landed; `wait_send` / `wait_recv` wait on them.
# - the **barrier semaphore** (`pltpu.get_barrier_semaphore()`, which needs a `collective_id` in
#   the kernel's `CompilerParams`): before anything is sent, each device signals its peer's and
#   waits for its own (`pl.semaphore_signal` / `pl.semaphore_wait`). After it, the peer is inside
#   this kernel, its inbox exists: nothing is written into a kernel that has not started.
# - a **REGULAR semaphore** (`pltpu.SemaphoreType.REGULAR`): a plain counter the kernel signals
#   and waits itself. The kernel below runs `n` all-reduces one after another through ONE inbox
#   (as a megakernel runs one per layer), so before it sends the next partial it must know that
#   the peer has *read* the last one: the peer signals this "inbox free" semaphore after reading.
#
# The kernel runs on each device under `jax.shard_map` over a 1-D mesh of devices;
# `lax.axis_index` is this device's index on the mesh axis, and `device_id=(1 - me,)` the other.
# With two terms the sum needs no order: `x + y` and `y + x` are the same bits in IEEE
# arithmetic, so both devices hold the same sum.

# %%
AXIS = "devices"  # the mesh axis of the all-reduces below
B, W, N_REDUCTIONS = 8, 128, 3  # one [8, 128] f32 tile per partial; 3 all-reduces in a row


def my_all_reduce_kernel(x_ref, o_ref, inbox, send_sem, recv_sem, free_sem, *, handshake=True):
    # x_ref, o_ref [n, B, W] f32 (VMEM): this device's n partials, their n sums; scratch: inbox
    # [B, W] f32 (the peer writes into it), DMA semaphores send_sem, recv_sem, REGULAR free_sem
    n = x_ref.shape[0]
    me = lax.axis_index(AXIS)
    peer = {"device_id": (1 - me,), "device_id_type": pl.DeviceIdType.MESH}

    barrier = pltpu.get_barrier_semaphore()  # 1. both devices are inside this kernel
    pl.semaphore_signal(barrier, 1, **peer)
    pl.semaphore_wait(barrier, 1)

    def one_reduction(i, carry):
        if handshake:
            @pl.when(i > 0)  # 2. the peer has read my last partial out of its inbox
            def _():
                pl.semaphore_wait(free_sem, 1)

        copy = pltpu.make_async_remote_copy(x_ref.at[i], inbox, send_sem, recv_sem, **peer)
        copy.start()  # 3. my partial into the peer's inbox
        copy.wait_recv()  # the peer's partial has landed in mine
        o_ref[i] = x_ref[i] + inbox[...]  # two terms: the same bits on both devices
        copy.wait_send()  # mine has left x_ref
        if handshake:
            @pl.when(i < n - 1)  # 4. my inbox is read: the peer may send the next one
            def _():
                pl.semaphore_signal(free_sem, 1, **peer)
        return carry

    lax.fori_loop(0, n, one_reduction, 0)


def on_devices(kernel, partials, scratch):
    """Run `kernel` on each of the first len(partials) devices, partials[d] on device d ->
    [devices, ...] of what each device's kernel wrote."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:partials.shape[0]]), (AXIS,))
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)

    def per_device(x):  # x [1, ...]: this device's slice of `partials`
        out = pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
            in_specs=[vmem], out_specs=vmem, scratch_shapes=scratch,
            compiler_params=pltpu.CompilerParams(collective_id=0),  # the barrier semaphore's
            interpret=tpu.interpret_params(),  # None on a TPU, interpret mode elsewhere
        )(x[0])
        return out[None]

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                 check_vma=False))(partials)


PAIR_SCRATCH = [pltpu.VMEM((B, W), jnp.float32),  # the inbox
                pltpu.SemaphoreType.DMA(()), pltpu.SemaphoreType.DMA(()),  # send, receive
                pltpu.SemaphoreType.REGULAR(())]  # "inbox free"
pair = jax.random.normal(jax.random.key(0), (2, N_REDUCTIONS, B, W), jnp.float32)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the two-device all-reduce against a plain jnp sum, with the race detector on, each
# remote copy moving the moment it starts (see the next cell)
RACE_CHECKED = {"detect_races": True, "vector_clock_size": 16, "dma_execution_mode": "eager"}
with tpu.interpret_options(**RACE_CHECKED):
    tpu.reset_races()
    summed = np.asarray(on_devices(my_all_reduce_kernel, pair, PAIR_SCRATCH))
    raced = tpu.races_found()
want = np.asarray(jnp.sum(pair, axis=0))  # [n, B, W]
assert not raced
assert all(np.array_equal(summed[d], want) for d in range(2))
print(f"{N_REDUCTIONS} all-reduces of [{B}, {W}] f32 on 2 devices: each device's sums equal "
      f"jnp.sum's, bit for bit: {all(np.array_equal(summed[d], want) for d in range(2))}; "
      f"no race found: {not raced}")

# %% [markdown]
# Leave the handshake out and a device may send its next partial into an inbox the peer has not
# read yet. The race detector of interpret mode usually sees it (it reports each race with the source
# lines involved; the cell keeps only the verdict). Both cells run the interpreter's copies in
# its eager mode, each moving the moment it starts, as a TPU's DMA engine moves it. In its
# default mode a copy moves when its semaphore is first waited on: if the receiver is already
# waiting for the next partial, its own thread writes it, after its read of the last one, and
# the race is hidden or not depending on which device's thread waits first.
#
# The detector can miss it, a few runs in a hundred here. It gives each semaphore one vector
# clock, which every signal merges into and every wait takes. When a device has started two
# copies before its peer waits for the first, that wait takes the second copy's clock too, and
# the detector then sees the peer's read of its inbox as after the second write. The race is
# still there, and then shows in the sums: the peer added the partial meant for the next
# reduction. So the check below is either: a race found, or a wrong sum.

# %%
with tpu.interpret_options(**RACE_CHECKED), contextlib.redirect_stdout(io.StringIO()) as report:
    tpu.reset_races()
    unsafe = np.asarray(on_devices(functools.partial(my_all_reduce_kernel, handshake=False),
                                   pair, PAIR_SCRATCH))
    unsafe_raced = tpu.races_found()
tpu.reset_races()
reports = report.getvalue().count("RACE DETECTED")
unsafe_wrong = not all(np.array_equal(unsafe[d], want) for d in range(2))
print(f"without the handshake: races found {unsafe_raced} "
      f"({reports} report{'' if reports == 1 else 's'}); sums wrong {unsafe_wrong}")
assert unsafe_raced or unsafe_wrong  # caught either way (above)

# %% [markdown]
# **With more than two devices the order matters.** Floating-point addition is not associative:
# `(a + b) + c` and `a + (b + c)` can differ in the last bit. If each of 4 devices added its own
# partial first and then the others as they arrive, the devices would hold *different* sums, and
# the next layer would diverge across ranks. A deterministic all-reduce adds in one fixed order on
# every device, rank 0's partial first. Here in plain numpy, 4 partials of `[8, 128]`:

# %%
quad = np.asarray(jax.random.normal(jax.random.key(1), (4, B, W), jnp.float32))
own_first = [functools.reduce(np.add, [quad[(d + k) % 4] for k in range(4)]) for d in range(4)]
rank_order = functools.reduce(np.add, list(quad))  # ((x0 + x1) + x2) + x3
differ = int(sum((s != own_first[0]).sum() for s in own_first[1:]))
# (the partials come from jax.random, whose floats depend on how XLA compiles: the count too)
print(f"own partial first: the 4 devices' sums differ in {differ} elements (of {3 * B * W} "
      f"compared against device 0's); in rank order: one sum, the same on every device")
assert differ > 0

# %% [markdown]
# ### Your turn: four devices, one-shot, in rank order
#
# Write the all-reduce of ONE `[B, W]` partial on **4** devices, **one-shot**: every device sends
# its partial to all 3 others at once (one phase of messages). Each device's inbox has a slot per
# device, `inbox [4, B, W]`: device `me` writes into slot `me` of each peer's inbox (and copies its
# own partial into its own slot `me`), so the sum can be taken in rank order,
# `((inbox[0] + inbox[1]) + inbox[2]) + inbox[3]`, the same bits on every device. The barrier now
# has 3 peers to signal and 3 signals to wait for; one `send_sem` and one `recv_sem` serve all
# copies (a DMA semaphore counts bytes: wait once per copy, or once for all of them with a
# descriptor of all their bytes). The check runs your kernel on 4 devices with the race detector
# on and compares every device's sum, bit for bit, with the rank-order sum; then Mosaic compiles
# it for the 4 chips of a v5e 2x2 slice.

# %%
def my_all_reduce4_kernel(x_ref, o_ref, inbox, send_sem, recv_sem):
    # x_ref, o_ref [B, W] f32; scratch: inbox [4, B, W] f32, DMA semaphores send_sem, recv_sem
    raise NotImplementedError("the one-shot all-reduce on 4 devices, in rank order")


# %%
QUAD_SCRATCH = [pltpu.VMEM((4, B, W), jnp.float32),
                pltpu.SemaphoreType.DMA(()), pltpu.SemaphoreType.DMA(())]


def on_mesh(kernel, scratch, mesh):
    """`kernel` on every device of `mesh` (as on_devices runs it), as a function to compile."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)

    def per_device(x):  # x [1, ...]: this device's slice
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape[1:], x.dtype), in_specs=[vmem],
            out_specs=vmem, scratch_shapes=scratch,
            compiler_params=pltpu.CompilerParams(collective_id=0))(x[0])[None]

    return jax.shard_map(per_device, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                         check_vma=False)


def check_all_reduce4(kernel):
    with tpu.interpret_options(detect_races=True, vector_clock_size=16):
        tpu.reset_races()
        got = np.asarray(on_devices(kernel, jnp.asarray(quad), QUAD_SCRATCH))
        assert not tpu.races_found(), "the race detector saw a copy race with a read"
    for d in range(4):
        assert np.allclose(got[d], rank_order, atol=1e-5), f"device {d} does not hold the sum"
        assert np.array_equal(got[d], rank_order), (
            f"device {d} holds the sum, but not the rank-order sum's bits: another order")
    if tpu.can_compile():  # Mosaic, for the 4 chips of a v5e 2x2 slice (its topology, no TPU)
        mesh = jax.sharding.Mesh(np.array(tpu.topology_devices("v5e:2x2")), (AXIS,))
        exercises.compiles(on_mesh(kernel, QUAD_SCRATCH, mesh),
                           jax.ShapeDtypeStruct((4, B, W), jnp.float32), chip="v5e",
                           shardings=(jax.sharding.NamedSharding(mesh, P(AXIS)),))


exercises.check("a 4-device all-reduce", lambda: check_all_reduce4(my_all_reduce4_kernel));


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: a 4-device all-reduce (double-click to open)
# NBVAL_CHECK_OUTPUT
def all_reduce4_solution(x_ref, o_ref, inbox, send_sem, recv_sem):
    n = inbox.shape[0]
    me = lax.axis_index(AXIS)

    def to(k):  # the k-th peer after me
        return {"device_id": (lax.rem(me + k, n),), "device_id_type": pl.DeviceIdType.MESH}

    barrier = pltpu.get_barrier_semaphore()
    for k in range(1, n):
        pl.semaphore_signal(barrier, 1, **to(k))
    pl.semaphore_wait(barrier, n - 1)
    copies = [pltpu.make_async_remote_copy(x_ref, inbox.at[me], send_sem, recv_sem, **to(k))
              for k in range(1, n)]
    for copy in copies:  # one phase: all peers at once
        copy.start()
    inbox[me] = x_ref[...]
    for copy in copies:  # 3 partials of [B, W] received (each copy waits for one's bytes)
        copy.wait_recv()
    total = inbox[0]
    for rank in range(1, n):  # rank order: the same bits on every device
        total = total + inbox[rank]
    o_ref[...] = total
    for copy in copies:
        copy.wait_send()


assert exercises.check("a 4-device all-reduce", lambda: check_all_reduce4(all_reduce4_solution))

# %% [markdown]
# ## 2 · The package's collectives: what they add
#
# `mkresearch.kernels.sharded.collectives` holds every collective of the sharded megakernel,
# built from the same primitive (through `dma.RemoteCopy`, which is `make_async_remote_copy`
# plus the DMA log). What it adds to your kernels:
#
# - **one set of inboxes for the whole step**, allocated as the kernel's scratch from a plan
#   (`ShardPlan.scratch()`): per channel (all ranks, or an ETP group) a reduce-scatter and an
#   all-gather inbox `[2, members, B, chunk]`;
# - **no handshake per collective**: the inboxes are double-buffered by a parity bit flipped at
#   every collective. Data of collective `k + 2` can only arrive once its sender finished
#   collective `k + 1`, which needed this rank's data of `k + 1`, sent after this rank read `k`'s
#   slots: the "inbox free" round trip of your kernel is not needed, and a step has hundreds of
#   collectives;
# - **one wait for all receives**: a DMA semaphore counts bytes, so one `wait_recv` with a
#   descriptor the size of all the inbox's slots covers every peer's copy;
# - **a deterministic order**: `all_reduce` adds the ranks' chunks in rank order; `reduce` (the
#   partial sums of a matrix split by its rows) adds a host's partials in rank order, then the
#   hosts' sums (`numerics.host_ordered_sum`), the same bits on every rank and under every
#   algorithm;
# - **algorithms over hosts** (`kernels/sharded/levels.py`): **one-shot** (every rank's partial to
#   every peer, one phase: your exercise), **two-level** (first within a host — the 8 cores, 4
#   chips, that share one — then the hosts' sums across hosts: fewer messages on the slower
#   links) and **rs-ag** (reduce-scatter then all-gather: each rank sums one chunk of the vector,
#   then the chunks are gathered; smaller messages);
# - **the DMA log**: every remote copy is logged with its source and destination rank, so the
#   collectives appear in the step's log, its tables and timelines (section 5).
#
# The barrier and the all-reduce, as written there (the embedding's all-reduce: a reduce-scatter,
# each rank summing its chunk in rank order, then an all-gather):

# %%
print(inspect.getsource(collectives.Collectives.barrier))
print(inspect.getsource(collectives.Collectives.all_reduce))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the package's one order: numerics.host_ordered_sum on one host is your rank order
one_host = np.asarray(numerics.host_ordered_sum([jnp.asarray(q) for q in quad]))
two_hosts = np.asarray(numerics.host_ordered_sum([jnp.asarray(q) for q in quad], (0, 0, 1, 1)))
print(f"one host: the rank-order sum, bit for bit: {np.array_equal(one_host, rank_order)}; "
      f"two hosts of 2: (x0 + x1) + (x2 + x3), bit for bit: "
      f"{np.array_equal(two_hosts, (quad[0] + quad[1]) + (quad[2] + quad[3]))}")
assert np.array_equal(one_host, rank_order)
assert np.array_equal(two_hosts, (quad[0] + quad[1]) + (quad[2] + quad[3]))

# %% [markdown]
# ## 3 · Who holds what
#
# From here on, the package's sharded megakernel on one layer of `kimi-k3-mini` (MLA attention +
# the routed experts: the kinds with the most collectives: heads, latent columns, expert groups;
# the 7-layer mini's sharded steps are tests/sharded's).
#
# `layout.layout(cfg, n)` says how many ways each group of weights splits. The mini has 2
# attention heads: on 4 and 8 ranks each head is held by 2 and 4 ranks (replicated), while the
# vocabulary, the experts and the column chunks keep splitting. The experts split **EP × ETP**
# (expert parallel × expert-tensor parallel: the experts are dealt out to EP groups of ETP ranks,
# and each expert's hidden columns are split over the ETP ranks of its group). On 8 ranks each
# rank holds 2 of the 16 experts whole (EP 8, ETP 1; `layout(..., etp=2)` would split each
# expert's hidden columns over 2 ranks instead, as the release's ETP 4 does at full size).
# Replicated bytes are the norms' gains, the mixing vectors and the router bias, the same on
# every rank.

# %%
LOGIT_TOL = 5e-2  # docs/kimi-k3.md §11
NEAR_TIE_GAP = 2 * LOGIT_TOL
RANKS = (2, 4, 8)
BATCH, PROMPT_LEN, STEPS = 2, 4, 2
CFG = get_config("kimi-k3-mini", n_layers=1, mla_first=0, n_dense_layers=0)
print(f"{CFG.name} with {CFG.n_layers} layers: {layer_pattern(CFG)} {CFG.layers}")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · every layout splits: a rank holds fewer bytes than one device
LAYOUTS = {n: layout.layout(CFG, n) for n in RANKS}
for n, lay in LAYOUTS.items():
    print(lay.describe())
    counted = layout_bytes.rank_bytes(lay, BATCH)
    print(f"  one rank's weights: {counted.weights:,d} B of which replicated "
          f"{counted.replicated_weights:,d} B")
full_weights = layout_bytes.rank_bytes(layout.layout(CFG, 1), BATCH).weights
print(f"one device (no sharding): {full_weights:,d} B")
assert all(layout_bytes.rank_bytes(lay, BATCH).weights < full_weights for lay in LAYOUTS.values())

# %% [markdown]
# ## 4 · Sharded steps, checked at each step
#
# A random prompt is prefilled by the reference; then `STEPS` greedy steps run three ways from the
# same state and tokens: the plain-JAX reference, the single-device megakernel, and the sharded
# megakernel on 2, 4 and 8 simulated devices (TPU interpret mode). At every step: the ranks agree
# on the token; the sharded logits and token equal the single device's bit for bit; the logits are
# within 5e-2 of the reference's and the greedy token is the reference's (or a near-tie); every
# rank's slice of the caches and states equals the single device's. The 8-rank steps are recorded
# (the DMA log of every rank, remote copies included) for section 5.

# %%
params = weights.init_params(CFG, 0)
prompt = jax.random.randint(jax.random.key(0), (BATCH, PROMPT_LEN), 0, CFG.vocab_size)
_, start_state = reference.prefill(params, reference.init_state(CFG, BATCH), prompt[:, :-1], CFG)
single = megakernel.prepare_weights(params, CFG)


def single_device_steps():
    """STEPS greedy steps of the reference and the single-device megakernel (tokens: the
    megakernel's): per step (reference logits, megakernel logits, tokens in, tokens out, state)."""
    state, ref_state = jax.tree.map(jnp.copy, start_state), start_state
    tokens, steps = np.asarray(prompt[:, -1], np.int32), []
    for i in range(STEPS):
        positions = np.full(BATCH, PROMPT_LEN - 1 + i, np.int32)
        ref_logits, ref_state, _ = reference.decode_step(params, ref_state, tokens, positions, CFG)
        out, state, aux = megakernel.decode_step(single, state, tokens, positions, CFG,
                                                 return_logits=True)
        steps.append({"positions": positions, "tokens": tokens, "next": np.asarray(out),
                      "ref_logits": np.asarray(ref_logits), "logits": np.asarray(aux["logits"]),
                      "state": jax.tree.map(np.asarray, state)})
        tokens = np.asarray(out)
    return steps


def sharded_steps(n_ranks, steps, record=False):
    """The same steps on n_ranks devices, checked at each step (section 4's list)."""
    lay = LAYOUTS[n_ranks]
    plan = sharded.make_sharded_plan(lay, BATCH, CFG.max_seq_len)
    mesh = sharded.make_mesh(n_ranks)
    prepared = sharded.prepare_weights(params, lay, mesh)
    state = sharded.shard_state(start_state, lay, mesh)
    report = {"ref_diff": 0.0, "single_diff": 0.0, "tokens_equal": 0, "near_ties": 0,
              "slices_equal": 0, "slices": 0, "logs": []}
    for want in steps:
        with dma.recording() if record else _nothing() as log:
            out, state, aux = sharded.decode_step(prepared, state, want["tokens"],
                                                  want["positions"], plan, mesh=mesh,
                                                  return_logits=True)
            jax.block_until_ready(out)
        report["logs"].append(log)
        per_rank, out = np.asarray(aux["tokens_per_rank"]), np.asarray(out)
        logits = np.asarray(aux["logits"])
        assert (per_rank == per_rank[:1]).all(), "the ranks disagree on the token"
        assert np.array_equal(logits.view(np.uint32), want["logits"].view(np.uint32))
        assert np.array_equal(out, want["next"])
        report["single_diff"] = max(report["single_diff"], float(np.abs(logits - want["logits"]).max()))
        report["ref_diff"] = max(report["ref_diff"], float(np.abs(logits - want["ref_logits"]).max()))
        top2 = np.sort(want["ref_logits"], -1)[:, -2:]
        same = out == want["ref_logits"].argmax(-1)
        report["tokens_equal"] += int(same.sum())
        report["near_ties"] += int((~same & (top2[:, 1] - top2[:, 0] < NEAR_TIE_GAP)).sum())
        expected = layout.shard_state(want["state"], lay)
        for got, exp in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
            got = np.asarray(got)
            for rank in range(n_ranks):
                report["slices"] += 1
                report["slices_equal"] += int(np.array_equal(got[rank].view(np.uint8),
                                                             np.asarray(exp[rank]).view(np.uint8)))
    return report


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


reference_steps = single_device_steps()
runs, seconds = {}, {}
for n in RANKS:
    t0 = time.perf_counter()
    runs[n] = sharded_steps(n, reference_steps, record=(n == max(RANKS)))
    seconds[n] = time.perf_counter() - t0
print("interpret-mode seconds per rank count (compile + steps): "
      + ", ".join(f"{n} ranks {s:.1f} s" for n, s in seconds.items()))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · each sharded step against the single-device megakernel and the reference
for n, run in runs.items():
    print(f"{n} ranks, {STEPS} steps at B={BATCH}: logits and tokens equal to the single-device "
          f"megakernel's (bit for bit): {run['single_diff'] == 0.0}; "
          f"{bound(run['ref_diff'], LOGIT_TOL, name='max |logit diff| vs the reference')}; "
          f"greedy tokens = the reference's or a near-tie: "
          f"{run['tokens_equal'] + run['near_ties'] == STEPS * BATCH}; state slices equal: "
          f"{run['slices_equal']}/{run['slices']}")
    assert run["single_diff"] == 0.0 and run["ref_diff"] <= LOGIT_TOL
    assert run["tokens_equal"] + run["near_ties"] == STEPS * BATCH
    assert run["slices_equal"] == run["slices"] > 0

# %% [markdown]
# ## 5 · The collectives on a timeline
#
# Every remote copy is in the DMA log with its source and destination rank. Per rank of the last
# 8-rank step: how many remote copies it starts and their bytes, by collective (the embedding's
# reduce-scatter, the all-gathers of column chunks and of split inputs, the chain that carries the
# routed experts' sum down the expert groups in id order), and its HBM bytes. These follow from
# the layout's shapes, not from the data. (The routed experts' HBM bytes do depend on the data:
# which experts the batch chose.)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the 8-rank step's remote copies by collective, and each rank's bytes
log = runs[max(RANKS)]["logs"][-1]
# the weights' components of the log (routed experts, embedding rows and cache reads depend on the
# tokens: the experts chosen, the owner of a token's row, the positions)
WEIGHTS = ("kda", "mla", "dense", "moe_nonrouted", "lm_head", "norms_and_mix")
by_collective = {}
for rank in log.ranks:
    for e in log.of_rank(rank).select("dma_start"):
        if e.remote:
            counts = by_collective.setdefault(ranks_plots.collective_of(e.name), {})
            copies, nbytes = counts.get(rank, (0, 0))
            counts[rank] = (copies + 1, nbytes + e.nbytes)
for collective, counts in sorted(by_collective.items()):
    print(f"{collective:15s} " + "  ".join(f"r{rank}: {c} x = {b:,d} B"
                                           for rank, (c, b) in sorted(counts.items())))
for rank in log.ranks:
    moved = logs.hbm_bytes_by_component(log.of_rank(rank))
    weights_moved = sum(moved.get(k, 0) for k in WEIGHTS)
    print(f"rank {rank}: weights DMA'd from HBM {weights_moved:,d} B; remote bytes sent "
          f"{log.of_rank(rank).remote_bytes():,d} B")
assert set(log.ranks) == set(range(max(RANKS)))
assert all(log.of_rank(rank).remote_bytes() > 0 for rank in log.ranks)
assert all(e.src_rank != e.dst_rank for e in log.select("dma_start") if e.remote)

# %% [markdown]
# The timeline model (`mkresearch.prediction.timeline`, notebook 07) models one device. Run on each rank's
# events alone (`timeline_ranks.rank_events`: what a rank receives is taken as ready; its remote copies
# are priced like its DMAs), it shows where in the step each collective sits and what runs beside
# it: the next stage's weight blocks are already streaming while a sublayer's output is being
# all-gathered. Waiting on peers is not in this picture: that needs a model of all ranks at once.

# %%
timelines = ranks_plots.rank_timelines(log, "tpu7x")
ranks_fig = ranks_plots.plot_rank_timelines(
    log, timelines, title=f"{CFG.name}, {CFG.n_layers} layer, on 8 ranks, B={BATCH}: one step "
                          "per rank on tpu7x, MODELLED (timeline model, not measured)")
show_figure(ranks_fig)  # described: an HTML export gives the picture its title
steps_us = [tl.total_s * 1e6 for tl in timelines.values()]
print(f"predicted step per rank (each alone): {min(steps_us):.1f} to {max(steps_us):.1f} us")

# %%
# Checks · every rank's modelled step; the figure's labels
assert all(s > 0 for s in steps_us)
assert not label_problems(ranks_fig)  # no label runs into another, none is cut

# %% [markdown]
# ## 6 · The full model: bytes per rank, ours beside the release's
#
# At full size the layout decides the step: each rank reads its slice of the weights once per
# step. The release (docs/kimi-k3.md §9) keeps the latent MoE projections, the router and W_down's input
# whole on every rank; ours splits them by output columns (gathered in the kernel), so a rank
# reads fewer bytes.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · our layout reads fewer bytes per rank than the release's
full = get_config("kimi-k3")
report = layout_bytes.compare(full, 32)
print(layout_bytes.format_table(report))
ours, release = (report["layouts"][name]["weights"] for name in ("ours", "release"))
assert ours < release and report["ours_saves_bytes"] == release - ours

# %% [markdown]
# ## 7 · Compiled for 32 TPU7x cores
#
# `compile_sharded_step` compiles the full model's sharded step for the 32 devices of the
# `tpu7x:2x2x4` topology on this CPU (libtpu, no TPU needed): one rank's program, its VMEM plan
# within the core's limit. It takes about a minute here, so the notebook shows the committed
# record (`make recorded` re-records it; a record that no longer matches the plan is recompiled).

# %%
compiles = {}
for model, n_ranks, name, batch, chip in recorded.RECORDED_SHARDED:
    compiles[model, n_ranks, name, batch, chip] = recorded.sharded_compile_or_recorded(
        model, n_ranks, name, batch, chip)
print("compile seconds per rank's program, on the machine that recorded it: " + ", ".join(
    f"{key[0]} {compiled.seconds:.0f} s" for key, (compiled, _, _) in compiles.items()))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · one Mosaic kernel per rank and a VMEM plan within the core's, for every recorded compile
rows = [{"model": model, "cores": f"{n_ranks} of {sharded.FULL_TOPOLOGY}", "layout": name,
         "B": batch, "Mosaic kernels": compiled.n_mosaic_kernels,
         "VMEM plan B": f"{plan.mega.vmem.total_bytes:,d}",
         "of B": f"{plan.mega.vmem.limit_bytes:,d}",
         "ring slots": plan.mega.stream.depth,
         "from": "recorded" if where.startswith("recorded") else where}
        for (model, n_ranks, name, batch, _), (compiled, plan, where) in compiles.items()]
print(widgets.format_table(rows, list(rows[0])))
print("(recorded: mkresearch/measurement/recorded/compile_<model>_32ranks_*.json; "
      "`make recorded` re-records them)")
assert all(compiled.n_mosaic_kernels == 1 and plan.mega.vmem.fits()
           for compiled, plan, _ in compiles.values())

# %% [markdown]
# ## 8 · Exact vs partial-sum collectives, predicted at full size
#
# The kernel's collectives, derived from one sharding plan (`kernels/sharded/plan.py`), come in
# three modes. *Exact*
# splits every matrix by its output columns and gathers around it (bit-equal to one device; the
# experts' sum runs down a chain of expert groups). *Partial-sum* splits a matrix that contracts
# over a split dimension (W_o over the heads, a W_down over the hidden, an expert's W2 over its
# hidden slice) by those rows and all-reduces the partial sums in one fixed order; the routed
# experts' sum is one reduction, not a chain; W_lu's column chunks ride in the messages of the
# shared expert's reduction (no gather of their own); one all-gather carries the router's and
# W_ld's column chunks (both of the normed x, before top-k), one W_qa's and W_kva's.
# *Restructured* is partial-sum with the latent MoE's rho reduce-scattered in one phase and W_lu
# split by its rows, its partial products beside the shared experts' in their one reduction
# (docs/sharding.md §4b; the table below prices it as the kernel runs it). Counted
# honestly, every collective: the ~188 of the release (docs/collectives.md) count only its two
# reductions per layer; our model of its layout, gathers and **sibling swaps** (exchanging halves with the other
# TensorCore of the same chip) included, issues far more (`mkresearch predict kimi-k3 --ranks 32` counts them in its colls column). The FFN hidden splits in
# half-lane chunks (the shared experts' 192 columns on every rank, gate and up streamed as one
# [d, 384] matrix: `kernels/stages/gate_up.py`), the column chunks of W_lu, the router, W_qa and
# W_kva are rotated off the ranks holding W_ld's (`layout.rotations`), and a rank whose chunk of a
# matrix is only padding skips it (`layout_split.streamed_zeros`): the GB/rank column below is the
# most any rank reads. Not built yet: hiding the
# shared expert's reduction under the routed experts' stream. The
# prediction (`scale_out.predict`) builds each rank's program from that same plan and prices
# every collective by the algorithm the plan sends it with, the interconnect model's choice
# (`mkresearch plan kimi-k3 --ranks 32` lists them with the reason).

# %%
# NBVAL_CHECK_OUTPUT
# Checks · partial-sum beats exact at every batch (predicted; against the release's modelled
# step under the same assumptions: notebook 09 §4)
from mkresearch.prediction import collective_plan
from mkresearch.views import scale_out_plots

modes = collective_plan.modes_table(full, 32)
print(f"{'mode':12s} {'B':>2s} {'colls':>5s} {'GB/rank':>7s} {'step ms':>7s} {'published':>9s}  "
      "HBM floor / peers / messages / compute / bubble (ms)")
for r in modes:
    parts = " / ".join(f"{v:.2f}" for v in r["parts_ms"].values())
    print(f"{r['mode']:12s} {r['batch']:2d} {r['collectives']:5d} {r['rank_gb']:7.2f} "
          f"{r['step_ms']:7.2f} {r['published_ms']:9.2f}  {parts}")
by_mode = {(r["mode"], r["batch"]): r for r in modes}
for b in (1, 2, 4, 8):
    part, exact = by_mode["partial-sum", b], by_mode["exact", b]
    assert part["collectives"] < exact["collectives"] and part["step_ms"] < exact["step_ms"]
assert by_mode["partial-sum", 1]["rank_gb"] < by_mode["exact", 1]["rank_gb"]

# %% [markdown]
# **The overlap picture.** 100 µs from the middle of rank 0's predicted step at B = 1: where HBM
# streams weights (blue) and where a collective is outstanding (red, from its issue to its
# completion). HBM should stay busy under the red. In partial-sum mode a rank's ring is as deep as
# its VMEM allows (`megakernel_sharded.ring_depth`: the deepest of at least 8 slots whose whole VMEM
# plan leaves 2 MiB spare, so all its blocks but one are in flight when a collective is waited
# for; `mkresearch predict kimi-k3 --explain` prints the depth at each batch); the exact mode keeps
# the preset's 3. It covers part of
# the outstanding time: the rest waits for the collectives' latency.

# %%
overlaps = [collective_plan.overlap(full, 32, 1, mode) for mode in ("partial-sum", "exact")]
overlap_fig = scale_out_plots.overlap_figure(overlaps)
show_figure(overlap_fig)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · how long a collective is outstanding, and HBM busy under it (predicted)
for o in overlaps:
    print(f"{o['mode']}: a collective is outstanding {o['outstanding_ms']:.1f} ms of the "
          f"{o['step_ms']:.1f} ms step; HBM busy during {o['hbm_busy_fraction']:.0%} of it")
    assert 0 < o["hbm_busy_ms"] <= o["outstanding_ms"] <= o["step_ms"]
assert not label_problems(overlap_fig)

# %% [markdown]
# **The overlap in the recorded log.** The 8-rank step recorded in section 4 (the one-layer
# kimi-k3-mini in the layout's exact mode, the kernel section 4 checks bit for bit; the partial-sum
# step's log is checked the same way in tests/sharded/test_partial_sum.py), rank 0 in program order: blue where a weight DMA is in flight (started, not yet waited: the
# global ring's next blocks, the first experts' slots), red from a collective's first remote copy
# to its last wait. `measurement.collective_overlap` returns the data; at every wait but the
# step's last two, weight DMAs are in flight, so a collective does not stop the weight stream.
# How much of a wait they cover is the prediction's question (above); the mini's ring on a rank
# has 4 slots (its shortest stage streams 3 blocks: the lookahead stays within it).

# %%
from mkresearch.measurement import collective_overlap

waits = collective_overlap.collective_overlap(log, 0)
idle = [c["name"] for c in waits if not c["hbm_in_flight"]]
window = (waits[0]["start"] - 40, waits[-1]["end"] + 40)  # the whole one-layer step
log_overlap_fig = scale_out_plots.log_overlap_figure(
    collective_overlap.overlap_rows(log, 0, *window),
    f"rank 0 of {max(RANKS)}, events {window[0]}-{window[1]}: weight DMAs in flight at "
    f"{len(waits) - len(idle)} of {len(waits)} collective waits")
show_figure(log_overlap_fig)

# %%
# NBVAL_CHECK_OUTPUT
# Checks · weight DMAs in flight at the recorded step's collective waits
print(f"rank 0's recorded step: {len(waits)} collective waits (the embedding's all-reduce in two "
      f"phases), weight DMAs in flight at {len(waits) - len(idle)}; none at {idle}")
assert idle == [waits[-2]["name"], "sampling_state/all_gather"]  # the last layer's last, the merge
# the last layer's last collective: the gather of W_lu's columns, the MoE stage's last matrix
assert idle[0].startswith("latent/w_lu") and all(c["hbm_in_flight"] > 0 for c in waits[:-2])
assert not label_problems(log_overlap_fig)

# %% [markdown]
# ## 9 · Fewer collectives, and what they cost
#
# A collective exists because a value computed in pieces across ranks is needed whole by a
# non-linear step: top-k needs the router's scores and the experts need W_ld's latent (one
# gather), ρ's RMSNorm needs the routed experts' sum, the next layer's residual mix needs the
# MoE's output sum and the attention's; MLA's RMSNorms need W_qa's and W_kva's columns. It goes
# away only if every rank computes the value whole, reading what the other ranks read for it.
# `prediction.replication_floor` prices each avoidance in bytes per rank and lists the cheapest
# design for every count (`mkresearch plan kimi-k3 --ranks 32` prints it too): Kimi K3 reaches
# the release's ~188 only when every rank reads the whole router, W_ld and W_lu, three times the
# bytes, an HBM floor above the release's measured step. Since every collective waits for the one
# before it, their latencies add up: the larger of that sum and the HBM floor bounds the step
# from below, whatever the overlap (`replication_floor.fastest` tries every combination). That
# bound holds over **replication designs only**: sending a collective another way (the latent
# sum ρ by a one-phase reduce-scatter) or splitting the router over fewer ranks shortens the
# chain without replicating; the full model prices those (`mkresearch predict kimi-k3
# --designs`, and the router placements `mkresearch plan kimi-k3 --ranks 32` prints).
# DeepSeek-V3 and GLM-4.5, whose experts work on the full d, add the shared experts' partial sums
# to the routed experts' on each rank before one reduction, at no cost in bytes
# (`layout.merges_shared_sum`): one collective a layer fewer than two reductions.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the cost of fewer collectives by replication, and its lowest bound within limits
from mkresearch.prediction import replication_floor

fronts = [replication_floor.frontier(get_config(m), 32)
          for m in ("kimi-k3", "deepseek-v3", "glm-4.5", "qwen3-235b-a22b")]
print(replication_floor.format_frontier(fronts[0]))
limits = {"": {}, "within 4.6 GB per rank": {"max_rank_bytes": 4.6e9},
          "with at most 200 collectives": {"max_collectives": 200}}
best = {words: replication_floor.fastest(full, 32, **kw) for words, kw in limits.items()}
for words, b in best.items():
    print(replication_floor.format_fastest(b, words))
# by replication alone these cannot hold together: 4.6 GB and 2.5 ms, or 200 collectives and
# 2.5 ms
assert best["within 4.6 GB per rank"]["bound_ms"] > 2.5
assert best["with at most 200 collectives"]["bound_ms"] > 4.02  # the release's measured step

# %%
frontier_fig = scale_out_plots.frontier_figure(fronts, max_collectives=200, max_floor_ms=2.5)
show_figure(frontier_fig)

# %%
# Checks · the frontier figure's labels
assert not label_problems(frontier_fig)

# %% [markdown]
# ## 10 · Beyond one host: one process per host
#
# The release's 16 chips sit on 4 hosts, and so does every TPU slice larger than one host. There
# JAX runs **one process per host** (a *multi-controller* run, joined by
# `jax.distributed.initialize`): each process drives only its own chips, every process runs the
# same program, and a computation over a mesh of *every* process's devices is one SPMD program
# whose remote DMAs and collectives cross the hosts. Three things change from the runs above:
#
# - **the mesh** spans the processes, each host's devices consecutive ranks (the cell below: the
#   mesh a run on each slice builds, from the topology's own devices);
# - **loading**: each process reads from the checkpoint only its ranks' slices, by byte ranges
#   (an FP8 scale block cut by a slice edge is read by both ranks), never the whole file;
# - **output**: results are gathered, and process 0 alone prints them.
#
# Step by step on a TPU VM slice, on every worker at once (docs/multihost.md §2):
#
# ```bash
# mkresearch decode --checkpoint DIR --prompt "The capital of France is" --ranks 16 --coordinator auto
# ```
#
# On this machine, `mkresearch launch` starts several processes as the hosts, with simulated CPU
# devices in each and JAX's CPU collectives (gloo) between them. One failing process stops the
# rest, with one line that names it:
#
# ```bash
# mkresearch launch --processes 2 -- decode kimi-k3-mini --ranks 8 --backend reference --steps 4
# ```
#
# That is the plain-JAX sharded reference, `--backend reference`. The kernel itself cannot span
# processes here: interpret mode keeps every simulated device's memory and semaphores in the one
# Python process that runs the kernel, so a remote copy to a peer in another process waits
# forever. The multi-host kernel is compiled instead (§7: one Mosaic kernel per rank). The tests
# run these commands for real, and check that 2 processes × 4 devices give the bits of
# 1 process × 8, tokens and logits (tests/test_multihost.py); the commands take minutes on two
# cores, so this notebook does not run them.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the mesh a multi-host slice's run builds: one process per host, its ranks consecutive
host_rows = []
for topology, n_ranks in (("v5e:2x4", 8), (sharded.FULL_TOPOLOGY, 32)):
    hosts = [d.process_index for d in sharded.make_mesh_on(topology, n_ranks).devices.flat]
    for host in sorted(set(hosts)):
        on_host = [r for r, h in enumerate(hosts) if h == host]
        host_rows.append({"slice": topology, "host (process)": host,
                          "ranks": f"{on_host[0]}-{on_host[-1]}",
                          "consecutive": on_host == list(range(on_host[0], on_host[-1] + 1))})
print(widgets.format_table(host_rows, list(host_rows[0])))
assert all(row["consecutive"] for row in host_rows)
assert [len([r for r in host_rows if r["slice"] == t]) for t in ("v5e:2x4", "tpu7x:2x2x4")] == [
    2, 4]

# %%
elapsed = time.perf_counter() - started
print(f"notebook body: {elapsed:.0f} s")
