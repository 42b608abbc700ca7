"""Tree selection and its ancestor mask in one kernel, against the torch reference and
`spec.tree.ancestor_mask`, on candidates made the way drafting makes them."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the tree-selection kernel needs the triton package")

from specserve.ops.triton_draft_frontier import expand_frontier_reference  # noqa: E402
from specserve.ops.triton_tree_select import (  # noqa: E402
    MAX_MASK_NODES,
    select_tree,
    select_tree_reference,
    select_tree_triton,
)
from specserve.speculative.frontier import Candidates, Frontier  # noqa: E402
from specserve.speculative.tree import ancestor_mask  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def drafted_candidates(bsz, k, num_steps, *, seed, ties=False, nans=False):
    """Every depth's candidates from random top-k log-probabilities, expanded by the drafting
    reference (so keys, greedy chain and parent ids are what drafting writes)."""
    g = torch.Generator().manual_seed(seed)
    scratch = max(1, (num_steps - 1) * k)
    cands = Candidates.empty(bsz, k + (num_steps - 1) * k * k, "cpu")
    fronts = Frontier.empty_pair(bsz, k, 4, scratch, torch.float32, "cpu")
    front = None
    for depth in range(num_steps):
        f = 1 if depth == 0 else k
        logp = -torch.rand(bsz * f, k, generator=g) * 4
        if ties:  # few distinct values: many exactly equal keys
            logp = (logp * 2).round() / 2
        if nans and depth == num_steps - 1:  # NaN ranks as -inf (leaves only: trees stay closed)
            logp[torch.rand(bsz * f, k, generator=g) < 0.3] = float("nan")
        logp = logp.sort(dim=1, descending=True).values
        tok = torch.randint(0, 1000, (bsz * f, k), generator=g)
        out = fronts[depth % 2] if depth + 1 < num_steps else None
        expand_frontier_reference(logp, tok, torch.randn(bsz * f, 4, generator=g), front, depth,
                                  cands, out)  # fmt: skip
        front = out
    depths = torch.cat(
        [torch.ones(k, dtype=torch.int64)]
        + [torch.full((k * k,), d + 1, dtype=torch.int64) for d in range(1, num_steps)]
    )
    roots = torch.randint(0, 1000, (bsz,), generator=g)
    return roots, cands, depths


CASES = [  # (bsz, k, num_steps, n)
    (1, 1, 5, 6),  # a chain
    (1, 4, 5, 16),
    (2, 8, 8, 48),  # the bundled draft's GPU tree
    (3, 8, 5, 64),
    (1, 8, 8, 457),  # every candidate
    (2, 16, 3, 100),  # 528 candidates: sorted in a 1024-wide block
    (1, 3, 4, 2),  # the smallest tree
]


# the interpreter is slow on the wide cases: their tie and NaN variants run with the slow set
PARAMS = [
    pytest.param(
        *case, variant, marks=[pytest.mark.slow] if variant != "plain" and case[3] >= 64 else []
    )
    for case in CASES
    for variant in ("plain", "ties", "nans")
]


@pytest.mark.parametrize("bsz,k,num_steps,n,variant", PARAMS)
def test_kernel_matches_reference_and_mask(bsz, k, num_steps, n, variant):
    roots, cands, depths = drafted_candidates(
        bsz, k, num_steps, seed=bsz * 100 + n, ties=variant == "ties", nans=variant == "nans"
    )
    want = select_tree_reference(roots, cands, depths, n)
    max_depth = min(num_steps, n - 1)  # what the drafter passes
    got = run_kernel(roots, cands, depths, n, max_depth)
    assert_same(got, want, max_depth)
    # a real tree: topological, depth = parent's + 1, within num_steps
    tok, par, dep = want[0], want[1], want[2]
    assert (par[:, 1:] < torch.arange(1, n)).all() and (par[:, 1:] >= 0).all()
    assert torch.equal(dep[:, 1:], torch.gather(dep, 1, par[:, 1:]) + 1)
    assert int(dep.max()) <= num_steps and torch.equal(tok[:, 0], roots)
    assert (got[4] is None) == (n > MAX_MASK_NODES)


def run_kernel(roots, cands, depths, n, max_depth):
    return select_tree_triton(roots.to(DEVICE), on_device(cands), depths.to(DEVICE), n, max_depth)


def on_device(cands: Candidates) -> Candidates:
    return Candidates(*(t.to(DEVICE) for t in vars(cands).values()))


def assert_same(got, want, max_depth):
    for name, x, y in zip(("tokens", "parents", "depths", "scores"), got[:4], want):
        assert x.dtype == y.dtype, name
        torch.testing.assert_close(x.cpu(), y, rtol=0, atol=0, equal_nan=True, msg=name)
    if got[4] is not None:
        assert torch.equal(got[4].cpu(), ancestor_mask(want[1], max_depth))


def test_garbage_rows_give_the_reference_tree():
    # padded batch rows draft from whatever features they hold: NaN and inf at every depth
    g = torch.Generator().manual_seed(11)
    roots, cands, depths = drafted_candidates(3, 8, 5, seed=11)
    for t in (cands.scores, cands.keys):
        t[torch.rand(t.shape, generator=g) < 0.3] = float("nan")
        t[torch.rand(t.shape, generator=g) < 0.1] = float("-inf")
    cands.keys[1] = float("nan")  # a whole row of NaN keys
    want = select_tree_reference(roots, cands, depths, 48)
    assert_same(run_kernel(roots, cands, depths, 48, 5), want, 5)


def test_a_chosen_node_without_its_parent_gets_parent_minus_one_as_in_the_reference():
    # not what drafting produces (a child never outranks its parent), but defined: no
    # uninitialised read
    roots, cands, depths = drafted_candidates(1, 2, 3, seed=5)
    cands.keys[0, 1] = float("nan")  # candidate id 2 (depth 1, not greedy) ranks last...
    child = int((cands.parents[0] == 2).nonzero()[0])
    cands.keys[0, child] = -0.01  # ...while its child outranks every non-greedy node
    want = select_tree_reference(roots, cands, depths, 5)
    assert (want[1][0, 1:] == -1).any()  # the case is real
    assert_same(run_kernel(roots, cands, depths, 5, 3), want, 3)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_dispatch_builds_the_mask_only_with_the_kernel(use_kernel):
    roots, cands, depths = drafted_candidates(2, 4, 4, seed=7)
    args = roots.to(DEVICE), on_device(cands), depths.to(DEVICE), 12, 4
    *_, anc = select_tree(*args, use_kernel=use_kernel)
    if use_kernel:
        assert anc is not None and anc.shape == (2, 12, 12)
    else:  # the torch path leaves the mask to verification
        assert anc is None


def test_out_of_range_tree_is_refused():
    roots, cands, depths = drafted_candidates(1, 2, 2, seed=3)
    with pytest.raises(ValueError, match="candidates"):
        run_kernel(roots, cands, depths, cands.tokens.shape[1] + 2, 2)
