"""mkresearch.views.facts: printed numbers that no other machine prints differently."""

import pytest

from mkresearch.views import facts


def test_stable_prints_a_rounding_far_from_a_flip():
    assert facts.stable(0.25812, ".3f", 1e-5) == "0.258"
    assert facts.stable(-4.9812, ".2f", 1e-4) == "-4.98"
    assert facts.stable(6.4e-4, ".1e", 1e-7) == "6.4e-04"


@pytest.mark.parametrize("value, spec, margin", [
    (0.2585, ".3f", 1e-5),  # on the midpoint: either neighbour prints otherwise
    (0.25849999, ".3f", 1e-6),
    (1.0, "g", -1.0),
])
def test_stable_refuses_a_rounding_that_could_flip(value, spec, margin):
    with pytest.raises(ValueError, match="margin" if margin < 0 else "another machine"):
        facts.stable(value, spec, margin)


def test_bound_prints_the_bound_not_the_digits():
    assert facts.bound(3.1e-6, 1e-5) == "max |error| <= 1e-05 PASS"
    assert facts.bound(7.2e-6, 1e-5) == "max |error| <= 1e-05 PASS"  # the same text
    assert facts.bound(2e-5, 1e-5, name="err") == "err <= 1e-05 FAIL"
