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


_ggml = None


def _shared_lib_name(base: str) -> str:
    """``libggml.so`` / ``libggml.dylib`` / ``ggml.dll`` for base ``ggml``."""
    return {"darwin": f"lib{base}.dylib", "win32": f"{base}.dll"}.get(sys.platform, f"lib{base}.so")


def load_ggml():
    """Our libggml (the one libllama uses: its backend registry), with the ggml-backend.h calls the
    package makes declared.

    The symbols are looked up through libllama's own handle: dlsym on a handle searches that library
    and the libraries it was linked with, so they are always those of the libggml that libllama
    loaded. Opening ``lib/libggml.so`` by its path instead would load a second ggml, with its own
    device registry, wherever that file is a copy of the one libllama needs (``libggml.so.0``): an
    installed wheel holds copies, not links, and an RPC server registered there was never seen by
    llama.cpp (issue 41)."""
    global _ggml
    if _ggml is None:
        import ctypes
        from ctypes import c_int, c_size_t, c_void_p

        # the same path llama-cpp-python opens (LLAMA_CPP_LIB_PATH, set by load_llama_cpp): one handle
        ggml = ctypes.CDLL(str(find_lib_dir() / _LIB_NAME), mode=ctypes.RTLD_GLOBAL)
        # GGML_API void ggml_backend_register(ggml_backend_reg_t reg);
        ggml.ggml_backend_register.argtypes = [c_void_p]
        ggml.ggml_backend_register.restype = None
        # GGML_API ggml_backend_dev_t ggml_backend_dev_by_type(enum ggml_backend_dev_type type);
        ggml.ggml_backend_dev_by_type.argtypes = [c_int]
        ggml.ggml_backend_dev_by_type.restype = c_void_p
        # GGML_API size_t ggml_backend_dev_count(void);
        ggml.ggml_backend_dev_count.argtypes = []
        ggml.ggml_backend_dev_count.restype = c_size_t
        # GGML_API ggml_backend_dev_t ggml_backend_dev_get(size_t index);
        ggml.ggml_backend_dev_get.argtypes = [c_size_t]
        ggml.ggml_backend_dev_get.restype = c_void_p
        # GGML_API const char * ggml_backend_dev_description(ggml_backend_dev_t device);
        ggml.ggml_backend_dev_description.argtypes = [c_void_p]
        ggml.ggml_backend_dev_description.restype = ctypes.c_char_p
        # GGML_API enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
        ggml.ggml_backend_dev_type.argtypes = [c_void_p]
        ggml.ggml_backend_dev_type.restype = c_int
        # GGML_API void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
        ggml.ggml_backend_dev_memory.argtypes = [c_void_p, ctypes.POINTER(c_size_t), ctypes.POINTER(c_size_t)]
        ggml.ggml_backend_dev_memory.restype = None
        _ggml = ggml
    return _ggml


# enum ggml_backend_dev_type
GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU = 0, 1, 3


def has_gpu_device() -> bool:
    """ggml has a GPU device now: this build's GPU backends, and the RPC servers registered so far."""
    ggml = load_ggml()
    return any(ggml.ggml_backend_dev_type(ggml.ggml_backend_dev_get(i)) in
               (GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU)
               for i in range(ggml.ggml_backend_dev_count()))
