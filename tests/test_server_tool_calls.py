"""Tool calling on /v1/chat/completions through structured output: a named tool choice answers
one call whose arguments fit the function's schema, "required" an array of calls to the
given tools, greedy and sampled, with speculative decoding (the same calls as without) and
without; streamed deltas join into the unstreamed calls; the tools, the history's calls and
tool messages reach the chat template; every refusal names its field. A tiny random model
with a real tokenizer and a template that renders tools, served in this process; the
openai client where it can send the request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from specserve.server.tool_calls import CallsReader
from tests.engine_utils import spec_args
from tests.model_factory import write_hf_model
from tests.test_server import Served, ServerThread
from tests.test_server_hardening import error_of
from tests.test_server_openai_compat import CHAT, events
from tests.test_structured_output import SCHEMA

TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}\n{% endfor %}"
    "{% if m.tool_call_id %}RESULT {{ m.tool_call_id }}: {% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = SCHEMA  # (the structured-output tests' schema: an enum and a bounded integer)
# (a reference into the function's own $defs: it must still resolve inside "required"'s array)
PING = {
    "$defs": {"flag": {"type": "boolean"}},
    "type": "object",
    "properties": {"up": {"$ref": "#/$defs/flag"}},
    "required": ["up"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "ping", "description": "is it up", "parameters": PING},
    },
]
FITS = {
    "get_weather": lambda v: (
        set(v) == {"answer", "count"}
        and v["answer"] in ("yes", "no")
        and type(v["count"]) is int
        and 0 <= v["count"] <= 99
    ),
    "ping": lambda v: set(v) == {"up"} and isinstance(v["up"], bool),
}
MESSAGES = [{"role": "user", "content": "paged kv cache and"}]
NAMED_NAME = "get_weather"
NAMED = {"type": "function", "function": {"name": NAMED_NAME}}
GREEDY = {"temperature": 0}
SAMPLED = {"temperature": 1.0, "seed": 1}


def _serve(folder: str, **engine_args):
    engine = Engine(
        model_path=folder, dtype="float32", device="cpu", context_length=512, **engine_args
    )
    srv = ServerThread(create_app(engine, ServerConfig(served_model_name="m"), owns_engine=False))
    srv.__enter__()
    return engine, srv, Served(engine, srv, "m")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"plain": ..., "speculative": ...}: one model, served without and with drafts (the
    target drafting for itself, so that steps accept several tokens)."""
    folder = write_hf_model(tmp_path_factory.mktemp("m") / "m", vocab_size=300, with_tokenizer=True)
    Path(folder, "chat_template.jinja").write_text(TEMPLATE)
    started = {
        "plain": _serve(folder),
        "speculative": _serve(
            folder, **spec_args(folder, topk=2, steps=3, ndt=6, algorithm="STANDALONE")
        ),
    }
    yield {name: s for name, (_, _, s) in started.items()}
    for engine, srv, s in started.values():
        s.http.close()
        srv.__exit__(None, None, None)
        engine.shutdown()


@pytest.fixture(scope="module")
def no_spaces(servers) -> dict[str, int]:
    """A logit_bias that keeps the random model from spending its tokens on JSON's optional
    whitespace, so that its answers complete."""
    tok = servers["plain"].engine.tokenizer
    return {str(i): -100 for i in range(300) if (t := tok.decode([i])) and not t.strip()}


def _ask(served, no_spaces, sampling, **body):
    asked = {"max_tokens": 160, "n": 3, "logit_bias": no_spaces, **sampling, **body}
    return served.client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, **asked)


def _check_call(call, names=("get_weather", "ping")):
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name in names
    assert FITS[call.function.name](json.loads(call.function.arguments)), call


# ---- named and required -----------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_named_function_is_answered_as_one_call_fitting_its_schema(servers, no_spaces, sampling):
    answers = {}
    for name, served in servers.items():
        got = _ask(served, no_spaces, sampling, tool_choice=NAMED)
        ids = set()
        for choice in got.choices:
            assert choice.finish_reason == "stop", choice
            assert choice.message.content is None and len(choice.message.tool_calls) == 1
            (call,) = choice.message.tool_calls
            _check_call(call, ("get_weather",))
            ids.add(call.id)
        assert len(ids) == len(got.choices)  # (each choice its own call)
        answers[name] = [c.message.tool_calls[0].function.arguments for c in got.choices]
    # lossless: the drafts change no argument
    assert answers["plain"] == answers["speculative"]
    if sampling is SAMPLED:  # (each choice samples its own)
        assert len(set(answers["plain"])) > 1, answers


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_required_is_answered_as_calls_to_the_given_tools(servers, no_spaces, sampling):
    answers = {}
    for name, served in servers.items():
        got = _ask(served, no_spaces, sampling, tool_choice="required")
        for choice in got.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None and choice.message.tool_calls
            for call in choice.message.tool_calls:
                _check_call(call)
        answers[name] = [
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            for choice in got.choices
        ]
    assert answers["plain"] == answers["speculative"]


def test_parallel_tool_calls_false_answers_one_call(servers, no_spaces):
    served = servers["plain"]
    counts = {}
    for parallel in (True, False):
        got = _ask(
            served, no_spaces, SAMPLED, tool_choice="required", parallel_tool_calls=parallel, n=4
        )
        counts[parallel] = [len(c.message.tool_calls) for c in got.choices]
    assert max(counts[True]) > 1, counts  # (this seed calls several when it may)
    assert counts[False] == [1] * 4, counts


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_streamed_calls_join_into_the_unstreamed_ones(servers, no_spaces, choice, sampling):
    served = servers["speculative"]
    whole = _ask(served, no_spaces, sampling, tool_choice=choice)
    stream = _ask(served, no_spaces, sampling, tool_choice=choice, stream=True)
    calls: dict[int, dict[int, dict]] = {}
    finishes = {}
    for chunk in stream:
        (c,) = chunk.choices
        if c.delta.role:  # the opening delta: no content
            assert c.delta.content is None, c
        for d in c.delta.tool_calls or ():
            got = calls.setdefault(c.index, {})
            if d.index not in got:  # a call's first delta: id, type and name, no arguments yet
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                assert d.function.arguments == "" and d.index == len(got), d
                got[d.index] = {"name": d.function.name, "arguments": ""}
            else:  # then pieces of its arguments alone
                assert d.id is None and d.function.name is None, d
                got[d.index]["arguments"] += d.function.arguments
        if c.finish_reason is not None:
            finishes[c.index] = c.finish_reason
    for choice_ in whole.choices:
        want = [
            {"name": t.function.name, "arguments": t.function.arguments}
            for t in choice_.message.tool_calls
        ]
        assert [calls[choice_.index][i] for i in sorted(calls[choice_.index])] == want
        assert finishes[choice_.index] == choice_.finish_reason
    if choice == "required" and sampling is SAMPLED:  # (a choice of this seed calls twice)
        assert any(len(c) > 1 for c in calls.values()), calls


def test_a_truncated_answer_keeps_the_calls_begun(servers, no_spaces):
    # (the length limit inside the arguments: the text so far, finish_reason "length")
    for choice, reason in ((NAMED, "length"), ("required", "length")):
        got = _ask(servers["plain"], no_spaces, GREEDY, tool_choice=choice, max_tokens=24, n=1)
        (c,) = got.choices
        assert c.finish_reason == reason
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 24,
                "temperature": 0, "logit_bias": no_spaces, "stream": True}  # fmt: skip
        streamed = "".join(
            d["function"]["arguments"]
            for e in events(servers["plain"], CHAT, body)
            for ch in e["choices"]
            for d in ch["delta"].get("tool_calls") or ()
        )
        assert streamed == "".join(t.function.arguments for t in c.message.tool_calls or ())


def test_tool_choice_none_answers_text_with_the_tools_in_the_template(servers):
    served = servers["plain"]
    prompt = served.engine.tokenize_chat(MESSAGES, tools=TOOLS)
    assert "TOOLS: get_weather ping" in served.engine.tokenizer.decode(prompt)
    got = served.client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    (c,) = got.choices
    assert isinstance(c.message.content, str) and c.message.tool_calls is None
    assert c.finish_reason == "length" and got.usage.prompt_tokens == len(prompt)
    # without tools, nothing is rendered for them
    plain = served.client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert plain.usage.prompt_tokens == len(served.engine.tokenize_chat(MESSAGES))
    assert plain.usage.prompt_tokens < len(prompt)
    # /tokenize renders them too: its ids are the chat route's prompt
    r = served.http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 200 and r.json()["tokens"] == prompt


def _call_of(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_history_with_tool_calls_and_tool_messages_reaches_the_template(servers, no_spaces):
    served = servers["plain"]
    first = _ask(served, no_spaces, GREEDY, tool_choice=NAMED, n=1).choices[0].message
    (call,) = first.tool_calls
    # the answer's message sent back as the client got it (content null), then the result
    history = [*MESSAGES, first, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    got = served.client.chat.completions.create(
        model="m", messages=history, tools=TOOLS, tool_choice="none", max_tokens=3
    )
    arguments = json.loads(call.function.arguments)
    rendered = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [_call_of(call.id, NAMED_NAME, arguments)],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": call.id},
    ]
    ids = served.engine.tokenize_chat(rendered, tools=TOOLS)
    assert got.usage.prompt_tokens == len(ids)
    shown = served.engine.tokenizer.decode(ids)
    # the arguments reach the template as an object (tojson prints it once, not quoted again)
    assert f"CALL {call.id} get_weather {json.dumps(arguments)}" in shown, shown
    assert f"RESULT {call.id}: sunny" in shown
    # arguments that are not a JSON object reach it as the text they are
    odd = {"role": "assistant", "content": None, "tool_calls": [_call_of("c1", "f", "not json")]}
    r = served.http.post(CHAT, json={"messages": [*MESSAGES, odd], "max_tokens": 2})
    assert r.status_code == 200, r.text
    # and so does JSON nested past the parser's depth (it was a 500 that dropped the
    # connection): here more than the context holds
    deep = '{"a":' * 50_000 + "1" + "}" * 50_000
    odd = {"role": "assistant", "content": None, "tool_calls": [_call_of("c1", "f", deep)]}
    r = served.http.post(CHAT, json={"messages": [*MESSAGES, odd], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
    r = served.http.post("/tokenize", json={"messages": [*MESSAGES, odd]})
    assert r.status_code == 200 and r.json()["count"] > 100_000, r.text[:300]
    # arguments deep enough to exhaust the template's recursion, not the parser's, too
    deep = '{"a":' * 600 + "1" + "}" * 600
    odd = {"role": "assistant", "content": None, "tool_calls": [_call_of("c1", "f", deep)]}
    r = served.http.post("/tokenize", json={"messages": [*MESSAGES, odd]})
    assert r.status_code == 200, r.text[:300]


def test_the_template_gets_what_the_server_renders():
    """The request's messages and tools, as the server hands them to the template."""
    from specserve.server.openai_protocol import ChatCompletionRequest

    text_parts = [{"type": "text", "text": "ok"}]
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [_call_of("c1", "ping", '{"up": true}')]},
                {"role": "tool", "tool_call_id": "c1", "content": text_parts},
            ],
            "tools": TOOLS,
            "tool_choice": "none",
        }
    )
    assert req.chat_messages()[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [_call_of("c1", "ping", {"up": True})]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
    ]
    assert req.template_options()["tools"] == TOOLS


# ---- the reader of a "required" answer --------------------------------------------------------
def test_the_calls_reader_reads_any_split_of_the_text():
    text = (
        '[ {"name": "f", "parameters": {"a": "}\\"{ ]", "b": [1, {"c": null}]}} ,\n'
        '{"name":"g","parameters":{}}, {"name": "h\\u00e9", "parameters": {"x": -1.5e3}}]'
    )
    want = [
        ("f", '{"a": "}\\"{ ]", "b": [1, {"c": null}]}'),
        ("g", "{}"),
        ("h\u00e9", '{"x": -1.5e3}'),
    ]
    for size in (1, 2, 3, 7, len(text)):
        reader = CallsReader()
        for i in range(0, len(text), size):
            reader.feed(text[i : i + size])
        assert [(c.name, "".join(c.arguments)) for c in reader.calls] == want, size
    # cut short: the calls begun, the last one's arguments so far
    reader = CallsReader()
    reader.feed(text[: text.index('"b"') + 3])
    assert [(c.name, "".join(c.arguments)) for c in reader.calls] == [("f", '{"a": "}\\"{ ]", "b"')]


# ---- refusals ---------------------------------------------------------------------------------
def _tool(name="f", **function):
    return {"type": "function", "function": {"name": name, **function}}


REFUSED = [  # (the body's fields beside the messages, the field the 400 names)
    ({"tools": [_tool(), _tool("bad name")]}, "tools[1].function.name"),
    ({"tools": [_tool(), _tool("x" * 65)]}, "tools[1].function.name"),
    ({"tools": [_tool(), _tool("g"), _tool("f")]}, "tools[2].function.name"),
    (
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        "tools[0].function.name",
    ),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [_tool(parameters={"type": "string"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters=[1])]}, "tools[0].function.parameters"),
    ({"tools": [_tool()]}, "tool_choice"),  # (OpenAI's default once tools are given: "auto")
    ({"tools": [_tool()], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": {"type": "mcp"}}, "tool_choice.type"),
    ({"tools": [_tool()], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    (
        {"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice.function.name",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": NAMED}, "tool_choice"),
    (
        {"tools": [_tool()], "tool_choice": "required", "parallel_tool_calls": 0},
        "parallel_tool_calls",
    ),
    (
        {"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "guided_regex"),
    (
        {"tools": [_tool()], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
    # a schema structured output cannot enforce, or cannot compile
    (
        {
            "tools": [_tool(parameters={"type": "object", "not": {}})],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools[0].function.parameters",
    ),
    (
        {
            "tools": [_tool(), _tool("g", parameters={"type": "object", "not": {}})],
            "tool_choice": "required",
        },
        "tools[1].function.parameters",
    ),
    (
        {
            "tools": [_tool(parameters={"type": "object", "properties": {"a": {"type": "nope"}}})],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools[0].function.parameters",
    ),
    # a stop string or token would end a call inside its arguments
    ({"tools": TOOLS, "tool_choice": NAMED, "stop": ["Par"]}, "stop"),
    ({"tools": TOOLS, "tool_choice": "required", "stop": "x"}, "stop"),
    ({"tools": TOOLS, "tool_choice": "required", "stop_token_ids": [5]}, "stop_token_ids"),
    # the deprecated functions
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
]
CALL = _call_of("c", "f", "{}")
HISTORY_REFUSED = [  # (messages, the field the 400 names)
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "assistant", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls"),
    (
        [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
        "messages[0].tool_calls[0].function.name",
    ),
    (
        [{"role": "assistant", "tool_calls": [{k: v for k, v in CALL.items() if k != "id"}]}],
        "messages[0].tool_calls[0].id",
    ),
    ([{"role": "tool", "content": "sunny"}], "messages[0].tool_call_id"),
    ([{"role": "function", "name": "f", "content": "x"}], "messages[0].role"),
    (
        [{"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}}],
        "messages[0].function_call",
    ),
]


def test_each_refusal_names_its_field(servers):
    http = servers["plain"].http
    cases = [({"messages": MESSAGES, **extra}, param) for extra, param in REFUSED]
    cases += [({"messages": messages}, param) for messages, param in HISTORY_REFUSED]
    for body, param in cases:
        r = http.post(CHAT, json={**body, "max_tokens": 2})
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == param, (body, r.text)
        assert err["message"].startswith(f"{param}: "), err
    # "auto" says what works instead
    r = http.post(CHAT, json={"messages": MESSAGES, "tools": [_tool()], "tool_choice": "auto"})
    assert "'required'" in error_of(r)["message"] and "parser" in error_of(r)["message"]


ACCEPTED = [  # neutral values, and what a structured-output field leaves unconstrained
    {"tool_choice": "none"},
    {"tool_choice": "auto"},  # (no tools: nothing to call, the answer is text as asked)
    {"tools": [], "tool_choice": "auto"},
    {"tools": None, "tool_choice": None, "parallel_tool_calls": None},
    {"tools": [_tool()], "tool_choice": "none", "response_format": {"type": "json_object"}},
    {"tools": [_tool(parameters={"type": "object", "not": {}})], "tool_choice": "none"},
    {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "text"}},
    {"tools": [_tool(strict=True, parameters=None, description=None)], "tool_choice": "required"},
    {"functions": [], "function_call": "none"},
    {"tools": TOOLS, "tool_choice": "none", "stop": ["x"]},
    {"tools": TOOLS, "tool_choice": NAMED, "stop": [], "stop_token_ids": []},
    # property names that are also keywords: their schemas' references still resolve
    {
        "tools": [
            _tool(
                parameters={
                    "$defs": {"u": {"type": "boolean"}},
                    "type": "object",
                    "properties": {
                        "default": {"$ref": "#/$defs/u"},
                        "enum": {"$ref": "#/$defs/u"},
                        "properties": {"$ref": "#/$defs/u"},
                    },
                }
            )
        ],
        "tool_choice": "required",
    },
]


def test_neutral_values_and_tools_beside_unconstrained_fields_are_served(servers):
    for extra in ACCEPTED:
        r = servers["plain"].http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)
