"""Requests that arrive together and share a prompt prefix the cache does not hold yet (a
system prompt, a fan-out of agent calls): prefilled in one batch, each computes the prefix
again. So while a request of the batch computes a prefix, a later request sharing at least
SHARE_MIN_TOKENS of it beyond what that request took from the cache waits for the next
prefill batch, where it starts from the cache (a computing request's pages are cached as
each of its prefill chunks completes). SGLang holds such requests back in the same way; vLLM
gets part of the effect from caching blocks as its chunked prefills complete them.

A computing request's chunk start stands for what the cache holds of the shared part (the
same tokens find the same pages). It can be less when that request could not take the
cache (it wants its prompt's log-probs) or was admitted before the prefix was cached: the
waiting request then loses one prefill batch, no more.
"""

from __future__ import annotations

from specserve.runtime.request import Request

# Below this, waiting for the prefix costs a request more (a prefill batch later) than it
# saves (SGLang uses the same threshold for its in-batch prefix check).
SHARE_MIN_TOKENS = 32


class PrefillSharing:
    """The requests of one prefill batch whose prompts will be cached, indexed by the
    prefix a later request must share to gain from waiting: each computing request's chunk
    start plus SHARE_MIN_TOKENS (whole pages). Lookups hash token slices (no pairwise
    comparisons: a burst of requests stays linear in its tokens)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.gain = -(-max(SHARE_MIN_TOKENS, page_size) // page_size) * page_size
        self._by_length: dict[int, set[tuple[int, ...]]] = {}

    def add(self, req: Request, start: int) -> None:
        """`req` prefills from position `start` in this batch; what it computes is cached once
        the batch completes (its full pages, before its last known token)."""
        length = start - start % self.page_size + self.gain  # (the cache holds whole pages)
        if req.fill_len - 1 >= length:
            self._by_length.setdefault(length, set()).add(tuple(req.all_ids[:length]))

    def should_wait(self, req: Request, reuse_limit: int) -> bool:
        """Whether fresh `req`, which may take up to `reuse_limit` tokens from the cache,
        shares with a computing request at least `gain` tokens that request does not have
        from the cache."""
        ids = req.all_ids
        return any(
            length <= reuse_limit and tuple(ids[:length]) in prefixes
            for length, prefixes in self._by_length.items()
        )
