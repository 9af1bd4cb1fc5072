"""A notebook's "Your turn" exercises: a check that tells the reader whether an answer holds.

An exercise is three cells. The reader's cell is editable and starts as a stub that raises
`NotImplementedError`; the check cell runs `check(name, verify)` on it, where `verify()` asserts
what a right answer does (equals the reference, no race, the period the model gives...); the
solution follows, folded away (its input hidden in JupyterLab, a Colab form), and runs the same
check under an `assert`, so nbval checks the solution on every run. `check` never raises: a cell
that is not written yet, a wrong answer or an answer that crashes is reported in one line, and
"Run all" goes on to the solution.

An exercise that writes DMA code checks it both ways a kernel can fail: run in interpret mode
with the race detector (`race_free`), and compiled by Mosaic for a TPU (`compiles`), which
refuses what the chip would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mkresearch.hardware import tpu

HOLDS, FAILS = "✓", "✗"


def check(name: str, verify: Callable[[], Any]) -> bool:
    """Run `verify()` and print whether the answer to exercise `name` holds; True if it does.

    NotImplementedError: not written yet; AssertionError: the answer does not hold (the first
    line of its message says why); any other exception: the answer crashed (its type and first
    line; the simulated TPU is reset, as after any failed interpreted kernel)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r} is invalid: a non-empty string naming the exercise")
    if not callable(verify):
        raise ValueError(  # noqa: TRY004 - the project's rule: bad input is a ValueError
            f"verify={verify!r} is invalid: a function of no arguments that asserts")
    try:
        verify()
    except NotImplementedError:
        print(f"{FAILS} {name}: not written yet: fill in the cell above, run it, then run this one")
        return False
    except AssertionError as error:
        print(f"{FAILS} {name}: does not hold yet: {_first_line(error) or 'an assert failed'}")
        return False
    except Exception as error:  # noqa: BLE001 - the reader's code: report it, never stop "Run all"
        tpu.reset_interpret_state()
        print(f"{FAILS} {name}: raised {type(error).__name__}: {_first_line(error)}")
        return False
    print(f"{HOLDS} {name}: holds")
    return True


def compiles(fn: Callable[..., Any], *args: Any, chip: str = "tpu7x",
             shardings: tuple | None = None) -> bool:
    """Part of a `verify`: assert that Mosaic compiles `fn(*args)` for `chip` (libtpu's compiler,
    run here without a TPU: `tpu.compile_for`, whose `shardings` place a program on several
    devices), as the chip would take it where interpret mode accepts more (a DMA window that is
    not whole tiles, a one-row copy). An AssertionError with the compiler's first line when it
    refuses; True when compiled; False, saying so in one line, on a runtime without libtpu
    (Colab's CPU runtime), where interpret mode's checks are all there is."""
    if not tpu.can_compile():
        print(f"not compiled: {tpu.NO_LIBTPU}")
        return False
    try:
        tpu.compile_for(fn, *args, chip=chip, shardings=shardings)
    except Exception as error:  # noqa: BLE001 - the compiler's message is the answer's fault
        raise AssertionError(f"Mosaic refuses it for {chip}: {_first_line(error)}") from None
    return True


def race_free(run: Callable[[], Any]) -> Any:
    """Part of a `verify`: run() (interpreted kernels) with the race flag reset first; assert
    that the race detector saw no DMA write a buffer while it was read (or the other way);
    run()'s result."""
    tpu.reset_races()
    result = run()
    assert not tpu.races_found(), "the race detector saw a DMA touch a buffer while it was used"
    return result


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]
