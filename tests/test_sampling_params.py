"""Sampling parameters: one validation shared by the offline API and every HTTP route, and a
sampler that survives any temperature the validation lets through."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specserve.errors import InvalidArgument
from specserve.ops.sampling import SamplingTensors, sample
from specserve.sampling_params import SamplingParams, check_field
from specserve.server.openai_protocol import CompletionRequest
from specserve.server.protocol import APIError, GenerateRequest, parse

# field -> values to try (valid and invalid mixed); the checks decide, the test compares them
JUNK = ["no", "false", "", None, True, False, 1, 0, -1, 2.5, [], {}, [1], {"a": [{"b": None}]}]
VALUES: dict[str, list] = {
    "temperature": [0, 0.0, 1e-39, 1e-6, 1e-5, 0.7, 2, 2.0001, 100, 100.5, 1e6, -0.1, *JUNK],
    "top_p": [1, 0.5, 1e-9, 0, 1.01, -1, *JUNK],
    "top_k": [-1, 0, 5, 2**63 - 1, 2**63, -2, 5.0, *JUNK],
    "min_p": [0, 0.0, 1, 0.3, 1.5, -0.1, *JUNK],
    "max_new_tokens": [0, 1, 2**63 - 1, 2**63, -1, 3.0, *JUNK],
    "stop": ["x", ["a", "b"], [""], ["a"] * 16, ["a"] * 17, "y" * 1024, "y" * 1025, [1], *JUNK],
    "stop_token_ids": [[1, 2], [0], [-1], [1.0], [True], list(range(1025)), *JUNK],
    "ignore_eos": JUNK,
    "seed": [0, 7, 2**63 - 1, 2**63, -1, 1.0, *JUNK],
    "skip_special_tokens": JUNK,
}
# JSON cannot carry Python's float('inf'); send it the way a client does (1e309 overflows).
RAW = {"temperature": ["1e309", "-1e309", "NaN", "Infinity"]}


def core_accepts(field: str, value, max_temperature: float = 100.0) -> bool:
    try:
        SamplingParams.from_any({field: value}, max_temperature=max_temperature)
        return True
    except InvalidArgument as e:
        assert e.field == field, (field, value, e)
        return False


def http_accepts(model, body: bytes, param: str) -> bool:
    try:
        parse(model, body)
        return True
    except APIError as e:
        assert e.status == 400 and e.param == param, (body[:80], e.param, e.message)
        assert e.message.startswith(param + ":")
        return False


@pytest.mark.parametrize("field", sorted(VALUES))
def test_generate_route_and_engine_agree(field):
    """/generate's sampling_params accepts exactly what Engine.generate accepts."""
    for value in VALUES[field]:
        body = json.dumps({"input_ids": [1], "sampling_params": {field: value}}).encode()
        want = core_accepts(field, value)
        got = http_accepts(GenerateRequest, body, f"sampling_params.{field}")
        assert got == want, (field, value, got, want)
    for raw in RAW.get(field, []):
        body = b'{"input_ids": [1], "sampling_params": {"%s": %s}}' % (field.encode(), raw.encode())
        assert not http_accepts(GenerateRequest, body, f"sampling_params.{field}")


OPENAI_NAME = {"max_new_tokens": "max_tokens"}


@pytest.mark.parametrize("field", sorted(VALUES))
def test_openai_routes_and_engine_agree(field):
    """The OpenAI routes accept what the engine accepts with temperature capped at 2 (null
    means the default there)."""
    name = OPENAI_NAME.get(field, field)
    for value in VALUES[field]:
        body = json.dumps({"prompt": [1], name: value}).encode()
        got = http_accepts(CompletionRequest, body, name)
        if value is None:
            assert got, (field, value)  # OpenAI's null = not given
            continue
        assert got == core_accepts(field, value, max_temperature=2.0), (field, value)


def test_booleans_are_not_numbers_and_strings_are_not_booleans():
    for field, value in [
        ("skip_special_tokens", "no"),
        ("skip_special_tokens", 1),
        ("skip_special_tokens", None),
        ("skip_special_tokens", "false"),
        ("ignore_eos", "no"),
        ("max_new_tokens", True),
        ("top_k", 5.0),
        ("temperature", True),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", 1e6),
        ("stop", ["s"] * 10_000),
        ("stop", "z" * 2000),
        ("bogus", 1),
    ]:
        with pytest.raises(InvalidArgument) as exc:
            SamplingParams.from_any({field: value})
        assert exc.value.field == field
        assert str(exc.value).startswith(field + ":")


def test_tiny_temperatures_are_greedy_and_validation_normalizes_them():
    assert SamplingParams.from_any({"temperature": 1e-39}).temperature == 0.0
    assert SamplingParams.from_any({"temperature": 1e-6}).greedy
    assert not SamplingParams.from_any({"temperature": 1e-5}).greedy
    assert check_field("stop", "ab") == ["ab"]


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 1e-8, 1e-6])
def test_sampler_gives_the_greedy_token_for_tiny_temperatures(temperature):
    """Even if a tiny temperature reaches the sampler (denormal in float32), it samples the
    argmax, not token 0 from NaN logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 5
    logits[:, 0] = logits.min() - 1  # token 0 is never the answer
    st = SamplingTensors(
        temperatures=torch.full((4,), temperature),
        top_ks=torch.zeros(4, dtype=torch.int64),
        top_ps=torch.ones(4),
        min_ps=torch.zeros(4),
        seeds=torch.arange(4),
        all_greedy=False,
        needs_filter=True,
    )
    got = sample(logits, st, torch.arange(4))
    assert got.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", 1.0000001),
        ("temperature", 100.0001),
        ("min_p", 1.0000001),
        ("frequency_penalty", 2.0000001),
        ("presence_penalty", -2.0000001),
        ("repetition_penalty", 2.0000001),
    ],
)
def test_a_value_just_past_its_range_is_shown_as_sent(field, value):
    # (shown rounded, "got 1" beside "must be in (0, 1]" contradicted itself)
    with pytest.raises(InvalidArgument) as info:
        SamplingParams.from_any({field: value})
    assert info.value.field == field and str(info.value).endswith(f"got {value!r}"), info.value
