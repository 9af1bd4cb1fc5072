"""`mkresearch decode --checkpoint DIR --prompt TEXT --steps N` (mkresearch.cli.checkpoint): a
checkpoint written here in the published layout (qwen3-235b-a22b-mini, two shards, a tiny
tokenizer.json built in the test), decoded from text to text; bad input is one line, exit 2.
No network."""

import json

import numpy as np
import pytest
from test_tokenizer import tiny_tokenizer_json

from mkresearch.checkpoint.loader import read_config, write_checkpoint
from mkresearch.checkpoint.tokenizer import TextStream, encode, load_tokenizer
from mkresearch.cli import main as cli
from mkresearch.model import prefill, reference, weights
from mkresearch.model.config import get_config

PROMPT = "a prompt fills every cache"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-mini")
    cfg = get_config("qwen3-235b-a22b-mini")
    params = weights.init_params(cfg, seed=4)
    write_checkpoint(directory, params, cfg, shards=2)
    tiny_tokenizer_json(directory)
    return directory, cfg, params


@pytest.mark.slow
def test_decode_streams_the_reference_greedy_text(checkpoint, capsys):
    directory, cfg, params = checkpoint
    status = cli.main(["decode", "--checkpoint", str(directory), "--prompt", PROMPT, "--steps",
                       "3", "--backend", "reference", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert status == 0
    # the same greedy tokens from the same weights, prefilled and decoded in Python
    tokenizer = load_tokenizer(directory)
    ids = encode(tokenizer, PROMPT, cfg.vocab_size)
    assert result["prompt_ids"] == ids
    small = read_config(directory).replace(max_seq_len=128)  # the CLI's: compiled already
    logits, state = prefill.prefill(params, reference.init_state(small, 1), np.asarray([ids]),
                                    small)
    tokens = [int(np.asarray(logits)[0, -1].argmax())]
    for i in range(2):
        step, state, _ = reference.decode_step(params, state, np.asarray([tokens[-1]]),
                                               np.asarray([len(ids) + i]), small)
        tokens.append(int(np.asarray(step)[0].argmax()))
    assert result["generated"] == tokens
    stream = TextStream(tokenizer, ids)
    assert result["text"] == "".join(stream.push(t) for t in tokens)
    # without --json: the prompt, then each token's text as it comes, on stdout
    assert cli.main(["decode", "--checkpoint", str(directory), "--prompt", PROMPT, "--steps", "3",
                     "--backend", "reference"]) == 0
    assert capsys.readouterr().out == PROMPT + result["text"] + "\n"


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "x"], "--checkpoint needs"),  # the checkpoint dropped below
    (["--checkpoint", "{dir}"], "--checkpoint needs --prompt TEXT"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--ranks", "2"], "--ranks with --checkpoint"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--batch", "2"], "--batch 2 is invalid"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--steps", "0"], "--steps must be"),
    (["--checkpoint", "{missing}", "--prompt", "x"], "config.json"),
    (["--checkpoint", "{no_tokenizer}", "--prompt", "x"], "no tokenizer.json"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--steps", "200"], "exceed max_seq_len"),
])
def test_bad_input_is_one_line(checkpoint, tmp_path, capsys, extra, message):
    directory, _, _ = checkpoint
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((directory / "config.json").read_text())
    if extra[0] == "--prompt":
        message = "--prompt TEXT needs --checkpoint DIR"
    argv = ["decode", "--steps", "2",
            *(a.format(dir=directory, missing=tmp_path / "nothing", no_tokenizer=no_tokenizer)
              for a in extra)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
