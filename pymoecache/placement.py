"""Where a model's tensors go, decided from the cache's configuration and the machine before the load: the
experts llama.cpp keeps in CPU memory (``--n-cpu-moe``, ``-ot``), the cache's fit beside GPU layers and a
VRAM tier, the miss path (a low-bit companion or the full copy) and its pools. ``pymoecache.Llama`` applies
what these decide.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import sys
import warnings
from typing import Optional

from . import _moecache_cpp  # noqa: F401  (first: our libllama, before llama_cpp loads one)
import llama_cpp  # noqa: E402
from . import _lib, config, rpc  # noqa: E402
from . import plan as _plan  # noqa: E402
from .config import INT32_MAX, RESIDENCIES, CacheConfig, ConfigError, Preset, check_int, resolved_top_j  # noqa: E402
from .keywords import check_llama_kwargs  # noqa: E402
from .moecache import MoECache, _as_routing  # noqa: E402
from .plan import AutoCacheSize, auto_cache_size, memory_shortfall  # noqa: E402


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


def batch_slots_shared(gpu_layers: int = 0, lowbit: int = 0, from_memory: bool = True) -> bool:
    """Whether the step slots of a batch (K for each sequence beyond the first) take one MoE layer's memory: on
    Linux every layer maps the same pages there, where the slots are the host's alone (src_cpp/moecache-slots.cpp;
    no GPU layers, whose tiers keep theirs, and no ``lowbit`` pools), and where the cache is sized from memory
    (``from_memory``: "auto" or bytes), which then gets what they would take. Elsewhere, and beside a cache of a
    stated count, every layer has its own, which keep a step's selections the cache does not until the layer's
    next step: more memory, fewer reads for a batch (the trained benchmark model at a quarter, 4 sequences of
    top-k + LRU: 1.28x one at a time with their own, 0.93x shared)."""
    return sys.platform.startswith(("linux", "android")) and not gpu_layers and not lowbit and from_memory


def batch_slot_bytes(info: ModelInfo, n_seq: int, gpu_layers: int = 0, lowbit: int = 0) -> int:
    """Memory of the step slots of ``n_seq`` sequences decoded together (:func:`batch_slots_shared`)."""
    layers = 1 if batch_slots_shared(gpu_layers, lowbit) else info.n_moe_layer
    return int(max(0, n_seq - 1) * info.n_expert_used * info.cache_bytes * layers)


def batch_sequences(info: ModelInfo, n_ctx: int, n_seq: int, available: Optional[int] = None, gpu_layers: int = 0,
                    lowbit: int = 0) -> int:
    """Sequences one decode step computes together (at most ``n_seq``): each beyond the first takes K more step
    slots (Llama(n_seq_max=N); one layer's where the layers share them, :func:`batch_slots_shared`, else every MoE
    layer's), and those may take at most half of the memory free beside the dense part, the KV cache, ``lowbit``
    pools and a token's K slots; the rest is the cache's. A batch of more sequences decodes in steps of this many
    (pymoecache.BatchDecoder), not in slots the memory cannot hold.

    >>> from pymoecache.model_info import ModelInfo
    >>> info = ModelInfo(path="m.gguf", arch="qwen3moe", name="", file_bytes=18 << 30, n_layer=48,
    ...                  moe_layers=list(range(48)), n_expert=128, n_expert_used=8, n_expert_shared=0,
    ...                  gating="softmax", n_expert_groups=0, expert_bytes=2785280,
    ...                  expert_bytes_total=48 * 128 * 2785280, n_embd=2048)
    >>> batch_sequences(info, n_ctx=4096, n_seq=16, available=10 << 30, lowbit=1)   # every layer's: 1 GiB a sequence
    3
    >>> batch_sequences(info, 4096, 16, 40 << 30, lowbit=1), batch_sequences(info, 4096, 256, 8 << 30, lowbit=0)
    (16, 83)
    """
    free = _plan._available_memory() if available is None else available
    dense, kv = _plan._on_host(info, n_ctx, gpu_layers)
    per_seq = max(1, batch_slot_bytes(info, 2, gpu_layers, lowbit))
    own = int(info.n_expert_used * info.cache_bytes * info.n_moe_layer)  # (a token's own K slots)
    room = free - dense - kv - max(0, lowbit) - own
    return int(max(1, min(n_seq, 1 + max(0, room // 2) // per_seq)))


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


@dataclasses.dataclass
class Placement:
    """What :func:`decide` settled before a load, which ``pymoecache.Llama.__init__`` applies."""
    kwargs: dict                 # llama_cpp.Llama's keywords: n_gpu_layers resolved, flash_attn a bool, ours taken out
    cache: CacheConfig           # size, prefetch, VRAM tier, miss path and a preset's eviction resolved
    routing: object              # the Routing (a Preset resolved into one)
    preset: object               # the Preset that was resolved, or None
    choice: Optional[AutoCacheSize]  # what size="auto" chose and why; None for a stated size
    residency: str               # "stream", "mmap" or "none": how llama.cpp loads the experts
    native: object               # the cache's native parameters (MoECache.for_model); None for a dense model
    n_seq_max: int               # sequences decoded together (llama.cpp's n_seq_max)
    n_seq_step: int              # of those, how many one decode step computes together (their slots fit in memory)
    fa_type: Optional[int]       # LLAMA_FLASH_ATTN_TYPE_AUTO for flash_attn="auto", else None (llama-cpp-python's)
    devices: Optional[list]      # the devices to load onto where an RPC server is gone; None: every device
    overrides: object            # llama.cpp's tensor_buft_overrides (n_cpu_moe, override_tensor), or None
    rpc_used: list               # the RPC servers whose devices take this model's layers
    eviction_decay: float        # the user's decay: what a preset without one keeps
    device_note: str             # what the GPUs' free memory decided (fit_device), for the plan line
    plan_gpu: tuple              # (layers whose dense part is on a GPU, MoE layers whose experts llama.cpp put there)
    plan_inputs: Optional[tuple]  # (experts cached, spare slots, memory free before the load, low-bit pools or None)
    share_steps: bool = True      # the layers may share a batch's step slots (a cache sized from memory)
    repack: bool = True           # llama.cpp's repacked layouts for the dense part (False: --no-repack)


def decide(model_path: str, info, cache, routing, routing_scope: str, kwargs: dict) -> Placement:
    """Where the tensors of ``model_path`` (its :func:`model_info` ``info``) go and how its cache is made, from
    ``Llama``'s arguments and the machine: every parameter checked before a byte of weights is read. Warns
    about what it leaves out (a tier without GPU layers, a cache that leaves no room)."""
    kwargs = dict(kwargs)
    native, plan_gpu, plan_inputs = None, (0, 0), None
    repack = kwargs.pop("repack", True)
    if not isinstance(repack, bool):
        raise ConfigError(f"repack must be True (llama.cpp's repacked layouts where the CPU has them) or False "
                          f"(llama-cli's --no-repack: the weights as the file has them), got {repack!r}")
    # llama-cli's --n-cpu-moe and -ot (=CPU): tensor buffer overrides, which llama-cpp-python does not take
    overrides = buffer_overrides(cpu_patterns(kwargs.pop("n_cpu_moe", None), kwargs.pop("override_tensor", None),
                                              info.n_layer))
    choice: Optional[AutoCacheSize] = None
    cache = as_cache(cache)
    if isinstance(routing, str):
        routing = config.parse_routing(routing)  # (config's name: what the routing tests count)
    if routing is None:  # the default: a preset (top-k where every expert is cached)
        routing = Preset.default_for(cache)
    preset = routing if isinstance(routing, Preset) else None  # resolved below, once the size is known
    eviction_decay = float(cache.eviction_decay)  # the user's: what a preset without a decay keeps
    if preset is None:
        routing = _as_routing(routing)
    check_llama_kwargs(kwargs)
    # flash attention: llama-cpp-python takes a bool; 'auto' is llama.cpp's own choice (llama-cli's default),
    # set on the context's parameters as the context is made
    flash_attn = kwargs.get("flash_attn", False)
    if isinstance(flash_attn, str):
        kwargs["flash_attn"] = flash_attn == "on"
    fa_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO if flash_attn == "auto" else None
    # sequences decoded together (pymoecache.BatchDecoder): llama.cpp's n_seq_max, one KV cache for all of them
    n_seq_max = kwargs.pop("n_seq_max", 1)
    check_int("n_seq_max", n_seq_max, 1, 256)
    n_seq_max = int(n_seq_max)
    n_batch = kwargs.get("n_batch", 512)  # (llama-cpp-python's default, which it cuts to n_ctx)
    if 0 < kwargs.get("n_ctx", 512) < n_batch:
        n_batch = kwargs.get("n_ctx", 512)
    if n_seq_max > n_batch:  # (llama.cpp would abort: a step's outputs, one per sequence, beyond n_batch)
        raise ConfigError(f"n_batch ({n_batch}) must be at least n_seq_max ({n_seq_max}): a batched step "
                          "decodes one token of every sequence (serve: -b at least -np)")
    asked = []
    if kwargs.get("rpc_servers") is not None:  # their devices exist for llama.cpp before it loads
        asked = rpc.parse_endpoints(kwargs.pop("rpc_servers"))
        for endpoint in asked:
            rpc.add_server(endpoint)
    # llama.cpp asks every registered device for its memory at load, and ggml aborts on a server that
    # is gone (it cannot unregister one): a load then names the devices that are still there
    gone = rpc.gone_servers() if rpc.servers() else []
    for endpoint in asked:
        if endpoint in gone:
            raise ConfigError(f"rpc server {endpoint} is gone: " + (
                "a model of this process lost it, and ggml keeps that dead connection; load in a new process"
                if rpc.was_lost(endpoint) else "start it at that address again, or load in a new process"))
    devices = rpc.live_devices(gone) if gone else None
    if gone and kwargs.get("n_gpu_layers"):
        warnings.warn(f"rpc server {gone[0]} is gone: its device is left out of this load"
                      + ("" if devices else " (no GPU device is left: the layers stay on the CPU)"), stacklevel=3)
    n_ctx = int(kwargs.get("n_ctx", 512) or info.n_ctx_train or 512)  # (the context the plans count the KV of)
    if kwargs.get("n_gpu_layers") == "auto":  # llama.cpp's -ngl auto: the layers whose dense part fits the GPUs
        free = _plan.device_free_memory(devices) if _plan.has_gpu() else None
        kwargs["n_gpu_layers"] = _plan.auto_gpu_layers(info, n_ctx, free)
        if free and not kwargs["n_gpu_layers"]:
            warnings.warn(f"n_gpu_layers=auto: no layer fits in the {_plan._mib(free)} free on the GPU (less "
                          f"a {_plan._mib(_plan.DEVICE_MARGIN)} margin): every layer stays on the CPU", stacklevel=3)
    # the servers whose devices take this model's layers: each decode first checks that they are there
    rpc_used = [e for e in rpc.servers() if e not in gone] if kwargs.get("n_gpu_layers") else []
    residency = "none"
    device_note = ""  # what the GPUs' free memory decided (fit_device), for the plan line
    if info.is_moe and cache.vram_size != "auto" and cache.vram_size > info.n_expert:
        raise ConfigError(f"vram_size={cache.vram_size}: the model has {info.n_expert} experts per layer; a VRAM "
                          f"tier holds at most that many")
    n_seq_step = n_seq_max  # sequences a decode step computes together (fewer where their slots do not fit)
    share_steps = isinstance(cache.size, str)  # sized from memory ("auto", bytes): the layers share the step slots
    if info.is_moe:  # check the parameters before spending time on loading weights
        if cache.size == "auto":
            n_gpu_auto = _plan.gpu_layers(kwargs.get("n_gpu_layers"), info.n_layer)
            low_auto = lowbit_pool_bytes(cache, info, str(model_path))
            if n_seq_max > 1:
                n_seq_step = batch_sequences(info, n_ctx, n_seq_max, gpu_layers=n_gpu_auto, lowbit=low_auto)
                if n_seq_step < n_seq_max:
                    slots = batch_slot_bytes(info, n_seq_max, n_gpu_auto, low_auto)
                    warnings.warn(f"n_seq_max={n_seq_max}: the slots of {n_seq_max} sequences decoded together "
                                  f"({_plan._mib(slots)}) do not fit in the memory free ({_plan._free_source()}): a "
                                  f"step decodes at most {n_seq_step} of them together, the others in the steps after",
                                  stacklevel=3)
            choice = auto_cache_size(info, n_ctx, gpu_layers=n_gpu_auto, lowbit=low_auto,
                                     batch=batch_slot_bytes(info, n_seq_step, n_gpu_auto, low_auto))
            if choice.lowbit and choice.lowbit > choice.available - choice.dense - choice.kv:
                raise ConfigError(
                    f"the low-bit pools need {choice.lowbit / 2**20:.0f} MiB (" + (
                        "lowbit_in_ram keeps every expert's low-bit copy in memory" if cache.lowbit_in_ram else
                        "K + 1 low-bit copies per layer") + f"), more than the "
                    f"{max(0, choice.available - choice.dense - choice.kv) / 2**20:.0f} MiB free beside the dense part "
                    "and the KV cache: the process would be killed for memory" + (
                        "; leave lowbit_in_ram (--lowbit-in-ram) off" if cache.lowbit_in_ram else ""))
            cache = dataclasses.replace(cache, size=choice.n_cached)
            if choice.fit < info.n_expert_used and choice.left < (64 << 20) and cache.lock_dense:
                # less memory than the dense part, the KV cache and a token's K slots: locked, the dense part would
                # leave the runtime nothing and the process would be killed; unlocked, the OS pages it as it pages
                # stock llama.cpp's mapping (slow, but the run goes on)
                warnings.warn(f"{choice.available / 2**20:.0f} MiB free ({choice.source}) holds less than the dense "
                              f"part ({choice.dense / 2**20:.0f} MiB), the KV cache and the {info.n_expert_used} "
                              "slots a token needs: the dense part is not locked, so the OS may page it (slow); "
                              "free memory or use a smaller context", stacklevel=3)
                cache = dataclasses.replace(cache, lock_dense=False)
        if cache.vram_size and cache.residency not in ("auto", "stream"):
            raise ConfigError(f"vram_size={cache.vram_size} needs residency 'stream' (its GPU slots are filled "
                              f"from the streamed cache's host slots), not {cache.residency!r}")
        n_gpu = _plan.gpu_layers(kwargs.get("n_gpu_layers"), info.n_layer)
        gpu = n_gpu > 0
        if cache.vram_size and not gpu:
            warnings.warn(f"vram_size={cache.vram_size} ignored: no layer is on a GPU (n_gpu_layers / -ngl, "
                          "with a GPU or an RPC server)", stacklevel=3)
            cache = dataclasses.replace(cache, vram_size=0, vram_exclusive=False)
        gpu_free = _plan.device_free_memory(devices) if gpu else None  # (the discrete GPUs'; None: none)
        asked_cache = cache
        fit = functools.partial(fit_device, info=info, n_gpu=n_gpu, free=gpu_free,
                                       placed_by_us=overrides is None, n_ctx=n_ctx, size_stated=choice is None)
        cache, device_note = fit(cache)
        if cache.prefetch == "auto":  # stream: gate into spare slots, taken out of a memory budget
            n = cache.n_cached_for(info.n_expert, info.cache_bytes, info.n_moe_layer)
            cache = cache.resolve_prefetch(cache.residency_for(cache.capacities(n), info.n_expert), n, info.n_expert_used,
                                           from_memory=choice is not None or isinstance(cache.size, str),
                                           n_expert=info.n_expert)
            if choice is not None and cache.size != choice.n_cached:
                choice = dataclasses.replace(choice, n_cached=cache.size, spare=cache.prefetch_spare)
            if device_note and cache.n_cached_for(info.n_expert, info.cache_bytes, info.n_moe_layer) < n:
                # the spare slots came out of the cache the GPU's tier was sized beside: sized again (and said)
                # for the cache that is left, so an exclusive tier also takes the experts they leave
                refit, device_note = fit(dataclasses.replace(asked_cache, size=cache.size))
                cache = dataclasses.replace(cache, vram_size=refit.vram_size, vram_exclusive=refit.vram_exclusive)
        n = cache.n_cached_for(info.n_expert, info.cache_bytes, info.n_moe_layer)
        residency = cache.residency_for(cache.capacities(n), info.n_expert)
        # llama.cpp places the experts (residency none, no placement flag): the GPU layers' are on a discrete GPU
        placed = residency == "none" and overrides is None and gpu_free is not None
        plan_gpu = (n_gpu, _plan.moe_layers_on_gpu(info, n_gpu) if placed else 0)
        if choice is not None and plan_gpu[1]:
            choice = dataclasses.replace(choice, n_cached=max(n, choice.n_cached), gpu_expert_layers=plan_gpu[1])
        if cache.vram_exclusive and residency == "stream" and n >= info.n_expert:
            warnings.warn(f"vram_exclusive ignored: the cache holds every expert ({n} of {info.n_expert} per layer), "
                          "so the VRAM tier copies part of it", stacklevel=3)
        if cache.unified == "on" and residency != "stream":
            if cache.residency != "auto":
                raise ConfigError(f"unified='on' needs residency 'stream' (the GPU computes on its host slots), "
                                  f"not {residency!r}")
            warnings.warn(f"unified='on' ignored: every expert fits in memory (residency '{residency}'), and "
                          f"with n_gpu_layers llama.cpp places them itself", stacklevel=3)
            cache = dataclasses.replace(cache, unified="auto")
        cache, companion = resolve_miss(cache, residency, str(model_path), gpu=gpu)
        if preset is not None:  # routing and eviction from the model's K and the share each tier holds
            ratio = companion.ratio if companion is not None and cache.miss == "lowbit-cache" else 1.0
            held = (cache, slots_with_companion(n, ratio, info.n_expert), info.n_expert,
                    slots_with_companion(cache.vram_size, ratio, info.n_expert))
            routing, eviction, decay = preset.resolve_all(info.n_expert_used, routing_share(*held),
                                                          prefers_device(*held))
            cache = dataclasses.replace(cache, eviction=eviction,
                                        eviction_decay=cache.eviction_decay if decay is None else decay)
        plan_inputs = (n, cache.prefetch_spare, choice.available if choice is not None else
                             _plan._available_memory(),  # before the load takes its share
                             (cache, companion.expert_bytes, companion_name(companion))
                             if companion is not None else None)
        if residency == "stream" and choice is None:
            short = memory_shortfall(info, n, n_ctx, cache.prefetch_spare,
                                     lowbit=lowbit_pool_bytes(cache, info, str(model_path)),
                                     gpu_layers=_plan.gpu_layers(kwargs.get("n_gpu_layers"), info.n_layer))
            if short:
                warnings.warn(f"cache size {cache.size} leaves no room: {short}. The OS will drop the dense "
                              "part or the runtime's pages and read them back every token (or end the process); "
                              "use cache size 'auto' (--cache-size auto) or a smaller one", stacklevel=3)
        top_j = resolved_top_j(routing, info.n_expert_used)
        if top_j > info.n_expert_used:
            raise ConfigError(f"top_j = {top_j} is larger than the model's K = {info.n_expert_used} experts per token")
        if residency != "none" and kwargs.get("use_mmap", True) is False:
            raise ConfigError(f"residency '{residency}' reads the experts through the file's mapping: not mapping "
                              "the model (--no-mmap, use_mmap=False) works only with residency 'none' (--residency "
                              "none), where the whole model is loaded")
        if residency != "none" and kwargs.pop("use_mlock", False):
            # llama.cpp's mlock would lock every expert of the mapping: here it means what the cache
            # locks, the dense part and the cached experts (the rest is not meant to be in memory)
            cache = dataclasses.replace(cache, lock_memory=True, lock_dense=True)
        # the native parameters, once, from the values resolved above (MoECache.for_model takes them)
        native = MoECache._params(info.n_expert, cache, routing, routing_scope, info.cache_bytes,
                                  info.n_moe_layer, model_path=str(model_path), n_expert_used=info.n_expert_used,
                                  n_seq=n_seq_step, share_steps=share_steps)
    return Placement(kwargs=kwargs, cache=cache, routing=routing, preset=preset, choice=choice, residency=residency,
                     native=native, n_seq_max=n_seq_max, n_seq_step=n_seq_step, fa_type=fa_type, devices=devices,
                     overrides=overrides, rpc_used=rpc_used, eviction_decay=eviction_decay, device_note=device_note,
                     plan_gpu=plan_gpu, plan_inputs=plan_inputs, share_steps=share_steps,
                     repack=repack)


@contextlib.contextmanager
def applied_to_load(p: Placement):
    """For the duration of a load (one at a time: ``Llama``'s lock), what llama-cpp-python's load lacks: the
    experts' residency (stream and mmap keep the file's layout and read nothing at load), a device list and
    buffer overrides on the model's parameters, flash attention "auto" and n_seq_max on the context's, and a
    chat formatter that lets a model with a broken template load (:func:`templates.tolerant_formatter`)."""
    from . import _moecache_cpp as C
    from .templates import tolerant_formatter

    C.moecache_set_load_residency(RESIDENCIES[p.residency])
    formatter = llama_cpp.llama_chat_format.Jinja2ChatFormatter
    llama_cpp.llama_chat_format.Jinja2ChatFormatter = tolerant_formatter()
    default_params = llama_cpp.llama_cpp.llama_model_default_params
    context_class = llama_cpp._internals.LlamaContext
    if p.fa_type is not None or p.n_seq_max > 1:
        llama_cpp._internals.LlamaContext = functools.partial(_context_with, context_class, p)
    if p.devices is not None or p.overrides is not None or not p.repack:
        # llama.cpp's model params have a devices list, buffer overrides and use_extra_bufts (the repacked
        # layouts) llama-cpp-python leaves unset
        dev_list = (ctypes.c_void_p * (len(p.devices) + 1))(*p.devices, None) if p.devices is not None else None
        llama_cpp.llama_cpp.llama_model_default_params = functools.partial(_params_with, default_params, dev_list,
                                                                           p.overrides, p.repack)
    try:
        yield
    finally:
        C.moecache_set_load_residency(C.MOECACHE_RESIDENCY_NONE)
        llama_cpp.llama_chat_format.Jinja2ChatFormatter = formatter
        llama_cpp.llama_cpp.llama_model_default_params = default_params
        llama_cpp._internals.LlamaContext = context_class


def _context_with(context_class, p: Placement, *, params, **kw):
    if p.fa_type is not None:
        params.flash_attn_type = p.fa_type
    params.n_seq_max = p.n_seq_max
    params.kv_unified = p.n_seq_max > 1  # (every sequence may use the whole n_ctx, as llama-server's)
    return context_class(params=params, **kw)


def _params_with(default_params, dev_list, overrides, repack=True):
    params = default_params()
    params.use_extra_bufts = repack
    if dev_list is not None:
        params.devices = ctypes.cast(dev_list, ctypes.c_void_p)
    if overrides is not None:
        params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
    return params


def loaded_plan(p: Placement, info, n_ctx: int, moecache):
    """The :class:`plan.MemoryPlan` of a model loaded with ``p`` (``Llama.memory_plan``): the memory free before the
    load, what each part takes, the low-bit pools and the VRAM tier as the library made them. None for a dense model."""
    if p.plan_inputs is None:
        return None
    n_cached, spare, available, low = p.plan_inputs
    n_gpu, on_gpu = p.plan_gpu
    out = _plan.memory_plan(info, n_ctx, n_cached, n_spare=spare, available=available, gpu_layers=n_gpu)
    pools = low is not None and low[0].miss != "lowbit-cache"
    out = dataclasses.replace(out, budget_from=_plan._free_source(), gpu_expert_layers=on_gpu,
                              n_batch=(p.n_seq_step - 1) * info.n_expert_used,
                              batch_shared=batch_slots_shared(n_gpu, int(pools), p.share_steps))
    if low is not None:  # the low-bit miss path: its pools, and the bytes a miss reads from it
        low, low_bytes, low_name = low
        out = dataclasses.replace(out, miss=low.miss, lowbit_in_ram=low.lowbit_in_ram, lowbit_bytes=low_bytes,
                                  lowbit_name=low_name)
        if low.miss == "lowbit-cache" and moecache is not None:  # the slots hold the copies: as many as fit
            n_cached = int(moecache.stats().capacity_per_layer.max())
            out = dataclasses.replace(out, n_cached=n_cached, slot_bytes=low_bytes, expert_bytes=low_bytes)
    if moecache is not None:  # the VRAM tier, as the library made it
        rs = moecache.residency_stats()
        out = dataclasses.replace(out, n_vram=rs.vram_slots, vram_bytes=rs.vram_bytes,
                                  vram_exclusive=rs.vram_exclusive_layers > 0, exclusive_layers=rs.vram_exclusive_layers,
                                  device_note=p.device_note)
    return out
