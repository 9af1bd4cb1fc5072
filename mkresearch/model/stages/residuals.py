"""Residual strategies: how a layer's attention and FFN outputs join the hidden state.

attention_mix  Kimi K3 (docs/kimi-k3.md §3): no classic residual stream; each sublayer's input is a learned
               softmax mix (`numerics.mix`) of block snapshots R_0..R_n and the block's partial
               sum P. Parameters: the folded mix weights of every layer and of the output.
prenorm        a classic pre-norm residual stream h ← bf(h + sublayer(RMSNorm(h))), as DeepSeek,
               GLM and Qwen use. No parameters beyond the norms.

The decode loops are in `mkresearch.model.reference` (the spec); this declares their parameters.
"""

from __future__ import annotations

import jax.numpy as jnp

from mkresearch.model import spec
from mkresearch.model.model_config import ModelConfig


def _mix_params(cfg: ModelConfig) -> dict[str, spec.Param]:
    d, n_layers = cfg.d_model, cfg.n_layers
    std = d ** -0.5  # <v/rms(v), w> ~ N(0, 1): softmax over candidates neither flat nor one-hot
    replicated = spec.REPLICATED  # every rank mixes the same [B, d] candidates
    return {"mix_out": spec.Param((d,), jnp.float32, ("normal", std), shard=replicated),
            "mix_attn": spec.Param((n_layers, d), jnp.float32, ("normal", std), shard=replicated),
            "mix_mlp": spec.Param((n_layers, d), jnp.float32, ("normal", std), shard=replicated)}


ATTENTION_MIX = spec.register_residual(spec.Residual(
    "attention_mix", _mix_params, "Kimi K3 attention residuals over block snapshots"))
PRENORM = spec.register_residual(spec.Residual(
    "prenorm", lambda cfg: {}, "pre-norm residual stream"))
