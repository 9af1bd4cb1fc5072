"""The scale-out model against the release's published numbers: validation, leave-one-out,
sensitivity, and our layout beside them.

Nothing here is fitted to a step time. The only fitted figures are the interconnect's (a line
through the release's measured all-reduces, one through its measured sibling copies:
`mkresearch.hardware.interconnect`); `leave_one_out()` refits the collective line without each of its
measurements and predicts the one left out, and reports how far every validation point moves.

`validation()`: the seven published points, each predicted out of sample: Kimi K3 at B = 1 / 2 /
4 / 8 (4.02 / 5.10 / 7.77 / 9.25 ms, docs/tpu.md), the second model's 3.26 ms, and speculative
decoding at 350 / 709 tok/s. `sensitivity()`: every ASSUMPTION moved x0.5 and x2 and the range each
prediction then spans. `second_model()`: the release's 816B-A42B on 8 cores, known only by its
totals (3.26 ms at B = 1, ~55 us per layer + ~195 us fixed, HBM floor 2.19 ms), so its program is
uniform (`uniform_programs`): equal layers, its 4 collectives per layer (o-proj all-reduce,
pre-MoE all-gather, expert all-reduce, post all-gather; all-reduces as one-shot reduce-scatter +
all-gather), ASSUMPTIONS: d = 7168 and Kimi K3's vocabulary for the LM head (the fixed bytes).
`ours_table()`: our layout with our schedule and with the release's, beside the published.
The figures quoted here are the release's own; the predictions are printed, never typed in:
`mkresearch predict kimi-k3 --validate` (validation, sensitivity, leave-one-out), notebook 09.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tqdm import tqdm

from mkresearch.hardware import interconnect as links
from mkresearch.hardware.chips import get_chip
from mkresearch.model.config import ModelConfig, get_config
from mkresearch.prediction import program, scale_out
from mkresearch.prediction import speculative_predict as speculative
from mkresearch.prediction.timeline_chip import timeline_chip
from mkresearch.prediction.timeline_ranks import PARTS, simulate_programs
from mkresearch.sharding import layout as layouts

BATCHES = (1, 2, 4, 8)
TOLERANCE = 0.15  # the bound on |predicted / published - 1|; its goal is GOAL
GOAL = 0.10
SECOND_MODEL = {"name": "816B-A42B MoE (the release's second model)", "n_layers": 62,
                "n_ranks": 8, "step_s": 3.26e-3, "per_layer_s": 55e-6, "fixed_s": 195e-6,
                "floor_s": 2.19e-3, "d_model": 7168, "vocab": 163840,
                "source": "docs/tpu.md: 3.26 ms per step at B = 1 on 4 chips, ~55 us per layer + "
                          "~195 us fixed, HBM floor 2.19 ms (61 % of roofline)"}
# the numeric ASSUMPTIONS the predictions rest on: (name, where it lives, field)
ASSUMPTIONS = (("hop_latency", "interconnect", "hop_latency"),
               ("dma_latency", "timeline_chip", "dma_latency"),
               ("vmem_bandwidth", "timeline_chip", "vmem_bandwidth"),
               ("banks (K3: the second model's 12)", "schedule", "banks"),
               ("expert_slots (K3: the second model's 4)", "schedule", "expert_slots"))


def _ms(seconds: float) -> float:
    return seconds * 1e3


@dataclasses.dataclass(frozen=True)
class Model:
    """The inputs every prediction here takes: the links, the chip's timeline, the schedule."""

    interconnect: Any = None  # links.Interconnect or None (the release's slice)
    timeline_chip: Any = None  # TimelineChip or None ("tpu7x")
    schedule: Any = None  # scale_out.Schedule or None (the release's)

    def predict(self, cfg: ModelConfig, batch: int, **kwargs: Any) -> dict:
        return scale_out.predict(cfg, 32, layouts.RELEASE, batch, interconnect=self.interconnect,
                                 timeline_chip=self.timeline_chip, schedule=self.schedule,
                                 **kwargs)


def release_table(cfg: ModelConfig | None = None, batches=BATCHES, *,
                  model: Model = Model(), algorithm: str | None = None) -> list[dict]:
    """One row per batch: published and predicted step, their ratio, the parts."""
    cfg = get_config("kimi-k3") if cfg is None else cfg
    rows = []
    for batch in batches:
        p = model.predict(cfg, batch, algorithm=algorithm)
        published = p["published_step_s"]
        ratio = p["step_s"] / published
        rows.append({"batch": batch, "published_ms": _ms(published),
                     "predicted_ms": _ms(p["step_s"]), "ratio": ratio, "miss": ratio - 1,
                     "parts_ms": {k: _ms(v) for k, v in p["parts_s"].items()},
                     "unexplained_ms": _ms(published - p["step_s"]),
                     "algorithm": p["algorithm"],
                     "collectives_per_rank": p["collectives_per_rank"],
                     "within": abs(ratio - 1) <= TOLERANCE})
    return rows


def uniform_programs(n_layers: int, rank_bytes: float, fixed_bytes: float, n_ranks: int,
                     d_model: int, batch: int, schedule: scale_out.Schedule):
    """(blocks, [ops]) of a model known only by its totals: n_layers equal layers (attention and
    FFN, half the layer's bytes each) with the second model's 4 collectives, the fixed bytes (LM
    head) last; one program stands for every rank (they are the same)."""
    layer = (rank_bytes - fixed_bytes) / n_layers
    half = program.weight_blocks(layer / 2, schedule.block_bytes)
    head = program.weight_blocks(fixed_bytes, schedule.block_bytes)
    prog = program.Program(list(half) * 2 * n_layers + list(head), batch)
    everyone = tuple(range(n_ranks))
    vector = batch * d_model * program.PARTIAL_SUM_BYTES
    for _ in range(n_layers):
        prog.block(len(half))
        prog.collective("o_proj", "all_reduce", (0,), vector, everyone)
        prog.collective("pre_moe", "all_gather", (0,), vector / n_ranks, everyone)
        prog.block(len(half))
        prog.collective("experts", "all_reduce", (0,), vector, everyone)
        prog.collective("post", "all_gather", (0,), vector / n_ranks, everyone)
    prog.block(len(head))
    return prog.blocks, [prog.ops]


def _second_model_step(n_layers: int, model: Model) -> Any:
    m = SECOND_MODEL
    rank_bytes = m["floor_s"] * get_chip("tpu7x").hbm_bandwidth
    fixed_bytes = m["vocab"] // m["n_ranks"] * m["d_model"] * 2  # bf16 LM head shard
    sched = model.schedule or scale_out.RELEASE_SCHEDULE
    if model.schedule is not None:  # the second model's banks and slots are published
        sched = dataclasses.replace(sched, banks=scale_out.RELEASE_SCHEDULE.banks,
                                    expert_slots=scale_out.RELEASE_SCHEDULE.expert_slots)
    blocks, programs = uniform_programs(
        n_layers, fixed_bytes + (rank_bytes - fixed_bytes) * n_layers / m["n_layers"],
        fixed_bytes, m["n_ranks"], m["d_model"], 1, sched)
    base = model.interconnect or links.interconnect("tpu7x")
    inter = links.interconnect(base, n_ranks=m["n_ranks"])
    # docs/collectives.md: its all-reduce is one-shot reduce-scatter + all-gather
    return simulate_programs(programs, blocks, sched.banks, 1, (0,), inter,
                             {"all_reduce": "rs-ag", "all_gather": "one-shot", "chain": "one-shot"},
                             model.timeline_chip or "tpu7x", prefetch_across=sched.prefetch_across)


def second_model(*, model: Model = Model()) -> dict:
    """The release's second model: predicted step, per layer (from two depths) and fixed."""
    m = SECOND_MODEL
    full = _second_model_step(m["n_layers"], model)
    half = _second_model_step(m["n_layers"] // 2, model)
    per_layer = (full.total_s - half.total_s) / (m["n_layers"] - m["n_layers"] // 2)
    parts = full.decomposition()
    ratio = full.total_s / m["step_s"]
    per_layer_collectives = [run.end - run.start for run in full.collectives[:4]]
    return {"model": m["name"], "published_ms": _ms(m["step_s"]),
            "predicted_ms": _ms(full.total_s), "ratio": ratio, "miss": ratio - 1,
            "within": abs(ratio - 1) <= TOLERANCE,
            "per_layer_us": per_layer * 1e6, "published_per_layer_us": m["per_layer_s"] * 1e6,
            "fixed_us": (full.total_s - per_layer * m["n_layers"]) * 1e6,
            "published_fixed_us": m["fixed_s"] * 1e6,
            "collectives_per_layer_us": sum(per_layer_collectives) * 1e6,
            "parts_ms": {k: _ms(parts[k]) for k in PARTS}, "source": m["source"]}


def validation(model: Model = Model(), cfg: ModelConfig | None = None) -> list[dict]:
    """The seven published points beside the model's predictions (ratio = predicted /
    published in time per token: step, or 1 / tok/s)."""
    cfg = get_config("kimi-k3") if cfg is None else cfg
    rows = [{"point": f"Kimi K3 B={r['batch']}", "unit": "ms", "published": r["published_ms"],
             "predicted": r["predicted_ms"], "ratio": r["ratio"]}
            for r in release_table(cfg, model=model)]
    second = second_model(model=model)
    rows.append({"point": "816B-A42B B=1 (8 cores)", "unit": "ms",
                 "published": second["published_ms"], "predicted": second["predicted_ms"],
                 "ratio": second["ratio"]})
    for r in speculative.predict_speculative(cfg, 32, layouts.RELEASE,
                                             interconnect=model.interconnect,
                                             timeline_chip=model.timeline_chip,
                                             schedule=model.schedule):
        rows.append({"point": f"speculative a={r['acceptance']} (k=7)", "unit": "tok/s",
                     "published": r["published_tok_s"], "predicted": r["tokens_per_s"],
                     "ratio": r["published_tok_s"] / r["tokens_per_s"]})
    for row in rows:
        row["within"] = abs(row["ratio"] - 1) <= TOLERANCE
        row["goal"] = abs(row["ratio"] - 1) <= GOAL
    return rows


def _varied(name: str, factor: float) -> Model:
    where, field = next((w, f) for n, w, f in ASSUMPTIONS if n == name)
    if where == "interconnect":
        base = links.interconnect("tpu7x")
        return Model(interconnect=links.interconnect(base, **{field: getattr(base, field) * factor}))
    if where == "timeline_chip":
        base = timeline_chip("tpu7x")
        return Model(timeline_chip=timeline_chip(base, **{field: getattr(base, field) * factor}))
    sched = scale_out.RELEASE_SCHEDULE
    return Model(schedule=dataclasses.replace(sched, **{field: max(1, round(getattr(sched, field)
                                                                             * factor))}))


def _bar(items: list, progress: bool, desc: str) -> Any:
    """`items`, counted by a progress bar (tqdm, on stderr) when `progress`."""
    return tqdm(items, desc=desc, unit="validation") if progress else items


def sensitivity(factors=(0.5, 2.0), cfg: ModelConfig | None = None, *,
                progress: bool = False) -> dict:
    """Every ASSUMPTION moved by each factor: {"rows": one per (assumption, factor) with each
    point's ratio, "ranges": per point (lowest, highest ratio) over them and the base}."""
    base = validation(cfg=cfg)
    rows, ranges = [], {r["point"]: [r["ratio"], r["ratio"]] for r in base}
    varied = [(name, factor) for name, _, _ in ASSUMPTIONS for factor in factors]
    for name, factor in _bar(varied, progress, "assumptions x0.5, x2"):
        points = validation(_varied(name, factor), cfg)
        rows.append({"assumption": name, "factor": factor,
                     "ratios": {r["point"]: r["ratio"] for r in points}})
        for r in points:
            low, high = ranges[r["point"]]
            ranges[r["point"]] = [min(low, r["ratio"]), max(high, r["ratio"])]
    return {"base": base, "rows": rows, "ranges": {k: tuple(v) for k, v in ranges.items()}}


def leave_one_out(cfg: ModelConfig | None = None, *, progress: bool = False) -> dict:
    """The collective line refitted without each measured all-reduce: the one left out
    predicted, and every validation point's ratio under each refit."""
    measured = links.COLLECTIVE_MEASURED
    held, ranges = [], {}
    for i, (nbytes, seconds) in _bar(list(enumerate(measured)), progress, "leave-one-out"):
        latency, bandwidth = links.fit_phases(measured[:i] + measured[i + 1:])
        inter = links.interconnect("tpu7x", ici_latency=latency, ici_bandwidth=bandwidth)
        small = links.interconnect(inter, slice=links.COLLECTIVE_MEASURED_ON)
        predicted = links.price(small, "all_reduce", "rs-ag", tuple(range(8)), nbytes).seconds
        held.append({"nbytes": nbytes, "measured_us": seconds * 1e6,
                     "predicted_us": predicted * 1e6, "ici_latency_us": latency * 1e6,
                     "ici_bandwidth_gbs": bandwidth / 1e9})
        for r in validation(Model(interconnect=inter), cfg):
            low, high = ranges.get(r["point"], (r["ratio"], r["ratio"]))
            ranges[r["point"]] = (min(low, r["ratio"]), max(high, r["ratio"]))
    return {"held_out": held, "ranges": ranges}


def ours_table(cfg: ModelConfig | None = None, batches=BATCHES, *, chip: str = "tpu7x",
               interconnect: links.Interconnect | None = None,
               algorithm: str | None = None, progress: bool = False) -> list[dict]:
    """Our layout with our schedule (its partial-sum collectives: "ours"; its bit-exact ones:
    "ours_exact") and with the release's schedule, beside the published."""
    cfg = get_config("kimi-k3") if cfg is None else cfg
    published = scale_out.PUBLISHED["kimi-k3"]
    rows = []
    for batch in tqdm(batches, desc="our layout", unit="batch") if progress else batches:
        row = {"batch": batch, "published_tok_s": published["tok_s"][batch],
               "gb200_tok_s": published["gb200_tok_s"][batch]}
        for label, schedule, mode in (("ours", "ours", "partial-sum"),
                                      ("ours_exact", "ours", "exact"),
                                      ("ours_release_schedule", "release", "partial-sum")):
            p = scale_out.predict(cfg, 32, layouts.OURS, batch, chip=chip, schedule=schedule,
                                  interconnect=interconnect, algorithm=algorithm,
                                  collectives=mode)
            parts = p["parts_s"]
            row[label] = {"step_ms": _ms(p["step_s"]), "tok_s": p["tokens_per_s"],
                          "parts_ms": {k: _ms(v) for k, v in parts.items()},
                          "dominant": max((k for k in PARTS if k != "hbm_floor"),
                                          key=lambda k: parts[k]),
                          "collectives_per_rank": p["collectives_per_rank"],
                          "schedule": dataclasses.asdict(scale_out.schedule_for(cfg, schedule,
                                                                                mode, 32))}
        rows.append(row)
    return rows
