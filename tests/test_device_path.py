"""The device path where the cache only counts (issue 54 item 2, src_cpp/moecache-device.cpp).

With every expert resident (residency none) and top-k routing, our routing decision is llama.cpp's
own, so a decoded token's graph keeps llama.cpp's selection on the device: no CPU split per MoE
layer; what the counting reads is computed into a staging buffer on the device (llama.cpp's logits and
argsort placed there, the gating computed again beside them) and read once per device and step, queued
behind the graph (on the CPU it is read in place). Checked through ggml's RPC backend
(`pymoecache rpc-server` on the loopback, a real second backend whose splits and copies are real)
and on the CPU:
- the graph splits of a decoded token are stock llama.cpp's (same model, same server, same process's
  library), and one read of device memory per token (none on the CPU);
- what the cache counts (hits, misses, evictions, the trace, each layer's contents) and the logits
  are the CPU op's (the op path, which recording the router's outputs still takes);
- the prior runs on the device too, as ggml ops on the router's outputs with the cache's boosts
  uploaded once per token, and chooses exactly what the op chooses;
- a routing without device ops goes back to the op path at once, and top-k comes back;
- a batch of sequences (one token each) takes the device path under top-k, counted step by step;
- as users run it: `pymoecache run -ngl 99 --rpc HOST:PORT` from outside the tree says so."""

import os
import re
import subprocess
import sys

import llama_cpp
import numpy as np
import pytest

import pymoecache
from pymoecache import CacheConfig
from pymoecache import _moecache_cpp as C
from conftest import model_path
from test_arch_models import arch_models  # noqa: F401 (the fixture: every architecture's random-weight model)

KW = dict(n_ctx=128, n_batch=32, n_ubatch=32, logits_all=True, verbose=False, n_threads=1, seed=1)
PROMPT = list(range(300, 320))
DECODES = list(range(1000, 1040))
NAMES = ["qwen2moe-60x4", "mixtral-8x2", "olmoe-64x8", "deepseek2-sigmoid-64x6"]


def decode(llm):
    llm.reset()
    llm.eval(PROMPT)
    llm.reset_moe_stats()
    for t in DECODES:
        llm.eval([t])
    return np.array(llm.scores[: llm.n_tokens])


def run(path, endpoint, n_gpu_layers, record=0, routing="lru", size=0.25):
    kw = dict(KW, n_gpu_layers=n_gpu_layers, **({"rpc_servers": endpoint} if n_gpu_layers else {}))
    cache = CacheConfig(size=size, residency="none", trace=4096, router_record=record)
    llm = pymoecache.Llama(str(path), cache=cache, routing=routing, **kw)
    logits = decode(llm)
    st = llm.moe_stats()
    out = dict(logits=logits, hits=st.hits, misses=st.misses, evictions=st.evictions,
               trace=llm.moecache.trace().tobytes(), cached=[llm.moecache.cached(il) for il in st.moe_layers],
               rs=st.residency)
    llm.close()
    return out


def stock_splits(path, endpoint, n_gpu_layers):
    kw = dict(KW, n_gpu_layers=n_gpu_layers)
    llm = llama_cpp.Llama(str(path), **kw)  # (the RPC server's devices are registered in this process)
    llm.reset()
    llm.eval(PROMPT)
    llm.eval([DECODES[0]])
    n = C.moecache_context_graph_splits(llm._ctx.ctx)
    llm.close()
    return n


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n_gpu_layers", [99, 0])
def test_top_k_counts_after_the_graph_as_the_op_does(fixture_dir, gpu, name, n_gpu_layers):
    path = model_path(fixture_dir, name)
    fast = run(path, gpu, n_gpu_layers)
    op = run(path, gpu, n_gpu_layers, record=len(PROMPT) + len(DECODES))  # recording keeps the op path
    rs, rs_op = fast["rs"], op["rs"]
    # the device path ran, and only there: each decoded token counted after its graph, read from the device
    # once (the staging is host memory on the CPU: no read)
    assert rs.decode_graphs == rs.device_steps == len(DECODES)
    assert rs.device_reads == (len(DECODES) if n_gpu_layers else 0)
    assert rs_op.device_reads == rs_op.device_steps == 0
    # it counts what the op counts, and llama.cpp computes the same
    assert fast["misses"] > 0 and fast["evictions"] > 0
    for key in ("hits", "misses", "evictions", "trace", "cached"):
        assert fast[key] == op[key], key
    assert np.array_equal(fast["logits"], op["logits"])
    if n_gpu_layers:
        stock = stock_splits(path, gpu, n_gpu_layers)
        assert rs.splits_per_token == stock, (rs.splits_per_token, stock)
        assert rs_op.splits_per_token > stock  # a CPU split per MoE layer: what this path removes
        assert "routing counted after the graph" in rs.summary()
    else:
        assert rs.splits_per_token == 1


def test_a_routing_that_changes_the_selection_takes_the_op_and_top_k_comes_back(fixture_dir, gpu):
    path = model_path(fixture_dir, "qwen2moe-60x4")
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.25, residency="none"), routing="lru",
                           **dict(KW, n_gpu_layers=99, rpc_servers=gpu))
    decode(llm)
    assert llm.moecache.residency_stats().device_reads == len(DECODES)
    for routing in ("max-rank:8", "prior-p:0.3"):  # (no device ops for them: the CPU op)
        llm.set_routing(routing)
        decode(llm)
        st = llm.moe_stats()
        assert st.residency.device_reads == st.residency.device_steps == 0
        assert st.residency.decode_graphs == len(DECODES)
        assert st.residency.splits_per_token > 2 and st.residency.device_routed == 0
    llm.set_routing("prior:0.5")  # the prior on the device: a read per token too (its next boosts need it)
    decode(llm)
    st = llm.moe_stats()
    assert st.residency.device_reads == len(DECODES) and st.residency.splits_per_token == 2
    assert st.residency.device_routed == len(DECODES) * len(st.moe_layers)
    llm.set_routing("lru")
    decode(llm)
    assert llm.moe_stats().residency.device_steps == len(DECODES)
    llm.close()


@pytest.mark.parametrize("name", NAMES)
def test_the_prior_on_the_device_routes_as_the_op(fixture_dir, gpu, name):
    """The prior as ggml ops on the device (boosts uploaded once per token, from the cache and Delta
    before it) chooses what the CPU op chooses: the same logits bit for bit, the same counters and
    trace, no tie broken otherwise; at stock llama.cpp's graph splits. On the CPU the op routes."""
    path = model_path(fixture_dir, name)
    fast = run(path, gpu, 99, routing="prior:0.5")
    op = run(path, gpu, 99, routing="prior:0.5", record=len(PROMPT) + len(DECODES))
    rs = fast["rs"]
    assert rs.device_routed == len(DECODES) * len(fast["cached"]) and rs.device_route_differs == 0
    assert op["rs"].device_routed == 0 and rs.splits_per_token < op["rs"].splits_per_token
    for key in ("hits", "misses", "evictions", "trace", "cached"):
        assert fast[key] == op[key], key
    assert np.array_equal(fast["logits"], op["logits"])
    lru = run(path, gpu, 99, routing="lru")
    assert lru["hits"] < fast["hits"]  # (the prior chose otherwise than top-k: it was applied)
    assert run(path, gpu, 0, routing="prior:0.5")["rs"].device_routed == 0


@pytest.mark.parametrize("name", ["qwen2moe-60x4", "deepseek2-sigmoid-64x6"])
def test_a_batch_of_sequences_takes_the_device_path(fixture_dir, gpu, name):
    """Four sequences decoded together (pymoecache.BatchDecoder) with top-k: each step's rows go to the
    device's staging, one per sequence, and are counted step by step as the op counts them: the same
    tokens and logits, counters, trace and per-sequence hits, at stock's two graph splits. Sequences end
    at different steps and a fifth one takes a freed slot: each one's hits and misses are every selection
    of its decoded tokens, though the engine's sums per row are read when the sequences change, not each
    step; the device is read once per step, behind its graph."""
    from pymoecache import BatchDecoder

    prompts = [[1, 5, 9, 13, 17], [1, 200, 33], [1, 7, 7, 7, 7, 7, 100], [1, 50], [1, 9, 2000]]
    lengths = [24, 9, 17, 24, 10]
    out = {}
    for record in (0, 4096):  # (recording the router keeps the op)
        llm = pymoecache.Llama(str(model_path(fixture_dir, name)), routing="top-k", n_seq_max=4, n_ctx=512,
                               cache=CacheConfig(size=0.25, residency="none", trace=4096, router_record=record),
                               verbose=False, n_threads=1, n_gpu_layers=99, rpc_servers=gpu)
        dec = BatchDecoder(llm)
        seqs = [dec.add(p, max_tokens=n, keep_logits=True) for p, n in zip(prompts, lengths)]
        dec.run()
        st = llm.moe_stats()
        out[record] = dict(tokens=[s.tokens for s in seqs], logits=[np.array(s.logits) for s in seqs], hits=st.hits,
                           misses=st.misses, trace=llm.moecache.trace().tobytes(), rows=[(s.hits, s.misses) for s in seqs],
                           rs=st.residency, per_token=llm.model_info.n_expert_used * len(st.moe_layers))
        dec.close()
        llm.close()
    fast, op = out[0], out[4096]
    assert [len(t) for t in fast["tokens"]] == lengths  # (no end-of-generation token in the fixture's first ones)
    assert fast["rs"].decode_steps == op["rs"].decode_steps and fast["rs"].decode_tokens == op["rs"].decode_tokens
    assert fast["rs"].decode_tokens >= sum(lengths) - len(lengths)
    for (hits, misses), tokens in zip(fast["rows"], fast["tokens"]):
        assert hits + misses == (len(tokens) - 1) * fast["per_token"], (hits, misses, len(tokens))
    assert fast["rs"].device_reads == fast["rs"].device_steps == fast["rs"].decode_steps and op["rs"].device_reads == 0
    assert fast["rs"].splits_per_token == 2 < op["rs"].splits_per_token
    for key in ("tokens", "hits", "misses", "trace", "rows"):
        assert fast[key] == op[key], key
    assert all(np.array_equal(a, b) for a, b in zip(fast["logits"], op["logits"]))


@pytest.mark.parametrize("routing", [[], ["--prior", "0.5"]])
def test_run_with_every_expert_on_the_device_as_users_run_it(fixture_dir, gpu, tmp_path, routing):
    """`pymoecache run MODEL -ngl 99 --rpc HOST:PORT`, the installed package from outside the tree: the
    model fits, so every expert is resident and the default routing is top-k: the stats line shows the
    routing counted after the graph, at stock llama.cpp's graph splits, one read of the device a token.
    With `--prior 0.5` the prior runs on the device too, at the same splits and reads."""
    path = model_path(fixture_dir, "mixtral-8x2")
    stock = stock_splits(path, gpu, 99)
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(path), "-ngl", "99", "--rpc", gpu, "-p",
                        "The cat", "-n", "12", "--temp", "0", *routing], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    m = re.search(r"device: ([0-9.]+) graph splits/tok, routing counted after the graph \(([0-9.]+) reads/tok\)", out)
    assert m and float(m.group(1)) == stock, out[-2000:]
    assert float(m.group(2)) == 1.0, out[-2000:]
    assert ("the prior routed on the device" in out) == bool(routing), out[-2000:]


@pytest.mark.parametrize("routing", ["topk", "prior:0.5"])
def test_every_architecture_counts_on_the_device_as_the_op_does(arch_models, gpu, routing):
    """Every MoE architecture of the pin (tests/test_arch_models.py's random-weight models) over RPC,
    `-ngl 99`, counting half the experts, top-k and the prior: where the device path routes a layer
    (llama.cpp's argsort and logits computed into the staging, the gating computed again beside them:
    softmax, sigmoid, softplus and sqrt, a selection bias; gpt-oss's probabilities are its logits;
    grovemoe routes twice a layer, counted in order), the counters, the trace and the logits are the CPU
    op's, bit for bit; where a router has another shape the op routes it."""
    from test_arch_models import DENSE, KW as ARCH_KW, NO_ROUTING, NOT_EVALUATED, TOKENS

    failures, on_device = {}, []
    for arch, path in sorted(arch_models.items()):
        if arch in NOT_EVALUATED or arch in DENSE or arch in NO_ROUTING:
            continue
        out = []
        for record in (0, len(TOKENS)):  # (recording the router keeps the op)
            llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.5, residency="none", trace=1024,
                                                                router_record=record),
                                   routing=routing, **dict(ARCH_KW, n_gpu_layers=99, rpc_servers=gpu))
            llm.eval(TOKENS[:16])
            for t in TOKENS[16:]:
                llm.eval([t])
            st = llm.moe_stats()
            out.append(dict(logits=np.array(llm.scores[: len(TOKENS)]), counters=(st.hits, st.misses, st.evictions),
                            trace=llm.moecache.trace().tobytes(), steps=st.residency.device_steps,
                            routed=st.residency.device_routed))
            llm.close()
        fast, op = out
        if op["steps"] != 0:
            failures[arch] = "the op path counted after the graph"
        elif fast["counters"] != op["counters"] or fast["trace"] != op["trace"]:
            failures[arch] = f"counted otherwise: {fast['counters']} against {op['counters']}"
        elif not np.array_equal(fast["logits"], op["logits"]):
            failures[arch] = f"logits differ by {np.abs(fast['logits'] - op['logits']).max()}"
        if fast["steps"] == len(TOKENS) - 16 and (routing == "topk" or fast["routed"] > 0):
            on_device.append(arch)
    assert not failures, failures
    assert {"gpt-oss", "qwen3moe", "deepseek2", "olmoe"} <= set(on_device), on_device
    assert ("grovemoe" in on_device) == (routing == "topk")  # (the prior's second routing needs the first counted)
    assert len(on_device) >= 40, on_device
