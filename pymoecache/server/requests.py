"""What a request to ``pymoecache serve`` must be: the checks every completion passes before the
model sees it, and the one error body of every status (OpenAI's ``{"error": {...}}``). Used by
completions.py (the OpenAI endpoints) and native.py (llama-server's); the server extras are
imported only inside the functions that answer.
"""

from __future__ import annotations

import json
import math
from typing import Optional

from ..grammar import JSON_GRAMMAR, json_schema_grammar
from ..stats import MoEStats

_MAX_BODY = 8 << 20          # bytes of one request body
MAX_PROMPTS = 64             # prompts of one /v1/completions request (each answered as its own choice)
_ROLES = ("system", "user", "assistant", "tool", "function", "developer")


# the error type of each status, as OpenAI and llama-server name them
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 499: "client_gone", 500: "server_error", 501: "not_supported_error",
                503: "unavailable_error"}


def slot_context(llm) -> int:
    """Cells one request may use: the context over the slots (-np N gives each n_ctx / N, as llama-server's), the
    whole context where the slots share it (-kvu) or there is one."""
    return getattr(llm, "n_ctx_slot", None) or llm.n_ctx()


def _too_long(what: str, n_prompt: int, max_tokens, n_ctx: int, llm) -> "RequestError":
    """The 400 of a request that cannot fit its slot, saying which context it is."""
    where = (f"its slot's context of {n_ctx} tokens (the context of {llm.n_ctx()} over the slots; serve -kvu shares "
             "it)" if n_ctx < llm.n_ctx() else f"the context of {n_ctx} tokens")
    return RequestError(f"{what} ({n_prompt} tokens) and max_tokens ({max_tokens}) exceed {where}", 400,
                        "messages" if what == "the messages" else "prompt")


def error_response(status: int, message: str, type: Optional[str] = None, param: Optional[str] = None,
                   headers: Optional[dict] = None):
    """Every error this server answers: OpenAI's ``{"error": {"message", "type", "param", "code"}}``, with
    llama-server's numeric ``code`` (the HTTP status)."""
    from fastapi.responses import JSONResponse

    kind = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


class RequestError(Exception):
    """A client error in a request body: status 400 (OpenAI's for every invalid parameter) and an OpenAI-style error object."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.param = status, param

    def response(self):
        return error_response(self.status, str(self), param=self.param)


def _field_error(errors: list) -> RequestError:
    """400 naming the first invalid field of a pydantic error list (the input is not echoed)."""
    first = errors[0] if errors else {}
    where = ".".join(str(x) for x in first.get("loc", ())) or "body"
    return RequestError(f"invalid field '{where}': {first.get('msg', 'invalid value')}", 400, where)


def check_grammar(llm, text, param: str = "grammar") -> None:
    """RequestError (400) unless ``text`` passes pymoecache.grammar.check_grammar, whose last
    check is llama.cpp's own parser (the sampler llama-cpp-python would build)."""
    from ..errors import GrammarError
    from ..grammar import check_grammar as check

    if not isinstance(text, str) or not text.strip():
        raise RequestError(f"'{param}' must be a non-empty GBNF grammar string", 400, param)
    try:
        check(text, llm._model.vocab)
    except GrammarError as e:
        raise RequestError(f"'{param}' " + str(e).removeprefix("grammar: "), 400, param) from None


def check_schema(schema, param: str) -> None:
    """RequestError (400) where a JSON schema would make a grammar larger than any grammar this server
    takes (pymoecache.grammar.check_schema_size: decided before anything is built)."""
    from ..errors import GrammarError
    from ..grammar import check_schema_size

    try:
        check_schema_size(schema)
    except GrammarError as e:
        raise RequestError(f"'{param}' " + str(e).removeprefix("schema: "), 400, param) from None


def schema_grammar(schema, param: str) -> str:
    """The GBNF grammar of a JSON schema (llama-cpp-python's converter, its strings as llama.cpp's: grammar.py;
    ``{}``: any JSON object, as llama-server reads it); RequestError (400) where the schema cannot be converted."""
    if not isinstance(schema, dict):
        raise RequestError(f"'{param}' must be a JSON schema object", 400, param)
    check_schema(schema, param)
    if not schema:
        return JSON_GRAMMAR
    try:
        return json_schema_grammar(schema)
    except Exception as e:  # the converter raises anything from KeyError to RecursionError
        raise RequestError(f"'{param}' cannot be turned into a grammar: {str(e)[:200]}", 400, param) from None


# sampling fields: (lowest, highest); NaN is out of every range (JSON parsers here accept NaN)
_SAMPLING_RANGES = {"temperature": (0.0, 1e6), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "typical_p": (0.0, 1.0),
                    "repeat_penalty": (0.0, 1e6), "presence_penalty": (-1e6, 1e6), "frequency_penalty": (-1e6, 1e6),
                    "mirostat_tau": (0.0, 1e6), "mirostat_eta": (0.0, 1e6),
                    "top_k": (-2**31, 2**31 - 1), "seed": (-1, 2**32 - 1)}  # (ctypes would wrap larger ones)


def _check_sampling(llm, body) -> None:
    """400 for what llama-cpp-python would silently misread: NaN or out-of-range sampling numbers,
    logit_bias ids that are not tokens of the model, more than one choice."""
    import math

    for name, (lo, hi) in _SAMPLING_RANGES.items():
        v = getattr(body, name, None)
        if v is not None and not lo <= v <= hi:
            raise RequestError(f"'{name}' must be a number in [{lo:g}, {hi:g}], got {str(v)[:40]}", 400, name)
    for name in ("n", "best_of"):
        v = getattr(body, name, None)
        if v is not None and v != 1:
            raise RequestError(f"'{name}' must be 1: this server answers one choice per request", 400, name)
    bias = getattr(body, "logit_bias", None) or {}
    if bias and getattr(body, "logit_bias_type", None) != "tokens":  # keys are token ids
        n_vocab = llm.n_vocab()
        for key, value in bias.items():
            try:
                tok = int(key)
            except ValueError:
                tok = -1
            if not 0 <= tok < n_vocab:
                raise RequestError(f"'logit_bias' key {key[:20]!r} is not a token id of this model (0 to {n_vocab - 1})",
                                   400, "logit_bias")
            if math.isnan(value):
                raise RequestError(f"'logit_bias' value for token {tok} is NaN", 400, "logit_bias")


def _check_logprobs(llm, d: dict, chat: bool) -> None:
    """400 for logprobs this server cannot answer (a 503 model_error before, which OpenAI clients retry)."""
    n_vocab = llm.n_vocab()
    name = "top_logprobs" if chat else "logprobs"
    n = d.get(name)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= n_vocab):
        raise RequestError(f"'{name}' must be an integer in [0, {n_vocab}] (the model's vocabulary), got {n!r}",
                           400, name)
    if not chat and n is not None and d.get("echo") and not llm._logits_all:
        raise RequestError("'logprobs' with 'echo' needs the logits of every prompt position, which this server "
                           "does not keep (a Llama made with logits_all=True does): ask without 'echo'", 400, "echo")


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", 400, "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise RequestError(f"messages[{i}] must be an object whose 'role' is one of {', '.join(_ROLES)}", 400,
                               "messages")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise RequestError(f"messages[{i}].content must be a string, a list of parts or null", 400, "messages")


def _include_usage(raw: bytes) -> bool:
    """OpenAI's ``stream_options.include_usage`` of a body validate_request has accepted."""
    opts = json.loads(raw).get("stream_options")
    return bool(isinstance(opts, dict) and opts.get("include_usage"))


class _NumberTooLarge(Exception):
    pass


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 19 and abs(int(text)) >= 2**63:  # (no field takes more than 64 bits)
        raise _NumberTooLarge(text)
    return int(text)


def _finite_float(text: str) -> float:
    v = float(text)
    if math.isinf(v):  # 1e400
        raise _NumberTooLarge(text)
    return v


def _constant(name: str) -> float:
    if name != "NaN":  # Infinity, -Infinity (not JSON; the parser here takes them): no field takes one
        raise _NumberTooLarge(name)
    return math.nan  # (NaN is out of every range: the field's own check answers 400)


def json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object of at most _MAX_BODY bytes; RequestError otherwise
    (also for a number no field can take: an integer beyond 64 bits, one beyond a float, Infinity)."""
    if not raw.strip():
        raise RequestError("the request body is empty: send a JSON object")
    if len(raw) > _MAX_BODY:
        raise RequestError(f"the request body is larger than {_MAX_BODY} bytes", 413)
    try:
        d = json.loads(raw, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_constant)
    except _NumberTooLarge as e:
        raise RequestError(f"the request holds a number no field takes: {str(e)[:40]}"
                           + ("..." if len(str(e)) > 40 else "") + " (infinite, or beyond 64 bits)") from None
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the request body is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(d, dict):
        raise RequestError("the request body must be a JSON object", 400)
    return d


def validate_request(llm, path: str, raw: bytes):
    """The stock request model for ``path`` built from ``raw``, after every check this server makes;
    RequestError (400) otherwise. Nothing here runs the model."""
    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
    from pydantic import ValidationError

    d = json_object(raw)
    d.pop("moecache", None)  # (this server's own field: request_routing reads it)
    request_routing(raw)
    chat = path.endswith("/chat/completions")
    if chat:
        _check_messages(d.get("messages"))
        for i, m in enumerate(d["messages"]):  # OpenAI's newer name of the system role; chat templates know "system"
            if m.get("role") == "developer":
                m["role"] = "system"
            if m["role"] == "system" and isinstance(m.get("content"), list):  # (text parts, as OpenAI takes them)
                parts = m["content"]
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in parts):
                    raise RequestError(f"messages[{i}].content: a system or developer message's parts must be text "
                                       "parts ({\"type\": \"text\", \"text\": ...})", 400, "messages")
                m["content"] = "\n".join(p["text"] for p in parts)
    elif "prompt" in d and not isinstance(d["prompt"], str) and not (
            isinstance(d["prompt"], list) and len(d["prompt"]) <= MAX_PROMPTS
            and all(isinstance(x, str) for x in d["prompt"])):
        raise RequestError(f"'prompt' must be a string or a list of at most {MAX_PROMPTS} strings (token ids are not "
                           "taken)", 400, "prompt")
    elif isinstance(d.get("prompt"), list) and len(d["prompt"]) > 1 and d.get("stream"):
        raise RequestError("a list of prompts is answered whole: send it without \"stream\", or stream each prompt "
                           "in a request of its own", 400, "stream")
    opts = d.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
        raise RequestError("'stream_options' must be an object such as {\"include_usage\": true} or null", 400,
                           "stream_options")
    if opts is not None and not d.get("stream"):
        raise RequestError("'stream_options' is only allowed with \"stream\": true", 400, "stream_options")
    n_ctx = slot_context(llm)
    # what current OpenAI SDKs send (max_completion_tokens) and llama-server's n_predict (-1: no limit)
    # are max_tokens by other names: one of them, or the same value in each
    given = {k: d.pop(k) for k in ("max_completion_tokens", "n_predict", "max_tokens") if d.get(k) is not None}
    if given.get("n_predict") == -1:
        given["n_predict"] = None
    if len({json.dumps(v) for v in given.values()}) > 1:
        raise RequestError(f"{' and '.join(sorted(given))} differ ({given}): give one limit", 400, sorted(given)[0])
    if given:
        d["max_tokens"] = next(iter(given.values()))
    mt = d.get("max_tokens")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= n_ctx):
        raise RequestError(f"'max_tokens' must be an integer in [1, {n_ctx}] (the context" + (
            " of a slot" if n_ctx < llm.n_ctx() else "") + f") or null, got {mt!r}", 400, "max_tokens")
    if chat:
        d["response_format"] = _response_format(d.get("response_format"))
        _check_tool_schemas(d)
    try:
        body = (CreateChatCompletionRequest if chat else CreateCompletionRequest)(**d)
    except ValidationError as e:
        raise _field_error(e.errors()) from None
    except (TypeError, ValueError, RecursionError) as e:
        raise RequestError(f"invalid request: {str(e)[:200]}", 400) from None
    _check_sampling(llm, body)
    _check_logprobs(llm, d, chat)
    if body.grammar is not None:
        check_grammar(llm, body.grammar)
    rf = d.get("response_format") if chat else None
    if isinstance(rf, dict) and rf.get("type") == "json_object":
        # the grammar is ours (llama-cpp-python's chat handlers would build theirs, whose strings take raw control
        # characters: invalid JSON); a request's own grammar beside it is refused
        grammar = JSON_GRAMMAR if rf.get("schema") is None else schema_grammar(rf["schema"], "response_format.schema")
        check_grammar(llm, grammar, "response_format.schema")
        if body.grammar is not None:
            raise RequestError("give 'response_format' or 'grammar', not both", 400, "grammar")
        body.grammar, body.response_format = grammar, None
    if not chat:
        prompts = [body.prompt] if isinstance(body.prompt, str) else (body.prompt or [""])
        longest = 0
        for i, prompt in enumerate(prompts):
            n_prompt = len(llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False))
            longest = max(longest, n_prompt)
            if n_prompt + (body.max_tokens or 1) > n_ctx:
                raise _too_long(f"the prompt[{i}]" if len(prompts) > 1 else "the prompt", n_prompt, body.max_tokens,
                                n_ctx, llm)
    elif n_ctx < llm.n_ctx():  # a slot's context: the rendered messages must fit it with max_tokens
        try:
            longest = len(llm.chat_template.tokens([dict(m) for m in d["messages"]], d.get("tools")))
        except Exception:  # (what the template cannot render here is the chat handler's to refuse, later)
            longest = 0
        if longest + (body.max_tokens or 1) > n_ctx:
            raise _too_long("the messages", longest, body.max_tokens, n_ctx, llm)
    if n_ctx < llm.n_ctx() and not body.max_tokens:  # no limit: until the slot is full, then "length"
        body.max_tokens = max(1, n_ctx - longest)
    return body


def _check_tool_schemas(d: dict) -> None:
    """The parameters of every tool and function a chat request names, bounded as a schema is: llama-cpp-python
    builds a grammar from the chosen one's."""
    for field in ("tools", "functions"):
        items = d.get(field)
        for i, t in enumerate(items if isinstance(items, list) else ()):
            f = t.get("function") if isinstance(t, dict) and field == "tools" else t
            params = f.get("parameters") if isinstance(f, dict) else None
            if params is not None:
                check_schema(params, f"{field}[{i}]" + (".function" if field == "tools" else "") + ".parameters")


def _response_format(rf):
    """OpenAI's ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (and llama-server's
    ``{"type": "json_schema", "schema": ...}``) as llama-cpp-python's ``{"type": "json_object", "schema": ...}``:
    the answer constrained by a grammar made from the schema, as llama-server does.

    >>> _response_format({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string"}}})
    {'type': 'json_object', 'schema': {'type': 'string'}}
    """
    if not isinstance(rf, dict) or rf.get("type") != "json_schema":
        return rf
    wrapper = rf.get("json_schema")
    if wrapper is not None and not isinstance(wrapper, dict):
        raise RequestError("'response_format.json_schema' must be an object such as {\"name\": ..., \"schema\": "
                           "{...}}", 400, "response_format")
    if wrapper is None and rf.get("schema") is None:
        raise RequestError("'response_format' of type json_schema needs its schema: {\"type\": \"json_schema\", "
                           "\"json_schema\": {\"name\": ..., \"schema\": {...}}}", 400, "response_format")
    schema = (wrapper or {}).get("schema", rf.get("schema", {}))
    if not isinstance(schema, dict):
        raise RequestError("'response_format.json_schema.schema' must be a JSON schema object", 400, "response_format")
    return {"type": "json_object", "schema": schema or {"type": "object"}}


def request_routing(raw: bytes):
    """The routing a request asks for in its own ``"moecache": {"routing": SPEC}`` (None: the server's):
    a spec as ``--routing`` takes, but a preset (which also sets the shared cache's eviction).
    RequestError (400) otherwise.

    >>> request_routing(b'{"prompt": "x", "moecache": {"routing": "lru"}}').spec()
    'lru'
    >>> request_routing(b'{"prompt": "x"}') is None
    True
    """
    from ..config import ConfigError, Preset, parse_routing

    try:
        d = json.loads(raw or b"{}")
    except ValueError:
        return None  # (json_object says why)
    opt = d.get("moecache") if isinstance(d, dict) else None
    if opt is None:
        return None
    if not isinstance(opt, dict) or set(opt) - {"routing"} or not isinstance(opt.get("routing"), str):
        raise RequestError("'moecache' must be an object such as {\"routing\": \"lru\"}", 400, "moecache")
    try:
        routing = parse_routing(opt["routing"])
    except ConfigError as e:
        raise RequestError(f"'moecache.routing': {e}", 400, "moecache.routing") from None
    if isinstance(routing, Preset):
        raise RequestError("'moecache.routing': a preset also sets the eviction of the cache every request shares; "
                           "give a routing (lru, prior:0.1:j=1, ...)", 400, "moecache.routing")
    return routing


def request_stats(before: MoEStats, after: MoEStats) -> dict:
    """Cache counters between two snapshots of the same cache (one request's share).

    >>> st = MoEStats.from_rows([(0, 2, 2, 10, 40, 30, 10, 8, 0, 0, 1.0)], n_expert=8, n_expert_used=4)
    >>> request_stats(st, st)["tokens"]
    0
    """

    d = after.since(before).summary_dict()
    return {k: d[k] for k in ("tokens", "hits", "misses", "hit_rate", "miss_rate", "misses_per_token",
                              "bytes_loaded", "rerouted", "rerouted_per_token", "p_given_up")}
