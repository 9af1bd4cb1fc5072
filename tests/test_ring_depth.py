"""Partial-sum mode deepens each rank's global weight ring as far as VMEM allows
(`megakernel_sharded.ring_depth`): more weight blocks keep HBM busy while a collective is waited
for. One function decides the depth; the kernel's plan and the prediction both read it."""

import pytest
from mkresearch.kernels.compose import megakernel_sharded as ms
from mkresearch.kernels.compose.megakernel_plan import VmemPlanError

from mkresearch.cli import main as cli
from mkresearch.model.config import get_config
from mkresearch.prediction import scale_out
from mkresearch.sharding import layout as layouts


def _layout(model: str, collectives: str = "partial-sum", **overrides) -> layouts.Layout:
    return layouts.layout(get_config(model, **overrides), 32, layouts.OURS,
                          collectives=collectives)


@pytest.mark.parametrize("model, batch", [("kimi-k3", 1), ("kimi-k3", 8), ("glm-4.5", 1)])
def test_the_ring_is_the_deepest_that_fits_vmem(model, batch):
    """The chosen depth's whole VMEM plan (the kernel's, shard buffers included) fits with
    `ring_vmem_spare_bytes(batch)` to spare; one slot more would not (or the depth is at its
    cap); never below PARTIAL_SUM_RING_DEPTH."""
    lay = _layout(model)
    ring = ms.ring_depth(lay, batch)
    plan = ms.make_sharded_plan(lay, batch)
    vmem = plan.mega.vmem
    deeper = ms.rank_vmem(lay, batch, ring.depth + 1)
    budget = vmem.limit_bytes - ms.ring_vmem_spare_bytes(batch)
    print(f"{model} B={batch}: {ring.describe()}; {vmem.total_bytes / 2**20:.2f} MiB, one slot "
          f"more {deeper.total_bytes / 2**20:.2f} MiB of {vmem.limit_bytes / 2**20:.0f}")
    assert plan.mega.stream.depth == plan.mega.cfg.ring_depth == ring.depth
    assert ring.depth > ms.PARTIAL_SUM_RING_DEPTH  # every one of these has room past the floor
    assert vmem.total_bytes == ms.rank_vmem(lay, batch, ring.depth).total_bytes <= budget
    assert deeper.total_bytes > budget and "the deepest within VMEM" in ring.reason


@pytest.mark.slow  # ~10 s: full-size VMEM traces at several depths
def test_kernel_plan_and_prediction_read_one_depth(capsys):
    """At each batch the prediction's ring (banks + 1) is the kernel plan's, built with the
    reductions its sharding plan chooses for the slice (`megakernel_sharded.kernel_options`: their
    level buffers take VMEM), and `predict` and `plan --ranks` say the depth and why."""
    cfg = get_config("kimi-k3")
    lay = _layout("kimi-k3")
    rings = {}
    for batch in (1, 8):
        options = ms.kernel_options(lay, batch)
        rings[batch] = ms.ring_depth(lay, batch, options=options)
        depth = ms.make_sharded_plan(lay, batch, options=options).mega.stream.depth
        row = scale_out.predict(cfg, 32, "ours", batch)
        assert row["schedule"]["banks"] + 1 == depth == rings[batch].depth
        assert row["schedule"]["ring"] == rings[batch].describe()
        assert row["schedule"]["reductions"] == options.reductions
    sixteen = ms.ring_depth(lay, 16, options=ms.kernel_options(lay, 16)).depth
    assert rings[1].depth >= rings[8].depth > sixteen  # less VMEM left as the rows grow
    assert cli.main(["predict", "kimi-k3", "--ranks", "32", "--batch", "1", "--rank-layout",
                     "ours"]) == 0
    assert f"ours B=1: {rings[1].describe()}" in capsys.readouterr().out
    assert cli.main(["plan", "kimi-k3", "--ranks", "32"]) == 0
    assert f"{rings[1].describe()}; " in capsys.readouterr().out


def test_exact_mode_and_mini_shapes_keep_their_depth():
    """Exact mode keeps cfg.ring_depth; a mini's ring stays at the lookahead's cap (its shortest
    stage + 1), as before the ring was deepened."""
    assert ms.ring_depth(_layout("kimi-k3", "exact"), 1).depth == get_config("kimi-k3").ring_depth
    mini = layouts.layout(get_config("kimi-k3-mini"), 8, layouts.OURS, collectives="partial-sum")
    ring = ms.ring_depth(mini, 3)
    assert ring.depth == 4 and "the lookahead's cap" in ring.reason
    assert ms.make_sharded_plan(mini, 3).mega.stream.depth == 4


def test_a_floor_over_vmem_is_refused_with_the_plan():
    """If even PARTIAL_SUM_RING_DEPTH slots do not fit, the floor stays and the plan is refused,
    listing its buffers."""
    lay = _layout("kimi-k3", ring_block_bytes=8 * 2**20)  # 8 slots of 7 MiB
    assert ms.ring_depth(lay, 1).depth == ms.PARTIAL_SUM_RING_DEPTH
    with pytest.raises(VmemPlanError, match=r"(?s)VMEM plan needs.*weight ring +\[8, "):
        ms.make_sharded_plan(lay, 1)
