"""The query projection of both MLA kernels (kinds "mla" and "mla_rope"), one body piece each
kernel calls: through the query LoRA, c_q = RMSNorm(bf(x W_qa)), q = bf(c_q W_qb) (Kimi K3,
DeepSeek-V3), or, with mla_q_rank 0, directly, q = bf(x W_q) (Moonlight, Kimi Linear), and the
KV down-projection x W_kva, streamed right after the query's first matrix (both of x). Same
arithmetic as `mkresearch.model.stages.mla.queries`; the DMAs keep MLA's names ("mla.w_qa", ...).
"""

from __future__ import annotations

from typing import Any

import jax
from mkresearch.kernels.base import blocks
from mkresearch.kernels.base.blocks import bf16, f32

from mkresearch.model.config import ModelConfig


def weight_names(q_rank: int) -> tuple[str, ...]:
    """The query weights in the body's order: LoRA (W_qa, its norm, W_qb) or W_q alone."""
    return ("w_q",) if q_rank == 0 else ("w_qa", "q_norm", "w_qb")


def streamed_names(q_rank: int) -> tuple[str, ...]:
    """The matrices `project` streams, in its order: the two of x first (W_qa or W_q, then W_kva:
    on a rank one all-gather carries both's column chunks), then W_qb (the norm gain is loaded
    whole)."""
    return ("w_q", "w_kva") if q_rank == 0 else ("w_qa", "w_kva", "w_qb")


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    q_width = cfg.n_heads * cfg.mla_qk_dim
    if cfg.mla_q_rank == 0:
        return {"w_q": (cfg.d_model, q_width)}
    return {"w_qa": (cfg.d_model, cfg.mla_q_rank), "q_norm": (cfg.mla_q_rank,),
            "w_qb": (cfg.mla_q_rank, q_width)}


def project(plan: Any, weights: dict, x: jax.Array, stream: Any, indices: dict
            ) -> tuple[jax.Array, jax.Array]:
    """(q [B, H·qk] f32 (bf16 values), x W_kva [B, kv cache dim] f32) of x [B, d] bf16; weights:
    the body's refs by name; stream: the stage's weight stream (`blocks.stream_matmuls`)."""
    first = "w_q" if plan.q_rank == 0 else "w_qa"
    down, kva = blocks.stream_matmuls(stream, x, tuple(
        (weights[name], plan.block_rows(name), f"mla.{name}") for name in (first, "w_kva")),
        **indices)
    if plan.q_rank == 0:
        return f32(bf16(down)), kva
    c_q = blocks.rms_norm(bf16(down), blocks.load_whole(weights["q_norm"], name="mla.q_norm",
                                                        **indices), plan.eps)  # [B, q_rank]
    return f32(bf16(blocks.stream_matmul(stream, c_q, weights["w_qb"], rows=plan.block_rows(
        "w_qb"), name="mla.w_qb", **indices))), kva

