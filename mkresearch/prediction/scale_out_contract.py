"""A rank's program for our sharded megakernel, read from the kernel's own collective schedule
(`kernels/compose/collective_schedule.py`): one source for what the kernel issues and what the prediction
prices, not a hand-kept parallel list.

Each stage is a sequence of actions: its streamed matrices (in the kernel's order; in
partial-sum mode a MoE stage streams its shared expert before the routed experts, whose
reduction then hides behind theirs) and the routed experts' fetch after the routing point (or
after the shared expert). A `CollectiveOp` is started after the action its `issue_after` names
and waited before the one its `wait_before` names; with nothing between the two it is a blocking
collective, otherwise it overlaps the actions between (`scale_out_sim`). Every collective is priced
by the algorithm `collective_choice.choose` picks for it (the simulation's "auto").
"""

from __future__ import annotations

from collections.abc import Callable

from mkresearch.kernels.compose import collective_schedule as contract
from mkresearch.prediction import collective_choice as choice
from mkresearch.sharding import layout as layouts

EXPERTS = "routed experts"
# the contract's labels of the exact mode's expert steps, all at the experts' point
EXPERT_LABELS = ("expert W1, W3", "expert W2", "the group's experts", "the last group's sum",
                 "expert/sum", EXPERTS)
MODES = contract.MODES


def stage_actions(kind: str, matrices: tuple[tuple[str, float], ...], mode: str,
                  routing: str | None) -> list[tuple[str, float]]:
    """The stage's actions in issue order: (matrix name, bytes) and (EXPERTS, 0)."""
    if routing is None:
        return list(matrices)
    # Both modes stream in the kernel's order, the routed experts right after the routing point:
    # the kernel does not yet move the shared expert ahead of the routed experts' stream (the
    # overlap issue 28 asks for), so the prediction does not assume it either.
    at = [m[0] for m in matrices].index(routing) + 1
    return [*matrices[:at], (EXPERTS, 0), *matrices[at:]]


def _position(label: str, kind: str, names: list[str], end: bool) -> int:
    """The action index a label names: issue points are after it, wait points before it."""
    if label == f"{kind} start":
        return -1
    if label == f"{kind} end":
        return len(names)
    if label == "shared expert W_down":
        return next(i for i, n in enumerate(names) if n.endswith("shared/w_down"))
    if label in EXPERT_LABELS:
        return names.index(EXPERTS)
    if label in names:
        return names.index(label)
    raise ValueError(f"collective schedule label {label!r} of stage {kind!r} names no step of "
                     f"the stage ({', '.join(names)})")


def stage_program(prog, kind: str, actions: list[tuple[str, float]], ops, *,
                  group_of: Callable[[tuple[int, ...]], tuple[int, ...]],
                  blocks: Callable[[float], None], experts: Callable[[], None]) -> None:
    """Append one stage's program to `prog` (a `scale_out.Program`): blocks per matrix, the
    experts' fetches, and its collectives (`ops`, the contract's CollectiveOps of this stage and
    layer) started and waited where the contract says."""
    names = [n for n, _ in actions]
    starts: dict[int, list] = {}
    waits: dict[int, list] = {}
    for op in ops:
        try:
            issue = _position(op.issue_after, kind, names, False)
        except ValueError:  # a label of no step here: after the matrix it serves, if it names one
            if op.matrix not in names:
                raise
            issue = names.index(op.matrix)
        try:
            wait = _position(op.wait_before, kind, names, True)
        except ValueError:  # waited for right after it is issued
            wait = issue + 1
        blocking = op.critical and wait <= issue + 1
        for k in range(op.count):
            name = f"{op.name}#{k}" if op.count > 1 else op.name
            starts.setdefault(issue, []).append((op, name, blocking))
            if not blocking:
                waits.setdefault(max(wait, issue + 1), []).append(name)
    for i in range(-1, len(actions) + 1):
        for name in waits.get(i, ()):
            prog.wait(name)
        if 0 <= i < len(actions):
            matrix, nbytes = actions[i]
            experts() if matrix == EXPERTS else blocks(nbytes)
        for op, name, blocking in starts.get(i, ()):
            collective(prog, op, name, group_of, blocking=blocking)


def collective(prog, op, name: str, group_of, *, blocking: bool = True) -> None:
    """One contract collective on `prog`: simulated among the stand-in ranks of its group, priced
    over the whole group (`path`) by the algorithm the kernel sends it with (a chain: its own
    price)."""
    prog.collective(name, op.op, group_of(op.group), op.payload_bytes, tuple(op.group),
                    blocking=blocking, algorithm=choice.sent_algorithm(op))


def schedule_ops(lay: layouts.Layout, batch: int, mode: str, wire: str, rank: int,
                 expert_counts: tuple[int, ...] | None, reductions: tuple = ()):
    """The contract's ops of `rank`'s step, grouped: (embedding ops, {(layer, stage): ops},
    sampling ops). reductions: the kernel's (`MegakernelOptions.reductions`)."""
    ops = contract.collective_schedule(lay, batch, mode, wire, rank=rank,
                                       expert_counts=expert_counts, reductions=reductions)
    n_layers = lay.cfg.n_layers
    by_stage: dict[tuple[int, str], list] = {}
    for op in ops:
        if 0 <= op.layer < n_layers:
            by_stage.setdefault((op.layer, op.stage), []).append(op)
    return ([op for op in ops if op.layer < 0], by_stage,
            [op for op in ops if op.layer >= n_layers])


def routing_point(lay: layouts.Layout, kind: str) -> str | None:
    """The matrix after which a MoE kind's routed experts run (the contract's)."""
    return contract._routing_point(lay, kind)  # the one definition, shared


def n_routed_layers(lay: layouts.Layout) -> int:
    """The layers whose FFN runs routed experts (the contract's `expert_counts` entries)."""
    return sum(1 for _, ffn in lay.cfg.layers if routing_point(lay, ffn))
