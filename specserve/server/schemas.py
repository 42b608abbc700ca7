"""What /openapi.json publishes: the request bodies (the strict models of `protocol`, which the
handlers parse themselves) and the shapes of responses and errors.

The response models only document; handlers build their JSON directly.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec_verify_ct: int | None = None
    spec_accept_length: float | None = None


class CompletionLogprobs(BaseModel):
    """The legacy shape; with echo the prompt's tokens come first (the first has null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    matched_stop: str | int | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None  # (null beside tool calls)
    tool_calls: list[ToolCallOut] | None = None  # with tool_choice 'required' or a function


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    matched_stop: str | int | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class GenerateOutput(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    finished: bool


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class ModelInfo(BaseModel):
    model_path: str
    served_model_name: str
    is_generation: bool
    context_length: int
    vocab_size: int
    has_tokenizer: bool


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: str
    reason: str | None = None


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("malformed or out-of-range request; `param` names the field"),
    401: _error("missing or wrong API key (--api-key)"),
    404: _error("unknown model or route"),
    408: _error("the request body did not arrive in time (--request-body-timeout)"),
    413: _error("the request body is too large (--max-request-bytes)"),
    415: _error("the body is not Content-Type: application/json"),
    500: _error("a failure inside the server or the engine"),
    503: _error("at capacity, shutting down, or the engine failed"),
}

STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON, or with `stream: true` server-sent events (`data: {json}` lines "
        "ending with `data: [DONE]`)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}

METRICS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


def body(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra declaring `model` (installed by `install_openapi`) as the JSON body."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]]) -> None:
    """Add the request models (and the models they use) to the app's schema components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description="OpenAI-compatible and SGLang-native LLM serving (docs/SERVER.md)",
                routes=app.routes,
            )
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in request_models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in js.pop("$defs", {}).items():
                    comps.setdefault(name, sub)
                comps[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
