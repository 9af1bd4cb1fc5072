"""`mkresearch compile MODEL --chip C --ranks N` (mkresearch.cli.compile_check): the sharded step
of a small real model compiled for the TPU VM slice it fits (v5e:2x4 by default for --chip v5e),
from shapes, with the real Mosaic compiler; a model that does not fit is one line naming the
bytes it needs and the chip has. Measured here: Qwen3-30B-A3B on v5e:2x4 compiles in ~6 s (one
Mosaic kernel per rank); GLM-4.5-Air needs 29.9 GB per v5e rank of its 17.2 GB."""

import pytest

from mkresearch.cli import main as cli


@pytest.mark.slow  # ~6 s: a Mosaic compile
def test_a_small_real_model_compiles_for_a_v5e_vm(capsys):
    assert cli.main(["compile", "qwen3-30b-a3b", "--chip", "v5e", "--ranks", "8",
                     "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b on 8 devices of v5e:2x4 (2 host(s)" in out  # a multi-host slice
    assert "1 Mosaic kernel(s)" in out  # one per rank: each rank's program launches one


@pytest.mark.parametrize("extra, message", [
    (["glm-4.5-air", "--chip", "v5e", "--ranks", "8"],
     "one rank of glm-4.5-air on 8 ranks does not fit the HBM of one v5e device"),
    (["qwen3-30b-a3b", "--chip", "v5e", "--ranks", "16"], "has 8 devices: n_ranks=16 needs"),
    (["qwen3-30b-a3b", "--chip", "v5e", "--ranks", "8", "--topology", "v6e:2x4"],
     "--topology 'v6e:2x4' is invalid with --chip v5e"),
    (["qwen3-30b-a3b", "--topology", "v5e:2x4"], "--topology is an option of --ranks N"),
])
def test_what_does_not_compile_is_one_line(capsys, extra, message):
    assert cli.main(["compile", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
