"""How one streamed matrix of a stage runs on a rank of the sharded megakernel (`Rule`): what is
gathered before and after it, whether its products are partial sums reduced, and which other
collective its values travel in. `kernels/compose/collective_schedule.collective_rules` makes
them from the layout; `collectives.ShardPlan.rules` holds them for the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """How one streamed matrix runs on a rank: its input gathered over `gather` first (to its
    whole `k` columns), its output's column chunks gathered over `out` after (to `n`)."""

    name: str  # DMA-log name
    out: str | None
    n: int
    gather: str | None
    k: int
    reduce: str | None = None  # partial-sum: rows split by this group, the products all-reduced
    # partial-sum: the output's column chunks travel in the messages of this later reduction of
    # the stage (a matrix whose whole output is needed only at the stage's end: W_lu), not alone
    rides: str | None = None
    # partial-sum: the output's column chunks travel in the gather of this later matrix of the
    # stage, computed from the same input (the router's with W_ld's, W_qa's with W_kva's): one
    # all-gather carries both (`sharded_stream.ShardedStream.matmuls`)
    joins: str | None = None
    # partial-sum: the stage output (its `settle` key) whose partial sums are added to this
    # matrix's before its one reduction (routed experts on the full d into the shared experts')
    adds: str | None = None


def expert_sum_merged(rules: tuple[Rule, ...] | list[Rule]) -> bool:
    """Whether the routed experts' partial sums travel in another matrix's reduction
    (`Rule.adds`): then they have no reduction ("expert/sum") of their own."""
    return any(rule.adds for rule in rules)
