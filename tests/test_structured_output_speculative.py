"""Structured output under speculative decoding, against the constraint's own meaning: an
output that finishes "stop" satisfies its JSON schema (checked on the parsed value) or
matches its regex fully as Python's `re` reads it (the dialect of SGLang and vLLM), or the
request is refused naming its field. Float32 on the CPU, the tiny random model and EAGLE
draft of tests/test_structured_output.py."""

from __future__ import annotations

import json
import re

import pytest

from specserve import Engine, InvalidArgument
from tests.test_structured_output import _tree, models  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def engine(models):  # noqa: F811 (the imported fixture)
    folder, draft = models
    with Engine(model_path=folder, device="cpu", **_tree(draft, 3, 2, 6)) as e:
        yield e


def _newline_favoured(engine) -> dict:
    """Sampling parameters under which the model would write newlines wherever allowed."""
    (newline,) = engine.tokenizer.encode("\n", add_special_tokens=False)
    return {"temperature": 0, "max_new_tokens": 8, "logit_bias": {str(newline): 50.0}}


def test_a_regex_dot_never_matches_a_newline(engine):
    """xgrammar's '.' took a newline, where Python's re (and the check a client runs) does
    not: "a.{3}" finished "stop" with "a\\n\\n\\n". Dots inside a class or escaped stay
    literal dots, and a class may still allow the newline."""
    sp = _newline_favoured(engine)
    for regex in ("a.{3}", "(x|.)b", "a[^b]", r"a[.]\.", r"a[\n.]"):
        out = engine.generate(prompt="hi", sampling_params={**sp, "regex": regex})
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (regex, out)
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])
    out = engine.generate(prompt="hi", sampling_params={**sp, "regex": "a[^b]"})
    assert out["text"] == "a\n"  # (a class is as written: it allows the favoured newline)


def test_multiple_of_on_numbers_is_refused_and_on_integers_enforced(engine):
    """multipleOf compiled to nothing on a number, or with a fraction on an integer: outputs
    such as 964445 finished "stop" against multipleOf 3."""
    for schema in (
        {"type": "number", "multipleOf": 3},
        {"type": ["number", "null"], "multipleOf": 3},
        {"type": "integer", "multipleOf": 2.5},
        {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}},
    ):
        with pytest.raises(InvalidArgument) as info:
            engine.generate(prompt="hi", sampling_params={"json_schema": schema})
        assert info.value.field == "json_schema" and "multipleOf" in str(info.value)
    schema = {"type": "integer", "multipleOf": 3}
    for seed in range(4):
        sp = {"json_schema": schema, "temperature": 1.0, "seed": seed, "max_new_tokens": 16}
        out = engine.generate(prompt="{", sampling_params=sp)
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert json.loads(out["text"]) % 3 == 0, out["text"]


def test_a_raw_newline_in_a_regex_class_is_served(engine):
    """Python's re takes a newline character inside a class; xgrammar refused it with "EBNF
    lexer error ... Character class should not contain newline", a grammar the client never
    wrote."""
    sp = _newline_favoured(engine)
    for regex in ("a[\n]", "a[^\nb]x", "a\nb"):
        out = engine.generate(prompt="hi", sampling_params={**sp, "regex": regex})
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (regex, out)
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])


@pytest.mark.parametrize("speculative", [True, False], ids=["tree", "plain"])
def test_a_stop_token_waits_for_a_repeated_negated_class_or_dot_to_match(engine, speculative):
    """xgrammar allowed the stop token where a trailing `[^a]+`, `.+`, `\\S+` or
    `[^,]{1,4}` had matched nothing yet (and `x[^a]+` after the x): with EOS favoured, ""
    and "x" finished "stop", which Python's re refuses."""
    eos = engine.tokenizer.eos_token_id
    sp = {"temperature": 0, "max_new_tokens": 8, "logit_bias": {str(eos): 100.0}}
    sp["speculative"] = speculative
    for regex in (".+", "[^a]+", r"\S+", "[^,]{1,4}", "x[^a]+", "[^a]{2,}"):
        out = engine.generate(prompt="hi", sampling_params={**sp, "regex": regex})
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (regex, out)
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])


def test_a_dot_or_negated_class_takes_no_surrogate_bytes(engine):
    """xgrammar's '.', negated classes and ranges spanning surrogates (of a regex, and of a
    schema's pattern) took the three UTF-8-style bytes of a surrogate
    (ED A0 80), which no text holds: "a.b" finished "stop" as 'a\\ufffd\\ufffd\\ufffdb'."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = engine.tokenizer
    as_char = bytes_to_unicode()
    ids = [tok.convert_tokens_to_ids(as_char[b]) for b in (0xED, 0xA0, 0x80)]
    bias = {str(t): w for t, w in zip(ids, (50.0, 45.0, 40.0))}
    bias[str(tok.encode("b", add_special_tokens=False)[0])] = 30.0
    for regex in ("a.b", "a[^x]b", r"a\Sb", r"a[\u0080-\uffff]b"):
        sp = {"regex": regex, "temperature": 0, "max_new_tokens": 8, "logit_bias": bias}
        out = engine.generate(prompt="hi", sampling_params=sp)
        assert "\ufffd" not in out["text"] and re.fullmatch(regex, out["text"]), out["text"]
    for pattern in ("^a.b$", "^a[^x]b$"):  # (a schema's pattern likewise)
        schema = {"type": "string", "pattern": pattern}
        sp = {"json_schema": schema, "temperature": 0, "max_new_tokens": 10, "logit_bias": bias}
        out = engine.generate(prompt="hi", sampling_params=sp)
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        value = json.loads(out["text"])
        assert "\ufffd" not in value and re.search(pattern, value), out["text"]
