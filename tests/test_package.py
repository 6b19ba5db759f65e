"""Importing pymoecache loads our patched libllama, and llama_cpp runs on it."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import llama_cpp

import pymoecache
from pymoecache import _moecache_cpp as C
from conftest import ROOT


def test_llama_cpp_runs_on_our_library():
    lib = llama_cpp.llama_cpp._lib
    assert lib is C.lib
    # a moecache symbol resolves in the very library llama_cpp loaded
    assert ctypes.cast(lib.moecache_abi_version, ctypes.c_void_p).value
    assert C.moecache_abi_version() == C.MOECACHE_ABI_VERSION
    lib_dir = Path(os.environ["LLAMA_CPP_LIB_PATH"])
    assert (lib_dir / "libllama.so").exists() or (lib_dir / "libllama.dylib").exists()


def test_native_version_names_the_pin():
    v = pymoecache.native_version()
    assert v.startswith("pymoecache ") and "llama-cpp-python 0.3.36" in v


def test_library_not_found_is_a_clear_import_error(tmp_path):
    env = dict(os.environ, PYMOECACHE_LIB_DIR=str(tmp_path))
    env.pop("LLAMA_CPP_LIB_PATH", None)
    r = subprocess.run([sys.executable, "-c", "import pymoecache"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "PYMOECACHE_LIB_DIR" in r.stderr


def test_default_params_match_the_header():
    cp = C.moecache_cache_default_params()
    rp = C.moecache_routing_default_params()
    assert (cp.n_cached, cp.fraction, cp.insertion, cp.update_on_prompt, cp.trace_capacity) == (-1, 0.5, 0, True, 0)
    assert (rp.policy, rp.top_j, rp.max_rank, rp.prune_rank, rp.scope) == (C.MOECACHE_POLICY_TOPK, 1, 8, 2, 0)
    assert abs(rp.prior_lambda - 0.5) < 1e-7 and abs(rp.cumsum_tau - 0.9) < 1e-7
