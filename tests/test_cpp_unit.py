"""Compile tests/cpp/test-moecache.cpp against the built libllama and run it."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from pymoecache._lib import find_lib_dir
from conftest import ROOT


def test_cpp_unit_tests(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    lib_dir = find_lib_dir()
    exe = tmp_path / "test-moecache"
    cmd = [cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1", str(ROOT / "tests/cpp/test-moecache.cpp"),
           f"-I{ROOT / 'src_cpp'}", f"-L{lib_dir}", "-lllama", f"-Wl,-rpath,{lib_dir}", "-o", str(exe)]
    subprocess.run(cmd, check=True)
    r = subprocess.run([str(exe)], cwd=tmp_path, capture_output=True, text=True)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("0 failed")


def test_io_queue_unit_tests(tmp_path):
    """The reader queue alone (src_cpp/moecache-io.cpp): priorities, promotion, cancellation, errors."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "test-io-queue"
    cmd = [cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread", str(ROOT / "tests/cpp/test-io-queue.cpp"),
           str(ROOT / "src_cpp/moecache-io.cpp"), f"-I{ROOT / 'src_cpp'}", "-o", str(exe)]
    subprocess.run(cmd, check=True)
    r = subprocess.run([str(exe)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("0 failed")
