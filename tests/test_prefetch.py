"""Prefetch (CacheConfig.prefetch, src_cpp/moecache-graph.cpp prefetch_ahead, moecache-slots.cpp):
predicted experts are inserted into a later layer's cache and read in the background. With the
model's own routing that changes what is resident, never a logit; with any routing the streamed
run equals the counters-only run with the same prefetch, so the slots always hold what the cache
says, whatever is in flight."""

from __future__ import annotations

import numpy as np
import pytest

import pymoecache
from pymoecache import CacheConfig
from conftest import MOE_FIXTURES, ROOT, model_path
from test_residency import run as run_residency

TRAINED = [ROOT / "models" / "tiny-shakespeare-qwen2moe-60x4.gguf", ROOT / "models" / "tiny-shakespeare-mixtral-8x2.gguf"]


def run(path, routing, size, prefetch="off", residency="stream", distance=1, **cache):
    """Logits of a prompt then one-token decodes, and the decodes' stats (test_residency.run)."""
    return run_residency(path, residency, routing, size, prefetch=prefetch, prefetch_distance=distance, **cache)


@pytest.fixture(scope="module")
def paths(fixture_dir):
    found = {name: model_path(fixture_dir, name) for name in MOE_FIXTURES}
    found.update({p.stem: p for p in TRAINED if p.exists()})
    return found


@pytest.mark.parametrize("name", MOE_FIXTURES + [p.stem for p in TRAINED])
def test_prefetch_never_changes_top_k_logits(paths, name):
    if name not in paths:
        pytest.skip(f"{name}.gguf is not in this checkout")
    ref, st_ref = run(paths[name], "lru", 0.25)
    assert np.isfinite(ref).all() and st_ref.misses > 0
    for prefetch, distance in (("gate", 1), ("gate", 2), ("previous", 1), ("trace", 1)):
        got, st = run(paths[name], "lru", 0.25, prefetch, distance=distance)
        assert np.array_equal(got, ref), f"{prefetch}/{distance}: max |diff| = {np.abs(got - ref).max()}"
        rs = st.residency
        assert rs.prefetch == prefetch
        # the bytes of a decode: on demand plus ahead, nothing else
        assert rs.demand_bytes_read + rs.prefetch_bytes_read == rs.decode_bytes_read
        assert rs.prefetch_used + rs.prefetch_wasted <= rs.prefetch_issued
        assert rs.prefetch_bytes_read <= rs.prefetch_issued * (rs.expert_bytes + 3 * 2 * 4096)
        assert 0 <= rs.predicted_selected <= rs.predicted_total
        if prefetch == "gate" and st.capacity_per_layer.min() >= st.n_expert_used:
            # every layer but the last d is predicted, every decoded token
            assert rs.predicted_total > 0 and rs.prefetch_issued > 0
            # a miss is a demand read of one expert: prefetched experts the token selects are hits
            assert rs.decode_loads == st.misses
            assert rs.demand_bytes_read >= st.misses * rs.expert_bytes
        if prefetch == "previous":
            # the experts of the previous token are still cached (the cache holds at least K): nothing to read
            assert rs.prefetch_issued == 0 and rs.prefetch_bytes_read == 0


@pytest.mark.parametrize("routing", ["lru", "prior:0.5", "max-rank:8"])
@pytest.mark.parametrize("name", ["qwen2moe-60x4", "tiny-shakespeare-qwen2moe-60x4", "tiny-shakespeare-mixtral-8x2"])
def test_streamed_prefetch_equals_counters_only(paths, name, routing):
    """The cache's logic does not depend on the reads: the streamed run (reads in flight, cancelled,
    promoted) gives the logits and counters of the run that only counts, for every routing."""
    if name not in paths:
        pytest.skip(f"{name}.gguf is not in this checkout")
    for size in (0.25, 0.5):
        ref, st_ref = run(paths[name], routing, size, "gate", residency="none")
        got, st = run(paths[name], routing, size, "gate", residency="stream")
        assert np.array_equal(got, ref), f"max |diff| = {np.abs(got - ref).max()}"
        assert (st.hits, st.misses, st.evictions) == (st_ref.hits, st_ref.misses, st_ref.evictions)
        a, b = st.residency, st_ref.residency
        assert (a.prefetch_issued, a.prefetch_used, a.prefetch_wasted, a.predicted_selected, a.predicted_total) == \
               (b.prefetch_issued, b.prefetch_used, b.prefetch_wasted, b.predicted_selected, b.predicted_total)
        assert b.decode_bytes_read == 0 and a.decode_bytes_read > 0


def test_a_prefetch_is_an_insertion_that_counts(paths):
    """Counters only, so the numbers are exact: every prefetched expert is inserted into its layer's
    cache, and ends either selected (used), evicted unselected (wasted) or still cached."""
    _, st_off = run(paths["tiny-shakespeare-qwen2moe-60x4"], "lru", 15, residency="none")
    _, st = run(paths["tiny-shakespeare-qwen2moe-60x4"], "lru", 15, "gate", residency="none")
    rs = st.residency
    assert rs.prefetch_issued > 0 and rs.prefetch_used > 0 and rs.prefetch_wasted > 0
    # the prompt filled every layer's cache, so each insertion (a token's miss or a prefetch) evicts one expert
    assert (st.occupancy_per_layer == 15).all()
    assert st.evictions == st.misses + rs.prefetch_issued
    assert st_off.evictions == st_off.misses
    assert st.selections_per_layer.sum() == st_off.selections_per_layer.sum()  # top-K: same selections
    # the prefetched experts a token used were hits it would not have had: misses go down by at most that
    assert st_off.misses - st.misses <= rs.prefetch_used
    recall = rs.predicted_selected / rs.predicted_total
    assert 0.0 < recall < 1.0 and rs.recall == pytest.approx(recall)
    assert rs.wasted_bytes == rs.prefetch_wasted * rs.expert_bytes


def test_prefetch_min_p_reads_only_the_likely_experts(paths):
    """prefetch_min_p: a predicted expert is prefetched only if the gate gives it at least that
    probability. Fewer predictions and prefetches as it rises; under top-k the logits stay those
    without prefetch; streamed (one reader ahead) equals counters-only."""
    path = paths["tiny-shakespeare-qwen2moe-60x4"]
    off, _ = run(path, "lru", 15, residency="none")
    issued, predicted = [], []
    for min_p in (0.0, 0.3, 0.6):
        got, st = run(path, "lru", 15, "gate", residency="none", prefetch_min_p=min_p)
        assert np.array_equal(got, off)
        issued.append(st.residency.prefetch_issued)
        predicted.append(st.residency.predicted_total)
    assert issued[0] > issued[1] > issued[2] and predicted[0] > predicted[1] > predicted[2], (issued, predicted)
    ref, st_ref = run(path, "prior:0.5", 0.25, "gate", residency="none", prefetch_min_p=0.3)
    got, st = run(path, "prior:0.5", 0.25, "gate", residency="stream", prefetch_min_p=0.3, prefetch_threads=1)
    assert np.array_equal(got, ref)
    assert (st.misses, st.residency.prefetch_issued) == (st_ref.misses, st_ref.residency.prefetch_issued)
    assert st.residency.prefetch_issued > 0


def test_prefetch_options_are_checked():
    with pytest.raises(pymoecache.ConfigError, match="prefetch must be one of"):
        CacheConfig(prefetch="always")
    with pytest.raises(pymoecache.ConfigError, match="prefetch_distance"):
        CacheConfig(prefetch="gate", prefetch_distance=0)
    with pytest.raises(pymoecache.ConfigError, match="prefetch_distance"):
        CacheConfig(prefetch="gate", prefetch_distance=9)
    for bad in (-0.1, 1.5, float("nan"), True, "0.3"):
        with pytest.raises(pymoecache.ConfigError, match="prefetch_min_p"):
            CacheConfig(prefetch="gate", prefetch_min_p=bad)
    with pytest.raises(pymoecache.ConfigError, match=r"prefetch_threads .* \[0, 4\], got 5"):
        CacheConfig(prefetch="gate", io_threads=4, prefetch_threads=5)
    with pytest.raises(pymoecache.ConfigError, match="prefetch_threads"):
        CacheConfig(prefetch="gate", prefetch_threads=-1)
    assert CacheConfig(prefetch="gate", io_threads=4, prefetch_threads=0).prefetch_threads == 0


def test_cli_prefetch_stats_line():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", "-p", "ROMEO:", "-n", "16", "--cache-size", "15",
                        "--prefetch", "gate", "--prefetch-distance", "2", "--prefetch-min-p", "0.05",
                        "--prefetch-threads", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "| prefetch gate: recall " in last and " issued, " in last and "read ahead" in last
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", "-n", "1", "--prefetch", "sometimes"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "invalid choice: 'sometimes'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", "-n", "1", "--prefetch", "gate", "--prefetch-min-p",
                        "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "prefetch_min_p must be a probability in [0, 1], got 2.0" in r.stderr


def test_ppl_decode_measures_prefetch_under_a_policy(tmp_path):
    """`ppl --decode` evaluates token by token, so prefetch takes part: under lru the perplexity is
    exactly that without prefetch (logits do not change), under the prior it may move, and the
    miss rate and recall are reported."""
    import json
    import subprocess
    import sys

    text = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
    if not text.exists():
        text = tmp_path / "t.txt"
        text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40)

    def ppl(*args):
        out = tmp_path / "rows.json"
        r = subprocess.run([sys.executable, "-m", "pymoecache", "ppl", "--text", str(text), "--ctx", "64", "--chunks",
                            "3", "--cache-size", "15", "--no-progress", "--json", str(out), *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return {row["spec"]: row for row in json.loads(out.read_text())}

    batch = ppl("--prior", "0.5")
    off = ppl("--prior", "0.5", "--decode")
    gate = ppl("--prior", "0.5", "--decode", "--prefetch", "gate")
    assert gate["lru"]["ppl"] == off["lru"]["ppl"]                     # top-k: prefetch never changes a logit
    assert gate["lru"]["miss_rate"] < off["lru"]["miss_rate"]          # prefetched experts the tokens used were hits
    assert abs(off["lru"]["ppl"] / batch["lru"]["ppl"] - 1) < 1e-3     # one token at a time = the batch, to rounding
    assert gate["prior:0.5"]["prefetch"] == "gate" and 0 < gate["prior:0.5"]["prefetch_recall"] < 1
    assert off["prior:0.5"]["prefetch"] == "off"
    r = subprocess.run([sys.executable, "-m", "pymoecache", "ppl", "--text", str(text), "--prefetch", "gate"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "add --decode" in r.stderr


def test_trace_prefetch_learns_from_past_requests(paths):
    """prefetch="trace": the second time the same text is a request, the store holds the first
    one's expert counts, so the prediction names more of the experts the tokens select."""
    llm = pymoecache.Llama(str(paths["tiny-shakespeare-qwen2moe-60x4"]), verbose=False, n_ctx=256, n_threads=2,
                           cache=CacheConfig(size=15, residency="none", prefetch="trace"))
    text = (ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt")
    text = text.read_text()[:4000] if text.exists() else "ROMEO: But soft, what light through yonder window breaks? " * 40
    tokens = llm.tokenize(text.encode(), add_bos=True)[:160]
    recall = []
    for _ in range(2):
        llm.reset()  # a new request: the previous one goes into the store
        llm.reset_moe_stats()
        for t in tokens:
            llm.eval([t])
        rs = llm.moe_stats().residency
        assert rs.predicted_total > 0
        recall.append(rs.recall)
    llm.close()
    assert 0.0 < recall[0] < recall[1] <= 1.0, recall


@pytest.mark.parametrize("routing", ["lru", "prior:0.5", "max-rank:8"])
@pytest.mark.parametrize("name", ["qwen2moe-60x4", "tiny-shakespeare-qwen2moe-60x4", "tiny-shakespeare-mixtral-8x2"])
def test_spare_slot_prefetch_changes_no_routing_only_reads(paths, name, routing):
    """prefetch_spare with prefetch_route off: the predicted experts are read into spare slots and the
    cache is left alone, so under every policy the logits, hits, misses and evictions are those without prefetch; the
    reads ahead are counted, each either selected by the routing it was read for (used) or not
    (wasted), and the misses it covered read nothing on demand."""
    if name not in paths:
        pytest.skip(f"{name}.gguf is not in this checkout")
    for size in (0.25, 0.5):
        ref, st_ref = run(paths[name], routing, size, "off")
        got, st = run(paths[name], routing, size, "gate", prefetch_spare=2, prefetch_route=False)
        assert np.array_equal(got, ref), f"max |diff| = {np.abs(got - ref).max()}"
        assert (st.hits, st.misses, st.evictions) == (st_ref.hits, st_ref.misses, st_ref.evictions)
        a, b = st.residency, st_ref.residency
        assert a.prefetch_issued > 0 and a.prefetch_bytes_read > 0
        assert a.prefetch_used + a.prefetch_wasted <= a.prefetch_issued  # (the last token's may be pending)
        assert a.prefetch_issued - (a.prefetch_used + a.prefetch_wasted) <= 2 * len(st.capacity_per_layer)
        # every expert a read ahead brought in is one read fewer on demand, never more bytes on demand
        assert a.demand_bytes_read <= b.demand_bytes_read
        if a.prefetch_used:
            assert a.demand_bytes_read < b.demand_bytes_read
        # counters only: the prediction is made (recall counted) and nothing else changes
        ref2, st2 = run(paths[name], routing, size, "gate", residency="none", prefetch_spare=2)  # (route: stream only)
        assert np.array_equal(ref2, ref) and (st2.hits, st2.misses) == (st_ref.hits, st_ref.misses)
        assert st2.residency.prefetch_issued == 0 and st2.residency.predicted_total > 0


@pytest.mark.parametrize("name", ["tiny-shakespeare-qwen2moe-60x4", "tiny-shakespeare-mixtral-8x2"])
def test_the_prior_counts_the_reads_ahead_as_cached(paths, name):
    """prefetch_route (the default): the prior boosts the experts a prediction reads into the spare
    slots, so the tokens select more of them (here with no budget, so that every predicted miss is
    read), top-k + LRU is untouched; with the adaptive trial it is off, so the routing does not follow
    the trial's timing."""
    if name not in paths:
        pytest.skip(f"{name}.gguf is not in this checkout")
    demand = {True: 0, False: 0}
    every = dict(prefetch_spare=2, prefetch_budget=-1.0)
    for size in (0.25, 0.5):
        ref, _ = run(paths[name], "lru", size, "gate", prefetch_route=False, **every)
        got, _ = run(paths[name], "lru", size, "gate", **every)
        assert np.array_equal(got, ref)  # (no prior: nothing to count)
        plain, off = run(paths[name], "prior:0.1:j=1", size, "gate", prefetch_route=False, **every)
        on, st = run(paths[name], "prior:0.1:j=1", size, "gate", **every)
        assert not np.array_equal(on, plain)
        assert st.residency.prefetch_used >= off.residency.prefetch_used
        demand[True] += st.residency.demand_bytes_read
        demand[False] += off.residency.demand_bytes_read
        adaptive, _ = run(paths[name], "prior:0.1:j=1", size, "gate", prefetch_adaptive=True, **every)  # on, then off
        assert np.array_equal(adaptive, plain)
    if name == "tiny-shakespeare-qwen2moe-60x4":  # fewer bytes on demand (on these few tokens A's only; the
        assert demand[True] < demand[False], demand  # long runs of docs/results.md: 1-6% fewer on A and B)


@pytest.mark.parametrize("name", ["tiny-shakespeare-qwen2moe-60x4", "tiny-shakespeare-mixtral-8x2"])
def test_the_reads_ahead_keep_to_their_budget(paths, name):
    """prefetch_budget: the reads ahead spend a budget that only the routing refills, so the experts
    read ahead for nothing stay under budget x those used (plus the start and the 1/32 per token),
    and the run does not depend on the disk's timing: one reader or eight, the same logits, reads
    and counters."""
    if name not in paths:
        pytest.skip(f"{name}.gguf is not in this checkout")
    S = 2
    common = dict(prefetch_spare=S)
    for size in (0.25, 0.5):
        _, free = run(paths[name], "prior:0.1:j=1", size, "gate", prefetch_budget=-1.0, **common)
        issued = {}
        for budget in (0.0, 0.5):
            got, st = run(paths[name], "prior:0.1:j=1", size, "gate", prefetch_budget=budget, **common)
            rs, layers = st.residency, len(st.capacity_per_layer)
            issued[budget] = rs.prefetch_issued
            assert rs.prefetch_issued > 0
            assert rs.prefetch_used + rs.prefetch_wasted <= rs.prefetch_issued
            start_and_retries = layers * (S + rs.decode_tokens / 32)
            assert rs.prefetch_wasted <= budget * rs.prefetch_used + start_and_retries
            again, st1 = run(paths[name], "prior:0.1:j=1", size, "gate", prefetch_budget=budget, io_threads=1, **common)
            assert np.array_equal(again, got)
            a, b = st1.residency, rs
            assert (st1.hits, st1.misses, a.prefetch_issued, a.prefetch_used, a.prefetch_wasted, a.demand_bytes_read) == \
                   (st.hits, st.misses, b.prefetch_issued, b.prefetch_used, b.prefetch_wasted, b.demand_bytes_read)
        # no budget reads every predicted miss, a budget fewer (the predictions here waste some)
        assert issued[0.0] <= issued[0.5] <= free.residency.prefetch_issued
        assert issued[0.0] < free.residency.prefetch_issued


def test_prefetch_budget_is_checked():
    for bad in (True, 65.0, float("nan"), "0.5"):
        with pytest.raises(pymoecache.ConfigError, match="prefetch_budget"):
            CacheConfig(prefetch="gate", prefetch_spare=2, prefetch_budget=bad)
    assert CacheConfig(prefetch_budget=-1).prefetch_budget == -1 and CacheConfig(prefetch_budget=0.5).prefetch_budget == 0.5
    assert CacheConfig().prefetch_budget == 0 and not CacheConfig().prefetch_adaptive  # (the default: a budget of 0)


def test_prefetch_spare_is_checked():
    with pytest.raises(pymoecache.ConfigError, match="prefetch_spare"):
        CacheConfig(prefetch="gate", prefetch_spare=-1)
    with pytest.raises(pymoecache.ConfigError, match="prefetch_spare"):
        CacheConfig(prefetch="gate", prefetch_spare=True)


@pytest.mark.parametrize("adaptive", [True, False])
def test_adaptive_spare_prefetch_tries_both_and_keeps_one(paths, adaptive):
    """prefetch_adaptive: a trial of 32 decoded tokens, with the reads ahead and without in turn,
    then the winner (whichever it was on this machine) for the next 96; off: every token has them.
    The routing is the same either way."""
    path = paths["tiny-shakespeare-qwen2moe-60x4"]
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=15, residency="stream", prefetch="gate", prefetch_spare=2,
                                                        prefetch_adaptive=adaptive),
                           routing="prior:0.5", n_ctx=128, n_threads=2, verbose=False)
    tokens = llm.tokenize(b"ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet "
                          b"is the sun. Arise, fair sun, and kill the envious moon")[:45]
    llm.eval(tokens[:4])
    llm.reset_moe_stats()
    for t in tokens[4:6]:
        llm.eval([t])
    assert llm.moe_stats().residency.prefetch_tokens_on == (1 if adaptive else 2)  # the trial: on, then off
    for t in tokens[6:44]:
        llm.eval([t])
    rs = llm.moe_stats().residency
    assert rs.decode_tokens == 40
    if adaptive:
        assert rs.prefetch_tokens_on in (16, 24)  # 16 of the trial's 32, then 8 tokens of the winner
    else:
        assert rs.prefetch_tokens_on == 40
    assert rs.prefetch_issued > 0
    assert f"on for {rs.prefetch_tokens_on}/40 tokens" in rs.summary()
    with pytest.raises(pymoecache.ConfigError, match="prefetch_adaptive"):
        CacheConfig(prefetch_adaptive=1)

