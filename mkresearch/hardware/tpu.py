"""How kernels run: compiled on a TPU, TPU interpret mode elsewhere; and compiling for TPUs on CPU.

One place decides how every `pallas_call` runs: `interpret_params()` is `None` on a real TPU (and
inside `with compiling():`), else a `pltpu.InterpretParams` built from the options set with
`interpret_options(...)`. Wrappers read it at call time and pass it to `pallas_call(interpret=...)`
as a static argument (it is a frozen, hashable dataclass).

`compile_for(fn, *shapes, chip=...)` runs the real Mosaic compiler of libtpu for a TPU chip this
machine does not have (devices from `jax.experimental.topologies`): tiling, layout and VMEM errors
surface there, and the compiled cost and memory analyses answer.

This module must import without jax (`select_platform()` runs before jax is imported), so jax is
imported inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from mkresearch.hardware import fast_interpret as fast  # both import without jax (see above)
from mkresearch.hardware.chips import CHIPS, get_chip

# ---- platform -----------------------------------------------------------------------------------


def _tpu_present() -> bool:
    """A TPU on this machine: /dev/accel* (v4, v5e, v6e, TPU7x) or /dev/vfio (v5p, v6e VMs)."""
    try:
        if any(name.startswith("accel") for name in os.listdir("/dev")):
            return True
    except OSError:
        pass
    return os.path.isdir("/dev/vfio") and any(n != "vfio" for n in os.listdir("/dev/vfio"))


def select_platform() -> None:
    """Before jax is imported: JAX_PLATFORMS=cpu unless this machine has a TPU or it is set already.

    With libtpu installed and no TPU, jax would otherwise try the TPU backend first and print
    host-discovery errors. An explicit JAX_PLATFORMS (even empty) is respected.
    """
    _keep_bf16_roundings()
    if "JAX_PLATFORMS" in os.environ or _tpu_present():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # jax read the variable at import; its backends may still be unset
        with contextlib.suppress(Exception):  # backends already initialised: nothing to choose
            sys.modules["jax"].config.update("jax_platforms", "cpu")


_EXACT_ROUNDING_FLAG = "--xla_allow_excess_precision=false"


def _keep_bf16_roundings() -> None:
    """Make XLA honour every bf16 rounding the reference writes (the spec's bf(...)).

    By default XLA may keep a fused intermediate in f32 where the program rounds it to bf16 (e.g.
    the Mix output feeding an RMSNorm), so a jitted reference drifts from the spec by a bf16 ulp
    in places and from the kernels, which round in VMEM as written. XLA reads XLA_FLAGS when its
    first backend starts, so this works even after `import jax`. An explicit setting is kept.
    """
    add_xla_flag(_EXACT_ROUNDING_FLAG)


def add_xla_flag(flag: str) -> None:
    """Append `--name=value` to XLA_FLAGS unless the variable sets that name already (an explicit
    setting is kept). XLA reads XLA_FLAGS when its first backend starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=")[0].lstrip("-") not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def on_tpu() -> bool:
    """True if jax's default backend is a real TPU (kernels are compiled, not interpreted)."""
    import jax

    return jax.default_backend() == "tpu"


# ---- interpret mode -----------------------------------------------------------------------------

# Options of pltpu.InterpretParams set by interpret_options(); defaults of this project.
_DEFAULT_OPTIONS: dict[str, Any] = {"detect_races": False, "vector_clock_size": None}
_options: dict[str, Any] = dict(_DEFAULT_OPTIONS)
_state = threading.local()  # .compiling: depth of `with compiling():`
_fast_interpret = True  # use mkresearch.hardware.fast_interpret when the jax version allows it


def _compiling() -> bool:
    return getattr(_state, "compiling", 0) > 0


@contextlib.contextmanager
def compiling(chip: str | None = None) -> Iterator[None]:
    """Inside: interpret_params() is None, so kernels traced here are built for Mosaic (a TPU),
    and target_chip() is `chip` (a mkresearch.hardware.chips name; None: not said)."""
    outer_chip = getattr(_state, "chip", None)
    _state.compiling = getattr(_state, "compiling", 0) + 1
    _state.chip = chip
    try:
        yield
    finally:
        _state.compiling -= 1
        _state.chip = outer_chip


# The chip kernels are built for where no TPU is present (interpret mode, compiles from shapes):
# the release's. Where a TPU is present, its own chip is the default (`default_chip`).
DEFAULT_CHIP = "tpu7x"


def chip_of_kind(device_kind: str) -> str | None:
    """The mkresearch.hardware.chips name of a jax `Device.device_kind` ("TPU v5 lite" -> "v5e");
    None for a kind the package does not know."""
    return next((chip.name for chip in CHIPS.values() if chip.device_kind == device_kind), None)


def present_chip() -> str | None:
    """This machine's TPU as a chips name (from `jax.devices()[0].device_kind`); None without a
    TPU, or for a TPU the package does not know."""
    if not on_tpu():
        return None
    import jax

    return chip_of_kind(jax.devices()[0].device_kind)


def default_chip() -> str:
    """The chip a kernel is built for unless told otherwise: the TPU present, else DEFAULT_CHIP
    (the default of `MegakernelOptions.chip`, of the CLI's --chip and of the notebooks)."""
    return present_chip() or DEFAULT_CHIP


def check_runs_here(chip: str) -> None:
    """ValueError in one line when a kernel built for `chip` is about to run on a TPU of another
    kind: its VMEM plan and decode paths are that chip's (compile it for `chip` from shapes
    instead: `compile_for`, `mkresearch compile --chip`)."""
    present = present_chip()
    if present is not None and not _compiling() and chip != present:
        raise ValueError(f"chip={chip!r} is invalid here: this machine's TPU is {present!r} and a "
                         f"kernel built for {chip} cannot run on it; build for {present!r} (the "
                         f"default) or compile for {chip} without running (`mkresearch compile "
                         f"--chip {chip}`)")


def target_chip() -> str | None:
    """The chip kernels traced now are built for, as a mkresearch.hardware.chips name: compile_for's chip
    inside it; on a TPU, this TPU (None if it is not one of CHIPS); in interpret mode None.
    Wrappers read it at call time, like interpret_params(), for chip-dependent code paths."""
    if _compiling():
        return getattr(_state, "chip", None)
    return present_chip()


class interpret_options:
    """Set pltpu.InterpretParams options: `interpret_options(detect_races=True, vector_clock_size=16)`.

    Called plainly it sets them for the rest of the process; used as `with interpret_options(...):`
    it restores the previous options on exit. Any InterpretParams field is accepted (unknown names
    raise ValueError listing the allowed ones); `reset_interpret_options()` goes back to the defaults.
    """

    def __init__(self, **options: Any) -> None:
        allowed = _interpret_fields()
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"interpret_options: unknown option(s) {', '.join(unknown)}; "
                             f"allowed: {', '.join(sorted(allowed))}")
        vcs = options.get("vector_clock_size")
        if vcs is not None and (not isinstance(vcs, int) or isinstance(vcs, bool) or vcs < 2):
            raise ValueError(f"vector_clock_size={vcs!r} is invalid: None or an int >= 2 "
                             "(>= 16 to catch double-buffer slot overwrites)")
        self._previous = dict(_options)
        _options.update(options)
        try:
            _build_interpret_params(tuple(sorted(_options.items())))  # validate now, not at call time
        except Exception:
            _options.clear()
            _options.update(self._previous)
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        _options.clear()
        _options.update(self._previous)


def reset_interpret_options() -> None:
    """Back to the project's defaults (no race detection)."""
    _options.clear()
    _options.update(_DEFAULT_OPTIONS)


def current_interpret_options() -> dict[str, Any]:
    return dict(_options)


@functools.cache
def _interpret_fields() -> tuple[str, ...]:
    import dataclasses

    from jax.experimental.pallas import tpu as pltpu

    return tuple(f.name for f in dataclasses.fields(pltpu.InterpretParams))


@functools.cache
def _build_interpret_params(items: tuple[tuple[str, Any], ...]):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(**dict(items))


def set_fast_interpret(enabled: bool) -> None:
    """Turn the io_callback speed-up (mkresearch.hardware.fast_interpret) on or off for later calls."""
    global _fast_interpret
    _fast_interpret = bool(enabled)
    if not enabled:
        fast.remove()


def interpret_params():
    """How to run a pallas_call here: None (compile it) on a TPU or inside compiling(), else
    pltpu.InterpretParams with the current interpret_options(). Hashable: pass it as a static arg."""
    if _compiling() or on_tpu():
        return None
    if _fast_interpret:
        fast.apply()  # no-op unless the pinned jax version; idempotent
    _latch_races()
    return _build_interpret_params(tuple(sorted(_options.items())))


def describe_backend() -> str:
    """One line: 'cpu: TPU interpret mode' or 'tpu: compiled (TPU v7x)'."""
    import jax

    backend = jax.default_backend()
    if backend == "tpu":
        return f"tpu: compiled ({jax.devices()[0].device_kind})"
    return f"{backend}: TPU interpret mode"


# ---- races and interpreter state ----------------------------------------------------------------


def _interpreter():
    """The private module holding interpret-mode global state (path checked for jax 0.10.2)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return interpret_pallas_call


# The interpreter recreates its race-detection state at the start of every kernel, so a race in
# one kernel would be forgotten once the next kernel runs. A latch remembers it until reset_races().
_race_latch = {"found": False}


def _latch_races() -> None:
    """Make the interpreter's RaceDetectionState report every race to _race_latch (idempotent)."""
    module = _interpreter()
    base = getattr(module, "RaceDetectionState", None)
    if base is None or getattr(base, "_mkresearch_latched", False):
        return

    class LatchedRaceDetectionState(base):  # type: ignore[misc, valid-type]
        _mkresearch_latched = True

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "races_found" and value:
                _race_latch["found"] = True
            super().__setattr__(name, value)

    module.RaceDetectionState = LatchedRaceDetectionState


def races_found() -> bool:
    """Whether the race detector flagged a race in any kernel since the last reset_races()."""
    races = getattr(_interpreter(), "races", None)
    return _race_latch["found"] or bool(races is not None and races.races_found)


def reset_races() -> None:
    """Clear the race flag."""
    _race_latch["found"] = False
    races = getattr(_interpreter(), "races", None)
    if races is not None:
        races.races_found = False


def reset_interpret_state() -> None:
    """Reset the simulated TPU after an exception inside an interpreted kernel (also the races)."""
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
    reset_races()
    _drop_failed_runtime_tokens()


class KernelTimeout(TimeoutError):
    """An interpreted kernel still running after the time it was given: stopped (run_timed)."""


def run_timed(fn: Callable[[], Any], seconds: float, what: str = "the kernel") -> Any:
    """fn() (a call that runs interpreted kernels), stopped after `seconds`: its result, or
    KernelTimeout in one line if it had not finished. A DMA wait on a semaphore nothing will
    signal (a copy started with another semaphore than its wait's) never returns in interpret
    mode, and the notebook would hang with no message; here the simulated TPU is told that the
    run failed, which ends every wait of it (private interpreter state, jax 0.10.2; the waiting
    thread is left to end by itself if that moved), and is reset. An exception of fn is raised
    as it is. On a TPU (compiled) fn just runs."""
    if interpret_params() is None:
        return fn()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = error

    thread = threading.Thread(target=run, name=f"mkresearch run_timed: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        timeout = KernelTimeout(f"{what} did not finish in {seconds:g} s: a DMA wait that no "
                                "started copy signals never returns (is each copy's semaphore "
                                "the one its wait waits on?)")
        memory = getattr(_interpreter(), "_shared_memory", None)
        if memory is not None and hasattr(memory, "set_failed"):
            memory.set_failed(timeout, top_level=False)  # every wait of the run raises now
        thread.join(10)
        reset_interpret_state()
        raise timeout
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _drop_failed_runtime_tokens() -> None:
    """Forget the effect tokens of the failed step. An interpreted kernel's callbacks are ordered
    effects: jax keeps the last computation's token and blocks on it before the next effectful
    call (and at exit), so the one exception would be raised again by every later kernel of this
    thread. Private jax state (jax 0.10.2: `dispatch.runtime_tokens`); a no-op if it moved."""
    try:
        from jax._src import dispatch
    except ImportError:
        return
    tokens = getattr(dispatch, "runtime_tokens", None)
    if tokens is not None and hasattr(tokens, "clear"):
        tokens.clear()


# ---- compiling for a TPU on this machine --------------------------------------------------------


class VmemOverflowError(ValueError):
    """The kernel needs more VMEM than the chip has (raised by compile_for)."""


@dataclass(frozen=True)
class CompileResult:
    """What compiling `fn` for `chip` with libtpu gave (all per device)."""

    chip: str
    seconds: float  # lower + compile wall time on this machine
    flops: float  # cost_analysis()["flops"]: for Mosaic kernels, what pallas_call(cost_estimate=) declares
    bytes_accessed: float  # cost_analysis()["bytes accessed"] (or the sum of its per-operand entries)
    memory: Mapping[str, int] = field(compare=False)  # memory_analysis(): argument/output/temp... bytes
    cost: Mapping[str, float] = field(default_factory=dict, compare=False)  # all of cost_analysis()
    n_mosaic_kernels: int = 0  # custom-calls with target tpu_custom_call in the compiled HLO
    hlo_text: str = field(default="", repr=False, compare=False)

    @property
    def mosaic_cost(self) -> dict[str, int]:
        """What the Mosaic kernels declare (`pallas_call(cost_estimate=...)`), summed over the
        tpu_custom_calls of the compiled HLO: flops, transcendentals, bytes_accessed (0 for a
        kernel declaring none). `flops` and `bytes_accessed` above are the whole program's: these
        plus the ops XLA adds around the kernels (operand copies into VMEM, reshapes, slices)."""
        total = dict.fromkeys(("flops", "transcendentals", "bytes_accessed"), 0)
        for line in self.hlo_text.splitlines():
            match = _MOSAIC_COST.search(line) if "tpu_custom_call" in line else None
            for key, value in (json.loads(match.group(1)).items() if match else ()):
                if key in total:
                    total[key] += int(value)
        return total

    def __str__(self) -> str:
        total = sum(v for k, v in self.memory.items() if k.endswith("size_in_bytes"))
        return (f"compiled for {self.chip} in {self.seconds:.2f} s: {self.n_mosaic_kernels} Mosaic "
                f"kernel(s), {self.flops:.3g} flops, {self.bytes_accessed:.3g} bytes accessed, "
                f"{total / 2**20:.1f} MiB buffers")


# A Mosaic custom call's backend_config carries its pallas_call cost estimate as JSON.
_MOSAIC_COST = re.compile(r'"cost_estimate":(\{[^{}]*\})')

_LIBTPU_NOISE = re.compile(
    r"host bounds|TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|worker hostname|Source Location Trace|"
    r"libtpu_init_utils|Logging before InitGoogle|ALLOW_MULTIPLE_LIBTPU_LOAD|^=+$|^\s*$|tfrc/runtime|could not determine TPU")


@contextlib.contextmanager
def _quiet_libtpu() -> Iterator[None]:
    """Swallow libtpu's C++ warnings about host bounds/worker names (no TPU here); keep the rest."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (e.g. some notebook front-ends)
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [line for line in sink.read().decode(errors="replace").splitlines()
                    if not _LIBTPU_NOISE.search(line)]
            if kept:
                print("\n".join(kept), file=sys.stderr)


# What a cell that compiles for a TPU says where it cannot (one line, the extra that brings libtpu).
NO_LIBTPU = ("compiling for a TPU needs libtpu, which this Python lacks: pip install "
             "'mkresearch[tpu]' (Linux x86-64), restart the runtime, run again")


def can_compile() -> bool:
    """Whether libtpu is here to compile for a TPU (the `tpu` extra, Linux x86-64; a hosted CPU
    runtime such as Colab's usually lacks it)."""
    return bool(os.environ.get("TPU_LIBRARY_PATH")) or importlib.util.find_spec("libtpu") is not None


@functools.cache
def _topology(topology_name: str):
    from jax.experimental import topologies

    if not can_compile():
        raise RuntimeError(NO_LIBTPU)
    if not _tpu_present():
        # No TPU to guard: let several processes (parallel tests, notebooks) load libtpu to compile;
        # otherwise the second one fails on /tmp/libtpu_lockfile ("ABORTED: ... lockfile").
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with _quiet_libtpu():
        return topologies.get_topology_desc(topology_name=topology_name, platform="tpu")


def tpu_device(chip: str = "tpu7x"):
    """The first device of `chip`'s topology (a TPU device on this machine, for lowering only)."""
    return _topology(get_chip(chip).topology).devices[0]


def topology_devices(topology_name: str) -> list:
    """The devices of a TPU topology, e.g. 'tpu7x:2x2x4' (16 chips, 32 devices), for lowering and
    compiling a multi-device program on this machine (jax.experimental.topologies)."""
    return list(_topology(topology_name).devices)


# Two ways libtpu reports a VMEM overflow (both RESOURCE_EXHAUSTED):
_VMEM_OOM_PATTERNS = (
    re.compile(r"Ran out of memory in memory space vmem.*?Used ([\d.]+[KMG]?) of ([\d.]+[KMG]?)", re.DOTALL),
    re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)[^\n]*space=vmem"),
    # a kernel's scoped VMEM (its scratch and Mosaic's temporaries) over the scoped limit
    re.compile(r"memory space vmem.*?Scoped allocation with size ([\d.]+[KMG]?) and limit "
               r"([\d.]+[KMG]?)", re.DOTALL),
)


def _vmem_overflow(message: str) -> tuple[str, str] | None:
    """(used, available) as the compiler wrote them if `message` is a VMEM overflow, else None."""
    for pattern in _VMEM_OOM_PATTERNS:
        match = pattern.search(message)
        if match:
            return tuple(_human_bytes(v) for v in match.groups())  # type: ignore[return-value]
    if "RESOURCE_EXHAUSTED" in message and "vmem" in message.lower():
        return ("?", "?")
    return None


def _human_bytes(value: str) -> str:
    return f"{int(value) / 2**20:.2f} Mi" if value.isdigit() else f"{value[:-1]} {value[-1]}i"


def _as_struct(x, sharding):
    import jax

    if isinstance(x, jax.ShapeDtypeStruct) or hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x  # a pytree leaf that is not an array (should be static)


def compile_for(fn: Callable, *shape_structs: Any, chip: str | None = None,
                static_argnums: tuple[int, ...] | int = (),
                shardings: tuple | None = None,
                donate_argnums: tuple[int, ...] = ()) -> CompileResult:
    """Compile `fn(*shape_structs)` for one device of `chip` (None: `default_chip()`) with the
    real Mosaic compiler.

    `shape_structs` are pytrees of jax.ShapeDtypeStruct (or arrays: only shape/dtype are used);
    arguments at `static_argnums` are passed through as static. `fn` is traced inside compiling(),
    so interpret_params() is None, target_chip() is `chip` and kernels are built for Mosaic (for
    that chip: e.g. how MXFP4 is decoded). A VMEM overflow raises
    VmemOverflowError (a ValueError) saying how much the kernel needs and the chip has.
    shardings: one jax Sharding per argument (over devices of `topology_devices`) for a program
    on several devices (a `jax.shard_map`); its HLO is one device's, so `n_mosaic_kernels`
    counts the kernels one device launches. donate_argnums: arguments whose buffers the program
    may reuse for its outputs, as a step donates its state: the HBM XLA counts is then a run's.
    """
    import jax

    spec = get_chip(default_chip() if chip is None else chip)  # ValueError listing the chips
    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    if shardings is None:
        shardings = (jax.sharding.SingleDeviceSharding(tpu_device(spec.name)),) * len(shape_structs)
    args = [arg if i in static_argnums
            else jax.tree.map(lambda x, s=shardings[i]: _as_struct(x, s), arg)
            for i, arg in enumerate(shape_structs)]
    start = time.perf_counter()
    with compiling(spec.name), _quiet_libtpu(), warnings.catch_warnings():
        # With JAX's persistent compilation cache on (`make test` shares one per run), a program
        # compiled here for a topology is written to it, but a compile-only client cannot load it
        # back: jax warns and compiles again, which is what happens anyway
        warnings.filterwarnings("ignore", message="Error reading persistent compilation cache "
                                "entry", category=UserWarning)
        lowered = jax.jit(fn, static_argnums=static_argnums,
                          donate_argnums=donate_argnums).lower(*args)
        try:
            compiled = lowered.compile()
        except Exception as error:
            message = str(error)
            overflow = _vmem_overflow(message)
            if overflow:
                used, limit = overflow
                raise VmemOverflowError(
                    f"the kernel needs more VMEM than {spec.name} has: it uses {used}B of the "
                    f"{limit}B of VMEM available ({spec.vmem_bytes / 2**20:.0f} MiB per TensorCore); "
                    f"shrink the blocks or buffers. Compiler said: {message.strip()[:400]}"
                ) from None
            raise
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per program
        cost = cost[0] if cost else {}
    memory = _memory_dict(compiled.memory_analysis())
    hlo = compiled.as_text() or ""
    n_kernels = len(re.findall(r'custom_call_target="tpu_custom_call"', hlo))
    # Some chips report only per-operand "bytes accessed{i}{}" / "bytes accessedout{}" entries.
    bytes_accessed = cost.get("bytes accessed") or sum(
        v for k, v in cost.items() if k.startswith("bytes accessed"))
    return CompileResult(chip=spec.name, seconds=seconds, flops=float(cost.get("flops", 0.0)),
                         bytes_accessed=float(bytes_accessed), memory=memory,
                         cost={k: float(v) for k, v in cost.items()}, n_mosaic_kernels=n_kernels,
                         hlo_text=hlo)


def lower_for_tpu(fn: Callable, *args: Any, static_argnums: tuple[int, ...] | int = ()):
    """Cross-lower `fn(*args)` for TPU without libtpu's compiler (≈0.05 s per kernel): catches
    block shapes that break the TPU tiling, which interpret mode accepts. Returns jax's Lowered."""
    import jax

    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    with compiling():
        traced = jax.jit(fn, static_argnums=static_argnums).trace(*args)
        return traced.lower(lowering_platforms=("tpu",))


def _memory_dict(analysis: Any) -> dict[str, int]:
    if analysis is None:
        return {}
    names = [n for n in dir(analysis) if n.endswith("_in_bytes") and not n.startswith("_")]
    return {n: int(getattr(analysis, n)) for n in names}
