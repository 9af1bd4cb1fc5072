"""The chip figures do not depend on the installed jax: chips._TPU_INFO is what
pltpu.get_tpu_info_for_chip answers in the pinned jax, written down (a jax in pyproject's range
before 0.9.2 has no such function, and a later one might answer otherwise)."""

import pytest
from jax.experimental.pallas import tpu as pltpu

from mkresearch.hardware import chips


@pytest.mark.parametrize("name", sorted(chips._LAYOUT))
def test_the_written_tpu_info_is_the_pinned_jax_s(name):
    _, _, version_name, per_device = chips._LAYOUT[name]
    info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, version_name), per_device)
    written = chips._tpu_info(version_name, per_device)
    assert {f: getattr(info, f) for f in chips.TPU_INFO_FIELDS} == vars(written)
