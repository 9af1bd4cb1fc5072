"""The scale-out model against the release's published numbers: validation, leave-one-out,
sensitivity, and ours beside the release under the same assumptions.

Nothing here is fitted to a step time. The only fitted figures are the interconnect's (a line
through the release's measured all-reduces, one through its measured sibling copies:
`mkresearch.hardware.interconnect`); `leave_one_out()` refits the collective line without each of its
measurements and predicts the one left out, and reports how far every validation point moves.

`Model` holds the assumptions both sides share (the links, the chip's timeline figures, whether a
weight stream runs past a collective, the cached context); every comparison of ours with the
release (`ours_table`, `assumptions`) predicts both under one `Model`. `validation()`: the
published points, each predicted out of sample: Kimi K3 at B = 1 / 2 / 4 / 8 (4.02 / 5.10 / 7.77
/ 9.25 ms, docs/tpu.md) at the benchmark's mean context, the second model at B = 1 / 2 / 4 / 8
(`second_model`: its program from its report's facts) and speculative decoding at 350 / 709
tok/s. `sensitivity()`: every ASSUMPTION moved (numbers x0.5 and x2, the vector rate x0.1 and
x2, switches to their other values) and the range each prediction then spans.
The figures quoted here are the release's own; the predictions are printed, never typed in:
`mkresearch predict kimi-k3 --validate` (validation, sensitivity, leave-one-out), notebook 09.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tqdm import tqdm

from mkresearch.hardware import interconnect as links
from mkresearch.model.config import ModelConfig, get_config
from mkresearch.prediction import scale_out
from mkresearch.prediction import second_model as second
from mkresearch.prediction import speculative_predict as speculative
from mkresearch.prediction.timeline_chip import timeline_chip
from mkresearch.prediction.timeline_ranks import PARTS
from mkresearch.sharding import layout as layouts

BATCHES = (1, 2, 4, 8)
TOLERANCE = 0.15  # the bound on |predicted / published - 1|; its goal is GOAL
GOAL = 0.10
# the release's benchmark (its scripts/benchmark_kimi.sh; docs/tpu.md §3): one prompt token and
# 1,024 generated per sequence, so the cache holds 1..1,024 tokens during decode: 512 on average
BENCHMARK_CONTEXT = 512
SECOND_MODEL = second.SECOND_MODEL


def _ms(seconds: float) -> float:
    return seconds * 1e3


@dataclasses.dataclass(frozen=True)
class Model:
    """The assumptions every prediction here holds, the same for ours and the release's: the
    links, the chip's timeline figures, the release's schedule (its banks and expert slots, an
    ASSUMPTION for Kimi K3), whether a weight stream runs past a collective (None: where each
    kernel's program issues its weights before the wait; True / False: every collective alike)
    and the tokens already cached (the benchmark's mean)."""

    interconnect: Any = None  # links.Interconnect or None (the release's slice)
    timeline_chip: Any = None  # TimelineChip or None ("tpu7x")
    schedule: Any = None  # the release's scale_out.Schedule or None (RELEASE_SCHEDULE)
    prefetch_across: bool | None = None
    context: int = BENCHMARK_CONTEXT

    def predict(self, cfg: ModelConfig, batch: int, name: str = layouts.RELEASE,
                **kwargs: Any) -> dict:
        """One side's prediction under these assumptions (ours: its own schedule)."""
        schedule = kwargs.pop("schedule", self.schedule if name == layouts.RELEASE else None)
        return scale_out.predict(cfg, 32, name, batch, interconnect=self.interconnect,
                                 timeline_chip=self.timeline_chip, schedule=schedule,
                                 context=self.context, prefetch_across=self.prefetch_across,
                                 **kwargs)

    def scaled(self, where: str, factors: dict[str, float], n_ranks: int | None = None
               ) -> Model:
        """These assumptions with figures of the links (`where` "interconnect": its slice the
        release's, or the one of n_ranks, where the Model names none) or of the chip
        ("timeline_chip") multiplied by `factors` ({figure: factor}), the rest held."""
        if where == "interconnect":
            base = self.interconnect or links.interconnect("tpu7x", n_ranks=n_ranks)
            moved = links.interconnect(base, **{f: getattr(base, f) * k
                                                for f, k in factors.items()})
        else:
            base = self.timeline_chip or timeline_chip("tpu7x")
            moved = timeline_chip(base, **{f: getattr(base, f) * k for f, k in factors.items()})
        return dataclasses.replace(self, **{where: moved})

    def describe(self) -> dict[str, Any]:
        """Every shared assumption with its value and source (JSON-able)."""
        inter = self.interconnect or links.interconnect("tpu7x")
        chip = self.timeline_chip or timeline_chip("tpu7x")
        out = {f"interconnect.{name}": {"value": value, "source": source}
               for name, value, source in inter.explain()}
        out |= {f"timeline_chip.{name}": {"value": getattr(chip, name),
                                          "source": chip.sources.get(name, "")}
                for name in TIMELINE_FIELDS}
        out["prefetch_across"] = {
            "value": self.prefetch_across,
            "source": "None: where each kernel's program issues the weights after a collective "
                      "before its wait (ours: its one global ring; the release: "
                      "program.release_collectives); True / False: a what-if, every collective"}
        out["context"] = {"value": self.context,
                          "source": "the release's benchmark: 1 prompt token, 1,024 generated"}
        out["routing"] = {"value": "uniform, seeded",
                          "source": "ASSUMPTION: uniform routing, as roofline's expected "
                                    "distinct experts"}
        return out


TIMELINE_FIELDS = ("hbm_bandwidth", "dma_bandwidth", "mxu_flops", "fp8_flops", "mxu_rows",
                   "vpu_flops", "vmem_bandwidth", "dma_latency", "n_dma_engines", "remote_copies_queued")


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


def second_model(batch: int = 1, *, model: Model = Model()) -> dict:
    """The release's second model at `batch`: predicted step (its program's, plus the time its
    report measures outside the layers), per layer (from two depths), its collectives."""
    m = SECOND_MODEL
    sched = model.schedule or scale_out.RELEASE_SCHEDULE
    kwargs = {"interconnect": model.interconnect, "chip": model.timeline_chip,
              "prefetch_across": model.prefetch_across}
    if model.schedule is not None:  # the banks and slots a what-if moves (its own are published)
        kwargs |= {"banks": sched.banks, "expert_slots": sched.expert_slots}
    full = second.simulate(batch, **kwargs)
    half = second.simulate(batch, n_layers=m["n_layers"] // 2, **kwargs)
    per_layer = (full.total_s - half.total_s) / (m["n_layers"] - m["n_layers"] // 2)
    step = full.total_s + m["outside_s"]
    published = m["step_ms"][batch] * 1e-3
    parts = full.decomposition()
    first_layer = full.collectives[:4]  # its four collectives, as the model prices them
    exposed = parts["collective_messages"] + parts["waiting_for_peers"]
    return {"model": m["name"], "batch": batch, "published_ms": _ms(published),
            "predicted_ms": _ms(step), "ratio": step / published, "miss": step / published - 1,
            "within": abs(step / published - 1) <= TOLERANCE,
            "per_layer_us": per_layer * 1e6, "published_per_layer_us": m["per_layer_us"],
            "fixed_us": (step - per_layer * m["n_layers"]) * 1e6,
            "published_fixed_us": m["fixed_us"],
            "collectives_per_layer_us": sum(run.end - run.start for run in first_layer) * 1e6,
            "collectives_exposed_per_layer_us": exposed / m["n_layers"] * 1e6,
            "published_collectives_per_layer_us": m["collectives_per_layer_us"],
            "collectives": [{"name": run.name, "op": run.op, "nbytes": run.nbytes,
                             "us": (run.end - run.start) * 1e6} for run in first_layer],
            "parts_ms": {k: _ms(parts[k]) for k in PARTS}, "source": m["source"]}


def second_model_collectives(model: Model = Model()) -> list[dict]:
    """Each of the second model's collectives whose payload its report measured alone, bf16 on
    its 8 cores (`links.COLLECTIVE_MEASURED_BF16`, points of the collective fit, and
    `links.GATHER_MEASURED`, not), modelled against measured, at the first batch that sends it."""
    measured = {("all_reduce", n): (s, True) for n, s in links.COLLECTIVE_MEASURED_BF16}
    measured |= {("all_gather", n): (s, False) for n, s in links.GATHER_MEASURED}
    rows: dict[tuple, dict] = {}
    for batch in BATCHES:
        for c in second_model(batch, model=model)["collectives"]:
            key = (c["op"], c["nbytes"])
            if key in measured and key not in rows:
                seconds, fitted = measured[key]
                rows[key] = {"name": c["name"], "op": c["op"], "batch": batch,
                             "nbytes": c["nbytes"], "modelled_us": c["us"],
                             "measured_us": seconds * 1e6, "in_fit": fitted}
    return list(rows.values())


def validation(model: Model = Model(), cfg: ModelConfig | None = None) -> list[dict]:
    """The published points beside the model's predictions (ratio = predicted / published in
    time per token: step, or 1 / tok/s)."""
    cfg = get_config("kimi-k3") if cfg is None else cfg
    rows = [{"point": f"Kimi K3 B={r['batch']}", "unit": "ms", "published": r["published_ms"],
             "predicted": r["predicted_ms"], "ratio": r["ratio"]}
            for r in release_table(cfg, model=model)]
    for batch in BATCHES:
        s = second_model(batch, model=model)
        rows.append({"point": f"816B-A42B B={batch} (8 cores)", "unit": "ms",
                     "published": s["published_ms"], "predicted": s["predicted_ms"],
                     "ratio": s["ratio"]})
    for r in speculative.predict_speculative(cfg, 32, layouts.RELEASE,
                                             interconnect=model.interconnect,
                                             timeline_chip=model.timeline_chip,
                                             schedule=model.schedule, context=model.context,
                                             prefetch_across=model.prefetch_across):
        rows.append({"point": f"speculative a={r['acceptance']} (k=7)", "unit": "tok/s",
                     "published": r["published_tok_s"], "predicted": r["tokens_per_s"],
                     "ratio": r["published_tok_s"] / r["tokens_per_s"]})
    for row in rows:
        row["within"] = abs(row["ratio"] - 1) <= TOLERANCE
        row["goal"] = abs(row["ratio"] - 1) <= GOAL
    return rows


# ---- the assumptions the sensitivity moves --------------------------------------------------
# (name, where it lives, field, the variants: factors for a number, values for a switch)
ASSUMPTIONS = (
    ("hop_latency", "interconnect", "hop_latency", (0.5, 2.0)),
    ("sibling_latency (the line through two copies)", "interconnect", "sibling_latency",
     (0.5, 2.0)),
    ("dma_latency", "timeline_chip", "dma_latency", (0.5, 2.0)),
    ("vmem_bandwidth", "timeline_chip", "vmem_bandwidth", (0.5, 2.0)),
    # x0.1: a vector unit of v5p's width and clock, the one public figure (timeline_chip)
    ("vpu_flops (the rows' own work, row_work)", "timeline_chip", "vpu_flops", (0.1, 2.0)),
    ("DMA queues (expert reads beside the ring)", "timeline_chip", "n_dma_engines", (2,)),
    ("remote copies behind the weight DMAs", "timeline_chip", "remote_copies_queued", (True,)),
    ("weight stream past every collective / none", "model", "prefetch_across", (True, False)),
    ("banks (K3: the second model's 12)", "schedule", "banks", (0.5, 2.0)),
    ("expert_slots (K3: the second model's 4)", "schedule", "expert_slots", (0.5, 2.0)),
)


def _varied(name: str, variant: Any) -> Model:
    """The base Model with one assumption moved: a number scaled by `variant`, a switch set to
    it."""
    where, field = next((w, f) for n, w, f, _ in ASSUMPTIONS if n == name)
    switch = isinstance(variant, bool) or field == "n_dma_engines"
    if where == "model":
        return Model(**{field: variant})
    if where == "timeline_chip" and switch:
        return Model(timeline_chip=timeline_chip("tpu7x", **{field: variant}))
    if where in ("interconnect", "timeline_chip"):  # a number of the links or the chip
        return Model().scaled(where, {field: variant})
    sched = scale_out.RELEASE_SCHEDULE
    return Model(schedule=dataclasses.replace(sched, **{
        field: max(1, round(getattr(sched, field) * variant))}))


def _bar(items: list, progress: bool, desc: str) -> Any:
    """`items`, counted by a progress bar (tqdm, on stderr) when `progress`."""
    return tqdm(items, desc=desc, unit="validation") if progress else items


def sensitivity(cfg: ModelConfig | None = None, *, progress: bool = False) -> dict:
    """Every ASSUMPTION moved to each of its variants: {"rows": one per (assumption, variant)
    with each point's ratio, "ranges": per point (lowest, highest ratio) over them and the
    base}."""
    base = validation(cfg=cfg)
    rows, ranges = [], {r["point"]: [r["ratio"], r["ratio"]] for r in base}
    varied = [(name, variant) for name, _, _, variants in ASSUMPTIONS for variant in variants]
    for name, variant in _bar(varied, progress, "assumptions moved"):
        points = validation(_varied(name, variant), cfg)
        rows.append({"assumption": name, "variant": variant,
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


# ---- ours beside the release, under the same assumptions ------------------------------------
def ours_table(cfg: ModelConfig | None = None, batches=BATCHES, *, model: Model = Model(),
               algorithm: str | None = None, progress: bool = False) -> list[dict]:
    """Per batch, under one `Model` for both sides: ours (its partial-sum collectives: "ours";
    its bit-exact ones: "ours_exact"), our layout with the release's schedule, and the release's
    own ("release"), beside the published."""
    cfg = get_config("kimi-k3") if cfg is None else cfg
    published = scale_out.PUBLISHED["kimi-k3"]
    rows = []
    for batch in tqdm(batches, desc="our layout", unit="batch") if progress else batches:
        row = {"batch": batch, "published_tok_s": published["tok_s"][batch],
               "gb200_tok_s": published["gb200_tok_s"][batch]}
        for label, name, schedule, mode in (
                ("ours", layouts.OURS, "ours", "partial-sum"),
                ("ours_exact", layouts.OURS, "ours", "exact"),
                ("ours_release_schedule", layouts.OURS, "release", "partial-sum"),
                ("release", layouts.RELEASE, "release", "partial-sum")):
            p = model.predict(cfg, batch, name, schedule=schedule if name == layouts.OURS
                              else model.schedule or schedule, algorithm=algorithm,
                              collectives=mode)
            parts = p["parts_s"]
            row[label] = {"step_ms": _ms(p["step_s"]), "tok_s": p["tokens_per_s"],
                          "rank_gb": p["rank_bytes"] / 1e9,
                          "parts_ms": {k: _ms(v) for k, v in parts.items()},
                          "dominant": max((k for k in PARTS if k != "hbm_floor"),
                                          key=lambda k: parts[k]),
                          "collectives_per_rank": p["collectives_per_rank"],
                          "schedule": p["schedule"]}
        row["ours_over_release"] = row["ours"]["step_ms"] / row["release"]["step_ms"]
        rows.append(row)
    return rows


def assumptions(cfg: ModelConfig | None = None, batch: int = 1, *,
                model: Model = Model()) -> dict[str, Any]:
    """Every assumption of both sides of a comparison (JSON-able): the shared ones (`Model`)
    once, then each side's own (its schedule: ring, expert reads, the MXU's input, where its
    stream runs past a collective), so a reader sees which are held equal and which differ by
    design."""
    cfg = get_config("kimi-k3") if cfg is None else cfg
    sides = {}
    for name in (layouts.OURS, layouts.RELEASE):
        p = model.predict(cfg, batch, name)
        sides[name] = {"schedule": p["schedule"], "rank_bytes": p["rank_bytes"],
                       "expert_format": layouts.layout(cfg, 32, name).expert_format}
    return {"shared": model.describe(), "sides": sides, "batch": batch, "model": cfg.name}
