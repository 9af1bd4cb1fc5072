"""The decode roofline: what one decode step must move through HBM, and how fast that can go.

Decode reads every weight it uses once per step, whatever the batch, and does ~2 FLOP per weight
per sequence: far below a TPU's critical intensity (≈166–560 FLOP/byte), so a step is memory-bound
and its floor is (bytes read + bytes written) / HBM bandwidth.

All byte counts come from `mkresearch.model.weights.param_shapes(cfg)` and the shapes of
`mkresearch.model.reference.init_state` (via `jax.eval_shape`: nothing is allocated, so the full-size
model is fine); nothing here is typed in except the published anchor throughputs, which are quoted
from docs/tpu.md and only ever drawn next to the computed floor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from mkresearch.hardware.chips import Chip, get_chip
from mkresearch.model import spec, weights
from mkresearch.model.config import EXPERT_FORMATS, MLA_CACHE_LAYOUTS, ModelConfig

# "released": the public kernels repack gate/up (W1, W3) to FP8 and keep down (W2) MXFP4 (docs/kimi-k3.md §7).
STEP_EXPERT_FORMATS = EXPERT_FORMATS + ("released",)
ROOFLINE_CHIPS = ("v5e", "v6e", "v5p", "tpu7x")
ROOFLINE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Published decode throughput of Kimi K3 on 16 TPU7x chips (32 devices), aggregate tok/s by batch,
# 1 input token and 1000 output tokens (docs/tpu.md §3). An anchor to plot
# against the computed floor, never an input to it.
PUBLISHED_TPU7X_16_CHIPS = {1: 249, 2: 392, 4: 515, 8: 865}


# ---- shapes -> bytes -------------------------------------------------------------------------
def tree_bytes(tree: Any) -> int:
    """Bytes of every array (or ShapeDtypeStruct) leaf of a pytree."""
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
               for leaf in jax.tree_util.tree_leaves(tree))


def tree_size(tree: Any) -> int:
    """Number of elements of every leaf of a pytree."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(tree))


@functools.lru_cache(maxsize=64)
def _param_shapes(cfg: ModelConfig) -> Any:
    return weights.param_shapes(cfg)


@functools.lru_cache(maxsize=64)
def _state_shapes(cfg: ModelConfig, batch: int, seq_len: int | None = None) -> Any:
    return spec.state_shapes(cfg, batch, seq_len or cfg.max_seq_len)


def state_bytes(cfg: ModelConfig, kind: spec.Stage, leaf_kind: str) -> int:
    """Bytes of one row's `leaf_kind` state of every layer of `kind` (a cache: per token)."""
    leaves = spec.state_table(cfg, 1, 1).get(kind.name, {})
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
               for leaf in leaves.values() if leaf.kind == leaf_kind)


def _check(cfg: ModelConfig, batch: int = 1, context: int = 0, expert_format: str | None = None,
           mla_cache_layout: str | None = None) -> None:
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg={cfg!r} is invalid: a mkresearch.model.config.ModelConfig")
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch={batch!r} is invalid: an int >= 1")
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 0:
        raise ValueError(f"context={context!r} is invalid: an int >= 0")
    if expert_format is not None and expert_format not in STEP_EXPERT_FORMATS:
        raise ValueError(f"expert_format={expert_format!r} is invalid: one of "
                         f"{', '.join(map(repr, STEP_EXPERT_FORMATS))}")
    if mla_cache_layout is not None and mla_cache_layout not in MLA_CACHE_LAYOUTS:
        raise ValueError(f"mla_cache_layout={mla_cache_layout!r} is invalid: one of "
                         f"{', '.join(map(repr, MLA_CACHE_LAYOUTS))}")


def routed_kind(cfg: ModelConfig) -> spec.Stage | None:
    """The model's FFN kind with routed experts (Kimi K3 "moe", the families "moe_full"), if any."""
    return next((kind for kind in spec.stages_of(cfg) if kind.routed), None)


def expert_bytes(cfg: ModelConfig, expert_format: str | None = None) -> int:
    """HBM bytes of one routed expert (W1, W3, W2 with their scales) in `expert_format`."""
    expert_format = expert_format or cfg.expert_format
    _check(cfg, expert_format=expert_format)
    kind = routed_kind(cfg)
    if kind is None:
        return 0

    def routed(fmt: str) -> dict:
        return _param_shapes(cfg.replace(expert_format=fmt))[kind.name]["experts"]

    if expert_format == "released":  # FP8 gate/up + MXFP4 down
        fp8, mxfp4 = routed("fp8"), routed("mxfp4")
        experts_bytes = tree_bytes([fp8["w1"], fp8["w3"], mxfp4["w2"]])
    else:
        experts_bytes = tree_bytes(routed(expert_format))
    return experts_bytes // (len(cfg.layers_of(kind.name)) * cfg.n_experts)


def expected_unique_experts(n_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts one MoE layer reads for `batch` tokens under uniform routing.

    Each token picks top_k of n_experts; an expert is missed by one token with probability
    1 − k/E, by all B tokens with (1 − k/E)^B, so E·(1 − (1 − k/E)^B) are read.
    """
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch)


def cache_bytes_per_token(cfg: ModelConfig) -> int:
    """KV-cache bytes per context token of one sequence, every layer with a cache."""
    return sum(state_bytes(cfg, kind, spec.CACHE) for kind in spec.stages_of(cfg))


def recurrent_state_bytes(cfg: ModelConfig) -> int:
    """Recurrent state bytes of one sequence (read and written each step), every layer."""
    return sum(state_bytes(cfg, kind, spec.RECURRENT) for kind in spec.stages_of(cfg))


def mla_cache_bytes_per_token(cfg: ModelConfig, layout: str | None = None) -> int:
    """MLA KV-cache bytes per context token of one sequence, all MLA layers, in `layout`."""
    layout = layout or cfg.mla_cache_layout
    _check(cfg, mla_cache_layout=layout)
    return state_bytes(cfg.replace(mla_cache_layout=layout), spec.stage("mla"), spec.CACHE)


def kda_state_bytes(cfg: ModelConfig) -> int:
    """KDA conv + recurrent state bytes of one sequence, all KDA layers (read and written each step)."""
    return state_bytes(cfg, spec.stage("kda"), spec.RECURRENT)


# ---- does it fit one device? -----------------------------------------------------------------
@dataclass(frozen=True)
class HbmFootprint:
    """HBM bytes one device holds to decode with `cfg`: every weight, and the caches and states of
    `batch` sequences of `seq_len` tokens, against the chip's HBM per device."""

    model: str
    chip: str
    batch: int
    seq_len: int
    expert_format: str
    weights: int
    states: int  # KDA conv + recurrent state, MLA cache
    available: int  # Chip.hbm_bytes (per device)

    @property
    def needed(self) -> int:
        return self.weights + self.states

    def fits(self) -> bool:
        return self.needed <= self.available


def hbm_footprint(cfg: ModelConfig, chip: str | Chip, batch: int = 1,
                  seq_len: int | None = None) -> HbmFootprint:
    """Bytes from `weights.param_shapes` and `reference.init_state` shapes (nothing allocated)."""
    chip = get_chip(chip)
    _check(cfg, batch)
    seq_len = cfg.max_seq_len if seq_len is None else int(seq_len)
    return HbmFootprint(model=cfg.name, chip=chip.name, batch=int(batch), seq_len=seq_len,
                        expert_format=cfg.expert_format, weights=tree_bytes(_param_shapes(cfg)),
                        states=tree_bytes(_state_shapes(cfg, int(batch), seq_len)),
                        available=int(chip.hbm_bytes))


def most_layers_that_fit(cfg: ModelConfig, chip: str | Chip, batch: int, seq_len: int,
                         budget: int) -> int:
    """The most of cfg's first layers (the layer pattern kept) whose HBM footprint at `batch`
    rows of `seq_len` tokens is at most `budget` bytes on one `chip` device; 0 if no valid cut
    fits (`on_chip.ON_CHIP`'s counts are these)."""
    best = 0
    for n_layers in range(1, cfg.n_layers + 1):
        try:
            cut = cfg.replace(n_layers=n_layers, max_seq_len=seq_len)
        except ValueError:  # too few layers for the family's pattern (dense first, MLA every k)
            continue
        if hbm_footprint(cut, chip, batch).needed > budget:
            break
        best = n_layers
    return best


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def check_fits_hbm(cfg: ModelConfig, chip: str | Chip, batch: int = 1,
                   seq_len: int | None = None) -> HbmFootprint:
    """The footprint, or a one-line ValueError (before anything is traced) naming the chip, the
    bytes needed and available, and what to change: shard across more devices, a smaller expert
    format, a smaller batch or cache."""
    footprint = hbm_footprint(cfg, chip, batch, seq_len)
    if footprint.fits():
        return footprint
    smallest = "mxfp4"  # the checkpoint's format: 4.25 bits per expert weight
    if cfg.expert_format == smallest:
        remedies = (f"shard the model across more ranks / devices, or lower the batch or the cache "
                    f"length (max_seq_len); expert_format={smallest!r} is already the smallest")
    else:
        with_smallest = hbm_footprint(cfg.replace(expert_format=smallest), chip, batch, seq_len)
        remedies = (f"shard the model across more ranks / devices, use expert_format={smallest!r} "
                    f"({_gb(with_smallest.needed)} needed) instead of {cfg.expert_format!r}, or "
                    "lower the batch or the cache length (max_seq_len)")
    raise ValueError(
        f"{cfg.name} does not fit the HBM of one {footprint.chip} device: it needs "
        f"{footprint.needed:,d} B ({_gb(footprint.needed)}: weights {_gb(footprint.weights)} with "
        f"expert_format={cfg.expert_format!r}, caches and states {_gb(footprint.states)} for batch "
        f"{footprint.batch} x {footprint.seq_len} tokens) but {footprint.chip} has "
        f"{footprint.available:,d} B ({_gb(footprint.available)}) per device: {remedies}")


# ---- one step --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepBytes:
    """HBM traffic of one decode step (all layers, all `batch` sequences) by component."""

    model: str
    batch: int
    context: int
    expert_format: str
    mla_cache_layout: str
    unique_experts_per_layer: float
    read: Mapping[str, int] = field(default_factory=dict)
    written: Mapping[str, int] = field(default_factory=dict)

    components: Mapping[str, str] = field(default_factory=dict)  # name -> label, display order
    state_components: tuple[str, ...] = ()  # the components that are state, not weights

    @property
    def weights(self) -> int:
        return sum(v for name, v in self.read.items() if name not in self.state_components)

    @property
    def total_read(self) -> int:
        return sum(self.read.values())

    @property
    def total_written(self) -> int:
        return sum(self.written.values())

    @property
    def total(self) -> int:
        return self.total_read + self.total_written

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "batch": self.batch, "context": self.context,
                "expert_format": self.expert_format, "mla_cache_layout": self.mla_cache_layout,
                "unique_experts_per_layer": self.unique_experts_per_layer,
                "components": dict(self.components),
                "read": dict(self.read), "written": dict(self.written), "weights": self.weights,
                "total_read": self.total_read, "total_written": self.total_written,
                "total": self.total}


def step_bytes(cfg: ModelConfig, batch: int = 1, context: int = 0, expert_format: str | None = None,
               mla_cache_layout: str | None = None, *,
               unique_experts: float | None = None) -> StepBytes:
    """Bytes one decode step reads and writes, by component (see StepBytes.components).

    `context` is the number of tokens already in each sequence's MLA cache. Weights are read once
    per step for the whole batch (routed experts: the expected unique ones under uniform routing,
    or `unique_experts` per MoE layer when given, e.g. a schedule's worst case min(E, B·k));
    the embedding is read one row per sequence; KDA state is read and written per sequence; the
    MLA cache is read for `context` tokens (a sliding window's kind: at most its window) and
    written for one, per sequence.
    """
    expert_format = expert_format or cfg.expert_format
    mla_cache_layout = mla_cache_layout or cfg.mla_cache_layout
    _check(cfg, batch, context, expert_format, mla_cache_layout)
    if unique_experts is not None and (
            isinstance(unique_experts, bool) or not isinstance(unique_experts, (int, float, np.number))
            or not 0 <= unique_experts <= cfg.n_experts):
        raise ValueError(f"unique_experts={unique_experts!r} is invalid: a number in [0, "
                         f"n_experts={cfg.n_experts}] (distinct experts one MoE layer reads)")
    cfg = cfg.replace(mla_cache_layout=mla_cache_layout)
    params = _param_shapes(cfg)
    kinds = spec.stages_of(cfg)
    unique = (expected_unique_experts(cfg.n_experts, cfg.top_k, batch) if unique_experts is None
              else unique_experts)
    embed = params["embed"]
    read: dict[str, int] = {}
    for kind in kinds:  # each kind's weights, its routed experts apart
        if kind.component is not None:
            read[kind.component[0]] = tree_bytes(
                {k: v for k, v in params[kind.name].items() if k not in kind.routed})
    for kind in kinds:
        if kind.routed:
            read[kind.routed_component[0]] = round(
                len(cfg.layers_of(kind.name)) * unique * expert_bytes(cfg, expert_format))
    trunk = {"embed", "lm_head", *(kind.name for kind in kinds)}
    read.update(lm_head=tree_bytes(params["lm_head"]),
                embedding_rows=batch * embed.shape[1] * np.dtype(embed.dtype).itemsize,
                norms_and_mix=tree_bytes([v for k, v in params.items() if k not in trunk]))
    written: dict[str, int] = {}
    states = []
    for kind in kinds:
        if kind.state_component is None:
            continue
        name = kind.state_component[0]
        recurrent = state_bytes(cfg, kind, spec.RECURRENT)
        per_token = state_bytes(cfg, kind, spec.CACHE)
        window = kind.window(cfg)  # a sliding window reads its last tokens only
        read[name] = batch * (recurrent + (min(context, window) if window else context)
                              * per_token)
        written[name] = batch * (recurrent + per_token)
        states.append(name)
    return StepBytes(model=cfg.name, batch=batch, context=context, expert_format=expert_format,
                     mla_cache_layout=mla_cache_layout, unique_experts_per_layer=unique,
                     read=read, written=written, components=spec.components(cfg),
                     state_components=tuple(states))


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the decode step (MTP modules apart:
    `mtp_parameters`).

    Active = every weight one token's step multiplies with: all but the embedding table (a lookup
    of one row) and the routed experts it does not select (n_moe · (E − k) experts).
    """
    counts = parameter_breakdown(cfg)
    return counts["total"], counts["active"]


def parameter_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """total and active (as `parameter_counts`), and the parts publications count differently:
    embedding, lm_head, routed (all routed experts) and routed_active (top_k of them per layer)."""
    params = _param_shapes(cfg.replace(expert_format="bf16"))  # one element per parameter

    def size(tree: Any) -> int:  # the checkpoint's parameters: the lanes' zero padding left out
        return sum(math.prod(weights.unpadded_shape(leaf.shape, cfg))
                   for leaf in jax.tree.leaves(tree))

    total = size(params)
    routed = unselected = 0
    for kind in spec.stages_of(cfg):  # routed experts: a token uses top_k of n_experts
        routed_size = size([params[kind.name][key] for key in kind.routed])
        routed += routed_size
        unselected += (routed_size // cfg.n_experts * (cfg.n_experts - cfg.top_k)
                       if routed_size else 0)
    embedding = size(params["embed"])
    return {"total": total, "active": total - embedding - unselected, "embedding": embedding,
            "lm_head": size(params["lm_head"]), "routed": routed,
            "routed_active": routed - unselected}


def padding_bytes(cfg: ModelConfig) -> int:
    """HBM bytes of the weights' zero padding (widths rounded up to whole lanes, GPT-OSS's 2880 ->
    2944: `weights.padded_widths`), in cfg's expert format: counted in every byte figure, never
    in the parameters."""
    if not weights.padded_widths(cfg):
        return 0
    table = spec.param_table(cfg)
    stored = _param_shapes(cfg)
    total = 0
    for param, leaf in zip(jax.tree.leaves(table, is_leaf=lambda x: isinstance(x, spec.Param)),
                           jax.tree.leaves(jax.tree.map(
                               tree_bytes, stored, is_leaf=lambda x: isinstance(x, dict) and (
                                   set(x) in ({"codes", "scales"}, {"values", "scales"}))))):
        padded = math.prod(param.shape)
        total += round(leaf * (padded - math.prod(weights.unpadded_shape(param.shape, cfg)))
                       / padded)
    return total


@dataclass(frozen=True)
class CountingRule:
    """How a publisher counts its "total" and "active" parameters, beside `parameter_breakdown`
    (total: every weight of the decode step, MTP modules apart; active: all but the embedding
    table and the routed experts a token does not choose, the LM head included). Each rule is
    read off the publisher's own figures for a sibling model too (`checked_on`)."""

    embedding_active: bool  # the input embedding table counted as active (a one-row lookup)
    lm_head_active: bool  # the LM head counted as active
    published: tuple[float, float]  # (total, active) as published: quoted, never computed
    checked_on: str  # a sibling model's published figures the same rule reproduces, by hand


# The totals are the main model's (MTP apart) under every rule. DeepSeek's 37 B is this rule's
# 36.63 B rounded to whole billions: 1.01 % under the published figure (no natural rule lands
# within 1 %: with the embedding table it is 37.55 B, +1.5 %).
PARAMETER_RULES = {
    "deepseek-v3": CountingRule(
        embedding_active=False, lm_head_active=True, published=(671e9, 37e9),
        checked_on="DeepSeek-V2 (236 B / 21 B published): 235.74 B / 20.85 B"),
    "glm-4.5": CountingRule(  # with its MTP layer the total would be 356.8 B (+0.5 %)
        embedding_active=False, lm_head_active=False, published=(355e9, 32e9),
        checked_on="GLM-4.5-Air (106 B / 12 B published): 106.85 B / 12.18 B"),
    "qwen3-235b-a22b": CountingRule(
        embedding_active=True, lm_head_active=True, published=(235e9, 22e9),
        checked_on="Qwen3-30B-A3B (30.5 B / 3.3 B published): 30.53 B / 3.35 B"),
    # the GPT-OSS model card's totals and active counts (OpenAI, "gpt-oss-120b & gpt-oss-20b
    # Model Card"): the unembedding active, the embedding not, the lanes' padding left out
    "gpt-oss-20b": CountingRule(
        embedding_active=False, lm_head_active=True, published=(20.9e9, 3.6e9),
        checked_on="gpt-oss-120b (116.8 B / 5.1 B published): 116.83 B / 5.13 B"),
    "gpt-oss-120b": CountingRule(
        embedding_active=False, lm_head_active=True, published=(116.8e9, 5.1e9),
        checked_on="gpt-oss-20b (20.9 B / 3.6 B published): 20.91 B / 3.61 B"),
}


def counting_rule(cfg: ModelConfig) -> CountingRule | None:
    """The publisher's rule for a full preset (its -mini and -rank are not published models)."""
    return PARAMETER_RULES.get(cfg.name)


def published_counts(cfg: ModelConfig, rule: CountingRule) -> tuple[int, int]:
    """(total, active) of `cfg` counted by `rule`: ours, with the embedding table and the LM head
    in or out of the active count as the publisher counts them."""
    counts = parameter_breakdown(cfg)
    active = (counts["active"] + rule.embedding_active * counts["embedding"]
              - (not rule.lm_head_active) * counts["lm_head"])
    return counts["total"], active


def as_published(cfg: ModelConfig) -> dict:
    """{"publisher_rule": the parameters as the model's publisher counts them, with its rule}
    (`mkresearch info`), or {} for a model with no rule in PARAMETER_RULES."""
    rule = counting_rule(cfg)
    if rule is None:
        return {}
    total, active = published_counts(cfg, rule)
    return {"publisher_rule": {"total": total, "active": active, **vars(rule)}}


def mtp_parameters(cfg: ModelConfig) -> int:
    """Parameters of the model's multi-token-prediction modules (DeepSeek-V3: 1), not counted in
    `parameter_counts`. One module (DeepSeek-V3 paper §2.2) is a layer of the last layer's kinds with
    its two norms, the projection of [RMSNorm(h); RMSNorm(embedding)] (2d x d) with those two
    norms, and a final norm; it shares the embedding and the LM head with the main model."""
    if not cfg.n_mtp_layers:
        return 0
    params = _param_shapes(cfg.replace(expert_format="bf16"))
    last = cfg.n_layers - 1
    layer = sum(tree_size(params[kind]) // len(cfg.layers_of(kind))  # one layer of each
                for kind in cfg.layers[last])
    d = cfg.d_model
    return cfg.n_mtp_layers * (layer + 2 * d + 2 * d * d + 2 * d + d)


def step_flops(cfg: ModelConfig, batch: int = 1, context: int = 0) -> float:
    """Matmul FLOPs of one step: 2 per active weight per sequence, plus attention over context
    (each attention kind's `Stage.context_flops` per cached token and layer)."""
    _, active = parameter_counts(cfg)
    attention = context * sum(kind.context_flops(cfg) * len(cfg.layers_of(kind.name))
                              for kind in spec.stages_of(cfg) if kind.role == spec.ATTENTION)
    return float(batch * (2 * active + attention))


# ---- the floor -------------------------------------------------------------------------------
def chip_hbm_bandwidth(chip: Chip) -> float:
    """HBM bytes/s of one whole chip (CHIPS figures are per JAX device)."""
    return chip.hbm_bandwidth * (chip.tensorcores_per_chip // chip.tensorcores_per_device)


def chip_bf16_flops(chip: Chip) -> float:
    return chip.bf16_flops * (chip.tensorcores_per_chip // chip.tensorcores_per_device)


@dataclass(frozen=True)
class Floor:
    """Lower bound on one decode step's time on `n_chips` chips with the bytes split evenly."""

    chip: str
    n_chips: int
    batch: int
    context: int
    bytes: int  # read + written, whole model, one step
    seconds: float  # memory floor: bytes / (n_chips · HBM bandwidth)
    compute_seconds: float  # bf16 FLOPs / (n_chips · peak): decode stays far below the memory time

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.seconds

    @property
    def memory_bound(self) -> bool:
        return self.seconds >= self.compute_seconds


def decode_floor(cfg: ModelConfig, chip: str | Chip, batch: int = 1, context: int = 0, *,
                 n_chips: int = 1, expert_format: str | None = None,
                 mla_cache_layout: str | None = None) -> Floor:
    """(bytes read + written) / HBM bandwidth for one step; `.tokens_per_s` = batch / seconds."""
    chip = get_chip(chip)
    if isinstance(n_chips, bool) or not isinstance(n_chips, int) or n_chips < 1:
        raise ValueError(f"n_chips={n_chips!r} is invalid: an int >= 1")
    moved = step_bytes(cfg, batch, context, expert_format, mla_cache_layout).total
    return Floor(chip=chip.name, n_chips=n_chips, batch=batch, context=context, bytes=moved,
                 seconds=moved / (n_chips * chip_hbm_bandwidth(chip)),
                 compute_seconds=step_flops(cfg, batch, context) / (n_chips * chip_bf16_flops(chip)))


def roofline_table(cfg: ModelConfig, chips: Sequence[str] = ROOFLINE_CHIPS,
                   batches: Sequence[int] = ROOFLINE_BATCHES, context: int = 0, *,
                   n_chips: int = 1, expert_format: str | None = None,
                   mla_cache_layout: str | None = None) -> list[dict[str, Any]]:
    """One row per (chip, batch): step bytes, floor milliseconds and tokens/s."""
    rows = []
    for name in chips:
        for batch in batches:
            floor = decode_floor(cfg, name, batch, context, n_chips=n_chips,
                                 expert_format=expert_format, mla_cache_layout=mla_cache_layout)
            rows.append({"chip": name, "n_chips": n_chips, "batch": batch, "context": context,
                         "gb_per_step": floor.bytes / 1e9, "floor_ms": floor.seconds * 1e3,
                         "tokens_per_s": floor.tokens_per_s, "memory_bound": floor.memory_bound})
    return rows


# ---- the figure's setting (drawn by mkresearch.views.plots.plot_roofline) ----------------------------
ROOFLINE_CONTEXT = 512  # ≈ mean context of the published 1-in / 1000-out benchmark
ROOFLINE_N_CHIPS = 16  # the published deployment
