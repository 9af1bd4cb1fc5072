"""GPT-OSS's attention kinds in the kernel registry ("gqa_sink", "gqa_sink_window";
`mkresearch.model.stages.gqa_sink`): `kernels/stages/gqa.py`'s body with its plan's GPT-OSS
switches: the sinks seed the online softmax, a window layer's tile loop starts at the window's
first tile (only the window's tiles are read: at most two of 128 tokens at GPT-OSS's window of 128,
whatever the context), and b_o is added to the output projection.

`sink_attention` is the stand-alone kernel twin of `stages.gqa_sink.sink_attention`.
"""

from __future__ import annotations

from typing import Any

import jax
from mkresearch.kernels.base.registry import KernelStage, register
from mkresearch.kernels.stages import gqa

from mkresearch.model.config import ModelConfig
from mkresearch.model.stages.gqa_sink import FULL, WINDOW


def sink_attention(p: dict, x: jax.Array, cache: dict, positions: jax.Array, cfg: ModelConfig,
                   kind: str, *, kv_tile: int | None = None, **indices: Any
                   ) -> tuple[jax.Array, dict]:
    """Kernel twin of `stages.gqa_sink.sink_attention` for a layer of `kind` (FULL or WINDOW):
    x [B, d] bf16, one layer's weights, its cache {"k", "v"} [B, KV, S, D], positions [B] i32
    -> (out [B, d] bf16, updated cache)."""
    if kind not in (FULL, WINDOW):
        raise ValueError(f"kind={kind!r} is invalid: {FULL!r} or {WINDOW!r}")
    return gqa.gqa_attention(p, x, cache, positions, cfg, kv_tile=kv_tile, kind=kind, **indices)


def _kernel(kind: str, label: str) -> KernelStage:
    return register(KernelStage(
        name=kind,
        plan=lambda cfg, batch, seq_len, options: gqa.make_plan(
            cfg, batch, seq_len, kv_tile=options.kv_tile, kind=kind),
        prepare=gqa.prepare_stack,
        streamed=lambda cfg: gqa.streamed_matrices(cfg, kind),
        body=gqa.gqa_attention_body, scope=lambda plan: label))


KERNEL = _kernel(FULL, "GQA (sinks)")
WINDOW_KERNEL = _kernel(WINDOW, "GQA (sinks, window)")
