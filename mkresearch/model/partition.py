"""How a model splits across ranks, from the sharding rules its kinds declare (`spec.Param.shard`):
how many ways each group splits on n ranks (`Split`, `splits`), each axis's per-rank length
(`Layout.local_length`), which rank counts split a model at all, and one rank's shapes as a
config of its own (`rank_config`: `get_config("kimi-k3-rank")`).

Rank counts: the heads (and GQA's K/V heads with their query heads), the vocabulary in whole lane
tiles with real rows on every rank, the routed experts as EP x ETP with every axis an expert's TP
splits in whole lane tiles. A rank count that does not split is a ValueError naming the field and
the allowed rank counts. The layout itself (which slice each rank holds, its per-rank shapes and
slices of real arrays, our rotations) is `mkresearch.sharding.layout`, built on these splits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any

import jax
import numpy as np

import mkresearch.model.stages  # noqa: F401 - registers the built-in stage kinds and their rules
from mkresearch.model import spec
from mkresearch.model.config_rules import EXPERT_BLOCKS
from mkresearch.model.model_config import LANE, ModelConfig

RELEASE_ETP = 4  # docs/kimi-k3.md §9: expert-tensor parallel 4 (EP = n_ranks / 4, 8 at 32 ranks)
MAX_LISTED_RANKS = 256  # ValueErrors list the allowed rank counts up to this
OURS, RELEASE = "ours", "release"
LAYOUTS = (OURS, RELEASE)
EXACT, PARTIAL_SUM, RESTRUCTURED = "exact", "partial-sum", "restructured"
# how matrices split: by their contraction (partial sums, the sharded megakernel's default), by
# output columns, or partial sums with the MoE reductions restructured (ρ reduce-scattered, W_lu
# split by its latent rows, its partial sums beside the shared experts' in one reduction, ρ's
# RMSNorm scale applied after the sum: `Param.scattered`, `kernels/sharded/plan.py`). The one list
# of mode names: every mode the sharded megakernel builds (`layout`, the CLI's `decode
# --collectives`) and the prediction prices (`predict --collectives`, `plan --collectives`)
COLLECTIVES = (PARTIAL_SUM, EXACT, RESTRUCTURED)
PARTIAL_SUM_MODES = (PARTIAL_SUM, RESTRUCTURED)  # the modes whose matrices split by their rows
DEFAULT_COLLECTIVES = PARTIAL_SUM
# groups split in chunks of whole lane tiles (zero-padded), not exactly
PADDED_GROUPS = (spec.FFN_HIDDEN, spec.MODEL_COLS, spec.DOWN_COLS, spec.MOE_LATENT)
# split in lane-tile chunks (the rest exactly); the router's columns placed apart too (ROUTER_COLS)
CHUNKED_GROUPS = (*PADDED_GROUPS, spec.VOCAB, spec.ROUTER_COLS)
# groups the release keeps whole on every rank: the router and the latent down-projections.
# ASSUMPTION: docs/kimi-k3.md §9 does not say how they split (docs/collectives.md splits the router's scores
# between siblings); kept whole, a rank reads 7.0 GB at B = 1 against §9's ≈ 6.97
RELEASE_REPLICATED = (spec.DOWN_COLS,)
HALF_LANE = LANE // 2  # the partial-sum FFN hidden's chunk unit (`Layout._chunk`)
RELEASE_EXPERT_FORMAT = "released"  # roofline's name for FP8 gate/up + MXFP4 down (docs/kimi-k3.md §7)
# where the MoE router's columns live (`Layout.router`; the kernel's
# `MegakernelOptions.router_placement`, the prediction's `designs`): split over every rank with the
# other down-projections (as built: its scores gathered with W_ld's latent in one all-gather over
# every rank before top-k), over the ranks of one host, between sibling cores (ranks r and r ^ 1),
# or whole on every rank (no gather before top-k)
ROUTER_SPLIT, ROUTER_HOST, ROUTER_SIBLING, ROUTER_REPLICATED = "split", "host", "sibling", "replicated"
ROUTER_PLACEMENTS = (ROUTER_SPLIT, ROUTER_HOST, ROUTER_SIBLING, ROUTER_REPLICATED)  # as built first
RELEASE_RANKS = 32  # docs/kimi-k3.md §9: 16 TPU7x chips x 2 TensorCores (one rank of them: '<preset>-rank')


def is_param(x: Any) -> bool:
    return isinstance(x, spec.Param)


def leaves_with_path(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in
            jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_param)]


def chunk_length(length: int, ways: int) -> int:
    """Per-rank chunk of a padded group: ceil(length / ways) rounded up to whole lane tiles."""
    per_rank = -(-length // ways)
    return -(-per_rank // LANE) * LANE


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=64)
def groups_used(cfg: ModelConfig) -> frozenset[str]:
    """The sharding groups some parameter or state leaf of cfg splits by."""
    leaves = [leaf for _, leaf in leaves_with_path(spec.param_table(cfg))]
    leaves += [leaf for kind in spec.state_table(cfg, 1, cfg.kv_tile).values()
               for leaf in kind.values()]
    return frozenset(group for leaf in leaves for _, group in (leaf.shard or ()))


@functools.lru_cache(maxsize=64)
def expert_widths(cfg: ModelConfig) -> tuple[int, ...]:
    """The lengths of the routed experts' axes split by expert TP (the hidden of W1 and W3, the
    output columns of W2: the latent, or d on the full d), from the kinds' rules."""
    return tuple(sorted({leaf.shape[axis] for _, leaf in leaves_with_path(spec.param_table(cfg))
                         for axis, group in (leaf.shard or ()) if group == spec.EXPERT_TP}))


def expert_output_width(cfg: ModelConfig) -> int:
    """The columns of an expert's output (W2's, split by expert TP): the latent (Kimi K3's moe)
    or d (moe_full): what the experts' weighted sum runs over."""
    outputs = {leaf.shape[-1] for _, leaf in leaves_with_path(spec.param_table(cfg))
               if leaf.gather == spec.EXPERT_TP}
    return max(outputs) if outputs else cfg.moe_latent


def _heads_ok(cfg: ModelConfig, n: int) -> bool:
    return cfg.n_heads % n == 0 or n % cfg.n_heads == 0


def _head_ways(cfg: ModelConfig, n: int) -> int:
    return min(n, cfg.n_heads)


def _kv_heads_ok(cfg: ModelConfig, n: int) -> bool:
    """Each rank's query heads read K/V heads it holds whole: the head slices split the K/V heads
    evenly, or each K/V head's query heads are whole head slices (it is then replicated)."""
    if spec.KV_HEADS not in groups_used(cfg):
        return True
    ways, kv = _head_ways(cfg, n), cfg.n_kv_heads
    return kv % ways == 0 or ways % kv == 0


def _vocab_ok(cfg: ModelConfig, n: int) -> bool:
    """Whole lane tiles per rank, and every rank holds real rows (the last one's tail padded)."""
    return n == 1 or (n - 1) * chunk_length(cfg.vocab_size, n) < cfg.vocab_size


def hidden_unit(cfg: ModelConfig) -> int:
    """The least slice of an expert's hidden a rank may hold: whole lane tiles and whole scale
    blocks of the expert format (the hidden is W2's contraction; a rank's config holds its
    slice as expert_hidden, e.g. fp8: multiples of 256)."""
    return math.lcm(LANE, EXPERT_BLOCKS.get(cfg.expert_format, 1))


def _expert_ways(cfg: ModelConfig, n: int, etp: int, columns: bool = True) -> bool:
    """EP = n / etp divides the experts; etp splits the hidden in lane tiles and `hidden_unit`s
    and, with `columns` (the exact mode, which splits W2 by its output columns), the experts'
    output columns in lane tiles too (the partial-sum modes split W2 by its hidden rows)."""
    widths = expert_widths(cfg) if columns else (cfg.expert_hidden,)
    return (n % etp == 0 and cfg.n_experts % (n // etp) == 0
            and all(width % (etp * LANE) == 0 for width in widths)
            and cfg.expert_hidden % (etp * hidden_unit(cfg)) == 0)


def _expert_fields(cfg: ModelConfig, columns: bool = True) -> str:
    out = expert_output_width(cfg)
    name = "moe_latent" if out == cfg.moe_latent and spec.MOE_LATENT in groups_used(cfg) \
        else "d_model"
    unit = hidden_unit(cfg)
    hidden = (f"whole {unit}-value {cfg.expert_format} scale blocks" if unit != LANE
              else f"whole {LANE}-lane tiles")
    if not columns:
        lanes = "" if unit == LANE else f" and of whole {LANE}-lane tiles"
        return f"expert_hidden={cfg.expert_hidden} in ETP slices of {hidden}{lanes}"
    return (f"expert_hidden={cfg.expert_hidden} in ETP slices of {hidden}, and {name}={out} "
            f"(W2's columns) in ETP whole {LANE}-lane slices")


def default_etp(cfg: ModelConfig, n: int, name: str = "ours") -> int:
    """Expert-tensor parallel ways: the release's 4 when n_ranks allows (EP >= 8 and the hidden
    splits in whole lane tiles), else the largest such divisor of n with EP = n / ETP >= 8;
    1 (pure expert parallel) when n <= 8."""
    del name  # both layouts split experts as the release does (docs/kimi-k3.md §9)
    options = [etp for etp in _divisors(n) if etp <= RELEASE_ETP and n // etp >= min(n, 8)
               and _expert_ways(cfg, n, etp)]
    return max(options) if options else 1


def expert_tp_ways(cfg: ModelConfig, n: int, columns: bool = True) -> list[int]:
    """The expert-tensor ways cfg's experts split into on n ranks (`_expert_ways`; `columns`
    False: the partial-sum modes', W2 split by its rows)."""
    return [etp for etp in _divisors(n) if _expert_ways(cfg, n, etp, columns)]


def allowed_ranks(cfg: ModelConfig, limit: int = MAX_LISTED_RANKS) -> list[int]:
    """Rank counts in [1, limit] that split cfg's heads, vocabulary and experts."""
    return [n for n in range(1, limit + 1)
            if _heads_ok(cfg, n) and _kv_heads_ok(cfg, n) and _vocab_ok(cfg, n)
            and any(_expert_ways(cfg, n, etp) for etp in _divisors(n))]


def check_ranks(cfg: ModelConfig, n_ranks: Any, etp: int | None = None,
                columns: bool = True) -> None:
    """ValueError naming the field that n_ranks does not divide, with the allowed rank counts;
    `columns` False: an etp asked for need not split W2's output columns (`_expert_ways`)."""
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, (int, np.integer)) or n_ranks < 1:
        raise ValueError(f"n_ranks={n_ranks!r} is invalid: an int >= 1 (allowed for {cfg.name}: "
                         f"{_listed(allowed_ranks(cfg))})")
    n = int(n_ranks)
    allowed = _listed(allowed_ranks(cfg))
    if not _heads_ok(cfg, n):
        raise ValueError(f"n_ranks={n} is invalid for {cfg.name}: it must divide n_heads="
                         f"{cfg.n_heads} or be a multiple of it (allowed rank counts: {allowed})")
    if not _kv_heads_ok(cfg, n):
        raise ValueError(f"n_ranks={n} is invalid for {cfg.name}: n_kv_heads={cfg.n_kv_heads} "
                         f"must split evenly over the {_head_ways(cfg, n)} head slices or each "
                         f"K/V head's query heads be whole slices (allowed rank counts: "
                         f"{allowed})")
    if not _vocab_ok(cfg, n):
        raise ValueError(f"n_ranks={n} is invalid for {cfg.name}: vocab_size={cfg.vocab_size} must "
                         f"split into whole {LANE}-lane tiles per rank with real rows on every "
                         f"rank (allowed rank counts: {allowed})")
    if etp is None:
        if not any(_expert_ways(cfg, n, e) for e in _divisors(n)):
            raise ValueError(f"n_ranks={n} is invalid for {cfg.name}: n_experts={cfg.n_experts} "
                             f"must split into EP = n_ranks / ETP groups with "
                             f"{_expert_fields(cfg)} (allowed rank counts: {allowed})")
    elif isinstance(etp, bool) or not isinstance(etp, int) or etp < 1 \
            or not _expert_ways(cfg, n, etp, columns):
        good = [e for e in _divisors(n) if _expert_ways(cfg, n, e, columns)]
        raise ValueError(f"etp={etp!r} is invalid for {cfg.name} on {n} ranks: a divisor of "
                         f"n_ranks with n_experts={cfg.n_experts} divisible by n_ranks / etp and "
                         f"{_expert_fields(cfg, columns)} (allowed: {good})")


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values)) or "none"


# ---- a layout: how many ways each group splits, and an axis's per-rank length ----------------
@dataclass(frozen=True)
class Split:
    """How one group splits: rank r holds slice (r // stride + start) % ways."""

    group: str
    ways: int
    stride: int = 1
    start: int = 0  # the slice rank 0 holds (a rotation: `ROTATIONS`)

    def index(self, rank: int) -> int:
        return (rank // self.stride + self.start) % self.ways

    def rank_of(self, index: int) -> int:
        """The first rank holding slice `index`."""
        return (index - self.start) % self.ways * self.stride


@dataclass(frozen=True)
class Layout:
    """Which slice of every group each of `n_ranks` ranks holds (hashable: a static argument)."""

    name: str
    cfg: ModelConfig
    n_ranks: int
    splits: tuple[Split, ...]
    expert_format: str = ""  # the routed experts' format its bytes are counted in
    # "exact": every matrix split by its output columns; "partial-sum": a matrix whose input
    # arrives split (Param.gather) split by its rows instead, its products partial sums;
    # "restructured": partial-sum, and W_lu split by its rows too (`Param.scattered`)
    collectives: str = "exact"
    # where the router's columns live (ROUTER_PLACEMENTS, `router_ways`: over how many
    # consecutive ranks, ROUTER_COLS); out of the repr while "split" (recorded compiles'
    # fingerprints): `mkresearch.sharding.layout.place_router`
    router: str = field(default=ROUTER_SPLIT, repr=False)
    router_ways: int = field(default=0, repr=False)

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.repr or self.router != ROUTER_SPLIT]
        return f"Layout({', '.join(shown)})"

    @property
    def partial_sums(self) -> bool:
        """Whether matrices whose input arrives split are split by their rows (PARTIAL_SUM_MODES)."""
        return self.collectives in PARTIAL_SUM_MODES

    def split(self, group: str) -> Split:
        """How `group` splits (whole when the layout has no split for it: a group no leaf of the
        model uses, e.g. kv_heads without GQA)."""
        if group == spec.ROUTER_COLS:  # consecutive ranks, slice r % ways (`router_ways`)
            return Split(group, max(self.router_ways, 1))
        return next((s for s in self.splits if s.group == group), Split(group, 1))

    def ways(self, group: str) -> int:
        return self.split(group).ways

    @property
    def ep(self) -> int:
        return self.ways(spec.EXPERTS)

    @property
    def etp(self) -> int:
        return self.ways(spec.EXPERT_TP)

    @property
    def head_replicas(self) -> int:
        """Ranks holding the same heads (> 1 only when the model has fewer heads than ranks)."""
        return self.split(spec.HEADS).stride

    def divides(self, group: str, length: int) -> bool:
        """Whether an axis of `length` splits by `group` here (more than one way, and for a
        padded group a chunk shorter than the axis)."""
        ways = self.ways(group)
        return ways > 1 and (group not in CHUNKED_GROUPS or self._chunk(group, length) < length)

    def _chunk(self, group: str, length: int) -> int:
        """A chunked group's per-rank chunk: whole lane tiles (`chunk_length`), except the FFN
        hidden in partial-sum mode: half-lane chunks (64), so a rank's gate and up columns side
        by side fill whole lanes (`kernels/stages/gate_up.py`) and its W_down rows whole sublane
        tiles: Kimi K3's 6,144 shared hidden are 192 on each of 32 ranks, not 256 on 24."""
        if group == spec.FFN_HIDDEN and self.partial_sums:
            return -(-length // (self.ways(group) * HALF_LANE)) * HALF_LANE
        return chunk_length(length, self.ways(group))

    def slice_firsts(self, group: str) -> tuple[int, ...]:
        """One rank per slice of `group`, slice 0 first (whose partial sums a reduction adds)."""
        split = self.split(group)
        return tuple(split.rank_of(i) for i in range(split.ways))

    def local_length(self, group: str, length: int) -> int:
        """Per-rank length of an axis of `length` split by `group` (padded groups: the chunk)."""
        if not self.divides(group, length):
            return length
        if group in CHUNKED_GROUPS:
            return self._chunk(group, length)
        return length // self.ways(group)

    def bounds(self, group: str, length: int, rank: int) -> tuple[int, int, int]:
        """(start, stop, per-rank length) of rank's slice of an axis of `length`: the real
        elements [start, stop), zero-padded to the per-rank length."""
        local = self.local_length(group, length)
        start = self.split(group).index(rank) * local if local < length else 0
        return min(start, length), min(start + local, length), local

    def describe(self) -> str:
        parts, used = [], groups_used(self.cfg)
        for s in (s for s in self.splits if s.group in used):
            how = "whole" if s.ways == 1 else f"{s.ways} ways"
            if s.stride > 1 and s.group in (spec.HEADS, spec.KV_HEADS):
                how += f" x {s.stride} replicas"
            parts.append(f"{s.group} {how}")
        return f"{self.name} layout of {self.cfg.name} on {self.n_ranks} ranks: " + ", ".join(parts)


def _check_rules(cfg: ModelConfig) -> None:
    """Every parameter and state leaf of every kind says how it shards (spec.Param.shard)."""
    for path, leaf in leaves_with_path(spec.param_table(cfg)):
        if leaf.shard is None:
            raise ValueError(f"parameter {path} of {cfg.name} has no sharding rule: give its "
                             "spec.Param a shard= (spec.split(axis, group) or spec.REPLICATED)")
    for kind, leaves in spec.state_table(cfg, 1, cfg.kv_tile).items():
        for name, leaf in leaves.items():
            if leaf.shard is None:
                raise ValueError(f"state leaf [{kind!r}][{name!r}] of {cfg.name} has no sharding "
                                 "rule: give its spec.StateLeaf a shard=")


def has_rules(cfg: ModelConfig) -> bool:
    """Whether every kind of cfg says how its parameters and states shard (`_check_rules`)."""
    try:
        _check_rules(cfg)
    except ValueError:
        return False
    return True


def splits(cfg: ModelConfig, n_ranks: int, name: str = OURS, etp: int | None = None,
           columns: bool = True) -> tuple[Split, ...]:
    """How many ways the `name` layout (LAYOUTS) splits each group of cfg on n_ranks ranks
    (ValueError naming the field for a rank count that does not split heads, vocabulary or
    experts, and for a kind whose parameters have no sharding rule). Rank r holds slice
    (r // stride) % ways: experts by EP groups of ETP consecutive ranks, heads replicated on
    n / H ranks when a model has fewer heads than ranks. `columns` False (the partial-sum
    modes): an etp asked for need not split W2's output columns."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg={cfg!r} is invalid: a mkresearch.model.config.ModelConfig")  # noqa: TRY004
    if name not in LAYOUTS:
        raise ValueError(f"layout name={name!r} is invalid: one of {', '.join(LAYOUTS)}")
    spec.check(cfg)
    check_ranks(cfg, n_ranks, etp, columns)
    n = int(n_ranks)
    etp = default_etp(cfg, n, name) if etp is None else etp
    if n > 1:
        _check_rules(cfg)
    heads = _head_ways(cfg, n)
    kv_heads = min(heads, cfg.n_kv_heads)  # with fewer K/V heads than head slices: replicated
    out = [Split(spec.HEADS, heads, n // heads),
           *([Split(spec.KV_HEADS, kv_heads, n // kv_heads)]
             if spec.KV_HEADS in groups_used(cfg) else []),
           Split(spec.VOCAB, n),
           Split(spec.EXPERTS, n // etp, etp), Split(spec.EXPERT_TP, etp)]
    for group in PADDED_GROUPS:
        whole = name == RELEASE and group in RELEASE_REPLICATED
        out.append(Split(group, 1 if whole else n))
    return tuple(out)


def rank_config(cfg: ModelConfig, name: str = RELEASE, n_ranks: int = RELEASE_RANKS,
                **overrides: Any) -> ModelConfig:
    """A single-device stand-in for one rank of the `name` layout: a ModelConfig with one rank's
    heads, vocabulary shard, local experts (top_k capped at their count) and FFN hidden chunks,
    for compiling and scaling a one-device megakernel at per-rank shapes (the collectives left
    out). A ModelConfig says a rank's share only through its sizes: an expert's ETP slice is taken
    on its hidden (W2's rows, not its latent columns: the same bytes), and the matrices the layout
    splits by their d or latent columns (W_o, W_down, W_lu, W_ld; ours: W_qa, W_kva, the router)
    stay whole: `layout_bytes.rank_bytes` counts any layout exactly. For the release layout on 32
    ranks it is `get_config("kimi-k3-rank")`. Named '<model>-rank' (release) or
    '<model>-rank-<layout>'."""
    lay = Layout(name, cfg, int(n_ranks), splits(cfg, n_ranks, name))
    experts = cfg.n_experts // lay.ep
    fields = {  # one rank's expert hidden: W1/W3 columns (its W2 latent slice is not expressible)
        "name": f"{cfg.name}-rank" if name == RELEASE else f"{cfg.name}-rank-{name}",
        "n_heads": cfg.n_heads // lay.ways(spec.HEADS),
        "n_kv_heads": lay.local_length(spec.KV_HEADS, cfg.n_kv_heads),
        "vocab_size": lay.local_length(spec.VOCAB, cfg.vocab_size),
        "n_experts": experts, "top_k": min(cfg.top_k, experts),
        "expert_hidden": lay.local_length(spec.EXPERT_TP, cfg.expert_hidden),
        "dense_hidden": lay.local_length(spec.FFN_HIDDEN, cfg.dense_hidden),
        "shared_hidden": lay.local_length(spec.FFN_HIDDEN, cfg.shared_hidden)}
    fields.update(overrides)
    return cfg.replace(**fields)


def has_rank(cfg: ModelConfig) -> bool:
    """Whether one of RELEASE_RANKS ranks of cfg exists (a mini's heads or experts may not split
    32 ways)."""
    return has_rules(cfg) and RELEASE_RANKS in allowed_ranks(cfg, RELEASE_RANKS)
