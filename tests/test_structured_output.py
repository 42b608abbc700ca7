"""Structured output (a JSON schema, a regex or an EBNF grammar per request): every output
follows its grammar, speculative output under a grammar equals plain output under it (trees,
chains, load-adaptive speculation, page sizes, overlap), and a constrained request changes
nothing for the unconstrained requests beside it. Float32 on the CPU."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specserve import Engine, InvalidArgument
from specserve.model.hf_loader import load_hf_config
from specserve.ops.token_bitmask import apply_token_bitmask, apply_token_bitmask_reference
from specserve.runtime.grammar import BatchGrammar, GrammarCompiler, RequestGrammar, new_bitmask
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.model_factory import build_tokenizer, write_hf_model
from tests.test_server import Served, ServerThread
from tests.test_server_hardening import error_of

VOCAB = 300  # byte-level BPE: any text has tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["answer", "count"],
    "additionalProperties": False,
}
GRAMMARS = [
    {"regex": "(yes|no|maybe)"},
    {"regex": "[a-z]{2,6}( [0-9]{1,3}){1,3}"},
    {"json_schema": SCHEMA},
    {"ebnf": 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'},
]
PROMPTS = ["hello world", "the quick brown fox", "What is the capital of France?"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    folder = write_hf_model(root / "m", vocab_size=VOCAB, with_tokenizer=True)
    draft = write_random_eagle_checkpoint(str(root / "d"), load_hf_config(folder), "EAGLE", seed=5)
    return folder, draft


def _tree(draft: str, steps: int, topk: int, tokens: int, **extra) -> dict:
    return dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=draft,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=tokens,
        **extra,
    )


def _batch(sampling: dict) -> list[tuple[str, dict]]:
    """Every prompt under every grammar, and unconstrained requests beside them."""
    out = [(p, {**g, **sampling}) for p in PROMPTS for g in GRAMMARS]
    return out + [(p, dict(sampling)) for p in PROMPTS]


def _generate(engine, batch) -> list[dict]:
    prompts = [p for p, _ in batch]
    return engine.generate(prompt=prompts, sampling_params=[sp for _, sp in batch])


def _follows_its_grammar(engine, sp: dict, out: dict) -> None:
    """A fresh matcher takes every output token; a finished ("stop") output is complete."""
    spec = next(((k, v) for k, v in sp.items() if k in ("json_schema", "regex", "ebnf")), None)
    if spec is None:
        return
    field, text = spec
    text = json.dumps(text) if isinstance(text, dict) else text
    matcher = RequestGrammar(engine.core.grammars.compile(field, text))
    assert matcher.accept(out["output_ids"]), (sp, out["text"])
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert matcher.terminated, (sp, out["text"])
        if field == "json_schema":
            value = json.loads(out["text"])
            assert value["answer"] in ("yes", "no") and 0 <= value["count"] <= 99


GREEDY = {"temperature": 0, "max_new_tokens": 24}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def plain_outputs(models):
    folder, _ = models
    with Engine(model_path=folder, device="cpu", debug_check_invariants=True) as engine:
        outs = {}
        for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
            batch = _batch(sampling)
            outs[name] = _generate(engine, batch)
            for (_, sp), out in zip(batch, outs[name]):
                _follows_its_grammar(engine, sp, out)
        # alone, the unconstrained requests decode as beside the constrained ones
        alone = _generate(engine, [(p, GREEDY) for p in PROMPTS])
        assert [o["output_ids"] for o in alone] == [
            o["output_ids"] for o in outs["greedy"][-len(PROMPTS) :]
        ]
    # the grammars finish some outputs and leave others running to max_new_tokens
    reasons = {o["meta_info"]["finish_reason"]["type"] for o in outs["greedy"]}
    assert reasons == {"stop", "length"}, reasons
    return outs


@pytest.mark.parametrize(
    "name, engine_args",
    [
        ("tree", lambda d: _tree(d, 3, 3, 8)),
        ("chain", lambda d: _tree(d, 3, 1, 4)),
        ("tree, page size 4, no overlap", lambda d: _tree(d, 4, 2, 7, page_size=4)),
        ("adaptive", lambda d: _tree(d, 4, 4, 16, speculative_adaptive=True)),
    ],
)
def test_speculative_output_under_a_grammar_equals_plain_output(
    models, plain_outputs, name, engine_args
):
    folder, draft = models
    args = engine_args(draft)
    if "no overlap" in name:
        args["disable_overlap_schedule"] = True
    with Engine(model_path=folder, device="cpu", debug_check_invariants=True, **args) as engine:
        if engine.core.adaptive is not None:  # every tier, ragged ones included, at random
            rng, count = random.Random(3), len(engine.core.adaptive.tiers)
            engine.core.adaptive.pick = lambda b, can=True, ready=None: rng.randrange(count)
        for mode, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
            outs = _generate(engine, _batch(sampling))
            want = plain_outputs[mode]
            assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in want], mode
            assert [o["meta_info"]["finish_reason"] for o in outs] == [
                o["meta_info"]["finish_reason"] for o in want
            ]
        verified = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        assert verified > 0  # the drafts were verified, not skipped


def test_every_sample_of_a_prompt_follows_the_grammar(models):
    folder, _ = models
    with Engine(model_path=folder, device="cpu") as engine:
        sp = {"regex": "(red|green|blue)( (red|green|blue))*", "n": 4, "temperature": 1.0}
        outs = engine.generate(prompt="colors:", sampling_params=dict(sp, max_new_tokens=12))
        assert len(outs) == 4
        for out in outs:
            _follows_its_grammar(engine, sp, out)


def test_a_grammar_completed_inside_a_step_ends_the_request_there(models):
    """A draft guessing the stop token right after the root: the step's bonus draw past the
    grammar's completion is no grammar's, and is not kept (ignore_eos or not)."""
    folder, draft = models
    sp = {"regex": "a", "max_new_tokens": 8, "temperature": 0}
    with Engine(model_path=folder, device="cpu") as engine:
        plain = [
            engine.generate(prompt="hello", sampling_params={**sp, "ignore_eos": i})
            for i in (False, True)
        ]
    with Engine(model_path=folder, device="cpu", **_tree(draft, 3, 1, 4)) as engine:
        drafter, eos = engine.core.worker.step.drafter, engine.tokenizer.eos_token_id
        draft_trees = drafter.draft

        def guessing_eos(batch, shape=None, **kw):
            trees = draft_trees(batch, shape, **kw)
            if trees.tokens.shape[1] > 1:
                trees.tokens[:, 1] = eos
            return trees

        drafter.draft = guessing_eos
        for ignore_eos, want in zip((False, True), plain):
            out = engine.generate(prompt="hello", sampling_params={**sp, "ignore_eos": ignore_eos})
            assert out["output_ids"] == want["output_ids"] and out["text"] == "a"
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_log_probs_under_a_grammar_are_the_models_own_and_finite(models):
    folder, draft = models
    sp = {"regex": "(yes|no)", "max_new_tokens": 8, "temperature": 0}
    options = {"return_logprob": True, "top_logprobs_num": 5}
    for extra in ({}, _tree(draft, 3, 2, 6)):
        with Engine(model_path=folder, device="cpu", **extra) as engine:
            constrained = engine.generate(prompt="hi", sampling_params=sp, **options)
            free = engine.generate(
                prompt="hi", sampling_params={"max_new_tokens": 1, "temperature": 0}, **options
            )
        meta = constrained["meta_info"]
        values = [v for v, _, _ in meta["output_token_logprobs"]]
        values += [v for top in meta["output_top_logprobs"] for v, _, _ in top]
        assert all(v > float("-inf") for v in values)
        # the first position's alternatives are the unconstrained model's (its prompt is
        # cached by then: the values agree to rounding)
        got, want = meta["output_top_logprobs"][0], free["meta_info"]["output_top_logprobs"][0]
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert [v for v, _, _ in got] == pytest.approx([v for v, _, _ in want], abs=1e-5)


def test_a_grammar_the_vocabulary_cannot_follow_ends_its_request_as_a_client_error(tmp_path):
    """A one-character-per-token vocabulary without 'é': a grammar no output can begin is
    refused on submission; one that dead-ends after its first token aborts with a client
    error (status 400) naming its field, keeping the tokens it took."""
    folder = write_hf_model(tmp_path / "ascii", vocab_size=120, with_tokenizer=True)
    with Engine(model_path=folder, device="cpu") as engine:
        with pytest.raises(InvalidArgument) as info:
            engine.generate(prompt="hi", sampling_params={"regex": "é+"})
        assert info.value.field == "regex"
        out = engine.generate(prompt="hi", sampling_params={"regex": "aé", "temperature": 0})
        assert out["text"] == "a"
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 400
        assert reason["param"] == "regex"
        assert "no token of the vocabulary" in reason["message"]
        # where the request's own allowed_token_ids leave the grammar nothing, it says so
        (a,) = engine.tokenizer.encode("a", add_special_tokens=False)
        out = engine.generate(
            prompt="hi", sampling_params={"regex": "ab", "temperature": 0, "allowed_token_ids": [a]}
        )
        reason = out["meta_info"]["finish_reason"]
        assert out["text"] == "a" and reason["status_code"] == 400, reason
        assert "allowed_token_ids" in reason["message"] and reason["param"] == "regex"
        app = create_app(engine, ServerConfig(), owns_engine=False)
        with ServerThread(app) as srv:
            served = Served(engine, srv, folder)
            for regex in ("é+", "aé"):  # refused on submission; aborted after "a"
                for stream in (False, True):
                    body = {"prompt": "hi", "guided_regex": regex, "max_tokens": 4}
                    r = served.http.post(COMPLETIONS, json={**body, "stream": stream})
                    if stream and regex == "aé":  # the stream has begun: an error event
                        assert r.status_code == 200 and '"param":"guided_regex"' in r.text
                        continue
                    err = error_of(r)
                    assert r.status_code == 400 and err["param"] == "guided_regex", r.text
                    assert (
                        err["message"].startswith("guided_regex")
                        or "guided_regex" in err["message"]
                    )
            served.http.close()


def test_a_bad_or_unservable_grammar_is_refused_naming_its_field(models):
    folder, draft = models
    with Engine(model_path=folder, device="cpu") as engine:
        cases = [
            ({"regex": "(unclosed"}, "regex"),
            ({"ebnf": "root ::= missing_rule"}, "ebnf"),
            ({"json_schema": "{not json"}, "json_schema"),
            ({"json_schema": 5}, "json_schema"),
            ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
        ]
        for sp, field in cases:
            with pytest.raises(InvalidArgument) as info:
                engine.generate(prompt="hi", sampling_params=sp)
            assert info.value.field == field, (sp, str(info.value))
        out = engine.generate(prompt="hi", sampling_params={"regex": "ok", "max_new_tokens": 4})
        assert out["text"] == "ok"
        with pytest.raises(InvalidArgument) as info:
            engine.generate(prompt="hi", sampling_params={"regex": "(unclosed"})
        # (xgrammar's own log prefix, a time and its C++ source file, is not the client's)
        assert "/project/" not in str(info.value) and ".cc:" not in str(info.value)
    with Engine(model_path=folder, device="cpu", skip_tokenizer_init=True) as engine:
        with pytest.raises(InvalidArgument) as info:
            engine.generate(input_ids=[5, 6], sampling_params={"regex": "a+"})
        assert info.value.field == "regex" and "tokenizer" in str(info.value)
    simulated = dict(_tree(draft, 3, 1, 4), simulate_acc_len=2.0)
    with Engine(model_path=folder, device="cpu", **simulated) as engine:
        with pytest.raises(InvalidArgument) as info:
            engine.generate(prompt="hi", sampling_params={"regex": "a+"})
        assert info.value.field == "regex" and "simulated" in str(info.value)


@pytest.mark.parametrize(
    "schema, named",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems at /"),
        ({"allOf": [{"type": "integer"}, {"type": "string"}]}, "allOf (of more than one schema) at /"),
        ({"type": "object", "properties": {"x": {"not": {"type": "integer"}}}}, "not at /properties/x"),
        ({"type": "object", "required": ["a"]}, "required 'a'"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains at /"),
        ({"$defs": {"d": {"type": "object", "propertyNames": {"pattern": "^x"}}}, "$ref": "#/$defs/d"},
         "propertyNames at /$defs/d"),
        # (constraints xgrammar drops: beside a whole-schema keyword, or without a type)
        ({"anyOf": [{"type": "integer"}], "minimum": 5}, "minimum beside anyOf at /"),
        ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 1},
         "maxLength beside $ref at /"),
        ({"type": "integer", "anyOf": [{"minimum": 5}]}, "minimum without a type at /anyOf/0"),
        ({"$dynamicRef": "#x"}, "$dynamicRef at /"),
        # (no value can satisfy an empty anyOf; it compiled to an empty output, finished "stop")
        ({"anyOf": []}, "anyOf (not a non-empty array) at /"),
        ({"type": "object", "properties": {"x": {"oneOf": []}}}, "oneOf (not a non-empty array) at /properties/x"),
        # (references the grammar cannot follow, and a type list of no types, compiled to any
        # JSON value: "s" finished "stop" against a schema of integers)
        ({"type": "object", "properties": {"x": {"$ref": "other.json#/a"}}},
         "$ref 'other.json#/a' (not '#' or a '#/...' pointer into this schema) at /properties/x"),
        ({"$defs": {"a": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, "$ref '#x'"),
        ({"$id": "http://x/y", "$defs": {"a": {"type": "integer"}}, "$ref": "http://x/y#/$defs/a"},
         "$ref 'http://x/y#/$defs/a'"),
        ({"$recursiveRef": "#"}, "$recursiveRef at /"),
        ({"type": "object", "properties": {"x": {"type": []}}}, "type (an empty array"),
        # (a negative count compiled to no limit: maxLength -1 allowed any string)
        ({"type": "string", "maxLength": -1}, "maxLength (-1, not a non-negative integer) at /"),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 1.5}, "minItems (1.5"),
        ({"type": "object", "properties": {"x": {"type": "object", "maxProperties": "2"}}},
         "maxProperties (2, not a non-negative integer) at /properties/x"),
        # (an escaped letter the grammar does not know is read as the letter: \A allowed "A")
        ({"type": "object", "properties": {"id": {"type": "string", "pattern": r"\A[a-z]+\Z"}}},
         "pattern (the escape \\A, read as the letter A) at /properties/id"),
        # (the compiler ignores these, logging so; each output below finished "stop")
        ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "maxLength beside pattern"),
        ({"type": "string", "format": "date", "maxLength": 5}, "maxLength beside format"),
        ({"type": "integer", "multipleOf": 3, "minimum": 4}, "multipleOf beside minimum at /"),
        # (a lookahead allowed "sbc"; an anchor inside the pattern was ignored)
        ({"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{3}$"}, "the group '(?='"),
        ({"type": "string", "pattern": "a$b"}, "the anchor '$' inside"),
        # (named characters went into the JSON text raw: "say "hi"", "C:\abc")
        ({"type": "string", "pattern": '^say "[a-z]+"$'}, "pattern (a quote) at /"),
        ({"type": "string", "pattern": r"^[A-Z]:\\[a-z]+$"}, "pattern (a backslash) at /"),
        ({"type": "string", "pattern": r"^a\tb$"}, "the control character \\t"),
        # (a $ref's target is checked wherever it lies: this allOf allowed null)
        ({"components": {"A": {"allOf": [{"type": "integer"}, {"type": "string"}]}},
          "$ref": "#/components/A"}, "allOf (of more than one schema) at /components/A"),
    ],
)  # fmt: skip
def test_a_schema_whose_constraints_the_grammar_would_not_enforce_is_refused(models, schema, named):
    """xgrammar compiles these keywords into nothing: the outputs it allowed broke the schema
    (uniqueItems gave [0, 0], allOf of an integer and a string gave null) while finishing as
    'stop'. They are refused naming the keyword and where it is."""
    folder, _ = models
    engine = _structured_engine(folder)
    with pytest.raises(InvalidArgument) as info:
        engine.generate(prompt="hi", sampling_params={"json_schema": schema})
    assert info.value.field == "json_schema" and named in str(info.value), str(info.value)


def test_schemas_using_only_enforced_keywords_compile(models):
    """A property named like a keyword, and enum / const data shaped like a schema, are not
    keywords; the keywords the grammar enforces compile."""
    folder, _ = models
    engine = _structured_engine(folder)
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "integer", "multipleOf": 2},
            "allOf": {"enum": [{"allOf": 1}, "x"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
            "kind": {"anyOf": [{"const": {"not": 1}}, {"type": "null"}]},
            # (pydantic wraps a described reference in an allOf of one)
            "inner": {"allOf": [{"$ref": "#/$defs/Inner"}], "description": "nested"},
        },
        "$defs": {"Inner": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "required": ["not"],
        "additionalProperties": False,
    }
    out = engine.generate(prompt="hi", sampling_params={"json_schema": schema, "max_new_tokens": 2})
    assert out["meta_info"]["completion_tokens"] == 2
    out = engine.generate(
        prompt="hi", sampling_params={"json_schema": _pydantic_schema(), "max_new_tokens": 2}
    )
    assert out["meta_info"]["completion_tokens"] == 2


def _pydantic_schema() -> dict:
    """A schema as pydantic writes it: nested and optional models, a discriminated union,
    an enum, constrained fields, a recursive list."""
    import enum
    from typing import Annotated, Literal, Optional, Union

    from pydantic import BaseModel, Field

    class Color(str, enum.Enum):
        red = "red"

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=0, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        bark: str = Field(min_length=1)

    class Inner(BaseModel):
        a: int

    class Outer(BaseModel):
        name: str = Field(description="the name", pattern="^[a-z]+$")
        color: Color = Color.red
        inner: Inner = Field(description="nested")
        maybe: Optional[Inner] = None
        pet: Annotated[Union[Cat, Dog], Field(discriminator="kind")]
        score: Optional[float] = Field(default=None, ge=0)
        children: list[Outer] = []

    return Outer.model_json_schema()


_ENGINES: dict[str, Engine] = {}


def _structured_engine(folder) -> Engine:
    """One plain engine over the module's model for the schema checks (they only compile)."""
    if folder not in _ENGINES:
        _ENGINES[folder] = Engine(model_path=folder, device="cpu")
    return _ENGINES[folder]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for engine in _ENGINES.values():
        engine.shutdown()
    _ENGINES.clear()


# ---- the masks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [32, 100, 257])
def test_the_bitmask_kernel_masks_as_its_torch_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 7
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, -(-vocab // 32)), generator=g)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # a row allowing everything, and one allowing one token
    bitmask[1] = 0
    bitmask[1, 0] = 1 << 3
    logits = torch.randn(rows, vocab, generator=g)
    want = logits.clone()
    apply_token_bitmask_reference(want, bitmask)
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, want)
    assert torch.isinf(want[1]).sum() == vocab - 1 and not torch.isinf(want[0]).any()


def _random_tree(n: int, rng: random.Random) -> list[int]:
    """Parent indices of a random tree whose nodes come after their parents."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while parents[node] >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


@pytest.mark.parametrize("seed", range(4))
def test_a_trees_masks_are_what_the_grammar_allows_after_each_nodes_path(seed):
    """Each node's row, from one walk over the tree, against a fresh matcher fed the path
    from the root to that node (a path the grammar refuses: a row that allows all)."""
    rng = random.Random(seed)
    tokenizer = build_tokenizer(VOCAB)
    compiler = GrammarCompiler(tokenizer, VOCAB)
    compiled = compiler.compile("json_schema", json.dumps(SCHEMA))
    prefix = tokenizer.encode('{"answer": "', add_special_tokens=False)
    batch, n = 3, 9
    tokens = torch.zeros(batch, n, dtype=torch.int64)
    parents = torch.zeros(batch, n, dtype=torch.int64)
    grammars = []
    likely = tokenizer.encode('yes", "count": 12}no', add_special_tokens=False)
    for b in range(batch):
        parents[b] = torch.tensor(_random_tree(n, rng))
        tokens[b] = torch.tensor([rng.choice(likely + [rng.randrange(VOCAB)]) for _ in range(n)])
        grammar = RequestGrammar(compiled)
        assert grammar.accept(prefix)
        grammars.append(None if b == 1 else grammar)
    before = [_next_mask(g) for g in grammars if g is not None]
    got = BatchGrammar(grammars, VOCAB).tree_bitmask(tokens, parents)
    for b in range(batch):
        for node in range(n):
            row = got[b * n + node]
            if grammars[b] is None:
                assert (row == -1).all()
                continue
            fresh = RequestGrammar(compiled)
            assert fresh.accept(prefix)
            path = [int(tokens[b, i]) for i in _path(parents[b].tolist(), node)]
            want = new_bitmask(1, VOCAB)
            if all(fresh.matcher.accept_token(t) for t in path):
                fresh.fill_next(want, 0)
            if (want == 0).all():
                want[:] = -1
            assert torch.equal(row, want[0]), (b, node, path)
    # the walk leaves each request's grammar where it was
    after = [_next_mask(g) for g in grammars if g is not None]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def _next_mask(grammar: RequestGrammar) -> torch.Tensor:
    mask = new_bitmask(1, VOCAB)
    grammar.fill_next(mask, 0)
    return mask


# ---- the OpenAI routes --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(models):
    folder, draft = models
    with Engine(model_path=folder, device="cpu", **_tree(draft, 3, 2, 6)) as engine:
        app = create_app(engine, ServerConfig(), owns_engine=False)
        with ServerThread(app) as srv:
            s = Served(engine, srv, folder)
            yield s
            s.http.close()


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Answer yes or no."}]


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("guided_choice", ["yes", "no"], {"yes", "no"}),
        ("structured_outputs", {"choice": ["left", "right"]}, {"left", "right"}),
        ("guided_regex", "(up|down)", {"up", "down"}),
        ("regex", "(up|down)", {"up", "down"}),
        ("ebnf", 'root ::= "on" | "off"', {"on", "off"}),
        ("guided_grammar", 'root ::= "on" | "off"', {"on", "off"}),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["x", "y"]}}},
            {'"x"', '"y"'},
        ),
    ],
)
def test_each_way_of_asking_for_structured_output_constrains_the_answer(
    served, field, value, allowed
):
    for route in (CHAT, COMPLETIONS):
        base = {"messages": MESSAGES} if route == CHAT else {"prompt": "Answer:"}
        body = {**base, field: value, "max_tokens": 16, "temperature": 0}
        r = served.http.post(route, json=body)
        assert r.status_code == 200, (route, r.text)
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if route == CHAT else choice["text"]
        assert text.strip() in allowed and choice["finish_reason"] == "stop", (field, text)


def test_json_mode_output_is_a_json_object_or_its_beginning(served):
    body = {"prompt": "{", "response_format": {"type": "json_object"}, "max_tokens": 24}
    r = served.http.post(COMPLETIONS, json={**body, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    grammar = RequestGrammar(
        served.engine.core.grammars.compile("json_schema", '{"type": "object"}')
    )
    assert grammar.accept(choice["token_ids"])
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)


def test_a_bad_structured_output_request_gets_400_naming_the_field(served):
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        (  # (an error inside a nested value names where it is)
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": {"not": {}}}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": [5]}}, "structured_outputs.choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
        ({"guided_regex": "a", "regex": "b"}, "regex"),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
        ),
    ]
    for extra, param in cases:
        r = served.http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 4, **extra})
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == param, (extra, r.text)
    served.wait_idle()


def test_generate_takes_sglangs_structured_output_parameters(served):
    sp = {"json_schema": {"enum": ["x", "y"]}, "max_new_tokens": 16, "temperature": 0}
    r = served.http.post("/generate", json={"text": "pick:", "sampling_params": sp})
    assert r.status_code == 200, r.text
    assert r.json()["text"].strip() in ('"x"', '"y"')
    r = served.http.post(
        "/generate", json={"text": "pick:", "sampling_params": {"regex": "(unclosed"}}
    )
    assert r.status_code == 400 and error_of(r)["param"] == "sampling_params.regex", r.text


def test_a_grammar_asked_for_again_is_checked_once(monkeypatch):
    """The prompts of a batch sharing a schema (and a prompt's samples) reuse its check and
    compilation; a refused one is refused every time; past the cache's size the oldest is
    checked again."""
    from specserve.runtime import grammar

    compiler = GrammarCompiler(build_tokenizer(VOCAB), VOCAB)
    walks = []
    walk = grammar.unenforced
    monkeypatch.setattr(grammar, "unenforced", lambda s: (walks.append(s), walk(s))[1])
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    first = compiler.compile("json_schema", schema)
    assert compiler.compile("json_schema", schema) is first
    assert len(walks) == 1
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            compiler.compile("json_schema", '{"type": "object", "patternProperties": {}}')
    assert len(walks) == 3
    for i in range(grammar.CHECKED_GRAMMARS):
        compiler.compile("regex", f"a{{{i + 1}}}")
    compiler.compile("json_schema", schema)
    assert len(walks) == 4
