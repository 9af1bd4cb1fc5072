"""The query projection of both MLA kernels (kinds "mla" and "mla_rope"), one body piece each
kernel calls: through the query LoRA, c_q = RMSNorm(bf(x W_qa)), q = bf(c_q W_qb) (Kimi K3,
DeepSeek-V3), or, with mla_q_rank 0, directly, q = bf(x W_q) (Moonlight, Kimi Linear). Same
arithmetic as `mkresearch.model.stages.mla.queries`; the DMAs keep MLA's names ("mla.w_qa", ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from mkresearch.kernels.base import blocks, planned
from mkresearch.kernels.base.blocks import bf16, f32

from mkresearch.model.config import ModelConfig


def weight_names(q_rank: int) -> tuple[str, ...]:
    """The query weights in the body's order: LoRA (W_qa, its norm, W_qb) or W_q alone."""
    return ("w_q",) if q_rank == 0 else ("w_qa", "q_norm", "w_qb")


def streamed_names(q_rank: int) -> tuple[str, ...]:
    """The query matrices the body streams (the norm gain is loaded whole)."""
    return ("w_q",) if q_rank == 0 else ("w_qa", "w_qb")


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    q_width = cfg.n_heads * cfg.mla_qk_dim
    if cfg.mla_q_rank == 0:
        return {"w_q": (cfg.d_model, q_width)}
    return {"w_qa": (cfg.d_model, cfg.mla_q_rank), "q_norm": (cfg.mla_q_rank,),
            "w_qb": (cfg.mla_q_rank, q_width)}


def project(plan: Any, weights: dict, x: jax.Array, stream: Callable, indices: dict) -> jax.Array:
    """q [B, H·qk] f32 (bf16 values) of x [B, d] bf16; weights: the body's refs by name."""
    if plan.q_rank == 0:
        return f32(bf16(stream(x, weights["w_q"], rows=plan.block_rows("w_q"), name="mla.w_q")))
    c_q = blocks.rms_norm(
        bf16(stream(x, weights["w_qa"], rows=plan.block_rows("w_qa"), name="mla.w_qa")),
        blocks.load_whole(weights["q_norm"], name="mla.q_norm", **indices), plan.eps)  # [B, q_rank]
    return f32(bf16(stream(c_q, weights["w_qb"], rows=plan.block_rows("w_qb"), name="mla.w_qb")))


def dmas(plan: Any, stream: Callable[[str], list], load: Callable[[str], list]
         ) -> list[planned.PlannedDma]:
    """`project`'s DMAs in its order: `stream(name)` a streamed matrix's, `load(name)` a norm's."""
    if plan.q_rank == 0:
        return stream("w_q")
    return stream("w_qa") + load("q_norm") + stream("w_qb")
