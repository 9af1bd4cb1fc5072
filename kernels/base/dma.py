"""The DMA log: every HBM<->VMEM copy and compute phase of a kernel, recorded as it executes.

Kernels move weights with `Copy` / `Ring` (thin wrappers over `pltpu.make_async_copy`) and mark
compute with `phase(...)`. Under `with recording() as log:` in TPU interpret mode, each start, wait
and phase edge appends an `Event` to `log.events` *while the kernel runs*, in execution order, with
the dynamic slot and loop indices. The bytes-moved tests and the pipeline timelines are built on it.

    with dma.recording() as log:
        out = some_wrapper(x, w)             # the wrapper passes dma.is_recording() as a static arg
    log.dma_bytes("w")                       # bytes of dma_start events whose name starts with "w"

Static facts (bytes, memory spaces, flops, VMEM bytes) are fixed at trace time; only slot and
indices travel through the callback. On a real TPU, inside `tpu.compiling()`, or when not
recording, nothing extra is emitted; `phase` always wraps its body in `jax.named_scope(name)`,
which on a TPU becomes a trace event in the profile.

Events are emitted with an *ordered* `io_callback` (jax.debug.callback is unordered: in interpret
mode its calls come out of order relative to each other, and its ordered form does not lower in
interpret mode with this jax).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dry_run

from mkresearch.hardware import tpu

KINDS = ("dma_start", "dma_wait", "phase_start", "phase_end")


# ---- the log ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One edge of a kernel's execution. nbytes/src/dst for DMAs, flops/vmem_bytes for phases."""

    kind: str  # one of KINDS
    name: str  # what moves or computes, e.g. "w_up" or "expert.w1"
    src: str | None = None  # memory space of the source ("hbm", "vmem", "smem", ...)
    dst: str | None = None  # memory space of the destination
    nbytes: int = 0  # bytes one DMA moves (0 for phases)
    slot: int | None = None  # ring slot / buffer index, if any
    indices: dict[str, int] = field(default_factory=dict)  # loop indices given by the kernel
    flops: int = 0  # declared FLOPs of a phase
    vmem_bytes: int = 0  # declared VMEM working set of a phase
    # in a sharded kernel (`on_rank`): the rank that executed the event; for a remote copy
    # (`RemoteCopy`) the ranks it goes from and to (None for a copy within one rank)
    rank: int | None = None
    src_rank: int | None = None
    dst_rank: int | None = None

    @property
    def remote(self) -> bool:
        return self.dst_rank is not None

    def to_record(self) -> dict[str, Any]:
        return asdict(self)


class DmaLog:
    """Events of every kernel executed while recording, in execution order."""

    def __init__(self, events: list[Event] | None = None) -> None:
        self.events: list[Event] = list(events or [])
        self._lock = threading.Lock()  # simulated cores run on threads

    def _append(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __repr__(self) -> str:
        return f"DmaLog({len(self.events)} events, {self.dma_bytes()} DMA bytes)"

    def select(self, kind: str | None = None, name: str | None = None) -> list[Event]:
        """Events of one kind (any if None) whose name starts with `name` (any if None)."""
        if kind is not None and kind not in KINDS:
            raise ValueError(f"kind={kind!r} is invalid: one of {', '.join(KINDS)}")
        return [e for e in self.events
                if (kind is None or e.kind == kind) and (name is None or e.name.startswith(name))]

    def dma_bytes(self, name: str | None = None) -> int:
        """Total bytes of dma_start events, optionally only those whose name starts with `name`.
        Remote copies between ranks are counted apart (`remote_bytes`)."""
        return sum(e.nbytes for e in self.select("dma_start", name) if not e.remote)

    def remote_bytes(self, name: str | None = None) -> int:
        """Bytes of the remote copies started (rank to rank), optionally one name prefix."""
        return sum(e.nbytes for e in self.select("dma_start", name) if e.remote)

    def of_rank(self, rank: int) -> DmaLog:
        """The events one rank executed, in its order (a sharded kernel's log holds every
        rank's events, `Event.rank`)."""
        return DmaLog([e for e in self.events if e.rank == rank])

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({e.rank for e in self.events if e.rank is not None}))

    def to_records(self) -> list[dict[str, Any]]:
        return [e.to_record() for e in self.events]

    def to_json(self) -> str:
        return json.dumps(self.to_records())

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> DmaLog:
        return cls([Event(**{**r, "indices": dict(r.get("indices") or {})}) for r in records])

    @classmethod
    def from_json(cls, text: str) -> DmaLog:
        return cls.from_records(json.loads(text))


_active: list[DmaLog] = []  # stack of logs being recorded (innermost last)
_ranks: list[Any] = []  # trace time: the (traced) rank of the sharded kernel being traced


@contextlib.contextmanager
def on_rank(rank: Any) -> Iterator[None]:
    """While a sharded kernel is traced: every event it emits carries `rank` (a traced scalar,
    `lax.axis_index`), so one log holds every rank's events apart (`DmaLog.of_rank`)."""
    _ranks.append(rank)
    try:
        yield
    finally:
        _ranks.pop()


@contextlib.contextmanager
def recording() -> Iterator[DmaLog]:
    """Record the events of kernels traced and run inside the block into a fresh DmaLog. Where
    kernels are compiled (a TPU) the events are the kernels' programs run on shapes
    (`record_from_shapes`): the package's wrappers do it (`kernels/base/chip_log.py`), and so
    does any `pl.pallas_call` called outside jit inside the block (a notebook's own kernel)."""
    log = DmaLog()
    _active.append(log)
    try:
        with _eager_calls_logged():
            yield log
    finally:
        jax.effects_barrier()  # async dispatch: let the kernels' callbacks land before we stop
        _active.remove(log)


def logs_from_shapes() -> bool:
    """Whether a kernel run now is logged from its program rather than as it runs: a log is
    recording and kernels are compiled (a TPU; `tpu.interpret_params()` is None)."""
    return bool(_active) and tpu.interpret_params() is None


@contextlib.contextmanager
def _eager_calls_logged() -> Iterator[None]:
    """While the outermost recording is open where kernels are compiled: `pl.pallas_call` logs
    each call made with concrete arguments (outside jit) from shapes. Calls inside jit (the
    package's wrappers, logged by `chip_log.run`) see tracers and pass through unlogged."""
    if len(_active) > 1 or not logs_from_shapes():
        yield
        return
    original = pl.pallas_call

    def logged(kernel: Any, *options: Any, **keywords: Any) -> Any:
        call = original(kernel, *options, **keywords)

        def run(*args: Any) -> Any:
            if not logs_from_shapes() or any(isinstance(leaf, jax.core.Tracer)
                                             for leaf in jax.tree.leaves(args)):
                return call(*args)
            known = jax.tree.map(known_for_shapes, args)  # before the call: it may donate them
            out = call(*args)
            record_from_shapes(lambda *xs: original(kernel, *options, **keywords)(*xs), *known)
            return out

        return run

    pl.pallas_call = logged
    try:
        yield
    finally:
        pl.pallas_call = original


def known_for_shapes(leaf: Any) -> Any:
    """What a run on shapes keeps of an argument: an integer array's values, else its shape."""
    if np.issubdtype(np.dtype(leaf.dtype), np.integer) and not isinstance(leaf, jax.core.Tracer):
        return np.asarray(leaf)
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)


def record_from_shapes(fn: Any, *args: Any, given: dict | None = None,
                       axis_env: tuple = ()) -> None:
    """Append to the open log the events of the one `pallas_call` fn(*args) makes, its program
    run on shapes (`dry_run`, compute phases planned too) with fn's concrete integer arguments
    (those passed unchanged to the kernel). ValueError naming the argument if one is traced
    (record outside jit)."""
    leaves = jax.tree.leaves(args)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    call, closed = dry_run.kernel_call_traced(fn, *shapes, axis_env=axis_env, phases=True)
    inputs = {}
    for operand, arg in dry_run.operand_sources(closed, call).items():
        leaf = leaves[arg]
        if not np.issubdtype(np.dtype(leaf.dtype), np.integer):
            continue  # a vector operand: its values never decide a DMA
        if isinstance(leaf, (jax.core.Tracer, jax.ShapeDtypeStruct)):
            raise ValueError(f"argument {arg} of {getattr(fn, '__name__', fn)!r} is traced: a "  # noqa: TRY004
                             "DMA log on a TPU is the kernel run on shapes with its integer "
                             "inputs known; record outside jit")
        inputs[operand] = np.asarray(leaf)
    append_planned(dry_run.run(dry_run.kernel_of(call.params["jaxpr"]), inputs, given))


def append_planned(planned: list) -> None:
    """Append planned events (`dry_run.run`'s PlannedDma and PlannedPhase, in program order) to
    the open log as the Events interpret mode records for them (`kernels/base/chip_log.py`)."""
    log = _active[-1]
    for item in planned:
        if item.kind in ("phase_start", "phase_end"):
            log._append(Event(item.kind, item.name, indices=dict(item.indices), flops=item.flops,
                              vmem_bytes=item.vmem_bytes))
        else:
            log._append(Event(item.kind, item.name, item.src, item.dst, item.nbytes, item.slot,
                              dict(item.indices)))


DRY_RUN = "dry run"  # what is_recording() says while a kernel is traced for a dry run


def is_recording() -> bool | str:
    """Python-side, at call time: wrappers pass it to jit as a static argument. True while a log
    is recording, False when none is, and DRY_RUN while a kernel is traced for a dry run
    (`kernels/base/chip_log.py` traces the wrapper itself): three static values, so a jit cache
    never hands a dry run the trace of a real call, whose copies state no planned events."""
    if dry_run.tracing():
        return DRY_RUN
    return bool(_active)


def _emitting() -> bool:
    """At trace time inside a kernel: emit callbacks only when recording an interpreted run
    (a dry run's trace states its DMAs as planned events instead, `dry_run.emit`)."""
    return bool(_active) and tpu.interpret_params() is not None and not dry_run.tracing()


def _emit(kind: str, name: str, slot: Any, indices: dict[str, Any],
          ranks: dict[str, Any] | None = None, **static: Any) -> None:
    """Append an Event to the active log when this point of the kernel executes. ranks: the
    Event's rank fields (traced values), beside the rank of `on_rank`."""
    ranks = {**({"rank": _ranks[-1]} if _ranks else {}), **(ranks or {})}
    keys, rank_keys = tuple(indices), tuple(ranks)

    def record(slot_value, *values):
        if _active:
            index_values, rank_values = values[:len(keys)], values[len(keys):]
            _active[-1]._append(Event(
                kind=kind, name=name, slot=None if slot is None else int(slot_value),
                indices={k: int(v) for k, v in zip(keys, index_values)},
                **{k: int(v) for k, v in zip(rank_keys, rank_values)}, **static))

    slot_operand = jnp.asarray(-1 if slot is None else slot, jnp.int32)
    operands = [jnp.asarray(indices[k], jnp.int32) for k in keys]
    operands += [jnp.asarray(ranks[k], jnp.int32) for k in rank_keys]
    io_callback(record, None, slot_operand, *operands, ordered=True)


def _memory_space(ref: Any) -> str:
    space = getattr(getattr(ref, "aval", None), "memory_space", None)
    if space is None:
        return "vmem"  # pallas_call block refs without an explicit space live in VMEM
    name = str(getattr(space, "value", space)).lower()
    return "hbm" if name == "any" else name  # pl.ANY operands of a pallas_call stay in HBM


def _nbytes(ref: Any) -> int:
    dtype = jnp.dtype(ref.dtype)
    bits = getattr(jax.dtypes, "itemsize_bits", lambda d: jnp.dtype(d).itemsize * 8)(dtype)
    return math.prod(ref.shape) * bits // 8


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r} is invalid: a non-empty string naming what is moved")


def _check_same_block(what: str, src_ref: Any, dst_ref: Any) -> None:
    """A DMA copies a block as it is: the same shape and dtype at both ends. Refused here, in one
    line naming the copy, when it is built to start: `make_async_copy` would accept it and fail
    only at the wait, deep inside JAX, naming no copy."""
    src, dst = (tuple(src_ref.shape), jnp.dtype(src_ref.dtype)), (tuple(dst_ref.shape),
                                                                  jnp.dtype(dst_ref.dtype))
    if src[0] != dst[0]:
        raise ValueError(f"{what}: src shape {src[0]} != dst shape {dst[0]}; slice both to the "
                         "block being moved")
    if src[1] != dst[1]:
        raise ValueError(f"{what}: src dtype {src[1]} != dst dtype {dst[1]}; a DMA moves bytes "
                         "as they are: convert after it lands")


def _scalar_indices(ref: Any) -> list[Any]:
    """The scalar indices a Ref was viewed at, in order (`slots.at[s]`, `sems.at[ring].at[s]`,
    `slots.at[s].at[pl.ds(0, n)]`: slices are not scalar indices); [] for a Ref not viewed so."""
    return [index for transform in getattr(ref, "transforms", ())
            for index in getattr(transform, "indices", ())
            if not isinstance(index, pl.Slice) and tuple(getattr(index, "shape", ())) == ()]


def _static_index(index: Any) -> int | None:
    """An index's value where tracing knows it (a Python int, a traced constant), else None."""
    if isinstance(index, jax.core.Tracer):
        index = getattr(getattr(index, "val", None), "val", None)  # a traced constant's Literal
        if index is None or isinstance(index, jax.core.Tracer):
            return None
    try:
        return int(index) if np.ndim(index) == 0 else None
    except (TypeError, ValueError):
        return None


def _same_index(a: Any, b: Any) -> bool | None:
    """Whether two indices are the same value: True, False, or None when tracing cannot tell
    (two traced values computed apart)."""
    if a is b:
        return True
    static = _static_index(a), _static_index(b)
    return None if None in static else static[0] == static[1]


def _check_ring_slot(name: str, slot: Any, dst_ref: Any, sem: Any) -> None:
    """A copy into ring slot s (`slot=s`, the destination `slots.at[s]`, or the source of a
    write-back to HBM: `dst_ref` is the ring's side) signals semaphore s
    (`sems.at[s]`), where the wait for it waits: with another semaphore the wait never returns
    (interpret mode hangs, no message) or returns for another block. Refused in one line when
    the destination is viewed at scalar indices none of which is `slot`, or the semaphore's last
    scalar index (its slot axis: `sems.at[s]`, `sems.at[ring].at[s]`) is not `slot`; two traced
    values computed apart count as different (name the slot once:
    `Copy(src, slots.at[s], sems.at[s], slot=s)`)."""
    if slot is None:
        return
    rule = ("a copy into ring slot s signals semaphore s, where its wait waits (with another, "
            "the wait never returns); view both at the one slot value: "
            "Copy(src, slots.at[s], sems.at[s], slot=s)")
    for ref, what in ((dst_ref, "ring slot it copies into"), (sem, "semaphore it signals")):
        indices = _scalar_indices(ref)
        if not indices:
            continue  # not viewed at a slot: a whole buffer, or rows of one
        same = [_same_index(slot, index) for index in (indices if ref is dst_ref else indices[-1:])]
        if True in same:
            continue
        if None not in same:
            shown = ", ".join(str(_static_index(index)) for index in indices)
            raise ValueError(f"Copy {name!r}: slot={_static_index(slot)} but the {what} is at "
                             f"[{shown}]: {rule}")
        raise ValueError(f"Copy {name!r}: its slot and the {what} are two traced values, which "
                         f"tracing cannot tell equal: {rule}")


# ---- inside kernels -----------------------------------------------------------------------------


class Copy:
    """One async copy `src_ref -> dst_ref` signalling `sem`, logged as `name` (+ slot, indices).

    Refused in one line naming the copy when it is built (before it starts): source and
    destination of another shape or dtype; with `slot=s`, a destination or semaphore viewed at
    another index than s (`slots.at[s]`, `sems.at[s]`: a copy into a ring slot signals that
    slot's semaphore, or its wait never returns).

    buffer: the VMEM buffer it fills or drains, by kind (`planned.WEIGHT_RING`, ...: what the
    schedule groups DMAs by); owner: (stage, layer) the data belongs to, if not the stage whose
    body is traced (`dry_run.owned_by`: a weight block started ahead belongs to the next stage).
    Neither changes the kernel: a dry run (`kernels/base/dry_run.py`) reads them."""

    def __init__(self, src_ref: Any, dst_ref: Any, sem: Any, *, name: str, slot: Any = None,
                 buffer: str | None = None, owner: tuple | None = None, **indices: Any) -> None:
        _check_name(name)
        _check_same_block(f"Copy {name!r}", src_ref, dst_ref)
        # the ring slot is the VMEM side: the destination of a read, the source of a write-back
        ring = src_ref if _memory_space(dst_ref) == "hbm" else dst_ref
        _check_ring_slot(name, slot, ring, sem)
        self.src_ref, self.dst_ref, self.sem = src_ref, dst_ref, sem
        self.name, self.slot, self.indices = name, slot, indices
        self.buffer, self.owner = buffer, owner if owner is not None else dry_run.owner()
        self.nbytes = _nbytes(dst_ref)

    def _descriptor(self):
        return pltpu.make_async_copy(self.src_ref, self.dst_ref, self.sem)

    def _log(self, kind: str) -> None:
        spaces = {"src": _memory_space(self.src_ref), "dst": _memory_space(self.dst_ref)}
        if dry_run.tracing():
            dry_run.emit(kind, self.name, self.slot, self.indices, nbytes=self.nbytes,
                         buffer=self.buffer, owner=self.owner, shape=tuple(self.dst_ref.shape),
                         dtype=jnp.dtype(self.dst_ref.dtype).name, **spaces)
        elif _emitting():
            _emit(kind, self.name, self.slot, self.indices, nbytes=self.nbytes, **spaces)

    def start(self) -> Copy:
        self._descriptor().start()
        self._log("dma_start")
        return self

    def wait(self) -> Copy:
        self._descriptor().wait()
        self._log("dma_wait")
        return self


class RemoteCopy:
    """One async copy from this rank's `src_ref` to `dst_ref` on rank `peer` (the same buffer
    there, e.g. a receive slot of a collective), signalling `send_sem` here and `recv_sem` there
    (`pltpu.make_async_remote_copy`). Logged with its source and destination rank: the sender
    logs dma_start and the wait for its send (`wait_send`), the receiver the wait for the data
    (`wait_recv`, built with the sender as `peer`). `rank` is this rank (traced)."""

    def __init__(self, src_ref: Any, dst_ref: Any, send_sem: Any, recv_sem: Any, *, peer: Any,
                 rank: Any, name: str, log_peer: Any = None, **indices: Any) -> None:
        _check_name(name)
        _check_same_block(f"RemoteCopy {name!r}", src_ref, dst_ref)
        self.src_ref, self.dst_ref, self.send_sem, self.recv_sem = src_ref, dst_ref, send_sem, recv_sem
        self.peer, self.rank, self.name, self.indices = peer, rank, name, indices
        # the other rank in the log: `peer`, or -1 for a wait that covers the copies of several
        # (a semaphore counts bytes: one wait for all of them)
        self.log_peer = peer if log_peer is None else log_peer
        self.nbytes = _nbytes(dst_ref)

    def _descriptor(self):
        return pltpu.make_async_remote_copy(self.src_ref, self.dst_ref, self.send_sem,
                                            self.recv_sem, device_id=(self.peer,),
                                            device_id_type=pl.DeviceIdType.MESH)

    def _log(self, kind: str, src_rank: Any, dst_rank: Any) -> None:
        if _emitting():
            _emit(kind, self.name, None, self.indices,
                  {"rank": self.rank, "src_rank": src_rank, "dst_rank": dst_rank},
                  src=_memory_space(self.src_ref), dst=_memory_space(self.dst_ref),
                  nbytes=self.nbytes)

    def start(self) -> RemoteCopy:
        self._descriptor().start()
        self._log("dma_start", self.rank, self.log_peer)
        return self

    def wait_send(self) -> RemoteCopy:
        self._descriptor().wait_send()
        self._log("dma_wait", self.rank, self.log_peer)
        return self

    def wait_recv(self) -> RemoteCopy:
        """On the receiver, with `peer` the sender: wait until its data has landed here."""
        self._descriptor().wait_recv()
        self._log("dma_wait", self.log_peer, self.rank)
        return self


class Ring:
    """A ring of VMEM slots `buffers_ref [n_slots, ...]` with one DMA semaphore per slot."""

    def __init__(self, buffers_ref: Any, sems_ref: Any, *, name: str,
                 buffer: str | None = None) -> None:
        _check_name(name)
        if sems_ref.shape[:1] != buffers_ref.shape[:1]:
            raise ValueError(f"Ring {name!r}: sems_ref shape {tuple(sems_ref.shape)} must be "
                             f"[n_slots={buffers_ref.shape[0]}] like buffers_ref's leading dim")
        self.buffers_ref, self.sems_ref, self.name = buffers_ref, sems_ref, name
        self.buffer_kind = buffer  # what its copies fill (`Copy`'s buffer)

    @property
    def n_slots(self) -> int:
        return self.buffers_ref.shape[0]

    def buffer(self, slot: Any) -> Any:
        """The VMEM ref of one slot: `[...]` (slot may be traced)."""
        return self.buffers_ref.at[slot]

    def copy(self, src_ref: Any, slot: Any, **indices: Any) -> Copy:
        return Copy(src_ref, self.buffers_ref.at[slot], self.sems_ref.at[slot], name=self.name,
                    slot=slot, buffer=self.buffer_kind, **indices)

    def start(self, src_ref: Any, slot: Any, **indices: Any) -> Copy:
        """Start copying `src_ref` (an HBM block) into `slot`."""
        return self.copy(src_ref, slot, **indices).start()

    def wait(self, src_ref: Any, slot: Any, **indices: Any) -> Copy:
        """Wait for the copy of `src_ref` into `slot` (same arguments as its start)."""
        return self.copy(src_ref, slot, **indices).wait()


@contextlib.contextmanager
def phase(name: str, *, flops: int = 0, vmem_bytes: int = 0, **indices: Any) -> Iterator[None]:
    """Mark a compute phase: logged edges when recording, a named scope (TPU trace event) always."""
    _check_name(name)
    emitting, planning = _emitting(), dry_run.planning_phases()
    static = {"flops": int(flops), "vmem_bytes": int(vmem_bytes)}
    owner = dry_run.owner()

    def edge(kind: str) -> None:  # logged as it runs (interpret mode), or planned (a dry run)
        if emitting:
            _emit(kind, name, None, indices, **static)
        elif planning:
            dry_run.emit_phase(kind, name, indices, owner=owner, **static)

    edge("phase_start")
    with jax.named_scope(name):
        yield
    edge("phase_end")
