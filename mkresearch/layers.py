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
    "core": ("mkresearch", "mkresearch.layers", "mkresearch.model.config", "mkresearch.model.config_rules",
             "mkresearch.model.reference",
             "mkresearch.model.weights", "mkresearch.hardware.chips", "mkresearch.model.sampling",
             "mkresearch.views.facts", "mkresearch.hardware.tpu", "mkresearch.hardware._fast_interpret",
             "mkresearch.model.roofline", "mkresearch.model.kv_cache", "mkresearch.model.spec",
             "mkresearch.model.numerics", "mkresearch.model.formats", "mkresearch.model.rope",
             "mkresearch.sharding.layout", "mkresearch.sharding.layout_ranks", "mkresearch.sharding.layout_bytes",
             "mkresearch.prediction.interconnect", "mkresearch.prediction.topology", "mkresearch.model.stages",
             "mkresearch.decoding.speculative", "mkresearch.decoding.acceptance", "mkresearch.decoding.drafters",
             "mkresearch.model.mtp",
             "mkresearch.model.stages.*"),
    "kernels": ("mkresearch.kernels", "mkresearch.kernels.*"),
    "analysis": ("mkresearch.prediction.timeline", "mkresearch.prediction.timeline_chip", "mkresearch.prediction.timeline_events",
                 "mkresearch.prediction.timeline_whatif", "mkresearch.measurement.profiling", "mkresearch.measurement.hlo",
                 "mkresearch.measurement.logs", "mkresearch.prediction.scaling", "mkresearch.prediction.schedule_report",
                 "mkresearch.prediction.timeline_ranks", "mkresearch.prediction.scale_out", "mkresearch.prediction.scale_out_sim",
                 "mkresearch.prediction.calibration",
                 "mkresearch.prediction.speculative_predict"),
    "app": ("mkresearch.cli.bench", "mkresearch.cli.main", "mkresearch.cli_*", "mkresearch.cli.figures",
            "mkresearch.views.plots",
            "mkresearch.*_plots", "mkresearch.views.widgets", "mkresearch.measurement.recorded",
            "mkresearch.__main__"),
}


def layer_of(module: str) -> str | None:
    """The layer of a module name (e.g. "mkresearch.kernels.stages.mla" -> "kernels"); None if none."""
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
