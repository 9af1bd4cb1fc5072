"""Expert weight formats (docs/kimi-k3.md §7): quantising routed-expert matrices and decoding them.

- bf16:  a bf16 array `[.., K, N]`
- fp8:   {"values": float8_e4m3fn [.., K, N], "scales": bf16 [.., K/256, N]}, scales powers of two
- mxfp4: {"codes": uint32 [.., K/8, N], "scales": uint8 [.., K/32, N]}: 8 E2M1 nibbles per uint32,
         the low nibble is the lowest K; E8M0 scale 2^(e-127) per 32 consecutive K values.

K is always the input dim of the matrix (the latent for W1/W3, the expert hidden for W2). Every
format decodes exactly to bf16 (`dequantize`), and fp8 / MXFP4 to fp8 e4m3 values with f32 block
scales (`mxu_parts`): what the MXU is handed with `ModelConfig.expert_mxu = "fp8"` (`mxu_matmul`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from mkresearch.model.config_rules import EXPERT_BLOCKS
from mkresearch.model.model_config import EXPERT_FORMATS, FP8_BLOCK, MXFP4_BLOCK
from mkresearch.model.numerics import block_scaled_matmul, sequence_sum

# E2M1 magnitudes indexed by the low 3 bits of a code; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX_EXP = 2  # largest E2M1 magnitude 6 = 1.5 * 2^2
E2M1_UPSCALE_ABOVE = 1.75  # max/scale > 7 would clip to 6; 3.5 = midpoint of 3 and 4 one binade down
E4M3_MAX = 448.0
E4M3_MAX_EXP = 8  # largest e4m3fn magnitude 448 = 1.75 * 2^8
E4M3_UPSCALE_ABOVE = 1.8125  # max/scale > 464 would clip to 448; 232 = midpoint of 224 and 240
NIBBLES_PER_WORD = 8
EXPERT_MATRICES = ("w1", "w3", "w2")
# Rows of K decoded (and multiplied) at once: bounds a kernel's f32 temporaries of one decode
# (K_CHUNK x N x 4 bytes); the reference multiplies in the same chunks where the chunking shows in
# the bits (`mxu_matmul`)
MAX_K_CHUNK = 1024


# ---- quantisation ----------------------------------------------------------------------------
def _check_k(w: Any, block: int, name: str) -> None:
    if w.ndim < 2 or w.shape[-2] % block:
        raise ValueError(
            f"{name}: w must be [..., K, N] with K a multiple of {block}, got shape {w.shape}")


def _check_packed(packed: Any, keys: tuple[str, ...], name: str) -> None:
    if not isinstance(packed, dict) or set(packed) != set(keys):
        raise ValueError(f"{name}: packed must be a dict with keys {keys}, got {packed!r:.80}")


def _block_exponent(w32: jax.Array, block: int, elem_max_exp: int, upscale_above: float
                    ) -> jax.Array:
    """Shared power-of-two exponent per `block` K values (the scale is 2^exponent).

    The block max lands in the element format's top binade: exponent = floor(log2 amax) -
    elem_max_exp, plus one when amax's mantissa m (amax = m·2^f, m in [1, 2)) exceeds
    `upscale_above`. That threshold is where the max would round above the element max: the
    block moves up a binade instead of clipping. It sits on a rounding midpoint of the binade
    below, so a quantised block picks the same exponent again (pack∘unpack∘pack = pack).
    """
    k, n = w32.shape[-2:]
    blocks = w32.reshape(*w32.shape[:-2], k // block, block, n)
    amax = jnp.max(jnp.abs(blocks), axis=-2)  # [.., K/block, N]
    mantissa, exp = jnp.frexp(amax)  # amax = mantissa * 2^exp, mantissa in [0.5, 1)
    exponent = exp - 1 - elem_max_exp + (2 * mantissa > upscale_above)
    return jnp.where(amax > 0, exponent, 0)


def _pow2(exponent: jax.Array) -> jax.Array:
    """Exactly 2^e as f32 for integer e in [-127, 127], built from the exponent bits.

    jnp.exp2 on XLA:CPU is off by an ulp for many integer exponents and returns 0 at -126.
    """
    e = jnp.asarray(exponent, jnp.int32)
    normal = jax.lax.bitcast_convert_type(((jnp.maximum(e, -126) + 127) << 23).astype(jnp.uint32),
                                          jnp.float32)
    return jnp.where(e >= -126, normal, jnp.float32(2.0**-127))  # E8M0's e=0 is subnormal


def _per_k(scales: jax.Array, block: int) -> jax.Array:
    """[.., K/block, N] -> [.., K, N] (each scale repeated over its block)."""
    return jnp.repeat(scales, block, axis=-2)


def mxfp4_pack(w: jax.Array) -> dict[str, jax.Array]:
    """Quantise w [.., K, N] to MXFP4 (round to nearest E2M1, ties to the smaller magnitude)."""
    _check_k(w, MXFP4_BLOCK, "mxfp4_pack")
    return _mxfp4_pack(w)


@jax.jit
def _mxfp4_pack(w: jax.Array) -> dict[str, jax.Array]:
    # |w|/scale <= 7 by the choice of exponent: rounding error at most one scale step
    w32 = jnp.asarray(w, jnp.float32)
    exp = _block_exponent(w32, MXFP4_BLOCK, E2M1_MAX_EXP, E2M1_UPSCALE_ABOVE)
    exp = jnp.clip(exp, -126, 127)  # E8M0 range, kept to normal f32 scales
    scaled = w32 / _per_k(_pow2(exp), MXFP4_BLOCK)  # |.| < 8
    # nearest grid magnitude: count the midpoints strictly below |x| (ties go to the smaller)
    grid = jnp.asarray(E2M1_VALUES, jnp.float32)
    midpoints = (grid[1:] + grid[:-1]) / 2
    magnitude = jnp.sum(jnp.abs(scaled)[..., None] > midpoints, axis=-1).astype(jnp.uint32)
    sign = jnp.where((scaled < 0) & (magnitude > 0), 8, 0).astype(jnp.uint32)
    nibbles = magnitude | sign  # [.., K, N] in 0..15
    k, n = nibbles.shape[-2:]
    nibbles = nibbles.reshape(*nibbles.shape[:-2], k // NIBBLES_PER_WORD, NIBBLES_PER_WORD, n)
    shifts = (4 * jnp.arange(NIBBLES_PER_WORD, dtype=jnp.uint32))[:, None]  # low nibble = low K
    codes = jnp.sum(nibbles << shifts, axis=-2, dtype=jnp.uint32)  # disjoint bits: sum == or
    return {"codes": codes, "scales": (exp + 127).astype(jnp.uint8)}


def mxfp4_unpack(packed: dict[str, jax.Array], dtype: Any = jnp.float32) -> jax.Array:
    """MXFP4 -> [.., K, N] in `dtype` (exact in f32 and bf16)."""
    _check_packed(packed, ("codes", "scales"), "mxfp4_unpack")
    return _mxfp4_unpack(packed, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=1)
def _mxfp4_unpack(packed: dict[str, jax.Array], dtype: Any) -> jax.Array:
    codes, scales = packed["codes"], packed["scales"]
    shifts = (4 * jnp.arange(NIBBLES_PER_WORD, dtype=jnp.uint32))[:, None]
    nibbles = (codes[..., :, None, :] >> shifts) & 0xF  # [.., K/8, 8, N]
    k8, n = codes.shape[-2:]
    nibbles = nibbles.reshape(*codes.shape[:-2], k8 * NIBBLES_PER_WORD, n)
    scale = _pow2(scales.astype(jnp.int32) - 127)
    return (e2m1_values(nibbles) * _per_k(scale, MXFP4_BLOCK)).astype(dtype)


def e2m1_values(nibbles: jax.Array) -> jax.Array:
    """E2M1 codes (uint32, 0..15) -> their f32 values (E2M1_VALUES, bit 3 the sign), built from
    the bits: a code (e1 e0 m) with e >= 1 is 2^(e-1)·(1 + m/2), an f32 exponent field e + 126 and
    mantissa bit m; code 1 is 0.5 (field 126), code 0 is 0. Bit operations, no table: a gather
    from an 8-entry table is a slow op on a TPU (36.9 ms per kimi-k3-mini step, v5e)."""
    e, m = (nibbles >> 1) & 3, nibbles & 1
    normal = ((e + 126) << 23) | (m << 22)
    bits = jnp.where(e > 0, normal, jnp.where(m == 1, jnp.uint32(126 << 23), jnp.uint32(0)))
    return jax.lax.bitcast_convert_type(bits | ((nibbles & 8) << 28), jnp.float32)


def fp8_pack(w: jax.Array) -> dict[str, jax.Array]:
    """Quantise w [.., K, N] to FP8 e4m3fn with a power-of-two bf16 scale per 256 K values."""
    _check_k(w, FP8_BLOCK, "fp8_pack")
    return _fp8_pack(w)


@jax.jit
def _fp8_pack(w: jax.Array) -> dict[str, jax.Array]:
    w32 = jnp.asarray(w, jnp.float32)
    exp = _block_exponent(w32, FP8_BLOCK, E4M3_MAX_EXP, E4M3_UPSCALE_ABOVE)
    exp = jnp.clip(exp, -126, 127)  # normal bf16 scales
    scales = _pow2(exp)  # [.., K/256, N], exact in bf16
    scaled = jnp.clip(w32 / _per_k(scales, FP8_BLOCK), -E4M3_MAX, E4M3_MAX)
    return {"values": scaled.astype(jnp.float8_e4m3fn), "scales": scales.astype(jnp.bfloat16)}


def fp8_unpack(packed: dict[str, jax.Array], dtype: Any = jnp.float32) -> jax.Array:
    """FP8 -> [.., K, N] in `dtype` (exact in f32 and bf16: 4 mantissa bits times 2^e)."""
    _check_packed(packed, ("values", "scales"), "fp8_unpack")
    return _fp8_unpack(packed, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=1)
def _fp8_unpack(packed: dict[str, jax.Array], dtype: Any) -> jax.Array:
    values = packed["values"].astype(jnp.float32)
    scale = packed["scales"].astype(jnp.float32)
    return (values * _per_k(scale, FP8_BLOCK)).astype(dtype)


def _check_format(fmt: str) -> None:
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"fmt={fmt!r} is invalid: one of {', '.join(map(repr, EXPERT_FORMATS))}")


def quantize(w: jax.Array, fmt: str) -> Any:
    """Full-precision w [.., K, N] -> an expert weight in `fmt` (the inverse of `dequantize`)."""
    _check_format(fmt)
    if fmt == "bf16":
        return jnp.asarray(w, jnp.bfloat16)
    return fp8_pack(w) if fmt == "fp8" else mxfp4_pack(w)


def expert_format_of(expert_weight: Any) -> str:
    """The format an expert weight is stored in, from its structure: "bf16", "fp8" or "mxfp4"."""
    if isinstance(expert_weight, dict):
        if set(expert_weight) == {"codes", "scales"}:
            return "mxfp4"
        if set(expert_weight) == {"values", "scales"}:
            return "fp8"
    elif getattr(expert_weight, "dtype", None) == jnp.bfloat16:
        return "bf16"
    raise ValueError(f"expert_weight={expert_weight!r:.80} is invalid: a bf16 array, "
                     "{'values', 'scales'} (fp8) or {'codes', 'scales'} (mxfp4)")


def dequantize(expert_weight: Any, fmt: str | None = None) -> jax.Array:
    """An expert weight in `fmt` -> bf16 [.., K, N]. Exact: both formats are bf16-representable.

    fmt: "bf16", "fp8" or "mxfp4"; None infers it from the weight's structure.
    """
    if fmt is None:
        fmt = expert_format_of(expert_weight)
    _check_format(fmt)
    if fmt == "bf16":
        return jnp.asarray(expert_weight, jnp.bfloat16)
    if fmt == "fp8":
        return fp8_unpack(expert_weight, jnp.bfloat16)
    return mxfp4_unpack(expert_weight, jnp.bfloat16)


def _chunks(fmt: str, k: int) -> list[int]:
    """The K chunks a decode may take, largest first: the divisors of k <= MAX_K_CHUNK that keep
    every part's chunk whole in its scale blocks (256 rows for FP8, 32 for MXFP4) and
    tile-aligned; [k] when there is none."""
    step = FP8_BLOCK  # also a multiple of MXFP4's 32 and of 8 x 32 (uint32 code rows, u8 tiles)
    rows = [r for r in range(min(k, MAX_K_CHUNK) // step * step, 0, -step) if k % r == 0]
    return rows or [k]


def k_chunk(fmt: str, k: int) -> int:
    """Rows of K decoded per step: the largest of the chunks a decode may take (`_chunks`)."""
    _check_format(fmt)
    if fmt == "bf16":
        return k  # nothing to decode: one dot over the whole K
    return _chunks(fmt, k)[0]


def mxu_k_chunk(fmt: str, k: int) -> int:
    """Rows of K per block-scaled dot of `mxu_matmul` (expert_mxu="fp8"): the smallest of the
    chunks a decode may take (`_chunks`: multiples of 256 where k allows; 256 is also the depth of
    TPU7x's 256 x 256 MXU). Why the smallest: a chunk of c rows spreads each batch row over
    c / block MXU rows (`numerics.block_scaled_matmul`), so B rows cost k / c chunks x
    ceil(B c / block / 256) row passes x c / 256 contraction passes = k / 256 x
    ceil(B c / block / 256): never more than with a larger chunk, at any B, and one row pass up
    to B = 32 (MXFP4: 8 blocks per row; FP8: 1). And a chunk that does not depend on B keeps a row's bits its own whatever the
    batch (docs/serving.md §1). The kernel (`quant.matmul`), the reference and the scale-out
    model (`mxu_spread`) all take it from here."""
    _check_format(fmt)
    if fmt == "bf16":
        raise ValueError("fmt='bf16' is invalid for an fp8 MXU input: 'fp8' or 'mxfp4'")
    return _chunks(fmt, k)[-1]


def mxu_spread(fmt: str, k: int) -> int:
    """MXU rows per batch row of `mxu_matmul` on a [k, N] matrix: its chunk's (`mxu_k_chunk`)
    scale blocks (`numerics.block_scaled_matmul` spreads each row over them)."""
    return mxu_k_chunk(fmt, k) // EXPERT_BLOCKS[fmt]


def mxu_parts(expert_weight: dict[str, jax.Array], fmt: str) -> tuple[jax.Array, jax.Array]:
    """An fp8 or MXFP4 expert weight -> (values float8_e4m3fn [.., K, N], scales f32
    [.., K/block, N]): what the MXU is handed with expert_mxu="fp8". Exact: every E2M1 value is an
    e4m3 value, and values x scales is `dequantize`'s."""
    if fmt == "fp8":
        _check_packed(expert_weight, ("values", "scales"), "mxu_parts")
        return expert_weight["values"], expert_weight["scales"].astype(jnp.float32)
    if fmt != "mxfp4":
        raise ValueError(f"fmt={fmt!r} is invalid for an fp8 MXU input: 'fp8' or 'mxfp4'")
    _check_packed(expert_weight, ("codes", "scales"), "mxu_parts")
    codes, scales = expert_weight["codes"], expert_weight["scales"]
    unit = {"codes": codes, "scales": jnp.full_like(scales, 127)}  # 2^0: the E2M1 values alone
    values = mxfp4_unpack(unit, jnp.float32).astype(jnp.float8_e4m3fn)
    return values, _pow2(scales.astype(jnp.int32) - 127)


def mxu_matmul(x: jax.Array, expert_weight: dict[str, jax.Array], fmt: str) -> jax.Array:
    """x bf16 [M, K] @ one fp8 or MXFP4 expert matrix [K, N] as the MXU is handed it with
    expert_mxu="fp8" -> f32 [M, N]: `numerics.block_scaled_matmul` over each chunk of `mxu_k_chunk`
    rows, the chunks added in order (a kernel's chunks, so the same bits)."""
    values, scales = mxu_parts(expert_weight, fmt)
    k = values.shape[-2]
    rows = mxu_k_chunk(fmt, k)
    block = EXPERT_BLOCKS[fmt]
    return sequence_sum(
        block_scaled_matmul(x[:, r:r + rows], values[r:r + rows],
                            scales[r // block:(r + rows) // block])
        for r in range(0, k, rows))


def k_rows(expert_weight: Any, start: int, stop: int, k: int) -> Any:
    """Rows [start, stop) of an expert weight [.., K = k, N] in any format: every stored part
    cut along its K axis in proportion (fp8 scales per 256 rows, MXFP4 codes per 8 and scales
    per 32: the cut must keep its blocks whole, as an ETP slice of the layout does)."""
    def cut(part):
        rows = part.shape[-2]
        if start * rows % k or stop * rows % k:
            raise ValueError(f"rows [{start}, {stop}) of K={k} cut a block of a part with "
                             f"{rows} rows: not whole scale blocks")
        return part[..., start * rows // k:stop * rows // k, :]

    return jax.tree.map(cut, expert_weight)


def quantized_shapes(shape: tuple[int, ...], fmt: str) -> Any:
    *lead, k, n = shape
    if fmt == "bf16":
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    if fmt == "fp8":
        return {"values": jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
                "scales": jax.ShapeDtypeStruct((*lead, k // FP8_BLOCK, n), jnp.bfloat16)}
    return {"codes": jax.ShapeDtypeStruct((*lead, k // NIBBLES_PER_WORD, n), jnp.uint32),
            "scales": jax.ShapeDtypeStruct((*lead, k // MXFP4_BLOCK, n), jnp.uint8)}
