"""The reduced vocabulary an EAGLE head drafts in (`--speculative-token-map`), optionally
growing with the tokens of the requests being served (`--speculative-token-map-growth`).

A token map covers most of what the target writes, but not the words a request brings along:
names and rare nouns of its prompt, which the answer copies and the draft predicts well.
Measured on SmolLM2-135M (32 held-out chats, 128 greedy tokens each): 4.2% of the answer
tokens are outside a 16,384-token map, 2.5% outside the map plus the prompt, 1.4% outside the
map, the prompt and the answer's earlier tokens. So with room for `growth` more tokens, every
prompt token and every emitted token outside the map joins the vocabulary (first come, first
kept, until the room is full), and the room empties when the engine has no request left.

Device layout, fixed at construction so CUDA graphs keep reading the same buffers: `weight`
[map + growth, hidden] (the rows of the target's lm_head), `ids` [map + growth] (the target id
of each column) and `bias` (0 for a column in use, -inf for free room, so that free columns
never rank and take no probability mass). Additions are stream-ordered device copies issued
between steps: a step already launched drafts with the vocabulary it was launched with.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class DraftVocab:
    def __init__(self, lm_head: torch.Tensor, token_ids: torch.Tensor, growth: int = 0):
        if growth < 0:
            raise ValueError(f"growth must be >= 0, got {growth}")
        self._full = lm_head  # the target's [vocab, hidden] (shared, never written)
        dev = lm_head.device
        token_ids = token_ids.to(device=dev, dtype=torch.int64).contiguous()
        self.base = token_ids.numel()
        self.capacity = self.base + growth
        self.weight = torch.zeros(
            (self.capacity, lm_head.shape[1]), dtype=lm_head.dtype, device=dev
        )
        self.weight[: self.base] = lm_head[token_ids]
        self.ids = torch.zeros(self.capacity, dtype=torch.int64, device=dev)
        self.ids[: self.base] = token_ids
        self.bias = None
        if growth:
            self.bias = torch.full((self.capacity,), float("-inf"), dtype=lm_head.dtype, device=dev)
            self.bias[: self.base] = 0
        self._map = frozenset(token_ids.tolist())
        self._added: list[int] = []
        self._present = set(self._map)

    @property
    def size(self) -> int:
        """Columns in use (the map plus the tokens added since the last reset)."""
        return self.base + len(self._added)

    def add(self, tokens: Iterable[int]) -> int:
        """Make room-permitting `tokens` draftable; returns how many were new."""
        if self.bias is None:
            return 0
        room = self.capacity - self.size
        new = [t for t in dict.fromkeys(tokens) if t not in self._present][:room]
        if not new:
            return 0
        dev = self.weight.device
        ids = torch.tensor(new, dtype=torch.int64).to(dev, non_blocking=True)
        cols = torch.arange(self.size, self.size + len(new), device=dev)
        self.weight.index_copy_(0, cols, self._full.index_select(0, ids))
        self.ids.index_copy_(0, cols, ids)
        self.bias.index_fill_(0, cols, 0)
        self._added.extend(new)
        self._present.update(new)
        return len(new)

    def reset(self) -> None:
        """Back to the map alone (no request left that could use the added tokens)."""
        if not self._added:
            return
        self.bias[self.base :] = float("-inf")
        self._added.clear()
        self._present = set(self._map)

    def __contains__(self, token: int) -> bool:
        return token in self._present
