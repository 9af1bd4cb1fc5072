"""Which rank counts split a model (`mkresearch.sharding.layout`'s checks): the heads (and GQA's K/V heads
with their query heads), the vocabulary in whole lane tiles with real rows on every rank, the
routed experts as EP x ETP with every axis an expert's TP splits in whole lane tiles; the groups a
model's parameters use and its experts' widths, read from the kinds' rules (`spec.Param.shard`).
A rank count that does not split is a ValueError naming the field and the allowed rank counts.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np

import mkresearch.model.stages  # noqa: F401 - registers the built-in stage kinds and their rules
from mkresearch.model import spec
from mkresearch.model.config import LANE, ModelConfig
from mkresearch.model.config_rules import EXPERT_BLOCKS

RELEASE_ETP = 4  # docs/kimi-k3.md §9: expert-tensor parallel 4 (EP = n_ranks / 4, 8 at 32 ranks)
MAX_LISTED_RANKS = 256  # ValueErrors list the allowed rank counts up to this


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


def _expert_ways(cfg: ModelConfig, n: int, etp: int) -> bool:
    """EP = n / etp divides the experts; etp splits the experts' output columns in lane tiles
    and the hidden in `hidden_unit`s."""
    return (n % etp == 0 and cfg.n_experts % (n // etp) == 0
            and all(width % (etp * LANE) == 0 for width in expert_widths(cfg))
            and cfg.expert_hidden % (etp * hidden_unit(cfg)) == 0)


def _expert_fields(cfg: ModelConfig) -> str:
    out = expert_output_width(cfg)
    name = "moe_latent" if out == cfg.moe_latent and spec.MOE_LATENT in groups_used(cfg) \
        else "d_model"
    unit = hidden_unit(cfg)
    hidden = (f"whole {unit}-value {cfg.expert_format} scale blocks" if unit != LANE
              else f"whole {LANE}-lane tiles")
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


def allowed_ranks(cfg: ModelConfig, limit: int = MAX_LISTED_RANKS) -> list[int]:
    """Rank counts in [1, limit] that split cfg's heads, vocabulary and experts."""
    return [n for n in range(1, limit + 1)
            if _heads_ok(cfg, n) and _kv_heads_ok(cfg, n) and _vocab_ok(cfg, n)
            and any(_expert_ways(cfg, n, etp) for etp in _divisors(n))]


def check_ranks(cfg: ModelConfig, n_ranks: Any, etp: int | None = None) -> None:
    """ValueError naming the field that n_ranks does not divide, with the allowed rank counts."""
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
    elif isinstance(etp, bool) or not isinstance(etp, int) or not _expert_ways(cfg, n, etp):
        good = [e for e in _divisors(n) if _expert_ways(cfg, n, e)]
        raise ValueError(f"etp={etp!r} is invalid for {cfg.name} on {n} ranks: a divisor of "
                         f"n_ranks with n_experts={cfg.n_experts} divisible by n_ranks / etp and "
                         f"{_expert_fields(cfg)} (allowed: {good})")


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values)) or "none"
