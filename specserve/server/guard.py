"""ASGI middleware that checks what every request carries before any handler runs: the API
key, the content type of POST bodies, the body's size and how long it takes to arrive.

The body is read here, counted as it arrives, and handed to the app whole: a body over the
limit gets 413 as soon as its Content-Length (or the bytes received so far) says so, and one
that does not arrive within `request_body_timeout` gets 408 (uvicorn's keep-alive timeout
restarts on every byte, so a client sending a byte now and then would otherwise hold the
request open forever). Errors have the API's JSON shape.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from specserve.server.protocol import APIError

_BODY_METHODS = ("POST", "PUT", "PATCH")
UNAUTHENTICATED_PATHS = ("/health",)


class _TooLarge(Exception):
    pass


class _Gone(Exception):
    pass


class RequestGuard:
    def __init__(
        self,
        app,
        max_request_bytes: int,
        request_body_timeout: float,
        api_key: str | None = None,
        on_reject: Callable[[int], None] | None = None,
    ):
        self.app = app
        self.max_bytes = max_request_bytes
        self.timeout = request_body_timeout
        self.api_key = api_key
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        err = self._check_headers(scope, headers)
        if err is not None:
            # after a 413 the rest of the body is not read: close rather than drain it
            await self._reply(scope, receive, send, err, close=err.status == 413)
            return
        if scope["method"] in _BODY_METHODS:
            try:
                body = await asyncio.wait_for(self._read(receive), self.timeout)
            except asyncio.TimeoutError:
                err = APIError(
                    f"the request body did not arrive within {self.timeout:g} seconds",
                    status=408,
                    code="request_timeout",
                )
                await self._reply(scope, receive, send, err, close=True)
                return
            except _TooLarge:
                await self._reply(scope, receive, send, self._too_large(), close=True)
                return
            except _Gone:
                return  # the client left before sending its body; nobody to answer
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _check_headers(self, scope, headers: Headers) -> APIError | None:
        if self.api_key is not None and scope["path"] not in UNAUTHENTICATED_PATHS:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            )
            if not ok:
                return APIError(
                    "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                    status=401,
                    type="authentication_error",
                    code="invalid_api_key",
                )
        if scope["method"] not in _BODY_METHODS:
            return None
        ctype = headers.get("content-type")
        no_body = headers.get("content-length", "0").strip() == "0"
        if ctype is None and no_body and "transfer-encoding" not in headers:
            return None  # nothing to parse (e.g. POST /flush_cache)
        media, _, params = (ctype or "").partition(";")
        charset = _param(params, "charset")
        if media.strip().lower() != "application/json" or charset not in (None, "utf-8", "utf8"):
            got = f"got {ctype!r}" if ctype else "none was given"
            return APIError(
                f"the request body must be JSON with 'Content-Type: application/json'; {got}",
                status=415,
                code="unsupported_media_type",
            )
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                return APIError(f"invalid Content-Length header {length!r}")
            if int(length) > self.max_bytes:
                return self._too_large(int(length))
        return None

    def _too_large(self, length: int | None = None) -> APIError:
        size = f"{length} bytes" if length is not None else "more bytes than that"
        return APIError(
            f"the request body is too large: at most {self.max_bytes} bytes are accepted "
            f"(--max-request-bytes), got {size}",
            status=413,
            code="request_too_large",
        )

    async def _read(self, receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Gone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _reply(self, scope, receive, send, err: APIError, close: bool = False) -> None:
        if self.on_reject is not None:
            self.on_reject(err.status)
        headers = {"Connection": "close"} if close else {}
        if err.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        await JSONResponse(err.body(), status_code=err.status, headers=headers)(
            scope, receive, send
        )


def _param(params: str, name: str) -> str | None:
    for part in params.split(";"):
        key, _, value = part.partition("=")
        if key.strip().lower() == name:
            return value.strip().strip('"').lower()
    return None


def _replay(body: bytes, receive):
    """A receive() that yields the body once, then whatever the connection says next (the
    handlers watch it for http.disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
