"""The page allocator: the free list of one pool of KV pages, and which row owns each page.

A row takes, when it joins, every page its cache will need (`Request.length` tokens: its prompt
and every generated token but the last), so a running row never waits for a page mid-decode; a
row that does not fit the free pages waits (`allocate` returns None) until rows leave. Pages go
back to the free list when their row leaves and the lowest free page is taken first, so a
finished row's pages are the next row's soon: nothing is zeroed in between, which is safe because
a row writes a position before any step reads it and never reads past its own length
(tests/test_serve.py holds both).
"""

from __future__ import annotations

import heapq

import numpy as np

from mkresearch.model import paged_kv

FREE = -1  # owner of a page no row holds


class PageAllocator:
    """The free list of a pool of `n_pages` pages (`reserved`: page ids never handed out, e.g. a
    page the empty slots point at). `owner[p]` is the row id holding page p, or FREE."""

    def __init__(self, n_pages: int, page_size: int, reserved: tuple[int, ...] = ()) -> None:
        for name, value in (("n_pages", n_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: an int >= 1")
        if any(not 0 <= page < n_pages for page in reserved):
            raise ValueError(f"reserved={reserved!r} is invalid: page ids in [0, {n_pages})")
        self.n_pages, self.page_size = int(n_pages), int(page_size)
        self.reserved = tuple(sorted(set(reserved)))
        self.owner = np.full(self.n_pages, FREE, np.int64)  # [n_pages]
        self._free = [p for p in range(self.n_pages) if p not in self.reserved]
        heapq.heapify(self._free)
        self._pages: dict[int, list[int]] = {}  # row id -> its pages, in table order

    @property
    def capacity(self) -> int:
        """Pages a row may ever take (the pool less its reserved pages)."""
        return self.n_pages - len(self.reserved)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.capacity - len(self._free)

    def pages_of(self, row: int) -> list[int]:
        """The pages `row` holds, in the order its page table lists them."""
        return list(self._pages.get(row, ()))

    def allocate(self, row: int, tokens: int) -> list[int] | None:
        """Take the pages of `tokens` cached tokens for `row` (the lowest free ids first); None
        when the free list is too short: the row waits. A row no pool could hold is a
        ValueError (it would wait forever)."""
        if row in self._pages:
            raise ValueError(f"row {row} already holds pages {self._pages[row]}: free them first")
        count = paged_kv.pages_needed(int(tokens), self.page_size)
        if count > self.capacity:
            raise ValueError(f"row {row} needs {count} pages of {self.page_size} tokens for "
                             f"{tokens} tokens: the pool holds {self.capacity}")
        if count > len(self._free):
            return None
        pages = [heapq.heappop(self._free) for _ in range(count)]
        self.owner[pages] = row
        self._pages[row] = pages
        return list(pages)

    def free(self, row: int) -> list[int]:
        """Give `row`'s pages back to the free list; returns them."""
        pages = self._pages.pop(row, [])
        self.owner[pages] = FREE
        for page in pages:
            heapq.heappush(self._free, page)
        return pages
