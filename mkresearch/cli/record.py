"""`make recorded` (`python -m mkresearch.cli.record`): compile and record every entry of
`recorded.RECORDED_COMPILES` (through `mkresearch compile ... --record`) and of
`recorded.RECORDED_SHARDED` (and of `recorded.RECORDED_RESTRUCTURED`, in that mode)."""

from __future__ import annotations

from mkresearch.cli import main as cli
from mkresearch.measurement.recorded import (
    RECORDED_COMPILES,
    RECORDED_RESTRUCTURED,
    RECORDED_SHARDED,
    sharded_compile_or_recorded,
)
from mkresearch.sharding.layout import RESTRUCTURED


def main() -> int:
    for model, batch, chip in RECORDED_COMPILES:
        status = cli.main(["compile", model, "--batch", str(batch), "--chip", chip, "--record"])
        if status:
            return status
    runs = [(r, None) for r in RECORDED_SHARDED] + [(r, RESTRUCTURED)
                                                    for r in RECORDED_RESTRUCTURED]
    for (model, n_ranks, name, batch, chip), mode in runs:
        result, _, _ = sharded_compile_or_recorded(model, n_ranks, name, batch, chip, record=True,
                                                   collectives=mode)
        print(f"{model} on {n_ranks} {chip} cores ({name} layout{', ' + mode if mode else ''}): "
              f"{result.n_mosaic_kernels} Mosaic kernel(s) per rank, compiled in "
              f"{result.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
