"""A prompt cache on disk: conversations kept by their tokens, so that a prompt beginning with one is not
prefilled again, across requests, conversations and restarts (llama-cpp-python's ``LlamaDiskCache``
keeps whole ``LlamaState`` objects, logits included; this keeps llama.cpp's KV cache of the sequence).

After each generation :meth:`PromptCache.save` writes the context's conversation (its tokens and
their KV cache, a pymoecache.kv state file naming the model and the context size) to ``DIR/<hash>.prompt``;
an entry whose tokens begin another's is dropped (the longer one serves every prompt it served). Before a
generation :meth:`PromptCache.restore` loads the entry of the same model and context size sharing the
longest prefix with the prompt, where that is longer than what the context already holds: only the rest
of the prompt is then decoded, and the restored history reads no expert. An entry that is truncated or
damaged is dropped when it would be used; entries of other models stay, unused. Files beyond ``capacity`` bytes go, least recently used first.

>>> cache = PromptCache("/tmp/prompts", capacity=2 << 30)                       # doctest: +SKIP
>>> llm.set_prompt_cache(cache)                                                 # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

from .errors import ConfigError, StateFileError
from .files import make_directory
from .kv import adopt_conversation, empty_context

_MIN_GAIN = 8            # tokens a restore must save over what the context holds


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _read_entry(path: Path) -> "Optional[_Entry]":
    """What a .prompt file says of itself (its header), None where it is not an entry."""
    from .kv import SEQUENCE, read_header

    try:
        h = read_header(path)
    except (OSError, StateFileError):
        return None
    return _Entry(h.tokens, h.model, h.n_ctx) if h.kind == SEQUENCE and h.tokens else None


class _Entry(NamedTuple):
    tokens: Tuple[int, ...]
    model: bytes  # the model's fingerprint (pymoecache.kv)
    n_ctx: int


class PromptCache:
    """Conversations on disk in ``directory`` (made if missing), at most ``capacity`` bytes."""

    def __init__(self, directory: "os.PathLike[str] | str", capacity: int = 2 << 30):
        if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)):
            raise ConfigError(f"prompt cache directory must be a path (str or os.PathLike), got {directory!r:.60}")
        if not os.fspath(directory) or "\0" in os.fspath(directory):
            raise ConfigError(f"prompt cache directory {os.fspath(directory)!r:.60} is empty or holds a NUL character")
        self.directory = Path(directory)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ConfigError(f"prompt cache capacity must be a positive number of bytes, got {capacity!r}")
        self.capacity = capacity
        make_directory(self.directory, "prompt cache", ConfigError)
        self._lock = threading.Lock()
        self.entries: Dict[Path, _Entry] = {}
        for p in self.directory.glob("*.prompt"):  # (files that are not entries are left alone and unused)
            entry = _read_entry(p)
            if entry is not None:
                self.entries[p] = entry
        self.restored = 0   # entries loaded so far, and the tokens they gave
        self.restored_tokens = 0

    def restore(self, llm, prompt: List[int]) -> int:
        """Load into ``llm``'s context the entry of this model and context size sharing the longest prefix
        with ``prompt`` where that beats what the context holds by at least a few tokens; returns the tokens
        restored (0: none). An entry that is truncated or damaged is dropped (its file removed)."""
        from .kv import load_file, model_fingerprint

        have = _lcp(llm.input_ids[:llm.n_tokens].tolist(), prompt)
        model, n_ctx = model_fingerprint(llm.model_path), llm.n_ctx()
        with self._lock:
            best, gain = None, have + _MIN_GAIN
            for p, e in self.entries.items():
                if e.model != model or e.n_ctx != n_ctx:  # (another model's, or another context size's)
                    continue
                n = _lcp(e.tokens, prompt)
                if n >= gain:
                    best, gain = p, n
        if best is None:
            return 0
        try:
            tokens = load_file(llm, best, 0)
        except (OSError, StateFileError):  # (damaged, truncated, or gone: dropped, the context emptied)
            with self._lock:
                self.entries.pop(best, None)
            try:
                best.unlink(missing_ok=True)
            except OSError:  # (a read-only directory: the entry is unused, not removed)
                pass
            empty_context(llm)
            return 0
        n = len(tokens)
        adopt_conversation(llm, tokens)
        try:
            os.utime(best)  # (recently used)
        except OSError:
            pass
        self.restored += 1
        self.restored_tokens += min(n, gain)
        return min(n, gain)

    def save(self, llm) -> Optional[Path]:
        """The context's conversation as an entry (None where it holds too little to be worth one, or where
        it cannot be written: the cache is a help, not a duty)."""
        from .kv import model_fingerprint, save_file

        n = llm.n_tokens
        if n < _MIN_GAIN:
            return None
        tokens = tuple(llm.input_ids[:n].tolist())
        model, n_ctx = model_fingerprint(llm.model_path), llm.n_ctx()
        name = hashlib.sha1(repr((model, n_ctx, tokens)).encode()).hexdigest()[:24] + ".prompt"
        path = self.directory / name
        if path in self.entries and path.exists():
            try:
                os.utime(path)
            except OSError:
                pass
            return path
        try:
            save_file(llm, path, list(tokens), 0, "prompt-cache entry")
        except StateFileError:  # (a full disk, a read-only directory, something not a file at the name)
            return None
        with self._lock:
            for p, e in list(self.entries.items()):  # a prefix of this one serves nothing this one does not
                if e.model == model and e.n_ctx == n_ctx and len(e.tokens) <= n and tokens[:len(e.tokens)] == e.tokens:
                    p.unlink(missing_ok=True)
                    del self.entries[p]
            self.entries[path] = _Entry(tokens, model, n_ctx)
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
