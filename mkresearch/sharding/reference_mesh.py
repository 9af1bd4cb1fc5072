"""The sharded reference on a mesh of devices, in one process or across several: plain JAX under
`jax.shard_map`, each rank holding only its slices of the weights.

Each rank holds what the layout gives it (`layout.shard_params`: the same slices the sharded
megakernel holds, so a process loads only its ranks' shards: `mkresearch.checkpoint.rank_loader`),
and computes the step of `reference_sharded` with them:

  partial sums    a matrix the partial-sum layout splits by its rows (W_o, W_down, the shared
                  experts' W_sd: `reference_sharded`'s `Partials`) stays on its ranks: each rank
                  multiplies its slice of the contraction, the partial products are all-gathered
                  and every rank adds them in the one fixed order (`numerics.reduce_partials`);
                  the routed experts likewise: each rank the weighted sum of its expert group's
                  experts, the groups' sums all-gathered and added in group order; with the
                  restructured collectives W_lu too (`reference_sharded`'s `NormedRows`): each
                  rank its latent rows' product and Σ ρ², both all-gathered and added in the
                  order of the shared experts' sum, RMSNorm's scale applied after it
  the rest        every other split weight (by heads, vocabulary, column chunks) is all-gathered
                  whole at the step's start, and every rank computes the rest of the step whole
                  (as the exact collectives do: they move whole values, so nothing changes)

so its logits and state equal `reference_sharded.decode_step`'s on one device for the layout's
collectives, partial-sum or restructured (and, with collectives "exact",
`reference.decode_step`'s): the same partial products added in the same order. Across processes
the all-gathers are JAX's collectives between them (gloo on CPU), which move bits, never add
them: 2 processes of 4 devices give the bits of 1 process of 8 (tests/test_multihost.py). The
state is whole and replicated on every rank.

Experts split by ETP too (`layout.layout(etp=)`: each expert's hidden over the ETP ranks of its
group): each rank computes its hidden slice's partial output of its group's chosen experts
(W1, W3 by their hidden columns, W2 by its rows, each product rounded to bf16 as the kernel
does), sums them, and every rank's sum is all-gathered and added in rank order, as
`reference_sharded` adds them (`numerics.ExpertGroups` with `ranks`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from mkresearch.hardware import distributed
from mkresearch.model import reference, spec
from mkresearch.model.numerics import (
    ExpertGroups,
    NormedRows,
    Partials,
    bf,
    group_sum,
    matmul,
    ordered_sum,
)
from mkresearch.sharding import layout as layouts
from mkresearch.sharding import reference_sharded

AXIS = "ranks"  # the mesh axis (the sharded megakernel's name for it too)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pieces"],
                   meta_fields=["bounds", "wire", "hosts", "starts", "firsts", "axis"])
@dataclass(frozen=True)
class RankPartials(Partials):
    """A row-split matrix as one rank holds it: pieces = (this rank's slice,), rows from
    starts[rank] of the input (zero-padded as the layout pads them); its partial product is
    all-gathered over `axis` and the slices' products (one per slice: the ranks `firsts`) are
    added as `Partials` adds them."""

    starts: tuple = ()
    firsts: tuple = ()
    axis: str = AXIS

    def products(self, a: jax.Array) -> list:
        piece = self.pieces[0]
        rows = piece.shape[-2]
        need = max(self.starts) + rows - a.shape[-1]
        x = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, max(need, 0))])
        start = jnp.asarray(self.starts, jnp.int32)[lax.axis_index(self.axis)]
        gathered = lax.all_gather(matmul(lax.dynamic_slice_in_dim(x, start, rows, axis=-1),
                                         piece), self.axis)  # [n_ranks, ..., N]
        return [gathered[rank] for rank in self.firsts]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pieces"],
                   meta_fields=["bounds", "wire", "hosts", "spans", "firsts", "axis"])
@dataclass(frozen=True)
class RankNormedRows(NormedRows):
    """The restructured mode's W_lu as one rank holds it: pieces = (this rank's latent rows,),
    rows spans[rank] = (start, stop) of ρ (zero-padded as the layout pads them); its partial
    product and Σ ρ² are all-gathered over `axis` and the slices' (one per slice: the ranks
    `firsts`) added as `NormedRows` adds them."""

    spans: tuple = ()
    firsts: tuple = ()
    axis: str = AXIS

    def parts(self, v: jax.Array, g: jax.Array) -> tuple[list, list]:
        piece = self.pieces[0]
        rows = piece.shape[-2]
        need = max(max(first for first, _ in self.spans) + rows - v.shape[-1], 0)
        rank = lax.axis_index(self.axis)
        start = jnp.asarray([first for first, _ in self.spans], jnp.int32)[rank]
        length = jnp.asarray([end - first for first, end in self.spans], jnp.int32)[rank]
        real = jnp.arange(rows) < length  # this rank's real rows; the rest its padding: zeros
        chunk = jnp.where(real, lax.dynamic_slice_in_dim(
            jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, need)]), start, rows, axis=-1), 0.0)
        gain = jnp.where(real, lax.dynamic_slice_in_dim(jnp.pad(g, (0, need)), start, rows), 0.0)
        square = ordered_sum(chunk * chunk, keepdims=True)  # [B, 1]
        product = matmul(bf(chunk * gain), piece)  # [B, N]
        products, squares = (lax.all_gather(part, self.axis) for part in (product, square))
        return [products[r] for r in self.firsts], [squares[r] for r in self.firsts]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["experts"],
                   meta_fields=["groups", "wire", "hosts", "merged", "ranks", "group_of_rank",
                                "firsts", "per_group", "axis"])
@dataclass(frozen=True)
class RankExpertGroups(ExpertGroups):
    """The routed experts as one rank holds them: `experts` its group's (ids group·per_group
    onwards); the rank sums its group's chosen experts, the groups' sums are all-gathered over
    `axis` (one per group: the ranks `firsts`) and added as `ExpertGroups` adds them."""

    group_of_rank: tuple = ()
    firsts: tuple = ()
    per_group: int = 1
    axis: str = AXIS

    def _group(self) -> jax.Array:
        return jnp.asarray(self.group_of_rank, jnp.int32)[lax.axis_index(self.axis)]

    def chosen(self, expert_ids: jax.Array) -> Any:
        # another group's choices read an expert of this group: group_sums leaves them out
        local = jnp.clip(expert_ids - self._group() * self.per_group, 0, self.per_group - 1)
        return jax.tree.map(lambda w: w[local], self.experts)

    def group_sums(self, y: jax.Array, coef: jax.Array, ids: jax.Array) -> list:
        mine = group_sum(y, coef, ids // self.per_group == self._group())  # [B, n]
        gathered = lax.all_gather(mine, self.axis)  # [n_ranks, B, n]
        return [gathered[rank] for rank in self.firsts]

    def slice_outputs(self, h: jax.Array, product) -> list:
        # ETP > 1: the rank holds its hidden slice of W1, W3 (h is that slice's) and its rows
        # of W2: its own slice's partial output only
        return [product(h, None)]

    def rank_sums(self, ys: list, coef: jax.Array, ids: jax.Array) -> list:
        # every rank's sum over its group's experts, all-gathered, in rank order
        mine = group_sum(ys[0], coef, ids // self.per_group == self._group())  # [B, n]
        gathered = lax.all_gather(mine, self.axis)  # [n_ranks, B, n]
        return [gathered[rank] for rank in range(gathered.shape[0])]


@dataclass(frozen=True)
class MeshReference:
    """What is static about the mesh reference of a layout (hashable: a jit static argument)."""

    layout: layouts.Layout
    wire: str = "f32"
    ranks_per_host: int = 0  # the kernel's hosts (`reference_sharded.sharded_params`)

    def __post_init__(self) -> None:
        lay = self.layout
        if lay.partial_sums:  # partial-sum or restructured
            reference_sharded.check_hosts(lay, self.ranks_per_host)


def make_mesh(n_ranks: int) -> Any:
    """A 1-D mesh of n_ranks devices over every process's (`distributed.mesh`)."""
    return distributed.mesh(n_ranks, AXIS)


def place_params(rank_params: dict, mesh: Any) -> dict:
    """This process's ranks' slices (leaves [n_local, ...], `distributed.local_ranks` order:
    `layout.shard_params(params, lay, ranks)` or a checkpoint's `rank_loader`) on the mesh."""
    return distributed.put_local(rank_params, mesh, P(AXIS))


def place_state(state: dict, mesh: Any) -> dict:
    """A whole-model decode state, replicated on every rank."""
    return distributed.put(state, mesh, P())


# ---- one rank's view of the weights ---------------------------------------------------------
def _gather_whole(lay: layouts.Layout, p: spec.Param, local: Any) -> Any:
    """A parameter's whole value on every rank from each rank's slice (all-gathered): the slices'
    real elements joined in slice order along each split axis (`layout._slice` inverted)."""
    active = layouts.active_shard(lay, layouts.param_shard(lay, p), p.shape)
    if not active:
        return local

    def one(part, whole):
        joins = []  # (axis, group, the real stored length of each slice of the group)
        for axis, group in active:
            factor = p.shape[axis] // whole.shape[axis]  # 1, or the values per stored element
            split = lay.split(group)
            bounds = [lay.bounds(group, p.shape[axis], split.rank_of(i))
                      for i in range(split.ways)]
            joins.append((axis, group, [(stop - start) // factor
                                        for start, stop, *_ in bounds]))
        return _join(lax.all_gather(part, AXIS), list(range(lay.n_ranks)), joins, lay)
    # the whole stored shapes (a tree of parts for a quantized parameter)
    return jax.tree.map(one, local, layouts.storage(lay.cfg, p))


def _join(gathered: jax.Array, ranks: list, joins: list, lay: layouts.Layout) -> jax.Array:
    """The whole array from gathered [n_ranks, *local], over `ranks`: along the first join's axis
    slice 0, 1, ... of its group (each cut to its real length; a slice of padding alone left
    out), each joined first along the other joins' axes from the ranks holding it."""
    (axis, group, lengths), rest = joins[0], joins[1:]
    split, pieces = lay.split(group), []
    for i, length in enumerate(lengths):
        if length == 0:
            continue
        holding = [r for r in ranks if split.index(r) == i]
        piece = _join(gathered, holding, rest, lay) if rest else gathered[holding[0]]
        pieces.append(lax.slice_in_dim(piece, 0, length, axis=axis))
    return jnp.concatenate(pieces, axis=axis)


def _rank_partials(lay: layouts.Layout, p: spec.Param, local: Any, group: str, wire: str,
                   per_host: int) -> RankPartials:
    rows = len(p.shape) - 2
    firsts = lay.slice_firsts(group)
    starts = tuple(lay.bounds(group, p.shape[rows], r)[0] for r in range(lay.n_ranks))
    bounds = tuple(lay.bounds(group, p.shape[rows], r)[:2] for r in firsts)
    return RankPartials((local,), bounds, wire, tuple(r // per_host for r in firsts), starts,
                        firsts, AXIS)


def _rank_normed_rows(lay: layouts.Layout, p: spec.Param, entries: dict, local: Any,
                      wire: str, per_host: int) -> RankNormedRows:
    """As `reference_sharded`'s W_lu: one piece per slice of the group its shared experts'
    reduction adds (`Param.beside`), in that order, each rank's rows of ρ by `Param.scattered`."""
    rows = len(p.shape) - 2
    firsts = lay.slice_firsts(entries[p.beside].gather)
    spans = tuple(lay.bounds(p.scattered, p.shape[rows], r)[:2] for r in range(lay.n_ranks))
    return RankNormedRows((local,), tuple(spans[r] for r in firsts), wire,
                          tuple(r // per_host for r in firsts), spans, firsts, AXIS)


def _rank_experts(lay: layouts.Layout, kind: str, local: Any, wire: str,
                  per_host: int) -> RankExpertGroups:
    """As `reference_sharded._expert_groups`: one partial per expert group (ETP = 1), or with
    ETP > 1 one per rank (its group and hidden slice), in rank order."""
    firsts = tuple(g * lay.etp for g in range(lay.ep))
    ep, pieces = lay.split(spec.EXPERTS), lay.split(spec.EXPERT_TP)
    ranks = (() if lay.etp == 1 else
             tuple((ep.index(r), pieces.index(r)) for r in range(lay.n_ranks)))
    hosts = tuple(r // per_host for r in (firsts if lay.etp == 1 else range(lay.n_ranks)))
    return RankExpertGroups(local, lay.ep, wire, hosts, layouts.merges_shared_sum(lay, kind),
                            ranks, group_of_rank=tuple(ep.index(r) for r in range(lay.n_ranks)),
                            firsts=firsts, per_group=lay.cfg.n_experts // lay.ep, axis=AXIS)


def rank_params(plan: MeshReference, local: dict) -> dict:
    """Inside the mesh: the parameters as the reference reads them on this rank, from its slices
    `local` (module docstring: row-split matrices and expert groups stay, the rest gathered)."""
    lay = plan.layout
    partial = lay.partial_sums and lay.n_ranks > 1  # partial-sum or restructured
    per_host = plan.ranks_per_host or lay.n_ranks
    out = {}
    for kind, entries in spec.param_table(lay.cfg).items():
        if not isinstance(entries, dict):
            out[kind] = _gather_whole(lay, entries, local[kind])
            continue
        stack = {}
        for key, p in entries.items():
            if key == "experts" and partial:
                stack[key] = _rank_experts(lay, kind, local[kind][key], plan.wire, per_host)
            elif not isinstance(p, spec.Param):  # the experts' w1, w3, w2
                stack[key] = {name: _gather_whole(lay, q, local[kind][key][name])
                              for name, q in p.items()}
            elif partial and (group := reference_sharded.row_split(lay, p)) is not None:
                stack[key] = _rank_partials(lay, p, local[kind][key], group, plan.wire, per_host)
            elif partial and reference_sharded.scattered_rows(lay, p):  # restructured: W_lu
                stack[key] = _rank_normed_rows(lay, p, entries, local[kind][key], plan.wire,
                                               per_host)
            else:
                stack[key] = _gather_whole(lay, p, local[kind][key])
        out[kind] = stack
    return out


# ---- the step -------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _call(plan: MeshReference, mesh: Any, params: dict, state: dict, tokens: jax.Array,
          positions: jax.Array):
    def per_rank(params, state, tokens, positions):
        local = jax.tree.map(lambda a: a[0], params)
        return reference.decode_step_jit(rank_params(plan, local), state, tokens, positions,
                                          cfg=plan.layout.cfg)

    return jax.shard_map(per_rank, mesh=mesh, in_specs=(P(AXIS), P(), P(), P()),
                         out_specs=(P(), P(), P()), check_vma=False)(params, state, tokens,
                                                                     positions)


def decode_step(params: dict, state: dict, tokens: Any, positions: Any, plan: MeshReference,
                mesh: Any) -> tuple[jax.Array, dict, dict]:
    """One step of the sharded reference on the mesh -> (logits [B, V] f32, state, aux), each
    replicated on every rank (`distributed.to_host` reads them on any process). params:
    `place_params` of the ranks' slices of plan.layout; state: `place_state` (donated); tokens,
    positions [B] (host values, the same on every process). Every process calls it together."""
    if not isinstance(plan, MeshReference):
        raise ValueError(f"plan={plan!r} is invalid: a MeshReference")  # noqa: TRY004
    reference.check_step_inputs(state, np.asarray(tokens), np.asarray(positions),
                                 plan.layout.cfg)
    inputs = distributed.put((np.asarray(tokens, np.int32), np.asarray(positions, np.int32)),
                             mesh, P())
    return _call(plan, mesh, params, state, *inputs)
