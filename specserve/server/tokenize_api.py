"""vLLM's /tokenize and /detokenize: the token ids of a prompt (a text, or chat messages
through the model's template, encoded exactly as the completion routes encode them) and the
text of token ids. Clients count a prompt's tokens with them (`vllm bench serve` asks the
server's /tokenize before a run)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import Field, ValidationError

from specserve.server.openai_api import check_model, check_token_ids
from specserve.server.openai_protocol import ChatCompletionRequest
from specserve.server.protocol import APIError, StrictModel, parse, validation_error_to_api_error
from specserve.server.state import ServerState

# the fields of a chat request that decide how its messages are encoded (checked as there)
_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                "chat_template_kwargs", "add_special_tokens", "chat_template", "tools")  # fmt: skip


class TokenizeRequest(StrictModel):
    """Either `prompt` (a text; special tokens added unless add_special_tokens is false) or
    `messages` (with the chat route's template options; only add_special_tokens false)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Any = None
    tools: list[Any] | None = None  # (rendered by the template, as the chat route renders them)
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int] = Field(...)


async def tokenize(request: Request, state: ServerState) -> dict[str, Any]:
    req = parse(TokenizeRequest, await request.body())
    check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError("prompt: give either prompt (a text) or messages (a chat)", param="prompt")
    if state.tokenizer is None:
        raise APIError(
            "prompt: tokenizing needs a tokenizer, and this server runs without one",
            param="prompt",
        )
    if req.prompt is not None:
        special = req.add_special_tokens is not False
        ids = await state.encode(req.prompt, "prompt", special)
    else:
        given = {k: getattr(req, k) for k in _CHAT_FIELDS if getattr(req, k) is not None}
        if req.tools:  # (the template's input alone: no tool choice constrains anything here)
            given["tool_choice"] = "none"
        try:
            chat = ChatCompletionRequest.model_validate(given)
        except ValidationError as e:
            raise validation_error_to_api_error(e) from None
        ids = await state.encode_chat(chat.chat_messages(), chat.template_options())
    return {
        "count": len(ids),
        "max_model_len": state.context_len,
        "tokens": ids,
        # the vocabulary's own strings, as vLLM gives them (byte-level: 'Ġword', a piece of a
        # character as its byte symbols), not each id decoded alone
        "token_strs": state.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    }


async def detokenize(request: Request, state: ServerState) -> dict[str, Any]:
    req = parse(DetokenizeRequest, await request.body())
    check_model(state, req.model)
    if state.tokenizer is None:
        raise APIError(
            "tokens: detokenizing needs a tokenizer, and this server runs without one",
            param="tokens",
        )
    check_token_ids(state, req.tokens, "tokens")
    return {"prompt": await state.off_loop(state.tokenizer.decode, req.tokens)}
