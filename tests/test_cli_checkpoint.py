"""`mkresearch decode --checkpoint DIR --prompt TEXT --steps N` (mkresearch.cli.checkpoint): a
checkpoint written here in the published layout (qwen3-235b-a22b-mini, two shards, a tiny
tokenizer.json built in the test), decoded from text to text, also with --speculate K and
--ranks N (the latter on 2 simulated devices in a child process: opt-in tier, ~90 s here); bad
input is one line, exit 2. No network."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_cli_ranks import check_sharded_decode
from test_tokenizer import tiny_tokenizer_json

from mkresearch.checkpoint.loader import read_config, write_checkpoint
from mkresearch.checkpoint.tokenizer import TextStream, encode, load_tokenizer
from mkresearch.cli import main as cli
from mkresearch.cli import ranks as cli_ranks
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
    (["--checkpoint", "{dir}", "--prompt", "x", "--ranks", "2", "--speculate", "1"],
     "--speculate runs on one device: --ranks 1"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--ranks", "0"], "--ranks must be an int >= 1"),
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


def _text(directory, cfg, generated):
    tokenizer = load_tokenizer(directory)
    stream = TextStream(tokenizer, encode(tokenizer, PROMPT, cfg.vocab_size))
    return PROMPT + "".join(stream.push(t) for t in generated)


@pytest.mark.slow
def test_speculate_with_checkpoint_weights(checkpoint, capsys):
    """--speculate 2 on the checkpoint's weights and tokenized prompt (the reference's verify:
    the megakernel's verify is the same code path with a random model, tests/test_cli_speculative.py):
    lossless against plain greedy decoding, and the text of the tokens."""
    directory, cfg, _ = checkpoint
    status = cli.main(["decode", "--checkpoint", str(directory), "--prompt", PROMPT, "--steps",
                       "3", "--speculate", "2", "--backend", "reference", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert status == 0 and result["lossless"]["passed"] and result["speculate"] == 2
    ids = encode(load_tokenizer(directory), PROMPT, cfg.vocab_size)
    assert result["prompt"] == [ids] and len(result["generated"][0]) == 3
    assert result["text"] == _text(directory, cfg, result["generated"][0])


def test_ranks_with_checkpoint_goes_to_the_sharded_run(checkpoint, monkeypatch, capsys):
    """--ranks 2 with --checkpoint takes the sharded run's road: in a child that still has one
    device it is refused there, in one line, before any weight is read."""
    directory, _, _ = checkpoint
    monkeypatch.setenv(cli_ranks.CHILD_ENV, "1")
    assert cli.main(["decode", "--checkpoint", str(directory), "--prompt", "a", "--steps", "2",
                     "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ranks 2 needs 2 devices but this cpu backend has 1" in err


@pytest.mark.slow
def test_decode_on_2_ranks_from_a_checkpoint_in_a_child(checkpoint):
    """The checkpoint's weights onto 2 simulated ranks by the layout (`decode_sharded`): each
    step's logits bit-equal to the sharded reference's and within the partial-sum claim of the
    reference; the text of the tokens. A child compiling the sharded, single-device and
    reference steps (the slowest test of this module)."""
    directory, cfg, _ = checkpoint
    env = {k: v for k, v in os.environ.items() if k != cli_ranks.CHILD_ENV}
    done = subprocess.run([sys.executable, "-m", "mkresearch", "decode", "--checkpoint",
                           str(directory), "--prompt", PROMPT, "--steps", "2", "--ranks", "2",
                           "--json"], capture_output=True, text=True, timeout=600, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["ranks"] == 2 and result["devices"] == 2 and result["passed"]
    assert result["text"] == _text(directory, cfg, result["generated"][0])
    check_sharded_decode(result)  # the checks of every `--ranks` run
