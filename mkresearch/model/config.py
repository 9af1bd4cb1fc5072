"""Model configurations by name: `get_config(name, **overrides)`, the one place a config is had by
its name, and `config_names()`, every name it takes:

  presets         `kimi-k3` (docs/kimi-k3.md §1) and the other families of docs/families.md
                  (`deepseek-v3`, `glm-4.5`, `qwen3-235b-a22b`, `gpt-oss-20b`,
                  `gpt-oss-120b`), each with a `-mini` that keeps
                  every feature of its family (`model_config.PRESETS`)
  '<preset>-rank' one of the release's 32 ranks of a full-size preset (docs/kimi-k3.md §9), derived from the
                  kinds' sharding rules, never typed in (`partition.rank_config`): a
                  single-device stand-in for compiling, not our full-size step
  published       the small real models' config.json fields (`published.PUBLISHED`:
                  `qwen3-30b-a3b`, `glm-4.5-air`, `moonlight-16b-a3b`, `kimi-linear-48b-a3b`)
  '<model>-on-<chip>'  a real-size model's layers, as many as fill one device of the chip
                  (`on_chip.ON_CHIP`: Moonlight-16B-A3B, Qwen3-30B-A3B and one Kimi K3 rank on
                  a v5e), for benchmarks on that chip

The dataclass and the presets are `mkresearch.model.model_config` (re-exported here: the names
the rest of the package imports from this module); this module sits above the split arithmetic
and the published configs in the model layer, so that one function serves every name.
"""

from __future__ import annotations

from typing import Any

from mkresearch.model import on_chip, partition, published
from mkresearch.model.model_config import (  # noqa: F401 - re-exported: the config's API
    ACTIVATIONS,
    BF16_SUBLANE,
    DEEPSEEK_V3,
    DEEPSEEK_V3_MINI,
    DENSE_THEN,
    DENSE_THEN_MOE,
    EXPERT_FORMATS,
    EXPERT_MXU_INPUTS,
    FP8_BLOCK,
    GLM_4_5,
    GLM_4_5_MINI,
    GPT_OSS_20B,
    GPT_OSS_120B,
    GPT_OSS_MINI,
    KDA_DECAYS,
    KIMI_ATTENTION,
    KIMI_K3,
    KIMI_K3_MINI,
    KIND_CYCLE,
    LANE,
    MLA_CACHE_LAYOUTS,
    MXFP4_BLOCK,
    PATTERN_LETTERS,
    PRESETS,
    QWEN3_235B,
    QWEN3_235B_MINI,
    RESIDUALS,
    RING_BLOCK_MULTIPLE,
    RING_MAX_DEPTH,
    ROUTER_SCORES,
    ModelConfig,
    layer_pattern,
)

RANK_SUFFIX = "-rank"  # '<preset>-rank': one of the release's 32 ranks of a full-size preset


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The config called `name` (see the module docstring), with optional field overrides
    (validated). ValueError naming the allowed names for an unknown one."""
    if name in published.PUBLISHED:  # a small real model's published config.json fields
        return published.published_config(name, **overrides)
    if name in on_chip.ON_CHIP:  # cut to fill one device, overrides (a format) before the cut
        entry = on_chip.ON_CHIP[name]
        return on_chip.cut(get_config(entry.base, **{**entry.overrides, **overrides}), name)
    base = name[:-len(RANK_SUFFIX)]
    if name.endswith(RANK_SUFFIX) and base in PRESETS:
        return partition.rank_config(PRESETS[base], partition.RELEASE, partition.RELEASE_RANKS,
                                     **overrides)
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(config_names())}")
    config = PRESETS[name]
    return config.replace(**overrides) if overrides else config


def config_names() -> tuple[str, ...]:
    """Every name `get_config` takes: the presets, one rank of each full-size one, the small
    real models' presets and the configs that fill one chip."""
    ranks = tuple(f"{name}{RANK_SUFFIX}" for name, cfg in PRESETS.items()
                  if partition.has_rank(cfg))
    return (*PRESETS, *ranks, *published.PUBLISHED, *on_chip.ON_CHIP)
