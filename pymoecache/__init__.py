"""pymoecache: a per-layer expert cache and cache-conditional routing for Mixture-of-Experts
models, running inside a patched llama.cpp.

The native library loads on first use of what needs it (:class:`Llama`, :class:`MoECache`,
:func:`native_version`); configuration, ``model_info``, the simulator and the reference work
without it. Importing pymoecache points llama-cpp-python at our libllama (so import it before
llama_cpp) without loading it.

>>> import pymoecache
>>> pymoecache.parse_routing("prior:0.5")
Prior(strength=0.5, top_j=None)
"""

from __future__ import annotations

import os as _os
import sys as _sys

from ._lib import find_lib_dir as _find_lib_dir
from .config import (CacheConfig, CumsumThreshold, DropRank, MaxRank, Preset, Prior, Prune, SwapRank, TopK,
                     parse_cache_size, parse_routing)
from .errors import (ClosedError, ConcurrentUseError, DeviceLostError, ConfigError, Error, GrammarError, ModelFileError, ModelLoadError,
                     ModelNotFoundError, MoECacheError, MoECacheIOError, StateFileError)
from .model_info import ModelInfo, model_info
from .models import default_model_path
from .stats import MoEStats, ResidencyStats

__version__ = "0.1.0"

# llama-cpp-python reads this when it is first imported, here or by the user: our library, not another
try:
    if "llama_cpp" not in _sys.modules:
        _os.environ["LLAMA_CPP_LIB_PATH"] = str(_find_lib_dir())
except ImportError:  # not built: the error comes, with what to do, when the library is first needed
    pass

_NATIVE = {"Llama": "llama", "MoECache": "llama", "auto_cache_size": "plan", "BatchDecoder": "batch"}


def __getattr__(name: str):
    """Llama and MoECache load the native library on first access (auto_cache_size does not)."""
    if name in _NATIVE:
        import importlib

        value = getattr(importlib.import_module(f".{_NATIVE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pymoecache' has no attribute {name!r}")


def native_version() -> str:
    """Version string of the loaded native library (moecache_version()); loads it."""
    from . import _moecache_cpp as C

    return C.moecache_version().decode()


__all__ = [
    "BatchDecoder", "CacheConfig", "ClosedError", "ConcurrentUseError", "DeviceLostError", "ConfigError", "CumsumThreshold", "DropRank", "Error", "GrammarError", "Llama",
    "MaxRank",
    "MoECache", "MoECacheError", "MoECacheIOError", "MoEStats", "ModelFileError", "ModelInfo", "ModelLoadError",
    "ModelNotFoundError", "Preset", "Prior", "Prune", "ResidencyStats", "StateFileError", "SwapRank", "TopK",
    "auto_cache_size", "default_model_path", "model_info", "native_version", "parse_cache_size", "parse_routing",
]
