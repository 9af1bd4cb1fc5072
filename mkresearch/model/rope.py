"""Rotary position embedding (RoPE), partial RoPE and YaRN, as the GQA and MLA-with-RoPE stages
use it (docs/families.md). The reference and the kernels call these same functions (the kernels
on VMEM values, with the position read from SMEM), so both round alike.

One convention for every family: NeoX "rotate half" on the first R dims of a vector. Dims i and
i + R/2 (i < R/2) are a pair rotated by the angle p·θ_i, with p the token's position:

    out_i       = x_i · cos(p θ_i) − x_{i+R/2} · sin(p θ_i)
    out_{i+R/2} = x_{i+R/2} · cos(p θ_i) + x_i · sin(p θ_i)           θ_i = theta^(−2i/R)

and dims R.. pass through (partial RoPE). Position 0 is the identity.
- GLM-4.5: R = head_dim · partial_rotary_factor = 64 of 128, the FIRST half of each head's dims,
  not interleaved (HF Glm4Moe takes GPT-NeoX's apply_rotary_pos_emb; vLLM and SGLang build it
  with get_rope's default neox style). (The dense GLM-4 models rotate interleaved pairs; GLM-4.5
  does not.)
- Qwen3: R = head_dim.
- DeepSeek-V3: the 64 rope dims of each head (q_pe) and the shared rope key (k_pe). DeepSeek's
  own inference code rotates *interleaved* pairs (2i, 2i+1) (view_as_complex); HF's
  modeling_deepseek de-interleaves q_pe and k_pe and then rotates halves, which gives the same
  scores. Here the de-interleave is a load-time permutation of the rope columns of W_qb (each head)
  and of W_kva (`deinterleave`), so the decode step keeps one convention and caches the rope key
  in rotate-half order; tests/test_families_reference.py checks it against the interleaved form.

Precision: θ_i is computed in f32 from an iota (`inverse_frequencies`), the angle p·θ_i and
cos/sin in f32, the rotation in f32 from the bf16 vector; callers round the result to bf16 once
(HF rounds cos/sin and each product to bf16: within a bf16 ulp of this).

YaRN (DeepSeek-V3's and GPT-OSS's rope_scaling; HF DeepseekV3YarnRotaryEmbedding and DeepSeek's
precompute_freqs_cis; GPT-OSS leaves the correction range untruncated): with factor s > 1, frequencies blend between θ_i (high frequencies,
kept) and θ_i / s (low frequencies, interpolated) by a linear ramp over the dims between the
correction dims of beta_fast and beta_slow rotations within the original context; cos and sin are
scaled by mscale(s, mscale) / mscale(s, mscale_all_dim) (1 for DeepSeek-V3), and the softmax
scale by mscale(s, mscale_all_dim)² where mscale(s, m) = 0.1 · m · ln s + 1 (`attention_scale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkresearch.model.model_config import ModelConfig

f32 = jnp.float32


@dataclass(frozen=True)
class Rope:
    """Everything static about one RoPE: R rotated dims, theta and YaRN (hashable: kernels take
    it as a static option)."""

    dim: int  # R: the rotated dims (even)
    theta: float
    yarn_factor: float = 1.0  # 1: no YaRN
    yarn_original_max_positions: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # the correction range floored / ceiled (transformers' `truncate`; GPT-OSS: False). Out of
    # the repr: a plan's repr, which holds its Rope, keys the recorded compiles
    yarn_truncate: bool = field(default=True, repr=False)

    @property
    def yarn(self) -> bool:
        return self.yarn_factor > 1

    def correction_range(self) -> tuple[float, float]:
        """(low, high) pair indices of YaRN's ramp: the dims completing beta_fast and beta_slow
        rotations over the original context, floored / ceiled (unless `yarn_truncate` is off)
        and clipped to [0, R − 1]."""
        def dim_of(rotations: float) -> float:
            return (self.dim * math.log(self.yarn_original_max_positions
                                        / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = dim_of(self.yarn_beta_fast), dim_of(self.yarn_beta_slow)
        if self.yarn_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        return float(low), float(high if high != low else high + 0.001)

    @property
    def cos_sin_scale(self) -> float:
        if not self.yarn:
            return 1.0
        return (yarn_mscale(self.yarn_factor, self.yarn_mscale)
                / yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim))


def yarn_mscale(factor: float, mscale: float) -> float:
    """0.1 · mscale · ln(factor) + 1 for factor > 1, else 1 (DeepSeek's yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def of(cfg: ModelConfig, dim: int) -> Rope:
    """The RoPE of cfg rotating `dim` dims (cfg.rope_dim for GQA, cfg.mla_qk_extra for MLA)."""
    return Rope(dim=int(dim), theta=float(cfg.rope_theta), yarn_factor=float(cfg.yarn_factor),
                yarn_original_max_positions=int(cfg.yarn_original_max_positions),
                yarn_beta_fast=float(cfg.yarn_beta_fast), yarn_beta_slow=float(cfg.yarn_beta_slow),
                yarn_mscale=float(cfg.yarn_mscale),
                yarn_mscale_all_dim=float(cfg.yarn_mscale_all_dim),
                yarn_truncate=bool(cfg.yarn_truncate))


def attention_scale(cfg: ModelConfig, qk_dim: int) -> float:
    """The softmax scale qk_dim^-½, times mscale(factor, mscale_all_dim)² with YaRN (DeepSeek-V3:
    192^-½ · (0.1 ln 40 + 1)²)."""
    scale = float(qk_dim) ** -0.5
    if cfg.yarn_factor > 1 and cfg.yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale


def inverse_frequencies(rope: Rope) -> jax.Array:
    """θ_i for i < R/2, f32 [1, R/2]: theta^(−2i/R) as exp(i · (−2 ln theta / R)) from an iota
    (jnp ops a TPU kernel lowers too), YaRN-blended when on."""
    half = rope.dim // 2
    i = jax.lax.broadcasted_iota(jnp.int32, (1, half), 1).astype(f32)
    extrapolated = jnp.exp(i * f32(-2.0 * math.log(rope.theta) / rope.dim))
    if not rope.yarn:
        return extrapolated
    low, high = rope.correction_range()
    ramp = jnp.clip((i - f32(low)) / f32(high - low), 0.0, 1.0)  # 0: keep, 1: interpolate
    return extrapolated / f32(rope.yarn_factor) * ramp + extrapolated * (1.0 - ramp)


def cos_sin(positions: Any, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """cos and sin of p·θ_i, f32 [..., R/2] for positions [...] (ints), YaRN-scaled when on."""
    positions = jnp.asarray(positions)
    return _trig(positions[..., None].astype(f32) * inverse_frequencies(rope)[0], rope)


def cos_sin_row(position: Any, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """`cos_sin` of one position (a scalar, e.g. read from SMEM in a kernel) as [1, R/2]: the
    same f32 values, built from 2-D vectors only (what a TPU kernel lowers)."""
    inverse = inverse_frequencies(rope)  # [1, R/2]
    angle = jnp.broadcast_to(jnp.asarray(position, jnp.int32), inverse.shape).astype(f32) * inverse
    return _trig(angle, rope)


def _trig(angle: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array]:
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    scale = rope.cos_sin_scale
    if scale != 1.0:
        cos, sin = cos * f32(scale), sin * f32(scale)
    return cos, sin


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., W] rotated on its first R = 2·cos.shape[-1] dims (module docstring), f32.
    cos, sin [..., R/2] broadcast against x's leading dims."""
    half = cos.shape[-1]
    x = x.astype(f32)
    first, second = x[..., :half], x[..., half:2 * half]
    parts = [first * cos - second * sin, second * cos + first * sin]
    if x.shape[-1] > 2 * half:
        parts.append(x[..., 2 * half:])
    return jnp.concatenate(parts, axis=-1)


def deinterleave(n: int) -> np.ndarray:
    """The column order that turns DeepSeek's interleaved rope pairs (2i, 2i+1) into rotate-half
    pairs (i, i + n/2): apply it to the rope columns of W_qb (each head) and W_kva when loading."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])
