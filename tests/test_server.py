"""The HTTP server, end to end: a real uvicorn server on 127.0.0.1, driven by the official
`openai` client and by httpx.

Most tests use the tiny random-weight model without tokenizer (token-id prompts); the chat
tests use the real default model (marked slow). One server per module per model.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig

TINY = dict(model_path="tiny", load_format="dummy", skip_tokenizer_init=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` from a background thread of this process."""

    def __init__(self, app):
        self.app = app
        # (bound here and handed to uvicorn: a port found free and closed again could be taken
        # by another test process before uvicorn bound it)
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            assert self.thread.is_alive(), "server thread died"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()


class Served:
    def __init__(self, engine, srv: ServerThread, model: str):
        self.engine = engine
        self.url = srv.url
        self.model = model
        self.loop_thread = srv.thread  # (the server's event loop runs there)
        self.client = openai.OpenAI(
            base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        self.http = httpx.Client(base_url=srv.url, timeout=60)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60
        )

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{label="v"}': value}."""
        r = self.http.get("/metrics")
        assert r.status_code == 200
        out = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """The metrics once nothing runs, waits or holds KV (a failure after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = {
                k: m[k]
                for k in (
                    "specserve_num_running_requests",
                    "specserve_num_queued_requests",
                    "specserve_num_inflight_requests",
                    "specserve_kv_used_tokens",
                )
                if m[k]
            }
            if not busy:
                return m
            assert time.monotonic() < deadline, f"not idle after {timeout} s: {busy}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def tiny_engine():
    engine = Engine(**TINY)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tiny(tiny_engine):
    app = create_app(tiny_engine, ServerConfig(max_queued_requests=64), owns_engine=False)
    with ServerThread(app) as srv:
        served = Served(tiny_engine, srv, "tiny")
        yield served
        served.http.close()


def greedy_ref(engine, ids: list[int], n: int, **extra) -> list[int]:
    sp = {"temperature": 0.0, "max_new_tokens": n, **extra}
    return engine.generate(input_ids=ids, sampling_params=sp)["output_ids"]


def prompt_ids(i: int, length: int = 8) -> list[int]:
    return [(7 * i + 3 * j + 1) % 500 + 3 for j in range(length + i % 5)]


# ---- basics -----------------------------------------------------------------------------------
def test_health_and_models(tiny):
    r = tiny.http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = tiny.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert tiny.client.models.retrieve("tiny").id == "tiny"


def test_completion_greedy_matches_engine(tiny):
    ids = prompt_ids(1)
    ref = greedy_ref(tiny.engine, ids, 16)
    out = tiny.client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0)
    choice = out.choices[0]
    assert choice.token_ids == ref
    assert choice.finish_reason == ("length" if len(ref) == 16 else "stop")
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(ref)
    assert out.usage.total_tokens == len(ids) + len(ref)


def test_completion_stream_matches_engine(tiny):
    ids = prompt_ids(2)
    ref = greedy_ref(tiny.engine, ids, 20)
    stream = tiny.client.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    got, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for c in chunk.choices:
            got.extend(c.token_ids)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert got == ref
    assert reasons == ["length" if len(ref) == 20 else "stop"]
    assert usage.completion_tokens == len(ref) and usage.prompt_tokens == len(ids)


def test_completion_batch_of_prompts(tiny):
    prompts = [prompt_ids(3), prompt_ids(4)]
    refs = [greedy_ref(tiny.engine, p, 10) for p in prompts]
    out = tiny.client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.token_ids for c in out.choices] == refs
    assert out.usage.completion_tokens == sum(map(len, refs))


def test_sampling_params_pass_through(tiny):
    """Seeded sampling with top_k/top_p/min_p is reproducible and equals the engine's."""
    ids = prompt_ids(5)
    sp = dict(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12)
    a = tiny.client.completions.create(
        model="tiny", prompt=ids, extra_body={"top_k": 50, "min_p": 0.01}, **sp
    )
    b = tiny.client.completions.create(
        model="tiny", prompt=ids, extra_body={"top_k": 50, "min_p": 0.01}, **sp
    )
    ref = tiny.engine.generate(
        input_ids=ids,
        sampling_params={
            "temperature": 0.8,
            "top_p": 0.9,
            "top_k": 50,
            "min_p": 0.01,
            "seed": 1234,
            "max_new_tokens": 12,
        },
    )["output_ids"]
    assert a.choices[0].token_ids == b.choices[0].token_ids == ref


def test_default_max_tokens_and_ignore_eos(tiny):
    out = tiny.client.completions.create(
        model="tiny", prompt=prompt_ids(6), extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 128  # the server's default max_tokens
    assert out.choices[0].finish_reason == "length"


def test_stop_token_ids(tiny):
    ids = prompt_ids(7)
    ref = greedy_ref(tiny.engine, ids, 12, ignore_eos=True)
    stop_at = ref[5]
    out = tiny.client.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [stop_at], "ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.token_ids == ref[: ref.index(stop_at) + 1]


# ---- SGLang's /generate -----------------------------------------------------------------------
def test_generate_native(tiny):
    ids = prompt_ids(8)
    ref = greedy_ref(tiny.engine, ids, 10)
    sp = {"temperature": 0, "max_new_tokens": 10}
    r = tiny.http.post("/generate", json={"input_ids": ids, "sampling_params": sp})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == ref
    assert body["meta_info"]["completion_tokens"] == len(ref)
    assert body["meta_info"]["finish_reason"]["type"] in ("length", "stop")

    # batch
    r = tiny.http.post("/generate", json={"input_ids": [ids, prompt_ids(9)], "sampling_params": sp})
    assert r.status_code == 200
    outs = r.json()
    assert len(outs) == 2 and outs[0]["output_ids"] == ref
    assert outs[1]["output_ids"] == greedy_ref(tiny.engine, prompt_ids(9), 10)

    # streaming: each event carries the ids so far
    events = []
    with tiny.http.stream(
        "POST", "/generate", json={"input_ids": ids, "sampling_params": sp, "stream": True}
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[-1]["output_ids"] == ref
    assert all(
        a["output_ids"] == b["output_ids"][: len(a["output_ids"])]
        for a, b in zip(payloads, payloads[1:])
    )


# ---- concurrency ------------------------------------------------------------------------------
def test_16_concurrent_clients(tiny):
    n = 16
    prompts = [prompt_ids(20 + i) for i in range(n)]
    max_tokens = [8 + (i % 4) * 4 for i in range(n)]
    refs = [greedy_ref(tiny.engine, p, m) for p, m in zip(prompts, max_tokens)]

    async def one(client, i):
        if i % 2:
            stream = await client.completions.create(
                model="tiny",
                prompt=prompts[i],
                max_tokens=max_tokens[i],
                temperature=0,
                stream=True,
            )
            ids = []
            async for chunk in stream:
                for c in chunk.choices:
                    ids.extend(c.token_ids)
            return ids
        out = await client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=max_tokens[i], temperature=0
        )
        return out.choices[0].token_ids

    async def main():
        clients = [tiny.aclient() for _ in range(n)]  # 16 separate clients (connections)
        try:
            return await asyncio.gather(*(one(c, i) for i, c in enumerate(clients)))
        finally:
            for c in clients:
                await c.close()

    before = tiny.metrics()
    got = asyncio.run(main())
    assert got == refs
    after = tiny.wait_idle()
    finished = sum(
        after[f'specserve_requests_total{{finish_reason="{k}"}}']
        - before[f'specserve_requests_total{{finish_reason="{k}"}}']
        for k in ("stop", "length")
    )
    assert finished == n
    assert after["specserve_kv_used_tokens"] == 0
    assert after["specserve_graph_captures_total"] == 0  # (eager on the CPU)
    assert after["specserve_graph_captures_idle_total"] == 0
    assert after["specserve_graph_shapes_without_memory"] == 0


# ---- validation -------------------------------------------------------------------------------
LONG = [5] * 3000  # longer than the tiny model's context (2048)

INVALID = [
    # (path, raw body or JSON-able, expected param)
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"", None),
    ("/v1/completions", [1, 2, 3], None),
    ("/v1/completions", "just a string", None),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, True, 3]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -4]}, "prompt"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": "text needs a tokenizer"}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 2000, "max_tokens": 100}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": [1, 2], "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": [1, 2], "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": [1, 2], "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": [1, 2], "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": [1, 2], "n": 0}, "n"),
    ("/v1/completions", {"prompt": [1, 2], "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"prompt": [1, 2], "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "stop": "x"}, "stop"),  # no tokenizer
    ("/v1/completions", {"prompt": [1, 2], "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2], "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2], "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [1, 2], "stream_options": {"include_usage": True}}, None),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 6}, "logprobs"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    ("/v1/completions", {"prompt": [1, 2], "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": [1, 2], "logit_bias": {"1000000": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        "max_tokens",
    ),
    ("/generate", {}, "text"),
    ("/generate", {"text": "a", "input_ids": [1]}, "text"),
    ("/generate", {"input_ids": "abc"}, "input_ids"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": [1]}, "sampling_params"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"foo": 1}}, "sampling_params.foo"),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
        "sampling_params.temperature",
    ),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}},
        "sampling_params.max_new_tokens",
    ),
    ("/generate", {"input_ids": [[1, 2], [3]], "stream": True}, "stream"),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"seed": 2**64}},
        "sampling_params.seed",
    ),
    ("/v1/completions", {"prompt": [1, 2], "top_k": 2**70}, "top_k"),
    ("/v1/completions", {"prompt": [1, 2], "seed": 2**64}, "seed"),
    ("/v1/completions", b'{"prompt": [1, 2], "temperature": NaN}', None),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 10**30}, "max_tokens"),
    ("/generate", {"input_ids": LONG}, "input_ids"),
]


def _post(http: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def test_invalid_requests_get_400_naming_the_field(tiny):
    assert len(INVALID) >= 15
    for path, body, param in INVALID:
        r = _post(tiny.http, path, body)
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] is None
        assert err["message"]
        if param is None:
            assert err["param"] is None or isinstance(err["param"], str)
        else:
            assert err["param"] is not None and err["param"].startswith(param), (body, err)
            assert err["param"] in err["message"], err
    # The openai client sees them as BadRequestError.
    with pytest.raises(openai.BadRequestError) as exc:
        tiny.client.completions.create(model="tiny", prompt=[1, 2], temperature=-1)
    assert exc.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        tiny.client.completions.create(model="tiny", prompt=[1, 2], n=65)
    # Unknown model: 404, unknown route: 404, both OpenAI-shaped.
    with pytest.raises(openai.NotFoundError):
        tiny.client.completions.create(model="gpt-17", prompt=[1, 2])
    r = tiny.http.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    # Still serving, nothing leaked.
    ids = prompt_ids(11)
    out = tiny.client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert out.choices[0].token_ids == greedy_ref(tiny.engine, ids, 5)
    m = tiny.wait_idle()
    assert m["specserve_num_inflight_requests"] == 0
    assert m['specserve_rejected_requests_total{status="400"}'] >= len(INVALID)


# ---- disconnects, limits, metrics -------------------------------------------------------------
LONG_STREAM = {
    "model": "tiny",
    "prompt": [3, 4, 5, 6],
    "max_tokens": 2000,
    "temperature": 0.7,
    "ignore_eos": True,
    "stream": True,
}


def test_client_disconnect_mid_stream_frees_kv(tiny_engine, tiny):
    before = tiny.wait_idle()
    # Pace the engine (20 ms a step: 2000 tokens take 10 s or more, even with drafts
    # accepted), so a client slowed down by a loaded machine still reads its 5 events while
    # the request is running; the test itself waits only for those 5 steps.
    pace = lambda core: time.sleep(0.02)  # noqa: E731
    tiny_engine.step_hooks.append(pace)
    try:
        with httpx.Client(base_url=tiny.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=LONG_STREAM) as resp:
                assert resp.status_code == 200
                n = 0
                lines = resp.iter_lines()  # (kept: a dropped iterator closes the connection)
                for line in lines:
                    n += line.startswith("data: ")
                    if n >= 5:
                        break
                busy = tiny.metrics()
                assert busy["specserve_num_running_requests"] == 1
                assert busy["specserve_kv_used_tokens"] > 0
            # leaving the blocks closes the connection mid-stream
        after = tiny.wait_idle()
    finally:
        tiny_engine.step_hooks.remove(pace)
    assert after["specserve_num_running_requests"] == 0
    assert after["specserve_kv_used_tokens"] == 0
    assert after["specserve_num_inflight_requests"] == 0
    aborted = 'specserve_requests_total{finish_reason="abort"}'
    assert after[aborted] == before[aborted] + 1
    # generated far fewer than the 2000 tokens asked for
    gen = after["specserve_generation_tokens_total"] - before["specserve_generation_tokens_total"]
    assert gen < 2000


def test_client_disconnect_non_streaming_frees_kv(tiny):
    before = tiny.wait_idle()
    body = {**LONG_STREAM, "stream": False}
    with httpx.Client(base_url=tiny.url, timeout=httpx.Timeout(30, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body)
    after = tiny.wait_idle()
    assert after["specserve_kv_used_tokens"] == 0
    assert after["specserve_num_running_requests"] == 0
    aborted = 'specserve_requests_total{finish_reason="abort"}'
    assert after[aborted] == before[aborted] + 1


def test_queue_full_gets_503(tiny_engine, tiny):
    app = create_app(tiny_engine, ServerConfig(max_queued_requests=1), owns_engine=False)
    tiny.wait_idle()
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=LONG_STREAM) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # keep a reference: a dropped iterator closes the stream
            next(lines)  # admitted and running
            r = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 503
            err = r.json()["error"]
            assert "max_queued_requests" in err["message"]
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.InternalServerError) as exc:
                client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2)
            assert exc.value.status_code == 503
        # the long request was aborted by the disconnect; the slot frees up
        deadline = time.monotonic() + 15
        while True:
            r = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text
    tiny.wait_idle()


def test_metrics_prometheus_format_and_counts(tiny):
    r = tiny.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    for name in (
        "specserve_requests",
        "specserve_prompt_tokens",
        "specserve_generation_tokens",
        "specserve_time_to_first_token_seconds",
        "specserve_e2e_request_latency_seconds",
        "specserve_num_running_requests",
        "specserve_num_queued_requests",
        "specserve_kv_usage",
        "specserve_kv_used_tokens",
        "specserve_spec_accept_length",
    ):
        assert name in names, name
    before = tiny.wait_idle()
    ids = prompt_ids(12)
    outs = [
        tiny.client.completions.create(model="tiny", prompt=ids, max_tokens=7, temperature=0)
        for _ in range(3)
    ]
    after = tiny.wait_idle()

    def delta(key):
        return after[key] - before.get(key, 0.0)

    done = sum(
        delta(f'specserve_requests_total{{finish_reason="{k}"}}') for k in ("stop", "length")
    )
    assert done == 3
    assert delta("specserve_prompt_tokens_total") == 3 * len(ids)
    gen = sum(o.usage.completion_tokens for o in outs)
    assert delta("specserve_generation_tokens_total") == gen
    assert delta("specserve_time_to_first_token_seconds_count") == 3
    assert delta("specserve_e2e_request_latency_seconds_count") == 3
    assert after["specserve_kv_total_tokens"] == tiny.engine.stats()["kv_total_tokens"]
    assert 0.0 <= after["specserve_kv_usage"] <= 1.0


# ---- speculative decoding stats and the serving benchmark --------------------------------------
@pytest.fixture(scope="module")
def spec_tiny():
    engine = Engine(
        **TINY,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="tiny",
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
    )
    app = create_app(engine, ServerConfig(), owns_engine=True)
    with ServerThread(app) as srv:
        served = Served(engine, srv, "tiny")
        yield served
        served.http.close()
    engine.shutdown()


def bench_args(url: str, *argv: str):
    import argparse

    from specserve.bench.serving import add_serving_parser

    parser = argparse.ArgumentParser()
    add_serving_parser(parser.add_subparsers())
    args = parser.parse_args(["serving", "--base-url", url, "--quiet", *argv])
    return args


def test_speculative_stats_in_usage_and_metrics(spec_tiny):
    ids = prompt_ids(13)
    out = spec_tiny.client.completions.create(
        model="tiny", prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    usage = out.usage.model_dump()
    assert usage["spec_verify_ct"] >= 1
    # tokens per verify step: the 11 after the prefill's first came from verify steps (the
    # last step may have emitted more than max_tokens kept)
    emitted = usage["spec_accept_length"] * usage["spec_verify_ct"]
    assert round(emitted) >= 11 and usage["spec_accept_length"] >= 1.0
    m = spec_tiny.wait_idle()
    assert m["specserve_spec_verify_steps_total"] >= usage["spec_verify_ct"]
    assert 1.0 <= m["specserve_spec_accept_length"] <= 3.0


def test_bench_serving_against_the_server(spec_tiny, tmp_path):
    from specserve.bench.serving import cmd_serving, format_table, run_benchmark

    args = bench_args(
        spec_tiny.url,
        *("--dataset", "random", "--endpoint", "completions", "--num-prompts", "8"),
        *("--request-rate", "40", "--input-len", "16", "--output-len", "8", "--ignore-eos"),
    )
    args.base_url = spec_tiny.url
    summary, results = asyncio.run(run_benchmark(args))
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 64
    assert summary["total_input_tokens"] == 8 * 16
    for key in ("ttft", "itl", "tpot", "e2e_latency"):
        for stat in ("mean", "p50", "p90", "p99"):
            assert summary[f"{stat}_{key}_ms"] > 0
    assert summary["p50_ttft_ms"] <= summary["p99_ttft_ms"]
    assert summary["request_throughput_req_s"] > 0
    assert summary["output_token_throughput_tok_s"] > 0
    assert summary["spec_accept_length_source"] == "metrics"
    assert 1.0 <= summary["spec_accept_length"] <= 3.0
    assert "p99_itl_ms" in format_table(summary)

    # fixed concurrency through /generate, via the CLI entry point, with JSON and plot files
    plot, out_json = tmp_path / "serving.png", tmp_path / "serving.json"
    args = bench_args(
        spec_tiny.url,
        *("--dataset", "random", "--endpoint", "generate", "--num-prompts", "6"),
        *("--max-concurrency", "2", "--output-len", "6", "--range-ratio", "0.5"),
        *("--plot", str(plot), "--output-json", str(out_json)),
    )
    assert cmd_serving(args) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(out_json.read_text())
    assert saved["summary"]["completed"] == 6 and len(saved["requests"]) == 6
    assert all(3 <= r["output_tokens"] <= 6 for r in saved["requests"])


def test_bench_prompt_set():
    from specserve.bench.serving import load_prompt_file

    prompts = load_prompt_file(None)
    assert 90 <= len(prompts) <= 120 and len(set(prompts)) == len(prompts)
    assert all(0 < len(p) < 200 for p in prompts)


# ---- process-level: CLI + SIGTERM -------------------------------------------------------------
def test_cli_serve_sigterm_aborts_in_flight_and_exits_cleanly():
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port)]
    cmd += ["--model-path", "tiny", "--load-format", "dummy", "--skip-tokenizer-init"]
    cmd += ["--graceful-shutdown-timeout", "1", "--served-model-name", "tiny-served"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-served"
        events: list[str] = []
        with httpx.Client(base_url=url, timeout=30) as http:
            body = {**LONG_STREAM, "model": "tiny-served"}
            with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        output = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, output
    assert "server stopped" in output
    # The in-flight stream ended properly: an error event (aborted at shutdown), then [DONE].
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert "shutting down" in last["error"]["message"]
    assert len(events) < 2000


def test_cli_rejects_bad_server_flag():
    r = subprocess.run(
        [sys.executable, "-m", "specserve.cli", "serve", "--max-queued-requests", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert r.returncode == 2 and "max_queued_requests" in r.stderr


# ---- the real model: chat (slow) --------------------------------------------------------------
@pytest.fixture(scope="module")
def real():
    engine = Engine()
    app = create_app(engine, ServerConfig(), owns_engine=True)
    with ServerThread(app) as srv:
        served = Served(engine, srv, str(engine.config.model_path))
        yield served
        served.http.close()
    engine.shutdown()


MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.mark.slow
def test_chat_greedy_matches_engine(real):
    ids = real.engine.tokenize_chat(MESSAGES)
    ref = real.engine.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 12}
    )
    out = real.client.chat.completions.create(
        model=real.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref["text"]
    assert choice.token_ids == ref["output_ids"]
    assert out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(ref["output_ids"])

    # streamed: same text, role first, finish reason last, usage at the end
    stream = real.client.chat.completions.create(
        model=real.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ref["output_ids"])


@pytest.mark.slow
def test_text_completion_and_stop_string(real):
    prompt = "The capital of France is"
    ref = real.engine.generate(
        prompt=prompt, sampling_params={"temperature": 0, "max_new_tokens": 10}
    )
    out = real.client.completions.create(
        model=real.model, prompt=prompt, max_tokens=10, temperature=0
    )
    assert out.choices[0].text == ref["text"]
    words = ref["text"].split()
    assert len(words) >= 2
    stop = words[1]
    out = real.client.completions.create(
        model=real.model, prompt=prompt, max_tokens=10, temperature=0, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == ref["text"][: ref["text"].index(stop)]
    # A stop string spanning tokens (part of it would be streamed before it matches): the
    # text still ends right before it, streamed or not.
    text = ref["text"]
    boundary = len(real.engine.tokenizer.decode(ref["output_ids"][:1]))
    assert 3 <= boundary <= len(text) - 2
    stop = text[boundary - 2 : boundary + 2]
    expected = text[: text.index(stop)]
    out = real.client.completions.create(
        model=real.model, prompt=prompt, max_tokens=10, temperature=0, stop=stop
    )
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    stream = real.client.completions.create(
        model=real.model, prompt=prompt, max_tokens=10, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected
    # stream of a text prompt gives the same text
    stream = real.client.completions.create(
        model=real.model, prompt=prompt, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref["text"]


@pytest.mark.slow
def test_chat_16_concurrent_clients(real):
    n = 16
    convs = [
        [{"role": "user", "content": f"Give me a word that rhymes with {w}."}]
        for w in (
            "cat dog sun tree blue red car book star moon fish cake rain hill ball ring".split()
        )
    ]
    ids = [real.engine.tokenize_chat(m) for m in convs]
    refs = real.engine.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 6}
    )

    async def one(client, i):
        if i % 2:
            stream = await client.chat.completions.create(
                model=real.model, messages=convs[i], max_tokens=6, temperature=0, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        out = await client.chat.completions.create(
            model=real.model, messages=convs[i], max_tokens=6, temperature=0
        )
        return out.choices[0].message.content

    async def main():
        clients = [real.aclient() for _ in range(n)]
        try:
            return await asyncio.gather(*(one(c, i) for i, c in enumerate(clients)))
        finally:
            for c in clients:
                await c.close()

    got = asyncio.run(main())
    assert got == [r["text"] for r in refs]
    m = real.wait_idle()
    assert m["specserve_kv_used_tokens"] == 0


@pytest.mark.slow
def test_chat_validation_with_real_model(real):
    r = real.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x" * 5}], "max_tokens": 10**6},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = real.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "word " * 9000}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = real.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    out = real.client.chat.completions.create(
        model=real.model,
        messages=[
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        max_tokens=3,
    )
    assert out.choices[0].finish_reason in ("stop", "length")
