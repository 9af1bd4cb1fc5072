"""Several processes, one program: JAX's multi-controller runtime, as mkresearch runs under it.

On a multi-host TPU slice (the release's 16 TPU7x chips are 4 hosts) JAX runs one process per
host. Each process sees its own devices (`jax.local_devices()`), every process sees the global
list (`jax.devices()`), and each one runs the same program in the same order: a computation over
a mesh of every process's devices is one SPMD program whose collectives cross the processes
(on TPU over ICI; on CPU over TCP, JAX's gloo collectives). This module is the one place that
joins such a run and moves arrays in and out of it:

    initialize(Runtime(...))      join: `jax.distributed.initialize` before JAX's backend starts;
                                  then SIGINT and SIGTERM end the process at once (end_on_signals)
    runtime_from(...)             a Runtime from flags, else the MKRESEARCH_* environment
    ordered_devices(), mesh(n)    the global devices, each process's consecutive (ranks of a host)
    local_ranks(mesh)             the mesh positions whose devices this process holds
    put(tree, mesh, spec)         host arrays, the same on every process -> global arrays
    put_local(stacks, mesh)       this process's ranks' slices [n_local, ...] -> [n_ranks, ...]
    to_host(x)                    a global array -> numpy on every process (gathered if needed)
    gather_values(value)          one small value per process -> every process's, in order
    is_leader()                   process 0: the one that prints

In one process all of these are the plain single-controller calls (`jax.device_put`,
`np.asarray`), so the same code runs with one process or many.

How a run is joined, in order of precedence: explicit values (the CLI's --coordinator,
--process-id, --num-processes, --local-devices), else the environment (ENV below). A coordinator
of "auto" lets JAX find the cluster itself (`jax.distributed.initialize()` with no arguments: a
Cloud TPU VM slice, Slurm, Open MPI). On CPU a process gets `local_devices` simulated devices
(`jax_num_cpu_devices`) and JAX's CPU collectives between processes are gloo's (the default of
`jax_cpu_collectives_implementation`, set here explicitly).

TPU interpret mode cannot span processes: jax keeps every simulated device's memory, DMA
semaphores and barriers in the Python process that runs the kernel
(`jax._src.pallas.mosaic.interpret.shared_memory`), so a kernel whose mesh has devices in another
process never ends, and raises nothing: a signal to a peer's barrier semaphore (as our kernels
send before any remote DMA) lands in this process's copy of it, and `semaphore_wait` waits
forever (a kernel without a barrier semaphore waits forever in interpret mode's global
`threading.Barrier(num_devices)` instead). tests/test_multihost.py shows the wait's stack.
`interpret_spans_processes` says when a run would do that; callers refuse it in one line
(docs/multihost.md).

Imports: JAX only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

COORDINATOR_ENV = "MKRESEARCH_COORDINATOR"  # host:port of process 0, or "auto"
PROCESS_ID_ENV = "MKRESEARCH_PROCESS_ID"
NUM_PROCESSES_ENV = "MKRESEARCH_NUM_PROCESSES"
LOCAL_DEVICES_ENV = "MKRESEARCH_LOCAL_DEVICES"  # CPU: simulated devices in this process
ENV = (COORDINATOR_ENV, PROCESS_ID_ENV, NUM_PROCESSES_ENV, LOCAL_DEVICES_ENV)
AUTO = "auto"
CPU_COLLECTIVES = "gloo"
INTERPRET_ACROSS_PROCESSES = (
    "TPU interpret mode keeps every device's memory and semaphores in the process running the "
    "kernel, so a remote DMA's semaphore signal never reaches a peer in another process and the "
    "kernel waits forever: a Pallas kernel cannot span processes off a TPU")


@dataclass(frozen=True)
class Runtime:
    """How this process joins a multi-process run (None: a single process)."""

    coordinator: str  # "host:port" of process 0, or AUTO
    process_id: int | None = None
    num_processes: int | None = None
    local_devices: int | None = None  # CPU only: simulated devices in this process

    def describe(self) -> str:
        if self.coordinator == AUTO:
            return "joined by JAX's cluster detection"
        return (f"process {self.process_id} of {self.num_processes}, coordinator "
                f"{self.coordinator}")


def _int(name: str, text: str | int | None, minimum: int) -> int | None:
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={text!r} is invalid: an int >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"{name}={text!r} is invalid: an int >= {minimum}")
    return value


def runtime_from(coordinator: str | None = None, process_id: int | str | None = None,
                 num_processes: int | str | None = None, local_devices: int | str | None = None,
                 environ: dict | None = None) -> Runtime | None:
    """The Runtime the values ask for, each given value first, else its MKRESEARCH_* variable
    (ENV); None when no coordinator is named (one process). ValueError naming the value when a
    named coordinator lacks a process id or count, or one is out of range."""
    environ = os.environ if environ is None else environ
    coordinator = coordinator or environ.get(COORDINATOR_ENV) or None
    process_id = environ.get(PROCESS_ID_ENV) if process_id is None else process_id
    num_processes = environ.get(NUM_PROCESSES_ENV) if num_processes is None else num_processes
    local_devices = environ.get(LOCAL_DEVICES_ENV) if local_devices is None else local_devices
    pid = _int(f"process id ({PROCESS_ID_ENV})", process_id, 0)
    count = _int(f"process count ({NUM_PROCESSES_ENV})", num_processes, 1)
    local = _int(f"local devices ({LOCAL_DEVICES_ENV})", local_devices, 1)
    if coordinator is None:
        if pid is not None or count is not None:
            raise ValueError(f"a process id or count needs a coordinator: --coordinator HOST:PORT "
                             f"(or {COORDINATOR_ENV}), the address of process 0")
        return None
    if coordinator != AUTO:
        if ":" not in coordinator:
            raise ValueError(f"coordinator={coordinator!r} is invalid: HOST:PORT (process 0's "
                             f"address) or {AUTO!r}")
        if pid is None or count is None:
            raise ValueError(f"coordinator {coordinator} needs the process id and count: "
                             f"--process-id I --num-processes P (or {PROCESS_ID_ENV}, "
                             f"{NUM_PROCESSES_ENV})")
        if pid >= count:
            raise ValueError(f"process id {pid} is invalid: an int in [0, {count}) (the process "
                             "count)")
    return Runtime(coordinator, pid, count, local)


def initialize(runtime: Runtime | None) -> bool:
    """Join the run `runtime` describes (nothing for None); True when a run was joined. Must come
    before JAX's backend starts (its first device or computation): RuntimeError otherwise. On
    CPU sets the simulated device count and gloo collectives first. Idempotent."""
    import jax
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge

    if runtime is None:
        return False
    if jax_distributed.global_state.client is not None:
        return True  # joined already (e.g. by the caller)
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("the multi-process runtime must start before JAX's devices are used "
                           "(jax.distributed.initialize): join first, e.g. as the first thing "
                           "of the program")
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
    if "cpu" in platforms.split(","):
        jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
        if runtime.local_devices is not None:
            jax.config.update("jax_num_cpu_devices", runtime.local_devices)
    # no preemption notices: JAX's would take SIGTERM over and let the run go on (end_on_signals)
    jax.config.update("jax_enable_preemption_service", False)
    if runtime.coordinator == AUTO:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(runtime.coordinator, runtime.num_processes,
                                   runtime.process_id)
    end_on_signals()
    return True


ENDING_SIGNALS = ("SIGINT", "SIGTERM")


def end_on_signals() -> None:
    """SIGINT and SIGTERM end this process at once, killed by the signal (their default
    actions), wherever it is: in a step, in a collective waiting for a peer, compiling.

    Why not Python's ways: JAX's preemption service takes SIGTERM as a notice for
    `reached_preemption_sync_point` and the run goes on to its end (exit 0; mkresearch has no
    sync points, so `initialize` turns the service off), and SIGINT's KeyboardInterrupt waits
    for the main thread to return from JAX, then its exit waits in `jax.distributed.shutdown`
    for peers still stepping (a collective's timeout later, ~30 s, blaming whichever failed
    first, or never). Killed by the signal, the process ends in milliseconds and its launcher
    (`mkresearch launch`) sees how: it names the process and the signal and stops the others
    (tests/test_multihost.py). Only in a multi-process run; the main thread only (where Python
    lets a handler be set)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for name in ENDING_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def process_count() -> int:
    import jax

    return jax.process_count()


def is_leader() -> bool:
    """Process 0 (the only process in a single-process run): the one that prints results."""
    import jax

    return jax.process_index() == 0


def interpret_spans_processes() -> bool:
    """True when a Pallas kernel here would run in interpret mode over several processes (which
    cannot work: module docstring)."""
    import jax

    return jax.process_count() > 1 and jax.default_backend() != "tpu"


# ---- the global mesh ------------------------------------------------------------------------
def ordered_devices(devices: list | None = None) -> list:
    """The global devices (default `jax.devices()`) with each process's consecutive, in process
    order and, within one, in JAX's order: a host's ranks are neighbours, as the sharding plan's
    hosts (`ranks_per_host`) take them. One process: `jax.devices()` as it is."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    return sorted(devices, key=lambda d: d.process_index)  # stable: JAX's order within a process


def mesh(n_ranks: int, axis: str, devices: list | None = None) -> Any:
    """A 1-D mesh of the first n_ranks of `ordered_devices(devices)` (ValueError if fewer)."""
    import jax
    import numpy as np

    ordered = ordered_devices(devices)
    if len(ordered) < n_ranks:
        raise ValueError(f"n_ranks={n_ranks} needs {n_ranks} devices but JAX has "
                         f"{len(ordered)}: on CPU set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={n_ranks} before JAX starts, "
                         "or join more processes (docs/multihost.md)")
    return jax.sharding.Mesh(np.array(ordered[:n_ranks]), (axis,))


def local_ranks(mesh_: Any) -> tuple[int, ...]:
    """The positions along a 1-D mesh whose devices belong to this process, ascending."""
    import jax

    here = jax.process_index()
    return tuple(i for i, d in enumerate(mesh_.devices.flat) if d.process_index == here)


# ---- arrays in and out ----------------------------------------------------------------------
def put(tree: Any, mesh_: Any, spec: Any) -> Any:
    """Host arrays (numpy or local jax arrays, the same values on every process) as global arrays
    with sharding NamedSharding(mesh, spec): each process transfers only the pieces its devices
    hold. In one process this is `jax.device_put`."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    sharding = NamedSharding(mesh_, spec)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def one(leaf):
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree.map(one, tree)


def put_local(stacks: Any, mesh_: Any, spec: Any) -> Any:
    """This process's ranks' slices, leaves [n_local, ...] in `local_ranks(mesh)` order, as
    global arrays [n_ranks, ...] split by `spec` over the rank axis (one slice per device): the
    other processes' slices are never seen here. In one process (every rank local) this is
    `put` of the whole stack."""
    import jax
    from jax.sharding import NamedSharding

    ranks = local_ranks(mesh_)
    devices = list(mesh_.devices.flat)
    n_ranks = len(devices)
    sharding = NamedSharding(mesh_, spec)

    def one(leaf):
        if leaf.shape[0] != len(ranks):
            raise ValueError(f"a leaf of shape {tuple(leaf.shape)} is invalid here: this process "
                             f"holds {len(ranks)} ranks ({list(ranks)}), one slice each")
        pieces = [jax.device_put(leaf[i:i + 1], devices[rank]) for i, rank in enumerate(ranks)]
        return jax.make_array_from_single_device_arrays((n_ranks, *leaf.shape[1:]), sharding,
                                                        pieces)
    return jax.tree.map(one, stacks)


def to_host(x: Any) -> Any:
    """A jax array (or a pytree of them) as numpy on this process: its value whole, gathered from
    the other processes when this one does not hold all of it (every process must call this
    together then: it is a collective)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    def one(leaf):
        if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
            return np.asarray(leaf)
        if leaf.is_fully_replicated:
            return np.asarray(leaf.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return jax.tree.map(one, x)


_gathered = [0]  # calls of gather_values so far: each one's keys are its own


def gather_values(value: Any, timeout_s: int = 600) -> list:
    """A small JSON-able value from every process -> the list of them in process order, on every
    process (through the coordinator's key-value store, not the devices: exact ints of any size).
    Every process must call it, in the same order. One process: [value]."""
    import json

    import jax
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return [value]
    _gathered[0] += 1
    key = f"mkresearch/gather/{_gathered[0]}"
    client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
    return [json.loads(client.blocking_key_value_get(f"{key}/{p}", timeout_s * 1000))
            for p in range(jax.process_count())]
