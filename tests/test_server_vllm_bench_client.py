"""specserve's server as `vllm bench serve` (vLLM 0.26) sees it.

The bodies are those of its `openai` backend (/v1/completions) and `openai-chat` backend
(/v1/chat/completions), as vLLM's vllm/benchmarks/lib/endpoint_request_func.py builds them;
the stream is read as that client reads it (re-implemented here): each network piece is
stripped of surrounding whitespace, events are split on blank lines (or taken whole when a
piece ends in one complete `data:` event), the first event with non-empty `choices` is the
first token (TTFT), each later one an inter-token gap, and the token count is the
`completion_tokens` of the final usage event (it never counts tokens itself when usage is
there). TPOT = (latency - TTFT) / (tokens - 1).

A tiny random model with a real byte-level BPE tokenizer and ChatML template, on a real
uvicorn server.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import pytest

from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.logprobs import TokenStrings
from specserve.server.openai_api import _chat_chunks
from specserve.server.openai_protocol import ChatCompletionRequest
from specserve.server.protocol import parse
from specserve.server.server_config import ServerConfig
from tests.model_factory import write_hf_model
from tests.test_server import ServerThread

MODEL = "m"
# Greedy output of this prompt holds several tokens whose text is an incomplete UTF-8
# character (byte-level BPE on a random model), and its 4th token is made the EOS below.
PROMPT = "the quick brown fox jumps"
EOS_AT = 3
HEADERS = {"x-request-id": "bench-0123abcd-0"}  # the client names every request


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = write_hf_model(
        tmp_path_factory.mktemp("vllm_bench") / "m", vocab_size=320, with_tokenizer=True, seed=11
    )
    make_eos_early(folder)
    engine = Engine(model_path=folder, dtype="float32", device="cpu", max_total_tokens=4096)
    app = create_app(engine, ServerConfig(served_model_name=MODEL), owns_engine=True)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        yield engine, http


def make_eos_early(folder: str) -> None:
    """Declare as EOS the token greedy decoding of PROMPT emits at EOS_AT, so that ignore_eos
    decides the output length."""
    with Engine(model_path=folder, dtype="float32", device="cpu") as probe:
        sp = {"temperature": 0, "max_new_tokens": EOS_AT + 1, "ignore_eos": True}
        eos = probe.generate(prompt=PROMPT, sampling_params=sp)["output_ids"][EOS_AT]
    path = f"{folder}/config.json"
    with open(path) as f:
        config = json.load(f)
    config["eos_token_id"] = eos
    with open(path, "w") as f:
        json.dump(config, f)


# ---- what the client sends -------------------------------------------------------------------
def completions_body(prompt, output_len: int, ignore_eos: bool = True) -> dict:
    """`--backend openai`: sampling flags (`--temperature 0`) are merged in from extra_body."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "repetition_penalty": 1.0,
        "max_tokens": output_len,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def chat_body(prompt: str, output_len: int) -> dict:
    """`--backend openai-chat`: the prompt as one user message of text parts."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        "max_completion_tokens": output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }


# ---- how the client reads the stream ---------------------------------------------------------
@dataclass
class BenchRead:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    text: str = ""
    chunk_texts: list[str] = field(default_factory=list)  # choices[0]'s text per timed event
    output_tokens: int | None = None
    prompt_len: int | None = None

    @property
    def success(self) -> bool:
        return bool(self.chunk_texts)

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class EventSplitter:
    """Bytes as they arrive -> complete SSE events, the way the client cuts them."""

    def __init__(self):
        self.pending = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, piece: bytes) -> list[str]:
        self.pending += self.decoder.decode(piece.strip())
        *done, self.pending = self.pending.split("\n\n")
        events = [e.strip() for e in done if e.strip()]
        if self.pending.startswith("data: ") and self._whole(self.pending[6:].strip()):
            events.append(self.pending.strip())
            self.pending = ""
        return events

    @staticmethod
    def _whole(payload: str) -> bool:
        if payload == "[DONE]":
            return True
        try:
            json.loads(payload)
            return True
        except json.JSONDecodeError:
            return False


def chunk_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def read_like_vllm_bench(http: httpx.Client, path: str, body: dict) -> BenchRead:
    out, splitter = BenchRead(), EventSplitter()
    start = last = time.perf_counter()
    with http.stream("POST", path, json=body, headers=HEADERS) as r:
        assert r.status_code == 200, r.read()
        for piece in r.iter_raw():
            if not piece.strip():
                continue
            for event in splitter.feed(piece):
                if event.startswith(":"):
                    continue  # an SSE comment
                payload = event.removeprefix("data: ")
                if payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if data.get("choices"):
                    now = time.perf_counter()
                    if out.chunk_texts:
                        out.itl.append(now - last)
                    else:
                        out.ttft = now - start
                    last = now
                    out.chunk_texts.append(chunk_text(data["choices"][0]))
                    out.text += out.chunk_texts[-1]
                elif data.get("usage"):
                    out.output_tokens = data["usage"].get("completion_tokens")
                    out.prompt_len = data["usage"].get("prompt_tokens")
    out.latency = last - start
    return out


def greedy(engine, n: int, stream: bool = False, **sp):
    sp = {"temperature": 0, "max_new_tokens": n, **sp}
    return engine.generate(prompt=PROMPT, sampling_params=sp, stream=stream)


# ---- tests -----------------------------------------------------------------------------------
def test_models_route_names_the_model_the_client_then_sends(served):
    """Without --model the client takes data[0]['id'] (sent as `model`) and ['root']."""
    _, http = served
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["root"]


def test_completions_as_the_random_dataset_sends_them(served):
    engine, http = served
    got = read_like_vllm_bench(http, "/v1/completions", completions_body(PROMPT, 16))
    want = greedy(engine, 16, ignore_eos=True)
    assert got.success and got.ttft > 0
    assert got.chunk_texts[0] != ""  # the timed first chunk is the first token itself
    assert got.text == want["text"]
    assert got.output_tokens == 16  # ignore_eos: the whole length despite the early EOS
    assert got.prompt_len == len(engine.tokenizer.encode(PROMPT))
    assert got.tpot > 0


def test_without_ignore_eos_the_output_ends_at_eos(served):
    _, http = served
    got = read_like_vllm_bench(
        http, "/v1/completions", completions_body(PROMPT, 16, ignore_eos=False)
    )
    assert got.output_tokens == EOS_AT + 1


def test_every_token_step_is_a_chunk_even_when_its_text_is_held_back(served):
    """The client's TTFT and ITL come from chunk arrival: a step whose text is not yet
    printable (part of a UTF-8 character) must still be a chunk, as in vLLM's server."""
    engine, http = served
    steps = [o for o in greedy(engine, 24, ignore_eos=True, stream=True) if o["output_ids"]]
    assert any(o["text"] == "" for o in steps), "the workload must hold some text back"
    got = read_like_vllm_bench(http, "/v1/completions", completions_body(PROMPT, 24))
    token_chunks = got.chunk_texts[:-1]  # the last timed chunk carries finish_reason
    assert len(token_chunks) == len(steps) == got.output_tokens == 24
    assert len(got.itl) == len(got.chunk_texts) - 1


def test_token_id_prompts(served):
    """The timed_trace dataset sends token ids as the completions prompt."""
    engine, http = served
    ids = engine.tokenizer.encode(PROMPT)
    got = read_like_vllm_bench(http, "/v1/completions", completions_body(ids, 8))
    assert got.output_tokens == 8 and got.prompt_len == len(ids)
    assert got.text == greedy(engine, 8, ignore_eos=True)["text"]


def test_chat_as_the_custom_dataset_sends_it(served):
    engine, http = served
    got = read_like_vllm_bench(http, "/v1/chat/completions", chat_body(PROMPT, 12))
    ids = engine.tokenize_chat([{"role": "user", "content": PROMPT}])
    want = engine.generate(
        input_ids=ids,
        sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
    )
    assert got.success and got.ttft > 0
    assert got.output_tokens == 12 and got.prompt_len == len(ids)
    assert got.text == want["text"]
    assert got.chunk_texts[0] == ""  # the role chunk: timed, sent with the first token


def test_chat_role_chunk_waits_for_the_first_token():
    """Nothing is streamed before the engine has the first token: the role chunk the client
    times as TTFT goes out with it, not with the response headers."""

    async def scenario() -> list[dict]:
        first_token = asyncio.Event()

        async def events():
            await first_token.wait()
            yield 0, {"text": "Hi", "output_ids": [5], "meta_info": {}, "finished": False}
            meta = {"finish_reason": {"type": "length"}, "prompt_tokens": 3, "completion_tokens": 1}
            yield 0, {"text": "", "output_ids": [], "meta_info": meta, "finished": True}

        run = SimpleNamespace(events=events)
        state = SimpleNamespace(
            model_name=MODEL, tokenizer=None, token_strings=lambda: TokenStrings(None)
        )
        req = parse(ChatCompletionRequest, json.dumps(chat_body("x", 1)).encode())
        stream = _chat_chunks(run, req, state, "chatcmpl-1", 0, with_ids=False)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done(), "a chunk went out before the first token"
        first_token.set()
        chunks = [await first] + [c async for c in stream]
        return [json.loads(c[6:]) for c in chunks if c.startswith("data: {")]

    events = asyncio.run(scenario())
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hi"}, {}]
    assert events[-1]["usage"]["completion_tokens"] == 1
