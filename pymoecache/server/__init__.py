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
* ``n_parallel`` > 1: the slots decoded together (batch.py).
* completions queue: one generates, up to ``max_queue`` wait their turn (in order of arrival), a
  request past that gets 503 with ``Retry-After``. Nothing is cut: a streamed answer is not
  interrupted by the next request. A client that disconnects frees its place, and its generation
  stops at the next token.
* llama-server's own ``POST /completion`` (its fields, streamed or not, with ``timings`` and our
  ``moecache``), ``/tokenize`` and ``/detokenize`` (native.py); ``max_completion_tokens`` and
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

The package: app.py (``create_app``), model.py (the served Llama and what the routes share), completions.py
(the completion routes: queue, disconnect watch, streaming), info.py (/health, /props, /slots, /metrics,
/moecache/stats), native.py (llama-server's own endpoints), slots.py (slot files), batch.py (``-np N``),
requests.py (what a request must be, the one error body). The server extras (fastapi, uvicorn, sse-starlette,
starlette-context, pydantic-settings; see ``PIP_SERVER``) are imported when ``create_app`` is first reached,
after :func:`server_module` has checked them.
"""

from __future__ import annotations

import importlib.util

from ..errors import MissingDependencyError
from ..llama import Llama  # noqa: F401  (the class every served model is: pymoecache.server.Llama)

PIP_SERVER = ('pip install "fastapi>=0.100" "uvicorn>=0.22" "sse-starlette>=1.6.1" '
              '"starlette-context>=0.3.6,<0.4" "pydantic-settings>=2.0.1"')
_EXTRAS = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")

__all__ = ["create_app", "server_module", "PIP_SERVER", "Llama"]


def server_module():
    """``llama_cpp.server.app``, or a MissingDependencyError saying how to install what it needs."""
    missing = [m for m in _EXTRAS if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDependencyError(f"the server needs packages that are not installed ({', '.join(missing)}): {PIP_SERVER}")
    import llama_cpp.server.app as app_mod

    return app_mod


def __getattr__(name: str):
    """``create_app``, imported on first use: its modules import the server extras, which
    :func:`server_module` checks first (a MissingDependencyError saying how to install them)."""
    if name == "create_app":
        server_module()
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
