"""A rank's program for the scale-out model, as data: the one representation both our kernel's
step and the release's are written in, and that `timeline_ranks.simulate_programs` runs
(`timeline.RankSimulation`, the timeline model's one simulator).

A program is a list of ops over a shared list of weight blocks (`Program`):

  ("blocks", n)                       the next n ring blocks: each waited, then multiplied
  ("hold", n), ("again", n)           the next n blocks kept in VMEM; the n oldest kept multiplied
                                      again (two microbatches, `microbatches.interleave`)
  ("fetch", nbytes, count, slots[, mix])
                                      count DMAs, `slots` in flight, each multiplied when it lands
                                      (mix: its matrices' share of the bytes, weights per byte and
                                      whether the MXU takes them as fp8: `expert_mix`)
  ("write", nbytes)                   a write back to HBM, waited at the end of the step
  ("compute", flops)                  element-wise work on the rows (`row_work`), at the chip's
                                      vector rate
  ("prefetch",)                       the next fetch's first DMAs issued here, waited there
  ("start", name, op, group, path, nbytes, blocking, algorithm, streams, ahead)
                                      a collective among the stand-in ranks `group`, priced over
                                      `path`; blocking: the rank waits for it here; streams: the
                                      weight ring runs ahead past it meanwhile (the kernel has
                                      issued the weights after it before waiting); where it does
                                      not, its next `ahead` blocks still move (issued earlier)
  ("wait", name)                      wait for the last collective started under that name

A stage is a sequence of actions (its streamed matrices in the order the rank streams them, and
the routed experts' fetch at their point, `EXPERTS`) and the `Collective`s around them: each is
started after the action its `issue_after` names and waited before the one its `wait_before`
names; with nothing between the two it blocks, otherwise it overlaps the actions between
(`place`). Ours come from the kernel's own collectives (`kernels/sharded/collective_ops.py`,
derived from the step's sharding plan: `our_collectives`); the release's are written here as the
same data from docs/collectives.md (`release_collectives`): one placement for both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax

from mkresearch.kernels.sharded import plan as sharding
from mkresearch.kernels.sharded.collective_ops import (
    EXPERTS,
    FIRST_EXPERT,
    CollectiveOp,
    collective_ops,
)
from mkresearch.model import formats, roofline, spec
from mkresearch.model.config import LANE, MXFP4_BLOCK, ModelConfig
from mkresearch.model.partition import RELEASE_ETP
from mkresearch.sharding import layout as layouts

F32 = 4
# docs/collectives.md: "Partial sums travel as bf16 pairs packed into 32-bit words"
PARTIAL_SUM_BYTES = 2
ONE_SHOT, TWO_LEVEL, RS_AG = "one-shot", "two-level", "rs-ag"
# The release's kernel and its demo's tuned decode options (kimi/decode_megakernel.py,
# `decode_options`): its routed (and shared) sums reduce-scatter from 6 rows; at 8 rows the
# attention's sum and the MoE's output are token-scattered (each pair of cores owns B / 4 rows)
RS_FROM_BATCH = 6
TOKEN_SCATTER_BATCH = 8
RELEASE_HOST_RANKS = 8  # rank // 8 is its host, rank % 8 its lane
RELEASE_LU_COLUMNS = 1024  # W_lu's columns per lane: a host's 8 lanes cover d (7,168 of 8,192)
SAMPLING_LANES = 384  # the sampling state a vocab shard sends: `sharded_stages.STATE_LANES`
# our kernel's W_ld latent gather with the router placed apart (`collective_ops.FIRST_EXPERT`):
# waited for before the first expert is computed, which needs that expert landed; priced as waited
# after the experts' reads (ASSUMPTION: done before the first expert lands, as `designs` says)
FIRST_EXPERT_WAIT = FIRST_EXPERT
# the collective ops' labels of the exact mode's expert steps, all at the experts' point
EXPERT_LABELS = ("expert W1, W3", "expert W2", "the group's experts", "the last group's sum",
                 sharding.EXPERT_SUM, EXPERTS)


class Program:
    """One rank's ops over the shared ring of weight `blocks` (see the module docstring)."""

    def __init__(self, blocks: list[int], batch: int) -> None:
        self.blocks, self.batch, self.ops = blocks, batch, []

    def block(self, count: int = 1) -> None:
        if self.ops and self.ops[-1][0] == "blocks":
            self.ops[-1] = ("blocks", self.ops[-1][1] + count)
        else:
            self.ops.append(("blocks", count))

    def prefetch(self) -> None:
        """The next fetch's first DMAs issued here (it waits for them where it is)."""
        self.ops.append(("prefetch",))

    def fetch(self, nbytes: float, count: int, slots: int, mix: tuple = (),
              order: str = "queued") -> None:
        if count:
            self.ops.append(("fetch", nbytes, count, slots, mix, order))

    def compute(self, flops: float) -> None:
        if flops:
            self.ops.append(("compute", flops))

    def write(self, nbytes: float) -> None:
        if nbytes:
            self.ops.append(("write", nbytes))

    def collective(self, name: str, op: str, group: tuple[int, ...], nbytes: float,
                   path: tuple[int, ...] = (), *, blocking: bool = True,
                   algorithm: str | None = None, streams: bool = True, ahead: int = 0) -> None:
        self.ops.append(("start", name, op, tuple(group), tuple(path), nbytes, blocking,
                         algorithm, streams, ahead))

    def wait(self, name: str) -> None:
        self.ops.append(("wait", name))


@functools.lru_cache(maxsize=1024)
def weight_blocks(nbytes: float, block_bytes: int) -> tuple[int, ...]:
    """nbytes in blocks of at most block_bytes, as equal as whole bytes allow."""
    n = max(1, math.ceil(nbytes / block_bytes))
    whole = round(nbytes)
    return tuple(whole // n + (1 if i < whole % n else 0) for i in range(n))


@dataclass(frozen=True)
class Collective:
    """One collective of a rank's program: priced over `path` (every rank taking part), started
    after the action `issue_after` names, waited before the one `wait_before` names."""

    name: str
    op: str  # `interconnect.price`'s: all_gather, all_reduce, chain
    path: tuple[int, ...]
    nbytes: float
    issue_after: str
    wait_before: str
    algorithm: str | None = None  # how it is sent (None: as the prediction's algorithm says)
    count: int = 1  # times per step
    critical: bool = True  # False: overlapped with the actions between issue and wait
    matrix: str = ""  # the streamed matrix it serves, if any
    group: tuple[int, ...] | None = None  # the stand-in ranks joined (None: those of `path`)
    # the weight stream runs ahead past it while it is waited for: the kernel has issued the
    # weights that follow it before waiting (`timeline.RankSimulation`: the ring's horizon)
    streams: bool = True
    ahead: int = 0  # where it does not: the ring's blocks after it issued anyway (earlier)


def from_op(op: CollectiveOp) -> Collective:
    """One of our kernel's collectives, as the kernel sends it."""
    return Collective(op.name, op.op, tuple(op.group), op.payload_bytes, op.issue_after,
                      op.wait_before, op.sent_algorithm, op.count, op.critical, op.matrix,
                      streams=op.streams)


# ---- placing a stage's collectives ------------------------------------------------------------
def _position(label: str, kind: str, names: list[str]) -> int:
    """The action index a label names: issue points are after it, wait points before it."""
    if label == f"{kind} start":
        return -1
    if label == f"{kind} end":
        return len(names)
    if label == "shared expert W_down":
        return next(i for i, n in enumerate(names) if n.endswith(sharding.SHARED_DOWN))
    if label in EXPERT_LABELS:
        return names.index(EXPERTS)
    if label == FIRST_EXPERT:  # beside the experts' reads: waited before the step after them
        return names.index(EXPERTS) + 1
    if label in names:
        return names.index(label)
    raise ValueError(f"collective label {label!r} of stage {kind!r} names no step of the stage "
                     f"({', '.join(names)})")


def _issue_and_wait(c: Collective, kind: str, names: list[str]) -> tuple[int, int]:
    """(the action it is started after, the action it is waited before)."""
    try:
        issue = _position(c.issue_after, kind, names)
    except ValueError:  # a label of no step here: after the matrix it serves, if it names one
        if c.matrix not in names:
            raise
        issue = names.index(c.matrix)
    try:
        wait = _position(c.wait_before, kind, names)
    except ValueError:  # waited for right after it is issued
        wait = issue + 1
    return issue, wait


def place(prog: Program, kind: str, actions: list[tuple[str, float]], collectives, *,
          group_of: Callable[[tuple[int, ...]], tuple[int, ...]],
          blocks: Callable[[float], None], experts: Callable[[], None],
          before: Callable[[str], None] | None = None,
          experts_issued: tuple[str, Callable[[], None]] | None = None) -> None:
    """Append one stage's program to `prog`: blocks per matrix, the experts' fetches at EXPERTS,
    and its `collectives` started and waited where they say; `before(name)` appends what runs
    before each action (the rows' own work, `row_work`); `experts_issued` (action, prefetch):
    the experts' first DMAs issued after that action and its collectives (`Program.prefetch`)."""
    names = [n for n, _ in actions]
    starts: dict[int, list] = {}
    waits: dict[int, list] = {}
    for c in collectives:
        issue, wait = _issue_and_wait(c, kind, names)
        blocking = c.critical and wait <= issue + 1
        for k in range(c.count):
            name = f"{c.name}#{k}" if c.count > 1 else c.name
            starts.setdefault(issue, []).append((c, name, blocking))
            if not blocking:
                waits.setdefault(max(wait, issue + 1), []).append(name)
    issue_at = names.index(experts_issued[0]) if experts_issued else None
    for i in range(-1, len(actions) + 1):
        for name in waits.get(i, ()):
            prog.wait(name)
        if 0 <= i < len(actions):
            matrix, nbytes = actions[i]
            if before is not None:
                before(matrix)
            experts() if matrix == EXPERTS else blocks(nbytes)
        for c, name, blocking in starts.get(i, ()):
            start(prog, c, name, group_of, blocking=blocking)
        if i == issue_at:
            experts_issued[1]()


def start(prog: Program, c: Collective, name: str, group_of, *, blocking: bool = True) -> None:
    """One collective on `prog`: simulated among the stand-in ranks of its path, priced over the
    whole path by its algorithm."""
    group = group_of(c.path) if c.group is None else c.group
    prog.collective(name, c.op, group, c.nbytes, c.path, blocking=blocking,
                    algorithm=c.algorithm, streams=c.streams, ahead=c.ahead)


# ---- the routed experts on the MXU ---------------------------------------------------------------
# The release's kernel multiplies its FP8 gate/up as fp8 and converts its MXFP4 down-projection's
# E2M1 codes to fp8 for the MXU (kimi/decode_megakernel.py: `_paired_expert_gate_up`,
# `_quantized_expert_dot`; docs/kimi-k3.md §7)
RELEASE_MXU_TAKES_FP8 = True
# ... and issues its next weights (W_lu before its routed reduction, the next layer's projections
# and router in `after_experts`) only once its expert stream is done: the ring does not run past
# the expert reads (`timeline.HELD`)
RELEASE_EXPERT_ORDER = "held"


@functools.lru_cache(maxsize=64)
def expert_mix(lay: layouts.Layout, mxu_fp8: bool, release: bool = False, batch: int = 1
               ) -> tuple[tuple[float, float, bool, int], ...]:
    """One routed expert's matrices on a rank of `lay` as (share of the expert's bytes, weights
    per stored byte, taken by the MXU as fp8, MXU rows per batch row): the fetch op's `mix`.
    Their stored formats are the layout's (`layout.count_format`); mxu_fp8: the kernel hands the
    MXU fp8 (else bf16); the rows: a block-scaled product spreads each row over its scale blocks
    (`numerics.block_scaled_matmul`), ours over a K chunk's (`formats.mxu_spread`), the
    release's as its kernel does (`release_mxu_spread`) at `batch`."""
    cfg = lay.cfg
    out = []
    for kind in spec.stages_of(cfg):
        table = spec.param_table(cfg)[kind.name]
        local = layouts.rank_params(lay)[kind.name]
        for key in kind.routed:
            for (path, _), mine in zip(layouts.leaves_with_path(table[key]),
                                       jax.tree.leaves(local[key], is_leaf=layouts.is_param),
                                       strict=True):
                fmt = layouts.count_format(lay, path)
                stored = roofline.tree_bytes(layouts.storage(cfg, mine, fmt))
                k = mine.shape[-2]
                spread = (1 if not mxu_fp8 or fmt == "bf16"
                          else release_mxu_spread(fmt, cfg, batch) if release
                          else formats.mxu_spread(fmt, k))
                out.append((stored, math.prod(mine.shape) / stored, mxu_fp8, spread))
        if out:
            break
    total = sum(b for b, _, _, _ in out)
    return tuple((b / total, w, fp8, spread) for b, w, fp8, spread in out)


def release_mxu_spread(fmt: str, cfg: ModelConfig, batch: int) -> int:
    """MXU rows per batch row of the release's expert product (`_quantized_expert_dot`,
    `_paired_expert_gate_up` in kimi/decode_megakernel.py): its FP8 gate/up one dot per scale
    block (no spreading); its MXFP4 down-projection spread over the 32-row scale blocks of a tile
    of min(2048, K) rows, 256 from 8 rows when K is 768 (its "block-major" path). K: its
    contraction, the rank's slice of the expert hidden (ETP 4, docs/kimi-k3.md §9; the layouts
    here store W2 by its latent columns instead: the same bytes)."""
    if fmt != "mxfp4":
        return 1
    k = cfg.expert_hidden // RELEASE_ETP
    tile = 256 if k == 768 and batch >= 8 else min(2048, k)
    return tile // MXFP4_BLOCK


# ---- ours: the kernel's collectives ------------------------------------------------------------
@functools.lru_cache(maxsize=256)  # every stage of every rank's program asks
def our_actions(lay: layouts.Layout, kind: str, matrices: tuple) -> tuple[tuple[str, float], ...]:
    """A stage's actions in the kernel's order (its streamed matrices': the shared experts
    before W_lu), the routed experts right after the routing point."""
    routing = sharding.routing_point(lay, kind)
    if routing is None:
        return tuple(matrices)
    at = [m[0] for m in matrices].index(routing) + 1
    return (*matrices[:at], (EXPERTS, 0), *matrices[at:])


def our_collectives(plan: sharding.ShardingPlan, rank: int,
                    expert_counts: tuple[int, ...] | None):
    """The plan's collectives of `rank`'s step, as program data, grouped: (embedding ones,
    {(layer, stage): ones}, sampling ones)."""
    n_layers = plan.layout.cfg.n_layers
    embed, by_stage, sampling = [], {}, []
    for op in collective_ops(plan, rank=rank, expert_counts=expert_counts):
        c = from_op(op)
        if op.layer < 0:
            embed.append(c)
        elif op.layer >= n_layers:
            sampling.append(c)
        else:
            by_stage.setdefault((op.layer, op.stage), []).append(c)
    return embed, by_stage, sampling


@functools.lru_cache(maxsize=256)  # every rank's program of a prediction asks
def n_routed_layers(lay: layouts.Layout) -> int:
    """The layers whose FFN runs routed experts (`collective_ops`'s `expert_counts` entries)."""
    return sum(1 for _, ffn in lay.cfg.layers if sharding.routing_point(lay, ffn))


# ---- the release's, from docs/collectives.md ---------------------------------------------------
def release_actions(matrices, routed: bool, partial_sums: bool = True
                    ) -> list[tuple[str, float]]:
    """The release computes the shared expert before the routed ones, its reduction hiding
    behind their stream (docs/collectives.md): with partial sums the shared matrices come
    before W_lu, else after it; the routed experts are fetched right after the shared expert's
    W_down."""
    shared = [m for m in matrices if m[0].startswith("shared/")]
    lu = [m for m in matrices if m[0].endswith("w_lu")]
    out = [m for m in matrices if m not in shared and m not in lu]
    out += shared + lu if partial_sums else lu + shared
    at = next((i for i, m in enumerate(out) if m[0].endswith(sharding.SHARED_DOWN)), None)
    if routed and at is not None:
        out.insert(at + 1, (EXPERTS, 0))
    return out


ROUTER_MATRIX = "w_router"  # the suffix of a MoE stage's router matrix


def release_experts_issued_after(actions) -> str | None:
    """The action after which the release issues its routed experts' first DMAs: its router's
    (they start inside top-k, right after the scores' swap, each local winner's copy as it is
    picked: `_route_hidden_states` calls `on_local_selection`; waited where the experts are
    computed, after the shared expert)."""
    names = [m for m, _ in actions]
    return next((m for m in names if m.endswith(ROUTER_MATRIX)), None) if EXPERTS in names \
        else None


def release_router_ahead(collectives, moe_matrices, block_bytes: int) -> tuple[Collective, ...]:
    """An attention stage's collectives before a MoE layer (its matrices `moe_matrices`): the
    release issues that layer's router a layer ahead (`after_experts` issues the next layer's
    router with its attention projections), so the ring still moves the router's blocks while
    the attention's output collectives hold it."""
    router = sum(nbytes for m, nbytes in moe_matrices if m.endswith(ROUTER_MATRIX))
    ahead = len(weight_blocks(router, block_bytes))
    return tuple(c if c.streams else dataclasses.replace(c, ahead=ahead) for c in collectives)


def release_collectives(lay: layouts.Layout, kind: str, actions, rank: int, batch: int,
                        routed: bool) -> tuple[Collective, ...]:
    """The release's collectives of one stage, each sent as its kernel sends it
    (kimi/decode_megakernel.py with its demo's tuned options, docs/collectives.md §1), partial
    sums as bf16 pairs on the wire:

      attention  the sibling's attended features swapped before the second half of W_o; below
                 TOKEN_SCATTER_BATCH one one-shot all-reduce over the 16 cores of its parity (15
                 messages of [B, d / 2]) and the halves swapped with the sibling; at it (token
                 scatter), a one-shot reduce-scatter of the B / 4 rows each pair of cores owns
                 among the host's 4 cores of its parity, their sums all-reduced one-shot over the
                 4 hosts (f32), swapped with the sibling, and the owned rows gathered again among
                 the host's pairs before the MoE and before the next attention
                 (sequence-parallel pre-attention)
      MoE        the router scores' halves swapped with the sibling; the latent, [B, 128] per
                 rank, all-gathered one-shot behind top-k, waited before the experts; the shared
                 expert's [B, d] sum (a host's one-shot, then the hosts') started before the
                 routed experts and waited after them; the routed experts' latent sum rho
                 ([B, latent]) reduced the same way (from RS_FROM_BATCH: reduce-scatter, the
                 hosts', all-gather); W_lu then multiplies a host's 1,024-column slice on each
                 core and the slices are all-gathered one-shot in the host (at
                 TOKEN_SCATTER_BATCH: each peer is sent only the rows its pair owns)
      dense FFN  its [B, d] sum, a host's one-shot then the hosts'

    How its weights move around them (its kernel: whole matrices issued at fixed points; written
    here as the ring's order and horizon): W_o is prefetched with the layer's projections, so the
    attended features' swap lets the stream run (`Collective.streams`); the attention's output
    collectives hold it but for the next MoE's router, issued a layer ahead in `after_experts`
    (`release_router_ahead`: `Collective.ahead`); W_ld and the shared expert are issued when the
    MoE starts, so they stream while the router scores are swapped; the routed experts' first
    reads are issued right after routing, inside top-k (`release_experts_issued_after`), waited
    after the shared expert; W_lu's read is issued before the routed sum, which is waited before
    W_lu's product, and the next layer's weights right after the experts (`after_experts`), so
    the stream runs past the MoE's output collectives."""
    groups = _release_groups(lay.n_ranks, rank)
    names = [m for m, _ in actions]
    first = names[0] if names else f"{kind} end"
    out = []
    if spec.stage(kind).role == "attention" and batch >= TOKEN_SCATTER_BATCH:
        # the owned rows, normalized, gathered
        out.append(_release_attention(kind, groups, "rows_in", "all_gather", "host_parity",
                                      _owned(batch) * lay.cfg.d_model * PARTIAL_SUM_BYTES,
                                      f"{kind} start", first))
    out += _release_stream_collectives(lay, kind, actions, groups, batch, routed)
    out += _release_output_collectives(lay, kind, names, groups, batch, routed)
    return tuple(out)


def _release_groups(n: int, rank: int) -> dict[str, tuple[int, ...]]:
    """The ranks a rank of the release's layout sends to, by name: its sibling pair, itself
    alone (a sibling swap waits for no stand-in), everyone, its host, the cores of its parity in
    its host and in all hosts, and its lane's core on every host."""
    everyone = tuple(range(n))
    host = tuple(r for r in everyone if r // RELEASE_HOST_RANKS == rank // RELEASE_HOST_RANKS)
    return {"pair": (rank, rank ^ 1), "alone": (rank,), "everyone": everyone, "host": host,
            "host_parity": tuple(r for r in host if r % 2 == rank % 2),
            "parity": tuple(r for r in everyone if r % 2 == rank % 2),
            "hosts": tuple(r for r in everyone
                           if r % RELEASE_HOST_RANKS == rank % RELEASE_HOST_RANKS)}


def _owned(batch: int) -> int:
    """Rows a pair of cores owns under token scatter."""
    return max(1, batch // 4)


def _release_reduction(batch: int) -> str:
    """The algorithm of the release's routed and shared sums at this batch."""
    return TWO_LEVEL if batch < RS_FROM_BATCH else RS_AG


def _release_attention(kind: str, groups: dict, name: str, op: str, group: str, nbytes: float,
                       issue: str, wait: str, streams: bool = False) -> Collective:
    """One of the attention's collectives among groups[group]: one-shot, the weight stream
    stopped behind it unless `streams`; a pair's waits for no stand-in."""
    path = groups[group]
    return Collective(f"{kind}/{name}", op, path, nbytes, issue, wait, ONE_SHOT,
                      group=groups["alone"] if len(path) == 2 else None, streams=streams)


def _release_stream_collectives(lay: layouts.Layout, kind: str, actions, groups: dict,
                                batch: int, routed: bool) -> list[Collective]:
    """`release_collectives` at the stage's streamed matrices: the attended features before
    W_o, the router scores, the MoE's latent and the shared expert's sum."""
    cfg, n, d, wire = lay.cfg, lay.n_ranks, lay.cfg.d_model, PARTIAL_SUM_BYTES
    names, end = [m for m, _ in actions], f"{kind} end"
    out = []
    for i, (matrix, nbytes) in enumerate(actions):
        if spec.stage(kind).role == "attention" and matrix.endswith("w_o"):
            before = names[i - 1] if i else f"{kind} start"  # W_o's rows on this rank, bf16
            out.append(_release_attention(kind, groups, "features", "all_gather", "pair",
                                          batch * nbytes / d, before, matrix, streams=True))
        if matrix.endswith(ROUTER_MATRIX):
            out.append(Collective("router/scores", "all_gather", groups["pair"],
                                  batch * sharding.lanes(cfg.n_experts // 2) * F32, matrix,
                                  matrix, ONE_SHOT, group=groups["alone"]))
        if routed and matrix.endswith("w_ld"):
            chunk = LANE * -(-cfg.moe_latent // (n * LANE))  # the padded latent's columns per rank
            out.append(Collective("latent", "all_gather", groups["everyone"],
                                  batch * chunk * wire, matrix, EXPERTS, ONE_SHOT))
        if routed and matrix.endswith(sharding.SHARED_DOWN):
            out.append(Collective("shared_sum", "all_reduce", groups["everyone"],
                                  batch * d * wire, matrix, end, _release_reduction(batch)))
    return out


def _release_output_collectives(lay: layouts.Layout, kind: str, names: list[str], groups: dict,
                                batch: int, routed: bool) -> list[Collective]:
    """`release_collectives` at the stage's end: the attention's output (token-scattered from
    TOKEN_SCATTER_BATCH), the routed sum and W_lu's slices, or the dense FFN's sum."""
    cfg, d, wire, end = lay.cfg, lay.cfg.d_model, PARTIAL_SUM_BYTES, f"{kind} end"
    owned, everyone = _owned(batch), groups["everyone"]
    if spec.stage(kind).role == "attention" and batch >= TOKEN_SCATTER_BATCH:
        return [_release_attention(kind, groups, name, "all_gather", group, nbytes, end, end)
                for name, group, nbytes in (
                    ("scatter", "host_parity", owned * d // 2 * wire),
                    ("hosts", "hosts", owned * d // 2 * F32),
                    ("halves", "pair", owned * d // 2 * wire),
                    ("rows", "host_parity", owned * d * wire))]
    if spec.stage(kind).role == "attention":
        return [_release_attention(kind, groups, "sum", "all_reduce", "parity",
                                   batch * d // 2 * wire, end, end),
                _release_attention(kind, groups, "halves", "all_gather", "pair",
                                   batch * d // 2 * wire, end, end)]
    if routed:
        rows = owned if batch >= TOKEN_SCATTER_BATCH else batch
        w_lu = next(m for m in names if m.endswith("w_lu"))
        before_lu = names[names.index(w_lu) - 1]
        return [Collective(f"{kind}_sum", "all_reduce", everyone, batch * cfg.moe_latent * wire,
                           before_lu, w_lu, _release_reduction(batch)),
                Collective(f"{kind}/output", "all_gather", groups["host"],
                           rows * RELEASE_LU_COLUMNS * wire, end, end, ONE_SHOT)]
    return [Collective(f"{kind}_sum", "all_reduce", everyone, batch * d * wire, end, end,
                       TWO_LEVEL)]


def release_step_collectives(lay: layouts.Layout, batch: int, wire: int
                             ) -> tuple[Collective, Collective]:
    """The embedding's all-reduce and the vocab shards' sampling merge (blocking)."""
    everyone, reps = tuple(range(lay.n_ranks)), tuple(range(0, lay.n_ranks, lay.etp))
    return (Collective("embed", "all_reduce", everyone, batch * lay.cfg.d_model * wire,
                       "", "", group=reps),
            Collective("sampling_state", "all_gather", everyone,
                       batch * SAMPLING_LANES * F32, "", "", group=reps))


def with_layer(ops, layer: int):
    """Collective ops with their layer set (a stage's ops, keyed apart from their layer)."""
    return tuple(dataclasses.replace(op, layer=layer) for op in ops)
