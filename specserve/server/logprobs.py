"""The engine's log-probs (SGLang's `(logprob, token_id, text)` entries in meta_info) in
OpenAI's shapes: chat `logprobs.content` and the legacy completions object.

Token strings are the tokenizer's text of the single token; without a tokenizer they are
`token_id:<id>` (vLLM's convention). JSON has no -inf: lower values are reported as -9999.0,
as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Any

FLOOR = -9999.0


def _value(v: float | None) -> float | None:
    return None if v is None else max(v, FLOOR)


class TokenStrings:
    """Token id -> its string, cached (the same ids recur in top lists)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
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


def _entries(meta: dict[str, Any], prefix: str) -> tuple[list, list]:
    tokens = meta.get(f"{prefix}_token_logprobs") or []
    tops = meta.get(f"{prefix}_top_logprobs") or [None] * len(tokens)
    return tokens, tops


def chat_content(meta: dict[str, Any], strings: TokenStrings) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` for the output tokens of (an incremental) meta_info."""

    def item(value: float, tid: int) -> dict[str, Any]:
        s = strings(tid)
        return {"token": s, "logprob": _value(value), "bytes": list(s.encode("utf-8"))}

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
