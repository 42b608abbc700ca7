"""SGLang's native /generate at its edges: a batch's per-prompt sampling parameters (as SGLang
and the offline `Engine.generate` take them) and the errors for request ids. A tiny random
model with a real tokenizer, served in this process.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests import test_server_openai_compat as compat

served = compat.served  # (the same fixture: a tiny model with a real tokenizer, per module)


@pytest.fixture(scope="module")
def http(served):
    return served.http


@pytest.fixture(scope="module")
def engine(served):
    return served.engine


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text[:300]
    return r.json()["error"]


GREEDY = {"temperature": 0, "max_new_tokens": 3}


def test_a_batch_takes_one_sampling_params_object_per_prompt(http, engine):
    """SGLang's `sampling_params: [{...}, {...}]` for a batch: each prompt runs with its own,
    and the answer is the offline Engine.generate's for the same call."""
    per_prompt = [{**GREEDY, "max_new_tokens": 2}, {**GREEDY, "max_new_tokens": 5, "n": 2}]
    r = http.post("/generate", json={"text": ["a b", "c d"], "sampling_params": per_prompt})
    assert r.status_code == 200, r.text[:300]
    outs = r.json()
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 5, 5]
    offline = engine.generate(["a b", "c d"], per_prompt)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in offline]


def test_per_prompt_sampling_params_errors_name_the_entry(http):
    body = {"input_ids": [[5, 6], [7, 8]]}
    err = error_of(http.post("/generate", json={**body, "sampling_params": [GREEDY]}))
    assert err["param"] == "sampling_params"
    assert "1 entries for 2 prompt" in err["message"], err
    err = error_of(http.post("/generate", json={**body, "sampling_params": []}))
    assert err["param"] == "sampling_params"
    bad = [GREEDY, {"temperature": -1}]
    err = error_of(http.post("/generate", json={**body, "sampling_params": bad}))
    assert err["param"] == "sampling_params[1].temperature", err
    err = error_of(http.post("/generate", json={**body, "sampling_params": [GREEDY, {"x": 1}]}))
    assert err["param"] == "sampling_params[1].x", err
    assert "max_new_tokens" in err["message"]  # the allowed names
    long = [GREEDY, {"max_new_tokens": 500}]
    err = error_of(http.post("/generate", json={**body, "sampling_params": long}))
    assert err["param"] == "sampling_params[1].max_new_tokens", err
    # errors found when the entry's request is built (its grammar compiled) too
    for bad, field in (({"regex": "("}, "regex"), ({"json_schema": "{bad"}, "json_schema"),
                       ({"regex": "a", "min_new_tokens": 2}, "min_new_tokens")):  # fmt: skip
        err = error_of(http.post("/generate", json={**body, "sampling_params": [GREEDY, bad]}))
        assert err["param"] == f"sampling_params[1].{field}", (bad, err)
    # neither an object nor a list: the error says which shapes are taken
    err = error_of(http.post("/generate", json={**body, "sampling_params": 3}))
    assert err["param"] == "sampling_params" and "list" in err["message"], err
    # the single-object form still names its fields as before
    err = error_of(http.post("/generate", json={**body, "sampling_params": {"top_p": 2}}))
    assert err["param"] == "sampling_params.top_p", err


def test_a_list_of_rids_for_one_prompt_is_refused_with_a_message_that_says_why(http):
    err = error_of(http.post("/generate", json={"text": "a", "rid": ["x"], **{}}))
    assert err["param"] == "rid"
    # (it said "has 1 ids for 1 prompt(s)": a count that matches, so no reason at all)
    assert not re.search(r"has (\d+) ids for \1 prompt", err["message"]), err
    assert "string" in err["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"text": [], "sampling_params": GREEDY},
        {"text": [], "sampling_params": []},
        {"input_ids": [], "sampling_params": [GREEDY]},
        {"input_ids": [[]], "sampling_params": GREEDY},
    ],
)
def test_an_empty_batch_is_refused_naming_the_prompt_field(http, body):
    err = error_of(http.post("/generate", json=body))
    assert err["param"] in ("text", "input_ids", "sampling_params"), err


def test_per_prompt_n_counts_the_samples_asked_not_the_largest_n_times_the_prompts(http):
    """40 prompts, one sampled 64 times: 103 requests, well within the server's 2048 a
    request; counted as 40 x 64 = 2560 it was refused."""
    one = {"temperature": 0, "max_new_tokens": 1}
    params = [{**one, "n": 64}] + [one] * 39
    r = http.post("/generate", json={"input_ids": [[5, 6]] * 40, "sampling_params": params})
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()) == 103
