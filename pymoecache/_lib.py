"""Find our patched libllama and make llama-cpp-python load it.

llama-cpp-python loads ``libllama`` from ``$LLAMA_CPP_LIB_PATH`` when that is set. We set it to
the directory of our build before ``llama_cpp`` is imported, then check that the library it
loaded exports the moecache API (``moecache_abi_version``).

Search order for the library directory:
1. ``$PYMOECACHE_LIB_DIR``
2. ``pymoecache/lib`` next to this file (an installed wheel)
3. ``build/cp*/bin`` of a source checkout (scikit-build-core's build dirs, named by wheel tag),
   newest first, for this machine's architecture only (``build/aarch64`` of
   scripts/test_aarch64.sh is a cross build and is never picked)
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from .errors import MissingDependencyError

_PKG_DIR = Path(__file__).resolve().parent
_LIB_NAME = {"darwin": "libllama.dylib", "win32": "llama.dll"}.get(sys.platform, "libllama.so")


def find_lib_dir() -> Path:
    """Directory holding our libllama (and libggml*); MissingDependencyError (an ImportError) if none."""
    env = os.environ.get("PYMOECACHE_LIB_DIR")
    if env:
        if not (Path(env) / _LIB_NAME).exists():
            raise MissingDependencyError(f"PYMOECACHE_LIB_DIR={env} has no {_LIB_NAME}")
        return Path(env)
    candidates = [_PKG_DIR / "lib"]
    machine = platform.machine().lower()  # x86_64, aarch64, arm64, amd64
    builds = [d for d in (_PKG_DIR.parent / "build").glob("cp*/bin") if d.parent.name.lower().endswith(machine)]
    candidates += sorted(builds,
                         key=lambda p: (p / _LIB_NAME).stat().st_mtime if (p / _LIB_NAME).exists() else 0,
                         reverse=True)
    for d in candidates:
        if (d / _LIB_NAME).exists():
            return d
    raise MissingDependencyError(
        f"pymoecache: no {_LIB_NAME} found (looked in {', '.join(str(c) for c in candidates)}). "
        "Build it with `bash scripts/setup.sh` (or `pip install .`), or set PYMOECACHE_LIB_DIR.")


def load_llama_cpp():
    """Import llama_cpp on our library and return its ctypes handle (a ctypes.CDLL)."""
    lib_dir = find_lib_dir()
    if "llama_cpp" not in sys.modules:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    import llama_cpp.llama_cpp as llama_cpp_capi  # noqa: E402  (must follow the env setting)

    lib = llama_cpp_capi._lib
    if not hasattr(lib, "moecache_abi_version"):
        raise MissingDependencyError(
            f"llama_cpp loaded a libllama without the moecache API ({getattr(lib, '_name', '?')}). "
            "Import pymoecache before llama_cpp, or set LLAMA_CPP_LIB_PATH to "
            f"{lib_dir}.")
    return lib
