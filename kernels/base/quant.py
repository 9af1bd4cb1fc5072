"""Expert weight formats inside a kernel: what to DMA, and decoding MXFP4 / FP8 in VMEM.

One [K, N] expert matrix (K = the input dim) is stored in HBM as a tuple of *parts*
(DEVELOPERS.md "Parameters", docs/kimi-k3.md §7):

    bf16   (weight bf16 [K, N],)
    fp8    (values float8_e4m3fn [K, N], scales bf16 [K/256, N])   scales are powers of two
    mxfp4  (codes uint32 [K/8, N], scales uint8 [K/32, N])          8 E2M1 nibbles per word, low
                                                                    nibble = lower K; E8M0 scales

Kernels DMA the parts as they are (so the DMA log counts the checkpoint's bytes) and decode them
here, chunk by chunk along K, right before the MXU dot. MXFP4 is never widened in HBM.

Decoding is exact (both formats are bf16-representable). MXFP4 codes are decoded one of two ways
(MXFP4_DECODES), chosen per chip by `mxfp4_decode_path` (`Chip.native_fp4`):

    native   `pltpu.bitcast` of the uint32 codes to float4_e2m1fn splits each word into 8
             consecutive K rows, low nibble first: exactly the checkpoint's packing. Mosaic lowers
             float4 vectors on TPU7x only.
    integer  shifts, masks and selects build each value's f32 bit pattern (`e2m1_to_f32`), then a
             32-bit bitcast: lowers on every chip.

The E8M0 scale 2^(e-127) is built from its exponent bits. `decode_body` + `decode` (a
pallas_call) exist to test exactly that, on its own.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, chip_log, costs, dma

from mkresearch.hardware import tpu
from mkresearch.hardware.chips import get_chip
from mkresearch.model.config import EXPERT_FORMATS, FP8_BLOCK, MXFP4_BLOCK
from mkresearch.model.formats import k_chunk, mxu_k_chunk
from mkresearch.model.numerics import block_scaled_matmul

NIBBLES_PER_WORD = 8
MXFP4_DECODES = ("native", "integer")


def check_format(expert_format: Any, name: str = "expert_format") -> str:
    """`expert_format` if it is one of EXPERT_FORMATS, else ValueError naming `name`."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"{name}={expert_format!r} is invalid: one of "
                         f"{', '.join(map(repr, EXPERT_FORMATS))}")
    return expert_format


def mxfp4_decode_path(chip: Any = None) -> str:
    """How kernels built for `chip` (a CHIPS name or Chip) decode E2M1 codes: "native" where
    Mosaic lowers float4 vectors (Chip.native_fp4), else "integer". None: tpu.target_chip()
    (compile_for's chip, or this TPU), and tpu.DEFAULT_CHIP in interpret mode."""
    if chip is None:
        chip = tpu.target_chip() or tpu.DEFAULT_CHIP
    return "native" if get_chip(chip).native_fp4 else "integer"


def check_runs_here(chip: Any = None) -> None:
    """A kernel built for `chip` (a CHIPS name or Chip; None: this machine's) about to run: a chip
    that is not this machine's TPU is refused in one line (`tpu.check_runs_here`: a TPU7x's
    float4 decode does not compile on a v5e), except while compiling for it (`compile_for`)."""
    if chip is not None:
        tpu.check_runs_here(get_chip(chip).name)


def part_names(expert_format: str) -> tuple[str, ...]:
    """Names of the stored parts of one matrix, in the order kernels take them."""
    check_format(expert_format)
    return {"bf16": ("weight",), "fp8": ("values", "scales"),
            "mxfp4": ("codes", "scales")}[expert_format]


def part_structs(expert_format: str, k: int, n: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shape and dtype of each stored part of one [k, n] matrix (a VMEM slot holds these)."""
    check_format(expert_format)
    if expert_format == "bf16":
        return (jax.ShapeDtypeStruct((k, n), jnp.bfloat16),)
    if expert_format == "fp8":
        return (jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((k // FP8_BLOCK, n), jnp.bfloat16))
    return (jax.ShapeDtypeStruct((k // NIBBLES_PER_WORD, n), jnp.uint32),
            jax.ShapeDtypeStruct((k // MXFP4_BLOCK, n), jnp.uint8))


def matrix_nbytes(expert_format: str, k: int, n: int) -> int:
    """HBM bytes of one [k, n] matrix in `expert_format`, scales included."""
    return sum(s.size * jnp.dtype(s.dtype).itemsize for s in part_structs(expert_format, k, n))


def split_parts(weight: Any, expert_format: str) -> tuple[jax.Array, ...]:
    """An expert weight of the parameter pytree (array or dict) -> its parts, in kernel order."""
    check_format(expert_format)
    if expert_format == "bf16":
        if isinstance(weight, dict):
            raise ValueError("expert_format='bf16' expects a bf16 array, got a dict of parts "
                             f"{sorted(weight)}: pass the format the weights were made in")
        return (weight,)
    names = part_names(expert_format)
    if not isinstance(weight, dict) or set(weight) != set(names):
        got = sorted(weight) if isinstance(weight, dict) else type(weight).__name__
        raise ValueError(f"expert_format={expert_format!r} expects a dict with keys {names}, "
                         f"got {got}")
    return tuple(weight[name] for name in names)


# ---- decoding values (inside a kernel, or plain jnp) ------------------------------------------
def _per_k(scale: jax.Array, block: int) -> jax.Array:
    """[R, N] -> [R * block, N]: each scale repeated over its K block (a sublane broadcast)."""
    rows, n = scale.shape
    return jnp.broadcast_to(scale[:, None, :], (rows, block, n)).reshape(rows * block, n)


def e8m0_to_f32(exponents: jax.Array) -> jax.Array:
    """E8M0 uint8 [R, N] -> f32 2^(e-127), built from the exponent bits: exact, where an exp2
    (a polynomial on the VPU, and on XLA:CPU) is off by an ulp for most integer exponents.
    e = 0 is 2^-127, an f32 subnormal the bit trick cannot make; e = 255 (NaN in OCP MX) gives inf.
    Decoding is exact for e in 2..254; at e <= 1 products below 2^-126 are f32 subnormals, which
    TPUs flush to zero (the packer makes such scales only for blocks with max |w| < ~1e-37)."""
    e = exponents.astype(jnp.int32)
    scale = pltpu.bitcast(e << 23, jnp.float32)
    return jnp.where(e == 0, jnp.float32(2.0**-127), scale)


def e2m1_to_f32(codes: jax.Array) -> jax.Array:
    """uint32 [R, N] of 8 E2M1 nibbles each -> f32 [8R, N], row 8r + j = nibble j of word r (low
    nibble first), with integer operations only (Mosaic lowers them on every chip).

    Word r is broadcast over the 8 sublanes of one f32 tile and sublane j shifts out nibble j, so
    the [R, 8, N] -> [8R, N] reshape only merges leading dimensions: no relayout."""
    rows, n = codes.shape
    words = jnp.broadcast_to(codes[:, None, :], (rows, NIBBLES_PER_WORD, n))  # [R, 8, N]
    shifts = lax.broadcasted_iota(jnp.uint32, words.shape, 1) * 4
    nibbles = ((words >> shifts) & 0xF).astype(jnp.int32)
    # magnitude code (e1 e0 m): 2^(e-1)·(1 + m/2) for e >= 1 is an f32 exponent field e + 126
    # and mantissa bit m; code 1 is 0.5 (exponent field 126, no mantissa), code 0 is 0
    magnitude = nibbles & 7
    exponent, mantissa = magnitude >> 1, magnitude & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    bits = jnp.where(magnitude >= 2, normal, mantissa * (126 << 23))
    bits = bits | ((nibbles & 8) << 28)  # the sign: code 8 is -0, as in mxfp4_unpack
    return pltpu.bitcast(bits, jnp.float32).reshape(rows * NIBBLES_PER_WORD, n)


def decode_mxfp4(codes: jax.Array, scales: jax.Array, mxfp4_decode: str) -> jax.Array:
    """codes uint32 [K/8, N], scales uint8 [K/32, N] -> bf16 [K, N], exactly mxfp4_unpack, by
    either path of MXFP4_DECODES (both give the same bits)."""
    values = e2m1_values(codes, mxfp4_decode, jnp.float32)  # [K, N]
    return (values * _per_k(e8m0_to_f32(scales), MXFP4_BLOCK)).astype(jnp.bfloat16)


def e2m1_values(codes: jax.Array, mxfp4_decode: str, dtype: Any) -> jax.Array:
    """codes uint32 [K/8, N] -> the E2M1 values [K, N] in `dtype` (f32, or float8_e4m3fn for the
    MXU: exact in both), by either path of MXFP4_DECODES."""
    if mxfp4_decode == "native":
        # bitcast splits word r into rows 8r..8r+7, low nibble first: the checkpoint's packing
        return pltpu.bitcast(codes, jnp.float4_e2m1fn).astype(dtype)
    return e2m1_to_f32(codes).astype(dtype)


def decode_fp8(values: jax.Array, scales: jax.Array) -> jax.Array:
    """values e4m3 [K, N], bf16 power-of-two scales [K/256, N] -> bf16 [K, N], exactly fp8_unpack."""
    scale = _per_k(scales.astype(jnp.float32), FP8_BLOCK)
    return (values.astype(jnp.float32) * scale).astype(jnp.bfloat16)


def decode_rows(part_refs: Sequence[Any], expert_format: str, row0: int, rows: int, *,
                mxfp4_decode: str) -> jax.Array:
    """Rows [row0, row0 + rows) of one stored matrix (refs in VMEM) -> bf16 [rows, N].
    row0 and rows are static and multiples of the format's scale block; mxfp4_decode is one of
    MXFP4_DECODES (read for MXFP4 only)."""
    if expert_format == "bf16":
        return part_refs[0][row0:row0 + rows, :]
    if expert_format == "fp8":
        values, scales = part_refs
        return decode_fp8(values[row0:row0 + rows, :],
                          scales[row0 // FP8_BLOCK:(row0 + rows) // FP8_BLOCK, :])
    codes, scales = part_refs
    return decode_mxfp4(codes[row0 // NIBBLES_PER_WORD:(row0 + rows) // NIBBLES_PER_WORD, :],
                        scales[row0 // MXFP4_BLOCK:(row0 + rows) // MXFP4_BLOCK, :], mxfp4_decode)


def mxu_rows(part_refs: Sequence[Any], expert_format: str, row0: int, rows: int, *,
             mxfp4_decode: str) -> tuple[jax.Array, jax.Array]:
    """Rows [row0, row0 + rows) of one stored fp8 or MXFP4 matrix (refs in VMEM) as the MXU takes
    them undecoded: (values float8_e4m3fn [rows, N], f32 scales [rows / block, N]). E2M1 codes
    become e4m3 exactly (every E2M1 value is one), by either path of MXFP4_DECODES."""
    if expert_format == "fp8":
        values, scales = part_refs
        return (values[row0:row0 + rows, :],
                scales[row0 // FP8_BLOCK:(row0 + rows) // FP8_BLOCK, :].astype(jnp.float32))
    codes, scales = part_refs
    values = e2m1_values(codes[row0 // NIBBLES_PER_WORD:(row0 + rows) // NIBBLES_PER_WORD, :],
                         mxfp4_decode, jnp.float8_e4m3fn)
    return values, e8m0_to_f32(scales[row0 // MXFP4_BLOCK:(row0 + rows) // MXFP4_BLOCK, :])


def matmul(x: jax.Array, part_refs: Sequence[Any], expert_format: str, *,
           mxfp4_decode: str, mxu_input: str = "bf16") -> jax.Array:
    """x bf16 [B, K] @ (one stored matrix in VMEM, chunk by chunk along K) -> f32 [B, N].

    mxu_input "bf16" (ModelConfig.expert_mxu): each chunk decoded to bf16 and multiplied; "fp8"
    (fp8 and MXFP4 formats): each chunk's values handed to the MXU as e4m3 and its scales applied
    after the dot (`numerics.block_scaled_matmul`, as the reference's `formats.mxu_matmul`).
    Decoding per K chunk keeps the temporaries small; f32 accumulation across chunks, in order.
    The fp8 chunks are `formats.mxu_k_chunk`'s (the fewest MXU passes at any B), the
    reference's."""
    k = x.shape[1]
    rows = (mxu_k_chunk(expert_format, k) if mxu_input == "fp8"
            else k_chunk(expert_format, k))
    acc = None
    for row0 in range(0, k, rows):
        if mxu_input == "fp8":
            values, scales = mxu_rows(part_refs, expert_format, row0, rows,
                                      mxfp4_decode=mxfp4_decode)
            part = block_scaled_matmul(x[:, row0:row0 + rows], values, scales)
        else:
            w = decode_rows(part_refs, expert_format, row0, rows,
                            mxfp4_decode=mxfp4_decode)  # [rows, N] bf16
            part = blocks.dot(x[:, row0:row0 + rows], w)
        acc = part if acc is None else acc + part
    return acc


# ---- a stand-alone decode kernel: HBM parts -> DMA -> decode in VMEM -> bf16 [K, N] ----------
def decode_body(*refs: Any, expert_format: str, mxfp4_decode: str) -> None:
    """refs = (*parts in HBM, out bf16 [K, N] in VMEM, *part buffers in VMEM, DMA sems [n_parts])."""
    n = len(part_names(expert_format))
    hbm, (out,), vmem, (sems,) = refs[:n], refs[n:n + 1], refs[n + 1:2 * n + 1], refs[2 * n + 1:]
    copies = [dma.Copy(src, dst, sems.at[i], name=f"decode/{name}")
              for i, (src, dst, name) in enumerate(zip(hbm, vmem, part_names(expert_format)))]
    for copy in copies:
        copy.start()
    for copy in copies:
        copy.wait()
    k = out.shape[0]
    rows = k_chunk(expert_format, k)
    with dma.phase("decode", vmem_bytes=out.size * 2):
        for row0 in range(0, k, rows):
            out[row0:row0 + rows, :] = decode_rows(vmem, expert_format, row0, rows,
                                                   mxfp4_decode=mxfp4_decode)


@functools.partial(jax.jit, static_argnames=("expert_format", "mxfp4_decode", "interpret",
                                             "recording"))
def _decode_call(parts: tuple, expert_format: str, mxfp4_decode: str, interpret: Any,
                 recording: bool) -> jax.Array:
    del recording  # only keeps recorded and silent traces apart in the jit cache
    k, n = _logical_shape(parts, expert_format)
    structs = part_structs(expert_format, k, n)
    call = functools.partial(
        pl.pallas_call,
        functools.partial(decode_body, expert_format=expert_format, mxfp4_decode=mxfp4_decode),
        out_shape=jax.ShapeDtypeStruct((k, n), jnp.bfloat16),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(parts),
        out_specs=pl.BlockSpec(memory_space=pltpu.MemorySpace.VMEM),
        scratch_shapes=[pltpu.VMEM(s.shape, s.dtype) for s in structs]
        + [pltpu.SemaphoreType.DMA((len(parts),))],
        interpret=interpret)
    # read off the body (kernels/base/costs.py), + the bf16 [K, N] result
    return costs.costed_call(call, *parts, io=(jax.ShapeDtypeStruct((k, n), jnp.bfloat16),))


def _logical_shape(parts: Sequence[Any], expert_format: str) -> tuple[int, int]:
    k_rows, n = parts[0].shape[-2:]
    return (k_rows * NIBBLES_PER_WORD if expert_format == "mxfp4" else k_rows), n


def decode(weight: Any, expert_format: str, *, chip: Any = None) -> jax.Array:
    """One stored [K, N] matrix (array or dict of parts, as in the parameter pytree) -> bf16 [K, N],
    decoded by a Pallas kernel in VMEM. Equals weights.dequantize(weight, expert_format) exactly.
    chip: the kernel is built for it (MXFP4 decode path, see mxfp4_decode_path; None: there)."""
    check_runs_here(chip)
    parts = split_parts(weight, expert_format)
    mxfp4_decode = mxfp4_decode_path(chip)
    want = part_structs(expert_format, *_logical_shape(parts, expert_format))
    for name, got, expect in zip(part_names(expert_format), parts, want):
        if got.shape != expect.shape or got.dtype != expect.dtype:
            raise ValueError(f"weight[{name!r}] has shape {got.shape} {got.dtype}: expected "
                             f"{expect.shape} {expect.dtype} for expert_format={expert_format!r}")
    return chip_log.run(lambda parts: _decode_call(parts, expert_format, mxfp4_decode,
                                                   tpu.interpret_params(), dma.is_recording()),
                        tuple(parts))
