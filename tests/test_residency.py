"""Expert residency (src_cpp/moecache-residency.cpp): where the experts' bytes live must not
change a single logit. With the same routing, stream (experts read from the file into slots) and
mmap (cached experts locked in the mapping) give bit-identical logits to the fully resident model
(residency "none") for every fixture architecture, both trained models and several cache sizes;
every decode miss is one expert read; a truncated file is a clear error, not a crash."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pymoecache
import synth
from pymoecache import CacheConfig
from conftest import MOE_FIXTURES, ROOT, model_path

KW = dict(n_ctx=256, n_batch=32, n_ubatch=32, logits_all=True, verbose=False, n_threads=2, seed=1)
PROMPT = list(range(300, 340))        # 40 tokens: prompt ubatches of 32 and 8, read through the mapping
DECODES = list(range(1000, 1032))     # 32 one-token decodes, read from the slots
TRAINED = [ROOT / "models" / "tiny-shakespeare-qwen2moe-60x4.gguf", ROOT / "models" / "tiny-shakespeare-mixtral-8x2.gguf"]
SETTINGS = [("lru", 0.25), ("prior:0.5", 0.5), ("max-rank:8", 3)]


def run(path, residency: str, routing: str, size, **cache):
    """Logits of PROMPT then DECODES, and the stats of the decodes alone (``cache``: more CacheConfig fields)."""
    cache.setdefault("prefetch", "off")  # (every read below is a miss's own; tests/test_prefetch.py reads ahead)
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=size, residency=residency, **cache), routing=routing, **KW)
    llm.reset()
    llm.eval(PROMPT)
    llm.reset_moe_stats()
    for t in DECODES:
        llm.eval([t])
    logits = np.array(llm.scores[: len(PROMPT) + len(DECODES)])
    st = llm.moe_stats()
    llm.close()
    return logits, st


def model_paths(fixture_dir):
    return [model_path(fixture_dir, name) for name in MOE_FIXTURES] + [p for p in TRAINED if p.exists()]


@pytest.fixture(scope="module")
def paths(fixture_dir):
    return {p.stem: p for p in model_paths(fixture_dir)}


@pytest.mark.parametrize("routing,size", SETTINGS)
@pytest.mark.parametrize("name", MOE_FIXTURES + [p.stem for p in TRAINED])
def test_stream_and_mmap_are_bit_identical_to_resident(paths, name, routing, size):
    if name not in paths:
        pytest.skip(f"{name}.gguf is not in this checkout")
    path = paths[name]
    ref, st_ref = run(path, "none", routing, size)
    assert np.isfinite(ref).all()
    K = st_ref.n_expert_used
    # stream: the expert matmuls take each expert as its bytes arrive (overlap_experts), or wait for all
    for residency, overlap in (("stream", True), ("stream", False), ("mmap", True)):
        got, st = run(path, residency, routing, size, overlap_experts=overlap)
        assert np.array_equal(got, ref), f"{residency} {overlap=}: max |diff| = {np.abs(got - ref).max()}"
        # same routing, so the same hits and misses
        assert st.misses == st_ref.misses and st.hits == st_ref.hits
        rs = st.residency
        assert rs.residency == residency and rs.decode_tokens == len(DECODES)
        assert st.misses > 0, "the setting should miss, or nothing was streamed"
        if st.capacity_per_layer.min() >= K:
            # memory follows the cache exactly: one expert read (or locked in) per decode miss
            assert rs.decode_loads == st.misses
            assert rs.decode_bytes_read >= st.misses * rs.expert_bytes
            assert rs.decode_bytes_read <= st.misses * (rs.expert_bytes + 3 * 2 * 4096)  # O_DIRECT windows
        if residency == "stream":
            n_slots = np.maximum(st.capacity_per_layer, K)
            assert rs.arena_bytes >= int((n_slots * rs.expert_bytes).sum())
            slot = pymoecache.model_info(path).cache_bytes  # (with a page per tensor where reads land in place)
            assert rs.arena_bytes <= int((n_slots * slot).sum()) + len(n_slots) * 4 * 4096


@pytest.mark.parametrize("routing", ["lru", "prior:0.5"])
@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_a_stream_cache_that_holds_every_expert_is_read_at_load(paths, name, routing):
    """A stream cache with room for all N experts reads them into its slots when it is made, as a
    resident model is read at load: no token reads anything, prompts compute on the slots instead
    of the mapping. Every expert is cached from the start: no selection is a miss, and the prior,
    which finds every expert cached, routes as top-k does (the logits are the stock model's)."""
    path = paths[name]
    ref, st_ref = run(path, "none", "lru", 1.0)
    prompt_read = {}
    for size in (1.0, 0.5):
        llm = pymoecache.Llama(str(path), cache=CacheConfig(size=size, residency="stream"), routing=routing, **KW)
        llm.eval(PROMPT)
        prompt_read[size] = llm.moe_stats().residency.prompt_bytes_read
        if size == 1.0:
            llm.reset_moe_stats()
            for t in DECODES:
                llm.eval([t])
            got = np.array(llm.scores[: len(PROMPT) + len(DECODES)])
            st = llm.moe_stats()
        else:
            half = llm.moe_stats()
        llm.close()
    assert np.array_equal(got, ref), f"max |diff| = {np.abs(got - ref).max()}"
    rs, N = st.residency, st.n_expert
    n_moe = len(st.capacity_per_layer)
    assert st.capacity_per_layer.tolist() == [N] * n_moe
    # every expert is in a slot from the start: no selection is a miss (resident counts first uses, which read nothing)
    assert st.misses == 0 and st.hits == st_ref.hits + st_ref.misses
    assert rs.decode_loads == 0 and rs.decode_bytes_read == 0
    assert prompt_read[1.0] == 0, "the prompt read the mapping, not the slots"
    assert N * n_moe * rs.expert_bytes <= rs.load_bytes_read <= N * n_moe * (rs.expert_bytes + 3 * 2 * 4096)
    assert rs.load_t_io_ms > 0
    # a cache of half the experts is filled by the tokens that need them, the prompt through the mapping
    assert half.residency.load_bytes_read == 0 and prompt_read[0.5] > 0


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_quantized_stream_matches_mmap(fixture_dir, name):
    """Q4_K_M: stream and mmap read the same (unrepacked) bytes, so the logits agree bit for bit."""
    path = model_path(fixture_dir, name, ".Q4_K_M")
    b, st_b = run(path, "mmap", "prior:0.5", 0.5)
    for overlap in (True, False):
        a, st_a = run(path, "stream", "prior:0.5", 0.5, overlap_experts=overlap)
        assert np.isfinite(a).all()
        assert np.array_equal(a, b), f"{overlap=}: max |diff| = {np.abs(a - b).max()}"
        assert st_a.misses == st_b.misses > 0


REPACK_SCRIPT = r"""
import sys
import numpy as np
import pymoecache
from pymoecache import CacheConfig
path, residency, out = sys.argv[1:4]
# (no reads ahead: streamed, the prior would count them, and mmap has none)
llm = pymoecache.Llama(path, cache=CacheConfig(size=1.0 if residency == "none" else 0.5, residency=residency,
                                               prefetch="off"),
                       routing="prior:0.5", n_ctx=128, n_threads=2, seed=1, logits_all=True, verbose=True)
llm.eval(list(range(300, 316)))
for t in range(1000, 1008):
    llm.eval([t])
np.save(out, np.array(llm.scores[:24]))
llm.close()
"""


def test_stream_and_mmap_give_the_dense_part_the_repacked_layout_of_resident(fixture_dir, tmp_path):
    """Issue 26 item 4: llama.cpp repacks Q4_0 weights for its faster kernels (CPU_REPACK, AVX2 or
    ARM dot products). Stream and mmap keep that for every weight but the routed experts, which stay
    in the file's layout in the mapping (the slots are read in it); resident repacks those too."""
    path = tmp_path / "qwen2moe-60x4.Q4_0.gguf"
    synth.quantize(model_path(fixture_dir, "qwen2moe-60x4"), path, "Q4_0")
    logs, logits = {}, {}
    for residency in ("none", "stream", "mmap"):
        out = tmp_path / f"{residency}.npy"
        r = subprocess.run([sys.executable, "-c", REPACK_SCRIPT, str(path), residency, str(out)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        logs[residency], logits[residency] = r.stderr, np.load(out)
    repacked = {res: set(re.findall(r"repack: repack tensor (\S+) with", log)) for res, log in logs.items()}
    if not repacked["none"]:
        pytest.skip("this CPU has no repacked layout for Q4_0 (no AVX2 or ARM dot product)")
    experts = {t for t in repacked["none"] if "_exps." in t}
    assert experts, repacked["none"]  # resident repacks the experts too
    for residency in ("stream", "mmap"):
        assert repacked[residency] == repacked["none"] - experts, residency
        assert "CPU_REPACK model buffer size" in logs[residency]
    # both read the experts' file bytes with the same kernels: bit for bit
    assert np.isfinite(logits["stream"]).all()
    assert np.array_equal(logits["stream"], logits["mmap"])


def test_no_repack_keeps_the_dense_part_in_the_files_layout(fixture_dir, tmp_path):
    """`pymoecache run --no-repack` is llama-cli's: llama.cpp repacks none of the dense part's Q4_0 weights
    (the default repacks them where the CPU has the layouts), and the run decodes. A keyword that is not a
    bool is refused before the load."""
    path = tmp_path / "qwen2moe-60x4.Q4_0.gguf"
    synth.quantize(model_path(fixture_dir, "qwen2moe-60x4"), path, "Q4_0")
    repacked = {}
    for flags in ((), ("--no-repack",)):
        r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(path), "-p", "Hello", "-n", "4",
                            "--cache-size", "0.5", "-v", *flags], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)  # (outside the source tree: the installed package, as a user runs it)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.startswith("Hello") and len(r.stdout) > len("Hello"), r.stdout
        repacked[flags] = re.findall(r"repack: repack tensor (\S+) with", r.stderr)
    if not repacked[()]:
        pytest.skip("this CPU has no repacked layout for Q4_0 (no AVX2 or ARM dot product)")
    assert repacked[("--no-repack",)] == [] and all("_exps." not in t for t in repacked[()]), repacked
    with pytest.raises(pymoecache.ConfigError, match="repack must be True"):
        pymoecache.Llama(str(path), repack="no")


def test_experts_of_whole_pages_are_read_in_place(tmp_path):
    """Experts whose bytes are a whole number of pages (as in most real models) but start mid-page
    in the file: each slot gets one page of padding so the page-aligned window around the expert is
    read straight into it (direct I/O, no bounce buffer, no copy). The logits stay bit-identical to
    resident, every miss reads exactly that window, and a byte budget counts the padding."""
    spec = dataclasses.replace(synth.BENCH_SPEC, name="inplace-qwen2moe-8x2", n_layer=2, n_embd=256, n_head=4,
                               n_head_kv=4, n_ctx=256, n_ff=512, n_expert=8, n_expert_used=2, n_ff_exp=256,
                               n_ff_shexp=256)
    path = synth.build_model(spec, tmp_path / "inplace.gguf")
    info = pymoecache.model_info(path)
    one = 256 * 256 // 32 * 34  # a Q8_0 [256, 256] expert: 17 pages
    assert info.expert_bytes == 3 * one
    pad = info.slot_bytes - info.expert_bytes
    assert pad > 0 and pad % 4096 == 0, "the model should start its expert tensors mid-page"
    ref, st_ref = run(path, "none", "lru", 3)
    got, st = run(path, "stream", "lru", 3)
    assert np.array_equal(got, ref), f"max |diff| = {np.abs(got - ref).max()}"
    rs = st.residency
    assert st.misses == st_ref.misses > 0 and rs.direct_io
    n_slots = int(np.maximum(st.capacity_per_layer, 2).sum())
    assert rs.arena_bytes == pytest.approx(n_slots * info.slot_bytes, abs=len(st.capacity_per_layer) * 3 * 4096)
    assert rs.decode_bytes_read == pytest.approx(st.misses * info.slot_bytes)  # the windows, read once each
    # a byte budget holds the padded slots
    budget = int(5 * info.slot_bytes * info.n_moe_layer) - 1
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=f"{budget}B", residency="stream", prefetch="off"), **KW)
    assert llm.moe_stats().capacity_per_layer.tolist() == [4, 4]
    assert llm.moe_stats().residency.arena_bytes <= budget
    llm.close()
    # the default prefetch ("auto") reads ahead into 2 spare slots per layer, paid for by the budget,
    # where 2K experts per layer stay cached (6 slots: 4 + 2); with 4 slots it is off
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=f"{budget}B", residency="stream"), **KW)
    assert llm.moecache.prefetch == "off"
    assert llm.moe_stats().capacity_per_layer.tolist() == [4, 4]
    llm.close()
    budget = int(7 * info.slot_bytes * info.n_moe_layer) - 1
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=f"{budget}B", residency="stream"), **KW)
    assert llm.moecache.prefetch == "gate"
    assert llm.moe_stats().capacity_per_layer.tolist() == [4, 4]
    assert llm.moe_stats().residency.arena_bytes <= budget
    llm.close()


def test_auto_residency_and_sizes(fixture_dir):
    path = model_path(fixture_dir, "qwen2moe-60x4")
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=1.0), **KW)
    assert llm.moe_stats().residency.residency == "none"  # everything fits: nothing to stream
    llm.close()
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.5), **KW)
    assert llm.moe_stats().residency.residency == "stream"
    llm.close()
    # auto size: a count from the free memory, at most N
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size="auto"), **KW)
    llm.eval(PROMPT)
    assert llm.moe_stats().capacity_per_layer.tolist() == [60] * 4  # a 15 MB model fits in any free memory
    llm.close()


def test_budget_too_small_to_stream_is_an_error(fixture_dir):
    path = model_path(fixture_dir, "qwen2moe-60x4")
    info = pymoecache.model_info(path)
    budget = int(2 * info.expert_bytes * info.n_moe_layer)  # 2 experts per layer, K = 4
    with pytest.raises(pymoecache.ConfigError, match="streaming needs at least K = 4"):
        pymoecache.Llama(str(path), cache=CacheConfig(size=f"{budget}B", residency="stream"), **KW)
    with pytest.raises(pymoecache.ConfigError, match="residency must be one of"):
        CacheConfig(residency="disk")


def test_streaming_needs_the_model_file(fixture_dir, tmp_path):
    """A moecache asked to stream from a file that is not the model's is refused with a reason."""
    path = model_path(fixture_dir, "qwen2moe-60x4")
    other = model_path(fixture_dir, "olmoe-64x8")
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.5, residency="none"), **KW)
    wrong = dataclasses.replace(pymoecache.model_info(path), path=str(other))
    with pytest.raises((pymoecache.ConfigError, pymoecache.MoECacheError), match="not stored as in the file"):
        pymoecache.MoECache.for_model(llm._model.model, wrong, cache=CacheConfig(size=0.5, residency="stream"),
                                      routing="lru")
    llm.close()


FAULT_SCRIPT = r"""
import os, sys
import pymoecache
from pymoecache import CacheConfig, Llama
path, cut, residency = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = Llama(path, cache=CacheConfig(size=4, residency=residency), routing="lru", n_ctx=256, verbose=False, seed=1)
llm.eval(list(range(300, 310)))
for t in range(4):
    llm.eval([1000 + t])
os.truncate(path, cut)  # the experts of the last layers are gone; every other tensor is intact
try:
    for t in range(200):
        llm.eval([400 + t])
except pymoecache.MoECacheIOError as e:
    print("IOERROR:", e)
    sys.exit(3)
print("no error")
"""


@pytest.mark.parametrize("residency", ["stream", "mmap"])
def test_truncated_model_file_is_a_clear_error(tmp_path, residency):
    path = tmp_path / "experts-last.gguf"
    synth.build_model(synth.FIXTURES["qwen2moe-60x4"], path, experts_last=True)
    info = pymoecache.model_info(path)
    # cut in the middle of the expert bytes: the last layers' experts can no longer be read
    cut = info.file_bytes - info.expert_bytes_total // 4
    r = subprocess.run([sys.executable, "-c", FAULT_SCRIPT, str(path), str(cut), residency], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 3, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
    assert "truncated" in r.stdout or "ends early" in r.stdout, r.stdout
    assert str(path) in r.stdout


def test_mlock_refused_warns_once_and_runs_unlocked(fixture_dir):
    """With RLIMIT_MEMLOCK at 64 KiB and no CAP_IPC_LOCK, mlock fails: one warning with the fix."""
    if not (shutil.which("prlimit") and shutil.which("setpriv")):
        pytest.skip("needs prlimit and setpriv (util-linux)")
    path = model_path(fixture_dir, "qwen2moe-60x4")
    code = ("import pymoecache; llm = pymoecache.Llama(%r, cache=pymoecache.CacheConfig(size=0.5, residency='stream'), "
            "routing='lru', n_ctx=128, verbose=False); llm.eval(list(range(300, 310))); "
            "[llm.eval([t]) for t in range(500, 520)]; rs = llm.moe_stats().residency; "
            "print('locked', rs.locked, 'tokens', rs.decode_tokens)" % str(path))
    cmd = ["prlimit", "--memlock=65536:65536", "setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--",
           sys.executable, "-c", code]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    if r.returncode != 0 and "setpriv" in r.stderr:
        pytest.skip(f"cannot drop CAP_IPC_LOCK here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "locked False tokens" in r.stdout and int(r.stdout.split()[-1]) >= 20
    assert r.stderr.count("mlock of the expert cache") == 1
    assert r.stderr.count("mlock of the model's dense part") == 1
    assert "ulimit -l unlimited" in r.stderr


def test_cli_run_stream_stats_line(fixture_dir):
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(model_path(fixture_dir, "qwen2moe-60x4")),
                        "-n", "16", "--prior", "0.5", "--cache-size", "0.25", "--residency", "stream", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    import json

    res = json.loads(r.stdout)
    assert res["residency"] == "stream"
    assert res["bytes_read_per_token"] > 0 and res["rss_bytes"] > 0 and res["arena_bytes"] > 0
    assert res["t_io_ms_per_token"] >= 0 and res["t_compute_ms_per_token"] > 0
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(model_path(fixture_dir, "qwen2moe-60x4")),
                        "-n", "4", "--cache-size", "100KiB", "--residency", "stream"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "streaming needs at least K" in r.stderr


def test_buffered_reads_where_direct_io_is_off_or_unsupported(fixture_dir, tmp_path):
    """direct_io=False, and a file system without O_DIRECT (tmpfs): buffered reads, same logits."""
    path = model_path(fixture_dir, "mixtral-8x2")
    ref, st_ref = run(path, "none", "prior:0.5", 3)
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=3, residency="stream", direct_io=False, io_threads=1, prefetch="off"),
                           routing="prior:0.5", **KW)
    llm.eval(PROMPT)
    for t in DECODES:
        llm.eval([t])
    assert np.array_equal(np.array(llm.scores[: len(PROMPT) + len(DECODES)]), ref)
    assert not llm.moe_stats().residency.direct_io
    llm.close()
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        copy = shm / f"pymoecache-test-{os.getpid()}.gguf"
        shutil.copy(path, copy)
        try:
            got, st = run(copy, "stream", "prior:0.5", 3)
            assert np.array_equal(got, ref) and st.residency.decode_loads == st.misses > 0
        finally:
            copy.unlink()


def expert_pages_in_page_cache(path) -> dict:
    """{layer: pages of the file that lie wholly inside one expert's bytes and are in the page cache}"""
    import ctypes
    import mmap

    from gguf import GGUFReader

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    ps = mmap.PAGESIZE
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    vec = (ctypes.c_ubyte * ((size + ps - 1) // ps))()
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
    libc.munmap(addr, size)
    pages = {}
    for t in GGUFReader(str(path)).tensors:
        if not t.name.endswith("_exps.weight"):
            continue
        il = int(t.name.split(".")[1])
        n_expert = int(t.shape[-1])
        nb2 = int(t.n_bytes) // n_expert
        for e in range(n_expert):
            b0 = int(t.data_offset) + e * nb2
            first, end = -(-b0 // ps), (b0 + nb2) // ps
            pages[il] = pages.get(il, 0) + sum(vec[p] & 1 for p in range(first, end))
    return pages


def test_prompt_read_ahead_leaves_no_expert_in_the_page_cache(fixture_dir):
    """A prompt streams its experts through the model's mapping, reading the next MoE layers' ahead
    on the reader threads (ubatches of 32 tokens x K = 128 selections >= 60 experts). What it read
    is dropped from memory and the page cache once its layer ran: after the prompt only the last
    layer's experts are still in, and after one decode none. (The first MoE layer is not read
    ahead; the kernel's own readahead of the router weights just before its experts can bring a
    few of them in, which no drop of ours covers, so it is left out. The locked dense part keeps
    the few expert pages that share a page-cache folio with it: those are counted after the load
    and allowed.)"""
    path = model_path(fixture_dir, "qwen2moe-60x4")

    def drop_file():
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (clean pages: dropped at once)
        os.close(fd)

    drop_file()
    assert sum(expert_pages_in_page_cache(path).values()) == 0
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.25, residency="stream"), routing="lru", **KW)
    after_load = expert_pages_in_page_cache(path)
    drop_file()
    pinned = expert_pages_in_page_cache(path)  # next to the locked dense part
    # what the kernel read around the locked pages at load was dropped (all but those folios)
    assert all(n <= 16 for n in after_load.values()) and all(n <= 16 for n in pinned.values()), (after_load, pinned)
    llm.eval(list(range(300, 396)))  # 3 ubatches
    after_prompt = expert_pages_in_page_cache(path)
    first, last = min(after_prompt), max(after_prompt)
    assert after_prompt[last] > pinned[last], after_prompt
    assert all(n == pinned[il] for il, n in after_prompt.items() if first < il < last), (after_prompt, pinned)
    llm.eval([1000])
    after_decode = expert_pages_in_page_cache(path)
    assert all(n == pinned[il] for il, n in after_decode.items() if il > first), (after_decode, pinned)
    llm.close()


@pytest.mark.parametrize("residency", ["stream", "mmap"])
def test_a_prompt_layer_reads_only_the_experts_its_ubatch_selected(fixture_dir, residency):
    """A prompt layer that was not read ahead (the first MoE layer) asks the kernel for its experts once
    its routing is known: only those its ubatch selected, since the matmul reads no other. 16 tokens x 4
    = 64 selections of 60 experts (enough to count as a prompt that touches a layer's experts) choose about
    40 distinct; before, all 60 were read."""
    from pymoecache.timeline import KIND

    path = model_path(fixture_dir, "qwen2moe-60x4")
    kw = dict(KW, n_batch=16, n_ubatch=16)
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.25, residency=residency, prefetch="off", trace=4096),
                           routing="lru", **kw)
    llm.start_timeline()
    llm.eval(list(range(300, 316)))  # one ubatch
    ev, trace = llm.timeline().events, llm.moecache.trace()
    first = min(llm.model_info.moe_layers)
    rec = trace[trace["layer"] == first]
    assert len(rec) == 16, len(rec)
    selected = {int(e) for r in rec for e in r["experts"][: r["n_selected"]]}
    asked = set(ev[(ev["kind"] == KIND["read_ahead"]) & (ev["layer"] == first)]["expert"].tolist())
    assert len(selected) < 60 and asked, (len(selected), asked)
    if residency == "mmap":  # (MMAP locks the cached experts: those are not asked for)
        asked |= set(llm.moecache.cached(first))
    assert asked <= selected, sorted(asked - selected)
    assert len(asked) >= len(selected) - len(llm.moecache.cached(first)), (asked, selected)
    llm.close()


def _vm_locked() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no VmLck in /proc/self/status")


@pytest.mark.parametrize("residency", ["stream", "mmap"])
@pytest.mark.parametrize("name", ["qwen2moe-60x4", "mixtral-8x2"])
def test_dense_part_is_locked(fixture_dir, name, residency):
    """lock_dense mlocks every mapped weight but the routed experts, and the token-embedding table
    only where the output reuses it (mixtral-8x2 has no output.weight, qwen2moe-60x4 has one); the
    lock is the process's (VmLck) and goes with the model; lock_dense=False locks nothing of it."""
    import gguf

    path = model_path(fixture_dir, name)
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    tied = "output.weight" not in tensors
    dense = [n for k, n in tensors.items() if "_exps." not in k and (tied or k != "token_embd.weight")]
    want = sum(dense)
    page = os.sysconf("SC_PAGE_SIZE")
    base = _vm_locked()
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.5, residency=residency), routing="lru",
                           n_ctx=64, verbose=False)
    llm.eval(list(range(300, 308)))
    rs = llm.moe_stats().residency
    # page-rounded ranges of the tensors, neighbours merged: at least their bytes, at most two pages more each
    assert want <= rs.dense_locked_bytes <= want + 2 * page * len(dense), (rs.dense_locked_bytes, want)
    assert rs.dense_locked_bytes % page == 0
    assert _vm_locked() - base >= rs.dense_locked_bytes + rs.locked_bytes - page
    assert f"dense part {rs.dense_locked_bytes / 2**20:.0f} MiB locked" in rs.summary()
    llm.close()
    assert _vm_locked() == base
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.5, residency=residency, lock_dense=False),
                           routing="lru", n_ctx=64, verbose=False)
    assert llm.moe_stats().residency.dense_locked_bytes == 0
    assert "dense part" not in llm.moe_stats().residency.summary()
    llm.close()


def test_dense_lock_is_shared_by_the_caches_of_one_model(fixture_dir):
    """A second moecache on the same model shares the dense lock: closing it keeps the first one's."""
    from pymoecache.llama import MoECache

    path = model_path(fixture_dir, "qwen2moe-60x4")
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.5, residency="mmap"), routing="lru", n_ctx=64,
                           verbose=False)
    locked = _vm_locked()
    dense = llm.moe_stats().residency.dense_locked_bytes
    assert dense > 0
    second = MoECache.for_model(llm._model.model, llm.model_info, cache=CacheConfig(size=0.5, residency="mmap"),
                                routing="lru")
    assert second.residency_stats().dense_locked_bytes == dense
    second.close()
    assert _vm_locked() == locked and llm.moe_stats().residency.dense_locked_bytes == dense
    llm.close()


def test_explicit_cache_size_that_leaves_no_room_warns(fixture_dir, monkeypatch):
    """An explicit size whose slots, dense part, KV cache and runtime exceed the free memory runs,
    with a warning that says what each takes; one that fits says nothing."""
    import warnings

    import pymoecache.plan as llama_module

    path = model_path(fixture_dir, "qwen2moe-60x4")
    info = pymoecache.model_info(path)
    dense = llama_module._on_host(info, 64, 0)[0]  # (the dense part the plan counts)
    monkeypatch.setattr(llama_module, "_available_memory", lambda: dense + (64 << 20))
    with pytest.warns(UserWarning, match=r"cache size 30 leaves no room: .* MiB of expert slots \+ .* dense part"):
        llm = pymoecache.Llama(str(path), cache=CacheConfig(size=30, residency="stream"), n_ctx=64, verbose=False)
    llm.eval(list(range(300, 304)))
    llm.close()
    monkeypatch.setattr(llama_module, "_available_memory", lambda: 8 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pymoecache.Llama(str(path), cache=CacheConfig(size=30, residency="stream"), n_ctx=64, verbose=False).close()


@pytest.mark.parametrize("residency", ["stream", "mmap"])
def test_a_cleared_cache_reads_as_a_fresh_one(fixture_dir, residency):
    """Issue 53 item 11: after clear() a row's first misses were not all read again (the slots still held
    their bytes): the same row three times in one process gave the same misses but fewer reads after the
    first, and the tables that ran several rows per process undercounted their bytes. Three rows after
    clear() read what a fresh cache reads, token for token."""
    path = str(model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0"))
    tokens = [(t * 37) % 500 + 10 for t in range(24)]

    def row(llm):
        llm.moecache.clear()
        llm.reset_moe_stats()
        llm.reset()
        llm.eval(tokens[:8])
        for t in tokens[8:]:
            llm.eval([t])
        st = llm.moe_stats()
        return st.misses, st.residency.decode_loads, st.residency.decode_bytes_read

    cache = CacheConfig(size=0.25, residency=residency, prefetch="off", lock_memory=False)
    fresh = pymoecache.Llama(path, cache=cache, routing="lru", n_ctx=64, verbose=False)
    first = row(fresh)
    fresh.close()
    llm = pymoecache.Llama(path, cache=cache, routing="lru", n_ctx=64, verbose=False)
    rows = [row(llm) for _ in range(3)]
    llm.close()
    assert first[0] > 0 and (residency == "mmap" or first[1] > 0)
    assert rows == [first] * 3, (first, rows)
