"""The radix prefix cache: KV pages of earlier requests, keyed by their tokens, page by page.

A node holds one full page: the KV of `page_size` tokens, whose key is those tokens; its path
from the root spells the token prefix the page's KV depends on (the KV of position p depends
on tokens [0, p]). A new request reuses the pages of its longest cached prefix.

Ownership: the cache holds one reference on every page it keeps (kv/allocator.py), a request
one on every page of its table. A request that reads cached pages locks the deepest node it
uses, which locks every ancestor: a locked node is never evicted. Unlocked nodes are exactly
the evictable ones (a lock on a node also locks its ancestors, so an unlocked node has no
locked descendant); leaves go first, least recently used first. Eviction runs only when an
allocation would otherwise fail, so cached pages cost no room a request needs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from specserve.kv.allocator import PageAllocator


class _Node:
    __slots__ = ("key", "page", "parent", "children", "lock", "last_use")

    def __init__(self, key: tuple[int, ...] | None, page: int, parent: _Node | None):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.lock = 0  # requests whose locked path passes through here
        self.last_use = 0


class PrefixCache:
    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = _Node(None, -1, None)
        self.root.lock = 1  # never evicted
        self.num_pages = 0  # pages the cache holds
        self.evictable = 0  # of those, unlocked (free for the taking)
        self._clock = itertools.count(1)
        self._leaves: list[tuple[int, int, _Node]] = []  # heap of (last_use, id, leaf)
        self._ids = itertools.count()

    # ---- lookups ----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_tokens: int) -> tuple[list[int], _Node]:
        """Pages of the longest cached prefix of `tokens` (whole pages, at most max_tokens
        tokens) and the deepest node matched (the root when nothing matched)."""
        node, pages, ps = self.root, [], self.page_size
        now = next(self._clock)
        for start in range(0, max_tokens - ps + 1, ps):
            child = node.children.get(tuple(tokens[start : start + ps]))
            if child is None:
                break
            child.last_use = now
            pages.append(child.page)
            node = child
        return pages, node

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> _Node:
        """Keep the full pages of a request (`pages[i]` holds tokens[i*ps : (i+1)*ps]); a page
        whose tokens are cached already stays the request's own. Returns the deepest node."""
        node, ps = self.root, self.page_size
        now = next(self._clock)
        for i in range(min(len(tokens) // ps, len(pages))):
            key = tuple(tokens[i * ps : (i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                child = _Node(key, pages[i], node)
                node.children[key] = child
                self.allocator.share([pages[i]])
                self.num_pages += 1
                self.evictable += 1
            child.last_use = now
            node = child
        self._push_if_leaf(node)
        return node

    # ---- locks ---------------------------------------------------------------------------
    def lock(self, node: _Node) -> None:
        while node is not None:
            node.lock += 1
            if node.lock == 1:
                self.evictable -= 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        leaf = node
        while node is not None:
            node.lock -= 1
            assert node.lock >= 0, "prefix cache: unlocked more often than locked"
            if node.lock == 0:
                self.evictable += 1
            node = node.parent
        self._push_if_leaf(leaf)

    # ---- eviction ------------------------------------------------------------------------
    def _push_if_leaf(self, node: _Node) -> None:
        if node is not self.root and not node.children and node.lock == 0:
            heapq.heappush(self._leaves, (node.last_use, next(self._ids), node))

    def evict(self, num_pages: int) -> int:
        """Drop up to num_pages unlocked pages, least recently used leaves first; returns how
        many went back to the free list."""
        freed = 0
        while freed < num_pages and self._leaves:
            last_use, _, node = heapq.heappop(self._leaves)
            if node.children or node.lock or node.parent is None:
                continue  # no longer an unlocked leaf (it is pushed again when it is)
            if last_use != node.last_use:  # used since: it waits its new turn
                heapq.heappush(self._leaves, (node.last_use, next(self._ids), node))
                continue
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.allocator.free([node.page])
            self.num_pages -= 1
            self.evictable -= 1
            freed += 1
            self._push_if_leaf(parent)
        return freed

    def flush(self) -> int:
        """Drop every unlocked page (with no request live: all of them)."""
        return self.evict(self.num_pages)

    def held_pages(self) -> list[int]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node.page)
            stack.extend(node.children.values())
        return out
