"""Measured timelines: capture an xprof trace, parse it into the timeline's `Span`s, open xprof.

On a TPU (`jax.default_backend() == "tpu"`) every `dma.phase(name)` of a kernel is also a
`jax.named_scope(name)`, which Mosaic lowers to trace events on the TensorCore: `capture` a
kernel call, `parse_trace(path, scopes=[phase names])` gives one measured `Span` per phase, and
`mkresearch.views.widgets` draws them under the model's lanes.

On CPU the same path runs, with two differences: an interpret-mode kernel shows up as host
callbacks (simulator time, not kernel structure: there the DMA log is the source of truth), and a
`jax.named_scope` is not an event of its own but op metadata. `parse_trace` recovers it: give it
`scope_names=hlo_scope_names(compiled)` and each XLA op event on the CPU is named by the scope
path its HLO instruction carries. `jax.profiler.TraceAnnotation` names are events everywhere.

Looking at a trace by hand:

    python -m xprof.server --logdir DIR --port 8791   # then open http://localhost:8791
    tensorboard --logdir DIR                           # if tensorboard is installed (profile tab)

`xprof_command(dir)` returns the first command line and `open_xprof(dir)` starts it (the caller
owns the process: `proc.terminate()` when done).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mkresearch.prediction.timeline import Span

XPROF_PORT = 8791
_HLO_METADATA = re.compile(r'%?([\w.\-]+) = [^\n]*?metadata=\{[^}]*?op_name="([^"]+)"')
_SCOPE_STATS = ("tf_op", "long_name", "name", "scope", "tf_op_name")


# ---- capture ---------------------------------------------------------------------------------
def capture(fn: Callable, *args: Any, logdir: str | Path, annotation: str = "mkresearch_step",
            warmup: bool = True) -> Path:
    """Run `fn(*args)` under `jax.profiler.trace(logdir)` and return the `.xplane.pb` it wrote.

    With `warmup`, `fn` runs once before tracing so the trace holds execution, not compilation.
    The traced call is wrapped in `TraceAnnotation(annotation)`, which is an event on any backend.
    """
    import jax

    if not callable(fn):
        raise ValueError(f"fn={fn!r} is invalid: a callable (the jitted kernel wrapper)")  # noqa: TRY004
    logdir = Path(logdir)
    if warmup:
        jax.block_until_ready(fn(*args))
    before = set(trace_files(logdir))
    with jax.profiler.trace(str(logdir)), jax.profiler.TraceAnnotation(annotation):
        jax.block_until_ready(fn(*args))
    new = [p for p in trace_files(logdir) if p not in before]
    if not new:
        raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {logdir}")
    return new[-1]


def trace_files(logdir: str | Path) -> list[Path]:
    """The `.xplane.pb` files under `logdir` (plugins/profile/<run>/), oldest first."""
    logdir = Path(logdir)
    if not logdir.exists():
        return []
    return sorted(logdir.glob("**/*.xplane.pb"), key=lambda p: (p.stat().st_mtime, str(p)))


def hlo_scope_names(compiled_or_text: Any) -> dict[str, str]:
    """HLO instruction name -> its `op_name` metadata (the jax.named_scope path, e.g.
    "jit(step)/gemv/dot_general"), from a `jax.stages.Compiled` or its `as_text()`."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    return {name: op_name for name, op_name in _HLO_METADATA.findall(text or "")}


# ---- parse -----------------------------------------------------------------------------------
def _event_paths(event: Any, scope_names: Mapping[str, str]) -> list[str]:
    """Names an event answers to: its own name, scope-like stats, and its HLO op's scope path."""
    paths = [event.name]
    for key, value in event.stats:
        if key in _SCOPE_STATS and isinstance(value, str):
            paths.append(value)
        if key == "hlo_op" and isinstance(value, str) and value in scope_names:
            paths.append(scope_names[value])
    return paths


def _matches(scope: str, paths: Iterable[str]) -> bool:
    return any(path == scope or scope in path.split("/") for path in paths)


def parse_trace(path: str | Path, scopes: Sequence[str] | None = None, *,
                scope_names: Mapping[str, str] | None = None,
                planes: Sequence[str] | None = None) -> list[Span]:
    """Spans (seconds from the first matched event) of a trace's events, as the timeline's `Span`s.

    `path`: an `.xplane.pb` file or a log directory (its newest file). `scopes`: keep events whose
    name is a scope, or whose scope path contains it as a component (the span is named by the
    scope); None keeps every event with a scope path (XLA ops), named by that path. `scope_names`:
    HLO instruction -> scope path (see `hlo_scope_names`), needed on CPU. `planes`: only planes
    whose name contains one of these (e.g. "/device:TPU"). Lanes are "plane:line".
    """
    from jax.profiler import ProfileData

    path = Path(path)
    if path.is_dir():
        files = trace_files(path)
        if not files:
            raise ValueError(f"path={str(path)!r} is invalid: no .xplane.pb under it")
        path = files[-1]
    if not path.exists():
        raise ValueError(f"path={str(path)!r} is invalid: no such trace file")
    if scopes is not None and (isinstance(scopes, str) or not all(isinstance(s, str) for s in scopes)):
        raise ValueError(f"scopes={scopes!r} is invalid: a sequence of scope names (or None)")
    scope_names = dict(scope_names or {})
    data = ProfileData.from_file(str(path))
    found: list[tuple[str, str, int, int]] = []  # (lane, name, start_ns, end_ns)
    for plane in data.planes:
        if planes is not None and not any(p in plane.name for p in planes):
            continue
        for line in plane.lines:
            for event in line.events:
                if event.name.startswith("end: "):  # CPU thunk executor's completion markers
                    continue
                paths = _event_paths(event, scope_names)
                if scopes is None:
                    scoped = [p for p in paths[1:] if "/" in p]
                    if not scoped:
                        continue
                    name = scoped[0]
                else:
                    name = next((s for s in scopes if _matches(s, paths)), None)
                    if name is None:
                        continue
                start = int(event.start_ns)
                found.append((f"{plane.name}:{line.name}", name, start,
                              start + int(event.duration_ns)))
    if not found:
        return []
    t0 = min(start for _, _, start, _ in found)
    return sorted((Span(lane=lane, name=name, start=(a - t0) * 1e-9, end=(b - t0) * 1e-9,
                        kind="measured") for lane, name, a, b in found),
                  key=lambda s: (s.start, s.lane))


def scope_totals(spans: Sequence[Span]) -> dict[str, float]:
    """Seconds per scope name, summed over spans: the measured counterpart of phase durations."""
    totals: dict[str, float] = {}
    for span in spans:
        totals[span.name] = totals.get(span.name, 0.0) + span.duration
    return totals


# ---- open ------------------------------------------------------------------------------------
def xprof_command(logdir: str | Path, port: int = XPROF_PORT) -> list[str]:
    """`python -m xprof.server --logdir DIR --port PORT`: serves the trace viewer at
    http://localhost:PORT (or through Colab's port proxy). TensorBoard's profile tab reads the
    same directory: `tensorboard --logdir DIR`."""
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port={port!r} is invalid: an int in 1..65535")
    return [sys.executable, "-m", "xprof.server", "--logdir", str(logdir), "--port", str(port)]


def tensorboard_command(logdir: str | Path, port: int = 6006) -> list[str]:
    """`tensorboard --logdir DIR --port PORT` (needs tensorboard + tensorboard-plugin-profile)."""
    exe = shutil.which("tensorboard") or "tensorboard"
    return [exe, "--logdir", str(logdir), "--port", str(port)]


def open_xprof(logdir: str | Path, port: int = XPROF_PORT, wait_s: float = 3.0) -> subprocess.Popen:
    """Start xprof on `logdir` in the background and return the process (call `.terminate()`).

    In Colab, then `from google.colab import output; output.serve_kernel_port_as_window(port)`.
    """
    proc = subprocess.Popen(xprof_command(logdir, port), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(wait_s)
    if proc.poll() is not None:
        raise RuntimeError(f"xprof exited with code {proc.returncode}; run "
                           f"{' '.join(xprof_command(logdir, port))!r} to see why")
    print(f"xprof serving {logdir} at http://localhost:{port}  (stop: proc.terminate())")
    return proc
