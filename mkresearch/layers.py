"""The layers of mkresearch, lowest first: a module imports only its own layer or lower ones, and
the imports of all modules together form no cycle. Each layer is one subpackage:

    cli                 what a user runs: `mkresearch` and its commands, the bench, make figures
      ^
    views               plots, widgets, printed facts (matplotlib lives here and in cli only)
      ^
    measurement         DMA logs and the runs that record them, profiles, HLO counts, records
      ^
    serve               continuous batching over paged KV: pages, slots, the loop, arrival traces
      ^
    prediction          timeline model, scale-out, calibration: what a step costs
      ^
    generation          the decode loop: jitted chunks of steps that stay on the device
      ^
    kernels.compose     the megakernel: plan, composer, schedule, the step on n ranks, verify
      ^
    kernels.sharded     collectives between ranks and the sharded pieces of stages
      ^
    kernels.stages      one Pallas body per stage kind (mkresearch.kernels, from kernels/)
      ^
    kernels.base        DMAs, blocks, the registry's kernel side, costs, the weight stream
      ^
    decoding            speculative decoding in plain JAX: verify, acceptance, drafters
      ^
    checkpoint          published checkpoints from disk: safetensors, tensor names, tokenizer
      ^
    sharding            layouts: which rank holds what, rank counts, per-rank bytes
      ^
    baselines           decode steps on JAX's own kernels (megablox gmm, ragged paged attention):
      ^                 the yardsticks, peers of the reference (never our kernels)
    model               configs, the stage registry and kinds, the reference, weights, roofline
      ^
    hardware            chips, how a kernel runs (interpret mode off a TPU), slices and their links;
                        the package root

`tests/test_layering.py` checks every import of `mkresearch/` and `kernels/` (module level and
inside functions) against this map, fails on a module that is in no layer, and fails on any
cycle of imports. A new module goes into the subpackage of its concern; a new subpackage is added
here, at the lowest layer it fits, with a docstring naming its job and what it may import.
"""

from __future__ import annotations

import fnmatch


def _package(name: str) -> tuple[str, str]:
    return (name, f"{name}.*")


# layer -> module names (fnmatch patterns), in order from the bottom up
LAYERS: dict[str, tuple[str, ...]] = {
    # the package root only selects the platform (hardware.tpu) before jax loads
    "hardware": ("mkresearch", "mkresearch.layers", *_package("mkresearch.hardware")),
    "model": _package("mkresearch.model"),
    "baselines": _package("mkresearch.baselines"),
    "sharding": _package("mkresearch.sharding"),
    "checkpoint": _package("mkresearch.checkpoint"),
    "decoding": _package("mkresearch.decoding"),
    "kernels.base": ("mkresearch.kernels", *_package("mkresearch.kernels.base")),
    "kernels.stages": _package("mkresearch.kernels.stages"),
    "kernels.sharded": _package("mkresearch.kernels.sharded"),
    "kernels.compose": _package("mkresearch.kernels.compose"),
    "generation": _package("mkresearch.generation"),
    "prediction": _package("mkresearch.prediction"),
    "serve": _package("mkresearch.serve"),
    "measurement": _package("mkresearch.measurement"),
    "views": _package("mkresearch.views"),
    "cli": ("mkresearch.__main__", *_package("mkresearch.cli")),
}
# the layers that may import matplotlib
DRAWING = ("views", "cli")


def layer_of(module: str) -> str | None:
    """The layer of a module name (e.g. "mkresearch.kernels.stages.mla" -> "kernels.stages")."""
    for layer, patterns in LAYERS.items():
        if module in patterns:
            return layer
    for layer, patterns in LAYERS.items():
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns if "*" in pattern):
            return layer
    return None


def rank(layer: str) -> int:
    """0 for hardware, 1 for model, ...: an import may go from a rank to the same or a lower one."""
    return list(LAYERS).index(layer)
