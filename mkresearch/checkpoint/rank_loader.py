"""Each rank's slices of a checkpoint, read from its safetensors by byte ranges: what one process
of a multi-host run loads (docs/multihost.md).

`load_rank_params(dir, lay, ranks)` returns what `layout.shard_params(load_params(dir, cfg), lay,
ranks)` returns, bit for bit (tests/test_rank_loader.py), without reading the rest: for every
published tensor only the box of it that the ranks' slices take (each entry's `names.Source`s map
a slice of our leaf back to the published axes: the transpose, the rope columns' order, the
padding, the stacked experts), the boxes read by byte ranges (`SafetensorsFile.read_box`: one
read per run of consecutive bytes). An FP8 weight's box is multiplied by the block scales it
overlaps: a 128 x 128 block that straddles two ranks' slices has its one scale read by both.
A slice the ranks share (a replicated weight, a head on several ranks) is read once. The bytes
each process read are counted (`RankLoad.bytes_read`, headers included); the sum over processes
is about the checkpoint's size (every slice read by the process holding it, replicated weights by
each process), each process's about its share.

Routed experts are quantized into the expert format slice by slice: the same bits as quantizing
the whole stack, since a rank's slice never cuts a scale block (the layout splits experts' axes
in whole lane chunks). The conversion errors `load_params(stats=...)` reports are not measured
here.

Imports: mkresearch.hardware, mkresearch.model, mkresearch.sharding, this package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from mkresearch.checkpoint.loader import CheckpointError, open_checked
from mkresearch.checkpoint.names import TENSOR, Entry
from mkresearch.checkpoint.safetensors_io import Shards
from mkresearch.model import formats, spec
from mkresearch.sharding import layout as layouts

Box = tuple[tuple[int, int], ...]  # [start, stop) per axis


@dataclass(frozen=True)
class RankLoad:
    """The ranks' slices of a checkpoint and what reading them cost."""

    params: dict  # leaves [len(ranks), ...]: `layout.shard_params(..., ranks)`'s
    ranks: tuple[int, ...]
    bytes_read: int  # from the checkpoint's files, headers included
    total_bytes: int  # the checkpoint's safetensors files together

    def facts(self) -> dict:
        return {"ranks": _ranges(self.ranks), "bytes_read": self.bytes_read,
                "total_bytes": self.total_bytes}

    def describe(self) -> str:
        return (f"ranks {_ranges(self.ranks)}: read {self.bytes_read:,d} B of "
                f"{self.total_bytes:,d} B ({self.bytes_read / self.total_bytes:.0%})")


def _ranges(ranks: tuple[int, ...]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == tuple(range(ranks[0], ranks[-1] + 1)) \
        and len(ranks) > 1 else ",".join(map(str, ranks))


def read_slice(shards: Shards, entry: Entry, box: Box) -> np.ndarray:
    """`entry.to_ours(every published tensor)[box]` (f32, one layer's leaf), reading only the
    published boxes it takes (module docstring)."""
    sources = entry.sources
    if len(sources) != len(box):
        raise CheckpointError(f"{entry.names[0]}: no slice reader for our {'.'.join(entry.key)} "
                              f"(its sources name {len(sources)} axes, the slice {len(box)})")
    stacked = next((k for k, s in enumerate(sources) if s.axis == TENSOR), None)
    if stacked is None:
        return _read_one(shards, entry.names[0], entry.shapes[0], sources, box)
    return np.stack([_read_one(shards, entry.names[t], entry.shapes[t], sources, box)
                     for t in range(*box[stacked])], axis=stacked)


def _read_one(shards: Shards, name: str, shape: tuple[int, ...], sources: tuple, box: Box):
    ours = [k for k, s in enumerate(sources) if s.axis != TENSOR]
    index, real = {}, {}  # published axis -> its indices; our axis -> its real (unpadded) length
    for k in ours:
        source, (start, stop) = sources[k], box[k]
        length = shape[source.axis] if source.length is None else source.length
        positions = np.arange(start, max(start, min(stop, length)))
        index[source.axis] = positions if source.order is None \
            else np.asarray(source.order)[positions]
        real[k] = len(positions)
    out_shape = tuple(box[k][1] - box[k][0] for k in ours)
    if any(len(i) == 0 for i in index.values()):
        return np.zeros(out_shape, np.float32)  # padding only
    published_box = tuple((int(index[a].min()), int(index[a].max()) + 1) if a in index
                          else (0, 1) for a in range(len(shape)))  # others: length 1
    values = shards.read_f32_box(name, published_box)
    picked = values[np.ix_(*(index[a] - published_box[a][0] if a in index else np.zeros(1, int)
                             for a in range(len(shape))))]
    referenced = sorted(index)
    picked = picked.reshape([len(index[a]) for a in referenced])
    picked = picked.transpose([referenced.index(sources[k].axis) for k in ours])
    return np.pad(picked, [(0, n - real[k]) for k, n in zip(ours, out_shape)])


def _leaf(tree: Any, key: tuple[str, ...]) -> Any:
    for part in key:
        tree = tree[part]
    return tree


def _rank_boxes(lay: layouts.Layout, p: spec.Param, entry: Entry, ranks: tuple[int, ...]) -> dict:
    """{our box of one layer: [positions in `ranks` holding it]} for a parameter."""
    active = dict(layouts.active_shard(lay, layouts.param_shard(lay, p), p.shape))
    stacked = entry.index is not None  # a per-layer stack: axis 0 is the layer
    if stacked and 0 in active:
        raise CheckpointError(f"{'.'.join(entry.key)}: split by its layer axis ({active[0]}): "
                              "no slice reader")
    boxes: dict[Box, list[int]] = {}
    for i, rank in enumerate(ranks):
        box = tuple(lay.bounds(active[a], n, rank)[:2] if a in active else (0, n)
                    for a, n in enumerate(p.shape))
        boxes.setdefault(box[1:] if stacked else box, []).append(i)
    return boxes


def load_rank_params(directory: str | os.PathLike, lay: layouts.Layout, ranks: Any, *,
                     progress: bool = True) -> RankLoad:
    """The checkpoint in `directory` as the slices `ranks` hold in layout `lay` (of lay.cfg, the
    checkpoint's config): leaves [len(ranks), ...] in `ranks` order, equal to
    `layout.shard_params(load_params(directory, lay.cfg), lay, ranks)`; every check of
    `load_params` first. Bad input: `CheckpointError`, one line."""
    directory, ranks, cfg = os.fspath(directory), tuple(int(r) for r in ranks), lay.cfg
    if not ranks or any(not 0 <= r < lay.n_ranks for r in ranks):
        raise CheckpointError(f"ranks={list(ranks)} is invalid: ranks in [0, {lay.n_ranks})")
    try:
        spec.check(cfg)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    shards, groups = open_checked(directory, cfg)
    table = spec.param_table(cfg)
    params = jax.tree.map(lambda s: np.zeros((len(ranks), *s.shape), s.dtype),
                          layouts.rank_param_shapes(lay))
    bar = tqdm(groups, desc=f"loading ranks {_ranges(ranks)} of "
                            f"{os.path.basename(directory.rstrip(os.sep))}",
               unit="layer", disable=not progress)
    for group in bar:
        for entry in group:
            p, leaf = _leaf(table, entry.key), _leaf(params, entry.key)
            for box, holders in _rank_boxes(lay, p, entry, ranks).items():
                if any(start == stop for start, stop in box):
                    continue  # a slice of padding alone: zeros
                ours = read_slice(shards, entry, box)
                value = (formats.quantize(jnp.asarray(ours), cfg.expert_format) if entry.quantized
                         else jnp.asarray(ours, p.dtype))
                for i in holders:
                    jax.tree.map(lambda part, v, i=i, layer=entry.index:
                                 _put(part, i, layer, np.asarray(v)), leaf, value)
    bar.close()
    return RankLoad(params, ranks, shards.bytes_read(), shards.total_bytes())


def _put(stack: np.ndarray, i: int, layer: int | None, value: np.ndarray) -> None:
    """value into rank position i (at `layer` of a per-layer stack), from the slice's start: the
    rest of the rank's slice stays zero (the layout's padding)."""
    target = stack[i] if layer is None else stack[i, layer]
    target[tuple(slice(0, n) for n in value.shape)] = value
