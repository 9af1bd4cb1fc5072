"""Two microbatches on one core (`prediction.microbatches`, a what-if): how their programs
interleave, and the weight ring's held blocks (`("hold", n)`, `("again", n)`) in the timeline
simulator. Kimi K3's numbers are in tests/test_scale_out_designs.py (beside the designs' cache)."""

import pytest

from mkresearch.model.config import get_config
from mkresearch.prediction import microbatches
from mkresearch.prediction import timeline as tl

MIB = 2**20
SUM = ("start", "sum", "all_reduce", (0, 8), (0, 8), 4096, True, "rs-ag", True, 0)
EARLY = ("start", "gather", "all_gather", (0, 8), (0, 8), 1024, False, "one-shot", True, 0)


def _run(ops, blocks, banks=4) -> tl.RankSimulation:
    sim = tl.RankSimulation(ops, "tpu7x", blocks=blocks, banks=banks, batch=1)
    for request in sim.run():  # a program without collectives yields none
        raise AssertionError(request)
    return sim


def _renamed(op, suffix, blocking=None):
    op = (op[0], op[1] + suffix, *op[2:])
    return op if blocking is None else (*op[:6], blocking, *op[7:])


def test_two_programs_alternate_segment_by_segment():
    """Each microbatch's blocking collective is started without waiting; the other's segment runs
    meanwhile on the same blocks (held, then multiplied again); each collective is waited for
    before its own microbatch goes on; a collective already started early keeps its place."""
    first = [("blocks", 2), EARLY, SUM, ("fetch", 1e6, 3, 2), ("wait", "gather"), ("blocks", 1)]
    second = [("blocks", 2), EARLY, SUM, ("fetch", 1e6, 5, 2), ("wait", "gather"), ("blocks", 1)]
    ops = microbatches.interleave(first, second)
    a, b = microbatches.FIRST, microbatches.SECOND
    assert ops == [
        ("hold", 2), ("blocks", 2), _renamed(EARLY, a), _renamed(SUM, a, blocking=False),
        ("again", 2), _renamed(EARLY, b), _renamed(SUM, b, blocking=False), ("wait", "sum" + a),
        ("fetch", 1e6, 3, 2), ("wait", "gather" + a), ("hold", 1), ("blocks", 1),
        ("wait", "sum" + b), ("fetch", 1e6, 5, 2), ("wait", "gather" + b), ("again", 1)]
    assert not [op for op in ops if op[0] == "start" and op[microbatches.BLOCKING]]
    with pytest.raises(ValueError, match="must meet the same"):
        microbatches.interleave(first, second[:2])


def test_held_blocks_are_read_once_and_multiplied_twice():
    """A block multiplied again costs the MXU its push a second time, not its bytes again; held,
    it stays in VMEM beside the ring (`held_peak_bytes`), which refills its slot meanwhile."""
    blocks = [2 * MIB] * 6
    once = _run([("blocks", 6)], blocks)
    twice = _run(microbatches.interleave([("blocks", 6)], [("blocks", 6)]), blocks)
    assert twice.dma_bytes == once.dma_bytes == sum(blocks)
    assert twice.flops == 2 * once.flops
    assert twice.ends == once.ends  # the ring streams as if the blocks were freed
    mxu = sum(blocks) * once.per_byte_bf16
    assert twice.total == pytest.approx(once.total + mxu, rel=1e-12)
    assert twice.held_peak_bytes == sum(blocks) and not twice.held

    sizes = [MIB, 2 * MIB, 3 * MIB, 4 * MIB, 5 * MIB]
    split = _run([("hold", 2), ("blocks", 3), ("again", 1), ("hold", 2), ("blocks", 2)], sizes)
    # held: blocks 0 and 1 (3 MiB), block 0 multiplied again, then blocks 3 and 4 beside 1
    assert list(split.held) == [1, 3, 4] and split.held_bytes == 11 * MIB
    assert split.held_peak_bytes == 11 * MIB
    assert split.flops == sum(sizes) + MIB
    with pytest.raises(ValueError, match=r"\('again', 3\): only 2 blocks are held"):
        _run([("hold", 2), ("blocks", 2), ("again", 3)], blocks)


@pytest.mark.parametrize("batch", [1, 3, 2.0, True])
def test_two_microbatches_need_an_even_batch(batch):
    with pytest.raises(ValueError, match=r"batch=.* is invalid: an even int >= 2"):
        microbatches.two_microbatch_step(get_config("kimi-k3-mini"), 2, batch)
