"""A recorded megakernel step (its DMA log) scaled to another config's shapes, for
`timeline.simulate`: what the mini model's step would move at full size, or on one rank of a pod
(`mkresearch.cli.bench.scale_to_rank`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np

from mkresearch.kernels.base import quant, weight_stream
from mkresearch.kernels.stages import residuals
from mkresearch.model import reference, roofline, spec, weights
from mkresearch.model.config import ModelConfig
from mkresearch.prediction import timeline


def _per_layer_bytes(tree: Any) -> int:
    return math.prod(tree.shape[1:]) * np.dtype(tree.dtype).itemsize


def _dma_prefix(streamed: tuple) -> str | None:
    """An attention kind's DMA-log prefix ('kda.', 'mla.', 'gqa.'): its streamed matrices are
    logged as prefix + weights key."""
    return next((m.name[:-len(m.key)] for m in streamed if m.name.endswith(m.key)), None)


def _byte_table(cfg: ModelConfig, batch: int) -> dict[str, float]:
    """DMA-log name (or name prefix) -> bytes one event of that name moves in a step of `cfg`
    (one layer's matrix, one KV token, one expert's part, one row of a vector...), for every
    stage kind of the model (`spec.stages_of`)."""
    params = weights.param_shapes(cfg)
    logical = spec.param_table(cfg)
    streamed = weight_stream.streamed_matrices(cfg)  # the matrices' DMA-log names
    caches = spec.state_table(cfg, 1, 1)  # one row, one token
    table: dict[str, float] = {}
    for stage in spec.stages_of(cfg):
        kind = stage.name
        for matrix in streamed.get(kind, ()):
            table[matrix.name] = _per_layer_bytes(params[kind][matrix.key])
        prefix = _dma_prefix(streamed.get(kind, ())) if stage.role == spec.ATTENTION else None
        if prefix:  # every weight of an attention kind, streamed or loaded whole
            for key, leaf in params[kind].items():
                table[prefix + key] = _per_layer_bytes(leaf)
            cache = sum(_per_layer_bytes(leaf) for leaf in caches.get(kind, {}).values()
                        if leaf.kind == spec.CACHE)
            if cache:  # KV tiles and the new token's entry: per token
                table[prefix + "kv"] = table[prefix + "kv_update"] = cache
        for key, name in (("router_bias", "router/bias"), ("latent_norm", "latent/norm")):
            if key in params[kind]:
                table[name] = _per_layer_bytes(params[kind][key])
        if stage.routed:
            for m in ("w1", "w3", "w2"):
                k, n = logical[kind]["experts"][m].shape[-2:]
                for part, struct in zip(quant.part_names(cfg.expert_format),
                                        quant.part_structs(cfg.expert_format, k, n)):
                    table[f"expert/{m}/{part}"] = struct.size * np.dtype(struct.dtype).itemsize
    if "kda" in cfg.kinds:
        state = jax.eval_shape(lambda: reference.init_state(cfg, batch, 1))
        table["kda.conv_state"] = _per_layer_bytes(state["kda"]["conv"])
        table["kda.state"] = _per_layer_bytes(state["kda"]["recurrent"])
    for name in ("embed", "mix_attn", "attn_norm", "mix_mlp", "mlp_norm", "mix_out",
                 "final_norm"):
        table[name] = cfg.d_model
    table["lm_head"] = cfg.d_model * cfg.vocab_size
    table["router/ids_to_smem"] = table["router/weights_to_smem"] = cfg.top_k
    return table


def _table_key(name: str, table: dict) -> str | None:
    """`name` if the table has it, else the longest table name it extends ('gqa.kv.k' -> 'gqa.kv',
    'mla.kv_update.ckv.read' -> 'mla.kv_update')."""
    if name in table:
        return name
    prefixes = [key for key in table if name.startswith(key + ".")]
    return max(prefixes, key=len) if prefixes else None


def scale_log(log: Any, recorded: ModelConfig, target: ModelConfig, batch: int,
              unique_experts: float | None = None) -> list:
    """The megakernel step recorded at `recorded`'s shapes (its DMA log), as it would run at
    `target`'s: every DMA's bytes scaled by its matrix / vector / state / KV-token ratio, the
    layer segments repeated and re-tagged along `target`'s layer pattern (a recorded layer of the
    same attention and FFN kind stands for each target layer), routed-expert DMAs scaled to
    `unique_experts` per MoE layer (default: uniform routing over target.n_experts with
    target.top_k; for one rank of an expert-parallel layout pass that rank's share, e.g.
    kimi-k3-rank at B: 112 · (1 − (1 − 16/896)^B)). Blocks keep the recorded count: a
    target matrix moves in as many (larger) blocks as the recorded one. For `timeline.simulate`.
    """
    events = timeline.events_of(log)
    scaled = functools.partial(_scaled_event, rec_bytes=_byte_table(recorded, batch),
                               tgt_bytes=_byte_table(target, batch))
    if unique_experts is None:
        unique_experts = roofline.expected_unique_experts(target.n_experts, target.top_k, batch)
    bounds = _layer_bounds(events, recorded)
    stream = weight_stream.make_stream_plan(recorded)
    first_names = {kind: [e.name for e in stream.entries(kind)]
                   for kind in dict.fromkeys(recorded.attention_kinds)}
    out = [scaled(ev) for ev in events[:bounds[0]]]
    recorded_layers = _source_layers(recorded)
    for layer in range(target.n_layers):
        this, after = _kinds(target, layer), (_kinds(target, layer + 1) or (None,))[0]
        source = recorded_layers.get((this, after), recorded_layers[(this, "any")])
        rec_after = (_kinds(recorded, source + 1) or (None,))[0]
        rename = {}
        if rec_after != after and rec_after and after:  # prefetch the other attention kind
            rename = dict(zip(first_names[rec_after], first_names[after]))
        segment = events[bounds[source]:bounds[source + 1]]
        expert_ratio = _expert_ratio(segment, unique_experts)
        layer_map = {source: layer, source + 1: layer + 1}
        for ev in segment:
            is_next = dict(ev.indices).get("layer") == source + 1
            out.append(scaled(ev, expert_ratio if ev.name.startswith("expert/") else 1.0,
                              layer_map, rename if is_next else None))
    out += [scaled(ev) for ev in events[bounds[-1]:]]
    return out


def _kinds(cfg: ModelConfig, layer: int) -> tuple | None:
    """(attention kind, FFN kind) of a layer; None past the last."""
    return cfg.layers[layer] if layer < cfg.n_layers else None


def _layer_bounds(events: list, recorded: ModelConfig) -> list[int]:
    """The index of each recorded layer's first event (its first residual vector's DMA), then of
    the tail's (the output mix or final norm); ValueError when the log has another layer count."""
    first_vector = residuals.RESIDUALS[recorded.residual].vectors[0]  # loaded first, every layer
    starts = [i for i, e in enumerate(events) if e.kind == "dma_start" and e.name == first_vector]
    tail = next(i for i, e in enumerate(events) if e.name in ("mix_out", "final_norm"))
    if len(starts) != recorded.n_layers:
        raise ValueError(f"log has {len(starts)} layers, recorded={recorded.name!r} has "
                         f"{recorded.n_layers}: pass the config the log was recorded at")
    return starts + [tail]


def _source_layers(recorded: ModelConfig) -> dict[tuple, int]:
    """The first recorded layer of each (kinds, the next layer's attention kind), and of each
    (kinds, "any"): the recorded layer that stands for a target layer."""
    recorded_layers: dict[tuple, int] = {}
    for layer in range(recorded.n_layers):
        key = (_kinds(recorded, layer), (_kinds(recorded, layer + 1) or (None,))[0])
        recorded_layers.setdefault(key, layer)
        recorded_layers.setdefault((_kinds(recorded, layer), "any"), layer)
    return recorded_layers


def _expert_ratio(segment: list, unique_experts: float) -> float:
    """unique_experts over the routed experts a recorded layer's segment fetched (1 without)."""
    experts = sum(1 for e in segment
                  if e.kind == "dma_start" and e.name.startswith("expert/w1/")
                  and e.name.endswith(("weight", "values", "codes")))
    return unique_experts / experts if experts else 1.0


def _scaled_event(ev: Any, ratio_extra: float = 1.0, layer_map: dict | None = None,
                  rename: dict | None = None, *, rec_bytes: dict, tgt_bytes: dict) -> Any:
    """One recorded event at the target's shapes: bytes (or a streamed block's matmul FLOPs) by
    the ratio of its entry in the two byte tables, x ratio_extra; its layer index mapped and its
    name renamed, when given."""
    name = rename.get(ev.name, ev.name) if rename else ev.name
    base = name.removesuffix("/matmul")  # a streamed block's matmul: FLOPs scale like bytes
    key_rec = _table_key(ev.name.removesuffix("/matmul"), rec_bytes)
    key_tgt = _table_key(base, tgt_bytes)
    ratio = (tgt_bytes[key_tgt] / rec_bytes[key_rec]) if key_rec and key_tgt else 1.0
    indices = tuple((k, layer_map.get(v, v) if layer_map and k == "layer" else v)
                    for k, v in ev.indices)
    if ev.kind.startswith("phase"):
        factor = ratio if base != name else 1.0
        return dataclasses.replace(ev, name=name, indices=indices, flops=ev.flops * factor,
                                   vmem_bytes=round(ev.vmem_bytes * factor))
    nbytes = round(ev.nbytes * ratio * ratio_extra)
    return dataclasses.replace(ev, name=name, nbytes=nbytes, indices=indices)
