"""The bridge between the HTTP handlers (asyncio) and the engine (its own loop thread).

`ServerState` owns the admission limit (`max_queued_requests`: requests submitted and not
finished), the metrics, and the mapping of engine argument errors onto request fields.
`Run` is one HTTP request's worth of engine requests (several for a batched /v1/completions):
the engine's callback posts each incremental output onto the run's asyncio queue through
`loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from specserve.errors import InvalidArgument
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import APIError

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    max_queued_requests: int | None = None  # None: no limit
    default_max_tokens: int | None = 128  # None: the rest of the context
    graceful_shutdown_timeout: float = 30.0

    def validate(self) -> None:
        if not (0 <= self.port <= 65535):
            raise InvalidArgument("port", f"must be in [0, 65535], got {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise InvalidArgument(
                "max_queued_requests", f"must be >= 1, got {self.max_queued_requests}"
            )
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise InvalidArgument(
                "default_max_tokens", f"must be >= 1, got {self.default_max_tokens}"
            )
        if self.graceful_shutdown_timeout < 0:
            raise InvalidArgument("graceful_shutdown_timeout", "must be >= 0")


def engine_error(e: InvalidArgument, rename: dict[str, str], prefix: str = "") -> APIError:
    """An engine InvalidArgument as a 400 naming the field as the client wrote it."""
    msg = str(e)
    if msg.startswith(e.field + ": "):
        msg = msg[len(e.field) + 2 :]
    param = rename.get(e.field, prefix + e.field)
    return APIError(f"{param}: {msg}", param=param)


class ServerState:
    def __init__(self, engine, cfg: ServerConfig):
        self.engine = engine
        self.cfg = cfg
        self.model_name = cfg.served_model_name or str(engine.config.model_path)
        self.context_len: int = engine.core.context_len
        self.tokenizer = engine.tokenizer
        self.shutting_down = False
        self._lock = threading.Lock()
        self.inflight = 0
        self.active_rids: set[str] = set()
        self.metrics = ServerMetrics(engine, self._server_state)

    def _server_state(self) -> dict[str, Any]:
        return {"inflight": self.inflight, "max_queued_requests": self.cfg.max_queued_requests}

    def accepts_model(self, name: str | None) -> bool:
        return not name or name in (self.model_name, str(self.engine.config.model_path))

    # ---- admission ----------------------------------------------------------------------------
    def reserve(self, n: int) -> None:
        if self.shutting_down:
            self.metrics.rejected.labels("503").inc()
            raise APIError(
                "the server is shutting down", status=503, type="service_unavailable_error"
            )
        limit = self.cfg.max_queued_requests
        with self._lock:
            if limit is not None and self.inflight + n > limit:
                busy = self.inflight
            else:
                self.inflight += n
                return
        self.metrics.rejected.labels("503").inc()
        raise APIError(
            f"the server is at capacity ({busy} requests in flight, max_queued_requests="
            f"{limit}); retry later",
            status=503,
            type="service_unavailable_error",
        )

    def release(self, n: int = 1) -> None:
        with self._lock:
            self.inflight -= n

    def _finished(self, rid: str, out: dict[str, Any]) -> None:
        with self._lock:
            self.active_rids.discard(rid)
        self.release(1)
        try:
            self.metrics.observe_finished(out)
        except Exception:  # metrics must never break the engine's loop
            log.exception("metrics update failed")

    # ---- tokenization -------------------------------------------------------------------------
    def encode(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(
                f"{param}: text needs a tokenizer, and this server runs without one "
                "(skip_tokenizer_init); send token ids",
                param=param,
            )
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            return self.engine.tokenize_chat(messages)
        except Exception as e:  # no tokenizer/template, or the template rejected the messages
            raise APIError(f"messages: {e}", param="messages") from None

    def check_context(
        self, ids: list[int], max_tokens: int | None, prompt_param: str, max_param: str
    ) -> int:
        """The max_new_tokens to use: as requested, or the default capped by the context."""
        n = len(ids)
        if n >= self.context_len:
            raise APIError(
                f"{prompt_param}: the prompt has {n} tokens but the model's context length is "
                f"{self.context_len} (the prompt must be shorter)",
                param=prompt_param,
            )
        room = self.context_len - n
        if max_tokens is None:
            default = self.cfg.default_max_tokens
            return room if default is None else min(default, room)
        if max_tokens > room:
            raise APIError(
                f"{max_param}: the context length is {self.context_len} tokens and the prompt "
                f"has {n}, so at most {room} can be generated; {max_tokens} were requested",
                param=max_param,
            )
        return max_tokens

    def abort_all(self) -> None:
        """Abort every request in flight (graceful-shutdown timeout)."""
        with self._lock:
            rids = list(self.active_rids)
        for rid in rids:
            self.engine.abort(rid)

    def abort_error(self, meta: dict[str, Any]) -> APIError:
        """The error for a request the engine aborted (shutdown or an internal failure)."""
        reason = meta.get("finish_reason") or {}
        message = str(reason.get("message") or "request aborted")
        if self.shutting_down or "shut down" in message:
            return APIError(
                "request aborted: the server is shutting down",
                status=503,
                type="service_unavailable_error",
            )
        return APIError(f"request aborted: {message}", status=500, type="server_error")

    # ---- runs ---------------------------------------------------------------------------------
    def start(
        self,
        prompts: list[list[int]],
        params: list[dict[str, Any]],
        rename: dict[str, str],
        prefix: str = "",
        rid: str | None = None,
    ) -> Run:
        """Admit and submit one engine request per prompt. Raises APIError (400/503)."""
        self.reserve(len(prompts))
        run = Run(self, asyncio.get_running_loop())
        submitted = 0
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params)):
                run.submit(i, ids, sp, rid if (rid and len(prompts) == 1) else None)
                submitted += 1
        except InvalidArgument as e:
            run.abort()
            self.release(len(prompts) - submitted)
            self.metrics.rejected.labels("400").inc()
            raise engine_error(e, rename, prefix) from None
        except BaseException:
            run.abort()
            self.release(len(prompts) - submitted)
            raise
        return run


class StopTextGuard:
    """Streams text so that no part of a stop string ever reaches the client.

    The engine trims a matched stop string from the request's text, but part of it may have
    been streamed in an earlier step already (a stop string spanning tokens), and the
    incremental outputs cannot take text back. So: hold back the last len(longest stop) - 1
    characters until more text arrives (a stop string cannot start before that), and on a
    stop-string finish cut the full decoded output at the match."""

    def __init__(self, tokenizer, stops: list[str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.hold = max(len(s) for s in stops) - 1
        self.text = ""  # as received from the engine
        self.ids: list[int] = []
        self.sent = 0

    def filter(self, out: dict[str, Any]) -> dict[str, Any]:
        self.text += out["text"]
        self.ids.extend(out["output_ids"])
        if not out.get("finished"):
            end = max(self.sent, len(self.text) - self.hold)
        else:
            final = self._final_text(out["meta_info"].get("finish_reason") or {})
            self.text, end = final, max(self.sent, len(final))
        chunk = self.text[self.sent : end]
        self.sent = end
        return {**out, "text": chunk}

    def _final_text(self, reason: dict[str, Any]) -> str:
        matched = reason.get("matched")
        if reason.get("type") != "stop" or not isinstance(matched, str):
            return self.text
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        cut = full.find(matched)
        return full[:cut] if cut >= 0 else self.text


class Run:
    def __init__(self, state: ServerState, loop: asyncio.AbstractEventLoop):
        self.state = state
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: list[str] = []
        self.unfinished: set[int] = set()
        self.guards: dict[int, StopTextGuard] = {}

    @property
    def id(self) -> str:
        return self.rids[0]

    def submit(self, index: int, ids: list[int], sp: dict[str, Any], rid: str | None) -> None:
        state, loop, queue = self.state, self.loop, self.queue
        rid = rid or uuid.uuid4().hex

        def on_output(out: dict[str, Any]) -> None:  # runs on the engine's thread
            try:
                if out.get("finished"):
                    state._finished(rid, out)
                loop.call_soon_threadsafe(queue.put_nowait, (index, out))
            except RuntimeError:  # the event loop is gone (server stopped)
                pass
            except Exception:
                log.exception("output delivery failed")

        with state._lock:
            if rid in state.active_rids:
                raise InvalidArgument("rid", f"request id {rid!r} is already in use")
            state.active_rids.add(rid)
        try:
            state.engine.submit(ids, sp, on_output, rid=rid)
        except BaseException:
            with state._lock:
                state.active_rids.discard(rid)
            raise
        self.rids.append(rid)
        self.unfinished.add(index)
        stops = sp.get("stop") if isinstance(sp, dict) else None
        if isinstance(stops, str):
            stops = [stops]
        if stops and state.tokenizer is not None:
            self.guards[index] = StopTextGuard(
                state.tokenizer, list(stops), bool(sp.get("skip_special_tokens", True))
            )

    def abort(self) -> None:
        """Abort what has not finished (client gone, error, shutdown); frees its KV."""
        for i in list(self.unfinished):
            self.state.engine.abort(self.rids[i])

    async def events(self) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Incremental outputs (index, delta) until every request of the run has finished."""
        while self.unfinished:
            index, out = await self.queue.get()
            guard = self.guards.get(index)
            if guard is not None:
                out = guard.filter(out)
            if out.get("finished"):
                self.unfinished.discard(index)
            yield index, out

    async def collect(self) -> list[dict[str, Any]]:
        """The final outputs (text and ids joined), in prompt order."""
        texts: list[list[str]] = [[] for _ in self.rids]
        ids: list[list[int]] = [[] for _ in self.rids]
        final: list[dict[str, Any] | None] = [None] * len(self.rids)
        async for i, out in self.events():
            texts[i].append(out["text"])
            ids[i].extend(out["output_ids"])
            if out.get("finished"):
                final[i] = {**out, "text": "".join(texts[i]), "output_ids": ids[i]}
        return final  # type: ignore[return-value]


async def watch_disconnect(request, on_disconnect) -> None:
    """Call on_disconnect() when the client goes away (ASGI http.disconnect)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # the connection is gone in some other way
        on_disconnect()
