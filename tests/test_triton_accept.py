"""Acceptance from the ancestor mask in one kernel, against the torch walk and mask paths."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the acceptance kernel needs the triton package")

from specserve.ops.triton_accept import accept_triton  # noqa: E402
from specserve.speculative.tree import DraftTrees, accept, ancestor_mask  # noqa: E402
from tests.engine_utils import random_trees, target_following_random_paths  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "bsz,n,max_depth",
    [
        (1, 6, 5),  # shaped as a chain below
        (3, 16, 4),
        (2, 48, 8),  # the bundled draft's GPU tree
        (4, 64, 8),
        (2, 130, 12),  # rows in several blocks of the kernel's loop
        (1, 2, 1),
    ],
)
def test_kernel_matches_the_torch_acceptance(bsz, n, max_depth):
    g = torch.Generator().manual_seed(bsz * 1000 + n)
    trees = random_trees(bsz, n, max_depth, g)
    if n == 6:  # a chain: node i's parent is i - 1
        parents = torch.arange(-1, n - 1).repeat(bsz, 1)
        trees = DraftTrees(trees.tokens, parents, torch.arange(n).repeat(bsz, 1), max_depth)
    for trial in range(4):
        target = target_following_random_paths(trees, g)
        if trial == 3:  # the target agrees with nothing: only the root
            target = torch.full_like(target, -5)
        anc = ancestor_mask(trees.parents, max_depth)
        want = accept(trees, target, anc)
        assert torch.equal(want.accept_len, accept(trees, target).accept_len)  # mask = walk
        dev = [t.to(DEVICE) for t in (trees.tokens, trees.parents, trees.depths, target, anc)]
        got = accept_triton(*dev, max_depth)
        for name, x in zip(("accept_len", "path", "bonus", "emitted"), got):
            assert torch.equal(x.cpu(), getattr(want, name)), (name, trial)


def test_a_node_without_a_parent_is_never_accepted_as_in_the_reference():
    g = torch.Generator().manual_seed(9)
    trees = random_trees(2, 16, 4, g)
    target = target_following_random_paths(trees, g)
    parents = trees.parents.clone()
    parents[:, 3] = -1  # an orphan (and so are its descendants' paths)
    trees = DraftTrees(trees.tokens, parents, trees.depths, 4)
    anc = ancestor_mask(parents, 4)
    want = accept(trees, target, anc)
    dev = [t.to(DEVICE) for t in (trees.tokens, parents, trees.depths, target, anc)]
    for name, x in zip(("accept_len", "path", "bonus", "emitted"), accept_triton(*dev, 4)):
        assert torch.equal(x.cpu(), getattr(want, name)), name


def test_accept_takes_the_kernel_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("the dispatch to the kernel happens on CUDA only")
    g = torch.Generator().manual_seed(5)
    trees = random_trees(2, 16, 4, g)
    target = target_following_random_paths(trees, g)
    want = accept(trees, target, ancestor_mask(trees.parents, 4))
    cuda = DraftTrees(*(t.cuda() for t in (trees.tokens, trees.parents, trees.depths)), 4)
    got = accept(cuda, target.cuda(), ancestor_mask(cuda.parents, 4))
    assert torch.equal(got.emitted.cpu(), want.emitted)
