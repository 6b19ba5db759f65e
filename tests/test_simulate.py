"""Offline replay (pymoecache.simulate) and Belady's OPT."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("hypothesis")
from hypothesis import assume, HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pymoecache.config import CacheConfig, CumsumThreshold, MaxRank, Prior, Prune, TopK  # noqa: E402
from pymoecache.llama import MoECache  # noqa: E402
from pymoecache.simulate import (RouterTrace, belady_opt, load_router_trace, lru_misses, replay, save_router_trace,  # noqa: E402
                                 served_order)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------
# fixed selection sequences


@st.composite
def selection_sequences(draw, max_n=12, max_tokens=60, max_layers=3):
    """Per layer a [T, K] array of distinct experts per row (some rows pruned: -1 at the end)."""
    n_layer = draw(st.integers(1, max_layers))
    N = draw(st.integers(1, max_n))
    K = draw(st.integers(1, min(N, 4)))
    T = draw(st.integers(0, max_tokens))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    hot = draw(st.integers(1, N))  # skewed use: most requests go to a few hot experts
    layers = []
    for _ in range(n_layer):
        sel = np.full((T, K), -1, dtype=np.int32)
        for t in range(T):
            k = K if rng.random() < 0.8 else int(rng.integers(1, K + 1))
            w = np.where(np.arange(N) < hot, 5.0, 1.0)
            sel[t, :k] = rng.choice(N, size=k, replace=False, p=w / w.sum())
        layers.append(sel)
    return layers, N, K


@settings(max_examples=200, **SETTINGS)
@given(data=selection_sequences(), cap=st.integers(0, 13))
def test_opt_never_misses_more_than_lru(data, cap):
    assume(cap == 0 or cap >= data[2])  # OPT is defined when a token's K experts fit
    layers, N, K = data
    opt, lru = belady_opt(layers, cap), lru_misses(layers, cap)
    requests = np.array([(sel >= 0).sum() for sel in layers])
    distinct = np.array([len(set(sel[sel >= 0].tolist())) for sel in layers])
    assert (opt <= lru).all()
    assert (opt <= requests).all()
    assert (opt >= (distinct if cap > 0 else requests)).all()  # compulsory misses


def brute_force_misses(rows, cap):
    """The fewest misses over every choice of victim at every eviction, under the cache's
    per-token rule (hits are the experts cached before the token; a miss always inserts; a
    victim is an expert the token does not use, unless it uses them all)."""
    rows = tuple(tuple(r) for r in rows)

    @lru_cache(maxsize=None)
    def best(t, cache):
        if t == len(rows):
            return 0
        row = rows[t]
        missing = [e for e in row if e not in cache]

        def insert(i, c):
            if i == len(missing):
                return best(t + 1, c)
            e = missing[i]
            if cap == 0:
                return insert(i + 1, c)
            if len(c) < cap:
                return insert(i + 1, c | {e})
            victims = [v for v in c if v not in row] or list(c)
            return min(insert(i + 1, (c - {v}) | {e}) for v in victims)

        return len(missing) + insert(0, cache)

    return best(0, frozenset())


@settings(max_examples=300, **SETTINGS)
@given(seq=st.lists(st.integers(0, 4), max_size=12), cap=st.integers(0, 4))
def test_opt_equals_brute_force_optimum(seq, cap):
    assert belady_opt([[[e] for e in seq]], cap)[0] == brute_force_misses([[e] for e in seq], cap)


@settings(max_examples=100, **SETTINGS)
@given(data=selection_sequences(max_n=5, max_tokens=6, max_layers=1), cap=st.integers(0, 5))
def test_opt_equals_brute_force_with_several_experts_per_token(data, cap):
    assume(cap == 0 or cap >= data[2])
    (sel,), _, _ = data
    rows = [[int(e) for e in row if e >= 0] for row in sel]
    assert belady_opt([sel], cap)[0] == brute_force_misses(rows, cap)


@settings(max_examples=100, **SETTINGS)
@given(data=selection_sequences(), extra=st.integers(0, 3))
def test_opt_with_room_for_every_expert_only_has_compulsory_misses(data, extra):
    layers, N, K = data
    distinct = np.array([len(set(sel[sel >= 0].tolist())) for sel in layers])
    cap = int(distinct.max()) + extra
    if cap == 0:
        return  # no requests at all
    assert belady_opt(layers, cap).tolist() == distinct.tolist()
    assert lru_misses(layers, cap).tolist() == distinct.tolist()


def test_capacity_zero_misses_every_request():
    sel = np.array([[0, 1], [0, -1], [1, 0]], dtype=np.int32)
    assert belady_opt([sel], 0).tolist() == lru_misses([sel], 0).tolist() == [5]


def test_hand_made_lru_and_opt_differ_by_a_known_amount():
    """Cycling over 3 experts with room for 2: LRU always evicts the one needed next (12 misses
    of 12); OPT misses the first 3, then every second request (7)."""
    cyclic = [[e] for e in [0, 1, 2] * 4]
    assert lru_misses([cyclic], 2).tolist() == [12]
    assert belady_opt([cyclic], 2).tolist() == [7]
    # the same through a real replay: a K = 1 router that prefers 0, 1, 2, 0, ...
    z = np.full((12, 1, 3), -5.0, dtype=np.float32)
    z[np.arange(12), 0, np.arange(12) % 3] = 5.0
    res = replay(RouterTrace(z, n_expert_used=1), TopK(), cache_size=2)
    assert res.misses == 12 and res.evictions == 10
    assert belady_opt(res.requests, 2).tolist() == [7]


def test_two_experts_per_token_opt_keeps_the_returning_expert():
    """K = 2, room for 2, tokens {0,1} {2,3} {0,2} {0,3}: the cache can only hold the last
    token's experts, so LRU = OPT = 2 + 2 + 1 (0; 2 is a hit and is spared) + 1 (3) = 6.
    With room for 3 on a longer sequence OPT can keep the expert needed soonest."""
    sel = np.array([[0, 1], [2, 3], [0, 2], [0, 3]], dtype=np.int32)
    assert lru_misses([sel], 2).tolist() == [6]
    assert belady_opt([sel], 2).tolist() == [6]
    sel = np.array([[0, 1], [2, 3], [0, 2], [1, 3], [0, 1]], dtype=np.int32)
    assert belady_opt([sel], 3)[0] <= lru_misses([sel], 3)[0]
    assert belady_opt([sel], 3)[0] == brute_force_misses(sel.tolist(), 3)


# --------------------------------------------------------------------------------------------
# replay


def random_trace(seed: int, n_tokens=40, n_layer=2, n_expert=12, k=3, kind="softmax") -> RouterTrace:
    rng = np.random.default_rng(seed)
    z = (rng.normal(size=(n_tokens, n_layer, n_expert)) * 2).astype(np.float32)
    z[:, :, : n_expert // 3] += 1.5  # some experts are more popular: caching pays
    if kind == "softmax":
        return RouterTrace(z, n_expert_used=k)
    p = (1 / (1 + np.exp(-z))).astype(np.float32)
    s = p + (rng.normal(size=n_expert) * 0.05).astype(np.float32)
    s[rng.random(size=s.shape) < 0.1] = -np.inf  # a few masked experts (>= k stay allowed here)
    s[:, :, :k] = np.maximum(s[:, :, :k], 0.0)
    return RouterTrace(z, n_expert_used=k, probs=p, scores=s.astype(np.float32), rank_on_logits=False)


ROUTINGS = [TopK(), Prune(2, top_j=1), MaxRank(5, top_j=1), CumsumThreshold(0.8, top_j=1), Prior(0.5, top_j=1),
            Prior(2.0, top_j=0)]


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("kind", ["softmax", "biased-sigmoid"])
@pytest.mark.parametrize("size", [0, 2, 6, 12])
def test_replay_matches_token_by_token_routing(routing, kind, size):
    tr = random_trace(seed=size * 7 + len(kind), kind=kind)
    res = replay(tr, routing, cache_size=size)
    mc = MoECache.synthetic(tr.n_layer, tr.n_expert, tr.n_expert_used, routing=routing,
                            cache=CacheConfig(size=size))
    for t in range(tr.n_tokens):           # the model's order: token by token, layer by layer
        for il in range(tr.n_layer):
            z, p, s = tr.layer(il)
            sel, _ = mc.route(il, z[t:t + 1], p[t:t + 1], None if s is None else s[t:t + 1],
                              rank_on_logits=tr.rank_on_logits)
            np.testing.assert_array_equal(sel[0], res.selected[il][t])
    st_ = mc.stats()
    np.testing.assert_array_equal(st_.tokens_per_layer, res.tokens_per_layer)
    np.testing.assert_array_equal(st_.selections_per_layer, res.selections_per_layer)
    np.testing.assert_array_equal(st_.hits_per_layer, res.hits_per_layer)
    np.testing.assert_array_equal(st_.misses_per_layer, res.misses_per_layer)
    np.testing.assert_array_equal(st_.evictions_per_layer, res.evictions_per_layer)
    np.testing.assert_allclose(st_.lifetime_per_layer, res.lifetime_per_layer, rtol=0, atol=1e-9)
    assert res.miss_rate == pytest.approx(st_.miss_rate, abs=1e-12)
    assert res.hit_rate == pytest.approx(st_.hit_rate, abs=1e-12)
    assert res.lifetime == pytest.approx(st_.lifetime, abs=1e-9)
    # the numpy reference replays to the same numbers
    ref = replay(tr, routing, cache_size=size, engine="reference")
    for name in ("tokens_per_layer", "selections_per_layer", "hits_per_layer", "misses_per_layer",
                 "evictions_per_layer", "occupancy_per_layer", "capacity_per_layer"):
        np.testing.assert_array_equal(getattr(ref, name), getattr(res, name), err_msg=name)
    np.testing.assert_allclose(ref.lifetime_per_layer, res.lifetime_per_layer, rtol=0, atol=1e-9)
    for a, b in zip(ref.selected, res.selected):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=40, **SETTINGS)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 4), cap=st.integers(0, 12),
       routing=st.sampled_from(ROUTINGS), insertion=st.sampled_from(["top-bottom", "bottom-top"]),
       kind=st.sampled_from(["softmax", "biased-sigmoid"]))
def test_replayed_requests_bound_the_replay(seed, k, cap, routing, insertion, kind):
    """requests are what the C++ cache served, in its order: a plain LRU over them reproduces the
    replay's misses exactly, and OPT over them can only do better (for every policy: its routing
    is then fixed)."""
    if getattr(routing, "top_j", 0) > k:
        routing = type(routing)(**{**routing.__dict__, "top_j": k})
    tr = random_trace(seed, n_tokens=30, k=k, kind=kind)
    res = replay(tr, routing, cache_size=cap, insertion=insertion)
    assert lru_misses(res.requests, cap).tolist() == res.misses_per_layer.tolist()
    k_run = max(int((req >= 0).sum(axis=1).max()) for req in res.requests)  # < K under prune
    if cap == 0 or cap >= k_run:
        assert (belady_opt(res.requests, cap) <= res.misses_per_layer).all()
    else:
        with pytest.raises(ValueError, match="at least K"):
            belady_opt(res.requests, cap)
    for sel, req in zip(res.selected, res.requests):  # same experts, other order
        np.testing.assert_array_equal(np.sort(sel, axis=1), np.sort(req, axis=1))


def test_replay_of_prior_beats_lru_on_a_skewed_trace():
    tr = random_trace(seed=3, n_tokens=200, n_expert=16, k=2)
    lru, prior = replay(tr, "lru", cache_size=8), replay(tr, "prior:1.0", cache_size=8)
    assert prior.miss_rate < lru.miss_rate
    assert prior.lifetime > lru.lifetime
    assert 0.0 <= prior.hit_rate <= 1.0 and prior.hit_rate == pytest.approx(1 - prior.miss_rate)


def test_trace_file_round_trip(tmp_path):
    tr = random_trace(seed=1, kind="biased-sigmoid")
    save_router_trace(tmp_path / "t.npz", tr)
    back = load_router_trace(tmp_path / "t.npz")
    assert back.n_expert_used == tr.n_expert_used and back.rank_on_logits is False
    np.testing.assert_array_equal(back.scores, tr.scores)
    a, b = replay(tr, "prior:0.5", 4), replay(str(tmp_path / "t.npz"), "prior:0.5", 4)
    assert a.misses_per_layer.tolist() == b.misses_per_layer.tolist()
    # a plain np.savez with only the required keys works too
    np.savez(tmp_path / "min.npz", logits=tr.logits, n_expert_used=3)
    assert load_router_trace(tmp_path / "min.npz").rank_on_logits is True
    with pytest.raises(ValueError, match="n_expert_used"):
        load_router_trace({"logits": tr.logits})


def test_served_order_is_by_router_weight():
    sel = np.array([[0, 1, 2, -1]], dtype=np.int32)
    p = np.array([[0.2, 0.5, 0.2, 0.1]], dtype=np.float32)
    assert served_order(sel, p, "top-bottom").tolist() == [[1, 0, 2, -1]]
    assert served_order(sel, p, "bottom-top").tolist() == [[2, 0, 1, -1]]


# --------------------------------------------------------------------------------------------
# a real model's router, and the eviction table


def test_router_trace_of_a_real_model_replays_as_the_model_routes(fixture_dir, tmp_path):
    """The recorded router outputs, replayed under LRU at the same cache size, give exactly the
    selections and misses the model itself counted while evaluating the same tokens."""
    from conftest import model_path

    from pymoecache.evaluate import load_llama, tokenize_text
    from pymoecache.simulate import record_router_trace

    model = model_path(fixture_dir, "qwen2moe-60x4")
    text = "The quick brown fox jumps over the lazy dog. " * 12
    tr = record_router_trace(model, text, tokens=96, ctx=48)
    assert (tr.n_tokens, tr.n_layer, tr.n_expert, tr.n_expert_used) == (96, 4, 60, 4)
    llm = load_llama(model, cache=CacheConfig(size=20, residency="none"), routing="lru", n_ctx=48, n_batch=48,
                     logits_all=True)
    ids = tokenize_text(llm, text)[:96]
    for i in range(0, 96, 48):
        llm.reset()
        llm.eval(ids[i:i + 48])
    st = llm.moe_stats()
    llm.close()
    res = replay(tr, "lru", cache_size=20)
    np.testing.assert_array_equal(res.misses_per_layer, st.misses_per_layer)
    save_router_trace(tmp_path / "t.npz", tr)
    again = load_router_trace(tmp_path / "t.npz")
    np.testing.assert_array_equal(again.logits, tr.logits)


def test_eviction_table_bounds_and_gap(tmp_path):
    from pymoecache.simulate import eviction_table

    rng = np.random.default_rng(5)
    # a skewed router: some experts are popular, the rest rare, so what to keep matters
    z = (rng.normal(size=(400, 2, 16)) + np.linspace(2, 0, 16)).astype(np.float32)
    rows = eviction_table(RouterTrace(z, n_expert_used=2), ["lru", "prior:0.5"], [6])
    assert len(rows) == 2 * 5
    for r in rows:
        if r["routing"] == "lru":  # stock routing: the selections are fixed, so Belady bounds every policy
            assert r["belady_misses"] <= r["misses"]
        assert r["lru_misses"] == next(x["misses"] for x in rows
                                       if x["routing"] == r["routing"] and x["eviction"] == "lru")
        want = (r["lru_misses"] - r["misses"]) / (r["lru_misses"] - r["belady_misses"])
        assert r["gap_closed"] == pytest.approx(want)
    assert any(r["eviction"] != "lru" and r["misses"] != r["lru_misses"] for r in rows)  # policies differ


def test_simulate_cli(fixture_dir, tmp_path):
    import json
    import subprocess
    import sys

    from conftest import ROOT, model_path

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "pymoecache", "simulate", *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a little cache that kept the right experts. " * 20)
    tr, out = tmp_path / "tr.npz", tmp_path / "rows.json"
    r = cli(model_path(fixture_dir, "qwen2moe-60x4"), "--text", text, "--tokens", "128", "--ctx", "64",
            "--cache-size", "0.5", "--save-trace", tr, "--json", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "gap closed" in r.stdout and "router-mass" in r.stdout and tr.is_file()
    rows = json.loads(out.read_text())
    assert {x["eviction"] for x in rows} == {"lru", "lfu", "activation", "freq-prob", "router-mass"}
    assert {x["routing"] for x in rows} == {"lru", "prior:0.5"}
    r2 = cli("--router-trace", tr, "--cache-size", "0.5", "--eviction", "lru,lfu", "--routing", "lru")
    assert r2.returncode == 0, r2.stderr
    first = [ln for ln in r.stdout.splitlines() if ln.startswith("lru") and " lfu " in ln]
    assert first and first[0] in r2.stdout  # the saved trace replays to the same row
    for bad, needle in [(("--router-trace", tr, "--eviction", "mru"), "--eviction takes"),
                        (("--router-trace", tmp_path / "missing.npz"), "cannot read router trace"),
                        ((model_path(fixture_dir, "qwen2moe-60x4"),), "--text FILE is needed")]:
        r = cli(*bad)
        assert r.returncode != 0 and needle in r.stderr and "Traceback" not in r.stderr
