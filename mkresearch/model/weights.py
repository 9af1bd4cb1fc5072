"""Parameters of one decode-step model: shapes and deterministic initialisation.

Layout (DEVELOPERS.md "Parameters"): matrices are [in, out]; per-layer weights are stacked by kind
along a leading axis (`params[kind][name][i]` belongs to layer `cfg.layers_of(kind)[i]`), beside
the trunk (embedding, LM head, norms, the residual strategy's weights). What each kind stores is
declared once, in the stage registry (`mkresearch.model.spec`, kinds in `mkresearch.model.stages`); routed
experts are stored in `cfg.expert_format` (`mkresearch.model.formats`, docs/kimi-k3.md §7).

Initialisation: every leaf is drawn from its own numpy stream seeded by (seed, leaf path), at f32,
with matrices ~ N(0, 1/in) so every projection keeps an O(1) RMS; norm weights near 1; embedding
rows RMS 1. Experts are generated at full precision, then quantised into the format. Widths padded
to whole lanes (GPT-OSS's 2880) have their padding zero (`zero_padding`).

Memory: a leaf is made on the host and sent to the device once, in its stored dtype: f32 values
never reach the device, and a stacked leaf is drawn and quantised one slice of its leading axis
at a time (the same numbers: numpy fills an array element by element from its stream), so the
host holds one slice at f32 and the device only what the model stores. A model whose weights fit
the chip's HBM is initialised there (Qwen3-30B-A3B's shapes at 8 layers on a v5e).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import mkresearch.model.stages  # noqa: F401 - registers the built-in stage kinds
from mkresearch.model import mtp, spec
from mkresearch.model.config import MXFP4_BLOCK, ModelConfig
from mkresearch.model.formats import (  # noqa: F401 - the formats, re-exported where they were
    E2M1_VALUES,
    EXPERT_MATRICES,
    NIBBLES_PER_WORD,
    dequantize,
    expert_format_of,
    fp8_pack,
    fp8_unpack,
    mxfp4_pack,
    mxfp4_unpack,
    quantize,
    quantized_shapes,
)


def _is_leaf(x: Any) -> bool:
    return isinstance(x, spec.Param)


def _shape_of(cfg: ModelConfig, leaf: spec.Param) -> Any:
    if leaf.quantized:
        return quantized_shapes(leaf.shape, cfg.expert_format)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The parameter pytree as jax.ShapeDtypeStruct leaves: no allocation, safe at full size."""
    return jax.tree.map(functools.partial(_shape_of, cfg), spec.param_table(cfg), is_leaf=_is_leaf)


def _draw(leaf: spec.Param, rng: np.random.Generator) -> np.ndarray:
    kind, *args = leaf.init
    if kind == "normal":
        return rng.standard_normal(leaf.shape, dtype=np.float32) * np.float32(args[0])
    if kind == "uniform":
        return rng.uniform(args[0], args[1], leaf.shape).astype(np.float32)
    if kind == "log_uniform":
        return np.log(rng.uniform(args[0], args[1], leaf.shape)).astype(np.float32)
    raise AssertionError(kind)


_quantize_jit = jax.jit(quantize, static_argnames="fmt")


def padded_widths(cfg: ModelConfig) -> dict[int, int]:
    """{our width: the checkpoint's} of the widths cfg pads to whole lanes (GPT-OSS: d_model and
    expert_hidden 2944 from 2880; ModelConfig.d_model_checkpoint), none for most models."""
    return {ours: theirs for ours, theirs in ((cfg.d_model, cfg.d_model_checkpoint),
                                              (cfg.expert_hidden, cfg.expert_hidden_checkpoint))
            if theirs and theirs != ours}


def unpadded_shape(shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...]:
    """A parameter's logical shape as the checkpoint has it: every axis of a padded width at the
    checkpoint's width (`padded_widths`)."""
    widths = padded_widths(cfg)
    return tuple(widths.get(length, length) for length in shape)


def zero_padding(values: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`values` (one parameter, at its logical shape) with the padding of every axis of a padded
    width zero (`padded_widths`: an axis as long as d_model holds d_model_checkpoint values, then
    zeros), so the hidden state's padding stays zero and no output changes (the config refuses
    widths that would make an axis ambiguous)."""
    for ours, theirs in padded_widths(cfg).items():
        for axis, length in enumerate(values.shape):
            if length == ours:
                index = [slice(None)] * values.ndim
                index[axis] = slice(theirs, None)
                values[tuple(index)] = 0
    return values


def _fill(table: Any, cfg: ModelConfig, seed: int, prefix: str = "") -> dict[str, Any]:
    """Arrays for a table of spec.Param, each leaf from its own stream seeded by (seed, prefix +
    leaf path)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} is invalid: an int >= 0")

    def fill(path: tuple, leaf: spec.Param) -> Any:
        name = prefix + jax.tree_util.keystr(path)
        rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
        if not leaf.quantized:
            values = zero_padding(_draw(leaf, rng), cfg)
            return jax.device_put(values.astype(jnp.dtype(leaf.dtype)))
        one = dataclasses.replace(leaf, shape=leaf.shape[1:])  # a slice: one layer's experts
        slices = [_on_host(zero_padding(_draw(one, rng), cfg), cfg.expert_format)
                  for _ in range(leaf.shape[0])]
        return jax.tree.map(_stacked, *slices)

    return jax.tree_util.tree_map_with_path(fill, table, is_leaf=_is_leaf)


def _on_host(values: np.ndarray, fmt: str) -> Any:
    """`quantize(values, fmt)` computed on the host's CPU device, as numpy arrays (traced values
    where init_params is itself traced, e.g. under jax.eval_shape)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        parts = _quantize_jit(jax.device_put(values, cpu), fmt=fmt)
    return jax.tree.map(lambda p: p if isinstance(p, jax.core.Tracer) else np.asarray(p), parts)


def _stacked(*parts: Any) -> jax.Array:
    """The slices of a leaf as one array, sent to the device once."""
    if any(isinstance(p, jax.core.Tracer) for p in parts):
        return jnp.stack(parts)
    return jax.device_put(np.stack(parts))


def init_params(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """The parameter pytree of `param_shapes(cfg)`, filled deterministically from (cfg, seed)."""
    spec.check(cfg)
    return _fill(spec.param_table(cfg), cfg, seed)


# ---- random weights drawn on the device, straight into the stored formats ---------------------
E2M1_RMS = float(np.sqrt(np.mean(np.square(E2M1_VALUES))))  # of a uniformly random nibble


def random_params(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """Random weights of `param_shapes(cfg)` drawn on the default device, leaf by leaf, for a
    full-size model timed on one chip (gpt-oss-20b on a 16 GB v5e: `init_params` draws each
    expert stack at full precision first, 27 GB of f32 for gpt-oss-20b's W1 alone). Each leaf's
    distribution is `init_params`'s, not its values: normal / uniform leaves drawn in f32 and
    rounded to their dtype; MXFP4 experts drawn as they are stored, uniformly random codes with
    the one E8M0 scale that gives them the RMS of the leaf's normal (no full-precision matrix
    ever exists); other expert formats drawn at full precision and quantised on the device. The
    padding of widths rounded up to whole lanes is zero, as `init_params`'."""
    spec.check(cfg)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} is invalid: an int >= 0")
    key = jax.random.key(int(seed))

    def draw(path: tuple, leaf: spec.Param) -> Any:
        leaf_key = jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()))
        return _random_leaf(leaf_key, leaf, cfg)

    return jax.tree_util.tree_map_with_path(draw, spec.param_table(cfg), is_leaf=_is_leaf)


def _random_leaf(key: jax.Array, leaf: spec.Param, cfg: ModelConfig) -> Any:
    unpadded = unpadded_shape(leaf.shape, cfg)
    if leaf.quantized and cfg.expert_format == "mxfp4":
        *lead, k, n = leaf.shape
        exponent = int(np.round(np.log2(leaf.init[1] / E2M1_RMS)))  # the normal's std
        parts = {"codes": jax.ShapeDtypeStruct((*lead, k // NIBBLES_PER_WORD, n), jnp.uint32),
                 "scales": jax.ShapeDtypeStruct((*lead, k // MXFP4_BLOCK, n), jnp.uint8)}
        stack = {name: jnp.zeros(s.shape, s.dtype) for name, s in parts.items()}
        for i in range(lead[0]):  # one layer at a time: the stack and one layer's slice alive
            part = _random_mxfp4(jax.random.fold_in(key, i), tuple(lead[1:]), k, n,
                                 unpadded[-2], unpadded[-1], exponent + 127)
            stack = _put(stack, i, part)
        return stack
    dtype = jnp.float32 if leaf.quantized else leaf.dtype
    values = _random_values(key, leaf.shape, leaf.init, unpadded, jnp.dtype(dtype))
    if leaf.quantized:
        return _quantize_jit(values, fmt=cfg.expert_format)
    return values


@functools.partial(jax.jit, donate_argnums=0)
def _put(stack: Any, index: int, part: Any) -> Any:
    return jax.tree.map(lambda s, v: jax.lax.dynamic_update_index_in_dim(s, v, index, 0),
                        stack, part)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_values(key: jax.Array, shape: tuple, init: tuple, unpadded: tuple,
                   dtype: Any) -> jax.Array:
    """A leaf drawn in its own dtype (no f32 copy of a bf16 embedding), its padding zero."""
    kind, *args = init
    if kind == "normal":
        values = jax.random.normal(key, shape, dtype) * jnp.asarray(args[0], dtype)
    elif kind == "uniform":
        values = jax.random.uniform(key, shape, dtype, args[0], args[1])
    else:  # "log_uniform"
        values = jnp.log(jax.random.uniform(key, shape, dtype, args[0], args[1]))
    for axis, (ours, theirs) in enumerate(zip(shape, unpadded)):
        if theirs != ours:  # the padding: zero
            index = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
            values = jnp.where(index < theirs, values, jnp.zeros((), dtype))
    return values


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _random_mxfp4(key: jax.Array, lead: tuple, k: int, n: int, k_used: int, n_used: int,
                  scale: int) -> dict[str, jax.Array]:
    """One layer's MXFP4 experts [*lead, K/8, N] / [*lead, K/32, N]: random codes, one scale."""
    codes = jax.random.bits(key, (*lead, k // NIBBLES_PER_WORD, n), jnp.uint32)
    shape = codes.shape
    used = ((jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 2) < k_used // NIBBLES_PER_WORD)
            & (jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1) < n_used))
    codes = jnp.where(used, codes, jnp.uint32(0))  # the padding: zero values
    return {"codes": codes,
            "scales": jnp.full((*lead, k // MXFP4_BLOCK, n), scale, jnp.uint8)}


# ---- multi-token-prediction modules (DeepSeek-V3): a draft model, apart from the step ----------
MTP_PREFIX = "mtp"  # their leaves' streams: distinct from every step weight's, which stay as they are


def mtp_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The MTP modules' parameters (`mkresearch.model.mtp.param_table`) as ShapeDtypeStructs; a config
    with n_mtp_layers = 0 is a ValueError."""
    return jax.tree.map(functools.partial(_shape_of, cfg), mtp.param_table(cfg), is_leaf=_is_leaf)


def init_mtp_params(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """The MTP modules' weights [n_mtp_layers, ...], drawn as `init_params` draws the step's (their
    own streams: `init_params` is unchanged by them)."""
    spec.check(cfg)
    return _fill(mtp.param_table(cfg), cfg, seed, MTP_PREFIX)


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
    routed = [kind for kind in spec.stages_of(cfg) if kind.routed]
    if not routed:
        return 0
    experts = param_shapes(cfg)[routed[0].name]["experts"]
    return nbytes(experts) // (len(cfg.layers_of(routed[0].name)) * cfg.n_experts)
