"""Page allocator: hands out fixed-size pages of KV slots, for any integer page_size >= 1."""

from __future__ import annotations


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

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def free_pages(self) -> list[int]:
        return list(self._free)
