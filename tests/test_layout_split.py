"""One answer for the partial-sum mode's per-rank bytes (`mkresearch.sharding.layout_split`): the
shapes the kernel builds are the ones `layout_bytes` counts and its planned DMAs stream, a rank
skips its slices of padding only, and where the shapes hold zeros, rank by rank. (The recorded DMA log of 8 simulated ranks is held to
the same count in tests/sharded/test_partial_sum.py.)"""

import numpy as np
import pytest
from mkresearch.kernels.compose import megakernel_sharded as ms
from mkresearch.kernels.compose import schedule as step_schedule

from mkresearch.model import spec
from mkresearch.model.config import get_config
from mkresearch.prediction import scale_out
from mkresearch.sharding import layout as layouts
from mkresearch.sharding import layout_bytes
from mkresearch.sharding import layout_split as split

WEIGHTS = ("kda", "mla", "dense", "moe_nonrouted", "lm_head")  # kimi-k3's streamed components


def planned_bytes(plan, rank):
    """rank's HBM bytes per component in the partial-sum kernel's planned DMAs (`schedule` of
    one rank's build: its own weight shapes, the slices of padding it skips)."""
    planned = step_schedule.schedule(plan.mega, operands=step_schedule.rank_operands(plan),
                                     live=step_schedule.rank_live(plan, rank))
    moved: dict[str, int] = {}
    for dma in planned.events:
        name = step_schedule.component(dma) if dma.kind == "dma_start" else None
        if name is not None:
            moved[name] = moved.get(name, 0) + dma.nbytes
    return moved, planned


def test_kimi_k3_bytes_per_rank_are_the_kernels_planned_dmas():
    """Kimi K3 on 32 ranks at B = 1: the partial-sum kernel's planned DMAs stream per component
    what `layout_bytes` counts, rank 0 (real data of every matrix: the most any rank reads) and
    rank 31 (only padding of W_lu, W_ld, the router, W_qa, W_kva, the shared experts and the
    dense FFN: it skips them, no DMA of a zero-only slice); predict's bytes per rank are rank 0's: 4.94 GB (measured
    here; above the issue's 4.6 GB: see `test_kimi_k3_streamed_zeros`)."""
    cfg = get_config("kimi-k3")
    lay = layouts.layout(cfg, 32, collectives="partial-sum")
    plan = ms.make_sharded_plan(lay, 1)
    counted = layout_bytes.rank_bytes(lay, 1)
    # the unsharded layout asked for its partial-sum shapes: the same count (one answer)
    assert layout_bytes.rank_bytes(layouts.layout(cfg, 32), 1, collectives="partial-sum") \
        == counted == layout_bytes.rank_bytes(lay, 1, rank=0)
    last = layout_bytes.rank_bytes(lay, 1, rank=31)
    for rank, want in ((0, counted), (31, last)):
        moved, planned = planned_bytes(plan, rank)
        for name in WEIGHTS:
            assert moved.get(name, 0) == want.component(name), (rank, name)
    skipped = set(step_schedule.rank_live(plan, 31))
    assert not skipped & {dma.name for dma in planned.events}  # rank 31's, the last planned
    assert len(skipped) == 11  # the dense FFN's 3, MLA's W_qa and W_kva, MoE's router, W_ld,
    # W_lu and the shared experts' 3
    assert scale_out.predict(cfg, 32, "ours", 1)["rank_bytes"] == counted.total
    print(f"kimi-k3 on 32 ranks, partial-sum, B = 1: the kernel's planned weight DMAs = "
          f"layout_bytes': {counted.total / 1e9:.2f} GB per rank per step on rank 0, "
          f"{last.total / 1e9:.2f} GB on rank 31 (it skips {sorted(skipped)})")
    assert round(counted.total / 1e9, 2) == 4.94


def test_kimi_k3_streamed_zeros():
    """Where the lane-tile chunks hold zeros on 32 ranks (measured): the ranks whose slice of each
    matrix is only padding (skipped), and the padding of the rank with the most per step. A split
    finer than a lane tile would not read less: HBM holds an even split of the router's columns,
    [7168, 28] per rank, in the tiles of today's chunk [7168, 128]."""
    lay = layouts.layout(get_config("kimi-k3"), 32)
    zero_only = {z.path: len(z.zero_only) for z in split.streamed_zeros(lay)}
    assert zero_only == {"['dense']['w_down']": 2, "['dense']['w_gate']": 2,
                         "['dense']['w_up']": 2, "['mla']['w_kva']": 27, "['mla']['w_qa']": 20,
                         "['moe']['w_ld']": 4, "['moe']['w_lu']": 4, "['moe']['w_router']": 25,
                         "['moe']['w_sd']": 8, "['moe']['w_sg']": 8, "['moe']['w_su']": 8}
    worst = sum(split.zero_bytes(lay).values())
    print(f"kimi-k3 on 32 ranks: ranks holding only padding, per matrix: {zero_only}; the rank "
          f"with the most holds {worst / 1e9:.2f} GB of padding per step (skipped)")
    assert round(worst / 1e9, 2) == 1.66
    assert split.tiled_nbytes((7168, 28), np.dtype("bfloat16")) \
        == split.tiled_nbytes((7168, 128), np.dtype("bfloat16"))
    assert split.tiled_nbytes((28, 7168), np.dtype("bfloat16")) \
        < split.tiled_nbytes((128, 7168), np.dtype("bfloat16"))


@pytest.mark.parametrize("model, zero_only_ranks", [("deepseek-v3", 27), ("glm-4.5", 20),
                                                    ("qwen3-235b-a22b", 0)])
def test_other_families_streamed_zeros(model, zero_only_ranks):
    """The three other families on 32 ranks: the most ranks streaming only padding of one matrix
    (DeepSeek-V3's W_kva: 576 columns, 4.5 lane tiles; GLM-4.5's shared experts: 1,536 hidden,
    12 lane tiles; Qwen3 has no shared expert and pads only the vocabulary's last tile)."""
    lay = layouts.layout(get_config(model), 32)
    zeros = split.streamed_zeros(lay)
    assert max((len(z.zero_only) for z in zeros), default=0) == zero_only_ranks
    for z in zeros:  # the shapes are the kernel's: what layout_bytes counts
        param = dict(layouts.leaves_with_path(spec.param_table(lay.cfg)))[z.path]
        assert split.partial_sum_shape(lay, param) == z.local


def test_refuses_a_non_layout():
    with pytest.raises(ValueError, match="lay="):
        split.partial_layout("kimi-k3")
