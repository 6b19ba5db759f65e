"""The hook is invisible when it should be: with top-k routing and a cache holding every
expert, logits are bit-identical to stock llama.cpp, for every fixture architecture and
quantization, through prompt batches, graph reuse and single-token decodes."""

from __future__ import annotations

import numpy as np
import pytest
import llama_cpp

import pymoecache
from conftest import MOE_FIXTURES, VARIANTS, model_path

KW = dict(n_ctx=128, n_batch=16, n_ubatch=16, logits_all=True, verbose=False, n_threads=2, seed=1)
# 40 prompt tokens (three ubatches of 16, 16 and 8) then 6 decodes of one token
PROMPT = list(range(300, 340))
DECODES = [1000, 1001, 1002, 1003, 1004, 1005]


def logits_of(llm) -> np.ndarray:
    llm.reset()
    llm.eval(PROMPT)
    for t in DECODES:
        llm.eval([t])
    return np.array(llm.scores[: len(PROMPT) + len(DECODES)])


@pytest.fixture(scope="module")
def stock_logits(fixture_dir):
    out = {}
    for name in MOE_FIXTURES:
        for v in VARIANTS:
            llm = llama_cpp.Llama(str(model_path(fixture_dir, name, v)), **KW)
            out[name + v] = logits_of(llm)
            llm.close()
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_topk_full_cache_is_bit_identical(fixture_dir, stock_logits, name, variant):
    path = model_path(fixture_dir, name, variant)
    llm = pymoecache.Llama(str(path), cache=pymoecache.CacheConfig(size=1.0), routing=pymoecache.TopK(), **KW)
    got = logits_of(llm)
    ref = stock_logits[name + variant]
    assert np.isfinite(ref).all()
    assert np.array_equal(got, ref), f"max |diff| = {np.abs(got - ref).max()}"

    # the hook really ran: every token of every MoE layer went through the cache
    st = llm.moe_stats()
    n_tok = len(PROMPT) + len(DECODES)
    assert st.tokens_per_layer.tolist() == [n_tok] * len(llm.model_info.moe_layers)
    assert (st.hits_per_layer + st.misses_per_layer == st.n_expert_used * n_tok).all()
    # cache = all experts: each expert misses at most once per layer (the first fill)
    assert (st.misses_per_layer <= st.n_expert).all()
    assert st.evictions == 0
    llm.close()


def test_prior_changes_logits_only_when_it_reroutes(fixture_dir, stock_logits):
    """Guard against a hook that never acts: a small cache with a strong prior must change
    the output, and the same with lambda = 0 must not."""
    name = MOE_FIXTURES[0]
    path = str(model_path(fixture_dir, name))
    ref = stock_logits[name]
    llm = pymoecache.Llama(path, cache=pymoecache.CacheConfig(size=0.25), routing=pymoecache.Prior(0.0), **KW)
    assert np.array_equal(logits_of(llm), ref)
    llm.set_routing(pymoecache.Prior(2.0))
    llm.moecache.clear()
    assert not np.array_equal(logits_of(llm), ref)
    llm.close()


def test_detach_and_reattach_rebuild_the_graph(fixture_dir, stock_logits):
    """Attaching or detaching between decodes must not reuse a graph built the other way."""
    name = MOE_FIXTURES[0]
    path = str(model_path(fixture_dir, name))
    llm = pymoecache.Llama(path, cache=pymoecache.CacheConfig(size=0.25), routing=pymoecache.Prior(2.0), **KW)
    rerouted = logits_of(llm)
    assert not np.array_equal(rerouted, stock_logits[name])
    llm.moecache.detach()
    before = llm.moe_stats().tokens
    assert np.array_equal(logits_of(llm), stock_logits[name])
    assert llm.moe_stats().tokens == before  # detached: nothing counted
    llm.moecache.attach(llm._ctx.ctx)
    llm.moecache.clear()
    assert np.array_equal(logits_of(llm), rerouted)  # same cache start state, same routing
    llm.close()
