"""What a request's caller sees: its SGLang-shaped output dicts (whole, or the part not sent
before, for streams), and the request ids of a prompt's n samples."""

from __future__ import annotations

import logging
import time
from typing import Any

from specserve.runtime.logprobs import TokenLogprobs, sglang_logprobs
from specserve.runtime.request import Request

log = logging.getLogger(__name__)


def output_or_failure(req: Request, incremental: bool = False, tokenizer=None) -> dict[str, Any]:
    """`request_output`; where building it raises (e.g. a tokenizer failing to decode the
    output's ids), the request ends with that reason and this last output says so: its caller
    is never left waiting for one that never comes."""
    try:
        return request_output(req, incremental, tokenizer)
    except Exception as e:
        log.exception("the output of %s could not be built", req.rid)
        message = f"building its output failed: {type(e).__name__}: {e}"
        req.finish("abort", message=message)  # (if it had not ended already)
        return {
            "text": "",
            "output_ids": [],
            "meta_info": {
                **_base_meta(req),
                "finish_reason": {"type": "abort", "message": message},
            },
            "finished": True,
        }


def verify_tokens(histogram: list[int]) -> int:
    """Tokens emitted by verify steps, from the accept-length histogram (index i: length i+1)."""
    return sum((i + 1) * count for i, count in enumerate(histogram))


def request_output(req: Request, incremental: bool = False, tokenizer=None) -> dict[str, Any]:
    """SGLang-shaped output. incremental: only text, ids and log-probs not sent before.
    tokenizer: gives each log-prob entry its token's text (return_text_in_logprobs)."""
    first_ids = req.stream_sent_tokens if incremental else 0
    with_input = not (incremental and req.stream_sent_input_logprobs)
    if incremental:
        # While a stop string could still complete across the next tokens, hold back the end
        # of the text that could begin one: text once sent cannot be taken back.
        hold = 0
        if req.params.stop and not req.finished:
            if req.stop_tails is None:
                req.stop_tails = StopStringTails(req.params.stop)
            hold = req.stop_tails.hold(req.text)
        limit = max(req.stream_sent_chars, len(req.text) - hold)
        text = req.text[req.stream_sent_chars : limit]
        ids = req.output_ids[req.stream_sent_tokens :]
        req.stream_sent_chars, req.stream_sent_tokens = limit, len(req.output_ids)
    else:
        text, ids = req.text, list(req.output_ids)
        if not req.detokenizes_live and req.finished and req.detok is not None:
            text = req.text = req.detok.text_of(req.text_ids)
    meta = _base_meta(req)
    if req.first_token_time is not None:
        meta["ttft"] = req.first_token_time - req.arrival
    if req.spec_verify_ct:
        meta["spec_verify_ct"] = req.spec_verify_ct
        # tokens per verify step (the prefill's token not counted; 1.0: no draft accepted)
        meta["spec_accept_length"] = verify_tokens(req.spec_accept_histogram) / req.spec_verify_ct
        meta["spec_accept_histogram"] = list(req.spec_accept_histogram)
    if req.return_logprob:
        meta.update(_logprob_meta(req, first_ids, with_input, tokenizer))
    return {"text": text, "output_ids": ids, "meta_info": meta, "finished": req.finished}


# Stops longer than this are followed character by character as the text grows (below);
# shorter ones are looked for anew at each step, which costs at most this squared.
LONG_STOP = 32


class StopStringTails:
    """How much of a growing text's end could begin one of its stop strings (held back from
    a stream until the next tokens tell). Short stops: `stop_string_start` on the text's
    end. Long ones: each keeps the length of the longest end of the text that begins it
    (Knuth-Morris-Pratt), advanced over the text appended since the last call, so a step
    costs what it added. (Looked for anew, 16 stops of 1,023 characters took 12 ms a step on
    text of 'a's against stops of 'ab...': one request slowing every step of the loop.)"""

    def __init__(self, stops: list[str]):
        self.short = [s for s in stops if len(s) <= LONG_STOP]
        self.long = [s for s in stops if len(s) > LONG_STOP]
        self.borders = [_borders(s) for s in self.long]
        self.matched = [0] * len(self.long)
        self.seen = 0  # characters of the text followed so far

    def hold(self, text: str) -> int:
        """`text`: the text of the last call with more appended."""
        if len(text) < self.seen:  # (not grown from the last one: follow it afresh)
            self.matched, self.seen = [0] * len(self.long), 0
        new, self.seen = text[self.seen :], len(text)
        for j, s in enumerate(self.long):
            m, borders, n = self.matched[j], self.borders[j], len(s)
            for ch in new:
                while m and s[m] != ch:
                    m = borders[m - 1]
                if s[m] == ch:
                    m += 1
                if m == n:  # (a whole stop: the request ends; its end may begin another)
                    m = borders[m - 1]
            self.matched[j] = m
        return max(stop_string_start(text, self.short), *self.matched, 0)


def _borders(s: str) -> list[int]:
    """borders[i]: the length of the longest proper prefix of s[: i + 1] that also ends it."""
    out = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = out[k - 1]
        if s[i] == s[k]:
            k += 1
        out[i] = k
    return out


def _base_meta(req: Request) -> dict[str, Any]:
    return {
        "id": req.name,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "finish_reason": req.finish_reason,
        "e2e_latency": (req.finish_time or time.perf_counter()) - req.arrival,
        "num_retractions": req.num_retractions,
        "cached_tokens": req.cached_tokens or 0,
    }


def stop_string_start(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that begins one of `stops` (0: none)."""
    hold = 0
    for s in stops:
        tail = text[max(0, len(text) - len(s) + 1) :] if len(s) > 1 else ""
        # (only where the stop's first character is: linear in the stop's length, not
        # quadratic; this runs on the engine's loop for every streamed request every step)
        i = tail.find(s[0])
        while i >= 0 and len(tail) - i > hold:
            if s.startswith(tail[i:]):
                hold = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return hold


def _logprob_meta(req: Request, first: int, with_input: bool, tokenizer) -> dict[str, Any]:
    """SGLang's log-prob fields: the output tokens from index `first`; the prompt's entries
    once they are complete (prefill done), and only once per stream."""
    text_of = None
    if req.return_text_in_logprobs and tokenizer is not None:
        text_of = lambda t: tokenizer.decode([t])  # noqa: E731
    top = req.top_logprobs_num > 0
    rec = req.logprobs
    output = TokenLogprobs(rec.output.values[first:], rec.output.top[first:])
    meta = sglang_logprobs(output, req.output_ids[first:], "output", top, text_of)
    prefilled = req.finished or bool(req.output_ids)
    if with_input and prefilled:
        req.stream_sent_input_logprobs = True
        start = max(req.logprob_start_len, 0)
        ids = req.prompt_ids[start:] if req.logprob_start_len >= 0 else []
        meta.update(sglang_logprobs(rec.input, ids, "input", top, text_of))
    else:
        meta.update(sglang_logprobs(TokenLogprobs(), [], "input", top, text_of))
    return meta


def sample_rids(rid: str, n: int) -> list[str]:
    """The request ids of a prompt's n samples: `rid` itself for one, else rid-0 .. rid-(n-1)."""
    return [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]


def prompt_rid(names: list[str]) -> str:
    """The prompt's id whose samples `sample_rids` named `names`."""
    return names[0] if len(names) == 1 else names[0].removesuffix("-0")
