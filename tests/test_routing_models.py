"""Routing through the graph on the fixture models: every policy does what method.md says,
as observed from logits, counters and the per-token trace."""

from __future__ import annotations

import numpy as np
import pytest

import pymoecache
from pymoecache import CacheConfig, MaxRank, Prior, Prune, TopK
from pymoecache.config import DropRank, SwapRank
import synth
from conftest import MOE_FIXTURES, model_path

KW = dict(n_ctx=128, n_batch=16, n_ubatch=16, logits_all=True, verbose=False, n_threads=2, seed=1)
PROMPT = list(range(400, 448))
GEN = [2000 + i for i in range(8)]


def run(llm, prompt=PROMPT, gen=GEN) -> np.ndarray:
    llm.reset()
    llm.eval(prompt)
    for t in gen:
        llm.eval([t])
    return np.array(llm.scores[: len(prompt) + len(gen)])


def load(fixture_dir, name, **kw):
    return pymoecache.Llama(str(model_path(fixture_dir, name)), **KW, **kw)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_prior_lambda_zero_is_stock_topk(fixture_dir, name):
    a = load(fixture_dir, name, cache=CacheConfig(size=0.25), routing=TopK())
    b = load(fixture_dir, name, cache=CacheConfig(size=0.25), routing=Prior(0.0))
    assert np.array_equal(run(a), run(b))
    sa, sb = a.moe_stats(), b.moe_stats()
    assert sa.misses == sb.misses and sa.evictions == sb.evictions
    a.close()
    b.close()


# Not for group-limited models: a cached expert in a group the router masked for this token
# cannot be chosen, so misses remain (test_group_limited_routing_never_leaves_the_chosen_groups).
@pytest.mark.parametrize("name", [n for n in MOE_FIXTURES if synth.FIXTURES[n].n_expert_groups <= 1])
def test_huge_prior_with_j0_only_hits_once_the_cache_is_full(fixture_dir, name):
    llm = load(fixture_dir, name, cache=CacheConfig(size=0.5, trace=100000), routing=Prior(1e6, top_j=0))
    run(llm)
    st = llm.moe_stats()
    tr = llm.moecache.trace()
    cap = int(st.capacity_per_layer[0])
    K = st.n_expert_used
    for layer in st.moe_layers:
        rows = tr[tr["layer"] == layer]
        # the cache is full after the first ceil(cap / K) tokens at the latest; then every expert is a hit
        full_from = -(-cap // K)
        assert len(rows) == len(PROMPT) + len(GEN)
        after = rows[rows["token"] >= full_from]
        assert len(after) > 0
        assert all(r["hit_mask"] == (1 << K) - 1 for r in after), layer
    assert st.miss_rate < 0.2
    llm.close()


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_prune_runs_at_most_r_experts(fixture_dir, name):
    K = synth.FIXTURES[name].n_expert_used
    R = max(1, K // 2)
    llm = load(fixture_dir, name, cache=CacheConfig(size=0.5, trace=100000), routing=Prune(R))
    out = run(llm)
    assert np.isfinite(out).all()
    st = llm.moe_stats()
    assert (st.selections_per_layer == R * st.tokens_per_layer).all()
    assert (st.hits_per_layer + st.misses_per_layer == st.selections_per_layer).all()
    tr = llm.moecache.trace()
    assert len(tr) == len(st.moe_layers) * (len(PROMPT) + len(GEN))
    assert (tr["n_selected"] == R).all()
    # pruning changes the output (fewer experts contribute), unless R = K
    ref = load(fixture_dir, name, cache=CacheConfig(size=0.5), routing=TopK())
    if R < K:
        assert not np.array_equal(out, run(ref))
    llm.close()
    ref.close()


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_rank_sensitivity_policies(fixture_dir, name):
    """drop-rank:(K-1) is prune:(K-1) without Top-J (same logits, bit for bit); swap-rank:0 runs
    the other K - 1 top experts plus exactly one from outside the stock top-K, every token."""
    K = synth.FIXTURES[name].n_expert_used
    drop = load(fixture_dir, name, cache=CacheConfig(size=0.5), routing=DropRank(K - 1))
    prune = load(fixture_dir, name, cache=CacheConfig(size=0.5), routing=Prune(K - 1, top_j=0))
    np.testing.assert_array_equal(run(drop), run(prune))
    st = drop.moe_stats()
    assert (st.selections_per_layer == (K - 1) * st.tokens_per_layer).all()
    swap = load(fixture_dir, name, cache=CacheConfig(size=0.5, trace=100000), routing=SwapRank(0, seed=7))
    out = run(swap)
    assert np.isfinite(out).all()
    tr = swap.moecache.trace()
    assert (tr["n_selected"] == K).all()
    in_top_k = np.array([bin(int(m)).count("1") for m in tr["top_k_mask"]])
    assert (in_top_k == K - 1).all()
    assert not np.array_equal(out, run(load(fixture_dir, name, cache=CacheConfig(size=0.5), routing=TopK())))
    for llm in (drop, prune, swap):
        llm.close()


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_hits_plus_misses_is_k_times_tokens(fixture_dir, name):
    llm = load(fixture_dir, name, cache=CacheConfig(size=0.25), routing=MaxRank(8))
    run(llm)
    st = llm.moe_stats()
    n = len(PROMPT) + len(GEN)
    assert (st.tokens_per_layer == n).all()
    assert (st.hits_per_layer + st.misses_per_layer == st.n_expert_used * n).all()
    assert (st.occupancy_per_layer <= st.capacity_per_layer).all()
    llm.close()


def test_changed_lambda_changes_the_next_tokens_selection(fixture_dir):
    name = "qwen2moe-60x4"
    llm = load(fixture_dir, name, cache=CacheConfig(size=0.25, trace=100000), routing=Prior(0.0))
    llm.reset()
    llm.eval(PROMPT)
    llm.eval([GEN[0]])
    tr0 = llm.moecache.trace()
    last0 = tr0[tr0["token"] == tr0["token"].max()]
    assert all(r["top_k_mask"] == 0b1111 for r in last0)   # lambda = 0: stock top-K
    llm.set_routing(Prior(5.0, top_j=0))                     # no reload, no graph rebuild
    llm.eval([GEN[1]])
    tr1 = llm.moecache.trace()
    last1 = tr1[tr1["token"] == tr1["token"].max()]
    assert any(r["top_k_mask"] != 0b1111 for r in last1)   # some layer now uses a cached non-top-K expert
    llm.close()


def test_group_limited_routing_never_leaves_the_chosen_groups(fixture_dir):
    """deepseek2 fixture: 64 experts in 8 groups, 4 groups used per token. A strong prior with a
    small cache would pull cached experts from masked groups if masking were ignored."""
    spec = synth.FIXTURES["deepseek2-sigmoid-64x6"]
    per_group = spec.n_expert // spec.n_expert_groups
    for routing in (TopK(), Prior(1e6, top_j=0), MaxRank(64, top_j=0)):
        llm = load(fixture_dir, "deepseek2-sigmoid-64x6", cache=CacheConfig(size=0.25, trace=100000), routing=routing)
        run(llm)
        tr = llm.moecache.trace()
        assert len(tr) == 3 * (len(PROMPT) + len(GEN))  # 3 MoE layers after the dense lead
        for r in tr:
            groups = {int(e) // per_group for e in r["experts"][: r["n_selected"]]}
            assert len(groups) <= spec.n_group_used, (routing, r["experts"][: r["n_selected"]])
        if not isinstance(routing, TopK):
            assert (tr["top_k_mask"] != (1 << spec.n_expert_used) - 1).any()  # the policy did reroute
        llm.close()


def test_scope_decode_keeps_prompts_on_stock_routing(fixture_dir):
    name = "qwen2moe-60x4"
    llm = load(fixture_dir, name, cache=CacheConfig(size=0.25, trace=100000), routing=Prior(5.0, top_j=0),
               routing_scope="decode")
    run(llm)
    tr = llm.moecache.trace()
    assert len(tr) == 4 * (len(PROMPT) + len(GEN))
    prompt_rows = tr[tr["token"] < len(PROMPT)]
    gen_rows = tr[tr["token"] >= len(PROMPT)]
    assert (prompt_rows["top_k_mask"] == 0b1111).all()
    assert (gen_rows["top_k_mask"] != 0b1111).any()
    llm.close()

    # prompt tokens may also be kept out of the cache and the counters entirely
    llm = load(fixture_dir, name, cache=CacheConfig(size=0.25, update_on_prompt=False), routing=TopK())
    run(llm)
    assert (llm.moe_stats().tokens_per_layer == len(GEN)).all()
    llm.close()


def test_cache_state_round_trip_and_model_identity(fixture_dir, tmp_path):
    a = load(fixture_dir, "qwen2moe-60x4", cache=CacheConfig(size=0.25), routing=TopK())
    run(a)
    path = tmp_path / "warm.moecache"
    a.save_cache_state(path)
    b = load(fixture_dir, "qwen2moe-60x4", cache=CacheConfig(size=0.25), routing=TopK())
    b.load_cache_state(path)
    for il in a.moe_stats().moe_layers:
        assert a.moecache.cached(int(il)) == b.moecache.cached(int(il))
    # a warm start misses less on the same text than a cold one
    cold = load(fixture_dir, "qwen2moe-60x4", cache=CacheConfig(size=0.25), routing=TopK())
    run(b)
    run(cold)
    assert b.moe_stats().misses < cold.moe_stats().misses
    other = load(fixture_dir, "olmoe-64x8", cache=CacheConfig(size=0.25), routing=TopK())
    with pytest.raises(pymoecache.MoECacheError, match="another model"):
        other.load_cache_state(path)
    for llm in (a, b, cold, other):
        llm.close()


def test_prior_calibration_file_fixes_delta(fixture_dir, tmp_path):
    a = load(fixture_dir, "qwen2moe-60x4", cache=CacheConfig(size=0.25), routing=Prior(0.5))
    run(a)
    cal = tmp_path / "prior.json"
    a.moecache.save_prior_calibration(cal)
    measured = a.moe_stats().delta_per_layer
    assert (measured > 0).all()

    b = load(fixture_dir, "qwen2moe-60x4", cache=CacheConfig(size=0.25), routing=Prior(0.5))
    b.moecache.load_prior_calibration(cal)
    run(b, prompt=PROMPT[:5], gen=[])  # a short, different text: a running mean would drift
    assert np.allclose(b.moe_stats().delta_per_layer, measured, rtol=1e-6)
    other = load(fixture_dir, "olmoe-64x8", cache=CacheConfig(size=0.25), routing=Prior(0.5))
    with pytest.raises(pymoecache.MoECacheError, match="not a prior calibration for this model"):
        other.moecache.load_prior_calibration(cal)
    for llm in (a, b, other):
        llm.close()


def test_per_layer_cache_sizes(fixture_dir):
    # deepseek2 fixture: layer 0 is dense, layers 1-3 are MoE with 64 experts
    llm = load(fixture_dir, "deepseek2-sigmoid-64x6", cache=CacheConfig(size=16, per_layer=[-1, 8, 32]),
               routing=TopK())
    run(llm)
    st = llm.moe_stats()
    assert st.moe_layers.tolist() == [1, 2, 3]
    assert st.capacity_per_layer.tolist() == [8, 32, 16]   # layer 3 falls back to size=16
    assert (st.occupancy_per_layer == st.capacity_per_layer).all()
    assert st.misses_per_layer[0] > st.misses_per_layer[1]   # the smaller cache misses more
    llm.close()
    with pytest.raises(pymoecache.ConfigError, match="larger than"):
        load(fixture_dir, "deepseek2-sigmoid-64x6", cache=CacheConfig(size=16, per_layer=[0, 65]))
