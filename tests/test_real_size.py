"""Real-size shapes (issue 76 item 1): scripts/real_size.py builds a GGUF with a real model's hyperparameters,
tensors and quantization mix; one layer of each (CI cannot hold 18 GB) loads in llama.cpp and decodes under
stream with every routing, in a fresh process as a user runs it."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import real_size  # noqa: E402

SHAPES = sorted(real_size.SHAPES)


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("real")


@pytest.fixture(scope="module", params=SHAPES)
def built(request, real_dir):
    """One layer of one shape at a time (`shape`, path), deleted after its tests: all five together are 4.8 GB,
    more than a CI host may have free."""
    shape = request.param
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "real_size.py"), shape, "--layers", "1",
                        "--out-dir", str(real_dir)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    path = Path(r.stdout.strip().splitlines()[-1])  # the last line: the path
    assert path.is_file()
    yield shape, path
    path.unlink()
    path.with_suffix(".json").unlink()


def run_capped(cmd: list, cwd: Path, cap=None) -> subprocess.CompletedProcess:
    """``cmd`` in a fresh process, in a memory cgroup of ``cap`` bytes where given (MemoryCapError, a RuntimeError,
    where this process may make none), from ``cwd`` (outside the checkout: the installed package, as a user has
    it); it must succeed."""
    from memcap import MemoryCap

    if cap is None:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    else:
        with MemoryCap(cap) as c:
            r = subprocess.run(cmd, cwd=cwd, preexec_fn=c.join, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def mixtral2(real_dir):
    """Mixtral's shape with two layers (8 experts of 102 MiB a layer), for the tests under a cap."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "real_size.py"), "mixtral-8x7b", "--layers", "2",
                        "--out-dir", str(real_dir)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return Path(r.stdout.strip().splitlines()[-1])


def test_the_full_size_files_are_the_real_ones_sizes():
    """The full files as the real GGUFs are (random weights aside): Qwen3-30B-A3B Q4_K_M 18.6 GB of which 48 x 128
    experts of 2.7 MiB; gpt-oss-20b MXFP4 12.1 GB; OLMoE-1B-7B Q4_K_M 4.2 GB (the published files' sizes); DeepSeek-V2-Lite's
    15.7B parameters."""
    size = {s: sum(real_size.nbytes(t) for t in real_size.tensors(real_size.SHAPES[s])) / 1e9 for s in SHAPES}
    assert abs(size["qwen3-30b-a3b"] - 18.6) < 0.2
    assert abs(size["gpt-oss-20b"] - 12.1) < 0.3
    assert abs(size["olmoe-1b-7b"] - 4.2) < 0.2
    assert 25 < size["mixtral-8x7b"] < 29.5
    qwen = real_size.tensors(real_size.SHAPES["qwen3-30b-a3b"])
    types = {t.name: t.qtype.name for t in qwen}
    # llama-quantize's Q4_K_M: Q6_K output, attn_v and ffn_down where use_more_bits picks the layer (0-5, 42-47,
    # and every third from 8), Q4_K elsewhere; F32 routers
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in (0, 6, 7, 8, 47)] == ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert types["blk.3.ffn_gate_inp.weight"] == "F32" and types["blk.3.ffn_up_exps.weight"] == "Q4_K"
    oss = {t.name: t.qtype.name for t in real_size.tensors(real_size.SHAPES["gpt-oss-20b"])}
    assert oss["blk.0.ffn_up_exps.weight"] == "MXFP4" and oss["blk.0.attn_q.weight"] == "Q8_0"
    # DeepSeek-V2-Lite: 15.7B parameters; a dense first layer, then 26 of 64 experts (rows of 1408: Q4_K's fallback
    # Q5_0, Q6_K's Q8_0) with 2 shared; MLA's split K and V up-projections
    ds = real_size.tensors(real_size.SHAPES["deepseek-v2-lite"])
    assert abs(sum(math.prod(t.shape) for t in ds) / 1e9 - 15.7) < 0.1
    dst = {t.name: t.qtype.name for t in ds}
    assert "blk.0.ffn_down.weight" in dst and "blk.0.ffn_gate_inp.weight" not in dst
    assert dst["blk.1.ffn_down_exps.weight"] == "Q8_0" and dst["blk.4.ffn_down_exps.weight"] == "Q5_0"
    assert dst["blk.26.ffn_up_shexp.weight"] == "Q4_K" and "blk.26.attn_k_b.weight" in dst


def test_a_built_file_is_kept_and_its_card_says_what_it_is(built):
    shape, path = built
    card = json.loads(path.with_suffix(".json").read_text())
    assert card["card"]["shape"]["n_layer"] == 1 and card["bytes"] == path.stat().st_size
    mtime = path.stat().st_mtime_ns
    assert real_size.build(shape, 1, out_dir=path.parent, progress=False) == path
    assert path.stat().st_mtime_ns == mtime  # (not written again)


_DECODE = r"""
import json, math, sys
import numpy as np
import pymoecache
path, routing = sys.argv[1], sys.argv[2]
llm = pymoecache.Llama(path, cache=pymoecache.CacheConfig(size=0.25, residency="stream"), routing=routing,
                       n_ctx=256, n_threads=2, verbose=False)
prompt = llm.tokenize(b"The quick brown fox")
llm.eval(prompt)
for _ in range(6):
    row = np.array(llm.eval_logits[-1])
    assert np.isfinite(row).all(), "non-finite logits"
    llm.eval([int(row.argmax())])
st = llm.moe_stats()
info = llm.model_info
print(json.dumps({"n_vocab": llm.n_vocab(), "n_expert": info.n_expert, "k": info.n_expert_used,
                  "arch": info.arch, "hits": int(st.hits), "misses": int(st.misses), "tokens": int(st.tokens),
                  "given_up": st.p_given_up, "n_prompt": len(prompt)}))
"""


@pytest.mark.parametrize("routing", ["lru", "prior:0.5", "max-rank:4", "cumsum:0.7", "preset:balanced"])
def test_one_layer_of_each_shape_decodes_under_stream_with_every_routing(built, routing):
    shape, path = built
    s = real_size.SHAPES[shape]
    r = subprocess.run([sys.executable, "-c", _DECODE, str(path), routing], capture_output=True, text=True,
                       timeout=300, cwd=path.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["n_vocab"] == s.n_vocab and out["n_expert"] == s.n_expert and out["k"] == s.n_expert_used
    assert out["arch"] == s.arch
    # (the only layer is the last, where llama.cpp computes the prompt's output row only, unless the arch's graph
    # computes every row there)
    assert out["tokens"] in (1 + 6, out["n_prompt"] + 6) and out["hits"] + out["misses"] > 0
    assert 0.0 <= out["given_up"] <= 1.0 + 1e-6  # a probability (gpt-oss's p are its logits: counted on their softmax)


def test_the_bench_runs_each_way_in_its_own_capped_cgroup(tmp_path):
    """scripts/bench_real_size.py as a user runs it, at its smallest: one layer of OLMoE's shape under a cap of the
    file's size, stock llama.cpp without repacking and pymoecache's defaults, each in a memory cgroup of its own. The
    defaults size their cache by the cgroup's limit (the plan says which it read) and stay within the cap. (At half
    the file, 199 MiB, less than the dense part and the KV cache beside a token's 8 slots, the defaults were killed
    in 1 of 3 runs with the dense part locked, in 0 of 2 since it is not locked there: not asserted, a race.)"""
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_real_size.py"), "olmoe-1b-7b", "--layers", "1",
                        "--out-dir", str(tmp_path), "--caps", "1", "--ways", "stock-no-repack,default", "--tokens", "3", "--warmup", "1",
                        "--prompt-tokens", "8", "--budget-s", "60", "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0 and "cannot make a memory cgroup" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {row["way"]: row for row in data["rows"]}
    assert set(rows) == {"stock-no-repack", "default"} and all("error" not in row for row in rows.values()), rows
    cap = rows["default"]["cap"]
    assert rows["default"]["budget_from"] == rows["default"]["cgroup"]  # ("cgroup v1" or "cgroup v2")
    assert rows["default"]["peak"] <= cap and rows["default"]["tokens"] == 3 and rows["default"]["decode_tok_s"] > 0
    assert "| default |" in r.stdout and "random weights" in r.stdout


def test_memory_below_the_dense_part_leaves_it_unlocked(monkeypatch):
    """Where the memory free holds less than the dense part, the KV cache and a token's K slots, cache size auto does
    not lock the dense part (locked, it leaves the runtime nothing and the process is killed; unlocked, the OS pages
    it as it pages stock's mapping), and says so; with room, it stays locked."""
    import warnings

    import pymoecache
    import pymoecache.plan

    from conftest import FIXTURE_DIR, model_path

    m = str(model_path(FIXTURE_DIR, "qwen2moe-60x4"))
    for available, locked in ((12 << 20, False), (4 << 30, True)):
        monkeypatch.setattr(pymoecache.plan, "_available_memory", lambda a=available: a)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            llm = pymoecache.Llama(m, n_ctx=128, verbose=False)
        said = [str(x.message) for x in w if "the dense part is not locked" in str(x.message)]
        assert llm.cache_config.lock_dense is locked and bool(said) is not locked, (available, said)
        llm.close()


@pytest.mark.parametrize("built", ["gpt-oss-20b", "olmoe-1b-7b"], indirect=True)
def test_a_companion_that_cannot_be_smaller_is_refused_before_any_work(built, tmp_path):
    """gpt-oss's expert rows (2880 values) take no 256-value block: llama.cpp would write Q2_K's fallback, Q4_0,
    larger than MXFP4. `lowbit` says so at once and writes nothing (it used to quantize the whole file first, then
    refuse it and leave it); OLMoE's rows (2048) take the default Q3_K."""
    from test_rpc_as_installed import installed

    shape, path = built
    r = installed(tmp_path, "lowbit", path, "-o", tmp_path / "lowbit.gguf")
    if shape == "gpt-oss-20b":
        assert r.returncode == 2 and "rows of blk.0.ffn_gate_exps.weight (2880 values)" in r.stderr, r.stderr
        assert "Q4_0 (4.50 bits per weight), not lower than the model's MXFP4" in r.stderr and "cannot have" in r.stderr
        assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    else:
        assert r.returncode == 0 and "at Q3_K" in r.stdout + r.stderr, r.stderr
        assert [p.name for p in tmp_path.iterdir()] == ["lowbit.gguf"]


def test_sequences_whose_slots_do_not_fit_decode_in_smaller_steps(monkeypatch):
    """Issue 76 item 3: serve -np 16 on qwen3-30b-a3b's shape under a third of the file was killed by the cap: each
    sequence beyond the first kept K more slots per layer (15 x 8 x 48 x 2.7 MiB = 15.6 GB). With cache size auto a
    step decodes as many sequences as half the memory beside the dense part, the KV cache and a token's slots holds
    step slots for, the others in the steps after, and says so; under top-k every sequence gets the tokens it gets
    with room for all of them. (The layers now share those slots where the cache is sized from memory, on Linux: a
    sequence costs one layer's K slots, so it takes little memory to fit all 16 of qwen3's; here, still few.)"""
    import warnings

    import pymoecache
    import pymoecache.placement
    import pymoecache.plan
    from pymoecache import BatchDecoder

    from conftest import FIXTURE_DIR, model_path

    m = str(model_path(FIXTURE_DIR, "qwen2moe-60x4.Q8_0"))
    info = pymoecache.model_info(m)
    dense, kv = pymoecache.plan._on_host(info, 512, 0)
    own = info.n_expert_used * info.cache_bytes * info.n_moe_layer  # (a token's K slots in every layer)
    per_seq = pymoecache.placement.batch_slot_bytes(info, 2)  # (another sequence's step slots)
    out = {}
    for available in (dense + kv + own + per_seq * 5 + per_seq // 2, 4 << 30):  # (room for 2 more sequences; all)
        monkeypatch.setattr(pymoecache.plan, "_available_memory", lambda a=available: a)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            llm = pymoecache.Llama(m, n_ctx=512, n_seq_max=8, routing="top-k", verbose=False)
        said = [str(x.message) for x in w if "sequences decoded together" in str(x.message)]
        dec = BatchDecoder(llm)
        seqs = [dec.add([1, 5 + i, 9, 13], max_tokens=6) for i in range(8)]
        dec.run()
        out[available] = (llm.placement.n_seq_step, dec.steps, [s.tokens for s in seqs], said)
        dec.close()
        llm.close()
    (step_small, steps_small, toks_small, said_small), (step_all, steps_all, toks_all, said_all) = out.values()
    assert (step_small, step_all) == (3, 8), out
    assert said_small and "a step decodes at most 3 of them together" in said_small[0] and not said_all
    assert steps_all == 5 and steps_small == 5 * 3  # (8 sequences: steps of 3, 3 and 2; the first token from the prompt)
    assert toks_small == toks_all


BEHIND_SCRIPT = r"""
import json, sys
import numpy as np
import pymoecache
import llama_cpp  # (after pymoecache, which loads our library for it)
path, n_cached, out, prefetch = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
cache = pymoecache.CacheConfig(size=n_cached, prefetch=prefetch) if n_cached else None  # (0: the defaults, by the cap)
llm = pymoecache.Llama(path, cache=cache, n_ctx=64, n_threads=2, verbose=False)
llm.start_timeline()
llm.eval(list(range(100, 124)))  # 24 tokens x 2 selections: every one of the 8 experts, most likely
logits = []
for t in (7, 300, 42, 5000):
    llm.eval([t])
    row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)  # (llm.scores holds them only with logits_all)
    logits.append(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy())
spans = [list(s) for s in llm._timeline_spans]  # (t_start_us, t_end_us, n_tokens) of each eval
ev = llm.timeline().events
from pymoecache.timeline import KINDS
events = [[KINDS[int(k)], int(l), int(e), int(q)] for k, l, e, q in zip(ev["kind"], ev["layer"], ev["expert"], ev["t_queued_us"])]
np.save(out, np.array(logits))
print(json.dumps({"n_cached": int(llm.moe_stats().capacity_per_layer[0]), "spans": spans, "events": events,
                  "prefetch": llm.cache_config.prefetch}))
"""


def test_a_prompt_under_a_cap_reads_its_slots_behind_it_not_through_the_mapping(tmp_path, mixtral2):
    """A prompt layer the memory leaves no room to ask for whole (a cap: the matmul faults it in through the kernel's
    readahead) used to copy the experts the cache keeps from the mapping before its matmul: pages the matmul's own
    faults then evicted and read again (Mixtral's shape at a third: 9.3 GB read for a 7.2 GB file, a fifth of the
    prompt waiting for the copies). Those slots are now read from the file with direct I/O once the prompt's ubatch
    ran. Two layers of Mixtral's shape (8 experts of 102 MiB) under a cap of a third of its file, the defaults, a fresh
    process: no copy from the mapping, every read of the prompt's cached experts queued after the prompt's
    matmuls; and the 4 tokens decoded after it give the logits of the same cache uncapped (the copies; its size, and
    no reads ahead, for which the cap left no room), bit for bit."""
    model = mixtral2  # (2 layers: the last computes the prompt's output row alone)

    def run(n_cached, cap=None, prefetch="auto"):
        cmd = [sys.executable, "-c", BEHIND_SCRIPT, str(model), str(n_cached), str(tmp_path / f"logits{n_cached}.npy"),
               prefetch]
        r = run_capped(cmd, tmp_path, cap)
        return json.loads(r.stdout.strip().splitlines()[-1]), np.load(tmp_path / f"logits{n_cached}.npy")

    try:
        capped, logits = run(0, cap=model.stat().st_size // 3)
    except RuntimeError as e:  # (MemoryCapError: no memory cgroup this process may make)
        pytest.skip(str(e))
    n = capped["n_cached"]
    assert 0 < n < 8, capped["n_cached"]
    # (the prompt's last routing, layer 1's, follows layer 0's matmuls: its output is layer 1's input)
    prompt_end = max(q for kind, _, _, q in capped["events"] if kind == "route" and q < capped["spans"][1][0])
    first = [ev for ev in capped["events"] if ev[1] == 0]  # (layer 0: the prompt's 24 tokens)
    copies = [ev for ev in first if ev[0] == "copy"]
    reads = [ev for ev in first if ev[0] in ("read", "read_ahead") and ev[3] <= capped["spans"][1][0]]
    assert {ev[0] for ev in capped["events"]} >= {"route", "read_ahead"}, capped["events"][:8]  # (the kinds recorded)
    assert not copies, copies[:4]
    assert reads and all(q >= prompt_end for _, _, _, q in reads), (prompt_end, reads[:4])
    assert 1 <= len({e for _, _, e, _ in reads}) <= n, reads  # (those the prompt left cached; the load's warm-up
    # token may have left one of them in its slot)
    uncapped, expect = run(n, prefetch=capped["prefetch"])  # (the cap left no room to read ahead: nor here)
    assert uncapped["n_cached"] == n and any(ev[0] == "copy" and ev[1] == 0 for ev in uncapped["events"])
    assert np.array_equal(logits, expect)


LEND_SCRIPT = r"""
import json, sys
import numpy as np
import pymoecache
import llama_cpp  # (after pymoecache, which loads our library for it)
path, out = sys.argv[1], sys.argv[2]
llm = pymoecache.Llama(path, cache=pymoecache.CacheConfig(size=2), n_ctx=64, n_threads=2, verbose=False)
rss_loaded = llm.moe_stats().residency.rss_bytes
llm.eval(list(range(100, 124)))  # 24 tokens x 2 selections: every one of the 8 experts, most likely
rs = llm.moe_stats().residency
after_prompt = [rs.locked, rs.arena_bytes, rs.locked_bytes]
logits = []
for t in range(123, 99, -1):  # the prompt's tokens backwards: the experts it left cached come first. (A random
    # router weighs its first choice ~1 and the rest ~0: a wrong second expert changes no logit)
    llm.eval([t])
    row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)  # (llm.scores holds them only with logits_all)
    logits.append(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy())
rs = llm.moe_stats().residency
np.save(out, np.array(logits))
print(json.dumps({"rss_loaded": rss_loaded, "layer_bytes": rs.expert_bytes * 8, "after_prompt": after_prompt,
                  "after_decode": [rs.locked, rs.arena_bytes, rs.locked_bytes],
                  "prefetch": [llm.cache_config.prefetch, llm.cache_config.prefetch_spare]}))
"""


def test_a_prompt_short_of_memory_borrows_the_slots_of_the_layers_it_has_not_reached(tmp_path, mixtral2):
    """A prompt computes on the mapping, not on the slots, and copies the experts the cache keeps into the slots as
    each layer runs; under a cap it had room for its layer's reads and little more (gpt-oss-20b's shape at a third:
    its 420 MB and 50 MB), so it read nothing ahead. Now, with room for its layer but not two, the last layers lend
    the pages of their slots to the prompt's reads and take them back at their layer (src_cpp/moecache-lend.cpp); a
    decode locks them again. Mixtral's shape with two layers (2 of 8 experts cached), a fresh process, first without
    a cap (nothing lent), then under a cap that leaves a layer and a half beyond what the load took: after the prompt
    the arena is locked less the lent slots, after a decode whole again, and the 24 tokens decoded give the logits of
    the run without a cap, bit for bit."""
    model = mixtral2

    def run(name, cap=None):
        cmd = [sys.executable, "-c", LEND_SCRIPT, str(model), str(tmp_path / f"{name}.npy")]
        r = run_capped(cmd, tmp_path, cap)
        return json.loads(r.stdout.strip().splitlines()[-1]), np.load(tmp_path / f"{name}.npy")

    free, expect = run("free")
    locked, arena, after_prompt = free["after_prompt"]
    if not locked:
        pytest.skip("the slot arena could not be locked here (RLIMIT_MEMLOCK): lent slots are not told apart")
    assert after_prompt == arena, free  # (room for every layer: nothing lent)
    try:
        capped, logits = run("capped", cap=free["rss_loaded"] + free["layer_bytes"] * 3 // 2 + (64 << 20))
    except RuntimeError as e:  # (MemoryCapError: no memory cgroup this process may make)
        pytest.skip(str(e))
    assert capped["after_prompt"][:2] == [True, arena] and capped["after_prompt"][2] < arena, capped
    assert capped["after_decode"] == [True, arena, arena], capped
    assert capped["prefetch"] == free["prefetch"]  # (the same cache, read ahead the same way)
    assert np.array_equal(logits, expect)


FOLIO_SCRIPT = r"""
import json, sys
import gguf
import pymoecache
path = sys.argv[1]
llm = pymoecache.Llama(path, n_ctx=64, n_threads=2, verbose=False)  # (the defaults: stream)
experts = [(t.data_offset, t.data_offset + t.n_bytes) for t in gguf.GGUFReader(path).tensors if "_exps" in t.name]
regions, head = [], None
with open("/proc/self/smaps") as f:
    for line in f:
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:  # a region's first line
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            head = (int(parts[2], 16), int(parts[2], 16) + hi - lo) if parts[-1] == path else None
        elif line.startswith("VmFlags:") and head:
            regions.append([head[0], head[1], " hg" in line])
print(json.dumps({"experts": experts, "regions": regions}))
"""


def test_a_stream_short_of_memory_for_its_experts_reads_them_in_2_mib_folios(tmp_path, mixtral2):
    """Where the memory free once the cache is locked holds less than the file's experts, a prompt's pages are
    reclaimed again as it goes, and 4 KiB pages cost the kernel more than the reads (qwen3-30b-a3b's shape at a
    third: a 128-token prompt in 8.1 s with 2 MiB folios against 11.1-12.0). So STREAM advises the expert regions of
    the mapping MADV_HUGEPAGE there, and only there: uncapped, small folios measured faster. Mixtral's two layers,
    the defaults, a fresh process: uncapped no region of the file is advised; under a cap of a third of the file the
    expert tensors are (VmFlags `hg` in /proc/self/smaps), and nothing outside them."""
    if not Path("/sys/kernel/mm/transparent_hugepage").is_dir():
        pytest.skip("no transparent huge pages in this kernel: nothing to advise")

    def run(cap=None):
        cmd = [sys.executable, "-c", FOLIO_SCRIPT, str(mixtral2)]
        r = run_capped(cmd, tmp_path, cap)
        return json.loads(r.stdout.strip().splitlines()[-1])

    free = run()
    assert free["regions"] and not any(hg for _, _, hg in free["regions"]), free["regions"]
    try:
        capped = run(cap=mixtral2.stat().st_size // 3)
    except RuntimeError as e:  # (MemoryCapError: no memory cgroup this process may make)
        pytest.skip(str(e))
    advised = [(lo, hi) for lo, hi, hg in capped["regions"] if hg]
    experts = capped["experts"]
    assert all(any(a <= lo and hi <= b for a, b in experts) for lo, hi in advised), (advised, experts)
    covered = sum(hi - lo for lo, hi in advised)
    whole = sum(b - a for a, b in experts)
    assert covered > whole - len(experts) * 2 * 4096, (covered, whole)  # (every tensor but its edge pages)


def test_a_cache_the_memory_left_short_says_how_to_make_a_companion(tmp_path, mixtral2):
    """`pymoecache run M` as a user with a model over their memory types it: under a cap of a third of Mixtral's
    two-layer file the context (-c 0) is capped by the memory, as serve's (the model's 32768 tokens got the run
    killed), the cache (sized from the memory) streams whole experts, and a tip says how to make the companion
    that later runs would take, what it would be and what a miss would read (Q3_K for Q4_K_M's experts: 1.41x fewer
    bytes). Uncapped every expert fits: no tip. Once a companion lies beside the model: no tip either."""
    m = tmp_path / "mixtral.gguf"
    m.symlink_to(mixtral2)
    cmd = [sys.executable, "-m", "pymoecache", "run", str(m), "-n", "1", "-p", "Hello"]  # (-c 0: capped by memory)
    free = run_capped(cmd, tmp_path)
    assert "tip:" not in free.stderr and "from memory" in free.stderr, free.stderr[-2000:]
    try:
        capped = run_capped(cmd, tmp_path, cap=mixtral2.stat().st_size // 3)
    except RuntimeError as e:  # (MemoryCapError: no memory cgroup this process may make)
        pytest.skip(str(e))
    # (its 32768 tokens' KV cache, 256 MiB, would leave no slot: the context is halved to fit a quarter of the memory)
    assert "tokens (the model's 32768 capped by the free memory); -c N sets it" in capped.stderr, capped.stderr[-2000:]
    tip = next((ln for ln in capped.stderr.splitlines() if ln.startswith("tip: ")), "")
    assert f"`pymoecache lowbit {m}`, once, makes mixtral.lowbit-Q3_K.gguf" in tip, capped.stderr[-2000:]
    assert "a miss reads 1.41x fewer bytes" in tip and "--type Q2_K" in tip, tip
    (tmp_path / "mixtral.lowbit-Q3_K.gguf").write_bytes(b"")  # (one beside it, unusable: the load says why)
    again = run_capped(cmd, tmp_path, cap=mixtral2.stat().st_size // 3)
    assert "tip:" not in again.stderr, again.stderr[-2000:]


def test_serve_under_a_cap_gives_the_same_tip_and_context_line(tmp_path, mixtral2):
    """`pymoecache serve M` under the same cap as the run above: its memory-capped context and the tip, said
    before the banner (the server then answers; it is stopped once the banner is out)."""
    from conftest import free_port
    from memcap import MemoryCap

    m = tmp_path / "mixtral.gguf"
    m.symlink_to(mixtral2)
    log = tmp_path / "serve.log"
    try:
        with MemoryCap(mixtral2.stat().st_size // 3) as c, open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pymoecache", "serve", str(m), "--port", str(free_port())],
                                    cwd=tmp_path, preexec_fn=c.join, stdout=out, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 300
                while "(OpenAI API)" not in log.read_text() and proc.poll() is None:  # (the banner)
                    assert time.monotonic() < deadline, log.read_text()[-2000:]
                    time.sleep(0.25)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    except RuntimeError as e:  # (MemoryCapError: no memory cgroup this process may make)
        pytest.skip(str(e))
    text = log.read_text()
    assert "(OpenAI API)" in text, text[-2000:]
    assert "capped by the free memory" in text and f"`pymoecache lowbit {m}`, once, makes mixtral.lowbit-Q3_K.gguf" in text
