"""The engine's log-probs (SGLang's `(logprob, token_id, text)` entries in meta_info) in
OpenAI's shapes: chat `logprobs.content` and the legacy completions object.

Token strings are the tokenizer's text of the single token; without a tokenizer they are
`token_id:<id>` (vLLM's convention). A chat entry's `bytes` are the token's own bytes: for a
token holding part of a character (its string shows U+FFFD), the raw bytes, so that a client
joining the bytes of consecutive tokens gets the text back, as OpenAI describes the field.
JSON has no -inf: lower values are reported as -9999.0, as OpenAI and vLLM do.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

FLOOR = -9999.0


def _value(v: float | None) -> float | None:
    return None if v is None else max(v, FLOOR)


class TokenBytes:
    """Token id -> the bytes it stands for: xgrammar's decoded vocabulary of the tokenizer
    (byte-level, byte-fallback and plain vocabularies alike), built once, on first use
    (about 0.3 s for a 49k vocabulary), and shared by a server's requests."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._vocab: list[bytes] | None = None
        self._lock = threading.Lock()

    def _decoded_vocab(self) -> list[bytes]:
        with self._lock:
            if self._vocab is None:
                try:
                    import xgrammar

                    info = xgrammar.TokenizerInfo.from_huggingface(
                        self.tokenizer, vocab_size=self.vocab_size
                    )
                    self._vocab = list(info.decoded_vocab)
                except Exception:  # a tokenizer it cannot read: bytes of the token strings
                    log.warning("no raw token bytes for log-probs", exc_info=True)
                    self._vocab = []
            return self._vocab

    def __call__(self, tid: int) -> bytes | None:
        vocab = self._decoded_vocab()
        return vocab[tid] if 0 <= tid < len(vocab) else None


class TokenStrings:
    """Token id -> its string, cached (the same ids recur in top lists); `bytes_of` its
    bytes (token_bytes: the server's TokenBytes, None without a tokenizer)."""

    def __init__(self, tokenizer, token_bytes: TokenBytes | None = None):
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            if self.tokenizer is None:
                s = f"token_id:{tid}"
            else:
                s = self.tokenizer.decode([tid])
            self._cache[tid] = s
        return s

    def bytes_of(self, tid: int) -> list[int]:
        """The token's bytes: its string's UTF-8, or, where the string stands in U+FFFD for
        part of a character, the raw bytes of that part."""
        s = self(tid)
        if "\ufffd" in s and self.token_bytes is not None:
            raw = self.token_bytes(tid)
            if raw:
                return list(raw)
        return list(s.encode("utf-8"))


def _entries(meta: dict[str, Any], prefix: str) -> tuple[list, list]:
    tokens = meta.get(f"{prefix}_token_logprobs") or []
    tops = meta.get(f"{prefix}_top_logprobs") or [None] * len(tokens)
    return tokens, tops


def chat_content(meta: dict[str, Any], strings: TokenStrings) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` for the output tokens of (an incremental) meta_info."""

    def item(value: float, tid: int) -> dict[str, Any]:
        return {"token": strings(tid), "logprob": _value(value), "bytes": strings.bytes_of(tid)}

    out = []
    for (value, tid, _), top in zip(*_entries(meta, "output")):
        entry = item(value, tid)
        entry["top_logprobs"] = [item(v, t) for v, t, _ in top or []]
        out.append(entry)
    return out


class CompletionLogprobs:
    """The legacy `{tokens, token_logprobs, top_logprobs, text_offset}` of one choice, built
    chunk by chunk (`text_offset` continues across a stream's chunks): the prompt's tokens
    first with echo, then the output's. A position's `top_logprobs` maps the N likeliest
    tokens' strings and the chosen token's to their log-probs (OpenAI: up to N + 1)."""

    def __init__(self, strings: TokenStrings):
        self.strings = strings
        self.offset = 0

    def part(self, meta: dict[str, Any], with_prompt: bool) -> dict[str, Any]:
        tokens, tops = _entries(meta, "output")
        if with_prompt:
            in_tokens, in_tops = _entries(meta, "input")
            tokens, tops = list(in_tokens) + list(tokens), list(in_tops) + list(tops)
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for (value, tid, _), top in zip(tokens, tops):
            s = self.strings(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(_value(value))
            if value is None:
                out["top_logprobs"].append(None)
            else:
                # (tokens of one string, e.g. bytes of split characters, all showing U+FFFD:
                # the string keeps its likeliest token's value)
                alternatives: dict[str, float | None] = {}
                for v, t, _ in top or []:
                    alternatives.setdefault(self.strings(t), _value(v))
                alternatives.setdefault(s, _value(value))
                out["top_logprobs"].append(alternatives)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out
