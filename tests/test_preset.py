"""Presets (issue 28 item 6): a named choice of routing and eviction, resolved from the model's K
and the share of experts cached; through the API, the CLI, ppl and bench, on a real model."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import pymoecache
from pymoecache import CacheConfig, ConfigError, Preset, Prior, TopK, parse_routing
from conftest import ROOT, http_request, model_path, running_server

QWEN = "qwen2moe-60x4"  # K = 4, N = 60
MIXTRAL = "mixtral-8x2"  # K = 2, N = 8


@pytest.mark.parametrize("name,K,share,routing,eviction", [
    ("quality", 4, 0.5, Prior(0.1, top_j=1), "lfu"),
    ("quality", 2, 0.25, Prior(0.1, top_j=1), "lfu"),
    ("quality", 8, 0.25, Prior(0.05, top_j=1), "lfu"),  # fine-grained (Qwen3-MoE, OLMoE): half the prior
    ("quality", 8, 0.5, Prior(0.05, top_j=1), "lfu"),
    ("balanced", 4, 0.5, Prior(0.2, top_j=1), "router-mass"),
    ("balanced", 4, 0.25, Prior(0.2, top_j=2), "router-mass"),
    ("balanced", 2, 0.5, Prior(0.1, top_j=1), "router-mass"),
    ("speed", 8, 0.1, Prior(0.3, top_j=1), "router-mass"),
    ("speed", 4, 1.0, TopK(), "lru"),  # everything cached: routing changes nothing
])
def test_each_preset_resolves_from_k_and_the_share_cached(name, K, share, routing, eviction):
    assert Preset(name).resolve(K, share) == (routing, eviction)
    assert Preset(name, eviction="lfu").resolve(K, share) == (routing, "lfu")  # an explicit eviction wins
    assert parse_routing(f"preset:{name}") == Preset(name)


def test_bad_presets_are_refused():
    with pytest.raises(ConfigError, match="unknown preset 'fast'"):
        parse_routing("preset:fast")
    with pytest.raises(ConfigError, match="eviction must be one of"):
        Preset("speed", eviction="fifo")


@pytest.mark.parametrize("size,routing", [(15, Prior(0.2, top_j=2)), (30, Prior(0.2, top_j=1)), (60, TopK())])
def test_llama_resolves_the_preset_and_runs_as_the_explicit_setting(fixture_dir, size, routing):
    path = str(model_path(fixture_dir, QWEN))
    tokens = list(range(300, 340))
    runs = []
    for r, cache in (("preset:balanced", CacheConfig(size=size, prefetch="off")),
                     (routing, CacheConfig(size=size, prefetch="off",
                                           eviction="router-mass" if size < 60 else "lru"))):
        # logits_all: without it llama-cpp-python leaves `scores` as it allocated it, uninitialized
        # (np.ndarray), and two runs compared whatever memory they were given
        llm = pymoecache.Llama(path, cache=cache, routing=r, n_ctx=64, logits_all=True, verbose=False)
        llm.eval(tokens)
        st = llm.moe_stats()
        runs.append(((llm.moecache.routing, llm.cache_config.eviction, st.misses, st.hits),
                     llm.scores[len(tokens) - 1].copy()))
        if r == "preset:balanced":
            assert llm.preset == Preset("balanced")
        llm.close()
    assert runs[0][0] == runs[1][0]
    assert np.array_equal(runs[0][1], runs[1][1])  # the same logits, bit for bit


def test_set_routing_resolves_a_preset_for_the_cache_in_place(fixture_dir):
    llm = pymoecache.Llama(str(model_path(fixture_dir, MIXTRAL)), cache=CacheConfig(size=4, prefetch="off"), n_ctx=64,
                           verbose=False)
    llm.set_routing("preset:speed")
    assert llm.moecache.routing == Prior(0.3, top_j=1) and llm.moecache.eviction == "router-mass"
    with pytest.raises(ConfigError, match="resolved from the cache size by pymoecache.Llama"):
        llm.moecache.set_routing("preset:speed")  # the bare cache does not know what to resolve it for
    llm.close()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pymoecache", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_cli_preset_says_what_ran_and_what_it_costs(fixture_dir):
    m = model_path(fixture_dir, QWEN)
    r = _cli("run", m, "--preset", "balanced", "--cache-size", "15", "-n", "4")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "[preset balanced: prior:0.2:j=2, router-mass eviction (+0.92-1.94% perplexity for 1.11-3.97x fewer misses "
        "on our reference models), cache 15/60 experts per layer]")
    d = json.loads(_cli("run", m, "--preset", "quality", "--cache-size", "30", "-n", "2", "--json",
                        "--eviction", "lfu").stdout)
    assert (d["preset"], d["routing"], d["eviction"]) == ("quality", "prior:0.1:j=1", "lfu")
    # K = 8: the default (no routing given) halves the prior
    d = json.loads(_cli("run", model_path(fixture_dir, "olmoe-64x8"), "--cache-size", "16", "-n", "2", "--json").stdout)
    assert (d["preset"], d["routing"], d["eviction"]) == ("quality", "prior:0.05:j=1", "lfu"), d
    r = _cli("run", m, "--preset", "speed", "--prior", "0.5")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = _cli("run", m, "--preset", "speed", "--top-j", "2")
    assert r.returncode == 2 and "the preset picks J" in r.stderr


def test_ppl_and_bench_take_a_preset(fixture_dir, tmp_path):
    m = model_path(fixture_dir, QWEN)
    text = tmp_path / "t.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 40)
    r = _cli("ppl", m, "-f", text, "--ctx", "64", "--chunks", "2", "--preset", "balanced", "--cache-size", "15",
             "--json", tmp_path / "p.json", "--no-progress")
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "p.json").read_text())
    assert [(x["spec"], x["eviction"]) for x in rows] == [("lru", "lru"), ("prior:0.2:j=2", "router-mass")]
    r = _cli("bench", m, "--routing", "preset:speed,lru", "-n", "4", "--cache-size", "15", "--json", tmp_path / "b.json")
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [x["routing"] for x in rows] == ["preset:speed", "lru"]
    # the lru row ran after the preset's, with LRU eviction again: its misses are those of lru alone
    r = _cli("bench", m, "--routing", "lru", "-n", "4", "--cache-size", "15", "--json", tmp_path / "a.json")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "a.json").read_text())[0]["miss_rate"] == rows[1]["miss_rate"]
    assert rows[0]["miss_rate"] < rows[1]["miss_rate"]


def test_the_default_is_the_quality_preset_in_python_cli_and_server(fixture_dir, tmp_path):
    """No routing given: a cache smaller than the model runs --preset quality, resolved the same way by
    pymoecache.Llama, the CLI and the server; a cache that holds every expert runs the model's top-K."""
    m = model_path(fixture_dir, QWEN)
    want = Preset("quality").resolve(4, 15 / 60)[0]
    llm = pymoecache.Llama(str(m), cache=CacheConfig(size=15, residency="none"), n_ctx=64, verbose=False)
    try:
        assert (llm.preset, llm.moecache.routing, llm.moecache.eviction) == (Preset("quality"), want, "lfu")
        assert llm.moecache.eviction_decay == pytest.approx(0.8)  # the preset's decay
    finally:
        llm.close()
    llm = pymoecache.Llama(str(m), cache=CacheConfig(size=1.0, residency="none", eviction="lfu"), n_ctx=64,
                           verbose=False)
    try:
        assert (llm.moecache.routing, llm.moecache.eviction) == (TopK(), "lfu")  # an explicit eviction is kept
    finally:
        llm.close()
    d = json.loads(_cli("run", m, "--cache-size", "15", "-n", "2", "--json").stdout)
    assert (d["preset"], d["routing"], d["eviction"]) == ("quality", want.spec(), "lfu")
    d = json.loads(_cli("run", m, "--cache-size", "15", "-n", "2", "--json", "--routing", "lru").stdout)
    assert (d["preset"], d["routing"]) == (None, "lru")  # top-k is one flag away
    with running_server(m, tmp_path / "serve.log", "--cache-size", "15", "-c", "64") as (base, _):
        props = json.loads(http_request(base + "/props")[1])["moecache"]
    assert (props["preset"], props["routing"]) == ("quality", want.spec())
