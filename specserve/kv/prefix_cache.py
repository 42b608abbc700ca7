"""The radix prefix cache: KV pages of earlier requests, keyed by their tokens, page by page.

A node holds one full page: the KV of `page_size` tokens, whose key is those tokens; its path
from the root spells the token prefix the page's KV depends on (the KV of position p depends
on tokens [0, p]). A new request reuses the pages of its longest cached prefix.

An EAGLE draft's KV at position p pairs the target's state at p with token p + 1, so a page's
draft KV also depends on the token after it: with `next_token_in_key` a node's key is its
tokens and the next one, and every matched page is exact for draft and target alike. The
last page of a prefix may then be found with another next token only (`match`'s boundary):
its target KV is right, its draft KV's last entry is not, so the scheduler copies it into a
page of the request's own and re-runs that one position.

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
    __slots__ = ("key", "page", "parent", "children", "lock", "last_use", "depth")

    def __init__(self, key: tuple[int, ...] | None, page: int, parent: _Node | None):
        self.key = key
        self.page = page
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1  # pages from the root
        self.children: dict[tuple[int, ...], _Node] = {}
        self.lock = 0  # requests whose locked path passes through here
        self.last_use = 0


class PrefixCache:
    def __init__(self, allocator: PageAllocator, next_token_in_key: bool = False):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.next_token_in_key = next_token_in_key
        self.root = _Node(None, -1, None)
        self.root.lock = 1  # never evicted
        self.num_pages = 0  # pages the cache holds
        self.evictable = 0  # of those, unlocked (free for the taking)
        self._clock = itertools.count(1)
        self._leaves: list[tuple[int, int, _Node]] = []  # heap of (last_use, id, leaf)
        self._ids = itertools.count()

    # ---- lookups ----------------------------------------------------------------------------
    def _key(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        """Page i's key: its tokens, and the next one with `next_token_in_key`."""
        ps = self.page_size
        return tuple(tokens[i * ps : (i + 1) * ps + (1 if self.next_token_in_key else 0)])

    def match(self, tokens: Sequence[int], max_tokens: int) -> tuple[list[int], _Node, bool]:
        """The longest cached prefix of `tokens` in whole pages, at most max_tokens tokens
        (tokens must extend one past them): (its pages, the deepest node matched, the root
        when none, boundary). boundary: the last page matched its tokens but not the next
        one (only with `next_token_in_key`): its draft KV's last entry is someone else's."""
        node, pages, ps = self.root, [], self.page_size
        now = next(self._clock)
        boundary = False
        for i in range(max_tokens // ps):
            key = self._key(tokens, i)
            child = node.children.get(key)
            if child is None and self.next_token_in_key:
                child = next((c for k, c in node.children.items() if k[:-1] == key[:-1]), None)
                boundary = child is not None
            if child is None:
                break
            child.last_use = now
            pages.append(child.page)
            node = child
            if boundary:
                break
        return pages, node, boundary

    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        num_tokens: int,
        start: _Node | None = None,
    ) -> _Node:
        """Keep the full pages among the first num_tokens of a request (`pages[i]` holds
        tokens[i*ps : (i+1)*ps]; with `next_token_in_key` tokens must go one further); a page
        whose key is cached already stays the request's own. Returns the deepest node.
        start: a node the request holds locked (its cached prefix, or what it inserted
        before): when it lies on the tokens' path, the walk resumes there, so a request's
        inserts look up its new pages only, not its whole history again (the prefix above
        `start` only has its last use refreshed, a pointer walk)."""
        node, ps = self.root, self.page_size
        count = min(num_tokens // ps, len(pages))
        now = next(self._clock)
        if start is not None and self._on_path(start, tokens, count):
            node = start
            while start is not self.root:  # the prefix resumed over is used now too
                start.last_use = now
                start = start.parent
        added = []
        for i in range(node.depth, count):
            key = self._key(tokens, i)
            child = node.children.get(key)
            if child is None:
                child = _Node(key, pages[i], node)
                node.children[key] = child
                added.append(pages[i])
            child.last_use = now
            node = child
        if added:
            self.allocator.share(added)
            self.num_pages += len(added)
            self.evictable += len(added)
        self._push_if_leaf(node)
        return node

    def _on_path(self, node: _Node, tokens: Sequence[int], count: int) -> bool:
        """Whether `node` (still cached) spells the first node.depth pages of `tokens`, within
        `count` pages. Its ancestors were matched or inserted by exact keys, so only its own
        key can differ: a boundary node found by its tokens but another next token."""
        return (
            node is not self.root
            and node.parent is not None
            and node.depth <= count
            and node.key == self._key(tokens, node.depth - 1)
        )

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

    def check_locks(self, locked: list[_Node]) -> None:
        """Every node's lock count is the number of `locked` nodes (one per request holding
        the cache) at or below it, and `evictable` counts the unlocked nodes."""
        want: dict[int, int] = {id(self.root): 1}
        for node in locked:
            while node is not None:
                want[id(node)] = want.get(id(node), 0) + 1
                node = node.parent
        unlocked, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            if node.lock != want.get(id(node), 0):
                raise AssertionError(f"prefix cache: a node locked {node.lock} times, held by "
                                     f"{want.get(id(node), 0)} requests")  # fmt: skip
            unlocked += node.lock == 0
            stack.extend(node.children.values())
        if unlocked != self.evictable:
            raise AssertionError(
                f"prefix cache: {unlocked} unlocked nodes, {self.evictable} counted"
            )

    def held_pages(self) -> list[int]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node.page)
            stack.extend(node.children.values())
        return out
