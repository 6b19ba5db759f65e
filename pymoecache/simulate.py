"""Offline replay of recorded router outputs, and Belady's optimal eviction as a lower bound.

Routing and caching only need the router's outputs, not the model: record them once, then try
any policy and cache size in seconds. Layers are independent (each has its own cache), so a
replay routes all tokens of layer 0, then of layer 1, ... which gives the same result as the
model's token-by-token order.

Router trace format (the simulator's input; not the cache timeline that ``pymoecache trace`` writes,
see pymoecache.evaluate): a file written with ``np.savez`` / ``np.savez_compressed`` (or any
mapping) with

    logits          float32 [n_tokens, n_layer, n_expert]  router logits z, tokens in order
    probs           optional, same shape: gating probabilities p (default: softmax(logits))
    scores          optional, same shape: selection scores s, -inf = masked (default: probs)
    n_expert_used   int: K, experts used per token
    rank_on_logits  optional bool (default True): Prior boosts z (softmax routers) rather than s

Only MoE layers belong in a router trace (index them 0..n_layer-1).

>>> rng = np.random.default_rng(0)
>>> tr = RouterTrace(rng.normal(size=(50, 2, 8)).astype(np.float32), n_expert_used=2)
>>> lru = replay(tr, "lru", cache_size=4)
>>> prior = replay(tr, "prior:1.0", cache_size=4)
>>> bool(prior.miss_rate < lru.miss_rate)
True
>>> bool((belady_opt(lru.requests, 4) <= lru.misses_per_layer).all())
True
"""

from __future__ import annotations

import bisect
import math

import os
import zipfile
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence, Union

import numpy as np

from .config import CacheConfig, ConfigError, Routing, parse_routing
from .files import save_npz_atomic
from .stats import MoEStats
from .reference import LayerCache, ReferenceCache, softmax_f32, update_order

CacheSize = Union[int, float, Sequence[int]]


# --------------------------------------------------------------------------------------------
# router traces


@dataclass
class RouterTrace:
    """Recorded router outputs, ``[n_tokens, n_layer, n_expert]`` each (see the module doc)."""

    logits: np.ndarray
    n_expert_used: int
    probs: Optional[np.ndarray] = None
    scores: Optional[np.ndarray] = None
    rank_on_logits: bool = True

    def __post_init__(self):
        self.logits = np.asarray(self.logits, dtype=np.float32)
        if self.logits.ndim != 3:
            raise ValueError(f"logits must be [n_tokens, n_layer, n_expert], got shape {self.logits.shape}")
        for name in ("probs", "scores"):
            a = getattr(self, name)
            if a is not None:
                a = np.asarray(a, dtype=np.float32)
                if a.shape != self.logits.shape:
                    raise ValueError(f"{name} has shape {a.shape}, logits {self.logits.shape}")
                setattr(self, name, a)
        self.n_expert_used = int(self.n_expert_used)
        self.rank_on_logits = bool(self.rank_on_logits)

    n_tokens = property(lambda self: self.logits.shape[0])
    n_layer = property(lambda self: self.logits.shape[1])
    n_expert = property(lambda self: self.logits.shape[2])

    def layer(self, il: int):
        """(z, p, s) of layer ``il`` as contiguous float32 ``[n_tokens, n_expert]``; s is None
        when it equals p. Missing probs are softmax(z), computed as MoECache.route does."""
        z = np.ascontiguousarray(self.logits[:, il, :])
        p = softmax_f32(z) if self.probs is None else np.ascontiguousarray(self.probs[:, il, :])
        s = None if self.scores is None else np.ascontiguousarray(self.scores[:, il, :])
        return z, p, s


def load_router_trace(src: Union[str, "os.PathLike[str]", Mapping]) -> RouterTrace:
    """A RouterTrace from an ``.npz`` path or a mapping with the keys of the module doc."""
    if isinstance(src, RouterTrace):
        return src
    try:
        data = np.load(src, allow_pickle=False) if isinstance(src, (str, os.PathLike)) else src
        keys = set(data.keys())
        if not {"logits", "n_expert_used"} <= keys:
            raise ConfigError(f"a router trace needs 'logits' and 'n_expert_used'; got {sorted(keys)}")
        tr = RouterTrace(logits=data["logits"], n_expert_used=int(np.asarray(data["n_expert_used"])),
                         probs=data["probs"] if "probs" in keys else None,
                         scores=data["scores"] if "scores" in keys else None,
                         rank_on_logits=bool(np.asarray(data["rank_on_logits"])) if "rank_on_logits" in keys else True)
    except ConfigError:
        raise
    except (OSError, EOFError, ValueError, TypeError, KeyError, zipfile.BadZipFile) as e:
        # not an .npz (BadZipFile), a damaged one, arrays of the wrong kind (object arrays refused)
        raise ConfigError(f"not a router trace (.npz from `pymoecache simulate --save-trace`): "
                          f"{type(e).__name__}: {str(e)[:200]}") from None
    if not 1 <= tr.n_expert_used <= tr.n_expert or tr.n_tokens == 0:
        raise ConfigError(f"router trace of {tr.n_tokens} tokens with n_expert_used {tr.n_expert_used} of "
                          f"{tr.n_expert} experts")
    if not np.isfinite(tr.logits).all():
        raise ConfigError("router trace holds non-finite logits")
    return tr


def save_router_trace(path: Union[str, "os.PathLike[str]"], trace: RouterTrace) -> None:
    """Writes ``trace`` in the format of the module doc (np.savez_compressed).

    >>> import tempfile, pathlib
    >>> tr = RouterTrace(np.zeros((3, 1, 4), np.float32), n_expert_used=2)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.npz"
    >>> save_router_trace(path, tr); load_router_trace(path).logits.shape
    (3, 1, 4)
    """
    extra = {k: getattr(trace, k) for k in ("probs", "scores") if getattr(trace, k) is not None}
    save_npz_atomic(path, "router trace", ConfigError, logits=trace.logits,
                    n_expert_used=np.int32(trace.n_expert_used), rank_on_logits=np.bool_(trace.rank_on_logits), **extra)


# --------------------------------------------------------------------------------------------
# replay


@dataclass
class ReplayResult(MoEStats):
    """The cache counters of a replay (:class:`MoEStats`: per-layer arrays, rates, lifetime),
    plus what was selected.

    selected[il]: ``[n_tokens, K]`` experts run, in router order, -1 = dropped (prune).
    requests[il]: the same experts in the order the cache served them (by router weight), the
    input to hand to :func:`belady_opt` / :func:`lru_misses`.
    """

    selected: List[np.ndarray] = field(default_factory=list)
    requests: List[np.ndarray] = field(default_factory=list)


def capacities(cache_size: CacheSize, n_layer: int, n_expert: int) -> List[int]:
    """Experts cached per layer: an int count, a float share of N (rounded as CacheConfig does),
    or one int per layer.

    >>> capacities(0.25, 2, 60), capacities([3, 5], 2, 8)
    ([15, 15], [3, 5])
    """
    if isinstance(cache_size, (int, float, np.integer, np.floating)) and not isinstance(cache_size, bool):
        size = int(cache_size) if isinstance(cache_size, (int, np.integer)) else float(cache_size)
        return [CacheConfig(size=size).n_cached_for(n_expert, None, 0)] * n_layer
    caps = [int(c) for c in cache_size]
    if len(caps) != n_layer or not all(0 <= c <= n_expert for c in caps):
        raise ConfigError(f"per-layer cache sizes must be {n_layer} counts in [0, {n_expert}], got {caps}")
    return caps


def replay(trace: Union[RouterTrace, Mapping, str, "os.PathLike[str]"], routing: Union[Routing, str] = "lru",
           cache_size: CacheSize = 0.5, insertion: str = "top-bottom", engine: str = "native",
           eviction: str = "lru", eviction_decay: float = 0.95) -> ReplayResult:
    """Routes every token of ``trace`` through fresh caches under ``routing`` and counts.

    eviction, eviction_decay: the cache's eviction policy (``CacheConfig.eviction``). The whole
    trace is one request (``activation`` eviction counts from its first token, with no profile).

    engine: "native" (the C++ of the real hook, via MoECache.synthetic) or "reference" (the numpy
    twin, slow). Both give identical results.

    >>> z = np.array([[[2., 1, 0]], [[0., 1, 2]], [[2., 1, 0]]], np.float32)   # 3 tokens, 1 layer, N=3
    >>> r = replay(RouterTrace(z, n_expert_used=1), "lru", cache_size=1)
    >>> r.selected[0].ravel().tolist(), int(r.misses_per_layer[0]), r.miss_rate
    ([0, 2, 0], 3, 1.0)
    >>> replay(RouterTrace(z, n_expert_used=1), "lru", cache_size=2).misses
    2
    """
    tr = load_router_trace(trace)
    routing = parse_routing(routing) if isinstance(routing, str) else routing
    caps = capacities(cache_size, tr.n_layer, tr.n_expert)
    if engine == "native":
        from .llama import MoECache  # the native engine: the library loads on first use

        cache = MoECache.synthetic(tr.n_layer, tr.n_expert, tr.n_expert_used, routing=routing,
                                   cache=CacheConfig(size=0, per_layer=caps, insertion=insertion, eviction=eviction,
                                                     eviction_decay=eviction_decay))
    elif engine == "reference":
        cache = ReferenceCache(tr.n_layer, tr.n_expert, tr.n_expert_used, caps, insertion=insertion, routing=routing,
                               eviction=eviction, eviction_decay=eviction_decay)
    else:
        raise ValueError(f"engine must be 'native' or 'reference', got {engine!r}")
    selected, requests = [], []
    for il in range(tr.n_layer):
        z, p, s = tr.layer(il)
        sel, _ = cache.route(il, z, p, s, rank_on_logits=tr.rank_on_logits)
        selected.append(sel)
        requests.append(served_order(sel, p, insertion))
    rows = [_layer_row(cache, il) for il in range(tr.n_layer)]
    return ReplayResult.from_rows(rows, tr.n_expert, tr.n_expert_used, selected=selected, requests=requests)


def served_order(selected: np.ndarray, probs: np.ndarray, insertion: str = "top-bottom") -> np.ndarray:
    """Each row of ``selected`` (router order, -1 = dropped) reordered as the cache serves it:
    by router weight, highest first ("top-bottom") or exactly reversed; -1 slots stay last."""
    out = np.full_like(selected, -1)
    for t, row in enumerate(selected):
        order = update_order([int(e) for e in row if e >= 0], probs[t], insertion)
        out[t, :len(order)] = order
    return out


def _layer_row(cache, il: int) -> tuple:
    """Layer il's counters in the column order of MoEStats.ROW, from either engine."""
    if isinstance(cache, ReferenceCache):
        r = cache.layer_stats(il)
        return (il, r.capacity, r.occupancy, r.tokens, r.selections, r.hits, r.misses, r.evictions,
                r.lifetime_count, r.lifetime_sum, r.delta, r.pinned, r.pinned_hits, r.rerouted, r.p_given_up)
    return cache.layer_row(il)[0]


# --------------------------------------------------------------------------------------------
# fixed selection sequences: LRU and Belady's OPT


def _requests(selections) -> List[int]:
    """A layer's selections as one request sequence: a ``[n_tokens, K]`` array (-1 = dropped
    slot, skipped) or a sequence of per-token expert lists, served row by row, left to right."""
    return [int(e) for row in selections for e in np.atleast_1d(row) if e >= 0]


def _per_layer(capacity: Union[int, Sequence[int]], n_layer: int) -> List[int]:
    caps = [int(capacity)] * n_layer if np.isscalar(capacity) else [int(c) for c in capacity]
    if len(caps) != n_layer:
        raise ValueError(f"{len(caps)} capacities for {n_layer} layers")
    return caps


def lru_misses(selections_per_layer, capacity: Union[int, Sequence[int]]) -> np.ndarray:
    """Misses of the cache's own LRU rule serving each layer's tokens in the given order: per
    token, an expert cached before the token is a hit; the misses are inserted in the row's
    order, evicting the least recently used entry the token does not use (the LRU one if it
    uses them all); hits refresh their recency; capacity 0 never caches.

    >>> lru_misses([[[0], [1], [2], [0], [1], [2]]], 2).tolist()
    [6]
    """
    caps = _per_layer(capacity, len(selections_per_layer))
    out = []
    for sel, cap in zip(selections_per_layer, caps):
        layer = LayerCache(cap)  # the reference's LRU: the same rule as the C++ cache
        for token in sel:
            row = [int(e) for e in np.atleast_1d(token) if e >= 0]
            layer.touch(row, row)
        out.append(layer.misses)
    return np.array(out, dtype=np.int64)


def belady_opt(selections_per_layer, capacity: Union[int, Sequence[int]]) -> np.ndarray:
    """Misses per layer under Belady's optimal eviction (MIN) for a FIXED selection sequence.

    Same rules as the cache: per token, an expert cached before the token is a hit; each miss is
    inserted (capacity 0 caches nothing); when full, OPT evicts the cached expert the token does
    not use (any cached one if it uses them all) whose next use is farthest in the future (never
    used again counts as farthest; ties go to the lower expert id). No eviction policy can do
    better on the same sequence, so this bounds what smarter eviction could gain without
    changing routing. The capacity must be 0 or at least K (the largest row), where this greedy
    rule is optimal. Pass ``ReplayResult.requests`` to compare with a replay.

    >>> cyclic = [[[0], [1], [2], [0], [1], [2]]]        # one layer, K = 1
    >>> belady_opt(cyclic, 2).tolist(), lru_misses(cyclic, 2).tolist()
    ([4], [6])
    """
    caps = _per_layer(capacity, len(selections_per_layer))
    for sel, cap in zip(selections_per_layer, caps):
        k = max((sum(1 for e in np.atleast_1d(t) if e >= 0) for t in sel), default=0)
        if 0 < cap < k:
            raise ValueError(f"belady_opt needs a cache of 0 or at least K = {k} experts (got {cap}): "
                             "with less, no cache can hold one token's experts and OPT is not defined")
    return np.array([_belady(sel, cap) for sel, cap in zip(selections_per_layer, caps)], dtype=np.int64)


def _belady(selections, capacity: int) -> int:
    rows = [[int(e) for e in np.atleast_1d(token) if e >= 0] for token in selections]
    uses = {}  # expert -> token indices that use it, ascending
    for t, row in enumerate(rows):
        for e in row:
            uses.setdefault(e, []).append(t)

    def next_use(e: int, t: int) -> float:
        i = bisect.bisect_right(uses[e], t)
        return uses[e][i] if i < len(uses[e]) else math.inf

    cache, misses = set(), 0
    for t, row in enumerate(rows):
        was_cached = cache.intersection(row)
        for e in row:
            if e in was_cached:
                continue
            misses += 1
            if capacity <= 0:
                continue
            if len(cache) >= capacity:
                candidates = [x for x in cache if x not in row] or list(cache)
                victim = max(candidates, key=lambda x: (next_use(x, t), -x))
                cache.discard(victim)
            cache.add(e)
    return misses


# --------------------------------------------------------------------------------------------
# recording a real model's router, and eviction policies against LRU and Belady


def record_router_trace(model_path: "str | os.PathLike[str]", text: str, *, tokens: int, ctx: int,
                        n_threads: Optional[int] = None, progress: bool = False) -> RouterTrace:
    """The router outputs of ``model_path`` on the first ``tokens`` tokens of ``text``, evaluated in
    chunks of ``ctx`` tokens (each from an empty KV cache, as ``pymoecache ppl``) with stock routing
    and every expert resident. Routing decisions change hidden states only under a cache-aware
    policy; replaying its routing over these stock outputs is the usual offline approximation."""
    from .evaluate import _progress, check_loaded_model, load_llama, tokenize_text

    if tokens < 1 or ctx < 2:
        raise ConfigError(f"need tokens >= 1 and ctx >= 2, got {tokens} and {ctx}")
    llm = load_llama(model_path, cache=CacheConfig(size=1.0, residency="none", router_record=tokens),
                     routing="lru", n_ctx=ctx, n_batch=ctx, n_threads=n_threads,
                     logits_all=True)  # else llama.cpp runs the last layer for the last token only
    check_loaded_model(llm, ctx)
    try:
        ids = tokenize_text(llm, text)[:tokens]
        if not ids:
            raise ConfigError("the text has no tokens")
        starts = range(0, len(ids), ctx)
        for i in _progress(starts, progress, "router trace"):
            llm.reset()
            llm.eval(ids[i:i + ctx])
        z, p, s, rank_on_logits = llm.moecache.router_record()
        return RouterTrace(z, n_expert_used=llm.moecache.n_expert_used, probs=p, scores=s,
                           rank_on_logits=rank_on_logits)
    finally:
        llm.close()


EVICTIONS = ("lru", "lfu", "activation", "freq-prob", "router-mass")


def eviction_table(trace: Union[RouterTrace, Mapping, str, "os.PathLike[str]"], routings: Sequence[Union[Routing, str]],
                   cache_sizes: Sequence[CacheSize], evictions: Sequence[str] = EVICTIONS,
                   eviction_decay: float = 0.95) -> List[dict]:
    """Miss rate of every (routing, cache size, eviction) replayed over ``trace``, next to LRU and
    Belady's optimum for the same routing. Belady is computed on the selections the routing made
    with LRU eviction (under stock routing they are the same for every policy; under a cache-aware
    routing the selections follow the cache, so there it is a reference, not a strict bound).
    ``gap_closed``: (LRU misses - misses) / (LRU misses - Belady misses), the share of the gap to
    the optimum the policy closes (None when LRU is already optimal).

    >>> rng = np.random.default_rng(0)
    >>> tr = RouterTrace(rng.normal(size=(80, 1, 8)).astype(np.float32), n_expert_used=2)
    >>> rows = eviction_table(tr, ["lru"], [4], evictions=["lru", "lfu"])
    >>> [(r["eviction"], r["misses"] >= r["belady_misses"]) for r in rows]
    [('lru', True), ('lfu', True)]
    """
    tr = load_router_trace(trace)
    rows = []
    for routing in routings:
        routing = parse_routing(routing) if isinstance(routing, str) else routing
        for size in cache_sizes:
            caps = capacities(size, tr.n_layer, tr.n_expert)
            lru = replay(tr, routing, caps, eviction="lru")
            opt = int(belady_opt(lru.requests, caps).sum()) if min(caps) >= tr.n_expert_used else None
            for ev in evictions:
                res = lru if ev == "lru" else replay(tr, routing, caps, eviction=ev, eviction_decay=eviction_decay)
                gap = (lru.misses - res.misses) / (lru.misses - opt) if opt is not None and lru.misses > opt else None
                rows.append({"routing": routing.spec(), "cache_size": caps[0], "n_expert": tr.n_expert,
                             "eviction": ev, "misses": res.misses, "miss_rate": res.miss_rate,
                             "lru_misses": lru.misses, "lru_miss_rate": lru.miss_rate, "belady_misses": opt,
                             "belady_miss_rate": (opt / (tr.n_expert_used * tr.n_tokens * tr.n_layer)
                                                  if opt is not None else None),
                             "gap_closed": gap, "tokens": tr.n_tokens})
    return rows


def format_eviction_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`eviction_table` as an aligned text table."""
    head = f"{'routing':<16} {'cache':>7} {'eviction':<12} {'miss rate':>9} {'Belady':>7} {'LRU':>7} {'gap closed':>10}"
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r['routing']:<16} {str(r['cache_size']) + '/' + str(r['n_expert']):>7} {r['eviction']:<12} "
                   f"{100 * r['miss_rate']:>8.1f}% "
                   + (f"{100 * r['belady_miss_rate']:>6.1f}% " if r["belady_miss_rate"] is not None else f"{'-':>7} ")
                   + f"{100 * r['lru_miss_rate']:>6.1f}% "
                   + (f"{100 * r['gap_closed']:>9.0f}%" if r["gap_closed"] is not None else f"{'-':>10}"))
    return "\n".join(out)
