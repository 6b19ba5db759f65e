"""The completion routes: the OpenAI ones (``/v1/completions``, ``/v1/chat/completions``) and llama-server's
``/completion``, each behind the request checks, the queue and the disconnect watch. A request runs one of
three ways: in the batch (``-np N`` > 1, plain sampling: server.batch), streamed (the generation runs while
the response is sent) or answered whole (llama_cpp.server's endpoint, on our ServedLlama).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from ..errors import ConfigError, Error
from . import batch as server_batch
from . import native as server_native
from . import tools as server_tools
from .model import CLIENT_GONE, REQUEST_ROUTING, ClientGone, _log
from .requests import (RequestError, _include_usage, error_response, json_object, request_routing, slot_context,
                       validate_request)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/engines/copilot-codex/completions")


async def watch_disconnect(request, gone: threading.Event) -> None:
    while not gone.is_set():
        if await request.is_disconnected():
            gone.set()
            return
        await asyncio.sleep(0.2)


class StopWhenGone(Response):
    """Wraps a streamed response: while it is sent, the generation behind it sees ``gone``
    (through CLIENT_GONE), set when the client disconnects or the response ends for any reason,
    so the decoding thread stops at its next token and llama_cpp.server's lock is released."""

    def __init__(self, response, request, gone: threading.Event, routing=None, on_end=None):
        super().__init__()
        self.response, self.request, self.gone, self.routing = response, request, gone, routing
        self.on_end = on_end  # (a batched stream: its sequence, cancelled however the stream ends)
        self.queue = request.app.state.served.queue
        self.queue.active += 1  # the request keeps its place until its stream ends

    async def __call__(self, scope, receive, send):
        reset = CLIENT_GONE.set(self.gone)
        reset_routing = REQUEST_ROUTING.set(self.routing)
        watcher = asyncio.create_task(watch_disconnect(self.request, self.gone))
        try:
            await self.response(scope, receive, send)
        except ClientGone:  # the generation stopped because the client left: nobody to answer
            _log.info("client of %s disconnected: generation stopped", self.request.url.path)
        except Error as e:  # mid-stream, after the status was sent: the stream ends without [DONE]
            _log.error("streamed request to %s stopped: %s", self.request.url.path, e)
        finally:
            self.queue.active -= 1
            self.gone.set()
            if self.on_end is not None:
                self.on_end()
            watcher.cancel()
            CLIENT_GONE.reset(reset)
            REQUEST_ROUTING.reset(reset_routing)


def stream_response(request, body, raw):
    """The stock streaming branch of both completion endpoints (an SSE stream fed by
    llama_cpp.server's publisher), through our completion so that the last chunk carries the
    "moecache" counters, and with OpenAI's ``stream_options.include_usage``: one more chunk,
    without choices, with the request's ``usage``."""
    import anyio
    import llama_cpp
    from sse_starlette.sse import EventSourceResponse

    app_mod = request.app.state.served.app_mod
    include_usage = _include_usage(raw)
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


def _stops(body) -> list:
    """A request's stop strings as a list (OpenAI takes one string or a list)."""
    return body.stop if isinstance(body.stop, list) else [body.stop] if isinstance(body.stop, str) else []


async def batched(request, body, raw, chat: bool, gone: threading.Event):
    """A request the batch serves (server.batch): it joins the running batch at the next step."""
    from sse_starlette.sse import EventSourceResponse

    served = request.app.state.served
    batch, llm = served.batch, served.llm()
    if chat:
        prompt = llm.chat_template.tokens([dict(m) for m in body.messages])
    else:
        prompt = server_batch.completion_tokens(llm, body.prompt if isinstance(body.prompt, str)
                                                else (body.prompt[0] if body.prompt else ""))
    if len(prompt) >= slot_context(llm):
        raise RequestError(f"the prompt ({len(prompt)} tokens) does not fit the context of {slot_context(llm)} tokens",
                           400, "messages" if chat else "prompt")
    stop = _stops(body)
    req = batch.submit(prompt, body, stop, stream=bool(body.stream))
    if body.stream:
        events = server_batch.chunks(batch, req, chat, _include_usage(raw), gone)
        return StopWhenGone(EventSourceResponse(events, sep="\n",
                                                ping_message_factory=served.app_mod._ping_message_factory),
                            request, gone, on_end=req.seq.cancel)
    watcher = asyncio.create_task(watch_disconnect(request, gone))
    served.queue.active += 1
    try:
        await server_batch.wait(req, gone)
    finally:
        served.queue.active -= 1
        watcher.cancel()
    if gone.is_set():
        raise ClientGone()
    return JSONResponse(server_batch.answer(batch, req, chat))


async def each_prompt(request, body, raw, endpoint, gone: threading.Event):
    """A list of prompts (OpenAI's /v1/completions): each prompt's answer is a choice, ``index`` its place in the
    list, usage summed. With -np N they join the batch together; else they run one after another."""
    served = request.app.state.served
    bodies = [body.model_copy(update={"prompt": p}) for p in body.prompt]
    answers = []
    if served.batch is not None and server_batch.batchable(bodies[0], False, raw):
        batch = served.batch
        stop = _stops(body)
        reqs = [batch.submit(server_batch.completion_tokens(served.llm(), b.prompt), b, stop, stream=False)
                for b in bodies]
        served.queue.active += 1
        watcher = asyncio.create_task(watch_disconnect(request, gone))
        try:
            for req in reqs:
                await server_batch.wait(req, gone)
        finally:
            served.queue.active -= 1
            watcher.cancel()
            for req in reqs:
                req.seq.cancel()
        if gone.is_set():
            raise ClientGone()
        answers = [server_batch.answer(batch, req, False) for req in reqs]
    else:
        served.queue.active += 1
        try:
            for b in bodies:
                a = await endpoint(request=request, body=b)
                answers.append(json.loads(a.body) if isinstance(a, Response) else a)
        finally:
            served.queue.active -= 1
    out = dict(answers[0])
    out["choices"] = [dict(a["choices"][0], index=i) for i, a in enumerate(answers)]
    usages = [a.get("usage") or {} for a in answers]
    out["usage"] = {k: sum(u.get(k, 0) for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return JSONResponse(out)


def checked(endpoint, validate=validate_request, stream=stream_response):
    """A completion endpoint behind the checks, the queue and the disconnect watch; ``validate(llm,
    path, raw)`` builds its body, ``stream(request, body, raw)`` its streamed response."""
    from starlette.requests import ClientDisconnect

    async def handler(request: Request):
        served = request.app.state.served
        gone, watcher = threading.Event(), None
        reset = CLIENT_GONE.set(gone)
        reset_routing = None
        try:
            raw = await request.body()
            plan = None
            if validate is validate_request and request.url.path.endswith("/chat/completions"):
                plan = server_tools.plan_request(json_object(raw), server_tools.template_format(served.llm().chat_template))
                raw = json.dumps(plan.request).encode() if plan is not None else raw
            body = validate(served.llm(), request.url.path, raw)
            routing = request_routing(raw)
            reset_routing = REQUEST_ROUTING.set(routing)
            if served.queue.full():
                return served.queue.busy_response()
            served.llm()._check_file()  # a model file replaced or truncated since load: 503 now, not a broken stream
            chat = request.url.path.endswith("/chat/completions")
            if not chat and isinstance(getattr(body, "prompt", None), list) and len(body.prompt) > 1:
                return await each_prompt(request, body, raw, endpoint, gone)
            if (served.batch is not None and validate is validate_request
                    and server_batch.batchable(body, chat, raw)):
                return await batched(request, body, raw, chat, gone)
            if body.stream:  # the generation runs while the response is sent, after this handler
                return StopWhenGone(stream(request, body, raw), request, gone, routing)
            watcher = asyncio.create_task(watch_disconnect(request, gone))
            served.queue.active += 1
            try:
                result = await endpoint(request=request, body=body)
                return server_tools.answer(plan, result) if plan is not None and isinstance(result, dict) else result
            finally:
                served.queue.active -= 1
        except ClientDisconnect:  # the client hung up before its request was in: nothing was started
            _log.info("client of %s disconnected before its request arrived", request.url.path)
            return Response(status_code=499)
        except ClientGone:
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
            CLIENT_GONE.reset(reset)
            if reset_routing is not None:
                REQUEST_ROUTING.reset(reset_routing)
    return handler


_noted = []  # (llama-server's fields /completion takes and ignores: said once per process)


def validate_native(llm, path, raw):
    req = server_native.NativeCompletion(llm, raw)
    if req.ignored and not _noted:
        _noted.append(True)
        _log.info("/completion: %s accepted and ignored (the context always keeps the longest common prefix)",
                  ", ".join(req.ignored))
    return req


def native_stream(request, req, raw):
    import anyio
    from sse_starlette.sse import EventSourceResponse

    served = request.app.state.served

    async def publish(chan):
        async with served.model_lock() as lp:
            async with chan:
                async for piece in iterate_in_threadpool(server_native.generate(lp(), req)):
                    await chan.send(dict(data=json.dumps(piece)))

    send_chan, recv_chan = anyio.create_memory_object_stream(10)
    return EventSourceResponse(recv_chan, sep="\n", ping_message_factory=served.app_mod._ping_message_factory,
                               data_sender_callable=functools.partial(publish, send_chan))


async def native_completion(request, body):
    async with request.app.state.served.model_lock() as lp:
        return JSONResponse(await run_in_threadpool(server_native.complete, lp(), body))


def add_routes(router, served) -> None:
    """The OpenAI completion paths (the stock endpoints again, behind validate_request and without their
    response models, which would drop the "moecache" field) and llama-server's /completion."""
    app_mod = served.app_mod
    endpoints = (app_mod.create_completion, app_mod.create_chat_completion, app_mod.create_completion)
    for path, endpoint in zip(COMPLETION_PATHS, endpoints):
        router.add_api_route(path, checked(endpoint), methods=["POST"], response_model=None, include_in_schema=False,
                             dependencies=served.auth)
    for path in ("/completion", "/completions"):
        router.add_api_route(path, checked(native_completion, validate_native, native_stream), methods=["POST"],
                             response_model=None, summary="Completion (llama-server's /completion)",
                             tags=["llama-server"], dependencies=served.auth)
