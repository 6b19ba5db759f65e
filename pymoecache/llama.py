"""``pymoecache.Llama``: llama-cpp-python's ``Llama`` with an expert cache and cache-aware routing.

>>> import pymoecache
>>> llm = pymoecache.Llama(pymoecache.default_model_path(), cache=pymoecache.CacheConfig(size=0.5),
...                        routing=pymoecache.Prior(0.5), verbose=False)      # doctest: +SKIP
>>> out = llm("Once upon a time", max_tokens=16)                              # doctest: +SKIP
>>> round(llm.moe_stats().hit_rate, 2)                                        # doctest: +SKIP
0.83
"""

from __future__ import annotations

import codecs
import os
import threading
import time
import warnings
from typing import Optional, Tuple, Union

import numpy as np

from . import _moecache_cpp as C  # first: it finds our libllama (a clear error if none) before llama_cpp loads one
import llama_cpp  # noqa: E402
from .config import CacheConfig, ConfigError, Preset, Routing, check_int, parse_routing
from .errors import (ClosedError, ConcurrentUseError, DeviceLostError, ModelFileError, MoECacheError, MoECacheIOError,
                     ModelLoadError)
from ._logtail import take_log_lines
from .grammar import check_grammar
from .logprobs import StepLogprobs, logits_row
from .moecache import MoECache  # noqa: F401 (MoECache: also pymoecache.llama.MoECache)
from .model_info import model_info
from . import placement, rpc
from .keywords import check_keywords
from .plan import AutoCacheSize  # noqa: F401 (re-exported)
from .stats import MoEStats

from . import _llamalog  # noqa: E402,F401  (importing it installs llama.cpp's log callback)


# one model load at a time: llama-cpp-python's verbose=False swaps the process's stdout/stderr
# file descriptors while it loads, and moecache_set_load_residency is process-wide
_LOAD_LOCK = threading.Lock()


CHECK_INTERVAL_S = 0.01  # decoded tokens check the model file and count page faults at most this often (seconds)


def _major_faults() -> int:
    """Major page faults of this process so far (pages read back from storage; 0 where unknown)."""
    try:
        import resource
    except ImportError:  # (not on Windows)
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _utf8_repaired(b: bytes) -> bytes:
    """``b`` with U+FFFD for each byte sequence that is not UTF-8, except an unfinished character at
    the end, which the next token may finish.

    >>> _utf8_repaired(b"\\xcb Dez"), _utf8_repaired(b"ok \\xe2\\x81"), _utf8_repaired(b"\\xe2\\x81\\xb8")
    (b'\\xef\\xbf\\xbd Dez', b'ok \\xe2\\x81', b'\\xe2\\x81\\xb8')
    """
    d = codecs.getincrementaldecoder("utf-8")("replace")
    text = d.decode(b, final=False)
    return text.encode() + d.getstate()[0]


def _file_signature(path: str) -> Tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _Tokenizer(llama_cpp.llama_tokenizer.LlamaTokenizer):
    """llama-cpp-python's tokenizer of a Llama (``llm.tokenizer()``, ``llm.tokenizer_``), which raises
    :class:`ClosedError` once that Llama is closed or collected: the model it reads is freed then."""

    def __init__(self, llama: "Llama"):
        import weakref

        super().__init__(llama)
        self._llama = weakref.ref(llama)

    def _open(self) -> None:
        llama = self._llama()
        if llama is None or type(llama) is _ClosedLlama:
            why = llama.__dict__.get("_closed_why") if llama is not None else None
            raise ClosedError("tokenizer: " + (why or "its Llama was closed (close(), or the end of its with block): "
                                                      "load the model again"))

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True):
        self._open()
        return super().tokenize(text, add_bos, special)

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        self._open()
        return super().detokenize(tokens, prev_tokens, special)


class Llama(llama_cpp.Llama):
    """``llama_cpp.Llama`` running on pymoecache's libllama, with a per-layer expert cache.

    Everything of ``llama_cpp.Llama`` works unchanged (completion, chat, streaming, grammars,
    tokenization); routing goes through the cache from the first token on.

    Args:
        model_path: a GGUF file.
        cache: :class:`CacheConfig` (default ``size="auto"``: as many experts per layer as fit in
            the free memory, all of them when the model fits; what does not fit is streamed: the
            cached experts live in an mlocked slot arena and a miss reads the expert from
            ``model_path``). ``cache_choice`` then says what auto chose and why.
        routing: a policy object (:class:`Prior`, :class:`MaxRank`, ...) or a spec string such
            as ``"prior:0.5"`` (default: the ``quality`` preset, which is stock top-k routing wherever
            every expert is cached; ``"lru"`` for top-k everywhere, the cache then only counts; the
            preset's eviction, lfu with decay 0.8, replaces CacheConfig's default ``"lru"``, and any
            other eviction given there is kept), or a
            :class:`Preset` (``"preset:balanced"``): routing and eviction picked from the model's
            K and the share of experts cached, once the cache size is known (``.preset``).
        routing_scope: ``"all"`` routes every token through the policy; ``"decode"`` only
            generated tokens (prompts use stock routing), as in the on-device deployment.
        **kwargs: passed to ``llama_cpp.Llama`` (n_ctx, n_threads, seed, verbose, n_gpu_layers, ...).
            ``n_gpu_layers`` with residency stream or mmap puts those layers' dense part on the GPU
            and keeps the routed experts in the cache in CPU memory (llama.cpp's ``--cpu-moe``
            placement). ``n_gpu_layers="auto"`` (llama.cpp's ``-ngl auto``): every layer whose dense part
            and KV cache fit in the GPUs' free memory beside a 1 GiB margin; where every expert is
            cached but they do not fit beside, they stay in RAM and a VRAM tier takes what fits
            (``CacheConfig.vram_size``). ``rpc_servers="HOST:PORT,..."`` (as llama-cpp-python's former option)
            offloads to ggml RPC servers (:mod:`pymoecache.rpc`). ``n_cpu_moe=N`` (or ``"all"``) and
            ``override_tensor="PATTERN=CPU,..."`` are llama-cli's ``--n-cpu-moe`` and ``-ot``: tensor
            buffer overrides that keep the routed experts of the first N layers (or the matching
            tensors) in CPU memory beside GPU layers; they matter with residency none, where the
            experts are otherwise where llama.cpp puts them (stream and mmap keep them in CPU memory).
            ``repack=False`` is llama-cli's ``--no-repack``: the dense part keeps the file's layout
            (llama.cpp's repacked layouts speed up some types and slow others: measure both).
            ``use_mlock=True`` with residency stream or mmap locks what the cache holds, the dense
            part and the cached experts (llama.cpp's lock of the whole mapping would pull in every
            expert).

    A dense model (no MoE layers) loads and runs with a warning, without a cache. If the model
    file becomes unreadable during a run, the token that needed the expert raises
    :class:`MoECacheIOError` (its output is discarded; the expert is read again next time); so
    does any decode after the file was truncated, overwritten, replaced or removed.

    Errors: a bad file raises :class:`ModelFileError` (:class:`ModelLoadError` with llama.cpp's
    reason when llama.cpp refuses it), a bad parameter :class:`ConfigError`; all derive from
    :class:`pymoecache.Error`. Threads: one ``Llama`` serves one thread at a time; a call from a
    second thread while the first decodes raises :class:`ConcurrentUseError` (use one ``Llama``
    per thread, or a lock). :meth:`moe_stats` may be called from any thread: it waits for the
    token being decoded and reads the counters between two tokens.

    >>> llm = Llama("model.gguf", routing="prior:0.5", cache=CacheConfig(size=0.25))  # doctest: +SKIP
    >>> llm.set_routing("max-rank:4")                                               # doctest: +SKIP
    >>> big = Llama("big-moe.gguf", cache=CacheConfig(size="3GiB"), routing="prior:0.5")  # doctest: +SKIP
    >>> big.moe_stats().residency.summary()                                         # doctest: +SKIP
    'stream: read 2.54 MiB/tok | per token: compute 20.39 ms, I/O wait 3.69 ms, routing 0.160 ms | rss 1244 MiB ...'
    """

    def __init__(self, model_path: Optional[str] = None, *, cache: Union[CacheConfig, int, float, str, None] = None,
                 routing: Union[Routing, str, None] = None, routing_scope: str = "all", **kwargs):
        check_keywords(kwargs)
        if model_path is None:  # as the CLI: the embedded default model
            from .models import default_model_path

            model_path = str(default_model_path())
        info = model_info(model_path)  # clear errors for missing, non-GGUF, truncated and impossible files
        # where every tensor goes and how the cache is made, decided (and checked) before any weight is read
        self.placement = p = placement.decide(str(model_path), info, cache, routing, routing_scope, kwargs)
        kwargs, cache, routing, residency = p.kwargs, p.cache, p.routing, p.residency
        self.n_seq_max = p.n_seq_max
        self._rpc_used = p.rpc_used  # the servers whose devices take this model's layers: each decode checks them
        self._busy = threading.Lock()  # held by the thread in eval/sample: a second one gets ConcurrentUseError
        self.n_evals = 0  # calls of eval (one sequence's tokens in slot 0)
        self._token_lock = threading.Lock()  # held while a token is decoded or sampled: readers of the
                                             # counters wait for the token in flight, never fail
        self._grammar_checked = None  # (text, root) of the last grammar check_grammar passed
        self._timeline_spans: Optional[list] = None  # start_timeline: (t_start_us, t_end_us, n_tokens) per eval
        self._decode_major_faults = 0  # major page faults of this process during one-token evals
        self._logits_unchecked = False  # eval's last row of logits not yet checked for NaN (_check_logits)
        # the file as loaded: eval() refuses to run on a model file truncated or replaced since
        # (its mapping would fault with SIGBUS or feed garbage); not needed when nothing is mapped
        self._file_sig = (_file_signature(str(model_path))
                          if residency != "none" or kwargs.get("use_mmap", True) else None)
        # and the low-bit companion it reads (a copy replaced in place would feed other weights)
        self._lowbit_sig = ((cache.lowbit, _file_signature(cache.lowbit))
                            if info.is_moe and cache.miss != "full" and cache.lowbit else None)
        with _LOAD_LOCK:
            take_log_lines()  # drop older lines: only this load's reason goes into the message
            try:
                with placement.applied_to_load(p):
                    super().__init__(model_path=str(model_path), **kwargs)
            except ValueError as e:  # llama-cpp-python's "Failed to load model from file" and friends
                why = take_log_lines() or "no reason logged"
                if str(e).startswith("Failed to create llama_context"):
                    raise ConfigError(f"llama.cpp could not create a context for {model_path} "
                                      f"(n_ctx={kwargs.get('n_ctx', 512)}): {why}") from None
                raise ModelLoadError(f"llama.cpp could not load {model_path}: {why}") from None
            except MemoryError:  # llama-cpp-python's arrays per context position (scores, token ids)
                raise ConfigError(f"not enough memory for a context of n_ctx={kwargs.get('n_ctx', 512)} tokens"
                                  + (" with logits_all=True (n_ctx x n_vocab floats)" if kwargs.get("logits_all")
                                     else "") + ": use a smaller n_ctx (-c)") from None
        if (kwargs.get("chat_format") is None and kwargs.get("chat_handler") is None and self.chat_format == "llama-2"
                and "tokenizer.chat_template" not in self.metadata):
            self.chat_format = "chatml"  # a model without a chat template: ChatML, as run, chat and serve (not
            #                              llama-cpp-python's llama-2 by guess)
        # a truncation of the mapped file faults in the middle of a matmul: the guard answers with
        # zeros and counts, eval() refuses the decode (moecache-guard.cpp)
        self._guard = -1
        if self._file_sig is not None:
            guard = C.moecache_guard_add(self._model.model, os.fsencode(str(model_path)))
            if guard >= 0:
                self._guard = guard
                self._stack.callback(C.moecache_guard_remove, guard)  # LIFO: before the model is freed
        self._no_vocab = llama_cpp.llama_vocab_type(self._model.vocab) == llama_cpp.LLAMA_VOCAB_TYPE_NONE
        if type(self.tokenizer_) is llama_cpp.llama_tokenizer.LlamaTokenizer:  # (not one the caller passed)
            self.tokenizer_ = _Tokenizer(self)
        self.model_info = info
        self.cache_config = cache
        self.cache_choice = p.choice  # AutoCacheSize: what size="auto" chose and why; None for an explicit size
        # the Preset that was resolved into routing and eviction (routing="preset:NAME", or the default), or None
        self.preset = p.preset if info.is_moe else None
        self.moecache: Optional[MoECache] = None
        if not info.is_moe:
            warnings.warn(f"{model_path}: no MoE layers ({info.arch} is a dense model); running without an expert cache",
                          stacklevel=2)
            return
        self.moecache = MoECache.for_model(self._model.model, info, cache=cache, routing=routing, scope=routing_scope,
                                           params=p.native)
        self.moecache.attach(self._ctx.ctx)
        self.moecache._rpc_used = list(self._rpc_used)  # (collected apart from this Llama, it checks them itself)
        # runs before the context is freed (LIFO); the object stays usable as a name that raises ClosedError
        self._stack.callback(self.moecache.close, "Llama.moecache: its Llama was closed (close(), or the end of its "
                                                  "with block): load the model again")
        if cache.miss == "lowbit-cache":  # a miss reads the companion's copy: what the counters count in bytes
            self.moecache.expert_bytes = float(self.moecache.residency_stats().expert_bytes)
        if cache.predictor is not None:
            self.load_predictor(cache.predictor)

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: Optional[str] = None, **kwargs) -> "Llama":
        """``llama_cpp.Llama.from_pretrained``: a GGUF of a Hugging Face Hub repository (``filename``
        may be a glob), downloaded once, then loaded as :class:`Llama` with ``kwargs``. Any failure of
        the download (offline, no such repository or file) is a :class:`pymoecache.hub.HubError` of
        one line; a missing huggingface-hub a :class:`MissingDependencyError`.

        >>> llm = Llama.from_pretrained("OWNER/SOME-MOE-GGUF", "*Q4_K_M.gguf", cache="50%")  # doctest: +SKIP
        """
        from .errors import Error, MissingDependencyError
        from .hub import HubError

        try:
            return super().from_pretrained(repo_id, filename, **kwargs)
        except Error:
            raise
        except ImportError:
            raise MissingDependencyError("Llama.from_pretrained needs huggingface-hub: pip install "
                                         "'pymoecache[hub]'") from None
        except Exception as e:  # huggingface_hub's and httpx's errors, llama-cpp-python's ValueError
            from . import hub as _hub_mod

            try:  # no network: the CLI's message and fix, not the resolver's errno
                hub = _hub_mod._hub()
                if _hub_mod._offline(hub) or not _hub_mod._reachable(hub):
                    raise _hub_mod._unreachable(hub, repo_id, filename if filename and "*" not in filename else "",
                                                kwargs.get("cache_dir")) from None
            except HubError:
                raise
            except Exception:
                pass
            why = " ".join(str(e).split()) or type(e).__name__
            raise HubError(f"cannot get {filename or 'a GGUF'} of {repo_id} from the Hugging Face Hub: "
                           f"{why[:300]}") from None

    _plan = None
    _lowbit_sig = None

    def memory_plan(self):
        """The :class:`pymoecache.plan.MemoryPlan` of this model as loaded: the memory that was free
        before the load, the dense part, the KV cache of this context, the expert cache and the
        headroom, and the reads a decoded token is expected to cost, with the disk probed once (on
        the first call) where the cache streams. None for a dense model.

        >>> print(llm.memory_plan().summary())                                      # doctest: +SKIP
        plan: 23.1 GiB free = dense part 4 MiB + KV cache 1 MiB (256 tokens) + expert cache ...
        """
        if self._plan is None:
            self._plan = placement.loaded_plan(self.placement, self.model_info, self.n_ctx(), self.moecache)
        return self._plan

    def _enter(self) -> None:
        """Take the decode lock without waiting: a second thread gets a clear error, not a crash."""
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUseError(
                "this Llama is decoding in another thread: a Llama (one llama.cpp context) serves one thread "
                "at a time; use one Llama per thread, or a lock around calls")

    def _check_file(self) -> None:
        """MoECacheIOError where the model file (or the low-bit companion) is gone, replaced, resized
        or modified since the load: before a prompt, and every CHECK_INTERVAL_S while decoding (a
        truncation inside a decode is the guard's: moecache-guard.cpp)."""
        if self._file_sig is not None:
            self._check_signature("model file", self.model_path, self._file_sig)
        if self._lowbit_sig is not None:
            self._check_signature("low-bit companion", *self._lowbit_sig)

    @staticmethod
    def _check_signature(kind: str, path: str, sig: Tuple[int, int, int, int]) -> None:
        try:
            st = os.stat(path)
        except OSError as e:
            now, what = None, f"is gone ({e.strerror})"
        else:
            now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # (_file_signature's, without its call)
            if now == sig:
                return
            (dev0, ino0, size0, _), (dev1, ino1, size1, _) = sig, now
            what = ("was replaced by another file" if (dev0, ino0) != (dev1, ino1) else
                    f"changed size from {size0} to {size1} bytes" if size0 != size1 else "was modified")
        raise MoECacheIOError(f"the {kind} {path} {what} since it was loaded: its weights can no longer be "
                              "trusted; load the model again")

    def eval(self, tokens) -> None:
        """``llama_cpp.Llama.eval``; a failed expert read, or a model file changed since it was
        loaded, raises :class:`MoECacheIOError`; a call while another thread decodes,
        :class:`ConcurrentUseError`."""
        self.n_evals += 1  # (BatchDecoder: someone else changed the KV cache)
        # the logits are checked for NaN where they are read: by the sampler (sample), by eval itself with
        # logits_all (scores), at the latest before the next decode; not here, which would synchronize
        # with the device once more per token (on RPC a round trip through ggml's client thread)
        self._decode_checked(lambda: super(Llama, self).eval(tokens), len(tokens), check_now=self._logits_all)

    def _decode_checked(self, decode, n_tokens: int, check_now: bool = True) -> None:
        """``decode()`` (llama_decode of ``n_tokens``, one sequence's, or a batch's one token each) with
        eval's checks: one thread at a time, the RPC servers and the model file first; the guard's
        faults and a failed expert read after; NaN logits after (``check_now``) or where they are read
        (sample, the next decode)."""
        self._enter()
        try:
            if self._rpc_used:
                self._check_rpc()
            # the file check and the fault count: before every prompt, and for decoded tokens at most every
            # CHECK_INTERVAL_S (each cost 5-15 us a token here, after a decode has evicted the CPU's caches)
            now = time.monotonic()
            due = n_tokens != 1 or self._faults_from is None or now - self._checked_at >= CHECK_INTERVAL_S
            if due:
                self._check_file()
                self._checked_at = now  # (after it passed: a retry after its error checks again)
            if self._logits_unchecked:  # (the last decode's, nobody sampled from them)
                self._check_logits()
            with self._token_lock:
                t0 = C.moecache_time_now_us() if self._timeline_spans is not None else 0
                if due:
                    self._count_decode_faults(decoding=n_tokens == 1)
                decode()
                if self._timeline_spans is not None:
                    self._timeline_spans.append((t0, C.moecache_time_now_us(), n_tokens))
                if self._guard >= 0 and C.moecache_guard_faults(self._guard):
                    raise MoECacheIOError(f"the model file {self.model_path} was truncated while in use: "
                                          f"{C.moecache_guard_faults(self._guard)} pages of it are gone, and this "
                                          "decode read zeros in their place; load the model again")
                self._logits_unchecked = True
                if check_now:
                    self._check_logits(synced=self._logits_all)
        except RuntimeError as e:
            if isinstance(e, MoECacheError):
                raise
            msg = self.moecache.take_io_error() if self.moecache is not None else None
            if msg:
                raise MoECacheIOError(msg) from None
            raise e
        finally:
            self._busy.release()

    def _count_decode_faults(self, decoding: bool) -> None:
        """The major page faults of decoded tokens (the pages they had to read back: a dropped dense
        part): the process's count read before an eval where a check is due (eval), the window
        since the last reading added where it held decoded tokens only (a prompt's eval closes it before
        it runs; the sampling between tokens is in it)."""
        now = _major_faults()
        if self._faults_from is not None:
            self._decode_major_faults += now - self._faults_from
        self._faults_from = now if decoding else None

    _faults_from: Optional[int] = None  # the process's major faults when the window of decoded tokens began
    _checked_at = 0.0  # time.monotonic() of the last file check and fault reading

    def _check_rpc(self) -> None:
        """DeviceLostError when an RPC server this model's layers are on is gone. ggml would abort the
        process on its first command to it, and again on freeing the buffers there: this Llama is
        given up instead, its memory kept until the process ends (docs/reliability.md)."""
        gone = [e for e in self._rpc_used if rpc.server_gone(e)]
        if not gone:
            return
        why = (f"rpc server {gone[0]} is gone: this model's layers there are lost and this Llama cannot run "
               "again (its memory stays allocated until the process ends; ggml cannot free buffers on a server "
               "that is gone). Load the model again: without -ngl here, or with the server back")
        rpc.mark_lost(gone)
        self._abandon(why)
        raise DeviceLostError(why)

    def _abandon(self, why: str) -> None:
        """Close this Llama without freeing anything native (ggml aborts on freeing buffers of a gone
        RPC server): the handles stay referenced by nothing and their frees are dropped."""
        for part in (getattr(self, "_model", None), getattr(self, "_ctx", None), getattr(self, "_batch", None)):
            if part is not None and hasattr(part, "_exit_stack"):
                part._exit_stack.pop_all()
        self._stack.pop_all()
        if self.moecache is not None:  # (dropped, not freed)
            self.moecache._handle = None
            self.moecache._closed_why = "Llama.moecache: " + why
        self._closed_why = why
        object.__setattr__(self, "__class__", _ClosedLlama)

    def _check_vocab(self) -> None:
        if self._no_vocab:  # llama.cpp asserts (aborts) on text with a vocabulary of type none
            raise ModelFileError(f"{self.model_path} has no tokenizer (tokenizer.ggml.model is none or missing): it "
                                 "takes token ids (eval), not text")

    def tokenizer(self) -> "_Tokenizer":
        """llama-cpp-python's tokenizer of this model; it raises :class:`ClosedError` once this Llama is
        closed."""
        return _Tokenizer(self)

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False):
        """``llama_cpp.Llama.tokenize``; ModelFileError for a model without a tokenizer."""
        self._check_vocab()
        return super().tokenize(text, add_bos, special)

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        """``llama_cpp.Llama.detokenize``; ModelFileError for a model without a tokenizer."""
        self._check_vocab()
        special = special or (self._repair_utf8 and self.special_text)
        b = super().detokenize(tokens, prev_tokens=prev_tokens, special=special)
        return _utf8_repaired(b) if self._repair_utf8 else b

    _repair_utf8 = False  # llama-cpp-python's completion code is running (_completion)
    special_text = False  # completions' text shows special tokens (chat markers), as llama-cli's -sp

    def _completion(self, prompt, args, kwargs):
        """``llama_cpp.Llama.create_completion``, whose detokenize, while its code runs, gives U+FFFD for
        bytes that no later token can make UTF-8 (:func:`_utf8_repaired`). Its stream yields only
        text that decodes, trying every prefix of what it holds: a model that samples a lone byte (a
        UTF-8 lead byte, then a token of plain text) held back the rest of the completion, re-decoding
        all of it at every token, so that a long one never ended; and the text dropped the byte."""
        if not kwargs.get("stream"):
            self._repair_utf8 = True
            try:
                return super().create_completion(prompt, *args, **kwargs)
            finally:
                self._repair_utf8 = False
        return self._repaired_chunks(super().create_completion(prompt, *args, **kwargs))

    def _repaired_chunks(self, chunks):
        try:
            while True:  # (the repair only while llama-cpp-python's code runs: not the consumer's between chunks)
                self._repair_utf8 = True
                try:
                    chunk = next(chunks)
                except StopIteration:
                    return
                finally:
                    self._repair_utf8 = False
                yield chunk
        finally:
            chunks.close()  # (a consumer that stops early ends llama-cpp-python's generator, as it did directly)

    def _check_logits(self, synced: bool = False) -> None:
        """ModelFileError when the last decode's last row of logits is not finite: NaN or inf in the
        weights (the dense part, or an expert as it was read) would otherwise sample nothing and end in
        silence. One pass over n_vocab floats per decode; ``synced``: something synchronized with the
        device since the decode (a sampler, llama_get_logits), so the check need not."""
        self._logits_unchecked = False
        if not synced:
            llama_cpp.llama_synchronize(self._ctx.ctx)
        bad = C.moecache_context_nonfinite_logits(self._ctx.ctx, -1)
        if bad > 0:
            raise ModelFileError(f"{self.model_path}: the model computed {bad} non-finite logits (NaN or inf) of "
                                 f"{self._n_vocab}: its weights hold NaN or inf values (a damaged or badly converted "
                                 "file)")

    def _init_sampler(self, *args, grammar=None, **kwargs):
        """Every sampler llama-cpp-python builds (``generate``, ``sample``) is made here: a grammar is
        checked before llama.cpp sees it, so a bad one raises GrammarError instead of crashing."""
        if grammar is not None:
            key = (getattr(grammar, "_grammar", None), getattr(grammar, "_root", "root"))
            if key != self._grammar_checked:
                check_grammar(key[0], self._model.vocab, key[1])
                self._grammar_checked = key
        return super()._init_sampler(*args, grammar=grammar, **kwargs)

    def sample(self, *args, **kwargs):
        """``llama_cpp.Llama.sample`` under the same one-thread guard as :meth:`eval`; a completion that
        asked for logprobs records the token's from the logits it was drawn from (pymoecache.logprobs)."""
        self._enter()
        try:
            with self._token_lock:
                tok = super().sample(*args, **kwargs)
                if self._logits_unchecked:  # (eval's, synchronized by the sampler that just read them)
                    self._check_logits(synced=True)
                if self._step_logprobs is not None:
                    row = logits_row(self)
                    if row is not None:
                        self._step_logprobs.record(row, tok)
                return tok
        finally:
            self._busy.release()

    _step_logprobs: Optional[StepLogprobs] = None  # the running completion's, when it asked for logprobs

    def create_completion(self, prompt, *args, **kwargs):
        """``llama_cpp.Llama.create_completion``; ``logprobs=N`` works without ``logits_all`` (each
        sampled token's log-probability and the top N, from the logits it was drawn from), except with
        ``echo`` (the prompt's logprobs need every prompt position's logits: ``logits_all=True``).

        >>> llm.create_completion("Once", max_tokens=2, logprobs=3)["choices"][0]["logprobs"]["tokens"]  # doctest: +SKIP
        [' upon', ' a']
        """
        n = kwargs.get("logprobs")
        if n is None or self._logits_all:
            return self._completion(prompt, args, kwargs)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.n_vocab():
            raise ConfigError(f"logprobs must be an integer in [0, {self.n_vocab()}], got {n!r}")
        if kwargs.get("echo"):
            raise ConfigError("logprobs with echo=True needs logits_all=True (the prompt's own logprobs need the "
                              "logits of every prompt position)")
        steps, kwargs["logprobs"] = StepLogprobs(n), None
        offset = len(prompt) if isinstance(prompt, str) else len(self.detokenize(prompt).decode("utf-8", "ignore"))
        if kwargs.get("stream"):
            return self._stream_logprobs(self._completion(prompt, args, kwargs), steps, offset)
        self._step_logprobs = steps
        try:
            result = self._completion(prompt, args, kwargs)
        finally:
            self._step_logprobs = None
        choice = result["choices"][0]
        choice["logprobs"] = steps.completion_logprobs(self, choice["text"], offset)
        return result

    def _stream_logprobs(self, chunks, steps: StepLogprobs, offset: int):
        self._step_logprobs = steps
        try:
            for chunk in chunks:
                for c in chunk.get("choices", []):
                    if c.get("text"):
                        c["logprobs"] = steps.completion_logprobs(self, c["text"], offset)
                        offset += len(c["text"])
                yield chunk
        finally:
            self._step_logprobs = None

    def close(self) -> None:
        """Free the model, the context and the expert cache now (a second call does nothing). Every
        use after it raises :class:`ClosedError`; ``with Llama(...) as llm:`` calls it at the end."""
        if not hasattr(self, "_stack"):  # __init__ failed before llama_cpp.Llama set it up
            return
        busy = getattr(self, "_busy", None)
        if busy is not None and not busy.acquire(blocking=False):
            raise ConcurrentUseError("close() while another thread decodes with this Llama: wait for it first")
        try:
            if not self._abandon_if_rpc_lost():  # (ggml would wait forever freeing buffers on a gone server)
                super().close()
        finally:
            object.__setattr__(self, "__class__", _ClosedLlama)  # every public name now raises
            if busy is not None:
                busy.release()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_stack") and not self._abandon_if_rpc_lost():  # (__init__ may have failed before
            super().__del__()                                              # llama_cpp.Llama set it up)

    def _abandon_if_rpc_lost(self) -> bool:
        """Before freeing: where an RPC server this model's layers are on is gone, give this Llama up
        instead (:meth:`_abandon`), and say so: ggml's RPC client waits forever for the answer to a free
        sent to a server that died (the process would never exit). True where it did."""
        try:
            gone = [e for e in getattr(self, "_rpc_used", None) or [] if rpc.server_gone(e)]
        except Exception:  # (at interpreter exit the modules may be half torn down: free as usual)
            return False
        if not gone:
            return False
        rpc.mark_lost(gone)
        self._abandon(f"rpc server {gone[0]} is gone: this Llama was closed without freeing its memory (ggml cannot "
                      "free buffers on a server that is gone)")
        return True

    def _require_cache(self) -> MoECache:
        if self.moecache is None:
            raise MoECacheError("this model has no MoE layers, so there is no expert cache")
        return self.moecache

    def start_timeline(self, capacity: int = 262_144) -> None:
        """Record what every token does from now on: each layer's routing and wait on the graph
        thread, each expert read on the reader threads (queued, started, finished, bytes) and each
        ``eval`` call's span. At most ``capacity`` events are kept (48 bytes each), the first ones.
        Read it with :meth:`timeline`.

        >>> llm.start_timeline()                                   # doctest: +SKIP
        >>> llm("Once upon a time", max_tokens=16)                 # doctest: +SKIP
        >>> tl = llm.timeline(); tl.overlap().summary()            # doctest: +SKIP
        '15 decoded tokens: 2.31 ms/token, reads in flight 0.90 ms/token, waited 0.84 ms/token, ...'
        >>> tl.save_chrome("run.json"); tl.plot("run.png")        # doctest: +SKIP
        """
        cache = self._require_cache()
        with self._token_lock:
            cache.timeline_start(capacity)
            self._timeline_spans = [] if capacity > 0 else None

    def timeline(self):
        """What was recorded since :meth:`start_timeline` (a :class:`pymoecache.timeline.Timeline`)."""
        from .timeline import TOKEN_DTYPE, Timeline

        cache = self._require_cache()
        if self._timeline_spans is None:
            raise MoECacheError("no timeline is being recorded: call start_timeline() first")
        with self._token_lock:
            ev, dropped = cache.timeline_events()
            spans = np.array(self._timeline_spans, dtype=TOKEN_DTYPE)
        return Timeline(ev, spans, dropped)

    def moe_stats(self) -> MoEStats:
        """Hit/miss counters since load (or the last :meth:`reset_moe_stats`), with the
        residency's bytes read, time split per token and resident memory in ``.residency``."""
        cache = self._require_cache()
        with self._token_lock:  # between tokens: a consistent snapshot, even while another thread generates
            st = cache.stats()
            self._count_decode_faults(decoding=False)  # (the last decoded token's, up to now)
        if st.residency is not None:  # compute time, as bench counts it: llama.cpp's own decode timer
            st.residency.decode_t_eval_ms = llama_cpp.llama_perf_context(self._ctx.ctx).t_eval_ms
            st.residency.decode_major_faults = self._decode_major_faults
        return st

    def load_state(self, state) -> None:
        """``llama_cpp.Llama.load_state``: the logits are the state's, not a decode's to check."""
        self._logits_unchecked = False
        super().load_state(state)

    def reset(self) -> None:
        """llama_cpp.Llama.reset (a new prompt, not a continuation); for the expert cache a new
        request begins (prefetch="trace" learns from the one that ended)."""
        super().reset()
        if getattr(self, "moecache", None) is not None:
            self.moecache.begin_request()

    _prompt_cache = None  # a pymoecache.prompt_cache.PromptCache that generate() restores from and saves to

    def set_prompt_cache(self, cache) -> None:
        """Keep conversations on disk by their tokens (a :class:`pymoecache.prompt_cache.PromptCache`, or
        None to stop): each generation first loads the kept conversation sharing the longest prefix with
        its prompt, so only the rest is decoded (and the history reads no expert), then keeps its own.

        >>> from pymoecache.prompt_cache import PromptCache
        >>> llm.set_prompt_cache(PromptCache("~/.cache/pymoecache/prompts"))     # doctest: +SKIP
        """
        from .prompt_cache import PromptCache

        if cache is not None and not isinstance(cache, PromptCache):
            raise ConfigError(f"set_prompt_cache takes a pymoecache.prompt_cache.PromptCache or None, got {cache!r}")
        self._prompt_cache = cache

    def generate(self, tokens, *args, **kwargs):
        """llama_cpp.Llama.generate, with the prompt cache (set_prompt_cache) around it where one is set."""
        if self._prompt_cache is None:
            return super().generate(tokens, *args, **kwargs)
        return self._generate_cached(self._prompt_cache, tokens, *args, **kwargs)

    def _generate_cached(self, cache, tokens, *args, **kwargs):
        cache.restore(self, list(tokens))
        try:
            yield from super().generate(tokens, *args, **kwargs)
        finally:
            cache.save(self)

    def reset_moe_stats(self) -> None:
        cache = self._require_cache()
        with self._token_lock:
            cache.reset_stats()
            self._decode_major_faults = 0
            self._faults_from = None
            llama_cpp.llama_perf_context_reset(self._ctx.ctx)  # the decode timer moe_stats() reads

    def set_routing(self, routing: Union[Routing, str], *, scope: Optional[str] = None) -> None:
        """Change the policy; takes effect on the next token, no reload.

        >>> llm.set_routing(Prior(1.0))        # doctest: +SKIP
        """
        cache = self._require_cache()
        if isinstance(routing, str) and routing.strip().lower().startswith("preset:"):
            routing = parse_routing(routing)
        if isinstance(routing, Preset):  # resolved now, from this cache's size: routing and eviction
            n = cache.layer_row(self.model_info.moe_layers[0])[0][1]
            held = (self.cache_config, n, cache.n_expert, cache.stats().residency.vram_slots)
            routing, eviction, decay = routing.resolve_all(cache.n_expert_used, placement.routing_share(*held),
                                                           placement.prefers_device(*held))
            with self._token_lock:  # as at load: the preset's decay, else the CacheConfig's (never the last one's)
                cache.set_eviction(eviction, self.placement.eviction_decay if decay is None else decay)
                cache.set_routing(routing, scope)
            return
        with self._token_lock:
            cache.set_routing(routing, scope)

    def set_eviction(self, eviction: str, decay: Optional[float] = None) -> None:
        """Change the eviction policy (``CacheConfig.eviction``); the next eviction uses it. Without
        ``decay``, the one the ``CacheConfig`` gave at load (default 0.95), as a fresh load would run it.

        >>> llm.set_eviction("router-mass")   # doctest: +SKIP
        """
        cache = self._require_cache()
        with self._token_lock:
            cache.set_eviction(eviction, self.placement.eviction_decay if decay is None else decay)

    def save_profile(self, path: "os.PathLike[str] | str") -> None:
        """Write the usage profile (which experts every request so far selected, this one included,
        and the trace store of past requests) to ``path``, atomically."""
        cache = self._require_cache().identify(self.model_path)
        with self._token_lock:
            cache.save_profile(path)

    def load_profile(self, path: "os.PathLike[str] | str", *, warm: bool = True, pin_hot: int = 0) -> int:
        """Load a profile saved by :meth:`save_profile` for the same model (:class:`StateFileError`
        for a damaged file or another model's; nothing changes then). ``warm``: every layer's cache
        starts with its most used experts; ``pin_hot``: that many per layer are never evicted (at
        most the cache size less K). Returns the experts pinned over all layers.

        >>> llm.load_profile("chat.moeprofile", pin_hot=4)   # doctest: +SKIP
        88
        """
        cache = self._require_cache().identify(self.model_path)
        check_int("pin_hot", pin_hot, 0, C.MOECACHE_MAX_EXPERTS)
        with self._token_lock:
            cache.load_profile(path)
            return cache.warm_start(pin_hot) if warm else 0

    def load_predictor(self, path: "os.PathLike[str] | str") -> int:
        """Predict experts ahead (``prefetch="gate"``) with the predictors of ``path``, written by
        :func:`pymoecache.tune.save_predictor` from :func:`pymoecache.tune.fit_predictor` for this
        model, instead of the next layers' routers. Only what is read ahead changes, never a
        routing decision or a logit. Returns how many layers got one.

        >>> from pymoecache import tune                                                      # doctest: +SKIP
        >>> tune.save_predictor("model.pred", tune.fit_predictor("model.gguf", calibration))  # doctest: +SKIP
        >>> llm.load_predictor("model.pred")                                                 # doctest: +SKIP
        19
        """
        from .predictors import load_predictor

        cache = self._require_cache()
        predictors = load_predictor(path)
        with self._token_lock:
            for il, w in predictors.items():
                cache.set_predictor(il, w)
        return len(predictors)

    def save_cache_state(self, path: "os.PathLike[str] | str") -> None:
        """Write the cache contents (per layer, in recency order) to ``path``, atomically."""
        cache = self._require_cache().identify(self.model_path)
        with self._token_lock:
            cache.save(path)

    def load_cache_state(self, path: "os.PathLike[str] | str") -> None:
        """Start warm: load contents saved by :meth:`save_cache_state` for the same model
        (:class:`StateFileError` for a damaged file or another model's; nothing is changed then)."""
        cache = self._require_cache().identify(self.model_path)
        with self._token_lock:
            cache.load(path)


class _ClosedLlama(Llama):
    """What a :class:`Llama` becomes when it is closed: its model and context are freed, so any
    public attribute or method raises :class:`ClosedError` instead of reaching freed memory (a
    segmentation fault in llama.cpp). A live Llama never pays for the check: only a closed one has
    this class."""

    _OPEN = frozenset({"close", "model_path", "model_info", "cache_config", "cache_choice", "preset"})

    def __getattribute__(self, name: str):
        if name.startswith("_") or name in _ClosedLlama._OPEN:
            return object.__getattribute__(self, name)
        why = object.__getattribute__(self, "__dict__").get("_closed_why")
        raise ClosedError(f"Llama.{name}: " + (why or "this Llama was closed (close(), or the end of its with "
                                                      "block): load the model again"))

    def close(self) -> None:
        """Closed already: nothing to do."""

    def __enter__(self):
        raise ClosedError("this Llama was closed: load the model again")

    def __del__(self) -> None:
        pass
