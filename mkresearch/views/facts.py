"""Printing computed numbers so that every correct machine prints the same text.

XLA:CPU sums in an order that depends on the processor, its caches and the thread count, so the
last digits of a float computed here are not a fact: another machine (or `make test`'s second
XLA configuration) prints others. A notebook cell whose output is checked (`# NBVAL_CHECK_OUTPUT`)
therefore prints exact integers, a bound met (`bound`), or a rounding that cannot flip
(`stable`): the text must be the same for every value within `margin` of the one computed here,
where `margin` is the largest difference another machine could make (say which in the call).
"""

from __future__ import annotations

import math


def stable(value: float, spec: str, margin: float) -> str:
    """format(value, spec), checked to be the text of every value in [value - margin,
    value + margin]; ValueError (print fewer digits, or a bound) when a rounding could flip."""
    if not margin >= 0 or not math.isfinite(margin):
        raise ValueError(f"margin={margin!r} is invalid: a finite number >= 0")
    value = float(value)
    text = format(value, spec)
    low, high = format(value - margin, spec), format(value + margin, spec)
    if low != text or high != text:
        raise ValueError(f"{value!r} prints as {text!r} with {spec!r}, but {low!r} or {high!r} "
                         f"within ±{margin:g}: another machine could print otherwise — use fewer "
                         "digits or print a bound")
    return text


def bound(value: float, limit: float, *, name: str = "max |error|", spec: str = "g") -> str:
    """'<name> <= <limit> PASS' (or FAIL): the bound is the fact, not the value's digits."""
    met = float(value) <= limit
    return f"{name} <= {format(limit, spec)} {'PASS' if met else 'FAIL'}"
