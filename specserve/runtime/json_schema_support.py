"""Which parts of a JSON schema structured output cannot enforce.

xgrammar (0.2.9) compiles some JSON-schema keywords into nothing: a schema using them
compiles, and the outputs it allows break the schema (`allOf` of an integer and a string
allowed `null`, of an integer and a minimum of 3 allowed 1; `uniqueItems` allowed `[0, 0]`;
`required` naming a property that `properties` does not list allowed `{}`), or allow
nothing a schema accepts (`contains`, `patternProperties`, `propertyNames`); and it drops a
constraint beside a `$ref`, `anyOf`, `enum` and the like, or on a schema without a `type`;
a `$ref` that is no JSON pointer into the schema itself (another document, an anchor, an
absolute URI) or a `type` of no types compiled to any JSON value at all, a negative
length or count to no limit, `multipleOf` on a number (or a fraction on an integer) to
nothing, a `pattern` escaping a letter the grammar does not know (`\\A`) to that letter
or naming a quote, a backslash or a control character into the JSON text raw
(runtime/regex_support.py), `minLength` / `maxLength` beside a `pattern` or `format`, and
`multipleOf` beside a bound, to nothing (it logs that it ignores them).
(`oneOf` is enforced as `anyOf`: a value matching two branches is taken.) An output that ends "stop" must satisfy its schema,
so such schemas are refused up front, naming each keyword and where it is (as vLLM refuses
the features its xgrammar backend does not support).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from specserve.runtime.regex_support import json_unsafe, python_error, unread

# keywords whose constraint the compiled grammar does not enforce (`allOf` of one subschema
# it does: pydantic wraps a described reference so, {"allOf": [{"$ref": ...}]})
IGNORED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "contains",
    "minContains",
    "maxContains",
    "patternProperties",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "$dynamicRef",
    "$recursiveRef",
)
# constraints on a value of one type: xgrammar drops them where the schema gives no `type`
# ({"minimum": 3} allowed 1)
TYPED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
         "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
         "minProperties", "maxProperties")  # fmt: skip
# schemas xgrammar takes whole: a constraint beside one of these is dropped ($ref with
# maxLength 1 allowed "xyz"; an enum of 1 and 2 with minimum 2 allowed 1; an object's
# properties beside an anyOf allowed neither branch)
WHOLE = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")
BESIDE_WHOLE = (*TYPED, "properties", "required", "additionalProperties", "items",
                "prefixItems")  # fmt: skip
SUPPORTED = (
    "type, properties, required (of the listed properties), additionalProperties, items, "
    "prefixItems, minItems, maxItems, enum, const, anyOf, oneOf, allOf of one schema, "
    "$ref ('#' or a '#/...' pointer) / $defs, minimum, maximum, exclusiveMinimum, "
    "exclusiveMaximum, multipleOf (an integer, on integers, without a bound), minLength, "
    "maxLength (not beside pattern or format), pattern (read as Python's re; ^ and $ at its "
    "ends; no lookarounds, quote, backslash or control character), format, minProperties, "
    "maxProperties (where the schema gives a type, and not beside $ref, allOf, anyOf, oneOf, "
    "enum or const; a type beside those only where every value they allow is of that type)"
)
# keywords holding one subschema, a list of them, or a map of names to them (the rest hold
# data, e.g. enum and const, or numbers)
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedItems",
        "unevaluatedProperties", "contentSchema", "not", "if", "then", "else", "contains",
        "propertyNames")  # fmt: skip
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_NAMED = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")
DEFINITIONS = ("$defs", "definitions")
IMPLIED_TYPES = (
    (("properties", "required", "additionalProperties", "minProperties", "maxProperties"),
     "object"),
    (("items", "prefixItems", "minItems", "maxItems"), "array"),
    (("minLength", "maxLength", "pattern"), "string"),
)  # fmt: skip
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# counts the JSON Schema spec makes non-negative integers: the compiler read a negative one
# as no limit (maxLength -1 allowed any string)
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# keywords whose value must be of one JSON type: the compiler's error for another named no
# keyword ("pattern": 5 gave a C++ assertion's text, "minimum": "5" "Value must be a number";
# draft 4's boolean exclusiveMinimum is no number either)
KEYWORD_VALUES = (
    *((k, (int, float), "a number") for k in BOUNDS),
    ("multipleOf", (int, float), "a number"),
    ("pattern", str, "a string"),
    ("format", str, "a string"),
)


def unenforced(schema: Any) -> list[str]:
    """What of `schema` (parsed JSON) structured output cannot enforce, each as 'KEYWORD at
    PATH' (PATH a JSON pointer; '' is the root). Empty: all of it is enforced. Every local
    `$ref`'s target is checked too, wherever it lies (the compiler follows any pointer into
    the schema: an allOf under "#/components" compiled to nothing)."""
    found: list[str] = []
    _walk(schema, "", found, schema)
    refs = _local_refs(schema)
    seen = {""}
    while refs:
        ref = refs.pop()
        pointer = ref[1:]
        if pointer in seen:
            continue
        seen.add(pointer)
        target = _resolve(schema, pointer)
        if target is not None:
            _walk(target, pointer, found, schema)
            refs.extend(_local_refs(target))
    return list(dict.fromkeys(found))  # (a target under $defs is walked twice)


def _local_refs(schema: Any) -> list[str]:
    """Every '#/...' $ref in `schema`, at any depth."""
    out, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                out.append(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def _resolve(schema: Any, pointer: str) -> Any:
    """The part of `schema` at a JSON pointer ('/a/b'), or None."""
    node = schema
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _walk(schema: Any, path: str, found: list[str], root: Any) -> None:
    if not isinstance(schema, dict):
        return  # (true / false, or not a schema: the compiler judges)
    where = path or "/"
    for key in IGNORED:
        if key in schema:
            found.append(f"{key} at {where}")
    whole = [k for k in WHOLE if k in schema]
    if whole:
        for key in BESIDE_WHOLE:
            if key in schema:
                found.append(f"{key} beside {whole[0]} at {where}")
        if "type" in schema and not _within_type(schema, root):
            found.append(
                f"type beside {whole[0]} at {where} (enforced only where every value "
                f"{whole[0]} allows is of that type)"
            )
    elif "type" not in schema:
        for key in TYPED:
            if key in schema:
                found.append(f"{key} without a type at {where}")
    all_of = schema.get("allOf")
    if all_of is not None and not (isinstance(all_of, list) and len(all_of) == 1):
        found.append(f"allOf (of more than one schema) at {where}")
    for key in ("anyOf", "oneOf"):  # (the JSON Schema spec asks for a non-empty array; an
        # empty one allowed no value, and the grammar compiled it to an empty output)
        if key in schema and not (isinstance(schema[key], list) and schema[key]):
            found.append(f"{key} (not a non-empty array) at {where}")
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        found.append(
            f"$ref {ref[:80]!r} (not '#' or a '#/...' pointer into this schema) at {where}"
        )
    if schema.get("type") == []:
        found.append(f"type (an empty array, which no value satisfies) at {where}")
    for key, kinds, what in KEYWORD_VALUES:
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], kinds)):
            found.append(f"{key} ({json.dumps(schema[key])[:40]}, not {what}) at {where}")
    for key in COUNTS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            found.append(f"{key} ({str(value)[:40]}, not a non-negative integer) at {where}")
    if "multipleOf" in schema and "type" in schema and not _integer_multiple(schema):
        found.append(f"multipleOf (enforced only on an integer type, by an integer) at {where}")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and (error := python_error(pattern)):
        found.append(f"pattern (not a valid regular expression: {error}) at {where}")
    elif isinstance(pattern, str) and (what := unread(pattern) or json_unsafe(pattern)):
        found.append(f"pattern ({what}) at {where}")
    for length in ("minLength", "maxLength"):  # (the compiler logs that it ignores them)
        beside = next((k for k in ("pattern", "format") if k in schema), None)
        if length in schema and beside is not None:
            found.append(f"{length} beside {beside} at {where}")
    bound = next((k for k in BOUNDS if k in schema), None)
    if "multipleOf" in schema and bound is not None:  # (it logs that it ignores multipleOf)
        found.append(f"multipleOf beside {bound} at {where}")
    if schema.get("uniqueItems") is True:
        found.append(f"uniqueItems at {where}")
    required = schema.get("required")
    properties = schema.get("properties")
    if isinstance(required, list):
        listed = properties if isinstance(properties, dict) else {}
        for name in required:
            if name not in listed:
                found.append(f"required {name!r} (not in properties) at {where}")
    for key in _ONE:
        if key in schema and not isinstance(schema[key], list):
            _walk(schema[key], f"{path}/{key}", found, root)
    for key in _MANY:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _walk(sub, f"{path}/{key}/{i}", found, root)
    for key in _NAMED:
        if key in DEFINITIONS:  # (walked where a $ref leads: one no $ref names constrains
            continue  # nothing, whatever keywords it holds)
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                _walk(sub, f"{path}/{key}/{_pointer(name)}", found, root)


def _within_type(schema: dict, root: Any) -> bool:
    """Whether every value the rest of `schema` allows (its enum, const, branches or $ref
    target, which the grammar takes whole) is of the `type` beside them: the grammar drops
    that type ({"type": "string", "enum": ["a", 1]} allowed 1)."""
    outer = _type_set(schema["type"])
    inner = _types_of({k: v for k, v in schema.items() if k != "type"}, root, 0)
    if outer is None or inner is None:
        return False
    return all(t in outer or (t == "integer" and "number" in outer) for t in inner)


def _type_set(value: Any) -> set[str] | None:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return set(value)
    return None


def _types_of(schema: Any, root: Any, depth: int) -> set[str] | None:
    """The JSON types of the values `schema` allows, where it says (None: not known)."""
    if not isinstance(schema, dict) or depth > 16:
        return None
    if "type" in schema:
        return _type_set(schema["type"])
    if "const" in schema:
        return {_json_type(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_json_type(v) for v in schema["enum"]}
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = root if ref == "#" else _resolve(root, ref[1:]) if ref.startswith("#/") else None
        return _types_of(target, root, depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            kinds = [_types_of(b, root, depth + 1) for b in branches]
            if any(k is None for k in kinds):
                return None
            return set().union(*kinds) if key != "allOf" else set.intersection(*kinds)
    # keywords of one type, from which the grammar takes it ({"properties": ...} is an
    # object: a tagged union's branches say no more)
    implied = {t for keys, t in IMPLIED_TYPES if any(k in schema for k in keys)}
    return implied if len(implied) == 1 else None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"  # (JSON Schema: 1.0 is an integer)
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _integer_multiple(schema: dict) -> bool:
    """multipleOf as the grammar enforces it: an integer on a schema of integers (on a number
    it compiled to nothing, 964445 passing for a multiple of 3; so did 2.5 on an integer)."""
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    value = schema["multipleOf"]
    return "number" not in types and isinstance(value, int) and not isinstance(value, bool)


def _pointer(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


# formats whose compiled rule is wider than the format, as the pattern they mean: the
# compiler's ipv4 took octets with leading zeros ("44.189.010.67"), which Python's ipaddress
# and the JSON Schema test suite refuse
OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {"ipv4": f"^(?:{OCTET}\\.){{3}}{OCTET}$"}


def with_patterns(schema: Any, rewrite: Callable[[str], str]) -> Any:
    """`schema` with every subschema's `pattern` rewritten, and each format of
    FORMAT_PATTERNS given as its pattern (a new object). Only a schema's own keywords are:
    data under enum, const or default keeps any "pattern" key it holds."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    format_pattern = FORMAT_PATTERNS.get(schema.get("format"))
    if format_pattern is not None and "pattern" not in schema:
        del out["format"]
        out["pattern"] = format_pattern
    if isinstance(out.get("pattern"), str):
        out["pattern"] = rewrite(out["pattern"])
    for key in _ONE:
        if key in schema and not isinstance(schema[key], list):
            out[key] = with_patterns(schema[key], rewrite)
    for key in _MANY:
        if isinstance(schema.get(key), list):
            out[key] = [with_patterns(sub, rewrite) for sub in schema[key]]
    for key in _NAMED:
        if isinstance(schema.get(key), dict):
            out[key] = {name: with_patterns(sub, rewrite) for name, sub in schema[key].items()}
    return out
