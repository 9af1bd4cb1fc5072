"""The built-in stage kinds and residual strategies, registered in `mkresearch.model.spec` on import."""

from mkresearch.model.stages import ffn, gqa, gqa_sink, kda, mla, mla_rope, moe_full, residuals

__all__ = ["ffn", "gqa", "gqa_sink", "kda", "mla", "mla_rope", "moe_full", "residuals"]
