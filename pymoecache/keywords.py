"""The keywords of ``pymoecache.Llama``, checked before a load: a name neither llama-cpp-python nor we take, and
the values that would reach llama.cpp's ctypes as fixed-width integers, abort it, or crash its first decode.

>>> check_keywords({"cache_size": 0.25})
Traceback (most recent call last):
...
pymoecache.errors.ConfigError: Llama() got an unknown keyword 'cache_size'; did you mean 'cache'?
"""

from __future__ import annotations

import functools
import os

from . import _moecache_cpp  # noqa: F401  (first: our libllama, before llama_cpp loads one)
import llama_cpp  # noqa: E402

from .config import INT32_MAX, ConfigError, check_int

MAX_THREADS = 512    # GGML_MAX_N_THREADS


def check_llama_kwargs(kw: dict) -> None:
    """Range checks for the llama_cpp.Llama options that reach ctypes as fixed-width integers."""
    for name in ("n_ctx", "n_batch", "n_ubatch"):
        if name in kw:
            check_int(name, kw[name], 0 if name == "n_ctx" else 1, INT32_MAX)
    if 0 < kw.get("n_ctx", 0) < 8:
        raise ConfigError(f"n_ctx = {kw['n_ctx']} is too small: use 0 (the model's training context) or at least 8")
    for name in ("n_threads", "n_threads_batch"):
        if kw.get(name) is not None and kw[name] != -1:
            check_int(name, kw[name], 1, MAX_THREADS)
    if "seed" in kw:
        check_int("seed", kw["seed"], -1, 2**32 - 1)
    if "n_gpu_layers" in kw and kw["n_gpu_layers"] != "auto":
        check_int("n_gpu_layers (or 'auto')", kw["n_gpu_layers"], -1, INT32_MAX)
    for name in ("type_k", "type_v"):  # (llama.cpp asserts on another type: the process aborts)
        v = kw.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v not in KV_TYPES):
            raise ConfigError(f"{name} must be a ggml type llama.cpp keeps a KV cache in: "
                              + ", ".join(f"{t} ({n})" for n, t in KV_TYPES.items()) + f"; got {v!r}")
    for name in ("lora_path", "lora_base"):  # (a missing adapter loaded, and the first decode crashed)
        if kw.get(name) is not None:
            check_gguf_path(name, kw[name])
    fmt = kw.get("chat_format")
    if fmt is not None:
        import difflib

        known = sorted(llama_cpp.llama_chat_format.LlamaChatCompletionHandlerRegistry()._chat_handlers)
        if not isinstance(fmt, str) or fmt not in known:
            close = difflib.get_close_matches(str(fmt), known, n=1, cutoff=0.6)
            raise ConfigError(f"unknown chat_format {fmt!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                              + f" (one of: {', '.join(known)})")
    fa = kw.get("flash_attn")
    if fa is not None and fa not in (True, False, "on", "off", "auto") or isinstance(fa, (int, float)) and \
            not isinstance(fa, bool):
        raise ConfigError(f"flash_attn must be True, False, 'on', 'off' or 'auto' (llama.cpp decides: on where the "
                          f"devices support it), got {fa!r}")
    draft = kw.get("draft_model")
    if draft is not None and not isinstance(draft, llama_cpp.llama_speculative.LlamaDraftModel):
        raise ConfigError(f"draft_model must be a llama_cpp.llama_speculative.LlamaDraftModel (such as "
                          f"LlamaPromptLookupDecoding()), got {draft!r}")


# the KV cache types llama.cpp takes (-ctk / -ctv): ggml type -> name
KV_TYPES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 20: "IQ4_NL", 6: "Q5_0", 7: "Q5_1"}


def check_gguf_path(name: str, path) -> None:
    """ConfigError unless ``path`` is a regular GGUF file (a LoRA adapter, its base model)."""
    import stat

    try:
        p = os.fsdecode(path)
    except TypeError:
        raise ConfigError(f"{name} must be a path, got {path!r}") from None
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ConfigError(f"{name} {p}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{name} {p} is not a regular file")
        if os.read(fd, 4) != b"GGUF":
            raise ConfigError(f"{name} {p} is not a GGUF file")
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=1)
def llama_keywords() -> frozenset:
    """The keywords llama_cpp.Llama takes (its signature), ours, and rpc_servers (taken here)."""
    import inspect

    sig = inspect.signature(llama_cpp.Llama.__init__).parameters
    return frozenset(n for n, p in sig.items() if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD) \
        - {"self"} | {"rpc_servers", "model_path", "cache", "routing", "routing_scope", "n_cpu_moe", "override_tensor",
                      "n_seq_max", "repack"}


def check_keywords(kw: dict) -> None:
    """ConfigError for a keyword neither llama_cpp.Llama nor we take (llama-cpp-python's ``**kwargs``
    would swallow it: ``cache_size=0.25`` did nothing), with the closest one as a guess."""
    import difflib

    known = llama_keywords()
    for name in kw:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            raise ConfigError(f"Llama() got an unknown keyword {name!r}" + (f"; did you mean {close[0]!r}?" if close
                                                                                else ""))
