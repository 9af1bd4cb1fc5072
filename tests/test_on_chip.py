"""`get_config("<model>-on-<chip>")` (mkresearch/model/on_chip.py): a real-size model's layers,
as many as fill one device of the chip, for benchmarks there."""

import pytest
from mkresearch.kernels.compose import megakernel as mk

from mkresearch.hardware.chips import get_chip
from mkresearch.model import on_chip, roofline
from mkresearch.model.config import config_names, get_config


@pytest.mark.parametrize("name", on_chip.ON_CHIP)
def test_the_most_layers_that_fit_one_device(name):
    """The base model's own shapes and format with its first n layers, n the most whose weights,
    caches and states at 8 rows of 4,352 tokens fit the chip's HBM less the headroom; the VMEM
    plan fits that chip at B = 1 and 8."""
    entry = on_chip.ON_CHIP[name]
    cfg, whole = get_config(name), get_config(entry.base, **entry.overrides)
    assert cfg.name == name and name in config_names()
    assert cfg == whole.replace(name=name, n_layers=entry.n_layers, max_seq_len=4352)
    budget = get_chip(entry.chip).hbm_bytes - on_chip.HEADROOM
    assert entry.n_layers == roofline.most_layers_that_fit(whole, entry.chip, 8, 4352, budget)
    for batch in (1, 8):
        plan = mk.make_plan(cfg, batch, cfg.max_seq_len, mk.MegakernelOptions(chip=entry.chip))
        assert plan.vmem.fits()


def test_the_named_cuts():
    """What the docstring and docs/tpu.md say: all of Moonlight in MXFP4 (11.05 GiB), 11 of
    Qwen3-30B-A3B's 48 layers (14.66 GiB), 24 of a Kimi K3 rank's 93 (14.40 GiB); not one layer
    of the whole Kimi K3; an override (a format) applies before the cut."""
    gib = {name: round(roofline.hbm_footprint(get_config(name), "v5e", 8).needed / 2**30, 2)
           for name in on_chip.ON_CHIP}
    assert gib == {"moonlight-16b-a3b-on-v5e": 11.05, "qwen3-30b-a3b-on-v5e": 14.66,
                   "kimi-k3-rank-on-v5e": 14.4}
    assert get_config("moonlight-16b-a3b-on-v5e").n_layers == 27 == get_config(
        "moonlight-16b-a3b").n_layers
    assert roofline.most_layers_that_fit(get_config("kimi-k3"), "v5e", 8, 4352, 15 * 2**30) == 0
    assert get_config("qwen3-30b-a3b-on-v5e", expert_format="mxfp4").expert_format == "mxfp4"


@pytest.mark.slow
def test_compiles_for_the_chip():
    """The megakernel step of one of them, compiled for a v5e from shapes: one Mosaic kernel,
    its arguments the footprint's weights and states at B = 8."""
    cfg = get_config("qwen3-30b-a3b-on-v5e")
    compiled, _ = mk.compile_step(cfg, 8, chip="v5e")
    assert compiled.n_mosaic_kernels == 1
    assert compiled.memory["argument_size_in_bytes"] >= roofline.hbm_footprint(cfg, "v5e", 8).needed
