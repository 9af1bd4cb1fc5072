"""Safetensors files read lazily and written, and DeepSeek's FP8 block scales (docs/checkpoints.md).

A safetensors file is an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}} (offsets into the data after the header),
then the data. `Shards` opens a checkpoint directory through `model.safetensors.index.json`
(`weight_map`: tensor -> file) or a lone `model.safetensors`, reads every header up front (so a
missing shard, a truncated file or a tensor the index names but its file lacks fails before any
weight is read) and then one tensor at a time, on demand: never the whole model in host memory.
`read_box` reads a box of a tensor (a range per axis) by byte ranges: one read per run of
consecutive bytes, nothing else of the file; every file counts the bytes read from it
(`Shards.bytes_read`: what a process of a multi-host run read, `mkresearch.checkpoint.rank_loader`).

FP8 (DeepSeek-V3's release): `W` float8_e4m3fn [out, in] and `W_scale_inv` f32
[ceil(out/128), ceil(in/128)]; the real weight is W * scale_inv, block by block.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np

from mkresearch.model.hf_config import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16,
          "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
FP8_BLOCK = 128  # DeepSeek's weight_block_size
SCALE_SUFFIX = "_scale_inv"
E4M3_MAX = 448.0


class SafetensorsFile:
    """One file's header, read and checked against the file size; tensors read on demand."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as handle:
                head = handle.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{path}: truncated (no safetensors header)")
                (length,) = struct.unpack("<Q", head)
                if length > size - 8:
                    raise CheckpointError(f"{path}: truncated (header of {length} B, file of {size} B)")
                header = json.loads(handle.read(length))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing shard") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{path}: not a safetensors file ({error})") from None
        header.pop("__metadata__", None)
        self.data_start, self.tensors = 8 + length, header
        self.bytes_read = 8 + length  # the header, read above; every read adds its bytes
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            if entry["dtype"] not in DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has dtype {entry['dtype']}: "
                                      f"expected one of {', '.join(DTYPES)}")
            itemsize = np.dtype(DTYPES[entry["dtype"]]).itemsize
            if end - begin != int(np.prod(entry["shape"])) * itemsize:
                raise CheckpointError(f"{path}: tensor {name} holds {end - begin} B, its shape "
                                      f"{entry['shape']} x {entry['dtype']} needs "
                                      f"{int(np.prod(entry['shape'])) * itemsize} B")
            if self.data_start + end > size:
                raise CheckpointError(f"{path}: truncated: tensor {name} ends at byte "
                                      f"{self.data_start + end}, the file has {size}")

    def read(self, name: str) -> np.ndarray:
        return self.read_box(name, tuple((0, n) for n in self.tensors[name]["shape"]))

    def read_box(self, name: str, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The elements [start, stop) of each axis of tensor `name` (row-major in the file), by
        byte ranges: one read per run of consecutive elements (the innermost axes whole after
        the last partial one), nothing else of the file."""
        entry = self.tensors[name]
        shape, dtype = tuple(entry["shape"]), np.dtype(DTYPES[entry["dtype"]])
        box = tuple((int(a), int(b)) for a, b in box)
        if len(box) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, shape)):
            raise ValueError(f"box={box} is invalid for tensor {name} of shape {list(shape)}")
        out = np.empty(tuple(b - a for a, b in box), dtype)
        if out.size == 0:
            return out
        if not shape:  # a scalar: its bytes
            box, shape, out = ((0, 1),), (1,), out.reshape(1)
        run_axis = len(shape) - 1  # axes after it are whole: one run per index of the axes before
        while run_axis > 0 and box[run_axis] == (0, shape[run_axis]):
            run_axis -= 1
        strides = [math.prod(shape[axis + 1:]) for axis in range(len(shape))]
        run = (box[run_axis][1] - box[run_axis][0]) * strides[run_axis]
        flat = out.reshape(-1, run)
        begin = self.data_start + entry["data_offsets"][0]
        with open(self.path, "rb") as handle:
            for row, index in enumerate(itertools.product(*(range(a, b) for a, b in
                                                            box[:run_axis]))):
                offset = sum(i * s for i, s in zip(index, strides)) \
                    + box[run_axis][0] * strides[run_axis]
                handle.seek(begin + offset * dtype.itemsize)
                data = handle.read(run * dtype.itemsize)
                if len(data) != run * dtype.itemsize:
                    raise CheckpointError(f"{self.path}: truncated while reading tensor {name}")
                flat[row] = np.frombuffer(data, dtype=dtype)
                self.bytes_read += len(data)
        return out.reshape(tuple(entry["shape"])) if not entry["shape"] else out


class Shards:
    """A checkpoint directory's tensors: name -> (file, dtype, shape), every header read up front."""

    def __init__(self, directory: str) -> None:
        index_path = os.path.join(directory, INDEX_FILE)
        if os.path.exists(index_path):
            try:
                with open(index_path, encoding="utf-8") as handle:
                    weight_map = json.load(handle)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index_path}: not a safetensors index with a weight_map "
                                      f"({error!r})") from None
        elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
            weight_map = None
        else:
            raise CheckpointError(f"{directory}: no {INDEX_FILE} and no {SINGLE_FILE}")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        for file in files:
            if not os.path.exists(os.path.join(directory, file)):
                tensor = next(n for n, f in weight_map.items() if f == file)
                raise CheckpointError(f"{os.path.join(directory, file)}: missing shard "
                                      f"(the index puts {tensor} and others in it)")
        self.files = {file: SafetensorsFile(os.path.join(directory, file)) for file in files}
        self.where: dict[str, SafetensorsFile] = {}
        for file, opened in self.files.items():
            for name in opened.tensors:
                if weight_map is None or weight_map.get(name) == file:
                    self.where[name] = opened
        for name, file in (weight_map or {}).items():
            if name not in self.where:
                raise CheckpointError(f"{os.path.join(directory, file)}: tensor {name} is missing "
                                      "(the index puts it in this file)")

    def names(self) -> set[str]:
        return set(self.where)

    def dtype(self, name: str) -> str:
        return self.where[name].tensors[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].tensors[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        return self.where[name].read(name)

    def read_f32(self, name: str) -> np.ndarray:
        """The tensor as f32; an FP8 weight is multiplied by its block scales (`_scale_inv`)."""
        values = self.read(name)
        if self.dtype(name) != "F8_E4M3":
            return values.astype(np.float32)
        return fp8_dequantize(values, self.read(name + SCALE_SUFFIX).astype(np.float32))

    def read_f32_box(self, name: str, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        """A box of the tensor (`SafetensorsFile.read_box`) as f32; an FP8 weight's box times the
        block scales it overlaps (a block straddling the box's edge: its one scale, read once)."""
        values = self.where[name].read_box(name, box)
        if self.dtype(name) != "F8_E4M3":
            return values.astype(np.float32)
        blocks = tuple((a // FP8_BLOCK, -(-b // FP8_BLOCK)) for a, b in box)
        scale = self.where[name + SCALE_SUFFIX].read_box(name + SCALE_SUFFIX, blocks)
        rows, cols = (np.arange(a, b) // FP8_BLOCK - a // FP8_BLOCK for a, b in box)
        return values.astype(np.float32) * scale.astype(np.float32)[np.ix_(rows, cols)]

    def bytes_read(self) -> int:
        """Bytes read from the checkpoint's files so far (headers included)."""
        return sum(opened.bytes_read for opened in self.files.values())

    def total_bytes(self) -> int:
        """The sizes of the checkpoint's safetensors files together."""
        return sum(os.path.getsize(opened.path) for opened in self.files.values())


# ---- FP8 with 128 x 128 block scales -----------------------------------------------------------
def _blocks(shape: tuple[int, ...]) -> tuple[int, int]:
    return -(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The `_scale_inv` shape of an FP8 weight [out, in]: [ceil(out/128), ceil(in/128)]."""
    return _blocks(shape)


def _expand(scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    full = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)
    return full[:shape[0], :shape[1]]


def fp8_dequantize(values: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """W * scale_inv block by block, f32 [out, in]."""
    return values.astype(np.float32) * _expand(scale_inv, values.shape)


def fp8_quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn [out, in], scale_inv f32 [ceil(out/128), ceil(in/128)]): each 128 x 128
    block scaled so its largest magnitude is 448 (DeepSeek's act_quant/weight_quant)."""
    weight = np.asarray(weight, np.float32)
    rows, cols = _blocks(weight.shape)
    padded = np.zeros((rows * FP8_BLOCK, cols * FP8_BLOCK), np.float32)
    padded[:weight.shape[0], :weight.shape[1]] = weight
    amax = np.abs(padded.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK)).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    values = (weight / _expand(scale_inv, weight.shape)).astype(ml_dtypes.float8_e4m3fn)
    return values, scale_inv


# ---- writing ---------------------------------------------------------------------------------
def write_file(path: str, tensors: dict[str, np.ndarray]) -> None:
    """One safetensors file of `tensors` (numpy arrays of the DTYPES dtypes)."""
    header, offset = {}, 0
    for name, array in tensors.items():
        nbytes = array.nbytes
        header[name] = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)))
        handle.write(blob)
        for array in tensors.values():
            handle.write(np.ascontiguousarray(array).tobytes())


def write_shards(directory: str, groups: Iterable[dict[str, np.ndarray]], n_groups: int,
                 shards: int) -> None:
    """Groups of tensors (e.g. one layer each) into `shards` files with an index (one file and no
    index when shards == 1); each group goes whole into one shard."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards={shards!r} is invalid: an int >= 1")
    if shards == 1:
        merged: dict[str, Any] = {}
        for group in groups:
            merged.update(group)
        write_file(os.path.join(directory, SINGLE_FILE), merged)
        return
    weight_map: dict[str, str] = {}
    current: dict[str, np.ndarray] = {}
    shard = 0
    per_shard = -(-n_groups // shards)
    shards = -(-n_groups // per_shard)  # the files actually written (fewer groups than shards)
    for i, group in enumerate(groups):
        current.update(group)
        if (i + 1) % per_shard == 0 or i + 1 == n_groups:
            file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
            write_file(os.path.join(directory, file), current)
            weight_map.update({name: file for name in current})
            current, shard = {}, shard + 1
    total = sum(1 for _ in weight_map)
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as handle:
        json.dump({"metadata": {"tensors": total}, "weight_map": weight_map}, handle, indent=1)
