"""The model spec and the stage registry: the one place that says what a model is made of.

A model is a sequence of layers, each (attention kind, FFN kind) (`ModelConfig.layers`), joined by
a residual strategy (`ModelConfig.residual`: Kimi's attention-residual mix, or a classic pre-norm
residual stream), with per-kind options (the other `ModelConfig` fields). Each sublayer kind is one
`Stage` in the registry, which owns

    params     one layer's weights: shapes, dtypes, how to draw them, which are routed experts
    state      one layer's state for one row: recurrent (read and written whole each step) or a
               cache (one entry per token)
    sublayer   the reference function (plain JAX: the oracle kernels are tested against)

and the roofline components its bytes are reported under. `weights.param_shapes`,
`reference.init_state`, the reference decode step, `roofline.step_bytes` and `mkresearch info`
are derived from it; none restates a shape. The kernel side of a kind (its body, VMEM buffers and
weight stream) is registered next to its kernel, keyed by the same name
(`mkresearch.kernels.base.registry`).

The built-in kinds live in `mkresearch.model.stages` (Kimi K3: kda, mla, dense, moe; DeepSeek-V3, GLM-4.5
and Qwen3: gqa, mla_rope, moe_full, with dense; GPT-OSS: gqa_sink, gqa_sink_window); a new kind is one
`register(Stage(...))` call (see tests/test_registry.py for a toy kind added that way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from mkresearch.model.model_config import ModelConfig

ATTENTION, FFN = "attention", "ffn"
RECURRENT, CACHE = "recurrent", "cache"

# Sharding groups (`mkresearch.sharding.layout`): what splits one axis of a parameter or state leaf across
# ranks. A kind declares, per Param, which axis splits by which group (`Param.shard`) and, for a
# matrix whose input arrives split across ranks, by which group (`Param.gather`: the input is
# all-gathered first, so every output element is one whole contraction, as on one device). How
# many ways each group splits is the layout's choice (the release's, or ours).
HEADS = "heads"  # attention heads (tensor parallel): an axis of H x per-head width
KV_HEADS = "kv_heads"  # GQA's K/V heads, split with the query heads that read them (replicated
#                        on the ranks of one K/V head's query heads when there are fewer K/V
#                        heads than head slices)
VOCAB = "vocab"  # vocabulary rows of the embedding and LM head
EXPERTS = "experts"  # routed experts (expert parallel)
EXPERT_TP = "expert_tp"  # inside an expert (expert-tensor parallel): W1, W3 by their hidden
#                          columns, W2 by its output columns (the latent, or d for moe_full)
FFN_HIDDEN = "ffn_hidden"  # the hidden of the dense FFN and the shared experts
MODEL_COLS = "model_cols"  # the d columns of a projection back to the model dim (W_o, W_down)
DOWN_COLS = "down_cols"  # the columns of a small down-projection of x (W_fa, W_qa, W_kva, router)
MOE_LATENT = "moe_latent"  # the latent columns of the MoE latent down-projection W_ld
# the router's columns when a layout places them apart from down_cols (`Param.router`,
# `partition.Layout.router`: whole on every rank, or split over a host's ranks or a pair of
# sibling cores); no Param declares it: a layout puts it in place of the router's down_cols
ROUTER_COLS = "router_cols"
SHARD_GROUPS = (HEADS, VOCAB, EXPERTS, EXPERT_TP, FFN_HIDDEN, MODEL_COLS, DOWN_COLS, MOE_LATENT,
                KV_HEADS)
REPLICATED: tuple = ()  # Param.shard of a parameter every rank holds whole


def split(axis: int, by: str) -> tuple[tuple[int, str], ...]:
    """Param.shard of a parameter whose `axis` splits by the group `by` (one of SHARD_GROUPS)."""
    if by not in SHARD_GROUPS:
        raise ValueError(f"by={by!r} is invalid: one of {', '.join(SHARD_GROUPS)}")
    return ((axis, by),)


@dataclass(frozen=True)
class Param:
    """One parameter of one layer (or of the trunk): logical shape, stored dtype, how to draw it.

    init: ("normal", std) | ("uniform", low, high) | ("log_uniform", low, high) (stores log x).
    quantized: a routed-expert matrix, stored in cfg.expert_format (weights.quantize).
    shard: how it splits across ranks (`mkresearch.sharding.layout`): ((axis, group), ...) with a group of
    SHARD_GROUPS, REPLICATED (every rank holds it whole), or None: no rule given (a layout over
    more than one rank refuses the kind, naming the parameter).
    gather: for a matrix whose input arrives split across ranks by a group (the heads' outputs,
    a hidden slice), that group: the kernel all-gathers the input before multiplying.
    scattered: in the restructured collectives mode, the group its input arrives reduce-scattered
    by (W_lu: ρ's latent chunks): its rows split by that group, its products partial sums.
    beside: with `scattered`, the key of the stage's parameter whose reduction its partial sums
    (and the sums of squares of its input's chunks) travel beside, in the order that reduction
    adds the ranks: the kernel's rules (`Rule.beside`) and the sharded reference both read it.
    router: the MoE router's matrix: a layout's router placement (`partition.Layout.router`) puts
    its columns in ROUTER_COLS instead of its DOWN_COLS (out of the repr while False).
    """

    shape: tuple[int, ...]
    dtype: Any
    init: tuple
    quantized: bool = False
    shard: tuple[tuple[int, str], ...] | None = None
    gather: str | None = None
    scattered: str | None = None
    beside: str | None = None
    router: bool = dataclasses.field(default=False, repr=False)

    def stacked(self, count: int, by: str | None = None) -> Param:
        """The same parameter for `count` layers (or experts: `by` the group that splits the new
        leading axis), stacked along a leading axis."""
        shard = self.shard
        if shard is not None:
            shard = tuple((axis + 1, group) for axis, group in shard)
            shard = (split(0, by) + shard) if by is not None else shard
        return Param((count, *self.shape), self.dtype, self.init, self.quantized, shard,
                     self.gather, self.scattered, self.beside, self.router)


def matrix(n_in: int, n_out: int, *, quantized: bool = False,
           shard: tuple[tuple[int, str], ...] | None = None, gather: str | None = None,
           scattered: str | None = None, beside: str | None = None,
           router: bool = False) -> Param:
    """A [in, out] bf16 matrix ~ N(0, 1/in): every projection keeps an O(1) RMS."""
    return Param((n_in, n_out), jnp.bfloat16, ("normal", n_in ** -0.5), quantized, shard, gather,
                 scattered, beside, router)


def norm(shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> Param:
    """A norm gain near 1 (not exactly 1, so a kernel that forgets it fails its test); every rank
    holds it whole."""
    return Param(shape, dtype, ("uniform", 0.8, 1.2), shard=REPLICATED)


@dataclass(frozen=True)
class StateLeaf:
    """One layer's state of one row. A CACHE leaf has one entry per token along `token_axis`."""

    shape: tuple[int, ...]
    dtype: Any
    kind: str = RECURRENT
    token_axis: int | None = None
    shard: tuple[tuple[int, str], ...] | None = None  # as Param.shard


@dataclass(frozen=True)
class Stage:
    """One sublayer kind: what it stores, what state it keeps, and its reference function.

    sublayer(p, x, state, positions, cfg) -> (out [B, d] bf16, new state, aux): p one layer's
    weights, x [B, d] bf16 the normalised input, state {leaf: [B, ...]} this layer's state,
    positions [B] i32. aux: a dict of per-row outputs the decode step collects (e.g. the MoE
    routing), possibly empty.
    """

    name: str
    role: str  # ATTENTION or FFN
    params: Callable[[ModelConfig], dict]  # one layer's weights: a nested dict of Param
    sublayer: Callable
    state: Callable[[ModelConfig, int], dict[str, StateLeaf]] = lambda cfg, seq_len: {}
    component: tuple[str, Callable[[ModelConfig], str]] | None = None  # roofline (name, label)
    state_component: tuple[str, str] | None = None  # roofline (name, label) of its state
    routed: tuple[str, ...] = ()  # param keys read only for the chosen experts
    routed_component: tuple[str, str] = ("routed_experts", "routed experts")
    description: str = ""
    # ValueError naming the ModelConfig field when cfg asks this kind for what it cannot do
    check: Callable[[ModelConfig], None] = lambda cfg: None
    # attention: matmul FLOPs per row, head set and cached token of one layer (scores + values)
    context_flops: Callable[[ModelConfig], int] = lambda cfg: 0
    # attention: the cached tokens one layer reads at most (a sliding window), 0: all of them
    window: Callable[[ModelConfig], int] = lambda cfg: 0


@dataclass(frozen=True)
class Residual:
    """How sublayer outputs join: the trunk parameters it needs beyond embedding, norms and head;
    the decode loop itself is in `mkresearch.model.reference` (it is the spec)."""

    name: str
    params: Callable[[ModelConfig], dict]
    description: str = ""


_STAGES: dict[str, Stage] = {}
_RESIDUALS: dict[str, Residual] = {}


def register(stage: Stage) -> Stage:
    """Add a stage kind to the registry (ValueError if the name is taken or the role unknown)."""
    if stage.role not in (ATTENTION, FFN):
        raise ValueError(f"Stage.role={stage.role!r} is invalid: {ATTENTION!r} or {FFN!r}")
    if stage.name in _STAGES and _STAGES[stage.name] is not stage:
        raise ValueError(f"a stage kind {stage.name!r} is registered already")
    _STAGES[stage.name] = stage
    return stage


def unregister(name: str) -> None:
    """Remove a stage kind (tests that register a toy kind clean up with this)."""
    _STAGES.pop(name, None)


def register_residual(residual: Residual) -> Residual:
    _RESIDUALS[residual.name] = residual
    return residual


def registered(role: str | None = None) -> tuple[str, ...]:
    return tuple(name for name, s in _STAGES.items() if role is None or s.role == role)


def stage(name: str) -> Stage:
    """The registered kind `name` (ValueError listing the registered kinds)."""
    if name not in _STAGES:
        raise ValueError(f"stage kind {name!r} is not registered: one of {', '.join(_STAGES)}")
    return _STAGES[name]


def residual(cfg: ModelConfig) -> Residual:
    return _RESIDUALS[cfg.residual]


def check(cfg: ModelConfig) -> ModelConfig:
    """ValueError naming the field when a layer's kind is not registered or has the wrong role."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg={cfg!r} is invalid: a mkresearch.model.config.ModelConfig")  # noqa: TRY004
    for field_name, kinds, role in (("attention", cfg.attention_kinds, ATTENTION),
                                    ("ffn", cfg.ffn_kinds, FFN)):
        for kind in dict.fromkeys(kinds):
            if kind not in _STAGES or _STAGES[kind].role != role:
                allowed = ", ".join(registered(role))
                raise ValueError(f"ModelConfig.{field_name}={getattr(cfg, field_name)!r} is "
                                 f"invalid: layer kind {kind!r} is not a registered {role} kind "
                                 f"(registered: {allowed})")
    if cfg.residual not in _RESIDUALS:
        raise ValueError(f"ModelConfig.residual={cfg.residual!r} is invalid: one of "
                         f"{', '.join(_RESIDUALS)}")
    for kind in cfg.kinds:  # what a kind cannot run with (e.g. MLA with RoPE: latent cache only)
        _STAGES[kind].check(cfg)
    return cfg


def stages_of(cfg: ModelConfig) -> tuple[Stage, ...]:
    """The stage kinds the model uses, attention kinds first, in layer order."""
    check(cfg)
    return tuple(_STAGES[kind] for kind in cfg.kinds)


# ---- the parameter and state tables -------------------------------------------------------------
def trunk_params(cfg: ModelConfig) -> dict[str, Param]:
    """Embedding, LM head, final norm and the per-layer pre-sublayer norms, then the residual
    strategy's own parameters."""
    d, n_layers, vocab = cfg.d_model, cfg.n_layers, cfg.vocab_size
    table = {
        "embed": Param((vocab, d), jnp.bfloat16, ("normal", 1.0), shard=split(0, VOCAB)),  # RMS 1
        "lm_head": matrix(d, vocab, shard=split(1, VOCAB)),
        "final_norm": norm((d,)),
    }
    table.update(residual(cfg).params(cfg))
    table.update(attn_norm=norm((n_layers, d)), mlp_norm=norm((n_layers, d)))
    return table


def param_table(cfg: ModelConfig) -> dict[str, Any]:
    """Every parameter of the model: the trunk, then each kind's layers stacked along a leading
    axis in layer order (`params[kind][name][i]` belongs to layer `cfg.layers_of(kind)[i]`)."""
    table: dict[str, Any] = trunk_params(check(cfg))
    for kind in stages_of(cfg):
        count = len(cfg.layers_of(kind.name))
        table[kind.name] = jax.tree.map(lambda p, count=count: p.stacked(count), kind.params(cfg),
                                        is_leaf=lambda x: isinstance(x, Param))
    return table


def state_table(cfg: ModelConfig, batch: int, seq_len: int) -> dict[str, dict[str, StateLeaf]]:
    """kind -> leaf -> StateLeaf of shape [n_layers_of_kind, B, ...] (kinds with state only)."""
    out = {}
    for kind in stages_of(cfg):
        leaves = kind.state(cfg, seq_len)
        if leaves:
            count = len(cfg.layers_of(kind.name))
            out[kind.name] = {
                name: StateLeaf((count, batch, *leaf.shape), leaf.dtype, leaf.kind,
                                None if leaf.token_axis is None else leaf.token_axis + 2,
                                None if leaf.shard is None
                                else tuple((axis + 2, group) for axis, group in leaf.shard))
                for name, leaf in leaves.items()}
    return out


def keeps_cache(cfg: ModelConfig, kind: str) -> bool:
    """Whether stage `kind` of `cfg` keeps a cache (read at the context) rather than a state of
    fixed size (or none)."""
    return any(leaf.kind == CACHE for leaf in (stage(kind).state(cfg, 1) or {}).values())


def state_shapes(cfg: ModelConfig, batch: int, seq_len: int) -> dict[str, dict[str, Any]]:
    """The decode state as jax.ShapeDtypeStruct leaves (`reference.init_state` fills zeros)."""
    return {kind: {name: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
                   for name, leaf in leaves.items()}
            for kind, leaves in state_table(cfg, batch, seq_len).items()}


def components(cfg: ModelConfig) -> Mapping[str, str]:
    """Roofline components of one step, name -> label, in display order: each kind's weights,
    routed experts, LM head, embedding rows, norms and residual weights, each kind's state."""
    out: dict[str, str] = {}
    kinds = stages_of(cfg)
    for kind in kinds:
        if kind.component is not None:
            name, label = kind.component
            out[name] = label(cfg)
    for kind in kinds:
        if kind.routed:
            out[kind.routed_component[0]] = kind.routed_component[1]
    out.update(lm_head="LM head", embedding_rows="embedding rows",
               norms_and_mix=("norms and residual-mix weights" if cfg.residual == "attention_mix"
                              else "norms"))
    for kind in kinds:
        if kind.state_component is not None:
            out[kind.state_component[0]] = kind.state_component[1]
    return out
