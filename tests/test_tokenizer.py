"""The checkpoint tokenizer (`mkresearch.checkpoint.tokenizer`): a tiny tokenizer.json built here (a BPE
trained on a few sentences, byte-level, so any text encodes), no network."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mkresearch.checkpoint.tokenizer import TextStream, encode, load_tokenizer
from mkresearch.model.hf_config import CheckpointError

CORPUS = ["the megakernel decodes one token per step", "a prompt fills every cache at once",
          "Kimi Delta Attention keeps a recurrent state", "héllo wörld ✓ naïve café"]


def tiny_tokenizer_json(directory, vocab_size=300):
    """Write DIR/tokenizer.json: byte-level BPE trained on CORPUS (vocab_size ids)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


def test_prompt_round_trips_and_streams_token_by_token(tmp_path):
    tiny_tokenizer_json(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    prompt = "a prompt fills"
    text = " every cache héllo ✓ café"
    ids = encode(tokenizer, prompt + text, vocab_size=2048)
    prompt_ids = encode(tokenizer, prompt, vocab_size=2048)
    assert ids[:len(prompt_ids)] == prompt_ids
    stream = TextStream(tokenizer, prompt_ids)
    pieces = [stream.push(i) for i in ids[len(prompt_ids):]]
    assert "".join(pieces) == text  # multi-byte characters come out whole, once
    assert stream.end() == "" and stream.text() == text  # nothing held back at the end
    assert len([p for p in pieces if p]) > 3  # streamed, not all at the end


def split_character_tokenizer():
    """Byte-level BPE with one merge, "Ġâ": a space and the first byte of a 3-byte character
    (✓ is e2 9c 93) in one token, so a sequence can end inside the character in a token that
    also holds the space before it."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {piece: i for i, piece in enumerate([*alphabet, "Ġâ"])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "â")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@pytest.mark.parametrize("text, cut", [("a ✓", 2), ("a ✓", 3), ("a ✓ café", 2), ("é", 1)])
def test_tokens_ending_inside_a_character_end_as_the_tokenizer_decodes_them(text, cut):
    """Tokens that stop inside a multi-byte character: `end()` gives what decoding the whole
    sequence gives, the U+FFFD replacement characters (what transformers prints), and the space
    held with them; before, both were dropped. Prompt "" and a one-token prompt of context."""
    tokenizer = split_character_tokenizer()
    ids = tokenizer.encode(text).ids[:cut]
    assert tokenizer.decode(ids).endswith("\ufffd")
    for prompt_len in (0, 1):
        stream = TextStream(tokenizer, ids[:prompt_len])
        pieces = "".join(stream.push(i) for i in ids[prompt_len:])
        assert pieces + stream.end() == stream.text() == tokenizer.decode(ids)[
            len(tokenizer.decode(ids[:prompt_len])):]
        assert stream.end() == ""  # once
    stream = TextStream(tokenizer)
    assert [stream.push(i) for i in ids][-1] == "" and stream.end().endswith("\ufffd")
    if text == "a ✓" and cut == 2:  # "Ġâ": the space came out only with the character's bytes
        assert stream.pieces == ["a", "", " \ufffd"]


def test_ids_past_the_tokenizer_come_out_as_ids(tmp_path):
    tokenizer = tiny_tokenizer_json(tmp_path, vocab_size=280)
    stream = TextStream(load_tokenizer(tmp_path))
    assert stream.push(tokenizer.get_vocab_size() + 5) == f"<{tokenizer.get_vocab_size() + 5}>"


def test_bad_tokenizer_input_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a tokenizers tokenizer.json") as error:
        load_tokenizer(tmp_path)
    assert "\n" not in str(error.value)
    tokenizer = tiny_tokenizer_json(tmp_path)
    with pytest.raises(CheckpointError, match="outside the model's vocab_size=10"):
        encode(tokenizer, "the megakernel", vocab_size=10)
    with pytest.raises(CheckpointError, match="non-empty string"):
        encode(tokenizer, "", vocab_size=2048)
