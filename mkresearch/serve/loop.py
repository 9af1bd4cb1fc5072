"""Continuous batching: rows join a running batch between decode steps and leave it when done.

    result = serve(params, requests, cfg, pages, batch=4)             # the reference paged step
    result = serve(..., step="megakernel")                           # the paged megakernel

Before each step, the waiting requests that have arrived join in arrival order, each when a slot
is empty and the pool has the pages of its whole cache (`PageAllocator`; a request that does not
fit waits, and so do the ones behind it). A joining request is prefilled alone
(`mkresearch.model.prefill`, one jitted call per chunk of its prompt, into a contiguous cache of
one page table's length), its cache is written into its pages (`paged_kv.scatter_cache`) and its
KDA state into its slot (replacing the slot's last request's whole), and its first token is drawn
from the prefill's last logits. Then one paged decode step runs every slot (an empty slot at
position -1: it reads and writes no page), rows of any length together; each row draws its next
token; a row leaves after `output_len` tokens or on `eos`, and its slot and pages are free for
the next request before the next step.

Batch invariance: a row's tokens are the same bits whether it decodes alone or joins a running
batch at any step, in any slot, on any pages. The steps are batch-invariant (tests/
test_batch_invariance.py), the prefill sees the row alone, and each row draws its tokens with
`sampling.sample` on its own logits with its request's seed and its own positions: the counter
of a row's draw is (request seed, 0, position), never the slot it happens to hold.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from mkresearch.kernels.compose import megakernel_paged
from mkresearch.model import paged_kv, prefill, reference, sampling, spec
from mkresearch.model.config import ModelConfig
from mkresearch.serve import trace
from mkresearch.serve.pages import PageAllocator
from mkresearch.serve.slots import EMPTY, SlotManager

# Prompt tokens per jitted prefill call: 1 makes one compiled call serve every prompt length (a
# longer chunk compiles once more for each new remainder of a prompt's length, ~10-30 s each here).
PREFILL_CHUNK = 1
POISON = 64.0  # what a finished row's pages are filled with (poison_freed): far off any entry


@dataclass
class StepRecord:
    """One decode step: who held each slot, how long each row's cache was after the step, who
    owned each page, who joined before it and who left after it, and its seconds here."""

    step: int
    slots: list[int]  # [B] request index per slot, -1 empty
    lengths: list[int]  # [B] tokens cached per slot after the step (0 empty)
    page_owner: list[int]  # [n_pages] request index per page, -1 free
    joined: list[int]
    left: list[int]
    seconds: float

    @property
    def occupied(self) -> int:
        return sum(request != EMPTY for request in self.slots)


@dataclass
class ServeResult:
    """What `serve` did: each request's tokens and where and when it ran, and every step."""

    batch: int
    pages: paged_kv.PagedKVConfig
    tokens: dict[int, list[int]] = field(default_factory=dict)  # request -> generated tokens
    slot_of: dict[int, int] = field(default_factory=dict)
    pages_of: dict[int, list[int]] = field(default_factory=dict)
    joined_at: dict[int, int] = field(default_factory=dict)  # the step before which it joined
    left_at: dict[int, int] = field(default_factory=dict)  # the step after which it left
    steps: list[StepRecord] = field(default_factory=list)
    prefill_seconds: float = 0.0

    @property
    def step_seconds(self) -> float:
        return sum(record.seconds for record in self.steps)

    @property
    def generated(self) -> int:
        return sum(len(tokens) for tokens in self.tokens.values())


def reference_step(params, state, tokens, positions, page_table, cfg, pages):
    """The reference paged step (`paged_kv.paged_decode_step`) -> (logits [B, V] f32, state)."""
    logits, state, _ = paged_kv.paged_decode_step(params, state, tokens, positions, page_table,
                                                  cfg, pages)
    return logits, state


def megakernel_step(params, state, tokens, positions, page_table, cfg, pages):
    """The paged megakernel (`megakernel_paged.paged_decode_step`, one pallas_call) -> (logits
    [B, V] f32, state): its logits, so each row draws with its own seed as on the reference."""
    _, state, aux = megakernel_paged.paged_decode_step(params, state, tokens, positions,
                                                       page_table, cfg, pages, return_logits=True)
    return aux["logits"], state


STEPS: dict[str, Callable] = {"reference": reference_step, "megakernel": megakernel_step}


def _step_function(step: str | Callable) -> Callable:
    if callable(step):
        return step
    if step not in STEPS:
        raise ValueError(f"step={step!r} is invalid: one of {', '.join(STEPS)} or a function "
                         "(params, state, tokens, positions, page_table, cfg, pages) -> "
                         "(logits, state)")
    return STEPS[step]


def draw(logits_row: Any, request: trace.Request, position: int) -> int:
    """The token a request draws from its logits [V] for `position`: greedy, or sampled with its
    own seed and position (one-row call: the counter's row is 0 wherever the request sits)."""
    if request.temperature is None:
        return int(np.argmax(np.asarray(logits_row)))  # the first index among ties, as sample
    token = sampling.sample(logits_row[None], seed=request.seed,
                            positions=np.asarray([position], np.int32),
                            temperature=request.temperature)
    return int(token[0])


def prefill_row(params: dict, request: trace.Request, cfg: ModelConfig,
                pages: paged_kv.PagedKVConfig, trace_seed: int = 0,
                chunk: int = PREFILL_CHUNK) -> tuple[jax.Array, dict]:
    """A request's prompt prefilled alone into a contiguous state of one page table's length ->
    (logits [V] after its last prompt token, the one-row state)."""
    prompt = trace.prompt_tokens(request, cfg.vocab_size, trace_seed)
    state = reference.init_state(cfg, 1, pages.max_context)
    logits, state = prefill.prefill(params, state, prompt[None], cfg, chunk=chunk)
    return logits[0, -1], state


def poison_pages(state: dict, page_ids: list[int], cfg: ModelConfig) -> dict:
    """The paged state with every cache leaf's pages `page_ids` set to POISON (a freed page's old
    values made loud: a row that read a page it had not written would see them)."""
    table = spec.state_table(cfg, 1, 1)
    ids = np.asarray(page_ids, np.int64)
    return {kind: {name: (leaf.at[:, ids].set(POISON) if table[kind][name].kind == spec.CACHE
                          else leaf) for name, leaf in leaves.items()}
            for kind, leaves in state.items()}


def check_requests(requests: Any, pages: paged_kv.PagedKVConfig,
                   cfg: ModelConfig) -> list[trace.Request]:
    """The requests, checked: a non-empty list of trace.Request with distinct indices, each one's
    positions within cfg.max_seq_len and its cache within a page table and within the pool."""
    if not isinstance(requests, (list, tuple)) or not requests or not all(
            isinstance(r, trace.Request) for r in requests):
        raise ValueError("requests is invalid: a non-empty list of serve.trace.Request")
    if len({r.index for r in requests}) != len(requests):
        raise ValueError("requests is invalid: every Request.index distinct")
    trace.check_fits(list(requests), cfg.max_seq_len, {
        f"one row's page table ({pages.max_pages_per_row} pages of {pages.page_size})":
            pages.max_context,
        f"the pool ({pages.n_pages} pages of {pages.page_size})": pages.n_pages * pages.page_size})
    return list(requests)


def serve(params: dict, requests: list[trace.Request], cfg: ModelConfig,
          pages: paged_kv.PagedKVConfig, *, batch: int, step: str | Callable = "reference",
          eos: int | None = None, trace_seed: int = 0, chunk: int = PREFILL_CHUNK,
          poison_freed: bool = False, progress: bool = False,
          on_step: Callable[[StepRecord], None] | None = None) -> ServeResult:
    """Serve `requests` with B = `batch` slots over the pool `pages` (see the module docstring);
    step "reference" (`paged_kv.paged_decode_step`) or "megakernel" (the paged megakernel), or a
    function of the same contract. Returns every request's tokens and a StepRecord per step
    (each also passed to `on_step` as soon as its step ran). A request done at its prefill
    (output_len 1, or eos first) is in both the joined and the left list of the step it joined
    before, when one runs then (`joined_at` / `left_at` hold it either way)."""
    if not isinstance(pages, paged_kv.PagedKVConfig):
        raise ValueError(f"pages={pages!r} is invalid: a paged_kv.PagedKVConfig")  # noqa: TRY004
    pages.check(cfg)
    requests = check_requests(requests, pages, cfg)
    run_step = _step_function(step)
    server = _Server(params, requests, cfg, pages, SlotManager(batch), eos=eos,
                     trace_seed=trace_seed, chunk=chunk, poison_freed=poison_freed)
    bar = tqdm(total=sum(r.output_len for r in requests), desc=f"{cfg.name} serve",
               unit="token", disable=not progress, leave=False)
    while server.waiting or server.slots.occupied:
        joined, done_at_prefill = server.admit(bar)
        if not server.slots.occupied:  # idle: the clock jumps to the next arrival
            if server.waiting:
                server.now = max(server.now + 1, server.waiting[0].arrival)
            continue
        record = server.step(run_step, joined, done_at_prefill, bar)
        if on_step is not None:
            on_step(record)
        server.now += 1
    bar.close()
    return server.result


class _Server:
    """`serve`'s running state: the slots, the page pool, the paged state, each row's page table,
    position and last token ([B] arrays), the waiting requests, the clock and the result."""

    def __init__(self, params: dict, requests: list[trace.Request], cfg: ModelConfig,
                 pages: paged_kv.PagedKVConfig, slots: SlotManager, *, eos: int | None,
                 trace_seed: int, chunk: int, poison_freed: bool) -> None:
        self.params, self.cfg, self.pages, self.slots = params, cfg, pages, slots
        self.eos, self.trace_seed, self.chunk = eos, trace_seed, chunk
        self.poison_freed = poison_freed
        self.allocator = PageAllocator(pages.n_pages, pages.page_size)
        self.state = paged_kv.init_paged_state(cfg, pages, slots.batch)
        self.table = np.full((slots.batch, pages.max_pages_per_row), -1, np.int32)  # [B, M]
        self.positions = np.full(slots.batch, -1, np.int32)  # [B] the slot of each next entry
        self.tokens = np.zeros(slots.batch, np.int32)  # [B] each row's last token, fed next
        self.by_index = {r.index: r for r in requests}
        self.waiting = deque(sorted(requests, key=lambda r: (r.arrival, r.index)))
        self.result = ServeResult(batch=slots.batch, pages=pages)
        self.now = 0

    def leave(self, request: int, slot: int | None) -> None:
        """Free the request's pages (poisoned if asked) and its slot, if it holds one."""
        freed = self.allocator.free(request)
        if self.poison_freed and freed:
            self.state = poison_pages(self.state, freed, self.cfg)
        self.result.left_at[request] = self.now
        if slot is not None:
            self.slots.release(slot)
            self.table[slot], self.positions[slot], self.tokens[slot] = -1, -1, 0

    def admit(self, bar: tqdm) -> tuple[list[int], list[int]]:
        """The arrived requests that fit join in arrival order, each prefilled into a free slot:
        (the requests that joined, those of them done at their prefill)."""
        joined, done_at_prefill = [], []
        while self.waiting and self.waiting[0].arrival <= self.now \
                and self.slots.free_slot() is not None:
            request = self.waiting[0]
            got = self.allocator.allocate(request.index, request.length)
            if got is None:  # the pool is full: it waits, and the ones behind it
                break
            self.waiting.popleft()
            slot = self.slots.free_slot()
            first = self.prefill(request, slot, got)
            joined.append(request.index)
            bar.update()
            if request.output_len == 1 or first == self.eos:  # done at its prefill: no step
                self.table[slot] = -1
                self.leave(request.index, None)
                done_at_prefill.append(request.index)
                continue
            self.slots.take(slot, request.index)
            self.positions[slot], self.tokens[slot] = request.prompt_len, first
        return joined, done_at_prefill

    def prefill(self, request: trace.Request, slot: int, got: list[int]) -> int:
        """The request's prompt prefilled alone and written into its pages and slot: its first
        token, drawn from the prefill's last logits."""
        result, started = self.result, time.perf_counter()
        last_logits, row_state = prefill_row(self.params, request, self.cfg, self.pages,
                                             self.trace_seed, self.chunk)
        self.table[slot, :len(got)] = got
        self.state = paged_kv.insert_row(self.state, row_state, slot, self.table[slot].copy(),
                                         request.prompt_len, self.cfg, self.pages)
        first = draw(last_logits, request, request.prompt_len)
        jax.block_until_ready(self.state)
        result.prefill_seconds += time.perf_counter() - started
        result.tokens[request.index] = [first]
        result.slot_of[request.index], result.pages_of[request.index] = slot, got
        result.joined_at[request.index] = self.now
        return first

    def step(self, run_step: Callable, joined: list[int], done_at_prefill: list[int],
             bar: tqdm) -> StepRecord:
        """One paged decode step over every slot, each row's next token drawn, the rows done
        leaving: its StepRecord, appended to the result."""
        started = time.perf_counter()
        # copies: the arrays below change after the step, and a step may read its inputs late
        logits, self.state = run_step(self.params, self.state, self.tokens.copy(),
                                      self.positions.copy(), self.table.copy(), self.cfg,
                                      self.pages)
        logits = np.asarray(logits)  # [B, V]
        seconds = time.perf_counter() - started
        held, owner = [int(r) for r in self.slots.requests], [int(o) for o in self.allocator.owner]
        left = list(done_at_prefill)
        lengths = [int(n) for n in np.maximum(self.positions + 1, 0)]
        for slot in self.slots.active():
            request = self.by_index[int(self.slots.requests[slot])]
            token = draw(logits[slot], request, int(self.positions[slot]) + 1)
            self.result.tokens[request.index].append(token)
            bar.update()
            self.positions[slot] += 1
            self.tokens[slot] = token
            if len(self.result.tokens[request.index]) == request.output_len or token == self.eos:
                left.append(request.index)
                self.leave(request.index, slot)
        self.result.steps.append(StepRecord(step=self.now, slots=held, lengths=lengths,
                                            page_owner=owner, joined=joined, left=left,
                                            seconds=seconds))
        return self.result.steps[-1]
