"""`python -m mkresearch.checkpoint DIR`: check a checkpoint directory without reading a weight
(`check_checkpoint`): its config in one line and exit 0, or the one-line error and exit 1."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mkresearch.checkpoint.hf_config import CheckpointError
from mkresearch.checkpoint.loader import check_checkpoint


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m mkresearch.checkpoint CHECKPOINT_DIR", file=sys.stderr)
        return 2
    try:
        cfg = check_checkpoint(args[0])
    except CheckpointError as error:
        print(f"mkresearch.checkpoint: {error}", file=sys.stderr)
        return 1
    print(f"ok: {cfg.name}: {cfg.n_layers} layers, d {cfg.d_model}, {cfg.attention} + {cfg.ffn}, "
          f"{cfg.n_experts} experts (top-{cfg.top_k}), vocab {cfg.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
