"""The logit biases, repetition / frequency / presence penalties and minimum lengths of a
batch's requests (sampling parameters `logit_bias`, `repetition_penalty`,
`frequency_penalty`, `presence_penalty`, `min_new_tokens`), put on the device for one step or one prefill's draws
(ops/penalties.py applies them).

They are built from the host's view of each request's output. So, as for structured output,
while such a request is live the engine launches no step ahead of the results of the one
before (runtime/engine_core.py), and a batch holding one runs eagerly, not from a CUDA graph
(runtime/worker.py): a first version that is exact everywhere; the requests without them
in the same batch draw the same tokens as they would elsewhere.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import torch

from specserve.device import to_device
from specserve.errors import InvalidArgument
from specserve.ops.penalties import Penalties, block_early_stops, penalize_rows
from specserve.sampling_params import ADJUSTMENT_NEUTRALS, SamplingParams


class BatchPenalties:
    def __init__(self, reqs, vocab_size: int, eos: AbstractSet[int], device: torch.device):
        """eos: the model's end-of-sequence ids (stop tokens unless a request ignores them)."""
        b, v = len(reqs), vocab_size
        outputs, prompts, bias_at, bias, stops = [], [], [], [], []
        remaining = [0] * b  # per request: tokens still to come before a stop may
        frequency, presence, repetition = [0.0] * b, [0.0] * b, [1.0] * b
        for i, r in enumerate(reqs):
            p = r.params
            if not p.adjusts_logits:
                continue
            base = i * v
            frequency[i], presence[i] = p.frequency_penalty, p.presence_penalty
            repetition[i] = p.repetition_penalty
            if p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0:
                outputs += [base + t for t in r.output_ids]
            if p.repetition_penalty != 1.0:
                prompts += [base + t for t in r.prompt_ids]
            for t, value in (p.logit_bias or {}).items():
                bias_at.append(base + t)
                bias.append(value)
            remaining[i] = max(0, p.min_new_tokens - len(r.output_ids))
            if remaining[i]:
                ids_ = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
                stops += [base + t for t in ids_ if t < v]

        def ids(values: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.int64), device)

        def per_request(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.float32), device)

        counts = torch.bincount(ids(outputs), minlength=b * v).float().view(b, v)
        in_prompt = torch.zeros(b * v, dtype=torch.bool, device=device)
        in_prompt[ids(prompts)] = True
        dense_bias = torch.zeros(b * v, dtype=torch.float32, device=device)
        dense_bias[ids(bias_at)] = per_request(bias)
        self.penalties = Penalties(
            counts,
            in_prompt.view(b, v),
            dense_bias.view(b, v),
            per_request(frequency),
            per_request(presence),
            per_request(repetition),
        )
        self.device = device
        self.stops = None  # min_new_tokens: [B, V] bool, the stop tokens not yet allowed
        if stops:
            self.stops = torch.zeros(b * v, dtype=torch.bool, device=device)
            self.stops[ids(stops)] = True
            self.stops = self.stops.view(b, v)
            self.remaining = ids(remaining)

    def draws(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V]: one draw per request, right after its output so far (a prefill's,
        or a plain step's)."""
        request = torch.arange(logits.shape[0], device=logits.device)
        return self._block_early_stops(
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
        return self._block_early_stops(out, request, depth)

    def _block_early_stops(self, logits, request, depth) -> torch.Tensor:
        if self.stops is None:
            return logits
        return block_early_stops(logits, self.stops, self.remaining, request, depth)


def batch_penalties(
    reqs, vocab_size: int, eos: AbstractSet[int], device: torch.device
) -> BatchPenalties | None:
    """The penalties of a batch, or None when none of its requests has any."""
    if not any(r.params.adjusts_logits for r in reqs):
        return None
    return BatchPenalties(reqs, vocab_size, eos, device)


def check_penalties(params: SamplingParams, vocab_size: int, tp_size: int) -> None:
    """What a request's penalties and biases need beyond their own checks: token ids in the
    vocabulary, and one rank (the other ranks hold each request's output as of its prefill
    only, so their draws would differ)."""
    if params.adjusts_logits and tp_size > 1:
        field = next(
            name
            for name, neutral in ADJUSTMENT_NEUTRALS.items()
            if getattr(params, name) not in neutral
        )
        raise InvalidArgument(field, "is not supported with tp_size > 1")
    outside = next((t for t in params.logit_bias or () if t >= vocab_size), None)
    if outside is not None:
        raise InvalidArgument(
            "logit_bias", f"token id {outside} is outside the vocabulary [0, {vocab_size})"
        )
