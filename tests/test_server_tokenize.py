"""vLLM's /tokenize and /detokenize: a text's or a chat's token ids as the completion routes
encode them (the usage they report counts the same), the text of ids, and errors naming the
field."""

from __future__ import annotations

import pytest

from specserve import Engine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from tests.test_server import ServerThread
from tests.test_server_openai_compat import CHAT, COMPLETIONS, served  # noqa: F401

TEXT = "paged kv cache and trees"
MESSAGES = [{"role": "user", "content": TEXT}]


def post(served, route: str, body: dict, status: int = 200) -> dict:  # noqa: F811
    r = served.http.post(route, json=body)
    assert r.status_code == status, r.text
    return r.json()


def test_a_text_counts_as_the_completion_route_counts_it(served):  # noqa: F811
    out = post(served, "/tokenize", {"prompt": TEXT, "model": str(served.engine.config.model_path)})
    done = post(served, COMPLETIONS, {"prompt": TEXT, "max_tokens": 1, "temperature": 0})
    assert out["count"] == len(out["tokens"]) == done["usage"]["prompt_tokens"]
    assert out["max_model_len"] == 256 and out["token_strs"] is None
    plain = post(served, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert plain["tokens"] == served.engine.tokenizer.encode(TEXT, add_special_tokens=False)
    named = post(served, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    # the vocabulary's strings, as vLLM's are (not each id decoded alone)
    assert named["token_strs"] == served.engine.tokenizer.convert_ids_to_tokens(named["tokens"])
    back = post(served, "/detokenize", {"tokens": plain["tokens"]})
    assert back["prompt"] == served.engine.tokenizer.decode(plain["tokens"])


@pytest.mark.parametrize("options", [{}, {"add_generation_prompt": False}])
def test_a_chat_counts_as_the_chat_route_counts_it(served, options):  # noqa: F811
    out = post(served, "/tokenize", {"messages": MESSAGES, **options})
    done = post(served, CHAT, {"messages": MESSAGES, "max_tokens": 1, **options})
    assert out["count"] == done["usage"]["prompt_tokens"]
    assert out["tokens"] == served.engine.tokenize_chat(MESSAGES, **options)


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "x"}, "chat_template"),
        ("/tokenize", {"prompt": TEXT, "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "ab"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_requests_name_the_field(served, route, body, param):  # noqa: F811
    status = 404 if param == "model" else 400
    err = post(served, route, body, status)["error"]
    assert err["param"] == param or err["message"].startswith(param), err
    assert post(served, "/tokenize", {"prompt": TEXT})["count"] > 0  # (still serving)


def test_token_strs_are_the_byte_level_vocabulary_strings_as_in_vllm(tmp_path):
    """With a byte-level vocabulary a token is 'Ġword' or a piece of a character's bytes:
    decoded alone it would be ' word' or U+FFFD (and several ids would read the same)."""
    import httpx

    from tests.model_factory import write_hf_model

    folder = write_hf_model(tmp_path / "m", vocab_size=300, with_tokenizer=True)
    with Engine(model_path=folder, dtype="float32", device="cpu", context_length=64) as engine:
        with ServerThread(create_app(engine, ServerConfig(), owns_engine=False)) as srv:
            body = {"prompt": "naïve kv 北", "return_token_strs": True}
            out = httpx.post(srv.url + "/tokenize", json=body).json()
    tok = engine.tokenizer
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    assert out["token_strs"] != [tok.decode([t]) for t in out["tokens"]]
