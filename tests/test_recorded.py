"""Recorded compile results: every record matches its plan (else notebook 06 compiles for half a
minute instead of showing it), records round-trip, stale ones are not used."""

import dataclasses
from pathlib import Path

import pytest
from mkresearch.kernels.compose import megakernel

from mkresearch.cli import main as cli
from mkresearch.hardware import tpu
from mkresearch.measurement import recorded
from mkresearch.model.config import get_config


def plan_of(model, batch, chip):
    cfg = get_config(model)
    return megakernel.make_plan(cfg, batch, cfg.max_seq_len, megakernel.MegakernelOptions(chip=chip))


@pytest.mark.parametrize("model, batch, chip", recorded.RECORDED_COMPILES)
def test_every_record_matches_its_current_plan(model, batch, chip):
    path = recorded.compile_path(model, batch, chip)
    assert path.exists(), f"{path.name} is missing: run `make recorded`"
    result = recorded.load_compile(plan_of(model, batch, chip), path)
    assert result is not None, (
        f"{path.name} was recorded for another megakernel plan or JAX version: run "
        f"`mkresearch compile {model} --batch {batch} --chip {chip} --record` (or `make recorded`)")
    assert result.chip == chip and result.n_mosaic_kernels == 1


def test_record_round_trip_and_stale_records(tmp_path):
    plan = plan_of("kimi-k3-mini", 1, "tpu7x")
    result = tpu.CompileResult(chip="tpu7x", seconds=1.5, flops=2.0, bytes_accessed=3.0,
                               memory={"temp_size_in_bytes": 4}, cost={"flops": 2.0},
                               n_mosaic_kernels=1, hlo_text="HloModule m")
    path = recorded.record_compile(result, plan, tmp_path / "r.json")
    loaded = recorded.load_compile(plan, path)
    assert loaded == result and dict(loaded.memory) == {"temp_size_in_bytes": 4}
    assert loaded.hlo_text == ""  # the HLO text is not recorded (megabytes)
    other = dataclasses.replace(plan, batch=2)
    assert recorded.load_compile(other, path) is None
    assert recorded.load_compile(plan, tmp_path / "missing.json") is None


def test_compile_command_refuses_bad_input(capsys):
    assert cli.main(["compile", "kimi-k3-rank", "--chip", "tpu9"]) == 2
    assert "--chip 'tpu9' is unknown" in capsys.readouterr().err
    assert cli.main(["compile", "kimi-k3-rank", "--batch", "0"]) == 2
    assert "--batch 0 is invalid" in capsys.readouterr().err


def test_records_are_shown_under_another_jax_in_the_range(monkeypatch):
    """A runtime keeps its own jax when it is in pyproject's range (Colab's 0.9.2): the records
    compiled with the pinned jax are still shown, saying which jax compiled them (compiling here
    would need that jax's libtpu, the tpu extra)."""
    constraints = (Path(__file__).parent.parent / "requirements" / "constraints.txt").read_text()
    assert f"jax=={recorded.RECORDED_JAX}\n" in constraints, "re-record (make recorded) with the pin"
    monkeypatch.setattr(recorded.jax, "__version__", "0.9.2")
    model, batch, chip = recorded.RECORDED_COMPILES[0]
    assert recorded.load_compile(plan_of(model, batch, chip), recorded.compile_path(model, batch, chip))
    result, _, where = recorded.compile_or_recorded(get_config(model), batch, chip=chip)
    assert result.n_mosaic_kernels == 1
    assert where.startswith(f"recorded (compile_{model}_b{batch}_{chip}.json, compiled with jax "
                            f"{recorded.RECORDED_JAX}; ")
