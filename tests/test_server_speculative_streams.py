"""The OpenAI routes when a speculative step emits several tokens at once: a stop string,
stop token or max_tokens met inside an accepted chain ends the answer there, streamed and
unstreamed alike; each chunk's log-probs cover exactly its tokens; n seeded choices stream
whole; a client leaving mid-stream aborts every choice. The target drafts for itself, so
greedy steps accept their whole chain (several tokens a chunk)."""

from __future__ import annotations

import time

import httpx
import pytest

from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from tests.engine_utils import spec_args
from tests.model_factory import EOS_ID, write_hf_model
from tests.test_server import Served, ServerThread
from tests.test_server_openai_compat import CHAT, COMPLETIONS, events

PROMPT = "paged kv cache and"
GREEDY = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def spec_served(tmp_path_factory):
    folder = write_hf_model(tmp_path_factory.mktemp("m") / "m", vocab_size=300, with_tokenizer=True)
    drafts = spec_args(folder, topk=2, steps=3, ndt=6, algorithm="STANDALONE")
    with Engine(
        model_path=folder, dtype="float32", device="cpu", context_length=256, **drafts
    ) as e:
        app = create_app(e, ServerConfig(), owns_engine=False)
        with ServerThread(app) as srv:
            s = Served(e, srv, "m")
            yield s
            s.http.close()


def _post(served, route: str, body: dict) -> dict:
    r = served.http.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed_choices(chunks: list[dict], route: str) -> dict[int, dict]:
    """Per choice index: its text joined, its token ids, its finishing chunks."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            got = out.setdefault(c["index"], {"text": "", "ids": [], "finishes": []})
            got["text"] += c["text"] if route == COMPLETIONS else c["delta"].get("content", "")
            got["ids"] += c.get("token_ids") or []
            if c["finish_reason"] is not None:
                got["finishes"].append(c)
    return out


@pytest.fixture(scope="module")
def greedy(spec_served):
    """The unconstrained greedy answer, which must have come in multi-token steps."""
    out = _post(spec_served, COMPLETIONS, {**GREEDY, "return_token_ids": True})
    assert out["usage"]["spec_accept_length"] >= 3, out["usage"]  # (else nothing is tested)
    return out["choices"][0]


def test_stop_strings_met_inside_a_step_cut_the_streamed_and_unstreamed_text_alike(
    spec_served, greedy
):
    text = greedy["text"]
    stops = {text[i : i + n] for n in (1, 3) for i in range(0, len(text) - n, 4)}
    stops = sorted(s for s in stops if "\ufffd" not in s)
    assert len(stops) >= 6
    for stop in stops:
        for keep in (False, True):
            body = {**GREEDY, "stop": [stop], "include_stop_str_in_output": keep}
            want = text[: text.find(stop) + (len(stop) if keep else 0)]
            whole = _post(spec_served, COMPLETIONS, body)["choices"][0]
            assert (whole["text"], whole["finish_reason"]) == (want, "stop"), (stop, keep)
            assert whole["matched_stop"] == stop
            (streamed,) = _streamed_choices(
                events(spec_served, COMPLETIONS, {**body, "stream": True}), COMPLETIONS
            ).values()
            assert streamed["text"] == want, (stop, keep)
            assert [f["matched_stop"] for f in streamed["finishes"]] == [stop]


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_inside_an_accepted_chain_is_exact_with_log_probs_per_chunk(
    spec_served, greedy, max_tokens
):
    body = {**GREEDY, "max_tokens": max_tokens, "return_token_ids": True, "logprobs": 2}
    whole = _post(spec_served, COMPLETIONS, body)
    assert whole["usage"]["completion_tokens"] == max_tokens
    choice = whole["choices"][0]
    assert choice["token_ids"] == greedy["token_ids"][:max_tokens]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["tokens"]) == max_tokens
    chunks = events(
        spec_served,
        COMPLETIONS,
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    *steps, last = chunks
    assert last["usage"]["completion_tokens"] == max_tokens
    for chunk in steps:  # each chunk's log-probs are those of its own tokens
        (c,) = chunk["choices"]
        assert len((c["logprobs"] or {"tokens": []})["tokens"]) == len(c["token_ids"]), c
    (streamed,) = _streamed_choices(steps, COMPLETIONS).values()
    assert streamed["ids"] == choice["token_ids"] and streamed["text"] == choice["text"]
    assert [f["finish_reason"] for f in streamed["finishes"]] == ["length"]


def test_stop_tokens_inside_a_chain_and_min_tokens_with_eos(spec_served, greedy):
    full = greedy["token_ids"]
    k = next(i for i in range(5, len(full)) if full[i] not in full[:i])
    body = {**GREEDY, "stop_token_ids": [full[k]], "return_token_ids": True}
    for stream in (False, True):
        if stream:
            chunks = events(spec_served, COMPLETIONS, {**body, "stream": True})
            got = _streamed_choices(chunks, COMPLETIONS)
            ids, reason = got[0]["ids"], got[0]["finishes"][0]["finish_reason"]
        else:
            choice = _post(spec_served, COMPLETIONS, body)["choices"][0]
            ids, reason = choice["token_ids"], choice["finish_reason"]
        assert (ids, reason) == (full[: k + 1], "stop")
    # EOS as likely as can be: drawn at the first position min_tokens allows it, mid-chain
    eos = {
        **GREEDY,
        "ignore_eos": False,
        "logit_bias": {str(EOS_ID): 100},
        "return_token_ids": True,
    }
    for min_tokens in (0, 5, 9):
        choice = _post(spec_served, COMPLETIONS, {**eos, "min_tokens": min_tokens})["choices"][0]
        assert len(choice["token_ids"]) == min_tokens + 1
        assert choice["token_ids"][-1] == EOS_ID and EOS_ID not in choice["token_ids"][:-1]
        assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", EOS_ID)


def test_chat_stream_of_n_seeded_choices_equals_the_unstreamed_answer(spec_served):
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 21,
        "temperature": 0.3,
        "seed": 3,
        "n": 3,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
    }
    whole = _post(spec_served, CHAT, body)
    assert whole["usage"]["spec_accept_length"] > 1
    chunks = events(
        spec_served, CHAT, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    for chunk in chunks[:-1]:
        (c,) = chunk["choices"]
        entries = (c["logprobs"] or {"content": []})["content"]
        assert len(entries) == len(c.get("token_ids") or []), c
        assert all(len(e["top_logprobs"]) == 2 for e in entries)
    streamed = _streamed_choices(chunks[:-1], CHAT)
    assert sorted(streamed) == [0, 1, 2]
    for i, choice in enumerate(whole["choices"]):
        assert streamed[i]["text"] == choice["message"]["content"]
        assert streamed[i]["ids"] == choice["token_ids"] and len(choice["token_ids"]) == 21
        assert [f["finish_reason"] for f in streamed[i]["finishes"]] == ["length"]
    alone = _post(spec_served, CHAT, {**body, "n": 1})["choices"][0]
    assert alone["token_ids"] == whole["choices"][0]["token_ids"]


def test_a_client_leaving_a_speculative_stream_aborts_every_choice(spec_served):
    before = spec_served.wait_idle()
    body = {**GREEDY, "max_tokens": 200, "temperature": 0.7, "n": 2, "stream": True}
    pace = lambda core: time.sleep(0.02)  # noqa: E731  (the stream outlasts the client)
    spec_served.engine.step_hooks.append(pace)
    try:
        with httpx.Client(base_url=spec_served.url, timeout=30) as http:
            with http.stream("POST", COMPLETIONS, json=body) as resp:
                assert resp.status_code == 200
                seen = 0
                lines = resp.iter_lines()  # (kept: a dropped iterator closes the connection)
                for line in lines:
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break
                assert spec_served.engine.stats()["num_running_requests"] == 2
        after = spec_served.wait_idle()
    finally:
        spec_served.engine.step_hooks.remove(pace)
    assert after["specserve_num_running_requests"] == 0
    assert after["specserve_num_inflight_requests"] == 0
    aborted = 'specserve_requests_total{finish_reason="abort"}'
    assert after[aborted] == before[aborted] + 2


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_stop_reason_names_what_the_request_asked_to_stop_at(spec_served, route):
    """vLLM's `stop_reason` beside SGLang's `matched_stop`: the stop string or stop token id
    that ended the choice; null for EOS and for length (matched_stop names EOS's id),
    unstreamed and on the finishing chunk."""
    base = dict(GREEDY)
    if route == CHAT:
        base = {k: v for k, v in GREEDY.items() if k != "prompt"}
        base["messages"] = [{"role": "user", "content": PROMPT}]
    answer = _post(spec_served, route, {**base, "return_token_ids": True})["choices"][0]
    text = answer["text"] if route == COMPLETIONS else answer["message"]["content"]
    full = answer["token_ids"]
    k = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    eos = {"ignore_eos": False, "logit_bias": {str(EOS_ID): 100}, "min_tokens": 4}
    cases = [  # (extra fields, matched_stop, stop_reason)
        ({"stop": [stop]}, stop, stop),
        ({"stop_token_ids": [full[k]]}, full[k], full[k]),
        (eos, EOS_ID, None),
        ({}, None, None),  # (length)
    ]
    for extra, matched, reason in cases:
        body = {**base, **extra}
        choice = _post(spec_served, route, body)["choices"][0]
        assert (choice["matched_stop"], choice["stop_reason"]) == (matched, reason), extra
        chunks = events(spec_served, route, {**body, "stream": True})
        (finish,) = _streamed_choices(chunks, route)[0]["finishes"]
        assert (finish["matched_stop"], finish["stop_reason"]) == (matched, reason), extra
