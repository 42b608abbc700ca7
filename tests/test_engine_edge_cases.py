"""The offline API under unusual use: arguments refused naming the field, requests that must
each end (finished, aborted or failed with a reason), and outputs at the edges."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specserve import Engine, InvalidArgument
from specserve.sampling_params import SamplingParams
from tests.engine_utils import TINY

EOS = 2  # the tiny preset's
GREEDY_10 = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    with Engine(**TINY) as e:
        yield e


def test_min_new_tokens_is_refused_when_every_allowed_token_is_a_stop_token(engine):
    """Before the minimum every allowed token would be held back, so the draw had nothing to
    take and emitted a token outside allowed_token_ids."""
    for sp in (
        {"allowed_token_ids": [EOS]},
        {"allowed_token_ids": [7, 9], "stop_token_ids": [9, 7]},
        {"allowed_token_ids": [EOS, 7], "stop_token_ids": [7]},
    ):
        with pytest.raises(InvalidArgument) as exc:
            engine.generate(input_ids=[5, 6], sampling_params={**sp, "min_new_tokens": 3})
        assert exc.value.field == "min_new_tokens"
        assert "allowed_token_ids" in str(exc.value)
    # a token left to draw, or EOS ignored: the minimum holds and only allowed tokens come
    for sp, want in (
        ({"allowed_token_ids": [EOS, 7]}, [7, 7, 7, EOS]),
        ({"allowed_token_ids": [EOS], "ignore_eos": True}, [EOS] * 4),
    ):
        out = engine.generate(
            input_ids=[5, 6],
            sampling_params={
                **sp,
                "min_new_tokens": 3,
                "max_new_tokens": 4,
                "temperature": 0,
                "logit_bias": {EOS: 100.0},
            },
        )
        assert out["output_ids"] == want


def test_a_sampling_params_object_changed_after_submission_leaves_its_requests_alone(engine):
    """The engine keeps its own copy: a caller reusing one object for several submissions
    (changing a field in between) gets each request as it was submitted."""
    done = {length: threading.Event() for length in (2, 5, 9)}
    got: dict[int, list[int]] = {length: [] for length in done}

    def collect(length):
        def on_output(out):
            got[length].extend(out["output_ids"])
            if out["finished"]:
                done[length].set()

        return on_output

    sp = SamplingParams(temperature=0.0, ignore_eos=True)
    for length in done:
        sp.max_new_tokens = length
        engine.submit([5, 6, 7], sp, collect(length))
    for event in done.values():
        assert event.wait(30)
    assert {length: len(ids) for length, ids in got.items()} == {2: 2, 5: 5, 9: 9}
    # nor does validation rewrite the caller's object (a tiny temperature means greedy)
    mine = SamplingParams(temperature=1e-7, max_new_tokens=2)
    engine.generate(input_ids=[5], sampling_params=mine)
    assert mine.temperature == 1e-7


def test_abort_right_after_a_prompt_sampled_n_times_is_submitted_aborts_every_sample():
    """A call's samples reach the engine together: an abort by their rid, however soon after
    the call, never lands between them and leaves some running to their full length."""
    with Engine(**TINY) as e:
        put = e._inbox.put

        first_queued = threading.Event()

        def slow_put(item, *args, **kwargs):  # (widens the window between two submissions)
            if item[0] != "add":
                return put(item, *args, **kwargs)
            if first_queued.is_set():
                time.sleep(0.5)
            put(item, *args, **kwargs)
            first_queued.set()

        e._inbox.put = slow_put
        outs: list[dict] = []
        sp = {"max_new_tokens": 100_000, "ignore_eos": True, "n": 3}
        t = threading.Thread(
            target=lambda: outs.extend(e.generate(input_ids=[5, 6], sampling_params=sp, rid="x")),
            daemon=True,
        )
        t.start()
        assert first_queued.wait(30)  # (the first sample is queued, the others not yet)
        e.abort("x")
        t.join(30)
        assert not t.is_alive(), "a sample the abort missed is still running"
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 3


@pytest.mark.parametrize("on_output", [None, "print", 5])
def test_a_low_level_submission_without_a_callable_callback_is_refused(engine, on_output):
    """Else the request ran until its first output, failed there on the loop, and its
    caller, who had no callback to hear it, never knew."""
    for submit in (engine.submit, engine.submit_samples):
        with pytest.raises(InvalidArgument) as exc:
            submit([5, 6, 7], {"max_new_tokens": 2}, on_output)
        assert exc.value.field == "on_output"
    reqs = engine.make_samples([5, 6, 7], {"max_new_tokens": 2})
    with pytest.raises(InvalidArgument):
        engine.submit_made(reqs, on_output)
    assert not engine.core.requests and engine._inbox.empty()


def test_shutdown_from_an_output_callback_shuts_the_engine_down():
    """The callback runs on the engine's loop: shutting down there must not fail the request
    as a broken callback ("cannot join current thread") nor skip closing the engine."""
    e = Engine(**TINY)
    closed = threading.Event()
    close = e.core.close
    e.core.close = lambda: (close(), closed.set())
    outs: list[dict] = []
    finished = threading.Event()

    def on_output(out):
        outs.append(out)
        if len(outs) == 2:
            e.shutdown()
        if out["finished"]:
            finished.set()

    e.submit([5, 6, 7], {"max_new_tokens": 100_000, "ignore_eos": True}, on_output)
    assert finished.wait(30)
    assert outs[-1]["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "engine shut down",
    }
    assert closed.wait(10)
    e._thread.join(10)
    assert not e._thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate(input_ids=[5], sampling_params={"max_new_tokens": 1})


def test_an_output_callback_calling_back_into_the_engine_does_not_hang_it(engine):
    """Callbacks run on the engine's loop: flush_cache there is answered at once, and a
    blocking generate is refused (it would wait for the loop it is holding), failing that
    request alone; the engine keeps serving."""
    seen: dict[str, object] = {}
    done = threading.Event()

    def on_output(out):
        if not out["finished"]:
            return
        seen["flushed"] = engine.flush_cache()
        try:
            engine.generate(input_ids=[5], sampling_params={"max_new_tokens": 1})
        except RuntimeError as err:
            seen["refused"] = str(err)
        done.set()

    engine.submit([5, 6, 7], {"max_new_tokens": 3}, on_output)
    assert done.wait(10), "the callback is stuck"
    assert isinstance(seen["flushed"], int)
    assert "submit" in seen["refused"]
    out = engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


def test_lists_in_a_submitted_sampling_params_object_are_the_engines_own(engine):
    done = threading.Event()
    got: list[int] = []
    full = engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY_10)["output_ids"]
    sp = SamplingParams(**GREEDY_10, stop_token_ids=[full[3]])

    def on_output(out):
        got.extend(out["output_ids"])
        if out["finished"]:
            done.set()

    engine.submit([5, 6, 7], sp, on_output)
    sp.stop_token_ids.append(full[1])  # (after submission: not the request's)
    assert done.wait(30)
    assert got == full[: full.index(full[3]) + 1]


def test_a_bug_met_while_adding_one_request_fails_it_alone(engine, monkeypatch):
    """An unexpected error on the loop (not a refusal) ends that request with the reason and
    leaves the loop serving: the other request of the call finishes, later calls are served."""
    add = engine.core.add_request

    def add_or_break(req):
        if req.rid == "broken":
            raise RuntimeError("simulated bug")
        add(req)

    monkeypatch.setattr(engine.core, "add_request", add_or_break)
    broken, fine = within_seconds(
        lambda: engine.generate(
            input_ids=[[5, 6], [5, 6]], sampling_params=GREEDY_10, rid=["broken", "fine"]
        )
    )
    reason = broken["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "simulated bug" in reason["message"]
    assert len(fine["output_ids"]) == 10
    monkeypatch.setattr(engine.core, "add_request", add)
    assert (
        engine.generate(input_ids=[5, 6], sampling_params=GREEDY_10)["output_ids"]
        == (fine["output_ids"])
    )


def test_a_failing_flush_raises_to_its_caller_and_the_loop_goes_on(engine, monkeypatch):
    def broken_flush():
        raise RuntimeError("simulated flush failure")

    monkeypatch.setattr(engine.core, "flush_cache", broken_flush)
    with pytest.raises(RuntimeError, match="simulated flush failure"):
        within_seconds(engine.flush_cache)
    monkeypatch.undo()
    out = within_seconds(lambda: engine.generate(input_ids=[5, 6], sampling_params=GREEDY_10))
    assert len(out["output_ids"]) == 10


def test_a_failing_abort_leaves_the_loop_serving(engine, monkeypatch):
    def broken_abort(rid, message="aborted by request"):
        raise RuntimeError("simulated abort failure")

    monkeypatch.setattr(engine.core, "abort", broken_abort)
    engine.abort("nobody")
    out = within_seconds(lambda: engine.generate(input_ids=[5, 6], sampling_params=GREEDY_10))
    assert len(out["output_ids"]) == 10


def within_seconds(call, seconds: float = 60.0):
    """call()'s result or exception, failing the test if it has not returned in time (a loop
    that died leaves its callers waiting forever)."""
    result: dict = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as e:  # (re-raised on the test's thread)
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no answer within {seconds} s: the engine's loop stopped"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("rid", ["", ["a", ""]])
def test_an_empty_request_id_is_refused(engine, rid):
    """An empty id was replaced by a made one, so an abort by the id given reached nothing."""
    prompts = [[5, 6]] if isinstance(rid, str) else [[5, 6], [5, 6]]
    with pytest.raises(InvalidArgument) as exc:
        engine.generate(input_ids=prompts, sampling_params=GREEDY_10, rid=rid)
    assert exc.value.field == "rid"
    with pytest.raises(InvalidArgument, match="non-empty"):
        engine.submit([5, 6], GREEDY_10, lambda out: None, rid="")


def test_requests_submitted_twice_are_refused_and_the_first_submission_runs_on(engine):
    """A second submit_made of the same requests was refused on the loop, which aborted the
    running request it had been given."""
    reqs = engine.make_samples([5, 6], {**GREEDY_10, "max_new_tokens": 40})
    done = threading.Event()
    outs: list[dict] = []

    def on_output(index, out):
        outs.append(out)
        if out["finished"]:
            done.set()

    engine.submit_made(reqs, on_output)
    with pytest.raises(InvalidArgument) as exc:
        engine.submit_made(reqs, on_output)
    assert exc.value.field == "reqs"
    assert done.wait(60)
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert sum(len(o["output_ids"]) for o in outs) == 40


LEFT_RUNNING = {
    "never shut down": "",
    # (shut down from its own callback, whose shutdown cannot wait for the loop it runs on)
    "shut down from its callback": (
        "import time\n"
        "done = threading.Event()\n"
        "def on_output(out):\n"
        "    if not done.is_set():\n"
        "        done.set()\n"
        "        engines[0].shutdown()\n"
        "        time.sleep(2)  # (the loop still busy when the main thread exits)\n"
        "engines[0].submit([5, 6], {'max_new_tokens': 50, 'ignore_eos': True}, on_output)\n"
        "done.wait(30)\n"
    ),
}


@pytest.mark.parametrize("how", list(LEFT_RUNNING))
def test_an_engine_left_running_is_shut_down_when_the_interpreter_exits(tmp_path, how):
    """vLLM's `LLM` is used without closing it: an engine left so ended the process under its
    running loop thread (on a CPU Triton then printed dozens of leaked-object lines)."""
    script = tmp_path / "left_running.py"
    script.write_text(
        "import atexit, threading\n"
        "engines = []\n"
        "# (registered first, so run last: after specserve's own exit hook)\n"
        "atexit.register(lambda: print('loop alive at exit:', engines[0]._thread.is_alive()))\n"
        "from specserve import Engine\n"
        "engines.append(Engine(model_path='tiny', load_format='dummy', device='cpu',\n"
        "                      max_total_tokens=256))\n"
        "print(engines[0].generate(input_ids=[[5, 6]], sampling_params={'max_new_tokens': 2})\n"
        "      [0]['output_ids'])\n" + LEFT_RUNNING[how]
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loop alive at exit: False" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "leaked" not in done.stderr, done.stderr[-2000:]


def test_abort_without_a_request_id_is_refused_naming_rid(engine):
    # (None makes an id when submitting; there is nothing it could name to abort)
    with pytest.raises(InvalidArgument) as info:
        engine.abort(None)
    assert info.value.field == "rid"
