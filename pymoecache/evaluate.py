"""Perplexity and miss rate of routing policies on a text, and per-token traces of the cache.

The protocol is the one of ``docs/method.md`` ("Evaluation protocol"): the text is cut
into chunks of ``ctx`` tokens; each chunk is evaluated from an empty KV cache and every
predicted position of it is scored; the policy routes every token; the expert cache is carried
from one chunk to the next (never cleared between chunks).

>>> parse_sweep("prior=0,0.5")
[Prior(strength=0.0, top_j=None), Prior(strength=0.5, top_j=None)]
>>> knob(MaxRank(4)), knob(TopK())
(4, None)

Typical use::

    rows = sweep("model.gguf", "valid.txt", parse_sweep("prior=0,0.5,1"), [0.5, 0.25], ctx=256)
    write_rows(rows, "pareto.csv")
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np

from .config import CacheConfig, CumsumThreshold, MaxRank, Preset, Prior, Prune, Routing, TopK, resolved_top_j
from .errors import EvalError  # noqa: F401  (raised here, defined with the other errors)
from .files import save_npz_atomic, write_atomic
from .stats import MoEStats

TRACE_FORMAT = "pymoecache-trace"  # `pymoecache trace`: the cache timeline (selected, hits, contents per token);
                                  # the simulator reads another file, a router trace (pymoecache.simulate)


# --- text ------------------------------------------------------------------------------------

def load_text(path: "str | Path") -> str:
    """The whole text file (WikiText raw files are already paragraphs joined with blank lines).

    >>> load_text("no-such-file.txt")
    Traceback (most recent call last):
    ...
    pymoecache.errors.EvalError: text file not found: no-such-file.txt
    """
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"text file not found: {p}" if not p.exists() else f"{p} is not a file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise EvalError(f"cannot read text file {p}: {e.strerror or e}") from None
    # a perplexity or a trace of bytes that are not text would mean nothing: refused, with where
    if b"\0" in data:
        raise EvalError(f"{p} is not a text file (a NUL byte at offset {data.index(0)})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(f"{p} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                        "convert it first, e.g. iconv -f latin1 -t utf-8") from None
    if not text.strip():
        raise EvalError(f"text file {p} is empty")
    return text


def tokenize_text(llm, text: str) -> List[int]:
    """Tokens of ``text`` without BOS (chunks get their own BOS in :func:`perplexity`)."""
    return llm.tokenize(text.encode("utf-8"), add_bos=False)


# --- perplexity ------------------------------------------------------------------------------

@dataclass
class PerplexityResult:
    ppl: float           # exp(nll)
    nll: float           # mean negative log-likelihood per scored token (nats)
    n_tokens: int        # tokens scored (ctx - 1 per chunk)
    n_chunks: int
    ctx: int
    stats: MoEStats      # cache counters of this run only
    ppl_err: float = 0.0 # its standard error, from the spread of the per-token NLLs (as llama-perplexity's "+/-")
    chunk_nll: List[float] = dataclasses.field(default_factory=list)  # mean NLL of each chunk, in order:
                                                                        # paired comparisons (paired_delta)


def model_context_length(llm) -> int:
    """The context length the model was trained with (GGUF ``<arch>.context_length``), 0 if unknown."""
    arch = llm.metadata.get("general.architecture", "")
    return int(llm.metadata.get(f"{arch}.context_length", 0) or 0)


def check_loaded_model(llm, n_ctx: int, what: str = "ctx") -> None:
    """EvalError (after closing ``llm``) unless it has MoE layers and a training context >= ``n_ctx``."""
    n_train = model_context_length(llm)
    if llm.moecache is None:
        llm.close()
        raise EvalError(f"{llm.model_path} has no MoE layers (a dense model): there are no experts to cache")
    if n_train and n_ctx > n_train:
        llm.close()
        raise EvalError(f"{what} {n_ctx} is larger than the model's context length {n_train}")


def load_llama(model_path: "str | Path", **kwargs):
    """``pymoecache.Llama(model_path, verbose=False, **kwargs)`` without the dense-model warning
    (callers check for a cache themselves and raise a clear error)."""
    import warnings

    from .llama import Llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return Llama(str(model_path), verbose=False, **kwargs)


def _n_ctx(llm) -> int:
    """Tokens the Llama can hold: llama-cpp-python sizes its token and logit buffers by the n_ctx it
    was given (llama.cpp may pad its own context up, so llm.n_ctx() can be larger)."""
    return min(llm.n_ctx(), llm.context_params.n_ctx)


def _check_llm(llm, ctx: int) -> None:
    if llm.moecache is None:
        raise EvalError("the model has no MoE layers: there is no expert cache to evaluate")
    if ctx < 2:
        raise EvalError(f"ctx must be >= 2 tokens, got {ctx}")
    if not getattr(llm, "_logits_all", False):
        raise EvalError("perplexity needs the logits of every position: create the Llama with logits_all=True")
    if ctx > _n_ctx(llm):
        raise EvalError(f"ctx {ctx} is larger than the Llama's context n_ctx={_n_ctx(llm)}: create it with n_ctx >= ctx")


def split_chunks(tokens: Sequence[int], ctx: int, limit_chunks: Optional[int] = None) -> List[List[int]]:
    """Whole chunks of ``ctx`` tokens (a shorter tail is dropped), at most ``limit_chunks``.

    >>> split_chunks(list(range(7)), 3)
    [[0, 1, 2], [3, 4, 5]]
    """
    n = len(tokens) // ctx
    if n == 0:
        raise EvalError(f"the text has {len(tokens)} tokens, fewer than one chunk of ctx={ctx}")
    if limit_chunks is not None:
        n = min(n, max(1, int(limit_chunks)))
    return [list(tokens[i * ctx:(i + 1) * ctx]) for i in range(n)]


def token_nll(logits: np.ndarray, targets: Sequence[int], rows: int = 128) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] for every position i, in float64.

    >>> [round(x, 6) for x in token_nll(np.zeros((2, 4), dtype=np.float32), [0, 3])] == [round(math.log(4), 6)] * 2
    True
    """
    targets = np.asarray(targets)
    out = np.empty(len(targets), dtype=np.float64)
    for i in range(0, len(targets), rows):  # slices: [rows, n_vocab] float64 at a time
        x = np.asarray(logits[i:i + rows], dtype=np.float64)
        m = x.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
        t = targets[i:i + rows]
        out[i:i + len(t)] = lse - x[np.arange(len(t)), t]
    return out


def paired_delta(chunks: Sequence[float], base: Sequence[float]) -> "tuple[float, float]":
    """How much higher a perplexity is than ``base``'s on the same chunks, and the standard error of that,
    as fractions (0.01 = +1%): from the per-chunk mean NLLs of both (``PerplexityResult.chunk_nll``, the
    ``chunk_nll`` of a sweep row), chunk by chunk, so that what the text does to both cancels. The error
    treats the chunks as independent samples (the expert cache carries over from one to the next, so it
    is a lower bound); nan with fewer than 2 chunks.

    >>> d, err = paired_delta([2.0, 3.0, 4.0], [1.99, 2.98, 3.99])
    >>> round(d, 4), round(err, 4)
    (0.0134, 0.0034)
    """
    a, b = np.asarray(chunks, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        raise EvalError(f"paired_delta needs the same chunks on both sides, got {a.size} and {b.size}")
    d = a - b  # [n_chunks] per-token NLL, this row less the base (equal chunks: their mean is the text's)
    ratio = math.exp(float(d.mean()))
    err = ratio * float(d.std(ddof=1)) / math.sqrt(d.size) if d.size > 1 else float("nan")
    return ratio - 1.0, err


def format_gap(gap: float, err: float) -> str:
    """A paired_delta as text: "+0.87% ±0.12" (no error part where it is nan).

    >>> format_gap(0.0087, 0.0012), format_gap(-0.01, float("nan"))
    ('+0.87% ±0.12', '-1.00%')
    """
    return f"{100 * gap:+.2f}%" + ("" if math.isnan(err) else f" ±{100 * err:.2f}")


def _progress(iterable, enabled: bool, desc: str, unit: str = "chunk"):
    """A progress bar on stderr where it is a terminal; elsewhere (a log file, a pipe) nothing, since
    each redraw would be a line of its own there (the "[row k of N]" lines still say where a run is)."""
    import sys

    if not enabled or not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, unit=unit, file=sys.stderr, leave=False)


def perplexity(llm, tokens: Sequence[int], ctx: int, *, progress: bool = True,
               limit_chunks: Optional[int] = None, desc: str = "perplexity", decode: bool = False) -> PerplexityResult:
    """Perplexity of ``tokens`` in chunks of ``ctx`` with the Llama's current routing and cache.

    Every chunk starts from an empty KV cache; its first token is replaced by BOS when the model's
    tokenizer adds one (as llama.cpp's perplexity tool does; that token is never scored). The expert
    cache is not cleared: it carries over from the previous chunk (and from before the call). The
    cache counters are reset at the start, so ``stats`` covers this run only. ``llm`` must be made
    with ``logits_all=True`` and ``n_ctx >= ctx``; route every token (``routing_scope="all"``).
    ``decode=True`` evaluates each chunk one token at a time, as generation does (slower; what
    happens only in decode, such as prefetch, then takes part).
    """
    _check_llm(llm, ctx)
    chunks = split_chunks(tokens, ctx, limit_chunks)
    bos = llm.tokenize(b"", add_bos=True)  # [BOS] or [] for models without one
    llm.moecache.reset_stats()
    total, total2, n_scored, per_chunk = 0.0, 0.0, 0, []
    for chunk in _progress(chunks, progress, desc):
        chunk = bos + chunk[len(bos):]
        llm.reset()  # empty KV cache: eval() removes every position from n_tokens = 0 on
        if decode:
            for t in chunk:
                llm.eval([t])
        else:
            llm.eval(chunk)
        nlls = token_nll(llm.scores[:len(chunk) - 1], chunk[1:])
        total, total2 = total + float(nlls.sum()), total2 + float((nlls * nlls).sum())
        n_scored += len(nlls)
        per_chunk.append(float(nlls.mean()))
    nll = total / n_scored
    var = max(0.0, total2 / n_scored - nll * nll)  # of one token's NLL
    err = math.exp(nll) * math.sqrt(var / (n_scored - 1)) if n_scored > 1 else 0.0
    return PerplexityResult(ppl=math.exp(nll), nll=nll, n_tokens=n_scored, n_chunks=len(chunks), ctx=ctx,
                            stats=llm.moecache.stats(), ppl_err=err, chunk_nll=per_chunk)


def perplexity_batched(llm, tokens: Sequence[int], ctx: int, n_seq: int, *, progress: bool = True,
                       limit_chunks: Optional[int] = None, desc: str = "perplexity") -> PerplexityResult:
    """:func:`perplexity` with ``decode=True``, the chunks decoded ``n_seq`` at a time together (one
    token of each a step, :class:`pymoecache.BatchDecoder`): the protocol of docs/method.md for
    sequences that share the cache and the steps, as ``serve -np`` runs them. ``llm`` must be made with
    ``n_seq_max >= n_seq``; its own conversation (slot 0) is forgotten.
    """
    from .batch import BatchDecoder

    if llm.n_seq_max < n_seq:
        raise EvalError(f"perplexity_batched: the Llama decodes {llm.n_seq_max} sequences at once (n_seq_max); "
                        f"{n_seq} asked")
    if llm.n_ctx() < ctx * n_seq:
        raise EvalError(f"perplexity_batched: {n_seq} chunks of {ctx} tokens need n_ctx >= {ctx * n_seq}, "
                        f"the Llama has {llm.n_ctx()}")
    chunks = split_chunks(tokens, ctx, limit_chunks)
    bos = llm.tokenize(b"", add_bos=True)
    llm.moecache.reset_stats()
    total, total2, n_scored, per_chunk = 0.0, 0.0, 0, []
    with BatchDecoder(llm) as dec:
        groups = [chunks[i:i + n_seq] for i in range(0, len(chunks), n_seq)]
        for group in _progress(groups, progress, desc):
            dec.forget()  # (every chunk from an empty KV cache)
            seqs = []
            for chunk in group:
                chunk = bos + chunk[len(bos):]
                seqs.append(dec.add(chunk[:1], max_tokens=len(chunk) - 1, forced=chunk[1:]))
            dec.run()
            for q in seqs:
                nlls = np.asarray(q.nll, dtype=np.float64)
                total, total2 = total + float(nlls.sum()), total2 + float((nlls * nlls).sum())
                n_scored += len(nlls)
                per_chunk.append(float(nlls.mean()))
    nll = total / n_scored
    var = max(0.0, total2 / n_scored - nll * nll)
    err = math.exp(nll) * math.sqrt(var / (n_scored - 1)) if n_scored > 1 else 0.0
    return PerplexityResult(ppl=math.exp(nll), nll=nll, n_tokens=n_scored, n_chunks=len(chunks), ctx=ctx,
                            stats=llm.moecache.stats(), ppl_err=err, chunk_nll=per_chunk)


# --- sweeps ----------------------------------------------------------------------------------

_SWEEP_POLICIES = {"prior": (Prior, float), "max-rank": (MaxRank, int), "cumsum": (CumsumThreshold, float),
                   "prune": (Prune, int)}
SWEEP_SPECS = "prior=L1,L2,... | max-rank=M1,M2,... | cumsum=T1,T2,... | prune=R1,R2,... | lru"


def parse_sweep(specs: "str | Iterable[str]", top_j: Optional[int] = None) -> List[Routing]:
    """Routings of one or more sweep specs such as ``"prior=0,0.25,0.5,1"``, in order.

    >>> [r.spec() for r in parse_sweep(["max-rank=2,4", "lru", "prune=1"])]
    ['max-rank:2', 'max-rank:4', 'lru', 'prune:1']
    >>> parse_sweep("cumsum=0.7", top_j=2)
    [CumsumThreshold(tau=0.7, top_j=2)]
    """
    if isinstance(specs, str):
        specs = [specs]
    out: List[Routing] = []
    for spec in specs:
        name, _, values = spec.strip().lower().partition("=")
        name = name.strip()
        if name in ("lru", "topk", "top-k") and not values.strip():
            out.append(TopK())
            continue
        if name not in _SWEEP_POLICIES or not values.strip():
            raise EvalError(f"cannot parse sweep {spec!r}; expected {SWEEP_SPECS}")
        cls, kind = _SWEEP_POLICIES[name]
        for v in values.split(","):
            try:
                x = kind(v.strip())
            except ValueError:
                raise EvalError(f"sweep {spec!r}: {v.strip()!r} is not a valid "
                                f"{'number' if kind is float else 'integer'}") from None
            out.append(cls(x) if top_j is None else cls(x, top_j=top_j))
    return out


def knob(routing: Routing):
    """The policy's parameter (lambda, m, tau or R); None for LRU."""
    fields = [f.name for f in dataclasses.fields(routing) if f.name != "top_j"]
    return getattr(routing, fields[0]) if fields else None


def policy_name(routing: Routing) -> str:
    return routing.spec().split(":")[0]


def result_row(routing: Routing, res: PerplexityResult) -> dict:
    """One row of a sweep table."""
    st = res.stats
    return {
        "policy": policy_name(routing),
        "knob": knob(routing),
        "top_j": resolved_top_j(routing, st.n_expert_used) if hasattr(routing, "top_j") else None,
        "spec": routing.spec(),
        "cache_size": int(st.capacity_per_layer[0]) if st.capacity_per_layer.size else 0,
        "n_expert": st.n_expert,
        "ppl": res.ppl,
        "ppl_err": res.ppl_err,
        "nll": res.nll,
        "miss_rate": st.miss_rate,
        "hit_rate": st.hit_rate,
        "lifetime": st.lifetime,
        "tokens": res.n_tokens,
        "chunks": res.n_chunks,
        "ctx": res.ctx,
        "prefetch": st.residency.prefetch if st.residency else "off",
        "prefetch_recall": st.residency.recall if st.residency else 0.0,
        # experts brought in per token and layer: the tokens' misses plus the prefetches
        "loads_per_token": (st.misses + (st.residency.prefetch_issued if st.residency else 0))
        / max(1, int(st.tokens_per_layer.sum())),
        **_miss_path_columns(st),
        "chunk_nll": [round(x, 6) for x in res.chunk_nll],  # (a CSV cell: space-separated)
    }


def _miss_path_columns(st) -> dict:
    """What the low-bit miss path did (streamed runs; zeros otherwise): the miss path, selections per
    token computed from the companion, and the MiB per token a token waited for: the companion's
    copies and the full copies read on demand, less those read behind the token (prefetches are
    not counted: a token waits for them only in part)."""
    rs = st.residency
    if rs is None or rs.residency != "stream":
        return {"miss_path": "full", "lowbit_per_token": 0.0, "critical_mib_per_token": 0.0}
    n = max(1, rs.decode_tokens)
    # (in expert bytes: the aligned windows of direct reads are not the model's bytes)
    crit = rs.lowbit_bytes_read + (rs.decode_loads - rs.lowbit_behind) * rs.expert_bytes
    return {"miss_path": rs.miss, "lowbit_per_token": rs.lowbit_loads / n,
            "critical_mib_per_token": crit / n / 2**20}


def with_lru(routings: Iterable[Routing]) -> List[Routing]:
    """LRU first, then the others in order, each spec once.

    >>> [r.spec() for r in with_lru(parse_sweep(["prior=0.5,0.5", "lru"]))]
    ['lru', 'prior:0.5']
    """
    out, seen = [TopK()], {"lru"}
    for r in routings:
        key = (r.spec(), getattr(r, "top_j", None))
        if r.spec() != "lru" and key not in seen:
            seen.add(key)
            out.append(r)
    return out


def load_for_eval(model_path: "str | Path", cache_size, ctx: int, *, n_threads: Optional[int] = None,
                  insertion: str = "top-bottom", prefetch: str = "off", prefetch_distance: int = 1,
                  prefetch_min_p: float = 0.0, eviction: str = "lru", eviction_decay: float = 0.95,
                  per_layer: Optional[Sequence[int]] = None, miss: str = "full", lowbit=None,
                  stream: bool = False, lowbit_max_p: float = 1.0, device: Optional[dict] = None):
    """A Llama ready for :func:`perplexity` at ``ctx`` (routing: every token). Residency "none":
    perplexity and miss rates do not depend on where the experts live, and all weights stay resident;
    except with a low-bit miss path (``miss`` "lowbit" or "lowbit-all", companion ``lowbit``), which
    computes streamed misses from their low-bit copies: then the experts stream (evaluate with
    ``decode=True``: prompts compute every expert at full precision). stream=True streams them with
    full-precision misses too, so that the rows count the bytes read on each token's critical path.
    per_layer: sizes of single layers (``CacheConfig.per_layer``). device: ``n_gpu_layers`` and
    ``rpc_servers`` of ``Llama`` (GPU layers: with residency none their experts are where llama.cpp
    puts them, the cache counting)."""
    cache = CacheConfig(size=cache_size, insertion=insertion, residency="stream" if stream or miss != "full" else "none",
                        prefetch=prefetch, prefetch_distance=prefetch_distance, prefetch_min_p=prefetch_min_p,
                        eviction=eviction, eviction_decay=eviction_decay, per_layer=per_layer, miss=miss,
                        lowbit=lowbit, lowbit_max_p=lowbit_max_p)
    llm = load_llama(model_path, cache=cache, routing=TopK(),
                     routing_scope="all", n_ctx=ctx, n_batch=ctx, logits_all=True, n_threads=n_threads, **(device or {}))
    check_loaded_model(llm, ctx)
    return llm


def sweep(model_path: "str | Path", text_path: "str | Path", routings: Sequence[Routing], cache_sizes: Sequence,
          *, ctx: int, max_chunks: Optional[int] = None, n_threads: Optional[int] = None, progress: bool = True,
          insertion: str = "top-bottom", decode: bool = False, prefetch: str = "off",
          prefetch_distance: int = 1, prefetch_min_p: float = 0.0, eviction: str = "lru",
          eviction_decay: float = 0.95, miss: str = "full", lowbit=None, stream: bool = False,
          lowbit_max_p: float = 1.0, on_row=None, device: Optional[dict] = None) -> List[dict]:
    """Perplexity and cache counters for every (cache size, routing); LRU is always included.

    miss, lowbit, lowbit_max_p, stream: the low-bit miss path and streamed experts
    (:func:`load_for_eval`); the miss path acts on decoded tokens only, so it needs ``decode=True``.
    device: GPU layers (:func:`load_for_eval`); each row says how many layers were on a GPU.

    The model is loaded once per cache size; before each routing the cache is emptied (which also
    restarts the prior's running Delta) and the counters are reset, so the rows are independent.
    on_row(rows, total): called before the first row (rows empty) and after each finished row, with
    the rows so far and how many there will be: progress, and rows kept if the sweep is stopped.
    """
    from .plan import gpu_layers

    if miss != "full" and not decode:
        raise EvalError(f"miss={miss!r} acts on decoded tokens only: evaluate with decode=True")
    text = load_text(text_path)
    routings = with_lru(routings)
    rows: List[dict] = []
    tokens = None
    total = len(cache_sizes) * len(routings)
    if on_row is not None:
        on_row(rows, total)
    for size in cache_sizes:
        llm = load_for_eval(model_path, size, ctx, n_threads=n_threads, insertion=insertion, prefetch=prefetch,
                            prefetch_distance=prefetch_distance, prefetch_min_p=prefetch_min_p, eviction=eviction,
                            eviction_decay=eviction_decay, miss=miss, lowbit=lowbit, stream=stream,
                            lowbit_max_p=lowbit_max_p, device=device)
        try:
            on_gpu = gpu_layers(llm.model_params.n_gpu_layers, llm.model_info.n_layer)
            tokens = tokens if tokens is not None else tokenize_text(llm, text)
            for routing in routings:
                if not isinstance(routing, Preset):  # (a preset brings its own eviction: Llama.set_routing)
                    llm.set_eviction(eviction)
                llm.moecache.clear()
                llm.moecache.reset_stats()
                asked = routing.spec() if hasattr(routing, "spec") else str(routing)
                llm.set_routing(routing, scope="all")
                routing = llm.moecache.routing  # a preset: what it resolved to for this cache size
                res = perplexity(llm, tokens, ctx, progress=progress, limit_chunks=max_chunks,
                                 desc=f"{routing.spec()}, cache {size}", decode=decode)
                rows.append({"model": Path(model_path).name, **result_row(routing, res),
                             "eviction": llm.moecache.eviction, "prefetch_min_p": prefetch_min_p,
                             "lowbit_max_p": lowbit_max_p if miss != "full" else None,
                             # the setting as asked (a preset and a cache size resolve per miss path)
                             "routing_asked": asked, "cache_asked": str(size),
                             "gpu_layers": on_gpu})  # (repeating layers on a GPU or an RPC server)
                if on_row is not None:
                    on_row(rows, total)
        finally:
            llm.close()
    return rows


def write_rows(rows: Sequence[dict], path: "str | Path", fmt: Optional[str] = None) -> None:
    """Write sweep rows as CSV or JSON (``fmt``, or from the extension: .csv / .json)."""
    p = Path(path)
    fmt = fmt or p.suffix.lower().lstrip(".")
    if fmt == "json":
        data = (json.dumps(list(rows), indent=1) + "\n").encode()
    elif fmt == "csv":
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [])
        w.writeheader()
        w.writerows({k: ("" if v is None else " ".join(map(str, v)) if isinstance(v, list) else v)
                     for k, v in r.items()} for r in rows)
        data = buf.getvalue().encode()
    else:
        raise EvalError(f"cannot tell the format of {p}: use a .csv or .json file name")
    write_atomic(p, data, f"{fmt.upper()} file", EvalError)  # whole or not at all, regular files only


def format_table(rows: Sequence[dict]) -> str:
    """The rows as an aligned text table (policy, eviction, knob, cache, ppl and its standard error, the
    perplexity against top-k + LRU's on the same chunks with its paired standard error, miss %, hit %,
    lifetime; with streamed rows also the miss path, low-bit experts per token and critical-path MiB
    per token)."""
    streamed = any(r.get("critical_mib_per_token") or r.get("miss_path", "full") != "full" for r in rows)
    paths = {r.get("miss_path", "full") for r in rows}
    vs_full = "full" in paths and len(paths) > 1  # a low-bit row beside the same setting at full precision
    head = ("policy", "eviction", "knob", "cache", *(("miss path",) if streamed else ()),
            "ppl", "±", "vs lru", *(("vs full",) if vs_full else ()), "miss %", "hit %", "lifetime",
            *(("low-bit/tok", "critical MiB/tok") if streamed else ()))
    body = [(r["policy"], r.get("eviction", "lru"), "-" if r["knob"] is None else f"{r['knob']:g}",
             f"{r['cache_size']}/{r['n_expert']}",
             *((r.get("miss_path", "full") + (f" p<{r['lowbit_max_p']:g}" if (r.get("lowbit_max_p") or 1) < 1 else ""),)
               if streamed else ()),
             f"{r['ppl']:.6g}", f"{r.get('ppl_err', 0.0):.3g}", _vs_lru(r, rows),
             *((_vs_full(r, rows),) if vs_full else ()),
             f"{100 * r['miss_rate']:.2f}", f"{100 * r['hit_rate']:.2f}", f"{r['lifetime']:.1f}",
             *((f"{r.get('lowbit_per_token', 0.0):.2f}", f"{r.get('critical_mib_per_token', 0.0):.3f}")
               if streamed else ()))
            for r in rows]
    n_left = 5 if streamed else 4
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) if i < n_left else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
             for line in [head, *body]]
    return "\n".join(lines)


def _vs_lru(row: dict, rows: Sequence[dict]) -> str:
    """``row``'s perplexity against the top-k + LRU row of its cache size and miss path, chunk by chunk
    (paired_delta): "+0.87% ±0.12"; "-" for that row itself or where there is none."""
    if row["policy"] == "lru":
        return "-"
    same = ("cache_size", "miss_path", "lowbit_max_p")
    base = next((r for r in rows if r["policy"] == "lru" and all(r.get(k) == row.get(k) for k in same)), None)
    if base is None or not row.get("chunk_nll") or len(row["chunk_nll"]) != len(base.get("chunk_nll") or []):
        return "-"
    return format_gap(*paired_delta(row["chunk_nll"], base["chunk_nll"]))


def _vs_full(row: dict, rows: Sequence[dict]) -> str:
    """``row``'s perplexity against the full-precision row of the same routing and cache size, chunk
    by chunk: what its low-bit copies cost ("-" for a full-precision row, or where there is none)."""
    if row.get("miss_path", "full") == "full":
        return "-"
    same = ("routing_asked", "cache_asked") if "cache_asked" in row else ("policy", "knob", "eviction", "cache_size")
    base = next((r for r in rows if r.get("miss_path", "full") == "full" and all(r.get(k) == row.get(k) for k in same)),
                None)
    if base is None or not row.get("chunk_nll") or len(row["chunk_nll"]) != len(base.get("chunk_nll") or []):
        return "-"
    return format_gap(*paired_delta(row["chunk_nll"], base["chunk_nll"]))


# --- traces ----------------------------------------------------------------------------------

def record_trace(llm, tokens: Sequence[int], *, progress: bool = False) -> dict:
    """Evaluate ``tokens`` one at a time from an empty expert cache and KV cache and record, per
    token t and MoE layer: the selected experts, which were hits, and the cache contents after t.

    Needs ``CacheConfig(trace=N)`` with N >= len(tokens) * (number of MoE layers). Returns a dict:
    ``selected`` [T, L, K] int32 (-1: dropped slot), ``hit`` [T, L, K] bool, ``cached`` [T, L, N]
    bool, ``moe_layers`` [L], and ``n_layer``, ``n_expert``, ``n_expert_used``, ``routing``,
    ``cache_size``, ``model``.
    """
    mc = llm.moecache
    if mc is None:
        raise EvalError("the model has no MoE layers: there is no expert cache to trace")
    moe = [int(x) for x in llm.model_info.moe_layers]
    T, L, N, K = len(tokens), len(moe), mc.n_expert, mc.n_expert_used
    if T == 0:
        raise EvalError("no tokens to trace")
    if T > _n_ctx(llm):
        raise EvalError(f"{T} tokens do not fit in the context (n_ctx={_n_ctx(llm)})")
    if mc.trace_capacity < T * L:
        raise EvalError(f"the trace buffer holds {mc.trace_capacity} records, {T} tokens x {L} MoE layers need "
                        f"{T * L}: create the Llama with CacheConfig(trace={T * L})")
    mc.clear()
    mc.reset_stats()
    llm.reset()
    cached = np.zeros((T, L, N), dtype=bool)
    for t in _progress(range(T), progress, "trace", unit="tok"):
        llm.eval([tokens[t]])
        for j, il in enumerate(moe):
            cached[t, j, mc.cached(il)] = True
    selected = np.full((T, L, K), -1, dtype=np.int32)
    hit = np.zeros((T, L, K), dtype=bool)
    col = {il: j for j, il in enumerate(moe)}
    for rec in mc.trace():
        t, j, n = int(rec["token"]), col[int(rec["layer"])], int(rec["n_selected"])
        selected[t, j, :n] = rec["experts"][:n]
        hit[t, j, :n] = (int(rec["hit_mask"]) >> np.arange(n)) & 1
    st = mc.stats()
    return {"format": TRACE_FORMAT, "selected": selected, "hit": hit, "cached": cached,
            "moe_layers": np.array(moe, dtype=np.int32), "n_layer": int(llm.model_info.n_layer),
            "n_expert": N, "n_expert_used": K, "routing": mc.routing.spec(),
            "cache_size": int(st.capacity_per_layer[0]), "model": Path(llm.model_path).name}


_TRACE_ARRAYS = ("selected", "hit", "cached", "moe_layers")


def save_trace_npz(path: "str | Path", d: dict) -> None:
    """Write a :func:`record_trace` dict to a compressed .npz file."""
    save_npz_atomic(path, "trace", EvalError, **{k: np.asarray(v) for k, v in d.items()})


def load_trace_npz(path: "str | Path") -> dict:
    """Read a trace written by :func:`save_trace_npz` (scalars come back as Python values)."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"trace file not found: {p}")
    try:
        with np.load(p, allow_pickle=False) as z:
            d = {k: (z[k] if k in _TRACE_ARRAYS else z[k].item()) for k in z.files}
    except (OSError, ValueError, EOFError):
        raise EvalError(f"{p} is not a pymoecache trace (not an .npz file)") from None
    if d.get("format") != TRACE_FORMAT or any(k not in d for k in _TRACE_ARRAYS):
        raise EvalError(f"{p} is not a pymoecache trace (write one with `pymoecache trace`)")
    return d


def trace_source(trace: Union[str, Path, dict]) -> dict:
    """A trace dict from a dict or an .npz path."""
    return trace if isinstance(trace, dict) else load_trace_npz(trace)
