"""Lossless speculative decoding with draft trees, on tiny random-weight models."""

from __future__ import annotations

import itertools

import pytest
import torch

from specserve import Engine, InvalidArgument
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from specserve.speculative.tree import DraftTrees, accept, ancestor_mask
from tests.engine_utils import (
    TINY,
    assert_kv_matches_plain_prefill,
    mixed_prompts,
    random_trees,
    target_following_random_paths,
)

GREEDY = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
PROMPTS = mixed_prompts(5, 512, seed=7, min_len=1, max_len=30)


@pytest.fixture(scope="module")
def plain_outputs():
    with Engine(**TINY) as e:
        return [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {
        "EAGLE": write_random_eagle_checkpoint(
            str(root / "eagle"), PRESETS["tiny"], "EAGLE", seed=1
        ),
        "EAGLE3": write_random_eagle_checkpoint(
            str(root / "eagle3"), PRESETS["tiny"], "EAGLE3", draft_vocab_size=200, seed=2
        ),
        "STANDALONE": "tiny",
    }


def spec_engine(algo, drafts, steps, topk, ndt, page_size=1, **kw):
    return Engine(
        **TINY,
        page_size=page_size,
        debug_check_invariants=True,
        speculative_algorithm=algo,
        speculative_draft_model_path=drafts[algo],
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
        **kw,
    )


QUICK = [
    ("EAGLE", 1, 3, 4, 1),
    ("EAGLE", 4, 3, 8, 3),
    ("EAGLE3", 2, 5, 10, 16),
    ("STANDALONE", 8, 3, 16, 3),
    ("EAGLE", 16, 1, 17, 1),
    ("EAGLE", 8, 5, 64, 16),  # SGLang's usual tree: more nodes than steps * topk
    ("EAGLE3", 3, 4, 31, 3),  # the most the candidates allow: 1 + 3 + 3 * 9
]


@pytest.mark.parametrize("algo, topk, steps, ndt, page_size", QUICK)
def test_greedy_speculative_equals_plain(plain_outputs, drafts, algo, topk, steps, ndt, page_size):
    with spec_engine(algo, drafts, steps, topk, ndt, page_size) as e:
        outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain_outputs
    for o in outs:
        assert o["meta_info"]["spec_verify_ct"] > 0
        assert sum(o["meta_info"]["spec_accept_histogram"]) == o["meta_info"]["spec_verify_ct"]


def _sweep():
    for topk, steps, page_size in itertools.product([1, 2, 4, 8, 16], [1, 3, 5], [1, 3, 16]):
        max_tree = 1 + topk + (steps - 1) * topk * topk
        for ndt in sorted({2, min(max_tree, 1 + steps), min(max_tree, 1 + steps * topk, 64)}):
            yield ("EAGLE", topk, steps, ndt, page_size)


@pytest.mark.slow
@pytest.mark.parametrize("algo, topk, steps, ndt, page_size", list(_sweep()))
def test_greedy_sweep_equals_plain(plain_outputs, drafts, algo, topk, steps, ndt, page_size):
    with spec_engine(algo, drafts, steps, topk, ndt, page_size) as e:
        outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain_outputs


@pytest.mark.parametrize(
    "topk, steps, ndt, page_size", [(1, 3, 4, 1), (4, 3, 13, 3), (8, 5, 41, 16), (16, 1, 17, 4)]
)
def test_target_as_its_own_draft_accepts_every_draft(drafts, topk, steps, ndt, page_size):
    sp = {**GREEDY, "max_new_tokens": 1 + 4 * (steps + 1)}  # prefill token + 4 full verifies
    with Engine(**TINY) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=sp)]
    with spec_engine("STANDALONE", drafts, steps, topk, ndt, page_size) as e:
        outs = e.generate(input_ids=PROMPTS, sampling_params=sp)
    assert [o["output_ids"] for o in outs] == plain
    for o in outs:
        hist = o["meta_info"]["spec_accept_histogram"]
        assert hist == [0] * steps + [4], hist


def test_kv_cache_equals_plain_prefill_after_every_step(drafts):
    checked = []
    with spec_engine("EAGLE", drafts, 3, 4, 9, page_size=3) as e:
        e.step_hooks.append(lambda core: checked.append(assert_kv_matches_plain_prefill(core)))
        e.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY)
    assert sum(checked) > 10


def test_stops_inside_an_accepted_run(plain_outputs, drafts):
    ref = plain_outputs[0]
    stop_tok = ref[7]
    expected = ref[: ref.index(stop_tok) + 1]
    with spec_engine("STANDALONE", drafts, 5, 2, 8) as e:
        out = e.generate(
            input_ids=PROMPTS[0], sampling_params={**GREEDY, "stop_token_ids": [stop_tok]}
        )
        capped = e.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 9})
        assert e.stats()["kv_used_tokens"] == 0
    assert out["output_ids"] == expected
    assert capped["output_ids"] == ref[:9]


def test_retraction_with_topk_8_leaves_outputs_unchanged(drafts):
    prompts = mixed_prompts(24, 512, seed=11, min_len=3, max_len=12)
    sp = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(**TINY) as e:
        expected = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
    with spec_engine("EAGLE", drafts, 3, 8, 16, page_size=4, max_total_tokens=240) as e:
        outs = e.generate(input_ids=prompts, sampling_params=sp)
        assert e.stats()["num_retractions"] > 0
        assert e.stats()["kv_used_tokens"] == 0
    assert [o["output_ids"] for o in outs] == expected


def test_seeded_sampling_equals_plain_sampling(drafts):
    """Counter-based noise: with the same seed, verification draws what plain decoding draws."""
    sp = {
        "temperature": 1.0,
        "top_k": 40,
        "top_p": 0.9,
        "seed": 5,
        "max_new_tokens": 20,
        "ignore_eos": True,
    }
    with Engine(**TINY) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=sp)]
    with spec_engine("STANDALONE", drafts, 3, 4, 10) as e:
        spec = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=sp)]
    assert spec == plain


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (
            dict(speculative_algorithm="MEDUSA", speculative_draft_model_path="tiny"),
            "speculative_algorithm",
        ),
        (dict(speculative_algorithm="EAGLE"), "speculative_draft_model_path"),
        (dict(speculative_num_steps=3), "speculative_num_steps"),
        (
            dict(
                speculative_algorithm="STANDALONE",
                speculative_draft_model_path="tiny",
                speculative_num_steps=2,
                speculative_eagle_topk=2,
                speculative_num_draft_tokens=8,  # 7 candidates: 2, then 2 x 2
            ),
            "speculative_num_draft_tokens",
        ),
        (
            dict(
                speculative_algorithm="STANDALONE",
                speculative_draft_model_path="tiny",
                speculative_eagle_topk=0,
            ),
            "speculative_eagle_topk",
        ),
        (
            dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/nonexistent"),
            "speculative_draft_model_path",
        ),
    ],
)
def test_invalid_speculative_configuration_is_refused(kwargs, field):
    with pytest.raises(InvalidArgument) as info:
        Engine(**TINY, **kwargs)
    assert info.value.field == field


def test_resolver_fills_a_chain_by_default_and_explains():
    from specserve.config import EngineConfig

    c = EngineConfig(speculative_algorithm="eagle", speculative_draft_model_path="x").resolve(
        cuda_available=False
    )
    assert (c.speculative_num_steps, c.speculative_eagle_topk, c.speculative_num_draft_tokens) == (
        3,
        1,
        4,
    )
    fields = {f for f, _, _ in c.decisions}
    assert {
        "speculative_algorithm",
        "speculative_num_steps",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "speculative_adaptive",
    } <= fields
    adaptive = [(v, r) for f, v, r in c.decisions if f == "speculative_adaptive"]
    assert adaptive[0][0] is False and "speculative_adaptive turns it on" in adaptive[0][1]


def test_adaptive_lag_tokens_without_speculation_are_rejected_by_name():
    from specserve.config import EngineConfig
    from specserve.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="speculative_adaptive_lag_tokens"):
        EngineConfig(speculative_adaptive_lag_tokens=8).resolve(cuda_available=False)


def test_accept_walks_the_matching_path():
    # root 0 -> {1: tok 10, 2: tok 11}; 1 -> {3: tok 12}; 2 -> {4: tok 13}
    trees = DraftTrees(
        tokens=torch.tensor([[99, 10, 11, 12, 13]]),
        parents=torch.tensor([[-1, 0, 0, 1, 2]]),
        depths=torch.tensor([[0, 1, 1, 2, 2]]),
        max_depth=2,
    )
    # target: after root -> 11 (node 2), after node 2 -> 13 (node 4), after node 4 -> 7 (bonus)
    target = torch.tensor([[11, 0, 13, 0, 7]])
    acc = accept(trees, target)
    assert acc.accept_len.tolist() == [3]
    assert acc.path.tolist() == [[0, 2, 4]]
    assert acc.emitted.tolist() == [[11, 13, 7]]
    mask = ancestor_mask(trees.parents, 2)[0]
    assert mask[4].tolist() == [True, False, True, False, True]
    # rejection at the root: only the correction token is emitted
    acc = accept(trees, torch.tensor([[42, 0, 0, 0, 0]]))
    assert acc.accept_len.tolist() == [1] and acc.emitted[0, 0].item() == 42


def test_tree_selection_keeps_the_stable_sort_order_under_ties():
    """The drafter picks the tree's nodes by one top-k over composite keys; it must choose
    what a stable descending sort would (ties to the lower candidate id, i.e. a parent before
    its children), or a chosen node could miss its parent."""
    from specserve.ops.triton_tree_select import best_columns

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        b, c = 3, int(torch.randint(2, 200, (1,), generator=g))
        keys = torch.randn(b, c, generator=g)
        keys = torch.where(torch.rand(b, c, generator=g) < 0.4, keys.round(), keys)  # ties
        keys[torch.rand(b, c, generator=g) < 0.1] = -0.0
        keys[torch.rand(b, c, generator=g) < 0.05] = 1e6 - 3  # the draft's greedy chain
        keys[torch.rand(b, c, generator=g) < 0.1] = float("-inf")
        nan = torch.rand(b, c, generator=g) < 0.05
        keys[nan] = float("nan")
        keys[nan & (torch.rand(b, c, generator=g) < 0.5)] = -float("nan")  # sign bit set
        m = int(torch.randint(1, c + 1, (1,), generator=g))
        as_sorted = torch.where(keys.isnan(), float("-inf"), keys + 0.0)  # NaN ranks as -inf
        stable = torch.sort(as_sorted, dim=1, descending=True, stable=True).indices[:, :m]
        got = best_columns(keys, m)
        assert torch.equal(got.sort(dim=1).values, stable.sort(dim=1).values)


def test_accept_from_the_ancestor_mask_equals_the_walk():
    """Verification accepts through the ancestor mask it already built; that must be the same
    path, bonus and tokens as walking the tree depth by depth, on random trees."""
    g = torch.Generator().manual_seed(3)
    longest = 0
    for bsz, n, max_depth in [(1, 6, 5), (3, 16, 4), (4, 64, 8), (2, 9, 1), (5, 33, 6)]:
        trees = random_trees(bsz, n, max_depth, g)
        target = target_following_random_paths(trees, g)
        walked = accept(trees, target)
        masked = accept(trees, target, ancestor_mask(trees.parents, max_depth))
        for field in ("accept_len", "path", "bonus", "emitted"):
            assert torch.equal(getattr(walked, field), getattr(masked, field)), field
        longest = max(longest, int(walked.accept_len.max()))
    assert longest > 3  # the cases exercise long accepted paths


def test_accept_never_takes_a_node_without_a_parent():
    """A non-root node whose parent is missing (-1) is not on any root path; neither way of
    accepting may take it, whatever the target says."""
    trees = DraftTrees(
        tokens=torch.tensor([[5, 10, 11]]),
        parents=torch.tensor([[-1, 0, -1]]),
        depths=torch.tensor([[0, 1, 2]]),
        max_depth=2,
    )
    target = torch.tensor([[11, 7, 9]])  # after the root the target says 11: node 2's token
    for acc in (accept(trees, target), accept(trees, target, ancestor_mask(trees.parents, 2))):
        assert acc.accept_len.tolist() == [1] and acc.emitted[0, 0].item() == 11


def test_stale_nan_in_the_draft_cache_does_not_leak_into_drafting(plain_outputs):
    """Tree drafting attends over the whole draft scratch with a mask; masked entries still
    enter with weight 0, so a non-finite leftover there (a reused page) must be cleared
    first, or every draft goes NaN and nothing is accepted. (The target is its own draft here,
    so every draft token is accepted when nothing leaks.)"""
    kwargs = dict(
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="tiny",
        speculative_num_steps=4,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=8,
    )
    accept_lengths = []
    for poison in (False, True):
        with Engine(**TINY, **kwargs) as engine:
            if poison:
                engine.core.worker.drafter.kv.buffer.fill_(float("nan"))
            outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outs] == plain_outputs
            accept_lengths.append(engine.stats()["spec_accept_length"])
    assert accept_lengths[0] > 4.5 and accept_lengths[1] == accept_lengths[0]
