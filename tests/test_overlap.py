"""Overlap scheduling: step k+1 is launched from device state before the host applies step k.

Outputs must not depend on it, for plain and speculative decoding, chains and trees, every
page size, with retraction, aborts and stops; no slot is ever leaked or shared."""

from __future__ import annotations

import random
import threading

import pytest

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, mixed_prompts, spec_args

SP = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    return write_random_eagle_checkpoint(
        str(tmp_path_factory.mktemp("eagle") / "e"), PRESETS["tiny"], "EAGLE", seed=4
    )


def run(prompts, overlap: bool, spec: dict | None = None, sp=SP, **kw):
    args = dict(TINY, debug_check_invariants=True, disable_overlap_schedule=not overlap, **kw)
    if spec:
        args.update(spec)
    with Engine(**args) as e:
        outs = e.generate(input_ids=prompts, sampling_params=sp)
        core = e.core
        stats = e.stats()
        assert stats["kv_used_tokens"] == 0
        ahead = core.num_launched_ahead
    return [o["output_ids"] for o in outs], stats, ahead


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_plain_decoding_same_with_and_without_overlap(page_size):
    prompts = mixed_prompts(6, 512, seed=21)
    off, _, ahead_off = run(prompts, False, page_size=page_size)
    on, _, ahead_on = run(prompts, True, page_size=page_size)
    assert on == off
    assert ahead_off == 0 and ahead_on > 0


@pytest.mark.parametrize("topk, steps, ndt", [(1, 3, 4), (4, 3, 10), (16, 2, 33)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_speculative_same_with_and_without_overlap(eagle, topk, steps, ndt, page_size):
    prompts = mixed_prompts(5, 512, seed=22)
    plain, _, _ = run(prompts, False)
    for draft in (eagle, "tiny"):
        spec = spec_args(draft, topk, steps, ndt)
        on, stats, ahead = run(prompts, True, spec, page_size=page_size)
        assert on == plain
        assert ahead > 0 and stats["spec_verify_ct"] > 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("tree", [None, (1, 3, 4), (4, 3, 10)])
def test_arrivals_prefilled_beside_the_step_in_flight(eagle, page_size, tree):
    """Requests admitted while others decode (a slot frees, a long prompt's next chunk, a
    prefix another request cached) are prefilled behind the decode step in flight instead of
    draining it; every output equals decoding without overlap."""
    shared = mixed_prompts(1, 512, seed=25, min_len=24, max_len=24)[0]
    prompts = mixed_prompts(7, 512, seed=26, min_len=2, max_len=60)
    prompts += [shared + p for p in mixed_prompts(4, 512, seed=27, min_len=1, max_len=9)]
    # staggered lengths: requests finish at different steps, so others start meanwhile
    sp = [dict(SP, max_new_tokens=6 + 5 * (i % 5)) for i in range(len(prompts))]
    kw = dict(page_size=page_size, max_running_requests=3, chunked_prefill_size=16)
    spec = spec_args(eagle, *tree) if tree else None
    off, _, _ = run(prompts, False, spec, sp=sp, **kw)
    on, stats, _ = run(prompts, True, spec, sp=sp, **kw)
    assert on == off
    assert stats["num_prefill_batches_beside_decode"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    if tree:
        assert stats["spec_verify_ct"] > 0


@pytest.mark.parametrize("topk", [1, 4, 16])
def test_overlap_with_retraction_and_stops(eagle, topk):
    prompts = mixed_prompts(24, 512, seed=23, min_len=3, max_len=12)
    sp = {"temperature": 0.0, "max_new_tokens": 28, "ignore_eos": True}
    plain, _, _ = run(prompts, False, sp=sp)
    stops = [{**sp, "stop_token_ids": [p[9]]} for p in plain]
    expected = [p[: p.index(p[9]) + 1] for p in plain]
    spec = spec_args("tiny", topk, 3, min(1 + 3 * topk, 16))
    on, stats, _ = run(prompts, True, spec, sp=stops, page_size=4, max_total_tokens=260)
    assert on == expected
    assert stats["num_retractions"] > 0


def test_stress_topk16_64_tokens_retraction_and_random_aborts(eagle):
    """64 concurrent requests, topk 16 and 64-node trees, a KV budget that forces retraction
    every few steps, random aborts from another thread, overlap on: every request finishes
    or is aborted, finished ones equal plain decoding, and every page is free at the end."""
    prompts = mixed_prompts(64, 512, seed=24, min_len=2, max_len=16)
    sp = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
    plain, _, _ = run(prompts, False, sp=sp)
    spec = spec_args(eagle, 16, 4, 64)
    engine = Engine(**TINY, **spec, page_size=4, max_total_tokens=1200, debug_check_invariants=True)
    rng = random.Random(0)
    rids = [f"r{i}" for i in range(64)]
    to_abort = set(rng.sample(rids, 12))
    results: dict[str, dict] = {}

    def client(i):
        results[rids[i]] = engine.generate(input_ids=prompts[i], sampling_params=sp, rid=rids[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for rid in sorted(to_abort):
        threading.Event().wait(rng.uniform(0.0, 0.05))
        engine.abort(rid)
    for t in threads:
        t.join(timeout=300)
    stats = engine.stats()
    ahead = engine.core.num_launched_ahead
    engine.shutdown()
    assert ahead > 0, "overlap never launched a step ahead"
    assert len(results) == 64, "a request was lost"
    aborted = 0
    for i, rid in enumerate(rids):
        out = results[rid]
        reason = out["meta_info"]["finish_reason"]["type"]
        if reason == "abort":
            assert rid in to_abort
            assert out["output_ids"] == plain[i][: len(out["output_ids"])]
            aborted += 1
        else:
            assert out["output_ids"] == plain[i]
    assert stats["num_retractions"] > 0
    engine.flush_cache()  # the prefix cache keeps finished requests' pages until flushed
    assert (
        engine.core.table.allocator.num_free_pages == engine.core.table.allocator.num_usable_pages
    )
    assert 0 < aborted <= 12, aborted


@pytest.mark.parametrize("page_size", [1, 4])
def test_decoding_takes_pages_as_tokens_are_accepted_not_every_step_anew(eagle, page_size):
    """Under overlap the next step is reserved before the last one's results are applied:
    the pages a step in flight may still need are kept, not freed and taken back at every
    step (host time the loop spends at large batches, where it sets the pace). Outputs stay
    those of plain decoding."""
    prompts = mixed_prompts(4, 512, seed=23)
    sp = dict(SP, max_new_tokens=40)
    plain, _, _ = run(prompts, False, sp=sp)
    args = dict(TINY, debug_check_invariants=True, page_size=page_size)
    args.update(spec_args(eagle, 4, 3, 10))
    with Engine(**args) as e:
        allocator = e.core.table.allocator
        alloc, free = allocator.alloc, allocator.free
        calls = {"alloc": 0, "free": 0}

        def counted_alloc(n):
            calls["alloc"] += n
            return alloc(n)

        def counted_free(pages):
            calls["free"] += len(pages)
            return free(pages)

        allocator.alloc, allocator.free = counted_alloc, counted_free
        outs = e.generate(input_ids=prompts, sampling_params=sp)
        steps = e.core.num_launched_ahead
    assert [o["output_ids"] for o in outs] == plain
    assert steps > 0
    # pages for each request's prompt and outputs, and once for its window and the steps in
    # flight (freeing and retaking them every step took about 2.5 times as many here)
    tokens = sum(len(p) for p in prompts) + len(prompts) * 40
    window = e.core.worker.decode_window + 2 * e.core.worker.max_accept + page_size
    assert calls["alloc"] <= -(-tokens // page_size) + len(prompts) * -(-window // page_size)


def test_a_request_done_with_a_step_in_flight_keeps_no_room_for_a_next_step(eagle):
    """Pages kept for the next step are given back as soon as a request finishes or is
    aborted, not when it is reaped a step later: under a tight KV budget they would stop the
    next step from being launched ahead, and retract a request for nothing."""
    from specserve.config import EngineConfig
    from specserve.runtime.engine_core import EngineCore
    from specserve.runtime.request import Request
    from specserve.sampling_params import SamplingParams

    core = EngineCore(EngineConfig.from_kwargs(**TINY, **spec_args(eagle, 1, 3, 4)).resolve())
    window, pages_for = core.worker.decode_window, core.table.pages_for
    for i, n in enumerate([9, 13, 16, 27]):
        sp = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
        core.add_request(Request(f"r{i}", [5, 6 + i, 7], sp, seed=0))
    checked, aborted = 0, False
    while core.has_work():
        core.step()
        if not aborted and core.num_launched_ahead > 2:
            aborted = core.abort("r3") is not None  # between steps, a step in flight
        for r in core.requests.values():
            if r.finished and r.inflight_steps:
                held = len(core.table.pages(r.rid))
                assert held <= pages_for(r.kv_len + window), (r.rid, held, r.kv_len)
                checked += 1
    assert aborted and checked >= 2
