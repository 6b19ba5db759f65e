"""Per-layer tuning (pymoecache/tune.py): slots per layer and the prior's per-layer strength.

The allocation and the choice are pure functions, checked on random curves; the measurement runs
the real library on a fixture model."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymoecache import CacheConfig, Llama, MoECache
from pymoecache.config import ConfigError, Prior, parse_routing
from pymoecache import tune
from pymoecache.tune import (LayerPoint, Sensitivity, allocate_slots, choose_layer_scales, ppl_evaluator,
                             tune_layer_scales)


@st.composite
def miss_curves(draw):
    n_layer = draw(st.integers(1, 6))
    k = draw(st.integers(1, 4))
    n_expert = draw(st.integers(k + 1, 64))
    curves = {}
    for il in range(n_layer):
        sizes = sorted(set(draw(st.lists(st.integers(1, n_expert), min_size=1, max_size=5))))
        rates = sorted((draw(st.floats(0, 1)) for _ in sizes), reverse=True)  # more slots, fewer misses
        curves[il * 2] = dict(zip(sizes, rates))  # layer ids need not be 0..n-1 (dense layers between)
    total = draw(st.integers(k * n_layer, n_expert * n_layer))
    return curves, total, k


@settings(max_examples=300, deadline=None)
@given(miss_curves())
def test_allocation_sums_to_the_budget_and_never_starves_a_layer_below_k(case):
    curves, total, k = case
    sizes = allocate_slots(curves, total, k)
    assert len(sizes) == len(curves)
    assert sum(sizes) == total
    assert min(sizes) >= k


def test_allocation_gives_slots_where_they_save_the_most_misses():
    flat = {11: 0.30, 15: 0.29, 19: 0.28}     # a slot saves 0.25 points
    steep = {11: 0.50, 15: 0.30, 19: 0.10}    # a slot saves 5 points
    assert allocate_slots({0: flat, 1: steep}, 30, 4) == [11, 19]
    assert allocate_slots({0: steep, 1: flat}, 30, 4) == [19, 11]
    assert allocate_slots({0: steep, 1: steep}, 30, 4) == [15, 15]  # equal curves: an even split


def test_allocation_refuses_a_budget_below_k_per_layer():
    with pytest.raises(ConfigError, match="K = 4"):
        allocate_slots({0: {4: 0.5}, 1: {4: 0.5}}, 7, 4)


def _sens():
    # layer 0: the prior costs a lot and saves little; layer 1: cheap and effective; layer 2 in between
    s = Sensitivity(base_ppl=100.0, base_miss={0: 0.4, 1: 0.6, 2: 0.5})
    for il, pts in {0: [(1, 101.5, 0.35), (2, 103.0, 0.30)],
                    1: [(1, 100.2, 0.30), (2, 100.4, 0.20)],
                    2: [(1, 100.5, 0.35), (2, 101.0, 0.25)]}.items():
        s.points += [LayerPoint(il, sc, p, m) for sc, p, m in pts]
    return s


def test_the_choice_spends_the_budget_where_it_buys_the_most_misses():
    s = _sens()
    assert choose_layer_scales(s, 0.001) == {0: 0.0, 1: 0.0, 2: 0.0}   # nothing fits in 0.1%
    assert choose_layer_scales(s, 0.0045) == {0: 0.0, 1: 2.0, 2: 0.0}
    assert choose_layer_scales(s, 0.0145) == {0: 0.0, 1: 2.0, 2: 2.0}
    assert choose_layer_scales(s, 1.0) == {0: 2.0, 1: 2.0, 2: 2.0}     # everything fits
    for budget in (0.002, 0.005, 0.01, 0.02, 0.05):  # the summed cost never exceeds the budget
        chosen = choose_layer_scales(s, budget)
        cost = sum(max(0.0, p.ppl / 100.0 - 1) for p in s.points if chosen[p.layer] == p.scale)
        assert cost <= budget + 1e-12


def test_tune_backs_off_until_the_whole_choice_fits():
    # a model whose layers' costs do not add up: together they cost twice their sum
    calls = []

    def evaluate(routing):
        calls.append(routing)
        scales = routing.layers
        cost = sum({0: 0.003, 1: 0.002}.get(il, 0) * s for il, s in enumerate(scales))
        if sum(1 for s in scales if s > 0) > 1:
            cost *= 2
        return 100.0 * (1 + cost), {il: 0.5 - 0.1 * s for il, s in enumerate(scales)}

    res = tune_layer_scales(evaluate, 0.2, 1, [0, 1], 2, 0.01, scales=(1.0, 2.0))
    assert res.ppl <= 101.0
    assert res.tries > 1  # the first choice (both layers at 2: 1% by the sum, 2% together) was refused
    assert calls[0].layers == (0.0, 0.0)  # the stock router first


def test_prior_layers_spec_round_trips_and_bad_scales_are_refused():
    r = parse_routing("prior:0.2:j=1:layers=0/1.5/1/1")
    assert r == Prior(0.2, top_j=1, layers=(0.0, 1.5, 1.0, 1.0))
    assert parse_routing(r.spec()) == r
    for bad in ("prior:0.2:layers=a/b", "lru:layers=1/2", "prior:0.2:layers=-1/1"):
        with pytest.raises(ConfigError):
            parse_routing(bad)
    with pytest.raises(ConfigError):
        Prior(0.2, layers=[float("nan")])


def test_a_scale_of_zero_is_the_stock_router_there_and_two_doubles_the_strength():
    """Layer by layer (the C++ library, synthetic layers fed the same router outputs): scale 0 routes as
    top-k, scale 1 as the flat prior, scale 2 as the flat prior of twice the strength."""
    rng = np.random.default_rng(0)
    z = rng.normal(size=(200, 16)).astype(np.float32) * 2

    def selections(routing, il):
        mc = MoECache.synthetic(3, 16, 4, cache=CacheConfig(size=6), routing=routing)
        try:
            return mc.route(il, z)[0].tolist()
        finally:
            mc.close()

    mixed = Prior(0.5, top_j=1, layers=(0.0, 1.0, 2.0))
    assert selections(mixed, 0) == selections(parse_routing("lru"), 0)
    assert selections(mixed, 1) == selections(Prior(0.5, top_j=1), 1)
    assert selections(mixed, 2) == selections(Prior(1.0, top_j=1), 2)
    assert selections(mixed, 2) != selections(mixed, 0)  # the prior acts there


def test_per_layer_scales_through_a_model(fixture_dir):
    """Through a loaded fixture model: all ones is the flat prior, all zeros the stock router."""
    llm = Llama(str(fixture_dir / "qwen2moe-60x4.gguf"), cache=CacheConfig(size=0.25, residency="none"), routing="lru",
                n_ctx=64, n_batch=64, logits_all=True, verbose=False)
    try:
        rng = random.Random(0)
        tokens = [rng.randrange(3, llm.n_vocab()) for _ in range(120)]
        evaluate = ppl_evaluator(llm, tokens, 40)
        n = llm.moecache.n_layer
        stock, flat = evaluate(parse_routing("lru")), evaluate(Prior(1.0, top_j=1))
        assert flat != stock
        assert evaluate(Prior(1.0, top_j=1, layers=(1.0,) * n)) == flat
        assert evaluate(Prior(1.0, top_j=1, layers=(0.0,) * n)) == stock
        assert evaluate(Prior(0.5, top_j=1, layers=(2.0,) * n)) == flat
    finally:
        llm.close()


# --- bad input is a ConfigError, said at once (issue 41 item 8) -----------------------------------

def _ev(ppl=10.0, miss=0.5):
    return lambda routing: (ppl, {il: miss for il in range(4)})


_BAD_CALLS = {
    "slots-nan-rate": lambda: tune.allocate_slots({0: {2: float("nan")}}, 4, 2),
    "slots-negative-rate": lambda: tune.allocate_slots({0: {2: -0.1}}, 4, 2),
    "slots-rate-above-1": lambda: tune.allocate_slots({0: {2: 1.5}}, 4, 2),
    "slots-huge-total": lambda: tune.allocate_slots({0: {2: 0.5, 8: 0.1}}, 10 ** 12, 2),
    "slots-no-layers": lambda: tune.allocate_slots({}, 4, 2),
    "slots-layer-without-sizes": lambda: tune.allocate_slots({0: {}}, 4, 2),
    "slots-fractional-total": lambda: tune.allocate_slots({0: {2: 0.5}}, 4.5, 2),
    "slots-k-0": lambda: tune.allocate_slots({0: {2: 0.5}}, 4, 0),
    "slots-size-not-a-number": lambda: tune.allocate_slots({0: {"a": 0.5}}, 4, 2),
    "choose-base-ppl-0": lambda: tune.choose_layer_scales(tune.Sensitivity(0.0, {0: 0.5}), 0.01),
    "choose-point-of-unknown-layer": lambda: tune.choose_layer_scales(
        tune.Sensitivity(10.0, {0: 0.5}, [tune.LayerPoint(1, 1.0, 11.0, 0.3)]), 0.01),
    "choose-nan-budget": lambda: tune.choose_layer_scales(tune.Sensitivity(10.0, {0: 0.5}), float("nan")),
    "choose-negative-budget": lambda: tune.choose_layer_scales(tune.Sensitivity(10.0, {0: 0.5}), -1),
    "choose-negative-mu": lambda: tune.choose_layer_scales(tune.Sensitivity(10.0, {0: 0.5}), 0.01, mu=-1),
    "sensitivity-layer-out-of-range": lambda: tune.layer_sensitivity(_ev(), 0.5, 1, [5], 2),
    "sensitivity-evaluate-misses-a-layer": lambda: tune.layer_sensitivity(lambda r: (10.0, {}), 0.5, 1, [0], 1),
    "sensitivity-evaluate-returns-none": lambda: tune.layer_sensitivity(lambda r: None, 0.5, 1, [0], 1),
    "sensitivity-nan-ppl": lambda: tune.layer_sensitivity(_ev(ppl=float("nan")), 0.5, 1, [0], 1),
    "sensitivity-negative-scale": lambda: tune.layer_sensitivity(_ev(), 0.5, 1, [0], 1, scales=(-1.0,)),
    "tune-no-layers": lambda: tune.tune_layer_scales(_ev(), 0.5, 1, [], 1, 0.01),
    "tune-nan-budget": lambda: tune.tune_layer_scales(_ev(), 0.5, 1, [0], 1, float("nan")),
    "tune-negative-budget": lambda: tune.tune_layer_scales(_ev(), 0.5, 1, [0], 1, -0.01),
    "tune-max-tries-0": lambda: tune.tune_layer_scales(_ev(), 0.5, 1, [0], 1, 0.01, max_tries=0),
}


@pytest.mark.parametrize("name", sorted(_BAD_CALLS))
def test_tune_refuses_bad_input_with_a_config_error(name):
    with pytest.raises(ConfigError):
        _BAD_CALLS[name]()


def test_fit_predictor_refuses_token_ids_outside_the_vocabulary(fixture_dir):
    with pytest.raises(ConfigError, match="token ids"):
        tune.fit_predictor(str(fixture_dir / "qwen2moe-60x4.gguf"), [1, 2, 10 ** 9])


def test_route_refuses_a_token_with_fewer_than_k_experts_to_choose():
    mc = MoECache.synthetic(1, 8, 2, cache=CacheConfig(size=4))
    try:
        with pytest.raises(ConfigError, match="K = 2 experts cannot be chosen"):
            mc.route(0, np.full((1, 8), np.nan, dtype=np.float32))
        z = np.full((2, 8), -np.inf, dtype=np.float32)
        z[:, :2] = 1.0  # two numbers: K = 2 can be chosen, the rest is masked
        assert sorted(mc.route(0, z)[0][0].tolist()) == [0, 1]
    finally:
        mc.close()
