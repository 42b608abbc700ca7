"""/v1/completions and /v1/chat/completions: request -> engine requests -> OpenAI responses."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from specserve.errors import InvalidArgument
from specserve.runtime.output import verify_tokens
from specserve.server.logprobs import CompletionLogprobs, chat_content
from specserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.protocol import APIError, parse
from specserve.server.run import Run, watch_disconnect
from specserve.server.state import (
    OFF_LOOP_PROMPT_TOKENS,
    ServerState,
    engine_error,
    prompt_param,
)
from specserve.server.structured_output import structured_output
from specserve.server.tool_calls import ToolCallStream, template_chars

# Bodies larger than this are parsed on the server's thread pool, not on the event loop.
PARSE_OFF_LOOP_BYTES = 64 * 1024
# Answers holding more entries than this (tokens, each log-prob alternative counted) are
# assembled and encoded on the server's thread pool: 64 chat choices of 200 tokens with 20
# alternatives each held the event loop, and every other client, for 2 s.
ANSWER_OFF_LOOP_ENTRIES = 20_000

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# JSON leaves these raw, but many clients split lines on them too (str.splitlines, JavaScript
# line terminators): escaped, every event is exactly one line.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(obj: Any) -> str:
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def finish_reason(meta: dict[str, Any]) -> str | None:
    kind = (meta.get("finish_reason") or {}).get("type")
    return {"stop": "stop", "length": "length"}.get(kind, kind)


def matched_stop(meta: dict[str, Any]) -> Any:
    return (meta.get("finish_reason") or {}).get("matched")


def stop_fields(meta: dict[str, Any], stop_token_ids: list[int] | None) -> dict[str, Any]:
    """What ended a choice, under both peers' names: SGLang's `matched_stop` (the stop string
    or token, EOS included) and vLLM's `stop_reason` (a stop string or a `stop_token_ids`
    entry; null for EOS and length)."""
    matched = matched_stop(meta)
    asked = isinstance(matched, str) or (matched is not None and matched in (stop_token_ids or ()))
    return {"matched_stop": matched, "stop_reason": matched if asked else None}


def usage(metas: list[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    """Completion tokens summed over the choices (in choice order: prompt i's samples are
    i * n ... i * n + n - 1); a prompt sampled n times counts once (as OpenAI), with the
    cached tokens its first sample found: the others reuse that sample's prefill."""
    firsts = metas[::n]
    prompt = sum(m.get("prompt_tokens", 0) for m in firsts)
    cached = sum(min(m.get("cached_tokens", 0), m.get("prompt_tokens", 0)) for m in firsts)
    completion = sum(m.get("completion_tokens", 0) for m in metas)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    if verify:  # speculative decoding: tokens per verify step
        out["spec_verify_ct"] = verify
        emitted = sum(verify_tokens(m.get("spec_accept_histogram", [])) for m in metas)
        out["spec_accept_length"] = emitted / verify  # tokens per verify step
    return out


def max_new_tokens_per_prompt(state: ServerState, req, prompts: list[list[int]], param: str):
    """Each prompt's max_new_tokens, the prompts cut first as truncate_prompt_tokens asks."""
    for i, ids in enumerate(prompts):
        where = prompt_param(param, i, len(prompts))
        prompts[i] = state.truncate_prompt(ids, req.truncate_prompt_tokens, where)
    requested, max_param = req.requested_max_tokens()
    least = req.least_tokens()
    return [
        state.check_context(ids, requested, prompt_param(param, i, len(prompts)), max_param, least)
        for i, ids in enumerate(prompts)
    ]


def client_field_names(req, prompt_param: str) -> dict[str, str]:
    """The engine's field names as this request wrote them (its errors name those)."""
    _, max_param = req.requested_max_tokens()
    return {
        "input_ids": prompt_param,
        "prompt": prompt_param,
        "max_new_tokens": max_param,
        # (vLLM's names or SGLang's, both taken)
        "min_new_tokens": "min_tokens" if req.min_tokens is not None else "min_new_tokens",
        "no_stop_trim": (
            "include_stop_str_in_output"
            if req.include_stop_str_in_output is not None
            else "no_stop_trim"
        ),
        **structured_output(req)[1],
    }


def answer_entries(outs: list[dict[str, Any]], alternatives: int) -> int:
    """The entries an answer holds: each token of the outputs (and of the prompts' log-probs),
    with its `alternatives` log-prob alternatives."""
    tokens = sum(
        len(o["output_ids"]) + len(o["meta_info"].get("input_token_logprobs") or ()) for o in outs
    )
    return tokens * (1 + alternatives)


async def json_answer(state: ServerState, build: Callable[[], Any], entries: int) -> Response:
    """The JSON of build(), made off the event loop when it holds more than
    ANSWER_OFF_LOOP_ENTRIES entries."""
    if entries > ANSWER_OFF_LOOP_ENTRIES:
        body = await state.off_loop(_json_bytes, build)
    else:
        body = _json_bytes(build)
    return Response(body, media_type="application/json")


def _json_bytes(build: Callable[[], Any]) -> bytes:
    return json_in_parts(build()).encode()


def json_in_parts(content: Any, depth: int = 2) -> str:
    """`content` as JSONResponse renders it (compact, UTF-8 kept, no NaN), each element of its
    top `depth` levels of lists and dicts encoded by a call of its own. One call of the C
    encoder holds the GIL throughout: 64 chat choices of 400 tokens with 20 alternatives
    each (32 MB) held it for 1.1 s, and the event loop's thread with it, off the loop or
    not; a choice at a time, for 17 ms at most. (A list of scalars, such as token ids, is
    encoded whole: a call per id would be 20x slower.)"""
    if depth > 0 and isinstance(content, list) and content and isinstance(content[0], dict | list):
        return "[" + ",".join(json_in_parts(item, depth - 1) for item in content) + "]"
    if depth > 0 and isinstance(content, dict) and all(isinstance(k, str) for k in content):
        fields = (f"{_json(k)}:{json_in_parts(v, depth - 1)}" for k, v in content.items())
        return "{" + ",".join(fields) + "}"
    return _json(content)


def _json(content: Any) -> str:
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


async def parse_body(request: Request, state: ServerState, model):
    body = await request.body()
    if len(body) > PARSE_OFF_LOOP_BYTES:
        return await state.off_loop(parse, model, body, chars=len(body))
    return parse(model, body)


async def collect_or_abort(request: Request, run: Run) -> list[dict[str, Any]]:
    """Wait for the run's final outputs; abort it if the client disconnects meanwhile."""
    watcher = asyncio.create_task(watch_disconnect(request, run.abort))
    try:
        return await run.collect()
    finally:
        watcher.cancel()
        run.abort()  # no-op unless cancelled (graceful-shutdown timeout) before finishing


def check_model(state: ServerState, model: str | None) -> None:
    if not state.accepts_model(model):
        raise APIError(
            f"model: the model {model!r} does not exist; this server serves {state.model_name!r}",
            status=404,
            param="model",
            code="model_not_found",
        )


def _check_common(state: ServerState, req) -> None:
    check_model(state, req.model)
    req.check_stream_options()


async def streamed(request: Request, run: Run, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Wrap an SSE generator: abort the run when the client disconnects or on any exit."""
    watcher = asyncio.create_task(watch_disconnect(request, run.abort))
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        watcher.cancel()
        run.abort()


def _n(req) -> int:
    return req.n or 1


# ---- /v1/completions --------------------------------------------------------------------------
async def completions(request: Request, state: ServerState):
    req = await parse_body(request, state, CompletionRequest)
    _check_common(state, req)
    given = req.prompts()
    state.size.check_batch(len(given), _n(req), "prompt", "n")
    prompts = [
        await state.encode(p, prompt_param("prompt", i, len(given)))
        if isinstance(p, str)
        else list(p)
        for i, p in enumerate(given)
    ]
    lengths = [len(p) for p in prompts]  # (before truncate_prompt_tokens cuts them)
    max_new = max_new_tokens_per_prompt(state, req, prompts, "prompt")
    params = [req.sampling_params(m) for m in max_new]
    # echo: each choice starts with its prompt's text (as given, or decoded from its ids; a
    # prompt truncate_prompt_tokens cut: the part kept). Decoded before the run starts: no
    # await may come between its start and the watch for the client's disconnect.
    shown = [g if len(p) == k else p for g, p, k in zip(given, prompts, lengths)]
    if req.echo:  # (decoded before the engine checks the ids, which the tokenizer may not hold)
        for i, p in enumerate(given):
            if not isinstance(p, str):
                check_token_ids(state, p, prompt_param("prompt", i, len(given)))
    echoes = await _echo_texts(state, shown) if req.echo else None
    run = await state.start(
        prompts, params, client_field_names(req, "prompt"), logprob_options=req.logprob_options()
    )
    created = int(time.time())
    cid = f"cmpl-{run.id}"
    with_ids = req.return_token_ids or state.tokenizer is None
    n = _n(req)

    if req.stream:
        chunks = _completion_chunks(run, req, state, cid, created, with_ids, echoes)
        return StreamingResponse(
            streamed(request, run, chunks), media_type="text/event-stream", headers=SSE_HEADERS
        )

    outs = await collect_or_abort(request, run)
    raise_abort(run, outs)
    strings = state.token_strings()

    def answer() -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            choice: dict[str, Any] = {
                "index": i,
                "text": (echoes[i // n] if echoes else "") + out["text"],
                "logprobs": None,
                "finish_reason": finish_reason(meta),
                **stop_fields(meta, req.stop_token_ids),
            }
            if req.logprobs is not None:
                choice["logprobs"] = CompletionLogprobs(strings).part(meta, req.echo)
            if with_ids:
                choice["token_ids"] = out["output_ids"]
            choices.append(choice)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": usage([o["meta_info"] for o in outs], n),
        }

    return await json_answer(state, answer, answer_entries(outs, req.logprobs or 0))


def check_token_ids(state: ServerState, ids: list[int], where: str) -> None:
    """Each of a prompt's token ids in the vocabulary (the engine's check, as a 400)."""
    try:
        state.engine.core.check_token_ids(ids, where)
    except InvalidArgument as e:
        raise engine_error(e, {}) from None


def raise_abort(run: Run, outs: list[dict[str, Any]]) -> None:
    """The error of the first choice the engine aborted, if any."""
    for out in outs:
        if finish_reason(out["meta_info"]) == "abort":
            raise run.abort_error(out["meta_info"])


async def _echo_texts(state: ServerState, shown: list[str | list[int]]) -> list[str]:
    """Each prompt's text, decoded off the event loop when the prompts are long."""

    def decode() -> list[str]:
        return [_echo_text(state, p) for p in shown]

    tokens = sum(len(p) for p in shown if not isinstance(p, str))
    return await state.off_loop(decode) if tokens > OFF_LOOP_PROMPT_TOKENS else decode()


def _echo_text(state: ServerState, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return state.tokenizer.decode(prompt) if state.tokenizer is not None else ""


def _chunk(
    cid: str,
    kind: str,
    created: int,
    state: ServerState,
    choice: dict[str, Any],
    ids: list[int] | None,
    include_usage: bool,
    running: dict[str, int] | None = None,
) -> str:
    """One SSE event of a streamed completion (usage: null until the final usage chunk, or
    `running`, the choice's usage so far, with continuous_usage_stats)."""
    if ids is not None:
        choice["token_ids"] = ids
    body: dict[str, Any] = {
        "id": cid,
        "object": kind,
        "created": created,
        "model": state.model_name,
        "choices": [choice],
    }
    if include_usage:
        body["usage"] = running
    return sse(body)


def running_usage(meta: dict[str, Any], completion: int | None = None) -> dict[str, int]:
    """One choice's usage so far (continuous_usage_stats, as vLLM): its prompt and the tokens
    it has generated (an incremental meta_info counts them all)."""
    prompt = meta.get("prompt_tokens", 0)
    done = meta.get("completion_tokens", 0) if completion is None else completion
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


async def _completion_chunks(
    run: Run,
    req: CompletionRequest,
    state: ServerState,
    cid: str,
    created: int,
    with_ids: bool,
    echoes: list[str] | None,
) -> AsyncIterator[str]:
    """Choices interleave, each chunk naming its index; with echo a choice's first chunk
    starts with its prompt (and the prompt's log-probs)."""
    include_usage = req.include_usage()
    metas: dict[int, dict[str, Any]] = {}
    n = _n(req)
    strings = state.token_strings()
    builders: dict[int, CompletionLogprobs] = {}
    started: set[int] = set()

    continuous = req.continuous_usage()

    def chunk(
        index: int, text: str, reason: str | None, ids=None, logprobs=None, meta=None, now=None
    ) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if meta is not None:  # the finishing chunk: what stopped the choice, as unstreamed
            choice.update(stop_fields(meta, req.stop_token_ids))
        running = running_usage(now) if continuous else None
        return _chunk(cid, "text_completion", created, state, choice, ids, include_usage, running)

    async for index, out in run.events():
        text, ids, meta = out["text"], out["output_ids"], out["meta_info"]
        first = index not in started
        started.add(index)
        if first and echoes:
            text = echoes[index // n] + text
        logprobs = None
        if req.logprobs is not None and finish_reason(meta) != "abort":
            builder = builders.setdefault(index, CompletionLogprobs(strings))
            logprobs = builder.part(meta, req.echo and first)
        # A step's tokens get their chunk even while their text is held back (an incomplete
        # UTF-8 character, a possible stop string): clients time TTFT and ITL by chunks.
        if text or ids or (logprobs and logprobs["tokens"]):
            yield chunk(index, text, None, ids if with_ids else None, logprobs, now=meta)
        if out["finished"]:
            metas[index] = meta
            if finish_reason(meta) == "abort":
                yield sse(run.abort_error(meta).body())
                yield SSE_DONE
                return
            yield chunk(
                index, "", finish_reason(meta), [] if with_ids else None, meta=meta, now=meta
            )
    if include_usage:
        yield sse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": state.model_name,
                "choices": [],
                "usage": usage([metas[i] for i in sorted(metas)], n),
            }
        )
    yield SSE_DONE


# ---- /v1/chat/completions ---------------------------------------------------------------------
async def chat_completions(request: Request, state: ServerState):
    req = await parse_body(request, state, ChatCompletionRequest)
    _check_common(state, req)
    req.check_logprobs()
    state.size.check_batch(1, _n(req), "messages", "n")
    tools = req.tool_plan()
    history = [m.tool_calls for m in req.messages if m.tool_calls]
    if state.tokenizer is not None and (req.tools or history):
        # (what the template renders beside the messages' content, which is checked there)
        field = "tools" if req.tools else "messages"
        state.size.check_text(template_chars(req.tools, history), field)
    ids = await state.encode_chat(req.chat_messages(), req.template_options())
    max_new = max_new_tokens_per_prompt(state, req, [ids], "messages")
    params = [req.sampling_params(max_new[0])]
    names = client_field_names(req, "messages")
    if tools is not None:
        names["json_schema"] = tools.source
    run = await state.start([ids], params, names, logprob_options=req.logprob_options())
    created = int(time.time())
    cid = f"chatcmpl-{run.id}"
    with_ids = req.return_token_ids

    if req.stream:
        return StreamingResponse(
            streamed(request, run, _chat_chunks(run, req, state, cid, created, with_ids)),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    outs = await collect_or_abort(request, run)
    raise_abort(run, outs)
    strings = state.token_strings()

    def answer() -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            message = {"role": "assistant", "content": out["text"]}
            reason = finish_reason(meta)
            if tools is not None:
                message, reason = tools.message(out["text"]), tools.finish_reason(reason)
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                "logprobs": None,
                "finish_reason": reason,
                **stop_fields(meta, req.stop_token_ids),
            }
            if req.logprobs:
                choice["logprobs"] = {"content": chat_content(meta, strings), "refusal": None}
            if with_ids:
                choice["token_ids"] = out["output_ids"]
            choices.append(choice)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": usage([o["meta_info"] for o in outs], _n(req)),
        }

    alternatives = (req.top_logprobs or 0) if req.logprobs else 0
    return await json_answer(state, answer, answer_entries(outs, alternatives))


async def _chat_chunks(
    run: Run,
    req: ChatCompletionRequest,
    state: ServerState,
    cid: str,
    created: int,
    with_ids: bool,
) -> AsyncIterator[str]:
    """Each choice opens with a role chunk, sent with its first output; choices interleave,
    each chunk naming its index. Tool calls: the text's deltas as `tool_calls` deltas (a step
    may give several chunks, its tokens and log-probs on the last)."""
    include_usage = req.include_usage()
    tools = req.tool_plan()
    calls: dict[int, ToolCallStream] = {}
    strings = state.token_strings()

    continuous = req.continuous_usage()

    def chunk(
        index: int,
        delta: dict[str, Any],
        reason: str | None,
        ids=None,
        logprobs=None,
        meta=None,
        now=None,
        done=None,
    ) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        if meta is not None:  # the finishing chunk: what stopped the choice, as unstreamed
            choice.update(stop_fields(meta, req.stop_token_ids))
        running = running_usage(now, done) if continuous else None
        kind = "chat.completion.chunk"
        return _chunk(cid, kind, created, state, choice, ids, include_usage, running)

    metas: dict[int, dict[str, Any]] = {}
    opened: set[int] = set()
    async for index, out in run.events():
        text, ids, meta = out["text"], out["output_ids"], out["meta_info"]
        if index not in opened and finish_reason(meta) != "abort":
            # With the choice's first output, as vLLM: a client timing the first chunk
            # measures the time to the first token, not to the response headers.
            opened.add(index)
            opening = {"role": "assistant", "content": ""}
            if tools is not None:
                opening = calls.setdefault(index, tools.stream()).opening()
            yield chunk(index, opening, None, now=meta, done=0)
        logprobs = None
        if req.logprobs and finish_reason(meta) != "abort":
            content = chat_content(meta, strings)
            logprobs = {"content": content, "refusal": None} if content else None
        if text or ids or logprobs:  # as completions: a chunk for every step's tokens
            tokens = ids if with_ids else None
            deltas = [{"content": text}]
            if tools is not None:  # (an aborted choice's first output opens no calls)
                stream = calls.get(index) or calls.setdefault(index, tools.stream())
                deltas = stream.deltas(text) or [{}]
            for delta in deltas[:-1]:
                yield chunk(index, delta, None, now=meta)
            yield chunk(index, deltas[-1], None, tokens, logprobs, now=meta)
        if out["finished"]:
            metas[index] = meta
            if finish_reason(meta) == "abort":
                yield sse(run.abort_error(meta).body())
                yield SSE_DONE
                return
            reason = finish_reason(meta)
            reason = reason if tools is None else tools.finish_reason(reason)
            yield chunk(index, {}, reason, meta=meta, now=meta)
    if include_usage:
        yield sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": [],
                "usage": usage([metas[i] for i in sorted(metas)], _n(req)),
            }
        )
    yield SSE_DONE
