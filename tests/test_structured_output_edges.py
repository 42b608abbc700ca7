"""Structured output at its edges: hostile grammars (schemas nested past Python's stack,
NaN, regex escapes the compiler would read as letters) are refused with a short message
naming their field, and the engine goes on serving. Float32 on the CPU, a tiny byte-level
tokenizer."""

from __future__ import annotations

import json
import re

import pytest

from specserve import Engine, InvalidArgument
from tests.model_factory import write_hf_model

GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_hf_model(
        tmp_path_factory.mktemp("edges") / "m", vocab_size=300, with_tokenizer=True
    )


@pytest.fixture(scope="module")
def engine(folder):
    with Engine(model_path=folder, device="cpu", dtype="float32") as e:
        yield e


def test_a_schema_nested_past_pythons_stack_is_refused_naming_its_field(engine):
    """Deeply nested schema text (or a dict) raised a bare RecursionError from the caller's
    generate (an internal error on a server) instead of a client error."""
    deep_text = '{"items":' * 5000 + "{}" + "}" * 5000
    deep_dict: dict = {}
    inner = deep_dict
    for _ in range(5000):
        inner["items"] = {}
        inner = inner["items"]
    for schema in (deep_text, "[" * 5000 + "]" * 5000, deep_dict):
        with pytest.raises(InvalidArgument) as info:
            engine.generate(prompt="hi", sampling_params={**GREEDY, "json_schema": schema})
        assert info.value.field == "json_schema" and "nested too deeply" in str(info.value)
    out = engine.generate(prompt="hi", sampling_params={**GREEDY, "regex": "ok"})
    assert out["text"] == "ok"


def test_a_regex_escape_the_grammar_would_read_as_a_letter_is_refused(engine):
    """xgrammar reads an escaped letter it does not know as that letter: Python's anchors
    \\A ... \\Z compiled, and the output began with "A" and finished "stop"."""
    for regex, escape in ((r"\A[a-z]+\Z", r"\A"), (r"[0-9]+\z", r"\z"), (r"x[\h]", r"\h")):
        with pytest.raises(InvalidArgument) as info:
            engine.generate(prompt="hi", sampling_params={**GREEDY, "regex": regex})
        assert info.value.field == "regex" and escape in str(info.value), str(info.value)
    # an escaped backslash before a letter, and the escapes the grammar reads, still serve
    out = engine.generate(prompt="hi", sampling_params={**GREEDY, "regex": r"\\A\t\x41\d"})
    assert out["text"][:4] == "\\A\tA" and out["text"][4].isdigit()


def test_a_regex_the_grammar_reads_otherwise_than_python_is_refused(engine):
    """Each compiled, and an output finishing "stop" broke Python's re.fullmatch: \\01 read as
    \\0 then 1, an anchor inside the pattern ignored, \\W letting in "é" (a word character to
    Python's re, reading Unicode)."""
    for regex, named in ((r"a\01", "octal"), (r"(a)\1", "backreference"), ("a$b", "anchor"),
                         ("x(^a)", "anchor"), (r"a\Wc", r"\W"), (r"[^\d]", r"\d in a class"),
                         ("a(?=b)b", "(?=")):  # fmt: skip
        with pytest.raises(InvalidArgument) as info:
            engine.generate(prompt="hi", sampling_params={**GREEDY, "regex": regex})
        assert info.value.field == "regex" and named in str(info.value), str(info.value)


def test_a_non_space_is_not_a_space_of_any_script(engine):
    """\\S, and \\s in a negated class, are spelt out as Python's whitespace: the grammar's
    \\S, ASCII alone, let in a no-break space, which Python's \\S rejects."""
    stopped = 0
    for regex in (r"\S+@\S+", r"[^\s,]{2,5}"):
        for seed in range(3):
            sp = {"temperature": 1.0, "seed": seed, "max_new_tokens": 8, "regex": regex}
            out = engine.generate(prompt="hi", sampling_params=sp)
            if out["meta_info"]["finish_reason"]["type"] == "stop":
                stopped += 1
                assert re.fullmatch(regex, out["text"]), (regex, out["text"])
    assert stopped >= 3  # (the bounded one always completes)
    with pytest.raises(InvalidArgument, match=r"\\S in a class"):
        engine.generate(prompt="hi", sampling_params={**GREEDY, "regex": r"[a\S]"})


def test_a_class_opening_with_a_bracket_keeps_it_literal(engine):
    """[^]] is 'anything but ]' to Python's re; the grammar closed the class at the first ']'
    and served "D]" as "stop"."""
    for seed in range(3):
        sp = {"temperature": 1.0, "seed": seed, "max_new_tokens": 4, "regex": "[^]]x"}
        out = engine.generate(prompt="hi", sampling_params=sp)
        assert re.fullmatch("[^]]x", out["text"]), out["text"]
    out = engine.generate(prompt="hi", sampling_params={**GREEDY, "regex": "[]a]"})
    assert out["text"] in ("]", "a")


def test_a_schema_the_compiler_refuses_gets_a_short_message_without_its_internals(engine):
    """NaN and Infinity are no JSON: xgrammar's refusal echoed the whole schema back, and a
    failed range check came with its C++ condition."""
    padding = {f"p{i}": {"type": "string"} for i in range(2000)}
    big = {"type": "object", "properties": {**padding, "x": {"type": "number", "minimum": 0}}}
    text = json.dumps(big).replace('"minimum": 0', '"minimum": NaN')
    for schema in (text, {**big, "properties": {"x": {"type": "number", "minimum": float("inf")}}}):
        with pytest.raises(InvalidArgument) as info:
            engine.generate(prompt="hi", sampling_params={**GREEDY, "json_schema": schema})
        message = str(info.value)
        assert info.value.field == "json_schema" and len(message) < 300, message[:300]
        assert "NaN" in message or "Infinity" in message or "JSON" in message
    with pytest.raises(InvalidArgument) as info:
        schema = {"type": "integer", "minimum": 10**30}
        engine.generate(prompt="hi", sampling_params={**GREEDY, "json_schema": schema})
    assert "Check failed" not in str(info.value) and "maximum limit" in str(info.value)


def test_a_length_bounded_string_holds_no_raw_control_character(engine):
    """The compiler's rule for a string with minLength / maxLength let control characters
    (a tab, \\x01) through raw, which JSON forbids in a string: outputs finishing "stop"
    did not parse."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 6}},
        "required": ["s"],
    }
    stopped = 0
    for seed in range(12):
        sp = {"temperature": 1.0, "seed": seed, "max_new_tokens": 64, "json_schema": schema}
        out = engine.generate(prompt="hi", sampling_params=sp)
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            stopped += 1
            value = json.loads(out["text"])["s"]  # (strict: a raw control character fails)
            assert 1 <= len(value) <= 6, out["text"]
    assert stopped >= 6


def test_a_schema_number_past_a_doubles_range_is_refused_naming_it(engine):
    """1e400 was read as infinity and the compiler failed with an empty reason."""
    for number in ("1e400", "-2E+999"):
        schema = '{"type": "number", "maximum": ' + number + "}"
        with pytest.raises(InvalidArgument) as info:
            engine.generate(prompt="hi", sampling_params={**GREEDY, "json_schema": schema})
        assert info.value.field == "json_schema" and number in str(info.value), str(info.value)
        assert "past a double's range" in str(info.value)
    schema = '{"type": "number", "minimum": 1e-400, "maximum": 2.5e3}'  # (tiny: 0.0)
    out = engine.generate(prompt="hi", sampling_params={**GREEDY, "json_schema": schema})
    assert 0 <= float(out["text"]) <= 2500


def test_a_regex_pythons_re_refuses_is_refused_naming_why(engine):
    """The grammar compiler served \\e, \\cA and [\\d-z] with meanings of its own; read as
    Python's re (as structured output promises) they are errors."""
    for regex in (r"\e", r"a\cA", r"[\d-z]+", "a{2,1}"):
        with pytest.raises(InvalidArgument) as info:
            engine.generate(prompt="hi", sampling_params={**GREEDY, "regex": regex})
        assert info.value.field == "regex", str(info.value)
        assert "not a valid regular expression" in str(info.value), str(info.value)
    schema = {"type": "string", "pattern": r"^[\d-z]+$"}
    with pytest.raises(InvalidArgument) as info:
        engine.generate(prompt="hi", sampling_params={**GREEDY, "json_schema": schema})
    assert "pattern (not a valid regular expression: bad character range" in str(info.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "enum": ["a", 1]},
        {"type": "string", "const": 1},
        {"type": "string", "anyOf": [{"type": "integer"}, {"type": "string"}]},
        {"type": "integer", "allOf": [{"type": "string"}]},
        {"type": ["string", "integer"], "enum": ["a", 1, True]},
        {"$defs": {"n": {"type": "number"}}, "type": "integer", "$ref": "#/$defs/n"},
    ],
    ids=["enum", "const", "anyOf", "allOf", "type_list", "ref"],
)
def test_a_type_beside_what_the_grammar_takes_whole_is_refused_where_it_would_be_dropped(
    engine, schema
):
    """The grammar takes enum, const, anyOf, oneOf, allOf and $ref whole and drops a type
    beside them: {"type": "string", "enum": ["a", 1]} produced 1, finishing "stop"."""
    with pytest.raises(InvalidArgument) as info:
        engine.generate(prompt="hi", sampling_params={**GREEDY, "json_schema": schema})
    whole = next(k for k in ("enum", "const", "anyOf", "allOf", "$ref") if k in schema)
    assert f"type beside {whole} at /" in str(info.value), str(info.value)


def test_a_type_that_holds_every_value_beside_it_serves(engine):
    union = {"type": "object", "oneOf": [
        {"properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
    ]}  # fmt: skip
    cases = [
        (union, lambda v: isinstance(v, dict) and set(v) in ({"a"}, {"b"})),
        ({"type": "string", "enum": ["yes", "no"]}, lambda v: v in ("yes", "no")),
        ({"type": "number", "enum": [1, 2.5]}, lambda v: v in (1, 2.5)),
        ({"type": ["integer", "null"], "anyOf": [{"type": "integer"}, {"type": "null"}]},
         lambda v: v is None or type(v) is int),
    ]  # fmt: skip
    for schema, allowed in cases:
        sp = {**GREEDY, "max_new_tokens": 24, "json_schema": schema}
        out = engine.generate(prompt="hi", sampling_params=sp)
        finish = out["meta_info"]["finish_reason"]["type"]
        if "enum" in schema:  # (a few tokens: it always ends)
            assert finish == "stop", out
        if finish == "stop":
            assert allowed(json.loads(out["text"])), (schema, out["text"])


@pytest.mark.parametrize(
    "keyword, value, what",
    [
        ("pattern", 5, "a string"),
        ("format", 5, "a string"),
        ("minimum", "5", "a number"),
        ("exclusiveMinimum", True, "a number"),
    ],
)
def test_a_keyword_value_of_the_wrong_type_is_refused_naming_the_keyword(
    engine, keyword, value, what
):
    """The compiler's own errors for these named no keyword ("pattern": 5 gave the text of
    a C++ assertion)."""
    schema = {"type": "integer" if what == "a number" else "string", keyword: value}
    with pytest.raises(InvalidArgument) as info:
        engine.generate(prompt="hi", sampling_params={**GREEDY, "json_schema": schema})
    assert f"{keyword} ({json.dumps(value)}, not {what}) at /" in str(info.value)


def test_only_a_schemas_own_pattern_keyword_is_rewritten():
    """Patterns are read as Python's re by rewriting them; data that happens to hold a
    "pattern" key (a const, an enum, a default) must keep it as written."""
    from specserve.runtime.json_schema_support import with_patterns

    schema = {
        "type": "object",
        "properties": {"pattern": {"type": "string", "pattern": "a."}},
        "items": [{"pattern": "b."}],
        "$defs": {"d": {"anyOf": [{"type": "string", "pattern": "c."}]}},
        "const": {"pattern": "kept."},
        "enum": [{"pattern": "kept."}],
        "default": {"pattern": "kept."},
    }
    out = with_patterns(schema, str.upper)
    assert out["properties"]["pattern"]["pattern"] == "A."
    assert out["items"][0]["pattern"] == "B."
    assert out["$defs"]["d"]["anyOf"][0]["pattern"] == "C."
    assert out["const"] == out["enum"][0] == out["default"] == {"pattern": "kept."}
    assert schema["properties"]["pattern"]["pattern"] == "a."  # (the caller's is left alone)


def test_a_definition_no_ref_names_is_not_refused_for_what_it_holds(engine):
    """$defs are checked where a $ref leads: an unused one with `not` constrains nothing
    (it was refused), a used one is still refused."""
    unused = {"enum": ["ok"], "$defs": {"u": {"not": {"type": "integer"}}}}
    out = engine.generate(prompt="hi", sampling_params={**GREEDY, "json_schema": unused})
    assert json.loads(out["text"]) == "ok"
    used = {"$ref": "#/$defs/u", "$defs": {"u": {"not": {"type": "integer"}}}}
    with pytest.raises(InvalidArgument) as info:
        engine.generate(prompt="hi", sampling_params={**GREEDY, "json_schema": used})
    assert "not at /$defs/u" in str(info.value)


def test_an_ipv4_format_takes_no_octet_with_a_leading_zero(engine):
    """The compiler's ipv4 rule took "44.189.010.67" (a greedy output finished "stop" so),
    which Python's ipaddress refuses; the format is given to the grammar as its pattern."""
    import ipaddress

    from specserve.runtime.grammar import GrammarCompiler, RequestGrammar

    tok = engine.tokenizer
    compiler = GrammarCompiler(tok, 300)
    schema = json.dumps({"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}},
                         "required": ["ip"]})  # fmt: skip

    def complete(address: str) -> bool:
        grammar = RequestGrammar(compiler.compile("json_schema", schema), "json_schema")
        ids = tok.encode(json.dumps({"ip": address}), add_special_tokens=False)
        return grammar.accept(ids) and grammar.accept([tok.eos_token_id]) and grammar.terminated

    for address in ("44.189.10.67", "0.0.0.0", "255.255.255.255", "44.189.010.67", "00.0.0.0",
                    "256.1.1.1", "1.2.3"):  # fmt: skip
        try:
            valid = ipaddress.IPv4Address(address) is not None
        except ValueError:
            valid = False
        assert complete(address) == valid, address


def test_the_regex_given_to_the_grammar_means_what_the_clients_regex_means():
    """`python_regex` rewrites '.', \\S, negated classes and ranges (no newline for '.', no
    surrogates): on any text without surrogates, Python's re must read both alike."""
    import random

    from specserve.runtime.regex_support import python_regex

    regexes = [r"a.b", r"a\Sb", r"[^\s,]{2,5}", r"[a-z\u0080-\uffff]+", r"[\x41-\x5a]x",
               r"[^]x]+", r"[]a]", r"x[\--/]y", r"(?:ab|c.)+", r"[^\u00e9]\.", "a\nb",
               r"\d{2}[\u00e0-\u00ff]?", r"[a-c-\uffff]+", "[\n-\r]x"]  # fmt: skip
    alphabet = "ab xyzAZ,.-/]\n\t\r\u00a0\u00e9\u2003\u4e2d\ue000\U0001f600c12"
    rng = random.Random(0)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(3000)]
    texts += ["ab", "a\u00e9b", "axb", "a\nb", "ZZx", "x-y", "x/y", "é.", "12é", "ab", "c\u4e2d"]
    for regex in regexes:
        given = re.compile(python_regex(regex))
        meant = re.compile(regex)
        for text in texts:
            assert bool(given.fullmatch(text)) == bool(meant.fullmatch(text)), (regex, text)
