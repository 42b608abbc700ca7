"""The request body of OpenAI's Responses API (POST /v1/responses) and its conversion into
the chat pipeline's inputs: chat messages, the engine's sampling parameters, and the names
the client wrote for the fields the engine's errors name.

The body shares the chat route's sampling fields and their checks (`CommonRequest`); it
differs where the Responses API does: `input` (and `instructions`) instead of `messages`,
`max_output_tokens` instead of `max_tokens`, `text.format` instead of `response_format`,
and one output. Unknown fields are refused (a mistyped field is not silently dropped); the
chat route's own names get a 400 pointing to this route's. Nothing is stored, so a response
cannot be continued (`previous_response_id`). Also the response's documented shape, for
/openapi.json.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from specserve.server.openai_protocol import NEUTRAL_FIELDS as _CHAT_NEUTRAL
from specserve.server.openai_protocol import ROLES, CommonRequest
from specserve.server.protocol import (
    APIError,
    StrictModel,
    core_check,
    field_error,
    is_int,
    only_neutral,
    short,
)
from specserve.server.structured_output import ANY_JSON_OBJECT

TEXT_PARTS = ("input_text", "output_text", "text")
# OpenAI's limits on `metadata`
METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512

# Fields of the chat route (inherited from `CommonRequest`) that this API names otherwise or
# lacks: any value, null included, is a 400 saying what to send instead.
_CHAT_ONLY: dict[str, str] = {
    "max_tokens": "use max_output_tokens",
    "n": "a response has one output",
    "return_token_ids": "not available on this route",
    "response_format": "use text.format",
    **{
        name: "structured output on this route is text.format"
        for name in (
            "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "structured_outputs", "json_schema", "regex", "ebnf",
        )
    },
}  # fmt: skip

# Features of the Responses API this server does not implement: accepted only at their neutral
# value (null always).
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "previous_response_id": (
        lambda v: False,
        "responses are not stored, so none can be continued (only null); send the "
        "conversation in input",
    ),
    "reasoning": (lambda v: False, "reasoning options are not supported (only null)"),
    "truncation": (
        lambda v: v == "disabled",
        "only null or 'disabled' (an input longer than the context is refused, not cut)",
    ),
    "include": (lambda v: v == [], "no extra output data is available (only null or [])"),
    "top_logprobs": (
        lambda v: is_int(v) and v == 0,
        "log-probs are not supported on this route (only null or 0)",
    ),
    "background": (lambda v: v is False, "background responses are not supported (only false)"),
    "background_options": (lambda v: False, "background responses are not supported (only null)"),
    "conversation": (
        lambda v: False,
        "conversations are not stored (only null); send the conversation in input",
    ),
    "prompt": (lambda v: False, "stored prompt templates are not available (only null)"),
    "context_management": (lambda v: False, "context management is not supported (only null)"),
    "max_tool_calls": (lambda v: False, "no tools are called (only null)"),
    "moderation": (lambda v: False, "moderation is not available (only null)"),
    "image": (lambda v: False, "images are not supported (only null)"),
    "access_programs": (lambda v: False, "is not supported (only null)"),
}


# The Responses API's own fields among those this route takes (the rest are extensions).
_OPENAI_FIELDS = (
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
    "stream", "stream_options", "text", "metadata", "user", "store", "tools",
    "tool_choice", "parallel_tool_calls", "previous_response_id", "reasoning",
    "truncation", "include", "top_logprobs", "background", "service_tier",
    "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
    "background_options", "conversation", "prompt", "context_management", "max_tool_calls",
    "moderation", "image", "access_programs",
)  # fmt: skip


class ResponsesTextFormat(StrictModel):
    """`text.format`: plain text, any JSON object, or JSON fitting a schema."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise field_error("schema", "type 'json_schema' needs a 'schema' (a JSON schema)")
        if self.type != "json_schema" and self.schema_ is not None:
            raise field_error(
                "schema", f"a 'schema' is only for type 'json_schema', not {self.type!r}"
            )
        return self

    def engine_param(self) -> tuple[dict[str, Any], dict[str, str]]:
        """(the engine's structured-output parameter, the field it came from: an error the
        engine finds in it names that field)."""
        if self.type == "json_object":
            return {"json_schema": ANY_JSON_OBJECT}, {"json_schema": "text.format"}
        if self.type == "json_schema":
            return {"json_schema": self.schema_}, {"json_schema": "text.format.schema"}
        return {}, {}


class ResponsesTextConfig(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    format: ResponsesTextFormat | None = None
    verbosity: Any = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, v):
        if v is not None:
            raise field_error("verbosity", f"is not supported (only null), got {short(v)}")
        return v


class ResponsesStreamOptions(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    # (OpenAI pads its deltas against length side channels; this server sends none, and
    # accepting the flag either way changes nothing a client reads)
    include_obfuscation: bool | None = None


# What `input` takes, for /openapi.json (the validator below checks it by hand, so that an
# error names the exact item: `input[1].content[0].type`).
_INPUT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "type": {"enum": ["message"]},
                    "role": {"enum": list(ROLES)},
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "type": "object",
                                    "required": ["type", "text"],
                                    "properties": {
                                        "type": {"enum": list(TEXT_PARTS)},
                                        "text": {"type": "string"},
                                        "annotations": {"type": "array"},
                                        "logprobs": {"type": "array"},
                                    },
                                    "additionalProperties": False,
                                },
                            },
                        ]
                    },
                    "id": {"type": "string"},
                    "status": {"type": "string"},
                },
                "additionalProperties": False,
            },
        },
    ]
}


class ResponsesRequest(CommonRequest):
    """POST /v1/responses. Sampling fields, their defaults and limits are the chat route's."""

    model_config = ConfigDict(strict=True, extra="forbid")

    input: Any = Field(..., json_schema_extra=_INPUT_SCHEMA)
    instructions: str | None = None  # a system message placed before the input
    max_output_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    text: ResponsesTextConfig | None = None
    metadata: dict[str, str] | None = None  # echoed back
    store: bool | None = None  # nothing is stored whatever it says
    parallel_tool_calls: bool | None = None  # (echoed; no tools are called)
    stream_options: ResponsesStreamOptions | None = None
    # accepted and ignored: they route, cache or identify a request on OpenAI's side and
    # change nothing about the output
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # (the prefix cache keeps what it can, whatever a request asks)
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # accepted only at their neutral value
    previous_response_id: Any = None
    reasoning: Any = None
    truncation: Any = None
    include: Any = None
    top_logprobs: Any = None
    background: Any = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    max_tool_calls: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    # the chat route's names (not published)
    max_tokens: SkipJsonSchema[Any] = None
    n: SkipJsonSchema[Any] = None
    return_token_ids: SkipJsonSchema[Any] = None
    response_format: SkipJsonSchema[Any] = None
    guided_json: SkipJsonSchema[Any] = None
    guided_regex: SkipJsonSchema[Any] = None
    guided_choice: SkipJsonSchema[Any] = None
    guided_grammar: SkipJsonSchema[Any] = None
    structured_outputs: SkipJsonSchema[Any] = None
    json_schema: SkipJsonSchema[Any] = None
    regex: SkipJsonSchema[Any] = None
    ebnf: SkipJsonSchema[Any] = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data):
        """An unknown field is refused naming the fields this route takes (a misspelt one
        would otherwise be a 400 that does not say what was meant)."""
        if isinstance(data, dict):
            unknown = next((k for k in data if k not in cls.model_fields), None)
            if unknown is not None:
                name = unknown if len(unknown) <= 60 else unknown[:57] + "..."
                raise APIError(
                    f"{name}: unknown field; this route takes {', '.join(published_fields())}",
                    param=unknown,
                )
        return data

    # (runs before the chat route's own checks of these names)
    @field_validator(*_CHAT_ONLY, mode="before")
    @classmethod
    def _chat_only(cls, v, info: ValidationInfo):
        raise field_error(
            info.field_name, f"not a field of the Responses API ({_CHAT_ONLY[info.field_name]})"
        )

    @field_validator(*_NEUTRAL)
    @classmethod
    def _responses_neutral(cls, v, info: ValidationInfo):
        return only_neutral(_NEUTRAL, info.field_name, v)

    @field_validator("max_output_tokens", mode="before")
    @classmethod
    def _max_output_tokens(cls, v):
        if v is None:
            return None
        v = core_check("max_output_tokens", v, 0, "max_new_tokens")
        if v < 1:  # (a response answers at least one token, as a chat does)
            raise field_error("max_output_tokens", f"must be >= 1, got {v}")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is None:
            return v
        if len(v) > METADATA_MAX_PAIRS:
            raise field_error("metadata", f"at most {METADATA_MAX_PAIRS} pairs, got {len(v)}")
        for key, value in v.items():
            if len(key) > METADATA_MAX_KEY or len(value) > METADATA_MAX_VALUE:
                raise field_error(
                    "metadata",
                    f"keys have at most {METADATA_MAX_KEY} characters and values at most "
                    f"{METADATA_MAX_VALUE}; the pair of key {short(key)} has more",
                )
        return v

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v):
        """The input as chat messages. (Raised as APIError, not a pydantic error, so that the
        error's param is the item's own path.)"""
        if isinstance(v, str):
            return [{"role": "user", "content": v}]
        if not isinstance(v, list) or not v:
            raise APIError(
                "input: must be a string or a non-empty list of message items "
                f"({{'role', 'content'}}), got {short(v)}",
                param="input",
            )
        return [_message(item, f"input[{i}]") for i, item in enumerate(v)]

    # ---- the chat pipeline's inputs --------------------------------------------------------
    def chat_messages(self) -> list[dict[str, str]]:
        """`instructions` as a leading system message, then the input's messages."""
        lead = (
            [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        )
        return lead + [dict(m) for m in self.input]

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_output_tokens, "max_output_tokens"

    def text_format(self) -> ResponsesTextFormat | None:
        return self.text.format if self.text is not None else None

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        sp = super().sampling_params(max_new_tokens)
        fmt = self.text_format()
        if fmt is not None:
            sp.update(fmt.engine_param()[0])
        return sp

    def structured_rename(self) -> dict[str, str]:
        """The engine's structured-output parameter -> the field of this body it came from."""
        fmt = self.text_format()
        return fmt.engine_param()[1] if fmt is not None else {}

    # ---- what the response echoes ----------------------------------------------------------
    def echoed(self) -> dict[str, Any]:
        """The request's settings as a response states them (OpenAI's defaults where not given;
        `store` is false: nothing is stored)."""
        fmt = self.text_format()
        shown = fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        parallel = self.parallel_tool_calls
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "metadata": dict(self.metadata or {}),
            "parallel_tool_calls": True if parallel is None else parallel,
            "tool_choice": self.tool_choice or "auto",
            "tools": [],
            "text": {"format": shown},
            "store": False,
            "previous_response_id": None,
            "reasoning": None,
            "truncation": "disabled",
            "top_logprobs": 0,
            "background": False,
            "user": self.user,
            "service_tier": "default",
            "prompt_cache_key": self.prompt_cache_key,
            "safety_identifier": self.safety_identifier,
        }


def published_fields() -> list[str]:
    """The fields a client may send: OpenAI's, then the sampling extensions (the chat
    route's fields accepted only at their neutral value are left out)."""
    ours = [
        n
        for n in ResponsesRequest.model_fields
        if n not in _OPENAI_FIELDS and n not in _CHAT_ONLY and n not in _CHAT_NEUTRAL
    ]
    return list(_OPENAI_FIELDS) + ours


def _message(item: Any, where: str) -> dict[str, str]:
    """One input item as a chat message; an APIError naming its path otherwise."""
    if not isinstance(item, dict):
        raise APIError(
            f"{where}: must be a message item ({{'role', 'content'}}), got {short(item)}",
            param=where,
        )
    kind = item.get("type")
    if kind not in (None, "message"):
        raise APIError(
            f"{where}.type: only 'message' items are supported (no tool calls, tool outputs, "
            f"reasoning or item references), got {short(kind)}",
            param=f"{where}.type",
        )
    # (an earlier response's output item sent back as history: its id, status and phase, which
    # OpenAI asks clients to resend, describe the item and are ignored; null is no value)
    item = {k: v for k, v in item.items() if v is not None}
    _only_keys(item, ("type", "role", "content", "id", "status", "phase"), where)
    role = item.get("role")
    if role not in ROLES:
        allowed = ", ".join(repr(r) for r in ROLES)
        raise APIError(
            f"{where}.role: must be one of {allowed}, got {short(role)}", param=f"{where}.role"
        )
    for key in ("id", "status", "phase"):
        if key in item and not isinstance(item[key], str):
            raise APIError(
                f"{where}.{key}: must be a string, got {short(item[key])}", param=f"{where}.{key}"
            )
    content = _content(item.get("content"), f"{where}.content")
    # The chat templates of small models know "system" but not OpenAI's "developer".
    return {"role": "system" if role == "developer" else role, "content": content}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise APIError(
            f"{where}: must be a string or a non-empty list of text parts, got {short(content)}",
            param=where,
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise APIError(
                f"{at}: must be a text part ({{'type', 'text'}}), got {short(part)}", param=at
            )
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            allowed = ", ".join(repr(t) for t in TEXT_PARTS)
            raise APIError(
                f"{at}.type: only text parts are supported ({allowed}), got {short(kind)}",
                param=f"{at}.type",
            )
        # (an earlier output's text part carries its annotations and log-probs: they describe
        # the text, which is all a prompt takes of it)
        part = {k: v for k, v in part.items() if v is not None}
        _only_keys(part, ("type", "text", "annotations", "logprobs"), at)
        if not isinstance(part.get("text"), str):
            raise APIError(
                f"{at}.text: must be a string, got {short(part.get('text'))}", param=f"{at}.text"
            )
        texts.append(part["text"])
    return "\n".join(texts)  # (as the chat route joins its text parts)


def _only_keys(obj: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise APIError(
            f"{where}.{unknown[0]}: unknown field; allowed: {', '.join(allowed)}",
            param=f"{where}.{unknown[0]}",
        )


# ---- the response's shape (documentation only: the handler builds its JSON directly) ------------
class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText]


class ResponseInputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class ResponseOutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: ResponseIncompleteDetails | None = None
    error: None = None
    model: str
    output: list[ResponseOutputMessage]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    metadata: dict[str, str]
    parallel_tool_calls: bool
    tool_choice: str
    tools: list[Any]
    text: dict[str, Any]
    store: bool
    previous_response_id: None = None
    reasoning: None = None
    truncation: str
    top_logprobs: int
    background: bool
    user: str | None = None
    service_tier: str
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
