"""Arrival traces: which requests arrive when, how long their prompts are and how many tokens
they ask for. What `mkresearch bench --workload FILE|synthetic` replays.

Time is counted in decode steps: a request arriving at step s may join the batch before step s
runs (if a slot and its pages are free; else it waits). Two file formats, one request each:

    JSON   {"requests": [{"prompt_len": 5, "output_len": 8, "arrival": 0}, ...]}  (or the list)
    CSV    a header naming the columns, then one row per request:
               prompt_len,output_len,arrival
               5,8,0

Optional fields: `temperature` (absent or empty: greedy; else a number > 0, sampled with the
request's own counter seed) and `seed` (the sampling seed, a uint32: default the request's
index). A request's prompt tokens are drawn from its index and the trace's seed
(`prompt_tokens`): a trace is lengths and times, not text. A file is UTF-8 (a byte-order mark is
skipped). Bad input is a ValueError of one line naming the file, the request (or CSV line) and the
field and what is allowed, raised before anything runs.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FIELDS = ("prompt_len", "output_len", "arrival")
OPTIONAL_FIELDS = ("temperature", "seed")
SYNTHETIC = "synthetic"
SEED_LIMIT = 2**32  # a sampling seed is a uint32 counter (`sampling.counter_uniform`)


@dataclass(frozen=True)
class Request:
    """One request of a trace: `prompt_len` tokens of prompt, `output_len` tokens to generate (the
    first drawn after its prefill), arriving at decode step `arrival`; greedy when temperature is
    None, else sampled with counter seed `seed`."""

    index: int
    prompt_len: int
    output_len: int
    arrival: int
    temperature: float | None = None
    seed: int = 0

    @property
    def length(self) -> int:
        """Tokens its cache holds at most: the prompt and every generated token but the last."""
        return self.prompt_len + self.output_len - 1


def _int_field(where: str, name: str, value: Any, minimum: int, limit: int | None = None) -> int:
    """An int >= minimum (and < limit when given), or a string of one."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
            or value < minimum or (limit is not None and value >= limit)):
        allowed = f"an int >= {minimum}" if limit is None else f"an int in [{minimum}, {limit})"
        raise ValueError(f"{where}: {name}={value!r} is invalid: {allowed}")
    return int(value)


def _temperature_field(where: str, value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip() in ("", "none", "greedy")):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not (math.isfinite(number) and number > 0):
        raise ValueError(f"{where}: temperature={value!r} is invalid: absent/empty (greedy) or a "
                         "finite number > 0")
    return number


def make_request(index: int, fields: dict, where: str | None = None) -> Request:
    """A Request from one record of a trace (a dict of its fields), checked."""
    where = where or f"workload request {index}"
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: {fields!r} is invalid: an object with fields "  # noqa: TRY004
                         f"{', '.join(FIELDS)}")
    missing = [name for name in FIELDS if name not in fields]
    unknown = sorted(set(fields) - set(FIELDS) - set(OPTIONAL_FIELDS))
    if missing or unknown:
        what = f"lacks {', '.join(missing)}" if missing else f"has unknown {', '.join(unknown)}"
        raise ValueError(f"{where} {what}: fields {', '.join(FIELDS)} (and optional "
                         f"{', '.join(OPTIONAL_FIELDS)})")
    seed = fields.get("seed")
    return Request(index=index,
                   prompt_len=_int_field(where, "prompt_len", fields["prompt_len"], 1),
                   output_len=_int_field(where, "output_len", fields["output_len"], 1),
                   arrival=_int_field(where, "arrival", fields["arrival"], 0),
                   temperature=_temperature_field(where, fields.get("temperature")),
                   seed=index if seed in (None, "") else _int_field(where, "seed", seed, 0,
                                                                   SEED_LIMIT))


def _csv_records(text: str, name: str) -> list[dict]:
    """The rows of a CSV trace as dicts of the header's fields (empty optional values left out);
    a row with more or fewer values than the header is refused, naming its line."""
    lines = [(number, row) for number, row in enumerate(csv.reader(io.StringIO(text)), 1) if row]
    header = [field.strip() for field in lines[0][1]] if lines else []
    if len(lines) < 2 or any(field not in header for field in FIELDS):
        raise ValueError(f"{name} is invalid: CSV with a header naming {', '.join(FIELDS)} "
                         "and one row per request (or JSON)")
    records = []
    for number, row in lines[1:]:
        if len(row) != len(header):
            raise ValueError(f"{name} line {number} is invalid: {len(row)} values, the header "
                             f"names {len(header)} ({', '.join(header)})")
        records.append({key: value for key, value in zip(header, row, strict=True)
                        if value.strip() or key in FIELDS})
    return records


def parse_trace(text: str, name: str = "workload") -> list[Request]:
    """Requests from the text of a JSON or CSV trace (JSON when it starts with { or [)."""
    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark (a spreadsheet's export)
    if text.lstrip()[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error.msg} at line {error.lineno}"
                             ) from None
        records = data.get("requests") if isinstance(data, dict) else data
        if not isinstance(records, list):
            raise ValueError(f"{name} is invalid: a JSON list of requests or "
                             '{"requests": [...]}')
    else:
        records = _csv_records(text, name)
    if not records:
        raise ValueError(f"{name} holds no request: at least one")
    return [make_request(i, record, f"{name} request {i}") for i, record in enumerate(records)]


def read_trace(path: str | Path) -> list[Request]:
    """Requests from a trace file (JSON or CSV, UTF-8, see the module docstring)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"workload {str(path)!r} cannot be read: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"workload {str(path)!r} is not UTF-8 text: byte {error.start} is "
                         f"{data[error.start]:#04x} (a trace is JSON or CSV in UTF-8)") from None
    return parse_trace(text, name=f"workload {path.name!r}")


def synthetic_trace(seed: int = 0, n_requests: int = 8, *, prompt_lens: tuple[int, int] = (2, 24),
                    output_lens: tuple[int, int] = (2, 16), mean_gap: float = 2.0,
                    sampled_every: int = 0) -> list[Request]:
    """A trace drawn from `seed`: lengths uniform in the inclusive ranges, arrivals a Poisson
    process of `mean_gap` steps between requests (the first at step 0); every `sampled_every`-th
    request sampled at temperature 1 (0: all greedy)."""
    if isinstance(n_requests, bool) or not isinstance(n_requests, int) or n_requests < 1:
        raise ValueError(f"n_requests={n_requests!r} is invalid: an int >= 1")
    for name, (low, high) in (("prompt_lens", prompt_lens), ("output_lens", output_lens)):
        if not 1 <= low <= high:
            raise ValueError(f"{name}={(low, high)!r} is invalid: 1 <= low <= high")
    rng = np.random.default_rng(seed)
    gaps = np.concatenate([[0], rng.poisson(mean_gap, n_requests - 1)])
    arrivals = np.cumsum(gaps)
    return [Request(index=i, prompt_len=int(rng.integers(prompt_lens[0], prompt_lens[1] + 1)),
                    output_len=int(rng.integers(output_lens[0], output_lens[1] + 1)),
                    arrival=int(arrivals[i]),
                    temperature=1.0 if sampled_every and i % sampled_every == 0 else None,
                    seed=i)
            for i in range(n_requests)]


def load_trace(source: str | Path, seed: int = 0) -> list[Request]:
    """`synthetic` (a trace from `seed`, `synthetic_trace`) or a trace file's requests."""
    return synthetic_trace(seed) if str(source) == SYNTHETIC else read_trace(source)


def check_fits(requests: list[Request], max_seq_len: int, limits: dict[str, int]) -> None:
    """ValueError naming the first request that could never run: its positions past the model's
    max_seq_len (prompt_len + output_len, as `decode` counts --prompt-len + --steps), or its
    cache (`Request.length`: the prompt and every generated token but the last) past one of
    `limits` (what holds it -> tokens, e.g. one row's page table and the whole pool)."""
    for request in requests:
        positions = request.prompt_len + request.output_len
        if positions > max_seq_len:
            raise ValueError(f"workload request {request.index}: prompt_len + output_len = "
                             f"{positions} exceeds max_seq_len={max_seq_len} of the model")
        for what, tokens in limits.items():
            if request.length > tokens:
                raise ValueError(f"workload request {request.index}: its cache of prompt_len + "
                                 f"output_len - 1 = {request.length} tokens exceeds {what}: "
                                 f"{tokens} tokens")


def prompt_tokens(request: Request, vocab_size: int, trace_seed: int = 0) -> np.ndarray:
    """[prompt_len] i32: the request's prompt, drawn from its index and the trace's seed."""
    rng = np.random.default_rng((trace_seed, request.index))
    return rng.integers(0, vocab_size, request.prompt_len).astype(np.int32)
