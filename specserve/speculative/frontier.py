"""The buffers of tree drafting: a depth's frontier and every depth's candidates.

ops/triton_draft_frontier.py fills them (one launch per depth on CUDA) and
ops/triton_tree_select.py picks the tree from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Frontier:
    """The k nodes of one depth that the draft runs next (all contiguous)."""

    ids: torch.Tensor  # [B, k] int64 candidate ids
    tokens: torch.Tensor  # [B, k] int64
    scores: torch.Tensor  # [B, k] float32 path log-probabilities
    greedy: torch.Tensor  # [B, k] bool: on the draft's own greedy chain
    feat: torch.Tensor  # [B, k, H] the parent's draft output (the model dtype)
    anc: torch.Tensor  # [B, k, S] bool: scratch columns the node attends to (self included)

    @staticmethod
    def empty_pair(bsz, k, hidden, scratch, dtype, device) -> tuple[Frontier, Frontier]:
        """Two frontiers in six allocations: a depth reads one and writes the other (the
        next frontier's ancestor rows are gathered from the current ones: not in place)."""
        i64, f32, b8 = torch.int64, torch.float32, torch.bool
        parts = [
            torch.empty(2, bsz, k, dtype=i64, device=device),
            torch.empty(2, bsz, k, dtype=i64, device=device),
            torch.empty(2, bsz, k, dtype=f32, device=device),
            torch.empty(2, bsz, k, dtype=b8, device=device),
            torch.empty(2, bsz, k, hidden, dtype=dtype, device=device),
            torch.empty(2, bsz, k, scratch, dtype=b8, device=device),
        ]
        return Frontier(*(p[0] for p in parts)), Frontier(*(p[1] for p in parts))


@dataclass
class Candidates:
    """Every depth's children, column c = candidate id c + 1: [B, C] each."""

    tokens: torch.Tensor  # int64
    scores: torch.Tensor  # float32 path log-probabilities
    keys: torch.Tensor  # float32 selection keys (the greedy chain above everything)
    parents: torch.Tensor  # int64 candidate id of the parent (0: the root)

    @staticmethod
    def empty(bsz: int, num_cand: int, device) -> Candidates:
        def e(dtype):
            return torch.empty(bsz, num_cand, dtype=dtype, device=device)

        return Candidates(e(torch.int64), e(torch.float32), e(torch.float32), e(torch.int64))
