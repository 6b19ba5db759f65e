"""llama-server's own endpoints on ``pymoecache serve``: ``POST /completion``, ``/tokenize``, ``/detokenize``.

Their request and response fields are llama-server's (tools/server/README.md of the pinned llama.cpp);
``create_app`` (app.py) routes them through the same API key, queue and model lock as the OpenAI
endpoints. Nothing here imports the server extras.

``/completion`` takes ``prompt`` (a string, token ids, a list mixing both, or a list of such prompts,
answered one after another), ``n_predict`` (-1: until the end of text or the context), ``stream``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repeat_penalty``, ``presence_penalty``,
``frequency_penalty``, ``seed``, ``stop``, ``grammar`` or ``json_schema``, ``n_probs``, ``return_tokens``;
``cache_prompt`` is accepted and has no effect (the context always reuses the longest common prefix, as
llama-cpp-python does). It answers ``index``, ``content``, ``tokens``, ``stop``, ``stop_type`` (eos, limit,
word), ``stopping_word``, ``tokens_predicted``, ``tokens_evaluated``, ``timings`` (llama.cpp's own prompt
and decode counters for this request), ``completion_probabilities`` with ``n_probs`` and our ``moecache``
(the request's cache counters); several prompts get a list of such objects.
"""

from __future__ import annotations

import codecs
import math
import time
from typing import Dict, Iterator, List

from .requests import RequestError, _check_messages, check_grammar, json_object, schema_grammar, slot_context

# llama-server's /completion defaults (tools/server/README.md)
_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
             "presence_penalty": 0.0, "frequency_penalty": 0.0}
_RANGES = {"temperature": (0.0, 1e6), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "repeat_penalty": (0.0, 1e6),
           "presence_penalty": (-1e6, 1e6), "frequency_penalty": (-1e6, 1e6)}
IGNORED = ("cache_prompt",)  # accepted, no effect (said once in the server's log)


def _token_ids(llm, v, field: str, limit: int = 0) -> List[int]:
    n_vocab = llm.n_vocab()
    if limit and isinstance(v, list) and len(v) > limit:
        raise RequestError(f"'{field}' holds {len(v)} ids, more than this server takes at once ({limit}: 4 times its "
                           f"context of {llm.n_ctx()} tokens)", 413, field)
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
        raise RequestError(f"'{field}' must be a list of token ids", 400, field)
    for t in v:
        if not 0 <= t < n_vocab:
            raise RequestError(f"'{field}' has {t}, which is not a token id of this model (0 to {n_vocab - 1})", 400,
                               field)
    return v


def _prompt_tokens(llm, prompt, field: str = "prompt") -> List[int]:
    """One prompt as llama-server takes it: a string, token ids, or a list mixing strings and ids (the
    strings tokenized in place, BOS before the first element when it is a string)."""
    if isinstance(prompt, str):
        return llm.tokenize(prompt.encode("utf-8", "surrogatepass"), add_bos=True, special=True)
    if not isinstance(prompt, list) or not all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))
                                               for x in prompt):
        raise RequestError(f"'{field}' must be a string, a list of token ids, or a list mixing strings and ids", 400,
                           "prompt")
    tokens: List[int] = []
    for i, x in enumerate(prompt):
        if isinstance(x, str):
            tokens += llm.tokenize(x.encode("utf-8", "surrogatepass"), add_bos=i == 0, special=True) if x else []
        else:
            tokens += _token_ids(llm, [x], field)
    return tokens


def _prompts(llm, prompt) -> List[List[int]]:
    """The prompts of a request: a list with no number in it is several prompts (llama-server's rule),
    anything else one."""
    if isinstance(prompt, list) and prompt and not any(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        if len(prompt) > _MAX_PROMPTS:
            raise RequestError(f"'prompt' holds {len(prompt)} prompts, more than this server takes at once "
                               f"({_MAX_PROMPTS})", 413, "prompt")
        return [_prompt_tokens(llm, p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt_tokens(llm, prompt)]


_MAX_PROMPTS = 64  # prompts of one request (answered one after another)


class NativeCompletion:
    """A checked ``/completion`` request: the prompts' tokens and the sampling settings."""

    def __init__(self, llm, raw: bytes):
        d = json_object(raw)
        self.ignored = [k for k in IGNORED if k in d]
        self.prompts = _prompts(llm, d.get("prompt", ""))
        for i, tokens in enumerate(self.prompts):
            if not tokens:
                raise RequestError("'prompt' is empty" if len(self.prompts) == 1 else f"prompt[{i}] is empty", 400,
                                   "prompt")
        self.tokens = self.prompts[0]
        n_ctx = slot_context(llm)
        n = d.get("n_predict", -1)
        if isinstance(n, bool) or not isinstance(n, int) or n < -1:
            raise RequestError(f"'n_predict' must be an integer >= -1 (-1: no limit), got {n!r}", 400, "n_predict")
        self.n_predicts = []
        for tokens in self.prompts:
            room = n_ctx - len(tokens)
            if room < 1:
                raise RequestError(f"the prompt ({len(tokens)} tokens) fills the context of {n_ctx} tokens", 400,
                                   "prompt")
            self.n_predicts.append(room if n == -1 else min(n, room))
        self.n_predict = self.n_predicts[0]
        self.sampling: Dict[str, float] = {}
        for name, default in _DEFAULTS.items():
            v = d.get(name, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and math.isnan(v)):
                raise RequestError(f"'{name}' must be a number, got {v!r}", 400, name)
            if isinstance(v, float) and math.isinf(v):
                raise RequestError(f"'{name}' must be a finite number, got {v}", 400, name)
            if name in _RANGES and not _RANGES[name][0] <= v <= _RANGES[name][1]:
                lo, hi = _RANGES[name]
                raise RequestError(f"'{name}' must be in [{lo:g}, {hi:g}], got {v}", 400, name)
            self.sampling[name] = v
        if not self.sampling["top_k"] == int(self.sampling["top_k"]) or not 0 <= self.sampling["top_k"] < 2**31:
            raise RequestError(f"'top_k' must be an integer >= 0, got {self.sampling['top_k']}", 400, "top_k")
        seed = d.get("seed", -1)
        if isinstance(seed, bool) or not isinstance(seed, int) or not -1 <= seed <= 2**32 - 1:
            raise RequestError(f"'seed' must be an integer in [-1, {2**32 - 1}] (-1: random), got {seed!r}", 400,
                               "seed")
        self.seed = seed
        stop = d.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError("'stop' must be a string or a list of strings", 400, "stop")
        self.stop = [s for s in stop if s]
        self.grammar = d.get("grammar") or None
        schema = d.get("json_schema")
        if schema is not None:
            if self.grammar is not None:
                raise RequestError("give 'json_schema' or 'grammar', not both", 400, "json_schema")
            self.grammar = schema_grammar(schema, "json_schema")
            check_grammar(llm, self.grammar, "json_schema")
        elif self.grammar is not None:
            check_grammar(llm, self.grammar)
        n_vocab = llm.n_vocab()
        self.n_probs = d.get("n_probs", 0)
        if isinstance(self.n_probs, bool) or not isinstance(self.n_probs, int) or not 0 <= self.n_probs <= n_vocab:
            raise RequestError(f"'n_probs' must be an integer in [0, {n_vocab}] (the model's vocabulary), got "
                               f"{self.n_probs!r}", 400, "n_probs")
        if d.get("post_sampling_probs", False) is not False:
            raise RequestError("'post_sampling_probs' is not supported here: n_probs gives each token's probabilities "
                               "from the model's logits (a softmax over the vocabulary), as llama-server does without it",
                               400, "post_sampling_probs")
        self.return_tokens = d.get("return_tokens", False)
        self.stream = d.get("stream", False)
        for name in ("return_tokens", "stream"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"'{name}' must be true or false", 400, name)


def _token_probs(llm, steps) -> List[dict]:
    """llama-server's ``completion_probabilities`` of sampled tokens: each token's log-probability under
    a softmax of the logits it was drawn from, and the top ``n_probs`` there (``steps``: StepLogprobs)."""
    def entry(tok, lp):
        b = llm.detokenize([tok], special=True)
        return {"id": tok, "token": b.decode("utf-8", "ignore"), "bytes": list(b), "logprob": lp}

    return [dict(entry(tok, lp), top_logprobs=[entry(i, v) for i, v in top]) for tok, lp, top in steps]


def generate(llm, req: NativeCompletion) -> Iterator[dict]:
    """The answer of a ``/completion`` request, as llama-server streams it: per prompt, ``{"index": i,
    "content": piece, "tokens": ids, "stop": false}`` per piece of text, then one ``"stop": true`` object
    with the totals. A piece that could begin a stop word is held back until it cannot; bytes of an
    unfinished UTF-8 character wait for the rest. Several prompts are answered one after another."""
    for i, tokens in enumerate(req.prompts):
        yield from _generate_one(llm, req, i, tokens, req.n_predicts[i])


def _generate_one(llm, req: NativeCompletion, index: int, prompt: List[int], n_predict: int) -> Iterator[dict]:
    import llama_cpp

    from ..logprobs import StepLogprobs, logits_row
    from .requests import request_stats

    if req.seed != -1:
        llm.set_seed(req.seed)
    grammar = llama_cpp.LlamaGrammar.from_string(req.grammar, verbose=False) if req.grammar else None
    stats0 = llm.moecache.stats() if llm.moecache is not None else None
    perf0 = llama_cpp.llama_perf_context(llm._ctx.ctx)
    llm._begin_request()
    vocab = llm._model.vocab
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text, sent, n, stop_type, word = "", 0, 0, "limit", ""
    ids: List[int] = []     # the generated tokens (a stop word's own are left out, as its text is)
    given = 0               # of ids (and probs), those already sent in a piece
    probs = StepLogprobs(req.n_probs) if req.n_probs > 0 else None
    s = req.sampling
    tokens = llm.generate(prompt, top_k=int(s["top_k"]), top_p=s["top_p"], min_p=s["min_p"], temp=s["temperature"],
                          repeat_penalty=s["repeat_penalty"], presence_penalty=s["presence_penalty"],
                          frequency_penalty=s["frequency_penalty"], grammar=grammar)
    hold = max((len(w) for w in req.stop), default=1) - 1

    def piece(content):
        nonlocal given
        out = {"index": index, "content": content, "tokens": ids[given:], "stop": False}
        if probs is not None:
            out["completion_probabilities"] = _token_probs(llm, probs.steps[given:len(ids)])
        given = len(ids)
        return out

    t0 = time.perf_counter()
    t1 = None  # when the first token was sampled: the prompt is evaluated by then
    for tok in tokens if n_predict > 0 else ():  # (n_predict 0: nothing to predict)
        t1 = t1 or time.perf_counter()
        if llama_cpp.llama_vocab_is_eog(vocab, tok):
            stop_type = "eos"
            break
        if probs is not None:
            probs.record(logits_row(llm), tok)
        n += 1
        ids.append(tok)
        text += decoder.decode(llm.detokenize([tok], special=False))
        # the earliest stop word (none can start in text already sent: the last `hold` characters wait)
        hits = [(i, w) for w in req.stop if (i := text.find(w, sent)) >= 0]
        if hits:
            i, word = min(hits)
            text, stop_type = text[:i], "word"
            ids = ids[:max(given, _tokens_within(llm, ids, given, len(text) - sent))]
            break
        if n >= n_predict:
            break
        safe = len(text) - hold if req.stop else len(text)
        if safe > sent:
            yield piece(text[sent:safe])
            sent = safe
    text += decoder.decode(b"", final=True) if stop_type != "word" else ""
    if len(text) > sent or len(ids) > given:
        yield piece(text[sent:])
    t2 = time.perf_counter()
    t1 = t1 or t2
    # llama-server's timings: the prompt's tokens llama.cpp evaluated (a prefix kept from the last request
    # is not) and the time to the first token; then the tokens predicted and the time they took
    p_n = llama_cpp.llama_perf_context(llm._ctx.ctx).n_p_eval - perf0.n_p_eval
    p_ms, e_n, e_ms = 1e3 * (t1 - t0), n, 1e3 * (t2 - t1)
    final = {
        "index": index, "content": "", "tokens": [], "stop": True,
        "model": getattr(llm, "model_alias", None) or llm.model_path,
        "tokens_predicted": n, "tokens_evaluated": len(prompt), "stop_type": stop_type, "stopping_word": word,
        "truncated": False, "generation_settings": {"n_predict": n_predict, "seed": req.seed, **req.sampling,
                                                    "stop": req.stop, "grammar": req.grammar or "",
                                                    "n_probs": req.n_probs},
        "timings": {"prompt_n": p_n, "prompt_ms": p_ms, "prompt_per_token_ms": p_ms / p_n if p_n else 0.0,
                    "prompt_per_second": 1e3 * p_n / p_ms if p_ms > 0 else 0.0,
                    "predicted_n": e_n, "predicted_ms": e_ms, "predicted_per_token_ms": e_ms / e_n if e_n else 0.0,
                    "predicted_per_second": 1e3 * e_n / e_ms if e_ms > 0 else 0.0},
    }
    if stats0 is not None:
        final["moecache"] = request_stats(stats0, llm.moecache.stats())
    yield final


def _tokens_within(llm, ids: List[int], start: int, n_chars: int) -> int:
    """How many of ``ids`` (from ``start``) have their text wholly within the next ``n_chars`` characters:
    the tokens of an answer cut before its stop word."""
    end, length = start, 0
    while end < len(ids):
        length += len(llm.detokenize([ids[end]], special=False).decode("utf-8", "replace"))
        if length > n_chars:
            break
        end += 1
    return end


def complete(llm, req: NativeCompletion):
    """The non-streamed answer: per prompt, the streamed pieces joined into the final object's ``content``
    (``tokens`` with ``return_tokens``, ``completion_probabilities`` with ``n_probs``); one object for one
    prompt, a list for several, as llama-server answers."""
    results, pieces = [], []
    for p in generate(llm, req):
        if not p["stop"]:
            pieces.append(p)
            continue
        p["content"] = "".join(x["content"] for x in pieces)
        p["tokens"] = [t for x in pieces for t in x["tokens"]] if req.return_tokens else []
        if req.n_probs > 0:
            p["completion_probabilities"] = [e for x in pieces for e in x["completion_probabilities"]]
        results.append(p)
        pieces = []
    return results[0] if len(results) == 1 else results


def _max_ids(llm) -> int:
    """Token ids a /detokenize (or pieces a /tokenize) answers at once: 4 times the context, as
    llama-server bounds what it takes by its context."""
    return 4 * max(llm.n_ctx(), 1024)


def tokenize(llm, raw: bytes) -> dict:
    """``POST /tokenize``: ``{"content", "add_special": false, "parse_special": true, "with_pieces": false}`` ->
    ``{"tokens": [ids]}``, or with pieces ``[{"id", "piece"}]`` (a piece that is not UTF-8 alone: its bytes)."""
    d = json_object(raw)
    content = d.get("content", "")
    if not isinstance(content, str):
        raise RequestError("'content' must be a string", 400, "content")
    flags = {}
    for name, default in (("add_special", False), ("parse_special", True), ("with_pieces", False)):
        flags[name] = d.get(name, default)
        if not isinstance(flags[name], bool):
            raise RequestError(f"'{name}' must be true or false", 400, name)
    ids = llm.tokenize(content.encode("utf-8", "surrogatepass"), add_bos=flags["add_special"],
                       special=flags["parse_special"]) if content else []
    if not flags["with_pieces"]:
        return {"tokens": ids}
    if len(ids) > _max_ids(llm):
        raise RequestError(f"with_pieces answers at most {_max_ids(llm)} tokens (4 times the context of {llm.n_ctx()}); "
                           f"this content has {len(ids)}: ask without with_pieces, or in parts", 413, "with_pieces")
    out = []
    for t in ids:
        b = llm.detokenize([t], special=True)
        try:
            out.append({"id": t, "piece": b.decode("utf-8")})
        except UnicodeDecodeError:
            out.append({"id": t, "piece": list(b)})
    return {"tokens": out}


def detokenize(llm, raw: bytes) -> dict:
    """``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"content": text}``; bytes that do not form UTF-8
    become U+FFFD, as llama-server's JSON writer replaces them."""
    d = json_object(raw)
    ids = _token_ids(llm, d.get("tokens", []), "tokens", _max_ids(llm))
    return {"content": llm.detokenize(ids, special=True).decode("utf-8", "replace") if ids else ""}


def apply_template(llm, raw: bytes) -> dict:
    """``POST /apply-template``: ``{"messages": [...], "tools": [...]}`` -> ``{"prompt": text}``, the conversation as the
    server's chat template renders it for a chat completion (the assistant's turn opened), as llama-server
    answers; nothing is generated."""
    from ..errors import ConfigError

    d = json_object(raw)
    _check_messages(d.get("messages"))
    messages = [dict(m, role="system") if m.get("role") == "developer" else m for m in d["messages"]]
    try:
        prompt, _ = llm.chat_template.render(messages, d.get("tools") if isinstance(d.get("tools"), list) else None)
    except ConfigError as e:
        raise RequestError(str(e), 400, "messages") from None
    return {"prompt": prompt}


def extras_detokenize(llm, raw: bytes) -> dict:
    """llama-cpp-python's /extras/detokenize: {"tokens"} -> {"text"}, ids checked, bytes replaced."""
    return {"text": detokenize(llm, raw)["content"]}


def _on_a_worker(fn):
    """A route answering ``fn(llm, body)`` on a worker thread (the event loop answers /health meanwhile)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    async def handler(request: Request):
        try:
            return JSONResponse(await run_in_threadpool(fn, request.app.state.served.llm(), await request.body()))
        except RequestError as e:
            return e.response()
    handler.__annotations__ = {"request": Request}  # (a real class: this module's annotations are strings)
    return handler


async def embeddings_refused(request):
    from .requests import error_response

    return error_response(501, "this server runs a generation model and does not compute embeddings "
                               f"({request.url.path}); llama-server answers the same without --embeddings",
                          headers={"x-should-retry": "false"})  # (the openai client would retry a 5xx)


def add_routes(router, served) -> None:
    """llama-server's /tokenize, /detokenize and /apply-template, llama-cpp-python's /extras/detokenize, and
    the embedding paths refused (501) as llama-server refuses them without --embeddings."""
    from fastapi import Request

    for path, fn, summary, tags in (
            ("/tokenize", tokenize, "Tokenize (llama-server's /tokenize)", ["llama-server"]),
            ("/detokenize", detokenize, "Detokenize (llama-server's /detokenize)", ["llama-server"]),
            ("/apply-template", apply_template, "The chat template applied (llama-server's /apply-template)",
             ["llama-server"]),
            ("/extras/detokenize", extras_detokenize, "Detokenize", ["Extras"])):
        router.add_api_route(path, _on_a_worker(fn), methods=["POST"], tags=tags, summary=summary,
                             dependencies=served.auth)
    embeddings_refused.__annotations__ = {"request": Request}
    for path in ("/v1/embeddings", "/embedding", "/embeddings"):
        router.add_api_route(path, embeddings_refused, methods=["POST"], include_in_schema=False,
                             dependencies=served.auth)
