"""Requests that arrive together and share a prompt prefix the cache does not hold yet (a
system prompt, a fan-out of agent calls): prefilled in one batch, each computes the prefix
again. So while a request of the batch computes a prefix, a later request sharing at least
SHARE_MIN_TOKENS of it beyond what is cached waits for the next prefill batch, where it starts
from the cache (the prefix is cached when the computing request completes its prefill). SGLang
holds such requests back in the same way; vLLM gets part of the effect from caching blocks
as its chunked prefills complete them.
"""

from __future__ import annotations

from specserve.runtime.request import Request

# Below this, waiting for the prefix costs a request more (a prefill batch later) than it
# saves (SGLang uses the same threshold for its in-batch prefix check).
SHARE_MIN_TOKENS = 32


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit` (slices compare at C speed)."""
    n, step = 0, 64
    while n < limit:
        end = min(n + step, limit)
        if a[n:end] != b[n:end]:
            while a[n] == b[n]:
                n += 1
            return n
        n = end
    return limit


class PrefillSharing:
    """The requests of one prefill batch whose prompts will be cached, indexed by their first
    SHARE_MIN_TOKENS tokens (any prefix worth waiting for starts with them)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.min_gain = max(SHARE_MIN_TOKENS, page_size)
        self._by_head: dict[tuple[int, ...], list[Request]] = {}

    def add(self, req: Request) -> None:
        """`req` prefills in this batch; its prompt is cached once that prefill completes."""
        ids = req.all_ids
        if req.fill_len > SHARE_MIN_TOKENS:
            self._by_head.setdefault(tuple(ids[:SHARE_MIN_TOKENS]), []).append(req)

    def should_wait(self, req: Request, reuse_limit: int) -> bool:
        """Whether fresh `req`, which may take up to `reuse_limit` tokens from the cache,
        would find at least `min_gain` more cached after this batch than now. A computing
        request's own cached start stands for what the cache holds of the shared part (the
        same tokens find the same pages)."""
        if reuse_limit < self.min_gain:
            return False
        ids = req.all_ids
        for other in self._by_head.get(tuple(ids[:SHARE_MIN_TOKENS]), ()):
            # what `other` caches: its full pages before its last prompt token
            limit = min(other.fill_len - 1, reuse_limit)
            shared = common_prefix_len(ids, other.all_ids, limit)
            shared -= shared % self.page_size
            if shared - (other.cached_tokens or 0) >= self.min_gain:
                return True
        return False
