"""The served model: the Llama every route answers from (``ServedLlama``: a request's cache counters in its
answer, its own routing while it decodes, a stop when its client left), llama_cpp.server's holder that loads
it, and :class:`Served`, what the routes share (the proxy, the queue, the batch, the settings), kept on the
app as ``app.state.served``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

from fastapi import HTTPException, Request

from ..config import Routing
from ..errors import Error
from ..llama import Llama
from ..stats import MoEStats
from .requests import error_response, request_stats

_log = logging.getLogger("pymoecache.serve")

# the disconnect of the client whose request is being generated (set per request by the completion routes,
# for a stream while its response is sent; run_in_threadpool carries it into the thread that decodes, where
# ServedLlama.eval reads it)
CLIENT_GONE: "contextvars.ContextVar[Optional[threading.Event]]" = contextvars.ContextVar("client_gone", default=None)
# the routing a request asked for ("moecache": {"routing": ...}); None: the server's
REQUEST_ROUTING: "contextvars.ContextVar[Optional[Routing]]" = contextvars.ContextVar("request_routing", default=None)


class ClientGone(Exception):
    """Raised between two tokens when the client of the request has disconnected."""


def perf_counters(llm) -> tuple:
    """llama.cpp's cumulative counters of the context: (prompt tokens, prompt ms, decoded tokens, decode ms)."""
    import llama_cpp

    p = llama_cpp.llama_perf_context(llm._ctx.ctx)
    return p.n_p_eval, p.t_p_eval_ms, p.n_eval, p.t_eval_ms


class Queue:
    """Completion requests that passed validation and are in the server: the one generating and
    those waiting on llama_cpp.server's lock (served in order of arrival). At most ``n_parallel +
    max_queue``; past that, 503 with Retry-After. One event loop changes ``active``: no lock needed."""

    def __init__(self, max_queue: int, n_parallel: int = 1):
        self.max_queue, self.n_parallel, self.active = max_queue, n_parallel, 0

    def full(self) -> bool:
        return self.active >= self.n_parallel + self.max_queue

    def busy_response(self):
        return error_response(503, f"the server is busy: {self.n_parallel} slot(s) and {self.max_queue} places in "
                                   "the queue are taken; retry later", headers={"Retry-After": "1"})


@dataclass
class Served:
    """What the routes share: the model (``llm()``, llama_cpp.server's proxy, and ``model_lock``, its lock as
    a dependency), the settings create_app was given, the queue, and the batch of ``-np N`` > 1."""
    app_mod: Any                 # llama_cpp.server.app (its module globals hold the model)
    model_path: str
    model_id: str                # the alias, or the file's name
    routing: Routing             # the server's routing, as given (the Llama holds it resolved)
    routing_scope: str
    n_parallel: int
    max_queue: int
    slot_dir: Optional[str]      # --slot-save-path, made; None: slot actions answer 501
    kv_unified: bool             # -kvu: the slots share the whole context (else n_ctx / n_parallel each)
    api_key: Optional[str]       # --api-key as given: one key, or several separated by commas (llama-server's)
    queue: Queue = None
    batch: Any = None            # server.batch.BatchServer where n_parallel > 1
    perf0: tuple = (0, 0.0, 0, 0.0)  # llama.cpp's counters after the load: /metrics counts from there
    cache_choice: Optional[str] = None
    memory_plan: Any = None
    created: int = field(default_factory=lambda: int(time.time()))  # when it was loaded (/v1/models)
    auth: List[Any] = field(default_factory=list)  # the API key's dependency, on every route but /health

    def llm(self) -> "ServedLlama":
        return self.app_mod._llama_proxy()

    def api_keys(self) -> frozenset:
        """The keys a request may carry: ``--api-key "A1,B2"`` is two, as llama-server splits it."""
        return frozenset(k.strip() for k in (self.api_key or "").split(",") if k.strip())

    def model_lock(self):
        """llama_cpp.server's model lock, as ``async with`` holds it."""
        return contextlib.asynccontextmanager(self.app_mod.get_llama_proxy)()

    def load(self) -> tuple:
        """(generating, waiting): llama_cpp.server's lock is held (-np N: the batch's sequences); the other
        completion requests in the server."""
        generating = self.app_mod.llama_inner_lock.locked()
        if self.batch is not None and generating:
            generating = max(1, len(self.batch.dec.running))
        return int(generating), max(0, self.queue.active - generating)


def load_model(served: Served, model_settings, *, chat_template=None, chat_template_file=None, **llama_kwargs):
    """The model loaded into llama_cpp.server's module global (one per process: the previous app's is freed
    first), through a holder that loads a ServedLlama (the stock one hard-codes ``llama_cpp.Llama``)."""
    from llama_cpp.server.model import LlamaProxy

    from ..templates import ChatTemplate

    class MoELlamaProxy(LlamaProxy):
        def load_llama_from_model_settings(self, settings):
            llm = ServedLlama(settings.model, **llama_kwargs)
            llm.model_alias = served.model_id
            if served.n_parallel > 1 and not served.kv_unified:  # llama-server's slots: n_ctx / N each
                llm.n_ctx_slot = llm.n_ctx() // served.n_parallel
            try:
                tmpl = ChatTemplate(llm, name=chat_template, file=chat_template_file, default_jinja=True)
            except Error:
                llm.close()
                raise
            llm.chat_handler = tmpl.handler()  # (the model's own by Jinja renders as llama-cpp-python's, given tools)
            llm.chat_template = tmpl
            return llm

    if served.app_mod._llama_proxy is not None:
        served.app_mod._llama_proxy.free()
        served.app_mod._llama_proxy = None
    served.app_mod._llama_proxy = MoELlamaProxy(models=[model_settings])


class ServedLlama(Llama):
    """``pymoecache.Llama`` that puts each request's cache counters into its results as ``"moecache"``
    (the stock server calls these two methods, under its lock, for every completion and chat)."""

    def eval(self, tokens) -> None:
        gone = CLIENT_GONE.get()
        if gone is not None and gone.is_set():  # the client left: stop before the next token
            raise ClientGone()
        super().eval(tokens)

    model_alias: Optional[str] = None  # the id answers carry (the alias, or the file's name)
    n_ctx_slot: Optional[int] = None   # cells one request may use: n_ctx / -np N (llama-server's slots), None: all

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
        routing = REQUEST_ROUTING.get()
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
            _logprob_bytes(result)
            if before is not None:
                result["moecache"] = request_stats(before, self._stats())
            if restore is not None:
                restore()
            return result
        return self._stream_with_request_stats(before, result, restore)

    def _stream_with_request_stats(self, before, chunks, restore=None):
        try:
            for chunk in chunks:
                _logprob_bytes(chunk)
                if before is not None and any(c.get("finish_reason") for c in chunk.get("choices", [])):
                    chunk["moecache"] = request_stats(before, self._stats())
                yield chunk
        finally:
            if restore is not None:  # (the request's routing, until its last token)
                restore()


def _logprob_bytes(result: dict) -> None:
    """A chat answer's logprobs carry each token's UTF-8 bytes, as OpenAI's and llama-server's do (llama-cpp-python
    leaves them null)."""
    for choice in result.get("choices") or ():
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        for entry in (lp.get("content") or ()) if isinstance(lp, dict) else ():
            for e in [entry, *(entry.get("top_logprobs") or ())]:
                if isinstance(e, dict) and e.get("bytes") is None and isinstance(e.get("token"), str):
                    e["bytes"] = list(e["token"].encode("utf-8"))


async def authenticate(request: Request) -> None:
    """The API key, as llama-server checks it: 401 unless ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``
    carries one of the server's keys (a route dependency where there are keys)."""
    keys = request.app.state.served.api_keys()
    auth = request.headers.get("authorization", "")
    bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else None
    if keys and bearer not in keys and request.headers.get("x-api-key", "").strip() not in keys:
        raise HTTPException(401, "Invalid API key", headers={"WWW-Authenticate": "Bearer"})
