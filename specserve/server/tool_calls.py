"""OpenAI tool calling on /v1/chat/completions through structured output, as vLLM and SGLang
serve it without a parser of the model's own tool-call format.

- `tool_choice` naming a function: the answer is constrained to a JSON object fitting that
  function's `parameters`; its text is the call's `arguments`.
- `"required"`: the answer is constrained to a JSON array of one or more `{"name",
  "parameters"}` objects, one per call (one at most with `parallel_tool_calls: false`).
- `"none"`: the tools only reach the chat template; the model answers in text.
- `"auto"` (OpenAI's default once tools are given) lets the model choose between text and a
  call in its own format, which only a model-specific parser can read: refused.

The tools reach the chat template whatever the choice (as vLLM passes them), and so do the
history's tool calls (`arguments` as an object, as transformers' templates expect) and tool
messages.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, ValidationInfo, field_validator

from specserve.runtime.json_schema_support import unenforced
from specserve.server.protocol import APIError, StrictModel, field_error, short
from specserve.server.structured_output import ANY_JSON_OBJECT

# OpenAI's rule for a function's name.
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
# Keywords whose values are data, not schemas: a "$ref" key there is no reference.
_DATA_KEYWORDS = frozenset(("enum", "const", "default", "examples"))
# Keywords whose values map names (of properties, definitions) to schemas: their keys are
# names, whatever they spell ("default", "enum", "$ref" are valid property names).
_NAMED_SCHEMAS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
)


# Arguments nested deeper than this reach the template as their text: its `tojson` recurses
# (600 levels ran out of Python's stack, a 400 that named no reason a client could act on).
TEMPLATE_DEPTH = 64


def _depth(value: Any) -> int:
    """How deeply a parsed JSON value nests objects and arrays (iteratively)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend(
                (v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)
            )
    return deepest


# ---- request bodies ---------------------------------------------------------------------------
class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # (a constrained answer fits the schema, strict or not)

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not NAME.fullmatch(v):
            raise field_error(
                "name", f"must be 1 to 64 letters, digits, underscores or dashes, got {short(v)}"
            )
        return v

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v):
        # (arguments are a JSON object, as OpenAI requires of a function's schema)
        if v is not None and "type" in v and v["type"] != "object":
            raise field_error("parameters", f"must describe an object, got type {short(v['type'])}")
        return v


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


def _check_tools(tools: list[Tool] | None) -> list[Tool] | None:
    """The request's tools (null for none), each name given once."""
    if not tools:
        return None
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            where = f"tools[{i}].function.name"
            raise APIError(f"{where}: {name!r} is also tools[{seen[name]}]'s name", param=where)
        seen[name] = i
    return tools


def _check_tool_choice(v: Any) -> str | dict[str, Any] | None:
    """null, 'none', 'auto', 'required' or {"type": "function", "function": {"name": ...}}."""
    if v is None or v in CHOICES:
        return v
    if not isinstance(v, dict):
        raise APIError(
            "tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', "
            f"'function': {{'name': ...}}}}, got {short(v)}",
            param="tool_choice",
        )
    if v.get("type") != "function":
        raise APIError(
            f"tool_choice.type: only 'function' is supported, got {short(v.get('type'))}",
            param="tool_choice.type",
        )
    function = v.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(
            f"tool_choice.function.name: must be a function's name, got {short(name)}",
            param="tool_choice.function.name",
        )
    return v


Tools = Annotated[list[Tool] | None, AfterValidator(_check_tools)]
ToolChoice = Annotated[Any, BeforeValidator(_check_tool_choice)]


class FunctionCall(StrictModel):
    name: str
    arguments: str | dict[str, Any]  # (OpenAI's is JSON text; an object is taken too)


class ToolCall(StrictModel):
    """A tool call of an assistant message in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """As transformers' templates read it: `arguments` an object where its text is one
        (templates print it with `tojson`, which would quote the text again)."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):  # (not JSON, or nested past the parser's
                parsed = None  # depth: the template shows the text as it came)
            if isinstance(parsed, dict) and _depth(parsed) <= TEMPLATE_DEPTH:
                arguments = parsed
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


def _assistant_calls(v: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
    if not v:  # ([] carries no call: clients copy histories with "tool_calls": [])
        return None
    role = info.data.get("role")
    if role is not None and role != "assistant":
        raise field_error("tool_calls", f"only an assistant's message calls tools, not a {role}'s")
    return v


def _answered_call(v: str | None, info: ValidationInfo) -> str | None:
    if v is None and info.data.get("role") == "tool":
        raise field_error("tool_call_id", "a tool message needs the id of the call it answers")
    return v


# A chat message's fields (ChatMessage declares role first: these read it)
HistoryToolCalls = Annotated[list[ToolCall] | None, AfterValidator(_assistant_calls)]
ToolCallId = Annotated[str | None, AfterValidator(_answered_call)]


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools]


def template_chars(tools: list[Tool] | None, calls: list[list[ToolCall]]) -> int:
    """Characters the template renders beyond the messages' content: the tools and the
    history's tool calls (as JSON)."""
    shown = [template_tools(tools or []), [c.model_dump() for cs in calls for c in cs]]
    return sum(len(json.dumps(x, ensure_ascii=False)) for x in shown)


# ---- the constraint ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """How a request's answer becomes tool calls: `named` (the one function's arguments) or
    `required` (an array of calls)."""

    kind: Literal["named", "required"]
    name: str | None  # the named function
    schema: dict[str, Any]  # the engine's json_schema
    source: str  # the request's field an error in the schema names

    def message(self, text: str) -> dict[str, Any]:
        """The assistant's message of a finished answer."""
        if self.kind == "named":
            calls = [_call(self.name, text)]
        else:
            reader = CallsReader()
            reader.feed(text)
            calls = [_call(c.name, "".join(c.arguments)) for c in reader.calls if c.name]
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def finish_reason(self, reason: str | None) -> str | None:
        """As vLLM: 'tool_calls' for a completed 'required' answer; a named function's answer
        keeps 'stop', as OpenAI answers a forced function."""
        return "tool_calls" if self.kind == "required" and reason == "stop" else reason

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def plan(
    tools: list[Tool] | None, choice: str | dict[str, Any] | None, parallel: bool | None
) -> ToolPlan | None:
    """The constraint the request's tool choice asks for (None: the answer is text)."""
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice in ("none", "auto"):  # (nothing to call: a text answer, as asked)
            return None
        raise APIError(
            "tool_choice: needs tools (a non-empty list of functions)", param="tool_choice"
        )
    if choice == "auto":
        raise APIError(
            "tool_choice: 'auto' (the default when tools are given) needs a parser of the "
            "model's own tool-call format, which this server does not have; send 'required' "
            "or a named function ({'type': 'function', 'function': {'name': ...}}) to "
            "constrain the answer to tool calls, or 'none' for a text answer",
            param="tool_choice",
        )
    if choice == "none":
        return None
    if choice == "required":
        items = [_call_schema(t, i) for i, t in enumerate(tools)]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolPlan("required", None, schema, "tools")
    name = choice["function"]["name"]
    index = next((i for i, t in enumerate(tools) if t.function.name == name), None)
    if index is None:
        known = ", ".join(repr(t.function.name) for t in tools)
        raise APIError(
            f"tool_choice.function.name: no tool is named {name!r} (tools: {known})",
            param="tool_choice.function.name",
        )
    schema = _parameters(tools[index], index)
    return ToolPlan("named", name, schema, f"tools[{index}].function.parameters")


def _parameters(tool: Tool, index: int) -> dict[str, Any]:
    """The function's schema (any object where it has none), refused naming it where
    structured output cannot enforce it."""
    schema = tool.function.parameters
    if not schema:  # (null, or {}, which would allow any JSON value, not only an object)
        return json.loads(ANY_JSON_OBJECT)
    found = unenforced(schema)
    if found:
        where = f"tools[{index}].function.parameters"
        shown = "; ".join(found[:8]) + ("; ..." if len(found) > 8 else "")
        raise APIError(
            f"{where}: uses what structured output cannot enforce ({shown})", param=where
        )
    return schema


def _call_schema(tool: Tool, index: int) -> dict[str, Any]:
    """One element of a 'required' answer: the function's name and its arguments. The
    function's own references ('#/$defs/x') are moved to where its schema now lies."""
    base = f"/items/anyOf/{index}/properties/parameters"
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "parameters": _rebased(_parameters(tool, index), base),
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _rebased(schema: Any, base: str) -> Any:
    """A schema (or a list of schemas) with its local references under `base`."""
    if isinstance(schema, list):
        return [_rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def check_alone(plan: ToolPlan | None, constraints: list[str]) -> None:
    """A tool choice that constrains the answer takes no other structured output."""
    if plan is not None and constraints:
        choice = "'required'" if plan.kind == "required" else f"function {plan.name!r}"
        raise APIError(
            f"{constraints[0]}: cannot be combined with tool_choice {choice}, which "
            "constrains the answer to tool calls already",
            param=constraints[0],
        )


def check_unstopped(plan: ToolPlan | None, stops: dict[str, Any]) -> None:
    """A tool choice that constrains the answer takes no stop string or stop token: one met
    inside the arguments would end the call before its JSON, looking finished."""
    given = next((name for name, value in stops.items() if value), None)
    if plan is not None and given is not None:
        raise APIError(
            f"{given}: cannot be combined with a tool choice that constrains the answer "
            "(a stop met inside the arguments would cut the call short); only null or []",
            param=given,
        )


# ---- answers ----------------------------------------------------------------------------------
def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or _call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class _Call:
    def __init__(self):
        self.name: str | None = None
        self.arguments: list[str] = []


_SPACE = " \t\r\n"


class CallsReader:
    """Reads a 'required' answer, a JSON array of {"name", "parameters"} objects, as its text
    grows: each element's name once its string is complete, and the text of its parameters
    as it comes (the raw text, so that streamed pieces join into the unstreamed arguments).
    The grammar makes the text valid JSON; one cut short (a length limit, a stop string)
    gives the calls begun so far."""

    def __init__(self):
        self.calls: list[_Call] = []
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.expect: str | None = None  # in an element: "key" or "value" comes next
        self.key: str | None = None  # the element's key whose value is read
        self.capture: str | None = None  # "key" or "value": what is being read
        self.literal = False  # the value read is a number, true, false or null
        self.text: list[str] = []

    def feed(self, text: str) -> None:
        for c in text:
            self._char(c)

    def _char(self, c: str) -> None:
        if self.in_string:
            self._take(c)
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.depth == 2 and self.capture:
                    self._end()
            return
        if self.literal and (c in _SPACE or c in ",}]"):
            self._end()
        if self.depth == 2 and self.expect and c not in _SPACE and c not in ":,}":
            self.capture, self.expect, self.text = self.expect, None, []
            self.literal = self.capture == "value" and c not in '"{['
        self._take(c)
        if c == '"':
            self.in_string = True
        elif c in "[{":
            self.depth += 1
            if self.depth == 2 and c == "{":  # an element opens
                self.calls.append(_Call())
                self.expect = "key"
        elif c in "]}":
            self.depth -= 1
            if self.depth == 2 and self.capture:  # the value's object or array closed
                self._end()
            if self.depth < 2:
                self.expect = None
        elif self.depth == 2 and c == ":":
            self.expect = "value"
        elif self.depth == 2 and c == ",":
            self.expect = "key"

    def _take(self, c: str) -> None:
        if self.capture == "value" and self.key == "parameters":
            self.calls[-1].arguments.append(c)
        elif self.capture:
            self.text.append(c)

    def _end(self) -> None:
        text = "".join(self.text)
        if self.capture == "key":
            self.key = _string(text)
        elif self.key == "name":
            self.calls[-1].name = _string(text)
        self.capture, self.literal, self.text = None, False, []


def _string(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class ToolCallStream:
    """One choice's tool calls as streamed deltas, as OpenAI streams them: a call's first
    delta carries its id, type and name with empty arguments, the next ones pieces of its
    arguments."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.reader = CallsReader() if plan.kind == "required" else None
        # per call of the reader that has begun streaming: (its index in the answer, the
        # characters of its arguments sent)
        self.sent: dict[int, list[int]] = {}

    def opening(self) -> dict[str, Any]:
        """The role delta that opens the choice (a named function's call begins there)."""
        delta: dict[str, Any] = {"role": "assistant", "content": None}
        if self.plan.kind == "named":
            delta["tool_calls"] = [self._header(0, self.plan.name)]
        return delta

    def deltas(self, text: str) -> list[dict[str, Any]]:
        """The deltas of the answer's next text, one per chunk."""
        if self.reader is None:
            return [self._arguments(0, text)] if text else []
        self.reader.feed(text)
        out = []
        for i, call in enumerate(self.reader.calls):
            if call.name is None:
                continue
            if i not in self.sent:
                self.sent[i] = [len(self.sent), 0]
                out.append({"tool_calls": [self._header(self.sent[i][0], call.name)]})
            index, done = self.sent[i]
            if len(call.arguments) > done:
                out.append(self._arguments(index, "".join(call.arguments[done:])))
                self.sent[i][1] = len(call.arguments)
        return out

    def _header(self, index: int, name: str) -> dict[str, Any]:
        return {"index": index, **_call(name, "")}

    def _arguments(self, index: int, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}
