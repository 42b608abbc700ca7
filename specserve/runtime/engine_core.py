"""The engine's step loop without threads: load, admit, schedule, run, apply results."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from specserve.config import EngineConfig
from specserve.errors import InvalidArgument
from specserve.runtime.draft_lag import DraftLag
from specserve.runtime.engine_parts import build_engine_parts
from specserve.runtime.grammar import grammar_spec, refuse_by_grammar
from specserve.runtime.graph_capture import release_cached_memory
from specserve.runtime.host_clock import HostClock
from specserve.runtime.logprobs import TokenLogprobs
from specserve.runtime.request import ReqState, Request
from specserve.runtime.running_cap import RunningCap
from specserve.sampling_params import is_int

_STARTED = (ReqState.RUNNING, ReqState.PREFILLING)

log = logging.getLogger(__name__)

# An idle engine captures wanted decode graphs only once it has had no work this long: a
# capture blocks the loop for 0.05-0.3 s, and a client that sends one request after another
# (a chat turn after the last answer) leaves gaps of a millisecond or so.
IDLE_CAPTURE_DELAY_S = 0.05


class EngineCore:
    def __init__(self, cfg: EngineConfig, tp=None):
        """tp: this rank's TensorParallel handle when tp_size > 1 (runtime/tensor_parallel.py
        builds the ranks): the model and KV cache hold this rank's shard."""
        self.cfg = cfg
        self.tp = tp
        self.peers = None  # rank 0 of tp_size > 1: the other ranks' processes
        self.device = torch.device(cfg.device)
        torch.manual_seed(cfg.random_seed)
        parts = build_engine_parts(cfg, tp)
        self.model_config = mc = parts.model_config
        self.tokenizer = parts.tokenizer
        self.context_len = parts.context_len
        self.max_total_tokens = parts.max_total_tokens
        self.load_decisions = parts.load_decisions
        self.kv_cache = parts.kv_cache
        self.table = parts.table
        self.rows = parts.rows
        self.runner = parts.runner
        self.worker = parts.worker
        self.scheduler = parts.scheduler
        self.adaptive = parts.adaptive
        self.draft_lag = parts.draft_lag
        self.eos_token_ids = parts.eos_token_ids
        self.stop_checker = parts.stop_checker
        self.grammars = parts.grammars
        # live requests with structured output: steps are not launched ahead while there are
        # any, since a step's masks need the grammar state after the step before it
        # (penalties are kept up to date on the device: runtime/penalty_rows.py)
        self.paced: set[str] = set()
        self.requests: dict[str, Request] = {}
        self.by_name: dict[str, Request] = {}  # the latest request of each caller's id
        self._rekeyed = itertools.count(1)
        self.overlap = not cfg.disable_overlap_schedule
        self.pending = None  # a launched decode step whose results the host has not applied
        self.host_clock = HostClock()  # the host's time per step (adaptive speculation)
        self.num_launched_ahead = 0  # decode steps launched before the previous was applied
        self.num_prefill_batches = 0
        self.num_prefills_beside = 0  # of those, run while a decode step was in flight
        self.num_steps = 0
        self._busy_at = 0.0  # when the loop last stepped (idle work waits a moment after)
        self.spec_totals = {"verify_ct": 0, "accepted": 0}
        # device seconds of the decode steps timed for the adaptive policy (their own time,
        # launch to end): against wall time it shows how long the device waited on the host
        self.timed_step_seconds = 0.0
        self.num_out_of_memory_retractions = 0  # (retract_after_out_of_memory)
        self.running_cap = RunningCap(cfg.max_running_requests)
        self.decode_launching: int | None = None  # requests of a decode launch under way
        self.touched_in_step: list[Request] = []
        log.info(
            "engine ready: %s, %d layers, KV %d tokens (page_size %d), device %s %s",
            cfg.model_path,
            mc.num_layers,
            self.max_total_tokens,
            cfg.page_size,
            cfg.device,
            cfg.dtype,
        )

    # ---- requests -----------------------------------------------------------------------
    def validate_prompt(self, ids: list[int], field: str) -> None:
        self.check_token_ids(ids, field)
        if len(ids) >= self.context_len:
            raise InvalidArgument(
                field,
                f"has {len(ids)} tokens; the context length is {self.context_len} (prompt must be shorter)",
            )
        if len(ids) > self.scheduler.max_prompt_tokens():
            raise InvalidArgument(
                field,
                f"has {len(ids)} tokens but the KV cache holds at most {self.scheduler.max_prompt_tokens()} "
                f"for one request (raise max_total_tokens)",
            )

    def check_token_ids(self, ids: list[int], field: str) -> None:
        """A non-empty list of the vocabulary's token ids, whatever its length."""
        if not isinstance(ids, (list, tuple)):
            raise InvalidArgument(field, f"must be a list of token ids, got {type(ids).__name__}")
        if not ids:
            raise InvalidArgument(field, "is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not is_int(t) or t < 0 or t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(field, f"token id {bad!r} is outside the vocabulary [0, {vocab})")

    def compile_grammar(self, params):
        """The compiled grammar a request's structured output asks for (None: none)."""
        spec = grammar_spec(params)
        return None if spec is None else self.compile_grammar_text(*spec)

    def grammar_compiled(self, field: str, text: str) -> bool:
        """Whether the grammar of sampling parameter `field` is compiled already (a request
        asking for it is built at once)."""
        return self.grammars is not None and self.grammars.is_compiled(field, text)

    def compile_grammar_text(self, field: str, text: str):
        """The compiled grammar of sampling parameter `field` (thread-safe, cached)."""
        if self.grammars is None:
            raise InvalidArgument(field, "structured output needs a tokenizer (none is loaded)")
        return self.grammars.compile(field, text)

    def add_request(self, req: Request) -> None:
        live = self.by_name.get(req.name)
        if live is not None and not live.finished:
            raise InvalidArgument(
                "rid", f"request id {req.name!r} is in use by a request still running"
            )
        # a finished request of this id keeps its pages until no launched step can write
        # them: the new one is filed under a key of its own (one no caller's request holds),
        # its id stays the caller's
        while req.rid in self.requests:
            req.rid = f"{req.name}#{next(self._rekeyed)}"
        self.requests[req.rid] = req
        self.by_name[req.name] = req
        if req.grammar is not None:
            self.paced.add(req.rid)
        if req.params.max_new_tokens == 0 and not req.wants_prompt_logprobs:
            req.finish("length", length=0)  # (with prompt log-probs: prefill, then finish)
            return
        self.scheduler.add(req)

    def abort(self, rid: str | Request, message: str = "aborted by request") -> Request | None:
        """Abort the running request the caller knows as `rid` (or that very request)."""
        req = rid if isinstance(rid, Request) else self.by_name.get(rid)
        if req is None or req.finished:
            return None
        req.finish("abort", message=message)
        if req.inflight_steps:  # it will not decode again: no room for a next step
            self.scheduler.trim(req)
        return req

    # ---- the loop --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return (
            self.pending is not None
            or self.scheduler.has_work()
            or any(r.finished for r in self.requests.values())
        )

    def idle_work(self) -> bool:
        """Work for a moment with no request running or waiting: capture a decode graph that
        steps ran eagerly or on a larger one (runtime/cuda_graphs.py). Whether it did any.
        Not before the engine has idled `IDLE_CAPTURE_DELAY_S`: a client sending its next
        request as the last one returns would find a capture in its way."""
        if self.has_work() or time.perf_counter() - self._busy_at < IDLE_CAPTURE_DELAY_S:
            return False
        try:
            return self.worker.capture_wanted()
        except Exception:  # no request depends on it: the covering graphs still serve (a
            # tensor-parallel group that failed here fails its next step instead)
            log.exception("capturing a decode graph while idle failed; no more such captures")
            self.worker.graphs.wanted.clear()
            return False

    def step(self) -> list[Request]:
        """Advance the engine by one batch. Returns the requests with something new (finished
        ones included); finished requests are forgotten here and their KV freed.

        Overlap: while a decode step is in flight, the next decode step is launched from
        device-side state *before* the host waits for the one in flight, so the host's
        bookkeeping (stop checks, detokenising, scheduling) runs while the device computes.
        Waiting prompts are prefilled beside the step launched ahead (queued after it on the
        device, their host work done while it runs); they join the next step. Only what the
        step in flight must not see (a retraction, a batch that no longer fits) drains it
        first and then runs as without overlap."""
        self._busy_at = time.perf_counter()
        # (kept on self: should the step raise, what it gathered is still reported, see
        # `touched_by_failed_step`; extended in place from here on)
        self.touched_in_step = touched = self._reap_finished()
        if self.pending is None:
            self.host_clock.interrupt()  # the loop may have idled: not a step's host time
        if self.pending is not None:
            ahead = None
            if self.overlap and not self.paced:
                reqs = self.scheduler.schedule_decode_ahead(self.worker.max_accept)
                if reqs:
                    ahead = self._launch_decode(reqs)
                    self.num_launched_ahead += 1
            touched += self._finish_decode(self.pending)
            self.pending = ahead
            if ahead is not None and all(r.finished for r in ahead.reqs):
                touched += self.drain()  # nobody left to use it: free their pages now
            elif ahead is not None:
                chunks = self.scheduler.schedule_prefill_beside(self.worker.max_accept)
                if chunks:
                    touched += self._run_prefill(chunks)
                    self.num_prefills_beside += 1
        else:
            plan = self.scheduler.schedule()
            touched += self._reap_finished()  # the scheduler may finish a lone request (KV full)
            if plan is not None:
                kind, batch = plan
                if kind == "prefill":
                    touched += self._run_prefill(batch)
                else:
                    self.pending = self._launch_decode(batch)
                    if not self.overlap:
                        touched += self._finish_decode(self.pending)
                        self.pending = None
        touched += self._reap_finished()
        if self.cfg.debug_check_invariants:
            self.check_invariants()
        seen, out = set(), []
        for r in touched:
            if r.rid in seen or r.finish_reported:
                continue  # each request is reported once per step, and once after finishing
            seen.add(r.rid)
            r.finish_reported = r.finished
            out.append(r)
        return out

    def touched_by_failed_step(self) -> list[Request]:
        """What the step that raised had gathered to report: requests it reaped (no longer in
        `requests`; their callers wait for their final output) or advanced."""
        out, self.touched_in_step = self.touched_in_step, []
        return out

    def retract_after_out_of_memory(self, error: torch.OutOfMemoryError) -> list[Request]:
        """A step ran the device out of memory: retract every started request (its outputs
        kept; a resumed request recomputes its KV, and draws at each position what it would
        have), oldest first to resume, and run at most half as many as were started, rather
        than fail them all (the cap climbs back slowly: runtime/running_cap.py). A request
        that ran alone fails, with the reason: fewer cannot run. Returns the finished
        requests, now reaped. (On tensor-parallel ranks the loop fails every request as for
        any step error: one rank's retraction would leave its peers' batches unmatched.)"""
        self.pending = None  # (abandoned: a resumed request draws its tokens again)
        failed_decode, self.decode_launching = self.decode_launching, None
        for r in self.requests.values():
            r.inflight_steps = 0  # (the abandoned step's: finished requests are reaped now)
            if r.kv_len > 0:  # (the broken step may have written past kv_len: not cached)
                r.kv_trusted = False
        started = sorted(
            (r for r in self.requests.values() if r.state in _STARTED), key=lambda r: r.arrival
        )
        limits = self.scheduler.limits
        if len(started) <= 1:
            for r in started:
                r.finish("abort", message=f"the device ran out of memory running it alone: {error}")
        else:
            limits.max_running_requests = self.running_cap.ran_out_of_memory(
                len(started), limits.max_running_requests, failed_decode
            )
            for r in reversed(started):  # (each to the queue's front: the oldest ends first)
                self.scheduler.retract(r)
            self.worker.forget_batch()
            self.num_out_of_memory_retractions += 1
            log.warning(
                "the device ran out of memory with %d requests started; retracted them and "
                "now run at most %d at once: %s",
                len(started),
                limits.max_running_requests,
                error,
            )
        if self.device.type == "cuda":
            release_cached_memory()  # (what the failed step's allocator cached)
        self.host_clock.interrupt()
        return self._reap_finished()  # (the one that failed, and those that had finished)

    def _run_prefill(self, chunks) -> list[Request]:
        self.host_clock.interrupt()
        self.decode_launching = None  # (not a decode step, should this one fail)
        sampled = self.worker.prefill(chunks)
        self.num_steps += 1
        self.num_prefill_batches += 1
        touched = []
        for c in chunks:
            self.scheduler.prefill_done(c)
            if c.completes:
                req = c.req
                first = req.first_token_time is None  # (not a resumed retraction)
                if first:
                    req.first_token_time = time.perf_counter()
                token, logprobs = sampled[req.rid]
                if req.params.max_new_tokens == 0:  # prompt scoring: the prefill was all
                    req.finish("length", length=0)
                else:
                    self._append_tokens(req, [token], logprobs)
                    # new text for the policy: a request that will decode with drafts
                    drafts = first and not req.finished and req.params.speculative
                    if self.adaptive is not None and drafts:
                        self.adaptive.arrived()
                touched.append(req)
        return touched

    def _append_tokens(
        self, req: Request, tokens: list[int], logprobs: TokenLogprobs | None = None
    ) -> int:
        """The host-side work on one request's new tokens (detokenizing, stop checks; the
        log-probs of the tokens kept); returns how many were kept. A failure there fails that
        request alone; finishing it is enough, since its pages are reaped only once no
        launched step can still write them."""
        try:
            # the grammar first: it keeps the tokens up to the one completing it, or before
            # one it refuses (a draw at a node past its completion is unconstrained)
            ended = None
            if req.grammar is not None:
                tokens, ended = req.grammar.take(tokens)
            kept = self.stop_checker.append_tokens(req, tokens, last_stops=ended == "complete")
            if logprobs is not None:
                req.logprobs.output.extend(logprobs, limit=kept)
            if ended == "refused" and not req.finished:
                refuse_by_grammar(req)
            return kept
        except Exception as e:
            log.exception("request %s: processing its new tokens failed", req.rid)
            req.finish("abort", message=f"internal error: {type(e).__name__}: {e}")
            return 0

    def describe_adaptive(self) -> dict | None:
        """The adaptive policy's view, and how often drafts caught up or were let go."""
        if self.adaptive is None:
            return None
        out = self.adaptive.describe()
        out["device_seconds"] = self.timed_step_seconds
        if self.draft_lag is not None:
            out["catch_ups"] = self.draft_lag.num_catch_ups
            out["stopped_speculating"] = self.draft_lag.num_stale
        # (requests that reused cached KV without exact draft entries, and so decode plainly)
        out["started_plainly_from_cache"] = self.scheduler.num_plain_reuses
        return out

    def _launch_decode(self, reqs: list[Request]):
        kv_upper = [r.kv_len + r.inflight_steps * self.worker.max_accept for r in reqs]
        tier, lagged, everyone = 0, None, False
        catch_ups: tuple[bool, bool] | None = None  # (speculative, plain), as DraftLag decides
        if self.adaptive is not None:
            # (one pass over the batch: at 128 requests of a small model each pass is a few
            # percent of the host's time, which is the step's)
            live = [r for r in reqs if r.params.speculative and not r.draft_stale]
            everyone = len(live) == len(reqs)
            ready = None
            if live:
                # whether a speculative, and a plain, step would catch the draft up (as
                # DraftLag.plan decides): its graph, and its width, are then a catch-up's
                lag, pays = self.draft_lag, lambda: self.adaptive.speculation_pays(len(reqs))
                speculative = lag is not None and lag.catches_up(1, live, pays)
                plain = speculative and lag.catches_up(0, live, pays)  # (a full ring lags)
                catch_ups = (speculative, plain)
                ready = self.worker.ready_tiers(
                    reqs, kv_upper, len(self.adaptive.tiers), lambda t: speculative if t else plain
                )
            tier = self.adaptive.pick(len(reqs), bool(live), ready=ready)
            if self.draft_lag is not None:
                known = None if catch_ups is None else catch_ups[0 if tier else 1]
                lagged = self.draft_lag.plan(
                    reqs, tier, lambda: self.adaptive.speculation_pays(len(reqs)), live, known
                )
        host = self.host_clock.launch()
        # (on a CPU the step's own work runs inside the launch: no separate host time)
        if host is not None and self.adaptive is not None and self.device.type == "cuda":
            self.adaptive.observe_host(*host)
        self.decode_launching = len(reqs)  # (what ran out of memory, if it does)
        pending = self.worker.launch_decode(
            reqs,
            kv_upper,
            tier,
            timed=self.adaptive is not None,
            catch_up=lagged is not None and lagged.catch_up,
        )
        self.decode_launching = None
        graphs = self.worker.graphs
        if pending.draws_adjusted or (
            graphs is not None and (graphs.captured_last or graphs.eager_last)
        ):
            self.host_clock.interrupt()  # a capture's or an eager launch's time: no step's
        pending.lagged = lagged
        pending.everyone_speculates = everyone  # (at launch)
        for r in reqs:
            r.inflight_steps += 1
        self.num_steps += 1
        return pending

    def _finish_decode(self, pending) -> list[Request]:
        """Wait for a launched step and apply its results (skipping requests that finished
        or were aborted meanwhile: their outputs were already final)."""
        start = time.perf_counter()
        out = pending.result()
        waited = time.perf_counter() - start
        self.host_clock.waited(waited, pending.tier, len(pending.reqs), sum(out.accept_lens))
        lagged = pending.lagged
        if self.adaptive is not None:
            stale = lagged.stale if lagged is not None else frozenset()
            speculating, reach = out.accept_lens, out.chain_reach
            if not (pending.everyone_speculates and not stale):
                spoke = [r.params.speculative and r.rid not in stale for r in pending.reqs]
                speculating = [n for n, s in zip(out.accept_lens, spoke) if s]
                if reach is not None:
                    reach = [n for n, s in zip(reach, spoke) if s]
            seconds = None if lagged is not None and lagged.catch_up else pending.seconds
            self.adaptive.observe(pending.tier, len(pending.reqs), speculating, seconds, reach)
            self.timed_step_seconds += pending.seconds or 0.0
        if lagged is not None and DraftLag.changes_nothing(lagged):
            lagged = None
        touched = []
        emitted = {}
        logprobs = out.logprobs or [None] * len(pending.reqs)
        # (one pass over the batch, its loop-invariant lookups hoisted: at large batches of a
        # small model the host's time is the step's)
        drafter, decode_done = self.worker.drafter, self.scheduler.decode_done
        observes, speculative = drafter.observes_tokens, drafter.speculative
        verified = accepted = 0
        for req, tokens, n, lp in zip(pending.reqs, out.emitted, out.accept_lens, logprobs):
            req.inflight_steps -= 1
            if req.finished:
                continue
            if lagged is not None:
                DraftLag.applied(lagged, req, n)
            kept = self._append_tokens(req, tokens, lp)
            decode_done(req, n)  # (after: a request just finished keeps less)
            if observes:
                emitted[req.rid] = tokens
            touched.append(req)
            if speculative and kept:
                # (the tokens kept, not accepted: a stop or max_new_tokens inside the run
                # drops the rest, and the statistics count what the client received)
                req.spec_verify_ct += 1
                hist = req.spec_accept_histogram
                if len(hist) < kept:
                    hist.extend([0] * (kept - len(hist)))
                hist[kept - 1] += 1
                verified += 1
                accepted += kept
        self.spec_totals["verify_ct"] += verified
        self.spec_totals["accepted"] += accepted
        limits = self.scheduler.limits  # (after running out of memory: climbs back slowly)
        limits.max_running_requests = self.running_cap.decode_step_done(limits.max_running_requests)
        if emitted:
            self.worker.observe_tokens(emitted)
        if self.worker.drafter.speculative and self.num_steps % 100 == 0:
            t = self.spec_totals
            log.info(
                "speculative: %d verifies, mean accept length %.3f",
                t["verify_ct"],
                t["accepted"] / max(1, t["verify_ct"]),
            )
        return touched

    def drain(self) -> list[Request]:
        """Apply the step in flight, if any (shutdown, tests)."""
        if self.pending is None:
            return []
        pending, self.pending = self.pending, None
        return self._finish_decode(pending) + self._reap_finished()

    def _reap_finished(self) -> list[Request]:
        # A request still in a launched step keeps its pages until that step is applied.
        done = [r for r in self.requests.values() if r.finished and r.inflight_steps == 0]
        if not done:
            return done
        start = time.perf_counter()
        try:
            self._reap(done)
        finally:
            self.host_clock.set_aside(time.perf_counter() - start)
        return done

    def _reap(self, done: list[Request]) -> None:
        for r in done:
            self.scheduler.remove(r)
            del self.requests[r.rid]
            self.paced.discard(r.rid)
            if self.by_name.get(r.name) is r:
                del self.by_name[r.name]
        # after the tables: should freeing a request's worker state fail, no request is left
        # half-removed for the loop's error path to trip over again
        for r in done:
            self.worker.forget(r.rid)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (the engine is shutting down)."""
        if self.peers is not None:
            self.peers.stop()

    def flush_cache(self) -> int:
        """Drop every cached page no live request uses; returns how many were dropped."""
        cache = self.scheduler.cache
        return 0 if cache is None else cache.flush()

    def check_invariants(self) -> None:
        self.table.check_invariants(set(self.requests))
        cache = self.scheduler.cache
        if cache is not None:
            cache.check_locks([r.cache_node for r in self.requests.values() if r.cache_node])
        for r in self.scheduler.running:
            if r.finished:
                continue  # waiting for its last launched step
            assert r.state is ReqState.RUNNING
            assert r.kv_len == len(r.all_ids) - 1, (
                f"{r.rid}: kv_len {r.kv_len} != {len(r.all_ids) - 1}"
            )
            assert self.table.capacity(r.rid) >= r.kv_len
