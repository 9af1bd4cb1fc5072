"""The layers of mkresearch, lowest first; a module imports only its own layer or lower ones.

    core       shapes, the reference oracle, weights, chips, how kernels run: plain JAX
      ^
    kernels    Pallas TPU kernels (kernels/, installed as mkresearch.kernels)
      ^
    analysis   what recorded runs and compiled programs say: timeline model, profiles, HLO,
      ^        DMA logs, a log scaled to another config, a step's schedule against the roofline
    app        what a user runs: bench, CLI, figures, plots, widgets

`tests/test_layering.py` checks every import of `mkresearch/` and `kernels/` (module-level and
inside functions) against this map, and fails on a module that is in no layer: a new module is
added here, to the lowest layer it fits.
"""

from __future__ import annotations

import fnmatch

# layer -> module names (fnmatch patterns), in order from the bottom up
LAYERS: dict[str, tuple[str, ...]] = {
    "core": ("mkresearch", "mkresearch.layers", "mkresearch.config", "mkresearch.config_rules",
             "mkresearch.reference", "mkresearch.reference_sharded",
             "mkresearch.weights", "mkresearch.chips", "mkresearch.sampling",
             "mkresearch.facts", "mkresearch.tpu", "mkresearch._fast_interpret",
             "mkresearch.roofline", "mkresearch.kv_cache", "mkresearch.spec",
             "mkresearch.numerics", "mkresearch.formats", "mkresearch.rope",
             "mkresearch.layout", "mkresearch.layout_ranks", "mkresearch.layout_bytes",
             "mkresearch.interconnect", "mkresearch.topology", "mkresearch.stages",
             "mkresearch.speculative", "mkresearch.acceptance", "mkresearch.drafters",
             "mkresearch.mtp",
             "mkresearch.stages.*"),
    "kernels": ("mkresearch.kernels", "mkresearch.kernels.*"),
    "analysis": ("mkresearch.timeline", "mkresearch.timeline_chip", "mkresearch.timeline_events",
                 "mkresearch.timeline_whatif", "mkresearch.profiling", "mkresearch.hlo",
                 "mkresearch.logs", "mkresearch.scaling", "mkresearch.schedule_report",
                 "mkresearch.timeline_ranks", "mkresearch.scale_out", "mkresearch.scale_out_sim",
                 "mkresearch.calibration",
                 "mkresearch.speculative_predict"),
    "app": ("mkresearch.bench", "mkresearch.cli", "mkresearch.cli_*", "mkresearch.figures",
            "mkresearch.plots",
            "mkresearch.*_plots", "mkresearch.widgets", "mkresearch.recorded",
            "mkresearch.__main__"),
}


def layer_of(module: str) -> str | None:
    """The layer of a module name (e.g. "mkresearch.kernels.mla" -> "kernels"); None if none."""
    for layer, patterns in LAYERS.items():
        if module in patterns:
            return layer
    for layer, patterns in LAYERS.items():
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns if "*" in pattern):
            return layer
    return None


def rank(layer: str) -> int:
    """0 for core, 1 for kernels, ...: an import may go from a rank to the same or a lower one."""
    return list(LAYERS).index(layer)
