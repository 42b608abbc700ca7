"""`specserve serve`'s process: bind the port, load the engine, serve, shut down on signals.

Shutdown: the first SIGINT/SIGTERM starts a drain. The listening socket stays open so that
new requests get a 503 (and /health answers 503) instead of a refused connection; requests
in flight get `--graceful-shutdown-timeout` seconds to finish, then are aborted (streams end
with an error event and [DONE]); then the server stops and the engine shuts down. A second
signal ends every open request at once the same way and exits.
"""

from __future__ import annotations

import asyncio
import socket
import sys

from specserve.errors import InvalidArgument
from specserve.server.server_config import ServerConfig
from specserve.server.state import ServerState

# After a forced exit is requested, how long open responses get to write their error event.
_FLUSH_SECONDS = 0.3
# After the drain aborts what is left, how long the engine gets to deliver those aborts.
_ABORT_SECONDS = 5.0


def server_config_from_args(args) -> ServerConfig:
    default_max = getattr(args, "default_max_tokens", 128)
    return ServerConfig(
        host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", 30000),
        served_model_name=getattr(args, "served_model_name", None),
        max_queued_requests=getattr(args, "max_queued_requests", None),
        max_samples_per_request=getattr(args, "max_samples_per_request", 2048),
        default_max_tokens=None if default_max in (None, 0, -1) else default_max,
        graceful_shutdown_timeout=getattr(args, "graceful_shutdown_timeout", 30.0),
        api_key=getattr(args, "api_key", None),
        max_request_bytes=getattr(args, "max_request_bytes", 8 * 1024 * 1024),
        request_body_timeout=getattr(args, "request_body_timeout", 30.0),
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a taken port fails before the model loads."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise InvalidArgument("host", f"cannot resolve {host!r}: {e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise InvalidArgument("port", f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(config, state: ServerState, grace: float):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, with the drain described in this module's docstring. handle_exit does
        not record the signal, so uvicorn does not re-raise it after serving (that would kill
        the process before the engine is shut down)."""

        signals = 0
        loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame) -> None:
            self.signals += 1
            if self.loop is None or not self.started:  # not serving yet: stop right away
                self.should_exit = True
                self.force_exit = self.signals > 1
                return
            if self.signals == 1:
                _say(
                    f"shutting down (signal {sig}); new requests get 503, in-flight requests "
                    f"have up to {grace:g}s to finish (send the signal again to exit now)"
                )
                self.loop.call_soon_threadsafe(self._start_drain)
            else:
                _say(f"signal {sig} again: ending open requests and exiting now")
                self.loop.call_soon_threadsafe(self._exit_now)

        def _start_drain(self) -> None:
            state.shutting_down = True
            self._drain = asyncio.ensure_future(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            while state.inflight > 0 and loop.time() < deadline:
                await asyncio.sleep(0.05)
            if state.inflight > 0:
                _say(f"aborting {state.inflight} request(s) still in flight")
                state.abort_all()
                deadline = loop.time() + _ABORT_SECONDS
                while state.inflight > 0 and loop.time() < deadline:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)  # let handlers write what they just received
            self.should_exit = True

        def _exit_now(self) -> None:
            state.end_all_now("the server is shutting down")
            assert self.loop is not None
            self.loop.call_later(_FLUSH_SECONDS, self._force)

        def _force(self) -> None:
            self.should_exit = self.force_exit = True

    return Server(config)


def _say(message: str) -> None:
    print(f"specserve: {message}", file=sys.stderr, flush=True)


def run_server(engine_kwargs: dict, args) -> int:
    """`specserve serve`: bind, load the engine, serve until SIGINT/SIGTERM, shut down."""
    import uvicorn

    from specserve.engine import Engine
    from specserve.server.app import create_app

    cfg = server_config_from_args(args)
    cfg.validate()  # before the (slow) engine load
    sock = bind_socket(cfg.host, cfg.port)
    try:
        engine = Engine(**engine_kwargs)
    except BaseException:
        sock.close()
        raise
    try:
        app = create_app(engine, cfg, owns_engine=True)
        state: ServerState = app.state.server
        log_level = str(engine.config.log_level).lower()
        config = uvicorn.Config(
            app,
            log_level=log_level,
            access_log=log_level in ("debug", "info"),
            # Only for responses still being written after the drain (they are all final).
            timeout_graceful_shutdown=10,
        )
        server = make_server(config, state, cfg.graceful_shutdown_timeout)
        port = sock.getsockname()[1]
        _say(
            f"model {state.model_name!r} loaded (context {state.context_len}; "
            f"{engine.config.draft_summary()}); starting the HTTP server on "
            f"http://{cfg.host}:{port}"
        )
        server.run(sockets=[sock])
        if not server.started:
            return 1
    finally:
        sock.close()
        engine.shutdown()  # idempotent; the app's lifespan normally did it already
    _say("server stopped")
    return 0
