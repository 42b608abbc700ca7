"""Request bodies of the HTTP API (pydantic, strict), the helpers the request models share, and
the conversion of validation errors into OpenAI-style 400 answers that name the offending
field. The OpenAI routes' bodies are in `openai_protocol`; /generate's are here.

Bodies are parsed with `model_validate_json` in strict mode: a string is not a number, a float
is not an integer, a number is not a boolean. Sampling parameters are checked by the engine's
own `check_field` (one validation for the server and the offline API). Unknown fields are
ignored, except inside `/generate`'s `sampling_params`.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from specserve.errors import InvalidArgument
from specserve.sampling_params import (
    MAX_TEMPERATURE,
    check_field,
    check_logprob_field,
    is_int,
    short,
)


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


def field_error(field: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message, {"field": field})


def core_check(name: str, value: Any, max_temperature: float, core_name: str | None = None):
    """The engine's check of one sampling parameter, as a pydantic error on this field."""
    try:
        return check_field(core_name or name, value, max_temperature)
    except InvalidArgument as e:
        msg = str(e)
        if msg.startswith(e.field + ": "):
            msg = msg[len(e.field) + 2 :]
        raise field_error(name, msg) from None


def is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(is_int(t) for t in v)


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _schema(**kw: Any) -> dict[str, Any]:
    return {"json_schema_extra": kw}


class NativeSamplingParams(StrictModel):
    """/generate's sampling_params: the engine's `SamplingParams`, checked by its own
    check_field (temperature up to 100); unknown names are an error."""

    model_config = ConfigDict(strict=True, extra="forbid")

    temperature: float = Field(1.0, **_schema(minimum=0, maximum=MAX_TEMPERATURE))
    top_p: float = Field(1.0, **_schema(exclusiveMinimum=0, maximum=1))
    top_k: int = Field(-1, **_schema(minimum=-1))
    min_p: float = Field(0.0, **_schema(minimum=0, maximum=1))
    max_new_tokens: int = Field(128, **_schema(minimum=0))
    min_new_tokens: int = Field(0, **_schema(minimum=0))
    stop: str | list[str] | None = Field(None, **_schema(maxItems=16))
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, **_schema(minimum=-(2**63)))
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, **_schema(minimum=1, maximum=64))
    speculative: bool = True
    frequency_penalty: float = Field(0.0, **_schema(minimum=-2, maximum=2))
    presence_penalty: float = Field(0.0, **_schema(minimum=-2, maximum=2))
    repetition_penalty: float = Field(1.0, **_schema(exclusiveMinimum=0, maximum=2))
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = Field(None, **_schema(minimum=-1))  # -1: the longest
    # structured output: a JSON schema (an object or its text), a regex, an EBNF grammar
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _check(cls, v, info: ValidationInfo):
        return core_check(info.field_name, v, MAX_TEMPERATURE)

    def engine_params(self) -> dict[str, Any]:
        """The fields the client set, for `SamplingParams.from_any`."""
        return self.model_dump(exclude_unset=True)


# /generate's sampling_params: one object for every prompt, or a list of one per prompt (as
# SGLang and the offline Engine.generate take); the tags only pick the shape, and errors leave
# them out of the field they name (`sampling_params[1].temperature`)
_SP_TAGS = ("one", "per_prompt")
SamplingParamsArg = Annotated[
    Union[
        Annotated[NativeSamplingParams, Tag("one")],
        Annotated[list[NativeSamplingParams], Tag("per_prompt")],
    ],
    Discriminator(lambda v: "per_prompt" if isinstance(v, list) else "one"),
]


def _checked_logprob_option(name: str, value: Any) -> Any:
    try:
        return check_logprob_field(name, value)
    except InvalidArgument as e:
        raise field_error(name, str(e)[len(e.field) + 2 :]) from None


def only_neutral(table: dict[str, tuple[Any, str]], name: str, v: Any) -> Any:
    """`v` if it is null or the neutral value of a feature this server lacks (`table`: field ->
    (is neutral, why not)), else a 400 naming the field."""
    is_neutral, message = table[name]
    if v is not None and not is_neutral(v):
        raise field_error(name, f"{message}, got {short(v)}")
    return v


# SGLang's /generate fields this server does not implement: accepted only at their neutral
# value (null always), so a request for an adapter, images or hidden states is not served as
# plain text on the base model.
_NATIVE_NEUTRAL: dict[str, tuple[Any, str]] = {
    "lora_path": (
        lambda v: isinstance(v, list) and all(x is None for x in v),
        "LoRA adapters are not supported (only null, or a list of nulls: one per prompt)",
    ),
    "image_data": (lambda v: v == [], "images are not supported (only null or [])"),
    "audio_data": (lambda v: v == [], "audio is not supported (only null or [])"),
    "video_data": (lambda v: v == [], "video is not supported (only null or [])"),
    "modalities": (lambda v: v == [], "only text is supported (only null or [])"),
    "input_embeds": (lambda v: False, "is not supported (only null)"),
    "return_hidden_states": (lambda v: v is False, "is not supported (only false)"),
    "custom_logit_processor": (lambda v: False, "is not supported (only null)"),
    "session_params": (lambda v: False, "sessions are not supported (only null)"),
    "token_ids_logprob": (lambda v: False, "is not supported (only null)"),
}


class GenerateRequest(StrictModel):
    """SGLang's native /generate body."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsArg | None = None
    stream: bool = False
    rid: str | list[str] | None = None  # one per prompt (a list for a batch), as SGLang
    # log-probs (SGLang's names), checked by the engine's check_logprob_field: a value for
    # every prompt, or (a batch) a list of one per prompt, as SGLang
    return_logprob: bool | list[bool] = False
    top_logprobs_num: int | list[int] = Field(0, **_schema(minimum=0, maximum=20))
    logprob_start_len: int | list[int] = Field(-1, **_schema(minimum=-1))
    return_text_in_logprobs: bool = False
    # SGLang's fields accepted only at their neutral value
    lora_path: Any = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    modalities: Any = None
    input_embeds: Any = None
    return_hidden_states: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    token_ids_logprob: Any = None

    @field_validator(*_NATIVE_NEUTRAL)
    @classmethod
    def _only_neutral(cls, v, info: ValidationInfo):
        return only_neutral(_NATIVE_NEUTRAL, info.field_name, v)

    @field_validator("text", mode="before")
    @classmethod
    def _text(cls, v):
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
            return v
        raise field_error("text", "must be a string or a non-empty list of strings")

    @field_validator("rid", mode="before")
    @classmethod
    def _rid(cls, v):
        if v is None or (isinstance(v, str) and v):
            return v
        if isinstance(v, list) and v and all(isinstance(r, str) and r for r in v):
            return v
        raise field_error("rid", "must be a non-empty string or a non-empty list of them")

    @field_validator("input_ids", mode="before")
    @classmethod
    def _input_ids(cls, v):
        if v is None or is_token_ids(v):
            return v
        if isinstance(v, list) and v and all(is_token_ids(p) for p in v):
            return v
        raise field_error(
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
        name = info.field_name
        if isinstance(v, list) and name != "return_text_in_logprobs":
            if not v:
                raise field_error(name, "must be a value or a non-empty list of one per prompt")
            return [_checked_logprob_option(name, x) for x in v]
        return _checked_logprob_option(name, v)

    def most_alternatives(self) -> int:
        """The most log-prob alternatives any prompt asked for (0: no log-probs)."""
        ask, top = self.return_logprob, self.top_logprobs_num
        n = max(len(x) if isinstance(x, list) else 1 for x in (ask, top))
        asks = ask if isinstance(ask, list) else [ask] * n
        tops = top if isinstance(top, list) else [top] * n
        return max((k for a, k in zip(asks, tops) if a), default=0)

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
    if len(loc) > 1 and loc[0] == "sampling_params" and len(loc) - isinstance(loc[1], int) == 2:
        names = ", ".join(NativeSamplingParams.model_fields)
        return f"sampling_params allows: {names}"
    return "see the API reference"


def validation_error_to_api_error(err: ValidationError) -> APIError:
    first = err.errors(include_url=False)[0]
    kind, loc, msg = first["type"], tuple(first["loc"]), first["msg"]
    if len(loc) > 1 and loc[0] == "sampling_params" and loc[1] in _SP_TAGS:
        loc = loc[:1] + loc[2:]
        if loc == ("sampling_params",) and kind == "model_type":
            msg = "must be an object of sampling parameters, or a list of one per prompt"
    if kind == "json_invalid":
        if "recursion limit" in msg:  # (pydantic's parser stops nesting at 200 levels)
            return APIError("request body nests arrays or objects more than 200 levels deep")
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
        message += f" (got {short(first['input'])})"
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
