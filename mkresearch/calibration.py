"""The scale-out model against the release's published numbers, and ours beside them.

`release_table()`: the release's layout and schedule (`scale_out.RELEASE_SCHEDULE`) predicted at
B = 1, 2, 4, 8 beside the published 4.0 / 5.1 / 7.8 / 9.25 ms, each published step decomposed
into the model's parts (HBM floor, collectives, compute, bubbles) and what the model leaves
unexplained; a miss over MISS_FRACTION names the assumption that would have to change and by how
much (`needed_ici_bandwidth`: the ICI bandwidth at which the model meets the published step).

`second_model()`: the release's other model (816B-A42B MoE, 62 layers, 4 chips = 8 cores, 3.26 ms
at B = 1, ~55 us per layer + ~195 us fixed, HBM floor 2.19 ms): only those figures are public,
so its program is uniform (`uniform_logs`): every layer the same bytes, two sublayers each
all-reduced; ASSUMPTIONS: d = 7168 and Kimi K3's vocabulary for the LM head (the fixed bytes).
Per layer and fixed time come from two depths (62 and 31 layers).

`ours_table()`: our layout with our schedule (as built: the exact collectives) and with the
release's schedule (partial sums: what our layout alone buys), beside the published TPU7x and
16x GB200 numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mkresearch import interconnect as links
from mkresearch import layout as layouts
from mkresearch import scale_out
from mkresearch.chips import get_chip
from mkresearch.config import ModelConfig, get_config
from mkresearch.timeline_events import CollectiveEvent
from mkresearch.timeline_ranks import PARTS, simulate_ranks

BATCHES = (1, 2, 4, 8)
MISS_FRACTION = 0.20  # the bound: a prediction further off says which assumption fails
SECOND_MODEL = {"name": "816B-A42B MoE (the release's second model)", "n_layers": 62,
                "n_ranks": 8, "step_s": 3.26e-3, "per_layer_s": 55e-6, "fixed_s": 195e-6,
                "floor_s": 2.19e-3, "d_model": 7168, "vocab": 163840,
                "source": "spec/tpu.md: 3.26 ms per step at B = 1 on 4 chips, ~55 us per layer + "
                          "~195 us fixed, HBM floor 2.19 ms (61 % of roofline)"}


def _ms(seconds: float) -> float:
    return seconds * 1e3


def release_table(cfg: ModelConfig | None = None, batches=BATCHES, *, chip: str = "tpu7x",
                  interconnect: links.Interconnect | None = None,
                  algorithm: str = "two-level") -> list[dict]:
    """One row per batch: published and predicted step, the parts, the miss, the assumption."""
    cfg = get_config("kimi-k3") if cfg is None else cfg
    rows = []
    for batch in batches:
        p = scale_out.predict(cfg, 32, layouts.RELEASE, batch, chip=chip,
                              interconnect=interconnect, algorithm=algorithm)
        published = p["published_step_s"]
        miss = (p["step_s"] - published) / published
        row = {"batch": batch, "published_ms": _ms(published), "predicted_ms": _ms(p["step_s"]),
               "miss": miss, "parts_ms": {k: _ms(v) for k, v in p["parts_s"].items()},
               "unexplained_ms": _ms(published - p["step_s"]),
               "collectives_per_rank": p["collectives_per_rank"], "within": abs(miss) <= MISS_FRACTION}
        if not row["within"]:
            needed = needed_ici_bandwidth(cfg, batch, chip=chip)
            row["needed_ici_bandwidth"] = needed
            row["assumption"] = (
                "ici_bandwidth: every ICI message of a core shares one link of 45 GB/s "
                f"(ASSUMPTION); the model meets the published step at ~{needed / 1e9:.0f} GB/s "
                f"per core ({needed / links.ICI_BANDWIDTH:.1f}x: messages spread over several "
                "links of the torus, or partial sums moved in bf16)")
        rows.append(row)
    return rows


def solve(step_s: Any, target_s: float, low: float, high: float, *, rising: bool,
          iterations: int = 8) -> float:
    """The value v in [low, high] (geometric bisection) at which step_s(v), increasing in v
    (rising) or decreasing, meets target_s."""
    for _ in range(iterations):
        mid = (low * high) ** 0.5
        if (step_s(mid) > target_s) == rising:
            high = mid
        else:
            low = mid
    return (low * high) ** 0.5


def needed_ici_bandwidth(cfg: ModelConfig, batch: int, *, chip: str = "tpu7x") -> float:
    """The ICI bandwidth (bytes/s per core) at which the release's predicted step at `batch`
    equals the published one (45 GB/s .. 16x that)."""
    base = links.interconnect(chip)

    def step(bandwidth: float) -> float:
        inter = links.interconnect(base, ici_bandwidth=bandwidth)
        return scale_out.predict(cfg, 32, layouts.RELEASE, batch, chip=chip,
                                 interconnect=inter)["step_s"]

    published = scale_out.published_step_s(cfg, 32, chip, batch)
    return solve(step, published, base.ici_bandwidth, base.ici_bandwidth * 16, rising=False,
                 iterations=5)


def uniform_logs(n_layers: int, rank_bytes: float, fixed_bytes: float, n_ranks: int,
                 d_model: int, batch: int, schedule: scale_out.Schedule) -> list[list]:
    """A model known only by its totals: n_layers equal layers (attention + FFN, each half the
    layer's bytes, each all-reduced), the fixed bytes (LM head) last; every rank the same."""
    layer = (rank_bytes - fixed_bytes) / n_layers
    blocks = []
    for i in range(n_layers):
        for part in ("attention", "ffn"):
            blocks += scale_out.weight_blocks(f"{part}", layer / 2, schedule.block_bytes)
    head = scale_out.weight_blocks("lm_head", fixed_bytes, schedule.block_bytes)
    everyone = tuple(range(n_ranks))
    nbytes = batch * d_model * scale_out.F32
    logs = []
    for _ in range(n_ranks):
        prog = scale_out.RankProgram(blocks + head, schedule, batch)
        prog.collective(CollectiveEvent("embed", "all_reduce", everyone, nbytes))
        for i in range(n_layers):
            for part in ("attention", "ffn"):
                for _ in scale_out.weight_blocks(part, layer / 2, schedule.block_bytes):
                    prog.block()
                prog.collective(CollectiveEvent(f"{part}_sum", "all_reduce", everyone, nbytes))
        for _ in head:
            prog.block()
        logs.append(prog.finish())
    return logs


def _second_model_step(n_layers: int, chip: str, interconnect: Any, algorithm: str) -> Any:
    m = SECOND_MODEL
    rank_bytes = m["floor_s"] * get_chip(chip).hbm_bandwidth
    fixed_bytes = m["vocab"] // m["n_ranks"] * m["d_model"] * 2  # bf16 LM head shard
    logs = uniform_logs(n_layers, fixed_bytes + (rank_bytes - fixed_bytes) * n_layers
                        / m["n_layers"], fixed_bytes, m["n_ranks"], m["d_model"], 1,
                        scale_out.RELEASE_SCHEDULE)
    return simulate_ranks(logs, chip, interconnect=interconnect, algorithm=algorithm)


def second_model(*, chip: str = "tpu7x", interconnect: links.Interconnect | None = None,
                 algorithm: str = "two-level") -> dict:
    """The release's second model: predicted step, per layer and fixed, beside the published;
    on a miss, the message latency (sibling and ICI alike) at which the model would meet it."""
    m = SECOND_MODEL
    full = _second_model_step(m["n_layers"], chip, interconnect, algorithm)
    half = _second_model_step(m["n_layers"] // 2, chip, interconnect, algorithm)
    per_layer = (full.total_s - half.total_s) / (m["n_layers"] - m["n_layers"] // 2)
    parts = full.decomposition()
    miss = (full.total_s - m["step_s"]) / m["step_s"]
    out = {"model": m["name"], "published_ms": _ms(m["step_s"]), "predicted_ms": _ms(full.total_s),
           "miss": miss, "within": abs(miss) <= MISS_FRACTION,
           "per_layer_us": per_layer * 1e6, "published_per_layer_us": m["per_layer_s"] * 1e6,
           "fixed_us": (full.total_s - per_layer * m["n_layers"]) * 1e6,
           "published_fixed_us": m["fixed_s"] * 1e6,
           "parts_ms": {k: _ms(parts[k]) for k in PARTS}, "source": m["source"]}
    if not out["within"]:
        base = links.interconnect(chip) if interconnect is None else interconnect

        def step(latency: float) -> float:
            inter = links.interconnect(base, ici_latency=latency, sibling_latency=latency)
            return _second_model_step(m["n_layers"], chip, inter, algorithm).total_s

        latency = solve(step, m["step_s"], base.ici_latency, 40e-6, rising=True,
                        iterations=5)
        out["needed_latency_us"] = latency * 1e6
        out["assumption"] = (
            f"latency per message: {base.ici_latency * 1e6:.1f} us (the sibling fit; ICI an "
            f"ASSUMPTION); the model meets the published step only at ~{latency * 1e6:.0f} us "
            "per message, i.e. per layer some ~"
            f"{(m['per_layer_s'] - per_layer) * 1e6:.0f} us the model does not have (a "
            "per-sublayer barrier or handshake, or a slower link)")
    return out


def ours_table(cfg: ModelConfig | None = None, batches=BATCHES, *, chip: str = "tpu7x",
               interconnect: links.Interconnect | None = None,
               algorithm: str = "two-level") -> list[dict]:
    """Our layout with our schedule (as built) and with the release's, beside the published."""
    cfg = get_config("kimi-k3") if cfg is None else cfg
    published = scale_out.PUBLISHED["kimi-k3"]
    rows = []
    for batch in batches:
        row = {"batch": batch, "published_tok_s": published["tok_s"][batch],
               "gb200_tok_s": published["gb200_tok_s"][batch]}
        for label, schedule in (("ours", "ours"), ("ours_release_schedule", "release")):
            p = scale_out.predict(cfg, 32, layouts.OURS, batch, chip=chip, schedule=schedule,
                                  interconnect=interconnect, algorithm=algorithm)
            parts = p["parts_s"]
            row[label] = {"step_ms": _ms(p["step_s"]), "tok_s": p["tokens_per_s"],
                          "parts_ms": {k: _ms(v) for k, v in parts.items()},
                          "dominant": max((k for k in PARTS if k != "hbm_floor"),
                                          key=lambda k: parts[k]),
                          "collectives_per_rank": p["collectives_per_rank"],
                          "schedule": dataclasses.asdict(scale_out.schedule_for(cfg, schedule))}
        rows.append(row)
    return rows
