"""Who gets in, under which id: a client's rid is free again as soon as its request finished
and names only that request (a disconnect never aborts another client's request that reuses
it); a request that could never fit (a batch over the admission limit, chat messages over
the context) is a 400 naming the field before anything is tokenized. A tiny random model
with a real tokenizer, served in this process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from specserve.server.state import ServerState
from tests.test_server import Served, ServerThread
from tests.test_server_hardening import error_of

CONTEXT = 128
LIMIT = 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tests.model_factory import write_hf_model

    folder = write_hf_model(tmp_path_factory.mktemp("m"), vocab_size=101, with_tokenizer=True)
    with Engine(model_path=folder, dtype="float32", device="cpu", context_length=CONTEXT) as e:
        yield e


@pytest.fixture(scope="module")
def served(engine):
    app = create_app(engine, ServerConfig(max_queued_requests=LIMIT), owns_engine=False)
    with ServerThread(app) as srv:
        s = Served(engine, srv, "m")
        yield s
        s.http.close()


LONG_CONTEXT = 8192  # (a request of thousands of tokens runs for seconds: no race to win)


@pytest.fixture(scope="module")
def long_served(tmp_path_factory):
    from tests.model_factory import write_hf_model

    folder = write_hf_model(
        tmp_path_factory.mktemp("long"),
        vocab_size=101,
        with_tokenizer=True,
        max_position_embeddings=LONG_CONTEXT,
    )
    with Engine(model_path=folder, dtype="float32", device="cpu", context_length=LONG_CONTEXT) as e:
        app = create_app(e, ServerConfig(), owns_engine=False)
        with ServerThread(app) as srv:
            s = Served(e, srv, "m")
            yield s
            s.http.close()


# ---- request ids ------------------------------------------------------------------------------
@contextmanager
def engine_slow_after_each_finish(engine):
    """After handing out a request's last output the engine's thread waits (up to 2 s) for
    the next submission, as a thread preempted there would: the finished request is still
    in the engine's tables while its client, answered, sends its next request."""
    deliver = engine._deliver

    def slow(req):
        deliver(req)
        if req.finished:
            deadline = time.monotonic() + 2
            while engine._inbox.empty() and time.monotonic() < deadline:
                time.sleep(0.001)

    engine._deliver = slow
    try:
        yield
    finally:
        del engine._deliver


@contextmanager
def background_traffic(url: str):
    """Long requests one after another: the engine keeps decoding a batch around the others."""
    stop = threading.Event()

    def run():
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        with httpx.Client(base_url=url, timeout=60) as http:
            while not stop.is_set():
                assert http.post("/generate", json=body).status_code == 200

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


def test_a_rid_is_free_again_as_soon_as_its_request_has_finished(served, engine):
    sp = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0}
    body = {"input_ids": [5, 6, 7], "rid": "again", "sampling_params": sp}
    with background_traffic(served.url), engine_slow_after_each_finish(engine):
        for _ in range(10):
            r = served.http.post("/generate", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["meta_info"]["id"] == "again"
            assert len(out["output_ids"]) == 3
    served.wait_idle()


def test_a_batch_names_each_prompt_with_a_list_of_rids_and_never_drops_one(served):
    sp = {"max_new_tokens": 2, "temperature": 0}
    batch = {"input_ids": [[5, 6], [7, 8]], "sampling_params": sp}
    r = served.http.post("/generate", json={**batch, "rid": ["first", "second"]})
    assert r.status_code == 200, r.text
    assert [out["meta_info"]["id"] for out in r.json()] == ["first", "second"]
    for rid in ("one-for-all", ["only-one"], ["same", "same"]):
        r = served.http.post("/generate", json={**batch, "rid": rid})
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == "rid", (rid, r.text)
    r = served.http.post("/generate", json={"input_ids": [5, 6], "rid": ["a", "b"]})
    assert r.status_code == 400 and error_of(r)["param"] == "rid", r.text


def test_a_rid_that_is_not_a_non_empty_string_gets_400_naming_rid(served):
    for rid in (5, "", [], ["a", ""], [1, 2], {"a": 1}, True):
        r = served.http.post("/generate", json={"input_ids": [5, 6], "rid": rid})
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == "rid", (rid, r.text)
        assert err["message"].startswith("rid: must be a non-empty string"), err


def test_a_rid_still_running_gets_400_naming_it(served):
    sp = {"max_new_tokens": 120, "ignore_eos": True}
    first = {"input_ids": [5, 6], "rid": "busy", "stream": True, "sampling_params": sp}
    with httpx.Client(base_url=served.url, timeout=30) as http:
        with http.stream("POST", "/generate", json=first) as resp:
            lines = resp.iter_lines()
            next(lines)  # admitted and running
            r = served.http.post("/generate", json={"input_ids": [5, 6], "rid": "busy"})
            err = error_of(r)
            assert r.status_code == 400 and err["param"] == "rid", r.text
            assert "'busy'" in err["message"] and "still running" in err["message"]
    served.wait_idle()


@pytest.mark.parametrize(
    "second",
    [{"rid": "many"}, {"rid": "many-1"}, {"rid": "many", "n": 2}, {"rid": "many-0", "n": 3}],
    ids=["its_rid", "a_sample_name", "its_rid_sampled", "a_sample_name_sampled"],
)
def test_a_sampled_prompt_still_running_holds_its_rid_and_its_samples_names(long_served, second):
    """A prompt sampled n times runs as rid-0 .. rid-(n-1), and the rid itself is taken too:
    a request reusing it would answer under the same id as the one running."""
    served = long_served
    sp = {"max_new_tokens": LONG_CONTEXT - 8, "ignore_eos": True, "n": 4}
    first = {"input_ids": [5, 6], "rid": "many", "stream": True, "sampling_params": sp}
    body = {"input_ids": [5, 6], "rid": second["rid"]}
    body["sampling_params"] = {"max_new_tokens": 1, "n": second.get("n", 1)}
    with httpx.Client(base_url=served.url, timeout=30) as http:
        with http.stream("POST", "/generate", json=first) as resp:
            lines = resp.iter_lines()  # (kept: a dropped iterator closes the connection)
            next(lines)  # admitted, and running for seconds yet
            r = served.http.post("/generate", json=body)
            assert r.status_code == 400 and error_of(r)["param"] == "rid", r.text
            assert "still running" in error_of(r)["message"]
    served.wait_idle()  # (closing the stream aborted the first)
    r = served.http.post("/generate", json=body)  # free once the first has finished
    assert r.status_code == 200, r.text


def test_a_disconnect_aborts_only_its_own_request_though_its_rid_was_reused(engine):
    """Client A's request finished, but A's handler has not read its outputs when client B
    starts a request under the same rid; then A disconnects, and its handler aborts what it
    has not seen finish. B's request must run to its end."""
    state = ServerState(engine, ServerConfig())

    async def scenario():
        short = {"max_new_tokens": 2, "temperature": 0}
        a = await state.start([[5, 6, 7]], [short], {}, rids=["shared"])
        deadline = time.monotonic() + 30
        while "shared" in state.active_rids:  # the engine finished A's request
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        long = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}
        b = await state.start([[5, 6, 7]], [long], {}, rids=["shared"])
        a.abort()  # A's client went away
        (out,) = await b.collect()
        return out

    try:
        out = asyncio.run(scenario())
    finally:
        state.pool.shutdown()
    assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
    assert len(out["output_ids"]) == 40
    assert out["meta_info"]["id"] == "shared"


# ---- too large to ever be served --------------------------------------------------------------
@pytest.fixture
def tokenized(engine, monkeypatch):
    """The sizes of what the server tokenizes: texts (characters) and chats (messages)."""
    seen = {"texts": [], "chats": []}
    encode, tokenize_chat = engine.tokenizer.encode, engine.tokenize_chat

    def spy_encode(text, *args, **kwargs):
        seen["texts"].append(len(text))
        return encode(text, *args, **kwargs)

    def spy_chat(messages):
        seen["chats"].append(len(messages))
        return tokenize_chat(messages)

    monkeypatch.setattr(engine.tokenizer, "encode", spy_encode)
    monkeypatch.setattr(engine, "tokenize_chat", spy_chat)
    return seen


def test_a_batch_larger_than_the_admission_limit_gets_400_before_tokenizing(served, tokenized):
    cases = [  # (route, body, param): every one more requests than max_queued_requests
        ("/v1/completions", {"prompt": ["hello"] * 300, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["hello"] * 5, "n": 64, "max_tokens": 1}, "n"),
        ("/v1/completions", {"prompt": [[5, 6]] * 300, "max_tokens": 1}, "prompt"),
        ("/generate", {"text": ["hello"] * 300}, "text"),
        (
            "/generate",
            {"input_ids": [[5, 6]] * 5, "sampling_params": {"n": 64}},
            "sampling_params.n",
        ),
    ]
    for route, body, param in cases:
        r = served.http.post(route, json=body)
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == param, (route, param, r.text)
        assert err["message"].startswith(param) and f"max_queued_requests={LIMIT}" in err["message"]
    assert tokenized["texts"] == []
    # each prompt's own n: the message counts the samples asked, not the largest n per prompt
    n = [64, 64, 64, 64, 20]  # (64: the most one prompt may ask for)
    body = {"input_ids": [[5, 6]] * len(n), "sampling_params": [{"n": k} for k in n]}
    err = error_of(served.http.post("/generate", json=body))
    assert err["param"] == "sampling_params[0].n", err
    assert f"add up to {sum(n)} requests" in err["message"], err
    assert f"at most {LIMIT}" in err["message"], err
    # n = 64 fits for one prompt (the most each prompt may ask for), and 5 prompts take n = 51
    r = served.http.post(
        "/v1/completions", json={"prompt": ["hello"] * 5, "n": 51, "max_tokens": 1}
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 5 * 51, r.text
    served.wait_idle()


def test_chat_messages_that_cannot_fit_are_rejected_before_tokenizing(served, tokenized):
    for count in (5_000, 200_000):
        body = {"messages": [{"role": "user", "content": ""}] * count, "max_tokens": 1}
        r = served.http.post("/v1/chat/completions", json=body)
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == "messages", r.text[:300]
        assert f"{count} messages" in err["message"] and str(CONTEXT) in err["message"]
    # measuring the template's cost of a message tokenizes a few; no request got there
    assert max(tokenized["chats"], default=0) <= 3, tokenized["chats"]


def test_the_cheap_chat_check_never_rejects_messages_that_fit(served, engine):
    """Up to the context and past it, with and without content: a chat is rejected exactly
    when its tokens do not leave room for max_tokens."""
    roles = ("user", "assistant")
    for content in ("", "hi", "the quick brown fox"):
        for count in range(1, 24):
            messages = [{"role": roles[i % 2], "content": content} for i in range(count)]
            fits = len(engine.tokenize_chat(messages)) + 1 <= CONTEXT
            body = {"messages": messages, "max_tokens": 1, "temperature": 0}
            r = served.http.post("/v1/chat/completions", json=body)
            assert r.status_code == (200 if fits else 400), (content, count, r.text[:300])
            if not fits:
                assert error_of(r)["param"] in ("messages", "max_tokens")
    served.wait_idle()


# ---- a bad request is a 400 whatever the load, and runs nothing --------------------------------
def test_a_bad_prompt_is_a_400_on_a_full_server_and_no_prompt_of_its_batch_runs(engine):
    app = create_app(engine, ServerConfig(max_queued_requests=8), owns_engine=False)
    bad_requests = [
        ("/v1/completions", {"prompt": [[5, 6], [1, 999]], "n": 4, "max_tokens": 2}, "prompt[1]"),
        ("/generate", {"input_ids": [[5, 6], [7, 500]]}, "input_ids[1]"),
        (
            "/generate",
            {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 5},
            "logprob_start_len",
        ),
        ("/generate", {"input_ids": [[5, 6], [7, 8]], "rid": ["dup", "dup"]}, "rid"),
    ]
    with ServerThread(app) as srv:
        served = Served(engine, srv, "m")
        before = served.metrics()
        for route, body, param in bad_requests:  # an idle server
            r = served.http.post(route, json=body)
            assert r.status_code == 400 and error_of(r)["param"] == param, (route, r.text)
        state = app.state.server
        state.reserve(8)  # the server is full (as with 8 requests in flight)
        try:
            for route, body, param in bad_requests:
                r = served.http.post(route, json=body)
                assert r.status_code == 400, (route, r.status_code, r.text)
                assert error_of(r)["param"] == param
            good = served.http.post("/generate", json={"input_ids": [5, 6]})
            assert good.status_code == 503  # a good request does wait for room
        finally:
            state.release(8)
        good = served.http.post("/generate", json={"input_ids": [5, 6]})
        assert good.status_code == 200, good.text
        after = served.wait_idle()
        served.http.close()
    # only the long request reached the engine: nothing of the rejected batches ran
    key = "specserve_prompt_tokens_total"
    assert after[key] - before[key] == 2
    aborted = 'specserve_requests_total{finish_reason="abort"}'
    assert after.get(aborted, 0) == before.get(aborted, 0)


def test_more_samples_in_one_request_than_the_server_takes_at_once_is_a_400(engine):
    app = create_app(engine, ServerConfig(max_samples_per_request=8), owns_engine=False)
    with ServerThread(app) as srv:
        served = Served(engine, srv, "m")
        r = served.http.post("/v1/completions", json={"prompt": [[5, 6]] * 3, "n": 3})
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == "n", r.text
        assert "max_samples_per_request=8" in err["message"]
        r = served.http.post("/generate", json={"input_ids": [[5, 6]] * 9})
        assert r.status_code == 400 and error_of(r)["param"] == "input_ids", r.text
        r = served.http.post("/v1/completions", json={"prompt": [[5, 6]] * 2, "n": 4})
        assert r.status_code == 200 and len(r.json()["choices"]) == 8, r.text
        served.http.close()


def test_max_tokens_past_what_the_kv_cache_holds_is_a_400_naming_the_room(tmp_path):
    from tests.model_factory import write_hf_model

    folder = write_hf_model(tmp_path / "m", vocab_size=101, with_tokenizer=True)
    with Engine(
        model_path=folder,
        dtype="float32",
        device="cpu",
        context_length=CONTEXT,
        max_total_tokens=48,
    ) as small:
        app = create_app(small, ServerConfig(), owns_engine=False)
        with ServerThread(app) as srv:
            served = Served(small, srv, "m")
            prompt = [5] * 10
            body = {"prompt": prompt, "max_tokens": 100, "ignore_eos": True}
            r = served.http.post("/v1/completions", json=body)
            err = error_of(r)
            assert r.status_code == 400 and err["param"] == "max_tokens", r.text
            assert "48" in err["message"] and "38" in err["message"]
            r = served.http.post("/v1/completions", json={**body, "max_tokens": 30})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 30
            # /generate: the same limit, under its own field's name
            native = {"input_ids": prompt, "sampling_params": {"ignore_eos": True}}
            native["sampling_params"]["max_new_tokens"] = 100
            r = served.http.post("/generate", json=native)
            err = error_of(r)
            assert r.status_code == 400, r.text
            assert err["param"] == "sampling_params.max_new_tokens" and "38" in err["message"]
            native["sampling_params"]["max_new_tokens"] = 30
            r = served.http.post("/generate", json=native)
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 30
            # a prompt the cache cannot hold is the prompt's fault, whatever max_tokens says
            for max_tokens in (None, 0, 1):
                body = {"prompt": [5] * 60}
                if max_tokens is not None:
                    body["max_tokens"] = max_tokens
                r = served.http.post("/v1/completions", json=body)
                err = error_of(r)
                assert r.status_code == 400 and err["param"] == "prompt", (max_tokens, r.text)
                assert "60 tokens" in err["message"], err
            native = {"input_ids": [5] * 60, "sampling_params": {"max_new_tokens": 0}}
            r = served.http.post("/generate", json=native)
            assert r.status_code == 400 and error_of(r)["param"] == "input_ids", r.text
            served.http.close()


def test_generate_max_new_tokens_past_the_context_is_a_400_and_its_default_stops_there(served):
    prompt = [5] * (CONTEXT - 10)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 11, "ignore_eos": True}}
    r = served.http.post("/generate", json=body)
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == "sampling_params.max_new_tokens", r.text
    assert "at most 10 can be generated" in err["message"]
    for sp in ({"max_new_tokens": 10, "ignore_eos": True}, {"ignore_eos": True}):  # (default 128)
        r = served.http.post("/generate", json={"input_ids": prompt, "sampling_params": sp})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 10


@pytest.mark.parametrize("page_size", [1, 4])
def test_what_the_server_admits_past_the_kv_room_of_a_speculative_step_completes(
    tmp_path, page_size
):
    """A request the server admits runs to its max_tokens, its last steps alone in the cache
    and plain where the tree's window does not fit: as many tokens as plain decoding gets
    from the cache; one token more is a 400 saying how many fit."""
    import re

    from specserve.model.hf_loader import load_hf_config
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
    from tests.engine_utils import spec_args
    from tests.model_factory import write_hf_model

    folder = write_hf_model(tmp_path / "m", vocab_size=101, with_tokenizer=True)
    draft = write_random_eagle_checkpoint(str(tmp_path / "d"), load_hf_config(folder), "EAGLE")
    with Engine(
        model_path=folder,
        dtype="float32",
        device="cpu",
        context_length=CONTEXT,
        max_total_tokens=64,
        page_size=page_size,
        **spec_args(draft, topk=4, steps=3, ndt=10),
    ) as small:
        app = create_app(small, ServerConfig(), owns_engine=False)
        with ServerThread(app) as srv:
            served = Served(small, srv, "m")
            body = {"prompt": [5] * 20, "max_tokens": 100, "ignore_eos": True}
            r = served.http.post("/v1/completions", json=body)
            assert r.status_code == 400 and error_of(r)["param"] == "max_tokens", r.text
            room = int(re.search(r"at most (\d+) can be generated", error_of(r)["message"])[1])
            assert room == 64 - 20  # (a plain engine's: the KV holds 64 positions)
            r = served.http.post("/v1/completions", json={**body, "max_tokens": room})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == room
            assert r.json()["choices"][0]["finish_reason"] == "length"
            r = served.http.post("/v1/completions", json={**body, "max_tokens": room + 1})
            assert r.status_code == 400 and error_of(r)["param"] == "max_tokens", r.text
            served.http.close()
