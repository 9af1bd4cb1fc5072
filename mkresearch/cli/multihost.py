"""`decode` and `bench` as one process of a multi-process run (docs/multihost.md): the options
that join it, and what changes when there are several processes.

    mkresearch decode kimi-k3-mini --ranks 8 --backend reference \\
        --coordinator 10.0.0.2:8476 --process-id 1 --num-processes 2 [--local-devices 4]
    mkresearch decode kimi-k3-mini --ranks 16 --coordinator auto     # every worker of a TPU slice

Each option falls back on its variable (`mkresearch.hardware.distributed.ENV`:
MKRESEARCH_COORDINATOR, MKRESEARCH_PROCESS_ID, MKRESEARCH_NUM_PROCESSES,
MKRESEARCH_LOCAL_DEVICES), which `mkresearch launch` sets for the processes it starts. `join`
runs first in the command, before JAX's backend starts. Then `--ranks N` is a mesh over every
process's devices, weights are placed (and a checkpoint read) per process, results gathered and
printed by process 0 alone (`leader_prints`). Each process prints one line to stderr when it has
joined (`JOINED`), naming itself, its devices and the run's.

Off a TPU the megakernel cannot span processes (interpret mode keeps every device in one
process: `distributed.INTERPRET_ACROSS_PROCESSES`): `refuse_kernel_across_processes` says so in
one line and names the plain-JAX sharded reference (`--backend reference`), which can.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mkresearch.cli.common import UsageError, human_bytes
from mkresearch.hardware import distributed

JOINED = "joined"  # in the one line each process prints when it has joined a run


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--coordinator, --process-id, --num-processes, --local-devices."""
    group = p.add_argument_group(
        "several processes (one per host: docs/multihost.md; `mkresearch launch` starts them "
        "on this machine)")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help=f"process 0's address, or 'auto' on a Cloud TPU VM slice (JAX finds "
                            f"the workers); default ${distributed.COORDINATOR_ENV}, else one "
                            "process")
    group.add_argument("--process-id", default=None, metavar="I",
                       help=f"this process's index, 0 .. P-1 (default "
                            f"${distributed.PROCESS_ID_ENV})")
    group.add_argument("--num-processes", default=None, metavar="P",
                       help=f"processes in the run (default ${distributed.NUM_PROCESSES_ENV})")
    group.add_argument("--local-devices", default=None, metavar="D",
                       help=f"CPU only: simulated devices in this process (default "
                            f"${distributed.LOCAL_DEVICES_ENV}, else 1)")


def join(args: argparse.Namespace) -> bool:
    """Join the run the options (or the environment) name, before anything uses JAX's devices;
    False when they name none (one process). Bad values: UsageError, one line."""
    try:
        runtime = distributed.runtime_from(args.coordinator, args.process_id,
                                           args.num_processes, args.local_devices)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if runtime is None:
        return False
    try:
        distributed.initialize(runtime)
    except RuntimeError as error:
        raise UsageError(str(error)) from None
    import jax

    print(f"mkresearch: process {jax.process_index()} of {jax.process_count()} {JOINED} "
          f"({runtime.describe()}): {len(jax.local_devices())} of {len(jax.devices())} "
          f"{jax.default_backend()} devices here", file=sys.stderr, flush=True)
    return True


def check_sharded(ranks: int, command: str) -> None:
    """UsageError (one line) for a run of several processes that is not sharded (--ranks 1):
    each process would run the whole model alone."""
    count = distributed.process_count()
    if count > 1 and ranks == 1:
        raise UsageError(f"{command} on {count} processes needs --ranks N > 1 (a mesh over "
                         "their devices); one process runs --ranks 1")


def refuse_kernel_across_processes(ranks: int, command: str = "decode") -> None:
    """UsageError (one line) when the sharded megakernel would run in interpret mode over
    several processes, which cannot work; it names what can (decode's --backend reference)."""
    if ranks > 1 and distributed.interpret_spans_processes():
        instead = ("--backend reference" if command == "decode" else
                   f"decode --ranks {ranks} --backend reference")
        raise UsageError(f"{command} --ranks {ranks} over {distributed.process_count()} "
                         f"processes needs a TPU for the megakernel: "
                         f"{distributed.INTERPRET_ACROSS_PROCESSES}; the plain-JAX sharded "
                         f"reference runs across processes ({instead})")


def leader_prints() -> bool:
    """Whether this process prints results (process 0; a single process always)."""
    return distributed.is_leader()


def processes_facts() -> dict[str, Any]:
    """The run's processes and devices, for a result."""
    import jax

    return {"processes": jax.process_count(), "devices": len(jax.devices()),
            "local_devices": len(jax.local_devices())}


def bytes_read_rows(loaded: Any) -> list[dict]:
    """What each process read of a checkpoint (a `rank_loader.RankLoad` here), gathered from
    every process, in process order (every process calls it together)."""
    import jax

    return distributed.gather_values({"process": jax.process_index(), **loaded.facts()})


def print_processes(result: dict) -> None:
    """The run's processes and, for a checkpoint read per process, what each read."""
    if result.get("processes", 1) > 1:
        print(f"{result['processes']} processes, {result['devices']} {result['platform']} "
              f"devices ({result['local_devices']} per process); results gathered to process 0")
    for row in result.get("bytes_read", ()):
        print(f"  process {row['process']} (ranks {row['ranks']}) read "
              f"{human_bytes(row['bytes_read'])} of the checkpoint's "
              f"{human_bytes(row['total_bytes'])} ({row['bytes_read'] / row['total_bytes']:.0%})")


def print_uncompared(result: dict) -> None:
    print("not compared with one device: no process holds every weight (each read its ranks' "
          f"shards); every step's logits: sha256 {result['logits_sha256'][:16]}..., to compare "
          "with a one-process run's")
