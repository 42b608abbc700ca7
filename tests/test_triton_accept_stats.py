"""A step's acceptance statistics in one kernel (greedy chain reach and calibration update),
against the torch references `greedy_chain_reach` and `observe`."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the acceptance statistics kernel needs the triton package")

from specserve.ops.triton_accept_stats import acceptance_stats_triton  # noqa: E402
from specserve.speculative import verify_budget  # noqa: E402
from specserve.speculative.tree import (  # noqa: E402
    DraftTrees,
    accept,
    ancestor_mask,
    greedy_chain_reach,
)
from specserve.speculative.verify_budget import CALIBRATION_EMA, observe, pruned  # noqa: E402
from tests.engine_utils import random_trees, target_following_random_paths  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = DEVICE.type == "cuda"


def _path_scores(parents: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[B, N] float64 path log-probs: the root 0, each node its parent's plus log(u)."""
    b, n = parents.shape
    local = torch.log(torch.rand(b, n, generator=g, dtype=torch.float64))
    scores = torch.zeros(b, n, dtype=torch.float64)
    for i in range(1, n):
        scores[:, i] = scores.gather(1, parents[:, i : i + 1]).squeeze(1) + local[:, i]
    return scores


def _greedy_target(trees: DraftTrees) -> torch.Tensor:
    """The target draws each node's child of lowest id (a leaf: -1, a token no child has),
    so the accepted path is the greedy chain."""
    b, n = trees.parents.shape
    first = torch.full((b, n + 1), n, dtype=torch.int64)
    ids = torch.arange(n).expand(b, n)
    first.scatter_reduce_(1, torch.where(trees.parents >= 0, trees.parents, n), ids, "amin")
    first = first[:, :n]
    return torch.where(first < n, trees.tokens.gather(1, first.clamp(max=n - 1)), -1)


def _check(trees, acc, width, rows_total, g, ema=CALIBRATION_EMA, strided=False):
    """The kernel against the references on one step; returns the reference reach."""
    b = trees.tokens.shape[0]
    want_reach = greedy_chain_reach(trees.parents, acc.path, acc.accept_len)
    base = 1 - torch.rand(2, rows_total, width + 3 * strided, generator=g)  # in (0, 1]
    reached, predicted = base[0, :, :width], base[1, :, :width]
    rows = torch.randperm(rows_total, generator=g)[:b]
    new_r, new_p = observe(reached[rows], predicted[rows], trees, acc.accept_len)
    want_r, want_p = reached.clone(), predicted.clone()
    want_r[rows], want_p[rows] = new_r, new_p

    dev_base = base.to(DEVICE)
    dev_r, dev_p = dev_base[0, :, :width], dev_base[1, :, :width]
    scores = None if trees.scores is None else trees.scores.to(DEVICE)
    args = (trees.parents, acc.path, acc.accept_len, trees.depths)
    reach = acceptance_stats_triton(
        *(t.to(DEVICE) for t in args), scores, dev_r, dev_p, rows.to(DEVICE), ema
    )
    assert torch.equal(reach.cpu(), want_reach)
    assert torch.equal(dev_r.cpu(), want_r)  # no exp in it: exact
    torch.testing.assert_close(dev_p.cpu(), want_p, rtol=1e-6, atol=1e-6)
    if strided:  # the columns around the rows' views are untouched
        assert torch.equal(dev_base[:, :, width:].cpu(), base[:, :, width:])
    return want_reach


CASES = [  # bsz, n, max_depth, width, scores, pruned
    (1, 6, 5, 6, None, False),  # shaped as a chain below
    (3, 16, 4, 5, torch.float32, True),
    (2, 48, 8, 9, torch.bfloat16, True),  # the bundled draft's GPU tree
    (4, 64, 8, 4, torch.float32, False),  # fewer calibration depths than path depths
    (2, 130, 12, 16, torch.float32, True),  # N not a power of two; more depths than the path
    (1, 260, 16, 17, torch.float16, True),
    (2, 24, 6, 7, torch.float64, True),  # scores drawn per node below, not along paths
    (1, 2, 1, 2, None, True),
]
if ON_CUDA:
    CASES += [(256, 48, 8, 9, torch.float32, True), (64, 260, 16, 17, torch.bfloat16, True)]


@pytest.mark.parametrize("bsz,n,max_depth,width,score_dtype,prune", CASES)
def test_kernel_matches_the_torch_references(bsz, n, max_depth, width, score_dtype, prune):
    g = torch.Generator().manual_seed(bsz * 1000 + n)
    trees = random_trees(bsz, n, max_depth, g)
    if n == 6:  # a chain: node i's parent is i - 1
        parents = torch.arange(-1, n - 1).repeat(bsz, 1)
        trees = DraftTrees(trees.tokens, parents, torch.arange(n).repeat(bsz, 1), max_depth)
    scores = None if score_dtype is None else _path_scores(trees.parents, g).to(score_dtype)
    if score_dtype == torch.float64:  # pruned nodes (counted at depth 0) may beat the root
        scores = torch.randn(bsz, n, generator=g, dtype=torch.float64)
    trees = DraftTrees(trees.tokens, trees.parents, trees.depths, max_depth, scores)
    if prune:  # ragged verification's pruned nodes: depth -1, never accepted
        keep = torch.rand(bsz, n, generator=g) < 0.7
        keep[:, 0] = True
        trees = pruned(trees, keep)
    anc = ancestor_mask(trees.parents, max_depth)
    reach_seen = 0
    for trial in range(3):
        target = _greedy_target(trees) if trial == 0 else target_following_random_paths(trees, g)
        # -1 stands for a token no child has: as the pruned nodes' token it would match
        acc = accept(trees, torch.where(target < 0, -5, target), anc)
        strided = trial == 1
        reach_seen += int(_check(trees, acc, width, bsz + 5, g, strided=strided).sum())
    if n > 2 and not prune:
        assert reach_seen > 0  # the greedy chain was followed somewhere


def test_an_ema_that_float32_rounds_and_rows_left_out(monkeypatch):
    monkeypatch.setattr(verify_budget, "CALIBRATION_EMA", 0.1)  # (observe reads it per call)
    g = torch.Generator().manual_seed(3)
    trees = random_trees(3, 20, 5, g)
    scores = _path_scores(trees.parents, g).float()
    trees = DraftTrees(trees.tokens, trees.parents, trees.depths, 5, scores)
    acc = accept(trees, target_following_random_paths(trees, g))
    _check(trees, acc, 6, 7, g, ema=0.1)
    # no calibration rows: the chain reach alone, the calibration untouched
    reached, predicted = torch.rand(2, 4, 6, generator=g).to(DEVICE)
    before = reached.clone(), predicted.clone()
    args = (trees.parents, acc.path, acc.accept_len, trees.depths, trees.scores)
    reach = acceptance_stats_triton(
        *(t.to(DEVICE) for t in args), reached, predicted, None, CALIBRATION_EMA
    )
    assert torch.equal(reach.cpu(), greedy_chain_reach(trees.parents, acc.path, acc.accept_len))
    assert torch.equal(reached, before[0]) and torch.equal(predicted, before[1])
    # no calibration at all (no ragged tiers, so no calibration rows exist): the same reach
    alone = acceptance_stats_triton(*(t.to(DEVICE) for t in args), None, None, None, 0.25)
    assert torch.equal(alone, reach)


def test_greedy_chain_reach_on_a_hand_built_tree():
    # the root's children 1 (greedy: lowest id) and 2; node 1's children 3 (greedy) and 4
    parents = torch.tensor([[-1, 0, 0, 1, 1]]).repeat(6, 1)
    # (the last: a path on the chain past accept_len counts up to accept_len only)
    path = torch.tensor([[0, 1, 3], [0, 1, 4], [0, 2, 2], [0, 0, 0], [0, 1, 1], [0, 1, 3]])
    accept_len = torch.tensor([3, 3, 2, 1, 2, 2])
    want = torch.tensor([2, 1, 0, 0, 1, 1])
    assert torch.equal(greedy_chain_reach(parents, path, accept_len), want)
    dev = [t.to(DEVICE) for t in (parents, path, accept_len)]
    depths = torch.tensor([[0, 1, 1, 2, 2]]).repeat(6, 1).to(DEVICE)
    cal = torch.ones(2, 6, 3, device=DEVICE)
    reach = acceptance_stats_triton(*dev, depths, None, cal[0], cal[1], None, CALIBRATION_EMA)
    assert torch.equal(reach.cpu(), want)
