"""llama-server's slot files on ``pymoecache serve --slot-save-path DIR``: ``POST /slots/{id}?action=save``
writes the conversation a slot holds (its tokens and llama.cpp's KV cache) to ``DIR/FILENAME``,
``action=restore`` reads one back, ``action=erase`` empties the slot.

With one slot (-np 1) the context holds one conversation, the last request's, and its file holds the whole
context. With -np N > 1 the slots are the sequences of one KV cache, decoded together (batch.py): a
slot's file holds that slot's sequence, and a restore puts it in the slot named. A restored conversation
continues without being prefilled again: the next request whose prompt begins with it decodes only what
follows (its ``timings.prompt_n``), and its history reads no expert. The files are pymoecache.kv's state
files, written whole or not at all; one that is not of this model, context and kind of slot, or is truncated
or damaged, is refused with the reason (400) before llama.cpp reads it. Bodies and answers are llama-server's (tools/server/README.md of the pinned llama.cpp).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..kv import adopt_conversation, empty_context
from .requests import RequestError, json_object

# a slot file's name, in bytes: the longest that leaves room for its temporary's suffix (.NAME.tmp.PID.RANDOM)
MAX_NAME = 200


def _filename(d: dict) -> str:
    """The request's ``filename``: a plain name in the slot directory (llama-server's rule: no path)."""
    name = d.get("filename")
    if not isinstance(name, str) or not name.strip():
        raise RequestError("'filename' must be a file name, e.g. \"conversation.bin\"", 400, "filename")
    try:
        n_bytes = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # (a lone surrogate: no file system name)
        n_bytes = -1
    if (name in (".", "..") or "/" in name or "\\" in name or "\0" in name or name != name.strip()
            or not 0 < n_bytes <= MAX_NAME or name.startswith(".")):
        raise RequestError(f"'filename' {name[:60]!r} is not a plain file name of the slot directory (no path, no "
                           f"leading dot, UTF-8, at most {MAX_NAME} bytes)", 400, "filename")
    return name


def handle(llm, directory: "str | None", n_slots: int, id_slot: int, action: str, raw: bytes, batch=None) -> dict:
    """One slot action on ``llm`` (the caller holds the model's lock); RequestError otherwise. ``batch``: the
    server's BatchServer (-np N > 1), whose slots are sequences of the one KV cache: each saved, restored
    and erased on its own (pymoecache.kv's state files of one sequence)."""
    if directory is None:
        raise RequestError("slot save and restore are off: start serve with --slot-save-path DIR", 501)
    if not 0 <= id_slot < n_slots:
        raise RequestError(f"slot {id_slot} does not exist: this server has slots 0 to {n_slots - 1} (-np)", 400,
                           "id_slot")
    if batch is not None:
        batch.own_context()
    if action == "erase":
        if batch is not None:
            n = len(batch.dec.kept(id_slot))
            batch.dec.set_kept(id_slot, [])
            return {"id_slot": id_slot, "n_erased": n}
        n = llm.n_tokens
        empty_context(llm)
        return {"id_slot": id_slot, "n_erased": n}
    if action not in ("save", "restore"):
        raise RequestError(f"unknown action {action!r}: save, restore or erase", 400, "action")
    d = json_object(raw)
    name = _filename(d)
    path = Path(directory) / name
    return (save if action == "save" else restore)(llm, path, id_slot, batch)


def save(llm, path: Path, id_slot: int, batch=None) -> dict:
    """The slot's conversation to ``path``, whole or not at all (pymoecache.kv's state file): the
    context's, or with ``batch`` the slot's sequence."""
    from ..errors import StateFileError
    from ..kv import save_file

    held = llm.input_ids[:llm.n_tokens].tolist() if batch is None else batch.dec.kept(id_slot)
    t0 = time.perf_counter()
    try:
        n_written = save_file(llm, path, held, None if batch is None else id_slot, "slot file")
    except StateFileError as e:
        raise RequestError(str(e).replace(str(path.parent) + os.sep, ""), 400, "filename") from None
    return {"id_slot": id_slot, "filename": path.name, "n_saved": len(held), "n_written": n_written,
            "timings": {"save_ms": 1e3 * (time.perf_counter() - t0)}}


def restore(llm, path: Path, id_slot: int, batch=None) -> dict:
    """A conversation from ``path`` into the slot: the whole context (-np 1), or with ``batch`` the slot's
    sequence. A request whose prompt begins with it then decodes only the rest. A file that is not one of
    this model, context and kind of slot is refused (400) before anything is loaded; one llama.cpp refuses
    leaves the slot empty."""
    from ..errors import StateFileError
    from ..kv import load_file

    t0 = time.perf_counter()
    seq_id = None if batch is None else id_slot
    try:
        if batch is not None:
            batch.dec.set_kept(id_slot, [])
        tokens = load_file(llm, path, seq_id)
    except FileNotFoundError:
        raise RequestError(f"no slot file {path.name} in the slot directory", 404, "filename") from None
    except StateFileError as e:
        if batch is None:
            empty_context(llm)  # (a load llama.cpp refused halfway is not a conversation)
        else:
            batch.dec.set_kept(id_slot, [])
        raise RequestError(f"{e}: the slot is now empty", 400, "filename") from None
    if batch is None:
        adopt_conversation(llm, tokens)
    else:
        batch.dec.set_kept(id_slot, tokens, in_cache=True)
    return {"id_slot": id_slot, "filename": path.name, "n_restored": len(tokens), "n_read": path.stat().st_size,
            "timings": {"restore_ms": 1e3 * (time.perf_counter() - t0)}}


async def slot_action(id_slot, request, action=""):
    """POST /slots/{id_slot}?action=save|restore|erase, under the model's lock, on a worker thread."""
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    served = request.app.state.served
    try:
        raw = await request.body()
        try:
            slot = int(id_slot)
        except ValueError:
            raise RequestError(f"slot id {id_slot[:20]!r} is not a number", 400, "id_slot") from None
        async with served.model_lock() as lp:
            return JSONResponse(await run_in_threadpool(handle, lp(), served.slot_dir, served.n_parallel, slot,
                                                        action, raw, served.batch))
    except RequestError as e:
        return e.response()


def add_routes(router, served) -> None:
    """POST /slots/{id_slot} (llama-server's slot actions)."""
    from fastapi import Request

    slot_action.__annotations__ = {"id_slot": str, "request": Request, "action": str}  # (real classes)
    router.add_api_route("/slots/{id_slot}", slot_action, methods=["POST"], tags=["llama-server"],
                         dependencies=served.auth,
                         summary="Save, restore or erase a slot's conversation (llama-server's slot actions; serve "
                                 "--slot-save-path DIR)")
