"""The HTTP server: FastAPI app over one `Engine`, run by uvicorn.

Endpoints: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /generate
(SGLang's native API), /health, /metrics. See docs/SERVER.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.runtime.logprobs import add_logprobs
from specserve.server import openai_api, responses_api, tokenize_api
from specserve.server import schemas as s
from specserve.server.guard import RequestGuard
from specserve.server.metrics import CONTENT_TYPE
from specserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.protocol import APIError, GenerateRequest
from specserve.server.responses_protocol import ResponseObject, ResponsesRequest
from specserve.server.server_config import ServerConfig
from specserve.server.state import ServerState, prompt_param
from specserve.server.tokenize_api import DetokenizeRequest, TokenizeRequest

log = logging.getLogger(__name__)


def create_app(engine, cfg: ServerConfig | None = None, owns_engine: bool = True) -> FastAPI:
    """The app serving `engine`. owns_engine: shut the engine down with the app."""
    cfg = cfg or ServerConfig()
    cfg.validate()
    state = ServerState(engine, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn calls this after its graceful shutdown (in-flight requests finished, or
        # cancelled and aborted once graceful_shutdown_timeout passed).
        state.shutting_down = True
        state.pool.shutdown(wait=False, cancel_futures=True)
        state.large_pool.shutdown(wait=False, cancel_futures=True)
        state.grammar_pool.shutdown(wait=False, cancel_futures=True)
        if owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="specserve", lifespan=lifespan, responses=s.ERROR_RESPONSES)
    app.state.server = state
    app.add_middleware(
        RequestGuard,
        max_request_bytes=cfg.max_request_bytes,
        request_body_timeout=cfg.request_body_timeout,
        api_key=cfg.api_key,
        on_reject=state.count_rejected,
    )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.rejected:
            state.count_rejected(exc.status)
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        err = APIError(f"internal error: {type(exc).__name__}", 500, type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        err = APIError(f"{param}: {first.get('msg', 'invalid request')}", param=param)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # (an unknown route or a method a route does not take: refused like any other request)
        state.count_rejected(exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)
        err.type = kind
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    # ---- OpenAI API -------------------------------------------------------------------------
    # Handlers parse their bodies themselves (strict, off the event loop when large, errors
    # naming the field); `body=` only publishes the request model in /openapi.json.
    @app.post(
        "/v1/completions",
        response_model=s.Completion,
        openapi_extra=s.body(CompletionRequest),
        responses=s.STREAMED,
    )
    async def v1_completions(request: Request):
        return await openai_api.completions(request, state)

    @app.post(
        "/v1/chat/completions",
        response_model=s.ChatCompletion,
        openapi_extra=s.body(ChatCompletionRequest),
        responses=s.STREAMED,
    )
    async def v1_chat_completions(request: Request):
        return await openai_api.chat_completions(request, state)

    @app.post(
        "/v1/responses",
        response_model=ResponseObject,
        openapi_extra=s.body(ResponsesRequest),
        responses=responses_api.STREAMED_EVENTS,
    )
    async def v1_responses(request: Request):
        return await responses_api.responses(request, state)

    def model_card() -> dict[str, Any]:
        return {
            "id": state.model_name,
            "object": "model",
            "created": started,
            "owned_by": "specserve",
            "root": str(engine.config.model_path),
            "max_model_len": state.context_len,
        }

    started = int(time.time())

    @app.get("/v1/models", response_model=s.ModelList)
    async def v1_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", response_model=s.ModelCard)
    async def v1_model(model: str, request: Request):
        if not model:  # ("/v1/models/": the list, redirected as other trailing slashes are)
            return RedirectResponse(str(request.url_for("v1_models")), status_code=307)
        if not state.accepts_model(model):
            raise APIError(
                f"model: the model {model!r} does not exist",
                status=404,
                param="model",
                code="model_not_found",
            )
        return model_card()

    # ---- vLLM's token counting ---------------------------------------------------------------
    @app.post("/tokenize", response_model=s.TokenizeResponse, openapi_extra=s.body(TokenizeRequest))
    async def tokenize(request: Request):
        return await tokenize_api.tokenize(request, state)

    @app.post(
        "/detokenize",
        response_model=s.DetokenizeResponse,
        openapi_extra=s.body(DetokenizeRequest),
    )
    async def detokenize(request: Request):
        return await tokenize_api.detokenize(request, state)

    # ---- SGLang native ----------------------------------------------------------------------
    @app.post(
        "/generate",
        response_model=s.GenerateOutput | list[s.GenerateOutput],
        openapi_extra=s.body(GenerateRequest),
        responses=s.STREAMED,
    )
    async def generate(request: Request):
        return await _generate(request, state)

    @app.get("/get_model_info", response_model=s.ModelInfo)
    async def get_model_info():
        return {
            "model_path": str(engine.config.model_path),
            "served_model_name": state.model_name,
            "is_generation": True,
            "context_length": state.context_len,
            "vocab_size": engine.core.model_config.vocab_size,
            "has_tokenizer": state.tokenizer is not None,
        }

    # ---- operations -------------------------------------------------------------------------
    # (HEAD too, as load balancers probe; a route per method, so each has its own OpenAPI id)
    @app.head("/health", operation_id="health_head", include_in_schema=False)
    @app.get(
        "/health",
        response_model=s.Health,
        responses={503: {"model": s.Health, "description": "shutting down or failed"}},
    )
    async def health():
        reason = state.unhealthy()
        if reason:
            status = "shutting down" if state.shutting_down else "failed"
            body = {"status": status, "reason": reason}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        # (the whole model, so that HEAD, which has no response model, says the length GET's
        # body has)
        return {"status": "ok", "reason": None}

    # (GET as SGLang also takes it; a route per method, so each has its own OpenAPI id)
    @app.get("/flush_cache", operation_id="flush_cache_get")
    @app.post("/flush_cache", operation_id="flush_cache")
    async def flush_cache():
        """Empty the prefix cache of every page no running request uses (SGLang's route)."""
        pages = await asyncio.to_thread(engine.flush_cache)
        return {"status": "ok", "flushed_pages": pages}

    @app.get("/metrics", response_class=Response, responses=s.METRICS)
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    s.install_openapi(
        app,
        [CompletionRequest, ChatCompletionRequest, ResponsesRequest, GenerateRequest,
         TokenizeRequest, DetokenizeRequest],
    )  # fmt: skip
    return app


def _rids_per_prompt(rid: str | list[str] | None, count: int, single: bool) -> list[str] | None:
    """The client's id of each prompt: a string for one prompt, a list of one per prompt for
    a batch (SGLang's rule); a mismatch is an error, never an id silently dropped."""
    if rid is None:
        return None
    if isinstance(rid, str):
        if not single:
            raise APIError(
                f"rid: a batch of {count} prompts takes a list of {count} ids, got one string",
                param="rid",
            )
        return [rid]
    if single:
        raise APIError(
            f"rid: one prompt takes its id as a string, got a list of {len(rid)}", param="rid"
        )
    if len(rid) != count:
        raise APIError(
            f"rid: has {len(rid)} ids for {count} prompt(s) (a string for one prompt, a list "
            "of one id per prompt for a batch)",
            param="rid",
        )
    if len(set(rid)) != len(rid):
        raise APIError("rid: the ids of a batch must be distinct", param="rid")
    return list(rid)


def _params_per_prompt(sampling_params, count: int):
    """Each prompt's sampling parameters (one object for all, or a list of one per prompt, as
    SGLang and `Engine.generate` take them), and where prompt i's are in the body (errors)."""
    if not isinstance(sampling_params, list):
        one = sampling_params.engine_params() if sampling_params else {}
        return [one] * count, lambda i: "sampling_params."
    if len(sampling_params) != count:
        raise APIError(
            f"sampling_params: has {len(sampling_params)} entries for {count} prompt(s); give "
            "one object for every prompt, or a list of one per prompt",
            param="sampling_params",
        )
    return [p.engine_params() for p in sampling_params], lambda i: f"sampling_params[{i}]."


async def _generate(request: Request, state: ServerState):
    req = await openai_api.parse_body(request, state, GenerateRequest)
    if (req.text is None) == (req.input_ids is None):
        raise APIError("text: give exactly one of text or input_ids", param="text")
    if req.text is not None:
        single, prompt_field = isinstance(req.text, str), "text"
        given = [req.text] if single else req.text
    else:
        single, prompt_field = isinstance(req.input_ids[0], int), "input_ids"
        given = [req.input_ids] if single else req.input_ids
    params, where_sp = _params_per_prompt(req.sampling_params, len(given))
    ns = [p.get("n", 1) for p in params]
    most = ns.index(max(ns))  # (the entry an error names)
    state.size.check_batch(len(given), ns[most], prompt_field, where_sp(most) + "n", sum(ns))
    if req.text is not None:
        prompts = [
            await state.encode(t, prompt_param("text", i, len(given))) for i, t in enumerate(given)
        ]
    else:
        prompts = [list(p) for p in given]
    if req.stream and not single:
        raise APIError("stream: streaming takes one prompt at a time", param="stream")
    # the prompt, and a max_new_tokens given, must fit the context and the KV cache, as on
    # the OpenAI routes (the default of 128 stops at the context instead, as in SGLang)
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        where = prompt_param(prompt_field, i, len(prompts))
        prompts[i] = ids = state.truncate_prompt(
            ids, sp.get("truncate_prompt_tokens"), where, prefix=where_sp(i)
        )
        state.check_context(ids, sp.get("max_new_tokens"), where, where_sp(i) + "max_new_tokens")
    logprob_options = req.logprob_options()
    rids = _rids_per_prompt(req.rid, len(prompts), single)
    rename = {
        "input_ids": prompt_field,
        "prompt": prompt_field,
        "sampling_params": "sampling_params",
    }
    rename.update({name: name for name in logprob_options})
    run = await state.start(
        prompts,
        params,
        rename,
        prefix="sampling_params.",
        rids=rids,
        logprob_options=logprob_options,
        prefixes=[where_sp(i) for i in range(len(prompts))],
    )
    if req.stream:
        return StreamingResponse(
            openai_api.streamed(request, run, _generate_chunks(run)),
            media_type="text/event-stream",
            headers=openai_api.SSE_HEADERS,
        )
    outs = await openai_api.collect_or_abort(request, run)
    openai_api.raise_abort(run, outs)
    # one prompt sampled n > 1 times answers a list of n outputs, as SGLang
    answer = outs[0] if single and len(outs) == 1 else outs
    entries = openai_api.answer_entries(outs, req.most_alternatives())
    return await openai_api.json_answer(state, lambda: answer, entries)


async def _generate_chunks(run):
    """SGLang's streaming format: every event carries its sample's `index` and the text, ids
    and log-probs so far."""
    text: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    logprobs: dict[int, dict[str, list]] = {}
    async for index, out in run.events():
        text.setdefault(index, []).append(out["text"])
        ids.setdefault(index, []).extend(out["output_ids"])
        meta = out["meta_info"]
        add_logprobs(logprobs.setdefault(index, {}), meta)
        if out["finished"] and (meta.get("finish_reason") or {}).get("type") == "abort":
            yield openai_api.sse(run.abort_error(meta).body())
            break
        meta = {**meta, **{k: list(v) for k, v in logprobs[index].items()}}
        yield openai_api.sse(
            {
                "text": "".join(text[index]),
                "output_ids": list(ids[index]),
                "meta_info": meta,
                "index": index,
            }
        )
    yield openai_api.SSE_DONE
