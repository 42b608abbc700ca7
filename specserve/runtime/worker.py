"""Runs scheduled batches on the device: prefill chunks, and launching and awaiting decode
steps (speculative/step.py); reads and writes the requests' device rows.

A decode step is launched without waiting for anything on the device; `PendingDecode` is
where the host later learns what it produced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from specserve.config.kernels import Kernels
from specserve.device import to_device
from specserve.kv.request_rows import RequestRows
from specserve.kv.table import KVInvariantError, KVTable
from specserve.model.runner import ModelRunner
from specserve.ops.attention_metadata import Segment, build_metadata
from specserve.ops.logprobs import token_logprobs, top_logprobs_bucket
from specserve.ops.sampling import SamplingMode, SamplingTensors, sample
from specserve.ops.token_bitmask import apply_token_bitmask
from specserve.runtime.grammar import batch_grammar, next_token_bitmask
from specserve.runtime.logprobs import TokenLogprobs, host_rows
from specserve.runtime.penalties import batch_penalties
from specserve.runtime.penalty_rows import PenaltyRows
from specserve.runtime.request import PrefillChunk, Request
from specserve.speculative.step import DecodeStep, StepLogprobs

log = logging.getLogger(__name__)

# Prompt log-probs are computed this many positions at a time: [rows, vocab] float32 logits
# of a whole long chunk would not fit.
PROMPT_LOGPROB_ROWS = 256
# A prefill batch of up to this many chunks that each fit a captured prefill graph replays
# one graph per chunk: an eager forward costs ~16 ms of host time (kernel launches), and one
# replay costs a read of the weights (~3.7 ms at the 8B shape, far less for small models).
# So up to four replays cost no more than one eager batch even at 8B; more run eagerly.
MAX_GRAPHED_PREFILL_CHUNKS = 4


@dataclass
class DecodeOutput:
    emitted: list[list[int]]  # per request: accepted draft tokens then the bonus token
    accept_lens: list[int]
    # per request: the emitted tokens' log-probs, for requests that ask for them
    logprobs: list[TokenLogprobs | None] | None = None
    # per request: accepted draft tokens on the draft's greedy chain (adaptive speculation)
    chain_reach: list[int] | None = None


class StepTimer:
    """A launched step's own duration: CUDA events right around its launch (the device's
    time, read once the step is done), or on a synchronous device the host's clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start, self.end = time.perf_counter(), None

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.end = time.perf_counter()

    def seconds(self) -> float:
        """(After the step's results were awaited.)"""
        return self.start.elapsed_time(self.end) / 1e3 if self.cuda else self.end - self.start


def rows_of_one(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[2, n]: two [n] tensors as the rows of one, a view where they are already two rows of
    one tensor (the decode step returns them so), else stacked (a kernel launch)."""
    n = first.shape[0]
    gap = second.storage_offset() - first.storage_offset()
    if (
        first.dtype == second.dtype
        and first.stride() == second.stride() == (1,)
        and second.shape[0] == n
        and gap >= n
        and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    ):
        return first.as_strided((2, n), (gap, 1))
    return torch.stack((first, second))


class PendingDecode:
    """A launched decode step. Its per-request results are copied to the host without
    blocking; `result()` waits for them, which is the only point where the host learns
    the accepted lengths (one step later, under overlap scheduling)."""

    def __init__(
        self,
        reqs: list[Request],
        accept_len: torch.Tensor,
        emitted: torch.Tensor,
        logprobs: StepLogprobs | None = None,
        chain_reach: torch.Tensor | None = None,
        tier: int = 0,
        timer: StepTimer | None = None,
    ):
        """timer: the step's own time, known once its results are (`seconds`)."""
        self.reqs = reqs
        self.tier = tier
        self.lagged = None  # what the step did to lagging drafts (runtime/draft_lag.py)
        self.everyone_speculates = False  # every request in it speculated at launch
        # its draws were masked to grammars (waiting on the host mid-step, eagerly) or
        # penalized, so its times are no tier's own (set by the worker)
        self.draws_adjusted = False
        self._timer = timer
        self.seconds: float | None = None
        self._reach = chain_reach is not None
        # (the reach travels in the accepted lengths' copy: one transfer, not two)
        outs = [accept_len if chain_reach is None else rows_of_one(accept_len, chain_reach)]
        outs.append(emitted)
        if logprobs is not None:
            outs.append(logprobs.token)
            if logprobs.top_values is not None:
                outs += [logprobs.top_values, logprobs.top_ids]
        if accept_len.device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in outs]
            for host, dev in zip(self._host, outs):
                host.copy_(dev, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = outs, None

    def result(self) -> DecodeOutput:
        if self._event is not None:
            self._event.synchronize()
        if self._timer is not None:
            self.seconds = self._timer.seconds()
        lens, emitted = self._host[0].tolist(), self._host[1].tolist()
        reach = None
        if self._reach:
            lens, reach = lens
        out = DecodeOutput([e[:n] for e, n in zip(emitted, lens)], lens, chain_reach=reach)
        if len(self._host) > 2:
            token = self._host[2].tolist()
            values, ids = (h.tolist() for h in self._host[3:5]) if len(self._host) > 3 else ([], [])
            out.logprobs = [
                host_rows(
                    token[i][:n],
                    values[i][:n] if values else None,
                    ids[i][:n] if ids else None,
                    r.top_logprobs_num,
                )
                if r.return_logprob
                else None
                for i, (r, n) in enumerate(zip(self.reqs, lens))
            ]
        return out


def decodes_plainly(req: Request) -> bool:
    """Whether a request's steps verify its root alone: it asked so, or its draft went stale."""
    return req.draft_stale or not req.params.speculative


def sampling_row(req: Request) -> tuple[tuple[float, float, float], tuple[int, int, int]]:
    """A request's column of the sampling tables (`SamplingTensors.from_tables`)."""
    p = req.params
    return (p.temperature, p.top_p, p.min_p), (p.top_k, req.seed, int(decodes_plainly(req)))


def request_sampling_mode(reqs: list[Request]) -> SamplingMode:
    asking = [r.top_logprobs_num for r in reqs if r.return_logprob]
    return SamplingMode(
        all_greedy=all(r.params.greedy for r in reqs),
        needs_filter=any(r.params.needs_filter and not r.params.greedy for r in reqs),
        logprobs=bool(asking),
        top_logprobs=top_logprobs_bucket(max(asking, default=0)) if asking else 0,
        any_plain=any(decodes_plainly(r) for r in reqs),
        penalized=any(r.params.adjusts_logits for r in reqs),
    )


def request_sampling(reqs: list[Request], device: torch.device) -> SamplingTensors:
    """A batch's sampling tensors built on the host (a prefill's first tokens; decode steps
    gather theirs by row): two host-to-device copies."""
    floats, ints = zip(*(sampling_row(r) for r in reqs))
    return SamplingTensors.from_tables(
        to_device(torch.tensor(floats, dtype=torch.float32).T.contiguous(), device),
        to_device(torch.tensor(ints, dtype=torch.int64).T.contiguous(), device),
        request_sampling_mode(reqs),
    )


class Worker:
    def __init__(
        self,
        target: ModelRunner,
        table: KVTable,
        rows: RequestRows,
        drafter,
        kernels: Kernels,
        simulator=None,
        tiers=None,
        eos_token_ids: frozenset[int] = frozenset(),
    ):
        """drafter: a TreeDrafter, or the RootOnlyDrafter of plain decoding; tiers: the tree
        shapes a step may draft (load-adaptive speculation), else the drafter's own;
        eos_token_ids: the model's (min_new_tokens holds them back)."""
        self.target = target
        self.table = table
        self.rows = rows  # per-request device state: page table, kv_len, root, draft feature
        self.device = rows.device
        self.drafter = drafter
        self.kernels = kernels
        self.step = DecodeStep(target, drafter, rows, kernels, simulator, tiers)
        self.vocab_size = target.model.config.vocab_size
        self.eos_token_ids = eos_token_ids
        self.graphs = None  # DecodeGraphs, when CUDA graphs are on
        self.prefill_graphs = None  # PrefillGraphs, when CUDA graphs are on
        self._sampling_cache: tuple[tuple, SamplingMode] | None = None
        self.penalty_rows: PenaltyRows | None = None  # made when a penalized request decodes
        self._penalized_eager = False  # (a penalized graph failed to capture)

    # ---- sizes the scheduler must reserve ------------------------------------------------
    @property
    def max_accept(self) -> int:
        """Most tokens one decode step can add to a request."""
        return self.step.max_accept

    @property
    def decode_window(self) -> int:
        """Logical positions past kv_len a decode step writes (target tree + draft scratch)."""
        return self.step.window

    @property
    def slot_width(self) -> int:
        """Logical positions past kv_len whose slots a decode step may read (>= the window)."""
        return self.step.slot_width

    def tier_slot_width(self, tier: int, catch_up: bool) -> int:
        """`slot_width` of a step of `tier` alone (speculative/step.py)."""
        return self.step.tier_slot_width(tier, catch_up)

    @property
    def kv_lookahead(self) -> int:
        """Positions past kv_len that stay owned between steps (a standalone draft's root)."""
        return self.drafter.lookahead

    def forget(self, rid: str) -> None:
        if self._sampling_cache is not None and any(
            r.rid == rid for r in self._sampling_cache[0][0]
        ):
            self._sampling_cache = None  # (it holds the request)
        if self.drafter.observes_tokens:
            self.drafter.release_tokens((rid,))

    def forget_batch(self) -> None:
        """Drop the last batch's sampling mode: its requests were retracted together and
        resume in other rows, which a batch of the same requests must write again."""
        self._sampling_cache = None

    def capture_wanted(self) -> bool:
        """Capture one decode graph that steps have so far replayed a larger graph for (call
        only while no step is in flight); whether there was one."""
        return self.graphs is not None and self.graphs.capture_wanted()

    def observe_tokens(self, tokens_by_request: dict[str, Sequence[int]]) -> None:
        """Prompt and output tokens of running requests (a growing draft vocabulary's input)."""
        if self.drafter.observes_tokens:
            self.drafter.observe_tokens(tokens_by_request)

    # ---- prefill --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk]) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Run the chunks; return the first sampled token of each request whose prefill
        completes, with its log-prob when the request asks for it. Prompt log-probs go to
        the requests' records here (they are never cut by a stop)."""
        if self._replay_each(chunks):
            first: dict[str, tuple[int, TokenLogprobs | None]] = {}
            for c in chunks:
                first.update(self.prefill([c]))
            return first
        for c in chunks:
            if c.copy_page is not None:
                self._copy_page(*c.copy_page)
        tokens = [t for c in chunks for t in c.req.all_ids[c.start : c.end]]
        # a growing draft vocabulary takes every token of the request, a cached prefix's too
        self.observe_tokens(
            {c.req.rid: c.req.all_ids[0 if c.first else c.start : c.end] for c in chunks}
        )
        dev = self.device
        capture = self.drafter.capture_layers
        out = None
        if self.prefill_graphs is not None and len(chunks) == 1:
            c = chunks[0]
            if self.table.capacity(c.req.rid) < c.end:  # (the eager path's slots() checks it)
                raise KVInvariantError(f"{c.req.rid}: prefill to {c.end} exceeds its pages")
            self.rows.flush()  # the graph reads the request's pages on the device
            out = self.prefill_graphs.forward(self.rows.row(c.req.rid), c.start, tokens, capture)
        graphed = out is not None
        if out is None:
            input_ids = to_device(torch.tensor(tokens, dtype=torch.int64), dev)
            positions = [p for c in chunks for p in range(c.start, c.end)]
            pos = to_device(torch.tensor(positions, dtype=torch.int64), dev)
            out = self.target.forward(input_ids, pos, self._prefill_metadata(chunks), capture)
        self._prompt_logprobs(chunks, out.hidden)

        done = [i for i, c in enumerate(chunks) if c.completes]
        sampled = None
        if done:
            ends = [0]
            for c in chunks:
                ends.append(ends[-1] + c.end - c.start)
            last_rows = to_device(torch.tensor([ends[i + 1] - 1 for i in done]), dev)
            logits = self.target.model.compute_logits(out.hidden[last_rows], self.kernels)
            reqs = [chunks[i].req for i in done]
            sample_pos = to_device(torch.tensor([chunks[i].end for i in done]), dev)
            drawn_from = logits  # (log-probs: the model's own, as vLLM reports them)
            penalties = batch_penalties(reqs, self.vocab_size, self.eos_token_ids, dev)
            if penalties is not None:
                drawn_from = penalties.draws(logits)
            if any(r.grammar is not None for r in reqs):
                drawn_from = drawn_from.clone() if drawn_from is logits else drawn_from
                apply_token_bitmask(drawn_from, next_token_bitmask(reqs, logits.shape[-1], dev))
            sampled = sample(drawn_from, request_sampling(reqs, dev), sample_pos, self.kernels)
            first_logprobs = self._first_token_logprobs(reqs, logits, sampled)
        if graphed and self.drafter.graphs_prefill:
            c = chunks[0]  # the token after the chunk: sampled, or the prompt's own
            g = self.prefill_graphs.draft(sampled if done else c.req.all_ids[c.end])
            features = g if done else None
        else:
            features = self.drafter.extend_after_prefill(chunks, out, done, sampled)
        if sampled is None:
            return {}
        rows = self.rows.rows_of([chunks[i].req.rid for i in done])
        # the draft has its entries for the whole prompt: it is exact up to kv_len
        rows_dev = to_device(torch.tensor(rows), dev)
        self.rows.set_state(rows_dev, sample_pos, sampled, features, sample_pos)
        self.rows.reset_calibration(rows_dev)
        values = sampled.tolist()
        first = {chunks[i].req.rid: (values[j], first_logprobs[j]) for j, i in enumerate(done)}
        self.observe_tokens({rid: (t,) for rid, (t, _) in first.items()})
        return first

    def _replay_each(self, chunks: list[PrefillChunk]) -> bool:
        """Whether a batch of several chunks runs as one graph replay per chunk."""
        graphs = self.prefill_graphs
        return (
            graphs is not None
            and 1 < len(chunks) <= MAX_GRAPHED_PREFILL_CHUNKS
            and all(graphs.bucket(c.start, c.end - c.start) is not None for c in chunks)
        )

    def _copy_page(self, src: int, dst: int) -> None:
        """A cached page's KV (target and draft) into a request's own page."""
        ps = self.table.page_size
        for cache in (self.target.kv_cache, *self.drafter.kv_caches()):
            cache.buffer[:, :, dst * ps : (dst + 1) * ps] = cache.buffer[
                :, :, src * ps : (src + 1) * ps
            ]

    # ---- log-probabilities of prefill --------------------------------------------------------
    def _first_token_logprobs(
        self, reqs: list[Request], logits: torch.Tensor, sampled: torch.Tensor
    ) -> list[TokenLogprobs | None]:
        """The sampled first tokens' log-probs, from the prompts' last logits."""
        asking = [j for j, r in enumerate(reqs) if r.return_logprob]
        out: list[TokenLogprobs | None] = [None] * len(reqs)
        if not asking:
            return out
        k = max(reqs[j].top_logprobs_num for j in asking)
        sel = to_device(torch.tensor(asking), self.device)
        rows = _host_logprobs(*token_logprobs(logits[sel], sampled[sel], k))
        for at, j in enumerate(asking):
            out[j] = rows(at, at + 1, reqs[j].top_logprobs_num)
        return out

    def _prompt_logprobs(self, chunks: list[PrefillChunk], hidden: torch.Tensor) -> None:
        """Append to each asking request's record the log-probs of the prompt tokens that
        positions of its chunk predict (token t from position t - 1), from its
        logprob_start_len on; earlier chunks of the prompt gave the ones before."""
        rows: list[int] = []
        tokens: list[int] = []
        owners: list[tuple[Request, int]] = []
        offset = 0
        for c in chunks:
            req = c.req
            if req.wants_prompt_logprobs:
                rec = req.logprobs.input
                if len(rec) == 0:  # the range's first token: nothing of the range precedes it
                    rec.extend(TokenLogprobs([None], [None]))
                nxt = req.logprob_start_len + len(rec)  # the next token without a value
                lo, hi = max(nxt - 1, c.start), min(len(req.prompt_ids) - 1, c.end)
                if lo > nxt - 1 and lo < hi:
                    # positions before this chunk were never computed (a cached prefix covered
                    # them): report them as unknown rather than shift every later value
                    log.warning("request %s: prompt log-probs %d..%d unknown", req.rid, nxt, lo)
                    rec.extend(TokenLogprobs([None] * (lo + 1 - nxt), [None] * (lo + 1 - nxt)))
                if lo < hi:
                    rows += range(offset + lo - c.start, offset + hi - c.start)
                    tokens += req.prompt_ids[lo + 1 : hi + 1]
                    owners.append((req, hi - lo))
            offset += c.end - c.start
        if not rows:
            return
        k = max(r.top_logprobs_num for r, _ in owners)
        values = TokenLogprobs()
        for at in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            part = slice(at, at + PROMPT_LOGPROB_ROWS)
            idx = to_device(torch.tensor(rows[part]), self.device)
            logits = self.target.model.compute_logits(hidden[idx], self.kernels)
            ids = to_device(torch.tensor(tokens[part]), self.device)
            chunk = _host_logprobs(*token_logprobs(logits, ids, k))(0, None, k)
            values.extend(chunk)
        at = 0
        for req, m in owners:
            own = values.top[at : at + m]
            kk = req.top_logprobs_num
            req.logprobs.input.extend(
                TokenLogprobs(values.values[at : at + m], [t[:kk] for t in own])
            )
            at += m

    def _prefill_metadata(self, chunks: list[PrefillChunk]):
        segments, out_slots = [], []
        for c in chunks:
            n = c.end - c.start
            segments.append(Segment(self.table.slots(c.req.rid, 0, c.end), n, n))
            out_slots.append(self.table.slots(c.req.rid, c.start, c.end))
        return build_metadata(segments, torch.cat(out_slots), self.device)

    # ---- decode -----------------------------------------------------------------------------
    def _sampling_for(self, reqs: list[Request]) -> SamplingMode:
        """A batch's sampling mode, reused while its membership (and which of its requests
        decode plainly) is unchanged; when it changes, the rows of requests new to their row,
        or that stopped speculating, get their sampling parameters (the step gathers the
        rest by row on the device). (Asked twice a step under adaptive speculation: the key
        is the requests themselves, identity-compared, and the stale ones among them, a
        quarter of the cost of a pair per request at batch 128; `forget` drops it when one
        of them is reaped.)"""
        key = (tuple(reqs), tuple(r for r in reqs if r.draft_stale))
        if self._sampling_cache is None or self._sampling_cache[0] != key:
            self._write_sampling_rows(reqs)
            self._sampling_cache = (key, request_sampling_mode(reqs))
        return self._sampling_cache[1]

    def _write_sampling_rows(self, reqs: list[Request]) -> None:
        """Write the sampling parameters of the requests whose row does not hold theirs: a
        row's tag is (its request, whether it decodes plainly), and a released row has none
        (so a request resumed after a retraction, in whatever row, writes its own again)."""
        table = self.rows
        rows, floats, ints, tags = [], [], [], []
        for r in reqs:
            row, plain = table.row(r.rid), decodes_plainly(r)
            held = table.sampling_tag(row)
            if held is not None and held[0] is r and held[1] == plain:
                continue
            f, i = sampling_row(r)
            rows.append(row)
            floats.append(f)
            ints.append(i)
            tags.append((r, plain))
        table.set_sampling(rows, floats, ints, tags)

    def ready_tiers(
        self, reqs: list[Request], kv_upper: list[int], tiers: int, catch_up
    ) -> AbstractSet[int] | None:
        """The tiers whose step over `reqs` replays a graph already captured (None: steps of
        this batch are not replayed from graphs); see DecodeGraphs.ready_tiers."""
        if self.graphs is None:
            return None
        kv_bound = max(kv_upper)
        return self.graphs.ready_tiers(
            len(reqs), kv_bound, self._sampling_for(reqs), tiers, catch_up
        )

    @torch.inference_mode()
    def launch_decode(
        self,
        reqs: list[Request],
        kv_upper: list[int],
        tier: int = 0,
        timed: bool = False,
        catch_up: bool = False,
    ) -> PendingDecode:
        """One decode step (speculative/step.py) of `reqs` drafting the step's tier `tier`,
        replayed from a CUDA graph when one fits; nothing waits for the device. kv_upper:
        host bounds of each kv_len. timed: measure the step's own time (adaptive tiers).
        catch_up: the draft first runs over the positions plain steps skipped."""
        self.rows.flush()
        rows = self.rows.rows_of([r.rid for r in reqs])
        sampling = self._sampling_for(reqs)
        width = max(kv_upper) + self.tier_slot_width(tier, catch_up)
        timer = StepTimer(self.device) if timed else None  # around the step alone
        out = None
        # structured output: the step waits for its drafts to mask the target's draws on the
        # host, so it runs eagerly; penalties live by row on the device (penalty_rows.py)
        draws = {}  # (the keyword arguments DecodeStep.run takes for them)
        if (grammar := batch_grammar(reqs, self.vocab_size)) is not None:
            draws["grammar"] = grammar
        if sampling.penalized:
            self._penalties().write(reqs, rows)
        if (
            self.graphs is not None
            and not draws
            and not (sampling.penalized and self._penalized_eager)
        ):
            out = self._replay(rows, sampling, width, tier, catch_up)
            if self.graphs.captured_last or self.graphs.covered_last or self.graphs.eager_last:
                # a capture's time, a larger shape's, or launches a graph will not have, are
                # not what this step will take
                timer = None
        if out is None:
            rows_dev = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
            st = SamplingTensors.gather(
                self.rows.sampling_floats, self.rows.sampling_ints, rows_dev, sampling
            )
            if sampling.penalized:
                draws["penalties"] = self.penalty_rows.batch(rows_dev)
            out = self.step.run(rows_dev, st, width, kv_upper, tier, catch_up, **draws)
        adjusted = bool(draws) or sampling.penalized  # (not a tier's own time)
        if adjusted:
            timer = None
        elif timer is not None:
            timer.stop()
        pending = PendingDecode(reqs, *out, tier=tier, timer=timer)
        pending.draws_adjusted = adjusted
        return pending

    def _replay(self, rows, sampling: SamplingMode, width: int, tier: int, catch_up: bool):
        try:
            return self.graphs.run(rows, sampling, width, tier, catch_up)
        except Exception:
            if not sampling.penalized or self.graphs.ran_rows_last:
                raise  # (a step run on the rows may have counted its tokens into them)
            # (captures run on padding rows alone, so no request's state has moved: its step
            # runs eagerly, as every penalized one after it)
            log.exception("capturing a penalized decode step failed; such steps run eagerly")
            self._penalized_eager = True
            return None

    def _penalties(self) -> PenaltyRows:
        if self.penalty_rows is None:  # (penalized graphs captured before it are dropped)
            self.penalty_rows = PenaltyRows(
                self.rows, self.vocab_size, self.eos_token_ids, self.device
            )
            self.rows.attach(self.penalty_rows)
        return self.penalty_rows


def _host_logprobs(token: torch.Tensor, values: torch.Tensor | None, ids: torch.Tensor | None):
    """Device log-probs brought to the host at once; returns rows(start, end, k) ->
    TokenLogprobs of those rows with k alternatives each."""
    token_h = token.tolist()
    values_h = values.tolist() if values is not None else None
    ids_h = ids.tolist() if ids is not None else None

    def rows(start: int, end: int | None, k: int) -> TokenLogprobs:
        return host_rows(
            token_h[start:end],
            values_h[start:end] if values_h is not None else None,
            ids_h[start:end] if ids_h is not None else None,
            k,
        )

    return rows
