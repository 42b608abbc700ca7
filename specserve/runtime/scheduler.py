"""Continuous batching: which requests run next, KV reservations, and retraction.

Pure CPU bookkeeping. Each step is either a prefill batch (new or resumed requests, chunked
to `chunked_prefill_size` tokens) or a decode batch (every running request). While both
kinds have work they alternate, so long prompts cannot starve running requests; under
overlap a prefill runs beside the decode step in flight instead (`schedule_prefill_beside`),
so arrivals do not stop the pipeline. Before a
decode step every running request gets `decode_window` logical positions past its KV; if
pages run out, the newest requests are retracted (KV freed, outputs kept, resumed later by
re-prefilling), so no request is lost and none changes its output.

With a prefix cache (kv/prefix_cache.py) a request starts from the pages of its longest cached
prefix and leaves its own full pages there as its prefill chunks complete, and when it is
retracted or finishes. An EAGLE draft's KV at the last cached position depends on the token after it
(the draft pairs each token with the target's state one position earlier), which may differ:
that last cached page is copied into a page of the request's own, and the prefill re-runs its
last token, so the draft's entry there is computed afresh and no shared page is written.
Requests arriving together with a prefix not cached yet do not all compute it: the later
ones wait for the batch that caches it (runtime/prefill_sharing.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specserve.kv.prefix_cache import PrefixCache
from specserve.kv.table import KVTable
from specserve.runtime.prefill_sharing import PrefillSharing
from specserve.runtime.request import PrefillChunk, ReqState, Request

log = logging.getLogger(__name__)


@dataclass
class SchedulerLimits:
    max_running_requests: int
    chunked_prefill_size: int  # tokens per prefill batch; <= 0: unlimited
    decode_window: int  # logical positions a decode step writes past kv_len
    kv_lookahead: int  # positions past kv_len kept between steps, none in flight
    max_accept: int  # tokens one decode step adds to a request at most


def reuse_limit(req: Request) -> int:
    """The most leading tokens a fresh request may take from the cache."""
    limit = req.fill_len - 1  # at least one token is prefilled: its logits sample the next
    if req.wants_prompt_logprobs:  # the target's logits of those positions are needed
        limit = min(limit, max(0, req.logprob_start_len - 1))
    return limit


class Scheduler:
    def __init__(self, table: KVTable, limits: SchedulerLimits, cache: PrefixCache | None = None):
        self.table = table
        self.limits = limits
        self.cache = cache
        table.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._last_was_prefill = False
        self.num_retractions = 0
        self.prefix_query_tokens = 0  # prompt tokens of admitted requests (with a cache)
        self.prefix_hit_tokens = 0  # of those, served from the cache
        # whether a request about to start will decode plainly, so that the target-only KV
        # of cached pages serves it too (load-adaptive speculation sets it: the request asked
        # for no drafts, or speculation does not pay at this load); such a request then
        # decodes plainly to its end
        self.will_decode_plainly: Callable[[Request], bool] = lambda req: False
        self.num_plain_reuses = 0  # requests started from target-only pages (so plainly)
        self.num_plain_to_fit = 0  # requests decoding plainly where their window did not fit

    # ---- admission ----------------------------------------------------------------------
    @property
    def usable_tokens(self) -> int:
        return self.table.allocator.num_usable_pages * self.table.page_size

    def max_prompt_tokens(self) -> int:
        """The longest fill that can ever run: alone in the cache, where a request too long
        for its speculative step's window decodes plainly (`_decode_plainly_to_fit`), each
        step writing one position past its KV."""
        return self.usable_tokens - 1 - self.limits.kv_lookahead

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a finished request; its computed pages go to the prefix cache."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    # ---- the prefix cache ----------------------------------------------------------------------
    def _cacheable_tokens(self, req: Request) -> tuple[int, int]:
        """(positions whose target KV is computed from the request's own tokens, of those the
        first whose draft KV is too): the target's KV of position p is exact for p < kv_len,
        the draft's pairs p with token p + 1 and is exact but for the last draft_behind
        positions (steps that skipped the draft) and past draft_exact_until."""
        known = len(req.prompt_ids) + len(req.output_ids) - 1  # (a key reads the next token)
        target = min(req.kv_len, known)
        exact = min(req.kv_len - req.draft_behind, known)
        if req.draft_exact_until is not None:
            exact = min(exact, req.draft_exact_until)
        return target, exact

    def _cache_prefix(self, req: Request) -> None:
        """Put the request's full computed pages in the cache and lock what it now uses."""
        if self.cache is None:
            return
        n, exact = self._cacheable_tokens(req)
        node = self.cache.insert(
            req.all_ids, self.table.pages(req.rid), n, req.cache_node, exact_tokens=exact
        )
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = node

    def _release(self, req: Request) -> None:
        """Free a request's KV: its computed full pages stay in the cache, unlocked."""
        if self.cache is not None and req.kv_len > 0 and req.kv_trusted:
            n, exact = self._cacheable_tokens(req)
            pages = self.table.pages(req.rid)
            self.cache.insert(
                req.all_ids, pages, n, req.cache_node, releasing=True, exact_tokens=exact
            )
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        self.table.release(req.rid)

    def _reuse_cached_prefix(self, req: Request, copy_boundary: bool) -> tuple[int, int] | None:
        """Start a request with no KV from its longest cached prefix (locked). Returns the
        (cached page, own page index) to copy when the prefix ends in a boundary page (its
        draft KV's last entry belongs to another next token): the request re-runs that one
        position in a copy of its own. copy_boundary False: that page is left out instead
        (the copy needs one page more than computing it would)."""
        plain = self.will_decode_plainly(req)
        pages, node, boundary = self.cache.match(req.all_ids, reuse_limit(req), plain)
        exact = self.cache.exact_pages(node) if plain else len(pages)
        if boundary and (not copy_boundary or exact < len(pages)):
            # (past its exact pages the request decodes plainly: no draft entry to re-run)
            pages, node, boundary = pages[:-1], self.cache.shorter(node), False
            exact = min(exact, len(pages))
        self.cache.lock(node)
        req.cache_node = node
        ps = self.table.page_size
        if exact < len(pages):  # target-only KV reused: its draft has no exact state there
            req.draft_exact_until, req.draft_stale = exact * ps, True
            self.num_plain_reuses += 1
        if not boundary:
            self.table.adopt(req.rid, pages)
            req.kv_len = len(pages) * ps
            return None
        self.table.adopt(req.rid, pages[:-1])
        req.kv_len = len(pages) * ps - 1
        return pages[-1], len(pages) - 1

    def _undo_reuse(self, req: Request) -> None:
        """No room to start after all: give the prefix back (it stays cached)."""
        self.cache.unlock(req.cache_node)
        req.cache_node = None
        self.table.release(req.rid)
        req.kv_len = 0
        if req.draft_exact_until is not None:
            self.num_plain_reuses -= 1
        req.draft_stale, req.draft_exact_until = False, None

    def _count_hit(self, req: Request, copied: bool) -> None:
        """Prompt tokens served from the cache, counted when a request is first admitted (a
        copied boundary page counts: its KV came from the cache)."""
        if req.cached_tokens is None:
            req.cached_tokens = req.kv_len + (1 if copied else 0)
            self.prefix_query_tokens += len(req.prompt_ids)
            self.prefix_hit_tokens += req.cached_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- choosing the next batch ------------------------------------------------------------
    def schedule(self) -> tuple[str, list] | None:
        prefill_first = bool(self.waiting) and (not self._last_was_prefill or not self.running)
        order = (self._schedule_prefill, self._schedule_decode)
        for fn in order if prefill_first else order[::-1]:
            batch = fn()
            if batch:
                self._last_was_prefill = fn == self._schedule_prefill
                return ("prefill" if self._last_was_prefill else "decode", batch)
        return None

    def _decode_headroom_pages(self, max_accept: int) -> int:
        """Pages the running requests' next decode step needs beyond what they hold (each step
        still in flight may add max_accept tokens first)."""
        w = self.limits.decode_window
        return sum(
            self.table.extra_pages_needed(r.rid, r.kv_len + r.inflight_steps * max_accept + w)
            for r in self.running
            if not r.finished
        )

    def schedule_prefill_beside(self, max_accept: int) -> list[PrefillChunk]:
        """A prefill batch to run while a decode step is in flight (overlap): what fits
        beside the running requests' next step, never by retracting one (that needs the
        step in flight applied first). Empty when nothing fits or nothing waits."""
        if not self.waiting:
            return []
        chunks = self._schedule_prefill(max_accept)
        if chunks:  # (should the pipeline drain next, decoding comes before more prefill)
            self._last_was_prefill = True
        return chunks

    def _schedule_prefill(self, max_accept: int = 0) -> list[PrefillChunk]:
        budget = self.limits.chunked_prefill_size
        if budget <= 0:
            budget = 1 << 62
        chunks: list[PrefillChunk] = []
        active = len(self.running) + sum(r.state is ReqState.PREFILLING for r in self.waiting)
        headroom = self._decode_headroom_pages(max_accept)
        # prompts this batch computes and caches, which later requests may wait for
        sharing = PrefillSharing(self.table.page_size) if self.cache is not None else None
        # A request part way through its prefill goes first: it holds pages, and one queued
        # ahead of it (held back for a shared prefix) that cannot fit beside them would
        # otherwise block it for good once nothing runs that could free pages.
        partial = [r for r in self.waiting if r.state is ReqState.PREFILLING]
        rest = [r for r in self.waiting if r.state is not ReqState.PREFILLING]
        for req in partial + rest:
            if req.state is ReqState.WAITING and active >= self.limits.max_running_requests:
                break
            first = req.prefill_after
            if first is not None and first.state in (ReqState.WAITING, ReqState.PREFILLING):
                continue  # a sibling sample: it starts from the first one's cached prompt
            fresh = self.cache is not None and req.kv_len == 0 and req.cache_node is None
            if fresh and sharing.should_wait(req, reuse_limit(req)):
                # it starts from the cache once this batch has put its prefix there; its
                # running slot stays its own (later arrivals must not take it meanwhile)
                active += req.state is ReqState.WAITING
                continue
            started = self._try_start(req, budget, headroom, fresh, copy_boundary=True)
            if started is None and fresh:  # a copied boundary page needs one page more
                started = self._try_start(req, budget, headroom, fresh, copy_boundary=False)
            if started is None:
                break
            end, copy = started
            if fresh:
                self._count_hit(req, copy is not None)
            admitted = req.state is ReqState.WAITING  # (its first chunk since admission)
            if admitted:
                active += 1
            req.set_state(ReqState.PREFILLING)
            if copy is not None:  # the cached boundary page into the request's own page
                copy = (copy[0], self.table.pages(req.rid)[copy[1]])
            chunks.append(PrefillChunk(req, req.kv_len, end, copy, admitted))
            if sharing is not None:
                sharing.add(req, chunks[-1].start)
            budget -= end - req.kv_len
            if budget <= 0:
                break
        return chunks

    def _try_start(
        self, req: Request, budget: int, headroom: int, fresh: bool, copy_boundary: bool
    ) -> tuple[int, tuple[int, int] | None] | None:
        """Reserve the request's next chunk (a fresh one from its cached prefix); returns
        (chunk end, page to copy or None), or None when there is no room."""
        copy = self._reuse_cached_prefix(req, copy_boundary) if fresh else None
        end = req.kv_len + min(req.fill_len - req.kv_len, budget)
        want = end + (self.limits.kv_lookahead if end == req.fill_len else 0)
        need = self.table.extra_pages_needed(req.rid, want)
        if need <= self.table.available_pages - headroom and self.table.reserve(req.rid, want):
            return end, copy
        if fresh:
            self._undo_reuse(req)
        return None

    def _window(self, req: Request) -> int:
        """Positions past its KV the request's next decode step must own."""
        return 1 if req.plain_to_fit else self.limits.decode_window

    def _schedule_decode(self) -> list[Request]:
        while self.running:
            need = sum(
                self.table.extra_pages_needed(r.rid, r.kv_len + self._window(r))
                for r in self.running
            )
            if need <= self.table.available_pages:
                break
            victim = self._pick_victim()
            if victim is None:
                lone = self.running[0]
                if not self._decode_plainly_to_fit(lone):
                    lone.finish("length", length=len(lone.output_ids), message="KV cache exhausted")
                    return []
            else:
                self.retract(victim)
        for r in self.running:
            ok = self.table.reserve(r.rid, r.kv_len + self._window(r))
            assert ok, "reservation failed after the capacity check"
            if r.plain_to_fit:  # (its tree and draft write past its pages: into scratch)
                self.table.scratch_past_pages(r.rid, r.kv_len + self.limits.decode_window)
        return list(self.running)

    def _decode_plainly_to_fit(self, req: Request) -> bool:
        """The only request left cannot own its speculative step's window: it decodes
        plainly from here if the position a plain step writes fits (as a plain engine with
        this cache would go on), so speculation never ends an output sooner. Its draft stops
        (its draft KV past here is not exact: the cache keeps the rest as target-only)."""
        if req.plain_to_fit or self.limits.decode_window == 1:
            return False
        if self.table.extra_pages_needed(req.rid, req.kv_len + 1) > self.table.available_pages:
            return False
        req.plain_to_fit = req.draft_stale = True
        exact = req.kv_len - req.draft_behind
        if req.draft_exact_until is None or req.draft_exact_until > exact:
            req.draft_exact_until = exact
        self.num_plain_to_fit += 1
        log.debug("%s decodes plainly: the KV cache cannot hold its draft window", req.rid)
        return True

    def schedule_decode_ahead(self, max_accept: int) -> list[Request]:
        """The next decode batch while one step is still in flight (overlap): every running,
        unfinished request, with pages reserved for the worst case (each in-flight step may
        add max_accept tokens). Empty when that does not fit: the caller then drains and
        schedules normally, retracting if it must."""
        reqs = [r for r in self.running if not r.finished]
        w = self.limits.decode_window
        bounds = [r.kv_len + r.inflight_steps * max_accept + w for r in reqs]
        if not reqs or not self.table.reserve_all([r.rid for r in reqs], bounds):
            return []
        return reqs

    def _pick_victim(self) -> Request | None:
        partial = [r for r in self.waiting if r.state is ReqState.PREFILLING]
        if partial:
            return partial[-1]
        if len(self.running) > 1:
            return max(self.running, key=lambda r: r.arrival)
        return None

    def retract(self, req: Request) -> None:
        """Free a request's KV and queue it to resume; its outputs so far are kept (and its
        computed pages cached, so resuming may find them again)."""
        self._release(req)
        req.kv_len = 0
        req.kv_trusted = True  # (none of it is left: the resumed prefill writes it anew)
        req.draft_lag = req.draft_behind = 0  # the resumed prefill rebuilds the draft's KV
        req.draft_stale, req.draft_exact_until, req.plain_to_fit = False, None, False
        req.num_retractions += 1
        self.num_retractions += 1
        if req in self.running:
            self.running.remove(req)
            req.set_state(ReqState.WAITING)
            self.waiting.appendleft(req)
        else:
            req.set_state(ReqState.WAITING)
        log.debug("retracted %s (outputs kept: %d)", req.rid, len(req.output_ids))

    # ---- applying results --------------------------------------------------------------------
    def prefill_done(self, chunk: PrefillChunk) -> None:
        req = chunk.req
        req.kv_len = chunk.end
        if chunk.copy_page is not None and req.cache_node is not None:
            # The boundary page is copied: the request no longer reads the cached one. Holding
            # its lock through a chunked prefill would keep a page the request's remaining
            # chunks may need (a lone request that fits could then never finish).
            node, shorter = req.cache_node, self.cache.shorter(req.cache_node)
            self.cache.lock(shorter)
            self.cache.unlock(node)
            req.cache_node = shorter
        if chunk.completes:
            self.waiting.remove(req)
            req.set_state(ReqState.RUNNING)
            self.running.append(req)
        else:
            req.set_state(ReqState.PREFILLING)
        # requests arriving meanwhile can share the prompt, also while its chunks go on (one
        # held back while this one computed their shared part starts where it has got to)
        self._cache_prefix(req)

    def decode_done(self, req: Request, accept_len: int) -> None:
        """A decode step's results applied to `req` (after its new tokens, which may have
        finished it)."""
        req.kv_len += accept_len
        if req.finished and req.inflight_steps and req.kv_trusted:
            # reaped only once the step launched ahead is applied, after the next requests
            # are admitted (a chat's next turn among them): cache its final pages now (the
            # steps in flight write only past kv_len)
            self._cache_prefix(req)
        self.trim(req)

    def trim(self, req: Request) -> None:
        """Give back the pages past what `req` keeps between steps. The steps still in flight
        write up to a window past kv_len as each of the earlier ones leaves it (max_accept
        further per step). Unless the request is done, the next step launched ahead reserves
        max_accept further again: those pages are kept rather than freed here and taken back
        at once (at page size 1, with the 6/8/64 tree's 7 tokens a step, 11 page operations
        per request a step instead of the 3 its accepted tokens need: host time at large
        batches, where the host sets the pace). A finished request keeps only what the steps
        in flight may write, until it is reaped."""
        limits = self.limits
        if not req.inflight_steps:
            keep = limits.kv_lookahead
        else:
            keep = limits.decode_window + (req.inflight_steps - 1) * limits.max_accept
            if not req.finished:
                keep += limits.max_accept  # the next step's reservation
        self.table.truncate(req.rid, req.kv_len + keep)
