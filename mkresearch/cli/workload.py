"""`mkresearch bench --workload FILE|synthetic`: an arrival trace served with paged KV caches and
continuous batching (`mkresearch.serve`), one line per decode step (occupied slots, pages held,
who joined and left, seconds here, the predicted TPU step of the full model at that occupancy),
then the totals. The data is `serve.workload.run_workload`'s; this module only prints it. Bad
input (a trace that cannot be read, a field out of range, a pool too small) is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from mkresearch.cli.common import (
    UsageError,
    at_least,
    known_chip,
    known_model,
    megakernel_batch,
    refusals,
)
from mkresearch.model import paged_kv, weights
from mkresearch.serve import loop, trace, workload

DEFAULT_SLOTS = 4
DEFAULT_PAGE_SIZE = 16
DEFAULT_PAGES = 24  # fewer than 4 slots x a whole table (4 x 8 at 128 tokens): rows may wait


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (--workload)")
    group.add_argument("--workload", default=None, metavar="FILE|synthetic",
                       help="serve an arrival trace (JSON or CSV: prompt_len, output_len, "
                            "arrival per request; `synthetic`: drawn from --trace-seed) with "
                            "paged KV and continuous batching, instead of the batch sweep")
    group.add_argument("--slots", type=int, default=DEFAULT_SLOTS,
                       help=f"rows of every step (default {DEFAULT_SLOTS})")
    group.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE,
                       help=f"tokens per KV page (default {DEFAULT_PAGE_SIZE})")
    group.add_argument("--pages", type=int, default=DEFAULT_PAGES,
                       help=f"pages in the pool (default {DEFAULT_PAGES})")
    group.add_argument("--step", default="reference", choices=tuple(loop.STEPS),
                       help="the paged decode step (default reference)")
    group.add_argument("--trace-seed", type=int, default=0,
                       help="seed of the synthetic trace and of every prompt's tokens")
    group.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Check, serve the trace, print the table as the steps run (or the JSON at the end)."""
    if args.ranks != 1 or args.speculate is not None:
        raise UsageError("--workload serves on one device without speculation: drop --ranks and "
                         "--speculate")
    cfg = known_model(args.model)
    known_chip(args.chip)
    megakernel_batch("--slots", args.slots)
    at_least("--page-size", args.page_size, 1)
    at_least("--pages", args.pages, 1)
    at_least("--trace-seed", args.trace_seed, 0)
    with refusals():  # everything a run could refuse, before it starts
        requests = trace.load_trace(args.workload, args.trace_seed)
        pages = paged_kv.PagedKVConfig(args.page_size, args.pages,
                                       -(-cfg.max_seq_len // args.page_size)).check(cfg)
        loop.check_requests(requests, pages, cfg)
    params = weights.init_params(cfg, 0)
    progress = not args.json and sys.stderr.isatty()
    if not args.json:  # the table as it goes: a line per step, flushed (stdout may be a pipe)
        print("\n".join(title_lines(cfg.name, len(requests), args.slots, pages, args.step)),
              flush=True)
    with refusals():
        result = workload.run_workload(
            params, requests, cfg, pages, batch=args.slots, step=args.step, chip=args.chip,
            trace_seed=args.trace_seed, progress=progress,
            on_step=None if args.json else lambda s: print(
                step_line(s, args.slots, pages.n_pages), flush=True))
    print(json.dumps(result) if args.json else "\n".join(total_lines(result["summary"])))
    return 0


def title_lines(model: str, requests: int, batch: int, pages: paged_kv.PagedKVConfig,
                step: str) -> list[str]:
    """The table's title and column header."""
    title = (f"{model}: {requests} requests over {batch} slots, {pages.n_pages} pages of "
             f"{pages.page_size} tokens, step {step}")
    header = (f"{'step':>5} {'slots':>6} {'pages held':>10} {'filled':>6}  {'joined':<10} "
              f"{'left':<10} {'s here':>7} {'TPU ms':>7}")
    return [title, header]


def step_line(s: dict, batch: int, n_pages: int) -> str:
    """One step's row of the table (a run_workload step)."""
    predicted = "-" if s["predicted_step_s"] is None else f"{s['predicted_step_s'] * 1e3:.2f}"
    return (f"{s['step']:>5} {s['occupied']:>3}/{batch:<2} {s['pages_held']:>6}/{n_pages:<3} "
            f"{s['pages_filled']:>6}  {_ids(s['joined']):<10} {_ids(s['left']):<10} "
            f"{s['seconds']:>7.3f} {predicted:>7}")


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def total_lines(summary: dict) -> list[str]:
    """The totals under the table (a run_workload summary); a run with no decode step (every
    request done at its prefill) says so."""
    speed = (f"{summary['tokens']} tokens in {summary['seconds_here']:.2f} s here "
             f"({summary['prefill_seconds_here']:.2f} s of it prefill, compiles included): "
             f"{_number(summary['tokens_per_s_here'], '.1f')} tokens/s, median step "
             f"{_number(summary['median_step_s_here'], '.3f')} s ({summary['platform_label']})")
    occupancy = (f"occupancy: slots {summary['mean_slot_occupancy']:.0%}, pages "
                 f"{summary['mean_page_occupancy']:.0%} (mean over {summary['decode_steps']} "
                 f"steps); longest wait {summary['max_wait_steps']} steps")
    lines = [speed, occupancy]
    if summary["ended_at_prefill"]:
        lines.append(f"done at their prefill (one token, no decode step): "
                     f"{_ids(summary['ended_at_prefill'])}")
    if "predicted_seconds" in summary:
        lines.append(f"predicted on {summary['chip']}: {summary['full_size']} at each step's "
                     f"occupancy, {summary['predicted_seconds'] * 1e3:.2f} ms for the "
                     f"{summary['decode_steps']} steps, "
                     f"{_number(summary['predicted_tokens_per_s'], ',.0f')} tokens/s "
                     f"({summary['prediction_label']})")
    return lines


def format_table(result: dict) -> str:
    """The step table and the totals of a run_workload result."""
    pages = paged_kv.PagedKVConfig(**result["pages"])
    return "\n".join([*title_lines(result["model"], result["summary"]["requests"],
                                    result["batch"], pages, result["step"]),
                      *(step_line(s, result["batch"], pages.n_pages) for s in result["steps"]),
                      *total_lines(result["summary"])])


def _ids(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids) or "-"
