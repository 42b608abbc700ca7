"""The radix prefix cache: KV pages of earlier requests, keyed by their tokens, page by page.

Page i of a request holds the KV of tokens [i*ps, (i+1)*ps) and its key is those tokens; a
page is reusable for a prefix that spells the same keys from page 0 on (the KV of position p
depends on tokens [0, p]). A new request reuses the pages of its longest cached prefix.

The tree is compressed (as SGLang's radix cache): a node holds a run of pages, the edge from
its parent, so nodes number about the branch points, not the cached pages. At page size 1 a
node per page meant a Python object per cached token: a full garbage collection over a
million cached pages took about a second, and every lookup walked one node per token. An edge
is split where a match or insert ends inside it, so the node returned ends exactly there;
the upper part becomes a new node and the existing one keeps the lower part, so a node a
request holds keeps spelling the same prefix.

An EAGLE draft's KV at position p pairs the target's state at p with token p + 1, so a page's
draft KV also depends on the token after it: with `next_token_in_key` a page's key is its
tokens and the next one (an edge stores its tokens and the one after), and every matched
page is exact for draft and target alike. The last page of a prefix may then be found with
another next token only (`match`'s boundary): its target KV is right, its draft KV's last
entry is not, so the scheduler copies it into a page of the request's own and re-runs that
one position.

Under load-adaptive speculation a plain step skips the draft, so a request's draft KV may be
exact only up to some position while its target KV goes further. Its pages past that point
are cached as target-only nodes (`exact` false): a speculating request's match stops before
the first of them (`match(..., plain=False)`), and a request that will decode plainly takes
them too. An exact copy of a target-only page, inserted later by a request that computed it
with its draft, replaces it (when no live request reads it); a target-only copy never
replaces an exact one.

Ownership: the cache holds one reference on every page it keeps (kv/allocator.py), a request
one on every page of its table. A request that reads cached pages locks the node ending its
prefix, which locks every ancestor: a locked node is never evicted. A request locks only
pages it holds (`insert`), so a lock never pins a copy nobody reads. Unlocked nodes are exactly
the evictable ones (a lock on a node also locks its ancestors, so an unlocked node has no
locked descendant); leaves go first, least recently used first, trimmed from their end when
fewer pages are asked for. Eviction runs only when an allocation would otherwise fail, so
cached pages cost no room a request needs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from specserve.kv.allocator import PageAllocator


class _Node:
    __slots__ = ("tokens", "pages", "parent", "children", "lock", "last_use", "depth", "exact")

    def __init__(
        self, tokens: list[int], pages: list[int], parent: _Node | None, exact: bool = True
    ):
        # The edge's pages and their tokens (and, with `next_token_in_key`, the next one).
        self.tokens = tokens
        self.pages = pages
        self.parent = parent
        self.depth = len(pages) + (0 if parent is None else parent.depth)  # pages from the root
        # Keyed by the child's first page's key: siblings differ there (else they'd share it).
        self.children: dict[tuple[int, ...], _Node] = {}
        self.lock = 0  # requests whose locked prefix passes through here
        self.last_use = 0
        self.exact = exact  # its pages' draft KV is exact too (else: the target's only)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading elements two lists share (compared in C-speed chunks first)."""
    n, i, step = min(len(a), len(b)), 0, 64
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, allocator: PageAllocator, next_token_in_key: bool = False):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.next_token_in_key = next_token_in_key
        self._extra = 1 if next_token_in_key else 0  # tokens a key reads past its page
        self.root = _Node([], [], None)
        self.root.lock = 1  # never evicted
        self.num_pages = 0  # pages the cache holds
        self.evictable = 0  # of those, unlocked (free for the taking)
        self._clock = itertools.count(1)
        self._leaves: list[tuple[int, int, _Node]] = []  # heap of (last_use, id, leaf)
        self._ids = itertools.count()

    # ---- keys and edges ---------------------------------------------------------------------
    def _key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        """Page i's key: its tokens, and the next one with `next_token_in_key`."""
        ps = self.page_size
        return tuple(tokens[i * ps : (i + 1) * ps + self._extra])

    def _edge_key(self, node: _Node) -> tuple[int, ...]:
        """The key of a node's first page: its entry in its parent's children."""
        return tuple(node.tokens[: self.page_size + self._extra])

    def _matching_pages(self, node: _Node, tokens: list[int], i: int, limit: int) -> int:
        """How many of the node's first `limit` pages have the keys of the tokens' pages i,
        i + 1, ... (the node's edge starts at page i); with the next token in the key a page
        matches only if the token after it does too."""
        ps, x = self.page_size, self._extra
        n = min(len(node.pages), limit)
        edge = node.tokens if n == len(node.pages) else node.tokens[: n * ps + x]
        same = _common_prefix(edge, tokens[i * ps : i * ps + len(edge)])
        return max(0, same - x) // ps

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut a node's edge after its first k pages; returns the new upper node. The node
        keeps the lower part (and its identity: a handle to it still ends where it did), and
        every lock through it passes through the upper part too."""
        ps, x = self.page_size, self._extra
        upper = _Node(node.tokens[: k * ps + x], node.pages[:k], node.parent, node.exact)
        upper.lock, upper.last_use = node.lock, node.last_use
        node.parent.children[self._edge_key(node)] = upper
        node.tokens, node.pages = node.tokens[k * ps :], node.pages[k:]
        node.parent = upper
        upper.children[self._edge_key(node)] = node
        return upper

    # ---- lookups ----------------------------------------------------------------------------
    def match(
        self, tokens: Sequence[int], max_tokens: int, plain: bool = False
    ) -> tuple[list[int], _Node, bool]:
        """The longest cached prefix of `tokens` in whole pages, at most max_tokens tokens
        (tokens must extend one past them): (its pages, the node ending exactly there, the
        root when none, boundary). boundary: the last page matched its tokens but not the next
        one (only with `next_token_in_key`): its draft KV's last entry is someone else's.
        plain: the request decodes plainly, so target-only pages serve it too (else the
        match stops before them; `exact_pages` says where they begin)."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        ps, x = self.page_size, self._extra
        node, pages, boundary = self.root, [], False
        now = next(self._clock)
        total = max_tokens // ps
        while node.depth < total:
            i = node.depth
            key = self._key(tokens, i)
            child = node.children.get(key)
            if child is not None:
                k = self._matching_pages(child, tokens, i, total - i)
                # With the next token in the key, page k may match all but its next token.
                if x and k < min(len(child.pages), total - i):
                    j = (i + k) * ps
                    boundary = child.tokens[k * ps : (k + 1) * ps] == tokens[j : j + ps]
                    k += boundary
            elif x:  # a sibling whose first page's tokens match, not its next token
                child = next(
                    (
                        c
                        for kk, c in node.children.items()
                        if kk[:-1] == key[:-1] and (c.exact or plain)
                    ),
                    None,
                )
                k, boundary = 1, child is not None
            if child is None or not (child.exact or plain):
                boundary = False  # (nothing of this edge is taken)
                break
            whole = k == len(child.pages)
            if not whole:  # the match ends inside this edge: a node must end there
                child = self._split(child, k)
            child.last_use = now
            pages.extend(child.pages)
            node = child
            if boundary or not whole:
                break
        return pages, node, boundary

    def exact_pages(self, node: _Node) -> int:
        """How many leading pages of `node`'s prefix have exact draft KV (up to its first
        target-only node)."""
        depth = node.depth
        while node is not self.root:
            if not node.exact:
                depth = node.parent.depth
            node = node.parent
        return depth

    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        num_tokens: int,
        start: _Node | None = None,
        releasing: bool = False,
        exact_tokens: int | None = None,
    ) -> _Node:
        """Keep the full pages among the first num_tokens of a request (`pages[i]` holds
        tokens[i*ps : (i+1)*ps]; with `next_token_in_key` tokens must go one further). Where
        a key is cached already with another page (the request computed it again), the
        cache takes the request's page if no live request reads its own, else it keeps its
        own and the insert stops there. Returns the node ending at the last page kept on the
        request's path: the pages from the root to it are all ones the request holds.
        start: a node the request holds locked (its cached prefix, or what it inserted
        before): when it lies on the tokens' path, the walk resumes there, so a request's
        inserts look up its new pages only, not its whole history again (the prefix above
        `start` only has its last use refreshed, a pointer walk). releasing: the request is
        done and will not read its pages again: where a live request reads the cached copy,
        the walk goes on under that copy (the request's own is freed with its table), so its
        later pages are cached too, not lost for its next turn. exact_tokens: the first
        tokens whose draft KV is exact too (None: all num_tokens); the pages past them are
        kept as target-only."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        ps, x = self.page_size, self._extra
        node = self.root
        count = min(num_tokens // ps, len(pages))
        exact = count if exact_tokens is None else min(count, exact_tokens // ps)
        now = next(self._clock)
        if start is not None and self._on_path(start, tokens, count):
            node = start
            # (pages of its path kept target-only that are exact now, the draft having caught
            # up since: the walk resumes above them, to mark them)
            while node is not self.root and self.exact_pages(node) < min(exact, node.depth):
                node = node.parent
            while start is not self.root:  # the prefix resumed over is used now too
                start.last_use = now
                start = start.parent
        while node.depth < count:
            i = node.depth
            own_exact = i < exact
            end = exact if own_exact else count  # (an edge is all exact or all target-only)
            key = self._key(tokens, i)
            child = node.children.get(key)
            if child is None:  # the rest is new: one edge, one reference per page
                added = list(pages[i:end])
                child = _Node(tokens[i * ps : end * ps + x], added, node, own_exact)
                node.children[key] = child
                self.allocator.share(added)
                self.num_pages += len(added)
                self.evictable += len(added)
            else:
                k = self._matching_pages(child, tokens, i, end - i)
                if k < len(child.pages):
                    child = self._split(child, k)
                own = list(pages[i : i + len(child.pages)])
                if child.pages != own:  # the request computed these positions itself
                    # (a request releasing its pages walks on under the cached copy: the
                    # same tokens' KV, and its own copy is freed with its table)
                    if child.exact and not own_exact:
                        # (an exact copy stays: a target-only one serves fewer requests)
                        if not releasing:
                            break
                    elif child.lock == 0:  # no live request reads the cached copy
                        self._replace_pages(child, own)
                        child.exact = child.exact or own_exact
                    elif not releasing:
                        # another request reads the cached copy: keep that, and stop where
                        # the copies part, so the request locks only pages it reads; its own
                        # copies past there stay its own (cached when it releases them)
                        same = _common_prefix(child.pages, own)
                        if same == 0:
                            break
                        child = self._split(child, same)
                        child.last_use = now
                        node = child
                        break
                elif own_exact and not child.exact:
                    child.exact = True  # (its own pages, their draft caught up since)
            child.last_use = now
            node = child
        self._push_if_leaf(node)
        return node

    def _replace_pages(self, node: _Node, pages: list[int]) -> None:
        """An unlocked node takes a request's copies of its pages (the same tokens, computed
        again, e.g. for prompt log-probs) and gives up its own: else the request, locking the
        node, would pin pages it never reads, and a lone request could find no room."""
        old = [a for a, b in zip(node.pages, pages) if a != b]
        new = [b for a, b in zip(node.pages, pages) if a != b]
        self.allocator.share(new)
        self.allocator.free(old)
        node.pages = list(pages)

    def _on_path(self, node: _Node, tokens: list[int], count: int) -> bool:
        """Whether `node` (still cached) spells the first node.depth pages of `tokens`, within
        `count` pages. The pages above its last were matched or inserted by exact keys, so
        only its last page's key can differ: a boundary found by its tokens but another next
        token."""
        ps = self.page_size
        return (
            node is not self.root
            and node.parent is not None
            and node.depth <= count
            and node.tokens[len(node.tokens) - ps - self._extra :]
            == tokens[(node.depth - 1) * ps : node.depth * ps + self._extra]
        )

    def shorter(self, node: _Node) -> _Node:
        """The node of `node`'s prefix less its last page (splitting its edge if needed)."""
        assert node is not self.root and node.parent is not None
        if len(node.pages) == 1:
            return node.parent
        return self._split(node, len(node.pages) - 1)

    # ---- locks ---------------------------------------------------------------------------
    def lock(self, node: _Node) -> None:
        while node is not None:
            node.lock += 1
            if node.lock == 1:
                self.evictable -= len(node.pages)
            node = node.parent

    def unlock(self, node: _Node) -> None:
        leaf = node
        while node is not None:
            node.lock -= 1
            assert node.lock >= 0, "prefix cache: unlocked more often than locked"
            if node.lock == 0:
                self.evictable += len(node.pages)
            node = node.parent
        self._push_if_leaf(leaf)

    # ---- eviction ------------------------------------------------------------------------
    def _push_if_leaf(self, node: _Node) -> None:
        if node is not self.root and not node.children and node.lock == 0:
            heapq.heappush(self._leaves, (node.last_use, next(self._ids), node))

    def evict(self, num_pages: int) -> int:
        """Drop up to num_pages unlocked pages, least recently used leaves first (the last
        one trimmed from its end to free no more than asked); returns how many went back to
        the free list."""
        freed, ps = 0, self.page_size
        while freed < num_pages and self._leaves:
            last_use, _, node = heapq.heappop(self._leaves)
            if node.children or node.lock or node.parent is None:
                continue  # no longer an unlocked leaf (it is pushed again when it is)
            if last_use != node.last_use:  # used since: it waits its new turn
                heapq.heappush(self._leaves, (node.last_use, next(self._ids), node))
                continue
            n = min(len(node.pages), num_pages - freed)
            if n < len(node.pages):  # its upper pages stay, still the least recently used
                dropped = node.pages[-n:]
                del node.pages[-n:]
                node.tokens = node.tokens[: len(node.pages) * ps + self._extra]
                node.depth -= n
                heapq.heappush(self._leaves, (last_use, next(self._ids), node))
            else:
                dropped = node.pages
                parent = node.parent
                del parent.children[self._edge_key(node)]
                node.parent = None
                self._push_if_leaf(parent)
            self.allocator.free(dropped)
            self.num_pages -= n
            self.evictable -= n
            freed += n
        return freed

    def flush(self) -> int:
        """Drop every unlocked page (with no request live: all of them)."""
        return self.evict(self.num_pages)

    def num_nodes(self) -> int:
        """Nodes in the tree, the root included."""
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    def check_locks(self, locked: list[_Node]) -> None:
        """Every node's lock count is the number of `locked` nodes (one per request holding
        the cache) at or below it, and `evictable` counts the pages of unlocked nodes."""
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
            if node.lock == 0:
                unlocked += len(node.pages)
            stack.extend(node.children.values())
        if unlocked != self.evictable:
            raise AssertionError(
                f"prefix cache: {unlocked} unlocked pages, {self.evictable} counted"
            )

    def held_pages(self) -> list[int]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.extend(node.pages)
            stack.extend(node.children.values())
        return out
