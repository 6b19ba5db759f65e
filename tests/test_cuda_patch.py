"""patches/0004 (ggml-cuda's buffer_from_host_ptr) compiles: scripts/check_cuda_patch.py fetches NVIDIA's compiler
and headers from PyPI and compiles the patched ggml-cuda.cu, as a user's CUDA build would (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT


def test_the_cuda_patch_compiles():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_cuda_patch.py")], capture_output=True, text=True,
                       timeout=1800)
    if r.returncode == 2:
        pytest.skip("no CUDA toolkit from PyPI here: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ggml-cuda.cu with patches/0004 compiles" in r.stdout, r.stdout
