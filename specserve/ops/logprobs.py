"""Log-probabilities of chosen tokens and the likeliest alternatives, on the device.

Values are log_softmax in float32 of the raw logits (before temperature and filters), as vLLM
reports them by default. The token's value and the top-k values come from one log_softmax
tensor, so a token that is its row's argmax reports exactly the top-1 value (clients such as
lm-evaluation-harness decide "greedy" by comparing the two for equality); that is why this is
torch and not the Triton top-k (ops/triton_topk.py), whose log-sum-exp is computed apart.
"""

from __future__ import annotations

import torch

from specserve.sampling_params import MAX_TOP_LOGPROBS


def top_logprobs_bucket(k: int) -> int:
    """The top-k width a batch computes for a largest request of `k`: 0, else a power of two
    capped at MAX_TOP_LOGPROBS, so few shapes (and CUDA graphs) exist."""
    if k <= 0:
        return 0
    width = 1
    while width < k:
        width *= 2
    return min(width, MAX_TOP_LOGPROBS)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits [R, V] (any float dtype), tokens [R] -> (float32 [R] log-prob of each token,
    float32 [R, k'] descending top values, int64 [R, k'] their ids), k' = min(k, V); no top-k
    (None, None) for k = 0."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.reshape(-1, 1)).squeeze(1)
    if k <= 0:
        return chosen, None, None
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return chosen, values, ids
