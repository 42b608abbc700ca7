"""Ragged verification: a step verifies B * verified nodes in all, each request its root and
as many of its best nodes as they are worth; what it emits is still exactly the target's."""

from __future__ import annotations

import random

import pytest
import torch

from specserve import Engine
from specserve.speculative.tree import accept
from specserve.speculative.verify_budget import (
    node_values,
    observe,
    plan_verify,
    pruned,
    ranks_by_key,
)
from tests.engine_utils import (
    TINY,
    mixed_prompts,
    random_trees,
    spec_args,
    target_following_random_paths,
)


def scored_trees(bsz: int, n: int, depth: int, seed: int):
    """Random trees whose path log-probabilities fall along every path, as a draft's do."""
    g = torch.Generator().manual_seed(seed)
    trees = random_trees(bsz, n, depth, g)
    step = torch.log(torch.rand(bsz, n, generator=g).clamp(min=1e-3))
    scores = torch.zeros(bsz, n)
    for i in range(1, n):
        parent = trees.parents[:, i]
        scores[:, i] = scores.gather(1, parent[:, None]).squeeze(1) + step[:, i]
    trees.scores = scores
    return trees


@pytest.mark.parametrize("seed", range(6))
def test_a_plan_verifies_the_budget_in_closed_trees_roots_first(seed):
    bsz, n = 7, 12
    trees = scored_trees(bsz, n, 4, seed)
    g = torch.Generator().manual_seed(100 + seed)
    reached, predicted = torch.rand(bsz, 5, generator=g), torch.rand(bsz, 5, generator=g) + 0.1
    plain = torch.rand(bsz, generator=g) < 0.3
    total = bsz * (2 + seed % 4) if seed < 5 else bsz * n  # (the last: more than trees hold)
    plan = plan_verify(
        trees, node_values(trees, reached, predicted), ranks_by_key(trees), plain, total
    )
    keep = plan.keep
    assert keep.sum() == total or keep.sum() == bsz + (~plain).sum() * (n - 1)
    assert keep[:, 0].all()  # every request verifies its root
    assert not keep[plain, 1:].any()  # requests decoded plainly verify nothing else
    parent_kept = torch.gather(keep, 1, trees.parents.clamp(min=0))
    assert (parent_kept | ~keep).all()  # closed: a kept node's parent is kept
    # the packed rows are the kept nodes in order, and row_of maps them back
    flat = keep.reshape(-1).nonzero().flatten()
    assert torch.equal(plan.packed[: len(flat)], flat)
    assert torch.equal(plan.row_of.reshape(-1)[flat], torch.arange(len(flat)))


def test_requests_whose_drafts_are_accepted_get_the_larger_share():
    bsz, n = 4, 16
    trees = scored_trees(bsz, n, 5, 0)
    trees.scores = torch.zeros(bsz, n) - 0.01 * trees.depths  # every draft equally sure
    reached = torch.ones(bsz, 6)
    reached[2:] = 0.05  # requests 2, 3 rarely get past the root
    plan = plan_verify(
        trees, node_values(trees, reached, torch.ones(bsz, 6)), ranks_by_key(trees), None, 4 * 6
    )
    share = plan.keep.sum(dim=1)
    assert min(share[:2]) > max(share[2:]) >= 1 and share.sum() == 4 * 6, share


@pytest.mark.parametrize("seed", range(4))
def test_pruned_trees_accept_only_verified_nodes(seed):
    """Acceptance over a pruned tree walks kept nodes only, whatever the target draws."""
    bsz, n = 5, 10
    trees = scored_trees(bsz, n, 4, seed)
    g = torch.Generator().manual_seed(seed)
    target = target_following_random_paths(trees, g)
    plan = plan_verify(
        trees, node_values(trees, torch.ones(bsz, 5), torch.ones(bsz, 5)),
        ranks_by_key(trees), None, bsz * 3,
    )  # fmt: skip
    target = torch.where(target < 0, 10**6, target)  # (a draw no child has; draws are >= 0)
    target = torch.where(plan.keep, target, -2)  # pruned nodes draw nothing
    acc = accept(pruned(trees, plan.keep), target, trees.ancestors())
    on_path = torch.gather(plan.keep, 1, acc.path)
    assert on_path.all()
    # where the target follows kept nodes only, pruning changes nothing
    follows = torch.where(plan.keep, target, -2)
    assert (
        torch.equal(acc.accept_len, accept(trees, follows, trees.ancestors()).accept_len)
        or (acc.accept_len <= accept(trees, follows, trees.ancestors()).accept_len).all()
    )


def test_calibration_tracks_how_deep_accepted_paths_reach():
    bsz, n = 2, 8
    trees = scored_trees(bsz, n, 3, 1)
    reached, predicted = torch.ones(bsz, 4), torch.ones(bsz, 4)
    for _ in range(30):  # request 0 always accepts 3 nodes past the root, request 1 none
        reached, predicted = observe(reached, predicted, trees, torch.tensor([4, 1]))
    assert reached[0].tolist() == pytest.approx([1, 1, 1, 1], abs=1e-3)
    assert reached[1, 1:].max() < 1e-3
    # predicted: the draft's best path probability at each depth it drafted (else no news)
    prob = torch.exp(trees.scores)
    for b in range(bsz):
        for d in range(4):
            at = trees.depths[b] == d
            want = prob[b][at].max().item() if at.any() else 1.0
            assert predicted[b, d].item() == pytest.approx(want, abs=1e-3), (b, d)


def ragged_engine_outputs(prompts, params, seed: int, **kw):
    spec = spec_args("tiny", 3, 4, 10, speculative_adaptive=True)
    with Engine(**TINY, debug_check_invariants=True, **kw, **spec) as e:
        rng = random.Random(seed)
        names = [str(t) for t in e.core.adaptive.tiers]
        # the tiers verifying part of the tree, drawn as often as all the others together
        ragged = [names.index("4/3/10@2"), names.index("4/3/10@5")]
        others = [t for t in range(len(names)) if t not in ragged]
        e.core.adaptive.pick = lambda b, can=True, ready=None: rng.choice(
            ragged if rng.random() < 0.5 else others
        )
        outs = e.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        steps = e.stats()["speculative_adaptive"]["steps"]
    assert all(steps[t] > 0 for t in ragged), steps
    return outs


@pytest.mark.parametrize("page_size", [1, 3])
def test_ragged_steps_sample_and_score_as_plain_decoding(page_size):
    """Seeded sampling with filters, and the emitted tokens' log-probs, under ragged steps."""
    prompts = mixed_prompts(4, 512, seed=11)
    params = [
        {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 5 + i, "max_new_tokens": 30,
         "ignore_eos": True}
        for i in range(4)
    ]  # fmt: skip
    with Engine(**TINY, page_size=page_size) as e:
        plain = e.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    ragged = ragged_engine_outputs(prompts, params, seed=page_size, page_size=page_size)
    for a, b in zip(plain, ragged):
        assert a["output_ids"] == b["output_ids"]
        va = [v for v, _, _ in a["meta_info"]["output_token_logprobs"]]
        vb = [v for v, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert va == pytest.approx(vb, abs=1e-4)
