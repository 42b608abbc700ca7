"""Request bodies of the HTTP API (pydantic, strict) and the conversion of validation errors
into OpenAI-style 400 answers that name the offending field.

Bodies are parsed with `model_validate_json` in strict mode: a string is not a number, a float
is not an integer, a number is not a boolean. Sampling parameters are checked by the engine's
own `check_field` (one validation for the server and the offline API); the OpenAI routes cap
temperature at 2, as OpenAI does. Fields of the OpenAI API that this server does not implement
are accepted only at their neutral value (e.g. `best_of: 1`), so a client never silently
gets something other than what it asked for. Unknown fields are ignored, except inside
`/generate`'s `sampling_params`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from specserve.errors import InvalidArgument
from specserve.sampling_params import MAX_TEMPERATURE, check_field, check_logprob_field

OPENAI_MAX_TEMPERATURE = 2.0


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code
        self.rejected = True  # answered before the engine saw the request (for /metrics)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _bad(field: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message, {"field": field})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _core_check(name: str, value: Any, max_temperature: float, core_name: str | None = None):
    """The engine's check of one sampling parameter, as a pydantic error on this field."""
    try:
        return check_field(core_name or name, value, max_temperature)
    except InvalidArgument as e:
        msg = str(e)
        if msg.startswith(e.field + ": "):
            msg = msg[len(e.field) + 2 :]
        raise _bad(name, msg) from None


# Sampling fields of the OpenAI routes checked by the engine's check_field; null = default.
_OPENAI_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "n",
    "speculative",
)
_NULLABLE = {"temperature", "top_p", "top_k", "min_p", "stop", "seed", "stop_token_ids", "n"}
# OpenAI's limits on alternatives per position: chat `top_logprobs`, completions `logprobs`.
CHAT_MAX_TOP_LOGPROBS = 20
COMPLETION_MAX_LOGPROBS = 5


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(_is_int(t) for t in v)


# OpenAI features this server does not implement: accepted only at their neutral value.
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "presence_penalty": (lambda v: v == 0, "is not supported (only 0)"),
    "frequency_penalty": (lambda v: v == 0, "is not supported (only 0)"),
    "repetition_penalty": (lambda v: v == 1.0, "is not supported (only 1.0)"),
    "logit_bias": (lambda v: not v, "is not supported"),
    "suffix": (lambda v: not v, "is not supported"),
    "best_of": (lambda v: v == 1, "only best_of=1 is supported"),
    "tools": (lambda v: not v, "tool calling is not supported"),
    "tool_choice": (lambda v: v in ("none", "auto"), "tool calling is not supported"),
    "response_format": (lambda v: v.get("type") == "text", "only {'type': 'text'} is supported"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _CommonRequest(_Strict):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, json_schema_extra={"minimum": 0})
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 2})
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: int | None = Field(None, json_schema_extra={"minimum": -1})
    min_p: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 1})
    stop: str | list[str] | None = Field(None, json_schema_extra={"maxItems": 16})
    seed: int | None = Field(None, json_schema_extra={"minimum": 0})
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (SGLang / vLLM names).
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    speculative: bool = True  # False: this request is decoded without draft tokens
    return_token_ids: bool = False
    # OpenAI fields accepted only at their neutral value.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator(*_OPENAI_SAMPLING, mode="before")
    @classmethod
    def _sampling(cls, v, info: ValidationInfo):
        if v is None and info.field_name in _NULLABLE:
            return None
        return _core_check(info.field_name, v, OPENAI_MAX_TEMPERATURE)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens_check(cls, v, info: ValidationInfo):
        return None if v is None else _core_check("max_tokens", v, 0, "max_new_tokens")

    @field_validator(*_NEUTRAL, check_fields=False)
    @classmethod
    def _only_neutral(cls, v, info: ValidationInfo):
        is_neutral, message = _NEUTRAL[info.field_name]
        if v is not None and not is_neutral(v):
            raise _bad(info.field_name, f"{message}, got {_short(v)}")
        return v

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options: only allowed when stream is true", param="stream_options"
            )

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """Engine (SGLang-named) sampling parameters; OpenAI's defaults where not given."""
        sp: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k in (None, 0) else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "max_new_tokens": max_new_tokens,
            "stop": list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "speculative": self.speculative,
        }
        if self.seed is not None:
            sp["seed"] = self.seed
        if self.n is not None:
            sp["n"] = self.n
        return sp

    def logprob_options(self) -> dict[str, Any]:
        """The engine's log-prob options for this request (none by default)."""
        return {}


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 5})

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v):
        if v is not None and not (_is_int(v) and 0 <= v <= COMPLETION_MAX_LOGPROBS):
            raise _bad(
                "logprobs",
                f"must be an integer in [0, {COMPLETION_MAX_LOGPROBS}] or null, got {_short(v)}",
            )
        return v

    def logprob_options(self) -> dict[str, Any]:
        """logprobs: N gives each token's log-prob and the N likeliest; echo asks for the
        prompt's too (its first token has none)."""
        if self.logprobs is None:
            return {}
        return {
            "return_logprob": True,
            "top_logprobs_num": self.logprobs,
            "logprob_start_len": 0 if self.echo else -1,
        }

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str) or _token_ids(v):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v) or all(_token_ids(p) for p in v):
                return v
        raise _bad(
            "prompt",
            "must be a string, a non-empty list of strings, a non-empty list of token ids, "
            "or a non-empty list of non-empty lists of token ids",
        )

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str) or _token_ids(p):
            return [p]
        return list(p)


ROLES = ("system", "developer", "user", "assistant")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] = Field(...)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            parts = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise _bad(
                        "content", "only text content parts ({'type': 'text', ...}) are supported"
                    )
                if not isinstance(part.get("text"), str):
                    raise _bad("content", "a text content part needs a string 'text'")
                parts.append(part["text"])
            return "\n".join(parts)
        raise _bad("content", "must be a string or a non-empty list of text content parts")


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    logprobs: bool = False
    top_logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 20})
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _at_least_one(cls, v, info: ValidationInfo):
        if v is not None and v < 1:
            raise _bad(info.field_name, f"must be >= 1, got {v}")
        return v

    @field_validator("max_completion_tokens", mode="before")
    @classmethod
    def _max_completion_tokens(cls, v):
        return None if v is None else _core_check("max_completion_tokens", v, 0, "max_new_tokens")

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _top_logprobs(cls, v):
        if v is not None and not (_is_int(v) and 0 <= v <= CHAT_MAX_TOP_LOGPROBS):
            raise _bad(
                "top_logprobs",
                f"must be an integer in [0, {CHAT_MAX_TOP_LOGPROBS}] or null, got {_short(v)}",
            )
        return v

    def check_logprobs(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(
                "top_logprobs: needs logprobs to be true (as OpenAI)", param="top_logprobs"
            )

    def logprob_options(self) -> dict[str, Any]:
        if not self.logprobs:
            return {}
        return {"return_logprob": True, "top_logprobs_num": self.top_logprobs or 0}

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def chat_messages(self) -> list[dict[str, str]]:
        out = []
        for m in self.messages:
            # The chat templates of small models know "system" but not OpenAI's "developer".
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.content})
        return out


def _schema(**kw: Any) -> dict[str, Any]:
    return {"json_schema_extra": kw}


class NativeSamplingParams(_Strict):
    """/generate's sampling_params: the engine's `SamplingParams`, checked by its own
    check_field (temperature up to 100); unknown names are an error."""

    model_config = ConfigDict(strict=True, extra="forbid")

    temperature: float = Field(1.0, **_schema(minimum=0, maximum=MAX_TEMPERATURE))
    top_p: float = Field(1.0, **_schema(exclusiveMinimum=0, maximum=1))
    top_k: int = Field(-1, **_schema(minimum=-1))
    min_p: float = Field(0.0, **_schema(minimum=0, maximum=1))
    max_new_tokens: int = Field(128, **_schema(minimum=0))
    stop: str | list[str] | None = Field(None, **_schema(maxItems=16))
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, **_schema(minimum=0))
    skip_special_tokens: bool = True
    n: int = Field(1, **_schema(minimum=1, maximum=64))
    speculative: bool = True

    @field_validator("*", mode="before")
    @classmethod
    def _check(cls, v, info: ValidationInfo):
        return _core_check(info.field_name, v, MAX_TEMPERATURE)

    def engine_params(self) -> dict[str, Any]:
        """The fields the client set, for `SamplingParams.from_any`."""
        return self.model_dump(exclude_unset=True)


class GenerateRequest(_Strict):
    """SGLang's native /generate body."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | None = None
    stream: bool = False
    rid: str | None = None
    # log-probs (SGLang's names), checked by the engine's check_logprob_field
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, **_schema(minimum=0, maximum=20))
    logprob_start_len: int = Field(-1, **_schema(minimum=-1))
    return_text_in_logprobs: bool = False

    @field_validator("text", mode="before")
    @classmethod
    def _text(cls, v):
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
            return v
        raise _bad("text", "must be a string or a non-empty list of strings")

    @field_validator("input_ids", mode="before")
    @classmethod
    def _input_ids(cls, v):
        if v is None or _token_ids(v):
            return v
        if isinstance(v, list) and v and all(_token_ids(p) for p in v):
            return v
        raise _bad(
            "input_ids",
            "must be a non-empty list of token ids or a non-empty list of such lists",
        )

    @field_validator(
        "return_logprob",
        "top_logprobs_num",
        "logprob_start_len",
        "return_text_in_logprobs",
        mode="before",
    )
    @classmethod
    def _logprob_option(cls, v, info: ValidationInfo):
        try:
            return check_logprob_field(info.field_name, v)
        except InvalidArgument as e:
            raise _bad(info.field_name, str(e)[len(e.field) + 2 :]) from None

    def logprob_options(self) -> dict[str, Any]:
        return {
            "return_logprob": self.return_logprob,
            "top_logprobs_num": self.top_logprobs_num,
            "logprob_start_len": self.logprob_start_len,
            "return_text_in_logprobs": self.return_text_in_logprobs,
        }


# ---- validation errors -> APIError ---------------------------------------------------------
def _loc_to_param(loc: tuple) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def _allowed(loc: tuple) -> str:
    if len(loc) == 2 and loc[0] == "sampling_params":
        names = ", ".join(NativeSamplingParams.model_fields)
        return f"sampling_params allows: {names}"
    return "see the API reference"


def _short(value: Any, limit: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def validation_error_to_api_error(err: ValidationError) -> APIError:
    first = err.errors(include_url=False)[0]
    kind, loc, msg = first["type"], tuple(first["loc"]), first["msg"]
    if kind == "json_invalid":
        return APIError(f"request body is not valid JSON: {msg}")
    if kind == "extra_forbidden":
        param = _loc_to_param(loc)
        return APIError(f"{param}: unknown field; {_allowed(loc)}", param=param)
    if not loc and kind in ("model_type", "model_attributes_type", "dict_type"):
        return APIError(
            f"request body must be a JSON object, got {type(first.get('input')).__name__}"
        )
    param = _loc_to_param(loc)
    message = f"{param}: {msg}"
    if kind not in ("missing", "invalid_value") and "input" in first:
        message += f" (got {_short(first['input'])})"
    if len(err.errors()) > 1:
        message += f" ({len(err.errors()) - 1} more error(s) in the body)"
    return APIError(message, param=param)


def parse(model: type[BaseModel], body: bytes):
    if not body.strip():
        raise APIError("request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error_to_api_error(e) from None
