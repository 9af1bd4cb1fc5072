"""Published checkpoints -> our parameter pytree, and our parameters -> a checkpoint.

`load_params(dir, cfg)` checks the whole checkpoint before it reads a weight: every header (a
missing shard or a truncated file), every name (a missing or an extra tensor), every shape and
dtype (FP8 weights need their `_scale_inv` block scales). Then it reads one layer at a time
(`names.layer_entries`), converts it (transposed, rope columns de-interleaved, FP8 block scales
applied, routed experts stacked and quantised into the expert format), and writes it into the
stacked arrays on the device: host memory holds one layer, never the whole model. Any failure
raises `CheckpointError` and returns nothing: no half-loaded parameters escape.

The conversion error of the routed experts (from the checkpoint's values, in f32, to our expert
format) is measured per matrix and returned in `stats` when a dict is passed: the largest
relative RMS error ‖ours − theirs‖ / ‖theirs‖ per format ("expert_rel_rms") and the largest
absolute error relative to the matrix's largest magnitude ("expert_rel_max").
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from mkresearch.checkpoint import gpt_oss_names
from mkresearch.checkpoint import names as names_module
from mkresearch.checkpoint.safetensors_io import (
    SCALE_SUFFIX,
    Shards,
    fp8_quantize,
    fp8_scale_shape,
    write_shards,
)
from mkresearch.model import formats, hf_fields, spec, weights
from mkresearch.model.config import ModelConfig

# the API of mkresearch.checkpoint is this module's: config.json's half comes from the model's reader
from mkresearch.model.hf_config import (  # noqa: F401 - re-exported
    CONFIG_FILE,
    CheckpointError,
    config_dict,
    config_from_dict,
    fp8_quantized,
    mxfp4_quantized,
    read_config,
)
from mkresearch.sharding import layout

FLOAT_DTYPES = ("BF16", "F16", "F32")


def _entries(cfg: ModelConfig, raw: dict[str, Any]) -> list[list[names_module.Entry]]:
    """The trunk's entries, then each layer's (`raw`: config.json, for the rope order and the
    published dense hidden)."""
    if gpt_oss_names.is_gpt_oss(cfg):
        mxfp4 = mxfp4_quantized(raw) if raw else cfg.expert_format == "mxfp4"
        return [gpt_oss_names.trunk_entries(cfg)] + [
            gpt_oss_names.layer_entries(cfg, layer, mxfp4=mxfp4) for layer in range(cfg.n_layers)]
    interleaved = bool(raw.get("rope_interleave", True))
    dense = raw.get("intermediate_size") if cfg.n_dense_layers else None
    try:
        names_module.check_supported(cfg)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    return [names_module.trunk_entries(cfg)] + [
        names_module.layer_entries(cfg, layer, interleaved=interleaved, dense_published=dense)
        for layer in range(cfg.n_layers)]


def _read_raw_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def mtp_tensors(names: set[str], cfg: ModelConfig) -> set[str]:
    """The multi-token-prediction modules' tensors (DeepSeek-V3, GLM-4.5 publish them as the
    layers after the last: `model.layers.{n_layers + i}.*`, i < n_mtp_layers): not part of the
    decode step, left unread (`weights.init_mtp_params` is the drafter's stand-in)."""
    prefixes = tuple(f"model.layers.{cfg.n_layers + i}." for i in range(cfg.n_mtp_layers))
    return {name for name in names if prefixes and name.startswith(prefixes)}


# A buffer older checkpoints saved with the weights (RoPE's inverse frequencies, which a model
# computes from its config): left unread, as transformers leaves it.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def ignored_tensors(names: set[str]) -> set[str]:
    """The tensors a checkpoint may carry that are not weights (IGNORED_SUFFIXES)."""
    return {name for name in names if name.endswith(IGNORED_SUFFIXES)}


def _check(shards: Shards, groups: list[list[names_module.Entry]], fp8: bool,
           cfg: ModelConfig) -> None:
    """Every expected tensor present with its shape and dtype, and nothing else (bar the MTP
    modules' tensors and the ignored buffers)."""
    expected: set[str] = mtp_tensors(shards.names(), cfg) | ignored_tensors(shards.names())
    for entry in (e for group in groups for e in group):
        for n, (name, shape) in enumerate(zip(entry.names, entry.shapes)):
            expected.add(name)
            if name not in shards.where:
                raise CheckpointError(f"tensor {name} is missing: expected {list(shape)} "
                                      f"(for our {'.'.join(entry.key)})")
            got, dtype = shards.shape(name), shards.dtype(name)
            where = shards.where[name].path  # the file, named with the tensor
            if got != shape:
                raise CheckpointError(f"{where}: tensor {name} has shape {list(got)}: expected "
                                      f"{list(shape)}")
            required = entry.dtypes[n] if entry.dtypes else None
            if required is not None:  # MXFP4 blocks and scales: bytes as stored
                if dtype != required:
                    raise CheckpointError(f"{where}: tensor {name} has dtype {dtype}: expected "
                                          f"{required} (MXFP4 as released)")
            elif dtype == "F8_E4M3" and entry.linear:
                if not fp8:
                    raise CheckpointError(f"tensor {name} is F8_E4M3 but config.json has no fp8 "
                                          "quantization_config")
                scale = name + SCALE_SUFFIX
                expected.add(scale)
                if scale not in shards.where:
                    raise CheckpointError(f"tensor {scale} is missing: expected "
                                          f"{list(fp8_scale_shape(shape))} F32 (FP8 block scales)")
                if shards.shape(scale) != fp8_scale_shape(shape) or shards.dtype(scale) != "F32":
                    raise CheckpointError(
                        f"tensor {scale} is {list(shards.shape(scale))} {shards.dtype(scale)}: "
                        f"expected {list(fp8_scale_shape(shape))} F32")
            elif dtype not in FLOAT_DTYPES:
                allowed = ", ".join(FLOAT_DTYPES + (("F8_E4M3",) if entry.linear else ()))
                raise CheckpointError(f"{where}: tensor {name} has dtype {dtype}: expected one of "
                                      f"{allowed}")
    extra = sorted(shards.names() - expected)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"tensor {extra[0]} is unexpected{more}: not a weight of this "
                              "config's model")


def check_checkpoint(directory: str | os.PathLike, cfg: ModelConfig | None = None) -> ModelConfig:
    """Everything `load_params` checks before reading a weight (config.json, every shard's header,
    every tensor's name, shape and dtype), reading none: the config, or `CheckpointError`."""
    directory = os.fspath(directory)
    if cfg is None:
        cfg = read_config(directory)
    open_checked(directory, cfg)
    return cfg


def open_checked(directory: str, cfg: ModelConfig) -> tuple[Shards, list[list[names_module.Entry]]]:
    """The checkpoint's shards (every header read) and its entries (the trunk's, then each
    layer's), every tensor checked against cfg (`_check`): what a load reads from."""
    raw = _read_raw_config(directory)
    groups = _entries(cfg, raw)
    shards = Shards(directory)
    try:
        _check(shards, groups, fp8_quantized(raw), cfg)
    except CheckpointError as error:
        raise CheckpointError(f"{error}{_defaulted_note(raw)}") from None
    return shards, groups


def _defaulted_note(raw: dict) -> str:
    """A shape or name that does not match may come from a size config.json left out: the
    fields read as transformers' defaults, named (or nothing)."""
    defaults = hf_fields.DEFAULTS.get(raw.get("model_type"), {})
    missing = [f for f, v in defaults.items() if raw.get(f) is None and isinstance(v, int)
               and not isinstance(v, bool)]
    if not missing:
        return ""
    shown = ", ".join(f"{f}={defaults[f]}" for f in missing[:4])
    more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
    return (f" (config.json leaves out {shown}{more}: read as transformers' defaults for "
            f"model_type {raw.get('model_type')!r})")


@functools.partial(jax.jit, donate_argnums=0)
def _set(stack: Any, index: jax.Array, value: Any) -> Any:
    return jax.tree.map(lambda s, v: jax.lax.dynamic_update_index_in_dim(s, v, index, 0),
                        stack, value)


def _conversion_error(theirs: np.ndarray, ours: Any, fmt: str, stats: dict) -> None:
    back = np.asarray(formats.dequantize(ours, fmt), np.float32)
    diff = back - theirs
    norm = float(np.sqrt(np.sum(theirs.astype(np.float64) ** 2))) or 1.0
    rel_rms = float(np.sqrt(np.sum(diff.astype(np.float64) ** 2))) / norm
    rel_max = float(np.max(np.abs(diff))) / (float(np.max(np.abs(theirs))) or 1.0)
    stats["expert_rel_rms"] = max(stats.get("expert_rel_rms", 0.0), rel_rms)
    stats["expert_rel_max"] = max(stats.get("expert_rel_max", 0.0), rel_max)


def _place(params: dict, key: tuple[str, ...], index: int | None, value: Any) -> dict:
    node = params
    for part in key[:-1]:
        node = node[part]
    node[key[-1]] = value if index is None else _set(node[key[-1]], jnp.int32(index), value)
    return params


def load_params(directory: str | os.PathLike, cfg: ModelConfig, *,
                expert_format: str | None = None, ranks: int | None = None,
                progress: bool = True, stats: dict | None = None) -> dict[str, Any]:
    """The checkpoint in `directory` as our parameter pytree for `cfg` (what
    `weights.init_params(cfg)` returns), experts in `expert_format` (default cfg.expert_format;
    the pytree is then cfg.replace(expert_format=...)'s). With `ranks`, every leaf is the ranks'
    slices stacked on a leading axis (`layout.shard_params` of our layout over `ranks`). A
    progress bar counts the layers unless `progress=False`; `stats` (a dict) receives the routed
    experts' conversion errors (module docstring). Bad input: `CheckpointError`, one line."""
    directory = os.fspath(directory)
    if expert_format is not None:
        try:
            cfg = cfg.replace(expert_format=expert_format)
        except ValueError as error:
            raise CheckpointError(str(error)) from None
    try:
        spec.check(cfg)
        lay = layout.layout(cfg, ranks) if ranks is not None else None
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    shards, groups = open_checked(directory, cfg)
    stats = {} if stats is None else stats
    table = spec.param_table(cfg)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), weights.param_shapes(cfg))
    if not cfg.router_bias and "moe_full" in params:  # Qwen3: no correction bias published
        params["moe_full"]["router_bias"] = jnp.zeros_like(params["moe_full"]["router_bias"])
    bar = tqdm(groups, desc=f"loading {os.path.basename(directory.rstrip(os.sep))}", unit="layer",
               disable=not progress)
    for group in bar:
        for entry in group:
            if entry.packed:
                value = _packed_value(entry, shards, cfg, stats, table)
                params = _place(params, entry.key, entry.index, value)
                continue
            ours = entry.to_ours([shards.read_f32(name) for name in entry.names])
            leaf = table
            for part in entry.key:
                leaf = leaf[part]
            if entry.quantized:
                value = formats.quantize(jnp.asarray(ours), cfg.expert_format)
                _conversion_error(ours, value, cfg.expert_format, stats)
            else:
                value = jnp.asarray(ours, leaf.dtype)
            params = _place(params, entry.key, entry.index, value)
    bar.close()
    if lay is not None:
        return layout.shard_params(params, lay)
    return params


def _packed_value(entry: names_module.Entry, shards: Shards, cfg: ModelConfig,
                  stats: dict, table: dict) -> Any:
    """A packed entry's value as cfg keeps it (`table`: cfg's spec.param_table): one leaf in its
    dtype, or a subtree (GPT-OSS's experts of one layer): MXFP4 parts as
    read when cfg's experts are MXFP4 (no value decoded), else decoded into cfg.expert_format;
    f32 matrices (a bf16 checkpoint) quantised into it, with their conversion error in `stats`;
    biases bf16."""
    raw = [shards.read(name) for name in entry.names]  # as stored: bf16 stays bf16
    tree = entry.to_ours(raw)
    del raw
    if not isinstance(tree, dict):  # one leaf of ours, in its dtype
        leaf = table
        for part in entry.key:
            leaf = leaf[part]
        return jnp.asarray(tree, leaf.dtype)
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):  # MXFP4 parts, read as released
            if cfg.expert_format == "mxfp4":
                out[key] = {part: jnp.asarray(array) for part, array in value.items()}
            else:  # asked for another format: one layer decoded at a time
                out[key] = formats.quantize(formats.mxfp4_unpack(value), cfg.expert_format)
        elif key in formats.EXPERT_MATRICES:
            out[key] = formats.quantize(jnp.asarray(value, jnp.float32), cfg.expert_format)
            _conversion_error(np.asarray(value, np.float32), out[key], cfg.expert_format, stats)
        else:
            out[key] = jnp.asarray(value, jnp.bfloat16)
    return out


# ---- writing ---------------------------------------------------------------------------------
def _published(entry: names_module.Entry, params: dict, cfg: ModelConfig,
               fp8: bool) -> dict[str, np.ndarray]:
    value = params
    for part in entry.key:
        value = value[part]
    if entry.index is not None:
        value = jax.tree.map(lambda v: v[entry.index], value)
    if entry.packed:  # as we store them: MXFP4 bytes, bf16 (f32 where ours are f32)
        return dict(zip(entry.names, (np.asarray(array) for array in entry.to_published(value))))
    if entry.quantized:
        value = formats.dequantize(value, cfg.expert_format)
    ours = np.asarray(jnp.asarray(value, jnp.float32))
    out: dict[str, np.ndarray] = {}
    for name, array in zip(entry.names, entry.to_published(ours)):
        if fp8 and entry.linear:
            out[name], out[name + SCALE_SUFFIX] = fp8_quantize(array)
        elif np.asarray(value).dtype == np.float32:
            out[name] = array.astype(np.float32)
        else:
            out[name] = array.astype(jnp.bfloat16)
    return out


def write_checkpoint(directory: str | os.PathLike, params: dict[str, Any], cfg: ModelConfig, *,
                     fp8: bool = False, shards: int = 1) -> None:
    """`params` (for cfg) as a checkpoint in the published layout: config.json, safetensors in
    `shards` files with `model.safetensors.index.json` when more than one, bf16 weights (f32
    where ours are f32), or with `fp8` every projection FP8 e4m3 with 128x128 `_scale_inv` block
    scales as DeepSeek-V3 ships them (the embedding, LM head, router and norms stay bf16)."""
    directory = os.fspath(directory)
    groups = _entries(cfg, {})
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as handle:
        json.dump(config_dict(cfg, fp8=fp8), handle, indent=1)
    tensors = ({k: v for entry in group for k, v in _published(entry, params, cfg, fp8).items()
                if not (entry.key[-1] == "router_bias" and not cfg.router_bias)}
               for group in groups)
    write_shards(directory, tensors, len(groups), shards)
