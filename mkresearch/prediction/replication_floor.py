"""What fewer collectives would cost by replication alone: for each collective of our partial-sum
step, the bytes per rank that avoiding it by every rank reading its inputs whole adds, and the
cheapest such design for every collective count (the frontier).

What this is not: a bound on every design. Its bounds (the larger of the HBM floor and the
collectives' latencies in sequence, each priced as the kernel sends it today) hold over
replication designs only. A collective sent another way (rho by a one-phase reduce-scatter), a
router split over fewer ranks, a collective hidden behind the expert reads or the weight stream:
those change the chain without replicating, and are priced by the full scale-out model instead
(`prediction.designs`, `prediction.design_table`: `mkresearch predict MODEL --designs`, and the
router placements `mkresearch plan MODEL --ranks N` prints after this frontier).

A collective of the step (`kernels/sharded/collective_ops.py`) exists because a value
computed in pieces across ranks is needed whole by a non-linear step (top-k, an RMSNorm, the
next layer's residual mix) or by the rank that samples. It goes away only if every rank computes
the value whole, i.e. reads what the other ranks read for it:

  column chunks gathered   (the router's and W_ld's before top-k and the experts, W_qa's and
                           W_kva's before MLA's RMSNorms): every rank reads the whole matrices;
  a reduction carrying     (W_lu's, riding in the shared experts' reduction): every rank reads
  column chunks            the whole W_lu, and the shared experts' partial sums travel in the
                           routed experts' reduction (they do not need ρ): one reduction, not two;
  the shared experts' sum  with routed experts on the full d (no latent: DeepSeek-V3, GLM-4.5),
                           for free: both are partial sums of [B, d], added before one reduction
                           (what the kernel does: `layout.merges_shared_sum`, then it is the
                           routed experts' sum too);
  the embedding's sum      every rank holds the whole table: it still reads only its B rows, so
                           no bytes per step (HBM capacity only);
  the sampling merge       every rank reads the whole LM head;
  a stage's own sum        (attention's W_o, the routed experts', dense W_down's): every rank
                           computes the whole stage: its heads and states, every expert, the
                           whole hidden. The routed experts do not fit one device's HBM at all.

`frontier(cfg, n_ranks)` adds the cheapest of these first (bytes per collective removed) and says,
for every count reached, the bytes per rank, the HBM floor (bytes over one device's bandwidth)
and the collectives' latency (each left priced as the kernel sends it, `collective_plan`). Every
collective of the step waits for the one before it (each layer's value passes through them in
turn), so their latencies add up along the step: the larger of the two is a lower bound on the
step, whatever the overlap with the weight stream. E.g. whether "at most 200 collectives", "at
most 4.6 GB per rank" and "at most 2.5 ms" can hold together. Bytes are the per-rank bytes
`layout_bytes.rank_bytes` counts (the most any rank reads). A merged reduction (the shared
experts' partial sums in the routed experts') is priced as the one it joins: a lower bound.
`mkresearch plan MODEL --ranks N` prints the collectives, the frontier and the bounds.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from mkresearch.hardware.chips import get_chip
from mkresearch.kernels.sharded import plan as sharding
from mkresearch.kernels.sharded.collective_ops import collective_ops
from mkresearch.model import roofline, spec
from mkresearch.model.config import ModelConfig
from mkresearch.prediction import collective_plan
from mkresearch.sharding import layout as layouts
from mkresearch.sharding import layout_bytes

SHARED_SUM = f"{sharding.SHARED_DOWN}/sum"  # the shared experts' reduction


@dataclass(frozen=True)
class Avoidance:
    """One collective of the step (run `count` times per step) and what avoiding it costs."""

    name: str  # the kernel's DMA-log name ("router/w_router+latent/w_ld", "kda.w_o/sum", ...)
    kind: str  # "all-gather" | "all-reduce"
    stage: str
    count: int  # per step
    extra_bytes: float  # per rank per step, all `count` avoided
    seconds: float  # the `count` collectives' price as the kernel sends them
    how: str  # what every rank would do instead
    fits_hbm: bool = True  # False: what every rank would hold exceeds one device's HBM


def _matrix_extra(lay: layouts.Layout, rules: dict, names: tuple[str, ...]) -> int:
    """Bytes one rank would read more per layer holding these column-split matrices whole."""
    out = 0
    for rule in (rules[n] for n in names):
        local = lay.local_length(rule.out, rule.n) if rule.out else rule.n
        out += rule.k * max(0, rule.n - local) * 2  # bf16, as streamed
    return out


def avoidances(cfg: ModelConfig, n_ranks: int, batch: int = 1, chip: str = "tpu7x"
               ) -> list[Avoidance]:
    """Every collective of rank 0's partial-sum step, grouped by name, with what avoiding it
    adds per rank (see the module docstring)."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg={cfg!r} is invalid: a mkresearch ModelConfig (get_config(name))")  # noqa: TRY004
    lay = layouts.layout(cfg, n_ranks, layouts.OURS, collectives=layouts.PARTIAL_SUM)
    plan = sharding.sharding_plan(lay, batch, "f32", chip)
    ops = collective_ops(plan, rank=0)
    rules = {r.name: r for r in plan.rules}
    whole = roofline.step_bytes(cfg, batch)
    mine = layout_bytes.rank_bytes(lay, batch, 0, layouts.PARTIAL_SUM)
    kinds = {k.name: k for k in spec.stages_of(cfg)}
    hbm = get_chip(chip).hbm_bytes
    counts = Counter(op.name for op in ops)
    merged = sharding.expert_sum_merged(plan.rules)  # the experts' sum in the shared experts'
    priced: Counter = Counter()
    for row in collective_plan.collective_plan(cfg, n_ranks, batch, chip=chip)["rows"]:
        priced[row["name"]] += row["us"] * row["count"] * 1e-6
    out, seen = [], set()
    for op in ops:
        if op.name in seen:
            continue
        seen.add(op.name)
        n, fits = counts[op.name], True
        if op.kind == "all-gather" and op.role == "output":
            names = (op.matrix, *op.carries)
            extra = n * _matrix_extra(lay, rules, names)
            how = f"every rank reads the whole {' and '.join(sorted(names))}"
        elif op.name == SHARED_SUM and not op.carries and not merged:  # experts on the full d
            extra = 0.0
            how = f"{op.matrix}'s partial sums added to the routed experts' before one reduction"
        elif op.role == "sum" and op.carries:
            extra = n * _matrix_extra(lay, rules, op.carries)
            how = (f"every rank reads the whole {' and '.join(op.carries)}; "
                   f"{op.matrix}'s partial sums travel in the routed experts' reduction")
        elif op.stage == "embed":
            extra, how = 0.0, "every rank holds the whole embedding table (reads its B rows)"
        elif op.stage == "sampling":
            extra = whole.read["lm_head"] - mine.component("lm_head")
            how = "every rank reads the whole LM head"
        elif op.name == sharding.EXPERT_SUM or (op.name == SHARED_SUM and merged):  # the experts' sum
            component = kinds[op.stage].routed_component[0]
            extra = whole.read[component] - mine.component(component)
            held = (roofline.expert_bytes(cfg) * cfg.n_experts
                    * len(cfg.layers_of(op.stage)))
            fits = held <= hbm
            how = "every rank computes every routed expert of the batch"
        else:  # a stage's own sum: the whole stage on every rank
            kind = kinds[op.stage]
            names = [kind.component[0]] + ([kind.state_component[0]]
                                           if kind.state_component else [])
            extra = sum(whole.read.get(c, 0) + whole.written.get(c, 0) - mine.component(c)
                        for c in names)
            how = f"every rank computes the whole {op.stage} stage (all heads / hidden)"
        out.append(Avoidance(op.name, op.kind, op.stage, n, float(extra), priced[op.name], how,
                             fits))
    return out


def frontier(cfg: ModelConfig, n_ranks: int, batch: int = 1, chip: str = "tpu7x"
             ) -> dict[str, Any]:
    """The step as built, then the avoidances cheapest per collective first (those that fit HBM):
    after each, the collectives per rank per step, the bytes per rank, the HBM floor. JSON-able."""
    lay = layouts.layout(cfg, n_ranks, layouts.OURS, collectives=layouts.PARTIAL_SUM)
    base = layout_bytes.rank_bytes(lay, batch, 0, layouts.PARTIAL_SUM).total
    found = avoidances(cfg, n_ranks, batch, chip)
    bandwidth = get_chip(chip).hbm_bandwidth
    count, nbytes, seconds = sum(a.count for a in found), float(base), sum(a.seconds for a in found)

    def row(avoided: str, how: str) -> dict:
        floor_ms, coll_ms = nbytes / bandwidth * 1e3, seconds * 1e3
        return {"avoided": avoided, "how": how, "collectives": count, "rank_bytes": nbytes,
                "floor_ms": floor_ms, "collectives_ms": coll_ms, "bound_ms": max(floor_ms, coll_ms)}

    rows = [row("", "as built")]
    for a in sorted((a for a in found if a.fits_hbm),
                    key=lambda a: (a.extra_bytes / a.count, -a.count)):
        count, nbytes, seconds = count - a.count, nbytes + a.extra_bytes, seconds - a.seconds
        rows.append(row(a.name, a.how))
    return {"model": cfg.name, "n_ranks": n_ranks, "batch": batch, "chip": chip, "rows": rows,
            "unfit": [a.name for a in found if not a.fits_hbm]}


def fewest_within(front: dict[str, Any], max_rank_bytes: float) -> dict[str, Any] | None:
    """The frontier's row with the fewest collectives at most `max_rank_bytes` per rank, or
    None (the step as built reads more)."""
    within = [r for r in front["rows"] if r["rank_bytes"] <= max_rank_bytes]
    return min(within, key=lambda r: r["collectives"]) if within else None


def bytes_for(front: dict[str, Any], max_collectives: int) -> dict[str, Any] | None:
    """The frontier's cheapest row with at most `max_collectives`, or None (no design fits)."""
    rows = [r for r in front["rows"] if r["collectives"] <= max_collectives]
    return min(rows, key=lambda r: r["rank_bytes"]) if rows else None


def fastest(cfg: ModelConfig, n_ranks: int, batch: int = 1, chip: str = "tpu7x", *,
            max_rank_bytes: float | None = None, max_collectives: int | None = None
            ) -> dict[str, Any] | None:
    """Of every combination of the avoidances that fit HBM (not only the frontier's order) within
    `max_rank_bytes` per rank and `max_collectives` per step (None: any), the one with the lowest
    bound on the step (the larger of its HBM floor and its collectives' latency): no replication
    design can be faster (designs that send a collective another way are not bounded here: see
    the module docstring). JSON-able; None if no combination meets the limits."""
    lay = layouts.layout(cfg, n_ranks, layouts.OURS, collectives=layouts.PARTIAL_SUM)
    base = float(layout_bytes.rank_bytes(lay, batch, 0, layouts.PARTIAL_SUM).total)
    found = avoidances(cfg, n_ranks, batch, chip)
    fit = [a for a in found if a.fits_hbm]
    bandwidth = get_chip(chip).hbm_bandwidth
    best = None
    for k in range(len(fit) + 1):
        for chosen in itertools.combinations(fit, k):
            nbytes = base + sum(a.extra_bytes for a in chosen)
            seconds = sum(a.seconds for a in found) - sum(a.seconds for a in chosen)
            bound = max(nbytes / bandwidth, seconds) * 1e3
            count = sum(a.count for a in found) - sum(a.count for a in chosen)
            if (max_rank_bytes is not None and nbytes > max_rank_bytes) or \
                    (max_collectives is not None and count > max_collectives):
                continue
            if best is None or bound < best["bound_ms"]:
                best = {"avoided": [a.name for a in chosen], "rank_bytes": nbytes,
                        "collectives": count,
                        "floor_ms": nbytes / bandwidth * 1e3, "collectives_ms": seconds * 1e3,
                        "bound_ms": bound}
    return best


def format_fastest(best: dict[str, Any] | None, limits: str = "") -> str:
    """One line: the lowest bound over replication designs (`fastest`), under `limits` (words)."""
    if best is None:
        return f"  no combination of these avoidances meets {limits}"
    avoided = ", ".join(best["avoided"]) or "none"
    return (f"  the lowest bound over replication designs{' ' + limits if limits else ''} (not "
            "over restructured reductions, router placements or overlap: `predict --designs`): "
            f"{best['bound_ms']:.2f} ms (floor {best['floor_ms']:.2f}, collectives "
            f"{best['collectives_ms']:.2f}) with {best['collectives']} collectives and "
            f"{best['rank_bytes'] / 1e9:.2f} GB per rank, avoiding {avoided}")


def format_frontier(front: dict[str, Any]) -> str:
    lines = [(f"fewer collectives by replication, and what they cost ({front['model']} on {front['n_ranks']} "
              f"ranks of {front['chip']}, B = {front['batch']}; bytes per rank; floor = bytes / "
              "one device's HBM bandwidth; coll = the collectives' latencies, one after another; "
              "bound = the larger):"),
             (f"  {'collectives':>11s} {'GB/rank':>8s} {'floor ms':>8s} {'coll ms':>8s} "
              f"{'bound ms':>8s}  avoided: how")]
    for r in front["rows"]:
        what = f"{r['avoided']}: {r['how']}" if r["avoided"] else r["how"]
        lines.append(f"  {r['collectives']:11d} {r['rank_bytes'] / 1e9:8.2f} "
                     f"{r['floor_ms']:8.2f} {r['collectives_ms']:8.2f} {r['bound_ms']:8.2f}  "
                     f"{what}")

    if front["unfit"]:
        lines.append(f"  not listed: {', '.join(front['unfit'])} (every rank would hold more "
                     "than one device's HBM)")
    return "\n".join(lines)
