"""What OpenAI clients send and read: null is the default for every optional field, fields of
features the server lacks are a 400 naming them (never silently ignored), `usage` counts a
prompt once whatever `n`, every SSE event is one line for any line-splitting client, and
`HEAD /health` answers. A tiny random model with a real tokenizer, served in this process.
"""

from __future__ import annotations

import json

import pytest

from specserve.engine import Engine
from specserve.errors import InvalidArgument
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from tests.test_server import Served, ServerThread
from tests.test_server_hardening import error_of

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


# ---- null -------------------------------------------------------------------------------------
NULLABLE = {  # route -> optional fields a client may send as null
    CHAT: [
        "logprobs",
        "stream",
        "top_logprobs",
        "stream_options",
        "max_completion_tokens",
        "documents",
        "add_special_tokens",
        "best_of",
    ],
    COMPLETIONS: [
        "echo",
        "stream",
        "logprobs",
        "stream_options",
        "suffix",
        "best_of",
        "add_special_tokens",
    ],
}
SHARED_NULLABLE = [
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "n", "user",
    "ignore_eos", "stop_token_ids", "skip_special_tokens", "speculative", "return_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "tools",
    "tool_choice", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
]  # fmt: skip


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_null_means_the_default_for_every_optional_field(served, route):
    base = {"messages": MESSAGES} if route == CHAT else {"prompt": "the quick brown fox"}
    base.update(max_tokens=6, seed=3, ignore_eos=True)
    want = served.http.post(route, json=base).json()["choices"]
    for field in NULLABLE[route] + SHARED_NULLABLE:
        r = served.http.post(route, json={**base, field: None})
        assert r.status_code == 200, (field, r.text)
        if field not in base:  # as if not sent: the same (seeded) answer, not streamed
            assert r.json()["choices"] == want, field
    body = {**base, "stream": True, "stream_options": {"include_usage": None}}
    assert all("usage" not in event for event in events(served, route, body))


# ---- features the server lacks ----------------------------------------------------------------
UNSUPPORTED = [  # (routes, field, value); structured output: tests/test_structured_output.py
    ((COMPLETIONS,), "tools", [{"type": "function", "function": {"name": "f"}}]),
    ((COMPLETIONS,), "tool_choice", "required"),
    ((CHAT,), "functions", [{"name": "f", "parameters": {}}]),
    ((CHAT,), "function_call", {"name": "f"}),
    ((CHAT, COMPLETIONS), "bad_words", ""),
    ((CHAT, COMPLETIONS), "use_beam_search", True),
    ((CHAT, COMPLETIONS), "bad_words", ["the"]),
    ((CHAT, COMPLETIONS), "prompt_logprobs", 1),
    # (accepted and ignored on chat before: each changes what vLLM or SGLang return)
    ((CHAT,), "best_of", 3),
    ((CHAT, COMPLETIONS), "best_of", True),
    ((CHAT, COMPLETIONS), "stop_regex", ["a+"]),
    ((CHAT, COMPLETIONS), "typical_p", 0.5),
    ((CHAT,), "documents", [{"text": "a"}]),
    ((CHAT,), "add_special_tokens", True),
    ((COMPLETIONS,), "add_special_tokens", False),
    # vLLM's and SGLang's extensions: served without them, the answer would quietly differ
    ((CHAT, COMPLETIONS), "lora_request", {"lora_name": "a", "lora_int_id": 1}),
    ((CHAT, COMPLETIONS), "lora_path", "my-adapter"),
    ((CHAT, COMPLETIONS), "logits_processors", ["module.Processor"]),
    ((CHAT, COMPLETIONS), "custom_logit_processor", "{}"),
    ((COMPLETIONS,), "prompt_embeds", "AAAA"),
    ((CHAT, COMPLETIONS), "return_tokens_as_token_ids", True),
    ((CHAT, COMPLETIONS), "return_hidden_states", True),
    ((CHAT, COMPLETIONS), "guided_whitespace_pattern", " *"),
    ((CHAT, COMPLETIONS), "structural_tag", "{}"),
    ((CHAT, COMPLETIONS), "spaces_between_special_tokens", False),
    ((CHAT, COMPLETIONS), "priority", 5),
    ((CHAT,), "priority", False),
]


def test_fields_of_features_the_server_lacks_get_400_naming_them(served):
    for routes, field, value in UNSUPPORTED:
        for route in routes:
            base = {"messages": MESSAGES} if route == CHAT else {"prompt": [5, 6]}
            r = served.http.post(route, json={**base, "max_tokens": 2, field: value})
            err = error_of(r)
            assert r.status_code == 400 and err["param"] == field, (route, field, r.text)
            assert err["message"].startswith(f"{field}: ") and "only" in err["message"], err
    # their neutral values are no request for the feature
    for route, field, value in [
        (COMPLETIONS, "response_format", {"type": "text"}),
        (COMPLETIONS, "tools", []),
        (COMPLETIONS, "tool_choice", "none"),
        (CHAT, "functions", []),
        (CHAT, "function_call", "auto"),
        (CHAT, "min_tokens", 0),
        (COMPLETIONS, "use_beam_search", False),
        (CHAT, "bad_words", []),
        (COMPLETIONS, "include_stop_str_in_output", False),
        (CHAT, "best_of", 1),
        (CHAT, "typical_p", 1.0),
        (COMPLETIONS, "no_stop_trim", False),
        (CHAT, "documents", []),
        (CHAT, "add_special_tokens", False),
        (COMPLETIONS, "add_special_tokens", True),
        (CHAT, "return_tokens_as_token_ids", False),
        (COMPLETIONS, "return_hidden_states", False),
        (CHAT, "spaces_between_special_tokens", True),
        (COMPLETIONS, "priority", 0),
        (CHAT, "logits_processors", []),
        (COMPLETIONS, "lora_request", None),
        (CHAT, "lora_path", []),
    ]:
        base = {"messages": MESSAGES} if route == CHAT else {"prompt": [5, 6]}
        r = served.http.post(route, json={**base, "max_tokens": 2, field: value})
        assert r.status_code == 200, (route, field, r.text)


GENERATE_UNSUPPORTED = [
    ("lora_path", "my-adapter"),
    ("lora_path", [None, "my-adapter"]),
    ("image_data", "data:image/png;base64,AAAA"),
    ("audio_data", ["a.wav"]),
    ("video_data", "v.mp4"),
    ("modalities", ["image"]),
    ("input_embeds", [[0.0, 1.0]]),
    ("return_hidden_states", True),
    ("custom_logit_processor", "{}"),
    ("session_params", {"id": "s"}),
    ("token_ids_logprob", [5, 6]),
]


def test_generate_fields_of_features_the_server_lacks_get_400_naming_them(served):
    base = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    for field, value in GENERATE_UNSUPPORTED:
        r = served.http.post("/generate", json={**base, field: value})
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == field, (field, r.text)
        assert err["message"].startswith(f"{field}: ") and "only" in err["message"], err
    neutral = [
        ("image_data", None),
        ("modalities", []),
        ("return_hidden_states", False),
        ("lora_path", []),  # (SGLang's batch form: one adapter or null per prompt)
        ("lora_path", [None]),
    ]
    for field, value in neutral:
        r = served.http.post("/generate", json={**base, field: value})
        assert r.status_code == 200, (field, r.text)


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_a_response_with_several_choices_has_one_id_as_openais(served, route):
    base = {"messages": MESSAGES} if route == CHAT else {"prompt": [5, 6]}
    body = {**base, "max_tokens": 3, "n": 2, "temperature": 0.5}
    one = served.http.post(route, json={**base, "max_tokens": 3}).json()["id"]
    whole = served.http.post(route, json=body).json()
    assert len(whole["choices"]) == 2
    ids = {e["id"] for e in events(served, route, {**body, "stream": True})}
    for got in (whole["id"], *ids):
        assert not got.endswith(("-0", "-1")), got
        assert got.split("-")[0] == one.split("-")[0]  # (cmpl- or chatcmpl-)
    assert len(ids) == 1


def test_one_model_by_its_id_and_the_list_behind_a_trailing_slash(served):
    card = served.http.get("/v1/models").json()["data"][0]
    assert served.http.get(f"/v1/models/{card['id']}").json() == card
    missing = served.http.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and error_of(missing)["code"] == "model_not_found"
    listed = served.http.get("/v1/models/")  # (no id: the list, as other trailing slashes)
    assert listed.status_code == 307 and listed.headers["location"].endswith("/v1/models")
    assert served.http.get("/v1/models/", follow_redirects=True).json()["data"] == [card]


def test_head_health(served):
    r = served.http.head("/health")
    assert r.status_code == 200 and r.content == b""
    got = served.http.get("/health")
    assert r.headers["content-length"] == str(len(got.content)), (r.headers, got.content)


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


# ---- vLLM's chat template options ---------------------------------------------------------------
CONVERSATION = [
    {"role": "user", "content": "Count from 1 to 10."},
    {"role": "assistant", "content": "1, 2, 3, 4,"},
]


@pytest.mark.parametrize(
    "options",
    [
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {},
    ],
)
def test_chat_template_options_decide_the_prompt_as_in_vllm(served, options):
    """add_generation_prompt: false leaves the assistant's turn unopened; with
    continue_final_message the model continues the final (assistant) message; template
    variables reach the template. The completion is the engine's for exactly those ids."""
    body = {"messages": CONVERSATION, "max_tokens": 6, "temperature": 0, **options}
    r = served.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    tokenizer = served.engine.tokenizer
    want_ids = tokenizer.apply_chat_template(
        CONVERSATION,
        add_generation_prompt=options.get("add_generation_prompt", True),
        continue_final_message=options.get("continue_final_message", False),
        tokenize=True,
        **options.get("chat_template_kwargs", {}),
    )
    want_ids = list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
    text = tokenizer.decode(want_ids)
    if options.get("continue_final_message"):
        assert text.endswith("1, 2, 3, 4,"), text  # (no end of turn after it)
    elif options.get("add_generation_prompt", True):
        assert text.endswith("<|im_start|>assistant\n"), text
    else:
        assert text.endswith("<|im_end|>\n"), text
    got = r.json()
    assert got["usage"]["prompt_tokens"] == len(want_ids)
    want = served.engine.generate(
        input_ids=want_ids, sampling_params={"max_new_tokens": 6, "temperature": 0}
    )
    assert got["choices"][0]["message"]["content"] == want["text"]


@pytest.mark.parametrize(
    "options, param",
    [
        ({"continue_final_message": True}, "continue_final_message"),  # (with the default
        # add_generation_prompt true: one or the other)
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"conversations": []}}, "chat_template_kwargs"),
        # (a special token the template prints, or any variable, sized past the size checks)
        ({"chat_template_kwargs": {"bos_token": "ab " * 1000}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"date_string": "ab " * 2000}}, "chat_template_kwargs"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"echo": True}, "echo"),
        ({"echo": 0}, "echo"),  # (strict: 0 is not false)
    ],
)
def test_chat_template_options_out_of_range_get_400_naming_them(served, options, param):
    body = {"messages": CONVERSATION, "max_tokens": 2, **options}
    r = served.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param, r.text


@pytest.mark.parametrize(
    "route, body, param",
    [
        (COMPLETIONS, {"prompt": ["the fox", "the lazy dog " * 100]}, "prompt[1]"),  # too long
        (COMPLETIONS, {"prompt": [[5, 6], [7, 10**6]]}, "prompt[1]"),  # out of the vocabulary
        (COMPLETIONS, {"prompt": [[5, 6], [7] * 300]}, "prompt[1]"),
        (COMPLETIONS, {"prompt": [[7] * 300]}, "prompt"),  # (one prompt: no index)
        ("/generate", {"input_ids": [[5, 6], [7, 10**6]]}, "input_ids[1]"),
        ("/generate", {"text": ["the lazy dog " * 100, "the fox"]}, "text[0]"),
    ],
)
def test_an_error_in_one_prompt_of_a_batch_names_that_prompt(served, route, body, param):
    r = served.http.post(route, json={**body, "max_tokens": 2} if route == COMPLETIONS else body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and err["message"].startswith(param + ": "), err


def test_chat_template_kwargs_reach_the_template(served, monkeypatch):
    tokenizer = served.engine.tokenizer
    template = "{% if flag %}the quick brown fox{% endif %}" + tokenizer.chat_template
    monkeypatch.setattr(tokenizer, "chat_template", template)
    usage = []
    for kwargs in ({"flag": True}, {"flag": False}, None):
        body = {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": kwargs}
        r = served.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"]["prompt_tokens"])
    assert usage[0] > usage[1] == usage[2], usage


# ---- penalties and logit bias -------------------------------------------------------------------
@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_logit_bias_and_penalties_reach_the_engine(served, route):
    base = {"messages": MESSAGES} if route == CHAT else {"prompt": "the quick brown fox"}
    base.update(max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True)

    def ids(body):
        r = served.http.post(route, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    assert ids({**base, "logit_bias": {"42": 100}}) == [42] * 8
    assert set(ids({**base, "allowed_token_ids": [7, 9]})) <= {7, 9}
    free = ids(base)
    assert ids({**base, "frequency_penalty": 2.0, "presence_penalty": 2.0}) != free
    assert not set(ids({**base, "logit_bias": {str(t): -100 for t in free}})) & set(free)


def test_generate_takes_logit_bias_and_penalties(served):
    def ids(**extra):
        body = {"input_ids": [5, 6, 7], "sampling_params": {**GREEDY_NATIVE, **extra}}
        r = served.http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    assert ids(logit_bias={"42": 100}) == [42] * 8
    assert ids(repetition_penalty=1.9, frequency_penalty=1.0) != ids()
    for bad, field in (
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
    ):
        r = served.http.post("/generate", json={"input_ids": [5], "sampling_params": bad})
        assert r.status_code == 400 and field in r.text, r.text


GREEDY_NATIVE = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_min_tokens_holds_back_the_stop_tokens(served, route):
    base = {"messages": MESSAGES} if route == CHAT else {"prompt": "the quick brown fox"}
    base.update(max_tokens=12, temperature=0, return_token_ids=True)

    def ids(**extra):
        r = served.http.post(route, json={**base, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    free = ids(ignore_eos=True)
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    assert len(ids(stop_token_ids=[free[k]])) == k + 1
    for name in ("min_tokens", "min_new_tokens"):  # (vLLM's name, SGLang's)
        held = ids(stop_token_ids=[free[k]], ignore_eos=True, **{name: k + 3})
        assert free[k] not in held[: k + 3] and len(held) > k + 3


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"min_tokens": 13}, "min_tokens"),  # past max_tokens
        ({"min_new_tokens": 13}, "min_new_tokens"),
        ({"min_tokens": False}, "min_tokens"),  # (strict types: not 0)
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_new_tokens": 2.0}, "min_new_tokens"),
        ({"min_tokens": 2, "min_new_tokens": 3}, "min_new_tokens"),
    ],
)
def test_bad_min_tokens_get_400_naming_the_field(served, extra, field):
    r = served.http.post(COMPLETIONS, json={"prompt": [5, 6], "max_tokens": 12, **extra})
    assert r.status_code == 400 and error_of(r)["param"] == field, r.text


@pytest.mark.parametrize("name", ["include_stop_str_in_output", "no_stop_trim"])
def test_the_stop_string_stays_in_the_text_when_asked(served, name):
    base = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = served.http.post(COMPLETIONS, json=base).json()["choices"][0]["text"]
    word = text[4:7]
    cut = text.find(word)
    for stream in (False, True):
        body = {**base, "stop": [word], name: True, "stream": stream}
        if stream:
            got = "".join(
                e["choices"][0]["text"] for e in events(served, COMPLETIONS, body) if e["choices"]
            )
        else:
            got = served.http.post(COMPLETIONS, json=body).json()["choices"][0]["text"]
        assert got == text[: cut + len(word)], (stream, got, text, word)
    for bad in (
        {name: "yes"},
        {name: 1},
        {"include_stop_str_in_output": True, "no_stop_trim": False},
    ):
        r = served.http.post(COMPLETIONS, json={**base, **bad})
        assert r.status_code == 400, r.text


# ---- truncate_prompt_tokens -------------------------------------------------------------------
def test_truncated_prompt_answers_as_its_last_tokens_everywhere(served):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are the prompt (usage counts
    them); -1 cuts a prompt past the context to the longest the engine takes."""
    prompt = [(7 * i) % 97 + 3 for i in range(40)]
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def completion(body):
        r = served.http.post(COMPLETIONS, json={**base, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()["usage"]["prompt_tokens"]

    tail, used = completion({"prompt": prompt[-5:]})
    assert used == 5
    assert completion({"prompt": prompt, "truncate_prompt_tokens": 5}) == (tail, 5)
    assert completion({"prompt": prompt, "truncate_prompt_tokens": 64}) == completion(
        {"prompt": prompt}
    )
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    offline = served.engine.generate(
        input_ids=prompt, sampling_params={**greedy, "truncate_prompt_tokens": 5}
    )
    assert offline["output_ids"] == tail
    native = served.http.post(
        "/generate",
        json={"input_ids": prompt, "sampling_params": {**greedy, "truncate_prompt_tokens": 5}},
    )
    assert native.status_code == 200 and native.json()["output_ids"] == tail, native.text

    too_long = [(3 * i) % 97 + 3 for i in range(300)]  # (the context holds 256)
    r = served.http.post(COMPLETIONS, json={**base, "prompt": too_long})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text
    ids, used = completion({"prompt": too_long, "truncate_prompt_tokens": -1, "max_tokens": 1})
    assert used == 255 and len(ids) == 1
    chat = served.http.post(CHAT, json={**base, "messages": MESSAGES, "truncate_prompt_tokens": 3})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 3, chat.text


@pytest.mark.parametrize("value", [0, -2, 2.0, True, "3", 256])
def test_bad_truncate_prompt_tokens_get_400_naming_the_field(served, value):
    for route, body in ((COMPLETIONS, {"prompt": [5, 6]}), (CHAT, {"messages": MESSAGES})):
        r = served.http.post(route, json={**body, "truncate_prompt_tokens": value})
        assert r.status_code == 400 and error_of(r)["param"] == "truncate_prompt_tokens", r.text
    r = served.http.post(
        "/generate", json={"input_ids": [5], "sampling_params": {"truncate_prompt_tokens": value}}
    )
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == "sampling_params.truncate_prompt_tokens", r.text


def test_a_bad_token_id_in_the_part_cut_off_is_refused_naming_its_prompt(served):
    bad = [5, 6, 10_000, 7, 8]  # (the vocabulary holds 101 ids)
    for route, body, param in (
        (COMPLETIONS, {"prompt": bad}, "prompt"),
        (COMPLETIONS, {"prompt": [[5, 6], bad]}, "prompt[1]"),
        ("/generate", {"input_ids": bad}, "input_ids"),
    ):
        if route == "/generate":
            body["sampling_params"] = {"truncate_prompt_tokens": 2}
        else:
            body["truncate_prompt_tokens"] = 2
        r = served.http.post(route, json=body)
        assert r.status_code == 400 and error_of(r)["param"] == param, r.text
        assert "10000" in error_of(r)["message"], r.text


@pytest.mark.parametrize("keep", [0, -2, 1.5])
def test_the_engine_checks_the_truncation_it_is_given(served, keep):
    with pytest.raises(InvalidArgument) as e:
        served.engine.truncate_prompt([5, 6, 7], keep)
    assert e.value.field == "truncate_prompt_tokens"
    assert served.engine.truncate_prompt([5, 6, 7], 2) == [6, 7]


def test_echo_shows_the_prompt_as_given_unless_truncation_cut_it(served):
    """A truncate_prompt_tokens that cuts nothing (a cap a client sets on every request)
    leaves echo's text as the prompt given, not its ids decoded (with the BOS token's text);
    a prompt it cut echoes the text of the tokens kept."""
    text = "hello world"

    def echoed(extra):
        body = {"prompt": text, "max_tokens": 0, "echo": True, **extra}
        r = served.http.post(COMPLETIONS, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert echoed({}) == text
    assert echoed({"truncate_prompt_tokens": 100}) == text
    kept = served.engine.tokenizer.encode(text, add_special_tokens=True)[-3:]
    assert echoed({"truncate_prompt_tokens": 3}) == served.engine.tokenizer.decode(kept)
