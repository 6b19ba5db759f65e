"""``create_app``: the served model loaded, the FastAPI app with its error handlers, and every route module's
routes on it (completions, info, native, slots; llama_cpp.server's other endpoints on plain routes).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional, Union

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware import Middleware
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette_context.middleware import RawContextMiddleware
from starlette_context.plugins import RequestIdPlugin

from .. import __version__
from ..config import CacheConfig, Preset, Routing, parse_routing
from ..errors import ConfigError
from ..files import make_directory
from ..step_order import StepOrder
from . import batch as server_batch
from . import completions, info, native, slots
from .model import Queue, Served, _log, authenticate, load_model, perf_counters
from .requests import _field_error, error_response


def create_app(model_path: "str | Path", *, cache: Optional[CacheConfig] = None,
               routing: Union[Routing, str, None] = None, routing_scope: str = "all", n_ctx: int = 2048,
               n_threads: Optional[int] = None, profile: "str | Path | None" = None, pin_hot: int = 0,
               max_queue: int = 16, alias: Optional[str] = None, api_key: Optional[str] = None,
               n_parallel: int = 1, kv_unified: bool = False, chat_template: Optional[str] = None, chat_template_file: Optional[str] = None,
               slot_save_path: "str | Path | None" = None, prompt_cache=None, batch_order: str = "auto",
               **llama_kwargs):
    """A FastAPI app serving ``model_path`` through llama-cpp-python's OpenAI-compatible endpoints, llama-server's
    and ours (``/moecache/stats``). Loads the model now (errors surface here, not at the first request); run it
    with ``uvicorn.run(app, host=..., port=...)``. One app per process (llama_cpp.server keeps its model in a
    module global: a second call frees the first's). ``**llama_kwargs`` go to :class:`pymoecache.Llama`.

    profile: a usage profile (``Llama.load_profile``), loaded now if it exists (``pin_hot`` experts pinned per
    layer), saved at shutdown; each completion is one request of it. max_queue: completions that may wait
    while one generates (past that, 503 + Retry-After). alias: the model's id in answers (default: the file's
    name). api_key: every endpoint but /health answers 401 without ``Authorization: Bearer KEY`` or ``X-Api-Key:
    KEY``; "A1,B2" is two keys, either of which opens it (llama-server's).
    n_parallel: slots, as llama-server's -np, decoded together (server/batch.py); a request the batch does not
    take (logprobs, a grammar, a routing of its own, ...) runs alone between batches; batch_order: which of the
    running slots a step decodes ("auto": together or one at a time in turns, whichever measured faster;
    "together"; "one-ahead": pymoecache/step_order.py). Each slot's context is
    n_ctx / n_parallel, as llama-server's; kv_unified (-kvu): every slot may use the whole context. prompt_cache: a
    :class:`pymoecache.prompt_cache.PromptCache`. slot_save_path: the directory of llama-server's slot files
    (server/slots.py; without it those actions answer 501). chat_template: a llama.cpp built-in name;
    chat_template_file: a Jinja file (default: the model's template by Jinja, ChatML without one).

    >>> app = create_app("model.gguf", routing="prior:0.5", cache=CacheConfig(size=0.5))  # doctest: +SKIP
    """
    import llama_cpp.server.app as app_mod  # (its extras checked by pymoecache.server.server_module)
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    # (the slot directory made where missing, as llama-server does, before the model loads)
    slot_dir = make_directory(slot_save_path, "--slot-save-path", ConfigError) if slot_save_path is not None else None
    StepOrder(batch_order)  # (checked before the model loads)
    cache = cache if cache is not None else CacheConfig()
    routing = parse_routing(routing) if isinstance(routing, str) else routing
    if routing is None:  # as Llama: the default preset (top-k where every expert is cached)
        routing = Preset.default_for(cache)
    served = Served(app_mod, str(model_path), alias or Path(model_path).name, routing, routing_scope, n_parallel,
                    max_queue, slot_dir, kv_unified, api_key, queue=Queue(max_queue, n_parallel))
    # model_construct: these settings come from our arguments only, not from environment variables
    # (pydantic-settings would read MODEL, N_CTX, API_KEY, ... from the environment). interrupt_requests
    # off: a streamed answer runs to its end while the next request waits (the stock default cuts it)
    app_mod.set_server_settings(ServerSettings.model_construct(interrupt_requests=False, api_key=None))  # (ours: auth)
    load_model(served, ModelSettings.model_construct(model=str(model_path), model_alias=served.model_id, n_ctx=n_ctx),
               chat_template=chat_template, chat_template_file=chat_template_file, cache=cache, routing=routing,
               routing_scope=routing_scope, n_ctx=n_ctx, n_threads=n_threads, n_seq_max=n_parallel,
               **{"verbose": False, **llama_kwargs})
    llm = served.llm()
    served.cache_choice = str(llm.cache_choice) if getattr(llm, "cache_choice", None) is not None else None
    served.memory_plan = llm.memory_plan()
    llm.set_prompt_cache(prompt_cache)
    served.auth = [Depends(authenticate)] if served.api_keys() else []
    # with an API key the documentation is behind it too, as every endpoint but /health
    docs = {} if api_key is None else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="pymoecache", version=__version__,
                  middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))], **docs)
    app.state.served = served
    app.state.cache_choice, app.state.memory_plan = served.cache_choice, served.memory_plan
    app.state.chat_template = llm.chat_template.label
    app.state.n_ctx = llm.n_ctx()  # (what llama.cpp made: it pads a small -c up)
    app.state.profile_pinned = None
    if profile is not None:
        if Path(profile).exists():
            app.state.profile_pinned = llm.load_profile(profile, pin_hot=pin_hot)
        app.router.on_shutdown.append(functools.partial(llm.save_profile, profile))
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    if n_parallel > 1:  # the slots decoded together (server/batch.py); the requests it does not take run alone
        served.batch = server_batch.BatchServer(llm, app_mod.get_llama_proxy, served.model_id, batch_order)
        app.router.on_shutdown.append(served.batch.close)
    served.perf0 = perf_counters(llm)  # /metrics counts from here: the load's own decodes are not requests
    router = APIRouter()
    for module in (completions, native, info, slots):
        module.add_routes(router, served)
    add_stock_routes(app, router, served)
    app.include_router(router)
    return app


async def invalid_request(request, exc):
    """The other stock endpoints' malformed bodies: 400, one line, no input echoed."""
    return _field_error(exc.errors()).response()


async def http_error(request, exc):
    """401, 404, 405, ...: the same body as every other error."""
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def internal_error(request, exc):
    _log.error("request to %s failed: %r", request.url.path, exc)
    return error_response(500, "internal server error")


async def openapi_behind_the_key(request: Request):
    return JSONResponse(request.app.openapi())


async def docs_behind_the_key(request: Request):
    from fastapi.openapi.docs import get_swagger_ui_html

    return get_swagger_ui_html(openapi_url="/openapi.json", title="pymoecache")


def add_stock_routes(app, router, served) -> None:
    """/docs and /openapi.json behind the API key where there is one, and llama_cpp.server's other endpoints
    (/v1/models, /extras/tokenize, ...) on plain routes: upstream's route class turns any error, a malformed
    body included, into a 500 carrying its traceback."""
    if served.api_key is not None:
        app.add_api_route("/openapi.json", openapi_behind_the_key, include_in_schema=False, dependencies=served.auth)
        app.add_api_route("/docs", docs_behind_the_key, include_in_schema=False, dependencies=served.auth)
    for r in served.app_mod.router.routes:
        if r.path in completions.COMPLETION_PATHS or r.path in ("/v1/embeddings", "/extras/detokenize", "/v1/models"):
            continue
        router.add_api_route(r.path, r.endpoint, methods=sorted(r.methods), response_model=r.response_model,
                             dependencies=served.auth if r.dependencies else [], summary=r.summary, tags=r.tags,
                             include_in_schema=r.include_in_schema, name=r.name)
