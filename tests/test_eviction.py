"""Eviction policies, the usage profile and pinning, on the synthetic cache (the real C++ via
MoECache.synthetic) and its numpy twin. The property test that both engines agree on every
policy is tests/test_route_property.py::test_cpp_matches_reference_every_eviction; these are the
readable cases and the invariants, plus the profile files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pymoecache import _moecache_cpp as C
from pymoecache.config import CacheConfig, ConfigError, TopK
from pymoecache.errors import StateFileError
from pymoecache.llama import MoECache
from pymoecache.reference import EVICTIONS, ReferenceCache

ENGINES = ("native", "reference")


def make(engine, n_layer=1, N=4, K=1, cap=2, eviction="lru", decay=0.95, routing=None):
    if engine == "native":
        return MoECache.synthetic(n_layer, N, K, routing=routing or TopK(),
                                  cache=CacheConfig(size=cap, eviction=eviction, eviction_decay=decay))
    return ReferenceCache(n_layer, N, K, cap, routing=routing or TopK(), eviction=eviction, eviction_decay=decay)


def logits(*probs):
    """Router logits whose softmax is each given probability row."""
    return np.log(np.array(probs, dtype=np.float64)).astype(np.float32)


# expert 0 is used three times, then 1 once, then 2 arrives: LRU drops 0 (used longest ago),
# LFU keeps it (used most)
FREQUENT_THEN_RECENT = logits(*[[0.7, 0.1, 0.1, 0.1]] * 3, [0.1, 0.7, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1])
# expert 1 runs for three tokens while 0 is the close runner-up every time; then 2 arrives with 0
# still the runner-up: router-mass keeps 0 (the router keeps wanting it), LRU and LFU drop 0
RUNNER_UP = logits([0.6, 0.2, 0.1, 0.1], *[[0.44, 0.46, 0.05, 0.05]] * 3, [0.4, 0.01, 0.58, 0.01])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("eviction,z,cached", [
    ("lru", FREQUENT_THEN_RECENT, [1, 2]),
    ("lfu", FREQUENT_THEN_RECENT, [0, 2]),
    ("router-mass", FREQUENT_THEN_RECENT, [0, 2]),
    ("lru", RUNNER_UP, [1, 2]),
    ("lfu", RUNNER_UP, [1, 2]),
    ("router-mass", RUNNER_UP, [0, 2]),
    ("freq-prob", RUNNER_UP, [0, 2]),
])
def test_hand_made_victims(engine, eviction, z, cached):
    c = make(engine, eviction=eviction)
    c.route(0, z)
    assert sorted(c.cached(0)) == cached


@pytest.mark.parametrize("engine", ENGINES)
def test_activation_keeps_what_this_request_uses(engine):
    """Request counts, not recency: after begin_request the new request's own experts win."""
    c = make(engine, eviction="activation")
    c.route(0, FREQUENT_THEN_RECENT[:3])  # request 1: expert 0 three times
    c.begin_request()
    c.route(0, logits(*[[0.1, 0.7, 0.1, 0.1]] * 2, [0.1, 0.1, 0.1, 0.7], [0.1, 0.1, 0.7, 0.1]))
    # request 2 used 1 twice and 3 once: 3 arrived last-but-one, 0 only has the profile's tenth
    assert sorted(c.cached(0)) == [1, 2]
    assert c.profile_counts()[0].tolist() == [3.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("eviction", EVICTIONS)
def test_pinned_experts_are_never_evicted(engine, eviction):
    rng = np.random.default_rng(7)
    c = make(engine, n_layer=2, N=16, K=2, cap=8, eviction=eviction)
    for il in range(2):
        c.route(il, (rng.normal(size=(200, 16)) + np.linspace(3, 0, 16)).astype(np.float32))
    c.begin_request()
    assert c.warm_start(3) == 6
    profile = c.profile_counts()
    pinned = [set(np.argsort(-profile[il], kind="stable")[:3].tolist()) for il in range(2)]
    for il in range(2):
        assert pinned[il] <= set(c.cached(il))
        c.route(il, rng.normal(size=(300, 16)).astype(np.float32) * 3)
        assert pinned[il] <= set(c.cached(il)), f"layer {il}: a pinned expert was evicted"
    st = c.stats() if engine == "native" else None
    if st is not None:
        assert st.pinned == 6 and 0 < st.pinned_hits <= st.hits


@pytest.mark.parametrize("engine", ENGINES)
def test_warm_start_fills_from_the_profile_and_caps_pins(engine):
    c = make(engine, N=6, K=2, cap=4)
    z = logits(*[[0.4, 0.3, 0.1, 0.1, 0.05, 0.05]] * 5, [0.05, 0.05, 0.1, 0.1, 0.3, 0.4])
    c.route(0, z)
    c.begin_request()
    # profile: 0 and 1 five times each, 5 and 4 once: 0 and 1 hottest, then 4, 5; equal counts go to
    # the more recently cached (top-bottom: each token's 1 came after its 0; 4 after 5), not to the lower id
    assert c.warm_start(10) == 2  # at most capacity - K = 2 pinned
    assert c.cached(0) == [5, 4, 0, 1]  # coldest first: the hottest is the most recent
    c2 = make(engine, N=6, K=2, cap=4)
    assert c2.warm_start(1) == 0 and c2.cached(0) == []  # no profile: an empty cache, nothing pinned


def test_eviction_switch_at_run_time_and_validation():
    mc = make("native", eviction="lru")
    mc.route(0, FREQUENT_THEN_RECENT[:4])
    mc.set_eviction("lfu")
    assert C.moecache_get_eviction(mc._h) == C.MOECACHE_EVICTION_LFU
    mc.route(0, FREQUENT_THEN_RECENT[4:])
    assert sorted(mc.cached(0)) == [0, 2]  # the usage was kept while LRU ruled: LFU decides at once
    for bad in [("mru", 0.9), ("lfu", 0.0), ("lfu", 1.5), ("lfu", float("nan"))]:
        with pytest.raises(ConfigError):
            mc.set_eviction(*bad)
    assert mc.eviction == "lfu"
    assert C.moecache_set_eviction(mc._h, 9, 0.9) == C.MOECACHE_ERR_INVALID
    assert "unknown eviction policy" in C.last_error()
    assert C.moecache_set_eviction(mc._h, 1, -0.5) == C.MOECACHE_ERR_INVALID
    with pytest.raises(ConfigError, match="eviction must be one of"):
        CacheConfig(eviction="belady")
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        CacheConfig(eviction_decay=2)
    with pytest.raises(ConfigError):
        mc.warm_start(-1)


# --------------------------------------------------------------------------------------------
# profile files


def _profiled(n_layer=2, N=8, K=2):
    mc = make("native", n_layer=n_layer, N=N, K=K, cap=4)
    rng = np.random.default_rng(3)
    for _ in range(2):
        for il in range(n_layer):
            mc.route(il, (rng.normal(size=(20, N)) + np.linspace(2, 0, N)).astype(np.float32))
        mc.begin_request()
    return mc


def test_profile_round_trip_includes_the_current_request(tmp_path):
    mc = _profiled()
    mc.route(0, logits(*[[0.9] + [0.1 / 7] * 7] * 5))  # the current request, not filed yet
    p = tmp_path / "p.moeprofile"
    mc.save_profile(p)
    want = mc.profile_counts()
    want[0, 0] += 5
    want[0, [int(e) for e in np.argsort(-np.array([0.9] + [0.1 / 7] * 7), kind="stable")[1:2]]] += 5
    other = make("native", n_layer=2, N=8, K=2, cap=4)
    other.load_profile(p)
    np.testing.assert_array_equal(other.profile_counts(), want)
    assert other.warm_start(1) == 2
    assert other.cached(0)[-1] == int(np.argmax(want[0]))


def test_profile_refuses_another_model_damage_and_special_files(tmp_path):
    mc = _profiled()
    p = tmp_path / "p.moeprofile"
    mc.save_profile(p)
    raw = p.read_bytes()
    target = _profiled()
    before = target.profile_counts()
    cases = {
        "another model": (make("native", n_layer=2, N=6, K=2, cap=4), raw, "another model"),
        "flipped byte": (target, raw[:60] + bytes([raw[60] ^ 1]) + raw[61:], "checksum"),
        "truncated": (target, raw[:-20], "checksum|corrupt"),
        "not a profile": (target, b"hello world, not a profile at all", "not a pymoecache usage profile"),
        "empty": (target, b"", "not a pymoecache usage profile"),
    }
    for name, (cache, data, needle) in cases.items():
        q = tmp_path / f"{name}.moeprofile"
        q.write_bytes(data)
        with pytest.raises(StateFileError, match=needle):
            cache.load_profile(q)
    np.testing.assert_array_equal(target.profile_counts(), before)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(StateFileError, match="not a regular file"):
        target.load_profile(fifo)
    with pytest.raises(StateFileError, match="No such file"):
        target.load_profile(tmp_path / "missing")
    with pytest.raises(StateFileError):
        target.save_profile(tmp_path / "no" / "dir" / "p")


def _fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & ((1 << 64) - 1)
    return h


def test_profile_with_values_out_of_range_is_refused(tmp_path):
    """Well-formed files (the checksum recomputed) whose counts are negative, NaN or infinite, or
    whose request store is out of range, are corrupt, and the profile stays as it was."""
    import struct

    mc = _profiled(n_layer=1, N=4, K=1)
    mc.route(0, logits(*[[0.7, 0.1, 0.1, 0.1]] * 10))
    mc.begin_request()  # a request of 10 tokens: the trace store holds it
    p = tmp_path / "p"
    mc.save_profile(p)
    raw = p.read_bytes()[:-8]
    desc_len = struct.unpack_from("<I", raw, 12)[0]
    counts = 16 + desc_len + 8 + 12       # magic, abi, desc, n_params, n_layer N K
    store = counts + 4 * 8 + 4            # 4 counts, then the number of stored requests
    assert struct.unpack_from("<I", raw, counts + 32)[0] >= 1
    before = mc.profile_counts()
    for off, fmt, bad, needle in [(counts, "<d", -1.0, "count out of range"),
                                  (counts + 8, "<d", float("nan"), "count out of range"),
                                  (counts, "<d", float("inf"), "count out of range"),
                                  (store, "<f", 1.5, "share out of range"),
                                  (counts + 32, "<I", 99, "number of stored requests")]:
        b = bytearray(raw)
        struct.pack_into(fmt, b, off, bad)
        p.write_bytes(bytes(b) + struct.pack("<Q", _fnv1a64(bytes(b))))
        with pytest.raises(StateFileError, match=needle):
            mc.load_profile(p)
        np.testing.assert_array_equal(mc.profile_counts(), before)
    p.write_bytes(raw + struct.pack("<Q", _fnv1a64(raw)))
    mc.load_profile(p)  # the untouched bytes load


# --------------------------------------------------------------------------------------------
# the CLI: --eviction, --profile, --pin-hot, the default Top-J


def cli(*args, timeout=300):
    import subprocess
    import sys

    from conftest import ROOT

    return subprocess.run([sys.executable, "-m", "pymoecache", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def run_json(*args):
    import json

    r = cli("run", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_profile_warm_start_and_pins_through_the_cli(fixture_dir, tmp_path):
    from conftest import model_path

    model = model_path(fixture_dir, "qwen2moe-60x4")
    prof = tmp_path / "chat.moeprofile"
    common = (model, "-p", "Once upon a time", "-n", "16", "--cache-size", "0.25", "--residency", "stream",
              "--routing", "lru")  # (the default preset would steer the text to the cache)
    cold, err = run_json(*common, "--profile", prof)
    assert "new, saved at the end" in err and prof.is_file()
    warm, err = run_json(*common, "--profile", prof, "--pin-hot", "4")
    assert "warm start, 16 experts pinned" in err  # 4 per layer, 4 MoE layers
    assert warm["pinned"] == 16 and 0 < warm["pinned_hits"] <= warm["hits"]
    # the same prompt again: the experts it needs are already cached, so fewer misses than cold
    assert warm["misses"] < cold["misses"], (warm["misses"], cold["misses"])
    assert warm["text"] == cold["text"]  # lru routing: where experts live never changes the output
    # the profile grew by the second run
    mc = MoECache.synthetic(1, 4, 1)  # (a shape check: another model's profile is refused)
    with pytest.raises(StateFileError, match="another model"):
        mc.load_profile(prof)


def test_profile_cli_errors(fixture_dir, tmp_path):
    from conftest import model_path

    model = model_path(fixture_dir, "qwen2moe-60x4")
    r = cli("run", model, "-n", "2", "--pin-hot", "2")
    assert r.returncode != 0 and "--pin-hot needs --profile" in r.stderr
    bad = tmp_path / "bad.moeprofile"
    bad.write_bytes(b"MOEPROF1" + b"\0" * 40)
    r = cli("run", model, "-n", "2", "--profile", bad)
    assert r.returncode != 0 and "corrupt" in r.stderr and "Traceback" not in r.stderr
    r = cli("run", model, "-n", "2", "--profile", tmp_path / "no" / "such" / "dir" / "p")
    assert r.returncode != 0 and "not a file in an existing directory" in r.stderr
    r = cli("run", model, "-n", "2", "--eviction", "mru")
    assert r.returncode != 0 and "invalid choice" in r.stderr
    r = cli("run", model, "-n", "2", "--eviction-decay", "0")
    assert r.returncode != 0 and "(0, 1]" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_every_eviction_runs_end_to_end_and_keeps_lru_routing_output(fixture_dir, eviction):
    """Under stock routing the eviction policy changes what is cached and read, never the text."""
    from conftest import model_path

    args = (model_path(fixture_dir, "qwen2moe-60x4"), "-p", "The king", "-n", "12", "--cache-size", "0.25",
            "--residency", "stream")
    base, _ = run_json(*args)
    d, _ = run_json(*args, "--eviction", eviction)
    assert d["eviction"] == eviction and d["text"] == base["text"]
    assert d["evictions"] > 0


def test_default_top_j_follows_k(fixture_dir):
    from conftest import model_path

    k4, _ = run_json(model_path(fixture_dir, "qwen2moe-60x4"), "-n", "2", "--prior", "0.5")
    k2, _ = run_json(model_path(fixture_dir, "mixtral-8x2"), "-n", "2", "--prior", "0.5")
    one, _ = run_json(model_path(fixture_dir, "qwen2moe-60x4"), "-n", "2", "--prior", "0.5", "--top-j", "1")
    assert (k4["top_j"], k2["top_j"], one["top_j"]) == (2, 1, 1)
    assert one["routing"] == "prior:0.5:j=1" and k4["routing"] == "prior:0.5"
    assert "1 for K <= 3 experts per token, 2 for K >= 4" in cli("run", "--help").stdout


@pytest.mark.parametrize("engine", ENGINES)
def test_policy_without_j_takes_the_model_default(engine):
    """Prior(0.5) on a K = 4 model routes exactly as Prior(0.5, top_j=2); on K = 2 as top_j=1."""
    from pymoecache.config import Prior

    rng = np.random.default_rng(11)
    z = rng.normal(size=(60, 16)).astype(np.float32)
    for K, J in ((4, 2), (2, 1)):
        a = make(engine, N=16, K=K, cap=6, routing=Prior(0.5))
        b = make(engine, N=16, K=K, cap=6, routing=Prior(0.5, top_j=J))
        c = make(engine, N=16, K=K, cap=6, routing=Prior(0.5, top_j=0))
        sa, sb, sc_ = a.route(0, z)[0], b.route(0, z)[0], c.route(0, z)[0]
        np.testing.assert_array_equal(sa, sb)
        assert not np.array_equal(sa, sc_)  # J matters on this input: the test can tell them apart


def test_fuzzed_profiles_are_loaded_or_refused_never_worse(tmp_path):
    """Random mutations of a real profile (half with the checksum repaired, so the field checks
    are reached): each is loaded whole or refused with StateFileError and the profile unchanged."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("fuzz_inputs_tests", ROOT / "tests" / "fuzz_inputs.py")
    fz = importlib.util.module_from_spec(spec)  # tests/fuzz_inputs.py (scripts/ has a module of that name too)
    spec.loader.exec_module(fz)

    mc = _profiled(n_layer=2, N=8, K=2)
    mc.route(0, logits(*[[0.3] + [0.1] * 7] * 10))
    mc.begin_request()
    p = tmp_path / "p"
    mc.save_profile(p)
    raw = p.read_bytes()
    rng = np.random.default_rng(2)
    outcomes = set()
    for _ in range(300):
        p.write_bytes(fz.state_mutant(rng, raw))
        before = mc.profile_counts()
        try:
            mc.load_profile(p)
            outcomes.add("ok")
            counts = mc.profile_counts()
            assert np.isfinite(counts).all() and (counts >= 0).all()
            mc.warm_start(2)  # a loaded profile is usable
        except StateFileError:
            outcomes.add("refused")
            np.testing.assert_array_equal(mc.profile_counts(), before)
    assert outcomes == {"ok", "refused"}
