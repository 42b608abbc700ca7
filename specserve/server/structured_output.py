"""Structured output as the OpenAI routes are asked for it, in the engine's terms (SGLang's
sampling parameters `json_schema`, `regex`, `ebnf`).

Accepted, one per request:
- OpenAI: `response_format` `{"type": "json_object"}` (any JSON object) or `{"type":
  "json_schema", "json_schema": {"schema": {...}}}`; `{"type": "text"}` is no constraint;
- vLLM: `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and the
  older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- SGLang: `json_schema`, `regex`, `ebnf`.
"""

from __future__ import annotations

import json
from typing import Any

from specserve.server.protocol import APIError, short

ANY_JSON_OBJECT = '{"type": "object"}'
SOURCES = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "json_schema",
    "regex",
    "ebnf",
)


def structured_output(req) -> tuple[dict[str, Any], dict[str, str]]:
    """(the engine's sampling parameters for the request's structured output, the request's
    field each of them came from: an error the engine finds names that field)."""
    given = constraint_fields(req)
    if not given:
        return {}, {}
    if len(given) > 1:
        raise APIError(
            f"{given[1]}: structured output takes one constraint; {given[0]} is given too",
            param=given[1],
        )
    engine_field, spec, where = _engine_param(given[0], getattr(req, given[0]))
    return {engine_field: spec}, {engine_field: where}


def constraint_fields(req) -> list[str]:
    """The request's fields that ask for a constraint, in SOURCES' order."""
    return [name for name in SOURCES if _given(name, getattr(req, name, None))]


def _given(name: str, value: Any) -> bool:
    if value is None:
        return False
    if name == "response_format":
        return not (isinstance(value, dict) and value.get("type") == "text")
    return True


def _engine_param(source: str, value: Any) -> tuple[str, Any, str]:
    """(the engine's parameter, its value, the request's field it came from, nested where
    it is: `structured_outputs.regex`)."""
    if source == "response_format":
        return _response_format(value)
    if source == "structured_outputs":
        return _structured_outputs(value)
    if source in ("guided_json", "json_schema"):
        return "json_schema", value, source
    if source in ("guided_regex", "regex"):
        return "regex", value, source
    if source == "guided_choice":
        return "ebnf", _choice_grammar(source, value), source
    return "ebnf", value, source  # guided_grammar, ebnf


def _response_format(value: Any) -> tuple[str, Any, str]:
    kinds = "'text', 'json_object' or 'json_schema'"
    if not isinstance(value, dict):
        raise APIError(
            f"response_format: must be an object, got {short(value)}", param="response_format"
        )
    kind = value.get("type")
    if kind == "json_object":
        return "json_schema", ANY_JSON_OBJECT, "response_format"
    if kind != "json_schema":
        raise APIError(
            f"response_format.type: must be {kinds}, got {short(kind)}",
            param="response_format.type",
        )
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if schema is None:
        raise APIError(
            "response_format.json_schema: must be an object with a 'schema' (the JSON schema)",
            param="response_format.json_schema",
        )
    return "json_schema", schema, "response_format.json_schema.schema"


def _structured_outputs(value: Any) -> tuple[str, Any, str]:
    keys = ("json", "regex", "choice", "grammar", "json_object")
    if not isinstance(value, dict):
        raise APIError(
            f"structured_outputs: must be an object, got {short(value)}",
            param="structured_outputs",
        )
    flag = value.get("json_object")
    if flag is not None and not isinstance(flag, bool):
        raise APIError(
            f"structured_outputs.json_object: must be true or false, got {short(flag)}",
            param="structured_outputs.json_object",
        )
    given = [k for k in keys if value.get(k) not in (None, False)]
    if value.get("disable_any_whitespace"):
        raise APIError(
            "structured_outputs.disable_any_whitespace: is not supported (only false): JSON "
            "takes any whitespace between tokens",
            param="structured_outputs.disable_any_whitespace",
        )
    unknown = sorted(set(value) - set(keys) - {"disable_any_whitespace"})
    if unknown or len(given) != 1:
        raise APIError(
            f"structured_outputs: must give exactly one of {', '.join(keys)}"
            + (f"; unknown: {', '.join(unknown)}" if unknown else f"; got {given or 'none'}"),
            param="structured_outputs",
        )
    key = given[0]
    where = f"structured_outputs.{key}"
    if key == "json":
        return "json_schema", value["json"], where
    if key == "json_object":
        return "json_schema", ANY_JSON_OBJECT, where
    if key == "regex":
        return "regex", value["regex"], where
    if key == "choice":
        return "ebnf", _choice_grammar(where, value["choice"]), where
    return "ebnf", value["grammar"], where


def _choice_grammar(field: str, choices: Any) -> str:
    """An EBNF grammar whose strings are exactly the choices."""
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise APIError(f"{field}: must be a non-empty list of non-empty strings", param=field)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
