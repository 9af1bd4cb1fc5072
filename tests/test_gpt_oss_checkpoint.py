"""A GPT-OSS checkpoint directory (docs/checkpoints.md §6), without transformers: written here in
the published layout (MXFP4 experts as `*_blocks` / `*_scales`, or bf16), read back bit for bit;
the released MXFP4 bytes are our codes (decoded here the way transformers decodes them: a lookup
table and ldexp, on the published layout); bad config.json fields and bad tensors are one line
naming the field or tensor and the file; `mkresearch decode --checkpoint DIR --prompt TEXT`
prints text. transformers itself: tests/test_gpt_oss_hf.py."""

import json
import re

import jax
import numpy as np
import pytest
from test_tokenizer import tiny_tokenizer_json

from mkresearch.checkpoint import gpt_oss_names, safetensors_io
from mkresearch.checkpoint import loader as checkpoint
from mkresearch.cli import main as cli
from mkresearch.model import formats, weights
from mkresearch.model.config import get_config

# transformers' FP4_VALUES (integrations/mxfp4.py): the E2M1 code -> value table
FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{format: (directory, cfg, params)}: gpt-oss-mini (vocab 512) in both expert formats."""
    out = {}
    for fmt in ("mxfp4", "bf16"):
        cfg = get_config("gpt-oss-mini", vocab_size=512, expert_format=fmt)
        params = weights.init_params(cfg, seed=2)
        directory = tmp_path_factory.mktemp(f"gpt-oss-{fmt}")
        checkpoint.write_checkpoint(directory, params, cfg)
        tiny_tokenizer_json(directory, vocab_size=512)
        out[fmt] = (directory, cfg, params)
    return out


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_written_and_read_back_bit_for_bit(written, fmt):
    directory, cfg, params = written[fmt]
    read = checkpoint.read_config(directory)
    assert read.replace(name=cfg.name, kv_tile=cfg.kv_tile) == cfg
    names = safetensors_io.Shards(str(directory)).names()
    assert ("model.layers.0.mlp.experts.gate_up_proj_blocks" in names) == (fmt == "mxfp4")
    loaded = checkpoint.load_params(directory, read, progress=False)
    same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), params, loaded)
    assert all(jax.tree.leaves(same))


def test_released_mxfp4_bytes_are_our_codes(written):
    """The published blocks decoded as transformers decodes them (a lookup on each byte's low
    nibble then its high one, ldexp by the scale - 127, rows [E, out, K] transposed to [in, out])
    equal our codes decoded (`formats.mxfp4_unpack`), gate and up the even and odd columns."""
    directory, cfg, params = written["mxfp4"]
    shards = safetensors_io.Shards(str(directory))
    p = "model.layers.1.mlp.experts."
    lut = np.asarray(FP4_VALUES, np.float32)

    def decode(blocks, scales):  # [E, N, G, 16], [E, N, G] -> [E, K, N]
        values = np.empty(blocks.shape[:-1] + (32,), np.float32)
        values[..., 0::2], values[..., 1::2] = lut[blocks & 0x0F], lut[blocks >> 4]
        values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
        return values.reshape(*blocks.shape[:2], -1).transpose(0, 2, 1)

    gate_up = decode(shards.read(p + "gate_up_proj_blocks"), shards.read(p + "gate_up_proj_scales"))
    down = decode(shards.read(p + "down_proj_blocks"), shards.read(p + "down_proj_scales"))
    layer = {m: jax.tree.map(lambda a: a[1], params["moe_full"]["experts"][m])
             for m in formats.EXPERT_MATRICES}
    ours = {m: np.asarray(formats.mxfp4_unpack(w)) for m, w in layer.items()}
    d, f = cfg.d_norm, cfg.expert_hidden_checkpoint
    np.testing.assert_array_equal(gate_up[..., 0::2], ours["w1"][:, :d, :f])
    np.testing.assert_array_equal(gate_up[..., 1::2], ours["w3"][:, :d, :f])
    np.testing.assert_array_equal(down, ours["w2"][:, :f, :d])
    # and back: our codes from the bytes, the padding zero codes with unit scales
    again = gpt_oss_names.blocks_to_codes(shards.read(p + "down_proj_blocks"),
                                          shards.read(p + "down_proj_scales"), cfg.expert_hidden,
                                          cfg.d_model)
    np.testing.assert_array_equal(again["codes"], np.asarray(layer["w2"]["codes"]))
    np.testing.assert_array_equal(again["scales"], np.asarray(layer["w2"]["scales"]))
    assert not np.asarray(layer["w2"]["codes"])[:, f // 8:].any()


def _rewrite_config(directory, tmp_path, change):
    target = tmp_path / "edited"
    target.mkdir()
    for path in directory.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    raw = json.loads((directory / "config.json").read_text())
    change(raw)
    (target / "config.json").write_text(json.dumps(raw))
    return target


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(layer_types=["sliding_attention"] * 3),
     r"config\.json: layer_types=\[.*\] is invalid: a list of 4 \(num_hidden_layers\)"),
    (lambda r: r["layer_types"].__setitem__(1, "chunked_attention"),
     r"config\.json: layer_types=.* is invalid"),
    (lambda r: r.update(sliding_window=None),
     r"config\.json: sliding_window=None is invalid: an int >= 1"),
    (lambda r: r.update(swiglu_limit="seven"), r"config\.json: swiglu_limit='seven' is invalid"),
    (lambda r: r["rope_scaling"].update(truncate="no"),
     r"config\.json: rope_scaling\.truncate='no' is invalid"),
    (lambda r: r.update(hidden_size=2890),  # not whole MXFP4 blocks: the shapes say so
     r"tensor model\.embed_tokens\.weight has shape \[512, 352\]: expected \[512, 2890\]"),
    (lambda r: r.update(num_attention_heads=7),
     (r"config\.json \(model_type .gpt_oss.\): ModelConfig\.n_kv_heads=2 is invalid: a divisor "
      r"of n_heads=7")),
])
def test_bad_config_field_is_one_line_naming_it(written, tmp_path, change, message):
    directory, _, _ = written["mxfp4"]
    error = _refused_in_one_line(_rewrite_config(directory, tmp_path, change), message)
    assert "config.json" in error or ".safetensors" in error


def _refused_in_one_line(directory, message) -> str:
    """check_checkpoint's CheckpointError for directory, matching message, on one line."""
    with pytest.raises(checkpoint.CheckpointError, match=message) as raised:
        checkpoint.check_checkpoint(directory)
    assert "\n" not in str(raised.value)
    return str(raised.value)


def _rewrite_tensors(directory, tmp_path, change):
    target = tmp_path / "edited"
    target.mkdir()
    (target / "config.json").write_bytes((directory / "config.json").read_bytes())
    shards = safetensors_io.Shards(str(directory))
    tensors = {name: shards.read(name) for name in sorted(shards.names())}
    change(tensors)
    safetensors_io.write_file(str(target / safetensors_io.SINGLE_FILE), tensors)
    return target


BLOCKS = "model.layers.2.mlp.experts.gate_up_proj_blocks"
SCALES = "model.layers.2.mlp.experts.down_proj_scales"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.__setitem__(BLOCKS, t[BLOCKS].astype(np.float32)),
     rf"model\.safetensors: tensor {re.escape(BLOCKS)} has dtype F32: expected U8 \(MXFP4"),
    (lambda t: t.__setitem__(SCALES, t[SCALES][..., :-1]),
     (rf"model\.safetensors: tensor {re.escape(SCALES)} has shape \[16, 352, 10\]: expected "
      r"\[16, 352, 11\]")),
    (lambda t: t.pop(SCALES), rf"tensor {re.escape(SCALES)} is missing: expected \[16, 352, 11\]"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj": t[BLOCKS]}),
     r"tensor model\.layers\.0\.mlp\.experts\.gate_up_proj is unexpected"),
])
def test_bad_tensor_is_one_line_naming_it_and_its_file(written, tmp_path, change, message):
    directory, _, _ = written["mxfp4"]
    _refused_in_one_line(_rewrite_tensors(directory, tmp_path, change), message)


@pytest.mark.slow
def test_decode_checkpoint_prints_text(written, capsys):
    """`decode --checkpoint DIR --prompt TEXT` reads the MXFP4 directory and its tokenizer.json,
    prefills and decodes, printing the prompt and the generated text: the reference's, and the
    megakernel's (the same)."""
    directory, _, _ = written["mxfp4"]
    assert cli.main(["decode", "--checkpoint", str(directory), "--prompt", "a prompt fills",
                     "--steps", "3", "--backend", "reference", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["generated"]) == 3 and result["text"]
    assert cli.main(["decode", "--checkpoint", str(directory), "--prompt", "a prompt fills",
                     "--steps", "3", "--backend", "reference"]) == 0
    assert capsys.readouterr().out == "a prompt fills" + result["text"] + "\n"
    # the megakernel (the default backend): the same text
    assert cli.main(["decode", "--checkpoint", str(directory), "--prompt", "a prompt fills",
                     "--steps", "3"]) == 0
    assert capsys.readouterr().out == "a prompt fills" + result["text"] + "\n"
