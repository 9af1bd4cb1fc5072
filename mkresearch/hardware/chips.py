"""TPU chips the kernels are compiled for and measured against, with where every figure comes from.

All figures are per *device as JAX sees it*: one TensorCore on v5e, v6e and TPU7x (TPU7x exposes
each of its two TensorCores as its own device), the two-TensorCore megacore on v5p. Two sources:

- `tpu_info`: `pltpu.get_tpu_info_for_chip(version, cores_per_device)` of the pinned jax 0.10.2,
  which answers without a TPU (its figures are per TensorCore; we multiply by the cores of one
  device). Its answers are written down here (`_TPU_INFO`), so every figure, and every prediction
  made from them, is the same under any jax in pyproject.toml's range (before 0.9.2 jax has no
  get_tpu_info_for_chip); tests/test_chips.py holds the table equal to the pinned jax's.
- `spec`: the table of docs/tpu.md (public chip pages), used where tpu_info has no figure (0) and
  for what tpu_info does not model (topology names, HBM per chip on megacore, MXU shape check).

Each `Chip` carries `sources`: field name -> where its value came from. `python -m mkresearch.hardware.chips`
prints the table with sources.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, SimpleNamespace

GB = 10**9
GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Chip:
    """One TPU generation, per JAX device. `sources[field]` says where each figure comes from."""

    name: str  # our short name: "v5e", "v6e", "v5p", "tpu7x"
    topology: str  # name for jax.experimental.topologies.get_topology_desc(topology_name=...)
    device_kind: str  # jax Device.device_kind of that topology's devices
    tensorcores_per_chip: int  # physical TensorCores on one chip
    tensorcores_per_device: int  # TensorCores behind one JAX device (2 on v5p megacore)
    hbm_bandwidth: float  # bytes/s per device
    bf16_flops: float  # peak dense bf16 FLOP/s per device
    fp8_flops: float  # peak dense fp8 FLOP/s per device (0: no fp8 MXU path)
    vmem_bytes: int  # VMEM per TensorCore
    hbm_bytes: int  # HBM capacity per device
    mxu_shape: tuple[int, int]  # systolic array of one MXU
    native_fp4: bool  # Mosaic lowers float4_e2m1fn vectors (E2M1 decode by bitcast) on this chip
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def critical_intensity(self) -> float:
        """FLOP per HBM byte where compute and memory time are equal (bf16)."""
        return self.bf16_flops / self.hbm_bandwidth

    def __str__(self) -> str:
        return (f"{self.name} ({self.device_kind}): {self.hbm_bandwidth / 1e12:.2f} TB/s, "
                f"{self.bf16_flops / 1e12:.0f} bf16 TFLOP/s, VMEM {self.vmem_bytes // MIB} MiB, "
                f"HBM {self.hbm_bytes / GB:.0f} GB per device"
                f"{', native FP4' if self.native_fp4 else ''}")


# docs/tpu.md, per chip. hbm_bytes here is per chip; per device it is divided by devices per chip.
_SPEC_TABLE = {
    #         bw B/s     bf16 FLOP/s  fp8 FLOP/s  TCs  VMEM/TC    HBM/chip      MXU
    "v5e": (819 * GB, 1.97e14, 0.0, 1, 128 * MIB, 16 * GB, (128, 128)),
    "v6e": (1638 * GB, 9.18e14, 0.0, 1, 128 * MIB, 32 * GB, (256, 256)),
    "v5p": (2765 * GB, 4.59e14, 0.0, 2, 64 * MIB, 95 * GIB, (128, 128)),
    "tpu7x": (7.37e12, 2.307e15, 4.614e15, 2, 64 * MIB, 192 * GIB, (256, 256)),
}
# Chips whose Mosaic (libtpu 0.0.42.1, pinned with jax 0.10.2) lowers a uint32 -> float4_e2m1fn
# pltpu.bitcast and its f32 convert. On v5e, v6e and v5p it fails with "Unsupported type
# 'vector<...xf4E2M1FN>'" (tpu.unpack_subelements); tests/test_expert_kernel.py compiles both.
_NATIVE_FP4 = ("tpu7x",)
_NATIVE_FP4_SOURCE = ("compiled with the pinned libtpu: the E2M1 bitcast lowers on tpu7x only "
                      "(tests/test_expert_kernel.py)")
# name -> (topology, device_kind, ChipVersion member name, TensorCores per JAX device)
_LAYOUT = {
    "v5e": ("v5e:2x2", "TPU v5 lite", "TPU_V5E", 1),
    "v6e": ("v6e:2x2", "TPU v6 lite", "TPU_V6E", 1),
    "v5p": ("v5p:2x2x1", "TPU v5", "TPU_V5P", 2),
    "tpu7x": ("tpu7x:2x2x1", "TPU7x", "TPU_7X", 1),
}


# pltpu.get_tpu_info_for_chip(ChipVersion.<name>, cores per device) of jax 0.10.2 (and 0.9.2):
# (mem_bw_bytes_per_second, bf16_ops_per_second, fp8_ops_per_second, vmem_capacity_bytes,
# hbm_capacity_bytes), per TensorCore
TPU_INFO_FIELDS = ("mem_bw_bytes_per_second", "bf16_ops_per_second", "fp8_ops_per_second",
                   "vmem_capacity_bytes", "hbm_capacity_bytes")
_TPU_INFO = {
    "TPU_V5E": (820_000_000_000, 197_000_000_000_000, 0, 134_217_728, 17_200_000_000),
    "TPU_V6E": (1_640_000_000_000, 920_000_000_000_000, 920_000_000_000_000, 134_217_728,
                34_400_000_000),
    "TPU_V5P": (1_230_000_000_000, 229_500_000_000_000, 0, 67_108_864, 51_500_000_000),
    "TPU_7X": (3_700_000_000_000, 1_155_000_000_000_000, 2_300_000_000_000_000, 67_108_864,
               103_000_000_000),
}


def _tpu_info(version_name: str, cores_per_device: int):
    """What pltpu.get_tpu_info_for_chip answered in jax 0.10.2 (_TPU_INFO), as its attributes."""
    del cores_per_device  # every entry is per TensorCore (v5p's device is two: scaled by _build)
    return SimpleNamespace(**dict(zip(TPU_INFO_FIELDS, _TPU_INFO[version_name], strict=True)))


def _build(name: str) -> Chip:
    topology, device_kind, version_name, per_device = _LAYOUT[name]
    bw, bf16, fp8, tcs, vmem, hbm_chip, mxu = _SPEC_TABLE[name]
    devices_per_chip = tcs // per_device
    info = _tpu_info(version_name, per_device)
    info_src = f"pltpu.get_tpu_info_for_chip(ChipVersion.{version_name}, {per_device})"
    spec_src = "docs/tpu.md §1 table"
    sources = {"topology": "docs/tpu.md §2 (get_topology_desc names)",
               "device_kind": "Device.device_kind of get_topology_desc(topology)",
               "tensorcores_per_chip": spec_src,
               "tensorcores_per_device": "JAX device layout (v5p megacore: 2; TPU7x: 1 per core)"}
    per_chip_src = spec_src + (f" / {devices_per_chip} devices per chip" if devices_per_chip > 1 else "")
    values = {
        "hbm_bandwidth": (bw / devices_per_chip, per_chip_src),
        "bf16_flops": (bf16 / devices_per_chip, per_chip_src),
        "fp8_flops": (fp8 / devices_per_chip, per_chip_src),
        "vmem_bytes": (vmem, spec_src),
        "hbm_bytes": (hbm_chip // devices_per_chip, per_chip_src),
        "mxu_shape": (mxu, spec_src),
        "native_fp4": (name in _NATIVE_FP4, _NATIVE_FP4_SOURCE),
    }
    if info is not None:  # prefer the library's figures where it has them (non-zero)
        from_info = {
            "hbm_bandwidth": info.mem_bw_bytes_per_second * per_device,
            "bf16_flops": info.bf16_ops_per_second * per_device,
            "fp8_flops": info.fp8_ops_per_second * per_device,
            "vmem_bytes": info.vmem_capacity_bytes,
            "hbm_bytes": info.hbm_capacity_bytes * per_device,
        }
        for key, value in from_info.items():
            if value:
                scale = f" x {per_device} cores" if per_device > 1 and key != "vmem_bytes" else ""
                attr = {"hbm_bandwidth": "mem_bw_bytes_per_second", "bf16_flops": "bf16_ops_per_second",
                        "fp8_flops": "fp8_ops_per_second", "vmem_bytes": "vmem_capacity_bytes",
                        "hbm_bytes": "hbm_capacity_bytes"}[key]
                spec_value = values[key][0]
                differs = spec_value and abs(value / spec_value - 1) > 0.05
                note = f" (docs/tpu.md §1 says {spec_value:.4g})" if differs else ""
                values[key] = (float(value) if key.endswith(("bandwidth", "flops")) else int(value),
                               f"{info_src}.{attr}{scale}{note}")
    if name == "v6e":  # tpu_info lists v6e fp8 at the bf16 rate: no native fp8 MXU path, use spec
        values["fp8_flops"] = (0.0, spec_src + " (no native fp8 MXU; tpu_info's figure is the bf16 rate)")
    sources.update({key: src for key, (_, src) in values.items()})
    return Chip(name=name, topology=topology, device_kind=device_kind, tensorcores_per_chip=tcs,
                tensorcores_per_device=per_device,
                **{key: value for key, (value, _) in values.items()},
                sources=MappingProxyType(sources))


CHIPS: Mapping[str, Chip] = MappingProxyType({name: _build(name) for name in _LAYOUT})


def get_chip(name: str | Chip) -> Chip:
    """The chip called `name` (a Chip passes through). Unknown names raise ValueError listing them."""
    if isinstance(name, Chip):
        return name
    if name not in CHIPS:
        raise ValueError(f"unknown chip {name!r}: choose one of {', '.join(map(repr, CHIPS))}")
    return CHIPS[name]


if __name__ == "__main__":
    for chip in CHIPS.values():
        print(chip)
        for key, src in chip.sources.items():
            print(f"    {key:24s} {getattr(chip, key)!s:>22}  <- {src}")


def with_overrides(base, overrides: Mapping, what: str, fixed: tuple[str, ...] = ("name",)):
    """A copy of a frozen record with `sources` (a Chip, a TimelineChip, an Interconnect) with
    some fields overridden, each marked "override" in its sources (ValueError naming an unknown
    field and the allowed ones)."""
    if not overrides:
        return base
    allowed = [f.name for f in dataclasses.fields(base) if f.name not in (*fixed, "sources")]
    for key in overrides:
        if key not in allowed:
            raise ValueError(f"{what} override {key!r} is invalid: choose from {allowed}")
    sources = dict(base.sources) | {key: "override" for key in overrides}
    return dataclasses.replace(base, **overrides, sources=MappingProxyType(sources))
