"""The offline API: one bad request (bad parameters, a raising detokenizer or callback) fails
alone while the requests around it finish correctly; a broken device step fails everything
and says so; streams never show part of a stop string."""

from __future__ import annotations

import threading

import pytest

from specserve import Engine, InvalidArgument
from tests.engine_utils import TINY

N = 24  # tokens per good request: long enough to overlap the bad ones


def prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 400 + 3 for j in range(6 + i % 4)] for i in range(n)]


@pytest.fixture(scope="module")
def engine():
    with Engine(**TINY) as e:
        yield e


def greedy(engine, ids, n=N):
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    return engine.generate(input_ids=ids, sampling_params=sp)["output_ids"]


def run_in_background(engine, ps):
    """Generate greedily for each prompt on its own thread; returns (threads, results)."""
    results: dict[int, list[int]] = {}

    def one(i, ids):
        results[i] = greedy(engine, ids)

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(ps)]
    for t in threads:
        t.start()
    return threads, results


def test_malformed_sampling_params_raise_naming_the_field_while_others_finish(engine):
    ps = prompts(4)
    refs = [greedy(engine, p) for p in ps]
    threads, results = run_in_background(engine, ps)
    bad = [
        ("skip_special_tokens", "no"),
        ("skip_special_tokens", 1),
        ("skip_special_tokens", None),
        ("skip_special_tokens", "false"),
        ("ignore_eos", "no"),
        ("temperature", float("inf")),
        ("temperature", 1e6),
        ("stop", ["x"] * 10_000),
        ("max_new_tokens", True),
        ("top_k", 2.0),
    ]
    for field, value in bad:
        with pytest.raises(InvalidArgument) as exc:
            engine.generate(input_ids=[5, 6, 7], sampling_params={field: value})
        assert exc.value.field == field
    with pytest.raises(InvalidArgument) as exc:
        engine.generate(input_ids=[[5, True]])
    assert exc.value.field == "input_ids"
    with pytest.raises(InvalidArgument) as exc:
        engine.generate(input_ids=[5], stream="no")
    assert exc.value.field == "stream"
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(len(ps))] == refs
    assert engine.failure is None


def test_a_raising_detokenizer_fails_only_its_request(engine, monkeypatch):
    ps = prompts(3)
    refs = [greedy(engine, p) for p in ps]
    checker = engine.core.stop_checker
    real = checker.append_tokens

    def append_tokens(req, tokens, **kwargs):
        if req.rid == "bad" and len(req.output_ids) >= 3:
            raise TypeError("decode() got an unexpected value")
        return real(req, tokens, **kwargs)

    monkeypatch.setattr(checker, "append_tokens", append_tokens)
    threads, results = run_in_background(engine, ps)
    sp = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    out = engine.generate(input_ids=[9, 8, 7], sampling_params=sp, rid="bad")
    for t in threads:
        t.join(timeout=60)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "TypeError" in reason["message"]
    assert len(out["output_ids"]) < 200
    assert [results[i] for i in range(len(ps))] == refs
    assert engine.failure is None
    assert engine.stats()["kv_used_tokens"] == 0 and not engine.core.requests


def test_a_raising_output_callback_fails_only_its_request(engine):
    ps = prompts(3)
    refs = [greedy(engine, p) for p in ps]
    seen: list[dict] = []
    done = threading.Event()

    def callback(out):
        seen.append(out)
        if out["finished"]:
            done.set()
        if len(seen) == 2:
            raise RuntimeError("consumer bug")

    threads, results = run_in_background(engine, ps)
    sp = {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}
    engine.submit([4, 4, 4], sp, callback)
    assert done.wait(30)
    for t in threads:
        t.join(timeout=60)
    last = seen[-1]["meta_info"]["finish_reason"]
    assert last["type"] == "abort" and "consumer bug" in last["message"]
    assert seen[-1]["meta_info"]["completion_tokens"] < 500
    assert [results[i] for i in range(len(ps))] == refs
    assert engine.failure is None


@pytest.mark.parametrize("stream", [False, True])
def test_an_output_that_cannot_be_built_ends_its_request_with_the_reason(
    engine, monkeypatch, stream
):
    """Building a request's last output raising (e.g. its tokenizer failing on the ids at
    the end) must not leave its caller waiting forever; the others finish as before."""
    from specserve.runtime import output

    ps = prompts(3)
    refs = [greedy(engine, p) for p in ps]
    real = output.request_output

    def request_output(req, *args, **kwargs):
        if req.rid == "bad" and req.finished:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(req, *args, **kwargs)

    monkeypatch.setattr(output, "request_output", request_output)
    threads, results = run_in_background(engine, ps)
    got: list[dict] = []
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

    def bad():
        got.extend(
            engine.generate(input_ids=[9, 8, 7], sampling_params=sp, rid="bad", stream=True)
            if stream
            else [engine.generate(input_ids=[9, 8, 7], sampling_params=sp, rid="bad")]
        )

    waiter = threading.Thread(target=bad, daemon=True)
    waiter.start()
    waiter.join(timeout=60)
    assert not waiter.is_alive(), "the caller was left waiting"
    last = got[-1]
    assert last["finished"]
    reason = last["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "UnicodeDecodeError" in reason["message"]
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(len(ps))] == refs
    assert engine.failure is None
    assert engine.stats()["kv_used_tokens"] == 0 and not engine.core.requests


def test_a_failing_device_step_fails_everything_and_says_why():
    with Engine(**TINY) as e:
        assert greedy(e, [3, 4, 5], 4)

        def broken(*a, **k):
            raise RuntimeError("device lost")

        e.core.worker.launch_decode = broken
        out = e.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 8})
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "device lost" in reason["message"]
        assert "device lost" in e.failure


def test_engine_stream_never_shows_part_of_a_stop_string(tmp_path):
    """The engine's stream (which the server relays) holds back text that could begin a
    stop string: the streamed text is exactly the output cut before the stop string."""
    from tests.model_factory import write_hf_model

    # vocab 101: every id decodes to text with the test tokenizer
    folder = write_hf_model(tmp_path / "m", vocab_size=101, with_tokenizer=True, seed=3)
    with Engine(model_path=folder, dtype="float32", device="cpu") as e:
        sp = {"temperature": 0.8, "seed": 2, "max_new_tokens": 40, "ignore_eos": True}
        full = e.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)["text"]
        assert len(full) > 20
        checked = 0
        for start, length in ((6, 3), (10, 5), (15, 4), (3, 8)):
            stop = full[start : start + length]
            if not stop.strip() or full.find(stop) < 2:
                continue
            cut = full[: full.find(stop)]
            chunks = [
                o["text"]
                for o in e.generate(
                    input_ids=[5, 6, 7, 8], sampling_params={**sp, "stop": stop}, stream=True
                )
            ]
            assert "".join(chunks) == cut, (stop, chunks)
            checked += 1
        assert checked >= 2


def test_text_decoded_once_at_the_end_equals_the_streamed_text(tmp_path):
    """`generate` without streaming decodes the text once the request finishes, streaming
    decodes it token by token: both give the same text, and a stop string still cuts the
    non-streamed text where the stream ends."""
    from tests.model_factory import write_hf_model

    folder = write_hf_model(tmp_path / "m", vocab_size=101, with_tokenizer=True, seed=3)
    cut_by_stop = 0
    with Engine(model_path=folder, dtype="float32", device="cpu") as e:
        for seed in range(4):
            sp = {"temperature": 0.9, "seed": seed, "max_new_tokens": 30, "ignore_eos": True}
            whole = e.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)
            chunks = list(e.generate(input_ids=[5, 6, 7, 8], sampling_params=sp, stream=True))
            assert len(whole["text"]) > 10
            assert whole["text"] == "".join(c["text"] for c in chunks)
            assert whole["output_ids"] == [t for c in chunks for t in c["output_ids"]]
            stop = whole["text"][8:11]
            if stop.strip() and whole["text"].find(stop) >= 2:
                cut = e.generate(input_ids=[5, 6, 7, 8], sampling_params={**sp, "stop": stop})
                assert cut["text"] == whole["text"][: whole["text"].find(stop)]
                cut_by_stop += 1
    assert cut_by_stop >= 2


@pytest.mark.parametrize("rid", [["a"], {"a": 1}, 5, b"a"])
def test_a_request_id_that_is_not_a_string_is_refused_and_the_loop_lives(engine, rid):
    """A low-level submission or an abort naming a request by something other than a string
    is refused in the caller's thread (an unhashable id once raised on the engine's loop,
    which died and left every request after it waiting forever)."""
    ps = prompts(2)
    refs = [greedy(engine, p) for p in ps]
    threads, results = run_in_background(engine, ps)
    for submit in (engine.submit, engine.submit_samples):
        with pytest.raises(InvalidArgument) as exc:
            submit([5, 6, 7], {"max_new_tokens": 2}, lambda *a: None, rid=rid)
        assert exc.value.field == "rid"
    with pytest.raises(InvalidArgument) as exc:
        engine.make_samples([5, 6, 7], {"max_new_tokens": 2}, rid)
    assert exc.value.field == "rid"
    with pytest.raises(InvalidArgument) as exc:
        engine.abort(rid)
    assert exc.value.field == "rid"
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(len(ps))] == refs
    assert greedy(engine, ps[0]) == refs[0]
    assert engine._thread.is_alive() and engine.failure is None


@pytest.mark.parametrize(
    "args, field",
    [
        (dict(sampling_params=[{}, {"temperature": -1}]), "sampling_params[1].temperature"),
        (
            dict(sampling_params=[{}, {"stop_token_ids": [10**6]}]),
            "sampling_params[1].stop_token_ids",
        ),
        (dict(sampling_params=[5, {}]), "sampling_params[0]"),
        (dict(input_ids=[[5, 6], [5, 10**6]]), "input_ids[1]"),
        (dict(sampling_params={"stop_token_ids": [10**6]}), "stop_token_ids"),  # (one for all)
    ],
)
def test_a_batch_entry_at_fault_is_named_by_its_index(engine, args, field):
    """A batch's bad entry is named as /generate names it: which prompt, which parameter."""
    args = {"input_ids": [[5, 6], [5, 7]], **args}
    with pytest.raises(InvalidArgument) as exc:
        engine.generate(**args)
    assert exc.value.field == field and str(exc.value).startswith(field + ": ")
    assert engine._thread.is_alive() and engine.failure is None


@pytest.mark.parametrize("ids", [[5, True], [5, 6.0], "abc", {5: 6}, (i for i in [5, 6])])
def test_a_low_level_prompt_that_is_not_token_ids_is_refused_naming_input_ids(engine, ids):
    """submit / make_samples take the prompt's ids as they are: the same rule as generate's
    input_ids (a bool is no token id; a string, dict or generator is no list of them)."""
    with pytest.raises(InvalidArgument) as exc:
        engine.make_samples(ids, {"max_new_tokens": 2})
    assert exc.value.field == "input_ids"
    with pytest.raises(InvalidArgument) as exc:
        engine.submit(ids, {"max_new_tokens": 2}, lambda out: None)
    assert exc.value.field == "input_ids"
    assert engine._thread.is_alive() and engine.failure is None
