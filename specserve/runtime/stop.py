"""Appending tokens to a request and deciding when it stops.

Speculative steps emit several tokens at once; a stop condition met inside that run ends
the request at that token, and nothing after it is kept. The text of a token that stops the
request (EOS, `stop_token_ids`, the token completing a grammar) is not part of its text, and
a stop string is cut off, as in SGLang and vLLM: the text ends where the answer ends (with
`no_stop_trim` both stay: the text ends with the stop string or the stopping token's text).
"""

from __future__ import annotations

from specserve.runtime.detokenizer import (
    IncrementalDetokenizer,
    prompt_context,
    stream_backend_of,
)
from specserve.runtime.request import Request


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int], context_len: int):
        self.tokenizer = tokenizer
        self.stream_backend = None if tokenizer is None else stream_backend_of(tokenizer)
        self.eos = eos_token_ids
        self.context_len = context_len

    def append_tokens(self, req: Request, tokens: list[int], last_stops: bool = False) -> int:
        """Append up to len(tokens) tokens, stopping at the first finishing one. Returns how
        many were kept. last_stops: the last token stops the request (it completed the
        request's grammar)."""
        p = req.params
        if req.detok is None and self.tokenizer is not None:
            skip = p.skip_special_tokens
            req.detok = IncrementalDetokenizer(
                self.tokenizer,
                skip,
                self.stream_backend,
                # (through the Rust backend where it decodes as the tokenizer does: faster)
                prompt_context(self.stream_backend or self.tokenizer, req.prompt_ids, skip),
            )
        detok = req.detok if req.detokenizes_live else None  # (else decoded at the end)
        for kept, tok in enumerate(tokens, start=1):
            req.output_ids.append(tok)
            # (min_new_tokens: the first ones neither are stop tokens, held back where drawn,
            # nor end in a stop string)
            early = len(req.output_ids) <= p.min_new_tokens
            stops = (last_stops and kept == len(tokens)) or (
                not early and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos))
            )
            len_before = len(req.text)
            if detok is not None and (p.no_stop_trim or not stops):
                req.text += detok.append(tok)
            if stops:
                self._finish(req, detok, "stop", matched=tok)
                return kept
            if p.stop and not early and self._match_stop_string(req, len_before):
                return kept
            if len(req.output_ids) >= p.max_new_tokens:
                self._finish(req, detok, "length", length=len(req.output_ids))
                return kept
            if len(req.prompt_ids) + len(req.output_ids) >= self.context_len:
                self._finish(
                    req,
                    detok,
                    "length",
                    length=len(req.output_ids),
                    message="context length reached",
                )
                return kept
        return len(tokens)

    def _finish(self, req: Request, detok, reason: str, **details) -> None:
        """End the request. The text held back (an incomplete character, or bytes that never
        form one) is final now, as decoded whole; a stop string it completes still cuts the
        text there and is the reason."""
        if detok is not None:
            len_before = len(req.text)
            req.text += detok.flush()
            if req.params.stop and self._match_stop_string(req, len_before):
                return
        req.finish(reason, **details)

    @staticmethod
    def _match_stop_string(req: Request, len_before: int) -> bool:
        """Whether a stop string now appears in the text: the text is cut before the first
        one (by position, then by the order given), and the request finishes."""
        first, matched = -1, None
        for s in req.params.stop:
            # each must end inside the new text (one that ended before it was already looked
            # for, or ended among the first min_new_tokens tokens, where it does not count)
            idx = req.text.find(s, max(0, len_before - len(s) + 1))
            if idx >= 0 and (first < 0 or idx < first):
                first, matched = idx, s
        if matched is None:
            return False
        req.text = req.text[: first + (len(matched) if req.params.no_stop_trim else 0)]
        req.finish("stop", matched=matched)
        return True
