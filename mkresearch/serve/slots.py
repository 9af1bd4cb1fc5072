"""The slots of a running batch: B rows of every decode step, each empty or held by one request.

A request takes the lowest empty slot when it joins and gives it back when it leaves. What lives
in a slot besides its token and position is the per-row state of the kinds without a cache (KDA's
convolution window and recurrent state: a fixed size per row, not paged): `paged_kv.insert_row`
replaces the slot's rows of those leaves whole when a request takes it (with the request's prefilled state,
which started from zeros), so nothing of the slot's last request survives into the next.
"""

from __future__ import annotations

import numpy as np

EMPTY = -1  # the request id of an empty slot


class SlotManager:
    """B slots; `requests[s]` is the request id in slot s, or EMPTY."""

    def __init__(self, batch: int) -> None:
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"batch={batch!r} is invalid: an int >= 1 (the slots of a step)")
        self.requests = np.full(int(batch), EMPTY, np.int64)  # [B]

    @property
    def batch(self) -> int:
        return len(self.requests)

    @property
    def occupied(self) -> int:
        return int(np.sum(self.requests != EMPTY))

    def active(self) -> list[int]:
        """The occupied slots, ascending."""
        return [int(s) for s in np.flatnonzero(self.requests != EMPTY)]

    def free_slot(self) -> int | None:
        """The lowest empty slot, or None when every slot is held."""
        empty = np.flatnonzero(self.requests == EMPTY)
        return int(empty[0]) if len(empty) else None

    def take(self, slot: int, request: int) -> None:
        if self.requests[slot] != EMPTY:
            raise ValueError(f"slot {slot} is held by request {self.requests[slot]}")
        self.requests[slot] = request

    def release(self, slot: int) -> int:
        """Empty `slot`; returns the request that held it."""
        request = int(self.requests[slot])
        self.requests[slot] = EMPTY
        return request
