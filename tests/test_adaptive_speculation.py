"""Load-adaptive speculation: every step drafts plain, a chain or the configured tree. Any
sequence of tiers decodes exactly what plain decoding does, the draft stays caught up over
plain steps, and the policy picks what pays."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specserve import Engine
from specserve.runtime.cuda_graphs import DecodeGraphs
from specserve.speculative.adaptive import (
    EXPLORE_BUDGET,
    AdaptiveSpeculation,
    batch_bucket,
    speculation_tiers,
)
from specserve.speculative.decision_hold import DECIDE_EVERY
from specserve.speculative.tree import PLAIN, TreeShape
from tests.engine_utils import (
    TINY,
    assert_kv_matches_plain_prefill,
    mixed_prompts,
    spec_args,
    wait_for_idle_captures,
)

SP = {"temperature": 0.0, "max_new_tokens": 14, "ignore_eos": True}


def run(prompts, params, random_tiers: int | None = None, padded=False, **kw):
    """random_tiers: a seed: each step's tier drawn at random instead of by the policy."""
    checked = []
    with Engine(**TINY, debug_check_invariants=True, **kw) as e:
        core = e.core
        if random_tiers is not None:  # random, but every tier early on
            rng = random.Random(random_tiers)
            count = len(core.adaptive.tiers)
            order = list(range(count))
            rng.shuffle(order)
            core.adaptive.pick = lambda b, can=True, ready=None: (
                order.pop() if order else rng.randrange(count)
            )
        if padded:
            core.worker.graphs = DecodeGraphs(core.worker, 4, max_width=4096, capture=False)
        e.step_hooks.append(lambda c: checked.append(assert_kv_matches_plain_prefill(c)))
        outs = e.generate(input_ids=prompts, sampling_params=params)
        stats = e.stats()
    return [o["output_ids"] for o in outs], stats, sum(checked)


@pytest.mark.parametrize("page_size", [1, 4, 3])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_any_sequence_of_tiers_decodes_as_plain_decoding(page_size, overlap, padded):
    prompts = mixed_prompts(5, 512, seed=page_size)
    kw = dict(page_size=page_size, disable_overlap_schedule=not overlap)
    params = dict(SP, max_new_tokens=40)  # enough steps for every tier
    plain, _, _ = run(prompts, params, **kw)
    # the target as its own draft: a drafting tier accepts all it drafts, if and only if the
    # draft's KV and root state stayed exact over the plain steps before it
    spec = spec_args("tiny", 3, 4, 10, speculative_adaptive=True)
    outs, stats, checked = run(prompts, params, random_tiers=page_size, padded=padded, **kw, **spec)
    assert outs == plain and checked > 0
    adaptive = stats["speculative_adaptive"]
    # plain, chains of 1..3, the tree verifying 2 and 5 of its 10 nodes per request, the tree
    assert adaptive["tiers"] == [
        "plain",
        "1/1/2",
        "2/1/3",
        "3/1/4",
        "4/3/10@2",
        "4/3/10@5",
        "4/3/10",
    ]
    assert all(n > 0 for n in adaptive["steps"]), adaptive  # every tier ran
    chain1, chain2, chain3, quarter, half, tree = adaptive["accept_length"][1:]
    assert (chain1, chain2, chain3, tree) == (2.0, 3.0, 4.0, 5.0)  # all they drafted
    assert 1.0 < quarter <= half <= tree  # pruned trees verify less of the same drafts


def test_each_tiers_step_reads_the_context_width_of_its_own_window():
    """A step of a small tier (plain, a chain) writes fewer positions past kv_len than the
    configured tree: it runs at kv_len + its own window (+ a catch-up's reach when it catches
    the draft up), so it is not pushed into a wider context bucket than the small tree alone
    would be; outputs stay those of plain decoding."""
    from specserve.speculative.step import DecodeStep

    prompts = mixed_prompts(4, 512, seed=7)
    params = dict(SP, max_new_tokens=30)
    plain, _, _ = run(prompts, params)
    seen = []  # (tier, catch_up, width - max kv_upper, the step's tier_slot_width)
    real_run = DecodeStep.run

    def recording_run(self, rows, sampling, width, kv_upper, tier=0, catch_up=False):
        seen.append((tier, catch_up, width - max(kv_upper), self.tier_slot_width(tier, catch_up)))
        return real_run(self, rows, sampling, width, kv_upper, tier, catch_up)

    spec = spec_args("tiny", 3, 4, 10, speculative_adaptive=True)
    DecodeStep.run = recording_run
    try:
        outs, stats, _ = run(prompts, params, random_tiers=3, **spec)
    finally:
        DecodeStep.run = real_run
    assert outs == plain
    count = len(stats["speculative_adaptive"]["tiers"])
    assert all(extra == own for _, _, extra, own in seen)
    by_tier = {(t, c): extra for t, c, extra, _ in seen}
    whole = by_tier[(count - 1, False)]
    assert by_tier[(0, False)] < by_tier[(1, False)] < whole  # plain, a chain of 1, the tree
    caught_up = [extra for (t, c), extra in by_tier.items() if c]
    assert caught_up and min(caught_up) >= 32  # a catch-up reaches over the ring of 32


def test_eagle_with_switches_and_retraction_under_random_tiers(tmp_path):
    from specserve.model.config import PRESETS
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint

    eagle = write_random_eagle_checkpoint(str(tmp_path / "e"), PRESETS["tiny"], "EAGLE")
    prompts = mixed_prompts(10, 512, seed=4, min_len=10, max_len=40)
    params = [dict(SP, speculative=i % 3 != 0) for i in range(10)]
    kw = dict(page_size=2, max_total_tokens=200)
    plain, _, _ = run(prompts, params, **kw)
    spec = spec_args(eagle, 2, 3, 6, speculative_adaptive=True)
    outs, stats, _ = run(prompts, params, random_tiers=1, **kw, **spec)
    assert outs == plain and stats["num_retractions"] > 0


def test_tiers_of_a_configuration():
    assert speculation_tiers(TreeShape(6, 8, 64)) == [
        PLAIN,
        TreeShape(1, 1, 2),
        TreeShape(2, 1, 3),
        TreeShape(3, 1, 4),
        TreeShape(4, 4, 16),  # drafts a fraction of the configured tree
        TreeShape(6, 8, 64, 16),
        TreeShape(6, 8, 64, 32),
        TreeShape(6, 8, 64),
    ]
    assert speculation_tiers(TreeShape(3, 1, 4)) == [
        PLAIN,
        TreeShape(1, 1, 2),
        TreeShape(2, 1, 3),
        TreeShape(3, 1, 4),
    ]
    assert speculation_tiers(TreeShape(1, 1, 2)) == [PLAIN, TreeShape(1, 1, 2)]
    # a configured tree no larger than the small one has no separate small tier
    assert TreeShape(3, 2, 6) not in speculation_tiers(TreeShape(3, 2, 6))[:-1]
    assert speculation_tiers(TreeShape(4, 4, 16))[-1] == TreeShape(4, 4, 16)


def test_every_tier_of_every_valid_configuration_fits_what_the_configured_tree_reserves():
    """A tier drafts no more nodes than its own steps and topk produce, and writes no more
    positions, accepts no deeper and keeps no wider topk than the configured tree the
    engine sized its windows and buffers for."""
    from specserve.config.speculative import MAX_STEPS, MAX_TOPK

    for steps in range(1, MAX_STEPS + 1):
        for topk in range(1, MAX_TOPK + 1):
            most = 1 + topk + (steps - 1) * topk * topk
            for tokens in sorted({2, 3, 5, 6, 9, 16, 17, 33, 64, most // 2, most} - {0, 1}):
                shape = TreeShape(steps, topk, min(tokens, most))
                for t in speculation_tiers(shape):
                    drafted = 1 + t.topk + (t.steps - 1) * t.topk * t.topk
                    assert t.tokens <= drafted, (shape, t)
                    assert t.topk <= shape.topk and t.max_depth <= shape.max_depth, (shape, t)
                    for delta in (0, 1):
                        assert t.window(delta) <= shape.window(delta), (shape, t)


@pytest.mark.parametrize(
    "steps,topk,ndt", [(6, 8, 64), (4, 4, 16), (1, 8, 9), (5, 2, 16), (3, 1, 4)]
)
def test_the_resolver_explains_the_tiers_the_policy_runs(steps, topk, ndt):
    from specserve.config.engine_config import EngineConfig

    spec = spec_args("tiny", topk, steps, ndt, speculative_adaptive=True)
    cfg = EngineConfig.from_kwargs(**TINY, **spec).resolve(cuda_available=False)
    why = next(r for f, _, r in cfg.decisions if f == "speculative_adaptive")
    shape = TreeShape(steps, topk, ndt)
    # the trees other than the configured one (the small tree, where there is one)
    others = [t for t in speculation_tiers(shape) if t.topk > 1 and t.drafted != shape]
    described = why.split(", the")[0]  # (the configured tree and its budgets come after)
    assert described.count("-step topk-") == len(others), why
    for t in others:
        assert f"a {t.steps}-step topk-{t.topk} tree of {t.tokens}" in described, (t, why)


def test_policy_measures_first_then_picks_what_pays_and_keeps_exploring():
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(6, 8, 64)]
    p = AdaptiveSpeculation(tiers, explore_every=8)
    seconds = {0: 1.0, 1: 1.2, 2: 1.6}  # a step's cost per tier (same at every batch size)
    first = []
    for _ in range(6):
        first.append(p.pick(4))
        # a tier's first step compiles and takes long: it must not count
        took = 100.0 if first[-1] not in first[:-1] else seconds[first[-1]]
        p.observe(first[-1], 4, [1] * 4, took)
    assert first == [0, 0, 1, 1, 2, 2]  # every tier measured at this bucket before choosing
    p.observe(1, 4, [1] * 4, None)  # (a step that captured a graph reports no time)
    # drafts rejected: plain pays most; speculative tiers are still tried, ever more rarely
    picks = []
    for _ in range(8 * 63):
        t = p.pick(4)
        picks.append(t)
        p.observe(t, 4, [1] * 4, seconds[t])
    explored = [i for i, t in enumerate(picks) if t != 0]
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    # (the gaps double; one that costs more than EXPLORE_BUDGET at the pace waits longer)
    assert 4 <= len(explored) <= 7 and gaps[-1] == max(gaps) >= 8 * 8, explored
    # drafts accepted again: the tree emits 7 a step, the chain 4, and the tree pays most
    # (4 * 7 / 1.6 > 4 * 4 / 1.2); the chain wins first, exploring finds the tree
    picks = []
    for _ in range(600):
        picks.append(p.pick(4))
        t = picks[-1]
        p.observe(t, 4, [7 if t == 2 else (4 if t == 1 else 1)] * 4, seconds[t])
    assert picks[-16:].count(2) >= 14, picks  # (one step in 8 explores another tier)


def test_a_steady_choice_is_scored_once_every_few_steps_and_a_drop_in_acceptance_ends_it():
    """Where the best tier stays best, the policy scores the tiers once every DECIDE_EVERY
    steps (its own work was a tenth of a host-bound step's); when the served tier's drafts
    stop being accepted it switches at the next step, not after the decision's hold."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(4, 4, 16)]
    seconds = [1.0, 1.2, 1.5]
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: seconds[t], explore_every=8)
    scored = []
    score = p._scores
    p._scores = lambda *a, **k: scored.append(1) or score(*a, **k)
    picks = []
    for _ in range(400):
        t = p.pick(64)
        picks.append(t)
        p.observe(t, 64, [(1, 2, 4)[t]] * 64, seconds[t])
    assert picks[-40:].count(2) >= 39, picks[-40:]  # the tree serves (4 tokens in 1.5)
    assert len(scored) <= 400 / DECIDE_EVERY + 30, len(scored)  # (+ explorations' own)
    # the tree's drafts stop being accepted: the next step's pick scores afresh
    t = p.pick(64)
    assert t == 2
    p.observe(2, 64, [1] * 64, seconds[2])
    after = p.pick(64)
    assert after != 2, p.accept


def test_a_hold_neither_keeps_a_stand_in_nor_a_tier_whose_step_time_moved():
    """A ragged tier standing in for its whole tree (no graph yet) is not held: once the
    whole tree is replayable it runs. And a step time that moved (a ragged tier's served
    steps far slower than its replay, so dominated by its whole tree) ends a hold."""
    tiers = speculation_tiers(TreeShape(6, 8, 64))
    whole = tiers.index(TreeShape(6, 8, 64))
    ragged = [t for t, shape in enumerate(tiers) if shape.ragged]
    ms = {t: 3.0 for t in range(len(tiers))}
    ms.update({0: 1.0, whole: 1.5, **{t: 1.5 for t in ragged}})
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: ms[t] / 1e3, explore_every=10**6)
    for t in range(1, len(tiers)):
        p.observe(t, 1, [4] * 16, ms[t] / 1e3)
    stand_in = p.pick(1, ready=frozenset({0, ragged[-1]}))
    assert stand_in == ragged[-1]
    p.observe(stand_in, 1, [4], ms[stand_in] / 1e3)
    assert p.pick(1, ready=frozenset({0, ragged[-1], whole})) == whole

    ms = {t: 1.5 for t in range(len(tiers))}
    ms.update({0: 0.8, **{t: 1.0 for t in ragged}})
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: ms[t] / 1e3, explore_every=10**6)
    for t in range(len(tiers)):
        p.observe(t, 1, [4] * 16, ms[t] / 1e3)
    first = p.pick(1)
    assert first in ragged
    p.observe(first, 1, [4], 11e-3)  # (its estimate: 3 ms, twice its whole tree's)
    assert p.pick(1) != first  # (dominated now; before, held for 3 more steps)


def test_explorations_that_find_nothing_come_ever_more_rarely_until_the_best_changes():
    """A steady speculative best (a chain of 2 at accept length 3, where deeper tiers emit no
    more) is explored around at a doubling interval, not every 32 steps; when the best tier
    changes (the draft stops being accepted) the pace starts over."""
    tiers = [PLAIN, TreeShape(1, 1, 2), TreeShape(2, 1, 3), TreeShape(3, 1, 4)]
    seconds = [1.0, 1.1, 1.2, 1.3]
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: seconds[t], explore_every=8)
    accept = 3

    def serve(steps: int) -> list[int]:
        picks = []
        for _ in range(steps):
            t = p.pick(4)
            picks.append(t)
            p.observe(t, 4, [min(accept, tiers[t].max_depth + 1)] * 4, seconds[t])
        return picks

    picks = serve(2000)
    assert picks[-100:].count(2) >= 99  # the chain of 2 serves
    explored = [i for i, t in enumerate(picks) if t != 2 and i > 50]
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 8 * 16, gaps
    assert len(explored) <= 12, explored  # at a fixed pace of 8 it would be ~250
    accept = 1  # drafts rejected: plain becomes best, and explorations start over
    picks = serve(200)
    first_plain = picks.index(0)
    again = [i for i, t in enumerate(picks) if t != 0 and i > first_plain + 4]
    # (at the first pace, or where a tier's step costs more than EXPLORE_BUDGET of the steps
    # since the last exploration, once it does not)
    dearest = (max(seconds) - seconds[0]) / (EXPLORE_BUDGET * seconds[0])
    assert again and again[0] - first_plain <= max(2 * 8, dearest + 1), picks[:60]


def test_a_trees_steps_teach_the_chains_it_contains_so_they_need_no_exploring():
    """A tree step reports how far its accepted path followed the draft's greedy chain: what a
    chain no deeper than the tree would have accepted. The policy learns those chains from it
    (a ragged step, whose pruning may cut the chain, teaches nothing) and explores only what
    it cannot learn that way: the other tree."""
    tiers = [PLAIN, TreeShape(1, 1, 2), TreeShape(3, 1, 4), TreeShape(4, 4, 16)]
    tiers += [TreeShape(6, 8, 64, 16), TreeShape(6, 8, 64)]
    seconds = [1.0, 1.1, 1.2, 1.3, 1.6, 1.5]  # (the ragged tier costs more than its whole tree)
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: seconds[t], explore_every=8)
    big = len(tiers) - 1
    p.observe(big, 2, [5, 1], 1.5, chain_reach=[4, 0])
    # chain of 1: 1 + min(1, reach) = [2, 1]; chain of 3: [4, 1]; decayed into the prior
    for chain, want in ((1, 1.5), (2, 2.5)):
        assert p.accept[chain] == pytest.approx(want, rel=0.05), p.accept
    assert p.counts[1] == p.counts[2] == 0  # learnt, not run
    before = list(p.accept)
    p.observe(4, 2, [3, 3], 1.4, chain_reach=[0, 0])  # ragged: its chain may have been pruned
    assert p.accept[1:3] == before[1:3]
    p.observe(3, 2, [5, 5], 1.3, chain_reach=[2, 3])  # the 4-deep tree teaches chains too
    assert before[2] < p.accept[2] < 3.5  # toward this step's [3, 4]
    # serving the big tree, whose side branches are accepted where the greedy chain stops
    # after a token: the chains, cheap enough that they would pay were all their tokens
    # accepted, are known not to, so only the small tree is explored
    seconds[2], seconds[3] = 0.8, 1.0
    accept = {1: 2, 2: 2, 3: 3, big: 7}
    picks = []
    for _ in range(400):
        t = p.pick(2)
        picks.append(t)
        p.observe(t, 2, [accept[t]] * 2, seconds[t], chain_reach=[1] * 2)
    assert picks[-100:].count(big) >= 95
    assert set(picks[50:]) == {3, big}, sorted(set(picks[50:]))
    assert p.accept[2] == pytest.approx(2.0, rel=0.02)  # 1 + min(3, 1)


def test_a_tier_learnt_on_hard_text_is_carried_to_the_easier_text_served_now():
    """A batch's tail of slow requests (hard text) teaches the tree a low acceptance and a
    chain of 3 serves; on the next batch (easy text) the chain's own steps say the text got
    easier, and the tree, not served since, is carried up with it and serves again without
    waiting for an exploration (explorations are off here)."""
    tiers = [PLAIN, TreeShape(1, 1, 2), TreeShape(2, 1, 3), TreeShape(3, 1, 4)]
    tiers.append(TreeShape(4, 4, 16))
    seconds = [0.9e-3, 1.0e-3, 1.0e-3, 1.0e-3, 1.45e-3]
    p = AdaptiveSpeculation(
        tiers, measure=lambda b, t: seconds[t], explore_every=10**6, max_explore_gap=10**6
    )
    tree, chain = 4, 3
    batch = 64

    def step(easy: bool) -> int:
        t = p.pick(batch)
        if easy:  # the chain of 3 emits 3 a request, the tree 4.5
            reach = [3] * 32 + [1] * 32
            tree_emits = [4, 5] * 32
        else:  # the chain of 3 emits 2.31, the tree 3.3
            reach = [3] * 7 + [2] * 6 + [1] * 51
            tree_emits = [3] * 45 + [4] * 19
        emitted = tree_emits if t == tree else [1 + min(tiers[t].max_depth, r) for r in reach]
        p.observe(t, batch, emitted, seconds[t], chain_reach=reach)
        return t

    easy = [step(True) for _ in range(40)]
    assert easy[-10:] == [tree] * 10  # 4.5 / 1.45 ms against the chain's 3 / 1.0 ms
    hard = [step(False) for _ in range(40)]
    assert hard[-10:] == [chain] * 10  # 3.3 / 1.45 ms against 2.31 / 1.0 ms
    again = [step(True) for _ in range(40)]
    # the tree's 3.3 carried by the chain's 2.31 -> 3: 4.5 a request, 4% ahead of the
    # chain's score; not carried, 24% behind
    assert again[-10:] == [tree] * 10, again
    assert p.accept[tree] == pytest.approx(4.5, rel=0.03)  # (served: learnt again)


def after_a_rejection_stretch(tiers, seconds, batch: int) -> AdaptiveSpeculation:
    """A policy that served 3,000 steps of `batch` requests whose drafts were all rejected:
    plain decoding serves, explorations ever rarer."""
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: seconds[t], explore_every=8)
    for _ in range(3000):
        t = p.pick(batch)
        p.observe(t, batch, [1] * batch if t else [], seconds[t])
    return p


def test_a_batch_of_new_requests_is_explored_at_once_even_where_no_tier_is_captured():
    """After a long stretch where drafts did not help (plain best, explorations far apart),
    new requests are other text: they must be tried before their drafts fall too far behind
    to catch up, even at a graph shape where only plain decoding is captured."""
    tiers = [PLAIN, TreeShape(1, 1, 2), TreeShape(3, 1, 4)]
    seconds = [1.0, 1.1, 1.3]
    p = after_a_rejection_stretch(tiers, seconds, 4)
    assert p.explore_gap == p.max_explore_gap
    picks = [p.pick(4, ready=frozenset({0})) for _ in range(20)]
    assert picks == [0] * 20  # only plain captured here: no exploration, no capture
    p.arrived(3)
    assert p.explore_gap == p.max_explore_gap  # fewer than a step holds: the same text
    p.arrived(1)
    picks = [p.pick(4, ready=frozenset({0})) for _ in range(8)]
    assert any(t > 0 for t in picks), picks  # tried at the first pace, captured once
    assert sum(t > 0 for t in picks) == 1, picks


def test_new_requests_are_tried_on_a_captured_tier_without_a_capture():
    """Where a speculative tier is captured at the step's shape, new requests are tried on it:
    no capture is paid for new text (one per batch of new requests stalled the first steps of
    every batch of a benchmark, and of a server under steady arrivals)."""
    tiers = [PLAIN, TreeShape(1, 1, 2), TreeShape(3, 1, 4)]
    seconds = [1.0, 1.1, 1.3]
    p = after_a_rejection_stretch(tiers, seconds, 4)
    p.pick(4)
    p.observe(1, 4, [1] * 4, seconds[1])  # the chain was tried last: the other is due first
    p.arrived(4)
    captured = frozenset({0, 1})
    picks = [p.pick(4, ready=captured) for _ in range(8)]
    assert any(t > 0 for t in picks), picks  # tried at the first pace
    assert set(picks) <= captured, picks  # on the captured chain: no capture


def test_new_requests_are_tried_even_where_only_hopeless_tiers_are_captured():
    """A captured speculative tier that could not beat plain decoding even accepting all it
    drafts (a wide tree at a large batch) is no way to try new requests: the new text's
    exploration then captures a tier that could."""
    tiers = [PLAIN, TreeShape(1, 1, 2), TreeShape(6, 8, 64)]
    seconds = [1.0, 1.1, 20.0]
    p = after_a_rejection_stretch(tiers, seconds, 64)
    p.arrived(64)
    picks = [p.pick(64, ready=frozenset({0, 2})) for _ in range(64)]
    assert [t for t in picks if t] == [1], picks  # the chain, captured once


def test_new_requests_speculating_already_are_not_explored_at_a_capture():
    """Where a speculative tier is the best, new requests speculate already: their text
    lets no exploration capture a tier at a shape where none worth exploring is captured (a
    capture in a batch's tail stalled a SmolLM2 batch of 128 on an H200 for 0.27 s, as long
    as the rest of its decode). Plain decoding and the best tier are captured there."""
    tiers = [PLAIN, TreeShape(1, 1, 2), TreeShape(3, 1, 4), TreeShape(6, 8, 64)]
    seconds = [1.0e-3, 1.1e-3, 1.2e-3, 1.8e-3]
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: seconds[t], explore_every=4)
    for _ in range(50):
        t = p.pick(8)
        p.observe(t, 8, [[1, 2, 3, 4][t]] * 8 if t else [], seconds[t])
    assert p.pick(8) == 2  # the chain of 3: 24 tokens in 1.2 ms (the tree: 32 in 1.8)
    p.arrived(8)
    picks = [p.pick(8, ready=frozenset({0, 2})) for _ in range(40)]
    assert set(picks) == {2}, picks


def test_a_captured_ragged_tier_stands_in_for_its_uncaptured_whole_tree():
    """A ragged tier never runs as the best tier where it costs as much as its whole tree,
    but where the whole tree is not captured at the step's shape and the captured ragged
    tier scores within the capture margin, it runs instead of a capture."""
    tiers = speculation_tiers(TreeShape(6, 8, 64))
    whole = tiers.index(TreeShape(6, 8, 64))
    ragged = [t for t, s in enumerate(tiers) if s.ragged]
    ms = {t: 3.0 for t in range(len(tiers))}
    ms[0], ms[whole] = 1.0, 1.5
    ms.update({t: 1.5 for t in ragged})  # host-bound: the budget saves nothing
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: ms[t] / 1e3, explore_every=10**6)
    for t in range(1, len(tiers)):
        p.observe(t, 1, [4] * 16, ms[t] / 1e3)
    assert p.pick(1) == whole
    assert p.pick(1, ready=frozenset({0, ragged[-1]})) == ragged[-1]


def test_new_text_lets_the_next_exploration_capture_there_and_nowhere_later():
    """Where no tier is worth exploring when the pace comes due (a large batch), the new
    requests' chance to capture is spent: it does not carry over to a draining tail."""
    tiers = [PLAIN, TreeShape(1, 1, 2), TreeShape(3, 1, 4)]

    def measure(b, t):  # speculation hopeless at 256, cheap at 2
        return 1e-3 * (1.0 + 0.1 * t) * (100.0 if b >= 256 and t else 1.0)

    p = AdaptiveSpeculation(tiers, measure=measure, explore_every=8)
    for t in (1, 2, 1, 2):  # drafts rejected: plain is best at any batch
        p.observe(t, 2, [1, 1], measure(2, t))
    for _ in range(200):
        t = p.pick(256)
        p.observe(t, 256, [1] * 256 if t else [], measure(256, t))
    p.arrived(256)
    for _ in range(20):  # the pace comes due here, with nothing hopeful
        assert p.pick(256, ready=frozenset({0})) == 0
    tail = [p.pick(2, ready=frozenset({0})) for _ in range(50)]
    assert tail == [0] * 50, tail  # only plain is captured at the tail's shape


def test_the_engine_tells_the_policy_of_each_request_that_starts_decoding():
    spec = spec_args("tiny", 3, 4, 10, speculative_adaptive=True)
    with Engine(**TINY, **spec) as e:
        calls = []
        arrived = e.core.adaptive.arrived
        e.core.adaptive.arrived = lambda n=1: (calls.append(n), arrived(n))
        e.generate(input_ids=mixed_prompts(5, 64, seed=4), sampling_params=SP)
        assert sum(calls) == 5
        # not new text for the drafts: one done at its first token, one decoded plainly
        e.generate(input_ids=[[5, 6, 7]], sampling_params=dict(SP, max_new_tokens=1))
        e.generate(input_ids=[[5, 6, 7]], sampling_params=dict(SP, speculative=False))
        assert sum(calls) == 5


@pytest.mark.parametrize("plain_rows", [0, 31])
def test_one_requests_noisy_accept_lengths_do_not_lock_the_policy_out_of_the_best_tier(plain_rows):
    """At batch 1 one request's accept length varies from step to step by more than the tiers
    differ, and real text runs easy and hard in stretches. The policy must still serve close
    to the best fixed tier: an estimate moved 20% by each single step locked the worse tier in
    for long runs and got 0.69 of the best tier's tokens/s here; one whose decay let a single
    exploring step decide a tier explored rarely got 0.93 (0.99 now). Requests that do not
    speculate (plain_rows: `speculative` off) ride along without diluting the evidence."""
    tiers = speculation_tiers(TreeShape(6, 8, 64))
    # step ms per tier at batch 1: SmolLM2-135M with its bundled draft on an H200
    # (the 4/4/16 tree's from its tokens/s and accept length)
    ms = [0.775, 1.143, 1.15, 1.205, 1.36, 1.785, 1.79, 1.52]
    # per-depth acceptance (chains follow the draft's top token; wider trees cover more)
    base = [0.0, 0.62, 0.62, 0.62, 0.74, 0.80, 0.83, 0.86]

    def accept_len(tier: int, step: int, rng: random.Random) -> int:
        p = base[tier] + (0.2 if (step // 30) % 2 == 0 else -0.2)  # easy, then hard text
        n = 1
        while tier and n <= tiers[tier].max_depth and rng.random() < p:
            n += 1
        return n

    def tokens_per_ms(seed: int, fixed: int | None = None, steps: int = 1000) -> float:
        """A fixed tier's, or (fixed None) the policy's, tokens per ms of step time."""
        policy = AdaptiveSpeculation(tiers, measure=lambda b, t: ms[t] / 1e3)
        rng, tokens, ms_spent = random.Random(seed), 0, 0.0
        for step in range(steps):
            t = policy.pick(1) if fixed is None else fixed
            n = accept_len(t, step, rng)
            # (as the engine reports: every speculating request, whatever the tier ran)
            policy.observe(t, 1 + plain_rows, [n], ms[t] / 1e3)
            tokens, ms_spent = tokens + n, ms_spent + ms[t]
        return tokens / ms_spent

    ratios = []
    for seed in range(8):
        best_fixed = max(tokens_per_ms(seed, t) for t in range(len(tiers)))
        ratios.append(tokens_per_ms(seed) / best_fixed)
    assert sum(ratios) / len(ratios) >= 0.96, ratios


def test_policy_weighs_replayed_step_times_plus_what_real_contexts_add():
    """Tiers are timed on graph replays over padding rows, which attend to nothing: once a
    tier is served, what real contexts add to its replay is added to the others' too."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(5, 4, 16)]
    replay = {0: 7.6, 1: 24.3, 2: 94.4}  # ms at batch 256, as on an H200 at the 8B shape
    served = {0: 14.5, 1: 37.0, 2: 150.0}
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: replay[t] / 1e3)
    picks = []
    for _ in range(40):
        picks.append(p.pick(256))
        p.observe(picks[-1], 256, [3 if picks[-1] else 1] * 256, served[picks[-1]] / 1e3)
    # by the replays alone plain would win (3 / 24.3 < 1 / 7.6); with the 6.9 ms real
    # contexts add, the chain does (3 / 31.2 > 1 / 14.5), and served it keeps winning
    assert picks[-30:].count(1) >= 29, picks
    assert abs(p.seconds(2, 256) - (94.4 + 37.0 - 24.3) / 1e3) < 2e-3


def serve_host_bound(p, tiers_ms, accept, host_us_per_token, steps, batch=64, host_us=0.0):
    """Serve `steps` steps: each tier's device ms; the host's time per emitted token, and
    `host_us` more per step."""
    picks = []
    for _ in range(steps):
        t = p.pick(batch)
        picks.append(t)
        tokens = batch * accept[t]
        p.observe(t, batch, [accept[t]] * batch if t else [], tiers_ms[t] / 1e3)
        p.observe_host(t, batch, (host_us + host_us_per_token * tokens) * 1e-6, tokens)
    return picks


def test_where_the_host_sets_the_pace_the_tier_emitting_most_per_step_is_picked():
    """Under overlap a step lasts as long as the longer of the host's and the device's work,
    and the host's is work per emitted token. Where it is longer than every tier's device
    time (a large batch of a small model), every tier emits at the host's pace: the one
    emitting most per step pays the per-step costs least often. By device time alone the
    chain would be picked."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(6, 8, 64)]
    device_ms = (1.1, 1.4, 5.0)  # batch 64 on an H200, SmolLM2 and its bundled draft
    accept = (1, 2, 4)
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: device_ms[t] / 1e3)
    for t in (1, 2):
        p.observe(t, 64, [accept[t]] * 64, device_ms[t] / 1e3)
    picks = serve_host_bound(p, device_ms, accept, 0.0, 300)
    assert picks[-100:].count(1) > 90, picks  # no host time: the chain (2 / 1.4 > 4 / 5)
    picks = serve_host_bound(p, device_ms, accept, 20.0, 300)  # 1.28-5.1 ms a step
    assert picks[-100:].count(2) > 90, picks[-100:]
    assert p.describe()["host_us_per_step_and_token"][64] == [0.0, 20.0]


def test_a_tier_emitting_more_wins_a_near_score_but_not_a_clear_loss():
    """SmolLM2 at batch 128 on an H100: a chain of 3 and the 4/4/16 tree scored within 1% of
    one another, and the chain served most steps, while a batch served by the tree ran
    faster (its batches end in fewer steps). Where the host's time is close to the device's
    (1.7 ms a step against the chain's 1.86), within EMIT_MORE_MARGIN of the best score the
    tier emitting more a step serves; a tier scoring clearly more still wins, and so does
    one scoring a little more where the host's time is short of the device's."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(4, 4, 16)]
    accept = (1, 2.21, 3.17)
    # the chain ahead by 1.4%, then by 8.7%; then by 1.4% with the host's 1.2 ms
    for tree_ms, host_us, served in ((2.75, 1700, 2), (2.95, 1700, 1), (2.75, 1200, 1)):
        device_ms = (1.5, 1.86, tree_ms)
        p = AdaptiveSpeculation(tiers, measure=lambda b, t, ms=device_ms: ms[t] / 1e3)
        picks = serve_host_bound(p, device_ms, accept, 0.0, 300, batch=128, host_us=host_us)
        assert picks[-100:].count(served) > 90, (tree_ms, host_us, picks[-100:])


def test_near_scores_do_not_chain_below_the_margin():
    """The tier emitting the most among those within EMIT_MORE_MARGIN of the best score, not
    a tier near a near one: chains of 1, 2 and 3 scoring 100, 97 and 94 (and emitting 2,
    2.5 and 3 a request) serve the chain of 2."""
    tiers = [PLAIN, TreeShape(1, 1, 2), TreeShape(2, 1, 3), TreeShape(3, 1, 4)]
    accept = (1, 2.0, 2.5, 3.0)
    device_ms = (5.0, 2.0 / 100, 2.5 / 97, 3.0 / 94)  # (ms per step for one request)
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: device_ms[t] / 1e3)
    # (the host's 18 us a step: close to the leading chain's 20 us of device time)
    picks = serve_host_bound(p, device_ms, accept, 0.0, 300, batch=1, host_us=18.0)
    assert picks[-100:].count(2) > 90, picks[-100:]


def test_a_host_cost_per_step_is_told_apart_from_one_per_token():
    """At small batches most of the host's time is a cost per step (SmolLM2 on an H200 at
    batch 16: 1.65 ms a step after steps of the 4/4/16 tree and the 6/8/64 tree alike, which
    emits more). Taken as a cost per token, the steps of the tree that emits most made the
    host look fast enough for a chain's steps, and the chain's steps made it look too slow
    for the tree: the policy flipped between them. A line through both tiers' host times
    tells the two costs apart, and the tree, the faster at the host's pace, stays."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(6, 8, 64)]
    device_ms = (0.8, 0.9, 1.7)
    accept = (1, 2.5, 4)
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: device_ms[t] / 1e3)
    # 1.5 ms a step, 1 us a token
    picks = serve_host_bound(p, device_ms, accept, 1.0, 400, batch=16, host_us=1500.0)
    per_step_us, per_token_us = p.describe()["host_us_per_step_and_token"][16]
    assert abs(per_step_us - 1500) < 1 and abs(per_token_us - 1) < 0.01
    # the tree: 64 tokens in 1.7 ms; the chain 40 in 1.54 (as a cost per token, measured
    # after the tree's steps: 40 in 0.98, 8% ahead of the tree)
    assert picks[-200:].count(2) >= 0.95 * 200, picks[-200:]


def test_a_wide_tier_whose_steps_emit_more_is_not_free_because_the_host_is_busy():
    """The host's time per step grows with what the step emits. Weighed as one time per
    step, the steps of a wide tier made the host look slower than a narrower tier's device
    time, so the wide tier's device time looked hidden and it kept running, at its own
    device time. (SmolLM2 on an H200 at batch 128: 8.1 us per token after steps of a chain of
    3, 8.4 after the 4/4/16 tree's; the tails of batches ran the 6/8/64 tree at 64 requests,
    4.2 ms a step against 2.8 for the 4/4/16 tree.)"""
    tiers = [PLAIN, TreeShape(4, 4, 16), TreeShape(6, 8, 64)]
    device_ms = (1.2, 2.3, 5.0)
    accept = (1, 3, 4)
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: device_ms[t] / 1e3)
    for _ in range(20):  # the wide tier served first: 4.1 ms of host time per step
        p.observe(2, 64, [accept[2]] * 64, device_ms[2] / 1e3)
        p.observe_host(2, 64, 16e-6 * 64 * accept[2], 64 * accept[2])
    picks = serve_host_bound(p, device_ms, accept, 16.0, 200)
    # the 4/4/16 tree: 3.1 ms of host time a step, 62k tokens/s; the wide one 5.0 ms, 51k
    # (one host time of 4.1 ms a step for both: 47k against 51k)
    assert picks[-100:].count(1) > 90, picks[-100:]


def host_us(p: AdaptiveSpeculation, bucket: int) -> list[float]:
    """The host's (us per step, us per token) the policy weighs tiers by at `bucket` now."""
    return [round(v * 1e6, 3) for v in p.host.cost_at(bucket)]


def test_a_tiers_old_host_time_does_not_tilt_the_line_through_fresh_ones():
    """The host's speed moves with the machine's load. A tier not run for HOST_POINT_AGE steps
    at a bucket no longer weighs in the host's cost (beside a fresh point, its old one tilted
    the line), and when it runs again it starts afresh."""
    from specserve.speculative.host_cost import HOST_POINT_AGE

    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(6, 8, 64)]
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: 1e-3)
    for _ in range(15):  # 1.5 ms a step, whatever the step emits
        p.observe_host(1, 16, 1.5e-3, 32)
        p.observe_host(2, 16, 1.5e-3, 64)
    assert host_us(p, 16) == [1500.0, 0.0]
    for _ in range(HOST_POINT_AGE + 1):  # then only the chain, the host twice as fast
        p.observe_host(1, 16, 0.75e-3, 32)
    # one fresh tier alone cannot tell the two costs apart: per token, as measured now
    assert host_us(p, 16) == [0.0, 23.438]
    for _ in range(3):  # the tree again, the host as fast: its new steps alone count
        p.observe_host(2, 16, 0.75e-3, 64)
    assert host_us(p, 16) == [750.0, 0.0]


def test_a_replay_timed_too_slow_is_corrected_by_the_first_step_served_at_that_tier():
    """A tier's replay at start-up can overstate its served time (seen: 8.9 ms for the
    served tree at batch 128, 6.7 ms served). Its first served step is a replay of an
    already compiled graph, so it counts: one exploration is enough to correct it."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(6, 8, 64)]
    replay_ms = (1.2, 1.6, 8.9)  # the tree's replay overstated
    served_ms = (1.2, 1.6, 6.0)
    accept = (1, 2, 4)
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: replay_ms[t] / 1e3)
    picks = []
    for _ in range(100):
        t = p.pick(128)
        picks.append(t)
        p.observe(t, 128, [accept[t]] * 128 if t else [], served_ms[t] / 1e3)
        # host-bound (7 ms a step of the tree): the tree, which emits most, pays most
        p.observe_host(t, 128, 14e-6 * 128 * accept[t], 128 * accept[t])
    assert picks[0] == 1  # by its replay the tree looked dearer than it is
    first_tree = picks.index(2)
    assert picks[first_tree:].count(2) >= 0.95 * len(picks[first_tree:]), picks


def test_the_hosts_time_is_the_loads_not_one_tiers():
    """The host's time per emitted token hardly depends on the tier; one slow interval (a
    collection, a burst of arrivals) during the only step a tier ran must not keep that tier
    out while every other step says the host takes 27 us a token."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(6, 8, 64)]
    device_ms = (1.2, 1.6, 6.0)
    accept = (1, 2, 4)
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: device_ms[t] / 1e3)
    for t, host_us in ((2, 60.0), *[(1, 27.0)] * 40):  # (27 us a token: 7 ms a chain step)
        p.observe(t, 128, [accept[t]] * 128, device_ms[t] / 1e3)
        p.observe_host(t, 128, host_us * 1e-6 * 128 * accept[t], 128 * accept[t])
    assert p.pick(128) == 2  # at the host's pace, 4 tokens a step beat 2


def test_a_spike_of_host_time_does_not_make_a_wider_tier_look_free():
    """Host time per step spikes (a collection, a burst of requests finishing). While a spike
    was in a moving average, a wider tier whose device time hid under the inflated host time
    looked free; its steps then ran at its own device time, the host back to normal. (SmolLM2
    on an H200 at batch 128: the 6/8/64 tree's 16-node budget ran a fifth of the steps, 5.0 ms
    each, against 4.1 ms for the 4/4/16 tree, which emits about as much.)"""
    tiers = [PLAIN, TreeShape(4, 4, 16), TreeShape(6, 8, 64)]
    device_ms = (1.2, 3.1, 5.0)
    accept = (1, 3.2, 3.5)
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: device_ms[t] / 1e3)
    picks, wall_ms = [], []

    def host_ms(step, t):  # 9.5 us a token (3.9 ms a step of the 4/4/16 tree), spiking 4x
        return (38.0 if step % 8 == 7 else 9.5) * 1e-3 * 128 * accept[t]

    for step in range(600):
        t = p.pick(128)
        picks.append(t)
        wall_ms.append(max(device_ms[t], host_ms(step, t)))
        p.observe(t, 128, [accept[t]] * 128 if t else [], device_ms[t] / 1e3)
        p.observe_host(t, 128, host_ms(step, t) / 1e3, 128 * accept[t])
    assert p.describe()["host_us_per_step_and_token"][128] == [
        0.0,
        9.5,
    ]  # what tiers were weighed by
    late = picks[100:]
    assert late.count(2) <= 0.03 * len(late), late
    tokens = sum(accept[t] for t in late)
    fixed = accept[1] * len(late) / sum(max(device_ms[1], host_ms(s, 1)) for s in range(100, 600))
    assert tokens / sum(wall_ms[100:]) >= 0.97 * fixed


def record_graph_keys(graphs: DecodeGraphs):
    """Wrap `graphs` to record each step's key and each capture's (key, idle)."""
    ran, captured = [], []
    run, capture = graphs.run, graphs._capture

    def recording_run(rows, sampling, width, tier=0, catch_up=False):
        shape = graphs.bucket(len(rows), width)
        ran.append(graphs._key(shape, sampling, tier, catch_up))
        return run(rows, sampling, width, tier, catch_up)

    def recording_capture(*key, idle=False):
        captured.append((key, idle))
        return capture(*key, idle=idle)

    graphs.run, graphs._capture = recording_run, recording_capture
    return ran, captured


def test_a_graph_is_captured_only_for_a_tier_a_step_runs_at_its_shape():
    """Each capture stalls the loop, and a growing batch meets a new context width every few
    steps: a shape is captured for the tier its step runs, not for every tier the policy
    might run there (exploration waits for tiers captured at the shape)."""
    spec = spec_args("tiny", 3, 4, 10, speculative_adaptive=True)
    with Engine(**TINY, **spec) as e:
        graphs = DecodeGraphs(e.core.worker, 4, max_width=4096, capture=False)
        e.core.worker.graphs = graphs
        ran, captured = record_graph_keys(graphs)
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
        e.generate(input_ids=prompts, sampling_params=dict(SP, max_new_tokens=40))
        assert len({key[-2] for key in ran}) > 1  # the policy did switch tiers
        # and no step waited for a graph it did not run (the idle engine may capture more)
        assert {key for key, idle in captured if not idle} <= set(ran)


def test_an_idle_engine_captures_the_tiers_run_at_a_batch_size_at_its_other_widths():
    """A batch's tail passes its batch buckets at the widest widths of its run, and the next
    wave of requests runs other tiers there: once idle, the engine captures each tier that ran
    at a batch bucket at every width met there, so the next wave replays them. It captures
    nothing else: not tiers that never ran at the bucket."""
    spec = spec_args("tiny", 3, 4, 10, speculative_adaptive=True)
    with Engine(**TINY, **spec) as e:
        graphs = DecodeGraphs(e.core.worker, 4, max_width=4096, capture=False)
        e.core.worker.graphs = graphs
        ran, captured = record_graph_keys(graphs)
        # the chains of 1 to 3 while contexts are short, then the chain of 1 alone
        picks = iter([1, 2, 3] * 8)
        e.core.adaptive.pick = lambda b, can=True, ready=None: next(picks, 1)
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
        e.generate(input_ids=prompts, sampling_params=dict(SP, max_new_tokens=300))
        wait_for_idle_captures(graphs)
        assert not e.stats()["num_graph_captures_wanted"]
        met = {}  # (batch bucket, sampling mode) -> (widths, (tier, catch-up) variants)
        for bs, width, *rest in ran:
            widths, variants = met.setdefault((bs, tuple(rest[:-2])), (set(), set()))
            widths.add(width)
            variants.add(tuple(rest[-2:]))
        assert met[(4, (True, False, False, 0, False, False))] == (
            {256, 512},
            {(1, False), (2, False), (3, False)},
        )
        alike = {(bs, w, *mode, *v) for (bs, mode), (ws, vs) in met.items() for w in ws for v in vs}
        assert set(graphs.graphs) == alike
        # (captured while idle: the shapes not run, and those run eagerly, EAGER_STEPS)
        assert alike - set(ran) <= {key for key, idle in captured if idle} <= alike


def test_simulated_rejection_switches_speculation_off():
    prompts = mixed_prompts(4, 512, seed=2)
    spec = spec_args(
        "tiny", 3, 4, 10, speculative_adaptive=True, simulate_acc_len=1.0,
        simulate_acc_method="match-expected",
    )  # fmt: skip
    _, stats, _ = run(prompts, dict(SP, max_new_tokens=60), **spec)
    steps = stats["speculative_adaptive"]["steps"]
    assert steps[0] > sum(steps[1:]), stats["speculative_adaptive"]


def draft_kv_of(core, req, n: int):
    """The draft's K and V of a request's positions [0, n), every layer."""
    kv = core.worker.drafter.kv
    slots = core.table.slots(req.rid, 0, n)
    return [kv.k[layer][slots].clone() for layer in range(len(kv.k))] + [
        kv.v[layer][slots].clone() for layer in range(len(kv.v))
    ]


@pytest.mark.parametrize("page_size", [1, 3])
def test_skipped_drafts_catch_up_to_the_kv_of_drafting_every_step(tmp_path, page_size):
    """Plain steps skip the EAGLE draft and it catches up (forced when the ring fills, and
    before drafting tiers): its KV and root state then equal those of an engine whose draft
    ran at every step, and outputs equal plain decoding."""
    from specserve.model.config import PRESETS
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint

    eagle = write_random_eagle_checkpoint(str(tmp_path / "e"), PRESETS["tiny"], "EAGLE")
    prompts = mixed_prompts(3, 512, seed=7, min_len=5, max_len=30)
    params = dict(SP, max_new_tokens=30)
    script = [0] * 9 + [1] + [0] * 3 + [2] + [0] * 5  # the ring (4 tokens) fills in between

    def scripted(lag_tokens: int):
        """Driven step by step from this thread, so both engines admit the requests at the
        same step (through Engine's loop thread, arrival would race the first steps)."""
        from specserve.config import EngineConfig
        from specserve.runtime.engine_core import EngineCore
        from specserve.runtime.request import Request
        from specserve.sampling_params import SamplingParams

        states = []
        kw = dict(page_size=page_size, disable_overlap_schedule=True, max_total_tokens=4096)
        spec = spec_args(eagle, 2, 3, 6, speculative_adaptive=True)
        cfg = EngineConfig.from_kwargs(
            **TINY, **kw, **spec, speculative_adaptive_lag_tokens=lag_tokens
        )
        core = EngineCore(cfg.resolve())
        n = iter(range(10**6))
        core.adaptive.pick = lambda b, can=True, ready=None: script[next(n) % len(script)]
        reqs = [Request(str(i), p, SamplingParams(**params), seed=0) for i, p in enumerate(prompts)]
        for r in reqs:
            core.add_request(r)
        rows = core.worker.rows
        while core.has_work():
            core.step()
            core.check_invariants()
            for i, r in enumerate(core.scheduler.running):
                exact = r.kv_len - r.draft_behind
                root = None
                if r.draft_behind == 0:
                    root = rows.features[rows.row(r.rid)].clone()
                states.append((i, r.kv_len, exact, draft_kv_of(core, r, exact), root))
        return [r.output_ids for r in reqs], states, core.describe_adaptive()

    plain, _, _ = run(prompts, params, page_size=page_size)
    skipping, lagged, stats = scripted(4)
    every_step, reference, _ = scripted(0)
    assert skipping == every_step == plain
    assert stats["catch_ups"] > 0 and stats["stopped_speculating"] == 0, stats
    # step for step the same requests at the same KV lengths (equal drafts accept equally)
    compared = caught_up = 0
    for (i, kv_len, exact, kv, root), (i_r, kv_len_r, _, kv_r, root_r) in zip(lagged, reference):
        if (i, kv_len) != (i_r, kv_len_r):
            break
        compared += 1
        assert exact >= kv_len - 4  # never further behind than the ring holds
        for a, b in zip(kv, kv_r):
            torch.testing.assert_close(a, b[: a.shape[0]], atol=1e-4, rtol=1e-4)
        if root is not None:
            torch.testing.assert_close(root, root_r, atol=1e-4, rtol=1e-4)
            caught_up += exact == kv_len
    assert compared == len(reference), (compared, len(reference))
    assert caught_up > 0


def test_a_draft_left_behind_stops_speculating_and_outputs_stay_exact():
    """Where speculation does not pay, a request whose ring fills stops speculating: later
    drafting steps decode it plainly. The prefix cache keeps its answer's target KV, which a
    next turn decoding plainly (speculation still not paying) reuses, as it reuses a history
    whose draft was kept current."""
    prompts = mixed_prompts(3, 512, seed=8, min_len=5, max_len=30)
    params = dict(SP, max_new_tokens=24)
    plain, _, _ = run(prompts, params)
    spec = spec_args("tiny", 3, 4, 10, speculative_adaptive=True)
    script = [0] * 8 + [2, 1] * 20

    def serve(lag_tokens: int):
        with Engine(**TINY, **spec, speculative_adaptive_lag_tokens=lag_tokens) as e:
            n = iter(range(10**6))
            e.core.adaptive.pick = lambda b, can=True, ready=None: script[
                min(next(n), len(script) - 1)
            ]
            e.core.adaptive.speculation_pays = lambda b: False
            outs = e.generate(input_ids=prompts, sampling_params=params)
            history = prompts[0] + outs[0]["output_ids"]
            again = e.generate(input_ids=history, sampling_params=dict(params, max_new_tokens=4))
            assert again["output_ids"] == next_turn
            return outs, e.stats()["speculative_adaptive"], again["meta_info"]["cached_tokens"]

    history = prompts[0] + plain[0]
    next_turn = run([history], dict(params, max_new_tokens=4))[0][0]
    outs, adaptive, cached = serve(3)
    assert [o["output_ids"] for o in outs] == plain
    assert adaptive["stopped_speculating"] == len(prompts), adaptive
    # stopped requests report no accepted drafts though drafting tiers ran
    assert all(o["meta_info"]["spec_accept_length"] == 1.0 for o in outs)
    assert cached > len(prompts[0]) + 10
    outs, adaptive, cached = serve(0)  # the draft runs every step: nothing falls behind
    assert [o["output_ids"] for o in outs] == plain
    assert adaptive.get("stopped_speculating", 0) == 0
    assert cached > len(prompts[0]) + 10


@pytest.mark.parametrize("stale", [False, True])
def test_requests_not_speculating_outlag_the_ring_while_others_catch_up(stale):
    """A request that does not speculate (asked for plain decoding, or left behind) is never
    caught up: decoded alone over more plain steps than its ring holds, then joined by a
    request whose draft catches up in the same batch, both decode as plain decoding does."""
    from specserve.config import EngineConfig
    from specserve.runtime.engine_core import EngineCore
    from specserve.runtime.request import Request
    from specserve.sampling_params import SamplingParams

    def serve(**kw):
        core = EngineCore(EngineConfig.from_kwargs(**TINY, **kw).resolve())
        pays = [not stale]  # (while the first request decodes alone)
        if core.adaptive is not None:
            script = iter([0] * 6 + [0, 1] * 20)
            core.adaptive.pick = lambda b, can=True, ready=None: next(script)
            core.adaptive.speculation_pays = lambda b: pays[0]
        sp = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
        first = Request("a", [5, 6, 7], dataclasses.replace(sp, speculative=stale), seed=0)
        second = Request("b", [8, 9, 10], sp, seed=0)
        core.add_request(first)
        for _ in range(6):
            core.step()
        core.add_request(second)
        pays[0] = True
        while core.has_work():
            core.step()
        return first, second

    plain = serve(no_default_draft=True)
    spec = spec_args("tiny", 1, 2, 3, speculative_adaptive=True)
    got = serve(**spec, speculative_adaptive_lag_tokens=1, disable_overlap_schedule=True)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]
    assert all(r.finish_reason["type"] == "length" for r in got), [r.finish_reason for r in got]
    assert got[0].draft_stale == stale


def test_tiers_are_timed_at_start_so_serving_never_stops_to_time_a_new_batch_size():
    """Timing a tier captures its graph (compiling its kernels for that batch shape): done
    at engine start for every bucket the graphs cover, never in the middle of serving."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(5, 4, 16)]
    calls = []

    def measure(bucket, tier):
        if bucket > 64:
            return None  # past the largest graph
        calls.append((bucket, tier))
        return (1 + tier) * (1 + bucket / 64) / 1e3

    p = AdaptiveSpeculation(tiers, measure=measure)
    assert p.prime(48) == 3 * 7  # buckets 1, 2, 4, 8, 16, 32, and 64 (which holds 48)
    assert sorted(calls) == sorted((b, t) for b in (1, 2, 4, 8, 16, 32, 64) for t in range(3))
    calls.clear()
    for bs in (1, 3, 7, 12, 30, 48, 2, 64):
        p.observe(p.pick(bs), bs, [2] * bs, 1e-3)
    assert calls == []
    assert AdaptiveSpeculation(tiers, measure=measure).prime(256) == 3 * 7  # 128+: online


def test_exploration_runs_only_tiers_whose_graph_is_captured_at_the_steps_shape():
    """Exploring a tier whose graph at this shape was never captured would stall every
    request on the capture: exploration waits for a shape where it is captured."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(6, 8, 64)]
    device_ms = (1.1, 1.4, 5.0)  # batch 64 on an H200, SmolLM2 and its bundled draft
    accept = (1, 2, 3)  # the chain, accepting all 4 it drafts, would beat the tree

    def serve(p, steps, ready):
        picks = []
        for _ in range(steps):
            t = p.pick(64, ready=ready)
            picks.append(t)
            p.observe(t, 64, [round(accept[t])] * 64 if t else [], device_ms[t] / 1e3)
            # host-bound (5.2 ms a step of the tree): the tree is best, the chain hopeful
            p.observe_host(t, 64, 27e-6 * 64 * accept[t], 64 * accept[t])
        return picks

    anywhere = AdaptiveSpeculation(tiers, measure=lambda b, t: device_ms[t] / 1e3)
    serve(anywhere, 200, None)
    assert 1 in serve(anywhere, 600, None)  # explored now and then
    captured = AdaptiveSpeculation(tiers, measure=lambda b, t: device_ms[t] / 1e3)
    serve(captured, 200, None)
    assert set(serve(captured, 600, frozenset({0, 2}))) == {2}


def test_a_captured_tier_within_the_margin_runs_instead_of_capturing_the_best():
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(3, 2, 6)]  # both start at accept length 4

    def policy(chain_ms):
        ms = (1.0, chain_ms, 1.0)
        return AdaptiveSpeculation(tiers, measure=lambda b, t: ms[t] / 1e3)

    # (a capture stalls for 10-50 steps' time; before a shape is long-lived, a tier 15%
    # better wins back fewer steps than that there)
    assert policy(1.15).pick(1, ready=frozenset({0, 1})) == 1  # 15% slower: no capture
    assert policy(1.5).pick(1, ready=frozenset({0, 1})) == 2  # 50%: worth its capture
    assert policy(1.15).pick(1, ready=frozenset()) == 2  # a new shape: the best is captured
    assert policy(1.15).pick(1, ready=None) == 2  # a long-lived shape: the best is captured


def test_the_policy_asks_whether_its_best_tier_is_replayable_not_every_tier():
    """Where the best tier has its graph, a step looks up no other tier's (at a batch of 128
    of a small model every lookup is host time the step waits for); where it has none, the
    captured tiers are weighed as before."""
    from specserve.runtime.cuda_graphs import ReadyTiers

    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(3, 2, 6)]
    ms = (1.0, 1.15, 1.0)
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: ms[t] / 1e3)
    asked: list[int] = []
    assert p.pick(1, ready=ReadyTiers(lambda t: asked.append(t) or True, 3)) == 2
    assert asked == [2]
    asked.clear()  # the best has no graph: the others are looked up, the chain runs
    assert p.pick(1, ready=ReadyTiers(lambda t: asked.append(t) or t < 2, 3)) == 1
    assert sorted(asked) == [0, 1, 2]


def test_batch_after_batch_the_policy_stops_capturing_graphs():
    """A benchmark's runs (or a server's waves of requests): each run a batch of 64 new
    requests whose contexts grow through width buckets while the batch drains. Every graph
    a step meets first is captured, stalling all requests for 10-50 steps' time. Once the
    shapes have been met, later runs must capture rarely: at a 3% margin (and with new text
    free to capture) the policy kept capturing one to two graphs per run to the end."""
    from specserve.runtime.cuda_graphs import LONG_LIVED_SHAPE_STEPS

    tiers = speculation_tiers(TreeShape(6, 8, 64))
    # SmolLM2-like step ms by tier: wide tiers grow with the batch, chains hardly
    slope = [600, 400, 300, 250, 60, 30, 30, 12]

    def seconds(b, t):
        return [0.8, 1.2, 1.25, 1.3, 1.4, 2.0, 2.1, 1.5][t] * (1 + b / slope[t]) / 1e3

    p_accept = [0.0, 0.62, 0.62, 0.62, 0.74, 0.80, 0.83, 0.86]
    late_captures = 0
    for seed in range(4):
        rng = random.Random(seed)
        p = AdaptiveSpeculation(tiers, measure=seconds)
        p.prime(256)
        graphs = {(b, 64, t) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for t in range(8)}
        last, streak = None, 0
        for run in range(6):
            made, kv = [0] * 64, [48] * 64
            p.arrived(64)
            while any(m < 128 for m in made):
                live = [i for i in range(64) if made[i] < 128]
                width = 64
                while width < max(kv[i] for i in live) + 64:
                    width *= 2
                shape = (batch_bucket(len(live)), width)
                last, streak = shape, (streak + 1 if shape == last else 1)
                captured = frozenset(t for t in range(8) if (*shape, t) in graphs)
                t = p.pick(len(live), ready=None if streak >= LONG_LIVED_SHAPE_STEPS else captured)
                if (*shape, t) not in graphs:
                    graphs.add((*shape, t))
                    late_captures += run >= 3
                lens = []
                for i in live:
                    n = 1
                    q = p_accept[t] + rng.uniform(-0.2, 0.2)
                    while t and n <= tiers[t].max_depth and rng.random() < q:
                        n += 1
                    n = min(n, 128 - made[i])
                    made[i], kv[i] = made[i] + n, kv[i] + n
                    lens.append(n)
                p.observe(t, len(live), lens, seconds(len(live), t))
    assert late_captures <= 0.8 * 4 * 3, late_captures  # per run, on average (1.3 at 3%)


def test_the_engine_asks_which_tiers_are_captured_and_stays_lossless():
    prompts = mixed_prompts(4, 512, seed=11)
    params = dict(SP, max_new_tokens=30)
    plain, _, _ = run(prompts, params)
    spec = spec_args("tiny", 3, 4, 10, speculative_adaptive=True)
    seen = []
    with Engine(**TINY, **spec) as e:
        core = e.core
        captured = frozenset({0, 2, len(core.adaptive.tiers) - 1})
        core.worker.ready_tiers = lambda reqs, kv_upper, tiers, catch_up: captured
        real_pick = core.adaptive.pick

        def pick(b, can=True, ready=None):
            seen.append(ready)
            return real_pick(b, can, ready=ready)

        core.adaptive.pick = pick
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    assert outs == plain
    assert seen and all(r == captured for r in seen)


def test_a_ragged_tier_costing_as_much_as_its_whole_tree_is_never_run():
    """A ragged budget verifies a subset of its tree's nodes, so it never emits more than the
    whole tree. Where it also costs at least as much (batch 1 on a small model: the budget's
    selection outweighs the nodes it saves), it must not run, even when its own estimate,
    learnt on easier text, says it accepts more."""
    tiers = speculation_tiers(TreeShape(6, 8, 64))
    assert TreeShape(6, 8, 64) in tiers
    ragged = [t for t, s in enumerate(tiers) if s.ragged]
    assert ragged
    ms = {t: 1.5 for t in range(len(tiers))}
    ms.update({t: 1.8 for t in ragged})  # SmolLM2 at batch 1 on an H200: 1.78 against 1.51
    ms[0] = 0.8
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: ms[t] / 1e3)
    for t in ragged:  # stale estimates from an easy stretch
        p.observe(t, 1, [7] * 20, ms[t] / 1e3)
    picks = []
    for _ in range(300):
        picks.append(p.pick(1))
        p.observe(picks[-1], 1, [4], ms[picks[-1]] / 1e3)
    assert not set(picks) & set(ragged), picks
    # where the budget does save time, it runs on its merits
    ms.update({t: 1.0 for t in ragged})
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: ms[t] / 1e3)
    assert p.pick(1) in ragged or any(p.pick(1) in ragged for _ in range(64))


def steps_of_forced_tier(tier_name: str, prompts: list[list[int]], tokens: int) -> list[dict]:
    """SmolLM2 with its bundled draft, every step of each greedy request (one at a time) forced
    to the tier named `tier_name`: per prompt, {position the step started at: (accept length,
    chain reach)}."""
    steps: list[dict] = []
    position = [0]
    tree = {"speculative_num_steps": 4, "speculative_eagle_topk": 4}
    with Engine(model_path="smollm2-135m", dtype="float32", speculative_adaptive=True,
                speculative_num_draft_tokens=16, **tree) as e:  # fmt: skip
        policy = e.core.adaptive
        tier = [str(t) for t in policy.tiers].index(tier_name)
        policy.pick = lambda b, can=True, ready=None: tier
        observe = policy.observe

        def recording(t, b, accept_lens, seconds, chain_reach=None):
            (n,) = accept_lens
            steps[-1][position[0]] = (n, chain_reach[0])
            position[0] += n
            return observe(t, b, accept_lens, seconds, chain_reach)

        policy.observe = recording
        sp = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
        for prompt in prompts:
            steps.append({})
            position[0] = len(prompt)
            e.generate(input_ids=prompt, sampling_params=sp)
    return steps


@pytest.mark.slow
def test_a_trees_chain_reach_is_what_the_chain_accepts_from_the_same_position():
    """Wherever a step of the 4/4/16 tree and a step of the chain of 3 start at the same
    position of the same greedy text, the tree's reported chain reach says exactly what the
    chain accepted there (the bundled draft on real prompts: reaches of every length)."""
    from specserve.bench.one_batch import chat_prompt_ids
    from specserve.model.registry import resolve_packaged
    from specserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_packaged("smollm2-135m"), "gguf")
    prompts = chat_prompt_ids(tokenizer, 2)
    matched, reaches = 0, set()
    trees = steps_of_forced_tier("4/4/16", prompts, 32)
    chains = steps_of_forced_tier("3/1/4", prompts, 32)
    for tree, chain in zip(trees, chains, strict=True):
        for position, (accepted, _) in chain.items():
            if position in tree:
                reach = tree[position][1]
                assert accepted == 1 + min(3, reach), (position, accepted, reach)
                matched += 1
                reaches.add(min(3, reach))
        assert all(0 <= r <= min(4, n - 1) for n, r in tree.values())
    assert matched >= 8 and len(reaches) >= 3, (matched, reaches)


def test_a_tier_underrated_on_earlier_text_is_explored_until_it_wins():
    """New requests on which the small tree does better than on the text its acceptance was
    learnt from: each exploration raises its estimate, and the explorations keep their pace
    until it serves, instead of coming twice as late each time while the wide tree goes on
    serving (SmolLM2 at batch 16 after batch 1 on an H200: 8% slower)."""
    tiers = [PLAIN, TreeShape(4, 4, 16), TreeShape(6, 8, 64)]
    seconds = [1.0, 1.5, 2.0]
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: seconds[t], explore_every=32)
    accept = {1: 2.4, 2: 3.6}

    def serve(steps: int) -> list[int]:
        picks = []
        for _ in range(steps):
            t = p.pick(16)
            picks.append(t)
            p.observe(t, 16, [accept.get(t, 1.0)] * 16, seconds[t])
        return picks

    assert serve(2000)[-100:].count(2) >= 99  # earlier text: the wide tree pays most
    accept[1] = 2.85  # new text: 16 * 2.85 / 1.5 beats 16 * 3.6 / 2.0 by 5.6% (past the margin)
    p.arrived(16)
    picks = serve(128)
    explored = [i for i, t in enumerate(picks) if t == 1][:3]
    # explorations at most 32 steps apart, each raising the estimate, until one finds it
    # best (doubling the wait after the second would have put the third at 127)
    assert explored[1] - explored[0] <= 32 and explored[2] - explored[1] <= 32, explored
    assert picks[96:].count(1) >= 31, picks


def test_a_batchs_sampling_is_rebuilt_when_a_request_stops_speculating():
    """A batch's sampling mode is reused while the same requests run, and rebuilt when one of
    them turns plain (its stale draft is no longer verified) or the batch's membership or
    order changes; each request's row holds its sampling parameters and whether it decodes
    plainly, which the step gathers by row."""
    from specserve.config.engine_config import EngineConfig
    from specserve.ops.sampling import SamplingTensors
    from specserve.runtime.engine_core import EngineCore
    from specserve.runtime.request import Request
    from specserve.sampling_params import SamplingParams

    core = EngineCore(EngineConfig.from_kwargs(**TINY).resolve())
    worker, rows = core.worker, core.rows
    sampling_for = worker._sampling_for

    def gathered(reqs):
        mode = sampling_for(reqs)
        idx = torch.tensor(rows.rows_of([r.rid for r in reqs]))
        return SamplingTensors.gather(rows.sampling_floats, rows.sampling_ints, idx, mode)

    sp = SamplingParams(temperature=0.0)
    a, b, c = (Request(name, [1, 2], sp, seed=0) for name in "abc")
    for r in (a, b, c):
        core.table.reserve(r.rid, 4)
    first = sampling_for([a, b, c])
    assert sampling_for([a, b, c]) is first  # the same batch: reused
    b.draft_stale = True
    turned = sampling_for([a, b, c])
    assert turned is not first and turned.any_plain and not first.any_plain
    assert gathered([a, b, c]).plain_rows.tolist() == [False, True, False]
    assert sampling_for([a, b, c]) is turned
    assert gathered([a, c, b]).plain_rows.tolist() == [False, False, True]  # order
    assert not sampling_for([a, c]).any_plain  # membership
    # a request reaped is forgotten (the cache held it); its rid's next request, in the
    # row it freed, samples by its own parameters
    sampling_for([a, b, c])
    core.table.release("b")
    worker.forget("b")
    assert worker._sampling_cache is None
    twin = Request("b", [1, 2], SamplingParams(temperature=0.7), seed=0)
    core.table.reserve("b", 4)
    st = gathered([a, twin, c])
    assert st.temperatures.tolist()[1] == pytest.approx(0.7) and not st.all_greedy
    assert st.plain_rows.tolist() == [False, False, False]


def test_explorations_cost_at_most_the_budget_where_a_tier_costs_several_plain_steps():
    """At a large batch of a large model, a tree's step costs several plain steps: with every
    draft rejected, exploring it at the starting pace after each batch's arrival cost 5% of
    the 8B shape's plain throughput at batch 128. Explorations now take at most
    EXPLORE_BUDGET of the time, however often new requests restart the pace."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(5, 4, 16)]
    seconds = [1.0, 1.6, 4.0]
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: seconds[t], explore_every=32)
    spent = {"plain": 0.0, "extra": 0.0}
    for step in range(20 * 256):
        if step % 64 == 0:
            p.arrived(128)  # a new batch: new text, the pace starts over
        t = p.pick(128)
        p.observe(t, 128, [1] * 128, seconds[t])
        if step >= 256:  # (after the first batch has learnt that drafts are rejected)
            spent["plain"] += seconds[0]
            spent["extra"] += seconds[t] - seconds[0]
    assert 0 < spent["extra"] / spent["plain"] <= 1.2 * EXPLORE_BUDGET, spent


def test_the_tier_likeliest_to_win_is_explored_first_not_the_one_seen_longest_ago():
    """SmolLM2 at batch 64 on an H100 (traced): a batch's first steps accept about a quarter
    less than later ones, and the 4/4/16 tree, learnt on two of them, scored below a chain
    that kept running (and so caught up with the later text). Explored by age, it waited
    behind three wide ragged tiers scoring less than it, for 165 steps served 10% slower.
    Now the highest scoring candidate is explored first."""
    tiers = speculation_tiers(TreeShape(6, 8, 64))
    assert tiers[3:5] == [TreeShape(3, 1, 4), TreeShape(4, 4, 16)], tiers
    device_ms = [1.13, 1.22, 1.33, 1.42, 2.14, 3.51, 4.39, 5.30]  # at bucket 64, as traced
    steady = [1.0, 1.6, 1.92, 2.15, 3.1, 2.95, 3.4, 3.83]  # accept lengths after a batch starts
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: device_ms[t] / 1e3, explore_every=32)

    def step(t: int, accept: float) -> None:
        # (a chain's accepted tokens lie on its greedy chain, which teaches the shorter ones)
        reach = [max(0, round(accept) - 1)] * 64 if t in (1, 2, 3) else None
        p.observe(t, 64, [accept] * 64, device_ms[t] / 1e3, reach)
        # the host's time as traced: 1.5 ms a step and 1.5 us a token (so the tree's steps,
        # which emit most, pay the per-step cost least often)
        p.observe_host(t, 64, 1.5e-3 + 1.5e-6 * 64 * accept, round(64 * accept))

    # what was served before (each step after a pick, which counts the steps): the wide
    # tiers, then the tree on a batch's first steps, then the chain
    for t, accept in [(5, 2.95), (6, 3.4), (7, 3.83)] * 3 + [(4, 0.72 * 3.1)] * 3 + [(3, 2.15)] * 3:
        p.pick(64)
        step(t, accept)
    picks = []
    for _ in range(240):
        t = p.pick(64)
        picks.append(t)
        step(t, steady[t])
    assert picks[:8] == [3] * 8  # (the chain serves while the tree looks worse)
    assert picks[-150:].count(4) >= 140, picks


def test_tiers_bound_by_the_host_tie_and_the_one_emitting_most_a_step_wins_whatever_rounding():
    """Where the host sets the pace, every tier scores 1 / (host seconds per token), each
    computed through its own token count; compared exactly, rounding broke the tie (traced on
    an H100: SmolLM2 at batch 64 alternated between chains of 2 and 3, and a tree bound by
    the host like them was never explored, its upper score a rounding below theirs)."""
    tiers = [PLAIN, TreeShape(1, 1, 2), TreeShape(2, 1, 3), TreeShape(3, 1, 4)]
    accept = [1.0, 1.63, 1.97, 2.15]  # (values whose token counts round differently)
    for per_token_us in (12.37, 13.59, 16.65, 9.61):
        p = AdaptiveSpeculation(tiers, measure=lambda b, t: 1e-4, explore_every=10**6)
        for t in range(4):  # every tier timed and observed: all far below the host's time
            p.observe(t, 64, [accept[t]] * 64 if t else [], 1e-4)
        p.observe_host(3, 64, per_token_us * 1e-6 * 64 * accept[3], round(64 * accept[3]))
        assert {p.pick(64) for _ in range(20)} == {3}, per_token_us


def rejected_at_128_then_accepted_at_1(steps_at_128: int, steps_at_1: int):
    """The picks of a policy over plain and a 5/4/16 tree whose step costs four plain ones at
    batch 128 (every draft rejected there) and 1.2 at batch 1 (one request, 5 tokens a step
    accepted): (the picks at 128, the picks at 1)."""
    tiers = [PLAIN, TreeShape(5, 4, 16)]
    seconds = {1: [0.010, 0.012], 128: [1.0, 4.0]}
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: seconds[b][t], explore_every=8)
    picks = {128: [], 1: []}
    for batch, steps, accepted in ((128, steps_at_128, 1), (1, steps_at_1, 5)):
        for _ in range(steps):
            t = p.pick(batch)
            picks[batch].append(t)
            p.observe(t, batch, [accepted] * batch if t else [], seconds[batch][t])
    return picks[128], picks[1]


def test_a_dear_exploration_at_a_large_batch_does_not_delay_cheap_ones_at_a_small_batch():
    """The budget weighs the exploration due against the time served since the last one: a
    wait set by a dear exploration at batch 128 does not carry over to batch 1, where a tree's
    step costs little more than a plain one: it is explored at the exploring pace."""
    _, picks = rejected_at_128_then_accepted_at_1(300, 60)
    assert 1 in picks[: 2 * 8], picks


def test_an_exploration_waiting_on_the_budget_at_a_large_batch_is_weighed_afresh_at_a_small_one():
    """An exploration due at batch 128 that waits for the budget (its step costs several
    plain ones) is weighed again when the batch shrinks: at batch 1 it costs little."""
    first, picks = rejected_at_128_then_accepted_at_1(40, 20)
    assert first.count(1) <= 2, first  # (the optimistic start's try, at most one exploration)
    assert 1 in picks[:10], picks


def test_after_a_long_stretch_of_rejected_drafts_at_a_large_batch_one_requests_drafts_count():
    """A step of 128 requests measures its mean precisely, but only for its own text: its
    weight is capped at what a stream of single requests builds up, so when one request's
    drafts are accepted at batch 1 the tree is back within a few explorations (its estimate
    weighed 136 requests, and moved 3% per exploration, before)."""
    _, picks = rejected_at_128_then_accepted_at_1(300, 80)
    assert picks[-30:].count(1) >= 28, picks


def test_where_a_stand_in_tier_serves_the_others_are_explored_not_it():
    """Where the best tier has no graph at the step's shape, a replayable one close to it
    serves; exploring runs another tier, not the one serving (which would teach nothing)."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(4, 4, 16), TreeShape(6, 8, 64)]
    ms = [1.0, 1.2, 1.3, 1.5]
    accept = [1, 3.0, 2.5, 4.0]
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: ms[t] / 1e3, explore_every=32)
    for _ in range(50):  # every tier learnt
        t = p.pick(8)
        p.observe(t, 8, [accept[t]] * 8 if t else [], ms[t] / 1e3)
    explored = []
    for _ in range(3000):  # the 6/8/64 tree, the best, not replayable at this width
        t = p.pick(8, ready={0, 1, 2})
        if p._explored is not None:
            explored.append(t)
        p.observe(t, 8, [accept[t]] * 8 if t else [], ms[t] / 1e3)
    assert explored and set(explored) == {2}, explored  # (the chain of 3 serves)


def test_a_budget_wait_ends_while_a_dominated_ragged_tier_serves():
    """A ragged tier slower than its whole tree scores 0, yet serves where that tree has no
    graph at the step's shape: its steps still count as served time, so an exploration
    waiting on the budget runs in time (it waited for ever)."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(6, 8, 64), TreeShape(6, 8, 64, 16)]
    ms = [1.0, 1.2, 1.5, 1.8]  # the ragged tier dominated by its whole tree
    accept = [1, 1, 4, 4]  # the chain's drafts rejected
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: ms[t] / 1e3, explore_every=32)
    ready, picks = None, []
    for _ in range(6000):
        t = p.pick(8, ready=ready)
        picks.append(t)
        p.observe(t, 8, [accept[t]] * 8 if t else [], ms[t] / 1e3)
        if ready is None and len(picks) > 100 and p._budget_needed[0] > 0:
            ready, start = {0, 1, 3}, len(picks)  # the whole tree not replayable now
    assert ready is not None
    assert picks[start:].count(1) >= 5, picks[start:].count(1)  # (explored, ever more rarely)


def test_a_tier_not_run_for_the_longest_gap_is_explored_though_others_score_higher():
    """Exploring runs the highest scoring candidate, but one not run for max_explore_gap picks
    first: its estimate may be long stale, and it would never come up otherwise."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(4, 4, 16), TreeShape(6, 8, 64)]
    ms = [1.0, 1.2, 1.4, 2.0]
    accept = [1, 3.0, 3.2, 3.4]  # the chain is best, the small tree close, the wide one far
    p = AdaptiveSpeculation(
        tiers, measure=lambda b, t: ms[t] / 1e3, explore_every=8, max_explore_gap=64
    )
    picks = []
    for _ in range(600):
        t = p.pick(8)
        picks.append(t)
        p.observe(t, 8, [accept[t]] * 8 if t else [], ms[t] / 1e3)
    assert picks[100:].count(3) >= 2, picks  # (the wide tree, now and then)
    assert picks[100:].count(2) >= 2, picks  # (and the small tree)


def test_a_best_tier_demoted_by_one_unlucky_step_is_looked_at_again_within_a_few_picks():
    """A tier not served is not observed: one step of 16 requests that accepted little drops
    the best tier's estimate below a wider tree's, and it stays that low until an
    exploration runs it again. (SmolLM2 at batch 16 on an H100: the 4/4/16 tree's estimate went
    from 2.39 to 2.18 against 2.95 served, and the 6/8/64 tree and a chain, 13-17% slower,
    served the next 45 steps.) The change of best tier brings that exploration within a few
    picks, and the demoted tier serves again."""
    tiers = [PLAIN, TreeShape(4, 4, 16), TreeShape(6, 8, 64)]
    seconds = [1.07e-3, 1.55e-3, 2.18e-3]
    accept = [1.0, 2.95, 3.7]  # (16 x 2.95 / 1.55 beats 16 x 3.7 / 2.18 by 12%)
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: seconds[t])
    for _ in range(300):
        t = p.pick(16)
        p.observe(t, 16, [accept[t]] * 16 if t else [], seconds[t])
    assert p.pick(16) == 1
    p.observe(1, 16, [1.4] * 16, seconds[1])  # an unlucky step
    picks = []
    for _ in range(40):
        t = p.pick(16)
        picks.append(t)
        p.observe(t, 16, [accept[t]] * 16 if t else [], seconds[t])
    assert picks[0] == 2, picks  # (the wide tree now scores best)
    assert 1 in picks[:8], picks
    assert picks[-20:].count(1) >= 19, picks  # (the wide tree explored at most once)


def test_describing_the_policy_from_another_thread_leaves_its_state_alone():
    """Engine.stats() (the server's /metrics) describes the policy from another thread while
    the loop's thread updates it: describing refitted the host's line there, iterating the
    deques and dicts the loop was appending to."""
    tiers = [PLAIN, TreeShape(3, 1, 4), TreeShape(6, 8, 64)]
    p = AdaptiveSpeculation(tiers, measure=lambda b, t: 1e-3)
    for _ in range(5):
        p.observe_host(1, 16, 1.5e-3, 32)
    before = host_us(p, 16)  # (the loop's own refit, at its next pick)
    for _ in range(5):
        p.observe_host(2, 16, 2.0e-3, 64)
    described = p.describe()["host_us_per_step_and_token"][16]
    assert described == before  # what tiers were last weighed by: no refit here
    assert 16 in p.host._stale  # (the loop's next pick refits it)
    assert host_us(p, 16) != before
