"""The logit biases, repetition / frequency / presence penalties, minimum lengths and allowed
tokens of a batch's requests (sampling parameters `logit_bias`, `repetition_penalty`,
`frequency_penalty`, `presence_penalty`, `min_new_tokens`, `allowed_token_ids`), put on the
device for one step or one prefill's draws (ops/penalties.py applies them).

A prefill's are built here from the host's view of each request's output; a decode step's
are gathered by row from tables on the device that the steps keep up to date
(runtime/penalty_rows.py), so such steps replay CUDA graphs and launch ahead as others do.
The requests without them in the same batch draw the same tokens as they would elsewhere.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import torch

from specserve.device import to_device
from specserve.errors import InvalidArgument
from specserve.ops.penalties import Penalties, block_early_stops, penalize_rows
from specserve.sampling_params import ADJUSTMENT_NEUTRALS, SamplingParams


class RequestPenalties:
    """One request's part, on the device: built once (its prompt's tokens, its bias, its stop
    tokens), and its output's counts brought up to date with the tokens added since the last
    step (a long prompt or output is not walked again every step)."""

    def __init__(self, req, vocab_size: int, eos: AbstractSet[int], device: torch.device):
        p, v = req.params, vocab_size
        self.counts = None  # [V] float32: the output's tokens counted, the first `counted`
        self.counted = 0
        if p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0:
            self.counts = torch.zeros(v, dtype=torch.float32, device=device)
        self.in_prompt = None  # [V] bool: the prompt's tokens (the repetition penalty's)
        if p.repetition_penalty != 1.0:
            self.in_prompt = _mask(v, set(req.prompt_ids), device)
        self.bias = None  # [V] float32
        if p.logit_bias:
            self.bias = torch.zeros(v, dtype=torch.float32, device=device)
            at = _ids(list(p.logit_bias), device)
            self.bias[at] = _floats(list(p.logit_bias.values()), device)
        self.banned = None  # [V] bool: tokens outside allowed_token_ids
        if p.allowed_token_ids:
            self.banned = ~_mask(v, set(p.allowed_token_ids), device)  # (checked: all < v)
        self.stops = None  # [V] bool: what min_new_tokens holds back
        if p.min_new_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            self.stops = _mask(v, {t for t in stops if t < v}, device)

    def counts_now(self, output_ids: list[int]) -> torch.Tensor | None:
        if self.counts is not None and len(output_ids) > self.counted:
            new = _ids(output_ids[self.counted :], self.counts.device)
            self.counts.index_add_(0, new, torch.ones_like(new, dtype=torch.float32))
            self.counted = len(output_ids)
        return self.counts


class BatchPenalties:
    def __init__(self, reqs, vocab_size: int, eos: AbstractSet[int], device: torch.device):
        """eos: the model's end-of-sequence ids (stop tokens unless a request ignores them)."""
        b, v = len(reqs), vocab_size
        remaining = [0] * b  # per request: tokens still to come before a stop may
        frequency, presence, repetition = [0.0] * b, [0.0] * b, [1.0] * b
        parts: list[RequestPenalties | None] = []
        for i, r in enumerate(reqs):
            p = r.params
            if not p.adjusts_logits:
                parts.append(None)
                continue
            if r.penalties is None:
                r.penalties = RequestPenalties(r, v, eos, device)
            parts.append(r.penalties)
            frequency[i], presence[i] = p.frequency_penalty, p.presence_penalty
            repetition[i] = p.repetition_penalty
            remaining[i] = max(0, p.min_new_tokens - len(r.output_ids))
        zeros = torch.zeros(v, dtype=torch.float32, device=device)
        nothing = torch.zeros(v, dtype=torch.bool, device=device)

        def rows(values, empty) -> torch.Tensor:
            return torch.stack([empty if x is None else x for x in values])

        self.penalties = Penalties(
            rows([q and q.counts_now(r.output_ids) for q, r in zip(parts, reqs)], zeros),
            rows([q and q.in_prompt for q in parts], nothing),
            rows([q and q.bias for q in parts], zeros),
            _floats(frequency, device),
            _floats(presence, device),
            _floats(repetition, device),
        )
        self._draft = None  # (the draft's columns, the penalties seen through them)
        self.stops = None  # min_new_tokens: [B, V] bool, the stop tokens not yet allowed
        self.banned = None  # allowed_token_ids: [B, V] bool, the tokens never drawn
        self._owner = None  # (PenaltyRows, the rows) where a decode step's come from
        if any(q and q.banned is not None for q in parts):
            self.banned = rows([q and q.banned for q in parts], nothing)
        held = [q.stops if q and remaining[i] else None for i, q in enumerate(parts)]
        if any(x is not None for x in held):
            self.stops = rows(held, nothing)
            self.remaining = _ids(remaining, device)

    @classmethod
    def from_tensors(
        cls, counts, in_prompt, bias, frequency, presence, repetition, *, banned, stops,
        remaining, owner,
    ) -> BatchPenalties:  # fmt: skip
        """A decode step's, gathered by row on the device (runtime/penalty_rows.py `owner`:
        (its PenaltyRows, the rows), which `advance` brings up to date)."""
        out = cls.__new__(cls)
        out.penalties = Penalties(counts, in_prompt, bias, frequency, presence, repetition)
        out._draft, out._owner = None, owner
        out.banned, out.stops, out.remaining = banned, stops, remaining
        return out

    def advance(self, accept_len: torch.Tensor, emitted: torch.Tensor) -> None:
        """A decode step emitted `emitted[b, :accept_len[b]]` for each request: its rows'
        counts and minimum lengths follow on the device (nothing to do for penalties the
        host built)."""
        if self._owner is not None:
            table, rows = self._owner
            table.advance(rows, accept_len, emitted)

    def draws(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V]: one draw per request, right after its output so far (a prefill's,
        or a plain step's)."""
        request = torch.arange(logits.shape[0], device=logits.device)
        return self._masked(
            penalize_rows(logits, self.penalties, request), request, torch.zeros_like(request)
        )

    def tree_draws(self, logits: torch.Tensor, trees, packed: torch.Tensor | None) -> torch.Tensor:
        """logits [B * N, V] of every node of the batch's trees, or of the nodes `packed`
        ([R] indices into B * N: a ragged step's). A node's draw follows its path below the
        root (the root is the output's last token, counted already)."""
        b, n = trees.tokens.shape
        request = torch.arange(b, device=logits.device).repeat_interleave(n)
        path = None
        if n > 1:
            on_path = trees.ancestors() & (trees.depths > 0)[:, None, :]
            path = torch.where(on_path, trees.tokens[:, None, :], -1).reshape(b * n, n)
        depth = trees.depths.reshape(-1)
        if packed is not None:
            request, depth = request[packed], depth[packed]
            path = None if path is None else path[packed]
        out = penalize_rows(logits, self.penalties, request, path)
        return self._masked(out, request, depth)

    def draft_draws(
        self,
        logits: torch.Tensor,
        request: torch.Tensor,
        depth: int,
        columns: torch.Tensor | None,
        path: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The draft's logits [R, draft vocab] at nodes of `depth` (their children's
        proposals), of requests `request` ([R]), penalized as the target's draws will be;
        columns: each column's target token id (None: the same); path [R, D]: each node's
        path below the root (target ids, -1: none)."""
        if self._draft is None or self._draft[0] is not columns:
            view, column_of = self.penalties, None
            if columns is not None:
                view = Penalties(
                    view.counts[:, columns],
                    view.in_prompt[:, columns],
                    view.bias[:, columns],
                    view.frequency,
                    view.presence,
                    view.repetition,
                )
                # target id -> its column (-1: outside the draft's vocabulary); an id in
                # several columns (a growing vocabulary's free ones): the lowest
                column_of = torch.full(
                    (self.penalties.counts.shape[1] + 1,), -1, device=columns.device
                )
                at = torch.arange(len(columns), device=columns.device)
                column_of.scatter_reduce_(0, columns, at, "amin", include_self=False)
            self._draft = (columns, view, column_of)
        _, view, column_of = self._draft
        if path is not None and column_of is not None:
            path = column_of[path]  # (-1 stays -1: the map's last entry)
        out = penalize_rows(logits, view, request, path)
        depth_of = torch.full_like(request, depth)
        return self._masked(out, request, depth_of, columns, keep_some=True)

    def _masked(self, logits, request, depth, columns=None, keep_some=False) -> torch.Tensor:
        """-inf (in place) at what allowed_token_ids leaves out, and at the stop tokens
        min_new_tokens holds back at a row's depth. columns: as in `draft_draws`; keep_some:
        a row these masks leave without a finite column is left as it was (a new tensor): a
        reduced draft vocabulary may hold none of the tokens allowed_token_ids allows, or
        only stop tokens still held back, and a growing one's free columns are -inf already;
        an all -inf row's log-probabilities would be NaN."""
        if keep_some and (self.banned is not None or self.stops is not None):
            kept = logits.clone()
            out = self._masked(logits, request, depth, columns)
            return torch.where(out.isneginf().all(1, keepdim=True), kept, out)
        if self.banned is not None:
            banned = self.banned[request]
            if columns is not None:
                banned = banned[:, columns]
            logits.masked_fill_(banned, float("-inf"))
        if self.stops is None:
            return logits
        stops = self.stops if columns is None else self.stops[:, columns]
        return block_early_stops(logits, stops, self.remaining, request, depth)


def batch_penalties(
    reqs, vocab_size: int, eos: AbstractSet[int], device: torch.device
) -> BatchPenalties | None:
    """The penalties of a batch, or None when none of its requests has any."""
    if not any(r.params.adjusts_logits for r in reqs):
        return None
    return BatchPenalties(reqs, vocab_size, eos, device)


def check_penalties(params: SamplingParams, tp_size: int, eos: AbstractSet[int]) -> None:
    """Penalties and biases need one rank: the other ranks hold each request's output as of
    its prefill only, so their draws would differ. eos: the model's end-of-sequence ids."""
    if params.adjusts_logits and tp_size > 1:
        field = next(
            name
            for name, neutral in ADJUSTMENT_NEUTRALS.items()
            if getattr(params, name) not in neutral
        )
        raise InvalidArgument(field, "is not supported with tp_size > 1")
    allowed = params.allowed_token_ids
    if params.min_new_tokens and allowed:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        if stops.issuperset(allowed):
            # (every token masked before the minimum: the draw would be a banned token)
            raise InvalidArgument(
                "min_new_tokens",
                f"must be 0 when every token of allowed_token_ids ({sorted(set(allowed))}) "
                "is a stop token (EOS or stop_token_ids): none could be drawn before the "
                f"minimum; got {params.min_new_tokens}",
            )


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.float32), device)


def _mask(vocab_size: int, tokens: AbstractSet[int], device: torch.device) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[_ids(sorted(tokens), device)] = True
    return mask
