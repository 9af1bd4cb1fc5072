"""Real-size configs cut to fill one device of a chip: `get_config("<model>-on-<chip>")`.

A model of real size with random weights is what a benchmark on one chip should stream (a mini's
step is latency-bound). `ON_CHIP` names the ones this package measures on a v5e (Colab's free
TPU, 16 GiB of HBM, 15.75 of them usable): each is its model's own layer shapes, widths and
expert format, with its first `n_layers` layers: the most that fit one device at FIT_BATCH rows
of FIT_SEQ_LEN tokens (weights, caches and states), leaving HEADROOM for what XLA and the kernel
allocate beside them (`roofline.most_layers_that_fit` finds them; tests/test_on_chip.py holds
each count to it).

    moonlight-16b-a3b-on-v5e   Moonlight-16B-A3B with MXFP4 experts: all 27 layers
    qwen3-30b-a3b-on-v5e       Qwen3-30B-A3B's layers (bf16, as published): 11 of 48
    kimi-k3-rank-on-v5e        one of the release's 32 ranks of Kimi K3 (28 of 896 experts a
                               layer, MXFP4): 24 of 93 layers (a whole Kimi K3 layer, 19 GB in
                               MXFP4, fits no v5e)
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mkresearch.model.model_config import ModelConfig


class OnChip(NamedTuple):
    base: str  # the config it cuts (a get_config name)
    chip: str  # the chip whose one device it fills
    overrides: dict[str, Any]  # field overrides of the base (e.g. the expert format)
    n_layers: int  # its first layers kept


ON_CHIP: dict[str, OnChip] = {
    "moonlight-16b-a3b-on-v5e": OnChip("moonlight-16b-a3b", "v5e", {"expert_format": "mxfp4"}, 27),
    "qwen3-30b-a3b-on-v5e": OnChip("qwen3-30b-a3b", "v5e", {}, 11),
    "kimi-k3-rank-on-v5e": OnChip("kimi-k3-rank", "v5e", {}, 24),
}
FIT_BATCH = 8
FIT_CONTEXT = 4096
# the cache holds the context and 256 tokens more (a benchmark's steps after it), whole KV tiles
FIT_SEQ_LEN = FIT_CONTEXT + 256
# beside the weights and states: XLA's and the kernel's own buffers (a v5e reports 15.75 of its
# 16 GiB usable to JAX; the jitted reference's temporaries are tens of MB, tests/test_agreement.py)
HEADROOM = 1 << 30


def cut(cfg: ModelConfig, name: str) -> ModelConfig:
    """cfg (the base with its overrides, and any the caller gives: the layer count stays the
    one that fits the named format) as `name`: its first ON_CHIP[name].n_layers layers, a cache
    of FIT_SEQ_LEN tokens."""
    return cfg.replace(name=name, n_layers=ON_CHIP[name].n_layers, max_seq_len=FIT_SEQ_LEN)
