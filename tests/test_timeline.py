"""The timeline (moecache_timeline_start, Llama.start_timeline, run --timeline): every expert read
the reader threads ran is in it with the bytes the counters count, every decoded token shows each
MoE layer's routing and wait, the overlap it reports agrees with the counters, and the files it
writes open as Chrome trace-event JSON. No timing is asserted, only order and accounting."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import pymoecache
from pymoecache import CacheConfig
from pymoecache.timeline import KIND, KINDS, Timeline
from conftest import ROOT, model_path


def generate(path, residency="stream", size=0.25, prefetch="off", capacity=262_144, n=12, **kw):
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=size, residency=residency, prefetch=prefetch),
                           routing="prior:0.5", n_ctx=256, n_threads=2, verbose=False, **kw)
    llm.start_timeline(capacity)
    llm("ROMEO: what light", max_tokens=n, temperature=0.0)
    return llm


@pytest.mark.parametrize("prefetch", ["off", "gate"])
def test_reads_in_the_timeline_are_the_reads_counted(fixture_dir, prefetch):
    llm = generate(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0"), prefetch=prefetch)
    tl, st = llm.timeline(), llm.moe_stats().residency
    ev = tl.events
    reads = ev[np.isin(ev["kind"], (KIND["read"], KIND["read_ahead"]))]
    assert len(reads) > 0
    # every byte the counters say was read is a read event, and ahead vs on demand agree
    assert int(reads["bytes"].sum()) == st.decode_bytes_read
    assert int(ev[ev["kind"] == KIND["read_ahead"]]["bytes"].sum()) == st.prefetch_bytes_read
    assert (prefetch == "gate") == (st.prefetch_bytes_read > 0)
    # each read ran on a reader thread, after it was queued
    assert (reads["thread"] >= 1).all()
    assert (reads["t_queued_us"] <= reads["t_start_us"]).all() and (reads["t_start_us"] <= reads["t_end_us"]).all()
    assert set(np.unique(reads["layer"])) <= set(llm.model_info.moe_layers)
    assert tl.dropped == 0


def test_every_decoded_token_routes_and_waits_in_every_moe_layer(fixture_dir):
    llm = generate(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0"), n=8)
    tl = llm.timeline()
    dec = tl.decode_tokens()
    assert len(dec) == 7 and len(tl.tokens) == 8  # the prompt, then 7 decodes (the 8th token is sampled only)
    layers = sorted(llm.model_info.moe_layers)
    for tok in dec:
        inside = tl.events[(tl.events["t_start_us"] >= tok["t_start_us"]) & (tl.events["t_end_us"] <= tok["t_end_us"])]
        for kind in ("route", "wait"):  # (a wait for one expert names it: the residency op's names none)
            e = inside[(inside["kind"] == KIND[kind]) & (inside["thread"] == 0) & (inside["expert"] == -1)]
            assert sorted(e["layer"].tolist()) == layers, kind
            assert (e["n_tokens"] == 1).all()
        # in each layer the routing comes before the wait for its experts
        route = inside[inside["kind"] == KIND["route"]]
        wait = inside[(inside["kind"] == KIND["wait"]) & (inside["expert"] == -1)]
        for il in layers:
            assert route[route["layer"] == il]["t_end_us"][0] <= wait[wait["layer"] == il]["t_start_us"][0]
    prompt = tl.tokens[tl.tokens["n_tokens"] > 1]
    assert len(prompt) == 1
    p0, p1 = prompt["t_start_us"][0], prompt["t_end_us"][0]
    pw = tl.events[(tl.events["kind"] == KIND["wait"]) & (tl.events["t_start_us"] >= p0) & (tl.events["t_end_us"] <= p1)]
    # the prompt's one ubatch: one residency op per MoE layer (llama.cpp runs the last layer's FFN
    # on the output rows only, so that one sees a single token)
    assert sorted(pw["layer"].tolist()) == layers
    assert (pw["n_tokens"][pw["layer"] != layers[-1]] == 7).all()


@pytest.mark.parametrize("routing,size", [("lru", 0.25), ("prior:0.5", 0.25)])
def test_a_layer_computes_its_cached_experts_before_it_waits_for_a_miss(fixture_dir, routing, size):
    """overlap_experts: each decoded layer runs the matmuls of every expert it selected exactly
    once, the cached ones (whose bytes are in) before any wait, and waits only for misses."""
    llm = pymoecache.Llama(str(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0")),
                           cache=CacheConfig(size=size, residency="stream", trace=4096), routing=routing,
                           n_ctx=256, n_threads=2, verbose=False)
    llm.start_timeline()
    llm("ROMEO: what light", max_tokens=12, temperature=0.0)
    tl, trace = llm.timeline(), llm.moecache.trace()
    layers = sorted(llm.model_info.moe_layers)
    dec = tl.decode_tokens()
    recs = {il: trace[trace["layer"] == il][-len(dec):] for il in layers}  # the decoded tokens' records, in order
    n_hits = n_misses = 0
    for t, tok in enumerate(dec):
        inside = tl.events[(tl.events["t_start_us"] >= tok["t_start_us"]) & (tl.events["t_end_us"] <= tok["t_end_us"])]
        for il in layers:
            r = recs[il][t]
            sel = r["experts"][: r["n_selected"]]
            hits = {int(e) for i, e in enumerate(sel) if r["hit_mask"] >> i & 1}
            misses = {int(e) for e in sel} - hits
            n_hits, n_misses = n_hits + len(hits), n_misses + len(misses)
            ran = inside[(inside["kind"] == KIND["expert"]) & (inside["layer"] == il)]
            assert sorted(ran["expert"].tolist()) == sorted({int(e) for e in sel}), (t, il)
            waits = inside[(inside["kind"] == KIND["wait"]) & (inside["layer"] == il) & (inside["expert"] >= 0)]
            assert set(waits["expert"].tolist()) <= misses, (t, il)
            if len(waits):
                first_wait = int(waits["t_start_us"].min())
                assert all(int(e["t_end_us"]) <= first_wait for e in ran if int(e["expert"]) in hits), (t, il)
    assert n_hits > 0 and n_misses > 0
    # with overlap_experts off, the residency op waits for everything and no expert event is recorded
    llm2 = pymoecache.Llama(str(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0")),
                            cache=CacheConfig(size=size, residency="stream", overlap_experts=False), routing=routing,
                            n_ctx=256, n_threads=2, verbose=False)
    llm2.start_timeline()
    llm2("ROMEO: what light", max_tokens=4, temperature=0.0)
    ev = llm2.timeline().events
    assert not (ev["kind"] == KIND["expert"]).any() and (ev[ev["kind"] == KIND["wait"]]["expert"] == -1).all()
    with pytest.raises(pymoecache.ConfigError, match="overlap_experts must be True or False"):
        CacheConfig(overlap_experts=1)


def test_overlap_agrees_with_the_counters(fixture_dir):
    import time

    llm = generate(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0"), n=16)
    for _ in range(100):  # the reads of cached experts a token did not wait for may still run: let them end
        st = llm.moe_stats().residency
        tl = llm.timeline()
        if llm.moe_stats().residency.decode_t_read_ms == st.decode_t_read_ms:
            break
        time.sleep(0.02)
    o = tl.overlap()
    assert o.tokens == st.decode_tokens == 15
    assert o.bytes_read == st.decode_bytes_read
    # reads in flight: the union of the recorded read intervals is the library's busy clock, exactly
    assert o.read_ms == pytest.approx(st.decode_t_read_ms, abs=1e-9)
    # every wait of the graph thread is in decode_t_io_ms (which also counts prefetch issue time)
    assert o.wait_ms <= st.decode_t_io_ms + 0.01
    assert 0.0 <= o.share <= 1.0 and 0.0 <= st.overlap <= 1.0
    assert "overlap" in st.summary() and "major faults" in st.summary()
    assert st.decode_major_faults >= 0 and st.major_faults_per_token == st.decode_major_faults / 15
    llm.reset_moe_stats()
    assert llm.moe_stats().residency.decode_major_faults == 0


def test_the_capacity_keeps_the_first_events_and_counts_the_rest(fixture_dir):
    llm = generate(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0"), capacity=50)
    tl = llm.timeline()
    assert len(tl) == 50 and tl.dropped > 0
    llm.start_timeline(0)  # off: nothing recorded, nothing to read
    with pytest.raises(pymoecache.MoECacheError, match="start_timeline"):
        llm.timeline()
    with pytest.raises(pymoecache.ConfigError):
        llm.start_timeline(-1)


def test_resident_and_mmap_record_what_they_do(fixture_dir):
    path = model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0")
    ev = generate(path, residency="none", size=1.0).timeline().events
    assert set(np.unique(ev["kind"])) == {KIND["route"]}  # no residency op, no reads
    ev = generate(path, residency="mmap").timeline().events
    assert {KIND["route"], KIND["wait"], KIND["lock"]} <= set(np.unique(ev["kind"]))
    assert not np.isin(ev["kind"], (KIND["read"], KIND["read_ahead"])).any()


def test_chrome_json_and_picture(fixture_dir, tmp_path):
    tl = generate(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0")).timeline()
    tl.save_chrome(tmp_path / "t.json", note="x")
    doc = json.loads((tmp_path / "t.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in xs)
    names = {e["name"].split(" ")[0] for e in xs}
    assert {"token", "route", "wait", "compute", "read"} <= names
    # the slices of the graph thread nest: none overlaps another inside a token
    g = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if e["tid"] == 0 and e["cat"] != "token")
    assert all(a[1] <= b[0] for a, b in zip(g, g[1:]))
    assert doc["otherData"]["note"] == "x" and doc["otherData"]["decode_tokens"] == 11
    pytest.importorskip("matplotlib")
    labels = tl.plot(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # issue 56 item 6: the legend lists what was drawn, nothing more (no reads ahead here: prefetch off)
    assert "compute" in labels and "read ahead" not in labels and "lowbit" not in labels, labels


def test_timeline_of_a_hand_made_recording():
    """Overlap arithmetic on known intervals: two reads in parallel then one alone, one wait."""
    from pymoecache.timeline import EVENT_DTYPE, TOKEN_DTYPE

    ev = np.zeros(4, dtype=EVENT_DTYPE)
    ev[0] = (KIND["read"], 0, 1, 1, 0, 0, 0, 0, 100, 10)
    ev[1] = (KIND["read"], 0, 2, 2, 0, 0, 0, 50, 150, 10)
    ev[2] = (KIND["read_ahead"], 1, 3, 1, 0, 0, 0, 400, 500, 10)
    ev[3] = (KIND["wait"], 0, -1, 0, 1, 0, 20, 20, 170, 0)
    tl = Timeline(ev, np.array([(0, 600, 1), (600, 700, 5)], dtype=TOKEN_DTYPE))
    o = tl.overlap()
    assert (o.tokens, o.read_ms, o.wait_ms, o.token_ms, o.bytes_read) == (1, 0.25, 0.15, 0.6, 30)
    assert o.share == pytest.approx(0.4)


def test_cli_timeline(fixture_dir, tmp_path):
    model = model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0")
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(model), "-p", "ROMEO:", "-n", "12",
                        "--cache-size", "0.25", "--prior", "0.5", "--timeline", str(out), "--timeline-plot", str(png)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"written to {out}" in r.stderr and "overlap" in r.stderr
    doc = json.loads(out.read_text())
    assert doc["otherData"]["routing"] == "prior:0.5" and doc["otherData"]["decode_tokens"] == 11
    assert png.stat().st_size > 0
    assert "overlap" in r.stderr.strip().splitlines()[-1]  # the stats line
    # a target that cannot be written is refused before the model loads
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(model), "-n", "4", "--timeline", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "not a regular file" in r.stderr


def test_timeline_get_copies_at_most_cap_and_returns_the_count(fixture_dir):
    import ctypes

    from pymoecache import _moecache_cpp as C

    llm = generate(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0"), n=6)
    buf = (C.moecache_event * 4)()
    for i in range(4):
        buf[i].kind = -7  # a marker: what the call does not write stays
    total = C.moecache_timeline_get(llm.moecache._h, buf, 3, None)
    assert total > 3 and [buf[i].kind for i in range(3)] != [-7] * 3 and buf[3].kind == -7
    ev, dropped = llm.moecache.timeline_events()
    assert len(ev) >= total and dropped == 0 and set(ev["kind"]) <= set(range(len(KINDS)))
