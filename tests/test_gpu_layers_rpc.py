"""GPU layers beside streamed and mmapped experts, through a real second ggml backend: RPC to a
local server (`pymoecache rpc-server`, the CPU of this machine behind TCP on the loopback). With
``n_gpu_layers=99`` the dense part of every layer lives in the server's device buffers and is
computed there; the routed experts stay in this process's cache; the routing ops, the reads and
the expert matmuls run on this process's CPU. The run must be the CPU run: the same tokens, the
same logits within the backend's tolerance, the same counters and the same cache contents."""

import dataclasses
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

import pymoecache
from pymoecache import CacheConfig, rpc
from pymoecache.errors import ConfigError
from conftest import MOE_FIXTURES, ROOT, model_path
from test_rpc_as_installed import installed_env

KW = dict(n_ctx=256, n_batch=32, n_ubatch=32, logits_all=True, verbose=False, n_threads=2, seed=1)
PROMPT = list(range(300, 340))   # 40 tokens: prompt ubatches of 32 and 8
DECODES = list(range(1000, 1024))  # 24 one-token decodes
TRAINED = [ROOT / "models" / "tiny-shakespeare-qwen2moe-60x4.gguf", ROOT / "models" / "tiny-shakespeare-mixtral-8x2.gguf"]
# the RPC server computes with the same CPU kernels; the tolerance is the one a GPU backend would need
RTOL, ATOL = 1e-3, 1e-3


def paths(fixture_dir):
    out = {name: model_path(fixture_dir, name) for name in MOE_FIXTURES}
    out.update({p.stem: p for p in TRAINED if p.exists()})
    return out


def run(path, residency, routing, size, n_gpu_layers, endpoint, greedy=8, unified="auto", vram_size=0, trace=None,
        miss=None, prompt_by_token=False):
    """Logits of PROMPT then DECODES, then `greedy` tokens decoded greedily; the stats of the decodes
    and each layer's cache contents. endpoint: the RPC server of the GPU layers (None: the process's
    own GPU device, tests/vulkan_worker.py). trace: a list that gets the decodes' trace records.
    miss: CacheConfig.miss (None: the default, lowbit-cache where a companion lies beside the model).
    prompt_by_token: PROMPT's tokens decoded one at a time (lowbit-cache computes prompts at full precision)."""
    kw = dict(KW, n_gpu_layers=n_gpu_layers)
    if n_gpu_layers and endpoint:
        kw["rpc_servers"] = endpoint
    cache = CacheConfig(size=size, residency=residency, prefetch="off", vram_size=vram_size, trace=4096 if trace is not None else 0,
                        miss=miss, **({"unified": unified} if residency == "stream" else {}))
    llm = pymoecache.Llama(str(path), cache=cache, routing=routing, **kw)
    llm.reset()
    for chunk in ([[t] for t in PROMPT] if prompt_by_token else [PROMPT]):
        llm.eval(chunk)
    llm.reset_moe_stats()
    for t in DECODES:
        llm.eval([t])
    tokens = []
    for _ in range(greedy):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    logits = np.array(llm.scores[: llm.n_tokens])
    st = llm.moe_stats()
    cached = [llm.moecache.cached(il) for il in st.moe_layers]
    if trace is not None:
        trace.extend(llm.moecache.trace())
    llm.close()
    return logits, tokens, st, cached


@pytest.mark.parametrize("residency", ["stream", "mmap"])
@pytest.mark.parametrize("routing", ["lru", "prior:0.5"])
@pytest.mark.parametrize("size", [0.25, 0.5])
@pytest.mark.parametrize("name", MOE_FIXTURES + [p.stem for p in TRAINED])
def test_rpc_gpu_layers_run_as_the_cpu_does(fixture_dir, gpu, name, routing, size, residency):
    path = paths(fixture_dir).get(name)
    if path is None:
        pytest.skip(f"{name}.gguf is not in this checkout")
    ref, ref_tokens, st_ref, cached_ref = run(path, residency, routing, size, 0, gpu)
    got, tokens, st, cached = run(path, residency, routing, size, 99, gpu)
    assert np.isfinite(ref).all() and st_ref.misses > 0
    assert np.allclose(got, ref, rtol=RTOL, atol=ATOL), f"max |diff| = {np.abs(got - ref).max()}"
    assert tokens == ref_tokens
    assert (st.hits, st.misses, st.evictions) == (st_ref.hits, st_ref.misses, st_ref.evictions)
    assert cached == cached_ref
    rs, rs_ref = st.residency, st_ref.residency
    assert rs.residency == residency and rs.decode_loads == rs_ref.decode_loads
    assert rs.decode_bytes_read == rs_ref.decode_bytes_read
    # the dense part is on the device: what the CPU run locks in the mapping is not mapped here
    # (the token embeddings, which llama.cpp keeps on the CPU, may be)
    assert rs_ref.dense_locked_bytes > 0 and rs.dense_locked_bytes < rs_ref.dense_locked_bytes / 2


def test_rpc_layers_are_on_the_device_and_the_experts_stay_in_the_cache(fixture_dir, gpu, capfd):
    path = model_path(fixture_dir, "qwen2moe-60x4")
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.25, residency="stream", prefetch="off"),
                           routing="prior:0.5", **dict(KW, verbose=True, n_gpu_layers=99, rpc_servers=gpu))
    llm.eval(PROMPT[:4])
    llm.reset_moe_stats()
    for t in DECODES[:4]:
        llm.eval([t])
    st = llm.moe_stats()
    llm.close()
    log = capfd.readouterr().err
    n_layer = pymoecache.model_info(path).n_layer
    assert f"offloaded {n_layer + 1}/{n_layer + 1} layers to GPU" in log
    assert f"RPC0[{gpu}] model buffer size" in log
    assert st.misses > 0 and st.residency.decode_loads == st.misses  # every miss read from the file here


def test_auto_cache_size_leaves_out_what_is_on_the_device(fixture_dir, gpu):
    from pymoecache.plan import auto_cache_size, gpu_layers

    path = model_path(fixture_dir, "qwen2moe-60x4")
    info = pymoecache.model_info(path)
    # (the server's device is registered) -ngl N: llama.cpp's output layer, then N - 1 repeating layers
    assert gpu_layers(0, info.n_layer) == 0 and gpu_layers(2, info.n_layer) == 1
    assert gpu_layers(info.n_layer, info.n_layer) == info.n_layer - 1
    assert gpu_layers(-1, info.n_layer) == gpu_layers(99, info.n_layer) == gpu_layers(info.n_layer + 1, info.n_layer) \
        == info.n_layer
    # a machine where the dense part matters: 20 experts per layer fit beside it and the 128 MiB margin. The
    # input layer is not counted: it stays on the CPU, in the mapping, where a token reads one row of it (the
    # output has weights of its own here)
    assert info.input_bytes > 0 and info.output_tied_bytes == 0
    kv = auto_cache_size(info, 256, available=1 << 40).kv
    free = info.non_expert_bytes - info.input_bytes + kv + (128 << 20) + 20 * info.cache_bytes * info.n_moe_layer
    cpu, half = (auto_cache_size(info, 256, available=free, gpu_layers=g) for g in (0, info.n_layer // 2))
    # the output layer goes first, then half of the repeating layers' share
    layers = info.non_expert_bytes - info.input_bytes - info.output_bytes
    assert cpu.n_cached == 20 and half.dense == layers - layers // 2 and half.kv == kv // 2
    assert half.n_cached > cpu.n_cached
    assert f"the dense part of {info.n_layer // 2} layers on the GPU" in str(half)
    llm = pymoecache.Llama(str(path), **dict(KW, n_gpu_layers=99, rpc_servers=gpu))
    assert llm.cache_choice.gpu_layers == info.n_layer and llm.cache_choice.dense == 0
    llm.close()


@pytest.mark.parametrize("name", ["qwen2moe-60x4", "mixtral-8x2"])
def test_the_input_and_output_layers_are_counted_where_llama_cpp_puts_them(fixture_dir, name):
    """ModelInfo's input and output layers, from the file's tensors as gguf reads them: token_embd.*
    (on the CPU whatever -ngl says) and output.* (the first layer -ngl offloads); a model without
    output.weight (mixtral fixture: tied) gets a copy of token_embd.weight on the output's device."""
    import gguf

    path = model_path(fixture_dir, name)
    info = pymoecache.model_info(path)
    size = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    assert info.input_bytes == sum(v for k, v in size.items() if k.startswith("token_embd")) > 0
    assert info.output_bytes == sum(v for k, v in size.items() if k.startswith(("output.", "output_norm."))) > 0
    assert info.output_tied_bytes == (0 if "output.weight" in size else size["token_embd.weight"])
    assert (name == "mixtral-8x2") == (info.output_tied_bytes > 0)
    host, dev = info.dense_bytes(info.n_layer)
    assert host == info.input_bytes and dev == info.non_expert_bytes - info.input_bytes + info.output_tied_bytes
    assert info.dense_bytes(0) == (info.non_expert_bytes, 0)


def test_partial_offload_runs_as_the_cpu_does(fixture_dir, gpu):
    # -ngl 2: layers split between the CPU and the device, graph splits in between
    path = model_path(fixture_dir, "mixtral-8x2")
    ref, ref_tokens, st_ref, cached_ref = run(path, "stream", "prior:0.5", 0.5, 0, gpu)
    got, tokens, st, cached = run(path, "stream", "prior:0.5", 0.5, 2, gpu)
    assert np.allclose(got, ref, rtol=RTOL, atol=ATOL) and tokens == ref_tokens
    assert (st.hits, st.misses) == (st_ref.hits, st_ref.misses) and cached == cached_ref


def test_rpc_endpoints_are_checked(fixture_dir):
    path = model_path(fixture_dir, "qwen2moe-60x4")
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        pymoecache.Llama(str(path), n_gpu_layers=99, rpc_servers="no-port", **KW)
    port = rpc._free_port("127.0.0.1")  # nothing listens there
    with pytest.raises(ConfigError, match="not reachable"):
        pymoecache.Llama(str(path), n_gpu_layers=99, rpc_servers=f"127.0.0.1:{port}", **KW)
    assert f"127.0.0.1:{port}" not in rpc.servers()


GONE_SCRIPT = r"""
import sys, warnings
import pymoecache
from pymoecache import rpc
from pymoecache.errors import ConfigError
path = sys.argv[1]
with rpc.LocalServer() as server:
    pymoecache.Llama(path, n_gpu_layers=99, n_ctx=64, verbose=False).close()
for ngl in (99, 0):  # the server is gone, its device cannot be unregistered: loads leave it out instead of aborting
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        llm = pymoecache.Llama(path, n_gpu_layers=ngl, n_ctx=64, verbose=False)
        print("loaded", llm("ROMEO:", max_tokens=2)["usage"]["completion_tokens"], [str(x.message)[:40] for x in w])
        llm.close()
try:
    pymoecache.Llama(path, n_gpu_layers=99, rpc_servers=server.endpoint, n_ctx=64, verbose=False)
except ConfigError as e:
    print("refused:", e)
with rpc.LocalServer(port=int(server.endpoint.rpartition(":")[2])):  # back at the same address: loads again
    pymoecache.Llama(path, n_gpu_layers=99, n_ctx=64, verbose=False).close()
print("ok again")
"""


def test_a_server_that_is_gone_is_left_out_not_an_abort(fixture_dir):
    import subprocess
    import sys

    # in a process of its own: the dead server's device stays registered there
    r = subprocess.run([sys.executable, "-c", GONE_SCRIPT, str(model_path(fixture_dir, "mixtral-8x2"))], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 4, r.stdout
    assert lines[0].startswith("loaded 2 ['rpc server 127.0.0.1:") and "is gone" in lines[0], r.stdout
    assert lines[1] == "loaded 2 []", r.stdout  # (no GPU layers asked: nothing to say)
    assert lines[2].startswith("refused: rpc server 127.0.0.1:") and "is gone" in lines[2], r.stdout
    assert lines[3] == "ok again"


# --- the VRAM tier (CacheConfig.vram_size): device slots over the host cache ---------------------

def run_vram(path, endpoint, fill, n_vram, routing="prior:0.5", size=0.25, n_gpu_layers=99, prefetch="off", **more):
    kw = dict(KW, n_gpu_layers=n_gpu_layers)
    if n_gpu_layers:
        kw["rpc_servers"] = endpoint
    cache = CacheConfig(size=size, residency="stream", prefetch=prefetch, vram_size=n_vram, vram_fill=fill, trace=4096,
                        **more)
    llm = pymoecache.Llama(str(path), cache=cache, routing=routing, **kw)
    llm.eval(PROMPT)
    llm.reset_moe_stats()
    for t in DECODES:
        llm.eval([t])
    logits = np.array(llm.scores[: llm.n_tokens])
    st = llm.moe_stats()
    trace = llm.moecache.trace()
    st.held = {il: (llm.moecache.cached(il), llm.moecache.vram_cached(il)) for il in st.moe_layers}
    llm.close()
    return logits, st, trace


def replay_vram(trace, n_vram, fill, n_tokens):
    """The tier's counters as moecache.h defines them, from the decoded tokens' selections, under
    LRU: free device slots first, then the least recently used expert the token did not select;
    "cpu" only fills free slots."""
    hits = copies = cpu = 0
    for layer in np.unique(trace["layer"]):
        rows = trace[trace["layer"] == layer]
        rows = rows[np.argsort(rows["token"], kind="stable")][-n_tokens:]  # the decodes (the prompt came first)
        held, used, clock = [-1] * n_vram, [0] * n_vram, 0
        for r in rows:
            token = set(int(x) for x in r["experts"][: r["n_selected"]])
            for e in r["experts"][: r["n_selected"]]:
                if e in held:
                    s = held.index(e)
                    hits += 1
                else:
                    free = [s for s in range(n_vram) if held[s] < 0]
                    old = [s for s in range(n_vram) if held[s] >= 0 and held[s] not in token]
                    if free:
                        s = free[0]
                    elif fill == "copy" and old:
                        s = min(old, key=lambda s: (used[s], s))
                    else:
                        cpu += 1
                        continue
                    held[s] = int(e)
                    copies += 1
                clock += 1
                used[s] = clock
    return hits, copies, cpu


@pytest.mark.parametrize("fill", ["copy", "cpu", "auto"])
@pytest.mark.parametrize("name", ["qwen2moe-60x4", "mixtral-8x2", "deepseek2-sigmoid-64x6"])
def test_vram_tier_runs_as_the_cpu_does(fixture_dir, gpu, name, fill):
    path = model_path(fixture_dir, name)
    K = pymoecache.model_info(path).n_expert_used
    ref, st_ref, _ = run_vram(path, gpu, fill, 0, n_gpu_layers=0)
    got, st, _ = run_vram(path, gpu, fill, K + 1)
    assert np.allclose(got, ref, rtol=RTOL, atol=ATOL), f"max |diff| = {np.abs(got - ref).max()}"
    # the host tier is the same: routing, hits, misses, reads from the file
    assert (st.hits, st.misses, st.evictions) == (st_ref.hits, st_ref.misses, st_ref.evictions)
    rs = st.residency
    assert rs.decode_loads == st_ref.residency.decode_loads
    # every selection of a decoded token came from exactly one tier and was computed on one side
    assert rs.vram_hits + rs.vram_from_ram + rs.vram_from_file == st.selections_per_layer.sum()
    assert rs.vram_copies + rs.vram_cpu == rs.vram_from_ram + rs.vram_from_file
    assert 0 < rs.vram_from_file <= rs.decode_loads and 0 < rs.vram_from_ram <= st.hits
    assert rs.vram_copy_bytes == rs.vram_copies * rs.expert_bytes
    assert rs.vram_bytes > 0 and st_ref.residency.vram_bytes == 0
    # K + 1 slots of each layer hold experts, and nothing else is on the device (no zero slot: the rows the device
    # computes for the CPU's selections are dropped, not added)
    assert rs.vram_slots == K + 1 and rs.vram_bytes == len(st.moe_layers) * (K + 1) * rs.expert_bytes
    assert rs.vram_hits > 0 and rs.vram_copies >= len(st.moe_layers)  # (each layer filled a slot at least)


@pytest.mark.parametrize("fill", ["copy", "cpu"])
@pytest.mark.parametrize("n_vram", [2, 6])
def test_vram_tier_decisions_follow_the_policy(fixture_dir, gpu, fill, n_vram):
    path = model_path(fixture_dir, "qwen2moe-60x4")  # K = 4: 2 device slots hold less than a token
    _, st, trace = run_vram(path, gpu, fill, n_vram, routing="lru")
    rs = st.residency
    want = replay_vram(trace, n_vram, fill, len(DECODES))
    assert (rs.vram_hits, rs.vram_copies, rs.vram_cpu) == want
    if fill == "cpu":  # the first experts used stay: one copy per device slot, no more
        assert rs.vram_copies == n_vram * len(st.moe_layers)


@pytest.mark.parametrize("eviction", ["lru", "lfu", "router-mass"])
def test_a_vram_tier_as_large_as_the_cache_holds_what_it_holds(fixture_dir, gpu, eviction):
    # the same eviction policy over the same usage, the same size, both empty at the first decode
    # (prompts leave the cache alone here): every selection the cache inserts, the tier copies up,
    # and each evicts the same expert
    path = model_path(fixture_dir, "qwen2moe-60x4")
    _, st, _ = run_vram(path, gpu, "copy", 15, routing="lru", size=15, eviction=eviction, update_on_prompt=False)
    for il, (cached, vram) in st.held.items():
        assert sorted(vram) == sorted(cached), f"layer {il}"
    assert st.evictions > 0 and st.residency.vram_copies == st.misses


def test_a_warm_start_fills_the_vram_tier_with_the_hottest_experts(fixture_dir, gpu, tmp_path):
    path, profile = model_path(fixture_dir, "qwen2moe-60x4"), tmp_path / "p.moeprofile"
    kw = dict(KW, n_gpu_layers=99, rpc_servers=gpu)
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.25, residency="stream", prefetch="off"), routing="lru", **kw)
    llm.eval(PROMPT)
    for t in DECODES:
        llm.eval([t])
    llm.save_profile(profile)
    llm.close()
    logits = {}
    for ngl in (99, 0):  # the same warm start on the CPU: the same logits
        llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.25, residency="stream", prefetch="off", vram_size=6,
                                                            vram_fill="cpu"), routing="lru", **dict(kw, n_gpu_layers=ngl))
        llm.load_profile(profile, warm=True)
        if ngl:
            counts = llm.moecache.profile_counts()
            for il in pymoecache.model_info(path).moe_layers:  # the six most selected, ties by the lower id,
                hottest = sorted(range(counts.shape[1]), key=lambda e: (-counts[il, e], e))[:6]  # the hottest the
                assert llm.moecache.vram_cached(il) == hottest[::-1]                            # most recent
        llm.reset_moe_stats()
        for t in DECODES[:8]:
            llm.eval([t])
        logits[ngl] = np.array(llm.scores[: llm.n_tokens])
        rs = llm.moe_stats().residency
        llm.close()
        if ngl:
            assert rs.vram_copies == 0 and rs.vram_hits > 0  # (cpu: a full tier keeps what the warm start put there)
    assert np.allclose(logits[99], logits[0], rtol=RTOL, atol=ATOL)


def test_copies_up_are_on_the_timeline(fixture_dir, gpu, tmp_path):
    import json

    path = model_path(fixture_dir, "mixtral-8x2")
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.5, residency="stream", prefetch="off", vram_size=2,
                                                        vram_fill="copy"),
                           routing="lru", **dict(KW, n_gpu_layers=99, rpc_servers=gpu))
    llm.eval(PROMPT[:8])
    llm.reset_moe_stats()
    llm.start_timeline()
    for t in DECODES[:12]:
        llm.eval([t])
    rs = llm.moe_stats().residency
    tl = llm.timeline()
    llm.close()
    ups = tl.events[tl.events["kind"] == 7]
    assert rs.vram_copies > 0 and len(ups) == rs.vram_copies
    assert (ups["bytes"] == rs.expert_bytes).all() and (ups["t_end_us"] >= ups["t_start_us"]).all()
    tl.save_chrome(tmp_path / "t.json")
    names = [e["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]]
    assert sum(n.startswith("copy_up L") for n in names) == rs.vram_copies


def run_vram_timeline(path, endpoint, cache, routing):
    """PROMPT, then DECODES on the timeline: logits, stats, each MoE layer's device slots, events."""
    llm = pymoecache.Llama(str(path), cache=cache, routing=routing, **dict(KW, n_gpu_layers=99, rpc_servers=endpoint))
    llm.eval(PROMPT)
    llm.reset_moe_stats()
    llm.start_timeline()
    for t in DECODES:
        llm.eval([t])
    st, ev = llm.moe_stats(), llm.timeline().events
    held = [llm.moecache.vram_cached(il) for il in st.moe_layers]
    logits = np.array(llm.scores[: llm.n_tokens])
    llm.close()
    return logits, st, held, ev


def test_copies_up_overlap_the_cpu_matmuls_and_change_nothing(fixture_dir, gpu):
    # vram_copy="async": each copy up goes to a second backend of the device and is waited for after
    # the CPU computed its own selections; "sync": the routing op makes it. The same results.
    path = model_path(fixture_dir, "qwen2moe-60x4")  # K = 4 over 2 device slots: both sides compute
    got = {}
    for mode in ("async", "sync"):
        cache = CacheConfig(size=0.5, residency="stream", prefetch="off", vram_size=2, vram_fill="copy", vram_copy=mode)
        logits, st, held, ev = run_vram_timeline(path, gpu, cache, "lru")
        got[mode] = (logits, st.residency, held, ev)
    logits, rs, held, _ = got["async"]
    assert rs.vram_copies > 0 and rs.vram_cpu > 0
    assert np.array_equal(got["sync"][0], logits) and got["sync"][2] == held
    for k in ("vram_hits", "vram_from_ram", "vram_from_file", "vram_copies", "vram_cpu", "vram_copy_bytes"):
        assert getattr(got["sync"][1], k) == getattr(rs, k), k
    for mode, (_, _, _, events) in got.items():
        ups = events[events["kind"] == 7]
        assert len(ups) == rs.vram_copies
        assert (ups["t_queued_us"] <= ups["t_start_us"]).all() and (ups["t_start_us"] <= ups["t_end_us"]).all()
        ops = events[(events["kind"] == 1) & (events["expert"] == -1)]  # each layer's routing op
        for u in ups:
            op_end = ops[(ops["layer"] == u["layer"]) & (ops["t_start_us"] <= u["t_start_us"])]["t_end_us"].max()
            if mode == "async":  # waited for after the op, once the CPU's matmuls of the layer ran
                inside = events[(events["kind"] == 6) & (events["layer"] == u["layer"]) &
                                (events["t_start_us"] >= op_end) & (events["t_end_us"] <= u["t_end_us"])]
                assert u["t_end_us"] > op_end and len(inside) > 0, mode
            else:  # made by the op
                assert u["t_end_us"] <= op_end, mode


def test_vram_tier_needs_a_device_and_stream(fixture_dir, gpu):
    path = model_path(fixture_dir, "mixtral-8x2")
    # no GPU layers: no layer has device memory, nothing changes
    _, st, _ = run_vram(path, gpu, "copy", 4, n_gpu_layers=0)
    assert st.residency.vram_bytes == 0 and st.residency.vram_hits + st.residency.vram_copies == 0
    with pytest.raises(ConfigError, match="needs residency .stream."):
        pymoecache.Llama(str(path), cache=CacheConfig(size=0.5, residency="mmap", vram_size=2), **KW)
    with pytest.raises(ConfigError, match="vram_fill"):
        CacheConfig(vram_size=2, vram_fill="gpu")
    with pytest.raises(ConfigError, match="vram_copy must be one of async, sync"):
        CacheConfig(vram_size=2, vram_copy="dma")
    with pytest.raises(ConfigError, match="vram_size .* or 'auto'"):
        CacheConfig(vram_size="all")
    with pytest.raises(ConfigError, match='vram_size "auto" is resolved by pymoecache.Llama'):
        pymoecache.MoECache.synthetic(n_layer=1, n_expert=8, n_expert_used=2,
                                      cache=CacheConfig(size=4, residency="stream", vram_size="auto"))
    # no GPU layers: said, and dropped
    with pytest.warns(UserWarning, match="vram_size=2 ignored: no layer is on a GPU"):
        llm = pymoecache.Llama(str(path), cache=CacheConfig(size=1.0, vram_size=2), **KW)
    assert llm.moe_stats().residency.vram_bytes == 0 and llm.cache_config.vram_size == 0
    llm.close()
    with pytest.warns(UserWarning, match="vram_size=2 ignored: no layer is on a GPU"):  # (exclusive with it: it was
        llm = pymoecache.Llama(str(path), cache=CacheConfig(size=4, vram_size=2, vram_exclusive=True), **KW)  # a crash)
    assert llm.moe_stats().residency.vram_exclusive_layers == 0 and not llm.cache_config.vram_exclusive
    llm.close()
    # every expert fits in RAM, GPU layers: residency auto is stream (every expert in the host slots), not
    # none (llama.cpp would put every expert on the device the tier was asked for because they do not fit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm = pymoecache.Llama(str(path), cache=CacheConfig(size=1.0, vram_size=2), n_gpu_layers=99, rpc_servers=gpu,
                               **KW)
    assert llm.cache_config.residency == "stream"
    llm.eval(PROMPT[:8])
    for t in DECODES:
        llm.eval([t])
    rs = llm.moe_stats().residency
    assert rs.vram_slots == 2 and rs.vram_bytes > 0 and rs.vram_hits > 0, rs
    llm.close()
    with pytest.raises(ConfigError, match="rpc_servers must be"):
        pymoecache.Llama(str(path), n_gpu_layers=99, rpc_servers=50052, **KW)


def test_unified_memory_needs_a_device_that_wraps_host_memory(fixture_dir, gpu):
    """unified="on" puts the experts of GPU layers on their device, in place on the host slots; an
    RPC server cannot wrap this process's memory, so "on" is refused with the reason, and "auto"
    leaves the experts to the CPU (the run of the tests above). Without GPU layers nothing changes."""
    path = model_path(fixture_dir, "mixtral-8x2")
    with pytest.raises(ConfigError, match="cannot wrap host memory"):
        pymoecache.Llama(str(path), cache=CacheConfig(size=0.5, residency="stream", unified="on"), n_gpu_layers=99,
                         rpc_servers=gpu, **KW)
    for unified, ngl in [("auto", 99), ("off", 99), ("on", 0)]:
        llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.5, residency="stream", unified=unified),
                               n_gpu_layers=ngl, **(dict(rpc_servers=gpu) if ngl else {}), **KW)
        llm.eval(PROMPT[:4])
        rs = llm.moe_stats().residency
        assert (rs.unified_layers, rs.unified_bytes) == (0, 0) and "unified" not in rs.summary()
        llm.close()
    with pytest.raises(ConfigError, match="unified must be one of"):
        CacheConfig(unified="yes")
    with pytest.raises(ConfigError, match="unified='on' needs residency 'stream'"):
        pymoecache.Llama(str(path), cache=CacheConfig(size=0.5, residency="mmap", unified="on"), **KW)
    with pytest.warns(UserWarning, match="unified='on' ignored"):
        pymoecache.Llama(str(path), cache=CacheConfig(size=1.0, unified="on"), **KW).close()


@pytest.mark.parametrize("name", ["qwen2moe-60x4", "deepseek2-sigmoid-64x6"])
def test_rpc_prior_routing_decides_as_the_reference_on_the_devices_router_outputs(fixture_dir, gpu, name):
    """With the routers on the device, the prior routing (on the CPU) decides from the router
    outputs the device computed exactly as the numpy reference does on those outputs: the same
    experts for every token and layer, the same misses."""
    from pymoecache.simulate import RouterTrace, replay

    path = model_path(fixture_dir, name)
    size = pymoecache.model_info(path).n_expert // 4
    cache = CacheConfig(size=size, residency="stream", prefetch="off", router_record=len(DECODES), trace=4096)
    llm = pymoecache.Llama(str(path), cache=cache, routing="prior:0.5", **dict(KW, n_gpu_layers=99, rpc_servers=gpu))
    for t in DECODES:  # token by token from an empty cache, as the replay runs
        llm.eval([t])
    z, p, s, rank_on_logits = llm.moecache.router_record()
    trace, st, K = llm.moecache.trace(), llm.moe_stats(), llm.moecache.n_expert_used
    llm.close()
    res = replay(RouterTrace(z, n_expert_used=K, probs=p, scores=s, rank_on_logits=rank_on_logits), "prior:0.5",
                 cache_size=size, engine="reference")
    assert len(trace) == len(DECODES) * len(st.moe_layers)
    for j, il in enumerate(st.moe_layers):
        rows = trace[trace["layer"] == il]
        rows = rows[np.argsort(rows["token"], kind="stable")]
        live = np.array([r["experts"][: r["n_selected"]] for r in rows])
        np.testing.assert_array_equal(live, res.selected[j], err_msg=f"layer {il}")
    np.testing.assert_array_equal(res.misses_per_layer, st.misses_per_layer)  # (per MoE layer)
    assert st.misses > 0 and st.hits > 0


@pytest.mark.parametrize("name", ["qwen2moe-60x4", "mixtral-8x2"])
def test_copies_up_ahead_of_the_routing_change_nothing_but_the_tier(fixture_dir, gpu, name):
    # with prefetch, the predicted experts of the next layer that its host cache holds are copied up
    # ahead of its routing (vram_copy="async"): the run is still the CPU run, the host tier's
    # counters are its counters, and the copies ahead are sent before their layer's routing op
    path = model_path(fixture_dir, name)
    ref, st_ref, _ = run_vram(path, gpu, "copy", 0, n_gpu_layers=0, prefetch="gate")
    got, tl = {}, {}
    for mode in ("async", "sync"):
        cache = CacheConfig(size=0.25, residency="stream", prefetch="gate", vram_size=6, vram_fill="copy",
                            vram_copy=mode)
        logits, st, _, tl[mode] = run_vram_timeline(path, gpu, cache, "prior:0.5")
        got[mode] = (logits, st)
    for mode, (logits, st) in got.items():
        assert np.allclose(logits, ref, rtol=RTOL, atol=ATOL), f"{mode}: max |diff| = {np.abs(logits - ref).max()}"
        assert (st.hits, st.misses, st.evictions) == (st_ref.hits, st_ref.misses, st_ref.evictions), mode
        rs = st.residency
        assert rs.vram_hits + rs.vram_from_ram + rs.vram_from_file == st.selections_per_layer.sum()
        assert rs.vram_copies + rs.vram_cpu == rs.vram_from_ram + rs.vram_from_file
        assert rs.vram_copy_bytes == (rs.vram_copies + rs.vram_ahead) * rs.expert_bytes
        ev = tl[mode]
        ups, ops = ev[ev["kind"] == 7], ev[(ev["kind"] == 1) & (ev["expert"] == -1)]
        assert len(ups) == rs.vram_copies + rs.vram_ahead
        early = 0  # sent before the routing op of their layer in which they ended began
        for u in ups:
            op_start = ops[(ops["layer"] == u["layer"]) & (ops["t_start_us"] <= u["t_end_us"])]["t_start_us"].max()
            early += int(u["t_start_us"] < op_start)
        if mode == "async":
            assert 0 < rs.vram_ahead_used <= rs.vram_ahead and rs.vram_ahead_used <= rs.vram_hits
            assert 0 < early <= rs.vram_ahead
        else:
            assert rs.vram_ahead == rs.vram_ahead_used == early == 0


def test_every_expert_in_ram_the_routing_prefers_the_experts_in_vram(fixture_dir, gpu):
    """Issue 54 item 3, the seeds' scenario: the cache holds every expert (streamed into host slots), a VRAM
    tier a quarter of them. The default routing is then the preset resolved for the tier's share (not top-k,
    as for a cache of every expert alone), and it prefers the experts in device memory: more selections are
    computed on the device than under top-k, and than llama.cpp's --n-cpu-moe gives with the same device
    bytes (a quarter of the MoE layers: 25% of the selections)."""
    path = model_path(fixture_dir, "qwen2moe-60x4")
    share = {}
    for routing in (None, "lru"):
        _, st, _ = run_vram(path, gpu, "auto", 15, routing=routing, size=1.0)
        rs = st.residency
        share[routing] = rs.vram_hits / (rs.vram_hits + rs.vram_from_ram + rs.vram_from_file)
        assert rs.decode_bytes_read == 0  # (every expert in host memory: nothing read while decoding)
    assert share[None] > share["lru"] > 0.25, share
    assert share[None] >= 2 * 0.25, share
    # the quality preset for a tier over every expert in RAM: half the prior of a cache that reads (0.05, not 0.1);
    # no tier: every expert cached, top-k has nothing to prefer
    for vram, resolved in ((15, "prior:0.05:j=1"), (0, "lru")):
        llm = pymoecache.Llama(str(path), cache=CacheConfig(size=1.0, residency="stream", vram_size=vram),
                               **dict(KW, n_gpu_layers=99, rpc_servers=gpu))
        spec = llm.moecache.routing.spec()
        llm.close()  # (before asserting: a Llama left open past the session's RPC server cannot be freed)
        assert spec == resolved, (vram, spec)


# --- exclusive tiers (CacheConfig.vram_exclusive, issue 54 item 3) ------------------------------------

def two_passes(path, endpoint, cache, routing="lru", n_gpu_layers=99):
    """PROMPT, DECODES and 40 more tokens decoded; then, after a reset, the same again: the second
    pass's stats (the cache and the tiers are warm), the logits of both and each layer's contents."""
    kw = dict(KW, n_gpu_layers=n_gpu_layers, **({"rpc_servers": endpoint} if n_gpu_layers else {}))
    llm = pymoecache.Llama(str(path), cache=cache, routing=routing, **kw)
    tokens = DECODES + list(range(2000, 2040))
    out = []
    for _ in range(2):
        llm.reset()
        llm.reset_moe_stats()
        llm.eval(PROMPT)
        for t in tokens:
            llm.eval([t])
        out.append(np.array(llm.scores[: llm.n_tokens]))
    st = llm.moe_stats()
    held = {il: (llm.moecache.cached(il), llm.moecache.vram_cached(il)) for il in st.moe_layers}
    plan = llm.memory_plan()
    llm.close()
    return out, st, held, plan


@pytest.mark.parametrize("fill", ["cpu", "copy"])
@pytest.mark.parametrize("name, host, vram", [("qwen2moe-60x4", 45, 15), ("mixtral-8x2", 6, 2)])
def test_exclusive_tiers_hold_a_model_larger_than_the_host_cache(fixture_dir, gpu, name, host, vram, fill):
    """A host cache of 3/4 of the experts and a VRAM tier of the rest, exclusive: together they hold
    every expert, so once warm no decoded token reads an expert from the file and none is evicted; the logits are
    those of the CPU run with every expert resident. The same tiers inclusive (the tier copies part
    of the host cache) keep reading. With vram_fill copy the tier's evictions move down into RAM."""
    path = model_path(fixture_dir, name)
    ref, _, _, _ = two_passes(path, gpu, CacheConfig(size=1.0, residency="none"), n_gpu_layers=0)
    cache = CacheConfig(size=host, residency="stream", prefetch="off", vram_size=vram, vram_fill=fill, vram_exclusive=True)
    got, st, held, plan = two_passes(path, gpu, cache)
    for g, r in zip(got, ref):
        assert np.allclose(g, r, rtol=RTOL, atol=ATOL), f"max |diff| = {np.abs(g - r).max()}"
    rs = st.residency
    assert rs.vram_exclusive_layers == len(st.moe_layers) and rs.vram_slots == vram
    assert rs.vram_pinned_bytes == 0  # (RPC registers no host memory: its copies are sent over the socket)
    assert rs.decode_loads == 0 and st.evictions == 0  # (the second pass; its prompt reads the mapping, as
    assert rs.decode_tokens > 0                        # every prompt does where the host cache lacks an expert)
    assert rs.vram_hits > 0 and rs.vram_from_file == 0
    n_expert = st.n_expert
    for il, (cached, in_vram) in held.items():
        assert len(in_vram) == vram and set(in_vram) <= set(cached), f"layer {il}"
        assert len(cached) <= host + vram
    if fill == "copy":
        assert rs.vram_copies > 0 and rs.vram_copies_down == rs.vram_copies  # a full tier: each copy up is a swap
    else:
        assert rs.vram_copies == 0 and rs.vram_copies_down == 0  # (filled in the first pass, kept)
    assert f"exclusive: RAM and VRAM hold {n_expert} of {n_expert} (all" in plan.summary()
    inclusive = dataclasses.replace(cache, vram_exclusive=False)
    _, st_inc, _, _ = two_passes(path, gpu, inclusive)
    assert st_inc.residency.decode_loads > 0 and st_inc.evictions > 0
    assert st_inc.residency.vram_exclusive_layers == 0


def test_exclusive_tiers_after_a_clear_a_state_load_and_a_warm_start(fixture_dir, gpu, tmp_path):
    """The tiers stay disjoint and complete through what empties or refills the cache: a clear empties
    both, a state load refills the host cache only, a warm start puts the hottest in the tier (and
    only there); each then decodes as the CPU does."""
    path = model_path(fixture_dir, "qwen2moe-60x4")
    kw = dict(KW, n_gpu_layers=99, rpc_servers=gpu)
    cache = CacheConfig(size=45, residency="stream", prefetch="off", vram_size=15, vram_fill="copy", vram_exclusive=True)
    ref = pymoecache.Llama(str(path), cache=CacheConfig(size=1.0, residency="none"), routing="lru", **dict(KW))
    llm = pymoecache.Llama(str(path), cache=cache, routing="lru", **kw)

    def decode_both():
        for m in (ref, llm):
            m.reset()
            m.eval(PROMPT)
            for t in DECODES:
                m.eval([t])
        a, b = np.array(llm.scores[: llm.n_tokens]), np.array(ref.scores[: ref.n_tokens])
        assert np.allclose(a, b, rtol=RTOL, atol=ATOL), f"max |diff| = {np.abs(a - b).max()}"

    decode_both()
    layers = llm.model_info.moe_layers
    llm.save_cache_state(tmp_path / "state.bin")
    llm.save_profile(tmp_path / "p.moeprofile")
    llm.moecache.clear()
    assert all(llm.moecache.cached(il) == [] and llm.moecache.vram_cached(il) == [] for il in layers)
    decode_both()
    llm.load_cache_state(tmp_path / "state.bin")
    assert all(llm.moecache.vram_cached(il) == [] and len(llm.moecache.cached(il)) <= 45 for il in layers)
    decode_both()
    llm.load_profile(tmp_path / "p.moeprofile", warm=True)
    counts = llm.moecache.profile_counts()
    for il in layers:  # the 15 most selected (equal counts by the profile's own order), cached, in the tier
        tier = llm.moecache.vram_cached(il)
        rest = [counts[il, e] for e in range(60) if e not in tier]
        assert len(tier) == 15 and min(counts[il, e] for e in tier) >= max(rest) and min(counts[il, tier]) > 0
        assert set(tier) <= set(llm.moecache.cached(il))
    llm.reset_moe_stats()
    decode_both()
    assert llm.moe_stats().residency.vram_hits > 0
    llm.close()
    ref.close()


def test_exclusive_tiers_are_refused_without_a_tier_and_said_when_the_cache_holds_everything(fixture_dir, gpu):
    path = model_path(fixture_dir, "mixtral-8x2")
    with pytest.raises(ConfigError, match="vram_exclusive needs a VRAM tier"):
        CacheConfig(size=4, vram_exclusive=True)
    with pytest.warns(UserWarning, match="vram_exclusive ignored: the cache holds every expert"):
        llm = pymoecache.Llama(str(path), cache=CacheConfig(size=1.0, residency="stream", vram_size=2, vram_exclusive=True),
                               **dict(KW, n_gpu_layers=99, rpc_servers=gpu))
    assert llm.moe_stats().residency.vram_exclusive_layers == 0
    llm.close()


def test_buffer_override_keywords_are_checked(fixture_dir):
    path = model_path(fixture_dir, "mixtral-8x2")
    for kw, says in [(dict(override_tensor="exps=CUDA0"), "only =CPU is"), (dict(override_tensor="exps"), "PATTERN="),
                     (dict(override_tensor="([=CPU"), "not a regular expression"), (dict(n_cpu_moe=-1), "n_cpu_moe")]:
        with pytest.raises(ConfigError, match=says):
            pymoecache.Llama(str(path), n_ctx=64, verbose=False, **kw)


@pytest.mark.parametrize("name", ["qwen2moe-60x4", "mixtral-8x2", "deepseek2-sigmoid-64x6"])
def test_a_vram_tier_costs_two_graph_splits_per_moe_layer(fixture_dir, gpu, name):
    """Each side computes its own activations between the up/gate and down matmuls (rebuilt from its own
    part of the sums), so the CPU's work of a layer and the device's run as one split each: what
    llama.cpp's --n-cpu-moe costs per layer whose experts the CPU computes (the first version crossed
    over twice more per layer: 18 splits a token on a 4-layer model instead of 10). The router's
    probabilities and top-k are computed on the CPU beside the routing op, so only the logits cross (with
    the FFN's input, and a router's selection bias, deepseek2's exp_probs_b, a device weight: one read)."""
    path = model_path(fixture_dir, name)
    info = pymoecache.model_info(path)
    _, st, _ = run_vram(path, gpu, "cpu", info.n_expert_used + 1)
    rs = st.residency
    assert rs.decode_graphs > 0  # (a dense layer adds nothing: it stays on the device)
    assert rs.decode_graph_splits == rs.decode_graphs * (2 + 2 * info.n_moe_layer), (
        rs.decode_graph_splits / rs.decode_graphs)


def test_bench_vram_share_splits_a_decoded_token_into_its_layers_on_the_timeline(fixture_dir, tmp_path):
    """`bench_vram_share.py --timeline`, as a user runs it (over a local RPC server): for each of our rows,
    each decoded token's routing and residency ops found per MoE layer on the library's timeline (one of
    each per layer and token, in order), the time between them positive, the parts within the token's
    period; with vram_fill copy and a tier of 4 of 60, copies up in flight."""
    path = model_path(fixture_dir, "qwen2moe-60x4")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_vram_share.py"), "--model", str(path),
                        "--tokens", "24", "--vram-fill", "copy", "--share", str(4 / 60), "--timeline",
                        "--json", str(tmp_path / "rows.json")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "where a decoded token's time goes" in r.stdout
    ours = [row for row in json.loads((tmp_path / "rows.json").read_text()) if "times" in row]
    assert len(ours) == 2  # (default and lru)
    for row in ours:
        t = row["times"]
        assert t["n_moe"] == pymoecache.model_info(path).n_moe_layer
        assert t["routing_us"] > 0 and t["waits_us"] > 0 and t["between_us"] > 0 and t["copy_up_us"] > 0, t
        assert 0 < t["rest_us"] < t["period_us"], t
        assert row["copies_up_per_token"] > 0 and row["pinned_bytes"] == 0  # (RPC: nothing registered)


TIER_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
import pymoecache
from pymoecache import CacheConfig, rpc
from bench_device import CommandCounter  # (a proxy in front of the server: counts ggml's RPC commands; mbps: a link)
path, n_vram, prefetch, fill, mbps = sys.argv[1], int(sys.argv[2]), sys.argv[4], sys.argv[5], float(sys.argv[6])
with rpc.LocalServer(threads=1, register=False) as server:
    counter = CommandCounter(server.endpoint, mbps=mbps)
    llm = pymoecache.Llama(path, n_gpu_layers=99, rpc_servers=counter.endpoint, n_ctx=128, verbose=False, n_threads=1,
                           cache=CacheConfig(size=1.0, residency="stream", prefetch=prefetch, vram_size=n_vram,
                                             vram_fill=fill), routing="lru")
    llm.eval(list(range(300, 316)))
    for t in range(316, 380):  # (decoded: the tier's free slots filled; fill "cpu" copies up nothing more)
        llm.eval([t])
    rs = llm.moe_stats().residency
    out = dict(copies=rs.vram_copies, cpu=rs.vram_cpu, layers=len(llm.moe_stats().moe_layers))

    def decode():
        for t in range(1000, 1016):
            llm.eval([t])

    got = counter.during(llm._ctx.ctx, decode)
    assert fill != "cpu" or llm.moe_stats().residency.vram_copies == out["copies"]
    out.update({k: v / 16 for k, v in got.items()})  # (per token of the 16 counted)
    print(json.dumps(out))
    llm.close()
"""


def run_tier(tmp_path, path, n_vram: int, prefetch: str = "off", fill: str = "auto", mbps: float = 0.0) -> dict:
    """TIER_SCRIPT in a process of its own, from a temp dir on the installed package: its counters and its
    RPC commands per decoded token."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", TIER_SCRIPT, str(path), str(n_vram), str(ROOT / "scripts"), prefetch,
                        fill, str(mbps)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=installed_env())
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["qwen2moe-60x4", "mixtral-8x2", "deepseek2-sigmoid-64x6"])
@pytest.mark.parametrize("prefetch", ["off", "gate"])
def test_a_decoded_token_reads_the_device_once_per_moe_layer(fixture_dir, name, prefetch, tmp_path):
    """Where the CPU computes experts beside a device layer, each read of a device tensor is a wait (over
    RPC a round trip): the router's logits, the FFN's input (with prefetch gate, the predictor's logits;
    deepseek2's selection bias, a device weight the CPU's top-k reads) cross in one read, and what the
    device's side reads from the CPU (the tier's slots and rows, the CPU's experts' output, the weights) in
    one write. Counted in a process of its own, through a proxy in front of the server: per decoded token,
    one read per MoE layer and one of the logits."""
    path = model_path(fixture_dir, name)
    info = pymoecache.model_info(path)
    per_token = run_tier(tmp_path, path, info.n_expert_used + 1, prefetch=prefetch, fill="cpu")
    assert per_token["GET_TENSOR"] == info.n_moe_layer + 1, per_token
    # writes: the graph's inputs, and per MoE layer one (the tier's ids, the CPU's experts' output and the
    # weights, joined)
    assert per_token["SET_TENSOR"] <= 6 + info.n_moe_layer, per_token


def test_the_default_fill_copies_nothing_up_a_slow_link(fixture_dir, tmp_path):
    """vram_fill auto copies an expert up where that costs less than computing it on the CPU. ggml's RPC
    client returns from a copy once it is queued on the socket, whatever the link: there the cost is
    measured with a read back (a round trip). Over a 10 MB/s link (a GPU machine across a slow network),
    once the tier's free slots are filled nothing more is copied up: the misses are computed on the CPU."""
    n_vram = 5
    got = run_tier(tmp_path, model_path(fixture_dir, "qwen2moe-60x4"), n_vram, mbps=10)
    assert got["cpu"] > 0 and got["copies"] <= got["layers"] * n_vram, got  # (the free slots' fills only)


BATCH_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import numpy as np
import pymoecache
from pymoecache import BatchDecoder, CacheConfig, rpc
from bench_device import CommandCounter
path = sys.argv[1]
prompts, lengths = [[1, 5, 9, 13, 17], [1, 200, 33], [1, 7, 7, 7, 7, 7, 100], [1, 50]], [12, 9, 12, 12]
out = {}
with rpc.LocalServer(threads=1, register=False) as server:
    counter = CommandCounter(server.endpoint)
    for ngl in (0, 99):
        kw = dict(n_gpu_layers=99, rpc_servers=counter.endpoint) if ngl else {}
        llm = pymoecache.Llama(path, routing="lru", n_seq_max=4, n_ctx=512, verbose=False, n_threads=1,
                               cache=CacheConfig(size=1.0, residency="stream", prefetch="off"), **kw)
        dec = BatchDecoder(llm)
        seqs = [dec.add(p, max_tokens=n, keep_logits=True) for p, n in zip(prompts, lengths)]
        dec.step()  # (the four admitted and prefilled, one step decoded)
        steps = []

        def drain():
            while not dec.idle():
                steps.append(dec.step())

        got = counter.during(llm._ctx.ctx, drain)
        out[ngl] = dict(tokens=[s.tokens for s in seqs], logits=[np.array(s.logits).tolist() for s in seqs],
                        reads_per_step=got.get("GET_TENSOR", 0) / len(steps), steps=len(steps),
                        n_moe=len(llm.moe_stats().moe_layers))
        dec.close()
        llm.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", ["qwen2moe-60x4", "deepseek2-sigmoid-64x6"])
def test_a_batch_step_beside_device_layers_reads_the_device_once_per_moe_layer(fixture_dir, name, tmp_path):
    """Four sequences decoded together (BatchDecoder), every layer on the device and the experts in the
    streamed cache, computed on the CPU: each step's router logits and FFN inputs (one row per sequence)
    cross in one read per MoE layer, as a single token's do, and the run is the CPU's: the same tokens
    and logits as without GPU layers."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", BATCH_SCRIPT, str(model_path(fixture_dir, name)), str(ROOT / "scripts")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=installed_env())  # (the installed package)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    cpu, dev = out["0"], out["99"]
    assert dev["tokens"] == cpu["tokens"] and dev["steps"] >= 8
    for a, b in zip(dev["logits"], cpu["logits"]):
        assert np.allclose(a, b, rtol=RTOL, atol=ATOL)
    assert dev["reads_per_step"] == dev["n_moe"] + 1, dev["reads_per_step"]  # (and the step's logits)
