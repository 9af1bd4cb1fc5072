"""`mkresearch bench --workload FILE|synthetic`: an arrival trace served with paged KV caches and
continuous batching (`mkresearch.serve`), one line per decode step (occupied slots, pages held,
who joined and left, seconds here, the predicted TPU step of the full model at that occupancy),
then the totals. The data is `serve.workload.run_workload`'s; this module only prints it. Bad
input (a trace that cannot be read, a field out of range, a pool too small) is one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator

import jax

from mkresearch.cli.common import (
    UsageError,
    at_least,
    known_chip,
    known_model,
    megakernel_batch,
    options_of,
    refusals,
)
from mkresearch.model import paged_kv, weights
from mkresearch.serve import loop, trace, workload

# the workload options' defaults (their parser's are None: given without --workload, refused)
DEFAULTS = {"slots": 4, "page_size": 16,
            "pages": 24,  # fewer than 4 slots x a whole table (4 x 8 at 128 tokens): rows may wait
            "step": "reference", "trace_seed": 0}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (--workload)")
    group.add_argument("--workload", default=None, metavar="FILE|synthetic",
                       help="serve an arrival trace (JSON or CSV: prompt_len, output_len, "
                            "arrival per request; `synthetic`: drawn from --trace-seed) with "
                            "paged KV and continuous batching, instead of the batch sweep")
    group.add_argument("--slots", type=int, default=None,
                       help=f"rows of every step (default {DEFAULTS['slots']})")
    group.add_argument("--page-size", type=int, default=None,
                       help=f"tokens per KV page (default {DEFAULTS['page_size']})")
    group.add_argument("--pages", type=int, default=None,
                       help=f"pages in the pool (default {DEFAULTS['pages']})")
    group.add_argument("--step", default=None, choices=tuple(loop.STEPS),
                       help=f"the paged decode step (default {DEFAULTS['step']})")
    group.add_argument("--trace-seed", type=int, default=None,
                       help="seed of the synthetic trace and of every prompt's tokens "
                            f"(default {DEFAULTS['trace_seed']})")
    group.add_argument("--json", action="store_true", help="print one JSON object")


def check_without_workload(args: argparse.Namespace) -> None:
    """A workload option given without --workload: a UsageError, not an option dropped."""
    options_of("--workload FILE|synthetic",
               ((f"--{dest.replace('_', '-')}", getattr(args, dest), None) for dest in DEFAULTS),
               "the batch sweep takes --batch")


def run(args: argparse.Namespace) -> int:
    """Check, serve the trace, print the table as the steps run (or the JSON at the end)."""
    for dest, default in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
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
    pool_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(
        paged_kv.paged_state_shapes(cfg, pages, args.slots)))
    progress = not args.json and sys.stderr.isatty()
    if not args.json:  # the table as it goes: a line per step, flushed (stdout may be a pipe)
        print("\n".join(title_lines(cfg.name, len(requests), args.slots, pages, args.step)),
              flush=True)
    with refusals(), out_of_memory(args, pool_bytes):
        result = workload.run_workload(
            params, requests, cfg, pages, batch=args.slots, step=args.step, chip=args.chip,
            trace_seed=args.trace_seed, progress=progress,
            on_step=None if args.json else lambda s: print(
                step_line(s, args.slots, pages.n_pages), flush=True))
    print(json.dumps(result) if args.json else "\n".join(total_lines(result["summary"])))
    return 0


@contextlib.contextmanager
def out_of_memory(args: argparse.Namespace, pool_bytes: int) -> Iterator[None]:
    """The device out of memory -> a UsageError naming the page pool's options and its bytes."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        raise UsageError(f"--pages {args.pages} x --page-size {args.page_size}: the KV page "
                         f"pool and the rows' states take {pool_bytes / 1e9:.3g} GB, more than "
                         f"the device could allocate: give fewer or smaller pages") from None


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
