"""``pymoecache serve``: llama-cpp-python's OpenAI-compatible server on ``pymoecache.Llama`` (the
app is built by pymoecache.server, imported only when the command runs).

    pymoecache serve model.gguf --prior 0.5 --cache-size 0.5 --port 8000
"""

from __future__ import annotations

import sys
from pathlib import Path

from .options import (UserError, add_hub_options, add_model_argument, add_routing_options, add_runtime_options,
                      cache_from_args, check_profile_args, resolve_model, routing_from_args)


def _check_port(host: str, port: int) -> None:
    """Fail before loading the model if the address cannot be listened on (in use, bad host)."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def cmd_serve(args) -> int:
    from ..model_info import model_info
    from ..server import create_app, server_module

    server_module()
    import uvicorn

    routing = routing_from_args(args)
    cache = cache_from_args(args)
    check_profile_args(args)
    if not 0 <= args.max_queue <= 100_000:
        raise UserError(f"--max-queue must be in [0, 100000], got {args.max_queue}")
    _check_port(args.host, args.port)
    model = resolve_model(args.model, args)
    if not model_info(model).is_moe:
        raise UserError(f"{model} has no MoE layers (a dense model): there are no experts to cache")
    app = create_app(model, cache=cache, routing=routing, routing_scope=args.scope, n_ctx=args.ctx,
                     n_threads=args.threads, n_threads_batch=args.threads, n_gpu_layers=args.n_gpu_layers,
                     profile=args.profile, pin_hot=args.pin_hot, max_queue=args.max_queue)
    url = f"http://{args.host}:{args.port}"
    choice = getattr(app.state, "cache_choice", None)
    print(f"pymoecache serve: {Path(model).name} [{routing.spec()}] at {url}/v1 (OpenAI API), "
          f"cache statistics at {url}/moecache/stats" + (f"; cache size {choice}" if choice else "")
          + (f"; usage profile {args.profile} (saved at shutdown)" if args.profile else ""),
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_command(subparsers) -> None:
    """Register ``serve`` on the ``pymoecache`` command line (called from cli.build_parser)."""
    s = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with the expert cache and its statistics",
        description="Serve a GGUF model over llama-cpp-python's OpenAI-compatible API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /docs) with the expert cache and routing below. "
                    "GET /moecache/stats returns the cache statistics as JSON, and every completion carries "
                    "a 'moecache' object with its own. Needs the server extras: fastapi, uvicorn, sse-starlette, "
                    "starlette-context and pydantic-settings.")
    add_model_argument(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s, this machine only; 0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=8000, metavar="N", help="TCP port (default %(default)s)")
    add_runtime_options(s, ctx_default=2048, seed=False)  # sampling and seed: per request, as in the OpenAI API
    s.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help="completion requests that wait while one generates; past that the server answers 503 "
                        "with Retry-After (default %(default)s)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level; info logs one line per request (default %(default)s)")
    add_hub_options(s)
    add_routing_options(s, profile=True)
    s.set_defaults(func=cmd_serve)
