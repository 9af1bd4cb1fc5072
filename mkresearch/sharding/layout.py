"""Sharded decode across ranks: which rank holds which slice of every weight, cache and state.

A layout assigns every parameter and state leaf of a model to `n_ranks` ranks (one rank = one
TensorCore = one JAX device), from the sharding rules the stage kinds declare next to their
parameters (`spec.Param.shard`: which axis splits by which group, or REPLICATED) and the number of
ways the layout splits each group:

    heads       attention heads, tensor parallel (every per-head axis, state and cache)
    kv_heads    GQA's K/V heads, with the query heads that read them: each rank holds the K/V
                heads of its query heads (one K/V head replicated on several ranks when the
                model has fewer K/V heads than head slices, as serving systems replicate them)
    vocab       embedding rows and LM head columns (in whole lane tiles per rank, the last
                rank's padded when the vocabulary does not split evenly: DeepSeek-V3's 129280,
                Qwen3's 151936 rows; the padded logits are masked out of sampling)
    experts     routed experts, expert parallel (EP)
    expert_tp   inside each routed expert, expert-tensor parallel (ETP; EP x ETP = n_ranks): W1
                and W3 by their hidden columns, W2 by its latent columns
    ffn_hidden  the hidden of the dense FFN and of the shared experts (W_gate, W_up columns)
    model_cols  the d columns of the projections back to the model dim (W_o, W_down, W_lu)
    down_cols   the columns of the small down-projections of x (KDA's W_fa, MLA's W_qa and
                W_kva, the router)
    moe_latent  the latent columns of the MoE latent down-projection W_ld

Every matrix splits by its output columns, never by its contraction: a rank computes whole dot
products for its columns (its input all-gathered first where it arrives split, `Param.gather`)
and the columns are all-gathered, so every value is the single-device one, bit for bit.

Rank r holds slice (r // stride + start) % ways of a group (`Split`): experts (r // ETP) % EP and
expert TP r % ETP (a group of ETP consecutive ranks owns the same experts), heads r // replicas
when a model has fewer heads than ranks (the mini model: 2 heads on up to 8 ranks, each head on
n / 2 consecutive ranks, which compute the same values). Heads, vocab, experts and expert TP split
exactly (ValueError naming the field and the allowed rank counts otherwise); the vocabulary and
the other groups split in chunks of 128 lanes (the FFN hidden in partial-sum mode: 64,
`Layout._chunk`): slice i is columns [i·c, (i+1)·c) of the axis zero-padded to ways·c, and an
axis no longer than one chunk stays whole (W_fa's 128 columns, mini's router). Our layout
rotates the chunks of model_cols, down_cols and moe_latent (`start`, `rotations`): the ranks
holding only padding of one matrix hold real chunks of another (what each rank then reads:
`mkresearch info kimi-k3 --ranks 32`).

Two layouts:
    release  docs/kimi-k3.md §9, the public kernels: 3 heads and 5120 vocab rows per rank, EP 8 x ETP 4, the
             FFN hidden sliced (dense 1056 -> 1152, shared 192 -> 256), the MoE latent sliced;
             the router and the attention's latent down-projections (down_cols) whole on every
             rank (an ASSUMPTION: §9 does not say); routed experts in the released format (FP8 gate/up, MXFP4 down, docs/kimi-k3.md §7).
             Its bytes per rank (`mkresearch info kimi-k3 --ranks 32`) stand beside the
             release's own ≈ 6.97 GB (docs/kimi-k3.md §9).
    ours     the same, with down_cols split too, and the experts in the checkpoint's MXFP4
             decoded in VMEM (cfg.expert_format)

Ours places the router's columns as the kernel's option says (`place_router`,
`MegakernelOptions.router_placement`, ROUTER_PLACEMENTS): split with down_cols (as built), or in
a group of their own (`spec.ROUTER_COLS`, `Layout.router_ways` consecutive ranks: a host's, a
sibling pair, or one: whole on every rank), each rank then holding more of them.

How many ways each group splits, an axis's per-rank length and the rank counts that split a
model are the model's (`mkresearch.model.partition`: `Split`, `Layout`, `splits`; one rank of a
full-size preset as a config, `get_config("kimi-k3-rank")`, reads them too); this module adds our
rotations, the partial-sum row splits (`param_shard`), per-rank shapes (`rank_param_shapes`,
`rank_state_shapes`) and the per-rank slices of real arrays (`shard_params`, `shard_state`);
per-rank bytes of one step (sharded vs replicated, by component) from
`mkresearch.sharding.layout_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np

from mkresearch.model import spec
from mkresearch.model.config import ModelConfig
from mkresearch.model.formats import quantized_shapes
from mkresearch.model.partition import (  # noqa: F401 - re-exported: the layout's API
    CHUNKED_GROUPS,
    COLLECTIVES,
    DEFAULT_COLLECTIVES,
    EXACT,
    HALF_LANE,
    LAYOUTS,
    MAX_LISTED_RANKS,
    OURS,
    PADDED_GROUPS,
    PARTIAL_SUM,
    PARTIAL_SUM_MODES,
    RELEASE,
    RELEASE_ETP,
    RELEASE_EXPERT_FORMAT,
    RELEASE_REPLICATED,
    RESTRUCTURED,
    ROUTER_HOST,
    ROUTER_PLACEMENTS,
    ROUTER_REPLICATED,
    ROUTER_SIBLING,
    ROUTER_SPLIT,
    Layout,
    Split,
    allowed_ranks,
    check_ranks,
    chunk_length,
    default_etp,
    expert_output_width,
    expert_widths,
    groups_used,
    has_rules,
    is_param,
    leaves_with_path,
    rank_config,
    splits,
)

# our layout rotates these groups' column chunks (`rotations`): no reduction adds over them
ROTATED_GROUPS = (spec.MODEL_COLS, spec.DOWN_COLS, spec.MOE_LATENT)


def layout(cfg: ModelConfig, n_ranks: int, name: str = OURS, *, etp: int | None = None,
           collectives: str = "exact") -> Layout:
    """The `name` layout (LAYOUTS) of cfg on n_ranks ranks: `partition.splits`, ours with its
    chunks rotated (`rotations`); etp: expert-tensor parallel ways (default `default_etp`);
    collectives: one of COLLECTIVES (`param_shard`). ValueError naming the field for a rank
    count that does not split heads, vocabulary or experts, and for a kind whose parameters have
    no sharding rule."""
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives={collectives!r} is invalid: one of {COLLECTIVES}")
    # the partial-sum modes split W2 by its hidden rows: an etp need not split its columns
    found = splits(cfg, n_ranks, name, etp, columns=collectives == EXACT)
    expert_format = RELEASE_EXPERT_FORMAT if name == RELEASE else cfg.expert_format
    lay = Layout(name=name, cfg=cfg, n_ranks=int(n_ranks), splits=found,
                 expert_format=expert_format, collectives=collectives)
    if name != OURS or lay.n_ranks == 1:
        return lay
    starts = rotations(dataclasses.replace(lay, collectives=PARTIAL_SUM))
    return dataclasses.replace(lay, splits=tuple(
        dataclasses.replace(s, start=starts.get(s.group, 0)) for s in found))


def router_ways(placement: str, n_ranks: int, ranks_per_host: int = 0) -> int:
    """Over how many consecutive ranks the router's columns split under `placement`
    (ROUTER_PLACEMENTS; host: `ranks_per_host`, 0 every rank one host). ValueError naming
    `router_placement` and its allowed values, or `ranks_per_host` when it does not divide the
    ranks into hosts."""
    if placement not in ROUTER_PLACEMENTS:
        raise ValueError(f"router_placement={placement!r} is invalid: one of {ROUTER_PLACEMENTS}")
    if placement == ROUTER_SPLIT:
        return n_ranks
    if placement == ROUTER_REPLICATED or n_ranks == 1:
        return 1
    if placement == ROUTER_SIBLING:
        if n_ranks % 2:
            raise ValueError(f"router_placement='sibling' is invalid on {n_ranks} ranks: sibling "
                             "cores are pairs (an even rank count)")
        return 2
    per_host = ranks_per_host or n_ranks
    if n_ranks % per_host:
        raise ValueError(f"ranks_per_host={ranks_per_host!r} is invalid for "
                         f"router_placement='host' on {n_ranks} ranks: a divisor of {n_ranks}")
    return per_host


def place_router(lay: Layout, placement: str = ROUTER_SPLIT, ranks_per_host: int = 0) -> Layout:
    """`lay` with the MoE router's columns placed (`Layout.router`, ROUTER_PLACEMENTS): "split" as
    laid out (down_cols, over every rank); else ROUTER_COLS over `router_ways` consecutive ranks
    (a host's, a sibling pair, or one: whole on every rank), slice r % ways, never rotated. Every
    rank then holds more of the router's columns (its bytes: `rank_param_shapes`,
    `layout_bytes`); each column's score is still one whole dot of the same x (bit-equal)."""
    ways = router_ways(placement, lay.n_ranks, ranks_per_host)
    if placement == ROUTER_SPLIT:
        return dataclasses.replace(lay, router=ROUTER_SPLIT, router_ways=0)
    return dataclasses.replace(lay, router=placement, router_ways=ways)


def merges_shared_sum(lay: Layout, kind: str) -> bool:
    """Whether, in partial-sum mode, a kind's shared experts' partial sums join its routed
    experts' in one reduction: experts on the full d (no latent projections: their sum and the
    shared experts' are both partial sums of [B, d], added on each rank first), with shared
    experts. The kernel (`kernels.sharded.plan.collective_rules`: `Rule.adds`) and the sharded
    reference (`reference_sharded`) both ask here."""
    params = spec.stage(kind).params(lay.cfg)
    return (lay.partial_sums and lay.n_ranks > 1 and "experts" in params
            and "w_sd" in params and "w_ld" not in params)


def _slice_bytes(lay: Layout, group: str) -> np.ndarray:
    """[ways] the bytes of the slices of `group` by slice index: every parameter split by that
    group alone, counted on the slices holding real data (a slice of padding only is skipped)."""
    out = np.zeros(lay.ways(group))
    for _, p in leaves_with_path(spec.param_table(lay.cfg)):
        shard = param_shard(lay, p)
        active = active_shard(lay, shard, p.shape)
        if [g for _, g in active] != [group]:
            continue
        length = p.shape[active[0][0]]
        nbytes = math.prod(local_shape(lay, p.shape, shard)) * np.dtype(p.dtype).itemsize
        out[:-(-length // lay.local_length(group, length))] += nbytes
    return out


@functools.lru_cache(maxsize=64)
def rotations(lay: Layout) -> dict[str, int]:
    """{group: start} for ROTATED_GROUPS: which slice rank 0 holds (`Split.start`), chosen so that
    the ranks holding only padding of one matrix hold the real column chunks of another: the
    per-rank bytes of the partial-sum layout `lay` (start 0 everywhere) with the least maximum
    (then the least sum of squares), each group's start in turn, three rounds. Kimi K3 on 32
    ranks: W_lu's 28 chunks from rank 3 on, the router's, W_qa's and W_kva's from rank 28 on
    (the bytes per rank: `mkresearch info kimi-k3 --ranks 32`)."""
    vectors = {g: _slice_bytes(lay, g) for g in ROTATED_GROUPS if lay.ways(g) == lay.n_ranks}
    starts, ranks = dict.fromkeys(vectors, 0), np.arange(lay.n_ranks)

    def cost(trial: dict) -> tuple[float, float]:
        per_rank = sum(v[(ranks + trial[g]) % lay.n_ranks] for g, v in vectors.items())
        return float(np.max(per_rank)), float(np.sum(per_rank * per_rank))

    for _ in range(3):
        for group in vectors:
            starts[group] = min(range(lay.n_ranks),
                                key=lambda s, g=group: (cost({**starts, g: s}), s))
    return starts


# ---- per-rank shapes ------------------------------------------------------------------------
def active_shard(lay: Layout, shard: Any, shape: tuple[int, ...]) -> tuple[tuple[int, str], ...]:
    """The (axis, group) pairs of a rule that this layout splits for a leaf of `shape`."""
    return tuple((axis, group) for axis, group in (shard or ())
                 if lay.divides(group, shape[axis]))


def param_shard(lay: Layout, p: Any) -> Any:
    """The split a layout gives parameter p: its rule, or in the partial-sum layouts, for a matrix
    whose input arrives split by a group (Param.gather: W_o, W_down, an expert's W2; in the
    restructured layout also Param.scattered: W_lu), its rows by that group instead (each rank
    multiplies its slice of the contraction: partial sums)."""
    if p.router and lay.router != ROUTER_SPLIT and p.shard:  # placed apart (`place_router`)
        return tuple((axis, spec.ROUTER_COLS if group == spec.DOWN_COLS else group)
                     for axis, group in p.shard)
    rows = len(p.shape) - 2
    by = p.gather or (p.scattered if lay.collectives == RESTRUCTURED else None)
    if not lay.partial_sums or by is None or rows < 0 or not lay.divides(by, p.shape[rows]):
        return p.shard
    return tuple((axis, group) for axis, group in p.shard if axis < rows) + ((rows, by),)


def local_shape(lay: Layout, shape: tuple[int, ...], shard: Any) -> tuple[int, ...]:
    out = list(shape)
    for axis, group in active_shard(lay, shard, shape):
        out[axis] = lay.local_length(group, shape[axis])
    return tuple(out)


def rank_params(lay: Layout) -> dict:
    """The parameter table (spec.Param leaves) with one rank's shapes."""
    return jax.tree.map(lambda p: dataclasses.replace(
        p, shape=local_shape(lay, p.shape, param_shard(lay, p))),
                        spec.param_table(lay.cfg), is_leaf=is_param)


def storage(cfg: ModelConfig, param: spec.Param, expert_format: str | None = None) -> Any:
    if param.quantized:
        return quantized_shapes(param.shape, expert_format or cfg.expert_format)
    return jax.ShapeDtypeStruct(param.shape, param.dtype)


def count_format(lay: Layout, key: str) -> str:
    """The format a routed-expert matrix's bytes are counted in: the layout's (the release's:
    FP8 gate/up W1, W3 and MXFP4 down W2)."""
    if lay.expert_format == RELEASE_EXPERT_FORMAT:
        return "mxfp4" if key.endswith("['w2']") else "fp8"
    return lay.expert_format or lay.cfg.expert_format


def rank_param_shapes(lay: Layout) -> dict:
    """One rank's parameter pytree as jax.ShapeDtypeStruct leaves (stored formats)."""
    return jax.tree.map(lambda p: storage(lay.cfg, p), rank_params(lay), is_leaf=is_param)


def rank_state_shapes(lay: Layout, batch: int, seq_len: int | None = None) -> dict:
    """One rank's decode state {kind: {leaf: ShapeDtypeStruct}}."""
    seq_len = lay.cfg.max_seq_len if seq_len is None else seq_len
    return {kind: {name: jax.ShapeDtypeStruct(local_shape(lay, leaf.shape, leaf.shard), leaf.dtype)
                   for name, leaf in leaves.items()}
            for kind, leaves in spec.state_table(lay.cfg, batch, seq_len).items()}


# ---- per-rank slices of real arrays -----------------------------------------------------------
def _slice(lay: Layout, array: Any, logical: tuple[int, ...], shard: Any, rank: int) -> np.ndarray:
    """rank's slice of one stored array (a quantized part packs an axis: same slice, scaled)."""
    out = np.asarray(array)
    for axis, group in active_shard(lay, shard, logical):
        factor = logical[axis] // out.shape[axis]  # 1, or the values per stored element
        start, stop, local = lay.bounds(group, logical[axis], rank)
        part = np.take(out, np.arange(start // factor, stop // factor), axis=axis)
        pad = [(0, 0)] * out.ndim
        pad[axis] = (0, local // factor - part.shape[axis])
        out = np.pad(part, pad)
    return out


def _shard_tree(lay: Layout, table: Any, tree: Any, shard_of, ranks: Any = None) -> Any:
    """Every leaf of `tree` (matching `table`'s Param / StateLeaf leaves) as [n_ranks, ...] (or
    [len(ranks), ...]: those ranks' slices, in that order)."""
    ranks = range(lay.n_ranks) if ranks is None else ranks

    def one(entry, value):
        def stack(part):
            return np.stack([_slice(lay, part, entry.shape, shard_of(entry), r) for r in ranks])
        return jax.tree.map(stack, value)

    return jax.tree.map(one, table, tree, is_leaf=lambda x: isinstance(x, (spec.Param,
                                                                           spec.StateLeaf)))


def shard_params(params: dict, lay: Layout, ranks: Any = None) -> dict:
    """The parameters as every rank's slice stacked along a leading rank axis: [n_ranks, ...]
    (numpy; what `jax.shard_map` over the rank axis hands each rank); `ranks`: only those ranks'
    slices, [len(ranks), ...] in that order (one process's ranks of a multi-process run)."""
    return _shard_tree(lay, spec.param_table(lay.cfg), params, lambda p: param_shard(lay, p),
                       ranks)


def shard_state(state: dict, lay: Layout) -> dict:
    """A decode state {kind: {leaf: [n_layers, B, ...]}} as each rank's slice, [n_ranks, ...]."""
    batch = next(iter(next(iter(state.values())).values())).shape[1]
    seq_len = _seq_len(state, lay.cfg, batch)
    return _shard_tree(lay, spec.state_table(lay.cfg, batch, seq_len), state, lambda s: s.shard)


def state_mismatches(rank_state: Any, state: dict, lay: Layout) -> list[dict]:
    """Where a sharded state (leaves [n_ranks, ...]: a sharded step's) differs in any bit from
    each rank's slice of a whole-model `state` (`shard_state`) -> one dict per differing leaf:
    "leaf" (kind/name), "ranks", "elements" differing, "max_abs_diff", and "first" (the first
    differing index of a rank's slice: rank, layer, row, ...). [] when every leaf is equal."""
    want = shard_state(state, lay)
    got_leaves = jax.tree_util.tree_flatten_with_path(rank_state)[0]
    out = []
    for (path, got), want_leaf in zip(got_leaves, jax.tree.leaves(want), strict=True):
        got, want_leaf = np.asarray(got), np.asarray(want_leaf)
        differs = got.view(np.uint8).reshape(got.shape + (-1,)) != \
            want_leaf.view(np.uint8).reshape(want_leaf.shape + (-1,))
        differs = differs.any(-1)
        if not differs.any():
            continue
        delta = np.abs(got.astype(np.float64) - want_leaf.astype(np.float64))[differs]
        out.append({"leaf": "/".join(str(getattr(k, "key", k)) for k in path),
                    "ranks": sorted({int(r) for r in np.nonzero(differs)[0]}),
                    "elements": int(differs.sum()), "max_abs_diff": float(delta.max()),
                    "first": [int(i) for i in np.argwhere(differs)[0]]})
    return out


def _seq_len(state: dict, cfg: ModelConfig, batch: int) -> int:
    for kind, leaves in spec.state_table(cfg, batch, 1).items():
        for name, leaf in leaves.items():
            if leaf.token_axis is not None:
                return state[kind][name].shape[leaf.token_axis]
    return cfg.max_seq_len


