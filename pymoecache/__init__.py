"""pymoecache: a per-layer expert cache and cache-conditional routing for Mixture-of-Experts
models, running inside a patched llama.cpp.

Importing pymoecache points llama-cpp-python at our libllama (so import it before llama_cpp)
and checks that the library exports the moecache API.

>>> import pymoecache
>>> pymoecache.parse_routing("prior:0.5")
Prior(strength=0.5, top_j=1)
"""

from . import _moecache_cpp as _C  # loads our libllama through llama_cpp (raises ImportError if it can't)
from .errors import (ConcurrentUseError, ConfigError, Error, ModelFileError, ModelLoadError, ModelNotFoundError,
                     MoECacheError, MoECacheIOError, StateFileError)
from .config import (CacheConfig, CumsumThreshold, DropRank, MaxRank, Prior, Prune, SwapRank, TopK,
                     parse_cache_size, parse_routing)
from .llama import Llama, MoECache, MoEStats, ResidencyStats, auto_cache_size
from .model_info import ModelInfo, model_info
from .models import default_model_path

__version__ = "0.1.0"


def native_version() -> str:
    """Version string of the loaded native library (moecache_version())."""
    return _C.moecache_version().decode()


__all__ = [
    "CacheConfig", "ConcurrentUseError", "ConfigError", "CumsumThreshold", "DropRank", "Error", "Llama", "MaxRank",
    "MoECache", "MoECacheError", "MoECacheIOError", "MoEStats", "ModelFileError", "ModelInfo", "ModelLoadError",
    "ModelNotFoundError", "Prior", "Prune", "ResidencyStats", "StateFileError", "SwapRank", "TopK",
    "auto_cache_size", "default_model_path", "model_info", "native_version", "parse_cache_size", "parse_routing",
]
