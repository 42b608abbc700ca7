"""A request and its explicit life cycle.

WAITING --(scheduled for prefill)--> PREFILLING --(last chunk done)--> RUNNING
RUNNING --(KV exhausted: retract)--> WAITING   (outputs kept; resumed by re-prefilling them)
any --(stop condition / abort / error)--> FINISHED
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.runtime.logprobs import RequestLogprobs
from specserve.sampling_params import SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


_ALLOWED = {
    ReqState.WAITING: {ReqState.PREFILLING, ReqState.FINISHED},
    ReqState.PREFILLING: {
        ReqState.PREFILLING,
        ReqState.RUNNING,
        ReqState.WAITING,
        ReqState.FINISHED,
    },
    ReqState.RUNNING: {ReqState.WAITING, ReqState.FINISHED},
    ReqState.FINISHED: set(),
}


@dataclass(eq=False)  # identity: two requests are never 'equal'
class Request:
    # the engine's key for the request's pages and rows; it is the caller's id (`name`)
    # unless a request of that name finished but still holds its pages (reaped a step later)
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    on_output: Callable[[Request], None] | None = None
    # Log-probabilities (SGLang's names). Prompt tokens from logprob_start_len on get theirs
    # (-1: none of the prompt), so prefill must compute the target's logits at every prompt
    # position >= logprob_start_len (token i's value is read at position i - 1; token
    # logprob_start_len itself reports None): a cached prefix must not cover them.
    return_logprob: bool = False
    top_logprobs_num: int = 0  # alternatives per position (with return_logprob)
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False  # each entry also carries its token's text
    logprobs: RequestLogprobs = field(default_factory=RequestLogprobs)
    # Sample i > 0 of a prompt with n > 1 names sample 0 here: its prefill may wait for
    # sample 0's, to reuse the prompt's pages.
    prefill_after: Request | None = None
    sample_of: str | None = None  # the rid a prompt's n > 1 samples were submitted under
    state: ReqState = ReqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Tokens of all_ids whose target KV is cached. While RUNNING: len(all_ids) - 1 (the last
    # token is the next step's input). While PREFILLING: how far prefill got.
    kv_len: int = 0
    finish_reason: dict[str, Any] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_retractions: int = 0
    inflight_steps: int = 0  # launched decode steps whose results are not applied yet
    finish_reported: bool = False  # the final output went out (reaping comes later)
    name: str = ""  # the id the caller knows the request by (rid when not given)
    # prefix cache: prompt tokens served from it at the first admission, and the deepest
    # cache node this request holds locked
    cached_tokens: int | None = None
    cache_node: Any = None
    kv_trusted: bool = True  # False after a failed device step: its KV is not cached
    # load-adaptive speculation (runtime/draft_lag.py)
    draft_lag: int = 0  # plain steps launched since the draft was last current
    draft_behind: int = 0  # tokens at the end of the KV without an exact draft entry
    draft_stale: bool = False  # stopped speculating: its draft fell too far behind
    # the positions whose draft KV is exact, where it reused the target-only KV of cached
    # pages past them (and so decodes plainly: kv/prefix_cache.py); None: every position's
    draft_exact_until: int | None = None
    # decodes plainly because the KV cache cannot hold its speculative step's window (it was
    # the only request left): each step reserves only the position it writes (scheduler.py)
    plain_to_fit: bool = False
    # speculative decoding statistics (SGLang's names)
    # structured output: the grammar's state after the emitted tokens (runtime/grammar.py)
    grammar: Any = None
    spec_verify_ct: int = 0
    spec_accept_histogram: list[int] = field(default_factory=list)
    # detokenized output (maintained by the engine's detokenizer)
    text: str = ""
    # the caller reads the text only once the request has finished (`Engine.generate`
    # without streaming): it is decoded then, in one call, instead of token by token on the
    # engine's loop (under cProfile at a batch of 128 on an H200: 13% of a step's host time)
    text_at_finish: bool = False
    stream_sent_tokens: int = 0
    stream_sent_chars: int = 0
    stream_sent_input_logprobs: bool = False
    detok: Any = None
    stop_tails: Any = None  # what a stream holds back for stop strings (runtime/output.py)
    final_output_sent: bool = False  # its caller has its last output (Engine._deliver)
    penalties: Any = None  # its penalties' device state, once used (runtime/penalties.py)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.rid

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def fill_len(self) -> int:
        """Tokens a (re-)prefill must process: everything known so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def detokenizes_live(self) -> bool:
        """Whether the engine keeps `text` current as tokens come (stop strings need it)."""
        return not self.text_at_finish or bool(self.params.stop)

    @property
    def text_ids(self) -> list[int]:
        """The output ids whose text is the request's: all but a token that stopped it."""
        reason = self.finish_reason or {}
        trimmed = not self.params.no_stop_trim
        if trimmed and reason.get("type") == "stop" and isinstance(reason.get("matched"), int):
            return self.output_ids[:-1]
        return self.output_ids

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    def set_state(self, new: ReqState) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"request {self.rid}: illegal transition {self.state} -> {new}")
        self.state = new

    def finish(self, reason: str, **details: Any) -> None:
        if self.finished:
            return
        self.set_state(ReqState.FINISHED)
        self.finish_reason = {"type": reason, **details}
        self.finish_time = time.perf_counter()


@dataclass
class PrefillChunk:
    """Positions [start, end) of a request's tokens, prefilled in one batch."""

    req: Request
    start: int
    end: int
    # (cached page, the request's own page): copied before the forward (a recomputed boundary)
    copy_page: tuple[int, int] | None = None
    # the first chunk since the request was admitted: positions before `start` (a cached
    # prefix) were never prefilled for this request
    first: bool = False

    @property
    def completes(self) -> bool:
        return self.end == self.req.fill_len
