"""The timeline model's chip: the few numbers `mkresearch.prediction.timeline` needs for one JAX device.

Figures come from `mkresearch.hardware.chips.CHIPS`; what no public source gives is an ASSUMPTION, named in
`TimelineChip.sources` and overridable with `timeline_chip(name, **fields)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from mkresearch.hardware.chips import CHIPS, get_chip, with_overrides

# ---- assumptions (no public figure; each is a TimelineChip field that can be overridden) -------
# Latency from issuing a DMA to its first byte moving. The Pallas pipelining guide names it (α)
# but gives no number; on-chip DMA descriptors take on the order of a microsecond. ASSUMPTION.
DMA_LATENCY_S = 0.5e-6
# DMA engines moving bytes for one TensorCore at once. Not published. ASSUMPTION: 1, i.e. the DMAs
# of a kernel are served one after another in issue order at the full HBM bandwidth, which is what
# the Pallas pipelining guide's α + N·X/β assumes. With k engines, up to k DMAs move bytes at once
# and share the bandwidth: the total rate is the same, but a deep prefetch delays the first block.
N_DMA_ENGINES = 1
# VMEM -> vector registers / MXU bandwidth. Not published; VMEM is on-die SRAM an order of
# magnitude faster than HBM. ASSUMPTION: 16x the device's HBM bandwidth.
VMEM_OVER_HBM = 16.0
# VPU (elementwise f32) peak. Not published per chip in a comparable form. ASSUMPTION: 1/16 of the
# bf16 MXU peak (8 x 128 lanes x a few VALU slots per cycle against 4 MXUs of 128^2 or 256^2).
VPU_OVER_MXU = 1.0 / 16.0


@dataclass(frozen=True)
class TimelineChip:
    """The few numbers the timeline needs for one JAX device (see `sources` for each)."""

    name: str
    hbm_bandwidth: float  # bytes/s per JAX device: the rate all DMA engines share
    mxu_flops: float  # peak dense bf16 FLOP/s: phases run at this rate (matmul work)
    vpu_flops: float  # peak elementwise FLOP/s: phases named in `vpu_phases` run at this rate
    vmem_bandwidth: float  # bytes/s a phase can read from VMEM: the floor on a phase's duration
    dma_latency: float  # seconds from issuing a DMA to its first byte moving (α of the guide)
    n_dma_engines: int  # DMAs that move bytes at once, sharing `hbm_bandwidth`
    vmem_capacity: int  # bytes of VMEM per TensorCore: the ceiling of the occupancy curve
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("hbm_bandwidth", "mxu_flops", "vpu_flops", "vmem_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"TimelineChip.{name}={value!r} is invalid: a finite number > 0")
        if not (isinstance(self.dma_latency, (int, float)) and self.dma_latency >= 0):
            raise ValueError(f"TimelineChip.dma_latency={self.dma_latency!r} is invalid: "
                             "a number of seconds >= 0")
        if not (isinstance(self.n_dma_engines, int) and self.n_dma_engines >= 1):
            raise ValueError(f"TimelineChip.n_dma_engines={self.n_dma_engines!r} is invalid: "
                             "an int >= 1")


def timeline_chip(chip: str | TimelineChip = "tpu7x", **overrides: Any) -> TimelineChip:
    """The timeline parameters of `chip` ("v5e", "v6e", "v5p", "tpu7x"), optionally overridden.

    Overridden fields get the source "override". Unknown chips or fields raise ValueError.
    """
    if isinstance(chip, TimelineChip):
        base = chip
    else:
        if chip not in CHIPS:
            raise ValueError(f"chip={chip!r} is invalid: choose one of {', '.join(map(repr, CHIPS))}")
        base = _from_chips(get_chip(chip))
    return with_overrides(base, overrides, "timeline_chip")


def _from_chips(chip) -> TimelineChip:
    src = chip.sources
    return TimelineChip(
        name=chip.name,
        hbm_bandwidth=chip.hbm_bandwidth,
        mxu_flops=chip.bf16_flops,
        vpu_flops=chip.bf16_flops * VPU_OVER_MXU,
        vmem_bandwidth=chip.hbm_bandwidth * VMEM_OVER_HBM,
        dma_latency=DMA_LATENCY_S,
        n_dma_engines=N_DMA_ENGINES,
        vmem_capacity=chip.vmem_bytes,
        sources=MappingProxyType({
            "hbm_bandwidth": f"mkresearch.hardware.chips.CHIPS[{chip.name!r}].hbm_bandwidth <- "
                             + src.get("hbm_bandwidth", "?"),
            "mxu_flops": f"mkresearch.hardware.chips.CHIPS[{chip.name!r}].bf16_flops <- "
                         + src.get("bf16_flops", "?"),
            "vpu_flops": f"ASSUMPTION: bf16_flops x {VPU_OVER_MXU:g}",
            "vmem_bandwidth": f"ASSUMPTION: hbm_bandwidth x {VMEM_OVER_HBM:g}",
            "dma_latency": f"ASSUMPTION: {DMA_LATENCY_S * 1e6:g} us",
            "n_dma_engines": f"ASSUMPTION: {N_DMA_ENGINES}",
            "vmem_capacity": f"mkresearch.hardware.chips.CHIPS[{chip.name!r}].vmem_bytes <- "
                             + src.get("vmem_bytes", "?"),
        }),
    )


def hbm_floor_s(nbytes: float, chip: str | TimelineChip = "tpu7x") -> float:
    """Seconds to move `nbytes` at `chip`'s HBM bandwidth (per JAX device)."""
    chip = timeline_chip(chip) if not isinstance(chip, TimelineChip) else chip
    return nbytes / chip.hbm_bandwidth
