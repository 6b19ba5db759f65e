"""The routing policies and the per-layer expert cache in plain Python/numpy.

This is a readable twin of ``src_cpp/moecache-route.cpp`` and ``src_cpp/moecache-cache.cpp`` (the
code that runs inside llama.cpp),
written to be checked line by line against ``docs/method.md``.
``tests/test_route_property.py`` feeds random router outputs to both and requires identical
selections, hit masks, counters and cache contents. It is slow (pure Python per token) and meant
for tests and for small offline experiments (``pymoecache.simulate``).

Notation (method.md): N routed experts, K used per token, z logits, p gating probabilities,
s selection scores (-inf or NaN = masked: the model forbids the expert for this token),
r the router's ranking, r' the final ranking, C the layer's cache, J = Top-J.

>>> import numpy as np
>>> from pymoecache.config import Prior
>>> rc = ReferenceCache(n_layer=1, n_expert=4, n_expert_used=2, capacity=2, routing=Prior(1.0, top_j=1))
>>> sel, hits = rc.route(0, np.array([[3., 2., 1., 0.]], dtype=np.float32))
>>> sel.tolist(), hits.tolist(), rc.cached(0)
([[0, 1]], [[0, 0]], [0, 1])
>>> # expert 2 now outranks 1, but 1 is cached: the prior keeps it
>>> sel, hits = rc.route(0, np.array([[3., 1.5, 2., 0.]], dtype=np.float32))
>>> sel.tolist(), hits.tolist()
([[0, 1]], [[1, 1]])
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from .config import (ConfigError, CumsumThreshold, DropRank, MaxRank, Prior, Prune, Routing, SwapRank, TopK,
                     parse_routing, resolved_top_j)

INSERTIONS = ("top-bottom", "bottom-top")


# --------------------------------------------------------------------------------------------
# small helpers


def f32(x: float) -> float:
    """``x`` rounded to float32, as a Python float. The C++ keeps lambda and tau in ``float``
    fields (struct moecache_routing_params), so e.g. Prior(0.3) really uses float32(0.3)."""
    return float(np.float32(x))


def is_allowed(score: float) -> bool:
    """An expert may be selected unless its selection score is -inf or NaN (masked)."""
    return score > -math.inf  # False for -inf and for NaN


def softmax_f32(z: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float32, computed exactly as ``MoECache.route`` does when it is given
    no ``probs`` (so both see bit-identical p)."""
    z = np.ascontiguousarray(np.atleast_2d(z), dtype=np.float32)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def top_j_of(routing: Routing, n_expert_used: int) -> int:
    """J of a policy on a model with K = n_expert_used: its own, else the model's default
    (config.default_top_j). TopK has no knob (J changes nothing there)."""
    return resolved_top_j(routing, n_expert_used)


# --------------------------------------------------------------------------------------------
# method.md, "Ranking and promotion"


def rank_experts(s: Sequence[float]) -> List[int]:
    """r: experts sorted by s, descending.

    Left open by method.md, fixed by the C++: masked experts (-inf / NaN) go last, and ties are
    broken by the lower expert id, in both the allowed and the masked part. (In the llama.cpp graph
    the model's own top-K is put first instead, so ties follow the model; moecache_route and this
    reference always rank here.)
    """
    def key(e):
        allowed = is_allowed(s[e])
        return (not allowed, -s[e] if allowed else 0.0, e)
    return sorted(range(len(s)), key=key)


def promote(r: Sequence[int], members: Sequence[int]) -> List[int]:
    """promote(r, S): the members of S in the order they have in r, then the rest of r in order."""
    chosen = set(members)
    return [e for e in r if e in chosen] + [e for e in r if e not in chosen]


# --------------------------------------------------------------------------------------------
# method.md, "Policies"


def cumsum_m(r: Sequence[int], p: Sequence[float], s: Sequence[float], tau: float) -> int:
    """cumsum(tau): m_t, the smallest m with p[r0] + ... + p[r(m-1)] >= tau * total.

    Choices the C++ makes that method.md leaves open:
    * "p_sorted" is p taken in router order r (r sorts by s, which may differ from p by a bias);
    * masked experts are left out, and tau is relative to total = the sum of p over the allowed
      experts (so it also works for sigmoid routers whose p do not sum to 1);
    * sums are float64, accumulated one expert at a time in r order (total too);
    * tau <= 0 gives m = 0; a threshold never reached (rounding) gives m = number of allowed experts.
    """
    allowed = [e for e in r if is_allowed(s[e])]  # r puts them first
    total = 0.0
    for e in allowed:
        total += float(p[e])
    if tau <= 0.0:
        return 0
    target = tau * total
    acc = 0.0
    for i, e in enumerate(allowed):
        acc += float(p[e])
        if acc >= target:
            return i + 1
    return len(allowed)


def max_rank_order(r: Sequence[int], s: Sequence[float], cached: Set[int], m: int) -> List[int]:
    """max-rank(m) before Top-J: the cached members of r[0:m] jump ahead, in r order.

    A masked expert is never promoted (it may not run at all, whatever the cache holds).
    """
    return promote(r, [e for e in r[:m] if e in cached and is_allowed(s[e])])


def score_range(u: Sequence[float], s: Sequence[float]) -> Optional[float]:
    """max(u) - min(u) over the allowed experts, in float64 from float32 extremes; None if
    every expert is masked. Non-finite values of u are skipped, so one -inf logit cannot make
    Delta infinite."""
    vals = [float(u[e]) for e in range(len(u)) if is_allowed(s[e]) and math.isfinite(u[e])]
    if not vals:
        return None
    return max(vals) - min(vals)


def prior_order(r: Sequence[int], u: np.ndarray, s: Sequence[float], cached: Set[int], J: int,
                boost: np.float32) -> List[int]:
    """prior(lambda): r' = argsort(u + boost * mask, descending), mask = cached or in r[0:J].

    The boost is added in float32 (as the C++ does) to u, the scale the model ranks by (z for
    softmax routers, s for biased-sigmoid ones). Masked experts stay at -inf. Ties in the boosted
    score keep their order in r (a stable sort of r).
    """
    top_j = set(r[:J])
    boosted = {}
    for e in range(len(u)):
        if not is_allowed(s[e]):
            boosted[e] = -math.inf
        elif e in cached or e in top_j:
            boosted[e] = float(np.float32(u[e]) + boost)  # float32 + float32
        else:
            boosted[e] = float(u[e])
    return sorted(r, key=lambda e: -boosted[e])  # sorted() is stable: ties stay in r order


_M64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64, as in moecache-route.cpp (swap-rank's random choice)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def analysis_order(r: List[int], s: np.ndarray, K: int, rank: int, swap: bool, seed: int, il: int,
                   token: int) -> Tuple[List[int], Optional[int]]:
    """drop-rank / swap-rank: (r', replacement) with r' = r with r[rank] moved last; for a swap,
    the replacement (a hashed pick among the allowed experts outside r[0:K], None if there is
    none) moved to position ``rank``."""
    n_allowed = sum(1 for e in r if is_allowed(s[e]))
    repl = None
    if swap and n_allowed > K:
        h = mix64(mix64(((seed << 32) ^ il) & _M64) ^ token)
        repl = r[K + h % (n_allowed - K)]
    out = []
    for i, e in enumerate(r):
        if i == rank and repl is not None:
            out.append(repl)
        if i != rank and e != repl:
            out.append(e)
    return out + [r[rank]], repl


def route_token(z: np.ndarray, p: np.ndarray, s: np.ndarray, routing: Routing, n_expert_used: int,
                cached: Set[int], delta: float, rank_on_logits: bool = True, il: int = 0,
                token: int = 0) -> List[int]:
    """The experts one token runs at one layer, in router order r.

    z, p, s: float32 [N] logits, probabilities, selection scores; cached: the layer's cache
    before this token; delta: Delta_l for the prior, over the tokens before this one (see
    ReferenceCache); rank_on_logits: the prior boosts z (True) or s (False).
    The selected set is r[0:J] plus the first (n_keep - J) other experts of r' (method.md: Top-J is
    applied by every policy); n_keep = K, except prune: min(K, max(R, J)).
    """
    K = n_expert_used
    analysis = isinstance(routing, (DropRank, SwapRank))
    J = 0 if analysis else min(top_j_of(routing, K), K)
    r = rank_experts(s)
    n_keep = K
    if analysis:
        r_final, repl = analysis_order(r, s, K, routing.rank, isinstance(routing, SwapRank),
                                       getattr(routing, "seed", 0), il, token)
        n_keep = K if repl is not None else max(K - 1, 1)  # a swap with nothing to swap in is a drop
    elif isinstance(routing, TopK):
        r_final = r
    elif isinstance(routing, Prune):
        n_keep = min(K, max(routing.rank, J))
        r_final = r
    elif isinstance(routing, MaxRank):
        r_final = max_rank_order(r, s, cached, routing.m)
    elif isinstance(routing, CumsumThreshold):
        r_final = max_rank_order(r, s, cached, cumsum_m(r, p, s, f32(routing.tau)))
    elif isinstance(routing, Prior):
        lam = f32(routing.strength)
        scale = f32(routing.layers[il]) if routing.layers is not None and il < len(routing.layers) else 1.0
        if lam > 0.0 and scale > 0.0:
            # the boost lambda * scale_l * Delta_l is computed in float64 and rounded once to float32
            boost = np.float32(lam * scale * delta)
            u = np.asarray(z if rank_on_logits else s, dtype=np.float32)
            if routing.on_probs:  # prior-p: the probability scale (p, or s for biased routers), no Delta
                boost = np.float32(lam * scale)
                u = np.asarray(p if rank_on_logits else s, dtype=np.float32)
            r_final = prior_order(r, u, s, cached, J, boost)
        else:
            r_final = r  # lambda = 0 is exactly the stock model
    else:
        raise ConfigError(f"unknown routing policy {routing!r}")

    chosen = list(r[:min(J, n_keep)])
    for e in r_final:
        if len(chosen) >= n_keep:
            break
        if e not in chosen:
            chosen.append(e)
    chosen_set = set(chosen)
    return [e for e in r if e in chosen_set]


def _row_sum(row: np.ndarray) -> float:
    """A row's sum in float64, one element at a time in order (as moecache-cache.cpp sums)."""
    total = 0.0
    for v in row:
        total += float(v)
    return total


def update_order(selected: Sequence[int], p: Sequence[float], insertion: str) -> List[int]:
    """The order in which one token's selected experts go through the cache (method.md, "Cache
    update"): by router weight p, highest first ("top-bottom", so the lowest-weight expert ends
    most recent), ties in r order (``selected`` is in r order and sorted() is stable);
    "bottom-top" is exactly the reverse, ties included."""
    order = sorted(selected, key=lambda e: -float(p[e]))
    return order if insertion == "top-bottom" else order[::-1]


# --------------------------------------------------------------------------------------------
# method.md, "Cache update": one layer's LRU cache and counters


@dataclass
class ReferenceLayerStats:
    """The counters of struct moecache_layer_stats, as moecache_get_layer_stats reports them."""

    capacity: int
    occupancy: int
    tokens: int
    selections: int
    hits: int
    misses: int
    evictions: int
    lifetime_count: int  # evicted entries + entries resident now
    lifetime_sum: float  # tokens each stayed: insertion to eviction, or insertion to now
    delta: float         # Delta_l (float32): the running mean over every token routed so far
    pinned: int = 0      # experts pinned now
    pinned_hits: int = 0  # hits on pinned experts
    rerouted: int = 0     # experts run from outside the router's own top K
    p_given_up: float = 0.0  # sum over tokens: router probability of its top K less that of the experts run

    @property
    def lifetime(self) -> float:
        return self.lifetime_sum / self.lifetime_count if self.lifetime_count else 0.0


EVICTIONS = ("lru", "lfu", "activation", "freq-prob", "router-mass")
ACTIVATION_PAST = 0.1  # activation eviction: weight of the profile's share against the request's own


class LayerCache:
    """One layer's cache with its counters, running Delta and eviction usage (the C++
    moecache_layer, src_cpp/moecache-cache.cpp). The simulator's lru_misses replays recorded
    selections through it.

    eviction: which cached expert a miss evicts (CacheConfig.eviction): the lowest score among the
    experts the token does not use and that are not pinned, ties by least recent use (LRU's score
    is 0 for all). n_expert is needed by every policy but LRU (the usage arrays are [n_expert]).
    """

    def __init__(self, capacity: int, n_expert: int = 0, eviction: str = "lru", decay: float = 0.95):
        if eviction not in EVICTIONS:
            raise ConfigError(f"eviction must be one of {', '.join(EVICTIONS)}, got {eviction!r}")
        self.capacity = capacity
        self.eviction = eviction
        self.decay = f32(decay)          # the C++ keeps it in a float field
        self.lru: List[int] = []        # cached experts, least recently used first
        self.inserted_at = {}           # expert -> value of `tokens` when it was inserted
        self.tokens = self.selections = self.hits = self.misses = self.evictions = 0
        self.pinned_hits = 0
        self.rerouted = 0               # experts run from outside the router's own top K
        self.p_given_up = 0.0           # float64, summed in the C++'s order
        self.lifetime_sum = 0.0         # of evicted entries
        self.lifetime_count = 0
        self.delta_sum = 0.0            # running Delta: float64 sum of per-token ranges
        self.delta_n = 0
        self.delta_fixed = 0.0          # > 0: a calibrated Delta used instead of the running mean
        self.delta_last = 0.0
        # eviction usage (kept whatever the policy), float64 like the C++
        self.freq = np.zeros(n_expert)   # decayed count of selections
        self.mass = np.zeros(n_expert)   # decayed sum of router probability
        self.last_p = np.zeros(n_expert, dtype=np.float32)  # the last token's router probabilities
        self.request = np.zeros(n_expert)  # selections in the current request
        self.profile = np.zeros(n_expert)  # selections in past requests
        self.pinned: Set[int] = set()

    def current_delta(self) -> float:
        """The Delta a token is routed with: the running mean over the tokens routed before it (0
        before the first), or the calibrated one."""
        running = self.delta_sum / self.delta_n if self.delta_n > 0 else 0.0
        return self.delta_fixed if self.delta_fixed > 0.0 else running

    def update_delta(self, u: np.ndarray, s: np.ndarray) -> None:
        """Adds a routed token's range of u (after its decision: the next token's Delta). Tokens with
        every expert masked do not count."""
        rng = score_range(u, s)
        if rng is not None:
            self.delta_sum += rng
            self.delta_n += 1

    def observe(self, p: np.ndarray, selected: Sequence[int]) -> None:
        """A token routed: decay the usage, add its router probabilities (NaN, negative: 0) and its
        selection, and count the selection in the current request. Before its insertions."""
        p = np.asarray(p, dtype=np.float32)
        pe = np.where(np.isfinite(p) & (p > 0), p, np.float32(0)).astype(np.float32)
        self.freq = self.freq * self.decay
        self.mass = self.mass * self.decay + pe.astype(np.float64)
        self.last_p = pe
        for e in selected:
            self.freq[e] += 1.0
            self.request[e] += 1.0

    def score(self, e: int) -> float:
        """What the eviction policy keeps: the lowest score goes first."""
        if self.eviction == "lfu":
            return float(self.freq[e])
        if self.eviction == "router-mass":
            return float(self.mass[e])
        if self.eviction == "freq-prob":
            return float(self.freq[e]) * float(self.last_p[e])
        if self.eviction == "activation":
            now_sum, past_sum = _row_sum(self.request), _row_sum(self.profile)
            now = float(self.request[e]) / now_sum if now_sum > 0 else 0.0
            past = float(self.profile[e]) / past_sum if past_sum > 0 else 0.0
            return now + ACTIVATION_PAST * past
        return 0.0

    def victim(self, in_use: Set[int]) -> int:
        """The entry to evict: not in use and not pinned if there is one, else not pinned, else any;
        the lowest score, ties by least recent use (min() keeps the first of the LRU list)."""
        candidates = ([x for x in self.lru if x not in in_use and x not in self.pinned]
                      or [x for x in self.lru if x not in self.pinned] or self.lru)
        return min(candidates, key=self.score)

    def insert(self, e: int, in_use: Set[int] = frozenset()) -> None:
        """A miss: e becomes the most recent entry. When full, the eviction policy picks the victim
        among the entries the current token does not use (see :meth:`victim`).
        Capacity 0 caches nothing. The evicted entry's lifetime ends at `tokens`, the count of
        tokens before the current one."""
        if self.capacity <= 0:
            return
        if len(self.lru) >= self.capacity:
            victim = self.victim(in_use)
            self.lru.remove(victim)
            self.pinned.discard(victim)
            self.lifetime_sum += float(self.tokens - self.inserted_at.pop(victim))
            self.lifetime_count += 1
            self.evictions += 1
        self.lru.append(e)
        self.inserted_at[e] = self.tokens

    def access(self, selected: Sequence[int], p: np.ndarray, insertion: str) -> List[int]:
        """Returns 1/0 (hit/miss) per entry of ``selected``: a hit is an expert that was cached
        when the token was routed. Then the usage is updated (:meth:`observe`) and the selected
        experts are touched in update_order: a hit refreshes its recency, a miss is inserted
        (never evicting an expert this token uses, unless all cached experts are in use). Only
        misses insert."""
        return self.touch(selected, update_order(selected, p, insertion), p)

    def touch(self, selected: Sequence[int], order: Sequence[int], p: Optional[np.ndarray] = None) -> List[int]:
        """:meth:`access` with the order of the updates given (a permutation of ``selected``);
        without ``p`` the usage is not updated (enough for LRU)."""
        was_cached = {e for e in selected if e in self.lru}
        self.pinned_hits += sum(1 for e in selected if e in self.pinned)
        if p is not None:
            self.observe(p, selected)
        in_use = set(selected)
        for e in order:
            if e not in was_cached:
                self.insert(e, in_use)
            elif e in self.lru:  # a hit not already evicted by this token's own misses (cache < K)
                self.lru.remove(e)
                self.lru.append(e)  # refresh recency
        self.hits += len(was_cached)
        self.misses += len(selected) - len(was_cached)
        self.selections += len(selected)
        self.tokens += 1
        return [1 if e in was_cached else 0 for e in selected]

    def empty(self) -> None:
        """Every entry leaves (its lifetime ends now) and the pins go; usage and Delta stay."""
        for e in self.lru:
            self.lifetime_sum += float(self.tokens - self.inserted_at.pop(e))
            self.lifetime_count += 1
        self.lru = []
        self.pinned = set()

    def begin_request(self) -> None:
        """The current request's counts go into the profile and start again."""
        self.profile = self.profile + self.request
        self.request = np.zeros_like(self.request)

    def warm(self, n_pin: int, n_expert_used: int) -> int:
        """Warm start from the profile: empty, then the most selected experts (ties: the more
        recently cached, then the more router mass, then the lower id), at most the capacity,
        inserted coldest first; the n_pin hottest (at most capacity - K) pinned."""
        recency = {e: i for i, e in enumerate(self.lru)}
        hot = sorted((e for e in range(len(self.profile)) if self.profile[e] > 0),
                     key=lambda e: (-self.profile[e], -recency.get(e, -1), -self.mass[e], e))[:max(0, self.capacity)]
        self.empty()
        for e in reversed(hot):
            self.insert(e)
        n = min(n_pin, len(hot), max(0, self.capacity - n_expert_used))
        self.pinned = set(hot[:n])
        return n

    def stats(self) -> ReferenceLayerStats:
        """Counters now; entries resident now count in the lifetimes with their age so far."""
        ages = [self.tokens - self.inserted_at[e] for e in self.lru]
        return ReferenceLayerStats(
            capacity=self.capacity, occupancy=len(self.lru), tokens=self.tokens, selections=self.selections,
            hits=self.hits, misses=self.misses, evictions=self.evictions,
            lifetime_count=self.lifetime_count + len(ages), lifetime_sum=self.lifetime_sum + float(sum(ages)),
            delta=float(np.float32(self.delta_last)), pinned=len(self.pinned), pinned_hits=self.pinned_hits,
            rerouted=self.rerouted, p_given_up=self.p_given_up)


class ReferenceCache:
    """Expert caches of ``n_layer`` MoE layers and a routing policy: the numpy twin of
    ``MoECache.synthetic`` / ``moecache_route``.

    capacity: experts cached per layer (int), or one int per layer; 0 <= capacity <= n_expert.
    insertion: "top-bottom" (default) or "bottom-top".
    routing: a config object (TopK, Prune, MaxRank, CumsumThreshold, Prior) or a spec string.
    """

    def __init__(self, n_layer: int, n_expert: int, n_expert_used: int, capacity: Union[int, Sequence[int]],
                 insertion: str = "top-bottom", routing: Union[Routing, str, None] = None,
                 eviction: str = "lru", eviction_decay: float = 0.95, batch_share: bool = True,
                 batch_prior: float = 3.0):
        if not (1 <= n_expert_used <= n_expert) or n_layer < 1:
            raise ConfigError(f"invalid expert counts: N = {n_expert} routed experts, K = {n_expert_used} used "
                              f"per token, {n_layer} layers")
        caps = [capacity] * n_layer if isinstance(capacity, (int, np.integer)) else list(capacity)
        if len(caps) != n_layer:
            raise ConfigError(f"per-layer cache sizes: got {len(caps)} entries for {n_layer} layers")
        for il, c in enumerate(caps):
            if not 0 <= c <= n_expert:
                raise ConfigError(f"cache size {c} (layer {il}) must be in [0, {n_expert}], the routed experts "
                                  "of the model")
        if insertion not in INSERTIONS:
            raise ConfigError(f"insertion must be 'top-bottom' or 'bottom-top', got {insertion!r}")
        self.n_layer, self.n_expert, self.n_expert_used = n_layer, n_expert, n_expert_used
        self.insertion = insertion
        self.batch_share = batch_share  # route_step: the other sequences' selections count as cached
        self.batch_prior = batch_prior  #   and the prior's strength is this many times alone's
        self.layers = [LayerCache(int(c), n_expert, eviction, eviction_decay) for c in caps]
        self.set_routing(routing if routing is not None else TopK())

    def set_routing(self, routing: Union[Routing, str]) -> None:
        """Change the policy (next token on), validated like moecache_set_routing."""
        if isinstance(routing, str):
            routing = parse_routing(routing)
        if not isinstance(routing, (TopK, Prune, MaxRank, CumsumThreshold, Prior, DropRank, SwapRank)):
            raise ConfigError(f"unknown routing policy {routing!r}")
        if isinstance(routing, (DropRank, SwapRank)) and routing.rank >= self.n_expert_used:
            raise ConfigError(f"analysis rank i = {routing.rank} is out of range: the model uses K = "
                              f"{self.n_expert_used} experts per token (0 <= i < K)")
        if isinstance(routing, DropRank) and self.n_expert_used < 2:
            raise ConfigError("drop-rank needs a model with at least 2 experts per token")
        if isinstance(routing, Prior) and routing.layers is not None and len(routing.layers) > self.n_layer:
            raise ConfigError(f"{routing.spec()} gives {len(routing.layers)} per-layer scales; there are "
                              f"{self.n_layer} layers")
        if top_j_of(routing, self.n_expert_used) > self.n_expert_used:
            raise ConfigError(f"top_j = {top_j_of(routing, self.n_expert_used)} is out of range: the model uses K = "
                              f"{self.n_expert_used} experts per token (0 <= top_j <= K)")
        self.routing = routing

    def set_prior_delta(self, delta: Optional[Sequence[float]]) -> None:
        """Fixed per-layer Delta_l (entries <= 0 keep the running mean); None restores the running mean."""
        vals = [] if delta is None else [f32(d) for d in delta]
        for il, L in enumerate(self.layers):
            d = vals[il] if il < len(vals) else 0.0
            L.delta_fixed = d if d > 0.0 and math.isfinite(d) else 0.0

    def route_one(self, il: int, z: np.ndarray, p: np.ndarray, s: np.ndarray,
                  rank_on_logits: bool = True, others: Set[int] = frozenset()) -> Tuple[List[int], List[int]]:
        """Routes one token through layer ``il``: (selected in r order, 1/0 hit per selected).
        ``others``: experts preferred as if cached (a batch's other sequences' selections, route_step)."""
        L = self.layers[il]
        u = z if rank_on_logits else s  # the scale the prior boosts and Delta measures
        selected = route_token(z, p, s, self.routing, self.n_expert_used, set(L.lru) | set(others),
                               L.current_delta(), rank_on_logits, il=il, token=L.tokens)
        L.update_delta(u, s)            # every policy keeps Delta up to date, for the tokens after this one
        L.delta_last = L.current_delta()
        # what the policy cost this token against the router's own top K (float64 sums, r order)
        r = rank_experts(s)
        K = self.n_expert_used
        top = [e for e in r[:K] if is_allowed(s[e])]  # (masked experts rank last)
        p_top = p_run = 0.0
        for e in top:
            p_top += float(p[e]) if np.isfinite(p[e]) else 0.0
        for e in selected:
            L.rerouted += 1 if r.index(e) >= K else 0
            p_run += float(p[e]) if np.isfinite(p[e]) else 0.0
        L.p_given_up += p_top - p_run
        return selected, L.access(selected, p, self.insertion)

    def route(self, il: int, logits: np.ndarray, probs: Optional[np.ndarray] = None,
              scores: Optional[np.ndarray] = None, rank_on_logits: bool = True) -> Tuple[np.ndarray, np.ndarray]:
        """Same contract as ``MoECache.route``: ``[n_tokens, n_expert]`` inputs (probs default to
        softmax(logits), scores to probs), tokens in order; returns ``(selected, hits)``, both
        ``[n_tokens, K]``, selected in r order, dropped slots -1 in both."""
        z = np.ascontiguousarray(np.atleast_2d(logits), dtype=np.float32)
        p = softmax_f32(z) if probs is None else np.ascontiguousarray(np.atleast_2d(probs), dtype=np.float32)
        s = p if scores is None else np.ascontiguousarray(np.atleast_2d(scores), dtype=np.float32)
        if z.shape[1] != self.n_expert or p.shape != z.shape or s.shape != z.shape:
            raise ValueError(f"logits, probs and scores must have the same shape [n_tokens, {self.n_expert}]")
        K = self.n_expert_used
        sel = np.full((z.shape[0], K), -1, dtype=np.int32)
        hits = np.full((z.shape[0], K), -1, dtype=np.int8)
        for t in range(z.shape[0]):
            chosen, hit = self.route_one(il, z[t], p[t], s[t], rank_on_logits)
            sel[t, :len(chosen)] = chosen
            hits[t, :len(hit)] = hit
        return sel, hits

    def route_step(self, il: int, logits: np.ndarray, probs: Optional[np.ndarray] = None,
                   scores: Optional[np.ndarray] = None, rank_on_logits: bool = True) -> Tuple[np.ndarray, np.ndarray]:
        """As :meth:`route`, the rows being one decode step of several sequences (a batch, one token of
        each), as ``MoECache.route(step=True)`` routes them. With ``batch_share`` and a policy that prefers
        cached experts (prior, max-rank, cumsum), two passes: the first routes every row against the cache
        as it is and changes nothing (Delta included); the second routes each row in order, as route does,
        with the experts the other rows selected in the first pass preferred as if cached; the prior's
        strength is ``batch_prior`` times its own for the step."""
        z = np.ascontiguousarray(np.atleast_2d(logits), dtype=np.float32)
        p = softmax_f32(z) if probs is None else np.ascontiguousarray(np.atleast_2d(probs), dtype=np.float32)
        s = p if scores is None else np.ascontiguousarray(np.atleast_2d(scores), dtype=np.float32)
        if not (self.batch_share and z.shape[0] > 1 and isinstance(self.routing, (Prior, MaxRank, CumsumThreshold))):
            return self.route(il, z, p, s, rank_on_logits)
        routing = self.routing
        if isinstance(routing, Prior):  # (batch_prior: lambda x batch_prior, one float32 product, as the C++)
            self.routing = dataclasses.replace(routing, strength=float(np.float32(f32(routing.strength))
                                                                         * np.float32(f32(self.batch_prior))))
        try:
            return self._route_step_shared(il, z, p, s, rank_on_logits)
        finally:
            self.routing = routing

    def _route_step_shared(self, il, z, p, s, rank_on_logits):
        L = self.layers[il]
        saved = (L.delta_sum, L.delta_n)
        first = []
        for t in range(z.shape[0]):
            first.append(route_token(z[t], p[t], s[t], self.routing, self.n_expert_used, set(L.lru),
                                     L.current_delta(), rank_on_logits, il=il, token=L.tokens))
            L.update_delta(z[t] if rank_on_logits else s[t], s[t])
        L.delta_sum, L.delta_n = saved
        K = self.n_expert_used
        sel = np.full((z.shape[0], K), -1, dtype=np.int32)
        hits = np.full((z.shape[0], K), -1, dtype=np.int8)
        for t in range(z.shape[0]):
            others = {e for u, f in enumerate(first) if u != t for e in f}
            chosen, hit = self.route_one(il, z[t], p[t], s[t], rank_on_logits, others)
            sel[t, :len(chosen)] = chosen
            hits[t, :len(hit)] = hit
        return sel, hits

    def set_eviction(self, eviction: str, decay: Optional[float] = None) -> None:
        """Change the eviction policy of every layer (as MoECache.set_eviction)."""
        if eviction not in EVICTIONS:
            raise ConfigError(f"eviction must be one of {', '.join(EVICTIONS)}, got {eviction!r}")
        for L in self.layers:
            L.eviction = eviction
            L.decay = L.decay if decay is None else f32(decay)

    def begin_request(self) -> None:
        for L in self.layers:
            L.begin_request()

    def warm_start(self, pin_hot: int = 0) -> int:
        """As MoECache.warm_start: returns the experts pinned over all layers."""
        return sum(L.warm(pin_hot, self.n_expert_used) for L in self.layers)

    def profile_counts(self) -> np.ndarray:
        return np.array([L.profile for L in self.layers])

    def cached(self, il: int) -> List[int]:
        """Experts cached in layer ``il``, least recently used first (as MoECache.cached)."""
        return list(self.layers[il].lru)

    def layer_stats(self, il: int) -> ReferenceLayerStats:
        return self.layers[il].stats()

    def stats(self) -> List[ReferenceLayerStats]:
        return [L.stats() for L in self.layers]
