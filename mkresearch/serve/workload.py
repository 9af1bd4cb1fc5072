"""A workload replayed: an arrival trace served by `loop.serve`, and what each step cost.

`run_workload(...)` is what `mkresearch bench --workload FILE|synthetic` prints and notebook 13
draws: one JSON-able dict (a pure function of its arguments but for the seconds measured here)

    requests   per request: lengths, arrival, the step it joined and left, its wait, slot,
               pages and tokens
    steps      per decode step: occupied slots, pages held and pages holding tokens, who owned
               each page, seconds here, and the predicted TPU step of the full model at that
               occupancy (`full_size.full_size_step`, the one full-size step, at the batch of
               occupied slots and the rows' mean context rounded up to whole pages)
    summary    tokens, tokens/s here (labelled: interpret mode or plain XLA on a CPU, not a
               TPU), the predicted TPU seconds and tokens/s of the same steps, mean occupancy

Idle steps (no row held) are not run and have no row: the clock jumps to the next arrival.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mkresearch.model import paged_kv
from mkresearch.model.config import ModelConfig
from mkresearch.prediction.full_size import full_size_of, full_size_step
from mkresearch.serve import loop, trace

PREDICTION_LABEL = "timeline model prediction of the full model at this occupancy, not measured"


def step_context(lengths: list[int], page_size: int) -> int:
    """The context one row of a step reads, for the prediction: the occupied rows' mean tokens
    rounded up to whole pages (a paged read is whole pages; rows of one step read their own)."""
    held = [n for n in lengths if n > 0]
    mean_pages = sum(paged_kv.pages_needed(n, page_size) for n in held) / len(held)
    return math.ceil(mean_pages) * page_size


def predicted_steps(records: list[loop.StepRecord], full: str, page_size: int,
                    chip: str = "tpu7x", cache: dict | None = None) -> list[float]:
    """The full-size step (seconds) of each record at its occupied batch and context (`cache`:
    (batch, context) -> seconds, kept across calls when given)."""
    cache = {} if cache is None else cache
    out = []
    for record in records:
        key = (record.occupied, step_context(record.lengths, page_size))
        if key not in cache:
            cache[key] = full_size_step(full, batch=key[0], context=key[1], chip=chip).step_s
        out.append(cache[key])
    return out


def _platform_label(step: Any) -> str:
    on_tpu = jax.default_backend() == "tpu"
    if on_tpu:
        return "measured on a TPU"
    if step == "megakernel":
        return "TPU interpret mode on CPU (a simulator: says nothing about a TPU)"
    return "plain XLA on CPU (the reference paged step)"


def step_row(record: loop.StepRecord, page_size: int, predicted: float | None) -> dict:
    """One step of the report (module docstring) from its StepRecord."""
    return {"step": record.step, "occupied": record.occupied, "slots": record.slots,
            "lengths": record.lengths,
            "pages_held": sum(owner >= 0 for owner in record.page_owner),
            "pages_filled": sum(paged_kv.pages_needed(n, page_size) for n in record.lengths),
            "page_owner": record.page_owner, "joined": record.joined, "left": record.left,
            "seconds": record.seconds, "predicted_step_s": predicted}


def run_workload(params: dict, requests: list[trace.Request], cfg: ModelConfig,
                 pages: paged_kv.PagedKVConfig, *, batch: int, step: str = "reference",
                 full_size: str | None = "auto", chip: str = "tpu7x", trace_seed: int = 0,
                 poison_freed: bool = False, progress: bool = False,
                 on_step: Callable[[dict], None] | None = None) -> dict:
    """Serve `requests` (`loop.serve`) and report each request, each step and the totals (module
    docstring). full_size: the full preset the prediction is of ("auto": the one cfg stands for,
    `full_size.full_size_of`; None: no prediction); poison_freed as `loop.serve`; `on_step`
    receives each step's row as soon as the step ran (a table printed as it goes)."""
    full = full_size_of(cfg.name) if full_size == "auto" else full_size
    steps: list[dict] = []
    cache: dict[tuple[int, int], float] = {}

    def record_step(record: loop.StepRecord) -> None:
        predicted = (predicted_steps([record], full, pages.page_size, chip, cache)[0] if full
                     else None)
        steps.append(step_row(record, pages.page_size, predicted))
        if on_step is not None:
            on_step(steps[-1])

    result = loop.serve(params, requests, cfg, pages, batch=batch, step=step,
                        trace_seed=trace_seed, poison_freed=poison_freed,
                        progress=progress, on_step=record_step)
    predicted = [s["predicted_step_s"] for s in steps]
    capacity = pages.n_pages
    rows = [{"index": q.index, "prompt_len": q.prompt_len, "output_len": q.output_len,
             "arrival": q.arrival, "temperature": q.temperature,
             "joined": result.joined_at[q.index], "left": result.left_at[q.index],
             "wait": result.joined_at[q.index] - q.arrival, "slot": result.slot_of[q.index],
             "pages": result.pages_of[q.index], "tokens": result.tokens[q.index]}
            for q in requests]
    seconds = result.step_seconds + result.prefill_seconds
    decoded = sum(s["occupied"] for s in steps)  # tokens drawn after a decode step
    summary = {
        "requests": len(rows), "tokens": result.generated, "decode_steps": len(steps),
        "seconds_here": seconds, "prefill_seconds_here": result.prefill_seconds,
        "tokens_per_s_here": result.generated / seconds if seconds else None,
        "median_step_s_here": float(np.median([s["seconds"] for s in steps])) if steps else None,
        "platform_label": _platform_label(step),
        "mean_slot_occupancy": sum(s["occupied"] for s in steps) / (len(steps) * batch)
        if steps else 0.0,
        "mean_page_occupancy": sum(s["pages_held"] for s in steps) / (len(steps) * capacity)
        if steps else 0.0,
        "max_wait_steps": max(row["wait"] for row in rows),
        "ended_at_prefill": [row["index"] for row in rows if len(row["tokens"]) == 1]}
    if full:
        tpu_seconds = sum(predicted)
        summary.update({"full_size": full, "chip": chip, "predicted_seconds": tpu_seconds,
                        "predicted_tokens_per_s": decoded / tpu_seconds if tpu_seconds else None,
                        "prediction_label": PREDICTION_LABEL})
    return {"model": cfg.name, "batch": batch, "step": step if isinstance(step, str) else "custom",
            "pages": {"page_size": pages.page_size, "n_pages": pages.n_pages,
                      "max_pages_per_row": pages.max_pages_per_row},
            "requests": rows, "steps": steps, "summary": summary}
