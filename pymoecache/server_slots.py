"""llama-server's slot files on ``pymoecache serve --slot-save-path DIR``: ``POST /slots/{id}?action=save``
writes the conversation a slot holds (its tokens and llama.cpp's KV cache) to ``DIR/FILENAME``,
``action=restore`` reads one back, ``action=erase`` empties the slot.

With one slot (-np 1) the context holds one conversation, the last request's, and its file is llama.cpp's
session file (``llama_state_save_file``). With -np N > 1 the slots are the sequences of one KV cache, decoded
together (server_batch.py): a slot's file is llama.cpp's sequence state file (``llama_state_seq_save_file``)
of what that slot holds, and a restore puts it in the slot named. A restored conversation continues without being
prefilled again: the next request whose prompt begins with it decodes only what follows (its
``timings.prompt_n``), and its history reads no expert. The files are llama.cpp's session files
(``llama_state_save_file``), written whole or not at all; a file that is not one of this model and
context is refused with the reason (400), and the context is then emptied rather than left half
restored. Bodies and answers are llama-server's (tools/server/README.md of the pinned llama.cpp).
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

from .prompt_cache import adopt_conversation, empty_context
from .server_requests import RequestError, json_object

_SESSION_MAGIC = 0x6767736E  # 'ggsn', llama.cpp's LLAMA_SESSION_MAGIC
_SEQ_MAGIC = 0x67677371      # 'ggsq', llama.cpp's LLAMA_STATE_SEQ_MAGIC: one sequence's state (-np N > 1)


def _filename(d: dict) -> str:
    """The request's ``filename``: a plain name in the slot directory (llama-server's rule: no path)."""
    name = d.get("filename")
    if not isinstance(name, str) or not name.strip():
        raise RequestError("'filename' must be a file name, e.g. \"conversation.bin\"", 400, "filename")
    if (name in (".", "..") or "/" in name or "\\" in name or "\0" in name or name != name.strip()
            or len(name.encode("utf-8", "surrogatepass")) > 255 or name.startswith(".")):
        raise RequestError(f"'filename' {name[:60]!r} is not a plain file name of the slot directory (no path, no "
                           "leading dot, at most 255 bytes)", 400, "filename")
    return name


def handle(llm, directory: "str | None", n_slots: int, id_slot: int, action: str, raw: bytes, batch=None) -> dict:
    """One slot action on ``llm`` (the caller holds the model's lock); RequestError otherwise. ``batch``: the
    server's BatchServer (-np N > 1), whose slots are sequences of the one KV cache: each saved, restored
    and erased on its own (llama.cpp's sequence state files)."""
    if directory is None:
        raise RequestError("slot save and restore are off: start serve with --slot-save-path DIR", 501)
    if not 0 <= id_slot < n_slots:
        raise RequestError(f"slot {id_slot} does not exist: this server has slots 0 to {n_slots - 1} (-np)", 400,
                           "id_slot")
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
    if batch is not None:
        return save(llm, path, id_slot, batch) if action == "save" else restore_seq(llm, batch, path, id_slot)
    return (save if action == "save" else restore)(llm, path, id_slot)


def save(llm, path: Path, id_slot: int, batch=None) -> dict:
    """The slot's conversation to ``path``, atomically (written beside, then renamed): the context's
    (a session file), or with ``batch`` the slot's sequence (a sequence state file)."""
    import llama_cpp

    from .errors import StateFileError
    from .files import writable_target

    try:
        target = writable_target(path, "slot file", StateFileError)
    except StateFileError as e:
        raise RequestError(str(e), 400, "filename") from None
    held = llm.input_ids[:llm.n_tokens].tolist() if batch is None else batch.dec.kept(id_slot)
    n = len(held)
    tokens = (llama_cpp.llama_token * max(1, n))(*held)
    tmp = f"{target}.tmp"
    t0 = time.perf_counter()
    try:
        ok = (llama_cpp.llama_state_save_file(llm._ctx.ctx, tmp.encode(), tokens, n) if batch is None else
              llama_cpp.llama_state_seq_save_file(llm._ctx.ctx, tmp.encode(), id_slot, tokens, n))
        if not ok:
            raise RequestError(f"llama.cpp could not write {path.name}", 500)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"id_slot": id_slot, "filename": path.name, "n_saved": n, "n_written": os.path.getsize(target),
            "timings": {"save_ms": 1e3 * (time.perf_counter() - t0)}}


def restore_seq(llm, batch, path: Path, id_slot: int) -> dict:
    """A sequence from ``path`` into slot ``id_slot``: a request whose prompt begins with it decodes only
    the rest. Refused (400, the slot emptied) where the file is not a sequence file of this model."""
    import llama_cpp

    head = _head(path)
    if int.from_bytes(head[:4], "little") == _SESSION_MAGIC:
        raise RequestError(f"{path.name} holds a whole context (saved with -np 1); this server's slots are "
                           "sequences (-np > 1): save it again from a slot here", 400, "filename")
    if int.from_bytes(head[:4], "little") != _SEQ_MAGIC:
        raise RequestError(f"{path.name} is not a slot file (llama.cpp's sequence state format)", 400, "filename")
    n_ctx = llm.n_ctx()
    tokens = (llama_cpp.llama_token * n_ctx)()
    n_out = ctypes.c_size_t(0)
    t0 = time.perf_counter()
    batch.dec.set_kept(id_slot, [])
    ok = llama_cpp.llama_state_seq_load_file(llm._ctx.ctx, str(path).encode(), id_slot, tokens, n_ctx,
                                             ctypes.byref(n_out))
    n = int(n_out.value)
    if not ok or not 0 < n <= n_ctx or any(not 0 <= t < llm.n_vocab() for t in tokens[:n]):
        batch.dec.set_kept(id_slot, [])  # (what llama.cpp read so far is not a conversation)
        raise RequestError(f"{path.name} is not a slot file of this model (a sequence of at most {n_ctx} tokens "
                           "saved by this model): the slot is now empty", 400, "filename")
    batch.dec.set_kept(id_slot, list(tokens[:n]), in_cache=True)
    return {"id_slot": id_slot, "filename": path.name, "n_restored": n, "n_read": path.stat().st_size,
            "timings": {"restore_ms": 1e3 * (time.perf_counter() - t0)}}


def _head(path: Path) -> bytes:
    if not path.exists():
        raise RequestError(f"no slot file {path.name} in the slot directory", 404, "filename")
    if not path.is_file():  # (a FIFO would block the read below)
        raise RequestError(f"{path.name} is not a regular file", 400, "filename")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise RequestError(f"cannot read the slot file {path.name}: {e.strerror}", 400, "filename") from None
    if len(head) < 8:
        raise RequestError(f"{path.name} is not a slot file (8 bytes or fewer)", 400, "filename")
    return head


def restore(llm, path: Path, id_slot: int) -> dict:
    """A conversation from ``path`` into the context; refused (400, the context emptied) where the file
    is not a session file of this model and context."""
    import llama_cpp

    head = _head(path)
    if int.from_bytes(head[:4], "little") == _SEQ_MAGIC:
        raise RequestError(f"{path.name} holds one slot's sequence (saved with -np > 1); this server's slot is "
                           "the whole context (-np 1): save it again here", 400, "filename")
    if int.from_bytes(head[:4], "little") != _SESSION_MAGIC:
        raise RequestError(f"{path.name} is not a slot file (llama.cpp's session format)", 400, "filename")
    n_ctx = llm.n_ctx()
    tokens = (llama_cpp.llama_token * n_ctx)()
    n_out = ctypes.c_size_t(0)
    t0 = time.perf_counter()
    ok = llama_cpp.llama_state_load_file(llm._ctx.ctx, str(path).encode(), tokens, n_ctx, ctypes.byref(n_out))
    n = int(n_out.value)
    if not ok or not 0 < n <= n_ctx or any(not 0 <= t < llm.n_vocab() for t in tokens[:n]):
        empty_context(llm)  # (what llama.cpp read so far is not a conversation)
        raise RequestError(f"{path.name} is not a slot file of this model and context (a conversation of at most "
                           f"{n_ctx} tokens saved by this model): the slot is now empty", 400, "filename")
    adopt_conversation(llm, tokens[:n])
    return {"id_slot": id_slot, "filename": path.name, "n_restored": n, "n_read": path.stat().st_size,
            "timings": {"restore_ms": 1e3 * (time.perf_counter() - t0)}}
