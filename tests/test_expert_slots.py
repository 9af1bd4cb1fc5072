"""Expert slots (`MegakernelOptions.expert_slots`: VMEM slots per expert matrix; issue 46): the
routed experts' reads the kernel keeps in flight, as the scale-out model prices them
(`timeline._fetch`: `slots` reads issued at routing, the next one issued once the expert before
it is multiplied, so n - 1 reads fly while one is multiplied).

Read from the step's schedule, the kernel itself run on shapes (`kernels/compose/schedule.py`):
kimi-k3-mini at B = 8, every one of its 16 experts routed in each MoE layer (the worst case),
with 2, 3 and 5 slots.
"""

import pytest
from mkresearch.kernels.compose import schedule
from mkresearch.kernels.compose.megakernel_plan import (
    EXPERT_SLOTS,
    MegakernelOptions,
    check_options,
    make_plan,
)
from mkresearch.kernels.stages import experts

from mkresearch.model import config

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu


def items_in_flight(n_slots: int) -> dict[int, list[tuple[int, list[int]]]]:
    """{MoE layer: [(item i, the items started and not yet waited for at item i's first wait)]}
    of kimi-k3-mini's worst-case schedule at B = 8 with n_slots slots per expert matrix."""
    cfg = config.get_config("kimi-k3-mini")
    plan = make_plan(cfg, 8, cfg.max_seq_len, MegakernelOptions(expert_slots=n_slots))
    out: dict[int, list] = {}
    started: dict[int, set[int]] = {}
    for e in schedule.schedule(plan).events:
        if not e.name.startswith(experts.EXPERT_DMA_PREFIX):
            continue
        item, flying = dict(e.indices)["item"], started.setdefault(e.layer, set())
        if e.kind == "dma_start":
            flying.add(item)
        elif item in flying:  # its first part waited for: the item is about to be multiplied
            out.setdefault(e.layer, []).append((item, sorted(flying)))
            flying.discard(item)
    return out


@pytest.mark.parametrize("n_slots", [2, 3, 5])
def test_n_slots_keep_n_reads_in_flight_at_each_wait(n_slots):
    """At item i's wait the items i .. i + n - 1 (as many as remain) have been started and no
    later one: while item i is multiplied, the next n - 1 reads move."""
    layers = items_in_flight(n_slots)
    cfg = config.get_config("kimi-k3-mini")
    assert sorted(layers) == list(cfg.moe_layers)
    for layer, waits in layers.items():
        n_items = len(waits)
        assert n_items == cfg.n_experts, (layer, n_items)  # the worst case: every expert
        for i, (item, flying) in enumerate(waits):
            assert item == i
            assert flying == list(range(i, min(i + n_slots, n_items))), (layer, i, flying)


def test_expert_slots_the_megakernel_takes():
    cfg = config.get_config("kimi-k3-mini")
    assert EXPERT_SLOTS == tuple(range(2, experts.MAX_SLOTS + 1))
    for bad in (1, experts.MAX_SLOTS + 1):
        with pytest.raises(ValueError, match=rf"expert_slots={bad} is invalid|n_slots={bad} is"):
            check_options(MegakernelOptions(expert_slots=bad), cfg)
