"""Where a model's tensors go, decided from the cache's configuration and the machine before the load: the
experts llama.cpp keeps in CPU memory (``--n-cpu-moe``, ``-ot``), the cache's fit beside GPU layers and a
VRAM tier, the miss path (a low-bit companion or the full copy) and its pools. ``pymoecache.Llama`` applies
what these decide.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import warnings
from typing import Optional

from . import _lib
from . import plan as _plan
from .config import INT32_MAX, CacheConfig, ConfigError, check_int


def cpu_patterns(n_cpu_moe, override_tensor, n_layer: int) -> list:
    r"""The tensor-name patterns llama.cpp's buffer overrides keep in CPU memory: the routed experts of
    the first ``n_cpu_moe`` layers ("all": every layer; llama-cli's --n-cpu-moe / --cpu-moe) and each
    ``PATTERN=CPU`` of ``override_tensor`` (llama-cli's -ot; another buffer type is a ConfigError).

    >>> cpu_patterns(2, "attn_q=CPU", 4)
    ['blk\\.0\\.ffn_(up|down|gate|gate_up)_exps', 'blk\\.1\\.ffn_(up|down|gate|gate_up)_exps', 'attn_q']
    """
    if n_cpu_moe == "all":
        n_cpu_moe = n_layer
    if n_cpu_moe is not None:
        check_int("n_cpu_moe", n_cpu_moe, 0, INT32_MAX)
    out = [rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_exps" for i in range(min(n_cpu_moe or 0, n_layer))]
    if override_tensor is not None:
        from .config import parse_override_tensor

        try:
            out += parse_override_tensor(override_tensor)
        except ConfigError as e:
            raise ConfigError(f"override_tensor {e}") from None
    return out


def buffer_overrides(patterns: list):
    """llama.cpp's ``tensor_buft_overrides`` keeping the tensors ``patterns`` match in CPU memory: a
    NULL-terminated array of ``struct llama_model_tensor_buft_override`` (None for no pattern)."""
    if not patterns:
        return None

    class Override(ctypes.Structure):  # struct llama_model_tensor_buft_override {const char * pattern; buft}
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    ggml = _lib.load_ggml()
    # GGML_API ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
    ggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    cpu = ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_by_type(_lib.GGML_BACKEND_DEVICE_TYPE_CPU))
    return (Override * (len(patterns) + 1))(*[Override(p.encode(), cpu) for p in patterns], Override(None, None))


def as_cache(cache) -> CacheConfig:
    """``cache=``: a CacheConfig, or what ``--cache-size`` takes (30, 0.25, "25%", "3GiB", "auto")."""
    if cache is None:
        return CacheConfig()
    if isinstance(cache, CacheConfig):
        return cache
    if isinstance(cache, str):
        from .config import parse_cache_size

        return CacheConfig(size=parse_cache_size(cache))
    if isinstance(cache, (int, float)) and not isinstance(cache, bool):
        if cache == 0:  # (the CLI's --cache-size 0, with its message)
            from .config import parse_cache_size

            parse_cache_size("0")
        return CacheConfig(size=cache)
    raise ConfigError(f"cache must be a pymoecache.CacheConfig or a cache size (30, 0.25, '25%', '3GiB', 'auto'), "
                      f"got {cache!r}")


def routing_share(cache: CacheConfig, n_cached: int, n_expert: int, n_vram: Optional[int] = None) -> float:
    """The share of experts the routing prefers, which a preset is resolved for: the cache's, or where
    a streamed cache holds every expert and a VRAM tier some, the tier's (the routing then prefers the
    experts in device memory: src_cpp/moecache-route.cpp). n_cached and n_vram: the experts per layer
    each tier holds (default n_vram: ``cache.vram_size``; with a companion, the copies that fit:
    :func:`slots_with_companion`).

    >>> routing_share(CacheConfig(size=1.0, residency="stream", vram_size=15), 60, 60)
    0.25
    >>> routing_share(CacheConfig(size=45, vram_size=15, vram_exclusive=True), 45, 60)  # exclusive: 45 + 15
    0.25
    >>> routing_share(CacheConfig(size=1.0, residency="stream", vram_size=2), 8, 8, n_vram=3)  # Q8_0 copies
    0.375
    """
    n_vram = cache.vram_size if n_vram is None else n_vram
    if prefers_device(cache, n_cached, n_expert, n_vram):
        return min(n_vram, n_expert) / n_expert
    if cache.vram_exclusive:  # the two tiers are the cache the routing sees
        return min(n_cached + n_vram, n_expert) / n_expert
    return min(n_cached, n_expert) / n_expert


def fit_device(cache: CacheConfig, info, n_gpu: int, free, placed_by_us: bool, n_ctx: int, size_stated: bool):
    """Where the experts of GPU layers go. A tier stated: the cache streams (a tier is filled from its
    host slots). Where nothing says where they go (residency "auto", no tier or ``vram_size="auto"``,
    no llama.cpp placement flag: ``placed_by_us``), the GPUs' ``free`` memory is spent on them
    (:func:`plan.device_fit`): every expert on the GPU where they fit (residency none; with MoE layers
    left on the CPU, only where RAM holds all of theirs); else RAM keeps what the cache holds and a VRAM
    tier takes what fits: copies where RAM holds every expert, others (exclusive tiers) where it holds
    fewer, a model larger than RAM. A stated cache size or tier
    (``size_stated``, ``vram_size="auto"``) keeps the RAM cache. Also the line the plan says it in
    ("" where nothing was decided here)."""
    asked = cache.vram_size == "auto"
    if n_gpu and cache.vram_size and not asked:  # a tier stated: the cache streams, also where it holds every
        # expert (auto would be 'none', llama.cpp putting them all on the GPU): the seeds' scenario, each in the
        # cache's host slots, the hot ones in the tier, the routing steered to them
        return (dataclasses.replace(cache, residency="stream") if cache.residency == "auto" else cache), ""
    if not n_gpu or cache.unified == "on" or not (asked or (placed_by_us and cache.residency == "auto")):
        return cache, ""
    n = cache.n_cached_for(info.n_expert, info.cache_bytes, info.n_moe_layer)
    fit = _plan.device_fit(info, n_ctx, n_gpu, free, n, keep_ram=size_stated or asked)
    room = (f"the {_plan._mib(free)} free on the GPU (less a {_plan._mib(_plan.DEVICE_MARGIN)} margin, the dense "
            f"part and the KV cache of {n_gpu} layers)" if free else "the GPU, which reports no free memory")
    if asked:  # (every expert cached and fitting the GPU: a tier of them all, as asked)
        n_vram = info.n_expert if fit.residency == "none" else fit.n_vram
        if not n_vram:
            warnings.warn(f"vram_size=auto: no VRAM tier, no expert fits in {room}", stacklevel=3)
        return (dataclasses.replace(cache, vram_size=n_vram, residency="stream" if n_vram else cache.residency,
                                    vram_exclusive=fit.exclusive or (cache.vram_exclusive and bool(n_vram))),
                f"VRAM tier sized to {room}" + (f": {fit.where}" if fit.exclusive else "") if n_vram else "")
    if fit.residency == "none":
        if n >= info.n_expert:
            return cache, ""  # (llama.cpp puts every one on the GPU, as it would without us)
        return (dataclasses.replace(cache, size=info.n_expert),
                f"the experts fit in {room}: {fit.where}; --residency stream keeps them in RAM")
    if n >= info.n_expert:
        return (dataclasses.replace(cache, residency="stream", vram_size=fit.n_vram),
                f"the experts do not fit in {room}: {fit.where} (--residency none: all on the GPU)")
    if not fit.n_vram:
        return cache, ""  # (the cache streams and the GPU has no room for an expert: as without a GPU)
    return (dataclasses.replace(cache, residency="stream", vram_size=fit.n_vram, vram_exclusive=True),
            f"the cache holds fewer than every expert: the tier holds others, sized to {room} (--residency stream: "
            "no tier)")


def prefers_device(cache: CacheConfig, n_cached: int, n_expert: int, n_vram: int) -> bool:
    """Host memory holds every expert (the streamed cache, or with exclusive tiers the two together) and
    a VRAM tier some: the routing's preference is then for the device (a selection outside the tier is
    computed on the CPU, nothing is read), which a preset is resolved for (``Preset(device_tier=)``).

    >>> prefers_device(CacheConfig(size=1.0, residency="stream", vram_size=15), 60, 60, 15)
    True
    >>> prefers_device(CacheConfig(size=30, residency="stream", vram_size=15), 30, 60, 15)
    False
    """
    return bool(n_vram) and ((cache.residency == "stream" and n_cached >= n_expert) or
                             (cache.vram_exclusive and n_cached < n_expert <= n_cached + n_vram))


def slots_with_companion(n: int, ratio: float, n_expert: int) -> int:
    """Experts per layer that n slots of full experts hold as a companion's copies (lowbit-cache: as
    many as fit in the same bytes, as src_cpp/moecache-lowbit.cpp sizes the host slots and the VRAM
    tier).

    >>> slots_with_companion(2, 1.88, 8), slots_with_companion(2, 2.91, 8), slots_with_companion(6, 2.91, 8)
    (3, 5, 8)
    """
    return min(n_expert, max(int(n * ratio), n)) if n else 0


def resolve_miss(cache: CacheConfig, residency: str, model_path: str, gpu: bool = False):
    """CacheConfig.miss made explicit for this model, and the companion checked for it (None for
    "full"): "auto" (and None, the default) becomes "lowbit-cache" where a usable companion is
    found ("lowbit" with lowbit_in_ram), else "full": said once with the reason for "auto",
    quietly for the default unless a companion is there but unusable. gpu: the model has GPU
    layers: there only lowbit-cache runs (the host slots, a VRAM tier and unified memory hold the
    companion's copies), the per-miss pools stay on the CPU only. ConfigError / CompanionError for a
    mode that cannot run."""
    miss = cache.miss or "auto"
    if miss == "full":
        if cache.lowbit is not None:
            raise ConfigError("lowbit= names a companion, which only miss='lowbit', 'lowbit-all', 'lowbit-cache' "
                              "or 'auto' reads")
        return dataclasses.replace(cache, miss="full"), None
    from . import lowbit as lb

    full = dataclasses.replace(cache, miss="full", lowbit_in_ram=False)
    if residency != "stream":
        if miss == "auto" and cache.lowbit is None:
            beside = lb.companions_beside(model_path)
            if beside:  # said once, at load: the file is there and does nothing this time
                warnings.warn(f"the low-bit companion {beside[0].name} is not used: every expert fits in memory at "
                              "full precision (residency none)", stacklevel=3)
            return full, None
        raise ConfigError(f"miss={miss!r} computes streamed experts from their low-bit copies: it needs "
                          f"residency 'stream', not {residency!r}")
    device = cache.vram_size or cache.unified == "on" or gpu
    if device and (miss in ("lowbit", "lowbit-all") or (miss == "auto" and cache.lowbit_in_ram)):
        if miss == "auto" and cache.lowbit is None:
            return full, None
        raise ConfigError(f"miss={miss!r} with GPU layers, a VRAM tier (vram_size) or unified memory is not "
                          "supported yet (miss='lowbit-cache' is: the slots, the GPU's copies and the experts "
                          "computed in place all hold the companion's)")
    if cache.miss is None and cache.lowbit is None and not lb.default_path(model_path).exists():
        return full, None  # (the default, and no companion beside the model: nothing to say)
    try:
        companion = lb.check_companion(model_path, cache.lowbit)
    except lb.CompanionError as e:
        if miss != "auto" or cache.lowbit is not None:
            raise
        warnings.warn(f"miss='auto': {e}; misses are read at full precision", stacklevel=3)
        return full, None
    # auto: where the plain alternative (every expert at the low type, more of them cached in the same
    # memory) beats the miss path, and it did on every measured model (docs/results.md), the cache holds
    # the companion's copies
    miss = ("lowbit" if cache.lowbit_in_ram else "lowbit-cache") if miss == "auto" else miss
    cache = dataclasses.replace(cache, miss=miss, lowbit=companion.path)
    if miss == "lowbit-all" and cache.prefetch != "off":  # no full copy is read while decoding: nothing ahead
        cache = dataclasses.replace(cache, prefetch="off", prefetch_spare=0)
    return cache, companion


def companion_name(companion) -> str:
    """'NAME (its experts at TYPES)' for the plan line: the file in use and the types llama.cpp made,
    its fallbacks included (a "Q4_K" companion of 64-wide rows holds Q5_0)."""
    types = "/".join(sorted(companion.types)) if companion.types else companion.type
    return f"{os.path.basename(str(companion.path))} (experts at {types})"


def lowbit_pool_bytes(cache: CacheConfig, info, model_path: str) -> int:
    """The low-bit pools decoding will hold beside the cache, for the automatic size: miss "lowbit" or
    "lowbit-all" (and "auto" with lowbit_in_ram, which becomes "lowbit") keep K + 1 companion copies per
    MoE layer, N + 1 with lowbit_in_ram; lowbit-cache (the default with a companion) and full precision
    keep none. 0 where no usable companion is found (resolve_miss then says why)."""
    miss = cache.miss or "auto"
    if miss not in ("lowbit", "lowbit-all") and not (miss == "auto" and cache.lowbit_in_ram):
        return 0
    from . import lowbit as lb

    try:
        companion = lb.check_companion(model_path, cache.lowbit)
    except (lb.CompanionError, OSError):
        return 0
    slots = (info.n_expert if cache.lowbit_in_ram else info.n_expert_used) + 1
    return int(slots * companion.expert_bytes * info.n_moe_layer)
