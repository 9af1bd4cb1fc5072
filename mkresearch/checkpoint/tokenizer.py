"""Text in, text out: a checkpoint's `tokenizer.json` through Hugging Face's `tokenizers` package.

    load_tokenizer(dir) -> Tokenizer          DIR/tokenizer.json (CheckpointError: one line)
    encode(tokenizer, text, vocab_size) -> [ids]   the prompt's ids, each checked < vocab_size
    TextStream(tokenizer, prompt_ids).push(id) -> text   the text a new token adds, as it
                                                         arrives (multi-byte characters split
                                                         over tokens come out whole, later)
    stream.end() -> text                     what is still held back when the tokens end (a
                                             character left incomplete: the replacement
                                             characters transformers prints)

Nothing touches the network: the file is read from disk (`Tokenizer.from_file`). The
`tokenizers` package is the `checkpoints` extra (`pip install "mkresearch[checkpoints]"`): without
it, load_tokenizer raises a CheckpointError naming the extra, and nothing else here needs it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mkresearch.model.hf_config import CheckpointError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
MISSING = ("a checkpoint's tokenizer.json needs the `tokenizers` package, the `checkpoints` extra: "
           'pip install "mkresearch[checkpoints]"')


def _tokenizers():
    """The `tokenizers` package, or a one-line CheckpointError naming the extra that brings it."""
    try:
        import tokenizers  # the checkpoints extra: imported only where a tokenizer is read
        import tokenizers.decoders
    except ModuleNotFoundError:
        raise CheckpointError(MISSING) from None
    return tokenizers


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a checkpoint directory (its tokenizer.json); CheckpointError naming the
    file when it is missing or not a tokenizer."""
    tokenizers = _tokenizers()
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no {TOKENIZER_FILE} in the checkpoint directory (the "
                              "tokenizer is needed for --prompt text)")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 - the Rust side raises a bare Exception
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{path}: not a tokenizers tokenizer.json ({first})") from None


def encode(tokenizer: Tokenizer, text: str, vocab_size: int) -> list[int]:
    """The ids of `text` (with the tokenizer's own special tokens, e.g. a BOS), each checked
    against the model's vocabulary; CheckpointError when empty or out of range."""
    if not isinstance(text, str) or not text:
        raise CheckpointError(f"prompt={text!r} is invalid: a non-empty string")
    ids = tokenizer.encode(text).ids
    if not ids:
        raise CheckpointError(f"prompt={text!r} encodes to no tokens")
    if max(ids) >= vocab_size:
        raise CheckpointError(f"{TOKENIZER_FILE}: token id {max(ids)} of the prompt is outside "
                              f"the model's vocab_size={vocab_size}")
    return ids


class TextStream:
    """Detokenises generated ids one at a time: `push(id)` returns the text the id adds ("" while
    a character split over several tokens is incomplete); `end()`, after the last id, the text
    still held back. The prompt's ids give the context (a leading space, a word piece's joiner).
    An id the tokenizer does not know (a model vocabulary padded past the tokenizer's) comes out
    as `<id>`."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.known = tokenizer.get_vocab_size(with_added_tokens=True)
        self.prompt_ids = [int(i) for i in prompt_ids]
        self._stream = _tokenizers().decoders.DecodeStream(ids=self.prompt_ids or None,
                                                            skip_special_tokens=False)
        self._fed = list(self.prompt_ids)  # every id the DecodeStream has seen
        self._held = 0  # how many of the last of them it holds back (an incomplete character)
        self.ids: list[int] = []
        self.pieces: list[str] = []

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self.ids.append(token_id)
        if token_id >= self.known:
            piece = f"<{token_id}>"
        else:
            piece = self._stream.step(self.tokenizer, token_id) or ""
            self._fed.append(token_id)
            self._held = 0 if piece else self._held + 1
        self.pieces.append(piece)
        return piece

    def end(self) -> str:
        """The text of the ids held back at the end (a multi-byte character the tokens stop
        inside, and anything before it in the same tokens): as the tokenizer decodes the whole
        sequence, i.e. with U+FFFD replacement characters, which is what transformers prints
        (`TextStreamer.end`). "" when nothing is held; call once, after the last push."""
        if not self._held:
            return ""
        before = self.tokenizer.decode(self._fed[:-self._held], skip_special_tokens=False)
        whole = self.tokenizer.decode(self._fed, skip_special_tokens=False)
        piece = whole[len(before):] if whole.startswith(before) else self.tokenizer.decode(
            self._fed[-self._held:], skip_special_tokens=False)
        self._held = 0
        self.pieces.append(piece)
        return piece

    def text(self) -> str:
        """Everything pushed so far (and `end()`'s text once called): the pieces, joined."""
        return "".join(self.pieces)
