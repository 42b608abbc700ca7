"""Page allocator: hands out fixed-size pages of KV slots, for any integer page_size >= 1.

A page has a reference count: each request whose page table lists it holds one, and the
prefix cache holds one for a page it keeps. A page returns to the free list when its last
holder lets go, so requests can share the pages of a common prefix.
"""

from __future__ import annotations

SCRATCH_PAGE = 0  # never allocated: padded tokens, and writes past a request's pages, land here


class PageAllocator:
    """Pages 1..num_pages-1 are allocatable; page 0 is reserved as a scratch page that
    padded (dummy) tokens may write into without touching anyone's KV."""

    def __init__(self, num_pages: int, page_size: int):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if num_pages < 2:
            raise ValueError("need at least one allocatable page besides the scratch page")
        self.page_size = page_size
        self.num_pages = num_pages
        # Pop from the end: lowest page ids are handed out first.
        self._free = list(range(num_pages - 1, 0, -1))
        self.refs = [0] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        """n pages, each with one reference, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        for p in taken:
            self.refs[p] = 1
        return taken[::-1]

    def share(self, pages: list[int]) -> None:
        """One more holder for each of these (held) pages."""
        for p in pages:
            assert self.refs[p] > 0, f"page {p} is free: it cannot be shared"
            self.refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """One holder fewer for each page; pages nobody holds return to the free list."""
        for p in reversed(pages):
            assert self.refs[p] > 0, f"page {p} freed more often than held"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)

    def free_pages(self) -> list[int]:
        return list(self._free)
