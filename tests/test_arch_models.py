"""Every MoE architecture of the pinned llama.cpp passes our door and runs the same streamed.

tools/arch-models/make-arch-models.cpp writes one random-weight model per architecture with
llama.cpp's own model builder (16 experts, 4 used). For each: ``model_info`` accepts what
llama.cpp's loader accepts (a validation that refuses a loadable file is a defect, issue 25 item 2),
counts as expert bytes exactly the expert matrices the cache moves, and with top-k routing and a
cache of half the experts, stream and mmap give logits bit-identical to stock llama.cpp and to
resident experts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import llama_cpp

import pymoecache
from pymoecache._lib import find_lib_dir
from pymoecache.model_info import model_info
from conftest import FIXTURE_DIR, ROOT

ARCH_DIR = FIXTURE_DIR / "archs"
TOOL = ROOT / "tools" / "arch-models" / "make-arch-models.cpp"
N_EXPERT, N_USED = 16, 4

# llama-cpp-python's Llama cannot evaluate these (no KV memory: diffusion models); model_info and
# the load are still checked
NOT_EVALUATED = {"llada-moe": "diffusion model", "rnd1": "diffusion model"}
# the pin's graph for these runs a dense FFN even when the file has expert tensors: the hook sees no routing
NO_ROUTING = {"refact"}
# the pin's builder writes the expert keys but no expert tensors for these: dense models
DENSE = {"ernie4_5", "paddleocr"}

KW = dict(n_ctx=64, n_batch=16, n_ubatch=16, logits_all=True, verbose=False, n_threads=2, seed=1)
TOKENS = [(7 * i + 3) % 128 for i in range(22)]  # a 16-token prompt batch, then 6 single-token decodes


@pytest.fixture(scope="module")
def arch_models() -> dict:
    """{architecture: path}, built once (a few seconds) into tests/fixtures/models/archs."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    lib_dir = find_lib_dir()
    stamp = ARCH_DIR / "made-by.txt"
    key = f"{TOOL.stat().st_mtime_ns} {(lib_dir / 'libllama.so').stat().st_mtime_ns} {N_EXPERT} {N_USED}\n"
    if not stamp.exists() or stamp.read_text().splitlines()[0] != key.strip():
        shutil.rmtree(ARCH_DIR, ignore_errors=True)
        ARCH_DIR.mkdir(parents=True)
        exe = ARCH_DIR / "make-arch-models"
        vendor = ROOT / "vendor" / "llama.cpp"
        subprocess.run([cxx, "-std=c++17", "-O1", "-w", str(TOOL), f"-I{TOOL.parent / 'shim'}",
                        f"-I{vendor / 'include'}", f"-I{vendor / 'ggml' / 'include'}", f"-I{vendor / 'src'}",
                        f"-L{lib_dir}", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib_dir}", "-o", str(exe)],
                       check=True)
        r = subprocess.run([str(exe), str(ARCH_DIR), str(N_EXPERT), str(N_USED)], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        stamp.write_text(key + r.stdout)
    out = {}
    for line in stamp.read_text().splitlines()[1:]:
        m = re.match(r"ok (\S+) (\S+)$", line)
        if m:
            out[m.group(1)] = Path(m.group(2))
    return out


def _logits(llm) -> np.ndarray:
    llm.reset()
    llm.eval(TOKENS[:16])
    for t in TOKENS[16:]:
        llm.eval([t])
    return np.array(llm.scores[: len(TOKENS)])


def test_every_moe_architecture_of_the_pin_is_written(arch_models):
    # the pin has 51 architectures that route experts (plus the dense and diffusion ones above):
    # a shrinking list would mean the builder or the pin changed under us
    assert len(arch_models) >= 55, sorted(arch_models)
    for name in ("gpt-oss", "qwen3moe", "deepseek2", "mixtral" if "mixtral" in arch_models else "llama", "olmoe"):
        assert name in arch_models


def test_model_info_accepts_every_architecture_and_counts_the_matrices(arch_models):
    import gguf

    refused = {}
    for arch, path in sorted(arch_models.items()):
        try:
            info = model_info(path)
        except pymoecache.ModelFileError as e:
            refused[arch] = str(e)
            continue
        # expert bytes = the 3-D .weight matrices only; biases and scales stay with the dense part
        r = gguf.GGUFReader(str(path))
        matrices = sum(int(t.n_bytes) for t in r.tensors if re.match(r"blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight$", t.name))
        assert info.expert_bytes_total == matrices, arch
        if arch in DENSE:
            assert not info.is_moe, arch
        else:
            assert info.is_moe and info.n_expert == N_EXPERT and info.n_expert_used == N_USED, arch
    assert not refused, refused


def test_gpt_oss_biases_are_accepted_and_a_wrong_one_refused(arch_models, tmp_path):
    """The per-expert bias of gpt-oss ([n_ff, n_expert]) passes; one whose last dimension is not
    the expert count is refused, as llama.cpp's loader refuses it."""
    from gguf_edit import Gguf

    path = arch_models["gpt-oss"]
    assert model_info(path).is_moe
    g = Gguf.parse(path.read_bytes())
    bias = g.tensor("blk.0.ffn_gate_exps.bias")
    assert bias.shape[-1] == N_EXPERT and len(bias.shape) == 2
    bias.shape = [bias.shape[0] * 2, bias.shape[1] // 2]   # the same bytes, no longer one entry per expert
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(g.to_bytes())
    with pytest.raises(pymoecache.ModelFileError, match="ffn_gate_exps.bias"):
        model_info(bad)
    assert llama_cpp.llama_model_load_from_file(str(bad).encode(), llama_cpp.llama_model_default_params()) is None


def test_stream_and_mmap_are_bit_identical_to_stock_on_every_architecture(arch_models):
    failures, routed = {}, []
    for arch, path in sorted(arch_models.items()):
        if arch in NOT_EVALUATED:
            llm = pymoecache.Llama(str(path), cache=pymoecache.CacheConfig(size=0.5), **KW)  # loads, at least
            llm.close()
            continue
        stock = llama_cpp.Llama(str(path), **KW)
        ref = _logits(stock)
        stock.close()
        if not np.isfinite(ref).all():
            failures[arch] = "stock llama.cpp gives non-finite logits"
            continue
        if arch in DENSE:
            continue
        for residency in ("none", "stream", "mmap"):
            llm = pymoecache.Llama(str(path), cache=pymoecache.CacheConfig(size=0.5, residency=residency),
                                   routing="topk", **KW)
            got = _logits(llm)
            st = llm.moe_stats()
            llm.close()
            if not np.array_equal(got, ref):
                failures[f"{arch}/{residency}"] = f"max |diff| {np.abs(got - ref).max()}"
            if residency == "stream" and arch not in NO_ROUTING:
                # the cache really ran: every MoE layer saw every token (grovemoe routes twice a
                # layer), with half the experts cached some missed
                if st.tokens_per_layer.min() < len(TOKENS) or st.misses == 0:
                    failures[f"{arch}/{residency}"] = f"the hook did not run: {st.tokens_per_layer.tolist()}"
                else:
                    routed.append(arch)
    assert not failures, failures
    assert len(routed) >= 50, routed


def test_the_architectures_doc_lists_every_architecture(arch_models):
    """docs/architectures.md is what scripts/gen_architectures.py writes from these models: every
    MoE architecture of the pin, none missing, none made up."""
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_architectures.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    listed = set(re.findall(r"^\| `([\w.-]+)` \|", (ROOT / "docs" / "architectures.md").read_text(), re.M))
    moe = {model_info(p).arch for p in arch_models.values() if model_info(p).is_moe}
    assert listed == moe and len(listed) >= 50
