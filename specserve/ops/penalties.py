"""Logit bias, repetition / frequency / presence penalties and a minimum length on the
target's logits, as vLLM and OpenAI define them, for every node of a draft tree.

A node's draw is the token after the node's path, so it is penalized by the request's output
so far plus the tokens on that path: a verified tree then draws exactly what plain decoding
draws after the same tokens, and speculation stays lossless. Per request, in vLLM's order:
1. logit_bias: logit[t] += bias[t];
2. repetition_penalty r, on every token of the prompt or the output:
   logit / r where it is positive, logit * r where not;
3. frequency_penalty f and presence_penalty p, on the output's tokens:
   logit[t] -= f * count[t] + p * (count[t] > 0);
4. min_new_tokens m: no stop token (EOS, stop_token_ids) while the output holds fewer than m.
Neutral values (no bias, r = 1, f = p = 0) leave a row's logits bit for bit as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Penalties:
    """Per request (rows of these tensors) of a batch, on the device."""

    counts: torch.Tensor  # [B, V] float32: each token's count in the output so far
    in_prompt: torch.Tensor  # [B, V] bool: tokens of the prompt (the repetition penalty's)
    bias: torch.Tensor  # [B, V] float32: logit_bias (zeros where none)
    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32


def _penalized(x, counts, in_prompt, bias, frequency, presence, repetition):
    """The formula, elementwise: x, counts, in_prompt and bias broadcast together, and the
    three penalties are one value per row ([R, 1])."""
    x = x + bias
    seen = in_prompt | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0).to(x.dtype)


# elements of the rows penalized at once: the formula's temporaries are several times a
# block's size, which a whole batch of tree nodes at a large vocabulary would not fit
PENALTY_BLOCK = 1 << 23


def penalize_rows(
    logits: torch.Tensor,
    pen: Penalties,
    request: torch.Tensor,
    path_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [R, V]: each row a draw of request `request[r]` ([R] int64, a row of `pen`).
    path_tokens [R, D] (-1: none): the tokens between the request's output so far and the
    row's draw (a tree node's path below its root), which count as output too. Returns new
    float32 logits."""
    rows = max(1, PENALTY_BLOCK // max(1, logits.shape[1]))
    if logits.shape[0] <= rows:
        return _penalize_block(logits.float(), pen, request, path_tokens)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for at in range(0, logits.shape[0], rows):
        part = slice(at, at + rows)
        path = None if path_tokens is None else path_tokens[part]
        out[part] = _penalize_block(logits[part].float(), pen, request[part], path)
    return out


def _penalize_block(x, pen, request, path_tokens) -> torch.Tensor:
    f, p, r = (t[request][:, None] for t in (pen.frequency, pen.presence, pen.repetition))
    counts = pen.counts[request]
    in_prompt = pen.in_prompt[request]
    out = _penalized(x, counts, in_prompt, pen.bias[request], f, p, r)
    if path_tokens is None or path_tokens.shape[1] == 0:
        return out
    # the path's tokens: each with its count in the output plus on the path
    valid = path_tokens >= 0
    # (a row's empty slots point at its first path token, or at token 0 where it has none,
    # so that every write to a token of a row writes the same value)
    first = torch.where(valid.any(1), path_tokens.max(1).values, 0)[:, None]
    tokens = torch.where(valid, path_tokens, first)
    on_path = ((tokens[:, :, None] == tokens[:, None, :]) & valid[:, None, :]).sum(2)
    c = counts.gather(1, tokens) + on_path.to(counts.dtype)
    value = _penalized(
        x.gather(1, tokens),
        c,
        in_prompt.gather(1, tokens),
        pen.bias[request].gather(1, tokens),
        f,
        p,
        r,
    )
    # where a row has no path, its slots point at token 0 with no count added: the same value
    return out.scatter_(1, tokens, value)


def block_early_stops(
    logits: torch.Tensor,
    stops: torch.Tensor,
    remaining: torch.Tensor,
    request: torch.Tensor,
    depth: torch.Tensor,
) -> torch.Tensor:
    """min_new_tokens: -inf at the stop tokens (`stops` [B, V] bool) of each row drawing
    before its request's minimum length, i.e. whose `depth` ([R]: tokens between the output so
    far and the draw) is below `remaining[request]` ([B]: min_new_tokens less the output's
    length). In place."""
    early = depth < remaining[request]
    return logits.masked_fill_(stops[request] & early[:, None], float("-inf"))


def penalize_reference(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    bias: dict[int, float],
    frequency: float,
    presence: float,
    repetition: float,
) -> torch.Tensor:
    """One draw's logits [V] after `output`, token by token (the tests' reference)."""
    x = logits.float().clone()
    for t, b in bias.items():
        x[t] += b
    counts: dict[int, int] = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    for t in set(prompt) | set(counts):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t, c in counts.items():
        x[t] = x[t] - frequency * c - presence
    return x
