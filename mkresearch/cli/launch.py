"""`mkresearch launch --processes P -- COMMAND ...`: a multi-process run on this machine, as a
multi-host slice runs one process per host (docs/multihost.md).

Starts P processes of `mkresearch COMMAND ...` (the same command line each), joined through a
coordinator on 127.0.0.1 at a free port: each gets MKRESEARCH_COORDINATOR,
MKRESEARCH_PROCESS_ID, MKRESEARCH_NUM_PROCESSES and MKRESEARCH_LOCAL_DEVICES (`cli.multihost`),
JAX_PLATFORMS=cpu unless this machine has a TPU. Process 0's stdout is this command's stdout
(the results: only process 0 prints them, `--json` stays one object per line); every stderr line
is passed on prefixed "[process i]".

Watching: the first process to fail (a non-zero exit status, or killed by a signal) ends the
run: one line on stderr names it, how it ended and its last line of stderr, and every other
process is killed (SIGKILL to its process group: JAX's runtime catches SIGTERM), then waited
for. SIGINT or SIGTERM to one of the processes kills it at once (a joined process restores
their default actions: `hardware.distributed.end_on_signals`), so the run ends the same way,
naming it. `--timeout S` ends a run that has not finished after S seconds the same way. A signal
to this command (Ctrl-C, SIGTERM) stops every process first (exit status 128 + the signal). On
Linux each process is also killed when this command dies (PR_SET_PDEATHSIG), so no process
outlives it. The exit status is 0 when every process exited 0, else the failing process's
status (128 + signal when killed).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mkresearch.cli.common import UsageError, at_least, in_range
from mkresearch.cli.options import add_command
from mkresearch.hardware import distributed

EXAMPLES = (("mkresearch launch --processes 2 -- decode kimi-k3-mini --ranks 8 --backend "
             "reference --steps 4"),
            ("mkresearch launch --processes 2 --local-devices 2 -- decode --checkpoint DIR "
             "--prompt \"The capital of France is\" --ranks 4 --backend reference"))
POLL_S = 0.05  # how often the processes are looked at
PREFIX = "mkresearch launch"


def add_parser(commands: Any) -> None:
    p = add_command(commands, "launch", "run a command as several processes on this machine, "
                                        "as on the hosts of a multi-host slice", EXAMPLES)
    p.add_argument("--processes", type=int, required=True, metavar="P",
                   help="processes to start (one per simulated host)")
    p.add_argument("--local-devices", type=int, default=None, metavar="D",
                   help="simulated CPU devices per process (default: the command's --ranks "
                        "divided by P, else 1)")
    p.add_argument("--port", type=int, default=0,
                   help="the coordinator's port on 127.0.0.1 (default: a free one)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="end the run if it has not finished after S seconds (default: none)")
    p.add_argument("launched", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the mkresearch command each process runs (after --)")


def _command(args: argparse.Namespace) -> list[str]:
    command = list(args.launched)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("launch needs a command after --, e.g. -- decode kimi-k3-mini --ranks 8 "
                         "--backend reference")
    if command[0] == "launch":
        raise UsageError("launch cannot launch itself: name the command after --")
    return command


def _ranks(command: list[str]) -> int | None:
    for i, word in enumerate(command):
        if word == "--ranks" and i + 1 < len(command):
            return int(command[i + 1]) if command[i + 1].isdigit() else None
        if word.startswith("--ranks="):
            value = word.split("=", 1)[1]
            return int(value) if value.isdigit() else None
    return None


def local_devices(args: argparse.Namespace, command: list[str]) -> int:
    """--local-devices, else the command's --ranks over the processes (which must divide it)."""
    if args.local_devices is not None:
        at_least("--local-devices", args.local_devices, 1)
        return args.local_devices
    ranks = _ranks(command)
    if ranks is None:
        return 1
    if ranks % args.processes:
        raise UsageError(f"--ranks {ranks} does not split over --processes {args.processes}: "
                         "give --local-devices D (D x P >= the ranks)")
    return max(1, ranks // args.processes)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: a new process group, killed when the launcher dies (Linux)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


@dataclass
class Process:
    """One started process: its index, Popen, the threads passing its output on, its last lines
    of stderr."""

    index: int
    popen: subprocess.Popen
    threads: list = field(default_factory=list)
    last_err: deque = field(default_factory=lambda: deque(maxlen=20))

    def ended(self) -> str:
        """How it ended: 'exited with status N' or 'was killed by SIGNAME'."""
        code = self.popen.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def last_line(self) -> str:
        lines = [line for line in self.last_err if line.strip()]
        return lines[-1].strip() if lines else ""

    def status(self) -> int:
        code = self.popen.returncode or 0
        return 128 - code if code < 0 else code


# gloo (JAX's CPU collectives) prints its connections on stdout: passed on to stderr instead
GLOO_LINE = "[Gloo] "


def _pass_on(stream: Any, out: Any, prefix: str, keep: deque | None, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        if keep is not None:
            keep.append(line)
        to, text = out, prefix + line
        if out is sys.stdout and line.startswith(GLOO_LINE):
            to, text = sys.stderr, "[process 0] " + line
        with lock:
            to.write(text)
            to.flush()
    stream.close()


def start(command: list[str], processes: int, devices: int, port: int) -> list[Process]:
    """The P processes of `mkresearch COMMAND`, each with its MKRESEARCH_* variables."""
    lock, started = threading.Lock(), []
    base = {k: v for k, v in os.environ.items() if k not in distributed.ENV}
    if not (os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio")):
        base["JAX_PLATFORMS"] = "cpu"
    for index in range(processes):
        env = {**base, distributed.COORDINATOR_ENV: f"127.0.0.1:{port}",
               distributed.PROCESS_ID_ENV: str(index),
               distributed.NUM_PROCESSES_ENV: str(processes),
               distributed.LOCAL_DEVICES_ENV: str(devices)}
        # every process started before any thread (a preexec_fn is only safe without threads)
        started.append(Process(index, subprocess.Popen(
            [sys.executable, "-m", "mkresearch", *command], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, bufsize=1,
            preexec_fn=_die_with_parent)))  # noqa: PLW1509 - started before this command's threads
    for process in started:
        index, popen = process.index, process.popen
        process.threads = [
            threading.Thread(target=_pass_on, daemon=True, args=(
                popen.stdout, sys.stdout if index == 0 else sys.stderr,
                "" if index == 0 else f"[process {index}] ", None, lock)),
            threading.Thread(target=_pass_on, daemon=True, args=(
                popen.stderr, sys.stderr, f"[process {index}] ", process.last_err, lock))]
        for thread in process.threads:
            thread.start()
    return started


def stop(processes: list[Process]) -> None:
    """SIGKILL to every process group still running, then wait for each and its output."""
    for process in processes:
        if process.popen.poll() is None:
            try:
                os.killpg(process.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in processes:
        process.popen.wait()
        for thread in process.threads:
            thread.join(timeout=5)


def watch(processes: list[Process], timeout: float | None) -> tuple[Process | None, str]:
    """Until every process exited 0 -> (None, ""), or the first to fail -> (it, how);
    (None, "timeout") after `timeout` seconds."""
    started = time.monotonic()
    while True:
        codes = [process.popen.poll() for process in processes]
        failed = [p for p, code in zip(processes, codes) if code not in (None, 0)]
        if failed:  # seen in one look: a killed one first (the others may have died of it)
            first = min(failed, key=lambda p: (p.popen.returncode > 0, p.index))
            return first, first.ended()
        if None not in codes:
            return None, ""
        if timeout is not None and time.monotonic() - started > timeout:
            return None, "timeout"
        time.sleep(POLL_S)


def run(args: argparse.Namespace) -> int:
    at_least("--processes", args.processes, 1)
    if args.port:  # 0: a free one
        in_range("--port", args.port, 1, 65535, "a TCP port; 0 or none: a free one")
    if args.timeout is not None and not 0 < args.timeout < math.inf:
        raise UsageError(f"--timeout {args.timeout:g} is invalid: a number of seconds > 0")
    command = _command(args)
    devices = local_devices(args, command)
    port = args.port or free_port()
    processes = start(command, args.processes, devices, port)
    print(f"{PREFIX}: {args.processes} processes of `mkresearch {' '.join(command)}` "
          f"(pids {', '.join(str(p.popen.pid) for p in processes)}), {devices} devices each, "
          f"coordinator 127.0.0.1:{port}", file=sys.stderr, flush=True)

    received = [signal.SIGINT]  # Ctrl-C's KeyboardInterrupt, unless SIGTERM came

    def interrupted(signum: int, frame: Any) -> None:
        received[0] = signal.Signals(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        failed, how = watch(processes, args.timeout)
    except KeyboardInterrupt:
        stop(processes)
        print(f"{PREFIX}: received {received[0].name}: stopped all {len(processes)} processes",
              file=sys.stderr)
        return 128 + received[0]
    finally:
        signal.signal(signal.SIGTERM, previous)
    others = [p for p in processes if p is not failed and p.popen.poll() is None]
    stop(processes)
    if how == "timeout":
        print(f"{PREFIX}: the run did not finish in --timeout {args.timeout:g} s: stopped "
              f"{len(others)} processes", file=sys.stderr)
        return 124
    if failed is None:
        return 0
    last = failed.last_line() if failed.popen.returncode > 0 else ""  # its error, if it had one
    print(f"{PREFIX}: process {failed.index} of {len(processes)} (pid {failed.popen.pid}) {how}"
          + (f" ({last})" if last else "") + f"; stopped the other {len(others)}",
          file=sys.stderr)
    return failed.status()
