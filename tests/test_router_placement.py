"""The router's placements (`MegakernelOptions.router_placement`, `layout.place_router`): the
option's checks and repr, the layout's per-rank router bytes, the kernel's collectives as data
(`collective_ops`), without running a step (those: tests/sharded/test_router_placement.py, in
the 8-device child of tests/test_sharded.py)."""

import pytest
from mkresearch.kernels.compose import megakernel_sharded as ms
from mkresearch.kernels.compose.megakernel_plan import MegakernelOptions
from mkresearch.kernels.sharded import collective_ops
from mkresearch.kernels.sharded import plan as sharding
from mkresearch.kernels.stages.experts import LATENT_DOWN
from mkresearch.kernels.stages.router import W_ROUTER

from mkresearch.model import spec
from mkresearch.model.config import get_config
from mkresearch.sharding import layout, layout_bytes

KIMI = get_config("kimi-k3")
MINI_E256 = get_config("kimi-k3-mini").replace(name="kimi-k3-mini-4l-e256", n_layers=4,
                                                n_experts=256)


def _lay(cfg=KIMI, n=32):
    return layout.layout(cfg, n, collectives=layout.PARTIAL_SUM)


@pytest.mark.parametrize("placement", ["nowhere", "", None, "Split"])
def test_a_bad_placement_is_refused_naming_the_option(placement):
    options = MegakernelOptions(router_placement=placement)
    with pytest.raises(ValueError, match=r"router_placement=.* is invalid: one of \('split', "
                                         r"'host', 'sibling', 'replicated'\)"):
        ms.make_sharded_plan(_lay(MINI_E256, 8), 1, options=options)
    with pytest.raises(ValueError, match="router_placement=.* is invalid"):
        layout.place_router(_lay(MINI_E256, 8), placement)


def test_hosts_that_do_not_divide_the_ranks_are_refused():
    with pytest.raises(ValueError, match="ranks_per_host=3 is invalid for router_placement="
                                         "'host' on 8 ranks"):
        layout.place_router(_lay(MINI_E256, 8), layout.ROUTER_HOST, 3)


def test_the_option_is_out_of_the_repr_unless_set():
    """Recorded compiles keep their fingerprints: "split" shows nowhere, another placement does."""
    assert "router" not in repr(MegakernelOptions())
    assert "router_placement='host'" in repr(MegakernelOptions(router_placement="host"))
    lay = _lay(MINI_E256, 8)
    assert "router_ways" not in repr(lay)
    assert repr(layout.place_router(lay)) == repr(lay)
    assert "router='sibling', router_ways=2" in repr(layout.place_router(lay,
                                                                        layout.ROUTER_SIBLING))
    plan = ms.make_sharded_plan(lay, 1)
    assert "router_ways" not in repr(plan.layout)
    assert [c.name for c in plan.shard.channels] == ["all"]


@pytest.mark.parametrize("placement, ways", [
    (layout.ROUTER_SPLIT, 32), (layout.ROUTER_HOST, 8), (layout.ROUTER_SIBLING, 2),
    (layout.ROUTER_REPLICATED, 1)])
def test_each_rank_holds_the_routers_columns_over_its_group(placement, ways):
    """Kimi K3's 896 router columns: 128 per rank split (32 ways) and on a host of 8, 512 on a
    sibling pair, all 896 replicated; the bytes per rank grow accordingly."""
    lay = layout.place_router(_lay(), placement, 8)
    assert lay.router == placement
    router = next(p for _, p in layout.leaves_with_path(spec.param_table(KIMI)) if p.router)
    cols = layout.local_shape(lay, router.shape, layout.param_shard(lay, router))[-1]
    assert cols == {32: 128, 8: 128, 2: 512, 1: 896}[ways]
    split = layout_bytes.rank_bytes(_lay(), 1).total
    placed = layout_bytes.rank_bytes(lay, 1).total
    moe = len(KIMI.moe_layers)
    extra = moe * 7168 * (cols - 128) * 2  # bf16 columns beyond the split's chunk
    assert extra <= placed - split <= extra + moe * 7168 * 128 * 2, (placement, placed - split)


def test_the_collectives_of_each_placement():
    """split: one fused gather of scores and latent over every rank before top-k; host, sibling:
    the scores among the group, waited before W_ld's product, the latent over every rank waited
    at the first expert; replicated: no scores gather."""
    for placement, group in ((layout.ROUTER_SPLIT, None), (layout.ROUTER_HOST, 8),
                             (layout.ROUTER_SIBLING, 2), (layout.ROUTER_REPLICATED, 1)):
        lay = layout.place_router(_lay(), placement, 8)
        for rank in (0, 13):
            ops = [op for op in collective_ops.collective_ops(sharding.sharding_plan(lay, 1),
                                                              rank=rank)
                   if op.layer == KIMI.moe_layers[0] and op.stage == "moe"]
            names = [op.name for op in ops]
            if group is None:
                assert names[0] == f"{W_ROUTER}+{LATENT_DOWN}"
                assert ops[0].wait_before == collective_ops.EXPERTS
                continue
            latent = next(op for op in ops if op.name == LATENT_DOWN)
            assert latent.group == tuple(range(32))
            assert latent.wait_before == collective_ops.FIRST_EXPERT
            scores = [op for op in ops if op.name == W_ROUTER]
            if group == 1:
                assert not scores
                continue
            first = rank // group * group
            assert scores[0].group == tuple(range(first, first + group))
            assert scores[0].wait_before == LATENT_DOWN
            assert names.index(W_ROUTER) < names.index(LATENT_DOWN)
            assert scores[0].payload_bytes == 4 * -(-896 // group // 128) * 128


def test_the_plan_places_the_layout_and_refuses_a_clash():
    options = MegakernelOptions(router_placement="host", ranks_per_host=4)
    plan = ms.make_sharded_plan(_lay(MINI_E256, 8), 1, options=options)
    assert (plan.layout.router, plan.layout.router_ways) == ("host", 4)
    assert [c.name for c in plan.shard.channels] == ["all", sharding.ROUTER_CHANNEL]
    assert ms.make_sharded_plan(plan.layout, 1, options=options).layout == plan.layout
    with pytest.raises(ValueError, match="the layout is placed by the options"):
        ms.make_sharded_plan(plan.layout, 1, options=MegakernelOptions(
            router_placement="sibling"))
