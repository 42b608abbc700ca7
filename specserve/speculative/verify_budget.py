"""Ragged verification: how many of its drafted nodes each request verifies this step.

A step of a budgeted tier verifies `total` nodes over the whole batch (a host constant: the
graph's shapes), roots included, and the device decides each request's share. A node is worth
the chance that it is accepted, estimated as its draft path probability times a calibration
of the request at the node's depth:

    value(node) = min(1, exp(path log-prob) * reached[row, depth] / predicted[row, depth])

where reached is a moving average of how often the request's accepted path reached that depth
and predicted of the draft's best path probability there (under simulated acceptance the
reached depth is the forced one). Within a request nodes are ranked by the drafter's key
(parents before children, so any top-k of a request is a closed tree), values are made
non-increasing along that rank, and the batch keeps the `total - B` most valuable non-root
nodes: each request then verifies its root and its best n_b - 1 nodes. Requests that decode
plainly keep their root alone.

The verify forward runs over the kept nodes only, packed (matmuls, logits and sampling cost
`total` rows instead of B * N); attention sees them in the dense [B, N] layout with the
pruned nodes masked out (`ops/attention.py: PackedQueries`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.speculative.tree import DraftTrees

CALIBRATION_EMA = 0.25  # weight of a step's observation in a request's calibration


@dataclass
class VerifyPlan:
    keep: torch.Tensor  # [B, N] bool: nodes verified this step (the root always)
    packed: torch.Tensor  # [total] int64: flat node index (b * N + i) of each verified row
    row_of: torch.Tensor  # [B, N] int64: each kept node's row in the packed forward


def node_values(trees: DraftTrees, reached: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """[B, N] estimated acceptance chance of each node; reached / predicted: [B, D + 1] per
    depth, of the batch's requests."""
    depth = trees.depths.clamp(min=0)
    cal = torch.gather(reached, 1, depth) / torch.gather(predicted, 1, depth).clamp(min=1e-6)
    prob = torch.exp(trees.scores.float()) if trees.scores is not None else 1.0
    return (prob * cal).clamp(max=1.0)


def plan_verify(
    trees: DraftTrees,
    values: torch.Tensor,
    rank: torch.Tensor,
    plain_rows: torch.Tensor | None,
    total: int,
    limit: torch.Tensor | None = None,
) -> VerifyPlan:
    """Which nodes to verify: `total` of them, each request's root first. rank [B, N]: each
    node's rank in its request (0: the root; a parent ranks before its children). limit: how
    many non-root nodes the real rows share, a device count (a graph's padding rows, which
    verify their root alone, do not enlarge it); None: all of `total - B`."""
    b, n = trees.tokens.shape
    dev = values.device
    by_rank = torch.full((b, n), -1.0, device=dev).scatter(1, rank, values.float())
    # non-increasing along the rank, so a request's share is a prefix of its ranking
    by_rank = torch.cummin(by_rank[:, 1:], dim=1).values
    if plain_rows is not None:
        by_rank = torch.where(plain_rows[:, None], -1.0, by_rank)
    extra = total - b
    # ties go to the lower request and rank: a stable order, whatever the batch holds
    flat = by_rank.reshape(-1)
    chosen = torch.zeros(b * (n - 1), dtype=torch.bool, device=dev)
    if extra > 0:
        order = torch.argsort(flat, descending=True, stable=True)[:extra]
        if limit is None:
            chosen.index_fill_(0, order, True)  # (a scalar fill: nothing copied from the host)
        else:  # the real rows' budget (a graph's padding rows take none of it)
            chosen.scatter_(0, order, torch.arange(extra, device=dev) < limit)
        # a budget larger than the speculating requests' trees leaves rows over: they are
        # computed (the forward's shape is fixed) but belong to no request's tree
        chosen &= flat >= 0
    share = 1 + chosen.view(b, n - 1).sum(dim=1)  # [B] nodes verified per request
    keep = rank < share[:, None]
    # the kept nodes first, in order; any rows left over are nodes no tree keeps
    packed = torch.argsort((~keep).reshape(-1).to(torch.int8), stable=True)[:total]
    row_of = torch.zeros(b * n, dtype=torch.int64, device=dev)
    row_of[packed] = torch.arange(total, device=dev)
    return VerifyPlan(keep, packed, row_of.view(b, n))


def ranks_by_key(trees: DraftTrees) -> torch.Tensor:
    """[B, N] each node's rank in its request: the root first, then by draft path score
    (higher first; ties to the lower node id, which is the parent's side). A child's score
    never exceeds its parent's, so every prefix of the ranking is a closed tree."""
    b, n = trees.tokens.shape
    scores = trees.scores.float() if trees.scores is not None else -trees.depths.float()
    scores = torch.where(torch.arange(n, device=scores.device) == 0, float("inf"), scores)
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n, device=order.device).expand(b, n))
    return rank


def pruned(trees: DraftTrees, keep: torch.Tensor) -> DraftTrees:
    """The trees as verification sees them: pruned nodes can be neither accepted (token -1
    matches no draw: draws are token ids) nor chosen by simulated acceptance (depth -1)."""
    return DraftTrees(
        torch.where(keep, trees.tokens, -1),
        trees.parents,
        torch.where(keep, trees.depths, -1),
        trees.max_depth,
        trees.scores,
        trees.anc,
    )


def observe(
    reached: torch.Tensor,
    predicted: torch.Tensor,
    trees: DraftTrees,
    accept_len: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's update of the batch's calibration rows [B, D + 1]: whether the accepted path
    reached each depth, and the draft's best path probability at each depth."""
    width = reached.shape[1]
    depth = torch.arange(width, device=reached.device)
    got = ((accept_len - 1)[:, None] >= depth[None, :]).float()
    prob = (
        torch.exp(trees.scores.float())
        if trees.scores is not None
        else torch.ones_like(trees.depths, dtype=torch.float32)
    )
    best = torch.zeros_like(reached).scatter_reduce(
        1, trees.depths.clamp(0, width - 1), prob, reduce="amax", include_self=True
    )
    drafted = torch.zeros_like(reached, dtype=torch.bool).scatter(
        1, trees.depths.clamp(0, width - 1), True
    )
    a = CALIBRATION_EMA
    new_reached = torch.where(drafted, reached + a * (got - reached), reached)
    new_predicted = torch.where(drafted, predicted + a * (best - predicted), predicted)
    return new_reached, new_predicted
