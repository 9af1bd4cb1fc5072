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
# (A scale-out program's routed-expert reads: with 1 they queue behind the weight ring's issued
# blocks, with 2 or more they take a queue of their own and share the bandwidth with the ring.)
N_DMA_ENGINES = 1
# VMEM -> vector registers / MXU bandwidth. Not published; VMEM is on-die SRAM an order of
# magnitude faster than HBM. ASSUMPTION: 16x the device's HBM bandwidth.
VMEM_OVER_HBM = 16.0
# VPU (elementwise f32) peak. Not published for TPU7x. ASSUMPTION: 1/16 of the bf16 MXU peak (8 x
# 128 lanes x a few VALU slots per cycle against 4 MXUs of 128^2 or 256^2). The one public figure
# of a TPU vector unit is v5p's (docs/tpu.md §1): per TensorCore 8 sublanes x 128 lanes x 4 ALUs,
# one operation each per cycle, at about 1.75 GHz: 1/32 of v5p's bf16 peak, and a tenth of this
# ASSUMPTION on TPU7x were its vector unit v5p's. The sensitivity set moves it down that far.
VPU_OVER_MXU = 1.0 / 16.0
V5P_VPU_OPS_PER_CYCLE = 8 * 128 * 4  # per TensorCore (PUBLISHED, docs/tpu.md §1)
V5P_CLOCK_HZ = 1.75e9  # (PUBLISHED, docs/tpu.md §1)
# The rate a stream of weight DMAs sustains on TPU7x, MEASURED by the release on its second model:
# its dense-weight ring moves 76 MiB per layer in 25 us (3.19 TB/s), and its step's bytes are quoted
# against 3.2 TB/s per core (docs/collectives.md §2), below the published 3.69 TB/s per core. The
# scale-out model's weight ring and expert reads move at this rate (`RankSimulation`); other chips:
# ASSUMPTION, the same fraction of their published figure.
TPU7X_DMA_MEASURED = 76 * 2**20 / 25e-6
TPU7X_HBM_PUBLISHED = 3.69e12  # docs/tpu.md: 7.37 TB/s per chip, two TensorCores
DMA_OVER_HBM = TPU7X_DMA_MEASURED / TPU7X_HBM_PUBLISHED
# A weight tile costs the MXU at least as many cycles as its systolic array has rows, however few
# LHS rows stream through it (weight-stationary: each tile is pushed into the array): a matmul of
# K x N weights on M rows takes 2 K N max(M, mxu_rows) / peak of its dtype. PUBLISHED: the MXU
# shape (docs/tpu.md §1); MEASURED on TPU7x by the release: its int8 dense phase (42 MiB per layer,
# 39.8 M weights pushed as bf16) takes 17.4 us, 2 x 256 x weights / bf16 peak = 17.7 us, and "bf16
# weight push is 2x the fp8 rate" (docs/collectives.md §2).
MXU_ROWS_SOURCE = ("PUBLISHED: the MXU's rows (docs/tpu.md §1); on TPU7x MEASURED by the release: "
                   "its int8 dense phase, 39.8 M weights pushed as bf16, takes 17.4 us = 2 x 256 x "
                   "weights / bf16 peak within 2 % (docs/collectives.md §2)")


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
    # the scale-out model's weight programs (`RankSimulation`'s ring and fetches): the rate their
    # DMAs sustain, the MXU rows a weight tile costs at least, the fp8 MXU peak (0: none). A
    # recorded log's DMAs and phases keep `hbm_bandwidth` and their logged FLOPs.
    dma_bandwidth: float = 0.0  # 0: hbm_bandwidth
    mxu_rows: int = 1
    fp8_flops: float = 0.0
    # a collective's remote copies leave behind the weight DMAs the core issued before them (one
    # queue for every DMA), else apart from them
    remote_copies_queued: bool = False
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("hbm_bandwidth", "mxu_flops", "vpu_flops", "vmem_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"TimelineChip.{name}={value!r} is invalid: a finite number > 0")
        if not (isinstance(self.dma_latency, (int, float)) and self.dma_latency >= 0):
            raise ValueError(f"TimelineChip.dma_latency={self.dma_latency!r} is invalid: "
                             "a number of seconds >= 0")
        if not (isinstance(self.dma_bandwidth, (int, float)) and self.dma_bandwidth >= 0
                and math.isfinite(self.dma_bandwidth)):
            raise ValueError(f"TimelineChip.dma_bandwidth={self.dma_bandwidth!r} is invalid: "
                             "bytes/s >= 0 (0: hbm_bandwidth)")
        if isinstance(self.mxu_rows, bool) or not (isinstance(self.mxu_rows, int)
                                                   and self.mxu_rows >= 1):
            raise ValueError(f"TimelineChip.mxu_rows={self.mxu_rows!r} is invalid: an int >= 1")
        if not (isinstance(self.n_dma_engines, int) and self.n_dma_engines >= 1):
            raise ValueError(f"TimelineChip.n_dma_engines={self.n_dma_engines!r} is invalid: "
                             "an int >= 1")


    @property
    def weight_dma_bandwidth(self) -> float:
        """The rate a program's weight DMAs move at (`dma_bandwidth`, or the HBM figure)."""
        return self.dma_bandwidth or self.hbm_bandwidth

    def mxu_seconds_per_byte(self, rows: int, weights_per_byte: float, fp8: bool) -> float:
        """Seconds the MXU takes per stored byte of a weight matrix multiplied on `rows` rows:
        2 x weights x max(rows, mxu_rows) / peak (fp8 values at the fp8 peak when the chip has
        one), never less than one VMEM read of the byte."""
        peak = self.fp8_flops if fp8 and self.fp8_flops else self.mxu_flops
        return max(2.0 * weights_per_byte * max(rows, self.mxu_rows) / peak,
                   1.0 / self.vmem_bandwidth)


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
        dma_bandwidth=TPU7X_DMA_MEASURED if chip.name == "tpu7x"
        else chip.hbm_bandwidth * DMA_OVER_HBM,
        mxu_rows=chip.mxu_shape[0],
        fp8_flops=chip.fp8_flops,
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
            "dma_bandwidth": (f"MEASURED: the release's dense weight ring on TPU7x, 76 MiB per "
                              f"layer in 25 us ({TPU7X_DMA_MEASURED / 1e12:.2f} TB/s per core; its "
                              "step's bytes quoted at 3.2 TB/s; docs/collectives.md §2)"
                              if chip.name == "tpu7x" else
                              f"ASSUMPTION: hbm_bandwidth x {DMA_OVER_HBM:.3f}, the fraction "
                              "TPU7x's measured weight ring reaches"),
            "mxu_rows": MXU_ROWS_SOURCE if chip.name == "tpu7x" else
            f"PUBLISHED: the MXU's rows, {chip.mxu_shape[0]} (docs/tpu.md §1)",
            "fp8_flops": f"mkresearch.hardware.chips.CHIPS[{chip.name!r}].fp8_flops <- "
                         + src.get("fp8_flops", "?"),
            "remote_copies_queued": "ASSUMPTION: False, a collective's remote copies do not "
                                    "wait for the weight DMAs issued before them (True: one "
                                    "queue for every DMA)",
        }),
    )


def hbm_floor_s(nbytes: float, chip: str | TimelineChip = "tpu7x") -> float:
    """Seconds to move `nbytes` at `chip`'s HBM bandwidth (per JAX device)."""
    chip = timeline_chip(chip) if not isinstance(chip, TimelineChip) else chip
    return nbytes / chip.hbm_bandwidth
