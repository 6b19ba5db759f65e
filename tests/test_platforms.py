"""Platform pieces that run everywhere: tools/moecache-run (the C++ driver used under qemu, adb
shell and Termux) agrees with the Python package; src_cpp compiles warning-free with every
compiler installed here; the Android script explains a missing NDK.

The aarch64 cross build itself runs in scripts/test_aarch64.sh (several minutes), not here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import pymoecache
import llama_cpp
from pymoecache import CacheConfig
from pymoecache._lib import find_lib_dir
from conftest import ROOT, model_path

PROMPT = "Once upon a time, in a land far away"
N_GEN = 12


@pytest.fixture(scope="module")
def moecache_run(tmp_path_factory):
    """tools/moecache-run built for this machine against the package's libllama."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    lib = find_lib_dir()
    exe = tmp_path_factory.mktemp("tools") / "moecache-run"
    v = ROOT / "vendor" / "llama.cpp"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", str(ROOT / "tools/moecache-run.cpp"),
                    f"-I{ROOT / 'src_cpp'}", f"-I{v / 'include'}", f"-I{v / 'ggml/include'}", f"-L{lib}",
                    "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(exe)], check=True)
    return exe


def parse_report(text: str) -> dict:
    gen = [int(m.group(1)) for m in re.finditer(r"^gen \d+ (\d+)$", text, re.M)]
    sel = {}
    for m in re.finditer(r"^sel L=(\d+) T=(\d+) (\S+) hit=([01]+) topk=([01]+)$", text, re.M):
        sel[(int(m.group(1)), int(m.group(2)))] = ([int(x) for x in m.group(3).split(",")], m.group(4))
    layers = {int(m.group(1)): (int(m.group(2)), int(m.group(3)))
              for m in re.finditer(r"^layer (\d+) tokens=\d+ hits=(\d+) misses=(\d+)", text, re.M)}
    return {"gen": gen, "sel": sel, "layers": layers}


@pytest.mark.parametrize("name,routing,cache,residency", [
    ("qwen2moe-60x4", "prior:0.5", 0.5, "stream"),
    ("mixtral-8x2", "max-rank:3", 0.5, "mmap"),
    ("deepseek2-sigmoid-64x6", "lru", 0.25, "none"),
])
def test_moecache_run_matches_the_python_package(fixture_dir, moecache_run, name, routing, cache, residency):
    """The same tokens, selections and counters, whatever the residency of either side (the
    Python package streams: its default for a cache smaller than all experts)."""
    path = model_path(fixture_dir, name, ".Q8_0")
    r = subprocess.run([str(moecache_run), "-m", str(path), "-p", PROMPT, "-n", str(N_GEN), "-t", "2",
                        "--cache", str(cache), "--routing", routing, "--trace", "--residency", residency],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (f"{residency}: read" in r.stderr) == (residency != "none"), r.stderr
    cpp = parse_report(r.stdout)
    assert len(cpp["gen"]) == N_GEN and cpp["sel"]

    # the same run through pymoecache.Llama: prompt as one batch, then greedy one token at a time,
    # logits of the last position only. Both run without flash attention (llama-cpp-python's
    # default; moecache-run's too), else near-ties in the router flip and the runs part ways. No reads
    # ahead: moecache-run has none, and the prior counts the package's (tests/test_prefetch.py).
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=cache, trace=100_000, prefetch="off"), routing=routing,
                           n_ctx=512, n_batch=512, n_threads=2, verbose=False)
    tokens = llm.tokenize(PROMPT.encode(), add_bos=True)
    llm.eval(tokens)
    gen = []
    for _ in range(N_GEN):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        nxt = int(np.argmax(logits))
        gen.append(nxt)
        llm.eval([nxt])
    assert gen == cpp["gen"]

    py_sel = {}
    for rec in llm.moecache.trace():
        n = int(rec["n_selected"])
        bits = "".join("1" if (int(rec["hit_mask"]) >> i) & 1 else "0" for i in range(n))
        py_sel[(int(rec["layer"]), int(rec["token"]))] = ([int(x) for x in rec["experts"][:n]], bits)
    assert py_sel == cpp["sel"]
    st = llm.moe_stats()
    py_layers = {int(il): (int(h), int(m)) for il, h, m in zip(st.moe_layers, st.hits_per_layer, st.misses_per_layer)}
    assert py_layers == cpp["layers"]
    llm.close()


def test_moecache_run_rejects_bad_input(moecache_run, tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"hello")
    for args, msg in (([], "no model"), (["-m", str(bad)], "cannot load"),
                      (["-m", str(bad), "--routing", "prior"], "bad --routing"),
                      (["-m", str(bad), "--cache", "1.5"], "bad --cache")):
        r = subprocess.run([str(moecache_run), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr[-300:])


def test_src_cpp_compiles_warning_free_with_the_installed_compilers():
    r = subprocess.run(["bash", str(ROOT / "scripts/check_warnings.sh")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "clean " in r.stdout


def test_build_android_explains_a_missing_ndk(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANDROID_NDK")}
    r = subprocess.run(["bash", str(ROOT / "scripts/build_android.sh")], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "set ANDROID_NDK" in r.stderr
    r = subprocess.run(["bash", str(ROOT / "scripts/build_android.sh")], capture_output=True, text=True,
                       env={**env, "ANDROID_NDK": str(tmp_path)})
    assert r.returncode == 2 and "is not an NDK" in r.stderr


def test_compare_traces_tells_a_near_tie_from_a_real_difference(fixture_dir, moecache_run, tmp_path):
    """scripts/compare_traces.py (test_aarch64.sh's judge for F16 cases) on real reports: a run
    against itself is the same; the same run with one selection flipped parts at a near-tie (equal
    router logits); the F16 model against its Q8_0 copy differs (logits apart by more than rounding)."""
    def report(variant, out):
        r = subprocess.run([str(moecache_run), "-m", str(model_path(fixture_dir, "qwen2moe-60x4", variant)), "-p", PROMPT,
                            "-n", "8", "-t", "2", "--cache", "0.5", "--routing", "prior:0.5", "--trace"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out.write_text(r.stdout)
        return out

    a, a2, q = report("", tmp_path / "a.txt"), report("", tmp_path / "a2.txt"), report(".Q8_0", tmp_path / "q.txt")
    text = a.read_text()
    assert re.search(r"^z L=\d+ T=0 -?\d", text, re.M)  # the router logits are in the report
    flipped = tmp_path / "flipped.txt"
    m = re.search(r"^sel L=(\d+) T=5 (\d+),(\d+),", text, re.M)
    flipped.write_text(text.replace(m.group(0), f"sel L={m.group(1)} T=5 {m.group(3)},{m.group(2)},", 1))

    def judge(x, y):
        r = subprocess.run([sys.executable, str(ROOT / "scripts/compare_traces.py"), str(x), str(y)],
                           capture_output=True, text=True, timeout=60)
        return r.returncode, r.stdout

    assert judge(a, a2)[0] == 0 and judge(a, a2)[1].startswith("same")
    rc, out = judge(a, flipped)
    assert rc == 0 and out.startswith(f"near-tie at L={m.group(1)} T=5"), out
    rc, out = judge(a, q)
    assert rc == 1 and out.startswith("differ: router logits part"), out
