"""Engine behaviour on a tiny random-weight model: batching, paging, retraction, inputs."""

from __future__ import annotations

import pathlib
import threading
import time

import pytest

from specserve import Engine, InvalidArgument
from tests.engine_utils import TINY, mixed_prompts, spec_args

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference_outputs():
    prompts = mixed_prompts(8, 512, seed=1)
    with Engine(**TINY) as e:
        alone = [e.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    return prompts, alone


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_batch_invariance_across_page_sizes(reference_outputs, page_size):
    prompts, alone = reference_outputs
    with Engine(**TINY, page_size=page_size, debug_check_invariants=True) as e:
        batched = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert e.stats()["kv_used_tokens"] == 0
    assert batched == alone


def test_chunked_prefill_gives_identical_outputs(reference_outputs):
    prompts, alone = reference_outputs
    with Engine(**TINY, chunked_prefill_size=7, page_size=4, debug_check_invariants=True) as e:
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert outs == alone


def test_retraction_under_tiny_kv_budget_loses_nothing():
    prompts = mixed_prompts(64, 512, seed=2, min_len=4, max_len=20)
    sp = {"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True}
    with Engine(**TINY) as e:
        expected = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
    # Room for about 4 requests at full length.
    with Engine(**TINY, max_total_tokens=200, page_size=4, debug_check_invariants=True) as e:
        outs = e.generate(input_ids=prompts, sampling_params=sp)
        stats = e.stats()
        e.core.check_invariants()
        e.flush_cache()  # the prefix cache keeps finished requests' pages until flushed
        assert e.core.table.allocator.num_free_pages == e.core.table.allocator.num_usable_pages
    assert [o["output_ids"] for o in outs] == expected
    assert stats["num_retractions"] > 0, "the budget was meant to force retraction"
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)


def test_seeded_sampling_is_reproducible_and_batch_invariant():
    prompts = mixed_prompts(4, 512, seed=3)
    sp = {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 1234,
        "max_new_tokens": 16,
        "ignore_eos": True,
    }
    with Engine(**TINY) as e:
        alone = [e.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
        batched = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
        other_seed = e.generate(input_ids=prompts[0], sampling_params={**sp, "seed": 99})[
            "output_ids"
        ]
    assert alone == batched
    assert other_seed != alone[0]


def test_a_negative_seed_is_a_seed_like_any_other():
    """Clients send seed -1 (vLLM and OpenAI's API take negative seeds): it samples
    reproducibly, and differently from another seed."""
    sp = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}
    engine = _shared_engine()
    runs = [
        engine.generate(input_ids=[5, 6, 7], sampling_params={**sp, "seed": s})["output_ids"]
        for s in (-1, -1, 1)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_streaming_concatenates_to_the_full_output():
    with Engine(**TINY) as e:
        full = e.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
        chunks = list(e.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, stream=True))
    assert chunks[-1]["finished"] and not any(c["finished"] for c in chunks[:-1])
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]


def test_stop_token_ids_end_the_request_at_that_token():
    with Engine(**TINY) as e:
        full = e.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]
        stop_at = full[10]
        out = e.generate(
            input_ids=[5, 6, 7], sampling_params={**GREEDY, "stop_token_ids": [stop_at]}
        )
    first = full.index(stop_at)
    assert out["output_ids"] == full[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -0.1}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": -5}}, "top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, 99999]}, "input_ids"),
        # (a stop token the model can never sample would silently never stop it)
        (
            {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [3, 99999]}},
            "stop_token_ids",
        ),
        ({"input_ids": [1] * 5000}, "input_ids"),
        ({"prompt": "text needs a tokenizer"}, "prompt"),
    ],
)
def test_bad_requests_name_the_field_and_the_engine_keeps_serving(kwargs, field):
    engine = _shared_engine()
    with pytest.raises(InvalidArgument) as info:
        engine.generate(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)
    ok = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert len(ok["output_ids"]) == 2


def test_bad_engine_arguments_are_refused():
    with pytest.raises(InvalidArgument) as info:
        Engine(model_path="no-such-model")
    assert info.value.field == "model_path"
    with pytest.raises(InvalidArgument) as info:
        Engine(**TINY, page_size=0)
    assert info.value.field == "page_size"
    with pytest.raises(InvalidArgument) as info:
        Engine(**TINY, not_an_arg=1)
    assert info.value.field == "not_an_arg"


def test_a_kv_pool_too_small_for_one_speculative_request_is_refused_with_its_minimum():
    """The minimum is a plain engine's (with a standalone draft's root): a request the cache
    cannot hold with its tree's window decodes plainly."""
    spec = spec_args("tiny", 4, 4, 16)
    with pytest.raises(InvalidArgument) as info:
        Engine(**TINY, **spec, max_total_tokens=2)
    assert info.value.field == "max_total_tokens"
    need = int(str(info.value).rsplit("at least ", 1)[1].split()[0])
    assert need == 3
    # the minimum it names serves a one-token prompt, and one more token
    with Engine(**TINY, **spec, max_total_tokens=need) as engine:
        out = engine.generate(input_ids=[5], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


def test_triton_attention_on_a_cpu_is_refused_outside_the_interpreter(monkeypatch):
    from specserve.config.engine_config import EngineConfig

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidArgument) as info:
        EngineConfig(**TINY, attention_backend="triton").resolve(cuda_available=False)
    assert info.value.field == "attention_backend"
    assert "'torch'" in str(info.value)
    # under Triton's interpreter (how its kernels are tested on a CPU) it is allowed
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    resolved = EngineConfig(**TINY, attention_backend="triton").resolve(cuda_available=False)
    assert resolved.attention_backend == "triton"


def test_a_rid_is_free_again_as_soon_as_its_request_finished():
    """A finished request keeps its pages until the step launched ahead of it is applied;
    its id is the caller's again at once (SGLang's rid semantics)."""
    with Engine(**TINY, **spec_args("tiny", 2, 3, 6)) as engine:
        deliver = engine._deliver

        def slow(req):  # the loop thread, preempted right after answering, meets the next
            deliver(req)  # submission before its next step reaps the finished request
            deadline = time.monotonic() + 2
            while req.finished and engine._inbox.empty() and time.monotonic() < deadline:
                time.sleep(0.001)

        engine._deliver = slow
        # a long request keeps a decode batch going, so steps are launched ahead
        long = {"max_new_tokens": 100000, "ignore_eos": True}
        background = engine.generate(input_ids=[9, 9], sampling_params=long, stream=True)
        next(background)
        for i in range(12):
            out = engine.generate(
                input_ids=[4, 5, 6 + i], sampling_params={"max_new_tokens": 3}, rid="same"
            )
            assert out["meta_info"]["id"] == "same"
            assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
            assert len(out["output_ids"]) == 3
        background.close()


def test_a_request_keyed_apart_never_takes_the_key_of_another_callers_request():
    """While a finished 'x' still holds its pages a new 'x' is keyed apart; a caller may
    itself run a request named like such a key ('x#1'), which must stay untouched."""
    from specserve.config import EngineConfig
    from specserve.runtime.engine_core import EngineCore
    from specserve.runtime.request import Request
    from specserve.sampling_params import SamplingParams

    cfg = EngineConfig.from_kwargs(**TINY, no_default_draft=True, debug_check_invariants=True)
    core = EngineCore(cfg.resolve())
    sp = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    other, first = Request("x#1", [4, 5, 6], sp, seed=0), Request("x", [7, 8, 9], sp, seed=0)
    core.add_request(other)
    core.add_request(first)
    for _ in range(3):
        core.step()
    core.abort("x")
    assert "x" in core.requests  # finished, still held by the step launched ahead of it
    second = Request("x", [7, 8], sp, seed=0)
    core.add_request(second)
    assert core.requests["x#1"] is other and second.rid not in ("x", "x#1")
    while core.has_work():
        core.step()
    assert len(other.output_ids) == 20 and len(second.output_ids) == 20
    assert other.finish_reason["type"] == second.finish_reason["type"] == "length"


def test_a_rid_still_running_is_refused_and_abort_reaches_only_the_running_request():
    engine = _shared_engine()
    long = {"max_new_tokens": 100000, "ignore_eos": True}
    stream = engine.generate(input_ids=[4, 5, 6], sampling_params=long, stream=True, rid="busy")
    next(stream)
    second = engine.generate(input_ids=[7, 8], sampling_params={"max_new_tokens": 2}, rid="busy")
    assert second["meta_info"]["finish_reason"]["type"] == "abort"
    assert "rid" in second["meta_info"]["finish_reason"]["message"]
    engine.abort("busy")
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    again = engine.generate(input_ids=[7, 8], sampling_params={"max_new_tokens": 2}, rid="busy")
    assert len(again["output_ids"]) == 2


def test_a_stream_is_submitted_when_returned_and_closing_it_aborts_it():
    """Its request runs from the call on: an abort by its rid before the first read reaches
    it; a stream closed or dropped unread frees its request; on a shut-down engine the call
    raises."""
    engine = _shared_engine()
    long = {"max_new_tokens": 100000, "ignore_eos": True}
    stream = engine.generate(input_ids=[4, 5, 6], sampling_params=long, stream=True, rid="s1")
    engine.abort("s1")
    outs = list(stream)
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert sum(len(o["output_ids"]) for o in outs) < 100000
    for drop in (True, False):
        stream = engine.generate(input_ids=[4, 5, 6], sampling_params=long, stream=True)
        if drop:
            del stream
        else:
            stream.close()
        deadline = time.monotonic() + 30
        while engine.stats()["num_running_requests"] or engine.stats()["num_waiting_requests"]:
            assert time.monotonic() < deadline, "an unread stream's request kept running"
            time.sleep(0.01)
    with Engine(**TINY) as stopped:
        pass
    with pytest.raises(RuntimeError, match="shut down"):
        stopped.generate(input_ids=[4, 5], stream=True)


def test_abort_of_an_unknown_rid_leaves_a_request_named_like_a_sample_of_it_running():
    """Abort by the rid of a prompt sampled n times reaches its samples (rid-0, rid-1, ...)
    and nothing else: a request submitted on its own as 'job-1' is no sample of 'job'."""
    engine = _shared_engine()
    sp = {"max_new_tokens": 200, "ignore_eos": True}
    stream = engine.generate(input_ids=[4, 5, 6], sampling_params=sp, stream=True, rid="job-1")
    first = next(stream)
    engine.abort("job")
    outs = [first, *stream]
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert sum(len(o["output_ids"]) for o in outs) == 200


def test_abort_frees_the_request_and_its_kv():
    engine = _shared_engine()
    results = {}

    def run():
        results["out"] = engine.generate(
            input_ids=[4, 5, 6],
            sampling_params={"max_new_tokens": 100000, "ignore_eos": True},
            rid="long-one",
        )

    t = threading.Thread(target=run)
    t.start()
    import time

    deadline = time.time() + 10
    while engine.stats()["num_running_requests"] == 0 and time.time() < deadline:
        time.sleep(0.01)
    engine.abort("long-one")
    t.join(timeout=10)
    out = results["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.stats()["kv_used_tokens"] == 0


def test_max_new_tokens_zero_and_context_limit():
    engine = _shared_engine()
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


_ENGINE = {}


def _shared_engine() -> Engine:
    if "e" not in _ENGINE:
        _ENGINE["e"] = Engine(**TINY, context_length=1024)
    return _ENGINE["e"]


def teardown_module(module):
    if "e" in _ENGINE:
        _ENGINE.pop("e").shutdown()


def test_a_failing_step_hook_fails_requests_and_loses_none():
    """A step hook (an invariant check) that raises must not stop the loop or swallow the
    requests its step finished: every caller gets an answer."""
    prompts = mixed_prompts(3, 512, seed=46)
    sp = {"temperature": 0.0, "max_new_tokens": 1}  # the prefill step finishes and reaps them
    results = []
    with Engine(**TINY, disable_overlap_schedule=True) as e:

        def boom(core):
            raise RuntimeError("check failed")

        e.step_hooks.append(boom)
        t = threading.Thread(
            target=lambda: results.append(e.generate(input_ids=prompts, sampling_params=sp))
        )
        t.start()
        t.join(timeout=60)
        assert not t.is_alive(), "generate hung after a failing step hook"
        e.step_hooks.remove(boom)
        again = e.generate(input_ids=prompts[0], sampling_params=sp)  # still serving
    assert len(results[0]) == 3 and all(o["finished"] for o in results[0])
    assert again["finished"]


def test_a_failing_step_whose_cleanup_also_fails_still_answers_every_caller(monkeypatch):
    """A step that raises fails its requests; should releasing their worker state raise too,
    the callers still get their answers and the engine keeps serving."""
    prompts = mixed_prompts(3, 512, seed=47)
    results = []
    with Engine(**TINY, disable_overlap_schedule=True) as e:
        core = e.core
        real_step, real_forget = core.step, core.worker.forget

        def failing_step():
            monkeypatch.setattr(core.worker, "forget", failing_forget)
            raise RuntimeError("device fault")

        def failing_forget(rid):
            raise RuntimeError("cleanup fault")

        monkeypatch.setattr(core, "step", failing_step)
        t = threading.Thread(
            target=lambda: results.append(e.generate(input_ids=prompts, sampling_params=GREEDY))
        )
        t.start()
        t.join(timeout=60)
        assert not t.is_alive(), "generate hung after the failed step's cleanup raised"
        monkeypatch.setattr(core, "step", real_step)
        monkeypatch.setattr(core.worker, "forget", real_forget)
        assert not core.requests  # nothing half-removed is left behind
        again = e.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert len(results[0]) == 3
    for out in results[0]:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "device fault" in out["meta_info"]["finish_reason"]["message"]
    assert again["finished"] and len(again["output_ids"]) == GREEDY["max_new_tokens"]


def test_the_collector_skips_the_startup_heap_while_serving_and_gets_it_back_after():
    """Full garbage collections would otherwise rescan the engine's whole start-up state
    (modules, model, kernels, graphs) while the device waits on the loop. Run in a fresh
    process: engines other tests leave open would keep the heap frozen here."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import gc
        from specserve import Engine
        from tests.engine_utils import TINY

        sp = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
        with Engine(**TINY) as first:
            frozen = gc.get_freeze_count()
            assert frozen > 10_000, frozen  # torch's and the engine's objects at least
            with Engine(**TINY):
                assert gc.get_freeze_count() >= frozen
            # the other engine's shutdown leaves this one's start-up state frozen
            assert gc.get_freeze_count() >= frozen, gc.get_freeze_count()
            out = first.generate(input_ids=[1, 2, 3], sampling_params=sp)
            assert len(out["output_ids"]) == 4
        # with no engine left, their state can be reclaimed
        assert gc.get_freeze_count() == 0, gc.get_freeze_count()
        """
    )
    root = str(pathlib.Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_calls_racing_a_shutdown_are_answered_not_left_waiting():
    """generate and flush_cache called while another thread shuts the engine down, caught
    between seeing the engine run and queueing their work for its loop: each returns (an
    aborted output, the flush's count) or raises, and none waits forever."""
    e = Engine(**TINY)
    put = e._inbox.put

    def slow_put(item, *args, **kwargs):  # (widens the window between check and queueing)
        if item[0] in ("add", "flush"):
            time.sleep(0.3)
        return put(item, *args, **kwargs)

    e._inbox.put = slow_put
    results = {}

    def call(name, fn):
        try:
            results[name] = fn()
        except RuntimeError as err:
            results[name] = err

    gen = lambda: e.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)  # noqa: E731
    threads = [
        threading.Thread(target=call, args=(name, fn), daemon=True)
        for name, fn in (("generate", gen), ("flush", e.flush_cache))
    ]
    for t in threads:
        t.start()
    time.sleep(0.1)
    e.shutdown()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), results
    out = results["generate"]
    assert isinstance(out, RuntimeError) or out["finished"]  # (run, or aborted by the shutdown)
    assert isinstance(results["flush"], (int, RuntimeError))


def test_abort_by_the_rid_of_a_prompt_sampled_n_times_aborts_its_samples():
    with Engine(**TINY) as e:
        outs = []
        sp = {**GREEDY, "n": 2, "max_new_tokens": 2000}
        t = threading.Thread(
            target=lambda: outs.extend(e.generate(input_ids=[5, 6, 7], sampling_params=sp, rid="x"))
        )
        t.start()
        deadline = time.time() + 30
        while e.stats()["num_running_requests"] < 2 and time.time() < deadline:
            time.sleep(0.01)
        e.abort("x")
        t.join(30)
    assert not t.is_alive()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]


def test_one_call_naming_a_request_id_twice_is_refused_before_anything_runs():
    with Engine(**TINY) as e:
        with pytest.raises(InvalidArgument, match="rid"):
            e.generate(input_ids=[[5, 6], [7, 8]], rid=["a", "a"], sampling_params=GREEDY)
        with pytest.raises(InvalidArgument, match="rid"):  # (a-1: the first prompt's sample)
            e.generate(
                input_ids=[[5, 6], [7, 8]],
                rid=["a", "a-1"],
                sampling_params=[{**GREEDY, "n": 2}, GREEDY],
            )
        assert e.stats()["num_running_requests"] == 0


def test_a_request_between_chunks_of_its_prompt_counts_as_running():
    """stats() (the server's running / queued gauges): a prompt prefilled in chunks is
    running from its first chunk on, not queued (it stays in the scheduler's waiting queue
    until its last chunk)."""
    chunk = 8
    with Engine(**{**TINY, "chunked_prefill_size": chunk, "context_length": 2048}) as e:
        done = threading.Event()
        t = threading.Thread(
            target=lambda: (
                e.generate(input_ids=[5 + i % 90 for i in range(1200)], sampling_params=GREEDY),
                done.set(),
            )
        )
        t.start()
        seen = []
        while not done.is_set():
            s = e.stats()
            # (from the second chunk on: the first one's request is still marked waiting)
            if 2 * chunk <= s["kv_used_tokens"] < 1200:
                seen.append((s["num_running_requests"], s["num_waiting_requests"]))
            time.sleep(0.0005)
        t.join(30)
    assert len(seen) >= 3, "the prefill ended before it could be observed"
    assert set(seen) == {(1, 0)}
