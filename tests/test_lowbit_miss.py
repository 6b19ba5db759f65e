"""The low-bit miss path (issue 42 item 2): a streamed decode computes misses (or every selection)
from the low-bit companion. Its numbers equal, bit for bit, llama.cpp's own op on the low-bit
tensors; the critical path reads fewer bytes; the full copies read behind become full-precision
hits; and a missing or unusable companion is a clear error (or, with miss='auto', a note)."""

from __future__ import annotations

import shutil
import time
import warnings

import numpy as np
import pytest

import pymoecache
from conftest import model_path
from pymoecache import CacheConfig, lowbit

MODEL = "qwen2moe-60x4"


@pytest.fixture(scope="module")
def files(fixture_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("lowbit")
    m = d / "model.gguf"
    shutil.copy(model_path(fixture_dir, MODEL, ".Q8_0"), m)
    # Q5_0: a type ggml's CPU backend computes as it is (Q4_0 would be repacked for the reference's
    # resident weights, another kernel); it is also what Q4_K falls back to on the fixture's rows
    c = lowbit.make_companion(m, type="Q5_0", progress=False)
    return m, c


def reference_model(model, companion, out):
    """``model`` with its routed experts replaced by the companion's tensors: what llama.cpp's own op
    computes on the low-bit copies (a GGUF edit, every other tensor byte for byte the model's)."""
    import gguf
    import gguf_edit as ge

    g = ge.Gguf.parse(model.read_bytes())
    low = {t.name: t for t in gguf.GGUFReader(companion).tensors}
    align = g.get("general.alignment", 32)
    data = bytearray()
    for t in g.tensors:
        if t.name in low:
            raw, t.ggml_type = low[t.name].data.tobytes(), int(low[t.name].tensor_type)
        else:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
            raw = g.data[t.offset:t.offset + int(np.prod(t.shape)) // block * size]
        data += b"\0" * (-len(data) % align)
        t.offset = len(data)
        data += raw
    g.data = bytes(data)
    out.write_bytes(g.to_bytes())
    return out


def logits_per_token(llm, tokens):
    """Each token evaluated alone (a decode: the low-bit path serves decodes), the logits after it."""
    import llama_cpp

    out = []
    for t in tokens:
        llm.eval([t])
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        out.append(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy())
    return np.array(out)


def reference_logits(m, c, tmp_path):
    """The tokens of a sentence and, for each, the logits of llama.cpp's own op on the companion's
    tensors (reference_model, every expert resident, top-k)."""
    ref = pymoecache.Llama(str(reference_model(m, c.path, tmp_path / "ref.gguf")), n_ctx=128, verbose=False,
                           n_threads=2, cache=CacheConfig(size=1.0, residency="none"), routing="lru")
    tokens = ref.tokenize(b"Once upon a time there was a king who ruled the land", add_bos=True)
    want = logits_per_token(ref, tokens)
    ref.close()
    return tokens, want


def test_every_selection_from_the_companion_equals_llama_cpps_op_on_it(files, tmp_path):
    m, c = files
    tokens, want = reference_logits(m, c, tmp_path)
    llm = pymoecache.Llama(str(m), n_ctx=128, verbose=False, n_threads=2, routing="lru",
                           cache=CacheConfig(size=8, miss="lowbit-all", prefetch="off"))
    got = logits_per_token(llm, tokens)
    rs = llm.moe_stats().residency
    llm.close()
    assert np.array_equal(got, want)  # bit for bit
    assert rs.lowbit_loads == len(tokens) * 4 * 4 and rs.lowbit_behind == 0  # K x MoE layers per token
    full = pymoecache.Llama(str(m), n_ctx=128, verbose=False, n_threads=2, routing="lru",
                            cache=CacheConfig(size=8, prefetch="off", miss="full"))
    assert not np.array_equal(logits_per_token(full, tokens), want)  # (the low-bit copies do change the numbers)
    full.close()


def test_misses_from_the_companion_read_fewer_bytes_on_the_critical_path(files):
    m, c = files
    runs = {}
    for miss in ("full", "lowbit"):
        llm = pymoecache.Llama(str(m), n_ctx=128, verbose=False, routing="lru",
                               cache=CacheConfig(size=8, miss=miss, prefetch="off"))
        tokens = llm.tokenize(b"Once upon a time there was a king who ruled the land", add_bos=True)
        logits_per_token(llm, tokens)
        runs[miss] = (llm.moe_stats(), llm.cache_config)
        llm.close()
    (full, _), (low, cfg) = runs["full"], runs["lowbit"]
    assert cfg.lowbit == c.path  # found beside the model
    rf, rl = full.residency, low.residency
    # (the routing is the cache's, the same policy; the experts' numbers differ, so the later tokens may
    # route a little differently: the counts are compared per token)
    assert rl.lowbit_loads > 0 and rl.lowbit_bytes_read == rl.lowbit_loads * c.expert_bytes
    # every full read went behind its token; the token after a miss computes it from the companion too
    assert rl.decode_loads == rl.lowbit_behind < rl.lowbit_loads
    # what a token waits for: the full copies it demands, or the low-bit copies of its misses
    per_token_full = rf.demand_bytes_read / rf.decode_tokens
    per_token_low = rl.lowbit_bytes_read / rl.decode_tokens
    assert per_token_low < per_token_full / 1.4, (per_token_low, per_token_full)
    assert "low-bit:" in rl.summary()


def test_copies_held_in_memory_compute_the_same_and_read_nothing_per_token(files):
    """lowbit_in_ram: every low-bit copy read once at load; the numbers are those of the pool read per
    token (the same copies), the misses' full copies still go behind, and no token reads the companion."""
    m, c = files
    got = {}
    for in_ram in (False, True):
        for miss in ("lowbit-all", "lowbit"):
            llm = pymoecache.Llama(str(m), n_ctx=128, verbose=False, n_threads=2, routing="lru",
                                   cache=CacheConfig(size=8, miss=miss, prefetch="off", lowbit_in_ram=in_ram))
            tokens = llm.tokenize(b"Once upon a time there was a king who ruled the land", add_bos=True)
            got[in_ram, miss] = (logits_per_token(llm, tokens), llm.moe_stats().residency, llm.memory_plan())
            llm.close()
    for miss in ("lowbit-all", "lowbit"):
        (pool, rp, plan_pool), (ram, rr, plan_ram) = got[False, miss], got[True, miss]
        assert np.array_equal(pool, ram), miss
        assert rr.lowbit_loads == rp.lowbit_loads > 0 and rr.lowbit_behind == rp.lowbit_behind
        assert rr.lowbit_bytes_read == 0 < rp.lowbit_bytes_read
        n_layers = 4
        assert rr.lowbit_bytes == (60 + 1) * c.expert_bytes * n_layers  # every copy and the zero slot
        assert rp.lowbit_bytes == (4 + 1) * c.expert_bytes * n_layers
        assert plan_ram.lowbit_memory == rr.lowbit_bytes and plan_pool.lowbit_memory == rp.lowbit_bytes
        assert plan_ram.critical_per_token == 0 < plan_pool.critical_per_token
        assert "low-bit" in plan_ram.summary() and "no read" in plan_ram.summary()
    with pytest.raises(pymoecache.ConfigError, match="lowbit_in_ram"):
        CacheConfig(size=8, miss="full", lowbit_in_ram=True)


def test_misses_that_weigh_more_than_lowbit_max_p_stay_at_full_precision(files):
    """HOBBIT's rule: a miss whose router probability is at least lowbit_max_p is read at full
    precision. Below every probability nothing comes from the companion: the full run's logits."""
    m, _ = files
    got = {}
    for miss, max_p in (("full", 1.0), ("lowbit", 1e-9), ("lowbit", 0.2), ("lowbit", 1.0)):
        llm = pymoecache.Llama(str(m), n_ctx=128, verbose=False, n_threads=2, routing="lru",
                               cache=CacheConfig(size=8, miss=miss, prefetch="off", lowbit_max_p=max_p))
        tokens = llm.tokenize(b"Once upon a time there was a king who ruled the land", add_bos=True)
        got[miss, max_p] = (logits_per_token(llm, tokens), llm.moe_stats().residency)
        llm.close()
    assert np.array_equal(got["lowbit", 1e-9][0], got["full", 1.0][0])
    assert got["lowbit", 1e-9][1].lowbit_loads == 0
    loads = [got["lowbit", p][1].lowbit_loads for p in (1e-9, 0.2, 1.0)]
    assert loads[0] < loads[1] < loads[2], loads
    with pytest.raises(pymoecache.ConfigError, match="lowbit_max_p"):
        CacheConfig(size=8, miss="lowbit", lowbit_max_p=0.0)


def test_the_timeline_marks_the_low_bit_reads(files, tmp_path):
    from pymoecache.timeline import KIND

    m, _ = files
    llm = pymoecache.Llama(str(m), n_ctx=128, verbose=False, routing="lru",
                           cache=CacheConfig(size=8, miss="lowbit", prefetch="off"))
    llm.start_timeline()
    logits_per_token(llm, llm.tokenize(b"Once upon a time there was", add_bos=True))
    ev = llm.timeline().events
    rs = llm.moe_stats().residency
    llm.close()
    low = ev[ev["kind"] == KIND["lowbit"]]
    # one read per expert tensor (gate, up, down) of each copy, on the reader threads
    assert len(low) == 3 * rs.lowbit_loads > 0 and (low["thread"] > 0).all() and (low["bytes"] > 0).all()


def test_a_missing_or_unusable_companion(files, fixture_dir, tmp_path):
    m, _ = files
    bare = tmp_path / "bare.gguf"
    shutil.copy(m, bare)
    kw = dict(n_ctx=64, verbose=False)
    with pytest.raises(lowbit.CompanionError, match="no low-bit companion at .*pymoecache lowbit"):
        pymoecache.Llama(str(bare), cache=CacheConfig(size=8, miss="lowbit"), **kw)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        llm = pymoecache.Llama(str(bare), cache=CacheConfig(size=8, miss="auto"), **kw)
    assert llm.cache_config.miss == "full" and any("pymoecache lowbit" in str(x.message) for x in w)
    llm.close()
    with warnings.catch_warnings(record=True) as w:  # the default: auto, quietly where there is no companion
        warnings.simplefilter("always")
        llm = pymoecache.Llama(str(bare), cache=CacheConfig(size=8), **kw)
    assert llm.cache_config.miss == "full" and not [x for x in w if "companion" in str(x.message)]
    llm.close()
    other = tmp_path / "other.gguf"
    shutil.copy(model_path(fixture_dir, "mixtral-8x2", ".Q8_0"), other)
    foreign = lowbit.make_companion(other, progress=False).path
    with pytest.raises(lowbit.CompanionError, match="another model"):
        pymoecache.Llama(str(bare), cache=CacheConfig(size=8, miss="lowbit", lowbit=foreign), **kw)
    with pytest.raises(pymoecache.ConfigError, match="needs residency 'stream'"):
        pymoecache.Llama(str(m), cache=CacheConfig(size=1.0, residency="none", miss="lowbit"), **kw)
    with pytest.raises(pymoecache.ConfigError, match="only miss="):
        pymoecache.Llama(str(m), cache=CacheConfig(size=8, miss="full", lowbit=foreign), **kw)
    with pytest.raises(lowbit.CompanionError, match="another model"):  # (the default, auto, reads the one named)
        pymoecache.Llama(str(m), cache=CacheConfig(size=8, lowbit=foreign), **kw)
    with pytest.raises(pymoecache.ConfigError, match="miss must be one of"):
        CacheConfig(miss="half")


def test_a_cache_of_low_bit_copies_equals_llama_cpps_op_on_them_in_the_same_memory(files, tmp_path):
    """miss='lowbit-cache': the slots hold the companion's copies, as many as fit in the memory of the
    experts asked for, and every read is from the companion. Each decoded token equals llama.cpp's
    own op on the low-bit tensors bit for bit, and the larger cache misses less."""
    m, c = files
    tokens, want = reference_logits(m, c, tmp_path)
    runs = {}
    for miss in ("full", "lowbit-cache"):
        llm = pymoecache.Llama(str(m), n_ctx=128, verbose=False, n_threads=2, routing="lru",
                               cache=CacheConfig(size=8, miss=miss, prefetch="off"))
        runs[miss] = (logits_per_token(llm, tokens), llm.moe_stats(), llm.memory_plan())
        llm.close()
    (full, st_full, _), (got, st, plan) = runs["full"], runs["lowbit-cache"]
    assert np.array_equal(got, want)  # bit for bit
    assert not np.array_equal(full, want)
    fit = int(8 * st_full.residency.expert_bytes / c.expert_bytes)  # Q8_0 -> Q5_0: 8 experts' bytes hold 12
    assert fit > 8 and (st.capacity_per_layer == fit).all() and (st_full.capacity_per_layer == 8).all()
    rs = st.residency
    assert rs.miss == "lowbit-cache" and rs.expert_bytes == c.expert_bytes and rs.lowbit_loads == 0
    assert rs.arena_bytes <= st_full.residency.arena_bytes  # the same memory
    assert 0 < st.misses < st_full.misses
    assert plan.n_cached == fit and plan.slot_bytes == c.expert_bytes and plan.lowbit_memory == 0
    assert f"{fit} of 60 per layer low-bit" in plan.summary() and "(lowbit-cache)" in plan.summary()
    assert "(lowbit-cache)" in rs.summary()


def test_a_cache_of_low_bit_copies_after_a_prompt(files):
    """A prompt computes from the model at full precision and reads the experts it leaves cached from
    the companion: the decoded tokens after it equal those of a run whose prompt cached nothing (every
    expert then read by the decodes), bit for bit."""
    import llama_cpp

    m, c = files
    got = {}
    for update in (True, False):
        llm = pymoecache.Llama(str(m), n_ctx=128, verbose=False, n_threads=2, routing="lru",
                               cache=CacheConfig(size=8, miss="lowbit-cache", prefetch="off", update_on_prompt=update))
        llm.eval(llm.tokenize(b"Once upon a time there was a king", add_bos=True))  # one ubatch
        prompt = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()
        occupancy = llm.moe_stats().occupancy_per_layer.copy()
        got[update] = (prompt, logits_per_token(llm, llm.tokenize(b" who ruled the land", add_bos=False)), occupancy)
        llm.close()
    assert (got[True][2] > 0).all() and (got[False][2] == 0).all()
    assert np.array_equal(got[True][0], got[False][0])
    assert np.array_equal(got[True][1], got[False][1])


def test_miss_auto_caches_the_low_bit_copies_where_a_companion_is_found(files):
    m, _ = files
    for miss in ("auto", None):  # (None: the default)
        llm = pymoecache.Llama(str(m), n_ctx=64, verbose=False, cache=CacheConfig(size=8, miss=miss))
        assert llm.cache_config.miss == "lowbit-cache" and llm.moe_stats().residency.miss == "lowbit-cache"
        llm.close()
    llm = pymoecache.Llama(str(m), n_ctx=64, verbose=False, cache=CacheConfig(size=8, miss="auto", lowbit_in_ram=True))
    assert llm.cache_config.miss == "lowbit"  # (copies in memory beside the cache: the miss path)
    llm.close()
    llm = pymoecache.Llama(str(m), n_ctx=64, verbose=False, cache=CacheConfig(size=1.0, miss="auto"))
    assert llm.cache_config.miss == "full"  # every expert cached at full precision: nothing streams
    llm.close()
    with pytest.raises(pymoecache.ConfigError, match="the cache holds them"):
        CacheConfig(size=8, miss="lowbit-cache", lowbit_in_ram=True)


def test_a_companion_changed_during_a_run_stops_the_next_eval(files, tmp_path):
    m, c = files
    model, companion = tmp_path / "model.gguf", tmp_path / "model.lowbit-Q5_0.gguf"
    shutil.copy(m, model)
    shutil.copy(c.path, companion)
    llm = pymoecache.Llama(str(model), n_ctx=64, verbose=False, cache=CacheConfig(size=8, prefetch="off"))
    assert llm.cache_config.miss == "lowbit-cache"
    tokens = llm.tokenize(b"Once upon a time", add_bos=True)
    llm.eval(tokens[:1])
    with open(companion, "ab") as f:
        f.write(b"\0" * 64)
    time.sleep(2 * pymoecache.llama.CHECK_INTERVAL_S)  # (decoded tokens check the files that often, not each one)
    with pytest.raises(pymoecache.MoECacheIOError, match="low-bit companion .* changed size"):
        llm.eval(tokens[1:2])
    llm.close()


def test_prompts_stay_at_full_precision(files):
    """A prompt ubatch never uses the pool, also where the layer holds every expert in its slots (its
    prompts then compute on the slots, through the same code as a decode)."""
    m, _ = files

    def prompt_logits(miss):
        import llama_cpp

        llm = pymoecache.Llama(str(m), n_ctx=128, verbose=False, routing="lru",
                               cache=CacheConfig(size=1.0, residency="stream", miss=miss, prefetch="off"))
        llm.eval(llm.tokenize(b"Once upon a time there was a king", add_bos=True))  # one ubatch
        out = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()
        loads = llm.moe_stats().residency.lowbit_loads
        llm.close()
        return out, loads

    full, _ = prompt_logits("full")
    low, loads = prompt_logits("lowbit-all")
    assert loads == 0 and np.array_equal(low, full)


def test_the_cli_and_the_server_as_users_run_them(files, tmp_path):
    import json
    import subprocess
    import sys
    import urllib.request

    from conftest import ROOT, running_server

    m, _ = files
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(m), "--cache-size", "8", "--miss", "lowbit",
                        "-n", "8", "-p", "Once upon a time"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "low-bit:" in r.stderr and "experts/tok from the companion" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(m), "--cache-size", "8", "--miss", "lowbit",
                        "--lowbit-in-ram", "-n", "4", "-p", "Once upon a time"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "every expert's low-bit copy" in r.stderr and "no read (its copies are in memory)" in r.stderr
    assert "(0.00 MiB/tok)" in r.stderr  # nothing read from the companion per token
    r = subprocess.run([sys.executable, "-m", "pymoecache", "info", str(m)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "low-bit companion" in r.stdout and "fewer bytes on the critical path" in r.stdout
    assert "--lowbit-in-ram" in r.stdout
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(m), "--cache-size", "8", "--miss", "lowbit",
                        "--lowbit", str(tmp_path / "none.gguf"), "-n", "2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "no low-bit companion at" in r.stderr and "Traceback" not in r.stderr
    with running_server(m, tmp_path / "server.log", "--cache-size", "8", "--miss", "lowbit", "--routing", "lru") as (base, _):
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(base + "/completion", data=json.dumps({"prompt": "Once upon a time",
                                                                            "n_predict": 8}).encode(), method="POST")
        assert json.loads(opener.open(req, timeout=300).read())["tokens_predicted"] > 0
        metrics = opener.open(base + "/metrics", timeout=60).read().decode()
        loads = [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("pymoecache:lowbit_loads_total ")]
        assert loads and loads[0] > 0


def test_ppl_puts_the_low_bit_path_beside_full_precision_misses(files, tmp_path):
    """`ppl --miss full lowbit`: the quality of the miss path against full-precision misses, the same
    routing and cache, as a user runs it. Full-precision rows stream too and keep their perplexity."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    m, _ = files
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little cat. It liked to play in the sun with a red ball. " * 30)
    out = tmp_path / "rows.json"
    base = [sys.executable, "-m", "pymoecache", "ppl", str(m), "-f", str(text), "--ctx", "32", "--chunks", "3",
            "--cache-size", "8", "--routing", "lru", "--no-progress"]
    r = subprocess.run(base + ["--miss", "full", "lowbit", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "critical MiB/tok" in r.stdout and "one token at a time" in r.stderr
    full, low = json.loads(out.read_text())
    assert (full["miss_path"], low["miss_path"]) == ("full", "lowbit")
    assert full["lowbit_per_token"] == 0 and low["lowbit_per_token"] > 0
    assert 0 < low["critical_mib_per_token"] < full["critical_mib_per_token"]
    assert low["ppl"] != full["ppl"]  # computed from other weights
    assert abs(low["ppl"] / full["ppl"] - 1) < 0.1
    # the same routing without streaming gives full's perplexity (where experts live changes no number);
    # --miss full: the default (auto) would take the companion beside the model, as run does
    r = subprocess.run(base + ["--decode", "--miss", "full", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (plain,) = json.loads(out.read_text())
    assert plain["ppl"] == full["ppl"] and plain["miss_rate"] == full["miss_rate"]
    r = subprocess.run(base + ["--lowbit", str(tmp_path / "x.gguf")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "--miss lowbit" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("in_ram", [False, True])
def test_cache_size_auto_sets_the_low_bit_pools_aside(files, monkeypatch, in_ram):
    """Issue 53 item 13: the automatic cache size leaves room for what decoding adds beside the cache. The
    low-bit miss path keeps K + 1 companion copies per layer (N + 1 with lowbit_in_ram): they are set
    aside before the cache is sized, and the plan says so. lowbit-cache (the default with a companion)
    keeps none: its slots are the cache."""
    import pymoecache.plan
    from pymoecache import auto_cache_size, model_info

    m, comp = files
    info, c = model_info(m), str(comp.path)
    per_expert = info.cache_bytes * info.n_moe_layer
    dense = pymoecache.plan._on_host(info, 256, 0)[0]  # (the dense part the plan counts)
    available = dense + 2 * 2 * 256 * info.n_layer * info.n_embd + (128 << 20) + int(info.n_expert // 2 * per_expert)
    monkeypatch.setattr(pymoecache.plan, "_available_memory", lambda: available)
    pools = int(((info.n_expert if in_ram else info.n_expert_used) + 1) * comp.expert_bytes * info.n_moe_layer)
    got = {}
    for miss in ("lowbit", None):
        llm = pymoecache.Llama(str(m), n_ctx=256, verbose=False, routing="lru",
                               cache=CacheConfig(size="auto", miss=miss, lowbit=c if miss else None,
                                                 lowbit_in_ram=in_ram and miss is not None, prefetch="off"))
        got[miss] = llm.cache_choice
        llm.close()
    assert got["lowbit"].lowbit == pools and got[None].lowbit == 0
    want = auto_cache_size(info, 256, available=available, lowbit=pools)
    assert got["lowbit"].n_cached == want.n_cached < got[None].n_cached
    assert f", {pools / 2**20:.0f} MiB low-bit pools, " in str(got["lowbit"]) and "low-bit" not in str(got[None])


def test_low_bit_copies_in_ram_beyond_the_free_memory_are_refused(files, monkeypatch):
    """Every expert's low-bit copy kept in memory (lowbit_in_ram) where they alone exceed what is free:
    a clear error at load, where the process would otherwise be killed for memory while decoding."""
    import pymoecache.plan
    from pymoecache import model_info
    from pymoecache.errors import ConfigError

    m, comp = files
    info = model_info(m)
    pools = int((info.n_expert + 1) * comp.expert_bytes * info.n_moe_layer)
    free = pymoecache.plan._on_host(info, 256, 0)[0] + 2 * 2 * 256 * info.n_layer * info.n_embd + pools // 2
    monkeypatch.setattr(pymoecache.plan, "_available_memory", lambda: free)
    with pytest.raises(ConfigError, match=r"low-bit pools need \d+ MiB \(lowbit_in_ram keeps every expert's low-bit "
                                          r"copy in memory\), more than the \d+ MiB free.*--lowbit-in-ram"):
        pymoecache.Llama(str(m), n_ctx=256, verbose=False,
                         cache=CacheConfig(size="auto", miss="lowbit", lowbit=str(comp.path), lowbit_in_ram=True))


# --- low-bit copies on the device (issue 54 item 4): beside GPU layers, over RPC ------------------------

def device_run(m, gpu, tokens, vram, miss=None, profile=None):
    """The tokens decoded one by one with every layer on the RPC device and the experts streamed into
    8 host slots (lowbit-cache: the copies that fit there), a VRAM tier of `vram` experts' bytes."""
    llm = pymoecache.Llama(str(m), n_ctx=128, verbose=False, n_threads=2, routing="lru", n_gpu_layers=99,
                           rpc_servers=gpu, cache=CacheConfig(size=8, residency="stream", prefetch="off", vram_size=vram,
                                                              vram_fill="copy", miss=miss))
    if profile is not None:
        llm.load_profile(profile, warm=True)
    held = {il: llm.moecache.vram_cached(il) for il in llm.model_info.moe_layers}
    held["counts"] = llm.moecache.profile_counts()  # (the profile's, after a warm start)
    got = logits_per_token(llm, tokens)
    out = (llm.cache_config.miss, got, llm.moe_stats(), llm.memory_plan(), held)
    llm.close()
    return out


def test_low_bit_copies_beside_gpu_layers_and_in_the_vram_tier_equal_llama_cpps_op_on_them(files, gpu, tmp_path):
    """The default with a companion (lowbit-cache) beside GPU layers: the host slots hold the
    companion's copies, computed on the CPU, and the VRAM tier holds them too, in the companion's
    type: as many as fit in the GPU bytes of vram_size experts. Each decoded token equals llama.cpp's
    own op on the low-bit tensors bit for bit (the RPC server computes with the CPU's kernels)."""
    m, c = files
    tokens, want = reference_logits(m, c, tmp_path)
    miss, got, st, plan, _ = device_run(m, gpu, tokens, 0)
    assert miss == "lowbit-cache" and np.array_equal(got, want)
    assert st.residency.vram_bytes == 0 and plan.n_vram == 0
    miss, got, st, plan, _ = device_run(m, gpu, tokens, 6)
    rs = st.residency
    assert miss == "lowbit-cache" and np.array_equal(got, want)  # bit for bit
    fit = int(6 * pymoecache.model_info(m).expert_bytes / c.expert_bytes)  # Q8_0 -> Q5_0: 6 experts' bytes hold 9
    assert fit == 9 and rs.vram_slots == fit and plan.n_vram == fit
    assert rs.vram_hits > 0 and rs.vram_copies > 0 and rs.vram_copy_bytes == rs.vram_copies * c.expert_bytes
    assert rs.vram_hits + rs.vram_from_ram + rs.vram_from_file == st.selections_per_layer.sum()
    assert f"VRAM tier {fit} of 60 per layer low-bit" in plan.summary()
    _, full, st_full, plan_full, _ = device_run(m, gpu, tokens, 6, miss="full")
    assert st_full.residency.vram_slots == 6 and not np.array_equal(full, want)
    assert rs.vram_bytes <= st_full.residency.vram_bytes  # more experts in the same GPU memory
    assert "VRAM tier 6 of 60 per layer in" in plan_full.summary()


def test_a_warm_start_fills_the_vram_tier_with_low_bit_copies_from_the_companion(files, gpu, tmp_path):
    """A usage profile's warm start puts each layer's hottest experts in the tier, read from the
    companion (the model's mapping holds the other type): what the device then computes from them
    still equals llama.cpp's op on the low-bit tensors, bit for bit."""
    m, c = files
    tokens, want = reference_logits(m, c, tmp_path)
    llm = pymoecache.Llama(str(m), n_ctx=128, verbose=False, n_threads=2, routing="lru",
                           cache=CacheConfig(size=8, prefetch="off"))
    logits_per_token(llm, tokens)
    profile = tmp_path / "p.moeprofile"
    llm.save_profile(profile)
    llm.close()
    miss, got, st, _, held = device_run(m, gpu, tokens, 6, profile=profile)
    assert miss == "lowbit-cache" and np.array_equal(got, want)
    counts = held.pop("counts")
    assert len(held) == 4 and counts.sum() > 0
    for il, experts in held.items():
        hottest = [e for e in sorted(range(counts.shape[1]), key=lambda e: (-counts[il, e], e)) if counts[il, e] > 0][:9]
        assert experts == hottest[::-1], f"layer {il}"  # the hottest the most recent
    assert st.residency.vram_hits > 0


def test_the_per_miss_pools_beside_gpu_layers_are_refused_with_the_way_that_runs(files, gpu):
    m, _ = files
    for miss in ("lowbit", "lowbit-all"):
        with pytest.raises(pymoecache.ConfigError, match="not supported yet .*lowbit-cache"):
            pymoecache.Llama(str(m), n_ctx=64, verbose=False, n_gpu_layers=99, rpc_servers=gpu,
                             cache=CacheConfig(size=8, miss=miss))
