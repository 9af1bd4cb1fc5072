"""A stage's weight stream on one rank of the sharded megakernel: the collectives each streamed
matrix needs around it (`collectives.Rule`), so that a stage body sees whole f32 products, as on
one device."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from mkresearch.kernels.base import blocks
from mkresearch.kernels.sharded.plan import carries


def fused_name(names: list[str] | tuple[str, ...]) -> str:
    """The DMA-log name of one all-gather carrying the column chunks of several matrices."""
    return "+".join(names)


class ShardedStream:
    """A stage's weight stream on one rank: a matrix whose input arrives split across ranks gets
    it gathered first; one split by its output columns gives its column chunk, then the chunks
    are gathered (`collectives.ShardPlan.rules`). The body sees whole f32 products, as on one
    device."""

    def __init__(self, inner: Any, collectives: Any) -> None:  # collectives.Collectives
        self.inner, self.collectives = inner, collectives

    def hold_after(self, name: str) -> None:
        blocks.hold_after(self.inner, name)

    def release_held(self) -> None:
        blocks.release_held(self.inner)

    def matmuls(self, x: Any, parts: tuple, **indices: Any) -> list:
        """x [B, K] times each (w_hbm [K, N], rows, name) of `parts` in order -> [each whole output
        [B, N] f32]: as `matmul` each, except that the column chunks of a matrix that joins a
        later part's gather (`Rule.joins`: the same input x) travel in that part's messages,
        one all-gather for both, started as soon as the last chunk is computed."""
        coll, outs, chunks = self.collectives, [], []
        for w_hbm, rows, name in parts:
            rule = coll.plan.rule(name)
            joined = [] if rule is None else [r for r in coll.plan.rules if r.joins == name]
            if rule is None or (rule.joins is None and not joined):
                outs.append(self.matmul(x, w_hbm, rows=rows, name=name, **indices))
                continue
            rows = blocks.weight_block_rows(tuple(w_hbm.shape), w_hbm.dtype)  # this rank's
            chunks.append((rule, self.inner.matmul(x, w_hbm, rows=rows, name=name, **indices)))
            outs.append(None)
            if rule.joins is not None:
                continue
            if [r.name for r, _ in chunks[:-1]] != [r.name for r in joined]:
                raise ValueError(f"{name}'s gather carries the column chunks of "
                                 f"{[r.name for r in joined]}: they come before it in `parts`")
            message = jnp.concatenate([c for _, c in chunks], axis=1)  # [B, Σ chunk widths]
            everyone = coll.all_gather(message, name=fused_name([r.name for r, _ in chunks]))
            wholes = iter(coll.unpack(everyone, [(r, c.shape[1]) for r, c in chunks], 0))
            outs = [next(wholes) if out is None else out for out in outs]
            chunks = []
        if chunks:
            raise ValueError(f"the column chunks of {[r.name for r, _ in chunks]} join a "
                             "gather that `parts` does not reach")
        return outs

    def matmul(self, x: Any, w_hbm: Any, *, rows: int, name: str, **indices: Any) -> Any:
        rule = self.collectives.plan.rule(name)
        if rule is not None and rule.joins is not None:
            raise ValueError(f"{name}'s column chunks join the gather of {rule.joins}: stream "
                             "both through `ShardedStream.matmuls`")
        if rule is None:
            return self.inner.matmul(x, w_hbm, rows=rows, name=name, **indices)
        if rule.reduce is not None:  # this rank's rows: a partial sum, reduced
            rows = blocks.weight_block_rows(tuple(w_hbm.shape), w_hbm.dtype)
            out = self.inner.matmul(x, w_hbm, rows=rows, name=name, **indices)
            coll = self.collectives
            if rule.beside or carries(coll.plan.rules, name):
                return out  # reduced at the stage's end with its riders (`Collectives.settle`)
            return coll.reduce(out, coll.layout.slice_firsts(rule.reduce), name=f"{name}/sum")[0]
        if rule.gather is not None:
            x = self.collectives.gather(x, rule.gather, rule.k, name=f"{name}/input")
        rows = blocks.weight_block_rows(tuple(w_hbm.shape), w_hbm.dtype)  # this rank's [K, N]
        out = self.inner.matmul(x, w_hbm, rows=rows, name=name, **indices)
        if rule.out is not None and rule.rides is not None:  # gathered with a later reduction
            return out  # this rank's column chunk (`Collectives.settle`)
        if rule.out is not None:
            out = self.collectives.gather(out, rule.out, rule.n, name=name)
        return out
