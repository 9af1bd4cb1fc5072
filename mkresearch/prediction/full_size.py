"""The full-size step: ONE answer to "how long is our step at full size, and how many bytes does
each rank move", for the kernel as built (the sharded megakernel, `kernels/compose/
megakernel_sharded.py`), naming its layout, collectives and rank count.

`decode`, `bench`, `info` and `predict` print `FullSizeStep.line()` of `full_size_step(...)` and
the notebooks print it (the README and docs/prediction.md §6 show the commands); nothing else
computes a full-size step time or per-rank bytes.
The step is the scale-out timeline model's (`scale_out.predict`: every rank's program simulated
together, collectives priced on the slice's links), the bytes are the layout's per-rank bytes
(`layout_bytes.rank_bytes`, what `info --ranks` tabulates). Both are predictions, not measured.

The one-device stand-in `<preset>-rank` (`config.get_config`: one rank's shapes compiled on one
device, with no collectives and, in the release's layout, W_ld and W_lu whole) is NOT this: it is a
compile target and a kernel-shape check, and every place that prints its figures labels it
`STAND_IN_LABEL`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mkresearch.hardware import topology
from mkresearch.model import partition
from mkresearch.model.config import PRESETS, RANK_SUFFIX, ModelConfig, get_config
from mkresearch.prediction import scale_out
from mkresearch.sharding import layout as layouts

# The collectives our sharded megakernel is built with (`decode --ranks N --collectives`):
# "partial-sum" (its default: split contractions reduced in one fixed order), "exact" (inputs
# gathered, every product on the rank that owns its columns: bit-equal to one device) or
# "restructured" (partial sums, the MoE latent reduce-scattered, W_lu split by its rows). The
# release's schedule has its own partial sums.
COLLECTIVES = layouts.COLLECTIVES
DEFAULT_COLLECTIVES = layouts.DEFAULT_COLLECTIVES
DEFAULT_RANKS = partition.RELEASE_RANKS
STAND_IN_LABEL = ("one-device stand-in (one rank's shapes on one device, no collectives): "
                  "not the full-size step")


@dataclass(frozen=True)
class FullSizeStep:
    """One full-size step: what it is (model, ranks, layout, collectives, chip, batch, context)
    and what it costs (step_s, rank_bytes per rank and step), beside the release's published step
    when there is one. `prediction` is scale_out.predict's whole row (the `predict` table's)."""

    model: str
    n_ranks: int
    layout: str
    collectives: str
    algorithm: str
    chip: str
    batch: int
    context: int
    step_s: float
    rank_bytes: float
    published_step_s: float | None
    prediction: dict
    expert_mxu: str = "bf16"  # our kernel's ModelConfig.expert_mxu (named only when "fp8")

    @property
    def label(self) -> str:
        algorithm = "each its own algorithm" if self.algorithm == "auto" else self.algorithm
        return (f"{self.model} on {self.n_ranks} ranks of {self.chip}, {self.layout} layout, "
                f"{self.collectives} collectives ({algorithm}), B={self.batch}"
                + (", experts to the MXU as fp8" if self.expert_mxu == "fp8" else "")
                + (f", context {self.context}" if self.context else ""))

    def line(self) -> str:
        """What every command prints for this step (the same text for the same arguments)."""
        published = (f"; the release publishes {self.published_step_s * 1e3:.2f} ms"
                     if self.published_step_s else "")
        return (f"full-size step ({self.label}): {self.step_s * 1e3:.2f} ms/step, "
                f"{self.rank_bytes / 1e9:.2f} GB per rank per step (timeline model prediction, "
                f"not measured){published}")

    def as_dict(self) -> dict[str, Any]:
        """JSON-able, without the prediction row; with `label` and `line`."""
        out = {k: v for k, v in asdict(self).items() if k != "prediction"}
        return {**out, "label": self.label, "line": self.line()}


def full_size_step(cfg: ModelConfig | str, n_ranks: int = DEFAULT_RANKS,
                   layout: str = layouts.OURS, batch: int = 1, *, collectives: str | None = None,
                   chip: str = "tpu7x", algorithm: str | None = None,
                   schedule: str | scale_out.Schedule | None = None,
                   context: int = 0) -> FullSizeStep:
    """The full-size step of `cfg` (a full preset, or its name) on n_ranks under `layout`.

    collectives: None = the kernel as built ("partial-sum", the sharded megakernel's default), else
    one of COLLECTIVES for our schedule; the release's schedule has its own partial sums.
    `schedule` / `algorithm` override scale_out's schedule and all-reduce algorithm (`predict
    --schedule/--algorithm`)."""
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    collectives = DEFAULT_COLLECTIVES if collectives is None else collectives
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives={collectives!r} is invalid: one of {COLLECTIVES}")
    row = scale_out.predict(cfg, n_ranks, layout, batch, chip=chip, algorithm=algorithm,
                            schedule=schedule, context=context, collectives=collectives)
    return FullSizeStep(model=cfg.name, n_ranks=n_ranks, layout=layout,
                        collectives=row["schedule"].get("collectives") or DEFAULT_COLLECTIVES,
                        algorithm=row["algorithm"],
                        chip=chip, batch=batch, context=context, step_s=row["step_s"],
                        rank_bytes=row["rank_bytes"], published_step_s=row["published_step_s"],
                        prediction=row,
                        expert_mxu=cfg.expert_mxu if row["schedule"].get("collectives") else "bf16")


def full_size_steps(cfg: ModelConfig, n_ranks: int, batch: int = 1, context: int = 0,
                    chip: str = "tpu7x") -> list[FullSizeStep]:
    """`full_size_step` in each layout (ours, then the release's) with its own collectives, as
    `info --ranks` prints them; [] when cfg has no sharding rules or no slice of `chip` has
    n_ranks ranks (nothing to predict on)."""
    slices = {s.n_ranks for s in topology.SLICES.values() if s.name.split(":")[0] == chip}
    if n_ranks not in slices or not layouts.has_rules(cfg):
        return []
    return [full_size_step(cfg, n_ranks, name, batch, chip=chip, context=context)
            for name in layouts.LAYOUTS]


def full_size_of(name: str) -> str | None:
    """The full preset a mini or a one-rank stand-in stands for ("kimi-k3-mini" -> "kimi-k3");
    None for a name that stands for none."""
    for suffix in ("-mini", RANK_SUFFIX):
        base = name.removesuffix(suffix)
        if base != name and base in PRESETS:
            return base
    return None


def stand_in_note(name: str) -> str | None:
    """For a one-device stand-in's name ("kimi-k3-rank"): what it is and where the full-size step
    is; None for any other name."""
    if not name.endswith(RANK_SUFFIX) or full_size_of(name) is None:
        return None
    return (f"{name}: {STAND_IN_LABEL}; the full-size step: "
            f"`mkresearch info {full_size_of(name)} --ranks {DEFAULT_RANKS}`")
