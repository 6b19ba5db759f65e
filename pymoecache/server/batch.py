"""``pymoecache serve -np N``: the slots decoded together (continuous batching).

One thread drives a :class:`pymoecache.BatchDecoder` on the served model: a completion or chat
completion joins the running batch at the next step (its prompt prefilled with any others that
arrived meanwhile) and leaves it when it ends, each with its own sampler, stop strings and stream.
While the batch runs the thread holds llama_cpp.server's model lock, so a request the batch does not
take (logprobs, a grammar or JSON schema, logit_bias, a routing of its own, echo, suffix, n > 1,
mirostat, tools) runs alone between batches, through the stock path, as with one slot.

The answers are those of the stock path for the same tokens: its sampler chain (the penalties over
the generated tokens, then greedy at temperature 0, else top-k, typical, top-p, min-p, temperature and
a seeded draw), its stop conditions (an end-of-generation token, ``max_tokens``, the context, the
first stop string, which is cut off) and its text (the completion's bytes after the prompt's, invalid
UTF-8 dropped). ``usage`` counts the prompt and the generated tokens; ``"moecache"`` holds the cache
counters while the request ran, shared with the sequences decoded beside it (``"batched": true``), and
its own tokens' share of the decode steps (``"sequence"``: hits and misses over the MoE layers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import threading
import time
import uuid
from typing import List, Optional

import llama_cpp

from .. import kv
from ..batch import BatchDecoder, Sequence
from .requests import request_routing, request_stats

_log = logging.getLogger("pymoecache.serve")
GATHER_S = 0.02  # how long the batch waits, from idle, for requests sent at the same time


def batchable(body, chat: bool, raw: bytes) -> bool:
    """Whether the batch serves this (validated) request: plain sampling, one choice, text out."""
    if request_routing(raw) is not None or getattr(body, "grammar", None) or body.logit_bias:
        return False
    if (body.n or 1) != 1 or body.mirostat_mode or (body.min_tokens or 0) > 0:
        return False
    if chat:
        rf = body.response_format
        rf_type = rf.get("type") if isinstance(rf, dict) else getattr(rf, "type", None)
        return not (body.logprobs or body.top_logprobs or body.tools or body.functions or body.tool_choice
                    or body.function_call or (rf is not None and rf_type not in (None, "text")))
    prompt = body.prompt if isinstance(body.prompt, str) else (body.prompt[0] if body.prompt else "")
    return not (body.logprobs is not None or body.echo or body.suffix or (body.best_of or 1) != 1 or not prompt)


def completion_tokens(llm, prompt: str) -> List[int]:
    """A completion's prompt as llama-cpp-python's create_completion tokenizes a string (no suffix): the
    model's BOS (or CLS) where it adds one, the text with special tokens parsed, its EOS (or SEP) where
    it adds one."""
    toks = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True) if prompt else []
    cls, sep = llm._model.token_cls(), llm._model.token_sep()
    bos = [cls if cls != -1 else llm.token_bos()] if llm._model.add_bos_token() else []
    eos = [sep if sep != -1 else llm.token_eos()] if llm._model.add_eos_token() or sep != -1 else []
    return [t for t in bos if t != -1] + toks + eos


def _utf8_prefix(b: bytes) -> int:
    """Length of the longest prefix of ``b`` that does not end inside a UTF-8 character."""
    n = len(b)
    for back in range(1, min(4, n) + 1):
        c = b[n - back]
        if c & 0xC0 != 0x80:  # the lead byte of the last character
            need = 1 if c < 0x80 else 2 if c >> 5 == 0b110 else 3 if c >> 4 == 0b1110 else 4 if c >> 3 == 0b11110 else 1
            return n if back >= need else n - back
    return n


class _Text:
    """A completion's text as its tokens come: the bytes after the prompt's, cut at the first stop
    string; ``delta()`` gives what may be sent now (never a part of a possible stop string, nor half a
    character)."""

    def __init__(self, llm, prompt: List[int], stop: List[str]):
        self.llm, self.prompt = llm, prompt
        self.stops = [s.encode("utf-8") for s in stop if s]
        self.tokens: List[int] = []
        self.all = b""
        self.sent = 0
        self.stopped = False

    def add(self, tok: int) -> None:
        if self.stopped or llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, tok):
            return
        self.tokens.append(tok)
        self.all = self.llm.detokenize(self.tokens, prev_tokens=self.prompt)
        hits = [self.all.index(s) for s in self.stops if s in self.all]
        if hits:
            self.all = self.all[:min(hits)]
            self.stopped = True

    def delta(self, final: bool) -> str:
        end = len(self.all)
        if not final and not self.stopped:  # hold back a tail a stop string may begin with
            for s in self.stops:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self.all.endswith(s[:k]):
                        end = min(end, len(self.all) - k)
                        break
            end = _utf8_prefix(self.all[:end])
        piece = self.all[self.sent:end]
        self.sent = max(self.sent, end)
        return piece.decode("utf-8", errors="ignore")

    def text(self) -> str:
        return self.all.decode("utf-8", errors="ignore")


class _Request:
    """One request in the batch: its sequence, its text, and how the engine thread reaches the event loop."""

    def __init__(self, loop, text: _Text, before, stream: bool):
        self.loop, self.text, self.before = loop, text, before
        self.queue: Optional[asyncio.Queue] = asyncio.Queue() if stream else None
        self.done = concurrent.futures.Future()
        self.seq: Optional[Sequence] = None
        self.error: Optional[BaseException] = None


class BatchServer:
    """The engine of ``serve -np N`` (see the module's doc). ``model_lock()`` is llama_cpp.server's
    dependency that holds its model lock (an async context manager); ``order``: BatchDecoder's (which running
    slots a step decodes: pymoecache/step_order.py)."""

    def __init__(self, llm, model_lock, model_id: str, order: str = "auto"):
        self.llm, self.model_lock, self.model_id = llm, model_lock, model_id
        self.dec = BatchDecoder(llm, order=order)
        self._cv = threading.Condition()
        self._requests: List[_Request] = []
        self._evals = llm.n_evals
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pymoecache-batch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # --- the event loop's side --------------------------------------------------------------
    def slots(self) -> list:
        """(state, sequence) per slot: generating or idle."""
        busy = {s.slot: s for s in self.dec.running}
        return [busy.get(i) for i in range(self.dec.n_slots)]

    def submit(self, prompt: List[int], body, stop: List[str], stream: bool) -> _Request:
        loop = asyncio.get_running_loop()
        st = self.llm.moecache.stats() if self.llm.moecache is not None else None
        req = _Request(loop, _Text(self.llm, prompt, stop), st, stream)
        temp = float(body.temperature)
        seed = body.seed if body.seed is not None else random.randrange(2**32)

        def on_token(seq, tok):
            req.text.add(tok)
            if req.text.stopped and not seq._cancel:
                seq.cancel()  # (a stop string: it ends here)
            if req.queue is not None:
                piece = req.text.delta(False)
                if piece:
                    loop.call_soon_threadsafe(req.queue.put_nowait, ("text", piece))

        max_tokens = body.max_tokens if body.max_tokens else self.llm.n_ctx() - len(prompt)
        req.seq = self.dec.add(prompt, max_tokens=max(1, max_tokens), temperature=temp, top_k=body.top_k,
                               top_p=body.top_p, min_p=body.min_p, seed=seed, on_token=on_token,
                               penalties=(float(body.repeat_penalty), float(body.frequency_penalty),
                                          float(body.presence_penalty)))
        with self._cv:
            self._requests.append(req)
            self._cv.notify_all()
        return req

    # --- the engine thread ------------------------------------------------------------------
    def _finish(self, req: _Request) -> None:
        if req.queue is not None:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, ("end", None))
        if not req.done.done():
            req.done.set_result(None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and self.dec.idle():
                    self._cv.wait()
                if self._stopped:
                    return
                loop = self._requests[0].loop if self._requests else None
            if loop is None:  # (sequences without a request: none in a server)
                continue
            # from idle: requests sent together arrive a few milliseconds apart; a short wait lets them be
            # prefilled together (their prompts read each expert once), not the first alone
            time.sleep(GATHER_S)
            release = threading.Event()
            held = threading.Event()

            async def hold():
                async with contextlib.asynccontextmanager(self.model_lock)():
                    held.set()
                    while not release.is_set():
                        await asyncio.sleep(0.005)

            fut = asyncio.run_coroutine_threadsafe(hold(), loop)
            held.wait()
            try:
                self._batch()
            finally:
                release.set()
                with contextlib.suppress(Exception):
                    fut.result(timeout=10)

    def own_context(self) -> None:
        """With the model lock held: where a request outside the batch used the context since the batch
        last did (slot 0 and more), what the free slots kept is gone; so is, after, that request's
        conversation (the Llama's own, in slot 0)."""
        if self.llm.n_evals != self._evals:
            self.dec.forget()
            kv.forget_conversation(self.llm)
            self._evals = self.llm.n_evals

    def _batch(self) -> None:
        """Steps while there is anything to decode; the model lock is held."""
        self.own_context()
        try:
            while True:
                with self._cv:
                    if self.dec.idle() or self._stopped:
                        break
                try:
                    self.dec.step()
                except Exception as e:  # a failed read, a changed model file: every request in the batch fails
                    _log.error("batched decode failed: %s", e)
                    with self._cv:
                        for req in self._requests:
                            req.error = e
                            req.seq.cancel()
                    self.dec.forget()
                self._reap()
        finally:
            kv.forget_conversation(self.llm)  # slot 0 held a batch's sequence: the Llama's own conversation is gone
            self._evals = self.llm.n_evals
            self._reap()

    def _reap(self) -> None:
        with self._cv:
            done = [r for r in self._requests if r.seq.done]
            self._requests = [r for r in self._requests if not r.seq.done]
        for req in done:
            if req.queue is not None:
                piece = req.text.delta(True)
                if piece:
                    req.loop.call_soon_threadsafe(req.queue.put_nowait, ("text", piece))
            self._finish(req)


def _finish_reason(req: _Request) -> str:
    s = req.seq
    if req.text.stopped or s.finish_reason == "stop":
        return "stop"
    return "length" if s.finish_reason == "length" else "stop"


def usage(req: _Request) -> dict:
    n_prompt = len(req.seq.prompt)
    eog = [t for t in req.seq.tokens if llama_cpp.llama_vocab_is_eog(req.text.llm._model.vocab, t)]
    n_completion = len(req.seq.tokens) - len(eog)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def moecache_field(server: BatchServer, req: _Request) -> Optional[dict]:
    if req.before is None:
        return None
    d = request_stats(req.before, server.llm.moecache.stats())
    d["batched"] = True  # (the counters of the batch while this request ran: shared with the others)
    s = req.seq  # and this request's own share of the decode steps: its tokens' hits and misses over the layers
    d["sequence"] = {"decoded_tokens": max(0, len(s.tokens) - 1), "hits": s.hits, "misses": s.misses}
    return d


async def wait(req: _Request, gone: threading.Event) -> None:
    """Until the request's sequence ends; a client that left cancels it."""
    while not req.done.done():
        if gone.is_set():
            req.seq.cancel()
        await asyncio.sleep(0.01)
    if req.error is not None:
        raise req.error


def answer(server: BatchServer, req: _Request, chat: bool) -> dict:
    created = int(time.time())
    text = req.text.text()
    reason = _finish_reason(req)
    if chat:
        out = {"id": f"chatcmpl-{uuid.uuid4()}", "object": "chat.completion", "created": created,
               "model": server.model_id, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                      "logprobs": None, "finish_reason": reason}]}
    else:
        out = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": created,
               "model": server.model_id, "choices": [{"text": text, "index": 0, "logprobs": None,
                                                      "finish_reason": reason}]}
    out["usage"] = usage(req)
    m = moecache_field(server, req)
    if m is not None:
        out["moecache"] = m
    return out


async def chunks(server: BatchServer, req: _Request, chat: bool, include_usage: bool, gone: threading.Event):
    """The SSE events of a streamed answer, as the stock path sends them."""
    import json

    created = int(time.time())
    cid = f"chatcmpl-{uuid.uuid4()}" if chat else f"cmpl-{uuid.uuid4()}"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: Optional[str], reason: Optional[str], first: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant"} if first else ({"content": piece} if piece is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"text": piece or "", "index": 0, "logprobs": None, "finish_reason": reason}
        return {"id": cid, "object": obj, "created": created, "model": server.model_id, "choices": [choice]}

    if chat:
        yield {"data": json.dumps(chunk(None, None, first=True))}
    while True:
        try:
            kind, piece = await asyncio.wait_for(req.queue.get(), timeout=0.2)
        except asyncio.TimeoutError:
            if gone.is_set():
                req.seq.cancel()
            continue
        if kind == "end":
            break
        if gone.is_set():  # (the client left: its sequence ends at the next step)
            req.seq.cancel()
        yield {"data": json.dumps(chunk(piece, None))}
    if req.error is not None:
        raise req.error
    last = chunk(None if chat else "", _finish_reason(req))
    m = moecache_field(server, req)
    if m is not None:
        last["moecache"] = m
    yield {"data": json.dumps(last)}
    if include_usage:
        yield {"data": json.dumps({"id": cid, "object": obj, "created": created, "model": server.model_id,
                                   "choices": [], "usage": usage(req)})}
    yield {"data": "[DONE]"}
