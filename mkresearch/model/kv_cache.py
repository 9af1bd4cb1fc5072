"""How long a KV cache is, and how the MLA KV cache is read, in bytes: shape arithmetic only
(config shapes, no kernel).

A DMA window of a bf16 HBM array starts and ends on its 16-row tiles, so the kernels
(`mkresearch.kernels.base.kv_tiles`) read the cached tokens of a row in whole 16-row groups.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mkresearch.model.config import BF16_SUBLANE, ModelConfig

# The KV tiles are read in groups of this many rows: a DMA window of a bf16 HBM array starts and
# ends on its 16-row tiles, so the last tile's tail past the position is skipped group by group.
KV_ROW_GROUP = BF16_SUBLANE


# A cache for N tokens is allocated rounded up to this many: few distinct shapes, few compiles.
CACHE_ROUND = 128


def cache_length(cfg: ModelConfig, tokens: int, round_to: int = CACHE_ROUND) -> int:
    """The cache length (a `max_seq_len` cfg accepts) that holds `tokens` tokens: rounded up to
    a multiple of both `round_to` and cfg.kv_tile (the config's rule: whole KV tiles), never past
    cfg.max_seq_len (itself whole tiles). ValueError naming max_seq_len when the tokens exceed
    it."""
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 1:
        raise ValueError(f"tokens={tokens!r} is invalid: an int >= 1")
    if tokens > cfg.max_seq_len:
        raise ValueError(f"{tokens} tokens exceed max_seq_len={cfg.max_seq_len} of {cfg.name}")
    step = math.lcm(round_to, cfg.kv_tile)
    return min(-(-int(tokens) // step) * step, cfg.max_seq_len)


def rows_read(count: int) -> int:
    """Cache rows the kernels read for `count` tokens: whole 16-row HBM tiles (bf16), the least
    a DMA window can cover. Tiles of T tokens add nothing: T is a multiple of 16."""
    return -(-count // KV_ROW_GROUP) * KV_ROW_GROUP


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes of one cached token of one layer, as the MLA kernel reads it (all heads of cfg)."""
    if cfg.mla_cache_layout == "expanded":
        return cfg.n_heads * (cfg.mla_k_padded + cfg.mla_v_dim) * 2
    return cfg.mla_latent_cache_dim * 2


def kv_tile_bytes_needed(positions: Any, cfg: ModelConfig) -> int:
    """KV bytes the cached tokens 0..p_b-1 of every row take, in the 16-row HBM tiles a DMA
    reads: Σ_b ⌈p_b / 16⌉ · 16 tokens (what `mla_attention` reads, whatever cfg.kv_tile)."""
    tokens = sum(rows_read(int(position)) for position in np.asarray(positions))
    return tokens * kv_bytes_per_token(cfg)
