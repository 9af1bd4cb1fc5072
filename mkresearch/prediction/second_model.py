"""The release's second model (an 816B-A42B MoE on 8 TPU7x cores), its program written from the
facts its report gives (docs/collectives.md §2), for the
validation (`calibration`): a model the release measured at B = 1, 2, 4 and 8 with identical
rows, so the same 8 experts per layer at every batch. What grows with the batch there is the
collectives' payloads, the compute rows and the KV cache, not the expert bytes: the batch-dependent
machinery of the scale-out model, checked alone.

Its decode step (TP8 on one host: every matrix and every expert split eight ways, one program
stands for every core), per layer:

  ring       76 MiB of bf16 weights in 2 MiB loads through 12 banks (24 MiB in flight across layer
             boundaries): q, kv, gate, o (16 + 4 + 16 + 16 MiB), pre (8), the router as a bf16
             hi/lo pair (8), post (8): its dims (d 8192, 128 query / 16 KV heads of 64, 4096-wide
             experts) split eight ways
  o-proj     all-reduce of [8, 8192] bf16 partial sums: reduce-scatter + all-gather
  pre        all-gather of [8, 512] per core
  experts    the batch's 8 distinct experts (3.19 MiB of int4 per core each), 4 slots issued right
             after routing; up to B = 4 ahead of the ring's deferred refills ("refills issued
             during the router phase are deferred behind the first expert slabs"), at B = 8
             behind them (its kernel defers only at B <= 4); its int4 dots measured DMA-bound at
             ~1.3 us per expert, so the MXU takes them at least at the fp8 rate
  experts'   all-reduce of [K B, 4096] bf16 partial sums, one row per (row, expert) pair: the
  sum        routing weights are applied after the sum (reduce-scatter + all-gather; at B = 8 a
             chip-hierarchical variant, priced here as the same reduce-scatter + all-gather: its
             report measures the two 13.5 and 14.5 us on [64, 4096])
  post       all-gather of [8, 1024] per core

Every collective's rows are padded to 8 (the MXU's row block), so below 8 rows a payload does not
shrink with the batch: the report's own measured all-reduces name "[8, 8192] (B=1 o-proj)" and
"[64, 4096] (B=8 experts)" (docs/collectives.md §2).
  KV         512 B per token per layer per core, the benchmark's rows at positions 151..279

then the LM head's 400 MiB through the ring, and ~70 us per step of dispatch, XLA glue, barrier
and ring priming the report measures outside the layers. The published points are its int4
container with bf16 dense weights (7.02 GB per step per core; the report's per-layer breakdown is
of this configuration): 3.592 / 3.705 / 3.912 / 4.291 ms at B = 1 / 2 / 4 / 8.
"""

from __future__ import annotations

from typing import Any

from mkresearch.hardware import interconnect as links
from mkresearch.prediction import program
from mkresearch.prediction.timeline import FIRST, QUEUED
from mkresearch.prediction.timeline_chip import TimelineChip, timeline_chip
from mkresearch.prediction.timeline_ranks import simulate_programs

MIB = 2**20
SECOND_MODEL = {
    "name": "816B-A42B MoE (the release's second model)", "n_layers": 62, "n_ranks": 8,
    "slice": "tpu7x:2x2x1", "d_model": 8192,
    # ms per step by batch, int4 experts + bf16 dense, identical rows (docs/collectives.md §2)
    "step_ms": {1: 3.592, 2: 3.705, 4: 3.912, 8: 4.291},
    "per_layer_us": 55.0, "fixed_us": 195.0, "collectives_per_layer_us": 14.0,
    # the ring's matrices per layer per core, MiB, in stream order (attention, then the MoE's)
    "attention_mib": (16, 4, 16, 16), "pre_mib": 8, "router_mib": 8, "post_mib": 8,
    "bank_bytes": 2 * MIB, "banks": 12, "expert_slots": 4, "experts": 8,
    "expert_bytes": 3.19 * MIB, "expert_weights": 4096 * 1024 + 512 * 4096,
    "lm_head_bytes": 400 * MIB, "outside_s": 70e-6, "kv_bytes_per_token": 512,
    # collectives' payloads: rows padded to a multiple of 8; the experts' sum is [top_k B, 4096]
    "payload_rows": 8, "top_k": 8, "expert_width": 4096, "gather_widths": (512, 1024),
    "defer_up_to_batch": 4,

    "positions": (151, 279),
    "source": "the release's report (docs/collectives.md §2): int4 container, bf16 "
              "dense, identical rows; 7.02 GB per step per core, ~55 us per layer + ~195 us "
              "fixed at B = 1, its four collectives ~14 us per layer",
}


def payload_rows(rows: int) -> int:
    """A collective's rows as its kernel sends them: padded to a multiple of 8."""
    block = SECOND_MODEL["payload_rows"]
    return -(-rows // block) * block


def programs(batch: int, n_layers: int | None = None) -> tuple[list[int], list[list]]:
    """(weight blocks, [its one program]) of one step at `batch` with `n_layers` layers."""
    m = SECOND_MODEL
    n_layers = m["n_layers"] if n_layers is None else n_layers
    everyone = tuple(range(m["n_ranks"]))
    wire = program.PARTIAL_SUM_BYTES

    def loads(mib: float) -> tuple[int, ...]:
        return program.weight_blocks(mib * MIB, m["bank_bytes"])

    layer = [*(b for mib in m["attention_mib"] for b in loads(mib)), *loads(m["pre_mib"]),
             *loads(m["router_mib"]), *loads(m["post_mib"])]
    head = program.weight_blocks(m["lm_head_bytes"], m["bank_bytes"])
    prog = program.Program(layer * n_layers + list(head), batch)
    tokens = sum(m["positions"]) / 2
    # its int4 experts at the fp8 rate, one MXU row per batch row (its report gives no spread)
    mix = ((1.0, m["expert_weights"] / m["expert_bytes"], True, 1),)

    def collective(name: str, op: str, rows: int, width: int, algorithm: str) -> None:
        prog.collective(name, op, (0,), payload_rows(rows) * width * wire, everyone,
                        algorithm=algorithm)

    pre_width, post_width = m["gather_widths"]
    expert_order = FIRST if batch <= m["defer_up_to_batch"] else QUEUED

    for _ in range(n_layers):
        prog.fetch(batch * tokens * m["kv_bytes_per_token"], 1, 1)  # the KV tiles
        prog.block(sum(len(loads(mib)) for mib in m["attention_mib"]))
        collective("o_proj", "all_reduce", batch, m["d_model"], program.RS_AG)
        prog.block(len(loads(m["pre_mib"])))
        collective("pre", "all_gather", batch, pre_width, program.ONE_SHOT)
        prog.block(len(loads(m["router_mib"])))
        prog.fetch(m["expert_bytes"], m["experts"], m["expert_slots"], mix, expert_order)
        collective("experts", "all_reduce", m["top_k"] * batch, m["expert_width"], program.RS_AG)
        prog.block(len(loads(m["post_mib"])))
        collective("post", "all_gather", batch, post_width, program.ONE_SHOT)
    prog.block(len(head))
    return prog.blocks, [prog.ops]


def simulate(batch: int, *, n_layers: int | None = None, interconnect: Any = None,
             chip: str | TimelineChip | None = None, banks: int | None = None,
             expert_slots: int | None = None, prefetch_across: bool | None = None) -> Any:
    """Its step at `batch` (a `timeline_ranks.RanksTimeline`; add SECOND_MODEL["outside_s"])."""
    m = SECOND_MODEL
    blocks, progs = programs(batch, n_layers)
    if expert_slots is not None:
        progs = [[op[:3] + (expert_slots,) + op[4:] if op[0] == "fetch" and op[2] > 1 else op
                  for op in ops] for ops in progs]
    base = interconnect or links.interconnect("tpu7x")
    inter = links.interconnect(base, slice=m["slice"])
    return simulate_programs(progs, blocks, banks or m["banks"], batch, (0,), inter, "auto",
                             chip or timeline_chip("tpu7x"), prefetch_across=prefetch_across)
