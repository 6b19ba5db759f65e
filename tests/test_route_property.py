"""The C++ router/cache (MoECache.synthetic(...).route) against the numpy reference
(pymoecache.reference), plus invariants that must hold whatever the implementation.

Random router outputs come from a numpy generator seeded by hypothesis (arrays of up to
40 x 96 values shrink badly element by element); a failing example prints the seed and every
knob, which is enough to replay it.
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pymoecache import _moecache_cpp as C  # noqa: E402
from pymoecache.config import (CacheConfig, ConfigError, CumsumThreshold, DropRank, MaxRank, SwapRank, Prior, Prune,  # noqa: E402
                               TopK)
from pymoecache.llama import MoECache  # noqa: E402
from pymoecache.reference import ReferenceCache  # noqa: E402

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
POLICIES = ("topk", "prune", "max-rank", "cumsum", "prior")


# --------------------------------------------------------------------------------------------
# random scenarios


@dataclass
class Scenario:
    N: int
    K: int
    J: int
    routing: object
    capacity: int
    insertion: str
    rank_on_logits: bool
    n_layer: int
    batches: List[int]       # tokens per route() call
    values: str              # how logits are drawn
    mask: str                # "none", "-inf" or "nan"
    n_masked: int            # experts masked per token (so N - n_masked >= K stay allowed)
    bias: str                # rank_on_logits=False: bias added to sigmoid(z)
    seed: int
    fixed_delta: Optional[List[float]] = None  # set_prior_delta (<= 0: running mean for that layer)
    eviction: str = "lru"
    decay: float = 0.95
    new_requests: bool = False  # begin_request after every batch (activation eviction, the profile)
    pin: Optional[int] = None   # warm_start(pin) from the profile after the first batch


def make_policy(draw, kind: str, N: int, K: int, J: int, max_m: Optional[int] = None, n_layer: int = 1):
    if kind == "topk":
        return TopK()
    if kind == "prune":
        return Prune(draw(st.integers(1, K + 2)), top_j=J)
    if kind == "max-rank":
        return MaxRank(draw(st.integers(0, N + 2 if max_m is None else max_m)), top_j=J)
    if kind == "drop-rank":
        return DropRank(draw(st.integers(0, K - 1)))
    if kind == "swap-rank":
        return SwapRank(draw(st.integers(0, K - 1)), seed=draw(st.integers(0, 2**32 - 1)))
    if kind == "cumsum":
        return CumsumThreshold(draw(st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0))), top_j=J)
    # exact binary fractions make boosted scores tie with unboosted ones (ties resolve by rank in r)
    # per-layer scales (moecache_set_prior_scale): 0 switches a layer's prior off, 1 is the flat prior
    layers = draw(st.one_of(st.none(), st.lists(st.one_of(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.75]),
                                                          st.floats(0.0, 4.0)), min_size=1, max_size=n_layer)))
    return Prior(draw(st.one_of(st.just(0.0), st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]), st.floats(0.0, 3.0))),
                 top_j=J, layers=layers, on_probs=draw(st.booleans()))  # prior-p: the boost in probability


VALUES = ("normal", "small-int", "binary", "near-int", "wide", "peaked")


@st.composite
def scenarios(draw, kinds=POLICIES, mask_ok=True, min_n=2, max_n=96, values=VALUES,
              biases=("none", "normal", "coarse"), evictions=("lru",)):
    N = draw(st.integers(min_n, max_n))
    K = draw(st.integers(1, min(N, 8)))
    J = draw(st.integers(0, K))
    kind = draw(st.sampled_from(kinds))
    mask = draw(st.sampled_from(("none", "-inf", "nan") if mask_ok else ("none",)))
    n_masked = draw(st.integers(1, N - K)) if mask != "none" and N > K else 0
    mask = mask if n_masked else "none"
    max_m = None  # m may reach past the allowed experts: masked ones must still never be promoted
    n_layer = draw(st.integers(1, 3))
    return Scenario(
        N=N, K=K, J=J, routing=make_policy(draw, kind, N, K, J, max_m, n_layer),
        capacity=draw(st.integers(0, N)),
        insertion=draw(st.sampled_from(("top-bottom", "bottom-top"))),
        rank_on_logits=draw(st.booleans()),
        n_layer=n_layer,
        batches=draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)),
        values=draw(st.sampled_from(values)),
        mask=mask, n_masked=n_masked,
        bias=draw(st.sampled_from(biases)),
        seed=draw(st.integers(0, 2**32 - 1)),
        fixed_delta=draw(st.one_of(st.none(), st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.75]), max_size=3))),
        eviction=draw(st.sampled_from(evictions)),
        decay=draw(st.sampled_from([1.0, 0.95, 0.5, 0.3])),
        new_requests=draw(st.booleans()) if evictions != ("lru",) else False,
        pin=draw(st.one_of(st.none(), st.integers(0, 6))) if evictions != ("lru",) else None)


def router_outputs(rng: np.random.Generator, sc: Scenario, T: int, bias: np.ndarray):
    """(z, p, s) float32 [T, N]; s is None when it equals p."""
    N = sc.N
    if sc.values == "small-int":      # many exact ties
        z = rng.integers(-2, 3, size=(T, N)).astype(np.float32)
    elif sc.values == "binary":       # ties everywhere, and Delta = 1 (or 0) exactly
        z = rng.integers(0, 2, size=(T, N)).astype(np.float32)
    elif sc.values == "near-int":     # distinct values closer than a float32 step after the boost
        z = (rng.integers(-2, 3, size=(T, N)) + rng.normal(size=(T, N)) * 1e-6).astype(np.float32)
    elif sc.values == "wide":         # softmax underflows to exact zeros: ties in p, not in z
        z = (rng.normal(size=(T, N)) * 40).astype(np.float32)
    elif sc.values == "peaked":       # one dominant expert per token
        z = rng.normal(size=(T, N)).astype(np.float32)
        z[np.arange(T), rng.integers(0, N, T)] += 6
    else:
        z = (rng.normal(size=(T, N)) * rng.choice([0.5, 2.0])).astype(np.float32)
    if sc.rank_on_logits:
        e = np.exp(z - z.max(axis=1, keepdims=True))
        p = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
        # the C API allows a biased s while the prior boosts z; then r (by s) and z disagree
        s = None if sc.bias == "none" else (p + bias).astype(np.float32)
    else:
        p = (1.0 / (1.0 + np.exp(-z.astype(np.float64)))).astype(np.float32)
        s = (p + bias).astype(np.float32)
    if sc.mask != "none":
        s = p.copy() if s is None else s
        for t in range(T):
            s[t, rng.choice(N, size=sc.n_masked, replace=False)] = -np.inf if sc.mask == "-inf" else np.nan
    return z, p, s


def make_bias(rng, sc: Scenario) -> np.ndarray:
    if sc.bias == "normal":
        return (rng.normal(size=sc.N) * 0.1).astype(np.float32)
    if sc.bias == "coarse":
        return (rng.integers(0, 2, size=sc.N) * 0.25).astype(np.float32)
    return np.zeros(sc.N, np.float32)


def native(sc: Scenario, routing=None, capacity=None) -> MoECache:
    return MoECache.synthetic(sc.n_layer, sc.N, sc.K, routing=routing or sc.routing,
                              cache=CacheConfig(size=sc.capacity if capacity is None else capacity,
                                                insertion=sc.insertion, eviction=sc.eviction,
                                                eviction_decay=sc.decay))


def reference(sc: Scenario, routing=None, capacity=None) -> ReferenceCache:
    return ReferenceCache(sc.n_layer, sc.N, sc.K, sc.capacity if capacity is None else capacity,
                          insertion=sc.insertion, routing=routing or sc.routing, eviction=sc.eviction,
                          eviction_decay=sc.decay)


ENGINES = ("native", "reference")


def make(engine: str, sc: Scenario, routing=None, capacity=None):
    return (native if engine == "native" else reference)(sc, routing, capacity)


def native_layer_stats(mc: MoECache, il: int):
    ls = C.moecache_layer_stats()
    assert C.moecache_get_layer_stats(mc._h, il, ctypes.byref(ls)) == C.MOECACHE_OK
    return ls


def ranking(s: np.ndarray) -> np.ndarray:
    """r computed independently of both implementations: s descending, masked last, ties by id."""
    allowed = s > -np.inf
    return np.lexsort((np.arange(s.size), np.where(allowed, -s, 0.0), ~allowed))


def n_keep(sc: Scenario) -> int:
    if isinstance(sc.routing, Prune):
        return min(sc.K, max(sc.routing.rank, sc.J))
    return sc.K


def drive(sc: Scenario, caches, per_batch=None, step: bool = False):
    """Routes every batch of every layer through each cache in ``caches`` (same inputs); calls
    per_batch(outputs, inputs) with outputs[i][il] = (sel, hits) of caches[i]. Between batches,
    a new request begins (sc.new_requests) and, after the first, the caches start warm from their
    profile with sc.pin experts pinned per layer."""
    rng = np.random.default_rng(sc.seed)
    bias = [make_bias(rng, sc) for _ in range(sc.n_layer)]
    for b, T in enumerate(sc.batches):
        for c in caches:
            if b > 0 and sc.new_requests:
                c.begin_request()
            if b == 1 and sc.pin is not None:
                c.warm_start(sc.pin)
        inputs, outputs = [], [[] for _ in caches]
        for il in range(sc.n_layer):
            z, p, s = router_outputs(rng, sc, T, bias[il])
            inputs.append((z, p, s))
            for i, c in enumerate(caches):
                if step:  # each batch one decode step of several sequences (Llama(n_seq_max=...) decodes so)
                    outputs[i].append(c.route(il, z, p, s, rank_on_logits=sc.rank_on_logits, step=True)
                                      if isinstance(c, MoECache) else c.route_step(il, z, p, s, sc.rank_on_logits))
                else:
                    outputs[i].append(c.route(il, z, p, s, rank_on_logits=sc.rank_on_logits))
        if per_batch:
            per_batch(outputs, inputs)


# --------------------------------------------------------------------------------------------
# C++ == reference


def assert_same_state(mc: MoECache, rc: ReferenceCache, n_layer: int) -> None:
    st_c = mc.stats()
    assert list(st_c.moe_layers) == list(range(n_layer))
    for il in range(n_layer):
        ref = rc.layer_stats(il)
        got = dict(capacity=st_c.capacity_per_layer[il], occupancy=st_c.occupancy_per_layer[il],
                   tokens=st_c.tokens_per_layer[il], selections=st_c.selections_per_layer[il],
                   hits=st_c.hits_per_layer[il], misses=st_c.misses_per_layer[il],
                   evictions=st_c.evictions_per_layer[il])
        want = {k: getattr(ref, k) for k in got}
        assert {k: int(v) for k, v in got.items()} == want, f"layer {il}"
        ls = native_layer_stats(mc, il)
        assert ls.lifetime_count == ref.lifetime_count, f"layer {il}"
        assert abs(ls.lifetime_sum - ref.lifetime_sum) <= 1e-9, f"layer {il}"
        assert np.float32(ls.delta) == np.float32(ref.delta), f"layer {il}: Delta"
        assert mc.cached(il) == rc.cached(il), f"layer {il}: LRU order"
        assert (ls.pinned, ls.pinned_hits) == (ref.pinned, ref.pinned_hits), f"layer {il}: pins"
        assert ls.rerouted == ref.rerouted, f"layer {il}: experts run from outside the top K"
        assert ls.p_given_up == ref.p_given_up, f"layer {il}: router probability given up"
    np.testing.assert_array_equal(mc.profile_counts(), rc.profile_counts())


@settings(max_examples=800, **SETTINGS)
@given(sc=scenarios())
def test_cpp_matches_reference(sc: Scenario):
    assert_matches_reference(sc)


def assert_matches_reference(sc: Scenario, step: bool = False) -> None:
    """The C++ and the reference route sc's batches alike (``step``: each batch one decode step of
    several sequences) and end in the same state."""
    mc, rc = native(sc), reference(sc)
    if sc.fixed_delta is not None:
        for c in (mc, rc):
            c.set_prior_delta(np.array(sc.fixed_delta[:sc.n_layer], dtype=np.float32))

    def check(outputs, inputs):
        for il in range(sc.n_layer):
            (sel_c, hit_c), (sel_r, hit_r) = outputs[0][il], outputs[1][il]
            np.testing.assert_array_equal(sel_c, sel_r, err_msg=f"layer {il}: selected experts")
            np.testing.assert_array_equal(hit_c, hit_r, err_msg=f"layer {il}: hit masks")
        assert_same_state(mc, rc, sc.n_layer)

    drive(sc, [mc, rc], check, step=step)


@settings(max_examples=400, **SETTINGS)
@given(sc=scenarios())
def test_cpp_matches_reference_batched_steps(sc: Scenario):
    """A batch of sequences' decode step (batch_share: two passes, the others' selections preferred as if
    cached) routes the same in C++ as in the reference, and differs from the rows routed one by one only
    where a policy prefers cached experts."""
    assert_matches_reference(sc, step=True)
    if isinstance(sc.routing, (TopK, Prune)):  # nothing to prefer: a step is its rows one by one
        outs = []
        drive(sc, [native(sc)], lambda o, i: outs.append(o[0]))
        mc2 = native(sc)
        drive(sc, [mc2], lambda o, i: np.testing.assert_array_equal(
            np.concatenate([x[0] for x in o[0]]), np.concatenate([x[0] for x in outs.pop(0)])), step=True)


def test_batch_share_prefers_what_another_sequence_selects():
    """Hand-made: two sequences, a cache that holds nothing. Routed one after the other, the first takes
    its own top 2; in a step, the expert the second one selects is as good as cached, and the prior
    takes it (the second still routes after the first's insertions, in both)."""
    z = np.array([[-9.0, 2.85, 3.0, 2.9], [4.0, 3.0, -9.0, -9.0]], dtype=np.float32)  # (1: near token 0's 2nd)
    for share in (True, False):
        cache = CacheConfig(size=2, batch_share=share)
        mc = MoECache.synthetic(1, 4, 2, routing=Prior(5.0, top_j=1), cache=cache)
        rc = ReferenceCache(1, 4, 2, 2, routing=Prior(5.0, top_j=1), batch_share=share)
        for c in (mc, rc):  # (a calibrated Delta: a layer's first token has no running one yet)
            c.set_prior_delta(np.array([12.0], dtype=np.float32))
        sel, _ = mc.route(0, z, step=True)
        ref, _ = rc.route_step(0, z)
        np.testing.assert_array_equal(sel, ref)
        assert sel[0].tolist() == ([2, 1] if share else [2, 3])  # (in router order)


@settings(max_examples=300, **SETTINGS)
@given(sc=scenarios(values=("normal", "peaked"), biases=("none", "normal"),
                    evictions=("lfu", "activation", "freq-prob", "router-mass", "lru")),
       relabel_seed=st.integers(0, 2**32 - 1))
def test_expert_numbering_decides_only_exact_ties(sc: Scenario, relabel_seed: int):
    """Issue 53 item 12: the same router outputs with the experts numbered otherwise (columns
    permuted, every float as it was) give the same decisions, renumbered: selections, hits and
    the cache's order. Only an exact tie (equal floats) may go by expert id (docs/method.md,
    "Expert numbering"), so the draws here have none."""
    perm = np.random.default_rng(relabel_seed).permutation(sc.N)  # new expert j is old expert perm[j]
    mc, mc2 = native(sc), native(sc)
    rng = np.random.default_rng(sc.seed)
    bias = [make_bias(rng, sc) for _ in range(sc.n_layer)]
    for b, T in enumerate(sc.batches):
        for c in (mc, mc2):
            if b > 0 and sc.new_requests:
                c.begin_request()
            if b == 1 and sc.pin is not None:
                c.warm_start(sc.pin)
        for il in range(sc.n_layer):
            z, p, s = router_outputs(rng, sc, T, bias[il])
            for row in (z, p, s):
                if row is not None:  # no exact ties among the allowed experts (and no p underflowing to 0)
                    assume(all(len(np.unique(r[r > -np.inf])) == np.count_nonzero(r > -np.inf) for r in row))
            sel, hit = mc.route(il, z, p, s, rank_on_logits=sc.rank_on_logits)
            sel2, hit2 = mc2.route(il, z[:, perm], p[:, perm], None if s is None else s[:, perm],
                                   rank_on_logits=sc.rank_on_logits)
            np.testing.assert_array_equal(np.where(sel2 >= 0, perm[sel2], sel2), sel, err_msg=f"layer {il}: selections")
            np.testing.assert_array_equal(hit2, hit, err_msg=f"layer {il}: hits")
            assert [int(perm[e]) for e in mc2.cached(il)] == list(mc.cached(il)), f"layer {il}: cache order"


@settings(max_examples=600, **SETTINGS)
@given(sc=scenarios(kinds=POLICIES + ("drop-rank", "swap-rank"), max_n=40,
                    evictions=("lfu", "activation", "freq-prob", "router-mass", "lru")))
def test_cpp_matches_reference_every_eviction(sc: Scenario):
    """Every eviction policy, composed with every routing policy (the analysis ones too), with new
    requests and warm starts with pins between batches: same selections, hits, victims (the cache
    contents in recency order), counters, lifetimes, pins and profile."""
    assume(sc.K >= 2 or not isinstance(sc.routing, DropRank))
    test_cpp_matches_reference.hypothesis.inner_test(sc)


@settings(max_examples=300, **SETTINGS)
@given(sc=scenarios(kinds=("prior",), max_n=12, values=("binary", "small-int", "near-int", "near-int"),
                    biases=("normal", "coarse")))
def test_cpp_matches_reference_prior_ties(sc: Scenario):
    """Few experts, tied or nearly tied logits, s biased away from z: boosted scores tie (ties go
    by rank in r, not by id) and the float32 rounding of z + boost decides the order."""
    test_cpp_matches_reference.hypothesis.inner_test(sc)


@settings(max_examples=300, **SETTINGS)
@given(sc=scenarios(kinds=("drop-rank", "swap-rank"), min_n=3))
def test_cpp_matches_reference_analysis_policies(sc: Scenario):
    """drop-rank / swap-rank (rank sensitivity analysis): same experts, hits and LRU state, and
    the removed rank is really gone: drop runs K - 1 experts without r[i]; swap runs r[0:K]
    without r[i] plus one allowed expert from outside r[0:K] (if any is left)."""
    assume(sc.K >= 2)  # drop-rank needs two experts per token
    test_cpp_matches_reference.hypothesis.inner_test(sc)
    rc = reference(sc)
    rng = np.random.default_rng(sc.seed)
    for T in sc.batches:
        z, p, s = router_outputs(rng, sc, T, make_bias(rng, sc))
        sel, _ = rc.route(0, z, p, s, rank_on_logits=sc.rank_on_logits)
        for t in range(T):
            st_ = p[t] if s is None else s[t]
            r = ranking(st_)
            got = [e for e in sel[t] if e >= 0]
            top = set(r[:sc.K].tolist())
            gone = int(r[sc.routing.rank])
            assert gone not in got
            if isinstance(sc.routing, DropRank):
                assert set(got) == top - {gone}
            else:
                n_allowed = int(np.sum(st_ > -np.inf))
                extra = set(got) - top
                assert len(got) == sc.K - (0 if n_allowed > sc.K else 1)
                assert len(extra) == (1 if n_allowed > sc.K else 0)
                assert all(st_[e] > -np.inf for e in extra)


@pytest.mark.parametrize("engine", ENGINES)
def test_prior_boost_is_added_in_float32(engine):
    """z_b = z_a + 2^-23; after the float32 addition of the boost (1.625) both are 2.625, so the
    tie goes to the expert ranked first in r (a, by its biased score). In float64 b would win."""
    eps = np.float32(2.0**-23)
    z = np.array([[1, 1 + eps, -1, -1], [1, 1 + eps, 3.5, -1]], dtype=np.float32)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    s = p.copy()
    s[1, :2] = [0.9, 0.8]
    sc = Scenario(N=4, K=2, J=0, routing=Prior(0.5, top_j=0), capacity=2, insertion="top-bottom",
                  rank_on_logits=True, n_layer=1, batches=[2], values="normal", mask="none", n_masked=0,
                  bias="none", seed=0)
    sel, hits = make(engine, sc).route(0, z, p, s)
    assert sel.tolist() == [[1, 0], [0, 2]]
    assert hits.tolist() == [[0, 0], [1, 0]]


def test_reference_matches_cpp_on_a_hand_made_prior_case():
    """Readable anchor for the property above: Prior keeps a cached expert over a better one."""
    z = np.array([[3.0, 2.0, 1.0, 0.0], [3.0, 1.5, 2.0, 0.0]], dtype=np.float32)
    for cache in (MoECache.synthetic(1, 4, 2, cache=CacheConfig(size=2), routing=Prior(1.0, top_j=1)),
                  ReferenceCache(1, 4, 2, 2, routing=Prior(1.0, top_j=1))):
        sel, hits = cache.route(0, z)
        assert sel.tolist() == [[0, 1], [0, 1]]
        assert hits.tolist() == [[0, 0], [1, 1]]
        assert cache.cached(0) == [0, 1]  # top-bottom: 0 (higher p) first, 1 most recent


# --------------------------------------------------------------------------------------------
# invariants (checked on both implementations)

def counters(cache, il: int) -> dict:
    if isinstance(cache, ReferenceCache):
        r = cache.layer_stats(il)
        return dict(tokens=r.tokens, selections=r.selections, hits=r.hits, misses=r.misses, evictions=r.evictions)
    ls = native_layer_stats(cache, il)
    return dict(tokens=ls.tokens, selections=ls.selections, hits=ls.hits, misses=ls.misses, evictions=ls.evictions)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=60, **SETTINGS)
@given(sc=scenarios())
def test_counter_and_selection_invariants(engine, sc: Scenario):
    cache = make(engine, sc)
    seen_hits = [0] * sc.n_layer

    def check(outputs, inputs):
        for il in range(sc.n_layer):
            sel, hits = outputs[0][il]
            z, p, s = inputs[il]
            s = p if s is None else s
            for t in range(sel.shape[0]):
                row = sel[t][sel[t] >= 0]
                # exactly n_keep experts run (prune: min(K, max(R, J)) <= max(R, J)); dropped slots last
                assert row.size == n_keep(sc)
                assert (sel[t][row.size:] == -1).all() and (hits[t][row.size:] == -1).all()
                assert set(hits[t][:row.size].tolist()) <= {0, 1}
                assert len(set(row.tolist())) == row.size
                r = ranking(s[t])
                pos = np.empty(sc.N, dtype=np.int64)
                pos[r] = np.arange(sc.N)
                assert (np.diff(pos[row]) > 0).all(), "selected experts are not in router order"
                # Top-J: the router's J favourites always run, under every policy
                assert set(r[:sc.J].tolist()) <= set(row.tolist())
            seen_hits[il] += int((hits == 1).sum())
            c = counters(cache, il)
            assert c["hits"] + c["misses"] == c["selections"]
            assert c["selections"] == n_keep(sc) * c["tokens"]
            if not isinstance(sc.routing, Prune):
                assert c["selections"] == sc.K * c["tokens"]
            assert c["hits"] == seen_hits[il]
            assert c["evictions"] <= c["misses"]

    drive(sc, [cache], check)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=40, **SETTINGS)
@given(sc=scenarios())
def test_cache_of_all_experts_misses_each_expert_at_most_once(engine, sc: Scenario):
    cache = make(engine, sc, capacity=sc.N)
    misses_of = np.zeros((sc.n_layer, sc.N), dtype=np.int64)
    used = [set() for _ in range(sc.n_layer)]

    def check(outputs, inputs):
        for il in range(sc.n_layer):
            sel, hits = outputs[0][il]
            np.add.at(misses_of[il], sel[hits == 0], 1)
            used[il] |= set(sel[sel >= 0].tolist())
            c = counters(cache, il)
            assert misses_of[il].max() <= 1
            assert c["misses"] == len(used[il])
            assert c["evictions"] == 0

    drive(sc, [cache], check)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=40, **SETTINGS)
@given(sc=scenarios(kinds=("prior",), mask_ok=False), lam=st.sampled_from([1e6, 1e5]))
def test_huge_prior_with_full_cache_only_hits_once_warm(engine, sc: Scenario, lam):
    """capacity N, J = 0, lambda huge: once K experts are cached, the K best cached ones always
    outrank every uncached expert, so every selection is a hit."""
    # needs Delta > 0: no all-tied tokens ("small-int"), no saturated sigmoids ("wide")
    sc = replace(sc, J=0, routing=Prior(lam, top_j=0),
                 values=sc.values if sc.values in ("normal", "peaked") else "normal")
    cache = make(engine, sc, capacity=sc.N)
    rng = np.random.default_rng(sc.seed)
    bias = make_bias(rng, sc)
    for T in sc.batches:
        z, p, s = router_outputs(rng, sc, T, bias)
        for t in range(T):
            warm = len(cache.cached(0)) >= sc.K
            sel, hits = cache.route(0, z[t:t + 1], p[t:t + 1], None if s is None else s[t:t + 1],
                                    rank_on_logits=sc.rank_on_logits)
            if warm:
                assert (hits == 1).all(), (t, sel, hits, cache.cached(0))


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=40, **SETTINGS)
@given(sc=scenarios(kinds=("prune",)))
def test_prune_never_runs_more_than_max_r_j(engine, sc: Scenario):
    cache = make(engine, sc)
    R = sc.routing.rank

    def check(outputs, inputs):
        for il in range(sc.n_layer):
            sel, _ = outputs[0][il]
            n_run = (sel >= 0).sum(axis=1)
            assert (n_run <= max(R, sc.J)).all()
            # prune keeps the router's favourites: the selection is r[0:n_keep]
            z, p, s = inputs[il]
            s = p if s is None else s
            for t in range(sel.shape[0]):
                assert sel[t][:n_run[t]].tolist() == ranking(s[t])[:n_run[t]].tolist()

    drive(sc, [cache], check)


@settings(max_examples=40, **SETTINGS)
@given(sc=scenarios(kinds=("prior",)))
def test_prior_with_lambda_zero_is_exactly_top_k(sc: Scenario):
    sc = replace(sc, routing=Prior(0.0, top_j=sc.J))
    caches = [native(sc), native(sc, routing=TopK()), reference(sc)]

    def check(outputs, inputs):
        for il in range(sc.n_layer):
            z, p, s = inputs[il]
            s = p if s is None else s
            stock = np.array([ranking(row)[:sc.K] for row in s], dtype=np.int32)
            for out in outputs:
                np.testing.assert_array_equal(out[il][0], stock)
                np.testing.assert_array_equal(out[il][1], outputs[1][il][1])
        for il in range(sc.n_layer):
            assert counters(caches[0], il) == counters(caches[1], il) == counters(caches[2], il)
            assert caches[0].cached(il) == caches[1].cached(il) == caches[2].cached(il)

    drive(sc, caches, check)


# --------------------------------------------------------------------------------------------
# masked experts (s = -inf / NaN) may never run


def _masked_case():
    """N = 4, K = 2, max-rank m = 4, J = 0: expert 3 is cached at token 0, masked at token 1."""
    sc = Scenario(N=4, K=2, J=0, routing=MaxRank(4, top_j=0), capacity=4, insertion="top-bottom",
                  rank_on_logits=True, n_layer=1, batches=[2], values="normal", mask="-inf", n_masked=1,
                  bias="none", seed=0)
    z = np.array([[0.0, 1.0, 2.0, 3.0]] * 2, dtype=np.float32)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    s = p.copy()
    s[1, 3] = -np.inf
    return sc, z, p, s


@pytest.mark.parametrize("engine", ENGINES)
def test_masked_expert_is_never_selected_minimal(engine):
    """Regression: max-rank once promoted a cached expert that the mask excluded (it selected
    [2, 3] at token 1 although expert 3 is masked). Expected: [2, 1]."""
    sc, z, p, s = _masked_case()
    cache = make(engine, sc)
    sel, _ = cache.route(0, z, p, s)
    assert sel.tolist() == [[3, 2], [2, 1]]


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=60, **SETTINGS)
@given(sc=scenarios(min_n=3).filter(lambda sc: sc.mask != "none"))
def test_masked_experts_are_never_selected(engine, sc: Scenario):
    if isinstance(sc.routing, MaxRank):
        sc = replace(sc, routing=MaxRank(sc.N + 2, top_j=sc.J))  # reach past the allowed experts
    cache = make(engine, sc)

    def check(outputs, inputs):
        for il in range(sc.n_layer):
            sel, _ = outputs[0][il]
            _, _, s = inputs[il]
            for t in range(sel.shape[0]):
                row = sel[t][sel[t] >= 0]
                assert (s[t][row] > -np.inf).all(), f"token {t}: masked expert selected: {row}"

    drive(sc, [cache], check)


# --------------------------------------------------------------------------------------------
# invalid parameters: ConfigError with a message that names the problem


def test_top_j_larger_than_k():
    with pytest.raises(ConfigError, match=r"top_j = 3 .*K = 2"):
        MoECache.synthetic(1, 8, 2, cache=CacheConfig(size=4), routing=Prior(0.5, top_j=3))
    with pytest.raises(ConfigError, match=r"top_j = 3 .*K = 2"):
        ReferenceCache(1, 8, 2, 4, routing=Prior(0.5, top_j=3))
    mc = MoECache.synthetic(1, 8, 2, cache=CacheConfig(size=4), routing=Prior(0.5, top_j=2))
    with pytest.raises(ConfigError, match="top_j"):
        mc.set_routing(MaxRank(3, top_j=5))


def test_policy_knobs_out_of_range():
    with pytest.raises(ConfigError, match="lambda"):
        Prior(-0.5)
    with pytest.raises(ConfigError, match="tau"):
        CumsumThreshold(1.5)
    with pytest.raises(ConfigError, match="prune rank"):
        Prune(0)
    with pytest.raises(ConfigError, match="max-rank"):
        MaxRank(-1)


@pytest.mark.parametrize("field, value, message", [
    ("prior_lambda", -0.5, "lambda = -0.5 must be"),
    ("prior_lambda", math.inf, "lambda = inf must be"),
    ("cumsum_tau", 1.5, r"tau = 1.5 must be in \[0, 1\]"),
    ("prune_rank", 0, "prune rank R = 0 must be >= 1"),
    ("max_rank", -1, "m = -1 must be >= 0"),
])
def test_native_validation_of_raw_params(field, value, message):
    """The C library checks the knobs itself (callers other than config.py)."""
    cp, rp = C.moecache_cache_default_params(), C.moecache_routing_default_params()
    cp.n_cached = 4
    setattr(rp, field, value)
    rp.policy = C.MOECACHE_POLICY_PRIOR
    with pytest.raises(ConfigError, match=message):
        MoECache(C.moecache_init_synthetic(1, 8, 2, cp, rp), 1, 8, 2)


def test_cache_larger_than_n():
    with pytest.raises(ConfigError, match="larger than"):
        MoECache.synthetic(1, 8, 2, cache=CacheConfig(size=9))
    with pytest.raises(ConfigError, match=r"cache size 9 .*\[0, 8\]"):
        ReferenceCache(1, 8, 2, 9)
    cp, rp = C.moecache_cache_default_params(), C.moecache_routing_default_params()
    cp.n_cached = 9
    with pytest.raises(ConfigError, match="cache size 9 .* larger than the 8 routed experts"):
        MoECache(C.moecache_init_synthetic(1, 8, 2, cp, rp), 1, 8, 2)
