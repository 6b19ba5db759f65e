"""The KV memory: the one module that clears, trims and adopts the context's sequences, and that saves and
loads them as state files (only this module and llama.py call llama.cpp's ``llama_memory_*`` and
``llama_state_*``, or set a Llama's ``n_tokens``).

The slot files of ``serve --slot-save-path`` and the entries of the prompt cache are written here and
read back only here. A file is ours, not llama.cpp's session file: a header that names what it fits,
then the tokens, then llama.cpp's state (``llama_state_get_data``, or ``llama_state_seq_get_data`` for
one sequence)::

    magic "pmc-kv\\0\\0"  version u32  kind u32 (1 context, 2 sequence)  model sha256 [32]
    n_ctx u32  n_tokens u32  n_state u64  payload sha256 [32]  tokens i32 [n_tokens]  state [n_state]

Everything is checked before llama.cpp sees a byte: the size, the format, the model (a fingerprint of
the GGUF's header and of samples of every tensor's data), the context size, the checksum of tokens and
state, the tokens against the vocabulary. A file that fails is refused with the reason
(:class:`StateFileError`); llama.cpp's own loaders abort the process on a truncated file and restore
another model's state without a word. Files are written whole or not at all (files.write_atomic).

>>> import tempfile, os
>>> p = os.path.join(tempfile.mkdtemp(), "x.bin")
>>> open(p, "wb").write(b"ggsq" + bytes(60))
64
>>> read_header(p)
Traceback (most recent call last):
...
pymoecache.errors.StateFileError: x.bin is not a pymoecache state file (llama.cpp's own state files are not read, nor pymoecache's slot files from before its format 1)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .errors import StateFileError
from .files import NotARegularFile, open_regular

MAGIC = b"pmc-kv\0\0"
VERSION = 1
CONTEXT, SEQUENCE = 1, 2  # a whole context (-np 1), one sequence of it (a slot of -np N, a prompt-cache entry)
_HEAD = struct.Struct("<8sII32sIIQ32s")  # magic, version, kind, model, n_ctx, n_tokens, n_state, checksum
_KIND_NAME = {CONTEXT: "a whole context (saved with -np 1)", SEQUENCE: "one sequence (a slot of -np > 1, or a "
              "prompt-cache entry)"}
_SAMPLE = 256  # bytes of each tensor's data the fingerprint reads, at its start, middle and end


@dataclass
class Header:
    """What a state file says of itself (read_header)."""
    kind: int
    model: bytes    # sha256 of the model (model_fingerprint)
    n_ctx: int      # the context size it was saved from, tokens
    tokens: Tuple[int, ...]
    n_state: int    # bytes of llama.cpp's state after the tokens
    checksum: bytes
    offset: int     # where the state starts in the file


def remove(ctx, seq_id: int, p0: int = -1, p1: int = -1) -> None:
    """Positions [p0, p1) of sequence ``seq_id`` (-1: all of them; p0 -1: from the start) gone from the KV
    memory of the context ``ctx`` (a ``llama_context *``)."""
    import llama_cpp

    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq_id, p0, p1)


def clear(llm) -> None:
    """Every sequence of ``llm``'s context gone, and the Llama's own conversation with them."""
    import llama_cpp

    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    llm.n_tokens = 0


def forget_conversation(llm) -> None:
    """The Llama's own conversation (slot 0) no longer what its KV memory holds: its next prompt is decoded
    whole (another user of the context, a batch, changed that sequence)."""
    llm.n_tokens = 0


def empty_context(llm) -> None:
    """``llm``'s context emptied (no tokens, no KV cache): what a load that failed halfway leaves."""
    llm.reset()
    llm._ctx.kv_cache_clear()


def adopt_conversation(llm, tokens) -> None:
    """After llama.cpp has loaded a conversation's KV cache into ``llm``'s context: its tokens as the
    context's, so that the next prompt beginning with them decodes only the rest (the last token's logits
    are not kept: llama-cpp-python evaluates it again)."""
    llm.input_ids[:len(tokens)] = tokens
    llm.n_tokens = len(tokens)
    llm._requires_eval = True
    llm._logits_unchecked = False  # (what a state file restored is not a decode of this context)


_fingerprints: Dict[tuple, bytes] = {}


def model_fingerprint(model_path: "os.PathLike[str] | str") -> bytes:
    """sha256 of a GGUF's content as far as a KV cache depends on it: its header (metadata and
    tensor table) and three windows of every tensor's data. A fine-tune of the same shapes, a new
    quantization or another model changes it; it reads the header and a few hundred KiB more. Kept per
    file (device, inode, size, mtime)."""
    from .model_info import _Header

    p = Path(model_path)
    st = p.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _fingerprints:
        h = _Header(p)
        d = hashlib.sha256()
        with open(p, "rb") as f:
            fd = f.fileno()
            d.update(os.pread(fd, h.data_start, 0))
            offsets = sorted(off for _, _, _, off in h.tensors) + [st.st_size - h.data_start]
            for a, b in zip(offsets, offsets[1:]):
                for at in (a, (a + b) // 2, max(a, b - _SAMPLE)):
                    d.update(os.pread(fd, min(_SAMPLE, max(0, b - at)), h.data_start + at))
        _fingerprints[key] = d.digest()
    return _fingerprints[key]


def _kind_of(seq_id: Optional[int]) -> int:
    return CONTEXT if seq_id is None else SEQUENCE


def save_file(llm, path: "os.PathLike[str] | str", tokens: List[int], seq_id: Optional[int] = None,
              what: str = "state file") -> int:
    """``llm``'s context (``seq_id`` None) or its sequence ``seq_id`` with its ``tokens`` to ``path``,
    whole or not at all; the bytes written. StateFileError where it cannot be written."""
    import llama_cpp

    from .files import write_atomic

    ctx = llm._ctx.ctx
    n_state = (llama_cpp.llama_state_get_size(ctx) if seq_id is None else
               llama_cpp.llama_state_seq_get_size(ctx, seq_id))
    n_tok = len(tokens)
    off = _HEAD.size + 4 * n_tok
    buf = bytearray(off + n_state)
    struct.pack_into(f"<{n_tok}i", buf, _HEAD.size, *tokens)
    dst = (ctypes.c_uint8 * n_state).from_buffer(buf, off)
    got = (llama_cpp.llama_state_get_data(ctx, dst, n_state) if seq_id is None else
           llama_cpp.llama_state_seq_get_data(ctx, dst, n_state, seq_id))
    del dst  # (the buffer may not be resized while ctypes holds it)
    if got != n_state:
        raise StateFileError(f"llama.cpp gave {got} bytes of state where it said {n_state}: {Path(path).name} "
                             "not written")
    checksum = hashlib.sha256(memoryview(buf)[_HEAD.size:]).digest()
    _HEAD.pack_into(buf, 0, MAGIC, VERSION, _kind_of(seq_id), model_fingerprint(llm.model_path), llm.n_ctx(), n_tok,
                    n_state, checksum)
    write_atomic(path, buf, what)
    return len(buf)


def _open_regular(path: "os.PathLike[str] | str"):
    """A regular file opened for reading (:func:`files.open_regular`), with a state file's messages."""
    p = Path(path)
    try:
        return open_regular(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"no file {p.name}") from None
    except OSError as e:
        raise StateFileError(f"cannot read {p.name}: {e.strerror}") from None
    except NotARegularFile:
        raise StateFileError(f"{p.name} is not a regular file") from None


def _parse_header(name: str, raw: bytes, size: int) -> Header:
    if len(raw) < _HEAD.size and len(raw) >= 8 and raw[:8] == MAGIC:
        raise StateFileError(f"{name} is truncated or damaged: {size} bytes, shorter than its header")
    if len(raw) < _HEAD.size or raw[:8] != MAGIC:
        raise StateFileError(f"{name} is not a pymoecache state file (llama.cpp's own state files are not read, "
                             "nor pymoecache's slot files from before its format 1)")
    magic, version, kind, model, n_ctx, n_tok, n_state, checksum = _HEAD.unpack_from(raw)
    if version != VERSION:
        raise StateFileError(f"{name} is a state file of format {version}; this pymoecache reads format {VERSION}")
    if kind not in _KIND_NAME:
        raise StateFileError(f"{name} is damaged: kind {kind}")
    off = _HEAD.size + 4 * n_tok
    if off + n_state != size:
        raise StateFileError(f"{name} is truncated or damaged: {size} bytes where its header says "
                             f"{off + n_state}")
    return Header(kind, model, n_ctx, (), n_state, checksum, off)


def read_header(path: "os.PathLike[str] | str") -> Header:
    """The header and tokens of a state file, its size checked (not its checksum: :func:`read_file`).
    StateFileError where it is not one, FileNotFoundError where it does not exist."""
    name = Path(path).name
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        h = _parse_header(name, f.read(_HEAD.size), size)
        raw = f.read(h.offset - _HEAD.size)
    if len(raw) != h.offset - _HEAD.size:
        raise StateFileError(f"{name} is truncated inside its tokens")
    h.tokens = struct.unpack(f"<{len(raw) // 4}i", raw)
    return h


def read_file(llm, path: "os.PathLike[str] | str", seq_id: Optional[int] = None) -> Tuple[List[int], bytearray, int]:
    """(tokens, the file's bytes, where the state starts) of a state file that fits ``llm``'s context (``seq_id``
    None) or a sequence of it; StateFileError with the reason otherwise, before llama.cpp sees anything. The
    header is checked before the state is read (a large file of another model is not read whole)."""
    name = Path(path).name
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEAD.size)
        h = _parse_header(name, head, size)
        if h.kind != _kind_of(seq_id):
            raise StateFileError(f"{name} holds {_KIND_NAME[h.kind]}; here it must hold {_KIND_NAME[_kind_of(seq_id)]}")
        if h.model != model_fingerprint(llm.model_path):
            raise StateFileError(f"{name} was saved by another model (or another version of this one)")
        if h.n_ctx != llm.n_ctx():
            raise StateFileError(f"{name} was saved from a context of {h.n_ctx} tokens; this one has {llm.n_ctx()}")
        if (h.offset - _HEAD.size) // 4 > llm.n_ctx():
            raise StateFileError(f"{name} is damaged: more tokens than its context holds")
        buf = bytearray(size)
        buf[:_HEAD.size] = head
        n = _HEAD.size + f.readinto(memoryview(buf)[_HEAD.size:])
    if n != size:
        raise StateFileError(f"{name} changed while it was read")
    if hashlib.sha256(memoryview(buf)[_HEAD.size:]).digest() != h.checksum:
        raise StateFileError(f"{name} is damaged: its checksum does not match its content")
    tokens = list(struct.unpack_from(f"<{(h.offset - _HEAD.size) // 4}i", buf, _HEAD.size))
    n_vocab = llm.n_vocab()
    if any(not 0 <= t < n_vocab for t in tokens):
        raise StateFileError(f"{name} is damaged: its tokens are not tokens of this model")
    return tokens, buf, h.offset


def load_file(llm, path: "os.PathLike[str] | str", seq_id: Optional[int] = None) -> List[int]:
    """The tokens of a state file, its state loaded into ``llm``'s context (``seq_id`` None: the whole
    context) or into sequence ``seq_id``. StateFileError where the file does not fit (nothing loaded) or
    llama.cpp refuses it (the caller then empties what it was loading into)."""
    import llama_cpp

    tokens, buf, off = read_file(llm, path, seq_id)
    n_state = len(buf) - off
    src = (ctypes.c_uint8 * n_state).from_buffer(buf, off)
    ctx = llm._ctx.ctx
    got = (llama_cpp.llama_state_set_data(ctx, src, n_state) if seq_id is None else
           llama_cpp.llama_state_seq_set_data(ctx, src, n_state, seq_id))
    del src
    if got == 0 or got > n_state:
        raise StateFileError(f"llama.cpp could not load {Path(path).name} into this context")
    return tokens
