"""The sharded megakernel on the other families' minis (DeepSeek-V3: MLA with RoPE; GLM-4.5 and
Qwen3: GQA; all three: MoE on the full d) on simulated devices, against the single-device
megakernel: `test_sharded_decode.run`'s checks (tokens and logits equal to the bit, every rank's
slice of every cache equal to the bit, logits within 5e-2 of the reference), and each rank's DMA'd
HBM bytes per component against `layout_bytes.rank_bytes`.

Cases (cheap: 2 greedy steps each; interpret mode grows with the ranks): DeepSeek-V3 on 2 ranks
(a head each, EP 2) at B = 2; GLM-4.5 on 2 ranks as ETP 2 (every expert's hidden and output
columns split over both; 2 query heads and their K/V head on each rank); Qwen3 on 8 ranks (its 4
query heads each on 2 ranks, its one K/V head replicated on all 8) with a vocabulary of 1920
rows: 8 shards of 256, the last one's 128 padding rows masked out of sampling.
"""

import jax
import numpy as np
import pytest
from test_sharded_decode import PROMPT_LEN, run, show  # noqa: F401 - the same steps and checks

from mkresearch.measurement import logs
from mkresearch.model import config, spec, weights
from mkresearch.sharding import layout, layout_bytes

CASES = {  # name: (config, ranks, batch, etp)
    "deepseek-v3": (config.get_config("deepseek-v3-mini"), 2, 2, None),
    "glm-4.5": (config.get_config("glm-4.5-mini"), 2, 1, 2),
    "qwen3-235b-a22b": (config.get_config("qwen3-235b-a22b-mini", vocab_size=1920), 8, 1, None),
}
STEPS = 2
# DMA-log names are the kernels' (MLA with RoPE keeps MLA's): the roofline component they count in
LOGGED_AS = {"mla_rope": "mla", "mla_rope_cache": "mla_cache"}


@pytest.mark.parametrize("family", list(CASES))
def test_family_sharded_equals_single_device(race_checked, family):
    cfg, n_ranks, batch, etp = CASES[family]
    params = weights.init_params(cfg, 0)
    report, recorded = run(params, n_ranks, batch, STEPS, etp=etp, record=True, cfg=cfg)
    show(f"{cfg.name} on {n_ranks} ranks", report)
    assert report["pallas_calls"] == 1 and report["equal_slices"] == report["slices"] > 0
    lay = layout.layout(cfg, n_ranks, etp=etp)
    if family == "qwen3-235b-a22b":
        assert lay.local_length(spec.VOCAB, cfg.vocab_size) * n_ranks > cfg.vocab_size  # padded
    check_bytes(lay, batch, recorded[0], report["expert_ids"])


def check_bytes(lay, batch, log, expert_ids):
    """Per rank: the log's HBM weight bytes by component equal the layout's (the norm gains read
    as f32 rows beside), the routed experts = this rank's distinct experts x one expert's slice."""
    cfg = lay.cfg
    counted = layout_bytes.rank_bytes(lay, batch)
    kind = next(k for k in cfg.ffn_kinds if spec.stage(k).routed)
    experts = layout.rank_param_shapes(lay)[kind]["experts"]
    leaves = jax.tree.leaves(experts)
    per_expert = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves) // int(
        np.prod(leaves[0].shape[:2]))
    local = cfg.n_experts // lay.ep
    table = spec.param_table(cfg)
    widened = sum(int(np.prod(table[name].shape)) * 2 for name in ("attn_norm", "mlp_norm"))
    # the router bias is counted by the layout but read only with cfg.router_bias (as on one
    # device: schedule_report.DIFFERENCES)
    unread = 0 if cfg.router_bias else int(np.prod(table[kind]["router_bias"].shape)) * 4
    weight_parts = [name for name in counted.components
                    if name not in counted.state_components
                    and name not in ("routed_experts", "embedding_rows", "norms_and_mix")]
    for rank in log.ranks:
        moved = logs.hbm_bytes_by_component(log.of_rank(rank))
        for name in weight_parts:
            got = moved.get(LOGGED_AS.get(name, name), 0)
            want = counted.component(name) - (unread if name == "moe_nonrouted" else 0)
            assert got == want, (rank, name, got, want)
        assert moved["norms_and_mix"] == counted.component("norms_and_mix") + widened
        group = lay.split(spec.EXPERTS).index(rank)
        mine = [len({e for e in np.unique(layer) if group * local <= e < (group + 1) * local})
                for layer in expert_ids]
        assert moved.get("routed_experts", 0) == sum(mine) * per_expert, (rank, mine)
        assert moved.get("other", 0) == 0 and log.of_rank(rank).remote_bytes() > 0
    weights_rank0 = sum(counted.component(n) for n in weight_parts)
    print(f"{cfg.name}: every rank's weights = the layout's ({weights_rank0:,d} B on rank 0: "
          f"{', '.join(weight_parts)}) + {widened:,d} B of norm gains read as f32; routed experts "
          f"= its distinct experts x {per_expert:,d} B")
