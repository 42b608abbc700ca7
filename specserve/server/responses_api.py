"""/v1/responses: OpenAI's Responses API on the chat pipeline (the chat template, the chat
route's sampling and structured output), answered as one response object or as a stream of
typed events.

A response holds one output item, the assistant's message, with one `output_text` part. The
stream opens with `response.created` and `response.in_progress` at once (as OpenAI's), then
the item and its part; a `response.output_text.delta` follows each engine output that adds
text; the part, the item and the response are closed with their `.done` events and
`response.completed` (or `response.incomplete` when the length limit stopped it), which
carries the whole response. No `[DONE]` follows, as on OpenAI's route.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from specserve.server.openai_api import (
    SSE_HEADERS,
    answer_entries,
    check_model,
    client_field_names,
    collect_or_abort,
    finish_reason,
    json_answer,
    max_new_tokens_per_prompt,
    parse_body,
    raise_abort,
    sse,
    streamed,
    usage,
)
from specserve.server.protocol import APIError
from specserve.server.responses_protocol import ResponsesRequest
from specserve.server.run import Run
from specserve.server.state import ServerState

# /openapi.json: what a 200 may be
STREAMED_EVENTS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON, or with `stream: true` server-sent events (`event: <type>` and "
        "`data: {json}` lines; the last is `response.completed`, `response.incomplete` or "
        "`error`)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


async def responses(request: Request, state: ServerState):
    req = await parse_body(request, state, ResponsesRequest)
    check_model(state, req.model)
    req.check_stream_options()
    ids = await _encode(state, req)
    max_new = max_new_tokens_per_prompt(state, req, [ids], "input")
    params = [req.sampling_params(max_new[0])]
    rename = {**client_field_names(req, "input"), **req.structured_rename()}
    run = await state.start([ids], params, rename)
    answer = _Answer(req, state, run.id, int(time.time()))

    if req.stream:
        return StreamingResponse(
            streamed(request, run, _events(run, answer)),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    outs = await collect_or_abort(request, run)
    raise_abort(run, outs)  # (the chat route's error, as it gives it)
    body = answer.final(outs[0]["text"], outs[0]["meta_info"])
    return await json_answer(state, lambda: body, answer_entries(outs, 0))


async def _encode(state: ServerState, req: ResponsesRequest) -> list[int]:
    """The prompt's ids through the chat template; an error about the messages (their size,
    the template's refusal) names `input`, this body's field."""
    try:
        return await state.encode_chat(req.chat_messages())
    except APIError as e:
        if not (e.param or "").startswith("messages"):
            raise
        message = e.message
        if message.startswith(f"{e.param}: "):
            message = message[len(e.param) + 2 :]
        renamed = APIError(f"input: {message}", e.status, "input", e.type, e.code)
        renamed.rejected = e.rejected
        raise renamed from None


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(meta: dict[str, Any]) -> dict[str, Any]:
    """The chat route's usage under the Responses API's names."""
    u = usage([meta])
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"],
        # (cache writes are OpenAI's explicit, billed caching: none here; the prefix cache
        # keeps what it can on its own)
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


class _Answer:
    """One response's fixed parts, and the response object at each of its stages."""

    def __init__(self, req: ResponsesRequest, state: ServerState, run_id: str, created: int):
        self.id = f"resp_{run_id}"
        self.item_id = f"msg_{run_id}"
        self.created = created
        self.model = state.model_name
        self.echoed = req.echoed()

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: dict[str, Any] | None = None,
        completed_at: int | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "completed_at": completed_at,
            "status": status,
            "incomplete_details": incomplete,
            "error": None,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echoed,
        }

    def message(self, status: str, text: str | None) -> dict[str, Any]:
        """The output item (no content part yet while `text` is None)."""
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": [] if text is None else [_text_part(text)],
        }

    def final(self, text: str, meta: dict[str, Any]) -> dict[str, Any]:
        """The finished response: incomplete where the length limit stopped it (the
        request's max_output_tokens, or the room the context left)."""
        complete = finish_reason(meta) != "length"
        status = "completed" if complete else "incomplete"
        return self.response(
            status,
            [self.message(status, text)],
            _usage(meta),
            None if complete else {"reason": "max_output_tokens"},
            int(time.time()) if complete else None,
        )


async def _events(run: Run, answer: _Answer) -> AsyncIterator[str]:
    sequence = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": next(sequence), **fields}
        return f"event: {kind}\n" + sse(body)

    at = {"item_id": answer.item_id, "output_index": 0, "content_index": 0}
    opened = answer.response("in_progress", [])
    yield event("response.created", response=opened)
    yield event("response.in_progress", response=opened)
    yield event(
        "response.output_item.added", output_index=0, item=answer.message("in_progress", None)
    )
    yield event("response.content_part.added", **at, part=_text_part(""))
    texts: list[str] = []
    meta: dict[str, Any] = {}
    async for _, out in run.events():
        meta = out["meta_info"]
        if out["finished"] and finish_reason(meta) == "abort":
            # the chat route's error (its message, param and kind), as OpenAI's error event
            err = run.abort_error(meta)
            yield event("error", code=err.code or err.type, message=err.message, param=err.param)
            return
        if out["text"]:
            texts.append(out["text"])
            yield event("response.output_text.delta", **at, delta=out["text"], logprobs=[])
    text = "".join(texts)
    final = answer.final(text, meta)
    item = final["output"][0]
    yield event("response.output_text.done", **at, text=text, logprobs=[])
    yield event("response.content_part.done", **at, part=item["content"][0])
    yield event("response.output_item.done", output_index=0, item=item)
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield event(kind, response=final)
