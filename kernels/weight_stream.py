"""The global weight stream of the megakernel (placeholder while it is being written)."""

from __future__ import annotations

from mkresearch.config import ModelConfig


def max_ring_depth(cfg: ModelConfig) -> int:
    return 4


def make_stream_plan(cfg: ModelConfig, depth: int, block_bytes: int):
    return None
