"""`get_config("<model>-on-<chip>")` (mkresearch/model/on_chip.py): a real-size model's layers,
as many as fill one device of the chip, for benchmarks there."""

import pytest
from mkresearch.kernels.compose import megakernel as mk

from mkresearch.hardware.chips import get_chip
from mkresearch.model import on_chip, roofline
from mkresearch.model.config import config_names, get_config

BUDGET = {name: get_chip(chip).hbm_bytes - on_chip.HEADROOM
          for name, (_, chip, _) in on_chip.ON_CHIP.items()}


def footprint(cfg, chip):
    return roofline.hbm_footprint(cfg, chip, on_chip.FIT_BATCH).needed


@pytest.mark.parametrize("name", on_chip.ON_CHIP)
def test_the_most_layers_that_fit_one_device(name):
    """The base model's own shapes and format with its first n layers, n the most whose weights,
    caches and states at 8 rows of 4,352 tokens fit the chip's HBM less the headroom; the VMEM
    plan fits that chip at B = 1 and 8."""
    base, chip, fixed = on_chip.ON_CHIP[name]
    cfg, whole = get_config(name), get_config(base, **fixed)
    assert cfg.name == name and name in config_names()
    assert cfg == whole.replace(name=name, n_layers=cfg.n_layers, max_seq_len=4352)
    assert footprint(cfg, chip) <= BUDGET[name]
    if cfg.n_layers < whole.n_layers:
        assert footprint(cfg.replace(n_layers=cfg.n_layers + 1), chip) > BUDGET[name]
    for batch in (1, 8):
        assert mk.make_plan(cfg, batch, cfg.max_seq_len, mk.MegakernelOptions(chip=chip)).vmem.fits()


def test_the_named_cuts():
    """What the docstring and docs/tpu.md say: all of Moonlight in MXFP4, 11 of Qwen3-30B-A3B's
    48 layers, 24 of a Kimi K3 rank's 93; an override (a format) comes before the cut."""
    assert {name: get_config(name).n_layers for name in on_chip.ON_CHIP} == {
        "moonlight-16b-a3b-on-v5e": 27, "qwen3-30b-a3b-on-v5e": 11, "kimi-k3-rank-on-v5e": 24}
    assert get_config("moonlight-16b-a3b-on-v5e").expert_format == "mxfp4"
    assert get_config("qwen3-30b-a3b-on-v5e", expert_format="mxfp4").n_layers == 34


def test_nothing_fits_is_one_line():
    with pytest.raises(ValueError, match=r"^too-big-on-v5e: not one layer of kimi-k3 fits one "
                                         r"v5e device at batch 8 x 4352 tokens"):
        on_chip.fill_one_device(get_config("kimi-k3"), "v5e", "too-big-on-v5e")


@pytest.mark.slow
def test_compiles_for_the_chip():
    """The megakernel step of one of them, compiled for a v5e from shapes: one Mosaic kernel,
    its arguments the footprint's weights and states at B = 8."""
    cfg = get_config("qwen3-30b-a3b-on-v5e")
    compiled, _ = mk.compile_step(cfg, 8, chip="v5e")
    assert compiled.n_mosaic_kernels == 1
    assert compiled.memory["argument_size_in_bytes"] >= footprint(cfg, "v5e")
