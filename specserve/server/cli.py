"""`specserve serve`: placeholder registration until the HTTP server lands."""

from __future__ import annotations


def add_serve_parser(sub, add_engine_args, engine_kwargs) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    add_engine_args(p)

    def run(args):
        from specserve.server.app import run_server

        return run_server(engine_kwargs(args), args)

    p.set_defaults(func=run)
