"""What a request's text is when it stops: the text of a stopping token (EOS,
`stop_token_ids`) is not part of it, a stop string is cut at its first place in the text,
and a stream holds back only text that could still begin a stop string. The same with
speculation (several tokens a step), streamed or not, decoded live or at the end."""

from __future__ import annotations

import random

import pytest

from specserve import Engine
from specserve.runtime.output import request_output, stop_string_start
from specserve.runtime.request import Request
from specserve.sampling_params import SamplingParams
from tests.engine_utils import spec_args
from tests.model_factory import write_hf_model

PROMPT = "the quick brown fox"
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("m") / "m", vocab_size=300, with_tokenizer=True)


def _standalone(model: str, topk: int, steps: int, tokens: int) -> dict:
    """The target drafting for itself: its drafts are accepted, many tokens a step."""
    return spec_args(model, topk, steps, tokens, algorithm="STANDALONE")


def _texts(engine, params: dict) -> list[str]:
    """The text non-streamed, and the streamed pieces joined."""
    whole = engine.generate(prompt=PROMPT, sampling_params=params)
    pieces = engine.generate(prompt=PROMPT, sampling_params=params, stream=True)
    return [whole["text"], "".join(p["text"] for p in pieces)], whole


@pytest.mark.parametrize("speculative", [False, True])
def test_a_stop_tokens_text_is_not_part_of_the_text(model, speculative):
    extra = _standalone(model, 2, 3, 6) if speculative else {}
    with Engine(model_path=model, dtype="float32", device="cpu", **extra) as e:
        full = e.generate(prompt=PROMPT, sampling_params=GREEDY)["output_ids"]
        k = next(
            i
            for i in range(3, len(full))
            if full[i] not in full[:i] and e.tokenizer.decode(full[i])
        )
        before = e.generate(prompt=PROMPT, sampling_params={**GREEDY, "max_new_tokens": k})
        for stop in ([], ["\x00never"]):  # (decoded at the end; decoded live, as stops need)
            params = {**GREEDY, "stop_token_ids": [full[k]], "stop": stop}
            texts, out = _texts(e, params)
            assert out["output_ids"] == full[: k + 1]
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[k]}
            assert texts == [before["text"]] * 2


@pytest.mark.parametrize("speculative", [False, True])
def test_no_stop_trim_keeps_the_stop_string_and_the_stopping_tokens_text(model, speculative):
    extra = _standalone(model, 2, 3, 6) if speculative else {}
    with Engine(model_path=model, dtype="float32", device="cpu", **extra) as e:
        free = e.generate(prompt=PROMPT, sampling_params=GREEDY)
        full, text = free["output_ids"], free["text"]
        k = next(
            i
            for i in range(3, len(full))
            if full[i] not in full[:i] and e.tokenizer.decode(full[i])
        )
        upto = e.generate(prompt=PROMPT, sampling_params={**GREEDY, "max_new_tokens": k + 1})
        for stop in ([], ["\x00never"]):  # (decoded at the end; decoded live)
            params = {**GREEDY, "stop_token_ids": [full[k]], "stop": stop, "no_stop_trim": True}
            texts, out = _texts(e, params)
            assert out["output_ids"] == full[: k + 1]
            assert texts == [upto["text"]] * 2  # (the stopping token's text too)
        word = text[len(text) // 3 : len(text) // 3 + 3]
        cut = text.find(word)
        texts, out = _texts(e, {**GREEDY, "stop": [word], "no_stop_trim": True})
        assert texts == [text[: cut + len(word)]] * 2
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}


def test_the_stop_string_first_in_the_text_ends_it(model):
    """Two stop strings completing at the same character: the text is cut at the one that
    begins first, though the other is listed first."""
    sampled = {"temperature": 1.0, "seed": 7, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(
        model_path=model, dtype="float32", device="cpu", **_standalone(model, 1, 4, 5)
    ) as e:
        text = e.generate(prompt=PROMPT, sampling_params=sampled)["text"]
        # early = text[i:j] and late = its last character, both new at j
        i, j = next(
            (i, j)
            for j in range(2, len(text))
            for i in range(j - 1)
            if text[j - 1] not in text[: j - 1] and text[i:j] not in text[: j - 1]
            and text.find(text[i:j]) == i
        )  # fmt: skip
        early, late = text[i:j], text[j - 1]
        texts, out = _texts(e, {**sampled, "stop": [late, early]})
    assert texts == [text[:i]] * 2
    assert out["meta_info"]["finish_reason"]["matched"] == early


def test_a_stream_holds_back_only_what_could_begin_a_stop_string():
    req = Request(
        rid="r",
        prompt_ids=[1],
        params=SamplingParams(stop=["world!", "Observation: the tool returned"]),
        seed=0,
    )
    req.output_ids, req.text = [5, 6], "Hello wor"
    assert request_output(req, incremental=True)["text"] == "Hello "
    req.output_ids.append(7)
    req.text += "ds apart"
    assert request_output(req, incremental=True)["text"] == "words apart"
    assert stop_string_start("an Obs", ["Observation: x", "bs!"]) == 3
    assert stop_string_start("nothing", ["Observation"]) == 0


@pytest.mark.parametrize("seed", range(3))
def test_long_stop_strings_are_held_back_as_the_text_grows_as_when_looked_for_anew(seed):
    from specserve.runtime.output import LONG_STOP, StopStringTails

    rng = random.Random(seed)
    for _ in range(300):
        alphabet = rng.choice(["ab", "abc", "a\n"])

        def word(n, alphabet=alphabet):
            return "".join(rng.choice(alphabet) for _ in range(n))

        stops = [word(rng.randrange(1, 3 * LONG_STOP)) for _ in range(rng.randrange(1, 5))]
        tails, text = StopStringTails(stops), ""
        for _ in range(8):
            text += word(rng.randrange(0, 2 * LONG_STOP))
            assert tails.hold(text) == stop_string_start(text, stops), (stops, text)


@pytest.mark.parametrize("reason", ["length", "stop token"])
def test_a_stop_string_in_text_held_back_to_the_end_still_stops_it(reason):
    """Bytes that never form a character decode to U+FFFD and are held back as an incomplete
    character would be, until the request ends: a stop string in them still cuts the text
    and is the reason, whatever ended the request."""
    from specserve.runtime.stop import StopChecker
    from specserve.server.logprobs import TokenBytes
    from tests.model_factory import build_tokenizer

    tok = build_tokenizer(300)
    raw = TokenBytes(tok, 300)
    stray = next(t for t in range(300) if raw(t) == b"\x80")  # a continuation byte, alone
    letter = tok.convert_tokens_to_ids("h")
    tokens = [letter] + [stray] * 4 + ([2] if reason == "stop token" else [])
    params = SamplingParams(max_new_tokens=len(tokens), stop=["\ufffd\ufffd"])
    req = Request(rid="r", prompt_ids=[1, letter], params=params, seed=0)
    checker = StopChecker(tok, eos_token_ids={2}, context_len=64)
    assert checker.append_tokens(req, tokens) == len(tokens)
    assert req.finish_reason == {"type": "stop", "matched": "\ufffd\ufffd"}
    assert req.text == "h"


@pytest.mark.parametrize("stops", [["ab"], ["ab", "zzzz"]])
def test_a_stop_string_ending_among_the_first_tokens_never_stops_the_request(stops):
    """min_new_tokens: a stop string that ended among the first tokens was found by the next
    token's check when a longer stop string widened its search, cutting text a stream had
    already sent."""
    from specserve.runtime.stop import StopChecker
    from tests.model_factory import build_tokenizer

    tok = build_tokenizer(300)
    tokens = [tok.convert_tokens_to_ids(c) for c in "xabcd"]
    params = SamplingParams(max_new_tokens=10, min_new_tokens=3, stop=stops)
    req = Request(rid="r", prompt_ids=[1], params=params, seed=0)
    checker = StopChecker(tok, eos_token_ids={2}, context_len=64)
    assert checker.append_tokens(req, tokens) == len(tokens)
    assert not req.finished and req.text == "xabcd"
