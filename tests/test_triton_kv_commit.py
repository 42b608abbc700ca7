"""The one-kernel accepted-path KV compaction against torch's gather-then-scatter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the compaction kernel needs the triton package")

from specserve.ops.triton_kv_commit import commit_path, commit_path_reference  # noqa: E402
from specserve.spec.tree import DraftTrees, accept  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_trees(bsz: int, n: int, max_depth: int, g: torch.Generator) -> DraftTrees:
    """Random trees in topological order (parent id < child id), depth <= max_depth."""
    parents = torch.full((bsz, n), -1, dtype=torch.int64)
    depths = torch.zeros((bsz, n), dtype=torch.int64)
    for b in range(bsz):
        for i in range(1, n):
            while True:
                p = int(torch.randint(0, i, (1,), generator=g))
                if depths[b, p] < max_depth:
                    break
            parents[b, i], depths[b, i] = p, depths[b, p] + 1
    tokens = torch.arange(n).repeat(bsz, 1)  # siblings carry distinct tokens
    return DraftTrees(tokens, parents, depths, max_depth)


def target_following_random_paths(trees: DraftTrees, g: torch.Generator) -> torch.Tensor:
    """At each node the target draws one of its children's tokens (or, one time in ten or at
    a leaf, a token no child has), so accepted paths of every length occur."""
    bsz, n = trees.tokens.shape
    target = torch.full((bsz, n), -1, dtype=torch.int64)
    for b in range(bsz):
        for i in range(n):
            children = (trees.parents[b] == i).nonzero().flatten()
            if len(children) and float(torch.rand(1, generator=g)) > 0.1:
                pick = children[int(torch.randint(0, len(children), (1,), generator=g))]
                target[b, i] = trees.tokens[b, pick]
    return target


@pytest.mark.parametrize(
    "bsz,n,max_depth,layers,kv_heads,head_dim,dtype",
    [
        (1, 6, 5, 2, 1, 16, torch.float32),  # a chain
        (3, 16, 4, 3, 2, 32, torch.float16),
        (4, 64, 8, 2, 3, 64, torch.float32),  # rows wider than one block loop (192)
        (2, 9, 3, 1, 8, 128, torch.float16),  # 1024-wide rows
    ],
)
def test_commit_path_matches_reference(bsz, n, max_depth, layers, kv_heads, head_dim, dtype):
    g = torch.Generator().manual_seed(bsz * 1000 + n)
    trees = random_trees(bsz, n, max_depth, g)
    acc = accept(trees, target_following_random_paths(trees, g))
    assert int(acc.accept_len.max()) > 2  # something moves
    window = n + 3
    num_slots = bsz * window + 7
    # each request's window in scattered, distinct slots (paged layouts look like this)
    window_slots = torch.randperm(num_slots, generator=g)[: bsz * window].view(bsz, window)
    buffer = torch.randn(2, layers, num_slots, kv_heads, head_dim, generator=g).to(dtype)
    expected = buffer.clone()
    commit_path_reference(expected, window_slots, acc.path)
    got = buffer.clone().to(DEVICE)
    commit_path(got, window_slots.to(DEVICE), acc.path.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    # the accepted path's rows really moved to the front of the window
    for b in range(bsz):
        for d in range(int(acc.accept_len[b])):
            src = window_slots[b, acc.path[b, d]]
            assert torch.equal(got[:, :, window_slots[b, d]].cpu(), buffer[:, :, src])
