"""Each rank's slices of a checkpoint read by byte ranges (mkresearch.checkpoint.rank_loader,
docs/multihost.md §3): a tensor's box read from its file equals the box of the whole tensor and
costs exactly its bytes; an FP8 box is scaled by the block scales it overlaps, also where a block
straddles the box's edge; the slices of a set of ranks equal `layout.shard_params` of the whole
load, bit for bit, and read only part of the files.
"""

import ml_dtypes
import numpy as np
import pytest

from mkresearch.checkpoint import loader, rank_loader, safetensors_io
from mkresearch.checkpoint.loader import CheckpointError
from mkresearch.model import weights
from mkresearch.model.config import get_config
from mkresearch.sharding import layout

DTYPES = (np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int32)


def _random_box(rng, shape):
    box = []
    for n in shape:
        start = int(rng.integers(0, n))
        box.append((start, int(rng.integers(start, n + 1))))
    return tuple(box)


@pytest.mark.parametrize("seed", range(12))
def test_a_box_read_by_byte_ranges_is_the_box_of_the_tensor(tmp_path, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 7, size=int(rng.integers(1, 5))))
    dtype = DTYPES[seed % len(DTYPES)]
    tensor = rng.standard_normal(shape).astype(dtype) if dtype is not np.int32 \
        else rng.integers(-99, 99, shape).astype(dtype)
    path = str(tmp_path / "one.safetensors")
    safetensors_io.write_file(path, {"t": tensor, "other": np.ones(3, np.float32)})
    opened = safetensors_io.SafetensorsFile(path)
    for _ in range(8):
        box = _random_box(rng, shape)
        before = opened.bytes_read
        got = opened.read_box("t", box)
        want = tensor[tuple(slice(a, b) for a, b in box)]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
        assert opened.bytes_read - before == want.nbytes  # its bytes, nothing else
    assert opened.read("t").tobytes() == tensor.tobytes()


@pytest.mark.parametrize("seed", range(6))
def test_an_fp8_box_takes_the_scales_of_the_blocks_it_overlaps(tmp_path, seed):
    """Boxes whose edges cut 128 x 128 blocks (the scale of a straddled block read by each box
    that overlaps it): the box of the whole tensor's dequantized values, bit for bit."""
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(130, 400)), int(rng.integers(130, 400)))
    values, scale = safetensors_io.fp8_quantize(rng.standard_normal(shape).astype(np.float32))
    safetensors_io.write_file(str(tmp_path / "model.safetensors"),
                              {"w": values, "w" + safetensors_io.SCALE_SUFFIX: scale})
    shards = safetensors_io.Shards(str(tmp_path))
    whole = shards.read_f32("w")
    straddles = 0
    for _ in range(10):
        box = _random_box(rng, shape)
        got = shards.read_f32_box("w", box)
        assert got.tobytes() == whole[tuple(slice(a, b) for a, b in box)].tobytes()
        straddles += any(a % 128 or b % 128 for a, b in box)
    assert straddles  # the case this test is about


def _checkpoint(tmp_path, name, **kwargs):
    cfg = get_config(name)
    directory = str(tmp_path / name)
    loader.write_checkpoint(directory, weights.init_params(cfg, seed=1), cfg, **kwargs)
    return directory, cfg


def _fp8_boxes(monkeypatch) -> list:
    """Record every box read of an FP8 tensor: (its shape, the box)."""
    seen, read = [], safetensors_io.Shards.read_f32_box

    def recording(shards, name, box):
        if shards.dtype(name) == "F8_E4M3":
            seen.append((tuple(shards.where[name].tensors[name]["shape"]), box))
        return read(shards, name, box)
    monkeypatch.setattr(safetensors_io.Shards, "read_f32_box", recording)
    return seen


@pytest.mark.slow  # ~40 s here: checkpoints written and read whole and by ranks
@pytest.mark.parametrize("name, kwargs, n_ranks, splits", [
    ("deepseek-v3-mini", {"fp8": True, "shards": 2}, 8, ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("qwen3-235b-a22b-mini", {"shards": 3}, 4, ((0,), (3, 1), (2,))),  # any ranks, any order
    ("glm-4.5-mini", {}, 8, ((0, 1, 2, 3), (4, 5, 6, 7))),
])
def test_the_ranks_slices_equal_the_whole_loads(tmp_path, monkeypatch, name, kwargs, n_ranks,
                                                 splits):
    """Each set of ranks (a process's; together every rank): `shard_params(load_params(...),
    lay, ranks)` bit for bit, reading part of the files; together about the files."""
    directory, cfg = _checkpoint(tmp_path, name, **kwargs)
    lay = layout.layout(cfg, n_ranks)
    whole = layout.shard_params(loader.load_params(directory, cfg, progress=False), lay)
    boxes = _fp8_boxes(monkeypatch)
    loads = [rank_loader.load_rank_params(directory, lay, ranks, progress=False)
             for ranks in splits]
    for ranks, load in zip(splits, loads):
        assert load.ranks == ranks
        assert_trees_bit_equal(load.params, whole, ranks)
        assert load.bytes_read < 0.8 * load.total_bytes, load.describe()
    total = loads[0].total_bytes
    together = sum(load.bytes_read for load in loads)
    print(f"{name}: " + " + ".join(f"{load.bytes_read:,d}" for load in loads)
          + f" = {together:,d} of {total:,d} B")
    assert 0.9 * total < together < 1.15 * total
    if kwargs.get("fp8"):  # a scale block straddling two ranks' slices was read
        assert any(a % 128 or (b % 128 and b != n) for shape, box in boxes
                   for (a, b), n in zip(box, shape))


def assert_trees_bit_equal(got, whole, ranks):
    """got's leaves [len(ranks), ...] are whole's [n_ranks, ...] at `ranks`, every bit."""
    import jax

    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(whole), strict=True):
        a, b = np.asarray(a), np.asarray(b)[list(ranks)]
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_ranks_outside_the_layout_are_one_line(tmp_path):
    directory, cfg = _checkpoint(tmp_path, "qwen3-235b-a22b-mini")
    with pytest.raises(CheckpointError, match=r"ranks=\[4\] is invalid: ranks in \[0, 4\)"):
        rank_loader.load_rank_params(directory, layout.layout(cfg, 4), (4,), progress=False)
