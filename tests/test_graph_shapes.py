"""Decode steps in CUDA-graph shape: batches padded to a bucket with padding rows, every
request's KV laid out in a fixed-width block, sampling inputs copied into static tensors.

On CPU the padded steps run eagerly (`DecodeGraphs(capture=False)`), which checks
everything a graph replays except the capture itself (tests/test_gpu.py captures on CUDA).
Outputs must equal unpadded eager decoding, token for token, while batches shrink and grow
across buckets, for plain and speculative decoding, sampling, and every page size."""

from __future__ import annotations

import pytest

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.runtime.cuda_graphs import (
    EAGER_STEPS,
    LONG_LIVED_SHAPE_STEPS,
    DecodeGraphs,
    batch_buckets,
)
from specserve.sampling_params import SamplingParams
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import (
    TINY,
    assert_kv_matches_plain_prefill,
    mixed_prompts,
    padded_graphs,
    record_graph_steps,
    spec_args,
    wait_for_idle_captures,
)


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    return write_random_eagle_checkpoint(
        str(tmp_path_factory.mktemp("eagle") / "e"), PRESETS["tiny"], "EAGLE", seed=8
    )


def generate(prompts, sps, padded: bool, max_bs: int = 4, **kw):
    args = dict(TINY, debug_check_invariants=True, **kw)
    with Engine(**args) as e:
        worker = e.core.worker
        assert worker.graphs is None  # CPU: graphs are off by default
        if padded:
            padded_graphs(e, max_bs)
        outs = e.generate(input_ids=prompts, sampling_params=sps)
        if padded:  # every shape a step ran at, once the idle engine has captured the covered
            wait_for_idle_captures(worker.graphs)
        shapes = sorted(worker.graphs.graphs) if padded else []
        assert e.stats()["kv_used_tokens"] == 0
    return [o["output_ids"] for o in outs], shapes


def varied_params(n: int, sample: bool):
    """Different lengths (so the batch shrinks through the buckets); some sampled."""
    out = []
    for i in range(n):
        sp = {"max_new_tokens": 6 + 5 * i, "ignore_eos": True, "temperature": 0.0}
        if sample and i % 2:
            sp.update(temperature=0.9, top_k=20 if i % 4 == 1 else 0, top_p=0.9, seed=100 + i)
        out.append(sp)
    return out


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    # past 8, every bucket but the largest is a multiple of 16 (no Triton recompiles)
    assert all(b % 16 == 0 for b in batch_buckets(256)[4:]) and batch_buckets(256)[-1] == 256


def test_start_up_captures_the_buckets_a_batch_can_meet_largest_first():
    """Captured at engine start: every bucket up to the one holding the most requests that
    can run together (cuda_graph_max_bs may exceed max_running_requests), largest first."""
    from types import SimpleNamespace

    worker = SimpleNamespace(rows=SimpleNamespace(version=0, attached_version=0))
    graphs = DecodeGraphs(worker, 256, max_width=4096, capture=False)
    assert graphs.start_buckets(32) == [32, 16, 8, 4, 2, 1]
    assert graphs.start_buckets(40) == [48, 32, 16, 8, 4, 2, 1]  # (40 requests: bucket 48)
    assert graphs.start_buckets(256) == graphs.buckets[::-1]
    assert graphs.start_buckets(1000) == graphs.buckets[::-1]  # (larger batches run eagerly)


def test_a_bucket_out_of_memory_at_start_is_left_to_eager_steps_and_the_rest_captured(caplog):
    """An engine whose largest graphs do not fit in device memory still starts: that bucket's
    steps run eagerly, and it is not tried again (neither by serving, nor by adaptive
    speculation's timing, which then times those steps as served); the smaller buckets are
    captured now."""
    from types import SimpleNamespace

    import torch

    worker = SimpleNamespace(
        rows=SimpleNamespace(version=0, attached_version=0), step=SimpleNamespace()
    )
    graphs = DecodeGraphs(worker, 64, max_width=4096, capture=True)
    tried = []

    def capture(*key, idle=False):
        tried.append(key)
        if key[0] == 64:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return object()

    graphs._capture = capture
    # 48, 32, 16, 8, 4, 2, 1 but not 64, greedy and sampled
    assert graphs.capture_at_start(1, 64) == 14
    for greedy in (True, False):
        at = sorted(key[0] for key in graphs.graphs if key[2] == greedy)
        assert at == [1, 2, 4, 8, 16, 32, 48]
    assert "no device memory to capture decode graph (64, 256, True" in caplog.text
    assert "no device memory to capture decode graph (64, 256, False" in caplog.text
    assert len(tried) == 16
    assert graphs.step_seconds(64, 0) is None and len(tried) == 16  # (not tried again)


def test_start_up_captures_serve_greedy_and_default_sampled_requests_unfiltered_ones_later():
    """The graphs captured at start are the ones a greedy batch and a batch at the OpenAI
    default (temperature 1, no top-k / top-p) replay; a filtered batch is captured as met."""
    from types import SimpleNamespace

    from specserve.ops.sampling import SamplingMode
    from specserve.runtime.worker import request_sampling_mode

    worker = SimpleNamespace(
        rows=SimpleNamespace(version=0, attached_version=0), step=SimpleNamespace()
    )
    graphs = DecodeGraphs(worker, 16, max_width=4096, capture=True)
    graphs._capture = lambda *key, idle=False: object()
    assert graphs.capture_at_start(2, 16) == 2 * 2 * 5  # modes x tiers x buckets 16..1

    def request(**params):
        sp = SamplingParams(**params)
        return SimpleNamespace(
            params=sp, return_logprob=False, top_logprobs_num=0, draft_stale=False
        )

    def captured(mode: SamplingMode, bs: int = 8, tier: int = 1) -> bool:
        return graphs._key((bs, 256), mode, tier, False) in graphs.graphs

    greedy = request_sampling_mode([request(temperature=0.0)] * 3)
    default = request_sampling_mode([request(), request(temperature=0.0)])
    filtered = request_sampling_mode([request(temperature=0.8, top_p=0.9)])
    assert captured(greedy) and captured(default) and not captured(filtered)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("overlap", [True, False])
def test_plain_decoding_padded_equals_eager(page_size, overlap):
    prompts = mixed_prompts(7, 512, seed=31)
    sps = varied_params(7, sample=True)
    kw = dict(page_size=page_size, disable_overlap_schedule=not overlap)
    eager, _ = generate(prompts, sps, padded=False, **kw)
    padded, shapes = generate(prompts, sps, padded=True, **kw)
    assert padded == eager
    # batches of 7..1 were padded into buckets 1, 2, 4 and ran eagerly above 4 requests
    assert {s[0] for s in shapes} >= {1, 2, 4}


def test_a_shrinking_batch_replays_its_larger_graph_and_captures_its_own_when_idle():
    """A new shape runs eagerly for its first EAGER_STEPS steps, then is captured. A batch's
    tail meets a smaller batch bucket every few steps: it replays the larger bucket's graph
    (padding rows) rather than stalling every request on a capture, and the engine captures
    those shapes' own graphs once no request is waiting; the same batch then replays them.
    Outputs equal eager decoding throughout."""
    prompts = mixed_prompts(4, 512, seed=35, min_len=4)
    lengths = [EAGER_STEPS + n for n in (4, 6, 9, 14)]
    sps = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
    eager, _ = generate(prompts, sps, padded=False)
    with Engine(**TINY, debug_check_invariants=True) as e:
        graphs = padded_graphs(e)
        ran = record_graph_steps(graphs)
        first = e.generate(input_ids=prompts, sampling_params=sps)
        wait_for_idle_captures(graphs)
        first_ran, ran[:] = list(ran), []
        second = e.generate(input_ids=prompts, sampling_params=sps)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in second] == eager
    # first pass: the batch of 4 eagerly, then captured; its tail of 2 and 1 on that graph
    hows = [how for _, how in first_ran]
    assert hows[: EAGER_STEPS + 1] == ["eager"] * EAGER_STEPS + ["captured"], hows
    assert hows.count("eager") == EAGER_STEPS and hows.count("captured") == 1
    assert {n for n, how in first_ran if how == "covered"} == {1, 2}
    assert {k[0] for k in graphs.graphs} == {1, 2, 4}  # the idle engine captured their own
    assert ran and all(how == "own" for _, how in ran)


def test_a_short_lived_shape_runs_eagerly_and_is_captured_when_idle():
    """A shape nothing covers that lasts fewer than EAGER_STEPS steps (a batch's tail at a
    context width no larger batch reached) is never captured while requests wait: its steps
    run eagerly, and the idle engine captures it for the next time."""
    prompts = mixed_prompts(2, 512, seed=36, min_len=4)
    sps = [{"temperature": 0.0, "max_new_tokens": EAGER_STEPS - 1, "ignore_eos": True}] * 2
    with Engine(**TINY, debug_check_invariants=True) as e:
        graphs = padded_graphs(e)
        ran = record_graph_steps(graphs)
        first = e.generate(input_ids=prompts, sampling_params=sps)
        steps = len(ran)
        assert [how for _, how in ran] == ["eager"] * steps and 1 < steps <= EAGER_STEPS
        wait_for_idle_captures(graphs)
        ran[:] = []
        second = e.generate(input_ids=prompts, sampling_params=sps)
        assert [how for _, how in ran] == ["own"] * steps
        assert e.stats()["num_graph_captures"] == 0
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in second]


@pytest.mark.parametrize("when", ["serving", "idle"])
def test_a_shape_without_memory_for_its_graph_runs_eagerly_and_fails_no_request(when, caplog):
    """A capture that runs out of device memory, while a step waits on it (the batch of 4,
    after its eager steps) or while the engine idles (the batch's tail of 2, covered until
    then by the graph of 4), leaves its shape to eager steps on the batch's rows or to its
    cover: every request still gets the tokens of eager decoding, the shape is not tried
    again, neither by a later step nor by the idle engine, and other shapes are captured as
    before."""
    import torch

    prompts = mixed_prompts(4, 512, seed=37, min_len=4)
    lengths = [EAGER_STEPS + n for n in (4, 6, 9, 14)]
    sps = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
    eager, _ = generate(prompts, sps, padded=False)
    refused_batch = 4 if when == "serving" else 2
    with Engine(**TINY, debug_check_invariants=True) as e:
        graphs = padded_graphs(e)
        capture, tried = graphs._capture, []

        def capture_out_of_memory(*key, idle=False):
            if key[0] != refused_batch:
                return capture(*key, idle=idle)
            tried.append((key, idle))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB")

        graphs._capture = capture_out_of_memory
        ran = record_graph_steps(graphs)
        first = e.generate(input_ids=prompts, sampling_params=sps)
        wait_for_idle_captures(graphs)
        second = e.generate(input_ids=prompts, sampling_params=sps)
        wait_for_idle_captures(graphs)
        stats = e.stats()
    assert stats["kv_used_tokens"] == 0 and stats["num_graph_shapes_without_memory"] == 1
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in second] == eager
    assert [idle for _, idle in tried] == [when == "idle"]  # (once)
    captured = {1, 2, 4} - {refused_batch}
    assert {k[0] for k in graphs.graphs} == captured
    if when == "serving":  # (batch 4's steps on their rows; later ones no longer stall)
        at_4 = [how for n, how in ran if n == 4]
        assert at_4[: EAGER_STEPS + 1] == ["eager"] * EAGER_STEPS + ["unpadded"]
        assert set(at_4[EAGER_STEPS + 1 :]) == {"unpadded"}
    assert "while idle failed" not in caplog.text


def test_only_running_out_of_memory_leaves_a_capture_to_eager_steps():
    """Any other failure of a capture (one that left the stream capturing, say) is a bug to
    report, not a shape to run eagerly; so is running out of memory on a tensor-parallel
    rank, whose steps must stay like its peers' graphs."""
    from types import SimpleNamespace

    import torch

    worker = SimpleNamespace(
        rows=SimpleNamespace(version=0, attached_version=0), step=SimpleNamespace()
    )
    key = (4, 256, True, False, False, 0, False, False, 0, False)
    for error, alone in [(RuntimeError("capture invalidated"), True),
                         (torch.OutOfMemoryError("CUDA out of memory"), False)]:  # fmt: skip
        graphs = DecodeGraphs(worker, 4, 4096, capture=True, eager_without_memory=alone)

        def failing(*key, idle=False, error=error):
            raise error

        graphs._capture = failing
        with pytest.raises(type(error)):
            graphs._capture_if_memory(key)
        assert not graphs._no_memory


@pytest.mark.parametrize(
    "draft, topk, steps, ndt", [("eagle", 1, 3, 4), ("eagle", 4, 3, 10), ("tiny", 3, 2, 7)]
)
@pytest.mark.parametrize("page_size", [1, 5])
def test_speculative_padded_equals_eager(eagle, draft, topk, steps, ndt, page_size):
    prompts = mixed_prompts(6, 512, seed=32)
    sps = varied_params(6, sample=True)
    draft_path = eagle if draft == "eagle" else "tiny"
    kw = dict(page_size=page_size, **spec_args(draft_path, topk, steps, ndt))
    plain, _ = generate(prompts, sps, padded=False, page_size=page_size)
    padded, shapes = generate(prompts, sps, padded=True, max_bs=8, **kw)
    assert padded == plain  # lossless: speculative output equals plain decoding
    assert shapes


@pytest.mark.parametrize("topk, ndt", [(1, 4), (4, 10)])
def test_simulated_acceptance_padded_keeps_kv_consistent(topk, ndt):
    """Simulated lengths come from a device-side counter (graph-safe): the padded path must
    keep the cache equal to a plain prefill of the emitted tokens, as the eager path does."""
    prompts = mixed_prompts(5, 512, seed=33, min_len=4)
    kw = spec_args("tiny", topk, 3, ndt, simulate_acc_len=2.5)
    checked = []
    with Engine(**TINY, page_size=4, **kw) as e:
        padded_graphs(e)
        e.step_hooks.append(lambda core: checked.append(assert_kv_matches_plain_prefill(core)))
        e.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
        )
        stats = e.stats()
    assert sum(checked) > 10
    # the target is its own draft: without simulation every verify would accept 4
    assert 1.5 < stats["spec_accept_length"] < 3.5


def test_ready_tiers_are_the_tiers_captured_at_the_steps_shape():
    """What adaptive speculation is told it can run without a capture: the tiers whose graph
    at this batch bucket, width bucket, sampling mode and draft catch-up exists."""
    import dataclasses
    from types import SimpleNamespace

    from specserve.ops.sampling import SamplingMode

    # (every tier's slot width 0 here: the widths asked about are the steps' widths)
    worker = SimpleNamespace(
        rows=SimpleNamespace(version=0, attached_version=0), tier_slot_width=lambda t, c: 0
    )
    graphs = DecodeGraphs(worker, 16, max_width=4096, capture=True)
    greedy = SamplingMode(all_greedy=True, needs_filter=False)
    sampled = dataclasses.replace(greedy, all_greedy=False)
    graphs.graphs[graphs._key(graphs.bucket(3, 300), greedy, 2, False)] = object()
    no_catch_up = lambda tier: False  # noqa: E731
    assert graphs.ready_tiers(3, 300, greedy, 4, no_catch_up) == {2}
    assert graphs.ready_tiers(4, 500, greedy, 4, no_catch_up) == {2}  # the same buckets
    # a smaller batch or width replays that graph (covers it) until it has its own
    assert graphs.ready_tiers(1, 100, greedy, 4, no_catch_up) == {2}
    assert graphs.ready_tiers(5, 300, greedy, 4, no_catch_up) == set()  # batch bucket 8
    assert graphs.ready_tiers(3, 600, greedy, 4, no_catch_up) == set()  # width bucket 1024
    assert graphs.ready_tiers(3, 300, sampled, 4, no_catch_up) == set()
    assert graphs.ready_tiers(3, 300, greedy, 4, lambda tier: tier > 0) == set()
    # a graph at most MAX_COVER_FACTOR times larger covers, a larger one does not (padding
    # rows cost device time)
    graphs.graphs[graphs._key(graphs.bucket(16, 300), greedy, 3, False)] = object()
    graphs._covers.clear()
    assert graphs.ready_tiers(5, 300, greedy, 4, no_catch_up) == {3}  # 16 covers 8
    assert graphs.ready_tiers(2, 300, greedy, 4, no_catch_up) == {2}  # 16 > 4 x 2
    assert graphs.ready_tiers(4, 300, greedy, 4, no_catch_up) == {2, 3}
    assert graphs.ready_tiers(3, 5000, greedy, 4, no_catch_up) is None  # past the widest
    # a shape that has served many steps in a row is long-lived: any tier may run there
    graphs.streak = (graphs._key(graphs.bucket(3, 300), greedy, 0, False)[:-2], 64)
    assert graphs.ready_tiers(3, 300, greedy, 4, no_catch_up) is None
    assert graphs.ready_tiers(3, 300, sampled, 4, no_catch_up) == set()  # another shape
    assert graphs.ready_tiers(3, 600, greedy, 4, no_catch_up) == set()
    worker.rows.version = 1  # rows reallocated: the next step drops every graph
    assert graphs.ready_tiers(3, 300, greedy, 4, no_catch_up) == set()
    graphs.capture = False  # eager steps: no capture to avoid
    assert graphs.ready_tiers(3, 300, greedy, 4, no_catch_up) is None


def test_each_tier_is_looked_up_at_its_own_width():
    """A small tier of a wide configured tree writes fewer positions past kv_len: its steps
    run, and are looked up, at the width the small tree alone would have (a wide tier at
    the same contexts may already be in the next width bucket)."""
    from types import SimpleNamespace

    from specserve.ops.sampling import SamplingMode

    slot_widths = {0: 2, 1: 16, 2: 64}  # plain, a small tree, the configured wide tree
    worker = SimpleNamespace(
        rows=SimpleNamespace(version=0, attached_version=0),
        tier_slot_width=lambda t, catch_up: max(slot_widths[t], 33) if catch_up else slot_widths[t],
    )
    graphs = DecodeGraphs(worker, 16, max_width=4096, capture=True)
    greedy = SamplingMode(all_greedy=True, needs_filter=False)
    for tier in (1, 2):
        graphs.graphs[graphs._key(graphs.bucket(4, 256), greedy, tier, False)] = object()
    no_catch_up = lambda tier: False  # noqa: E731
    # kv_len up to 200: the small tree's steps fit width 256, the wide tree's need 512
    assert graphs.ready_tiers(4, 200, greedy, 3, no_catch_up) == {1}
    assert graphs.ready_tiers(4, 190, greedy, 3, no_catch_up) == {1, 2}
    # a catch-up reaches further than the small tree's own window
    assert graphs.ready_tiers(4, 230, greedy, 3, lambda tier: tier > 0) == set()
    assert graphs.ready_tiers(4, 230, greedy, 3, no_catch_up) == {1}
    # a long streak at a shape: a tier at that shape may run (and capture) there, a tier
    # whose width is in the next bucket may not; where every tier is at it, any tier may
    graphs.streak = ((4, 256, *graphs._mode(greedy)), 64)
    assert graphs.ready_tiers(4, 200, greedy, 3, no_catch_up) == {0, 1}
    assert graphs.ready_tiers(4, 150, greedy, 3, no_catch_up) is None


def test_a_tier_timed_at_start_is_wanted_at_each_new_width_in_any_sampling_mode():
    """The policy may pick any tier timed at a batch bucket at engine start: a step meeting a
    new width there (in any sampling mode) makes the idle engine capture every such tier at
    it, not only the tier that step ran; a bucket not timed wants only the tiers run there."""
    import dataclasses
    from types import SimpleNamespace

    from specserve.ops.sampling import SamplingMode

    # (a catch-up reaches 300 positions past kv_len, a step without one none here)
    reach = lambda tier, catch_up: 300 if catch_up else 0  # noqa: E731
    worker = SimpleNamespace(
        rows=SimpleNamespace(version=0, attached_version=0), tier_slot_width=reach
    )
    graphs = DecodeGraphs(worker, 32, max_width=4096, capture=True)
    greedy = SamplingMode(all_greedy=True, needs_filter=False)
    sampled = dataclasses.replace(greedy, all_greedy=False)
    for tier in range(3):
        graphs.note_timed(4, tier)  # as timing each tier at engine start does
    ran = graphs._key(graphs.bucket(3, 300), greedy, 1, False)  # batch 4, width 512
    graphs._want_alike(ran)
    assert set(graphs.wanted) == {graphs._key((4, 512), greedy, t, False) for t in (0, 2)}
    graphs.wanted.clear()
    graphs._want_alike(graphs._key((4, 512), sampled, 2, False))
    assert set(graphs.wanted) == {graphs._key((4, 512), sampled, t, False) for t in (0, 1)}
    graphs.wanted.clear()
    graphs._want_alike(graphs._key((16, 512), greedy, 1, False))  # not timed at 16
    assert not graphs.wanted
    # a catch-up run at 16 is wanted at the widths met there that can hold its reach only
    graphs._want_alike(graphs._key((16, 512), greedy, 1, True))
    graphs.wanted.clear()
    graphs._want_alike(graphs._key((16, 256), greedy, 1, False))
    assert set(graphs.wanted) == set()  # (256 < 300: no catch-up step fits there)
    graphs._want_alike(graphs._key((16, 1024), greedy, 1, False))
    assert set(graphs.wanted) == {graphs._key((16, 1024), greedy, 1, True)}


def test_ready_tiers_are_looked_up_once_each_and_only_when_asked():
    from specserve.runtime.cuda_graphs import ReadyTiers

    asked = []
    ready = ReadyTiers(lambda t: asked.append(t) or t % 2 == 1, 4)
    assert 3 in ready and 3 in ready and 2 not in ready and 7 not in ready
    assert asked == [3, 2]  # (7 is no tier: not looked up)
    assert ready == {1, 3} and len(ready) == 2 and sorted(asked) == [0, 1, 2, 3]
    assert 1.0 not in ready and 1 in ready  # (1.0 is no tier, and leaves tier 1 as it was)
    assert ready & {1, 2} == {1} and ready | {0} == {0, 1, 3} and "[1, 3]" in repr(ready)


def test_requests_sent_back_to_back_find_no_idle_capture_in_their_way(monkeypatch):
    """The idle engine captures only once it has had no work for IDLE_CAPTURE_DELAY_S: a
    client sending its next request as the last one returns (a benchmark's timed pass, a
    chat's next turn) must not wait for a capture in between."""
    from specserve.runtime import engine_core

    monkeypatch.setattr(engine_core, "IDLE_CAPTURE_DELAY_S", 1.0)
    prompts = mixed_prompts(2, 512, seed=37, min_len=4)
    sps = [{"temperature": 0.0, "max_new_tokens": max(2, EAGER_STEPS // 2), "ignore_eos": True}] * 2
    with Engine(**TINY) as e:
        graphs = padded_graphs(e)
        for _ in range(2):  # (fewer steps than EAGER_STEPS in all)
            e.generate(input_ids=prompts, sampling_params=sps)
        wanted = set(graphs.wanted)
        assert wanted and not wanted & set(graphs.graphs)  # run eagerly each time
        wait_for_idle_captures(graphs)
        assert wanted <= set(graphs.graphs)


def test_a_shape_met_again_and_again_is_captured_after_its_eager_steps():
    """Eager steps are counted over every visit to a shape, not in a row: a batch flipping
    between two buckets (a request joining and leaving) would otherwise run both eagerly
    for as long as the engine stays busy."""

    from specserve.kv.request_rows import PAD_ROW
    from specserve.ops.sampling import SamplingMode

    with Engine(**TINY) as e:
        # this test runs the steps itself, from its own thread: the idle engine's loop must not
        # capture the wanted shapes meanwhile (on a loaded machine a step outlasts the idle delay)
        e.core.idle_work = lambda: False
        graphs = padded_graphs(e)

        def sampling(n):
            return SamplingMode(all_greedy=True, needs_filter=False)

        hows = {1: [], 4: []}
        for _ in range(EAGER_STEPS + 1):
            for n in (4, 1):  # (nothing covers either before the batch of 4 is captured)
                graphs.run([PAD_ROW] * n, sampling(n), 100)
                how = (
                    "captured"
                    if graphs.captured_last
                    else "covered"
                    if graphs.covered_last
                    else "eager"
                    if graphs.eager_last
                    else "own"
                )
                hows[n].append(how)
    assert hows[4] == ["eager"] * EAGER_STEPS + ["captured"]
    assert hows[1] == ["eager"] * EAGER_STEPS + ["covered"]


def test_a_request_outliving_its_batch_gets_its_own_graph_once_long_lived():
    """A lone request left from a batch would otherwise run on the batch's larger graph for
    as long as the engine is busy: once its shape has served LONG_LIVED_SHAPE_STEPS steps in
    a row, it is captured there and then."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14], [15, 16, 17, 18]]
    lengths = (3, 3, 3, LONG_LIVED_SHAPE_STEPS + 20)
    sps = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
    eager, _ = generate(prompts, sps, padded=False)
    with Engine(**TINY, debug_check_invariants=True) as e:
        graphs = padded_graphs(e)
        # an earlier batch of 4 (the idle engine captured its graph)
        e.generate(input_ids=prompts, sampling_params=dict(sps[0], max_new_tokens=3))
        wait_for_idle_captures(graphs)
        ran = record_graph_steps(graphs)
        outs = e.generate(input_ids=prompts, sampling_params=sps)
    assert [o["output_ids"] for o in outs] == eager
    alone = [how for rows, how in ran if rows == 1]
    n = LONG_LIVED_SHAPE_STEPS
    assert alone[: n - 1] == ["covered"] * (n - 1)
    assert alone[n - 1] == "captured"
    assert set(alone[n:]) == {"own"} and len(alone) > n


def test_a_ragged_tier_verifies_as_many_nodes_per_request_on_a_larger_graph():
    """Padding rows must not enlarge the real rows' verify budget: a request decoded on a
    covering (larger) graph verifies, and so accepts, what it does eagerly."""
    from tests.engine_utils import spec_args

    prompts = mixed_prompts(4, 512, seed=35, min_len=4)
    sps = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in (3, 6, 9, 40)]
    spec = spec_args("tiny", 3, 4, 10, speculative_adaptive=True)

    def serve(padded: bool):
        with Engine(**TINY, **spec) as e:
            quarter = next(t for t, s in enumerate(e.core.adaptive.tiers) if s.ragged)
            e.core.adaptive.pick = lambda b, can=True, ready=None: quarter
            if padded:
                padded_graphs(e)
            outs = e.generate(input_ids=prompts, sampling_params=sps)
        return [(o["output_ids"], o["meta_info"]["spec_accept_histogram"]) for o in outs]

    assert serve(padded=True) == serve(padded=False)


@pytest.mark.parametrize("padded", [False, True])
def test_each_request_samples_with_its_own_parameters_as_batches_and_rows_change(eagle, padded):
    """A step reads each request's sampling parameters by row on the device (inside its
    graph), written when the request first decodes in its row. Requests with different
    parameters come and go (at most three run at once, so rows are freed and taken by
    others, a draft-less one among them, and a caller's id is used again with other
    parameters): each output equals the request's output alone."""
    prompts = mixed_prompts(7, 512, seed=5)
    sps = [
        {"max_new_tokens": 5 + 3 * i, "ignore_eos": True, "temperature": 0.0}
        if i % 2 == 0
        else {
            "max_new_tokens": 4 + 2 * i,
            "ignore_eos": True,
            "temperature": 0.7 + 0.1 * i,
            "top_k": 0 if i % 3 else 15,
            "top_p": 0.95,
            "seed": 7 * i,
        }
        for i in range(7)
    ]
    sps[3]["speculative"] = False
    kw = dict(
        TINY, debug_check_invariants=True, max_running_requests=3, **spec_args(eagle, 2, 3, 6)
    )
    with Engine(**kw) as e:  # (no graphs: each step gathers its sampling eagerly)
        alone = [e.generate(input_ids=p, sampling_params=sp) for p, sp in zip(prompts, sps)]
    with Engine(**kw) as e:
        if padded:
            padded_graphs(e)
        together = e.generate(input_ids=prompts, sampling_params=sps)
        greedy_sp = {**sps[1], "temperature": 0.0}
        greedy = e.generate(input_ids=prompts[1], sampling_params=greedy_sp, rid="same")
        sampled = e.generate(input_ids=prompts[1], sampling_params=sps[1], rid="same")
    assert [o["output_ids"] for o in together] == [o["output_ids"] for o in alone]
    assert sampled["output_ids"] == alone[1]["output_ids"] != greedy["output_ids"]
    assert together[3]["meta_info"]["spec_accept_length"] == 1.0


def test_a_retracted_request_resumes_in_another_row_with_its_own_sampling_parameters():
    """Retraction frees a request's row; resumed, it may decode in another row, which must
    hold its parameters (seeded draws, some greedy) and not the row's last occupant's."""
    prompts = mixed_prompts(24, 512, seed=2, min_len=4, max_len=20)
    sps = [
        {"max_new_tokens": 30, "ignore_eos": True, "temperature": 0.0}
        if i % 3 == 0
        else {"max_new_tokens": 30, "ignore_eos": True, "temperature": 1.0, "seed": i}
        for i in range(len(prompts))
    ]
    with Engine(**TINY) as e:
        padded_graphs(e)
        expected = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sps)]
    with Engine(**TINY, max_total_tokens=200, page_size=4, debug_check_invariants=True) as e:
        padded_graphs(e)
        outs = e.generate(input_ids=prompts, sampling_params=sps)
        assert e.stats()["num_retractions"] > 0, "the budget was meant to force retraction"
    assert [o["output_ids"] for o in outs] == expected


def test_a_request_resumed_in_the_row_another_used_meanwhile_samples_with_its_own():
    """A retracted request frees its row; another request may decode there and finish before
    the first resumes in that very row (free rows are taken last in, first out), which must
    then hold the resumed request's parameters again, not the other's."""
    import torch

    from specserve.config.engine_config import EngineConfig
    from specserve.ops.sampling import SamplingTensors
    from specserve.runtime.engine_core import EngineCore
    from specserve.runtime.request import Request
    from specserve.sampling_params import SamplingParams

    core = EngineCore(EngineConfig.from_kwargs(**TINY).resolve())
    worker, rows, table = core.worker, core.rows, core.table
    b = Request("b", [1, 2], SamplingParams(temperature=0.9, top_p=0.8), seed=11)
    x = Request("x", [1, 2], SamplingParams(temperature=0.0), seed=0)

    def sampling(req):
        idx = torch.tensor([rows.row(req.rid)])
        st = SamplingTensors.gather(
            rows.sampling_floats, rows.sampling_ints, idx, worker._sampling_for([req])
        )
        return st.temperatures.item(), st.top_ps.item(), st.seeds.item()

    table.reserve("b", 4)
    first = sampling(b)
    row = rows.row("b")
    table.release("b")  # retracted
    table.reserve("x", 4)
    assert rows.row("x") == row and sampling(x) == (0.0, 1.0, 0)
    table.release("x")
    worker.forget("x")  # finished and reaped
    table.reserve("b", 4)  # resumed, in the same row
    assert rows.row("b") == row and sampling(b) == first == pytest.approx((0.9, 0.8, 11))


def test_retractions_under_a_tight_budget_keep_every_samples_own_parameters():
    """Samples of one prompt (n > 1) wait for the first one's prefill, so a retracted sample
    can be passed over while other requests take and free its row: the outputs under a
    budget that retracts equal those with room for all."""
    import random

    rng = random.Random(200)
    prompts = mixed_prompts(10, 32, seed=200, min_len=3, max_len=24)
    sps = []
    for _ in prompts:
        sp = {"max_new_tokens": rng.choice([2, 3, 5, 12, 30]), "ignore_eos": True}
        if rng.random() < 0.4:
            sp["temperature"] = 0.0
        else:
            sp.update(
                temperature=rng.choice([0.5, 1.0, 1.5]),
                seed=rng.randint(0, 99),
                top_k=rng.choice([0, 5]),
            )
        sp["n"] = rng.choice([1, 1, 2, 3])
        sps.append(sp)
    with Engine(**TINY) as e:
        roomy = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sps)]
    tight = dict(max_total_tokens=80, page_size=1, chunked_prefill_size=-1, max_running_requests=4)
    with Engine(**TINY, debug_check_invariants=True, **tight) as e:
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sps)]
        assert e.stats()["num_retractions"] > 0, "the budget was meant to force retraction"
    assert outs == roomy


def test_an_adaptive_engine_built_inside_inference_mode_writes_its_rows_sampling():
    """The adaptive policy's graph lookup asks for a batch's sampling before the step is
    launched; an engine built inside torch.inference_mode() holds its row tables as inference
    tensors, which that write must still reach."""
    import torch

    prompts = mixed_prompts(3, 512, seed=1)
    sp = {"max_new_tokens": 8, "temperature": 0.7, "seed": 3, "ignore_eos": True}
    with torch.inference_mode():
        engine = Engine(**TINY, **spec_args("tiny", 2, 3, 6, speculative_adaptive=True))
    with engine as e:
        padded_graphs(e)
        outs = e.generate(input_ids=prompts, sampling_params=sp)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 3


def test_penalty_tables_moving_drop_only_the_penalized_graphs():
    """The first penalized request attaches the penalty tables (and more penalized requests
    at once than its slots reallocate them): graphs of steps without penalties, those
    captured at start among them, do not read them and are kept; penalized ones are
    dropped. Rows reallocated drop every graph."""
    from types import SimpleNamespace

    from specserve.ops.sampling import SamplingMode

    rows = SimpleNamespace(version=0, attached_version=0)
    graphs = DecodeGraphs(SimpleNamespace(rows=rows), 16, max_width=4096, capture=False)
    greedy = SamplingMode(all_greedy=True, needs_filter=False)
    penalized = SamplingMode(all_greedy=False, needs_filter=False, penalized=True)
    for mode in (greedy, penalized):
        for bs in (1, 8):
            graphs.graphs[graphs._key((bs, 256), mode, 0, False)] = object()
    graphs.wanted[graphs._key((4, 256), penalized, 0, False)] = None
    graphs.wanted[graphs._key((4, 256), greedy, 0, False)] = None
    rows.attached_version += 1
    graphs._drop_stale_graphs()
    assert sorted(graphs.graphs) == sorted(graphs._key((b, 256), greedy, 0, False) for b in (1, 8))
    assert list(graphs.wanted) == [graphs._key((4, 256), greedy, 0, False)]
    rows.version += 1
    graphs._drop_stale_graphs()
    assert not graphs.graphs and not graphs.wanted
