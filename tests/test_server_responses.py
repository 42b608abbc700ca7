"""POST /v1/responses (OpenAI's Responses API) against a running server, read by the official
`openai` client and by raw HTTP where the client hides details: the answer is the chat route's
answer for the same messages, streamed deltas add up to it, the length limit shows as an
incomplete response, structured output fits its schema, refused fields get a 400 naming them,
an aborted request gives the chat route's error, and a client leaving mid-stream affects no
later request. A tiny random model with a real tokenizer and chat template, served in this
process.
"""

from __future__ import annotations

import json
import time

import openai
import pytest

from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from tests.model_factory import write_hf_model
from tests.test_server import Served, ServerThread
from tests.test_server_hardening import error_of

CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
PROMPT = "the quick brown fox"
# greedy, and never stopped early by EOS: outputs are long enough to compare
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # (a one-character-per-token vocabulary without 'é': a schema can dead-end part-way)
    folder = write_hf_model(tmp_path_factory.mktemp("m"), vocab_size=101, with_tokenizer=True)
    with Engine(model_path=folder, dtype="float32", device="cpu", context_length=256) as engine:
        app = create_app(engine, ServerConfig(served_model_name="m"), owns_engine=False)
        with ServerThread(app) as srv:
            s = Served(engine, srv, "m")
            yield s
            s.http.close()


def chat(served, messages: list[dict], max_tokens: int, **extra) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, **GREEDY, **extra}
    r = served.http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(served, body: dict) -> list[tuple[str, dict]]:
    """(event name, JSON) of each event of a streamed response, as sent."""
    with served.http.stream("POST", RESPONSES, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    out = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name[len("event: ") :], json.loads(data[len("data: ") :])))
    return out


# ---- the answer --------------------------------------------------------------------------------
def test_the_text_and_usage_are_the_chat_routes_for_the_same_messages(served):
    want = chat(served, [{"role": "user", "content": PROMPT}], 8)
    got = served.client.responses.create(
        model="m", input=PROMPT, max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.output_text == want["choices"][0]["message"]["content"] and got.output_text
    assert got.object == "response" and got.id.startswith("resp_") and got.error is None
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    (item,) = got.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "incomplete" and [p.type for p in item.content] == ["output_text"]
    assert got.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.output_tokens == want["usage"]["completion_tokens"] == 8
    assert got.usage.total_tokens == want["usage"]["total_tokens"]
    assert got.usage.output_tokens_details.reasoning_tokens == 0
    details = got.usage.input_tokens_details
    assert details.cached_tokens <= got.usage.input_tokens and details.cache_write_tokens == 0
    # the settings are echoed as OpenAI states them
    assert got.max_output_tokens == 8 and got.temperature == 0 and got.top_p == 1.0
    assert got.tools == [] and got.tool_choice == "auto" and got.parallel_tool_calls is True
    assert got.metadata == {} and got.store is False and got.previous_response_id is None
    assert got.text.format.type == "text" and got.instructions is None


def test_message_items_instructions_and_roles_make_the_chat_prompt(served):
    """`instructions` is a leading system message; `developer` is `system`; text parts join
    as the chat route joins them; an earlier response's output item goes back as history."""
    earlier = served.client.responses.create(
        input="hi", max_output_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    # (as the client dumps them: nulls and `phase` included, which OpenAI asks to resend)
    history = [{**item.model_dump(), "phase": "final_answer"} for item in earlier.output]
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        *history,
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}],
        },
    ]
    messages = [
        {"role": "system", "content": "you are a fox"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": earlier.output_text},
        {"role": "user", "content": "a\nb"},
    ]
    want = chat(served, messages, 6)
    got = served.client.responses.create(
        input=items,
        instructions="you are a fox",
        max_output_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.output_text == want["choices"][0]["message"]["content"]
    assert got.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert got.instructions == "you are a fox"
    # and instructions change the prompt: without them the prompt is shorter
    plain = served.client.responses.create(input=items, max_output_tokens=1)
    assert plain.usage.input_tokens < got.usage.input_tokens


def test_sampling_extensions_and_metadata_reach_the_answer(served):
    """Seeded sampling equals the chat route's; stop strings stop it; metadata comes back."""
    body = {"temperature": 0.9, "seed": 7, "top_k": 20, "ignore_eos": True}
    want = chat(served, [{"role": "user", "content": PROMPT}], 10, **body)
    r = served.http.post(
        RESPONSES,
        json={"input": PROMPT, "max_output_tokens": 10, **body, "metadata": {"k": "v"}},
    )
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["output"][0]["content"][0]["text"] == want["choices"][0]["message"]["content"]
    assert got["metadata"] == {"k": "v"} and got["temperature"] == 0.9
    assert "output_text" not in got  # (the client's property, not a field)
    text = want["choices"][0]["message"]["content"]
    stop = text[3:5]
    r = served.http.post(
        RESPONSES, json={"input": PROMPT, "max_output_tokens": 10, **body, "stop": [stop]}
    )
    assert r.json()["output"][0]["content"][0]["text"] == text[: text.find(stop)]
    assert r.json()["status"] == "completed"


# ---- streaming ---------------------------------------------------------------------------------
def test_streamed_deltas_add_up_to_the_answer_in_openais_event_order(served):
    body = {"input": PROMPT, "max_output_tokens": 8, **GREEDY}
    whole = served.http.post(RESPONSES, json=body).json()
    events = sse_events(served, body)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = [d for n, d in events if n == "response.output_text.delta"]
    head = [n for n in names if n != "response.output_text.delta"]
    assert head == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert names.index("response.output_text.done") == len(events) - 4  # deltas before it
    text = whole["output"][0]["content"][0]["text"]
    assert "".join(d["delta"] for d in deltas) == text and len(deltas) > 1
    assert all(d["delta"] and d["logprobs"] == [] for d in deltas)
    item_id = events[2][1]["item"]["id"]
    assert {(d["item_id"], d["output_index"], d["content_index"]) for d in deltas} == {
        (item_id, 0, 0)
    }
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == text
    assert final["usage"] == whole["usage"] and final["id"] == events[0][1]["response"]["id"]
    assert events[0][1]["response"]["status"] == "in_progress"


def test_the_openai_client_reads_the_stream_to_its_completion(served):
    """A stop string ends the response by itself: `response.completed`, the text before it."""
    ask = {"input": "hello world", "max_output_tokens": 30, "temperature": 0}
    text = served.client.responses.create(**ask).output_text
    stop = text[4:6]
    stream = served.client.responses.create(**ask, stream=True, extra_body={"stop": [stop]})
    events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1]
    assert final.type == "response.completed" and final.response.status == "completed"
    assert deltas == final.response.output_text == text[: text.find(stop)]
    assert final.response.incomplete_details is None and final.response.usage.output_tokens > 0
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = {type(e).__name__ for e in events}
    assert {"ResponseCreatedEvent", "ResponseTextDeltaEvent", "ResponseCompletedEvent"} <= kinds


# ---- structured output -------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_a_json_schema_format_gives_json_that_fits_it(served):
    got = served.client.responses.create(
        input="Answer yes or no.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}},
    )
    assert got.status == "completed", got.output_text
    assert json.loads(got.output_text)["answer"] in ("yes", "no")
    assert set(json.loads(got.output_text)) == {"answer"}
    assert got.text.format.type == "json_schema"
    got = served.client.responses.create(
        input="{", max_output_tokens=60, temperature=0, text={"format": {"type": "json_object"}}
    )
    if got.status == "completed":
        assert isinstance(json.loads(got.output_text), dict)
    else:  # (any whitespace is JSON: a weak model may spend its tokens on it)
        assert got.output_text.lstrip().startswith("{")


def test_an_aborted_request_gives_the_chat_routes_error(served):
    """A pattern the vocabulary cannot continue part-way ends the request with a client
    error naming the schema, in this route's names; streamed, as an error event."""
    schema = {"type": "string", "pattern": "aé"}
    want = served.http.post(
        CHAT,
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
        },
    )
    body = {"input": "hi", "max_output_tokens": 6}
    body["text"] = {"format": {"type": "json_schema", "name": "s", "schema": schema}}
    r = served.http.post(RESPONSES, json=body)
    err, chat_err = error_of(r), error_of(want)
    assert r.status_code == want.status_code == 400, r.text
    assert chat_err["param"] == "response_format.json_schema.schema"
    assert err["param"] == "text.format.schema" and err["type"] == chat_err["type"]
    assert err["message"] == chat_err["message"].replace(chat_err["param"], err["param"])
    events = sse_events(served, body)
    name, data = events[-1]
    assert name == "error" and data["param"] == "text.format.schema"
    assert data["message"] == err["message"] and data["code"] == "invalid_request_error"
    assert "response.completed" not in [n for n, _ in events]
    served.wait_idle()


# ---- refused -----------------------------------------------------------------------------------
REFUSED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10_000}, "max_output_tokens"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 2}, "n"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"metadata": {"k": 5}}, "metadata.k"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": 3}}}}, "text.format.schema"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].type"),
    ({"input": ["hi"]}, "input[0]"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"role": "user", "content": "a", "name": "x"}]}, "input[0].name"),
    ({"input": "x" * 20_000}, "input"),  # (more characters than the context holds)
    ({"input": PROMPT * 20}, "input"),  # (more tokens than the context holds)
    ({"model": "other"}, "model"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),  # (not streamed)
]


@pytest.mark.parametrize("extra, param", REFUSED, ids=[p for _, p in REFUSED])
def test_refused_fields_get_400_naming_them(served, extra, param):
    body = {"input": "hi", "max_output_tokens": 2, **extra}
    r = served.http.post(RESPONSES, json=body)
    err = error_of(r)
    assert r.status_code in (400, 404) and err["param"] == param, r.text
    assert err["message"].startswith(f"{param}: "), err


def test_an_unknown_field_is_refused_naming_the_fields_taken(served):
    r = served.http.post(RESPONSES, json={"input": "hi", "max_output_token": 2})
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == "max_output_token"
    assert "max_output_tokens" in err["message"] and "instructions" in err["message"]


def test_the_openai_client_gets_the_400_too(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client.responses.create(input="hi", previous_response_id="resp_x")
    assert info.value.body["param"] == "previous_response_id"


def test_neutral_values_of_unsupported_features_are_accepted(served):
    body = {
        "input": "hi",
        "max_output_tokens": 2,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "reasoning": None,
        "truncation": "disabled",
        "include": [],
        "top_logprobs": 0,
        "store": True,
        "previous_response_id": None,
        "user": "u",
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": None,
        "stream_options": None,
        # (the official client's other fields, as tools that send every field send them)
        **dict.fromkeys(
            (
                "conversation",
                "prompt",
                "context_management",
                "max_tool_calls",
                "background_options",
                "moderation",
                "image",
                "access_programs",
            )
        ),  # fmt: skip
        "text": {"format": {"type": "text"}},
    }
    r = served.http.post(RESPONSES, json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tool_choice"] == "none" and got["parallel_tool_calls"] is False
    assert got["store"] is False  # (nothing is stored)


# ---- disconnects -------------------------------------------------------------------------------
def test_a_client_leaving_mid_stream_does_not_affect_the_next_request(served):
    before = served.wait_idle()
    pace = lambda core: time.sleep(0.02)  # noqa: E731  (the stream outlives the reads)
    served.engine.step_hooks.append(pace)
    try:
        body = {"input": PROMPT, "max_output_tokens": 200, **GREEDY, "stream": True}
        with served.http.stream("POST", RESPONSES, json=body) as r:
            lines = r.iter_lines()  # (kept: a dropped iterator closes the connection)
            deltas = 0
            for line in lines:
                deltas += line == "event: response.output_text.delta"
                if deltas >= 3:
                    break
            assert served.metrics()["specserve_num_running_requests"] == 1
        after = served.wait_idle()
    finally:
        served.engine.step_hooks.remove(pace)
    aborted = 'specserve_requests_total{finish_reason="abort"}'
    assert after[aborted] == before[aborted] + 1 and after["specserve_kv_used_tokens"] == 0
    want = chat(served, [{"role": "user", "content": PROMPT}], 6)
    got = served.client.responses.create(
        input=PROMPT, max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.output_text == want["choices"][0]["message"]["content"]
