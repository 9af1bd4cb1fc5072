"""The built-in stage kinds and residual strategies, registered in `mkresearch.spec` on import."""

from mkresearch.stages import ffn, kda, mla, residuals

__all__ = ["ffn", "kda", "mla", "residuals"]
