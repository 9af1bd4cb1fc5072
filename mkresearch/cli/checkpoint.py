"""`mkresearch decode --checkpoint DIR --prompt "..." --steps N`: a published checkpoint from disk
to text. Its config.json and weights through `mkresearch.checkpoint`, the prompt through its
tokenizer.json (`mkresearch.checkpoint.tokenizer`), one jitted prefill call per chunk (`mkresearch.model.prefill`),
then greedy decoding with the megakernel (or the reference, `--backend reference`), each token's
text printed as it is decoded. Bad input (a missing file, a bad tensor, an unknown model type,
a prompt the vocabulary cannot hold) is one line and exit status 2.

With `--ranks N` or `--speculate K` the checkpoint's weights and tokenized prompt go through the
same runs as a random model's (`cli.ranks.decode_sharded`: the weights onto the ranks by
`mkresearch.sharding.layout`, the prompt stepped through the sharded megakernel, each step checked
against the single device and the reference; `cli.speculative.decode`: verify steps of K drafts,
checked lossless against plain greedy decoding), and the text of the tokens is printed after
their report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mkresearch.checkpoint.loader import CheckpointError, load_params, read_config
from mkresearch.checkpoint.rank_loader import load_rank_params
from mkresearch.checkpoint.tokenizer import TextStream, encode, load_tokenizer
from mkresearch.cli import ranks as cli_ranks
from mkresearch.cli import speculative as cli_speculative
from mkresearch.cli.common import UsageError, at_least, refusals
from mkresearch.kernels.compose import megakernel
from mkresearch.model import kv_cache, prefill, reference


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="a checkpoint directory (config.json, safetensors, tokenizer.json): "
                             "decode --prompt text with its weights instead of a random model")
    parser.add_argument("--prompt", default=None, metavar="TEXT",
                        help="with --checkpoint: the prompt text (tokenized by its "
                             "tokenizer.json); the generated text is printed as it is decoded")


def check(args: argparse.Namespace) -> None:
    """One-line refusals of option combinations, before anything is read."""
    if args.checkpoint is None:
        if args.prompt is not None:
            raise UsageError("--prompt TEXT needs --checkpoint DIR (the tokenizer and weights)")
        return
    if args.prompt is None:
        raise UsageError("--checkpoint needs --prompt TEXT (the text to continue)")
    if args.prompt_len is not None:
        raise UsageError(f"--prompt-len {args.prompt_len} is invalid with --checkpoint: the "
                         "prompt is --prompt's tokens")
    at_least("--steps", args.steps, 1)
    if args.batch != 1:
        raise UsageError(f"--batch {args.batch} is invalid with --checkpoint: one prompt, 1 row")
    at_least("--ranks", args.ranks, 1)
    if args.ranks != 1 and args.speculate is not None:
        raise UsageError("--speculate runs on one device: --ranks 1")


@dataclass(frozen=True)
class Loaded:
    """What --ranks and --speculate take from a checkpoint: `params()` reads the weights (in the
    process that decodes: a --ranks child), `rank_params(lay, ranks)` only the slices of those
    ranks (`rank_loader.RankLoad`: a process of a multi-process run, the sharded reference),
    `prompt` [1, T] int32, `text(ids)` the ids' text."""

    params: Callable[[], dict]
    prompt: Any
    text: Callable[[Sequence[int]], str]
    rank_params: Callable[[Any, tuple], Any] | None = None


@contextlib.contextmanager
def _checkpoint_errors() -> Iterator[None]:
    """CheckpointError (and a library ValueError) -> one line, exit status 2."""
    try:
        with refusals():
            yield
    except CheckpointError as error:
        raise UsageError(str(error).splitlines()[0]) from None


def run_decode(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Load, prefill, decode; stream the text to stdout (or one JSON object with --json)."""
    backend = args.backend or "megakernel"
    if backend not in ("megakernel", "reference"):
        raise UsageError(f"--backend {backend!r} is unknown: choose one of megakernel, reference")
    progress = not args.json and sys.stderr.isatty()
    cfg, tokenizer, prompt_ids = _read_checkpoint(args)
    if args.ranks > 1 or args.speculate is not None:
        return _run_on_ranks_or_speculative(args, argv, cfg, tokenizer, prompt_ids, progress)
    with _checkpoint_errors():
        options = megakernel.MegakernelOptions(chip=args.chip)
        if backend == "megakernel":  # refuses (VMEM plan, HBM) before any weight is read
            megakernel.make_plan(cfg, 1, cfg.max_seq_len, options)
        params, state, token, seconds = _load_and_prefill(args, cfg, prompt_ids, progress)
    stream = TextStream(tokenizer, prompt_ids)
    write = (lambda text: None) if args.json else (
        lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    write(args.prompt)
    write(stream.push(token))
    prepared = megakernel.prepare_weights(params, cfg) if backend == "megakernel" else None
    started = time.perf_counter()
    with _checkpoint_errors():
        generated = _decode_greedy(params, prepared, state, token, len(prompt_ids), args.steps,
                                   cfg, options, lambda new: write(stream.push(new)))
    write(stream.end())  # a character the tokens stop inside: its replacement characters
    seconds["decode"] = time.perf_counter() - started
    result = _result(cfg, backend, args, prompt_ids, generated, stream, seconds)
    if args.json:
        print(json.dumps(result))
    else:
        write("\n")
        _print_times(cfg, backend, args.steps, len(prompt_ids), seconds)
    return 0


def _read_checkpoint(args: argparse.Namespace) -> tuple[Any, Any, list[int]]:
    """(the checkpoint's config with a cache of the run's length, its tokenizer, the prompt's
    ids); a prompt + --steps (+ a verify step's drafts) past its max_seq_len is a UsageError."""
    with _checkpoint_errors():
        cfg = read_config(args.checkpoint)
        tokenizer = load_tokenizer(args.checkpoint)
        prompt_ids = encode(tokenizer, args.prompt, cfg.vocab_size)
        # a verify step of K drafts caches K - 1 tokens past the last one kept
        drafts = f" - 1 + --speculate {args.speculate}" if args.speculate else ""
        length = len(prompt_ids) + args.steps + (args.speculate - 1 if args.speculate else 0)
        if length > cfg.max_seq_len:
            raise UsageError(f"the prompt's {len(prompt_ids)} tokens + --steps {args.steps}"
                             f"{drafts} = {length} exceed max_seq_len={cfg.max_seq_len} of the "
                             "checkpoint")
        return cfg.replace(max_seq_len=kv_cache.cache_length(cfg, length)), tokenizer, prompt_ids


def _load_and_prefill(args: argparse.Namespace, cfg: Any, prompt_ids: list[int],
                      progress: bool) -> tuple[dict, dict, int, dict]:
    """The weights read and the prompt prefilled by the reference: (params, state, the first
    greedy token, {"load": seconds, "prefill": seconds})."""
    import numpy as np

    started = time.perf_counter()
    params = load_params(args.checkpoint, cfg, progress=progress)
    load_seconds = time.perf_counter() - started
    state = reference.init_state(cfg, 1, cfg.max_seq_len)
    started = time.perf_counter()
    logits, state = prefill.prefill(params, state, np.asarray([prompt_ids]), cfg,
                                    progress=progress)
    token = int(np.asarray(logits[0, -1]).argmax())
    return params, state, token, {"load": load_seconds,
                                  "prefill": time.perf_counter() - started}


def _decode_greedy(params: dict, prepared: Any, state: dict, token: int, prompt_len: int,
                   steps: int, cfg: Any, options: Any, emit: Callable[[int], None]) -> list[int]:
    """`steps` greedy tokens from the first one (after the prompt), each after it on the
    megakernel (`prepared` weights) or else the reference, each passed to `emit` as it comes."""
    import jax
    import numpy as np

    generated = [token]
    for i in range(steps - 1):
        tokens, positions = np.asarray([token], np.int32), np.asarray([prompt_len + i], np.int32)
        if prepared is not None:
            next_token, state, _ = megakernel.decode_step(prepared, state, tokens, positions, cfg,
                                                          options=options)
        else:
            step_logits, state, _ = reference.decode_step(params, state, tokens, positions, cfg)
            next_token = np.asarray(step_logits).argmax(-1)
        token = int(np.asarray(next_token)[0])
        generated.append(token)
        emit(token)
    jax.block_until_ready(state)
    return generated


def _print_times(cfg: Any, backend: str, steps: int, prompt_len: int, seconds: dict) -> None:
    """The run's times, to stderr (stdout holds the text alone)."""
    import jax

    print(f"{cfg.name}, backend {backend} on {jax.default_backend()}: prompt "
          f"{prompt_len} tokens prefilled in {seconds['prefill']:.2f} s (one call per "
          f"{prefill.DEFAULT_CHUNK}-token chunk, compile included), {steps} greedy tokens "
          f"in {seconds['decode']:.2f} s; weights loaded in {seconds['load']:.2f} s",
          file=sys.stderr)


def _run_on_ranks_or_speculative(args: argparse.Namespace, argv: Sequence[str], cfg: Any,
                                 tokenizer: Any, prompt_ids: list[int], progress: bool) -> int:
    """--ranks N or --speculate K with the checkpoint's weights and prompt (module docstring)."""
    import numpy as np

    def text(ids: Sequence[int]) -> str:
        stream = TextStream(tokenizer, prompt_ids)
        return args.prompt + "".join(stream.push(i) for i in ids) + stream.end()

    loaded = Loaded(lambda: load_params(args.checkpoint, cfg, progress=progress),
                    np.asarray([prompt_ids], np.int32), text,
                    lambda lay, ranks: load_rank_params(args.checkpoint, lay, ranks,
                                                        progress=progress))
    args.prompt_len = len(prompt_ids)  # what the random-prompt runs check their lengths by
    with _checkpoint_errors():
        if args.speculate is not None:
            return cli_speculative.run_decode(args, cfg, loaded)
        args.backend = args.backend or "megakernel"
        cli_ranks.check_ranks(cfg, args.ranks, args.backend, getattr(args, "etp", None),
                              getattr(args, "collectives", None))
        cli_ranks.design_options(cfg, args)
        return cli_ranks.run_decode(args, cfg, argv, progress, loaded)


def _result(cfg: Any, backend: str, args: argparse.Namespace, prompt_ids: list[int],
            generated: list[int], stream: TextStream, seconds: dict) -> dict:
    return {"model": cfg.name, "backend": backend, "checkpoint": str(args.checkpoint),
            "prompt": args.prompt, "prompt_ids": prompt_ids, "generated": generated,
            "text": stream.text(), "steps": args.steps, "seconds": seconds}
