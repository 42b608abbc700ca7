"""The OpenAI routes as vLLM's and SGLang's clients use them, past the common paths: usage
reported on every chunk of a stream when asked. A tiny random model with a real tokenizer,
served in this process.
"""

from __future__ import annotations

import pytest

from tests import test_server_openai_compat as compat
from tests.test_server_openai_compat import CHAT, COMPLETIONS, MESSAGES, events

served = compat.served  # (the same fixture: a tiny model with a real tokenizer, per module)


def _body(route: str, **extra) -> dict:
    base = {"messages": MESSAGES} if route == CHAT else {"prompt": ["the quick", "brown fox"]}
    return {**base, "max_tokens": 5, "seed": 7, "ignore_eos": True, "stream": True, **extra}


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_continuous_usage_stats_puts_running_usage_on_every_chunk(served, route):
    # vLLM's and SGLang's stream option: each chunk's usage counts its choice's prompt and
    # the tokens that choice has so far; the last chunk still sums every choice
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = events(served, route, _body(route, n=2, stream_options=options))
    *running, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * 5 * (
        2 if route == COMPLETIONS else 1
    )
    seen: dict[int, int] = {}
    for chunk in running:
        usage = chunk["usage"]
        assert usage is not None, chunk
        (choice,) = chunk["choices"]
        done = usage["completion_tokens"]
        assert done >= seen.get(choice["index"], 0)
        seen[choice["index"]] = done
        assert usage["total_tokens"] == usage["prompt_tokens"] + done
        assert usage["prompt_tokens"] > 0
    assert sorted(seen.values()) == [5] * len(seen)


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_continuous_usage_stats_without_include_usage_adds_nothing(served, route):
    # (vLLM: usage on every chunk only when include_usage is on too)
    options = {"continuous_usage_stats": True}
    assert all(
        "usage" not in e for e in events(served, route, _body(route, stream_options=options))
    )


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_min_tokens_past_the_default_length_lifts_it(served, route):
    # max_tokens unset: the server's default length (128) is no limit the client chose, so
    # a min_tokens above it that fits the context is served, as vLLM serves it
    body = _body(route, min_tokens=140, stream=False)
    del body["max_tokens"], body["ignore_eos"]
    r = served.http.post(route, json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] >= 140 * (2 if route == COMPLETIONS else 1)
    # one that cannot fit the context is still refused, naming the field and the room left
    r = served.http.post(route, json={**body, "min_tokens": 250})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "min_tokens" and "at most" in err["message"], err


@pytest.mark.parametrize("bad", [-3, 101, 10**12])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_of_token_ids_outside_the_vocabulary_is_a_400_naming_the_prompt(served, bad, stream):
    """echo decodes a prompt's ids before the engine checks them: an id the tokenizer cannot
    hold (negative, or past 2**32) raised inside it, a 500."""
    body = {"prompt": [[5, 6], [7, bad]], "max_tokens": 2, "echo": True, "stream": stream}
    r = served.http.post(COMPLETIONS, json=body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "prompt[1]" and str(bad) in err["message"], err
    assert "[0, 101)" in err["message"], err


def test_an_assistant_message_with_tool_calls_is_served_and_elsewhere_refused(served):
    """A history carrying tool calls reaches the template (tests/test_server_tool_calls.py);
    only an assistant's message carries them."""
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": call}]
    r = served.http.post(CHAT, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text[:300]
    wrong = [{**MESSAGES[0], "tool_calls": call}]
    r = served.http.post(CHAT, json={"messages": wrong, "max_tokens": 2})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "messages[0].tool_calls", r.text
    for none in (None, []):  # (histories copied from other servers' answers carry [])
        ok = [*MESSAGES, {"role": "assistant", "content": "x", "tool_calls": none}]
        assert served.http.post(CHAT, json={"messages": ok, "max_tokens": 2}).status_code == 200


def test_a_message_name_reaches_the_chat_template():
    # (templates that render a speaker's name read it; vLLM passes it through likewise)
    from specserve.server.openai_protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "user", "content": "yo"},
            ]
        }
    )
    assert req.chat_messages() == [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "user", "content": "yo"},
    ]


def test_min_tokens_with_a_response_format_names_no_field_the_client_did_not_send(served):
    body = {"messages": MESSAGES, "max_tokens": 4, "min_tokens": 2}
    r = served.http.post(CHAT, json={**body, "response_format": {"type": "json_object"}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "min_tokens" and "json_schema" not in err["message"], err
