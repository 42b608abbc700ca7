"""The HTTP server: FastAPI app over one `Engine`, run by uvicorn.

Endpoints: /v1/chat/completions, /v1/completions, /v1/models, /generate (SGLang's native
API), /health, /metrics. See docs/SERVER.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.server import openai_api
from specserve.server.metrics import CONTENT_TYPE
from specserve.server.protocol import (
    APIError,
    GenerateRequest,
    check_native_sampling_params,
    parse,
)
from specserve.server.state import ServerConfig, ServerState

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
        if owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status == 400:
            state.metrics.rejected.labels("400").inc()
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        err = APIError(f"{param}: {first.get('msg', 'invalid request')}", param=param)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)
        err.type = kind
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    # ---- OpenAI API -------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def v1_completions(request: Request):
        return await openai_api.completions(request, state)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request):
        return await openai_api.chat_completions(request, state)

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

    @app.get("/v1/models")
    async def v1_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def v1_model(model: str):
        if not state.accepts_model(model):
            raise APIError(
                f"model: the model {model!r} does not exist",
                status=404,
                param="model",
                code="model_not_found",
            )
        return model_card()

    # ---- SGLang native ----------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        return await _generate(request, state)

    @app.get("/get_model_info")
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
    @app.get("/health")
    async def health():
        if state.shutting_down:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _generate(request: Request, state: ServerState):
    req = parse(GenerateRequest, await request.body())
    if (req.text is None) == (req.input_ids is None):
        raise APIError("text: give exactly one of text or input_ids", param="text")
    if req.text is not None:
        single = isinstance(req.text, str)
        texts = [req.text] if single else req.text
        prompts = [state.encode(t, "text") for t in texts]
        prompt_param = "text"
    else:
        single = isinstance(req.input_ids[0], int)
        prompts = [list(req.input_ids)] if single else [list(p) for p in req.input_ids]
        prompt_param = "input_ids"
    if req.stream and not single:
        raise APIError("stream: streaming takes one prompt at a time", param="stream")
    for ids in prompts:
        if len(ids) >= state.context_len:
            raise APIError(
                f"{prompt_param}: the prompt has {len(ids)} tokens but the model's context "
                f"length is {state.context_len} (the prompt must be shorter)",
                param=prompt_param,
            )
    sp = dict(req.sampling_params or {})
    check_native_sampling_params(sp)
    run = state.start(
        prompts,
        [sp] * len(prompts),
        {"input_ids": prompt_param, "prompt": prompt_param, "sampling_params": "sampling_params"},
        prefix="sampling_params.",
        rid=req.rid,
    )
    if req.stream:
        return StreamingResponse(
            openai_api._streamed(request, run, _generate_chunks(run)),
            media_type="text/event-stream",
            headers=openai_api.SSE_HEADERS,
        )
    outs = await openai_api._collect_or_abort(request, run)
    for out in outs:
        reason = out["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise state.abort_error(out["meta_info"])
    return JSONResponse(outs[0] if single else outs)


async def _generate_chunks(run):
    """SGLang's streaming format: every event carries the text and ids so far."""
    text, ids = [], []
    async for _, out in run.events():
        text.append(out["text"])
        ids.extend(out["output_ids"])
        meta = out["meta_info"]
        if out["finished"] and (meta.get("finish_reason") or {}).get("type") == "abort":
            yield openai_api.sse(run.state.abort_error(meta).body())
            break
        yield openai_api.sse(
            {"text": "".join(text), "output_ids": list(ids), "meta_info": meta, "index": 0}
        )
    yield openai_api.SSE_DONE


def server_config_from_args(args) -> ServerConfig:
    default_max = getattr(args, "default_max_tokens", 128)
    return ServerConfig(
        host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", 30000),
        served_model_name=getattr(args, "served_model_name", None),
        max_queued_requests=getattr(args, "max_queued_requests", None),
        default_max_tokens=None if default_max in (None, 0, -1) else default_max,
        graceful_shutdown_timeout=getattr(args, "graceful_shutdown_timeout", 30.0),
    )


def _make_server(config, state: ServerState, grace: float):
    """A uvicorn server whose SIGINT/SIGTERM handling is: stop accepting, let in-flight
    requests finish for `grace` seconds, then abort the rest (their streams end with an
    error event and [DONE]), shut the engine down, and return normally (exit status 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        _abort_timer: threading.Timer | None = None

        def handle_exit(self, sig, frame) -> None:
            if self._abort_timer is None:
                print(
                    f"specserve: shutting down (signal {sig}); letting in-flight requests "
                    f"finish for up to {grace:g}s",
                    file=sys.stderr,
                    flush=True,
                )
                state.shutting_down = True
                self._abort_timer = threading.Timer(grace, state.abort_all)
                self._abort_timer.daemon = True
                self._abort_timer.start()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # Like uvicorn's, without re-raising the signal afterwards (which would kill the
            # process before the engine is shut down).
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)
                if self._abort_timer is not None:
                    self._abort_timer.cancel()

    return Server(config)


def run_server(engine_kwargs: dict, args) -> int:
    """`specserve serve`: load the engine, serve until SIGINT/SIGTERM, shut down cleanly."""
    import uvicorn

    from specserve.engine import Engine

    cfg = server_config_from_args(args)
    cfg.validate()  # before the (slow) engine load
    engine = Engine(**engine_kwargs)
    try:
        app = create_app(engine, cfg, owns_engine=True)
        state: ServerState = app.state.server
        log_level = str(engine.config.log_level).lower()
        config = uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level=log_level,
            access_log=log_level in ("debug", "info"),
            # Backstop only: aborted requests normally end within a step of the abort.
            timeout_graceful_shutdown=cfg.graceful_shutdown_timeout + 10,
        )
        server = _make_server(config, state, cfg.graceful_shutdown_timeout)
        print(
            f"specserve: model {state.model_name!r} loaded (context {state.context_len}; "
            f"{engine.config.draft_summary()}); starting the HTTP server on "
            f"http://{cfg.host}:{cfg.port}",
            file=sys.stderr,
            flush=True,
        )
        server.run()
        if not server.started:
            return 1
    finally:
        engine.shutdown()  # idempotent; the app's lifespan normally did it already
    print("specserve: server stopped", file=sys.stderr, flush=True)
    return 0
