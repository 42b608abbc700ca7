"""Clients that send what a server must survive without letting it reach anyone else: requests
that are costly to admit, odd but valid values, refusals that must name their field. A tiny
random model with a real tokenizer, served in this process on the CPU.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from tests.test_server import ServerThread


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tests.model_factory import write_hf_model

    folder = write_hf_model(tmp_path_factory.mktemp("m"), vocab_size=101, with_tokenizer=True)
    with Engine(model_path=folder, dtype="float32", device="cpu", context_length=512) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, ServerConfig(), owns_engine=False)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def error_of(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while "specserve_num_inflight_requests 0.0" not in http.get("/metrics").text:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)


def record_threads(monkeypatch, owner, name: str) -> list[threading.Thread]:
    """The thread each call of owner.name runs on, appended as it is called."""
    threads = []
    original = getattr(owner, name)

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return threads


def health_while(server, http, path: str, body: dict) -> tuple[httpx.Response, float]:
    """(the answer to body, the slowest /health answered while it was served)"""
    result = {}

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            result["r"] = client.post(path, json=body)

    sender = threading.Thread(target=send)
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        start = time.perf_counter()
        assert http.get("/health").status_code == 200
        slowest = max(slowest, time.perf_counter() - start)
        time.sleep(0.05)
    sender.join()
    return result["r"], slowest


# ---- admitting a request runs off the event loop when it is costly ----------------------------
def test_a_batch_sharing_a_large_schema_leaves_health_responsive(server, http, monkeypatch):
    """Each prompt of a batch is validated with its structured output; a large schema shared
    by many prompts took that work per prompt on the event loop every client shares (a 3 MB
    schema on 2,000 one-token prompts held /health for a minute). It is built on a worker
    thread (a time limit on /health alone would also measure the GIL on a loaded machine)."""
    from specserve.server.state import ServerState

    built_on = record_threads(monkeypatch, ServerState, "_make")
    schema = {"type": "string", "description": "x" * 1_000_000}
    body = {"prompt": [[5]] * 500, "max_tokens": 1, "json_schema": schema}
    r, slowest = health_while(server, http, "/v1/completions", body)
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"]) == 500
    assert built_on and server.thread not in built_on, "admitted on the event loop's thread"
    assert slowest < 10.0, f"/health took {slowest:.1f} s while the batch was admitted"
    wait_idle(http)


def test_a_large_answer_with_log_probs_is_assembled_off_the_event_loop(server, http, monkeypatch):
    """64 choices of 400 tokens with 20 alternatives each: assembling and encoding that
    answer on the event loop held it, and /health, for 3 s or more (of 200 tokens: 1.4-2.1
    s). It is built on a worker thread (and encoded a choice at a time, which
    `test_a_large_answer_is_encoded_a_choice_at_a_time` checks; a time limit on /health
    cannot tell the two apart on a loaded machine, where the GIL alone slows it)."""
    from specserve.server import openai_api

    built_on = []
    build_json = openai_api._json_bytes

    def recorded(build):
        body = build_json(build)
        built_on.append((len(body), threading.current_thread()))
        return body

    monkeypatch.setattr(openai_api, "_json_bytes", recorded)
    body = {**CHAT, "max_tokens": 400, "n": 64, "ignore_eos": True}
    r, _ = health_while(
        server, http, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 20}
    )
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert len(choices) == 64
    assert all(len(c["logprobs"]["content"]) == 400 for c in choices)
    assert all(len(e["top_logprobs"]) == 20 for e in choices[5]["logprobs"]["content"])
    size, thread = max(built_on, key=lambda b: b[0])
    assert size == len(r.content)
    assert thread is not server.thread, "the answer was built on the event loop's thread"
    wait_idle(http)


def test_an_answer_encoded_a_choice_at_a_time_is_the_json_of_the_whole():
    """What lets other requests run while a large answer is encoded: the same bytes as one
    call of the encoder, NaN still refused."""
    import json
    import math

    from specserve.server.openai_api import json_in_parts

    answers = [
        {"id": "c", "choices": [{"index": 0, "text": 'é😀\n"', "logprobs": None}], "usage": {}},
        [{"text": "a", "meta_info": {"id": "1", "output_token_logprobs": [[-0.5, 3, None]]}}],
        {"choices": [], "nested": {"deep": [[1, 2], {"k": [True, None]}]}, 3: "int key"},
        [],
        {},
        "plain",
        -1.5e-300,
    ]
    for answer in answers:
        whole = json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        assert json_in_parts(answer) == whole
    with pytest.raises(ValueError):
        json_in_parts({"choices": [{"logprob": math.nan}]})


def test_a_large_answer_is_encoded_a_choice_at_a_time(monkeypatch):
    """No call of the encoder (which holds the GIL, and so the event loop, throughout) takes
    more than one choice of a 64-choice answer; token ids are not encoded one by one."""
    from specserve.server import openai_api

    calls = []
    encode = openai_api._json

    def recorded(content):
        calls.append(encode(content))
        return calls[-1]

    monkeypatch.setattr(openai_api, "_json", recorded)
    entry = {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "b", "logprob": -1.0}]}
    choice = {"index": 0, "logprobs": {"content": [entry] * 50}, "ids": list(range(300))}
    openai_api.json_in_parts({"id": "c", "choices": [choice] * 64, "usage": {}})
    assert max(len(c) for c in calls) == len(encode(choice)) and len(calls) < 80
    calls.clear()
    openai_api.json_in_parts({"text": "x", "output_ids": list(range(1000))})
    assert len(calls) < 10


def test_a_batch_of_many_token_ids_is_checked_and_echoed_off_the_event_loop(
    server, http, monkeypatch
):
    """2,000 prompts of 500 token ids, echoed: checking every id and decoding the prompts for
    the echo held the event loop, and /health, for half a second (0.7 s on an idle machine;
    off it, a loaded 2-core machine running the suite in parallel still delayed /health
    0.28 s, so the threads they ran on are what is checked)."""
    from specserve.server import openai_api
    from specserve.server.state import ServerState

    checked_on = record_threads(monkeypatch, ServerState, "_make")
    echoed_on = record_threads(monkeypatch, openai_api, "_echo_text")
    prompts = [[(7 * i + j) % 90 + 5 for j in range(500)] for i in range(2000)]
    body = {"prompt": prompts, "max_tokens": 0, "echo": True}
    r, _ = health_while(server, http, "/v1/completions", body)
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert len(choices) == 2000 and all(c["text"] for c in choices)
    assert checked_on and server.thread not in checked_on, "ids checked on the event loop"
    assert len(echoed_on) == 2000 and server.thread not in echoed_on, "echo decoded on the loop"


# ---- refusals name the field the client wrote -------------------------------------------------
@pytest.mark.parametrize("name", ["self", "tokenize"])
def test_a_template_variable_that_is_an_argument_of_the_template_call_names_its_field(http, name):
    """`self` reached apply_chat_template as a keyword (a TypeError there), refused as a
    fault of `messages`."""
    r = http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {name: True}})
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == "chat_template_kwargs", r.text
    assert err["message"].startswith(f"chat_template_kwargs: {name}: not a template variable")


@pytest.mark.parametrize("name", ["min_tokens", "min_new_tokens"])
@pytest.mark.parametrize(
    "beside",
    [
        {"response_format": {"type": "json_object"}},  # (a grammar could complete first)
        {"allowed_token_ids": [2], "stop_token_ids": [2]},  # (no token could be drawn)
    ],
)
def test_min_tokens_refused_by_the_engine_names_the_field_as_written(http, name, beside):
    """The engine calls it min_new_tokens; a client that wrote vLLM's min_tokens was told of
    a field it never sent."""
    body = {"prompt": [5, 6], "max_tokens": 5, name: 3, **beside}
    r = http.post("/v1/completions", json=body)
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == name, r.text
    assert err["message"].startswith(f"{name}: "), err


def _rejected(http: httpx.Client, status: int) -> float:
    key = f'specserve_rejected_requests_total{{status="{status}"}}'
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(key):
            return float(line.split()[-1])
    return 0.0


def test_an_unknown_route_or_method_is_a_json_error_counted_as_rejected(http):
    before = {s: _rejected(http, s) for s in (404, 405)}
    r = http.get("/v1/nope")
    assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"
    r = http.put("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 405 and "PUT /v1/completions" in error_of(r)["message"]
    assert _rejected(http, 404) == before[404] + 1
    assert _rejected(http, 405) == before[405] + 1


def test_a_body_nested_too_deeply_is_refused_saying_so(http):
    deep = "[" * 300 + "]" * 300
    r = http.post(
        "/v1/completions",
        content='{"prompt": "x", "max_tokens": 1, "metadata": ' + deep + "}",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    message = error_of(r)["message"]
    assert "200 levels deep" in message and "not valid JSON" not in message, message
