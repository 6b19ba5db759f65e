"""Our shared libraries export no copy of the C++ runtime.

A CUDA build on a machine whose toolkit links libstdc++ statically (nvcc 13.0 with its own gcc)
made libggml-cuda.so export std::ostream & co.; the dynamic linker bound libllama's calls to that
copy, and every model load crashed. CMakeLists.txt links every shared library with
-Wl,--exclude-libs,ALL. These tests check the built libraries, and check on a library made the
way that toolkit made it that the check finds such a copy and that the flag removes it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pymoecache._lib import find_lib_dir

pytestmark = pytest.mark.skipif(sys.platform != "linux" or not shutil.which("nm") or not shutil.which("ldd"),
                                reason="ELF libraries, nm and ldd (Linux)")


def strong_text_symbols(lib: Path) -> set[str]:
    """The functions a library exports as its own (nm type T, without a @VERSION): template code a
    library instantiates for itself is weak (W), and may be in ours and libstdc++ both."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return {f[2].split("@")[0] for f in (line.split() for line in out.splitlines()) if len(f) == 3 and f[1] == "T"}


def libstdcxx() -> Path:
    """The libstdc++ our libllama loads."""
    out = subprocess.run(["ldd", str(find_lib_dir() / "libllama.so")], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        if "libstdc++" in line and "=>" in line:
            return Path(line.split("=>")[1].split()[0])
    pytest.skip("libllama.so is not linked with a shared libstdc++")


def runtime_copies(lib: Path) -> set[str]:
    return strong_text_symbols(lib) & strong_text_symbols(libstdcxx())


def test_no_library_exports_the_cxx_runtime():
    libs = sorted(find_lib_dir().glob("lib*.so"))
    assert any(p.name == "libllama.so" for p in libs)
    for lib in libs:
        copies = runtime_copies(lib)
        assert not copies, f"{lib.name} exports {len(copies)} functions of libstdc++, e.g. {sorted(copies)[:3]}"


def test_exclude_libs_keeps_a_static_runtime_private(tmp_path):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    src = tmp_path / "f.cpp"
    src.write_text('#include <sstream>\n#include <string>\n'
                   'extern "C" int f(long x) { std::ostringstream s; s << x; return (int) s.str().size(); }\n')
    made = {}
    for name, extra in (("static", []), ("private", ["-Wl,--exclude-libs,ALL"])):
        out = tmp_path / f"lib{name}.so"
        r = subprocess.run([cxx, "-shared", "-fPIC", "-O2", "-static-libstdc++", str(src), "-o", str(out), *extra],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"g++ cannot link libstdc++ statically here: {r.stderr[-300:]}")
        made[name] = out
    assert len(runtime_copies(made["static"])) > 100  # std::logic_error::what and hundreds more
    assert runtime_copies(made["private"]) == set()
    assert "f" in strong_text_symbols(made["private"])  # the library's own function is still exported
