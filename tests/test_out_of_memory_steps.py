"""A step that runs the device out of memory retracts the started requests and runs fewer at
once: every request still finishes with the output it would have had, and only a request that
ran out of memory alone fails, saying so."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.runtime.running_cap import RunningCap
from specserve.server.metrics import ServerMetrics
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, mixed_prompts, spec_args

GREEDY = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    return write_random_eagle_checkpoint(
        str(tmp_path_factory.mktemp("eagle") / "e"), PRESETS["tiny"], "EAGLE", seed=4
    )


def out_of_memory_above(engine: Engine, most: int) -> list[int]:
    """Make the engine's decode launches raise as a device would with more than `most`
    requests in a step; returns the batch sizes that raised."""
    worker = engine.core.worker
    launch, raised = worker.launch_decode, []

    def launch_decode(reqs, *args, **kwargs):
        if len(reqs) > most:
            raised.append(len(reqs))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return launch(reqs, *args, **kwargs)

    worker.launch_decode = launch_decode
    return raised


def out_of_memory_at_call(engine: Engine, call: int) -> list[int]:
    """Make the engine's `call`-th decode launch (from 0) raise as a device out of memory
    would; returns [call] once it has."""
    worker = engine.core.worker
    launch, calls, raised = worker.launch_decode, [0], []

    def launch_decode(*args, **kwargs):
        calls[0] += 1
        if calls[0] - 1 == call:
            raised.append(call)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return launch(*args, **kwargs)

    worker.launch_decode = launch_decode
    return raised


def run(prompts, sp, most: int | None, **kw):
    with Engine(**dict(TINY, debug_check_invariants=True, **kw)) as e:
        raised = out_of_memory_above(e, most) if most is not None else []
        outs = e.generate(input_ids=prompts, sampling_params=sp)
        stats = e.stats()
        assert stats["kv_used_tokens"] == 0 and not e.core.requests
        assert e.failure is None
    return [o["output_ids"] for o in outs], [o["meta_info"] for o in outs], stats, raised


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("tree", [None, (4, 3, 10)])
def test_requests_retracted_after_running_out_of_memory_finish_as_they_would_have(
    eagle, overlap, tree
):
    prompts = mixed_prompts(8, 512, seed=31, min_len=2, max_len=30)
    kw = dict(page_size=4, disable_overlap_schedule=not overlap, max_running_requests=8)
    if tree:
        kw.update(spec_args(eagle, *tree))
    sampled = [dict(GREEDY, temperature=0.8, seed=i) if i % 2 else GREEDY for i in range(8)]
    want, _, _, _ = run(prompts, sampled, None, **kw)
    got, meta, stats, raised = run(prompts, sampled, 3, **kw)
    assert got == want
    assert all(m["finish_reason"]["type"] == "length" for m in meta)
    assert raised and stats["num_out_of_memory_retractions"] >= 1
    assert stats["max_running_requests"] <= 3  # (halved until a step fits)


def test_a_request_that_runs_out_of_memory_alone_fails_saying_so_and_the_engine_lives():
    with Engine(**TINY) as e:
        raised = out_of_memory_above(e, 0)
        out = e.generate(input_ids=[3, 4, 5], sampling_params=GREEDY)
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "out of memory running it alone" in reason["message"]
        assert raised == [1] and e.failure is None
        e.core.worker.launch_decode = type(e.core.worker).launch_decode.__get__(e.core.worker)
        again = e.generate(input_ids=[3, 4, 5], sampling_params=GREEDY)
        assert again["meta_info"]["finish_reason"]["type"] == "length"


def test_a_prefill_that_runs_out_of_memory_is_retried_with_fewer_requests():
    prompts = mixed_prompts(6, 512, seed=33, min_len=4, max_len=40)
    want, _, _, _ = run(prompts, GREEDY, None, max_running_requests=6)
    with Engine(**dict(TINY, debug_check_invariants=True, max_running_requests=6)) as e:
        worker = e.core.worker
        prefill, raised = worker.prefill, []

        def prefill_once_too_many(chunks):
            if len(chunks) > 2 and not raised:
                raised.append(len(chunks))
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return prefill(chunks)

        worker.prefill = prefill_once_too_many
        outs = e.generate(input_ids=prompts, sampling_params=GREEDY)
        assert raised and e.stats()["num_out_of_memory_retractions"] == 1
        assert e.stats()["kv_used_tokens"] == 0 and e.failure is None
        metrics = ServerMetrics(e, lambda: {"inflight": 0}).render().decode()
        assert "specserve_out_of_memory_retractions_total 1.0" in metrics
    assert [o["output_ids"] for o in outs] == want


def test_a_sampled_request_resumed_alone_draws_with_its_own_settings():
    """Two requests retracted together resume in other rows: a batch of the same requests
    afterwards must write its rows' sampling settings again, not reuse the last batch's."""
    sampled = {"temperature": 0.8, "seed": 11, "max_new_tokens": 24, "ignore_eos": True}
    greedy = dict(GREEDY, max_new_tokens=8)
    for overlap in (True, False):
        outs = []
        for inject in (False, True):
            kw = dict(TINY, max_running_requests=4, disable_overlap_schedule=not overlap)
            with Engine(**kw) as e:
                worker, raised = e.core.worker, []
                prefill = worker.prefill

                def prefill_c_once(chunks, prefill=prefill, raised=raised, inject=inject):
                    if inject and not raised and any(c.req.rid == "c" for c in chunks):
                        raised.append(1)
                        raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                    return prefill(chunks)

                worker.prefill = prefill_c_once
                a_ids, a_started, a_done = [], threading.Event(), threading.Event()

                def on_a(out, ids=a_ids, started=a_started, done=a_done):
                    ids.extend(out["output_ids"])
                    if len(ids) >= 3:
                        started.set()
                    if out["finished"]:
                        done.set()

                e.submit([5, 6, 7, 8, 9], sampled, on_a, rid="a")
                assert a_started.wait(30)  # (a decodes alone a few steps before c arrives)
                c = e.generate(input_ids=[10, 11, 12], sampling_params=greedy, rid="c")
                assert a_done.wait(30)
                outs.append((list(a_ids), c["output_ids"]))
                assert raised == ([1] if inject else [])
        assert outs[0] == outs[1]


def test_requests_that_finish_or_are_aborted_around_the_failing_step_are_all_reported():
    """A request that finished by length in the step just applied (still counted in the step
    launched ahead), one aborted while a step was in flight, and one reaped at the start of
    the step that raised: each gets its final output, and the rest finish as they would
    have."""
    prompts = [[5 + i, 6, 7, 8] for i in range(5)]
    lengths = [30, 6, 30, 30, 30]
    for overlap in (True, False):
        results = []
        for inject in (False, True):
            kw = dict(TINY, debug_check_invariants=True, max_running_requests=8)
            kw["disable_overlap_schedule"] = not overlap
            with Engine(**kw) as e:
                raised = out_of_memory_at_call(e, 5) if inject else []
                done, outs = threading.Event(), {}

                def on_output(out, rid, outs=outs, done=done):
                    got = outs.setdefault(rid, {"ids": []})
                    got["ids"] += out["output_ids"]
                    if out["finished"]:
                        got["reason"] = out["meta_info"]["finish_reason"]["type"]
                        if len(outs) == 5 and all("reason" in o for o in outs.values()):
                            done.set()

                for i, (ids, n) in enumerate(zip(prompts, lengths)):
                    sp = dict(GREEDY, max_new_tokens=n)
                    e.submit(ids, sp, lambda out, rid=f"r{i}": on_output(out, rid), rid=f"r{i}")
                while len(outs.get("r2", {"ids": []})["ids"]) < 4:
                    time.sleep(0.001)
                e.abort("r2")
                assert done.wait(30), {k: v.get("reason") for k, v in outs.items()}
                assert e.failure is None and not e.core.requests
                results.append(
                    {k: (v["reason"], v["ids"] if k != "r2" else None) for k, v in outs.items()}
                )
                assert raised or not inject
        assert results[0] == results[1]
        assert results[1]["r2"][0] == "abort" and results[1]["r1"][0] == "length"


def test_requests_waiting_when_a_step_ran_out_of_memory_still_cache_their_prompt():
    """Only what the failed step may have written is kept out of the prefix cache: a request
    that was waiting then caches its pages, its answer's too, as usual."""
    prompts = mixed_prompts(4, 512, seed=35, min_len=24, max_len=24)
    with Engine(**dict(TINY, debug_check_invariants=True, max_running_requests=2)) as e:
        raised = out_of_memory_above(e, 1)
        outs = e.generate(input_ids=prompts, sampling_params=GREEDY)
        assert raised and e.stats()["num_out_of_memory_retractions"] == 1
        # (its prompt is cached when prefilled; its answer when it is released)
        answered = prompts[3] + outs[3]["output_ids"]
        again = e.generate(input_ids=answered, sampling_params=dict(GREEDY, max_new_tokens=1))
        assert again["meta_info"]["cached_tokens"] > len(prompts[3])


def test_the_running_cap_climbs_back_below_the_decode_batch_that_ran_out_of_memory():
    cap = RunningCap(256, restore_steps=3, ceiling_restore_steps=10**9)
    assert cap.ran_out_of_memory(200, 256, decode_batch=180) == 100
    current, seen = 100, []
    for _ in range(3 * 150):
        current = cap.decode_step_done(current)
        seen.append(current)
    assert seen[1] == 100 and seen[2] == 101  # (one request per restore_steps steps)
    assert current == 179  # (never again the decode batch that failed)
    current = cap.ran_out_of_memory(150, current, decode_batch=140)
    assert current == 75
    for _ in range(3 * 200):
        current = cap.decode_step_done(current)
    assert current == 139
    # a prefill's failure halves the cap but says nothing of decode batches
    prefill = RunningCap(64, restore_steps=1, ceiling_restore_steps=10**9)
    current = prefill.ran_out_of_memory(40, 64, decode_batch=None)
    assert current == 20
    for _ in range(100):
        current = prefill.decode_step_done(current)
    assert current == 64
    # a decode batch smaller than half the started requests (the rest prefilling) bounds it
    beside = RunningCap(64, restore_steps=1, ceiling_restore_steps=10**9)
    assert beside.ran_out_of_memory(40, 64, decode_batch=6) == 5


def test_the_ceiling_rises_again_after_many_steps_without_running_out_of_memory():
    cap = RunningCap(8, restore_steps=1, ceiling_restore_steps=50)
    current = cap.ran_out_of_memory(2, 8, decode_batch=2)
    assert current == 1 and cap.ceiling == 1
    for _ in range(49):
        current = cap.decode_step_done(current)
    assert current == 1  # (one at a time while the failure is recent)
    for _ in range(50 * 10):
        current = cap.decode_step_done(current)
    assert current == 8 and cap.ceiling == 8  # (back to the configured cap, never above)


def test_a_decode_batch_that_ran_out_of_memory_beside_a_prefill_is_not_run_again():
    """A decode step of 6 fails while a 7th request is still prefilling: the ceiling is 5
    (the decode batch's size less one), not 6 (the started requests' less one)."""
    short = [[5 + i, 6 + i] for i in range(6)]
    long = [[7 + (j % 400) for j in range(300)]]
    sp = dict(GREEDY, max_new_tokens=120)
    kw = dict(max_running_requests=10, chunked_prefill_size=16, disable_overlap_schedule=True)
    want, _, _, _ = run(short + long, sp, None, **kw)
    with Engine(**dict(TINY, debug_check_invariants=True, **kw)) as e:
        e.core.running_cap = RunningCap(10, restore_steps=2)
        raised = out_of_memory_above(e, 5)
        outs = e.generate(input_ids=short + long, sampling_params=sp)
        stats = e.stats()
    assert [o["output_ids"] for o in outs] == want
    assert raised == [6] and stats["num_out_of_memory_retractions"] == 1
    assert stats["max_running_requests"] == 5


def test_after_running_out_of_memory_more_requests_run_at_once_again():
    """Once the step that ran out of memory is behind, the engine climbs back towards the
    batch that failed, so a passing shortage does not halve its throughput for good."""
    prompts = mixed_prompts(16, 512, seed=37, min_len=2, max_len=12)
    sp = dict(GREEDY, max_new_tokens=60)
    want, _, _, _ = run(prompts, sp, None, max_running_requests=8)
    with Engine(**dict(TINY, debug_check_invariants=True, max_running_requests=8)) as e:
        e.core.running_cap = RunningCap(8, restore_steps=2)
        raised = out_of_memory_at_call(e, 3)
        worker, sizes = e.core.worker, []
        launch = worker.launch_decode

        def record(reqs, *args, **kwargs):
            sizes.append(len(reqs))
            return launch(reqs, *args, **kwargs)

        worker.launch_decode = record
        outs = e.generate(input_ids=prompts, sampling_params=sp)
        stats = e.stats()
    assert [o["output_ids"] for o in outs] == want
    assert raised == [3] and stats["num_out_of_memory_retractions"] == 1
    failed_at = sizes[3]
    assert failed_at == 8
    after = sizes[4:]
    assert max(after[:2]) <= 4  # (half of those started, at once)
    assert max(after) == failed_at - 1  # (climbed back, not to the count that failed)
    assert stats["max_running_requests"] == failed_at - 1
