"""``pymoecache serve``: llama-cpp-python's OpenAI-compatible server running ``pymoecache.Llama``.

    pymoecache serve model.gguf --prior 0.5 --cache-size 0.5 --port 8080
    curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'
    curl http://127.0.0.1:8080/moecache/stats

Every endpoint of ``llama_cpp.server`` works as there (/v1/completions, /v1/chat/completions,
/v1/models, /extras/tokenize, /docs), with these additions:

* ``GET /moecache/stats``: the cache counters since the server started (see :func:`stats_json`), and
  ``GET /health``: up, generating or not, requests waiting. Both answer during a generation, with a
  snapshot taken between two tokens.
* llama-server's ``GET /props``, ``/slots`` and ``/metrics`` (Prometheus text: its token counters
  and rates, requests in flight and waiting, and the expert cache's hits, misses and bytes read);
  ``api_key`` (401 without it on everything but /health), ``alias`` (the model's id, default the
  file's name), ``n_parallel`` slots, and ``stream_options.include_usage`` on streamed answers.
* ``n_parallel`` > 1: the slots decoded together (server_batch.py).
* completions queue: one generates, up to ``max_queue`` wait their turn (in order of arrival), a
  request past that gets 503 with ``Retry-After``. Nothing is cut: a streamed answer is not
  interrupted by the next request. A client that disconnects frees its place, and its generation
  stops at the next token.
* llama-server's own ``POST /completion`` (its fields, streamed or not, with ``timings`` and our
  ``moecache``), ``/tokenize`` and ``/detokenize`` (server_native.py); ``max_completion_tokens`` and
  ``n_predict`` limit an OpenAI answer as ``max_tokens`` does; ``logprobs`` / ``top_logprobs`` are
  answered without ``logits_all`` (pymoecache.logprobs).
* request bodies are checked before the model sees them: malformed JSON, wrong types, bad roles,
  ``max_tokens`` outside [1, n_ctx], a prompt longer than the context, a grammar (or JSON schema)
  llama.cpp cannot parse, token ids outside the vocabulary all get 400 (OpenAI's status for a bad request), never a 500 or a crash;
  an internal error is a 500 without details (the traceback goes to the server's log). Every error,
  whatever its status (401, 404, 405, 501, 503 too), is OpenAI's ``{"error": {"message", "type",
  "param", "code"}}``. /embedding and /v1/embeddings answer 501, as llama-server without
  ``--embeddings``: the server runs a generation model.
* a ``"moecache"`` object in every completion and chat completion response, and in the last
  chunk of a streamed completion: the counters of that request alone (tokens, hits, misses,
  rates, bytes loaded). Streamed chats have none: llama_cpp.server runs them through
  ``llama_cpp.Llama.create_chat_completion`` itself, not through our subclass.

The server extras are imported only here, when a server is built: fastapi, uvicorn, sse-starlette,
starlette-context and pydantic-settings (see ``PIP_SERVER``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib.util
import json
import logging
import threading
from pathlib import Path
from typing import Optional, Union

from .config import CacheConfig, Preset, Routing, parse_routing, resolved_top_j
from .errors import ConfigError, Error, MissingDependencyError
from .llama import Llama
from .stats import MoEStats
from .server_requests import (RequestError, _field_error, _include_usage, error_response, request_routing,  # noqa: F401
                              request_stats, validate_request)

PIP_SERVER = ('pip install "fastapi>=0.100" "uvicorn>=0.22" "sse-starlette>=1.6.1" '
              '"starlette-context>=0.3.6,<0.4" "pydantic-settings>=2.0.1"')
_EXTRAS = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")
_COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/engines/copilot-codex/completions")
_log = logging.getLogger("pymoecache.serve")


# the disconnect of the client whose request is being generated (set per request by create_app's
# handler, for a stream while its response is sent; run_in_threadpool carries it into the thread
# that decodes, where _ServedLlama.eval reads it)
_CLIENT_GONE: "contextvars.ContextVar[Optional[threading.Event]]" = contextvars.ContextVar("client_gone", default=None)
# the routing a request asked for ("moecache": {"routing": ...}); None: the server's
_REQUEST_ROUTING: "contextvars.ContextVar[Optional[Routing]]" = contextvars.ContextVar("request_routing", default=None)


class _ClientGone(Exception):
    """Raised between two tokens when the client of the request has disconnected."""


class _Queue:
    """Completion requests that passed validation and are in the server: the one generating and
    those waiting on llama_cpp.server's lock (served in order of arrival). At most ``n_parallel +
    max_queue``; past that, 503 with Retry-After. One event loop changes ``active``: no lock needed."""

    def __init__(self, max_queue: int, n_parallel: int = 1):
        self.max_queue, self.n_parallel, self.active = max_queue, n_parallel, 0

    def full(self) -> bool:
        return self.active >= self.n_parallel + self.max_queue

    def busy_response(self):
        return error_response(503, f"the server is busy: {self.n_parallel} slot(s) and {self.max_queue} places in "
                                   "the queue are taken; retry later", "server_busy", headers={"Retry-After": "1"})


async def _watch_disconnect(request, gone: threading.Event) -> None:
    while not gone.is_set():
        if await request.is_disconnected():
            gone.set()
            return
        await asyncio.sleep(0.2)


def perf_counters(llm) -> tuple:
    """llama.cpp's cumulative counters of the context: (prompt tokens, prompt ms, decoded tokens, decode ms)."""
    import llama_cpp

    p = llama_cpp.llama_perf_context(llm._ctx.ctx)
    return p.n_p_eval, p.t_p_eval_ms, p.n_eval, p.t_eval_ms


def metrics_text(llm, generating: bool, waiting: int, since: tuple = (0, 0.0, 0, 0.0)) -> str:
    """``GET /metrics``: llama-server's counters (prompt and predicted tokens, their seconds and
    rates, requests in flight and waiting) from llama.cpp's own timings since ``since`` (the
    perf_counters when the server started: what the load itself decoded does not count), and the
    expert cache's (hits, misses, hit rate, bytes read, I/O wait), in Prometheus' text format."""
    n_p, ms_p, n_e, ms_e = (a - b for a, b in zip(perf_counters(llm), since))
    t_p, t_e = ms_p / 1e3, ms_e / 1e3
    rows = [
        ("llamacpp:prompt_tokens_total", "counter", "Prompt tokens processed.", n_p),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt process time.", t_p),
        ("llamacpp:tokens_predicted_total", "counter", "Generated tokens (decoded).", n_e),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time.", t_e),
        ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         n_p / t_p if t_p > 0 else 0.0),
        ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
         n_e / t_e if t_e > 0 else 0.0),
        ("llamacpp:requests_processing", "gauge", "Requests generating.", int(generating)),
        ("llamacpp:requests_deferred", "gauge", "Requests waiting in the queue.", waiting),
    ]
    if llm.moecache is not None:
        st = llm.moe_stats()
        rs = st.residency
        rows += [
            ("pymoecache:tokens_total", "counter", "Tokens routed through the expert cache.", st.tokens),
            ("pymoecache:cache_hits_total", "counter", "Expert selections found in the cache.", st.hits),
            ("pymoecache:cache_misses_total", "counter", "Expert selections not in the cache.", st.misses),
            ("pymoecache:cache_hit_rate", "gauge", "Hits / (hits + misses) since load.", st.hit_rate),
            ("pymoecache:rerouted_total", "counter", "Experts run from outside the router's own top K (what "
             "cache-conditional routing changed).", st.rerouted),
            ("pymoecache:router_probability_given_up", "gauge", "Router probability given up per token and MoE "
             "layer since load: its own top K's less that of the experts run.", st.p_given_up),
            ("pymoecache:bytes_read_total", "counter", "Expert bytes read from the model file (load, prompts, "
             "decoding).", (rs.load_bytes_read + rs.prompt_bytes_read + rs.decode_bytes_read) if rs else 0),
            ("pymoecache:io_wait_seconds_total", "counter", "Time decoded tokens waited for expert reads.",
             rs.decode_t_io_ms / 1e3 if rs else 0.0),
            ("pymoecache:lowbit_loads_total", "counter", "Selections of decoded tokens computed from the low-bit "
             "companion (--miss lowbit).", rs.lowbit_loads if rs else 0),
            ("pymoecache:lowbit_bytes_read_total", "counter", "Bytes read from the low-bit companion.",
             rs.lowbit_bytes_read if rs else 0),
        ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(out) + "\n"


def server_module():
    """``llama_cpp.server.app``, or a MissingDependencyError saying how to install what it needs."""
    missing = [m for m in _EXTRAS if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDependencyError(f"the server needs packages that are not installed ({', '.join(missing)}): {PIP_SERVER}")
    import llama_cpp.server.app as app_mod

    return app_mod


def stats_json(llm: Llama, routing: Routing, routing_scope: str) -> dict:
    """What ``GET /moecache/stats`` answers: the counters since load, in total and per MoE layer."""
    st = llm.moe_stats()
    routing = llm.moecache.routing  # as resolved (a preset names what it chose)
    return {
        "model": llm.model_path,
        "routing": routing.spec(),
        "preset": llm.preset.name if getattr(llm, "preset", None) is not None else None,
        "top_j": (resolved_top_j(routing, llm.model_info.n_expert_used) if hasattr(routing, "top_j") else None),
        "routing_scope": routing_scope,
        **st.summary_dict(),
        "expert_bytes": st.expert_bytes,
        "moe_layers": st.moe_layers.tolist(),
        "cache_size_per_layer": st.capacity_per_layer.tolist(),
        "cache_choice": str(llm.cache_choice) if getattr(llm, "cache_choice", None) is not None else None,
        "tokens_per_layer": st.tokens_per_layer.tolist(),
        "hits_per_layer": st.hits_per_layer.tolist(),
        "misses_per_layer": st.misses_per_layer.tolist(),
        "evictions_per_layer": st.evictions_per_layer.tolist(),
        "hit_rate_per_layer": st.hit_rate_per_layer.tolist(),
    }


class _ServedLlama(Llama):
    """``pymoecache.Llama`` that puts each request's cache counters into its results as ``"moecache"``
    (the stock server calls these two methods, under its lock, for every completion and chat)."""

    def eval(self, tokens) -> None:
        gone = _CLIENT_GONE.get()
        if gone is not None and gone.is_set():  # the client left: stop before the next token
            raise _ClientGone()
        super().eval(tokens)

    model_alias: Optional[str] = None  # the id answers carry (create_app's alias or the file's name)

    def create_completion(self, *args, **kwargs):
        self._begin_request()
        if self.model_alias is not None:
            kwargs["model"] = self.model_alias
        with self._request_routing() as restore:
            return self._with_request_stats(self._stats(), super().create_completion(*args, **kwargs), restore)

    def create_chat_completion(self, *args, **kwargs):
        self._begin_request()
        if self.model_alias is not None:
            kwargs["model"] = self.model_alias
        with self._request_routing() as restore:
            return self._with_request_stats(self._stats(), super().create_chat_completion(*args, **kwargs), restore)

    @contextlib.contextmanager
    def _request_routing(self):
        """The request's own routing ("moecache": {"routing": ...}) for as long as it decodes: yields the
        function that puts the server's back (called here for an answer, by the stream at its end)."""
        if self._routing_lent is not None:  # a stream never read (its client left first) kept it: back now
            self.set_routing(self._routing_lent)
            self._routing_lent = None
        routing = _REQUEST_ROUTING.get()
        if routing is None or self.moecache is None:
            yield None
            return
        server = self.moecache.routing
        self.set_routing(routing)
        self._routing_lent = server

        def restore():
            if self._routing_lent is not None:
                self._routing_lent = None
                self.set_routing(server)

        try:
            yield restore
        except BaseException:
            restore()
            raise

    _usage: Optional[dict] = None
    _routing_lent = None  # the server's routing while a request runs with its own (restored after it)

    def sample(self, *args, **kwargs):
        tok = super().sample(*args, **kwargs)
        u = self._usage
        if u is not None:  # a request's token counts, as a non-streamed answer's "usage" counts them
            if u["prompt_tokens"] is None:
                u["prompt_tokens"] = self.n_tokens  # the whole prompt is in the context at the first sample
            import llama_cpp

            if not llama_cpp.llama_vocab_is_eog(self._model.vocab, tok):  # an end-of-text token is not text
                u["completion_tokens"] += 1
        return tok

    def last_usage(self) -> dict:
        """Token counts of the last request, as OpenAI's ``usage`` object."""
        u = self._usage or {"prompt_tokens": 0, "completion_tokens": 0}
        p, c = u["prompt_tokens"] or 0, u["completion_tokens"]
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _begin_request(self) -> None:
        self._usage = {"prompt_tokens": None, "completion_tokens": 0}
        if self.moecache is not None:  # each completion is a request (the profile, activation eviction)
            self.moecache.begin_request()

    def _stats(self) -> Optional[MoEStats]:
        return self.moecache.stats() if self.moecache is not None else None

    def _with_request_stats(self, before, result, restore=None):
        if isinstance(result, dict):
            if before is not None:
                result["moecache"] = request_stats(before, self._stats())
            if restore is not None:
                restore()
            return result
        return self._stream_with_request_stats(before, result, restore)

    def _stream_with_request_stats(self, before, chunks, restore=None):
        try:
            for chunk in chunks:
                if before is not None and any(c.get("finish_reason") for c in chunk.get("choices", [])):
                    chunk["moecache"] = request_stats(before, self._stats())
                yield chunk
        finally:
            if restore is not None:  # (the request's routing, until its last token)
                restore()


def create_app(model_path: "str | Path", *, cache: Optional[CacheConfig] = None,
               routing: Union[Routing, str, None] = None, routing_scope: str = "all", n_ctx: int = 2048,
               n_threads: Optional[int] = None, profile: "str | Path | None" = None, pin_hot: int = 0,
               max_queue: int = 16, alias: Optional[str] = None, api_key: Optional[str] = None,
               n_parallel: int = 1, chat_template: Optional[str] = None, chat_template_file: Optional[str] = None,
               slot_save_path: "str | Path | None" = None, prompt_cache=None, **llama_kwargs):
    """A FastAPI app serving ``model_path`` through llama-cpp-python's OpenAI-compatible endpoints,
    plus ``GET /moecache/stats``. Loads the model now (errors surface here, not at the first request).
    Run it with ``uvicorn.run(app, host=..., port=...)``.

    ``llama_cpp.server`` keeps its model in a module global, so one app per process: a second call
    frees the first app's model. ``**llama_kwargs`` go to :class:`pymoecache.Llama`.

    profile: a usage profile file (``Llama.load_profile``): loaded now if it exists (a warm start,
    ``pin_hot`` experts pinned per layer) and saved when the server shuts down. Each completion is
    one request of the profile.

    max_queue: completion requests that may wait while one generates; past that, 503 + Retry-After.

    alias: the model's id in /v1/models and in every answer (default: the file's name).
    api_key: every endpoint but /health answers 401 without ``Authorization: Bearer KEY``.
    n_parallel: slots, as llama-server's -np: requests held at once besides the queue, decoded
    together (server_batch.py: continuous batching on one expert cache); a request the batch does not
    take (logprobs, a grammar, logit_bias, a routing of its own, ...) runs alone between batches.
    /slots shows what each slot decodes.

    prompt_cache: a :class:`pymoecache.prompt_cache.PromptCache` every completion restores from and saves to.
    slot_save_path: a directory for llama-server's slot files (``POST /slots/{id}?action=save|restore|erase``,
    server_slots.py); without it those actions answer 501.

    chat_template: one of llama.cpp's built-in template names; chat_template_file: a Jinja template
    file. Default: the model's own template rendered by Jinja (llama-server --jinja), ChatML for a
    model without one (pymoecache.templates).

    >>> app = create_app("model.gguf", routing="prior:0.5", cache=CacheConfig(size=0.5))  # doctest: +SKIP
    """
    app_mod = server_module()
    from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.middleware import Middleware
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse, Response
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from starlette_context.middleware import RawContextMiddleware
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette_context.plugins import RequestIdPlugin

    from . import __version__

    from .files import make_directory

    # (made where missing, as llama-server does, before the model loads)
    slot_dir = make_directory(slot_save_path, "--slot-save-path", ConfigError) if slot_save_path is not None else None
    cache = cache if cache is not None else CacheConfig()
    routing = parse_routing(routing) if isinstance(routing, str) else routing
    if routing is None:  # as Llama: the default preset (top-k where every expert is cached)
        routing = Preset.default_for(cache)

    class MoELlamaProxy(LlamaProxy):
        """The stock model holder, loading our class: its own loader hard-codes ``llama_cpp.Llama``."""

        def load_llama_from_model_settings(self, settings):
            from .templates import ChatTemplate

            llm = _ServedLlama(settings.model, cache=cache, routing=routing, routing_scope=routing_scope,
                               n_ctx=n_ctx, n_threads=n_threads, n_seq_max=n_parallel,
                               **{"verbose": False, **llama_kwargs})
            llm.model_alias = model_id
            try:
                tmpl = ChatTemplate(llm, name=chat_template, file=chat_template_file, default_jinja=True)
            except Error:
                llm.close()
                raise
            if chat_template or chat_template_file or tmpl.fallback:  # (else llama-cpp-python's own, the same)
                llm.chat_handler = tmpl.handler()
            llm.chat_template = tmpl
            return llm

    # model_construct: these settings come from our arguments only, not from environment variables
    # (pydantic-settings would read MODEL, N_CTX, API_KEY, ... from the environment).
    model_id = alias or Path(model_path).name
    model_settings = ModelSettings.model_construct(model=str(model_path), model_alias=model_id, n_ctx=n_ctx)
    # interrupt_requests off: a streamed answer runs to its end while the next request waits (the stock
    # default cuts it as soon as another request arrives)
    app_mod.set_server_settings(ServerSettings.model_construct(interrupt_requests=False, api_key=api_key))
    # The one place we reach into llama_cpp.server: its endpoints take the model from this module
    # global, and set_llama_proxy() can only build a stock LlamaProxy (llama_cpp.Llama), not ours.
    if app_mod._llama_proxy is not None:  # one model per process: free the previous app's first
        app_mod._llama_proxy.free()
        app_mod._llama_proxy = None
    proxy = app_mod._llama_proxy = MoELlamaProxy(models=[model_settings])  # loads the model

    # with an API key the documentation is behind it too, as every endpoint but /health (added below)
    docs = {} if api_key is None else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="pymoecache", version=__version__,
                  middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))], **docs)
    choice = getattr(proxy(), "cache_choice", None)  # what cache size "auto" chose and why
    app.state.cache_choice = str(choice) if choice is not None else None
    app.state.memory_plan = proxy().memory_plan()
    proxy().set_prompt_cache(prompt_cache)
    app.state.chat_template = proxy().chat_template.label
    app.state.n_ctx = proxy().n_ctx()  # (what llama.cpp made: it pads a small -c up)
    app.state.profile_pinned = None
    if profile is not None:
        served = proxy()
        if Path(profile).exists():
            app.state.profile_pinned = served.load_profile(profile, pin_hot=pin_hot)
        app.router.on_shutdown.append(lambda: served.save_profile(profile))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc):  # the other stock endpoints: 400, one line, no input echoed
        return _field_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):  # 401, 404, 405, ...: the same body as every other error
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        _log.error("request to %s failed: %r", request.url.path, exc)
        return error_response(500, "internal server error")
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    queue = _Queue(max_queue, n_parallel)
    # -np N > 1: the slots decoded together (server_batch.py); the requests it does not take run alone
    from . import server_batch

    batch = server_batch.BatchServer(proxy(), app_mod.get_llama_proxy, model_id) if n_parallel > 1 else None
    if batch is not None:
        app.router.on_shutdown.append(batch.close)
    perf0 = perf_counters(proxy())  # /metrics counts from here: the load's own decodes are not requests
    auth = [Depends(app_mod.authenticate)]
    if api_key is not None:
        from fastapi.openapi.docs import get_swagger_ui_html

        @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
        async def openapi_behind_the_key():
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False, dependencies=auth)
        async def docs_behind_the_key():
            return get_swagger_ui_html(openapi_url="/openapi.json", title="pymoecache")

    # The stock completion endpoints again, behind validate_request and without their response
    # models (which would drop the "moecache" field); registered first, so they answer these paths.
    ours = APIRouter()

    class StopWhenGone(Response):
        """Wraps a streamed response: while it is sent, the generation behind it sees ``gone``
        (through _CLIENT_GONE), set when the client disconnects or the response ends for any reason,
        so the decoding thread stops at its next token and llama_cpp.server's lock is released."""

        def __init__(self, response, request, gone: threading.Event, routing=None, on_end=None):
            super().__init__()
            self.response, self.request, self.gone, self.routing = response, request, gone, routing
            self.on_end = on_end  # (a batched stream: its sequence, cancelled however the stream ends)
            queue.active += 1  # the request keeps its place until its stream ends

        async def __call__(self, scope, receive, send):
            reset = _CLIENT_GONE.set(self.gone)
            reset_routing = _REQUEST_ROUTING.set(self.routing)
            watcher = asyncio.create_task(_watch_disconnect(self.request, self.gone))
            try:
                await self.response(scope, receive, send)
            except _ClientGone:  # the generation stopped because the client left: nobody to answer
                _log.info("client of %s disconnected: generation stopped", self.request.url.path)
            except Error as e:  # mid-stream, after the status was sent: the stream ends without [DONE]
                _log.error("streamed request to %s stopped: %s", self.request.url.path, e)
            finally:
                queue.active -= 1
                self.gone.set()
                if self.on_end is not None:
                    self.on_end()
                watcher.cancel()
                _CLIENT_GONE.reset(reset)
                _REQUEST_ROUTING.reset(reset_routing)

    def stream_response(request, body, include_usage: bool):
        """The stock streaming branch of both completion endpoints (an SSE stream fed by
        llama_cpp.server's publisher), through our completion so that the last chunk carries the
        "moecache" counters, and with OpenAI's ``stream_options.include_usage``: one more chunk,
        without choices, with the request's ``usage``."""
        import anyio
        import llama_cpp
        from sse_starlette.sse import EventSourceResponse

        chat = request.url.path.endswith("/chat/completions")
        if not chat and isinstance(body.prompt, list):
            body.prompt = body.prompt[0] if body.prompt else ""
        kwargs = body.model_dump(exclude={"n", "logit_bias_type", "user", "min_tokens"} | ({"best_of"} if not chat else set()))

        def call(llama, **kw):
            chunks = llama_cpp.Llama.create_chat_completion(llama, **kw) if chat else llama.create_completion(**kw)
            last = None
            for chunk in chunks:
                last = chunk
                yield chunk
            if include_usage and last is not None:
                yield {"id": last["id"], "object": last["object"], "created": last["created"], "model": last["model"],
                       "choices": [], "usage": llama.last_usage()}

        send_chan, recv_chan = anyio.create_memory_object_stream(10)
        return EventSourceResponse(
            recv_chan, sep="\n", ping_message_factory=app_mod._ping_message_factory,
            data_sender_callable=functools.partial(app_mod.get_event_publisher, request=request,
                                                   inner_send_chan=send_chan, body=body, body_model=body.model,
                                                   llama_call=call, kwargs=kwargs))

    from starlette.requests import ClientDisconnect

    def checked(endpoint, validate=validate_request, stream=None):
        """A completion endpoint behind the checks, the queue and the disconnect watch; ``validate(llm,
        path, raw)`` builds its body, ``stream(request, body, raw)`` its streamed response."""
        stream = stream or (lambda request, body, raw: stream_response(request, body, _include_usage(raw)))

        async def handler(request: Request):
            gone, watcher = threading.Event(), None
            reset = _CLIENT_GONE.set(gone)
            reset_routing = None
            try:
                raw = await request.body()
                body = validate(proxy(), request.url.path, raw)
                routing = request_routing(raw)
                reset_routing = _REQUEST_ROUTING.set(routing)
                if queue.full():
                    return queue.busy_response()
                proxy()._check_file()  # a model file replaced or truncated since load: 503 now, not a broken stream
                chat = request.url.path.endswith("/chat/completions")
                if batch is not None and validate is validate_request and server_batch.batchable(body, chat, raw):
                    return await batched(request, body, raw, chat, gone)
                if body.stream:  # the generation runs while the response is sent, after this handler
                    return StopWhenGone(stream(request, body, raw), request, gone, routing)
                watcher = asyncio.create_task(_watch_disconnect(request, gone))
                queue.active += 1
                try:
                    return await endpoint(request=request, body=body)
                finally:
                    queue.active -= 1
            except ClientDisconnect:  # the client hung up before its request was in: nothing was started
                _log.info("client of %s disconnected before its request arrived", request.url.path)
                return Response(status_code=499)
            except _ClientGone:
                _log.info("client of %s disconnected: generation stopped", request.url.path)
                return error_response(499, "client disconnected")
            except RequestError as e:
                return e.response()
            except ConfigError as e:  # a parameter of the request the model refuses: the client's error
                return RequestError(str(e)).response()
            except Error as e:  # the model cannot serve (its file changed, NaN weights, an I/O error): say so
                _log.error("request to %s failed: %s", request.url.path, e)
                return error_response(503, str(e), "model_error")
            except HTTPException:
                raise
            except ValueError as e:  # llama-cpp-python's own checks of a request (context window, ...)
                return RequestError(" ".join(str(e).split())[:300]).response()
            except Exception:  # ours or upstream's bug: logged here, no details to the client
                _log.exception("request to %s failed", request.url.path)
                return error_response(500, "internal server error")
            finally:
                if watcher is not None:
                    watcher.cancel()
                _CLIENT_GONE.reset(reset)
                if reset_routing is not None:
                    _REQUEST_ROUTING.reset(reset_routing)
        handler.__annotations__ = {"request": Request}  # a real class: this module's annotations are strings
        return handler

    async def batched(request, body, raw, chat: bool, gone: threading.Event):
        """A request the batch serves (server_batch.py): it joins the running batch at the next step."""
        from sse_starlette.sse import EventSourceResponse

        llm = proxy()
        if chat:
            prompt = llm.chat_template.tokens([dict(m) for m in body.messages])
        else:
            prompt = server_batch.completion_tokens(llm, body.prompt if isinstance(body.prompt, str)
                                                    else (body.prompt[0] if body.prompt else ""))
        if len(prompt) >= llm.n_ctx():
            raise RequestError(f"the prompt ({len(prompt)} tokens) does not fit the context of {llm.n_ctx()} tokens",
                               400, "messages" if chat else "prompt")
        stop = body.stop if isinstance(body.stop, list) else [body.stop] if isinstance(body.stop, str) else []
        req = batch.submit(prompt, body, stop, stream=bool(body.stream))
        if body.stream:
            events = server_batch.chunks(batch, req, chat, _include_usage(raw), gone)
            return StopWhenGone(EventSourceResponse(events, sep="\n", ping_message_factory=app_mod._ping_message_factory),
                                request, gone, on_end=req.seq.cancel)
        watcher = asyncio.create_task(_watch_disconnect(request, gone))
        queue.active += 1
        try:
            await server_batch.wait(req, gone)
        finally:
            queue.active -= 1
            watcher.cancel()
        if gone.is_set():
            raise _ClientGone()
        return JSONResponse(server_batch.answer(batch, req, chat))

    endpoints = (app_mod.create_completion, app_mod.create_chat_completion, app_mod.create_completion)
    for path, endpoint in zip(_COMPLETION_PATHS, endpoints):
        ours.add_api_route(path, checked(endpoint), methods=["POST"], response_model=None, include_in_schema=False,
                           dependencies=[Depends(app_mod.authenticate)])

    # llama-server's own endpoints (server_native.py): /completion (and its alias /completions),
    # /tokenize, /detokenize; /embedding(s) refused as llama-server refuses them without --embeddings
    from . import server_native

    noted = []

    def validate_native(llm, path, raw):
        req = server_native.NativeCompletion(llm, raw)
        if req.ignored and not noted:
            noted.append(True)
            _log.info("/completion: %s accepted and ignored (the context always keeps the longest common prefix)",
                      ", ".join(req.ignored))
        return req

    def native_stream(request, req, raw):
        import anyio
        from sse_starlette.sse import EventSourceResponse
        from starlette.concurrency import iterate_in_threadpool

        async def publish(chan):
            async with contextlib.asynccontextmanager(app_mod.get_llama_proxy)() as lp:
                async with chan:
                    async for piece in iterate_in_threadpool(server_native.generate(lp(), req)):
                        await chan.send(dict(data=json.dumps(piece)))

        send_chan, recv_chan = anyio.create_memory_object_stream(10)
        return EventSourceResponse(recv_chan, sep="\n", ping_message_factory=app_mod._ping_message_factory,
                                   data_sender_callable=functools.partial(publish, send_chan))

    async def native_completion(request, body):
        from starlette.concurrency import run_in_threadpool

        async with contextlib.asynccontextmanager(app_mod.get_llama_proxy)() as lp:
            return JSONResponse(await run_in_threadpool(server_native.complete, lp(), body))

    for path in ("/completion", "/completions"):
        ours.add_api_route(path, checked(native_completion, validate_native, native_stream), methods=["POST"],
                           response_model=None, summary="Completion (llama-server's /completion)",
                           tags=["llama-server"], dependencies=auth)

    def native(fn):
        from starlette.concurrency import run_in_threadpool

        async def handler(request: Request):  # (on a worker thread: the event loop answers /health meanwhile)
            try:
                return JSONResponse(await run_in_threadpool(fn, proxy(), await request.body()))
            except RequestError as e:
                return e.response()
        handler.__annotations__ = {"request": Request}
        return handler

    ours.add_api_route("/tokenize", native(server_native.tokenize), methods=["POST"], tags=["llama-server"],
                       summary="Tokenize (llama-server's /tokenize)", dependencies=auth)
    ours.add_api_route("/detokenize", native(server_native.detokenize), methods=["POST"], tags=["llama-server"],
                       summary="Detokenize (llama-server's /detokenize)", dependencies=auth)
    ours.add_api_route("/apply-template", native(server_native.apply_template), methods=["POST"],
                       tags=["llama-server"], summary="The chat template applied (llama-server's /apply-template)",
                       dependencies=auth)

    def extras_detokenize(llm, raw):  # llama-cpp-python's {"tokens"} -> {"text"}, ids checked, bytes replaced
        return {"text": server_native.detokenize(llm, raw)["content"]}

    ours.add_api_route("/extras/detokenize", native(extras_detokenize), methods=["POST"], tags=["Extras"],
                       summary="Detokenize", dependencies=auth)

    async def embeddings_refused(request: Request):
        return error_response(501, "this server runs a generation model and does not compute embeddings "
                                   f"({request.url.path}); llama-server answers the same without --embeddings",
                              headers={"x-should-retry": "false"})  # (the openai client would retry a 5xx)
    embeddings_refused.__annotations__ = {"request": Request}

    for path in ("/v1/embeddings", "/embedding", "/embeddings"):
        ours.add_api_route(path, embeddings_refused, methods=["POST"], include_in_schema=False, dependencies=auth)

    def load() -> tuple:
        # generating: llama_cpp.server's lock is held (-np N: the batch's sequences); waiting: the other
        # completion requests in the server
        generating = app_mod.llama_inner_lock.locked()
        if batch is not None and generating:
            generating = max(1, len(batch.dec.running))
        return int(generating), max(0, queue.active - generating)

    @ours.get("/v1/health", include_in_schema=False)  # (llama-server's alias)
    @ours.get("/health", summary="Server health", tags=["pymoecache"])
    async def health() -> dict:  # public, as llama-server's: no API key needed
        generating, waiting = load()
        return {"status": "ok", "model": model_id, "generating": generating, "waiting": waiting,
                "slots": n_parallel, "max_queue": max_queue}

    @ours.get("/props", summary="Server properties (llama-server's /props)", tags=["pymoecache"], dependencies=auth)
    def props() -> dict:
        llm = proxy()
        import llama_cpp

        tmpl = llm.chat_template
        return {"default_generation_settings": {"n_ctx": llm.n_ctx(), "model": model_id,
                                                "params": {"temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                                           "min_p": 0.05, "repeat_penalty": 1.0}},
                "total_slots": n_parallel, "model_alias": model_id, "model_path": str(model_path),
                "chat_template": tmpl.text if tmpl.text is not None else tmpl.name.decode("utf-8", "replace"),
                "chat_template_source": tmpl.label,
                "build_info": f"pymoecache {__version__} on llama-cpp-python {llama_cpp.__version__}",
                "moecache": {"routing": (llm.moecache.routing if llm.moecache is not None else routing).spec(),
                             "preset": llm.preset.name if getattr(llm, "preset", None) is not None else None,
                             "routing_scope": routing_scope,
                             # as resolved at load (auto made explicit): where the experts are, what a miss reads
                             "residency": (llm.moecache.residency_stats().residency if llm.moecache is not None
                                           else "none"),
                             "miss": llm.cache_config.miss if llm.moecache is not None else None,
                             "lowbit": (str(llm.cache_config.lowbit) if llm.moecache is not None
                                        and llm.cache_config.lowbit else None),
                             "cache_choice": app.state.cache_choice,
                             # where the memory goes (the plan line at start, as numbers): the dense part, the
                             # cache, a VRAM tier (n_vram, vram_exclusive), experts llama.cpp put on a GPU
                             "memory_plan": (app.state.memory_plan.as_dict()
                                             if app.state.memory_plan is not None else None)}}

    @ours.get("/slots", summary="Slots (llama-server's /slots)", tags=["pymoecache"], dependencies=auth)
    def slots() -> list:
        generating, waiting = load()
        n_ctx = proxy().n_ctx()
        if batch is not None and batch.dec.running:  # each slot's own state: the batch's sequences in theirs
            seqs = batch.slots()
            return [{"id": i, "n_ctx": n_ctx, "is_processing": s is not None,
                     "state": "generating" if s is not None else "idle",
                     "n_decoded": len(s.tokens) if s is not None else 0} for i, s in enumerate(seqs)]
        states = ["generating"] * generating + ["waiting"] * waiting
        return [{"id": i, "n_ctx": n_ctx, "is_processing": i < len(states) and states[i] == "generating",
                 "state": states[i] if i < len(states) else "idle"} for i in range(n_parallel)]

    from . import server_slots

    async def slot_action(id_slot, request, action=""):
        from starlette.concurrency import run_in_threadpool

        try:
            raw = await request.body()
            try:
                slot = int(id_slot)
            except ValueError:
                raise RequestError(f"slot id {id_slot[:20]!r} is not a number", 400, "id_slot") from None
            async with contextlib.asynccontextmanager(app_mod.get_llama_proxy)() as lp:
                return JSONResponse(await run_in_threadpool(server_slots.handle, lp(), slot_dir, n_parallel, slot,
                                                            action, raw, batch))
        except RequestError as e:
            return e.response()
    slot_action.__annotations__ = {"id_slot": str, "request": Request, "action": str}  # (real classes, as above)
    ours.add_api_route("/slots/{id_slot}", slot_action, methods=["POST"], tags=["llama-server"], dependencies=auth,
                       summary="Save, restore or erase a slot's conversation (llama-server's slot actions; serve "
                               "--slot-save-path DIR)")

    @ours.get("/metrics", summary="Prometheus metrics (llama-server's names, and the expert cache's)",
              tags=["pymoecache"], dependencies=auth)
    def prometheus_metrics():
        return Response(metrics_text(proxy(), *load(), since=perf0), media_type="text/plain; version=0.0.4")

    @ours.get("/moecache/stats", summary="Expert cache statistics", tags=["pymoecache"], dependencies=auth)
    def moecache_stats() -> dict:
        # Llama.moe_stats() reads the counters under the lock that guards each decoded token: a
        # consistent snapshot between two tokens, without waiting for (or interrupting) a whole
        # request as the server's request lock would
        llm = proxy()
        if llm.moecache is None:
            raise HTTPException(status_code=404, detail=f"{model_path} has no MoE layers: there is no expert cache")
        return stats_json(llm, routing, routing_scope)

    # The other stock endpoints (/v1/models, /extras/tokenize, ...) on plain routes: upstream's route
    # class turns any error, a malformed body included, into a 500 carrying its traceback.
    for r in app_mod.router.routes:
        if r.path in _COMPLETION_PATHS or r.path in ("/v1/embeddings", "/extras/detokenize"):
            continue
        ours.add_api_route(r.path, r.endpoint, methods=sorted(r.methods), response_model=r.response_model,
                           dependencies=r.dependencies, summary=r.summary, tags=r.tags,
                           include_in_schema=r.include_in_schema, name=r.name)
    app.include_router(ours)
    return app
