"""The stage notebooks teach by writing kernels: each writes its own `pallas_call` with the Pallas
TPU primitives where they first matter, and asks the reader to write something, with a check
that says whether the answer holds and a folded-away solution that nbval checks.

TEACHING is the one list of the notebooks held to it and of what each one's own code cells
must write beside a `pallas_call`.
"""

import ast
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkresearch.views import exercises

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"

# notebook -> the primitives its own code cells write (every one also writes a pallas_call and
# has a "Your turn" exercise).
TEACHING = {
    "01_vmem_pipelining": ("make_async_copy", "DMA semaphore"),
    "02_attention": (),
    "03_moe_routing": (),
    "04_expert_gemm": ("scalar prefetch", "make_async_copy", "DMA semaphore"),
    "05_sampling": (),
    "06_megakernel": ("make_async_copy", "DMA semaphore", "scalar prefetch"),
    "08_scale_out": ("make_async_remote_copy", "DMA semaphore"),
    "14_porting_a_family": ("scalar prefetch",),
}


def _call_named(node, name):
    func = node.func if isinstance(node, ast.Call) else None
    return (isinstance(func, ast.Attribute) and func.attr == name) or (
        isinstance(func, ast.Name) and func.id == name)


def _is_dma_semaphore(node):  # pltpu.SemaphoreType.DMA
    return (isinstance(node, ast.Attribute) and node.attr == "DMA"
            and isinstance(node.value, ast.Attribute | ast.Name)
            and getattr(node.value, "attr", getattr(node.value, "id", None)) == "SemaphoreType")


def _is_scalar_prefetch(node):  # num_scalar_prefetch=n > 0, or a PrefetchScalarGridSpec
    if _call_named(node, "PrefetchScalarGridSpec"):
        return True
    return isinstance(node, ast.Call) and any(
        k.arg == "num_scalar_prefetch" and not (isinstance(k.value, ast.Constant) and not k.value.value)
        for k in node.keywords)


PRIMITIVES = {
    "pallas_call": lambda node: _call_named(node, "pallas_call"),
    "make_async_copy": lambda node: _call_named(node, "make_async_copy"),
    "make_async_remote_copy": lambda node: _call_named(node, "make_async_remote_copy"),
    "DMA semaphore": _is_dma_semaphore,
    "scalar prefetch": _is_scalar_prefetch,
}


def _source(cell) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


MAGIC = re.compile(r"\s*(%|!(?!=))")  # an IPython magic or shell line, not a `!=` continued


def _tree(cell) -> ast.Module:
    """A code cell's syntax tree (IPython magics and shell lines left out)."""
    lines = [line for line in _source(cell).splitlines() if not MAGIC.match(line)]
    return ast.parse("\n".join(lines))


def _cells(stem):
    return json.loads((NOTEBOOKS_DIR / f"{stem}.ipynb").read_text())["cells"]


def _written(cells) -> set[str]:
    """The PRIMITIVES the notebook's own code cells write."""
    found = set()
    for cell in (c for c in cells if c["cell_type"] == "code"):
        for node in ast.walk(_tree(cell)):
            found |= {name for name, matches in PRIMITIVES.items() if matches(node)}
    return found


def _folded(cell) -> bool:
    """A solution folded away: input hidden in JupyterLab, a Colab form with a #@title line."""
    metadata = cell.get("metadata", {})
    return (cell["cell_type"] == "code" and metadata.get("jupyter", {}).get("source_hidden") is True
            and metadata.get("cellView") == "form" and _source(cell).startswith("#@title "))


def _checks(cell) -> tuple[list[str], list[str]]:
    """The exercise names a code cell checks with `exercises.check(name, ...)`: (those checked
    plainly, those checked under an assert)."""
    plain, asserted = [], []
    for node in ast.walk(_tree(cell)):
        if isinstance(node, ast.Assert) and _call_named(node.test, "check") \
                and isinstance(node.test.args[0], ast.Constant):
            asserted.append(node.test.args[0].value)
        elif isinstance(node, ast.Expr) and _call_named(node.value, "check") \
                and isinstance(node.value.args[0], ast.Constant):
            plain.append(node.value.args[0].value)
    return plain, asserted


def _output_text(cell) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream")


def _is_heading(cell) -> bool:
    return cell["cell_type"] == "markdown" and any(
        line.startswith("#") for line in _source(cell).splitlines())


def _exercises(cells) -> list[list[dict]]:
    """The cells of each "Your turn" section: from its heading to the next heading."""
    sections, current = [], None
    for cell in cells:
        if _is_heading(cell):
            current = None
            if any(line.startswith("#") and "Your turn" in line
                   for line in _source(cell).splitlines()):
                current = []
                sections.append(current)
            continue
        if current is not None:
            current.append(cell)
    return sections


@pytest.mark.parametrize("stem", sorted(TEACHING))
def test_notebook_writes_its_own_kernels(stem):
    written = _written(_cells(stem))
    for needed in ("pallas_call", *TEACHING[stem]):
        assert needed in written, f"{stem}: no code cell writes a {needed}"


@pytest.mark.parametrize("stem", sorted(TEACHING))
def test_notebook_has_an_exercise_with_a_check_and_a_folded_checked_solution(stem):
    """Each "Your turn" section: the reader's check cell (committed as "not written yet": the
    editable cell ships as a stub), then the solution folded away, checking the same exercise
    under an assert and marked # NBVAL_CHECK_OUTPUT, committed as holding."""
    sections = _exercises(_cells(stem))
    assert sections, f"{stem}: no 'Your turn' heading"
    for section in sections:
        code = [cell for cell in section if cell["cell_type"] == "code"]
        readers = [(cell, name) for cell in code if not _folded(cell) for name in _checks(cell)[0]]
        solutions = [(cell, name) for cell in code if _folded(cell) for name in _checks(cell)[1]]
        assert readers, f"{stem}: a 'Your turn' section without a check cell (exercises.check)"
        assert solutions, f"{stem}: a 'Your turn' section without a folded solution that asserts " \
                          "exercises.check(...)"
        for cell, name in readers:
            assert f"{exercises.FAILS} {name}: not written yet" in _output_text(cell), (
                f"{stem}: the check of {name!r} was committed with the exercise answered")
        for cell, name in solutions:
            assert name in {n for _, n in readers}, f"{stem}: the solution checks {name!r}, " \
                                                    "which the reader's check cell does not"
            assert "# NBVAL_CHECK_OUTPUT" in _source(cell).splitlines()
            assert f"{exercises.HOLDS} {name}: holds" in _output_text(cell), (
                f"{stem}: the solution of {name!r} was committed without holding")


# The notebooks with an exercise whose solution writes DMA code, checked both ways a kernel can
# fail: run in interpret mode under the race detector, and compiled by Mosaic for a TPU.
DMA_EXERCISES = ("02_attention", "03_moe_routing", "04_expert_gemm", "05_sampling",
                 "06_megakernel", "08_scale_out")


def _dma_exercise(section) -> bool:
    """A "Your turn" section whose folded solution writes a DMA and whose check cell (the one
    calling exercises.check) runs the race detector and compiles with Mosaic."""
    code = [cell for cell in section if cell["cell_type"] == "code"]
    writes_dma = any(_folded(cell) and {"make_async_copy", "make_async_remote_copy"}
                     & _written([cell]) for cell in code)
    checks = "\n".join(_source(cell) for cell in code if not _folded(cell) and _checks(cell)[0])
    races = any(call in checks for call in ("races_found(", "race_free("))
    compiles = any(call in checks for call in ("compile_for(", "exercises.compiles("))
    return writes_dma and races and compiles


@pytest.mark.parametrize("stem", DMA_EXERCISES)
def test_an_exercise_writes_dma_code_checked_by_the_race_detector_and_mosaic(stem):
    assert any(_dma_exercise(section) for section in _exercises(_cells(stem))), (
        f"{stem}: no 'Your turn' whose solution writes a DMA (make_async_copy or "
        "make_async_remote_copy) and whose check runs the race detector and compiles it with "
        "Mosaic (exercises.race_free, exercises.compiles)")


def test_the_detectors_see_what_they_name():
    cells = [{"cell_type": "code", "source": source} for source in (
        "y = pl.pallas_call(kernel, grid=(2,))(x)",
        "%timeit f()\n!ls\ncopy = pltpu.make_async_copy(src, dst, sem)\nok = (a\n      != b)",
        "scratch = [pltpu.SemaphoreType.DMA((2,))]",
        "spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(4,))",
        "c = pltpu.make_async_remote_copy(a, b, s, r, device_id=(1,))",
        "# pl.pallas_call in a comment is not a call")]
    assert _written(cells) == set(PRIMITIVES)
    assert _written([{"cell_type": "code", "source": "f(num_scalar_prefetch=0)"}]) == set()
    assert _written([cells[-1]]) == set()


# ---- mkresearch.views.exercises.check --------------------------------------------------------


def _not_written():
    raise NotImplementedError("write it")


def _wrong():
    assert 1 + 1 == 3, "1 + 1 is 2"


def _crashes():
    raise ZeroDivisionError("division by zero\nmore detail")


@pytest.mark.parametrize("verify, holds, says", [
    (lambda: None, True, "✓ ring: holds"),
    (_not_written, False, "✗ ring: not written yet"),
    (_wrong, False, "✗ ring: does not hold yet: 1 + 1 is 2"),
    (_crashes, False, "✗ ring: raised ZeroDivisionError: division by zero"),
])
def test_check_says_whether_the_answer_holds_and_never_raises(capsys, verify, holds, says):
    assert exercises.check("ring", verify) is holds
    out = capsys.readouterr().out
    assert out.startswith(says) and out.count("\n") == 1, out


@pytest.mark.parametrize("name, verify", [("", lambda: None), ("ring", None), (3, lambda: None)])
def test_check_refuses_a_bad_name_or_verify(name, verify):
    with pytest.raises(ValueError, match="name=|verify="):
        exercises.check(name, verify)


# ---- the two checks of an exercise that writes DMA code --------------------------------------
def _one_row_copy(x, position):
    """A kernel copying row `position` of x [16, 128] bf16 alone: interpret mode takes it, Mosaic
    refuses a DMA that does not start at a whole (16, 128) bf16 tile."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from mkresearch.hardware import tpu

    def kernel(position_ref, x_hbm, o_ref, row, sem):
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(position_ref[0], 1)], row, sem)
        copy.start()
        copy.wait()
        o_ref[...] = row[...]

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((1, 128), x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((1, 128), x.dtype), pltpu.SemaphoreType.DMA(())],
        interpret=tpu.interpret_params())(jnp.array([position], jnp.int32), x)


def test_compiles_says_whether_mosaic_takes_a_kernel(capsys, monkeypatch):
    from mkresearch.hardware import tpu

    x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(_one_row_copy(x, 5)), np.asarray(x[5:6]))
    if not tpu.can_compile():
        pytest.skip(tpu.NO_LIBTPU)
    assert exercises.compiles(lambda x_: x_ * 2, x)
    with pytest.raises(AssertionError, match="^Mosaic refuses it for tpu7x: "):
        exercises.compiles(lambda x_: _one_row_copy(x_, 5), x)
    monkeypatch.setattr(tpu, "can_compile", lambda: False)
    assert exercises.compiles(lambda x_: x_ * 2, x) is False
    assert capsys.readouterr().out == f"not compiled: {tpu.NO_LIBTPU}\n"


def test_race_free_says_whether_a_dma_raced(race_checked):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from mkresearch.hardware import tpu

    def racy_kernel(x_hbm, o_ref, buf_ref, sem):
        copy = pltpu.make_async_copy(x_hbm, buf_ref, sem)
        copy.start()
        o_ref[...] = buf_ref[...]  # reads the DMA destination before waiting: a race
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)

    def run(kernel):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                              scratch_shapes=[pltpu.VMEM(x.shape, x.dtype),
                                              pltpu.SemaphoreType.DMA(())],
                              interpret=tpu.interpret_params())(x)

    with pytest.raises(AssertionError, match="the race detector saw a DMA"):
        exercises.race_free(lambda: run(racy_kernel))
    tpu.reset_races()  # the fixture fails a test that leaves a race found
    assert exercises.race_free(lambda: 42) == 42
