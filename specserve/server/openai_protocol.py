"""Request bodies of the OpenAI routes, /v1/completions and /v1/chat/completions (pydantic,
strict; see `protocol`).

The OpenAI routes cap temperature at 2, as OpenAI does. Fields of the OpenAI API that this
server does not implement are accepted only at their neutral value (e.g. `best_of: 1`), so a
client never silently gets something other than what it asked for.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from specserve.server.protocol import (
    APIError,
    StrictModel,
    core_check,
    field_error,
    is_int,
    is_token_ids,
    only_neutral,
    short,
)
from specserve.server.structured_output import constraint_fields, structured_output
from specserve.server.tool_calls import (
    HistoryToolCalls,
    ToolCallId,
    ToolChoice,
    ToolPlan,
    Tools,
    check_alone,
    check_unstopped,
    plan,
    template_tools,
)

OPENAI_MAX_TEMPERATURE = 2.0

# Sampling fields checked by the engine's check_field; null = default.
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
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "truncate_prompt_tokens",
)
# Booleans outside those: null is the default too, as OpenAI's and vLLM's servers take it.
_NULL_IS_DEFAULT = ("stream", "return_token_ids", "echo", "logprobs")
# OpenAI's limits on alternatives per position: chat `top_logprobs`, completions `logprobs`.
CHAT_MAX_TOP_LOGPROBS = 20
COMPLETION_MAX_LOGPROBS = 5

# Features this server does not implement: accepted only at their neutral value (null always).
NEUTRAL_FIELDS: dict[str, tuple[Any, str]] = {
    "suffix": (lambda v: not v, "is not supported"),
    "best_of": (lambda v: is_int(v) and v == 1, "only best_of=1 is supported"),
    # (chat takes tools: server/tool_calls.py)
    "tools": (
        lambda v: not v,
        "tool calling is served on /v1/chat/completions only (here only null or [])",
    ),
    "tool_choice": (
        lambda v: v in ("none", "auto"),
        "tool calling is served on /v1/chat/completions only (here only null, 'none' or 'auto')",
    ),
    # (OpenAI's deprecated form of tools)
    "functions": (
        lambda v: not v,
        "the deprecated function calling is not supported, use tools (only null or [])",
    ),
    "function_call": (
        lambda v: v in ("none", "auto"),
        "the deprecated function calling is not supported, use tool_choice (only null, "
        "'none' or 'auto')",
    ),
    # sampling extensions of vLLM and SGLang that would change the output
    # (these are untyped here: the strict types of the other fields are checked by hand, so
    # that false or 0.0 is not taken for 0)
    "use_beam_search": (lambda v: v is False, "beam search is not supported (only false)"),
    "bad_words": (lambda v: v == [], "is not supported (only null or [])"),
    "prompt_logprobs": (lambda v: False, "is not supported (only null)"),
    "stop_regex": (lambda v: v == [], "is not supported (only null or [])"),
    "typical_p": (lambda v: v == 1 and not isinstance(v, bool), "is not supported (only 1.0)"),
    "documents": (lambda v: v == [], "is not supported (only null or [])"),
    # vLLM's and SGLang's extensions that would change the output or its form
    "lora_request": (lambda v: False, "LoRA adapters are not supported (only null)"),
    "lora_path": (
        lambda v: isinstance(v, list) and all(x is None for x in v),
        "LoRA adapters are not supported (only null, or a list of nulls: one per prompt)",
    ),
    "logits_processors": (lambda v: v == [], "is not supported (only null or [])"),
    "custom_logit_processor": (lambda v: False, "is not supported (only null)"),
    "prompt_embeds": (lambda v: False, "is not supported (only null)"),
    "return_tokens_as_token_ids": (lambda v: v is False, "is not supported (only false)"),
    "return_hidden_states": (lambda v: v is False, "is not supported (only false)"),
    "guided_whitespace_pattern": (lambda v: False, "is not supported (only null)"),
    "structural_tag": (lambda v: False, "is not supported (only null)"),
    "spaces_between_special_tokens": (lambda v: v is True, "is not supported (only true)"),
    "priority": (
        lambda v: is_int(v) and v == 0,
        "priority scheduling is not supported (only 0)",
    ),
}


def _int_or_null(name: str, v: Any, maximum: int) -> int | None:
    if v is not None and not (is_int(v) and 0 <= v <= maximum):
        raise field_error(name, f"must be an integer in [0, {maximum}] or null, got {short(v)}")
    return v


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's and SGLang's: with include_usage, every chunk carries its choice's usage so far
    continuous_usage_stats: bool = False

    @field_validator("include_usage", "continuous_usage_stats", mode="before")
    @classmethod
    def _null_is_false(cls, v):
        return False if v is None else v


def _one_field(name: str, value: Any, other_name: str, other: Any) -> Any:
    """The value of a field that has two names (vLLM's and SGLang's): either given, or both
    alike."""
    if value is not None and other is not None and value != other:
        raise APIError(
            f"{other_name}: differs from {name} (two names of one field)", param=other_name
        )
    return value if value is not None else other


class CommonRequest(StrictModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, json_schema_extra={"minimum": 0})
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 2})
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: int | None = Field(None, json_schema_extra={"minimum": -1})
    min_p: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 1})
    stop: str | list[str] | None = Field(None, json_schema_extra={"maxItems": 16})
    seed: int | None = Field(None, json_schema_extra={"minimum": -(2**63)})
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
    # penalties on the output so far and a bias per token id (string keys, as OpenAI's)
    presence_penalty: float = Field(0.0, json_schema_extra={"minimum": -2, "maximum": 2})
    frequency_penalty: float = Field(0.0, json_schema_extra={"minimum": -2, "maximum": 2})
    repetition_penalty: float = Field(1.0, json_schema_extra={"exclusiveMinimum": 0, "maximum": 2})
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # the only tokens drawn (vLLM's)
    # the prompt's last k tokens (vLLM's); -1: the longest prompt the engine takes
    truncate_prompt_tokens: int | None = Field(None, json_schema_extra={"minimum": -1})
    # OpenAI fields accepted only at their neutral value.
    tools: list[Any] | None = None
    tool_choice: Any = None
    # structured output (server/structured_output.py)
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    # no stop token or stop string before this many tokens (vLLM's name; SGLang's)
    min_tokens: int | None = None
    min_new_tokens: int | None = None
    # the text keeps the stop string or stopping token (vLLM's name; SGLang's)
    include_stop_str_in_output: bool | None = None
    no_stop_trim: bool | None = None
    best_of: Any = None
    stop_regex: Any = None
    typical_p: Any = None
    use_beam_search: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None
    lora_request: Any = None
    lora_path: Any = None
    logits_processors: Any = None
    custom_logit_processor: Any = None
    prompt_embeds: Any = None
    return_tokens_as_token_ids: Any = None
    return_hidden_states: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    spaces_between_special_tokens: Any = None
    priority: Any = None

    @field_validator(*_OPENAI_SAMPLING, mode="before")
    @classmethod
    def _sampling(cls, v, info: ValidationInfo):
        if v is None:
            return cls.model_fields[info.field_name].default
        return core_check(info.field_name, v, OPENAI_MAX_TEMPERATURE)

    @field_validator("min_tokens", "min_new_tokens", mode="before")
    @classmethod
    def _min_tokens_check(cls, v, info: ValidationInfo):
        return None if v is None else core_check(info.field_name, v, 0, "min_new_tokens")

    @field_validator(*_NULL_IS_DEFAULT, mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, v, info: ValidationInfo):
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens_check(cls, v, info: ValidationInfo):
        return None if v is None else core_check("max_tokens", v, 0, "max_new_tokens")

    @field_validator(*NEUTRAL_FIELDS, check_fields=False)
    @classmethod
    def _only_neutral(cls, v, info: ValidationInfo):
        return only_neutral(NEUTRAL_FIELDS, info.field_name, v)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage on every chunk (as vLLM: only together with include_usage)."""
        return self.include_usage() and self.stream_options.continuous_usage_stats

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options: only allowed when stream is true", param="stream_options"
            )

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def least_tokens(self) -> int:
        """min_tokens (either name): the server's default length is raised to it."""
        least = _one_field("min_tokens", self.min_tokens, "min_new_tokens", self.min_new_tokens)
        return least or 0

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
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
        }
        keep = _one_field("include_stop_str_in_output", self.include_stop_str_in_output,
                          "no_stop_trim", self.no_stop_trim)  # fmt: skip
        sp["no_stop_trim"] = bool(keep)
        least = _one_field("min_tokens", self.min_tokens, "min_new_tokens", self.min_new_tokens)
        if least:
            if least > max_new_tokens:
                field = "min_tokens" if self.min_tokens is not None else "min_new_tokens"
                raise APIError(
                    f"{field}: must be at most the completion's maximum length "
                    f"({max_new_tokens}), got {least}",
                    param=field,
                )
            sp["min_new_tokens"] = least
        if self.seed is not None:
            sp["seed"] = self.seed
        if self.n is not None:
            sp["n"] = self.n
        sp.update(structured_output(self)[0])
        return sp

    def logprob_options(self) -> dict[str, Any]:
        """The engine's log-prob options for this request (none by default)."""
        return {}


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    echo: bool = False
    suffix: str | None = None
    # vLLM's: a text prompt is encoded with the tokenizer's special tokens (BOS), only so
    add_special_tokens: Any = None

    @field_validator("add_special_tokens", mode="before")
    @classmethod
    def _special_tokens_added(cls, v):
        if v is not None and v is not True:
            raise field_error("add_special_tokens", f"is not supported (only true), got {short(v)}")
        return v

    logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 5})

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v):
        return _int_or_null("logprobs", v, COMPLETION_MAX_LOGPROBS)

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
        if isinstance(v, str) or is_token_ids(v):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v) or all(is_token_ids(p) for p in v):
                return v
        raise field_error(
            "prompt",
            "must be a string, a non-empty list of strings, a non-empty list of token ids, "
            "or a non-empty list of non-empty lists of token ids",
        )

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str) or is_token_ids(p):
            return [p]
        return list(p)


ROLES = ("system", "developer", "user", "assistant")
# (a tool's answer: chat only, the Responses route takes no tool outputs)
CHAT_ROLES = (*ROLES, "tool")


class ChatMessage(StrictModel):
    role: Literal[CHAT_ROLES]
    # (before content, which an assistant's message with tool calls may leave null)
    tool_calls: HistoryToolCalls = None
    content: str | list[dict[str, Any]] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_call_id: ToolCallId = Field(None, validate_default=True)  # (a tool message's)
    # (the deprecated function calling: refused, as its functions are, rather than dropped
    # from the history)
    function_call: Any = None

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v):
        if v:
            raise field_error(
                "function_call",
                "the deprecated function calling is not supported, use tool_calls (only null)",
            )
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v, info: ValidationInfo):
        if isinstance(v, str):
            return v
        if v is None and info.data.get("role") == "assistant" and info.data.get("tool_calls"):
            return v
        if isinstance(v, list) and v:
            parts = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise field_error(
                        "content", "only text content parts ({'type': 'text', ...}) are supported"
                    )
                if not isinstance(part.get("text"), str):
                    raise field_error("content", "a text content part needs a string 'text'")
                parts.append(part["text"])
            return "\n".join(parts)
        raise field_error(
            "content",
            "must be a string or a non-empty list of text content parts (null only in an "
            "assistant's message with tool_calls)",
        )


# apply_chat_template's own arguments: what the request's other fields decide, not template
# variables
_TEMPLATE_ARGUMENTS = frozenset(
    (
        "conversation", "conversations", "messages", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize", "padding",
        "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
        "self",  # (the method's own: as a keyword, a TypeError there)
        # the tokenizer's special tokens, which the template also reads
        "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
        "mask_token", "additional_special_tokens",
    )
)  # fmt: skip
# The most characters a request's template variables may hold (as JSON): the request-size
# checks count the messages' text before the template renders, and a variable the template
# prints would get past them.
MAX_TEMPLATE_KWARGS_CHARS = 4096


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    # (a chat answers at least one token: 0, which completions take for scoring, is refused)
    max_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    max_completion_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    logprobs: bool = False
    top_logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 20})
    functions: list[Any] | None = None  # (OpenAI's deprecated form of tools)
    function_call: Any = None
    # tool calling (server/tool_calls.py); tools and tool_choice are CommonRequest's names,
    # which the other routes take only at their neutral value
    tools: Tools = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None  # false: 'required' answers one call
    _tool_plan: ToolPlan | None = PrivateAttr(None)
    # vLLM's chat template options: the assistant's turn opened after the messages, or the
    # final message continued; variables the template reads (e.g. enable_thinking)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # accepted only at their neutral value: a request's own template (vLLM too refuses one
    # unless its server trusts requests' templates), and vLLM's chat echo
    chat_template: Any = None
    echo: Any = None
    documents: Any = None  # (vLLM's retrieval documents for the template)
    # vLLM's: the template's text alone, no special tokens added around it, only so
    add_special_tokens: Any = None

    # (the parent's check of the neutral fields, less the tools this route takes)
    @field_validator(
        *(f for f in NEUTRAL_FIELDS if f not in ("tools", "tool_choice")), check_fields=False
    )
    @classmethod
    def _only_neutral(cls, v, info: ValidationInfo):
        return only_neutral(NEUTRAL_FIELDS, info.field_name, v)

    @model_validator(mode="after")
    def _tool_constraint(self):
        self._tool_plan = plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        check_alone(self._tool_plan, constraint_fields(self))
        check_unstopped(self._tool_plan, {"stop": self.stop, "stop_token_ids": self.stop_token_ids})
        return self

    def tool_plan(self) -> ToolPlan | None:
        """How the answer becomes tool calls (None: it is text)."""
        return self._tool_plan

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        sp = super().sampling_params(max_new_tokens)
        if self._tool_plan is not None:
            sp["json_schema"] = self._tool_plan.schema
        return sp

    @field_validator("add_special_tokens", mode="before")
    @classmethod
    def _no_special_tokens_added(cls, v):
        if v is not None and v is not False:
            raise field_error(
                "add_special_tokens", f"is not supported (only false), got {short(v)}"
            )
        return v

    @field_validator("add_generation_prompt", "continue_final_message", mode="before")
    @classmethod
    def _template_flag(cls, v, info: ValidationInfo):
        if v is None:
            return cls.model_fields[info.field_name].default
        if not isinstance(v, bool):
            raise field_error(info.field_name, f"must be true or false, got {short(v)}")
        return v

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, v):
        if v is None:
            return v
        if not isinstance(v, dict):
            raise field_error("chat_template_kwargs", "must be an object of template variables")
        taken = sorted(k for k in v if k in _TEMPLATE_ARGUMENTS)
        if taken:
            raise field_error(
                "chat_template_kwargs",
                f"{', '.join(taken)}: not a template variable (set by the request's own "
                "fields or by the tokenizer)",
            )
        if len(json.dumps(v)) > MAX_TEMPLATE_KWARGS_CHARS:
            raise field_error(
                "chat_template_kwargs",
                f"at most {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON (template "
                "variables, not text)",
            )
        return v

    @field_validator("chat_template")
    @classmethod
    def _no_request_template(cls, v):
        if v is not None:
            raise field_error(
                "chat_template", "a request's own chat template is not accepted (only null)"
            )
        return v

    @field_validator("echo")
    @classmethod
    def _no_chat_echo(cls, v):
        if v is not None and v is not False:  # (strict: 0 is not false)
            raise field_error("echo", "is not supported on chat completions (only false)")
        return v

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _at_least_one(cls, v, info: ValidationInfo):
        if v is not None and v < 1:
            raise field_error(info.field_name, f"must be >= 1, got {v}")
        return v

    @field_validator("max_completion_tokens", mode="before")
    @classmethod
    def _max_completion_tokens(cls, v):
        return None if v is None else core_check("max_completion_tokens", v, 0, "max_new_tokens")

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _top_logprobs(cls, v):
        return _int_or_null("top_logprobs", v, CHAT_MAX_TOP_LOGPROBS)

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

    def template_options(self) -> dict[str, Any]:
        """`Engine.tokenize_chat`'s options."""
        options: dict[str, Any] = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": self.chat_template_kwargs,
        }
        if self.tools:  # (whatever the tool choice, as vLLM renders them)
            options["tools"] = template_tools(self.tools)
        return options

    def chat_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            # The chat templates of small models know "system" but not OpenAI's "developer".
            role = "system" if m.role == "developer" else m.role
            # (null content, beside tool calls, is "" to the templates and the size checks)
            message: dict[str, Any] = {"role": role, "content": m.content or ""}
            if m.name is not None:  # (for the templates that render a speaker's name)
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [c.for_template() for c in m.tool_calls]
            if m.role == "tool":
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out
