"""One request can never hurt another: malformed, oversized, slow or unauthenticated requests
get a 4xx in the API's JSON error shape while well-formed requests around them complete, and
/health stays responsive. A tiny random model with a real tokenizer, served in this process.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time

import httpx
import pytest

from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from tests.test_server import Served, ServerThread

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tests.model_factory import write_hf_model

    # vocab 101: every id decodes to text with the test tokenizer
    folder = write_hf_model(tmp_path_factory.mktemp("m"), vocab_size=101, with_tokenizer=True)
    with Engine(model_path=folder, dtype="float32", device="cpu", context_length=128) as e:
        yield e


@pytest.fixture(scope="module")
def hard(engine):
    app = create_app(engine, ServerConfig(max_queued_requests=256), owns_engine=False)
    with ServerThread(app) as srv:
        served = Served(engine, srv, "m")
        yield served
        served.http.close()


@pytest.fixture(scope="module")
def strict(engine):
    """The same engine behind an API key, a 4 KiB body limit and a 1 s body deadline."""
    cfg = ServerConfig(api_key="sekret", max_request_bytes=4096, request_body_timeout=1.0)
    with ServerThread(create_app(engine, cfg, owns_engine=False)) as srv:
        yield srv


def error_of(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


# ---- a flood of malformed requests beside well-formed ones ------------------------------------
BASE = {
    "/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/generate": {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}},
}
NESTED = {"a": [{"b": [[{"c": None}]]}]}
BOOL = ["no", "false", 1, 0, None, 1.5, [], NESTED]
OPENAI_BOOL = [v for v in BOOL if v is not None]  # null is the default on the OpenAI routes
COUNT = [True, "10", 2.5, -5, 2**70, [], NESTED, "1e309", "NaN"]  # strings in RAW are raw JSON
# (negative seeds are taken, as vLLM takes them: only outside int64)
SEED_REFUSED = [v for v in COUNT if v != -5] + [-(2**63) - 1]
NUMBER = ["hot", True, 1e6, -1, [], NESTED, "1e309", "-1e309", "NaN", "Infinity", 10**400]
RAW = {"1e309", "-1e309", "NaN", "Infinity"}
STOP = [5, [1], [""], ["a"] * 17, "x" * 1025, ["s"] * 10_000, NESTED, True]
IDS = [[-1], "1", [True], [1.5], NESTED, 7]
OPENAI_FIELDS = {
    "max_tokens": COUNT,
    "temperature": [*NUMBER, 2.5],
    "top_p": [*NUMBER, 0, 1.5],
    "top_k": [*COUNT, -2],
    "min_p": [*NUMBER, 1.5],
    "stop": STOP,
    "seed": [*SEED_REFUSED],
    "n": [0, 65, "1", True, 2.5],
    "stream": OPENAI_BOOL,
    "stream_options": [True, "x", {"include_usage": "yes"}],
    "ignore_eos": OPENAI_BOOL,
    "stop_token_ids": IDS,
    "skip_special_tokens": OPENAI_BOOL,
    "return_token_ids": OPENAI_BOOL,
    "logprobs": [6, "x", -1],
    "presence_penalty": [2.5, -3, "x", "NaN", True],
    "frequency_penalty": [2.5, "0.5", False, 10**400],
    "repetition_penalty": [0, -1, 2.5, "x", 10**400],
    "logit_bias": [
        [1],
        "x",
        {"x": 1},
        {"-1": 1},
        {"1": 101},
        {"1": "a"},
        {"1": True},
        {"10000000": 1},
        {"1": 10**400},
        {"9" * 5000: 1},
    ],
    "model": [5, "gpt-17", NESTED],
}
BAD: list[tuple[str, str, object]] = []  # (route, field, value)
for _route in ("/v1/completions", "/v1/chat/completions"):
    BAD += [(_route, f, v) for f, vs in OPENAI_FIELDS.items() for v in vs]
BAD += [
    ("/v1/completions", "prompt", v) for v in [5, [], [1, True], [[]], NESTED, None, [1, 10**6]]
]
BAD += [("/v1/completions", "prompt", "a" * (2 * MIB))]  # cannot fit the context
BAD += [
    ("/v1/chat/completions", "messages", v)
    for v in ["hi", [], [{"role": "x", "content": "a"}], [{"role": "user", "content": 5}], None]
]
BAD += [("/v1/chat/completions", "max_completion_tokens", v) for v in [0, True, "3"]]
BAD += [("/generate", "input_ids", v) for v in ["abc", [True], [[1], ["a"]], [-1], [10**9], NESTED]]
BAD += [("/generate", "text", v) for v in [5, [], [1], NESTED]]
BAD += [("/generate", "rid", v) for v in [5, True, [], NESTED]]
BAD += [("/generate", "stream", v) for v in BOOL]
BAD += [("/generate", "return_logprob", v) for v in [1, "no", None]]
BAD += [("/generate", "top_logprobs_num", v) for v in [21, -1, True, "3", 1.0]]
BAD += [("/generate", "logprob_start_len", v) for v in [-2, "0", 1.5]]
BAD += [("/v1/chat/completions", "top_logprobs", v) for v in [21, -1, True, "3"]]
BAD += [("/generate", "sampling_params", v) for v in [[1], "x", 5, {"bogus": 1}]]
_NATIVE = {
    "temperature": [*NUMBER, None, 101],
    "top_p": [*NUMBER, None],
    "top_k": [*COUNT, None],
    "min_p": [*NUMBER, None],
    "max_new_tokens": [*COUNT, None],
    "stop": STOP,
    "stop_token_ids": IDS,
    "ignore_eos": BOOL,
    "seed": [*SEED_REFUSED],
    "skip_special_tokens": BOOL,
    "n": [0, 65, True, None, 1.5],
    "frequency_penalty": [2.5, "0.5", 10**400],
    "repetition_penalty": [0, 10**400],
    "logit_bias": [{"x": 1}, {"1": 10**400}, {"9" * 5000: 1}, {"1": True}],
}
BAD += [("/generate", f"sampling_params.{f}", v) for f, vs in _NATIVE.items() for v in vs]


def bad_body(route: str, field: str, value) -> bytes:
    """BASE[route] with `field` (dotted: nested) set to `value` (raw JSON when in RAW)."""
    body = json.loads(json.dumps(BASE[route]))
    target, *rest = field.split(".")
    marker = "__RAW__"
    raw = isinstance(value, str) and value in RAW
    if rest:
        body.setdefault(target, {})[rest[0]] = marker if raw else value
    else:
        body[target] = marker if raw else value
    text = json.dumps(body)
    return text.replace(f'"{marker}"', value).encode() if raw else text.encode()


NOT_A_FIELD = [  # (route, body, content type, status)
    ("/v1/completions", b"{not json", "application/json", 400),
    ("/v1/completions", b"", "application/json", 400),
    ("/v1/completions", b"[1, 2, 3]", "application/json", 400),
    ("/generate", b'"just a string"', "application/json", 400),
    ("/generate", b"\xff\xfe\x00garbage", "application/json", 400),
    ("/generate", b"[" * 5000 + b"]" * 5000, "application/json", 400),
    ("/v1/chat/completions", json.dumps(BASE["/v1/chat/completions"]).encode(), "text/plain", 415),
    ("/generate", b"input_ids=1", "application/x-www-form-urlencoded", 415),
    ("/generate", json.dumps(BASE["/generate"]).encode(), None, 415),
    ("/generate", json.dumps(BASE["/generate"]).encode(), "application/json; charset=latin-1", 415),
    ("/v1/completions", b'{"prompt": "' + b"a" * (9 * MIB) + b'"}', "application/json", 413),
]


class GoodTraffic:
    """Well-formed requests on every route, streamed and not, in a loop on a thread; each
    answer is compared with the one given before any malformed request was sent."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, timeout=60)
        self.requests = [
            ("/v1/completions", {**BASE["/v1/completions"], "temperature": 0, "max_tokens": 8}),
            ("/v1/chat/completions", {**BASE["/v1/chat/completions"], "temperature": 0}),
            ("/generate", {"input_ids": [9, 8, 7], "sampling_params": {"temperature": 0}}),
        ]
        self.expected = [self.one(path, body) for path, body in self.requests]
        self.done, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def one(self, path: str, body: dict) -> str:
        if body.get("stream"):
            text = []
            with self.http.stream("POST", path, json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        assert "error" not in event, event
                        text.append(_event_text(path, event))
            return "".join(text) if path != "/generate" else text[-1]
        r = self.http.post(path, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        if path == "/v1/completions":
            return out["choices"][0]["text"]
        if path == "/v1/chat/completions":
            return out["choices"][0]["message"]["content"]
        return out["text"]

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            k = i % len(self.requests)
            path, body = self.requests[k]
            stream = (i // len(self.requests)) % 2 == 1
            try:
                got = self.one(path, {**body, "stream": stream})
                if got != self.expected[k]:
                    self.failures.append((path, stream, got, self.expected[k]))
            except Exception as e:  # noqa: BLE001 - every failure is reported by the test
                self.failures.append((path, stream, repr(e)))
            self.done += 1
            i += 1

    def __enter__(self) -> GoodTraffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.http.close()


def _event_text(path: str, event: dict) -> str:
    if path == "/generate":
        return event["text"]  # cumulative
    choices = event.get("choices") or [{}]
    if path == "/v1/completions":
        return choices[0].get("text") or ""
    return (choices[0].get("delta") or {}).get("content") or ""


def test_malformed_flood_on_every_route_never_hurts_a_concurrent_request(hard):
    assert len(BAD) > 300
    before = hard.metrics()
    with GoodTraffic(hard.url) as good, httpx.Client(base_url=hard.url, timeout=60) as http:
        statuses = []
        for route, field, value in BAD:
            r = http.post(
                route,
                content=bad_body(route, field, value),
                headers={"content-type": "application/json"},
            )
            statuses.append(r.status_code)
            assert r.status_code in (400, 404), (route, field, value, r.status_code, r.text)
            err = error_of(r)
            assert err["param"] and err["param"].startswith(field.split(".")[0]), (field, err)
            assert err["message"].startswith(err["param"]), err
        for route, body, ctype, status in NOT_A_FIELD:
            headers = {"content-type": ctype} if ctype else {}
            r = http.post(route, content=body, headers=headers)
            statuses.append(r.status_code)
            assert r.status_code == status, (route, body[:40], r.status_code, r.text[:300])
            error_of(r)
        # On a fast machine the flood can end before the good loop has done a round on every
        # route; keep flooding (bounded) so well-formed answers are checked under the flood.
        deadline = time.monotonic() + 120
        for route, field, value in itertools.cycle(BAD):
            if good.done >= 2 * len(good.requests) or time.monotonic() > deadline:
                break
            r = http.post(
                route,
                content=bad_body(route, field, value),
                headers={"content-type": "application/json"},
            )
            statuses.append(r.status_code)
            assert r.status_code in (400, 404), (route, field, value, r.status_code, r.text)
        rounds = good.done
    assert not good.failures, good.failures[:3]
    assert rounds >= 2 * len(good.requests)
    assert all(400 <= s < 500 for s in statuses)
    after = hard.wait_idle()
    assert after["specserve_kv_used_tokens"] == 0 and after["specserve_num_inflight_requests"] == 0
    assert hard.engine.failure is None
    assert hard.http.get("/health").json()["status"] == "ok"
    rejected = sum(
        after.get(f'specserve_rejected_requests_total{{status="{s}"}}', 0)
        - before.get(f'specserve_rejected_requests_total{{status="{s}"}}', 0)
        for s in (400, 404, 413, 415)
    )
    assert rejected == len(statuses)  # each rejection counted once


# ---- bodies: size, speed, deadline ------------------------------------------------------------
class HealthProbe:
    """Polls /health from its own connection and records each latency."""

    def __init__(self, url: str):
        self.url, self.latencies = url, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self._stop.is_set():
                t = time.perf_counter()
                assert http.get("/health").status_code == 200
                self.latencies.append(time.perf_counter() - t)
                time.sleep(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_health_stays_fast_while_huge_bodies_arrive(hard, monkeypatch):
    """Bodies past the limit are refused as they arrive; one just under it is parsed on a
    worker thread. /health is polled throughout (loosely timed: on a loaded machine the GIL
    alone slows it; which thread parsed is what tells the loop was left free)."""
    from specserve.server import openai_api

    parsed_on = []
    parse = openai_api.parse

    def recorded(model, body):
        parsed_on.append((len(body), threading.current_thread()))
        return parse(model, body)

    monkeypatch.setattr(openai_api, "parse", recorded)
    with HealthProbe(hard.url) as probe, httpx.Client(base_url=hard.url, timeout=60) as http:
        t = time.perf_counter()
        r = http.post("/v1/chat/completions", content=b"x" * (20 * MIB), headers=JSON)
        assert r.status_code == 413 and "max-request-bytes" in error_of(r)["message"]

        def chunks():  # no Content-Length: the server counts what arrives
            for _ in range(20):
                yield b" " * MIB

        r = http.post("/generate", content=chunks(), headers=JSON)
        assert r.status_code == 413, r.text
        # a maximal accepted body: one chat message just under the limit
        msg = "word " * ((8 * MIB - 200) // 5)
        body = {"messages": [{"role": "user", "content": msg}], "max_tokens": 4}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and error_of(r)["param"] == "messages", r.text[:300]
        elapsed = time.perf_counter() - t
    size, thread = max(parsed_on, key=lambda p: p[0])
    assert size > 8 * MIB - 1000 and thread is not hard.loop_thread, "parsed on the event loop"
    assert probe.latencies and max(probe.latencies) < 2.0, (max(probe.latencies), elapsed)


JSON = {"content-type": "application/json"}


def test_a_stalled_body_gets_408_at_the_deadline(strict):
    port = strict.port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        head = (
            "POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
            "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
        )
        s.sendall(head.encode() + b'{"input_ids": [')
        t = time.monotonic()
        s.settimeout(0.25)
        answer = b""
        while time.monotonic() - t < 5 and b"\r\n\r\n" not in answer:
            try:  # a byte now and then does not extend the deadline
                s.sendall(b"1")
                answer += s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
        waited = time.monotonic() - t
        s.settimeout(2)
        head_end = answer.find(b"\r\n\r\n")
        length = int(answer.split(b"content-length: ")[1].split(b"\r\n")[0]) if head_end > 0 else 0
        while head_end > 0 and len(answer) < head_end + 4 + length:  # the body may come later
            more = s.recv(65536)
            if not more:
                break
            answer += more
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 0.8 < waited < 3.0
    assert b'"request_timeout"' in answer or b"request_timeout" in answer


def test_api_key_is_required_on_every_route_but_health(strict):
    with httpx.Client(base_url=strict.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        for method, path in [
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("GET", "/get_model_info"),
            ("GET", "/openapi.json"),
            ("POST", "/generate"),
            ("POST", "/v1/completions"),
        ]:
            for auth in (None, "Bearer wrong", "sekret", "Basic sekret"):
                headers = {**JSON, **({"authorization": auth} if auth else {})}
                r = http.request(method, path, headers=headers, content=b"{}")
                assert r.status_code == 401, (method, path, auth)
                assert error_of(r)["type"] == "authentication_error"
        ok = {"authorization": "Bearer sekret"}
        assert http.get("/v1/models", headers=ok).status_code == 200
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        assert http.post("/generate", json=body, headers=ok).status_code == 200
        # the small limit of this app: 413 once the body is over 4 KiB
        r = http.post("/generate", json={"text": "a" * 5000}, headers=ok)
        assert r.status_code == 413


def test_json_content_type_with_charset_is_accepted(hard):
    body = json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = hard.http.post("/generate", content=body, headers={"content-type": ctype})
        assert r.status_code == 200, (ctype, r.text)


# ---- engine-detected errors, names, stop strings ----------------------------------------------
def test_engine_detected_400_is_counted_once_and_duplicate_rid_names_rid(hard, engine):
    before = hard.metrics()
    r = hard.http.post("/generate", json={"input_ids": [5, 500]})  # outside the vocabulary
    assert r.status_code == 400 and error_of(r)["param"] == "input_ids"
    after = hard.metrics()
    key = 'specserve_rejected_requests_total{status="400"}'
    assert after[key] - before.get(key, 0) == 1

    sp = {"max_new_tokens": 120, "ignore_eos": True}
    first = {"input_ids": [5, 6], "rid": "taken", "stream": True, "sampling_params": sp}
    with httpx.Client(base_url=hard.url, timeout=30) as http:
        with http.stream("POST", "/generate", json=first) as resp:
            lines = resp.iter_lines()
            next(lines)  # admitted
            r = hard.http.post("/generate", json={"input_ids": [5, 6], "rid": "taken"})
            assert r.status_code == 400 and error_of(r)["param"] == "rid", r.text
            assert "taken" in error_of(r)["message"]
    hard.wait_idle()


def test_tiny_temperature_answers_greedily(hard):
    greedy = hard.http.post(
        "/generate", json={"input_ids": [7, 8], "sampling_params": {"temperature": 0}}
    ).json()["output_ids"]
    for t in (1e-39, 1e-30, 1e-8):
        sp = {"temperature": t}
        r = hard.http.post("/generate", json={"input_ids": [7, 8], "sampling_params": sp})
        assert r.status_code == 200 and r.json()["output_ids"] == greedy, t


def test_stream_never_shows_part_of_a_stop_string(hard):
    sp = {"temperature": 0.8, "seed": 4, "max_new_tokens": 40, "ignore_eos": True}
    full = hard.http.post("/generate", json={"text": "the quick", "sampling_params": sp})
    full = full.json()["text"]
    checked = 0
    for start, length in ((6, 3), (11, 5), (16, 4)):
        stop = full[start : start + length]
        if not stop.strip() or full.find(stop) < 2:
            continue
        body = {"prompt": "the quick", "max_tokens": 40, "stop": [stop], "stream": True}
        body.update(temperature=0.8, seed=4, ignore_eos=True)
        text = []
        with hard.http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text.append(_event_text("/v1/completions", json.loads(line[6:])))
        assert "".join(text) == full[: full.find(stop)], (stop, text)
        checked += 1
    assert checked >= 2


# ---- the published schema --------------------------------------------------------------------
def test_openapi_describes_every_body_and_response(hard):
    spec = hard.http.get("/openapi.json").json()
    comps = spec["components"]["schemas"]
    for path, model in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/generate", "GenerateRequest"),
    ]:
        op = spec["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model)
        assert op["responses"]["200"]["content"]["application/json"]["schema"]
        assert op["responses"]["400"]["content"]["application/json"]["schema"]
    assert {"temperature", "max_tokens", "stop", "prompt"} <= set(
        comps["CompletionRequest"]["properties"]
    )
    assert "NativeSamplingParams" in comps and "ChatMessage" in comps
    # the bounds the routes enforce: a completion may score (0 tokens), a chat answers
    for model, least in (("CompletionRequest", 0), ("ChatCompletionRequest", 1)):
        assert comps[model]["properties"]["max_tokens"]["minimum"] == least, model
        body = {"max_tokens": least - 1}
        body |= {"prompt": [5]} if least == 0 else {"messages": [{"role": "user", "content": "a"}]}
        route = "/v1/completions" if least == 0 else "/v1/chat/completions"
        assert error_of(hard.http.post(route, json=body))["param"] == "max_tokens"
    for path in ("/v1/models", "/health", "/get_model_info"):
        assert spec["paths"][path]["get"]["responses"]["200"]["content"]


def test_schema_fuzz_no_5xx_no_hang(hard):
    """A few hundred requests generated from /openapi.json (valid and invalid by the schema):
    no 5xx, none hangs, and a well-formed request sent meanwhile completes."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode

    spec = hard.http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.update(base_url=hard.url)
    cases = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE)
    )
    seen: list[int] = []

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def fuzz(case):
        t = time.perf_counter()
        response = case.call(base_url=hard.url, timeout=20)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)
        assert time.perf_counter() - t < 20
        seen.append(response.status_code)

    with GoodTraffic(hard.url) as good:
        fuzz()
    assert not good.failures, good.failures[:3]
    assert good.done >= 1
    assert len(seen) >= 150
    assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen)
    assert hard.engine.failure is None


def slow_grammar_compiles(engine, monkeypatch, seconds: float) -> None:
    """Make every grammar compile of `engine` take `seconds` longer (as a large schema does)."""
    core = engine.core
    compile_text = core.compile_grammar_text

    def slow_compile(field, text):
        time.sleep(seconds)
        return compile_text(field, text)

    monkeypatch.setattr(core, "compile_grammar_text", slow_compile)


# ---- slow grammar compiles do not hold up other clients --------------------------------------
def test_slow_grammar_compiles_do_not_stall_other_clients_prompts(hard, monkeypatch):
    """Structured-output grammars compile on a pool of their own: two requests whose schemas
    take seconds to compile leave a plain chat request's tokenizing free (they shared the
    tokenizing pool's two threads, and the chat waited for both compiles)."""
    slow_grammar_compiles(hard.engine, monkeypatch, 2.5)
    results = {}

    def constrained(i: int) -> None:
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
        r = hard.http.post(
            "/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 3, "json_schema": schema},
        )
        results[i] = r.status_code

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # (both compiles under way)
    start = time.perf_counter()
    r = hard.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    )
    waited = time.perf_counter() - start
    for t in threads:
        t.join()
    assert r.status_code == 200, r.text
    assert waited < 2.0, f"a plain chat waited {waited:.1f} s behind grammar compiles"
    assert results == {0: 200, 1: 200}


def test_one_clients_slow_grammars_leave_other_clients_grammars_free(hard, monkeypatch):
    """A grammar that compiles for seconds (a 50,000-way regex took 10 s) holds up only its own
    request: while as many of them compile as the grammar pool has workers, a request whose
    grammar is compiled already is built at once; with one compiling, another client's new
    grammar compiles beside it (one worker made both wait)."""
    import specserve.server.state as state_module

    core = hard.engine.core
    compile_text = core.compile_grammar_text

    def slow_for_some(field, text):
        if "slow" in text:
            time.sleep(3.0)
        return compile_text(field, text)

    monkeypatch.setattr(core, "compile_grammar_text", slow_for_some)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    compiled = {**chat, "response_format": {"type": "json_object"}}
    assert hard.http.post("/v1/chat/completions", json=compiled).status_code == 200

    def timed(body: dict) -> float:
        start = time.perf_counter()
        r = hard.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return time.perf_counter() - start

    def slow_requests(count: int) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=timed, args=({**chat, "regex": f"slow{i}[ab]"},))
            for i in range(count)
        ]
        for t in threads:
            t.start()
        time.sleep(0.5)  # (their compiles under way)
        return threads

    threads = slow_requests(state_module.GRAMMAR_WORKERS)
    waited = timed(compiled)
    for t in threads:
        t.join()
    assert waited < 2.0, f"a compiled grammar waited {waited:.1f} s behind others' compiles"

    threads = slow_requests(1)
    waited = timed({**chat, "regex": "[cd]+"})
    for t in threads:
        t.join()
    assert waited < 2.0, f"a new grammar waited {waited:.1f} s behind another's compile"


def test_large_prompts_tokenize_beside_other_clients_prompts(hard, monkeypatch):
    """Texts past LARGE_TEXT_CHARS tokenize on a pool of their own: two slow ones leave a
    short prompt's tokenizing free (on the shared pool of two threads, a one-word prompt
    waited 9 s behind two 2 MB ones)."""
    import specserve.server.state as state_module

    monkeypatch.setattr(state_module, "LARGE_TEXT_CHARS", 500)
    tokenizer = hard.engine.tokenizer
    encode = tokenizer.encode

    def slow_for_large(text, *args, **kwargs):
        if len(text) > 500:
            time.sleep(2.5)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_for_large)
    results = {}

    def large(i: int) -> None:
        r = hard.http.post("/v1/completions", json={"prompt": "a b " * 150, "max_tokens": 1})
        results[i] = r.status_code

    threads = [threading.Thread(target=large, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # (the first large prompt tokenizing, the second waiting for it)
    start = time.perf_counter()
    r = hard.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    waited = time.perf_counter() - start
    for t in threads:
        t.join()
    assert r.status_code == 200, r.text
    assert waited < 2.0, f"a short prompt waited {waited:.1f} s behind large ones"
    assert set(results) == {0, 1} and all(code in (200, 400) for code in results.values())


def test_a_grammar_compile_holds_its_place_in_the_queue(engine, monkeypatch):
    """A request whose grammar is compiling counts against max_queued_requests: compiles
    cannot pile up past the bound (the one over it gets a 503)."""
    slow_grammar_compiles(engine, monkeypatch, 2.0)
    app = create_app(engine, ServerConfig(max_queued_requests=1), owns_engine=False)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        statuses = []

        def constrained(i: int) -> None:
            schema = {"type": "object", "properties": {f"q{i}": {"type": "string"}}}
            body = {"prompt": [5, 6], "max_tokens": 2, "json_schema": schema}
            statuses.append(http.post("/v1/completions", json=body).status_code)

        first = threading.Thread(target=constrained, args=(0,))
        first.start()
        time.sleep(0.5)  # (its compile under way)
        constrained(1)
        first.join()
        assert sorted(statuses) == [200, 503]


def test_a_generate_batch_compiling_its_grammar_holds_a_place_per_prompt(engine, monkeypatch):
    slow_grammar_compiles(engine, monkeypatch, 2.0)
    app = create_app(engine, ServerConfig(max_queued_requests=4), owns_engine=False)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        statuses = {}
        schema = {"type": "object", "properties": {"b": {"type": "integer"}}}
        batch = {
            "input_ids": [[5, 6], [7, 8], [9, 10], [11, 12]],
            "sampling_params": {"max_new_tokens": 2, "json_schema": schema},
        }
        first = threading.Thread(
            target=lambda: statuses.update(batch=http.post("/generate", json=batch).status_code)
        )
        first.start()
        state = app.state.server
        deadline = time.monotonic() + 30
        while state.inflight < 4:  # (its compile under way, holding 4 places)
            assert time.monotonic() < deadline, "the batch never took its places"
            time.sleep(0.01)
        one = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "regex": "[ab]+"}}
        statuses["one"] = http.post("/generate", json=one).status_code
        first.join()
        assert statuses == {"batch": 200, "one": 503}
