"""Load-adaptive speculation on CUDA: steps of every tier replayed from their own graphs, in
any order, decode exactly what plain decoding does (float32), and the draft stays caught up."""

from __future__ import annotations

import itertools

import pytest
import torch

from specserve import Engine
from tests.engine_utils import GPU_TINY, mixed_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU = GPU_TINY
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.mark.parametrize("page_size,lag_tokens", [(1, 32), (16, 4), (3, 0)])
def test_random_tiers_under_graphs_decode_as_plain(page_size, lag_tokens):
    """lag_tokens 4: plain stretches fill the draft's ring, so forced catch-ups replay too."""
    prompts = mixed_prompts(6, 512, seed=page_size)
    params = dict(GREEDY, max_new_tokens=80)  # steps enough for every tier
    with Engine(**GPU, page_size=page_size) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="tiny",
                speculative_num_steps=4, speculative_eagle_topk=4,
                speculative_num_draft_tokens=16, speculative_adaptive=True,
                speculative_adaptive_lag_tokens=lag_tokens)  # fmt: skip
    with Engine(**GPU, page_size=page_size, **spec) as e:
        # every tier, in changing orders, and plain stretches longer than the ring
        # (tiers: plain, chains of 1, 2, 3, the tree at 4 and 8 nodes per request, the tree)
        tiers = itertools.cycle([6, 2, 0, 1, 5, 3, 0, 4, 6, 0, 0, 0, 0, 0, 0, 5, 1, 2, 3, 4])
        e.core.adaptive.pick = lambda b, can=True, ready=None: next(tiers)
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
        adaptive = e.stats()["speculative_adaptive"]
        assert e.core.worker.graphs.num_captures > 0
    assert outs == plain
    assert all(n > 0 for n in adaptive["steps"]), adaptive
    assert (adaptive.get("catch_ups", 0) > 0) == (lag_tokens > 0), adaptive
    chain1, chain2, chain3, quarter, half, tree = adaptive["accept_length"][1:]
    assert (chain1, chain2, chain3, tree) == (2.0, 3.0, 4.0, 5.0)  # the self-draft: all it drafts
    assert 1.0 < quarter <= half <= tree  # ragged steps verify part of the same drafts


def test_every_tier_is_timed_at_every_batch_bucket_before_the_first_request():
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="tiny",
                speculative_num_steps=3, speculative_eagle_topk=2,
                speculative_num_draft_tokens=6, speculative_adaptive=True)  # fmt: skip
    with Engine(**GPU, **spec, cuda_graph_max_bs=12) as e:
        adaptive = e.core.adaptive
        count = len(adaptive.tiers)
        assert set(adaptive.replayed) == {(t, b) for t in range(count) for b in (1, 2, 4, 8, 16)}
        assert all(s > 0 for s in adaptive.replayed.values())


def test_the_hosts_time_per_step_is_measured_while_steps_overlap():
    """What the host spends per step (applying one, launching the next) is taken from steps
    that overlapped; it is positive and, at this tiny model, a fraction of a millisecond to a
    few milliseconds, not the run's wall time (an idle loop or a prefill is never counted)."""
    import time

    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="tiny",
                speculative_num_steps=3, speculative_eagle_topk=4,
                speculative_num_draft_tokens=8, speculative_adaptive=True)  # fmt: skip
    prompts = mixed_prompts(8, 512, seed=31)
    with Engine(**GPU, **spec) as e:
        start = time.perf_counter()
        e.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=64))
        time.sleep(0.2)  # the loop idles: the next run's first interval must not count it
        e.generate(input_ids=prompts[:1], sampling_params=dict(GREEDY, max_new_tokens=64))
        wall = time.perf_counter() - start
        host = e.stats()["speculative_adaptive"]["host_ms"]
    assert host, "no host time measured"
    assert all(0 < ms < 50 and ms < wall * 1e3 / 10 for ms in host.values()), host


def test_every_tier_timed_at_start_is_captured_at_a_new_width_when_idle():
    """The policy may pick any tier timed at a batch bucket at engine start: once a step
    meets a wider context there, the idle engine captures every such tier at that width, so
    a later wave running another tier there replays it instead of stalling on eager steps
    and a capture."""
    from tests.engine_utils import wait_for_idle_captures

    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="tiny",
                speculative_num_steps=3, speculative_eagle_topk=2,
                speculative_num_draft_tokens=6, speculative_adaptive=True)  # fmt: skip
    prompts = mixed_prompts(4, 512, seed=5, min_len=300, max_len=320)  # past width 256
    with Engine(**GPU, **spec, cuda_graph_max_bs=4) as e:
        graphs = e.core.worker.graphs
        tiers = len(e.core.adaptive.tiers)
        e.core.adaptive.pick = lambda b, can=True, ready=None: 1  # one chain tier only
        e.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=16))
        wait_for_idle_captures(graphs)
        first = {k for k in graphs.graphs if k[0] == 4 and k[1] > 256}
        # a wave that runs every other tier at that shape replays them, captures nothing
        captures = graphs.num_captures
        for tier in range(tiers):
            e.core.adaptive.pick = lambda b, can=True, ready=None, t=tier: t
            e.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=8))
        assert graphs.num_captures == captures
    assert {k[1] for k in first} == {512}
    assert {(k[-2], k[-1]) for k in first} == {(t, False) for t in range(tiers)}
