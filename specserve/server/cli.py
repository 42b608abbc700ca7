"""`specserve serve [engine flags] [server flags]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import math


def _finite_seconds(value: str) -> float:
    """Seconds as a finite float: NaN passed the server's range checks (every comparison with
    it is false) and an endless wait is no timeout."""
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {value!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {value!r}")
    return v


def add_serve_parser(sub, add_engine_args, engine_kwargs) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve the engine over HTTP: /v1/chat/completions, /v1/completions, "
        "/v1/models, /generate, /health, /metrics (see docs/SERVER.md).",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=30000, help="port to bind (default: 30000)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model name in /v1/models and responses (default: the model path)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="most requests submitted and not finished; more get HTTP 503 (default: no limit)",
    )
    g.add_argument(
        "--max-samples-per-request",
        type=int,
        default=2048,
        help="most prompts x n in one request; more get HTTP 400 (admitting and answering a "
        "request runs on the event loop that every client shares; default: 2048)",
    )
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=128,
        help="max_tokens of OpenAI requests that do not set it, capped by the remaining "
        "context; 0 or -1 means the whole remaining context (default: 128)",
    )
    g.add_argument(
        "--graceful-shutdown-timeout",
        type=_finite_seconds,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds to let in-flight requests finish before aborting "
        "them; a second signal exits at once (default: 30)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on every route but /health (default: none)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="largest request body accepted; larger ones get HTTP 413 (default: 8 MiB)",
    )
    g.add_argument(
        "--request-body-timeout",
        type=_finite_seconds,
        default=30.0,
        help="seconds a client has to send a whole request body; slower ones get HTTP 408 "
        "(default: 30)",
    )
    add_engine_args(p)

    def run(args):
        from specserve.server.serve import run_server

        return run_server(engine_kwargs(args), args)

    p.set_defaults(func=run)
