"""A config cut to its first layers, as kernel and reference tests draw it instead of a whole
mini: `weights.init_params` draws each leaf from its own stream, layer by layer, so a cut's
weights are each kind's first layers of the whole config, bit for bit (tests/test_weights.py
checks it at every depth of each family's mini, with its dense layers, none or all but the last,
in each expert format), at a fraction of the time (no later layers' experts).
Imported as `from cuts import first_layers` (tests/ is on sys.path, like tests/tiers.py)."""

import dataclasses

from mkresearch.model.config import ModelConfig


def first_layers(cfg: ModelConfig, n: int, **changes) -> ModelConfig:
    """cfg cut to its first n layers, named `<name>-<n>l` (Kimi K3's mla_first kept within the
    cut); `changes`: any other fields."""
    return cfg.replace(**{"name": f"{cfg.name}-{n}l", "n_layers": n,
                          "mla_first": min(cfg.mla_first, n - 1), **changes})


def kimi_kinds(cfg: ModelConfig, **changes) -> ModelConfig:
    """Kimi K3 (or its mini) in two layers, every kind of its layers: KDA + dense, MLA + MoE, an
    attention-residual block per layer."""
    cut = first_layers(cfg, 2, attn_res_block=1, **changes)
    assert cut.layers == (("kda", "dense"), ("mla", "moe")), cut.layers
    return cut


def dense_and_one_moe(cfg: ModelConfig) -> ModelConfig:
    """A family's mini cut to its dense layers and one MoE layer: every sublayer kind of the
    family (its later MoE layers repeat the last)."""
    cut = first_layers(cfg, cfg.n_dense_layers + 1)
    assert cut.layers == cfg.layers[:cut.n_layers], (cut.layers, cfg.layers)
    return cut


def changed_fields(cfg: ModelConfig, cut: ModelConfig) -> tuple[tuple[str, object], ...]:
    """The (field, value) pairs in which `cut` differs from `cfg`, in field order: a cut as
    overrides (`partial_sum_sweep.Case.overrides`)."""
    return tuple((f.name, getattr(cut, f.name)) for f in dataclasses.fields(cut)
                 if getattr(cut, f.name) != getattr(cfg, f.name))
