"""``pymoecache serve``: llama-cpp-python's OpenAI-compatible server on ``pymoecache.Llama`` (the
app is built by pymoecache.server, imported only when the command runs); ``pymoecache rpc-server``:
this machine's CPU as a ggml RPC device (pymoecache.rpc).

    pymoecache serve model.gguf --prior 0.5 --cache-size 0.5 --port 8080
    pymoecache rpc-server --port 50052
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .loading import companion_tip, miss_asked
from .options import (UserError, add_hub_options, add_model_argument, add_prompt_cache_options, add_routing_options,
                      add_runtime_options, add_template_options, cache_from_args, check_profile_args,
                      prompt_cache_from_args, resolve_model, routing_from_args, runtime_kwargs)


def _check_port(host: str, port: int) -> None:
    """Fail before loading the model if the address cannot be listened on (in use, bad host)."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _check_llama_server_flags(args) -> None:
    """llama-server's flags that mean nothing here are refused with the reason (exit 2); --slots and --metrics
    are accepted: /slots and /metrics are always on here."""
    if args.embeddings:
        raise UserError("--embeddings: this server runs generation models and computes no embeddings (/v1/embeddings "
                        "answers 501, as llama-server without --embeddings)")
    if args.n_predict is not None:
        raise UserError("-n/--n-predict: each request says how many tokens it wants (max_tokens, or n_predict on "
                        "/completion); serve has no server-wide number")


def _slot_note(n_ctx: int, args) -> str:
    """How the slots share the context, on the line serve prints at start."""
    if args.parallel < 2:
        return ""
    return " shared by the slots (-kvu)" if args.kv_unified else f" ({n_ctx // args.parallel} per slot; -kvu shares it)"


def cmd_serve(args) -> int:
    from ..model_info import model_info
    from ..plan import memory_context
    from ..server import create_app, server_module

    _check_llama_server_flags(args)
    server_module()
    import uvicorn

    routing = routing_from_args(args)
    cache = cache_from_args(args)
    check_profile_args(args)
    if not 0 <= args.max_queue <= 100_000:
        raise UserError(f"--max-queue must be in [0, 100000], got {args.max_queue}")
    _check_port(args.host, args.port)
    if not 1 <= args.parallel <= 256:
        raise UserError(f"-np/--parallel must be in [1, 256], got {args.parallel}")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty")
    model = resolve_model(args.model, args)
    info = model_info(model)
    if not info.is_moe:
        raise UserError(f"{model} has no MoE layers (a dense model): there are no experts to cache")
    kw = runtime_kwargs(args)
    prompts = prompt_cache_from_args(args)
    ctx_note = ""
    if args.ctx == 0:  # llama-server's -c 0: the model's training context, capped by the memory
        kw["n_ctx"], ctx_note = memory_context(info)
    app = create_app(model, cache=cache, routing=routing, routing_scope=args.scope, profile=args.profile,
                     pin_hot=args.pin_hot, max_queue=args.max_queue, alias=args.alias, api_key=args.api_key,
                     n_parallel=args.parallel, kv_unified=args.kv_unified, chat_template=args.chat_template,
                     chat_template_file=args.chat_template_file, slot_save_path=args.slot_save_path, prompt_cache=prompts,
                     batch_order=args.batch_order, **kw)
    url = f"http://{args.host}:{args.port}"
    if kw.get("n_ctx") and app.state.n_ctx != kw["n_ctx"]:
        ctx_note += f" (-c {kw['n_ctx']}, rounded up by llama.cpp)"
    choice = getattr(app.state, "cache_choice", None)
    plan = app.state.memory_plan
    if plan is not None:
        print(plan.summary(), file=sys.stderr, flush=True)
        tip = companion_tip(plan, str(model), miss_asked(args), sized_by_memory=choice is not None)
        if tip:
            print(tip, file=sys.stderr, flush=True)
    print(f"pymoecache serve: {args.alias or Path(model).name} [{routing.spec()}] at {url}/v1 (OpenAI API), "
          f"context {app.state.n_ctx}{ctx_note}{_slot_note(app.state.n_ctx, args)}, {args.parallel} slot(s) + "
          f"{args.max_queue} queued; /health, /props, "
          f"/slots, /metrics, /moecache/stats" + (f"; cache size {choice}" if choice else "")
          + ("; API key required" if args.api_key else "")
          + (f"; usage profile {args.profile} (saved at shutdown)" if args.profile else "")
          + f"; chat template: {app.state.chat_template}",
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
    s.add_argument("--port", type=int, default=8080, metavar="N", help="TCP port (default %(default)s, as llama-server)")
    add_runtime_options(s, ctx_default=0, seed=False)  # sampling and seed: per request, as in the OpenAI API
    s.add_argument("-a", "--alias", default=None, metavar="NAME",
                   help="the model's id in /v1/models and in answers (default: the file's name)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health; others get 401 "
                        "(default: none, open)")
    s.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                   help="slots, as llama-server: requests decoded together (continuous batching: a request joins "
                        "the running batch at the next step, each expert a step needs is read once, and the routing "
                        "prefers what the other slots read); a request with logprobs, a grammar, logit_bias or a "
                        "routing of its own runs alone between batches. The cache keeps (N - 1) x K more slots per "
                        "layer for a batch; /slots shows them (default %(default)s)")
    s.add_argument("--batch-order", choices=["auto", "together", "one-ahead"], default="auto",
                   help="which of the -np N running slots a decode step takes: together (each expert a step needs "
                        "read once), one-ahead (one slot at a time, in turns of 32 tokens, the others waiting: where "
                        "the cache cannot hold what they all select, e.g. top-k + LRU under a memory cap, together "
                        "reads more a token and is slower), or auto: whichever measured more tokens a second, "
                        "measured again as the load changes (default %(default)s)")
    s.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true",
                   help="every slot may use the whole context, shared (llama-server's -kvu); without it each of the "
                        "-np N slots has n_ctx / N of it, as llama-server's, and a request that cannot fit its slot "
                        "is a 400 at once (default: off)")
    s.add_argument("--threads-http", dest="threads_http", type=int, default=None, metavar="N",
                   help="accepted for llama-server's command lines: the HTTP side here is one asyncio loop")
    s.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help="completion requests that wait besides the slots; past that the server answers 503 "
                        "with Retry-After (default %(default)s)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level; info logs one line per request (default %(default)s)")
    s.add_argument("--slots", action="store_true", help="llama-server's flag: /slots is always on here")
    s.add_argument("--slot-save-path", metavar="DIR", default=None,
                   help="where POST /slots/ID?action=save writes a slot's conversation (its tokens and KV cache) "
                        "and action=restore reads one back, as llama-server (made if missing; default: none, "
                        "those actions answer 501)")
    s.add_argument("--metrics", action="store_true",
                   help="llama-server's flag: /metrics (Prometheus text, llama-server's counters and the expert "
                        "cache's) is always on here")
    s.add_argument("--embeddings", "--embedding", action="store_true",
                   help="llama-server's embeddings: refused, a generation model computes none here")
    s.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=None, metavar="N",
                   help="llama-server's tokens per request: refused, each request says how many (max_tokens)")
    add_prompt_cache_options(s)
    add_template_options(s, serve=True)
    add_hub_options(s)
    add_routing_options(s, profile=True)
    s.set_defaults(func=cmd_serve)


def rpc_listen_address(host: str, port: int) -> str:
    """The IPv4 address ggml's RPC server is to listen on for ``--host`` (a name is resolved here:
    ggml takes only a dotted IPv4 address, and returns without serving for anything else); UserError
    for a port out of range, a name that does not resolve to IPv4, or an IPv6 address."""
    import socket

    if not 0 < port < 65536:
        raise UserError(f"--port {port}: give a TCP port from 1 to 65535 (ggml's RPC server takes no port 0: "
                        "clients need to know it)")
    try:
        socket.inet_pton(socket.AF_INET6, host.strip("[]"))
        raise UserError(f"--host {host}: ggml's RPC server listens on IPv4 addresses only (e.g. 127.0.0.1 or 0.0.0.0)")
    except OSError:
        pass
    try:
        return socket.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError) as e:
        raise UserError(f"--host {host}: no IPv4 address for it ({getattr(e, 'strerror', None) or e}); "
                        "ggml's RPC server listens on IPv4 addresses only") from None


def rpc_memory(text: str) -> int:
    """--mem as llama.cpp's rpc-server took it: MiB as a plain number, or a size with a unit (``8G``).

    >>> rpc_memory("2048") == 2 << 30, rpc_memory("1.5G") == 3 << 29
    (True, True)
    """
    from ..config import parse_bytes

    n = int(float(text) * 2**20) if text.strip().replace(".", "", 1).isdigit() else parse_bytes(text)
    if not n or n < 1 << 20:
        raise UserError(f"--mem {text}: give the memory to report, at least 1 MiB: MiB as a number (8192) or a "
                        "size with a unit (8G, 512MiB)")
    return n


def cmd_rpc_server(args) -> int:
    import threading

    from .. import rpc
    from ..plan import _mib

    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    mem = rpc_memory(args.mem) if args.mem is not None else None
    addr = rpc_listen_address(args.host, args.port)
    _check_port(addr, args.port)
    shown = args.host if addr == args.host else f"{args.host} ({addr})"
    print(f"pymoecache rpc-server: serving this machine's CPU at {shown}:{args.port}"
          + (f", reporting {_mib(mem)} of memory" if mem is not None else "") + " (Ctrl-C to stop); "
          f"offload to it with -ngl N --rpc {args.host}:{args.port}", file=sys.stderr, flush=True)
    # ggml's server blocks in accept() and returns only when it cannot serve: it runs in a thread
    # of its own, so that this one takes Ctrl-C (a signal reaches Python code, never a C call)
    done = threading.Event()

    def run() -> None:
        try:
            rpc.serve(f"{addr}:{args.port}", threads=args.threads, mem=mem)
        finally:
            done.set()

    threading.Thread(target=run, name="rpc-server", daemon=True).start()
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        print("pymoecache rpc-server: stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)  # (the server thread sits in accept(): nothing to join)
    raise UserError(f"ggml's RPC server at {addr}:{args.port} stopped without serving (see its lines above)")


def add_rpc_command(subparsers) -> None:
    """Register ``rpc-server`` (called from cli.build_parser)."""
    s = subparsers.add_parser(
        "rpc-server", help="serve this machine's CPU as a ggml RPC device (what -ngl N --rpc HOST:PORT offloads to)",
        description="Serve this machine's CPU as a ggml RPC device, as llama.cpp's rpc-server does with its CPU "
                    "backend: another process offloads GPU layers to it with -ngl N --rpc HOST:PORT (its dense part "
                    "goes there, the experts stay in that process's cache). A machine with a GPU runs llama.cpp's "
                    "own rpc-server instead. No authentication: only on a trusted network.")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s, this machine only)")
    s.add_argument("--port", type=int, default=50052, metavar="N", help="TCP port (default %(default)s, as llama.cpp)")
    s.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads computing the offloaded layers (default: half of the cores)")
    s.add_argument("-m", "--mem", default=None, metavar="SIZE",
                   help="memory the device reports to clients, free and total: MiB as a number, or a size with a "
                        "unit (8G), as llama.cpp's rpc-server -m did; a client plans its GPU layers for that much "
                        "(default: this machine's memory)")
    s.set_defaults(func=cmd_rpc_server)
