"""A request's log-probabilities on the host: what the prompt and each kept output token got.

The device computes them (prefill: runtime/worker.py; decode steps: speculative/step.py);
here they are kept per request, in token order, as plain floats and ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Top = list[tuple[float, int]]  # (log-prob, token id), likeliest first


@dataclass
class TokenLogprobs:
    """Log-probs of consecutive tokens: `values[i]` of token i; `top[i]` its alternatives
    (empty lists when no top-k was asked for)."""

    values: list[float | None] = field(default_factory=list)
    top: list[Top | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.values)

    def extend(self, other: TokenLogprobs, limit: int | None = None) -> None:
        self.values.extend(other.values[:limit])
        self.top.extend(other.top[:limit])


@dataclass
class RequestLogprobs:
    """input: prompt tokens from the request's logprob_start_len on (the first has None, as
    SGLang reports it: no position of the asked range precedes it); output: one entry per
    output token kept."""

    input: TokenLogprobs = field(default_factory=TokenLogprobs)
    output: TokenLogprobs = field(default_factory=TokenLogprobs)


def host_rows(
    values: list[float],
    top_values: list[list[float]] | None,
    top_ids: list[list[int]] | None,
    k: int,
) -> TokenLogprobs:
    """Device results brought to the host (`.tolist()`) as TokenLogprobs, each row's
    alternatives cut to the request's own k."""
    if top_values is None or k == 0:
        return TokenLogprobs(list(values), [[] for _ in values])
    top = [list(zip(tv[:k], ti[:k])) for tv, ti in zip(top_values, top_ids)]
    return TokenLogprobs(list(values), top)


# ---- SGLang's output shape ------------------------------------------------------------------------
LOGPROB_KEYS = (
    "input_token_logprobs",
    "input_top_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
)


def sglang_logprobs(
    rec: TokenLogprobs, ids: list[int], prefix: str, with_top: bool, text_of
) -> dict[str, list]:
    """`{prefix}_token_logprobs`: (log-prob, token id, text or None) per token, and with
    `with_top` `{prefix}_top_logprobs`: a list of such triples per token (None where the
    value itself is None). text_of(id) -> str, or None to leave texts out."""

    def triple(value: float | None, tid: int) -> tuple:
        return (value, tid, text_of(tid) if text_of is not None else None)

    out: dict[str, list] = {
        f"{prefix}_token_logprobs": [triple(v, t) for v, t in zip(rec.values, ids)]
    }
    if with_top:
        out[f"{prefix}_top_logprobs"] = [
            None if top is None else [triple(v, t) for v, t in top] for top in rec.top
        ]
    return out


def add_logprobs(total: dict, delta_meta: dict) -> None:
    """Extend the log-prob lists of `total` by those of an incremental output's meta_info."""
    for key in LOGPROB_KEYS:
        if key in delta_meta:
            total.setdefault(key, []).extend(delta_meta[key])
