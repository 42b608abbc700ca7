"""Log-probs and n over HTTP, with the openai client and httpx, against transformers.

A tiny random model with a real tokenizer (byte-level BPE, ChatML template): chat
`logprobs`/`top_logprobs` (streamed too), completions `logprobs` with `echo` and `max_tokens: 0`
(prompt scoring as lm-evaluation-harness asks for it), n choices, /generate's SGLang fields.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from specserve.engine import Engine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from tests.model_factory import hf_logits, load_hf_model, write_hf_model
from tests.test_server import ServerThread

TOL = 1e-4
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = write_hf_model(
        tmp_path_factory.mktemp("srv_lp") / "m", vocab_size=320, with_tokenizer=True, seed=4
    )
    engine = Engine(model_path=folder, dtype="float32", device="cpu", max_total_tokens=2048)
    app = create_app(engine, ServerConfig(served_model_name="m"), owns_engine=True)
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=60)
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            yield engine, load_hf_model(folder), client, http


def reference(hf, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(hf, ids), dim=-1)


def close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=TOL, rtol=0)


def test_chat_logprobs_match_transformers(served):
    engine, hf, client, _ = served
    out = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = out.choices[0]
    prompt = engine.tokenize_chat(MESSAGES)
    ids = choice.token_ids
    ref = reference(hf, prompt + ids)
    content = choice.logprobs.content
    assert len(content) == len(ids) == 6
    close(
        [c.logprob for c in content],
        [ref[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids)],
    )
    # a client joining the tokens' bytes gets the answer's text (byte-level tokens of this
    # vocabulary often hold part of a character)
    joined = bytes(b for c in content for b in c.bytes).decode("utf-8", errors="replace")
    assert joined == engine.tokenizer.decode(ids)
    for j, (c, t) in enumerate(zip(content, ids)):
        assert c.token == engine.tokenizer.decode([t])
        if "\ufffd" not in c.token:
            assert c.bytes == list(c.token.encode("utf-8"))
        values, top_ids = ref[len(prompt) - 1 + j].topk(3)
        assert [x.token for x in c.top_logprobs] == [engine.tokenizer.decode([i]) for i in top_ids]
        close([x.logprob for x in c.top_logprobs], values.tolist())
        assert c.logprob == c.top_logprobs[0].logprob  # greedy: exactly the top-1 value

    streamed = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    entries = [
        e
        for ch in streamed
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    # (the stream's prompt comes from the prefix cache: the same values up to float rounding)
    assert [e.token for e in entries] == [c.token for c in content]
    close([e.logprob for e in entries], [c.logprob for c in content])


def test_chat_n_choices_streamed_and_not(served):
    _, _, client, _ = served
    args = dict(model="m", messages=MESSAGES, max_tokens=5, temperature=1.0, seed=3, n=3)
    out = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1
    assert out.usage.completion_tokens == 15
    one = client.chat.completions.create(**{**args, "n": 1}, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert one.choices[0].message.content == texts[0]  # sample 0 uses the seed itself
    parts: dict[int, str] = {0: "", 1: "", 2: ""}
    finished = set()
    for ch in client.chat.completions.create(**args, stream=True, extra_body={"ignore_eos": True}):
        for c in ch.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert [parts[i] for i in range(3)] == texts


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_completion_echo_scores_the_prompt_as_lm_eval_reads_it(served, max_tokens):
    engine, hf, client, _ = served
    text = "the quick brown fox"
    out = client.completions.create(
        model="m", prompt=text, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
    )
    lp = out.choices[0].logprobs
    prompt = engine.tokenizer.encode(text)
    assert out.choices[0].text.startswith(text)
    assert len(lp.tokens) == len(prompt) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(hf, prompt + ([] if max_tokens == 0 else [int(ref_argmax(hf, prompt))]))
    want = [ref[i - 1, t].item() for i, t in enumerate(prompt) if i > 0]
    close(lp.token_logprobs[1 : len(prompt)], want)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for i in range(1, len(prompt)):
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and 1 <= len(top) <= 2  # the chosen and the likeliest
        assert max(top.values()) == pytest.approx(ref[i - 1].max().item(), abs=TOL)
    if max_tokens:  # lm-eval's is_greedy: the generated (greedy) token equals its top value
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())


def ref_argmax(hf, prompt: list[int]) -> int:
    return hf_logits(hf, prompt)[-1].argmax().item()


def test_completion_logprobs_stream_and_n(served):
    _, _, client, http = served
    body = {
        "prompt": "hello",
        "max_tokens": 4,
        "logprobs": 2,
        "echo": True,
        "n": 2,
        "seed": 5,
        "ignore_eos": True,
    }
    whole = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    tokens = {0: [], 1: []}
    values = {0: [], 1: []}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                if c["logprobs"]:
                    tokens[c["index"]] += c["logprobs"]["tokens"]
                    values[c["index"]] += c["logprobs"]["token_logprobs"]
    for c in whole["choices"]:
        assert tokens[c["index"]] == c["logprobs"]["tokens"]
        assert values[c["index"]] == c["logprobs"]["token_logprobs"]
        assert all(len(t) <= 3 for t in c["logprobs"]["top_logprobs"][1:])


def test_generate_sglang_fields(served):
    engine, hf, _, http = served
    body = {
        "input_ids": [1, 40, 50, 60],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == [40, 50, 60]
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["output_token_logprobs"][0][2] == engine.tokenizer.decode(
        [meta["output_token_logprobs"][0][1]]
    )
    assert all(len(t) == 2 for t in meta["output_top_logprobs"])
    two = http.post(
        "/generate", json={**body, "sampling_params": {**body["sampling_params"], "n": 2}}
    )
    assert isinstance(two.json(), list) and len(two.json()) == 2
    bad = http.post("/generate", json={**body, "logprob_start_len": 4})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_start_len"


def test_generate_batch_takes_logprob_options_per_prompt(served):
    """As SGLang: a batch's return_logprob, top_logprobs_num and logprob_start_len may be
    lists of one per prompt; each prompt gets what it asked for, and a list of another
    length, or a bad entry, is refused naming the field."""
    _, _, _, http = served
    body = {
        "input_ids": [[1, 40, 50, 60], [1, 70, 80]],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        "return_logprob": [True, False],
        "top_logprobs_num": [2, 0],
        "logprob_start_len": [1, -1],
    }
    first, second = (o["meta_info"] for o in http.post("/generate", json=body).json())
    assert [e[1] for e in first["input_token_logprobs"]] == [40, 50, 60]
    assert len(first["output_token_logprobs"]) == 3
    assert all(len(t) == 2 for t in first["output_top_logprobs"])
    assert "output_token_logprobs" not in second or not second["output_token_logprobs"]
    both = http.post("/generate", json={**body, "return_logprob": True, "top_logprobs_num": 1})
    second = both.json()[1]["meta_info"]
    assert len(second["output_token_logprobs"]) == 3 and not second.get("input_token_logprobs")
    assert all(len(t) == 1 for t in second["output_top_logprobs"])
    for field, value in [
        ("top_logprobs_num", [2]),
        ("top_logprobs_num", [2, 21]),
        ("return_logprob", []),
        ("logprob_start_len", [1, "x"]),
    ]:
        bad = http.post("/generate", json={**body, field: value})
        assert bad.status_code == 400, (field, value, bad.text)
        assert bad.json()["error"]["param"] == field, bad.json()


def test_logprob_fields_are_validated(served):
    _, _, client, _ = served
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=MESSAGES, logprobs=True, top_logprobs=21)
    assert exc.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=MESSAGES, top_logprobs=2)
    assert exc.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="m", prompt="a", logprobs=6)
    assert exc.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="m", prompt="a", n=65)
    assert exc.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="m", prompt="a", best_of=2)
    assert exc.value.body["param"] == "best_of"


def test_completion_top_logprobs_of_tokens_sharing_a_string_keep_the_likeliest():
    """Bytes of split characters all show as U+FFFD: a position's top_logprobs, keyed by
    string, keeps the likeliest of them, not whichever came last."""
    from specserve.server.logprobs import CompletionLogprobs, TokenStrings

    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return "\ufffd" if ids[0] >= 200 else f"t{ids[0]}"

    meta = {
        "output_token_logprobs": [(-0.5, 201, None)],
        "output_top_logprobs": [[(-0.5, 201, None), (-1.5, 7, None), (-1.7, 202, None)]],
    }
    part = CompletionLogprobs(TokenStrings(Bytes())).part(meta, with_prompt=False)
    assert part["tokens"] == ["\ufffd"] and part["token_logprobs"] == [-0.5]
    assert part["top_logprobs"] == [{"\ufffd": -0.5, "t7": -1.5}]


@pytest.mark.parametrize("vocab_size", [320, 1000])
def test_chat_bytes_of_tokens_splitting_characters_join_into_the_text(vocab_size):
    """OpenAI's `bytes`: a character split over tokens (each showing U+FFFD) comes back whole
    when a client joins the tokens' bytes."""
    from specserve.server.logprobs import TokenBytes, TokenStrings, chat_content
    from tests.model_factory import build_tokenizer

    tok = build_tokenizer(vocab_size)
    text = "naïve café, 😀 ok, 東京"
    ids = tok.encode(text, add_special_tokens=False)
    strings = TokenStrings(tok, TokenBytes(tok, vocab_size))
    assert any("\ufffd" in strings(t) for t in ids), "the text meant to split a character"
    meta = {
        "output_token_logprobs": [(-0.1, t, None) for t in ids],
        "output_top_logprobs": [[(-0.1, t, None)] for t in ids],
    }
    content = chat_content(meta, strings)
    assert bytes(b for c in content for b in c["bytes"]) == text.encode("utf-8")
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]
    assert [c["token"] for c in content] == [tok.decode([t]) for t in ids]


def test_a_streams_finishing_chunk_names_the_stop_as_the_unstreamed_answer_does(served):
    engine, _, client, _ = served
    greedy = {"max_tokens": 12, "temperature": 0}
    ids = (
        client.completions.create(
            model="m", prompt="hello", **greedy, extra_body={"return_token_ids": True}
        )
        .choices[0]
        .token_ids
    )
    text = engine.tokenizer.decode(ids[:8])
    stops = [
        {"extra_body": {"stop_token_ids": [ids[4]]}},
        {"stop": [text[-2:]]} if text[-2:].strip() else {"stop": [text[-3:]]},
        {},  # (length: null)
    ]
    reasons = []
    for stop in stops:
        kw = dict(model="m", **greedy, **stop)
        whole = client.completions.create(prompt="hello", **kw).choices[0]
        reasons.append(whole.finish_reason)
        last = [c for c in client.completions.create(prompt="hello", stream=True, **kw)][-1]
        assert last.choices[0].finish_reason == whole.finish_reason
        assert last.choices[0].matched_stop == whole.matched_stop
        chat = dict(kw, messages=MESSAGES)
        whole = client.chat.completions.create(**chat).choices[0]
        last = [c for c in client.chat.completions.create(stream=True, **chat)][-1]
        assert last.choices[0].finish_reason == whole.finish_reason
        assert last.choices[0].matched_stop == whole.matched_stop
    assert reasons == ["stop", "stop", "length"]
    assert whole.matched_stop is None
