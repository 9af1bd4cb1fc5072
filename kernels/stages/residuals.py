"""The megakernel's residual strategies: the hidden state between stages, kept in VMEM.

The kernel twins of the reference's decode loops (`mkresearch.model.reference`, strategies named by
`ModelConfig.residual`). Each strategy says which VMEM buffers hold its hidden state, which
per-layer vectors it loads (in this order, one DMA each, at the start of every layer), and what
runs around the two stages of a layer, and which trunk vectors the head loads (`head_vectors`):

    attention_mix  Kimi K3 (docs/kimi-k3.md §3): block snapshots R and the block's partial sum P; each stage's
                   input is a softmax mix of them (`numerics.mix`), its output added to P
    prenorm        a classic residual stream h ← bf(h + stage(RMSNorm(h)))

Everything here is element-wise work on [B, d] values (the stage bodies move the weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from mkresearch.kernels.base import dma

from mkresearch.model import numerics
from mkresearch.model.config import ModelConfig


def _add(a: Any, b: Any) -> Any:
    return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(jnp.bfloat16)


def _mix(n_snapshots, snapshots_ref, partial, w, eps, n_blocks):
    """numerics.mix over {R_0..R_{n-1}, P} with a traced n: one static branch per count."""
    def branch(k):
        def mixed():
            parts = ([snapshots_ref[0:k]] if k else []) + [partial[None]]
            return numerics.mix(jnp.concatenate(parts, axis=0), w, eps)  # [B, d] bf16
        return mixed

    return lax.switch(n_snapshots, [branch(k) for k in range(n_blocks + 1)])


@dataclass(frozen=True)
class AttentionMix:
    """Kimi K3's attention residuals. Hidden state: snapshots R [n_blocks, B, d] and the block's
    partial sum P [B, d] (bf16)."""

    name: str = "attention_mix"
    vectors: tuple[str, ...] = ("mix_attn", "attn_norm", "mix_mlp", "mlp_norm")
    vectors_label: str = "mix/norm"
    head_vectors: tuple[str, ...] = ("mix_out", "final_norm")  # DMA'd before the LM head

    def vmem(self, cfg: ModelConfig, batch: int) -> list:
        return [("snapshots R", (cfg.n_blocks, batch, cfg.d_model), jnp.bfloat16),
                ("partial P", (batch, cfg.d_model), jnp.bfloat16)]

    def head_candidates(self, cfg: ModelConfig) -> int:
        return cfg.n_blocks + 1  # the final mix's candidates R_0..R_last, P

    def start(self, hidden: tuple, embedded: Any) -> None:
        """R_0 = P = e, R_1.. = 0 (docs/kimi-k3.md §3.1)."""
        snapshots, partial = hidden
        partial[...] = embedded
        snapshots[...] = jnp.zeros(snapshots.shape, snapshots.dtype)
        snapshots[0] = embedded

    def attention_input(self, hidden, layer, vectors, cfg: ModelConfig) -> Any:
        """2.1 h = Mix(𝒜_ℓ): ℓ = 0 → {P}; block start → {R_0..R_{n-1}, P}; else {R_0..R_n, P};
        2.2 a new block snapshots the previous block's sum; returns RMSNorm(h)."""
        snapshots, partial = hidden
        block, offset = lax.div(layer, cfg.attn_res_block), lax.rem(layer, cfg.attn_res_block)
        with dma.phase("mix_attn", layer=layer):
            n_attn = jnp.where(layer == 0, 0, jnp.where(offset == 0, block, block + 1))
            h = _mix(n_attn, snapshots, partial[...], vectors[0], cfg.rms_eps, cfg.n_blocks)

            @pl.when(offset == 0)
            def _():
                snapshots[block] = partial[...]

            return numerics.rms_norm(h, vectors[1].astype(jnp.bfloat16), cfg.rms_eps)

    def ffn_input(self, hidden, layer, vectors, attention_out, cfg: ModelConfig) -> Any:
        """2.4 P ← a at a block start, else bf(P + a); 2.5 h′ = Mix({R_0..R_n, P}); returns
        RMSNorm(h′)."""
        snapshots, partial_ref = hidden
        block, offset = lax.div(layer, cfg.attn_res_block), lax.rem(layer, cfg.attn_res_block)
        with dma.phase("mix_mlp", layer=layer):
            partial = jnp.where(offset == 0, attention_out, _add(partial_ref[...], attention_out))
            partial_ref[...] = partial
            h = _mix(block + 1, snapshots, partial, vectors[2], cfg.rms_eps, cfg.n_blocks)
            return numerics.rms_norm(h, vectors[3].astype(jnp.bfloat16), cfg.rms_eps)

    def after_ffn(self, hidden, ffn_out) -> None:
        """2.7 P ← bf(P + m)."""
        partial = hidden[1]
        partial[...] = _add(partial[...], ffn_out)

    def head_inputs(self, hidden) -> tuple:
        """(snapshots, partial) for the sampling body's final mix."""
        return hidden


@dataclass(frozen=True)
class Prenorm:
    """A pre-norm residual stream. Hidden state: h [B, d] bf16 (its norms divide by cfg.d_norm:
    GPT-OSS's checkpoint width, where d_model pads it to whole lanes)."""

    name: str = "prenorm"
    vectors: tuple[str, ...] = ("attn_norm", "mlp_norm")
    vectors_label: str = "norm"
    head_vectors: tuple[str, ...] = ("final_norm",)

    def vmem(self, cfg: ModelConfig, batch: int) -> list:
        return [("hidden h", (batch, cfg.d_model), jnp.bfloat16)]

    def head_candidates(self, cfg: ModelConfig) -> int:
        return 1

    def start(self, hidden: tuple, embedded: Any) -> None:
        hidden[0][...] = embedded

    def attention_input(self, hidden, layer, vectors, cfg: ModelConfig) -> Any:
        with dma.phase("norm_attn", layer=layer):
            return numerics.rms_norm(hidden[0][...], vectors[0].astype(jnp.bfloat16), cfg.rms_eps,
                                     cfg.d_norm)

    def ffn_input(self, hidden, layer, vectors, attention_out, cfg: ModelConfig) -> Any:
        with dma.phase("norm_mlp", layer=layer):
            h = _add(hidden[0][...], attention_out)
            hidden[0][...] = h
            return numerics.rms_norm(h, vectors[1].astype(jnp.bfloat16), cfg.rms_eps, cfg.d_norm)

    def after_ffn(self, hidden, ffn_out) -> None:
        hidden[0][...] = _add(hidden[0][...], ffn_out)

    def head_inputs(self, hidden) -> tuple:
        """(no snapshots, h): the sampling body normalises h without a final mix."""
        return None, hidden[0]


RESIDUALS = {r.name: r for r in (AttentionMix(), Prenorm())}
