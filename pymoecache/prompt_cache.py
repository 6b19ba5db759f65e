"""A prompt cache on disk: conversations kept by their tokens, so that a prompt beginning with one is not
prefilled again, across requests, conversations and restarts (llama-cpp-python's ``LlamaDiskCache``
keeps whole ``LlamaState`` objects, logits included; this keeps llama.cpp's KV cache of the sequence).

After each generation :meth:`PromptCache.save` writes the context's conversation (its tokens and
their KV cache, llama.cpp's ``llama_state_seq_save_file``) to ``DIR/<hash>.prompt``; an entry whose
tokens begin another's is dropped (the longer one serves every prompt it served). Before a generation
:meth:`PromptCache.restore` loads the entry sharing the longest prefix with the prompt, where that is
longer than what the context already holds: only the rest of the prompt is then decoded, and the
restored history reads no expert. Files beyond ``capacity`` bytes go, least recently used first.

>>> cache = PromptCache("/tmp/prompts", capacity=2 << 30)                       # doctest: +SKIP
>>> llm.set_prompt_cache(cache)                                                 # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .errors import ConfigError
from .files import make_directory

_SEQ_MAGIC = 0x67677371  # 'ggsq', llama.cpp's LLAMA_STATE_SEQ_MAGIC
_MIN_GAIN = 8            # tokens a restore must save over what the context holds


def adopt_conversation(llm, tokens) -> None:
    """After llama.cpp has loaded a conversation's KV cache into ``llm``'s context: its tokens as the
    context's, so that the next prompt beginning with them decodes only the rest (the last token's logits
    are not kept: llama-cpp-python evaluates it again)."""
    llm.input_ids[:len(tokens)] = tokens
    llm.n_tokens = len(tokens)
    llm._requires_eval = True
    llm._logits_unchecked = False  # (what a state file restored is not a decode of this context)


def empty_context(llm) -> None:
    """``llm``'s context emptied (no tokens, no KV cache): what a load that failed halfway leaves."""
    llm.reset()
    llm._ctx.kv_cache_clear()


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _read_tokens(path: Path) -> Optional[Tuple[int, ...]]:
    """The tokens a .prompt file holds (its header), None where it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12 or int.from_bytes(head[:4], "little") != _SEQ_MAGIC:
                return None
            n = int.from_bytes(head[8:12], "little")
            if not 0 < n <= 1 << 22:
                return None
            raw = f.read(4 * n)
    except OSError:
        return None
    if len(raw) < 4 * n:
        return None
    return tuple(int.from_bytes(raw[i:i + 4], "little", signed=True) for i in range(0, 4 * n, 4))


class PromptCache:
    """Conversations on disk in ``directory`` (made if missing), at most ``capacity`` bytes."""

    def __init__(self, directory: "os.PathLike[str] | str", capacity: int = 2 << 30):
        self.directory = Path(directory)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ConfigError(f"prompt cache capacity must be a positive number of bytes, got {capacity!r}")
        self.capacity = capacity
        make_directory(self.directory, "prompt cache", ConfigError)
        self._lock = threading.Lock()
        self.entries: Dict[Path, Tuple[int, ...]] = {}
        for p in self.directory.glob("*.prompt"):  # (files that are not entries are left alone and unused)
            tokens = _read_tokens(p)
            if tokens is not None:
                self.entries[p] = tokens
        self.restored = 0   # entries loaded so far, and the tokens they gave
        self.restored_tokens = 0

    def restore(self, llm, prompt: List[int]) -> int:
        """Load into ``llm``'s context the entry sharing the longest prefix with ``prompt`` where that beats
        what the context holds by at least a few tokens; returns the tokens restored (0: none)."""
        import llama_cpp

        have = _lcp(llm.input_ids[:llm.n_tokens].tolist(), prompt)
        with self._lock:
            best, gain = None, have + _MIN_GAIN
            for p, tokens in self.entries.items():
                n = _lcp(tokens, prompt)
                if n >= gain:
                    best, gain = p, n
        if best is None:
            return 0
        n_ctx = llm.n_ctx()
        buf = (llama_cpp.llama_token * n_ctx)()
        n_out = ctypes.c_size_t(0)
        if not llama_cpp.llama_state_seq_load_file(llm._ctx.ctx, str(best).encode(), 0, buf, n_ctx,
                                                   ctypes.byref(n_out)) or not 0 < n_out.value <= n_ctx:
            with self._lock:  # (not one of this model and context, or gone: dropped, the context emptied)
                self.entries.pop(best, None)
            empty_context(llm)
            return 0
        n = int(n_out.value)
        adopt_conversation(llm, buf[:n])
        try:
            os.utime(best)  # (recently used)
        except OSError:
            pass
        self.restored += 1
        self.restored_tokens += min(n, gain)
        return min(n, gain)

    def save(self, llm) -> Optional[Path]:
        """The context's conversation as an entry (None where it holds too little to be worth one)."""
        import llama_cpp

        n = llm.n_tokens
        if n < _MIN_GAIN:
            return None
        tokens = tuple(llm.input_ids[:n].tolist())
        name = hashlib.sha1(repr(tokens).encode()).hexdigest()[:24] + ".prompt"
        path = self.directory / name
        if path in self.entries and path.exists():
            try:
                os.utime(path)
            except OSError:
                pass
            return path
        tmp = self.directory / (name + ".tmp")
        arr = (llama_cpp.llama_token * n)(*tokens)
        try:
            if not llama_cpp.llama_state_seq_save_file(llm._ctx.ctx, str(tmp).encode(), 0, arr, n):
                return None
            os.replace(tmp, path)
        except OSError:  # (a full disk: the cache is a help, not a duty)
            return None
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            for p, t in list(self.entries.items()):  # a prefix of this one serves nothing this one does not
                if len(t) <= n and tokens[:len(t)] == t:
                    p.unlink(missing_ok=True)
                    del self.entries[p]
            self.entries[path] = tokens
            self._trim()
        return path

    def _trim(self) -> None:
        files = []
        for p in self.entries:
            try:
                st = p.stat()
                files.append((st.st_mtime, st.st_size, p))
            except OSError:
                files.append((0.0, 0, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):  # least recently used first
            if total <= self.capacity:
                break
            p.unlink(missing_ok=True)
            del self.entries[p]
            total -= size
