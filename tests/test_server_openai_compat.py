"""What OpenAI clients read: `usage` counts a prompt once whatever `n`, and every SSE event is
one line for any line-splitting client. A tiny random model with a real tokenizer, served in
this process.
"""

from __future__ import annotations

import json

import pytest

from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.state import ServerConfig
from tests.test_server import Served, ServerThread

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.model_factory import write_hf_model

    folder = write_hf_model(tmp_path_factory.mktemp("m"), vocab_size=101, with_tokenizer=True)
    with Engine(model_path=folder, dtype="float32", device="cpu", context_length=256) as engine:
        app = create_app(engine, ServerConfig(), owns_engine=False)
        with ServerThread(app) as srv:
            s = Served(engine, srv, "m")
            yield s
            s.http.close()


def events(served, route: str, body: dict) -> list[dict]:
    """The JSON events of a stream, each checked to be one `data:` line."""
    with served.http.stream("POST", route, json=body) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    out = []
    for line in raw.splitlines():  # splits at U+2028, U+2029, U+0085 too
        if not line:
            continue
        assert line.startswith("data: "), repr(line)
        if line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


# ---- usage ------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_usage_counts_each_prompt_and_its_cached_tokens_once_with_n_samples(served, route):
    if route == CHAT:
        base = {"messages": MESSAGES}
        prompt_tokens, prompts = len(served.engine.tokenize_chat(MESSAGES)), 1
    else:
        base = {"prompt": [list(range(10, 40)), list(range(50, 70))]}
        prompt_tokens, prompts = 30 + 20, 2
    base.update(max_tokens=3, n=4, ignore_eos=True)
    streamed = {**base, "stream": True, "stream_options": {"include_usage": True}}
    assert served.http.post("/flush_cache").status_code == 200
    usages = []
    for _ in range(2):  # the first time no prompt is cached, then each is
        usages.append(served.http.post(route, json=base).json()["usage"])
        usages.append(events(served, route, streamed)[-1]["usage"])
    for usage in usages:
        assert usage["prompt_tokens"] == prompt_tokens, usage
        assert usage["completion_tokens"] == 3 * 4 * prompts, usage
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < prompt_tokens, usage
    assert usages[-1]["prompt_tokens_details"]["cached_tokens"] > 0


# ---- streaming --------------------------------------------------------------------------------
def test_every_stream_event_is_one_line_whatever_the_text(served):
    prompt = "line\u2028separator\u2029paragraph\x85next line"
    body = {"prompt": prompt, "echo": True, "max_tokens": 4, "stream": True}
    chunks = events(served, COMPLETIONS, body)  # (echo: the prompt's text comes back)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text.startswith(prompt)
