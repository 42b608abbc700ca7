"""Which KV slots each request owns: request id -> its pages, in logical order.

A request's token at logical position p lives in slot `pages[p // page_size] * page_size +
p % page_size`. Target and draft models share this table (each has its own KV tensors
indexed by the same slots), so one reservation covers both. The first pages of a request may
be shared with the prefix cache and other requests (`adopt`); a request only ever writes
positions past them.
"""

from __future__ import annotations

from collections import Counter

import torch

from specserve.kv.allocator import SCRATCH_PAGE, PageAllocator


class KVInvariantError(AssertionError):
    pass


class KVTable:
    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._pages: dict[str, list[int]] = {}
        self.mirror = None  # optional device copy (RequestRows): told of every page change
        self.cache = None  # optional PrefixCache: its unlocked pages are reclaimed on demand

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get: free ones, and cached ones nobody uses."""
        free = self.allocator.num_free_pages
        return free + (self.cache.evictable if self.cache is not None else 0)

    def pages(self, rid: str) -> list[int]:
        return list(self._pages.get(rid, ()))

    def adopt(self, rid: str, pages: list[int]) -> None:
        """A request with no pages yet starts with these shared, already computed ones."""
        assert not self._pages.get(rid), f"{rid} already holds pages"
        self.allocator.share(pages)
        self._pages[rid] = list(pages)
        if self.mirror is not None and pages:
            self.mirror.on_pages_added(rid, 0, list(pages))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def capacity(self, rid: str) -> int:
        return len(self._pages.get(rid, ())) * self.page_size

    def extra_pages_needed(self, rid: str, num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(self._pages.get(rid, ())))

    def reserve(self, rid: str, num_tokens: int) -> bool:
        """Make room for logical positions [0, num_tokens); all or nothing."""
        return self.reserve_all([rid], [num_tokens])

    def reserve_all(self, rids: list[str], num_tokens: list[int]) -> bool:
        """Make room for logical positions [0, n) of each request, all or nothing: one
        allocation for the batch (a decode step reserves for every running request), with
        cached pages nobody uses evicted only when that makes it fit. Without eviction each
        request gets the pages one reservation per request, in order, would give it."""
        ps = self.page_size
        held = [self._pages.get(rid) for rid in rids]
        needs = [
            max(0, -(-n // ps) - (len(h) if h is not None else 0)) for n, h in zip(num_tokens, held)
        ]
        total = sum(needs)
        if total > self.available_pages:
            return False
        pages = self.allocator.alloc(total)
        if pages is None:
            self.cache.evict(total - self.allocator.num_free_pages)
            pages = self.allocator.alloc(total)
            if pages is None:
                return False
        at = 0
        for rid, h, need in zip(rids, held, needs):
            if h is None:
                h = self._pages[rid] = []
            if need:
                got = pages[at : at + need]
                at += need
                if self.mirror is not None:
                    self.mirror.on_pages_added(rid, len(h), got)
                h.extend(got)
        return True

    def scratch_past_pages(self, rid: str, num_tokens: int) -> None:
        """Point the device mirror's page entries of positions past the request's pages, up
        to num_tokens, at the scratch page: a step may then write there without a
        reservation (the entries may still name pages the request freed, which others now
        hold). Its own pages are unchanged."""
        held = len(self._pages.get(rid, ()))
        extra = self.pages_for(num_tokens) - held
        if self.mirror is not None and extra > 0:
            self.mirror.on_pages_added(rid, held, [SCRATCH_PAGE] * extra)

    def truncate(self, rid: str, num_tokens: int) -> None:
        """Give back the pages past logical position num_tokens."""
        pages = self._pages.get(rid)
        if pages is None:
            return
        keep = self.pages_for(num_tokens)
        if keep < len(pages):
            self.allocator.free(pages[keep:])
            del pages[keep:]

    def release(self, rid: str) -> None:
        pages = self._pages.pop(rid, None)
        if pages:
            self.allocator.free(pages)
        if self.mirror is not None:
            self.mirror.on_release(rid)

    # ---- a replica of another process's table (tensor parallelism) -------------------------
    # It follows the owner's page changes as its device mirror sees them (no allocation here);
    # pages the owner truncates stay listed until the owner gives the positions new pages.
    def follow_added(self, rid: str, first_index: int, pages: list[int]) -> None:
        owned = self._pages.setdefault(rid, [])
        del owned[first_index:]
        owned.extend(pages)
        if self.mirror is not None:
            self.mirror.on_pages_added(rid, first_index, pages)

    def follow_released(self, rid: str) -> None:
        self._pages.pop(rid, None)
        if self.mirror is not None:
            self.mirror.on_release(rid)

    def owners(self) -> list[str]:
        return list(self._pages)

    def slots(self, rid: str, start: int, end: int) -> torch.Tensor:
        """Slot ids (int64, CPU) of logical positions [start, end)."""
        pages = self._pages[rid]
        if end > len(pages) * self.page_size:
            raise KVInvariantError(f"{rid}: positions up to {end} exceed reserved capacity")
        pos = torch.arange(start, end, dtype=torch.int64)
        page_ids = torch.tensor(pages, dtype=torch.int64)
        return page_ids[pos // self.page_size] * self.page_size + pos % self.page_size

    def check_invariants(self, live_rids: set[str] | None = None) -> None:
        """Every page is free, or held by live requests and the cache with a reference count
        equal to its holders; nothing leaks."""
        holders = Counter()
        for rid, pages in self._pages.items():
            if live_rids is not None and rid not in live_rids:
                raise KVInvariantError(f"request {rid} holds {len(pages)} pages but is not live")
            if len(set(pages)) != len(pages):
                raise KVInvariantError(f"request {rid} lists a page twice")
            holders.update(pages)
        if self.cache is not None:
            cached = self.cache.held_pages()
            if len(set(cached)) != len(cached):
                raise KVInvariantError("the prefix cache holds a page twice")
            holders.update(cached)
        refs, free = self.allocator.refs, self.allocator.free_pages()
        if len(set(free)) != len(free):
            raise KVInvariantError("a page is free twice")
        for p in free:
            if holders[p] or refs[p]:
                raise KVInvariantError(f"page {p} is free but held ({holders[p]}, refs {refs[p]})")
        wrong = [p for p, n in holders.items() if refs[p] != n]
        if wrong:
            p = wrong[0]
            raise KVInvariantError(f"page {p}: {holders[p]} holders, reference count {refs[p]}")
        seen = set(free) | set(holders)
        expected = set(range(1, self.allocator.num_pages))
        if seen != expected:
            lost = sorted(expected - seen)[:8]
            bogus = sorted(seen - expected)[:8]
            raise KVInvariantError(f"pages lost {lost} or out of range {bogus}")
