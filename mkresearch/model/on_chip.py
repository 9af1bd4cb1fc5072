"""Real-size configs cut to fill one device of a chip: `get_config("<model>-on-<chip>")`.

A model of real size with random weights is what a benchmark on one chip should stream (a mini's
step is latency-bound). `ON_CHIP` names the ones this package measures on a v5e (Colab's free
TPU, 16 GiB of HBM, 15.75 of them usable): each is its model's own layer shapes, widths and
expert format, with as many of its layers as fit one device at FIT_BATCH rows of FIT_CONTEXT
tokens (`fill_one_device`, from `roofline.hbm_footprint`: weights, caches and states), leaving
HEADROOM for what XLA and the kernel allocate beside them.

    moonlight-16b-a3b-on-v5e   Moonlight-16B-A3B with MXFP4 experts: all 27 layers
    qwen3-30b-a3b-on-v5e       Qwen3-30B-A3B's layers (bf16, as published): 11 of 48
    kimi-k3-rank-on-v5e        one of the release's 32 ranks of Kimi K3 (28 of 896 experts a
                               layer, MXFP4): 24 of 93 layers
"""

from __future__ import annotations

from typing import Any

from mkresearch.hardware.chips import get_chip
from mkresearch.model.model_config import ModelConfig

# name -> (the config it cuts, the chip, field overrides before cutting)
ON_CHIP: dict[str, tuple[str, str, dict[str, Any]]] = {
    "moonlight-16b-a3b-on-v5e": ("moonlight-16b-a3b", "v5e", {"expert_format": "mxfp4"}),
    "qwen3-30b-a3b-on-v5e": ("qwen3-30b-a3b", "v5e", {}),
    "kimi-k3-rank-on-v5e": ("kimi-k3-rank", "v5e", {}),
}
FIT_BATCH = 8
FIT_CONTEXT = 4096
# the cache holds the context and 256 tokens more (a benchmark's steps after it), whole KV tiles
FIT_SEQ_LEN = FIT_CONTEXT + 256
# beside the weights and states: XLA's and the kernel's own buffers (a v5e reports 15.75 of its
# 16 GiB usable to JAX; the jitted reference's temporaries are tens of MB, tests/test_agreement.py)
HEADROOM = 1 << 30


def fill_one_device(cfg: ModelConfig, chip: str, name: str) -> ModelConfig:
    """cfg with the most of its layers (from the first: the layer pattern kept) whose HBM
    footprint at FIT_BATCH rows of FIT_SEQ_LEN tokens fits one `chip` device less HEADROOM,
    called `name`. ValueError in one line if not even the smallest valid cut fits."""
    from mkresearch.model import roofline  # it imports the configs' module, which imports this

    budget = get_chip(chip).hbm_bytes - HEADROOM
    best = None
    for n_layers in range(1, cfg.n_layers + 1):
        try:
            cut = cfg.replace(name=name, n_layers=n_layers, max_seq_len=FIT_SEQ_LEN)
        except ValueError:  # too few layers for the family's pattern (dense first, MLA every k)
            continue
        if roofline.hbm_footprint(cut, chip, FIT_BATCH).needed > budget:
            break
        best = cut
    if best is None:
        raise ValueError(f"{name}: not one layer of {cfg.name} fits one {chip} device at batch "
                         f"{FIT_BATCH} x {FIT_SEQ_LEN} tokens ({budget:,d} B of HBM less headroom)")
    return best
