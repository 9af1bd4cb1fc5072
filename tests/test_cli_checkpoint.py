"""`mkresearch decode --checkpoint DIR --prompt TEXT --steps N` (mkresearch.cli.checkpoint): a
checkpoint written here in the published layout (qwen3-235b-a22b-mini cut to two of its four
layers, all alike: GQA + MoE; two shards, a tiny tokenizer.json built in the test), decoded from
text to text, also with --speculate K and --ranks N (the latter on 2 simulated devices in a
child process, the slowest test here); bad input is one line, exit 2. No network."""

import json
import math

import numpy as np
import pytest
from test_cli_ranks import check_sharded_decode
from test_tokenizer import tiny_tokenizer_json

from mkresearch.checkpoint.loader import read_config, write_checkpoint
from mkresearch.checkpoint.tokenizer import TextStream, encode, load_tokenizer
from mkresearch.cli import main as cli
from mkresearch.cli import ranks as cli_ranks
from mkresearch.model import kv_cache, prefill, reference, weights
from mkresearch.model.config import get_config
from mkresearch.model.published import PUBLISHED, published_config

PROMPT = "a prompt fills every cache"
# test_decode_on_2_ranks_from_a_checkpoint_in_a_child's: 3 tokens (one a merge), 4 interpret-
# mode steps of the sharded kernel (each checked against the single-device and reference
# steps), not 17
SHORT_PROMPT = "a pr"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-mini")
    # two layers: every compile of the module (reference, megakernel, sharded) is of half the
    # mini's, and each decodes the same kind of layer (mla_first: unused by Qwen3)
    cfg = get_config("qwen3-235b-a22b-mini", n_layers=2, mla_first=0)
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
    read = read_config(directory)  # the CLI's cache: compiled already
    small = read.replace(max_seq_len=kv_cache.cache_length(read, len(ids) + 3))
    logits, state = prefill.prefill(params, reference.init_state(small, 1), np.asarray([ids]),
                                    small)
    tokens = [int(np.asarray(logits)[0, -1].argmax())]
    for i in range(2):
        step, state, _ = reference.decode_step(params, state, np.asarray([tokens[-1]]),
                                               np.asarray([len(ids) + i]), small)
        tokens.append(int(np.asarray(step)[0].argmax()))
    assert result["generated"] == tokens
    stream = TextStream(tokenizer, ids)
    assert result["text"] == "".join(stream.push(t) for t in tokens) + stream.end()
    # without --json: the prompt, then each token's text as it comes, on stdout
    assert cli.main(["decode", "--checkpoint", str(directory), "--prompt", PROMPT, "--steps", "3",
                     "--backend", "reference"]) == 0
    assert capsys.readouterr().out == PROMPT + result["text"] + "\n"


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """The mini with max_position_embeddings 2048, as real configs have: read back, the family's
    KV tile (256) is the config's, so the cache the CLI allocates must be whole 256-token tiles."""
    directory = tmp_path_factory.mktemp("qwen3-mini-2048")
    cfg = get_config("qwen3-235b-a22b-mini", max_seq_len=2048, n_layers=1,
                     mla_first=0)  # one layer: cheap compiles (mla_first: unused by Qwen3)
    write_checkpoint(directory, weights.init_params(cfg, seed=4), cfg)
    tiny_tokenizer_json(directory)
    assert read_config(directory).kv_tile == 256
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("prompt_tokens, backend", [(1, "reference"), (10, "reference"),
                                                    (130, "reference"), (279, "megakernel")])
def test_decode_at_prompt_lengths_of_a_2048_position_checkpoint(long_checkpoint, capsys,
                                                                prompt_tokens, backend):
    """Prompts of 1, 10, 130 and 279 tokens (caches of 256 and 512: one and two KV tiles) decode;
    before, any cache not a multiple of 256 was refused (`max_seq_len=128 is invalid`)."""
    prompt = "z" * prompt_tokens  # one token per "z" (no merge of it in the tiny tokenizer)
    status = cli.main(["decode", "--checkpoint", str(long_checkpoint), "--prompt", prompt,
                       "--steps", "2", "--backend", backend, "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    result = json.loads(captured.out)
    assert len(result["prompt_ids"]) == prompt_tokens and len(result["generated"]) == 2


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_published_preset_accepts_every_cache_length_the_cli_asks_for(name):
    """`kv_cache.cache_length` is the CLI's (and notebook 12's) cache for prompt + steps tokens:
    for each published preset, at its own max_position_embeddings, every token count up to it
    gets a cache the config accepts (the function is a step: its edges are checked, 1, k·step
    and k·step + 1), holding the tokens, and too many tokens are one ValueError naming
    max_seq_len."""
    cfg = published_config(name)
    step = math.lcm(kv_cache.CACHE_ROUND, cfg.kv_tile)
    edges = {1, cfg.max_seq_len} | {t for k in range(1, cfg.max_seq_len // step + 1)
                                    for t in (k * step, k * step + 1) if t <= cfg.max_seq_len}
    lengths = set()
    for tokens in sorted(edges):
        length = kv_cache.cache_length(cfg, tokens)
        assert tokens <= length <= cfg.max_seq_len and length % cfg.kv_tile == 0, tokens
        lengths.add(length)
    for length in lengths:
        assert cfg.replace(max_seq_len=length).max_seq_len == length
    with pytest.raises(ValueError, match=f"exceed max_seq_len={cfg.max_seq_len}"):
        kv_cache.cache_length(cfg, cfg.max_seq_len + 1)


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "x"], "--checkpoint needs"),  # the checkpoint dropped below
    (["--checkpoint", "{dir}"], "--checkpoint needs --prompt TEXT"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--ranks", "2", "--speculate", "1"],
     "--speculate runs on one device: --ranks 1"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--ranks", "0"], "--ranks must be an int >= 1"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--batch", "2"], "--batch 2 is invalid"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--steps", "0"], "--steps must be"),
    (["--checkpoint", "{missing}", "--prompt", "x"], "nothing: no such directory"),
    (["--checkpoint", "{dir}/config.json", "--prompt", "x"], "config.json: not a directory"),
    (["--checkpoint", "{no_tokenizer}", "--prompt", "x"], "no tokenizer.json"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--steps", "200"], "exceed max_seq_len"),
    (["--checkpoint", "{dir}", "--prompt", "x", "--steps", "127", "--speculate", "2"],
     "+ --steps 127 - 1 + --speculate 2 = 129 exceed max_seq_len=128"),
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


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": "yarn"}, "config.json: rope_scaling='yarn' is invalid: a JSON object"),
    ({"hidden_size": [256]}, "config.json: hidden_size=[256] is invalid: an int"),
    ({"num_hidden_layers": "three"}, "config.json: num_hidden_layers='three' is invalid: an int"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}},
     "rope_scaling={'type': 'yarn', 'factor': 4.0} is not supported: none for GQA models"),
])
def test_bad_config_json_is_one_line_naming_the_field(checkpoint, tmp_path, capsys, change,
                                                      message):
    """config.json values of the wrong type: one line naming the file and the field, exit 2
    (were a TypeError, an AttributeError and a ValueError naming neither). DeepSeek's YaRN
    without original_max_position_embeddings reads as transformers reads it:
    tests/test_checkpoint_hf.py."""
    directory, _, _ = checkpoint
    for path in directory.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    raw = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    assert cli.main(["decode", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def _text(directory, cfg, generated, prompt=PROMPT):
    tokenizer = load_tokenizer(directory)
    stream = TextStream(tokenizer, encode(tokenizer, prompt, cfg.vocab_size))
    return prompt + "".join(stream.push(t) for t in generated) + stream.end()


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
def test_decode_on_2_ranks_from_a_checkpoint_in_a_child(checkpoint, capfd, monkeypatch):
    """The checkpoint's weights onto 2 simulated ranks by the layout (`decode_sharded`): each
    step's logits and states bit-equal to the sharded reference's and within the partial-sum
    claim of the reference; the text of the tokens. A child compiling the sharded,
    single-device and reference steps (the slowest test of this module). The command from this process
    (`cli.main`: a parent process would only start Python and JAX again); the child it runs
    prints on this process's stdout."""
    directory, cfg, _ = checkpoint
    monkeypatch.delenv(cli_ranks.CHILD_ENV, raising=False)
    status = cli.main(["decode", "--checkpoint", str(directory), "--prompt", SHORT_PROMPT,
                       "--steps", "2", "--ranks", "2", "--json"])
    captured = capfd.readouterr()
    assert status == 0, captured.err[-4000:]
    result = json.loads(captured.out)
    assert result["ranks"] == 2 and result["devices"] == 2 and result["passed"]
    assert result["text"] == _text(directory, cfg, result["generated"][0], SHORT_PROMPT)
    check_sharded_decode(result)  # the checks of every `--ranks` run
