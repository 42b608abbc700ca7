"""Draft trees and the tensor maths of verification, on the device, without host sync.

Per request the tree has a fixed width N (`num_draft_tokens`, a named config constant): node
0 is the root (the last verified token, not yet in the KV cache), nodes are in topological
order (parent index < child index), `depths[i]` <= max_depth (`num_steps`). Node i is the
token at position `kv_len + depths[i]` and its KV goes to logical position `kv_len + i`
(scratch) until the accepted path is compacted to `kv_len + depth`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeShape:
    """What one step drafts: `steps` draft forwards keeping `topk` children per node, the best
    `tokens` nodes (the root included) verified. tokens == 1 is plain decoding. verified > 0:
    the batch verifies `verified` nodes per request on average, each request as many of its
    best nodes as they are worth (ragged verification, speculative/verify_budget.py)."""

    steps: int
    topk: int
    tokens: int
    verified: int = 0

    @property
    def drafted(self) -> TreeShape:
        """The shape drafting builds (whatever part of it is verified)."""
        return TreeShape(self.steps, self.topk, self.tokens)

    @property
    def ragged(self) -> bool:
        return 0 < self.verified < self.tokens

    @property
    def max_depth(self) -> int:
        return min(self.steps, self.tokens - 1)

    def window(self, delta: int) -> int:
        """Logical positions past kv_len a step of this shape writes: the target's tree, the
        draft's scratch for forwarded frontier nodes, and the draft extend of the accepted
        path (delta: the draft's position offset)."""
        return max(
            self.tokens, delta + max(0, self.steps - 1) * self.topk, delta + self.max_depth + 1
        )

    def __str__(self) -> str:
        if self.tokens == 1:
            return "plain"
        budget = f"@{self.verified}" if self.ragged else ""
        return f"{self.steps}/{self.topk}/{self.tokens}{budget}"


PLAIN = TreeShape(0, 1, 1)


@dataclass
class DraftTrees:
    tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64, -1 for the root
    depths: torch.Tensor  # [B, N] int64
    max_depth: int  # host constant: no node is deeper
    scores: torch.Tensor | None = None  # [B, N] draft path log-probability (root 0)
    anc: torch.Tensor | None = None  # [B, N, N] `ancestor_mask`, when drafting built it

    def ancestors(self) -> torch.Tensor:
        """The ancestor-or-self mask: the one drafting built, else built now."""
        return self.anc if self.anc is not None else ancestor_mask(self.parents, self.max_depth)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def root_only(roots: torch.Tensor) -> DraftTrees:
        """Plain decoding is verification of a one-node tree."""
        zeros = torch.zeros_like(roots)[:, None]
        return DraftTrees(roots[:, None], zeros - 1, zeros, 0)


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """bool [B, N, N]: mask[b, i, j] is True iff node j is node i or one of its ancestors."""
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    safe_parent = torch.where(parents < 0, torch.arange(n, device=parents.device), parents)
    mask = eye.clone()
    for _ in range(max_depth):
        mask = eye | torch.gather(mask, 1, safe_parent[:, :, None].expand(b, n, n))
    return mask


@dataclass
class Acceptance:
    accept_len: torch.Tensor  # [B] nodes accepted incl. the root (= tokens emitted this step)
    path: torch.Tensor  # [B, max_depth + 1] node ids of the accepted path; padded by repeats
    bonus: torch.Tensor  # [B] the target's token after the last accepted node
    emitted: torch.Tensor  # [B, max_depth + 1] tokens emitted: path tokens[1:] then bonus


def accept(
    trees: DraftTrees,
    target_tokens: torch.Tensor,
    anc: torch.Tensor | None = None,
    use_kernel: bool = False,
) -> Acceptance:
    """Walk each tree from the root, following the child equal to the target's own token.

    target_tokens[b, i] is the token the target draws at node i (argmax, or a seeded sample
    of its filtered distribution). Following the draft only where it agrees with that draw
    makes every emitted token exactly the target's own: lossless for greedy and sampling.
    Siblings carry distinct tokens, so at most one child matches.

    anc: the trees' `ancestor_mask`, if already built (verification builds it): then a node
    is accepted iff no node on its root path disagrees, a handful of kernels instead of a
    walk of max_depth steps (one kernel on CUDA with use_kernel, ops/triton_accept.py).
    """
    parents, tokens = trees.parents, trees.tokens
    if anc is not None and use_kernel:
        from specserve.ops.triton_accept import accept_triton

        return Acceptance(
            *accept_triton(tokens, parents, trees.depths, target_tokens, anc, trees.max_depth)
        )
    b, n = tokens.shape
    safe_parent = parents.clamp(min=0)
    agrees = tokens == torch.gather(target_tokens, 1, safe_parent)
    if anc is not None:
        not_root = torch.arange(n, device=tokens.device) > 0
        # the root always "agrees"; a non-root node without a parent never does (as in the walk)
        disagrees = not_root > (agrees & (parents >= 0))
        accepted = ~(anc & disagrees[:, None, :]).any(dim=2)
        return acceptance_of_path(trees, accepted, target_tokens)
    accepted = torch.zeros(b, n, dtype=torch.bool, device=tokens.device)
    accepted[:, 0] = True
    for _ in range(trees.max_depth):
        accepted = accepted | ((parents >= 0) & agrees & torch.gather(accepted, 1, safe_parent))
    return acceptance_of_path(trees, accepted, target_tokens)


def greedy_chain_reach(
    parents: torch.Tensor, path: torch.Tensor, accept_len: torch.Tensor
) -> torch.Tensor:
    """[B] how many of the accepted path's draft tokens lie on the draft's own greedy chain
    (top-1 of the top-1 ...): what a chain drafted from the same root would have accepted,
    capped at its depth, had it been run instead. Exact, not an estimate: the drafter writes
    a node's children in the draft's rank order and keeps the greedy chain in every tree
    (speculative/drafter.py), so a node's greedy child is its child of lowest id; a chain's
    token is accepted iff the target's draw at its parent equals it, and the tree's path,
    following that same draw (the same seeded draw under sampling), takes that child. (Of a
    ragged step's pruned tree it is a lower bound: pruning may cut the chain.)
    parents [B, N] (-1: the root); path [B, D + 1] the accepted node per depth, repeats past
    accept_len [B]."""
    b, n = parents.shape
    ids = torch.arange(n, device=parents.device).expand(b, n)
    # each node's child of lowest id (n: none); the root's -1 goes to a spare column
    first = torch.full((b, n + 1), n, dtype=torch.int64, device=parents.device)
    first.scatter_reduce_(1, torch.where(parents >= 0, parents, n), ids, reduce="amin")
    on_chain = path[:, 1:] == torch.gather(first, 1, path[:, :-1])
    depth = torch.arange(1, path.shape[1], device=parents.device)
    on_chain &= depth[None, :] < accept_len[:, None]
    return torch.cumprod(on_chain.long(), dim=1).sum(dim=1)


def root_only_where(
    plain: torch.Tensor, trees: DraftTrees, acc: Acceptance, target_tokens: torch.Tensor
) -> Acceptance:
    """Rows where `plain` [B] is True accept the root alone: the request emits the target's
    own token at the root, as plain decoding would (its drafts are verified but never taken).
    """
    b, n = trees.tokens.shape
    root = torch.zeros(b, n, dtype=torch.bool, device=plain.device)
    root[:, 0] = True
    alone = acceptance_of_path(trees, root, target_tokens)

    def pick(mine: torch.Tensor, plainly: torch.Tensor) -> torch.Tensor:
        return torch.where(plain.view(-1, *[1] * (mine.dim() - 1)), plainly, mine)

    return Acceptance(*(pick(a, p) for a, p in zip(vars(acc).values(), vars(alone).values())))


def acceptance_of_path(
    trees: DraftTrees, accepted: torch.Tensor, target_tokens: torch.Tensor
) -> Acceptance:
    """From a root-to-node path given as a bool mask [B, N]: the path by depth, the bonus
    token (the target's own token at the path's last node) and the emitted tokens."""
    tokens = trees.tokens
    b, n = tokens.shape
    accept_len = accepted.sum(dim=1)
    width = trees.max_depth + 1
    # path[b, depth] = accepted node at that depth; depths beyond the path repeat the last.
    path = torch.zeros(b, width, dtype=torch.int64, device=tokens.device)
    node_ids = torch.arange(n, device=tokens.device).expand(b, n)
    key = torch.where(accepted, trees.depths, torch.full_like(trees.depths, width))
    # Accepted nodes have distinct depths, so each depth gets exactly one id; rejected nodes
    # add zero into the last bucket.
    path.scatter_add_(1, key.clamp(max=width - 1), torch.where(accepted, node_ids, 0))
    depth_idx = torch.arange(width, device=tokens.device)[None, :]
    last = torch.gather(path, 1, (accept_len - 1)[:, None])
    path = torch.where(depth_idx < accept_len[:, None], path, last)
    bonus = torch.gather(target_tokens, 1, last).squeeze(1)
    path_tokens = torch.gather(tokens, 1, path)
    emitted = torch.cat([path_tokens[:, 1:], bonus[:, None]], dim=1)
    emitted = torch.where(depth_idx == (accept_len - 1)[:, None], bonus[:, None], emitted)
    return Acceptance(accept_len, path, bonus, emitted)
