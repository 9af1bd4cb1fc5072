"""Expert reads first (`MegakernelOptions.expert_reads_first`, issue 46 item 4): once routing is
known, the routed experts' first DMAs are issued ahead of the weight ring's prefetches of the
blocks after the routing point (the ring holds them back, `weight_stream.StageStream.hold_after`).

Read from the step's schedule, which is the kernel itself run on shapes (`kernels/compose/
schedule.py`): Kimi K3's full widths on one rank of 32 (two layers, so that it takes seconds),
where the ring (24 slots of 2 MiB) would otherwise have W_lu's and the shared experts' blocks
queued ahead of the experts. The prefetches the attention stage issued before the MoE stage began
are out of reach (they are in flight before routing starts): the held ones are those the MoE stage
itself would issue before its experts.
"""

import pytest
from cuts import kimi_kinds
from mkresearch.kernels.base import planned
from mkresearch.kernels.compose import megakernel_sharded as ms
from mkresearch.kernels.compose import schedule
from mkresearch.kernels.compose.megakernel_plan import MegakernelOptions, check_options
from mkresearch.kernels.stages import experts, router

from mkresearch.model import config
from mkresearch.sharding import layout

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

BEFORE_ROUTING = (router.W_ROUTER, experts.LATENT_DOWN)  # what a rank streams before top-k


def queued_before_experts(expert_reads_first: bool) -> dict[int, list[str]]:
    """{MoE layer: the ring blocks past its routing point that the MoE stage starts before its
    first expert DMA} on rank 0 of Kimi K3's 2-layer cut on 32 ranks (restructured)."""
    cfg = kimi_kinds(config.get_config("kimi-k3"))
    lay = layout.layout(cfg, 32, collectives=layout.RESTRUCTURED)
    options = ms.kernel_options(lay, 1, expert_reads_first=expert_reads_first)
    events = schedule.schedule(ms.make_sharded_plan(lay, 1, options=options), rank=0).events
    out = {}
    for layer in cfg.moe_layers:
        begun = next(i for i, e in enumerate(events)  # the MoE stage's first block consumed
                     if e.kind == "dma_wait" and e.layer == layer and e.stage == "moe")
        first = next(i for i, e in enumerate(events)
                     if e.kind == "dma_start" and e.name.startswith(experts.EXPERT_DMA_PREFIX)
                     and i > begun)
        out[layer] = [e.name for e in events[begun:first]
                      if e.kind == "dma_start" and e.buffer == planned.WEIGHT_RING
                      and not (e.layer == layer and e.name in BEFORE_ROUTING)]
    return out


@pytest.mark.slow  # two schedules of a full-width 2-layer cut: ~40 s quiet, 150 s on a loaded machine
def test_expert_reads_go_ahead_of_the_rings_prefetches():
    """With the option, after top-k no ring prefetch past the routing point is issued before the
    experts' first reads; without it, W_lu's and the shared experts' blocks are."""
    held = queued_before_experts(True)
    queued = queued_before_experts(False)
    print(f"ring blocks past the routing point issued before the first expert read, per MoE "
          f"layer: {({k: len(v) for k, v in queued.items()})} without the option, "
          f"{({k: len(v) for k, v in held.items()})} with it")
    assert held and all(not names for names in held.values()), held
    assert all(names for names in queued.values()), queued


def test_expert_reads_first_is_a_bool():
    cfg = config.get_config("kimi-k3-mini")
    with pytest.raises(ValueError, match="expert_reads_first=1 is invalid: True or False"):
        check_options(MegakernelOptions(expert_reads_first=1), cfg)
