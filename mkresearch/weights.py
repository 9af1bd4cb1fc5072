"""Parameters of one decode-step model: shapes, deterministic initialisation, expert quantisation.

Layout (DEVELOPERS.md "Parameters"): matrices are [in, out]; per-layer weights are stacked by kind
along a leading axis (`kda`, `mla`, `dense`, `moe`), so `params["kda"]["w_q"][i]` belongs to layer
`cfg.kda_layers[i]`. Routed experts are stored in `cfg.expert_format` (spec §7):

- bf16:  a bf16 array `[.., K, N]`
- fp8:   {"values": float8_e4m3fn [.., K, N], "scales": bf16 [.., K/256, N]}, scales powers of two
- mxfp4: {"codes": uint32 [.., K/8, N], "scales": uint8 [.., K/32, N]}: 8 E2M1 nibbles per uint32,
         the low nibble is the lowest K; E8M0 scale 2^(e-127) per 32 consecutive K values.

K is always the input dim of the matrix (the latent for W1/W3, the expert hidden for W2).

Initialisation: every leaf is drawn from its own numpy stream seeded by (seed, leaf path), at f32,
with matrices ~ N(0, 1/in) so every projection keeps an O(1) RMS; norm weights near 1; embedding
rows RMS 1. Experts are generated at full precision, then quantised into the format.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkresearch.config import EXPERT_FORMATS, FP8_BLOCK, MXFP4_BLOCK, ModelConfig

# E2M1 magnitudes indexed by the low 3 bits of a code; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX_EXP = 2  # largest E2M1 magnitude 6 = 1.5 * 2^2
E2M1_UPSCALE_ABOVE = 1.75  # max/scale > 7 would clip to 6; 3.5 = midpoint of 3 and 4 one binade down
E4M3_MAX = 448.0
E4M3_MAX_EXP = 8  # largest e4m3fn magnitude 448 = 1.75 * 2^8
E4M3_UPSCALE_ABOVE = 1.8125  # max/scale > 464 would clip to 448; 232 = midpoint of 224 and 240
NIBBLES_PER_WORD = 8
EXPERT_MATRICES = ("w1", "w3", "w2")


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
    magnitude = jnp.asarray(E2M1_VALUES, jnp.float32)[nibbles & 7]
    values = jnp.where(nibbles & 8, -magnitude, magnitude)
    scale = _pow2(scales.astype(jnp.int32) - 127)
    return (values * _per_k(scale, MXFP4_BLOCK)).astype(dtype)


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


def _quantized_shapes(shape: tuple[int, ...], fmt: str) -> Any:
    *lead, k, n = shape
    if fmt == "bf16":
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    if fmt == "fp8":
        return {"values": jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
                "scales": jax.ShapeDtypeStruct((*lead, k // FP8_BLOCK, n), jnp.bfloat16)}
    return {"codes": jax.ShapeDtypeStruct((*lead, k // NIBBLES_PER_WORD, n), jnp.uint32),
            "scales": jax.ShapeDtypeStruct((*lead, k // MXFP4_BLOCK, n), jnp.uint8)}


# ---- the parameter table ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Leaf:
    """One parameter: logical shape, stored dtype, and how to draw it.

    init: ("normal", std) | ("uniform", low, high) | ("log_uniform", low, high) (stores log x).
    quantized: a routed-expert matrix, stored in cfg.expert_format.
    """

    shape: tuple[int, ...]
    dtype: Any
    init: tuple
    quantized: bool = False


def _matrix(n_in: int, n_out: int, lead: tuple[int, ...] = (), quantized: bool = False) -> _Leaf:
    return _Leaf((*lead, n_in, n_out), jnp.bfloat16, ("normal", n_in ** -0.5), quantized)


def _norm(shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> _Leaf:
    # plain gamma near 1 (not exactly 1, so a kernel that forgets gamma fails its test)
    return _Leaf(shape, dtype, ("uniform", 0.8, 1.2))


def _table(cfg: ModelConfig) -> dict[str, Any]:
    d, L, V, H = cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.n_heads
    D, R = cfg.kda_head_dim, cfg.kda_gate_rank
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    n_dense, n_moe = len(cfg.dense_layers), len(cfg.moe_layers)
    mix_std = d ** -0.5  # <v/rms(v), w> ~ N(0, 1): softmax over candidates neither flat nor one-hot
    table: dict[str, Any] = {
        "embed": _Leaf((V, d), jnp.bfloat16, ("normal", 1.0)),  # rows of RMS 1
        "lm_head": _matrix(d, V),
        "final_norm": _norm((d,)),
        "mix_out": _Leaf((d,), jnp.float32, ("normal", mix_std)),
        "mix_attn": _Leaf((L, d), jnp.float32, ("normal", mix_std)),
        "mix_mlp": _Leaf((L, d), jnp.float32, ("normal", mix_std)),
        "attn_norm": _norm((L, d)),
        "mlp_norm": _norm((L, d)),
    }
    if n_kda:
        k = (n_kda,)
        table["kda"] = {
            "w_fa": _matrix(d, R, k), "w_fb": _matrix(R, H * D, k),
            "w_q": _matrix(d, H * D, k), "w_k": _matrix(d, H * D, k),
            "w_v": _matrix(d, H * D, k), "w_g": _matrix(d, H * D, k),
            "w_b": _matrix(d, H, k),
            "conv_w": _Leaf((*k, 3, cfg.kda_conv_size, H * D), jnp.bfloat16,
                            ("normal", cfg.kda_conv_size ** -0.5)),
            # exp(a_log) in [1, 4]: the decay gate responds to g_raw without saturating
            "a_log": _Leaf((*k, H), jnp.float32, ("log_uniform", 1.0, 4.0)),
            "dt_bias": _Leaf((*k, H * D), jnp.float32, ("uniform", -1.0, 1.0)),
            "o_norm": _norm((*k, D)),
            "w_o": _matrix(H * D, d, k),
        }
    if n_mla:
        m = (n_mla,)
        table["mla"] = {
            "w_qa": _matrix(d, cfg.mla_q_rank, m), "q_norm": _norm((*m, cfg.mla_q_rank)),
            "w_qb": _matrix(cfg.mla_q_rank, H * cfg.mla_qk_dim, m),
            "w_kva": _matrix(d, cfg.mla_kv_rank + cfg.mla_qk_extra, m),
            "kv_norm": _norm((*m, cfg.mla_kv_rank)),
            "w_kvb": _matrix(cfg.mla_kv_rank, H * (cfg.mla_qk_nope + cfg.mla_v_dim), m),
            "w_g": _matrix(d, H * cfg.mla_v_dim, m),
            "w_o": _matrix(H * cfg.mla_v_dim, d, m),
        }
    if n_dense:
        f = (n_dense,)
        table["dense"] = {
            "w_gate": _matrix(d, cfg.dense_hidden, f), "w_up": _matrix(d, cfg.dense_hidden, f),
            "w_down": _matrix(cfg.dense_hidden, d, f),
        }
    if n_moe:
        e = (n_moe,)
        E, Lat, Fe = cfg.n_experts, cfg.moe_latent, cfg.expert_hidden
        moe: dict[str, Any] = {
            "w_router": _matrix(d, E, e),
            # small correction bias: changes some selections, never dominates the scores
            "router_bias": _Leaf((*e, E), jnp.float32, ("normal", 0.05)),
            "w_ld": _matrix(d, Lat, e),
            "latent_norm": _norm((*e, Lat), jnp.float32),
            "w_lu": _matrix(Lat, d, e),
            "experts": {
                "w1": _matrix(Lat, Fe, (*e, E), quantized=True),
                "w3": _matrix(Lat, Fe, (*e, E), quantized=True),
                "w2": _matrix(Fe, Lat, (*e, E), quantized=True),
            },
        }
        if cfg.n_shared_experts:
            moe.update(w_sg=_matrix(d, cfg.shared_hidden, e), w_su=_matrix(d, cfg.shared_hidden, e),
                       w_sd=_matrix(cfg.shared_hidden, d, e))
        table["moe"] = moe
    return table


def _is_leaf(x: Any) -> bool:
    return isinstance(x, _Leaf)


def _check_cfg(cfg: Any) -> None:
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg={cfg!r} is invalid: a mkresearch.config.ModelConfig")  # noqa: TRY004


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The parameter pytree as jax.ShapeDtypeStruct leaves: no allocation, safe at full size."""
    _check_cfg(cfg)

    def shape_of(leaf: _Leaf) -> Any:
        if leaf.quantized:
            return _quantized_shapes(leaf.shape, cfg.expert_format)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)

    return jax.tree.map(shape_of, _table(cfg), is_leaf=_is_leaf)


def _draw(leaf: _Leaf, rng: np.random.Generator) -> np.ndarray:
    kind, *args = leaf.init
    if kind == "normal":
        return rng.standard_normal(leaf.shape, dtype=np.float32) * np.float32(args[0])
    if kind == "uniform":
        return rng.uniform(args[0], args[1], leaf.shape).astype(np.float32)
    if kind == "log_uniform":
        return np.log(rng.uniform(args[0], args[1], leaf.shape)).astype(np.float32)
    raise AssertionError(kind)


_quantize_jit = jax.jit(quantize, static_argnames="fmt")


def init_params(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """The parameter pytree of `param_shapes(cfg)`, filled deterministically from (cfg, seed)."""
    _check_cfg(cfg)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} is invalid: an int >= 0")

    def fill(path: tuple, leaf: _Leaf) -> Any:
        name = jax.tree_util.keystr(path)
        rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
        values = _draw(leaf, rng)
        if leaf.quantized:
            return _quantize_jit(values, fmt=cfg.expert_format)
        return jnp.asarray(values, leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, _table(cfg), is_leaf=_is_leaf)


# ---- sizes -----------------------------------------------------------------------------------
def nbytes(tree: Any) -> int:
    """Total bytes of a pytree of arrays or ShapeDtypeStructs."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def n_values(tree: Any) -> int:
    """Number of logical values (parameters) in a parameter pytree of any expert format.

    MXFP4 codes count 8 values per uint32; quantisation scales are not parameters.
    """
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        key = getattr(path[-1], "key", None)
        size = int(np.prod(x.shape))
        if key == "scales":
            continue
        total += size * (NIBBLES_PER_WORD if key == "codes" else 1)
    return total


def expert_nbytes(cfg: ModelConfig) -> int:
    """Bytes of ONE routed expert (w1 + w3 + w2) in cfg.expert_format, scales included."""
    _check_cfg(cfg)
    experts = param_shapes(cfg).get("moe", {}).get("experts")
    if experts is None:
        return 0
    return nbytes(experts) // (len(cfg.moe_layers) * cfg.n_experts)
